//! openraft wired to Keel's storage and the gRPC network, and how a replica
//! joins its cluster.
//!
//! Bootstrap happens exactly once per cluster. Without `--peers`, a replica
//! forms a one-member cluster of itself. With `--peers`, only the member
//! with the lowest id initialises, and only after asking the other peers
//! whether a cluster already exists (a wiped member that comes back must
//! rejoin, not found a second cluster); the others wait for the leader to
//! replicate the membership to them. A data directory initialised with one
//! member set refuses a different `--peers` until the membership changes.

use std::collections::BTreeMap;
use std::sync::Arc;

use keel_storage::{DataDir, LogStore, StateMachineStore, TypeConfig};
use openraft::{BasicNode, Config, SnapshotPolicy};

use crate::raft_network::{ClusterIdentity, GrpcNetwork};

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
    #[error("cannot read or write the cluster id in {path}: {source}")]
    ClusterId {
        path: String,
        source: std::io::Error,
    },
    #[error("invalid Raft configuration: {0}")]
    Config(String),
    #[error("Raft failed: {0}")]
    Raft(String),
    #[error("--peers must name this replica's id {id} with its address (got {peers})")]
    NotInPeers { id: u64, peers: String },
    #[error(
        "this data directory belongs to a cluster of members {stored}; --peers says {given}. \
         Refusing to start: initialising a cluster twice with different members could split it. \
         Start with the original --peers (or none), or use a fresh data directory to join another cluster"
    )]
    PeersMismatch { stored: String, given: String },
}

/// Who is in the cluster at bootstrap: member id → address (API and Raft on
/// one port). Empty: a one-member cluster of this replica.
pub type Peers = BTreeMap<u64, String>;

fn show(ids: impl IntoIterator<Item = u64>) -> String {
    let ids: Vec<String> = ids.into_iter().map(|i| i.to_string()).collect();
    format!("{{{}}}", ids.join(","))
}

/// Asks every other peer whether it belongs to an initialised cluster;
/// returns the id of one that does. Unreachable peers count as "no".
async fn existing_cluster(id: u64, peers: &Peers) -> Option<u64> {
    use keel_proto::api::{keel_client::KeelClient, ClusterStatusRequest};
    for (peer, addr) in peers.iter().filter(|(p, _)| **p != id) {
        let url = format!("http://{addr}");
        let Ok(endpoint) = tonic::transport::Endpoint::from_shared(url) else {
            continue;
        };
        let endpoint = endpoint
            .connect_timeout(std::time::Duration::from_millis(500))
            .timeout(std::time::Duration::from_secs(1));
        let Ok(channel) = endpoint.connect().await else {
            continue;
        };
        let mut client = KeelClient::new(channel);
        if let Ok(status) = client.cluster_status(ClusterStatusRequest::default()).await {
            if !status.into_inner().voters.is_empty() {
                return Some(*peer);
            }
        }
    }
    None
}

/// A running Raft replica and the stores behind it.
pub struct RaftNode {
    pub id: u64,
    pub raft: Raft,
    /// The cluster this replica belongs to (checked on every Raft message).
    pub identity: Arc<ClusterIdentity>,
    pub state_machine: StateMachineStore,
    pub log: LogStore,
    /// Held for the life of the node: the data directory's lock.
    pub data_dir: DataDir,
    /// See [`RaftSettings::peer_source_ip`].
    pub peer_source_ip: Option<std::net::IpAddr>,
}

/// Raft timing and compaction settings.
#[derive(Debug, Clone)]
pub struct RaftSettings {
    pub heartbeat_interval_ms: u64,
    pub election_timeout_min_ms: u64,
    pub election_timeout_max_ms: u64,
    /// Build a snapshot (and purge the log behind it) every this many entries.
    pub snapshot_every_entries: u64,
    /// Log entries kept behind a snapshot, so a briefly absent follower
    /// catches up from the log rather than by a snapshot install.
    pub keep_log_after_snapshot: u64,
    /// The local address this replica's connections to its peers (Raft,
    /// forwarded requests) bind to; `None`: the system's choice. A
    /// fault-injecting proxy in front of a peer tells the replicas apart by
    /// it (`keel-chaos` gives each 127.0.0.x its own).
    pub peer_source_ip: Option<std::net::IpAddr>,
}

impl Default for RaftSettings {
    fn default() -> Self {
        RaftSettings {
            // A follower refuses to vote while it heard from a leader within
            // the longest election timeout (openraft's leader lease), so a
            // failover takes about one to two election timeouts: these keep
            // it under a second (BENCHMARKS.md, failover: 200-400 ms gave a
            // p50 of 750-800 ms and a p99 of 1.7-2.4 s, 150-300 ms gives
            // about 600 ms and 0.9-1.5 s).
            heartbeat_interval_ms: 50,
            election_timeout_min_ms: 150,
            election_timeout_max_ms: 300,
            snapshot_every_entries: 10_000,
            keep_log_after_snapshot: 1000,
            peer_source_ip: None,
        }
    }
}

impl RaftSettings {
    /// openraft's configuration for these settings: what every replica
    /// runs with (and the deterministic simulation of the Raft layer too).
    pub fn openraft_config(&self) -> Result<Config, RaftNodeError> {
        Config {
            cluster_name: "keel".into(),
            heartbeat_interval: self.heartbeat_interval_ms,
            election_timeout_min: self.election_timeout_min_ms,
            election_timeout_max: self.election_timeout_max_ms,
            snapshot_policy: SnapshotPolicy::LogsSinceLast(self.snapshot_every_entries),
            max_in_snapshot_log_to_keep: self.keep_log_after_snapshot,
            // Proposals are at most 4 MiB; keep one replication message
            // well under the transport's limit.
            max_payload_entries: 32,
            snapshot_max_chunk_size: 1024 * 1024,
            ..Default::default()
        }
        .validate()
        .map_err(|e| RaftNodeError::Config(e.to_string()))
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
        peers: &Peers,
        data_dir: DataDir,
        settings: &RaftSettings,
    ) -> Result<RaftNode, RaftNodeError> {
        if !peers.is_empty() && !peers.contains_key(&id) {
            return Err(RaftNodeError::NotInPeers {
                id,
                peers: peers
                    .iter()
                    .map(|(i, a)| format!("{i}={a}"))
                    .collect::<Vec<_>>()
                    .join(","),
            });
        }
        let log_dir = data_dir.raft_log_dir();
        let log = LogStore::open(&log_dir).map_err(|source| RaftNodeError::Log {
            path: log_dir.display().to_string(),
            source,
        })?;
        let state_machine = StateMachineStore::open(&data_dir.state_dir())?;
        let identity_path = data_dir.root().join("cluster-id");
        let identity_error = |source| RaftNodeError::ClusterId {
            path: identity_path.display().to_string(),
            source,
        };
        let identity =
            Arc::new(ClusterIdentity::load(identity_path.clone()).map_err(identity_error)?);
        let config = settings.openraft_config()?;
        let raft = Raft::new(
            id,
            Arc::new(config),
            GrpcNetwork::new(identity.clone(), settings.peer_source_ip),
            log.clone(),
            state_machine.clone(),
        )
        .await
        .map_err(|e| RaftNodeError::Raft(e.to_string()))?;
        let initialized = raft
            .is_initialized()
            .await
            .map_err(|e| RaftNodeError::Raft(e.to_string()))?;
        let stored: Vec<u64> = raft
            .metrics()
            .borrow()
            .membership_config
            .membership()
            .voter_ids()
            .collect();
        if initialized && stored.is_empty() {
            // openraft counts a replica as initialised once it has voted,
            // even if no entry (so no membership) has reached it: a member
            // wiped and started again, stopped before the leader's snapshot
            // arrived. It is in the cluster already and initialises
            // nothing; the leader brings it up to date.
            tracing::info!(
                id,
                "voted in the cluster but holds no membership yet; waiting for the leader to reach this replica"
            );
        } else if initialized {
            let membership = raft.metrics().borrow().membership_config.clone();
            // Only a membership that never changed since bootstrap (its log
            // id is the initial one) is held against --peers.
            let never_changed = membership.log_id().is_none_or(|l| l.index == 0);
            let given: Vec<u64> = peers.keys().copied().collect();
            if !peers.is_empty() && never_changed && stored != given {
                return Err(RaftNodeError::PeersMismatch {
                    stored: show(stored),
                    given: show(given),
                });
            }
            tracing::info!(id, voters = %show(stored), "recovered from the data directory");
        } else if peers.is_empty() {
            let members = BTreeMap::from([(
                id,
                BasicNode {
                    addr: advertise_addr.to_string(),
                },
            )]);
            identity.create(id).map_err(identity_error)?;
            raft.initialize(members)
                .await
                .map_err(|e| RaftNodeError::Raft(e.to_string()))?;
            tracing::info!(id, "initialised a one-member cluster");
        } else if peers.keys().next() == Some(&id) {
            if let Some(existing) = existing_cluster(id, peers).await {
                tracing::info!(
                    id,
                    peer = existing,
                    "a cluster already exists; waiting for its leader to add this replica"
                );
            } else {
                let members: BTreeMap<u64, BasicNode> = peers
                    .iter()
                    .map(|(i, addr)| (*i, BasicNode { addr: addr.clone() }))
                    .collect();
                identity.create(id).map_err(identity_error)?;
                raft.initialize(members)
                    .await
                    .map_err(|e| RaftNodeError::Raft(e.to_string()))?;
                tracing::info!(id, members = %show(peers.keys().copied()), "initialised the cluster");
            }
        } else {
            tracing::info!(id, "waiting for the cluster's leader to reach this replica");
        }
        Ok(RaftNode {
            id,
            raft,
            identity,
            state_machine,
            log,
            data_dir,
            peer_source_ip: settings.peer_source_ip,
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

#[cfg(test)]
mod tests {
    use super::*;
    use openraft::storage::RaftLogStorage;

    /// A member wiped and started again votes for the leader before the
    /// leader's snapshot reaches it; killed then, its directory holds a vote
    /// and no membership. It must start again and wait for the leader, not
    /// refuse its own `--peers` as another cluster's.
    #[tokio::test]
    async fn a_replica_that_voted_but_holds_no_membership_starts_and_waits() {
        let dir = tempfile::tempdir().expect("tempdir");
        let root = dir.path().join("r3");
        {
            let data = DataDir::open(&root).expect("data dir");
            let mut log = LogStore::open(&data.raft_log_dir()).expect("log");
            log.save_vote(&openraft::Vote::new(7, 1))
                .await
                .expect("vote");
        }
        let peers: Peers = (1..=3).map(|i| (i, format!("127.0.0.1:{i}"))).collect();
        let node = RaftNode::start(
            3,
            "127.0.0.1:3",
            &peers,
            DataDir::open(&root).expect("data dir"),
            &RaftSettings::default(),
        )
        .await
        .expect("a replica that only voted starts");
        assert!(node.raft.is_initialized().await.expect("state"));
        let voters: Vec<u64> = node
            .raft
            .metrics()
            .borrow()
            .membership_config
            .membership()
            .voter_ids()
            .collect();
        assert!(voters.is_empty(), "no membership was made up: {voters:?}");
        node.shutdown().await.expect("shutdown");
    }
}
