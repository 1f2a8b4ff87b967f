//! A data directory written by an earlier version of Keel (committed under
//! `tests/fixtures/`, see its README) opens in this one with the same
//! state: the offline replay, the state machine as a server opens it, and
//! every record of its Raft log. Issue 21 changes the encodings; this is
//! what holds them to the disks users already have.

use keel_storage::{replay_data_dir, DataDir, LogStore, StateMachineStore, Until};

/// What `keel replay` said of the fixture when it was written.
const LAST_INDEX: u64 = 31;
const STATE_HASH: &str = "a3fa95e79133ee6600af8ce36229b5aecf7c06a8990c5f65897ac6e19d7c6037";

#[path = "support/fixture.rs"]
mod fixture;

use fixture::fixture;

#[test]
fn a_data_directory_of_entry_format_3_replays_to_the_same_state() {
    let tmp = fixture();
    let dir = DataDir::open(tmp.path()).expect("data dir");
    let summary = replay_data_dir(&dir, Until::End).expect("replays");
    assert_eq!(summary.last_index, LAST_INDEX);
    assert_eq!(summary.state_hash.to_string(), STATE_HASH);
    assert_eq!(summary.refused, 0);
    assert_eq!(summary.nodes, 1);
    let jobs: Vec<(&str, u64)> = summary
        .jobs_by_state
        .iter()
        .map(|(s, n)| (s.as_str(), *n))
        .collect();
    assert_eq!(
        jobs,
        vec![("cancelled", 1), ("failed", 1), ("succeeded", 2)]
    );
}

#[test]
fn a_data_directory_of_entry_format_3_opens_as_a_server_opens_it() {
    let tmp = fixture();
    // It holds every kind of record: a snapshot (format 6) besides the
    // journal's pages and the WAL's entries, membership included.
    {
        let db = sled::open(tmp.path().join("state")).expect("sled");
        let tree = db.open_tree("sm").expect("tree");
        assert!(
            tree.get(b"m/snapshot-data").expect("read").is_some(),
            "the fixture has a snapshot"
        );
    }
    // The state machine: its snapshot, then the journal after it.
    let store = StateMachineStore::open(&tmp.path().join("state")).expect("opens");
    {
        let shared = store.shared();
        let applied = shared.read();
        assert_eq!(applied.last_applied.map(|l| l.index), Some(LAST_INDEX));
        assert_eq!(applied.state.state_hash().to_string(), STATE_HASH);
        assert!(
            !applied
                .membership
                .membership()
                .voter_ids()
                .collect::<Vec<_>>()
                .is_empty(),
            "the membership is kept"
        );
    }
    drop(store);
    // The Raft log: every record it holds decodes, up to the last index.
    let log = LogStore::open(&tmp.path().join("raft-log")).expect("opens");
    let last = log.last_log_id().expect("a log");
    assert_eq!(last.index, LAST_INDEX);
    let entries = log
        .entries(0, last.index + 1)
        .expect("every record decodes");
    assert!(!entries.is_empty());
    assert_eq!(entries.last().map(|e| e.log_id), Some(last));
    assert!(log.vote().is_some(), "the vote is kept");
}
