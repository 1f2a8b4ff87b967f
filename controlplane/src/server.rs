//! The `keel server` process: lock the data directory, start Raft, serve the
//! API, and shut down cleanly on SIGTERM or SIGINT.

use std::future::Future;
use std::net::SocketAddr;
use std::path::PathBuf;
use std::sync::Arc;

use keel_proto::api::keel_server::KeelServer;
use keel_storage::DataDir;
use tokio::net::TcpListener;

use keel_executors::{
    HollowConfig, HollowExecutor, KubeConfig, KubeExecutor, LocalConfig, LocalExecutor, SshConfig,
    SshExecutor,
};
use keel_scheduling::policy::Policy;

use crate::api::{Clock, KeelApi};
use crate::clock::ServerClock;
use crate::executors::AnyExecutor;
use crate::inventory::NodeInventory;
use crate::leader::LoopSettings;
use crate::node_liveness::HeartbeatInbox;
use crate::proposer::Proposer;
use crate::raft_network::{RaftService, RAFT_MESSAGE_MAX_BYTES};
use crate::raft_node::{Peers, RaftNode, RaftNodeError, RaftSettings};
use crate::MAX_REQUEST_BYTES;

#[derive(Debug, Clone)]
pub struct ServerConfig {
    pub id: u64,
    pub data_dir: PathBuf,
    pub listen: SocketAddr,
    /// The cluster's members at bootstrap (empty: a one-member cluster).
    /// This replica's entry is the address its peers and clients use.
    pub peers: Peers,
    pub raft: RaftSettings,
    /// The nodes this server runs workers on (local executor).
    pub nodes: Vec<NodeInventory>,
    /// Where the local executor keeps worker logs, pid and exit records and
    /// checkpoints (`None`: in the data directory). Replicas on one machine
    /// that share one let a new leader re-adopt the workers the last one
    /// started.
    pub executor_dir: Option<PathBuf>,
    /// With real GPUs, the kernel log read for the driver's Xid records
    /// (`/dev/kmsg`; `None`: none read).
    pub gpu_kernel_log: Option<PathBuf>,
    /// How workers' logs are rotated, and when they pause for want of space
    /// (local and SSH executors).
    pub worker_logs: keel_executors::worker_log::LogSettings,
    /// What the leader removes as time passes (finished jobs, their worker
    /// logs), in log time ([`crate::retention`]).
    pub retention: crate::retention::Retention,
    /// Run workers on these SSH hosts instead of local processes (the
    /// leader's executor probes them: they need no heartbeats).
    pub ssh: Option<SshConfig>,
    /// Run the nodes' workers as hollow workers: no process each, runs
    /// computed from the throughput table (`keel_executors::hollow`).
    pub hollow: bool,
    /// Run workers as Pods on this Kubernetes cluster instead (its Nodes
    /// with GPUs are probed by the leader's executor).
    pub kubernetes: Option<KubernetesTarget>,
    /// The scheduling policy, until an operator switches it at run time
    /// (`SetPolicy`, logged).
    pub policy: Arc<dyn Policy>,
    /// Options for the policies switched to at run time.
    pub policy_options: keel_scheduling::policy::PolicyOptions,
    pub loops: LoopSettings,
    /// How long a replica removed from its cluster keeps answering (each
    /// request with its removal) before it stops ([`crate::removal`]).
    pub removed_grace: std::time::Duration,
    /// The most `WatchEvents` streams this replica serves at once.
    pub max_event_streams: usize,
    /// The most API requests this replica works on at once
    /// ([`crate::admission`]).
    pub max_api_requests: usize,
    /// How long one API request may take ([`crate::admission`]).
    pub request_timeout: std::time::Duration,
    /// The most requests one connection may have open at once (HTTP/2
    /// streams; more wait on the caller's side).
    pub max_streams_per_connection: u32,
    /// Check every caller's token or certificate against its role
    /// ([`crate::authz`]); needs TLS.
    pub acl: bool,
    /// The umask the server was started with, which its local workers get
    /// back ([`crate::permissions`]); `None`: they keep the server's.
    pub worker_umask: Option<u32>,
    /// Where `/metrics`, `/healthz` and `/readyz` are served
    /// ([`crate::http`]).
    pub http: crate::http::HttpListen,
}

/// Where the Kubernetes executor finds its API server, and its settings.
#[derive(Debug, Clone)]
pub struct KubernetesTarget {
    /// `None`: the kubeconfig (`KUBECONFIG`, `~/.kube/config`) or the
    /// in-cluster service account; a URL: that API server, unauthenticated
    /// (a local proxy, `kubectl proxy`, or a test's stand-in).
    pub api_url: Option<String>,
    pub config: KubeConfig,
}

#[derive(Debug, thiserror::Error)]
pub enum ServerError {
    #[error(transparent)]
    Node(#[from] RaftNodeError),
    #[error(transparent)]
    DataDir(#[from] keel_storage::DataDirError),
    #[error("cannot listen on {addr}: {source}")]
    Listen {
        addr: SocketAddr,
        source: std::io::Error,
    },
    #[error("the gRPC server failed: {0}")]
    Serve(#[from] tonic::transport::Error),
    #[error("Raft stopped on a fatal error: {0}")]
    RaftStopped(String),
    #[error("the executor: {0}")]
    Executor(#[from] keel_executors::ExecutorError),
    #[error("the Kubernetes client: {0}")]
    Kubernetes(String),
    /// This replica was removed from its cluster and stopped (issue 34).
    #[error("{0}; stopped")]
    Removed(crate::removal::Removal),
}

/// Reads the certificates again at every SIGHUP: new connections, in and
/// out, use them; a file that does not load leaves the ones in use, and
/// the log says why.
///
/// The handler is installed before this returns, so a SIGHUP sent once the
/// server answers is never the default (which ends the process).
fn reload_on_sighup(
    tls: Arc<crate::tls::TlsState>,
    mut stop: tokio::sync::watch::Receiver<bool>,
) -> impl Future<Output = ()> {
    use tokio::signal::unix::{signal, SignalKind};
    let hangups = signal(SignalKind::hangup());
    async move {
        let mut hangups = match hangups {
            Ok(s) => s,
            Err(e) => {
                tracing::warn!(error = %e, "cannot watch for SIGHUP: certificates reload only at a restart");
                return;
            }
        };
        loop {
            tokio::select! {
                got = hangups.recv() => {
                    if got.is_none() {
                        return;
                    }
                    match tls.reload() {
                        Ok(()) => tracing::info!(
                            cert = ?tls.files().cert,
                            ca = %tls.files().ca.display(),
                            "SIGHUP: certificates reloaded; new connections use them"
                        ),
                        Err(e) => tracing::error!(
                            error = %e,
                            "SIGHUP: the certificates did not load; the ones in use stay"
                        ),
                    }
                }
                _ = stop.changed() => return,
            }
        }
    }
}

/// A started server: its bound address and the Raft node behind it.
pub struct Server {
    pub addr: SocketAddr,
    pub node: Arc<RaftNode>,
    listener: TcpListener,
    config: ServerConfig,
    executor: Arc<AnyExecutor>,
    /// Where this server's local workers' logs are, and the free space
    /// below which they pause (for its nodes' note).
    logs_floor: Option<crate::node_liveness::LogsFloor>,
    /// The HTTP endpoint's listener (`None`: off).
    http: Option<TcpListener>,
    /// Where it listens.
    pub http_addr: Option<SocketAddr>,
}

impl std::fmt::Debug for Server {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Server")
            .field("addr", &self.addr)
            .field("node", &self.node)
            .finish_non_exhaustive()
    }
}

impl Server {
    /// Locks the data directory, recovers or initialises Raft, and binds the
    /// listener. Nothing is served until [`Server::serve`].
    pub async fn start(config: &ServerConfig, clock: Clock) -> Result<Server, ServerError> {
        let data_dir = DataDir::open(&config.data_dir)?;
        let listener =
            TcpListener::bind(config.listen)
                .await
                .map_err(|source| ServerError::Listen {
                    addr: config.listen,
                    source,
                })?;
        let addr = listener
            .local_addr()
            .map_err(|source| ServerError::Listen {
                addr: config.listen,
                source,
            })?;
        // Tools and tests that start a server on port 0 learn its address
        // here. Written whole or not at all (a temporary file renamed over
        // it): a reader polling for the file never sees it half written.
        let addr_file = data_dir.root().join("server.addr");
        atomic_write_file::AtomicWriteFile::open(&addr_file)
            .and_then(|mut file| {
                use std::io::Write;
                file.write_all(addr.to_string().as_bytes())?;
                file.commit()
            })
            .map_err(|source| ServerError::Listen {
                addr: config.listen,
                source,
            })?;
        // The HTTP endpoint's address, for tools and tests likewise
        // (`DATA/http.addr`).
        let http = crate::http::bind(config.http)
            .await
            .map_err(|source| ServerError::Listen {
                addr: config.http.addr().unwrap_or(config.listen),
                source,
            })?;
        let http_addr = match &http {
            Some(l) => Some(l.local_addr().map_err(|source| ServerError::Listen {
                addr: config.listen,
                source,
            })?),
            None => None,
        };
        if let Some(http_addr) = http_addr {
            atomic_write_file::AtomicWriteFile::open(data_dir.root().join("http.addr"))
                .and_then(|mut file| {
                    use std::io::Write;
                    file.write_all(http_addr.to_string().as_bytes())?;
                    file.commit()
                })
                .map_err(|source| ServerError::Listen {
                    addr: http_addr,
                    source,
                })?;
        }
        let exe = std::env::current_exe().ok();
        let executor_dir = config
            .executor_dir
            .clone()
            .unwrap_or_else(|| data_dir.root().to_path_buf());
        let executor = match (&config.ssh, &config.kubernetes) {
            (_, Some(k8s)) => {
                // Keel retries in the background, not the client (see
                // `keel_executors::kubernetes::calls`).
                let kube_config = match &k8s.api_url {
                    Some(url) => {
                        let uri = url.parse().map_err(|e| {
                            ServerError::Kubernetes(format!("--k8s-api-url {url}: {e}"))
                        })?;
                        let mut c = kube::Config::new(uri);
                        c.default_namespace = k8s.config.namespace.clone();
                        c
                    }
                    None => kube::Config::infer()
                        .await
                        .map_err(|e| ServerError::Kubernetes(e.to_string()))?,
                };
                let client = keel_executors::kubernetes::calls::client(kube_config)
                    .map_err(|e| ServerError::Kubernetes(e.to_string()))?;
                AnyExecutor::Kube(KubeExecutor::new(client, k8s.config.clone()))
            }
            (Some(ssh), None) => AnyExecutor::Ssh(SshExecutor::new(ssh.clone())?),
            (None, None) if config.hollow => {
                let hollow = HollowExecutor::new(HollowConfig {
                    dir: executor_dir.join("hollow"),
                    checkpoints_dir: executor_dir.join("checkpoints"),
                    // Exits are found within a tenth of a second; progress
                    // is reported at each run's own interval.
                    tick_every: std::time::Duration::from_millis(100),
                })?;
                hollow.declare_nodes(config.nodes.iter().map(|n| n.name.as_str()))?;
                AnyExecutor::Hollow(hollow)
            }
            (None, None) => {
                let local = LocalExecutor::new(LocalConfig {
                    workers_dir: executor_dir.join("workers"),
                    checkpoints_dir: executor_dir.join("checkpoints"),
                    nodes_dir: executor_dir.join("nodes"),
                    path_prepend: exe.as_ref().and_then(|p| p.parent().map(PathBuf::from)),
                    // Workers run under `keel supervise`, so they outlive this
                    // process and a restarted server re-adopts them.
                    supervisor: exe,
                    check_gpu_processes: config.nodes.iter().any(|n| n.discovered),
                    logs: config.worker_logs,
                    worker_umask: config.worker_umask,
                })?;
                // This server's nodes run here: whichever server sharing
                // the executor directory leads runs their workers.
                local.declare_nodes(config.nodes.iter().map(|n| n.name.as_str()))?;
                AnyExecutor::Local(local)
            }
        };
        let advertise = config
            .peers
            .get(&config.id)
            .cloned()
            .unwrap_or_else(|| addr.to_string());
        let server_clock = ServerClock::new(clock.clone(), config.raft.max_clock_offset_ms);
        let node = RaftNode::start(
            config.id,
            &advertise,
            &config.peers,
            data_dir,
            &config.raft,
            server_clock,
        )
        .await?;
        let logs_floor = matches!(executor, AnyExecutor::Local(_))
            .then(|| crate::node_liveness::LogsFloor {
                dir: executor_dir.join("workers"),
                min_free_bytes: config.worker_logs.min_free_bytes,
            })
            .filter(|f| f.min_free_bytes > 0);
        Ok(Server {
            addr,
            node: Arc::new(node),
            listener,
            config: config.clone(),
            executor: Arc::new(executor),
            logs_floor,
            http,
            http_addr,
        })
    }

    /// Serves the API until `shutdown` resolves, then stops Raft and flushes.
    pub async fn serve(self, shutdown: impl Future<Output = ()>) -> Result<(), ServerError> {
        let proposer = Proposer::spawn(self.node.clone());
        // The leader's loops measure durations in log time.
        let log_time = self.node.clock.log_time();
        let (stop_tx, stop_rx) = tokio::sync::watch::channel(false);
        let clock_watch = tokio::spawn(crate::clock::clock_watch_loop(
            self.node.raft.clone(),
            self.node.clock.clone(),
            stop_rx.clone(),
        ));
        let heartbeats = Arc::new(HeartbeatInbox::new(log_time.clone()));
        let liveness = tokio::spawn(crate::node_liveness::liveness_loop(
            self.node.clone(),
            proposer.clone(),
            heartbeats.clone(),
            log_time.clone(),
            self.config.loops.clone(),
            stop_rx.clone(),
        ));
        let probing = tokio::spawn(forward_probes(
            self.executor.clone(),
            heartbeats.clone(),
            stop_rx.clone(),
        ));
        let repairing = tokio::spawn(membership_repair_loop(self.node.clone(), stop_rx.clone()));
        let following_leader = tokio::spawn(crate::leader_loss::follow_leader_loop(
            self.node.clone(),
            stop_rx.clone(),
        ));
        let retaining = tokio::spawn(crate::retention::retention_loop(
            self.node.clone(),
            self.executor.clone(),
            proposer.clone(),
            log_time.clone(),
            self.config.retention,
            stop_rx.clone(),
        ));
        let following = tokio::spawn(crate::metrics::follow(
            self.node.metrics.clone(),
            self.node.raft.clone(),
            self.node.state_machine.clone(),
            stop_rx.clone(),
        ));
        let serving_http = self.http.map(|listener| {
            let tls = match &self.node.transport {
                crate::transport::Transport::Tls(tls) => Some(tls.clone()),
                crate::transport::Transport::Plain => None,
            };
            tracing::info!(
                addr = ?self.http_addr,
                https = tls.is_some(),
                tokens = self.config.acl,
                "serving the console, /metrics, /healthz and /readyz"
            );
            tokio::spawn(crate::http::serve(
                listener,
                crate::http::Http::new(self.node.clone(), self.config.policy.name())
                    .with_acl(self.config.acl, crate::api::system_clock())
                    .with_whatif_defaults(crate::http::WhatifDefaults::of(
                        &self.config.policy_options,
                        &self.config.loops,
                    )),
                tls,
                stop_rx.clone(),
            ))
        });
        let reports = crate::leader::SchedulingReports::default();
        let scheduling = tokio::spawn(crate::leader::scheduling_loop(
            self.node.clone(),
            proposer.clone(),
            crate::leader::SchedulingSetup {
                default_policy: self.config.policy.clone(),
                options: self.config.policy_options.clone(),
                cannot_share_gpus: keel_executors::Executor::cannot_share_gpus(
                    self.executor.as_ref(),
                ),
                clock: log_time.clone(),
                settings: self.config.loops.clone(),
            },
            reports.clone(),
            stop_rx.clone(),
        ));
        let reconciling = tokio::spawn(crate::leader::reconcile_loop(
            self.node.clone(),
            proposer.clone(),
            self.executor.clone(),
            self.config.loops.clone(),
            stop_rx.clone(),
        ));
        let api = Arc::new(
            KeelApi::new(
                self.node.clone(),
                proposer,
                self.executor.clone(),
                heartbeats,
                self.config.policy.name(),
                reports,
                self.config.max_event_streams,
            )
            .with_acl(self.config.acl)
            .with_secret_keys(self.config.loops.secret_keys.clone()),
        );
        let beating = tokio::spawn(crate::node_liveness::heartbeat_loop(
            api.clone(),
            self.config.nodes.clone(),
            self.config.gpu_kernel_log.clone(),
            self.logs_floor.clone(),
            self.config.loops.clone(),
            stop_rx.clone(),
        ));
        let service = crate::metrics::Measured {
            metrics: self.node.metrics.clone(),
            inner: crate::removal::RefuseWhenRemoved {
                inner: crate::admission::Bounded::new(
                    crate::grpc_status::TooLargeIsResourceExhausted(
                        KeelServer::from_arc(api)
                            .max_decoding_message_size(MAX_REQUEST_BYTES)
                            .max_encoding_message_size(64 * MAX_REQUEST_BYTES),
                    ),
                    self.config.max_api_requests,
                )
                .with_deadline(self.config.request_timeout),
                flag: self.node.removal.clone(),
            },
        };
        tracing::info!(addr = %self.addr, tls = self.node.transport.is_tls(), "serving the Keel API");
        // Accepted with Nagle off (replies are small and latency-bound),
        // and with TLS handshaken, when the server has certificates.
        let incoming = self.node.transport.incoming(self.listener);
        let reloading = match &self.node.transport {
            crate::transport::Transport::Tls(tls) => {
                Some(tokio::spawn(reload_on_sighup(tls.clone(), stop_rx.clone())))
            }
            crate::transport::Transport::Plain => None,
        };
        // Set when the API begins to close: open FollowLeader streams end,
        // so the graceful shutdown does not wait on them.
        let (closing_tx, closing_rx) = tokio::sync::watch::channel(false);
        let raft_service = keel_proto::raft::raft_server::RaftServer::new(
            RaftService::new(
                self.node.raft.clone(),
                self.node.id,
                self.node.identity.clone(),
                self.node.wire_format,
                self.node.clock.clone(),
            )
            .members_by_certificate(self.node.transport.is_tls())
            .closing_with(closing_rx),
        )
        .max_decoding_message_size(RAFT_MESSAGE_MAX_BYTES)
        .max_encoding_message_size(RAFT_MESSAGE_MAX_BYTES);
        // Fail-stop: if Raft's core stops (a storage error: a full or
        // failing disk), the process ends with the cause instead of serving
        // on as a replica that can no longer vote or apply. What it had
        // made durable is recovered by the next start.
        //
        // Woken by the server's metrics (leader, vote, membership), which
        // close when the core ends, after its last full metrics say why:
        // the full ones change several times at every write, and this
        // future runs on the main thread, a wake-up from another thread
        // each time.
        let metrics = self.node.raft.metrics();
        let mut server_metrics = self.node.raft.server_metrics();
        let raft_failed = async move {
            loop {
                if let Err(fatal) = &metrics.borrow().running_state {
                    return fatal.to_string();
                }
                if server_metrics.changed().await.is_err() {
                    return match &metrics.borrow().running_state {
                        Err(fatal) => fatal.to_string(),
                        Ok(()) => "Raft's core stopped".to_string(),
                    };
                }
            }
        };
        let fatal = std::sync::Arc::new(std::sync::Mutex::new(None::<String>));
        let noted = fatal.clone();
        let removed = std::sync::Arc::new(std::sync::Mutex::new(None));
        let noted_removal = removed.clone();
        let removal = crate::removal::watch(
            self.node.clone(),
            self.node.removal.clone(),
            self.node.data_dir.root().to_path_buf(),
            self.config.removed_grace,
        );
        let watchdog = ShutdownWatchdog::new(self.config.loops.shutdown_timeout);
        let armed = watchdog.clone();
        let stop_serving = async move {
            tokio::select! {
                _ = shutdown => {}
                cause = raft_failed => {
                    tracing::error!(cause = %cause, "Raft stopped: shutting down");
                    if let Ok(mut f) = noted.lock() {
                        *f = Some(cause);
                    }
                }
                gone = removal => {
                    if let Ok(mut r) = noted_removal.lock() {
                        *r = Some(gone);
                    }
                }
            }
            let _ = closing_tx.send(true);
            armed.arm("closing the API (requests in flight)");
        };
        let result = tonic::transport::Server::builder()
            .max_concurrent_streams(Some(self.config.max_streams_per_connection))
            .add_service(service)
            .add_service(raft_service)
            .serve_with_incoming_shutdown(incoming, stop_serving)
            .await;
        tracing::info!("shutting down");
        // Armed already, unless the server stopped on its own.
        watchdog.arm("stopping the workers and the leader's loops");
        // Workers stop (SIGTERM, grace, SIGKILL) while Raft still runs, so
        // their exits are recorded where possible.
        let _ = stop_tx.send(true);
        let _ = scheduling.await;
        let _ = reconciling.await;
        let _ = liveness.await;
        let _ = beating.await;
        let _ = probing.await;
        let _ = repairing.await;
        let _ = following_leader.await;
        let _ = retaining.await;
        if let Some(reloading) = reloading {
            let _ = reloading.await;
        }
        let _ = clock_watch.await;
        let _ = following.await;
        if let Some(serving_http) = serving_http {
            let _ = serving_http.await;
        }
        watchdog.step("stopping Raft and flushing the log");
        let fatal = fatal.lock().ok().and_then(|mut f| f.take());
        let stopped = self.node.shutdown().await;
        watchdog.disarm();
        if let Some(cause) = fatal {
            return Err(ServerError::RaftStopped(cause));
        }
        if let Some(removal) = removed.lock().ok().and_then(|mut r| r.take()) {
            return Err(ServerError::Removed(removal));
        }
        stopped?;
        result?;
        Ok(())
    }
}

/// Bounds a shutdown: once armed, the process exits with status 2 if the
/// shutdown has not finished within the timeout, logging the step it was
/// stuck at (a write that cannot commit without a quorum, say, would
/// otherwise hold it forever). A thread of its own, so a runtime that is
/// stuck cannot hold it too.
#[derive(Debug, Clone)]
struct ShutdownWatchdog {
    timeout: std::time::Duration,
    /// The step under way; `None` once the shutdown finished.
    step: Arc<std::sync::Mutex<Option<&'static str>>>,
    armed: Arc<std::sync::atomic::AtomicBool>,
}

impl ShutdownWatchdog {
    fn new(timeout: std::time::Duration) -> Self {
        ShutdownWatchdog {
            timeout,
            step: Arc::new(std::sync::Mutex::new(None)),
            armed: Arc::new(std::sync::atomic::AtomicBool::new(false)),
        }
    }

    /// Starts the clock (once) at `step`.
    fn arm(&self, step: &'static str) {
        if self.armed.swap(true, std::sync::atomic::Ordering::SeqCst) {
            return;
        }
        self.step(step);
        let (timeout, watched) = (self.timeout, self.step.clone());
        let spawned = std::thread::Builder::new()
            .name("shutdown-watchdog".into())
            .spawn(move || {
                std::thread::sleep(timeout);
                let stuck = *watched.lock().unwrap_or_else(|e| e.into_inner());
                if let Some(step) = stuck {
                    tracing::error!(
                        step,
                        timeout_s = timeout.as_secs_f64(),
                        "the shutdown did not finish in time; exiting (status 2) while {step}"
                    );
                    std::process::exit(2);
                }
            });
        if let Err(e) = spawned {
            tracing::warn!(error = %e, "cannot start the shutdown watchdog");
        }
    }

    fn step(&self, step: &'static str) {
        *self.step.lock().unwrap_or_else(|e| e.into_inner()) = Some(step);
    }

    /// The shutdown finished: the watchdog lets the process be.
    fn disarm(&self) {
        *self.step.lock().unwrap_or_else(|e| e.into_inner()) = None;
    }
}

/// How often the leader looks for a member to re-admit.
/// The most requests one connection may have open at once, unless
/// `--max-streams-per-connection` says otherwise: a quarter of the
/// replica's whole bound (`--max-api-requests`), so one caller cannot take
/// every place. A follower forwarding for many clients shares one
/// connection to the leader; past it, its forwards wait their turn.
pub const MAX_STREAMS_PER_CONNECTION: u32 = 256;

const MEMBERSHIP_REPAIR_INTERVAL: std::time::Duration = std::time::Duration::from_millis(500);

/// On the leader: re-admits members that came back with a new data
/// directory, one membership change at a time (`membership::Repairer`).
async fn membership_repair_loop(node: Arc<RaftNode>, mut stop: tokio::sync::watch::Receiver<bool>) {
    let mut repairer = crate::membership::Repairer::new(node.strangers.clone());
    loop {
        tokio::select! {
            _ = stop.changed() => return,
            _ = tokio::time::sleep(MEMBERSHIP_REPAIR_INTERVAL) => {}
        }
        match repairer.step(&node.raft).await {
            Ok(Some(step)) => tracing::info!(?step, "membership repair step committed"),
            Ok(None) => {}
            Err(e) => tracing::warn!(error = %e, "membership repair step failed; trying again"),
        }
    }
}

/// Hands what the executor's probes learned (SSH hosts answering or not) to
/// the liveness loop, as heartbeats. The executor probes only while this
/// server leads, so a follower forwards nothing.
async fn forward_probes(
    executor: Arc<AnyExecutor>,
    inbox: Arc<HeartbeatInbox>,
    mut stop: tokio::sync::watch::Receiver<bool>,
) {
    loop {
        tokio::select! {
            _ = tokio::time::sleep(std::time::Duration::from_millis(200)) => {}
            _ = stop.changed() => return,
        }
        if *stop.borrow() {
            return;
        }
        let probes = keel_executors::Executor::take_node_probes(executor.as_ref()).await;
        if !probes.is_empty() {
            inbox.record_probes(probes);
        }
    }
}

/// Resolves on SIGTERM or SIGINT.
pub async fn shutdown_signal() {
    let ctrl_c = async {
        if let Err(e) = tokio::signal::ctrl_c().await {
            tracing::error!(error = %e, "cannot listen for SIGINT");
            std::future::pending::<()>().await;
        }
    };
    #[cfg(unix)]
    let term = async {
        match tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate()) {
            Ok(mut s) => {
                s.recv().await;
            }
            Err(e) => {
                tracing::error!(error = %e, "cannot listen for SIGTERM");
                std::future::pending::<()>().await;
            }
        }
    };
    #[cfg(not(unix))]
    let term = std::future::pending::<()>();
    tokio::select! {
        _ = ctrl_c => tracing::info!("SIGINT received"),
        _ = term => tracing::info!("SIGTERM received"),
    }
}
