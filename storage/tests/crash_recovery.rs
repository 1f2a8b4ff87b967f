//! Crash recovery on real files: a writer process killed with SIGKILL loses
//! no acknowledged entry; a torn final record is dropped, not replayed.

use std::io::{BufRead, BufReader};
use std::process::{Command, Stdio};

use keel_storage::LogStore;
use openraft::storage::RaftLogStorage;

#[path = "support/crash_writer.rs"]
mod crash_writer;
use crash_writer::entry_at;

#[test]
fn sigkill_mid_stream_loses_no_acknowledged_entry() {
    for round in 0..3 {
        let dir = tempfile::tempdir().expect("tempdir");
        let mut child = Command::new(env!("CARGO_BIN_EXE_crash-writer"))
            .arg(dir.path())
            .stdout(Stdio::piped())
            .spawn()
            .expect("spawn writer");
        let stdout = child.stdout.take().expect("stdout");
        let mut acked = 0u64;
        // Kill at a different point each round, while the writer is busy.
        let kill_after = 300 + 400 * round;
        for line in BufReader::new(stdout).lines() {
            let line = line.expect("read line");
            acked = line
                .strip_prefix("acked ")
                .and_then(|n| n.parse().ok())
                .expect("acked N");
            if acked >= kill_after {
                break;
            }
        }
        child.kill().expect("SIGKILL the writer");
        child.wait().expect("reap");
        assert!(acked >= kill_after, "writer stopped early at {acked}");

        let store = LogStore::open(dir.path()).expect("reopen after SIGKILL");
        let entries = store.entries(0, u64::MAX).expect("read back");
        assert!(
            entries.len() as u64 >= acked,
            "round {round}: {acked} acknowledged but only {} entries back",
            entries.len()
        );
        for (i, e) in entries.iter().enumerate() {
            let expected = entry_at(i as u64 + 1);
            assert_eq!(e.log_id, expected.log_id, "round {round}: entry {i}");
            assert_eq!(e.payload, expected.payload, "round {round}: entry {i}");
        }
    }
}

#[tokio::test]
async fn a_torn_final_record_is_detected_and_dropped() {
    let dir = tempfile::tempdir().expect("tempdir");
    {
        let store = LogStore::open(dir.path()).expect("open");
        for i in 1..=10 {
            store.append_durable(&[entry_at(i)]).expect("append");
        }
    }
    // Tear the last record: cut the newest WAL file a few bytes short, as a
    // crash in the middle of a write would.
    let mut files: Vec<_> = std::fs::read_dir(dir.path())
        .expect("list")
        .filter_map(|e| e.ok())
        .map(|e| e.path())
        .filter(|p| p.is_file())
        .collect();
    files.sort();
    let last = files.last().expect("a WAL file");
    let len = std::fs::metadata(last).expect("stat").len();
    let f = std::fs::OpenOptions::new()
        .write(true)
        .open(last)
        .expect("open WAL file");
    f.set_len(len - 5).expect("truncate");
    drop(f);

    let mut store = LogStore::open(dir.path()).expect("reopen a torn WAL");
    let entries = store.entries(0, u64::MAX).expect("read back");
    assert_eq!(entries.len(), 9, "the torn 10th record is dropped");
    for (i, e) in entries.iter().enumerate() {
        assert_eq!(e.payload, entry_at(i as u64 + 1).payload);
    }
    let state = store.get_log_state().await.expect("log state");
    assert_eq!(state.last_log_id.map(|l| l.index), Some(9));
    // And the log goes on from there.
    store
        .append_durable(&[entry_at(10)])
        .expect("append after recovery");
    assert_eq!(store.entries(0, u64::MAX).expect("read").len(), 10);
}
