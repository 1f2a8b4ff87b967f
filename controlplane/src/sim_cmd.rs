//! `keel sim`: reads the inputs, runs [`keel_sim::simulate`], prints
//! the summary and writes per-job results.

use std::io::Write;
use std::path::PathBuf;
use std::time::Instant;

use anyhow::Context;
use keel_scheduling::gavel::mechanism::MechanismConfig;
use keel_scheduling::policy::QueueOptions;
use keel_sim::{self as sim, RoundSimConfig, SimConfig, SimJob, SimReport};
use serde::Serialize;

use crate::render::{print_json, print_table, Output};

/// Largest workload or cluster file read.
const INPUT_MAX_BYTES: u64 = 512 * 1024 * 1024;

#[derive(clap::Args, Debug)]
pub struct SimArgs {
    /// GPUs by type, `v100:p100:k80` counts.
    #[arg(long, default_value = "36:36:36", conflicts_with = "cluster_file")]
    cluster: String,
    /// GPUs per server for `--cluster` (each server holds one type).
    #[arg(long, default_value_t = 1)]
    gpus_per_server: u32,
    /// A YAML or JSON list of nodes instead: `- {gpu_type: a100, gpus: 8, count: 4}`;
    /// or nodes and queues: `{nodes: [...], queues: [{name: a, quota:
    /// {v100: 16}, cohort: c, borrow_limit: {}, lend_limit: {}, weight: 1}]}`.
    #[arg(long)]
    cluster_file: Option<PathBuf>,
    /// Put the workload's jobs in queues by shares, drawn with a seeded
    /// generator of their own: `a=3,b=1` (three jobs in four to `a`).
    /// The queues must be in the cluster file (or be `default`).
    #[arg(long, value_parser = parse_share, value_delimiter = ',')]
    generate_queues: Vec<(String, u32)>,
    /// Keel's trace format: one JSON object per line (`arrival_s`, `model`,
    /// `workers` as a number or `{min, max}`, `gpus_per_worker`,
    /// `total_steps`, `priority`).
    #[arg(long, group = "workload")]
    trace: Option<PathBuf>,
    /// Gavel's trace format (10 tab-separated columns).
    #[arg(long, group = "workload")]
    gavel_trace: Option<PathBuf>,
    /// The job stream of Gavel's generator as CSV (`job_id, model,
    /// scale_factor, duration_s_on_v100, total_steps, unit_arrival`);
    /// `--rate` turns unit arrivals into seconds.
    #[arg(long, group = "workload")]
    generated_csv: Option<PathBuf>,
    /// Generate this many jobs with Gavel's distributions.
    #[arg(long, group = "workload")]
    generate: Option<usize>,
    /// Draw this many jobs from Gavel's own generator for `--seed`, draw
    /// for draw (the stream of `jobs_seed=S.csv`, and beyond it); steps
    /// from the `--throughputs` table's v100 figures; `--multi-gpu` keeps
    /// the drawn scale factors.
    #[arg(long, group = "workload", requires = "throughputs")]
    gavel_generate: Option<usize>,
    /// Arrivals per hour for `--generate` (Poisson; 0: all at once) and
    /// `--generated-csv`.
    #[arg(long, default_value_t = 3.2)]
    rate: f64,
    /// Seed for `--generate`.
    #[arg(long, default_value_t = 0)]
    seed: u64,
    /// `--generate` multi-GPU jobs too (scale factors 1/2/4/8 at 70/10/15/5 %).
    #[arg(long)]
    multi_gpu: bool,
    /// `--generate` elastic jobs: each may run on 1 to 4 × its scale
    /// factor workers.
    #[arg(long)]
    elastic: bool,
    /// Scheduling policy.
    #[arg(long, default_value = "fifo", conflicts_with = "compare")]
    policy: String,
    /// Run several policies on the same workload and print them side by
    /// side, e.g. `fifo,srjf,tiresias`.
    #[arg(long, value_delimiter = ',')]
    compare: Vec<String>,
    /// Let jobs behind a blocked head of the queue start when they fit.
    #[arg(long)]
    backfill: bool,
    #[command(flatten)]
    tiresias: crate::TiresiasArgs,
    /// Seconds between scheduling rounds (arrivals and completions also
    /// start a round; for heterogeneity-aware policies, the round length).
    #[arg(long, default_value_t = 360.0)]
    round_s: f64,
    /// Heterogeneity-aware policies: least seconds between two solves of
    /// the allocation (it is solved again only when the job set changed).
    #[arg(long, default_value_t = 1920.0)]
    resolve_interval_s: f64,
    /// Heterogeneity-aware policies: Gavel's mechanism constants (360 s
    /// rounds, 1,920 s between solves, 180 s initial credit) and its
    /// simulator's time semantics, for results comparable with Gavel's.
    #[arg(long)]
    gavel_compat: bool,
    /// Price per hour of each GPU type, for
    /// `max_sum_throughput_normalized_by_cost_perf`: `v100=2.48,k80=0.45`.
    #[arg(long, value_parser = crate::parse_price, value_delimiter = ',')]
    gpu_prices: Vec<(String, f64)>,
    /// Seconds without progress each time a job (re)starts on an allocation.
    #[arg(long, default_value_t = 0.0)]
    restart_s: f64,
    /// A running job reports progress at the first round at least this
    /// many seconds after its last report (and when it finishes).
    #[arg(long, default_value_t = 1800.0)]
    progress_interval_s: f64,
    /// Measure only jobs with workload ids in START:END (inclusive); the run
    /// stops once they all finished.
    #[arg(long, value_parser = parse_window)]
    window: Option<(u64, u64)>,
    /// Gavel's throughput table (`simulation_throughputs.json` layout): the
    /// speed of jobs whose Gavel job type and size it holds (Gavel traces);
    /// the others run at the project's table's speed.
    #[arg(long)]
    throughputs: Option<PathBuf>,
    /// Remove finished jobs from the state this many simulated seconds
    /// after they finished, as the server's `--retain-finished-s` does
    /// (default: keep them).
    #[arg(long)]
    retain_finished_s: Option<f64>,
    /// Keep at most this many finished jobs in the state, as the server's
    /// `--retain-finished-max` does (default: no limit).
    #[arg(long)]
    retain_finished_max: Option<usize>,
    /// Report the state's size (jobs held, snapshot bytes) this many times
    /// over the run, and at its end (0: not).
    #[arg(long, default_value_t = 0)]
    state_size_samples: u32,
    /// Write one CSV row per job here.
    #[arg(long)]
    jobs_csv: Option<PathBuf>,
    /// Write figures here as SVG: JCT CDF per policy, GPU utilisation and
    /// queue length over time.
    #[arg(long)]
    plot: Option<PathBuf>,
}

/// `NAME=SHARE`, one queue of `--generate-queues`.
fn parse_share(s: &str) -> Result<(String, u32), String> {
    let (name, share) = s
        .split_once('=')
        .ok_or_else(|| format!("{s:?} is not QUEUE=SHARE"))?;
    let share: u32 = share
        .trim()
        .parse()
        .map_err(|e| format!("{s:?}: the share: {e}"))?;
    Ok((name.trim().to_string(), share))
}

fn parse_window(s: &str) -> Result<(u64, u64), String> {
    let (a, b) = s
        .split_once(':')
        .ok_or_else(|| format!("{s:?} is not START:END"))?;
    let a: u64 = a.trim().parse().map_err(|e| format!("window start: {e}"))?;
    let b: u64 = b.trim().parse().map_err(|e| format!("window end: {e}"))?;
    if a > b {
        return Err(format!("window start {a} is after its end {b}"));
    }
    Ok((a, b))
}

fn read_text(path: &std::path::Path) -> anyhow::Result<String> {
    read_text_limited(path, INPUT_MAX_BYTES)
}

/// The text of `path`, refused (naming the size and the limit) when it is
/// longer than `max_bytes`.
pub fn read_text_limited(path: &std::path::Path, max_bytes: u64) -> anyhow::Result<String> {
    let len = std::fs::metadata(path)
        .with_context(|| format!("cannot read {}", path.display()))?
        .len();
    if len > max_bytes {
        anyhow::bail!(
            "{} is {len} bytes; the limit is {max_bytes}",
            path.display()
        );
    }
    std::fs::read_to_string(path).with_context(|| format!("cannot read {}", path.display()))
}

fn workload(args: &SimArgs) -> anyhow::Result<Vec<SimJob>> {
    if let Some(path) = &args.trace {
        return sim::workload::parse_keel_trace(&read_text(path)?)
            .with_context(|| format!("in {}", path.display()));
    }
    if let Some(path) = &args.gavel_trace {
        return sim::workload::parse_gavel_trace(&read_text(path)?)
            .with_context(|| format!("in {}", path.display()));
    }
    if let Some(path) = &args.generated_csv {
        return sim::workload::parse_gavel_generated_csv(&read_text(path)?, args.rate)
            .with_context(|| format!("in {}", path.display()));
    }
    if let Some(jobs) = args.gavel_generate {
        let path = args
            .throughputs
            .as_ref()
            .context("--gavel-generate needs --throughputs")?;
        let table = sim::ThroughputTable::from_gavel_json(&read_text(path)?)
            .with_context(|| format!("in {}", path.display()))?;
        let seed = u32::try_from(args.seed)
            .map_err(|_| anyhow::anyhow!("--seed {}: must be below 2^32", args.seed))?;
        return Ok(sim::GavelGenerator {
            jobs,
            rate_per_hour: args.rate,
            seed,
            multi_gpu: args.multi_gpu,
        }
        .generate(&table)?);
    }
    let jobs = args.generate.context(
        "give a workload: --trace FILE, --gavel-trace FILE, --generated-csv FILE, --generate N \
         or --gavel-generate N",
    )?;
    Ok(sim::Generator {
        jobs,
        rate_per_hour: args.rate,
        seed: args.seed,
        multi_gpu: args.multi_gpu,
        elastic: args.elastic,
    }
    .generate()?)
}

/// A policy to run: one of Keel's (the event-driven simulator over the
/// state machine) or a heterogeneity-aware one (the round-based
/// mechanism).
enum SimPolicy {
    Keel(Box<dyn keel_scheduling::policy::Policy>),
    Gavel(String),
}

/// The cluster's nodes, and its queues when the cluster file has some.
type Cluster = (Vec<sim::SimNode>, sim::SimQueues);

fn cluster(args: &SimArgs) -> anyhow::Result<Cluster> {
    match &args.cluster_file {
        Some(path) => read_cluster_file(path),
        None => Ok((
            sim::cluster_from_counts(&args.cluster, args.gpus_per_server)?,
            Vec::new(),
        )),
    }
}

/// The nodes and queues of a cluster file (YAML or JSON).
pub(crate) fn read_cluster_file(path: &std::path::Path) -> anyhow::Result<Cluster> {
    let file: sim::ClusterFile = serde_saphyr::from_str(&read_text(path)?)
        .with_context(|| format!("in {}", path.display()))?;
    file.resolve()
        .with_context(|| format!("in {}", path.display()))
}

/// Every job's queue is one the cluster defines (or the default one).
fn check_queues(jobs: &[SimJob], queues: &Cluster) -> anyhow::Result<()> {
    let known = |q: &str| {
        q.is_empty()
            || q == keel_state::queue::DEFAULT_QUEUE
            || queues.1.iter().any(|(name, _)| name == q)
    };
    if let Some(job) = jobs.iter().find(|j| !known(&j.queue)) {
        anyhow::bail!(
            "job {} names queue {:?}, which the cluster file does not define (queues: {})",
            job.id,
            job.queue,
            std::iter::once(keel_state::queue::DEFAULT_QUEUE)
                .chain(queues.1.iter().map(|(n, _)| n.as_str()))
                .collect::<Vec<_>>()
                .join(", ")
        );
    }
    Ok(())
}

#[derive(Serialize)]
struct StateSizeRow {
    at_h: f64,
    submitted: u64,
    jobs: u64,
    snapshot_bytes: u64,
}

#[derive(Serialize)]
struct QueueRow {
    queue: String,
    jobs: usize,
    gpu_h: f64,
    /// Its share of the GPU-time used while two queues or more had jobs
    /// waiting.
    contended_share: f64,
    /// Jobs that arrived to an idle queue with unused quota that covered
    /// them.
    within_quota_jobs: usize,
    /// The longest such a job waited to start.
    within_quota_max_wait_s: f64,
}

#[derive(Serialize)]
struct Summary<'a> {
    policy: &'a str,
    jobs: usize,
    measured: usize,
    finished: usize,
    unfinished: usize,
    avg_jct_h: f64,
    median_jct_h: f64,
    p95_jct_h: f64,
    p99_jct_h: f64,
    makespan_h: f64,
    utilisation: f64,
    rounds: u64,
    decisions: u64,
    preemptions: u64,
    resizes: u64,
    migrations: u64,
    entries: u64,
    solves: u64,
    lease_extensions_pct: Option<f64>,
    pairs_placed: u64,
    simulated_h: f64,
    /// Finished jobs removed from the state (`--retain-finished-*`).
    jobs_removed: u64,
    /// The state's size over the run (`--state-size-samples`).
    state_sizes: Vec<StateSizeRow>,
    /// Each queue's use (with queues).
    queues: Vec<QueueRow>,
    /// Hours during which two queues or more had jobs waiting.
    contended_h: f64,
    wall_s: f64,
    rounds_per_s: f64,
    state_hash: &'a str,
}

pub fn run(args: SimArgs, out: Output) -> anyhow::Result<()> {
    if !(args.round_s.is_finite() && args.round_s > 0.0) {
        anyhow::bail!("--round-s must be a positive number of seconds");
    }
    if !(args.restart_s.is_finite() && args.restart_s >= 0.0) {
        anyhow::bail!("--restart-s must be a number of seconds ≥ 0");
    }
    if !(args.progress_interval_s.is_finite() && args.progress_interval_s >= 0.0) {
        anyhow::bail!("--progress-interval-s must be a number of seconds ≥ 0");
    }
    let names = if args.compare.is_empty() {
        vec![args.policy.clone()]
    } else {
        args.compare.clone()
    };
    let options = keel_scheduling::policy::PolicyOptions {
        queue: QueueOptions {
            backfill: args.backfill,
        },
        tiresias: args.tiresias.options()?,
        gavel: Default::default(),
    };
    if !(args.resolve_interval_s.is_finite() && args.resolve_interval_s >= 0.0) {
        anyhow::bail!("--resolve-interval-s must be a number of seconds ≥ 0");
    }
    let policies = names
        .iter()
        .map(|n| {
            if keel_scheduling::gavel::GAVEL_POLICY_NAMES.contains(&n.as_str()) {
                Ok(SimPolicy::Gavel(n.clone()))
            } else if args.gavel_compat {
                anyhow::bail!(
                    "--gavel-compat runs the heterogeneity-aware policies ({}); {n:?} is not one",
                    keel_scheduling::gavel::GAVEL_POLICY_NAMES.join(", ")
                )
            } else {
                Ok(SimPolicy::Keel(keel_scheduling::policy::by_name_with(
                    n, &options,
                )?))
            }
        })
        .collect::<anyhow::Result<Vec<_>>>()?;
    let cluster = cluster(&args)?;
    let mut jobs = workload(&args)?;
    if !args.generate_queues.is_empty() {
        sim::assign_queues(&mut jobs, &args.generate_queues, args.seed)?;
    }
    check_queues(&jobs, &cluster)?;
    if !cluster.1.is_empty() || jobs.iter().any(|j| !j.queue.is_empty()) {
        if let Some(SimPolicy::Gavel(name)) =
            policies.iter().find(|p| matches!(p, SimPolicy::Gavel(_)))
        {
            anyhow::bail!(
                "queues are simulated under Keel's policies (the event simulator); {name} runs in the round-based simulator, which has none"
            );
        }
    }
    let mut config = SimConfig::new(cluster.0, jobs);
    config.queues = cluster.1;
    config.round_s = args.round_s;
    config.restart_s = args.restart_s;
    config.progress_interval_s = args.progress_interval_s;
    config.window = args.window;
    if let Some(s) = args.retain_finished_s {
        if !(s.is_finite() && s >= 0.0) {
            anyhow::bail!("--retain-finished-s must be a number of seconds ≥ 0, not {s}");
        }
    }
    if args.retain_finished_max == Some(0) {
        anyhow::bail!("--retain-finished-max must be at least 1 (leave it out for no limit)");
    }
    if args.retain_finished_s.is_some() || args.retain_finished_max.is_some() {
        config.retention = Some(sim::SimRetention {
            finished_s: args.retain_finished_s,
            finished_max: args.retain_finished_max,
        });
    }
    config.state_size_samples = args.state_size_samples;
    if let Some(path) = &args.throughputs {
        config.throughputs = Some(
            sim::ThroughputTable::from_gavel_json(&read_text(path)?)
                .with_context(|| format!("in {}", path.display()))?,
        );
    }
    let mechanism = if args.gavel_compat {
        MechanismConfig::gavel()
    } else {
        MechanismConfig {
            round_s: args.round_s,
            min_resolve_interval_s: args.resolve_interval_s,
            initial_credit_s: args.round_s / 2.0,
            ..MechanismConfig::gavel()
        }
    };
    let mut reports = Vec::new();
    for policy in &policies {
        let started = Instant::now();
        let report = match policy {
            SimPolicy::Keel(policy) => sim::simulate(&config, policy.as_ref()),
            SimPolicy::Gavel(name) => {
                let rounds = RoundSimConfig {
                    nodes: config.nodes.clone(),
                    jobs: config.jobs.clone(),
                    throughputs: config.throughputs.clone(),
                    mechanism: mechanism.clone(),
                    seed: args.seed,
                    window: config.window,
                    max_simulated_s: config.max_simulated_s,
                    instance_costs: args.gpu_prices.iter().cloned().collect(),
                };
                sim::simulate_rounds(&rounds, name)?
            }
        };
        let wall_s = started.elapsed().as_secs_f64();
        reports.push((report, wall_s));
    }
    if let (Some(path), [(report, _)]) = (&args.jobs_csv, reports.as_slice()) {
        write_csv(path, report)?;
    } else if args.jobs_csv.is_some() {
        anyhow::bail!("--jobs-csv takes one policy, not --compare");
    }
    if let Some(dir) = &args.plot {
        let runs: Vec<&SimReport> = reports.iter().map(|(r, _)| r).collect();
        keel::sim_plot::write_all(dir, &runs, args.window)?;
    }
    let summaries: Vec<Summary> = reports
        .iter()
        .map(|(r, wall_s)| summarise(r, args.window, *wall_s))
        .collect();
    match (out, summaries.as_slice()) {
        (Output::Json, [one]) => print_json(one),
        (Output::Json, many) => print_json(&many),
        (Output::Table, [one]) => print_one(one),
        (Output::Table, many) => print_compare(many),
    }
}

fn summarise(report: &SimReport, window: Option<(u64, u64)>, wall_s: f64) -> Summary<'_> {
    let jct = report.jct(window);
    let h = |s: f64| s / 3600.0;
    Summary {
        policy: &report.policy,
        jobs: report.jobs.len(),
        measured: jct.finished + jct.unfinished,
        finished: jct.finished,
        unfinished: jct.unfinished,
        avg_jct_h: h(jct.mean_s),
        median_jct_h: h(jct.median_s),
        p95_jct_h: h(jct.p95_s),
        p99_jct_h: h(jct.p99_s),
        makespan_h: h(report.makespan_s),
        utilisation: report.utilisation,
        rounds: report.rounds,
        decisions: report.decisions,
        preemptions: report.preemptions,
        resizes: report.resizes,
        migrations: report.migrations,
        entries: report.entries,
        solves: report.solves,
        lease_extensions_pct: (report.lease_extension_opportunities > 0).then(|| {
            100.0 * report.lease_extensions as f64 / report.lease_extension_opportunities as f64
        }),
        pairs_placed: report.pairs_placed,
        simulated_h: h(report.simulated_s),
        jobs_removed: report.jobs_removed,
        state_sizes: report
            .state_sizes
            .iter()
            .map(|z| StateSizeRow {
                at_h: h(z.at_s),
                submitted: z.submitted,
                jobs: z.jobs,
                snapshot_bytes: z.snapshot_bytes,
            })
            .collect(),
        queues: queue_rows(report),
        contended_h: h(report.contended_s),
        wall_s,
        rounds_per_s: if wall_s > 0.0 {
            report.rounds as f64 / wall_s
        } else {
            0.0
        },
        state_hash: &report.state_hash,
    }
}

fn queue_rows(report: &SimReport) -> Vec<QueueRow> {
    let contended: f64 = report.queues.values().map(|q| q.contended_gpu_s).sum();
    let mut names: std::collections::BTreeSet<&str> =
        report.queues.keys().map(String::as_str).collect();
    names.extend(report.jobs.iter().map(|j| j.queue.as_str()));
    if report.queues.is_empty() {
        return Vec::new();
    }
    names
        .into_iter()
        .map(|name| {
            let used = report.queues.get(name).copied().unwrap_or_default();
            let jobs: Vec<&sim::JobResult> =
                report.jobs.iter().filter(|j| j.queue == name).collect();
            let within: Vec<&&sim::JobResult> = jobs.iter().filter(|j| j.within_quota).collect();
            QueueRow {
                queue: name.to_string(),
                jobs: jobs.len(),
                gpu_h: used.gpu_s / 3600.0,
                contended_share: if contended > 0.0 {
                    used.contended_gpu_s / contended
                } else {
                    0.0
                },
                within_quota_jobs: within.len(),
                within_quota_max_wait_s: within
                    .iter()
                    .filter_map(|j| j.first_start_s.map(|s| s - j.arrival_s))
                    .fold(0.0, f64::max),
            }
        })
        .collect()
}

fn print_one(summary: &Summary) -> anyhow::Result<()> {
    let rows = vec![
        vec!["policy".into(), summary.policy.to_string()],
        vec![
            "jobs finished (measured)".into(),
            format!("{} of {}", summary.finished, summary.measured),
        ],
        vec!["average JCT".into(), format!("{:.2} h", summary.avg_jct_h)],
        vec![
            "median JCT".into(),
            format!("{:.2} h", summary.median_jct_h),
        ],
        vec!["p95 JCT".into(), format!("{:.2} h", summary.p95_jct_h)],
        vec!["p99 JCT".into(), format!("{:.2} h", summary.p99_jct_h)],
        vec!["makespan".into(), format!("{:.2} h", summary.makespan_h)],
        vec![
            "GPU utilisation".into(),
            format!("{:.1} %", 100.0 * summary.utilisation),
        ],
        vec!["rounds".into(), summary.rounds.to_string()],
        vec!["decisions".into(), summary.decisions.to_string()],
        vec!["preemptions".into(), summary.preemptions.to_string()],
        vec!["resizes and moves".into(), summary.resizes.to_string()],
        vec!["workers migrated".into(), summary.migrations.to_string()],
        vec!["log entries".into(), summary.entries.to_string()],
        vec!["allocation solves".into(), summary.solves.to_string()],
        vec![
            "lease extensions".into(),
            summary
                .lease_extensions_pct
                .map_or_else(|| "-".into(), |p| format!("{p:.1} %")),
        ],
        vec![
            "pairs sharing GPUs".into(),
            summary.pairs_placed.to_string(),
        ],
        vec![
            "simulated time".into(),
            format!("{:.1} h", summary.simulated_h),
        ],
        vec![
            "finished jobs removed".into(),
            summary.jobs_removed.to_string(),
        ],
        vec!["wall time".into(), format!("{:.2} s", summary.wall_s)],
        vec![
            "rounds per second".into(),
            format!("{:.0}", summary.rounds_per_s),
        ],
        vec![
            "state hash".into(),
            if summary.state_hash.is_empty() {
                "- (round-based mechanism, no state machine)".into()
            } else {
                summary.state_hash.to_string()
            },
        ],
    ];
    print_table(&["", ""], &rows)?;
    if !summary.queues.is_empty() {
        writeln!(std::io::stdout().lock())?;
        let rows: Vec<Vec<String>> = summary
            .queues
            .iter()
            .map(|q| {
                vec![
                    q.queue.clone(),
                    q.jobs.to_string(),
                    format!("{:.1}", q.gpu_h),
                    format!("{:.1}", 100.0 * q.contended_share),
                    q.within_quota_jobs.to_string(),
                    format!("{:.0}", q.within_quota_max_wait_s),
                ]
            })
            .collect();
        print_table(
            &[
                "QUEUE",
                "JOBS",
                "GPU-HOURS",
                "SHARE WHILE CONTENDED (%)",
                "JOBS WITHIN QUOTA",
                "THEIR LONGEST WAIT (s)",
            ],
            &rows,
        )?;
        writeln!(
            std::io::stdout().lock(),
            "two queues or more had jobs waiting for {:.1} h",
            summary.contended_h
        )?;
    }
    if !summary.state_sizes.is_empty() {
        writeln!(std::io::stdout().lock())?;
        let sizes: Vec<Vec<String>> = summary
            .state_sizes
            .iter()
            .map(|z| {
                vec![
                    format!("{:.1}", z.at_h),
                    z.submitted.to_string(),
                    z.jobs.to_string(),
                    z.snapshot_bytes.to_string(),
                ]
            })
            .collect();
        print_table(
            &["AT (h)", "SUBMITTED", "JOBS IN STATE", "SNAPSHOT (bytes)"],
            &sizes,
        )?;
    }
    Ok(())
}

fn print_compare(summaries: &[Summary]) -> anyhow::Result<()> {
    let rows: Vec<Vec<String>> = summaries
        .iter()
        .map(|s| {
            vec![
                s.policy.to_string(),
                format!("{}/{}", s.finished, s.measured),
                format!("{:.2}", s.avg_jct_h),
                format!("{:.2}", s.median_jct_h),
                format!("{:.2}", s.p99_jct_h),
                format!("{:.1}", s.makespan_h),
                format!("{:.1}", 100.0 * s.utilisation),
                s.preemptions.to_string(),
                s.resizes.to_string(),
                format!("{:.2}", s.wall_s),
            ]
        })
        .collect();
    print_table(
        &[
            "POLICY",
            "FINISHED",
            "AVG JCT (h)",
            "MEDIAN (h)",
            "P99 (h)",
            "MAKESPAN (h)",
            "UTIL (%)",
            "PREEMPTIONS",
            "RESIZES",
            "WALL (s)",
        ],
        &rows,
    )
}

fn write_csv(path: &PathBuf, report: &SimReport) -> anyhow::Result<()> {
    let file =
        std::fs::File::create(path).with_context(|| format!("cannot create {}", path.display()))?;
    let mut w = std::io::BufWriter::new(file);
    writeln!(
        w,
        "id,job_id,model,gpus,arrival_s,first_start_s,finish_s,jct_s,restarts"
    )?;
    let opt = |v: Option<f64>| v.map(|x| format!("{x:.3}")).unwrap_or_default();
    for j in &report.jobs {
        writeln!(
            w,
            "{},{},{},{},{:.3},{},{},{},{}",
            j.id,
            j.job_id,
            j.model,
            j.gpus,
            j.arrival_s,
            opt(j.first_start_s),
            opt(j.finish_s),
            opt(j.jct_s()),
            j.restarts
        )?;
    }
    w.flush()?;
    Ok(())
}
