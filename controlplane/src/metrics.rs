//! What a replica shows Prometheus (issue 24, item 1): the figures behind
//! `/metrics` on `--http-listen` ([`crate::http`]), named by Prometheus's
//! conventions (`keel_` first, base units last, `_total` on counters).
//!
//! Two kinds:
//! - **read at scrape time** from what the replica keeps anyway
//!   ([`StateCollector`]): the applied state (jobs by state, GPUs and GPUs
//!   in use by type, nodes, queues' pending and held jobs, quotas and
//!   usage), openraft's metrics and the log's commit index. Nothing is
//!   counted twice, and every replica shows the cluster as it applied it;
//! - **counted as things happen** in this process ([`Metrics`]): API
//!   requests and their latency, scheduling rounds and what they proposed,
//!   proposals and their batches, leader changes seen, and the applied
//!   events a replica follows from its journal (jobs finished by outcome,
//!   preempted, requeued; nodes lost and recovered; placements refused).
//!   They start at zero with the process, as Prometheus counters do.
//!
//! Absences: no figure is kept in the replicated state for metrics' sake
//! (a counter here never changes a state hash), and no label takes an
//! unbounded value from a client (methods are the API's own; queues and
//! GPU types are the cluster's, bounded by their limits).

use std::sync::Arc;
use std::time::Duration;

use prometheus_client::collector::Collector;
use prometheus_client::encoding::{DescriptorEncoder, EncodeLabelSet, EncodeMetric};
use prometheus_client::metrics::counter::{ConstCounter, Counter};
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::ConstGauge;
use prometheus_client::metrics::histogram::{exponential_buckets, Histogram};
use prometheus_client::metrics::MetricType;
use prometheus_client::registry::{Registry, Unit};

use keel_state::model::{JobState, NodeState};
use keel_state::ClusterState;
use keel_storage::{LogStore, StateMachineStore};

use crate::raft_node::Raft;

/// An API request's labels: its method and the gRPC code it was answered
/// with.
#[derive(Debug, Clone, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct RequestLabels {
    pub method: String,
    pub code: String,
}

/// A label set of one label, `method`.
#[derive(Debug, Clone, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct MethodLabel {
    pub method: String,
}

/// A label set of one label, `policy`.
#[derive(Debug, Clone, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct PolicyLabel {
    pub policy: String,
}

/// A label set of one label, `outcome`.
#[derive(Debug, Clone, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct OutcomeLabel {
    pub outcome: String,
}

/// A launch's labels: the executor, and whether it started the worker.
#[derive(Debug, Clone, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct LaunchLabels {
    pub executor: String,
    pub result: String,
}

/// A label set of one label, `executor`.
#[derive(Debug, Clone, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct ExecutorLabel {
    pub executor: String,
}

/// A label set of one label, `to` (what a node became).
#[derive(Debug, Clone, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct TransitionLabel {
    pub to: String,
}

/// The figures this process counts, and the registry they are read from.
#[derive(Debug)]
pub struct Metrics {
    registry: Registry,
    /// API requests by method and code.
    pub api_requests: Family<RequestLabels, Counter>,
    /// How long the API took to answer (for a stream: to start it).
    pub api_request_duration: Family<MethodLabel, Histogram>,
    /// Scheduling rounds this replica ran while leading, by policy.
    pub scheduling_rounds: Family<PolicyLabel, Counter>,
    /// How long a round's planning took (admission, policy, fit, diff).
    pub scheduling_round_duration: Histogram,
    /// How long the policy's own plan took within a round (for the
    /// heterogeneity-aware policies, their LP solves), by policy.
    pub policy_solve_duration: Family<PolicyLabel, Histogram>,
    /// Decisions proposed (rounds that changed something).
    pub scheduling_decisions: Counter,
    /// Placements those decisions carried (jobs that gain, move or lose
    /// GPUs).
    pub placement_changes: Counter,
    /// Entries this replica proposed, and how many went in each batch.
    pub proposals: Counter,
    pub proposal_batch_entries: Histogram,
    /// Times this replica saw the leader change (a new leader, or none).
    pub leader_changes: Counter,
    /// Elections this replica stood for at once because its leader's
    /// process was gone ([`crate::leader_loss`]).
    pub leader_lost_elections: Counter,
    /// Worker launches this replica's executor made while it led, by
    /// executor and result, and how long each took.
    pub executor_launches: Family<LaunchLabels, Counter>,
    pub executor_launch_duration: Family<ExecutorLabel, Histogram>,
    /// Applied events followed from the journal since this process
    /// started.
    pub jobs_finished: Family<OutcomeLabel, Counter>,
    pub jobs_preempted: Counter,
    pub jobs_requeued: Counter,
    pub placements_refused: Counter,
    pub node_transitions: Family<TransitionLabel, Counter>,
}

/// Latency buckets from 0.1 ms to about 6.5 s (doubling).
fn latency_buckets() -> impl Iterator<Item = f64> {
    exponential_buckets(0.000_1, 2.0, 17)
}

impl Metrics {
    /// The figures this process counts; [`Metrics::reading`] adds those
    /// read from a replica at each scrape.
    pub fn new() -> Metrics {
        let mut registry = Registry::with_prefix("keel");
        let api_requests = Family::<RequestLabels, Counter>::default();
        registry.register(
            "api_requests",
            "API requests answered, by method and gRPC code",
            api_requests.clone(),
        );
        let api_request_duration = Family::<MethodLabel, Histogram>::new_with_constructor(|| {
            Histogram::new(latency_buckets())
        });
        registry.register_with_unit(
            "api_request_duration",
            "Time to answer an API request (a stream: to start it), by method",
            Unit::Seconds,
            api_request_duration.clone(),
        );
        let scheduling_rounds = Family::<PolicyLabel, Counter>::default();
        registry.register(
            "scheduling_rounds",
            "Scheduling rounds run by this replica while it led, by policy",
            scheduling_rounds.clone(),
        );
        let scheduling_round_duration = Histogram::new(latency_buckets());
        registry.register_with_unit(
            "scheduling_round_duration",
            "Time to plan one scheduling round (admission, policy, fit, changes)",
            Unit::Seconds,
            scheduling_round_duration.clone(),
        );
        let policy_solve_duration = Family::<PolicyLabel, Histogram>::new_with_constructor(|| {
            Histogram::new(latency_buckets())
        });
        registry.register_with_unit(
            "scheduling_policy_solve_duration",
            "Time the policy's own plan took within a scheduling round (LP solves included), by policy",
            Unit::Seconds,
            policy_solve_duration.clone(),
        );
        let scheduling_decisions = Counter::default();
        registry.register(
            "scheduling_decisions",
            "Allocation decisions proposed (rounds that changed an allocation)",
            scheduling_decisions.clone(),
        );
        let placement_changes = Counter::default();
        registry.register(
            "scheduling_placement_changes",
            "Placements the proposed decisions carried (jobs that gain, move or lose GPUs)",
            placement_changes.clone(),
        );
        let proposals = Counter::default();
        registry.register(
            "raft_proposals",
            "Entries this replica proposed to the Raft log",
            proposals.clone(),
        );
        let proposal_batch_entries = Histogram::new(exponential_buckets(1.0, 2.0, 12));
        registry.register(
            "raft_proposal_batch_entries",
            "Entries per proposal batch",
            proposal_batch_entries.clone(),
        );
        let leader_changes = Counter::default();
        registry.register(
            "raft_leader_changes",
            "Times this replica saw its cluster's leader change",
            leader_changes.clone(),
        );
        let leader_lost_elections = Counter::default();
        registry.register(
            "raft_leader_lost_elections",
            "Elections this replica stood for at once because its leader's process was gone",
            leader_lost_elections.clone(),
        );
        let executor_launches = Family::<LaunchLabels, Counter>::default();
        registry.register(
            "executor_launches",
            "Worker launches by executor and result (ok, error), made while this replica led",
            executor_launches.clone(),
        );
        let executor_launch_duration =
            Family::<ExecutorLabel, Histogram>::new_with_constructor(|| {
                Histogram::new(latency_buckets())
            });
        registry.register_with_unit(
            "executor_launch_duration",
            "Time an executor took to launch a worker (to start it, or to be refused)",
            Unit::Seconds,
            executor_launch_duration.clone(),
        );
        let jobs_finished = Family::<OutcomeLabel, Counter>::default();
        registry.register(
            "jobs_finished",
            "Jobs that ended, by outcome (applied since this process started)",
            jobs_finished.clone(),
        );
        let jobs_preempted = Counter::default();
        registry.register(
            "jobs_preempted",
            "Preemptions of running jobs (applied since this process started)",
            jobs_preempted.clone(),
        );
        let jobs_requeued = Counter::default();
        registry.register(
            "jobs_requeued",
            "Jobs put back to wait after a failure or a lost node (applied since this process started)",
            jobs_requeued.clone(),
        );
        let placements_refused = Counter::default();
        registry.register(
            "placements_refused",
            "Placements of a decision that apply refused (applied since this process started)",
            placements_refused.clone(),
        );
        let node_transitions = Family::<TransitionLabel, Counter>::default();
        registry.register(
            "node_transitions",
            "Nodes that were lost or recovered (applied since this process started)",
            node_transitions.clone(),
        );
        // Known label values start at 0, so `rate` and `increase` see the
        // first one (Prometheus's advice for bounded labels).
        for outcome in ["succeeded", "failed", "cancelled"] {
            let _ = jobs_finished.get_or_create(&OutcomeLabel {
                outcome: outcome.to_string(),
            });
        }
        for to in ["lost", "recovered"] {
            let _ = node_transitions.get_or_create(&TransitionLabel { to: to.to_string() });
        }
        Metrics {
            registry,
            api_requests,
            api_request_duration,
            scheduling_rounds,
            scheduling_round_duration,
            policy_solve_duration,
            scheduling_decisions,
            placement_changes,
            proposals,
            proposal_batch_entries,
            leader_changes,
            leader_lost_elections,
            executor_launches,
            executor_launch_duration,
            jobs_finished,
            jobs_preempted,
            jobs_requeued,
            placements_refused,
            node_transitions,
        }
    }

    /// Adds the figures `collector` reads from a replica at each scrape.
    pub fn reading(mut self, collector: StateCollector) -> Metrics {
        self.registry.register_collector(Box::new(collector));
        self
    }

    /// Every figure in Prometheus's text exposition format (OpenMetrics).
    pub fn render(&self) -> Result<String, std::fmt::Error> {
        let mut out = String::new();
        prometheus_client::encoding::text::encode(&mut out, &self.registry)?;
        Ok(out)
    }

    /// Every figure in Prometheus's classic text format (0.0.4), for a
    /// scraper that does not ask for OpenMetrics ([`to_text_format`]).
    pub fn render_text(&self) -> Result<String, std::fmt::Error> {
        Ok(to_text_format(&self.render()?))
    }

    /// Counts what one applied entry's events say (as the journal keeps
    /// them).
    pub fn count_events(&self, events: &[keel_proto::entry::Event]) {
        use keel_proto::entry::event::Kind;
        for event in events {
            let finished = |outcome: &str| {
                self.jobs_finished
                    .get_or_create(&OutcomeLabel {
                        outcome: outcome.to_string(),
                    })
                    .inc();
            };
            let node = |to: &str| {
                self.node_transitions
                    .get_or_create(&TransitionLabel { to: to.to_string() })
                    .inc();
            };
            match &event.kind {
                Some(Kind::JobFinished(f)) => finished(&f.state),
                Some(Kind::JobCancelled(_)) => finished("cancelled"),
                Some(Kind::JobPreempted(_)) => {
                    self.jobs_preempted.inc();
                }
                Some(Kind::JobRequeued(_)) => {
                    self.jobs_requeued.inc();
                }
                Some(Kind::PlacementRefused(_)) => {
                    self.placements_refused.inc();
                }
                Some(Kind::NodeLost(_)) => node("lost"),
                Some(Kind::NodeRecovered(_)) => node("recovered"),
                _ => {}
            }
        }
    }

    /// Records one launch by `executor`.
    pub fn launched(&self, executor: &str, ok: bool, took: Duration) {
        self.executor_launches
            .get_or_create(&LaunchLabels {
                executor: executor.to_string(),
                result: if ok { "ok" } else { "error" }.to_string(),
            })
            .inc();
        self.executor_launch_duration
            .get_or_create(&ExecutorLabel {
                executor: executor.to_string(),
            })
            .observe(took.as_secs_f64());
    }

    /// Records one API request.
    pub fn api_request(&self, method: &str, code: tonic::Code, took: Duration) {
        self.api_requests
            .get_or_create(&RequestLabels {
                method: method.to_string(),
                code: code_name(code).to_string(),
            })
            .inc();
        self.api_request_duration
            .get_or_create(&MethodLabel {
                method: method.to_string(),
            })
            .observe(took.as_secs_f64());
    }
}

/// An OpenMetrics exposition in Prometheus's classic text format: a
/// counter family's `# HELP` and `# TYPE` name its samples (`x_total`, not
/// `x`), and `# UNIT` and `# EOF` go (the older parsers, `promtool check
/// metrics` among them, read no other difference).
pub fn to_text_format(openmetrics: &str) -> String {
    let counters: std::collections::BTreeSet<&str> = openmetrics
        .lines()
        .filter_map(|l| l.strip_prefix("# TYPE "))
        .filter_map(|l| l.strip_suffix(" counter"))
        .collect();
    let mut out = String::with_capacity(openmetrics.len());
    for line in openmetrics.lines() {
        if line.starts_with("# UNIT ") || line == "# EOF" {
            continue;
        }
        let renamed = ["# HELP ", "# TYPE "].iter().find_map(|prefix| {
            let rest = line.strip_prefix(prefix)?;
            let (name, tail) = rest.split_once(' ').unwrap_or((rest, ""));
            counters
                .contains(name)
                .then(|| format!("{prefix}{name}_total {tail}"))
        });
        match renamed {
            Some(l) => out.push_str(l.trim_end()),
            None => out.push_str(line),
        }
        out.push('\n');
    }
    out
}

impl Default for Metrics {
    fn default() -> Metrics {
        Metrics::new()
    }
}

/// A gRPC code as Prometheus labels usually spell it (`OK`,
/// `NOT_FOUND`, ...).
pub fn code_name(code: tonic::Code) -> &'static str {
    use tonic::Code;
    match code {
        Code::Ok => "OK",
        Code::Cancelled => "CANCELLED",
        Code::Unknown => "UNKNOWN",
        Code::InvalidArgument => "INVALID_ARGUMENT",
        Code::DeadlineExceeded => "DEADLINE_EXCEEDED",
        Code::NotFound => "NOT_FOUND",
        Code::AlreadyExists => "ALREADY_EXISTS",
        Code::PermissionDenied => "PERMISSION_DENIED",
        Code::ResourceExhausted => "RESOURCE_EXHAUSTED",
        Code::FailedPrecondition => "FAILED_PRECONDITION",
        Code::Aborted => "ABORTED",
        Code::OutOfRange => "OUT_OF_RANGE",
        Code::Unimplemented => "UNIMPLEMENTED",
        Code::Internal => "INTERNAL",
        Code::Unavailable => "UNAVAILABLE",
        Code::DataLoss => "DATA_LOSS",
        Code::Unauthenticated => "UNAUTHENTICATED",
    }
}

/// Wraps the API service: each request's method, code and time go to
/// [`Metrics::api_request`].
///
/// The code is the response's `grpc-status` header, which a refusal
/// carries (tonic answers an error with headers only); a response without
/// one started well and counts as `OK` (a stream that fails later is not
/// counted again). A method the service does not have (answered
/// `UNIMPLEMENTED`) is counted as `unknown`, so a client cannot grow the
/// label's values.
#[derive(Debug, Clone)]
pub struct Measured<S> {
    pub metrics: Arc<Metrics>,
    pub inner: S,
}

impl<S: tonic::server::NamedService> tonic::server::NamedService for Measured<S> {
    const NAME: &'static str = S::NAME;
}

impl<S> tonic::codegen::Service<tonic::codegen::http::Request<tonic::body::Body>> for Measured<S>
where
    S: tonic::codegen::Service<
        tonic::codegen::http::Request<tonic::body::Body>,
        Response = tonic::codegen::http::Response<tonic::body::Body>,
        Error = std::convert::Infallible,
    >,
    S::Future: Send + 'static,
{
    type Response = tonic::codegen::http::Response<tonic::body::Body>;
    type Error = std::convert::Infallible;
    type Future = tonic::codegen::BoxFuture<Self::Response, Self::Error>;

    fn poll_ready(
        &mut self,
        cx: &mut std::task::Context<'_>,
    ) -> std::task::Poll<Result<(), Self::Error>> {
        self.inner.poll_ready(cx)
    }

    fn call(&mut self, request: tonic::codegen::http::Request<tonic::body::Body>) -> Self::Future {
        let method = request
            .uri()
            .path()
            .rsplit('/')
            .next()
            .unwrap_or_default()
            .to_string();
        let started = std::time::Instant::now();
        let metrics = self.metrics.clone();
        // The request's span, in the caller's trace when it sent one
        // (built only with `--otlp-endpoint`).
        let span = crate::traces::api_span(
            request.uri().path(),
            request
                .headers()
                .get(crate::traces::TRACEPARENT_HEADER)
                .and_then(|v| v.to_str().ok()),
        );
        let answer = self.inner.call(request);
        Box::pin(tracing::Instrument::instrument(
            async move {
                let response = answer.await;
                if let Ok(r) = &response {
                    let code = r
                        .headers()
                        .get("grpc-status")
                        .and_then(|v| v.to_str().ok())
                        .and_then(|v| v.parse::<i32>().ok())
                        .map_or(tonic::Code::Ok, tonic::Code::from_i32);
                    let method = if code == tonic::Code::Unimplemented {
                        "unknown"
                    } else {
                        method.as_str()
                    };
                    metrics.api_request(method, code, started.elapsed());
                }
                response
            },
            span,
        ))
    }
}

/// What `/metrics` reads at each scrape from the replica's own state, Raft
/// and log.
#[derive(Clone)]
pub struct StateCollector {
    pub raft: Raft,
    pub state_machine: StateMachineStore,
    pub log: LogStore,
}

impl std::fmt::Debug for StateCollector {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("StateCollector").finish_non_exhaustive()
    }
}

/// One figure: a gauge or a counter, without labels or by label sets.
enum Figure {
    Gauge(Vec<(Vec<(&'static str, String)>, i64)>),
    Counter(u64),
}

/// The figures of one state, by name, with their help (what the
/// collector writes; a pure function of the state, tested without a
/// replica).
/// The jobs the state keeps, counted by state (in `JobState::ALL`'s
/// order; the console shows the same counts).
pub(crate) fn jobs_by_state(state: &ClusterState) -> [(JobState, i64); 6] {
    let mut counts = JobState::ALL.map(|s| (s, 0i64));
    for job in state.jobs().values() {
        if let Some((_, n)) = counts.iter_mut().find(|(s, _)| *s == job.state) {
            *n += 1;
        }
    }
    counts
}

fn state_figures(state: &ClusterState) -> Vec<(&'static str, &'static str, Figure)> {
    let spanning = state
        .allocated_jobs()
        .filter_map(|j| j.allocation.as_ref())
        .filter(|a| {
            let first = a.gpus.first().map(|g| &g.node);
            a.gpus.iter().any(|g| Some(&g.node) != first)
        })
        .count() as i64;
    let jobs = jobs_by_state(state)
        .into_iter()
        .map(|(s, n)| (vec![("state", s.as_str().to_string())], n))
        .collect();
    let capacity = state.capacity();
    let free = state.free_gpus();
    let gpus = capacity
        .types()
        .map(|t| {
            (
                vec![("gpu_type", t.clone())],
                capacity.free_of_type(t) as i64,
            )
        })
        .collect();
    let in_use = capacity
        .types()
        .map(|t| {
            let used = capacity
                .free_of_type(t)
                .saturating_sub(free.free_of_type(t));
            (vec![("gpu_type", t.clone())], used as i64)
        })
        .collect();
    let mut nodes = [0i64; 2];
    for node in state.nodes().values() {
        nodes[usize::from(node.state == NodeState::Lost)] += 1;
    }
    let nodes = [NodeState::Alive, NodeState::Lost]
        .iter()
        .zip(nodes)
        .map(|(s, n)| (vec![("state", s.as_str().to_string())], n))
        .collect();
    let mut figures = vec![
        (
            "jobs",
            "Jobs the state keeps, by state",
            Figure::Gauge(jobs),
        ),
        (
            "jobs_submitted",
            "Jobs ever submitted to the cluster (from the replicated state)",
            Figure::Counter(state.jobs_submitted()),
        ),
        (
            "jobs_spanning_nodes",
            "Jobs holding GPUs on more than one node",
            Figure::Gauge(vec![(Vec::new(), spanning)]),
        ),
        ("gpus", "Live GPUs, by type", Figure::Gauge(gpus)),
        (
            "gpus_in_use",
            "GPUs held by jobs, by type",
            Figure::Gauge(in_use),
        ),
        ("nodes", "Nodes, by state", Figure::Gauge(nodes)),
    ];
    // Queues: every queue, the default one included, counted as `keel
    // queue list` counts them.
    let usage = crate::api::queues::usage_by_queue(state);
    let mut pending = Vec::new();
    let mut holding = Vec::new();
    let mut quota = Vec::new();
    let mut used = Vec::new();
    for (name, spec) in &state.queues().all() {
        let of_queue = usage.get(name.as_str());
        let label = || vec![("queue", name.clone())];
        pending.push((label(), of_queue.map_or(0, |u| i64::from(u.pending_jobs))));
        holding.push((label(), of_queue.map_or(0, |u| i64::from(u.running_jobs))));
        for (t, n) in spec.quota.iter().flatten() {
            quota.push((
                vec![("queue", name.clone()), ("gpu_type", t.clone())],
                i64::from(*n),
            ));
        }
        for (t, n) in of_queue.into_iter().flat_map(|u| &u.used) {
            used.push((
                vec![("queue", name.clone()), ("gpu_type", t.clone())],
                i64::from(*n),
            ));
        }
    }
    figures.extend([
        (
            "queue_pending_jobs",
            "Jobs waiting for GPUs, by queue",
            Figure::Gauge(pending),
        ),
        (
            "queue_admitted_jobs",
            "Jobs holding GPUs, by queue",
            Figure::Gauge(holding),
        ),
        (
            "queue_quota_gpus",
            "GPUs a queue is guaranteed, by queue and type",
            Figure::Gauge(quota),
        ),
        (
            "queue_used_gpus",
            "GPUs a queue's jobs hold, by queue and type",
            Figure::Gauge(used),
        ),
    ]);
    figures
}

fn encode_figure(
    encoder: &mut DescriptorEncoder,
    name: &str,
    help: &str,
    figure: &Figure,
) -> Result<(), std::fmt::Error> {
    match figure {
        Figure::Counter(n) => {
            let counter = ConstCounter::new(*n);
            let metric = encoder.encode_descriptor(name, help, None, counter.metric_type())?;
            counter.encode(metric)
        }
        Figure::Gauge(values) => {
            let mut metric = encoder.encode_descriptor(name, help, None, MetricType::Gauge)?;
            match values.as_slice() {
                // One value without labels: the plain sample.
                [(labels, v)] if labels.is_empty() => ConstGauge::new(*v).encode(metric),
                _ => {
                    for (labels, v) in values {
                        ConstGauge::new(*v).encode(metric.encode_family(labels)?)?;
                    }
                    Ok(())
                }
            }
        }
    }
}

impl Collector for StateCollector {
    fn encode(&self, mut encoder: DescriptorEncoder) -> Result<(), std::fmt::Error> {
        // The state's figures under its read lock (applies wait meanwhile:
        // one pass over the jobs the state keeps).
        let figures = {
            let shared = self.state_machine.shared();
            let applied = shared.read();
            state_figures(&applied.state)
        };
        for (name, help, figure) in &figures {
            encode_figure(&mut encoder, name, help, figure)?;
        }
        let raft = raft_figures(&self.raft, self.log.committed_index());
        for (name, help, figure) in &raft {
            encode_figure(&mut encoder, name, help, figure)?;
        }
        for (name, help, reading) in [
            (
                "wal_fsync_duration",
                "Time from an append's sync request to its fdatasync's end (a sync under way waited for included)",
                self.log.sync_latency().read(),
            ),
            (
                "snapshot_duration",
                "Time to build a snapshot: read the state, encode, save, compact the journal",
                self.state_machine.snapshot_latency().read(),
            ),
        ] {
            let metric =
                encoder.encode_descriptor(name, help, Some(&Unit::Seconds), MetricType::Histogram)?;
            encode_reading(metric, &reading)?;
        }
        let mut metric = encoder.encode_descriptor(
            "snapshot_phase_duration",
            "Time each part of a snapshot build took, by phase: read (the state under its lock; applies wait), encode, save (written and flushed), compact (the journal's pages behind it merged)",
            Some(&Unit::Seconds),
            MetricType::Histogram,
        )?;
        for (phase, latency) in self.state_machine.snapshot_phases().phases() {
            encode_reading(metric.encode_family(&[("phase", phase)])?, &latency.read())?;
        }
        Ok(())
    }
}

/// A histogram the stores keep ([`keel_storage::Latency`]), as a sample.
fn encode_reading(
    mut metric: prometheus_client::encoding::MetricEncoder<'_>,
    reading: &keel_storage::LatencyReading,
) -> Result<(), std::fmt::Error> {
    metric.encode_histogram::<prometheus_client::encoding::NoLabelSet>(
        reading.sum_s,
        reading.count,
        &reading.buckets,
        None,
    )
}

/// What openraft and the log say of this replica.
fn raft_figures(raft: &Raft, committed: Option<u64>) -> Vec<(&'static str, &'static str, Figure)> {
    let m = raft.metrics().borrow().clone();
    let one = |v: i64| Figure::Gauge(vec![(Vec::new(), v)]);
    let as_i64 = |v: u64| i64::try_from(v).unwrap_or(i64::MAX);
    let last_log = m.last_log_index.unwrap_or(0);
    let mut lag = Vec::new();
    for (follower, matched) in m.replication.iter().flatten() {
        if *follower == m.id {
            continue;
        }
        let matched = matched.as_ref().map_or(0, |l| l.index);
        lag.push((
            vec![("follower", crate::membership::show(*follower))],
            as_i64(last_log.saturating_sub(matched)),
        ));
    }
    vec![
        (
            "raft_term",
            "This replica's Raft term",
            one(as_i64(m.current_term)),
        ),
        (
            "raft_has_leader",
            "Whether this replica knows a leader (1) or not (0)",
            one(i64::from(m.current_leader.is_some())),
        ),
        (
            "raft_is_leader",
            "Whether this replica leads (1) or not (0)",
            one(i64::from(m.current_leader == Some(m.id))),
        ),
        (
            "raft_last_log_index",
            "The last index in this replica's log",
            one(as_i64(last_log)),
        ),
        (
            "raft_commit_index",
            "The last index this replica knows committed",
            one(as_i64(committed.unwrap_or(0))),
        ),
        (
            "raft_applied_index",
            "The last index this replica applied",
            one(as_i64(m.last_applied.map_or(0, |l| l.index))),
        ),
        (
            "raft_snapshot_index",
            "The index of this replica's last snapshot",
            one(as_i64(m.snapshot.map_or(0, |l| l.index))),
        ),
        (
            "raft_replication_lag_entries",
            "Entries a follower's log is behind the leader's (on the leader only)",
            Figure::Gauge(lag),
        ),
    ]
}

/// Whether a replica is ready for clients: it knows a leader and has
/// applied everything it knows committed. `Err`: why not.
pub fn readiness(raft: &Raft, log: &LogStore) -> Result<(), String> {
    let m = raft.metrics().borrow().clone();
    if m.current_leader.is_none() {
        return Err(format!("no leader known (term {})", m.current_term));
    }
    let applied = m.last_applied.map_or(0, |l| l.index);
    let committed = log.committed_index().unwrap_or(0);
    if applied < committed {
        return Err(format!(
            "applied up to index {applied}, committed up to {committed}"
        ));
    }
    Ok(())
}

/// A policy whose plans are timed into
/// `keel_scheduling_policy_solve_duration_seconds{policy}`: the runtime
/// measures around the pure policy, which plans exactly as before (the
/// scheduling engine puts it around every policy it makes).
#[derive(Debug)]
pub struct TimedPolicy {
    inner: Arc<dyn keel_scheduling::policy::Policy>,
    metrics: Arc<Metrics>,
}

impl TimedPolicy {
    pub fn new(inner: Arc<dyn keel_scheduling::policy::Policy>, metrics: Arc<Metrics>) -> Self {
        TimedPolicy { inner, metrics }
    }

    /// What the engine puts around each policy it makes.
    pub fn wrapper(metrics: Arc<Metrics>) -> keel_scheduling::engine::PolicyWrapper {
        Arc::new(move |p| Box::new(TimedPolicy::new(Arc::from(p), metrics.clone())))
    }
}

impl keel_scheduling::policy::Policy for TimedPolicy {
    fn name(&self) -> &'static str {
        self.inner.name()
    }

    fn plan<'a>(
        &self,
        input: &keel_scheduling::policy::SchedulingInput<'a>,
    ) -> keel_scheduling::policy::Plan<'a> {
        let started = std::time::Instant::now();
        let plan = self.inner.plan(input);
        self.metrics
            .policy_solve_duration
            .get_or_create(&PolicyLabel {
                policy: self.inner.name().to_string(),
            })
            .observe(started.elapsed().as_secs_f64());
        plan
    }

    fn counters(&self, state: &ClusterState) -> std::collections::BTreeMap<&'static str, u64> {
        self.inner.counters(state)
    }

    fn admission_order(
        &self,
        input: &keel_scheduling::policy::SchedulingInput<'_>,
    ) -> Option<Vec<keel_state::model::JobId>> {
        self.inner.admission_order(input)
    }
}

/// How long the journal's follower waits after reading before it reads
/// again: a busy replica applies hundreds of entries a second, and a read
/// at each one woke this task and scanned the journal at every write on
/// every replica. A count is at most this late on `/metrics`.
const FOLLOW_PAUSE: Duration = Duration::from_millis(100);

/// Counts the applied events this replica journals, from its start on,
/// and the leader changes it sees, until `stop` turns true.
pub async fn follow(
    metrics: Arc<Metrics>,
    raft: Raft,
    state_machine: StateMachineStore,
    mut stop: tokio::sync::watch::Receiver<bool>,
) {
    let shared = state_machine.shared();
    let mut applied = shared.subscribe_journal();
    let mut seen = *applied.borrow();
    let mut next = keel_storage::JournalCursor::at_index(seen + 1);
    // The server's metrics (leader, membership) change only with them;
    // `raft.metrics()` changes several times at every write.
    let mut server_metrics = raft.server_metrics();
    let mut leader = server_metrics.borrow().current_leader;
    loop {
        tokio::select! {
            changed = applied.changed() => {
                if changed.is_err() {
                    return;
                }
                let upto = *applied.borrow_and_update();
                if upto <= seen {
                    continue;
                }
                // By (index, position): a batch may end inside an entry's
                // records (a proposal's commands share its index).
                const BATCH: usize = 4 * crate::proposer::PROPOSAL_MAX_COMMANDS;
                loop {
                    let records = match state_machine.applied_entries_at(next, BATCH) {
                        Ok(records) => records,
                        Err(e) => {
                            tracing::debug!(error = %e, "metrics: the journal did not read");
                            break;
                        }
                    };
                    for record in &records {
                        metrics.count_events(&record.events);
                    }
                    if let Some(last) = records.last() {
                        next = keel_storage::JournalCursor::after(last);
                    }
                    if records.len() < BATCH {
                        break;
                    }
                }
                seen = upto;
                tokio::select! {
                    _ = tokio::time::sleep(FOLLOW_PAUSE) => {}
                    _ = stop.changed() => return,
                }
            }
            changed = server_metrics.changed() => {
                if changed.is_err() {
                    return;
                }
                let now = server_metrics.borrow_and_update().current_leader;
                if now != leader {
                    metrics.leader_changes.inc();
                    leader = now;
                }
            }
            _ = stop.changed() => return,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use keel_state::command::Command;
    use keel_state::fixtures::{job_spec, TestCluster};
    use keel_state::model::GpuRef;

    fn figure<'a>(figures: &'a [(&'static str, &'static str, Figure)], name: &str) -> &'a Figure {
        &figures
            .iter()
            .find(|(n, _, _)| *n == name)
            .unwrap_or_else(|| panic!("no figure {name}"))
            .2
    }

    fn gauge(figures: &[(&'static str, &'static str, Figure)], name: &str, label: &str) -> i64 {
        match figure(figures, name) {
            Figure::Gauge(values) => values
                .iter()
                .find(|(labels, _)| labels.iter().any(|(_, v)| v == label) || label.is_empty())
                .map_or(0, |(_, v)| *v),
            Figure::Counter(_) => panic!("{name} is a counter"),
        }
    }

    #[test]
    fn the_state_figures_count_jobs_gpus_and_queues_as_the_state_says() {
        let mut c = TestCluster::v100_nodes(&[4, 4]);
        let a = c.submit(job_spec("a", 2, 2));
        let _b = c.submit(job_spec("b", 1, 1));
        let g = |node: &str, index| GpuRef {
            node: node.into(),
            index,
        };
        // a on both nodes: one job spanning two.
        c.place(a, vec![g("n0", 0), g("n0", 1), g("n1", 0), g("n1", 1)]);
        let figures = state_figures(&c.state);
        assert_eq!(gauge(&figures, "jobs", "running"), 1);
        assert_eq!(gauge(&figures, "jobs", "pending"), 1);
        assert_eq!(gauge(&figures, "gpus", "v100"), 8);
        assert_eq!(gauge(&figures, "gpus_in_use", "v100"), 4);
        assert_eq!(gauge(&figures, "jobs_spanning_nodes", ""), 1);
        assert_eq!(gauge(&figures, "nodes", "alive"), 2);
        assert_eq!(gauge(&figures, "queue_pending_jobs", "default"), 1);
        assert_eq!(gauge(&figures, "queue_admitted_jobs", "default"), 1);
        assert!(matches!(
            figure(&figures, "jobs_submitted"),
            Figure::Counter(2)
        ));
        c.apply(Command::finish_job(
            a,
            keel_state::command::JobOutcome::Succeeded,
            String::new(),
        ));
        let figures = state_figures(&c.state);
        assert_eq!(gauge(&figures, "gpus_in_use", "v100"), 0);
        assert_eq!(gauge(&figures, "jobs", "succeeded"), 1);
        assert_eq!(gauge(&figures, "jobs_spanning_nodes", ""), 0);
    }

    #[test]
    fn the_classic_text_format_names_counters_by_their_samples() {
        let open = "# HELP keel_x Things.\n# TYPE keel_x counter\nkeel_x_total 3\n\
                    # HELP keel_t Time.\n# TYPE keel_t histogram\n# UNIT keel_t seconds\n\
                    keel_t_count 1\n# TYPE keel_g gauge\nkeel_g 2\n# EOF\n";
        assert_eq!(
            to_text_format(open),
            "# HELP keel_x_total Things.\n# TYPE keel_x_total counter\nkeel_x_total 3\n\
             # HELP keel_t Time.\n# TYPE keel_t histogram\nkeel_t_count 1\n\
             # TYPE keel_g gauge\nkeel_g 2\n"
        );
    }

    #[test]
    fn applied_events_are_counted_by_kind() {
        use keel_proto::entry as pb;
        let m = Metrics::new();
        let event = |kind| pb::Event { kind: Some(kind) };
        m.count_events(&[
            event(pb::event::Kind::JobFinished(pb::JobFinished {
                job_id: 1,
                state: "failed".into(),
                ..Default::default()
            })),
            event(pb::event::Kind::NodeLost(pb::NodeLost {
                name: "n0".into(),
                ..Default::default()
            })),
        ]);
        let text = m.render().expect("renders");
        assert!(
            text.contains("keel_jobs_finished_total{outcome=\"failed\"} 1"),
            "{text}"
        );
        assert!(
            text.contains("keel_node_transitions_total{to=\"lost\"} 1"),
            "{text}"
        );
        m.api_request(
            "SubmitJob",
            tonic::Code::InvalidArgument,
            Duration::from_millis(3),
        );
        let text = m.render().expect("renders");
        assert!(
            text.contains(
                "keel_api_requests_total{method=\"SubmitJob\",code=\"INVALID_ARGUMENT\"} 1"
            ),
            "{text}"
        );
        assert!(text.contains("keel_api_request_duration_seconds_count{method=\"SubmitJob\"} 1"));
    }
}
