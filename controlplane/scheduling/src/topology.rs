//! Topology-aware placement of sized jobs, with the fewest moves.
//!
//! Elastic policies decide *how many* workers each job gets
//! ([`Sizes`]); this module decides *which GPUs*, in three steps:
//!
//! 1. **Keep**: a running job keeps its GPUs when its size is unchanged; one
//!    that shrinks keeps the workers on the nodes where it has the most
//!    (releasing the scattered ones first).
//! 2. **Grow and start**, in the policy's order: a growing job adds workers
//!    on its own GPU type, on nodes it already uses first; a new job is
//!    placed as a gang (see [`crate::placement`]), at its planned size or
//!    the largest smaller one that fits.
//! 3. **Repack** when a job could not be placed although its GPU type has
//!    enough free GPUs (fragmentation): every job on that type is packed
//!    afresh onto virtual nodes, largest first, best fit (so multi-GPU jobs
//!    use as few nodes as possible), and the virtual nodes are mapped onto
//!    the physical ones by the Hungarian algorithm (Kuhn–Munkres)
//!    maximising the workers that stay where they are. Only the jobs whose
//!    GPUs actually change are restarted.
//!
//! [`migrations`] counts workers that moved to another node.

use crate::placement::Placement;
use std::collections::{BTreeMap, BTreeSet};

use pathfinding::kuhn_munkres::kuhn_munkres;
use pathfinding::matrix::Matrix;

use crate::policy::Plan;
use keel_state::model::{GpuRef, Job, JobId, NodeState};
use keel_state::state::ClusterState;

/// Workers per job, as an elastic policy decided them. A job left out (or
/// sized 0) holds no GPUs.
pub type Sizes = BTreeMap<JobId, u32>;

/// Workers per node.
fn workers_by_node(gpus: &[GpuRef], per_worker: u32) -> BTreeMap<String, u32> {
    let mut out: BTreeMap<String, u32> = BTreeMap::new();
    for rank in gpus.chunks(per_worker.max(1) as usize) {
        if let Some(g) = rank.first() {
            *out.entry(g.node.clone()).or_default() += 1;
        }
    }
    out
}

/// Workers of a job that moved to another node between two allocations:
/// those that left a node, less those a shrink removed.
pub fn migrations(before: &[GpuRef], after: &[GpuRef], per_worker: u32) -> u32 {
    let old = workers_by_node(before, per_worker);
    let new = workers_by_node(after, per_worker);
    let left: u32 = old
        .iter()
        .map(|(n, w)| w.saturating_sub(new.get(n).copied().unwrap_or(0)))
        .sum();
    let shrunk = old
        .values()
        .sum::<u32>()
        .saturating_sub(new.values().sum::<u32>());
    left.saturating_sub(shrunk)
}

/// The GPU type of a job's allocation (its first GPU's).
pub fn allocation_type<'s>(state: &'s ClusterState, gpus: &[GpuRef]) -> Option<&'s str> {
    let g = gpus.first()?;
    state
        .nodes()
        .get(&g.node)?
        .gpus
        .get(&g.index)
        .map(String::as_str)
}

/// `workers` of a job's current GPUs, keeping the nodes where it has most.
fn shrink(gpus: &[GpuRef], per_worker: u32, workers: u32) -> Vec<GpuRef> {
    let mut ranks: Vec<&[GpuRef]> = gpus.chunks(per_worker.max(1) as usize).collect();
    let by_node = workers_by_node(gpus, per_worker);
    // Most workers first, then node name; stable within a node.
    ranks.sort_by(|a, b| {
        let (na, nb) = (&a[0].node, &b[0].node);
        by_node[nb].cmp(&by_node[na]).then(na.cmp(nb))
    });
    let mut out: Vec<GpuRef> = ranks
        .into_iter()
        .take(workers as usize)
        .flatten()
        .cloned()
        .collect();
    out.sort();
    out
}

/// Places `sizes` (jobs in `order`, most important first) onto the
/// cluster's GPUs. A job whose planned size cannot be placed gets the
/// largest smaller size (down to its minimum) that can, or none.
pub fn place_sizes<'a>(state: &'a ClusterState, sizes: &Sizes, order: &[JobId]) -> Plan<'a> {
    place_sizes_of(state, |id| state.job(id), sizes, order)
}

/// [`place_sizes`], with each job's spec as `job` shows it (the
/// admission's copy, its types narrowed to those its queue may use).
pub fn place_sizes_of<'a>(
    state: &'a ClusterState,
    job: impl Fn(JobId) -> Option<&'a Job>,
    sizes: &Sizes,
    order: &[JobId],
) -> Plan<'a> {
    let mut free = state.free_gpus().clone();
    let mut plan = Plan::default();
    // The sized jobs in `order` (which may list many more): stop once all
    // are found.
    let mut jobs: Vec<(&Job, u32)> = Vec::with_capacity(sizes.len());
    let mut found = 0;
    for id in order {
        if found == sizes.len() {
            break;
        }
        let Some(w) = sizes.get(id) else { continue };
        found += 1;
        if let (Some(job), true) = (job(*id), *w > 0) {
            jobs.push((job, *w));
        }
    }
    // 1. Keep what stays.
    for (job, workers) in &jobs {
        let Some(a) = &job.allocation else { continue };
        let per = job.spec.gpus.max(1);
        let current = job.worker_count();
        let kept = if *workers >= current {
            a.gpus.clone()
        } else {
            shrink(&a.gpus, per, *workers)
        };
        plan.placements.insert(job.id, kept.into());
    }
    // Whatever running jobs no longer keep is free for the rest.
    for job in state.allocated_jobs() {
        let Some(a) = &job.allocation else { continue };
        match plan.placements.get(&job.id) {
            Some(kept) if kept.len() == a.gpus.len() => {}
            Some(kept) => {
                let dropped: Vec<GpuRef> = a
                    .gpus
                    .iter()
                    .filter(|g| !kept.contains(g))
                    .cloned()
                    .collect();
                free.release(state, &dropped);
            }
            None => free.release(state, &a.gpus),
        }
    }
    // 2. Grow and start.
    let mut unplaced: Vec<(JobId, u32)> = Vec::new();
    for (job, workers) in &jobs {
        let spec = &job.spec;
        let per = spec.gpus.max(1);
        let have = plan
            .placements
            .get(&job.id)
            .map(|kept| u32::try_from(kept.len()).unwrap_or(u32::MAX) / per);
        if have.is_some_and(|have| *workers <= have) {
            continue;
        }
        match plan.placements.get(&job.id).cloned() {
            Some(kept) => {
                let have = have.unwrap_or(0);
                let Some(gpu_type) = allocation_type(state, &kept) else {
                    continue;
                };
                let near: BTreeSet<String> = kept.iter().map(|g| g.node.clone()).collect();
                let extra = (1..=workers - have)
                    .rev()
                    .find_map(|w| free.place_near(gpu_type, per, w, &near));
                if let Some(extra) = extra {
                    free.remove(&extra);
                    let mut all = kept.into_owned();
                    all.extend(extra);
                    all.sort();
                    plan.placements.insert(job.id, all.into());
                }
            }
            None => {
                let min = spec.workers.min.min(*workers).max(1);
                let placed = (min..=*workers).rev().find_map(|w| free.place(spec, w));
                match placed {
                    Some(gpus) => {
                        free.remove(&gpus);
                        plan.placements.insert(job.id, gpus.into());
                    }
                    None => unplaced.push((job.id, *workers)),
                }
            }
        }
    }
    // 3. Repack a fragmented type for the jobs left out.
    for (job_id, workers) in unplaced {
        let Some(job) = state.job(job_id) else {
            continue;
        };
        let spec = &job.spec;
        let per = spec.gpus.max(1);
        let min = spec.workers.min.min(workers).max(1);
        for gpu_type in free.types_for(spec) {
            let fits = (min..=workers).rev().find(|w| {
                free.free_of_type(&gpu_type) >= (per * w) as usize
                    && repack(state, &plan, &gpu_type, (job_id, per, *w)).is_some()
            });
            let Some(w) = fits else { continue };
            let Some(repacked) = repack(state, &plan, &gpu_type, (job_id, per, w)) else {
                continue;
            };
            for (id, gpus) in repacked {
                if let Some(old) = plan.placements.get(&id) {
                    free.release(state, old);
                }
                free.remove(&gpus);
                plan.placements.insert(id, gpus.into());
            }
            break;
        }
    }
    plan
}

/// Packs every planned job on `gpu_type`, plus `extra` (job, GPUs per
/// worker, workers), onto that type's live nodes; `None` when they do not
/// fit. Returns the new GPUs of every job whose GPUs change.
fn repack(
    state: &ClusterState,
    plan: &Plan,
    gpu_type: &str,
    extra: (JobId, u32, u32),
) -> Option<BTreeMap<JobId, Vec<GpuRef>>> {
    // The type's nodes and their GPU indexes of that type.
    let nodes: Vec<(&String, Vec<u32>)> = state
        .nodes()
        .iter()
        .filter(|(_, n)| n.state == NodeState::Alive)
        .map(|(name, n)| {
            let idx: Vec<u32> = n
                .gpus
                .iter()
                .filter(|(_, t)| t.as_str() == gpu_type)
                .map(|(i, _)| *i)
                .collect();
            (name, idx)
        })
        .filter(|(_, idx)| !idx.is_empty())
        .collect();
    // Jobs to pack: (id, per worker, workers, current workers per node).
    let mut items: Vec<(JobId, u32, u32, BTreeMap<String, u32>)> = plan
        .placements
        .iter()
        .filter(|(_, gpus)| allocation_type(state, gpus) == Some(gpu_type))
        .filter_map(|(id, gpus)| {
            let per = state.job(*id)?.spec.gpus.max(1);
            let w = u32::try_from(gpus.len()).ok()? / per;
            Some((*id, per, w, workers_by_node(gpus, per)))
        })
        .collect();
    items.push((extra.0, extra.1, extra.2, BTreeMap::new()));
    // Largest first, then id.
    items.sort_by(|a, b| (b.1 * b.2).cmp(&(a.1 * a.2)).then(a.0.cmp(&b.0)));
    // Virtual nodes: the physical capacities, largest first.
    let mut caps: Vec<(usize, u32)> = nodes
        .iter()
        .enumerate()
        .map(|(i, (_, idx))| (i, u32::try_from(idx.len()).unwrap_or(u32::MAX)))
        .collect();
    caps.sort_by(|a, b| b.1.cmp(&a.1).then(a.0.cmp(&b.0)));
    let mut room: Vec<u32> = caps.iter().map(|c| c.1).collect();
    // virtual node → job → workers
    let mut virtual_nodes: Vec<BTreeMap<JobId, u32>> = vec![BTreeMap::new(); room.len()];
    for (id, per, workers, _) in &items {
        let want = per * workers;
        // Whole job on one virtual node, best fit.
        let best = (0..room.len())
            .filter(|v| room[*v] >= want)
            .min_by_key(|v| (room[*v], *v));
        if let Some(v) = best {
            room[v] -= want;
            virtual_nodes[v].insert(*id, *workers);
            continue;
        }
        // Otherwise across the roomiest virtual nodes, whole workers.
        let mut order: Vec<usize> = (0..room.len()).collect();
        order.sort_by_key(|v| (std::cmp::Reverse(room[*v] / per), *v));
        let mut left = *workers;
        for v in order {
            if left == 0 {
                break;
            }
            let here = (room[v] / per).min(left);
            if here > 0 {
                room[v] -= here * per;
                *virtual_nodes[v].entry(*id).or_default() += here;
                left -= here;
            }
        }
        if left > 0 {
            return None;
        }
    }
    // Hungarian: virtual node v onto physical node p, weight = GPUs that
    // stay put; infeasible pairs (v needs more than p has) weigh far less.
    let n = nodes.len();
    // GPUs each virtual node holds: its capacity less what is left.
    let used: Vec<u32> = caps.iter().zip(&room).map(|(c, r)| c.1 - r).collect();
    let per_of: BTreeMap<JobId, u32> = items.iter().map(|i| (i.0, i.1)).collect();
    let current: BTreeMap<JobId, &BTreeMap<String, u32>> =
        items.iter().map(|i| (i.0, &i.3)).collect();
    let infeasible = -(1i64 << 40);
    let weights = Matrix::from_fn(n, n, |(v, p)| {
        if used[v] as usize > nodes[p].1.len() {
            return infeasible;
        }
        virtual_nodes[v]
            .iter()
            .map(|(id, w)| {
                let here = current
                    .get(id)
                    .and_then(|c| c.get(nodes[p].0.as_str()))
                    .copied()
                    .unwrap_or(0);
                i64::from(here.min(*w) * per_of.get(id).copied().unwrap_or(1))
            })
            .sum()
    });
    let (_, assignment) = kuhn_munkres(&weights);
    if (0..n).any(|v| weights[(v, assignment[v])] == infeasible) {
        return None;
    }
    // GPU indexes: on each node, jobs keep the indexes they hold there.
    let mut out: BTreeMap<JobId, Vec<GpuRef>> = BTreeMap::new();
    for (v, jobs) in virtual_nodes.iter().enumerate() {
        let p = assignment[v];
        let (node, indexes) = &nodes[p];
        let mut taken: BTreeSet<u32> = BTreeSet::new();
        let mut wants: Vec<(JobId, usize)> = Vec::new();
        for (id, w) in jobs {
            let want = (w * per_of.get(id).copied().unwrap_or(1)) as usize;
            let mine: Vec<u32> = plan
                .placements
                .get(id)
                .map(|gpus| {
                    gpus.iter()
                        .filter(|g| &g.node == *node)
                        .map(|g| g.index)
                        .take(want)
                        .collect()
                })
                .unwrap_or_default();
            for i in &mine {
                taken.insert(*i);
            }
            let entry = out.entry(*id).or_default();
            entry.extend(mine.iter().map(|i| GpuRef {
                node: (*node).clone(),
                index: *i,
            }));
            wants.push((*id, want - mine.len()));
        }
        let mut spare = indexes.iter().filter(|i| !taken.contains(i));
        for (id, want) in wants {
            let entry = out.entry(id).or_default();
            for _ in 0..want {
                let i = spare.next()?;
                entry.push(GpuRef {
                    node: (*node).clone(),
                    index: *i,
                });
            }
        }
    }
    for gpus in out.values_mut() {
        gpus.sort();
    }
    out.retain(|id, gpus| plan.placements.get(id).map(|p| &p[..]) != Some(&gpus[..]));
    Some(out)
}

#[cfg(test)]
mod tests {
    use super::*;
    use keel_state::fixtures::{job_spec, TestCluster};

    fn g(node: &str, index: u32) -> GpuRef {
        GpuRef {
            node: node.into(),
            index,
        }
    }

    /// Submits a job of `gpus_per_worker` GPUs, `min..=max` workers, and
    /// places it on `at` (unless empty).
    fn run(c: &mut TestCluster, gpus_per_worker: u32, min: u32, max: u32, at: &[GpuRef]) -> JobId {
        let mut spec = job_spec("j", gpus_per_worker, min);
        spec.workers.max = max;
        let id = c.submit(spec);
        if !at.is_empty() {
            c.place(id, at.to_vec());
        }
        id
    }

    #[test]
    fn unchanged_jobs_keep_their_gpus_and_shrinking_ones_keep_their_largest_node() {
        let mut w = TestCluster::v100_nodes(&[4, 4]);
        let a = run(
            &mut w,
            1,
            1,
            4,
            &[g("n0", 0), g("n0", 1), g("n0", 2), g("n1", 0)],
        );
        let b = run(&mut w, 1, 1, 1, &[g("n1", 1)]);
        let sizes: Sizes = [(a, 3), (b, 1)].into_iter().collect();
        let plan = place_sizes(&w.state, &sizes, &[a, b]);
        assert_eq!(
            plan.placements[&a],
            vec![g("n0", 0), g("n0", 1), g("n0", 2)]
        );
        assert_eq!(plan.placements[&b], vec![g("n1", 1)]);
        let before = &w
            .state
            .job(a)
            .and_then(|j| j.allocation.clone())
            .expect("a")
            .gpus;
        assert_eq!(
            migrations(before, &plan.placements[&a], 1),
            0,
            "a shrink is no move"
        );
    }

    #[test]
    fn a_growing_job_adds_workers_next_to_its_own() {
        let mut w = TestCluster::v100_nodes(&[4, 4]);
        let a = run(&mut w, 1, 1, 4, &[g("n1", 0)]);
        let sizes: Sizes = [(a, 3)].into_iter().collect();
        let plan = place_sizes(&w.state, &sizes, &[a]);
        assert_eq!(
            plan.placements[&a],
            vec![g("n1", 0), g("n1", 1), g("n1", 2)]
        );
    }

    #[test]
    fn fragmentation_is_repacked_with_the_fewest_moves() {
        // Two 4-GPU nodes, each with two single-GPU jobs: 4 GPUs free, but
        // no node has 4. A 4-GPU gang needs the small jobs moved together.
        let mut w = TestCluster::v100_nodes(&[4, 4]);
        let a = run(&mut w, 1, 1, 1, &[g("n0", 0)]);
        let b = run(&mut w, 1, 1, 1, &[g("n0", 1)]);
        let c = run(&mut w, 1, 1, 1, &[g("n1", 2)]);
        let d = run(&mut w, 1, 1, 1, &[g("n1", 3)]);
        let big = run(&mut w, 4, 1, 1, &[]);
        let sizes: Sizes = [(a, 1), (b, 1), (c, 1), (d, 1), (big, 1)]
            .into_iter()
            .collect();
        let plan = place_sizes(&w.state, &sizes, &[a, b, c, d, big]);
        let gpus_of_big = &plan.placements[&big];
        assert_eq!(gpus_of_big.len(), 4);
        let nodes: BTreeSet<&str> = gpus_of_big.iter().map(|x| x.node.as_str()).collect();
        assert_eq!(nodes.len(), 1, "the gang is on one node");
        // Exactly two small jobs moved (the Hungarian mapping keeps n0's
        // pair or n1's pair in place), and nothing is double-booked.
        let moved = [a, b, c, d]
            .iter()
            .filter(|id| {
                let before = &w
                    .state
                    .job(**id)
                    .and_then(|j| j.allocation.clone())
                    .expect("runs")
                    .gpus;
                migrations(before, &plan.placements[id], 1) > 0
            })
            .count();
        assert_eq!(moved, 2);
        let all: Vec<&GpuRef> = plan.placements.values().flat_map(|p| p.iter()).collect();
        let distinct: BTreeSet<&GpuRef> = all.iter().copied().collect();
        assert_eq!(all.len(), distinct.len());
    }

    #[test]
    fn migrations_count_moved_workers_not_dropped_ones() {
        let before = [g("a", 0), g("a", 1), g("b", 0), g("b", 1)];
        assert_eq!(migrations(&before, &[g("a", 0), g("a", 1)], 1), 0);
        assert_eq!(migrations(&before, &[g("a", 0), g("c", 1)], 1), 1);
        assert_eq!(
            migrations(&before, &[g("c", 0), g("c", 1), g("c", 2), g("c", 3)], 1),
            4
        );
        assert_eq!(
            migrations(&before, &[g("a", 0), g("a", 1), g("b", 0), g("b", 1)], 2),
            0
        );
    }
}
