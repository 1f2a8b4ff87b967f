//! The one mapping from domain errors to gRPC status codes.

use keel_core::{ApplyError, SpecError};
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
                | ApplyError::NodeNotLost(_) => Code::FailedPrecondition,
            },
            ApiError::NotLeader { .. } | ApiError::Unavailable(_) => Code::Unavailable,
            ApiError::Storage(_) => Code::Internal,
            ApiError::Unsupported(_) | ApiError::NewMemberUnreachable { .. } => {
                Code::FailedPrecondition
            }
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
