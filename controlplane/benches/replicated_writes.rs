//! Durable writes through a three-replica cluster, beside a three-member
//! etcd on the same machine and loopback, in the same run.
//!
//! Keel: three real `keel server` processes; clients submit jobs (the
//! encoded request padded to 256 bytes) to the leader, each client on its
//! own connection, each submission acknowledged once committed by a
//! majority (fdatasync'd on each) and applied. etcd: three `etcd`
//! processes (Debian's `etcd-server`; skipped when `etcd` is not on PATH),
//! clients `Put` 256-byte values to the leader over gRPC. 1 and 64
//! concurrent clients each.
//!
//! Run: `cargo bench -p keel --bench replicated_writes`
//! (`KEEL_BENCH_SECONDS` sets each phase's length; default 5.)

#![allow(clippy::print_stdout)]

use std::path::Path;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use keel_proto::api::{keel_client::KeelClient, ClusterStatusRequest, SubmitJobRequest};
use keel_proto::entry::JobSpec;
use prost::Message;
use tonic::transport::Channel;

const KEEL: &str = env!("CARGO_BIN_EXE_keel");
const VALUE_BYTES: usize = 256;

/// The few etcd messages the benchmark needs (field numbers from etcd's
/// `rpc.proto`, API v3).
mod etcd {
    #[derive(Clone, PartialEq, prost::Message)]
    pub struct PutRequest {
        #[prost(bytes = "vec", tag = "1")]
        pub key: Vec<u8>,
        #[prost(bytes = "vec", tag = "2")]
        pub value: Vec<u8>,
    }
    #[derive(Clone, PartialEq, prost::Message)]
    pub struct ResponseHeader {
        #[prost(uint64, tag = "1")]
        pub cluster_id: u64,
        #[prost(uint64, tag = "2")]
        pub member_id: u64,
    }
    #[derive(Clone, PartialEq, prost::Message)]
    pub struct PutResponse {
        #[prost(message, optional, tag = "1")]
        pub header: Option<ResponseHeader>,
    }
    #[derive(Clone, PartialEq, prost::Message)]
    pub struct StatusRequest {}
    #[derive(Clone, PartialEq, prost::Message)]
    pub struct StatusResponse {
        #[prost(message, optional, tag = "1")]
        pub header: Option<ResponseHeader>,
        #[prost(uint64, tag = "4")]
        pub leader: u64,
    }
}

fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0")
        .and_then(|l| l.local_addr())
        .expect("a free port")
        .port()
}

fn percentile(sorted: &[Duration], p: f64) -> Duration {
    if sorted.is_empty() {
        return Duration::ZERO;
    }
    sorted[(((sorted.len() as f64) - 1.0) * p).round() as usize]
}

struct Row {
    what: String,
    per_s: f64,
    p50: Duration,
    p99: Duration,
}

async fn channel(addr: &str) -> Channel {
    tonic::transport::Endpoint::from_shared(format!("http://{addr}"))
        .expect("endpoint")
        .tcp_nodelay(true)
        .connect()
        .await
        .expect("connect")
}

/// Runs `clients` loops of `one` for `secs`; each loop gets its own channel.
async fn load<F, Fut>(what: String, addr: &str, clients: usize, secs: f64, one: F) -> Row
where
    F: Fn(Channel, usize) -> Fut + Clone + Send + 'static,
    Fut: std::future::Future<Output = bool> + Send,
{
    let start = Instant::now();
    let deadline = start + Duration::from_secs_f64(secs);
    let mut tasks = Vec::new();
    for c in 0..clients {
        let ch = channel(addr).await;
        let one = one.clone();
        tasks.push(tokio::spawn(async move {
            let mut lat = Vec::new();
            let mut i = c * 1_000_000;
            while Instant::now() < deadline {
                let t = Instant::now();
                i += 1;
                if one(ch.clone(), i).await {
                    lat.push(t.elapsed());
                }
            }
            lat
        }));
    }
    let mut lat = Vec::new();
    for t in tasks {
        lat.extend(t.await.expect("load task"));
    }
    lat.sort();
    Row {
        what,
        per_s: lat.len() as f64 / start.elapsed().as_secs_f64(),
        p50: percentile(&lat, 0.5),
        p99: percentile(&lat, 0.99),
    }
}

/// A spec whose SubmitJobRequest encodes to `VALUE_BYTES`.
fn padded_spec(i: usize) -> JobSpec {
    let mut spec = JobSpec {
        name: format!("w-{i}"),
        command: vec!["true".into(), String::new()],
        gpus_per_worker: 1,
        min_workers: 1,
        max_workers: 1,
        ..Default::default()
    };
    let base = SubmitJobRequest {
        spec: Some(spec.clone()),
        request_id: String::new(),
    }
    .encoded_len();
    spec.command[1] = "x".repeat(VALUE_BYTES.saturating_sub(base));
    spec
}

fn spawn_keel(dir: &Path) -> (Vec<Child>, Vec<String>) {
    let addrs: Vec<String> = (0..3)
        .map(|_| format!("127.0.0.1:{}", free_port()))
        .collect();
    let peers = addrs
        .iter()
        .enumerate()
        .map(|(i, a)| format!("{}={a}", i + 1))
        .collect::<Vec<_>>()
        .join(",");
    let children = addrs
        .iter()
        .enumerate()
        .map(|(i, a)| {
            Command::new(KEEL)
                .args(["server", "--no-local-node", "--id", &(i + 1).to_string()])
                .args(["--peers", &peers, "--listen", a, "--data-dir"])
                .arg(dir.join(format!("keel{}", i + 1)))
                .stdout(Stdio::null())
                .stderr(Stdio::null())
                .spawn()
                .expect("spawn keel")
        })
        .collect();
    (children, addrs)
}

async fn keel_leader(addrs: &[String]) -> String {
    loop {
        for a in addrs {
            if let Ok(ep) = tonic::transport::Endpoint::from_shared(format!("http://{a}")) {
                if let Ok(ch) = ep.connect().await {
                    if let Ok(s) = KeelClient::new(ch)
                        .cluster_status(ClusterStatusRequest {})
                        .await
                    {
                        if s.into_inner().role == "leader" {
                            return a.clone();
                        }
                    }
                }
            }
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

fn spawn_etcd(dir: &Path) -> Option<(Vec<Child>, Vec<String>)> {
    let available = Command::new("etcd")
        .arg("--version")
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .status()
        .is_ok_and(|s| s.success());
    if !available {
        return None;
    }
    let ports: Vec<(u16, u16)> = (0..3).map(|_| (free_port(), free_port())).collect();
    let cluster = ports
        .iter()
        .enumerate()
        .map(|(i, (_, peer))| format!("e{i}=http://127.0.0.1:{peer}"))
        .collect::<Vec<_>>()
        .join(",");
    let children = ports
        .iter()
        .enumerate()
        .map(|(i, (client, peer))| {
            Command::new("etcd")
                .args(["--name", &format!("e{i}")])
                .arg("--data-dir")
                .arg(dir.join(format!("etcd{i}")))
                .args([
                    "--listen-client-urls",
                    &format!("http://127.0.0.1:{client}"),
                ])
                .args([
                    "--advertise-client-urls",
                    &format!("http://127.0.0.1:{client}"),
                ])
                .args(["--listen-peer-urls", &format!("http://127.0.0.1:{peer}")])
                .args([
                    "--initial-advertise-peer-urls",
                    &format!("http://127.0.0.1:{peer}"),
                ])
                .args([
                    "--initial-cluster",
                    &cluster,
                    "--initial-cluster-state",
                    "new",
                ])
                .stdout(Stdio::null())
                .stderr(Stdio::null())
                .spawn()
                .expect("spawn etcd")
        })
        .collect();
    let addrs = ports
        .iter()
        .map(|(c, _)| format!("127.0.0.1:{c}"))
        .collect();
    Some((children, addrs))
}

async fn etcd_status(ch: Channel) -> Option<etcd::StatusResponse> {
    let mut grpc = tonic::client::Grpc::new(ch);
    grpc.ready().await.ok()?;
    let path =
        tonic::codegen::http::uri::PathAndQuery::from_static("/etcdserverpb.Maintenance/Status");
    grpc.unary(
        tonic::Request::new(etcd::StatusRequest {}),
        path,
        tonic_prost::ProstCodec::default(),
    )
    .await
    .ok()
    .map(|r| r.into_inner())
}

async fn etcd_leader(addrs: &[String]) -> String {
    loop {
        for a in addrs {
            if let Ok(ep) = tonic::transport::Endpoint::from_shared(format!("http://{a}")) {
                if let Ok(ch) = ep.connect().await {
                    if let Some(s) = etcd_status(ch).await {
                        if s.leader != 0 && s.header.map(|h| h.member_id) == Some(s.leader) {
                            return a.clone();
                        }
                    }
                }
            }
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

async fn etcd_put(ch: Channel, i: usize) -> bool {
    let mut grpc = tonic::client::Grpc::new(ch);
    if grpc.ready().await.is_err() {
        return false;
    }
    let path = tonic::codegen::http::uri::PathAndQuery::from_static("/etcdserverpb.KV/Put");
    let req = etcd::PutRequest {
        key: format!("key-{i:012}").into_bytes(),
        value: vec![b'v'; VALUE_BYTES],
    };
    let resp: Result<tonic::Response<etcd::PutResponse>, _> = grpc
        .unary(
            tonic::Request::new(req),
            path,
            tonic_prost::ProstCodec::default(),
        )
        .await;
    resp.is_ok()
}

async fn keel_submit(ch: Channel, i: usize) -> bool {
    KeelClient::new(ch)
        .submit_job(SubmitJobRequest {
            spec: Some(padded_spec(i)),
            request_id: String::new(),
        })
        .await
        .is_ok()
}

fn main() {
    let secs: f64 = std::env::var("KEEL_BENCH_SECONDS")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(5.0);
    let dir = tempfile::tempdir().expect("tempdir");
    let rt = tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
        .expect("runtime");
    let mut rows = Vec::new();
    rt.block_on(async {
        let (mut keel, addrs) = spawn_keel(dir.path());
        let leader = keel_leader(&addrs).await;
        for clients in [1, 64] {
            rows.push(
                load(
                    format!("keel, 3 replicas, {clients} client(s)"),
                    &leader,
                    clients,
                    secs,
                    keel_submit,
                )
                .await,
            );
        }
        for c in &mut keel {
            let _ = c.kill();
            let _ = c.wait();
        }
        match spawn_etcd(dir.path()) {
            None => println!(
                "etcd is not on PATH: the etcd rows are skipped (apt-get install etcd-server)"
            ),
            Some((mut etcd, addrs)) => {
                let leader = etcd_leader(&addrs).await;
                for clients in [1, 64] {
                    rows.push(
                        load(
                            format!("etcd, 3 members, {clients} client(s)"),
                            &leader,
                            clients,
                            secs,
                            etcd_put,
                        )
                        .await,
                    );
                }
                for c in &mut etcd {
                    let _ = c.kill();
                    let _ = c.wait();
                }
            }
        }
    });
    println!("| what | writes/s | p50 | p99 |");
    println!("|---|---:|---:|---:|");
    for r in rows {
        println!(
            "| {} | {:.0} | {:.2} ms | {:.2} ms |",
            r.what,
            r.per_s,
            r.p50.as_secs_f64() * 1e3,
            r.p99.as_secs_f64() * 1e3
        );
    }
}
