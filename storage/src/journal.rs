//! The audit journal: every applied Keel entry, never purged.
//!
//! Entries are stored in pages (`e` + first index → protobuf
//! `JournalPage`). Commands proposed together share their Raft index. `apply` writes one page per batch it applies, in the same
//! atomic sled batch as the rest of its writes. Reading a million tiny sled
//! values costs more than applying them, so [`compact`] merges runs of small
//! pages behind a snapshot into pages of about [`PAGE_TARGET_ENTRIES`]: the
//! content and order never change, only how many sled values hold them. A
//! merge puts the pages' bytes one after the other (protobuf appends
//! repeated fields), and each compaction starts where the last one left
//! only settled pages behind it, so one costs the bytes written since the
//! last, decoding no entry.

use keel_proto::entry as pb;
use keel_state::codec::{entry_from_proto, entry_to_proto};
use keel_state::log_time::earlier_than_before;
use keel_state::{ClusterState, LogEntry};
use prost::Message;

use crate::replay::ReplayError;
use crate::state_machine::{index_of, key};

pub(crate) const PREFIX_PAGE: u8 = b'e';
/// Compaction merges pages until they hold about this many entries.
pub(crate) const PAGE_TARGET_ENTRIES: usize = 1024;

/// The page for one apply batch.
#[derive(Debug, Default)]
pub(crate) struct PageBuilder {
    page: pb::JournalPage,
}

impl PageBuilder {
    pub(crate) fn push(&mut self, index: u64, entry: &LogEntry) {
        self.page.indexes.push(index);
        self.page.entries.push(entry_to_proto(entry));
    }

    /// The key and value to store, if the batch held any Keel entry.
    pub(crate) fn finish(self) -> Option<([u8; 9], Vec<u8>)> {
        let first = *self.page.indexes.first()?;
        Some((key(PREFIX_PAGE, first), self.page.encode_to_vec()))
    }
}

/// Encodes a journal page of `(index, entry)` pairs, as `apply` writes one.
pub fn encode_page(entries: &[(u64, LogEntry)]) -> Vec<u8> {
    let mut page = PageBuilder::default();
    for (index, entry) in entries {
        page.push(*index, entry);
    }
    page.page.encode_to_vec()
}

/// Decodes a journal page (its first index `first` named in errors).
pub fn decode_page_entries(first: u64, bytes: &[u8]) -> Result<Vec<(u64, LogEntry)>, ReplayError> {
    decode_page(first, bytes)?
        .into_iter()
        .map(|(index, e)| {
            entry_from_proto(e)
                .map(|e| (index, e))
                .map_err(|source| ReplayError::Decode { index, source })
        })
        .collect()
}

fn decode_page(first: u64, bytes: &[u8]) -> Result<Vec<(u64, pb::LogEntry)>, ReplayError> {
    let page = pb::JournalPage::decode(bytes).map_err(|e| ReplayError::Decode {
        index: first,
        source: keel_state::codec::DecodeError::Protobuf(e.to_string()),
    })?;
    if page.indexes.len() != page.entries.len() {
        return Err(ReplayError::Read(format!(
            "journal page at {first} has {} indexes for {} entries",
            page.indexes.len(),
            page.entries.len()
        )));
    }
    Ok(page.indexes.into_iter().zip(page.entries).collect())
}

/// What [`apply_journal`] did.
#[derive(Debug, Default)]
pub(crate) struct JournalApplied {
    pub(crate) entries: u64,
    pub(crate) refused: u64,
    pub(crate) last_index: Option<u64>,
    /// With `check`: the first index after which
    /// [`ClusterState::check_invariants`] failed, and how.
    pub(crate) first_violation: Option<(u64, String)>,
}

type DecodedPage = Result<Vec<(u64, pb::LogEntry)>, ReplayError>;

/// Sends the decoded entries with index in `from..=until`, page by page.
fn read_pages(
    tree: &sled::Tree,
    from: u64,
    until: u64,
    tx: &std::sync::mpsc::SyncSender<DecodedPage>,
) -> Result<(), ReplayError> {
    let read = |e: sled::Error| ReplayError::Read(e.to_string());
    // The page holding `from` may start before it.
    let start = tree
        .range(key(PREFIX_PAGE, 0)..=key(PREFIX_PAGE, from))
        .next_back()
        .transpose()
        .map_err(read)?
        .and_then(|(k, _)| index_of(&k))
        .unwrap_or(from);
    for item in tree.range(key(PREFIX_PAGE, start)..=key(PREFIX_PAGE, until)) {
        let (k, v) = item.map_err(read)?;
        let first =
            index_of(&k).ok_or_else(|| ReplayError::Read("malformed journal key".into()))?;
        let mut entries = decode_page(first, &v)?;
        entries.retain(|(i, _)| *i >= from && *i <= until);
        if tx.send(Ok(entries)).is_err() {
            break; // the applier stopped
        }
    }
    Ok(())
}

/// The first index the journal holds (0: none).
pub(crate) fn first_index(tree: &sled::Tree) -> Result<u64, sled::Error> {
    let Some(item) = tree
        .range(key(PREFIX_PAGE, 0)..=key(PREFIX_PAGE, u64::MAX))
        .next()
    else {
        return Ok(0);
    };
    let (k, _) = item?;
    Ok(index_of(&k).unwrap_or(0))
}

/// Calls `each` with the journal entries with index in `from..=until`, in
/// index order, decoded; returns the last index read (0: none). One
/// thread reads pages and decodes their protobuf while this one converts
/// the entries and runs `each` (for a replay the work splits about evenly
/// over two cores).
pub(crate) fn for_each_entry<E: From<ReplayError>>(
    tree: &sled::Tree,
    from: u64,
    until: u64,
    each: &mut dyn FnMut(u64, LogEntry) -> Result<(), E>,
) -> Result<u64, E> {
    let mut last = 0;
    std::thread::scope(|scope| -> Result<u64, E> {
        // Bounded: the reader runs at most a few pages ahead.
        let (tx, rx) = std::sync::mpsc::sync_channel(16);
        scope.spawn(move || {
            if let Err(e) = read_pages(tree, from, until, &tx) {
                let _ = tx.send(Err(e));
            }
        });
        for page in rx {
            for (index, entry) in page? {
                let entry = entry_from_proto(entry)
                    .map_err(|source| ReplayError::Decode { index, source })?;
                each(index, entry)?;
                last = index;
            }
        }
        Ok(last)
    })
}

/// What a replay calls with each journaled entry before applying it: its
/// index, the entry, and the state it is applied to.
pub type Visitor<'a> = &'a mut dyn FnMut(u64, &LogEntry, &ClusterState);

/// Applies the journal entries with index in `from..=until` to `state`, in
/// index order ([`for_each_entry`]); the result is that of a plain loop.
pub(crate) fn apply_journal(
    tree: &sled::Tree,
    state: &mut ClusterState,
    from: u64,
    until: u64,
    check: bool,
    mut visit: Option<Visitor<'_>>,
) -> Result<JournalApplied, ReplayError> {
    let mut out = JournalApplied::default();
    for_each_entry(tree, from, until, &mut |index,
                                            entry|
     -> Result<(), ReplayError> {
        if let Some(visit) = visit.as_mut() {
            visit(index, &entry, state);
        }
        let backwards = check
            .then(|| earlier_than_before(state.last_entry_at_ms(), entry.at_ms))
            .flatten();
        if state.apply(index, &entry).is_err() {
            out.refused += 1;
        }
        if check && out.first_violation.is_none() {
            if let Some(backwards) = backwards {
                out.first_violation = Some((index, backwards));
            } else if let Err(broken) = state.check_invariants() {
                out.first_violation = Some((index, broken));
            }
        }
        out.entries += 1;
        out.last_index = Some(index);
        Ok(())
    })?;
    Ok(out)
}

/// What one [`compact`] did.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Compacted {
    /// How many pages were merged away.
    pub(crate) merged_away: usize,
    /// Where the next compaction may start: every page that begins below
    /// it is settled (full, or a small page a full one follows, which no
    /// later compaction merges either).
    pub(crate) settled_below: u64,
}

/// Merges runs of pages that lie wholly at or below `upto` into pages of
/// about [`PAGE_TARGET_ENTRIES`]. Each merge is one atomic sled batch (the
/// merged page replaces its parts), so a crash mid-way leaves a valid journal.
/// Pages that begin below `from` are not read: a compaction costs the pages
/// written since the last one's [`Compacted::settled_below`], not the whole
/// journal (which is never purged). Any `from` at or below that bound gives
/// the same journal; one above it only leaves small pages unmerged.
pub(crate) fn compact(tree: &sled::Tree, from: u64, upto: u64) -> Result<Compacted, sled::Error> {
    let mut merged_away = 0;
    let mut settled_below = from;
    // A run's pages: (first index, the page's bytes).
    let mut run: Vec<(u64, sled::IVec)> = Vec::new();
    let mut run_entries = 0;
    // Two encoded `JournalPage`s one after the other are the encoding of
    // the page holding both's indexes and entries, in order (protobuf
    // appends repeated fields), so a merge copies bytes and decodes no
    // entry.
    let flush = |run: &mut Vec<(u64, sled::IVec)>| -> Result<(), sled::Error> {
        if run.len() < 2 {
            run.clear();
            return Ok(());
        }
        let first = run[0].0;
        let mut merged = Vec::with_capacity(run.iter().map(|(_, v)| v.len()).sum());
        let mut batch = sled::Batch::default();
        for (k, page) in run.drain(..) {
            merged.extend_from_slice(&page);
            if k != first {
                batch.remove(&key(PREFIX_PAGE, k)[..]);
            }
        }
        batch.insert(&key(PREFIX_PAGE, first)[..], merged);
        tree.apply_batch(batch)
    };
    if upto < from {
        return Ok(Compacted {
            merged_away,
            settled_below,
        });
    }
    // Read before any merge writes (the values are shared buffers).
    let pages = tree
        .range(key(PREFIX_PAGE, from)..=key(PREFIX_PAGE, upto))
        .collect::<Result<Vec<_>, _>>()?;
    for (k, v) in pages {
        let (Some(first), Ok(page)) = (index_of(&k), PageIndexes::decode(v.as_ref())) else {
            continue;
        };
        // Only pages wholly behind `upto`; and full pages stay as they are.
        let Some(&last) = page.indexes.last().filter(|l| **l <= upto) else {
            break;
        };
        if page.indexes.len() >= PAGE_TARGET_ENTRIES {
            let n = run.len();
            flush(&mut run)?;
            merged_away += n.saturating_sub(1);
            run_entries = 0;
            settled_below = last + 1;
            continue;
        }
        run_entries += page.indexes.len();
        run.push((first, v));
        if run_entries >= PAGE_TARGET_ENTRIES {
            let n = run.len();
            flush(&mut run)?;
            merged_away += n.saturating_sub(1);
            run_entries = 0;
            settled_below = last + 1;
        }
    }
    // What is left merges into one page short of the target: the next
    // compaction starts from it.
    if let Some((first, _)) = run.first() {
        settled_below = *first;
    }
    let n = run.len();
    flush(&mut run)?;
    merged_away += n.saturating_sub(1);
    Ok(Compacted {
        merged_away,
        settled_below,
    })
}

/// A `JournalPage`'s indexes alone (its field 1): decoding one skips the
/// entries' bytes, so compaction counts a page's entries without decoding
/// them.
#[derive(Clone, PartialEq, prost::Message)]
struct PageIndexes {
    #[prost(uint64, repeated, tag = "1")]
    indexes: Vec<u64>,
}

#[cfg(test)]
mod tests {
    use super::*;

    fn entries() -> Vec<LogEntry> {
        keel_state::fixtures::mixed_entries(64, 4, 5)
    }

    /// The entry written at `index`.
    fn entry_at(entries: &[LogEntry], index: u64) -> &LogEntry {
        &entries[index as usize % entries.len()]
    }

    /// Pages of 1 to 5 entries, with a full one (past the target) every
    /// 37th; returns the last index written.
    fn write_pages(tree: &sled::Tree, pages: usize) -> u64 {
        let entries = entries();
        let mut index = 0u64;
        for p in 0..pages {
            let size = if p % 37 == 36 {
                PAGE_TARGET_ENTRIES + 76
            } else {
                1 + p % 5
            };
            let mut page = PageBuilder::default();
            for _ in 0..size {
                index += 1;
                page.push(index, entry_at(&entries, index));
            }
            let (k, v) = page.finish().expect("a page");
            tree.insert(k, v).expect("insert");
        }
        index
    }

    fn contents(tree: &sled::Tree) -> Vec<(Vec<u8>, Vec<u8>)> {
        tree.iter()
            .map(|kv| kv.expect("read"))
            .map(|(k, v)| (k.to_vec(), v.to_vec()))
            .collect()
    }

    /// Compacting from where the last compaction settled gives the very
    /// pages a compaction of the whole journal gives, step after step,
    /// while reading ever less of it.
    #[test]
    fn a_compaction_from_the_settled_bound_equals_one_of_the_whole_journal() {
        let db = sled::Config::new().temporary(true).open().expect("sled");
        let whole = db.open_tree("whole").expect("tree");
        let resumed = db.open_tree("resumed").expect("tree");
        let last = write_pages(&whole, 600);
        assert_eq!(write_pages(&resumed, 600), last);
        let mut from = 0;
        let mut bounds = Vec::new();
        for upto in [7, 300, 2_500, 2_501, last / 2, last - 3, last] {
            let a = compact(&whole, 0, upto).expect("compact the whole");
            let b = compact(&resumed, from, upto).expect("compact from the bound");
            assert_eq!(a.merged_away, b.merged_away, "at {upto}");
            assert_eq!(contents(&whole), contents(&resumed), "at {upto}");
            assert!(b.settled_below >= from && b.settled_below <= upto + 1);
            from = b.settled_below;
            bounds.push(from);
        }
        // The bound moved through the journal: each compaction after the
        // first read only the pages past it.
        assert!(bounds.windows(2).all(|w| w[0] <= w[1]), "{bounds:?}");
        assert!(bounds[bounds.len() - 2] > last / 2, "{bounds:?}");
        // Nothing left to merge behind the last bound.
        assert_eq!(compact(&whole, 0, last).expect("again").merged_away, 0);
        // The merged pages (bytes put one after the other) decode to every
        // entry once, in order, each beside its index.
        let entries = entries();
        let mut seen = Vec::new();
        for kv in whole.iter() {
            let (_, v) = kv.expect("read");
            let page = pb::JournalPage::decode(v.as_ref()).expect("page");
            assert_eq!(page.indexes.len(), page.entries.len());
            for (index, entry) in page.indexes.iter().zip(&page.entries) {
                assert_eq!(
                    entry,
                    &entry_to_proto(entry_at(&entries, *index)),
                    "{index}"
                );
            }
            seen.extend(page.indexes);
        }
        assert_eq!(seen, (1..=last).collect::<Vec<_>>());
        assert!(whole.len() < 200, "{} pages", whole.len());
    }
}
