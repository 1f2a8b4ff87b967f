//! Tiresias (discretised 2D-LAS, as in Voda): jobs are ranked by priority
//! (higher first), then by the GPU-time they have received. Queue 0 holds jobs under the first
//! threshold, queue 1 those under the second, and so on; within a queue,
//! the earlier submission first. A running job that crosses a threshold is
//! demoted and may be preempted by jobs in higher queues. Starvation guard:
//! a job that has waited at least `starvation_factor` times as long as it
//! has run goes back to queue 0, and keeps it while it runs for a slice of
//! its wait.

use std::cmp::Reverse;
use std::collections::BinaryHeap;

use keel_state::model::{Job, JobId};
use keel_state::state::Service;

/// The shortest run time the starvation guard counts with.
const MIN_RUN_MS: u64 = 60_000;

use super::admit::admit_in_order;
use super::{Plan, Policy, SchedulingInput};

/// Tiresias's knobs.
#[derive(Debug, Clone, PartialEq)]
pub struct TiresiasOptions {
    /// Queue thresholds in GPU-seconds of attained service, ascending.
    pub thresholds_gpu_s: Vec<u64>,
    /// Promote a waiting job after it waited this many times as long as it
    /// has run (0: never).
    pub starvation_factor: u64,
}

impl TiresiasOptions {
    /// Most thresholds (queues − 1) accepted.
    pub const THRESHOLDS_MAX: usize = 16;

    /// Checks the thresholds: at most [`Self::THRESHOLDS_MAX`], each
    /// positive, strictly ascending.
    pub fn validate(&self) -> Result<(), String> {
        let t = &self.thresholds_gpu_s;
        if t.len() > Self::THRESHOLDS_MAX {
            return Err(format!(
                "{} queue thresholds; the limit is {}",
                t.len(),
                Self::THRESHOLDS_MAX
            ));
        }
        if t.first() == Some(&0) {
            return Err("queue thresholds must be positive GPU-seconds".into());
        }
        if t.windows(2).any(|w| w[0] >= w[1]) {
            return Err(format!("queue thresholds must ascend, not {t:?}"));
        }
        Ok(())
    }
}

impl Default for TiresiasOptions {
    fn default() -> Self {
        TiresiasOptions {
            thresholds_gpu_s: vec![3600],
            starvation_factor: 8,
        }
    }
}

#[derive(Debug, Clone, Default)]
pub struct Tiresias {
    options: TiresiasOptions,
}

impl Tiresias {
    pub fn new(options: TiresiasOptions) -> Self {
        Tiresias { options }
    }
}

impl Policy for Tiresias {
    fn name(&self) -> &'static str {
        "tiresias"
    }

    fn plan<'a>(&self, input: &SchedulingInput<'a>) -> Plan<'a> {
        admit_in_order(input, self.rank_lazily(input))
    }

    fn admission_order(&self, input: &SchedulingInput<'_>) -> Option<Vec<JobId>> {
        Some(self.rank(input))
    }
}

/// A job's place in the ranking: priority (higher first), queue,
/// submission, id. Unique (the id), so sorting and a heap agree.
type RankKey = (Reverse<i32>, usize, u64, JobId);

/// A job with its key, ordered by the key alone, least important
/// greatest: the top of a [`BinaryHeap`] of them is the most important.
struct Ranked<'a> {
    key: RankKey,
    /// The job, when the ranking read it; else it is looked up by id
    /// (the key's last part) when taken.
    job: Option<&'a Job>,
}

impl PartialEq for Ranked<'_> {
    fn eq(&self, other: &Self) -> bool {
        self.key == other.key
    }
}

impl Eq for Ranked<'_> {}

impl PartialOrd for Ranked<'_> {
    fn partial_cmp(&self, other: &Self) -> Option<std::cmp::Ordering> {
        Some(self.cmp(other))
    }
}

impl Ord for Ranked<'_> {
    fn cmp(&self, other: &Self) -> std::cmp::Ordering {
        other.key.cmp(&self.key)
    }
}

impl Tiresias {
    /// Unfinished jobs, most important first: by priority (higher first),
    /// then queue, then submission.
    pub(crate) fn rank(&self, input: &SchedulingInput<'_>) -> Vec<JobId> {
        let mut ranked = self.keys(input.now_ms, input.unfinished_jobs());
        ranked.sort_unstable_by_key(|r| r.key);
        ranked.into_iter().map(|r| r.key.3).collect()
    }

    /// The same order as [`Self::rank`], sorted only as far as it is read:
    /// the keys are heapified (linear) and popped one by one, so a round
    /// whose first few hundred jobs fill the cluster does not sort the
    /// thousands that wait behind them.
    ///
    /// Without queue admission (every unfinished job in the round), the
    /// jobs that have had no service are not read at all but merged in
    /// from the state's index of them, which holds them in their ranking
    /// order: they have attained nothing, so all are in the same queue and
    /// none is promoted, and their key is (priority, that queue,
    /// submission, id). They are most of the waiting jobs of a loaded
    /// cluster (BENCHMARKS, "The overloaded multi-GPU run").
    fn rank_lazily<'a>(&self, input: &SchedulingInput<'a>) -> impl Iterator<Item = &'a Job> {
        let merge_never_served = !input.admission.is_active();
        let state = input.state;
        let mut heap = BinaryHeap::from(if merge_never_served {
            // From the state's index of what ranking reads: the jobs are
            // read only as they are taken.
            state
                .served_unfinished()
                .map(|(id, service)| Ranked {
                    key: self.key(input.now_ms, id, service),
                    job: None,
                })
                .collect::<Vec<_>>()
        } else {
            self.keys(input.now_ms, input.unfinished_jobs())
        });
        let first_queue = self.queue_of(0);
        let mut never_served = merge_never_served
            .then(|| input.state.never_served_jobs())
            .into_iter()
            .flatten()
            .map(move |job| Ranked {
                key: (
                    Reverse(job.spec.priority),
                    first_queue,
                    job.submitted_at_ms,
                    job.id,
                ),
                job: Some(job),
            })
            .peekable();
        let taken = move |r: Ranked<'a>| r.job.or_else(|| state.job(r.key.3));
        std::iter::from_fn(move || loop {
            let next = match (heap.peek(), never_served.peek()) {
                (Some(served), Some(fresh)) if fresh.key < served.key => never_served.next(),
                (Some(_), _) => heap.pop(),
                (None, _) => never_served.next(),
            }?;
            // Every id of the index is a job of the state.
            if let Some(job) = taken(next) {
                return Some(job);
            }
        })
    }

    /// The queue of a job that has attained `attained_ms` of GPU-time
    /// (before any promotion).
    fn queue_of(&self, attained_ms: u64) -> usize {
        self.options
            .thresholds_gpu_s
            .iter()
            .take_while(|t| attained_ms >= t.saturating_mul(1000))
            .count()
    }

    fn keys<'a>(&self, now: u64, jobs: impl Iterator<Item = &'a Job>) -> Vec<Ranked<'a>> {
        jobs.map(|job| Ranked {
            key: self.key(now, job.id, &Service::of(job)),
            job: Some(job),
        })
        .collect()
    }

    /// Job `id`'s place in the ranking at `now`, from what it has had.
    fn key(&self, now: u64, id: JobId, service: &Service) -> RankKey {
        let mut queue = self.queue_of(service.attained_gpu_ms(now));
        let factor = self.options.starvation_factor;
        // How long it has run in all (service over its size), at least a
        // minute: a job preempted moments after it started must not come
        // back moments later.
        let executed_ms = (service.service_gpu_ms / service.min_gpus).max(MIN_RUN_MS);
        let promoted = match service.held {
            // Waiting long enough: back to queue 0.
            None => {
                factor > 0
                    && service.service_gpu_ms > 0
                    && now.saturating_sub(service.queued_since_ms)
                        >= executed_ms.saturating_mul(factor)
            }
            // Promoted and now running: it keeps queue 0 for a slice of
            // its wait, so it is not preempted again at the next pass.
            Some((_, decided_at_ms)) => {
                let waited = decided_at_ms.saturating_sub(service.queued_since_ms);
                factor > 0
                    && service.service_gpu_ms > 0
                    && waited >= executed_ms.saturating_mul(factor)
                    && now.saturating_sub(decided_at_ms) < waited / factor
            }
        };
        if promoted {
            queue = 0;
        }
        (
            Reverse(service.priority),
            queue,
            service.submitted_at_ms,
            id,
        )
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use keel_state::fixtures::{job_spec, TestCluster};
    use keel_state::model::GpuRef;
    use keel_state::{Command, JobPlacement, LogEntry};

    /// The lazily sorted ranking is the sorted one, read to its end, at
    /// times when running jobs cross thresholds and waiting ones are
    /// promoted.
    #[test]
    fn the_lazy_ranking_is_the_sorted_one() {
        let mut cluster = TestCluster::v100_nodes(&[8, 8]);
        let mut running = Vec::new();
        for i in 0..40u32 {
            let mut spec = job_spec(&format!("j{i}"), 1 + i % 2, 1);
            spec.priority = i32::try_from(i % 3).expect("small");
            let id = cluster.submit(spec);
            if i < 6 {
                running.push(id);
            }
        }
        for (n, id) in running.into_iter().enumerate() {
            let n = u32::try_from(n).expect("small");
            // Place each on GPUs of its own size.
            let job = cluster.state.job(id).expect("submitted");
            let size = job.spec.gpus;
            let gpus = (0..size)
                .map(|k| GpuRef {
                    node: format!("n{}", n % 2),
                    index: (n / 2) * 2 + k,
                })
                .collect();
            cluster.place(id, gpus);
        }
        let tiresias = Tiresias::new(TiresiasOptions {
            thresholds_gpu_s: vec![60, 600],
            starvation_factor: 2,
        });
        let same = |cluster: &TestCluster, now_ms: u64| {
            let input = SchedulingInput::everyone(&cluster.state, now_ms);
            let sorted = tiresias.rank(&input);
            assert_eq!(sorted.len(), 40);
            let lazy: Vec<JobId> = tiresias.rank_lazily(&input).map(|j| j.id).collect();
            assert_eq!(lazy, sorted, "at {now_ms} ms");
        };
        for now_ms in [1, 30_000, 90_000] {
            same(&cluster, now_ms);
        }
        // Two running jobs preempted after 100 s of service wait with it
        // (read, not merged from the index); one placed and preempted in
        // the same millisecond had none (merged like a job never placed).
        let (preempted, at_once) = ([1, 4], 21);
        cluster.place(
            at_once,
            vec![GpuRef {
                node: "n1".into(),
                index: 7,
            }],
        );
        for id in [at_once].into_iter().chain(preempted) {
            cluster.index += 1;
            let at_ms = if id == at_once { 1 } else { 100_000 };
            cluster
                .state
                .apply(
                    cluster.index,
                    &LogEntry::new(
                        at_ms,
                        Command::decide_allocation(
                            cluster.index - 1,
                            "test",
                            cluster.state.last_round() + 1,
                            vec![JobPlacement::alone(id, Vec::new())],
                        ),
                    ),
                )
                .expect("preempted");
        }
        let never_served: Vec<JobId> = cluster.state.never_served_jobs().map(|j| j.id).collect();
        assert!(never_served.contains(&at_once) && !never_served.contains(&1));
        let mut served: Vec<JobId> = cluster
            .state
            .served_unfinished_jobs()
            .map(|j| j.id)
            .collect();
        assert!(served.contains(&1) && served.contains(&4) && !served.contains(&at_once));
        served.extend(never_served);
        served.sort_unstable();
        let unfinished: Vec<JobId> = cluster.state.unfinished_jobs().map(|j| j.id).collect();
        assert_eq!(
            served, unfinished,
            "the two indexes split the unfinished jobs"
        );
        for now_ms in [100_000, 250_000, 700_000, 5_000_000] {
            same(&cluster, now_ms);
        }
    }
}
