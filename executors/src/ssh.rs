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
//!
//! The module's parts, each in its own file:
//!
//! - [`protocol`]: the agent's requests and replies (framed by a
//!   tokio-util codec) and the `poll` and `logs` answers, pure;
//! - `connection`: the SSH master, the helper's installation, the agents;
//! - `poll`: what a poll asks and how its answer changes the book, pure,
//!   and the loop that runs it;
//! - this file: the [`Executor`] (launch, stop, logs, take over, release),
//!   its workers kept in a [`WorkerBook`].

mod connection;
mod nodes_file;
mod poll;
pub mod protocol;

use std::collections::{BTreeMap, BTreeSet};
use std::sync::Arc;
use std::time::{Duration, Instant};

use keel_state::{JobId, ProgressSample};

pub use connection::AGENTS_PER_HOST;
pub use nodes_file::{
    parse_nodes_file, HostKeyCheck, NodesFileError, SshConfig, SshNode, FIELD_MAX_LEN,
    NODES_FILE_MAX_BYTES, NODES_MAX,
};
pub use protocol::{helper_name, HELPER_SCRIPT};

use crate::book::{Book, Clock, SystemClock, Worker, WorkerBook};
use crate::contract::{checkpoint_dir_name, environment, gpu_refs, ProgressLines, WorkerLaunch};
use crate::executor::{Executor, ExecutorError, NodeProbe, RemovedLogs, WorkerLog};
use crate::reconcile::Observed;
use crate::WorkerId;
use connection::{Host, RunError, ShippedKeel};
use protocol::{parse_logs, release_request};

/// The longest wait between attempts to reach a host that does not answer.
pub const RECONNECT_BACKOFF_MAX: Duration = Duration::from_secs(10);

/// The first rendezvous port handed out; each live (job, epoch) gets the
/// lowest one no other live one uses.
pub const RENDEZVOUS_PORT_BASE: u16 = 29500;

/// What the book keeps of an SSH worker besides what every executor keeps.
#[derive(Debug, Default)]
struct SshWorker {
    /// The rendezvous port of its (job, epoch).
    port: u16,
    /// How far rank 0's log has been read for progress; `None`: not yet
    /// known (a re-adopted worker is followed from its log's end).
    offset: Option<u64>,
    lines: ProgressLines,
    /// When the launch (or the adoption) completed; `None` while launching.
    settled: Option<Instant>,
}

/// Exit records to delete on each node (their exits are in the log), sent
/// with the node's next poll.
#[derive(Debug, Default)]
struct PendingForgets {
    forget: BTreeMap<String, BTreeSet<WorkerId>>,
}

type SshBook = Book<SshWorker, PendingForgets>;

/// Runs workers on hosts over SSH. Cheap to clone (shared state).
#[derive(Debug, Clone)]
pub struct SshExecutor {
    shared: Arc<Shared>,
}

#[derive(Debug)]
struct Shared {
    config: SshConfig,
    hosts: BTreeMap<String, Arc<Host>>,
    book: WorkerBook<SshWorker, PendingForgets>,
}

impl SshExecutor {
    /// An executor for the hosts in `config`. Nothing is contacted until
    /// this server leads ([`Executor::take_over`]).
    pub fn new(config: SshConfig) -> Result<SshExecutor, ExecutorError> {
        SshExecutor::with_clock(config, Arc::new(SystemClock))
    }

    /// An executor reading the time from `clock`.
    pub fn with_clock(
        config: SshConfig,
        clock: Arc<dyn Clock>,
    ) -> Result<SshExecutor, ExecutorError> {
        std::fs::create_dir_all(&config.control_dir).map_err(|e| {
            ExecutorError::Other(format!("creating {}: {e}", config.control_dir.display()))
        })?;
        let ship = match (&config.keel_binary, config.install_keel) {
            (Some(path), true) => Some(ShippedKeel::new(path).map_err(|e| {
                ExecutorError::Other(format!(
                    "reading {} to install it on the hosts: {e}",
                    path.display()
                ))
            })?),
            _ => None,
        };
        let hosts = config
            .nodes
            .iter()
            .map(|n| (n.name.clone(), Arc::new(Host::new(n.clone(), ship.clone()))))
            .collect();
        Ok(SshExecutor {
            shared: Arc::new(Shared {
                config,
                hosts,
                book: WorkerBook::new(clock),
            }),
        })
    }

    /// The nodes this executor runs workers on.
    pub fn nodes(&self) -> impl Iterator<Item = &SshNode> {
        self.shared.config.nodes.iter()
    }

    fn book(&self) -> &WorkerBook<SshWorker, PendingForgets> {
        &self.shared.book
    }

    /// The rendezvous port of (job, epoch): the one its workers have, else
    /// the lowest no other live (job, epoch) uses.
    fn port_for(book: &SshBook, job_id: JobId, epoch: u64) -> u16 {
        let mut used = BTreeSet::new();
        for (id, w) in &book.workers {
            if id.job_id == job_id && id.epoch == epoch {
                return w.extra.port;
            }
            if w.is_running() {
                used.insert(w.extra.port);
            }
        }
        (RENDEZVOUS_PORT_BASE..u16::MAX)
            .find(|p| !used.contains(p))
            .unwrap_or(RENDEZVOUS_PORT_BASE)
    }

    async fn launch_worker(&self, launch: WorkerLaunch) {
        let id = launch.id.clone();
        let Some(host) = self.shared.hosts.get(&launch.node).cloned() else {
            let reason = format!("node {:?} is not in the SSH nodes file", launch.node);
            self.not_started(&id, &launch.node, reason);
            return;
        };
        if launch.command.is_empty() {
            let reason = "the SSH executor runs commands, not images".to_string();
            self.not_started(&id, &launch.node, reason);
            return;
        }
        let generation = {
            let mut book = self.book().lock();
            let extra = SshWorker {
                port: Self::port_for(&book, id.job_id, id.epoch),
                offset: Some(0),
                ..SshWorker::default()
            };
            let gpus = gpu_refs(&launch.node, launch.gpus.iter().copied());
            book.workers
                .insert(id.clone(), Worker::running(&launch.node, gpus, extra));
            book.generation()
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
                    let now = this.book().now();
                    let mut book = this.book().lock();
                    if !book.is_current(generation) {
                        return;
                    }
                    let Some(w) = book.workers.get_mut(&launch.id) else {
                        return;
                    };
                    if !w.is_running() || w.extra.settled.is_some() {
                        return;
                    }
                    if w.stopping {
                        w.exited = Some((
                            None,
                            format!(
                                "stopped before it started: node {} could not be reached",
                                launch.node
                            ),
                        ));
                        w.extra.settled = Some(now);
                        return;
                    }
                }
                if this.attempt_launch(&host, &launch, generation).await {
                    return;
                }
            }
        });
    }

    fn not_started(&self, id: &WorkerId, node: &str, reason: String) {
        let extra = SshWorker {
            settled: Some(self.book().now()),
            ..SshWorker::default()
        };
        self.book()
            .insert_not_started(id, node, (Some(127), reason), extra);
    }

    /// One attempt at starting `launch` on `host`. Returns false when the
    /// host could not be reached (try again); a launch that ran, or failed
    /// on the host, is settled.
    async fn attempt_launch(&self, host: &Host, launch: &WorkerLaunch, generation: u64) -> bool {
        let id = &launch.id;
        let config = &self.shared.config;
        let result = match host.connect(config).await {
            Err(e) => Err(e),
            Ok(connection) => {
                let port = self
                    .book()
                    .lock()
                    .workers
                    .get(id)
                    .map_or(0, |w| w.extra.port);
                let checkpoint = format!(
                    "{}/checkpoints/{}",
                    connection.work_dir,
                    checkpoint_dir_name(id.job_id)
                );
                let mut env = environment(launch, port, &checkpoint);
                if let Some(dir) = &connection.bin_dir {
                    // The helper puts it first on the worker's PATH.
                    env.insert("KEEL_BIN_DIR".into(), dir.clone());
                }
                // The job's limits, for the helper's supervisor (which
                // takes them out of the worker's environment).
                if let Some(bytes) = launch.resources.memory_bytes {
                    env.insert("KEEL_LIMIT_MEMORY_BYTES".into(), bytes.to_string());
                }
                if let Some(millis) = launch.resources.cpu_millis {
                    env.insert("KEEL_LIMIT_CPU_MILLIS".into(), millis.to_string());
                }
                // How the host's log writer rotates the worker's log: as
                // the job asks within the server's maximum (the supervisor
                // takes these out too, and says where the job asked more).
                let (rotation, notes) = config.logs.for_job(&launch.logs);
                env.insert(
                    "KEEL_LOG_MAX_FILE_BYTES".into(),
                    rotation.max_file_bytes.to_string(),
                );
                env.insert("KEEL_LOG_MAX_FILES".into(), rotation.max_files.to_string());
                env.insert(
                    "KEEL_LOG_MIN_FREE_BYTES".into(),
                    config.logs.min_free_bytes.to_string(),
                );
                if !notes.is_empty() {
                    env.insert("KEEL_LOG_NOTE".into(), notes.join("; "));
                }
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
                host.run(config, argv).await
            }
        };
        let now = self.book().now();
        let mut book = self.book().lock();
        if !book.is_current(generation) {
            return true;
        }
        match result {
            Ok((_, stdout)) => {
                let stdout = String::from_utf8_lossy(&stdout);
                // "N WHY": the host refused a GPU another process uses.
                if let Some(why) = stdout.lines().find_map(|l| l.strip_prefix("N ")) {
                    book.record_not_admitted(id, format!("could not start: {}", why.trim()));
                    if let Some(w) = book.workers.get_mut(id) {
                        w.extra.settled = Some(now);
                    }
                    return true;
                }
                let offset = stdout
                    .lines()
                    .next()
                    .and_then(|l| l.trim().parse().ok())
                    .unwrap_or(0);
                if let Some(w) = book.workers.get_mut(id) {
                    w.extra.offset = Some(offset);
                    w.extra.settled = Some(now);
                }
                tracing::info!(worker = %id, node = %launch.node, gpus = ?launch.gpus, "worker started over SSH");
                true
            }
            Err(RunError::Unreachable(reason)) => {
                tracing::warn!(worker = %id, node = %launch.node, %reason, "cannot reach the node to launch; will retry");
                false
            }
            Err(e @ RunError::Failed(_)) => {
                let reason = format!("could not launch on node {}: {e}", launch.node);
                tracing::warn!(worker = %id, %reason, "worker did not start");
                book.record_exit(id, Some(127), reason);
                if let Some(w) = book.workers.get_mut(id) {
                    w.extra.settled = Some(now);
                }
                true
            }
        }
    }

    /// Sends `signal` to a worker's process group; retried while the host
    /// cannot be reached, until the worker is known to have exited or this
    /// server stops leading.
    async fn signal_until_sent(&self, id: &WorkerId, signal: &str, generation: u64) {
        let config = &self.shared.config;
        loop {
            let node = {
                let book = self.book().lock();
                if !book.is_current(generation) {
                    return;
                }
                match book.workers.get(id) {
                    Some(w) if w.is_running() => w.node.clone(),
                    _ => return,
                }
            };
            let Some(host) = self.shared.hosts.get(&node).cloned() else {
                return;
            };
            let connection = match host.connect(config).await {
                Ok(c) => c,
                Err(e) => {
                    tracing::debug!(worker = %id, error = %e, "cannot signal yet");
                    tokio::time::sleep(config.poll_interval).await;
                    continue;
                }
            };
            let argv = vec!["signal".into(), signal.into(), connection.base(id)];
            match host.run(config, argv).await {
                Ok(_) => return,
                Err(e) => {
                    tracing::debug!(worker = %id, signal, error = %e, "signal not delivered yet");
                    tokio::time::sleep(config.poll_interval).await;
                }
            }
        }
    }
}

impl Executor for SshExecutor {
    fn kind(&self) -> &'static str {
        "ssh"
    }

    fn owns(&self, node: &str) -> bool {
        self.shared.hosts.contains_key(node)
    }

    async fn launch(&self, launch: WorkerLaunch) -> Result<(), ExecutorError> {
        if self.book().contains(&launch.id) {
            return Ok(());
        }
        self.launch_worker(launch).await;
        Ok(())
    }

    async fn stop(&self, id: &WorkerId, grace: Duration) -> Result<(), ExecutorError> {
        let Some(generation) = self.book().begin_stop(id) else {
            return Ok(());
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
        Ok(self.book().observe())
    }

    async fn forget(&self, id: &WorkerId) {
        let mut book = self.book().lock();
        let Some(worker) = book.forget(id) else {
            return;
        };
        if self.shared.hosts.contains_key(&worker.node) {
            book.shared
                .forget
                .entry(worker.node)
                .or_default()
                .insert(id.clone());
        }
    }

    async fn take_progress(&self) -> BTreeMap<JobId, Vec<ProgressSample>> {
        self.book().take_progress()
    }

    async fn remove_logs(&self, job_id: JobId) -> Result<Option<RemovedLogs>, ExecutorError> {
        if self.book().running().iter().any(|id| id.job_id == job_id) {
            return Ok(None);
        }
        let mut tasks = tokio::task::JoinSet::new();
        for host in self.shared.hosts.values() {
            let this = self.clone();
            let host = host.clone();
            tasks.spawn(async move {
                let config = &this.shared.config;
                let connection = host.connect(config).await?;
                let argv = vec![
                    "remove_logs".to_string(),
                    connection.workers_dir(),
                    format!("job-{job_id}"),
                ];
                let (_, out) = host.run(config, argv).await?;
                Ok::<_, RunError>(String::from_utf8_lossy(&out).trim().to_string())
            });
        }
        let mut removed = RemovedLogs::default();
        let mut running = false;
        let mut errors = Vec::new();
        while let Some(joined) = tasks.join_next().await {
            match joined {
                Ok(Ok(answer)) if answer == "running" => running = true,
                Ok(Ok(answer)) => {
                    let mut f = answer.split(' ').map(|n| n.parse::<u64>().unwrap_or(0));
                    removed.files += f.next().unwrap_or(0);
                    removed.bytes += f.next().unwrap_or(0);
                }
                Ok(Err(e)) => errors.push(e.to_string()),
                Err(e) => errors.push(e.to_string()),
            }
        }
        // A host that did not answer keeps its files: asked again later.
        if !errors.is_empty() {
            return Err(ExecutorError::Other(format!(
                "removing the logs of job {job_id}: {}",
                errors.join("; ")
            )));
        }
        Ok((!running).then_some(removed))
    }

    async fn logs(&self, job_id: JobId, tail_bytes: u64) -> Result<Vec<WorkerLog>, ExecutorError> {
        let mut tasks = tokio::task::JoinSet::new();
        for host in self.shared.hosts.values() {
            let this = self.clone();
            let host = host.clone();
            tasks.spawn(async move {
                let config = &this.shared.config;
                let connection = host.connect(config).await?;
                let argv = vec![
                    "logs".to_string(),
                    connection.workers_dir(),
                    format!("job-{job_id}"),
                    tail_bytes.to_string(),
                ];
                let (_, out) = host.run(config, argv).await?;
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
        let Some(generation) = self.book().begin_leading() else {
            return;
        };
        for host in self.shared.hosts.values() {
            tokio::spawn(self.clone().poll_loop(host.clone(), generation));
        }
    }

    async fn release(&self) {
        self.book().release();
    }

    async fn take_node_probes(&self) -> Vec<NodeProbe> {
        self.book().take_probes()
    }

    async fn shutdown(&self, grace: Duration) {
        let running = self.book().running();
        for id in &running {
            let _ = self.stop(id, grace).await;
        }
        let deadline = tokio::time::Instant::now() + grace + Duration::from_secs(3);
        while !self.book().running().is_empty() && tokio::time::Instant::now() < deadline {
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
        // These exits were the shutdown's doing, not the workers' failures:
        // drop their records so the next leader does not report them (the
        // state still wants the workers, and they are relaunched from their
        // checkpoints).
        let mut by_node: BTreeMap<String, Vec<WorkerId>> = BTreeMap::new();
        {
            let book = self.book().lock();
            for id in &running {
                if let Some(w) = book.workers.get(id) {
                    by_node.entry(w.node.clone()).or_default().push(id.clone());
                }
            }
        }
        let config = &self.shared.config;
        for (node, ids) in by_node {
            let Some(host) = self.shared.hosts.get(&node) else {
                continue;
            };
            let Ok(connection) = host.connect(config).await else {
                continue;
            };
            // Released, claims included: the next leader launches them again.
            let argv = release_request(connection.workers_dir(), &ids);
            let _ = host.run(config, argv).await;
        }
        self.book().end_leading();
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn rendezvous_ports_are_shared_by_an_epoch_and_unique_among_live_ones() {
        let mut book = SshBook::default();
        let mut add = |job_id, epoch, rank, port, exited: bool| {
            let extra = SshWorker {
                port,
                ..SshWorker::default()
            };
            let mut w = Worker::running("n", Vec::new(), extra);
            w.exited = exited.then(|| (Some(0), String::new()));
            book.workers.insert(
                WorkerId {
                    job_id,
                    epoch,
                    rank,
                },
                w,
            );
        };
        add(1, 1, 0, 29500, false);
        add(2, 1, 0, 29501, false);
        add(3, 1, 0, 29502, true);
        let book = book;
        assert_eq!(SshExecutor::port_for(&book, 1, 1), 29500, "same epoch");
        assert_eq!(
            SshExecutor::port_for(&book, 4, 1),
            29502,
            "freed by an exit"
        );
    }
}
