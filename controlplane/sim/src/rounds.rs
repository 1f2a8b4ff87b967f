//! The round-based simulator for the heterogeneity-aware policies
//! ([`keel_scheduling::gavel`]), with the time semantics of Gavel's simulator so its
//! results can be compared one to one (`keel sim --gavel-compat`).
//!
//! Each round the [`Mechanism`] places jobs; a placed job runs
//! `min(⌊T·round_s⌋, remaining)` whole steps at its speed `T` on that type,
//! and the round ends when its longest micro-task does (so rounds last a
//! little under `round_s`). Then finished micro-tasks are credited to the
//! mechanism (time on the type since the round began), finished jobs leave,
//! arrivals up to the new time join, and the next round is planned —
//! re-solving the policy first when the mechanism says so. When nothing
//! runs, time jumps to the next arrival.
//!
//! Unlike [`super::simulate`], this loop does not drive
//! [`keel_state::ClusterState`]: it replays Gavel's bookkeeping (a few hundred
//! thousand micro-tasks per run) rather than Keel's log entries, and it
//! is the mechanism, not the loop, that the live scheduler shares.

use std::collections::BTreeMap;

use keel_scheduling::gavel::mechanism::{Combo, Mechanism, MechanismConfig, TypeServers};
use keel_scheduling::gavel::{
    self, AllocationError, AllocationProblem, PairThroughputs, PolicyResult, PolicyRun,
    ProblemJobId,
};
use keel_scheduling::throughput;

use super::engine::{JobResult, Sample, SimNode, SimReport};
use super::workload::SimJob;
use super::ThroughputTable;

/// What to simulate.
#[derive(Debug, Clone)]
pub struct RoundSimConfig {
    pub nodes: Vec<SimNode>,
    pub jobs: Vec<SimJob>,
    /// Speeds by Gavel job type; jobs it does not hold run at the
    /// project's table's speed for their model.
    pub throughputs: Option<ThroughputTable>,
    /// The mechanism's constants; the type shuffle and the FIFO rule are
    /// set from the policy (as Gavel does) and `seed`.
    pub mechanism: MechanismConfig,
    /// Gavel's seed: type-agnostic policies shuffle the type order with
    /// `seed + 5`.
    pub seed: u64,
    /// Measure only jobs whose workload id is in `[start, end]`; stop once
    /// they all finished.
    pub window: Option<(u64, u64)>,
    /// Stop after this much simulated time even if jobs remain.
    pub max_simulated_s: f64,
    /// Price per hour by GPU type, for the cost-normalised policy.
    pub instance_costs: BTreeMap<String, f64>,
}

/// Gavel's order of the types in the per-type lists (then any other type
/// by name).
pub const GAVEL_TYPE_ORDER: [&str; 3] = ["v100", "p100", "k80"];

/// Whether Gavel shuffles the type order for `policy`: its type-agnostic
/// policies (Gavel's class names without `Perf` or `Packing`; AlloX's is
/// `AlloX_Perf`).
pub fn shuffles_types(policy: &str) -> bool {
    !policy.ends_with("_perf")
        && !policy.contains("packed")
        && !matches!(policy, "allox" | "gandiva")
}

/// The cluster as the mechanism sees it: types in Gavel's order, GPUs
/// numbered across the cluster, grouped by node.
pub fn type_servers(nodes: &[SimNode]) -> Vec<TypeServers> {
    let mut by_type: BTreeMap<String, Vec<Vec<u32>>> = BTreeMap::new();
    let mut next = 0u32;
    for node in nodes {
        // A node holds one type in the clusters `keel sim` builds; a mixed
        // node counts as one server per type.
        let mut here: BTreeMap<&str, Vec<u32>> = BTreeMap::new();
        for gpu in &node.gpus {
            here.entry(gpu.gpu_type.as_str()).or_default().push(next);
            next += 1;
        }
        for (t, ids) in here {
            by_type.entry(t.to_string()).or_default().push(ids);
        }
    }
    let mut out = Vec::new();
    for t in GAVEL_TYPE_ORDER {
        if let Some(servers) = by_type.remove(t) {
            out.push(TypeServers {
                gpu_type: t.to_string(),
                servers,
            });
        }
    }
    out.extend(
        by_type
            .into_iter()
            .map(|(gpu_type, servers)| TypeServers { gpu_type, servers }),
    );
    out
}

/// A job in the system.
#[derive(Debug, Clone)]
struct Active {
    position: usize,
    throughputs: BTreeMap<String, f64>,
    /// Steps per second by the mechanism's type index.
    speed: Vec<f64>,
    steps_done: f64,
    /// Its kind's number in [`KindPairs`] (space-sharing policies).
    kind: Option<usize>,
}

/// A micro-task of the current round: a job alone, or a pair sharing
/// GPUs (each running its own steps; the task ends with the later).
#[derive(Debug, Clone)]
struct MicroTask {
    combo: Combo,
    type_index: usize,
    gpus: u32,
    /// (job, steps it runs), one or two.
    parts: [Option<(ProblemJobId, f64)>; 2],
    start_s: f64,
    finish_s: f64,
}

/// The name a job's type has in an [`AllocationProblem`]: Gavel's job
/// type and size (pair figures exist between jobs of one size only).
fn problem_job_type(job_type: &str, scale_factor: u32) -> String {
    format!("{job_type} x{scale_factor}")
}

/// Runs `policy` (one of [`gavel::GAVEL_POLICY_NAMES`]) on `config`.
pub fn simulate_rounds(
    config: &RoundSimConfig,
    policy: &str,
) -> Result<SimReport, AllocationError> {
    if !gavel::GAVEL_POLICY_NAMES.contains(&policy) {
        return Err(AllocationError::UnknownPolicy {
            name: policy.to_string(),
        });
    }
    if policy == "allox" {
        if let Some(job) = config
            .jobs
            .iter()
            .find(|j| j.workers_min * j.gpus_per_worker != 1)
        {
            return Err(AllocationError::Invalid {
                field: "scale_factors".into(),
                reason: format!(
                    "allox places single-GPU jobs only; workload job {} has {} GPUs",
                    job.id,
                    job.workers_min * job.gpus_per_worker
                ),
            });
        }
    }
    let types = type_servers(&config.nodes);
    let cluster_spec: BTreeMap<String, u32> = types
        .iter()
        .map(|t| {
            let n = t
                .servers
                .iter()
                .map(|s| u32::try_from(s.len()).unwrap_or(u32::MAX))
                .sum();
            (t.gpu_type.clone(), n)
        })
        .collect();
    let total_gpus: u32 = cluster_spec.values().sum();
    let mut mechanism_config = config.mechanism.clone();
    mechanism_config.shuffle_seed =
        shuffles_types(policy).then(|| u32::try_from((config.seed + 5) & 0xFFFF_FFFF).unwrap_or(5));
    mechanism_config.skip_zero_priority = policy.starts_with("fifo");
    let round_s = if mechanism_config.round_s.is_finite() && mechanism_config.round_s > 0.0 {
        mechanism_config.round_s
    } else {
        360.0
    };
    let mut mechanism = Mechanism::new(mechanism_config, types);
    let mut run = PolicyRun::new(
        policy,
        u32::try_from(config.seed & 0xFFFF_FFFF).unwrap_or(0),
    )?;
    let packs = gavel::shares_gpus(policy);
    // Pairs' steps per second by type index, `[smaller id's, larger's]`.
    let mut pair_speeds: BTreeMap<(ProblemJobId, ProblemJobId), Vec<[f64; 2]>> = BTreeMap::new();
    let mut kind_pairs = KindPairs::default();
    let gpu_types: Vec<String> = cluster_spec.keys().cloned().collect();

    let mut order: Vec<usize> = (0..config.jobs.len()).collect();
    order.sort_by(|a, b| {
        config.jobs[*a]
            .arrival_s
            .total_cmp(&config.jobs[*b].arrival_s)
            .then(a.cmp(b))
    });
    let start_s = order.first().map_or(0.0, |i| config.jobs[*i].arrival_s);
    let speeds = |job: &SimJob| -> BTreeMap<String, f64> {
        let scale = job.workers_min * job.gpus_per_worker;
        cluster_spec
            .keys()
            .map(|t| {
                let from_table = config
                    .throughputs
                    .as_ref()
                    .zip(job.job_type.as_deref())
                    .and_then(|(table, job_type)| table.steps_per_s(job_type, scale, t));
                let speed = from_table
                    .unwrap_or_else(|| throughput::profile(&job.model).steps_per_s(t, scale));
                (t.clone(), speed)
            })
            .collect()
    };

    let mut report = SimReport::new(policy, total_gpus);
    let mut results: Vec<JobResult> = Vec::with_capacity(config.jobs.len());
    let mut result_of: BTreeMap<ProblemJobId, usize> = BTreeMap::new();
    let mut active: BTreeMap<ProblemJobId, Active> = BTreeMap::new();
    let mut running: Vec<MicroTask> = Vec::new();
    let mut next_arrival = 0usize;
    let mut now_s = start_s;
    // Gavel's round bookkeeping: a micro-task's time counts from the start
    // of its round, which is the end of the round before.
    let mut round_start_s = 0.0f64;
    let mut round_end_s: Option<f64> = None;
    let mut busy_gpu_s = 0.0;
    let mut window_left = config.window.map_or(0, |(a, b)| {
        config
            .jobs
            .iter()
            .filter(|j| (a..=b).contains(&j.id))
            .count()
    });
    let in_window = |id: u64| config.window.is_none_or(|(a, b)| (a..=b).contains(&id));
    let mut finished = 0usize;
    let mut placed_last_round = 0usize;

    loop {
        if config.window.is_some() && window_left == 0 {
            break;
        }
        if config.window.is_none() && finished == config.jobs.len() {
            break;
        }
        if let Some(end) = running.iter().map(|m| m.finish_s).max_by(f64::total_cmp) {
            if let Some(previous_end) = round_end_s {
                round_start_s = previous_end;
            }
            round_end_s = Some(end);
            now_s = end;
        } else if let Some(i) = order.get(next_arrival) {
            now_s = now_s.max(config.jobs[*i].arrival_s);
        } else {
            // Nothing runs and nothing will arrive: what waits can never
            // be placed.
            break;
        }
        if now_s - start_s > config.max_simulated_s {
            break;
        }

        // Credit the round's micro-tasks.
        for task in std::mem::take(&mut running) {
            let ran_s = task.finish_s - round_start_s;
            mechanism.record_run(task.combo, task.type_index, ran_s);
            busy_gpu_s += f64::from(task.gpus) * (task.finish_s - task.start_s);
            for (job, steps) in task.parts.into_iter().flatten() {
                let Some(a) = active.get_mut(&job) else {
                    continue;
                };
                a.steps_done += steps;
                let total = config.jobs[a.position].total_steps as f64;
                if total - a.steps_done <= 0.0 {
                    mechanism.remove_job(job);
                    active.remove(&job);
                    if packs {
                        pair_speeds.retain(|(x, y), _| *x != job && *y != job);
                    }
                    finished += 1;
                    if let Some(r) = result_of.get(&job).and_then(|i| results.get_mut(*i)) {
                        r.finish_s = Some(task.finish_s);
                        if in_window(r.id) {
                            window_left = window_left.saturating_sub(1);
                        }
                    }
                }
            }
        }

        // Arrivals.
        while let Some(i) = order.get(next_arrival) {
            let job = &config.jobs[*i];
            if job.arrival_s > now_s {
                break;
            }
            let throughputs = speeds(job);
            mechanism.add_job(job.id, job.workers_min * job.gpus_per_worker, &throughputs);
            let kind = match (packs, config.throughputs.as_ref()) {
                (true, Some(table)) => kind_pairs.note(job, table, &gpu_types),
                _ => None,
            };
            if packs {
                // As in Gavel: a pair with every job already here of the
                // same size whose pair figures the table has.
                for (other_id, other) in &active {
                    let (Some(mine), Some(theirs)) = (kind, other.kind) else {
                        continue;
                    };
                    let figures = kind_pairs.between(theirs, mine);
                    if figures.is_empty() {
                        continue;
                    }
                    let ((a, b), figures) = if *other_id < job.id {
                        ((*other_id, job.id), figures)
                    } else {
                        let swapped = figures.into_iter().map(|(t, [x, y])| (t, [y, x])).collect();
                        ((job.id, *other_id), swapped)
                    };
                    mechanism.add_pair(a, b, &figures);
                    let by_index = (0..cluster_spec.len())
                        .map(|ti| {
                            figures
                                .get(mechanism.type_name(ti))
                                .copied()
                                .unwrap_or([0.0, 0.0])
                        })
                        .collect();
                    pair_speeds.insert((a, b), by_index);
                }
            }
            let speed = (0..cluster_spec.len())
                .map(|ti| {
                    throughputs
                        .get(mechanism.type_name(ti))
                        .copied()
                        .unwrap_or(0.0)
                })
                .collect();
            active.insert(
                job.id,
                Active {
                    position: *i,
                    throughputs,
                    speed,
                    steps_done: 0.0,
                    kind,
                },
            );
            result_of.insert(job.id, results.len());
            results.push(JobResult {
                id: job.id,
                queue: keel_state::queue::DEFAULT_QUEUE.to_string(),
                within_quota: false,
                job_id: job.id,
                model: job.model.clone(),
                gpus: job.workers_min * job.gpus_per_worker,
                arrival_s: job.arrival_s,
                first_start_s: None,
                finish_s: None,
                cancelled_s: None,
                restarts: 0,
            });
            next_arrival += 1;
        }
        if config.window.is_some() && window_left == 0 {
            break;
        }

        // Re-solve when due, then plan the round.
        if mechanism.needs_solve(now_s) {
            let mut problem = AllocationProblem {
                cluster_spec: cluster_spec.clone(),
                throughputs: active
                    .iter()
                    .map(|(id, a)| (*id, a.throughputs.clone()))
                    .collect(),
                scale_factors: active
                    .iter()
                    .map(|(id, a)| {
                        let j = &config.jobs[a.position];
                        (*id, j.workers_min * j.gpus_per_worker)
                    })
                    .collect(),
                priority_weights: active
                    .iter()
                    .map(|(id, a)| (*id, f64::from(config.jobs[a.position].priority.max(1))))
                    .collect(),
                times_since_start: active
                    .iter()
                    .map(|(id, a)| (*id, now_s - config.jobs[a.position].arrival_s))
                    .collect(),
                num_steps_remaining: active
                    .iter()
                    .map(|(id, a)| {
                        let total = config.jobs[a.position].total_steps as f64;
                        (*id, (total - a.steps_done).max(0.0))
                    })
                    .collect(),
                instance_costs: config.instance_costs.clone(),
                slos: BTreeMap::new(),
                job_types: BTreeMap::new(),
                pair_throughputs: BTreeMap::new(),
            };
            if packs {
                problem.job_types = active
                    .iter()
                    .filter_map(|(id, a)| Some((*id, kind_pairs.name(a.kind?)?.to_string())))
                    .collect();
                problem.pair_throughputs = kind_pairs.figures.clone();
            }
            let result: PolicyResult = match run.solve(&problem, mechanism.allocation()) {
                Ok(result) => result,
                // A solver failure must not stop the cluster: fall back to
                // equal shares until the next solve.
                Err(_) => gavel::isolated(&problem),
            };
            mechanism.install_with_pairs(now_s, result.allocation, &result.pair_allocation);
        }
        let plan = mechanism.plan_round();
        report.rounds += 1;
        // A round decides something when a job starts, moves or stops.
        if plan.len() != placed_last_round || plan.values().any(|p| !p.extended) {
            report.decisions += 1;
        }
        placed_last_round = plan.len();
        for (combo, placement) in plan {
            let ti = placement.type_index;
            // (job, steps per second here) for each job of the entry.
            let members: [Option<(ProblemJobId, f64)>; 2] = match combo.as_pair() {
                None => combo.as_single().map_or([None, None], |j| {
                    let speed = active
                        .get(&j)
                        .and_then(|a| a.speed.get(ti).copied())
                        .unwrap_or(0.0);
                    [Some((j, speed)), None]
                }),
                Some((a, b)) => {
                    let [sa, sb] = pair_speeds
                        .get(&(a, b))
                        .and_then(|v| v.get(ti).copied())
                        .unwrap_or([0.0, 0.0]);
                    [Some((a, sa)), Some((b, sb))]
                }
            };
            let mut parts = [None, None];
            let mut finish_s = now_s;
            for (slot, (job, speed)) in members.into_iter().flatten().enumerate() {
                let Some(a) = active.get(&job) else {
                    continue;
                };
                if speed <= 0.0 {
                    continue;
                }
                let remaining = config.jobs[a.position].total_steps as f64 - a.steps_done;
                let steps = (speed * round_s).trunc().min(remaining);
                finish_s = finish_s.max(now_s + steps / speed);
                parts[slot] = Some((job, steps));
                if let Some(r) = result_of.get(&job).and_then(|i| results.get_mut(*i)) {
                    if r.first_start_s.is_none() {
                        r.first_start_s = Some(now_s);
                    } else if !placement.extended {
                        r.restarts += 1;
                        report.preemptions += 1;
                    }
                }
            }
            if parts.iter().all(Option::is_none) {
                continue;
            }
            running.push(MicroTask {
                combo,
                type_index: ti,
                gpus: u32::try_from(placement.workers.len()).unwrap_or(u32::MAX),
                parts,
                start_s: now_s,
                finish_s,
            });
        }
        let busy_gpus = running.iter().map(|m| m.gpus).sum();
        report.samples.push(Sample {
            at_s: now_s,
            busy_gpus,
            queued_jobs: u32::try_from(active.len().saturating_sub(running.len()))
                .unwrap_or(u32::MAX),
        });
    }

    report.jobs = results;
    report.simulated_s = now_s - start_s;
    let last_finish = report
        .jobs
        .iter()
        .filter(|j| in_window(j.id))
        .filter_map(|j| j.finish_s)
        .max_by(f64::total_cmp)
        .unwrap_or(start_s);
    report.makespan_s = last_finish - start_s;
    let available = f64::from(total_gpus) * report.simulated_s;
    report.utilisation = if available > 0.0 {
        (busy_gpu_s / available).min(1.0)
    } else {
        0.0
    };
    let stats = mechanism.stats();
    report.solves = stats.solves;
    report.lease_extensions = stats.lease_extensions;
    report.lease_extension_opportunities = stats.lease_extension_opportunities;
    report.pairs_placed = stats.pairs_placed;
    Ok(report)
}

/// The pair figures among the kinds of job (type and size) seen so far:
/// grown as new kinds arrive, so each pair of kinds is read from the table
/// once. Kinds are numbered in the order seen; the allocation problem names
/// them as in [`problem_job_type`].
#[derive(Debug, Default)]
struct KindPairs {
    /// Kind name → its number.
    numbers: BTreeMap<String, usize>,
    /// By number: (name, Gavel job type, size).
    kinds: Vec<(String, String, u32)>,
    /// (later kind, earlier or same kind) → GPU type → `[later's,
    /// earlier's]`.
    by_number: BTreeMap<(usize, usize), BTreeMap<String, [f64; 2]>>,
    /// The same figures by name, for the allocation problem.
    figures: PairThroughputs,
}

impl KindPairs {
    /// Records the kind of `job`, reading its pair figures with every kind
    /// of its size seen before (and itself); returns the kind's number.
    fn note(
        &mut self,
        job: &SimJob,
        table: &ThroughputTable,
        gpu_types: &[String],
    ) -> Option<usize> {
        let job_type = job.job_type.as_deref()?;
        let scale = job.workers_min * job.gpus_per_worker;
        let name = problem_job_type(job_type, scale);
        if let Some(n) = self.numbers.get(&name) {
            return Some(*n);
        }
        let number = self.kinds.len();
        self.numbers.insert(name.clone(), number);
        self.kinds.push((name.clone(), job_type.to_string(), scale));
        for (other, (other_name, other_type, other_scale)) in self.kinds.iter().enumerate() {
            if *other_scale != scale {
                continue;
            }
            let by_gpu: BTreeMap<String, [f64; 2]> = gpu_types
                .iter()
                .filter_map(|t| {
                    Some((
                        t.clone(),
                        table.pair_steps_per_s(job_type, other_type, scale, t)?,
                    ))
                })
                .collect();
            if !by_gpu.is_empty() {
                self.figures
                    .entry(name.clone())
                    .or_default()
                    .insert(other_name.clone(), by_gpu.clone());
                self.by_number.insert((number, other), by_gpu);
            }
        }
        Some(number)
    }

    /// The name of kind `number` in the allocation problem.
    fn name(&self, number: usize) -> Option<&str> {
        self.kinds.get(number).map(|(name, _, _)| name.as_str())
    }

    /// The figures of kinds `a` and `b` side by side, by GPU type: `[a's,
    /// b's]` (empty when the table has none for the pair).
    fn between(&self, a: usize, b: usize) -> BTreeMap<String, [f64; 2]> {
        if let Some(by_gpu) = self.by_number.get(&(a, b)) {
            return by_gpu.clone();
        }
        self.by_number
            .get(&(b, a))
            .map(|by_gpu| {
                by_gpu
                    .iter()
                    .map(|(t, [x, y])| (t.clone(), [*y, *x]))
                    .collect()
            })
            .unwrap_or_default()
    }
}
