//! Behaviour of `ClusterState::apply`: lifecycle transitions and refusals,
//! and property tests over random entry sequences.

use std::collections::BTreeSet;

use keel_state::codec::{decode_entry, encode_entry};
use keel_state::*;
use proptest::prelude::*;

fn spec(name: &str, gpus: u32, workers: u32) -> JobSpec {
    keel_state::fixtures::job_spec(name, gpus, workers)
}

fn gpu(node: &str, index: u32) -> GpuRef {
    GpuRef {
        node: node.into(),
        index,
    }
}

struct Harness {
    state: ClusterState,
    index: u64,
}

impl Harness {
    fn new() -> Self {
        Harness {
            state: ClusterState::new(),
            index: 0,
        }
    }
    fn apply(&mut self, command: Command) -> Result<Vec<Event>, ApplyError> {
        // Every entry survives the wire format unchanged.
        let entry = LogEntry::new(1000 * (self.index + 1), command);
        let decoded = decode_entry(&encode_entry(&entry)).expect("round trip");
        assert_eq!(decoded, entry);
        self.apply_unencoded(entry.command)
    }
    /// [`Harness::apply`] without the wire round trip (for entries over
    /// its size limit, which `apply` must refuse on its own).
    fn apply_unencoded(&mut self, command: Command) -> Result<Vec<Event>, ApplyError> {
        self.index += 1;
        let entry = LogEntry::new(1000 * self.index, command);
        let before = self.state.clone();
        let res = self.state.apply(self.index, &entry);
        if res.is_err() {
            let mut expected = before;
            // Only the index moves on a refusal.
            let _ = expected.apply(self.index, &LogEntry::new(0, Command::remove_job(u64::MAX)));
            assert_eq!(self.state, expected, "a refused entry changed the state");
        }
        self.state.check_invariants().expect("invariants");
        res
    }
    fn node(&mut self, name: &str, gpus: u32) {
        self.apply(Command::register_node(
            name,
            "127.0.0.1",
            (0..gpus)
                .map(|index| Gpu {
                    index,
                    gpu_type: "v100".into(),
                })
                .collect(),
        ))
        .expect("register");
    }
    fn submit(&mut self, s: JobSpec) -> JobId {
        match self
            .apply(Command::submit_job(s))
            .expect("submit")
            .as_slice()
        {
            [Event::JobSubmitted { job_id, .. }] => *job_id,
            other => panic!("unexpected events {other:?}"),
        }
    }
    fn place(&mut self, placements: Vec<(JobId, Vec<GpuRef>)>) -> Vec<Event> {
        self.apply(Command::decide_allocation(
            self.index,
            "fifo",
            1,
            placements
                .into_iter()
                .map(|(job_id, gpus)| JobPlacement::alone(job_id, gpus))
                .collect(),
        ))
        .expect("plans are applied per job")
    }
}

impl Harness {
    /// Places `a` and `b` together on `gpus` (space sharing).
    fn pair(&mut self, a: JobId, b: JobId, gpus: Vec<GpuRef>) -> Vec<Event> {
        self.decide(vec![
            placed(a, gpus.clone(), Some(b)),
            placed(b, gpus, Some(a)),
        ])
    }

    fn partner(&self, job: JobId) -> Option<JobId> {
        self.state
            .job(job)
            .and_then(|j| j.allocation.as_ref())
            .and_then(|a| a.shared_with)
    }
}

/// A placement of `job` on `gpus`, sharing them with `partner` if given.
fn placed(job_id: JobId, gpus: Vec<GpuRef>, share_with: Option<JobId>) -> JobPlacement {
    JobPlacement {
        job_id,
        gpus,
        share_with,
    }
}

impl Harness {
    /// One decision with these placements.
    fn decide(&mut self, placements: Vec<JobPlacement>) -> Vec<Event> {
        self.apply(Command::decide_allocation(self.index, "p", 1, placements))
            .expect("applied per job")
    }
}

fn refused(events: &[Event]) -> Vec<(JobId, String)> {
    events
        .iter()
        .filter_map(|e| match e {
            Event::PlacementRefused { job_id, reason } => Some((*job_id, reason.clone())),
            _ => None,
        })
        .collect()
}

#[test]
fn a_declared_pair_shares_its_gpus_and_the_survivor_runs_on_alone() {
    let mut h = Harness::new();
    h.node("n0", 2);
    let a = h.submit(spec("a", 1, 1));
    let b = h.submit(spec("b", 1, 1));
    let c = h.submit(spec("c", 1, 1));
    let events = h.pair(a, b, vec![gpu("n0", 0)]);
    assert!(refused(&events).is_empty(), "{events:?}");
    assert!(events.iter().any(|e| matches!(e,
        Event::JobAllocated { job_id, shared_with: Some(p), .. } if *job_id == a && *p == b)));
    assert_eq!(
        h.state.gpu_holders().get(&gpu("n0", 0)),
        Some(&GpuHolders {
            job: a,
            sharer: Some(b)
        })
    );
    assert_eq!((h.partner(a), h.partner(b)), (Some(b), Some(a)));
    // The shared GPU is not free; the other one is.
    assert_eq!(h.state.free_gpus().total(), 1);
    // A third job may not join the pair's GPU, alone or as a pair.
    let events = h.place(vec![(c, vec![gpu("n0", 0)])]);
    assert!(
        matches!(refused(&events).as_slice(), [(j, r)] if *j == c && r.contains("held by job")),
        "{events:?}"
    );
    // The pair's first member finishes; the other runs on alone, same epoch.
    let epoch_b = h
        .state
        .job(b)
        .and_then(|j| j.allocation.as_ref())
        .map(|x| x.epoch);
    h.apply(Command::finish_job(a, JobOutcome::Succeeded, String::new()))
        .expect("finish");
    assert_eq!(h.partner(b), None);
    assert_eq!(
        h.state
            .job(b)
            .and_then(|j| j.allocation.as_ref())
            .map(|x| x.epoch),
        epoch_b
    );
    assert_eq!(
        h.state.gpu_holders().get(&gpu("n0", 0)),
        Some(&GpuHolders::one(b))
    );
    // b finishes too: the GPU is free again.
    h.apply(Command::finish_job(b, JobOutcome::Succeeded, String::new()))
        .expect("finish");
    assert!(h.state.gpu_holders().is_empty());
    assert_eq!(h.state.free_gpus().total(), 2);
}

#[test]
fn a_pair_forms_on_one_members_gpus_and_moves_whole() {
    let mut h = Harness::new();
    h.node("n0", 2);
    let a = h.submit(spec("a", 1, 1));
    let b = h.submit(spec("b", 1, 1));
    h.place(vec![(a, vec![gpu("n0", 0)]), (b, vec![gpu("n0", 1)])]);
    // b joins a on GPU 0: both get a new epoch; GPU 1 is free.
    let events = h.pair(a, b, vec![gpu("n0", 0)]);
    assert!(refused(&events).is_empty(), "{events:?}");
    assert_eq!(
        h.state
            .job(a)
            .and_then(|j| j.allocation.as_ref())
            .map(|x| x.epoch),
        Some(2)
    );
    assert!(!h.state.gpu_holders().contains_key(&gpu("n0", 1)));
    // The same pair again changes nothing.
    let events = h.pair(a, b, vec![gpu("n0", 0)]);
    assert!(events.is_empty(), "{events:?}");
    // The pair moves to GPU 1 whole.
    h.pair(a, b, vec![gpu("n0", 1)]);
    assert_eq!(
        h.state.gpu_holders().get(&gpu("n0", 1)),
        Some(&GpuHolders {
            job: a,
            sharer: Some(b)
        })
    );
    assert!(!h.state.gpu_holders().contains_key(&gpu("n0", 0)));
    // a is moved away alone: b stays on GPU 1 and runs alone.
    h.place(vec![(a, vec![gpu("n0", 0)])]);
    assert_eq!((h.partner(a), h.partner(b)), (None, None));
    assert_eq!(
        h.state.gpu_holders().get(&gpu("n0", 1)),
        Some(&GpuHolders::one(b))
    );
}

#[test]
fn a_pair_is_placed_whole_or_not_at_all() {
    let mut h = Harness::new();
    h.node("n0", 2);
    let a = h.submit(spec("a", 1, 1));
    let b = h.submit(spec("b", 1, 1));
    let c = h.submit(spec("c", 1, 1));
    // Not mutual.
    let events = h.decide(vec![
        placed(a, vec![gpu("n0", 0)], Some(b)),
        JobPlacement::alone(b, vec![gpu("n0", 0)]),
    ]);
    // a is refused; b asked for the GPU alone and gets it.
    let r = refused(&events);
    assert!(
        matches!(r.as_slice(), [(j, reason)] if *j == a && reason.contains("shares GPUs with job")),
        "{r:?}"
    );
    assert_eq!(
        h.state.gpu_holders().get(&gpu("n0", 0)),
        Some(&GpuHolders::one(b))
    );
    assert_eq!(h.partner(b), None);
    // Not the same GPUs.
    let events = h.decide(vec![
        placed(a, vec![gpu("n0", 0)], Some(b)),
        placed(b, vec![gpu("n0", 1)], Some(a)),
    ]);
    assert_eq!(refused(&events).len(), 2, "{events:?}");
    // Itself, or with no GPUs.
    let events = h.decide(vec![placed(a, vec![gpu("n0", 0)], Some(a))]);
    assert!(refused(&events)[0].1.contains("itself"), "{events:?}");
    // One member's GPU is held by another job: both are refused and
    // neither takes anything.
    h.place(vec![(c, vec![gpu("n0", 1)])]);
    let events = h.decide(vec![
        placed(a, vec![gpu("n0", 1)], Some(b)),
        placed(b, vec![gpu("n0", 1)], Some(a)),
    ]);
    assert_eq!(refused(&events).len(), 2, "{events:?}");
    assert_eq!(
        h.state.gpu_holders().get(&gpu("n0", 1)),
        Some(&GpuHolders::one(c))
    );
    // A lost node preempts both members.
    h.pair(a, b, vec![gpu("n0", 0)]);
    h.apply(Command::mark_node_lost("n0", "gone"))
        .expect("lost");
    for j in [a, b, c] {
        assert_eq!(h.state.job(j).map(|x| x.state), Some(JobState::Preempted));
    }
    assert!(h.state.gpu_holders().is_empty());
}

#[test]
fn job_lifecycle_pending_running_succeeded() {
    let mut h = Harness::new();
    h.node("n0", 4);
    let j = h.submit(spec("a", 2, 1));
    assert_eq!(h.state.job(j).map(|j| j.state), Some(JobState::Pending));
    let ev = h.place(vec![(j, vec![gpu("n0", 0), gpu("n0", 1)])]);
    assert!(matches!(
        ev.as_slice(),
        [Event::JobAllocated { epoch: 1, .. }]
    ));
    assert_eq!(h.state.job(j).map(|j| j.state), Some(JobState::Running));
    h.apply(Command::record_worker_started(j, 1, 0, "n0"))
        .expect("worker started");
    h.apply(Command::finish_job(j, JobOutcome::Succeeded, String::new()))
        .expect("finish");
    assert_eq!(h.state.job(j).map(|j| j.state), Some(JobState::Succeeded));
    assert!(h.state.gpu_holders().is_empty(), "GPUs released on finish");
}

impl Harness {
    fn start(&mut self, job_id: JobId, epoch: u64, rank: u32, node: &str) {
        self.apply(Command::record_worker_started(job_id, epoch, rank, node))
            .expect("worker started");
    }
    fn exit(&mut self, job_id: JobId, epoch: u64, rank: u32, code: Option<i32>) -> Vec<Event> {
        self.apply(Command::record_worker_exited(
            job_id,
            epoch,
            rank,
            code,
            String::new(),
        ))
        .expect("exit recorded")
    }
}

#[test]
fn a_job_succeeds_when_every_worker_exits_zero() {
    let mut h = Harness::new();
    h.node("n0", 2);
    let j = h.submit(spec("a", 1, 2));
    h.place(vec![(j, vec![gpu("n0", 0), gpu("n0", 1)])]);
    h.start(j, 1, 0, "n0");
    h.start(j, 1, 1, "n0");
    let ev = h.exit(j, 1, 1, Some(0));
    assert_eq!(ev.len(), 1, "one of two workers done: still running");
    assert_eq!(h.state.job(j).map(|j| j.state), Some(JobState::Running));
    let ev = h.exit(j, 1, 0, Some(0));
    assert!(matches!(
        ev.last(),
        Some(Event::JobFinished {
            state: JobState::Succeeded,
            ..
        })
    ));
    assert!(h.state.gpu_holders().is_empty());
}

#[test]
fn a_failed_worker_requeues_the_job_until_retries_run_out() {
    let mut h = Harness::new();
    h.node("n0", 2);
    let mut s = spec("flaky", 1, 1);
    s.max_retries = 1;
    let j = h.submit(s);
    h.place(vec![(j, vec![gpu("n0", 0)])]);
    h.start(j, 1, 0, "n0");
    let ev = h.exit(j, 1, 0, Some(3));
    assert!(
        matches!(ev.last(), Some(Event::JobRequeued { retries: 1, .. })),
        "{ev:?}"
    );
    let job = h.state.job(j).expect("job");
    assert_eq!(job.state, JobState::Pending);
    assert!(
        job.message.contains("exited with code 3"),
        "{}",
        job.message
    );
    // Second attempt, on another GPU; a stale exit of epoch 1 changes nothing.
    h.place(vec![(j, vec![gpu("n0", 1)])]);
    let ev = h.exit(j, 1, 0, None);
    assert_eq!(ev.len(), 1);
    assert_eq!(h.state.job(j).map(|j| j.state), Some(JobState::Running));
    let ev = h.exit(j, 2, 0, None);
    assert!(matches!(
        ev.last(),
        Some(Event::JobFinished {
            state: JobState::Failed,
            ..
        })
    ));
    let job = h.state.job(j).expect("job");
    assert!(
        job.message.contains("killed by a signal"),
        "{}",
        job.message
    );
    assert!(h.state.gpu_holders().is_empty());
}

/// Issue 30, item 1: a worker its node did not admit (a kubelet admission
/// error) requeues the job without spending a retry, even with none left,
/// and holds it back for a moment so the node's corrected offer comes in.
#[test]
fn a_worker_its_node_did_not_admit_spends_no_retry() {
    let mut h = Harness::new();
    h.node("n0", 2);
    let j = h.submit(spec("strict", 1, 1));
    h.place(vec![(j, vec![gpu("n0", 0)])]);
    h.start(j, 1, 0, "n0");
    let ev = h
        .apply(Command::RecordWorkerExited {
            job_id: j,
            epoch: 1,
            rank: 0,
            exit_code: None,
            reason: "could not start: UnexpectedAdmissionError".into(),
            not_admitted: true,
        })
        .expect("exit recorded");
    assert!(
        matches!(ev.last(), Some(Event::JobRequeued { retries: 0, .. })),
        "{ev:?}"
    );
    let job = h.state.job(j).expect("job");
    assert_eq!(job.state, JobState::Pending);
    assert_eq!(job.retries, 0);
    assert!(
        job.message.contains("was not admitted on node n0")
            && job.message.contains("no retry spent"),
        "{}",
        job.message
    );
    assert!(
        job.not_before_ms.is_some(),
        "held back for the node's correction"
    );
    assert!(h.state.gpu_holders().is_empty());
    // The same exit without the mark fails the job (no retries).
    h.place(vec![(j, vec![gpu("n0", 1)])]);
    let ev = h.exit(j, 2, 0, None);
    assert!(matches!(
        ev.last(),
        Some(Event::JobFinished {
            state: JobState::Failed,
            ..
        })
    ));
}

#[test]
fn a_worker_exit_after_cancel_changes_nothing() {
    let mut h = Harness::new();
    h.node("n0", 1);
    let j = h.submit(spec("a", 1, 1));
    h.place(vec![(j, vec![gpu("n0", 0)])]);
    h.apply(Command::cancel_job(j, "user")).expect("cancel");
    h.exit(j, 1, 0, Some(143));
    assert_eq!(h.state.job(j).map(|j| j.state), Some(JobState::Cancelled));
}

#[test]
fn a_worker_never_straddles_nodes() {
    let mut h = Harness::new();
    h.node("n0", 2);
    h.node("n1", 2);
    let j = h.submit(spec("a", 2, 1));
    let ev = h.place(vec![(j, vec![gpu("n0", 0), gpu("n1", 0)])]);
    assert!(
        matches!(&ev[..], [Event::PlacementRefused { reason, .. }] if reason.contains("whole workers")),
        "{ev:?}"
    );
}

#[test]
fn the_supply_demand_version_moves_on_scheduling_changes_only() {
    let mut h = Harness::new();
    h.node("n0", 1);
    let v0 = h.state.supply_demand_version();
    let j = h.submit(spec("a", 1, 1));
    let v1 = h.state.supply_demand_version();
    assert!(v1 > v0);
    h.place(vec![(j, vec![gpu("n0", 0)])]);
    let v2 = h.state.supply_demand_version();
    assert!(v2 > v1);
    h.start(j, 1, 0, "n0");
    h.apply(Command::report_progress(
        j,
        vec![ProgressSample {
            step: 1,
            total_steps: 10,
            loss: None,
            samples_per_s: 1.0,
            at_ms: 1,
        }],
    ))
    .expect("progress");
    assert_eq!(h.state.supply_demand_version(), v2);
    assert_eq!(h.state.last_round(), 1);
}

#[test]
fn a_decision_that_preempts_a_job_and_hands_its_gpu_to_an_older_one_keeps_the_index() {
    // Found by `no_gpu_is_held_by_two_jobs_outside_a_declared_pair`: job 2's release ran after
    // job 1 was granted job 2's GPU, and dropped job 1's hold on it.
    let mut h = Harness::new();
    h.node("n0", 2);
    let older = h.submit(spec("older", 1, 1));
    let younger = h.submit(spec("younger", 2, 1));
    h.place(vec![(younger, vec![gpu("n0", 0), gpu("n0", 1)])]);
    h.place(vec![(younger, vec![]), (older, vec![gpu("n0", 0)])]);
    assert_eq!(
        h.state.gpu_holders().get(&gpu("n0", 0)).map(|h| h.job),
        Some(older)
    );
    assert_eq!(h.state.gpu_holders().len(), 1);
}

/// Issue 19, item 13: a size refusal names its unit (bytes for strings,
/// entries for lists).
#[test]
fn a_size_refusal_names_its_unit() {
    let mut h = Harness::new();
    let j = h.submit(spec("a", 1, 1));
    let err = h
        .apply(Command::cancel_job(j, "x".repeat(100_000)))
        .expect_err("too long");
    assert!(
        err.to_string()
            .starts_with("reason is 100000 bytes long; the limit is"),
        "{err}"
    );
    let err = h
        .apply(Command::register_node(
            "n",
            "a:1",
            (0..10_000)
                .map(|index| Gpu {
                    index,
                    gpu_type: "v100".into(),
                })
                .collect(),
        ))
        .expect_err("too many");
    assert!(
        err.to_string().contains("10000 entries; the limit is"),
        "{err}"
    );
}

/// The latest entry time (what a new leader stamps after) counts refused
/// entries too, survives a snapshot, and is neither content nor hash.
#[test]
fn the_latest_entry_time_counts_every_entry_and_survives_a_snapshot() {
    let refused = Command::cancel_job(99, String::new());
    // A job submitted at 5 s, then a refused entry stamped `refused_at_ms`.
    let state_with = |refused_at_ms: u64| {
        let mut state = ClusterState::new();
        let submit = Command::submit_job(spec("a", 1, 1));
        state
            .apply(1, &LogEntry::new(5_000, submit))
            .expect("submitted");
        assert!(state
            .apply(2, &LogEntry::new(refused_at_ms, refused.clone()))
            .is_err());
        state
    };
    let mut state = state_with(9_000);
    assert_eq!(state.last_entry_at_ms(), 9_000);
    // An entry stamped earlier (a log written before log time was kept
    // monotonic) does not move it back.
    assert!(state
        .apply(3, &LogEntry::new(7_000, refused.clone()))
        .is_err());
    assert_eq!(state.last_entry_at_ms(), 9_000);
    let back = ClusterState::from_snapshot_proto(state.to_snapshot_proto()).expect("decodes");
    assert_eq!(back.last_entry_at_ms(), 9_000);
    // The time is no content: two states that differ only in it are equal
    // and hash alike.
    let (late, early) = (state_with(9_000), state_with(6_000));
    assert_ne!(late.last_entry_at_ms(), early.last_entry_at_ms());
    assert_eq!(late.state_hash(), early.state_hash());
    assert_eq!(late, early);
}

#[test]
fn a_jobs_resource_limits_are_kept_by_snapshots_and_hashed() {
    let state_with = |memory_bytes: Option<u64>| {
        let mut spec = spec("limited", 1, 1);
        spec.resources.memory_bytes = memory_bytes;
        spec.resources.cpu_millis = memory_bytes.map(|_| 500);
        let mut h = Harness::new();
        h.submit(spec);
        h.state
    };
    let (unlimited, small, large) = (
        state_with(None),
        state_with(Some(64 << 20)),
        state_with(Some(128 << 20)),
    );
    // The limits are content: they tell states apart, hash included (the
    // spec's binary form leaves them out, the hash adds them).
    assert_ne!(small, large);
    assert_ne!(small.state_hash(), large.state_hash());
    assert_ne!(small.state_hash(), unlimited.state_hash());
    // A snapshot keeps them.
    let back = ClusterState::from_snapshot_proto(small.to_snapshot_proto()).expect("decodes");
    assert_eq!(back, small);
    assert_eq!(back.state_hash(), small.state_hash());
    let job = back.jobs().values().next().expect("a job");
    assert_eq!(job.spec.resources.memory_bytes, Some(64 << 20));
    assert_eq!(job.spec.resources.cpu_millis, Some(500));
}

#[test]
fn a_jobs_log_rotation_is_kept_by_snapshots_and_hashed() {
    let state_with = |max_files: Option<u32>| {
        let mut spec = spec("rotated", 1, 1);
        spec.logs.max_files = max_files;
        spec.logs.max_file_bytes = max_files.map(|_| 1 << 20);
        let mut h = Harness::new();
        h.submit(spec);
        h.state
    };
    let (plain, two, three) = (state_with(None), state_with(Some(2)), state_with(Some(3)));
    assert_ne!(two.state_hash(), three.state_hash());
    assert_ne!(two.state_hash(), plain.state_hash());
    let back = ClusterState::from_snapshot_proto(two.to_snapshot_proto()).expect("decodes");
    assert_eq!(back, two);
    assert_eq!(back.state_hash(), two.state_hash());
    let job = back.jobs().values().next().expect("a job");
    assert_eq!(
        (job.spec.logs.max_files, job.spec.logs.max_file_bytes),
        (Some(2), Some(1 << 20))
    );
}

#[test]
fn cancel_of_a_finished_job_is_refused() {
    let mut h = Harness::new();
    let j = h.submit(spec("a", 1, 1));
    h.apply(Command::cancel_job(j, "user"))
        .expect("cancel pending job");
    let err = h.apply(Command::cancel_job(j, "again")).unwrap_err();
    assert_eq!(
        err,
        ApplyError::JobEnded {
            job_id: j,
            state: JobState::Cancelled,
            action: "cancelled".into()
        }
    );
    assert_eq!(
        h.apply(Command::cancel_job(99, String::new())),
        Err(ApplyError::UnknownJob(99))
    );
}

#[test]
fn allocation_of_a_gpu_in_use_is_refused_for_that_job_only() {
    let mut h = Harness::new();
    h.node("n0", 2);
    let a = h.submit(spec("a", 1, 1));
    let b = h.submit(spec("b", 1, 1));
    let c = h.submit(spec("c", 1, 1));
    h.place(vec![(a, vec![gpu("n0", 0)])]);
    let ev = h.place(vec![(b, vec![gpu("n0", 0)]), (c, vec![gpu("n0", 1)])]);
    assert!(ev.contains(&Event::PlacementRefused {
        job_id: b,
        reason: "GPU n0/0 is held by job 1".into()
    }));
    assert!(matches!(ev.last(), Some(Event::JobAllocated { job_id, .. }) if *job_id == c));
    assert_eq!(
        h.state.gpu_holders().get(&gpu("n0", 0)).map(|h| h.job),
        Some(a)
    );
    assert_eq!(h.state.job(b).map(|j| j.state), Some(JobState::Pending));
}

#[test]
fn a_plan_can_move_gpus_between_jobs() {
    let mut h = Harness::new();
    h.node("n0", 1);
    let a = h.submit(spec("a", 1, 1));
    let b = h.submit(spec("b", 1, 1));
    h.place(vec![(a, vec![gpu("n0", 0)])]);
    let ev = h.place(vec![(a, vec![]), (b, vec![gpu("n0", 0)])]);
    assert_eq!(ev.len(), 2, "{ev:?}");
    assert_eq!(h.state.job(a).map(|j| j.state), Some(JobState::Preempted));
    assert_eq!(
        h.state.gpu_holders().get(&gpu("n0", 0)).map(|h| h.job),
        Some(b)
    );
}

#[test]
fn allocation_on_a_lost_node_is_refused_and_loss_preempts() {
    let mut h = Harness::new();
    h.node("n0", 2);
    h.node("n1", 2);
    let a = h.submit(spec("a", 1, 2));
    h.place(vec![(a, vec![gpu("n0", 0), gpu("n1", 0)])]);
    let ev = h
        .apply(Command::mark_node_lost("n1", "heartbeat timeout"))
        .expect("lost");
    assert!(ev.contains(&Event::JobPreempted {
        job_id: a,
        reason: "node n1 lost".into()
    }));
    assert!(
        h.state.gpu_holders().is_empty(),
        "the whole gang is released"
    );
    let ev = h.place(vec![(a, vec![gpu("n0", 0), gpu("n1", 1)])]);
    assert_eq!(
        ev,
        vec![Event::PlacementRefused {
            job_id: a,
            reason: "node \"n1\" is lost".into()
        }]
    );
    h.apply(Command::mark_node_recovered("n1"))
        .expect("recovered");
    let ev = h.place(vec![(a, vec![gpu("n0", 0), gpu("n1", 1)])]);
    assert!(matches!(
        ev.as_slice(),
        [Event::JobAllocated { epoch: 2, .. }]
    ));
}

#[test]
fn placements_must_match_the_job_shape_and_types() {
    let mut h = Harness::new();
    h.node("n0", 4);
    let mut s = spec("a", 2, 1);
    s.gpu_types.allowed = vec!["k80".into()];
    let a = h.submit(s);
    let ev = h.place(vec![(a, vec![gpu("n0", 0)])]);
    assert!(
        matches!(&ev[..], [Event::PlacementRefused { reason, .. }] if reason.contains("workers of 2 GPUs"))
    );
    let ev = h.place(vec![(a, vec![gpu("n0", 0), gpu("n0", 1)])]);
    assert!(
        matches!(&ev[..], [Event::PlacementRefused { reason, .. }] if reason.contains("not an allowed type"))
    );
    let b = h.submit(spec("b", 2, 1));
    let ev = h.place(vec![(b, vec![gpu("n0", 7), gpu("n0", 1)])]);
    assert!(
        matches!(&ev[..], [Event::PlacementRefused { reason, .. }] if reason.contains("does not exist"))
    );
}

#[test]
fn stale_epochs_and_bad_ranks_are_refused() {
    let mut h = Harness::new();
    h.node("n0", 2);
    let a = h.submit(spec("a", 1, 1));
    h.place(vec![(a, vec![gpu("n0", 0)])]);
    h.place(vec![(a, vec![gpu("n0", 1)])]);
    assert_eq!(
        h.apply(Command::record_worker_started(a, 1, 0, "n0")),
        Err(ApplyError::StaleEpoch {
            job_id: a,
            epoch: 1,
            current: 2
        })
    );
    assert!(matches!(
        h.apply(Command::record_worker_started(a, 2, 1, "n0")),
        Err(ApplyError::RankOutOfRange { .. })
    ));
}

/// Issue 19, item 5: a node is removed only when no job holds its GPUs,
/// unless forced, which sends those jobs back to the queue.
#[test]
fn a_node_is_removed_only_when_idle_unless_forced() {
    let mut h = Harness::new();
    h.node("n0", 2);
    h.node("n1", 1);
    let a = h.submit(spec("a", 1, 1));
    h.place(vec![(a, vec![gpu("n0", 1)])]);
    let err = h
        .apply(Command::remove_node("n0", false))
        .expect_err("a job holds a GPU");
    assert_eq!(
        err,
        ApplyError::NodeInUse {
            node: "n0".into(),
            jobs: vec![a]
        }
    );
    assert!(err.to_string().contains("force"), "{err}");
    assert_eq!(
        h.apply(Command::remove_node("n1", false)),
        Ok(vec![Event::NodeRemoved { name: "n1".into() }])
    );
    let events = h.apply(Command::remove_node("n0", true)).expect("forced");
    assert_eq!(
        events,
        vec![
            Event::JobPreempted {
                job_id: a,
                reason: "node n0 removed".into()
            },
            Event::NodeRemoved { name: "n0".into() }
        ]
    );
    assert!(h.state.nodes().is_empty());
    assert!(h.state.gpu_holders().is_empty());
    let job = h.state.job(a).expect("the job stays");
    assert_eq!(job.state, JobState::Preempted);
    assert!(job.allocation.is_none());
    assert_eq!(
        h.apply(Command::remove_node("n0", true)),
        Err(ApplyError::UnknownNode("n0".into()))
    );
}

#[test]
fn removal_needs_an_ended_job_and_re_registration_keeps_held_gpus() {
    let mut h = Harness::new();
    h.node("n0", 2);
    let a = h.submit(spec("a", 1, 1));
    h.place(vec![(a, vec![gpu("n0", 1)])]);
    assert!(matches!(
        h.apply(Command::remove_job(a)),
        Err(ApplyError::JobNotEnded { .. })
    ));
    let shrink = h.apply(Command::register_node(
        "n0",
        "x",
        vec![Gpu {
            index: 0,
            gpu_type: "v100".into(),
        }],
    ));
    assert!(matches!(shrink, Err(ApplyError::GpuInUse { .. })));
}

/// Issue 23, item 5: which ended jobs retention removes (by age, beyond
/// a count, oldest first, at most a limit), that one whose worker is still
/// recorded as running is kept until its exit, and that a removed job is
/// told apart from one never submitted.
#[test]
fn retention_removes_the_oldest_ended_jobs_but_not_one_whose_worker_runs() {
    let mut h = Harness::new();
    h.node("n0", 2);
    let [a, b, c, d] = ["a", "b", "c", "d"].map(|n| h.submit(spec(n, 1, 1)));
    h.place(vec![(c, vec![gpu("n0", 0)])]);
    h.start(c, 1, 0, "n0");
    let mut finished_ms = Vec::new();
    for job_id in [a, b, c] {
        h.apply(Command::cancel_job(job_id, String::new()))
            .expect("cancelled");
        finished_ms.push(
            h.state
                .job(job_id)
                .and_then(|j| j.finished_at_ms)
                .expect("finished"),
        );
    }
    // c has ended but its worker's exit is still to come; d waits.
    assert_eq!(h.state.ended_job_count(), 2);
    let all = usize::MAX;
    assert_eq!(
        h.state.jobs_due_for_removal(u64::MAX, 0, all, all),
        vec![a, b]
    );
    // By age: b finished a second after a.
    let retain_ms = 10_000;
    assert_eq!(
        h.state
            .jobs_due_for_removal(finished_ms[1] + retain_ms - 1, retain_ms, all, all),
        vec![a]
    );
    assert_eq!(
        h.state
            .jobs_due_for_removal(finished_ms[0] + retain_ms - 1, retain_ms, all, all),
        Vec::<JobId>::new()
    );
    // By count: keeping one, the oldest goes; keeping two, none.
    assert_eq!(h.state.jobs_due_for_removal(0, u64::MAX, 1, all), vec![a]);
    assert_eq!(
        h.state.jobs_due_for_removal(0, u64::MAX, 2, all),
        Vec::<JobId>::new()
    );
    assert_eq!(
        h.state.jobs_due_for_removal(u64::MAX, 0, all, 1),
        vec![a],
        "at most limit"
    );
    let refused = h.apply(Command::remove_job(c));
    assert!(
        matches!(&refused, Err(ApplyError::Invalid { field, reason })
            if field == "job_id" && reason.contains("rank 0 is still recorded as running")),
        "{refused:?}"
    );
    h.exit(c, 1, 0, Some(143));
    assert_eq!(
        h.state.jobs_due_for_removal(u64::MAX, 0, all, all),
        vec![a, b, c]
    );
    assert_eq!(
        h.apply(Command::remove_job(a)),
        Ok(vec![Event::JobRemoved { job_id: a }])
    );
    assert!(h.state.was_removed(a));
    assert!(!h.state.was_removed(d), "still there");
    assert!(!h.state.was_removed(d + 1), "never submitted");
    assert!(!h.state.was_removed(0));
    assert_eq!(h.state.ended_job_count(), 2);
    assert_eq!(
        h.state.jobs_due_for_removal(u64::MAX, 0, all, all),
        vec![b, c]
    );
}

/// A queue spec with a quota of `n` GPUs of type `t`.
fn quota(t: &str, n: u32) -> keel_state::queue::QueueSpec {
    keel_state::queue::QueueSpec::with_quota([(t.to_string(), n)].into())
}

/// The field a refusal names (a queue's or a command's).
fn refused_field(r: Result<Vec<Event>, ApplyError>) -> String {
    match r {
        Err(ApplyError::Queue(keel_state::queue::QueueError::Invalid { field, .. }))
        | Err(ApplyError::Invalid { field, .. }) => field.to_string(),
        other => panic!("{other:?}"),
    }
}

/// Issue 23, item 1: queues are replicated state. A quota names the
/// cluster's GPU types; a job names an existing queue; a queue holding an
/// unfinished job is kept; every refusal names its field and changes
/// nothing (the harness checks that); queues are hashed.
#[test]
fn queues_are_made_changed_and_deleted_through_the_log_and_jobs_name_them() {
    use keel_state::queue::QueueError;
    let mut h = Harness::new();
    h.node("n0", 2);
    let before = h.state.state_hash();
    assert_eq!(
        refused_field(h.apply(Command::create_queue("team-a", quota("h100", 1)))),
        "quota"
    );
    assert_eq!(
        refused_field(h.apply(Command::create_queue("Team A", quota("v100", 1)))),
        "name"
    );
    let mut in_team = spec("a", 1, 1);
    in_team.queue = "team-a".into();
    assert_eq!(
        refused_field(h.apply(Command::submit_job(in_team.clone()))),
        "queue",
        "no such queue yet"
    );
    assert_eq!(
        h.apply(Command::create_queue("team-a", quota("v100", 1))),
        Ok(vec![Event::QueueCreated {
            name: "team-a".into()
        }])
    );
    assert_ne!(h.state.state_hash(), before, "queues are hashed");
    assert!(matches!(
        h.apply(Command::create_queue("team-a", quota("v100", 2))),
        Err(ApplyError::Queue(QueueError::Exists(_)))
    ));
    let a = h.submit(in_team);
    assert_eq!(
        h.state.job(a).map(|j| j.spec.queue.as_str()),
        Some("team-a")
    );
    h.apply(Command::update_queue("team-a", quota("v100", 2)))
        .expect("updated");
    assert_eq!(
        h.state.queues().spec("team-a").and_then(|s| s.quota),
        Some([("v100".to_string(), 2)].into())
    );
    assert!(matches!(
        h.apply(Command::delete_queue("team-a")),
        Err(ApplyError::Queue(QueueError::HoldsJobs { jobs: 1, .. }))
    ));
    h.apply(Command::cancel_job(a, String::new()))
        .expect("cancelled");
    h.apply(Command::delete_queue("team-a"))
        .expect("deleted once its job ended");
    assert!(matches!(
        h.apply(Command::delete_queue("default")),
        Err(ApplyError::Queue(QueueError::DefaultKept))
    ));
    // The default queue takes a quota, and jobs naming it or none.
    h.apply(Command::update_queue("default", quota("v100", 1)))
        .expect("the default queue takes a quota");
    let mut in_default = spec("b", 1, 1);
    in_default.queue = "default".into();
    h.submit(in_default);
    h.submit(spec("c", 1, 1));
    // A decoded snapshot holds the same queues.
    let decoded = keel_state::ClusterState::from_snapshot_proto(h.state.to_snapshot_proto())
        .expect("decodes");
    assert_eq!(decoded.queues(), h.state.queues());
    assert_eq!(decoded.state_hash(), h.state.state_hash());
}

/// Once queues are kept, a submission's queue is answered from the queue
/// index's numbers: a queue deleted after its jobs had a number there is
/// refused all the same, and one made after the index was built is taken.
#[test]
fn a_deleted_queues_name_is_refused_while_other_queues_are_kept() {
    let mut h = Harness::new();
    h.node("n0", 2);
    for name in ["team-a", "team-b"] {
        h.apply(Command::create_queue(name, quota("v100", 1)))
            .expect("created");
    }
    let in_queue = |queue: &str| {
        let mut s = spec("a", 1, 1);
        s.queue = queue.into();
        s
    };
    let a = h.submit(in_queue("team-a"));
    h.apply(Command::cancel_job(a, String::new()))
        .expect("cancelled");
    h.apply(Command::delete_queue("team-a")).expect("deleted");
    assert!(!h.state.queues().is_unset(), "team-b keeps the index");
    assert_eq!(
        refused_field(h.apply(Command::submit_job(in_queue("team-a")))),
        "queue",
        "a deleted queue is refused"
    );
    assert_eq!(
        refused_field(h.apply(Command::submit_job(in_queue("team-c")))),
        "queue",
        "a queue never made is refused"
    );
    h.submit(in_queue("team-b"));
    h.submit(in_queue(""));
    h.submit(in_queue("default"));
    h.apply(Command::create_queue("team-c", quota("v100", 1)))
        .expect("created");
    h.submit(in_queue("team-c"));
    h.apply(Command::create_queue("team-a", quota("v100", 1)))
        .expect("made again");
    let again = h.submit(in_queue("team-a"));
    assert_eq!(
        h.state
            .waiting_in_queue("team-a")
            .map(|j| j.id)
            .collect::<Vec<_>>(),
        vec![again]
    );
}

/// A decision's quota check counts the placements it keeps, not those it
/// refused before the check: a not-preemptible job's release, refused,
/// gives nothing back to its queue, so another job of the queue that
/// would take it beyond its quota (with nothing to borrow) is refused.
#[test]
fn a_refused_release_gives_no_quota_to_the_same_decisions_growth() {
    let mut h = Harness::new();
    h.node("n0", 4);
    // The quotas take every GPU: nothing is left to borrow.
    h.apply(Command::create_queue("team-a", quota("v100", 2)))
        .expect("created");
    h.apply(Command::update_queue("default", quota("v100", 2)))
        .expect("updated");
    let in_team = |name: &str, preemptible: bool| {
        let mut s = spec(name, 2, 1);
        s.queue = "team-a".into();
        s.preemptible = preemptible;
        s
    };
    let kept = h.submit(in_team("kept", false));
    let grows = h.submit(in_team("grows", true));
    h.place(vec![(kept, vec![gpu("n0", 0), gpu("n0", 1)])]);
    let events = h.decide(vec![
        placed(kept, Vec::new(), None),
        placed(grows, vec![gpu("n0", 2), gpu("n0", 3)], None),
    ]);
    let reasons = refused(&events);
    assert_eq!(reasons.len(), 2, "{events:?}");
    assert_eq!(reasons[0].0, kept);
    assert!(reasons[0].1.contains("not preemptible"), "{reasons:?}");
    assert_eq!(reasons[1].0, grows);
    assert!(reasons[1].1.contains("quota"), "{reasons:?}");
    let usage = h.state.queue_usage();
    assert_eq!(
        usage.get("team-a").and_then(|u| u.get("v100")),
        Some(&2),
        "{usage:?}"
    );
    assert_eq!(h.state.job(kept).map(|j| j.state), Some(JobState::Running));
}

fn v100s(indexes: &[u32]) -> Vec<Gpu> {
    indexes
        .iter()
        .map(|&index| Gpu {
            index,
            gpu_type: "v100".into(),
        })
        .collect()
}

fn inventory(name: &str, gpus: Vec<Gpu>, failed: Vec<FailedGpu>) -> Command {
    Command::RecordNodeInventory {
        name: name.into(),
        address: "127.0.0.1".into(),
        gpus,
        failed,
        note: String::new(),
    }
}

/// Issue 33: a GPU that leaves a node's inventory while a job holds it is
/// gone, with why, in one entry; the job goes back to the queue (its other
/// GPUs released too), spending no retry; the other job runs on.
#[test]
fn a_gpu_gone_from_a_nodes_inventory_preempts_its_job_in_one_entry() {
    let mut h = Harness::new();
    h.node("gx-0", 2);
    let a = h.submit(spec("a", 1, 1));
    let b = h.submit(spec("b", 1, 1));
    h.place(vec![(a, vec![gpu("gx-0", 0)]), (b, vec![gpu("gx-0", 1)])]);
    let events = h
        .apply(inventory("gx-0", v100s(&[0]), vec![]))
        .expect("never refused for what jobs hold");
    assert_eq!(
        events,
        vec![
            Event::JobPreempted {
                job_id: b,
                reason: "GPU gx-0/1 gone: no longer in the node's inventory".into()
            },
            Event::NodeRegistered {
                name: "gx-0".into(),
                gpus: v100s(&[0])
            },
            Event::NodeInventoryChanged {
                name: "gx-0".into(),
                added: vec![],
                gone: vec![FailedGpu {
                    index: 1,
                    gpu_type: "v100".into(),
                    reason: "no longer in the node's inventory".into()
                }]
            },
        ]
    );
    let node = &h.state.nodes()["gx-0"];
    assert_eq!(node.gpus.len(), 1);
    assert_eq!(
        node.gone_gpus[&1].reason,
        "no longer in the node's inventory"
    );
    let job = h.state.job(b).expect("b");
    assert_eq!(job.state, JobState::Preempted);
    assert_eq!(job.retries, 0, "the GPU's failure is not the job's");
    assert_eq!(h.state.job(a).expect("a").state, JobState::Running);
    // The GPU comes back: added, no longer gone.
    let events = h
        .apply(inventory("gx-0", v100s(&[0, 1]), vec![]))
        .expect("applies");
    assert!(events.contains(&Event::NodeInventoryChanged {
        name: "gx-0".into(),
        added: v100s(&[1]),
        gone: vec![]
    }));
    assert!(h.state.nodes()["gx-0"].gone_gpus.is_empty());
    assert_eq!(h.state.free_gpus().total(), 1);
}

/// Issue 33: a failed GPU carries its reason; a GPU whose type changed is
/// removed (its job preempted) and added as its new type.
#[test]
fn a_failed_gpu_keeps_its_reason_and_a_changed_type_is_removed_and_added() {
    let mut h = Harness::new();
    h.node("n", 2);
    let a = h.submit(spec("a", 2, 1));
    h.place(vec![(a, vec![gpu("n", 0), gpu("n", 1)])]);
    let xid = "Xid 79: GPU has fallen off the bus";
    let failed = vec![FailedGpu {
        index: 0,
        gpu_type: "v100".into(),
        reason: xid.into(),
    }];
    let a100 = Gpu {
        index: 1,
        gpu_type: "a100".into(),
    };
    let events = h
        .apply(inventory("n", vec![a100.clone()], failed))
        .expect("applies");
    assert_eq!(
        events[0],
        Event::JobPreempted {
            job_id: a,
            reason: format!("GPU n/0 gone: {xid}")
        },
        "one preemption for the gang, with the first GPU's reason"
    );
    assert_eq!(
        events.last(),
        Some(&Event::NodeInventoryChanged {
            name: "n".into(),
            added: vec![a100.clone()],
            gone: vec![
                FailedGpu {
                    index: 0,
                    gpu_type: "v100".into(),
                    reason: xid.into()
                },
                FailedGpu {
                    index: 1,
                    gpu_type: "v100".into(),
                    reason: "its type changed from v100 to a100".into()
                },
            ]
        })
    );
    let node = &h.state.nodes()["n"];
    assert_eq!(node.gpus.get(&1), Some(&"a100".to_string()));
    assert_eq!(node.gone_gpus.keys().copied().collect::<Vec<_>>(), vec![0]);
    assert!(h.state.gpu_holders().is_empty());
    // Snapshots keep gone GPUs; the hash sees them.
    let back = ClusterState::from_snapshot_proto(h.state.to_snapshot_proto()).expect("decodes");
    assert_eq!(back, h.state);
    assert_eq!(back.state_hash(), h.state.state_hash());
    let mut healed = h.state.clone();
    healed
        .apply(
            h.index + 1,
            &LogEntry::new(h.index * 1000 + 1000, inventory("n", vec![a100], vec![])),
        )
        .expect("applies");
    assert_eq!(
        healed.nodes()["n"].gone_gpus.len(),
        1,
        "missing, still gone"
    );
    let reason = &healed.nodes()["n"].gone_gpus[&0].reason;
    assert_eq!(reason, xid, "the reason it was gone with is kept");
}

/// Issue 33: a report that offers a GPU and says it failed, or names a GPU
/// failed twice, is refused naming the GPU; nothing changes.
#[test]
fn a_report_offering_a_failed_gpu_is_refused() {
    let mut h = Harness::new();
    let failed = |index| FailedGpu {
        index,
        gpu_type: "v100".into(),
        reason: "lost".into(),
    };
    let err = h
        .apply(inventory("n", v100s(&[0]), vec![failed(0)]))
        .expect_err("refused");
    assert_eq!(
        err,
        ApplyError::DuplicateGpu {
            node: "n".into(),
            index: 0
        }
    );
    let err = h
        .apply(inventory("n", v100s(&[0]), vec![failed(1), failed(1)]))
        .expect_err("refused");
    assert!(err.to_string().contains("GPU index 1 twice"), "{err}");
    assert!(h.state.nodes().is_empty());
}

/// A node an operator marked lost after its agent's report was made stays
/// lost when the report's entry is applied.
#[test]
fn a_report_does_not_revive_a_node_an_operator_marked_lost() {
    let mut h = Harness::new();
    h.node("n", 2);
    h.apply(Command::mark_node_lost("n", "maintenance"))
        .expect("lost");
    h.apply(inventory("n", v100s(&[0]), vec![]))
        .expect("applies");
    let node = &h.state.nodes()["n"];
    assert_eq!(
        (node.state, node.message.as_str()),
        (NodeState::Lost, "maintenance")
    );
    assert_eq!(node.gpus.len(), 1);
}

#[test]
fn an_invalid_spec_is_refused_naming_the_field() {
    let mut h = Harness::new();
    let err = h.apply(Command::submit_job(spec("a", 0, 1))).unwrap_err();
    assert_eq!(
        err.to_string(),
        "invalid job spec: spec.gpus is 0; it must be between 1 and 64"
    );
}

// ---- Property tests ----

/// What the state's postcard form (snapshot format 7, for a replica of the
/// release before) carries: everything but what that release does not
/// know, the nodes' gone GPUs (issue 33).
fn postcard_carried(state: &ClusterState) -> ClusterState {
    let mut snapshot = state.to_snapshot_proto();
    for node in &mut snapshot.nodes {
        node.gone_gpus.clear();
    }
    ClusterState::from_snapshot_proto(snapshot).expect("decodes")
}

const NODES: [&str; 3] = ["n0", "n1", "n2"];

fn arb_gpu() -> impl Strategy<Value = GpuRef> {
    (0..NODES.len(), 0u32..5).prop_map(|(n, i)| gpu(NODES[n], i))
}

fn arb_command() -> impl Strategy<Value = Command> {
    let job = 0u64..12;
    prop_oneof![
        1 => (0..NODES.len(), 1u32..5).prop_map(|(n, g)| Command::register_node(NODES[n], "a", (0..g)
                .map(|index| Gpu {
                    index,
                    gpu_type: if index % 2 == 0 { "v100" } else { "k80" }.into()
                })
                .collect())),
        // Issue 33: any subset of GPUs 0..5, some failed, some retyped.
        1 => (0..NODES.len(), 0u32..32, 0u32..32, any::<bool>()).prop_map(
            |(n, offered, failed, retype)| Command::RecordNodeInventory {
                name: NODES[n].into(),
                address: "a".into(),
                gpus: (0..5)
                    .filter(|i| offered & (1 << i) != 0)
                    .map(|index| Gpu {
                        index,
                        gpu_type: if (index % 2 == 0) != retype { "v100" } else { "k80" }.into()
                    })
                    .collect(),
                failed: (0..5)
                    .filter(|i| offered & (1 << i) == 0 && failed & (1 << i) != 0)
                    .map(|index| FailedGpu {
                        index,
                        gpu_type: "v100".into(),
                        reason: "Xid 79".into()
                    })
                    .collect(),
                note: String::new(),
            }
        ),
        1 => (0..NODES.len()).prop_map(|n| Command::mark_node_lost(NODES[n], "r")),
        1 => (0..NODES.len()).prop_map(|n| Command::mark_node_recovered(NODES[n])),
        1 => (0..NODES.len(), any::<bool>()).prop_map(|(n, force)| Command::remove_node(NODES[n], force)),
        3 => (1u32..3, 1u32..3).prop_map(|(g, w)| Command::submit_job(spec("j", g, w))),
        1 => job.clone().prop_map(|job_id| Command::cancel_job(job_id, String::new())),
        4 => proptest::collection::vec((job.clone(), proptest::collection::vec(arb_gpu(), 0..5)), 1..4)
            .prop_map(|ps| Command::decide_allocation(0, "p", 0, ps.into_iter().map(|(job_id, gpus)| JobPlacement::alone(job_id, gpus)).collect())),
        // Space sharing: a pair, sometimes flawed (not on the same GPUs,
        // not mutual, one member missing), beside placements alone.
        3 => (job.clone(), job.clone(), proptest::collection::vec(arb_gpu(), 0..3), 0u8..5,
              proptest::collection::vec((job.clone(), proptest::collection::vec(arb_gpu(), 0..3)), 0..2))
            .prop_map(|(a, b, gpus, flaw, alone)| {
                let mut other = gpus.clone();
                if flaw == 1 {
                    other.pop();
                }
                let mut placements = vec![
                    JobPlacement { job_id: a, gpus, share_with: Some(b) },
                    JobPlacement { job_id: b, gpus: other, share_with: (flaw != 2).then_some(a) },
                ];
                if flaw == 3 {
                    placements.pop();
                }
                placements.extend(alone.into_iter().map(|(job_id, gpus)| JobPlacement::alone(job_id, gpus)));
                Command::decide_allocation(0, "p", 0, placements)
            }),
        1 => (job.clone(), 0u64..4, 0u32..3).prop_map(|(job_id, epoch, rank)| Command::record_worker_started(job_id, epoch, rank, "n0")),
        1 => (job.clone(), 0u64..4, 0u32..3, proptest::option::of(-2i32..3)).prop_map(
            |(job_id, epoch, rank, exit_code)| Command::record_worker_exited(job_id, epoch, rank, exit_code, String::new())),
        1 => (job.clone(), 0u64..100).prop_map(|(job_id, step)| Command::report_progress(job_id, vec![ProgressSample { step, total_steps: 100, loss: Some(1.0 / (step as f64 + 1.0)), samples_per_s: 10.0, at_ms: step }])),
        1 => (job.clone(), any::<bool>()).prop_map(|(job_id, ok)| Command::finish_job(job_id, if ok { JobOutcome::Succeeded } else { JobOutcome::Failed }, String::new())),
        1 => job.prop_map(Command::remove_job),
        1 => prop::sample::select(vec!["fifo", "optimus", "no-such-policy"])
            .prop_map(Command::set_policy),
    ]
}

fn run(commands: &[Command]) -> (ClusterState, Vec<Result<Vec<Event>, ApplyError>>) {
    let mut state = ClusterState::new();
    let results = commands
        .iter()
        .enumerate()
        .map(|(i, c)| state.apply(i as u64 + 1, &LogEntry::new(i as u64 * 10, c.clone())))
        .collect();
    (state, results)
}

/// An entry with a client's request id.
fn requested(at_ms: u64, command: Command, id: &str) -> LogEntry {
    LogEntry {
        request_id: Some(id.into()),
        ..LogEntry::new(at_ms, command)
    }
}

/// Issue 19, item 4: a submission whose answer was lost and that the client
/// sends again is one job, and the retry is told the first outcome.
#[test]
fn a_retried_request_applies_once_and_is_answered_with_the_first_outcome() {
    let mut state = ClusterState::new();
    let submit = || Command::submit_job(spec("train", 1, 1));
    let first = state
        .apply(1, &requested(1_000, submit(), "cli-1"))
        .expect("accepted");
    assert!(matches!(first[..], [Event::JobSubmitted { job_id: 1, .. }]));
    let after_first = state.clone();
    let repeat = state
        .apply(2, &requested(5_000, submit(), "cli-1"))
        .expect("a repeat is not a refusal");
    assert_eq!(
        repeat,
        vec![Event::RequestRepeated {
            request_id: "cli-1".into(),
            first_index: 1
        }]
    );
    assert_eq!(state.jobs().len(), 1, "one job, however often it is sent");
    assert_eq!(state.answer(Ok(repeat)), Ok(first.clone()));
    // Nothing but the index moved: a refused entry at the same index
    // leaves the same state.
    let mut expected = after_first;
    let _ = expected.apply(2, &LogEntry::new(0, Command::remove_job(99)));
    assert_eq!(state.state_hash(), expected.state_hash());
    // Without the id, the same command is a second job.
    state
        .apply(3, &LogEntry::new(6_000, submit()))
        .expect("accepted");
    assert_eq!(state.jobs().len(), 2);
    // A refusal is not remembered: its retry is judged again.
    let cancel = || Command::cancel_job(7, String::new());
    let refused = state.apply(4, &requested(7_000, cancel(), "cli-2"));
    assert_eq!(refused, Err(ApplyError::UnknownJob(7)));
    assert_eq!(
        state.apply(5, &requested(8_000, cancel(), "cli-2")),
        refused
    );
    state.check_invariants().expect("invariants");
}

#[test]
fn a_request_id_used_for_another_command_is_refused_and_changes_nothing() {
    let mut state = ClusterState::new();
    state
        .apply(1, &requested(0, Command::submit_job(spec("a", 1, 1)), "r"))
        .expect("accepted");
    let before = state.clone();
    let err = state
        .apply(2, &requested(1, Command::submit_job(spec("b", 1, 1)), "r"))
        .expect_err("another command under the same id");
    assert_eq!(
        err,
        ApplyError::RequestIdReused {
            request_id: "r".into(),
            first_index: 1
        }
    );
    assert!(err.to_string().contains("index 1"), "{err}");
    assert_eq!(state.jobs(), before.jobs());
    // A malformed id is refused, naming the field and the limit.
    let long = "x".repeat(65);
    let err = state
        .apply(
            3,
            &requested(2, Command::submit_job(spec("c", 1, 1)), &long),
        )
        .expect_err("too long");
    assert!(
        err.to_string()
            .contains("request_id is 65 bytes long; the limit is 64"),
        "{err}"
    );
    assert_eq!(state.jobs().len(), 1);
}

/// The window is log time, decided in `apply`: the same on every replica.
#[test]
fn a_request_is_remembered_for_the_window_of_log_time_only() {
    use keel_state::requests::REMEMBER_FOR_MS;
    let mut state = ClusterState::new();
    let submit = || Command::submit_job(spec("a", 1, 1));
    state
        .apply(1, &requested(0, submit(), "r"))
        .expect("accepted");
    let inside = state
        .apply(2, &requested(REMEMBER_FOR_MS, submit(), "r"))
        .expect("repeat");
    assert!(matches!(inside[..], [Event::RequestRepeated { .. }]));
    let after = state
        .apply(3, &requested(REMEMBER_FOR_MS + 1, submit(), "r"))
        .expect("new");
    assert!(matches!(after[..], [Event::JobSubmitted { job_id: 2, .. }]));
    assert_eq!(state.remembered_requests(), 1);
    state.check_invariants().expect("invariants");
}

#[test]
fn set_policy_logs_well_formed_names_and_refuses_others() {
    let mut h = Harness::new();
    assert_eq!(h.state.policy(), None);
    // Which policies exist is the API's check; `apply` holds the name to
    // its form, so no policy list decides how a log replays.
    let err = h
        .apply(Command::set_policy("no-such-policy"))
        .expect_err("not a name");
    let text = err.to_string();
    assert!(
        text.contains("policy") && text.contains("lower-case letters, digits and _"),
        "{text}"
    );
    assert_eq!(h.state.policy(), None);
    let events = h.apply(Command::set_policy("optimus")).expect("known name");
    assert_eq!(
        events,
        vec![Event::PolicyChanged {
            from: String::new(),
            to: "optimus".into()
        }]
    );
    let events = h.apply(Command::set_policy("drf")).expect("known name");
    assert_eq!(
        events,
        vec![Event::PolicyChanged {
            from: "optimus".into(),
            to: "drf".into()
        }]
    );
    assert_eq!(h.state.policy(), Some("drf"));
}

/// A decision's policy memory (issue 21, item 3): kept with the decision,
/// hashed, refused from a decision planned before the memory in force,
/// cleared when another policy is chosen, and checked for its writer and
/// size.
#[test]
fn a_decisions_policy_memory_is_state() {
    let mut h = Harness::new();
    h.node("n0", 1);
    let memory = |bytes: &[u8]| PolicyMemory {
        policy: "max_min_fairness".into(),
        format: 1,
        bytes: bytes.to_vec(),
    };
    let decide = |h: &mut Harness, based_on: u64, m: PolicyMemory| {
        h.apply(Command::DecideAllocation {
            based_on,
            policy: "max_min_fairness".into(),
            round: h.state.last_round() + 1,
            placements: vec![],
            memory: Some(m),
        })
    };
    let empty_hash = h.state.state_hash();
    let version = h.state.supply_demand_version();
    let at = h.index;
    assert_eq!(decide(&mut h, at, memory(b"one")), Ok(vec![]));
    assert_eq!(h.state.policy_memory(), Some(&memory(b"one")));
    assert_ne!(h.state.state_hash(), empty_hash, "the memory is hashed");
    assert_eq!(
        h.state.supply_demand_version(),
        version,
        "a memory alone wakes no scheduler"
    );
    let recorded_at = h.index;
    // Planned on a state before that memory: its memory is not kept.
    let events = decide(&mut h, recorded_at - 1, memory(b"stale")).expect("applied");
    assert!(
        matches!(&events[..], [Event::PolicyMemoryRefused { reason, .. }] if reason.contains(&format!("index {recorded_at}"))),
        "{events:?}"
    );
    assert_eq!(h.state.policy_memory(), Some(&memory(b"one")));
    // Planned on it: kept.
    assert_eq!(decide(&mut h, recorded_at, memory(b"two")), Ok(vec![]));
    assert_eq!(h.state.policy_memory(), Some(&memory(b"two")));
    // Written by another policy than the deciding one, or too large.
    let at = h.index;
    let mut other = memory(b"x");
    other.policy = "fifo".into();
    let err = decide(&mut h, at, other).expect_err("another writer");
    assert!(err.to_string().contains("policy memory"), "{err}");
    let err = h
        .apply_unencoded(Command::DecideAllocation {
            based_on: at,
            policy: "max_min_fairness".into(),
            round: h.state.last_round() + 1,
            placements: vec![],
            memory: Some(memory(&vec![
                0;
                keel_state::policy_memory::POLICY_MEMORY_MAX_BYTES
                    + 1
            ])),
        })
        .expect_err("too large");
    assert!(matches!(err, ApplyError::TooLarge { .. }), "{err}");
    assert_eq!(h.state.policy_memory(), Some(&memory(b"two")));
    // The same policy chosen again keeps it; another one clears it, and a
    // decision planned before the switch cannot bring it back.
    h.apply(Command::set_policy("max_min_fairness"))
        .expect("set");
    assert_eq!(h.state.policy_memory(), Some(&memory(b"two")));
    let before_switch = h.index;
    h.apply(Command::set_policy("fifo")).expect("set");
    assert_eq!(h.state.policy_memory(), None);
    let events = decide(&mut h, before_switch, memory(b"old")).expect("applied");
    assert!(
        matches!(&events[..], [Event::PolicyMemoryRefused { .. }]),
        "{events:?}"
    );
    assert_eq!(h.state.policy_memory(), None);
}

#[test]
fn progress_reports_build_the_performance_history() {
    let mut h = Harness::new();
    h.node("n0", 2);
    let mut s = spec("elastic", 1, 1);
    s.workers.max = 2;
    s.model = Some("resnet50".into());
    let id = h.submit(s);
    let place = |h: &mut Harness, gpus: u32| {
        let based_on = h.index;
        h.apply(Command::decide_allocation(
            based_on,
            "test",
            h.state.last_round() + 1,
            vec![JobPlacement {
                job_id: id,
                gpus: (0..gpus)
                    .map(|index| GpuRef {
                        node: "n0".into(),
                        index,
                    })
                    .collect(),
                share_with: None,
            }],
        ))
        .expect("placed");
    };
    let report = |h: &mut Harness, step: u64, at_ms: u64| {
        h.apply(Command::report_progress(
            id,
            vec![ProgressSample {
                step,
                total_steps: 0,
                loss: Some(2.0 / (1.0 + step as f64 / 100.0)),
                samples_per_s: 0.0,
                at_ms,
            }],
        ))
        .expect("progress");
    };
    place(&mut h, 1);
    report(&mut h, 0, 0);
    report(&mut h, 110, 10_000); // 11 steps/s on one v100
    place(&mut h, 2); // a resize: a new epoch
    report(&mut h, 120, 30_000); // the gap across the restart is no speed
    report(&mut h, 322, 40_000); // 20.2 steps/s on two
    let job = h.state.job(id).expect("job");
    // The one-GPU epoch is folded into the history by type and size; the
    // current one (two GPUs) is still being measured. (The fits on this
    // history are keel-scheduling's, tested there.)
    let folded: Vec<(u32, f64)> = job.perf.speeds["v100"]
        .iter()
        .map(|(n, s)| (*n, s.mean()))
        .collect();
    assert_eq!(folded, vec![(1, 11.0)]);
    assert_eq!(
        (job.perf.epoch_gpu_type.as_str(), job.perf.epoch_gpus),
        ("v100", 2)
    );
    assert!((job.perf.epoch_speed.mean() - 20.2).abs() < 1e-9);
    assert_eq!(job.perf.loss_points.len(), 4);
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 512, .. ProptestConfig::default() })]

    #[test]
    fn replaying_a_sequence_gives_the_same_hash(commands in proptest::collection::vec(arb_command(), 0..80)) {
        let (a, ra) = run(&commands);
        let (b, rb) = run(&commands);
        prop_assert_eq!(a.state_hash(), b.state_hash());
        prop_assert_eq!(ra, rb);
        prop_assert_eq!(a, b);
    }

    #[test]
    fn no_gpu_is_held_by_two_jobs_outside_a_declared_pair(commands in proptest::collection::vec(arb_command(), 0..80)) {
        let mut state = ClusterState::new();
        for (i, c) in commands.iter().enumerate() {
            let _ = state.apply(i as u64 + 1, &LogEntry::new(i as u64, c.clone()));
            // Build the lazy free-GPU index now and then, so the entries
            // after it keep it up to date (check_invariants compares it
            // with a fresh build).
            if i % 5 == 0 {
                let _ = state.free_gpus();
            }
            if let Err(broken) = state.check_invariants() {
                return Err(TestCaseError::fail(format!("after entry {} ({c:?}): {broken}", i + 1)));
            }
        }
    }

    #[test]
    fn acknowledged_jobs_stay_until_removed(commands in proptest::collection::vec(arb_command(), 0..80)) {
        let mut state = ClusterState::new();
        let mut acknowledged = BTreeSet::new();
        for (i, c) in commands.iter().enumerate() {
            let res = state.apply(i as u64 + 1, &LogEntry::new(i as u64, c.clone()));
            if let Ok(events) = &res {
                for e in events {
                    match e {
                        Event::JobSubmitted { job_id, .. } => { acknowledged.insert(*job_id); }
                        Event::JobRemoved { job_id } => { acknowledged.remove(job_id); }
                        _ => {}
                    }
                }
            }
            for id in &acknowledged {
                prop_assert!(state.job(*id).is_some(), "job {} vanished after entry {}", id, i + 1);
            }
        }
    }

    #[test]
    fn a_decoded_state_equals_the_live_one_indexes_included(commands in proptest::collection::vec(arb_command(), 0..80)) {
        let (live, _) = run(&commands);
        let bytes = postcard::to_allocvec(&live).expect("encodes");
        let decoded: ClusterState = postcard::from_bytes(&bytes).expect("decodes");
        prop_assert!(decoded.check_invariants().is_ok());
        let carried = postcard_carried(&live);
        prop_assert_eq!(decoded.state_hash(), carried.state_hash());
        prop_assert_eq!(&decoded, &carried);
        // And through the snapshot's protobuf (format 8).
        let decoded = ClusterState::from_snapshot_proto(live.to_snapshot_proto()).expect("decodes");
        prop_assert_eq!(decoded.state_hash(), live.state_hash());
        prop_assert_eq!(decoded, live);
    }

    /// Every client request sent twice in a row (a retry after a lost
    /// answer) ends in the same jobs and nodes as sent once, and a
    /// replica that replays the doubled log reaches the same hash.
    #[test]
    fn requests_sent_twice_end_where_requests_sent_once_do(commands in proptest::collection::vec(arb_command(), 0..60)) {
        let mut once = ClusterState::new();
        let mut twice = ClusterState::new();
        let mut index = 0;
        for (i, c) in commands.iter().enumerate() {
            let entry = requested(i as u64 * 10, c.clone(), &format!("r{i}"));
            let first = once.apply(i as u64 + 1, &entry);
            index += 1;
            prop_assert_eq!(twice.apply(index, &entry), first.clone());
            index += 1;
            let repeat = twice.apply(index, &entry);
            prop_assert_eq!(twice.answer(repeat), first);
            prop_assert!(twice.check_invariants().is_ok());
        }
        prop_assert_eq!(once.jobs(), twice.jobs());
        prop_assert_eq!(once.nodes(), twice.nodes());
        prop_assert_eq!(once.gpu_holders(), twice.gpu_holders());
        let bytes = postcard::to_allocvec(&twice).expect("encodes");
        let decoded: ClusterState = postcard::from_bytes(&bytes).expect("decodes");
        prop_assert_eq!(decoded.state_hash(), postcard_carried(&twice).state_hash());
        let decoded = ClusterState::from_snapshot_proto(twice.to_snapshot_proto()).expect("decodes");
        prop_assert_eq!(decoded.state_hash(), twice.state_hash());
        prop_assert_eq!(decoded, twice);
    }

    #[test]
    fn a_different_history_gives_a_different_hash(commands in proptest::collection::vec(arb_command(), 1..40)) {
        let (a, _) = run(&commands);
        let mut longer = commands.clone();
        longer.push(Command::submit_job(spec("extra", 1, 1)));
        let (b, _) = run(&longer);
        prop_assert_ne!(a.state_hash(), b.state_hash());
    }
}

/// A node's change updates the capacity and free-GPU indexes in place
/// (only that node's part): after each kind of node command, with jobs
/// holding GPUs on that node and across nodes and the free index built,
/// both equal indexes built afresh (`check_invariants`).
#[test]
fn a_node_change_keeps_the_gpu_indexes_equal_to_fresh_ones() {
    use keel_state::fixtures::{job_spec, TestCluster};
    let gpu = |node: &str, index: u32| GpuRef {
        node: node.into(),
        index,
    };
    let v100s = |n: u32| -> Vec<Gpu> {
        (0..n)
            .map(|index| Gpu {
                index,
                gpu_type: "v100".into(),
            })
            .collect()
    };
    let mut c = TestCluster::v100_nodes(&[4, 4, 2]);
    let spanning = c.submit(job_spec("spanning", 2, 2));
    c.place(
        spanning,
        vec![gpu("n0", 0), gpu("n0", 1), gpu("n1", 0), gpu("n1", 1)],
    );
    let alone = c.submit(job_spec("alone", 1, 1));
    c.place(alone, vec![gpu("n2", 0)]);
    assert_eq!(c.state.free_gpus().total(), 5, "the free index built");
    let commands = [
        Command::mark_node_lost("n1", "unreachable"),
        Command::mark_node_recovered("n1"),
        Command::record_node_inventory(
            "n2",
            "127.0.0.1",
            vec![Gpu {
                index: 1,
                gpu_type: "k80".into(),
            }],
        ),
        Command::register_node("n3", "127.0.0.1", v100s(8)),
        Command::remove_node("n3", false),
    ];
    for command in commands {
        c.apply(command.clone());
        if let Err(e) = c.state.check_invariants() {
            panic!("after {command:?}: {e}");
        }
    }
    // n1 lost preempted the spanning job (its n0 GPUs came back too);
    // n2 lost GPU 0 (the alone job with it) and offers one k80.
    assert_eq!(c.state.free_gpus().free_of_type("v100"), 8);
    assert_eq!(c.state.free_gpus().free_of_type("k80"), 1);
    assert_eq!(c.state.capacity().total(), 9);
}

/// The jobs of an index are read by one ordered walk beside the job map
/// when the index is large (seeking past long runs of jobs not in it) and
/// by one lookup per id when it is small: either way, exactly the jobs the
/// index names, in id order.
#[test]
fn an_index_reads_the_same_jobs_walked_or_looked_up() {
    let mut state = ClusterState::new();
    let mut index = 0;
    let mut apply = |state: &mut ClusterState, command: Command| {
        index += 1;
        state
            .apply(index, &LogEntry::new(index * 10, command))
            .expect("accepted");
    };
    for _ in 0..200 {
        apply(&mut state, Command::submit_job(spec("j", 1, 1)));
    }
    let unfinished_by_scan = |state: &ClusterState| -> Vec<JobId> {
        state
            .jobs()
            .values()
            .filter(|j| !j.state.is_terminal())
            .map(|j| j.id)
            .collect()
    };
    let unfinished_read =
        |state: &ClusterState| -> Vec<JobId> { state.unfinished_jobs().map(|j| j.id).collect() };
    // A long run ended (sought past), then short gaps (walked).
    for job_id in (1..=60).chain((61..=200).filter(|id| id % 3 == 0)) {
        apply(&mut state, Command::cancel_job(job_id, String::new()));
    }
    let walked = unfinished_read(&state);
    assert_eq!(walked.len(), 94, "the large index is walked");
    assert_eq!(walked, unfinished_by_scan(&state));
    assert_eq!(state.unfinished_jobs().size_hint(), (94, Some(94)));
    // Few left: looked up one by one.
    for job_id in (61..=190).filter(|id| id % 3 != 0) {
        apply(&mut state, Command::cancel_job(job_id, String::new()));
    }
    let looked_up = unfinished_read(&state);
    assert_eq!(looked_up, vec![191, 193, 194, 196, 197, 199, 200]);
    assert_eq!(looked_up, unfinished_by_scan(&state));
    state.check_invariants().expect("invariants");
}

#[test]
fn secrets_are_put_used_by_their_owners_jobs_kept_while_used_and_snapshotted_sealed() {
    use keel_state::secret::{SealedValue, SecretError, SecretRef};
    let mut h = Harness::new();
    h.node("n0", 2);
    let before = h.state.state_hash();
    let sealed = |byte: u8| SealedValue {
        key_id: "k0123".into(),
        nonce: vec![byte; 24],
        ciphertext: vec![byte; 40],
    };
    // Entries with an actor, as the API proposes them.
    let as_actor = |h: &mut Harness, actor: &str, command: Command| {
        h.index += 1;
        let mut entry = LogEntry::new(1000 * h.index, command);
        entry.actor = Some(actor.into());
        let decoded = decode_entry(&encode_entry(&entry)).expect("round trip");
        assert_eq!(decoded, entry);
        let res = h.state.apply(h.index, &entry);
        h.state.check_invariants().expect("invariants");
        res
    };
    let put = |name: &str, queue: &str| {
        Command::put_secret(name, [("api_key".to_string(), sealed(1))].into(), queue)
    };
    assert_eq!(
        as_actor(&mut h, "token:alice", put("tracker", "")),
        Ok(vec![Event::SecretPut {
            name: "tracker".into(),
            keys: vec!["api_key".into()],
            revision: 1
        }])
    );
    assert_ne!(h.state.state_hash(), before, "secrets are hashed");
    assert!(!h.state.postcard_carries_whole(), "postcard has no secrets");
    let mut uses = spec("train", 1, 1);
    uses.secret_env.insert(
        "WANDB_API_KEY".into(),
        SecretRef {
            name: "tracker".into(),
            key: "api_key".into(),
        },
    );
    // Another user's job may not use it; its owner's may.
    let refused = as_actor(&mut h, "token:bob", Command::submit_job(uses.clone()));
    assert!(
        matches!(&refused, Err(ApplyError::Secret(SecretError::NotYours { field, .. })) if field == "env.WANDB_API_KEY"),
        "{refused:?}"
    );
    let mut wrong_key = uses.clone();
    wrong_key.secret_env.insert(
        "OTHER".into(),
        SecretRef {
            name: "tracker".into(),
            key: "nope".into(),
        },
    );
    assert!(matches!(
        as_actor(&mut h, "token:alice", Command::submit_job(wrong_key)),
        Err(ApplyError::Secret(SecretError::UnknownKey { .. }))
    ));
    let events =
        as_actor(&mut h, "token:alice", Command::submit_job(uses)).expect("the owner's job");
    let Some(Event::JobSubmitted { job_id, .. }) = events.first() else {
        panic!("{events:?}")
    };
    let job_id = *job_id;
    assert_eq!(
        h.state
            .job(job_id)
            .map(|j| j.spec.secret_env["WANDB_API_KEY"].to_string()),
        Some("tracker/api_key".into())
    );
    // A secret for a queue's jobs.
    h.apply(Command::create_queue(
        "team-a",
        keel_state::queue::QueueSpec::with_quota([("v100".to_string(), 1)].into()),
    ))
    .expect("queue");
    as_actor(&mut h, "token:root", put("shared", "team-a")).expect("put for a queue");
    let mut in_team = spec("team-job", 1, 1);
    in_team.queue = "team-a".into();
    in_team.secret_env.insert(
        "TOKEN".into(),
        SecretRef {
            name: "shared".into(),
            key: "api_key".into(),
        },
    );
    as_actor(&mut h, "token:bob", Command::submit_job(in_team)).expect("the queue's job");
    // Kept while a job that uses it is unfinished.
    assert!(matches!(
        h.apply(Command::delete_secret("tracker")),
        Err(ApplyError::Secret(SecretError::InUse { jobs: 1, .. }))
    ));
    // Snapshots carry the sealed values and the references, same hash.
    let back = ClusterState::from_snapshot_proto(h.state.to_snapshot_proto()).expect("decodes");
    assert_eq!(back.state_hash(), h.state.state_hash());
    assert_eq!(back.secrets(), h.state.secrets());
    assert_eq!(
        back.job(job_id).map(|j| &j.spec.secret_env),
        h.state.job(job_id).map(|j| &j.spec.secret_env)
    );
    h.apply(Command::cancel_job(job_id, String::new()))
        .expect("cancelled");
    assert_eq!(
        h.apply(Command::delete_secret("tracker")),
        Ok(vec![Event::SecretDeleted {
            name: "tracker".into()
        }])
    );
    assert!(h.state.secrets().get("tracker").is_none());
}

/// The waiting jobs come higher priority first, then in submission order,
/// without the jobs holding GPUs or the ended ones: FIFO's order, kept as
/// an index so that a round reads only as far as it gets.
#[test]
fn the_waiting_jobs_come_by_priority_then_submission_without_the_running_or_ended() {
    let mut c = fixtures::TestCluster::v100_nodes(&[1]);
    let mut ids = Vec::new();
    for (name, priority) in [
        ("low", 0),
        ("high", 5),
        ("low2", 0),
        ("high2", 5),
        ("mid", 1),
    ] {
        let mut s = spec(name, 1, 1);
        s.priority = priority;
        ids.push(c.submit(s));
    }
    let order = |c: &fixtures::TestCluster| -> Vec<String> {
        c.state
            .waiting_jobs_by_priority()
            .map(|j| j.spec.name.clone())
            .collect()
    };
    assert_eq!(order(&c), ["high", "high2", "mid", "low", "low2"]);
    c.place(ids[1], vec![gpu("n0", 0)]);
    c.apply(Command::cancel_job(ids[4], "not needed"));
    assert_eq!(order(&c), ["high2", "low", "low2"]);
    // Preempted, it waits again in its place.
    c.place(ids[1], Vec::new());
    assert_eq!(order(&c), ["high", "high2", "low", "low2"]);
    assert_eq!(c.state.queued_count(), 4);
    c.state.check_invariants().expect("indexes agree");
}
