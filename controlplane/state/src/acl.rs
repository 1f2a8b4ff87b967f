//! Access control (issue 22, item 2): the tokens a cluster knows and the
//! role each gives, replicated like everything else.
//!
//! A token is a secret the caller presents; the log and the state keep
//! only its BLAKE3 hash, so neither a snapshot nor the journal can be
//! replayed into a working secret. Tokens are made by `BootstrapAcl` (the
//! first, an `admin`, once per cluster) and `CreateToken`, and dropped by
//! `RevokeToken`. What each role may do is the API's table
//! (`keel::authz`); this module knows roles, not methods.
//!
//! Absences: no clock (a token's expiry is its creating entry's time plus
//! its TTL, and whether it has passed is asked with a time the caller
//! gives); no secret (only hashes).

use std::collections::{BTreeMap, BTreeSet};

use serde::{Deserialize, Serialize};

/// Limits on what the ACL commands carry.
pub mod limits {
    /// A token's name: 1 to this many bytes.
    pub const TOKEN_NAME_MAX_LEN: usize = 64;
    /// The most tokens a cluster keeps (expired ones count until revoked).
    pub const TOKENS_MAX: usize = 10_000;
    /// The longest a token may live: ten years.
    pub const TOKEN_TTL_MAX_MS: u64 = 10 * 366 * 24 * 3600 * 1000;
    /// The most queues one token may be limited to.
    pub const TOKEN_QUEUES_MAX: usize = 64;
    /// A secret a client chooses itself: this many bytes at least...
    pub const SECRET_MIN_LEN: usize = 32;
    /// ...and at most this many.
    pub const SECRET_MAX_LEN: usize = 256;
}

/// What a token's holder may do. Ordered from most to least trusted; the
/// rights of each are the API's (`keel::authz`).
#[derive(
    Debug,
    Clone,
    Copy,
    PartialEq,
    Eq,
    PartialOrd,
    Ord,
    Hash,
    Serialize,
    Deserialize,
    crate::proto_form::ProtoForm,
)]
#[proto(enumeration = "keel_proto::entry::Role")]
pub enum Role {
    /// Everything: the policy, membership, nodes, tokens, any job.
    Admin,
    /// Nodes and any job.
    Operator,
    /// Submits jobs; reads, cancels and reads the logs of its own; reads
    /// the cluster's summary.
    User,
    /// Reads everything, changes nothing.
    Viewer,
    /// A node's agent: heartbeats only.
    Node,
}

impl Role {
    pub const ALL: [Role; 5] = [
        Role::Admin,
        Role::Operator,
        Role::User,
        Role::Viewer,
        Role::Node,
    ];

    pub fn as_str(self) -> &'static str {
        match self {
            Role::Admin => "admin",
            Role::Operator => "operator",
            Role::User => "user",
            Role::Viewer => "viewer",
            Role::Node => "node",
        }
    }

    pub fn parse(name: &str) -> Option<Role> {
        Role::ALL.into_iter().find(|r| r.as_str() == name)
    }
}

impl std::fmt::Display for Role {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.as_str())
    }
}

/// A secret's digest: what the state keeps of a token's secret.
#[derive(Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize)]
pub struct SecretHash(pub [u8; 32]);

impl SecretHash {
    pub fn of(secret: &str) -> SecretHash {
        SecretHash(*blake3::hash(secret.as_bytes()).as_bytes())
    }
}

impl std::fmt::Debug for SecretHash {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        // Enough to tell two apart in a log line; the hash is no secret,
        // but there is no reason to print it whole.
        write!(f, "SecretHash({:02x}{:02x}…)", self.0[0], self.0[1])
    }
}

/// One token the cluster knows.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Token {
    pub role: Role,
    pub secret_hash: SecretHash,
    /// The time of the entry that made it.
    pub created_at_ms: u64,
    /// When it stops being accepted (log time); `None`: never.
    pub expires_at_ms: Option<u64>,
    /// Who made it (the creating entry's actor).
    pub created_by: Option<String>,
    /// The queues its holder may submit jobs to (issue 23; a `user` token
    /// only); empty: any. Not in the token's serde form: hashed apart
    /// (`ClusterState::state_hash`) once a token has some, so states
    /// without them hash as before.
    #[serde(skip)]
    pub queues: BTreeSet<String>,
}

impl Token {
    /// Whether its holder may submit to queue `queue` (`""`: the default).
    pub fn may_submit_to(&self, queue: &str) -> bool {
        queue_allowed(&self.queues, queue)
    }

    /// Whether it has expired at `now_ms`.
    pub fn expired_at(&self, now_ms: u64) -> bool {
        self.expires_at_ms.is_some_and(|at| now_ms >= at)
    }
}

/// The cluster's tokens. Empty and not bootstrapped in a cluster that never
/// turned ACLs on: such a state encodes and hashes as before ACLs existed.
#[derive(Debug, Clone, Default, Serialize)]
pub struct Acl {
    bootstrapped: bool,
    tokens: BTreeMap<String, Token>,
    /// Token names by secret hash: derived from `tokens`.
    #[serde(skip)]
    by_hash: BTreeMap<SecretHash, String>,
}

impl PartialEq for Acl {
    fn eq(&self, other: &Acl) -> bool {
        self.bootstrapped == other.bootstrapped && self.tokens == other.tokens
    }
}

/// Why an ACL command was refused (`ApplyError::Acl`).
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error, Serialize, Deserialize)]
pub enum AclError {
    #[error("the cluster's ACLs are bootstrapped already (once per cluster)")]
    AlreadyBootstrapped,
    #[error("the cluster's ACLs are not bootstrapped: run keel acl bootstrap first")]
    NotBootstrapped,
    #[error("a token named {0:?} exists already")]
    NameTaken(String),
    #[error("no token is named {0:?}")]
    UnknownToken(String),
    #[error("the secret is another token's; choose another")]
    SecretTaken,
    #[error("the cluster holds {limit} tokens, the limit; revoke some first")]
    TooManyTokens { limit: usize },
    #[error("{0:?} is the last admin token that has not expired; create another admin token before revoking it")]
    LastAdmin(String),
    #[error("{field} is invalid: {reason}")]
    Invalid { field: String, reason: String },
}

/// Checks a token's name: 1 to [`limits::TOKEN_NAME_MAX_LEN`] bytes of
/// letters, digits and `.`, `_`, `-`, `@`.
pub fn validate_token_name(name: &str) -> Result<(), AclError> {
    let ok = !name.is_empty()
        && name.len() <= limits::TOKEN_NAME_MAX_LEN
        && name
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || matches!(b, b'.' | b'_' | b'-' | b'@'));
    if ok {
        Ok(())
    } else {
        Err(AclError::Invalid {
            field: "name".into(),
            reason: format!(
                "{name:?} is not a token name (1 to {} letters, digits, '.', '_', '-' or '@')",
                limits::TOKEN_NAME_MAX_LEN
            ),
        })
    }
}

/// Checks a secret a client chose: [`limits::SECRET_MIN_LEN`] to
/// [`limits::SECRET_MAX_LEN`] bytes of letters, digits, `_` and `-` (what
/// `keel acl` makes, and what fits an HTTP header as it is).
pub fn validate_secret(secret: &str) -> Result<(), AclError> {
    let ok = (limits::SECRET_MIN_LEN..=limits::SECRET_MAX_LEN).contains(&secret.len())
        && secret
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || matches!(b, b'_' | b'-'));
    if ok {
        Ok(())
    } else {
        Err(AclError::Invalid {
            field: "secret".into(),
            reason: format!(
                "a secret is {} to {} letters, digits, '_' or '-' ({} bytes given)",
                limits::SECRET_MIN_LEN,
                limits::SECRET_MAX_LEN,
                secret.len()
            ),
        })
    }
}

/// Whether a holder limited to `queues` (empty: any) may submit to the
/// job's `queue` field (`""`: the default queue).
pub fn queue_allowed(queues: &BTreeSet<String>, queue: &str) -> bool {
    queues.is_empty() || queues.contains(crate::quota::queue_of(queue))
}

/// Checks the queues a token is limited to: a `user` token's only (the
/// other roles reach every job or none), each an existing queue, at most
/// [`limits::TOKEN_QUEUES_MAX`], none twice.
pub fn validate_token_queues(
    role: Role,
    queues: &[String],
    queue_exists: impl Fn(&str) -> bool,
) -> Result<BTreeSet<String>, AclError> {
    let invalid = |reason: String| AclError::Invalid {
        field: "queues".into(),
        reason,
    };
    if queues.is_empty() {
        return Ok(BTreeSet::new());
    }
    if role != Role::User {
        return Err(invalid(format!(
            "only a user token may be limited to queues; a {role} token reaches every queue"
        )));
    }
    if queues.len() > limits::TOKEN_QUEUES_MAX {
        return Err(invalid(format!(
            "{} queues given; a token names at most {}",
            queues.len(),
            limits::TOKEN_QUEUES_MAX
        )));
    }
    let mut set = BTreeSet::new();
    for queue in queues {
        if let Err(crate::queue::QueueError::Invalid { reason, .. }) =
            crate::queue::validate_queue_name("queues", queue)
        {
            return Err(invalid(reason));
        }
        if !queue_exists(queue) {
            return Err(invalid(format!("no queue is named {queue:?}")));
        }
        if !set.insert(queue.clone()) {
            return Err(invalid(format!("{queue:?} is named twice")));
        }
    }
    Ok(set)
}

impl Acl {
    /// An ACL as a snapshot holds it; `Err` if two tokens share a secret.
    pub fn from_parts(
        bootstrapped: bool,
        tokens: BTreeMap<String, Token>,
    ) -> Result<Acl, AclError> {
        let mut by_hash = BTreeMap::new();
        for (name, token) in &tokens {
            if by_hash.insert(token.secret_hash, name.clone()).is_some() {
                return Err(AclError::SecretTaken);
            }
        }
        Ok(Acl {
            bootstrapped,
            tokens,
            by_hash,
        })
    }

    /// Whether `BootstrapAcl` has been applied.
    pub fn is_bootstrapped(&self) -> bool {
        self.bootstrapped
    }

    pub fn tokens(&self) -> &BTreeMap<String, Token> {
        &self.tokens
    }

    /// The token whose secret this is, with its name.
    pub fn token_for_secret(&self, secret: &str) -> Option<(&str, &Token)> {
        let name = self.by_hash.get(&SecretHash::of(secret))?;
        let token = self.tokens.get(name)?;
        Some((name.as_str(), token))
    }

    /// `BootstrapAcl`: the first token, an admin one.
    pub(crate) fn bootstrap(
        &mut self,
        name: &str,
        secret_hash: SecretHash,
        at_ms: u64,
        actor: Option<&String>,
    ) -> Result<(), AclError> {
        if self.bootstrapped {
            return Err(AclError::AlreadyBootstrapped);
        }
        validate_token_name(name)?;
        self.insert(
            name,
            Role::Admin,
            secret_hash,
            at_ms,
            None,
            actor,
            BTreeSet::new(),
        )?;
        self.bootstrapped = true;
        Ok(())
    }

    /// `CreateToken`; returns when it expires. `queues` limits a `user`
    /// token's submissions (each must satisfy `queue_exists`).
    #[allow(clippy::too_many_arguments)]
    pub(crate) fn create(
        &mut self,
        name: &str,
        role: Role,
        secret_hash: SecretHash,
        ttl_ms: Option<u64>,
        queues: &[String],
        queue_exists: impl Fn(&str) -> bool,
        at_ms: u64,
        actor: Option<&String>,
    ) -> Result<Option<u64>, AclError> {
        if !self.bootstrapped {
            return Err(AclError::NotBootstrapped);
        }
        validate_token_name(name)?;
        let queues = validate_token_queues(role, queues, queue_exists)?;
        let expires_at_ms = match ttl_ms {
            None => None,
            Some(ttl) if ttl == 0 || ttl > limits::TOKEN_TTL_MAX_MS => {
                return Err(AclError::Invalid {
                    field: "ttl".into(),
                    reason: format!(
                        "{ttl} ms; a token lives 1 ms to {} ms (ten years)",
                        limits::TOKEN_TTL_MAX_MS
                    ),
                })
            }
            Some(ttl) => Some(at_ms.saturating_add(ttl)),
        };
        self.insert(name, role, secret_hash, at_ms, expires_at_ms, actor, queues)?;
        Ok(expires_at_ms)
    }

    #[allow(clippy::too_many_arguments)]
    fn insert(
        &mut self,
        name: &str,
        role: Role,
        secret_hash: SecretHash,
        at_ms: u64,
        expires_at_ms: Option<u64>,
        actor: Option<&String>,
        queues: BTreeSet<String>,
    ) -> Result<(), AclError> {
        if self.tokens.contains_key(name) {
            return Err(AclError::NameTaken(name.to_string()));
        }
        if self.by_hash.contains_key(&secret_hash) {
            return Err(AclError::SecretTaken);
        }
        if self.tokens.len() >= limits::TOKENS_MAX {
            return Err(AclError::TooManyTokens {
                limit: limits::TOKENS_MAX,
            });
        }
        self.by_hash.insert(secret_hash, name.to_string());
        self.tokens.insert(
            name.to_string(),
            Token {
                role,
                secret_hash,
                created_at_ms: at_ms,
                expires_at_ms,
                created_by: actor.cloned(),
                queues,
            },
        );
        Ok(())
    }

    /// `RevokeToken`. The last admin token that has not expired at `at_ms`
    /// is kept: without it nobody could manage the cluster again.
    pub(crate) fn revoke(&mut self, name: &str, at_ms: u64) -> Result<Token, AclError> {
        let token = self
            .tokens
            .get(name)
            .ok_or_else(|| AclError::UnknownToken(name.to_string()))?;
        let live_admin = |t: &Token| t.role == Role::Admin && !t.expired_at(at_ms);
        if live_admin(token)
            && self
                .tokens
                .iter()
                .filter(|(n, t)| *n != name && live_admin(t))
                .count()
                == 0
        {
            return Err(AclError::LastAdmin(name.to_string()));
        }
        let token = self
            .tokens
            .remove(name)
            .ok_or_else(|| AclError::UnknownToken(name.to_string()))?;
        self.by_hash.remove(&token.secret_hash);
        Ok(token)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn hash(s: &str) -> SecretHash {
        SecretHash::of(s)
    }

    #[test]
    fn a_token_is_found_by_its_secret_only_while_it_is_known() {
        let mut acl = Acl::default();
        assert_eq!(
            acl.create("alice", Role::User, hash("a"), None, &[], |_| true, 0, None),
            Err(AclError::NotBootstrapped)
        );
        acl.bootstrap("root", hash("r"), 10, None)
            .expect("bootstrap");
        assert_eq!(
            acl.bootstrap("again", hash("x"), 11, None),
            Err(AclError::AlreadyBootstrapped)
        );
        let expires = acl
            .create(
                "alice",
                Role::User,
                hash("a"),
                Some(1000),
                &[],
                |_| true,
                20,
                None,
            )
            .expect("alice");
        assert_eq!(expires, Some(1020));
        assert_eq!(
            acl.create(
                "alice",
                Role::Viewer,
                hash("b"),
                None,
                &[],
                |_| true,
                21,
                None
            ),
            Err(AclError::NameTaken("alice".into()))
        );
        assert_eq!(
            acl.create(
                "bob",
                Role::Viewer,
                hash("a"),
                None,
                &[],
                |_| true,
                21,
                None
            ),
            Err(AclError::SecretTaken)
        );
        let (name, token) = acl.token_for_secret("a").expect("alice's");
        assert_eq!((name, token.role), ("alice", Role::User));
        assert!(!token.expired_at(1019) && token.expired_at(1020));
        assert!(acl.token_for_secret("nope").is_none());
        acl.revoke("alice", 30).expect("revoke");
        assert!(acl.token_for_secret("a").is_none());
        assert_eq!(
            acl.revoke("alice", 30),
            Err(AclError::UnknownToken("alice".into()))
        );
    }

    #[test]
    fn only_a_user_token_is_limited_to_queues_and_only_to_existing_ones() {
        let mut acl = Acl::default();
        acl.bootstrap("root", hash("r"), 0, None)
            .expect("bootstrap");
        let exists = |q: &str| matches!(q, "default" | "team-a" | "team-b");
        let queues = |names: &[&str]| names.iter().map(|n| n.to_string()).collect::<Vec<_>>();
        let refused = |acl: &mut Acl, role, names: &[&str]| match acl.create(
            "t",
            role,
            hash("t"),
            None,
            &queues(names),
            exists,
            1,
            None,
        ) {
            Err(AclError::Invalid { field, reason }) => {
                assert_eq!(field, "queues");
                reason
            }
            other => panic!("{names:?} for a {role} token: {other:?}"),
        };
        assert!(refused(&mut acl, Role::Operator, &["team-a"]).contains("only a user token"));
        assert!(refused(&mut acl, Role::User, &["team-c"]).contains("no queue is named \"team-c\""));
        assert!(refused(&mut acl, Role::User, &["Team"]).contains("not a queue name"));
        assert!(refused(&mut acl, Role::User, &["team-a", "team-a"]).contains("named twice"));
        let many: Vec<String> = (0..=limits::TOKEN_QUEUES_MAX)
            .map(|i| format!("q{i}"))
            .collect();
        let many: Vec<&str> = many.iter().map(String::as_str).collect();
        assert!(refused(&mut acl, Role::User, &many).contains("at most 64"));
        assert!(acl.tokens().len() == 1, "nothing refused was kept");
        acl.create(
            "alice",
            Role::User,
            hash("a"),
            None,
            &queues(&["team-b", "default"]),
            exists,
            2,
            None,
        )
        .expect("a user token limited to two queues");
        let (_, alice) = acl.token_for_secret("a").expect("alice");
        assert!(alice.may_submit_to("team-b") && alice.may_submit_to(""));
        assert!(!alice.may_submit_to("team-a"));
        let (_, root) = acl.token_for_secret("r").expect("root");
        assert!(root.may_submit_to("team-a"), "no queues: any");
    }

    #[test]
    fn the_last_live_admin_token_is_kept() {
        let mut acl = Acl::default();
        acl.bootstrap("root", hash("r"), 0, None)
            .expect("bootstrap");
        assert_eq!(
            acl.revoke("root", 1),
            Err(AclError::LastAdmin("root".into()))
        );
        acl.create(
            "ops",
            Role::Admin,
            hash("o"),
            Some(100),
            &[],
            |_| true,
            1,
            None,
        )
        .expect("ops");
        acl.revoke("root", 2).expect("another admin lives");
        // ops is the last admin; once it has expired it can go too (nobody
        // can use it any more).
        assert_eq!(
            acl.revoke("ops", 50),
            Err(AclError::LastAdmin("ops".into()))
        );
        acl.revoke("ops", 101).expect("expired");
    }

    #[test]
    fn names_secrets_and_ttls_are_bounded() {
        assert!(validate_token_name("alice@team-1.x_y").is_ok());
        for bad in ["", "a b", "ü", &"n".repeat(65)] {
            assert!(validate_token_name(bad).is_err(), "{bad:?}");
        }
        assert!(validate_secret(&"s".repeat(32)).is_ok());
        for bad in [
            &"s".repeat(31),
            &"s".repeat(257),
            &format!("{} x", "s".repeat(40)),
        ] {
            assert!(validate_secret(bad).is_err(), "{bad:?}");
        }
        let mut acl = Acl::default();
        acl.bootstrap("root", hash("r"), 0, None)
            .expect("bootstrap");
        for ttl in [0, limits::TOKEN_TTL_MAX_MS + 1] {
            assert!(matches!(
                acl.create("t", Role::User, hash("t"), Some(ttl), &[], |_| true, 0, None),
                Err(AclError::Invalid { field, .. }) if field == "ttl"
            ));
        }
    }

    #[test]
    fn a_snapshot_with_two_tokens_of_one_secret_is_refused() {
        let token = |role| Token {
            role,
            secret_hash: hash("same"),
            created_at_ms: 0,
            expires_at_ms: None,
            created_by: None,
            queues: BTreeSet::new(),
        };
        let tokens = BTreeMap::from([
            ("a".to_string(), token(Role::Admin)),
            ("b".to_string(), token(Role::User)),
        ]);
        assert_eq!(Acl::from_parts(true, tokens), Err(AclError::SecretTaken));
    }
}
