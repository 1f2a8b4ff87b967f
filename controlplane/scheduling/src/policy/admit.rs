//! Admission in priority order, shared by the preemptive queue policies
//! (`srjf`, `tiresias`): the most important jobs run, the rest wait, and a
//! running job that is no longer among the most important loses its GPUs.

use crate::placement::Placement;
use std::borrow::Cow;
use std::collections::BTreeMap;

use keel_state::model::{Job, JobState};

use super::{Plan, SchedulingInput};

/// Plans `order` (unfinished jobs as the round sees them, most important
/// first; read only until the cluster's GPUs are all handed out): each job
/// gets its minimum workers while GPUs last (a running job keeps its
/// current GPUs and size); a job that does not fit is passed over, not
/// waited for; running jobs left out are preempted. Jobs in retry backoff
/// at `now_ms` and jobs the whole cluster could not hold are skipped.
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
    let mut admitted: Vec<&Job> = Vec::new();
    for job in order {
        if budget == 0 {
            break;
        }
        if job.state.is_terminal() || job.backing_off(now_ms) {
            continue;
        }
        let need = match &job.allocation {
            Some(a) => a.gpus.len(),
            None => {
                let spec = &job.spec;
                let shape = (
                    spec.gpus,
                    spec.workers.min,
                    spec.gpu_types.allowed.as_slice(),
                );
                let fits = *fits_cluster
                    .entry(shape)
                    .or_insert_with(|| capacity.place(spec, spec.workers.min).is_some());
                if !fits {
                    continue;
                }
                (spec.gpus * spec.workers.min) as usize
            }
        };
        if need > budget {
            continue;
        }
        budget -= need;
        admitted.push(job);
    }
    let mut plan = Plan::default();
    // Admitted running jobs stay where they are; the others give their
    // GPUs back.
    for job in admitted.iter().filter(|j| j.state == JobState::Running) {
        if let Some(a) = &job.allocation {
            plan.placements.insert(job.id, Cow::Borrowed(&a.gpus));
        }
    }
    let mut free = state.free_gpus().clone();
    for job in state.allocated_jobs() {
        if let (Some(a), false) = (&job.allocation, plan.placements.contains_key(&job.id)) {
            free.release(state, &a.gpus);
        }
    }
    // Then the waiting ones, most important first.
    for job in admitted.iter().filter(|j| j.allocation.is_none()) {
        if let Some(gpus) = free.place(&job.spec, job.spec.workers.min) {
            free.remove(&gpus);
            plan.placements.insert(job.id, gpus.into());
        }
    }
    plan
}
