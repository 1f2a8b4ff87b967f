//! What a scheduling policy keeps between rounds, as the log records it.
//!
//! A policy with memory (the heterogeneity-aware round mechanism: time
//! received per GPU type, deficits, the allocation in force, leases,
//! Gandiva's pairs, finish-time fairness's credited time) returns its new
//! memory with each round's decision, and the leader logs it inside that
//! `DecideAllocation`. `apply` keeps the last one, opaque: this crate knows
//! no policy, so it checks only the envelope (the policy's name, a size
//! limit, and that the decision saw the memory it replaces). The memory is
//! part of the state: hashed, in snapshots, rebuilt by replay; a new leader
//! plans from it, so a failover does not reset what the policy remembered.

use serde::{Deserialize, Serialize};

use crate::proto_form::ProtoForm;

/// The largest memory one decision may carry, in bytes: half of an
/// entry's limit ([`crate::codec::ENTRY_MAX_BYTES`]), leaving the rest to
/// the decision's placements.
pub const POLICY_MEMORY_MAX_BYTES: usize = crate::codec::ENTRY_MAX_BYTES / 2;

/// A policy's memory as logged: its own encoding, versioned by the policy.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, ProtoForm)]
#[proto(message = "keel_proto::entry::PolicyMemory")]
pub struct PolicyMemory {
    /// The policy that wrote it (the decision's policy).
    pub policy: String,
    /// The policy's format version of `bytes`; a policy that meets a
    /// version it does not read starts afresh.
    pub format: u32,
    pub bytes: Vec<u8>,
}

/// The state's slot: the last memory recorded and where it changed.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct PolicyMemorySlot {
    /// The memory in force, if any.
    pub memory: Option<PolicyMemory>,
    /// The index of the entry that last set or cleared `memory` (0: never).
    /// A decision based on an earlier state did not see it, so its memory
    /// is refused (two leaders' rounds must not both be credited from one
    /// base).
    pub changed_at: u64,
}

impl PolicyMemorySlot {
    /// Whether nothing was ever recorded (the state of every log written
    /// before policy memory was logged: such states hash and encode as
    /// they did).
    pub fn is_unset(&self) -> bool {
        self.memory.is_none() && self.changed_at == 0
    }
}
