//! Node heartbeats and the leader's liveness timers.
//!
//! - **Heartbeats** (every replica that declares nodes): every
//!   `heartbeat_every`, the server reports its nodes with their inventory
//!   through the `NodeHeartbeat` RPC, which a follower forwards to the
//!   leader. They are not log entries; the leader keeps them in a
//!   [`HeartbeatInbox`].
//! - **Probes** (the leader's executor, for nodes it reaches itself: SSH
//!   hosts): answers are recorded as heartbeats, failures with their
//!   reason ([`HeartbeatInbox::record_probes`]).
//! - **Liveness** (leader only, after the term's first entry is applied):
//!   a [`NodeLiveness`] created when this replica starts to lead takes the
//!   reports and proposes what they mean: registrations, `MarkNodeLost` for
//!   nodes silent for `node_timeout`, `MarkNodeRecovered` for nodes it had
//!   marked lost that report again. A replica that loses leadership drops
//!   its timers; the next leader starts its own, counting every node as
//!   heard when it took over.

use std::collections::BTreeMap;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use keel_proto::api::keel_server::Keel;
use keel_proto::api::NodeHeartbeatRequest;
use keel_proto::entry as pb;
use keel_state::liveness::{NodeLiveness, NodeReport};
use keel_state::Command;
use tokio::sync::watch;

use crate::api::{Clock, KeelApi};
use crate::inventory::NodeInventory;
use crate::leader::{LeaderGate, LoopSettings};
use crate::proposer::Proposer;
use crate::raft_node::RaftNode;

/// Most nodes in one heartbeat.
pub const HEARTBEAT_NODES_MAX: usize = 4096;

/// Reports received by this replica while it leads, newest per node, until
/// the liveness loop takes them.
pub struct HeartbeatInbox {
    clock: Clock,
    reports: Mutex<BTreeMap<String, (u64, NodeReport)>>,
    /// Failed probes of the executor's nodes: when, and why.
    failures: Mutex<BTreeMap<String, (u64, String)>>,
}

impl std::fmt::Debug for HeartbeatInbox {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("HeartbeatInbox").finish_non_exhaustive()
    }
}

impl HeartbeatInbox {
    pub fn new(clock: Clock) -> Self {
        HeartbeatInbox {
            clock,
            reports: Mutex::new(BTreeMap::new()),
            failures: Mutex::new(BTreeMap::new()),
        }
    }

    /// Records what the executor's probes found now: answers count as
    /// heartbeats, failures keep their reason.
    pub fn record_probes(&self, probes: Vec<keel_executors::NodeProbe>) {
        let at_ms = (self.clock)();
        let mut reports = Vec::new();
        {
            let mut failures = self.failures.lock().unwrap_or_else(|e| e.into_inner());
            for probe in probes {
                match probe {
                    keel_executors::NodeProbe::Answered(r) => reports.push(r),
                    keel_executors::NodeProbe::Unreachable { name, reason } => {
                        failures.insert(name, (at_ms, reason));
                    }
                }
            }
        }
        self.record(reports);
    }

    fn take_failures(&self) -> BTreeMap<String, (u64, String)> {
        std::mem::take(&mut *self.failures.lock().unwrap_or_else(|e| e.into_inner()))
    }

    /// Records reports received now.
    pub fn record(&self, reports: Vec<NodeReport>) {
        let at_ms = (self.clock)();
        let mut inbox = self.reports.lock().unwrap_or_else(|e| e.into_inner());
        for r in reports {
            inbox.insert(r.name.clone(), (at_ms, r));
        }
    }

    fn take(&self) -> BTreeMap<String, (u64, NodeReport)> {
        std::mem::take(&mut *self.reports.lock().unwrap_or_else(|e| e.into_inner()))
    }
}

/// The reports in a heartbeat request.
pub fn reports_from_proto(nodes: Vec<pb::RegisterNode>) -> Vec<NodeReport> {
    nodes
        .into_iter()
        .map(|n| NodeReport {
            name: n.name,
            address: n.address,
            gpus: n
                .gpus
                .into_iter()
                .map(keel_state::codec::gpu_from_proto)
                .collect(),
            note: n.note,
        })
        .collect()
}

/// Reports this server's nodes every `settings.heartbeat_every`, through
/// its own API (which forwards to the leader). Returns when `stop` turns
/// true.
pub async fn heartbeat_loop(
    api: Arc<KeelApi>,
    nodes: Vec<NodeInventory>,
    logs_floor: Option<LogsFloor>,
    settings: LoopSettings,
    mut stop: watch::Receiver<bool>,
) {
    if nodes.is_empty() {
        return;
    }
    let mut request = NodeHeartbeatRequest {
        nodes: nodes
            .iter()
            .map(|n| pb::RegisterNode {
                name: n.name.clone(),
                address: n.address.clone(),
                gpus: n.gpus.iter().map(keel_state::codec::gpu_to_proto).collect(),
                note: String::new(),
            })
            .collect(),
    };
    // A beat that is not answered in time is abandoned: the next one goes
    // out on time (a beat stuck on a dead connection must not silence the
    // node for good).
    let deadline = settings.heartbeat_every.max(Duration::from_secs(1)) * 2;
    let discovered = nodes.iter().any(|n| n.discovered);
    let mut checked: Option<tokio::time::Instant> = None;
    loop {
        if checked.is_none_or(|t| t.elapsed() >= NOTE_EVERY) {
            checked = Some(tokio::time::Instant::now());
            let strangers = if discovered {
                strangers_note().await
            } else {
                String::new()
            };
            let logs = match &logs_floor {
                Some(floor) => floor.note().await,
                None => String::new(),
            };
            for (node, inventory) in request.nodes.iter_mut().zip(&nodes) {
                let mut parts = Vec::new();
                if inventory.discovered && !strangers.is_empty() {
                    parts.push(strangers.as_str());
                }
                if !logs.is_empty() {
                    parts.push(logs.as_str());
                }
                node.note = parts.join("; ");
                keel_state::state::limits::cut_to(
                    &mut node.note,
                    keel_state::state::limits::NODE_NOTE_MAX_LEN,
                );
            }
        }
        let beat = api.node_heartbeat(tonic::Request::new(request.clone()));
        let wait = match tokio::time::timeout(deadline, beat).await {
            Ok(Ok(_)) => settings.heartbeat_every,
            Ok(Err(status)) => {
                // No leader yet, or an election: try again soon.
                tracing::debug!(error = %status.message(), "heartbeat not delivered");
                settings.heartbeat_every.min(Duration::from_millis(200))
            }
            Err(_) => {
                tracing::debug!(?deadline, "heartbeat not answered in time");
                settings.heartbeat_every.min(Duration::from_millis(200))
            }
        };
        tokio::select! {
            _ = tokio::time::sleep(wait) => {}
            _ = stop.changed() => return,
        }
        if *stop.borrow() {
            return;
        }
    }
}

/// Where a server's workers write their logs, and the free space below
/// which their supervisors pause them.
#[derive(Debug, Clone)]
pub struct LogsFloor {
    pub dir: std::path::PathBuf,
    pub min_free_bytes: u64,
}

impl LogsFloor {
    /// "worker logs paused: ..." while the filesystem is below the floor
    /// (the supervisors pause each worker's log then), else empty.
    async fn note(&self) -> String {
        let dir = self.dir.clone();
        let free = tokio::task::spawn_blocking(move || {
            // The directory may not exist before the first worker.
            let mut at = dir.as_path();
            while !at.exists() {
                match at.parent() {
                    Some(p) => at = p,
                    None => break,
                }
            }
            keel_executors::worker_log::free_bytes(at)
        })
        .await;
        match free {
            Ok(Ok(free)) if free < self.min_free_bytes => {
                use keel_executors::worker_log::show_bytes;
                format!(
                    "worker logs paused: their filesystem has {} free, under the floor of {} (--worker-log-min-free-bytes)",
                    show_bytes(free),
                    show_bytes(self.min_free_bytes)
                )
            }
            _ => String::new(),
        }
    }
}

/// How often a server looks at what its nodes' note says: with real GPUs,
/// which processes use them; whether its workers' logs are paused.
const NOTE_EVERY: Duration = Duration::from_secs(2);

/// The processes on this machine's GPUs that no Keel worker started, as
/// the node's note ("GPU 0 busy: pid P (name)"; empty when none): the
/// executor refuses those GPUs, and `keel nodes` says why.
async fn strangers_note() -> String {
    use keel_executors::discovery;
    let found = tokio::task::spawn_blocking(|| {
        discovery::gpu_processes().map(|all| {
            all.into_iter()
                .filter(|p| discovery::keel_job_of(p.pid).is_none())
                .map(|p| p.to_string())
                .collect::<Vec<_>>()
        })
    })
    .await;
    let mut note = match found {
        Ok(Ok(busy)) => busy.join("; "),
        Ok(Err(e)) => format!("cannot list the processes on its GPUs: {e}"),
        Err(_) => String::new(),
    };
    keel_state::state::limits::cut_to(&mut note, keel_state::state::limits::NODE_NOTE_MAX_LEN);
    note
}

/// The leader's liveness timers. Returns when `stop` turns true.
pub async fn liveness_loop(
    node: Arc<RaftNode>,
    proposer: Proposer,
    inbox: Arc<HeartbeatInbox>,
    clock: Clock,
    settings: LoopSettings,
    mut stop: watch::Receiver<bool>,
) {
    let mut gate = LeaderGate::new("node liveness");
    // The term these timers were started in, and the timers.
    let mut timers: Option<(u64, NodeLiveness)> = None;
    // Cheap when nothing is due (one pass over the nodes), and a new node
    // is registered within a tick of its first report.
    let tick = (settings.node_timeout / 10).min(Duration::from_millis(200));
    loop {
        tokio::select! {
            _ = tokio::time::sleep(tick) => {}
            _ = stop.changed() => return,
        }
        if *stop.borrow() {
            return;
        }
        if !gate.ready(&node).await {
            timers = None;
            continue;
        }
        let term = node.raft.metrics().borrow().current_term;
        let (_, liveness) = match &mut timers {
            Some((t, l)) if *t == term => (t, l),
            _ => {
                tracing::info!(term, "node liveness timers started");
                let timeout_ms =
                    u64::try_from(settings.node_timeout.as_millis()).unwrap_or(u64::MAX);
                let started = timers.insert((term, NodeLiveness::new(timeout_ms, clock())));
                (&mut started.0, &mut started.1)
            }
        };
        for (_, (at_ms, report)) in inbox.take() {
            liveness.heard(report, at_ms);
        }
        for (name, (at_ms, reason)) in inbox.take_failures() {
            liveness.unreachable(&name, &reason, at_ms);
        }
        let due = {
            let shared = node.state_machine.shared();
            let applied = shared.read();
            liveness.forget_removed(&applied.state);
            liveness.due(&applied.state, clock())
        };
        for command in due {
            if let Command::MarkNodeLost { name, reason } = &command {
                tracing::warn!(node = %name, %reason, "marking a silent node lost");
            }
            let kind = command.kind();
            if let Err(e) = proposer.propose(command).await {
                tracing::warn!(error = %e, kind, "liveness entry not committed");
            }
        }
    }
}
