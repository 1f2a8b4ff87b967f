//! This server's nodes and GPUs, and their registration in the log.
//!
//! A server brings its inventory: the local machine's GPUs (from
//! `nvidia-smi`), or a simulated cluster (`--simulated-gpus 4xv100,2xk80
//! --simulated-nodes 2`). Once it leads, it registers each node whose
//! record differs from the state, and marks lost the nodes it registered
//! before but no longer has.

use std::sync::Arc;
use std::time::Duration;

use keel_core::{Command, Gpu, NodeState};
use keel_executors::discovery::{self, DiscoveryError};

use crate::proposer::Proposer;
use crate::raft_node::RaftNode;

/// One node this server runs workers on.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct NodeInventory {
    pub name: String,
    /// Where its workers reach each other (the rendezvous address).
    pub address: String,
    pub gpus: Vec<Gpu>,
}

/// The GPUs declared by default when none are given and none are found: a
/// small simulated cluster that runs on a laptop.
pub const DEFAULT_SIMULATED_GPUS: &str = "4xv100,4xk80";
pub const DEFAULT_SIMULATED_NODES: u32 = 2;

/// Simulated nodes `sim-0`, `sim-1`, ... sharing `spec` between them.
pub fn simulated(spec: &str, nodes: u32) -> Result<Vec<NodeInventory>, DiscoveryError> {
    let parsed = discovery::parse_simulated_gpus(spec)?;
    Ok(discovery::split_over_nodes(&parsed, nodes)?
        .into_iter()
        .enumerate()
        .map(|(i, gpus)| NodeInventory {
            name: format!("sim-{i}"),
            address: "127.0.0.1".into(),
            gpus,
        })
        .collect())
}

/// This machine's name, for its node.
pub fn hostname() -> String {
    std::fs::read_to_string("/proc/sys/kernel/hostname")
        .ok()
        .map(|s| s.trim().to_string())
        .filter(|s| !s.is_empty())
        .or_else(|| std::env::var("HOSTNAME").ok())
        .unwrap_or_else(|| "localhost".into())
}

/// The local machine with its NVIDIA GPUs, or `None` when it has none.
pub fn discovered() -> Result<Option<NodeInventory>, DiscoveryError> {
    let gpus = discovery::discover_nvidia_gpus()?;
    Ok((!gpus.is_empty()).then(|| NodeInventory {
        name: hostname(),
        address: "127.0.0.1".into(),
        gpus,
    }))
}

/// Waits until this node leads (at most `wait`), then registers the
/// inventory. With `retire_missing` (a one-replica cluster, where every node
/// is this server's), nodes in the state but not in the inventory are marked
/// lost. Returns how many entries it proposed.
pub async fn register(
    node: Arc<RaftNode>,
    proposer: Proposer,
    inventory: Vec<NodeInventory>,
    retire_missing: bool,
    wait: Duration,
) -> usize {
    let mut metrics = node.raft.metrics();
    let deadline = tokio::time::Instant::now() + wait;
    while metrics.borrow().current_leader != Some(node.id) {
        if tokio::time::timeout_at(deadline, metrics.changed())
            .await
            .is_err()
        {
            tracing::warn!("not the leader; the inventory is not registered");
            return 0;
        }
    }
    let mut commands = Vec::new();
    {
        let shared = node.state_machine.shared();
        let applied = shared.read();
        let state = &applied.state;
        for n in &inventory {
            let same = state.nodes().get(&n.name).is_some_and(|have| {
                have.state == NodeState::Alive
                    && have.address == n.address
                    && have.gpus.len() == n.gpus.len()
                    && n.gpus
                        .iter()
                        .all(|g| have.gpus.get(&g.index) == Some(&g.gpu_type))
            });
            if !same {
                commands.push(Command::RegisterNode {
                    name: n.name.clone(),
                    address: n.address.clone(),
                    gpus: n.gpus.clone(),
                });
            }
        }
        for (name, have) in state.nodes().iter().filter(|_| retire_missing) {
            if have.state == NodeState::Alive && !inventory.iter().any(|n| &n.name == name) {
                commands.push(Command::MarkNodeLost {
                    name: name.clone(),
                    reason: "no longer in the server's inventory".into(),
                });
            }
        }
    }
    let count = commands.len();
    for command in commands {
        let kind = command.kind();
        if let Err(e) = proposer.propose(command).await {
            tracing::warn!(error = %e, kind, "inventory entry not committed");
        }
    }
    count
}
