//! Admission in priority order, shared by the preemptive queue policies
//! (`srjf`, `tiresias`): the most important jobs run, and a running job
//! that is no longer among them loses its GPUs when one of them is placed
//! on one; what no admitted job can use goes to the jobs after them.

use crate::placement::Placement;
use std::borrow::Cow;
use std::collections::BTreeMap;

use keel_state::free_gpus::FreeGpus;
use keel_state::model::{GpuRef, Job, JobId, JobState};

use super::{Plan, SchedulingInput};

/// Jobs past the admitted ones that a round reads for free GPUs no
/// admitted job could use (backfill), as a batch scheduler bounds its
/// backfill scan: a round of a cluster where thousands wait does not read
/// them all.
pub const BACKFILL_WINDOW: usize = 512;

/// Plans `order` (unfinished jobs as the round sees them, most important
/// first). Admission reads it until the cluster's GPUs are all counted:
/// each job counts its minimum workers' GPUs (a running job, its current
/// ones); a job the rest of the count cannot hold is passed over. Admitted
/// running jobs keep their GPUs. Each admitted waiting job is placed on
/// free GPUs, else on free GPUs and those of running jobs admission left
/// out, and only the jobs left out that hold one of them are preempted
/// (every GPU of each, and of a job sharing one with it): the others keep
/// running, since admission counts GPUs, not where they are. Then the
/// next [`BACKFILL_WINDOW`] jobs of the order may start on what is still
/// free, preempting nothing. Jobs in retry backoff at `now_ms` and jobs
/// the whole cluster could not hold are skipped.
pub(crate) fn admit_in_order<'a>(
    input: &SchedulingInput<'a>,
    order: impl IntoIterator<Item = &'a Job>,
) -> Plan<'a> {
    let (state, now_ms) = (input.state, input.now_ms);
    let capacity = state.capacity();
    let mut budget = capacity.total();
    // Whether a shape (GPUs per worker, minimum workers, allowed types)
    // fits the whole cluster, worked out once per shape.
    let mut fits_cluster: BTreeMap<(u32, u32, &[String]), bool> = BTreeMap::new();
    let mut fits = |job: &'a Job| {
        let spec = &job.spec;
        let shape = (
            spec.gpus,
            spec.workers.min,
            spec.gpu_types.allowed.as_slice(),
        );
        *fits_cluster
            .entry(shape)
            .or_insert_with(|| capacity.place(spec, spec.workers.min).is_some())
    };
    let mut order = order.into_iter();
    let mut admitted: Vec<&Job> = Vec::new();
    if budget > 0 {
        for job in order.by_ref() {
            if job.state.is_terminal() || job.backing_off(now_ms) {
                continue;
            }
            let need = match &job.allocation {
                Some(a) => a.gpus.len(),
                None if fits(job) => (job.spec.gpus * job.spec.workers.min) as usize,
                None => continue,
            };
            if need > budget {
                continue;
            }
            budget -= need;
            admitted.push(job);
            if budget == 0 {
                break;
            }
        }
    }
    let mut plan = Plan::default();
    // Admitted running jobs stay where they are.
    for job in admitted.iter().filter(|j| j.state == JobState::Running) {
        if let Some(a) = &job.allocation {
            plan.placements.insert(job.id, Cow::Borrowed(&a.gpus));
        }
    }
    // The running jobs left out, which an admitted job may displace (a job
    // that may not be preempted never is: `keep_unpreemptible` would undo
    // a placement on its GPUs).
    let mut outranked: BTreeMap<JobId, &'a [GpuRef]> = BTreeMap::new();
    for job in state.allocated_jobs() {
        let Some(a) = &job.allocation else { continue };
        if plan.placements.contains_key(&job.id) {
            continue;
        }
        if job.spec.preemptible {
            outranked.insert(job.id, &a.gpus);
        } else {
            plan.placements.insert(job.id, Cow::Borrowed(&a.gpus));
        }
    }
    let mut free = state.free_gpus().clone();
    // `free` and the GPUs of every job left out, made when first needed.
    let mut free_if_preempted: Option<FreeGpus> = None;
    for job in admitted.iter().filter(|j| j.allocation.is_none()) {
        let (spec, workers) = (&job.spec, job.spec.workers.min);
        if let Some(gpus) = free.place(spec, workers) {
            free.remove(&gpus);
            if let Some(all) = &mut free_if_preempted {
                all.remove(&gpus);
            }
            plan.placements.insert(job.id, gpus.into());
            continue;
        }
        if outranked.is_empty() {
            continue;
        }
        let all = free_if_preempted.get_or_insert_with(|| {
            let mut all = free.clone();
            for gpus in outranked.values() {
                all.release(state, gpus);
            }
            all
        });
        let Some(gpus) = all.place(spec, workers) else {
            continue;
        };
        all.remove(&gpus);
        // The jobs left out that hold one of them lose all of theirs (and
        // a job sharing one of those, its own); the rest of what they held
        // is free for the jobs after this one.
        let mut lost: Vec<GpuRef> = gpus.clone();
        loop {
            let before = outranked.len();
            outranked.retain(|_, held| {
                let taken = held.iter().any(|g| lost.contains(g));
                if taken {
                    free.release(state, held);
                    lost.extend(held.iter().cloned());
                }
                !taken
            });
            if outranked.len() == before {
                break;
            }
        }
        free.remove(&gpus);
        plan.placements.insert(job.id, gpus.into());
    }
    // The jobs left out whose GPUs no admitted job took keep running.
    for (id, gpus) in outranked {
        plan.placements.insert(id, Cow::Borrowed(gpus));
    }
    // Backfill: what is still free goes to the jobs after the admitted
    // ones, in order, preempting nothing.
    for job in order.take(BACKFILL_WINDOW) {
        if free.total() == 0 {
            break;
        }
        if job.allocation.is_some() || job.state.is_terminal() || job.backing_off(now_ms) {
            continue;
        }
        if let Some(gpus) = free.place(&job.spec, job.spec.workers.min) {
            free.remove(&gpus);
            plan.placements.insert(job.id, gpus.into());
        }
    }
    plan
}
