//! Retention (issue 23): what the leader removes as time passes, in log
//! time.
//!
//! - **Worker logs** (`--retain-logs-s`): a finished job's logs are removed
//!   through its executor once it has been finished that long.
//! - **Finished jobs** (`--retain-finished-s`, `--retain-finished-max`): a
//!   finished job leaves the state through a logged `RemoveJob` once it has
//!   been finished that long, or when more finished jobs are kept than the
//!   most allowed (the oldest go first), so the state and its snapshots
//!   stop growing with history. The journal keeps what happened to it
//!   (`keel why`, `keel events`, `keel replay`). Its worker logs go
//!   before it does, unless logs are kept forever (`--retain-logs-s 0`).
//!
//! [`due`] and `ClusterState::jobs_due_for_removal` are the decisions, pure;
//! [`retention_loop`] drives them.

use std::collections::BTreeSet;
use std::sync::Arc;
use std::time::Duration;

use keel_executors::Executor;
use keel_state::{ClusterState, Command, JobId};
use tokio::sync::watch;

use crate::api::Clock;
use crate::proposer::Proposer;
use crate::raft_node::RaftNode;

/// The default of `--retain-finished-s`: a week.
pub const DEFAULT_RETAIN_FINISHED: Duration = Duration::from_secs(7 * 86_400);
/// The default of `--retain-finished-max`.
pub const DEFAULT_RETAIN_FINISHED_MAX: usize = 100_000;

/// What is removed, and when (`None`: kept).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Retention {
    /// Finished jobs' worker logs, this long after they finished.
    pub logs: Option<Duration>,
    /// Finished jobs, this long after they finished.
    pub finished: Option<Duration>,
    /// Finished jobs beyond this many (the oldest).
    pub finished_max: Option<usize>,
}

impl Default for Retention {
    /// The server's defaults: logs and jobs a week, at most 100,000
    /// finished jobs.
    fn default() -> Self {
        Retention {
            logs: Some(DEFAULT_RETAIN_FINISHED),
            finished: Some(DEFAULT_RETAIN_FINISHED),
            finished_max: Some(DEFAULT_RETAIN_FINISHED_MAX),
        }
    }
}

impl Retention {
    /// Nothing removed, ever.
    pub fn keep_all() -> Retention {
        Retention {
            logs: None,
            finished: None,
            finished_max: None,
        }
    }

    fn removes_anything(&self) -> bool {
        self.logs.is_some() || self.finished.is_some() || self.finished_max.is_some()
    }

    /// How often the loop looks: often enough that anything goes within a
    /// tenth of its retention.
    fn sweep_every(&self) -> Duration {
        [self.logs, self.finished]
            .into_iter()
            .flatten()
            .map(|d| d / 10)
            .min()
            .unwrap_or(Duration::from_secs(5))
            .clamp(Duration::from_millis(200), Duration::from_secs(5))
    }
}

/// The finished jobs whose logs are due for removal at `now_ms`: finished
/// at least `retain_ms` ago (their workers all exited) and not yet
/// removed, oldest first, at most `max` of them. Read from the state's
/// index of ended jobs: a sweep costs the jobs past the retention, not
/// every job held.
pub fn due(
    state: &ClusterState,
    now_ms: u64,
    retain_ms: u64,
    removed: &BTreeSet<JobId>,
    max: usize,
) -> Vec<JobId> {
    state
        .ended_jobs()
        .take_while(|(finished_ms, _)| now_ms.saturating_sub(*finished_ms) >= retain_ms)
        .filter(|(_, id)| !removed.contains(id))
        .take(max)
        .map(|(_, id)| id)
        .collect()
}

/// Log removals per sweep: a backlog (a first sweep on an old cluster) is
/// worked through over several.
const PER_SWEEP: usize = 64;
/// Job removals per sweep (proposed together: they share log entries).
const JOBS_PER_SWEEP: usize = 1024;

fn millis(d: Option<Duration>, none: u64) -> u64 {
    d.map_or(none, |d| u64::try_from(d.as_millis()).unwrap_or(u64::MAX))
}

/// Removes what `retention` says, while this replica leads. Returns when
/// `stop` turns true.
pub async fn retention_loop<E: Executor>(
    node: Arc<RaftNode>,
    executor: Arc<E>,
    proposer: Proposer,
    clock: Clock,
    retention: Retention,
    mut stop: watch::Receiver<bool>,
) {
    if !retention.removes_anything() {
        return;
    }
    let every = retention.sweep_every();
    // Jobs whose logs this leadership removed (a new leader sweeps again;
    // removing what is gone costs a listing).
    let mut removed = BTreeSet::new();
    // Whether the last sweep removed a full sweep's worth of jobs: then the
    // next one follows at once, so a backlog is worked through as fast as
    // the log takes the removals, not a sweep per interval.
    let mut behind = false;
    loop {
        if !behind {
            tokio::select! {
                _ = tokio::time::sleep(every) => {}
                _ = stop.changed() => return,
            }
        }
        behind = false;
        if *stop.borrow() {
            return;
        }
        if !crate::leader::is_leader(&node) {
            removed.clear();
            continue;
        }
        let now_ms = clock();
        let (logs_due, jobs_due) = {
            let shared = node.state_machine.shared();
            let applied = shared.read();
            let logs_due = match retention.logs {
                Some(_) => due(
                    &applied.state,
                    now_ms,
                    millis(retention.logs, 0),
                    &removed,
                    PER_SWEEP,
                ),
                None => Vec::new(),
            };
            let jobs_due = applied.state.jobs_due_for_removal(
                now_ms,
                millis(retention.finished, u64::MAX),
                retention.finished_max.unwrap_or(usize::MAX),
                JOBS_PER_SWEEP,
            );
            (logs_due, jobs_due)
        };
        for job_id in logs_due {
            if remove_logs(executor.as_ref(), job_id, "--retain-logs-s").await {
                removed.insert(job_id);
            }
        }
        let mut removals = Vec::new();
        for job_id in jobs_due {
            // Its logs first (unless they are kept forever): nothing would
            // name them once the job is gone.
            let logs_gone = retention.logs.is_none()
                || removed.contains(&job_id)
                || remove_logs(executor.as_ref(), job_id, "--retain-finished-s").await;
            if logs_gone {
                removed.remove(&job_id);
                removals.push(proposer.propose(Command::remove_job(job_id)));
            }
        }
        if removals.is_empty() {
            continue;
        }
        let asked = removals.len();
        let outcomes = futures::future::join_all(removals).await;
        let refused: Vec<String> = outcomes
            .iter()
            .filter_map(|o| o.as_ref().err().map(ToString::to_string))
            .collect();
        behind = asked == JOBS_PER_SWEEP && refused.is_empty();
        tracing::info!(
            removed = asked - refused.len(),
            "removed finished jobs from the state (--retain-finished-s, --retain-finished-max); the journal keeps their history"
        );
        if let Some(first) = refused.first() {
            tracing::warn!(refused = refused.len(), error = %first, "some finished jobs were not removed; trying again later");
        }
    }
}

/// Removes a finished job's logs through the executor; whether they are
/// gone (`false`: a worker of it still runs, or the executor failed).
async fn remove_logs<E: Executor>(executor: &E, job_id: JobId, flag: &str) -> bool {
    match executor.remove_logs(job_id).await {
        Ok(Some(r)) => {
            if r.files > 0 {
                tracing::info!(
                    job_id,
                    files = r.files,
                    bytes = r.bytes,
                    "removed the logs of a finished job ({flag})"
                );
            }
            true
        }
        // A worker of it still runs (being stopped): later.
        Ok(None) => false,
        Err(e) => {
            tracing::warn!(job_id, error = %e, "could not remove a finished job's logs; trying again later");
            false
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use keel_state::fixtures::job_spec;
    use keel_state::{Command, LogEntry};

    #[test]
    fn only_jobs_finished_longer_ago_than_the_retention_are_due() {
        let mut state = ClusterState::default();
        let mut index = 0;
        let mut apply = |at_ms: u64, command: Command| {
            index += 1;
            state
                .apply(index, &LogEntry::new(at_ms, command))
                .expect("applied");
        };
        for (at, name) in [(1_000, "a"), (2_000, "b"), (3_000, "c")] {
            apply(at, Command::submit_job(job_spec(name, 1, 1)));
        }
        // Job 1 cancelled at 10 s, job 2 at 20 s; job 3 still pending.
        for (at, job_id) in [(10_000, 1), (20_000, 2)] {
            apply(at, Command::cancel_job(job_id, String::new()));
        }
        let none = BTreeSet::new();
        assert_eq!(due(&state, 14_999, 5_000, &none, 10), Vec::<JobId>::new());
        assert_eq!(due(&state, 15_000, 5_000, &none, 10), vec![1]);
        assert_eq!(due(&state, 30_000, 5_000, &none, 10), vec![1, 2]);
        assert_eq!(due(&state, 30_000, 5_000, &none, 1), vec![1], "at most max");
        let done = BTreeSet::from([1]);
        assert_eq!(due(&state, 30_000, 5_000, &done, 10), vec![2]);
    }
}
