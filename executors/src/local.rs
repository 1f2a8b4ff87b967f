//! The local executor: workers are child processes of the server.
//!
//! Each worker runs in its own process group (so stopping it reaches the
//! processes it starts), with the worker contract in its environment. Its
//! stdout and stderr go straight to `ROOT/job-J/eE-rR.log` (no pipe through
//! the server, so a worker never dies of a broken pipe when the server
//! does); the executor follows rank 0's log for progress lines and buffers
//! them until the reconcile loop takes them. Stop = SIGTERM to the group,
//! then SIGKILL after the grace period (under a supervisor, to every process
//! of the group but the supervisor, which then records the exit).
//!
//! With a supervisor (`keel supervise`, see [`crate::supervisor`]), each
//! worker runs under a small parent that outlives the server and records the
//! worker's exit. A `.pid` file beside each log (the supervisor's pid, its
//! kernel start time, the worker's GPUs) lets a server that starts to lead
//! find them: [`Executor::take_over`] re-adopts the ones still running (the
//! reconciler then launches nothing twice) and reports the exits it missed;
//! this is how a restarted server, or a new leader on the same machine
//! sharing the directory (`--executor-dir`), carries on. Without a
//! supervisor (unit tests), leftovers are killed instead.
//! [`Executor::release`] (leadership lost) stops watching every worker
//! without touching it, so a deposed leader never records or stops what the
//! next one now owns.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

use keel_state::{JobId, ProgressSample};
use nix::sys::signal::{killpg, Signal};
use nix::unistd::Pid;
use tokio::io::AsyncWriteExt;

use crate::book::{Clock, SystemClock, Worker, WorkerBook};
use crate::containment::{Cgroups, WorkerCgroup};
use crate::contract::{checkpoint_dir_name, environment, gpu_refs, WorkerLaunch};
use crate::declared_nodes::DeclaredNodes;
use crate::executor::{Executor, ExecutorError, RemovedLogs, WorkerLog};
use crate::reconcile::Observed;
use crate::supervisor::{read_exit, ExitRecord};
use crate::WorkerId;

/// Where the local executor keeps things.
#[derive(Debug, Clone)]
pub struct LocalConfig {
    /// Per-worker logs and pid files.
    pub workers_dir: PathBuf,
    /// Per-job checkpoint directories.
    pub checkpoints_dir: PathBuf,
    /// One empty file per node this machine runs workers for, written by
    /// every server that shares the directory
    /// ([`LocalExecutor::declare_nodes`]): what the executor owns.
    pub nodes_dir: PathBuf,
    /// Put first on the workers' PATH (the directory of the `keel` binary,
    /// so job files can run `keel trainer`).
    pub path_prepend: Option<PathBuf>,
    /// The `keel` binary, to run each worker under `keel supervise`.
    /// `None`: workers are direct children of the server; a later executor
    /// kills the ones it finds instead of re-adopting them.
    pub supervisor: Option<PathBuf>,
    /// The GPUs are real (found by `nvidia-smi`): before a worker starts,
    /// ask the driver which processes use its GPUs, and refuse a GPU that
    /// a process of another job, or of no job, uses.
    pub check_gpu_processes: bool,
    /// How the supervisor rotates each worker's log, and the free space
    /// below which it pauses it (so that a noisy worker cannot fill the
    /// disk the Raft log needs).
    pub logs: crate::worker_log::LogSettings,
    /// The umask supervised workers run under (the server runs under
    /// `077`); `None`: the supervisor's.
    pub worker_umask: Option<u32>,
}

/// What a `.pid` file holds.
#[derive(Debug, serde::Serialize, serde::Deserialize)]
struct PidFile {
    pid: u32,
    /// Kernel start time of `pid`, so a reused pid is never mistaken for it.
    start: u64,
    node: String,
    gpus: Vec<u32>,
    /// The worker's cgroup, when it has one.
    #[serde(default)]
    cgroup: Option<PathBuf>,
}

/// What a `.claim` file holds: the server process that launched (or is
/// launching) the worker. Created exclusively before the launch, in the
/// executor directory the replicas on one machine share, so that two
/// servers — a leader and a stale one woken from a pause — never both
/// start one (job, epoch, rank).
#[derive(Debug, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
struct Claim {
    pid: u32,
    /// Kernel start time of `pid`.
    start: u64,
}

impl Claim {
    fn ours() -> Option<Claim> {
        let pid = std::process::id();
        Some(Claim {
            pid,
            start: process_start_time(pid)?,
        })
    }

    fn alive(&self) -> bool {
        process_start_time(self.pid) == Some(self.start)
    }
}

/// Whether this server may launch a worker ([`LocalExecutor::claim`]).
#[derive(Debug, PartialEq, Eq)]
enum Claimed {
    /// The claim is ours: launch it.
    Ours,
    /// Another server launched it (now adopted, or its exit reported) or is
    /// launching it: nothing to start.
    Elsewhere,
}

/// What the book keeps of a local worker besides what every executor
/// keeps: its process (the supervisor's, with one), if it started.
#[derive(Debug)]
struct LocalWorker {
    pid: Option<u32>,
    /// The cgroup holding every process it started, when it has one.
    cgroup: Option<WorkerCgroup>,
}

/// The rendezvous port of each live (job, epoch).
#[derive(Debug, Default)]
struct Ports {
    by_epoch: BTreeMap<(JobId, u64), u16>,
}

/// Runs workers as local child processes. Cheap to clone (shared state).
#[derive(Debug, Clone)]
pub struct LocalExecutor {
    config: Arc<LocalConfig>,
    book: Arc<WorkerBook<LocalWorker, Ports>>,
    /// Where each worker's cgroup goes (with a supervisor, where a cgroup
    /// hierarchy is writable); `None`: process groups only.
    cgroups: Option<Arc<Cgroups>>,
    /// The nodes the servers sharing the directory declared.
    nodes: DeclaredNodes,
}

/// How long a worker's leftover processes get after its main process
/// exited, between SIGTERM and the kill.
pub const LEFTOVER_GRACE: Duration = Duration::from_secs(10);

/// How often a re-adopted worker (not our child: no wait) is checked.
const ADOPTED_POLL: Duration = Duration::from_millis(200);

/// How often a running worker's log is read for progress lines.
const PROGRESS_POLL: Duration = Duration::from_millis(200);

/// The bytes of `path` from `offset` on (at most 1 MiB per read).
/// Up to 1 MiB of stream `path` from `offset` (see [`crate::worker_log`]):
/// where the bytes start (later than `offset` when rotation took what was
/// there) and the bytes.
async fn read_from(path: &Path, offset: u64) -> (u64, Vec<u8>) {
    let path = path.to_path_buf();
    tokio::task::spawn_blocking(move || crate::worker_log::read_from(&path, offset, 1 << 20))
        .await
        .ok()
        .and_then(Result::ok)
        .map_or((offset, Vec::new()), |(at, bytes, _)| (at, bytes))
}

/// Stream `path`'s length (0 when it is missing or unreadable).
async fn stream_len(path: &Path) -> u64 {
    let path = path.to_path_buf();
    tokio::task::spawn_blocking(move || crate::worker_log::segments(&path).map_or(0, |s| s.total()))
        .await
        .unwrap_or(0)
}

fn log_name(id: &WorkerId) -> String {
    format!("e{}-r{}", id.epoch, id.rank)
}

/// The kernel's start time of `pid` (clock ticks since boot), if it runs
/// (a zombie does not).
fn process_start_time(pid: u32) -> Option<u64> {
    stat_start_time(pid, false)
}

/// The kernel's start time of `pid`, running or a zombie not yet waited
/// for (`zombie_too`): a worker that ended before its launch finished
/// still has the start time its pid file records.
fn stat_start_time(pid: u32, zombie_too: bool) -> Option<u64> {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    let after_name = &stat[stat.rfind(')')? + 1..];
    let mut fields = after_name.split_whitespace();
    match fields.next() {
        Some("X") => return None,
        Some("Z") if !zombie_too => return None,
        _ => {}
    }
    fields.nth(18)?.parse().ok()
}

impl LocalExecutor {
    /// Creates the directories. Workers an earlier server left are taken
    /// over by [`Executor::take_over`], once this server leads.
    pub fn new(config: LocalConfig) -> Result<LocalExecutor, ExecutorError> {
        LocalExecutor::with_clock(config, Arc::new(SystemClock))
    }

    /// An executor reading the time from `clock`.
    pub fn with_clock(
        config: LocalConfig,
        clock: Arc<dyn Clock>,
    ) -> Result<LocalExecutor, ExecutorError> {
        for dir in [
            &config.workers_dir,
            &config.checkpoints_dir,
            &config.nodes_dir,
        ] {
            std::fs::create_dir_all(dir)
                .map_err(|e| ExecutorError::Other(format!("creating {}: {e}", dir.display())))?;
        }
        let cgroups = match &config.supervisor {
            None => None,
            Some(_) => {
                let tag = blake3::hash(config.workers_dir.to_string_lossy().as_bytes()).to_hex();
                match Cgroups::detect(&tag[..16]) {
                    Ok(c) => {
                        tracing::info!(parent = %c.parent.display(), flavour = ?c.flavour, "each worker runs in its own cgroup");
                        Some(Arc::new(c))
                    }
                    Err(why) => {
                        tracing::warn!(%why, "workers are contained by their process group only: a process that calls setsid escapes it");
                        None
                    }
                }
            }
        };
        Ok(LocalExecutor {
            nodes: DeclaredNodes::new(&config.nodes_dir),
            config: Arc::new(config),
            book: Arc::new(WorkerBook::new(clock)),
            cgroups,
        })
    }

    /// Whether each worker runs in its own cgroup.
    pub fn contains_in_cgroups(&self) -> bool {
        self.cgroups.is_some()
    }

    /// Declares this server's nodes as run by this machine: any server
    /// sharing the executor directory (and so the machine) then owns them
    /// when it leads.
    pub fn declare_nodes<'a>(
        &self,
        names: impl IntoIterator<Item = &'a str>,
    ) -> Result<(), ExecutorError> {
        self.nodes.declare(names)
    }

    /// Claims a worker's identity before launching it: an exclusive create
    /// of its `.claim` file. A claim that exists already means another
    /// server launched the worker (its pid or exit file is there: this one
    /// adopts it, or reports its exit) or is launching it now (its process
    /// lives: this one waits for the next pass). A claim whose server is
    /// gone without launching (killed between claim and spawn) is taken
    /// over.
    fn claim(&self, id: &WorkerId, log_path: &Path) -> std::io::Result<Claimed> {
        let path = log_path.with_extension("claim");
        let ours = Claim::ours();
        for _ in 0..2 {
            match std::fs::OpenOptions::new()
                .write(true)
                .create_new(true)
                .open(&path)
            {
                Ok(mut file) => {
                    if let Some(ours) = &ours {
                        let body = serde_json::to_vec(ours).map_err(std::io::Error::other)?;
                        std::io::Write::write_all(&mut file, &body)?;
                    }
                    return Ok(Claimed::Ours);
                }
                Err(e) if e.kind() == std::io::ErrorKind::AlreadyExists => {
                    if pid_path(log_path).exists() || log_path.with_extension("exit").exists() {
                        tracing::info!(worker = %id, "launched by another server: adopting it");
                        self.take_over(id.clone(), log_path);
                        return Ok(Claimed::Elsewhere);
                    }
                    let holder: Option<Claim> = std::fs::read(&path)
                        .ok()
                        .and_then(|b| serde_json::from_slice(&b).ok());
                    if let Some(h) = holder.filter(|h| h.alive() && Some(h) != ours.as_ref()) {
                        tracing::info!(
                            worker = %id,
                            server_pid = h.pid,
                            "another server is launching this worker; waiting for it"
                        );
                        return Ok(Claimed::Elsewhere);
                    }
                    // Its server died before launching it: the claim is stale.
                    let _ = std::fs::remove_file(&path);
                }
                Err(e) => return Err(e),
            }
        }
        Ok(Claimed::Elsewhere)
    }

    fn job_dir(&self, job_id: JobId) -> PathBuf {
        self.config.workers_dir.join(format!("job-{job_id}"))
    }

    /// Workers an earlier server left: re-adopted when still running under
    /// a supervisor (or killed, without one), and their missed exits
    /// reported. Must run on a tokio runtime.
    fn take_over_leftovers(&self) {
        let Ok(jobs) = std::fs::read_dir(&self.config.workers_dir) else {
            return;
        };
        for job in jobs.flatten() {
            let Some(job_id) = job
                .file_name()
                .to_str()
                .and_then(|n| n.strip_prefix("job-"))
                .and_then(|n| n.parse::<JobId>().ok())
            else {
                continue;
            };
            let Ok(files) = std::fs::read_dir(job.path()) else {
                continue;
            };
            let mut names: Vec<PathBuf> = files.flatten().map(|f| f.path()).collect();
            names.sort();
            for path in names {
                let ext = path.extension().and_then(|e| e.to_str()).unwrap_or("");
                if ext != "pid" && ext != "exit" {
                    continue;
                }
                let Some((epoch, rank)) = path
                    .file_stem()
                    .and_then(|s| s.to_str())
                    .and_then(|s| parse_log_name(&format!("{s}.log")))
                else {
                    continue;
                };
                let id = WorkerId {
                    job_id,
                    epoch,
                    rank,
                };
                if self.book.contains(&id) {
                    continue;
                }
                self.take_over(id, &path.with_extension("log"));
            }
        }
    }

    fn take_over(&self, id: WorkerId, log_path: &Path) {
        let exit_path = log_path.with_extension("exit");
        let pid_file: Option<PidFile> = std::fs::read(pid_path(log_path))
            .ok()
            .and_then(|b| serde_json::from_slice(&b).ok());
        let running = pid_file
            .as_ref()
            .filter(|p| process_start_time(p.pid) == Some(p.start));
        match running {
            Some(p) if self.config.supervisor.is_some() => {
                tracing::info!(worker = %id, pid = p.pid, "re-adopting a worker left by an earlier server");
                let gpus = gpu_refs(&p.node, p.gpus.iter().copied());
                let cgroup = p
                    .cgroup
                    .clone()
                    .filter(|_| self.cgroups.is_some())
                    .map(WorkerCgroup::at);
                let extra = LocalWorker {
                    pid: Some(p.pid),
                    cgroup,
                };
                self.book.insert(&id, Worker::running(&p.node, gpus, extra));
                // Its progress stream, or the log of a worker started
                // before there were progress streams.
                let progress = Some(crate::worker_log::progress_path(log_path))
                    .filter(|p| p.exists())
                    .unwrap_or_else(|| log_path.to_path_buf());
                let start = crate::worker_log::segments(&progress).map_or(0, |s| s.total());
                let this = self.clone();
                let (pid, started) = (p.pid, p.start);
                let log_path = log_path.to_path_buf();
                let generation = self.book.generation();
                tokio::spawn(async move {
                    let follower = this.start_follower(&id, &progress, start, generation);
                    while process_start_time(pid) == Some(started)
                        && this.book.is_current(generation)
                    {
                        tokio::time::sleep(ADOPTED_POLL).await;
                    }
                    this.finish(&id, &log_path, follower, None, generation)
                        .await;
                });
            }
            Some(p) => {
                tracing::warn!(worker = %id, pid = p.pid, "killing a worker left by an earlier server");
                let _ = killpg(Pid::from_raw(p.pid as i32), Signal::SIGKILL);
                if let Some(cg) = p.cgroup.clone().map(WorkerCgroup::at) {
                    cg.kill_all();
                }
                let _ = std::fs::remove_file(pid_path(log_path));
                let _ = std::fs::remove_file(&exit_path);
                // Killed, not ended: it may be launched again.
                let _ = std::fs::remove_file(log_path.with_extension("claim"));
            }
            None => {
                // Ended while no server watched: report what the supervisor
                // recorded, or that the record is missing.
                let _ = std::fs::remove_file(pid_path(log_path));
                if pid_file.is_none() && !exit_path.exists() {
                    return;
                }
                let record = read_exit(&exit_path).unwrap_or(ExitRecord {
                    exit_code: None,
                    reason: "ended while no server watched it (no exit record)".into(),
                });
                tracing::info!(worker = %id, reason = %record.reason, "a worker ended while no server watched it");
                // Its supervisor is gone, but what the worker started may
                // not be (its supervisor killed with it, before draining):
                // found by its cgroup, stopped before the exit is reported,
                // so its GPUs are free when the next worker gets them.
                let cgroup = pid_file
                    .as_ref()
                    .and_then(|p| p.cgroup.clone())
                    .filter(|_| self.cgroups.is_some())
                    .map(WorkerCgroup::at)
                    .filter(|cg| !cg.pids().is_empty());
                let node = pid_file.map(|p| p.node).unwrap_or_default();
                let Some(cg) = cgroup else {
                    let exit = (record.exit_code, record.reason);
                    self.book.insert(
                        &id,
                        Worker::ended(
                            &node,
                            exit,
                            LocalWorker {
                                pid: None,
                                cgroup: None,
                            },
                        ),
                    );
                    return;
                };
                let left = cg.pids().len();
                tracing::warn!(worker = %id, left, cgroup = %cg.dir.display(), "its supervisor is gone but processes it started run on: stopping them before its exit is reported");
                self.book.insert(
                    &id,
                    Worker::running(
                        &node,
                        Vec::new(),
                        LocalWorker {
                            pid: None,
                            cgroup: Some(cg.clone()),
                        },
                    ),
                );
                let this = self.clone();
                let generation = self.book.generation();
                let log_path = log_path.to_path_buf();
                tokio::spawn(async move {
                    let left = tokio::task::spawn_blocking(move || cg.drain(LEFTOVER_GRACE))
                        .await
                        .unwrap_or(0);
                    append_line(
                        &log_path,
                        &format!("keel: stopped {left} process(es) the worker left running"),
                    )
                    .await;
                    if this.book.is_current(generation) {
                        this.book.record_exit(&id, record.exit_code, record.reason);
                    }
                });
            }
        }
    }

    /// Follows rank 0's progress stream; `None` for other ranks.
    fn start_follower(
        &self,
        id: &WorkerId,
        stream: &Path,
        start: u64,
        generation: u64,
    ) -> Option<(
        tokio::sync::oneshot::Sender<()>,
        tokio::task::JoinHandle<()>,
    )> {
        (id.rank == 0).then(|| {
            let (done_tx, done_rx) = tokio::sync::oneshot::channel::<()>();
            let this = self.clone();
            let id = id.clone();
            let path = stream.to_path_buf();
            let task = tokio::spawn(async move {
                this.follow_progress(id, path, start, done_rx, generation)
                    .await
            });
            (done_tx, task)
        })
    }

    /// After a worker ended: last progress read, then its exit, from the
    /// supervisor's record when there is one, else from `status`.
    async fn finish(
        &self,
        id: &WorkerId,
        log_path: &Path,
        follower: Option<(
            tokio::sync::oneshot::Sender<()>,
            tokio::task::JoinHandle<()>,
        )>,
        status: Option<std::io::Result<std::process::ExitStatus>>,
        generation: u64,
    ) {
        if let Some((done_tx, task)) = follower {
            // One last read after the exit, so the final lines count.
            let _ = done_tx.send(());
            let _ = task.await;
        }
        if !self.book.is_current(generation) {
            // Released: the leader that took over watches this worker.
            return;
        }
        let _ = std::fs::remove_file(pid_path(log_path));
        let record = read_exit(&log_path.with_extension("exit")).unwrap_or_else(|| match status {
            Some(Ok(s)) => crate::supervisor::describe(s),
            Some(Err(e)) => ExitRecord {
                exit_code: None,
                reason: format!("could not wait for the worker: {e}"),
            },
            None => ExitRecord {
                exit_code: None,
                reason: "killed (its supervisor left no exit record)".into(),
            },
        });
        self.book.record_exit(id, record.exit_code, record.reason);
    }

    /// One rendezvous port per (job, epoch), free on this machine when chosen.
    fn port_for(&self, job_id: JobId, epoch: u64) -> u16 {
        if let Some(p) = self.book.lock().shared.by_epoch.get(&(job_id, epoch)) {
            return *p;
        }
        let port = std::net::TcpListener::bind("0.0.0.0:0")
            .and_then(|l| l.local_addr())
            .map_or(29500, |a| a.port());
        *self
            .book
            .lock()
            .shared
            .by_epoch
            .entry((job_id, epoch))
            .or_insert(port)
    }

    async fn spawn_worker(&self, launch: WorkerLaunch) -> Result<(), ExecutorError> {
        let id = launch.id.clone();
        let io = |source| ExecutorError::Io {
            id: id.clone(),
            source,
        };
        let job_dir = self.job_dir(id.job_id);
        tokio::fs::create_dir_all(&job_dir).await.map_err(io)?;
        let log_path = job_dir.join(format!("{}.log", log_name(&id)));
        if let Some(busy) = self.busy_gpus(&launch).await {
            let reason = format!("could not start: {busy}");
            append_line(&log_path, &format!("keel: {reason}")).await;
            self.book.insert_not_admitted(
                &id,
                &launch.node,
                reason,
                LocalWorker {
                    pid: None,
                    cgroup: None,
                },
            );
            return Ok(());
        }
        if self.claim(&id, &log_path).map_err(io)? == Claimed::Elsewhere {
            return Ok(());
        }
        let checkpoint = self
            .config
            .checkpoints_dir
            .join(checkpoint_dir_name(id.job_id));
        tokio::fs::create_dir_all(&checkpoint).await.map_err(io)?;
        let port = self.port_for(id.job_id, id.epoch);
        let env = environment(&launch, port, &checkpoint.to_string_lossy());
        let Some(program) = launch.command.first() else {
            self.fail_to_start(
                &id,
                &launch.node,
                &log_path,
                "the local executor runs commands, not images",
            )
            .await;
            return Ok(());
        };
        // Progress is read from the supervisor's progress stream (or, for
        // an unsupervised worker, from its log), from where this run
        // begins (a relaunch with the same identity appends to the same
        // stream); taken before the spawn, so a fast worker's first lines
        // are not skipped.
        let progress = match self.config.supervisor {
            Some(_) => crate::worker_log::progress_path(&log_path),
            None => log_path.clone(),
        };
        let start = stream_len(&progress).await;
        let exit_path = log_path.with_extension("exit");
        let _ = std::fs::remove_file(&exit_path);
        let name = format!("j{}-e{}-r{}", id.job_id, id.epoch, id.rank);
        let cgroup = self.cgroups.as_ref().map(|c| c.worker(&name));
        let mut cmd = match &self.config.supervisor {
            Some(keel) => {
                let mut c = tokio::process::Command::new(keel);
                c.arg("supervise").arg("--exit-file").arg(&exit_path);
                if let Some(mask) = self.config.worker_umask {
                    c.arg("--worker-umask").arg(format!("{mask:04o}"));
                }
                if let (Some(cg), Some(cgroups)) = (&cgroup, &self.cgroups) {
                    c.arg("--cgroup")
                        .arg(&cg.dir)
                        .arg("--leftover-grace-ms")
                        .arg(LEFTOVER_GRACE.as_millis().to_string());
                    // The cgroups of the limits asked for (on v1, more
                    // for the worker to enter).
                    let limits = cgroups.limits(&name);
                    let asked = launch.resources;
                    if let Some(dir) = limits.memory_dir.filter(|_| asked.memory_bytes.is_some()) {
                        c.arg("--memory-cgroup").arg(dir);
                    }
                    if let Some(dir) = limits.cpu_dir.filter(|_| asked.cpu_millis.is_some()) {
                        c.arg("--cpu-cgroup").arg(dir);
                    }
                }
                if let Some(bytes) = launch.resources.memory_bytes {
                    c.arg("--memory-max-bytes").arg(bytes.to_string());
                }
                if let Some(millis) = launch.resources.cpu_millis {
                    c.arg("--cpu-max-millis").arg(millis.to_string());
                }
                // The supervisor writes the log, rotated as the job asks
                // within this server's maximum (the log says where not).
                let (rotation, notes) = self.config.logs.for_job(&launch.logs);
                for note in notes {
                    append_line(&log_path, &format!("keel: {note}")).await;
                }
                c.arg("--log")
                    .arg(&log_path)
                    .arg("--log-max-file-bytes")
                    .arg(rotation.max_file_bytes.to_string())
                    .arg("--log-max-files")
                    .arg(rotation.max_files.to_string())
                    .arg("--log-min-free-bytes")
                    .arg(self.config.logs.min_free_bytes.to_string());
                c.arg("--").args(&launch.command);
                c.stdout(std::process::Stdio::null())
                    .stderr(std::process::Stdio::null());
                c
            }
            None => {
                // Unsupervised (tests): the worker writes its log itself,
                // unrotated.
                let log = std::fs::OpenOptions::new()
                    .create(true)
                    .append(true)
                    .open(&log_path)
                    .map_err(io)?;
                let mut c = tokio::process::Command::new(program);
                c.args(&launch.command[1..])
                    .stdout(log.try_clone().map_err(io)?)
                    .stderr(log);
                c
            }
        };
        // The server's own key never reaches a worker (unless the job's
        // spec sets the variable itself).
        for name in crate::contract::SERVER_ONLY_ENV {
            cmd.env_remove(name);
        }
        cmd.envs(&env)
            .stdin(std::process::Stdio::null())
            .process_group(0)
            .kill_on_drop(false);
        if let Some(dir) = &self.config.path_prepend {
            let path = std::env::var_os("PATH").unwrap_or_default();
            let mut paths = vec![dir.clone()];
            paths.extend(std::env::split_paths(&path));
            if let Ok(joined) = std::env::join_paths(paths) {
                if !env.contains_key("PATH") {
                    cmd.env("PATH", joined);
                }
            }
        }
        let mut child = match cmd.spawn() {
            Ok(c) => c,
            Err(e) => {
                let reason = format!("could not start {program:?}: {e}");
                self.fail_to_start(&id, &launch.node, &log_path, &reason)
                    .await;
                return Ok(());
            }
        };
        let pid = child.id();
        // The pid file is how a later server (after this one dies) finds
        // the worker and adopts it instead of launching it again: a worker
        // whose pid file cannot be written (a full disk) is stopped and
        // reported as not started, never left running unseen.
        let recorded = match pid {
            Some(pid) => write_pid_file(
                &pid_path(&log_path),
                pid,
                &launch.node,
                &launch.gpus,
                cgroup.as_ref().map(|c| c.dir.clone()),
            ),
            None => Err(std::io::Error::other("it exited before its pid was read")),
        };
        if let Err(e) = recorded {
            if let Some(pid) = pid {
                let _ = nix::sys::signal::killpg(
                    Pid::from_raw(i32::try_from(pid).unwrap_or(i32::MAX)),
                    Signal::SIGKILL,
                );
            }
            if let Some(cg) = &cgroup {
                cg.kill_all();
            }
            let _ = child.wait().await;
            let _ = std::fs::remove_file(pid_path(&log_path));
            let _ = std::fs::remove_file(&exit_path);
            let _ = std::fs::remove_file(log_path.with_extension("claim"));
            let reason = format!(
                "could not record the worker's pid file ({e}): it was stopped, so that no later \
                 server starts it a second time"
            );
            tracing::error!(worker = %id, "{reason}");
            self.fail_to_start(&id, &launch.node, &log_path, &reason)
                .await;
            return Ok(());
        }
        tracing::info!(worker = %id, ?pid, node = %launch.node, gpus = ?launch.gpus, "worker started");
        let gpus = gpu_refs(&launch.node, launch.gpus.iter().copied());
        self.book.insert(
            &id,
            Worker::running(&launch.node, gpus, LocalWorker { pid, cgroup }),
        );
        let this = self.clone();
        let generation = self.book.generation();
        tokio::spawn(async move {
            let follower = this.start_follower(&id, &progress, start, generation);
            let status = child.wait().await;
            this.finish(&id, &log_path, follower, Some(status), generation)
                .await;
        });
        Ok(())
    }

    /// Reads the worker's log as it grows and buffers its progress lines,
    /// until `done` fires (then reads what is left once more).
    async fn follow_progress(
        &self,
        id: WorkerId,
        path: PathBuf,
        mut offset: u64,
        mut done: tokio::sync::oneshot::Receiver<()>,
        generation: u64,
    ) {
        let mut lines = crate::contract::ProgressLines::default();
        let mut finished = false;
        loop {
            if !finished {
                finished = tokio::select! {
                    _ = &mut done => true,
                    _ = tokio::time::sleep(PROGRESS_POLL) => false,
                };
            }
            let (at, chunk) = read_from(&path, offset).await;
            if at > offset {
                // Rotated away unread (more than the progress stream holds
                // came since the last read): newer samples follow.
                tracing::debug!(worker = %id, lost_bytes = at - offset, "progress lines rotated away unread");
                lines = crate::contract::ProgressLines::default();
            }
            offset = at + chunk.len() as u64;
            let samples = lines.push(&chunk, self.book.unix_ms());
            if !self.book.add_progress(generation, id.job_id, samples) {
                return;
            }
            // After the end, read on until everything was read.
            if finished && chunk.is_empty() {
                return;
            }
        }
    }

    /// With real GPUs: what uses the launch's GPUs that is not Keel's
    /// (its job's space-sharing partner may), as "GPU 0 busy: pid P (name)";
    /// `None` when they are free, or when the driver cannot say (a worker
    /// then starts as it did before the check existed, and the server says
    /// why).
    async fn busy_gpus(&self, launch: &WorkerLaunch) -> Option<String> {
        if !self.config.check_gpu_processes || launch.gpus.is_empty() {
            return None;
        }
        let gpus = launch.gpus.clone();
        let allowed: Vec<JobId> = launch.shared_with.iter().map(|s| s.job_id).collect();
        let found = tokio::task::spawn_blocking(crate::discovery::gpu_processes).await;
        match found {
            Ok(Ok(processes)) => {
                let busy = crate::discovery::busy(
                    &processes,
                    &gpus,
                    &allowed,
                    crate::discovery::keel_job_of,
                );
                (!busy.is_empty()).then(|| {
                    busy.iter()
                        .map(ToString::to_string)
                        .collect::<Vec<_>>()
                        .join("; ")
                })
            }
            Ok(Err(e)) => {
                tracing::warn!(worker = %launch.id, error = %e, "cannot ask nvidia-smi which processes use the worker's GPUs: starting it unchecked");
                None
            }
            Err(_) => None,
        }
    }

    async fn fail_to_start(&self, id: &WorkerId, node: &str, log_path: &Path, reason: &str) {
        append_line(log_path, &format!("keel: {reason}")).await;
        let exit = (Some(127), reason.to_string());
        self.book.insert_not_started(
            id,
            node,
            exit,
            LocalWorker {
                pid: None,
                cgroup: None,
            },
        );
    }

    fn signal(&self, id: &WorkerId, signal: Signal) {
        let (pid, cgroup) = {
            let book = self.book.lock();
            match book.workers.get(id) {
                Some(w) if w.is_running() => match w.extra.pid {
                    Some(pid) => (pid, w.extra.cgroup.clone()),
                    None => return,
                },
                _ => return,
            }
        };
        // Every process of the worker, the ones that left its process group
        // too (the supervisor is not in the cgroup: it records the end).
        if let Some(cg) = &cgroup {
            if signal == Signal::SIGKILL {
                cg.kill_all();
            } else {
                cg.signal(signal);
            }
        }
        if signal == Signal::SIGKILL && self.config.supervisor.is_some() {
            // Spare the supervisor (the group's leader), so that it records
            // the worker's end; it exits right after.
            for member in group_members(pid).into_iter().filter(|m| *m != pid) {
                let _ = nix::sys::signal::kill(Pid::from_raw(member as i32), Signal::SIGKILL);
            }
            return;
        }
        if let Err(e) = killpg(Pid::from_raw(pid as i32), signal) {
            tracing::debug!(worker = %id, %signal, error = %e, "signal not delivered");
        }
    }
}

/// Appends `line` to the worker's log at `path` (made if missing).
async fn append_line(path: &Path, line: &str) {
    if let Ok(mut f) = tokio::fs::OpenOptions::new()
        .create(true)
        .append(true)
        .open(path)
        .await
    {
        let _ = f.write_all(format!("{line}\n").as_bytes()).await;
    }
}

/// The processes in process group `pgid` (from `/proc`).
fn group_members(pgid: u32) -> Vec<u32> {
    let Ok(entries) = std::fs::read_dir("/proc") else {
        return Vec::new();
    };
    entries
        .flatten()
        .filter_map(|e| e.file_name().to_str()?.parse::<u32>().ok())
        .filter(|pid| {
            std::fs::read_to_string(format!("/proc/{pid}/stat"))
                .ok()
                .and_then(|stat| {
                    // After "pid (comm) ": state, ppid, pgrp.
                    let rest = &stat[stat.rfind(')')? + 1..];
                    rest.split_whitespace().nth(2)?.parse::<u32>().ok()
                })
                == Some(pgid)
        })
        .collect()
}

/// Removes directory `dir` and what it holds (no directories below);
/// what it removed. A missing one removes nothing.
fn remove_dir_counting(dir: &Path) -> std::io::Result<RemovedLogs> {
    let mut removed = RemovedLogs::default();
    let entries = match std::fs::read_dir(dir) {
        Ok(e) => e,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(removed),
        Err(e) => return Err(e),
    };
    for entry in entries {
        let entry = entry?;
        let len = entry.metadata().map_or(0, |m| m.len());
        std::fs::remove_file(entry.path())?;
        removed.files += 1;
        removed.bytes += len;
    }
    std::fs::remove_dir(dir)?;
    Ok(removed)
}

fn pid_path(log_path: &Path) -> PathBuf {
    log_path.with_extension("pid")
}

/// Writes a worker's pid file whole or not at all (a temporary file
/// renamed over `path`).
fn write_pid_file(
    path: &Path,
    pid: u32,
    node: &str,
    gpus: &[u32],
    cgroup: Option<PathBuf>,
) -> std::io::Result<()> {
    // The child is not waited for yet, so even one that already ended
    // is a zombie whose start time reads.
    let start = stat_start_time(pid, true)
        .ok_or_else(|| std::io::Error::other("its start time could not be read"))?;
    let record = PidFile {
        pid,
        start,
        node: node.to_string(),
        gpus: gpus.to_vec(),
        cgroup,
    };
    let body = serde_json::to_vec(&record).map_err(std::io::Error::other)?;
    let tmp = path.with_extension("pid.tmp");
    if let Err(e) = std::fs::write(&tmp, &body) {
        let _ = std::fs::remove_file(&tmp);
        return Err(e);
    }
    std::fs::rename(&tmp, path)
}

/// Parses `eE-rR.log` into (epoch, rank).
fn parse_log_name(name: &str) -> Option<(u64, u32)> {
    let stem = name.strip_suffix(".log")?;
    let (e, r) = stem.split_once('-')?;
    Some((
        e.strip_prefix('e')?.parse().ok()?,
        r.strip_prefix('r')?.parse().ok()?,
    ))
}

impl Executor for LocalExecutor {
    fn kind(&self) -> &'static str {
        "local"
    }

    fn owns(&self, node: &str) -> bool {
        self.nodes.contains(node)
    }

    async fn launch(&self, launch: WorkerLaunch) -> Result<(), ExecutorError> {
        if self.book.contains(&launch.id) {
            return Ok(());
        }
        self.spawn_worker(launch).await
    }

    async fn stop(&self, id: &WorkerId, grace: Duration) -> Result<(), ExecutorError> {
        if self.book.begin_stop(id).is_none() {
            return Ok(());
        }
        tracing::info!(worker = %id, grace_s = grace.as_secs_f64(), "stopping worker");
        self.signal(id, Signal::SIGTERM);
        let this = self.clone();
        let id = id.clone();
        tokio::spawn(async move {
            tokio::time::sleep(grace).await;
            this.signal(&id, Signal::SIGKILL);
        });
        Ok(())
    }

    async fn observe(&self) -> Result<BTreeMap<WorkerId, Observed>, ExecutorError> {
        Ok(self.book.observe())
    }

    async fn forget(&self, id: &WorkerId) {
        // The exit is in the log now; its record is no longer needed.
        let _ = std::fs::remove_file(
            self.job_dir(id.job_id)
                .join(format!("{}.exit", log_name(id))),
        );
        let mut book = self.book.lock();
        book.forget(id);
        let epoch_live = book
            .workers
            .keys()
            .any(|w| w.job_id == id.job_id && w.epoch == id.epoch);
        if !epoch_live {
            book.shared.by_epoch.remove(&(id.job_id, id.epoch));
        }
    }

    async fn take_progress(&self) -> BTreeMap<JobId, Vec<ProgressSample>> {
        self.book.take_progress()
    }

    async fn logs(&self, job_id: JobId, tail_bytes: u64) -> Result<Vec<WorkerLog>, ExecutorError> {
        let dir = self.job_dir(job_id);
        let mut out = Vec::new();
        let Ok(entries) = std::fs::read_dir(&dir) else {
            return Ok(out);
        };
        for entry in entries.flatten() {
            let name = entry.file_name().to_string_lossy().to_string();
            let Some((epoch, rank)) = parse_log_name(&name) else {
                continue;
            };
            // Across its rotated files; its length counts every byte.
            let read = || crate::worker_log::read_tail(&entry.path(), tail_bytes);
            let id = WorkerId {
                job_id,
                epoch,
                rank,
            };
            match read() {
                Ok((content, total_bytes)) => out.push(WorkerLog {
                    id,
                    content,
                    total_bytes,
                    paused: std::fs::read_to_string(crate::worker_log::paused_path(&entry.path()))
                        .ok(),
                }),
                Err(source) => return Err(ExecutorError::Io { id, source }),
            }
        }
        out.sort_by(|a, b| a.id.cmp(&b.id));
        Ok(out)
    }

    async fn remove_logs(&self, job_id: JobId) -> Result<Option<RemovedLogs>, ExecutorError> {
        if self.book.running().iter().any(|id| id.job_id == job_id) {
            return Ok(None);
        }
        let dir = self.job_dir(job_id);
        let removed = tokio::task::spawn_blocking(move || remove_dir_counting(&dir))
            .await
            .map_err(|e| ExecutorError::Other(e.to_string()))?
            .map_err(|e| ExecutorError::Other(format!("removing the logs of job {job_id}: {e}")))?;
        Ok(Some(removed))
    }

    async fn take_over(&self) {
        self.take_over_leftovers();
    }

    async fn release(&self) {
        self.book.release();
    }

    async fn shutdown(&self, grace: Duration) {
        let running = self.book.running();
        for id in &running {
            let _ = self.stop(id, grace).await;
        }
        let deadline = tokio::time::Instant::now() + grace + Duration::from_secs(2);
        while !self.book.running().is_empty() && tokio::time::Instant::now() < deadline {
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        // These exits were the shutdown's doing, not the workers' failures:
        // drop their records and claims so the next server does not report
        // them and may launch them again (the state still wants the
        // workers, and they are relaunched from their checkpoints).
        for id in &running {
            let base = self.job_dir(id.job_id).join(log_name(id));
            let _ = std::fs::remove_file(base.with_extension("exit"));
            let _ = std::fs::remove_file(base.with_extension("claim"));
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn launch(job_id: JobId, command: &[&str]) -> WorkerLaunch {
        let id = WorkerId {
            job_id,
            epoch: 1,
            rank: 0,
        };
        WorkerLaunch::for_test(id, "local", vec![1, 3], command)
    }

    fn executor(dir: &Path) -> LocalExecutor {
        LocalExecutor::new(LocalConfig {
            workers_dir: dir.join("workers"),
            checkpoints_dir: dir.join("checkpoints"),
            nodes_dir: dir.join("nodes"),
            path_prepend: None,
            supervisor: None,
            logs: Default::default(),
            check_gpu_processes: false,
            worker_umask: None,
        })
        .expect("executor")
    }

    async fn wait_exit(exec: &LocalExecutor, id: &WorkerId) -> Observed {
        for _ in 0..1000 {
            let obs = exec.observe().await.expect("observe");
            if let Some(o @ Observed::Exited { .. }) = obs.get(id) {
                return o.clone();
            }
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
        panic!("worker {id} did not exit within 10 s");
    }

    /// The worker ends as one that never started (exit 127), for a
    /// reason that says `why`.
    async fn assert_not_started(exec: &LocalExecutor, id: &WorkerId, why: &str) {
        match wait_exit(exec, id).await {
            Observed::Exited { exit_code, reason } => {
                assert_eq!(exit_code, Some(127));
                assert!(reason.contains(why), "{reason}");
            }
            o => panic!("{o:?}"),
        }
    }

    async fn wait_log(exec: &LocalExecutor, job_id: JobId, needle: &str) {
        for _ in 0..1000 {
            let logs = exec.logs(job_id, 1 << 16).await.expect("logs");
            if logs
                .iter()
                .any(|l| String::from_utf8_lossy(&l.content).contains(needle))
            {
                return;
            }
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
        panic!("job {job_id}'s log never said {needle:?}");
    }

    #[tokio::test]
    async fn runs_with_the_contract_logs_output_and_reports_progress() {
        let dir = tempfile::tempdir().expect("tempdir");
        let exec = executor(dir.path());
        let l = launch(
            1,
            &[
                "sh",
                "-c",
                "echo gpus=$CUDA_VISIBLE_DEVICES rank=$RANK; echo oops >&2; \
                 echo 'KEEL_PROGRESS {\"step\":3,\"total_steps\":9,\"samples_per_s\":2}'; exit 4",
            ],
        );
        let id = l.id.clone();
        exec.launch(l.clone()).await.expect("launch");
        exec.launch(l).await.expect("second launch is a no-op");
        let o = wait_exit(&exec, &id).await;
        assert_eq!(
            o,
            Observed::Exited {
                exit_code: Some(4),
                reason: "exited with code 4".into()
            }
        );
        let logs = exec.logs(1, 1 << 20).await.expect("logs");
        assert_eq!(logs.len(), 1);
        let text = String::from_utf8_lossy(&logs[0].content);
        assert!(text.contains("gpus=1,3 rank=0"), "{text}");
        assert!(text.contains("oops"), "{text}");
        let progress = exec.take_progress().await;
        assert_eq!(progress[&1][0].step, 3);
        assert!(exec.take_progress().await.is_empty(), "taken once");
        exec.forget(&id).await;
        assert!(exec.observe().await.expect("observe").is_empty());
    }

    #[tokio::test]
    async fn stop_sends_sigterm_then_sigkill_after_the_grace_period() {
        let dir = tempfile::tempdir().expect("tempdir");
        let exec = executor(dir.path());
        // Exits 143 on SIGTERM.
        let polite = launch(
            1,
            &[
                "sh",
                "-c",
                "trap 'exit 143' TERM; echo ready; while true; do sleep 0.05; done",
            ],
        );
        // Ignores SIGTERM.
        let stubborn = launch(
            2,
            &[
                "sh",
                "-c",
                "trap '' TERM; echo ready; while true; do sleep 0.05; done",
            ],
        );
        exec.launch(polite.clone()).await.expect("launch");
        exec.launch(stubborn.clone()).await.expect("launch");
        // The traps are set once each shell has said so.
        wait_log(&exec, 1, "ready").await;
        wait_log(&exec, 2, "ready").await;
        exec.stop(&polite.id, Duration::from_secs(30))
            .await
            .expect("stop");
        exec.stop(&stubborn.id, Duration::from_millis(300))
            .await
            .expect("stop");
        match wait_exit(&exec, &polite.id).await {
            Observed::Exited { exit_code, reason } => {
                assert_eq!(exit_code, Some(143));
                assert!(reason.contains("stopped by keel"), "{reason}");
            }
            o => panic!("{o:?}"),
        }
        match wait_exit(&exec, &stubborn.id).await {
            Observed::Exited { exit_code, reason } => {
                assert_eq!(exit_code, None);
                assert!(reason.contains("SIGKILL"), "{reason}");
            }
            o => panic!("{o:?}"),
        }
    }

    #[tokio::test]
    async fn a_command_that_cannot_start_is_an_exit_with_the_reason() {
        let dir = tempfile::tempdir().expect("tempdir");
        let exec = executor(dir.path());
        let l = launch(1, &["/no/such/program"]);
        exec.launch(l.clone())
            .await
            .expect("launch reports through observe");
        assert_not_started(&exec, &l.id, "could not start").await;
    }

    /// A worker that ended before its launch wrote its pid file (a zombie
    /// until waited for) still gets one, with its start time: its launch
    /// is not taken for a failure (found when `true`-like workers raced
    /// the pid file under load).
    #[test]
    fn a_worker_that_already_ended_still_gets_its_pid_file() {
        let dir = tempfile::tempdir().expect("tempdir");
        let mut child = std::process::Command::new("true").spawn().expect("spawns");
        let pid = child.id();
        // Ended, not waited for: a zombie.
        let deadline = std::time::Instant::now() + std::time::Duration::from_secs(30);
        let zombie = std::iter::from_fn(|| (std::time::Instant::now() < deadline).then_some(()))
            .any(|()| {
                let state = std::fs::read_to_string(format!("/proc/{pid}/stat"))
                    .ok()
                    .and_then(|s| {
                        let after = s.get(s.rfind(')')? + 1..)?.to_string();
                        after.split_whitespace().next().map(str::to_string)
                    });
                if state.as_deref() == Some("Z") {
                    return true;
                }
                std::thread::sleep(std::time::Duration::from_millis(1));
                false
            });
        assert!(zombie, "the child did not end within 30 s");
        assert_eq!(process_start_time(pid), None, "a zombie does not run");
        let path = dir.path().join("w.pid");
        write_pid_file(&path, pid, "n0", &[0], None).expect("written");
        let record: PidFile =
            serde_json::from_slice(&std::fs::read(&path).expect("read")).expect("parses");
        assert_eq!(record.pid, pid);
        assert_eq!(Some(record.start), stat_start_time(pid, true));
        let _ = child.wait();
    }

    /// A worker whose pid file cannot be written (a full disk; here the
    /// path is taken by a directory) is stopped and reported as not
    /// started: a later server, finding no pid file, would launch it again
    /// while it still ran.
    #[tokio::test]
    async fn a_worker_whose_pid_file_cannot_be_written_is_stopped_not_left_unseen() {
        let dir = tempfile::tempdir().expect("tempdir");
        let exec = executor(dir.path());
        let l = launch(1, &["sh", "-c", "exec sleep 30.4242"]);
        let log_path = exec.job_dir(1).join(format!("{}.log", log_name(&l.id)));
        let blocker = pid_path(&log_path);
        std::fs::create_dir_all(blocker.join("in-the-way"))
            .expect("a directory where the pid file goes");
        exec.launch(l.clone())
            .await
            .expect("launch reports through observe");
        assert_not_started(&exec, &l.id, "could not record the worker's pid file").await;
        // The launch waited for the worker to die: no live process runs it.
        let running: Vec<String> = std::fs::read_dir("/proc")
            .expect("/proc")
            .flatten()
            .filter_map(|e| {
                let cmdline = std::fs::read(e.path().join("cmdline")).ok()?;
                let stat = std::fs::read_to_string(e.path().join("stat")).ok()?;
                let state = stat.rsplit(") ").next()?.chars().next()?;
                let cmdline = String::from_utf8_lossy(&cmdline).replace('\0', " ");
                (cmdline.contains("30.4242") && state != 'Z').then_some(cmdline)
            })
            .collect();
        assert!(running.is_empty(), "still running: {running:?}");
        assert!(
            !log_path.with_extension("claim").exists(),
            "the claim is given up"
        );
    }

    /// Issue 19, item 3: a worker another live server has claimed is not
    /// launched here (a stale leader woken from a pause finds the new
    /// leader's claim); once that server is gone without launching it, the
    /// stale claim is taken over and the worker starts, once.
    #[tokio::test]
    async fn a_worker_claimed_by_another_live_server_is_not_launched_here() {
        let dir = tempfile::tempdir().expect("tempdir");
        let exec = executor(dir.path());
        let marker = dir.path().join("started");
        let script = format!("echo once >> {}", marker.display());
        let l = launch(1, &["sh", "-c", &script]);
        let mut other = std::process::Command::new("sleep")
            .arg("30")
            .spawn()
            .expect("another server");
        let claim = Claim {
            pid: other.id(),
            start: process_start_time(other.id()).expect("its start time"),
        };
        let job_dir = dir.path().join("workers/job-1");
        std::fs::create_dir_all(&job_dir).expect("job dir");
        std::fs::write(
            job_dir.join("e1-r0.claim"),
            serde_json::to_vec(&claim).expect("json"),
        )
        .expect("claim");
        exec.launch(l.clone()).await.expect("launch");
        assert!(
            exec.observe().await.expect("observe").is_empty(),
            "launched a worker another server claimed"
        );
        assert!(!job_dir.join("e1-r0.pid").exists());
        let _ = other.kill();
        let _ = other.wait();
        exec.launch(l.clone()).await.expect("launch");
        match wait_exit(&exec, &l.id).await {
            Observed::Exited { exit_code, .. } => assert_eq!(exit_code, Some(0)),
            o => panic!("{o:?}"),
        }
        assert_eq!(std::fs::read_to_string(&marker).expect("ran"), "once\n");
        let now: Claim =
            serde_json::from_slice(&std::fs::read(job_dir.join("e1-r0.claim")).expect("claim"))
                .expect("json");
        assert_eq!(Some(now), Claim::ours());
    }

    #[test]
    fn log_names_round_trip() {
        assert_eq!(parse_log_name("e3-r12.log"), Some((3, 12)));
        assert_eq!(parse_log_name("e3-r12.pid"), None);
    }
}
