//! Admission in priority order, shared by the preemptive queue policies
//! (`srjf`, `tiresias`): the most important jobs run, a job that cannot
//! be placed is passed over for the ones after it, and a running job loses
//! its GPUs only to a more important job placed on one of them.

use crate::placement::Placement;
use std::borrow::Cow;
use std::collections::{BTreeMap, BTreeSet};

use keel_state::free_gpus::FreeGpus;
use keel_state::model::{GpuRef, Job, JobId};

use super::{Plan, SchedulingInput};

/// Plans `order` (unfinished jobs as the round sees them, most important
/// first; read only until the cluster's GPUs are all handed out). A
/// running job keeps its GPUs and size when the order reaches it, unless
/// a more important job took one of them before. A waiting job gets its
/// minimum workers on free GPUs, else on free GPUs and those of running
/// jobs the order has not reached yet, which are then preempted (every
/// GPU of each, and of a job sharing one with it); a job that fits neither
/// is passed over, not waited for, and the jobs after it may take the
/// GPUs it could not use. Running jobs never reached keep their GPUs: no
/// job is preempted for nothing. Jobs in retry backoff at `now_ms` and
/// jobs the whole cluster could not hold are skipped.
pub(crate) fn admit_in_order<'a>(
    input: &SchedulingInput<'a>,
    order: impl IntoIterator<Item = &'a Job>,
) -> Plan<'a> {
    let (state, now_ms) = (input.state, input.now_ms);
    let capacity = state.capacity();
    // GPUs not yet kept or handed out by this plan.
    let mut budget = capacity.total();
    // Whether a shape (GPUs per worker, minimum workers, allowed types)
    // fits the whole cluster, worked out once per shape; and the shapes
    // that found no place this round (what they could take only shrinks
    // as the order goes on, so they find none later either).
    type Shape<'s> = (u32, u32, &'s [String]);
    let mut fits_cluster: BTreeMap<Shape<'_>, bool> = BTreeMap::new();
    let mut no_place: BTreeSet<Shape<'_>> = BTreeSet::new();
    let mut plan = Plan::default();
    // Running jobs the order has not reached: more important jobs may take
    // their GPUs. A job that may not be preempted keeps its own from the
    // start (`keep_unpreemptible` would undo a placement on them).
    let mut unreached: BTreeMap<JobId, &'a [GpuRef]> = BTreeMap::new();
    for job in state.allocated_jobs() {
        let Some(a) = &job.allocation else { continue };
        if job.spec.preemptible {
            unreached.insert(job.id, &a.gpus);
        } else {
            budget = budget.saturating_sub(a.gpus.len());
            plan.placements.insert(job.id, Cow::Borrowed(&a.gpus));
        }
    }
    let mut free = state.free_gpus().clone();
    // `free` and every unreached job's GPUs, made when first needed.
    let mut free_if_preempted: Option<FreeGpus> = None;
    for job in order {
        if budget == 0 {
            break;
        }
        if job.state.is_terminal() || job.backing_off(now_ms) {
            continue;
        }
        if job.allocation.is_some() {
            // Reached: it keeps what it holds (unless a more important job
            // took it, and it is no longer among the unreached).
            if let Some(gpus) = unreached.remove(&job.id) {
                if let Some(all) = &mut free_if_preempted {
                    all.remove(gpus);
                }
                budget = budget.saturating_sub(gpus.len());
                plan.placements.insert(job.id, Cow::Borrowed(gpus));
            }
            continue;
        }
        let spec = &job.spec;
        let workers = spec.workers.min;
        let shape = (spec.gpus, workers, spec.gpu_types.allowed.as_slice());
        let fits = *fits_cluster
            .entry(shape)
            .or_insert_with(|| capacity.place(spec, workers).is_some());
        let need = (spec.gpus * workers) as usize;
        if !fits || need > budget || no_place.contains(&shape) {
            continue;
        }
        if let Some(gpus) = free.place(spec, workers) {
            free.remove(&gpus);
            if let Some(all) = &mut free_if_preempted {
                all.remove(&gpus);
            }
            budget -= need;
            plan.placements.insert(job.id, gpus.into());
            continue;
        }
        let all = free_if_preempted.get_or_insert_with(|| {
            let mut all = free.clone();
            for gpus in unreached.values() {
                all.release(state, gpus);
            }
            all
        });
        let Some(gpus) = all.place(spec, workers) else {
            no_place.insert(shape);
            continue;
        };
        all.remove(&gpus);
        // The unreached jobs holding one of them lose all of theirs (and a
        // job sharing one of those, its own); what is left of it is free
        // for the jobs after this one.
        let mut lost: Vec<GpuRef> = gpus.clone();
        loop {
            let before = unreached.len();
            unreached.retain(|_, held| {
                let taken = held.iter().any(|g| lost.contains(g));
                if taken {
                    free.release(state, held);
                    lost.extend(held.iter().cloned());
                }
                !taken
            });
            if unreached.len() == before {
                break;
            }
        }
        free.remove(&gpus);
        budget -= need;
        plan.placements.insert(job.id, gpus.into());
    }
    // The running jobs never reached keep running.
    for (id, gpus) in unreached {
        plan.placements.insert(id, Cow::Borrowed(gpus));
    }
    plan
}
