//! Raft between replicas over gRPC (`keel.raft.v1`).
//!
//! [`GrpcNetwork`] is openraft's network: one lazily connected channel per
//! peer, a deadline on every call from openraft's `RPCOption`, and errors
//! mapped so openraft backs off from unreachable peers. [`RaftService`] is
//! the receiving side, served on the same port as the client API. Payloads
//! are openraft's own request and response types, encoded with postcard.
//! Snapshots travel as openraft's chunks (`snapshot_max_chunk_size`), one
//! call per chunk.
//!
//! Every message carries the sender's cluster id ([`ClusterIdentity`]); a
//! replica refuses messages from another cluster, so a member restarted
//! with the wrong `--peers` or at a reused address never mixes two
//! clusters' logs. Every message also names the Raft id it is for (a
//! member id and an incarnation, `membership`): a replica refuses messages
//! for another incarnation of itself, answering with its own Raft id, which
//! the sender keeps in [`Strangers`] for the leader's repair. A replica that
//! lost its disk therefore neither votes nor acknowledges entries until it
//! has been re-admitted.

use std::path::PathBuf;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use keel_proto::raft::raft_client::RaftClient;
use keel_proto::raft::raft_server::Raft as RaftRpc;
use keel_proto::raft::RaftMessage;
use keel_storage::TypeConfig;
use openraft::error::{
    InstallSnapshotError, NetworkError, RPCError, RaftError, RemoteError, Timeout, Unreachable,
};
use openraft::network::{RPCOption, RaftNetwork, RaftNetworkFactory};
use openraft::raft::{
    AppendEntriesRequest, AppendEntriesResponse, InstallSnapshotRequest, InstallSnapshotResponse,
    VoteRequest, VoteResponse,
};
use openraft::BasicNode;
use serde::de::DeserializeOwned;
use serde::Serialize;
use tonic::transport::{Channel, Endpoint};
use tonic::{Request, Response, Status};

use crate::membership::{self, Strangers};
use crate::raft_node::Raft;

/// Largest Raft message accepted or sent: a batch of entries
/// (`max_payload_entries` proposals of at most 4 MiB each) or one snapshot
/// chunk.
pub const RAFT_MESSAGE_MAX_BYTES: usize = 256 * 1024 * 1024;

fn encode<T: Serialize>(value: &T) -> Result<Vec<u8>, postcard::Error> {
    postcard::to_allocvec(value)
}

fn decode<T: DeserializeOwned>(bytes: &[u8]) -> Result<T, postcard::Error> {
    postcard::from_bytes(bytes)
}

/// Metadata naming the sender's cluster on every Raft message.
const CLUSTER_ID_HEADER: &str = "keel-cluster-id";

/// Metadata naming the Raft id a message is for.
const TO_HEADER: &str = "keel-to";

/// Metadata of a refusal naming the refusing replica's Raft id.
const REFUSED_BY_HEADER: &str = "keel-raft-id";

/// Longest cluster id accepted from a peer.
const CLUSTER_ID_MAX_LEN: usize = 64;

/// Which cluster this replica belongs to: an id made by the member that
/// initialised the cluster, learnt by the others from the first leader
/// message they accept, and kept in `DATA/cluster-id`.
#[derive(Debug)]
pub struct ClusterIdentity {
    path: PathBuf,
    id: Mutex<Option<String>>,
}

/// What a replica does with a message from `theirs`.
#[derive(Debug, PartialEq, Eq)]
enum Admission {
    Accept,
    /// Accept, and belong to `theirs` from now on.
    Adopt,
    Refuse {
        mine: String,
    },
}

impl ClusterIdentity {
    /// Reads the id kept in `path`, if any.
    pub fn load(path: PathBuf) -> std::io::Result<ClusterIdentity> {
        let id = match std::fs::read_to_string(&path) {
            Ok(s) => Some(s.trim().to_string()).filter(|s| !s.is_empty()),
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => None,
            Err(e) => return Err(e),
        };
        Ok(ClusterIdentity {
            path,
            id: Mutex::new(id),
        })
    }

    pub fn get(&self) -> Option<String> {
        self.id.lock().unwrap_or_else(|e| e.into_inner()).clone()
    }

    /// Makes a new id (when this replica initialises a cluster).
    pub fn create(&self, replica: u64) -> std::io::Result<String> {
        let nanos = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(0, |d| d.as_nanos());
        let id = format!("{nanos:x}-{:x}-{replica}", std::process::id());
        self.set(&id)?;
        Ok(id)
    }

    /// Keeps `id`, whole or not at all, durably (a synced temporary file
    /// renamed over it, the directory synced).
    fn set(&self, id: &str) -> std::io::Result<()> {
        use std::io::Write;
        let mut file = atomic_write_file::AtomicWriteFile::open(&self.path)?;
        file.write_all(id.as_bytes())?;
        file.commit()?;
        *self.id.lock().unwrap_or_else(|e| e.into_inner()) = Some(id.to_string());
        Ok(())
    }

    fn admit(&self, theirs: Option<&str>, from_leader: bool) -> Admission {
        match (self.get(), theirs) {
            (Some(mine), Some(theirs)) if mine != theirs => Admission::Refuse { mine },
            (None, Some(_)) if from_leader => Admission::Adopt,
            _ => Admission::Accept,
        }
    }

    /// Checks a received message's cluster id: refused if it is another
    /// cluster's; `Some(id)` if this replica has none yet and the message
    /// comes from a leader (to [`ClusterIdentity::adopt`] once the message
    /// is known to be for this replica).
    fn check<T>(&self, request: &Request<T>, from_leader: bool) -> Result<Option<String>, Status> {
        let theirs = request
            .metadata()
            .get(CLUSTER_ID_HEADER)
            .and_then(|v| v.to_str().ok())
            .filter(|v| v.len() <= CLUSTER_ID_MAX_LEN);
        match self.admit(theirs, from_leader) {
            Admission::Accept => Ok(None),
            Admission::Adopt => Ok(Some(theirs.unwrap_or_default().to_string())),
            Admission::Refuse { mine } => {
                let theirs = theirs.unwrap_or_default();
                tracing::warn!(
                    mine = %mine,
                    theirs,
                    "refused a Raft message from another cluster"
                );
                Err(Status::failed_precondition(format!(
                    "cluster id mismatch: this replica belongs to cluster {mine}, the message \
                     came from cluster {theirs} (check --peers and the addresses)"
                )))
            }
        }
    }

    /// Belongs to cluster `id` from now on.
    fn adopt(&self, id: &str) -> Result<(), Status> {
        tracing::info!(cluster_id = id, "joined cluster");
        self.set(id)
            .map_err(|e| Status::internal(format!("cannot keep the cluster id: {e}")))
    }
}

/// Makes a [`GrpcPeer`] for each peer openraft replicates to.
#[derive(Debug, Clone)]
pub struct GrpcNetwork {
    identity: Arc<ClusterIdentity>,
    source_ip: Option<std::net::IpAddr>,
    strangers: Strangers,
}

impl GrpcNetwork {
    /// Connections to peers bind to `source_ip` when given; peers that
    /// answer as another incarnation are kept in `strangers`.
    pub fn new(
        identity: Arc<ClusterIdentity>,
        source_ip: Option<std::net::IpAddr>,
        strangers: Strangers,
    ) -> GrpcNetwork {
        GrpcNetwork {
            identity,
            source_ip,
            strangers,
        }
    }
}

impl RaftNetworkFactory<TypeConfig> for GrpcNetwork {
    type Network = GrpcPeer;

    async fn new_client(&mut self, target: u64, node: &BasicNode) -> GrpcPeer {
        let mut peer = GrpcPeer::new(target, &node.addr, self.identity.clone());
        peer.source_ip = self.source_ip;
        peer.strangers = self.strangers.clone();
        peer
    }
}

/// One peer: its address and a lazily connected channel.
#[derive(Debug)]
pub struct GrpcPeer {
    target: u64,
    addr: String,
    client: Option<RaftClient<Channel>>,
    identity: Arc<ClusterIdentity>,
    source_ip: Option<std::net::IpAddr>,
    strangers: Strangers,
}

impl GrpcPeer {
    fn new(target: u64, addr: &str, identity: Arc<ClusterIdentity>) -> GrpcPeer {
        GrpcPeer {
            target,
            addr: addr.to_string(),
            client: None,
            identity,
            source_ip: None,
            strangers: Strangers::default(),
        }
    }

    fn client(&mut self) -> Result<RaftClient<Channel>, tonic::transport::Error> {
        if let Some(c) = &self.client {
            return Ok(c.clone());
        }
        let url = if self.addr.contains("://") {
            self.addr.clone()
        } else {
            format!("http://{}", self.addr)
        };
        let channel = Endpoint::from_shared(url)?
            .local_address(self.source_ip)
            .connect_timeout(Duration::from_millis(500))
            .tcp_nodelay(true)
            .http2_keep_alive_interval(Duration::from_secs(10))
            .connect_lazy();
        let client = RaftClient::new(channel)
            .max_decoding_message_size(RAFT_MESSAGE_MAX_BYTES)
            .max_encoding_message_size(RAFT_MESSAGE_MAX_BYTES);
        self.client = Some(client.clone());
        Ok(client)
    }

    /// One call: encode, send with a deadline, decode the remote `Result`.
    async fn call<Req, Resp, E>(
        &mut self,
        kind: RpcKind,
        request: &Req,
        option: &RPCOption,
    ) -> Result<Resp, RPCError<u64, BasicNode, E>>
    where
        Req: Serialize,
        Resp: DeserializeOwned,
        E: std::error::Error + DeserializeOwned,
    {
        let network = |e: &dyn std::error::Error| {
            RPCError::Network(NetworkError::new(&std::io::Error::other(e.to_string())))
        };
        let payload = encode(request).map_err(|e| network(&e))?;
        let mut client = self.client().map_err(|e| {
            RPCError::Unreachable(Unreachable::new(&std::io::Error::other(e.to_string())))
        })?;
        let ttl = option.hard_ttl();
        let mut req = Request::new(RaftMessage { payload });
        req.set_timeout(ttl);
        if let Some(id) = self
            .identity
            .get()
            .and_then(|id| tonic::metadata::MetadataValue::try_from(id).ok())
        {
            req.metadata_mut().insert(CLUSTER_ID_HEADER, id);
        }
        req.metadata_mut()
            .insert(TO_HEADER, tonic::metadata::MetadataValue::from(self.target));
        let call = async {
            match kind {
                RpcKind::AppendEntries => client.append_entries(req).await,
                RpcKind::Vote => client.vote(req).await,
                RpcKind::InstallSnapshot => client.install_snapshot(req).await,
            }
        };
        let reply = match tokio::time::timeout(ttl, call).await {
            Err(_) => {
                return Err(RPCError::Timeout(Timeout {
                    action: kind.action(),
                    id: 0,
                    target: self.target,
                    timeout: ttl,
                }))
            }
            Ok(Err(status)) => {
                // Another incarnation of the member answered: it takes no
                // part until the leader re-admits it (`membership`).
                if let Some(found) = refused_by(&status) {
                    self.strangers.saw(self.target, found);
                    return Err(RPCError::Unreachable(Unreachable::new(
                        &std::io::Error::other(status.message().to_string()),
                    )));
                }
                // A peer that is down or not listening: drop the channel so
                // the next call reconnects, and let openraft back off.
                if matches!(
                    status.code(),
                    tonic::Code::Unavailable | tonic::Code::Unknown
                ) {
                    self.client = None;
                    return Err(RPCError::Unreachable(Unreachable::new(
                        &std::io::Error::other(status.message().to_string()),
                    )));
                }
                return Err(network(&status));
            }
            Ok(Ok(reply)) => {
                self.strangers.answered(self.target);
                reply.into_inner()
            }
        };
        let result: Result<Resp, E> = decode(&reply.payload).map_err(|e| network(&e))?;
        result.map_err(|e| RPCError::RemoteError(RemoteError::new(self.target, e)))
    }
}

#[derive(Debug, Clone, Copy)]
enum RpcKind {
    AppendEntries,
    Vote,
    InstallSnapshot,
}

impl RpcKind {
    fn action(self) -> openraft::RPCTypes {
        match self {
            RpcKind::AppendEntries => openraft::RPCTypes::AppendEntries,
            RpcKind::Vote => openraft::RPCTypes::Vote,
            RpcKind::InstallSnapshot => openraft::RPCTypes::InstallSnapshot,
        }
    }
}

impl RaftNetwork<TypeConfig> for GrpcPeer {
    async fn append_entries(
        &mut self,
        rpc: AppendEntriesRequest<TypeConfig>,
        option: RPCOption,
    ) -> Result<AppendEntriesResponse<u64>, RPCError<u64, BasicNode, RaftError<u64>>> {
        self.call(RpcKind::AppendEntries, &rpc, &option).await
    }

    async fn install_snapshot(
        &mut self,
        rpc: InstallSnapshotRequest<TypeConfig>,
        option: RPCOption,
    ) -> Result<
        InstallSnapshotResponse<u64>,
        RPCError<u64, BasicNode, RaftError<u64, InstallSnapshotError>>,
    > {
        // A snapshot chunk (up to a MiB) is not sent to an address known to
        // answer as another incarnation: it would be refused after the
        // transfer. Heartbeats still go, and keep the record fresh.
        if let Some(found) = self.strangers.snapshot().get(&self.target) {
            return Err(RPCError::Unreachable(Unreachable::new(
                &std::io::Error::other(format!(
                    "{} answers at this address now, not {}",
                    crate::membership::show(*found),
                    crate::membership::show(self.target)
                )),
            )));
        }
        self.call(RpcKind::InstallSnapshot, &rpc, &option).await
    }

    async fn vote(
        &mut self,
        rpc: VoteRequest<u64>,
        option: RPCOption,
    ) -> Result<VoteResponse<u64>, RPCError<u64, BasicNode, RaftError<u64>>> {
        self.call(RpcKind::Vote, &rpc, &option).await
    }
}

/// The Raft id a refusal names: the refusing replica is another
/// incarnation of the member the message was for.
fn refused_by(status: &Status) -> Option<u64> {
    if status.code() != tonic::Code::FailedPrecondition {
        return None;
    }
    status
        .metadata()
        .get(REFUSED_BY_HEADER)?
        .to_str()
        .ok()?
        .parse()
        .ok()
}

/// The Raft id a received message names as its addressee, if any.
fn addressee<T>(request: &Request<T>) -> Option<u64> {
    request
        .metadata()
        .get(TO_HEADER)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.parse::<u64>().ok())
}

/// Refuses a message that is not for `me` (its `keel-to` names another
/// incarnation of this member, or nothing), naming `me` in the answer.
fn check_addressed_to<T>(me: u64, request: &Request<T>) -> Result<(), Status> {
    let to = addressee(request);
    if to == Some(me) {
        return Ok(());
    }
    let mut status = Status::failed_precondition(format!(
        "this replica is Raft member {}, the message was for {}: a member whose data \
         directory is new takes no part in votes or quorums until the leader re-admits it",
        membership::show(me),
        to.map_or_else(
            || "no member (a sender older than incarnations)".into(),
            membership::show
        ),
    ));
    status
        .metadata_mut()
        .insert(REFUSED_BY_HEADER, tonic::metadata::MetadataValue::from(me));
    Err(status)
}

/// The receiving side: hands each message to the local Raft.
#[derive(Clone)]
pub struct RaftService {
    raft: Raft,
    /// This replica's Raft id: messages for any other are refused.
    me: u64,
    identity: Arc<ClusterIdentity>,
    /// The addressee of the last message refused as not for this replica
    /// (a refusal is logged when it names another than the last).
    last_refused: Arc<Mutex<Option<Option<u64>>>>,
}

impl std::fmt::Debug for RaftService {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RaftService").finish_non_exhaustive()
    }
}

impl RaftService {
    pub fn new(raft: Raft, me: u64, identity: Arc<ClusterIdentity>) -> RaftService {
        RaftService {
            raft,
            me,
            identity,
            last_refused: Arc::default(),
        }
    }

    /// Admits a received message: refused if it comes from another cluster
    /// or is for another incarnation of this member (logged when the
    /// addressee changes); a replica without a cluster id adopts the one a
    /// leader's message carries, once the message is known to be for it.
    fn admit<T>(&self, request: &Request<T>, from_leader: bool) -> Result<(), Status> {
        let adopt = self.identity.check(request, from_leader)?;
        check_addressed_to(self.me, request).inspect_err(|status| {
            let to = Some(addressee(request));
            let mut last = self.last_refused.lock().unwrap_or_else(|p| p.into_inner());
            if *last != to {
                *last = to;
                tracing::warn!("{}", status.message());
            }
        })?;
        match adopt {
            Some(id) => self.identity.adopt(&id),
            None => Ok(()),
        }
    }
}

fn bad_payload(e: postcard::Error) -> Status {
    Status::invalid_argument(format!("undecodable Raft message: {e}"))
}

fn reply<T: Serialize>(result: &T) -> Result<Response<RaftMessage>, Status> {
    let payload = encode(result).map_err(|e| Status::internal(e.to_string()))?;
    Ok(Response::new(RaftMessage { payload }))
}

#[tonic::async_trait]
impl RaftRpc for RaftService {
    async fn append_entries(
        &self,
        request: Request<RaftMessage>,
    ) -> Result<Response<RaftMessage>, Status> {
        self.admit(&request, true)?;
        let req: AppendEntriesRequest<TypeConfig> =
            decode(&request.into_inner().payload).map_err(bad_payload)?;
        reply(&self.raft.append_entries(req).await)
    }

    async fn vote(&self, request: Request<RaftMessage>) -> Result<Response<RaftMessage>, Status> {
        self.admit(&request, false)?;
        let req: VoteRequest<u64> = decode(&request.into_inner().payload).map_err(bad_payload)?;
        reply(&self.raft.vote(req).await)
    }

    async fn install_snapshot(
        &self,
        request: Request<RaftMessage>,
    ) -> Result<Response<RaftMessage>, Status> {
        self.admit(&request, true)?;
        let req: InstallSnapshotRequest<TypeConfig> =
            decode(&request.into_inner().payload).map_err(bad_payload)?;
        reply(&self.raft.install_snapshot(req).await)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_message_for_another_incarnation_is_refused_naming_this_one() {
        let me = membership::raft_id(3, 9);
        let request = |to: Option<u64>| {
            let mut r = Request::new(());
            if let Some(to) = to {
                r.metadata_mut()
                    .insert(TO_HEADER, tonic::metadata::MetadataValue::from(to));
            }
            r
        };
        assert!(check_addressed_to(me, &request(Some(me))).is_ok());
        for to in [Some(membership::raft_id(3, 4)), Some(3), None] {
            let refused = check_addressed_to(me, &request(to)).expect_err("refused");
            assert_eq!(refused_by(&refused), Some(me), "{to:?}");
        }
    }

    #[test]
    fn a_replica_refuses_another_cluster_and_adopts_only_from_a_leader() {
        let dir = tempfile::tempdir().expect("tempdir");
        let path = dir.path().join("cluster-id");
        let fresh = ClusterIdentity::load(path.clone()).expect("load");
        assert_eq!(fresh.admit(Some("a"), false), Admission::Accept);
        assert_eq!(fresh.get(), None, "a vote request does not brand a replica");
        assert_eq!(fresh.admit(Some("a"), true), Admission::Adopt);
        fresh.set("a").expect("set");
        assert_eq!(fresh.admit(Some("a"), true), Admission::Accept);
        assert_eq!(
            fresh.admit(Some("b"), true),
            Admission::Refuse { mine: "a".into() }
        );
        assert_eq!(
            fresh.admit(None, true),
            Admission::Accept,
            "a peer without an id"
        );
        let reloaded = ClusterIdentity::load(path).expect("reload");
        assert_eq!(reloaded.get().as_deref(), Some("a"), "kept across restarts");
        let made = reloaded.create(1).expect("create");
        assert_ne!(made, "a");
    }
}
