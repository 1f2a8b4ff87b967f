//! The once-per-term leadership check both simulated loops make before they
//! act, as the server's `LeaderGate` does: a replica that believes it leads
//! confirms it with a quorum (`ensure_linearizable`, which also applies the
//! term's first entry) once per term, and acts only in a confirmed term.

use std::time::Duration;

use openraft::ServerState;

use super::net::Raft;

/// What a loop may do this tick.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Leadership {
    /// Not the leader (or not running): act on nothing.
    NotLeading,
    /// The leader of `term`; `confirmed` once a quorum said so this term.
    Leading { term: u64, confirmed: bool },
}

/// The term a replica last confirmed its leadership in.
#[derive(Debug, Default)]
pub(crate) struct TermGate {
    confirmed_term: Option<u64>,
}

impl TermGate {
    /// Forgets the confirmation (a new process, or a loop stopped leading).
    pub(crate) fn reset(&mut self) {
        self.confirmed_term = None;
    }

    /// Where this replica stands now, confirming a new term's leadership
    /// with a quorum, waiting at most `within` for it.
    pub(crate) async fn check(&mut self, raft: &Raft, within: Duration) -> Leadership {
        let (leads, term) = {
            let m = raft.metrics();
            let m = m.borrow();
            (m.state == ServerState::Leader, m.current_term)
        };
        if !leads {
            self.reset();
            return Leadership::NotLeading;
        }
        if self.confirmed_term != Some(term) {
            let confirmed = matches!(
                tokio::time::timeout(within, raft.ensure_linearizable()).await,
                Ok(Ok(_))
            );
            if !confirmed {
                return Leadership::Leading {
                    term,
                    confirmed: false,
                };
            }
            self.confirmed_term = Some(term);
        }
        Leadership::Leading {
            term,
            confirmed: true,
        }
    }
}
