//! Failover of a three-replica cluster of real `keel server` processes on
//! loopback: under a steady stream of submissions (one client that fails
//! over between the three addresses), SIGKILL the leader and measure the
//! time from the kill to the next acknowledged write. The killed replica is
//! restarted and the cluster allowed to converge before the next trial.
//!
//! Run: `cargo bench -p keel --bench failover`
//! (`KEEL_FAILOVER_TRIALS` sets the number of trials; default 20;
//! `KEEL_BENCH_BIN` runs the servers from another build of `keel`.)

#![allow(clippy::print_stdout)]

use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use keel_proto::api::{keel_client::KeelClient, ClusterStatusRequest, SubmitJobRequest};
use keel_proto::entry::JobSpec;
use tonic::transport::Channel;

mod common;

use common::{free_port, server_binary};

struct Replica {
    id: u64,
    addr: String,
    data: PathBuf,
    child: Option<Child>,
}

fn spawn(r: &mut Replica, peers: &str) {
    r.child = Some(
        Command::new(server_binary())
            .args(["server", "--no-local-node", "--id", &r.id.to_string()])
            .args(["--peers", peers, "--listen", &r.addr, "--data-dir"])
            .arg(&r.data)
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .expect("spawn keel server"),
    );
}

async fn client(addr: &str) -> Option<KeelClient<Channel>> {
    let channel = tonic::transport::Endpoint::from_shared(format!("http://{addr}"))
        .ok()?
        .connect_timeout(Duration::from_millis(200))
        .timeout(Duration::from_millis(1000))
        .tcp_nodelay(true)
        .connect()
        .await
        .ok()?;
    Some(KeelClient::new(channel))
}

async fn leader(addrs: &[String]) -> (u64, u64) {
    loop {
        for a in addrs {
            if let Some(mut c) = client(a).await {
                if let Ok(s) = c.cluster_status(ClusterStatusRequest {}).await {
                    let s = s.into_inner();
                    if s.role == "leader" {
                        return (s.member_id, s.last_applied_index);
                    }
                }
            }
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

/// Waits until every replica has applied at least what the leader had
/// applied when this was called (the writes keep flowing meanwhile).
async fn caught_up(addrs: &[String]) {
    let (_, target) = leader(addrs).await;
    for a in addrs {
        loop {
            let applied = match client(a).await {
                Some(mut c) => c
                    .cluster_status(ClusterStatusRequest {})
                    .await
                    .map(|s| s.into_inner().last_applied_index)
                    .unwrap_or(0),
                None => 0,
            };
            if applied >= target {
                break;
            }
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    }
}

fn spec(i: u64) -> JobSpec {
    JobSpec {
        name: format!("failover-{i}"),
        command: vec!["true".into()],
        gpus_per_worker: 1,
        min_workers: 1,
        max_workers: 1,
        ..Default::default()
    }
}

fn main() {
    let trials: usize = std::env::var("KEEL_FAILOVER_TRIALS")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(20);
    let dir = tempfile::tempdir().expect("tempdir");
    let mut replicas: Vec<Replica> = (1..=3)
        .map(|id| Replica {
            id,
            addr: format!("127.0.0.1:{}", free_port()),
            data: dir.path().join(format!("r{id}")),
            child: None,
        })
        .collect();
    let peers = replicas
        .iter()
        .map(|r| format!("{}={}", r.id, r.addr))
        .collect::<Vec<_>>()
        .join(",");
    let addrs: Vec<String> = replicas.iter().map(|r| r.addr.clone()).collect();
    for r in &mut replicas {
        spawn(r, &peers);
    }
    let rt = tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
        .expect("runtime");
    // Milliseconds since `epoch`: when the leader was killed (u64::MAX: not
    // in a trial), and when the first write *sent after* the kill was
    // acknowledged (0: not yet). A reply already on its way from the old
    // leader when it was killed does not count.
    let epoch = Instant::now();
    let killed_at = Arc::new(AtomicU64::new(u64::MAX));
    let recovered_at = Arc::new(AtomicU64::new(0));
    let acks = Arc::new(AtomicU64::new(0));
    rt.block_on(async {
        leader(&addrs).await;
        // The steady writer: one submission at a time, failing over.
        let writer = {
            let addrs = addrs.clone();
            let killed_at = killed_at.clone();
            let recovered_at = recovered_at.clone();
            let acks = acks.clone();
            tokio::spawn(async move {
                let mut i = 0u64;
                let mut current: Option<KeelClient<Channel>> = None;
                let mut next_addr = 0usize;
                loop {
                    if current.is_none() {
                        current = client(&addrs[next_addr % addrs.len()]).await;
                        next_addr += 1;
                        if current.is_none() {
                            continue;
                        }
                    }
                    let Some(c) = current.as_mut() else { continue };
                    i += 1;
                    let sent = epoch.elapsed().as_millis() as u64;
                    match c.submit_job(SubmitJobRequest { spec: Some(spec(i)), request_id: String::new() }).await {
                        Ok(_) => {
                            acks.fetch_add(1, Ordering::SeqCst);
                            if sent >= killed_at.load(Ordering::SeqCst) {
                                let now = epoch.elapsed().as_millis() as u64;
                                let _ = recovered_at.compare_exchange(
                                    0,
                                    now,
                                    Ordering::SeqCst,
                                    Ordering::SeqCst,
                                );
                            }
                        }
                        Err(_) => {
                            current = None;
                            tokio::time::sleep(Duration::from_millis(10)).await;
                        }
                    }
                }
            })
        };
        let mut failovers = Vec::new();
        for trial in 0..trials {
            caught_up(&addrs).await;
            let (leader_id, _) = leader(&addrs).await;
            // Let the load run steadily for a moment.
            let before = acks.load(Ordering::SeqCst);
            while acks.load(Ordering::SeqCst) < before + 50 {
                tokio::time::sleep(Duration::from_millis(5)).await;
            }
            let victim = &mut replicas[leader_id as usize - 1];
            recovered_at.store(0, Ordering::SeqCst);
            let kill = epoch.elapsed().as_millis() as u64;
            killed_at.store(kill, Ordering::SeqCst);
            if let Some(mut c) = victim.child.take() {
                c.kill().expect("SIGKILL");
                c.wait().expect("reap");
            }
            while recovered_at.load(Ordering::SeqCst) == 0 {
                tokio::time::sleep(Duration::from_millis(1)).await;
            }
            let took = Duration::from_millis(recovered_at.load(Ordering::SeqCst) - kill);
            killed_at.store(u64::MAX, Ordering::SeqCst);
            println!("trial {trial}: leader {leader_id} killed; writes acknowledged again after {took:?}");
            failovers.push(took);
            spawn(victim, &peers);
        }
        writer.abort();
        failovers.sort();
        let pct = |p: f64| failovers[((failovers.len() as f64 - 1.0) * p).round() as usize];
        println!();
        println!(
            "failover over {} trials: p50 {:?}, p99 {:?}, max {:?} (writes acknowledged in all: {})",
            failovers.len(),
            pct(0.5),
            pct(0.99),
            failovers.last().copied().unwrap_or_default(),
            acks.load(Ordering::SeqCst)
        );
    });
    for r in &mut replicas {
        if let Some(mut c) = r.child.take() {
            let _ = c.kill();
            let _ = c.wait();
        }
    }
}
