//! The Raft state machine: `ClusterState` in memory, its history on sled.
//!
//! Keys of the `sm` tree (indexes big-endian, so keys sort by index):
//!
//! | key | value |
//! |---|---|
//! | `e` + first index | a journal page: applied entries (protobuf `JournalPage`), see [`crate::journal`] |
//! | `v` + index + position | what one command did (protobuf `AppliedEntry`) |
//! | `c` + index | a state installed from a leader's snapshot at index (replay starts there) |
//! | `m/applied`, `m/membership` | last applied log id and membership (`meta_codec`) |
//! | `m/removed` | the Raft ids memberships have removed ([`RemovedMembers`]; format byte 1, then postcard) |
//! | `m/snapshot-meta`, `m/snapshot-data` | the current snapshot |
//!
//! Each `apply` call writes one atomic sled batch. On open, the state is the
//! current snapshot plus the journal entries after it, so a crash that loses
//! sled's unflushed tail costs only re-applying those entries from the Raft
//! log. The journal is never purged.

use std::io::Cursor;
use std::path::Path;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, RwLock, RwLockReadGuard, RwLockWriteGuard};

use keel_proto::entry as pb;
use keel_state::codec::applied_entry_to_proto;
use keel_state::command::{Command, LogEntry};
use keel_state::ClusterState;
use openraft::storage::{RaftStateMachine, Snapshot};
use openraft::{
    AnyError, BasicNode, EntryPayload, ErrorSubject, ErrorVerb, OptionalSend, RaftSnapshotBuilder,
    SnapshotMeta, StorageIOError, StoredMembership,
};
use prost::Message;
use serde::{Deserialize, Serialize};
use tokio::sync::watch;

use crate::journal_writer::{JournalWriter, Writes};
use crate::{ApplyResponse, Entry, LogId, StorageError, StoreError, TypeConfig};

pub(crate) const PREFIX_APPLIED: u8 = b'v';
pub(crate) const PREFIX_CHECKPOINT: u8 = b'c';
/// Per-job history index: prefix, job id, Raft index, position → nothing.
pub(crate) const PREFIX_JOB_HISTORY: u8 = b'h';
const KEY_APPLIED: &[u8] = b"m/applied";
const KEY_MEMBERSHIP: &[u8] = b"m/membership";
const KEY_REMOVED: &[u8] = b"m/removed";

/// The Raft ids that applied memberships named and a later one did not
/// (issue 34): each with its last address and the log index of the
/// membership that dropped it; at most [`RemovedMembers::MAX`], the oldest
/// dropped first. A snapshot does not carry them: a replica that installed
/// one knows the removals it applied itself.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct RemovedMembers(pub std::collections::BTreeMap<u64, (String, u64)>);

impl RemovedMembers {
    pub const MAX: usize = 64;
    const FORMAT: u8 = 1;

    /// Records what a membership applied at `index` changed from `before`.
    fn apply(
        &mut self,
        before: &openraft::Membership<u64, BasicNode>,
        after: &openraft::Membership<u64, BasicNode>,
        index: u64,
    ) {
        let named: std::collections::BTreeSet<u64> = after.nodes().map(|(id, _)| *id).collect();
        for (id, node) in before.nodes() {
            if !named.contains(id) {
                self.0.insert(*id, (node.addr.clone(), index));
            }
        }
        self.0.retain(|id, _| !named.contains(id));
        while self.0.len() > Self::MAX {
            let oldest = self
                .0
                .iter()
                .min_by_key(|(id, (_, i))| (*i, **id))
                .map(|(id, _)| *id);
            match oldest {
                Some(id) => self.0.remove(&id),
                None => break,
            };
        }
    }

    fn encode(&self) -> Vec<u8> {
        let list: Vec<(u64, &str, u64)> = self
            .0
            .iter()
            .map(|(id, (addr, index))| (*id, addr.as_str(), *index))
            .collect();
        let mut bytes = vec![Self::FORMAT];
        bytes.extend(postcard::to_stdvec(&list).unwrap_or_default());
        bytes
    }

    fn decode(bytes: &[u8]) -> Result<RemovedMembers, String> {
        match bytes.split_first() {
            Some((&Self::FORMAT, rest)) => {
                let list: Vec<(u64, String, u64)> =
                    postcard::from_bytes(rest).map_err(|e| e.to_string())?;
                Ok(RemovedMembers(
                    list.into_iter()
                        .map(|(id, addr, index)| (id, (addr, index)))
                        .collect(),
                ))
            }
            Some((format, _)) => Err(format!(
                "removed members in format {format}, not one this build reads (1)"
            )),
            None => Err("empty".into()),
        }
    }
}
const KEY_SNAPSHOT_META: &[u8] = b"m/snapshot-meta";
const KEY_SNAPSHOT_DATA: &[u8] = b"m/snapshot-data";
/// The sled tree the snapshot and its meta live in (under the keys above).
/// In the state tree they shared a leaf node with the keys every apply
/// batch rewrites (`m/applied`, ...), and sled, rewriting that node whole,
/// wrote the snapshot (megabytes) again each time: some 23 KB per client
/// write at 5,000 writes/s (BENCHMARKS, "One replica beside a one-member
/// etcd"). A data directory written before keeps its snapshot in the
/// state tree until the next one is saved ([`snapshot_pair`]).
const SNAPSHOT_TREE: &str = "snapshot";
/// What the state tree holds at the snapshot's keys once the snapshot has
/// moved to [`SNAPSHOT_TREE`]: a meta in a format no release reads (254),
/// so a release before this one refuses the data directory ("format 254
/// is not one this build reads; upgrade keel") instead of starting from
/// an empty state.
const SNAPSHOT_MOVED: &[u8] = b"\xfethe snapshot is in the sled tree `snapshot` (a newer keel)";
/// Where the next journal compaction starts (8 bytes, big-endian): a hint
/// (`journal::Compacted::settled_below`), so that a compaction after a
/// restart does not read the whole journal again. Lost or behind, it costs
/// time only.
const KEY_JOURNAL_SETTLED: &[u8] = b"m/journal-settled";
/// 2: `ClusterState` gained the supply/demand version, the last round and
/// per-job retries. 3: jobs gained their attained service and queueing
/// time. 4: jobs gained their performance history (loss points, speeds).
/// 5: allocations name a sharing partner; the GPU-holder index holds pairs.
/// 6: the client requests remembered for exactly-once writes.
/// 7: the running policy's memory, after the state.
/// 8: protobuf (`keel.entry.v1.StateSnapshot`) instead of postcard.
/// Versions 7 and 6 are still read (6 as a state without policy memory).
const SNAPSHOT_FORMAT_VERSION: u32 = 8;
/// The postcard versions this build still reads: the one before, and the
/// one the data directories of the releases before it hold.
const SNAPSHOT_FORMAT_VERSION_POSTCARD: u32 = 7;
const SNAPSHOT_FORMAT_VERSION_PREVIOUS: u32 = 6;
/// A protobuf snapshot's first byte: field 1 (`format_version`), varint.
/// A postcard snapshot starts with its version (6 or 7) instead.
const PROTOBUF_FIRST_BYTE: u8 = 0x08;

/// The trace of the job whose first progress sample `entry` reports, if
/// the job has one and spans are exported.
fn first_progress_trace(state: &ClusterState, entry: &LogEntry) -> Option<String> {
    match &entry.command {
        Command::ReportProgress { job_id, .. } if tracing::enabled!(target: crate::trace_context::TARGET, tracing::Level::TRACE) =>
        {
            let job = state.jobs().get(job_id)?;
            (job.progress_samples == 0)
                .then(|| job.trace_parent.clone())
                .flatten()
        }
        _ => None,
    }
}

/// The snapshot's meta and bytes: from [`SNAPSHOT_TREE`], or in a data
/// directory written before it, from the state tree (whose copy a saved
/// snapshot replaces with [`SNAPSHOT_MOVED`]).
fn snapshot_pair(
    snapshots: &sled::Tree,
    sm: &sled::Tree,
) -> Result<(Option<sled::IVec>, Option<sled::IVec>), StoreError> {
    let meta = snapshots.get(KEY_SNAPSHOT_META)?;
    if meta.is_some() {
        return Ok((meta, snapshots.get(KEY_SNAPSHOT_DATA)?));
    }
    match sm.get(KEY_SNAPSHOT_META)? {
        Some(m) if m.as_ref() == SNAPSHOT_MOVED => Err(StoreError::corrupt(
            "the state directory",
            "its snapshot moved to the `snapshot` tree, which is empty",
        )),
        meta => Ok((meta, sm.get(KEY_SNAPSHOT_DATA)?)),
    }
}

pub(crate) fn key(prefix: u8, index: u64) -> [u8; 9] {
    let mut k = [0u8; 9];
    k[0] = prefix;
    k[1..].copy_from_slice(&index.to_be_bytes());
    k
}

/// Key of an applied record: prefix, Raft index, position in the proposal.
/// Where a reader of the journal stands: the next record it wants is the
/// first at or after (`index`, `position`).
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord)]
pub struct JournalCursor {
    pub index: u64,
    pub position: u32,
}

impl JournalCursor {
    /// The first record of entry `index` (or of the first entry after it).
    pub fn at_index(index: u64) -> Self {
        Self { index, position: 0 }
    }

    /// The record right after `record`: the next of its entry, or the first
    /// of the next entry.
    pub fn after(record: &pb::AppliedEntry) -> Self {
        match record.position.checked_add(1) {
            Some(position) => Self {
                index: record.index,
                position,
            },
            None => Self::at_index(record.index.saturating_add(1)),
        }
    }
}

pub(crate) fn applied_key(index: u64, position: u32) -> [u8; 13] {
    let mut k = [0u8; 13];
    k[0] = PREFIX_APPLIED;
    k[1..9].copy_from_slice(&index.to_be_bytes());
    k[9..].copy_from_slice(&position.to_be_bytes());
    k
}

fn job_history_key(job_id: u64, index: u64, position: u32) -> [u8; 21] {
    let mut k = [0u8; 21];
    k[0] = PREFIX_JOB_HISTORY;
    k[1..9].copy_from_slice(&job_id.to_be_bytes());
    k[9..17].copy_from_slice(&index.to_be_bytes());
    k[17..].copy_from_slice(&position.to_be_bytes());
    k
}

pub(crate) fn index_of(key: &[u8]) -> Option<u64> {
    let bytes: [u8; 8] = key.get(1..9)?.try_into().ok()?;
    Some(u64::from_be_bytes(bytes))
}

/// The most sled keeps of its pages in memory. sled's default is 1 GiB,
/// which a replica reached after 100,000 jobs (its RSS 943 MiB against
/// 439 MiB for the same state fresh from a snapshot; BENCHMARKS, "Scale"):
/// the state is in memory anyway, and the journal is written once and
/// read for `keel events`, `why` and replays, which read it in order.
const SLED_CACHE_BYTES: u64 = 64 * 1024 * 1024;

/// Opens a sled database. The data directory's lock already keeps other
/// processes out; sled's own file lock can still be held for a moment by the
/// background threads of a handle this process just dropped, so a lock
/// conflict is retried for up to two seconds.
pub(crate) fn open_sled(dir: &Path) -> Result<sled::Db, sled::Error> {
    let mut attempts = 0;
    loop {
        match sled::Config::new()
            .path(dir)
            .cache_capacity(SLED_CACHE_BYTES)
            .open()
        {
            Err(sled::Error::Io(e))
                if attempts < 100 && e.to_string().contains("could not acquire lock") =>
            {
                attempts += 1;
                std::thread::sleep(std::time::Duration::from_millis(20));
            }
            other => return other,
        }
    }
}

/// What the state machine holds in memory.
#[derive(Debug, Default)]
pub struct Applied {
    pub state: ClusterState,
    pub last_applied: Option<LogId>,
    pub membership: StoredMembership<u64, BasicNode>,
    /// Who the memberships applied here removed ([`RemovedMembers`]).
    pub removed_members: RemovedMembers,
}

/// The applied state, shared with readers (the API, the leader's loops).
#[derive(Debug)]
pub struct SharedState {
    applied: RwLock<Applied>,
    /// The index the journal's records are in sled up to (the journal
    /// writer's, which merges batches and may linger).
    journaled_index: watch::Sender<u64>,
    /// The index the state in memory is applied up to.
    state_index: watch::Sender<u64>,
}

impl SharedState {
    pub fn read(&self) -> RwLockReadGuard<'_, Applied> {
        self.applied.read().unwrap_or_else(|p| p.into_inner())
    }

    fn write(&self) -> RwLockWriteGuard<'_, Applied> {
        self.applied.write().unwrap_or_else(|p| p.into_inner())
    }

    /// Watch the journal's index move: every entry up to it has its
    /// records in sled ([`StateMachineStore::applied_entries`]).
    pub fn subscribe_journal(&self) -> watch::Receiver<u64> {
        self.journaled_index.subscribe()
    }

    /// Watch the state in memory move: every entry up to it is applied in
    /// [`SharedState::read`]'s state; its journal records may still be
    /// queued for sled. For loops that read the state, not the journal
    /// (the leader's scheduling and reconciling).
    pub fn subscribe_state(&self) -> watch::Receiver<u64> {
        self.state_index.subscribe()
    }

    pub(crate) fn journaled(&self, index: u64) {
        self.journaled_index.send_replace(index);
    }
}

/// A postcard snapshot's data (formats 6 and 7): the format version and
/// the whole `ClusterState`; in version 7 the state's policy memory follows
/// ([`keel_state::policy_memory::PolicyMemorySlot`]).
#[derive(Serialize, Deserialize)]
pub(crate) struct SnapshotFile {
    pub(crate) format_version: u32,
    pub(crate) state: ClusterState,
}

/// [`SnapshotFile`] borrowed, to encode format 7 without copying the
/// state.
#[derive(Serialize)]
struct SnapshotFileRef<'a> {
    format_version: u32,
    state: &'a ClusterState,
}

/// Encodes `state` as a snapshot in the current format (8, protobuf).
pub fn encode_snapshot(state: &ClusterState) -> Vec<u8> {
    let mut snapshot = state.to_snapshot_proto();
    snapshot.format_version = SNAPSHOT_FORMAT_VERSION;
    snapshot.encode_to_vec()
}

/// Encodes `state` as a snapshot in `format`: the current one (8), or 7,
/// the format the release before reads (postcard; for a peer of that
/// release during a rolling upgrade).
pub fn encode_snapshot_as(state: &ClusterState, format: u32) -> Result<Vec<u8>, String> {
    match format {
        SNAPSHOT_FORMAT_VERSION => Ok(encode_snapshot(state)),
        SNAPSHOT_FORMAT_VERSION_POSTCARD if !state.postcard_carries_whole() => Err(format!(
            "the state holds what snapshot format {format} cannot carry (tokens, submitters, \
             resource limits, log rotation or gone GPUs): a replica of the release before \
             cannot hold it; upgrade it"
        )),
        SNAPSHOT_FORMAT_VERSION_POSTCARD => {
            let mut bytes = postcard::to_stdvec(&SnapshotFileRef {
                format_version: format,
                state,
            })
            .map_err(|e| e.to_string())?;
            bytes.extend(
                postcard::to_stdvec(state.policy_memory_slot()).map_err(|e| e.to_string())?,
            );
            Ok(bytes)
        }
        other => Err(format!(
            "snapshot format {other} is not one this build writes \
             ({SNAPSHOT_FORMAT_VERSION_POSTCARD} or {SNAPSHOT_FORMAT_VERSION})"
        )),
    }
}

/// The snapshot format a replica writes and reads at most, given the
/// newest Raft wire format it speaks: 8 with wire format 2, 7 (what the
/// release before wrote and read) with wire format 1.
pub fn snapshot_format_for_wire(wire_format: u32) -> u32 {
    if wire_format >= crate::raft_wire::RAFT_WIRE_FORMAT {
        SNAPSHOT_FORMAT_VERSION
    } else {
        SNAPSHOT_FORMAT_VERSION_POSTCARD
    }
}

/// Decodes a snapshot of format 8 (protobuf), 7 or 6 (postcard); a newer
/// format is refused naming the ones this build reads.
pub fn decode_snapshot(bytes: &[u8]) -> Result<ClusterState, String> {
    decode_snapshot_up_to(bytes, SNAPSHOT_FORMAT_VERSION)
}

/// [`decode_snapshot`], refusing formats newer than `newest` too.
pub fn decode_snapshot_up_to(bytes: &[u8], newest: u32) -> Result<ClusterState, String> {
    let newest = newest.min(SNAPSHOT_FORMAT_VERSION);
    let refused = |found: u32| {
        format!(
            "snapshot format version {found} is not one this build reads \
             ({SNAPSHOT_FORMAT_VERSION_PREVIOUS} to {newest}){}",
            if found > newest { "; upgrade keel" } else { "" }
        )
    };
    if bytes.first() == Some(&PROTOBUF_FIRST_BYTE) {
        let snapshot = keel_proto::entry::StateSnapshot::decode(bytes)
            .map_err(|e| format!("the snapshot is not valid protobuf: {e}"))?;
        if snapshot.format_version != SNAPSHOT_FORMAT_VERSION || newest < SNAPSHOT_FORMAT_VERSION {
            return Err(refused(snapshot.format_version));
        }
        return ClusterState::from_snapshot_proto(snapshot).map_err(|e| e.to_string());
    }
    let (file, rest): (SnapshotFile, &[u8]) =
        postcard::take_from_bytes(bytes).map_err(|e| e.to_string())?;
    match file.format_version {
        SNAPSHOT_FORMAT_VERSION_POSTCARD => {
            let mut state = file.state;
            let slot = postcard::from_bytes(rest)
                .map_err(|e| format!("the snapshot's policy memory: {e}"))?;
            state.restore_policy_memory(slot);
            Ok(state)
        }
        SNAPSHOT_FORMAT_VERSION_PREVIOUS if rest.is_empty() => Ok(file.state),
        found => Err(refused(found)),
    }
}

/// A snapshot taken under the state's lock, to encode after it.
enum PendingSnapshot {
    Message(Box<keel_proto::entry::StateSnapshot>),
    Encoded(Vec<u8>),
}

fn sm_err(e: impl Into<StoreError>) -> StorageError {
    e.into()
        .into_raft(ErrorSubject::StateMachine, ErrorVerb::Write)
}

fn read_err(e: impl Into<StoreError>) -> StorageError {
    e.into()
        .into_raft(ErrorSubject::StateMachine, ErrorVerb::Read)
}

/// The state machine store. Cheap to clone: clones share everything.
#[derive(Debug, Clone)]
pub struct StateMachineStore {
    shared: Arc<SharedState>,
    db: sled::Db,
    tree: sled::Tree,
    writer: Arc<JournalWriter>,
    snapshot_seq: Arc<AtomicU64>,
    /// The snapshot format written and the newest read from a leader
    /// ([`snapshot_format_for_wire`]).
    snapshot_format: Arc<std::sync::atomic::AtomicU32>,
    /// How long building a snapshot took, in all and by part (`/metrics`).
    snapshot_latency: Arc<crate::latency::SnapshotLatency>,
    /// The snapshot and its meta ([`SNAPSHOT_TREE`]).
    snapshots: sled::Tree,
    /// Where the next journal compaction starts ([`KEY_JOURNAL_SETTLED`]).
    journal_settled: Arc<AtomicU64>,
    /// Build snapshots on the task that asks for one, not on Tokio's
    /// blocking pool (the deterministic simulation: one thread, virtual
    /// time).
    build_inline: bool,
}

impl StateMachineStore {
    /// Writes snapshots in `format` from now on, and refuses a leader's
    /// snapshot of a newer one: 7 makes the store behave as the release
    /// before format 8 did (mixed-release tests).
    pub fn use_snapshot_format(&self, format: u32) {
        self.snapshot_format.store(format, Ordering::Relaxed);
    }

    /// How long the snapshots this store built took (read, encode, save,
    /// compact the journal).
    pub fn snapshot_latency(&self) -> &crate::latency::Latency {
        &self.snapshot_latency.total
    }

    /// How long each part of the snapshots this store built took.
    pub fn snapshot_phases(&self) -> &crate::latency::SnapshotLatency {
        &self.snapshot_latency
    }

    /// Builds snapshots on the task that asks for one. By default a build
    /// (seconds for a large state: reading it, encoding, saving, merging
    /// the journal's pages) runs on Tokio's blocking pool, so that it does
    /// not hold one of the runtime's workers, which carry the heartbeats;
    /// the deterministic simulation, one thread on virtual time, needs it
    /// inline for a seed to replay the same run.
    pub fn build_snapshots_inline(&mut self) {
        self.build_inline = true;
    }

    /// Opens (or creates) the store in `dir` and rebuilds the state: the
    /// current snapshot, then every journal entry after it.
    pub fn open(dir: &Path) -> Result<StateMachineStore, StoreError> {
        let db = open_sled(dir)?;
        let tree = db.open_tree("sm")?;
        let snapshots = db.open_tree(SNAPSHOT_TREE)?;
        let last_applied: Option<LogId> = match tree.get(KEY_APPLIED)? {
            Some(v) => meta_codec::decode_last_applied(&v)
                .map_err(|e| StoreError::corrupt("the last applied log id", e))?,
            None => None,
        };
        let membership: StoredMembership<u64, BasicNode> = match tree.get(KEY_MEMBERSHIP)? {
            Some(v) => meta_codec::decode_membership(&v)
                .map_err(|e| StoreError::corrupt("the stored membership", e))?,
            None => StoredMembership::default(),
        };
        let removed_members = match tree.get(KEY_REMOVED)? {
            Some(v) => RemovedMembers::decode(&v)
                .map_err(|e| StoreError::corrupt("the removed members", e))?,
            None => RemovedMembers::default(),
        };
        let (mut state, from) = match snapshot_pair(&snapshots, &tree)? {
            (Some(meta), Some(data)) => {
                let meta = meta_codec::decode_snapshot_meta(&meta)
                    .map_err(|e| StoreError::corrupt("the snapshot's meta", e))?;
                let state =
                    decode_snapshot(&data).map_err(|e| StoreError::corrupt("the snapshot", e))?;
                (state, meta.last_log_id.map_or(0, |l| l.index + 1))
            }
            _ => (ClusterState::new(), 0),
        };
        // Defensive: the snapshot is written only after the journal caught
        // up, so the applied id on disk is never behind it.
        if from > 0 && last_applied.is_none_or(|l| l.index + 1 < from) {
            return Err(StoreError::corrupt(
                "the state directory",
                format!("the snapshot reaches index {} but the applied index on disk is {last_applied:?}", from - 1),
            ));
        }
        let until = last_applied.map_or(0, |l| l.index);
        if until >= from {
            // Refusals were recorded when first applied; the state is the same.
            crate::journal::apply_journal(&tree, &mut state, from, until, false, None)
                .map_err(|e| StoreError::corrupt("the journal", e))?;
        }
        let (journaled_index, _) = watch::channel(until);
        let (state_index, _) = watch::channel(until);
        let shared = Arc::new(SharedState {
            applied: RwLock::new(Applied {
                state,
                last_applied,
                membership,
                removed_members,
            }),
            journaled_index,
            state_index,
        });
        let journal_settled = match tree.get(KEY_JOURNAL_SETTLED)? {
            Some(v) => <[u8; 8]>::try_from(v.as_ref()).map_or(0, u64::from_be_bytes),
            None => 0,
        };
        let writer = Arc::new(JournalWriter::spawn(tree.clone(), shared.clone())?);
        Ok(StateMachineStore {
            shared,
            db,
            tree,
            writer,
            snapshot_seq: Arc::new(AtomicU64::new(0)),
            snapshot_format: Arc::new(std::sync::atomic::AtomicU32::new(SNAPSHOT_FORMAT_VERSION)),
            snapshot_latency: Arc::default(),
            snapshots,
            journal_settled: Arc::new(AtomicU64::new(journal_settled)),
            build_inline: false,
        })
    }

    pub fn shared(&self) -> Arc<SharedState> {
        self.shared.clone()
    }

    /// Up to `limit` applied-entry records from index `from` on, in order.
    pub fn applied_entries(
        &self,
        from: u64,
        limit: usize,
    ) -> Result<Vec<pb::AppliedEntry>, StoreError> {
        self.applied_entries_at(JournalCursor::at_index(from), limit)
    }

    /// Up to `limit` applied-entry records from `from` on, in (index,
    /// position) order. A proposal's commands share one index, so a reader
    /// that goes on in batches resumes at [`JournalCursor::after`] its last
    /// record, not at the next index (which would skip the rest of an entry
    /// whose records a batch cut).
    pub fn applied_entries_at(
        &self,
        from: JournalCursor,
        limit: usize,
    ) -> Result<Vec<pb::AppliedEntry>, StoreError> {
        let mut out = Vec::new();
        for item in self
            .tree
            .range(applied_key(from.index, from.position)..=applied_key(u64::MAX, u32::MAX))
            .take(limit)
        {
            let (k, v) = item?;
            out.push(pb::AppliedEntry::decode(v.as_ref()).map_err(|e| {
                StoreError::corrupt(format!("applied record {:?}", index_of(&k)), e)
            })?);
        }
        Ok(out)
    }

    /// The state as it was at `until` (an index, or the last entry
    /// stamped at or before a time), rebuilt from this replica's journal
    /// while it runs: from the nearest checkpoint at or before it, and
    /// refused when that is more than `max_entries` indexes back
    /// ([`crate::ReplayError::TooFar`]). What the journal has not recorded
    /// yet (it is written behind the state) is not in it: the summary's
    /// `last_index` says where it stopped.
    pub fn state_at(
        &self,
        until: crate::replay::Until,
        max_entries: u64,
    ) -> Result<crate::ReplaySummary, crate::ReplayError> {
        crate::replay::rewind_tree(&self.tree, until, max_entries)
    }

    /// This replica's history up to `until` (an index, or the last entry
    /// stamped at or before a time) from its own journal while it runs: the
    /// state the journal starts from, then its entries
    /// ([`crate::JournalHistory::for_each`]). Refused when the journal
    /// holds more than `max_entries` indexes up to `until`
    /// ([`crate::ReplayError::HistoryTooLong`]). What the journal has not recorded
    /// yet (it is written behind the state) is not in it.
    pub fn history(
        &self,
        until: crate::replay::Until,
        max_entries: u64,
    ) -> Result<crate::JournalHistory<'_>, crate::ReplayError> {
        crate::replay::history_of_tree(&self.tree, until, max_entries)
    }

    /// The bytes of the last snapshot saved (0: none yet).
    pub fn snapshot_bytes(&self) -> Result<u64, StoreError> {
        Ok(snapshot_pair(&self.snapshots, &self.tree)?
            .1
            .map_or(0, |v| u64::try_from(v.len()).unwrap_or(u64::MAX)))
    }

    /// The applied records whose events concern `job_id`, oldest first, at
    /// most `limit`; and whether more were left out.
    pub fn job_history(
        &self,
        job_id: u64,
        limit: usize,
    ) -> Result<(Vec<pb::AppliedEntry>, bool), StoreError> {
        let from = job_history_key(job_id, 0, 0);
        let to = job_history_key(job_id, u64::MAX, u32::MAX);
        let mut out = Vec::new();
        for item in self.tree.range(from..=to) {
            if out.len() == limit {
                return Ok((out, true));
            }
            let (k, _) = item?;
            let index = u64::from_be_bytes(k[9..17].try_into().unwrap_or_default());
            let position = u32::from_be_bytes(k[17..21].try_into().unwrap_or_default());
            let Some(v) = self.tree.get(applied_key(index, position))? else {
                continue;
            };
            out.push(pb::AppliedEntry::decode(v.as_ref()).map_err(|e| {
                StoreError::corrupt(format!("applied record {index}/{position}"), e)
            })?);
        }
        Ok((out, false))
    }

    /// Merges the journal's small pages at or below `upto` into larger ones
    /// (content unchanged). Runs after each snapshot; returns the number of
    /// pages merged away. Reads only the pages written since the last
    /// compaction settled the ones before them.
    pub fn compact_journal(&self, upto: u64) -> Result<usize, StoreError> {
        let from = self.journal_settled.load(Ordering::Relaxed);
        let done = crate::journal::compact(&self.tree, from, upto)?;
        if done.settled_below != from {
            self.tree
                .insert(KEY_JOURNAL_SETTLED, &done.settled_below.to_be_bytes())?;
            self.journal_settled
                .store(done.settled_below, Ordering::Relaxed);
        }
        Ok(done.merged_away)
    }

    /// Makes everything applied so far survive a killed process.
    pub fn flush(&self) -> Result<(), StoreError> {
        self.writer.barrier()?;
        self.db.flush()?;
        Ok(())
    }

    /// Makes the state of a store no Raft runs on (`keel snapshot
    /// restore`) the snapshot `data` (whose decoding is `state`) described
    /// by `meta`: its applied log id and membership included, so that Raft
    /// starts from it (and purges the log up to it). Refused unless the
    /// store holds nothing.
    pub(crate) fn restore_at_rest(
        &self,
        meta: &SnapshotMeta<u64, BasicNode>,
        data: &[u8],
        state: ClusterState,
    ) -> Result<(), StoreError> {
        if self.shared.read().last_applied.is_some()
            || snapshot_pair(&self.snapshots, &self.tree)?.0.is_some()
        {
            return Err(StoreError::corrupt(
                "the state directory",
                "it already holds a state: restore into an empty data directory",
            ));
        }
        self.save_snapshot(meta, data, true)?;
        let mut applied = self.shared.write();
        applied.state = state;
        applied.last_applied = meta.last_log_id;
        applied.membership = meta.last_membership.clone();
        Ok(())
    }

    fn save_snapshot(
        &self,
        meta: &SnapshotMeta<u64, BasicNode>,
        data: &[u8],
        checkpoint: bool,
    ) -> Result<(), StoreError> {
        // The snapshot's index must not be ahead of the applied index on
        // disk: drain the journal writer first.
        self.writer.barrier()?;
        let meta_bytes = meta_codec::encode_snapshot_meta(meta);
        if checkpoint {
            // An installed snapshot is the state: it, the applied id and
            // the membership it brings change together, across both trees.
            use sled::transaction::{ConflictableTransactionResult, TransactionError};
            use sled::Transactional;
            let index = meta.last_log_id.map_or(0, |l| l.index);
            let applied = meta_codec::encode_last_applied(&meta.last_log_id);
            let membership = meta_codec::encode_membership(&meta.last_membership);
            (&self.tree, &self.snapshots)
                .transaction(
                    |(sm, snapshots)| -> ConflictableTransactionResult<(), std::convert::Infallible> {
                        snapshots.insert(KEY_SNAPSHOT_META, meta_bytes.as_slice())?;
                        snapshots.insert(KEY_SNAPSHOT_DATA, data)?;
                        sm.insert(&key(PREFIX_CHECKPOINT, index)[..], data)?;
                        sm.insert(KEY_APPLIED, applied.as_slice())?;
                        sm.insert(KEY_MEMBERSHIP, membership.as_slice())?;
                        sm.insert(KEY_SNAPSHOT_META, SNAPSHOT_MOVED)?;
                        sm.insert(KEY_SNAPSHOT_DATA, SNAPSHOT_MOVED)?;
                        Ok(())
                    },
                )
                .map_err(|e| match e {
                    TransactionError::Storage(e) => StoreError::Sled(e),
                    TransactionError::Abort(never) => match never {},
                })?;
        } else {
            let mut batch = sled::Batch::default();
            batch.insert(KEY_SNAPSHOT_META, meta_bytes);
            batch.insert(KEY_SNAPSHOT_DATA, data);
            self.snapshots.apply_batch(batch)?;
            // Once: the state tree's copy (a data directory written before)
            // gives way to the marker.
            if self.tree.get(KEY_SNAPSHOT_META)?.as_deref() != Some(SNAPSHOT_MOVED) {
                let mut batch = sled::Batch::default();
                batch.insert(KEY_SNAPSHOT_META, SNAPSHOT_MOVED);
                batch.insert(KEY_SNAPSHOT_DATA, SNAPSHOT_MOVED);
                self.tree.apply_batch(batch)?;
            }
        }
        // Log compaction purges the Raft log up to this snapshot: it must be
        // on disk first.
        self.flush()
    }
}

/// The store's values for Raft's own records: the last applied log id,
/// the membership and the snapshot's meta. Format 2 (written): a format
/// byte, 2, then protobuf (`keel.replication.v1`). Format 1 (still read):
/// JSON, as the releases before format 2 wrote it.
pub(crate) mod meta_codec {
    use keel_proto::replication as pb;
    use openraft::{BasicNode, SnapshotMeta, StoredMembership};
    use prost::Message;
    use serde::de::DeserializeOwned;

    use crate::raft_wire::{
        log_id_from_proto, log_id_to_proto, snapshot_meta_from_proto, snapshot_meta_to_proto,
        stored_membership_from_proto, stored_membership_to_proto, WireError,
    };
    use crate::LogId;

    const FORMAT: u8 = 2;

    fn encode(m: &impl Message) -> Vec<u8> {
        let mut v = Vec::with_capacity(1 + m.encoded_len());
        v.push(FORMAT);
        v.extend_from_slice(&m.encode_to_vec());
        v
    }

    fn decode<T: DeserializeOwned, M: Message + Default>(
        bytes: &[u8],
        from: impl FnOnce(M) -> Result<T, WireError>,
    ) -> Result<T, String> {
        match bytes.split_first() {
            Some((&FORMAT, rest)) => {
                from(M::decode(rest).map_err(|e| e.to_string())?).map_err(|e| e.to_string())
            }
            // JSON: an object, or null.
            Some((b'{' | b'n', _)) => serde_json::from_slice(bytes).map_err(|e| e.to_string()),
            Some((other, _)) => Err(format!(
                "format {other} is not one this build reads (1, JSON, or {FORMAT}){}",
                if *other > FORMAT {
                    "; upgrade keel"
                } else {
                    ""
                }
            )),
            None => Err("an empty value".into()),
        }
    }

    pub fn encode_last_applied(id: &Option<LogId>) -> Vec<u8> {
        encode(&pb::LastApplied {
            log_id: id.as_ref().map(log_id_to_proto),
        })
    }

    pub fn decode_last_applied(bytes: &[u8]) -> Result<Option<LogId>, String> {
        decode(bytes, |m: pb::LastApplied| {
            Ok(m.log_id.map(log_id_from_proto))
        })
    }

    pub fn encode_membership(m: &StoredMembership<u64, BasicNode>) -> Vec<u8> {
        encode(&stored_membership_to_proto(m))
    }

    pub fn decode_membership(bytes: &[u8]) -> Result<StoredMembership<u64, BasicNode>, String> {
        decode(bytes, stored_membership_from_proto)
    }

    pub fn encode_snapshot_meta(meta: &SnapshotMeta<u64, BasicNode>) -> Vec<u8> {
        encode(&snapshot_meta_to_proto(meta))
    }

    pub fn decode_snapshot_meta(bytes: &[u8]) -> Result<SnapshotMeta<u64, BasicNode>, String> {
        decode(bytes, snapshot_meta_from_proto)
    }
}

impl StateMachineStore {
    /// Builds a snapshot of the state applied so far, on this thread: the
    /// state read under its lock (applies wait meanwhile), encoded, saved
    /// and flushed, then the journal behind it compacted. Each part's time
    /// goes to [`StateMachineStore::snapshot_phases`]. (openraft's error,
    /// boxed: it is large to carry back from another thread.)
    fn build_snapshot_here(&self) -> Result<Snapshot<TypeConfig>, Box<StorageError>> {
        let phases = &self.snapshot_latency;
        let started = std::time::Instant::now();
        let (data, meta) = {
            let applied = self.shared.read();
            // Under the lock only what reads the state: the protobuf
            // message (format 8; its encoding, as long again, happens
            // after the lock is released), or the postcard bytes (7).
            // Format 8 too when format 7 would lose part of the state (a
            // replica pinned to the release before's wire format, in a
            // cluster that uses what that release cannot hold).
            let format = self.snapshot_format.load(Ordering::Relaxed);
            let data =
                if format == SNAPSHOT_FORMAT_VERSION || !applied.state.postcard_carries_whole() {
                    let mut message = applied.state.to_snapshot_proto();
                    message.format_version = SNAPSHOT_FORMAT_VERSION;
                    PendingSnapshot::Message(Box::new(message))
                } else {
                    PendingSnapshot::Encoded(
                        encode_snapshot_as(&applied.state, format)
                            .map_err(|e| sm_err(StoreError::corrupt("the snapshot's format", e)))?,
                    )
                };
            let seq = self.snapshot_seq.fetch_add(1, Ordering::Relaxed);
            let snapshot_id = match applied.last_applied {
                Some(l) => format!(
                    "{}-{}-{}-{seq}",
                    l.leader_id.term, l.leader_id.node_id, l.index
                ),
                None => format!("0-0-0-{seq}"),
            };
            let meta = SnapshotMeta {
                last_log_id: applied.last_applied,
                last_membership: applied.membership.clone(),
                snapshot_id,
            };
            (data, meta)
        };
        let read = started.elapsed();
        let data = match data {
            PendingSnapshot::Message(message) => message.encode_to_vec(),
            PendingSnapshot::Encoded(bytes) => bytes,
        };
        let encoded = started.elapsed();
        self.save_snapshot(&meta, &data, false).map_err(|e| {
            e.into_raft(
                ErrorSubject::Snapshot(Some(meta.signature())),
                ErrorVerb::Write,
            )
        })?;
        let saved = started.elapsed();
        if let Some(upto) = meta.last_log_id.map(|l| l.index) {
            let merged = self.compact_journal(upto).map_err(sm_err)?;
            tracing::debug!(upto, merged, "journal compacted");
        }
        let total = started.elapsed();
        let (encode, save, compact) = (encoded - read, saved - encoded, total - saved);
        phases.read.observe(read);
        phases.encode.observe(encode);
        phases.save.observe(save);
        phases.compact.observe(compact);
        phases.total.observe(total);
        tracing::debug!(
            bytes = data.len(),
            read_ms = read.as_millis(),
            encode_ms = encode.as_millis(),
            save_ms = save.as_millis(),
            compact_ms = compact.as_millis(),
            "snapshot built"
        );
        Ok(Snapshot {
            meta,
            snapshot: Box::new(Cursor::new(data)),
        })
    }
}

impl RaftSnapshotBuilder<TypeConfig> for StateMachineStore {
    /// On Tokio's blocking pool (unless [`build_snapshots_inline`]): a
    /// build of a large state takes seconds, and on a runtime worker it
    /// would hold up the tasks that send heartbeats.
    ///
    /// [`build_snapshots_inline`]: StateMachineStore::build_snapshots_inline
    async fn build_snapshot(&mut self) -> Result<Snapshot<TypeConfig>, StorageError> {
        if self.build_inline {
            return self.build_snapshot_here().map_err(|e| *e);
        }
        let store = self.clone();
        match tokio::task::spawn_blocking(move || store.build_snapshot_here()).await {
            Ok(built) => built.map_err(|e| *e),
            Err(e) if e.is_panic() => std::panic::resume_unwind(e.into_panic()),
            Err(e) => Err(sm_err(StoreError::Unfinished {
                what: "the snapshot build".into(),
                message: e.to_string(),
            })),
        }
    }
}

impl RaftStateMachine<TypeConfig> for StateMachineStore {
    type SnapshotBuilder = StateMachineStore;

    async fn applied_state(
        &mut self,
    ) -> Result<(Option<LogId>, StoredMembership<u64, BasicNode>), StorageError> {
        let applied = self.shared.read();
        Ok((applied.last_applied, applied.membership.clone()))
    }

    async fn apply<I>(&mut self, entries: I) -> Result<Vec<ApplyResponse>, StorageError>
    where
        I: IntoIterator<Item = Entry> + OptionalSend,
        I::IntoIter: OptionalSend,
    {
        let mut writes = Writes::default();
        let mut page = crate::journal::PageBuilder::default();
        let mut responses = Vec::new();
        // Whether this batch applied a membership: only then are the
        // membership and the removed members written again (they were
        // rewritten at every batch, two of its sled inserts in five at one
        // client).
        let mut membership_applied = false;
        {
            let mut applied = self.shared.write();
            for entry in entries {
                let index = entry.log_id.index;
                applied.last_applied = Some(entry.log_id);
                let outcomes = match entry.payload {
                    EntryPayload::Blank => Vec::new(),
                    EntryPayload::Normal(proposal) => {
                        let mut outcomes = Vec::with_capacity(proposal.entries.len());
                        for (position, e) in proposal.entries.iter().enumerate() {
                            let position = u32::try_from(position).unwrap_or(u32::MAX);
                            // A traced write's apply, and a traced job's
                            // first progress, are spans of its trace.
                            let _traced = e.trace_parent.as_deref().map(|parent| {
                                let span = tracing::trace_span!(
                                    target: crate::trace_context::TARGET,
                                    "keel.apply",
                                    raft.index = index,
                                    keel.command = e.command.kind(),
                                );
                                crate::trace_context::join(&span, parent);
                                span.entered()
                            });
                            let first_progress = first_progress_trace(&applied.state, e);
                            let outcome = applied.state.apply(index, e);
                            if let (Some(parent), Ok(_)) = (first_progress, &outcome) {
                                let span = tracing::trace_span!(
                                    target: crate::trace_context::TARGET,
                                    "keel.first_progress",
                                    raft.index = index,
                                );
                                crate::trace_context::join(&span, &parent);
                            }
                            page.push(index, e);
                            writes.inserts.push((
                                applied_key(index, position).to_vec(),
                                applied_entry_to_proto(index, position, e, &outcome)
                                    .encode_to_vec(),
                            ));
                            if let Err(refusal) = &outcome {
                                tracing::debug!(index, position, %refusal, "entry refused");
                            }
                            if let Ok(events) = &outcome {
                                let jobs: std::collections::BTreeSet<u64> =
                                    events.iter().filter_map(|e| e.job_id()).collect();
                                for job_id in jobs {
                                    writes.inserts.push((
                                        job_history_key(job_id, index, position).to_vec(),
                                        Vec::new(),
                                    ));
                                }
                            }
                            // A repeated request's client hears the first
                            // outcome; the journal keeps what happened.
                            outcomes.push(applied.state.answer(outcome));
                        }
                        outcomes
                    }
                    EntryPayload::Membership(m) => {
                        let before = applied.membership.membership().clone();
                        applied.removed_members.apply(&before, &m, index);
                        applied.membership = StoredMembership::new(Some(entry.log_id), m);
                        membership_applied = true;
                        Vec::new()
                    }
                };
                responses.push(ApplyResponse { index, outcomes });
            }
            if let Some((k, v)) = page.finish() {
                writes.inserts.push((k.to_vec(), v));
            }
            writes.inserts.push((
                KEY_APPLIED.to_vec(),
                meta_codec::encode_last_applied(&applied.last_applied),
            ));
            if membership_applied {
                writes.inserts.push((
                    KEY_MEMBERSHIP.to_vec(),
                    meta_codec::encode_membership(&applied.membership),
                ));
                writes
                    .inserts
                    .push((KEY_REMOVED.to_vec(), applied.removed_members.encode()));
            }
            writes.applied_index = applied.last_applied.map_or(0, |l| l.index);
        }
        self.writer.write(writes).map_err(sm_err)?;
        if let Some(last) = responses.last() {
            self.shared.state_index.send_replace(last.index);
        }
        Ok(responses)
    }

    async fn get_snapshot_builder(&mut self) -> Self::SnapshotBuilder {
        self.clone()
    }

    async fn begin_receiving_snapshot(&mut self) -> Result<Box<Cursor<Vec<u8>>>, StorageError> {
        Ok(Box::new(Cursor::new(Vec::new())))
    }

    async fn install_snapshot(
        &mut self,
        meta: &SnapshotMeta<u64, BasicNode>,
        snapshot: Box<Cursor<Vec<u8>>>,
    ) -> Result<(), StorageError> {
        let data = snapshot.into_inner();
        let newest = self.snapshot_format.load(Ordering::Relaxed);
        let state = decode_snapshot_up_to(&data, newest).map_err(|e| {
            StorageError::from(StorageIOError::read_snapshot(
                Some(meta.signature()),
                AnyError::error(e),
            ))
        })?;
        self.save_snapshot(meta, &data, true).map_err(|e| {
            e.into_raft(
                ErrorSubject::Snapshot(Some(meta.signature())),
                ErrorVerb::Write,
            )
        })?;
        let index = {
            let mut applied = self.shared.write();
            applied.state = state;
            applied.last_applied = meta.last_log_id;
            applied.membership = meta.last_membership.clone();
            meta.last_log_id.map_or(0, |l| l.index)
        };
        self.shared.journaled_index.send_replace(index);
        self.shared.state_index.send_replace(index);
        Ok(())
    }

    async fn get_current_snapshot(&mut self) -> Result<Option<Snapshot<TypeConfig>>, StorageError> {
        match snapshot_pair(&self.snapshots, &self.tree).map_err(read_err)? {
            (Some(meta), Some(data)) => Ok(Some(Snapshot {
                meta: meta_codec::decode_snapshot_meta(&meta)
                    .map_err(|e| read_err(StoreError::corrupt("the snapshot's meta", e)))?,
                snapshot: Box::new(Cursor::new(data.to_vec())),
            })),
            _ => Ok(None),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use keel_state::command::{Command, LogEntry};
    use keel_state::policy_memory::{PolicyMemory, PolicyMemorySlot};

    fn membership(voters: &[u64]) -> openraft::Membership<u64, BasicNode> {
        let nodes: std::collections::BTreeMap<u64, BasicNode> = voters
            .iter()
            .map(|id| (*id, BasicNode::new(format!("10.0.0.{id}:7070"))))
            .collect();
        openraft::Membership::new(vec![voters.iter().copied().collect()], nodes)
    }

    /// Issue 34: the memberships applied say who was removed, at which
    /// index, and forget one added again; the record survives its encoding.
    #[test]
    fn removed_members_are_what_a_later_membership_dropped() {
        let mut removed = RemovedMembers::default();
        removed.apply(&membership(&[]), &membership(&[1, 2, 3]), 1);
        assert!(removed.0.is_empty(), "nobody was removed at the start");
        removed.apply(&membership(&[1, 2, 3]), &membership(&[2, 3]), 40);
        assert_eq!(
            removed.0,
            std::collections::BTreeMap::from([(1, ("10.0.0.1:7070".to_string(), 40))])
        );
        let back = RemovedMembers::decode(&removed.encode()).expect("decodes");
        assert_eq!(back, removed);
        assert!(RemovedMembers::decode(&[9, 0]).is_err(), "a newer format");
        removed.apply(&membership(&[2, 3]), &membership(&[1, 2, 3]), 50);
        assert!(removed.0.is_empty(), "added again");
    }

    fn state_with_memory() -> ClusterState {
        let mut state = ClusterState::new();
        let decision = Command::DecideAllocation {
            based_on: 0,
            policy: "max_min_fairness".into(),
            round: 1,
            placements: vec![],
            memory: Some(PolicyMemory {
                policy: "max_min_fairness".into(),
                format: 1,
                bytes: vec![7; 100],
            }),
        };
        state
            .apply(1, &LogEntry::new(1, decision))
            .expect("applied");
        state
    }

    #[test]
    fn a_snapshot_carries_the_policy_memory_and_the_previous_version_still_reads() {
        let state = state_with_memory();
        let back = decode_snapshot(&encode_snapshot(&state)).expect("decodes");
        assert_eq!(back, state);
        assert_eq!(back.state_hash(), state.state_hash());
        assert!(back.policy_memory().is_some());

        // Version 7: postcard, the memory after the state.
        let mut v7 = postcard::to_stdvec(&SnapshotFileRef {
            format_version: SNAPSHOT_FORMAT_VERSION_POSTCARD,
            state: &state,
        })
        .expect("encodes");
        v7.extend(postcard::to_stdvec(state.policy_memory_slot()).expect("encodes"));
        let read = decode_snapshot(&v7).expect("version 7 reads");
        assert_eq!(read, state);
        assert_eq!(read.state_hash(), state.state_hash());

        // Version 6: the state alone, read as a state without memory.
        let mut old = ClusterState::new();
        old.apply(1, &LogEntry::new(1, Command::set_policy("drf")))
            .expect("applied");
        let v6 = postcard::to_stdvec(&SnapshotFileRef {
            format_version: SNAPSHOT_FORMAT_VERSION_PREVIOUS,
            state: &old,
        })
        .expect("encodes");
        let read = decode_snapshot(&v6).expect("version 6 reads");
        assert_eq!(read, old);
        assert_eq!(read.policy_memory_slot(), &PolicyMemorySlot::default());

        // A newer version is refused, naming the ones read.
        let mut v9 = old.to_snapshot_proto();
        v9.format_version = SNAPSHOT_FORMAT_VERSION + 1;
        let err = decode_snapshot(&v9.encode_to_vec()).expect_err("newer");
        assert!(
            err.contains("version 9") && err.contains("6 to 8") && err.contains("upgrade"),
            "{err}"
        );
        // Written for a replica of the release before (format 7, as it
        // reads), and refused by one when written in format 8.
        let for_old =
            encode_snapshot_as(&state, SNAPSHOT_FORMAT_VERSION_POSTCARD).expect("encodes");
        assert_eq!(for_old, v7);
        let read =
            decode_snapshot_up_to(&for_old, SNAPSHOT_FORMAT_VERSION_POSTCARD).expect("reads");
        assert_eq!(read, state);
        let err = decode_snapshot_up_to(&encode_snapshot(&state), SNAPSHOT_FORMAT_VERSION_POSTCARD)
            .expect_err("newer than the release before reads");
        assert!(err.contains("version 8") && err.contains("6 to 7"), "{err}");
        // A snapshot whose state breaks an invariant is refused.
        let mut broken = state.to_snapshot_proto();
        broken.format_version = SNAPSHOT_FORMAT_VERSION;
        broken.gpu_holders.push(keel_proto::entry::GpuHolding {
            gpu: Some(keel_proto::entry::GpuRef {
                node: "ghost".into(),
                index: 0,
            }),
            job: 42,
            sharer: None,
        });
        let err = decode_snapshot(&broken.encode_to_vec()).expect_err("inconsistent");
        assert!(err.contains("GPU holder index"), "{err}");
    }

    /// Submissions `from..from + n` at indexes `from..`, one apply call.
    async fn submit_jobs(store: &mut StateMachineStore, from: u64, n: u64) {
        let entries: Vec<Entry> = (from..from + n)
            .map(|i| Entry {
                log_id: LogId::new(openraft::CommittedLeaderId::new(1, 1), i),
                payload: EntryPayload::Normal(keel_state::Proposal::new(vec![LogEntry::new(
                    i * 1_000,
                    Command::submit_job(keel_state::fixtures::job_spec(&format!("j{i}"), 1, 1)),
                )])),
            })
            .collect();
        store.apply(entries).await.expect("apply");
    }

    /// The membership and the removed members are written only by the
    /// batches that apply a membership; batches of commands after it leave
    /// them as they were, and a reopened store reads them back.
    #[tokio::test]
    async fn a_membership_applied_before_later_batches_survives_a_reopen() {
        let dir = tempfile::tempdir().expect("tempdir");
        let mut store = StateMachineStore::open(dir.path()).expect("open");
        let id = |i| LogId::new(openraft::CommittedLeaderId::new(1, 1), i);
        store
            .apply(vec![
                Entry {
                    log_id: id(1),
                    payload: EntryPayload::Membership(membership(&[1, 2, 3])),
                },
                Entry {
                    log_id: id(2),
                    payload: EntryPayload::Membership(membership(&[2, 3])),
                },
            ])
            .await
            .expect("apply");
        // The journal writer's thread writes the batches; flushed, they are in.
        store.flush().expect("flush");
        assert!(store.tree.get(KEY_MEMBERSHIP).expect("read").is_some());
        store.tree.remove(KEY_REMOVED).expect("remove");
        submit_jobs(&mut store, 3, 4).await;
        store.flush().expect("flush");
        assert!(
            store.tree.get(KEY_REMOVED).expect("read").is_none(),
            "a batch without a membership does not write the removed members"
        );
        store
            .apply(vec![Entry {
                log_id: id(7),
                payload: EntryPayload::Membership(membership(&[2, 3])),
            }])
            .await
            .expect("apply");
        submit_jobs(&mut store, 8, 2).await;
        store.flush().expect("flush");
        drop(store);
        let store = StateMachineStore::open(dir.path()).expect("reopen");
        let applied = store.shared();
        let applied = applied.read();
        assert_eq!(applied.last_applied.map(|l| l.index), Some(9));
        assert_eq!(applied.membership.log_id().map(|l| l.index), Some(7));
        assert_eq!(applied.membership.membership(), &membership(&[2, 3]));
        assert_eq!(
            applied.removed_members.0,
            std::collections::BTreeMap::from([(1, ("10.0.0.1:7070".to_string(), 2))])
        );
    }

    /// The snapshot lives in a tree of its own, away from the keys every
    /// apply rewrites; the state tree keeps a marker a release before
    /// refuses. A data directory with the snapshot in the state tree (as
    /// the releases before wrote it) opens on it, and its next snapshot
    /// moves.
    #[tokio::test]
    async fn the_snapshot_lives_apart_from_the_keys_every_apply_rewrites() {
        let dir = tempfile::tempdir().expect("tempdir");
        let mut store = StateMachineStore::open(dir.path()).expect("open");
        submit_jobs(&mut store, 1, 20).await;
        let built = store.build_snapshot().await.expect("snapshot");
        let bytes = built.snapshot.into_inner();
        assert_eq!(
            store
                .snapshots
                .get(KEY_SNAPSHOT_DATA)
                .expect("read")
                .as_deref(),
            Some(&bytes[..])
        );
        assert_eq!(
            store.tree.get(KEY_SNAPSHOT_DATA).expect("read").as_deref(),
            Some(SNAPSHOT_MOVED)
        );
        let err =
            meta_codec::decode_snapshot_meta(SNAPSHOT_MOVED).expect_err("no release reads it");
        assert!(
            err.contains("format 254") && err.contains("upgrade keel"),
            "{err}"
        );
        assert_eq!(store.snapshot_bytes().expect("size"), bytes.len() as u64);
        let hash = store.shared().read().state.state_hash();
        store.flush().expect("flush");

        // As a release before left it: the snapshot in the state tree only.
        let meta = store
            .snapshots
            .get(KEY_SNAPSHOT_META)
            .expect("read")
            .expect("meta");
        store.tree.insert(KEY_SNAPSHOT_META, meta).expect("write");
        store
            .tree
            .insert(KEY_SNAPSHOT_DATA, &bytes[..])
            .expect("write");
        store.snapshots.clear().expect("clear");
        store.flush().expect("flush");
        drop(store);
        let mut store = StateMachineStore::open(dir.path()).expect("reopen");
        assert_eq!(store.shared().read().state.state_hash(), hash);
        let current = store
            .get_current_snapshot()
            .await
            .expect("read")
            .expect("a snapshot");
        assert_eq!(current.snapshot.into_inner(), bytes);
        submit_jobs(&mut store, 21, 5).await;
        store.build_snapshot().await.expect("snapshot");
        assert!(store
            .snapshots
            .get(KEY_SNAPSHOT_DATA)
            .expect("read")
            .is_some());
        assert_eq!(
            store.tree.get(KEY_SNAPSHOT_DATA).expect("read").as_deref(),
            Some(SNAPSHOT_MOVED)
        );
        let hash = store.shared().read().state.state_hash();
        store.flush().expect("flush");
        drop(store);
        let store = StateMachineStore::open(dir.path()).expect("reopen");
        assert_eq!(store.shared().read().state.state_hash(), hash);
        assert_eq!(store.shared().read().state.jobs().len(), 25);
    }

    /// Format 7 (postcard, the release before's) leaves out what is encoded
    /// apart: a state with tokens or a submitter is never written in it, by
    /// a peer's copy or by a replica pinned to the older wire format, which
    /// writes format 8 instead of a snapshot that would reload as another
    /// state.
    #[tokio::test]
    async fn a_state_format_7_cannot_carry_is_never_written_in_it() {
        use keel_state::acl::SecretHash;
        let mut state = ClusterState::new();
        let mut submit = LogEntry::new(
            1_000,
            Command::submit_job(keel_state::fixtures::job_spec("audited", 1, 1)),
        );
        assert!(state.postcard_carries_whole());
        submit.actor = Some("token:alice".into());
        state.apply(1, &submit).expect("applies");
        assert!(!state.postcard_carries_whole(), "a submitter");
        let mut tokens = ClusterState::new();
        tokens
            .apply(
                1,
                &LogEntry::new(
                    1_000,
                    Command::bootstrap_acl(
                        "root",
                        SecretHash::of("root-secret-0123456789abcdefghijk"),
                    ),
                ),
            )
            .expect("applies");
        assert!(!tokens.postcard_carries_whole(), "tokens");
        for lossy in [&state, &tokens] {
            let err = encode_snapshot_as(lossy, SNAPSHOT_FORMAT_VERSION_POSTCARD)
                .expect_err("format 7 would lose part of it");
            assert!(
                err.contains("cannot carry") && err.contains("upgrade"),
                "{err}"
            );
        }
        // A store pinned to format 7 snapshots it in format 8 instead.
        let dir = tempfile::tempdir().expect("tempdir");
        let mut store = StateMachineStore::open(dir.path()).expect("store");
        store.use_snapshot_format(SNAPSHOT_FORMAT_VERSION_POSTCARD);
        store.shared.write().state = tokens.clone();
        let snapshot = store.build_snapshot().await.expect("a snapshot");
        let bytes = snapshot.snapshot.into_inner();
        assert_eq!(bytes.first(), Some(&PROTOBUF_FIRST_BYTE), "format 8");
        assert_eq!(decode_snapshot(&bytes).expect("decodes"), tokens);
    }
}
