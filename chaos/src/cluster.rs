//! The replicas: real `keel server` processes on 127.0.0.1, each behind its
//! fault-injecting proxy ([`crate::proxy`]).
//!
//! Replica `i` listens on its own port; its peers know it by its proxy's
//! address (the `--peers` list, and so the Raft membership), and its own
//! connections to peers leave from `127.0.0.{10+i}`. Clients reach the
//! replicas directly. Each replica declares one simulated node
//! (`r{i}`), and all share one executor directory, as replicas on one
//! machine do, so a new leader re-adopts the workers the last one started.

use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::atomic::{AtomicU32, Ordering};
use std::sync::Arc;
use std::time::Duration;

use keel_proto::api::{self, keel_client::KeelClient};
use nix::sys::signal::{kill, Signal};
use nix::unistd::Pid;
use tonic::transport::Channel;

use crate::proxy::{self, Links};

#[derive(Debug, thiserror::Error)]
pub enum ClusterError {
    #[error("cannot start replica {id} ({keel}): {source}")]
    Spawn {
        id: u64,
        keel: String,
        source: std::io::Error,
    },
    #[error("replica {id}: {message}")]
    Io { id: u64, message: String },
    #[error("no free port: {0}")]
    Port(std::io::Error),
}

/// How the replicas are run.
#[derive(Debug, Clone)]
pub struct ClusterConfig {
    /// The `keel` binary.
    pub keel: PathBuf,
    pub replicas: u64,
    /// Where the data directories, logs and executor directory go.
    pub dir: PathBuf,
    /// More `keel server` flags for every replica.
    pub extra_args: Vec<String>,
    /// Run the replicas over mutual TLS (a CA and certificates made in
    /// `dir/certs`), and the clients with a client certificate.
    pub tls: bool,
    /// Check callers (`--acl`, which needs `tls`): the harness bootstraps
    /// the ACLs and its clients present an `operator` token.
    pub acl: bool,
}

/// One replica.
#[derive(Debug)]
pub struct Replica {
    pub id: u64,
    /// Where it listens (clients dial this).
    pub listen: SocketAddr,
    /// Its proxy (peers dial this).
    pub advertised: SocketAddr,
    pub data: PathBuf,
    child: Option<Child>,
    /// SIGSTOPped and not yet continued.
    paused: bool,
    starts: u32,
    /// The log of its latest start.
    log: Option<PathBuf>,
}

impl Replica {
    pub fn is_running(&self) -> bool {
        self.child.is_some() && !self.paused
    }

    pub fn is_up(&self) -> bool {
        self.child.is_some()
    }
}

/// The cluster's processes and links.
#[derive(Debug)]
pub struct Cluster {
    pub config: ClusterConfig,
    pub replicas: Vec<Replica>,
    pub links: Arc<Links>,
    peers: String,
    /// How the harness's clients reach the replicas.
    pub transport: keel::transport::Transport,
    /// The token they present (with [`ClusterConfig::acl`]).
    pub token: Option<String>,
}

/// The ports handed out by [`listen_port`] in this process, never twice.
static NEXT_PORT_PROBE: AtomicU32 = AtomicU32::new(0);

/// The lowest port the kernel hands out for outgoing connections and
/// `bind(0)` (`/proc/sys/net/ipv4/ip_local_port_range`), 32768 if unknown.
fn ephemeral_low() -> u16 {
    std::fs::read_to_string("/proc/sys/net/ipv4/ip_local_port_range")
        .ok()
        .and_then(|s| s.split_whitespace().next()?.parse().ok())
        .unwrap_or(32768)
}

/// A free port for a replica to listen on, below the ephemeral range.
///
/// A port from `bind(0)` is free only until it is released: the replica
/// binds it a moment later (and again after each restart), and in between
/// any outgoing connection on the machine may be given it as its local
/// port, and the replica then fails to start. Ports below the ephemeral
/// range are never given to outgoing connections.
fn listen_port() -> Result<SocketAddr, ClusterError> {
    let high = u32::from(ephemeral_low().max(2048));
    let low = high / 2;
    let span = high - low;
    // Start where another process running the harness is unlikely to.
    let start = std::process::id().wrapping_mul(7919) % span;
    for _ in 0..span {
        let probe = NEXT_PORT_PROBE.fetch_add(1, Ordering::Relaxed);
        let port = low + (start + probe) % span;
        let Ok(port) = u16::try_from(port) else {
            continue;
        };
        if let Ok(l) = std::net::TcpListener::bind(("127.0.0.1", port)) {
            return l.local_addr().map_err(ClusterError::Port);
        }
    }
    Err(ClusterError::Port(std::io::Error::new(
        std::io::ErrorKind::AddrInUse,
        format!("every port in {low}..{high} is taken"),
    )))
}

impl Cluster {
    /// Starts every replica and its proxy (inside a tokio runtime).
    pub async fn start(config: ClusterConfig) -> Result<Cluster, ClusterError> {
        let links = Arc::new(Links::default());
        let mut replicas = Vec::new();
        for id in 1..=config.replicas {
            let listen = listen_port()?;
            let advertised = proxy::spawn(links.clone(), id, listen)
                .await
                .map_err(ClusterError::Port)?;
            replicas.push(Replica {
                id,
                listen,
                advertised,
                data: config.dir.join(format!("r{id}")),
                child: None,
                paused: false,
                starts: 0,
                log: None,
            });
        }
        let peers = replicas
            .iter()
            .map(|r| format!("{}={}", r.id, r.advertised))
            .collect::<Vec<_>>()
            .join(",");
        let transport = if config.tls {
            make_certs(&config.dir.join("certs"), config.replicas)?
        } else {
            keel::transport::Transport::Plain
        };
        let mut cluster = Cluster {
            config,
            replicas,
            links,
            peers,
            transport,
            token: None,
        };
        for id in 1..=cluster.config.replicas {
            cluster.spawn(id)?;
        }
        cluster.wait_serving(Duration::from_secs(60)).await?;
        if cluster.config.acl {
            cluster.token = Some(cluster.bootstrap_acl(Duration::from_secs(60)).await?);
        }
        Ok(cluster)
    }

    /// Bootstraps the ACLs with an admin token, and makes the `operator`
    /// token the harness's clients present (the workload cancels jobs and
    /// marks nodes: an operator's rights, no more). Each write goes under
    /// one request id with a secret chosen here, so sending it again until
    /// a leader takes it applies it once.
    async fn bootstrap_acl(&self, bound: Duration) -> Result<String, ClusterError> {
        let fail = |message: String| ClusterError::Io { id: 0, message };
        let root = keel::authz::new_secret().map_err(|e| fail(e.to_string()))?;
        let operator = keel::authz::new_secret().map_err(|e| fail(e.to_string()))?;
        let deadline = std::time::Instant::now() + bound;
        let mut last = String::new();
        let bootstrapped = self
            .until_taken(None, deadline, &mut last, |mut c| {
                let request = api::BootstrapAclRequest {
                    name: "root".into(),
                    secret: root.clone(),
                    request_id: "chaos-bootstrap-acl".into(),
                };
                async move { c.bootstrap_acl(request).await }
            })
            .await;
        if bootstrapped
            && self
                .until_taken(Some(&root), deadline, &mut last, |mut c| {
                    let request = api::CreateTokenRequest {
                        name: "chaos-workload".into(),
                        role: "operator".into(),
                        ttl_s: 0,
                        secret: operator.clone(),
                        request_id: "chaos-create-token".into(),
                        queues: Vec::new(),
                    };
                    async move { c.create_token(request).await }
                })
                .await
        {
            return Ok(operator);
        }
        Err(fail(format!(
            "the ACLs were not bootstrapped within {bound:?}: {last}"
        )))
    }

    /// Sends a write to each replica in turn, presenting `token`, until one
    /// takes it (`true`) or `deadline`; the last refusal is kept in `last`.
    async fn until_taken<T, F, Fut>(
        &self,
        token: Option<&str>,
        deadline: std::time::Instant,
        last: &mut String,
        mut call: F,
    ) -> bool
    where
        F: FnMut(Client) -> Fut,
        Fut: std::future::Future<Output = Result<tonic::Response<T>, tonic::Status>>,
    {
        while std::time::Instant::now() < deadline {
            for r in &self.replicas {
                let Some(c) = client_for(&self.transport, token, r.listen) else {
                    continue;
                };
                match call(c).await {
                    Ok(_) => return true,
                    Err(e) => *last = e.to_string(),
                }
            }
            tokio::time::sleep(Duration::from_millis(200)).await;
        }
        false
    }

    /// Waits until every replica answers, or fails naming the one that
    /// exited (and why) or did not answer within `bound`.
    async fn wait_serving(&mut self, bound: Duration) -> Result<(), ClusterError> {
        let deadline = std::time::Instant::now() + bound;
        for id in 1..=self.config.replicas {
            loop {
                if let Some((id, how)) = self.crashed().into_iter().next() {
                    return Err(ClusterError::Io {
                        id,
                        message: format!("exited at start: {how}"),
                    });
                }
                if self.status(id, Duration::from_millis(500)).await.is_some() {
                    break;
                }
                if std::time::Instant::now() >= deadline {
                    return Err(ClusterError::Io {
                        id,
                        message: format!("did not answer within {bound:?}"),
                    });
                }
                tokio::time::sleep(Duration::from_millis(50)).await;
            }
        }
        Ok(())
    }

    /// The replicas whose process ended without the harness stopping it
    /// (a crash, or a failure to start), reaped: each with how it ended
    /// and the last lines of its log.
    pub fn crashed(&mut self) -> Vec<(u64, String)> {
        let mut out = Vec::new();
        for r in &mut self.replicas {
            let Some(child) = r.child.as_mut() else {
                continue;
            };
            let Ok(Some(status)) = child.try_wait() else {
                continue;
            };
            r.child = None;
            r.paused = false;
            let log = r.log.as_deref().map(log_tail).unwrap_or_default();
            out.push((r.id, format!("{status}; its log ends:\n{log}")));
        }
        out
    }

    fn replica(&mut self, id: u64) -> &mut Replica {
        let last = self.replicas.len().saturating_sub(1);
        let i = usize::try_from(id.saturating_sub(1)).unwrap_or(usize::MAX);
        &mut self.replicas[i.min(last)]
    }

    /// Starts replica `id`'s process (after a kill or a wipe) unless it runs.
    pub fn spawn(&mut self, id: u64) -> Result<(), ClusterError> {
        self.spawn_with(id, &[])
    }

    /// Whether replica `id`'s process has ended on its own (it is reaped).
    pub fn exited(&mut self, id: u64) -> bool {
        let r = self.replica(id);
        let ended = r
            .child
            .as_mut()
            .is_some_and(|c| matches!(c.try_wait(), Ok(Some(_))));
        if ended {
            r.child = None;
            r.paused = false;
        }
        ended
    }

    /// Restarts replica `id` with `env` set (e.g. `FAILPOINTS`).
    pub fn restart_with(&mut self, id: u64, env: &[(&str, &str)]) -> Result<(), ClusterError> {
        self.kill(id);
        self.spawn_with(id, env)
    }

    fn spawn_with(&mut self, id: u64, env: &[(&str, &str)]) -> Result<(), ClusterError> {
        self.exited(id);
        let keel = self.config.keel.clone();
        let mut extra = self.config.extra_args.clone();
        if self.config.acl {
            extra.push("--acl".into());
        }
        if self.config.tls {
            let certs = self.config.dir.join("certs");
            for (flag, file) in [
                ("--tls-cert", format!("member-{id}.crt")),
                ("--tls-key", format!("member-{id}.key")),
                ("--tls-ca", "ca.crt".to_string()),
            ] {
                extra.push(flag.to_string());
                extra.push(certs.join(file).display().to_string());
            }
        }
        let executor_dir = self.config.dir.join("executor");
        let pause = format!(
            "reconcile-before-side-effects=return({})",
            self.pause_trigger().display()
        );
        let failpoints = env
            .iter()
            .filter(|(k, _)| *k == "FAILPOINTS")
            .map(|(_, v)| v.to_string())
            .chain([pause])
            .collect::<Vec<_>>()
            .join(";");
        let peers = self.peers.clone();
        let r = self.replica(id);
        if r.child.is_some() {
            return Ok(());
        }
        r.starts += 1;
        let log_path = r.data.with_extension(format!("log.{}", r.starts));
        std::fs::create_dir_all(r.data.parent().unwrap_or(Path::new("."))).map_err(|e| {
            ClusterError::Io {
                id,
                message: e.to_string(),
            }
        })?;
        let log = std::fs::File::create(&log_path).map_err(|e| ClusterError::Io {
            id,
            message: format!("{}: {e}", log_path.display()),
        })?;
        let child = Command::new(&keel)
            .args(["server", "--id", &id.to_string(), "--peers", &peers])
            .args(["--listen", &r.listen.to_string()])
            .arg("--data-dir")
            .arg(&r.data)
            .arg("--executor-dir")
            .arg(&executor_dir)
            .args(["--peer-source-ip", &proxy::source_ip(id).to_string()])
            .args([
                "--simulated-gpus",
                "1xv100",
                "--node-name",
                &format!("r{id}"),
            ])
            .args(&extra)
            // Failpoints only where asked, never inherited; every replica
            // may pause itself before a launch while the trigger file is
            // there (`pause_leader_before_launch`; chaos builds only).
            .env_remove("FAILPOINTS")
            .envs(env.iter().copied().filter(|(k, _)| *k != "FAILPOINTS"))
            .env("FAILPOINTS", failpoints)
            .stdout(Stdio::null())
            .stderr(log)
            .spawn()
            .map_err(|source| ClusterError::Spawn {
                id,
                keel: keel.display().to_string(),
                source,
            })?;
        r.child = Some(child);
        r.paused = false;
        r.log = Some(log_path);
        Ok(())
    }

    fn signal(&mut self, id: u64, signal: Signal) {
        if let Some(c) = &self.replica(id).child {
            let pid = Pid::from_raw(i32::try_from(c.id()).unwrap_or(i32::MAX));
            if let Err(e) = kill(pid, signal) {
                tracing::warn!(replica = id, %signal, error = %e, "signal not delivered");
            }
        }
    }

    /// SIGKILL, and reap.
    pub fn kill(&mut self, id: u64) {
        let r = self.replica(id);
        if let Some(mut c) = r.child.take() {
            let _ = c.kill();
            let _ = c.wait();
        }
        r.paused = false;
    }

    /// SIGSTOP: the process freezes where it is (a leader keeps believing it
    /// leads).
    pub fn pause(&mut self, id: u64) {
        self.signal(id, Signal::SIGSTOP);
        self.replica(id).paused = true;
    }

    /// The file whose presence makes the next replica about to launch or
    /// stop a worker freeze itself (SIGSTOP) there, once: it removes the
    /// file as it does.
    pub fn pause_trigger(&self) -> PathBuf {
        self.config.dir.join("pause-before-launch")
    }

    /// A running replica that froze itself (its process is stopped though
    /// the harness did not pause it), now counted as paused so the heal
    /// resumes it.
    pub fn self_paused(&mut self) -> Option<u64> {
        let stopped = self.replicas.iter().find_map(|r| {
            let pid = r.child.as_ref()?.id();
            let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
            let state = stat.rsplit(") ").next()?.chars().next()?;
            (!r.paused && state == 'T').then_some(r.id)
        })?;
        self.replica(stopped).paused = true;
        Some(stopped)
    }

    /// SIGCONT.
    pub fn resume(&mut self, id: u64) {
        if self.replica(id).paused {
            self.signal(id, Signal::SIGCONT);
            self.replica(id).paused = false;
        }
    }

    /// Kills replica `id`, deletes its data directory, and starts it empty:
    /// it rejoins from the leader (log or snapshot).
    pub fn wipe(&mut self, id: u64) -> Result<(), ClusterError> {
        self.kill(id);
        let data = self.replica(id).data.clone();
        if data.exists() {
            std::fs::remove_dir_all(&data).map_err(|e| ClusterError::Io {
                id,
                message: format!("wipe {}: {e}", data.display()),
            })?;
        }
        self.spawn(id)
    }

    /// The replicas that run (not killed, not paused).
    pub fn running(&self) -> Vec<u64> {
        self.replicas
            .iter()
            .filter(|r| r.is_running())
            .map(|r| r.id)
            .collect()
    }

    /// A client of replica `id` (lazy: connects on first use).
    pub fn client(&self, id: u64) -> Option<Client> {
        let r = self.replicas.iter().find(|r| r.id == id)?;
        client_for(&self.transport, self.token.as_deref(), r.listen)
    }

    /// Replica `id`'s status, or `None` if it does not answer in time.
    pub async fn status(&self, id: u64, timeout: Duration) -> Option<api::ClusterStatusResponse> {
        let mut c = self.client(id)?;
        let call = c.cluster_status(api::ClusterStatusRequest {});
        match tokio::time::timeout(timeout, call).await {
            Ok(Ok(r)) => Some(r.into_inner()),
            _ => None,
        }
    }

    /// The leader the running replicas report, with the highest term.
    pub async fn leader(&self) -> Option<u64> {
        let mut best: Option<(u64, u64)> = None;
        for id in self.running() {
            if let Some(s) = self.status(id, Duration::from_millis(500)).await {
                if s.role == "leader" && best.is_none_or(|(t, _)| s.term > t) {
                    best = Some((s.term, s.member_id));
                }
            }
        }
        best.map(|(_, id)| id)
    }

    /// Whether the leader's membership names every replica as a voter under
    /// the incarnation the replica reports, and nothing else: no member
    /// that lost its disk is still being re-admitted. `Err` says what is
    /// missing.
    pub async fn members_current(&self) -> Result<(), String> {
        let leader = self.leader().await.ok_or("no leader")?;
        let status = self
            .status(leader, Duration::from_secs(1))
            .await
            .ok_or("the leader did not answer")?;
        let mut recorded: Vec<(u64, u64, bool)> = status
            .members
            .iter()
            .map(|m| (m.id, m.incarnation, m.voter))
            .collect();
        recorded.sort();
        let mut expected = Vec::new();
        for r in &self.replicas {
            let own = self
                .status(r.id, Duration::from_secs(1))
                .await
                .ok_or_else(|| format!("replica {} did not answer", r.id))?;
            expected.push((r.id, own.incarnation, true));
        }
        expected.sort();
        if recorded == expected {
            Ok(())
        } else {
            Err(format!(
                "the leader's membership (id, incarnation, voter) is {recorded:?}; the replicas are {expected:?}"
            ))
        }
    }

    /// Waits up to `bound` for [`Cluster::members_current`].
    pub async fn wait_members_current(&self, bound: Duration) -> Result<(), String> {
        let deadline = std::time::Instant::now() + bound;
        loop {
            let result = self.members_current().await;
            if result.is_ok() || std::time::Instant::now() >= deadline {
                return result;
            }
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
    }

    /// Waits up to `bound` for a leader (an election may be under way).
    pub async fn wait_leader(&self, bound: Duration) -> Option<u64> {
        let deadline = std::time::Instant::now() + bound;
        loop {
            if let Some(l) = self.leader().await {
                return Some(l);
            }
            if std::time::Instant::now() >= deadline {
                return None;
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    }
}

/// The last lines of the log at `path`, indented.
fn log_tail(path: &Path) -> String {
    const LINES: usize = 8;
    let text = match std::fs::read_to_string(path) {
        Ok(t) => t,
        Err(e) => return format!("    ({}: {e})", path.display()),
    };
    let lines: Vec<&str> = text.lines().collect();
    let mut out = format!("    ({})\n", path.display());
    for l in &lines[lines.len().saturating_sub(LINES)..] {
        out.push_str("    ");
        out.push_str(l);
        out.push('\n');
    }
    out
}

/// Adds a token to every request (`authorization: Bearer`), if there is one.
#[derive(Debug, Clone)]
pub struct WithToken(Option<tonic::metadata::MetadataValue<tonic::metadata::Ascii>>);

impl tonic::service::Interceptor for WithToken {
    fn call(
        &mut self,
        mut request: tonic::Request<()>,
    ) -> Result<tonic::Request<()>, tonic::Status> {
        if let Some(value) = &self.0 {
            request
                .metadata_mut()
                .insert(keel::authz::AUTHORIZATION_HEADER, value.clone());
        }
        Ok(request)
    }
}

/// A client of one replica, as the harness makes them.
pub type Client = KeelClient<tonic::service::interceptor::InterceptedService<Channel, WithToken>>;

/// A lazily connected client of the server at `addr`, presenting `token`.
pub fn client_for(
    transport: &keel::transport::Transport,
    token: Option<&str>,
    addr: SocketAddr,
) -> Option<Client> {
    let token = match token {
        Some(t) => Some(format!("Bearer {t}").parse().ok()?),
        None => None,
    };
    let addr = addr.to_string();
    let endpoint = transport
        .endpoint(&addr)
        .ok()?
        .connect_timeout(Duration::from_millis(500))
        .tcp_nodelay(true);
    let channel = transport
        .lazy(endpoint, keel::transport::Peer::Address(&addr), None)
        .ok()?;
    Some(
        KeelClient::with_interceptor(channel, WithToken(token))
            .max_decoding_message_size(256 * 1024 * 1024),
    )
}

/// A CA, certificates for members 1 to `replicas` (naming 127.0.0.1) and a
/// client's, in `dir`; the client's transport.
fn make_certs(dir: &Path, replicas: u64) -> Result<keel::transport::Transport, ClusterError> {
    let io = |message: String| ClusterError::Io { id: 0, message };
    std::fs::create_dir_all(dir).map_err(|e| io(format!("{}: {e}", dir.display())))?;
    let ca = keel::tls::certs::new_ca("chaos").map_err(|e| io(e.to_string()))?;
    let write = |name: &str, text: &str| {
        std::fs::write(dir.join(name), text).map_err(|e| io(format!("{name}: {e}")))
    };
    write("ca.crt", &ca.cert_pem)?;
    for id in 1..=replicas {
        let issued = ca
            .issue_member(id, &["127.0.0.1".to_string()], 30)
            .map_err(|e| io(e.to_string()))?;
        write(&format!("member-{id}.crt"), &issued.cert_pem)?;
        write(&format!("member-{id}.key"), &issued.key_pem)?;
    }
    let client = ca
        .issue_client("chaos", 30)
        .map_err(|e| io(e.to_string()))?;
    write("client.crt", &client.cert_pem)?;
    write("client.key", &client.key_pem)?;
    let files = keel::tls::TlsFiles {
        cert: Some(dir.join("client.crt")),
        key: Some(dir.join("client.key")),
        ca: dir.join("ca.crt"),
    };
    let tls = keel::tls::TlsState::load(files, keel::tls::Holder::Client)
        .map_err(|e| io(e.to_string()))?;
    Ok(keel::transport::Transport::Tls(Arc::new(tls)))
}

impl Drop for Cluster {
    fn drop(&mut self) {
        for r in &mut self.replicas {
            if let Some(mut c) = r.child.take() {
                if r.paused {
                    let pid = Pid::from_raw(i32::try_from(c.id()).unwrap_or(i32::MAX));
                    let _ = kill(pid, Signal::SIGCONT);
                }
                let _ = c.kill();
                let _ = c.wait();
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn listen_ports_are_below_the_ephemeral_range_and_never_repeat() {
        let low = ephemeral_low();
        let a = listen_port().expect("a port");
        let b = listen_port().expect("a port");
        assert_ne!(a.port(), b.port());
        assert!(
            a.port() < low && b.port() < low,
            "{a} {b} (ephemeral from {low})"
        );
    }

    #[tokio::test]
    async fn a_replica_that_cannot_start_is_named_with_its_log() {
        let dir = tempfile::tempdir().expect("tempdir");
        // A "keel" that writes a line to its log and exits at once.
        let keel = dir.path().join("keel");
        std::fs::write(
            &keel,
            "#!/bin/sh\necho 'cannot bind: address in use' >&2\nexit 3\n",
        )
        .expect("script");
        let mut perms = std::fs::metadata(&keel).expect("meta").permissions();
        std::os::unix::fs::PermissionsExt::set_mode(&mut perms, 0o755);
        std::fs::set_permissions(&keel, perms).expect("chmod");
        let err = Cluster::start(ClusterConfig {
            keel,
            replicas: 3,
            dir: dir.path().join("run"),
            extra_args: Vec::new(),
            tls: false,
            acl: false,
        })
        .await
        .expect_err("no replica starts");
        let text = err.to_string();
        assert!(text.contains("exited at start"), "{text}");
        assert!(text.contains("exit status: 3"), "{text}");
        assert!(text.contains("cannot bind: address in use"), "{text}");
    }
}
