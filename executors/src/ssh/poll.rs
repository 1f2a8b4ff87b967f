//! The poll: every `poll_interval`, while this server leads, one request
//! per host reports every worker's state there and rank 0's log from the
//! last offset read. [`plan_poll`] says what to ask and [`apply_poll`]
//! folds the answer into the book; both are pure. The poll is also the
//! node's heartbeat ([`NodeProbe`]).
//!
//! A worker found that the book does not know is re-adopted (running) or
//! reported (exited): that is how a new leader, or this one after a network
//! drop, carries on.

use std::collections::BTreeSet;
use std::sync::Arc;
use std::time::{Duration, Instant};

use keel_state::liveness::NodeReport;
use keel_state::Gpu;

use super::connection::{Host, RunError};
use super::protocol::{
    parse_poll, poll_request, PollReport, ReadFrom, RemoteWorker, POLL_CHUNK_MAX,
};
use super::{SshBook, SshExecutor, SshWorker, RECONNECT_BACKOFF_MAX};
use crate::book::Worker;
use crate::contract::gpu_refs;
use crate::executor::NodeProbe;
use crate::WorkerId;

/// What one poll of a node asks for.
#[derive(Debug, Default, PartialEq, Eq)]
pub(super) struct PollPlan {
    /// Exit records to delete (their exits are in the log).
    pub forgets: Vec<WorkerId>,
    /// Rank 0 logs to read, and from where.
    pub reads: Vec<(WorkerId, ReadFrom)>,
}

/// What to ask `node` for.
pub(super) fn plan_poll(book: &SshBook, node: &str) -> PollPlan {
    PollPlan {
        forgets: book
            .shared
            .forget
            .get(node)
            .map(|s| s.iter().cloned().collect())
            .unwrap_or_default(),
        reads: book
            .workers
            .iter()
            .filter(|(id, w)| {
                id.rank == 0 && w.node == node && w.is_running() && w.extra.settled.is_some()
            })
            .map(|(id, w)| (id.clone(), w.extra.offset))
            .collect(),
    }
}

/// Folds `node`'s answer to `plan` into the book: progress lines first,
/// then re-adoptions and exits. `started` is when the poll was sent (a
/// worker launched after it may not be in the answer yet); `at_ms` stamps
/// the progress samples.
pub(super) fn apply_poll(
    book: &mut SshBook,
    node: &str,
    plan: &PollPlan,
    report: PollReport,
    started: Instant,
    now: Instant,
    at_ms: u64,
) {
    if let Some(pending) = book.shared.forget.get_mut(node) {
        for id in &plan.forgets {
            pending.remove(id);
        }
    }
    let generation = book.generation();
    // Progress first: a worker found exited below has its last lines in
    // these chunks (read after its state was). A rank 0 whose log was not
    // read to its end in this poll has its exit recorded by a later one, so
    // no progress line is lost.
    let mut drained: BTreeSet<WorkerId> = plan.reads.iter().map(|(id, _)| id.clone()).collect();
    for (id, offset, chunk) in report.chunks {
        if chunk.len() >= POLL_CHUNK_MAX {
            drained.remove(&id);
        }
        let Some(w) = book.workers.get_mut(&id) else {
            continue;
        };
        match w.extra.offset {
            None => {
                w.extra.offset = Some(offset);
                continue;
            }
            Some(o) if offset < o => continue,
            Some(o) => {
                if offset > o {
                    // Rotated away unread (more came than the progress
                    // stream holds): newer lines follow.
                    tracing::debug!(worker = %id, lost_bytes = offset - o, "progress lines rotated away unread");
                    w.extra.lines = Default::default();
                }
                w.extra.offset = Some(offset + chunk.len() as u64);
            }
        }
        let samples = w.extra.lines.push(&chunk, at_ms);
        book.add_progress(generation, id.job_id, samples);
    }
    let mut seen = BTreeSet::new();
    let pending_forget = book.shared.forget.get(node).cloned().unwrap_or_default();
    let mut exits = Vec::new();
    for (id, state) in report.workers {
        seen.insert(id.clone());
        if pending_forget.contains(&id) {
            continue;
        }
        let known = book.workers.contains_key(&id);
        match state {
            RemoteWorker::Running { port, gpus } => {
                if !known {
                    tracing::info!(worker = %id, %node, "re-adopting a worker found running");
                    let extra = SshWorker {
                        port,
                        offset: None,
                        settled: Some(now),
                        ..SshWorker::default()
                    };
                    book.workers
                        .insert(id, Worker::running(node, gpu_refs(node, gpus), extra));
                }
            }
            _ if known && id.rank == 0 && !drained.contains(&id) => {}
            RemoteWorker::Exited { code, reason } => {
                if !known {
                    tracing::info!(worker = %id, %node, %reason, "a worker ended while no server watched it");
                    book.workers.insert(id.clone(), found_ended(node, now));
                }
                exits.push((id, code, reason));
            }
            RemoteWorker::Gone => {
                if !known {
                    book.workers.insert(id.clone(), found_ended(node, now));
                }
                exits.push((
                    id,
                    None,
                    "killed (its supervisor left no exit record)".to_string(),
                ));
            }
        }
    }
    // Workers this executor started whose records are gone from the host.
    for (id, w) in &book.workers {
        if w.node == node
            && w.is_running()
            && w.extra.settled.is_some_and(|t| t < started)
            && !seen.contains(id)
            && (id.rank != 0 || drained.contains(id))
        {
            exits.push((
                id.clone(),
                None,
                "its records on the host are gone".to_string(),
            ));
        }
    }
    for (id, code, reason) in exits {
        book.record_exit(&id, code, reason);
    }
}

/// A worker found on a host (its exit is recorded right after).
fn found_ended(node: &str, now: Instant) -> Worker<SshWorker> {
    let extra = SshWorker {
        settled: Some(now),
        ..SshWorker::default()
    };
    Worker::running(node, Vec::new(), extra)
}

/// How often a host with `nvidia-smi` is asked which processes of no job
/// use its GPUs, for its node's note.
const GPU_PROCESSES_EVERY: Duration = Duration::from_secs(2);

impl SshExecutor {
    /// Polls one host until this server stops leading.
    pub(super) async fn poll_loop(self, host: Arc<Host>, generation: u64) {
        let interval = self.shared.config.poll_interval;
        let mut wait = interval;
        // What the driver last said of processes of no job on the host's
        // GPUs, and when it was asked.
        let mut busy: (Option<tokio::time::Instant>, String) = (None, String::new());
        loop {
            if !self.shared.book.is_current(generation) {
                return;
            }
            let name = host.node.name.clone();
            let probe = match self.poll_once(&host, generation).await {
                Ok(found) => {
                    let PollFound {
                        gpus,
                        failed,
                        gpu_note,
                        uncontained,
                        lists_gpu_processes,
                    } = found;
                    wait = interval;
                    if lists_gpu_processes
                        && busy.0.is_none_or(|t| t.elapsed() >= GPU_PROCESSES_EVERY)
                    {
                        busy.0 = Some(tokio::time::Instant::now());
                        let config = &self.shared.config;
                        if let Ok((_, out)) = host.run(config, vec!["busy".into()]).await {
                            busy.1 = String::from_utf8_lossy(&out)
                                .lines()
                                .map(str::trim)
                                .filter(|l| !l.is_empty())
                                .collect::<Vec<_>>()
                                .join("; ");
                        }
                    }
                    let mut note = [uncontained.unwrap_or_default(), gpu_note, busy.1.clone()]
                        .into_iter()
                        .filter(|n| !n.is_empty())
                        .collect::<Vec<_>>()
                        .join("; ");
                    keel_state::state::limits::cut_to(
                        &mut note,
                        keel_state::state::limits::NODE_NOTE_MAX_LEN,
                    );
                    NodeProbe::Answered(NodeReport {
                        name: name.clone(),
                        address: host.node.address.clone(),
                        gpus,
                        failed,
                        note,
                    })
                }
                Err(e) => {
                    tracing::debug!(node = %name, error = %e, "node did not answer");
                    wait = (wait * 2).min(RECONNECT_BACKOFF_MAX);
                    NodeProbe::Unreachable {
                        name: name.clone(),
                        reason: e.to_string(),
                    }
                }
            };
            if !self.shared.book.set_probe(generation, probe) {
                return;
            }
            tokio::time::sleep(wait.max(Duration::from_millis(1))).await;
        }
    }

    /// One poll of `host` by the loop of `generation` (what it finds is
    /// dropped if that generation ended meanwhile), and what it learned of
    /// the node.
    async fn poll_once(&self, host: &Host, generation: u64) -> Result<PollFound, RunError> {
        let name = &host.node.name;
        let book = &self.shared.book;
        let started = book.now();
        let plan = plan_poll(&book.lock(), name);
        let config = &self.shared.config;
        let connection = host.connect(config).await?;
        let argv = poll_request(connection.workers_dir(), &plan.forgets, &plan.reads);
        let (connection, out) = host.run(config, argv).await?;
        let report = parse_poll(&out).map_err(RunError::Failed)?;
        let (now, at_ms) = (book.now(), book.unix_ms());
        let mut b = book.lock();
        if b.is_current(generation) {
            apply_poll(&mut b, name, &plan, report, started, now, at_ms);
        }
        Ok(PollFound {
            gpus: connection.gpus.clone(),
            failed: connection.failed.clone(),
            gpu_note: connection.gpu_note.clone(),
            uncontained: connection.uncontained.clone(),
            lists_gpu_processes: connection.lists_gpu_processes,
        })
    }
}

/// What a poll learned of its node besides its workers.
struct PollFound {
    gpus: Vec<Gpu>,
    failed: Vec<keel_state::FailedGpu>,
    gpu_note: String,
    /// Why its workers get no cgroup, when they do not.
    uncontained: Option<String>,
    /// It has `nvidia-smi`, which can list the processes on its GPUs.
    lists_gpu_processes: bool,
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::reconcile::Observed;

    fn id(job_id: u64, rank: u32) -> WorkerId {
        WorkerId {
            job_id,
            epoch: 1,
            rank,
        }
    }

    fn observed(book: &SshBook, id: &WorkerId) -> Option<Observed> {
        book.workers
            .get(id)
            .map(|w| Observed::of(&w.exited, &w.gpus))
    }

    fn launched(book: &mut SshBook, id: &WorkerId, at: Instant) {
        let extra = SshWorker {
            port: 29500,
            offset: Some(0),
            settled: Some(at),
            ..SshWorker::default()
        };
        book.workers
            .insert(id.clone(), Worker::running("a", Vec::new(), extra));
    }

    #[test]
    fn a_worker_found_running_is_adopted_and_one_found_ended_is_reported() {
        let mut book = SshBook::default();
        let t = Instant::now();
        let plan = plan_poll(&book, "a");
        assert_eq!(plan, PollPlan::default());
        let report = PollReport {
            workers: vec![
                (
                    id(1, 0),
                    RemoteWorker::Running {
                        port: 29501,
                        gpus: vec![2, 3],
                    },
                ),
                (
                    id(2, 1),
                    RemoteWorker::Exited {
                        code: Some(3),
                        reason: "exited with status 3".into(),
                    },
                ),
                (id(3, 1), RemoteWorker::Gone),
            ],
            chunks: Vec::new(),
        };
        apply_poll(&mut book, "a", &plan, report, t, t, 0);
        match observed(&book, &id(1, 0)) {
            Some(Observed::Running { gpus }) => {
                assert_eq!(gpus.iter().map(|g| g.index).collect::<Vec<_>>(), vec![2, 3]);
            }
            other => panic!("{other:?}"),
        }
        assert_eq!(book.workers[&id(1, 0)].extra.port, 29501);
        assert_eq!(
            observed(&book, &id(2, 1)),
            Some(Observed::Exited {
                exit_code: Some(3),
                reason: "exited with status 3".into()
            })
        );
        assert!(matches!(
            observed(&book, &id(3, 1)),
            Some(Observed::Exited {
                exit_code: None,
                ..
            })
        ));
        // The adopted rank 0 is read from its log's end next time.
        assert_eq!(plan_poll(&book, "a").reads, vec![(id(1, 0), None)]);
    }

    #[test]
    fn rank_0s_exit_waits_until_its_log_is_read_to_the_end() {
        let mut book = SshBook::default();
        let t0 = Instant::now();
        launched(&mut book, &id(1, 0), t0);
        let plan = plan_poll(&book, "a");
        assert_eq!(plan.reads, vec![(id(1, 0), Some(0))]);
        let exited = || RemoteWorker::Exited {
            code: Some(0),
            reason: "exited with status 0".into(),
        };
        // A full chunk: more log to read, so the exit waits.
        let mut chunk = b"KEEL_PROGRESS {\"step\": 1}\n".to_vec();
        chunk.resize(POLL_CHUNK_MAX, b'.');
        let report = PollReport {
            workers: vec![(id(1, 0), exited())],
            chunks: vec![(id(1, 0), 0, chunk)],
        };
        apply_poll(&mut book, "a", &plan, report, t0, t0, 10);
        assert!(
            book.workers[&id(1, 0)].is_running(),
            "held for its last lines"
        );
        let plan = plan_poll(&book, "a");
        assert_eq!(plan.reads, vec![(id(1, 0), Some(POLL_CHUNK_MAX as u64))]);
        let report = PollReport {
            workers: vec![(id(1, 0), exited())],
            chunks: vec![(
                id(1, 0),
                POLL_CHUNK_MAX as u64,
                b"\nKEEL_PROGRESS {\"step\": 2}\n".to_vec(),
            )],
        };
        apply_poll(&mut book, "a", &plan, report, t0, t0, 20);
        assert!(!book.workers[&id(1, 0)].is_running());
        let steps: Vec<u64> = book.take_progress()[&1].iter().map(|s| s.step).collect();
        assert_eq!(steps, vec![1, 2], "every line counted once");
    }

    #[test]
    fn records_gone_from_the_host_end_a_worker_launched_before_the_poll() {
        let mut book = SshBook::default();
        let t0 = Instant::now();
        launched(&mut book, &id(1, 1), t0);
        let later = t0 + Duration::from_secs(1);
        launched(&mut book, &id(2, 1), later);
        let plan = plan_poll(&book, "a");
        apply_poll(
            &mut book,
            "a",
            &plan,
            PollReport::default(),
            later,
            later,
            0,
        );
        assert!(matches!(
            observed(&book, &id(1, 1)),
            Some(Observed::Exited { exit_code: None, reason }) if reason.contains("records on the host are gone")
        ));
        assert!(
            book.workers[&id(2, 1)].is_running(),
            "launched as the poll was sent: not in its answer yet"
        );
    }

    #[test]
    fn a_forgotten_exit_is_not_reported_again_and_its_forget_is_sent_once() {
        let mut book = SshBook::default();
        book.shared
            .forget
            .entry("a".into())
            .or_default()
            .insert(id(1, 0));
        let plan = plan_poll(&book, "a");
        assert_eq!(plan.forgets, vec![id(1, 0)]);
        let report = PollReport {
            workers: vec![(id(1, 0), RemoteWorker::Gone)],
            chunks: Vec::new(),
        };
        // The answer was read before the forget took effect on the host.
        book.shared
            .forget
            .entry("a".into())
            .or_default()
            .insert(id(1, 0));
        let t = Instant::now();
        let stale = PollPlan::default();
        apply_poll(&mut book, "a", &stale, report, t, t, 0);
        assert!(book.workers.is_empty(), "a pending forget is not reported");
        apply_poll(&mut book, "a", &plan, PollReport::default(), t, t, 0);
        assert_eq!(plan_poll(&book, "a").forgets, Vec::<WorkerId>::new());
    }
}
