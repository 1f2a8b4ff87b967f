//! What the queues' jobs hold and wait for (issue 23), derived from the
//! jobs, kept by `apply` once there are queues and not before: a cluster
//! that never made a queue pays nothing for them.
//!
//! - each holding job's charge to its queue (the allocation's epoch, so an
//!   entry that does not change the allocation costs one lookup), what it
//!   holds by type and whether it may be preempted, by queue (what reclaim
//!   reads), and the [`QuotaBook`] on their sum, which `apply`'s quota
//!   check and the scheduler read;
//! - the waiting jobs of each queue in the order admission takes them
//!   (higher priority first, then submission order).
//!
//! [`ClusterState::check_invariants`](super::ClusterState::check_invariants)
//! proves the kept index equals one built afresh.

use std::borrow::Cow;
use std::cmp::Reverse;
use std::collections::{BTreeMap, BTreeSet};

use crate::free_gpus::FreeGpus;
use crate::model::{Job, JobId, Node};
use crate::queue::Queues;
use crate::quota::{queue_of, QuotaBook};

/// The allocation a holding job is charged for (its queue is its spec's).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
struct Charge {
    epoch: u64,
}

/// What a holding job holds of its queue's quota (what reclaim reads,
/// without looking the job up).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Held {
    /// Its GPUs by type.
    pub by_type: BTreeMap<String, u32>,
    /// Whether reclaim may preempt it (`JobSpec::preemptible`).
    pub preemptible: bool,
}

#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub(super) struct QueueIndex {
    /// `None` while the cluster has no queue: nothing is kept.
    book: Option<QuotaBook>,
    charges: BTreeMap<JobId, Charge>,
    /// The jobs holding GPUs, by queue, with what each holds (what reclaim
    /// looks through).
    holding: BTreeMap<String, BTreeMap<JobId, Held>>,
    /// The sizes of what preemptible holding jobs hold, by queue, then
    /// type: size to how many jobs hold that many GPUs of the type (what
    /// reclaim could free, read without walking the jobs).
    sizes: BTreeMap<String, BTreeMap<String, BTreeMap<u32, u32>>>,
    /// Unfinished jobs holding no GPUs, by queue, in admission order.
    waiting: BTreeMap<String, BTreeSet<(Reverse<i32>, JobId)>>,
    /// Each waiting job's priority (its queue is its spec's).
    waiting_key: BTreeMap<JobId, i32>,
}

impl QueueIndex {
    /// The index of `jobs` with `queues` on a cluster of `nodes` whose
    /// live GPUs are `capacity` (empty while there are no queues).
    pub(super) fn of(
        jobs: &BTreeMap<JobId, Job>,
        nodes: &BTreeMap<String, Node>,
        queues: &Queues,
        capacity: &FreeGpus,
    ) -> QueueIndex {
        let mut index = QueueIndex::default();
        if queues.is_unset() {
            return index;
        }
        for (id, job) in jobs {
            index.charge(*id, Some(job), nodes);
            index.queue_up(*id, Some(job));
        }
        index.book = Some(book_of(queues, capacity, &index.usage()));
        index
    }

    /// Charges every holding job afresh and builds the book again (after
    /// a node or a queue changed).
    pub(super) fn recharge(
        &mut self,
        jobs: &BTreeMap<JobId, Job>,
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
        let holding: Vec<JobId> = self.charges.keys().copied().collect();
        self.charges.clear();
        self.holding.clear();
        self.sizes.clear();
        for id in holding {
            self.charge(id, jobs.get(&id), nodes);
        }
        self.book = Some(book_of(queues, capacity, &self.usage()));
    }

    /// Puts job `id` (None: removed) where it now belongs.
    pub(super) fn update(&mut self, id: JobId, job: Option<&Job>, nodes: &BTreeMap<String, Node>) {
        if self.book.is_none() {
            return;
        }
        self.charge(id, job, nodes);
        self.queue_up(id, job);
    }

    /// GPUs each queue's jobs hold, by queue, then type (summed from the
    /// holding jobs: the book keeps the same sums, by type, then queue).
    pub(super) fn usage(&self) -> BTreeMap<String, BTreeMap<String, u32>> {
        let mut usage: BTreeMap<String, BTreeMap<String, u32>> = BTreeMap::new();
        for (queue, jobs) in &self.holding {
            let by_type = usage.entry(queue.clone()).or_default();
            for held in jobs.values() {
                for (t, n) in &held.by_type {
                    *by_type.entry(t.clone()).or_default() += n;
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

    pub(super) fn put_book(&mut self, book: QuotaBook) {
        self.book = Some(book);
    }

    pub(super) fn waiting_in<'a>(&'a self, queue: &str) -> impl Iterator<Item = JobId> + 'a {
        self.waiting
            .get(queue)
            .into_iter()
            .flatten()
            .map(|(_, id)| *id)
    }

    /// The jobs of `queue` holding GPUs, each with what it holds.
    pub(super) fn holding_in<'a>(
        &'a self,
        queue: &str,
    ) -> impl Iterator<Item = (JobId, &'a Held)> + 'a {
        self.holding
            .get(queue)
            .into_iter()
            .flatten()
            .map(|(id, held)| (*id, held))
    }

    /// What the preemptible jobs of `queue` hold, by type: each size (GPUs
    /// of the type one job holds) and how many jobs hold it, smallest
    /// first.
    pub(super) fn preemptible_sizes_in<'a>(
        &'a self,
        queue: &str,
    ) -> impl Iterator<Item = (&'a String, &'a BTreeMap<u32, u32>)> + 'a {
        self.sizes.get(queue).into_iter().flatten()
    }

    pub(super) fn queues_with_waiting(&self) -> impl Iterator<Item = &String> + '_ {
        self.waiting.keys()
    }

    /// Moves `id`'s charge to what `job` holds now.
    fn charge(&mut self, id: JobId, job: Option<&Job>, nodes: &BTreeMap<String, Node>) {
        let alloc = job.and_then(|j| j.allocation.as_ref().map(|a| (j, a)));
        match (self.charges.get(&id), alloc) {
            (Some(old), Some((_, a))) if old.epoch == a.epoch => return,
            (None, None) => return,
            _ => {}
        }
        if self.charges.remove(&id).is_some() {
            // A job's queue never changes; a job no longer there (removed)
            // is looked for in every queue.
            let queue: Option<Cow<'_, str>> = match job {
                Some(j) => Some(Cow::Borrowed(queue_of(&j.spec.queue))),
                None => self
                    .holding
                    .iter()
                    .find(|(_, jobs)| jobs.contains_key(&id))
                    .map(|(q, _)| Cow::Owned(q.clone())),
            };
            if let Some(queue) = queue {
                let mut held = None;
                if let Some(jobs) = self.holding.get_mut(queue.as_ref()) {
                    held = jobs.remove(&id);
                    if jobs.is_empty() {
                        self.holding.remove(queue.as_ref());
                    }
                }
                if let Some(held) = held {
                    if held.preemptible {
                        self.forget_sizes(&queue, &held);
                    }
                    if let Some(book) = &mut self.book {
                        for (t, n) in &held.by_type {
                            book.give_back(&queue, t, *n);
                        }
                    }
                }
            }
        }
        if let Some((job, a)) = alloc {
            let charge = Charge { epoch: a.epoch };
            let queue = queue_of(&job.spec.queue);
            let held = Held {
                by_type: super::gpus_by_type(nodes, &a.gpus),
                preemptible: job.spec.preemptible,
            };
            if let Some(book) = &mut self.book {
                for (t, n) in &held.by_type {
                    book.force(queue, t, *n);
                }
            }
            if held.preemptible {
                let sizes = match self.sizes.get_mut(queue) {
                    Some(sizes) => sizes,
                    None => self.sizes.entry(queue.to_string()).or_default(),
                };
                for (t, n) in &held.by_type {
                    let by_size = match sizes.get_mut(t) {
                        Some(by_size) => by_size,
                        None => sizes.entry(t.clone()).or_default(),
                    };
                    *by_size.entry(*n).or_default() += 1;
                }
            }
            match self.holding.get_mut(queue) {
                Some(jobs) => {
                    jobs.insert(id, held);
                }
                None => {
                    self.holding
                        .insert(queue.to_string(), BTreeMap::from([(id, held)]));
                }
            }
            self.charges.insert(id, charge);
        }
    }

    /// Takes what `held` holds out of `queue`'s sizes.
    fn forget_sizes(&mut self, queue: &str, held: &Held) {
        let Some(sizes) = self.sizes.get_mut(queue) else {
            return;
        };
        for (t, n) in &held.by_type {
            if let Some(by_size) = sizes.get_mut(t) {
                if let Some(count) = by_size.get_mut(n) {
                    *count -= 1;
                    if *count == 0 {
                        by_size.remove(n);
                    }
                }
                if by_size.is_empty() {
                    sizes.remove(t);
                }
            }
        }
        if sizes.is_empty() {
            self.sizes.remove(queue);
        }
    }

    /// Puts `id` in its queue's waiting set, or out of every one.
    fn queue_up(&mut self, id: JobId, job: Option<&Job>) {
        let waits = job.is_some_and(|j| !j.state.is_terminal() && j.allocation.is_none());
        let now = job.filter(|_| waits).map(|j| j.spec.priority);
        let before = self.waiting_key.get(&id).copied();
        if before == now {
            return;
        }
        if let Some(p) = before {
            self.waiting_key.remove(&id);
            // A job's queue never changes; a job no longer there (removed)
            // is looked for in every queue.
            let key = (Reverse(p), id);
            let queue: Option<Cow<'_, str>> = match job {
                Some(j) => Some(Cow::Borrowed(queue_of(&j.spec.queue))),
                None => self
                    .waiting
                    .iter()
                    .find(|(_, set)| set.contains(&key))
                    .map(|(q, _)| Cow::Owned(q.clone())),
            };
            if let Some(q) = queue {
                if let Some(set) = self.waiting.get_mut(q.as_ref()) {
                    set.remove(&key);
                    if set.is_empty() {
                        self.waiting.remove(q.as_ref());
                    }
                }
            }
        }
        if let (Some(p), Some(j)) = (now, job) {
            let q = queue_of(&j.spec.queue);
            match self.waiting.get_mut(q) {
                Some(set) => {
                    set.insert((Reverse(p), id));
                }
                None => {
                    self.waiting
                        .insert(q.to_string(), BTreeSet::from([(Reverse(p), id)]));
                }
            }
            self.waiting_key.insert(id, p);
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
