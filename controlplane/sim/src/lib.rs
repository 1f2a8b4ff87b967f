//! The discrete-event simulator behind `keel sim`.
//!
//! It drives the real [`ClusterState::apply`](keel_state::ClusterState::apply)
//! with the real policies ([`keel_scheduling::policy`]) on a virtual clock, so what a
//! policy does in simulation is what it does on the cluster. Inputs: a
//! cluster ([`cluster_from_counts`] for `36:36:36`, or a list of
//! [`NodeSpec`]), a workload ([`workload`]: Keel's trace format, Gavel's,
//! or a seeded generator), a policy. Output: a [`SimReport`].
//!
//! Pure like keel-state: no I/O (the CLI reads files and passes
//! text), no clock, no threads, seeded randomness only.

mod engine;
pub mod fixtures;
pub mod gavel_generator;
pub mod gavel_throughputs;
pub mod history;
pub mod rounds;
pub mod whatif;
pub mod workload;

pub use engine::{
    simulate, simulate_policies, JctSummary, JobResult, NodeChange, QueueUse, Sample, SimConfig,
    SimNode, SimReport, SimRetention, SpeedSources, StateSize,
};
pub use gavel_generator::GavelGenerator;
pub use gavel_throughputs::{ThroughputTable, ThroughputTableError};
pub use rounds::{simulate_rounds, RoundSimConfig};
pub use workload::{assign_queues, Generator, MeasuredSpeed, SimJob, WorkloadError};

use serde::Deserialize;

use keel_state::model::Gpu;

/// The GPU types of a `v100:p100:k80` cluster spec, in order.
pub const COUNT_SPEC_TYPES: [&str; 3] = ["v100", "p100", "k80"];

/// Most GPUs a simulated cluster may have.
pub const CLUSTER_GPUS_MAX: u32 = 1_000_000;

/// A cluster spec that cannot be used, naming what is wrong.
#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum ClusterSpecError {
    #[error("cluster spec {spec:?}: {reason}")]
    Invalid { spec: String, reason: String },
}

/// A `v100:p100:k80` spec (e.g. `36:36:36`) as nodes of `gpus_per_server`
/// GPUs of one type each (`v100-0`, `v100-1`, ...; a remainder makes one
/// smaller node).
pub fn cluster_from_counts(
    spec: &str,
    gpus_per_server: u32,
) -> Result<Vec<SimNode>, ClusterSpecError> {
    let invalid = |reason: &str| ClusterSpecError::Invalid {
        spec: spec.to_string(),
        reason: reason.to_string(),
    };
    let counts: Vec<&str> = spec.split(':').collect();
    if counts.len() != COUNT_SPEC_TYPES.len() {
        return Err(invalid("expected three counts, v100:p100:k80"));
    }
    if gpus_per_server == 0 || gpus_per_server > 1024 {
        return Err(invalid("GPUs per server must be between 1 and 1024"));
    }
    let mut nodes = Vec::new();
    let mut total: u64 = 0;
    for (count, gpu_type) in counts.iter().zip(COUNT_SPEC_TYPES) {
        let count: u32 = count
            .trim()
            .parse()
            .map_err(|_| invalid("each count must be a whole number"))?;
        total += u64::from(count);
        if total > u64::from(CLUSTER_GPUS_MAX) {
            return Err(invalid(&format!("more than {CLUSTER_GPUS_MAX} GPUs")));
        }
        let mut left = count;
        let mut n = 0;
        while left > 0 {
            let here = left.min(gpus_per_server);
            nodes.push(SimNode {
                name: format!("{gpu_type}-{n}"),
                gpus: (0..here)
                    .map(|index| Gpu {
                        index,
                        gpu_type: gpu_type.to_string(),
                    })
                    .collect(),
            });
            left -= here;
            n += 1;
        }
    }
    if nodes.is_empty() {
        return Err(invalid("the cluster has no GPUs"));
    }
    Ok(nodes)
}

/// One entry of a cluster file (YAML or JSON list): `count` nodes of
/// `gpus` GPUs of `gpu_type`.
#[derive(Debug, Clone, PartialEq, Eq, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct NodeSpec {
    /// Name prefix (default: the GPU type).
    #[serde(default)]
    pub name: Option<String>,
    pub gpu_type: String,
    pub gpus: u32,
    #[serde(default = "one")]
    pub count: u32,
}

fn one() -> u32 {
    1
}

/// Queues to make before a run: name and terms.
pub type SimQueues = Vec<(String, keel_state::queue::QueueSpec)>;

/// A cluster file: a list of nodes, or nodes and queues
/// (`{nodes: [...], queues: [...]}`).
#[derive(Debug, Clone, PartialEq, Eq, Deserialize)]
#[serde(untagged)]
pub enum ClusterFile {
    Nodes(Vec<NodeSpec>),
    WithQueues {
        nodes: Vec<NodeSpec>,
        #[serde(default)]
        queues: Vec<QueueFileEntry>,
    },
}

/// One queue of a cluster file, as `keel queue create` takes it.
#[derive(Debug, Clone, PartialEq, Eq, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct QueueFileEntry {
    pub name: String,
    /// GPUs per type (`{v100: 18}`).
    #[serde(default)]
    pub quota: std::collections::BTreeMap<String, u32>,
    #[serde(default)]
    pub cohort: Option<String>,
    #[serde(default)]
    pub borrow_limit: std::collections::BTreeMap<String, u32>,
    #[serde(default)]
    pub lend_limit: std::collections::BTreeMap<String, u32>,
    #[serde(default = "one")]
    pub weight: u32,
}

impl ClusterFile {
    /// The nodes and queues it describes, each queue checked as the API
    /// checks it (against the nodes' GPU types).
    pub fn resolve(&self) -> Result<(Vec<SimNode>, SimQueues), ClusterSpecError> {
        let (specs, entries) = match self {
            ClusterFile::Nodes(nodes) => (nodes, &[][..]),
            ClusterFile::WithQueues { nodes, queues } => (nodes, queues.as_slice()),
        };
        let nodes = cluster_from_specs(specs)?;
        let types: std::collections::BTreeSet<&str> = nodes
            .iter()
            .flat_map(|n| n.gpus.iter().map(|g| g.gpu_type.as_str()))
            .collect();
        let mut queues = Vec::new();
        let mut names = std::collections::BTreeSet::new();
        for q in entries {
            let invalid = |reason: String| ClusterSpecError::Invalid {
                spec: format!("queue {:?}", q.name),
                reason,
            };
            keel_state::queue::validate_queue_name("name", &q.name)
                .map_err(|e| invalid(e.to_string()))?;
            if !names.insert(q.name.clone()) {
                return Err(invalid("is listed twice".into()));
            }
            let spec = keel_state::queue::QueueSpec {
                quota: Some(q.quota.clone()),
                cohort: q.cohort.clone(),
                borrow_limit: q.borrow_limit.clone(),
                lend_limit: q.lend_limit.clone(),
                weight: q.weight,
            };
            spec.validate(|t| types.contains(t))
                .map_err(|e| invalid(e.to_string()))?;
            queues.push((q.name.clone(), spec));
        }
        Ok((nodes, queues))
    }
}

/// The nodes a cluster file describes.
pub fn cluster_from_specs(specs: &[NodeSpec]) -> Result<Vec<SimNode>, ClusterSpecError> {
    let mut nodes = Vec::new();
    let mut total: u64 = 0;
    let mut seen: std::collections::BTreeMap<String, u32> = Default::default();
    for spec in specs {
        let invalid = |reason: &str| ClusterSpecError::Invalid {
            spec: format!("{spec:?}"),
            reason: reason.to_string(),
        };
        if spec.gpus == 0 || spec.gpus > 1024 {
            return Err(invalid("gpus must be between 1 and 1024"));
        }
        if spec.gpu_type.is_empty() || spec.gpu_type.len() > 64 {
            return Err(invalid("gpu_type must be 1 to 64 characters"));
        }
        total += u64::from(spec.gpus) * u64::from(spec.count);
        if total > u64::from(CLUSTER_GPUS_MAX) {
            return Err(invalid(&format!("more than {CLUSTER_GPUS_MAX} GPUs")));
        }
        let prefix = spec.name.clone().unwrap_or_else(|| spec.gpu_type.clone());
        for _ in 0..spec.count {
            let n = seen.entry(prefix.clone()).or_default();
            nodes.push(SimNode {
                name: format!("{prefix}-{n}"),
                gpus: (0..spec.gpus)
                    .map(|index| Gpu {
                        index,
                        gpu_type: spec.gpu_type.to_ascii_lowercase(),
                    })
                    .collect(),
            });
            *n += 1;
        }
    }
    if nodes.is_empty() {
        return Err(ClusterSpecError::Invalid {
            spec: "[]".into(),
            reason: "the cluster has no GPUs".into(),
        });
    }
    Ok(nodes)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn count_specs_make_nodes_of_one_type() {
        let nodes = cluster_from_counts("3:0:2", 2).expect("valid");
        let names: Vec<&str> = nodes.iter().map(|n| n.name.as_str()).collect();
        assert_eq!(names, ["v100-0", "v100-1", "k80-0"]);
        assert_eq!(nodes[1].gpus.len(), 1, "the remainder");
        assert!(cluster_from_counts("1:2", 1).is_err());
        assert!(cluster_from_counts("0:0:0", 1).is_err());
        assert!(cluster_from_counts("a:1:1", 1).is_err());
    }

    #[test]
    fn node_specs_expand_counts() {
        let nodes = cluster_from_specs(&[
            NodeSpec {
                name: Some("dgx".into()),
                gpu_type: "A100".into(),
                gpus: 8,
                count: 2,
            },
            NodeSpec {
                name: None,
                gpu_type: "k80".into(),
                gpus: 4,
                count: 1,
            },
        ])
        .expect("valid");
        assert_eq!(nodes.len(), 3);
        assert_eq!(nodes[1].name, "dgx-1");
        assert_eq!(nodes[0].gpus[0].gpu_type, "a100");
    }
}
