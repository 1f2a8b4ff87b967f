//! Group commit above Raft: concurrent commands share one log entry.
//!
//! openraft 0.9 waits for each log append to be flushed before it takes the
//! next, and makes one log entry per `client_write`. One fdatasync per
//! command would cap a replica at the disk's sync rate (about 3,000/s here).
//! So the API does not write commands one by one: it hands them to this
//! task, which proposes everything that queued up while the previous
//! proposal was being made durable as one [`Proposal`]. Each command still
//! gets its own outcome.

use std::sync::Arc;
use std::time::Duration;

use keel_state::codec::entry_to_proto;
use keel_state::{Command, Event, LogEntry, Proposal};
use prost::Message;
use tokio::sync::{mpsc, oneshot};

use crate::grpc_status::ApiError;
use crate::raft_node::{Raft, RaftNode};
use openraft::error::{CheckIsLeaderError, RaftError};
use openraft::BasicNode;

/// Most commands in one proposal.
pub const PROPOSAL_MAX_COMMANDS: usize = 1024;
/// Most encoded bytes in one proposal (a single larger command goes alone).
pub const PROPOSAL_MAX_BYTES: usize = 4 * 1024 * 1024;
/// How long a new leader waits to apply its log before its first stamp.
const CATCH_UP_TIMEOUT: Duration = Duration::from_secs(5);
/// Commands waiting for a proposal before callers wait to queue.
const QUEUE: usize = 8192;

/// The index a command was committed at, and what applying it did.
pub type Committed = Result<(u64, Vec<Event>), ApiError>;

struct Pending {
    command: Command,
    request_id: Option<String>,
    actor: Option<String>,
    /// The sampled trace the proposing caller is in ([`crate::traces`]).
    trace_parent: Option<String>,
    reply: oneshot::Sender<Committed>,
}

/// A handle to the proposer task. Cheap to clone.
#[derive(Debug, Clone)]
pub struct Proposer {
    tx: mpsc::Sender<Pending>,
}

impl Proposer {
    /// Starts the proposer task on the current tokio runtime. It stamps
    /// entries with the node's log time (`crate::clock`).
    pub fn spawn(node: Arc<RaftNode>) -> Proposer {
        let (tx, rx) = mpsc::channel(QUEUE);
        tokio::spawn(run(node, rx));
        Proposer { tx }
    }

    /// Proposes a command and waits until it is applied (or refused).
    pub async fn propose(&self, command: Command) -> Committed {
        self.propose_request(command, None, None).await
    }

    /// Proposes a client's command under its request id (see
    /// `keel_state::requests`): a repeat is answered with the first outcome.
    /// `actor` is who asked ([`crate::caller`]).
    pub async fn propose_request(
        &self,
        command: Command,
        request_id: Option<String>,
        actor: Option<String>,
    ) -> Committed {
        // A traced caller's write (the API's span, with `--otlp-endpoint`)
        // is proposed in a span of its own, from the queue to the outcome
        // (batching, the leader's WAL append, replication, commit, apply);
        // its context goes into the entry, so what acts on the entry
        // anywhere hangs under it. An untraced caller's gets no span.
        let span = if crate::traces::current_trace_parent().is_some() {
            tracing::trace_span!(
                target: crate::traces::TARGET,
                "keel.propose",
                keel.command = command.kind(),
            )
        } else {
            tracing::Span::none()
        };
        let trace_parent = crate::traces::trace_parent_of(&span);
        let proposed = async {
            let (reply, rx) = oneshot::channel();
            self.tx
                .send(Pending {
                    command,
                    request_id,
                    actor,
                    trace_parent,
                    reply,
                })
                .await
                .map_err(|_| ApiError::Unavailable("the server is shutting down".into()))?;
            rx.await
                .map_err(|_| ApiError::Unavailable("the server is shutting down".into()))?
        };
        tracing::Instrument::instrument(proposed, span).await
    }
}

/// Why a leader could not catch up before stamping.
#[derive(Debug, thiserror::Error)]
pub enum CatchUpError {
    /// Not leading, or no quorum to confirm it.
    #[error(transparent)]
    NotLeader(#[from] RaftError<u64, CheckIsLeaderError<u64, BasicNode>>),
    /// Its log was not applied in time.
    #[error("{0}")]
    NotApplied(#[from] openraft::metrics::WaitError),
}

/// What a leader does before its first stamp of a term, so its stamps are
/// later than every entry before them: confirms it leads (its term's first
/// entry committed), then applies its whole log, not only up to the commit
/// index (a leader restarted into its own term, as openraft resumes a
/// committed vote, may hold entries it stamped before the crash and that
/// are not committed yet). Returns the term it caught up in. The server's
/// proposer and `keel-dst` both run it.
pub async fn apply_whole_log(raft: &Raft, timeout: Duration) -> Result<u64, CatchUpError> {
    let (term, last_log_index) = {
        let metrics = raft.metrics();
        let m = metrics.borrow();
        (m.current_term, m.last_log_index)
    };
    raft.ensure_linearizable().await?;
    raft.wait(Some(timeout))
        .applied_index_at_least(last_log_index, "applying the log before stamping")
        .await?;
    Ok(term)
}

/// [`apply_whole_log`], then no stamp earlier than the latest entry, and
/// the log time the replies of that round said (if none carried one, this
/// leader's own reckoning becomes the reference).
async fn caught_up_term(node: &RaftNode) -> Result<u64, ApiError> {
    let term = apply_whole_log(&node.raft, CATCH_UP_TIMEOUT)
        .await
        .map_err(|e| match e {
            CatchUpError::NotLeader(e) => ApiError::from(e),
            CatchUpError::NotApplied(e) => ApiError::Unavailable(e.to_string()),
        })?;
    let last = node.state_machine.shared().read().state.last_entry_at_ms();
    node.clock.saw_entry(last);
    node.clock.seed();
    Ok(term)
}

/// Fails a batch before it was proposed: the first command and every one
/// queued behind it.
fn refuse_queued(first: Pending, rx: &mut mpsc::Receiver<Pending>, e: &ApiError) {
    let _ = first.reply.send(Err(e.clone()));
    while let Ok(p) = rx.try_recv() {
        let _ = p.reply.send(Err(e.clone()));
    }
}

async fn run(node: Arc<RaftNode>, mut rx: mpsc::Receiver<Pending>) {
    let raft = node.raft.clone();
    let mut carried: Option<Pending> = None;
    let mut stamping_term: Option<u64> = None;
    loop {
        let first = match carried.take() {
            Some(p) => p,
            None => match rx.recv().await {
                Some(p) => p,
                None => return,
            },
        };
        if stamping_term != Some(raft.metrics().borrow().current_term) {
            match caught_up_term(&node).await {
                Ok(term) => stamping_term = Some(term),
                Err(e) => {
                    refuse_queued(first, &mut rx, &e);
                    continue;
                }
            }
        }
        // This replica's clock, checked against the voters' now (not at
        // the watch loop's next tick): a leader an hour ahead stamps
        // nothing once it has heard the others.
        node.clock.check(node.clock.observe(&raft));
        let at_ms = match node.clock.stamp() {
            Ok(at_ms) => at_ms,
            Err(refused) => {
                // This replica's clock is too far ahead to lead: nothing
                // is proposed (clients go to another replica).
                refuse_queued(first, &mut rx, &ApiError::Unavailable(refused.to_string()));
                continue;
            }
        };
        let mut entries = Vec::new();
        let mut replies = Vec::new();
        let mut bytes = 0;
        let mut next = Some(first);
        while let Some(p) = next.take() {
            let entry = LogEntry {
                at_ms,
                command: p.command,
                request_id: p.request_id,
                actor: p.actor,
                trace_parent: p.trace_parent,
            };
            let size = entry_to_proto(&entry).encoded_len();
            if !entries.is_empty() && bytes + size > PROPOSAL_MAX_BYTES {
                carried = Some(Pending {
                    command: entry.command,
                    request_id: entry.request_id,
                    actor: entry.actor,
                    trace_parent: entry.trace_parent,
                    reply: p.reply,
                });
                break;
            }
            bytes += size;
            entries.push(entry);
            replies.push(p.reply);
            if entries.len() < PROPOSAL_MAX_COMMANDS {
                next = rx.try_recv().ok();
            }
        }
        // One proposal at a time: openraft appends and syncs one entry at a
        // time anyway, so proposals in parallel only make smaller batches
        // (seen in one-off experiments, not kept benchmarks: 64 in-process
        // clients on one replica, ~27k/s with one in flight, ~8k/s with
        // four; three replicas, replicated_writes with 64 clients, 3,508/s
        // with one, 3,018/s with two, 2,863/s with four).
        node.metrics.proposals.inc_by(entries.len() as u64);
        node.metrics
            .proposal_batch_entries
            .observe(entries.len() as f64);
        match raft.client_write(Proposal::new(entries)).await {
            Ok(resp) => {
                let index = resp.data.index;
                for (reply, outcome) in replies.into_iter().zip(resp.data.outcomes) {
                    let _ = reply.send(
                        outcome
                            .map(|events| (index, events))
                            .map_err(ApiError::from),
                    );
                }
            }
            Err(e) => {
                let e = ApiError::from(e);
                for reply in replies {
                    let _ = reply.send(Err(e.clone()));
                }
            }
        }
    }
}
