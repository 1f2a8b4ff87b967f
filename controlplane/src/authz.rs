//! Who may do what (issue 22, item 2): the caller of each API request, its
//! role, and the one table of what each role may do.
//!
//! With `--acl` (which needs TLS) every request names its caller:
//! - `authorization: Bearer <secret>`: the token with that secret in the
//!   replicated state ([`keel_state::acl`]) gives its role, and the actor
//!   `token:<name>`. A secret that is unknown, revoked, expired or another
//!   cluster's is refused (`UNAUTHENTICATED`), never taken for less.
//! - No token: a client certificate's holder is a `user`, `cert:<common
//!   name>`.
//! - A replica's certificate, with nothing forwarded, is a `member`:
//!   heartbeats and status only. A replica forwards its caller's token
//!   and certificate name; the answering replica decides again from them
//!   (a follower cannot make a caller more than it is).
//! - An in-process call (no connection: the server's own heartbeats) is
//!   the server itself.
//!
//! Without `--acl` nothing is checked (the loopback default).
//!
//! Absences: no right is granted outside [`scope`]; no handler reads a
//! role itself.

use std::collections::BTreeSet;

use keel_state::acl::Role;
use tonic::Request;

use crate::grpc_status::ApiError;
use crate::transport::PeerInfo;

/// The metadata a caller's token travels in: `Bearer <secret>`.
pub const AUTHORIZATION_HEADER: &str = "authorization";

/// What a call needs.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
pub enum Right {
    /// `SubmitJob`.
    SubmitJobs,
    /// `GetJob`, `ListJobs`, `JobHistory`, `GetLogs`.
    ReadJobs,
    /// `CancelJob`.
    CancelJobs,
    /// `ListNodes`, `WatchEvents`: everything that is not one job's.
    ReadCluster,
    /// `ClusterStatus`, `WhoAmI`.
    ReadStatus,
    /// `SetNodeState`, `RemoveNode`.
    ManageNodes,
    /// `SetPolicy`.
    SetPolicy,
    /// `AddMember`, `RemoveMember`.
    ManageMembers,
    /// `NodeHeartbeat`.
    SendHeartbeats,
    /// `CreateToken`, `ListTokens`, `RevokeToken`.
    ManageTokens,
    /// `BootstrapAcl` (once per cluster; any known caller may try).
    BootstrapAcl,
    /// `CreateQueue`, `UpdateQueue`, `DeleteQueue` (issue 23).
    ManageQueues,
    /// `SaveSnapshot`: the whole state, every job's spec included (issue
    /// 25).
    SaveSnapshots,
    /// `PutSecret`, `DeleteSecret`, `ListSecrets` (issue 35: a user its
    /// own), `RotateSecretKey` (every secret: admin).
    ManageSecrets,
}

impl Right {
    pub const ALL: [Right; 14] = [
        Right::SubmitJobs,
        Right::ReadJobs,
        Right::CancelJobs,
        Right::ReadCluster,
        Right::ReadStatus,
        Right::ManageNodes,
        Right::SetPolicy,
        Right::ManageMembers,
        Right::SendHeartbeats,
        Right::ManageTokens,
        Right::BootstrapAcl,
        Right::ManageQueues,
        Right::SaveSnapshots,
        Right::ManageSecrets,
    ];

    pub fn name(self) -> &'static str {
        match self {
            Right::SubmitJobs => "submit-jobs",
            Right::ReadJobs => "read-jobs",
            Right::CancelJobs => "cancel-jobs",
            Right::ReadCluster => "read-cluster",
            Right::ReadStatus => "read-status",
            Right::ManageNodes => "manage-nodes",
            Right::SetPolicy => "set-policy",
            Right::ManageMembers => "manage-members",
            Right::SendHeartbeats => "send-heartbeats",
            Right::ManageTokens => "manage-tokens",
            Right::BootstrapAcl => "bootstrap-acl",
            Right::ManageQueues => "manage-queues",
            Right::SaveSnapshots => "save-snapshots",
            Right::ManageSecrets => "manage-secrets",
        }
    }
}

/// How far a right reaches.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Scope {
    /// Every job (or no job is concerned).
    All,
    /// The caller's own jobs only (those its actor submitted).
    Own,
    /// Not at all.
    None,
}

/// The table: what `role` may do with `right`.
pub fn scope(role: Role, right: Right) -> Scope {
    use Right::*;
    use Role::*;
    match (role, right) {
        // Heartbeats declare GPUs: from a node's agent (or a replica) only.
        (Node, SendHeartbeats | ReadStatus | BootstrapAcl) => Scope::All,
        (Node, _) | (_, SendHeartbeats) => Scope::None,
        (Admin, _) => Scope::All,
        (Operator, SubmitJobs | ReadJobs | CancelJobs | ReadCluster | ReadStatus | ManageNodes) => {
            Scope::All
        }
        (Viewer, ReadJobs | ReadCluster | ReadStatus) => Scope::All,
        (User, SubmitJobs | ReadStatus) => Scope::All,
        (User, ReadJobs | CancelJobs | ManageSecrets) => Scope::Own,
        (_, BootstrapAcl) => Scope::All,
        (Operator | Viewer | User, _) => Scope::None,
    }
}

/// The roles that hold `right` over every job, for a refusal's message.
fn roles_with(right: Right) -> Vec<&'static str> {
    Role::ALL
        .into_iter()
        .filter(|r| scope(*r, right) == Scope::All)
        .map(Role::as_str)
        .collect()
}

/// Who a request is from.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Caller {
    /// ACLs are off: nothing is checked. The actor is the certificate's,
    /// if any ([`crate::caller::caller_of`]).
    Unchecked { actor: Option<String> },
    /// An in-process call: the server itself.
    Server,
    /// A replica, for itself.
    Member(u64),
    /// A token's or a client certificate's holder; `queues`: the queues a
    /// token limits its submissions to (issue 23; empty: any).
    Holder {
        actor: String,
        role: Role,
        queues: BTreeSet<String>,
    },
}

impl Caller {
    /// The actor its entries record.
    pub fn actor(&self) -> Option<String> {
        match self {
            Caller::Unchecked { actor } => actor.clone(),
            Caller::Server => None,
            Caller::Member(id) => Some(format!("member {id}")),
            Caller::Holder { actor, .. } => Some(actor.clone()),
        }
    }

    /// Its role's name, as `WhoAmI` says it.
    pub fn role_name(&self) -> &'static str {
        match self {
            Caller::Unchecked { .. } => "",
            Caller::Server => "server",
            Caller::Member(_) => "member",
            Caller::Holder { role, .. } => role.as_str(),
        }
    }

    fn describe(&self) -> String {
        match self {
            Caller::Holder { actor, role, .. } => format!("{actor} (role {role})"),
            other => other.actor().unwrap_or_else(|| "this caller".into()),
        }
    }

    /// The queues it may submit to; empty: any.
    pub fn queues(&self) -> BTreeSet<String> {
        match self {
            Caller::Holder { queues, .. } => queues.clone(),
            _ => BTreeSet::new(),
        }
    }

    /// How far `right` reaches for this caller; a refusal names the right
    /// and the roles that have it.
    pub fn authorize(&self, right: Right) -> Result<Granted, ApiError> {
        let scope = match self {
            Caller::Unchecked { .. } | Caller::Server => Scope::All,
            Caller::Member(_) => match right {
                Right::ReadStatus | Right::SendHeartbeats => Scope::All,
                _ => Scope::None,
            },
            Caller::Holder { role, .. } => scope(*role, right),
        };
        if scope == Scope::None {
            return Err(ApiError::PermissionDenied {
                right: right.name(),
                message: format!(
                    "{} may not {}: that needs role {}",
                    self.describe(),
                    right.name(),
                    roles_with(right).join(" or ")
                ),
            });
        }
        Ok(Granted {
            right,
            scope,
            actor: self.actor(),
            queues: self.queues(),
        })
    }
}

/// Whether `caller` may report node `node` in a heartbeat: a `node` token
/// reports only the node it is named for, `NAME` or `NAME-*` (one agent,
/// one machine's nodes; like Kubernetes' node restriction), so a stolen
/// node token cannot declare GPUs on every node. Replicas and, without
/// ACLs, anyone report any node.
pub fn may_report_node(caller: &Caller, node: &str) -> Result<(), ApiError> {
    let Caller::Holder {
        actor,
        role: Role::Node,
        ..
    } = caller
    else {
        return Ok(());
    };
    let name = actor.strip_prefix("token:").unwrap_or(actor);
    let own = node == name
        || node
            .strip_prefix(name)
            .is_some_and(|rest| rest.starts_with('-'));
    if own {
        return Ok(());
    }
    Err(ApiError::PermissionDenied {
        right: Right::SendHeartbeats.name(),
        message: format!("{actor} (role node) reports only node {name} or {name}-*, not {node:?}"),
    })
}

/// A right granted to a caller, and how far it reaches.
#[derive(Debug, Clone)]
pub struct Granted {
    right: Right,
    scope: Scope,
    actor: Option<String>,
    queues: BTreeSet<String>,
}

impl Granted {
    /// The actor the caller's entries record.
    pub fn actor(&self) -> Option<String> {
        self.actor.clone()
    }

    /// Whether the caller may act on a job submitted by `submitted_by`.
    pub fn reaches(&self, submitted_by: Option<&str>) -> bool {
        match self.scope {
            Scope::All => true,
            Scope::Own => submitted_by.is_some() && submitted_by == self.actor.as_deref(),
            Scope::None => false,
        }
    }

    /// Whether the caller may submit a job to queue `queue` (`""`: the
    /// default queue): a token limited to queues (issue 23) names it.
    pub fn check_queue(&self, queue: &str) -> Result<(), ApiError> {
        if keel_state::acl::queue_allowed(&self.queues, queue) {
            return Ok(());
        }
        let queue = keel_state::quota::queue_of(queue);
        Err(ApiError::PermissionDenied {
            right: self.right.name(),
            message: format!(
                "{} may submit to queue{} {} only, and the job names queue {queue:?}",
                self.actor.as_deref().unwrap_or("this caller"),
                if self.queues.len() == 1 { "" } else { "s" },
                self.queues
                    .iter()
                    .map(|q| format!("{q:?}"))
                    .collect::<Vec<_>>()
                    .join(", ")
            ),
        })
    }

    /// [`Self::reaches`], or a refusal naming the job.
    pub fn check_job(&self, job_id: u64, submitted_by: Option<&str>) -> Result<(), ApiError> {
        if self.reaches(submitted_by) {
            return Ok(());
        }
        Err(ApiError::PermissionDenied {
            right: self.right.name(),
            message: format!(
                "{} may {} of its own jobs only, and job {job_id} is not one: that needs role {}",
                self.actor.as_deref().unwrap_or("this caller"),
                self.right.name(),
                roles_with(self.right).join(" or ")
            ),
        })
    }
}

/// The caller of `request` (see the module's doc). `acl`: whether this
/// replica checks callers; `token_role` looks a secret up in the state at
/// `now_ms`, giving the token's name, role and queues, or why it is
/// refused.
pub fn caller_of<T>(
    request: &Request<T>,
    acl: bool,
    token_role: impl FnOnce(&str) -> Result<TokenHolder, String>,
) -> Result<Caller, ApiError> {
    if !acl {
        return Ok(Caller::Unchecked {
            actor: crate::caller::caller_of(request),
        });
    }
    let Some(peer) = request.extensions().get::<PeerInfo>() else {
        return Ok(Caller::Server);
    };
    let Some(identity) = peer.identity.as_ref() else {
        return Err(ApiError::Unauthenticated(
            "this replica checks callers (--acl) and this one has no client certificate".into(),
        ));
    };
    if let Some(value) = request.metadata().get(AUTHORIZATION_HEADER) {
        let secret = value
            .to_str()
            .ok()
            .and_then(|v| v.strip_prefix("Bearer "))
            .map(str::trim)
            .filter(|s| !s.is_empty())
            .ok_or_else(|| {
                ApiError::Unauthenticated(
                    "the authorization metadata is not `Bearer <token>`".into(),
                )
            })?;
        let holder = token_role(secret).map_err(ApiError::Unauthenticated)?;
        return Ok(Caller::Holder {
            actor: format!("token:{}", holder.name),
            role: holder.role,
            queues: holder.queues,
        });
    }
    match identity.member {
        Some(member) => match crate::caller::caller_of(request) {
            // Forwarded for a certificate's holder.
            Some(actor) if actor.starts_with("cert:") => Ok(Caller::Holder {
                actor,
                role: Role::User,
                queues: BTreeSet::new(),
            }),
            _ => Ok(Caller::Member(member)),
        },
        None => Ok(Caller::Holder {
            actor: format!("cert:{}", identity.common_name),
            role: Role::User,
            queues: BTreeSet::new(),
        }),
    }
}

/// Looks a secret up in `acl` at `now_ms`: the token's name and role, or
/// why it is refused (without saying which of unknown, revoked or another
/// cluster's: all three are "not one of this cluster's").
/// A token's holder, as its secret names it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TokenHolder {
    pub name: String,
    pub role: Role,
    /// The queues it may submit to; empty: any.
    pub queues: BTreeSet<String>,
}

pub fn token_role(
    acl: &keel_state::acl::Acl,
    secret: &str,
    now_ms: u64,
) -> Result<TokenHolder, String> {
    let Some((name, token)) = acl.token_for_secret(secret) else {
        return Err(
            "the token is not one of this cluster's (unknown, revoked, or another cluster's)"
                .into(),
        );
    };
    if token.expired_at(now_ms) {
        return Err(format!(
            "token {name:?} expired at {} (Unix ms); ask an admin for another",
            token.expires_at_ms.unwrap_or_default()
        ));
    }
    Ok(TokenHolder {
        name: name.to_string(),
        role: token.role,
        queues: token.queues.clone(),
    })
}

/// A new secret: `keel_` and 32 bytes from the operating system's
/// generator, in hex.
pub fn new_secret() -> Result<String, ApiError> {
    use rand::RngCore;
    let mut bytes = [0u8; 32];
    rand::rngs::OsRng
        .try_fill_bytes(&mut bytes)
        .map_err(|e| ApiError::Unavailable(format!("no randomness for a secret: {e}")))?;
    let hex: String = bytes.iter().map(|b| format!("{b:02x}")).collect();
    Ok(format!("keel_{hex}"))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_table_gives_each_role_its_rights_and_no_more() {
        use Right::*;
        let all = |role| {
            Right::ALL
                .into_iter()
                .filter(|r| scope(role, *r) == Scope::All)
                .collect::<Vec<_>>()
        };
        assert_eq!(
            all(Role::Admin),
            Right::ALL
                .into_iter()
                .filter(|r| *r != SendHeartbeats)
                .collect::<Vec<_>>()
        );
        assert_eq!(
            all(Role::Operator),
            vec![
                SubmitJobs,
                ReadJobs,
                CancelJobs,
                ReadCluster,
                ReadStatus,
                ManageNodes,
                BootstrapAcl
            ]
        );
        assert_eq!(
            all(Role::Viewer),
            vec![ReadJobs, ReadCluster, ReadStatus, BootstrapAcl]
        );
        assert_eq!(all(Role::User), vec![SubmitJobs, ReadStatus, BootstrapAcl]);
        assert_eq!(scope(Role::User, ReadJobs), Scope::Own);
        assert_eq!(scope(Role::User, CancelJobs), Scope::Own);
        assert_eq!(scope(Role::User, ManageSecrets), Scope::Own);
        assert_eq!(scope(Role::Operator, ManageSecrets), Scope::None);
        assert_eq!(
            all(Role::Node),
            vec![ReadStatus, SendHeartbeats, BootstrapAcl]
        );
    }

    #[test]
    fn a_user_reaches_its_own_jobs_only() {
        let alice = Caller::Holder {
            actor: "token:alice".into(),
            role: Role::User,
            queues: BTreeSet::new(),
        };
        let granted = alice.authorize(Right::CancelJobs).expect("own jobs");
        assert!(granted.reaches(Some("token:alice")));
        assert!(!granted.reaches(Some("token:bob")));
        assert!(
            !granted.reaches(None),
            "a job without a submitter is no one's"
        );
        let refused = granted.check_job(7, Some("token:bob")).expect_err("bob's");
        let status = tonic::Status::from(refused);
        assert_eq!(status.code(), tonic::Code::PermissionDenied);
        assert!(status.message().contains("job 7"), "{}", status.message());
        let refused = alice.authorize(Right::SetPolicy).expect_err("admin only");
        let status = tonic::Status::from(refused);
        assert_eq!(status.code(), tonic::Code::PermissionDenied);
        assert!(
            status.message().contains("set-policy") && status.message().contains("admin"),
            "{}",
            status.message()
        );
    }

    #[test]
    fn a_token_limited_to_queues_submits_to_those_only() {
        let alice = Caller::Holder {
            actor: "token:alice".into(),
            role: Role::User,
            queues: BTreeSet::from(["default".to_string(), "team-a".to_string()]),
        };
        let granted = alice.authorize(Right::SubmitJobs).expect("submits");
        granted.check_queue("team-a").expect("its queue");
        granted.check_queue("").expect("the default queue, named");
        let status = tonic::Status::from(granted.check_queue("team-b").expect_err("another"));
        assert_eq!(status.code(), tonic::Code::PermissionDenied);
        assert!(
            status
                .message()
                .contains("token:alice may submit to queues \"default\", \"team-a\" only")
                && status.message().contains("\"team-b\""),
            "{}",
            status.message()
        );
        let bob = Caller::Holder {
            actor: "token:bob".into(),
            role: Role::User,
            queues: BTreeSet::new(),
        };
        let granted = bob.authorize(Right::SubmitJobs).expect("submits");
        granted.check_queue("team-b").expect("no queues: any");
    }

    #[test]
    fn a_node_token_reports_its_own_nodes_only() {
        let rack = Caller::Holder {
            actor: "token:rack1".into(),
            role: Role::Node,
            queues: BTreeSet::new(),
        };
        for own in ["rack1", "rack1-0", "rack1-gpu-7"] {
            assert!(may_report_node(&rack, own).is_ok(), "{own}");
        }
        for other in ["rack10", "rack2", "r", "sim-0"] {
            assert!(may_report_node(&rack, other).is_err(), "{other}");
        }
        assert!(may_report_node(&Caller::Member(2), "anything").is_ok());
        assert!(may_report_node(&Caller::Server, "anything").is_ok());
    }

    #[test]
    fn secrets_are_long_random_and_valid() {
        let a = new_secret().expect("a");
        let b = new_secret().expect("b");
        assert_ne!(a, b);
        keel_state::acl::validate_secret(&a).expect("valid");
        assert_eq!(a.len(), "keel_".len() + 64);
    }
}
