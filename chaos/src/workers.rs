//! The process table, watched for a worker identity launched twice.
//!
//! Every worker runs under its own `keel supervise` process, with the
//! worker contract's environment (`KEEL_JOB_ID`, `KEEL_ALLOCATION_EPOCH`,
//! `KEEL_RANK`). Two supervisors of one (job, epoch, rank) — at the same
//! moment or one after the other — mean the worker was launched twice (a
//! stale leader woken from a pause, say): a duplicate, whatever the log
//! says. (Keel launches an identity again only after a SIGTERM shutdown,
//! which the chaos runs never send.)

use std::collections::BTreeMap;
use std::path::Path;
use std::time::Duration;

/// A worker's identity: (job, allocation epoch, rank).
pub type Identity = (u64, u64, u32);

/// A process: its pid and kernel start time (a reused pid is another).
pub type Process = (u32, u64);

/// A process's parent and kernel start time, from `/proc/PID/stat`.
fn parent_and_start(pid: u32) -> Option<(u32, u64)> {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    let fields: Vec<&str> = stat.rsplit(") ").next()?.split(' ').collect();
    Some((fields.get(1)?.parse().ok()?, fields.get(19)?.parse().ok()?))
}

/// The live supervisors of workers whose checkpoints are under `dir` (one
/// run's), by identity.
pub fn live_supervisors(dir: &Path) -> BTreeMap<Identity, Vec<Process>> {
    // (pid, parent, start) per identity; a supervisor's child between its
    // fork and its exec still looks like a supervisor, and is left out.
    let mut found: BTreeMap<Identity, Vec<(u32, u32, u64)>> = BTreeMap::new();
    let Ok(procs) = std::fs::read_dir("/proc") else {
        return BTreeMap::new();
    };
    let prefix = dir.to_string_lossy().to_string();
    for p in procs.flatten() {
        let Some(pid) = p.file_name().to_str().and_then(|s| s.parse::<u32>().ok()) else {
            continue;
        };
        let Ok(cmdline) = std::fs::read(p.path().join("cmdline")) else {
            continue;
        };
        let args: Vec<&[u8]> = cmdline.split(|b| *b == 0).collect();
        if args.get(1) != Some(&&b"supervise"[..]) {
            continue;
        }
        let Ok(environ) = std::fs::read(p.path().join("environ")) else {
            continue;
        };
        let mut env: BTreeMap<&str, &str> = BTreeMap::new();
        for var in environ.split(|b| *b == 0) {
            if let Some((k, v)) = std::str::from_utf8(var)
                .ok()
                .and_then(|s| s.split_once('='))
            {
                env.insert(k, v);
            }
        }
        if !env
            .get("KEEL_CHECKPOINT_DIR")
            .is_some_and(|d| d.starts_with(&prefix))
        {
            continue;
        }
        let id = (|| {
            Some((
                env.get("KEEL_JOB_ID")?.parse().ok()?,
                env.get("KEEL_ALLOCATION_EPOCH")?.parse().ok()?,
                env.get("KEEL_RANK")?.parse().ok()?,
            ))
        })();
        if let (Some(id), Some((parent, start))) = (id, parent_and_start(pid)) {
            found.entry(id).or_default().push((pid, parent, start));
        }
    }
    found
        .into_iter()
        .map(|(id, procs)| {
            let pids: Vec<u32> = procs.iter().map(|(pid, _, _)| *pid).collect();
            let supervisors = procs
                .into_iter()
                .filter(|(_, parent, _)| !pids.contains(parent))
                .map(|(pid, _, start)| (pid, start))
                .collect();
            (id, supervisors)
        })
        .collect()
}

/// Samples the process table every `every` until `stop` turns true;
/// returns a description of each identity seen under two supervisors.
pub async fn watch_for_duplicates(
    dir: std::path::PathBuf,
    every: Duration,
    mut stop: tokio::sync::watch::Receiver<bool>,
) -> Vec<String> {
    let mut seen: BTreeMap<Identity, std::collections::BTreeSet<Process>> = BTreeMap::new();
    loop {
        for (id, procs) in live_supervisors(&dir) {
            seen.entry(id).or_default().extend(procs);
        }
        tokio::select! {
            _ = tokio::time::sleep(every) => {}
            _ = stop.changed() => break,
        }
        if *stop.borrow() {
            break;
        }
    }
    seen.into_iter()
        .filter(|(_, procs)| procs.len() > 1)
        .map(|((job, epoch, rank), procs)| {
            let pids: Vec<u32> = procs.iter().map(|(pid, _)| *pid).collect();
            format!("job {job} epoch {epoch} rank {rank} was launched {} times (supervisor pids {pids:?})", pids.len())
        })
        .collect()
}
