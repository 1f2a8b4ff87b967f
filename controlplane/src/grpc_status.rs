//! The one mapping from domain errors to gRPC status codes.

use keel_state::{ApplyError, SpecError};
use openraft::error::{ClientWriteError, RaftError};
use openraft::BasicNode;
use tonic::{Code, Status};

/// Errors the API answers with, each with one status code.
#[derive(Debug, Clone, thiserror::Error)]
pub enum ApiError {
    #[error(transparent)]
    InvalidSpec(#[from] SpecError),
    #[error("{0}")]
    Refused(#[from] ApplyError),
    #[error("{field}: {message}")]
    InvalidArgument {
        field: &'static str,
        message: String,
    },
    #[error("job {0} does not exist")]
    JobNotFound(u64),
    #[error("this replica is not the leader{}", leader.as_ref().map(|l| format!("; the leader is {l}")).unwrap_or_default())]
    NotLeader { leader: Option<String> },
    #[error("Raft is unavailable: {0}")]
    Unavailable(String),
    #[error("storage failed: {0}")]
    Storage(String),
    /// The request is valid but this server cannot carry it out.
    #[error("{0}")]
    Unsupported(String),
    /// A member to add does not answer at its address, so its identity
    /// (member id and incarnation) cannot be learnt.
    #[error("cannot ask the replica at {address} who it is (start it first, with --id {id} and --peers): {reason}")]
    NewMemberUnreachable {
        id: u64,
        address: String,
        reason: String,
    },
    /// A membership change was refused because the last one has not
    /// committed (it needs a quorum of both its old and its new voters).
    #[error(
        "{what}: the last membership change (entry {pending_index}) has not committed yet; \
         it completes once a quorum of both the old and the new voters answers. If those \
         members are gone for good, stop this replica and run \
         `keel cluster force-new-cluster` on it"
    )]
    MembershipChangeInProgress { what: String, pending_index: u64 },
    /// A membership change is in the log but did not commit in time.
    #[error(
        "{what}: the change is in the log but did not commit within {timeout_s} s (it needs a \
         quorum of both the old and the new voters); it completes if they answer. If they are \
         gone for good, stop this replica and run `keel cluster force-new-cluster` on it"
    )]
    MembershipChangeNotCommitted { what: String, timeout_s: u64 },
    /// A new member answered but did not catch up as a learner in time.
    #[error("member {id} at {address} did not catch up within {timeout_s} s: {outcome}")]
    LearnerDidNotCatchUp {
        id: u64,
        address: String,
        timeout_s: u64,
        outcome: String,
    },
}

impl From<RaftError<u64, ClientWriteError<u64, BasicNode>>> for ApiError {
    fn from(e: RaftError<u64, ClientWriteError<u64, BasicNode>>) -> Self {
        match e {
            RaftError::APIError(ClientWriteError::ForwardToLeader(f)) => ApiError::NotLeader {
                leader: f.leader_node.map(|n| n.addr),
            },
            RaftError::APIError(ClientWriteError::ChangeMembershipError(e)) => {
                ApiError::Unavailable(e.to_string())
            }
            RaftError::Fatal(f) => ApiError::Unavailable(f.to_string()),
        }
    }
}

impl From<ApiError> for Status {
    fn from(e: ApiError) -> Status {
        let code = match &e {
            ApiError::InvalidSpec(_) | ApiError::InvalidArgument { .. } => Code::InvalidArgument,
            ApiError::JobNotFound(_) => Code::NotFound,
            ApiError::Refused(a) => match a {
                ApplyError::InvalidSpec(_)
                | ApplyError::TooLarge { .. }
                | ApplyError::Invalid { .. }
                | ApplyError::DuplicateGpu { .. }
                | ApplyError::RankOutOfRange { .. } => Code::InvalidArgument,
                ApplyError::UnknownJob(_) | ApplyError::UnknownNode(_) => Code::NotFound,
                ApplyError::JobEnded { .. }
                | ApplyError::JobNotEnded { .. }
                | ApplyError::JobNotRunning { .. }
                | ApplyError::StaleEpoch { .. }
                | ApplyError::GpuInUse { .. }
                | ApplyError::NodeLost(_)
                | ApplyError::NodeNotLost(_)
                | ApplyError::NodeInUse { .. } => Code::FailedPrecondition,
                ApplyError::RequestIdReused { .. } => Code::AlreadyExists,
            },
            ApiError::NotLeader { .. } | ApiError::Unavailable(_) => Code::Unavailable,
            ApiError::Storage(_) => Code::Internal,
            ApiError::Unsupported(_)
            | ApiError::NewMemberUnreachable { .. }
            | ApiError::LearnerDidNotCatchUp { .. }
            | ApiError::MembershipChangeInProgress { .. } => Code::FailedPrecondition,
            ApiError::MembershipChangeNotCommitted { .. } => Code::DeadlineExceeded,
        };
        Status::new(code, e.to_string())
    }
}

impl From<RaftError<u64, openraft::error::CheckIsLeaderError<u64, BasicNode>>> for ApiError {
    fn from(e: RaftError<u64, openraft::error::CheckIsLeaderError<u64, BasicNode>>) -> Self {
        use openraft::error::CheckIsLeaderError;
        match e {
            RaftError::APIError(CheckIsLeaderError::ForwardToLeader(f)) => ApiError::NotLeader {
                leader: f.leader_node.map(|n| n.addr),
            },
            RaftError::APIError(CheckIsLeaderError::QuorumNotEnough(q)) => {
                ApiError::Unavailable(q.to_string())
            }
            RaftError::Fatal(f) => ApiError::Unavailable(f.to_string()),
        }
    }
}

impl From<keel_storage::StoreError> for ApiError {
    fn from(e: keel_storage::StoreError) -> Self {
        ApiError::Storage(e.to_string())
    }
}

/// Wraps the API service so that a request over the size limit is
/// `RESOURCE_EXHAUSTED`, the conventional code for a message too large.
/// tonic's framing refuses it before any handler runs, as `OUT_OF_RANGE`
/// (with the size and the limit in bytes, which stay in the message).
#[derive(Debug, Clone)]
pub struct TooLargeIsResourceExhausted<S>(pub S);

impl<S: tonic::server::NamedService> tonic::server::NamedService
    for TooLargeIsResourceExhausted<S>
{
    const NAME: &'static str = S::NAME;
}

impl<S> tonic::codegen::Service<tonic::codegen::http::Request<tonic::body::Body>>
    for TooLargeIsResourceExhausted<S>
where
    S: tonic::codegen::Service<
        tonic::codegen::http::Request<tonic::body::Body>,
        Response = tonic::codegen::http::Response<tonic::body::Body>,
        Error = std::convert::Infallible,
    >,
    S::Future: Send + 'static,
{
    type Response = tonic::codegen::http::Response<tonic::body::Body>;
    type Error = std::convert::Infallible;
    type Future = tonic::codegen::BoxFuture<Self::Response, Self::Error>;

    fn poll_ready(
        &mut self,
        cx: &mut std::task::Context<'_>,
    ) -> std::task::Poll<Result<(), Self::Error>> {
        self.0.poll_ready(cx)
    }

    fn call(&mut self, request: tonic::codegen::http::Request<tonic::body::Body>) -> Self::Future {
        let answer = self.0.call(request);
        Box::pin(async move {
            let mut response = answer.await?;
            let headers = response.headers_mut();
            let out_of_range = headers
                .get("grpc-status")
                .is_some_and(|v| v.as_bytes() == b"11");
            // tonic's words, percent-encoded in the header.
            let too_large = headers
                .get("grpc-message")
                .is_some_and(|m| m.as_bytes().windows(9).any(|w| w == b"too%20lar"));
            if out_of_range && too_large {
                headers.insert(
                    "grpc-status",
                    tonic::codegen::http::HeaderValue::from_static("8"),
                );
            }
            Ok(response)
        })
    }
}
