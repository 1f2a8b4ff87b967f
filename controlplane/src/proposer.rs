//! Group commit above Raft: concurrent commands share one log entry.
//!
//! openraft 0.9 waits for each log append to be flushed before it takes the
//! next, and makes one log entry per `client_write`. One fdatasync per
//! command would cap a replica at the disk's sync rate (about 3,000/s here).
//! So the API does not write commands one by one: it hands them to this
//! task, which proposes everything that queued up while the previous
//! proposal was being made durable as one [`Proposal`]. Each command still
//! gets its own outcome.

use keel_state::codec::entry_to_proto;
use keel_state::{Command, Event, LogEntry, Proposal};
use prost::Message;
use tokio::sync::{mpsc, oneshot};

use crate::api::Clock;
use crate::grpc_status::ApiError;
use crate::raft_node::Raft;

/// Most commands in one proposal.
pub const PROPOSAL_MAX_COMMANDS: usize = 1024;
/// Most encoded bytes in one proposal (a single larger command goes alone).
pub const PROPOSAL_MAX_BYTES: usize = 4 * 1024 * 1024;
/// Commands waiting for a proposal before callers wait to queue.
const QUEUE: usize = 8192;

/// The index a command was committed at, and what applying it did.
pub type Committed = Result<(u64, Vec<Event>), ApiError>;

struct Pending {
    command: Command,
    request_id: Option<String>,
    reply: oneshot::Sender<Committed>,
}

/// A handle to the proposer task. Cheap to clone.
#[derive(Debug, Clone)]
pub struct Proposer {
    tx: mpsc::Sender<Pending>,
}

impl Proposer {
    /// Starts the proposer task on the current tokio runtime.
    pub fn spawn(raft: Raft, clock: Clock) -> Proposer {
        let (tx, rx) = mpsc::channel(QUEUE);
        tokio::spawn(run(raft, clock, rx));
        Proposer { tx }
    }

    /// Proposes a command and waits until it is applied (or refused).
    pub async fn propose(&self, command: Command) -> Committed {
        self.propose_request(command, None).await
    }

    /// Proposes a client's command under its request id (see
    /// `keel_state::requests`): a repeat is answered with the first outcome.
    pub async fn propose_request(&self, command: Command, request_id: Option<String>) -> Committed {
        let (reply, rx) = oneshot::channel();
        self.tx
            .send(Pending {
                command,
                request_id,
                reply,
            })
            .await
            .map_err(|_| ApiError::Unavailable("the server is shutting down".into()))?;
        rx.await
            .map_err(|_| ApiError::Unavailable("the server is shutting down".into()))?
    }
}

async fn run(raft: Raft, clock: Clock, mut rx: mpsc::Receiver<Pending>) {
    let mut carried: Option<Pending> = None;
    loop {
        let first = match carried.take() {
            Some(p) => p,
            None => match rx.recv().await {
                Some(p) => p,
                None => return,
            },
        };
        let at_ms = clock();
        let mut entries = Vec::new();
        let mut replies = Vec::new();
        let mut bytes = 0;
        let mut next = Some(first);
        while let Some(p) = next.take() {
            let entry = LogEntry {
                at_ms,
                command: p.command,
                request_id: p.request_id,
            };
            let size = entry_to_proto(&entry).encoded_len();
            if !entries.is_empty() && bytes + size > PROPOSAL_MAX_BYTES {
                carried = Some(Pending {
                    command: entry.command,
                    request_id: entry.request_id,
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
