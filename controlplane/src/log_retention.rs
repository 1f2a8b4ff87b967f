//! Retention of finished jobs' worker logs (`--retain-logs-s`): the
//! leader removes a job's logs, through its executor, once the job has
//! been finished that long in log time, and says so in its own log.
//!
//! [`due`] is the decision, pure; [`retention_loop`] drives it.

use std::collections::BTreeSet;
use std::sync::Arc;
use std::time::Duration;

use keel_executors::Executor;
use keel_state::{ClusterState, JobId};
use tokio::sync::watch;

use crate::api::Clock;
use crate::raft_node::RaftNode;

/// The finished jobs whose logs are due for removal at `now_ms`: finished
/// at least `retain_ms` ago and not yet removed, oldest first, at most
/// `max` of them.
pub fn due(
    state: &ClusterState,
    now_ms: u64,
    retain_ms: u64,
    removed: &BTreeSet<JobId>,
    max: usize,
) -> Vec<JobId> {
    let mut due: Vec<(u64, JobId)> = state
        .jobs()
        .values()
        .filter(|j| j.state.is_terminal() && !removed.contains(&j.id))
        .filter_map(|j| {
            let finished = j.finished_at_ms?;
            (now_ms.saturating_sub(finished) >= retain_ms).then_some((finished, j.id))
        })
        .collect();
    due.sort_unstable();
    due.into_iter().take(max).map(|(_, id)| id).collect()
}

/// Removals per sweep: a backlog (a first sweep on an old cluster) is
/// worked through over several.
const PER_SWEEP: usize = 64;

/// Removes finished jobs' logs `retain` after they finished, while this
/// replica leads. Returns when `stop` turns true.
pub async fn retention_loop<E: Executor>(
    node: Arc<RaftNode>,
    executor: Arc<E>,
    clock: Clock,
    retain: Duration,
    mut stop: watch::Receiver<bool>,
) {
    let retain_ms = u64::try_from(retain.as_millis()).unwrap_or(u64::MAX);
    // Often enough that a log goes within a tenth of its retention.
    let every = (retain / 10).clamp(Duration::from_millis(200), Duration::from_secs(60));
    // Jobs whose logs this leadership removed (a new leader sweeps again;
    // removing what is gone costs a listing).
    let mut removed = BTreeSet::new();
    loop {
        tokio::select! {
            _ = tokio::time::sleep(every) => {}
            _ = stop.changed() => return,
        }
        if *stop.borrow() {
            return;
        }
        if !crate::leader::is_leader(&node) {
            removed.clear();
            continue;
        }
        let jobs = {
            let shared = node.state_machine.shared();
            let applied = shared.read();
            due(&applied.state, clock(), retain_ms, &removed, PER_SWEEP)
        };
        for job_id in jobs {
            match executor.remove_logs(job_id).await {
                Ok(Some(r)) => {
                    if r.files > 0 {
                        tracing::info!(
                            job_id,
                            files = r.files,
                            bytes = r.bytes,
                            retain_s = retain.as_secs_f64(),
                            "removed the logs of a job finished longer ago than --retain-logs-s"
                        );
                    }
                    removed.insert(job_id);
                }
                // A worker of it still runs (being stopped): later.
                Ok(None) => {}
                Err(e) => {
                    tracing::warn!(job_id, error = %e, "could not remove a finished job's logs; trying again later")
                }
            }
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
            apply(
                at,
                Command::SubmitJob {
                    spec: job_spec(name, 1, 1),
                },
            );
        }
        // Job 1 cancelled at 10 s, job 2 at 20 s; job 3 still pending.
        for (at, job_id) in [(10_000, 1), (20_000, 2)] {
            apply(
                at,
                Command::CancelJob {
                    job_id,
                    reason: String::new(),
                },
            );
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
