//! The Raft log and vote in a write-ahead log that really reaches the disk.
//!
//! Backed by `raft-log` (chunked WAL, CRC-checked records). Its flush worker
//! calls `fdatasync` and serves every flush request queued while a sync was
//! running with the next single sync. openraft is told an append is flushed
//! only from that worker's callback, after the sync. (openraft 0.9 issues one
//! append at a time, so group commit happens above it: see the control
//! plane's proposer.)
//!
//! Encoding of a WAL record's payload: one tag byte, then
//! - `0` blank;
//! - `1` a normal entry, as a protobuf `keel.entry.v1.Proposal` (which
//!   carries its own format versions);
//! - `3` a membership change, as a protobuf `keel.replication.v1.Membership`;
//! - `2` a membership change as JSON (openraft's serde form): written by
//!   the releases before tag 3, still read.
//!
//! A tag this build does not know is refused with an error naming it.

use std::fmt::Debug;
use std::io;
use std::ops::{Bound, RangeBounds};
use std::path::Path;
use std::sync::mpsc::{sync_channel, SyncSender};
use std::sync::{Arc, Mutex, MutexGuard};

use crate::latency::Latency;

use keel_proto::replication as pb;
use keel_state::codec::{decode_proposal, proposal_bytes};
use openraft::storage::{LogFlushed, LogState, RaftLogStorage};
use openraft::{
    CommittedLeaderId, EntryPayload, ErrorSubject, ErrorVerb, OptionalSend, RaftLogReader, Vote,
};
use prost::Message;
use raft_log::api::raft_log_writer::RaftLogWriter;
use raft_log::RaftLog;

use crate::raft_wire::{membership_from_proto, membership_to_proto};
use crate::{Entry, LogId, StorageError, StoreError, TypeConfig};

/// raft-log's view of a log id: ((term, leader node id), index).
type WalLogId = ((u64, u64), u64);
/// raft-log's view of a vote: ((term, node id), committed).
type WalVote = ((u64, u64), bool);

/// What the WAL's flush worker calls back when a sync is done.
pub(crate) enum WalCallback {
    /// An append openraft waits on, when its sync was asked for, and
    /// where the time to its end is counted; the spans of the traced
    /// writes it carries end with it ([`crate::trace_context`]).
    Appended(
        LogFlushed<TypeConfig>,
        std::time::Instant,
        Arc<Latency>,
        Vec<tracing::Span>,
    ),
    /// A caller blocked until the sync is done.
    Blocking(SyncSender<io::Result<()>>),
}

impl Debug for WalCallback {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            WalCallback::Appended(..) => f.write_str("WalCallback::Appended"),
            WalCallback::Blocking(_) => f.write_str("WalCallback::Blocking"),
        }
    }
}

impl raft_log::Callback for WalCallback {
    fn send(self, res: Result<(), io::Error>) {
        match self {
            WalCallback::Appended(flushed, asked, latency, spans) => {
                latency.observe(asked.elapsed());
                flushed.log_io_completed(res);
                drop(spans);
            }
            WalCallback::Blocking(tx) => {
                // raft-log's own callback for a channel: a receiver that
                // gave up is not an error.
                raft_log::Callback::send(tx, res);
            }
        }
    }
}

#[derive(Debug, Default, Clone, PartialEq, Eq)]
pub(crate) struct WalTypes;

impl raft_log::Types for WalTypes {
    type LogId = WalLogId;
    type LogPayload = Vec<u8>;
    type Vote = WalVote;
    type Callback = WalCallback;
    type UserData = ();

    fn log_index(log_id: &Self::LogId) -> u64 {
        log_id.1
    }

    fn payload_size(payload: &Self::LogPayload) -> u64 {
        payload.len() as u64
    }
}

fn to_wal_id(id: &LogId) -> WalLogId {
    ((id.leader_id.term, id.leader_id.node_id), id.index)
}

fn from_wal_id(id: &WalLogId) -> LogId {
    LogId::new(CommittedLeaderId::new(id.0 .0, id.0 .1), id.1)
}

const TAG_BLANK: u8 = 0;
const TAG_NORMAL: u8 = 1;
const TAG_MEMBERSHIP_JSON: u8 = 2;
const TAG_MEMBERSHIP: u8 = 3;

/// Encodes a WAL record's payload (see the module's documentation).
pub fn encode_payload(payload: &EntryPayload<TypeConfig>) -> Vec<u8> {
    match payload {
        EntryPayload::Blank => vec![TAG_BLANK],
        EntryPayload::Normal(proposal) => {
            let mut v = vec![TAG_NORMAL];
            v.extend_from_slice(proposal_bytes(proposal));
            v
        }
        EntryPayload::Membership(m) => {
            let mut v = vec![TAG_MEMBERSHIP];
            v.extend_from_slice(&membership_to_proto(m).encode_to_vec());
            v
        }
    }
}

/// Decodes a WAL record's payload, of entry `index` (named in errors).
pub fn decode_payload(index: u64, bytes: &[u8]) -> Result<EntryPayload<TypeConfig>, StoreError> {
    let what = || format!("Raft log entry {index}");
    match bytes.split_first() {
        Some((&TAG_BLANK, _)) => Ok(EntryPayload::Blank),
        Some((&TAG_NORMAL, rest)) => Ok(EntryPayload::Normal(
            decode_proposal(rest).map_err(|e| StoreError::corrupt(what(), e))?,
        )),
        Some((&TAG_MEMBERSHIP, rest)) => {
            let m = pb::Membership::decode(rest).map_err(|e| StoreError::corrupt(what(), e))?;
            Ok(EntryPayload::Membership(
                membership_from_proto(m).map_err(|e| StoreError::corrupt(what(), e))?,
            ))
        }
        Some((&TAG_MEMBERSHIP_JSON, rest)) => Ok(EntryPayload::Membership(
            serde_json::from_slice(rest).map_err(|e| StoreError::corrupt(what(), e))?,
        )),
        other => Err(StoreError::corrupt(
            what(),
            format!("unknown payload tag {:?}", other.map(|(t, _)| *t)),
        )),
    }
}

fn io_err(subject: ErrorSubject<u64>, verb: ErrorVerb, e: io::Error) -> StorageError {
    StorageError::from_io_error(subject, verb, e)
}

/// The Raft log store. Cheap to clone: clones share one WAL.
#[derive(Clone)]
pub struct LogStore {
    wal: Arc<Mutex<RaftLog<WalTypes>>>,
    /// How long appends waited for their `fdatasync` (`/metrics`).
    sync_latency: Arc<Latency>,
}

impl Debug for LogStore {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("LogStore").finish_non_exhaustive()
    }
}

impl LogStore {
    /// Opens (or creates) the WAL in `dir`, truncating a torn final record.
    pub fn open(dir: &Path) -> io::Result<LogStore> {
        std::fs::create_dir_all(dir)?;
        let mut config = raft_log::Config::new(dir.to_string_lossy());
        config.wal.truncate_incomplete_record = Some(true);
        // Do not hold a sync back waiting for company (raft-log waits 1 ms by
        // default). openraft appends one entry at a time and waits for its
        // flush, so there is no company to wait for: commands are grouped
        // above Raft, by the proposer (BENCHMARKS.md, "Durable
        // submissions through one replica", has what the wait cost a lone
        // writer).
        config.wal.flush_batch_wait = Some(std::time::Duration::ZERO);
        let wal = RaftLog::<WalTypes>::open(Arc::new(config))?;
        Ok(LogStore {
            wal: Arc::new(Mutex::new(wal)),
            sync_latency: Arc::default(),
        })
    }

    /// How long appends waited from asking for their sync to its end
    /// (queueing behind a sync under way included): etcd's
    /// `wal_fsync_duration` for this log.
    pub fn sync_latency(&self) -> &Latency {
        &self.sync_latency
    }

    fn lock(&self) -> MutexGuard<'_, RaftLog<WalTypes>> {
        // A poisoned lock means a panic mid-write; the WAL itself is still
        // consistent (records are checksummed), so go on with it.
        self.wal.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Queues a sync and waits for it.
    fn sync_and_wait(&self) -> io::Result<()> {
        let (tx, rx) = sync_channel(1);
        self.lock().flush(true, Some(WalCallback::Blocking(tx)))?;
        rx.recv()
            .map_err(|_| io::Error::other("the WAL flush worker stopped"))?
    }

    /// Appends entries and returns once they are on disk (`fdatasync`ed).
    /// openraft's `append` takes the same path with a callback instead of a
    /// wait; tools, tests and benchmarks use this one.
    pub fn append_durable(&self, entries: &[Entry]) -> Result<(), StoreError> {
        let mut records = Vec::with_capacity(entries.len());
        for e in entries {
            records.push((to_wal_id(&e.log_id), encode_payload(&e.payload)));
        }
        self.lock().append(records)?;
        Ok(self.sync_and_wait()?)
    }

    /// The last log id, or the last purged one when the log holds none.
    pub fn last_log_id(&self) -> Option<LogId> {
        let wal = self.lock();
        let state = wal.log_state();
        state.last().or(state.purged()).map(from_wal_id)
    }

    /// The vote on disk.
    pub fn vote(&self) -> Option<Vote<u64>> {
        let wal = self.lock();
        wal.log_state().vote().map(|((term, node_id), committed)| {
            let mut v = Vote::new(*term, *node_id);
            v.committed = *committed;
            v
        })
    }

    /// Saves a vote and returns once it is on disk.
    pub fn save_vote_durable(&self, vote: &Vote<u64>) -> Result<(), StoreError> {
        self.lock().save_vote((
            (vote.leader_id.term, vote.leader_id.node_id),
            vote.committed,
        ))?;
        Ok(self.sync_and_wait()?)
    }

    /// The last index this log knows to be committed (as far as it reached
    /// the disk: openraft saves it with the next synced append).
    /// The first index the WAL still holds (`None`: it holds none).
    pub fn first_index(&self) -> Option<u64> {
        let wal = self.lock();
        let state = wal.log_state();
        let last = state.last().map(|id| from_wal_id(id).index)?;
        let first = state.purged().map_or(0, |id| from_wal_id(id).index + 1);
        (first <= last).then_some(first)
    }

    pub fn committed_index(&self) -> Option<u64> {
        self.lock()
            .log_state()
            .committed()
            .map(|c| from_wal_id(c).index)
    }

    /// Every entry in `[start, end)` that the log holds.
    pub fn entries(&self, start: u64, end: u64) -> Result<Vec<Entry>, StoreError> {
        self.read_range(start, end)
    }

    fn read_range(&self, start: u64, end: u64) -> Result<Vec<Entry>, StoreError> {
        let wal = self.lock();
        let mut out = Vec::with_capacity(end.saturating_sub(start).min(4096) as usize);
        for item in wal.read(start, end) {
            let (id, payload) = item?;
            out.push(Entry {
                log_id: from_wal_id(&id),
                payload: decode_payload(id.1, &payload)?,
            });
        }
        Ok(out)
    }
}

fn range_to_bounds<RB: RangeBounds<u64>>(range: &RB) -> (u64, u64) {
    let start = match range.start_bound() {
        Bound::Included(&s) => s,
        Bound::Excluded(&s) => s.saturating_add(1),
        Bound::Unbounded => 0,
    };
    let end = match range.end_bound() {
        Bound::Included(&e) => e.saturating_add(1),
        Bound::Excluded(&e) => e,
        Bound::Unbounded => u64::MAX,
    };
    (start, end)
}

impl RaftLogReader<TypeConfig> for LogStore {
    async fn try_get_log_entries<RB: RangeBounds<u64> + Clone + Debug + OptionalSend>(
        &mut self,
        range: RB,
    ) -> Result<Vec<Entry>, StorageError> {
        let (start, end) = range_to_bounds(&range);
        self.read_range(start, end)
            .map_err(|e| e.into_raft(ErrorSubject::Logs, ErrorVerb::Read))
    }
}

impl RaftLogStorage<TypeConfig> for LogStore {
    type LogReader = LogStore;

    async fn get_log_state(&mut self) -> Result<LogState<TypeConfig>, StorageError> {
        let wal = self.lock();
        let state = wal.log_state();
        let last_purged_log_id = state.purged().map(from_wal_id);
        let last_log_id = state.last().map(from_wal_id).or(last_purged_log_id);
        Ok(LogState {
            last_purged_log_id,
            last_log_id,
        })
    }

    async fn get_log_reader(&mut self) -> Self::LogReader {
        self.clone()
    }

    async fn save_vote(&mut self, vote: &Vote<u64>) -> Result<(), StorageError> {
        // A vote must be on disk before it is acted on.
        self.save_vote_durable(vote)
            .map_err(|e| e.into_raft(ErrorSubject::Vote, ErrorVerb::Write))
    }

    async fn read_vote(&mut self) -> Result<Option<Vote<u64>>, StorageError> {
        Ok(self.vote())
    }

    async fn save_committed(&mut self, committed: Option<LogId>) -> Result<(), StorageError> {
        if let Some(c) = committed {
            let mut wal = self.lock();
            wal.commit(to_wal_id(&c))
                .map_err(|e| io_err(ErrorSubject::Store, ErrorVerb::Write, e))?;
            // Best effort: the next synced append carries it to disk.
            wal.flush(false, None)
                .map_err(|e| io_err(ErrorSubject::Store, ErrorVerb::Write, e))?;
        }
        Ok(())
    }

    async fn read_committed(&mut self) -> Result<Option<LogId>, StorageError> {
        Ok(self.lock().log_state().committed().map(from_wal_id))
    }

    // The failpoint's closure returns openraft's StorageError, as every
    // method here does.
    #[cfg_attr(feature = "failpoints", allow(clippy::result_large_err))]
    async fn append<I>(
        &mut self,
        entries: I,
        callback: LogFlushed<TypeConfig>,
    ) -> Result<(), StorageError>
    where
        I: IntoIterator<Item = Entry> + OptionalSend,
        I::IntoIter: OptionalSend,
    {
        let mut wal = self.lock();
        // Entries at or below the purge point are already covered by the
        // state machine; the WAL refuses to go back past it, and nothing
        // reads them again, so they are dropped.
        let purged = wal.log_state().purged().map(|p| p.1);
        let mut records = Vec::new();
        let mut traced = Vec::new();
        for e in entries {
            if purged.is_some_and(|p| e.log_id.index <= p) {
                tracing::debug!(log_id = %e.log_id, "append below the purge point dropped");
                continue;
            }
            if let openraft::EntryPayload::Normal(proposal) = &e.payload {
                for parent in proposal
                    .entries
                    .iter()
                    .filter_map(|l| l.trace_parent.as_deref())
                {
                    let span = tracing::trace_span!(
                        target: crate::trace_context::TARGET,
                        "keel.wal_append",
                        raft.index = e.log_id.index,
                    );
                    crate::trace_context::join(&span, parent);
                    traced.push(span);
                }
            }
            records.push((to_wal_id(&e.log_id), encode_payload(&e.payload)));
        }
        // Chaos builds: a slow disk (`sleep(ms)`) or a full one (`return`).
        #[cfg(feature = "failpoints")]
        fail::fail_point!("wal-append", |_| {
            Err(io_err(
                ErrorSubject::Logs,
                ErrorVerb::Write,
                io::Error::new(
                    io::ErrorKind::StorageFull,
                    "no space left on device (failpoint)",
                ),
            ))
        });
        wal.append(records)
            .map_err(|e| io_err(ErrorSubject::Logs, ErrorVerb::Write, e))?;
        // openraft learns the entries are durable only once fdatasync returned.
        let asked = std::time::Instant::now();
        wal.flush(
            true,
            Some(WalCallback::Appended(
                callback,
                asked,
                self.sync_latency.clone(),
                traced,
            )),
        )
        .map_err(|e| io_err(ErrorSubject::Logs, ErrorVerb::Write, e))
    }

    async fn truncate(&mut self, log_id: LogId) -> Result<(), StorageError> {
        self.lock()
            .truncate(log_id.index)
            .map_err(|e| io_err(ErrorSubject::Logs, ErrorVerb::Delete, e))?;
        self.sync_and_wait()
            .map_err(|e| io_err(ErrorSubject::Logs, ErrorVerb::Delete, e))
    }

    async fn purge(&mut self, log_id: LogId) -> Result<(), StorageError> {
        let mut wal = self.lock();
        wal.purge(to_wal_id(&log_id))
            .map_err(|e| io_err(ErrorSubject::Logs, ErrorVerb::Delete, e))?;
        wal.flush(true, None)
            .map_err(|e| io_err(ErrorSubject::Logs, ErrorVerb::Delete, e))
    }
}
