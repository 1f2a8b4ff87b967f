//! Backup and restore at scale (issue 25): a state of 100,000 jobs on
//! 1,000 nodes of 8 GPUs (8,000 of the jobs running, the rest waiting),
//! written as a snapshot file; then, with the real binary:
//! `keel snapshot restore` into an empty data directory, `keel server` on
//! it (start to answering as the leader: a replica's restart with that
//! state), `keel snapshot save` through the API (a linearizable read, the
//! state encoded, sent in pieces, checked and written) and `keel snapshot
//! inspect`. Then the same restart with `KEEL_BACKUP_JOURNAL` (default
//! 1,000,000) progress entries applied after the snapshot: the worst
//! case, every one of them replayed from the journal at the start (a
//! server snapshots every `--snapshot-every` entries, 10,000 by default,
//! so a real restart replays at most that many). Wall times, the file's
//! size, the data directory's and the server's RSS.
//!
//! Run: `cargo bench -p keel --bench backup` (`KEEL_BACKUP_JOBS`,
//! `KEEL_BACKUP_NODES`, `KEEL_BACKUP_JOURNAL` change the sizes).

#![allow(clippy::print_stdout)]

use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use keel_proto::api;
use keel_state::command::{Command as Cmd, JobPlacement, LogEntry};
use keel_state::model::{Gpu, GpuRef};
use keel_state::ClusterState;
use prost::Message;

mod common;

use common::{count, KEEL};

/// The state: `nodes` nodes of 8 GPUs, `jobs` one-GPU jobs, the first
/// 8 × `nodes` of them placed.
fn state(nodes: u64, jobs: u64) -> ClusterState {
    let mut state = ClusterState::new();
    let mut index = 0u64;
    let mut apply = |state: &mut ClusterState, command: Cmd| {
        index += 1;
        let _ = state.apply(index, &LogEntry::new(1_700_000_000_000 + index, command));
    };
    for n in 0..nodes {
        apply(
            &mut state,
            Cmd::register_node(
                format!("gpu-{n:04}"),
                format!("10.1.{}.{}:7070", n / 250, n % 250),
                (0..8)
                    .map(|index| Gpu {
                        index,
                        gpu_type: if n % 2 == 0 { "a100" } else { "v100" }.into(),
                    })
                    .collect(),
            ),
        );
    }
    for j in 0..jobs {
        apply(
            &mut state,
            Cmd::submit_job(keel_state::fixtures::job_spec(&format!("job-{j}"), 1, 1)),
        );
    }
    let mut job = 1u64;
    for n in 0..nodes {
        let placements = (0..8)
            .filter_map(|index| {
                let id = job;
                job += 1;
                (id <= jobs).then(|| {
                    JobPlacement::alone(
                        id,
                        vec![GpuRef {
                            node: format!("gpu-{n:04}"),
                            index,
                        }],
                    )
                })
            })
            .collect();
        apply(
            &mut state,
            Cmd::decide_allocation(0, "fifo", n + 1, placements),
        );
    }
    state
}

fn timed(args: &[&str]) -> Duration {
    let started = Instant::now();
    let out = Command::new(KEEL).args(args).output().expect("keel");
    let took = started.elapsed();
    assert!(
        out.status.success(),
        "keel {args:?}: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    took
}

fn rss_mib(pid: u32) -> f64 {
    common::status_mib(pid, "VmRSS:")
}

/// Applies `entries` progress reports of the running jobs to the state
/// machine of the data directory `data` (no server on it), after its
/// last applied entry, as a leader's would be.
fn journal(data: &std::path::Path, entries: u64, running: u64) {
    use keel_state::command::Proposal;
    use keel_state::model::ProgressSample;
    use openraft::storage::RaftStateMachine;
    use openraft::{CommittedLeaderId, EntryPayload, LogId};
    let rt = tokio::runtime::Runtime::new().expect("runtime");
    rt.block_on(async {
        let mut sm = keel_storage::StateMachineStore::open(&data.join("state")).expect("state");
        let (from, leader) = {
            let shared = sm.shared();
            let applied = shared.read();
            let last = applied.last_applied.expect("restored");
            (last.index + 1, last.leader_id)
        };
        let mut index = from;
        while index < from + entries {
            let batch: Vec<keel_storage::Entry> = (index..(index + 1000).min(from + entries))
                .map(|i| {
                    let at_ms = 1_800_000_000_000 + i;
                    keel_storage::Entry {
                        log_id: LogId::new(CommittedLeaderId::new(leader.term, leader.node_id), i),
                        payload: EntryPayload::Normal(Proposal::new(vec![LogEntry::new(
                            at_ms,
                            Cmd::report_progress(
                                1 + i % running,
                                vec![ProgressSample {
                                    step: i,
                                    total_steps: u64::MAX / 2,
                                    loss: Some(1.0),
                                    samples_per_s: 250.0,
                                    at_ms,
                                }],
                            ),
                        )])),
                    }
                })
                .collect();
            index += batch.len() as u64;
            sm.apply(batch).await.expect("apply");
        }
        sm.flush().expect("flush");
    });
}

fn du_mib(path: &std::path::Path) -> f64 {
    fn walk(p: &std::path::Path) -> u64 {
        match std::fs::symlink_metadata(p) {
            Ok(m) if m.is_dir() => std::fs::read_dir(p)
                .map(|d| d.flatten().map(|e| walk(&e.path())).sum())
                .unwrap_or(0),
            Ok(m) => m.len(),
            Err(_) => 0,
        }
    }
    walk(path) as f64 / (1024.0 * 1024.0)
}

/// Starts `keel server` on `data` at `addr`; returns it and how long it
/// took to answer as the leader.
fn serve(data: &str, addr: &str) -> (std::process::Child, Duration) {
    let started = Instant::now();
    let server = Command::new(KEEL)
        .args(["server", "--data-dir", data, "--id", "1", "--listen", addr])
        .args([
            "--no-local-node",
            "--http-listen",
            "off",
            "--node-timeout-s",
            "3600",
        ])
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .expect("keel server");
    loop {
        let out = Command::new(KEEL)
            .args(["cluster", "status", "-o", "json", "--addr", addr])
            .output()
            .expect("keel cluster status");
        if out.status.success() && String::from_utf8_lossy(&out.stdout).contains("\"leader\"") {
            break;
        }
        assert!(
            started.elapsed() < Duration::from_secs(600),
            "the server did not serve"
        );
        std::thread::sleep(Duration::from_millis(20));
    }
    (server, started.elapsed())
}

fn main() {
    let nodes = count("KEEL_BACKUP_NODES", 1_000);
    let jobs = count("KEEL_BACKUP_JOBS", 100_000);
    let journal_entries = count("KEEL_BACKUP_JOURNAL", 1_000_000);
    let dir = tempfile::tempdir().expect("tempdir");
    let built = Instant::now();
    let state = state(nodes, jobs);
    let built = built.elapsed();
    assert_eq!(state.jobs().len() as u64, jobs);
    let file = api::SnapshotFile {
        format: keel::api::SNAPSHOT_FILE_FORMAT,
        cluster_id: "bench".into(),
        index: nodes * 2 + jobs,
        term: 1,
        state_hash: state.state_hash().to_string(),
        taken_at_ms: 1_700_000_000_000,
        taken_by_member: 1,
        members: Vec::new(),
        state: keel_storage::snapshot_codec::encode_snapshot(&state),
    };
    let path = dir.path().join("state.snap");
    std::fs::write(&path, file.encode_to_vec()).expect("write");
    let bytes = std::fs::metadata(&path).map(|m| m.len()).unwrap_or(0);
    let path = path.to_str().expect("utf-8").to_string();
    let port = std::net::TcpListener::bind("127.0.0.1:0")
        .and_then(|l| l.local_addr())
        .expect("a port")
        .port();
    let addr = format!("127.0.0.1:{port}");
    let data = dir.path().join("data");
    let data = data.to_str().expect("utf-8").to_string();

    let inspect = timed(&["snapshot", "inspect", &path]);
    let restore = timed(&[
        "snapshot",
        "restore",
        &path,
        "--data-dir",
        &data,
        "--id",
        "1",
        "--member-addr",
        &addr,
    ]);
    let (mut server, serving) = serve(&data, &addr);
    let rss = rss_mib(server.id());
    let saved = dir.path().join("saved.snap");
    let saved = saved.to_str().expect("utf-8").to_string();
    let save = timed(&["snapshot", "save", &saved, "--addr", &addr]);
    let _ = server.kill();
    let _ = server.wait();
    let running = (nodes * 8).min(jobs).max(1);
    let journaled = Instant::now();
    journal(std::path::Path::new(&data), journal_entries, running);
    let journaled = journaled.elapsed();
    let data_mib = du_mib(std::path::Path::new(&data));
    let (mut server, replayed) = serve(&data, &addr);
    let replayed_rss = rss_mib(server.id());
    let out = Command::new(KEEL)
        .args(["cluster", "status", "-o", "json", "--addr", &addr])
        .output()
        .expect("keel cluster status");
    let status: serde_json::Value = serde_json::from_slice(&out.stdout).expect("status");
    let applied = status["last_applied_index"].as_u64().unwrap_or(0);
    assert!(
        applied >= file.index + journal_entries,
        "every journal entry applied: {applied} against {} + {journal_entries}",
        file.index
    );
    let _ = server.kill();
    let _ = server.wait();
    println!(
        "backup and restore: {jobs} jobs, {nodes} nodes of 8 GPUs ({} running)",
        (nodes * 8).min(jobs)
    );
    println!("| step | wall time |");
    println!("|---|---:|");
    println!(
        "| the state built by apply (in process) | {:.2} s |",
        built.as_secs_f64()
    );
    println!(
        "| `keel snapshot inspect` (read, decode, hash) | {:.2} s |",
        inspect.as_secs_f64()
    );
    println!(
        "| `keel snapshot restore` | {:.2} s |",
        restore.as_secs_f64()
    );
    println!(
        "| `keel server` on it, start to answering as leader | {:.2} s |",
        serving.as_secs_f64()
    );
    println!(
        "| `keel snapshot save` through the API | {:.2} s |",
        save.as_secs_f64()
    );
    println!(
        "| {journal_entries} progress entries applied to its state machine (in process) | {:.2} s |",
        journaled.as_secs_f64()
    );
    println!(
        "| `keel server` on it, every one replayed from the journal, start to answering as leader | {:.2} s |",
        replayed.as_secs_f64()
    );
    println!("file: {bytes} bytes; the server's RSS once serving: {rss:.0} MiB; with the journal: data directory {data_mib:.0} MiB, RSS {replayed_rss:.0} MiB");
}
