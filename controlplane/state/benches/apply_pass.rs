//! One pass of a 200,000-entry stream through `ClusterState::apply`, for
//! counting instructions, which do not move with the machine's load as
//! wall-clock figures do (BENCHMARKS, "the cost of queues"). The stream
//! is made first; only `apply_all` is to be counted:
//!
//! ```sh
//! cargo bench -p keel-state --bench apply_pass --no-run   # prints the executable
//! valgrind --tool=callgrind --toggle-collect='apply_pass::apply_all' \
//!   target/release/deps/apply_pass-HASH queues   # or: plain
//! ```
//!
//! Run by `cargo bench` without an argument, it applies both streams once
//! and says how long each took (a smoke run, not a figure).

#![allow(clippy::print_stderr)] // a bench binary reports on the terminal

use keel_state::fixtures::{mixed_entries, mixed_entries_in_queues};
use keel_state::{ClusterState, LogEntry};

const ENTRIES: usize = 200_000;

#[inline(never)]
fn apply_all(entries: &[LogEntry]) -> ClusterState {
    let mut state = ClusterState::new();
    for (i, e) in entries.iter().enumerate() {
        let _ = std::hint::black_box(state.apply(i as u64 + 1, e));
    }
    state
}

fn main() {
    let which: Vec<String> = std::env::args()
        .skip(1)
        .filter(|a| a == "plain" || a == "queues")
        .collect();
    let which = if which.is_empty() {
        vec!["plain".to_string(), "queues".to_string()]
    } else {
        which
    };
    for stream in which {
        let entries = if stream == "queues" {
            mixed_entries_in_queues(ENTRIES, 32, 42, 50)
        } else {
            mixed_entries(ENTRIES, 32, 42)
        };
        let started = std::time::Instant::now();
        let state = apply_all(&entries);
        eprintln!(
            "{stream}: {ENTRIES} entries in {:?}, state {}",
            started.elapsed(),
            state.state_hash()
        );
    }
}
