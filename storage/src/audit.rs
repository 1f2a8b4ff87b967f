//! The tamper-evident audit export (issue 27, item 4): every entry a data
//! directory holds, as JSON lines chained by hashes, and the check that
//! replays one.
//!
//! An export is three kinds of line, each a JSON object tagged `record`:
//!
//! - one `header`: the format, the index the entries follow and the hash of
//!   the state after it (with that state itself, as a protobuf snapshot in
//!   base64, when it is not the empty one);
//! - an `entry` per log entry, in log order: index, term (while the Raft
//!   log still holds it), time, actor, request id, the command (readable
//!   JSON, and the protobuf bytes a verifier replays), its outcome (events,
//!   or why it was refused), the state hash after applying it, and `prev`:
//!   the BLAKE3 hash of the line before, byte for byte;
//! - one `end`: how many entries, `prev`, and a seal over both. A cut
//!   export has none.
//!
//! [`verify`] rebuilds the state from the header and applies each entry's
//! bytes, checking every field of every line against what the replay and
//! the line before say, and names the first index where they disagree.
//! The hash of the last line ([`AuditSummary::last_line_hash`]), kept
//! apart from the file, pins the whole export.
//!
//! The log holds no secret in the clear (only sealed values and
//! references), so neither does an export.

use std::io::{BufRead, Write};

use base64::Engine;
use keel_state::codec::{entry_from_proto, entry_to_proto};
use keel_state::{ClusterState, LogEntry};
use prost::Message;
use serde::{Deserialize, Serialize};

use crate::replay::{ReplayError, Until};

/// The export's format; [`verify`] reads this one.
pub const AUDIT_FORMAT: u32 = 1;

#[derive(Debug, thiserror::Error)]
pub enum AuditError {
    #[error(transparent)]
    Replay(#[from] ReplayError),
    #[error("cannot write the export: {0}")]
    Write(std::io::Error),
    #[error("cannot read the export: {0}")]
    Read(std::io::Error),
    /// The first index asked for is past the last one the export would
    /// write: it would hold no entry.
    #[error("--from {from} is past the last entry to export ({last}): the export would hold none")]
    EmptyRange { from: u64, last: u64 },
    /// The export and its replay disagree: the first place they do.
    #[error("{}: {what}", match index { Some(i) => format!("index {i} (line {line})"), None => format!("line {line}") })]
    Disagrees {
        /// The log index of the line, when it names one.
        index: Option<u64>,
        /// The line, counted from 1.
        line: u64,
        what: String,
    },
}

/// One line of an export.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
// Lines are made and read one at a time; the entry, the common one, is
// the large one.
#[allow(clippy::large_enum_variant)]
#[serde(tag = "record", rename_all = "snake_case", deny_unknown_fields)]
enum Line {
    Header {
        keel_audit: u32,
        /// The entries follow the state after this index (0: the start).
        after_index: u64,
        state_hash: String,
        /// That state as a protobuf snapshot, base64; absent for the
        /// empty state.
        snapshot: Option<String>,
    },
    Entry {
        index: u64,
        /// Absent once the Raft log no longer holds the entry (the
        /// journal keeps entries, not terms).
        term: Option<u64>,
        at_ms: u64,
        /// `at_ms` in RFC 3339, for reading.
        time: String,
        actor: Option<String>,
        request_id: Option<String>,
        /// The command's kind and the command, for reading.
        kind: String,
        command: serde_json::Value,
        /// The entry as the log holds it (protobuf, base64): what a
        /// verifier replays.
        entry: String,
        outcome: Outcome,
        /// The state's hash after the entry.
        state_hash: String,
        prev: String,
    },
    End {
        entries: u64,
        prev: String,
        /// The hash of the two fields above ([`end_seal`]): as no line
        /// follows this one, it tells a change to this line from a change
        /// to the line before.
        seal: String,
    },
}

fn end_seal(entries: u64, prev: &str) -> String {
    line_hash(&format!("end {entries} {prev}"))
}

/// What applying an entry did.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case", deny_unknown_fields)]
enum Outcome {
    Events(serde_json::Value),
    Refused(String),
}

impl Outcome {
    fn of(result: &Result<Vec<keel_state::Event>, keel_state::ApplyError>) -> Outcome {
        match result {
            Ok(events) => Outcome::Events(serde_json::to_value(events).unwrap_or_default()),
            Err(e) => Outcome::Refused(e.to_string()),
        }
    }
}

/// What an export wrote or a verification read.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct AuditSummary {
    pub entries: u64,
    /// The index the entries follow, and the last one.
    pub after_index: u64,
    pub last_index: u64,
    pub state_hash: String,
    /// The BLAKE3 hash of the export's last line (hex): keep it apart from
    /// the file to pin it.
    pub last_line_hash: String,
}

fn line_hash(line: &str) -> String {
    blake3::hash(line.as_bytes()).to_hex().to_string()
}

fn rfc3339(at_ms: u64) -> String {
    let time = std::time::UNIX_EPOCH + std::time::Duration::from_millis(at_ms);
    humantime::format_rfc3339_millis(time).to_string()
}

/// The readable form of an entry's command.
fn command_json(entry: &LogEntry) -> serde_json::Value {
    serde_json::to_value(&entry.command).unwrap_or_default()
}

/// Writes lines, each chained to the one before; the header only once
/// another line follows it, so that an export refused for holding no
/// entry has written nothing.
struct Chain<'w> {
    out: &'w mut dyn Write,
    prev: String,
    header: Option<Line>,
}

impl Chain<'_> {
    /// Writes the header if it is not written yet: before the line after
    /// it is made, which links to it.
    fn start(&mut self) -> Result<(), AuditError> {
        match self.header.take() {
            Some(header) => self.write(&header),
            None => Ok(()),
        }
    }

    fn write(&mut self, line: &Line) -> Result<(), AuditError> {
        let text =
            serde_json::to_string(line).map_err(|e| AuditError::Write(std::io::Error::other(e)))?;
        writeln!(self.out, "{text}").map_err(AuditError::Write)?;
        self.prev = line_hash(&text);
        Ok(())
    }
}

/// Exports the entries of data directory `dir` after index `after` up to
/// `until` (the journal's, then the committed ones the Raft log holds
/// past it) to `out`. A range that would hold no entry (`after`, when
/// given, at or past the last index `until` names) is refused before
/// anything is written.
pub fn export(
    dir: &crate::DataDir,
    after: u64,
    until: Until,
    out: &mut dyn Write,
) -> Result<AuditSummary, AuditError> {
    let state_dir = dir.state_dir();
    let until_index = crate::replay::index_of_until(&state_dir, until)?;
    let asked_after = after;
    if asked_after > 0 && asked_after >= until_index {
        return Err(AuditError::EmptyRange {
            from: asked_after + 1,
            last: until_index,
        });
    }
    // The journal starts after the first snapshot a replica installed, if
    // it did: the entries then follow that snapshot's state.
    let after = after.max(crate::replay::journal_start(&state_dir)?.saturating_sub(1));
    let base = crate::replay::replay_until(&state_dir, Until::Index(after))?;
    let mut state = base.state;
    let after = state.last_index().max(after.min(until_index));
    let snapshot = (state.state_hash() != ClusterState::new().state_hash()).then(|| {
        base64::engine::general_purpose::STANDARD.encode(state.to_snapshot_proto().encode_to_vec())
    });
    let mut chain = Chain {
        out,
        prev: String::new(),
        header: Some(Line::Header {
            keel_audit: AUDIT_FORMAT,
            after_index: after,
            state_hash: state.state_hash().to_string(),
            snapshot,
        }),
    };
    let mut entries = 0u64;
    let mut last_index = after;
    let mut write_entry = |index: u64, entry: &LogEntry, term: Option<u64>| {
        chain.start()?;
        let outcome = Outcome::of(&state.apply(index, entry));
        let line = Line::Entry {
            index,
            term,
            at_ms: entry.at_ms,
            time: rfc3339(entry.at_ms),
            actor: entry.actor.clone(),
            request_id: entry.request_id.clone(),
            kind: entry.command.kind().to_string(),
            command: command_json(entry),
            entry: base64::engine::general_purpose::STANDARD
                .encode(entry_to_proto(entry).encode_to_vec()),
            outcome,
            state_hash: state.state_hash().to_string(),
            prev: chain.prev.clone(),
        };
        chain.write(&line)?;
        entries += 1;
        last_index = index;
        Ok::<(), AuditError>(())
    };
    let log = LogTerms::open(dir)?;
    let journaled =
        crate::replay::journal_entries(&state_dir, after + 1, until_index, &mut |index, entry| {
            write_entry(index, &entry, log.term(index)?)
        })?;
    // Committed entries past the journal's end (a replica killed before
    // its journal caught up), from the Raft log.
    for (index, term, entry) in log.committed_after(journaled.max(after), until_index)? {
        write_entry(index, &entry, Some(term))?;
    }
    // A first index past the log's end (`until` not named): nothing to
    // export, and nothing written yet.
    if entries == 0 && asked_after > 0 {
        return Err(AuditError::EmptyRange {
            from: asked_after + 1,
            last: state.last_index(),
        });
    }
    let state_hash = state.state_hash().to_string();
    chain.start()?;
    chain.write(&Line::End {
        entries,
        prev: chain.prev.clone(),
        seal: end_seal(entries, &chain.prev),
    })?;
    Ok(AuditSummary {
        entries,
        after_index: after,
        last_index,
        state_hash,
        last_line_hash: chain.prev,
    })
}

/// The Raft log of a data directory (where it is, and the store when
/// there is one), for terms and its committed tail.
struct LogTerms(std::path::PathBuf, Option<crate::LogStore>);

impl LogTerms {
    fn open(dir: &crate::DataDir) -> Result<LogTerms, AuditError> {
        let log_dir = dir.raft_log_dir();
        let log = crate::replay::open_log(&log_dir)?;
        Ok(LogTerms(log_dir, log))
    }

    fn log_error(e: crate::StoreError) -> AuditError {
        AuditError::Replay(ReplayError::Log {
            path: "the Raft log".into(),
            message: e.to_string(),
        })
    }

    /// The term of entry `index`, while the log holds it.
    fn term(&self, index: u64) -> Result<Option<u64>, AuditError> {
        let Some(log) = &self.1 else {
            return Ok(None);
        };
        if log.first_index().is_none_or(|first| index < first) {
            return Ok(None);
        }
        Ok(log
            .entries(index, index + 1)
            .map_err(Self::log_error)?
            .first()
            .map(|e| e.log_id.leader_id.term))
    }

    /// The committed Keel entries after `after` up to `until`, with their
    /// indexes and terms.
    fn committed_after(
        &self,
        after: u64,
        until: u64,
    ) -> Result<Vec<(u64, u64, LogEntry)>, AuditError> {
        let mut out = Vec::new();
        if let Some(log) = &self.1 {
            crate::replay::committed_tail(
                log,
                &self.0,
                after,
                crate::replay::Until::Index(until),
                &mut |index, term, e| out.push((index, term, e.clone())),
            )?;
        }
        Ok(out)
    }
}

/// Checks an export: rebuilds the state its header gives, applies every
/// entry's bytes, and compares every line with the replay and the line
/// before. The first disagreement is the error.
///
/// Every field of an entry line but `term` and `prev` is checked against
/// the replay at that line. A line whose `prev` is not the hash of the
/// line before breaks the chain: if the line after it links to it as it
/// is, the line before was changed (its `term`, or anything its own checks
/// cannot see); otherwise this line's `prev` was.
pub fn verify(input: impl BufRead) -> Result<AuditSummary, AuditError> {
    let mut state: Option<ClusterState> = None;
    // The line before: its hash, its number and its index.
    let mut prev = String::new();
    let mut prev_index: Option<u64> = None;
    let (mut entries, mut after_index, mut last_index) = (0u64, 0u64, 0u64);
    let mut ended = false;
    let mut lines = input.lines().enumerate().peekable();
    while let Some((n, text)) = lines.next() {
        let text = text.map_err(AuditError::Read)?;
        let line_no = n as u64 + 1;
        let fail = |index: Option<u64>, what: String| AuditError::Disagrees {
            index,
            line: line_no,
            what,
        };
        if ended {
            return Err(fail(None, "a line after the end record".into()));
        }
        let line: Line = serde_json::from_str(&text)
            .map_err(|e| fail(None, format!("not a record of this format: {e}")))?;
        let (line_index, line_prev) = match &line {
            Line::Header { .. } => (None, None),
            Line::Entry { index, prev, .. } => (Some(*index), Some(prev)),
            Line::End { prev, .. } => (None, Some(prev)),
        };
        if let Some(line_prev) = line_prev.filter(|p| **p != prev) {
            // Whether this line is as it was written: the next line links
            // to it, or (the end) its seal holds.
            let intact = match (&line, lines.peek()) {
                (
                    Line::End {
                        entries,
                        prev,
                        seal,
                    },
                    _,
                ) => *seal == end_seal(*entries, prev),
                (_, Some((_, Ok(next)))) => serde_json::from_str::<serde_json::Value>(next)
                    .ok()
                    .and_then(|v| v.get("prev").and_then(|p| p.as_str()).map(str::to_string))
                    .is_some_and(|p| p == line_hash(&text)),
                _ => false,
            };
            return Err(if intact {
                AuditError::Disagrees {
                    index: prev_index,
                    line: line_no - 1,
                    what: format!(
                        "this line was changed: it hashes to {prev}, the next line links to {line_prev}"
                    ),
                }
            } else {
                fail(
                    line_index,
                    format!("its prev is {line_prev}, the line before hashes to {prev}"),
                )
            });
        }
        match line {
            Line::Header {
                keel_audit,
                after_index: after,
                state_hash,
                snapshot,
            } => {
                if state.is_some() || line_no != 1 {
                    return Err(fail(None, "a header after the first line".into()));
                }
                if keel_audit != AUDIT_FORMAT {
                    return Err(fail(
                        None,
                        format!("format {keel_audit}; this keel reads format {AUDIT_FORMAT}"),
                    ));
                }
                let base = match snapshot {
                    None => ClusterState::new(),
                    Some(b64) => base64::engine::general_purpose::STANDARD
                        .decode(b64)
                        .map_err(|e| e.to_string())
                        .and_then(|bytes| {
                            keel_proto::entry::StateSnapshot::decode(bytes.as_slice())
                                .map_err(|e| e.to_string())
                        })
                        .and_then(|m| {
                            ClusterState::from_snapshot_proto(m).map_err(|e| e.to_string())
                        })
                        .map_err(|e| fail(None, format!("the header's snapshot: {e}")))?,
                };
                if base.state_hash().to_string() != state_hash {
                    return Err(fail(
                        None,
                        format!(
                            "the header's state hashes to {}, not {state_hash}",
                            base.state_hash()
                        ),
                    ));
                }
                if base.last_index() > after {
                    return Err(fail(
                        None,
                        format!(
                            "the header's state is at index {}, past after_index {after}",
                            base.last_index()
                        ),
                    ));
                }
                after_index = after;
                last_index = after;
                state = Some(base);
            }
            Line::Entry {
                index,
                term: _,
                at_ms,
                time,
                actor,
                request_id,
                kind,
                command,
                entry,
                outcome,
                state_hash,
                prev: _,
            } => {
                let fail = |what: String| fail(Some(index), what);
                let Some(state) = state.as_mut() else {
                    return Err(fail("an entry before the header".into()));
                };
                if index < last_index || index <= after_index {
                    return Err(fail(format!("out of order after index {last_index}")));
                }
                let decoded = base64::engine::general_purpose::STANDARD
                    .decode(&entry)
                    .map_err(|e| e.to_string())
                    .and_then(|bytes| {
                        keel_proto::entry::LogEntry::decode(bytes.as_slice())
                            .map_err(|e| e.to_string())
                    })
                    .and_then(|m| entry_from_proto(m).map_err(|e| e.to_string()))
                    .map_err(|e| fail(format!("the entry's bytes: {e}")))?;
                let differs = |field: &str| fail(format!("its {field} is not the entry's"));
                if at_ms != decoded.at_ms {
                    return Err(differs("at_ms"));
                }
                if time != rfc3339(decoded.at_ms) {
                    return Err(differs("time"));
                }
                if actor != decoded.actor {
                    return Err(differs("actor"));
                }
                if request_id != decoded.request_id {
                    return Err(differs("request_id"));
                }
                if kind != decoded.command.kind() {
                    return Err(differs("kind"));
                }
                if command != command_json(&decoded) {
                    return Err(differs("command"));
                }
                let replayed = Outcome::of(&state.apply(index, &decoded));
                if outcome != replayed {
                    return Err(fail(format!(
                        "its outcome is not the replay's ({})",
                        serde_json::to_string(&replayed).unwrap_or_default()
                    )));
                }
                let replayed_hash = state.state_hash().to_string();
                if state_hash != replayed_hash {
                    return Err(fail(format!(
                        "the state after it hashes to {replayed_hash}, the line says {state_hash}"
                    )));
                }
                entries += 1;
                last_index = index;
            }
            Line::End {
                entries: count,
                prev: line_prev,
                seal,
            } => {
                if state.is_none() {
                    return Err(fail(None, "the end before the header".into()));
                }
                if seal != end_seal(count, &line_prev) {
                    return Err(fail(None, "its seal is not the hash of its fields".into()));
                }
                if count != entries {
                    return Err(fail(
                        None,
                        format!("the end counts {count} entries; the export holds {entries}"),
                    ));
                }
                ended = true;
            }
        }
        prev = line_hash(&text);
        prev_index = line_index;
    }
    let Some(state) = state else {
        return Err(AuditError::Disagrees {
            index: None,
            line: 1,
            what: "no header".into(),
        });
    };
    if !ended {
        return Err(AuditError::Disagrees {
            index: Some(last_index),
            line: entries + 2,
            what: "the export ends without its end record (cut short?)".into(),
        });
    }
    Ok(AuditSummary {
        entries,
        after_index,
        last_index,
        state_hash: state.state_hash().to_string(),
        last_line_hash: prev,
    })
}
