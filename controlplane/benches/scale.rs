//! Scale (issue 26, item 2): three real `keel server` replicas managing
//! hollow nodes (`--hollow`: workers real to the control plane, no process
//! each), 1,250 nodes of 8 GPUs by default, and many clients submitting
//! one- to eight-GPU `keel trainer` jobs as fast as they are acknowledged.
//!
//! Measured, on the client's clock: submissions/s (the first send to the
//! last acknowledgement), placements/s (a job's `JobAllocated` event seen
//! on the leader's event stream), the time from a job's acknowledgement to
//! its worker recorded running (`WorkerStarted` seen), p50 and p99; the
//! leader's CPU (user + system over the run, from `/proc`) and peak RSS;
//! log entries per placement (the leader's last log index moved, over the
//! placements). Jobs are short (`KEEL_SCALE_STEPS` of resnet50, 20 by
//! default: 1.8 s on one v100, 0.3 s on eight), so the cluster turns
//! over; the report says how many GPUs were busy at most, which tells a
//! run bound by the cluster's size from one bound by the control plane.
//!
//! Two variants: `KEEL_SCALE_PRELOAD=N` first runs N one-GPU jobs of two
//! steps through the cluster (acknowledged, placed, finished: N more jobs
//! in the state, kept by retention) before the measured phase;
//! `KEEL_SCALE_FAILOVER=1` kills the leader with kill -9 once half the
//! jobs are placed: clients send their request again (same request id) to
//! whichever replica leads next, the event stream resumes from the next
//! replica where it stopped, and the report adds the time from the kill to
//! the first placement committed after it (log time) and the GPUs ever
//! held by two jobs at once (from the events; must be 0).
//!
//! Run: `cargo bench -p keel --bench scale`. Sizes from the environment:
//! `KEEL_SCALE_NODES` (1250), `KEEL_SCALE_JOBS` (20000),
//! `KEEL_SCALE_CLIENTS` (64), `KEEL_SCALE_STEPS` (20),
//! `KEEL_SCALE_PRELOAD` (0), `KEEL_SCALE_FAILOVER` (0).

#![allow(clippy::print_stdout, clippy::print_stderr)]

use std::collections::BTreeMap;
use std::path::Path;
use std::process::Child;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use keel_proto::api::{
    keel_client::KeelClient, ClusterStatusRequest, ListNodesRequest, SubmitJobRequest,
    WatchEventsRequest,
};
use keel_proto::entry::{event::Kind, JobSpec};
use tonic::transport::Channel;

mod common;

use common::{count, percentile};

/// Three replicas sharing one executor directory, each declaring the same
/// hollow nodes (whichever leads runs their workers).
fn spawn_keel(dir: &Path, nodes: u64) -> (Vec<Child>, Vec<String>) {
    // One type: a worker's GPUs are of one type, so a node of 4 + 4
    // would take no single worker of more than 4.
    let gpus = format!("{}xv100", nodes * 8);
    common::spawn_three(dir, |_, command| {
        command
            .arg("--executor-dir")
            .arg(dir.join("executor"))
            .args(["--hollow", "--simulated-gpus", &gpus])
            .args(["--simulated-nodes", &nodes.to_string()])
            .args(["--round-s", "1", "--http-listen", "off"]);
    })
}

async fn client(addr: &str) -> KeelClient<Channel> {
    let endpoint = Channel::from_shared(format!("http://{addr}"))
        .expect("endpoint")
        .tcp_nodelay(true);
    KeelClient::new(endpoint.connect().await.expect("connect"))
}

/// The index of the replica that leads, once one does (`skip`: one known
/// dead).
async fn leader(addrs: &[String], skip: Option<usize>) -> usize {
    loop {
        for (i, a) in addrs.iter().enumerate() {
            if Some(i) == skip {
                continue;
            }
            let Ok(ch) = Channel::from_shared(format!("http://{a}"))
                .expect("endpoint")
                .connect()
                .await
            else {
                continue;
            };
            if let Ok(s) = KeelClient::new(ch)
                .cluster_status(ClusterStatusRequest {})
                .await
            {
                if s.into_inner().role == "leader" {
                    return i;
                }
            }
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

/// Job `i`: one worker of 1 to 8 GPUs, resnet50 for `steps` steps of
/// hollow training on v100s (about 11 steps/s on one, 68 on eight).
fn spec(i: u64, steps: u64) -> JobSpec {
    sized_spec(i, 1 + (i % 8) as u32, steps)
}

fn sized_spec(i: u64, gpus: u32, steps: u64) -> JobSpec {
    JobSpec {
        name: format!("scale-{i}"),
        command: ["keel", "trainer", "--speedup", "1"]
            .map(String::from)
            .to_vec(),
        gpus_per_worker: gpus,
        min_workers: 1,
        max_workers: 1,
        model: "resnet50".into(),
        total_steps: Some(steps),
        ..Default::default()
    }
}

/// User plus system CPU seconds of `pid` so far.
fn cpu_s(pid: u32) -> f64 {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).unwrap_or_default();
    // After the command's closing parenthesis: fields 14 and 15 (1-based)
    // are utime and stime, in clock ticks (100 a second on Linux).
    let rest = stat.rsplit_once(')').map_or("", |(_, r)| r);
    let fields: Vec<&str> = rest.split_whitespace().collect();
    let ticks = |n: usize| {
        fields
            .get(n)
            .and_then(|f| f.parse::<f64>().ok())
            .unwrap_or(0.0)
    };
    (ticks(11) + ticks(12)) / 100.0
}

/// Peak and current RSS of `pid`, MiB.
fn rss_mib(pid: u32) -> (f64, f64) {
    (
        common::status_mib(pid, "VmHWM:"),
        common::status_mib(pid, "VmRSS:"),
    )
}

/// What the event streams showed: when each job was placed, recorded
/// running and finished (first of each, on this process's clock), GPUs in
/// use, and any GPU given to a job while another held it.
#[derive(Default)]
struct Seen {
    /// The last entry taken: its Raft index and position in it (one Raft
    /// entry holds a proposal's batch).
    last: (u64, u32),
    /// Commands applied (a Raft entry holds a batch of them).
    commands: u64,
    allocated: BTreeMap<u64, Instant>,
    /// Log time (ms) and index of each placement.
    allocated_log: Vec<(u64, u64)>,
    started: BTreeMap<u64, Instant>,
    finished: BTreeMap<u64, Instant>,
    holder: BTreeMap<(String, u32), u64>,
    holding: BTreeMap<u64, Vec<(String, u32)>>,
    most_gpus_busy: usize,
    double_booked: u64,
}

impl Seen {
    fn release(&mut self, job: u64) {
        for gpu in self.holding.remove(&job).unwrap_or_default() {
            if self.holder.get(&gpu) == Some(&job) {
                self.holder.remove(&gpu);
            }
        }
    }

    fn take(&mut self, entry: keel_proto::entry::AppliedEntry, now: Instant) {
        if (entry.index, entry.position) <= self.last {
            return;
        }
        self.last = (entry.index, entry.position);
        self.commands += 1;
        for event in entry.events {
            match event.kind {
                Some(Kind::JobAllocated(a)) => {
                    self.allocated.entry(a.job_id).or_insert(now);
                    self.allocated_log.push((entry.at_ms, entry.index));
                    self.release(a.job_id);
                    let gpus: Vec<(String, u32)> =
                        a.gpus.into_iter().map(|g| (g.node, g.index)).collect();
                    for gpu in &gpus {
                        if let Some(other) = self.holder.insert(gpu.clone(), a.job_id) {
                            if other != a.job_id {
                                self.double_booked += 1;
                            }
                        }
                    }
                    self.holding.insert(a.job_id, gpus);
                    self.most_gpus_busy = self.most_gpus_busy.max(self.holder.len());
                }
                Some(Kind::WorkerStarted(w)) => {
                    self.started.entry(w.job_id).or_insert(now);
                }
                Some(Kind::JobFinished(f)) => {
                    self.finished.entry(f.job_id).or_insert(now);
                    self.release(f.job_id);
                }
                Some(Kind::JobCancelled(c)) => self.release(c.job_id),
                Some(Kind::JobPreempted(p)) => self.release(p.job_id),
                Some(Kind::JobRequeued(r)) => self.release(r.job_id),
                _ => {}
            }
        }
    }
}

/// Who leads now, as the clients and the event stream follow it.
struct Cluster {
    addrs: Vec<String>,
    leader: tokio::sync::RwLock<usize>,
    /// The replica killed (never asked again).
    dead: std::sync::Mutex<Option<usize>>,
}

impl Cluster {
    async fn leader_addr(&self) -> String {
        self.addrs[*self.leader.read().await].clone()
    }

    /// Finds the leader again after `was` stopped answering.
    async fn follow(&self, was: usize) {
        let mut now = self.leader.write().await;
        if *now != was {
            return;
        }
        let dead = *self.dead.lock().expect("dead");
        *now = leader(&self.addrs, dead).await;
    }
}

/// Streams the leader's applied entries into `seen` from `from_index`,
/// following the leadership when the stream breaks.
async fn watch(cluster: Arc<Cluster>, seen: Arc<Mutex<Seen>>, from_index: u64) {
    loop {
        let lead = *cluster.leader.read().await;
        // From the last Raft entry seen (its batch again: what was taken
        // is skipped).
        let from = seen.lock().expect("seen").last.0.max(from_index);
        let Ok(ch) = Channel::from_shared(format!("http://{}", cluster.addrs[lead]))
            .expect("endpoint")
            .connect()
            .await
        else {
            cluster.follow(lead).await;
            continue;
        };
        let stream = KeelClient::new(ch)
            .watch_events(WatchEventsRequest {
                from_index: from,
                follow: true,
            })
            .await;
        if let Ok(stream) = stream {
            let mut stream = stream.into_inner();
            while let Ok(Some(entry)) = stream.message().await {
                seen.lock().expect("seen").take(entry, Instant::now());
            }
        }
        cluster.follow(lead).await;
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

/// Submits jobs `range` (made by `make`) from `clients` clients, each
/// sending a job again, with its request id, to whichever replica leads
/// when an answer does not come; when each was acknowledged.
async fn submit_all(
    cluster: Arc<Cluster>,
    range: std::ops::Range<u64>,
    clients: u64,
    make: fn(u64, u64) -> JobSpec,
    steps: u64,
) -> BTreeMap<u64, Instant> {
    let next = Arc::new(std::sync::atomic::AtomicU64::new(range.start));
    let mut tasks = Vec::new();
    for _ in 0..clients {
        let next = next.clone();
        let cluster = cluster.clone();
        let end = range.end;
        tasks.push(tokio::spawn(async move {
            let mut acked = Vec::new();
            let mut c = client(&cluster.leader_addr().await).await;
            loop {
                let i = next.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
                if i >= end {
                    return acked;
                }
                let request = SubmitJobRequest {
                    spec: Some(make(i, steps)),
                    request_id: format!("scale-{i}"),
                };
                loop {
                    let lead = *cluster.leader.read().await;
                    let answer =
                        tokio::time::timeout(Duration::from_secs(5), c.submit_job(request.clone()))
                            .await;
                    match answer {
                        Ok(Ok(answer)) => {
                            acked.push((answer.into_inner().job_id, Instant::now()));
                            break;
                        }
                        // Only a lost leader is waited out; anything else
                        // is the benchmark's mistake.
                        Ok(Err(status))
                            if !matches!(
                                status.code(),
                                tonic::Code::Unavailable
                                    | tonic::Code::DeadlineExceeded
                                    | tonic::Code::Unknown
                                    | tonic::Code::Cancelled
                            ) =>
                        {
                            panic!("job {i} refused: {status}");
                        }
                        _ => {}
                    }
                    cluster.follow(lead).await;
                    let addr = cluster.leader_addr().await;
                    if let Ok(ch) = Channel::from_shared(format!("http://{addr}"))
                        .expect("endpoint")
                        .connect()
                        .await
                    {
                        c = KeelClient::new(ch);
                    }
                }
            }
        }));
    }
    let mut acked = BTreeMap::new();
    for t in tasks {
        acked.extend(t.await.expect("client"));
    }
    acked
}

fn one_gpu(i: u64, steps: u64) -> JobSpec {
    sized_spec(i, 1, steps)
}

fn main() {
    let nodes = count("KEEL_SCALE_NODES", 1250);
    let jobs = count("KEEL_SCALE_JOBS", 20_000);
    let clients = count("KEEL_SCALE_CLIENTS", 64);
    let steps = count("KEEL_SCALE_STEPS", 20);
    let preload = count("KEEL_SCALE_PRELOAD", 0);
    let failover = count("KEEL_SCALE_FAILOVER", 0) == 1;
    let dir = tempfile::tempdir().expect("tempdir");
    let rt = tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
        .expect("runtime");
    let (mut keel, addrs) = spawn_keel(dir.path(), nodes);
    let pids: Vec<u32> = keel.iter().map(Child::id).collect();
    rt.block_on(async {
        let cluster = Arc::new(Cluster {
            leader: tokio::sync::RwLock::new(leader(&addrs, None).await),
            addrs: addrs.clone(),
            dead: std::sync::Mutex::new(None),
        });
        let mut admin = client(&cluster.leader_addr().await).await;
        let registered = Instant::now();
        loop {
            let listed = admin
                .list_nodes(ListNodesRequest {})
                .await
                .map(|r| r.into_inner().nodes.len() as u64)
                .unwrap_or(0);
            if listed >= nodes {
                break;
            }
            assert!(
                registered.elapsed() < Duration::from_secs(120),
                "{listed} of {nodes} nodes registered"
            );
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
        eprintln!("scale: {nodes} nodes registered in {:?}", registered.elapsed());
        let status = |mut admin: KeelClient<Channel>| async move {
            admin
                .cluster_status(ClusterStatusRequest {})
                .await
                .expect("status")
                .into_inner()
        };
        if preload > 0 {
            let started = Instant::now();
            let first = status(admin.clone()).await.last_log_index;
            let seen = Arc::new(Mutex::new(Seen::default()));
            let watching = tokio::spawn(watch(cluster.clone(), seen.clone(), first + 1));
            submit_all(cluster.clone(), jobs..jobs + preload, clients, one_gpu, 2).await;
            while (seen.lock().expect("seen").finished.len() as u64) < preload {
                tokio::time::sleep(Duration::from_millis(200)).await;
            }
            watching.abort();
            eprintln!(
                "scale: {preload} jobs run first, in {:.1} s",
                started.elapsed().as_secs_f64()
            );
        }
        let first_index = status(admin.clone()).await.last_log_index;
        let seen = Arc::new(Mutex::new(Seen::default()));
        let watching = tokio::spawn(watch(cluster.clone(), seen.clone(), first_index + 1));
        let cpu_before: Vec<f64> = pids.iter().map(|p| cpu_s(*p)).collect();
        let start = Instant::now();
        let submitting = tokio::spawn(submit_all(cluster.clone(), 0..jobs, clients, spec, steps));
        // When the leader was killed (Unix ms) and the last index seen then.
        let mut killed: Option<(u64, u64)> = None;
        let deadline = Instant::now() + Duration::from_secs(600);
        let mut said = Instant::now();
        loop {
            let (placed, started, finished, last_index) = {
                let seen = seen.lock().expect("seen");
                (
                    seen.allocated.len() as u64,
                    seen.started.len(),
                    seen.finished.len() as u64,
                    seen.last.0,
                )
            };
            if failover && killed.is_none() && placed >= jobs / 2 {
                let lead = *cluster.leader.read().await;
                *cluster.dead.lock().expect("dead") = Some(lead);
                let at_ms = std::time::SystemTime::now()
                    .duration_since(std::time::UNIX_EPOCH)
                    .expect("clock")
                    .as_millis() as u64;
                keel[lead].kill().expect("kill -9 the leader");
                eprintln!("scale: leader (member {}) killed at {placed} placed", lead + 1);
                killed = Some((at_ms, last_index));
            }
            if finished >= jobs || Instant::now() > deadline {
                break;
            }
            if said.elapsed() >= Duration::from_secs(5) {
                said = Instant::now();
                eprintln!("scale: {placed} placed, {started} started, {finished} finished");
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
        let acked = submitting.await.expect("clients");
        let submitted_s = acked
            .values()
            .max()
            .map_or(f64::NAN, |t| t.duration_since(start).as_secs_f64());
        let wall_s = start.elapsed().as_secs_f64();
        let lead = *cluster.leader.read().await;
        let cpu = cpu_s(pids[lead]) - cpu_before[lead];
        let (peak_mib, now_mib) = rss_mib(pids[lead]);
        let last_index = status(client(&cluster.leader_addr().await).await)
            .await
            .last_log_index;
        watching.abort();
        let seen = seen.lock().expect("seen");
        let placed = seen.allocated.len() as f64;
        let (first, last) = (
            seen.allocated.values().min().copied(),
            seen.allocated.values().max().copied(),
        );
        let placing_s = match (first, last) {
            (Some(f), Some(l)) => l.duration_since(f).as_secs_f64().max(1e-3),
            _ => f64::NAN,
        };
        let mut ack_to_running: Vec<Duration> = seen
            .started
            .iter()
            .filter_map(|(job, at)| Some(at.saturating_duration_since(*acked.get(job)?)))
            .collect();
        ack_to_running.sort();
        println!(
            "scale: 3 replicas, {nodes} hollow nodes x 8 GPUs, {clients} clients, {jobs} jobs of 1-8 GPUs, {steps} steps each{}{}",
            if preload > 0 { format!(", after {preload} jobs run first") } else { String::new() },
            if failover { ", the leader killed half way" } else { "" },
        );
        println!("| figure | value |");
        println!("|---|---:|");
        println!("| submissions/s (acknowledged) | {:.0} |", jobs as f64 / submitted_s);
        println!("| placements/s (first to last JobAllocated) | {:.0} |", placed / placing_s);
        println!("| placements over the whole run (/s) | {:.0} |", placed / wall_s);
        println!(
            "| acknowledgement to worker running, p50 / p99 | {:.0} ms / {:.0} ms |",
            percentile(&ack_to_running, 0.5).as_secs_f64() * 1000.0,
            percentile(&ack_to_running, 0.99).as_secs_f64() * 1000.0
        );
        println!(
            "| jobs placed / recorded running / finished | {} / {} / {} |",
            seen.allocated.len(),
            seen.started.len(),
            seen.finished.len()
        );
        println!("| most GPUs busy at once | {} of {} |", seen.most_gpus_busy, nodes * 8);
        println!("| GPUs given to a job while another held them | {} |", seen.double_booked);
        if let Some((at_ms, index)) = killed {
            let resumed = seen
                .allocated_log
                .iter()
                .filter(|(_, i)| *i > index)
                .map(|(t, _)| *t)
                .min();
            match resumed {
                Some(t) => println!(
                    "| kill -9 of the leader to the next placement committed (log time) | {} ms |",
                    t.saturating_sub(at_ms)
                ),
                None => println!("| kill -9 of the leader to the next placement | none seen |"),
            }
        }
        let whose = if killed.is_some() { "the new leader's" } else { "the leader's" };
        println!(
            "| CPU, user + system ({whose} over the run, {wall_s:.1} s) | {:.0} % of a core |",
            cpu / wall_s * 100.0
        );
        println!("| leader RSS, peak / at the end | {peak_mib:.0} / {now_mib:.0} MiB |");
        println!(
            "| commands applied per placement / Raft entries per placement | {:.2} / {:.3} |",
            seen.commands as f64 / placed,
            (last_index - first_index) as f64 / placed
        );
    });
    for child in &mut keel {
        let _ = child.kill();
        let _ = child.wait();
    }
}
