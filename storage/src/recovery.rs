//! Offline recovery of a cluster that cannot commit: etcd's
//! `--force-new-cluster`, for Keel's data directories.
//!
//! A cluster that lost a quorum of its voters, or that is stuck in the
//! joint phase of a membership change whose new members are gone (a joint
//! configuration commits only with a quorum of both the old and the new
//! voters), cannot change its membership through Raft: every change must
//! commit first. The operator stops the surviving replica that holds the
//! most log, and [`force_single_voter`] rewrites its log so that it is the
//! only voter:
//!
//! 1. the vote moves to a term above every term in the log, voted for
//!    this replica (synced before anything is appended: a log entry must
//!    never be of a term above the vote);
//! 2. a membership entry naming this replica alone is appended after the
//!    last entry (synced).
//!
//! openraft reads the last membership entry of the log as the effective
//! one, so the replica starts as the only voter, elects itself and commits
//! its whole log, the entries it held but never saw committed included (as
//! etcd does). Nothing it holds is dropped. The other members' data
//! directories must be wiped before they are added back (as new members,
//! with `keel cluster add`): they still believe in the old membership.

use std::collections::{BTreeMap, BTreeSet};

use openraft::{BasicNode, CommittedLeaderId, EntryPayload, Membership, Vote};

use crate::{DataDir, Entry, LogId, LogStore, StateMachineStore, StoreError};

/// Why a data directory could not be recovered.
#[derive(Debug, thiserror::Error)]
pub enum RecoveryError {
    #[error(transparent)]
    Store(#[from] StoreError),
    #[error("cannot open the Raft log in {path}: {source}")]
    Log {
        path: String,
        source: std::io::Error,
    },
    #[error("the data directory holds no Raft log: there is no cluster to recover")]
    NoLog,
    #[error(
        "Raft id {raft_id} is not a voter of the membership this data directory holds \
         (voters {voters:?}); only a voter's log is known to hold what the cluster acknowledged"
    )]
    NotAVoter { raft_id: u64, voters: Vec<u64> },
    #[error(
        "the membership names no address for Raft id {raft_id}; give the address this \
         replica serves on"
    )]
    NoAddress { raft_id: u64 },
    #[error("the data directory already holds a Raft log or vote: restore into an empty one")]
    NotEmpty,
    #[error("the snapshot cannot be read: {0}")]
    Snapshot(String),
}

/// Founds a new one-member cluster in the empty data directory `dir` (held
/// locked) from a snapshot's state (`keel snapshot restore`): the state
/// machine holds `state` as its snapshot, applied at `index` of `term`,
/// with a membership naming `raft_id` at `address` alone; the log holds a
/// vote for `raft_id` at that term and no entry (Raft purges the log up
/// to the snapshot when it starts). Started, the replica elects itself
/// and serves the state from `index` on; other members are then added
/// with `keel cluster add`. Returns the snapshot's log id.
pub fn found_from_snapshot(
    dir: &DataDir,
    raft_id: u64,
    address: &str,
    term: u64,
    index: u64,
    state: &[u8],
) -> Result<LogId, RecoveryError> {
    let log_dir = dir.raft_log_dir();
    let log = LogStore::open(&log_dir).map_err(|source| RecoveryError::Log {
        path: log_dir.display().to_string(),
        source,
    })?;
    if log.last_log_id().is_some() || log.vote().is_some() {
        return Err(RecoveryError::NotEmpty);
    }
    let decoded = crate::snapshot_codec::decode_snapshot(state).map_err(RecoveryError::Snapshot)?;
    let term = term.max(1);
    let log_id = LogId::new(CommittedLeaderId::new(term, raft_id), index);
    let membership = Membership::new(
        vec![BTreeSet::from([raft_id])],
        BTreeMap::from([(
            raft_id,
            BasicNode {
                addr: address.to_string(),
            },
        )]),
    );
    let meta = openraft::SnapshotMeta {
        last_log_id: Some(log_id),
        last_membership: openraft::StoredMembership::new(Some(log_id), membership),
        snapshot_id: format!("restored-{term}-{index}"),
    };
    let sm = StateMachineStore::open(&dir.state_dir())?;
    sm.restore_at_rest(&meta, state, decoded)?;
    // No entry may be of a term above the vote.
    log.save_vote_durable(&Vote::new(term, raft_id))?;
    tracing::warn!(raft_id, %address, index, term, "founded a new one-member cluster from a snapshot");
    Ok(log_id)
}

/// What [`force_single_voter`] did.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ForcedMembership {
    /// The voter sets of the membership the log held (two while it was
    /// in a joint configuration).
    pub previous_configs: Vec<BTreeSet<u64>>,
    /// The last index known committed before (`None`: not recorded).
    pub committed_index: Option<u64>,
    /// The appended membership entry.
    pub log_id: LogId,
    /// The address the replica is a member at.
    pub address: String,
}

/// Makes the replica whose data directory is `dir` (held locked, so no
/// server runs on it) the only voter of its cluster, as Raft id `raft_id`
/// at `address` (default: its address in the membership). See the module
/// documentation for what it writes and why that is safe for what the
/// replica holds.
pub fn force_single_voter(
    dir: &DataDir,
    raft_id: u64,
    address: Option<&str>,
) -> Result<ForcedMembership, RecoveryError> {
    let log_dir = dir.raft_log_dir();
    let log = LogStore::open(&log_dir).map_err(|source| RecoveryError::Log {
        path: log_dir.display().to_string(),
        source,
    })?;
    let (last, vote) = (log.last_log_id(), log.vote());
    let Some(last) = last else {
        return Err(RecoveryError::NoLog);
    };
    // The membership in effect: the last membership entry of the log, else
    // the one the state machine applied last.
    let applied = {
        let sm = StateMachineStore::open(&dir.state_dir())?;
        let shared = sm.shared();
        let guard = shared.read();
        (guard.last_applied, guard.membership.membership().clone())
    };
    let (applied_id, applied_membership) = applied;
    let from = applied_id.map_or(0, |l| l.index + 1);
    let mut effective = applied_membership;
    for entry in log.entries(from, last.index + 1)? {
        if let EntryPayload::Membership(m) = entry.payload {
            effective = m;
        }
    }
    let configs: Vec<BTreeSet<u64>> = effective.get_joint_config().clone();
    if !configs.iter().any(|c| c.contains(&raft_id)) {
        return Err(RecoveryError::NotAVoter {
            raft_id,
            voters: effective.voter_ids().collect(),
        });
    }
    let address = match address {
        Some(a) => a.to_string(),
        None => effective
            .get_node(&raft_id)
            .map(|n| n.addr.clone())
            .ok_or(RecoveryError::NoAddress { raft_id })?,
    };
    let term = vote
        .map_or(0, |v| v.leader_id.term)
        .max(last.leader_id.term)
        .saturating_add(1);
    let committed_index = log.committed_index();
    // The vote first: a crash between the two leaves a higher term and
    // nothing else, which is harmless.
    log.save_vote_durable(&Vote::new(term, raft_id))?;
    let log_id = LogId::new(CommittedLeaderId::new(term, raft_id), last.index + 1);
    let membership = Membership::new(
        vec![BTreeSet::from([raft_id])],
        BTreeMap::from([(
            raft_id,
            BasicNode {
                addr: address.clone(),
            },
        )]),
    );
    log.append_durable(&[Entry {
        log_id,
        payload: EntryPayload::Membership(membership),
    }])?;
    tracing::warn!(
        raft_id,
        %address,
        index = log_id.index,
        term,
        "forced a new one-voter cluster"
    );
    Ok(ForcedMembership {
        previous_configs: configs,
        committed_index,
        log_id,
        address,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn membership_entry(term: u64, index: u64, configs: Vec<BTreeSet<u64>>) -> Entry {
        let nodes: BTreeMap<u64, BasicNode> = configs
            .iter()
            .flatten()
            .map(|id| {
                (
                    *id,
                    BasicNode {
                        addr: format!("127.0.0.1:{}", 7000 + id),
                    },
                )
            })
            .collect();
        Entry {
            log_id: LogId::new(CommittedLeaderId::new(term, 1), index),
            payload: EntryPayload::Membership(Membership::new(configs, nodes)),
        }
    }

    fn blank(term: u64, index: u64) -> Entry {
        Entry {
            log_id: LogId::new(CommittedLeaderId::new(term, 1), index),
            payload: EntryPayload::Blank,
        }
    }

    #[test]
    fn a_replica_stuck_in_a_joint_change_becomes_the_only_voter_above_every_term() {
        let tmp = tempfile::tempdir().expect("tempdir");
        {
            let dir = DataDir::open(tmp.path()).expect("data dir");
            let log = LogStore::open(&dir.raft_log_dir()).expect("log");
            let three = BTreeSet::from([1, 2, 3]);
            log.append_durable(&[
                membership_entry(1, 0, vec![three.clone()]),
                blank(1, 1),
                blank(2, 2),
                // Removing 3 while 2 and 3 are gone: a joint configuration
                // that cannot commit.
                membership_entry(2, 3, vec![three, BTreeSet::from([1, 2])]),
            ])
            .expect("append");
            log.save_vote_durable(&Vote::new_committed(2, 1))
                .expect("vote");
        }
        let dir = DataDir::open(tmp.path()).expect("data dir");
        // A member of no configuration is refused, and nothing is written.
        let refused = force_single_voter(&dir, 9, None).expect_err("9 is no voter");
        assert!(
            matches!(refused, RecoveryError::NotAVoter { raft_id: 9, ref voters } if voters == &[1, 2, 3]),
            "{refused}"
        );
        let forced = force_single_voter(&dir, 1, None).expect("forced");
        assert_eq!(
            forced.previous_configs,
            vec![BTreeSet::from([1, 2, 3]), BTreeSet::from([1, 2])]
        );
        assert_eq!(forced.address, "127.0.0.1:7001");
        assert_eq!(forced.log_id.index, 4);
        assert_eq!(forced.log_id.leader_id.term, 3);
        drop(dir);
        // What a restart reads: the vote for itself at the new term, and the
        // one-voter membership as the last entry, after everything else.
        let log = LogStore::open(&tmp.path().join("raft-log")).expect("log");
        let vote = log.vote().expect("a vote");
        assert_eq!((vote.leader_id.term, vote.leader_id.node_id), (3, 1));
        assert!(!vote.committed, "it must still win an election");
        let entries = log.entries(0, 10).expect("entries");
        assert_eq!(entries.len(), 5, "nothing the replica held is dropped");
        match &entries[4].payload {
            EntryPayload::Membership(m) => {
                assert_eq!(m.get_joint_config(), &vec![BTreeSet::from([1])]);
                assert_eq!(m.nodes().count(), 1);
            }
            other => panic!("the last entry is {other:?}"),
        }
    }

    #[test]
    fn a_snapshot_founds_a_one_member_cluster_only_in_an_empty_directory() {
        let mut state = keel_state::ClusterState::new();
        let spec = keel_state::fixtures::job_spec("saved", 1, 1);
        state
            .apply(
                1,
                &keel_state::LogEntry::new(5, keel_state::Command::submit_job(spec)),
            )
            .expect("applied");
        let bytes = crate::snapshot_codec::encode_snapshot(&state);
        let tmp = tempfile::tempdir().expect("tempdir");
        {
            let dir = DataDir::open(tmp.path()).expect("data dir");
            let refused = found_from_snapshot(&dir, 7, "127.0.0.1:7007", 3, 40, b"\x09junk")
                .expect_err("not a snapshot");
            assert!(matches!(refused, RecoveryError::Snapshot(_)), "{refused}");
            let log_id =
                found_from_snapshot(&dir, 7, "127.0.0.1:7007", 3, 40, &bytes).expect("founded");
            assert_eq!((log_id.index, log_id.leader_id.term), (40, 3));
            let again = found_from_snapshot(&dir, 7, "127.0.0.1:7007", 3, 40, &bytes)
                .expect_err("not empty any more");
            assert!(matches!(again, RecoveryError::NotEmpty), "{again}");
        }
        // What a start reads: the state at index 40, member 7 alone, and a
        // vote for it at the snapshot's term (not committed: it elects
        // itself).
        let sm = StateMachineStore::open(&tmp.path().join("state")).expect("state");
        let shared = sm.shared();
        let applied = shared.read();
        assert_eq!(applied.state.state_hash(), state.state_hash());
        assert_eq!(applied.last_applied.map(|l| l.index), Some(40));
        let voters: Vec<u64> = applied.membership.membership().voter_ids().collect();
        assert_eq!(voters, vec![7]);
        drop(applied);
        let log = LogStore::open(&tmp.path().join("raft-log")).expect("log");
        let vote = log.vote().expect("a vote");
        assert_eq!(
            (vote.leader_id.term, vote.leader_id.node_id, vote.committed),
            (3, 7, false)
        );
        assert!(
            log.last_log_id().is_none(),
            "no entry: Raft purges up to the snapshot"
        );
    }

    #[test]
    fn a_directory_without_a_log_has_nothing_to_recover() {
        let tmp = tempfile::tempdir().expect("tempdir");
        let dir = DataDir::open(tmp.path()).expect("data dir");
        assert!(matches!(
            force_single_voter(&dir, 1, None),
            Err(RecoveryError::NoLog)
        ));
    }
}
