//! An in-memory Raft log on a simulated disk.
//!
//! A write lands in the "page cache" at once; a flush makes everything
//! written before it durable after a seeded delay, flushes finishing in the
//! order they were issued (one disk per replica), and openraft hears that
//! an append is flushed only then, as from Keel's write-ahead log. A crash
//! ([`SimDisk::crash`]) loses every write that was not durable: appended
//! entries and the committed id. The vote, a truncation and a purge are
//! durable when their call returns (Keel's log syncs them before it
//! answers).

use std::collections::BTreeMap;
use std::fmt::Debug;
use std::ops::{Bound, RangeBounds};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::Duration;

use keel_state::fixtures::SplitMix64;
use keel_storage::{Entry, LogId, StorageError, TypeConfig};
use openraft::storage::{LogFlushed, LogState, RaftLogStorage};
use openraft::{OptionalSend, RaftLogReader, Vote};
use tokio::sync::mpsc;
use tokio::task::JoinHandle;

#[derive(Debug, Default)]
struct Disk {
    /// Index → the entry and the sequence number of the write that put it.
    entries: BTreeMap<u64, (Entry, u64)>,
    vote: Option<Vote<u64>>,
    /// The committed id openraft last saved, and its write's number.
    committed: (Option<LogId>, u64),
    /// The committed id as of the last flush that covered it.
    durable_committed: Option<LogId>,
    purged: Option<LogId>,
    /// Entries removed by truncations (a conflicting suffix the leader
    /// overwrote).
    truncated: u64,
    /// Writes numbered up to this are durable.
    durable_seq: u64,
    next_seq: u64,
}

/// One replica's disk. It outlives the replica's crashes.
#[derive(Debug, Clone)]
pub struct SimDisk {
    disk: Arc<Mutex<Disk>>,
    /// Flushes take 50–200 ms instead of 0.5–8 ms.
    slow: Arc<AtomicBool>,
    /// A broken disk, to check the checker: appends are acknowledged at
    /// once and become durable 100–500 ms later.
    lying: bool,
    rng: Arc<Mutex<SplitMix64>>,
}

impl SimDisk {
    pub fn new(seed: u64, lying: bool) -> SimDisk {
        SimDisk {
            disk: Arc::default(),
            slow: Arc::default(),
            lying,
            rng: Arc::new(Mutex::new(SplitMix64::new(seed))),
        }
    }

    fn lock(&self) -> MutexGuard<'_, Disk> {
        self.disk.lock().unwrap_or_else(|p| p.into_inner())
    }

    pub fn set_slow(&self, slow: bool) {
        self.slow.store(slow, Ordering::Relaxed);
    }

    /// A crash: every write not yet durable is lost. Returns how many
    /// entries were.
    pub fn crash(&self) -> usize {
        let mut d = self.lock();
        let durable = d.durable_seq;
        let before = d.entries.len();
        d.entries.retain(|_, (_, seq)| *seq <= durable);
        let lost = before - d.entries.len();
        let committed = d.durable_committed;
        d.committed = (committed, 0);
        lost
    }

    /// A lost disk: everything on it gone (the replica must be down). The
    /// count of truncated entries is the run's, not the disk's: it stays.
    pub fn wipe(&self) {
        let mut d = self.lock();
        let truncated = d.truncated;
        *d = Disk::default();
        d.truncated = truncated;
    }

    /// Entries removed by truncations so far.
    pub fn truncated(&self) -> u64 {
        self.lock().truncated
    }

    /// The entries on this disk now (durable or not), by index.
    pub fn entries(&self) -> BTreeMap<u64, Entry> {
        self.lock()
            .entries
            .iter()
            .map(|(i, (e, _))| (*i, e.clone()))
            .collect()
    }

    fn flush_delay(&self) -> Duration {
        let mut rng = self.rng.lock().unwrap_or_else(|p| p.into_inner());
        let us = if self.lying {
            100_000 + rng.below(400_000)
        } else if self.slow.load(Ordering::Relaxed) {
            50_000 + rng.below(150_000)
        } else {
            500 + rng.below(7_500)
        };
        Duration::from_micros(us)
    }
}

struct Flush {
    /// Writes up to this number become durable.
    seq: u64,
    delay: Duration,
    callback: Option<LogFlushed<TypeConfig>>,
}

/// The log store of one incarnation of a replica: its disk, and the task
/// that completes its flushes (aborted by a crash).
#[derive(Debug, Clone)]
pub struct SimLogStore {
    disk: SimDisk,
    flushes: mpsc::UnboundedSender<Flush>,
}

impl Debug for Flush {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Flush").field("seq", &self.seq).finish()
    }
}

impl SimLogStore {
    /// A store on `disk`, and its flushing task (abort it to crash).
    pub fn open(disk: SimDisk) -> (SimLogStore, JoinHandle<()>) {
        let (tx, mut rx) = mpsc::unbounded_channel::<Flush>();
        let on = disk.clone();
        let flusher = tokio::spawn(async move {
            while let Some(f) = rx.recv().await {
                tokio::time::sleep(f.delay).await;
                {
                    let mut d = on.lock();
                    d.durable_seq = d.durable_seq.max(f.seq);
                    if d.committed.1 <= d.durable_seq {
                        d.durable_committed = d.committed.0;
                    }
                }
                if let Some(callback) = f.callback {
                    callback.log_io_completed(Ok(()));
                }
            }
        });
        (SimLogStore { disk, flushes: tx }, flusher)
    }
}

fn bounds(range: &impl RangeBounds<u64>) -> (Bound<u64>, Bound<u64>) {
    (range.start_bound().cloned(), range.end_bound().cloned())
}

impl RaftLogReader<TypeConfig> for SimLogStore {
    async fn try_get_log_entries<RB: RangeBounds<u64> + Clone + Debug + OptionalSend>(
        &mut self,
        range: RB,
    ) -> Result<Vec<Entry>, StorageError> {
        Ok(self
            .disk
            .lock()
            .entries
            .range(bounds(&range))
            .map(|(_, (e, _))| e.clone())
            .collect())
    }
}

impl RaftLogStorage<TypeConfig> for SimLogStore {
    type LogReader = SimLogStore;

    async fn get_log_state(&mut self) -> Result<LogState<TypeConfig>, StorageError> {
        let d = self.disk.lock();
        let last = d.entries.values().next_back().map(|(e, _)| e.log_id);
        Ok(LogState {
            last_purged_log_id: d.purged,
            last_log_id: last.or(d.purged),
        })
    }

    async fn get_log_reader(&mut self) -> Self::LogReader {
        self.clone()
    }

    async fn save_vote(&mut self, vote: &Vote<u64>) -> Result<(), StorageError> {
        self.disk.lock().vote = Some(*vote);
        Ok(())
    }

    async fn read_vote(&mut self) -> Result<Option<Vote<u64>>, StorageError> {
        Ok(self.disk.lock().vote)
    }

    async fn save_committed(&mut self, committed: Option<LogId>) -> Result<(), StorageError> {
        let mut d = self.disk.lock();
        d.next_seq += 1;
        d.committed = (committed, d.next_seq);
        Ok(())
    }

    async fn read_committed(&mut self) -> Result<Option<LogId>, StorageError> {
        Ok(self.disk.lock().committed.0)
    }

    async fn append<I>(
        &mut self,
        entries: I,
        callback: LogFlushed<TypeConfig>,
    ) -> Result<(), StorageError>
    where
        I: IntoIterator<Item = Entry> + OptionalSend,
        I::IntoIter: OptionalSend,
    {
        let seq = {
            let mut d = self.disk.lock();
            let purged = d.purged.map(|p| p.index);
            for e in entries {
                if purged.is_some_and(|p| e.log_id.index <= p) {
                    continue;
                }
                d.next_seq += 1;
                let seq = d.next_seq;
                d.entries.insert(e.log_id.index, (e, seq));
            }
            d.next_seq
        };
        let delay = self.disk.flush_delay();
        let callback = if self.disk.lying {
            callback.log_io_completed(Ok(()));
            None
        } else {
            Some(callback)
        };
        // The flusher ends only with a crash, and then nobody waits.
        let _ = self.flushes.send(Flush {
            seq,
            delay,
            callback,
        });
        Ok(())
    }

    async fn truncate(&mut self, log_id: LogId) -> Result<(), StorageError> {
        let mut d = self.disk.lock();
        let gone = d.entries.split_off(&log_id.index);
        d.truncated += gone.len() as u64;
        Ok(())
    }

    async fn purge(&mut self, log_id: LogId) -> Result<(), StorageError> {
        let mut d = self.disk.lock();
        d.entries = d.entries.split_off(&(log_id.index + 1));
        d.purged = Some(log_id);
        Ok(())
    }
}
