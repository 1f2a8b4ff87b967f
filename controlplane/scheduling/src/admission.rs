//! Admission above the policies (issue 23, items 2 and 3): which waiting
//! jobs a round may start, within their queues' quotas and what they may
//! borrow, and which borrowers give GPUs back to a queue below its quota.
//! The policy in use then orders and sizes what is admitted
//! ([`crate::policy::SchedulingInput`] shows it only those jobs), and
//! [`Admission::fit`] holds its plan to the same [`QuotaBook`] `apply`
//! checks, so no placement it proposes is refused for quota.
//!
//! One round, with queues defined (none: every job is admitted, nothing
//! is computed):
//! 1. **Within quota.** Each queue's waiting jobs, higher priority first,
//!    then in submission order, are admitted while their minimum fits the
//!    queue's unused quota of a type they may use.
//! 2. **Reclaim.** Where what was admitted within quota needs more GPUs of
//!    a type than are free, the borrowers of that type (queues beyond
//!    their quota) give back running jobs, lowest priority first, then the
//!    most recently placed, never taking a borrower below its own quota,
//!    until enough are free. A reclaimed job is preempted by this round's
//!    decision (checkpoint and requeue, like any preemption).
//! 3. **Borrowing, by weight.** The GPUs still free after (1) are lent:
//!    the queue borrowing least for its weight (GPUs beyond its quotas over
//!    its weight) admits its next job that fits what it may borrow
//!    ([`QuotaBook::headroom`]) and what is free, then the next queue, and
//!    so on.
//!
//! A queue's scan passes over at most [`LOOKAHEAD`] jobs it cannot admit
//! in a round; the jobs behind them wait for a later round. A job is
//! admitted for the types it was admissible on: a job that may use several
//! types is shown to the policy allowed only those.
//!
//! Absences: no clock but the round's `now_ms`, no I/O, no randomness;
//! ordered maps only. Nothing here changes the state: reclaim is a plan's
//! preemption, decided and logged like any other.

use std::borrow::Cow;
use std::collections::{BTreeMap, BTreeSet, VecDeque};

use crate::placement::Placement;
use crate::policy::Plan;
use keel_state::command::JobPlacement;
use keel_state::model::{GpuRef, Job, JobId};
use keel_state::quota::{queue_of, QuotaBook};
use keel_state::state::{ClusterState, HeldGpus};

/// The most jobs of one queue a round passes over without admitting them.
pub const LOOKAHEAD: usize = 256;

/// Why a waiting job was not admitted this round (`keel job` says it).
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum WaitReason {
    /// It waits out a retry backoff.
    Backoff { until_ms: u64 },
    /// No node of the cluster, however free, could hold its minimum.
    NeverFits,
    /// Its queue has used its quota of every type the job may use, and
    /// has nothing more to borrow.
    OverQuota { queue: String },
    /// Its queue may take it, but the GPUs it could use are taken (by
    /// jobs within their quotas, or by this round's admissions).
    NoFreeGpus { queue: String },
    /// Within its queue's quota, but the GPUs are held by other queues'
    /// borrowing jobs that reclaim may not preempt (it would take them
    /// below their own quota): it starts when they end.
    HeldByBorrowers { queue: String },
    /// Not looked at: [`LOOKAHEAD`] jobs of its queue before it could not
    /// be admitted either.
    BehindInQueue { queue: String },
}

impl std::fmt::Display for WaitReason {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            WaitReason::Backoff { until_ms } => {
                write!(f, "waits out its retry backoff (until log time {until_ms} ms)")
            }
            WaitReason::NeverFits => write!(f, "no node of the cluster could hold it"),
            WaitReason::OverQuota { queue } => write!(
                f,
                "over quota: queue {queue:?} holds its quota of every type the job may use, and has nothing more to borrow"
            ),
            WaitReason::NoFreeGpus { queue } => write!(
                f,
                "queue {queue:?} may take it, but no fitting GPUs are free"
            ),
            WaitReason::HeldByBorrowers { queue } => write!(
                f,
                "within queue {queue:?}'s quota, waiting for GPUs other queues borrowed (their jobs cannot be preempted without taking them below their own quota)"
            ),
            WaitReason::BehindInQueue { queue } => write!(
                f,
                "behind {LOOKAHEAD} or more jobs of queue {queue:?} that wait too"
            ),
        }
    }
}

/// One round's admission.
#[derive(Debug, Default)]
pub struct Admission {
    /// Whether queues are defined (else everyone is admitted).
    active: bool,
    /// The waiting jobs admitted, each with its spec's types narrowed to
    /// those it was admitted on (`Some`: a narrowed copy).
    admitted: BTreeMap<JobId, Option<Job>>,
    /// Running jobs this round preempts to give quota back, and why.
    reclaimed: BTreeMap<JobId, String>,
    /// Why waiting jobs looked at were not admitted.
    waiting: BTreeMap<JobId, WaitReason>,
    /// Why the jobs of a queue that were not looked at wait, by queue.
    unreached: BTreeMap<String, WaitReason>,
}

static EVERYONE: Admission = Admission {
    active: false,
    admitted: BTreeMap::new(),
    reclaimed: BTreeMap::new(),
    waiting: BTreeMap::new(),
    unreached: BTreeMap::new(),
};

/// A queue's waiting jobs, as a round walks them.
struct Cursor<'a> {
    queue: String,
    rest: Box<dyn Iterator<Item = &'a Job> + 'a>,
    /// Jobs step 1 passed over, for step 3.
    missed: VecDeque<&'a Job>,
    /// Jobs passed over so far.
    misses: usize,
}

impl<'a> Cursor<'a> {
    fn next(&mut self) -> Option<&'a Job> {
        self.missed.pop_front().or_else(|| self.rest.next())
    }
}

impl Admission {
    /// Everyone admitted, nothing reclaimed: a cluster without queues.
    pub fn everyone() -> &'static Admission {
        &EVERYONE
    }

    /// Whether queues limit this round (else the policy sees every job).
    pub fn is_active(&self) -> bool {
        self.active
    }

    /// Whether `job_id` (waiting) was admitted.
    pub fn is_admitted(&self, job_id: JobId) -> bool {
        !self.active || self.admitted.contains_key(&job_id)
    }

    /// The admitted waiting jobs, by id, as the policy sees them.
    pub fn admitted<'a>(&'a self, state: &'a ClusterState) -> impl Iterator<Item = &'a Job> + 'a {
        self.admitted
            .iter()
            .filter_map(move |(id, narrowed)| narrowed.as_ref().or_else(|| state.job(*id)))
    }

    /// The admitted job `job_id` as the policy sees it (types narrowed).
    pub fn narrowed(&self, job_id: JobId) -> Option<&Job> {
        self.admitted.get(&job_id).and_then(Option::as_ref)
    }

    /// The running jobs this round preempts to give quota back.
    pub fn reclaimed(&self) -> &BTreeMap<JobId, String> {
        &self.reclaimed
    }

    /// Why waiting job `job` was not admitted; `None`: it was (or there
    /// are no queues, or it is not waiting).
    pub fn wait_reason(&self, job: &Job) -> Option<WaitReason> {
        if !self.active
            || job.allocation.is_some()
            || job.state.is_terminal()
            || self.admitted.contains_key(&job.id)
        {
            return None;
        }
        let queue = queue_of(&job.spec.queue);
        Some(
            self.waiting
                .get(&job.id)
                .or_else(|| self.unreached.get(queue))
                .cloned()
                .unwrap_or_else(|| WaitReason::BehindInQueue {
                    queue: queue.to_string(),
                }),
        )
    }

    /// The round's admission on `state` at `now_ms`, each queue's jobs
    /// taken in priority and submission order.
    pub fn of(state: &ClusterState, now_ms: u64) -> Admission {
        Admission::in_order(state, now_ms, None)
    }

    /// The round's admission on `state` at `now_ms`, each queue's jobs
    /// taken in `order` when given (the policy's ranking,
    /// [`crate::policy::Policy::admission_order`]; jobs it leaves out are
    /// not admitted), else in priority and submission order.
    pub fn in_order(state: &ClusterState, now_ms: u64, order: Option<&[JobId]>) -> Admission {
        let Some(mut book) = state.quota_book() else {
            return Admission::default();
        };
        let mut out = Admission {
            active: true,
            ..Admission::default()
        };
        let capacity = state.capacity();
        let mut free: BTreeMap<String, u64> = capacity
            .types()
            .map(|t| (t.clone(), state.free_gpus().free_of_type(t) as u64))
            .collect();
        // Shapes (GPUs per worker, minimum workers, allowed types) the
        // whole cluster could hold, worked out once each.
        let mut fits: BTreeMap<(u32, u32, Vec<String>), bool> = BTreeMap::new();
        let mut usable = |job: &Job, out: &mut Admission, now_ms: u64| -> Option<Vec<String>> {
            if job.backing_off(now_ms) {
                out.waiting.insert(
                    job.id,
                    WaitReason::Backoff {
                        until_ms: job.not_before_ms.unwrap_or(now_ms),
                    },
                );
                return None;
            }
            let spec = &job.spec;
            let shape = (spec.gpus, spec.workers.min, spec.gpu_types.allowed.clone());
            let fits = *fits
                .entry(shape)
                .or_insert_with(|| capacity.place(spec, spec.workers.min).is_some());
            if !fits {
                out.waiting.insert(job.id, WaitReason::NeverFits);
                return None;
            }
            Some(capacity.types_for(spec))
        };
        let demand =
            |job: &Job| u64::from(job.spec.gpus.max(1).saturating_mul(job.spec.workers.min));
        let gpus_of = |n: u64| u32::try_from(n).unwrap_or(u32::MAX);

        // 1. Within quota.
        let mut cursors: Vec<Cursor<'_>> = Vec::new();
        let mut within: BTreeMap<String, u64> = BTreeMap::new();
        // (job, queue, type, GPUs) admitted in step 1, in order.
        let mut charged: Vec<(JobId, String, String, u64)> = Vec::new();
        // GPUs of each type reclaim could free ([`reclaim_potential`]).
        let mut potential: Option<BTreeMap<String, u64>> = None;
        // Each queue's waiting jobs in the policy's order, when it gives
        // one.
        let mut ranked: BTreeMap<&str, Vec<&Job>> = BTreeMap::new();
        if let Some(order) = order {
            for job in order.iter().filter_map(|id| state.job(*id)) {
                if job.allocation.is_none() && !job.state.is_terminal() {
                    ranked
                        .entry(queue_of(&job.spec.queue))
                        .or_default()
                        .push(job);
                }
            }
        }
        for queue in state.queues_with_waiting_jobs() {
            let rest: Box<dyn Iterator<Item = &Job> + '_> = match order {
                Some(_) => Box::new(
                    ranked
                        .remove(queue.as_str())
                        .unwrap_or_default()
                        .into_iter(),
                ),
                None => Box::new(state.waiting_in_queue(queue)),
            };
            let mut cursor = Cursor {
                queue: queue.clone(),
                rest,
                missed: VecDeque::new(),
                misses: 0,
            };
            loop {
                let unused = book.unused_total(queue);
                if unused == 0 || cursor.misses >= LOOKAHEAD {
                    break;
                }
                let Some(job) = cursor.rest.next() else {
                    break;
                };
                let Some(types) = usable(job, &mut out, now_ms) else {
                    continue;
                };
                let d = demand(job);
                // A type with enough GPUs free for it (else reclaim must
                // free them), and of those the one whose unused quota it
                // fills best (the least left over, then the most free), so
                // larger holes stay for larger jobs; it is admitted on
                // that type alone.
                let within_quota: Vec<(String, u64)> = types
                    .into_iter()
                    .filter_map(|t| {
                        let unused = u64::from(book.quota(queue, &t))
                            .checked_sub(u64::from(book.used(queue, &t)) + d)?;
                        Some((t, unused))
                    })
                    .collect();
                let spare = |t: &str, potential: Option<&BTreeMap<String, u64>>| {
                    (free.get(t).copied().unwrap_or(0)
                        + potential.and_then(|p| p.get(t)).copied().unwrap_or(0))
                    .saturating_sub(within.get(t).copied().unwrap_or(0))
                };
                // Where nothing is free enough, what reclaim could free
                // counts too (worked out once, when first needed).
                if potential.is_none() && within_quota.iter().all(|(t, _)| spare(t, None) < d) {
                    potential = Some(reclaim_potential(state, &book));
                }
                let best = within_quota
                    .into_iter()
                    .map(|(t, unused)| {
                        let spare = spare(&t, potential.as_ref());
                        (spare < d, unused, std::cmp::Reverse(spare), t)
                    })
                    .min();
                match best {
                    Some((_, _, _, t)) => {
                        let _ = book.take(queue, &t, gpus_of(d));
                        *within.entry(t.clone()).or_default() += d;
                        charged.push((job.id, queue.clone(), t.clone(), d));
                        out.admit(job, vec![t], state);
                    }
                    None => {
                        cursor.missed.push_back(job);
                        cursor.misses += 1;
                        // A job its quota could hold holds the jobs behind
                        // it (they may still borrow, step 3): a large job
                        // is not passed over for ever by smaller ones
                        // taking each GPU its queue frees.
                        if book
                            .gpu_types()
                            .any(|t| u64::from(book.quota(queue, t)) >= d)
                        {
                            break;
                        }
                    }
                }
            }
            cursors.push(cursor);
        }

        // 2. Reclaim what borrowers hold of a type the admitted need.
        let short: Vec<(String, u64)> = within
            .iter()
            .filter_map(|(t, need)| {
                let have = free.get(t).copied().unwrap_or(0);
                (*need > have).then(|| (t.clone(), need - have))
            })
            .collect();
        if !short.is_empty() {
            out.reclaim(state, &mut book, &mut free, short);
            // What reclaim could not free (a borrower's job would take it
            // below its own quota) waits: the last admitted first, so no
            // admitted job waits on GPUs that will not come.
            for (job_id, queue, t, d) in charged.iter().rev() {
                let need = within.get(t).copied().unwrap_or(0);
                if need <= free.get(t).copied().unwrap_or(0) {
                    continue;
                }
                out.admitted.remove(job_id);
                out.waiting.insert(
                    *job_id,
                    WaitReason::HeldByBorrowers {
                        queue: queue.clone(),
                    },
                );
                book.give_back(queue, t, gpus_of(*d));
                if let Some(w) = within.get_mut(t) {
                    *w -= d;
                }
            }
        }

        // 3. Lend what is still free, the least-borrowing queue (for its
        //    weight) first.
        let mut room: BTreeMap<String, u64> = free
            .iter()
            .map(|(t, f)| {
                (
                    t.clone(),
                    f.saturating_sub(within.get(t).copied().unwrap_or(0)),
                )
            })
            .collect();
        let key = |book: &QuotaBook, queue: &str| {
            // Borrowed GPUs per unit of weight, in millionths.
            book.borrowed_total(queue).saturating_mul(1_000_000) / u64::from(book.weight(queue))
        };
        // Nothing free (a full cluster): nothing to lend, no turn to take.
        let mut turn: BTreeSet<(u64, usize)> = if room.values().all(|r| *r == 0) {
            BTreeSet::new()
        } else {
            cursors
                .iter()
                .enumerate()
                .map(|(i, c)| (key(&book, &c.queue), i))
                .collect()
        };
        while let Some((_, i)) = turn.pop_first() {
            if room.values().all(|r| *r == 0) {
                break;
            }
            let cursor = &mut cursors[i];
            let queue = cursor.queue.clone();
            let mut admitted = false;
            while cursor.misses < LOOKAHEAD {
                let Some(job) = cursor.next() else { break };
                let Some(types) = usable(job, &mut out, now_ms) else {
                    continue;
                };
                let d = demand(job);
                let may_borrow: Vec<String> = types
                    .into_iter()
                    .filter(|t| u64::from(book.headroom(&queue, t)) >= d)
                    .collect();
                // Where it fits what is free, the type whose unused quota
                // (its own first) it fills best, as in step 1.
                let best = may_borrow
                    .iter()
                    .filter_map(|t| {
                        let spare = room.get(t).copied().unwrap_or(0).checked_sub(d)?;
                        let unused = u64::from(book.quota(&queue, t))
                            .saturating_sub(u64::from(book.used(&queue, t)) + d);
                        Some((unused, std::cmp::Reverse(spare), t.clone()))
                    })
                    .min();
                let Some((_, _, t)) = best else {
                    let reason = if may_borrow.is_empty() {
                        WaitReason::OverQuota {
                            queue: queue.clone(),
                        }
                    } else {
                        WaitReason::NoFreeGpus {
                            queue: queue.clone(),
                        }
                    };
                    out.waiting.insert(job.id, reason);
                    cursor.misses += 1;
                    continue;
                };
                if book.take(&queue, &t, gpus_of(d)).is_err() {
                    cursor.misses += 1;
                    continue;
                }
                if let Some(r) = room.get_mut(&t) {
                    *r -= d;
                }
                out.admit(job, vec![t], state);
                admitted = true;
                break;
            }
            if admitted {
                turn.insert((key(&book, &queue), i));
            }
        }
        // The jobs no step reached: behind too many that wait, or their
        // queue may take no more, or nothing fitting was left free.
        for cursor in &cursors {
            let reason = if cursor.misses >= LOOKAHEAD {
                WaitReason::BehindInQueue {
                    queue: cursor.queue.clone(),
                }
            } else if book
                .gpu_types()
                .all(|t| book.headroom(&cursor.queue, t) == 0)
            {
                WaitReason::OverQuota {
                    queue: cursor.queue.clone(),
                }
            } else {
                WaitReason::NoFreeGpus {
                    queue: cursor.queue.clone(),
                }
            };
            out.unreached.insert(cursor.queue.clone(), reason);
        }
        out
    }

    /// Admits `job` for `types` (a copy with its types narrowed when they
    /// are fewer than it may use).
    fn admit(&mut self, job: &Job, types: Vec<String>, state: &ClusterState) {
        self.waiting.remove(&job.id);
        let allowed = &job.spec.gpu_types.allowed;
        let all = if allowed.is_empty() {
            state.capacity().types().count()
        } else {
            allowed.len()
        };
        let narrowed = (types.len() < all).then(|| {
            let mut copy = job.clone();
            copy.spec.gpu_types.allowed = types;
            copy
        });
        self.admitted.insert(job.id, narrowed);
    }

    /// Step 2: frees `short` GPUs of each type from the borrowers.
    fn reclaim(
        &mut self,
        state: &ClusterState,
        book: &mut QuotaBook,
        free: &mut BTreeMap<String, u64>,
        short: Vec<(String, u64)>,
    ) {
        let borrowers: Vec<String> = book.borrowers().cloned().collect();
        for (gpu_type, mut missing) in short {
            // The borrowers' running jobs on this type: lowest priority
            // first, then the most recently placed.
            let mut victims: Vec<(&Job, HeldGpus)> = borrowers
                .iter()
                .filter(|q| book.borrowed(q, &gpu_type) > 0)
                .flat_map(|q| state.holdings_in_queue(q))
                .filter(|(id, held)| {
                    held.preemptible()
                        && held.of_type(&gpu_type) > 0
                        && !self.reclaimed.contains_key(id)
                })
                .filter_map(|(id, held)| Some((state.job(id)?, held)))
                // A job sharing its GPUs with one that may not be preempted
                // stays with it (the pair is kept whole).
                .filter(|(j, _)| {
                    j.allocation
                        .as_ref()
                        .and_then(|a| a.shared_with)
                        .and_then(|p| state.job(p))
                        .is_none_or(|p| p.spec.preemptible)
                })
                .collect();
            victims.sort_by_key(|(j, _)| {
                let placed = j.allocation.as_ref().map_or(0, |a| a.decided_at_ms);
                (
                    j.spec.priority,
                    std::cmp::Reverse(placed),
                    std::cmp::Reverse(j.id),
                )
            });
            for (job, by_type) in victims {
                if missing == 0 {
                    break;
                }
                let queue = queue_of(&job.spec.queue);
                let held = by_type.of_type(&gpu_type);
                // Never below the borrower's own quota.
                if book.borrowed(queue, &gpu_type) < held {
                    continue;
                }
                for (t, n) in by_type.by_type() {
                    book.give_back(queue, t, n);
                    *free.entry(t.to_string()).or_default() += u64::from(n);
                }
                missing = missing.saturating_sub(u64::from(held));
                self.reclaimed.insert(
                    job.id,
                    format!(
                        "reclaimed: queue {queue:?} borrowed {gpu_type} GPUs that a queue below its quota needs"
                    ),
                );
            }
        }
    }

    /// Holds `plan` to the quotas, as `apply` will, and returns its
    /// changes ([`Plan::changes`]) once it holds: reclaimed jobs leave
    /// it; then, in job order, a placement that makes its queue hold more
    /// than it may is cut to the most whole workers (at least the job's
    /// minimum) that fit, or else the job keeps what it holds (a waiting
    /// job stays out). A pair is kept or dropped whole.
    pub fn fit<'a>(&self, state: &'a ClusterState, plan: &mut Plan<'a>) -> Vec<JobPlacement> {
        if !self.active {
            return plan.changes(state);
        }
        plan.list_the_rest(state);
        for id in self.reclaimed.keys() {
            plan.placements.remove(id);
            if let Some(partner) = plan.partners.remove(id) {
                plan.partners.remove(&partner);
                plan.placements.remove(&partner);
            }
        }
        // A job cut or kept as it was changes what the jobs after it may
        // take (a hold kept is not given back): check again until a pass
        // changes nothing, which is the pass `apply` makes. Each pass that
        // changes something removes a change, so this ends.
        loop {
            if let Some(changes) = self.fit_once(state, plan) {
                return changes;
            }
        }
    }

    /// One pass of [`Admission::fit`]: `None` when it changed `plan`,
    /// else the plan's changes (which hold to the quotas).
    fn fit_once<'a>(
        &self,
        state: &'a ClusterState,
        plan: &mut Plan<'a>,
    ) -> Option<Vec<JobPlacement>> {
        let changes = plan.changes(state);
        let Some(mut book) = state.quota_book() else {
            return Some(changes);
        };
        // (job, its queue, what it holds by type, its planned GPUs)
        type Growth<'s> = (JobId, &'s str, BTreeMap<String, u32>, Vec<GpuRef>);
        let mut growing: Vec<Growth<'_>> = Vec::new();
        for change in &changes {
            let Some(job) = state.job(change.job_id) else {
                continue;
            };
            let queue = queue_of(&job.spec.queue);
            let old = job
                .allocation
                .as_ref()
                .map(|a| state.gpus_by_type(&a.gpus))
                .unwrap_or_default();
            for (t, n) in &old {
                book.give_back(queue, t, *n);
            }
            let new = state.gpus_by_type(&change.gpus);
            if new
                .iter()
                .any(|(t, n)| *n > old.get(t).copied().unwrap_or(0))
            {
                growing.push((change.job_id, queue, old, change.gpus.clone()));
            } else {
                for (t, n) in &new {
                    book.force(queue, t, *n);
                }
            }
        }
        let mut dropped: Vec<JobId> = Vec::new();
        let mut cut = false;
        for (job_id, queue, old, gpus) in growing {
            let Some(job) = state.job(job_id) else {
                continue;
            };
            let per = job.spec.gpus.max(1) as usize;
            let min = job.spec.workers.min.max(1) as usize;
            // The most whole workers, down to the minimum, that fit.
            let mut fitted = None;
            let mut workers = gpus.len() / per;
            while workers >= min {
                let part = &gpus[..workers * per];
                let want = state.gpus_by_type(part);
                if try_take(&mut book, queue, &want) {
                    fitted = Some(part.to_vec());
                    break;
                }
                workers -= 1;
            }
            match fitted {
                Some(part) if part.len() == gpus.len() => {}
                Some(part) => {
                    plan.placements.insert(job_id, part.into());
                    cut = true;
                }
                None => {
                    for (t, n) in &old {
                        book.force(queue, t, *n);
                    }
                    dropped.push(job_id);
                }
            }
        }
        if !cut && dropped.is_empty() {
            return Some(changes);
        }
        for job_id in dropped {
            let current = state
                .job(job_id)
                .and_then(|j| j.allocation.as_ref())
                .map(|a| Cow::Borrowed(a.gpus.as_slice()));
            match current {
                Some(gpus) => {
                    plan.placements.insert(job_id, gpus);
                }
                None => {
                    plan.placements.remove(&job_id);
                }
            }
            if let Some(partner) = plan.partners.remove(&job_id) {
                plan.partners.remove(&partner);
                plan.placements.remove(&partner);
            }
        }
        None
    }
}

/// GPUs of each type reclaim could free: for each borrower and type, its
/// jobs holding that type, smallest first, while they add up to no more
/// than it borrows of it.
fn reclaim_potential(state: &ClusterState, book: &QuotaBook) -> BTreeMap<String, u64> {
    let mut potential: BTreeMap<String, u64> = BTreeMap::new();
    for queue in book.borrowers() {
        for (t, sizes) in state.preemptible_sizes_in_queue(queue) {
            let borrowed = u64::from(book.borrowed(queue, t));
            if borrowed > 0 {
                *potential.entry(t.clone()).or_default() += smallest_within(sizes, borrowed);
            }
        }
    }
    potential
}

/// The most of the jobs' holdings (`sizes`: size to how many jobs hold
/// it), smallest first, that add up to no more than `limit`.
fn smallest_within(sizes: &BTreeMap<u32, u32>, limit: u64) -> u64 {
    let mut freed = 0u64;
    for (size, count) in sizes {
        let size = u64::from(*size);
        let fit = (limit - freed)
            .checked_div(size)
            .unwrap_or(u64::from(*count));
        freed += size * fit.min(u64::from(*count));
        if fit < u64::from(*count) {
            break;
        }
    }
    freed
}

/// Takes every type of `want` for `queue`, or nothing.
fn try_take(book: &mut QuotaBook, queue: &str, want: &BTreeMap<String, u32>) -> bool {
    let mut taken: Vec<(&String, u32)> = Vec::new();
    for (t, n) in want {
        if book.take(queue, t, *n).is_err() {
            for (t, n) in taken {
                book.give_back(queue, t, n);
            }
            return false;
        }
        taken.push((t, *n));
    }
    true
}
