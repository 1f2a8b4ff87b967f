//! The Kubernetes executor: one Pod per worker, through the API server.
//!
//! - **Launch**: a Pod `keel-jJ-eE-rR` pinned to the node the plan chose
//!   (`spec.nodeName`), `restartPolicy: Never`, `nvidia.com/gpu` limits for
//!   its GPU count, labels carrying job, epoch and rank (its identity), the
//!   worker contract in its environment (`CUDA_VISIBLE_DEVICES` is left to
//!   the NVIDIA device plugin, which picks the devices), and checkpoints on
//!   the volume the config names. A multi-worker job gets a headless Service
//!   `keel-jJ-eE` that resolves to rank 0 (the rendezvous address).
//! - **Observe**: a watch on the Pods Keel manages (`kube::runtime::watcher`,
//!   list then watch, restarted by the watcher on errors). Pending and
//!   Running are running; Succeeded and Failed are exits with the
//!   container's exit code and reason; a Pod that cannot pull its image, or
//!   Pending longer than `pending_timeout`, is deleted and reported as an
//!   exit with the reason.
//! - **Progress**: rank 0's log, followed (`follow=true`), parsed for
//!   progress lines; a restarted stream skips steps already reported.
//! - **Stop**: delete with the grace period (the kubelet sends SIGTERM, then
//!   SIGKILL).
//! - **Take over**: the watch's first list finds the Pods an earlier leader
//!   created: running ones are re-adopted, finished ones reported.
//! - **Nodes**: Node objects with `nvidia.com/gpu` capacity; the GPU type
//!   from a label (`nvidia.com/gpu.product`); Ready nodes answer, others are
//!   reported unreachable with their condition.

use std::collections::{BTreeMap, BTreeSet};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use futures::{AsyncBufReadExt, StreamExt, TryStreamExt};
use k8s_openapi::api::core::v1::{
    Container, EnvVar, Node, Pod, PodSpec, ResourceRequirements, Service, ServicePort, ServiceSpec,
    Volume, VolumeMount,
};
use k8s_openapi::apimachinery::pkg::api::resource::Quantity;
use k8s_openapi::apimachinery::pkg::apis::meta::v1::ObjectMeta;
use keel_state::liveness::NodeReport;
use keel_state::{Gpu, JobId, ProgressSample};
use kube::api::{Api, DeleteParams, ListParams, LogParams, PostParams};
use kube::runtime::watcher;

use crate::book::{Clock, Exit, SystemClock, Worker, WorkerBook};
use crate::contract::{
    checkpoint_dir_name, environment, gpu_refs, parse_progress_line, WorkerLaunch,
};
use crate::discovery::gpu_type_of;
use crate::executor::{Executor, ExecutorError, NodeProbe, WorkerLog};
use crate::reconcile::Observed;
use crate::WorkerId;

/// The label every Pod and Service Keel creates carries.
pub const MANAGED_BY: &str = "app.kubernetes.io/managed-by";
pub const LABEL_JOB: &str = "keel.dev/job";
pub const LABEL_EPOCH: &str = "keel.dev/epoch";
pub const LABEL_RANK: &str = "keel.dev/rank";
/// The GPU indexes the plan chose, on the Pod (the device plugin picks the
/// devices; Keel's indexes are its own accounting).
pub const ANNOTATION_GPUS: &str = "keel.dev/gpus";
/// The rendezvous port inside each Pod.
pub const RENDEZVOUS_PORT: u16 = 29500;
/// Where the checkpoint volume is mounted in each worker.
pub const CHECKPOINT_MOUNT: &str = "/keel/checkpoints";

/// The Kubernetes executor's configuration.
#[derive(Debug, Clone)]
pub struct KubeConfig {
    pub namespace: String,
    /// The image for jobs that give a command and no image.
    pub default_image: Option<String>,
    /// The extended resource GPUs are requested as.
    pub gpu_resource: String,
    /// The Node label that names the GPU model.
    pub gpu_type_label: String,
    /// A PersistentVolumeClaim for checkpoints (each job in its own
    /// subdirectory); without one, checkpoints live in an emptyDir and are
    /// lost when the Pod goes.
    pub checkpoint_claim: Option<String>,
    /// A Pod Pending longer than this (and not pulling its image) is given
    /// up on.
    pub pending_timeout: Duration,
    /// How often Nodes are listed (their probes).
    pub node_poll_interval: Duration,
}

impl KubeConfig {
    pub fn new(namespace: &str) -> KubeConfig {
        KubeConfig {
            namespace: namespace.to_string(),
            default_image: None,
            gpu_resource: "nvidia.com/gpu".into(),
            gpu_type_label: "nvidia.com/gpu.product".into(),
            checkpoint_claim: None,
            pending_timeout: Duration::from_secs(300),
            node_poll_interval: Duration::from_secs(2),
        }
    }
}

/// A worker's Pod name: `keel-jJ-eE-rR`.
pub fn pod_name(id: &WorkerId) -> String {
    format!("keel-j{}-e{}-r{}", id.job_id, id.epoch, id.rank)
}

/// The headless Service of a job's epoch: `keel-jJ-eE`.
pub fn service_name(job_id: JobId, epoch: u64) -> String {
    format!("keel-j{job_id}-e{epoch}")
}

/// The worker a Pod runs, from its labels.
fn worker_of(pod: &Pod) -> Option<WorkerId> {
    let labels = pod.metadata.labels.as_ref()?;
    Some(WorkerId {
        job_id: labels.get(LABEL_JOB)?.parse().ok()?,
        epoch: labels.get(LABEL_EPOCH)?.parse().ok()?,
        rank: labels.get(LABEL_RANK)?.parse().ok()?,
    })
}

/// What a Pod's status says about its worker.
#[derive(Debug, Clone, PartialEq, Eq)]
enum PodState {
    Running,
    Exited {
        code: Option<i32>,
        reason: String,
    },
    /// Cannot start (an image that cannot be pulled, a bad spec): delete it
    /// and report this.
    Stuck(String),
}

fn pod_state(pod: &Pod) -> PodState {
    let status = pod.status.as_ref();
    let phase = status.and_then(|s| s.phase.as_deref()).unwrap_or("Pending");
    let container = status
        .and_then(|s| s.container_statuses.as_ref())
        .and_then(|c| c.first());
    let terminated = container
        .and_then(|c| c.state.as_ref())
        .and_then(|s| s.terminated.as_ref());
    match phase {
        "Succeeded" | "Failed" => {
            let (code, reason) = match terminated {
                Some(t) => (
                    Some(t.exit_code),
                    match (&t.reason, &t.message) {
                        (Some(r), Some(m)) => {
                            format!("exited with code {} ({r}: {m})", t.exit_code)
                        }
                        (Some(r), None) => format!("exited with code {} ({r})", t.exit_code),
                        _ => format!("exited with code {}", t.exit_code),
                    },
                ),
                None => (
                    None,
                    format!(
                        "pod {}: {}",
                        phase.to_lowercase(),
                        status
                            .and_then(|s| s.reason.clone().or(s.message.clone()))
                            .unwrap_or_default()
                    ),
                ),
            };
            PodState::Exited { code, reason }
        }
        _ => {
            let waiting = container
                .and_then(|c| c.state.as_ref())
                .and_then(|s| s.waiting.as_ref());
            match waiting.and_then(|w| w.reason.as_deref()) {
                Some(
                    r @ ("ErrImagePull"
                    | "ImagePullBackOff"
                    | "InvalidImageName"
                    | "CreateContainerConfigError"
                    | "CreateContainerError"),
                ) => PodState::Stuck(format!(
                    "{r}: {}",
                    waiting.and_then(|w| w.message.clone()).unwrap_or_default()
                )),
                _ => PodState::Running,
            }
        }
    }
}

/// What the book keeps of a Pod's worker besides what every executor
/// keeps.
#[derive(Debug, Default)]
struct PodWorker {
    /// When the Pod was first seen not running yet (for the pending timeout).
    pending_since: Option<Instant>,
    following: bool,
    /// Rank 0's exit, held until its log has been read to the end (the
    /// follower records it), so the last progress lines count.
    pending_exit: Option<Exit>,
    /// The highest step reported (a restarted log stream skips up to it).
    last_step: Option<u64>,
}

/// Runs workers as Pods. Cheap to clone (shared state).
#[derive(Clone)]
pub struct KubeExecutor {
    client: kube::Client,
    config: Arc<KubeConfig>,
    book: Arc<WorkerBook<PodWorker>>,
    /// The GPU Nodes of the last listing: what the executor owns.
    listed_nodes: Arc<Mutex<BTreeSet<String>>>,
}

impl std::fmt::Debug for KubeExecutor {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("KubeExecutor")
            .field("config", &self.config)
            .finish_non_exhaustive()
    }
}

fn api_error(e: kube::Error) -> String {
    match &e {
        kube::Error::Api(status) => format!("{} ({})", status.message, status.reason),
        _ => e.to_string(),
    }
}

impl KubeExecutor {
    /// An executor on `client` (from the kubeconfig, the in-cluster
    /// account, or a URL).
    pub fn new(client: kube::Client, config: KubeConfig) -> KubeExecutor {
        KubeExecutor::with_clock(client, config, Arc::new(SystemClock))
    }

    /// An executor reading the time from `clock` (the pending timeout, the
    /// progress samples' time).
    pub fn with_clock(
        client: kube::Client,
        config: KubeConfig,
        clock: Arc<dyn Clock>,
    ) -> KubeExecutor {
        KubeExecutor {
            client,
            config: Arc::new(config),
            book: Arc::new(WorkerBook::new(clock)),
            listed_nodes: Arc::default(),
        }
    }

    fn pods(&self) -> Api<Pod> {
        Api::namespaced(self.client.clone(), &self.config.namespace)
    }

    fn selector() -> String {
        format!("{MANAGED_BY}=keel")
    }

    fn record_exit(&self, id: &WorkerId, code: Option<i32>, reason: String) {
        self.book.record_exit(id, code, reason);
    }

    /// The Pod for `launch`.
    fn pod_for(&self, launch: &WorkerLaunch) -> Result<Pod, String> {
        let id = &launch.id;
        if launch.shared_with.is_some() {
            return Err(CANNOT_SHARE_GPUS.into());
        }
        let image = match launch.image.clone().or(self.config.default_image.clone()) {
            Some(i) => i,
            None => {
                return Err(
                    "the Kubernetes executor needs an image: set `image` in the job spec (or a default image)".into(),
                )
            }
        };
        let multi = launch.world_size > 1;
        let rendezvous = if multi {
            format!(
                "{}.{}.svc",
                service_name(id.job_id, id.epoch),
                self.config.namespace
            )
        } else {
            "127.0.0.1".to_string()
        };
        let mut contract = launch.clone();
        contract.rendezvous_addr = rendezvous;
        let checkpoint = format!("{CHECKPOINT_MOUNT}/{}", checkpoint_dir_name(id.job_id));
        let mut env = environment(&contract, RENDEZVOUS_PORT, &checkpoint);
        // The device plugin exposes the Pod's GPUs and sets this itself.
        env.remove("CUDA_VISIBLE_DEVICES");
        let labels: BTreeMap<String, String> = [
            (MANAGED_BY.to_string(), "keel".to_string()),
            (LABEL_JOB.to_string(), id.job_id.to_string()),
            (LABEL_EPOCH.to_string(), id.epoch.to_string()),
            (LABEL_RANK.to_string(), id.rank.to_string()),
        ]
        .into();
        let gpus_csv = launch
            .gpus
            .iter()
            .map(u32::to_string)
            .collect::<Vec<_>>()
            .join(",");
        let limits = (!launch.gpus.is_empty()).then(|| {
            BTreeMap::from([(
                self.config.gpu_resource.clone(),
                Quantity(launch.gpus.len().to_string()),
            )])
        });
        let volume = match &self.config.checkpoint_claim {
            Some(claim) => Volume {
                name: "checkpoints".into(),
                persistent_volume_claim: Some(
                    k8s_openapi::api::core::v1::PersistentVolumeClaimVolumeSource {
                        claim_name: claim.clone(),
                        read_only: None,
                    },
                ),
                ..Volume::default()
            },
            None => Volume {
                name: "checkpoints".into(),
                empty_dir: Some(Default::default()),
                ..Volume::default()
            },
        };
        Ok(Pod {
            metadata: ObjectMeta {
                name: Some(pod_name(id)),
                namespace: Some(self.config.namespace.clone()),
                labels: Some(labels),
                annotations: Some(BTreeMap::from([(ANNOTATION_GPUS.to_string(), gpus_csv)])),
                ..ObjectMeta::default()
            },
            spec: Some(PodSpec {
                node_name: Some(launch.node.clone()),
                restart_policy: Some("Never".into()),
                hostname: (multi && id.rank == 0).then(|| pod_name(id)),
                containers: vec![Container {
                    name: "worker".into(),
                    image: Some(image),
                    command: (!launch.command.is_empty()).then(|| launch.command.clone()),
                    env: Some(
                        env.into_iter()
                            .map(|(name, value)| EnvVar {
                                name,
                                value: Some(value),
                                value_from: None,
                            })
                            .collect(),
                    ),
                    resources: Some(ResourceRequirements {
                        limits,
                        ..ResourceRequirements::default()
                    }),
                    volume_mounts: Some(vec![VolumeMount {
                        name: "checkpoints".into(),
                        mount_path: CHECKPOINT_MOUNT.into(),
                        ..VolumeMount::default()
                    }]),
                    ..Container::default()
                }],
                volumes: Some(vec![volume]),
                ..PodSpec::default()
            }),
            status: None,
        })
    }

    /// The headless Service that resolves to a job's rank 0.
    fn service_for(&self, job_id: JobId, epoch: u64) -> Service {
        let selector = BTreeMap::from([
            (MANAGED_BY.to_string(), "keel".to_string()),
            (LABEL_JOB.to_string(), job_id.to_string()),
            (LABEL_EPOCH.to_string(), epoch.to_string()),
            (LABEL_RANK.to_string(), "0".to_string()),
        ]);
        let mut labels = selector.clone();
        labels.remove(LABEL_RANK);
        Service {
            metadata: ObjectMeta {
                name: Some(service_name(job_id, epoch)),
                namespace: Some(self.config.namespace.clone()),
                labels: Some(labels),
                ..ObjectMeta::default()
            },
            spec: Some(ServiceSpec {
                cluster_ip: Some("None".into()),
                selector: Some(selector),
                ports: Some(vec![ServicePort {
                    name: Some("rendezvous".into()),
                    port: i32::from(RENDEZVOUS_PORT),
                    ..ServicePort::default()
                }]),
                publish_not_ready_addresses: Some(true),
                ..ServiceSpec::default()
            }),
            status: None,
        }
    }

    async fn launch_pod(&self, launch: WorkerLaunch) {
        let id = launch.id.clone();
        let pod = match self.pod_for(&launch) {
            Ok(p) => p,
            Err(reason) => {
                let extra = PodWorker::default();
                self.book
                    .insert_not_started(&id, &launch.node, (Some(127), reason), extra);
                return;
            }
        };
        let extra = PodWorker {
            pending_since: Some(self.book.now()),
            ..PodWorker::default()
        };
        let gpus = gpu_refs(&launch.node, launch.gpus.iter().copied());
        self.book
            .insert(&id, Worker::running(&launch.node, gpus, extra));
        if launch.world_size > 1 && id.rank == 0 {
            let services: Api<Service> =
                Api::namespaced(self.client.clone(), &self.config.namespace);
            match services
                .create(
                    &PostParams::default(),
                    &self.service_for(id.job_id, id.epoch),
                )
                .await
            {
                Ok(_) => {}
                Err(kube::Error::Api(s)) if s.code == 409 => {}
                Err(e) => {
                    tracing::warn!(worker = %id, error = %api_error(e), "rendezvous service not created")
                }
            }
        }
        let generation = self.book.generation();
        if self.create_pod(&id, &pod).await {
            return;
        }
        // The API server did not answer (or is overloaded): keep trying in
        // the background until it takes the Pod, or the worker is stopped.
        let this = self.clone();
        tokio::spawn(async move {
            loop {
                tokio::time::sleep(Duration::from_secs(1)).await;
                {
                    let mut book = this.book.lock();
                    if !book.is_current(generation) {
                        return;
                    }
                    let Some(w) = book.workers.get_mut(&id) else {
                        return;
                    };
                    if !w.is_running() {
                        return;
                    }
                    if w.stopping {
                        w.exited = Some((
                            None,
                            "stopped before it started: the API server did not take its pod".into(),
                        ));
                        return;
                    }
                }
                if this.create_pod(&id, &pod).await {
                    return;
                }
            }
        });
    }

    /// One attempt at creating a worker's Pod. False when it may succeed
    /// later (no answer, 5xx, 429); a refusal is recorded as the worker's
    /// exit.
    async fn create_pod(&self, id: &WorkerId, pod: &Pod) -> bool {
        match self.pods().create(&PostParams::default(), pod).await {
            Ok(_) => {
                tracing::info!(worker = %id, "pod created");
                true
            }
            // Already there (a launch retried after a lost answer): the
            // watch reports it.
            Err(kube::Error::Api(s)) if s.code == 409 => true,
            Err(kube::Error::Api(s)) if s.code < 500 && s.code != 429 => {
                let reason = format!(
                    "the API server refused the pod: {} ({})",
                    s.message, s.reason
                );
                self.record_exit(id, Some(127), reason);
                true
            }
            Err(e) => {
                tracing::warn!(worker = %id, error = %api_error(e), "pod not created yet; will retry");
                false
            }
        }
    }

    /// Applies what the watch says about one Pod.
    fn on_pod(&self, pod: &Pod, generation: u64) {
        let Some(id) = worker_of(pod) else {
            return;
        };
        let state = pod_state(pod);
        let node = pod
            .spec
            .as_ref()
            .and_then(|s| s.node_name.clone())
            .unwrap_or_default();
        let mut follow = false;
        let mut give_up: Option<String> = None;
        {
            let now = self.book.now();
            let mut book = self.book.lock();
            if !book.is_current(generation) {
                return;
            }
            let entry = book.workers.entry(id.clone()).or_insert_with(|| {
                // Found by the watch: an earlier leader's (re-adopted or
                // reported), or ours after a restart of the watch.
                tracing::info!(worker = %id, "found a pod this executor did not start");
                let gpus = pod
                    .metadata
                    .annotations
                    .as_ref()
                    .and_then(|a| a.get(ANNOTATION_GPUS))
                    .map(|csv| gpu_refs(&node, csv.split(',').filter_map(|g| g.parse().ok())))
                    .unwrap_or_default();
                let extra = PodWorker {
                    pending_since: Some(now),
                    ..PodWorker::default()
                };
                Worker::running(&node, gpus, extra)
            });
            if entry.exited.is_some() {
                return;
            }
            let running = pod.status.as_ref().and_then(|s| s.phase.as_deref()) == Some("Running");
            match &state {
                // A Pod still Pending is timed by `give_up_on_pending`.
                PodState::Running => {
                    if running {
                        entry.extra.pending_since = None;
                    }
                    if running && id.rank == 0 && !entry.extra.following {
                        entry.extra.following = true;
                        follow = true;
                    }
                }
                PodState::Stuck(reason) => give_up = Some(reason.clone()),
                PodState::Exited { code, reason } => {
                    if entry.extra.following {
                        // The follower records it once the log is read.
                        entry.extra.pending_exit = Some((*code, reason.clone()));
                        return;
                    }
                }
            }
        }
        match state {
            PodState::Exited { code, reason } => self.record_exit(&id, code, reason),
            PodState::Stuck(_) | PodState::Running => {
                if let Some(reason) = give_up {
                    self.abandon(&id, &reason);
                } else if follow {
                    tokio::spawn(self.clone().follow_progress(id, generation));
                }
            }
        }
    }

    /// A Pod gone from the API server.
    fn on_pod_deleted(&self, pod: &Pod) {
        let Some(id) = worker_of(pod) else {
            return;
        };
        let pending = self
            .book
            .lock()
            .workers
            .get_mut(&id)
            .and_then(|w| w.extra.pending_exit.take());
        match (pending, pod_state(pod)) {
            (Some((code, reason)), _) | (None, PodState::Exited { code, reason }) => {
                self.record_exit(&id, code, reason)
            }
            _ => self.record_exit(&id, None, "its pod was deleted".into()),
        }
    }

    /// Follows rank 0's log for progress until the Pod ends or this server
    /// stops leading; a broken stream is opened again, skipping the steps
    /// already reported.
    async fn follow_progress(self, id: WorkerId, generation: u64) {
        let name = pod_name(&id);
        loop {
            let params = LogParams {
                container: Some("worker".into()),
                follow: true,
                ..LogParams::default()
            };
            match self.pods().log_stream(&name, &params).await {
                Ok(stream) => {
                    let mut lines = stream.lines();
                    while let Some(Ok(line)) = lines.next().await {
                        let Some(sample) = parse_progress_line(&line, self.book.unix_ms()) else {
                            continue;
                        };
                        let mut book = self.book.lock();
                        if !book.is_current(generation) {
                            return;
                        }
                        let Some(w) = book.workers.get_mut(&id) else {
                            return;
                        };
                        if w.extra.last_step.is_some_and(|s| sample.step <= s) {
                            continue;
                        }
                        w.extra.last_step = Some(sample.step);
                        book.add_progress(generation, id.job_id, [sample]);
                    }
                }
                Err(e) => {
                    tracing::debug!(worker = %id, error = %api_error(e), "log stream not opened")
                }
            }
            // The stream ends when the container does: an exit the watch
            // saw meanwhile is recorded now, after the last lines.
            let pending = {
                let mut book = self.book.lock();
                if !book.is_current(generation) {
                    return;
                }
                match book.workers.get_mut(&id) {
                    None => return,
                    Some(w) if !w.is_running() => return,
                    Some(w) => w.extra.pending_exit.take(),
                }
            };
            if let Some((code, reason)) = pending {
                self.record_exit(&id, code, reason);
                return;
            }
            tokio::time::sleep(Duration::from_millis(500)).await;
        }
    }

    /// Watches Keel's Pods until this server stops leading.
    async fn watch_pods(self, generation: u64) {
        let config = watcher::Config::default().labels(&Self::selector());
        let mut stream = watcher(self.pods(), config).boxed();
        let mut listed: BTreeSet<WorkerId> = BTreeSet::new();
        let mut last_check = Instant::now();
        loop {
            if last_check.elapsed() > Duration::from_millis(200) {
                self.give_up_on_pending();
                last_check = Instant::now();
            }
            let next = tokio::select! {
                n = stream.try_next() => n,
                _ = tokio::time::sleep(Duration::from_millis(200)) => {
                    if !self.book.is_current(generation) {
                        return;
                    }
                    self.give_up_on_pending();
                    continue;
                }
            };
            if !self.book.is_current(generation) {
                return;
            }
            match next {
                Ok(Some(watcher::Event::Apply(pod))) => self.on_pod(&pod, generation),
                Ok(Some(watcher::Event::Delete(pod))) => self.on_pod_deleted(&pod),
                Ok(Some(watcher::Event::Init)) => listed.clear(),
                Ok(Some(watcher::Event::InitApply(pod))) => {
                    if let Some(id) = worker_of(&pod) {
                        listed.insert(id);
                    }
                    self.on_pod(&pod, generation);
                }
                Ok(Some(watcher::Event::InitDone)) => {
                    // Pods this executor knew of that the new list lacks
                    // were deleted while the watch was down.
                    let gone: Vec<WorkerId> = {
                        let now = self.book.now();
                        let book = self.book.lock();
                        book.workers
                            .iter()
                            .filter(|(id, w)| {
                                w.is_running()
                                    && w.extra.pending_since.is_none_or(|t| {
                                        now.saturating_duration_since(t) > Duration::from_secs(5)
                                    })
                                    && !listed.contains(id)
                            })
                            .map(|(id, _)| id.clone())
                            .collect()
                    };
                    for id in gone {
                        self.record_exit(&id, None, "its pod was deleted".into());
                    }
                }
                Ok(None) => return,
                Err(e) => {
                    tracing::debug!(error = %e, "pod watch interrupted");
                    tokio::time::sleep(Duration::from_millis(500)).await;
                }
            }
        }
    }

    /// Pods Pending past the timeout (no event comes for them): deleted,
    /// and their workers reported as not started.
    fn give_up_on_pending(&self) {
        let timeout = self.config.pending_timeout;
        let now = self.book.now();
        let stuck: Vec<WorkerId> = self
            .book
            .lock()
            .workers
            .iter()
            .filter(|(_, w)| {
                w.is_running()
                    && w.extra
                        .pending_since
                        .is_some_and(|t| now.saturating_duration_since(t) > timeout)
            })
            .map(|(id, _)| id.clone())
            .collect();
        let reason = format!("pending for more than {:.0} s", timeout.as_secs_f64());
        for id in stuck {
            self.abandon(&id, &reason);
        }
    }

    /// A worker whose Pod cannot start: reported as not started, with why,
    /// and its Pod deleted.
    fn abandon(&self, id: &WorkerId, reason: &str) {
        self.record_exit(id, Some(127), format!("could not start: {reason}"));
        let this = self.clone();
        let name = pod_name(id);
        tokio::spawn(async move {
            let _ = this.pods().delete(&name, &DeleteParams::default()).await;
        });
    }

    /// Lists Nodes every `node_poll_interval` as their probes, until this
    /// server stops leading.
    async fn probe_nodes(self, generation: u64) {
        let nodes: Api<Node> = Api::all(self.client.clone());
        loop {
            let (probes, listed) = match nodes.list(&ListParams::default()).await {
                Ok(list) => {
                    let probes = list
                        .items
                        .iter()
                        .filter_map(|n| self.node_probe(n))
                        .collect::<Vec<_>>();
                    let listed = probes
                        .iter()
                        .map(|p| match p {
                            NodeProbe::Answered(r) => r.name.clone(),
                            NodeProbe::Unreachable { name, .. } => name.clone(),
                        })
                        .collect();
                    (probes, Some(listed))
                }
                Err(e) => {
                    tracing::warn!(error = %api_error(e), "cannot list nodes");
                    (Vec::new(), None)
                }
            };
            {
                let mut book = self.book.lock();
                if !book.is_current(generation) {
                    return;
                }
                // A failed listing keeps the last one.
                if let Some(listed) = listed {
                    *self.listed_nodes.lock().unwrap_or_else(|e| e.into_inner()) = listed;
                }
                for p in probes {
                    book.set_probe(generation, p);
                }
            }
            tokio::time::sleep(self.config.node_poll_interval).await;
        }
    }

    /// A Node's probe: its GPUs when Ready, else why not. Nodes without
    /// GPUs are not Keel's.
    fn node_probe(&self, node: &Node) -> Option<NodeProbe> {
        let name = node.metadata.name.clone()?;
        let status = node.status.as_ref()?;
        let count: u32 = status
            .capacity
            .as_ref()
            .and_then(|c| c.get(&self.config.gpu_resource))
            .and_then(|q| q.0.parse().ok())
            .unwrap_or(0);
        if count == 0 {
            return None;
        }
        let ready = status
            .conditions
            .as_ref()
            .and_then(|c| c.iter().find(|c| c.type_ == "Ready"));
        if ready.is_none_or(|c| c.status != "True") {
            let why = ready
                .map(|c| {
                    format!(
                        "not Ready ({}: {})",
                        c.reason.clone().unwrap_or_default(),
                        c.message.clone().unwrap_or_default()
                    )
                })
                .unwrap_or_else(|| "no Ready condition".into());
            return Some(NodeProbe::Unreachable { name, reason: why });
        }
        let gpu_type = node
            .metadata
            .labels
            .as_ref()
            .and_then(|l| l.get(&self.config.gpu_type_label))
            .map_or_else(|| "gpu".to_string(), |p| gpu_type_of(p));
        let address = status
            .addresses
            .as_ref()
            .and_then(|a| a.iter().find(|a| a.type_ == "InternalIP"))
            .map_or_else(|| name.clone(), |a| a.address.clone());
        Some(NodeProbe::Answered(NodeReport {
            name,
            address,
            gpus: (0..count)
                .map(|index| Gpu {
                    index,
                    gpu_type: gpu_type.clone(),
                })
                .collect(),
        }))
    }
}

/// Why the Kubernetes executor runs no space-sharing policy.
pub const CANNOT_SHARE_GPUS: &str =
    "the Kubernetes executor cannot put two Pods on the same GPUs: \
     the device plugin hands each Pod whole GPUs of its own choosing (time-slicing and MPS \
     replicas are not pinned to a device either); use a policy without space sharing";

impl Executor for KubeExecutor {
    fn owns(&self, node: &str) -> bool {
        self.listed_nodes
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .contains(node)
    }

    fn cannot_share_gpus(&self) -> Option<&'static str> {
        Some(CANNOT_SHARE_GPUS)
    }

    async fn launch(&self, launch: WorkerLaunch) -> Result<(), ExecutorError> {
        if self.book.contains(&launch.id) {
            return Ok(());
        }
        self.launch_pod(launch).await;
        Ok(())
    }

    async fn stop(&self, id: &WorkerId, grace: Duration) -> Result<(), ExecutorError> {
        if self.book.begin_stop(id).is_none() {
            return Ok(());
        }
        let params = DeleteParams {
            grace_period_seconds: Some(u32::try_from(grace.as_secs()).unwrap_or(u32::MAX)),
            ..DeleteParams::default()
        };
        match self.pods().delete(&pod_name(id), &params).await {
            Ok(_) => Ok(()),
            Err(kube::Error::Api(s)) if s.code == 404 => Ok(()),
            Err(e) => {
                // Not deleted: try again on the next pass.
                if let Some(w) = self.book.lock().workers.get_mut(id) {
                    w.stopping = false;
                }
                Err(ExecutorError::Other(format!(
                    "deleting pod {}: {}",
                    pod_name(id),
                    api_error(e)
                )))
            }
        }
    }

    async fn observe(&self) -> Result<BTreeMap<WorkerId, Observed>, ExecutorError> {
        Ok(self.book.observe())
    }

    async fn forget(&self, id: &WorkerId) {
        let known = self
            .book
            .lock()
            .workers
            .get(id)
            .is_some_and(|w| !w.is_running());
        if !known {
            return;
        }
        // The exit is in the log: the finished Pod (and the epoch's Service,
        // with rank 0) can go.
        let _ = self
            .pods()
            .delete(&pod_name(id), &DeleteParams::default())
            .await;
        if id.rank == 0 {
            let services: Api<Service> =
                Api::namespaced(self.client.clone(), &self.config.namespace);
            let _ = services
                .delete(&service_name(id.job_id, id.epoch), &DeleteParams::default())
                .await;
        }
        self.book.forget(id);
    }

    async fn take_progress(&self) -> BTreeMap<JobId, Vec<ProgressSample>> {
        self.book.take_progress()
    }

    async fn logs(&self, job_id: JobId, tail_bytes: u64) -> Result<Vec<WorkerLog>, ExecutorError> {
        let list = self
            .pods()
            .list(
                &ListParams::default()
                    .labels(&format!("{},{LABEL_JOB}={job_id}", Self::selector())),
            )
            .await
            .map_err(|e| ExecutorError::Other(api_error(e)))?;
        let mut out = Vec::new();
        for pod in list.items {
            let Some(id) = worker_of(&pod) else {
                continue;
            };
            let params = LogParams {
                container: Some("worker".into()),
                limit_bytes: None,
                ..LogParams::default()
            };
            let text = self
                .pods()
                .logs(&pod_name(&id), &params)
                .await
                .unwrap_or_default();
            let bytes = text.into_bytes();
            let total_bytes = bytes.len() as u64;
            let start = bytes
                .len()
                .saturating_sub(usize::try_from(tail_bytes).unwrap_or(usize::MAX));
            out.push(WorkerLog {
                id,
                content: bytes[start..].to_vec(),
                total_bytes,
            });
        }
        out.sort_by(|a, b| a.id.cmp(&b.id));
        Ok(out)
    }

    async fn take_over(&self) {
        let Some(generation) = self.book.begin_leading() else {
            return;
        };
        tokio::spawn(self.clone().watch_pods(generation));
        tokio::spawn(self.clone().probe_nodes(generation));
    }

    async fn release(&self) {
        self.book.release();
    }

    async fn take_node_probes(&self) -> Vec<NodeProbe> {
        self.book.take_probes()
    }

    async fn shutdown(&self, grace: Duration) {
        // Pods belong to the cluster, not to this process: a server that
        // stops leaves them for the next leader, which re-adopts them.
        let _ = grace;
        let running = self.book.running();
        tracing::info!(pods = running.len(), "leaving the pods to the next leader");
        self.book.end_leading();
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use k8s_openapi::api::core::v1::{
        ContainerState, ContainerStateTerminated, ContainerStateWaiting, ContainerStatus, PodStatus,
    };

    fn pod_with(phase: &str, state: ContainerState) -> Pod {
        Pod {
            status: Some(PodStatus {
                phase: Some(phase.into()),
                container_statuses: Some(vec![ContainerStatus {
                    name: "worker".into(),
                    state: Some(state),
                    ..ContainerStatus::default()
                }]),
                ..PodStatus::default()
            }),
            ..Pod::default()
        }
    }

    #[test]
    fn pod_statuses_map_to_worker_states() {
        let done = pod_with(
            "Failed",
            ContainerState {
                terminated: Some(ContainerStateTerminated {
                    exit_code: 137,
                    reason: Some("OOMKilled".into()),
                    ..ContainerStateTerminated::default()
                }),
                ..ContainerState::default()
            },
        );
        assert_eq!(
            pod_state(&done),
            PodState::Exited {
                code: Some(137),
                reason: "exited with code 137 (OOMKilled)".into()
            }
        );
        let pull = pod_with(
            "Pending",
            ContainerState {
                waiting: Some(ContainerStateWaiting {
                    reason: Some("ImagePullBackOff".into()),
                    message: Some("Back-off pulling image \"nope:1\"".into()),
                }),
                ..ContainerState::default()
            },
        );
        match pod_state(&pull) {
            PodState::Stuck(r) => assert!(
                r.contains("ImagePullBackOff") && r.contains("nope:1"),
                "{r}"
            ),
            s => panic!("{s:?}"),
        }
        assert_eq!(pod_state(&Pod::default()), PodState::Running, "pending");
    }

    #[test]
    fn names_fit_kubernetes_limits() {
        let id = WorkerId {
            job_id: u64::MAX,
            epoch: u64::MAX,
            rank: u32::MAX,
        };
        assert!(pod_name(&id).len() <= 63);
        assert!(service_name(u64::MAX, u64::MAX).len() <= 63);
    }
}
