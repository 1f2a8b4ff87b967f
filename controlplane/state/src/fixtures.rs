//! Deterministic, seeded entry streams for benchmarks and tests, and a
//! small cluster to apply entries to in tests ([`TestCluster`]).
//!
//! [`mixed_entries`] plays a busy cluster: nodes register, jobs are submitted,
//! placed, start workers, report progress (the bulk of the log, as in
//! production), finish and are removed. Each entry is checked against a
//! state the generator keeps, so nearly all of them are accepted.

use crate::command::{Command, JobOutcome, JobPlacement, LogEntry};
use crate::model::{Gpu, GpuRef, JobId, JobState, ProgressSample};
use crate::spec::{GpuTypes, JobSpec, Workers};
use crate::state::ClusterState;

pub use crate::rng::SplitMix64;

/// A valid spec: `gpus` per worker, a fixed number of `workers`.
pub fn job_spec(name: &str, gpus: u32, workers: u32) -> JobSpec {
    JobSpec {
        name: name.into(),
        user: "ada".into(),
        command: vec!["python3".into(), "train.py".into()],
        image: None,
        env: Default::default(),
        secret_env: Default::default(),
        gpus,
        workers: Workers {
            min: workers,
            max: workers,
        },
        gpu_types: GpuTypes::default(),
        model: Some("resnet50".into()),
        total_steps: Some(10_000),
        epochs: None,
        priority: 0,
        max_retries: 0,
        retry_backoff_s: 0,
        resources: Default::default(),
        logs: Default::default(),
        queue: String::new(),
        preemptible: true,
    }
}

/// A state and the index of its last entry, for tests: nodes of v100s,
/// entries applied in order and stamped at 1 ms (time does not move).
#[derive(Debug, Clone)]
pub struct TestCluster {
    pub state: ClusterState,
    pub index: u64,
}

impl TestCluster {
    /// Nodes `n0`, `n1`, ... with `gpus_per_node[i]` v100s each.
    pub fn v100_nodes(gpus_per_node: &[u32]) -> TestCluster {
        let mut c = TestCluster {
            state: ClusterState::new(),
            index: 0,
        };
        for (n, count) in gpus_per_node.iter().enumerate() {
            c.apply(Command::register_node(
                format!("n{n}"),
                "127.0.0.1",
                (0..*count)
                    .map(|index| Gpu {
                        index,
                        gpu_type: "v100".into(),
                    })
                    .collect(),
            ));
        }
        c
    }

    /// Applies `command` as the next entry; panics if it is refused.
    pub fn apply(&mut self, command: Command) -> Vec<crate::event::Event> {
        self.index += 1;
        self.state
            .apply(self.index, &LogEntry::new(1, command))
            .expect("applies")
    }

    /// Submits `spec`; returns the new job's id.
    pub fn submit(&mut self, spec: JobSpec) -> JobId {
        self.apply(Command::submit_job(spec));
        self.state.jobs().keys().last().copied().expect("a job")
    }

    /// Gives `job_id` exactly `gpus` (one decision, based on the last entry).
    pub fn place(&mut self, job_id: JobId, gpus: Vec<GpuRef>) {
        self.apply(Command::decide_allocation(
            self.index,
            "test",
            self.state.last_round() + 1,
            vec![JobPlacement::alone(job_id, gpus)],
        ));
    }
}

/// `count` entries of a busy cluster with `nodes` nodes of 8 GPUs, from `seed`.
pub fn mixed_entries(count: usize, nodes: u32, seed: u64) -> Vec<LogEntry> {
    mixed_entries_in_queues(count, nodes, seed, 0)
}

/// [`mixed_entries`] with `queues` queues defined after the nodes (one
/// cohort, quotas above the cluster's size, so nothing is refused for
/// quota) and the jobs spread over them in turn: the same decisions,
/// with every quota check paid.
pub fn mixed_entries_in_queues(
    count: usize,
    nodes: u32,
    seed: u64,
    queues: usize,
) -> Vec<LogEntry> {
    let mut rng = SplitMix64::new(seed);
    let mut state = ClusterState::new();
    let mut out = Vec::with_capacity(count);
    let mut at_ms = 1_700_000_000_000u64;
    let mut submitted = 0u64;
    fn push(out: &mut Vec<LogEntry>, state: &mut ClusterState, command: Command, at_ms: u64) {
        let entry = LogEntry::new(at_ms, command);
        let index = out.len() as u64 + 1;
        let _accepted = state.apply(index, &entry);
        out.push(entry);
    }
    for n in 0..nodes {
        push(
            &mut out,
            &mut state,
            Command::register_node(
                format!("node-{n}"),
                format!("10.0.0.{n}:7070"),
                (0..8)
                    .map(|index| Gpu {
                        index,
                        gpu_type: if n % 2 == 0 { "v100" } else { "k80" }.into(),
                    })
                    .collect(),
            ),
            at_ms,
        );
    }
    for q in 0..queues {
        let quota = ["v100", "k80"]
            .iter()
            .map(|t| (t.to_string(), nodes * 8))
            .collect();
        let mut spec = crate::queue::QueueSpec::with_quota(quota);
        spec.cohort = Some("all".into());
        push(
            &mut out,
            &mut state,
            Command::create_queue(format!("q{q}"), spec),
            at_ms,
        );
    }
    while out.len() < count {
        at_ms += 1 + rng.below(20);
        let running: Vec<JobId> = state
            .jobs()
            .values()
            .filter(|j| j.state == JobState::Running)
            .map(|j| j.id)
            .collect();
        let roll = rng.below(100);
        let command = if roll < 8 || (roll >= 16 && running.is_empty()) {
            submitted += 1;
            Command::submit_job(JobSpec {
                user: format!("user-{}", submitted % 7),
                queue: if queues == 0 {
                    String::new()
                } else {
                    format!("q{}", submitted % queues as u64)
                },
                ..job_spec(&format!("job-{submitted}"), 1 << rng.below(3), 1)
            })
        } else if roll < 16 {
            // Place the oldest pending job on free GPUs of one node, if any fit.
            let pending = state.jobs().values().find(|j| j.state == JobState::Pending);
            let Some(job) = pending else { continue };
            let want = job.spec.gpus as usize;
            let placement = state.nodes().keys().find_map(|node| {
                let free: Vec<GpuRef> = (0..8)
                    .map(|index| GpuRef {
                        node: node.clone(),
                        index,
                    })
                    .filter(|g| !state.gpu_holders().contains_key(g))
                    .take(want)
                    .collect();
                (free.len() == want).then_some(free)
            });
            let Some(gpus) = placement else {
                // Full: finish a running job to make room.
                if running.is_empty() {
                    continue;
                }
                let job_id = running[rng.below(running.len() as u64) as usize];
                push(
                    &mut out,
                    &mut state,
                    Command::finish_job(job_id, JobOutcome::Succeeded, String::new()),
                    at_ms,
                );
                continue;
            };
            Command::decide_allocation(
                out.len() as u64,
                "fifo",
                out.len() as u64,
                vec![JobPlacement::alone(job.id, gpus)],
            )
        } else if roll < 22 {
            let job_id = running[rng.below(running.len() as u64) as usize];
            let Some(epoch) = state
                .job(job_id)
                .and_then(|j| j.allocation.as_ref())
                .map(|a| a.epoch)
            else {
                continue;
            };
            Command::record_worker_started(job_id, epoch, 0, "node-0")
        } else if roll < 25 {
            let job_id = running[rng.below(running.len() as u64) as usize];
            Command::finish_job(
                job_id,
                if rng.below(10) == 0 {
                    JobOutcome::Failed
                } else {
                    JobOutcome::Succeeded
                },
                String::new(),
            )
        } else if roll < 33 {
            // The oldest ended job whose workers have all exited, as the
            // leader's retention picks.
            let Some(&job_id) = state
                .jobs_due_for_removal(u64::MAX, 0, usize::MAX, 1)
                .first()
            else {
                continue;
            };
            Command::remove_job(job_id)
        } else {
            let job_id = running[rng.below(running.len() as u64) as usize];
            let step = state
                .job(job_id)
                .and_then(|j| j.progress.as_ref())
                .map_or(0, |p| p.step);
            Command::report_progress(
                job_id,
                (1..=4)
                    .map(|k| ProgressSample {
                        step: step + k * 10,
                        total_steps: 10_000,
                        loss: Some(2.0 / (1.0 + (step + k * 10) as f64 / 1000.0)),
                        samples_per_s: 250.0 + rng.below(50) as f64,
                        at_ms: at_ms - (4 - k) * 500,
                    })
                    .collect(),
            )
        };
        push(&mut out, &mut state, command, at_ms);
    }
    out.truncate(count);
    out
}

/// The inputs each fuzz target runs: `KEEL_FUZZ_CASES`, else 2,000 (about
/// a second each in CI; RELIABILITY records a long local run).
pub fn fuzz_cases() -> u32 {
    std::env::var("KEEL_FUZZ_CASES")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(2_000)
}

/// One change a fuzz target makes to a seed input ([`mutate`]): `kind`
/// (mod 4) picks a byte set to `byte` at `a`, a cut at `a`, a stretch of up
/// to 32 bytes from `a` copied to `b`, or `byte` inserted `b % 8 + 1` times
/// at `a` (positions modulo the input's length).
pub type Mutation = (u8, usize, usize, u8);

/// `seed` changed by `mutations` in turn: what the fuzz targets (`tests/
/// fuzz_*.rs` of each crate) feed their decoders and parsers beside
/// arbitrary bytes, so that inputs reach past the first check.
pub fn mutate(seed: &[u8], mutations: &[Mutation]) -> Vec<u8> {
    let mut bytes = seed.to_vec();
    for &(kind, a, b, byte) in mutations {
        let len = bytes.len();
        match kind % 4 {
            0 if len > 0 => bytes[a % len] = byte,
            1 => bytes.truncate(a % (len + 1)),
            2 if len > 0 => {
                let from = a % len;
                let stretch = bytes[from..len.min(from + 32)].to_vec();
                let to = b % (len + 1);
                bytes.splice(to..to, stretch);
            }
            3 => {
                let at = a % (len + 1);
                bytes.splice(at..at, std::iter::repeat_n(byte, b % 8 + 1));
            }
            _ => {}
        }
    }
    bytes
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_stream_is_deterministic_and_mostly_accepted() {
        let a = mixed_entries(5_000, 8, 7);
        assert_eq!(a, mixed_entries(5_000, 8, 7));
        assert_ne!(a, mixed_entries(5_000, 8, 8));
        let mut state = ClusterState::new();
        let refused = a
            .iter()
            .enumerate()
            .filter(|(i, e)| state.apply(*i as u64 + 1, e).is_err())
            .count();
        assert!(refused * 100 < a.len(), "{refused} of {} refused", a.len());
        state.check_invariants().expect("invariants");
        let kinds: std::collections::BTreeSet<&str> = a.iter().map(|e| e.command.kind()).collect();
        for kind in [
            "submit_job",
            "decide_allocation",
            "record_worker_started",
            "report_progress",
            "finish_job",
            "remove_job",
        ] {
            assert!(kinds.contains(kind), "no {kind} in the stream");
        }
    }
}
