//! This server's nodes and GPUs, and their registration in the log.
//!
//! A server brings its inventory: the local machine's GPUs (from
//! `nvidia-smi`), or a simulated cluster (`--simulated-gpus 4xv100,2xk80
//! --simulated-nodes 2`), and reports it to the leader in its heartbeats
//! ([`crate::node_liveness`]), which register it.

use keel_executors::discovery::{self, DiscoveryError};
use keel_state::Gpu;

/// One node this server runs workers on.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct NodeInventory {
    pub name: String,
    /// Where its workers reach each other (the rendezvous address).
    pub address: String,
    pub gpus: Vec<Gpu>,
    /// Its GPUs are real (found by `nvidia-smi`), not simulated: the
    /// driver can say which processes use them.
    pub discovered: bool,
}

/// The GPUs declared by default when none are given and none are found: a
/// small simulated cluster that runs on a laptop.
pub const DEFAULT_SIMULATED_GPUS: &str = "4xv100,4xk80";
pub const DEFAULT_SIMULATED_NODES: u32 = 2;

/// Simulated nodes `PREFIX-0`, `PREFIX-1`, ... sharing `spec` between them.
pub fn simulated(
    spec: &str,
    nodes: u32,
    prefix: &str,
) -> Result<Vec<NodeInventory>, DiscoveryError> {
    let parsed = discovery::parse_simulated_gpus(spec)?;
    Ok(discovery::split_over_nodes(&parsed, nodes)?
        .into_iter()
        .enumerate()
        .map(|(i, gpus)| NodeInventory {
            name: format!("{prefix}-{i}"),
            address: "127.0.0.1".into(),
            gpus,
            discovered: false,
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
/// The GPUs are the ones the driver lists now; the heartbeat loop lists
/// them again and reads the kernel's log for Xids
/// ([`keel_executors::gpu_health`]).
pub fn discovered() -> Result<Option<NodeInventory>, DiscoveryError> {
    let Some(listing) = keel_executors::gpu_health::list_nvidia_gpus()? else {
        return Ok(None);
    };
    if listing.gpus.is_empty() && listing.lost.is_empty() {
        return Ok(None);
    }
    Ok(Some(NodeInventory {
        name: hostname(),
        address: "127.0.0.1".into(),
        gpus: listing.offered(),
        discovered: true,
    }))
}
