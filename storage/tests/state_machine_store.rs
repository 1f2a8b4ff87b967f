//! The sled state machine: recovery on reopen, snapshots, the journal, and
//! offline replay, on real files.

use keel_state::{Command, Gpu, GpuRef, JobPlacement, JobSpec, LogEntry, Proposal};
use keel_storage::{replay, Entry, StateMachineStore};
use openraft::storage::RaftStateMachine;
use openraft::{CommittedLeaderId, EntryPayload, LogId, RaftSnapshotBuilder};

fn spec(name: &str) -> JobSpec {
    keel_state::fixtures::job_spec(name, 1, 1)
}

fn normal(index: u64, command: Command) -> Entry {
    Entry {
        log_id: LogId::new(CommittedLeaderId::new(1, 1), index),
        payload: EntryPayload::Normal(Proposal::new(vec![LogEntry::new(index * 1000, command)])),
    }
}

/// A small history: a node, jobs, an allocation, a refused cancel.
fn history(from: u64, jobs: u64) -> Vec<Entry> {
    let mut out = vec![Entry {
        log_id: LogId::new(CommittedLeaderId::new(1, 1), from),
        payload: EntryPayload::Blank,
    }];
    let mut i = from + 1;
    out.push(normal(
        i,
        Command::register_node(
            format!("n{from}"),
            "127.0.0.1",
            (0..4)
                .map(|index| Gpu {
                    index,
                    gpu_type: "v100".into(),
                })
                .collect(),
        ),
    ));
    for j in 0..jobs {
        i += 1;
        out.push(normal(i, Command::submit_job(spec(&format!("j{j}")))));
    }
    i += 1;
    out.push(normal(i, Command::cancel_job(10_000, "no such job")));
    out
}

#[tokio::test]
async fn state_survives_reopen_and_matches_offline_replay() {
    let dir = tempfile::tempdir().expect("tempdir");
    let (hash, last) = {
        let mut sm = StateMachineStore::open(dir.path()).expect("open");
        let responses = sm.apply(history(1, 5)).await.expect("apply");
        assert_eq!(responses.len(), 8);
        assert!(
            responses[7].outcomes[0].is_err(),
            "cancel of an unknown job is refused"
        );
        let allocate = normal(
            9,
            Command::decide_allocation(
                8,
                "fifo",
                1,
                vec![JobPlacement {
                    job_id: 1,
                    gpus: vec![GpuRef {
                        node: "n1".into(),
                        index: 0,
                    }],
                    share_with: None,
                }],
            ),
        );
        sm.apply([allocate]).await.expect("apply plan");
        let shared = sm.shared();
        let applied = shared.read();
        sm.flush().expect("flush");
        (applied.state.state_hash(), applied.last_applied)
    };
    let mut reopened = StateMachineStore::open(dir.path()).expect("reopen");
    let (last_applied, _) = reopened.applied_state().await.expect("applied state");
    assert_eq!(last_applied, last);
    assert_eq!(reopened.shared().read().state.state_hash(), hash);

    let records = reopened.applied_entries(0, 100).expect("journal records");
    assert_eq!(records.len(), 8, "one record per normal entry");
    assert_eq!(records[6].command, "cancel_job");
    assert!(records[6].refused.contains("does not exist"));
    assert_eq!(records[7].command, "decide_allocation");
    drop(reopened);

    let summary = replay(dir.path(), None).expect("replay");
    assert_eq!(summary.state_hash, hash, "replay rebuilds the live state");
    assert_eq!(summary.entries, 8);
    assert_eq!(summary.refused, 1);
    assert_eq!(summary.jobs_by_state.get("running"), Some(&1));
    let partial = replay(dir.path(), Some(4)).expect("replay until 4");
    assert_eq!(partial.last_index, 4);
    assert_eq!(partial.state.jobs().len(), 2);
}

#[tokio::test]
async fn snapshot_then_more_entries_recovers_the_same_state() {
    let dir = tempfile::tempdir().expect("tempdir");
    let hash = {
        let mut sm = StateMachineStore::open(dir.path()).expect("open");
        sm.apply(history(1, 3)).await.expect("apply");
        let snap = sm.build_snapshot().await.expect("snapshot");
        assert_eq!(snap.meta.last_log_id.map(|l| l.index), Some(6));
        sm.apply(history(7, 4)).await.expect("apply more");
        sm.flush().expect("flush");
        let h = sm.shared().read().state.state_hash();
        h
    };
    let sm = StateMachineStore::open(dir.path()).expect("reopen");
    assert_eq!(sm.shared().read().state.state_hash(), hash);
    assert_eq!(sm.shared().read().state.jobs().len(), 7);
}

/// A leader's store that applied `history(1, 3)` and built a snapshot of
/// it, and a follower's that installed that snapshot and then applied
/// `history(7, 2)`.
async fn follower_from_a_snapshot(
    leader_dir: &std::path::Path,
    follower_dir: &std::path::Path,
) -> (StateMachineStore, StateMachineStore) {
    let mut leader = StateMachineStore::open(leader_dir).expect("open");
    leader.apply(history(1, 3)).await.expect("apply");
    let snap = leader.build_snapshot().await.expect("snapshot");
    let mut follower = StateMachineStore::open(follower_dir).expect("open");
    follower
        .install_snapshot(&snap.meta, snap.snapshot)
        .await
        .expect("install");
    follower.apply(history(7, 2)).await.expect("apply after");
    (leader, follower)
}

#[tokio::test]
async fn an_installed_snapshot_is_a_replay_checkpoint() {
    let leader_dir = tempfile::tempdir().expect("tempdir");
    let follower_dir = tempfile::tempdir().expect("tempdir");
    let (mut leader, follower) =
        follower_from_a_snapshot(leader_dir.path(), follower_dir.path()).await;
    leader.apply(history(7, 2)).await.expect("apply after");
    let hash = leader.shared().read().state.state_hash();
    assert_eq!(follower.shared().read().state.state_hash(), hash);
    follower.flush().expect("flush");
    drop(follower);

    let summary = replay(follower_dir.path(), None).expect("replay");
    assert_eq!(
        summary.started_after, 6,
        "replay starts at the installed snapshot"
    );
    assert_eq!(summary.state_hash, hash);
}

#[tokio::test]
async fn journal_compaction_keeps_content_and_order() {
    let dir = tempfile::tempdir().expect("tempdir");
    let entries = keel_state::fixtures::mixed_entries(5_000, 4, 3);
    let mut sm = StateMachineStore::open(dir.path()).expect("open");
    // One page per small batch, as a lightly loaded leader writes them.
    let mut index = 0u64;
    for chunk in entries.chunks(3) {
        let batch: Vec<Entry> = chunk
            .iter()
            .map(|e| {
                index += 1;
                Entry {
                    log_id: LogId::new(CommittedLeaderId::new(1, 1), index),
                    payload: EntryPayload::Normal(Proposal::new(vec![e.clone()])),
                }
            })
            .collect();
        sm.apply(batch).await.expect("apply");
    }
    let live_hash = sm.shared().read().state.state_hash();
    // Replay to an index in the middle of what will be a merged page.
    sm.flush().expect("flush");
    let before = {
        let mut state = keel_state::ClusterState::new();
        for (i, e) in entries.iter().take(2_500).enumerate() {
            let _ = state.apply(i as u64 + 1, e);
        }
        state.state_hash()
    };

    let merged = sm.compact_journal(4_000).expect("compact");
    assert!(merged > 1_000, "only {merged} pages merged");
    assert_eq!(
        sm.compact_journal(4_000).expect("compact again"),
        0,
        "idempotent"
    );
    // A snapshot in the middle of a merged page, then reopen.
    assert_eq!(sm.snapshot_latency().read().count, 0);
    let snap = sm.build_snapshot().await.expect("snapshot");
    assert_eq!(snap.meta.last_log_id.map(|l| l.index), Some(5_000));
    // Timed for `/metrics`.
    let timed = sm.snapshot_latency().read();
    assert_eq!(timed.count, 1);
    assert!(timed.sum_s > 0.0);
    sm.flush().expect("flush");
    drop(sm);

    let sm = StateMachineStore::open(dir.path()).expect("reopen");
    assert_eq!(sm.shared().read().state.state_hash(), live_hash);
    drop(sm);
    let full = replay(dir.path(), None).expect("replay");
    assert_eq!(full.entries, 5_000);
    assert_eq!(full.state_hash, live_hash);
    let partial = replay(dir.path(), Some(2_500)).expect("partial replay");
    assert_eq!(partial.last_index, 2_500);
    assert_eq!(partial.state_hash, before);
}

/// A proposal's commands share its Raft index: a reader of the journal
/// in batches smaller than a proposal resumes inside the entry, so it
/// sees every record once (resuming at the next index skipped the rest
/// of an entry whose records a batch cut).
#[tokio::test]
async fn a_journal_read_in_batches_resumes_inside_a_proposal() {
    let dir = tempfile::tempdir().expect("tempdir");
    let mut sm = StateMachineStore::open(dir.path()).expect("open");
    let commands = 700u32;
    let big = Proposal::new(
        (0..commands)
            .map(|i| LogEntry::new(1_000, Command::submit_job(spec(&format!("j{i}")))))
            .collect(),
    );
    let entries = vec![
        Entry {
            log_id: LogId::new(CommittedLeaderId::new(1, 1), 1),
            payload: EntryPayload::Normal(big),
        },
        normal(2, Command::cancel_job(1, "after the big one")),
    ];
    sm.apply(entries).await.expect("apply");
    sm.flush().expect("flush"); // the journal's writer has written it

    let batch = 256;
    let mut cursor = keel_storage::JournalCursor::at_index(0);
    let mut seen = Vec::new();
    loop {
        let records = sm.applied_entries_at(cursor, batch).expect("read");
        if let Some(last) = records.last() {
            cursor = keel_storage::JournalCursor::after(last);
        }
        let done = records.len() < batch;
        seen.extend(
            records
                .into_iter()
                .map(|r| (r.index, r.position, r.command)),
        );
        if done {
            break;
        }
    }
    assert_eq!(seen.len(), commands as usize + 1, "every record once");
    for (i, (index, position, command)) in seen.iter().take(commands as usize).enumerate() {
        assert_eq!((*index, *position), (1, i as u32));
        assert_eq!(command, "submit_job");
    }
    assert_eq!(seen[commands as usize], (2, 0, "cancel_job".to_string()));
    // What a reader resuming at the next index would have missed.
    let first = sm.applied_entries(0, batch).expect("read");
    let skipped = sm
        .applied_entries(first.last().expect("a record").index + 1, batch)
        .expect("read");
    assert_eq!(skipped.len(), 1, "the next index holds only the cancel");
}

/// Time travel on a live store: the state at an index, rebuilt from the
/// store's own journal while it stays open, is the state the entries up
/// to that index make; a request that would replay more than its bound
/// is refused, naming the bound.
#[tokio::test]
async fn a_live_store_rebuilds_the_state_at_an_index_within_a_bound() {
    let dir = tempfile::tempdir().expect("tempdir");
    let entries = keel_state::fixtures::mixed_entries(3_000, 4, 7);
    let sm = store_of(dir.path(), &entries).await;
    let state_after = |n: usize| {
        let mut state = keel_state::ClusterState::new();
        for (i, e) in entries.iter().take(n).enumerate() {
            let _ = state.apply(i as u64 + 1, e);
        }
        state.state_hash()
    };

    let at = sm
        .state_at(keel_storage::Until::Index(1_234), 10_000)
        .expect("state at 1234");
    assert_eq!(at.last_index, 1_234);
    assert_eq!(at.state_hash, state_after(1_234));
    // The live state is untouched.
    assert_eq!(sm.shared().read().state.state_hash(), state_after(3_000));
    // Past the end: the journal's end.
    let end = sm
        .state_at(keel_storage::Until::Index(u64::MAX), 10_000)
        .expect("state at the end");
    assert_eq!(end.last_index, 3_000);
    assert_eq!(end.state_hash, state_after(3_000));
    // By time: the last entry stamped at or before it.
    let stamp = entries[99].at_ms;
    let by_time = sm
        .state_at(keel_storage::Until::Time(stamp), 10_000)
        .expect("state by time");
    let last_at_stamp = entries.iter().rposition(|e| e.at_ms <= stamp).expect("one") + 1;
    assert_eq!(by_time.last_index, last_at_stamp as u64);
    assert_eq!(by_time.state_hash, state_after(last_at_stamp));
    // Bounded.
    let refused = sm
        .state_at(keel_storage::Until::Index(2_000), 500)
        .expect_err("too far");
    let message = refused.to_string();
    assert!(
        message.contains("2000 entries") && message.contains("limit of 500"),
        "{message}"
    );
}

/// A running replica's history (what the console's what-if reads): the
/// state its journal starts from, then its entries up to the index asked
/// for, in order; refused past its bound, naming it. After an installed
/// snapshot, it starts from the snapshot's state.
#[tokio::test]
async fn a_live_store_gives_its_history_from_the_journals_start_within_a_bound() {
    let dir = tempfile::tempdir().expect("tempdir");
    let entries = keel_state::fixtures::mixed_entries(500, 4, 7);
    let sm = store_of(dir.path(), &entries).await;
    let walked = |until, limit| -> Result<(u64, Vec<(u64, keel_state::LogEntry)>), String> {
        let history = sm.history(until, limit).map_err(|e| e.to_string())?;
        let mut seen = Vec::new();
        history
            .for_each(&mut |index, entry| seen.push((index, entry.clone())))
            .map_err(|e| e.to_string())?;
        assert_eq!(
            history.state_before.state_hash(),
            keel_state::ClusterState::new().state_hash()
        );
        Ok((history.first_index, seen))
    };
    let (first, all) = walked(keel_storage::Until::End, 500).expect("the whole history");
    assert_eq!(first, 1);
    let expected: Vec<(u64, keel_state::LogEntry)> = entries
        .iter()
        .enumerate()
        .map(|(i, e)| (i as u64 + 1, e.clone()))
        .collect();
    assert_eq!(all, expected);
    let (_, some) = walked(keel_storage::Until::Index(123), 500).expect("up to 123");
    assert_eq!(some, expected[..123].to_vec());
    let refused = walked(keel_storage::Until::End, 499).expect_err("over the bound");
    assert!(
        refused.contains("indexes 1 to 500") && refused.contains("limit of 499"),
        "{refused}"
    );

    // A replica that installed a snapshot: its journal starts after it.
    let (leader_dir, follower_dir) = (
        tempfile::tempdir().expect("tempdir"),
        tempfile::tempdir().expect("tempdir"),
    );
    let (leader, follower) = follower_from_a_snapshot(leader_dir.path(), follower_dir.path()).await;
    let at_snapshot = leader.shared().read().state.state_hash();
    follower.flush().expect("flush");
    let history = follower
        .history(keel_storage::Until::End, 100)
        .expect("the follower's history");
    // Index 7 is a blank entry, which the journal does not keep.
    assert_eq!(history.first_index, 8);
    assert_eq!(history.state_before.state_hash(), at_snapshot);
    let mut indexes = Vec::new();
    history
        .for_each(&mut |index, _| indexes.push(index))
        .expect("walk");
    assert_eq!(indexes.first(), Some(&8));
    assert_eq!(indexes.last(), Some(&history.last_index));
}

/// A store at `dir` that applied `entries`, one Raft entry each from
/// index 1, flushed.
async fn store_of(dir: &std::path::Path, entries: &[LogEntry]) -> StateMachineStore {
    let mut sm = StateMachineStore::open(dir).expect("open");
    let batch: Vec<Entry> = entries
        .iter()
        .enumerate()
        .map(|(i, e)| Entry {
            log_id: LogId::new(CommittedLeaderId::new(1, 1), i as u64 + 1),
            payload: EntryPayload::Normal(Proposal::new(vec![e.clone()])),
        })
        .collect();
    sm.apply(batch).await.expect("apply");
    sm.flush().expect("flush");
    sm
}

/// A data directory at `root` whose Raft log holds `all` entries,
/// committed, and whose journal only the first `journaled` (a replica
/// killed before its journal writer caught up).
async fn journal_behind_the_log(
    root: &std::path::Path,
    all: &[Entry],
    journaled: usize,
) -> keel_storage::DataDir {
    use openraft::storage::RaftLogStorage;
    let last = all.last().map(|e| e.log_id).expect("entries");
    {
        let dir = keel_storage::DataDir::open(root).expect("data dir");
        let mut log = keel_storage::LogStore::open(&dir.raft_log_dir()).expect("log");
        log.append_durable(all).expect("append");
        log.save_committed(Some(last)).await.expect("commit");
        let mut sm = StateMachineStore::open(&dir.state_dir()).expect("open");
        sm.apply(all[..journaled].to_vec()).await.expect("apply");
        sm.flush().expect("flush");
    }
    keel_storage::DataDir::open(root).expect("data dir")
}

/// A replica killed before its journal writer caught up: the Raft log holds
/// committed entries the journal does not. The offline replay takes them
/// from the log and reaches the state that applying everything gives.
#[tokio::test]
async fn replay_of_a_data_dir_takes_the_journal_tail_from_the_raft_log() {
    let tmp = tempfile::tempdir().expect("tempdir");
    let all = history(1, 6);
    let last = all.last().map(|e| e.log_id).expect("entries");
    let expected = {
        let scratch = tempfile::tempdir().expect("tempdir");
        let mut sm = StateMachineStore::open(scratch.path()).expect("open");
        sm.apply(all.clone()).await.expect("apply");
        let hash = sm.shared().read().state.state_hash();
        hash
    };
    // The journal got only the first four entries.
    let dir = journal_behind_the_log(tmp.path(), &all, 4).await;
    let journal_only = replay(&dir.state_dir(), None).expect("journal replay");
    assert_eq!(journal_only.last_index, 4);
    assert_ne!(journal_only.state_hash, expected);
    let summary = keel_storage::replay_data_dir(&dir, keel_storage::Until::End).expect("replay");
    assert_eq!(summary.state_hash, expected);
    assert_eq!(summary.last_index, last.index);
    assert_eq!(
        summary.from_log, 5,
        "entries 5..=9 (four submissions, a cancel)"
    );
    let until =
        keel_storage::replay_data_dir(&dir, keel_storage::Until::Index(6)).expect("until 6");
    assert_eq!(until.last_index, 6);
    assert_eq!(until.from_log, 2);
    // What `keel whatif` reads: every entry once, in log order, the
    // journal's then the log's, and the same state when applied.
    let read = |until: keel_storage::Until| {
        let mut entries = Vec::new();
        let last = keel_storage::for_each_entry(&dir, 0, until, &mut |index, entry| {
            entries.push((index, entry.clone()))
        })
        .expect("read");
        (last, entries)
    };
    let (read_last, entries) = read(keel_storage::Until::End);
    assert_eq!(read_last, last.index);
    let indexes: Vec<u64> = entries.iter().map(|(i, _)| *i).collect();
    assert!(
        indexes.windows(2).all(|w| w[0] <= w[1]),
        "in order: {indexes:?}"
    );
    assert!(indexes.contains(&4) && indexes.contains(&5), "{indexes:?}");
    let mut state = keel_state::ClusterState::new();
    for (index, entry) in &entries {
        let _ = state.apply(*index, entry);
    }
    assert_eq!(state.state_hash(), expected);
    let (until_last, _) = read(keel_storage::Until::Index(6));
    assert_eq!(until_last, 6);
}

/// The checked replays (what chaos runs and the deterministic simulation
/// hold every replica to) find an entry stamped earlier than the one
/// before it, in the journal and in the Raft log's tail alike.
#[tokio::test]
async fn a_checked_replay_finds_log_time_going_backwards() {
    let tmp = tempfile::tempdir().expect("tempdir");
    let mut all = history(1, 6);
    // Entry 6 stamped before entry 5 (a leader whose clock was behind).
    let backwards = |entry: &mut Entry| {
        if let EntryPayload::Normal(p) = &mut entry.payload {
            p.entries[0].at_ms = 10;
        }
    };
    backwards(&mut all[5]);
    let dir = journal_behind_the_log(tmp.path(), &all, 4).await;
    let from_log =
        keel_storage::replay_data_dir_checked(&dir, keel_storage::Until::End).expect("replays");
    let (index, why) = from_log.invariant_violation.expect("found");
    assert_eq!(index, 6);
    assert!(why.contains("went backwards"), "{why}");
    // Unchecked, the same log replays (what an operator's `keel replay`
    // does with an old log).
    assert!(
        keel_storage::replay_data_dir(&dir, keel_storage::Until::End)
            .expect("replays")
            .invariant_violation
            .is_none()
    );

    // The same in the journal.
    let journal = tempfile::tempdir().expect("tempdir");
    let mut sm = StateMachineStore::open(journal.path()).expect("open");
    sm.apply(all).await.expect("apply");
    sm.flush().expect("flush");
    drop(sm);
    let summary = keel_storage::replay_until_checked(journal.path(), keel_storage::Until::End)
        .expect("replays");
    assert_eq!(summary.invariant_violation.map(|(i, _)| i), Some(6));
}
