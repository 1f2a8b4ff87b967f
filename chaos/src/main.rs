//! `keel-chaos`: runs Keel's chaos suite against real replicas (see the
//! library's documentation) and prints the report.

use std::path::PathBuf;
use std::time::Duration;

use anyhow::Context;
use clap::Parser;
use keel_chaos::faults::FaultKind;
use keel_chaos::RunConfig;

/// Fault injection against a cluster of real `keel server` processes.
#[derive(Parser, Debug)]
#[command(version)]
struct Args {
    /// Fault rounds.
    #[arg(long, default_value_t = 20)]
    rounds: u32,
    /// Seed of the fault schedule and the workload.
    #[arg(long, default_value_t = 1)]
    seed: u64,
    /// Replicas (3 or 5).
    #[arg(long, default_value_t = 3)]
    replicas: u64,
    /// Concurrent clients.
    #[arg(long, default_value_t = 3)]
    clients: u32,
    /// Operations per second per client, at most.
    #[arg(long, default_value_t = 8.0)]
    rate: f64,
    /// The fault kinds to deal, comma-separated (default: all but the disk
    /// faults).
    #[arg(long, value_delimiter = ',')]
    faults: Vec<String>,
    /// Deal the disk faults too (slow and full disk on a follower); the
    /// `keel` binary must be built with `--features failpoints`.
    #[arg(long)]
    disk_faults: bool,
    /// Deal the skewed-clock fault too (a replica restarted with its clock
    /// seconds to hours off); needs libfaketime (`apt-get install
    /// faketime`).
    #[arg(long)]
    clock_faults: bool,
    /// The `keel` binary (default: next to this one, else on PATH).
    #[arg(long)]
    keel: Option<PathBuf>,
    /// Keep the replicas' directories here (default: a temporary directory,
    /// removed after a passing run).
    #[arg(long)]
    dir: Option<PathBuf>,
    /// Seconds the cluster may take to commit again after a fault or heal.
    #[arg(long, default_value_t = 20.0)]
    liveness_bound_s: f64,
    /// Clients read stale (`keel --stale`), which is not linearizable: a
    /// check of the checker, which must then report violations.
    #[arg(long)]
    stale_reads: bool,
    /// Run the replicas and the clients over mutual TLS (certificates made
    /// for the run).
    #[arg(long)]
    tls: bool,
    /// And ACLs on (`keel server --acl`; implies --tls): the harness
    /// bootstraps them, and its clients present an operator's token.
    #[arg(long)]
    acl: bool,
    /// `text` or `json`.
    #[arg(long, short, default_value = "text")]
    output: String,
}

fn default_keel() -> PathBuf {
    std::env::current_exe()
        .ok()
        .and_then(|p| Some(p.parent()?.join("keel")))
        .filter(|p| p.exists())
        .unwrap_or_else(|| PathBuf::from("keel"))
}

#[allow(clippy::print_stdout)]
fn main() -> anyhow::Result<()> {
    let args = Args::parse();
    tracing_subscriber::fmt()
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_env("KEEL_LOG")
                .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("warn")),
        )
        .with_writer(std::io::stderr)
        .init();
    if !(3..=7).contains(&args.replicas) || args.replicas % 2 == 0 {
        anyhow::bail!("--replicas {}: must be 3, 5 or 7", args.replicas);
    }
    if !(args.rate.is_finite() && args.rate > 0.0 && args.rate <= 1000.0) {
        anyhow::bail!(
            "--rate {}: must be between 0 and 1000 operations per second",
            args.rate
        );
    }
    if !(args.liveness_bound_s.is_finite() && (1.0..=600.0).contains(&args.liveness_bound_s)) {
        anyhow::bail!(
            "--liveness-bound-s {}: must be between 1 and 600",
            args.liveness_bound_s
        );
    }
    let kinds = if args.faults.is_empty() {
        let mut all = FaultKind::ALL.to_vec();
        if args.disk_faults {
            all.extend(FaultKind::DISK);
        }
        if args.clock_faults {
            all.extend(FaultKind::CLOCK);
        }
        all
    } else {
        args.faults
            .iter()
            .map(|f| {
                FaultKind::parse(f).with_context(|| {
                    format!(
                        "--faults {f:?}: known kinds are {}",
                        FaultKind::ALL
                            .into_iter()
                            .chain(FaultKind::DISK)
                            .chain(FaultKind::CLOCK)
                            .map(FaultKind::as_str)
                            .collect::<Vec<_>>()
                            .join(", ")
                    )
                })
            })
            .collect::<anyhow::Result<Vec<_>>>()?
    };
    let mut config = RunConfig::new(
        args.keel.unwrap_or_else(default_keel),
        args.seed,
        args.rounds,
    );
    config.replicas = args.replicas;
    config.clients = args.clients;
    config.rate_per_client = args.rate;
    if kinds.contains(&FaultKind::SkewedClock) && config.faketime.is_none() {
        anyhow::bail!("the skewed-clock fault needs libfaketime: apt-get install faketime");
    }
    config.kinds = kinds;
    config.dir = args.dir;
    config.stale_reads = args.stale_reads;
    config.tls = args.tls;
    config.acl = args.acl;
    config.liveness_bound = Duration::from_secs_f64(args.liveness_bound_s);
    let runtime = tokio::runtime::Runtime::new()?;
    let report = runtime.block_on(keel_chaos::run(&config))?;
    match args.output.as_str() {
        "json" => println!("{}", serde_json::to_string_pretty(&report)?),
        "text" => print!("{}", report.text()),
        other => anyhow::bail!("--output {other:?}: text or json"),
    }
    if !report.passed {
        std::process::exit(1);
    }
    Ok(())
}
