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
use keel_state::codec::DecodeError;
use keel_state::liveness::{NodeLiveness, NodeReport};
use keel_state::proto_form::ProtoForm;
use keel_state::Command;
use tokio::sync::watch;

use crate::api::{Clock, KeelApi};
use crate::inventory::NodeInventory;
use crate::leader::{LeaderGate, LoopSettings};
use crate::proposer::Proposer;
use crate::raft_node::RaftNode;
use keel_executors::gpu_health::{GpuHealth, HealthReport, KernelLog};

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

/// The reports in a heartbeat request: `reports` when it has any (a
/// server of this release), `nodes` otherwise (the release before).
pub fn reports_from_proto(request: NodeHeartbeatRequest) -> Result<Vec<NodeReport>, DecodeError> {
    if !request.reports.is_empty() {
        return request
            .reports
            .into_iter()
            .map(|n| {
                Ok(NodeReport {
                    name: n.name,
                    address: n.address,
                    gpus: ProtoForm::from_proto(n.gpus, "record_node_inventory.gpus")?,
                    failed: ProtoForm::from_proto(n.failed, "record_node_inventory.failed")?,
                    note: n.note,
                })
            })
            .collect();
    }
    request
        .nodes
        .into_iter()
        .map(|n| {
            Ok(NodeReport {
                name: n.name,
                address: n.address,
                gpus: ProtoForm::from_proto(n.gpus, "register_node.gpus")?,
                failed: Vec::new(),
                note: n.note,
            })
        })
        .collect()
}

/// A heartbeat carrying `reports`, in both of its forms.
fn heartbeat_request(reports: &[NodeReport]) -> NodeHeartbeatRequest {
    NodeHeartbeatRequest {
        nodes: reports
            .iter()
            .map(|r| pb::RegisterNode {
                name: r.name.clone(),
                address: r.address.clone(),
                gpus: r.gpus.to_proto(),
                note: r.note.clone(),
            })
            .collect(),
        reports: reports
            .iter()
            .map(|r| pb::RecordNodeInventory {
                name: r.name.clone(),
                address: r.address.clone(),
                gpus: r.gpus.to_proto(),
                failed: r.failed.to_proto(),
                note: r.note.clone(),
            })
            .collect(),
    }
}

/// Reports this server's nodes every `settings.heartbeat_every`, through
/// its own API (which forwards to the leader). With real GPUs, it lists
/// them again every [`NOTE_EVERY`] and reads `gpu_kernel_log` for Xids
/// ([`GpuHealth`]): a GPU lost or failed is reported failed, with why.
/// Returns when `stop` turns true.
pub async fn heartbeat_loop(
    api: Arc<KeelApi>,
    nodes: Vec<NodeInventory>,
    gpu_kernel_log: Option<std::path::PathBuf>,
    logs_floor: Option<LogsFloor>,
    settings: LoopSettings,
    mut stop: watch::Receiver<bool>,
) {
    if nodes.is_empty() {
        return;
    }
    let mut reports: Vec<NodeReport> = nodes
        .iter()
        .map(|n| NodeReport {
            name: n.name.clone(),
            address: n.address.clone(),
            gpus: n.gpus.clone(),
            failed: Vec::new(),
            note: String::new(),
        })
        .collect();
    // A beat that is not answered in time is abandoned: the next one goes
    // out on time (a beat stuck on a dead connection must not silence the
    // node for good).
    let deadline = settings.heartbeat_every.max(Duration::from_secs(1)) * 2;
    let discovered = nodes.iter().any(|n| n.discovered);
    let mut health = discovered.then(|| GpuHealth::new(open_kernel_log(gpu_kernel_log.as_deref())));
    let mut checked: Option<tokio::time::Instant> = None;
    loop {
        if checked.is_none_or(|t| t.elapsed() >= NOTE_EVERY) {
            checked = Some(tokio::time::Instant::now());
            let strangers = if discovered {
                strangers_note().await
            } else {
                String::new()
            };
            let gpus = match health.take() {
                Some(h) => {
                    let (h, found) = check_gpus(h).await;
                    health = h;
                    found
                }
                None => GpusFound::Unchanged(String::new()),
            };
            let logs = match &logs_floor {
                Some(floor) => floor.note().await,
                None => String::new(),
            };
            for (report, inventory) in reports.iter_mut().zip(&nodes) {
                let mut parts = Vec::new();
                if inventory.discovered {
                    match &gpus {
                        GpusFound::Now(found) => {
                            for f in &found.failed {
                                if !report.failed.contains(f) {
                                    tracing::warn!(node = %report.name, gpu = f.index, reason = %f.reason, "a GPU failed: it is offered no more, and its job goes back to the queue");
                                }
                            }
                            report.gpus.clone_from(&found.gpus);
                            report.failed.clone_from(&found.failed);
                            if !found.note.is_empty() {
                                parts.push(found.note.clone());
                            }
                        }
                        GpusFound::Unchanged(why) if !why.is_empty() => parts.push(why.clone()),
                        GpusFound::Unchanged(_) => {}
                    }
                    if !strangers.is_empty() {
                        parts.push(strangers.clone());
                    }
                }
                if !logs.is_empty() {
                    parts.push(logs.clone());
                }
                report.note = parts.join("; ");
                keel_state::state::limits::cut_to(
                    &mut report.note,
                    keel_state::state::limits::NODE_NOTE_MAX_LEN,
                );
            }
        }
        let beat = api.node_heartbeat(tonic::Request::new(heartbeat_request(&reports)));
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

/// The kernel log, opened at its end; `None` (said once) when it cannot be
/// read, e.g. `/dev/kmsg` without `CAP_SYSLOG`.
fn open_kernel_log(path: Option<&std::path::Path>) -> Option<KernelLog> {
    let path = path?;
    match KernelLog::open_at_end(path) {
        Ok(log) => Some(log),
        Err(e) => {
            tracing::warn!(path = %path.display(), error = %e, "GPU Xids are not read: the kernel log cannot be opened (GPUs the driver lost are still found)");
            None
        }
    }
}

/// What a GPU check found.
enum GpusFound {
    /// The GPUs now.
    Now(HealthReport),
    /// Nothing new: why, when `nvidia-smi` failed (for the node's note).
    Unchanged(String),
}

/// Lists the GPUs and reads the kernel log, off the runtime.
async fn check_gpus(mut health: GpuHealth) -> (Option<GpuHealth>, GpusFound) {
    let checked = tokio::task::spawn_blocking(move || {
        let found = keel_executors::gpu_health::list_nvidia_gpus()
            .map(|listing| listing.map(|l| health.check(&l)));
        (health, found)
    })
    .await;
    match checked {
        Ok((health, Ok(Some(report)))) => (Some(health), GpusFound::Now(report)),
        Ok((health, Ok(None))) => (
            Some(health),
            GpusFound::Unchanged("nvidia-smi is gone: GPUs not checked".into()),
        ),
        Ok((health, Err(e))) => (
            Some(health),
            GpusFound::Unchanged(format!("cannot list its GPUs: {e}")),
        ),
        Err(_) => (None, GpusFound::Unchanged(String::new())),
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
/// which GPUs it has and which processes use them; whether its workers'
/// logs are paused.
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
            if let Command::MarkNodeLost { name, reason, .. } = &command {
                tracing::warn!(node = %name, %reason, "marking a silent node lost");
            }
            let kind = command.kind();
            match proposer.propose(command.clone()).await {
                Ok(_) => {}
                // Committed and refused by the state machine: the same
                // report waits, longer each time (issue 33), and the reason
                // is said once per report.
                Err(crate::grpc_status::ApiError::Refused(e)) => {
                    let name = match &command {
                        Command::RecordNodeInventory { name, .. } => name.as_str(),
                        _ => "",
                    };
                    if liveness.refused(&command, clock()) {
                        tracing::warn!(node = %name, error = %e, kind, "a node's report was refused; it is proposed again only after a wait that doubles up to 5 minutes, or when the node reports something else. Fix what the error names on the node (its inventory or note), or remove the node (keel node remove)");
                    } else {
                        tracing::debug!(node = %name, error = %e, kind, "a node's report was refused again");
                    }
                }
                Err(e) => {
                    tracing::warn!(error = %e, kind, "liveness entry not committed");
                }
            }
        }
    }
}
