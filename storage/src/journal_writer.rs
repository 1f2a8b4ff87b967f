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

use std::sync::mpsc::{sync_channel, Receiver, SyncSender};
use std::sync::{Arc, Mutex};
use std::thread::JoinHandle;

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

/// Most queued apply calls merged into one sled batch.
const MAX_MERGED: usize = 4096;
/// Apply calls queued before `apply` waits for the writer.
const QUEUE: usize = 8192;

#[derive(Debug)]
pub(crate) struct JournalWriter {
    tx: Option<SyncSender<Work>>,
    handle: Option<JoinHandle<()>>,
    failed: Arc<Mutex<Option<String>>>,
}

impl JournalWriter {
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

fn run(
    tree: &sled::Tree,
    shared: &SharedState,
    rx: &Receiver<Work>,
    failed: &Mutex<Option<String>>,
) {
    while let Ok(first) = rx.recv() {
        let mut batch = sled::Batch::default();
        let mut writes = 0;
        let mut applied_index = None;
        let mut barriers = Vec::new();
        let mut next = Some(first);
        while let Some(work) = next.take() {
            match work {
                Work::Write(w) => {
                    for (k, v) in w.inserts {
                        batch.insert(k, v);
                    }
                    applied_index = Some(w.applied_index);
                    writes += 1;
                }
                Work::Barrier(done) => barriers.push(done),
            }
            if writes < MAX_MERGED {
                next = rx.try_recv().ok();
            }
        }
        let result = if writes > 0 {
            tree.apply_batch(batch).map_err(|e| e.to_string())
        } else {
            Ok(())
        };
        match &result {
            Ok(()) => {
                if let Some(i) = applied_index {
                    shared.journaled(i);
                }
            }
            Err(e) => {
                tracing::error!(error = %e, "the journal writer failed; the state machine stops");
                *failed.lock().unwrap_or_else(|p| p.into_inner()) = Some(e.clone());
            }
        }
        for done in barriers {
            let _ = done.send(result.clone());
        }
        if result.is_err() {
            return;
        }
    }
}
