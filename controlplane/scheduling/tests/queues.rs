//! Queues above every policy (issue 23, items 2 and 3): admission within
//! quota and borrowing, and reclaim, for each of Keel's policies, through
//! `decide` and `apply` as the leader runs them.

use std::collections::BTreeMap;

use keel_scheduling::admission::{Admission, WaitReason};
use keel_scheduling::policy::{by_name, decide, QueueOptions, POLICY_NAMES};
use keel_state::fixtures::{job_spec, TestCluster};
use keel_state::queue::QueueSpec;
use keel_state::*;
use proptest::prelude::*;

fn quota(pairs: &[(&str, u32)]) -> BTreeMap<String, u32> {
    pairs.iter().map(|(t, n)| (t.to_string(), *n)).collect()
}

/// Two nodes of 4 v100s; queues `a` and `b` with 4 each, in cohort `c`
/// when `cohort`.
fn two_queues(cohort: bool) -> TestCluster {
    let mut c = TestCluster::v100_nodes(&[4, 4]);
    for name in ["a", "b"] {
        let mut spec = QueueSpec::with_quota(quota(&[("v100", 4)]));
        spec.cohort = cohort.then(|| "c".to_string());
        c.apply(Command::create_queue(name, spec));
    }
    c
}

fn submit(c: &mut TestCluster, queue: &str, gpus: u32) -> JobId {
    let mut spec = job_spec(&format!("{queue}-{}", c.index), gpus, 1);
    spec.queue = queue.into();
    c.submit(spec)
}

/// Runs one round of `policy` at `now_ms` and applies it; panics when
/// `apply` refuses any placement (the admission must not propose one).
fn round(c: &mut TestCluster, policy: &str, now_ms: u64) -> Vec<Event> {
    let policy = by_name(policy, QueueOptions::default()).expect("a policy");
    let Some(decision) = decide(policy.as_ref(), &c.state, now_ms) else {
        return Vec::new();
    };
    let events = c.apply(decision);
    let refused: Vec<&Event> = events
        .iter()
        .filter(|e| matches!(e, Event::PlacementRefused { .. }))
        .collect();
    assert!(refused.is_empty(), "{policy:?}: {refused:?}");
    c.state.check_invariants().expect("invariants");
    events
}

/// The jobs a round's events preempted.
fn preempted(events: &[Event]) -> Vec<JobId> {
    events
        .iter()
        .filter_map(|e| match e {
            Event::JobPreempted { job_id, .. } => Some(*job_id),
            _ => None,
        })
        .collect()
}

fn held(c: &TestCluster, queue: &str) -> u32 {
    c.state
        .queue_usage()
        .get(queue)
        .and_then(|u| u.get("v100"))
        .copied()
        .unwrap_or(0)
}

#[test]
fn a_queue_holds_its_quota_and_borrows_only_in_its_cohort_under_every_policy() {
    for policy in POLICY_NAMES.iter().chain(&["max_min_fairness", "gandiva"]) {
        for cohort in [false, true] {
            let mut c = two_queues(cohort);
            let a: Vec<JobId> = (0..3).map(|_| submit(&mut c, "a", 2)).collect();
            let b = submit(&mut c, "b", 2);
            round(&mut c, policy, 1);
            round(&mut c, policy, 2);
            round(&mut c, policy, 400_000);
            assert_eq!(held(&c, "b"), 2, "{policy}: b runs its job");
            if cohort {
                assert_eq!(held(&c, "a"), 6, "{policy}: a borrows b's unused 2");
            } else {
                assert_eq!(held(&c, "a"), 4, "{policy}: a holds its quota only");
                let admission = Admission::of(&c.state, 3);
                let waiting = c.state.job(a[2]).expect("a's third job");
                assert_eq!(
                    admission.wait_reason(waiting),
                    Some(WaitReason::OverQuota { queue: "a".into() }),
                    "{policy}"
                );
            }
            assert!(c.state.job(b).is_some_and(|j| j.allocation.is_some()));
        }
    }
}

#[test]
fn a_queue_below_its_quota_reclaims_what_a_borrower_holds_within_one_round() {
    for policy in POLICY_NAMES {
        let mut c = two_queues(true);
        // a takes the whole cluster: its 4 and b's 4, lent.
        let a: Vec<JobId> = (0..4).map(|_| submit(&mut c, "a", 2)).collect();
        round(&mut c, policy, 1);
        round(&mut c, policy, 2);
        assert_eq!(held(&c, "a"), 8, "{policy}");
        // b wants 4 of its quota back: the next round preempts a's two
        // most recently placed jobs and starts b's.
        let b1 = submit(&mut c, "b", 2);
        let b2 = submit(&mut c, "b", 2);
        let events = round(&mut c, policy, 3);
        let preempted = preempted(&events);
        assert_eq!(preempted.len(), 2, "{policy}: {events:?}");
        assert!(preempted.iter().all(|id| a.contains(id)), "{policy}");
        assert_eq!(held(&c, "b"), 4, "{policy}: b has its quota back");
        assert_eq!(held(&c, "a"), 4, "{policy}: a keeps its own quota");
        for id in [b1, b2] {
            assert!(c.state.job(id).is_some_and(|j| j.allocation.is_some()));
        }
        // And nothing more moves: a's waiting jobs are over quota.
        let again = round(&mut c, policy, 4);
        assert!(
            !again
                .iter()
                .any(|e| matches!(e, Event::JobPreempted { .. })),
            "{policy}: {again:?}"
        );
    }
}

#[test]
fn the_pool_beyond_every_quota_is_shared_by_weight() {
    // 8 GPUs, quotas of 1 each: a pool of 6, weights 1 and 2.
    let mut c = TestCluster::v100_nodes(&[4, 4]);
    for (name, weight) in [("a", 1), ("b", 2)] {
        let mut spec = QueueSpec::with_quota(quota(&[("v100", 1)]));
        spec.weight = weight;
        c.apply(Command::create_queue(name, spec));
    }
    for _ in 0..8 {
        submit(&mut c, "a", 1);
        submit(&mut c, "b", 1);
    }
    round(&mut c, "fifo", 1);
    // Each queue has its 1; the pool's 6 go 2 to a and 4 to b.
    assert_eq!((held(&c, "a"), held(&c, "b")), (3, 5));
}

#[test]
fn without_queues_admission_is_everyone() {
    let mut c = TestCluster::v100_nodes(&[2]);
    let job = c.submit(job_spec("x", 4, 1));
    let admission = Admission::of(&c.state, 1);
    assert!(!admission.is_active());
    assert!(admission.is_admitted(job));
    assert_eq!(
        admission.wait_reason(c.state.job(job).expect("job")),
        None,
        "no queue, no reason from admission"
    );
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(keel_state::fixtures::fuzz_cases()))]

    /// Whatever the queues, the jobs, their priorities and whether they
    /// may be preempted, no policy's decision is refused by `apply` (for
    /// quota, or for moving a job that may not be preempted), and the
    /// state's invariants (the queue index among them) hold.
    #[test]
    fn no_policy_proposes_what_apply_refuses_for_quota(
        quotas in prop::collection::vec((0u32..=6, any::<bool>(), 1u32..=3), 1..=3),
        jobs in prop::collection::vec((0usize..3, 1u32..=4, 1u32..=2, 0u32..=2, any::<bool>(), -1i32..=1), 1..=12),
        policy in prop::sample::select(
            POLICY_NAMES
                .iter()
                .chain(&["max_min_fairness", "max_min_fairness_packed", "gandiva", "fifo_perf"])
                .copied()
                .collect::<Vec<_>>(),
        ),
    ) {
        let mut c = TestCluster::v100_nodes(&[4, 4, 2]);
        for (i, (q, cohort, weight)) in quotas.iter().enumerate() {
            let mut spec = QueueSpec::with_quota(quota(&[("v100", *q)]));
            spec.cohort = cohort.then(|| "c".to_string());
            spec.weight = *weight;
            c.apply(Command::create_queue(format!("q{i}"), spec));
        }
        for (queue, gpus, min, extra, preemptible, priority) in &jobs {
            let mut spec = job_spec("j", *gpus, *min);
            spec.workers.max = min + extra;
            spec.preemptible = *preemptible;
            spec.priority = *priority;
            if *queue < quotas.len() {
                spec.queue = format!("q{queue}");
            }
            c.submit(spec);
        }
        for now in 1..=4 {
            round(&mut c, policy, now * 60_000);
        }
    }
}

/// Issue 23, item 4: a running job that may not be preempted keeps its
/// GPUs under every policy, whatever arrives; `apply` would refuse the
/// change (the round helper fails on any refusal).
#[test]
fn a_job_that_may_not_be_preempted_keeps_its_gpus_under_every_policy() {
    for policy in POLICY_NAMES.iter().chain(&["max_min_fairness", "gandiva"]) {
        let mut c = TestCluster::v100_nodes(&[2]);
        let mut fixed = job_spec("fixed", 2, 1);
        fixed.preemptible = false;
        let fixed = c.submit(fixed);
        round(&mut c, policy, 1);
        let before = c.state.job(fixed).and_then(|j| j.allocation.clone());
        assert!(before.is_some(), "{policy}: it runs");
        let mut urgent = job_spec("urgent", 2, 1);
        urgent.priority = 100;
        let urgent = c.submit(urgent);
        for now in [2, 400_000, 800_000] {
            let events = round(&mut c, policy, now);
            assert!(
                !events
                    .iter()
                    .any(|e| matches!(e, Event::JobPreempted { .. })),
                "{policy}: {events:?}"
            );
        }
        assert_eq!(
            c.state.job(fixed).and_then(|j| j.allocation.clone()),
            before,
            "{policy}"
        );
        assert!(c.state.job(urgent).is_some_and(|j| j.allocation.is_none()));
    }
}

#[test]
fn reclaim_passes_over_jobs_that_may_not_be_preempted() {
    // a holds the node: two preemptible jobs, then two that may not be
    // preempted, on b's lent GPUs.
    let setup = |fixed_first: bool| {
        let mut c = two_queues(true);
        let mut ids = Vec::new();
        for i in 0..4 {
            let mut spec = job_spec("a", 2, 1);
            spec.queue = "a".into();
            spec.preemptible = if fixed_first { false } else { i < 2 };
            ids.push(c.submit(spec));
            round(&mut c, "fifo", 1 + i);
        }
        assert_eq!(held(&c, "a"), 8);
        (c, ids)
    };
    // b wants 2 back: a's most recent preemptible job goes, never one
    // that may not be preempted.
    let (mut c, a) = setup(false);
    submit(&mut c, "b", 2);
    let events = round(&mut c, "fifo", 10);
    let preempted = preempted(&events);
    assert_eq!(preempted, vec![a[1]], "{events:?}");
    assert_eq!(held(&c, "b"), 2);
    // Every job of a may not be preempted: b waits, and says why.
    let (mut c, _) = setup(true);
    let b = submit(&mut c, "b", 2);
    let events = round(&mut c, "fifo", 10);
    assert!(
        !events
            .iter()
            .any(|e| matches!(e, Event::JobPreempted { .. })),
        "{events:?}"
    );
    let admission = Admission::of(&c.state, 11);
    assert_eq!(
        admission.wait_reason(c.state.job(b).expect("b's job")),
        Some(WaitReason::HeldByBorrowers { queue: "b".into() })
    );
}
