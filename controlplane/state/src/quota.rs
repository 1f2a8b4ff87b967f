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

/// A queue's terms, by type id, as the book reads them.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
struct Terms {
    /// By type id (a type past the end: 0).
    quota: Vec<u32>,
    /// Its cohort's id.
    cohort: Option<usize>,
    borrow_limit: Vec<Option<u32>>,
    lend_limit: Vec<Option<u32>>,
    weight: u32,
}

impl Terms {
    fn quota(&self, t: usize) -> u32 {
        self.quota.get(t).copied().unwrap_or(0)
    }

    fn borrow_limit(&self, t: usize) -> Option<u32> {
        self.borrow_limit.get(t).copied().flatten()
    }

    /// What it lends of `unused` GPUs of type `t`: within its lending
    /// limit, and nothing outside a cohort.
    fn lendable(&self, t: usize, unused: u32) -> u32 {
        if self.cohort.is_none() {
            return 0;
        }
        match self.lend_limit.get(t).copied().flatten() {
            Some(limit) => unused.min(limit),
            None => unused,
        }
    }
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
    /// By cohort id.
    cohorts: Vec<CohortSums>,
    /// What the borrowing takes from the pool: every cohort's spill and
    /// the loners' borrowing.
    pool_used: u64,
}

/// The names behind the book's numbers: queues, types and cohorts are
/// small numbers inside (a queue's counters are a vector by type), names
/// only at its edges. Shared by a book and its copies (a round's admission
/// copies the state's book): they change only when a queue or a type the
/// book did not know turns up.
#[derive(Debug, Clone, Default)]
struct Names {
    queue_ids: BTreeMap<String, usize>,
    /// By queue id.
    terms: Vec<Terms>,
    type_ids: BTreeMap<String, usize>,
    types: Vec<String>,
    cohorts: Vec<String>,
}

/// What every queue holds and may hold, by GPU type.
#[derive(Debug, Clone, Default)]
pub struct QuotaBook {
    names: std::sync::Arc<Names>,
    /// By queue id, then type id: queue `q`'s holding of type `t` at
    /// `q * stride + t` (one allocation, so a round's copy is cheap).
    used: Vec<u32>,
    /// The types `used` has room for per queue.
    stride: usize,
    /// By type id: `None` for a type only a quota names (no live GPU).
    books: Vec<Option<TypeBook>>,
    /// During a trial ([`QuotaBook::begin_trial`]): what each (queue,
    /// type) held before the trial first changed it (a few per decision).
    trial: Option<Vec<(usize, usize, u32)>>,
}

/// Two books are equal when they say the same of every queue and type by
/// name (the numbers inside may differ: a book kept entry by entry meets
/// an unknown queue or type later than one built afresh).
impl PartialEq for QuotaBook {
    fn eq(&self, other: &QuotaBook) -> bool {
        self.view() == other.view()
    }
}

impl Eq for QuotaBook {}

/// A book by names: queues' terms and holdings, types' pools and sums.
type View<'a> = (
    BTreeMap<
        &'a str,
        (
            BTreeMap<&'a str, (u32, Option<u32>, Option<u32>)>,
            Option<&'a str>,
            u32,
        ),
    >,
    BTreeMap<(&'a str, &'a str), u32>,
    BTreeMap<&'a str, (u64, u64, BTreeMap<&'a str, CohortSums>)>,
);

impl QuotaBook {
    /// The book for `queues` on a cluster whose live GPUs are `capacity`
    /// (count by type), with `usage` (GPUs each queue's jobs hold, by
    /// queue, then type).
    pub fn new<'a>(
        queues: &Queues,
        capacity: impl IntoIterator<Item = (&'a String, usize)>,
        usage: &BTreeMap<String, BTreeMap<String, u32>>,
    ) -> QuotaBook {
        let specs = queues.each();
        let capacity: Vec<(&String, usize)> = capacity.into_iter().collect();
        let mut names = Names::default();
        // Every type a capacity or a term names, and every cohort.
        let mut type_names: std::collections::BTreeSet<&str> =
            capacity.iter().map(|(t, _)| t.as_str()).collect();
        let mut cohort_names: std::collections::BTreeSet<&str> = Default::default();
        for spec in specs.values() {
            type_names.extend(spec.quota.iter().flatten().map(|(t, _)| t.as_str()));
            type_names.extend(spec.borrow_limit.keys().map(String::as_str));
            type_names.extend(spec.lend_limit.keys().map(String::as_str));
            cohort_names.extend(spec.cohort.as_deref());
        }
        for t in type_names {
            names.type_ids.insert(t.to_string(), names.types.len());
            names.types.push(t.to_string());
        }
        names.cohorts = cohort_names.iter().map(|c| c.to_string()).collect();
        let by_type = |map: &BTreeMap<String, u32>, ids: &BTreeMap<String, usize>| {
            let mut v = vec![None; ids.len()];
            for (t, n) in map {
                if let Some(i) = ids.get(t) {
                    v[*i] = Some(*n);
                }
            }
            v
        };
        for (name, spec) in &specs {
            let quota = match &spec.quota {
                Some(quota) => by_type(quota, &names.type_ids)
                    .into_iter()
                    .map(|n| n.unwrap_or(0))
                    .collect(),
                None => vec![0; names.type_ids.len()],
            };
            let terms = Terms {
                quota,
                cohort: spec
                    .cohort
                    .as_deref()
                    .and_then(|c| names.cohorts.iter().position(|n| n == c)),
                borrow_limit: by_type(&spec.borrow_limit, &names.type_ids),
                lend_limit: by_type(&spec.lend_limit, &names.type_ids),
                weight: spec.weight.max(1),
            };
            names.queue_ids.insert(name.to_string(), names.terms.len());
            names.terms.push(terms);
        }
        let cohorts = names.cohorts.len();
        let mut books: Vec<Option<TypeBook>> = vec![None; names.types.len()];
        for (gpu_type, count) in &capacity {
            let Some(t) = names.type_ids.get(gpu_type.as_str()).copied() else {
                continue;
            };
            let quoted: u64 = names.terms.iter().map(|q| u64::from(q.quota(t))).sum();
            let mut book = TypeBook {
                pool: (*count as u64).saturating_sub(quoted),
                cohorts: vec![CohortSums::default(); cohorts],
                pool_used: 0,
            };
            // Every queue's quota is unused, so lendable, before anything
            // is held.
            for terms in &names.terms {
                if let Some(c) = terms.cohort {
                    book.cohorts[c].lendable += u64::from(terms.lendable(t, terms.quota(t)));
                }
            }
            books[t] = Some(book);
        }
        let mut book = QuotaBook {
            used: vec![0; names.terms.len() * names.types.len()],
            stride: names.types.len(),
            names: std::sync::Arc::new(names),
            books,
            trial: None,
        };
        for (queue, by_type) in usage {
            for (gpu_type, n) in by_type {
                book.force(queue, gpu_type, *n);
            }
        }
        book
    }

    /// The book's number for queue `queue` (what the `_at` calls take),
    /// if it knows the queue. A number stays the queue's for the book's
    /// life (copies included): names the book meets later get new ones.
    pub(crate) fn queue_id(&self, queue: &str) -> Option<usize> {
        self.names.queue_ids.get(queue).copied()
    }

    /// The book's number for `gpu_type`, as [`QuotaBook::queue_id`].
    pub(crate) fn type_id(&self, gpu_type: &str) -> Option<usize> {
        self.names.type_ids.get(gpu_type).copied()
    }

    /// [`QuotaBook::force`] by the book's numbers.
    pub(crate) fn force_at(&mut self, q: usize, t: usize, n: u32) {
        let used = self.used_at(q, t);
        self.set_used_at(q, t, used.saturating_add(n));
    }

    /// [`QuotaBook::give_back`] by the book's numbers.
    pub(crate) fn give_back_at(&mut self, q: usize, t: usize, n: u32) {
        let used = self.used_at(q, t);
        self.set_used_at(q, t, used.saturating_sub(n));
    }

    pub(crate) fn used_at(&self, q: usize, t: usize) -> u32 {
        if t >= self.stride {
            return 0;
        }
        self.used.get(q * self.stride + t).copied().unwrap_or(0)
    }

    pub(crate) fn quota_at(&self, q: usize, t: usize) -> u32 {
        self.names.terms.get(q).map_or(0, |terms| terms.quota(t))
    }

    /// Queue `queue`'s quota of `gpu_type` (0 when it names none).
    pub fn quota(&self, queue: &str, gpu_type: &str) -> u32 {
        match (self.queue_id(queue), self.type_id(gpu_type)) {
            (Some(q), Some(t)) => self.quota_at(q, t),
            _ => 0,
        }
    }

    /// Queue `queue`'s weight (1 for a queue the book does not know).
    pub fn weight(&self, queue: &str) -> u32 {
        self.queue_id(queue)
            .and_then(|q| self.names.terms.get(q))
            .map_or(1, |t| t.weight)
    }

    /// GPUs of `gpu_type` queue `queue` holds.
    pub fn used(&self, queue: &str, gpu_type: &str) -> u32 {
        match (self.queue_id(queue), self.type_id(gpu_type)) {
            (Some(q), Some(t)) => self.used_at(q, t),
            _ => 0,
        }
    }

    /// GPUs of `gpu_type` queue `queue` holds beyond its quota.
    pub fn borrowed(&self, queue: &str, gpu_type: &str) -> u32 {
        match (self.queue_id(queue), self.type_id(gpu_type)) {
            (Some(q), Some(t)) => self.used_at(q, t).saturating_sub(self.quota_at(q, t)),
            _ => 0,
        }
    }

    /// The live types' ids (those with GPUs, so with a book).
    fn live_types(&self) -> impl Iterator<Item = usize> + '_ {
        (0..self.books.len()).filter(|t| self.books[*t].is_some())
    }

    /// Queue number `q`'s holding beyond its quota (`over`) or its quota
    /// left (`!over`), all live types together.
    fn total_at(&self, q: usize, over: bool) -> u64 {
        self.live_types()
            .map(|t| {
                let (used, quota) = (self.used_at(q, t), self.quota_at(q, t));
                u64::from(if over {
                    used.saturating_sub(quota)
                } else {
                    quota.saturating_sub(used)
                })
            })
            .sum()
    }

    /// GPUs queue `queue` holds beyond its quotas, all types together.
    pub fn borrowed_total(&self, queue: &str) -> u64 {
        self.queue_id(queue).map_or(0, |q| self.total_at(q, true))
    }

    /// The queues holding more than their quota of some live type, by
    /// name.
    pub fn borrowers(&self) -> impl Iterator<Item = &String> + '_ {
        self.names
            .queue_ids
            .iter()
            .filter(|(_, q)| self.total_at(**q, true) > 0)
            .map(|(name, _)| name)
    }

    /// Queue `queue`'s unused quota, all live types together.
    pub fn unused_total(&self, queue: &str) -> u64 {
        self.queue_id(queue).map_or(0, |q| self.total_at(q, false))
    }

    /// The GPU types the book knows (the cluster's live ones).
    pub fn gpu_types(&self) -> impl Iterator<Item = &String> + '_ {
        self.names
            .type_ids
            .iter()
            .filter(|(_, t)| self.books.get(**t).is_some_and(Option::is_some))
            .map(|(name, _)| name)
    }

    /// The queues the book knows, the default one included.
    pub fn queues(&self) -> impl Iterator<Item = &String> + '_ {
        self.names.queue_ids.keys()
    }

    /// Whether the borrowing of `gpu_type` exceeds what the cohorts and
    /// the pool lend: quota taken back from borrowers, or capacity lost.
    pub fn overcommitted(&self, gpu_type: &str) -> u64 {
        self.type_id(gpu_type)
            .and_then(|t| self.books.get(t)?.as_ref())
            .map_or(0, |b| b.pool_used.saturating_sub(b.pool))
    }

    /// The most GPUs of `gpu_type` queue `queue` may take now
    /// ([`QuotaBook::take`] accepts any number up to it).
    pub fn headroom(&self, queue: &str, gpu_type: &str) -> u32 {
        let Some(t) = self.type_id(gpu_type) else {
            return 0;
        };
        self.headroom_at(self.queue_id(queue), t)
    }

    /// [`QuotaBook::headroom`] by ids (`None`: a queue the book does not
    /// know: no quota, no cohort).
    fn headroom_at(&self, q: Option<usize>, t: usize) -> u32 {
        let Some(book) = self.books.get(t).and_then(Option::as_ref) else {
            return 0;
        };
        let none = Terms::default();
        let terms = q.and_then(|q| self.names.terms.get(q)).unwrap_or(&none);
        let used = q.map_or(0, |q| self.used_at(q, t));
        let quota = terms.quota(t);
        let under = quota.saturating_sub(used);
        let over = used.saturating_sub(quota);
        // Up to its quota, always; then, with its unused quota taken, what
        // its cohort has spare and what the pool has left.
        let lent_now = u64::from(terms.lendable(t, under));
        let spare = match terms.cohort {
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
            .borrow_limit(t)
            .map_or(u64::MAX, |l| u64::from(l.saturating_sub(over)));
        let beyond = u32::try_from(spare.min(limit)).unwrap_or(u32::MAX);
        under.saturating_add(beyond)
    }

    /// Queue `queue` takes `n` more GPUs of `gpu_type`, or is refused
    /// (nothing changes then). Within its quota it never is; beyond it,
    /// when it would pass its borrowing limit, or when the pool's use would
    /// grow beyond the pool.
    pub fn take(&mut self, queue: &str, gpu_type: &str, n: u32) -> Result<(), QuotaRefusal> {
        let (q, t) = (self.queue_id(queue), self.type_id(gpu_type));
        let used = match (q, t) {
            (Some(q), Some(t)) => self.used_at(q, t),
            _ => 0,
        };
        let quota = match (q, t) {
            (Some(q), Some(t)) => self.quota_at(q, t),
            _ => 0,
        };
        let would_hold = used.saturating_add(n);
        if would_hold <= quota {
            self.set_used(queue, gpu_type, would_hold);
            return Ok(());
        }
        let terms = q.and_then(|q| self.names.terms.get(q));
        if let Some(limit) = t.and_then(|t| terms.and_then(|terms| terms.borrow_limit(t))) {
            if would_hold - quota > limit {
                return Err(QuotaRefusal::BorrowLimit {
                    queue: queue.into(),
                    gpu_type: gpu_type.into(),
                    would_hold,
                    quota,
                    limit,
                });
            }
        }
        let room = t.map_or(0, |t| self.headroom_at(q, t));
        if n > room {
            return Err(QuotaRefusal::NothingToBorrow {
                queue: queue.into(),
                gpu_type: gpu_type.into(),
                would_hold,
                quota,
                cohort: terms
                    .and_then(|terms| terms.cohort)
                    .and_then(|c| self.names.cohorts.get(c).cloned()),
                lendable: room.saturating_sub(quota.saturating_sub(used)),
            });
        }
        self.set_used(queue, gpu_type, would_hold);
        Ok(())
    }

    /// Queue `queue` takes `n` more GPUs of `gpu_type` unchecked (what it
    /// held already, kept).
    pub fn force(&mut self, queue: &str, gpu_type: &str, n: u32) {
        match (self.queue_id(queue), self.type_id(gpu_type)) {
            (Some(q), Some(t)) => self.force_at(q, t, n),
            _ => self.set_used(queue, gpu_type, n),
        }
    }

    /// Queue `queue` gives back `n` GPUs of `gpu_type`.
    pub fn give_back(&mut self, queue: &str, gpu_type: &str, n: u32) {
        if let (Some(q), Some(t)) = (self.queue_id(queue), self.type_id(gpu_type)) {
            self.give_back_at(q, t, n);
        }
    }

    /// Starts a trial: the changes until [`QuotaBook::end_trial`] are
    /// undone then (what a decision tries before it is granted).
    pub fn begin_trial(&mut self) {
        self.trial = Some(Vec::new());
    }

    /// Ends a trial, putting back what every queue held before it.
    pub fn end_trial(&mut self) {
        if let Some(before) = self.trial.take() {
            for (q, t, used) in before.into_iter().rev() {
                self.set_used_at(q, t, used);
            }
        }
    }

    /// Sets what `queue` holds of `gpu_type`, keeping the sums. A queue or
    /// a type the book does not know (none should hold GPUs) is added:
    /// quota 0, no cohort, weight 1; a type without live GPUs has no pool.
    fn set_used(&mut self, queue: &str, gpu_type: &str, new: u32) {
        let q = match self.queue_id(queue) {
            Some(q) => q,
            None if new == 0 => return,
            None => {
                let names = std::sync::Arc::make_mut(&mut self.names);
                let q = names.terms.len();
                names.queue_ids.insert(queue.to_string(), q);
                names.terms.push(Terms {
                    weight: 1,
                    ..Terms::default()
                });
                self.used.resize(self.used.len() + self.stride, 0);
                q
            }
        };
        let t = match self.type_id(gpu_type) {
            Some(t) => t,
            None if new == 0 => return,
            None => {
                let names = std::sync::Arc::make_mut(&mut self.names);
                let t = names.types.len();
                names.type_ids.insert(gpu_type.to_string(), t);
                names.types.push(gpu_type.to_string());
                self.books.push(None);
                // Room for the new type in every queue's row (the stride
                // is always the number of types).
                let queues = names.terms.len();
                let (old, stride) = (self.stride, self.stride + 1);
                let mut used = vec![0; queues * stride];
                for q in 0..queues {
                    if let Some(row) = self.used.get(q * old..(q + 1) * old) {
                        used[q * stride..q * stride + old].copy_from_slice(row);
                    }
                }
                self.used = used;
                self.stride = stride;
                t
            }
        };
        self.set_used_at(q, t, new);
    }

    fn set_used_at(&mut self, q: usize, t: usize, new: u32) {
        let old = self.used_at(q, t);
        if old == new {
            return;
        }
        if let Some(trial) = &mut self.trial {
            if !trial.iter().any(|(tq, tt, _)| *tq == q && *tt == t) {
                trial.push((q, t, old));
            }
        }
        let cohorts = self.names.cohorts.len();
        let Some(terms) = self.names.terms.get(q) else {
            return;
        };
        let Some(slot) = self.books.get_mut(t) else {
            return;
        };
        // A type with no live GPUs gets a book (no pool) once held.
        let book = slot.get_or_insert_with(|| TypeBook {
            cohorts: vec![CohortSums::default(); cohorts],
            ..TypeBook::default()
        });
        let quota = terms.quota(t);
        let contribution = |used: u32| {
            (
                u64::from(used.saturating_sub(quota)),
                u64::from(terms.lendable(t, quota.saturating_sub(used))),
            )
        };
        let (old_over, old_lend) = contribution(old);
        let (new_over, new_lend) = contribution(new);
        match terms.cohort.and_then(|c| book.cohorts.get_mut(c)) {
            Some(sums) => {
                let old_spill = sums.spill();
                sums.over = sums.over - old_over + new_over;
                sums.lendable = sums.lendable - old_lend + new_lend;
                book.pool_used = book.pool_used - old_spill + sums.spill();
            }
            None => {
                book.pool_used = book.pool_used - old_over + new_over;
            }
        }
        if let Some(slot) = self
            .used
            .get_mut(q * self.stride + t)
            .filter(|_| t < self.stride)
        {
            *slot = new;
        }
    }

    /// The book by names, for [`PartialEq`].
    fn view(&self) -> View<'_> {
        let names = &self.names;
        let type_name = |t: usize| names.types.get(t).map_or("", String::as_str);
        let queues = names
            .queue_ids
            .iter()
            .map(|(name, q)| {
                let terms = &names.terms[*q];
                let by_type = (0..names.types.len())
                    .map(|t| {
                        (
                            type_name(t),
                            (
                                terms.quota(t),
                                terms.borrow_limit(t),
                                terms.lend_limit.get(t).copied().flatten(),
                            ),
                        )
                    })
                    .filter(|(_, v)| *v != (0, None, None))
                    .collect();
                (
                    name.as_str(),
                    (
                        by_type,
                        terms
                            .cohort
                            .and_then(|c| names.cohorts.get(c))
                            .map(String::as_str),
                        terms.weight,
                    ),
                )
            })
            .collect();
        let mut used = BTreeMap::new();
        for (name, q) in &names.queue_ids {
            let row = self.used.get(q * self.stride..(q + 1) * self.stride);
            for (t, n) in row.into_iter().flatten().enumerate() {
                if *n > 0 {
                    used.insert((name.as_str(), type_name(t)), *n);
                }
            }
        }
        let books = self
            .books
            .iter()
            .enumerate()
            .filter_map(|(t, b)| {
                let b = b.as_ref()?;
                let cohorts = b
                    .cohorts
                    .iter()
                    .enumerate()
                    .filter(|(_, s)| **s != CohortSums::default())
                    .map(|(c, s)| (names.cohorts.get(c).map_or("", String::as_str), *s))
                    .collect();
                Some((type_name(t), (b.pool, b.pool_used, cohorts)))
            })
            .collect();
        (queues, used, books)
    }
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

    /// A queue or a type the book did not know, once held, gets its own
    /// counters beside the others' (which keep theirs).
    #[test]
    fn a_queue_or_type_first_met_when_held_is_added_beside_the_others() {
        let q = queues(&[("a", QueueSpec::with_quota(types(&[("v100", 2)])))]);
        let mut stepped = book_of(&q, &[("v100", 4)]);
        stepped.force("a", "v100", 2);
        stepped.force("a", "k80", 3);
        stepped.force("x", "v100", 1);
        stepped.force("x", "t4", 5);
        assert_eq!(stepped.used("a", "v100"), 2);
        assert_eq!(stepped.used("a", "k80"), 3);
        assert_eq!(stepped.used("x", "v100"), 1);
        assert_eq!(stepped.used("x", "t4"), 5);
        assert_eq!(stepped.used("x", "k80"), 0);
        assert_eq!(stepped.borrowed("a", "k80"), 3);
        let mut usage: BTreeMap<String, BTreeMap<String, u32>> = BTreeMap::new();
        usage.insert("a".into(), types(&[("v100", 2), ("k80", 3)]));
        usage.insert("x".into(), types(&[("v100", 1), ("t4", 5)]));
        let capacity = types(&[("v100", 4)]);
        let rebuilt = QuotaBook::new(&q, capacity.iter().map(|(t, n)| (t, *n as usize)), &usage);
        assert_eq!(rebuilt, stepped);
        stepped.give_back("x", "t4", 5);
        assert_ne!(rebuilt, stepped);
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
            c.apply(Command::create_queue(
                name,
                QueueSpec::with_quota(types(&[("v100", 4)])),
            ));
        }
        let in_queue = |queue: &str, name: &str, n: u32| {
            let mut spec = job_spec(name, n, 1);
            spec.queue = queue.into();
            spec
        };
        let a1 = c.submit(in_queue("a", "a1", 4));
        let a2 = c.submit(in_queue("a", "a2", 2));
        let b1 = c.submit(in_queue("b", "b1", 2));
        let events = c.apply(Command::decide_allocation(
            c.index,
            "test",
            1,
            vec![
                JobPlacement::alone(a1, gpus("n0", 0..4)),
                JobPlacement::alone(a2, gpus("n1", 0..2)),
                JobPlacement::alone(b1, gpus("n1", 2..4)),
            ],
        ));
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
        c.apply(Command::cancel_job(a1, String::new()));
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
            let events = c.apply(Command::decide_allocation(c.index, "test", 9, placements));
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
