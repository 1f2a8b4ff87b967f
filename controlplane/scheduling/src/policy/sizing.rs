//! Building blocks of the elastic policies (Voda's family, FfDL, AFS-L,
//! DRF, Optimus): who may run, minimum sizes in an order, and handing out
//! the remaining GPUs one worker at a time. A policy composes them into
//! [`Sizes`]; [`crate::topology::place_sizes`] turns sizes into GPUs.
//!
//! Sizing counts GPUs of every type together (the budget is the cluster's
//! live GPUs); placement then keeps each job on one type and lowers a size
//! that does not fit.

use crate::placement::Placement;
use std::cmp::Ordering;
use std::collections::{BTreeMap, BinaryHeap};

use crate::topology::{place_sizes_of, Sizes};
use keel_state::model::{Job, JobId};
use keel_state::state::ClusterState;

use super::{Plan, SchedulingInput};

/// Jobs an elastic policy may size at `now_ms`: unfinished, not in retry
/// backoff, and whose minimum fits the whole cluster. Higher priority
/// first, then submission order.
pub(crate) fn candidates<'a>(input: &SchedulingInput<'a>) -> Vec<&'a Job> {
    let mut eligible = Eligible::new(input);
    super::by_priority(input.unfinished_jobs().filter(|job| eligible.check(job)))
}

/// The [`candidates`] as far as [`minimums`] reads them with the whole
/// cluster's budget, each given its minimum while GPUs last, and the GPUs
/// left. The jobs after that prefix get no size, so a policy that sizes
/// only jobs with a minimum (every elastic policy) plans the same from the
/// prefix, and a long queue is checked only as far as the cluster fills.
pub(crate) fn candidates_with_minimums<'a>(
    input: &SchedulingInput<'a>,
) -> (Vec<&'a Job>, Sizes, u32) {
    let mut eligible = Eligible::new(input);
    let mut sizes = Sizes::new();
    let mut left = budget(input.state);
    let mut prefix = Vec::new();
    for job in super::by_priority(input.unfinished_jobs()) {
        if left == 0 {
            break;
        }
        if !eligible.check(job) {
            continue;
        }
        prefix.push(job);
        left = give_minimum(job, &mut sizes, left);
    }
    (prefix, sizes, left)
}

/// Whether a job may be sized now ([`candidates`]), with whether each
/// shape fits the whole cluster worked out once.
struct Eligible<'i, 'a> {
    input: &'i SchedulingInput<'a>,
    fits: BTreeMap<(u32, u32, &'a [String]), bool>,
}

impl<'i, 'a> Eligible<'i, 'a> {
    fn new(input: &'i SchedulingInput<'a>) -> Self {
        Eligible {
            input,
            fits: BTreeMap::new(),
        }
    }

    fn check(&mut self, job: &'a Job) -> bool {
        if job.backing_off(self.input.now_ms) {
            return false;
        }
        if job.allocation.is_some() {
            // Running: it fits.
            return true;
        }
        let spec = &job.spec;
        let shape = (
            spec.gpus,
            spec.workers.min,
            spec.gpu_types.allowed.as_slice(),
        );
        let capacity = self.input.state.capacity();
        *self
            .fits
            .entry(shape)
            .or_insert_with(|| capacity.place(spec, spec.workers.min).is_some())
    }
}

/// The [`candidates`] in `order` (job ids, most important first: the
/// rankings put priority first themselves).
pub(crate) fn candidates_in<'a>(input: &SchedulingInput<'a>, order: Vec<JobId>) -> Vec<&'a Job> {
    let eligible: BTreeMap<JobId, &Job> =
        candidates(input).into_iter().map(|j| (j.id, j)).collect();
    order
        .into_iter()
        .filter_map(|id| eligible.get(&id).copied())
        .collect()
}

/// The cluster's live GPUs.
pub(crate) fn budget(state: &ClusterState) -> u32 {
    u32::try_from(state.capacity().total()).unwrap_or(u32::MAX)
}

/// GPUs per worker of `job` (at least 1).
pub(crate) fn per_worker(job: &Job) -> u32 {
    job.spec.gpus.max(1)
}

/// Gives each job in `order` its minimum while the budget lasts; a job
/// whose minimum does not fit what is left is passed over. Returns the
/// sizes and the GPUs left.
pub(crate) fn minimums(order: &[&Job], mut left: u32) -> (Sizes, u32) {
    let mut sizes = Sizes::new();
    for job in order {
        if left == 0 {
            break;
        }
        left = give_minimum(job, &mut sizes, left);
    }
    (sizes, left)
}

/// Sizes `job` at its minimum if that fits `left`; returns what is left.
fn give_minimum(job: &Job, sizes: &mut Sizes, left: u32) -> u32 {
    let need = per_worker(job).saturating_mul(job.spec.workers.min);
    if need > left {
        return left;
    }
    sizes.insert(job.id, job.spec.workers.min);
    left - need
}

/// Voda's elastic hand-out: one more worker to each sized job in `order`,
/// round after round, while any is below its maximum and GPUs remain.
pub(crate) fn round_robin(order: &[&Job], sizes: &mut Sizes, mut left: u32) -> u32 {
    loop {
        let mut gave = false;
        for job in order {
            let Some(n) = sizes.get_mut(&job.id) else {
                continue;
            };
            let per = per_worker(job);
            if *n < job.spec.workers.max && per <= left {
                *n += 1;
                left -= per;
                gave = true;
            }
        }
        if !gave {
            return left;
        }
    }
}

/// A heap entry: the gain of one more worker for a job.
#[derive(Debug, PartialEq)]
struct Offer {
    gain: f64,
    job_id: JobId,
}

impl Eq for Offer {}

impl Ord for Offer {
    fn cmp(&self, other: &Self) -> Ordering {
        // Highest gain first; ties: the earlier job.
        self.gain
            .total_cmp(&other.gain)
            .then(other.job_id.cmp(&self.job_id))
    }
}

impl PartialOrd for Offer {
    fn partial_cmp(&self, other: &Self) -> Option<Ordering> {
        Some(self.cmp(other))
    }
}

/// Greedy marginal gain: repeatedly gives one more worker to the sized job
/// whose `gain(job, workers now)` is highest, while it is positive, the job
/// is below its maximum and its worker fits what is left.
pub(crate) fn greedy<'a>(
    jobs: &[&'a Job],
    sizes: &mut Sizes,
    mut left: u32,
    mut gain: impl FnMut(&'a Job, u32) -> f64,
) -> u32 {
    let mut heap = BinaryHeap::new();
    let mut by_id: BTreeMap<JobId, &'a Job> = BTreeMap::new();
    // Only elastic jobs can grow: the others are passed over before their
    // size is looked up (most of a long queue, most rounds).
    for job in jobs
        .iter()
        .filter(|j| j.spec.workers.max > j.spec.workers.min)
    {
        if let Some(n) = sizes.get(&job.id) {
            if *n < job.spec.workers.max {
                heap.push(Offer {
                    gain: gain(job, *n),
                    job_id: job.id,
                });
                by_id.insert(job.id, job);
            }
        }
    }
    if heap.is_empty() {
        return left;
    }
    while let Some(Offer { gain: g, job_id }) = heap.pop() {
        if left == 0 || g <= 0.0 || g.is_nan() {
            break;
        }
        let (Some(job), Some(n)) = (by_id.get(&job_id), sizes.get_mut(&job_id)) else {
            continue;
        };
        let per = per_worker(job);
        if per > left {
            // Too big for what is left; smaller jobs may still fit.
            continue;
        }
        *n += 1;
        left -= per;
        if *n < job.spec.workers.max {
            let next = gain(job, *n);
            heap.push(Offer { gain: next, job_id });
        }
    }
    left
}

/// Places `sizes`, most important first as in `order`.
pub(crate) fn plan<'a>(input: &SchedulingInput<'a>, sizes: &Sizes, order: &[&Job]) -> Plan<'a> {
    let ids: Vec<JobId> = order.iter().map(|j| j.id).collect();
    place_sizes_of(input.state, |id| input.job(id), sizes, &ids)
}

#[cfg(test)]
mod tests {
    use super::*;
    use keel_state::fixtures::{job_spec, TestCluster};

    /// Sizing minimums while reading the candidates gives what sizing the
    /// whole list gives, from a prefix of it: a queue longer than the
    /// cluster, priorities, a job too big for any node, elastic jobs.
    #[test]
    fn minimums_from_the_prefix_equal_minimums_from_every_candidate() {
        let mut cluster = TestCluster::v100_nodes(&[4, 4]);
        for i in 0..30u32 {
            let gpus = if i == 3 { 16 } else { 1 + i % 3 };
            let mut spec = job_spec(&format!("j{i}"), gpus, 1);
            spec.workers.max = 1 + i % 2;
            spec.priority = i32::try_from(i % 4).expect("small");
            cluster.submit(spec);
        }
        let input = SchedulingInput::everyone(&cluster.state, 1);
        let every = candidates(&input);
        assert!(
            every.iter().all(|j| j.spec.gpus != 16),
            "the unfit job is out"
        );
        let (all_sizes, all_left) = minimums(&every, budget(input.state));
        let (prefix, sizes, left) = candidates_with_minimums(&input);
        assert_eq!((sizes, left), (all_sizes, all_left));
        assert!(prefix.len() < every.len(), "the queue is read in part");
        let ids = |jobs: &[&Job]| jobs.iter().map(|j| j.id).collect::<Vec<_>>();
        assert_eq!(ids(&prefix), ids(&every[..prefix.len()]));
    }
}
