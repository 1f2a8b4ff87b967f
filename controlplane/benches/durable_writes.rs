//! Durable submissions through a single replica, over gRPC on loopback, with
//! 1 and with 64 concurrent clients (each on its own connection), beside the
//! disk's physical limit measured in the same run: one `fdatasync` per write,
//! and one per batch of 64 writes.
//!
//! Run: `cargo bench -p keel --bench durable_writes`
//! (`KEEL_BENCH_SECONDS` sets each phase's length; default 5.)

#![allow(clippy::print_stdout)]

use std::io::Write;
use std::time::{Duration, Instant};

use keel::api::system_clock;
use keel::raft_node::RaftSettings;
use keel::server::{Server, ServerConfig};
use keel_proto::api::{keel_client::KeelClient, SubmitJobRequest};
use keel_proto::entry::JobSpec;

fn percentile(sorted: &[Duration], p: f64) -> Duration {
    if sorted.is_empty() {
        return Duration::ZERO;
    }
    let i = ((sorted.len() as f64 - 1.0) * p).round() as usize;
    sorted[i.min(sorted.len() - 1)]
}

/// Waits for load tasks and summarises their latencies; each latency is one
/// entry.
async fn collect(
    what: String,
    start: Instant,
    tasks: Vec<tokio::task::JoinHandle<Vec<Duration>>>,
) -> Row {
    let mut latencies = Vec::new();
    for t in tasks {
        latencies.extend(t.await.expect("load task"));
    }
    let entries = latencies.len();
    row(what, latencies, entries, start.elapsed().as_secs_f64())
}

fn row(what: String, mut latencies: Vec<Duration>, entries: usize, wall: f64) -> Row {
    latencies.sort();
    Row {
        what,
        per_s: entries as f64 / wall,
        p50: percentile(&latencies, 0.5),
        p99: percentile(&latencies, 0.99),
    }
}

struct Row {
    what: String,
    per_s: f64,
    p50: Duration,
    p99: Duration,
}

/// Appends `batch` records of `record_bytes` and fdatasyncs, for `secs`.
fn fdatasync_limit(dir: &std::path::Path, batch: usize, record_bytes: usize, secs: f64) -> Row {
    let path = dir.join(format!("sync-{batch}"));
    let mut f = std::fs::File::create(&path).expect("create");
    let record = vec![0xabu8; record_bytes];
    let mut latencies = Vec::new();
    let start = Instant::now();
    while start.elapsed().as_secs_f64() < secs {
        let t = Instant::now();
        for _ in 0..batch {
            f.write_all(&record).expect("write");
        }
        f.sync_data().expect("fdatasync");
        latencies.push(t.elapsed());
    }
    let entries = latencies.len() * batch;
    row(
        format!("fdatasync, 1 per {batch} write(s) of {record_bytes} B"),
        latencies,
        entries,
        start.elapsed().as_secs_f64(),
    )
}

fn spec(i: usize) -> JobSpec {
    JobSpec {
        name: format!("bench-{i}"),
        user: "bench".into(),
        command: vec!["python3".into(), "train.py".into()],
        gpus_per_worker: 1,
        min_workers: 1,
        max_workers: 1,
        model: "resnet50".into(),
        total_steps: Some(1000),
        ..Default::default()
    }
}

async fn submissions(addr: &str, clients: usize, secs: f64) -> Row {
    let mut tasks = Vec::new();
    let start = Instant::now();
    for c in 0..clients {
        let url = format!("http://{addr}");
        tasks.push(tokio::spawn(async move {
            let mut client = KeelClient::connect(url).await.expect("connect");
            let mut latencies = Vec::new();
            let mut i = c * 1_000_000;
            while start.elapsed().as_secs_f64() < secs {
                let t = Instant::now();
                client
                    .submit_job(SubmitJobRequest {
                        spec: Some(spec(i)),
                        request_id: String::new(),
                    })
                    .await
                    .expect("submit");
                latencies.push(t.elapsed());
                i += 1;
            }
            latencies
        }));
    }
    collect(format!("keel submit, {clients} client(s)"), start, tasks).await
}

async fn proposals(proposer: &keel::proposer::Proposer, tasks: usize, secs: f64) -> Row {
    let start = Instant::now();
    let mut handles = Vec::new();
    for t in 0..tasks {
        let proposer = proposer.clone();
        handles.push(tokio::spawn(async move {
            let mut latencies = Vec::new();
            let mut i = t * 1_000_000;
            while start.elapsed().as_secs_f64() < secs {
                let spec = keel_state::codec::spec_from_proto(spec(i));
                let t0 = Instant::now();
                proposer
                    .propose(keel_state::Command::submit_job(spec))
                    .await
                    .expect("propose");
                latencies.push(t0.elapsed());
                i += 1;
            }
            latencies
        }));
    }
    collect(
        format!("proposer in-process, {tasks} task(s)"),
        start,
        handles,
    )
    .await
}

fn main() {
    let secs: f64 = std::env::var("KEEL_BENCH_SECONDS")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or(5.0);
    // Same disk as the project's target directory.
    let base = std::path::PathBuf::from(env!("CARGO_TARGET_TMPDIR"));
    std::fs::create_dir_all(&base).expect("tmpdir");
    let dir = tempfile::tempdir_in(&base).expect("tempdir");
    let rt = tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
        .expect("runtime");
    let mut rows = vec![
        fdatasync_limit(dir.path(), 1, 200, secs),
        fdatasync_limit(dir.path(), 64, 200, secs),
    ];
    rt.block_on(async {
        let config = ServerConfig {
            id: 1,
            data_dir: dir.path().join("data"),
            listen: "127.0.0.1:0".parse().expect("addr"),
            peers: Default::default(),
            raft: RaftSettings::default(),
            // No GPUs: the scheduling loop runs but places nothing, so the
            // figure is the write path's.
            nodes: Vec::new(),
            executor_dir: None,
            gpu_kernel_log: None,
            worker_logs: Default::default(),
            retention: keel::retention::Retention::keep_all(),
            ssh: None,
            kubernetes: None,
            hollow: false,
            policy: std::sync::Arc::new(keel_scheduling::policy::Fifo::default()),
            policy_options: Default::default(),
            loops: keel::leader::LoopSettings::default(),
            removed_grace: std::time::Duration::from_secs(5),
            max_event_streams: keel::api::MAX_EVENT_STREAMS,
            max_api_requests: keel::admission::MAX_API_REQUESTS,
            acl: false,
            request_timeout: keel::admission::REQUEST_TIMEOUT,
            max_streams_per_connection: keel::server::MAX_STREAMS_PER_CONNECTION,
            worker_umask: None,
            http: keel::http::HttpListen::Off,
        };
        let server = Server::start(&config, system_clock()).await.expect("start");
        let addr = server.addr.to_string();
        let node = server.node.clone();
        let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
        let serving = tokio::spawn(server.serve(async {
            let _ = stopped.await;
        }));
        // Wait for leadership.
        let mut client = KeelClient::connect(format!("http://{addr}"))
            .await
            .expect("connect");
        while client
            .submit_job(SubmitJobRequest {
                spec: Some(spec(0)),
                request_id: String::new(),
            })
            .await
            .is_err()
        {
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
        rows.push(submissions(&addr, 1, secs).await);
        rows.push(submissions(&addr, 64, secs).await);
        // The same through the proposer in-process, without gRPC: what the
        // replica itself sustains when the load generator and the API do not
        // share its two cores.
        let proposer = keel::proposer::Proposer::spawn(node);
        rows.push(proposals(&proposer, 1, secs).await);
        rows.push(proposals(&proposer, 64, secs).await);
        let _ = stop.send(());
        let _ = serving.await;
    });
    println!();
    println!("| what | entries/s | p50 | p99 |");
    println!("|---|---:|---:|---:|");
    for r in &rows {
        println!(
            "| {} | {:.0} | {:.2} ms | {:.2} ms |",
            r.what,
            r.per_s,
            r.p50.as_secs_f64() * 1e3,
            r.p99.as_secs_f64() * 1e3
        );
    }
    println!();
    println!(
        "gRPC: 64 clients / 1 client: {:.1}x",
        rows[3].per_s / rows[2].per_s.max(1e-9)
    );
    println!(
        "in-process: 64 tasks / 1 task: {:.1}x",
        rows[5].per_s / rows[4].per_s.max(1e-9)
    );
}
