//! openraft wired to Keel's storage.
//!
//! One replica for now: the network never carries a message, because a
//! one-member cluster has no one to send to. Replication over gRPC replaces
//! [`NoPeers`] when clusters get more members.

use std::collections::BTreeMap;
use std::sync::Arc;

use keel_storage::{DataDir, LogStore, StateMachineStore, TypeConfig};
use openraft::error::{InstallSnapshotError, RPCError, RaftError, Unreachable};
use openraft::network::{RPCOption, RaftNetwork, RaftNetworkFactory};
use openraft::raft::{
    AppendEntriesRequest, AppendEntriesResponse, InstallSnapshotRequest, InstallSnapshotResponse,
    VoteRequest, VoteResponse,
};
use openraft::{BasicNode, Config, SnapshotPolicy};

pub type Raft = openraft::Raft<TypeConfig>;

#[derive(Debug, thiserror::Error)]
pub enum RaftNodeError {
    #[error(transparent)]
    DataDir(#[from] keel_storage::DataDirError),
    #[error("cannot open the Raft log in {path}: {source}")]
    Log {
        path: String,
        source: std::io::Error,
    },
    #[error("cannot open the state machine: {0}")]
    StateMachine(#[from] keel_storage::StoreError),
    #[error("invalid Raft configuration: {0}")]
    Config(String),
    #[error("Raft failed: {0}")]
    Raft(String),
}

/// The peer network of a one-member cluster: every peer is unreachable.
#[derive(Debug, Clone, Default)]
pub struct NoPeers;

impl RaftNetworkFactory<TypeConfig> for NoPeers {
    type Network = NoPeers;
    async fn new_client(&mut self, _target: u64, _node: &BasicNode) -> NoPeers {
        NoPeers
    }
}

fn unreachable<E: std::error::Error>() -> RPCError<u64, BasicNode, E> {
    RPCError::Unreachable(Unreachable::new(&std::io::Error::other(
        "this replica has no peers",
    )))
}

impl RaftNetwork<TypeConfig> for NoPeers {
    async fn append_entries(
        &mut self,
        _rpc: AppendEntriesRequest<TypeConfig>,
        _option: RPCOption,
    ) -> Result<AppendEntriesResponse<u64>, RPCError<u64, BasicNode, RaftError<u64>>> {
        Err(unreachable())
    }

    async fn install_snapshot(
        &mut self,
        _rpc: InstallSnapshotRequest<TypeConfig>,
        _option: RPCOption,
    ) -> Result<
        InstallSnapshotResponse<u64>,
        RPCError<u64, BasicNode, RaftError<u64, InstallSnapshotError>>,
    > {
        Err(unreachable())
    }

    async fn vote(
        &mut self,
        _rpc: VoteRequest<u64>,
        _option: RPCOption,
    ) -> Result<VoteResponse<u64>, RPCError<u64, BasicNode, RaftError<u64>>> {
        Err(unreachable())
    }
}

/// A running Raft replica and the stores behind it.
pub struct RaftNode {
    pub id: u64,
    pub raft: Raft,
    pub state_machine: StateMachineStore,
    pub log: LogStore,
    /// Held for the life of the node: the data directory's lock.
    pub data_dir: DataDir,
}

/// Raft timing and compaction settings.
#[derive(Debug, Clone)]
pub struct RaftSettings {
    pub heartbeat_interval_ms: u64,
    pub election_timeout_min_ms: u64,
    pub election_timeout_max_ms: u64,
    /// Build a snapshot (and purge the log behind it) every this many entries.
    pub snapshot_every_entries: u64,
}

impl Default for RaftSettings {
    fn default() -> Self {
        RaftSettings {
            heartbeat_interval_ms: 100,
            election_timeout_min_ms: 300,
            election_timeout_max_ms: 600,
            snapshot_every_entries: 10_000,
        }
    }
}

impl std::fmt::Debug for RaftNode {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RaftNode")
            .field("id", &self.id)
            .field("data_dir", &self.data_dir)
            .finish_non_exhaustive()
    }
}

impl RaftNode {
    /// Opens the data directory (taking its lock), recovers the log and the
    /// state machine, and starts Raft. On first start it initialises a
    /// one-member cluster with itself; on later starts membership comes from
    /// the log.
    pub async fn start(
        id: u64,
        advertise_addr: &str,
        data_dir: DataDir,
        settings: &RaftSettings,
    ) -> Result<RaftNode, RaftNodeError> {
        let log_dir = data_dir.raft_log_dir();
        let log = LogStore::open(&log_dir).map_err(|source| RaftNodeError::Log {
            path: log_dir.display().to_string(),
            source,
        })?;
        let state_machine = StateMachineStore::open(&data_dir.state_dir())?;
        let config = Config {
            cluster_name: "keel".into(),
            heartbeat_interval: settings.heartbeat_interval_ms,
            election_timeout_min: settings.election_timeout_min_ms,
            election_timeout_max: settings.election_timeout_max_ms,
            snapshot_policy: SnapshotPolicy::LogsSinceLast(settings.snapshot_every_entries),
            max_in_snapshot_log_to_keep: 1000,
            ..Default::default()
        }
        .validate()
        .map_err(|e| RaftNodeError::Config(e.to_string()))?;
        let raft = Raft::new(
            id,
            Arc::new(config),
            NoPeers,
            log.clone(),
            state_machine.clone(),
        )
        .await
        .map_err(|e| RaftNodeError::Raft(e.to_string()))?;
        let initialized = raft
            .is_initialized()
            .await
            .map_err(|e| RaftNodeError::Raft(e.to_string()))?;
        if !initialized {
            let members = BTreeMap::from([(
                id,
                BasicNode {
                    addr: advertise_addr.to_string(),
                },
            )]);
            raft.initialize(members)
                .await
                .map_err(|e| RaftNodeError::Raft(e.to_string()))?;
            tracing::info!(id, "initialised a one-member cluster");
        } else {
            tracing::info!(id, "recovered from the data directory");
        }
        Ok(RaftNode {
            id,
            raft,
            state_machine,
            log,
            data_dir,
        })
    }

    /// Stops Raft and makes the state machine's writes survive a crash.
    pub async fn shutdown(&self) -> Result<(), RaftNodeError> {
        self.raft
            .shutdown()
            .await
            .map_err(|e| RaftNodeError::Raft(e.to_string()))?;
        self.state_machine.flush()?;
        Ok(())
    }
}
