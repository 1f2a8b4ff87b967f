//! FIFO: jobs start in arrival order, each with all of its GPUs at once.
//!
//! Running jobs keep their GPUs (FIFO never preempts; its plan names only
//! the jobs it starts, [`Plan::keeps_the_rest`]). Waiting jobs are taken
//! by priority (higher first), then in submission order; each gets as many workers as fit, from
//! `workers.max` down to `workers.min`, placed as a gang. When the head of
//! the queue does not fit, the queue stops there unless backfill is on, in
//! which case later jobs that fit start. A job that could not fit even on the
//! whole cluster (too many GPUs, or types the cluster lacks) is passed over
//! rather than blocking the queue forever, and so is a job waiting out its
//! retry backoff.

use crate::placement::Placement;
use std::borrow::Cow;
use std::collections::BTreeSet;

use keel_state::model::JobState;

use super::{Plan, Policy, QueueOptions, SchedulingInput};

#[derive(Debug, Clone, Copy, Default)]
pub struct Fifo {
    options: QueueOptions,
}

impl Fifo {
    pub fn new(options: QueueOptions) -> Self {
        Fifo { options }
    }
}

impl Policy for Fifo {
    fn name(&self) -> &'static str {
        "fifo"
    }

    fn plan<'a>(&self, input: &SchedulingInput<'a>) -> Plan<'a> {
        let state = input.state;
        let mut plan = Plan::default();
        let mut free = input.free_gpus();
        let capacity = state.capacity();
        if input.admission.is_active() {
            // Some running jobs may be reclaimed: name those that stay, in
            // id order (built in one pass rather than inserted one by one).
            plan.placements = input
                .allocated_jobs()
                .filter_map(|job| Some((job.id, Cow::Borrowed(&job.allocation.as_ref()?.gpus[..]))))
                .collect();
        } else {
            // Running jobs keep their GPUs: the plan names only the jobs it
            // starts, so a round costs what it starts, not what runs.
            plan.keeps_the_rest = true;
        }
        // Shapes (GPUs per worker, minimum workers, allowed types) that did
        // not fit this round. Free GPUs only shrink within a round, so a
        // later job of the same shape cannot fit either: backfill over
        // thousands of waiting jobs costs one attempt per distinct shape.
        let mut failed: BTreeSet<(u32, u32, &[String])> = BTreeSet::new();
        // Higher priority first; within a priority, arrival order (job ids
        // are assigned in submission order). Read from the state's index as
        // far as the round gets: with no GPU free, or a head that does not
        // fit, a long queue costs the round nothing.
        let waiting: Box<dyn Iterator<Item = _>> = if free.total() == 0 {
            Box::new(std::iter::empty())
        } else {
            input.waiting_jobs_by_priority()
        };
        for job in waiting {
            let job_id = &job.id;
            if !matches!(job.state, JobState::Pending | JobState::Preempted)
                || job.backing_off(input.now_ms)
            {
                continue;
            }
            if free.total() == 0 {
                break;
            }
            let spec = &job.spec;
            let shape = (
                spec.gpus,
                spec.workers.min,
                spec.gpu_types.allowed.as_slice(),
            );
            // Fewer workers never fit worse, so the minimum decides whether
            // the job fits at all; then take as many as fit.
            if failed.contains(&shape) {
                continue;
            }
            let fits = free.place(spec, spec.workers.min).map(|at_min| {
                (spec.workers.min + 1..=spec.workers.max)
                    .rev()
                    .find_map(|workers| free.place(spec, workers))
                    .unwrap_or(at_min)
            });
            match fits {
                Some(gpus) => {
                    free.remove(&gpus);
                    plan.placements.insert(*job_id, gpus.into());
                }
                None if capacity.place(spec, spec.workers.min).is_none() => {
                    // Can never run here; do not hold the queue up for it.
                    failed.insert(shape);
                }
                None if self.options.backfill => {
                    failed.insert(shape);
                }
                None => break,
            }
        }
        plan
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::policy::Policy;
    use keel_state::command::Command;
    use keel_state::fixtures::{job_spec, TestCluster};
    use keel_state::model::{GpuRef, JobId};

    /// The shared test cluster, plus FIFO rounds.
    struct World(TestCluster);

    impl std::ops::Deref for World {
        type Target = TestCluster;
        fn deref(&self) -> &TestCluster {
            &self.0
        }
    }

    impl std::ops::DerefMut for World {
        fn deref_mut(&mut self) -> &mut TestCluster {
            &mut self.0
        }
    }

    impl World {
        fn new(gpus_per_node: &[u32]) -> World {
            World(TestCluster::v100_nodes(gpus_per_node))
        }

        /// Runs one round and applies its decision; returns the jobs placed.
        fn round(&mut self, fifo: &Fifo) -> Vec<JobId> {
            let plan = fifo.plan(&SchedulingInput::everyone(&self.state, 1));
            let changes = plan.changes(&self.state);
            let placed = changes.iter().map(|p| p.job_id).collect();
            if !changes.is_empty() {
                let based_on = self.index;
                self.apply(Command::decide_allocation(based_on, "fifo", 1, changes));
            }
            self.state.check_invariants().expect("invariants");
            placed
        }
    }

    #[test]
    fn arrival_order_and_no_backfill_past_a_blocked_head() {
        let mut w = World::new(&[4]);
        w.submit(job_spec("a", 2, 1));
        w.submit(job_spec("b", 4, 1)); // does not fit while a runs
        w.submit(job_spec("c", 1, 1)); // would fit, but waits behind b
        let fifo = Fifo::default();
        assert_eq!(w.round(&fifo), vec![1]);
        assert_eq!(
            w.round(&fifo),
            Vec::<JobId>::new(),
            "a stable plan proposes nothing"
        );
        let backfill = Fifo::new(QueueOptions { backfill: true });
        assert_eq!(w.round(&backfill), vec![3]);
    }

    #[test]
    fn a_job_larger_than_the_cluster_does_not_block_the_queue() {
        let mut w = World::new(&[2]);
        w.submit(job_spec("huge", 8, 1));
        w.submit(job_spec("small", 1, 1));
        assert_eq!(w.round(&Fifo::default()), vec![2]);
    }

    #[test]
    fn running_jobs_keep_their_gpus_and_the_next_starts_when_one_ends() {
        let mut w = World::new(&[2, 2]);
        for name in ["a", "b", "c"] {
            w.submit(job_spec(name, 2, 1));
        }
        let fifo = Fifo::default();
        assert_eq!(w.round(&fifo), vec![1, 2]);
        let a_gpus = w
            .state
            .job(1)
            .and_then(|j| j.allocation.clone())
            .expect("a runs")
            .gpus;
        w.apply(Command::record_worker_exited(
            1,
            1,
            0,
            Some(0),
            String::new(),
        ));
        assert_eq!(w.state.job(1).map(|j| j.state), Some(JobState::Succeeded));
        assert_eq!(w.round(&fifo), vec![3]);
        let c_gpus = w
            .state
            .job(3)
            .and_then(|j| j.allocation.clone())
            .expect("c runs")
            .gpus;
        assert_eq!(a_gpus, c_gpus, "c takes the GPUs a released");
    }

    #[test]
    fn a_failed_job_waits_out_its_backoff_without_blocking_the_queue() {
        let mut w = World::new(&[1]);
        let mut flaky = job_spec("flaky", 1, 1);
        flaky.max_retries = 3;
        flaky.retry_backoff_s = 10;
        w.submit(flaky);
        w.submit(job_spec("next", 1, 1));
        let fifo = Fifo::default();
        assert_eq!(w.round(&fifo), vec![1]);
        // Fails at t = 1 ms (the World's entries are stamped at 1).
        w.apply(Command::record_worker_exited(
            1,
            1,
            0,
            Some(1),
            String::new(),
        ));
        let job = w.state.job(1).expect("job");
        assert_eq!(job.not_before_ms, Some(10_001));
        assert_eq!(w.state.next_backoff_end_ms(5_000), Some(10_001));
        // During the backoff the next job runs instead.
        let plan = fifo.plan(&SchedulingInput::everyone(&w.state, 5_000));
        assert_eq!(plan.placements.keys().copied().collect::<Vec<_>>(), vec![2]);
        // Once it is over, the flaky job is first in line again.
        let plan = fifo.plan(&SchedulingInput::everyone(&w.state, 10_001));
        assert_eq!(plan.placements.keys().copied().collect::<Vec<_>>(), vec![1]);
        // The wait doubles with each retry, up to the cap.
        let spec = &w.state.job(1).expect("job").spec;
        assert_eq!(spec.retry_backoff_ms(2), 20_000);
        assert_eq!(spec.retry_backoff_ms(30), 600_000);
    }

    #[test]
    fn elastic_jobs_get_as_many_workers_as_fit() {
        let mut w = World::new(&[3]);
        let mut spec = job_spec("elastic", 1, 1);
        spec.workers.max = 8;
        w.submit(spec);
        assert_eq!(w.round(&Fifo::default()), vec![1]);
        assert_eq!(w.state.job(1).map(|j| j.worker_count()), Some(3));
    }

    #[test]
    fn multi_worker_jobs_span_nodes_in_whole_workers() {
        let mut w = World::new(&[2, 2, 2]);
        w.submit(job_spec("big", 2, 3));
        assert_eq!(w.round(&Fifo::default()), vec![1]);
        let gpus = w
            .state
            .job(1)
            .and_then(|j| j.allocation.clone())
            .expect("runs")
            .gpus;
        let nodes: std::collections::BTreeSet<&str> =
            gpus.iter().map(|g| g.node.as_str()).collect();
        assert_eq!(nodes.len(), 3);
        assert!(gpus.contains(&GpuRef {
            node: "n2".into(),
            index: 1
        }));
    }
}
