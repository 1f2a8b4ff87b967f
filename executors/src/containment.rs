//! Containing every process a worker starts: one cgroup per worker.
//!
//! A process group does not contain a worker: anything that calls
//! `setsid` (launchers, daemons, data-loader and MPI helpers) leaves it,
//! and would keep running on the worker's GPU after Keel handed the GPU
//! on. A cgroup cannot be left by an unprivileged process, so the
//! supervisor (`keel supervise --cgroup DIR`) starts the worker as a shell
//! that moves itself into the worker's own cgroup and then execs it
//! ([`ENTER_AND_EXEC`]), and when the worker's main process exits, or the
//! worker is stopped, every process left in it is stopped (SIGTERM, then
//! after the grace `cgroup.kill`, or freeze-and-SIGKILL on cgroup v1); the
//! worker's exit is written only once the cgroup is empty, so its GPUs are
//! not handed on while any process of it runs (Slurm's `proctrack/cgroup`,
//! a container's end under Kubernetes).
//!
//! [`Cgroups::detect`] finds a hierarchy Keel may write: cgroup v2 (the
//! unified hierarchy, under this process's own cgroup), else cgroup v1's
//! freezer. Where neither is writable, workers are contained by their
//! process group only, and the server says so once.
//!
//! A job's `resources` are enforced by the memory and cpu controllers:
//! v2's when they are delegated to Keel's cgroup (`memory.max`,
//! `cpu.max`), else v1's memory and cpu hierarchies
//! (`memory.limit_in_bytes`, `cpu.cfs_quota_us`), where the worker enters
//! a cgroup of the same name too. A worker the kernel killed for memory
//! ends "out of memory", not "killed by SIGKILL" ([`Limits::oom_kills`]).
//! Where no controller is writable, a limit is not enforced and the
//! worker's log says so.

use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use nix::sys::signal::{kill, Signal};
use nix::unistd::Pid;

/// Which kind of cgroup hierarchy holds the workers.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Flavour {
    /// cgroup v2: `cgroup.kill` (Linux 5.14+) or `cgroup.freeze`.
    V2,
    /// cgroup v1's freezer: `freezer.state`.
    V1Freezer,
}

/// Where Keel makes its workers' cgroups.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Cgroups {
    pub flavour: Flavour,
    /// The directory the workers' cgroups go in (`.../keel`).
    pub parent: PathBuf,
    /// What starts this executor's workers' cgroup names (so executors of
    /// different directories on one machine never meet), with nothing
    /// left behind when they are gone.
    pub tag: String,
    /// Where the workers' memory limits go (`.../keel` of a hierarchy with
    /// the memory controller: `parent` itself on v2), if anywhere.
    pub memory_parent: Option<PathBuf>,
    /// Where their CPU limits go, likewise.
    pub cpu_parent: Option<PathBuf>,
}

/// This process's cgroup in the hierarchy `matches` picks from
/// `/proc/self/cgroup` lines (`ID:CONTROLLERS:PATH`).
fn own_path(proc_cgroup: &str, matches: impl Fn(&str, &str) -> bool) -> Option<String> {
    proc_cgroup.lines().find_map(|line| {
        let mut parts = line.splitn(3, ':');
        let (id, controllers, path) = (parts.next()?, parts.next()?, parts.next()?);
        matches(id, controllers).then(|| path.to_string())
    })
}

/// The mount points of `fstype` (and, for v1, with `option` among the
/// super options) from `/proc/self/mountinfo`.
fn mount_of(mountinfo: &str, fstype: &str, option: Option<&str>) -> Option<PathBuf> {
    mountinfo.lines().find_map(|line| {
        let (left, right) = line.split_once(" - ")?;
        let mut r = right.split_whitespace();
        let (ty, _source, options) = (r.next()?, r.next()?, r.next().unwrap_or(""));
        if ty != fstype || option.is_some_and(|o| !options.split(',').any(|x| x == o)) {
            return None;
        }
        left.split_whitespace().nth(4).map(PathBuf::from)
    })
}

impl Cgroups {
    /// A writable hierarchy for the workers of the executor called `tag`
    /// (unique per executor directory), or why there is none.
    pub fn detect(tag: &str) -> Result<Cgroups, String> {
        let mountinfo = std::fs::read_to_string("/proc/self/mountinfo")
            .map_err(|e| format!("cannot read /proc/self/mountinfo: {e}"))?;
        let own = std::fs::read_to_string("/proc/self/cgroup")
            .map_err(|e| format!("cannot read /proc/self/cgroup: {e}"))?;
        let mut tried = Vec::new();
        let candidates = [
            (
                Flavour::V2,
                mount_of(&mountinfo, "cgroup2", None),
                own_path(&own, |id, c| id == "0" && c.is_empty()),
            ),
            (
                Flavour::V1Freezer,
                mount_of(&mountinfo, "cgroup", Some("freezer")),
                own_path(&own, |_, c| c.split(',').any(|x| x == "freezer")),
            ),
        ];
        for (flavour, mount, path) in candidates {
            let (Some(mount), Some(path)) = (mount, path) else {
                continue;
            };
            let parent = mount.join(path.trim_start_matches('/')).join("keel");
            match std::fs::create_dir_all(&parent) {
                Ok(()) => {
                    let limits = |controller: &str| {
                        (flavour == Flavour::V2 && delegate_v2(&parent, controller))
                            .then(|| parent.clone())
                            .or_else(|| v1_parent(&mountinfo, &own, controller))
                    };
                    return Ok(Cgroups {
                        flavour,
                        memory_parent: limits("memory"),
                        cpu_parent: limits("cpu"),
                        parent,
                        tag: tag.to_string(),
                    });
                }
                Err(e) => tried.push(format!("{}: {e}", parent.display())),
            }
        }
        Err(if tried.is_empty() {
            "no cgroup v2 or v1 freezer hierarchy is mounted".into()
        } else {
            format!("no cgroup may be made here ({})", tried.join("; "))
        })
    }

    /// The cgroup of the worker called `name` (not made yet).
    pub fn worker(&self, name: &str) -> WorkerCgroup {
        WorkerCgroup {
            flavour: self.flavour,
            dir: self.parent.join(format!("{}-{name}", self.tag)),
        }
    }

    /// Where the limits of the worker called `name` go.
    pub fn limits(&self, name: &str) -> Limits {
        let leaf = format!("{}-{name}", self.tag);
        Limits {
            memory_dir: self.memory_parent.as_ref().map(|p| p.join(&leaf)),
            cpu_dir: self.cpu_parent.as_ref().map(|p| p.join(&leaf)),
        }
    }

    /// What the node can enforce, for its note: `cgroup v2 (memory, cpu
    /// limits)`, `cgroup v1 freezer (no memory limits)`...
    pub fn describe(&self) -> String {
        let kind = match self.flavour {
            Flavour::V2 => "cgroup v2",
            Flavour::V1Freezer => "cgroup v1 freezer",
        };
        let can: Vec<&str> = [
            ("memory", self.memory_parent.is_some()),
            ("cpu", self.cpu_parent.is_some()),
        ]
        .into_iter()
        .filter_map(|(c, yes)| yes.then_some(c))
        .collect();
        if can.is_empty() {
            format!("{kind} (no memory or cpu limits)")
        } else {
            format!("{kind} ({} limits)", can.join(", "))
        }
    }
}

/// Whether `controller` is enabled for `parent`'s children on cgroup v2
/// (enabling it when it is delegated to `parent`).
fn delegate_v2(parent: &Path, controller: &str) -> bool {
    let has = |file: &str| {
        std::fs::read_to_string(parent.join(file))
            .is_ok_and(|s| s.split_whitespace().any(|c| c == controller))
    };
    if !has("cgroup.controllers") {
        return false;
    }
    let _ = std::fs::write(
        parent.join("cgroup.subtree_control"),
        format!("+{controller}"),
    );
    has("cgroup.subtree_control")
}

/// `.../keel` in the cgroup v1 hierarchy of `controller`, made, if one is
/// mounted and writable.
fn v1_parent(mountinfo: &str, own: &str, controller: &str) -> Option<PathBuf> {
    let mount = mount_of(mountinfo, "cgroup", Some(controller))?;
    let path = own_path(own, |id, c| {
        id != "0" && c.split(',').any(|x| x == controller)
    })?;
    let parent = mount.join(path.trim_start_matches('/')).join("keel");
    std::fs::create_dir_all(&parent).ok().map(|()| parent)
}

/// Where one worker's memory and CPU limits are written (a cgroup with
/// the memory, resp. cpu, controller; on v2 the worker's own cgroup).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Limits {
    pub memory_dir: Option<PathBuf>,
    pub cpu_dir: Option<PathBuf>,
}

/// The CFS period Keel writes CPU quotas against (100 ms, the kernel's
/// default).
const CPU_PERIOD_US: u64 = 100_000;

fn is_v2(dir: &Path) -> bool {
    dir.parent()
        .is_some_and(|p| p.join("cgroup.controllers").exists())
}

impl Limits {
    /// The cgroups the worker must enter besides its own (`own`): the v1
    /// ones; on v2 the limits are on its own cgroup.
    pub fn extra_dirs(&self, own: &Path) -> Vec<PathBuf> {
        let mut out: Vec<PathBuf> = Vec::new();
        for dir in [&self.memory_dir, &self.cpu_dir].into_iter().flatten() {
            if dir != own && !out.contains(dir) {
                out.push(dir.clone());
            }
        }
        out
    }

    /// Makes the cgroups and writes the limits asked for. What was asked
    /// and cannot be enforced here, as lines for the worker's log.
    pub fn apply(&self, resources: &keel_state::spec::Resources) -> Vec<String> {
        for dir in [&self.memory_dir, &self.cpu_dir].into_iter().flatten() {
            let _ = std::fs::create_dir_all(dir);
        }
        let mut unenforced = Vec::new();
        if let Some(bytes) = resources.memory_bytes {
            let written = self.memory_dir.as_ref().is_some_and(|dir| {
                if is_v2(dir) {
                    let ok = std::fs::write(dir.join("memory.max"), bytes.to_string()).is_ok();
                    // Beyond the limit the worker is killed, not swapped out.
                    let _ = std::fs::write(dir.join("memory.swap.max"), "0");
                    ok
                } else {
                    let ok = std::fs::write(dir.join("memory.limit_in_bytes"), bytes.to_string())
                        .is_ok();
                    let _ =
                        std::fs::write(dir.join("memory.memsw.limit_in_bytes"), bytes.to_string());
                    ok
                }
            });
            if !written {
                unenforced.push(format!(
                    "resources.memory ({}) is not enforced on this node: no writable memory cgroup controller",
                    keel_state::resources::show_memory(bytes)
                ));
            }
        }
        if let Some(millis) = resources.cpu_millis {
            let quota_us = u64::from(millis) * CPU_PERIOD_US / 1000;
            let written = self.cpu_dir.as_ref().is_some_and(|dir| {
                if is_v2(dir) {
                    std::fs::write(dir.join("cpu.max"), format!("{quota_us} {CPU_PERIOD_US}"))
                        .is_ok()
                } else {
                    std::fs::write(dir.join("cpu.cfs_period_us"), CPU_PERIOD_US.to_string()).is_ok()
                        && std::fs::write(dir.join("cpu.cfs_quota_us"), quota_us.to_string())
                            .is_ok()
                }
            });
            if !written {
                unenforced.push(format!(
                    "resources.cpus ({}) is not enforced on this node: no writable cpu cgroup controller",
                    keel_state::resources::show_cpus(millis)
                ));
            }
        }
        unenforced
    }

    /// How many times the kernel killed a process of the worker for
    /// memory (v2 `memory.events`, v1 `memory.oom_control`).
    pub fn oom_kills(&self) -> u64 {
        let Some(dir) = &self.memory_dir else {
            return 0;
        };
        ["memory.events", "memory.oom_control"]
            .iter()
            .filter_map(|f| std::fs::read_to_string(dir.join(f)).ok())
            .find_map(|text| {
                text.lines().find_map(|l| {
                    l.strip_prefix("oom_kill ")
                        .and_then(|n| n.trim().parse().ok())
                })
            })
            .unwrap_or(0)
    }

    /// Removes the cgroups (once the worker's processes are gone).
    pub fn remove(&self, own: &Path) {
        for dir in self.extra_dirs(own) {
            for _ in 0..50 {
                if std::fs::remove_dir(&dir).is_ok() || !dir.exists() {
                    break;
                }
                std::thread::sleep(Duration::from_millis(20));
            }
        }
    }
}

/// One worker's cgroup.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct WorkerCgroup {
    pub flavour: Flavour,
    pub dir: PathBuf,
}

impl WorkerCgroup {
    /// The cgroup at `dir` (its flavour from the files a v1 freezer has).
    pub fn at(dir: PathBuf) -> WorkerCgroup {
        let parent_is_v1 = dir
            .parent()
            .is_some_and(|p| p.join("freezer.state").exists() || p.join("tasks").exists());
        WorkerCgroup {
            flavour: if parent_is_v1 {
                Flavour::V1Freezer
            } else {
                Flavour::V2
            },
            dir,
        }
    }

    /// Makes the cgroup (it may exist from an earlier run of the worker).
    pub fn create(&self) -> std::io::Result<()> {
        std::fs::create_dir_all(&self.dir)
    }

    /// The file a process writes `0` to in order to enter the cgroup.
    pub fn procs_file(&self) -> PathBuf {
        self.dir.join("cgroup.procs")
    }

    /// The processes in it now (none when it is gone).
    pub fn pids(&self) -> Vec<u32> {
        pids_in(&self.dir)
    }

    /// Sends `signal` to every process in it.
    pub fn signal(&self, signal: Signal) {
        for pid in self.pids() {
            let _ = kill(Pid::from_raw(pid as i32), signal);
        }
    }

    /// Kills every process in it at once: `cgroup.kill` where the kernel
    /// has it, else freeze, SIGKILL each, thaw (no process can fork while
    /// frozen, so none escapes the sweep).
    pub fn kill_all(&self) {
        if self.flavour == Flavour::V2 && std::fs::write(self.dir.join("cgroup.kill"), "1").is_ok()
        {
            return;
        }
        let (file, freeze, thaw) = match self.flavour {
            Flavour::V2 => ("cgroup.freeze", "1", "0"),
            Flavour::V1Freezer => ("freezer.state", "FROZEN", "THAWED"),
        };
        let frozen = std::fs::write(self.dir.join(file), freeze).is_ok();
        self.signal(Signal::SIGKILL);
        if frozen {
            let _ = std::fs::write(self.dir.join(file), thaw);
        }
    }

    /// Stops whatever is left in it: SIGTERM, then, after `grace` (or at
    /// once when it empties), [`WorkerCgroup::kill_all`] until it is empty;
    /// then removes it. How many processes were left.
    pub fn drain(&self, grace: Duration) -> usize {
        let left = self.pids().len();
        if left > 0 {
            self.signal(Signal::SIGTERM);
            wait_empty(&self.dir, grace);
            let deadline = Instant::now() + Duration::from_secs(30);
            while !self.pids().is_empty() && Instant::now() < deadline {
                self.kill_all();
                wait_empty(&self.dir, Duration::from_millis(200));
            }
        }
        let _ = std::fs::remove_dir(&self.dir);
        left
    }
}

/// The shell script a worker starts as, with its umask (octal digits, or
/// empty to keep the supervisor's), the directories of its cgroups (its
/// own, then those holding its limits on cgroup v1; none without
/// cgroups), `--` and its command as the arguments: it sets the umask,
/// moves itself into each cgroup, then becomes the command. Exits 127,
/// saying why, when it cannot.
pub const ENTER_AND_EXEC: &str = r#"if [ -n "$1" ]; then umask "$1" || { echo "keel: cannot set the umask $1" >&2; exit 127; }; fi
shift
while [ "$1" != -- ]; do echo 0 > "$1/cgroup.procs" || { echo "keel: cannot enter the cgroup $1" >&2; exit 127; }; shift; done
shift
command -v -- "$1" > /dev/null 2>&1 || { echo "keel: could not start $1: not found" >&2; exit 127; }
exec "$@""#;

fn pids_in(dir: &Path) -> Vec<u32> {
    std::fs::read_to_string(dir.join("cgroup.procs"))
        .map(|s| s.lines().filter_map(|l| l.trim().parse().ok()).collect())
        .unwrap_or_default()
}

fn wait_empty(dir: &Path, limit: Duration) {
    let deadline = Instant::now() + limit;
    while !pids_in(dir).is_empty() && Instant::now() < deadline {
        std::thread::sleep(Duration::from_millis(20));
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn hierarchies_are_found_from_mountinfo_and_proc_cgroup() {
        let mountinfo = "\
30 25 0:26 / /sys/fs/cgroup/unified rw,relatime shared:5 - cgroup2 cgroup2 rw
35 25 0:31 / /sys/fs/cgroup/freezer rw,relatime shared:9 - cgroup cgroup rw,freezer
36 25 0:32 / /sys/fs/cgroup/pids rw,relatime shared:10 - cgroup cgroup rw,pids";
        assert_eq!(
            mount_of(mountinfo, "cgroup2", None),
            Some(PathBuf::from("/sys/fs/cgroup/unified"))
        );
        assert_eq!(
            mount_of(mountinfo, "cgroup", Some("freezer")),
            Some(PathBuf::from("/sys/fs/cgroup/freezer"))
        );
        assert_eq!(mount_of(mountinfo, "cgroup", Some("memory")), None);
        let own = "6:freezer:/a/b\n4:memory:/m\n0::/user.slice/x.scope";
        assert_eq!(
            own_path(own, |id, c| id == "0" && c.is_empty()).as_deref(),
            Some("/user.slice/x.scope")
        );
        assert_eq!(
            own_path(own, |_, c| c.split(',').any(|x| x == "freezer")).as_deref(),
            Some("/a/b")
        );
    }
}
