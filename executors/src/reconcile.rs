//! The reconciler's decision, as a pure function: desired workers (from the
//! state) and observed workers (from the executor) in, actions out.
//!
//! Level-triggered and idempotent: the same inputs give the same actions, an
//! observed worker is never launched again, and a worker's identity is
//! (job, allocation epoch, rank), so a new epoch is a new worker. The
//! runtime (the leader's reconcile loop) executes the actions and turns the
//! `Record*` ones into log entries.

use std::collections::{BTreeMap, BTreeSet};

use keel_state::{ClusterState, GpuRef, JobState, WorkerState};

use crate::contract::{SharedWith, WorkerLaunch};
use crate::WorkerId;

/// What the executor reports about a worker it runs or ran.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Observed {
    Running {
        gpus: Vec<GpuRef>,
    },
    Exited {
        exit_code: Option<i32>,
        reason: String,
    },
    /// Its node refused to start it (a kubelet admission error: no device
    /// free): recorded as an exit that spends none of the job's retries.
    NotAdmitted {
        reason: String,
    },
}

impl Observed {
    /// What an executor's record of a worker says: exited (code, reason),
    /// or running on `gpus`.
    pub fn of(exited: &Option<(Option<i32>, String)>, gpus: &[GpuRef]) -> Observed {
        match exited {
            Some((exit_code, reason)) => Observed::Exited {
                exit_code: *exit_code,
                reason: reason.clone(),
            },
            None => Observed::Running {
                gpus: gpus.to_vec(),
            },
        }
    }
}

/// How an exit is reported: a worker Keel was stopping says so.
pub fn exit_reason(stopping: bool, reason: String) -> String {
    if stopping && !reason.contains("stopped") {
        format!("{reason} (stopped by keel)")
    } else {
        reason
    }
}

/// One step the reconciler asks for.
#[derive(Debug, Clone, PartialEq)]
pub enum Action {
    /// Record in the log that the worker exited; then the executor forgets it.
    RecordExit {
        id: WorkerId,
        exit_code: Option<i32>,
        reason: String,
        /// Its node refused to start it ([`Observed::NotAdmitted`]).
        not_admitted: bool,
    },
    /// Stop a worker that is no longer wanted (SIGTERM, grace, SIGKILL).
    Stop { id: WorkerId },
    /// Start a wanted worker that is not running.
    Launch(Box<WorkerLaunch>),
    /// Record in the log that a wanted worker runs.
    RecordStart { id: WorkerId, node: String },
}

/// The workers the state wants running: every rank of every running job's
/// current allocation, except ranks already recorded as exited.
pub fn desired_workers(state: &ClusterState) -> BTreeMap<WorkerId, WorkerLaunch> {
    let mut out = BTreeMap::new();
    for job in state.allocated_jobs() {
        let job_id = &job.id;
        if job.state != JobState::Running {
            continue;
        }
        let Some(alloc) = &job.allocation else {
            continue;
        };
        let ranks = alloc.ranks(job.spec.gpus);
        let world_size = u32::try_from(ranks.len()).unwrap_or(u32::MAX);
        let rendezvous_addr = ranks
            .first()
            .and_then(|g| g.first())
            .and_then(|g| state.nodes().get(&g.node))
            .map(|n| n.address.clone())
            .unwrap_or_default();
        let mut per_node: BTreeMap<&str, u32> = BTreeMap::new();
        for gpus in &ranks {
            if let Some(first) = gpus.first() {
                *per_node.entry(first.node.as_str()).or_default() += 1;
            }
        }
        let mut seen_on_node: BTreeMap<&str, u32> = BTreeMap::new();
        for (rank, gpus) in ranks.iter().enumerate() {
            let Some(first) = gpus.first() else { continue };
            let rank = u32::try_from(rank).unwrap_or(u32::MAX);
            let local_rank = {
                let n = seen_on_node.entry(first.node.as_str()).or_default();
                *n += 1;
                *n - 1
            };
            let exited = job
                .workers
                .get(&rank)
                .is_some_and(|w| w.epoch == alloc.epoch && w.state == WorkerState::Exited);
            if exited {
                continue;
            }
            let id = WorkerId {
                job_id: *job_id,
                epoch: alloc.epoch,
                rank,
            };
            let gpu_type = state
                .nodes()
                .get(&first.node)
                .and_then(|n| n.gpus.get(&first.index))
                .cloned()
                .unwrap_or_default();
            let shared_with = alloc.shared_with.map(|partner| SharedWith {
                job_id: partner,
                model: state.job(partner).and_then(|p| p.spec.model.clone()),
            });
            out.insert(
                id.clone(),
                WorkerLaunch {
                    id,
                    job_name: job.spec.name.clone(),
                    command: job.spec.command.clone(),
                    image: job.spec.image.clone().filter(|i| !i.is_empty()),
                    env: job.spec.env.clone(),
                    secret_env: job
                        .spec
                        .secret_env
                        .iter()
                        .map(|(name, reference)| {
                            let sealed = state
                                .secrets()
                                .get(&reference.name)
                                .and_then(|s| s.values.get(&reference.key))
                                .cloned();
                            let secret = crate::contract::SecretEnv {
                                reference: reference.clone(),
                                sealed,
                                value: None,
                            };
                            (name.clone(), secret)
                        })
                        .collect(),
                    node: first.node.clone(),
                    gpus: gpus.iter().map(|g| g.index).collect(),
                    gpu_type,
                    world_size,
                    local_rank,
                    local_world_size: per_node.get(first.node.as_str()).copied().unwrap_or(1),
                    rendezvous_addr: rendezvous_addr.clone(),
                    model: job.spec.model.clone(),
                    total_steps: job.spec.total_steps,
                    shared_with,
                    resources: job.spec.resources,
                    logs: job.spec.logs,
                    trace_parent: job.trace_parent.clone(),
                },
            );
        }
    }
    out
}

/// Workers the state records as running (started and not exited).
pub fn recorded_running(state: &ClusterState) -> BTreeSet<WorkerId> {
    let mut out = BTreeSet::new();
    for job in state.jobs_with_running_workers() {
        for (rank, w) in &job.workers {
            if w.state == WorkerState::Running {
                out.insert(WorkerId {
                    job_id: job.id,
                    epoch: w.epoch,
                    rank: *rank,
                });
            }
        }
    }
    out
}

/// The actions that bring what runs towards what is wanted, in the order to
/// take them: exits are recorded first, unwanted workers stopped, then
/// wanted ones launched (only on GPUs no other live process uses: a stopped
/// worker keeps its GPUs until it has exited; the one exception is a
/// wanted worker of the launch's declared partner, which shares them),
/// then starts recorded.
pub fn reconcile(
    desired: &BTreeMap<WorkerId, WorkerLaunch>,
    observed: &BTreeMap<WorkerId, Observed>,
    recorded_running: &BTreeSet<WorkerId>,
) -> Vec<Action> {
    let mut actions = Vec::new();
    let mut busy: BTreeMap<&GpuRef, Vec<&WorkerId>> = BTreeMap::new();
    for (id, o) in observed {
        match o {
            Observed::Exited { exit_code, reason } => actions.push(Action::RecordExit {
                id: id.clone(),
                exit_code: *exit_code,
                reason: reason.clone(),
                not_admitted: false,
            }),
            Observed::NotAdmitted { reason } => actions.push(Action::RecordExit {
                id: id.clone(),
                exit_code: None,
                reason: reason.clone(),
                not_admitted: true,
            }),
            Observed::Running { gpus } => {
                for g in gpus {
                    busy.entry(g).or_default().push(id);
                }
                if !desired.contains_key(id) {
                    actions.push(Action::Stop { id: id.clone() });
                }
            }
        }
    }
    for (id, launch) in desired {
        if observed.contains_key(id) {
            continue;
        }
        let partner = launch.shared_with.as_ref().map(|p| p.job_id);
        let blocked = launch.gpus.iter().any(|index| {
            let gpu = GpuRef {
                node: launch.node.clone(),
                index: *index,
            };
            busy.get(&gpu).is_some_and(|holders| {
                holders
                    .iter()
                    .any(|h| Some(h.job_id) != partner || !desired.contains_key(*h))
            })
        });
        if !blocked {
            actions.push(Action::Launch(Box::new(launch.clone())));
        }
    }
    for (id, o) in observed {
        if let (Observed::Running { .. }, Some(launch)) = (o, desired.get(id)) {
            if !recorded_running.contains(id) {
                actions.push(Action::RecordStart {
                    id: id.clone(),
                    node: launch.node.clone(),
                });
            }
        }
    }
    actions
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;
    use keel_state::fixtures::job_spec;
    use keel_state::{Command, Gpu, JobPlacement, LogEntry};

    /// A state built entry by entry, for the reconciler's tests and its
    /// engine's.
    pub(crate) struct World {
        pub(crate) state: ClusterState,
        index: u64,
    }

    impl World {
        /// Node n0: 4 V100s at 10.0.0.5.
        pub(crate) fn new() -> World {
            let mut w = World {
                state: ClusterState::new(),
                index: 0,
            };
            w.add_node("n0", "10.0.0.5", 4);
            w
        }

        pub(crate) fn add_node(&mut self, name: &str, address: &str, gpus: u32) {
            self.apply(Command::register_node(
                name,
                address,
                (0..gpus)
                    .map(|index| Gpu {
                        index,
                        gpu_type: "v100".into(),
                    })
                    .collect(),
            ));
        }

        /// Submits a job of `gpus` GPUs in one worker; its id.
        pub(crate) fn submit(&mut self, name: &str, gpus: u32) -> u64 {
            self.apply(Command::submit_job(job_spec(name, gpus, 1)));
            self.state.jobs().keys().copied().max().unwrap_or(0)
        }

        pub(crate) fn apply(&mut self, command: Command) {
            self.index += 1;
            self.state
                .apply(self.index, &LogEntry::new(1, command))
                .expect("applies");
        }
        fn place(&mut self, job_id: u64, gpus: &[u32]) {
            self.place_on(job_id, "n0", gpus);
        }

        /// Places `job_id` on `gpus` of `node`.
        pub(crate) fn place_on(&mut self, job_id: u64, node: &str, gpus: &[u32]) {
            self.apply(Command::decide_allocation(
                self.index,
                "test",
                1,
                vec![JobPlacement {
                    job_id,
                    gpus: gpus
                        .iter()
                        .map(|index| GpuRef {
                            node: node.into(),
                            index: *index,
                        })
                        .collect(),
                    share_with: None,
                }],
            ));
        }
        fn actions(&self, observed: &BTreeMap<WorkerId, Observed>) -> Vec<Action> {
            reconcile(
                &desired_workers(&self.state),
                observed,
                &recorded_running(&self.state),
            )
        }
    }

    fn gpu(index: u32) -> GpuRef {
        GpuRef {
            node: "n0".into(),
            index,
        }
    }

    fn wid(job_id: u64, epoch: u64, rank: u32) -> WorkerId {
        WorkerId {
            job_id,
            epoch,
            rank,
        }
    }

    fn running(gpus: &[u32]) -> Observed {
        Observed::Running {
            gpus: gpus.iter().map(|i| gpu(*i)).collect(),
        }
    }

    #[test]
    fn a_new_allocation_launches_every_rank_with_the_contract() {
        let mut w = World::new();
        w.apply(Command::submit_job(job_spec("a", 2, 2)));
        w.place(1, &[0, 1, 2, 3]);
        let actions = w.actions(&BTreeMap::new());
        let launches: Vec<&WorkerLaunch> = actions
            .iter()
            .filter_map(|a| match a {
                Action::Launch(l) => Some(l.as_ref()),
                _ => None,
            })
            .collect();
        assert_eq!(launches.len(), 2);
        assert_eq!(launches[1].id, wid(1, 1, 1));
        assert_eq!(launches[1].gpus, vec![2, 3]);
        assert_eq!(launches[1].local_rank, 1);
        assert_eq!(launches[1].world_size, 2);
        assert_eq!(launches[1].rendezvous_addr, "10.0.0.5");
    }

    #[test]
    fn reconciling_twice_launches_nothing_twice() {
        let mut w = World::new();
        w.apply(Command::submit_job(job_spec("a", 1, 1)));
        w.place(1, &[0]);
        let observed: BTreeMap<_, _> = [(wid(1, 1, 0), running(&[0]))].into_iter().collect();
        // Running but not yet recorded: record it, launch nothing.
        assert_eq!(
            w.actions(&observed),
            vec![Action::RecordStart {
                id: wid(1, 1, 0),
                node: "n0".into()
            }]
        );
        w.apply(Command::record_worker_started(1, 1, 0, "n0"));
        assert_eq!(w.actions(&observed), vec![], "steady state: no action");
    }

    #[test]
    fn a_new_epoch_stops_the_old_worker_and_waits_for_its_gpus() {
        let mut w = World::new();
        w.apply(Command::submit_job(job_spec("a", 1, 1)));
        w.apply(Command::submit_job(job_spec("b", 1, 1)));
        w.place(1, &[0]);
        // Job 1 is preempted; job 2 gets its GPU.
        w.apply(Command::decide_allocation(
            w.index,
            "test",
            2,
            vec![
                JobPlacement {
                    job_id: 1,
                    gpus: vec![],
                    share_with: None,
                },
                JobPlacement {
                    job_id: 2,
                    gpus: vec![gpu(0)],
                    share_with: None,
                },
            ],
        ));
        let mut observed: BTreeMap<_, _> = [(wid(1, 1, 0), running(&[0]))].into_iter().collect();
        assert_eq!(
            w.actions(&observed),
            vec![Action::Stop { id: wid(1, 1, 0) }],
            "job 2 waits until job 1's process has left GPU 0"
        );
        observed.insert(
            wid(1, 1, 0),
            Observed::Exited {
                exit_code: Some(143),
                reason: "stopped".into(),
            },
        );
        let actions = w.actions(&observed);
        assert!(matches!(&actions[0], Action::RecordExit { id, .. } if *id == wid(1, 1, 0)));
        assert!(matches!(&actions[1], Action::Launch(l) if l.id == wid(2, 1, 0)));
        assert_eq!(actions.len(), 2);
    }

    #[test]
    fn a_declared_partner_launches_beside_a_running_worker_and_no_one_else_does() {
        let mut w = World::new();
        for name in ["a", "b", "c"] {
            w.apply(Command::submit_job(job_spec(name, 1, 1)));
        }
        w.place(3, &[0]);
        // Job 3 leaves GPU 0 to the pair of jobs 1 and 2.
        let pair = |a: u64, b: u64| JobPlacement {
            job_id: a,
            gpus: vec![gpu(0)],
            share_with: Some(b),
        };
        w.apply(Command::decide_allocation(
            w.index,
            "test",
            2,
            vec![JobPlacement::alone(3, vec![]), pair(1, 2), pair(2, 1)],
        ));
        // Job 3's worker still runs: neither member may start.
        let mut observed: BTreeMap<_, _> = [(wid(3, 1, 0), running(&[0]))].into_iter().collect();
        assert_eq!(
            w.actions(&observed),
            vec![Action::Stop { id: wid(3, 1, 0) }]
        );
        // Job 3 exited; job 1's worker is up: job 2's starts beside it, told
        // whom it shares with.
        observed.remove(&wid(3, 1, 0));
        observed.insert(wid(1, 1, 0), running(&[0]));
        let actions = w.actions(&observed);
        let launch = actions.iter().find_map(|a| match a {
            Action::Launch(l) => Some(l.as_ref()),
            _ => None,
        });
        let launch = launch.expect("job 2 launches");
        assert_eq!(launch.id, wid(2, 1, 0));
        assert_eq!(launch.gpus, vec![0]);
        assert_eq!(launch.shared_with.as_ref().map(|p| p.job_id), Some(1));
        let env = crate::contract::environment(launch, 29500, "/tmp/c");
        assert_eq!(
            env.get("KEEL_SHARED_WITH_JOB").map(String::as_str),
            Some("1")
        );
        assert_eq!(
            env.get("KEEL_SHARED_WITH_MODEL").map(String::as_str),
            Some("resnet50")
        );
        assert_eq!(
            env.get("CUDA_VISIBLE_DEVICES").map(String::as_str),
            Some("0")
        );
    }

    #[test]
    fn an_exited_rank_of_a_running_job_is_not_relaunched() {
        let mut w = World::new();
        w.apply(Command::submit_job(job_spec("a", 1, 2)));
        w.place(1, &[0, 1]);
        w.apply(Command::record_worker_exited(
            1,
            1,
            1,
            Some(0),
            String::new(),
        ));
        let observed: BTreeMap<_, _> = [(wid(1, 1, 0), running(&[0]))].into_iter().collect();
        let actions = w.actions(&observed);
        assert!(
            actions.iter().all(|a| !matches!(a, Action::Launch(_))),
            "{actions:?}"
        );
    }
}
