//! The SSH executor: workers on hosts reached over SSH.
//!
//! Each host declared in the nodes file ([`nodes_file`]) gets one OpenSSH
//! connection (the `openssh` crate over a ControlMaster socket). On
//! connecting, the executor installs its helper, `keel-node.sh` (POSIX sh,
//! in this module's directory), under the host's work directory, starts it
//! as a long-lived agent (`keel-node.sh serve`: requests on its stdin,
//! length-framed answers on its stdout, so a request costs a fork on the
//! host instead of a login shell), and discovers the GPUs with
//! `nvidia-smi` unless the file declares them. Everything on the host goes
//! through the agent:
//!
//! - **launch**: the worker runs under a shell supervisor in its own
//!   session (`setsid`), with the worker contract in its environment and its
//!   output in a log file, so it survives the SSH connection, the server that
//!   opened it, and a failover. Its identity (job, epoch, rank) is its file
//!   name, `workers/job-J/eE-rR.{log,pid,exit}`, kept on the host.
//! - **poll** (every `poll_interval`, one command per host, while this server
//!   leads): every worker's state on the host (running, exited with the code
//!   the supervisor recorded, or gone without a record), and rank 0's log
//!   from the last offset read, for progress lines. A worker found that this
//!   executor does not know is re-adopted (running) or reported (exited):
//!   that is how a new leader, or this one after a network drop, carries on.
//!   The poll is also the node's heartbeat ([`NodeProbe`]).
//! - **signal**: SIGTERM to the worker's process group, SIGKILL after the
//!   grace period. The supervisor survives the SIGTERM to record the exit.
//!
//! A worker ended by signal N is recorded with status 128 + N and the
//! signal's name (a shell cannot tell it from `exit 128+N`).
//!
//! Connections that fail (the agent's stream ends, a request times out) are
//! dropped and made again on the next request; an unreachable host is
//! retried with a backoff of up to [`RECONNECT_BACKOFF_MAX`]. The agent
//! runs one request at a time, in the order sent.

mod nodes_file;

use std::collections::{BTreeMap, BTreeSet};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use keel_state::liveness::NodeReport;
use keel_state::{Gpu, GpuRef, JobId, ProgressSample};
use openssh::{ChildStdin, ControlPersist, KnownHosts, Session, SessionBuilder, Stdio};
use tokio::io::{AsyncBufReadExt, AsyncReadExt, AsyncWriteExt};

pub use nodes_file::{
    parse_nodes_file, HostKeyCheck, NodesFileError, SshConfig, SshNode, FIELD_MAX_LEN,
    NODES_FILE_MAX_BYTES, NODES_MAX,
};

use crate::contract::{
    buffer_progress, checkpoint_dir_name, environment, gpu_refs, ProgressLines, WorkerLaunch,
};
use crate::discovery::parse_nvidia_smi;
use crate::executor::{Executor, ExecutorError, NodeProbe, WorkerLog};
use crate::reconcile::Observed;
use crate::WorkerId;

/// The helper run on every host.
pub const HELPER_SCRIPT: &str = include_str!("ssh/keel-node.sh");

/// Agents (remote shells serving requests) per host connection.
pub const AGENTS_PER_HOST: usize = 4;

/// The longest wait between attempts to reach a host that does not answer.
pub const RECONNECT_BACKOFF_MAX: Duration = Duration::from_secs(10);

/// The first rendezvous port handed out; each live (job, epoch) gets the
/// lowest one no other live one uses.
pub const RENDEZVOUS_PORT_BASE: u16 = 29500;

/// The most bytes of one log a poll returns (the helper's limit).
const POLL_CHUNK_MAX: usize = 256 * 1024;

/// The longest reason kept for a node or a worker (a state limit).
const REASON_MAX_LEN: usize = 1024;

/// The helper's file name: versioned by its content, so hosts may keep
/// several versions while older supervisors finish.
pub fn helper_name() -> String {
    // FNV-1a: stable across builds and platforms.
    let mut h: u64 = 0xcbf2_9ce4_8422_2325;
    for b in HELPER_SCRIPT.bytes() {
        h ^= u64::from(b);
        h = h.wrapping_mul(0x0100_0000_01b3);
    }
    format!("keel-node-{h:016x}.sh")
}

fn now_ms() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| u64::try_from(d.as_millis()).unwrap_or(u64::MAX))
}

/// An error and its causes on one line, at most [`REASON_MAX_LEN`] bytes.
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

fn clip(s: &str) -> String {
    let one_line = s.split_whitespace().collect::<Vec<_>>().join(" ");
    if one_line.len() <= REASON_MAX_LEN {
        return one_line;
    }
    let mut end = REASON_MAX_LEN;
    while !one_line.is_char_boundary(end) {
        end -= 1;
    }
    one_line[..end].to_string()
}

/// A worker's files, relative to the workers directory: `job-J/eE-rR`.
fn relative_base(id: &WorkerId) -> String {
    format!("job-{}/e{}-r{}", id.job_id, id.epoch, id.rank)
}

fn parse_base(base: &str) -> Option<WorkerId> {
    let (job, rest) = base.split_once('/')?;
    let (e, r) = rest.split_once('-')?;
    Some(WorkerId {
        job_id: job.strip_prefix("job-")?.parse().ok()?,
        epoch: e.strip_prefix('e')?.parse().ok()?,
        rank: r.strip_prefix('r')?.parse().ok()?,
    })
}

fn parse_gpus(csv: &str) -> Vec<u32> {
    csv.split(',').filter_map(|g| g.parse().ok()).collect()
}

/// An established connection and what was learned on making it.
#[derive(Debug)]
struct Connection {
    /// The master connection, closed (`ssh -O exit`) when the last
    /// reference goes.
    _session: Arc<Session>,
    /// [`AGENTS_PER_HOST`] agents, taken in turn: requests to one host run
    /// that many at a time.
    agents: Vec<Agent>,
    next_agent: AtomicU64,
    /// The work directory's absolute path on the host.
    work_dir: String,
    gpus: Vec<Gpu>,
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

    fn workers_dir(&self) -> String {
        format!("{}/workers", self.work_dir)
    }

    fn base(&self, id: &WorkerId) -> String {
        format!("{}/{}", self.workers_dir(), relative_base(id))
    }
}

/// What the agent answered to one request.
#[derive(Debug)]
struct Reply {
    status: i32,
    stdout: Vec<u8>,
    stderr: Vec<u8>,
}

/// The helper running as `serve` on the host, over one SSH channel.
#[derive(Debug)]
struct Agent {
    stdin: tokio::sync::Mutex<ChildStdin>,
    pending: Arc<Mutex<BTreeMap<u64, tokio::sync::oneshot::Sender<Reply>>>>,
    next_id: AtomicU64,
    /// Set when its answers stopped (the channel or connection ended).
    dead: Arc<AtomicBool>,
    /// Keeps the channel's local `ssh` process.
    _child: openssh::Child<Arc<Session>>,
}

/// Quotes `arg` for the agent's `eval`: single quotes, and a newline as
/// `$nl` (a request is one line).
fn quote_for_agent(arg: &str) -> String {
    let mut out = String::with_capacity(arg.len() + 2);
    out.push('\'');
    for c in arg.chars() {
        match c {
            '\'' => out.push_str("'\\''"),
            '\n' => out.push_str("'\"$nl\"'"),
            c => out.push(c),
        }
    }
    out.push('\'');
    out
}

impl Agent {
    /// Starts `sh HELPER serve` on `session` and the task reading its
    /// answers.
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
        let pending: Arc<Mutex<BTreeMap<u64, tokio::sync::oneshot::Sender<Reply>>>> =
            Arc::default();
        let dead = Arc::new(AtomicBool::new(false));
        let (reader_pending, reader_dead) = (pending.clone(), dead.clone());
        tokio::spawn(async move {
            let mut reader = tokio::io::BufReader::new(stdout);
            let mut header = String::new();
            loop {
                header.clear();
                match reader.read_line(&mut header).await {
                    Ok(n) if n > 0 => {}
                    _ => break,
                }
                let f: Vec<&str> = header.trim_end().split(' ').collect();
                let parsed = match f.as_slice() {
                    ["@@", id, status, out_len, err_len] => (|| {
                        Some((
                            id.parse::<u64>().ok()?,
                            status.parse::<i32>().ok()?,
                            out_len.parse::<usize>().ok()?,
                            err_len.parse::<usize>().ok()?,
                        ))
                    })(),
                    _ => None,
                };
                let Some((id, status, out_len, err_len)) = parsed else {
                    tracing::warn!(header = %header.trim_end(), "the agent answered out of frame");
                    break;
                };
                let mut stdout = vec![0; out_len];
                let mut stderr = vec![0; err_len];
                if reader.read_exact(&mut stdout).await.is_err()
                    || reader.read_exact(&mut stderr).await.is_err()
                {
                    break;
                }
                let waiter = reader_pending
                    .lock()
                    .unwrap_or_else(|e| e.into_inner())
                    .remove(&id);
                if let Some(w) = waiter {
                    let _ = w.send(Reply {
                        status,
                        stdout,
                        stderr,
                    });
                }
            }
            reader_dead.store(true, Ordering::SeqCst);
            // Waiters see their sender dropped: the connection is gone.
            reader_pending
                .lock()
                .unwrap_or_else(|e| e.into_inner())
                .clear();
        });
        Ok(Agent {
            stdin: tokio::sync::Mutex::new(stdin),
            pending,
            next_id: AtomicU64::new(1),
            dead,
            _child: child,
        })
    }

    fn is_dead(&self) -> bool {
        self.dead.load(Ordering::SeqCst)
    }

    /// Sends one request and waits for its answer.
    async fn request(&self, argv: &[String]) -> Result<Reply, RunError> {
        if argv.iter().any(|a| a.contains('\0')) {
            return Err(RunError::Failed(
                "an argument or environment value contains a NUL byte".into(),
            ));
        }
        let id = self.next_id.fetch_add(1, Ordering::SeqCst);
        let mut line = id.to_string();
        for a in argv {
            line.push(' ');
            line.push_str(&quote_for_agent(a));
        }
        line.push('\n');
        let (tx, rx) = tokio::sync::oneshot::channel();
        self.pending
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .insert(id, tx);
        let lost = || RunError::Unreachable("the connection to the host's agent ended".into());
        if self.is_dead() {
            return Err(lost());
        }
        {
            let mut stdin = self.stdin.lock().await;
            if stdin.write_all(line.as_bytes()).await.is_err() || stdin.flush().await.is_err() {
                return Err(lost());
            }
        }
        rx.await.map_err(|_| lost())
    }
}

#[derive(Debug)]
struct Host {
    node: SshNode,
    connection: tokio::sync::Mutex<Option<Arc<Connection>>>,
}

/// Why a command on a host did not do its job.
#[derive(Debug)]
enum RunError {
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

#[derive(Debug)]
struct Entry {
    node: String,
    gpus: Vec<GpuRef>,
    port: u16,
    exited: Option<(Option<i32>, String)>,
    stopping: bool,
    /// How far rank 0's log has been read for progress; `None`: not yet
    /// known (a re-adopted worker is followed from its log's end).
    offset: Option<u64>,
    lines: ProgressLines,
    /// When the launch (or the adoption) completed; `None` while launching.
    settled: Option<Instant>,
}

#[derive(Debug, Default)]
struct Inner {
    workers: BTreeMap<WorkerId, Entry>,
    progress: BTreeMap<JobId, Vec<ProgressSample>>,
    /// Exit records to delete on each node (their exits are in the log).
    forget: BTreeMap<String, BTreeSet<WorkerId>>,
    probes: BTreeMap<String, NodeProbe>,
    /// Bumped by `release`: poll loops and stop tasks started before it end
    /// without recording anything.
    generation: u64,
    leading: bool,
}

/// Runs workers on hosts over SSH. Cheap to clone (shared state).
#[derive(Debug, Clone)]
pub struct SshExecutor {
    shared: Arc<Shared>,
}

#[derive(Debug)]
struct Shared {
    config: SshConfig,
    hosts: BTreeMap<String, Arc<Host>>,
    inner: Mutex<Inner>,
}

impl SshExecutor {
    /// An executor for the hosts in `config`. Nothing is contacted until
    /// this server leads ([`Executor::take_over`]).
    pub fn new(config: SshConfig) -> Result<SshExecutor, ExecutorError> {
        std::fs::create_dir_all(&config.control_dir).map_err(|e| {
            ExecutorError::Other(format!("creating {}: {e}", config.control_dir.display()))
        })?;
        let hosts = config
            .nodes
            .iter()
            .map(|n| {
                (
                    n.name.clone(),
                    Arc::new(Host {
                        node: n.clone(),
                        connection: tokio::sync::Mutex::new(None),
                    }),
                )
            })
            .collect();
        Ok(SshExecutor {
            shared: Arc::new(Shared {
                config,
                hosts,
                inner: Mutex::default(),
            }),
        })
    }

    /// The nodes this executor runs workers on.
    pub fn nodes(&self) -> impl Iterator<Item = &SshNode> {
        self.shared.config.nodes.iter()
    }

    fn lock(&self) -> MutexGuard<'_, Inner> {
        // A panic while holding the lock leaves plain data; go on with it.
        self.shared.inner.lock().unwrap_or_else(|e| e.into_inner())
    }

    fn generation(&self) -> u64 {
        self.lock().generation
    }

    /// The connection to `host`, made (helper installed, GPUs found) if
    /// there is none.
    async fn connect(&self, host: &Host) -> Result<Arc<Connection>, RunError> {
        let mut slot = host.connection.lock().await;
        if let Some(c) = slot.as_ref() {
            if !c.is_dead() {
                return Ok(c.clone());
            }
            if let Some(c) = slot.take() {
                tokio::task::spawn_blocking(move || drop(c));
            }
        }
        let node = &host.node;
        let config = &self.shared.config;
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
        let session = tokio::time::timeout(
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
        })?;
        // Install the helper (once per version) and learn the work
        // directory's absolute path.
        let install = "mkdir -p \"$1\" && cd \"$1\" && mkdir -p workers checkpoints && \
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
        let session = Arc::new(session);
        let helper = format!("{work_dir}/{}", helper_name());
        let mut agents = Vec::with_capacity(AGENTS_PER_HOST);
        for _ in 0..AGENTS_PER_HOST {
            agents.push(Agent::start(&session, &helper).await?);
        }
        let agent = &agents[0];
        let mut probe = vec!["probe".to_string()];
        if node.gpus.is_none() {
            probe.push("gpus".into());
        }
        let reply = tokio::time::timeout(
            config.connect_timeout + Duration::from_secs(10),
            agent.request(&probe),
        )
        .await
        .map_err(|_| RunError::Unreachable(format!("no answer from {}'s agent", node.host)))??;
        if reply.status != 0 {
            return Err(RunError::Failed(clip(&String::from_utf8_lossy(
                &reply.stderr,
            ))));
        }
        let gpus = match &node.gpus {
            Some(declared) => declared.clone(),
            None => parse_nvidia_smi(&String::from_utf8_lossy(&reply.stdout))
                .map_err(|e| RunError::Failed(e.to_string()))?,
        };
        let connection = Connection {
            _session: session,
            agents,
            next_agent: AtomicU64::new(0),
            work_dir,
            gpus,
        };
        tracing::info!(node = %node.name, host = %node.host, work_dir = %connection.work_dir, gpus = connection.gpus.len(), "connected over SSH");
        let connection = Arc::new(connection);
        *slot = Some(connection.clone());
        Ok(connection)
    }

    /// Drops `host`'s connection if it is still `broken` (a later one is
    /// kept). Closing runs `ssh -O exit`, so it happens off the runtime.
    async fn disconnect(&self, host: &Host, broken: &Arc<Connection>) {
        let mut slot = host.connection.lock().await;
        if slot.as_ref().is_some_and(|c| Arc::ptr_eq(c, broken)) {
            if let Some(c) = slot.take() {
                tokio::task::spawn_blocking(move || drop(c));
            }
        }
    }

    /// Runs `argv` (a helper command and its arguments) on `host`'s agent,
    /// connecting first if needed, and returns its stdout. A broken or
    /// silent connection is dropped.
    async fn run(
        &self,
        host: &Host,
        argv: Vec<String>,
        timeout: Duration,
    ) -> Result<(Arc<Connection>, Vec<u8>), RunError> {
        let connection = self.connect(host).await?;
        let Some(agent) = connection.agent() else {
            return Err(RunError::Failed("no agent".into()));
        };
        match tokio::time::timeout(timeout, agent.request(&argv)).await {
            Err(_) => {
                self.disconnect(host, &connection).await;
                Err(RunError::Unreachable(format!(
                    "no answer from {} within {:.0} s",
                    host.node.host,
                    timeout.as_secs_f64()
                )))
            }
            Ok(Err(e)) => {
                self.disconnect(host, &connection).await;
                Err(e)
            }
            Ok(Ok(reply)) if reply.status == 0 => Ok((connection, reply.stdout)),
            Ok(Ok(reply)) => Err(RunError::Failed(format!(
                "exit status {}: {}",
                reply.status,
                clip(&String::from_utf8_lossy(&reply.stderr))
            ))),
        }
    }

    fn command_timeout(&self) -> Duration {
        self.shared.config.connect_timeout + Duration::from_secs(10)
    }

    fn record_exit(&self, id: &WorkerId, exit_code: Option<i32>, reason: String) {
        let mut inner = self.lock();
        if let Some(e) = inner.workers.get_mut(id) {
            if e.exited.is_some() {
                return;
            }
            let reason = crate::reconcile::exit_reason(e.stopping, reason);
            tracing::info!(worker = %id, code = ?exit_code, %reason, "worker exited");
            e.exited = Some((exit_code, reason));
        }
    }

    /// The rendezvous port of (job, epoch): the one its workers have, else
    /// the lowest no other live (job, epoch) uses.
    fn port_for(inner: &Inner, job_id: JobId, epoch: u64) -> u16 {
        let mut used = BTreeSet::new();
        for (id, e) in &inner.workers {
            if id.job_id == job_id && id.epoch == epoch {
                return e.port;
            }
            if e.exited.is_none() {
                used.insert(e.port);
            }
        }
        (RENDEZVOUS_PORT_BASE..u16::MAX)
            .find(|p| !used.contains(p))
            .unwrap_or(RENDEZVOUS_PORT_BASE)
    }

    async fn launch_worker(&self, launch: WorkerLaunch) {
        let id = launch.id.clone();
        let Some(host) = self.shared.hosts.get(&launch.node).cloned() else {
            self.insert_exited(
                &id,
                &launch.node,
                Some(127),
                format!("node {:?} is not in the SSH nodes file", launch.node),
            );
            return;
        };
        if launch.command.is_empty() {
            self.insert_exited(
                &id,
                &launch.node,
                Some(127),
                "the SSH executor runs commands, not images".into(),
            );
            return;
        }
        let generation = {
            let mut inner = self.lock();
            let port = Self::port_for(&inner, id.job_id, id.epoch);
            inner.workers.insert(
                id.clone(),
                Entry {
                    node: launch.node.clone(),
                    gpus: gpu_refs(&launch.node, launch.gpus.iter().copied()),
                    port,
                    exited: None,
                    stopping: false,
                    offset: Some(0),
                    lines: ProgressLines::default(),
                    settled: None,
                },
            );
            inner.generation
        };
        if self.attempt_launch(&host, &launch, generation).await {
            return;
        }
        // The host did not answer: keep trying in the background (the
        // reconcile pass is not held up). If it stays away, its node is
        // marked lost, the worker is no longer wanted, and `stop` ends the
        // attempts.
        let this = self.clone();
        tokio::spawn(async move {
            loop {
                tokio::time::sleep(
                    this.shared
                        .config
                        .poll_interval
                        .max(Duration::from_millis(500)),
                )
                .await;
                {
                    let mut inner = this.lock();
                    if inner.generation != generation {
                        return;
                    }
                    let Some(e) = inner.workers.get_mut(&launch.id) else {
                        return;
                    };
                    if e.exited.is_some() || e.settled.is_some() {
                        return;
                    }
                    if e.stopping {
                        e.exited = Some((
                            None,
                            format!(
                                "stopped before it started: node {} could not be reached",
                                launch.node
                            ),
                        ));
                        e.settled = Some(Instant::now());
                        return;
                    }
                }
                if this.attempt_launch(&host, &launch, generation).await {
                    return;
                }
            }
        });
    }

    /// One attempt at starting `launch` on `host`. Returns false when the
    /// host could not be reached (try again); a launch that ran, or failed
    /// on the host, is settled.
    async fn attempt_launch(&self, host: &Host, launch: &WorkerLaunch, generation: u64) -> bool {
        let id = &launch.id;
        let result = match self.connect(host).await {
            Err(e) => Err(e),
            Ok(connection) => {
                let port = self.lock().workers.get(id).map_or(0, |e| e.port);
                let checkpoint = format!(
                    "{}/checkpoints/{}",
                    connection.work_dir,
                    checkpoint_dir_name(id.job_id)
                );
                let env = environment(launch, port, &checkpoint);
                let gpus = if launch.gpus.is_empty() {
                    "-".to_string()
                } else {
                    launch
                        .gpus
                        .iter()
                        .map(u32::to_string)
                        .collect::<Vec<_>>()
                        .join(",")
                };
                let mut argv = vec![
                    "launch".to_string(),
                    connection.base(id),
                    checkpoint,
                    port.to_string(),
                    gpus,
                    env.len().to_string(),
                ];
                argv.extend(env.iter().map(|(k, v)| format!("{k}={v}")));
                argv.extend(launch.command.iter().cloned());
                self.run(host, argv, self.command_timeout()).await
            }
        };
        let mut inner = self.lock();
        if inner.generation != generation {
            return true;
        }
        match result {
            Ok((_, stdout)) => {
                let offset = String::from_utf8_lossy(&stdout)
                    .lines()
                    .next()
                    .and_then(|l| l.trim().parse().ok())
                    .unwrap_or(0);
                if let Some(e) = inner.workers.get_mut(id) {
                    e.offset = Some(offset);
                    e.settled = Some(Instant::now());
                }
                tracing::info!(worker = %id, node = %launch.node, gpus = ?launch.gpus, "worker started over SSH");
                true
            }
            Err(RunError::Unreachable(reason)) => {
                tracing::warn!(worker = %id, node = %launch.node, %reason, "cannot reach the node to launch; will retry");
                false
            }
            Err(e @ RunError::Failed(_)) => {
                drop(inner);
                let reason = format!("could not launch on node {}: {e}", launch.node);
                tracing::warn!(worker = %id, %reason, "worker did not start");
                self.record_exit(id, Some(127), reason);
                if let Some(w) = self.lock().workers.get_mut(id) {
                    w.settled = Some(Instant::now());
                }
                true
            }
        }
    }

    fn insert_exited(&self, id: &WorkerId, node: &str, code: Option<i32>, reason: String) {
        tracing::warn!(worker = %id, %reason, "worker did not start");
        self.lock().workers.insert(
            id.clone(),
            Entry {
                node: node.to_string(),
                gpus: Vec::new(),
                port: 0,
                exited: Some((code, reason)),
                stopping: false,
                offset: None,
                lines: ProgressLines::default(),
                settled: Some(Instant::now()),
            },
        );
    }

    /// Sends `signal` to a worker's process group; retried while the host
    /// cannot be reached, until the worker is known to have exited or this
    /// server stops leading.
    async fn signal_until_sent(&self, id: &WorkerId, signal: &str, generation: u64) {
        loop {
            let node = {
                let inner = self.lock();
                if inner.generation != generation {
                    return;
                }
                match inner.workers.get(id) {
                    Some(e) if e.exited.is_none() => e.node.clone(),
                    _ => return,
                }
            };
            let Some(host) = self.shared.hosts.get(&node).cloned() else {
                return;
            };
            let connection = match self.connect(&host).await {
                Ok(c) => c,
                Err(e) => {
                    tracing::debug!(worker = %id, error = %e, "cannot signal yet");
                    tokio::time::sleep(self.shared.config.poll_interval).await;
                    continue;
                }
            };
            let argv = vec!["signal".into(), signal.into(), connection.base(id)];
            match self.run(&host, argv, self.command_timeout()).await {
                Ok(_) => return,
                Err(e) => {
                    tracing::debug!(worker = %id, signal, error = %e, "signal not delivered yet");
                    tokio::time::sleep(self.shared.config.poll_interval).await;
                }
            }
        }
    }

    /// Polls one host until this server stops leading.
    async fn poll_loop(self, host: Arc<Host>, generation: u64) {
        let interval = self.shared.config.poll_interval;
        let mut wait = interval;
        loop {
            if self.generation() != generation {
                return;
            }
            let name = host.node.name.clone();
            let probe = match self.poll_once(&host, generation).await {
                Ok(gpus) => {
                    wait = interval;
                    NodeProbe::Answered(NodeReport {
                        name: name.clone(),
                        address: host.node.address.clone(),
                        gpus,
                    })
                }
                Err(e) => {
                    tracing::debug!(node = %name, error = %e, "node did not answer");
                    wait = (wait * 2).min(RECONNECT_BACKOFF_MAX);
                    NodeProbe::Unreachable {
                        name: name.clone(),
                        reason: e.to_string(),
                    }
                }
            };
            {
                let mut inner = self.lock();
                if inner.generation != generation {
                    return;
                }
                inner.probes.insert(name, probe);
            }
            tokio::time::sleep(wait).await;
        }
    }

    /// One poll of `host`: forgets, worker states, progress. Returns the
    /// node's GPUs.
    async fn poll_once(&self, host: &Host, generation: u64) -> Result<Vec<Gpu>, RunError> {
        let name = &host.node.name;
        let started = Instant::now();
        let (forgets, reads): (Vec<WorkerId>, Vec<(WorkerId, Option<u64>)>) = {
            let inner = self.lock();
            let forgets = inner
                .forget
                .get(name)
                .map(|s| s.iter().cloned().collect())
                .unwrap_or_default();
            let reads = inner
                .workers
                .iter()
                .filter(|(id, e)| {
                    id.rank == 0 && e.node == *name && e.exited.is_none() && e.settled.is_some()
                })
                .map(|(id, e)| (id.clone(), e.offset))
                .collect();
            (forgets, reads)
        };
        let connection = self.connect(host).await?;
        let mut argv = vec!["poll".to_string(), connection.workers_dir()];
        argv.extend(forgets.iter().map(|id| format!("F:{}", relative_base(id))));
        argv.extend(reads.iter().map(|(id, offset)| match offset {
            Some(o) => format!("{}:{o}", relative_base(id)),
            None => format!("{}:end", relative_base(id)),
        }));
        let (connection, out) = self.run(host, argv, self.command_timeout()).await?;
        let report = parse_poll(&out).map_err(RunError::Failed)?;
        let at_ms = now_ms();
        let mut inner = self.lock();
        if inner.generation != generation {
            return Ok(connection.gpus.clone());
        }
        if let Some(pending) = inner.forget.get_mut(name) {
            for id in &forgets {
                pending.remove(id);
            }
        }
        // Progress first: a worker found exited below has its last lines
        // in these chunks (read after its state was). A rank 0 whose log
        // was not read to its end in this poll has its exit recorded by a
        // later one, so no progress line is lost.
        let mut drained: BTreeSet<WorkerId> = reads.iter().map(|(id, _)| id.clone()).collect();
        for (id, offset, chunk) in report.chunks {
            if chunk.len() >= POLL_CHUNK_MAX {
                drained.remove(&id);
            }
            let Some(e) = inner.workers.get_mut(&id) else {
                continue;
            };
            match e.offset {
                None => {
                    e.offset = Some(offset);
                    continue;
                }
                Some(o) if o != offset => continue,
                Some(_) => e.offset = Some(offset + chunk.len() as u64),
            }
            let samples = e.lines.push(&chunk, at_ms);
            if !samples.is_empty() {
                buffer_progress(&mut inner.progress, id.job_id, samples);
            }
        }
        let mut seen = BTreeSet::new();
        let pending_forget: BTreeSet<WorkerId> =
            inner.forget.get(name).cloned().unwrap_or_default();
        let mut exits = Vec::new();
        for (id, state) in report.workers {
            seen.insert(id.clone());
            if pending_forget.contains(&id) {
                continue;
            }
            let known = inner.workers.get(&id);
            match (state, known) {
                (WorkerState::Running { port, gpus }, None) => {
                    tracing::info!(worker = %id, node = %name, "re-adopting a worker found running");
                    inner.workers.insert(
                        id.clone(),
                        Entry {
                            node: name.clone(),
                            gpus: gpu_refs(name, gpus),
                            port,
                            exited: None,
                            stopping: false,
                            offset: None,
                            lines: ProgressLines::default(),
                            settled: Some(Instant::now()),
                        },
                    );
                }
                (WorkerState::Running { .. }, Some(_)) => {}
                (_, Some(_)) if id.rank == 0 && !drained.contains(&id) => {}
                (WorkerState::Exited { code, reason }, known) => {
                    if known.is_none() {
                        tracing::info!(worker = %id, node = %name, %reason, "a worker ended while no server watched it");
                        inner.workers.insert(id.clone(), unknown_exited(name));
                    }
                    exits.push((id, code, reason));
                }
                (WorkerState::Gone, known) => {
                    if known.is_none() {
                        inner.workers.insert(id.clone(), unknown_exited(name));
                    }
                    exits.push((
                        id,
                        None,
                        "killed (its supervisor left no exit record)".to_string(),
                    ));
                }
            }
        }
        // Workers this executor started whose records are gone from the host.
        for (id, e) in &inner.workers {
            if e.node == *name
                && e.exited.is_none()
                && e.settled.is_some_and(|t| t < started)
                && !seen.contains(id)
                && (id.rank != 0 || drained.contains(id))
            {
                exits.push((
                    id.clone(),
                    None,
                    "its records on the host are gone".to_string(),
                ));
            }
        }
        drop(inner);
        for (id, code, reason) in exits {
            self.record_exit(&id, code, reason);
        }
        Ok(connection.gpus.clone())
    }

    fn running(&self) -> Vec<WorkerId> {
        self.lock()
            .workers
            .iter()
            .filter(|(_, e)| e.exited.is_none())
            .map(|(id, _)| id.clone())
            .collect()
    }
}

fn unknown_exited(node: &str) -> Entry {
    Entry {
        node: node.to_string(),
        gpus: Vec::new(),
        port: 0,
        exited: None,
        stopping: false,
        offset: None,
        lines: ProgressLines::default(),
        settled: Some(Instant::now()),
    }
}

#[derive(Debug, PartialEq, Eq)]
enum WorkerState {
    Running { port: u16, gpus: Vec<u32> },
    Exited { code: Option<i32>, reason: String },
    Gone,
}

#[derive(Debug, Default)]
struct PollReport {
    workers: Vec<(WorkerId, WorkerState)>,
    chunks: Vec<(WorkerId, u64, Vec<u8>)>,
}

/// Splits `out` at the first newline: (line, rest).
fn next_line(out: &[u8]) -> Option<(&str, &[u8])> {
    let nl = out.iter().position(|b| *b == b'\n')?;
    Some((std::str::from_utf8(&out[..nl]).ok()?, &out[nl + 1..]))
}

/// Parses the helper's `poll` output.
fn parse_poll(mut out: &[u8]) -> Result<PollReport, String> {
    let mut report = PollReport::default();
    loop {
        let (line, rest) =
            next_line(out).ok_or_else(|| "the poll's answer ended early".to_string())?;
        out = rest;
        let mut words = line.splitn(3, ' ');
        let kind = words.next().unwrap_or("");
        if kind == "END" {
            return Ok(report);
        }
        let base = words.next().unwrap_or("");
        let rest = words.next().unwrap_or("");
        let id = parse_base(base).ok_or_else(|| format!("unexpected poll line {line:?}"))?;
        match kind {
            "R" => {
                let f: Vec<&str> = rest.split(' ').collect();
                let port = f.first().and_then(|p| p.parse().ok()).unwrap_or(0);
                let gpus = f.get(1).map(|g| parse_gpus(g)).unwrap_or_default();
                report
                    .workers
                    .push((id, WorkerState::Running { port, gpus }));
            }
            "X" => {
                let (code, reason) = rest.split_once(' ').unwrap_or((rest, ""));
                report.workers.push((
                    id,
                    WorkerState::Exited {
                        code: code.parse().ok(),
                        reason: clip(reason),
                    },
                ));
            }
            "G" => report.workers.push((id, WorkerState::Gone)),
            "P" => {
                let mut f = rest.split(' ');
                let offset: u64 = f.next().and_then(|s| s.parse().ok()).unwrap_or(0);
                let len: usize = f
                    .next()
                    .and_then(|s| s.parse().ok())
                    .ok_or_else(|| format!("unexpected poll line {line:?}"))?;
                if out.len() < len {
                    return Err("a log chunk ended early".into());
                }
                report.chunks.push((id, offset, out[..len].to_vec()));
                out = &out[len..];
            }
            _ => return Err(format!("unexpected poll line {line:?}")),
        }
    }
}

/// Parses the helper's `logs` output for one job.
fn parse_logs(job_id: JobId, mut out: &[u8]) -> Vec<WorkerLog> {
    let mut logs = Vec::new();
    while let Some((line, rest)) = next_line(out) {
        let f: Vec<&str> = line.split(' ').collect();
        let (Some(&"L"), Some(name), Some(total), Some(len)) =
            (f.first(), f.get(1), f.get(2), f.get(3))
        else {
            break;
        };
        let (Ok(total_bytes), Ok(len)) = (total.parse::<u64>(), len.parse::<usize>()) else {
            break;
        };
        let Some(id) = name
            .strip_suffix(".log")
            .and_then(|stem| parse_base(&format!("job-{job_id}/{stem}")))
        else {
            break;
        };
        if rest.len() < len {
            break;
        }
        logs.push(WorkerLog {
            id,
            content: rest[..len].to_vec(),
            total_bytes,
        });
        out = &rest[len..];
    }
    logs
}

impl Executor for SshExecutor {
    fn owns(&self, node: &str) -> bool {
        self.shared.hosts.contains_key(node)
    }

    async fn launch(&self, launch: WorkerLaunch) -> Result<(), ExecutorError> {
        if self.lock().workers.contains_key(&launch.id) {
            return Ok(());
        }
        self.launch_worker(launch).await;
        Ok(())
    }

    async fn stop(&self, id: &WorkerId, grace: Duration) -> Result<(), ExecutorError> {
        let generation = {
            let mut inner = self.lock();
            match inner.workers.get_mut(id) {
                Some(e) if e.exited.is_none() && !e.stopping => e.stopping = true,
                _ => return Ok(()),
            }
            inner.generation
        };
        tracing::info!(worker = %id, grace_s = grace.as_secs_f64(), "stopping worker");
        let this = self.clone();
        let id = id.clone();
        tokio::spawn(async move {
            let deadline = tokio::time::Instant::now() + grace;
            this.signal_until_sent(&id, "TERM", generation).await;
            tokio::time::sleep_until(deadline).await;
            this.signal_until_sent(&id, "KILL", generation).await;
        });
        Ok(())
    }

    async fn observe(&self) -> Result<BTreeMap<WorkerId, Observed>, ExecutorError> {
        Ok(self
            .lock()
            .workers
            .iter()
            .map(|(id, e)| (id.clone(), Observed::of(&e.exited, &e.gpus)))
            .collect())
    }

    async fn forget(&self, id: &WorkerId) {
        let mut inner = self.lock();
        let Some(node) = inner
            .workers
            .get(id)
            .filter(|e| e.exited.is_some())
            .map(|e| e.node.clone())
        else {
            return;
        };
        inner.workers.remove(id);
        if self.shared.hosts.contains_key(&node) {
            inner.forget.entry(node).or_default().insert(id.clone());
        }
    }

    async fn take_progress(&self) -> BTreeMap<JobId, Vec<ProgressSample>> {
        std::mem::take(&mut self.lock().progress)
    }

    async fn logs(&self, job_id: JobId, tail_bytes: u64) -> Result<Vec<WorkerLog>, ExecutorError> {
        let mut tasks = tokio::task::JoinSet::new();
        for host in self.shared.hosts.values() {
            let this = self.clone();
            let host = host.clone();
            tasks.spawn(async move {
                let connection = this.connect(&host).await?;
                let argv = vec![
                    "logs".to_string(),
                    connection.workers_dir(),
                    format!("job-{job_id}"),
                    tail_bytes.to_string(),
                ];
                let (_, out) = this.run(&host, argv, this.command_timeout()).await?;
                Ok::<_, RunError>(parse_logs(job_id, &out))
            });
        }
        let mut out = Vec::new();
        let mut errors = Vec::new();
        while let Some(joined) = tasks.join_next().await {
            match joined {
                Ok(Ok(logs)) => out.extend(logs),
                Ok(Err(e)) => errors.push(e.to_string()),
                Err(e) => errors.push(e.to_string()),
            }
        }
        if out.is_empty() && !errors.is_empty() {
            return Err(ExecutorError::Other(format!(
                "no node answered: {}",
                errors.join("; ")
            )));
        }
        out.sort_by(|a, b| a.id.cmp(&b.id));
        Ok(out)
    }

    async fn take_over(&self) {
        let generation = {
            let mut inner = self.lock();
            if inner.leading {
                return;
            }
            inner.leading = true;
            inner.generation
        };
        for host in self.shared.hosts.values() {
            tokio::spawn(self.clone().poll_loop(host.clone(), generation));
        }
    }

    async fn release(&self) {
        let mut inner = self.lock();
        inner.generation += 1;
        inner.leading = false;
        inner.workers.clear();
        inner.progress.clear();
        inner.forget.clear();
        inner.probes.clear();
    }

    async fn take_node_probes(&self) -> Vec<NodeProbe> {
        std::mem::take(&mut self.lock().probes)
            .into_values()
            .collect()
    }

    async fn shutdown(&self, grace: Duration) {
        let running = self.running();
        for id in &running {
            let _ = self.stop(id, grace).await;
        }
        let deadline = tokio::time::Instant::now() + grace + Duration::from_secs(3);
        while !self.running().is_empty() && tokio::time::Instant::now() < deadline {
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
        // These exits were the shutdown's doing, not the workers' failures:
        // drop their records so the next leader does not report them (the
        // state still wants the workers, and they are relaunched from their
        // checkpoints).
        let mut by_node: BTreeMap<String, Vec<WorkerId>> = BTreeMap::new();
        {
            let inner = self.lock();
            for id in &running {
                if let Some(e) = inner.workers.get(id) {
                    by_node.entry(e.node.clone()).or_default().push(id.clone());
                }
            }
        }
        for (node, ids) in by_node {
            let Some(host) = self.shared.hosts.get(&node) else {
                continue;
            };
            let Ok(connection) = self.connect(host).await else {
                continue;
            };
            // Released, claims included: the next leader launches them again.
            let mut argv = vec!["poll".to_string(), connection.workers_dir()];
            argv.extend(ids.iter().map(|id| format!("R:{}", relative_base(id))));
            let _ = self.run(host, argv, self.command_timeout()).await;
        }
        let mut inner = self.lock();
        inner.generation += 1;
        inner.leading = false;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn bases_round_trip() {
        let id = WorkerId {
            job_id: 12,
            epoch: 3,
            rank: 1,
        };
        assert_eq!(parse_base(&relative_base(&id)), Some(id));
        assert_eq!(parse_base("job-x/e1-r0"), None);
        assert!(helper_name().starts_with("keel-node-"));
    }

    #[test]
    fn agent_words_quote_quotes_and_newlines() {
        assert_eq!(quote_for_agent("a b"), "'a b'");
        assert_eq!(quote_for_agent("it's"), "'it'\\''s'");
        assert_eq!(quote_for_agent("x\ny"), "'x'\"$nl\"'y'");
        assert_eq!(quote_for_agent(""), "''");
    }

    #[test]
    fn poll_answers_parse_with_binary_chunks() {
        let mut out = b"R job-1/e1-r0 29500 0,1\nX job-2/e1-r0 137 killed by SIGKILL (status 137)\nG job-3/e2-r1\n".to_vec();
        out.extend_from_slice(b"P job-1/e1-r0 10 5\nab\ncdP job-1/e1-r1 0 0\nEND\n");
        let r = parse_poll(&out).expect("parses");
        assert_eq!(r.workers.len(), 3);
        assert_eq!(
            r.workers[0].1,
            WorkerState::Running {
                port: 29500,
                gpus: vec![0, 1]
            }
        );
        assert_eq!(
            r.workers[1].1,
            WorkerState::Exited {
                code: Some(137),
                reason: "killed by SIGKILL (status 137)".into()
            }
        );
        assert_eq!(r.workers[2].1, WorkerState::Gone);
        assert_eq!(r.chunks[0].2, b"ab\ncd");
        assert_eq!(r.chunks[1].2, b"");
        assert!(parse_poll(b"R job-1/e1-r0 1 0\n").is_err(), "no END");
        assert!(parse_poll(b"P job-1/e1-r0 0 50\nshort").is_err());
        assert!(parse_poll(b"Q what\nEND\n").is_err());
    }

    #[test]
    fn log_answers_parse() {
        let logs = parse_logs(4, b"L e1-r0.log 100 3\nabcL e2-r1.log 2 2\nxy");
        assert_eq!(logs.len(), 2);
        assert_eq!(logs[0].content, b"abc");
        assert_eq!(logs[0].total_bytes, 100);
        assert_eq!(
            logs[1].id,
            WorkerId {
                job_id: 4,
                epoch: 2,
                rank: 1
            }
        );
    }

    #[test]
    fn rendezvous_ports_are_shared_by_an_epoch_and_unique_among_live_ones() {
        let mut inner = Inner::default();
        let mut add = |job_id, epoch, rank, port, exited: bool| {
            inner.workers.insert(
                WorkerId {
                    job_id,
                    epoch,
                    rank,
                },
                Entry {
                    exited: exited.then(|| (Some(0), String::new())),
                    port,
                    ..unknown_exited("n")
                },
            );
        };
        add(1, 1, 0, 29500, false);
        add(2, 1, 0, 29501, false);
        add(3, 1, 0, 29502, true);
        let inner = inner;
        assert_eq!(SshExecutor::port_for(&inner, 1, 1), 29500, "same epoch");
        assert_eq!(
            SshExecutor::port_for(&inner, 4, 1),
            29502,
            "freed by an exit"
        );
    }
}
