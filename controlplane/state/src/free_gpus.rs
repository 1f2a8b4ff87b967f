//! The free-GPU index the state keeps: GPUs by type, then node, as sorted
//! indexes ([`ClusterState::capacity`] holds every GPU of a live node,
//! [`ClusterState::free_gpus`] those no job holds). Placement, which reads
//! it to decide where a job's workers go, is the scheduling crate's.

use std::collections::BTreeMap;

use crate::model::{GpuRef, NodeState};
use crate::state::ClusterState;

/// Free GPUs by type, then node, as sorted GPU indexes.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct FreeGpus {
    by_type: BTreeMap<String, BTreeMap<String, Vec<u32>>>,
    /// Free GPUs per type (kept with `by_type`).
    count_by_type: BTreeMap<String, usize>,
}

impl FreeGpus {
    /// Every GPU on a live node that no job holds (a copy of the state's
    /// index, [`ClusterState::free_gpus`]).
    pub fn of(state: &ClusterState) -> FreeGpus {
        state.free_gpus().clone()
    }

    /// Every GPU on a live node of `nodes` that no job holds, worked out
    /// afresh.
    pub(crate) fn of_holders<H>(
        nodes: &BTreeMap<String, crate::model::Node>,
        holders: &BTreeMap<GpuRef, H>,
    ) -> FreeGpus {
        let mut free = FreeGpus::default();
        for (name, node) in nodes {
            if node.state != NodeState::Alive {
                continue;
            }
            for (index, gpu_type) in &node.gpus {
                let held = holders.contains_key(&GpuRef {
                    node: name.clone(),
                    index: *index,
                });
                if !held {
                    *free.count_by_type.entry(gpu_type.clone()).or_default() += 1;
                    free.by_type
                        .entry(gpu_type.clone())
                        .or_default()
                        .entry(name.clone())
                        .or_default()
                        .push(*index);
                }
            }
        }
        free
    }

    /// Every GPU on a live node, held or not: what an empty cluster offers
    /// (a copy of the state's index, [`ClusterState::capacity`]).
    pub fn capacity(state: &ClusterState) -> FreeGpus {
        state.capacity().clone()
    }

    /// Every GPU on a live node of `nodes`.
    pub(crate) fn of_nodes(nodes: &BTreeMap<String, crate::model::Node>) -> FreeGpus {
        let mut all = FreeGpus::default();
        for (name, node) in nodes {
            if node.state != NodeState::Alive {
                continue;
            }
            for (index, gpu_type) in &node.gpus {
                *all.count_by_type.entry(gpu_type.clone()).or_default() += 1;
                all.by_type
                    .entry(gpu_type.clone())
                    .or_default()
                    .entry(name.clone())
                    .or_default()
                    .push(*index);
            }
        }
        all
    }

    /// Free GPUs of every type together.
    pub fn total(&self) -> usize {
        self.count_by_type.values().sum()
    }

    /// Free GPUs of one type.
    pub fn free_of_type(&self, gpu_type: &str) -> usize {
        self.count_by_type.get(gpu_type).copied().unwrap_or(0)
    }

    /// Free GPUs of `gpu_type` by node, as sorted indexes (`None`: none
    /// free).
    pub fn nodes_of_type(&self, gpu_type: &str) -> Option<&BTreeMap<String, Vec<u32>>> {
        self.by_type.get(gpu_type)
    }

    /// The GPU types with a free GPU, in name order.
    pub fn types(&self) -> impl Iterator<Item = &String> + '_ {
        self.by_type.keys()
    }

    /// Gives `gpus` back (they become free again); their types come from
    /// `state`'s nodes.
    pub fn release(&mut self, state: &ClusterState, gpus: &[GpuRef]) {
        for g in gpus {
            if let Some(gpu_type) = state
                .nodes()
                .get(&g.node)
                .and_then(|n| n.gpus.get(&g.index))
            {
                self.release_one(gpu_type, g);
            }
        }
    }

    /// Gives one GPU of `gpu_type` back.
    pub(crate) fn release_one(&mut self, gpu_type: &str, g: &GpuRef) {
        // Looked up by reference first: no allocation unless the type or
        // node is new to the index.
        let nodes = match self.by_type.get_mut(gpu_type) {
            Some(nodes) => nodes,
            None => self.by_type.entry(gpu_type.to_string()).or_default(),
        };
        let free = match nodes.get_mut(&g.node) {
            Some(free) => free,
            None => nodes.entry(g.node.clone()).or_default(),
        };
        if let Err(pos) = free.binary_search(&g.index) {
            free.insert(pos, g.index);
            match self.count_by_type.get_mut(gpu_type) {
                Some(c) => *c += 1,
                None => {
                    self.count_by_type.insert(gpu_type.to_string(), 1);
                }
            }
        }
    }

    /// Sets node `name`'s part of the index afresh: none of its old GPUs,
    /// then those of `node` (when it is alive) that `keep` keeps (by
    /// index: all for the capacity, the unheld ones for the free index).
    /// What a node's change costs: its own GPUs and the types, not every
    /// node's GPUs again.
    pub(crate) fn replace_node(
        &mut self,
        name: &str,
        node: Option<&crate::model::Node>,
        keep: impl Fn(u32) -> bool,
    ) {
        let mut emptied = Vec::new();
        for (gpu_type, nodes) in self.by_type.iter_mut() {
            if let Some(old) = nodes.remove(name) {
                if let Some(c) = self.count_by_type.get_mut(gpu_type) {
                    *c -= old.len();
                }
                if nodes.is_empty() {
                    emptied.push(gpu_type.clone());
                }
            }
        }
        for t in emptied {
            self.by_type.remove(&t);
            self.count_by_type.remove(&t);
        }
        let Some(node) = node.filter(|n| n.state == NodeState::Alive) else {
            return;
        };
        for (index, gpu_type) in &node.gpus {
            if keep(*index) {
                self.release_one(
                    gpu_type,
                    &GpuRef {
                        node: name.to_string(),
                        index: *index,
                    },
                );
            }
        }
    }

    /// Marks `gpus` as taken.
    pub fn remove(&mut self, gpus: &[GpuRef]) {
        let mut emptied: Option<String> = None;
        for g in gpus {
            // A node's GPUs may be of several types: look in each.
            for (gpu_type, nodes) in self.by_type.iter_mut() {
                let Some(free) = nodes.get_mut(&g.node) else {
                    continue;
                };
                let Ok(pos) = free.binary_search(&g.index) else {
                    continue;
                };
                free.remove(pos);
                if free.is_empty() {
                    nodes.remove(&g.node);
                }
                if let Some(c) = self.count_by_type.get_mut(gpu_type) {
                    *c -= 1;
                }
                if nodes.is_empty() {
                    emptied = Some(gpu_type.clone());
                }
                break;
            }
            // A type with nothing free leaves the index, so an index kept
            // up to date equals one built afresh.
            if let Some(t) = emptied.take() {
                self.by_type.remove(&t);
                self.count_by_type.remove(&t);
            }
        }
    }
}
