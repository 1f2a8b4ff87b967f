//! Quota accounting (issue 23, item 2): what each queue may hold of each
//! GPU type, given what every queue holds now. `apply` refuses a placement
//! that breaks it ([`QuotaBook::take`]); the scheduler's admission and its
//! last check of a plan use the same book, so a plan it proposes is not
//! refused for quota.
//!
//! The rules, per GPU type (a queue's quota for a type it does not name is
//! 0; the default queue without a quota has 0 of every type):
//! - a queue may always hold up to its quota;
//! - beyond it, a queue borrows: from the unused quota of the queues of its
//!   cohort (each lends at most its `lend_limit`), then from the *pool*, the
//!   cluster's GPUs beyond every queue's quota (live capacity less the sum
//!   of the quotas), which every queue shares. A queue in no cohort
//!   borrows from the pool only. A queue borrows at most its
//!   `borrow_limit` of a type (none named: no limit but the supply);
//! - a cohort's borrowing is covered by its members' lendable quota first;
//!   what exceeds it uses the pool. The pool's use may not grow beyond the
//!   pool. Growth within a queue's quota is never refused, even when it
//!   takes back quota a borrower was using: then the borrower holds more
//!   than it may, and the scheduler reclaims (item 3).
//!
//! How the pool is divided among queues that want it (by weight) is the
//! admission's choice, not a rule of this book: any division within the
//! pool is valid.
//!
//! Absences: no clock, no jobs, no placement; numbers of GPUs in, yes or no
//! (and why) out. Every map is ordered.

use std::collections::BTreeMap;

use crate::queue::{Queues, DEFAULT_QUEUE};

/// Why a queue may not take more GPUs of a type.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum QuotaRefusal {
    #[error(
        "queue {queue:?} would hold {would_hold} {gpu_type} GPUs, {} beyond its quota of {quota}; its borrow_limit for {gpu_type} is {limit}",
        would_hold - quota
    )]
    BorrowLimit {
        queue: String,
        gpu_type: String,
        would_hold: u32,
        quota: u32,
        limit: u32,
    },
    #[error(
        "queue {queue:?} would hold {would_hold} {gpu_type} GPUs, {} beyond its quota of {quota}, and {source} lend only {lendable} more",
        would_hold - quota,
        source = match cohort {
            Some(c) => format!("its cohort {c:?} and the GPUs beyond every quota"),
            None => "the GPUs beyond every quota (it is in no cohort)".to_string(),
        }
    )]
    NothingToBorrow {
        queue: String,
        gpu_type: String,
        would_hold: u32,
        quota: u32,
        cohort: Option<String>,
        lendable: u32,
    },
}

/// A queue's terms, as the book reads them.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
struct Terms {
    quota: BTreeMap<String, u32>,
    cohort: Option<String>,
    borrow_limit: BTreeMap<String, u32>,
    lend_limit: BTreeMap<String, u32>,
    weight: u32,
}

/// A cohort's sums for one type.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
struct CohortSums {
    /// What its members could lend: each one's unused quota, within its
    /// lending limit.
    lendable: u64,
    /// What its members hold beyond their quotas.
    over: u64,
}

impl CohortSums {
    /// What the cohort's borrowing takes from the pool.
    fn spill(&self) -> u64 {
        self.over.saturating_sub(self.lendable)
    }
}

/// One GPU type's book.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
struct TypeBook {
    /// GPUs beyond every queue's quota.
    pool: u64,
    /// GPUs each queue holds.
    used: BTreeMap<String, u32>,
    cohorts: BTreeMap<String, CohortSums>,
    /// What the borrowing takes from the pool: every cohort's spill and
    /// the loners' borrowing.
    pool_used: u64,
}

/// What every queue holds and may hold, by GPU type.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct QuotaBook {
    /// Shared between a book and its copies (a round's admission copies
    /// the state's book): the terms change only when the queues do.
    terms: std::sync::Arc<BTreeMap<String, Terms>>,
    types: BTreeMap<String, TypeBook>,
    /// During a trial ([`QuotaBook::begin_trial`]): what each (queue,
    /// type) held before the trial first changed it (a few per decision).
    trial: Option<Vec<(String, String, u32)>>,
}

impl QuotaBook {
    /// The book for `queues` on a cluster whose live GPUs are `capacity`
    /// (count by type), with `usage` (GPUs each queue's jobs hold, by
    /// queue, then type).
    pub fn new<'a>(
        queues: &Queues,
        capacity: impl IntoIterator<Item = (&'a String, usize)>,
        usage: &BTreeMap<String, BTreeMap<String, u32>>,
    ) -> QuotaBook {
        let terms: BTreeMap<String, Terms> = queues
            .all()
            .into_iter()
            .map(|(name, spec)| {
                (
                    name,
                    Terms {
                        quota: spec.quota.unwrap_or_default(),
                        cohort: spec.cohort,
                        borrow_limit: spec.borrow_limit,
                        lend_limit: spec.lend_limit,
                        weight: spec.weight.max(1),
                    },
                )
            })
            .collect();
        let mut book = QuotaBook {
            terms: std::sync::Arc::new(terms),
            types: BTreeMap::new(),
            trial: None,
        };
        for (gpu_type, count) in capacity {
            let quoted: u64 = book
                .terms
                .values()
                .map(|t| u64::from(t.quota.get(gpu_type).copied().unwrap_or(0)))
                .sum();
            let pool = (count as u64).saturating_sub(quoted);
            book.types.insert(
                gpu_type.clone(),
                TypeBook {
                    pool,
                    ..TypeBook::default()
                },
            );
        }
        // Every queue's quota is unused, so lendable, before anything is
        // held.
        for (gpu_type, type_book) in &mut book.types {
            for terms in book.terms.values() {
                if let Some(c) = &terms.cohort {
                    let unused = terms.quota.get(gpu_type).copied().unwrap_or(0);
                    type_book.cohorts.entry(c.clone()).or_default().lendable +=
                        u64::from(lendable(terms, gpu_type, unused));
                }
            }
        }
        for (queue, by_type) in usage {
            for (gpu_type, n) in by_type {
                book.force(queue, gpu_type, *n);
            }
        }
        book
    }

    /// Queue `queue`'s quota of `gpu_type` (0 when it names none).
    pub fn quota(&self, queue: &str, gpu_type: &str) -> u32 {
        self.terms
            .get(queue)
            .and_then(|t| t.quota.get(gpu_type))
            .copied()
            .unwrap_or(0)
    }

    /// Queue `queue`'s weight (1 for a queue the book does not know).
    pub fn weight(&self, queue: &str) -> u32 {
        self.terms.get(queue).map_or(1, |t| t.weight)
    }

    /// GPUs of `gpu_type` queue `queue` holds.
    pub fn used(&self, queue: &str, gpu_type: &str) -> u32 {
        self.types
            .get(gpu_type)
            .and_then(|t| t.used.get(queue))
            .copied()
            .unwrap_or(0)
    }

    /// GPUs of `gpu_type` queue `queue` holds beyond its quota.
    pub fn borrowed(&self, queue: &str, gpu_type: &str) -> u32 {
        self.used(queue, gpu_type)
            .saturating_sub(self.quota(queue, gpu_type))
    }

    /// GPUs queue `queue` holds beyond its quotas, all types together.
    pub fn borrowed_total(&self, queue: &str) -> u64 {
        self.types
            .keys()
            .map(|t| u64::from(self.borrowed(queue, t)))
            .sum()
    }

    /// The GPU types the book knows (the cluster's live ones).
    pub fn gpu_types(&self) -> impl Iterator<Item = &String> + '_ {
        self.types.keys()
    }

    /// The queues the book knows, the default one included.
    pub fn queues(&self) -> impl Iterator<Item = &String> + '_ {
        self.terms.keys()
    }

    /// Whether the borrowing of `gpu_type` exceeds what the cohorts and
    /// the pool lend: quota taken back from borrowers, or capacity lost.
    pub fn overcommitted(&self, gpu_type: &str) -> u64 {
        self.types
            .get(gpu_type)
            .map_or(0, |t| t.pool_used.saturating_sub(t.pool))
    }

    /// The most GPUs of `gpu_type` queue `queue` may take now
    /// ([`QuotaBook::take`] accepts any number up to it).
    pub fn headroom(&self, queue: &str, gpu_type: &str) -> u32 {
        let Some(book) = self.types.get(gpu_type) else {
            return 0;
        };
        let none = Terms::default();
        let terms = self.terms.get(queue).unwrap_or(&none);
        let used = self.used(queue, gpu_type);
        let quota = self.quota(queue, gpu_type);
        let under = quota.saturating_sub(used);
        let over = used.saturating_sub(quota);
        // Up to its quota, always; then, with its unused quota taken, what
        // its cohort has spare and what the pool has left.
        let lent_now = u64::from(lendable(terms, gpu_type, under));
        let spare = match &terms.cohort {
            Some(c) => {
                let sums = book.cohorts.get(c).copied().unwrap_or_default();
                let at_quota = CohortSums {
                    lendable: sums.lendable - lent_now,
                    over: sums.over,
                };
                let pool_used = book.pool_used - sums.spill() + at_quota.spill();
                at_quota.lendable.saturating_sub(at_quota.over)
                    + book.pool.saturating_sub(pool_used)
            }
            None => book.pool.saturating_sub(book.pool_used),
        };
        let limit = terms
            .borrow_limit
            .get(gpu_type)
            .map_or(u64::MAX, |l| u64::from(l.saturating_sub(over)));
        let beyond = u32::try_from(spare.min(limit)).unwrap_or(u32::MAX);
        under.saturating_add(beyond)
    }

    /// Queue `queue` takes `n` more GPUs of `gpu_type`, or is refused
    /// (nothing changes then). Within its quota it never is; beyond it,
    /// when it would pass its borrowing limit, or when the pool's use would
    /// grow beyond the pool.
    pub fn take(&mut self, queue: &str, gpu_type: &str, n: u32) -> Result<(), QuotaRefusal> {
        let used = self.used(queue, gpu_type);
        let quota = self.quota(queue, gpu_type);
        let would_hold = used.saturating_add(n);
        if would_hold <= quota {
            self.set_used(queue, gpu_type, would_hold);
            return Ok(());
        }
        let terms = self.terms.get(queue);
        if let Some(limit) = terms.and_then(|t| t.borrow_limit.get(gpu_type)) {
            if would_hold - quota > *limit {
                return Err(QuotaRefusal::BorrowLimit {
                    queue: queue.into(),
                    gpu_type: gpu_type.into(),
                    would_hold,
                    quota,
                    limit: *limit,
                });
            }
        }
        let room = self.headroom(queue, gpu_type);
        if n > room {
            return Err(QuotaRefusal::NothingToBorrow {
                queue: queue.into(),
                gpu_type: gpu_type.into(),
                would_hold,
                quota,
                cohort: terms.and_then(|t| t.cohort.clone()),
                lendable: room.saturating_sub(quota.saturating_sub(used)),
            });
        }
        self.set_used(queue, gpu_type, would_hold);
        Ok(())
    }

    /// Queue `queue` takes `n` more GPUs of `gpu_type` unchecked (what it
    /// held already, kept).
    pub fn force(&mut self, queue: &str, gpu_type: &str, n: u32) {
        let used = self.used(queue, gpu_type);
        self.set_used(queue, gpu_type, used.saturating_add(n));
    }

    /// Queue `queue` gives back `n` GPUs of `gpu_type`.
    pub fn give_back(&mut self, queue: &str, gpu_type: &str, n: u32) {
        let used = self.used(queue, gpu_type);
        self.set_used(queue, gpu_type, used.saturating_sub(n));
    }

    /// Starts a trial: the changes until [`QuotaBook::end_trial`] are
    /// undone then (what a decision tries before it is granted).
    pub fn begin_trial(&mut self) {
        self.trial = Some(Vec::new());
    }

    /// Ends a trial, putting back what every queue held before it.
    pub fn end_trial(&mut self) {
        if let Some(before) = self.trial.take() {
            for (queue, gpu_type, used) in before.into_iter().rev() {
                self.set_used(&queue, &gpu_type, used);
            }
        }
    }

    /// Sets what `queue` holds of `gpu_type`, keeping the sums.
    fn set_used(&mut self, queue: &str, gpu_type: &str, new: u32) {
        if let Some(trial) = &mut self.trial {
            if !trial.iter().any(|(q, t, _)| q == queue && t == gpu_type) {
                let before = self
                    .types
                    .get(gpu_type)
                    .and_then(|t| t.used.get(queue))
                    .copied()
                    .unwrap_or(0);
                trial.push((queue.to_string(), gpu_type.to_string(), before));
            }
        }
        if !self.terms.contains_key(queue) {
            // A queue the book does not know (none should hold GPUs):
            // quota 0, no cohort, weight 1.
            std::sync::Arc::make_mut(&mut self.terms).insert(
                queue.to_string(),
                Terms {
                    weight: 1,
                    ..Terms::default()
                },
            );
        }
        let quota = self.quota(queue, gpu_type);
        let Some(terms) = self.terms.get(queue) else {
            return;
        };
        if !self.types.contains_key(gpu_type) {
            self.types.insert(gpu_type.to_string(), TypeBook::default());
        }
        let Some(book) = self.types.get_mut(gpu_type) else {
            return;
        };
        let old = book.used.get(queue).copied().unwrap_or(0);
        if old == new {
            return;
        }
        let contribution = |used: u32| {
            (
                u64::from(used.saturating_sub(quota)),
                u64::from(lendable(terms, gpu_type, quota.saturating_sub(used))),
            )
        };
        let (old_over, old_lend) = contribution(old);
        let (new_over, new_lend) = contribution(new);
        match &terms.cohort {
            Some(c) => {
                if !book.cohorts.contains_key(c) {
                    book.cohorts.insert(c.clone(), CohortSums::default());
                }
                let Some(sums) = book.cohorts.get_mut(c) else {
                    return;
                };
                let old_spill = sums.spill();
                sums.over = sums.over - old_over + new_over;
                sums.lendable = sums.lendable - old_lend + new_lend;
                book.pool_used = book.pool_used - old_spill + sums.spill();
            }
            None => {
                book.pool_used = book.pool_used - old_over + new_over;
            }
        }
        if new == 0 {
            book.used.remove(queue);
        } else if let Some(used) = book.used.get_mut(queue) {
            *used = new;
        } else {
            book.used.insert(queue.to_string(), new);
        }
    }
}

/// What a queue lends of `unused` GPUs of `gpu_type`: within its lending
/// limit, and nothing outside a cohort.
fn lendable(terms: &Terms, gpu_type: &str, unused: u32) -> u32 {
    if terms.cohort.is_none() {
        return 0;
    }
    terms
        .lend_limit
        .get(gpu_type)
        .map_or(unused, |l| unused.min(*l))
}

/// A queue's name for a job's `queue` field (empty: the default queue).
pub fn queue_of(spec_queue: &str) -> &str {
    if spec_queue.is_empty() {
        DEFAULT_QUEUE
    } else {
        spec_queue
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::queue::QueueSpec;

    fn types(pairs: &[(&str, u32)]) -> BTreeMap<String, u32> {
        pairs.iter().map(|(t, n)| (t.to_string(), *n)).collect()
    }

    fn queues(specs: &[(&str, QueueSpec)]) -> Queues {
        let mut q = Queues::default();
        for (name, spec) in specs {
            q.create(name, spec, 1, None).expect("created");
        }
        q
    }

    fn in_cohort(quota: &[(&str, u32)], cohort: &str) -> QueueSpec {
        let mut spec = QueueSpec::with_quota(types(quota));
        spec.cohort = Some(cohort.into());
        spec
    }

    fn book_of(queues: &Queues, capacity: &[(&str, u32)]) -> QuotaBook {
        let capacity = types(capacity);
        QuotaBook::new(
            queues,
            capacity.iter().map(|(t, n)| (t, *n as usize)),
            &BTreeMap::new(),
        )
    }

    #[test]
    fn within_quota_always_then_the_cohort_lends_its_unused_quota() {
        let q = queues(&[
            ("a", in_cohort(&[("v100", 8)], "c")),
            ("b", in_cohort(&[("v100", 8)], "c")),
        ]);
        let mut book = book_of(&q, &[("v100", 16)]);
        assert_eq!(book.headroom("a", "v100"), 16, "8 own, 8 of b's");
        book.take("a", "v100", 12).expect("8 own and 4 borrowed");
        assert_eq!(book.borrowed("a", "v100"), 4);
        assert_eq!(book.headroom("b", "v100"), 8, "its quota, always");
        assert_eq!(book.headroom("a", "v100"), 4);
        // b takes its quota back: the book allows it and a is now
        // overcommitted by 4 (for reclaim to fix).
        book.take("b", "v100", 8).expect("within quota");
        assert_eq!(book.overcommitted("v100"), 4);
        assert_eq!(book.headroom("a", "v100"), 0);
        let refused = book.take("a", "v100", 1).expect_err("nothing to lend");
        assert!(
            refused
                .to_string()
                .contains("13 v100 GPUs, 5 beyond its quota of 8"),
            "{refused}"
        );
        book.give_back("a", "v100", 4);
        assert_eq!(book.overcommitted("v100"), 0);
        assert_eq!(book.used("a", "v100"), 8);
    }

    #[test]
    fn lending_and_borrowing_limits_and_the_pool() {
        let mut a = in_cohort(&[("v100", 8)], "c");
        a.borrow_limit = types(&[("v100", 2)]);
        let mut b = in_cohort(&[("v100", 8)], "c");
        b.lend_limit = types(&[("v100", 3)]);
        let loner = QueueSpec::with_quota(types(&[("v100", 4)]));
        let q = queues(&[("a", a), ("b", b), ("loner", loner)]);
        // 24 GPUs, 20 quoted: a pool of 4.
        let mut book = book_of(&q, &[("v100", 24)]);
        assert_eq!(book.headroom("a", "v100"), 10, "8 and at most 2 borrowed");
        assert!(matches!(
            book.take("a", "v100", 11),
            Err(QuotaRefusal::BorrowLimit { limit: 2, .. })
        ));
        assert_eq!(
            book.headroom("loner", "v100"),
            8,
            "its 4 and the pool's 4, not b's quota"
        );
        assert_eq!(book.headroom(DEFAULT_QUEUE, "v100"), 4, "the pool only");
        // The default queue takes the pool; b lends a 3 (its limit)...
        book.take(DEFAULT_QUEUE, "v100", 4).expect("the pool");
        assert_eq!(book.headroom("loner", "v100"), 4, "its quota only now");
        assert_eq!(book.headroom("a", "v100"), 10);
        book.take("a", "v100", 10).expect("2 borrowed of b's 3");
        // ... and nothing beyond b's lending limit reaches a cohort mate.
        let mut c = in_cohort(&[], "c");
        c.weight = 2;
        let q2 = queues(&[
            ("b", {
                let mut b = in_cohort(&[("v100", 8)], "c");
                b.lend_limit = types(&[("v100", 3)]);
                b
            }),
            ("c", c),
        ]);
        let mut book2 = book_of(&q2, &[("v100", 8)]);
        assert_eq!(book2.headroom("c", "v100"), 3);
        book2.take("c", "v100", 3).expect("lent");
        assert_eq!(book2.weight("c"), 2);
        assert!(matches!(
            book2.take("c", "v100", 1),
            Err(QuotaRefusal::NothingToBorrow { lendable: 0, .. })
        ));
    }

    #[test]
    fn a_book_rebuilt_from_usage_matches_one_built_step_by_step() {
        let q = queues(&[
            ("a", in_cohort(&[("v100", 4), ("k80", 2)], "c")),
            ("b", in_cohort(&[("v100", 4)], "c")),
            ("d", QueueSpec::with_quota(types(&[("k80", 2)]))),
        ]);
        let mut stepped = book_of(&q, &[("v100", 10), ("k80", 6)]);
        stepped.take("a", "v100", 7).expect("taken");
        stepped.take("d", "k80", 3).expect("taken");
        stepped.take(DEFAULT_QUEUE, "v100", 1).expect("taken");
        let mut usage: BTreeMap<String, BTreeMap<String, u32>> = BTreeMap::new();
        usage.insert("a".into(), types(&[("v100", 7)]));
        usage.insert("d".into(), types(&[("k80", 3)]));
        usage.insert(DEFAULT_QUEUE.into(), types(&[("v100", 1)]));
        let capacity = types(&[("v100", 10), ("k80", 6)]);
        let rebuilt = QuotaBook::new(&q, capacity.iter().map(|(t, n)| (t, *n as usize)), &usage);
        for queue in ["a", "b", "d", DEFAULT_QUEUE] {
            for t in ["v100", "k80"] {
                assert_eq!(
                    rebuilt.headroom(queue, t),
                    stepped.headroom(queue, t),
                    "{queue} {t}"
                );
            }
        }
        assert_eq!(rebuilt.borrowed_total("a"), 3);
    }

    /// `apply` holds every decision to the same book: a placement beyond
    /// quota and borrowing is refused for that job alone, which keeps what
    /// it had; within its quota a queue is never refused.
    #[test]
    fn apply_refuses_a_placement_beyond_quota_and_borrowing_for_that_job() {
        use crate::command::{Command, JobPlacement};
        use crate::event::Event;
        use crate::fixtures::{job_spec, TestCluster};
        use crate::model::GpuRef;
        let gpus = |node: &str, range: std::ops::Range<u32>| -> Vec<GpuRef> {
            range
                .map(|index| GpuRef {
                    node: node.into(),
                    index,
                })
                .collect()
        };
        // Two nodes of 4; queues a and b hold 4 each, in no cohort: no
        // pool, no borrowing.
        let mut c = TestCluster::v100_nodes(&[4, 4]);
        for name in ["a", "b"] {
            c.apply(Command::CreateQueue {
                name: name.into(),
                spec: QueueSpec::with_quota(types(&[("v100", 4)])),
            });
        }
        let in_queue = |queue: &str, name: &str, n: u32| {
            let mut spec = job_spec(name, n, 1);
            spec.queue = queue.into();
            spec
        };
        let a1 = c.submit(in_queue("a", "a1", 4));
        let a2 = c.submit(in_queue("a", "a2", 2));
        let b1 = c.submit(in_queue("b", "b1", 2));
        let events = c.apply(Command::DecideAllocation {
            based_on: c.index,
            policy: "test".into(),
            round: 1,
            placements: vec![
                JobPlacement::alone(a1, gpus("n0", 0..4)),
                JobPlacement::alone(a2, gpus("n1", 0..2)),
                JobPlacement::alone(b1, gpus("n1", 2..4)),
            ],
            memory: None,
        });
        let refused: Vec<(u64, &String)> = events
            .iter()
            .filter_map(|e| match e {
                Event::PlacementRefused { job_id, reason } => Some((*job_id, reason)),
                _ => None,
            })
            .collect();
        assert_eq!(refused.len(), 1, "{events:?}");
        assert_eq!(refused[0].0, a2);
        assert!(
            refused[0]
                .1
                .contains("queue \"a\" would hold 6 v100 GPUs, 2 beyond its quota of 4"),
            "{}",
            refused[0].1
        );
        assert!(c.state.job(a2).is_some_and(|j| j.allocation.is_none()));
        assert_eq!(
            c.state.queue_usage().get("a").and_then(|u| u.get("v100")),
            Some(&4)
        );
        assert_eq!(
            c.state.queue_usage().get("b").and_then(|u| u.get("v100")),
            Some(&2)
        );
        // a's job moving within its quota is no growth; a1 ending gives its
        // quota back, and a2 then fits.
        c.apply(Command::CancelJob {
            job_id: a1,
            reason: String::new(),
        });
        assert_eq!(c.state.queue_usage().get("a"), None);
        c.place(a2, gpus("n0", 0..2));
        assert_eq!(
            c.state.queue_usage().get("a").and_then(|u| u.get("v100")),
            Some(&2)
        );
        c.state.check_invariants().expect("invariants");
    }

    /// Issue 23, item 4, in `apply`: a running job that may not be
    /// preempted keeps its GPUs whatever a decision says (moved, emptied,
    /// or its GPUs given to another job); node loss is not a decision.
    #[test]
    fn apply_keeps_a_job_that_may_not_be_preempted_where_it_is() {
        use crate::command::{Command, JobPlacement};
        use crate::event::Event;
        use crate::fixtures::{job_spec, TestCluster};
        use crate::model::GpuRef;
        let gpu = |index| GpuRef {
            node: "n0".into(),
            index,
        };
        let mut c = TestCluster::v100_nodes(&[2]);
        let mut spec = job_spec("fixed", 1, 1);
        spec.preemptible = false;
        let fixed = c.submit(spec);
        let other = c.submit(job_spec("other", 1, 1));
        c.place(fixed, vec![gpu(0)]);
        for placements in [
            vec![JobPlacement::alone(fixed, vec![gpu(1)])],
            vec![JobPlacement::alone(fixed, Vec::new())],
            vec![
                JobPlacement::alone(fixed, Vec::new()),
                JobPlacement::alone(other, vec![gpu(0)]),
            ],
        ] {
            let events = c.apply(Command::DecideAllocation {
                based_on: c.index,
                policy: "test".into(),
                round: 9,
                placements,
                memory: None,
            });
            assert!(
                events.iter().any(|e| matches!(e,
                    Event::PlacementRefused { job_id, reason } if *job_id == fixed && reason.contains("not preemptible"))),
                "{events:?}"
            );
            assert!(
                !events
                    .iter()
                    .any(|e| matches!(e, Event::JobPreempted { .. })),
                "{events:?}"
            );
            assert_eq!(
                c.state
                    .job(fixed)
                    .and_then(|j| j.allocation.as_ref())
                    .map(|a| a.gpus.clone()),
                Some(vec![gpu(0)])
            );
        }
        // Another job may still take the free GPU.
        c.place(other, vec![gpu(1)]);
        assert!(c.state.job(other).is_some_and(|j| j.allocation.is_some()));
        c.state.check_invariants().expect("invariants");
    }
}
