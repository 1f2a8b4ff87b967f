//! The state machine's apply with span export on and off (issue 24's
//! overhead figure), in the same run and the same store.
//!
//! 240,000 entries of a busy cluster (`mixed_entries`, 32 nodes), every
//! hundredth in a sampled trace of its own (as 1 % of the writes are at
//! `--trace-sample-ratio 0.01`), applied through `StateMachineStore::apply`
//! in batches of 1 to 64, as a live replica does (journal on sled
//! included), in chunks of 5,000 entries taken in turn by three modes
//! (the state's growth falls on each alike):
//!
//! - off: no span export (no layer wants the trace's spans: the field is
//!   carried and nothing else happens);
//! - to a collector: the server's export (`keel::traces::TraceExport`,
//!   OTLP/gRPC, batches of 512) to a collector in this process, whose
//!   decoding shares the machine's cores; each traced entry opens its
//!   `keel.apply` span (and a traced job's first progress its own);
//! - to nowhere: the same export to a port where nothing listens: the
//!   spans are built and batched, and dropped at their export.
//!
//! Run: `cargo bench -p keel --bench traced_apply`
//! (`KEEL_BENCH_ENTRIES` sets the number of entries; `KEEL_BENCH_MODE=off`,
//! `collector` or `nowhere` applies every chunk in one mode, for an
//! instruction count of the applying thread:
//! `KEEL_BENCH_MODE=off valgrind --tool=callgrind
//! --toggle-collect='traced_apply::apply_chunk' target/release/deps/traced_apply-* --bench`.)

#![allow(clippy::print_stdout)]

use std::time::Instant;

use keel_state::fixtures::{mixed_entries, SplitMix64};
use keel_state::{LogEntry, Proposal};
use keel_storage::{Entry, StateMachineStore};
use openraft::storage::RaftStateMachine;
use openraft::{CommittedLeaderId, EntryPayload, LogId};

#[path = "../tests/support/otlp.rs"]
mod otlp;

/// `KEEL_BENCH_ENTRIES` overrides.
const ENTRIES: usize = 240_000;

/// Entries in one chunk of one mode.
const CHUNK: usize = 5_000;

/// Applies `entries` from `first` (their log index is their position + 1)
/// into `sm`; the time it took.
#[inline(never)]
fn apply_chunk(
    rt: &tokio::runtime::Runtime,
    sm: &mut StateMachineStore,
    entries: &[LogEntry],
    first: usize,
    rng: &mut SplitMix64,
) -> std::time::Duration {
    let started = Instant::now();
    rt.block_on(async {
        let mut next = 0usize;
        while next < entries.len() {
            let n = (1 + rng.below(64) as usize).min(entries.len() - next);
            let batch: Vec<Entry> = entries[next..next + n]
                .iter()
                .enumerate()
                .map(|(i, e)| Entry {
                    log_id: LogId::new(CommittedLeaderId::new(1, 1), (first + next + i) as u64 + 1),
                    payload: EntryPayload::Normal(Proposal::new(vec![e.clone()])),
                })
                .collect();
            sm.apply(batch).await.expect("apply");
            next += n;
        }
    });
    started.elapsed()
}

/// Which export a chunk is applied under.
#[derive(Clone, Copy)]
enum Mode {
    Off,
    ToCollector,
    ToNowhere,
}

/// Each mode twice in six chunks, in an order that puts each as often
/// before as after the others.
const ORDER: [Mode; 6] = [
    Mode::Off,
    Mode::ToCollector,
    Mode::ToNowhere,
    Mode::ToNowhere,
    Mode::ToCollector,
    Mode::Off,
];

fn main() {
    let rt = tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
        .expect("runtime");
    let entries = std::env::var("KEEL_BENCH_ENTRIES")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(ENTRIES);
    let mut stream = mixed_entries(entries, 32, 42);
    for (i, e) in stream.iter_mut().enumerate().filter(|(i, _)| i % 100 == 0) {
        e.trace_parent = Some(format!("00-{:032x}-{:016x}-01", i + 1, i + 1));
    }
    let collector = otlp::Collector::start();
    // The server's export, to the collector and to a port where nothing
    // listens (spans built, batched and dropped at their export).
    let export_to = |endpoint: String| {
        let (export, layer) = rt
            .block_on(async {
                keel::traces::TraceExport::start(
                    &endpoint,
                    keel::traces::Sampling::ratio(0.01)?,
                    "bench",
                )
            })
            .expect("the span export");
        let subscriber = {
            use tracing_subscriber::layer::SubscriberExt;
            tracing_subscriber::registry().with(layer)
        };
        (export, tracing::Dispatch::new(subscriber))
    };
    let (to_collector, collecting) = export_to(collector.endpoint.clone());
    let (to_nowhere, dropping) = export_to("http://127.0.0.1:1".to_string());
    // Two dispatchers or more: a call site's interest is asked of each
    // when it is first hit (with one alone, tracing asks the default at
    // that moment, and a span first hit in an "off" chunk would stay off).
    let dir = tempfile::tempdir().expect("tempdir");
    let mut sm = StateMachineStore::open(dir.path()).expect("open");
    let mut rng = SplitMix64::new(7);
    let mut took = [std::time::Duration::ZERO; 3];
    let mut applied = [0usize; 3];
    let only = match std::env::var("KEEL_BENCH_MODE").as_deref() {
        Ok("off") => Some(Mode::Off),
        Ok("collector") => Some(Mode::ToCollector),
        Ok("nowhere") => Some(Mode::ToNowhere),
        _ => None,
    };
    for (n, chunk) in stream.chunks(CHUNK).enumerate() {
        let first = n * CHUNK;
        let mode = only.unwrap_or(ORDER[n % ORDER.len()]);
        let mut apply = || apply_chunk(&rt, &mut sm, chunk, first, &mut rng);
        took[mode as usize] += match mode {
            Mode::Off => apply(),
            Mode::ToCollector => tracing::dispatcher::with_default(&collecting, apply),
            Mode::ToNowhere => tracing::dispatcher::with_default(&dropping, apply),
        };
        applied[mode as usize] += chunk.len();
    }
    sm.flush().expect("flush");
    rt.block_on(to_collector.shutdown());
    rt.block_on(to_nowhere.shutdown());
    let rate = |m: Mode| applied[m as usize] as f64 / took[m as usize].as_secs_f64();
    if only.is_some() {
        println!(
            "{} entries applied in one mode",
            applied.iter().sum::<usize>()
        );
        return;
    }
    let off = rate(Mode::Off);
    println!("| apply, {entries} entries in chunks of {CHUNK} | entries/s | against off |");
    println!("|---|---:|---:|");
    println!("| span export off | {off:.0} | |");
    for (what, mode) in [
        (
            "export to a collector in this process, 1 % traced",
            Mode::ToCollector,
        ),
        (
            "export to nowhere (spans built and batched), 1 % traced",
            Mode::ToNowhere,
        ),
    ] {
        println!(
            "| {what} | {:.0} | {:+.1} % |",
            rate(mode),
            (rate(mode) / off - 1.0) * 100.0
        );
    }
    println!("{} spans received by the collector", collector.count());
}
