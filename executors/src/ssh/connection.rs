//! Connections to hosts: one OpenSSH master per host (the `openssh` crate
//! over a ControlMaster socket), the helper installed once per version, and
//! [`AGENTS_PER_HOST`] agents (`keel-node.sh serve`) that run requests in
//! the order sent.
//!
//! A connection that fails (an agent's stream ends, a request times out) is
//! dropped, and the next request makes a new one.

use std::collections::BTreeMap;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use futures::{SinkExt, StreamExt};
use keel_state::Gpu;
use openssh::{ChildStdin, ControlPersist, KnownHosts, Session, SessionBuilder, Stdio};
use tokio_util::codec::{FramedRead, FramedWrite};

use super::nodes_file::{HostKeyCheck, SshConfig, SshNode};
use super::protocol::{clip, helper_name, relative_base, AgentCodec, Reply, Request};
use super::HELPER_SCRIPT;
use crate::gpu_health::{parse_gpu_listing, GpuHealth};
use crate::WorkerId;

/// Agents (remote shells serving requests) per host connection.
pub const AGENTS_PER_HOST: usize = 4;

/// Why a command on a host did not do its job.
#[derive(Debug)]
pub(super) enum RunError {
    /// The host could not be reached (or the connection broke): the
    /// connection is dropped and made again next time.
    Unreachable(String),
    /// The helper ran and failed, with what it said.
    Failed(String),
}

impl std::fmt::Display for RunError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            RunError::Unreachable(s) | RunError::Failed(s) => f.write_str(s),
        }
    }
}

/// An error and its causes on one line, clipped.
fn describe_error(e: &dyn std::error::Error) -> String {
    let mut s = e.to_string();
    let mut source = e.source();
    while let Some(cause) = source {
        let text = cause.to_string();
        if !s.contains(&text) {
            s.push_str(": ");
            s.push_str(&text);
        }
        source = cause.source();
    }
    clip(s.trim())
}

type Waiters = Arc<Mutex<BTreeMap<u64, tokio::sync::oneshot::Sender<Reply>>>>;

/// The helper running as `serve` on the host, over one SSH channel.
#[derive(Debug)]
struct Agent {
    requests: tokio::sync::Mutex<FramedWrite<ChildStdin, AgentCodec>>,
    waiting: Waiters,
    next_id: AtomicU64,
    /// Set when its answers stopped (the channel or connection ended).
    dead: Arc<AtomicBool>,
    /// Keeps the channel's local `ssh` process.
    _child: openssh::Child<Arc<Session>>,
}

impl Agent {
    /// Starts `sh HELPER serve` on `session` and the task reading its
    /// replies.
    async fn start(session: &Arc<Session>, helper: &str) -> Result<Agent, RunError> {
        let mut child = session
            .clone()
            .arc_command("sh")
            .arg(helper)
            .arg("serve")
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(Stdio::null())
            .spawn()
            .await
            .map_err(|e| RunError::Unreachable(describe_error(&e)))?;
        let (Some(stdin), Some(stdout)) = (child.stdin().take(), child.stdout().take()) else {
            return Err(RunError::Failed("the agent's pipes are missing".into()));
        };
        let waiting: Waiters = Arc::default();
        let dead = Arc::new(AtomicBool::new(false));
        let (reader_waiting, reader_dead) = (waiting.clone(), dead.clone());
        tokio::spawn(async move {
            let mut replies = FramedRead::new(stdout, AgentCodec::default());
            loop {
                let reply = match replies.next().await {
                    Some(Ok(reply)) => reply,
                    Some(Err(e)) => {
                        tracing::warn!(error = %e, "dropping the agent");
                        break;
                    }
                    None => break,
                };
                let waiter = reader_waiting
                    .lock()
                    .unwrap_or_else(|e| e.into_inner())
                    .remove(&reply.id);
                if let Some(w) = waiter {
                    let _ = w.send(reply);
                }
            }
            reader_dead.store(true, Ordering::SeqCst);
            // Waiters see their sender dropped: the connection is gone.
            reader_waiting
                .lock()
                .unwrap_or_else(|e| e.into_inner())
                .clear();
        });
        Ok(Agent {
            requests: tokio::sync::Mutex::new(FramedWrite::new(stdin, AgentCodec::default())),
            waiting,
            next_id: AtomicU64::new(1),
            dead,
            _child: child,
        })
    }

    fn is_dead(&self) -> bool {
        self.dead.load(Ordering::SeqCst)
    }

    /// Sends one request and waits for its reply.
    async fn request(&self, argv: Vec<String>) -> Result<Reply, RunError> {
        let id = self.next_id.fetch_add(1, Ordering::SeqCst);
        let (tx, rx) = tokio::sync::oneshot::channel();
        self.waiting
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .insert(id, tx);
        let lost = || RunError::Unreachable("the connection to the host's agent ended".into());
        if self.is_dead() {
            return Err(lost());
        }
        let sent = self.requests.lock().await.send(Request { id, argv }).await;
        if let Err(e) = sent {
            self.waiting
                .lock()
                .unwrap_or_else(|e| e.into_inner())
                .remove(&id);
            return Err(match e {
                super::protocol::ProtocolError::Nul => RunError::Failed(e.to_string()),
                _ => lost(),
            });
        }
        rx.await.map_err(|_| lost())
    }
}

/// An established connection and what was learned on making it.
#[derive(Debug)]
pub(super) struct Connection {
    /// The master connection, closed (`ssh -O exit`) when the last
    /// reference goes.
    _session: Arc<Session>,
    /// [`AGENTS_PER_HOST`] agents, taken in turn: requests to one host run
    /// that many at a time.
    agents: Vec<Agent>,
    next_agent: AtomicU64,
    /// The work directory's absolute path on the host.
    pub work_dir: String,
    pub gpus: Vec<Gpu>,
    /// GPUs listed at an earlier connection and not now, or lost by the
    /// driver, with why (issue 33).
    pub failed: Vec<keel_state::FailedGpu>,
    /// What the listing said that no GPU index carries (a GPU lost before
    /// it was ever listed), for the node's note.
    pub gpu_note: String,
    /// Where the shipped `keel` is on the host, if one was shipped.
    pub bin_dir: Option<String>,
    /// Why the host's workers get no cgroup (said in the node's note), or
    /// `None` when they do.
    pub uncontained: Option<String>,
    /// The host has `nvidia-smi`: the driver can say which processes use
    /// its GPUs (asked for the node's note, `busy`).
    pub lists_gpu_processes: bool,
}

impl Connection {
    fn is_dead(&self) -> bool {
        self.agents.iter().any(Agent::is_dead)
    }

    fn agent(&self) -> Option<&Agent> {
        let n = self.next_agent.fetch_add(1, Ordering::Relaxed);
        self.agents
            .get(usize::try_from(n).unwrap_or(0) % self.agents.len().max(1))
    }

    pub fn workers_dir(&self) -> String {
        format!("{}/workers", self.work_dir)
    }

    /// A worker's base path on the host (its files add a suffix).
    pub fn base(&self, id: &WorkerId) -> String {
        format!("{}/{}", self.workers_dir(), relative_base(id))
    }
}

/// The `keel` binary shipped to the hosts: where it is here and its
/// content-hashed directory name there.
#[derive(Debug, Clone)]
pub(super) struct ShippedKeel {
    pub path: std::path::PathBuf,
    /// `keel-<hash>`: hosts keep one directory per version.
    pub dir_name: String,
}

impl ShippedKeel {
    /// Hashes `path` (blake3, read in 1 MiB blocks).
    pub fn new(path: &std::path::Path) -> std::io::Result<ShippedKeel> {
        let mut hasher = blake3::Hasher::new();
        hasher.update_reader(std::fs::File::open(path)?)?;
        let hash = hasher.finalize().to_hex();
        Ok(ShippedKeel {
            path: path.to_path_buf(),
            dir_name: format!("keel-{}", &hash[..16]),
        })
    }
}

/// One host of the nodes file and its connection, if made.
#[derive(Debug)]
pub(super) struct Host {
    pub node: SshNode,
    /// The `keel` to install there, if any.
    ship: Option<ShippedKeel>,
    connection: tokio::sync::Mutex<Option<Arc<Connection>>>,
    /// The host's GPUs over its connections (discovered ones only): a GPU
    /// listed before and missing now is reported failed, with why.
    health: std::sync::Mutex<GpuHealth>,
}

impl Host {
    pub fn new(node: SshNode, ship: Option<ShippedKeel>) -> Host {
        Host {
            node,
            ship,
            connection: tokio::sync::Mutex::new(None),
            health: std::sync::Mutex::new(GpuHealth::new(None)),
        }
    }

    /// The connection, made (helper installed, GPUs found) if there is
    /// none.
    pub async fn connect(&self, config: &SshConfig) -> Result<Arc<Connection>, RunError> {
        let mut slot = self.connection.lock().await;
        if let Some(c) = slot.as_ref() {
            if !c.is_dead() {
                return Ok(c.clone());
            }
            if let Some(c) = slot.take() {
                tokio::task::spawn_blocking(move || drop(c));
            }
        }
        let node = &self.node;
        let session = open_session(node, config).await?;
        // Install the helper (once per version) and learn the work
        // directory's absolute path. What Keel keeps there (worker logs,
        // records, checkpoints) is the connecting user's alone: made under
        // umask 077, and `workers` and `checkpoints` closed to others if an
        // older version left them open.
        let install = "umask 077 && mkdir -p \"$1\" && cd \"$1\" && mkdir -p workers checkpoints && \
                       chmod go-rwx workers checkpoints && \
                       { [ -f \"$2\" ] || { printf '%s' \"$3\" > \"$2.tmp\" && mv -f \"$2.tmp\" \"$2\"; }; } && pwd";
        let out = session
            .command("sh")
            .arg("-c")
            .arg(install)
            .arg("sh")
            .arg(&node.work_dir)
            .arg(helper_name())
            .arg(HELPER_SCRIPT)
            .output()
            .await
            .map_err(|e| RunError::Unreachable(describe_error(&e)))?;
        if !out.status.success() {
            return Err(RunError::Failed(format!(
                "preparing {} on {}: {}",
                node.work_dir,
                node.host,
                clip(&String::from_utf8_lossy(&out.stderr))
            )));
        }
        let work_dir = String::from_utf8_lossy(&out.stdout).trim().to_string();
        let bin_dir = match &self.ship {
            Some(ship) => Some(install_keel(&session, &work_dir, ship, &node.host).await?),
            None => None,
        };
        let session = Arc::new(session);
        let helper = format!("{work_dir}/{}", helper_name());
        let mut agents = Vec::with_capacity(AGENTS_PER_HOST);
        for _ in 0..AGENTS_PER_HOST {
            agents.push(Agent::start(&session, &helper).await?);
        }
        let mut probe = vec!["probe".to_string()];
        if node.gpus.is_none() {
            probe.push("gpus".into());
        }
        let reply = tokio::time::timeout(
            config.connect_timeout + Duration::from_secs(10),
            agents[0].request(probe),
        )
        .await
        .map_err(|_| RunError::Unreachable(format!("no answer from {}'s agent", node.host)))??;
        if reply.status != 0 {
            return Err(RunError::Failed(clip(&String::from_utf8_lossy(
                &reply.stderr,
            ))));
        }
        // "K ..." lines say whether workers get cgroups; the rest is
        // nvidia-smi's listing.
        let text = String::from_utf8_lossy(&reply.stdout);
        let (kinds, listing): (Vec<&str>, Vec<&str>) =
            text.lines().partition(|l| l.starts_with("K "));
        let uncontained = kinds
            .iter()
            .find_map(|l| l.strip_prefix("K none "))
            .map(|why| {
                let mut note = format!(
                    "workers contained by their session only ({}): a process that calls setsid escapes",
                    why.trim()
                );
                keel_state::state::limits::cut_to(
                    &mut note,
                    keel_state::state::limits::NODE_NOTE_MAX_LEN,
                );
                note
            });
        if let Some(note) = &uncontained {
            tracing::warn!(node = %node.name, %note, "no cgroups on this host");
        }
        let (gpus, failed, gpu_note) = match &node.gpus {
            Some(declared) => (declared.clone(), Vec::new(), String::new()),
            None => {
                let listing = parse_gpu_listing(&listing.join("\n"))
                    .map_err(|e| RunError::Failed(e.to_string()))?;
                let report = self
                    .health
                    .lock()
                    .unwrap_or_else(|e| e.into_inner())
                    .check(&listing);
                if !report.failed.is_empty() {
                    tracing::warn!(node = %node.name, failed = ?report.failed, "GPUs failed on an SSH host");
                }
                (report.gpus, report.failed, report.note)
            }
        };
        let lists_gpu_processes = kinds.contains(&"K nvidia-smi");
        let connection = Connection {
            lists_gpu_processes,
            _session: session,
            agents,
            next_agent: AtomicU64::new(0),
            work_dir,
            gpus,
            failed,
            gpu_note,
            bin_dir,
            uncontained,
        };
        tracing::info!(node = %node.name, host = %node.host, work_dir = %connection.work_dir, gpus = connection.gpus.len(), "connected over SSH");
        let connection = Arc::new(connection);
        *slot = Some(connection.clone());
        Ok(connection)
    }

    /// Drops the connection if it is still `broken` (a later one is kept).
    /// Closing runs `ssh -O exit`, so it happens off the runtime.
    async fn disconnect(&self, broken: &Arc<Connection>) {
        let mut slot = self.connection.lock().await;
        if slot.as_ref().is_some_and(|c| Arc::ptr_eq(c, broken)) {
            if let Some(c) = slot.take() {
                tokio::task::spawn_blocking(move || drop(c));
            }
        }
    }

    /// Runs `argv` (a helper command and its arguments) on an agent,
    /// connecting first if needed, and returns its stdout. A broken or
    /// silent connection is dropped.
    pub async fn run(
        &self,
        config: &SshConfig,
        argv: Vec<String>,
    ) -> Result<(Arc<Connection>, Vec<u8>), RunError> {
        let timeout = command_timeout(config);
        let connection = self.connect(config).await?;
        let Some(agent) = connection.agent() else {
            return Err(RunError::Failed("no agent".into()));
        };
        match tokio::time::timeout(timeout, agent.request(argv)).await {
            Err(_) => {
                self.disconnect(&connection).await;
                Err(RunError::Unreachable(format!(
                    "no answer from {} within {:.0} s",
                    self.node.host,
                    timeout.as_secs_f64()
                )))
            }
            Ok(Err(e @ RunError::Unreachable(_))) => {
                self.disconnect(&connection).await;
                Err(e)
            }
            Ok(Err(e)) => Err(e),
            Ok(Ok(reply)) if reply.status == 0 => Ok((connection, reply.stdout)),
            Ok(Ok(reply)) => Err(RunError::Failed(format!(
                "exit status {}: {}",
                reply.status,
                clip(&String::from_utf8_lossy(&reply.stderr))
            ))),
        }
    }
}

/// Installs `ship` under `WORK_DIR/bin/keel-<hash>/keel` unless it is
/// there (written to a temporary name, then renamed: a host never runs a
/// partial binary). Returns the directory.
async fn install_keel(
    session: &Session,
    work_dir: &str,
    ship: &ShippedKeel,
    host: &str,
) -> Result<String, RunError> {
    let dir = format!("{work_dir}/bin/{}", ship.dir_name);
    let there = session
        .command("test")
        .arg("-x")
        .arg(format!("{dir}/keel"))
        .status()
        .await
        .map_err(|e| RunError::Unreachable(describe_error(&e)))?;
    if there.success() {
        return Ok(dir);
    }
    let mut child = session
        .command("sh")
        .arg("-c")
        .arg("umask 077 && mkdir -p \"$1\" && cat > \"$1/keel.$$\" && chmod 700 \"$1/keel.$$\" && mv -f \"$1/keel.$$\" \"$1/keel\"")
        .arg("sh")
        .arg(&dir)
        .stdin(Stdio::piped())
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()
        .await
        .map_err(|e| RunError::Unreachable(describe_error(&e)))?;
    let Some(mut stdin) = child.stdin().take() else {
        return Err(RunError::Failed("the upload's stdin is missing".into()));
    };
    let mut file = tokio::fs::File::open(&ship.path)
        .await
        .map_err(|e| RunError::Failed(format!("reading {}: {e}", ship.path.display())))?;
    let copied = tokio::io::copy(&mut file, &mut stdin).await;
    drop(stdin);
    let out = child
        .wait_with_output()
        .await
        .map_err(|e| RunError::Unreachable(describe_error(&e)))?;
    if let Err(e) = copied {
        return Err(RunError::Unreachable(format!(
            "sending keel to {host}: {e}"
        )));
    }
    if !out.status.success() {
        return Err(RunError::Failed(format!(
            "installing keel in {dir} on {host}: {}",
            clip(&String::from_utf8_lossy(&out.stderr))
        )));
    }
    tracing::info!(%host, %dir, "installed keel on the host");
    Ok(dir)
}

/// How long a request may take before its connection counts as broken.
fn command_timeout(config: &SshConfig) -> Duration {
    config.connect_timeout + Duration::from_secs(10)
}

/// Opens the master connection to `node`.
async fn open_session(node: &SshNode, config: &SshConfig) -> Result<Session, RunError> {
    let mut builder = SessionBuilder::default();
    builder
        .port(node.port)
        .known_hosts_check(match config.host_key_check {
            HostKeyCheck::Strict => KnownHosts::Strict,
            HostKeyCheck::AcceptNew => KnownHosts::Add,
            HostKeyCheck::Accept => KnownHosts::Accept,
        })
        .connect_timeout(config.connect_timeout)
        // A silent connection is found dead after ~3 of these.
        .server_alive_interval(Duration::from_secs(1))
        .control_directory(&config.control_dir)
        // A master left by a killed server goes away once idle.
        .control_persist(ControlPersist::IdleFor(
            std::num::NonZeroUsize::new(60).unwrap_or(std::num::NonZeroUsize::MIN),
        ));
    if let Some(user) = &node.user {
        builder.user(user.clone());
    }
    if let Some(key) = &node.key {
        builder.keyfile(key);
    }
    if let Some(file) = &config.known_hosts_file {
        builder.user_known_hosts_file(file);
    }
    tokio::time::timeout(
        config.connect_timeout + Duration::from_secs(5),
        builder.connect(&node.host),
    )
    .await
    .map_err(|_| {
        RunError::Unreachable(format!(
            "ssh {}:{}: no answer within {:.0} s",
            node.host,
            node.port,
            config.connect_timeout.as_secs_f64() + 5.0
        ))
    })?
    .map_err(|e| {
        RunError::Unreachable(format!(
            "ssh {}:{}: {}",
            node.host,
            node.port,
            describe_error(&e)
        ))
    })
}
