//! Issue 27's speed figure end to end: `keel whatif` on a data directory
//! holding a history of 100,000 jobs and about 5 M entries.
//!
//! The history is the one `cargo bench -p keel-sim --bench whatif_scale`
//! times in memory (`keel_sim::fixtures::scale_history`: a simulated
//! cluster's own log, 100,000 generated jobs, `KEEL_WHATIF_SCALE_JOBS`,
//! FIFO on 1,536 GPUs). Here it is first written into a data directory through the
//! state machine store, as a replica applying a long backlog would write it
//! (calls of 64 entries, as fast as the store takes them; the time and the
//! process's memory are printed, the figure that once passed 20 GB), and
//! its journal compacted, as a server does behind a snapshot. Then the
//! `keel` binary runs `keel whatif --data-dir DIR --policy recorded` on it,
//! timed from start to exit, with its peak RSS.
//!
//! Run: `cargo bench -p keel --bench whatif_journal`

#![allow(clippy::print_stdout)]

use std::process::Command;
use std::time::Instant;

use keel_state::Proposal;
use keel_storage::{Entry, StateMachineStore};
use openraft::storage::RaftStateMachine;
use openraft::{CommittedLeaderId, EntryPayload, LogId};

mod common;

use common::{count, KEEL};

/// A field of this process's `/proc/self/status`, in MiB.
fn status_mib(field: &str) -> u64 {
    std::fs::read_to_string("/proc/self/status")
        .unwrap_or_default()
        .lines()
        .find_map(|l| l.strip_prefix(field))
        .and_then(|v| v.trim().trim_end_matches("kB").trim().parse::<u64>().ok())
        .map_or(0, |kib| kib / 1024)
}

fn main() {
    let jobs = count("KEEL_WHATIF_SCALE_JOBS", 100_000) as usize;
    let started = Instant::now();
    let log = keel_sim::fixtures::scale_history(jobs).expect("history");
    println!(
        "history: {jobs} jobs, {} entries, simulated in {:.1} s",
        log.len(),
        started.elapsed().as_secs_f64()
    );

    let dir = tempfile::Builder::new()
        .prefix("keel-whatif-journal")
        .tempdir_in(std::env::var("KEEL_BENCH_DIR").unwrap_or_else(|_| ".".into()))
        .expect("tempdir");
    let rss_before = status_mib("VmRSS:");
    let started = Instant::now();
    {
        let runtime = tokio::runtime::Runtime::new().expect("runtime");
        let mut store = StateMachineStore::open(&dir.path().join("state")).expect("open");
        let mut rss_most = rss_before;
        runtime.block_on(async {
            for (n, calls) in log.chunks(64).enumerate() {
                let entries: Vec<Entry> = calls
                    .iter()
                    .map(|(index, e)| Entry {
                        log_id: LogId::new(CommittedLeaderId::new(1, 1), *index),
                        payload: EntryPayload::Normal(Proposal::new(vec![e.clone()])),
                    })
                    .collect();
                store.apply(entries).await.expect("apply");
                if n % 4096 == 0 {
                    rss_most = rss_most.max(status_mib("VmRSS:"));
                }
            }
        });
        let last = log.last().map_or(0, |(index, _)| *index);
        store.flush().expect("flush");
        let written_s = started.elapsed().as_secs_f64();
        rss_most = rss_most.max(status_mib("VmRSS:"));
        let compacting = Instant::now();
        let pages = store.compact_journal(last).expect("compact");
        store.flush().expect("flush");
        println!(
            "written: {:.1} s ({:.0} entries/s), RSS {rss_before} MiB before, at most {rss_most} MiB while writing (+{} MiB); compacted {pages} pages in {:.1} s",
            written_s,
            log.len() as f64 / written_s,
            rss_most.saturating_sub(rss_before),
            compacting.elapsed().as_secs_f64()
        );
    }
    let entries = log.len();
    drop(log);
    let du = Command::new("du").arg("-sh").arg(dir.path()).output();
    if let Ok(du) = du {
        print!("data directory: {}", String::from_utf8_lossy(&du.stdout));
    }

    let started = Instant::now();
    let out = Command::new(KEEL)
        .args(["whatif", "--data-dir"])
        .arg(dir.path())
        .args([
            "--policy",
            "recorded",
            "--round-s",
            &keel_sim::fixtures::SCALE_ROUND_S.to_string(),
            "--progress-interval-s",
            &keel_sim::fixtures::SCALE_PROGRESS_INTERVAL_S.to_string(),
            "-o",
            "json",
        ])
        .output()
        .expect("keel whatif");
    let whatif_s = started.elapsed().as_secs_f64();
    assert!(
        out.status.success(),
        "keel whatif failed: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    let usage = nix::sys::resource::getrusage(nix::sys::resource::UsageWho::RUSAGE_CHILDREN)
        .expect("getrusage");
    let report: serde_json::Value = serde_json::from_slice(&out.stdout).expect("json report");
    println!(
        "keel whatif --policy recorded on {entries} entries: {whatif_s:.1} s, peak RSS {} MiB; error {}",
        usage.max_rss() / 1024,
        report.get("validation").map_or_else(String::new, |v| v.to_string())
    );
}
