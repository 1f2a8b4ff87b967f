//! Durable writes through a three-replica cluster, beside a three-member
//! etcd on the same machine and loopback, in the same run.
//!
//! Keel: three real `keel server` processes; clients submit jobs (the
//! encoded request padded to 256 bytes) to the leader, each client on its
//! own connection, each submission acknowledged once committed by a
//! majority (fdatasync'd on each) and applied. etcd: three `etcd`
//! processes (Debian's `etcd-server`; skipped when `etcd` is not on PATH),
//! clients `Put` 256-byte values to the leader over gRPC. 1 and 64
//! concurrent clients each. Keel runs twice: in plaintext, then over
//! mutual TLS (certificates from `keel tls init`, clients holding a client
//! certificate), for TLS's cost (issue 22).
//!
//! Observability's cost (issue 24): Keel once more with `/metrics` off
//! and no span export (`--http-listen off`), with `/metrics` scraped every
//! second, and with that and spans exported over OTLP to a collector in
//! this process, 1 % of the writes sampled (the servers' default ratio):
//! the three runs after each other, twice.
//!
//! Run: `cargo bench -p keel --bench replicated_writes`
//! (`KEEL_BENCH_SECONDS` sets each phase's length; default 5;
//! `KEEL_BENCH_ONLY=observability` runs the observability rows alone;
//! `KEEL_BENCH_ONLY=single`, one replica beside a one-member etcd;
//! `KEEL_BENCH_ONLY=plain`, the plaintext three-replica rows beside etcd
//! alone, the flags any earlier `keel` takes, to compare commits with
//! `KEEL_BENCH_BIN`.)

#![allow(clippy::print_stdout)]

use std::path::Path;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use keel::transport::{Peer, Transport};
use keel_proto::api::{keel_client::KeelClient, ClusterStatusRequest, SubmitJobRequest};
use keel_proto::entry::JobSpec;
use prost::Message;
use tonic::transport::Channel;

#[path = "../tests/support/otlp.rs"]
mod otlp;

mod common;

use common::{free_port, percentile, KEEL};
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

struct Row {
    what: String,
    per_s: f64,
    p50: Duration,
    p99: Duration,
}

async fn channel(transport: &Transport, addr: &str) -> Channel {
    let endpoint = transport
        .endpoint(addr)
        .expect("endpoint")
        .tcp_nodelay(true);
    transport
        .connect(endpoint, Peer::Address(addr))
        .await
        .expect("connect")
}

/// Runs `clients` loops of `one` for `secs`; each loop gets its own channel.
async fn load<F, Fut>(
    what: String,
    (transport, addr): (&Transport, &str),
    clients: usize,
    secs: f64,
    one: F,
) -> Row
where
    F: Fn(Channel, usize) -> Fut + Clone + Send + 'static,
    Fut: std::future::Future<Output = bool> + Send,
{
    let start = Instant::now();
    let deadline = start + Duration::from_secs_f64(secs);
    let mut tasks = Vec::new();
    for c in 0..clients {
        let ch = channel(transport, addr).await;
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

/// Three replicas in `dir`; over TLS with the certificates in `certs`
/// (`keel tls init`), if given.
fn spawn_keel(dir: &Path, certs: Option<&Path>, extra: &[String]) -> (Vec<Child>, Vec<String>) {
    common::spawn_three(dir, |id, command| {
        command.arg("--no-local-node").args(extra);
        if let Some(certs) = certs {
            command
                .arg("--tls-cert")
                .arg(certs.join(format!("member-{id}.crt")))
                .arg("--tls-key")
                .arg(certs.join(format!("member-{id}.key")))
                .arg("--tls-ca")
                .arg(certs.join("ca.crt"));
        }
    })
}

/// The certificates of a three-member cluster and a client, in
/// `dir/certs`, and a client's transport holding them.
fn tls_client(dir: &Path) -> (std::path::PathBuf, Transport) {
    let certs = dir.join("certs");
    let made = Command::new(KEEL)
        .args(["tls", "init"])
        .arg(&certs)
        .stdout(Stdio::null())
        .status()
        .expect("keel tls init");
    assert!(made.success(), "keel tls init failed");
    let files = keel::tls::TlsFiles {
        cert: Some(certs.join("client-admin.crt")),
        key: Some(certs.join("client-admin.key")),
        ca: certs.join("ca.crt"),
    };
    let tls = keel::tls::TlsState::load(files, keel::tls::Holder::Client).expect("client TLS");
    (certs, Transport::Tls(std::sync::Arc::new(tls)))
}

async fn keel_leader(transport: &Transport, addrs: &[String]) -> String {
    loop {
        for a in addrs {
            let Ok(ep) = transport.endpoint(a) else {
                continue;
            };
            if let Ok(ch) = transport.connect(ep, Peer::Address(a)).await {
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
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

/// `members` etcd members (1 or 3) in `dir`, if `etcd` is on PATH.
fn spawn_etcd(dir: &Path, members: usize) -> Option<(Vec<Child>, Vec<String>)> {
    let available = Command::new("etcd")
        .arg("--version")
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .status()
        .is_ok_and(|s| s.success());
    if !available {
        return None;
    }
    let ports: Vec<(u16, u16)> = (0..members).map(|_| (free_port(), free_port())).collect();
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

/// Reads each replica's `/metrics` every second (its address from
/// `DATA/http.addr`), until aborted.
async fn scrape_every_second(dirs: Vec<std::path::PathBuf>) {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    loop {
        for dir in &dirs {
            let Ok(addr) = std::fs::read_to_string(dir.join("http.addr")) else {
                continue;
            };
            if let Ok(mut s) = tokio::net::TcpStream::connect(addr.trim()).await {
                let _ = s
                    .write_all(b"GET /metrics HTTP/1.1\r\nHost: keel\r\nConnection: close\r\n\r\n")
                    .await;
                let mut body = Vec::new();
                let _ = s.read_to_end(&mut body).await;
            }
        }
        tokio::time::sleep(Duration::from_secs(1)).await;
    }
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
    let only = std::env::var("KEEL_BENCH_ONLY").unwrap_or_default();
    let only_observability = only == "observability";
    let only_plain = only == "plain";
    let collector = otlp::Collector::start();
    let mut rows = Vec::new();
    if only == "single" {
        rt.block_on(single_member(dir.path(), secs, &mut rows));
        print_rows(rows);
        return;
    }
    rt.block_on(async {
        let (certs, tls) = tls_client(dir.path());
        let plain = Transport::Plain;
        let off = vec!["--http-listen".to_string(), "off".to_string()];
        let on = vec![
            "--http-listen".to_string(),
            "127.0.0.1:0".to_string(),
            "--otlp-endpoint".to_string(),
            collector.endpoint.clone(),
        ];
        let mut runs = Vec::new();
        if !only_observability {
            runs.push(("keel", &plain, None, Vec::new()));
        }
        if !only_observability && !only_plain {
            runs.push((
                "keel over mutual TLS",
                &tls,
                Some(certs.as_path()),
                Vec::new(),
            ));
        }
        let metrics_only = vec!["--http-listen".to_string(), "127.0.0.1:0".to_string()];
        let observability_rounds = if only_plain { 0 } else { 2 };
        for _ in 0..observability_rounds {
            runs.push(("keel, metrics and traces off", &plain, None, off.clone()));
            runs.push(("keel, metrics scraped", &plain, None, metrics_only.clone()));
            runs.push((
                "keel, metrics scraped, traces at 1 %",
                &plain,
                None,
                on.clone(),
            ));
        }
        for (run, (name, transport, certs, extra)) in runs.into_iter().enumerate() {
            let run_dir = dir.path().join(format!("run{run}"));
            let (mut keel, addrs) = spawn_keel(&run_dir, certs, &extra);
            let leader = keel_leader(transport, &addrs).await;
            // The metrics, scraped every second on each replica, as a
            // Prometheus would (its own cost left out).
            let scraping = extra.contains(&"127.0.0.1:0".to_string()).then(|| {
                let dirs: Vec<std::path::PathBuf> = (1..=3)
                    .map(|id| run_dir.join(format!("keel{id}")))
                    .collect();
                tokio::spawn(scrape_every_second(dirs))
            });
            let spans_before = collector.count();
            for clients in [1, 64] {
                rows.push(
                    load(
                        format!("{name}, 3 replicas, {clients} client(s)"),
                        (transport, &leader),
                        clients,
                        secs,
                        keel_submit,
                    )
                    .await,
                );
            }
            if let Some(scraping) = scraping {
                scraping.abort();
            }
            if extra.contains(&"--otlp-endpoint".to_string()) {
                println!(
                    "{name}: {} spans exported",
                    collector.count() - spans_before
                );
            }
            for c in &mut keel {
                let _ = c.kill();
                let _ = c.wait();
            }
        }
        if only_observability {
            return;
        }
        etcd_rows(dir.path(), 3, secs, &mut rows).await;
    });
    print_rows(rows);
}

/// One `keel server` replica (the embedded default: no peers), then a
/// one-member etcd, on the same cores and disk, one after the other:
/// 1 and 64 clients each.
async fn single_member(dir: &Path, secs: f64, rows: &mut Vec<Row>) {
    let plain = Transport::Plain;
    let addr = format!("127.0.0.1:{}", free_port());
    let mut keel = Command::new(common::server_binary())
        .args(["server", "--no-local-node", "--http-listen", "off"])
        .args(["--listen", &addr, "--data-dir"])
        .arg(dir.join("keel1"))
        .stdout(Stdio::null())
        .stderr(common::server_log(1))
        .spawn()
        .expect("spawn keel");
    let leader = keel_leader(&plain, std::slice::from_ref(&addr)).await;
    for clients in [1, 64] {
        rows.push(
            load(
                format!("keel, 1 replica, {clients} client(s)"),
                (&plain, &leader),
                clients,
                secs,
                keel_submit,
            )
            .await,
        );
    }
    let _ = keel.kill();
    let _ = keel.wait();
    etcd_rows(dir, 1, secs, rows).await;
}

/// `members` etcd members in `dir`, 1 and 64 clients `Put`ting to the
/// leader; nothing (said so) when `etcd` is not on PATH.
async fn etcd_rows(dir: &Path, members: usize, secs: f64, rows: &mut Vec<Row>) {
    let Some((mut etcd, addrs)) = spawn_etcd(dir, members) else {
        println!("etcd is not on PATH: the etcd rows are skipped (apt-get install etcd-server)");
        return;
    };
    let leader = etcd_leader(&addrs).await;
    let name = if members == 1 { "member" } else { "members" };
    for clients in [1, 64] {
        rows.push(
            load(
                format!("etcd, {members} {name}, {clients} client(s)"),
                (&Transport::Plain, &leader),
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

fn print_rows(rows: Vec<Row>) {
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
