//! `keel-dst`: the deterministic simulation of Keel's Raft layer, over a
//! range of seeds (see `keel_chaos::dst`). Exits non-zero if any seed
//! fails a check, or, with `--twice`, replays differently.

use std::time::Duration;

use anyhow::Context;
use clap::Parser;
use keel_chaos::dst::{run_seed, DstConfig, DstReport, Fault};

/// Simulated clusters on a virtual clock, every choice from a seed.
#[derive(Parser, Debug)]
#[command(version)]
struct Args {
    /// The first seed.
    #[arg(long, default_value_t = 0)]
    first: u64,
    /// How many seeds, from `--first` on.
    #[arg(long, default_value_t = 100)]
    seeds: u64,
    /// Replicas (3 or 5).
    #[arg(long, default_value_t = 3)]
    replicas: u64,
    /// Fault rounds per seed.
    #[arg(long, default_value_t = 12)]
    rounds: u32,
    /// Concurrent clients.
    #[arg(long, default_value_t = 3)]
    clients: u32,
    /// A check of the checker: disks acknowledge appends before they are
    /// durable, so crashes lose committed entries; the runs must fail.
    #[arg(long)]
    lying_disk: bool,
    /// The fault kinds to deal, comma-separated (default: all).
    #[arg(long, value_delimiter = ',')]
    faults: Vec<String>,
    /// Every disk slow (50–200 ms flushes) all the time.
    #[arg(long)]
    slow_disks: bool,
    /// Leave out the replicas' scheduling and reconcile loops (the Raft
    /// layer's faults alone, at half the cost).
    #[arg(long)]
    no_scheduling: bool,
    /// A check of the checker: the reconcile loops launch and stop without
    /// a quorum's confirmation, so stale leaders act; runs with the
    /// `stale_leader` fault must fail.
    #[arg(long)]
    unconfirmed: bool,
    /// Run every seed twice and fail if the two traces differ.
    #[arg(long)]
    twice: bool,
    /// Print each run's trace (virtual ms, faults, leaders, operations).
    #[arg(long)]
    trace: bool,
    /// Print every seed's line, not only the failures.
    #[arg(long, short)]
    verbose: bool,
    /// `text` or `json` (one report per seed, one per line).
    #[arg(long, short, default_value = "text")]
    output: String,
}

#[allow(clippy::print_stdout)]
fn main() -> anyhow::Result<()> {
    let args = Args::parse();
    if ![3, 5].contains(&args.replicas) {
        anyhow::bail!("--replicas must be 3 or 5, not {}", args.replicas);
    }
    let faults = if args.faults.is_empty() {
        Fault::ALL.to_vec()
    } else {
        args.faults
            .iter()
            .map(|f| {
                Fault::parse(f).with_context(|| {
                    format!(
                        "unknown fault kind {f:?}; the kinds: {}",
                        Fault::ALL.map(Fault::name).join(", ")
                    )
                })
            })
            .collect::<anyhow::Result<Vec<_>>>()?
    };
    let started = std::time::Instant::now();
    let (mut failed, mut virtual_s) = (Vec::new(), 0.0);
    for seed in args.first..args.first.saturating_add(args.seeds) {
        let config = DstConfig {
            seed,
            replicas: args.replicas,
            rounds: args.rounds,
            clients: args.clients,
            liveness_bound: Duration::from_secs(20),
            lying_disk: args.lying_disk,
            faults: faults.clone(),
            slow_disks: args.slow_disks,
            scheduling: !args.no_scheduling,
            unconfirmed: args.unconfirmed,
        };
        let mut report: DstReport = run_seed(&config).with_context(|| format!("seed {seed}"))?;
        if args.twice {
            let again = run_seed(&config).with_context(|| format!("seed {seed}, again"))?;
            if again.digest != report.digest {
                report.passed = false;
                report.violations.push(format!(
                    "nondeterministic: a second run gave digest {} (first {})",
                    again.digest, report.digest
                ));
            }
        }
        virtual_s += report.virtual_s;
        if args.output == "json" {
            println!("{}", serde_json::to_string(&report)?);
        } else if args.verbose || args.trace || !report.passed {
            if args.trace {
                for line in &report.trace {
                    println!("  {line}");
                }
            }
            println!("{}", report.line());
            for v in &report.violations {
                println!("  {v}");
            }
        }
        if !report.passed {
            failed.push(seed);
        }
    }
    if args.output != "json" {
        println!(
            "keel-dst: {} seeds from {}, {} failed{}; {:.0} s simulated in {:.1} s",
            args.seeds,
            args.first,
            failed.len(),
            if failed.is_empty() {
                String::new()
            } else {
                format!(" (seeds {failed:?}; repeat one with --first S --seeds 1 -v)")
            },
            virtual_s,
            started.elapsed().as_secs_f64()
        );
    }
    if failed.is_empty() {
        Ok(())
    } else {
        std::process::exit(1)
    }
}
