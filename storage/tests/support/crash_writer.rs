//! Helper for the crash test: appends entries to a WAL as fast as it can and
//! prints `acked N` after each batch is durable, until it is killed.
//!
//! Usage: `crash-writer DIR`

#![allow(clippy::print_stdout)]

use std::io::Write;
use std::path::PathBuf;

use keel_state::fixtures::job_spec;
use keel_state::{Command, LogEntry, Proposal};
use keel_storage::{Entry, LogStore};
use openraft::{CommittedLeaderId, EntryPayload, LogId};

/// The entry the writer puts at `index`; the test rebuilds it to compare.
pub fn entry_at(index: u64) -> Entry {
    Entry {
        log_id: LogId::new(CommittedLeaderId::new(1, 1), index),
        payload: EntryPayload::Normal(Proposal::new(vec![LogEntry {
            at_ms: index,
            command: Command::submit_job(job_spec(&format!("job-{index}"), 1, 1)),
            request_id: None,
            actor: None,
            trace_parent: None,
        }])),
    }
}

#[allow(dead_code)]
fn main() -> Result<(), Box<dyn std::error::Error>> {
    let dir = PathBuf::from(std::env::args().nth(1).ok_or("usage: crash-writer DIR")?);
    let store = LogStore::open(&dir)?;
    let mut next = 1u64;
    let mut out = std::io::stdout().lock();
    loop {
        let batch: Vec<Entry> = (next..next + 7).map(entry_at).collect();
        store.append_durable(&batch)?;
        next += 7;
        writeln!(out, "acked {}", next - 1)?;
        out.flush()?;
    }
}
