//! Fixture tests for the elastic policies: small clusters, allocations
//! worked out by hand from each policy's rule (the arithmetic is in the
//! comments), checked as worker counts per job.

use std::collections::BTreeMap;

use keel_scheduling::policy::{by_name, QueueOptions, SchedulingInput};
use keel_state::fixtures::{job_spec, TestCluster};
use keel_state::*;

/// One node of v100s (the shared [`TestCluster`]) and the elastic
/// policies' view of it.
struct World(TestCluster);

impl World {
    fn new(v100s: u32) -> World {
        World(TestCluster::v100_nodes(&[v100s]))
    }

    /// Submits a job of `gpus` GPUs per worker, `min..=max` workers.
    fn submit(&mut self, model: &str, gpus: u32, min: u32, max: u32, steps: u64) -> JobId {
        let mut spec = job_spec(model, gpus, min);
        spec.workers.max = max;
        spec.model = Some(model.into());
        spec.total_steps = Some(steps);
        self.0.submit(spec)
    }

    /// Workers per job in `policy`'s plan.
    fn plan(&self, policy: &str) -> BTreeMap<JobId, usize> {
        let policy = by_name(policy, QueueOptions::default()).expect("known");
        let plan = policy.plan(&SchedulingInput::everyone(&self.0.state, self.0.index));
        plan.placements
            .iter()
            .map(|(id, gpus)| {
                let per = self.0.state.job(*id).expect("job").spec.gpus as usize;
                (*id, gpus.len() / per)
            })
            .collect()
    }
}

fn sizes(pairs: &[(JobId, usize)]) -> BTreeMap<JobId, usize> {
    pairs.iter().copied().collect()
}

#[test]
fn elastic_fifo_gives_minimums_in_order_then_one_more_worker_round_robin() {
    let mut w = World::new(4);
    let a = w.submit("resnet50", 1, 1, 4, 1000);
    let b = w.submit("resnet50", 1, 1, 4, 1000);
    let c = w.submit("resnet50", 1, 1, 4, 1000);
    // Minimums: a, b, c get 1 each (1 left); round-robin: a gets it.
    assert_eq!(w.plan("elastic_fifo"), sizes(&[(a, 2), (b, 1), (c, 1)]));
    // A job whose minimum no longer fits is passed over, not waited for.
    let mut w = World::new(4);
    let a = w.submit("resnet50", 1, 1, 1, 1000);
    let big = w.submit("resnet50", 4, 1, 1, 1000);
    let d = w.submit("resnet50", 1, 1, 4, 1000);
    assert_eq!(w.plan("elastic_fifo"), sizes(&[(a, 1), (d, 3)]));
    let _ = big;
}

#[test]
fn elastic_srjf_hands_out_in_order_of_remaining_time() {
    let mut w = World::new(3);
    let long = w.submit("resnet50", 1, 1, 4, 1_000_000);
    let short = w.submit("resnet50", 1, 1, 4, 1_000);
    // Order: short, long. Minimums 1 + 1; the third GPU goes to short.
    assert_eq!(w.plan("elastic_srjf"), sizes(&[(short, 2), (long, 1)]));
}

#[test]
fn elastic_tiresias_gives_spare_gpus_by_marginal_speedup() {
    let mut w = World::new(4);
    // resnet50 keeps 0.92 of linear speed-up per doubling, recommendation
    // only 0.7: speedup(2) − speedup(1) is 0.84 against 0.40; then
    // speedup(3) − speedup(2) = 3·0.92^log2(3) − 1.84 = 0.789 > 0.40.
    let rec = w.submit("recommendation", 1, 1, 4, 1000);
    let resnet = w.submit("resnet50", 1, 1, 4, 1000);
    assert_eq!(w.plan("elastic_tiresias"), sizes(&[(rec, 1), (resnet, 3)]));
}

#[test]
fn ffdl_maximises_the_total_speedup() {
    let mut w = World::new(4);
    // Two spare GPUs: resnet +2 gives 2.629 + 1 = 3.629; +1 each gives
    // 1.84 + 1.40 = 3.24; recommendation +2 gives 1 + 1.706 = 2.706.
    let rec = w.submit("recommendation", 1, 1, 4, 1000);
    let resnet = w.submit("resnet50", 1, 1, 4, 1000);
    assert_eq!(w.plan("ffdl_optimizer"), sizes(&[(rec, 1), (resnet, 3)]));
    // With a 2-GPU worker the programme counts GPUs, not workers: the
    // spare 2 GPUs make one more 2-GPU worker (speed-up 1.84) rather than
    // two 1-GPU workers for recommendation (+0.706).
    let mut w = World::new(6);
    let rec = w.submit("recommendation", 1, 1, 4, 1000);
    let pair = w.submit("resnet50", 2, 1, 3, 1000);
    // Minimums: 1 + 2 GPUs, 3 spare. Options: pair +1 worker (2 GPUs,
    // speed-up(4 GPUs)/speed-up(2) − 1 = 3.386/1.84 − 1 = 0.84) and rec +1
    // (0.40): 1.24; rec +3 alone: 4·0.7² − 1 = 0.96; pair +1 alone: 0.84.
    // Best: pair 2 workers, rec 2 workers.
    assert_eq!(w.plan("ffdl_optimizer"), sizes(&[(rec, 2), (pair, 2)]));
}

#[test]
fn afs_l_starts_short_jobs_first_then_weighs_relative_gains() {
    let mut w = World::new(4);
    let short = w.submit("resnet50", 1, 1, 4, 1_000);
    let long = w.submit("resnet50", 1, 1, 4, 1_000_000);
    // Grant 1: short (waiting, shortest). Grant 2: long is waiting, its
    // gain 1 beats short's (1.84 − 1)/1 = 0.84. Grant 3: long's
    // (1.84 − 1)/1.84 = 0.457 < short's 0.84: short. Grant 4: short's
    // (2.629 − 1.84)/1.84 = 0.429 < long's 0.457: long.
    assert_eq!(w.plan("afs_l"), sizes(&[(short, 2), (long, 2)]));
}

#[test]
fn drf_fills_the_smallest_share_first() {
    let mut w = World::new(6);
    let pair = w.submit("resnet50", 2, 1, 2, 1000);
    let single = w.submit("resnet50", 1, 1, 4, 1000);
    // Minimums: pair 2 GPUs, single 1 (3 left). Single has the smaller
    // share and takes one (2 GPUs each); on the tie the earlier job, pair,
    // takes its next worker (2 GPUs): nothing is left.
    assert_eq!(w.plan("drf"), sizes(&[(pair, 2), (single, 2)]));
    // One GPU more and single gets it (3 GPUs against pair's 4).
    let mut w = World::new(7);
    let pair = w.submit("resnet50", 2, 1, 2, 1000);
    let single = w.submit("resnet50", 1, 1, 4, 1000);
    assert_eq!(w.plan("drf"), sizes(&[(pair, 2), (single, 3)]));
}

#[test]
fn optimus_grants_workers_where_they_save_the_most_time() {
    let mut w = World::new(4);
    let short = w.submit("resnet50", 1, 1, 4, 10_000);
    let long = w.submit("resnet50", 1, 1, 4, 100_000);
    // Same model, ten times the steps: a worker saves ten times as much
    // time on the long job. Spare 2 GPUs: long 1→2 saves R·(1 − 1/1.84);
    // then long 2→3 saves 10·R_s·(0.543 − 0.380) = 1.63 R_s > short 1→2's
    // 0.457 R_s.
    assert_eq!(w.plan("optimus"), sizes(&[(short, 1), (long, 3)]));
}

#[test]
fn elastic_policies_shrink_a_running_job_for_a_new_one() {
    for policy in ["elastic_fifo", "elastic_srjf", "elastic_tiresias", "drf"] {
        let mut w = World::new(4);
        let a = w.submit("resnet50", 1, 1, 4, 100_000);
        let c = &mut w.0;
        let plan = by_name(policy, QueueOptions::default())
            .expect("known")
            .plan(&SchedulingInput::everyone(&c.state, c.index));
        let changes = plan.changes(&c.state);
        let based_on = c.index;
        c.apply(Command::decide_allocation(based_on, policy, 1, changes));
        assert_eq!(c.state.job(a).map(Job::worker_count), Some(4), "{policy}");
        let b = w.submit("resnet50", 1, 1, 1, 100_000);
        let after = w.plan(policy);
        assert_eq!(after.get(&b), Some(&1), "{policy}: the new job runs");
        assert_eq!(after.get(&a), Some(&3), "{policy}: the elastic job shrinks");
    }
}
