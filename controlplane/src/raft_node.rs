//! openraft wired to Keel's storage and the gRPC network, and how a replica
//! joins its cluster.
//!
//! Bootstrap happens exactly once per cluster. Without `--peers`, a replica
//! forms a one-member cluster of itself. With `--peers`, only the member
//! with the lowest id initialises, in the background while its API serves,
//! once a majority of the members (itself included) has answered that it
//! holds no cluster and none that it does: a wiped member that comes back
//! must rejoin, not found a second cluster, even while its peers are out of
//! reach. The others wait for the leader to replicate the membership to
//! them. A data directory initialised with one member set refuses a
//! different `--peers` until the membership changes.
//!
//! Raft knows each member by a Raft id made of its member id and the
//! incarnation of its data directory (`membership`): the cluster is
//! initialised with the Raft ids the peers answered with, and a member that
//! did not answer is named by its member id alone until it joins.

use std::collections::BTreeMap;
use std::sync::Arc;

use keel_storage::{DataDir, LogStore, StateMachineStore, TypeConfig};
use openraft::{BasicNode, Config, SnapshotPolicy};

use crate::clock::ServerClock;
use crate::membership::{self, Strangers};
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
    #[error("--id {id} is out of range: member ids are 1 to {max}")]
    MemberIdOutOfRange { id: u64, max: u64 },
    #[error(transparent)]
    Incarnation(#[from] membership::IncarnationError),
    /// The replica of this data directory was removed (issue 34).
    #[error(transparent)]
    Removed(#[from] crate::removal::RemovalError),
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

/// What one peer said when asked, at bootstrap, whether a cluster exists.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum PeerAnswer {
    /// It belongs to an initialised cluster (it knows voters).
    Initialised,
    /// It answered and holds no cluster yet; its Raft id.
    Uninitialised { raft_id: u64 },
    /// No answer (down, partitioned, not started yet).
    Unreachable,
}

/// What the lowest-id replica does at bootstrap, given the other peers'
/// answers.
#[derive(Debug, Clone, PartialEq, Eq)]
enum Bootstrap {
    /// A cluster exists (this peer said so): wait for its leader.
    Join { peer: u64 },
    /// A majority of the members, this replica included, holds no cluster
    /// and none said otherwise: initialise.
    Initialise,
    /// Too few answers to tell a first start from a wiped member whose
    /// cluster is out of reach: ask again.
    AskAgain { uninitialised: usize, needed: usize },
}

/// The bootstrap rule, pure. Initialising needs a majority of the members
/// (this replica counts) to have answered "no cluster": a cluster that
/// exists holds a majority of members that know it, so at least one of any
/// majority would have said so. Initialising on silence instead would let a
/// wiped member whose peers are unreachable found a second cluster.
fn bootstrap(members: usize, answers: &BTreeMap<u64, PeerAnswer>) -> Bootstrap {
    if let Some((peer, _)) = answers.iter().find(|(_, a)| **a == PeerAnswer::Initialised) {
        return Bootstrap::Join { peer: *peer };
    }
    let uninitialised = 1 + answers
        .values()
        .filter(|a| matches!(a, PeerAnswer::Uninitialised { .. }))
        .count();
    let needed = members / 2 + 1;
    if uninitialised >= needed {
        Bootstrap::Initialise
    } else {
        Bootstrap::AskAgain {
            uninitialised,
            needed,
        }
    }
}

/// What member `member` at `addr` says of itself (`ClusterStatus`),
/// within a second.
pub(crate) async fn status_of(
    transport: &crate::transport::Transport,
    member: u64,
    addr: &str,
) -> Result<keel_proto::api::ClusterStatusResponse, String> {
    use keel_proto::api::{keel_client::KeelClient, ClusterStatusRequest};
    let endpoint = transport
        .endpoint(addr)
        .map_err(|e| e.to_string())?
        .connect_timeout(std::time::Duration::from_millis(500))
        .timeout(std::time::Duration::from_secs(1));
    let channel = transport
        .connect(endpoint, crate::transport::Peer::Member(member))
        .await
        .map_err(|e| e.to_string())?;
    let mut client = KeelClient::new(channel);
    client
        .cluster_status(ClusterStatusRequest::default())
        .await
        .map(|r| r.into_inner())
        .map_err(|e| e.message().to_string())
}

/// Asks every other peer whether it belongs to an initialised cluster.
async fn ask_peers(
    id: u64,
    peers: &Peers,
    transport: &crate::transport::Transport,
) -> BTreeMap<u64, PeerAnswer> {
    let mut answers = BTreeMap::new();
    for (peer, addr) in peers.iter().filter(|(p, _)| **p != id) {
        answers.insert(*peer, PeerAnswer::Unreachable);
        let Ok(status) = status_of(transport, *peer, addr).await else {
            continue;
        };
        if status.member_id != *peer {
            tracing::warn!(
                peer,
                addr,
                answered_as = status.member_id,
                "a peer's address answers as another member; check --peers"
            );
            continue;
        }
        let answer = if status.voters.is_empty() {
            PeerAnswer::Uninitialised {
                raft_id: membership::raft_id(*peer, status.incarnation),
            }
        } else {
            PeerAnswer::Initialised
        };
        answers.insert(*peer, answer);
    }
    answers
}

/// How long the lowest id waits between rounds of asking its peers.
const ASK_AGAIN_INTERVAL: std::time::Duration = std::time::Duration::from_millis(500);

/// The lowest id's bootstrap: asks its peers every [`ASK_AGAIN_INTERVAL`]
/// until it joins the cluster they hold or initialises one with them (see
/// [`bootstrap`]). Ends then, or when Raft stops, or when a leader reached
/// this replica first.
async fn bootstrap_when_a_majority_answers(
    id: u64,
    raft_id: u64,
    peers: Peers,
    raft: Raft,
    identity: Arc<ClusterIdentity>,
    transport: crate::transport::Transport,
) {
    let mut rounds = 0u64;
    loop {
        match raft.is_initialized().await {
            Ok(false) => {}
            Ok(true) => {
                tracing::info!(id, "reached by the cluster's leader");
                return;
            }
            // Raft stopped; the server reports why.
            Err(_) => return,
        }
        let answers = ask_peers(id, &peers, &transport).await;
        match bootstrap(peers.len(), &answers) {
            Bootstrap::Join { peer } => {
                tracing::info!(
                    id,
                    peer,
                    "a cluster already exists; waiting for its leader to add this replica"
                );
                return;
            }
            Bootstrap::Initialise => match initialise(
                raft_id,
                &initial_members(raft_id, &peers, &answers),
                &raft,
                &identity,
            )
            .await
            {
                Ok(()) => {
                    tracing::info!(id, members = %show(peers.keys().copied()), "initialised the cluster");
                    return;
                }
                // Already initialised (a leader got here first), stopped
                // (the next round sees which), or the data directory
                // refused the id (tried again).
                Err(e) => tracing::warn!(id, error = %e, "could not initialise the cluster"),
            },
            Bootstrap::AskAgain {
                uninitialised,
                needed,
            } => {
                // Every 10 s, not every round: the wait can be long.
                if rounds.is_multiple_of(20) {
                    tracing::info!(
                        id,
                        uninitialised,
                        needed,
                        "waiting for a majority of --peers to answer before initialising \
                         (a peer that is down may hold this cluster already)"
                    );
                }
            }
        }
        rounds += 1;
        tokio::time::sleep(ASK_AGAIN_INTERVAL).await;
    }
}

/// The first membership: Raft id → address, each peer under the Raft id
/// it answered with (this replica under its own), a peer that did not
/// answer under its member id alone (it joins as a new incarnation when it
/// answers, `membership`).
fn initial_members(
    raft_id: u64,
    peers: &Peers,
    answers: &BTreeMap<u64, PeerAnswer>,
) -> BTreeMap<u64, BasicNode> {
    peers
        .iter()
        .map(|(member, addr)| {
            let id = if *member == membership::member_of(raft_id) {
                raft_id
            } else {
                match answers.get(member) {
                    Some(PeerAnswer::Uninitialised { raft_id }) => *raft_id,
                    _ => *member,
                }
            };
            (id, BasicNode { addr: addr.clone() })
        })
        .collect()
}

/// Initialises the cluster of `members`, keeping its id first. An id kept
/// already is this replica's own from an earlier round (or adopted from a
/// leader that got here first).
async fn initialise(
    raft_id: u64,
    members: &BTreeMap<u64, BasicNode>,
    raft: &Raft,
    identity: &ClusterIdentity,
) -> Result<(), String> {
    if identity.get().is_none() {
        identity
            .create(membership::member_of(raft_id))
            .map_err(|e| format!("cannot keep the new cluster id in the data directory: {e}"))?;
    }
    raft.initialize(members.clone())
        .await
        .map_err(|e| e.to_string())
}

/// A running Raft replica and the stores behind it.
pub struct RaftNode {
    /// Its Raft id: member id and incarnation (`membership::raft_id`;
    /// `membership::member_of` and `incarnation_of` take it apart).
    pub id: u64,
    /// Peers that answered as another incarnation (the leader's repair
    /// reads them).
    pub strangers: Strangers,
    /// What this replica learned of its removal from the cluster
    /// ([`crate::removal`]).
    pub removal: crate::removal::RemovalFlag,
    pub raft: Raft,
    /// The cluster this replica belongs to (checked on every Raft message).
    pub identity: Arc<ClusterIdentity>,
    pub state_machine: StateMachineStore,
    pub log: LogStore,
    /// Log time and the clocks' offsets ([`crate::clock`]).
    pub clock: Arc<ServerClock>,
    /// Held for the life of the node: the data directory's lock.
    pub data_dir: DataDir,
    /// See [`RaftSettings::peer_source_ip`].
    pub peer_source_ip: Option<std::net::IpAddr>,
    /// See [`RaftSettings::wire_format`].
    pub wire_format: u32,
    /// See [`RaftSettings::transport`].
    pub transport: crate::transport::Transport,
    /// What this replica shows on `/metrics` ([`crate::metrics`]).
    pub metrics: Arc<crate::metrics::Metrics>,
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
    /// The newest Raft wire format this replica reads and writes
    /// (`keel_storage::raft_wire`): the current one, or the one before to
    /// behave as the release before it did (mixed-release tests).
    pub wire_format: u32,
    /// How far replicas' clocks may differ (`--max-clock-offset-ms`): a
    /// replica further ahead of the middle of the cluster's clocks does not
    /// lead, and log time moves at most this far ahead of what a new leader
    /// heard (`keel_state::log_time`).
    pub max_clock_offset_ms: u64,
    /// How this replica reaches its peers (Raft, forwarded requests,
    /// bootstrap questions): plaintext or TLS with its member certificate.
    pub transport: crate::transport::Transport,
}

impl Default for RaftSettings {
    fn default() -> Self {
        RaftSettings {
            // When the leader's process ends, its followers see it at once
            // and stand then (`crate::leader_loss`). These timeouts decide
            // the rest (a frozen leader, a network fault): a follower
            // refuses to vote while it heard from a leader within the
            // longest election timeout (openraft's leader lease), so such a
            // failover takes about one to two election timeouts
            // (BENCHMARKS.md, "Failover of a three-replica cluster").
            heartbeat_interval_ms: 50,
            election_timeout_min_ms: 150,
            election_timeout_max_ms: 300,
            snapshot_every_entries: 10_000,
            keep_log_after_snapshot: 1000,
            peer_source_ip: None,
            wire_format: keel_storage::raft_wire::RAFT_WIRE_FORMAT,
            max_clock_offset_ms: keel_state::log_time::MAX_CLOCK_OFFSET_MS_DEFAULT,
            transport: crate::transport::Transport::Plain,
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
            // Per snapshot chunk (openraft's default is 200 ms). The last
            // chunk to a replica of the release before carries the whole
            // snapshot again, re-encoded (`raft_network`), and on a loaded
            // machine a 1 MiB chunk has taken longer than 200 ms.
            install_snapshot_timeout: 1000,
            ..Default::default()
        }
        .validate()
        .map_err(|e| RaftNodeError::Config(e.to_string()))
    }
}

impl std::fmt::Debug for RaftNode {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RaftNode")
            .field("id", &membership::show(self.id))
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
        member: u64,
        advertise_addr: &str,
        peers: &Peers,
        data_dir: DataDir,
        settings: &RaftSettings,
        clock: Arc<ServerClock>,
    ) -> Result<RaftNode, RaftNodeError> {
        let id = member;
        if !membership::is_member_id(id) {
            return Err(RaftNodeError::MemberIdOutOfRange {
                id,
                max: membership::MEMBER_ID_MAX,
            });
        }
        if let Some(bad) = peers.keys().find(|p| !membership::is_member_id(**p)) {
            return Err(RaftNodeError::MemberIdOutOfRange {
                id: *bad,
                max: membership::MEMBER_ID_MAX,
            });
        }
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
        // A replica removed from its cluster does not serve again as one.
        crate::removal::check_not_removed(data_dir.root())?;
        let log_dir = data_dir.raft_log_dir();
        let mut log = LogStore::open(&log_dir).map_err(|source| RaftNodeError::Log {
            path: log_dir.display().to_string(),
            source,
        })?;
        // The incarnation is made before anything is voted or appended, so
        // a directory with Raft state always has one (or predates them).
        let fresh = {
            use openraft::storage::RaftLogStorage;
            let state = log
                .get_log_state()
                .await
                .map_err(|e| RaftNodeError::Raft(e.to_string()))?;
            let vote = log
                .read_vote()
                .await
                .map_err(|e| RaftNodeError::Raft(e.to_string()))?;
            state.last_log_id.is_none() && state.last_purged_log_id.is_none() && vote.is_none()
        };
        let incarnation =
            membership::load_or_create_incarnation(&data_dir.root().join("incarnation"), fresh)?;
        let raft_id = membership::raft_id(member, incarnation);
        let strangers = Strangers::default();
        let removal = crate::removal::RemovalFlag::default();
        let state_machine = StateMachineStore::open(&data_dir.state_dir())?;
        // No stamp is earlier than what the log already holds.
        clock.saw_entry(state_machine.shared().read().state.last_entry_at_ms());
        // Pinned to the wire format before: its snapshot format too.
        state_machine.use_snapshot_format(keel_storage::snapshot_codec::snapshot_format_for_wire(
            settings.wire_format,
        ));
        let identity_path = data_dir.root().join("cluster-id");
        let identity_error = |source| RaftNodeError::ClusterId {
            path: identity_path.display().to_string(),
            source,
        };
        let identity =
            Arc::new(ClusterIdentity::load(identity_path.clone()).map_err(identity_error)?);
        let config = settings.openraft_config()?;
        let raft = Raft::new(
            raft_id,
            Arc::new(config),
            GrpcNetwork::new(
                identity.clone(),
                settings.peer_source_ip,
                settings.transport.clone(),
                strangers.clone(),
                settings.wire_format,
                clock.clone(),
            )
            .telling(raft_id, removal.clone()),
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
            let config = raft.metrics().borrow().membership_config.clone();
            // Only a membership that never changed since bootstrap (its log
            // id is the initial one) is held against --peers, by member id.
            let never_changed = config.log_id().is_none_or(|l| l.index == 0);
            let stored: std::collections::BTreeSet<u64> =
                stored.iter().map(|r| membership::member_of(*r)).collect();
            let given: std::collections::BTreeSet<u64> = peers.keys().copied().collect();
            if !peers.is_empty() && never_changed && stored != given {
                return Err(RaftNodeError::PeersMismatch {
                    stored: show(stored),
                    given: show(given),
                });
            }
            tracing::info!(id, voters = %show(stored), "recovered from the data directory");
        } else if peers.is_empty() {
            let members = BTreeMap::from([(
                raft_id,
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
            // In the background, so the API answers (cluster status, the
            // peers' own bootstrap questions) while this replica waits.
            tokio::spawn(bootstrap_when_a_majority_answers(
                id,
                raft_id,
                peers.clone(),
                raft.clone(),
                identity.clone(),
                settings.transport.clone(),
            ));
        } else {
            tracing::info!(
                id,
                incarnation = %format!("{incarnation:012x}"),
                "waiting for the cluster's leader to reach this replica (a member whose data \
                 directory is new joins as a learner first)"
            );
        }
        let metrics = Arc::new(crate::metrics::Metrics::new().reading(
            crate::metrics::StateCollector {
                raft: raft.clone(),
                state_machine: state_machine.clone(),
                log: log.clone(),
            },
        ));
        Ok(RaftNode {
            metrics,
            id: raft_id,
            strangers,
            removal,
            raft,
            identity,
            state_machine,
            log,
            clock,
            data_dir,
            peer_source_ip: settings.peer_source_ip,
            wire_format: settings.wire_format,
            transport: settings.transport.clone(),
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

    const FREE: PeerAnswer = PeerAnswer::Uninitialised { raft_id: 0 };

    fn answers(list: &[(u64, PeerAnswer)]) -> BTreeMap<u64, PeerAnswer> {
        list.iter().copied().collect()
    }

    /// The names `text` binds to a receiver of the full Raft metrics
    /// (`let [mut] NAME = ....metrics();`).
    fn full_metrics_receivers(text: &str) -> Vec<String> {
        text.lines()
            .filter_map(|line| {
                let rest = line.trim().strip_prefix("let ")?;
                let rest = rest.strip_prefix("mut ").unwrap_or(rest);
                let (name, value) = rest.split_once(" = ")?;
                value
                    .trim_end()
                    .ends_with(".metrics();")
                    .then(|| name.to_string())
            })
            .collect()
    }

    /// No loop in the server waits on every change of `raft.metrics()`,
    /// which openraft sends several times per write on every replica
    /// (ARCHITECTURE, Invariants): such a receiver is read, never awaited;
    /// a loop watching leadership or membership waits on
    /// `raft.server_metrics()`.
    #[test]
    fn no_loop_awaits_every_change_of_the_full_raft_metrics() {
        assert_eq!(
            full_metrics_receivers(
                "let mut metrics = node.raft.metrics();\nlet m = raft.server_metrics();"
            ),
            vec!["metrics".to_string()]
        );
        let mut read = 0;
        let mut dirs = vec![std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("src")];
        while let Some(dir) = dirs.pop() {
            for entry in std::fs::read_dir(&dir).expect("the sources").flatten() {
                let path = entry.path();
                if path.is_dir() {
                    dirs.push(path);
                    continue;
                }
                if path.extension().is_none_or(|e| e != "rs") {
                    continue;
                }
                let text = std::fs::read_to_string(&path).expect("a source");
                read += 1;
                for name in full_metrics_receivers(&text) {
                    let awaited = format!("{name}.changed()");
                    // `name` whole: `server_metrics.changed()` is not `metrics`'s.
                    let whole = text.match_indices(&awaited).any(|(at, _)| {
                        text[..at]
                            .chars()
                            .next_back()
                            .is_none_or(|c| !(c.is_alphanumeric() || c == '_'))
                    });
                    assert!(
                        !whole,
                        "{}: `{name}` (raft.metrics()) is awaited with changed(): \
                         wait on raft.server_metrics() instead",
                        path.display()
                    );
                }
            }
        }
        assert!(read > 20, "read only {read} sources");
    }

    #[test]
    fn bootstrap_initialises_only_with_a_majority_that_holds_no_cluster() {
        use PeerAnswer::*;
        // Three members: this one and one more that holds nothing make a majority.
        assert_eq!(
            bootstrap(3, &answers(&[(2, FREE), (3, Unreachable)])),
            Bootstrap::Initialise
        );
        // Both others silent: a first start, or a wiped member whose
        // cluster is out of reach. Ask again.
        assert_eq!(
            bootstrap(3, &answers(&[(2, Unreachable), (3, Unreachable)])),
            Bootstrap::AskAgain {
                uninitialised: 1,
                needed: 2
            }
        );
        // Any member that knows a cluster wins over any count of empty ones.
        assert_eq!(
            bootstrap(3, &answers(&[(2, FREE), (3, Initialised)])),
            Bootstrap::Join { peer: 3 }
        );
        // Five members need three.
        assert_eq!(
            bootstrap(
                5,
                &answers(&[
                    (2, FREE),
                    (3, Unreachable),
                    (4, Unreachable),
                    (5, Unreachable)
                ])
            ),
            Bootstrap::AskAgain {
                uninitialised: 2,
                needed: 3
            }
        );
        assert_eq!(
            bootstrap(
                5,
                &answers(&[(2, FREE), (3, Unreachable), (4, FREE), (5, Unreachable)])
            ),
            Bootstrap::Initialise
        );
        // Two members: both must hold nothing.
        assert_eq!(
            bootstrap(2, &answers(&[(2, Unreachable)])),
            Bootstrap::AskAgain {
                uninitialised: 1,
                needed: 2
            }
        );
    }

    #[tokio::test]
    async fn a_member_id_outside_16_bits_is_refused_at_start() {
        let dir = tempfile::tempdir().expect("tempdir");
        for id in [0, 70_000] {
            let err = RaftNode::start(
                id,
                "127.0.0.1:1",
                &Peers::new(),
                DataDir::open(dir.path().join(format!("r{id}"))).expect("data dir"),
                &RaftSettings::default(),
                ServerClock::new(crate::api::system_clock(), 500),
            )
            .await
            .expect_err("refused");
            assert_eq!(
                err.to_string(),
                format!("--id {id} is out of range: member ids are 1 to 65535")
            );
        }
    }

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
            ServerClock::new(crate::api::system_clock(), 500),
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
