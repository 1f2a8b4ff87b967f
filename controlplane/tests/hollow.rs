//! Hollow nodes (issue 26): a real `keel server --hollow` on simulated
//! nodes places, launches, follows and ends real jobs without starting a
//! process per worker, and a server killed with kill -9 and started again
//! re-adopts the runs it left.

use keel_proto::api::{self, keel_client::KeelClient};
use keel_proto::entry::JobSpec;

mod support;

use support::{wait_for, ServerProcess, KEEL};

/// The processes whose parent is `pid`.
fn children(pid: u32) -> Vec<u32> {
    let Ok(tasks) = std::fs::read_dir(format!("/proc/{pid}/task")) else {
        return Vec::new();
    };
    tasks
        .flatten()
        .filter_map(|t| std::fs::read_to_string(t.path().join("children")).ok())
        .flat_map(|c| {
            c.split_whitespace()
                .filter_map(|p| p.parse().ok())
                .collect::<Vec<u32>>()
        })
        .collect()
}

/// A `keel trainer` job of `workers` × `gpus_per_worker` GPUs.
fn trainer_spec(
    name: String,
    gpus_per_worker: u32,
    workers: u32,
    steps: u64,
    speedup: &str,
) -> JobSpec {
    JobSpec {
        name,
        command: ["keel", "trainer", "--speedup", speedup]
            .map(String::from)
            .to_vec(),
        gpus_per_worker,
        min_workers: workers,
        max_workers: workers,
        model: "resnet50".into(),
        total_steps: Some(steps),
        ..Default::default()
    }
}

async fn submit(url: &str, specs: Vec<JobSpec>) -> Vec<u64> {
    let mut client = KeelClient::connect(url.to_string()).await.expect("connect");
    let mut ids = Vec::new();
    for spec in specs {
        let id = client
            .submit_job(api::SubmitJobRequest {
                spec: Some(spec),
                request_id: String::new(),
            })
            .await
            .expect("submitted")
            .into_inner()
            .job_id;
        ids.push(id);
    }
    ids
}

fn states(server: &ServerProcess) -> Vec<(u64, String)> {
    server
        .json(&["jobs"])
        .as_array()
        .expect("jobs")
        .iter()
        .map(|j| {
            (
                j["id"].as_u64().expect("id"),
                j["state"].as_str().expect("state").to_string(),
            )
        })
        .collect()
}

/// The `worker_started` entries of job `id`'s history.
fn starts(server: &ServerProcess, id: u64) -> usize {
    server.json(&["job", &id.to_string()])["history"]
        .as_array()
        .expect("history")
        .iter()
        .filter(|e| e["command"] == "record_worker_started")
        .count()
}

const ARGS: &[&str] = &[
    "--hollow",
    "--simulated-gpus",
    "256xv100,256xk80",
    "--simulated-nodes",
    "64",
    "--round-s",
    "0.2",
    "--progress-interval-s",
    "0.2",
    "--http-listen",
    "off",
];

#[test]
fn hollow_nodes_run_jobs_without_a_process_each_and_a_restarted_server_readopts_their_runs() {
    let dir = tempfile::tempdir().expect("tempdir");
    let data = dir.path().join("data");
    let server = ServerProcess::start(&data, ARGS);
    wait_for("the 64 nodes registered by heartbeat", || {
        (server.json(&["nodes"]).as_array().map(Vec::len) == Some(64)).then_some(())
    });

    // One run long enough to be running when the server is killed, and 150
    // short ones of one to eight GPUs (two workers for the larger ones).
    let url = format!("http://{}", server.addr);
    let runtime = tokio::runtime::Runtime::new().expect("runtime");
    let long = runtime.block_on(submit(
        &url,
        vec![trainer_spec("long".into(), 4, 2, 1_000_000, "50")],
    ))[0];
    let specs = (0..150u32)
        .map(|i| {
            let gpus = 1 + i % 8;
            let (per_worker, workers) = if gpus > 4 {
                (gpus.div_ceil(2), 2)
            } else {
                (gpus, 1)
            };
            trainer_spec(format!("short-{i}"), per_worker, workers, 2_000, "200")
        })
        .collect();
    let short = runtime.block_on(submit(&url, specs));
    assert_eq!(short.len(), 150);

    let mut most_running = 0;
    let finished = wait_for("every short job to succeed", || {
        assert!(
            children(server.pid()).is_empty(),
            "a hollow server starts no process: {:?}",
            children(server.pid())
        );
        let now = states(&server);
        most_running = most_running.max(now.iter().filter(|(_, s)| s == "running").count());
        let done = now
            .iter()
            .filter(|(id, s)| short.contains(id) && s == "succeeded")
            .count();
        (done == short.len()).then_some(now)
    });
    assert!(
        most_running > 10,
        "jobs ran side by side: at most {most_running}"
    );
    assert!(finished.iter().any(|(id, s)| *id == long && s == "running"));
    let job = server.json(&["job", &long.to_string()]);
    let before = job["progress"]["step"].as_u64().expect("a step");
    assert!(before > 0, "{job}");
    assert_eq!(starts(&server, long), 2, "two workers started once");

    // kill -9, and the same server again: the run goes on where the clock
    // says (its first progress after the restart is past where it was),
    // with no worker started again.
    // The long job's runs as the hollow executor journalled their launches.
    let launches = || -> Vec<serde_json::Value> {
        let text = std::fs::read_to_string(data.join("hollow/runs.jsonl")).expect("the journal");
        text.lines()
            .filter_map(|l| serde_json::from_str::<serde_json::Value>(l).ok())
            .filter_map(|l| l.get("launched").cloned())
            .filter(|l| l["worker"]["job_id"] == long)
            .collect()
    };
    let launched = launches();
    assert_eq!(launched.len(), 2, "{launched:?}");
    let killed_ms = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .expect("clock")
        .as_millis() as u64;
    server.kill9();
    let server = ServerProcess::start(&data, ARGS);
    let after = wait_for("the long run's first progress after the restart", || {
        let progress = server.json(&["job", &long.to_string()])["progress"].clone();
        (progress["at_ms"].as_u64()? > killed_ms).then(|| progress["step"].as_u64())?
    });
    assert!(after > before, "at step {after}, was at {before}");
    assert_eq!(
        launches(),
        launched,
        "the runs were re-adopted as they were, not launched again"
    );
    let job = server.json(&["job", &long.to_string()]);
    assert_eq!(job["state"], "running", "{job}");
    assert_eq!(
        starts(&server, long),
        2,
        "re-adopted, not launched again: {job}"
    );
    assert!(children(server.pid()).is_empty());

    // A cancelled run is stopped like a process: its exit is recorded.
    server.cli_ok(&["cancel", &long.to_string()]);
    wait_for("the long run's workers to exit", || {
        let job = server.json(&["job", &long.to_string()]);
        let workers = job["workers"].as_array()?.clone();
        (job["state"] == "cancelled" && workers.iter().all(|w| w["state"] == "exited"))
            .then_some(())
    });
    server.terminate();
}

/// `--hollow` needs simulated GPUs and runs no other executor: refused,
/// naming the flags, before anything is made.
#[test]
fn hollow_without_simulated_gpus_or_beside_another_executor_is_refused() {
    let dir = tempfile::tempdir().expect("tempdir");
    let data = dir.path().join("data");
    let data_s = data.to_str().expect("utf-8");
    for (extra, named) in [
        (vec![], "--simulated-gpus"),
        (
            vec!["--simulated-gpus", "8xv100", "--no-local-node"],
            "--no-local-node",
        ),
        (
            vec!["--simulated-gpus", "8xv100", "--kubernetes"],
            "--kubernetes",
        ),
    ] {
        let out = std::process::Command::new(KEEL)
            .args(["server", "--hollow", "--data-dir", data_s])
            .args(&extra)
            .output()
            .expect("keel server");
        assert!(!out.status.success(), "{extra:?} was taken");
        let err = String::from_utf8_lossy(&out.stderr);
        assert!(err.contains(named), "{extra:?}: {err}");
        assert!(!data.exists(), "{extra:?} made a data directory");
    }
}
