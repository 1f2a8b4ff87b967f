//! Writes the state machine's sled batches on a thread of its own.
//!
//! openraft applies one entry per call under light concurrency, and one
//! sled `apply_batch` costs far more than applying an entry in memory
//! (BENCHMARKS.md, "Durable submissions through one replica", has the
//! profile). So `apply` changes the state in
//! memory, answers, and queues its writes here; this thread merges whatever
//! is queued into one atomic sled batch. Nothing durable depends on this
//! being prompt: the Raft log (WAL) already holds every applied entry, and
//! on restart openraft re-applies whatever the journal had not recorded.
//! What must wait for it ([`JournalWriter::barrier`]): building a snapshot
//! (the log is purged behind it), installing one, flushing, and readers that
//! want the journal to be complete up to an index.
//!
//! Each sled `apply_batch` seals sled's IO buffer and hands its write to
//! sled's IO threads, waking all of them (0.34's pool notifies every
//! waiting thread): at one client, one batch per write was a quarter of
//! the three replicas' CPU (BENCHMARKS.md, "One client: the journal's
//! batches and a stream to each follower"). So the writer lingers up to [`LINGER`] after a call for more
//! to merge, unless a barrier is waiting. Only readers of the journal see
//! the delay; the leader's loops follow the state in memory
//! ([`SharedState::subscribe_state`]).
//!
//! A merged batch is bounded by what it holds ([`MAX_BATCH_INSERTS`],
//! [`MAX_BATCH_BYTES`]), not by how many calls it merges: sled 0.34 keeps
//! memory in proportion to the size of the batches it was given and does not
//! give it back (BENCHMARKS.md, "Speed end to end, stop 51"): a 5 M-entry
//! history applied through the store as fast as it takes them, with the
//! writer behind and merging everything queued, grew past 20 GB. A replica
//! catching up on a backlog applies the same way.

use std::sync::mpsc::{sync_channel, Receiver, SyncSender, TryRecvError};
use std::sync::{Arc, Mutex};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use crate::state_machine::SharedState;
use crate::StoreError;

/// Inserts for one apply call, and the applied index they bring the journal to.
#[derive(Debug, Default)]
pub(crate) struct Writes {
    pub(crate) inserts: Vec<(Vec<u8>, Vec<u8>)>,
    pub(crate) applied_index: u64,
}

enum Work {
    Write(Writes),
    Barrier(SyncSender<Result<(), String>>),
}

/// Most inserts merged into one sled batch: calls are merged until the
/// batch holds this many or [`MAX_BATCH_BYTES`] (one call's writes are
/// never split, so a batch can hold more when a single call does).
const MAX_BATCH_INSERTS: usize = 512;
/// Most bytes of keys and values merged into one sled batch.
const MAX_BATCH_BYTES: usize = 512 * 1024;
/// Apply calls queued before `apply` waits for the writer.
const QUEUE: usize = 1024;
/// How long the writer waits after a call for more calls to merge into
/// its batch; a barrier, a full batch or a closed queue ends the wait.
pub(crate) const LINGER: Duration = Duration::from_millis(10);

#[derive(Debug)]
pub(crate) struct JournalWriter {
    tx: Option<SyncSender<Work>>,
    handle: Option<JoinHandle<()>>,
    failed: Arc<Mutex<Option<String>>>,
}

impl JournalWriter {
    /// Starts the writer's thread; it merges calls arriving within
    /// [`LINGER`] of each batch's first.
    pub(crate) fn spawn(tree: sled::Tree, shared: Arc<SharedState>) -> Result<Self, StoreError> {
        let (tx, rx) = sync_channel(QUEUE);
        let failed = Arc::new(Mutex::new(None));
        let failed_in_thread = failed.clone();
        let handle = std::thread::Builder::new()
            .name("keel-journal".into())
            .spawn(move || run(&tree, &shared, &rx, &failed_in_thread))?;
        Ok(JournalWriter {
            tx: Some(tx),
            handle: Some(handle),
            failed,
        })
    }

    fn check(&self) -> Result<&SyncSender<Work>, StoreError> {
        if let Some(e) = self
            .failed
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .as_ref()
        {
            return Err(StoreError::corrupt("the journal writer", e));
        }
        self.tx
            .as_ref()
            .ok_or_else(|| StoreError::corrupt("the journal writer", "stopped"))
    }

    /// Queues one apply call's writes.
    pub(crate) fn write(&self, writes: Writes) -> Result<(), StoreError> {
        self.check()?
            .send(Work::Write(writes))
            .map_err(|_| StoreError::corrupt("the journal writer", "stopped"))
    }

    /// Returns once every write queued before it is in sled.
    pub(crate) fn barrier(&self) -> Result<(), StoreError> {
        let (tx, rx) = sync_channel(1);
        self.check()?
            .send(Work::Barrier(tx))
            .map_err(|_| StoreError::corrupt("the journal writer", "stopped"))?;
        rx.recv()
            .map_err(|_| StoreError::corrupt("the journal writer", "stopped"))?
            .map_err(|e| StoreError::corrupt("the journal writer", e))
    }
}

impl Drop for JournalWriter {
    fn drop(&mut self) {
        // Closing the queue lets the thread write what is left and stop.
        self.tx.take();
        if let Some(h) = self.handle.take() {
            let _ = h.join();
        }
    }
}

/// What the writer takes off the queue for one sled batch.
struct Merged {
    batch: sled::Batch,
    /// Inserts in `batch`, and their keys' and values' bytes.
    inserts: usize,
    bytes: usize,
    /// The applied index the batch brings the journal to; `None` when it
    /// merged no apply call (barriers only).
    applied_index: Option<u64>,
    barriers: Vec<SyncSender<Result<(), String>>>,
}

impl Merged {
    /// `first` and whatever is queued behind it or arrives within `linger`
    /// of it, until the batch holds [`MAX_BATCH_INSERTS`] inserts or
    /// [`MAX_BATCH_BYTES`], a barrier is taken, or the queue closes.
    fn take(first: Work, rx: &Receiver<Work>, linger: Duration) -> Merged {
        let deadline = Instant::now() + linger;
        let mut merged = Merged {
            batch: sled::Batch::default(),
            inserts: 0,
            bytes: 0,
            applied_index: None,
            barriers: Vec::new(),
        };
        let mut next = Some(first);
        while let Some(work) = next.take() {
            match work {
                Work::Write(w) => {
                    merged.inserts += w.inserts.len();
                    for (k, v) in w.inserts {
                        merged.bytes += k.len() + v.len();
                        merged.batch.insert(k, v);
                    }
                    merged.applied_index = Some(w.applied_index);
                }
                Work::Barrier(done) => merged.barriers.push(done),
            }
            if merged.inserts >= MAX_BATCH_INSERTS || merged.bytes >= MAX_BATCH_BYTES {
                break;
            }
            next = match rx.try_recv() {
                Ok(work) => Some(work),
                Err(TryRecvError::Empty) if merged.barriers.is_empty() => {
                    match deadline.checked_duration_since(Instant::now()) {
                        // Timed out or closed: the batch is done.
                        Some(left) if !left.is_zero() => rx.recv_timeout(left).ok(),
                        _ => None,
                    }
                }
                Err(_) => None,
            };
        }
        merged
    }
}

fn run(
    tree: &sled::Tree,
    shared: &SharedState,
    rx: &Receiver<Work>,
    failed: &Mutex<Option<String>>,
) {
    while let Ok(first) = rx.recv() {
        let merged = Merged::take(first, rx, LINGER);
        let result = match merged.applied_index {
            Some(_) => tree.apply_batch(merged.batch).map_err(|e| e.to_string()),
            None => Ok(()),
        };
        match &result {
            Ok(()) => {
                if let Some(i) = merged.applied_index {
                    shared.journaled(i);
                }
            }
            Err(e) => {
                tracing::error!(error = %e, "the journal writer failed; the state machine stops");
                *failed.lock().unwrap_or_else(|p| p.into_inner()) = Some(e.clone());
            }
        }
        for done in merged.barriers {
            let _ = done.send(result.clone());
        }
        if result.is_err() {
            return;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn write(index: u64, inserts: usize, value_bytes: usize) -> Work {
        Work::Write(Writes {
            inserts: (0..inserts)
                .map(|i| {
                    let key = [index.to_be_bytes(), (i as u64).to_be_bytes()].concat();
                    (key, vec![7; value_bytes])
                })
                .collect(),
            applied_index: index,
        })
    }

    /// A writer that fell behind takes a bounded batch off a long queue, not
    /// the whole queue (sled's memory grows with its batches' size).
    #[test]
    fn a_long_queue_is_written_in_batches_of_bounded_size() {
        let (tx, rx) = sync_channel(QUEUE);
        for index in 1..=1000 {
            tx.send(write(index, 10, 16)).expect("queued");
        }
        let first = rx.recv().expect("queued");
        let merged = Merged::take(first, &rx, Duration::ZERO);
        // Calls of indexes 1, 2, ...: the index reached is the calls merged.
        let calls = MAX_BATCH_INSERTS.div_ceil(10) as u64;
        assert_eq!(merged.inserts as u64, calls * 10);
        assert_eq!(merged.applied_index, Some(calls));
        // The rest waits for the next batches, in order, each call whole.
        let mut written = calls;
        let mut batches = 1;
        while let Ok(first) = rx.try_recv() {
            let merged = Merged::take(first, &rx, Duration::ZERO);
            assert!(merged.inserts <= MAX_BATCH_INSERTS + 9);
            let reached = merged.applied_index.expect("writes merged");
            assert_eq!(merged.inserts as u64, (reached - written) * 10);
            written = reached;
            batches += 1;
        }
        assert_eq!(written, 1000);
        assert!(batches >= 10_000 / (MAX_BATCH_INSERTS + 9));
    }

    /// The bytes bound holds for few large values, and one call's writes
    /// are never split: the journal's applied index stays atomic with them.
    #[test]
    fn a_batch_stops_at_its_bytes_and_keeps_each_call_whole() {
        let (tx, rx) = sync_channel(QUEUE);
        let value_bytes = MAX_BATCH_BYTES / 3;
        for index in 1..=5 {
            tx.send(write(index, 2, value_bytes)).expect("queued");
        }
        let merged = Merged::take(rx.recv().expect("queued"), &rx, Duration::ZERO);
        assert_eq!(merged.inserts, 4);
        assert!(merged.bytes >= MAX_BATCH_BYTES);
        assert_eq!(
            merged.applied_index,
            Some(2),
            "two calls reach the bytes bound"
        );
        // A barrier behind writes is answered with the batch it ends.
        let (done, answered) = sync_channel(1);
        let (tx, rx) = sync_channel(QUEUE);
        tx.send(write(1, 1, 1)).expect("queued");
        tx.send(Work::Barrier(done)).expect("queued");
        let merged = Merged::take(rx.recv().expect("queued"), &rx, Duration::ZERO);
        assert_eq!((merged.applied_index, merged.barriers.len()), (Some(1), 1));
        assert!(
            matches!(
                answered.try_recv(),
                Err(std::sync::mpsc::TryRecvError::Empty)
            ),
            "answered only once written"
        );
    }
    /// A call arriving while the writer lingers joins the batch; a barrier
    /// ends the wait at once (the linger here is an hour), and so does a
    /// closed queue.
    #[test]
    fn the_writer_lingers_for_more_calls_until_a_barrier_or_a_closed_queue() {
        let hour = Duration::from_secs(3600);
        let (tx, rx) = sync_channel(QUEUE);
        tx.send(write(1, 1, 1)).expect("queued");
        let (done, _answered) = sync_channel(1);
        let sender = std::thread::spawn(move || {
            // Most likely sent after `take` found the queue empty and
            // waits; merged either way.
            std::thread::sleep(Duration::from_millis(20));
            tx.send(write(2, 3, 1)).expect("queued");
            tx.send(Work::Barrier(done)).expect("queued");
            tx
        });
        let merged = Merged::take(rx.recv().expect("queued"), &rx, hour);
        assert_eq!(
            (merged.inserts, merged.applied_index, merged.barriers.len()),
            (4, Some(2), 1),
            "the later call merged, the barrier ended the batch"
        );
        let tx = sender.join().expect("sender");
        // A call, then the queue closes: written without waiting.
        tx.send(write(3, 1, 1)).expect("queued");
        drop(tx);
        let merged = Merged::take(rx.recv().expect("queued"), &rx, hour);
        assert_eq!((merged.inserts, merged.applied_index), (1, Some(3)));
    }
}
