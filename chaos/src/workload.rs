//! The client workload and its history.
//!
//! A few clients, each a loop at a bounded rate: submit a job (a unique
//! name), cancel one of its own, read any acknowledged job, or mark a node
//! lost or alive as an operator would (its jobs go back to the queue), at a replica
//! drawn from a seeded stream (followers forward writes to the leader).
//! Every operation is recorded with when it was invoked and completed
//! (milliseconds since the run began) and its outcome: acknowledged (with
//! the log index and the job id), failed (a definite refusal: it did not
//! happen) or indeterminate (a timeout or a lost connection: it may have).
//! A submission in doubt (and one in ten whose first answer the client
//! drops on purpose) is sent again with the same request id, up to
//! [`SUBMIT_ATTEMPTS`] times, and recorded as one operation from the first
//! send to the last answer; Keel must apply it once, so a name appearing
//! twice is a duplicate Keel made.

use std::collections::BTreeMap;
use std::net::SocketAddr;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use keel_proto::api;
use keel_state::rng::SplitMix64;
use serde::Serialize;
use tonic::Code;

/// What an operation asked.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case", tag = "op")]
pub enum Request {
    Submit {
        name: String,
    },
    Cancel {
        job_id: u64,
    },
    Get {
        job_id: u64,
    },
    /// An operator marking a node lost or alive (`keel node lost|alive`).
    SetNode {
        node: String,
        state: String,
    },
}

/// How an operation ended.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case", tag = "outcome")]
pub enum Outcome {
    /// Done: for writes, the log index (and a submission's job id); for
    /// reads, the job's state (`None`: not found).
    Ok {
        index: Option<u64>,
        job_id: Option<u64>,
        state: Option<String>,
    },
    /// Refused: it did not happen.
    Failed { reason: String },
    /// Unknown: it may or may not have happened.
    Indeterminate { reason: String },
}

/// One operation of the history.
#[derive(Debug, Clone, Serialize)]
pub struct Op {
    pub client: u32,
    /// The replica of the last attempt.
    pub replica: u64,
    /// How often it was sent (a submission in doubt is sent again, with
    /// the same request id).
    pub attempts: u32,
    pub request: Request,
    pub invoked_ms: u64,
    pub completed_ms: u64,
    pub outcome: Outcome,
}

impl Op {
    pub fn is_ok(&self) -> bool {
        matches!(self.outcome, Outcome::Ok { .. })
    }
}

/// The history, appended to by every client.
#[derive(Debug, Clone, Default)]
pub struct History(Arc<Mutex<Vec<Op>>>);

impl History {
    pub fn push(&self, op: Op) {
        match self.0.lock() {
            Ok(mut g) => g.push(op),
            Err(p) => p.into_inner().push(op),
        }
    }

    pub fn ops(&self) -> Vec<Op> {
        match self.0.lock() {
            Ok(g) => g.clone(),
            Err(p) => p.into_inner().clone(),
        }
    }

    /// Acknowledged submissions so far: job id → name.
    pub fn acknowledged_jobs(&self) -> BTreeMap<u64, String> {
        self.ops()
            .into_iter()
            .filter_map(|op| match (&op.request, &op.outcome) {
                (
                    Request::Submit { name },
                    Outcome::Ok {
                        job_id: Some(id), ..
                    },
                ) => Some((*id, name.clone())),
                _ => None,
            })
            .collect()
    }
}

/// How the clients run.
#[derive(Debug, Clone)]
pub struct WorkloadConfig {
    /// Operations per second per client, at most.
    pub rate_per_client: f64,
    /// An operation that has not completed by then is indeterminate.
    pub timeout: Duration,
    pub seed: u64,
    /// Read with `keel-read: stale` (the contacted replica's state as it
    /// is): not linearizable, so the checker should find stale reads. A
    /// test of the checker, not of Keel.
    pub stale_reads: bool,
    /// The nodes the operator operations pick from.
    pub nodes: Vec<String>,
    /// Plaintext, or TLS with the harness's client certificate.
    pub transport: keel::transport::Transport,
    /// The token the clients present (a cluster with `--acl`).
    pub token: Option<String>,
}

/// The clock every history entry is measured on.
#[derive(Debug, Clone, Copy)]
pub struct RunClock(pub Instant);

impl RunClock {
    pub fn now_ms(&self) -> u64 {
        u64::try_from(self.0.elapsed().as_millis()).unwrap_or(u64::MAX)
    }
}

/// Most sends of one submission.
pub const SUBMIT_ATTEMPTS: u32 = 3;

/// The GPU type no node has: a job that allows only it waits forever.
pub const NO_SUCH_GPU_TYPE: &str = "chaos-none";

/// The spec of a workload job: a one-GPU worker that reports progress
/// twice and succeeds within half a second. A job
/// that is not `runnable` allows only a GPU type no node has, so it stays
/// pending (scheduling runs, but the backlog stays bounded).
pub fn job_spec(name: &str, runnable: bool) -> keel_state::JobSpec {
    let mut spec = keel_state::fixtures::job_spec(name, 1, 1);
    spec.user = "chaos".into();
    // Two progress reports a few tenths of a second apart, then success.
    spec.command = vec![
        "sh".into(),
        "-c".into(),
        "echo 'KEEL_PROGRESS {\"step\": 1, \"total_steps\": 2}'; sleep 0.3; \
         echo 'KEEL_PROGRESS {\"step\": 2, \"total_steps\": 2}'"
            .into(),
    ];
    spec.model = None;
    spec.total_steps = None;
    if !runnable {
        spec.gpu_types.allowed = vec![NO_SUCH_GPU_TYPE.into()];
    }
    spec
}

/// Is a gRPC error a definite refusal (the operation did not happen)?
fn definite(code: Code) -> bool {
    matches!(
        code,
        Code::InvalidArgument
            | Code::NotFound
            | Code::FailedPrecondition
            | Code::AlreadyExists
            | Code::OutOfRange
            | Code::ResourceExhausted
            | Code::PermissionDenied
            | Code::Unauthenticated
    )
}

/// The outcome a gRPC error means for a write.
pub fn outcome_of_error(status: &tonic::Status) -> Outcome {
    let reason = format!("{:?}: {}", status.code(), status.message());
    // The server said the write was not proposed (no leader took it), or
    // the connection was never made: nothing was applied.
    let never_sent =
        keel::grpc_status::not_proposed(status) || keel::grpc_status::never_connected(status);
    if definite(status.code()) || never_sent {
        Outcome::Failed { reason }
    } else {
        Outcome::Indeterminate { reason }
    }
}

/// One client: runs until `stop` turns true.
pub async fn client(
    id: u32,
    replicas: Vec<(u64, SocketAddr)>,
    config: WorkloadConfig,
    clock: RunClock,
    history: History,
    stop: tokio::sync::watch::Receiver<bool>,
) {
    let mut rng = SplitMix64::new(config.seed ^ (u64::from(id) << 32) ^ 0x9e37_79b9);
    let clients: Vec<_> = replicas
        .iter()
        .filter_map(|(rid, addr)| {
            Some((
                *rid,
                crate::cluster::client_for(&config.transport, config.token.as_deref(), *addr)?,
            ))
        })
        .collect();
    if clients.is_empty() {
        return;
    }
    let pause = Duration::from_secs_f64(1.0 / config.rate_per_client.max(0.1));
    let mut mine: Vec<u64> = Vec::new();
    let mut n = 0u64;
    while !*stop.borrow() {
        let (mut replica, mut c) = clients[rng.below(clients.len() as u64) as usize].clone();
        let roll = rng.below(100);
        let runnable = rng.below(5) == 0;
        let known = history.acknowledged_jobs();
        let request = if roll < 60 || known.is_empty() {
            n += 1;
            Request::Submit {
                name: format!("c{id}-{n}"),
            }
        } else if roll >= 95 && !config.nodes.is_empty() {
            let node = config.nodes[rng.below(config.nodes.len() as u64) as usize].clone();
            let state = if rng.below(2) == 0 { "lost" } else { "alive" };
            Request::SetNode {
                node,
                state: state.into(),
            }
        } else if roll < 75 && !mine.is_empty() {
            Request::Cancel {
                job_id: mine[rng.below(mine.len() as u64) as usize],
            }
        } else {
            // Half the reads go to the latest jobs, where a stale read
            // would show.
            let ids: Vec<u64> = known.keys().copied().collect();
            let recent = ids.len().saturating_sub(10);
            let i = if rng.below(2) == 0 {
                recent + rng.below((ids.len() - recent) as u64) as usize
            } else {
                rng.below(ids.len() as u64) as usize
            };
            Request::Get { job_id: ids[i] }
        };
        let invoked_ms = clock.now_ms();
        let mut attempts = 0u32;
        let outcome = match &request {
            Request::Submit { name } => {
                // One request id (the unique name) for every attempt: the
                // server applies the submission once however often it
                // arrives. A lost answer is retried at another replica, and
                // one submission in ten loses its first answer on purpose
                // (the client never sees it and retries).
                let spec = keel_state::codec::spec_to_proto(&job_spec(name, runnable));
                let lose_first_answer = rng.below(10) == 0;
                let mut in_doubt = false;
                let outcome = loop {
                    attempts += 1;
                    let call = c.submit_job(api::SubmitJobRequest {
                        spec: Some(spec.clone()),
                        request_id: name.clone(),
                    });
                    let outcome = match tokio::time::timeout(config.timeout, call).await {
                        Ok(Ok(r)) => {
                            let r = r.into_inner();
                            Outcome::Ok {
                                index: Some(r.index),
                                job_id: Some(r.job_id),
                                state: None,
                            }
                        }
                        Ok(Err(status)) => outcome_of_error(&status),
                        Err(_) => Outcome::Indeterminate {
                            reason: "timed out".into(),
                        },
                    };
                    let lost = attempts == 1 && lose_first_answer;
                    let retry = lost || matches!(outcome, Outcome::Indeterminate { .. });
                    if !retry || attempts >= SUBMIT_ATTEMPTS || *stop.borrow() {
                        break match outcome {
                            // A refusal after an attempt in doubt proves
                            // nothing about that attempt.
                            Outcome::Failed { reason } if in_doubt => Outcome::Indeterminate {
                                reason: format!("{reason} (after an attempt in doubt)"),
                            },
                            outcome => outcome,
                        };
                    }
                    in_doubt = true;
                    (replica, c) = clients[rng.below(clients.len() as u64) as usize].clone();
                    tokio::time::sleep(Duration::from_millis(50)).await;
                };
                if let Outcome::Ok {
                    job_id: Some(id), ..
                } = &outcome
                {
                    mine.push(*id);
                }
                outcome
            }
            Request::Cancel { job_id } => {
                attempts = 1;
                let call = c.cancel_job(api::CancelJobRequest {
                    job_id: *job_id,
                    reason: "chaos".into(),
                    request_id: format!("c{id}-cancel-{invoked_ms}-{job_id}"),
                });
                match tokio::time::timeout(config.timeout, call).await {
                    Ok(Ok(r)) => Outcome::Ok {
                        index: Some(r.into_inner().index),
                        job_id: Some(*job_id),
                        state: None,
                    },
                    Ok(Err(status)) => outcome_of_error(&status),
                    Err(_) => Outcome::Indeterminate {
                        reason: "timed out".into(),
                    },
                }
            }
            Request::SetNode { node, state } => {
                attempts = 1;
                let call = c.set_node_state(api::SetNodeStateRequest {
                    name: node.clone(),
                    state: state.clone(),
                    reason: "chaos".into(),
                    request_id: String::new(),
                });
                match tokio::time::timeout(config.timeout, call).await {
                    Ok(Ok(r)) => Outcome::Ok {
                        index: Some(r.into_inner().index),
                        job_id: None,
                        state: None,
                    },
                    Ok(Err(status)) => outcome_of_error(&status),
                    Err(_) => Outcome::Indeterminate {
                        reason: "timed out".into(),
                    },
                }
            }
            Request::Get { job_id } => {
                attempts = 1;
                let mut request = tonic::Request::new(api::GetJobRequest { job_id: *job_id });
                if config.stale_reads {
                    if let Ok(v) = "stale".parse() {
                        request.metadata_mut().insert("keel-read", v);
                    }
                }
                let call = c.get_job(request);
                match tokio::time::timeout(config.timeout, call).await {
                    Ok(Ok(r)) => Outcome::Ok {
                        index: None,
                        job_id: Some(*job_id),
                        state: Some(r.into_inner().state),
                    },
                    Ok(Err(status)) if status.code() == Code::NotFound => Outcome::Ok {
                        index: None,
                        job_id: Some(*job_id),
                        state: None,
                    },
                    // A read changes nothing: any failure is just a failure.
                    Ok(Err(status)) => Outcome::Failed {
                        reason: format!("{:?}: {}", status.code(), status.message()),
                    },
                    Err(_) => Outcome::Failed {
                        reason: "timed out".into(),
                    },
                }
            }
        };
        history.push(Op {
            client: id,
            replica,
            attempts,
            request,
            invoked_ms,
            completed_ms: clock.now_ms(),
            outcome,
        });
        tokio::time::sleep(pause).await;
    }
}
