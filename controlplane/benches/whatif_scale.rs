//! Issue 27's speed figure: `keel whatif` on a history of 100,000 jobs and
//! about 5 M entries.
//!
//! The history is a simulated cluster's own log (`keel sim`'s engine with
//! `keep_log`: 100,000 generated jobs, `KEEL_WHATIF_SCALE_JOBS`, on 1,536
//! GPUs, progress reported at most every 40 minutes), written into a data directory's
//! journal through the state machine store, as a replica writes it. Then
//! the `keel` binary reads it back: `keel whatif --policy recorded`, and
//! with three more policies, each timed.
//!
//! Run: `cargo bench -p keel --bench whatif_scale`

#![allow(clippy::print_stdout)]

use std::process::Command;
use std::time::Instant;

use keel_state::Proposal;
use keel_storage::{Entry, StateMachineStore};
use openraft::storage::RaftStateMachine;
use openraft::{CommittedLeaderId, EntryPayload, LogId};

mod common;

use common::{count, KEEL};

fn main() {
    let jobs = count("KEEL_WHATIF_SCALE_JOBS", 100_000) as usize;
    let started = Instant::now();
    let workload = keel_sim::Generator {
        jobs,
        // About 80 % of the cluster's GPU time asked for (a job asks for
        // about 32 GPU-hours on average).
        rate_per_hour: 38.8,
        seed: 27,
        multi_gpu: true,
        elastic: false,
    }
    .generate()
    .expect("workload");
    let nodes = keel_sim::cluster_from_counts("512:512:512", 8).expect("cluster");
    let mut config = keel_sim::SimConfig::new(nodes, workload);
    config.round_s = 360.0;
    config.progress_interval_s = 2400.0;
    config.keep_log = true;
    let fifo = keel_scheduling::policy::Fifo::new(Default::default());
    let mut report = keel_sim::simulate(&config, &fifo);
    let log = std::mem::take(&mut report.log);
    drop(report);
    let entries = log.len();
    println!(
        "history: {jobs} jobs, {entries} entries, simulated in {:.1} s",
        started.elapsed().as_secs_f64()
    );

    let dir = tempfile::tempdir().expect("tempdir");
    let data = dir.path().join("data");
    let started = Instant::now();
    {
        let data_dir = keel_storage::DataDir::open(&data).expect("data dir");
        let rt = tokio::runtime::Runtime::new().expect("runtime");
        let mut sm = StateMachineStore::open(&data_dir.state_dir()).expect("open");
        let mut log = log.into_iter();
        let mut written = 0usize;
        loop {
            let batch: Vec<Entry> = log
                .by_ref()
                .take(64)
                .map(|(index, e)| Entry {
                    log_id: LogId::new(CommittedLeaderId::new(1, 1), index),
                    payload: EntryPayload::Normal(Proposal::new(vec![e])),
                })
                .collect();
            if batch.is_empty() {
                break;
            }
            written += batch.len();
            rt.block_on(sm.apply(batch)).expect("apply");
            // Bounded: the journal writer's queue drained now and then,
            // as a replica's pace bounds it.
            if written % 65_536 < 64 {
                sm.flush().expect("flush");
            }
        }
        sm.flush().expect("flush");
    }
    println!(
        "written to a journal in {:.1} s",
        started.elapsed().as_secs_f64()
    );

    for policies in ["recorded", "recorded,fifo,srjf,tiresias"] {
        let started = Instant::now();
        let out = Command::new(KEEL)
            .args(["whatif", "--policy", policies])
            .args(["--round-s", "360", "--progress-interval-s", "2400"])
            .arg("--data-dir")
            .arg(&data)
            .output()
            .expect("run keel whatif");
        let wall_s = started.elapsed().as_secs_f64();
        assert!(
            out.status.success(),
            "{}",
            String::from_utf8_lossy(&out.stderr)
        );
        println!("{}", String::from_utf8_lossy(&out.stdout));
        println!("keel whatif --policy {policies}: {wall_s:.1} s");
    }
}
