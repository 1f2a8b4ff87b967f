//! A replica removed from its cluster (issue 34), as etcd treats one: it
//! says so to every client and stops.
//!
//! - How a replica learns it was removed:
//!   - [`removed_by_membership`] (pure): the membership it applied last
//!     (committed) names it no more, and an earlier one it applied did
//!     (a replica catching up from the start applies memberships from
//!     before it joined: those do not count). A leader that removes itself
//!     learns it this way.
//!   - [`refuse_vote_of_removed`] (pure): a follower removed by a leader
//!     never gets the entry that removes it (the leader stops replicating
//!     to it as the entry is appended). When it stands for election, a
//!     peer whose committed membership names it no more and is newer than
//!     anything in the candidate's log refuses the vote with the removal
//!     ([`REMOVED_AT_HEADER`]); the candidate's network hands that to
//!     [`RemovalFlag::told`]. A lagging peer cannot say it wrongly: a
//!     member's own log holds the membership that added it, which is newer
//!     than any membership without it.
//! - What it does then ([`watch`]): writes `DATA/removed` first (so the
//!   data directory refuses to start as a member again, [`check_not_removed`]),
//!   logs the removal, answers every API request but `ClusterStatus` with
//!   UNAVAILABLE and the removal's words ([`RefuseWhenRemoved`]; clients
//!   try their next address), shows it in `ClusterStatus`, and stops after
//!   `--removed-grace-s`.
//!
//! A removed learner is not told (it never votes): it stops hearing from
//! the leader and serves stale reads only until an operator stops it.

use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use openraft::BasicNode;
use serde::{Deserialize, Serialize};

use crate::membership::{member_of, show};

/// Metadata of a vote refusal that tells the candidate it was removed: the
/// log index of the membership that no longer names it.
pub const REMOVED_AT_HEADER: &str = "keel-removed-at";

/// The file a removed replica writes in its data directory.
pub const REMOVED_FILE: &str = "removed";

/// A replica's removal from its cluster.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Removal {
    /// The Raft id (member id and incarnation) that was removed.
    pub raft_id: u64,
    pub cluster_id: String,
    /// The log index of the membership that names it no more.
    pub index: u64,
    /// How it learned: "applied the membership" or "told by member N".
    pub how: String,
    /// Unix ms when it learned.
    pub learned_at_ms: u64,
}

impl std::fmt::Display for Removal {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "replica {} was removed from cluster {} at log index {}; it serves nothing",
            show(self.raft_id),
            if self.cluster_id.is_empty() {
                "(unnamed)"
            } else {
                &self.cluster_id
            },
            self.index
        )
    }
}

/// Why a data directory refuses to start.
#[derive(Debug, thiserror::Error)]
pub enum RemovalError {
    #[error(
        "{removal} (learned {how}). This data directory cannot serve as a member again: \
         to bring member {member} back, add it through a member (`keel cluster add --id {member} \
         --address ...`) and start it on an empty data directory"
    )]
    Removed {
        removal: Removal,
        how: String,
        member: u64,
    },
    #[error("cannot read {path}: {source}")]
    Read {
        path: PathBuf,
        source: std::io::Error,
    },
    #[error("{path} is not a removal record: {reason}")]
    Corrupt { path: PathBuf, reason: String },
    #[error("cannot write {path}: {source}")]
    Write {
        path: PathBuf,
        source: std::io::Error,
    },
}

/// Refuses to start on a data directory whose replica was removed.
pub fn check_not_removed(data_dir: &Path) -> Result<(), RemovalError> {
    let path = data_dir.join(REMOVED_FILE);
    let bytes = match std::fs::read(&path) {
        Ok(b) => b,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(()),
        Err(source) => return Err(RemovalError::Read { path, source }),
    };
    let removal: Removal = serde_json::from_slice(&bytes).map_err(|e| RemovalError::Corrupt {
        path: path.clone(),
        reason: e.to_string(),
    })?;
    Err(RemovalError::Removed {
        how: removal.how.clone(),
        member: member_of(removal.raft_id),
        removal,
    })
}

/// Writes the removal record durably (write, fsync, rename, fsync the
/// directory) before anything is said of it.
pub fn record(data_dir: &Path, removal: &Removal) -> Result<(), RemovalError> {
    use std::io::Write;
    let path = data_dir.join(REMOVED_FILE);
    let tmp = data_dir.join(format!("{REMOVED_FILE}.tmp"));
    let write = |source| RemovalError::Write {
        path: path.clone(),
        source,
    };
    let body = serde_json::to_vec_pretty(removal).map_err(|e| write(std::io::Error::other(e)))?;
    let mut file = std::fs::File::create(&tmp).map_err(write)?;
    file.write_all(&body).map_err(write)?;
    file.sync_all().map_err(write)?;
    std::fs::rename(&tmp, &path).map_err(write)?;
    std::fs::File::open(data_dir)
        .and_then(|d| d.sync_all())
        .map_err(write)
}

/// The log index at which the applied membership removed `me`, if it did:
/// `membership` (its log index and every Raft id it names, voters and
/// learners, both halves of a joint one) is committed (at or below
/// `last_applied`) and does not name `me`, and `me` was named by a
/// membership applied before (`was_member`).
pub fn removed_by_membership(
    me: u64,
    was_member: bool,
    membership_index: Option<u64>,
    named: &[u64],
    last_applied: Option<u64>,
) -> Option<u64> {
    let index = membership_index?;
    let committed = last_applied.is_some_and(|applied| index <= applied);
    (was_member && committed && !named.contains(&me)).then_some(index)
}

/// Whether a vote request from `candidate`, whose log ends at
/// `candidate_last_index`, comes from a replica removed by this replica's
/// committed membership (see the module's notes): the membership's log
/// index, or `None`.
pub fn refuse_vote_of_removed(
    me: u64,
    candidate: u64,
    candidate_last_index: Option<u64>,
    membership_index: Option<u64>,
    named: &[u64],
    last_applied: Option<u64>,
) -> Option<u64> {
    let index = membership_index?;
    let committed = last_applied.is_some_and(|applied| index <= applied);
    let newer_than_its_log = candidate_last_index.is_none_or(|last| index > last);
    (committed && named.contains(&me) && !named.contains(&candidate) && newer_than_its_log)
        .then_some(index)
}

/// Every Raft id a membership names (voters and learners; both halves of
/// a joint one).
pub fn named(membership: &openraft::Membership<u64, BasicNode>) -> Vec<u64> {
    membership.nodes().map(|(id, _)| *id).collect()
}

/// Where a replica keeps what it learned of its removal: shared by the
/// network (a peer's refusal), the API (what to answer) and [`watch`].
#[derive(Debug, Clone, Default)]
pub struct RemovalFlag(Arc<Mutex<Option<Removal>>>);

impl RemovalFlag {
    /// The removal, once known.
    pub fn get(&self) -> Option<Removal> {
        self.0.lock().unwrap_or_else(|e| e.into_inner()).clone()
    }

    /// Sets the removal if none is set yet; returns whether it was set.
    fn set(&self, removal: Removal) -> bool {
        let mut slot = self.0.lock().unwrap_or_else(|e| e.into_inner());
        if slot.is_some() {
            return false;
        }
        *slot = Some(removal);
        true
    }

    /// A peer refused this replica's vote request: it was removed at
    /// `index` (pending [`watch`]'s record).
    pub fn told(&self, me: u64, cluster_id: String, index: u64, by: u64, at_ms: u64) {
        let removal = Removal {
            raft_id: me,
            cluster_id,
            index,
            how: format!("from member {}, which refused its vote", show(by)),
            learned_at_ms: at_ms,
        };
        if self.set(removal) {
            tracing::debug!(index, by, "a peer says this replica was removed");
        }
    }
}

/// Watches for this replica's removal; once known, records it, says it,
/// and returns after `grace` (the caller stops the server). Never returns
/// if the replica is not removed.
pub async fn watch(
    node: Arc<crate::raft_node::RaftNode>,
    flag: RemovalFlag,
    data_dir: PathBuf,
    grace: Duration,
) -> Removal {
    let me = node.id;
    let metrics = node.raft.metrics();
    // Woken by a membership change (the server's metrics change only with
    // it, the leader or the vote), not at every write as `metrics` would
    // be; the removing membership's apply follows its append by moments,
    // and the tick below sees it.
    let mut server_metrics = node.raft.server_metrics();
    let mut was_member = false;
    let removal = loop {
        {
            let m = metrics.borrow();
            let named = named(m.membership_config.membership());
            was_member |= named.contains(&me);
            if let Some(index) = removed_by_membership(
                me,
                was_member,
                m.membership_config.log_id().map(|l| l.index),
                &named,
                m.last_applied.map(|l| l.index),
            ) {
                let removal = Removal {
                    raft_id: me,
                    cluster_id: node.identity.get().unwrap_or_default(),
                    index,
                    how: "by applying the membership that removed it".into(),
                    learned_at_ms: node.clock.wall_ms(),
                };
                flag.set(removal);
            }
        }
        if let Some(removal) = flag.get() {
            break removal;
        }
        tokio::select! {
            changed = server_metrics.changed() => {
                if changed.is_err() {
                    std::future::pending::<()>().await;
                }
            }
            // A peer's refusal sets the flag without a metrics change.
            _ = tokio::time::sleep(Duration::from_millis(200)) => {}
        }
    };
    if let Err(e) = record(&data_dir, &removal) {
        tracing::error!(error = %e, "cannot record this replica's removal; it stops all the same");
    }
    tracing::error!(
        how = %removal.how,
        grace_s = grace.as_secs_f64(),
        "{removal}: it answers every request with that and stops after the grace (--removed-grace-s)"
    );
    tokio::time::sleep(grace).await;
    removal
}

/// Answers every API request but `ClusterStatus` with UNAVAILABLE and the
/// removal's words once this replica is removed.
#[derive(Debug, Clone)]
pub struct RefuseWhenRemoved<S> {
    pub inner: S,
    pub flag: RemovalFlag,
}

impl<S: tonic::server::NamedService> tonic::server::NamedService for RefuseWhenRemoved<S> {
    const NAME: &'static str = S::NAME;
}

/// The one API method a removed replica still answers.
const STATUS_PATH: &str = "/keel.api.v1.Keel/ClusterStatus";

impl<S> tonic::codegen::Service<tonic::codegen::http::Request<tonic::body::Body>>
    for RefuseWhenRemoved<S>
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
        self.inner.poll_ready(cx)
    }

    fn call(&mut self, request: tonic::codegen::http::Request<tonic::body::Body>) -> Self::Future {
        if request.uri().path() != STATUS_PATH {
            if let Some(removal) = self.flag.get() {
                let status = crate::grpc_status::status_with_reason(
                    tonic::Code::Unavailable,
                    removal.to_string(),
                    crate::grpc_status::reason::REMOVED,
                    None,
                    Default::default(),
                );
                return Box::pin(async move { Ok(status.into_http()) });
            }
        }
        Box::pin(self.inner.call(request))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_replica_is_removed_only_by_a_committed_membership_after_one_that_named_it() {
        let (me, other) = (1, 2);
        // Catching up from the start: memberships from before it joined.
        assert_eq!(
            removed_by_membership(me, false, Some(1), &[other], Some(5)),
            None
        );
        // Named before, named no more, committed: removed at 7.
        assert_eq!(
            removed_by_membership(me, true, Some(7), &[other], Some(7)),
            Some(7)
        );
        // Not yet committed: it may still be undone.
        assert_eq!(
            removed_by_membership(me, true, Some(7), &[other], Some(6)),
            None
        );
        // A joint membership still names it.
        assert_eq!(
            removed_by_membership(me, true, Some(7), &[me, other], Some(9)),
            None
        );
    }

    #[test]
    fn only_a_candidate_that_never_got_its_removal_is_told() {
        let (me, removed, newcomer) = (2, 1, 4);
        // Membership at 10 names 2 and 3: 1 was removed; its log ends at 9.
        assert_eq!(
            refuse_vote_of_removed(me, removed, Some(9), Some(10), &[2, 3], Some(12)),
            Some(10)
        );
        // A newcomer made a voter at 20 asks a peer that lags at the
        // membership of 10: its log holds 20, so it is not told.
        assert_eq!(
            refuse_vote_of_removed(me, newcomer, Some(20), Some(10), &[2, 3], Some(12)),
            None
        );
        // Uncommitted here, or this replica not a member: nothing said.
        assert_eq!(
            refuse_vote_of_removed(me, removed, Some(9), Some(10), &[2, 3], Some(9)),
            None
        );
        assert_eq!(
            refuse_vote_of_removed(5, removed, Some(9), Some(10), &[2, 3], Some(12)),
            None
        );
        // A member asks: nothing said.
        assert_eq!(
            refuse_vote_of_removed(me, 3, Some(9), Some(10), &[2, 3], Some(12)),
            None
        );
    }

    #[test]
    fn a_removed_data_directory_refuses_to_start_naming_the_way_back() {
        let dir = tempfile::tempdir().expect("tempdir");
        assert!(check_not_removed(dir.path()).is_ok());
        let removal = Removal {
            raft_id: crate::membership::raft_id(1, 0xabc),
            cluster_id: "c-1".into(),
            index: 42,
            how: "by applying the membership that removed it".into(),
            learned_at_ms: 1,
        };
        record(dir.path(), &removal).expect("recorded");
        let err = check_not_removed(dir.path()).expect_err("refused");
        let text = err.to_string();
        assert!(
            text.starts_with("replica 1.000000000abc was removed from cluster c-1 at log index 42"),
            "{text}"
        );
        assert!(text.contains("keel cluster add --id 1"), "{text}");
    }
}
