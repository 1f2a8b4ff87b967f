//! Where a job's workers go: gang placement on the state's free-GPU index
//! ([`FreeGpus`]).
//!
//! Pure and deterministic: ordered maps only, ties broken by name. Policies
//! decide *which* jobs run and with how many workers; this module decides
//! *which GPUs* they get.
//!
//! Rules, in order:
//! - a worker is one process on one node, so its GPUs are on one node;
//! - all of a job's GPUs are of one type (synchronous training runs at the
//!   pace of the slowest worker);
//! - preferred types first, then the type with the most free GPUs;
//! - a gang that fits on one node goes to the node where it fits most
//!   tightly (least fragmentation); a larger one fills the emptiest nodes
//!   first (fewest nodes, least cross-node traffic).

use std::collections::BTreeMap;

use keel_state::model::GpuRef;
use keel_state::spec::JobSpec;
use keel_state::state::ClusterState;

pub use keel_state::free_gpus::FreeGpus;

/// Gang placement on a free-GPU index.
pub trait Placement {
    /// The GPU types a job may use, in the order placement tries them.
    fn types_for(&self, spec: &JobSpec) -> Vec<String>;

    /// Places `workers` workers of `spec.gpus` GPUs each, all of one type,
    /// without changing `self`. `None` when they do not fit.
    fn place(&self, spec: &JobSpec, workers: u32) -> Option<Vec<GpuRef>>;

    /// Places `workers` more workers of `per_worker` GPUs on `gpu_type`,
    /// on the `near` nodes first (a growing job's own), then the roomiest.
    /// `None` when they do not fit; `self` is unchanged.
    fn place_near(
        &self,
        gpu_type: &str,
        per_worker: u32,
        workers: u32,
        near: &std::collections::BTreeSet<String>,
    ) -> Option<Vec<GpuRef>>;
}

impl Placement for FreeGpus {
    fn types_for(&self, spec: &JobSpec) -> Vec<String> {
        candidate_types(self, spec)
    }

    fn place(&self, spec: &JobSpec, workers: u32) -> Option<Vec<GpuRef>> {
        let per_worker = spec.gpus.max(1) as usize;
        let want = per_worker.checked_mul(workers as usize)?;
        if want == 0 {
            return None;
        }
        for gpu_type in candidate_types(self, spec) {
            if let Some(gpus) = place_on_type(self, &gpu_type, per_worker, workers as usize) {
                return Some(gpus);
            }
        }
        None
    }

    fn place_near(
        &self,
        gpu_type: &str,
        per_worker: u32,
        workers: u32,
        near: &std::collections::BTreeSet<String>,
    ) -> Option<Vec<GpuRef>> {
        let per = per_worker.max(1) as usize;
        let nodes = self.nodes_of_type(gpu_type)?;
        let mut order: Vec<(&String, &Vec<u32>)> = nodes.iter().collect();
        order.sort_by_key(|(name, free)| {
            (!near.contains(*name), std::cmp::Reverse(free.len() / per))
        });
        let mut left = workers as usize;
        let mut gpus = Vec::with_capacity(left * per);
        for (node, free) in order {
            if left == 0 {
                break;
            }
            let here = (free.len() / per).min(left);
            gpus.extend(free[..here * per].iter().map(|index| GpuRef {
                node: node.clone(),
                index: *index,
            }));
            left -= here;
        }
        (left == 0 && workers > 0).then(|| {
            gpus.sort();
            gpus
        })
    }
}

fn candidate_types(free: &FreeGpus, spec: &JobSpec) -> Vec<String> {
    let allowed = |t: &str| {
        spec.gpu_types.allowed.is_empty() || spec.gpu_types.allowed.iter().any(|a| a == t)
    };
    let mut order: Vec<String> = Vec::new();
    for t in &spec.gpu_types.preferred {
        if allowed(t) && free.nodes_of_type(t).is_some() && !order.contains(t) {
            order.push(t.clone());
        }
    }
    let mut rest: Vec<&String> = free
        .types()
        .filter(|t| allowed(t) && !order.contains(t))
        .collect();
    // Most free first; the map's name order breaks ties (sort is stable).
    rest.sort_by_key(|t| std::cmp::Reverse(free.free_of_type(t)));
    order.extend(rest.into_iter().cloned());
    order
}

fn place_on_type(
    free: &FreeGpus,
    gpu_type: &str,
    per_worker: usize,
    workers: usize,
) -> Option<Vec<GpuRef>> {
    let want = per_worker * workers;
    if free.free_of_type(gpu_type) < want {
        return None;
    }
    let nodes = free.nodes_of_type(gpu_type)?;
    let slots = |free: &Vec<u32>| free.len() / per_worker;
    if nodes.values().map(slots).sum::<usize>() < workers {
        return None;
    }
    fn take(node: &str, free: &[u32], count: usize) -> Vec<GpuRef> {
        free[..count]
            .iter()
            .map(|index| GpuRef {
                node: node.to_string(),
                index: *index,
            })
            .collect()
    }
    // The whole gang on one node, as tightly as possible.
    let tightest = nodes
        .iter()
        .filter(|(_, free)| free.len() >= want)
        .min_by_key(|(_, free)| free.len());
    if let Some((node, free)) = tightest {
        let mut gpus = take(node, free, want);
        gpus.sort();
        return Some(gpus);
    }
    // Across nodes, emptiest first.
    let mut by_room: Vec<(&String, &Vec<u32>)> = nodes.iter().collect();
    by_room.sort_by_key(|(_, free)| std::cmp::Reverse(slots(free)));
    let mut gpus = Vec::with_capacity(want);
    let mut left = workers;
    for (node, free) in by_room {
        if left == 0 {
            break;
        }
        let here = slots(free).min(left);
        gpus.extend(take(node, free, here * per_worker));
        left -= here;
    }
    gpus.sort();
    Some(gpus)
}

/// Why no node of `state`, however free, could run `spec`: none has an
/// allowed GPU type, none has a worker's GPUs of one type, or all of them
/// together cannot hold the minimum workers. `None` when some placement
/// exists once GPUs are free. Every registered node counts (a lost one may
/// come back); nodes that join later may change the answer, so the job
/// waits rather than being refused.
pub fn never_fits(state: &ClusterState, spec: &JobSpec) -> Option<String> {
    // GPU type → GPUs of that type on each node.
    let mut by_type: BTreeMap<&str, Vec<u32>> = BTreeMap::new();
    for node in state.nodes().values() {
        let mut counts: BTreeMap<&str, u32> = BTreeMap::new();
        for t in node.gpus.values() {
            *counts.entry(t.as_str()).or_default() += 1;
        }
        for (t, c) in counts {
            by_type.entry(t).or_default().push(c);
        }
    }
    let allowed: Vec<&str> = if spec.gpu_types.allowed.is_empty() {
        by_type.keys().copied().collect()
    } else {
        spec.gpu_types
            .allowed
            .iter()
            .map(String::as_str)
            .filter(|t| by_type.contains_key(t))
            .collect()
    };
    if allowed.is_empty() {
        return Some(if spec.gpu_types.allowed.is_empty() {
            "no node has GPUs".to_string()
        } else {
            format!(
                "no node has GPU type {}",
                spec.gpu_types.allowed.join(" or ")
            )
        });
    }
    let gpus = spec.gpus.max(1);
    let largest = allowed
        .iter()
        .flat_map(|t| by_type[t].iter().copied())
        .max()
        .unwrap_or(0);
    if largest < gpus {
        return Some(format!(
            "no node has {gpus} GPUs of type {} (the most on one node is {largest})",
            allowed.join(" or ")
        ));
    }
    let most_workers = allowed
        .iter()
        .map(|t| by_type[t].iter().map(|c| c / gpus).sum::<u32>())
        .max()
        .unwrap_or(0);
    (most_workers < spec.workers.min).then(|| {
        format!(
            "the nodes hold at most {most_workers} workers of {gpus} GPU{} of one type ({}); the job needs at least {}",
            if gpus == 1 { "" } else { "s" },
            allowed.join(" or "),
            spec.workers.min
        )
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use keel_state::command::{Command, LogEntry};
    use keel_state::fixtures::job_spec;
    use keel_state::model::Gpu;

    fn cluster(nodes: &[(&str, &[(u32, &str)])]) -> ClusterState {
        let mut s = ClusterState::new();
        for (i, (name, gpus)) in nodes.iter().enumerate() {
            let entry = LogEntry {
                at_ms: 1,
                command: Command::register_node(
                    name.to_string(),
                    "127.0.0.1",
                    gpus.iter()
                        .map(|(index, t)| Gpu {
                            index: *index,
                            gpu_type: t.to_string(),
                        })
                        .collect(),
                ),
                request_id: None,
                actor: None,
                trace_parent: None,
            };
            s.apply(i as u64 + 1, &entry).expect("register");
        }
        s
    }

    fn g(node: &str, index: u32) -> GpuRef {
        GpuRef {
            node: node.into(),
            index,
        }
    }

    /// Issue 19, item 8: a job no node can ever run says why it waits.
    #[test]
    fn a_job_no_node_can_run_says_why() {
        let s = cluster(&[
            ("a", &[(0, "v100"), (1, "v100"), (2, "k80")]),
            ("b", &[(0, "v100"), (1, "v100")]),
        ]);
        let spec = |gpus, workers, allowed: &[&str]| {
            let mut spec = job_spec("j", gpus, workers);
            spec.gpu_types.allowed = allowed.iter().map(|t| t.to_string()).collect();
            spec
        };
        assert_eq!(never_fits(&s, &spec(2, 2, &["v100"])), None);
        assert_eq!(never_fits(&s, &spec(1, 4, &[])), None, "four v100s");
        assert_eq!(
            never_fits(&s, &spec(1, 5, &[])).as_deref(),
            Some("the nodes hold at most 4 workers of 1 GPU of one type (k80 or v100); the job needs at least 5")
        );
        assert_eq!(
            never_fits(&s, &spec(1, 1, &["h100x"])).as_deref(),
            Some("no node has GPU type h100x")
        );
        assert_eq!(
            never_fits(&s, &spec(16, 1, &[])).as_deref(),
            Some("no node has 16 GPUs of type k80 or v100 (the most on one node is 2)")
        );
        assert_eq!(
            never_fits(&s, &spec(2, 3, &["v100"])).as_deref(),
            Some("the nodes hold at most 2 workers of 2 GPUs of one type (v100); the job needs at least 3")
        );
        assert_eq!(
            never_fits(&ClusterState::new(), &spec(1, 1, &[])).as_deref(),
            Some("no node has GPUs")
        );
    }

    #[test]
    fn a_small_gang_goes_where_it_fits_most_tightly() {
        let s = cluster(&[
            ("a", &[(0, "v100"), (1, "v100"), (2, "v100"), (3, "v100")]),
            ("b", &[(0, "v100"), (1, "v100")]),
        ]);
        let free = FreeGpus::of(&s);
        assert_eq!(
            free.place(&job_spec("j", 2, 1), 1),
            Some(vec![g("b", 0), g("b", 1)])
        );
        assert_eq!(
            free.place(&job_spec("j", 1, 3), 3),
            Some(vec![g("a", 0), g("a", 1), g("a", 2)])
        );
    }

    #[test]
    fn a_large_gang_spans_nodes_in_whole_workers() {
        let s = cluster(&[
            ("a", &[(0, "v100"), (1, "v100"), (2, "v100")]),
            ("b", &[(0, "v100"), (1, "v100"), (2, "v100")]),
        ]);
        let free = FreeGpus::of(&s);
        // Two workers of 2 GPUs: no node has 4, each node has one slot of 2.
        assert_eq!(
            free.place(&job_spec("j", 2, 2), 2),
            Some(vec![g("a", 0), g("a", 1), g("b", 0), g("b", 1)])
        );
        // Three workers of 2 GPUs do not fit (only two whole slots).
        assert_eq!(free.place(&job_spec("j", 2, 3), 3), None);
    }

    #[test]
    fn one_type_per_job_preferred_first_and_allowed_only() {
        let s = cluster(&[
            ("a", &[(0, "v100"), (1, "k80"), (2, "k80")]),
            ("b", &[(0, "v100")]),
        ]);
        let free = FreeGpus::of(&s);
        // No preference: the type with the most free GPUs (a tie here: name order).
        let any = job_spec("j", 1, 2);
        assert_eq!(free.place(&any, 2), Some(vec![g("a", 1), g("a", 2)]));
        let mut pref = job_spec("j", 1, 2);
        pref.gpu_types.preferred = vec!["v100".into()];
        assert_eq!(free.place(&pref, 2), Some(vec![g("a", 0), g("b", 0)]));
        let mut only = job_spec("j", 1, 3);
        only.gpu_types.allowed = vec!["v100".into()];
        assert_eq!(free.place(&only, 3), None, "never mixes types");
    }

    #[test]
    fn removed_gpus_are_not_offered_again() {
        let s = cluster(&[("a", &[(0, "v100"), (1, "v100")])]);
        let mut free = FreeGpus::of(&s);
        let first = free.place(&job_spec("j", 1, 1), 1).expect("fits");
        free.remove(&first);
        let second = free.place(&job_spec("j", 1, 1), 1).expect("fits");
        assert_ne!(first, second);
        free.remove(&second);
        assert_eq!(free.total(), 0);
        assert_eq!(free.place(&job_spec("j", 1, 1), 1), None);
    }
}
