//! A steady leader under load (issue 26): three real `keel server`
//! replicas on loopback, 64 clients each on its own connection to the
//! leader, each submitting a job and cancelling it, one write after the
//! other, for `KEEL_BENCH_SECONDS` (default 600). Cancelled jobs are
//! removed after 10 s (`--retain-finished-s 10`), so the state stays the
//! same size however long it runs.
//!
//! Every 200 ms the benchmark asks each replica its term and leader:
//! any election, spurious or not, raises the term. It reports the terms
//! and leaders seen, the writes and their latency, the leader's CPU and
//! peak RSS, and each replica's histograms of WAL syncs and snapshot
//! builds (and the time each part of the builds took) from its `/metrics`
//! (what can hold up a replica long enough for an election).
//!
//! Run: `cargo bench -p keel --bench steady_leader`
//! (`KEEL_BENCH_BIN` runs the servers from another build of `keel`.)

#![allow(clippy::print_stdout)]

use std::collections::BTreeSet;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use keel_proto::api::{
    keel_client::KeelClient, CancelJobRequest, ClusterStatusRequest, SubmitJobRequest,
};
use keel_proto::entry::JobSpec;
use tonic::transport::Channel;

mod common;

use common::{count, percentile};

const CLIENTS: usize = 64;

async fn connect(addr: &str) -> Option<Channel> {
    tonic::transport::Endpoint::from_shared(format!("http://{addr}"))
        .ok()?
        .connect_timeout(Duration::from_millis(500))
        .tcp_nodelay(true)
        .connect()
        .await
        .ok()
}

/// Each replica's (term, leader) as it answers now (`None`: no answer).
async fn views(addrs: &[String]) -> Vec<Option<(u64, Option<u64>)>> {
    let mut out = Vec::new();
    for a in addrs {
        let view = match connect(a).await {
            Some(ch) => KeelClient::new(ch)
                .cluster_status(ClusterStatusRequest {})
                .await
                .ok()
                .map(|s| {
                    let s = s.into_inner();
                    (s.term, s.leader_id)
                }),
            None => None,
        };
        out.push(view);
    }
    out
}

fn spec(i: usize) -> JobSpec {
    JobSpec {
        name: format!("steady-{i}"),
        command: vec!["true".into()],
        gpus_per_worker: 1,
        min_workers: 1,
        max_workers: 1,
        ..Default::default()
    }
}

/// `utime + stime` of `pid` in clock ticks.
fn cpu_ticks(pid: u32) -> u64 {
    std::fs::read_to_string(format!("/proc/{pid}/stat"))
        .ok()
        .and_then(|s| {
            let rest = s.rsplit_once(')')?.1.to_string();
            let f: Vec<&str> = rest.split_whitespace().collect();
            Some(f.get(11)?.parse::<u64>().ok()? + f.get(12)?.parse::<u64>().ok()?)
        })
        .unwrap_or(0)
}

fn main() {
    let secs = count("KEEL_BENCH_SECONDS", 600);
    let dir = tempfile::tempdir().expect("tempdir");
    let (mut children, addrs) = common::spawn_three(dir.path(), |_, c| {
        c.args(["--no-local-node", "--http-listen", "127.0.0.1:0"])
            .args(["--retain-finished-s", "10"]);
    });
    let rt = tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
        .expect("runtime");
    rt.block_on(async {
        let (term0, leader) = loop {
            let seen = views(&addrs).await;
            if let Some((t, Some(l))) = seen.iter().flatten().find(|(_, l)| l.is_some()) {
                break (*t, *l);
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        };
        let leader_member = leader as usize;
        let leader_addr = addrs
            .get(leader_member.saturating_sub(1))
            .cloned()
            .unwrap_or_else(|| addrs[0].clone());
        let leader_pid = children
            .get(leader_member.saturating_sub(1))
            .map_or(0, |c| c.id());
        println!(
            "{} s of {CLIENTS} clients (submit, then cancel) against leader {leader_member} at {leader_addr}, term {term0}",
            secs
        );
        let done = Arc::new(AtomicBool::new(false));
        let start = Instant::now();
        let cpu0 = cpu_ticks(leader_pid);
        let mut tasks = Vec::new();
        for c in 0..CLIENTS {
            let ch = connect(&leader_addr).await.expect("connect to the leader");
            let done = done.clone();
            tasks.push(tokio::spawn(async move {
                let mut client = KeelClient::new(ch);
                let (mut lat, mut failed) = (Vec::new(), 0u64);
                let mut i = c * 1_000_000;
                while !done.load(Ordering::Relaxed) {
                    i += 1;
                    let t = Instant::now();
                    let submitted = client
                        .submit_job(SubmitJobRequest {
                            spec: Some(spec(i)),
                            request_id: String::new(),
                        })
                        .await;
                    let Ok(submitted) = submitted else {
                        failed += 1;
                        continue;
                    };
                    lat.push(t.elapsed());
                    let t = Instant::now();
                    let cancelled = client
                        .cancel_job(CancelJobRequest {
                            job_id: submitted.into_inner().job_id,
                            reason: String::new(),
                            request_id: String::new(),
                        })
                        .await;
                    match cancelled {
                        Ok(_) => lat.push(t.elapsed()),
                        Err(_) => failed += 1,
                    }
                }
                (lat, failed)
            }));
        }
        let mut terms = BTreeSet::from([term0]);
        let mut leaders = BTreeSet::from([leader]);
        let mut unanswered = 0u64;
        let mut rss_peak = 0.0f64;
        while start.elapsed() < Duration::from_secs(secs) {
            tokio::time::sleep(Duration::from_millis(200)).await;
            for view in views(&addrs).await {
                match view {
                    Some((t, l)) => {
                        terms.insert(t);
                        leaders.extend(l);
                    }
                    None => unanswered += 1,
                }
            }
            rss_peak = rss_peak.max(common::status_mib(leader_pid, "VmRSS:"));
        }
        done.store(true, Ordering::Relaxed);
        let elapsed = start.elapsed().as_secs_f64();
        let cpu = (cpu_ticks(leader_pid) - cpu0) as f64 / 100.0 / elapsed;
        let (mut lat, mut failed) = (Vec::new(), 0u64);
        for t in tasks {
            let (l, f) = t.await.expect("client");
            lat.extend(l);
            failed += f;
        }
        lat.sort();
        println!(
            "writes: {:.0}/s acknowledged ({} in all, {failed} failed), p50 {:?}, p99 {:?}",
            lat.len() as f64 / elapsed,
            lat.len(),
            percentile(&lat, 0.5),
            percentile(&lat, 0.99)
        );
        println!(
            "terms seen: {terms:?} ({} election(s) after the first); leaders seen: {:?}; status calls unanswered: {unanswered}",
            terms.len() - 1,
            leaders
        );
        println!(
            "leader: {:.0} % of a core, peak RSS {rss_peak:.0} MiB",
            cpu * 100.0
        );
    });
    // Each replica's histograms of snapshot builds and WAL syncs: how many
    // took longer than the lease and timeout a follower waits.
    for id in 1..=3 {
        let Ok(addr) = std::fs::read_to_string(dir.path().join(format!("keel{id}/http.addr")))
        else {
            continue;
        };
        let Ok(mut s) = std::net::TcpStream::connect(addr.trim()) else {
            continue;
        };
        use std::io::{Read, Write};
        let _ = s.write_all(b"GET /metrics HTTP/1.1\r\nHost: keel\r\nConnection: close\r\n\r\n");
        let mut body = String::new();
        let _ = s.read_to_string(&mut body);
        for line in body.lines().filter(|l| {
            let whole = l.starts_with("keel_snapshot_duration_seconds")
                || l.starts_with("keel_wal_fsync_duration_seconds");
            // Each part of the builds: its sum and count.
            let part = l.starts_with("keel_snapshot_phase_duration_seconds");
            let total = l.contains("_sum") || l.contains("_count");
            (part && total)
                || (whole
                    && (total
                        || l.contains("le=\"0.4096")
                        || l.contains("le=\"0.8192")
                        || l.contains("le=\"1.6384")
                        || l.contains("le=\"3.2768")
                        || l.contains("le=\"+Inf")))
        }) {
            println!("replica {id}: {line}");
        }
    }
    for c in &mut children {
        let _ = c.kill();
        let _ = c.wait();
    }
}
