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
}

/// Runs `command` to its end, writes its exit to `exit_file`, and returns
/// the code to exit with. With a cgroup, the worker runs in it (made here,
/// entered before `exec`, with the cgroups of its limits), and once its
/// main process exits every process left in it is stopped (SIGTERM, the
/// leftover grace, then killed) before the exit is written: the worker's
/// GPUs are free when its exit is known. A worker the kernel killed for
/// memory ends "out of memory".
pub async fn supervise(exit_file: PathBuf, command: Vec<String>, containment: Containment) -> i32 {
    let Containment {
        cgroup,
        limits,
        resources,
        leftover_grace,
    } = containment;
    use tokio::signal::unix::{signal, SignalKind};
    // Our own SIGTERM handler: the group's SIGTERM is for the worker.
    let mut term = signal(SignalKind::terminate()).ok();
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
                    let _ = writeln!(std::io::stderr(), "keel: {line}");
                }
                let mut c = tokio::process::Command::new("/bin/sh");
                c.arg("-c")
                    .arg(crate::containment::ENTER_AND_EXEC)
                    .arg("keel-enter")
                    .arg(&cg.dir)
                    .args(limits.extra_dirs(&cg.dir))
                    .arg("--")
                    .args(&command);
                c
            }
            Err(e) => {
                let _ = writeln!(
                    std::io::stderr(),
                    "keel: the worker runs without its cgroup {}: {e}",
                    cg.dir.display(),
                );
                let mut c = tokio::process::Command::new(program);
                c.args(&command[1..]);
                c
            }
        },
        None => {
            // No cgroup: no limit can be enforced; the log says so.
            for line in crate::containment::Limits::default().apply(&resources) {
                let _ = writeln!(std::io::stderr(), "keel: {line}");
            }
            let mut c = tokio::process::Command::new(program);
            c.args(&command[1..]);
            c
        }
    };
    cmd.kill_on_drop(false);
    let mut child = match cmd.spawn() {
        Ok(c) => c,
        Err(e) => {
            let record = ExitRecord {
                exit_code: Some(127),
                reason: format!("could not start {program:?}: {e}"),
            };
            let _ = writeln!(std::io::stderr(), "keel: {}", record.reason);
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
            let _ = writeln!(
                std::io::stderr(),
                "keel: stopped {left} process(es) the worker left running"
            );
        }
    }
    let _ = write_exit(&exit_file, &record);
    // Signals cannot be re-raised safely here; 128 + n is the shell's
    // convention for "killed by signal n".
    record.exit_code.unwrap_or(128 + 9)
}
