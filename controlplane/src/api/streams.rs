//! A bound on the event streams one caller holds open on a replica (issue
//! 22, item 5), beside the replica's whole bound (`--max-event-streams`):
//! one client that opens streams in a loop cannot take every place.
//!
//! A caller is its actor (`token:alice`, `cert:admin`) or, without one
//! (plaintext), its address's IP.

use std::collections::BTreeMap;
use std::sync::{Arc, Mutex};

/// The most event streams one caller holds open on one replica.
pub const MAX_EVENT_STREAMS_PER_CALLER: usize = 16;

/// Open event streams by caller.
#[derive(Debug, Default)]
pub struct StreamsByCaller(Mutex<BTreeMap<String, usize>>);

/// One caller's place, given back when dropped (with its stream).
#[derive(Debug)]
pub struct CallerStream {
    streams: Arc<StreamsByCaller>,
    caller: String,
}

impl StreamsByCaller {
    /// A place for `caller`, unless it holds `limit` already.
    pub fn open(self: &Arc<Self>, caller: String, limit: usize) -> Option<CallerStream> {
        let mut open = self.0.lock().unwrap_or_else(|e| e.into_inner());
        let count = open.entry(caller.clone()).or_default();
        if *count >= limit {
            return None;
        }
        *count += 1;
        Some(CallerStream {
            streams: self.clone(),
            caller,
        })
    }

    /// How many `caller` holds.
    #[cfg(test)]
    fn held(&self, caller: &str) -> usize {
        let open = self.0.lock().unwrap_or_else(|e| e.into_inner());
        open.get(caller).copied().unwrap_or(0)
    }
}

impl Drop for CallerStream {
    fn drop(&mut self) {
        let mut open = self.streams.0.lock().unwrap_or_else(|e| e.into_inner());
        if let Some(count) = open.get_mut(&self.caller) {
            *count -= 1;
            if *count == 0 {
                open.remove(&self.caller);
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_caller_holds_at_most_its_limit_and_gets_places_back() {
        let streams = Arc::new(StreamsByCaller::default());
        let a1 = streams.open("token:a".into(), 2).expect("1");
        let _a2 = streams.open("token:a".into(), 2).expect("2");
        assert!(streams.open("token:a".into(), 2).is_none(), "a third");
        let _b = streams.open("token:b".into(), 2).expect("another caller");
        drop(a1);
        assert_eq!(streams.held("token:a"), 1);
        let _a3 = streams.open("token:a".into(), 2).expect("its place back");
        assert_eq!(streams.held("nobody"), 0);
    }
}
