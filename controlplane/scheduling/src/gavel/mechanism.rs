//! The round-based mechanism: turns a fractional [`Allocation`] into the
//! placements of one round, so that over many rounds each job receives the
//! time on each type its allocation asks for.
//!
//! Per round, for every (job, type) the priority is the allocation over the
//! share of that type's time the job has received since the last reset
//! (`X[i][j] / (t[i][j] / Σ_k t[k][j])`); entries are sorted per type by
//! (priority, deficit, allocation), the types' lists are concatenated and
//! walked greedily, one placement per job, while GPUs are left. A job placed
//! on the type it ran on last round keeps its GPUs when they are free
//! (lease extension: no checkpoint and relaunch); the others are packed
//! server by server, largest jobs first.
//!
//! The allocation is re-solved only when the job set changed and at least
//! `min_resolve_interval_s` passed since the last solve. Before a re-solve,
//! each (job, type) accumulates a deficit (the time the old allocation
//! promised since the last reset less the time received) and the times
//! received restart at `initial_credit_s`, so a new job does not start with
//! an infinite priority. These are Gavel's rules and, with
//! [`MechanismConfig::gavel`], its constants; the same component drives
//! `keel sim --gavel-compat` and the live scheduler.
//!
//! Space sharing (Gavel's packed policies and Gandiva): besides each job
//! alone, an entry may be a pair of jobs of one size sharing the same GPUs
//! ([`Combo`]). A pair is placed like a job, and then neither of its jobs
//! runs elsewhere that round. Pairs keep their own time received, deficit
//! and allocation; as in Gavel, a pair's time starts at 0 (not at the
//! credit) until the next reset. Entries that tie are taken in the order
//! Gavel's dictionaries hold them: by the newer job's arrival, the job
//! alone before its pairs, and its pairs by the partner's arrival.
//!
//! Pure: the caller passes the time and the solver's answer; the only
//! randomness is the seeded type shuffle of type-agnostic policies
//! (Mersenne Twister seeded as Python's `random.Random(seed)`, so a run can
//! follow Gavel's simulator round by round).

use std::collections::{BTreeMap, BTreeSet};

use super::{Allocation, PairAllocation, ProblemJobId};
use keel_state::rng::PyRandom;
use serde::{Deserialize, Serialize};

/// What a round places: one job alone, or two jobs sharing GPUs.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize)]
pub struct Combo {
    /// The job alone, or the later-arrived (larger id) of the pair.
    newer: ProblemJobId,
    /// The earlier job of a pair.
    older: Option<ProblemJobId>,
}

impl Combo {
    pub fn single(job: ProblemJobId) -> Combo {
        Combo {
            newer: job,
            older: None,
        }
    }

    /// The pair of `a` and `b` (either order; `a != b`).
    pub fn pair(a: ProblemJobId, b: ProblemJobId) -> Combo {
        Combo {
            newer: a.max(b),
            older: Some(a.min(b)),
        }
    }

    /// The job alone, or `None` for a pair.
    pub fn as_single(&self) -> Option<ProblemJobId> {
        self.older.is_none().then_some(self.newer)
    }

    /// The pair, smaller id first, or `None` for a job alone.
    pub fn as_pair(&self) -> Option<(ProblemJobId, ProblemJobId)> {
        self.older.map(|o| (o, self.newer))
    }

    /// The jobs, smaller id first.
    pub fn jobs(&self) -> impl Iterator<Item = ProblemJobId> {
        self.older.into_iter().chain(std::iter::once(self.newer))
    }
}

/// The mechanism's constants.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct MechanismConfig {
    /// Length of a round.
    pub round_s: f64,
    /// Least time between two solves of the allocation.
    pub min_resolve_interval_s: f64,
    /// Time on every type each job is credited with at each reset.
    pub initial_credit_s: f64,
    /// Skip entries with priority 0 (jobs the allocation gives nothing):
    /// Gavel's FIFO policies leave such GPUs idle rather than run them.
    pub skip_zero_priority: bool,
    /// Shuffle the type order each round with this seed (Gavel does for
    /// its type-agnostic policies, with seed + 5); `None`: the cluster's
    /// type order every round.
    pub shuffle_seed: Option<u32>,
}

impl MechanismConfig {
    /// Gavel's constants: 360 s rounds, at least 1,920 s between solves, a
    /// credit of half a round.
    pub fn gavel() -> MechanismConfig {
        MechanismConfig {
            round_s: 360.0,
            min_resolve_interval_s: 1920.0,
            initial_credit_s: 180.0,
            skip_zero_priority: false,
            shuffle_seed: None,
        }
    }
}

/// A GPU, numbered across the cluster.
pub type WorkerId = u32;

/// The GPUs of one type, grouped by server.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct TypeServers {
    pub gpu_type: String,
    pub servers: Vec<Vec<WorkerId>>,
}

impl TypeServers {
    fn gpus(&self) -> u32 {
        self.servers
            .iter()
            .map(|s| u32::try_from(s.len()).unwrap_or(u32::MAX))
            .sum()
    }
}

/// Where one job runs this round.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Placement {
    /// Index of the GPU type in the mechanism's types
    /// ([`Mechanism::type_name`]).
    pub type_index: usize,
    pub workers: Vec<WorkerId>,
    /// The job keeps exactly the GPUs it had last round (no checkpoint and
    /// relaunch).
    pub extended: bool,
}

/// What the mechanism keeps per entry (a job alone or a pair), by type
/// index.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
struct Book {
    scale_factor: u32,
    /// Steps per second alone; for a pair, the slower of its two jobs
    /// beside each other (0: cannot run there).
    speed: Vec<f64>,
    /// Time received since the last reset (from the credit).
    time_on_s: Vec<f64>,
    deficit_s: Vec<f64>,
    /// The installed allocation's row; `None` for a job that arrived
    /// after the last solve.
    x: Option<Vec<f64>>,
}

/// Counters for reports.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct MechanismStats {
    pub solves: u64,
    pub rounds: u64,
    /// Entries that ran in consecutive rounds on exactly the same GPUs.
    pub lease_extensions: u64,
    /// Entries that ran last round with a job still active this round.
    pub lease_extension_opportunities: u64,
    /// Pairs placed to share GPUs.
    pub pairs_placed: u64,
}

/// The round-based mechanism's state. It encodes (serde) whole but for
/// derived caches, as the live policy's memory in the log.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct Mechanism {
    config: MechanismConfig,
    /// Types in their base order (before any shuffle).
    types: Vec<TypeServers>,
    /// Jobs alone and pairs, in Gavel's tie order.
    books: BTreeMap<Combo, Book>,
    /// Each job's pair partners.
    partners: BTreeMap<ProblemJobId, BTreeSet<ProblemJobId>>,
    /// [`Mechanism::member_positions`], kept until the entries change.
    #[serde(skip)]
    members: Option<(Vec<[Option<u32>; 2]>, usize)>,
    /// Σ over entries of time received per type since the last reset.
    type_time_s: Vec<f64>,
    allocation: Allocation,
    last_reset_s: f64,
    job_set_changed: bool,
    /// Last round's placements: type index and GPUs.
    current: BTreeMap<Combo, (usize, Vec<WorkerId>)>,
    shuffler: Option<PyRandom>,
    stats: MechanismStats,
}

impl Mechanism {
    /// A mechanism over `types` (their order is the order of the per-type
    /// lists when the policy does not shuffle).
    pub fn new(config: MechanismConfig, types: Vec<TypeServers>) -> Mechanism {
        let shuffler = config.shuffle_seed.map(PyRandom::new);
        Mechanism {
            config,
            type_time_s: vec![0.0; types.len()],
            types,
            books: BTreeMap::new(),
            partners: BTreeMap::new(),
            members: None,
            allocation: Allocation::new(),
            last_reset_s: 0.0,
            job_set_changed: false,
            current: BTreeMap::new(),
            shuffler,
            stats: MechanismStats::default(),
        }
    }

    pub fn stats(&self) -> MechanismStats {
        self.stats
    }

    /// The constants it runs with.
    pub fn config(&self) -> &MechanismConfig {
        &self.config
    }

    /// The time `job` (alone) received on each type since the last reset,
    /// the reset's credit included, by type name.
    pub fn time_received_s(&self, job: ProblemJobId) -> BTreeMap<&str, f64> {
        self.books
            .get(&Combo::single(job))
            .map(|b| {
                self.types
                    .iter()
                    .zip(&b.time_on_s)
                    .map(|(t, s)| (t.gpu_type.as_str(), *s))
                    .collect()
            })
            .unwrap_or_default()
    }

    /// The name of the type at `index`.
    pub fn type_name(&self, index: usize) -> &str {
        self.types.get(index).map_or("", |t| t.gpu_type.as_str())
    }

    /// The allocation the rounds follow.
    pub fn allocation(&self) -> &Allocation {
        &self.allocation
    }

    /// The jobs the mechanism knows.
    pub fn job_ids(&self) -> impl Iterator<Item = ProblemJobId> + '_ {
        self.books.keys().filter_map(Combo::as_single)
    }

    pub fn contains(&self, job: ProblemJobId) -> bool {
        self.books.contains_key(&Combo::single(job))
    }

    /// A job arrived: credited on every type, no allocation until the next
    /// solve. `throughputs` by type name (a missing type: 0).
    pub fn add_job(
        &mut self,
        job: ProblemJobId,
        scale_factor: u32,
        throughputs: &BTreeMap<String, f64>,
    ) {
        let n = self.types.len();
        let speed = self
            .types
            .iter()
            .map(|t| throughputs.get(&t.gpu_type).copied().unwrap_or(0.0))
            .collect();
        self.books.insert(
            Combo::single(job),
            Book {
                scale_factor: scale_factor.max(1),
                speed,
                time_on_s: vec![self.config.initial_credit_s; n],
                deficit_s: vec![0.0; n],
                x: None,
            },
        );
        self.members = None;
        self.job_set_changed = true;
    }

    /// Jobs `a` and `b` (both known, of one size) may share GPUs, at
    /// `figures` by type name: `[a's, b's]` steps per second beside each
    /// other (a missing type: they cannot share it). Ignored when either
    /// job is unknown or their sizes differ.
    pub fn add_pair(
        &mut self,
        a: ProblemJobId,
        b: ProblemJobId,
        figures: &BTreeMap<String, [f64; 2]>,
    ) {
        let (Some(ba), Some(bb)) = (
            self.books.get(&Combo::single(a)),
            self.books.get(&Combo::single(b)),
        ) else {
            return;
        };
        if a == b || ba.scale_factor != bb.scale_factor {
            return;
        }
        let scale_factor = ba.scale_factor;
        let n = self.types.len();
        let speed = self
            .types
            .iter()
            .map(|t| figures.get(&t.gpu_type).map_or(0.0, |[fa, fb]| fa.min(*fb)))
            .collect();
        self.books.insert(
            Combo::pair(a, b),
            Book {
                scale_factor,
                speed,
                time_on_s: vec![0.0; n],
                deficit_s: vec![0.0; n],
                x: None,
            },
        );
        self.partners.entry(a).or_default().insert(b);
        self.partners.entry(b).or_default().insert(a);
        self.members = None;
    }

    /// A job ended (finished, cancelled or failed), and with it its pairs.
    pub fn remove_job(&mut self, job: ProblemJobId) {
        if self.books.remove(&Combo::single(job)).is_some() {
            self.job_set_changed = true;
            self.members = None;
        }
        for partner in self.partners.remove(&job).unwrap_or_default() {
            self.books.remove(&Combo::pair(job, partner));
            if let Some(p) = self.partners.get_mut(&partner) {
                p.remove(&job);
            }
            self.members = None;
        }
    }

    /// `combo` ran `seconds` on the type at `type_index` (a round's
    /// micro-task; a pair's lasts until the later of its two ends).
    pub fn record_run(&mut self, combo: Combo, type_index: usize, seconds: f64) {
        if !(seconds.is_finite() && seconds > 0.0) {
            return;
        }
        if let Some(t) = self
            .books
            .get_mut(&combo)
            .and_then(|b| b.time_on_s.get_mut(type_index))
        {
            *t += seconds;
            if let Some(total) = self.type_time_s.get_mut(type_index) {
                *total += seconds;
            }
        }
    }

    /// Whether the allocation must be solved again before the round at
    /// `now_s`: the job set changed and the last solve is old enough (or
    /// there was none).
    pub fn needs_solve(&self, now_s: f64) -> bool {
        self.job_set_changed
            && (now_s - self.last_reset_s >= self.config.min_resolve_interval_s
                || self.last_reset_s == 0.0)
    }

    /// Installs a freshly solved allocation at `now_s`: first the deficits
    /// under the old one, then the times received restart at the credit.
    pub fn install(&mut self, now_s: f64, allocation: Allocation) {
        self.install_with_pairs(now_s, allocation, &PairAllocation::new());
    }

    /// [`Mechanism::install`] for a space-sharing policy: `pairs` gives the
    /// pairs' time (a known pair it does not name gets none, but may still
    /// fill GPUs left over, as in Gavel).
    pub fn install_with_pairs(
        &mut self,
        now_s: f64,
        allocation: Allocation,
        pairs: &PairAllocation,
    ) {
        let elapsed_s = now_s - self.last_reset_s;
        let credit = self.config.initial_credit_s;
        let n = self.types.len();
        let row_of = |row: &BTreeMap<String, f64>| -> Vec<f64> {
            self.types
                .iter()
                .map(|t| row.get(&t.gpu_type).copied().unwrap_or(0.0))
                .collect()
        };
        for (combo, book) in &mut self.books {
            for ti in 0..n {
                let received = book.time_on_s[ti] - credit;
                let promised = book.x.as_ref().map_or(0.0, |x| x[ti] * elapsed_s);
                book.deficit_s[ti] += promised - received;
                book.time_on_s[ti] = credit;
            }
            book.x = match combo.as_pair() {
                None => allocation.get(&combo.newer).map(row_of),
                Some(pair) => Some(pairs.get(&pair).map_or_else(|| vec![0.0; n], row_of)),
            };
        }
        let entries = self.books.len() as f64;
        for total in &mut self.type_time_s {
            *total = credit * entries;
        }
        self.allocation = allocation;
        self.last_reset_s = now_s;
        self.job_set_changed = false;
        self.stats.solves += 1;
    }

    /// The priority of a job on the type at `ti` now.
    fn priority(&self, book: &Book, ti: usize) -> f64 {
        let Some(x) = book.x.as_ref().map(|x| x[ti]) else {
            return 0.0;
        };
        if x == 0.0 || book.speed[ti] == 0.0 {
            return 0.0;
        }
        let type_time = self.type_time_s[ti];
        let fraction = if type_time == 0.0 {
            0.0
        } else {
            book.time_on_s[ti] / type_time
        };
        if fraction > 0.0 {
            x / fraction
        } else {
            // Not scheduled yet: a priority far above any ratio, still in
            // proportion to the allocation.
            x * 1e9
        }
    }

    /// The type order of this round.
    fn round_types(&mut self) -> Vec<usize> {
        let mut order: Vec<usize> = (0..self.types.len()).collect();
        if let Some(rng) = &mut self.shuffler {
            rng.shuffle(&mut order);
        }
        order
    }

    /// Each entry's jobs (in entry order) as positions among the jobs
    /// alone, and how many jobs there are.
    fn member_positions(&self) -> (Vec<[Option<u32>; 2]>, usize) {
        let single_position: BTreeMap<ProblemJobId, u32> = self
            .books
            .keys()
            .filter_map(Combo::as_single)
            .enumerate()
            .map(|(i, job)| (job, u32::try_from(i).unwrap_or(u32::MAX)))
            .collect();
        let members = self
            .books
            .keys()
            .map(|c| {
                let position = |j: ProblemJobId| single_position.get(&j).copied();
                match c.as_pair() {
                    None => [position(c.newer), None],
                    Some((a, b)) => [position(a), position(b)],
                }
            })
            .collect();
        (members, single_position.len())
    }

    /// The placements of the next round. Call [`Mechanism::install`] first
    /// when [`Mechanism::needs_solve`] says so. Never places more GPUs of a
    /// type than it has, a GPU twice, or a job twice (alone or in a pair).
    pub fn plan_round(&mut self) -> BTreeMap<Combo, Placement> {
        self.stats.rounds += 1;
        let order = self.round_types();
        if self.members.is_none() {
            self.members = Some(self.member_positions());
        }
        let (members, jobs) = match &self.members {
            Some((m, n)) => (m.as_slice(), *n),
            None => (&[][..], 0),
        };
        let books: Vec<(Combo, &Book)> = self.books.iter().map(|(c, b)| (*c, b)).collect();
        let mut left: Vec<u32> = self.types.iter().map(TypeServers::gpus).collect();
        let mut chosen = vec![false; jobs];
        let mut chosen_count = 0usize;
        // Per type, in queue order: (entry, scale factor, has an allocation).
        let mut per_type: Vec<Vec<(Combo, u32, bool)>> = vec![Vec::new(); self.types.len()];
        // Per type: (entry's position, priority, deficit, allocation),
        // sorted descending, ties in entry order; the types' lists walked
        // one after the other.
        type Entry = (u32, f64, f64, f64);
        let order_of = |a: &Entry, b: &Entry| {
            b.1.total_cmp(&a.1)
                .then(b.2.total_cmp(&a.2))
                .then(b.3.total_cmp(&a.3))
                .then(a.0.cmp(&b.0))
        };
        let mut entries: Vec<Entry> = Vec::with_capacity(books.len());
        let mut tail: Vec<Entry> = Vec::with_capacity(books.len());
        for &ti in &order {
            if left[ti] == 0 || chosen_count == jobs {
                continue;
            }
            // Only entries that could be placed here are listed (the walk
            // would skip the others): runnable on this type, no job
            // already chosen, not ruled out by the FIFO rule. Entries with
            // priority 0 come after every other; they are sorted only if
            // GPUs are left once the others are walked.
            entries.clear();
            tail.clear();
            let taken = |chosen: &[bool], m: Option<u32>| m.is_none_or(|m| chosen[m as usize]);
            for (i, (combo, book)) in books.iter().enumerate() {
                let [first, second] = members[i];
                if book.speed[ti] <= 0.0
                    || taken(&chosen, first)
                    || (combo.older.is_some() && taken(&chosen, second))
                {
                    continue;
                }
                let priority = self.priority(book, ti);
                if self.config.skip_zero_priority && priority <= 0.0 {
                    continue;
                }
                let entry = (
                    u32::try_from(i).unwrap_or(u32::MAX),
                    priority,
                    book.deficit_s[ti],
                    book.x.as_ref().map_or(0.0, |x| x[ti]),
                );
                if priority > 0.0 {
                    entries.push(entry);
                } else {
                    tail.push(entry);
                }
            }
            for list in [&mut entries, &mut tail] {
                // Only the head of the order is usually walked: sort it in
                // growing chunks as the walk reaches them.
                let mut sorted = 0usize;
                let mut at = 0;
                while at < list.len() && left[ti] > 0 && chosen_count < jobs {
                    if at == sorted {
                        let chunk = (left[ti] as usize + 16).max(sorted);
                        let end = (sorted + chunk).min(list.len());
                        let rest = &mut list[sorted..];
                        if end - sorted < rest.len() {
                            rest.select_nth_unstable_by(end - sorted, order_of);
                        }
                        rest[..end - sorted].sort_unstable_by(order_of);
                        sorted = end;
                    }
                    let i = list[at].0 as usize;
                    at += 1;
                    let (combo, book) = books[i];
                    let [first, second] = members[i];
                    if taken(&chosen, first)
                        || (combo.older.is_some() && taken(&chosen, second))
                        || book.scale_factor > left[ti]
                    {
                        continue;
                    }
                    left[ti] -= book.scale_factor;
                    for m in [first, second].into_iter().flatten() {
                        chosen[m as usize] = true;
                        chosen_count += 1;
                    }
                    per_type[ti].push((combo, book.scale_factor, book.x.is_some()));
                }
            }
        }
        let placements = self.assign(&order, per_type);
        for combo in self.current.keys() {
            if combo.jobs().any(|j| self.contains(j)) {
                self.stats.lease_extension_opportunities += 1;
                if placements.get(combo).is_some_and(|p| p.extended) {
                    self.stats.lease_extensions += 1;
                }
            }
        }
        self.stats.pairs_placed += placements.keys().filter(|c| c.older.is_some()).count() as u64;
        self.current = placements
            .iter()
            .map(|(combo, p)| (*combo, (p.type_index, p.workers.clone())))
            .collect();
        placements
    }

    /// GPUs for the chosen entries, type by type: largest scale factor
    /// first; within a size, entries that ran on this type last round keep
    /// their GPUs when all are still free, then the rest are packed server
    /// by server (the type's GPUs in server order, skipping taken ones).
    /// Entries the allocation does not name (arrived since the last solve)
    /// are not placed, as in Gavel.
    fn assign(
        &self,
        order: &[usize],
        mut per_type: Vec<Vec<(Combo, u32, bool)>>,
    ) -> BTreeMap<Combo, Placement> {
        let mut out: BTreeMap<Combo, Placement> = BTreeMap::new();
        let mut taken: BTreeSet<WorkerId> = BTreeSet::new();
        for &ti in order {
            let entries = &mut per_type[ti];
            if entries.is_empty() {
                continue;
            }
            entries.sort_by_key(|j| std::cmp::Reverse(j.1));
            let mut gpus = self.types[ti].servers.iter().flatten().copied();
            let mut sizes: Vec<u32> = entries.iter().map(|(_, s, _)| *s).collect();
            sizes.dedup();
            for size in sizes {
                for (combo, _, _) in entries.iter().filter(|(_, s, _)| *s == size) {
                    let Some((previous_type, previous)) = self.current.get(combo) else {
                        continue;
                    };
                    if *previous_type != ti || previous.iter().any(|w| taken.contains(w)) {
                        continue;
                    }
                    taken.extend(previous.iter().copied());
                    out.insert(
                        *combo,
                        Placement {
                            type_index: ti,
                            workers: previous.clone(),
                            extended: true,
                        },
                    );
                }
                for (combo, _, allocated) in entries.iter().filter(|(_, s, _)| *s == size) {
                    if !allocated || out.contains_key(combo) {
                        continue;
                    }
                    let mut workers = Vec::with_capacity(size as usize);
                    while workers.len() < size as usize {
                        let Some(w) = gpus.next() else {
                            break;
                        };
                        if taken.insert(w) {
                            workers.push(w);
                        }
                    }
                    if workers.len() == size as usize {
                        let extended = self
                            .current
                            .get(combo)
                            .is_some_and(|(t, w)| *t == ti && *w == workers);
                        out.insert(
                            *combo,
                            Placement {
                                type_index: ti,
                                workers,
                                extended,
                            },
                        );
                    } else {
                        // Cannot happen: the walk counted GPUs per type.
                        // Give back what was taken so nothing leaks.
                        for w in workers {
                            taken.remove(&w);
                        }
                    }
                }
            }
        }
        out
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn cluster(counts: &[(&str, u32)], per_server: u32) -> Vec<TypeServers> {
        let mut next = 0;
        counts
            .iter()
            .map(|(t, n)| {
                let mut servers = Vec::new();
                let mut left = *n;
                while left > 0 {
                    let here = left.min(per_server);
                    servers.push((next..next + here).collect());
                    next += here;
                    left -= here;
                }
                TypeServers {
                    gpu_type: t.to_string(),
                    servers,
                }
            })
            .collect()
    }

    fn speeds(v: f64, k: f64) -> BTreeMap<String, f64> {
        [("v100".to_string(), v), ("k80".to_string(), k)]
            .into_iter()
            .collect()
    }

    fn row(v: f64, k: f64) -> BTreeMap<String, f64> {
        speeds(v, k)
    }

    #[test]
    fn shuffle_follows_python_random() {
        // r = random.Random(5); r.shuffle(['v100', 'p100', 'k80']) eight
        // times on fresh lists.
        let expected = [
            ["v100", "p100", "k80"],
            ["v100", "p100", "k80"],
            ["p100", "v100", "k80"],
            ["k80", "v100", "p100"],
            ["p100", "v100", "k80"],
            ["p100", "k80", "v100"],
            ["v100", "k80", "p100"],
            ["k80", "p100", "v100"],
        ];
        let mut config = MechanismConfig::gavel();
        config.shuffle_seed = Some(5);
        let mut m = Mechanism::new(config, cluster(&[("v100", 1), ("p100", 1), ("k80", 1)], 1));
        for want in expected {
            let got: Vec<String> = m
                .round_types()
                .into_iter()
                .map(|i| m.types[i].gpu_type.clone())
                .collect();
            assert_eq!(got, want);
        }
    }

    #[test]
    fn time_sharing_follows_the_allocation() {
        // Two jobs, one v100: each should get half of it.
        let mut m = Mechanism::new(MechanismConfig::gavel(), cluster(&[("v100", 1)], 1));
        m.add_job(0, 1, &speeds(1.0, 0.0));
        m.add_job(1, 1, &speeds(1.0, 0.0));
        assert!(m.needs_solve(0.0));
        let half: BTreeMap<String, f64> = [("v100".to_string(), 0.5)].into_iter().collect();
        m.install(0.0, [(0, half.clone()), (1, half)].into_iter().collect());
        assert!(!m.needs_solve(10.0));
        let mut runs = [0u32; 2];
        for _ in 0..10 {
            let plan = m.plan_round();
            assert_eq!(plan.len(), 1, "one GPU, one job per round");
            let (job, p) = plan.iter().next().expect("one");
            let job = job.as_single().expect("no pairs here");
            runs[job as usize] += 1;
            m.record_run(Combo::single(job), p.type_index, 360.0);
        }
        assert_eq!(runs, [5, 5]);
    }

    #[test]
    fn a_job_keeps_its_gpus_and_new_jobs_wait_for_a_solve() {
        let mut m = Mechanism::new(MechanismConfig::gavel(), cluster(&[("v100", 4)], 4));
        m.add_job(0, 2, &speeds(1.0, 0.0));
        m.install(100.0, [(0, row(1.0, 0.0))].into_iter().collect());
        let first = m.plan_round();
        m.record_run(Combo::single(0), 0, 360.0);
        m.add_job(1, 2, &speeds(1.0, 0.0));
        assert!(!m.needs_solve(460.0), "the last solve is too recent");
        let second = m.plan_round();
        assert_eq!(
            second.get(&Combo::single(0)).map(|p| &p.workers),
            first.get(&Combo::single(0)).map(|p| &p.workers),
            "lease extended"
        );
        assert!(second.get(&Combo::single(0)).is_some_and(|p| p.extended));
        assert!(!second.contains_key(&Combo::single(1)), "no allocation yet");
        assert!(m.needs_solve(2020.0));
        assert_eq!(m.stats().lease_extensions, 1);
    }

    #[test]
    fn deficits_carry_what_the_old_allocation_promised() {
        let mut m = Mechanism::new(MechanismConfig::gavel(), cluster(&[("v100", 1)], 1));
        m.add_job(0, 1, &speeds(1.0, 0.0));
        m.install(0.0, [(0, row(1.0, 0.0))].into_iter().collect());
        // Promised 2,000 s on v100, received 1,500.
        m.record_run(Combo::single(0), 0, 1500.0);
        m.add_job(1, 1, &speeds(1.0, 0.0));
        assert!(m.needs_solve(2000.0));
        m.install(2000.0, Allocation::new());
        let d = m.books[&Combo::single(0)].deficit_s[0];
        assert!((d - 500.0).abs() < 1e-9, "{d}");
        assert_eq!(m.books[&Combo::single(1)].deficit_s[0], 0.0);
    }
}
