//! Raft between replicas over gRPC (`keel.raft.v1`).
//!
//! [`GrpcNetwork`] is openraft's network: one lazily connected channel per
//! peer, a deadline on every call from openraft's `RPCOption`, and errors
//! mapped so openraft backs off from unreachable peers. [`RaftService`] is
//! the receiving side, served on the same port as the client API. Payloads
//! are openraft's own request and response types, encoded with postcard.
//! Snapshots travel as openraft's chunks (`snapshot_max_chunk_size`), one
//! call per chunk.

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

/// Makes a [`GrpcPeer`] for each peer openraft replicates to.
#[derive(Debug, Clone, Default)]
pub struct GrpcNetwork;

impl RaftNetworkFactory<TypeConfig> for GrpcNetwork {
    type Network = GrpcPeer;

    async fn new_client(&mut self, target: u64, node: &BasicNode) -> GrpcPeer {
        GrpcPeer::new(target, &node.addr)
    }
}

/// One peer: its address and a lazily connected channel.
#[derive(Debug)]
pub struct GrpcPeer {
    target: u64,
    addr: String,
    client: Option<RaftClient<Channel>>,
}

impl GrpcPeer {
    fn new(target: u64, addr: &str) -> GrpcPeer {
        GrpcPeer {
            target,
            addr: addr.to_string(),
            client: None,
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
            Ok(Ok(reply)) => reply.into_inner(),
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

/// The receiving side: hands each message to the local Raft.
#[derive(Clone)]
pub struct RaftService {
    raft: Raft,
}

impl std::fmt::Debug for RaftService {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RaftService").finish_non_exhaustive()
    }
}

impl RaftService {
    pub fn new(raft: Raft) -> RaftService {
        RaftService { raft }
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
        let req: AppendEntriesRequest<TypeConfig> =
            decode(&request.into_inner().payload).map_err(bad_payload)?;
        reply(&self.raft.append_entries(req).await)
    }

    async fn vote(&self, request: Request<RaftMessage>) -> Result<Response<RaftMessage>, Status> {
        let req: VoteRequest<u64> = decode(&request.into_inner().payload).map_err(bad_payload)?;
        reply(&self.raft.vote(req).await)
    }

    async fn install_snapshot(
        &self,
        request: Request<RaftMessage>,
    ) -> Result<Response<RaftMessage>, Status> {
        let req: InstallSnapshotRequest<TypeConfig> =
            decode(&request.into_inner().payload).map_err(bad_payload)?;
        reply(&self.raft.install_snapshot(req).await)
    }
}
