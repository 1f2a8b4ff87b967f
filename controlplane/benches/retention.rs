//! Retention on a live server (issue 23, item 5): N short jobs (`true`
//! workers) through a real `keel server` with 16 simulated GPUs, at most 64
//! unfinished at a time, with `--retain-finished-s` and
//! `--retain-finished-max` set; every few seconds the jobs the state holds
//! and the last snapshot's size, from `ClusterStatus`. Without retention
//! both grow with every job; with it they stay bounded.
//!
//! Run: `cargo bench -p keel --bench retention`
//! (`KEEL_RETENTION_JOBS` sets N, default 20,000;
//! `KEEL_RETENTION_FLAGS` the retention flags, default
//! `--retain-finished-s 30 --retain-finished-max 1000`; `none` for none).

#![allow(clippy::print_stdout)]

use std::time::{Duration, Instant};

// The end-to-end tests' server process.
#[path = "../tests/support/mod.rs"]
mod support;

use keel_proto::api::{self, keel_client::KeelClient};
use keel_proto::entry::JobSpec;
use support::ServerProcess;

const UNFINISHED_MAX: u64 = 64;

fn main() {
    let jobs: u64 = std::env::var("KEEL_RETENTION_JOBS")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(20_000);
    let flags = std::env::var("KEEL_RETENTION_FLAGS")
        .unwrap_or_else(|_| "--retain-finished-s 30 --retain-finished-max 1000".into());
    let mut args = vec![
        "--simulated-gpus",
        "16xv100",
        "--simulated-nodes",
        "2",
        "--round-s",
        "0.2",
        // Commands share Raft entries (group commit): snapshots often
        // enough to see their size move.
        "--snapshot-every",
        "500",
    ];
    if flags != "none" {
        args.extend(flags.split_whitespace());
    } else {
        args.extend(["--retain-finished-s", "0", "--retain-finished-max", "0"]);
    }
    let dir = tempfile::tempdir().expect("tempdir");
    let data = dir.path().join("data");
    let _reaper = support::WorkerReaper(data.clone());
    let server = ServerProcess::start(&data, &args);
    let addr = format!("http://{}", server.addr);
    let rt = tokio::runtime::Runtime::new().expect("runtime");
    println!("retention ({flags}): {jobs} jobs");
    println!(
        "| elapsed (s) | submitted | jobs in state | of them finished | last snapshot (bytes) |"
    );
    println!("|---:|---:|---:|---:|---:|");
    rt.block_on(async move {
        let mut client = KeelClient::connect(addr).await.expect("connect");
        let started = Instant::now();
        let mut submitted = 0u64;
        let mut next_sample = Duration::ZERO;
        let mut largest = (0u64, 0u64);
        loop {
            let status = client
                .cluster_status(api::ClusterStatusRequest {})
                .await
                .expect("status")
                .into_inner();
            let unfinished = status.jobs_in_state - status.finished_jobs_in_state;
            largest = (
                largest.0.max(status.jobs_in_state),
                largest.1.max(status.snapshot_bytes),
            );
            let elapsed = started.elapsed();
            let done = submitted == jobs && unfinished == 0;
            if elapsed >= next_sample || done {
                println!(
                    "| {:.0} | {submitted} | {} | {} | {} |",
                    elapsed.as_secs_f64(),
                    status.jobs_in_state,
                    status.finished_jobs_in_state,
                    status.snapshot_bytes
                );
                next_sample = elapsed + Duration::from_secs(15);
            }
            if done {
                println!(
                    "retention: {jobs} jobs in {:.0} s; at most {} jobs in the state, at most {} bytes of snapshot",
                    elapsed.as_secs_f64(),
                    largest.0,
                    largest.1
                );
                break;
            }
            let room = UNFINISHED_MAX.saturating_sub(unfinished).min(jobs - submitted);
            let submissions = (0..room).map(|i| {
                let mut client = client.clone();
                let name = format!("short-{}", submitted + i);
                async move {
                    client
                        .submit_job(api::SubmitJobRequest {
                            spec: Some(JobSpec {
                                name,
                                command: vec!["true".into()],
                                gpus_per_worker: 1,
                                min_workers: 1,
                                max_workers: 1,
                                ..Default::default()
                            }),
                            request_id: String::new(),
                        })
                        .await
                        .expect("submitted");
                }
            });
            futures::future::join_all(submissions).await;
            submitted += room;
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
    });
    server.terminate();
}
