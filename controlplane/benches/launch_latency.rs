//! Launch latency per executor: from the entry that allocates a job
//! (`JobAllocated`) to the entry that records its worker running
//! (`WorkerStarted`), both stamped by the leader's clock, over N one-GPU
//! jobs (`sleep 2` workers) on a real `keel server` with 8 GPUs, read
//! back from `keel events`. Executors, in one run:
//!
//! - local: workers under `keel supervise`, 8 simulated GPUs;
//! - SSH on loopback: a real sshd on 127.0.0.1 (the tests' fixture), one
//!   node of 8 declared GPUs, workers under the helper's shell supervisor.
//!
//! Run: `cargo bench -p keel --bench launch_latency`
//! (`KEEL_LAUNCH_JOBS` sets N; default 100. Needs `sshd`.)

#![allow(clippy::print_stdout)]

use std::collections::BTreeMap;
use std::time::Instant;

// The end-to-end tests' server process and bounded waits.
#[path = "../tests/support/mod.rs"]
mod support;

use support::{wait_for, ServerProcess};

#[path = "../../executors/tests/support/sshd.rs"]
mod sshd;

fn percentile(sorted: &[u64], p: f64) -> u64 {
    let i = ((sorted.len() as f64 - 1.0) * p).round() as usize;
    sorted.get(i).copied().unwrap_or(0)
}

fn main() {
    let jobs: usize = std::env::var("KEEL_LAUNCH_JOBS")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(100);
    measure("local executor", jobs, |_| {
        vec!["--simulated-gpus".to_string(), "8xv100".to_string()]
    });
    let sshd = sshd::Sshd::start();
    measure("SSH executor, loopback", jobs, |dir| {
        let nodes = dir.join("nodes.yaml");
        std::fs::write(
            &nodes,
            format!(
                "known_hosts: accept\nknown_hosts_file: {kh}\nnodes:\n  - name: lo\n    host: 127.0.0.1\n    port: {port}\n    user: {user}\n    key: {key}\n    gpus: 8xv100\n    work_dir: {work}\n",
                kh = dir.join("known_hosts").display(),
                port = sshd.port,
                user = sshd.user,
                key = sshd.key.display(),
                work = dir.join("work").display(),
            ),
        )
        .expect("nodes file");
        vec!["--ssh-nodes".to_string(), nodes.display().to_string()]
    });
}

/// Runs `jobs` one-GPU jobs on a server started with `args(dir)` and prints
/// the latencies.
fn measure(executor: &str, jobs: usize, args: impl Fn(&std::path::Path) -> Vec<String>) {
    let dir = tempfile::tempdir().expect("tempdir");
    let args = args(dir.path());
    let args: Vec<&str> = args.iter().map(String::as_str).collect();
    let server = ServerProcess::start(&dir.path().join("data"), &args);
    let spec = dir.path().join("job.yaml");
    std::fs::write(&spec, "name: launch\ncommand: [sleep, \"2\"]\ngpus: 1\n").expect("spec");
    let spec = spec.to_str().expect("utf-8");
    let started = Instant::now();
    for _ in 0..jobs {
        server.cli_ok(&["submit", "-f", spec]);
    }
    wait_for("every job to finish", || {
        let out = server.cli_ok(&["jobs", "--state", "succeeded", "-o", "json"]);
        let done: serde_json::Value = serde_json::from_str(&out).ok()?;
        (done.as_array()?.len() >= jobs).then_some(())
    });
    let wall = started.elapsed();
    let (allocated, running) = entry_times(&server);
    let mut latencies: Vec<u64> = running
        .iter()
        .filter_map(|(job, at)| Some(at.saturating_sub(*allocated.get(job)?)))
        .collect();
    latencies.sort_unstable();
    assert_eq!(latencies.len(), jobs, "a latency per job");
    println!(
        "launch_latency ({executor}): {} jobs, allocated -> worker running: p50 {} ms, p99 {} ms, max {} ms ({:.1} s in all)",
        latencies.len(),
        percentile(&latencies, 0.5),
        percentile(&latencies, 0.99),
        latencies.last().copied().unwrap_or(0),
        wall.as_secs_f64()
    );
    server.terminate();
}

/// Per job: the time of the entry that first allocated it, and of the
/// entry that first recorded its worker running.
fn entry_times(server: &ServerProcess) -> (BTreeMap<u64, u64>, BTreeMap<u64, u64>) {
    let mut allocated = BTreeMap::new();
    let mut running = BTreeMap::new();
    for line in server.cli_ok(&["events", "-o", "json"]).lines() {
        let record: serde_json::Value =
            serde_json::from_str(line).expect("one JSON object per line");
        let at = record["at_ms"].as_u64().unwrap_or(0);
        for event in record["events"].as_array().into_iter().flatten() {
            for (kind, e) in event["kind"].as_object().into_iter().flatten() {
                let Some(job) = e["job_id"].as_u64() else {
                    continue;
                };
                match kind.as_str() {
                    "job_allocated" => {
                        allocated.entry(job).or_insert(at);
                    }
                    "worker_started" => {
                        running.entry(job).or_insert(at);
                    }
                    _ => {}
                }
            }
        }
    }
    (allocated, running)
}
