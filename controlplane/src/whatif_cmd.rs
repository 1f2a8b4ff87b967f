//! `keel whatif`: a data directory's recorded history run through the
//! simulator under the policies that decided (`recorded`, validated
//! against what happened) and under others ([`keel_sim::history`],
//! [`keel_sim::whatif`]).

use std::io::Write;
use std::path::PathBuf;

use anyhow::Context;
use keel_scheduling::policy::{Policy, PolicyOptions, QueueOptions};
use keel_sim::history::{History, RecordedEnd, RecordedWorkload, Recorder};
use keel_sim::whatif::{summarise, validate, RunSummary, Validation};
use keel_sim::{self as sim, SimConfig, SimReport};
use serde::Serialize;

use crate::render::{print_json, print_table, Output};

/// The name of the run that replays the policies the log says decided.
const RECORDED: &str = "recorded";

#[derive(clap::Args, Debug)]
pub struct WhatifArgs {
    /// A stopped replica's data directory (or a copy of one).
    #[arg(long, required_unless_present = "from", conflicts_with = "from")]
    data_dir: Option<PathBuf>,
    /// A snapshot file (`keel snapshot save`) instead of a data directory:
    /// its jobs as their records keep them (submission, end, the speeds
    /// their performance history measured, the GPU time they held), its
    /// nodes, and the policy that decided last. A snapshot keeps no
    /// history of node losses or earlier policies, and a job that
    /// reported no progress has no measured speed; the report says how
    /// many were measured.
    #[arg(long, value_name = "SNAPSHOT_FILE", conflicts_with = "until_time")]
    from: Option<PathBuf>,
    /// Policies to run the history through, e.g. `fifo,tiresias`.
    /// `recorded` (the policies that decided, as the log names them, each
    /// from its first decision) always runs first: its error on the
    /// history is reported before any other run.
    #[arg(long, value_delimiter = ',', default_value = RECORDED)]
    policy: Vec<String>,
    /// Run on these nodes instead of the recorded ones (`keel sim`'s
    /// cluster file: `- {gpu_type: a100, gpus: 8, count: 4}`), and its
    /// queues if it has any (else the recorded ones); the recorded node
    /// losses are not replayed then.
    #[arg(long)]
    cluster_file: Option<PathBuf>,
    /// Only the jobs submitted at or after this time (RFC 3339); jobs
    /// submitted before are left out, even those still running then.
    #[arg(long)]
    from_time: Option<String>,
    /// The history up to the last entry stamped at or before this time
    /// (RFC 3339).
    #[arg(long)]
    until_time: Option<String>,
    /// Seconds between scheduling rounds, as the server's `--round-s`.
    #[arg(long, default_value_t = 10.0)]
    round_s: f64,
    /// A running job reports progress at least this often (seconds), as
    /// the server's `--progress-interval-s`.
    #[arg(long, default_value_t = 2.0)]
    progress_interval_s: f64,
    /// Seconds without progress each time a job (re)starts on an
    /// allocation.
    #[arg(long, default_value_t = 0.0)]
    restart_s: f64,
    /// Let jobs behind a blocked head of the queue start when they fit.
    #[arg(long)]
    backfill: bool,
    #[command(flatten)]
    tiresias: crate::TiresiasArgs,
    /// Write one CSV row per job and run: the recorded JCT and each run's.
    #[arg(long)]
    jobs_csv: Option<PathBuf>,
    /// Write figures here as SVG (JCT CDF per run, utilisation and queue
    /// length over time), as `keel sim --plot`.
    #[arg(long)]
    plot: Option<PathBuf>,
}

/// What the log holds, as the report shows it.
#[derive(Debug, Serialize)]
struct HistorySummary {
    first_index: u64,
    last_index: u64,
    entries: u64,
    state_hash: String,
    jobs: usize,
    succeeded: usize,
    failed: usize,
    cancelled: usize,
    unfinished: usize,
    nodes: usize,
    gpus: u32,
    node_changes: usize,
    span_s: f64,
    /// The policies that decided, each from its first decision (seconds
    /// after the first submission).
    policies: Vec<PolicyFrom>,
    /// Jobs with at least one speed measured, and the figures (job × GPU
    /// type × allocation size) measured in all.
    jobs_measured: usize,
    speeds_measured: usize,
    /// Measured speeds over the table's (median): what unmeasured jobs
    /// run at, times the table.
    table_scale: f64,
    mean_jct_s: f64,
    utilisation: f64,
}

#[derive(Debug, Serialize)]
struct PolicyFrom {
    from_s: f64,
    name: String,
}

/// `keel whatif -o json`.
#[derive(Debug, Serialize)]
struct Report {
    history: HistorySummary,
    /// The `recorded` run against what happened.
    validation: Validation,
    runs: Vec<RunSummary>,
}

pub fn run(args: WhatifArgs, out: Output) -> anyhow::Result<()> {
    for (flag, value, least) in [
        ("--round-s", args.round_s, f64::MIN_POSITIVE),
        ("--progress-interval-s", args.progress_interval_s, 0.0),
        ("--restart-s", args.restart_s, 0.0),
    ] {
        if !(value.is_finite() && value >= least) {
            anyhow::bail!("{flag} must be a finite number of seconds ≥ {least}, not {value}");
        }
    }
    let options = PolicyOptions {
        queue: QueueOptions {
            backfill: args.backfill,
        },
        tiresias: args.tiresias.options()?,
        gavel: Default::default(),
    };
    let by_name = |name: &str| -> anyhow::Result<Box<dyn Policy>> {
        Ok(keel_scheduling::policy::by_name_with(name, &options)?)
    };
    // `recorded` first, once; then the others as named.
    let mut names = vec![RECORDED.to_string()];
    for name in &args.policy {
        if !names.contains(name) {
            if name != RECORDED {
                by_name(name).with_context(|| "--policy")?;
            }
            names.push(name.clone());
        }
    }
    let mut history = read_history(&args)?;
    if let Some(from) = &args.from_time {
        history.keep_submitted_from(crate::cli::unix_ms(from, "--from-time")?);
    }
    if history.jobs.is_empty() {
        anyhow::bail!(
            "{} holds no job submitted in the range asked for (entries {}..={})",
            source_of(&args).display(),
            history.first_index,
            history.last_index
        );
    }
    let workload = history.workload();
    let mut config = SimConfig::new(workload.nodes.clone(), workload.jobs.clone());
    config.node_changes = workload.node_changes.clone();
    config.queues = workload.queues.clone();
    config.table_scale = workload.table_scale;
    if let Some(path) = &args.cluster_file {
        let (nodes, queues) = crate::sim_cmd::read_cluster_file(path)?;
        config.nodes = nodes;
        // Its queues, if it names any; else the recorded ones.
        if !queues.is_empty() {
            config.queues = queues;
        }
        config.node_changes.clear();
    }
    config.round_s = args.round_s;
    config.progress_interval_s = args.progress_interval_s;
    config.restart_s = args.restart_s;
    let mut reports: Vec<SimReport> = Vec::new();
    for name in &names {
        let mut report = if name == RECORDED {
            run_recorded(&config, &workload, &by_name)?
        } else {
            sim::simulate(&config, by_name(name)?.as_ref())
        };
        report.policy = name.clone();
        reports.push(report);
    }
    let validation = validate(&history, &reports[0]);
    if let Some(path) = &args.jobs_csv {
        write_csv(path, &history, &reports)?;
    }
    if let Some(dir) = &args.plot {
        let runs: Vec<&SimReport> = reports.iter().collect();
        crate::sim_plot::write_all(dir, &runs, None)?;
    }
    let report = Report {
        history: summarise_history(&history, &workload),
        validation,
        runs: reports.iter().map(|r| summarise(&r.policy, r)).collect(),
    };
    match out {
        Output::Json => print_json(&report),
        Output::Table => print_report(&report),
    }
}

/// The file or directory the history is read from.
fn source_of(args: &WhatifArgs) -> &std::path::Path {
    args.from
        .as_deref()
        .or(args.data_dir.as_deref())
        .unwrap_or(std::path::Path::new(""))
}

/// The history a data directory holds, up to `--until-time`; or what a
/// snapshot file's state keeps of it.
fn read_history(args: &WhatifArgs) -> anyhow::Result<History> {
    if let Some(path) = &args.from {
        let (_, state) = crate::snapshot_cmd::read(path)?;
        return Ok(Recorder::starting_from(state).finish());
    }
    let Some(data_dir) = &args.data_dir else {
        anyhow::bail!("give --data-dir DIR or --from SNAPSHOT_FILE");
    };
    let until = crate::cli::until(None, args.until_time.as_deref(), "--until-time")?;
    // Take the directory's lock: a directory a server is writing would be
    // read moving.
    let dir = keel_storage::DataDir::open(data_dir)
        .with_context(|| format!("cannot read {}", data_dir.display()))?;
    let context = || format!("cannot read the history in {}", data_dir.display());
    let mut recorder =
        Recorder::starting_from(keel_storage::state_before_journal(&dir).with_context(context)?);
    keel_storage::for_each_entry(&dir, 0, until, &mut |index, entry| {
        recorder.record(index, entry)
    })
    .with_context(context)?;
    Ok(recorder.finish())
}

/// Runs the policies that decided, each from its first decision on (FIFO
/// throughout when none decided: the log does not name the server's
/// configured policy until one decides).
fn run_recorded(
    config: &SimConfig,
    workload: &RecordedWorkload,
    by_name: &dyn Fn(&str) -> anyhow::Result<Box<dyn Policy>>,
) -> anyhow::Result<SimReport> {
    let mut boxed: Vec<(f64, Box<dyn Policy>)> = Vec::new();
    for (at, name) in &workload.policies {
        let policy = by_name(name).with_context(|| {
            format!("the log names policy {name:?}, which this build does not know")
        })?;
        boxed.push((*at, policy));
    }
    let schedule: Vec<(f64, &dyn Policy)> = boxed.iter().map(|(at, p)| (*at, p.as_ref())).collect();
    Ok(sim::simulate_policies(config, &schedule))
}

fn summarise_history(history: &History, workload: &RecordedWorkload) -> HistorySummary {
    let ended = |end: RecordedEnd| {
        history
            .jobs
            .iter()
            .filter(|j| j.end.map(|(_, e)| e) == Some(end))
            .count()
    };
    let jcts: Vec<f64> = history.jobs.iter().filter_map(|j| j.jct_s()).collect();
    HistorySummary {
        first_index: history.first_index,
        last_index: history.last_index,
        entries: history.entries,
        state_hash: history.state_hash.clone(),
        jobs: history.jobs.len(),
        succeeded: ended(RecordedEnd::Succeeded),
        failed: ended(RecordedEnd::Failed),
        cancelled: ended(RecordedEnd::Cancelled),
        unfinished: history.jobs.iter().filter(|j| j.end.is_none()).count(),
        nodes: history.nodes.len(),
        gpus: history.total_gpus(),
        node_changes: history.node_changes.len(),
        span_s: history.end_ms().saturating_sub(history.first_ms) as f64 / 1000.0,
        policies: workload
            .policies
            .iter()
            .map(|(from_s, name)| PolicyFrom {
                from_s: *from_s,
                name: name.clone(),
            })
            .collect(),
        jobs_measured: workload.jobs_measured,
        speeds_measured: workload.speeds_measured,
        table_scale: workload.table_scale,
        mean_jct_s: if jcts.is_empty() {
            0.0
        } else {
            jcts.iter().sum::<f64>() / jcts.len() as f64
        },
        utilisation: history.utilisation(),
    }
}

fn print_report(report: &Report) -> anyhow::Result<()> {
    let h = &report.history;
    let v = &report.validation;
    let policies = h
        .policies
        .iter()
        .map(|p| format!("{} from {:.0} s", p.name, p.from_s))
        .collect::<Vec<_>>()
        .join(", ");
    let rows = vec![
        vec![
            "entries".into(),
            format!("{} ({}..={})", h.entries, h.first_index, h.last_index),
        ],
        vec![
            "jobs".into(),
            format!(
                "{} ({} succeeded, {} failed, {} cancelled, {} unfinished)",
                h.jobs, h.succeeded, h.failed, h.cancelled, h.unfinished
            ),
        ],
        vec![
            "nodes".into(),
            format!(
                "{} ({} GPUs, {} losses and recoveries)",
                h.nodes, h.gpus, h.node_changes
            ),
        ],
        vec!["span".into(), format!("{:.0} s", h.span_s)],
        vec![
            "policies".into(),
            if policies.is_empty() {
                "none decided".into()
            } else {
                policies
            },
        ],
        vec![
            "speeds measured".into(),
            format!(
                "{} jobs, {} job × GPU type × size figures; the others at the table's × {:.3}",
                h.jobs_measured, h.speeds_measured, h.table_scale
            ),
        ],
    ];
    print_table(&["history", ""], &rows)?;
    let mut stdout = std::io::stdout().lock();
    writeln!(stdout)?;
    let rows = vec![
        vec![
            "mean JCT".into(),
            format!("{:.1} s", v.mean_jct_recorded_s),
            format!("{:.1} s", v.mean_jct_simulated_s),
            format!("{:.1} %", 100.0 * v.mean_jct_error),
        ],
        vec![
            "p95 JCT".into(),
            format!("{:.1} s", v.p95_jct_recorded_s),
            format!("{:.1} s", v.p95_jct_simulated_s),
            format!("{:.1} %", 100.0 * v.p95_jct_error),
        ],
        vec![
            "utilisation".into(),
            format!("{:.1} %", 100.0 * v.utilisation_recorded),
            format!("{:.1} %", 100.0 * v.utilisation_simulated),
            format!("{:.1} points", 100.0 * v.utilisation_error),
        ],
        vec![
            "mean queueing".into(),
            format!("{:.1} s", v.mean_queueing_recorded_s),
            format!("{:.1} s", v.mean_queueing_simulated_s),
            String::new(),
        ],
    ];
    writeln!(
        stdout,
        "the simulator on this history ({} jobs that succeeded in both):",
        v.jobs_compared
    )?;
    drop(stdout);
    print_table(&["", "recorded", "simulated", "error"], &rows)?;
    writeln!(std::io::stdout().lock())?;
    let rows: Vec<Vec<String>> = report
        .runs
        .iter()
        .map(|r| {
            vec![
                r.policy.clone(),
                format!("{}/{}", r.finished, r.jobs),
                format!("{:.1}", r.mean_jct_s),
                format!("{:.1}", r.median_jct_s),
                format!("{:.1}", r.p95_jct_s),
                format!("{:.1}", r.p99_jct_s),
                format!("{:.1}", r.mean_queueing_s),
                format!("{:.1}", r.makespan_s),
                format!("{:.1} %", 100.0 * r.utilisation),
                r.preemptions.to_string(),
                format!(
                    "{}/{}/{}",
                    r.speeds_measured, r.speeds_modelled, r.speeds_from_table
                ),
            ]
        })
        .collect();
    print_table(
        &[
            "policy",
            "finished",
            "mean JCT s",
            "median s",
            "p95 s",
            "p99 s",
            "queueing s",
            "makespan s",
            "utilisation",
            "preemptions",
            "speeds m/s/t",
        ],
        &rows,
    )
}

/// One row per job and run: the job as recorded, then each run's.
fn write_csv(path: &PathBuf, history: &History, reports: &[SimReport]) -> anyhow::Result<()> {
    let file =
        std::fs::File::create(path).with_context(|| format!("cannot create {}", path.display()))?;
    let mut w = std::io::BufWriter::new(file);
    writeln!(
        w,
        "job_id,run,arrival_s,first_start_s,finish_s,jct_s,recorded_jct_s,jct_delta_s"
    )?;
    let opt = |v: Option<f64>| v.map(|x| format!("{x:.3}")).unwrap_or_default();
    for report in reports {
        for r in &report.jobs {
            let Some(job) = usize::try_from(r.id).ok().and_then(|i| history.jobs.get(i)) else {
                continue;
            };
            let recorded = job.jct_s();
            let delta = r.jct_s().zip(recorded).map(|(s, real)| s - real);
            writeln!(
                w,
                "{},{},{:.3},{},{},{},{},{}",
                job.job_id,
                report.policy,
                r.arrival_s,
                opt(r.first_start_s),
                opt(r.finish_s),
                opt(r.jct_s()),
                opt(recorded),
                opt(delta)
            )?;
        }
    }
    w.flush()?;
    Ok(())
}
