//! The worker supervisor (`keel supervise`): a small parent between the
//! executor and the worker, so that a worker outlives the server that
//! started it and its exit is never lost.
//!
//! The local executor starts `keel supervise --exit-file F -- CMD...` as the
//! leader of a new process group. The supervisor starts the worker in that
//! group, survives the group's SIGTERM (the worker gets it and checkpoints),
//! waits for the worker and writes its exit status to `F` before exiting
//! with the same code. A server that restarts finds the supervisor still
//! running (its pid file) and re-adopts the worker, or finds `F` and
//! records the exit it missed. After the grace period the executor sends
//! SIGKILL to every process of the group but the supervisor, which then
//! records the kill; a SIGKILL that reaches the supervisor too (an operator
//! killing the group) leaves no exit file, and the executor reports that.

use std::io::Write;
use std::path::{Path, PathBuf};

use serde::{Deserialize, Serialize};

/// A worker's end, as the supervisor recorded it.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ExitRecord {
    pub exit_code: Option<i32>,
    pub reason: String,
}

/// Writes `record` to `path` whole or not at all, durably (a synced
/// temporary file renamed over it, the directory synced).
pub fn write_exit(path: &Path, record: &ExitRecord) -> std::io::Result<()> {
    let body = serde_json::to_vec(record).map_err(std::io::Error::other)?;
    let mut file = atomic_write_file::AtomicWriteFile::open(path)?;
    file.write_all(&body)?;
    file.commit()
}

/// The worker's start: a shell that sets its umask (`umask`, if not
/// empty), moves itself into each of `cgroups`, then execs `command`
/// ([`crate::containment::ENTER_AND_EXEC`]).
fn enter_and_exec(umask: &str, cgroups: &[PathBuf], command: &[String]) -> tokio::process::Command {
    let mut c = tokio::process::Command::new("/bin/sh");
    c.arg("-c")
        .arg(crate::containment::ENTER_AND_EXEC)
        .arg("keel-enter")
        .arg(umask)
        .args(cgroups)
        .arg("--")
        .args(command);
    c
}

/// The exit recorded at `path`, if there is a readable one.
pub fn read_exit(path: &Path) -> Option<ExitRecord> {
    serde_json::from_slice(&std::fs::read(path).ok()?).ok()
}

/// Describes an exit status the way the executor reports exits.
pub fn describe(status: std::process::ExitStatus) -> ExitRecord {
    use std::os::unix::process::ExitStatusExt;
    match (status.code(), status.signal()) {
        (Some(c), _) => ExitRecord {
            exit_code: Some(c),
            reason: format!("exited with code {c}"),
        },
        (None, Some(sig)) => {
            let name =
                nix::sys::signal::Signal::try_from(sig).map_or(sig.to_string(), |s| s.to_string());
            ExitRecord {
                exit_code: None,
                reason: format!("killed by {name}"),
            }
        }
        (None, None) => ExitRecord {
            exit_code: None,
            reason: "ended".into(),
        },
    }
}

/// How the supervisor contains its worker.
#[derive(Debug, Clone, Default)]
pub struct Containment {
    /// The worker's own cgroup (made here), if it has one.
    pub cgroup: Option<PathBuf>,
    /// Where its limits go.
    pub limits: crate::containment::Limits,
    /// The limits (from the job's spec).
    pub resources: keel_state::spec::Resources,
    /// What processes the worker left get between SIGTERM and the kill.
    pub leftover_grace: std::time::Duration,
    /// The umask the worker runs under (octal digits, e.g. `0022`), set by
    /// its shell hop; `None`: the supervisor's own.
    pub umask: Option<String>,
}

/// Where the supervisor writes its worker's output.
#[derive(Debug, Clone)]
pub struct WorkerOutput {
    /// The worker's log (a stream of rotated files, see [`crate::worker_log`]).
    pub log: PathBuf,
    pub rotation: crate::worker_log::Rotation,
    /// Below this much free space the log is paused.
    pub floor: Option<crate::worker_log::FreeSpaceFloor>,
}

/// How long the supervisor waits, once the worker and what it left are
/// gone, for the last of its output: a process that escaped a worker with
/// no cgroup may hold the pipe open for ever.
const LAST_OUTPUT_WAIT: std::time::Duration = std::time::Duration::from_secs(2);

/// Says `line` in the worker's log: through its writer when the supervisor
/// writes the log, else on stderr (the log the executor opened for it).
fn say(writer: Option<&SharedWriter>, line: &str) {
    match writer {
        Some(w) => w
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .write(format!("keel: {line}\n").as_bytes()),
        None => {
            let _ = writeln!(std::io::stderr(), "keel: {line}");
        }
    }
}

type SharedWriter = std::sync::Arc<std::sync::Mutex<crate::worker_log::StreamWriter>>;

/// Runs `command` to its end, writes its exit to `exit_file`, and returns
/// the code to exit with. With a cgroup, the worker runs in it (made here,
/// entered before `exec`, with the cgroups of its limits), and once its
/// main process exits every process left in it is stopped (SIGTERM, the
/// leftover grace, then killed) before the exit is written: the worker's
/// GPUs are free when its exit is known. A worker the kernel killed for
/// memory ends "out of memory". With `output`, the worker's stdout and
/// stderr are one pipe the supervisor copies to the rotated log (and its
/// progress lines to the progress stream); the exit is written after the
/// last of it.
pub async fn supervise(
    exit_file: PathBuf,
    command: Vec<String>,
    containment: Containment,
    output: Option<WorkerOutput>,
) -> i32 {
    let Containment {
        cgroup,
        limits,
        resources,
        leftover_grace,
        umask,
    } = containment;
    let umask = umask.unwrap_or_default();
    use tokio::signal::unix::{signal, SignalKind};
    // Our own SIGTERM handler: the group's SIGTERM is for the worker.
    let mut term = signal(SignalKind::terminate()).ok();
    let writer: Option<SharedWriter> = match &output {
        Some(o) => match crate::worker_log::StreamWriter::open(&o.log, o.rotation, o.floor) {
            Ok(w) => Some(std::sync::Arc::new(std::sync::Mutex::new(w))),
            Err(e) => {
                let record = ExitRecord {
                    exit_code: Some(127),
                    reason: format!("could not open its log {}: {e}", o.log.display()),
                };
                let _ = write_exit(&exit_file, &record);
                return 127;
            }
        },
        None => None,
    };
    let say = |line: &str| say(writer.as_ref(), line);
    let Some(program) = command.first() else {
        let record = ExitRecord {
            exit_code: Some(127),
            reason: "no command to run".into(),
        };
        let _ = write_exit(&exit_file, &record);
        return 127;
    };
    let cgroup = cgroup.map(crate::containment::WorkerCgroup::at);
    let mut cmd = match &cgroup {
        // The worker starts as a shell that enters the cgroup (writing `0`
        // moves the writer) and then execs the command: everything it
        // starts is in the cgroup from its first instruction on. A shell,
        // not `keel`: the hop then adds about 0.6 ms to a worker's start,
        // where starting the debug `keel` takes about 6 ms (measured on the
        // CI-like machine), and a worker stopped during it dies unprepared.
        Some(cg) => match cg.create() {
            Ok(()) => {
                for line in limits.apply(&resources) {
                    say(&line);
                }
                let mut dirs = vec![cg.dir.clone()];
                dirs.extend(limits.extra_dirs(&cg.dir));
                enter_and_exec(&umask, &dirs, &command)
            }
            Err(e) => {
                say(&format!(
                    "the worker runs without its cgroup {}: {e}",
                    cg.dir.display(),
                ));
                enter_and_exec(&umask, &[], &command)
            }
        },
        None => {
            // No cgroup: no limit can be enforced; the log says so.
            for line in crate::containment::Limits::default().apply(&resources) {
                say(&line);
            }
            enter_and_exec(&umask, &[], &command)
        }
    };
    cmd.kill_on_drop(false);
    // The worker's stdout and stderr: one pipe (their order kept), copied
    // to the log by a thread of the supervisor's, outside the worker's
    // cgroup, so that draining the cgroup never loses its last lines.
    let mut copier = None;
    if let Some(w) = &writer {
        match std::io::pipe().and_then(|(r, wr)| Ok((r, wr.try_clone()?, wr))) {
            Ok((reader, out, err)) => {
                cmd.stdout(out).stderr(err);
                let w = w.clone();
                copier = Some(std::thread::spawn(move || {
                    let _ = crate::worker_log::copy_to_end(reader, |bytes| {
                        w.lock().unwrap_or_else(|e| e.into_inner()).write(bytes)
                    });
                }));
            }
            Err(e) => say(&format!("the worker's output is lost: no pipe: {e}")),
        }
    }
    let spawned = cmd.spawn();
    // The pipe's write ends are the worker's alone now: its end is the
    // copier's end of input.
    drop(cmd);
    let mut child = match spawned {
        Ok(c) => c,
        Err(e) => {
            let record = ExitRecord {
                exit_code: Some(127),
                reason: format!("could not start {program:?}: {e}"),
            };
            say(&record.reason);
            let _ = write_exit(&exit_file, &record);
            return 127;
        }
    };
    let status = loop {
        tokio::select! {
            status = child.wait() => break status,
            _ = async {
                match term.as_mut() {
                    Some(t) => { t.recv().await; }
                    None => std::future::pending::<()>().await,
                }
            } => {}
        }
    };
    let mut record = match status {
        Ok(s) => describe(s),
        Err(e) => ExitRecord {
            exit_code: None,
            reason: format!("could not wait for the worker: {e}"),
        },
    };
    if record.exit_code != Some(0) && limits.oom_kills() > 0 {
        record.reason = match resources.memory_bytes {
            Some(b) => format!(
                "out of memory: over its limit of {} ({})",
                keel_state::resources::show_memory(b),
                record.reason
            ),
            None => format!("out of memory ({})", record.reason),
        };
    }
    if let Some(cg) = cgroup {
        let own = cg.dir.clone();
        let left = tokio::task::spawn_blocking(move || {
            let left = cg.drain(leftover_grace);
            limits.remove(&own);
            left
        })
        .await
        .unwrap_or(0);
        if left > 0 {
            say(&format!(
                "stopped {left} process(es) the worker left running"
            ));
        }
    }
    if let Some(copier) = copier {
        let done = tokio::task::spawn_blocking(move || copier.join());
        if tokio::time::timeout(LAST_OUTPUT_WAIT, done).await.is_err() {
            say("the worker's output pipe is still open (a process it started outside its cgroup); the log ends here");
        }
    }
    let _ = write_exit(&exit_file, &record);
    // Signals cannot be re-raised safely here; 128 + n is the shell's
    // convention for "killed by signal n".
    record.exit_code.unwrap_or(128 + 9)
}
