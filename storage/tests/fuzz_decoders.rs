//! Fuzz targets for every decoder of bytes that cross a process or reach
//! a disk (issue 22, item 5), on stable Rust with proptest: log entries
//! and proposals, WAL payloads, journal pages, snapshots, and each Raft
//! message in both wire formats. Each is fed arbitrary bytes and mutations
//! of its golden fixtures (`tests/fixtures/golden`: bytes flipped,
//! truncated, spliced), and must answer with a value or an error: no
//! panic, no allocation beyond what the input's length allows (prost and
//! postcard size what they allocate by the bytes present).
//!
//! `KEEL_FUZZ_CASES` sets the inputs per target (default 2,000, about a
//! second each in CI); BENCHMARKS.md records a long local run. A failing
//! input is kept by proptest in `proptest-regressions/`, which is
//! committed.

use std::path::Path;

use keel_state::fixtures::{mutate, Mutation};
use keel_storage::raft_wire::WireMessage;
use keel_storage::TypeConfig;
use openraft::error::{InstallSnapshotError, RaftError};
use openraft::raft::{
    AppendEntriesRequest, AppendEntriesResponse, InstallSnapshotRequest, InstallSnapshotResponse,
    VoteRequest, VoteResponse,
};
use proptest::prelude::*;

/// The golden fixtures whose names start with `prefix`.
fn golden(prefix: &str) -> Vec<Vec<u8>> {
    let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/golden");
    let mut files: Vec<_> = std::fs::read_dir(&dir)
        .expect("the golden fixtures")
        .map(|e| e.expect("entry").path())
        .filter(|p| {
            p.file_name()
                .and_then(|n| n.to_str())
                .is_some_and(|n| n.starts_with(prefix) && n.ends_with(".bin"))
        })
        .collect();
    files.sort();
    let seeds: Vec<Vec<u8>> = files
        .iter()
        .map(|p| std::fs::read(p).expect("read"))
        .collect();
    assert!(!seeds.is_empty(), "golden fixtures named {prefix}*");
    seeds
}

/// Inputs for a decoder: arbitrary bytes, or a golden seed mutated.
fn inputs(seeds: Vec<Vec<u8>>) -> impl Strategy<Value = Vec<u8>> {
    let count = seeds.len();
    prop_oneof![
        prop::collection::vec(any::<u8>(), 0..2048),
        (0..count, prop::collection::vec(any::<Mutation>(), 1..6))
            .prop_map(move |(i, m)| mutate(&seeds[i], &m)),
    ]
}

fn config() -> ProptestConfig {
    ProptestConfig {
        cases: keel_state::fixtures::fuzz_cases(),
        // Inputs are cheap: keep shrinking short.
        max_shrink_iters: 2_000,
        ..ProptestConfig::default()
    }
}

proptest! {
    #![proptest_config(config())]

    #[test]
    fn an_entry_decodes_or_is_refused(bytes in inputs(golden("entry-"))) {
        let _ = keel_state::codec::decode_entry(&bytes);
    }

    #[test]
    fn a_proposal_decodes_or_is_refused(bytes in inputs(golden("proposal"))) {
        let _ = keel_state::codec::decode_proposal(&bytes);
    }

    #[test]
    fn a_wal_payload_decodes_or_is_refused(bytes in inputs(golden("wal-"))) {
        let _ = keel_storage::wal_codec::decode_payload(1, &bytes);
    }

    #[test]
    fn a_journal_page_decodes_or_is_refused(bytes in inputs(golden("journal-"))) {
        let _ = keel_storage::journal_codec::decode_page_entries(1, &bytes);
    }

    #[test]
    fn a_snapshot_decodes_or_is_refused(bytes in inputs(golden("snapshot-"))) {
        let _ = keel_storage::snapshot_codec::decode_snapshot(&bytes);
    }

    #[test]
    fn raft_records_of_the_state_store_decode_or_are_refused(bytes in inputs(golden("meta-"))) {
        let _ = keel_storage::meta_codec::decode_last_applied(&bytes);
        let _ = keel_storage::meta_codec::decode_membership(&bytes);
        let _ = keel_storage::meta_codec::decode_snapshot_meta(&bytes);
    }

    #[test]
    fn every_raft_message_decodes_or_is_refused(
        bytes in inputs(golden("raft-")),
        format in 0u32..4,
    ) {
        let _ = AppendEntriesRequest::<TypeConfig>::decode(&bytes, format);
        let _ = VoteRequest::<u64>::decode(&bytes, format);
        let _ = InstallSnapshotRequest::<TypeConfig>::decode(&bytes, format);
        let _ = Result::<AppendEntriesResponse<u64>, RaftError<u64>>::decode(&bytes, format);
        let _ = Result::<VoteResponse<u64>, RaftError<u64>>::decode(&bytes, format);
        let _ = Result::<
            InstallSnapshotResponse<u64>,
            RaftError<u64, InstallSnapshotError>,
        >::decode(&bytes, format);
    }
}

/// The mutations reach the seeds' decoders: a golden entry decodes, and
/// one byte of its command changed either decodes to another value or is
/// refused (the target is not only feeding garbage to the first check).
#[test]
fn the_seeds_decode_and_their_mutations_reach_the_decoder() {
    let seeds = golden("entry-");
    for seed in &seeds {
        assert!(keel_state::codec::decode_entry(seed).is_ok());
    }
    let changed = mutate(&seeds[0], &[(0, seeds[0].len() - 1, 0, 0xff)]);
    assert_ne!(changed, seeds[0]);
    assert_ne!(
        keel_state::codec::decode_entry(&changed).ok(),
        keel_state::codec::decode_entry(&seeds[0]).ok()
    );
}
