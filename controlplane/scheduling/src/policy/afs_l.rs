//! AFS-L (Hwang et al., as in Voda): GPUs are handed out one grant at a
//! time (a waiting job's first grant is its minimum, later ones one
//! worker). Each grant goes to the winner of pairwise comparisons along
//! the jobs ordered by estimated remaining time: the current candidate `j`
//! (shorter) loses to a longer job `jb` when
//! `(S_jb(n+1) − S_jb(n)) / S_jb(n+1) > (S_j(n+1) − S_j(n)) / S_j(n)`,
//! with `S` a job's speed from its performance model. A waiting job
//! (`S_j(0) = 0`) is never passed over for a longer one, so short jobs start
//! first and the spare GPUs go where they speed a job up most relative to
//! its length.

use crate::perf::JobPerf;

use super::sizing::{budget, candidates_in, per_worker, plan};
use super::{srjf, Plan, Policy, SchedulingInput};
use crate::topology::Sizes;

#[derive(Debug, Clone, Copy, Default)]
pub struct AfsL;

impl Policy for AfsL {
    fn name(&self) -> &'static str {
        "afs_l"
    }

    fn admission_order(
        &self,
        input: &SchedulingInput<'_>,
    ) -> Option<Vec<keel_state::model::JobId>> {
        Some(srjf::rank(input))
    }

    fn plan<'a>(&self, input: &SchedulingInput<'a>) -> Plan<'a> {
        let jobs = candidates_in(input, srjf::rank(input));
        // Speeds by job and worker count, worked out when first needed.
        let mut perf: Vec<Option<JobPerf<'_>>> = vec![None; jobs.len()];
        let mut speeds: Vec<Vec<Option<f64>>> = vec![Vec::new(); jobs.len()];
        let mut speed = |i: usize, n: u32| -> f64 {
            if n == 0 {
                return 0.0;
            }
            let at = n as usize;
            if let Some(Some(s)) = speeds[i].get(at) {
                return *s;
            }
            let p = perf[i].get_or_insert_with(|| JobPerf::of(jobs[i]));
            let s = p.steps_per_s_v100(n.saturating_mul(per_worker(jobs[i])));
            if speeds[i].len() <= at {
                speeds[i].resize(at + 1, None);
            }
            speeds[i][at] = Some(s);
            s
        };
        let mut workers = vec![0u32; jobs.len()];
        let mut left = budget(input.state);
        // The next grant of job i: its minimum first, then one worker.
        let grant = |i: usize, n: u32| -> u32 {
            if n == 0 {
                jobs[i].spec.workers.min
            } else {
                1
            }
        };
        loop {
            let fits = |i: usize, n: u32| {
                n < jobs[i].spec.workers.max
                    && grant(i, n).saturating_mul(per_worker(jobs[i])) <= left
            };
            let mut winner: Option<usize> = None;
            for i in 0..jobs.len() {
                if !fits(i, workers[i]) {
                    continue;
                }
                let Some(c) = winner else {
                    winner = Some(i);
                    continue;
                };
                let nc = workers[c];
                if nc == 0 {
                    // A waiting shorter job always keeps the grant.
                    break;
                }
                let (sc, sc_next) = (speed(c, nc), speed(c, nc + grant(c, nc)));
                let ni = workers[i];
                let (si, si_next) = (speed(i, ni), speed(i, ni + grant(i, ni)));
                let longer = if si_next > 0.0 {
                    (si_next - si) / si_next
                } else {
                    0.0
                };
                let shorter = if sc > 0.0 {
                    (sc_next - sc) / sc
                } else {
                    f64::INFINITY
                };
                if longer > shorter {
                    winner = Some(i);
                }
            }
            let Some(w) = winner else { break };
            let g = grant(w, workers[w]);
            left -= g * per_worker(jobs[w]);
            workers[w] += g;
        }
        let sizes: Sizes = jobs
            .iter()
            .zip(&workers)
            .filter(|(_, n)| **n > 0)
            .map(|(j, n)| (j.id, *n))
            .collect();
        plan(input, &sizes, &jobs)
    }
}
