//! The checks over a run's history and the replicas' final states.
//!
//! - **Lost**: an acknowledged submission missing (or under another id) on
//!   any replica after healing.
//! - **Duplicated**: a job name present more than once on a replica (a
//!   client sends a submission again only under its request id, so only
//!   Keel could have doubled it), or a refused submission that took effect.
//! - **Divergent**: replicas at different applied indexes or state hashes
//!   after convergence, or a replica whose offline replay (journal, then
//!   the Raft log's committed tail) gives another hash than it serves.
//! - **Invariants**: the offline replay checks `ClusterState`'s invariants
//!   after every entry (no GPU held by two jobs outside a declared pair,
//!   the holder index agreeing with the allocations, ...).
//! - **Linearizability of the job registry**, checked against the log as
//!   the witness order (every replica holds the same log): acknowledged
//!   writes that did not overlap in real time are in the log in their real
//!   order (log indexes, and the job ids the state machine hands out in log
//!   order); a read never misses a job whose submission was acknowledged
//!   before the read began; a read after an acknowledged cancellation sees
//!   the job cancelled; a read sees `cancelled` only if a cancellation was
//!   invoked before it ended; a terminal state once read never changes.

use std::collections::BTreeMap;

use serde::Serialize;

use crate::workload::{Op, Outcome, Request};

/// What a replica holds at the end of a run.
#[derive(Debug, Clone, Serialize)]
pub struct FinalReplica {
    pub id: u64,
    pub applied_index: u64,
    pub state_hash: String,
    /// Job id → (name, state).
    #[serde(skip)]
    pub jobs: BTreeMap<u64, (String, String)>,
    pub replay: Option<ReplayCheck>,
}

/// The offline replay of a replica's data directory.
#[derive(Debug, Clone, Serialize)]
pub struct ReplayCheck {
    pub last_index: u64,
    pub state_hash: String,
    pub invariant_violation: Option<(u64, String)>,
    pub error: Option<String>,
}

/// What the checks found: each a list of descriptions (empty: passed).
#[derive(Debug, Clone, Default, Serialize)]
pub struct Findings {
    pub lost: Vec<String>,
    pub duplicated: Vec<String>,
    pub divergent: Vec<String>,
    pub invariant_violations: Vec<String>,
    pub linearizability: Vec<String>,
}

impl Findings {
    pub fn passed(&self) -> bool {
        self.lost.is_empty()
            && self.duplicated.is_empty()
            && self.divergent.is_empty()
            && self.invariant_violations.is_empty()
            && self.linearizability.is_empty()
    }
}

fn describe(op: &Op) -> String {
    serde_json::to_string(op).unwrap_or_else(|_| format!("{op:?}"))
}

/// Runs every check.
pub fn check(history: &[Op], replicas: &[FinalReplica]) -> Findings {
    let mut f = Findings::default();
    check_submissions(history, replicas, &mut f);
    check_replicas(replicas, &mut f);
    check_linearizable(history, &mut f);
    f
}

fn check_submissions(history: &[Op], replicas: &[FinalReplica], f: &mut Findings) {
    for r in replicas {
        let mut by_name: BTreeMap<&str, Vec<u64>> = BTreeMap::new();
        for (id, (name, _)) in &r.jobs {
            by_name.entry(name.as_str()).or_default().push(*id);
        }
        for (name, ids) in &by_name {
            if ids.len() > 1 {
                f.duplicated.push(format!(
                    "replica {}: job {name:?} is there {} times: ids {ids:?}",
                    r.id,
                    ids.len()
                ));
            }
        }
        for op in history {
            let Request::Submit { name } = &op.request else {
                continue;
            };
            match &op.outcome {
                Outcome::Ok {
                    job_id: Some(id), ..
                } if r.jobs.get(id).map(|(n, _)| n.as_str()) != Some(name.as_str()) => {
                    f.lost.push(format!(
                        "replica {}: acknowledged submission of {name:?} as job {id} is missing (holds {:?}): {}",
                        r.id,
                        r.jobs.get(id),
                        describe(op)
                    ));
                }
                Outcome::Failed { .. } if by_name.contains_key(name.as_str()) => {
                    f.duplicated.push(format!(
                        "replica {}: a refused submission took effect: {}",
                        r.id,
                        describe(op)
                    ));
                }
                _ => {}
            }
        }
    }
}

fn check_replicas(replicas: &[FinalReplica], f: &mut Findings) {
    if let Some(first) = replicas.first() {
        for r in &replicas[1..] {
            if (r.applied_index, &r.state_hash) != (first.applied_index, &first.state_hash) {
                f.divergent.push(format!(
                    "replica {} is at index {} hash {}; replica {} at index {} hash {}",
                    r.id,
                    r.applied_index,
                    r.state_hash,
                    first.id,
                    first.applied_index,
                    first.state_hash
                ));
            }
        }
    }
    for r in replicas {
        let Some(replay) = &r.replay else {
            continue;
        };
        if let Some(e) = &replay.error {
            f.divergent.push(format!(
                "replica {}: its data directory cannot be replayed: {e}",
                r.id
            ));
            continue;
        }
        if replay.last_index == r.applied_index && replay.state_hash != r.state_hash {
            f.divergent.push(format!(
                "replica {}: replaying its journal and log to index {} gives hash {}, it served {}",
                r.id, replay.last_index, replay.state_hash, r.state_hash
            ));
        }
        if replay.last_index < r.applied_index {
            f.divergent.push(format!(
                "replica {}: applied index {} but its disk replays only to {}",
                r.id, r.applied_index, replay.last_index
            ));
        }
        if let Some((index, broken)) = &replay.invariant_violation {
            f.invariant_violations
                .push(format!("replica {}: after entry {index}: {broken}", r.id));
        }
    }
}

/// For each op of `later`, whether an op of `earlier` that completed
/// before it was invoked has a key at or above its own: the real-time order
/// and the log order disagree.
fn order_violations(
    earlier: &[(&Op, u64)],
    later: &[(&Op, u64)],
    what: &str,
    out: &mut Vec<String>,
) {
    let mut by_completion: Vec<&(&Op, u64)> = earlier.iter().collect();
    by_completion.sort_by_key(|(op, _)| op.completed_ms);
    // Running maximum of the key over completions, with the op holding it.
    let mut max_so_far: Vec<(u64, &Op)> = Vec::with_capacity(by_completion.len());
    for (op, key) in &by_completion {
        let best = match max_so_far.last() {
            Some((k, o)) if *k >= *key => (*k, *o),
            _ => (*key, *op),
        };
        max_so_far.push(best);
    }
    for (op, key) in later {
        let before = by_completion.partition_point(|(o, _)| o.completed_ms < op.invoked_ms);
        if before == 0 {
            continue;
        }
        let (k, first) = max_so_far[before - 1];
        if k >= *key {
            out.push(format!(
                "{what}: {} completed before {} began, yet has {what} {k} ≥ {key}",
                describe(first),
                describe(op)
            ));
        }
    }
}

fn check_linearizable(history: &[Op], f: &mut Findings) {
    let writes: Vec<(&Op, u64)> = history
        .iter()
        .filter_map(|op| match (&op.request, &op.outcome) {
            (
                Request::Submit { .. } | Request::Cancel { .. } | Request::SetNode { .. },
                Outcome::Ok { index: Some(i), .. },
            ) => Some((op, *i)),
            _ => None,
        })
        .collect();
    order_violations(&writes, &writes, "log index", &mut f.linearizability);
    let submits: Vec<(&Op, u64)> = history
        .iter()
        .filter_map(|op| match (&op.request, &op.outcome) {
            (
                Request::Submit { .. },
                Outcome::Ok {
                    job_id: Some(id), ..
                },
            ) => Some((op, *id)),
            _ => None,
        })
        .collect();
    order_violations(&submits, &submits, "job id", &mut f.linearizability);

    let acked_submit: BTreeMap<u64, &Op> = submits.iter().map(|(op, id)| (*id, *op)).collect();
    let mut cancels: BTreeMap<u64, Vec<&Op>> = BTreeMap::new();
    for op in history {
        if let Request::Cancel { job_id } = &op.request {
            cancels.entry(*job_id).or_default().push(op);
        }
    }
    let reads: Vec<(&Op, u64, Option<&String>)> = history
        .iter()
        .filter_map(|op| match (&op.request, &op.outcome) {
            (Request::Get { job_id }, Outcome::Ok { state, .. }) => {
                Some((op, *job_id, state.as_ref()))
            }
            _ => None,
        })
        .collect();
    let terminal = |s: &str| matches!(s, "succeeded" | "failed" | "cancelled");
    for (op, job_id, state) in &reads {
        // A job acknowledged before the read began is there.
        if let (None, Some(submit)) = (state, acked_submit.get(job_id)) {
            if submit.completed_ms < op.invoked_ms {
                f.linearizability.push(format!(
                    "stale read: {} found no job {job_id}, acknowledged by {}",
                    describe(op),
                    describe(submit)
                ));
            }
        }
        let job_cancels = cancels.get(job_id).map(Vec::as_slice).unwrap_or_default();
        // After an acknowledged cancellation, the job reads as cancelled.
        if let Some(cancel) = job_cancels
            .iter()
            .find(|c| c.is_ok() && c.completed_ms < op.invoked_ms)
        {
            if state.map(String::as_str) != Some("cancelled") {
                f.linearizability.push(format!(
                    "{} read {state:?} after {} was acknowledged",
                    describe(op),
                    describe(cancel)
                ));
            }
        }
        // Cancelled only by a cancellation invoked before the read ended.
        if state.map(String::as_str) == Some("cancelled")
            && !job_cancels.iter().any(|c| c.invoked_ms <= op.completed_ms)
        {
            f.linearizability.push(format!(
                "{} read cancelled, but no cancellation of job {job_id} had begun",
                describe(op)
            ));
        }
    }
    // A terminal state once read never changes.
    let mut by_job: BTreeMap<u64, Vec<(&Op, &String)>> = BTreeMap::new();
    for (op, job_id, state) in &reads {
        if let Some(s) = state {
            by_job.entry(*job_id).or_default().push((op, s));
        }
    }
    for reads in by_job.values() {
        for (a, sa) in reads.iter().filter(|(_, s)| terminal(s)) {
            for (b, sb) in reads {
                if a.completed_ms < b.invoked_ms && sa != sb {
                    f.linearizability.push(format!(
                        "{} read {sa}, then {} read {sb}",
                        describe(a),
                        describe(b)
                    ));
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn op(request: Request, invoked_ms: u64, completed_ms: u64, outcome: Outcome) -> Op {
        Op {
            client: 0,
            replica: 1,
            attempts: 1,
            request,
            invoked_ms,
            completed_ms,
            outcome,
        }
    }

    fn submitted(name: &str, at: u64, index: u64, id: u64) -> Op {
        op(
            Request::Submit { name: name.into() },
            at,
            at + 5,
            Outcome::Ok {
                index: Some(index),
                job_id: Some(id),
                state: None,
            },
        )
    }

    fn read(id: u64, at: u64, state: Option<&str>) -> Op {
        op(
            Request::Get { job_id: id },
            at,
            at + 5,
            Outcome::Ok {
                index: None,
                job_id: Some(id),
                state: state.map(str::to_string),
            },
        )
    }

    fn replica(id: u64, jobs: &[(u64, &str)]) -> FinalReplica {
        FinalReplica {
            id,
            applied_index: 10,
            state_hash: "h".into(),
            jobs: jobs
                .iter()
                .map(|(i, n)| (*i, (n.to_string(), "pending".to_string())))
                .collect(),
            replay: None,
        }
    }

    #[test]
    fn a_clean_history_passes() {
        let history = vec![
            submitted("c0-1", 0, 3, 1),
            submitted("c0-2", 10, 4, 2),
            read(1, 20, Some("pending")),
        ];
        let f = check(
            &history,
            &[
                replica(1, &[(1, "c0-1"), (2, "c0-2")]),
                replica(2, &[(1, "c0-1"), (2, "c0-2")]),
            ],
        );
        assert!(f.passed(), "{f:?}");
    }

    #[test]
    fn each_check_catches_what_it_is_for() {
        // Lost on replica 2, duplicated on replica 1.
        let history = vec![submitted("c0-1", 0, 3, 1), submitted("c0-2", 10, 4, 2)];
        let f = check(
            &history,
            &[
                replica(1, &[(1, "c0-1"), (2, "c0-2"), (3, "c0-2")]),
                replica(2, &[(1, "c0-1")]),
            ],
        );
        assert_eq!(f.lost.len(), 1, "{f:?}");
        assert_eq!(f.duplicated.len(), 1, "{f:?}");
        // Divergent hashes.
        let mut other = replica(2, &[]);
        other.state_hash = "x".into();
        assert_eq!(check(&[], &[replica(1, &[]), other]).divergent.len(), 1);
        // Real-time order against the log: the later write got the lower index.
        let f = check(
            &[submitted("c0-1", 0, 9, 2), submitted("c0-2", 10, 4, 1)],
            &[],
        );
        assert_eq!(f.linearizability.len(), 2, "index and id: {f:?}");
        // A stale read, and a terminal state that changed.
        let f = check(
            &[
                submitted("c0-1", 0, 3, 1),
                read(1, 10, None),
                read(1, 20, Some("succeeded")),
                read(1, 30, Some("pending")),
            ],
            &[],
        );
        assert_eq!(f.linearizability.len(), 2, "{f:?}");
        // Cancelled without a cancellation; not cancelled after one.
        let cancel = op(
            Request::Cancel { job_id: 1 },
            40,
            45,
            Outcome::Ok {
                index: Some(6),
                job_id: Some(1),
                state: None,
            },
        );
        let f = check(
            &[
                submitted("c0-1", 0, 3, 1),
                read(1, 10, Some("cancelled")),
                cancel,
                read(1, 50, Some("pending")),
            ],
            &[],
        );
        // ... and the terminal state read first changed.
        assert_eq!(f.linearizability.len(), 3, "{f:?}");
    }
}
