//! One chaos run: start the cluster, run the workload, inject the faults of
//! the schedule round by round, heal, check, report.

use std::collections::BTreeMap;
use std::path::PathBuf;
use std::time::{Duration, Instant};

use keel_proto::api;

use crate::checker::{self, FinalReplica, ReplayCheck};
use crate::cluster::{Cluster, ClusterConfig, ClusterError};
use crate::faults::{self, FaultKind};
use crate::report::{Percentiles, Report, RoundReport};
use crate::workload::{self, History, Op, Outcome, Request, RunClock, WorkloadConfig};

/// How a run goes.
#[derive(Debug, Clone)]
pub struct RunConfig {
    /// The `keel` binary the replicas run.
    pub keel: PathBuf,
    pub replicas: u64,
    pub rounds: u32,
    pub seed: u64,
    /// The fault kinds dealt (all by default).
    pub kinds: Vec<FaultKind>,
    pub clients: u32,
    pub rate_per_client: f64,
    /// Where the replicas' directories go (`None`: a fresh one under the
    /// system's temporary directory, removed after a passing run).
    pub dir: Option<PathBuf>,
    /// How long the cluster may take to commit again after a heal, to elect
    /// and commit after a fault that leaves a majority, and to schedule
    /// again at the end.
    pub liveness_bound: Duration,
    /// Pause between rounds.
    pub calm: Duration,
    /// Clients read stale (see [`WorkloadConfig::stale_reads`]): the
    /// checker must then find violations.
    pub stale_reads: bool,
    /// libfaketime, for the skewed-clock fault (found where installed).
    pub faketime: Option<PathBuf>,
    /// The replicas and the clients over mutual TLS (issue 22).
    pub tls: bool,
    /// And ACLs on: the clients present an operator's token (implies
    /// `tls`).
    pub acl: bool,
}

impl RunConfig {
    pub fn new(keel: PathBuf, seed: u64, rounds: u32) -> RunConfig {
        RunConfig {
            keel,
            replicas: 3,
            rounds,
            seed,
            kinds: FaultKind::ALL.to_vec(),
            clients: 3,
            rate_per_client: 8.0,
            dir: None,
            liveness_bound: Duration::from_secs(20),
            calm: Duration::from_millis(500),
            stale_reads: false,
            faketime: crate::faults::libfaketime(),
            tls: false,
            acl: false,
        }
    }

    /// The command line that runs this configuration again.
    pub fn command_line(&self) -> String {
        let kinds = self
            .kinds
            .iter()
            .map(|k| k.as_str())
            .collect::<Vec<_>>()
            .join(",");
        format!(
            "keel-chaos --seed {} --rounds {} --replicas {} --clients {} --rate {} --faults {kinds}{}{}{}",
            self.seed,
            self.rounds,
            self.replicas,
            self.clients,
            self.rate_per_client,
            if self.stale_reads { " --stale-reads" } else { "" },
            if self.tls && !self.acl { " --tls" } else { "" },
            if self.acl { " --acl" } else { "" }
        )
    }
}

#[derive(Debug, thiserror::Error)]
pub enum RunError {
    #[error(transparent)]
    Cluster(#[from] ClusterError),
    #[error("{0}")]
    Setup(String),
}

/// The harness's own probe writes: how failovers and heals are timed, and
/// where liveness failures are collected.
struct Probes {
    clock: RunClock,
    history: History,
    /// Probes sent so far (each a job named `probe-N`).
    sent: u64,
    /// How long a write may take to be acknowledged.
    bound: Duration,
    liveness: Vec<String>,
}

impl Probes {
    /// Submits a probe job (recorded in the history) to `replicas` in turn,
    /// a new one every 100 ms without waiting for those in flight, until one
    /// is acknowledged or `bound` passes; returns when the first was
    /// acknowledged (run clock, ms). Probes still in flight finish (and are
    /// recorded) on their own.
    async fn wait_for_write(
        &mut self,
        cluster: &Cluster,
        replicas: &[u64],
        bound: Duration,
    ) -> Option<u64> {
        let deadline = Instant::now() + bound;
        let (acked_tx, mut acked_rx) = tokio::sync::mpsc::unbounded_channel::<u64>();
        let mut turn = 0usize;
        let mut tick = tokio::time::interval(Duration::from_millis(100));
        while Instant::now() < deadline && !replicas.is_empty() {
            tokio::select! {
                Some(at) = acked_rx.recv() => return Some(at),
                _ = tick.tick() => {}
            }
            let replica = replicas[turn % replicas.len()];
            turn += 1;
            self.sent += 1;
            let name = format!("probe-{}", self.sent);
            let Some(mut c) = cluster.client(replica) else {
                continue;
            };
            let history = self.history.clone();
            let clock = self.clock;
            let acked_tx = acked_tx.clone();
            tokio::spawn(async move {
                let invoked_ms = clock.now_ms();
                let call = c.submit_job(api::SubmitJobRequest {
                    spec: Some(keel_state::codec::spec_to_proto(&workload::job_spec(
                        &name, false,
                    ))),
                    request_id: name.clone(),
                });
                let outcome = match tokio::time::timeout(Duration::from_millis(2000), call).await {
                    Ok(Ok(r)) => {
                        let r = r.into_inner();
                        Outcome::Ok {
                            index: Some(r.index),
                            job_id: Some(r.job_id),
                            state: None,
                        }
                    }
                    Ok(Err(status)) => workload::outcome_of_error(&status),
                    Err(_) => Outcome::Indeterminate {
                        reason: "timed out".into(),
                    },
                };
                let completed_ms = clock.now_ms();
                let acked = matches!(outcome, Outcome::Ok { .. });
                history.push(Op {
                    client: u32::MAX,
                    replica,
                    attempts: 1,
                    request: Request::Submit { name },
                    invoked_ms,
                    completed_ms,
                    outcome,
                });
                if acked {
                    let _ = acked_tx.send(completed_ms);
                }
            });
        }
        acked_rx.try_recv().ok()
    }

    /// [`Probes::wait_for_write`] within the liveness bound; a liveness
    /// failure named `what` if no write is acknowledged in time.
    async fn write(&mut self, cluster: &Cluster, replicas: &[u64], what: &str) -> Option<u64> {
        let at = self.wait_for_write(cluster, replicas, self.bound).await;
        if at.is_none() {
            self.liveness.push(format!(
                "{what}: no write acknowledged within {:?}",
                self.bound
            ));
        }
        at
    }
}

/// Records the replicas that exited without the harness stopping them
/// since the last look (`when`), and starts them again so the run goes on.
fn restart_crashed(
    cluster: &mut Cluster,
    crashes: &mut Vec<String>,
    when: &str,
) -> Result<(), RunError> {
    for (id, how) in cluster.crashed() {
        crashes.push(format!("{when}: replica {id} exited on its own: {how}"));
        cluster.spawn(id)?;
    }
    Ok(())
}

/// Waits until every replica serves the same applied index and state hash.
async fn converged(cluster: &Cluster, bound: Duration) -> Option<Vec<(u64, u64, String)>> {
    let deadline = Instant::now() + bound;
    while Instant::now() < deadline {
        let mut all = Vec::new();
        for id in 1..=cluster.config.replicas {
            match cluster.status(id, Duration::from_millis(500)).await {
                Some(s) => all.push((id, s.last_applied_index, s.state_hash)),
                None => break,
            }
        }
        if all.len() as u64 == cluster.config.replicas
            && all.iter().all(|(_, i, h)| (*i, h) == (all[0].1, &all[0].2))
        {
            return Some(all);
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    None
}

/// Every job a replica holds: id → (name, state), read locally.
async fn jobs_on(cluster: &Cluster, id: u64) -> BTreeMap<u64, (String, String)> {
    let Some(mut c) = cluster.client(id) else {
        return BTreeMap::new();
    };
    let mut all = BTreeMap::new();
    let mut page_token = String::new();
    // Page after page (the server answers at most 1,000 jobs by default).
    loop {
        let mut request = tonic::Request::new(api::ListJobsRequest {
            page_token: page_token.clone(),
            ..Default::default()
        });
        if let Ok(v) = "stale".parse() {
            request.metadata_mut().insert("keel-read", v);
        }
        match tokio::time::timeout(Duration::from_secs(10), c.list_jobs(request)).await {
            Ok(Ok(r)) => {
                let r = r.into_inner();
                all.extend(
                    r.jobs
                        .into_iter()
                        .map(|j| (j.id, (j.spec.map(|s| s.name).unwrap_or_default(), j.state))),
                );
                if r.next_page_token.is_empty() {
                    return all;
                }
                page_token = r.next_page_token;
            }
            _ => return BTreeMap::new(),
        }
    }
}

/// Marks every node alive (the workload's operator may have left some
/// lost), submits a runnable job and waits for it to succeed: scheduling
/// works.
async fn schedules(cluster: &Cluster, bound: Duration) -> Result<(), String> {
    let deadline = Instant::now() + bound;
    let mut c = cluster.client(1).ok_or("no client")?;
    for i in 1..=cluster.config.replicas {
        // Until it is done ("not lost" is as good as done) or the bound.
        while Instant::now() < deadline {
            let call = c.set_node_state(api::SetNodeStateRequest {
                name: format!("r{i}-0"),
                state: "alive".into(),
                reason: String::new(),
                request_id: String::new(),
            });
            match tokio::time::timeout(Duration::from_secs(2), call).await {
                Ok(Ok(_)) => break,
                Ok(Err(s)) if s.code() == tonic::Code::FailedPrecondition => break,
                _ => tokio::time::sleep(Duration::from_millis(100)).await,
            }
        }
    }
    let id = loop {
        let call = c.submit_job(api::SubmitJobRequest {
            spec: Some(keel_state::codec::spec_to_proto(&workload::job_spec(
                "liveness", true,
            ))),
            // Sent until acknowledged: one request id makes it one job.
            request_id: "liveness".into(),
        });
        if let Ok(Ok(r)) = tokio::time::timeout(Duration::from_secs(1), call).await {
            break r.into_inner().job_id;
        }
        if Instant::now() >= deadline {
            return Err("no write was acknowledged".into());
        }
    };
    let mut last = String::new();
    while Instant::now() < deadline {
        let call = c.get_job(api::GetJobRequest { job_id: id });
        if let Ok(Ok(j)) = tokio::time::timeout(Duration::from_secs(1), call).await {
            last = j.into_inner().state;
            if last == "succeeded" {
                return Ok(());
            }
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    Err(format!(
        "job {id} did not succeed within {bound:?} (last seen {last:?})"
    ))
}

/// Runs one chaos run to its report.
pub async fn run(config: &RunConfig) -> Result<Report, RunError> {
    let started = Instant::now();
    let (dir, temporary) = match &config.dir {
        Some(d) => (d.clone(), false),
        None => (
            std::env::temp_dir().join(format!("keel-chaos-{}-{}", config.seed, std::process::id())),
            true,
        ),
    };
    std::fs::create_dir_all(&dir)
        .map_err(|e| RunError::Setup(format!("{}: {e}", dir.display())))?;
    let mut cluster = Cluster::start(ClusterConfig {
        keel: config.keel.clone(),
        replicas: config.replicas,
        dir: dir.clone(),
        extra_args: [
            "--round-s",
            "0.5",
            "--progress-interval-s",
            "0.5",
            "--stop-grace-s",
            "1",
            "--node-timeout-s",
            "3",
            "--snapshot-every",
            "300",
            "--keep-log-entries",
            "50",
        ]
        .iter()
        .map(|s| s.to_string())
        .collect(),
        tls: config.tls || config.acl,
        acl: config.acl,
    })
    .await?;
    let clock = RunClock(Instant::now());
    let history = History::default();
    let mut probes = Probes {
        clock,
        history: history.clone(),
        sent: 0,
        bound: config.liveness_bound,
        liveness: Vec::new(),
    };
    let everyone: Vec<u64> = (1..=config.replicas).collect();
    if probes
        .wait_for_write(&cluster, &everyone, Duration::from_secs(60))
        .await
        .is_none()
    {
        return Err(RunError::Setup(format!(
            "the cluster never acknowledged a write (logs in {})",
            dir.display()
        )));
    }
    let (stop_tx, stop_rx) = tokio::sync::watch::channel(false);
    // Two live workers of one identity are a duplicate, whatever the log
    // says (a stale leader's launch).
    let watching = tokio::spawn(crate::workers::watch_for_duplicates(
        dir.clone(),
        Duration::from_millis(50),
        stop_rx.clone(),
    ));
    let addrs: Vec<(u64, std::net::SocketAddr)> =
        cluster.replicas.iter().map(|r| (r.id, r.listen)).collect();
    let clients: Vec<_> = (0..config.clients)
        .map(|id| {
            tokio::spawn(workload::client(
                id,
                addrs.clone(),
                WorkloadConfig {
                    rate_per_client: config.rate_per_client,
                    timeout: Duration::from_secs(3),
                    seed: config.seed,
                    stale_reads: config.stale_reads,
                    nodes: (1..=config.replicas).map(|i| format!("r{i}-0")).collect(),
                    transport: cluster.transport.clone(),
                    token: cluster.token.clone(),
                },
                clock,
                history.clone(),
                stop_rx.clone(),
            ))
        })
        .collect();

    let schedule = faults::schedule(config.seed, config.rounds, &config.kinds);
    let mut rounds = Vec::new();
    let mut crashes = Vec::new();
    for round in schedule {
        restart_crashed(
            &mut cluster,
            &mut crashes,
            &format!("before round {}", rounds.len()),
        )?;
        // A member that lost its disk is re-admitted (a learner, caught
        // up, then a voter) within the liveness bound, before the next
        // fault: until then it is one member down, and one more fault
        // would be two.
        if let Err(e) = cluster.wait_members_current(config.liveness_bound).await {
            probes.liveness.push(format!(
                "round {}: the membership is not every replica as a voter within {:?}: {e}",
                rounds.len(),
                config.liveness_bound
            ));
        }
        let Some(leader) = cluster.wait_leader(config.liveness_bound).await else {
            // A cluster that cannot elect is the finding: the rounds after
            // this one are not dealt (each would wait out the bound again),
            // and the run goes on to its checks and report.
            probes.liveness.push(format!(
                "round {}: no leader within {:?} before injecting; the remaining rounds are not dealt",
                rounds.len(),
                config.liveness_bound
            ));
            rounds.push(RoundReport {
                round,
                victims: Vec::new(),
                injected_at_ms: clock.now_ms(),
                failover_ms: None,
                heal_ms: None,
            });
            break;
        };
        let followers: Vec<u64> = cluster
            .running()
            .into_iter()
            .filter(|r| *r != leader)
            .collect();
        let follower = followers
            .get((round.pick % followers.len().max(1) as u64) as usize)
            .copied()
            .unwrap_or(leader);
        let others: Vec<u64> = everyone.iter().copied().filter(|r| *r != leader).collect();
        let injected_at_ms = clock.now_ms();
        let victims: Vec<u64> = match round.kind {
            FaultKind::KillLeader => {
                cluster.kill(leader);
                vec![leader]
            }
            FaultKind::KillFollower => {
                cluster.kill(follower);
                vec![follower]
            }
            FaultKind::KillMajority => {
                let majority = config.replicas / 2 + 1;
                let mut v = vec![leader];
                v.extend(others.iter().copied().take(majority as usize - 1));
                for id in &v {
                    cluster.kill(*id);
                }
                v
            }
            FaultKind::PauseLeader => {
                cluster.pause(leader);
                vec![leader]
            }
            FaultKind::IsolateLeader => {
                cluster.links.partition(&[leader], &others);
                vec![leader]
            }
            FaultKind::IsolateFollower => {
                let rest: Vec<u64> = everyone
                    .iter()
                    .copied()
                    .filter(|r| *r != follower)
                    .collect();
                cluster.links.partition(&[follower], &rest);
                vec![follower]
            }
            FaultKind::LeaderCannotSend => {
                for o in &others {
                    cluster.links.cut(leader, *o);
                }
                vec![leader]
            }
            FaultKind::LeaderCannotHear => {
                for o in &others {
                    cluster.links.cut(*o, leader);
                }
                vec![leader]
            }
            FaultKind::WipeFollower => {
                cluster.wipe(follower)?;
                vec![follower]
            }
            FaultKind::WipeFollowerThenPauseLeader => {
                let lagging = crate::faults::lagging_followers(&others, follower, config.replicas);
                for id in &lagging {
                    cluster.pause(*id);
                }
                // The leader commits with the others meanwhile.
                tokio::time::sleep(Duration::from_millis(round.hold_ms / 3)).await;
                cluster.pause(leader);
                cluster.wipe(follower)?;
                for id in &lagging {
                    cluster.resume(*id);
                }
                let mut v = vec![leader, follower];
                v.extend(lagging);
                v
            }
            FaultKind::SlowDiskFollower => {
                cluster.restart_with(follower, &[("FAILPOINTS", "wal-append=sleep(150)")])?;
                vec![follower]
            }
            FaultKind::FullDiskFollower => {
                cluster.restart_with(follower, &[("FAILPOINTS", "wal-append=3*off->return")])?;
                vec![follower]
            }
            FaultKind::SkewedClock => {
                let victim = if round.pick & 2 == 0 {
                    leader
                } else {
                    follower
                };
                let skew_s = crate::faults::clock_skew_s(round.pick >> 8);
                match &config.faketime {
                    Some(lib) => {
                        let env = crate::faults::skewed_clock_env(lib, skew_s);
                        let pairs: Vec<(&str, &str)> =
                            env.iter().map(|(k, v)| (*k, v.as_str())).collect();
                        tracing::info!(victim, skew_s, "restarting a replica with its clock off");
                        cluster.restart_with(victim, &pairs)?;
                    }
                    None => probes.liveness.push(format!(
                        "round {}: skewed_clock: libfaketime is not installed (apt-get install faketime)",
                        rounds.len()
                    )),
                }
                vec![victim]
            }
            FaultKind::PauseLeaderBeforeLaunch => {
                // Arm the pause, and give the leader a worker to launch.
                let trigger = cluster.pause_trigger();
                std::fs::write(&trigger, b"").map_err(|e| RunError::Setup(e.to_string()))?;
                if let Some(mut c) = cluster.client(leader) {
                    let name = format!("pause-probe-{}", rounds.len());
                    let call = c.submit_job(api::SubmitJobRequest {
                        spec: Some(keel_state::codec::spec_to_proto(&workload::job_spec(
                            &name, true,
                        ))),
                        request_id: name.clone(),
                    });
                    let _ = tokio::time::timeout(Duration::from_secs(2), call).await;
                }
                let deadline = Instant::now() + config.liveness_bound;
                let mut frozen = None;
                while frozen.is_none() && Instant::now() < deadline {
                    frozen = cluster.self_paused();
                    if frozen.is_none() {
                        tokio::time::sleep(Duration::from_millis(20)).await;
                    }
                }
                if frozen.is_none() {
                    let _ = std::fs::remove_file(&trigger);
                    probes.liveness.push(format!(
                        "round {}: pause_leader_before_launch: no replica froze before a launch \
                         within {:?} (is keel built with --features failpoints?)",
                        rounds.len(),
                        config.liveness_bound
                    ));
                }
                frozen.into_iter().collect()
            }
        };
        tracing::info!(kind = round.kind.as_str(), ?victims, "fault injected");
        // A fault that takes the leader but leaves a majority: time the
        // failover (the hold lasts at least until it is over).
        let expects_failover = matches!(
            round.kind,
            FaultKind::KillLeader
                | FaultKind::PauseLeader
                | FaultKind::IsolateLeader
                | FaultKind::LeaderCannotSend
                | FaultKind::PauseLeaderBeforeLaunch
        );
        let failover_ms = if expects_failover {
            let what = format!(
                "round {}: {} — by the majority",
                rounds.len(),
                round.kind.as_str()
            );
            probes
                .write(&cluster, &others, &what)
                .await
                .map(|t| t.saturating_sub(injected_at_ms))
        } else {
            None
        };
        let mut full_disk_stopped = true;
        if round.kind == FaultKind::FullDiskFollower {
            // Fail-stop: the replica whose disk filled exits once it has
            // to append (the workload keeps entries coming).
            let deadline = Instant::now() + config.liveness_bound;
            full_disk_stopped = false;
            while Instant::now() < deadline {
                if victims
                    .iter()
                    .all(|id| !cluster.replicas[(*id - 1) as usize].is_up() || cluster.exited(*id))
                {
                    full_disk_stopped = true;
                    break;
                }
                tokio::time::sleep(Duration::from_millis(50)).await;
            }
        }
        let held = clock.now_ms().saturating_sub(injected_at_ms);
        if held < round.hold_ms {
            tokio::time::sleep(Duration::from_millis(round.hold_ms - held)).await;
        }
        // Heal.
        cluster.links.heal();
        if !full_disk_stopped {
            probes.liveness.push(format!(
                "round {}: full_disk_follower: replica {victims:?} still ran {:?} after its disk filled \
                 (is keel built with --features failpoints?)",
                rounds.len(),
                config.liveness_bound
            ));
        }
        for id in &victims {
            cluster.resume(*id);
            if matches!(
                round.kind,
                FaultKind::SlowDiskFollower | FaultKind::FullDiskFollower | FaultKind::SkewedClock
            ) {
                cluster.restart_with(*id, &[])?;
            } else {
                cluster.spawn(*id)?;
            }
        }
        let healed_at_ms = clock.now_ms();
        let what = format!(
            "round {}: {} — after the heal",
            rounds.len(),
            round.kind.as_str()
        );
        let at = probes.write(&cluster, &everyone, &what).await;
        rounds.push(RoundReport {
            round,
            victims,
            injected_at_ms,
            failover_ms,
            heal_ms: at.map(|t| t.saturating_sub(healed_at_ms)),
        });
        tokio::time::sleep(config.calm).await;
    }
    let _ = stop_tx.send(true);
    for c in clients {
        let _ = c.await;
    }
    restart_crashed(&mut cluster, &mut crashes, "after the last round")?;
    // Scheduling resumes, and the replicas agree.
    if let Err(e) = schedules(&cluster, config.liveness_bound * 3).await {
        probes.liveness.push(format!("after the faults: {e}"));
    }
    let statuses = converged(&cluster, Duration::from_secs(90)).await;
    if let Err(e) = cluster.wait_members_current(config.liveness_bound).await {
        probes.liveness.push(format!(
            "after the faults: a wiped member was not re-admitted within {:?}: {e}",
            config.liveness_bound
        ));
    }
    let mut replicas_final = Vec::new();
    match &statuses {
        None => probes
            .liveness
            .push("the replicas did not converge within 90 s".into()),
        Some(all) => {
            for (id, index, hash) in all {
                replicas_final.push(FinalReplica {
                    id: *id,
                    applied_index: *index,
                    state_hash: hash.clone(),
                    jobs: jobs_on(&cluster, *id).await,
                    replay: None,
                });
            }
        }
    }
    crashes.extend(
        cluster
            .crashed()
            .into_iter()
            .map(|(id, how)| format!("at the end: replica {id} exited on its own: {how}")),
    );
    // Stop hard (what is on disk must hold up to a kill -9), then replay
    // every data directory and check every index.
    for id in 1..=config.replicas {
        cluster.kill(id);
    }
    for r in &mut replicas_final {
        let data = dir.join(format!("r{}", r.id));
        let check = match keel_storage::DataDir::open(&data) {
            Err(e) => ReplayCheck {
                last_index: 0,
                state_hash: String::new(),
                invariant_violation: None,
                error: Some(e.to_string()),
            },
            Ok(d) => {
                match keel_storage::replay_data_dir_checked(
                    &d,
                    keel_storage::Until::Index(r.applied_index),
                ) {
                    Ok(s) => ReplayCheck {
                        last_index: s.last_index,
                        state_hash: s.state_hash.to_string(),
                        invariant_violation: s.invariant_violation,
                        error: None,
                    },
                    Err(e) => ReplayCheck {
                        last_index: 0,
                        state_hash: String::new(),
                        invariant_violation: None,
                        error: Some(e.to_string()),
                    },
                }
            }
        };
        r.replay = Some(check);
    }
    let ops = history.ops();
    let mut findings = checker::check(&ops, &replicas_final);
    findings
        .duplicated
        .extend(watching.await.unwrap_or_default());
    let mut faults_by_kind: BTreeMap<String, u64> = BTreeMap::new();
    for r in &rounds {
        *faults_by_kind
            .entry(r.round.kind.as_str().to_string())
            .or_default() += 1;
    }
    let liveness = probes.liveness;
    let passed =
        findings.passed() && liveness.is_empty() && crashes.is_empty() && statuses.is_some();
    let reproduce = (!passed).then(|| {
        let mut s = format!(
            "reproduce: {}\nreplica directories and logs: {}\nschedule:\n",
            config.command_line(),
            dir.display()
        );
        for (i, r) in rounds.iter().enumerate() {
            s.push_str(&format!(
                "  round {i}: {} on {:?} at {} ms, held {} ms\n",
                r.round.kind.as_str(),
                r.victims,
                r.injected_at_ms,
                r.round.hold_ms
            ));
        }
        s
    });
    let report = Report {
        seed: config.seed,
        replicas: config.replicas,
        faults_by_kind,
        operations: Report::operations_of(&ops),
        lost: findings.lost.len(),
        duplicated: findings.duplicated.len(),
        divergent: findings.divergent.len(),
        invariant_violations: findings.invariant_violations.len(),
        linearizability_violations: findings.linearizability.len(),
        failover: Percentiles::of(rounds.iter().filter_map(|r| r.failover_ms).collect()),
        heal: Percentiles::of(rounds.iter().filter_map(|r| r.heal_ms).collect()),
        rounds,
        liveness,
        crashes,
        findings,
        replicas_final,
        wall_s: started.elapsed().as_secs_f64(),
        passed,
        reproduce,
    };
    drop(cluster);
    if report.passed && temporary {
        let _ = std::fs::remove_dir_all(&dir);
    }
    Ok(report)
}
