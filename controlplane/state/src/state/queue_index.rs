//! What the queues' jobs hold and wait for (issue 23), derived from the
//! jobs, kept by `apply` once there are queues and not before: a cluster
//! that never made a queue pays nothing for them.
//!
//! - each job holding or waiting for GPUs in one slot: its queue, the
//!   allocation it is charged for (the epoch) and its priority while it
//!   waits, so an entry that changes neither costs one lookup;
//! - by queue: what each holding job holds by type and whether it may be
//!   preempted (what reclaim reads), the sizes of those holdings, and the
//!   waiting jobs in the order admission takes them (higher priority
//!   first, then submission order);
//! - the [`QuotaBook`] on the holdings' sum, which `apply`'s quota check
//!   and the scheduler read.
//!
//! Inside, queues and GPU types are small numbers given as they are first
//! met (and the book's own numbers for them, looked up once), so keeping
//! the index compares no names; names only at its edges.
//!
//! [`ClusterState::check_invariants`](super::ClusterState::check_invariants)
//! proves the kept index equals one built afresh.

use std::cmp::Reverse;
use std::collections::{BTreeMap, BTreeSet, VecDeque};

use smallvec::SmallVec;

use crate::free_gpus::FreeGpus;
use crate::model::{Allocation, GpuRef, Job, JobId, Node};
use crate::queue::{Queues, DEFAULT_QUEUE};
use crate::quota::{queue_of, QuotaBook};
use crate::state::JobMap;

/// A job holding GPUs or waiting for them, as the index knows it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct Slot {
    /// Its queue's number (a job's queue never changes).
    queue: usize,
    /// The epoch of the allocation it is charged for, while it holds one.
    charged: Option<u64>,
    /// Its priority, while it waits.
    waiting: Option<i32>,
}

/// The slots by job id, kept in a window from the lowest id with a slot to
/// the highest: ids are given in submission order and a job has a slot
/// only while it waits or holds GPUs, so the window is about as long as
/// the jobs submitted since the oldest unfinished one, and a lookup is an
/// index, not a search (what the queued `apply` stream spent most in;
/// BENCHMARKS, "The cost of queues").
#[derive(Debug, Clone, Default)]
struct Slots {
    /// The id of the window's first place.
    first: JobId,
    window: VecDeque<Option<Slot>>,
}

impl Slots {
    fn at(&self, id: JobId) -> Option<usize> {
        let at = usize::try_from(id.checked_sub(self.first)?).ok()?;
        (at < self.window.len()).then_some(at)
    }

    fn get(&self, id: JobId) -> Option<&Slot> {
        self.window.get(self.at(id)?)?.as_ref()
    }

    fn get_mut(&mut self, id: JobId) -> Option<&mut Slot> {
        let at = self.at(id)?;
        self.window.get_mut(at)?.as_mut()
    }

    fn insert(&mut self, id: JobId, slot: Slot) {
        if self.window.is_empty() {
            self.first = id;
        }
        while id < self.first {
            self.window.push_front(None);
            self.first -= 1;
        }
        let at = usize::try_from(id - self.first).unwrap_or(usize::MAX);
        if at >= self.window.len() {
            self.window.resize(at + 1, None);
        }
        self.window[at] = Some(slot);
    }

    fn remove(&mut self, id: JobId) {
        if let Some(at) = self.at(id) {
            self.window[at] = None;
        }
        while matches!(self.window.front(), Some(None)) {
            self.window.pop_front();
            self.first += 1;
        }
        while matches!(self.window.back(), Some(None)) {
            self.window.pop_back();
        }
    }

    fn iter(&self) -> impl Iterator<Item = (JobId, &Slot)> + '_ {
        (self.first..)
            .zip(&self.window)
            .filter_map(|(id, s)| Some((id, s.as_ref()?)))
    }

    fn iter_mut(&mut self) -> impl Iterator<Item = (JobId, &mut Slot)> + '_ {
        (self.first..)
            .zip(&mut self.window)
            .filter_map(|(id, s)| Some((id, s.as_mut()?)))
    }
}

/// GPUs by type number (a job's GPUs are of one or two types, held
/// without an allocation).
type ByType = SmallVec<[(usize, u32); 2]>;

/// What a holding job holds of its queue's quota.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
struct Held {
    /// Its GPUs by type number, in the order of the types' names.
    by_type: ByType,
    /// Whether reclaim may preempt it (`JobSpec::preemptible`).
    preemptible: bool,
}

/// What a holding job holds of its queue's quota, by type name (what
/// reclaim reads, without looking the job up).
#[derive(Debug, Clone, Copy)]
pub struct HeldGpus<'a> {
    held: &'a Held,
    types: &'a [String],
}

impl<'a> HeldGpus<'a> {
    /// Whether reclaim may preempt the job (`JobSpec::preemptible`).
    pub fn preemptible(&self) -> bool {
        self.held.preemptible
    }

    /// Its GPUs of `gpu_type`.
    pub fn of_type(&self, gpu_type: &str) -> u32 {
        self.by_type()
            .find(|(t, _)| *t == gpu_type)
            .map_or(0, |(_, n)| n)
    }

    /// Its GPUs by type, in the order of the types' names.
    pub fn by_type(&self) -> impl Iterator<Item = (&'a str, u32)> + 'a {
        let types = self.types;
        self.held
            .by_type
            .iter()
            .map(move |(t, n)| (types.get(*t).map_or("", String::as_str), *n))
    }
}

/// One queue's part of the index.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
struct QueueJobs {
    /// Its jobs holding GPUs, with what each holds (what reclaim looks
    /// through).
    holding: BTreeMap<JobId, Held>,
    /// By type number: the sizes of what its preemptible holding jobs hold
    /// of the type, size to how many jobs hold that many (what reclaim
    /// could free, read without walking the jobs).
    sizes: Vec<BTreeMap<u32, u32>>,
    /// Its unfinished jobs holding no GPUs, in admission order.
    waiting: BTreeSet<(Reverse<i32>, JobId)>,
}

impl QueueJobs {
    fn is_empty(&self) -> bool {
        self.holding.is_empty()
            && self.sizes.iter().all(BTreeMap::is_empty)
            && self.waiting.is_empty()
    }
}

/// A queue's or a type's number the book has not given (yet).
const NOT_IN_BOOK: usize = usize::MAX;

#[derive(Debug, Clone, Default)]
pub(super) struct QueueIndex {
    /// `None` while the cluster has no queue: nothing is kept.
    book: Option<QuotaBook>,
    /// Queue names to their numbers (given as queues are first met, never
    /// taken back while the index lives).
    ids: BTreeMap<String, usize>,
    /// Queue names by number.
    names: Vec<String>,
    /// By queue number: whether jobs may name the queue now. Every queue
    /// that exists has a number (given when the index is built or
    /// recharged, which every queue command does); a deleted queue keeps
    /// its number, marked not live, so its name is refused.
    live: Vec<bool>,
    /// The job the current entry submits and its queue's number, as the
    /// submission resolved it ([`QueueIndex::admit_queue_name`]), for its
    /// slot: the name is looked up once per submission.
    submitted: Option<(JobId, usize)>,
    /// By queue number.
    queues: Vec<QueueJobs>,
    /// GPU type names to their numbers, as for queues.
    type_ids: BTreeMap<String, usize>,
    /// Type names by number.
    types: Vec<String>,
    /// The book's numbers for the index's queues and types, by the
    /// index's numbers (`NOT_IN_BOOK`: the book does not know it). Looked
    /// up again whenever the book is built anew.
    book_queue: Vec<usize>,
    book_type: Vec<usize>,
    slots: Slots,
    /// A decision's new GPUs by type number and job, as the checks of its
    /// placements counted them ([`QueueIndex::note_counts`]; sorted by
    /// [`QueueIndex::within_quotas`]), for its quota pre-check and the
    /// charges of the same entry, which would count them again; emptied
    /// before each entry ([`QueueIndex::start_entry`]).
    counted: Vec<(JobId, ByType)>,
}

/// Two indexes are equal when they hold the same by queue and type name
/// (numbers are given in the order queues and types are met, which differs
/// between an index kept entry by entry and one built afresh).
impl PartialEq for QueueIndex {
    fn eq(&self, other: &QueueIndex) -> bool {
        self.book == other.book
            && self.view() == other.view()
            && self.live_names() == other.live_names()
    }
}

impl Eq for QueueIndex {}

/// A holding by type name, and whether it may be preempted.
type HeldView<'a> = (BTreeMap<&'a str, u32>, bool);

/// A queue's part by names: holdings, non-empty sizes, waiting jobs.
type QueueView<'a> = (
    BTreeMap<JobId, HeldView<'a>>,
    BTreeMap<&'a str, &'a BTreeMap<u32, u32>>,
    &'a BTreeSet<(Reverse<i32>, JobId)>,
);

/// An index by names: each queue's part, each job's slot.
type IndexView<'a> = (
    BTreeMap<&'a str, QueueView<'a>>,
    BTreeMap<JobId, (&'a str, Option<u64>, Option<i32>)>,
);

impl QueueIndex {
    /// The index of `jobs` with `queues` on a cluster of `nodes` whose
    /// live GPUs are `capacity` (empty while there are no queues).
    pub(super) fn of(
        jobs: &JobMap,
        nodes: &BTreeMap<String, Node>,
        queues: &Queues,
        capacity: &FreeGpus,
    ) -> QueueIndex {
        let mut index = QueueIndex::default();
        if queues.is_unset() {
            return index;
        }
        index.mark_live(queues);
        for (id, job) in jobs {
            index.place(*id, Some(job), nodes);
        }
        index.set_book(book_of(queues, capacity, &index.usage()));
        index
    }

    /// Charges every holding job afresh and builds the book again (after
    /// a node or a queue changed).
    pub(super) fn recharge(
        &mut self,
        jobs: &JobMap,
        nodes: &BTreeMap<String, Node>,
        queues: &Queues,
        capacity: &FreeGpus,
    ) {
        if queues.is_unset() {
            *self = QueueIndex::default();
            return;
        }
        if self.book.is_none() {
            // The first queue: start keeping the index.
            *self = QueueIndex::of(jobs, nodes, queues, capacity);
            return;
        }
        // The book is built below from the charges: none kept meanwhile.
        self.book = None;
        for part in &mut self.queues {
            part.holding.clear();
            part.sizes.clear();
        }
        let holding: Vec<JobId> = self
            .slots
            .iter_mut()
            .filter(|(_, slot)| slot.charged.is_some())
            .map(|(id, slot)| {
                slot.charged = None;
                id
            })
            .collect();
        self.mark_live(queues);
        for id in holding {
            self.place(id, jobs.get(&id).map(|j| &**j), nodes);
        }
        self.set_book(book_of(queues, capacity, &self.usage()));
    }

    /// Numbers every queue of `queues` (the default one too) and marks
    /// which numbers jobs may name now.
    fn mark_live(&mut self, queues: &Queues) {
        self.live.iter_mut().for_each(|live| *live = false);
        let names =
            std::iter::once(DEFAULT_QUEUE).chain(queues.stored().keys().map(String::as_str));
        for name in names {
            let q = self.queue_number(name);
            self.live[q] = true;
        }
    }

    /// The names jobs may name, by the index.
    fn live_names(&self) -> BTreeSet<&str> {
        self.ids
            .iter()
            .filter(|(_, q)| self.live[**q])
            .map(|(name, _)| name.as_str())
            .collect()
    }

    /// Whether a job may name queue `queue` (`""`: the default one), from
    /// the index's numbers while it is kept (`None`: it is not, ask the
    /// queues). A yes keeps the number for job `id`'s slot, which this
    /// entry makes next, so a submission looks its queue's name up once.
    pub(super) fn admit_queue_name(&mut self, id: JobId, queue: &str) -> Option<bool> {
        self.book.as_ref()?;
        let q = self
            .ids
            .get(queue_of(queue))
            .copied()
            .filter(|q| self.live[*q]);
        self.submitted = q.map(|q| (id, q));
        Some(q.is_some())
    }

    /// Puts job `id` (None: removed) where it now belongs.
    pub(super) fn update(&mut self, id: JobId, job: Option<&Job>, nodes: &BTreeMap<String, Node>) {
        if self.book.is_none() {
            return;
        }
        self.place(id, job, nodes);
    }

    /// GPUs each queue's jobs hold, by queue, then type (summed from the
    /// holding jobs: the book keeps the same sums, by type, then queue).
    pub(super) fn usage(&self) -> BTreeMap<String, BTreeMap<String, u32>> {
        let mut usage: BTreeMap<String, BTreeMap<String, u32>> = BTreeMap::new();
        for (queue, q) in &self.ids {
            let part = &self.queues[*q];
            if part.holding.is_empty() {
                continue;
            }
            let by_type = usage.entry(queue.clone()).or_default();
            for held in part.holding.values() {
                for (t, n) in &held.by_type {
                    *by_type.entry(self.types[*t].clone()).or_default() += n;
                }
            }
        }
        usage
    }

    pub(super) fn book(&self) -> Option<&QuotaBook> {
        self.book.as_ref()
    }

    /// The book, out of the index for a decision's trial
    /// ([`QueueIndex::put_book`] puts it back).
    pub(super) fn take_book(&mut self) -> Option<QuotaBook> {
        self.book.take()
    }

    /// Puts back the book [`QueueIndex::take_book`] took. A trial may
    /// have met queues or types new to it (numbered after the others), so
    /// the numbers it had not given are looked up again.
    pub(super) fn put_book(&mut self, book: QuotaBook) {
        self.book = Some(book);
        self.look_up_book_numbers(false);
    }

    /// Keeps what a decision's placement of job `id` holds by type, as
    /// the placement's check counted it, for [`QueueIndex::within_quotas`]
    /// and the charges of the same entry.
    pub(super) fn note_counts(&mut self, id: JobId, counts: &[(&str, u32)]) {
        let by_type = self.numbered(counts);
        self.counted.push((id, by_type));
    }

    /// Whether a decision's changes (the jobs `ids`, whose new GPUs
    /// [`QueueIndex::note_counts`] kept), net of what those jobs hold now,
    /// leave every queue within its quota of every type: then no growth
    /// can be refused (releases come first, so each one meets a smaller
    /// hold) and the decision needs no trial. `false` also when it cannot
    /// say (a job without counts, a job, a type or a queue the index or
    /// the book does not know yet). Counts of jobs not in `ids` (refused
    /// since) are passed over.
    pub(super) fn within_quotas(&mut self, ids: impl Iterator<Item = JobId>) -> bool {
        let Some(book) = &self.book else {
            return true;
        };
        if !self.counted.is_sorted_by_key(|(id, _)| *id) {
            self.counted.sort_unstable_by_key(|(id, _)| *id);
        }
        let mut net: SmallVec<[(usize, usize, i64); 4]> = SmallVec::new();
        let mut add = |q: usize, t: usize, n: i64| match net
            .iter_mut()
            .find(|(nq, nt, _)| *nq == q && *nt == t)
        {
            Some((_, _, d)) => *d += n,
            None => net.push((q, t, n)),
        };
        for id in ids {
            let Ok(at) = self.counted.binary_search_by_key(&id, |(j, _)| *j) else {
                return false;
            };
            let Some(slot) = self.slots.get(id) else {
                return false;
            };
            let q = slot.queue;
            if let Some(held) = self.queues[q].holding.get(&id) {
                for (t, n) in &held.by_type {
                    add(q, *t, -i64::from(*n));
                }
            }
            for (t, n) in &self.counted[at].1 {
                add(q, *t, i64::from(*n));
            }
        }
        net.iter().all(|(q, t, d)| {
            if *d <= 0 {
                return true;
            }
            let (bq, bt) = (self.book_queue[*q], self.book_type[*t]);
            bq != NOT_IN_BOOK
                && bt != NOT_IN_BOOK
                && i64::from(book.used_at(bq, bt)) + d <= i64::from(book.quota_at(bq, bt))
        })
    }

    /// Forgets what the entry before resolved: a decision's pre-check's
    /// counts, a submission's queue number (before each entry).
    pub(super) fn start_entry(&mut self) {
        self.counted.clear();
        self.submitted = None;
    }

    /// GPUs of each type number in `gpus`, in the order of the types'
    /// names (numbers given to types met for the first time; a GPU of a
    /// node the state does not know counts as type "").
    fn count_types(&mut self, nodes: &BTreeMap<String, Node>, gpus: &[GpuRef]) -> ByType {
        self.numbered(&super::type_counts(nodes, gpus))
    }

    /// GPU counts by type name as counts by type number, in the order of
    /// the types' names (numbers given to types met for the first time).
    fn numbered(&mut self, counts: &[(&str, u32)]) -> ByType {
        let mut by_type: ByType = counts
            .iter()
            .map(|(name, n)| (self.type_number(name), *n))
            .collect();
        if by_type.len() > 1 {
            by_type.sort_unstable_by(|x, y| self.types[x.0].cmp(&self.types[y.0]));
        }
        by_type
    }

    fn part(&self, queue: &str) -> Option<&QueueJobs> {
        self.ids.get(queue).map(|q| &self.queues[*q])
    }

    pub(super) fn waiting_in<'a>(&'a self, queue: &str) -> impl Iterator<Item = JobId> + 'a {
        self.part(queue)
            .into_iter()
            .flat_map(|p| p.waiting.iter())
            .map(|(_, id)| *id)
    }

    /// The jobs of `queue` holding GPUs, each with what it holds.
    pub(super) fn holding_in<'a>(
        &'a self,
        queue: &str,
    ) -> impl Iterator<Item = (JobId, HeldGpus<'a>)> + 'a {
        let types = self.types.as_slice();
        self.part(queue)
            .into_iter()
            .flat_map(|p| p.holding.iter())
            .map(move |(id, held)| (*id, HeldGpus { held, types }))
    }

    /// What the preemptible jobs of `queue` hold, by type name: each size
    /// (GPUs of the type one job holds) and how many jobs hold it,
    /// smallest first.
    pub(super) fn preemptible_sizes_in<'a>(
        &'a self,
        queue: &str,
    ) -> impl Iterator<Item = (&'a String, &'a BTreeMap<u32, u32>)> + 'a {
        let part = self.part(queue);
        self.type_ids.iter().filter_map(move |(name, t)| {
            let sizes = part?.sizes.get(*t)?;
            (!sizes.is_empty()).then_some((name, sizes))
        })
    }

    /// The queues with waiting jobs, by name.
    pub(super) fn queues_with_waiting(&self) -> impl Iterator<Item = &String> + '_ {
        self.ids
            .iter()
            .filter(|(_, q)| !self.queues[**q].waiting.is_empty())
            .map(|(name, _)| name)
    }

    /// The number of queue `queue`, given now if it has none.
    fn queue_number(&mut self, queue: &str) -> usize {
        if let Some(q) = self.ids.get(queue) {
            return *q;
        }
        let q = self.queues.len();
        self.ids.insert(queue.to_string(), q);
        self.names.push(queue.to_string());
        self.live.push(false);
        self.queues.push(QueueJobs::default());
        let in_book = self.book.as_ref().and_then(|b| b.queue_id(queue));
        self.book_queue.push(in_book.unwrap_or(NOT_IN_BOOK));
        q
    }

    /// The number of GPU type `gpu_type`, given now if it has none.
    fn type_number(&mut self, gpu_type: &str) -> usize {
        if let Some(t) = self.type_ids.get(gpu_type) {
            return *t;
        }
        let t = self.types.len();
        self.type_ids.insert(gpu_type.to_string(), t);
        self.types.push(gpu_type.to_string());
        let in_book = self.book.as_ref().and_then(|b| b.type_id(gpu_type));
        self.book_type.push(in_book.unwrap_or(NOT_IN_BOOK));
        t
    }

    fn set_book(&mut self, book: QuotaBook) {
        self.book = Some(book);
        self.look_up_book_numbers(true);
    }

    /// Looks up the book's numbers for the index's queues and types: all
    /// of them (`afresh`: a new book), or those it had not given.
    fn look_up_book_numbers(&mut self, afresh: bool) {
        let Some(book) = &self.book else {
            return;
        };
        for (q, name) in self.names.iter().enumerate() {
            if afresh || self.book_queue[q] == NOT_IN_BOOK {
                self.book_queue[q] = book.queue_id(name).unwrap_or(NOT_IN_BOOK);
            }
        }
        for (t, name) in self.types.iter().enumerate() {
            if afresh || self.book_type[t] == NOT_IN_BOOK {
                self.book_type[t] = book.type_id(name).unwrap_or(NOT_IN_BOOK);
            }
        }
    }

    /// Queue `q` takes (`more`) or gives back `n` GPUs of type `t` in the
    /// book, by the book's numbers when it has them.
    fn book_change(&mut self, q: usize, t: usize, n: u32, more: bool) {
        let Some(book) = &mut self.book else {
            return;
        };
        let (bq, bt) = (self.book_queue[q], self.book_type[t]);
        if bq != NOT_IN_BOOK && bt != NOT_IN_BOOK {
            if more {
                book.force_at(bq, bt, n);
            } else {
                book.give_back_at(bq, bt, n);
            }
            return;
        }
        // A queue or type the book does not know (none should hold GPUs):
        // by name, which adds it; then its new numbers.
        if more {
            book.force(&self.names[q], &self.types[t], n);
        } else {
            book.give_back(&self.names[q], &self.types[t], n);
        }
        self.book_queue[q] = book.queue_id(&self.names[q]).unwrap_or(NOT_IN_BOOK);
        self.book_type[t] = book.type_id(&self.types[t]).unwrap_or(NOT_IN_BOOK);
    }

    fn view(&self) -> IndexView<'_> {
        let type_name = |t: &usize| self.types[*t].as_str();
        (
            self.ids
                .iter()
                .map(|(name, q)| (name.as_str(), &self.queues[*q]))
                .filter(|(_, part)| !part.is_empty())
                .map(|(name, part)| {
                    let holding = part
                        .holding
                        .iter()
                        .map(|(id, held)| {
                            let by_type = held
                                .by_type
                                .iter()
                                .map(|(t, n)| (type_name(t), *n))
                                .collect();
                            (*id, (by_type, held.preemptible))
                        })
                        .collect();
                    let sizes = part
                        .sizes
                        .iter()
                        .enumerate()
                        .filter(|(_, s)| !s.is_empty())
                        .map(|(t, s)| (type_name(&t), s))
                        .collect();
                    (name, (holding, sizes, &part.waiting))
                })
                .collect(),
            self.slots
                .iter()
                .map(|(id, s)| (id, (self.names[s.queue].as_str(), s.charged, s.waiting)))
                .collect(),
        )
    }

    /// Puts job `id` (None: removed) where it now belongs: charged for
    /// what it holds, or in its queue's waiting set, or out of the index.
    fn place(&mut self, id: JobId, job: Option<&Job>, nodes: &BTreeMap<String, Node>) {
        let alloc = job.and_then(|j| j.allocation.as_ref());
        let charged = alloc.map(|a| a.epoch);
        let waiting = job
            .filter(|j| !j.state.is_terminal() && j.allocation.is_none())
            .map(|j| j.spec.priority);
        match self.slots.get_mut(id) {
            Some(slot) => {
                if slot.charged != charged || slot.waiting != waiting {
                    let mut moved = *slot;
                    self.move_slot(&mut moved, id, job, nodes, charged, waiting);
                    if moved.charged.is_none() && moved.waiting.is_none() {
                        self.slots.remove(id);
                    } else if let Some(slot) = self.slots.get_mut(id) {
                        *slot = moved;
                    }
                }
            }
            None => {
                if let Some(j) = job.filter(|_| charged.is_some() || waiting.is_some()) {
                    let queue = match self.submitted {
                        Some((submitted, q)) if submitted == id => q,
                        _ => self.queue_number(queue_of(&j.spec.queue)),
                    };
                    let mut slot = Slot {
                        queue,
                        charged: None,
                        waiting: None,
                    };
                    self.move_slot(&mut slot, id, job, nodes, charged, waiting);
                    self.slots.insert(id, slot);
                }
            }
        }
    }

    /// Moves job `id`'s `slot` to what it holds (`charged`) and whether it
    /// waits (`waiting`) now.
    fn move_slot(
        &mut self,
        slot: &mut Slot,
        id: JobId,
        job: Option<&Job>,
        nodes: &BTreeMap<String, Node>,
        charged: Option<u64>,
        waiting: Option<i32>,
    ) {
        let q = slot.queue;
        if slot.charged != charged {
            if slot.charged.is_some() {
                self.uncharge(id, q);
            }
            if let Some((j, a)) = job.and_then(|j| Some((j, j.allocation.as_ref()?))) {
                self.charge(id, q, j, a, nodes);
            }
            slot.charged = charged;
        }
        if slot.waiting != waiting {
            let part = &mut self.queues[q];
            if let Some(p) = slot.waiting {
                part.waiting.remove(&(Reverse(p), id));
            }
            if let Some(p) = waiting {
                part.waiting.insert((Reverse(p), id));
            }
            slot.waiting = waiting;
        }
    }

    /// Charges job `id` of queue `q` for allocation `a`.
    fn charge(
        &mut self,
        id: JobId,
        q: usize,
        job: &Job,
        a: &Allocation,
        nodes: &BTreeMap<String, Node>,
    ) {
        // What this entry's pre-check counted for the job, when it did
        // (the same GPUs: a job's allocation changes only by the decision
        // that was checked).
        let counted = self
            .counted
            .binary_search_by_key(&id, |(j, _)| *j)
            .ok()
            .map(|at| std::mem::take(&mut self.counted[at].1))
            .filter(|c| c.iter().map(|(_, n)| *n as usize).sum::<usize>() == a.gpus.len());
        let by_type = match counted {
            Some(c) => c,
            None => self.count_types(nodes, &a.gpus),
        };
        for (t, n) in &by_type {
            self.book_change(q, *t, *n, true);
        }
        let part = &mut self.queues[q];
        if job.spec.preemptible {
            for (t, n) in &by_type {
                if part.sizes.len() <= *t {
                    part.sizes.resize_with(*t + 1, BTreeMap::new);
                }
                *part.sizes[*t].entry(*n).or_default() += 1;
            }
        }
        part.holding.insert(
            id,
            Held {
                by_type,
                preemptible: job.spec.preemptible,
            },
        );
    }

    /// Takes back job `id`'s charge to queue `q`.
    fn uncharge(&mut self, id: JobId, q: usize) {
        let Some(held) = self.queues[q].holding.remove(&id) else {
            return;
        };
        if held.preemptible {
            let sizes = &mut self.queues[q].sizes;
            for (t, n) in &held.by_type {
                if let Some(by_size) = sizes.get_mut(*t) {
                    if let Some(count) = by_size.get_mut(n) {
                        *count -= 1;
                        if *count == 0 {
                            by_size.remove(n);
                        }
                    }
                }
            }
        }
        for (t, n) in &held.by_type {
            self.book_change(q, *t, *n, false);
        }
    }
}

fn book_of(
    queues: &Queues,
    capacity: &FreeGpus,
    usage: &BTreeMap<String, BTreeMap<String, u32>>,
) -> QuotaBook {
    let counts = capacity.types().map(|t| (t, capacity.free_of_type(t)));
    QuotaBook::new(queues, counts, usage)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn slot(queue: usize) -> Slot {
        Slot {
            queue,
            charged: None,
            waiting: Some(0),
        }
    }

    #[test]
    fn the_slot_window_grows_both_ways_shrinks_from_both_ends_and_iterates_by_id() {
        let mut slots = Slots::default();
        slots.insert(10, slot(1));
        slots.insert(13, slot(2));
        slots.insert(8, slot(3));
        assert_eq!((slots.first, slots.window.len()), (8, 6));
        let ids: Vec<(JobId, usize)> = slots.iter().map(|(id, s)| (id, s.queue)).collect();
        assert_eq!(ids, vec![(8, 3), (10, 1), (13, 2)]);
        assert!(slots.get(10).is_some() && slots.get(9).is_none() && slots.get(7).is_none());
        assert!(slots.get(14).is_none() && slots.get(0).is_none());
        if let Some(s) = slots.get_mut(13) {
            s.charged = Some(4);
        }
        assert_eq!(slots.get(13).and_then(|s| s.charged), Some(4));

        slots.remove(8);
        assert_eq!((slots.first, slots.window.len()), (10, 4));
        slots.remove(13);
        assert_eq!((slots.first, slots.window.len()), (10, 1));
        slots.remove(99);
        slots.remove(10);
        assert!(slots.window.is_empty());
        // Empty, it starts again wherever the next id is.
        slots.insert(1_000_000, slot(0));
        assert_eq!((slots.first, slots.window.len()), (1_000_000, 1));
        for (_, s) in slots.iter_mut() {
            s.waiting = None;
        }
        assert_eq!(slots.get(1_000_000).and_then(|s| s.waiting), None);
    }
}
