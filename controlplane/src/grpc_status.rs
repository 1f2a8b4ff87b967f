//! The one mapping from domain errors to gRPC status codes, each with a
//! machine-readable reason (`google.rpc.ErrorInfo`, [`reason`]).

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
    /// An ended job that retention removed from the state (issue 23).
    #[error("job {0} has ended and was removed from the state (finished jobs are kept for --retain-finished-s, at most --retain-finished-max of them); `keel why {0}` shows its history from the journal")]
    JobRemoved(u64),
    #[error("this replica is not the leader{}", leader.as_ref().map(|l| format!("; the leader is {l}")).unwrap_or_default())]
    NotLeader { leader: Option<String> },
    /// No leader is known: the request was not proposed.
    #[error("no leader is known yet; retry")]
    NoLeader,
    #[error("Raft is unavailable: {0}")]
    Unavailable(String),
    #[error("storage failed: {0}")]
    Storage(String),
    /// The request is valid but this server cannot carry it out.
    #[error("{0}")]
    Unsupported(String),
    /// This server cannot seal or open a secret: no key, or not the one a
    /// value was sealed with (issue 35).
    #[error("{0}")]
    SecretKey(String),
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
    /// Every event stream this replica allows is open.
    #[error(
        "{limit} event streams are open on this replica, its limit (--max-event-streams); \
         close one, or watch from another replica"
    )]
    TooManyStreams { limit: usize },
    /// One caller holds as many event streams open as it may.
    #[error(
        "{caller} holds {limit} event streams open on this replica, the most one caller may; \
         close one"
    )]
    TooManyStreamsForCaller { caller: String, limit: usize },
    /// The caller is not known (issue 22): a token that is unknown,
    /// revoked, expired or another cluster's, or no identity at all.
    #[error("{0}")]
    Unauthenticated(String),
    /// The caller is known but its role lacks the right the call needs.
    #[error("{message}")]
    PermissionDenied {
        /// The right the call needs ([`crate::authz::Right`]'s name).
        right: &'static str,
        message: String,
    },
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

/// The domain of Keel's `google.rpc.ErrorInfo` details.
pub const ERROR_DOMAIN: &str = "keel.dev";

/// Machine-readable reasons, sent as `google.rpc.ErrorInfo.reason` with
/// every error the API answers (clients decide on these and the code,
/// never on the message's words). Stable: a reason is never renamed.
pub mod reason {
    /// This replica is not the leader; the write was not logged. Metadata
    /// `leader`: the leader's address, when known. Safe to retry.
    pub const NOT_LEADER: &str = "NOT_LEADER";
    /// No leader could be reached; the request was not proposed. Safe to
    /// retry.
    pub const NO_LEADER: &str = "NO_LEADER";
    /// Raft could not take the request (no quorum, shutting down); a write
    /// may or may not have been logged: retry it with its request id.
    pub const RAFT_UNAVAILABLE: &str = "RAFT_UNAVAILABLE";
    /// A field of the request is invalid. Metadata `field`; the details
    /// also carry a `google.rpc.BadRequest` field violation.
    pub const INVALID_ARGUMENT: &str = "INVALID_ARGUMENT";
    pub const JOB_NOT_FOUND: &str = "JOB_NOT_FOUND";
    /// A queue of that name exists already (issue 23).
    pub const QUEUE_EXISTS: &str = "QUEUE_EXISTS";
    /// No queue of that name.
    pub const QUEUE_NOT_FOUND: &str = "QUEUE_NOT_FOUND";
    /// No such secret, or no such key in it (issue 35).
    pub const SECRET_NOT_FOUND: &str = "SECRET_NOT_FOUND";
    /// This server cannot seal or open secrets: it holds no key, or not
    /// the one a value was sealed with (issue 35).
    pub const SECRET_KEY_MISSING: &str = "SECRET_KEY_MISSING";
    pub const NODE_NOT_FOUND: &str = "NODE_NOT_FOUND";
    /// The state refuses the command as it stands (a job ended, a node in
    /// use, a stale epoch, ...).
    pub const FAILED_PRECONDITION: &str = "FAILED_PRECONDITION";
    /// A request id sent again with another command.
    pub const REQUEST_ID_REUSED: &str = "REQUEST_ID_REUSED";
    pub const STORAGE: &str = "STORAGE";
    pub const UNSUPPORTED: &str = "UNSUPPORTED";
    pub const NEW_MEMBER_UNREACHABLE: &str = "NEW_MEMBER_UNREACHABLE";
    pub const LEARNER_DID_NOT_CATCH_UP: &str = "LEARNER_DID_NOT_CATCH_UP";
    pub const MEMBERSHIP_CHANGE_IN_PROGRESS: &str = "MEMBERSHIP_CHANGE_IN_PROGRESS";
    pub const MEMBERSHIP_CHANGE_NOT_COMMITTED: &str = "MEMBERSHIP_CHANGE_NOT_COMMITTED";
    /// This replica was removed from its cluster and serves nothing (issue
    /// 34); nothing was proposed. Ask another replica.
    pub const REMOVED: &str = "REMOVED";
    /// Every event stream this replica allows is open (`WatchEvents`);
    /// retry later or on another replica.
    pub const TOO_MANY_STREAMS: &str = "TOO_MANY_STREAMS";
    /// The replica is working on as many requests as it allows
    /// (`--max-api-requests`); nothing was done. Retry later or on another
    /// replica.
    pub const OVERLOADED: &str = "OVERLOADED";
    /// The caller is not known (issue 22): a token that is unknown,
    /// revoked, expired or another cluster's. Nothing was done.
    pub const UNAUTHENTICATED: &str = "UNAUTHENTICATED";
    /// The caller's role lacks the right the call needs. Metadata `right`:
    /// which. Nothing was done.
    pub const PERMISSION_DENIED: &str = "PERMISSION_DENIED";
    /// A token of that name, or with that secret, exists already.
    pub const TOKEN_EXISTS: &str = "TOKEN_EXISTS";
    pub const TOKEN_NOT_FOUND: &str = "TOKEN_NOT_FOUND";
    /// The request took longer than the replica allows
    /// (`--request-timeout-s`); a write may still be applied: send it again
    /// with its request id.
    pub const REQUEST_TIMEOUT: &str = "REQUEST_TIMEOUT";
}

impl ApiError {
    /// The status code, the reason ([`reason`]) and the field at fault,
    /// if one is.
    fn classify(&self) -> (Code, &'static str, Option<String>) {
        use reason::*;
        match self {
            ApiError::InvalidSpec(e) => (Code::InvalidArgument, INVALID_ARGUMENT, spec_field(e)),
            ApiError::InvalidArgument { field, .. } => (
                Code::InvalidArgument,
                INVALID_ARGUMENT,
                Some(field.to_string()),
            ),
            ApiError::JobNotFound(_) | ApiError::JobRemoved(_) => {
                (Code::NotFound, JOB_NOT_FOUND, None)
            }
            ApiError::Refused(a) => match a {
                ApplyError::InvalidSpec(e) => {
                    (Code::InvalidArgument, INVALID_ARGUMENT, spec_field(e))
                }
                ApplyError::TooLarge { field, .. } | ApplyError::Invalid { field, .. } => {
                    (Code::InvalidArgument, INVALID_ARGUMENT, Some(field.clone()))
                }
                ApplyError::DuplicateGpu { .. } | ApplyError::RankOutOfRange { .. } => {
                    (Code::InvalidArgument, INVALID_ARGUMENT, None)
                }
                ApplyError::UnknownJob(_) => (Code::NotFound, JOB_NOT_FOUND, None),
                ApplyError::UnknownNode(_) => (Code::NotFound, NODE_NOT_FOUND, None),
                ApplyError::JobEnded { .. }
                | ApplyError::JobNotEnded { .. }
                | ApplyError::JobNotRunning { .. }
                | ApplyError::StaleEpoch { .. }
                | ApplyError::GpuInUse { .. }
                | ApplyError::NodeLost(_)
                | ApplyError::NodeNotLost(_)
                | ApplyError::NodeInUse { .. } => {
                    (Code::FailedPrecondition, FAILED_PRECONDITION, None)
                }
                ApplyError::RequestIdReused { .. } => (
                    Code::AlreadyExists,
                    REQUEST_ID_REUSED,
                    Some("request_id".into()),
                ),
                ApplyError::Acl(e) => {
                    use keel_state::acl::AclError as A;
                    match e {
                        A::AlreadyBootstrapped | A::NotBootstrapped | A::LastAdmin(_) => {
                            (Code::FailedPrecondition, FAILED_PRECONDITION, None)
                        }
                        A::NameTaken(_) => (Code::AlreadyExists, TOKEN_EXISTS, Some("name".into())),
                        A::SecretTaken => {
                            (Code::AlreadyExists, TOKEN_EXISTS, Some("secret".into()))
                        }
                        A::UnknownToken(_) => (Code::NotFound, TOKEN_NOT_FOUND, None),
                        A::TooManyTokens { .. } => {
                            (Code::ResourceExhausted, FAILED_PRECONDITION, None)
                        }
                        A::Invalid { field, .. } => {
                            (Code::InvalidArgument, INVALID_ARGUMENT, Some(field.clone()))
                        }
                    }
                }
                ApplyError::Queue(e) => {
                    use keel_state::queue::QueueError as Q;
                    match e {
                        Q::Exists(_) => (Code::AlreadyExists, QUEUE_EXISTS, Some("name".into())),
                        Q::Unknown(_) => (Code::NotFound, QUEUE_NOT_FOUND, Some("name".into())),
                        Q::HoldsJobs { .. } | Q::DefaultKept => {
                            (Code::FailedPrecondition, FAILED_PRECONDITION, None)
                        }
                        Q::TooMany { .. } => (Code::ResourceExhausted, FAILED_PRECONDITION, None),
                        Q::Invalid { field, .. } => {
                            (Code::InvalidArgument, INVALID_ARGUMENT, Some(field.clone()))
                        }
                    }
                }
                ApplyError::Secret(e) => {
                    use keel_state::secret::SecretError as S;
                    match e {
                        S::Unknown(_) | S::UnknownKey { .. } => {
                            (Code::NotFound, SECRET_NOT_FOUND, None)
                        }
                        S::RevisionMoved { .. } | S::InUse { .. } => {
                            (Code::FailedPrecondition, FAILED_PRECONDITION, None)
                        }
                        S::NotYours { field, .. } => (
                            Code::PermissionDenied,
                            PERMISSION_DENIED,
                            Some(field.clone()),
                        ),
                        S::TooMany { .. } => (Code::ResourceExhausted, FAILED_PRECONDITION, None),
                        S::TooLarge { field, .. } | S::Invalid { field, .. } => {
                            (Code::InvalidArgument, INVALID_ARGUMENT, Some(field.clone()))
                        }
                    }
                }
            },
            ApiError::Unauthenticated(_) => (Code::Unauthenticated, UNAUTHENTICATED, None),
            ApiError::PermissionDenied { .. } => (Code::PermissionDenied, PERMISSION_DENIED, None),
            ApiError::NotLeader { .. } => (Code::Unavailable, NOT_LEADER, None),
            ApiError::NoLeader => (Code::Unavailable, NO_LEADER, None),
            ApiError::Unavailable(_) => (Code::Unavailable, RAFT_UNAVAILABLE, None),
            ApiError::Storage(_) => (Code::Internal, STORAGE, None),
            ApiError::Unsupported(_) => (Code::FailedPrecondition, UNSUPPORTED, None),
            ApiError::SecretKey(_) => (Code::FailedPrecondition, SECRET_KEY_MISSING, None),
            ApiError::NewMemberUnreachable { .. } => {
                (Code::FailedPrecondition, NEW_MEMBER_UNREACHABLE, None)
            }
            ApiError::LearnerDidNotCatchUp { .. } => {
                (Code::FailedPrecondition, LEARNER_DID_NOT_CATCH_UP, None)
            }
            ApiError::MembershipChangeInProgress { .. } => (
                Code::FailedPrecondition,
                MEMBERSHIP_CHANGE_IN_PROGRESS,
                None,
            ),
            ApiError::MembershipChangeNotCommitted { .. } => (
                Code::DeadlineExceeded,
                MEMBERSHIP_CHANGE_NOT_COMMITTED,
                None,
            ),
            ApiError::TooManyStreams { .. } | ApiError::TooManyStreamsForCaller { .. } => {
                (Code::ResourceExhausted, TOO_MANY_STREAMS, None)
            }
        }
    }
}

/// The spec field a spec error names (`spec.gpus`, ...).
fn spec_field(e: &SpecError) -> Option<String> {
    let field = match e {
        SpecError::Missing { field }
        | SpecError::TooLong { field, .. }
        | SpecError::TooMany { field, .. }
        | SpecError::OutOfRange { field, .. }
        | SpecError::Invalid { field, .. } => field,
    };
    Some(format!("spec.{field}"))
}

/// A status with `google.rpc.ErrorInfo` details (and a
/// `google.rpc.BadRequest` field violation when a field is at fault).
pub fn status_with_reason(
    code: Code,
    message: String,
    reason: &str,
    field: Option<String>,
    metadata: std::collections::HashMap<String, String>,
) -> Status {
    use tonic_types::{ErrorDetails, StatusExt};
    let mut metadata = metadata;
    if let Some(f) = &field {
        metadata.insert("field".into(), f.clone());
    }
    let mut details = ErrorDetails::with_error_info(reason, ERROR_DOMAIN, metadata);
    if let Some(f) = field {
        details.add_bad_request_violation(f, message.clone());
    }
    Status::with_error_details(code, message, details)
}

/// The reason ([`reason`]) a status from a Keel server carries, if any.
pub fn reason_of(status: &Status) -> Option<String> {
    use tonic_types::StatusExt;
    status
        .get_details_error_info()
        .filter(|info| info.domain == ERROR_DOMAIN)
        .map(|info| info.reason)
}

/// Whether a status says the request was not proposed (not the leader,
/// or no leader reached), so sending it again cannot apply it twice.
pub fn not_proposed(status: &Status) -> bool {
    status.code() == Code::Unavailable
        && reason_of(status).is_some_and(|r| {
            r == reason::NOT_LEADER || r == reason::NO_LEADER || r == reason::REMOVED
        })
}

/// Whether a status is the transport's own for a connection that was never
/// made (the connector's words; no server answered, so there is no reason
/// to read): nothing was sent. One lost midway is not this.
pub fn never_connected(status: &Status) -> bool {
    status.code() == Code::Unavailable
        && reason_of(status).is_none()
        && (status.message().contains("tcp connect error")
            || status.message().contains("error trying to connect"))
}

impl From<ApiError> for Status {
    fn from(e: ApiError) -> Status {
        let (code, reason, field) = e.classify();
        let mut metadata = std::collections::HashMap::new();
        if let ApiError::NotLeader {
            leader: Some(leader),
        } = &e
        {
            metadata.insert("leader".to_string(), leader.clone());
        }
        if let ApiError::PermissionDenied { right, .. } = &e {
            metadata.insert("right".to_string(), right.to_string());
        }
        status_with_reason(code, e.to_string(), reason, field, metadata)
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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_refusal_carries_its_reason_and_the_field_at_fault() {
        let not_leader = Status::from(ApiError::NotLeader {
            leader: Some("10.0.0.2:7070".into()),
        });
        assert_eq!(not_leader.code(), Code::Unavailable);
        assert_eq!(reason_of(&not_leader).as_deref(), Some(reason::NOT_LEADER));
        use tonic_types::StatusExt;
        let info = not_leader.get_details_error_info().expect("error info");
        assert_eq!(
            info.metadata.get("leader").map(String::as_str),
            Some("10.0.0.2:7070")
        );

        let no_leader = Status::from(ApiError::NoLeader);
        assert_eq!(reason_of(&no_leader).as_deref(), Some(reason::NO_LEADER));

        let bad = Status::from(ApiError::InvalidSpec(SpecError::OutOfRange {
            field: "gpus".into(),
            value: 0,
            min: 1,
            max: 64,
        }));
        assert_eq!(bad.code(), Code::InvalidArgument);
        assert_eq!(reason_of(&bad).as_deref(), Some(reason::INVALID_ARGUMENT));
        let violations = bad.get_details_bad_request().expect("bad request");
        assert_eq!(violations.field_violations[0].field, "spec.gpus");

        // A status from elsewhere (the transport) has no Keel reason.
        assert_eq!(reason_of(&Status::unavailable("tcp connect error")), None);

        assert!(not_proposed(&not_leader) && not_proposed(&no_leader));
        assert!(!not_proposed(&bad));
        assert!(never_connected(&Status::unavailable(
            "error trying to connect: tcp connect error: Connection refused"
        )));
        assert!(!never_connected(&Status::unavailable(
            "transport error: connection reset"
        )));
        assert!(!never_connected(&no_leader), "a server's answer");
    }
}
