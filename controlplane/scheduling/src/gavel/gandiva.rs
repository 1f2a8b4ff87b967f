//! `gandiva`: equal time shares; when the jobs ask for more GPUs than the
//! cluster has, jobs are paired at random (two of one size) to share GPUs,
//! as Gandiva does, and the pairs are kept from one solve to the next.
//!
//! The rules are Gavel's model of Gandiva, so its simulator's numbers can
//! be compared:
//! - A kept pair is dropped when either job has left, or when packing does
//!   not pay: the sum over types of both jobs' pair-to-alone throughput
//!   ratios is under 1 (or a figure is missing or 0). A job left alone is
//!   never kept: it is drawn again at the next solve.
//! - Not oversubscribed (`Σ s_i ≤ Σ N_j`): every job alone, equal shares.
//! - Oversubscribed: the jobs not in a kept pair are drawn two at a time
//!   (as many draws as there were such jobs); a draw of two sizes is
//!   skipped. Then every entry (pair or job alone) gets `N_j/m` of each
//!   type `j` over its size, `m` the number of entries, the row scaled to
//!   sum to at most 1.
//!
//! The draws follow Python's `random.Random(seed).sample(jobs, 2)`
//! exactly ([`PyRandom`]), so a run follows
//! Gavel's simulator pair for pair. Pure: the random stream is the only
//! state besides the pairs, both carried in [`Gandiva`].

use std::collections::{BTreeMap, BTreeSet};

use super::{Allocation, AllocationProblem, PairAllocation, PolicyResult, ProblemJobId};
use keel_state::rng::PyRandom;

/// Gandiva's memory between solves.
#[derive(Debug, Clone, serde::Serialize, serde::Deserialize)]
pub struct Gandiva {
    /// Kept pairs, each job mapped to its partner.
    pairs: BTreeMap<ProblemJobId, ProblemJobId>,
    rng: PyRandom,
}

impl Gandiva {
    /// Fresh memory, drawing as Python's `random.Random(seed)`.
    pub fn new(seed: u32) -> Gandiva {
        Gandiva {
            pairs: BTreeMap::new(),
            rng: PyRandom::new(seed),
        }
    }

    /// Whether packing `a` beside `b` pays: Σ over types of both jobs'
    /// pair-to-alone ratios is at least 1.
    fn pays(problem: &AllocationProblem, a: ProblemJobId, b: ProblemJobId) -> bool {
        let mut sum = 0.0;
        for t in problem.types() {
            let Some(figures) = problem.pair_throughput(a, b, t) else {
                return false;
            };
            for (job, f) in [a, b].into_iter().zip(figures) {
                if f <= 0.0 {
                    return false;
                }
                let alone = problem.throughput(job, t);
                if alone > 0.0 {
                    sum += f / alone;
                }
            }
        }
        sum >= 1.0
    }

    /// The next allocation for `problem`.
    pub fn allocate(&mut self, problem: &AllocationProblem) -> PolicyResult {
        let jobs: Vec<ProblemJobId> = problem.throughputs.keys().copied().collect();
        let active: BTreeSet<ProblemJobId> = jobs.iter().copied().collect();
        let kept: Vec<(ProblemJobId, ProblemJobId)> = self
            .pairs
            .iter()
            .filter(|(a, b)| a < b)
            .map(|(a, b)| (*a, *b))
            .filter(|(a, b)| {
                active.contains(a) && active.contains(b) && Self::pays(problem, *a, *b)
            })
            .collect();
        self.pairs.clear();
        for (a, b) in &kept {
            self.pairs.insert(*a, *b);
            self.pairs.insert(*b, *a);
        }

        let requested: u64 = jobs
            .iter()
            .map(|j| u64::from(problem.scale_factor(*j)))
            .sum();
        let available: u64 = problem.cluster_spec.values().map(|n| u64::from(*n)).sum();
        let (singles, pairs) = if requested <= available {
            (jobs, Vec::new())
        } else {
            let mut unpaired: Vec<ProblemJobId> = jobs
                .iter()
                .copied()
                .filter(|j| !self.pairs.contains_key(j))
                .collect();
            let draws = unpaired.len();
            let mut drawn = 0;
            while unpaired.len() > 1 && drawn < draws {
                drawn += 1;
                let [a, b] = self.rng.sample_two(&unpaired);
                if problem.scale_factor(a) != problem.scale_factor(b) {
                    continue;
                }
                unpaired.retain(|j| *j != a && *j != b);
                self.pairs.insert(a, b);
                self.pairs.insert(b, a);
            }
            let pairs: Vec<(ProblemJobId, ProblemJobId)> = self
                .pairs
                .iter()
                .filter(|(a, b)| a < b)
                .map(|(a, b)| (*a, *b))
                .collect();
            (unpaired, pairs)
        };

        let entries = (singles.len() + pairs.len()) as f64;
        let share = |scale_factor: u32| -> BTreeMap<String, f64> {
            let mut row: BTreeMap<String, f64> = problem
                .cluster_spec
                .iter()
                .map(|(t, n)| (t.clone(), f64::from(*n) / entries / f64::from(scale_factor)))
                .collect();
            let sum: f64 = row.values().sum();
            if sum > 1.0 {
                for x in row.values_mut() {
                    *x /= sum;
                }
            }
            row
        };
        let zero: BTreeMap<String, f64> = problem
            .cluster_spec
            .keys()
            .map(|t| (t.clone(), 0.0))
            .collect();
        let mut allocation = Allocation::new();
        for job in problem.throughputs.keys() {
            allocation.insert(*job, zero.clone());
        }
        for job in &singles {
            allocation.insert(*job, share(problem.scale_factor(*job)));
        }
        let pair_allocation: PairAllocation = pairs
            .iter()
            .map(|(a, b)| ((*a, *b), share(problem.scale_factor(*a))))
            .collect();
        problem.result_with_pairs(allocation, pair_allocation, None)
    }
}
