//! `ClusterState::apply` throughput on a recorded stream of mixed entries
//! (submissions, placements, worker starts, progress batches, finishes,
//! removals) over a 32-node, 256-GPU cluster; registering 5,000 nodes.
//!
//! Run: `cargo bench -p keel-state --bench apply`

use criterion::{criterion_group, criterion_main, BatchSize, Criterion, Throughput};
use keel_state::fixtures::{mixed_entries, mixed_entries_in_queues};
use keel_state::{ClusterState, Command, Gpu, LogEntry};

const ENTRIES: usize = 200_000;

fn apply_mixed_stream(c: &mut Criterion) {
    let entries = mixed_entries(ENTRIES, 32, 42);
    let mut group = c.benchmark_group("apply");
    group.throughput(Throughput::Elements(ENTRIES as u64));
    group.sample_size(20);
    group.bench_function("mixed_stream_200k", |b| {
        b.iter_batched(
            ClusterState::new,
            |mut state| {
                for (i, e) in entries.iter().enumerate() {
                    let _ = std::hint::black_box(state.apply(i as u64 + 1, e));
                }
                state
            },
            BatchSize::LargeInput,
        )
    });
    // The same stream with 50 queues defined (issue 23: within 10 %).
    let queued = mixed_entries_in_queues(ENTRIES, 32, 42, 50);
    group.bench_function("mixed_stream_200k_50_queues", |b| {
        b.iter_batched(
            ClusterState::new,
            |mut state| {
                for (i, e) in queued.iter().enumerate() {
                    let _ = std::hint::black_box(state.apply(i as u64 + 1, e));
                }
                state
            },
            BatchSize::LargeInput,
        )
    });
    group.finish();

    // Registering 5,000 nodes of 8 GPUs, the free-GPU index read every
    // 100 (as a scheduler would): each node's change sets only its own
    // part of the GPU indexes (issue 26's scale).
    let register: Vec<LogEntry> = (0..5_000u32)
        .map(|n| {
            LogEntry::new(
                1,
                Command::register_node(
                    format!("node-{n}"),
                    "10.0.0.1:7070",
                    (0..8)
                        .map(|index| Gpu {
                            index,
                            gpu_type: "v100".into(),
                        })
                        .collect(),
                ),
            )
        })
        .collect();
    let mut group = c.benchmark_group("nodes");
    group.sample_size(10);
    group.bench_function("register_5000_nodes", |b| {
        b.iter_batched(
            ClusterState::new,
            |mut state| {
                for (i, e) in register.iter().enumerate() {
                    let _ = std::hint::black_box(state.apply(i as u64 + 1, e));
                    if i % 100 == 0 {
                        std::hint::black_box(state.free_gpus().total());
                    }
                }
                state
            },
            BatchSize::LargeInput,
        )
    });
    group.finish();

    let mut state = ClusterState::new();
    for (i, e) in entries.iter().enumerate() {
        let _ = state.apply(i as u64 + 1, e);
    }
    let mut group = c.benchmark_group("state_hash");
    group.sample_size(20);
    group.bench_function(format!("{}_jobs", state.jobs().len()), |b| {
        b.iter(|| std::hint::black_box(state.state_hash()))
    });
    // What a snapshot costs while the state's lock is held: a copy of the
    // state, or its conversion to the snapshot's protobuf message, or both
    // and the encoding.
    group.bench_function("clone", |b| b.iter(|| std::hint::black_box(state.clone())));
    group.bench_function("to_snapshot_proto", |b| {
        b.iter(|| std::hint::black_box(state.to_snapshot_proto()))
    });
    group.bench_function("to_snapshot_proto_encoded", |b| {
        b.iter(|| {
            use prost::Message;
            std::hint::black_box(state.to_snapshot_proto().encode_to_vec())
        })
    });
    group.finish();
}

criterion_group!(benches, apply_mixed_stream);
criterion_main!(benches);
