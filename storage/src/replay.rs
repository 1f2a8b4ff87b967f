//! Offline replay: rebuild `ClusterState` from a data directory's journal
//! (and, past the journal's end, from the Raft log).

use std::collections::BTreeMap;
use std::path::Path;

use keel_state::log_time::earlier_than_before;
use keel_state::{ClusterState, StateHash};

use crate::journal::{apply_journal, Visitor};
use crate::state_machine::{applied_key, decode_snapshot, index_of, key, PREFIX_CHECKPOINT};

#[derive(Debug, thiserror::Error)]
pub enum ReplayError {
    #[error("cannot open the journal in {path}: {message}")]
    Open { path: String, message: String },
    #[error("cannot read the journal: {0}")]
    Read(String),
    #[error("journal entry {index} cannot be decoded: {source}")]
    Decode {
        index: u64,
        source: keel_state::codec::DecodeError,
    },
    #[error("the checkpoint at index {index} cannot be decoded: {message}")]
    Checkpoint { index: u64, message: String },
    #[error("cannot read the Raft log in {path}: {message}")]
    Log { path: String, message: String },
    #[error(
        "rebuilding the state at index {to} would replay {} entries from {}, more than the limit of {limit} for one request",
        to - from,
        if *from == 0 { "the start".to_string() } else { format!("the checkpoint at index {from}") }
    )]
    TooFar { from: u64, to: u64, limit: u64 },
    #[error(
        "the journal holds indexes {first} to {last}, more than the limit of {limit} for one request"
    )]
    HistoryTooLong { first: u64, last: u64, limit: u64 },
}

/// What a replay rebuilt.
#[derive(Debug, Clone)]
pub struct ReplaySummary {
    /// Entries applied by this replay.
    pub entries: u64,
    /// Entries refused by the state machine (as they were when first applied).
    pub refused: u64,
    /// Index the replay started after (a checkpoint), 0 for the beginning.
    pub started_after: u64,
    /// The last index applied.
    pub last_index: u64,
    /// Entries (commands) taken from the Raft log past the journal's end:
    /// committed, but not yet journaled when the replica stopped (the
    /// journal is written behind the state machine; a SIGKILL can cut its
    /// tail, which a restart rebuilds from the log).
    pub from_log: u64,
    pub state_hash: StateHash,
    /// Only from [`replay_data_dir_checked`]: the first index after which
    /// the state broke an invariant (`ClusterState::check_invariants`), and
    /// how.
    pub invariant_violation: Option<(u64, String)>,
    pub jobs_by_state: BTreeMap<String, u64>,
    pub nodes: u64,
    pub state: ClusterState,
}

/// Replays the journal in a state directory (`DATA_DIR/state`) up to and
/// including `until` (everything if `None`).
pub fn replay(state_dir: &Path, until: Option<u64>) -> Result<ReplaySummary, ReplayError> {
    replay_until(state_dir, until.map_or(Until::End, Until::Index))
}

/// Where to stop a replay.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Until {
    /// Everything in the journal.
    End,
    /// Up to and including this log index.
    Index(u64),
    /// Up to and including the last entry stamped at or before this Unix
    /// time in milliseconds (entries carry the leader's clock; the search
    /// assumes stamps do not go backwards, as they do not between leaders
    /// whose clocks agree).
    Time(u64),
}

/// Replays a data directory up to `until`: its journal, then the committed
/// entries of its Raft log that the journal had not recorded yet.
pub fn replay_data_dir(dir: &crate::DataDir, until: Until) -> Result<ReplaySummary, ReplayError> {
    replay_dir(dir, until, false)
}

/// [`replay_data_dir`], checking the state's invariants after
/// every entry (no GPU held by two jobs outside a declared pair, indexes
/// agreeing with the jobs, ...) and that no entry's time is earlier than
/// the one before it: what a chaos run holds every replica to.
pub fn replay_data_dir_checked(
    dir: &crate::DataDir,
    until: Until,
) -> Result<ReplaySummary, ReplayError> {
    replay_dir(dir, until, true)
}

fn replay_dir(
    dir: &crate::DataDir,
    until: Until,
    check: bool,
) -> Result<ReplaySummary, ReplayError> {
    let journaled = replay_tree_at(&dir.state_dir(), until, check, None)?;
    let ReplaySummary {
        mut entries,
        mut refused,
        started_after,
        mut last_index,
        mut state,
        mut invariant_violation,
        ..
    } = journaled;
    let mut from_log = 0;
    log_tail(dir, last_index, until, &mut |index, _, e| {
        let backwards = check
            .then(|| earlier_than_before(state.last_entry_at_ms(), e.at_ms))
            .flatten();
        if state.apply(index, e).is_err() {
            refused += 1;
        }
        if check && invariant_violation.is_none() {
            if let Some(backwards) = backwards {
                invariant_violation = Some((index, backwards));
            } else if let Err(broken) = state.check_invariants() {
                invariant_violation = Some((index, broken));
            }
        }
        entries += 1;
        from_log += 1;
        last_index = index;
    })?;
    let mut summary = summarise(state, entries, refused, started_after, last_index, from_log);
    summary.invariant_violation = invariant_violation;
    Ok(summary)
}

fn summarise(
    state: ClusterState,
    entries: u64,
    refused: u64,
    started_after: u64,
    last_index: u64,
    from_log: u64,
) -> ReplaySummary {
    let mut jobs_by_state = BTreeMap::new();
    for job in state.jobs().values() {
        *jobs_by_state.entry(job.state.to_string()).or_insert(0) += 1;
    }
    ReplaySummary {
        entries,
        refused,
        started_after,
        last_index,
        from_log,
        state_hash: state.state_hash(),
        invariant_violation: None,
        jobs_by_state,
        nodes: state.nodes().len() as u64,
        state,
    }
}

/// Replays the journal in a state directory up to `until`.
pub fn replay_until(state_dir: &Path, until: Until) -> Result<ReplaySummary, ReplayError> {
    replay_tree_at(state_dir, until, false, None)
}

/// [`replay_until`], calling `visit` with each entry's index, the entry
/// and the state it is about to be applied to (the state at the entry
/// before): how a check sees the state a leader planned on. Entries before
/// the last checkpoint (an installed snapshot) are not visited.
pub fn replay_until_visiting(
    state_dir: &Path,
    until: Until,
    visit: Visitor<'_>,
) -> Result<ReplaySummary, ReplayError> {
    replay_tree_at(state_dir, until, false, Some(visit))
}

/// [`replay_until`], checking the state's invariants after every entry
/// (the journal alone: for a state directory without a Raft log, as the
/// deterministic simulation's replicas have).
pub fn replay_until_checked(state_dir: &Path, until: Until) -> Result<ReplaySummary, ReplayError> {
    replay_tree_at(state_dir, until, true, None)
}

fn replay_tree_at(
    state_dir: &Path,
    until: Until,
    check: bool,
    visit: Option<Visitor<'_>>,
) -> Result<ReplaySummary, ReplayError> {
    let db = crate::state_machine::open_sled(state_dir).map_err(|e| ReplayError::Open {
        path: state_dir.display().to_string(),
        message: e.to_string(),
    })?;
    let tree = db
        .open_tree("sm")
        .map_err(|e| ReplayError::Read(e.to_string()))?;
    let index = match until {
        Until::End => u64::MAX,
        Until::Index(i) => i,
        Until::Time(at_ms) => index_at_time(&tree, at_ms)?,
    };
    replay_tree(&tree, index, check, visit)
}

/// The last journaled index whose entry was stamped at or before `at_ms`
/// (0 when none was): a binary search over the applied records.
fn index_at_time(tree: &sled::Tree, at_ms: u64) -> Result<u64, ReplayError> {
    use prost::Message;
    let read = |e: sled::Error| ReplayError::Read(e.to_string());
    // The first record at or after `index`: (its index, its stamp).
    let record_from = |index: u64| -> Result<Option<(u64, u64)>, ReplayError> {
        let Some(item) = tree
            .range(applied_key(index, 0)..=applied_key(u64::MAX, u32::MAX))
            .next()
        else {
            return Ok(None);
        };
        let (k, v) = item.map_err(read)?;
        let record = keel_proto::entry::AppliedEntry::decode(v.as_ref())
            .map_err(|e| ReplayError::Read(format!("applied record: {e}")))?;
        Ok(Some((index_of(&k).unwrap_or(index), record.at_ms)))
    };
    let mut best = 0;
    let (mut lo, mut hi) = (0u64, u64::MAX);
    while lo < hi {
        let mid = lo + (hi - lo) / 2;
        match record_from(mid)? {
            Some((index, stamp)) if stamp <= at_ms => {
                best = best.max(index);
                lo = index.saturating_add(1);
            }
            _ => hi = mid,
        }
    }
    Ok(best)
}

/// The index `until` names in a live replica's journal `tree`: `End`, or
/// an index past the journal's last, is the last journaled one; a time,
/// the last entry stamped at or before it.
fn journaled_until(tree: &sled::Tree, until: Until) -> Result<u64, ReplayError> {
    let last = tree
        .range(applied_key(0, 0)..=applied_key(u64::MAX, u32::MAX))
        .next_back()
        .transpose()
        .map_err(|e| ReplayError::Read(e.to_string()))?
        .and_then(|(k, _)| index_of(&k))
        .unwrap_or(0);
    Ok(match until {
        Until::End => last,
        Until::Index(i) => i.min(last),
        Until::Time(at_ms) => index_at_time(tree, at_ms)?,
    })
}

/// The state at `until` rebuilt from a live replica's journal `tree` (the
/// console's time travel), refused when more than `max_entries` indexes
/// lie between it and where the replay would start (the nearest
/// checkpoint at or before it, or the start): one request's replay is
/// bounded.
pub(crate) fn rewind_tree(
    tree: &sled::Tree,
    until: Until,
    max_entries: u64,
) -> Result<ReplaySummary, ReplayError> {
    let index = journaled_until(tree, until)?;
    let from = checkpoint_at_or_before(tree, index)?.map_or(0, |(i, _)| i);
    if index - from > max_entries {
        return Err(ReplayError::TooFar {
            from,
            to: index,
            limit: max_entries,
        });
    }
    replay_tree(tree, index, false, None)
}

/// A running replica's history up to an index, as `keel whatif` reads a
/// data directory ([`state_before_journal`], [`for_each_entry`]), but from
/// the replica's own open journal ([`crate::StateMachineStore::history`]).
#[derive(Debug)]
pub struct JournalHistory<'a> {
    tree: &'a sled::Tree,
    /// The state the journal starts from: the empty state, or the
    /// snapshot the replica installed before its first journaled entry.
    pub state_before: ClusterState,
    /// The journal's first index and the last one the history reaches.
    pub first_index: u64,
    pub last_index: u64,
}

impl JournalHistory<'_> {
    /// Calls `each` with every journaled entry of the history, in log
    /// order, without applying them; returns the last index read.
    pub fn for_each(
        &self,
        each: &mut dyn FnMut(u64, &keel_state::LogEntry),
    ) -> Result<u64, ReplayError> {
        crate::journal::for_each_entry(
            self.tree,
            self.first_index,
            self.last_index,
            &mut |index, entry| {
                each(index, &entry);
                Ok::<(), ReplayError>(())
            },
        )
    }
}

/// [`JournalHistory`] of `tree` up to `until`, refused when it would read
/// more than `max_entries` indexes ([`ReplayError::HistoryTooLong`]).
pub(crate) fn history_of_tree(
    tree: &sled::Tree,
    until: Until,
    max_entries: u64,
) -> Result<JournalHistory<'_>, ReplayError> {
    let first = crate::journal::first_index(tree).map_err(|e| ReplayError::Read(e.to_string()))?;
    let last_index = journaled_until(tree, until)?;
    if last_index.saturating_sub(first) >= max_entries {
        return Err(ReplayError::HistoryTooLong {
            first,
            last: last_index,
            limit: max_entries,
        });
    }
    let state_before = if first <= 1 {
        ClusterState::new()
    } else {
        replay_tree(tree, first - 1, false, None)?.state
    };
    Ok(JournalHistory {
        tree,
        state_before,
        first_index: first,
        last_index,
    })
}

/// The last installed checkpoint at or before `until`: its index and bytes.
fn checkpoint_at_or_before(
    tree: &sled::Tree,
    until: u64,
) -> Result<Option<(u64, sled::IVec)>, ReplayError> {
    Ok(tree
        .range(key(PREFIX_CHECKPOINT, 0)..=key(PREFIX_CHECKPOINT, until))
        .next_back()
        .transpose()
        .map_err(|e| ReplayError::Read(e.to_string()))?
        .map(|(k, v)| (index_of(&k).unwrap_or(0), v)))
}

fn replay_tree(
    tree: &sled::Tree,
    until: u64,
    check: bool,
    visit: Option<Visitor<'_>>,
) -> Result<ReplaySummary, ReplayError> {
    // Start from the last installed checkpoint at or before `until`, if any:
    // the journal has a gap before it.
    let checkpoint = checkpoint_at_or_before(tree, until)?;
    let (mut state, started_after) = match checkpoint {
        Some((index, v)) => {
            let state = decode_snapshot(&v)
                .map_err(|message| ReplayError::Checkpoint { index, message })?;
            (state, index)
        }
        None => (ClusterState::new(), 0),
    };
    let start = started_after.saturating_add(u64::from(started_after > 0));
    let applied = apply_journal(tree, &mut state, start, until, check, visit)?;
    let last_index = applied.last_index.unwrap_or(started_after);
    let mut summary = summarise(
        state,
        applied.entries,
        applied.refused,
        started_after,
        last_index,
        0,
    );
    summary.invariant_violation = applied.first_violation;
    Ok(summary)
}

/// The log index `until` names in a state directory's journal (`End`: the
/// last journaled one, or any later one the Raft log holds).
pub(crate) fn index_of_until(state_dir: &Path, until: Until) -> Result<u64, ReplayError> {
    match until {
        Until::End => Ok(u64::MAX),
        Until::Index(i) => Ok(i),
        Until::Time(at_ms) => {
            let db = open_state(state_dir)?;
            let tree = db
                .open_tree("sm")
                .map_err(|e| ReplayError::Read(e.to_string()))?;
            index_at_time(&tree, at_ms)
        }
    }
}

/// The first index the journal holds (0: it holds none). After a replica
/// installed a snapshot, the journal starts past it.
pub(crate) fn journal_start(state_dir: &Path) -> Result<u64, ReplayError> {
    let db = open_state(state_dir)?;
    let tree = db
        .open_tree("sm")
        .map_err(|e| ReplayError::Read(e.to_string()))?;
    crate::journal::first_index(&tree).map_err(|e| ReplayError::Read(e.to_string()))
}

/// Calls `each` with every journaled entry with index in `from..=until`,
/// in log order, without applying them; returns the last index read (0:
/// none).
pub(crate) fn journal_entries<E: From<ReplayError>>(
    state_dir: &Path,
    from: u64,
    until: u64,
    each: &mut dyn FnMut(u64, keel_state::LogEntry) -> Result<(), E>,
) -> Result<u64, E> {
    let db = open_state(state_dir)?;
    let tree = db
        .open_tree("sm")
        .map_err(|e| ReplayError::Read(e.to_string()))?;
    crate::journal::for_each_entry(&tree, from, until, each)
}

fn open_state(state_dir: &Path) -> Result<sled::Db, ReplayError> {
    crate::state_machine::open_sled(state_dir).map_err(|e| ReplayError::Open {
        path: state_dir.display().to_string(),
        message: e.to_string(),
    })
}

/// The state a data directory's journal starts from: the empty state, or
/// the snapshot a replica installed before its first journaled entry
/// (the history before it is not in the directory).
pub fn state_before_journal(dir: &crate::DataDir) -> Result<ClusterState, ReplayError> {
    let state_dir = dir.state_dir();
    let start = journal_start(&state_dir)?;
    if start <= 1 {
        return Ok(ClusterState::new());
    }
    Ok(replay_until(&state_dir, Until::Index(start - 1))?.state)
}

/// Calls `each` with every entry of data directory `dir` after index
/// `after` and up to `until`, in log order, without applying them: the
/// journal's, then the committed entries the Raft log holds past it (a
/// replica killed before its journal caught up). Returns the last index
/// read (0: none).
pub fn for_each_entry(
    dir: &crate::DataDir,
    after: u64,
    until: Until,
    each: &mut dyn FnMut(u64, &keel_state::LogEntry),
) -> Result<u64, ReplayError> {
    let state_dir = dir.state_dir();
    let until_index = index_of_until(&state_dir, until)?;
    let journaled = journal_entries(&state_dir, after + 1, until_index, &mut |index, entry| {
        each(index, &entry);
        Ok::<(), ReplayError>(())
    })?;
    let mut last = journaled;
    log_tail(dir, journaled.max(after), until, &mut |index, _, e| {
        each(index, e);
        last = index;
    })?;
    Ok(last)
}

/// Calls `each` with the committed entries of `dir`'s Raft log after
/// index `after`, up to `until` (an index, or the last entry stamped at
/// or before a time), in log order, with their index and term: what a
/// replica killed before its journal caught up holds past the journal.
/// Nothing without a log.
fn log_tail(
    dir: &crate::DataDir,
    after: u64,
    until: Until,
    each: &mut dyn FnMut(u64, u64, &keel_state::LogEntry),
) -> Result<(), ReplayError> {
    let log_dir = dir.raft_log_dir();
    match open_log(&log_dir)? {
        Some(log) => committed_tail(&log, &log_dir, after, until, each),
        None => Ok(()),
    }
}

/// The Raft log at `log_dir`, when there is one.
pub(crate) fn open_log(log_dir: &std::path::Path) -> Result<Option<crate::LogStore>, ReplayError> {
    if !log_dir.exists() {
        return Ok(None);
    }
    crate::LogStore::open(log_dir)
        .map(Some)
        .map_err(|e| ReplayError::Log {
            path: log_dir.display().to_string(),
            message: e.to_string(),
        })
}

/// [`log_tail`] of a log already open (`log_dir`: where it is, for
/// errors).
pub(crate) fn committed_tail(
    log: &crate::LogStore,
    log_dir: &std::path::Path,
    after: u64,
    until: Until,
    each: &mut dyn FnMut(u64, u64, &keel_state::LogEntry),
) -> Result<(), ReplayError> {
    let log_error = |message: String| ReplayError::Log {
        path: log_dir.display().to_string(),
        message,
    };
    let (until_index, until_ms) = match until {
        Until::End => (u64::MAX, u64::MAX),
        Until::Index(i) => (i, u64::MAX),
        Until::Time(t) => (u64::MAX, t),
    };
    let end = log
        .committed_index()
        .unwrap_or(0)
        .min(until_index)
        .saturating_add(1);
    let start = after.saturating_add(1);
    if start >= end {
        return Ok(());
    }
    for entry in log
        .entries(start, end)
        .map_err(|e| log_error(e.to_string()))?
    {
        if let openraft::EntryPayload::Normal(proposal) = &entry.payload {
            for e in &proposal.entries {
                if e.at_ms > until_ms {
                    return Ok(());
                }
                each(entry.log_id.index, entry.log_id.leader_id.term, e);
            }
        }
    }
    Ok(())
}
