//! Raft between replicas over gRPC (`keel.raft.v1`).
//!
//! [`GrpcNetwork`] is openraft's network: one lazily connected channel per
//! peer, a deadline on every call from openraft's `RPCOption`, and errors
//! mapped so openraft backs off from unreachable peers. [`RaftService`] is
//! the receiving side, served on the same port as the client API. Snapshots
//! travel as openraft's chunks (`snapshot_max_chunk_size`), one call per
//! chunk. AppendEntries go on one stream per peer held open
//! (`AppendEntriesStream`, a request and its reply per message): gRPC was
//! a quarter of a follower's CPU at one client, most of it AppendEntries
//! as unary calls, each a new HTTP/2 stream and a task (BENCHMARKS.md,
//! "One client: the journal's batches and a stream to each follower"). A
//! peer without it (a release before) gets unary calls.
//!
//! Payloads are versioned (`keel_storage::raft_wire`): format 2 is protobuf
//! (`keel.replication.v1`), format 1 openraft's types in postcard, as the
//! releases before format 2 sent them. A replica reads both, answers in the
//! format it was asked in, and says the newest it reads; a [`GrpcPeer`]
//! writes the newest both ends read, and format 1 until the peer has
//! answered on the current connection (`raft_wire::send_format`). So a
//! cluster keeps working while its members are upgraded one at a time.
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
use keel_proto::raft::{FollowLeaderRequest, RaftMessage};
use keel_storage::raft_wire::{self, WireError, WireMessage};
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
use tonic::transport::Channel;
use tonic::{Request, Response, Status};

use crate::clock::ServerClock;
use crate::membership::{self, Strangers};
use crate::raft_node::Raft;

/// Largest Raft message accepted or sent: a batch of entries
/// (`max_payload_entries` proposals of at most 4 MiB each) or one snapshot
/// chunk.
pub const RAFT_MESSAGE_MAX_BYTES: usize = 256 * 1024 * 1024;

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

/// Names this replica's cluster and the Raft id `to` a message is for in
/// its metadata (every Raft call carries both).
pub(crate) fn address<T>(request: &mut Request<T>, identity: &ClusterIdentity, to: u64) {
    if let Some(id) = identity
        .get()
        .and_then(|id| tonic::metadata::MetadataValue::try_from(id).ok())
    {
        request.metadata_mut().insert(CLUSTER_ID_HEADER, id);
    }
    request
        .metadata_mut()
        .insert(TO_HEADER, tonic::metadata::MetadataValue::from(to));
}

/// Makes a [`GrpcPeer`] for each peer openraft replicates to.
#[derive(Debug, Clone)]
pub struct GrpcNetwork {
    identity: Arc<ClusterIdentity>,
    source_ip: Option<std::net::IpAddr>,
    transport: crate::transport::Transport,
    strangers: Strangers,
    wire_format: u32,
    formats: PeerFormats,
    clock: Arc<ServerClock>,
    /// This replica's Raft id and where a peer's word of its removal goes.
    removal: Option<(u64, crate::removal::RemovalFlag)>,
}

/// What each peer said it reads, shared by the clients openraft makes for
/// it (it makes a new one per replication stream and per election).
#[derive(Debug, Clone, Default)]
struct PeerFormats(Arc<Mutex<std::collections::BTreeMap<u64, PeerFormat>>>);

#[derive(Debug, Default)]
struct PeerFormat {
    /// The newest format the peer said it reads since its connection was
    /// made (`None`: it has not answered yet).
    reads: Option<u32>,
    /// The format last logged as the one written to it (a change is logged
    /// once, not at every reconnection).
    logged: Option<u32>,
    /// Its silence was said (once, until it answers again).
    silent: bool,
}

impl PeerFormats {
    fn lock(&self) -> std::sync::MutexGuard<'_, std::collections::BTreeMap<u64, PeerFormat>> {
        self.0.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// The format to write to `peer` by a replica reading up to `mine`.
    fn send_format(&self, peer: u64, mine: u32) -> u32 {
        let reads = self.lock().get(&peer).and_then(|p| p.reads);
        raft_wire::send_format(mine, reads)
    }

    /// What `peer` said it reads since its connection was made (`None`: it
    /// has not answered).
    fn reads(&self, peer: u64) -> Option<u32> {
        self.lock().get(&peer).and_then(|p| p.reads)
    }

    /// Forgets what `peer` reads (its connection dropped or a call failed:
    /// it may be another release now).
    fn forget(&self, peer: u64) {
        if let Some(p) = self.lock().get_mut(&peer) {
            p.reads = None;
        }
    }

    /// `peer` did not answer: whether that is news (it answered, or was
    /// never heard of, until now), to say once.
    fn went_silent(&self, peer: u64) -> bool {
        let mut all = self.lock();
        let p = all.entry(peer).or_default();
        !std::mem::replace(&mut p.silent, true)
    }

    /// `peer` answered: whether it had been said to be silent.
    fn heard(&self, peer: u64) -> bool {
        self.lock()
            .get_mut(&peer)
            .is_some_and(|p| std::mem::replace(&mut p.silent, false))
    }

    /// `peer` answered saying it reads up to `reads`: the format to write
    /// to it from now on, if that is not the one last logged.
    fn answered(&self, peer: u64, reads: u32, mine: u32) -> Option<u32> {
        let mut all = self.lock();
        let p = all.entry(peer).or_default();
        p.reads = Some(reads);
        let writes = raft_wire::send_format(mine, p.reads);
        (p.logged != Some(writes)).then(|| {
            p.logged = Some(writes);
            writes
        })
    }
}

impl GrpcNetwork {
    /// Connections to peers bind to `source_ip` when given; peers that
    /// answer as another incarnation are kept in `strangers`; messages are
    /// written in at most `wire_format` (`raft_wire::RAFT_WIRE_FORMAT`
    /// unless pinned to the one before).
    pub fn new(
        identity: Arc<ClusterIdentity>,
        source_ip: Option<std::net::IpAddr>,
        transport: crate::transport::Transport,
        strangers: Strangers,
        wire_format: u32,
        clock: Arc<ServerClock>,
    ) -> GrpcNetwork {
        GrpcNetwork {
            identity,
            source_ip,
            transport,
            strangers,
            wire_format,
            formats: PeerFormats::default(),
            clock,
            removal: None,
        }
    }

    /// Peers that refuse this replica's (`me`'s) vote because it was
    /// removed say so into `flag` ([`crate::removal`]).
    pub fn telling(mut self, me: u64, flag: crate::removal::RemovalFlag) -> GrpcNetwork {
        self.removal = Some((me, flag));
        self
    }
}

impl RaftNetworkFactory<TypeConfig> for GrpcNetwork {
    type Network = GrpcPeer;

    async fn new_client(&mut self, target: u64, node: &BasicNode) -> GrpcPeer {
        let mut peer = GrpcPeer::new(target, &node.addr, self.identity.clone());
        peer.source_ip = self.source_ip;
        peer.transport = self.transport.clone();
        peer.strangers = self.strangers.clone();
        peer.wire_format = self.wire_format;
        peer.formats = self.formats.clone();
        peer.clock = Some(self.clock.clone());
        peer.removal = self.removal.clone();
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
    transport: crate::transport::Transport,
    strangers: Strangers,
    /// The newest wire format this replica writes.
    wire_format: u32,
    /// What the peers said they read.
    formats: PeerFormats,
    /// A snapshot gathered for a peer that reads wire format 1 only (its
    /// id and the bytes so far): sent once whole, in the snapshot format
    /// that release reads.
    gathered: Option<(String, Vec<u8>)>,
    /// This replica's clocks: each message says its wall clock and log
    /// time and the peer's offset, each reply the peer's clock.
    clock: Option<Arc<ServerClock>>,
    /// This replica's Raft id and where a peer's word of its removal goes.
    removal: Option<(u64, crate::removal::RemovalFlag)>,
    /// The AppendEntries stream to the peer, once opened and while no
    /// request is awaiting its reply on it (`append_on_stream`); dropped
    /// with the channel.
    append_stream: Option<AppendStream>,
    /// The peer answered `AppendEntriesStream` with UNIMPLEMENTED (a
    /// release before it): unary calls until the channel is dropped.
    no_append_stream: bool,
}

/// An open `AppendEntriesStream`: requests in, replies in the same order.
#[derive(Debug)]
struct AppendStream {
    requests: tokio::sync::mpsc::Sender<RaftMessage>,
    replies: tonic::Streaming<RaftMessage>,
}

impl GrpcPeer {
    fn new(target: u64, addr: &str, identity: Arc<ClusterIdentity>) -> GrpcPeer {
        GrpcPeer {
            target,
            addr: addr.to_string(),
            client: None,
            identity,
            source_ip: None,
            transport: crate::transport::Transport::Plain,
            strangers: Strangers::default(),
            wire_format: raft_wire::RAFT_WIRE_FORMAT,
            formats: PeerFormats::default(),
            clock: None,
            gathered: None,
            removal: None,
            append_stream: None,
            no_append_stream: false,
        }
    }

    fn client(&mut self) -> Result<RaftClient<Channel>, crate::transport::ConnectError> {
        if let Some(c) = &self.client {
            return Ok(c.clone());
        }
        let endpoint = self
            .transport
            .endpoint(&self.addr)?
            .connect_timeout(Duration::from_millis(500))
            .tcp_nodelay(true)
            .http2_keep_alive_interval(Duration::from_secs(10));
        // With TLS, the peer must show the certificate of the member it is.
        let channel = self.transport.lazy(
            endpoint,
            crate::transport::Peer::Member(membership::member_of(self.target)),
            self.source_ip,
        )?;
        let client = RaftClient::new(channel)
            .max_decoding_message_size(RAFT_MESSAGE_MAX_BYTES)
            .max_encoding_message_size(RAFT_MESSAGE_MAX_BYTES);
        self.client = Some(client.clone());
        Ok(client)
    }

    /// Says, once until it answers again, that the peer does not answer and
    /// what to check (openraft retries it every heartbeat, and says so at
    /// most once a minute: see `log_limit`).
    fn say_silent(&self, why: &str) {
        if self.formats.went_silent(self.target) {
            tracing::warn!(
                peer = %membership::show(self.target),
                addr = %self.addr,
                error = %why,
                "a peer does not answer; Raft keeps trying it. Check that it runs and \
                 that --peers gives its address (this is said again only after it has answered)"
            );
        }
    }

    /// Forgets the channel, and with it what the peer said it reads (a
    /// replica restarted at the address may run another release).
    fn disconnect(&mut self) {
        self.client = None;
        self.append_stream = None;
        self.no_append_stream = false;
        self.formats.forget(self.target);
    }

    /// A unary request to the peer: addressed, with its deadline.
    fn unary(&self, message: RaftMessage, ttl: Duration) -> Request<RaftMessage> {
        let mut req = Request::new(message);
        req.set_timeout(ttl);
        address(&mut req, &self.identity, self.target);
        req
    }

    /// Sends one AppendEntries on the stream to the peer, opening it first
    /// if none is open, and waits for its reply. A peer that has no such
    /// stream gets a unary call, now and until the channel is dropped.
    ///
    /// The stream is held here while its reply is awaited and put back
    /// only after the reply: an error, a closed stream or a caller that
    /// stops waiting (a late reply would answer the next request) drops it.
    async fn append_on_stream(
        &mut self,
        client: &mut RaftClient<Channel>,
        message: RaftMessage,
        ttl: Duration,
    ) -> Result<Response<RaftMessage>, Status> {
        let mut stream = match self.append_stream.take() {
            Some(stream) => stream,
            None => {
                let (requests, queued) = tokio::sync::mpsc::channel(1);
                let mut req = Request::new(tokio_stream::wrappers::ReceiverStream::new(queued));
                address(&mut req, &self.identity, self.target);
                match client.append_entries_stream(req).await {
                    Ok(replies) => AppendStream {
                        requests,
                        replies: replies.into_inner(),
                    },
                    Err(status) if status.code() == tonic::Code::Unimplemented => {
                        tracing::info!(
                            peer = %membership::show(self.target),
                            "the peer has no AppendEntries stream (a release before it): one call each"
                        );
                        self.no_append_stream = true;
                        return client.append_entries(self.unary(message, ttl)).await;
                    }
                    Err(status) => return Err(status),
                }
            }
        };
        let closed = || Status::unavailable("the AppendEntries stream to the peer closed");
        if stream.requests.send(message).await.is_err() {
            return Err(closed());
        }
        let reply = stream.replies.message().await?.ok_or_else(closed)?;
        self.append_stream = Some(stream);
        Ok(Response::new(reply))
    }

    /// One call: encode, send with a deadline, decode the remote `Result`.
    async fn call<Req, Resp, E>(
        &mut self,
        kind: RpcKind,
        request: &Req,
        option: &RPCOption,
    ) -> Result<Resp, RPCError<u64, BasicNode, E>>
    where
        Req: WireMessage,
        Result<Resp, E>: WireMessage,
        E: std::error::Error,
    {
        let network = |e: &dyn std::error::Error| {
            RPCError::Network(NetworkError::new(&std::io::Error::other(e.to_string())))
        };
        let format = self
            .formats
            .send_format(self.target, self.wire_format)
            .max(request.oldest_format().min(self.wire_format));
        let payload = request.encode(format).map_err(|e| network(&e))?;
        let mut client = self.client().map_err(|e| {
            RPCError::Unreachable(Unreachable::new(&std::io::Error::other(e.to_string())))
        })?;
        let ttl = option.hard_ttl();
        let sent = self.clock.as_ref().map(|c| (c.wall_ms(), c.mono_ms()));
        let message = RaftMessage {
            payload,
            format_version: format,
            reads_up_to: self.wire_format,
            sent_at_ms: sent.map_or(0, |(wall, _)| wall),
            log_time_ms: match (&self.clock, kind) {
                (Some(c), RpcKind::AppendEntries) => c.told_ms(),
                _ => 0,
            },
            clock_offset_ms: match (&self.clock, kind) {
                (Some(c), RpcKind::AppendEntries) => c.offset_of_peer(self.target),
                _ => None,
            },
        };
        let answered = if matches!(kind, RpcKind::AppendEntries) && !self.no_append_stream {
            // A timeout drops the stream with the future that holds it.
            tokio::time::timeout(ttl, self.append_on_stream(&mut client, message, ttl)).await
        } else {
            let req = self.unary(message, ttl);
            let call = async {
                match kind {
                    RpcKind::AppendEntries => client.append_entries(req).await,
                    RpcKind::Vote => client.vote(req).await,
                    RpcKind::InstallSnapshot => client.install_snapshot(req).await,
                }
            };
            tokio::time::timeout(ttl, call).await
        };
        let reply = match answered {
            Err(_) => {
                self.say_silent(&format!("no answer within {} ms", ttl.as_millis()));
                return Err(RPCError::Timeout(Timeout {
                    action: kind.action(),
                    id: 0,
                    target: self.target,
                    timeout: ttl,
                }));
            }
            Ok(Err(status)) => {
                // The peer says this replica was removed (it refused the
                // vote): the removal watch stops the server.
                if let (Some(index), Some((me, flag))) = (removed_at(&status), &self.removal) {
                    let at_ms = self.clock.as_ref().map_or(0, |c| c.wall_ms());
                    flag.told(
                        *me,
                        self.identity.get().unwrap_or_default(),
                        index,
                        self.target,
                        at_ms,
                    );
                    return Err(RPCError::Unreachable(Unreachable::new(
                        &std::io::Error::other(status.message().to_string()),
                    )));
                }
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
                    self.say_silent(status.message());
                    self.disconnect();
                    return Err(RPCError::Unreachable(Unreachable::new(
                        &std::io::Error::other(status.message().to_string()),
                    )));
                }
                // Anything else (a payload the peer could not read among
                // them) is asked again in the oldest format both surely
                // read, until the peer says otherwise.
                self.formats.forget(self.target);
                return Err(network(&status));
            }
            Ok(Ok(reply)) => {
                if let (Some(clock), Some((wall, mono))) = (&self.clock, sent) {
                    let round_trip_ms = clock.mono_ms().saturating_sub(mono);
                    clock.peer_answered(
                        self.target,
                        wall,
                        reply.get_ref().sent_at_ms,
                        round_trip_ms,
                    );
                    clock.heard_peer(reply.get_ref().log_time_ms, round_trip_ms);
                }
                self.strangers.answered(self.target);
                if self.formats.heard(self.target) {
                    tracing::info!(peer = %membership::show(self.target), addr = %self.addr, "the peer answers again");
                }
                reply.into_inner()
            }
        };
        // A release before format 2 leaves `reads_up_to` unset: format 1.
        let peer_reads = raft_wire::received_format(reply.reads_up_to);
        if let Some(writes) = self
            .formats
            .answered(self.target, peer_reads, self.wire_format)
        {
            tracing::info!(
                peer = %membership::show(self.target),
                reads_up_to = peer_reads,
                "writing Raft wire format {writes} to the peer"
            );
        }
        let reply_format = raft_wire::received_format(reply.format_version);
        let result = if reply_format > self.wire_format {
            Err(WireError::Format {
                found: reply_format,
                newest: self.wire_format,
            })
        } else {
            Result::<Resp, E>::decode(&reply.payload, reply_format)
        }
        .map_err(|e| network(&e))?;
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
        if self.formats.send_format(self.target, self.wire_format) < raft_wire::RAFT_WIRE_FORMAT {
            return self.install_snapshot_for_release_before(rpc, &option).await;
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

/// How a snapshot goes to a peer written to in the format before
/// ([`GrpcPeer::install_snapshot_for_release_before`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum SnapshotForPeer {
    /// As the leader has it (format 8).
    AsItIs,
    /// Re-encoded in the format the release before reads (7), which
    /// refuses a state it does not carry whole.
    Older,
}

/// The choice for a replica writing up to wire format `mine` to a peer
/// that said it reads up to `peer_reads` (`None`: not yet). A peer that
/// has not said (a new incarnation, a restart) gets the snapshot as it is
/// when format 7 would lose part of the state: a peer of the release
/// before refuses it and is known for that release at the next try, while
/// a lossy copy would leave a replica holding another state (keel-chaos
/// found tokens lost on a wiped member this way).
fn snapshot_for_peer(mine: u32, peer_reads: Option<u32>, carried_whole: bool) -> SnapshotForPeer {
    if mine >= raft_wire::RAFT_WIRE_FORMAT && peer_reads.is_none() && !carried_whole {
        SnapshotForPeer::AsItIs
    } else {
        SnapshotForPeer::Older
    }
}

impl GrpcPeer {
    /// Sends a snapshot to a peer of the release before wire format 2,
    /// which reads snapshot format 7 at most: the chunks are gathered here
    /// (each acknowledged at once) until the last, and the whole snapshot
    /// is then sent in the format the peer reads, in chunks of its own.
    async fn install_snapshot_for_release_before(
        &mut self,
        rpc: InstallSnapshotRequest<TypeConfig>,
        option: &RPCOption,
    ) -> Result<
        InstallSnapshotResponse<u64>,
        RPCError<u64, BasicNode, RaftError<u64, InstallSnapshotError>>,
    > {
        let id = rpc.meta.snapshot_id.clone();
        if rpc.offset == 0 {
            self.gathered = Some((id.clone(), Vec::new()));
        }
        let expected = match &self.gathered {
            Some((gathering, bytes)) if *gathering == id => bytes.len() as u64,
            _ => 0,
        };
        if rpc.offset != expected {
            // Out of sequence: openraft starts the snapshot again.
            self.gathered = None;
            let segment = |offset| openraft::SnapshotSegmentId {
                id: id.clone(),
                offset,
            };
            return Err(RPCError::RemoteError(RemoteError::new(
                self.target,
                RaftError::APIError(InstallSnapshotError::SnapshotMismatch(
                    openraft::error::SnapshotMismatch {
                        expect: segment(expected),
                        got: segment(rpc.offset),
                    },
                )),
            )));
        }
        if let Some((_, bytes)) = &mut self.gathered {
            bytes.extend_from_slice(&rpc.data);
        }
        if !rpc.done {
            return Ok(InstallSnapshotResponse { vote: rpc.vote });
        }
        let whole = self.gathered.take().map(|(_, b)| b).unwrap_or_default();
        let older = keel_storage::snapshot_codec::snapshot_format_for_wire(
            raft_wire::RAFT_WIRE_FORMAT_PREVIOUS,
        );
        let failed = |format: u32, e: String| {
            RPCError::Network(NetworkError::new(&std::io::Error::other(format!(
                "cannot write snapshot {id} in format {format}: {e}"
            ))))
        };
        let state =
            keel_storage::snapshot_codec::decode_snapshot(&whole).map_err(|e| failed(older, e))?;
        let choice = snapshot_for_peer(
            self.wire_format,
            self.formats.reads(self.target),
            state.postcard_carries_whole(),
        );
        let (data, format) = match choice {
            SnapshotForPeer::AsItIs => (
                whole,
                keel_storage::snapshot_codec::snapshot_format_for_wire(raft_wire::RAFT_WIRE_FORMAT),
            ),
            SnapshotForPeer::Older => {
                let data = keel_storage::snapshot_codec::encode_snapshot_as(&state, older)
                    .map_err(|e| failed(older, e))?;
                (data, older)
            }
        };
        tracing::info!(
            peer = %membership::show(self.target),
            snapshot = %id,
            bytes = data.len(),
            "sending the snapshot in format {format} (the peer reads no newer, or has not said yet)"
        );
        let chunks: Vec<&[u8]> = if data.is_empty() {
            vec![&[][..]]
        } else {
            data.chunks(SNAPSHOT_CHUNK_BYTES).collect()
        };
        let last = chunks.len() - 1;
        let mut offset = 0u64;
        let mut response = InstallSnapshotResponse { vote: rpc.vote };
        for (i, chunk) in chunks.into_iter().enumerate() {
            let request = InstallSnapshotRequest {
                vote: rpc.vote,
                meta: rpc.meta.clone(),
                offset,
                data: chunk.to_vec(),
                done: i == last,
            };
            response = self
                .call(RpcKind::InstallSnapshot, &request, option)
                .await?;
            if response.vote > rpc.vote {
                break;
            }
            offset += chunk.len() as u64;
        }
        Ok(response)
    }
}

/// The size of the chunks a snapshot is sent in to a replica of the
/// release before. All of them go within the last chunk's deadline
/// (`install_snapshot_timeout`), so few and large.
const SNAPSHOT_CHUNK_BYTES: usize = 8 * 1024 * 1024;

/// The log index a vote refusal names as this replica's removal.
fn removed_at(status: &Status) -> Option<u64> {
    status
        .metadata()
        .get(crate::removal::REMOVED_AT_HEADER)?
        .to_str()
        .ok()?
        .parse()
        .ok()
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

/// Returns once the server begins to close (a graceful shutdown waits for
/// open streams); never, if a closing can no longer come.
async fn closed(closing: &mut tokio::sync::watch::Receiver<bool>) {
    while !*closing.borrow_and_update() {
        if closing.changed().await.is_err() {
            std::future::pending::<()>().await;
        }
    }
}

/// The receiving side: hands each message to the local Raft.
#[derive(Clone)]
pub struct RaftService {
    raft: Raft,
    /// The newest wire format this replica reads (and answers in, when
    /// asked in it).
    wire_format: u32,
    /// This replica's Raft id: messages for any other are refused.
    me: u64,
    identity: Arc<ClusterIdentity>,
    /// The addressee of the last message refused as not for this replica
    /// (a refusal is logged when it names another than the last).
    last_refused: Arc<Mutex<Option<Option<u64>>>>,
    clock: Arc<ServerClock>,
    /// See [`RaftService::members_by_certificate`].
    members_by_certificate: bool,
    /// `FollowLeader` streams served at once ([`crate::leader_loss`]).
    followers: Arc<tokio::sync::Semaphore>,
    /// Set when the server begins to close: the `FollowLeader` streams end
    /// (a graceful shutdown waits for open streams).
    closing: tokio::sync::watch::Receiver<bool>,
}

impl std::fmt::Debug for RaftService {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RaftService").finish_non_exhaustive()
    }
}

impl RaftService {
    pub fn new(
        raft: Raft,
        me: u64,
        identity: Arc<ClusterIdentity>,
        wire_format: u32,
        clock: Arc<ServerClock>,
    ) -> RaftService {
        RaftService {
            raft,
            wire_format,
            me,
            identity,
            last_refused: Arc::default(),
            clock,
            members_by_certificate: false,
            followers: Arc::new(tokio::sync::Semaphore::new(
                crate::leader_loss::MAX_FOLLOWERS,
            )),
            closing: tokio::sync::watch::channel(false).1,
        }
    }

    /// The `FollowLeader` streams end when `closing` turns true (or its
    /// sender is dropped).
    pub fn closing_with(mut self, closing: tokio::sync::watch::Receiver<bool>) -> RaftService {
        self.closing = closing;
        self
    }

    /// With TLS: a Raft message is refused unless the caller's certificate
    /// names the member that sent it (a client's certificate, or another
    /// member's, votes and appends nothing).
    pub fn members_by_certificate(mut self, on: bool) -> RaftService {
        self.members_by_certificate = on;
        self
    }

    /// Refuses a message whose sender (`sender`, a Raft id: the candidate
    /// or the leader it names) is not the member the caller's certificate
    /// names, when [`RaftService::members_by_certificate`].
    fn check_certificate<T>(
        &self,
        request: &Request<T>,
        sender: Option<u64>,
    ) -> Result<(), Status> {
        if !self.members_by_certificate {
            return Ok(());
        }
        let member = sender.map(membership::member_of);
        let peer = request.extensions().get::<crate::transport::PeerInfo>();
        if let (Some(member), Some(peer)) = (member, peer) {
            if peer.names_member(member) {
                return Ok(());
            }
        }
        let said = member.map_or_else(|| "no member".to_string(), |m| format!("member {m}"));
        let expected = member.map_or_else(String::new, |m| {
            format!(" (a certificate naming {})", crate::tls::member_name(m))
        });
        let remote = peer
            .and_then(|p| p.remote)
            .map_or_else(|| "?".to_string(), |r| r.to_string());
        tracing::warn!(%remote, sender = %said, "refused a Raft message: the caller's certificate is not that member's");
        Err(Status::permission_denied(format!(
            "a Raft message from {said} needs that member's certificate{expected}; the caller's \
             certificate does not name it"
        )))
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

impl RaftService {
    /// Refuses the vote of a candidate this replica's committed membership
    /// removed, telling it so ([`crate::removal::refuse_vote_of_removed`]):
    /// a follower removed by its leader never gets that entry, and would
    /// otherwise stand for election, unheard, for as long as it runs.
    fn refuse_removed(&self, req: &VoteRequest<u64>) -> Result<(), Status> {
        let candidate = req.vote.leader_id().voted_for().unwrap_or_default();
        let index = {
            let m = self.raft.metrics();
            let m = m.borrow();
            crate::removal::refuse_vote_of_removed(
                self.me,
                candidate,
                req.last_log_id.map(|l| l.index),
                m.membership_config.log_id().map(|l| l.index),
                &crate::removal::named(m.membership_config.membership()),
                m.last_applied.map(|l| l.index),
            )
        };
        let Some(index) = index else {
            return Ok(());
        };
        let mut status = Status::failed_precondition(format!(
            "replica {} was removed from this cluster at log index {index}: this replica refuses its vote",
            membership::show(candidate)
        ));
        status.metadata_mut().insert(
            crate::removal::REMOVED_AT_HEADER,
            tonic::metadata::MetadataValue::from(index),
        );
        Err(status)
    }

    /// Admits and decodes a received message. With certificates
    /// ([`RaftService::members_by_certificate`]) the caller's certificate
    /// is checked against the sender the message names (`sender`) before
    /// anything else of it is acted on, the cluster id it carries
    /// included; without, the message is admitted before it is decoded.
    fn receive<T: WireMessage>(
        &self,
        request: &Request<RaftMessage>,
        from_leader: bool,
        sender: impl Fn(&T) -> Option<u64>,
    ) -> Result<(u32, T), Status> {
        self.receive_message(request, request.get_ref(), from_leader, sender)
    }

    /// [`RaftService::receive`] for a `message` of a stream whose call is
    /// `call` (its metadata and the caller's certificate).
    fn receive_message<C, T: WireMessage>(
        &self,
        call: &Request<C>,
        message: &RaftMessage,
        from_leader: bool,
        sender: impl Fn(&T) -> Option<u64>,
    ) -> Result<(u32, T), Status> {
        if !self.members_by_certificate {
            self.admit(call, from_leader)?;
            return self.decode(message);
        }
        let (format, req) = self.decode(message)?;
        self.check_certificate(call, sender(&req))?;
        self.admit(call, from_leader)?;
        Ok((format, req))
    }

    /// One AppendEntries: admitted, handed to the local Raft, answered in
    /// the format it came in.
    async fn append<C>(
        &self,
        call: &Request<C>,
        message: &RaftMessage,
    ) -> Result<RaftMessage, Status> {
        let (format, req) = self.receive_message(
            call,
            message,
            true,
            |r: &AppendEntriesRequest<TypeConfig>| r.vote.leader_id().voted_for(),
        )?;
        let result = self.raft.append_entries(req).await;
        // A leader this replica follows: its log time is the log's, and
        // what it measured of this replica's clock counts.
        if matches!(
            result,
            Ok(AppendEntriesResponse::Success
                | AppendEntriesResponse::PartialSuccess(_)
                | AppendEntriesResponse::Conflict)
        ) {
            self.clock
                .heard_leader(message.log_time_ms, message.clock_offset_ms);
        }
        self.reply(format, &result).map(Response::into_inner)
    }

    /// Decodes a received message: its format and its request. A format
    /// newer than this replica reads is FAILED_PRECONDITION (an upgrade is
    /// due), a payload that does not decode INVALID_ARGUMENT.
    fn decode<T: WireMessage>(&self, message: &RaftMessage) -> Result<(u32, T), Status> {
        let format = raft_wire::received_format(message.format_version);
        if format > self.wire_format {
            return Err(Status::failed_precondition(
                WireError::Format {
                    found: format,
                    newest: self.wire_format,
                }
                .to_string(),
            ));
        }
        let request = T::decode(&message.payload, format)
            .map_err(|e| Status::invalid_argument(e.to_string()))?;
        Ok((format, request))
    }

    /// Answers in `format`, the one the request came in.
    fn reply<T: WireMessage>(
        &self,
        format: u32,
        result: &T,
    ) -> Result<Response<RaftMessage>, Status> {
        let payload = result
            .encode(format)
            .map_err(|e| Status::internal(e.to_string()))?;
        Ok(Response::new(RaftMessage {
            payload,
            format_version: format,
            reads_up_to: self.wire_format,
            sent_at_ms: self.clock.wall_ms(),
            log_time_ms: self.clock.told_ms(),
            clock_offset_ms: None,
        }))
    }
}

#[tonic::async_trait]
impl RaftRpc for RaftService {
    async fn append_entries(
        &self,
        request: Request<RaftMessage>,
    ) -> Result<Response<RaftMessage>, Status> {
        self.append(&request, request.get_ref())
            .await
            .map(Response::new)
    }

    type AppendEntriesStreamStream = std::pin::Pin<
        Box<dyn tokio_stream::Stream<Item = Result<RaftMessage, Status>> + Send + 'static>,
    >;

    /// Each message is read, handed to Raft and answered by the task
    /// that serves the stream's replies: no task or queue of its own.
    async fn append_entries_stream(
        &self,
        request: Request<tonic::Streaming<RaftMessage>>,
    ) -> Result<Response<Self::AppendEntriesStreamStream>, Status> {
        // With certificates, only a member opens one (each message is
        // then checked against the leader it names): a client's
        // certificate holds no stream open.
        if self.members_by_certificate
            && request
                .extensions()
                .get::<crate::transport::PeerInfo>()
                .and_then(|p| p.identity.as_ref())
                .and_then(|i| i.member)
                .is_none()
        {
            return Err(Status::permission_denied(
                "an AppendEntries stream is a member's: the caller's certificate names no member",
            ));
        }
        let (metadata, extensions, inbound) = request.into_parts();
        let call = Request::from_parts(metadata, extensions, ());
        let open = (self.clone(), call, inbound, self.closing.clone());
        let replies = futures::stream::unfold(Some(open), |open| async move {
            let (service, call, mut inbound, mut closing) = open?;
            let message = tokio::select! {
                m = inbound.message() => m,
                () = closed(&mut closing) => return None,
            };
            let Ok(Some(message)) = message else {
                return None;
            };
            let reply = service.append(&call, &message).await;
            // A refusal is the stream's last reply.
            let next = reply.is_ok().then_some((service, call, inbound, closing));
            Some((reply, next))
        });
        Ok(Response::new(Box::pin(replies)))
    }

    async fn vote(&self, request: Request<RaftMessage>) -> Result<Response<RaftMessage>, Status> {
        let (format, req) = self.receive(&request, false, |r: &VoteRequest<u64>| {
            r.vote.leader_id().voted_for()
        })?;
        self.refuse_removed(&req)?;
        self.reply(format, &self.raft.vote(req).await)
    }

    async fn install_snapshot(
        &self,
        request: Request<RaftMessage>,
    ) -> Result<Response<RaftMessage>, Status> {
        let (format, req) =
            self.receive(&request, true, |r: &InstallSnapshotRequest<TypeConfig>| {
                r.vote.leader_id().voted_for()
            })?;
        self.reply(format, &self.raft.install_snapshot(req).await)
    }

    type FollowLeaderStream = crate::leader_loss::LeaderStream;

    async fn follow_leader(
        &self,
        request: Request<FollowLeaderRequest>,
    ) -> Result<Response<Self::FollowLeaderStream>, Status> {
        self.check_certificate(&request, Some(request.get_ref().follower))?;
        self.admit(&request, false)?;
        let permit = self.followers.clone().try_acquire_owned().map_err(|_| {
            Status::resource_exhausted(format!(
                "this leader already serves {} FollowLeader streams",
                crate::leader_loss::MAX_FOLLOWERS
            ))
        })?;
        crate::leader_loss::leader_present(&self.raft, self.me, self.closing.clone(), permit)
            .map(Response::new)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_peer_that_has_not_answered_gets_a_state_format_7_would_lose_as_it_is() {
        use SnapshotForPeer::*;
        let (new, old) = (
            raft_wire::RAFT_WIRE_FORMAT,
            raft_wire::RAFT_WIRE_FORMAT_PREVIOUS,
        );
        // Not answered yet: format 7 only if it carries the state whole.
        assert_eq!(snapshot_for_peer(new, None, true), Older);
        assert_eq!(snapshot_for_peer(new, None, false), AsItIs);
        // Known for the release before: format 7, which refuses a state it
        // cannot carry (an error, never a lossy copy).
        assert_eq!(snapshot_for_peer(new, Some(old), false), Older);
        // This replica pinned to the older format: always format 7.
        assert_eq!(snapshot_for_peer(old, None, false), Older);
    }

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

    /// A peer that answers every AppendEntries with success, counting the
    /// unary calls and the messages on streams; with `streams` false it
    /// answers `AppendEntriesStream` UNIMPLEMENTED, as a release before it.
    #[derive(Clone, Default)]
    struct FakePeer {
        streams: bool,
        /// Answer the first message on a stream only once `release` is
        /// notified, and then with `Conflict` (the others get `Success`).
        hold_first: bool,
        release: Arc<tokio::sync::Notify>,
        unary: Arc<std::sync::atomic::AtomicUsize>,
        streamed: Arc<std::sync::atomic::AtomicUsize>,
        opened: Arc<std::sync::atomic::AtomicUsize>,
    }

    fn success(request: &RaftMessage) -> RaftMessage {
        answer(request, AppendEntriesResponse::Success)
    }

    fn conflict(request: &RaftMessage) -> RaftMessage {
        answer(request, AppendEntriesResponse::Conflict)
    }

    fn answer(request: &RaftMessage, response: AppendEntriesResponse<u64>) -> RaftMessage {
        let format = raft_wire::received_format(request.format_version);
        let result: Result<AppendEntriesResponse<u64>, RaftError<u64>> = Ok(response);
        RaftMessage {
            payload: result.encode(format).expect("encode"),
            format_version: format,
            reads_up_to: raft_wire::RAFT_WIRE_FORMAT,
            ..RaftMessage::default()
        }
    }

    #[tonic::async_trait]
    impl RaftRpc for FakePeer {
        async fn append_entries(
            &self,
            request: Request<RaftMessage>,
        ) -> Result<Response<RaftMessage>, Status> {
            self.unary.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
            Ok(Response::new(success(request.get_ref())))
        }

        type AppendEntriesStreamStream =
            tokio_stream::wrappers::ReceiverStream<Result<RaftMessage, Status>>;

        async fn append_entries_stream(
            &self,
            request: Request<tonic::Streaming<RaftMessage>>,
        ) -> Result<Response<Self::AppendEntriesStreamStream>, Status> {
            self.opened
                .fetch_add(1, std::sync::atomic::Ordering::SeqCst);
            if !self.streams {
                return Err(Status::unimplemented("no such method"));
            }
            let mut inbound = request.into_inner();
            let (tx, rx) = tokio::sync::mpsc::channel(1);
            let streamed = self.streamed.clone();
            let (hold_first, release) = (self.hold_first, self.release.clone());
            tokio::spawn(async move {
                while let Ok(Some(m)) = inbound.message().await {
                    let before = streamed.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
                    let reply = if hold_first && before == 0 {
                        release.notified().await;
                        conflict(&m)
                    } else {
                        success(&m)
                    };
                    if tx.send(Ok(reply)).await.is_err() {
                        break;
                    }
                }
            });
            Ok(Response::new(tokio_stream::wrappers::ReceiverStream::new(
                rx,
            )))
        }

        async fn vote(&self, _: Request<RaftMessage>) -> Result<Response<RaftMessage>, Status> {
            Err(Status::unimplemented("not in this test"))
        }

        async fn install_snapshot(
            &self,
            _: Request<RaftMessage>,
        ) -> Result<Response<RaftMessage>, Status> {
            Err(Status::unimplemented("not in this test"))
        }

        type FollowLeaderStream = crate::leader_loss::LeaderStream;

        async fn follow_leader(
            &self,
            _: Request<FollowLeaderRequest>,
        ) -> Result<Response<Self::FollowLeaderStream>, Status> {
            Err(Status::unimplemented("not in this test"))
        }
    }

    /// A [`GrpcPeer`] to a fake peer served by a real tonic server (and
    /// the directory its cluster identity lives in).
    async fn peer_of(fake: FakePeer) -> (GrpcPeer, tempfile::TempDir) {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
            .await
            .expect("bind");
        let addr = listener.local_addr().expect("addr");
        tokio::spawn(
            tonic::transport::Server::builder()
                .add_service(keel_proto::raft::raft_server::RaftServer::new(fake))
                .serve_with_incoming(crate::transport::Transport::Plain.incoming(listener)),
        );
        let dir = tempfile::tempdir().expect("tempdir");
        let identity = Arc::new(ClusterIdentity::load(dir.path().join("cluster-id")).expect("id"));
        (GrpcPeer::new(2, &addr.to_string(), identity), dir)
    }

    fn heartbeat() -> AppendEntriesRequest<TypeConfig> {
        AppendEntriesRequest {
            vote: openraft::Vote::new_committed(1, 1),
            prev_log_id: None,
            entries: Vec::new(),
            leader_commit: None,
        }
    }

    /// Sends three AppendEntries to a fake peer through a [`GrpcPeer`],
    /// each answered with success.
    async fn three_appends_to(fake: FakePeer) {
        let (mut peer, _dir) = peer_of(fake).await;
        let option = RPCOption::new(Duration::from_secs(10));
        for _ in 0..3 {
            let reply = peer.append_entries(heartbeat(), option.clone()).await;
            assert!(
                matches!(reply, Ok(AppendEntriesResponse::Success)),
                "{reply:?}"
            );
        }
    }

    /// A reply that comes after its request timed out answers nothing: the
    /// stream it comes on was dropped, and the next request opens another.
    #[tokio::test]
    async fn a_late_reply_on_the_stream_does_not_answer_the_next_request() {
        use std::sync::atomic::Ordering::SeqCst;
        let fake = FakePeer {
            streams: true,
            hold_first: true,
            ..FakePeer::default()
        };
        let (mut peer, _dir) = peer_of(fake.clone()).await;
        let first = peer
            .append_entries(heartbeat(), RPCOption::new(Duration::from_millis(200)))
            .await;
        assert!(matches!(first, Err(RPCError::Timeout(_))), "{first:?}");
        // The first reply (a Conflict) is sent now, on the first stream.
        fake.release.notify_one();
        let next = peer
            .append_entries(heartbeat(), RPCOption::new(Duration::from_secs(10)))
            .await;
        assert!(
            matches!(next, Ok(AppendEntriesResponse::Success)),
            "the next request got its own reply, not the late one: {next:?}"
        );
        assert_eq!(
            (fake.opened.load(SeqCst), fake.streamed.load(SeqCst)),
            (2, 2)
        );
    }

    /// A leader's entries go on one stream held open to each follower; a
    /// follower of the release before, which has no such stream, gets one
    /// call each, and is not asked for the stream again.
    #[tokio::test]
    async fn appends_go_on_one_stream_or_as_calls_to_a_peer_without_it() {
        use std::sync::atomic::Ordering::SeqCst;
        let streaming = FakePeer {
            streams: true,
            ..FakePeer::default()
        };
        three_appends_to(streaming.clone()).await;
        assert_eq!(
            (
                streaming.opened.load(SeqCst),
                streaming.streamed.load(SeqCst),
                streaming.unary.load(SeqCst)
            ),
            (1, 3, 0)
        );
        let older = FakePeer::default();
        three_appends_to(older.clone()).await;
        assert_eq!(
            (
                older.opened.load(SeqCst),
                older.streamed.load(SeqCst),
                older.unary.load(SeqCst)
            ),
            (1, 0, 3),
            "asked for the stream once"
        );
    }
}
