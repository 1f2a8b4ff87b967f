//! Replay: rebuild `ClusterState` from a 1M-entry journal on disk (sled),
//! decoding every entry and applying it.
//!
//! And a snapshot of the state that builds: encoded and decoded in format
//! 8 (protobuf) and format 7 (postcard, the format before), with the sizes
//! printed.
//!
//! Run: `cargo bench -p keel-storage --bench replay`

use criterion::{criterion_group, criterion_main, Criterion, Throughput};
use keel_state::fixtures::mixed_entries;
use keel_state::Proposal;
use keel_storage::{Entry, StateMachineStore};
use openraft::storage::RaftStateMachine;
use openraft::{CommittedLeaderId, EntryPayload, LogId};

const ENTRIES: usize = 1_000_000;

fn replay_journal(c: &mut Criterion) {
    let dir = tempfile::tempdir().expect("tempdir");
    let rt = tokio::runtime::Runtime::new().expect("runtime");
    {
        let mut sm = StateMachineStore::open(dir.path()).expect("open");
        let entries = mixed_entries(ENTRIES, 32, 42);
        // Apply batches of 1 to 64 entries, as a live leader does, then
        // compact the journal behind a snapshot, as the server does.
        let mut rng = keel_state::fixtures::SplitMix64::new(7);
        rt.block_on(async {
            let mut next = 0usize;
            while next < entries.len() {
                let n = (1 + rng.below(64) as usize).min(entries.len() - next);
                let batch: Vec<Entry> = entries[next..next + n]
                    .iter()
                    .enumerate()
                    .map(|(i, e)| Entry {
                        log_id: LogId::new(CommittedLeaderId::new(1, 1), (next + i) as u64 + 1),
                        payload: EntryPayload::Normal(Proposal::new(vec![e.clone()])),
                    })
                    .collect();
                sm.apply(batch).await.expect("apply");
                next += n;
            }
        });
        sm.compact_journal(ENTRIES as u64).expect("compact");
        sm.flush().expect("flush");
    }
    let mut group = c.benchmark_group("replay");
    group.throughput(Throughput::Elements(ENTRIES as u64));
    group.sample_size(10);
    group.bench_function("journal_1m_entries", |b| {
        b.iter(|| {
            let summary = keel_storage::replay(dir.path(), None).expect("replay");
            assert_eq!(summary.entries, ENTRIES as u64);
            summary
        })
    });
    group.finish();
}

#[allow(clippy::print_stderr)] // The sizes, beside criterion's own report.
fn snapshot_formats(c: &mut Criterion) {
    use keel_storage::snapshot_codec::{decode_snapshot, encode_snapshot_as};
    let mut state = keel_state::ClusterState::new();
    for (i, e) in mixed_entries(200_000, 32, 42).iter().enumerate() {
        let _ = state.apply(i as u64 + 1, e);
    }
    let mut group = c.benchmark_group("snapshot");
    group.sample_size(10);
    for format in [8u32, 7] {
        let bytes = encode_snapshot_as(&state, format).expect("encodes");
        eprintln!(
            "snapshot format {format}: {} jobs, {} bytes",
            state.jobs().len(),
            bytes.len()
        );
        group.throughput(Throughput::Bytes(bytes.len() as u64));
        group.bench_function(format!("encode_format_{format}"), |b| {
            b.iter(|| encode_snapshot_as(&state, format).expect("encodes"))
        });
        group.bench_function(format!("decode_format_{format}"), |b| {
            b.iter(|| decode_snapshot(&bytes).expect("decodes"))
        });
    }
    group.finish();
}

criterion_group!(benches, replay_journal, snapshot_formats);
criterion_main!(benches);
