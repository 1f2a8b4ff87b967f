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

use std::cmp::Reverse;
use std::collections::{BTreeMap, BTreeSet};

use crate::free_gpus::FreeGpus;
use crate::model::{Job, JobId, Node};
use crate::queue::Queues;
use crate::quota::{queue_of, QuotaBook};

/// The allocation a holding job is charged for, and its queue's number
/// (a job's queue never changes).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
struct Charge {
    epoch: u64,
    queue: usize,
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

/// One queue's part of the index.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
struct QueueJobs {
    /// Its jobs holding GPUs, with what each holds (what reclaim looks
    /// through).
    holding: BTreeMap<JobId, Held>,
    /// The sizes of what its preemptible holding jobs hold, by type: size
    /// to how many jobs hold that many GPUs of the type (what reclaim
    /// could free, read without walking the jobs).
    sizes: BTreeMap<String, BTreeMap<u32, u32>>,
    /// Its unfinished jobs holding no GPUs, in admission order.
    waiting: BTreeSet<(Reverse<i32>, JobId)>,
}

impl QueueJobs {
    fn is_empty(&self) -> bool {
        self.holding.is_empty() && self.sizes.is_empty() && self.waiting.is_empty()
    }
}

#[derive(Debug, Clone, Default)]
pub(super) struct QueueIndex {
    /// `None` while the cluster has no queue: nothing is kept.
    book: Option<QuotaBook>,
    /// Queue names to their numbers in `queues` (given as queues are first
    /// met, never taken back while the index lives).
    ids: BTreeMap<String, usize>,
    /// Queue names by number.
    names: Vec<String>,
    /// By queue number.
    queues: Vec<QueueJobs>,
    charges: BTreeMap<JobId, Charge>,
    /// Each waiting job's priority and queue number.
    waiting_key: BTreeMap<JobId, (i32, usize)>,
}

/// Two indexes are equal when they hold the same by queue name (numbers
/// are given in the order queues are met, which differs between an index
/// kept entry by entry and one built afresh).
impl PartialEq for QueueIndex {
    fn eq(&self, other: &QueueIndex) -> bool {
        self.book == other.book && self.view() == other.view()
    }
}

impl Eq for QueueIndex {}

/// An index by names: each queue's part, each job's charge and wait.
type IndexView<'a> = (
    BTreeMap<&'a str, &'a QueueJobs>,
    BTreeMap<JobId, (u64, &'a str)>,
    BTreeMap<JobId, (i32, &'a str)>,
);

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
        for part in &mut self.queues {
            part.holding.clear();
            part.sizes.clear();
        }
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
        for (queue, q) in &self.ids {
            let part = &self.queues[*q];
            if part.holding.is_empty() {
                continue;
            }
            let by_type = usage.entry(queue.clone()).or_default();
            for held in part.holding.values() {
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
    ) -> impl Iterator<Item = (JobId, &'a Held)> + 'a {
        self.part(queue)
            .into_iter()
            .flat_map(|p| p.holding.iter())
            .map(|(id, held)| (*id, held))
    }

    /// What the preemptible jobs of `queue` hold, by type: each size (GPUs
    /// of the type one job holds) and how many jobs hold it, smallest
    /// first.
    pub(super) fn preemptible_sizes_in<'a>(
        &'a self,
        queue: &str,
    ) -> impl Iterator<Item = (&'a String, &'a BTreeMap<u32, u32>)> + 'a {
        self.part(queue).into_iter().flat_map(|p| p.sizes.iter())
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
        self.queues.push(QueueJobs::default());
        q
    }

    fn view(&self) -> IndexView<'_> {
        let names = &self.names;
        (
            self.ids
                .iter()
                .map(|(name, q)| (name.as_str(), &self.queues[*q]))
                .filter(|(_, part)| !part.is_empty())
                .collect(),
            self.charges
                .iter()
                .map(|(id, c)| (*id, (c.epoch, names[c.queue].as_str())))
                .collect(),
            self.waiting_key
                .iter()
                .map(|(id, (p, q))| (*id, (*p, names[*q].as_str())))
                .collect(),
        )
    }

    /// Moves `id`'s charge to what `job` holds now.
    fn charge(&mut self, id: JobId, job: Option<&Job>, nodes: &BTreeMap<String, Node>) {
        let alloc = job.and_then(|j| j.allocation.as_ref().map(|a| (j, a)));
        match (self.charges.get(&id), alloc) {
            (Some(old), Some((_, a))) if old.epoch == a.epoch => return,
            (None, None) => return,
            _ => {}
        }
        if let Some(old) = self.charges.remove(&id) {
            let q = old.queue;
            if let Some(held) = self.queues[q].holding.remove(&id) {
                if held.preemptible {
                    forget_sizes(&mut self.queues[q].sizes, &held);
                }
                if let Some(book) = &mut self.book {
                    for (t, n) in &held.by_type {
                        book.give_back(&self.names[q], t, *n);
                    }
                }
            }
        }
        if let Some((job, a)) = alloc {
            let queue = queue_of(&job.spec.queue);
            let q = self.queue_number(queue);
            let held = Held {
                by_type: super::gpus_by_type(nodes, &a.gpus),
                preemptible: job.spec.preemptible,
            };
            if let Some(book) = &mut self.book {
                for (t, n) in &held.by_type {
                    book.force(queue, t, *n);
                }
            }
            let part = &mut self.queues[q];
            if held.preemptible {
                for (t, n) in &held.by_type {
                    let by_size = match part.sizes.get_mut(t) {
                        Some(by_size) => by_size,
                        None => part.sizes.entry(t.clone()).or_default(),
                    };
                    *by_size.entry(*n).or_default() += 1;
                }
            }
            part.holding.insert(id, held);
            self.charges.insert(
                id,
                Charge {
                    epoch: a.epoch,
                    queue: q,
                },
            );
        }
    }

    /// Puts `id` in its queue's waiting set, or out of every one.
    fn queue_up(&mut self, id: JobId, job: Option<&Job>) {
        let waits = job.is_some_and(|j| !j.state.is_terminal() && j.allocation.is_none());
        let now = job.filter(|_| waits).map(|j| j.spec.priority);
        let before = self.waiting_key.get(&id).copied();
        if before.map(|(p, _)| p) == now {
            return;
        }
        if let Some((p, q)) = before {
            self.waiting_key.remove(&id);
            self.queues[q].waiting.remove(&(Reverse(p), id));
        }
        if let (Some(p), Some(j)) = (now, job) {
            let q = self.queue_number(queue_of(&j.spec.queue));
            self.queues[q].waiting.insert((Reverse(p), id));
            self.waiting_key.insert(id, (p, q));
        }
    }
}

/// Takes what `held` holds out of a queue's `sizes`.
fn forget_sizes(sizes: &mut BTreeMap<String, BTreeMap<u32, u32>>, held: &Held) {
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
}

fn book_of(
    queues: &Queues,
    capacity: &FreeGpus,
    usage: &BTreeMap<String, BTreeMap<String, u32>>,
) -> QuotaBook {
    let counts = capacity.types().map(|t| (t, capacity.free_of_type(t)));
    QuotaBook::new(queues, counts, usage)
}
