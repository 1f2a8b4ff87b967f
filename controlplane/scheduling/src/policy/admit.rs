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
/// waited for; a running job left out is preempted only when a job
/// admitted before it is placed on one of its GPUs. Jobs in retry backoff
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
    // Admitted running jobs stay where they are.
    for job in admitted.iter().filter(|j| j.state == JobState::Running) {
        if let Some(a) = &job.allocation {
            plan.placements.insert(job.id, Cow::Borrowed(&a.gpus));
        }
    }
    // The running jobs left out may lose their GPUs, but only to a more
    // important job that is placed on one of them: admission counts GPUs,
    // not where they are, and preempting a job whose GPUs no admitted job
    // can use would stop its work for nothing (and start it again a round
    // later, as the live day of issue 27 showed).
    let mut outranked: Vec<(&Job, &[keel_state::GpuRef])> = state
        .allocated_jobs()
        .filter(|j| !plan.placements.contains_key(&j.id))
        .filter_map(|j| Some((j, j.allocation.as_ref()?.gpus.as_slice())))
        .collect();
    // What is free, and what would be if every job left out let go.
    let mut free = state.free_gpus().clone();
    let mut free_if_preempted: Option<keel_state::free_gpus::FreeGpus> = None;
    // Then the waiting ones, most important first.
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
            for (_, gpus) in &outranked {
                all.release(state, gpus);
            }
            all
        });
        let Some(gpus) = all.place(spec, workers) else {
            continue;
        };
        all.remove(&gpus);
        // The jobs left out that held one of them lose all of theirs (and
        // a job sharing one of those with them, its own); the rest of what
        // they held is free for the jobs after this one.
        let mut lost: Vec<keel_state::GpuRef> = gpus.clone();
        loop {
            let before = outranked.len();
            outranked.retain(|(_, held)| {
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
    // The jobs left out whose GPUs no one took keep running.
    for (job, gpus) in outranked {
        plan.placements.insert(job.id, Cow::Borrowed(gpus));
    }
    plan
}
