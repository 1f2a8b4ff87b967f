//! Exactly-once client writes: the requests `apply` remembers.
//!
//! Raft does not stop a client from applying a write twice: an answer lost
//! after the entry committed (a leader killed, a connection closed) leaves
//! the client in doubt, and its retry is a second entry. So a client write
//! may carry a request id ([`crate::LogEntry::request_id`]; the CLI makes
//! one per command and keeps it across its retries). `apply` remembers the
//! id of every accepted request with a digest of its command and its
//! outcome; a later entry with the same id and the same command changes
//! nothing and is answered with the first outcome
//! ([`crate::Event::RequestRepeated`] in the journal); the same id with
//! another command is refused ([`crate::ApplyError::RequestIdReused`]).
//!
//! The memory is part of the replicated state (snapshots, the state hash),
//! and bounded deterministically, by log time and count, the same on every
//! replica: a request is remembered for [`REMEMBER_FOR_MS`] of log time, and
//! at most [`REMEMBER_MAX`] requests are (the oldest go first). A refused
//! request is not remembered: its retry is judged again (a refusal changes
//! nothing, so judging it again cannot apply anything twice).

use std::collections::{BTreeMap, VecDeque};

use prost::Message;
use serde::{Deserialize, Serialize};

use crate::command::Command;
use crate::event::Event;
use crate::state::ApplyError;

/// Longest request id, in bytes.
pub const REQUEST_ID_MAX_LEN: usize = 64;
/// How long (log time) a request is remembered after it was applied: far
/// longer than any client retries (the CLI gives up after 30 s).
pub const REMEMBER_FOR_MS: u64 = 15 * 60 * 1000;
/// Most requests remembered at once; the oldest are forgotten first.
pub const REMEMBER_MAX: usize = 100_000;

/// Checks a request id: 1 to [`REQUEST_ID_MAX_LEN`] bytes of letters,
/// digits and `-_.:`.
pub fn validate_request_id(id: &str) -> Result<(), ApplyError> {
    if id.len() > REQUEST_ID_MAX_LEN {
        return Err(ApplyError::TooLarge {
            field: "request_id".into(),
            len: id.len(),
            limit: REQUEST_ID_MAX_LEN,
        });
    }
    if id.is_empty()
        || !id
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || matches!(b, b'-' | b'_' | b'.' | b':'))
    {
        return Err(ApplyError::Invalid {
            field: "request_id".into(),
            reason: format!("{id:?} is not 1 to {REQUEST_ID_MAX_LEN} letters, digits or -_.:"),
        });
    }
    Ok(())
}

/// A digest of a command's protobuf encoding (stable across builds, unlike
/// the in-memory layout), so a reused id with another command is caught.
pub fn command_digest(command: &Command) -> [u8; 32] {
    let entry = crate::codec::entry_to_proto(&crate::LogEntry::new(0, command.clone()));
    *blake3::hash(&entry.encode_to_vec()).as_bytes()
}

/// One remembered request.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Remembered {
    /// The log index the request was first applied at.
    pub first_index: u64,
    /// Its entry's log time.
    pub at_ms: u64,
    pub command_digest: [u8; 32],
    /// What applying it did.
    pub events: Vec<Event>,
}

/// The requests remembered, by id and in the order they were applied.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct RecentRequests {
    by_id: BTreeMap<String, Remembered>,
    /// (log time, id) in apply order: what to forget first.
    order: VecDeque<(u64, String)>,
}

impl RecentRequests {
    /// The request remembered under `id`, unless it is older than the
    /// window at log time `now_ms` (then it is as good as forgotten, even
    /// before [`RecentRequests::remember`] drops it).
    pub fn get(&self, id: &str, now_ms: u64) -> Option<&Remembered> {
        self.by_id
            .get(id)
            .filter(|r| r.at_ms.saturating_add(REMEMBER_FOR_MS) >= now_ms)
    }

    /// The request remembered under `id`, in the window or not (until
    /// [`RecentRequests::remember`] drops it).
    pub fn remembered(&self, id: &str) -> Option<&Remembered> {
        self.by_id.get(id)
    }

    /// The requests remembered, in the order they were applied.
    pub fn in_order(&self) -> impl Iterator<Item = (&str, &Remembered)> {
        self.order
            .iter()
            .filter_map(|(_, id)| Some((id.as_str(), self.by_id.get(id)?)))
    }

    /// The requests `in_order` gave: refused if an id is there twice, or
    /// if there are more than [`REMEMBER_MAX`].
    pub fn from_order(
        requests: impl IntoIterator<Item = (String, Remembered)>,
    ) -> Result<RecentRequests, String> {
        let mut out = RecentRequests::default();
        for (id, r) in requests {
            out.order.push_back((r.at_ms, id.clone()));
            if out.by_id.insert(id.clone(), r).is_some() {
                return Err(format!("request id {id:?} is remembered twice"));
            }
        }
        if out.order.len() > REMEMBER_MAX {
            return Err(format!("{} request ids remembered", out.order.len()));
        }
        Ok(out)
    }

    /// How many requests are remembered.
    pub fn len(&self) -> usize {
        self.by_id.len()
    }

    pub fn is_empty(&self) -> bool {
        self.by_id.is_empty()
    }

    /// Remembers an accepted request, and forgets those out of the window
    /// at its log time or beyond the count.
    pub fn remember(&mut self, id: &str, remembered: Remembered) {
        let now_ms = remembered.at_ms;
        if self.by_id.insert(id.to_string(), remembered).is_some() {
            // An expired id used again: its old place in the order goes.
            self.order.retain(|(_, o)| o != id);
        }
        self.order.push_back((now_ms, id.to_string()));
        while let Some((at_ms, oldest)) = self.order.front() {
            let expired = at_ms.saturating_add(REMEMBER_FOR_MS) < now_ms;
            if !expired && self.order.len() <= REMEMBER_MAX {
                break;
            }
            self.by_id.remove(oldest);
            self.order.pop_front();
        }
    }

    /// The two views agree (in constant time, as the invariant checks run
    /// after every entry of a replay): as many ids in the order as
    /// remembered, the newest in both, and no more than the count.
    pub fn check(&self) -> Result<(), String> {
        if self.order.len() != self.by_id.len() {
            return Err(format!(
                "{} request ids in the order, {} remembered",
                self.order.len(),
                self.by_id.len()
            ));
        }
        if let Some((at_ms, id)) = self.order.back() {
            if self.by_id.get(id).map(|r| r.at_ms) != Some(*at_ms) {
                return Err(format!("request id {id:?} is in the order only"));
            }
        }
        if self.order.len() > REMEMBER_MAX {
            return Err(format!("{} request ids remembered", self.order.len()));
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn remembered(at_ms: u64) -> Remembered {
        Remembered {
            first_index: 1,
            at_ms,
            command_digest: [0; 32],
            events: Vec::new(),
        }
    }

    #[test]
    fn a_request_is_forgotten_after_the_window_and_the_oldest_beyond_the_count() {
        let mut r = RecentRequests::default();
        r.remember("a", remembered(0));
        assert!(r.get("a", REMEMBER_FOR_MS).is_some());
        assert!(r.get("a", REMEMBER_FOR_MS + 1).is_none());
        r.remember("b", remembered(REMEMBER_FOR_MS + 1));
        assert_eq!(r.len(), 1, "a left the window when b came");
        r.check().expect("consistent");
        for i in 0..REMEMBER_MAX {
            r.remember(&format!("x{i}"), remembered(REMEMBER_FOR_MS + 2));
        }
        assert_eq!(r.len(), REMEMBER_MAX);
        assert!(r.get("b", REMEMBER_FOR_MS + 2).is_none(), "b went first");
        r.check().expect("consistent");
    }

    #[test]
    fn an_expired_id_used_again_is_remembered_once() {
        let mut r = RecentRequests::default();
        r.remember("a", remembered(0));
        r.remember("a", remembered(REMEMBER_FOR_MS + 5));
        assert_eq!(r.len(), 1);
        r.check().expect("consistent");
    }

    #[test]
    fn request_ids_are_checked() {
        validate_request_id("cli-0f3a:1").expect("fine");
        let long = "a".repeat(REQUEST_ID_MAX_LEN + 1);
        let err = validate_request_id(&long).expect_err("too long");
        assert!(
            err.to_string()
                .contains("request_id is 65 bytes long; the limit is 64"),
            "{err}"
        );
        for bad in ["", "a b", "é", "a/b"] {
            let err = validate_request_id(bad).expect_err(bad);
            assert!(err.to_string().contains("request_id"), "{err}");
        }
    }
}
