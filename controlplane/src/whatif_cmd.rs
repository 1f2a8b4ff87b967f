//! `keel whatif`: a data directory's recorded history run through the
//! simulator under the policies that decided (`recorded`, validated
//! against what happened) and under others ([`keel_sim::history`],
//! [`keel_sim::whatif`]).

use std::io::Write;
use std::path::PathBuf;

use anyhow::Context;
use keel::whatif::{compare, run_names, Report, Settings, RECORDED};
use keel_scheduling::policy::{PolicyOptions, QueueOptions};
use keel_sim::history::{History, Recorder};
use keel_sim::SimReport;

use crate::render::{print_json, print_table, Output};

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
    /// Add nodes to the recorded ones (or to `--cluster-file`'s):
    /// `COUNTxGPUSxTYPE[,...]`, e.g. `2x8xa100` for two nodes of eight
    /// A100s. The `recorded` run's error is still measured on the
    /// recorded nodes.
    #[arg(long, value_name = "COUNTxGPUSxTYPE")]
    add_nodes: Option<String>,
    /// Only the jobs submitted at or after this time (RFC 3339); jobs
    /// submitted before are left out, even those still running then.
    #[arg(long)]
    from_time: Option<String>,
    /// The history up to the last entry stamped at or before this time
    /// (RFC 3339).
    #[arg(long, conflicts_with = "until")]
    until_time: Option<String>,
    /// The history up to this log index (as `keel replay --until`).
    #[arg(long, value_name = "INDEX", conflicts_with = "from")]
    until: Option<u64>,
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
    // Unknown policies are refused before the history is read.
    run_names(&args.policy, &options).context("--policy")?;
    let settings = Settings {
        policies: args.policy.clone(),
        options,
        round_s: args.round_s,
        progress_interval_s: args.progress_interval_s,
        restart_s: args.restart_s,
        submitted_from_ms: args
            .from_time
            .as_deref()
            .map(|t| crate::cli::unix_ms(t, "--from-time"))
            .transpose()?,
        cluster: args
            .cluster_file
            .as_deref()
            .map(crate::sim_cmd::read_cluster_file)
            .transpose()?,
        added_nodes: match &args.add_nodes {
            Some(spec) => keel::whatif::added_nodes("--add-nodes", spec)?,
            None => Vec::new(),
        },
    };
    let history = read_history(&args)?;
    let compared = compare(history, &settings)
        .with_context(|| format!("in {}", source_of(&args).display()))?;
    if let Some(path) = &args.jobs_csv {
        write_csv(path, &compared.history, &compared.runs)?;
    }
    if let Some(dir) = &args.plot {
        let runs: Vec<&SimReport> = compared.runs.iter().collect();
        keel::sim_plot::write_all(dir, &runs, None)?;
    }
    match out {
        Output::Json => print_json(&compared.report),
        Output::Table => print_report(&compared.report),
    }
}

/// The file or directory the history is read from.
fn source_of(args: &WhatifArgs) -> &std::path::Path {
    args.from
        .as_deref()
        .or(args.data_dir.as_deref())
        .unwrap_or(std::path::Path::new(""))
}

/// The history a data directory holds, up to `--until` or
/// `--until-time`; or what a
/// snapshot file's state keeps of it.
fn read_history(args: &WhatifArgs) -> anyhow::Result<History> {
    if let Some(path) = &args.from {
        let (_, state) = crate::snapshot_cmd::read(path)?;
        return Ok(Recorder::starting_from(state).finish());
    }
    let Some(data_dir) = &args.data_dir else {
        anyhow::bail!("give --data-dir DIR or --from SNAPSHOT_FILE");
    };
    let until = crate::cli::until(args.until, args.until_time.as_deref(), "--until-time")?;
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

fn print_report(report: &Report) -> anyhow::Result<()> {
    let h = &report.history;
    let v = &report.validation;
    let policies = h
        .policies
        .iter()
        .map(|p| format!("{} from {:.0} s", p.name, p.from_s))
        .collect::<Vec<_>>()
        .join(", ");
    let mut rows = vec![
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
    if let Some(gpus) = &report.changed_cluster {
        let listed: Vec<String> = gpus.iter().map(|(t, n)| format!("{n} {t}")).collect();
        rows.push(vec![
            "runs on".into(),
            format!(
                "{} GPUs ({}); the error below is on the recorded nodes",
                gpus.values().sum::<u32>(),
                listed.join(", ")
            ),
        ]);
    }
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
