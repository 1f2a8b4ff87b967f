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
//! - **Not admitted**: a Pod the kubelet rejects (no free device:
//!   `UnexpectedAdmissionError`, `OutOfnvidia.com/gpu`) never ran: it is
//!   reported as [`crate::Observed::NotAdmitted`] (the job is requeued
//!   without spending a retry) and the Node is looked at again at once.
//! - **Stop**: delete with the grace period rounded up to whole seconds (0
//!   only with `force_delete`: the API server takes 0 as "delete now"); the
//!   Pod runs until the kubelet confirms, and its worker (with its GPUs)
//!   stays running until then. One still terminating `terminating_timeout`
//!   after its grace is reported, its GPUs kept out of what the Node offers,
//!   and given up on when its Node is not Ready.
//! - **API calls** have a deadline (`call_timeout`); creates and deletes that
//!   fail transiently (no answer, 429, 5xx) are retried in the background
//!   after the server's `Retry-After` ([`calls`]), so a slow API server
//!   holds no reconcile pass. A 409 on create is this worker's Pod (its
//!   labels say so) or a conflict reported as the worker's exit.
//! - **Take over**: the watch's first list finds the Pods an earlier leader
//!   created: running ones are re-adopted, finished ones reported.
//! - **Nodes**: Node objects with `nvidia.com/gpu` capacity; the GPU type
//!   from a label (`nvidia.com/gpu.product`); what each offers Keel is
//!   [`offer`]'s: allocatable, less other workloads' Pods (a cluster-wide
//!   watch) and Keel's stuck terminating Pods; cordoned and tainted Nodes
//!   take no new workers.

pub mod calls;
pub mod follow;
pub mod offer;

use std::collections::{BTreeMap, BTreeSet};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use futures::{AsyncReadExt, StreamExt, TryStreamExt};
use k8s_openapi::api::core::v1::{
    Container, EnvVar, EnvVarSource, Node, Pod, PodSpec, ResourceRequirements, Secret,
    SecretKeySelector, Service, ServicePort, ServiceSpec, Toleration, Volume, VolumeMount,
};
use k8s_openapi::apimachinery::pkg::api::resource::Quantity;
use k8s_openapi::apimachinery::pkg::apis::meta::v1::ObjectMeta;
use keel_state::{JobId, ProgressSample};
use kube::api::{Api, DeleteParams, ListParams, LogParams, PostParams};
use kube::runtime::watcher;

use crate::book::{Clock, Exit, SystemClock, Worker, WorkerBook};
use crate::contract::{
    checkpoint_dir_name, environment, gpu_refs, parse_progress_line, WorkerLaunch,
};
use crate::executor::{Executor, ExecutorError, NodeProbe, WorkerLog};
use crate::reconcile::Observed;
use crate::WorkerId;
use calls::{bounded, retry_delay, CallError};
use follow::{next_line, ResumePoint};
use offer::{offer, pod_gpus, NodeUse, OfferRules};

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
    /// Taints Keel's Pods tolerate: they go on every Pod, and a Node
    /// tainted only with these takes workers.
    pub tolerations: Vec<Toleration>,
    /// The longest one API call may take before it counts as failed (and,
    /// for a create or delete, is tried again in the background).
    pub call_timeout: Duration,
    /// How long past its grace a stopped Pod may stay Terminating before it
    /// is reported (and its GPUs kept out of the Node's offer).
    pub terminating_timeout: Duration,
    /// Force-delete (`gracePeriodSeconds: 0`) a stopped Pod still
    /// terminating past `terminating_timeout`, and stop with no grace when
    /// asked for none. Off: the API server's force delete removes the Pod
    /// object while its containers may still run on the GPUs.
    pub force_delete: bool,
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
            tolerations: Vec::new(),
            call_timeout: Duration::from_secs(10),
            terminating_timeout: Duration::from_secs(60),
            force_delete: false,
        }
    }

    /// A toleration from `KEY[=VALUE][:EFFECT]` (`--k8s-tolerate`): with a
    /// value it must equal the taint's; without one any value is
    /// tolerated; without an effect, every effect.
    pub fn parse_toleration(text: &str) -> Result<Toleration, String> {
        let (rest, effect) = match text.rsplit_once(':') {
            Some((r, e)) => (r, Some(e)),
            None => (text, None),
        };
        if let Some(e) = effect {
            if !matches!(e, "NoSchedule" | "PreferNoSchedule" | "NoExecute") {
                return Err(format!(
                    "{text:?}: the effect must be NoSchedule, PreferNoSchedule or NoExecute, not {e:?}"
                ));
            }
        }
        let (key, value) = match rest.split_once('=') {
            Some((k, v)) => (k, Some(v)),
            None => (rest, None),
        };
        if key.is_empty() || key.len() > 316 {
            return Err(format!("{text:?}: the key must be 1 to 316 characters"));
        }
        Ok(Toleration {
            key: Some(key.to_string()),
            operator: Some(if value.is_some() { "Equal" } else { "Exists" }.into()),
            value: value.map(str::to_string),
            effect: effect.map(str::to_string),
            toleration_seconds: None,
        })
    }
}

/// The grace period a stop asks the API server for: whole seconds, rounded
/// up, at least 1 unless `force` (0 means "delete now" to the API server).
pub fn grace_seconds(grace: Duration, force: bool) -> i64 {
    if force && grace.is_zero() {
        return 0;
    }
    let ceil = grace.as_secs() + u64::from(grace.subsec_nanos() > 0);
    i64::try_from(ceil.max(1)).unwrap_or(i64::MAX)
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

/// Whether `pod` is one of this executor's (its label and namespace).
fn is_ours(pod: &Pod, namespace: &str) -> bool {
    pod.metadata.namespace.as_deref() == Some(namespace)
        && pod
            .metadata
            .labels
            .as_ref()
            .and_then(|l| l.get(MANAGED_BY))
            .is_some_and(|v| v == "keel")
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
    /// The kubelet refused it (no device free, a node predicate): it never
    /// ran.
    NotAdmitted(String),
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
    let started = container
        .and_then(|c| c.state.as_ref())
        .is_some_and(|s| s.running.is_some() || s.terminated.is_some());
    match phase {
        // A Pod the kubelet rejected at admission fails with a reason and
        // no container that ever ran.
        "Failed" if !started && status.and_then(|s| s.reason.as_ref()).is_some() => {
            let s = status.cloned().unwrap_or_default();
            PodState::NotAdmitted(format!(
                "could not start: the kubelet did not admit it ({}: {})",
                s.reason.unwrap_or_default(),
                s.message.unwrap_or_default()
            ))
        }
        "Succeeded" | "Failed" => {
            let (code, reason) = match terminated {
                Some(t) => (
                    Some(t.exit_code),
                    match (&t.reason, &t.message) {
                        // The kubelet's word for the kernel's memory kill.
                        (Some(r), _) if r == "OOMKilled" => format!(
                            "out of memory: over the container's limit (exited with code {})",
                            t.exit_code
                        ),
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
    /// The API server has taken the Pod (its create was answered, or a
    /// watch or list showed it): a later list without it means deleted.
    created: bool,
    /// A list taken while its create was unanswered lacked the Pod: it is
    /// asked for by name once the create is answered.
    confirm_when_created: bool,
    following: bool,
    /// Rank 0's exit, held until its log has been read to the end (the
    /// follower records it), so the last progress lines count.
    pending_exit: Option<Exit>,
    /// The highest step reported (a restarted log stream skips up to it).
    last_step: Option<u64>,
    /// Where rank 0's followed log was read to.
    log_at: ResumePoint,
    /// When Keel asked for the Pod's deletion, and the grace it gave.
    stop_asked: Option<(Instant, Duration)>,
    /// Still terminating past its grace and `terminating_timeout`: said
    /// once, and its GPUs kept out of the Node's offer.
    stuck: bool,
    /// Its variables from secrets are in a Secret named like its Pod
    /// (issue 35), deleted when the worker is forgotten.
    has_secret: bool,
}

/// The labels that name a worker's Pod and Secret as Keel's and its.
fn worker_labels(id: &WorkerId) -> BTreeMap<String, String> {
    [
        (MANAGED_BY.to_string(), "keel".to_string()),
        (LABEL_JOB.to_string(), id.job_id.to_string()),
        (LABEL_EPOCH.to_string(), id.epoch.to_string()),
        (LABEL_RANK.to_string(), id.rank.to_string()),
    ]
    .into()
}

/// What a worker's Pod needs made before it: the job's rendezvous Service
/// (rank 0 of a multi-worker job) and the worker's Secret.
struct PodExtras {
    service: Option<Service>,
    secret: Option<Secret>,
}

/// Whether `pod` reads variables from the Secret named like it (a worker
/// with secrets, found by a new leader).
fn reads_own_secret(pod: &Pod) -> bool {
    let own = pod.metadata.name.as_deref();
    pod.spec.iter().flat_map(|s| &s.containers).any(|c| {
        c.env.iter().flatten().any(|e| {
            e.value_from
                .as_ref()
                .and_then(|v| v.secret_key_ref.as_ref())
                .is_some_and(|r| Some(r.name.as_str()) == own)
        })
    })
}

/// What the executor sees of the cluster besides its own workers (cleared
/// with them when leadership ends).
#[derive(Debug, Default)]
struct Cluster {
    /// Other workloads' unfinished Pods that request GPUs, by
    /// `namespace/name`: their Node and GPUs.
    others: BTreeMap<String, (String, u32)>,
    /// Why other workloads' Pods cannot be seen (RBAC, an API error), when
    /// they cannot.
    others_unseen: Option<String>,
    /// Nodes the last listing found not Ready.
    not_ready: BTreeSet<String>,
}

/// Runs workers as Pods. Cheap to clone (shared state).
#[derive(Clone)]
pub struct KubeExecutor {
    client: kube::Client,
    config: Arc<KubeConfig>,
    book: Arc<WorkerBook<PodWorker, Cluster>>,
    /// The GPU Nodes of the last listing: what the executor owns.
    listed_nodes: Arc<Mutex<BTreeSet<String>>>,
    /// Wakes the Node probe at once (a Pod was not admitted, a Pod is
    /// stuck terminating).
    reprobe: Arc<tokio::sync::Notify>,
}

impl std::fmt::Debug for KubeExecutor {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("KubeExecutor")
            .field("config", &self.config)
            .finish_non_exhaustive()
    }
}

impl KubeExecutor {
    /// An executor on `client` (from the kubeconfig, the in-cluster
    /// account, or a URL; build it with [`calls::client`] so that Keel, not
    /// the client, retries).
    pub fn new(client: kube::Client, config: KubeConfig) -> KubeExecutor {
        KubeExecutor::with_clock(client, config, Arc::new(SystemClock))
    }

    /// An executor reading the time from `clock` (the pending and
    /// terminating timeouts, the progress samples' time).
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
            reprobe: Arc::default(),
        }
    }

    fn pods(&self) -> Api<Pod> {
        Api::namespaced(self.client.clone(), &self.config.namespace)
    }

    fn services(&self) -> Api<Service> {
        Api::namespaced(self.client.clone(), &self.config.namespace)
    }

    fn secrets(&self) -> Api<Secret> {
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
        // A variable from a secret is read from the worker's Secret
        // ([`Self::secret_for`]): its value is not in the Pod.
        let from_secret: Vec<EnvVar> = launch
            .secret_env
            .keys()
            .filter(|name| env.remove(name.as_str()).is_some())
            .map(|name| EnvVar {
                name: name.clone(),
                value: None,
                value_from: Some(EnvVarSource {
                    secret_key_ref: Some(SecretKeySelector {
                        name: pod_name(id),
                        key: name.clone(),
                        optional: Some(false),
                    }),
                    ..EnvVarSource::default()
                }),
            })
            .collect();
        let labels = worker_labels(id);
        let gpus_csv = launch
            .gpus
            .iter()
            .map(u32::to_string)
            .collect::<Vec<_>>()
            .join(",");
        // GPUs, and the job's CPU and memory limits (requests default to
        // the limits: the scheduler sees what the worker may use).
        let mut limits = BTreeMap::new();
        if !launch.gpus.is_empty() {
            limits.insert(
                self.config.gpu_resource.clone(),
                Quantity(launch.gpus.len().to_string()),
            );
        }
        if let Some(millis) = launch.resources.cpu_millis {
            limits.insert("cpu".to_string(), Quantity(format!("{millis}m")));
        }
        if let Some(bytes) = launch.resources.memory_bytes {
            limits.insert("memory".to_string(), Quantity(bytes.to_string()));
        }
        let limits = (!limits.is_empty()).then_some(limits);
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
                tolerations: (!self.config.tolerations.is_empty())
                    .then(|| self.config.tolerations.clone()),
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
                            .chain(from_secret)
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

    /// The Secret holding `launch`'s opened variables from secrets, named
    /// like its Pod and labelled like it; none without such variables.
    fn secret_for(&self, launch: &WorkerLaunch) -> Option<Secret> {
        let values: BTreeMap<String, String> = launch
            .secret_env
            .iter()
            .filter_map(|(name, s)| Some((name.clone(), s.value.clone()?)))
            .collect();
        if values.is_empty() {
            return None;
        }
        let id = &launch.id;
        let labels = worker_labels(id);
        Some(Secret {
            metadata: ObjectMeta {
                name: Some(pod_name(id)),
                namespace: Some(self.config.namespace.clone()),
                labels: Some(labels),
                ..ObjectMeta::default()
            },
            string_data: Some(values),
            type_: Some("Opaque".into()),
            ..Secret::default()
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

    /// Starts a worker: its Pod (and, for rank 0 of a multi-worker job, the
    /// rendezvous Service) is created in the background, so a slow API
    /// server holds no reconcile pass.
    fn launch_pod(&self, launch: WorkerLaunch) {
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
        let secret = self.secret_for(&launch);
        let extra = PodWorker {
            pending_since: Some(self.book.now()),
            has_secret: secret.is_some(),
            ..PodWorker::default()
        };
        let gpus = gpu_refs(&launch.node, launch.gpus.iter().copied());
        self.book
            .insert(&id, Worker::running(&launch.node, gpus, extra));
        let generation = self.book.generation();
        let service =
            (launch.world_size > 1 && id.rank == 0).then(|| self.service_for(id.job_id, id.epoch));
        tokio::spawn(
            self.clone()
                .create(id, pod, PodExtras { service, secret }, generation),
        );
    }

    /// Whether a task of `generation` should go on with `id`: it leads,
    /// the worker is in the book and has not ended. A worker Keel stops
    /// before its Pod was taken ends here.
    fn still_wanted(&self, id: &WorkerId, generation: u64) -> bool {
        let mut book = self.book.lock();
        if !book.is_current(generation) {
            return false;
        }
        match book.workers.get_mut(id) {
            Some(w) if w.is_running() && w.stopping => {
                w.exited = Some((
                    None,
                    "stopped before it started: the API server had not taken its pod".into(),
                ));
                false
            }
            Some(w) => w.is_running(),
            None => false,
        }
    }

    /// Creates a worker's Pod, trying again after transient failures (no
    /// answer, 429 after its `Retry-After`, 5xx) until it is taken,
    /// refused, or no longer wanted.
    async fn create(self, id: WorkerId, pod: Pod, extras: PodExtras, generation: u64) {
        let deadline = self.config.call_timeout;
        if let Some(secret) = extras.secret {
            if !self.create_secret(&id, &secret, generation).await {
                return;
            }
        }
        if let Some(svc) = extras.service {
            match bounded(
                deadline,
                self.services().create(&PostParams::default(), &svc),
            )
            .await
            {
                Ok(_) | Err(CallError::Conflict(_)) => {}
                Err(e) => {
                    tracing::warn!(worker = %id, error = %e, "rendezvous service not created")
                }
            }
        }
        let name = pod_name(&id);
        let mut attempt = 0u32;
        while self.still_wanted(&id, generation) {
            let wait = match bounded(deadline, self.pods().create(&PostParams::default(), &pod))
                .await
            {
                Ok(_) => {
                    tracing::info!(worker = %id, "pod created");
                    self.mark_created(&id, generation);
                    return;
                }
                // There already: this worker's (a create that was taken but
                // answered with an error, a launch retried by a new leader),
                // or someone else's.
                Err(CallError::Conflict(message)) => {
                    match bounded(deadline, self.pods().get(&name)).await {
                        Ok(existing)
                            if is_ours(&existing, &self.config.namespace)
                                && worker_of(&existing).as_ref() == Some(&id) =>
                        {
                            tracing::info!(worker = %id, "pod already there: this worker's");
                            self.mark_created(&id, generation);
                            return;
                        }
                        Ok(existing) => {
                            let labels = existing.metadata.labels.unwrap_or_default();
                            self.record_exit(
                                &id,
                                Some(127),
                                format!(
                                    "could not start: a pod named {name} exists that is not this worker's \
                                     (its labels: {labels:?}): {message}"
                                ),
                            );
                            return;
                        }
                        // Gone meanwhile: create it again.
                        Err(CallError::NotFound) => Duration::ZERO,
                        Err(e) => retry_delay(attempt, retry_after(&e)),
                    }
                }
                Err(e @ (CallError::Refused { .. } | CallError::NotFound)) => {
                    self.record_exit(
                        &id,
                        Some(127),
                        format!("could not start: the API server refused the pod: {e}"),
                    );
                    return;
                }
                Err(e @ CallError::Transient { .. }) => {
                    let wait = retry_delay(attempt, retry_after(&e));
                    tracing::warn!(worker = %id, error = %e, retry_in_s = wait.as_secs_f64(), "pod not created yet");
                    wait
                }
            };
            attempt = attempt.saturating_add(1);
            tokio::time::sleep(wait).await;
        }
    }

    /// Creates a worker's Secret before its Pod, trying again after
    /// transient failures; one there already is this worker's (a create
    /// taken but answered with an error, a launch retried by a new
    /// leader). Whether the Pod may be created.
    async fn create_secret(&self, id: &WorkerId, secret: &Secret, generation: u64) -> bool {
        let mut attempt = 0u32;
        while self.still_wanted(id, generation) {
            let created = bounded(
                self.config.call_timeout,
                self.secrets().create(&PostParams::default(), secret),
            )
            .await;
            let wait = match created {
                Ok(_) | Err(CallError::Conflict(_)) => return true,
                Err(e @ (CallError::Refused { .. } | CallError::NotFound)) => {
                    self.record_exit(
                        id,
                        Some(127),
                        format!(
                            "could not start: the API server refused the worker's Secret \
                             (the executor's role needs create and delete on secrets): {e}"
                        ),
                    );
                    return false;
                }
                Err(e @ CallError::Transient { .. }) => {
                    let wait = retry_delay(attempt, retry_after(&e));
                    tracing::warn!(worker = %id, error = %e, retry_in_s = wait.as_secs_f64(), "secret not created yet");
                    wait
                }
            };
            attempt = attempt.saturating_add(1);
            tokio::time::sleep(wait).await;
        }
        false
    }

    /// Deletes a Pod with `grace_s`, trying again after transient failures
    /// while this generation leads and the worker is in the book.
    async fn delete(self, id: WorkerId, grace_s: i64, generation: u64) {
        let params = DeleteParams {
            grace_period_seconds: Some(u32::try_from(grace_s).unwrap_or(u32::MAX)),
            ..DeleteParams::default()
        };
        let name = pod_name(&id);
        let mut attempt = 0u32;
        loop {
            if !self.book.is_current(generation) || !self.book.contains(&id) {
                return;
            }
            match bounded(self.config.call_timeout, self.pods().delete(&name, &params)).await {
                Ok(_) | Err(CallError::NotFound) => return,
                Err(e @ (CallError::Refused { .. } | CallError::Conflict(_))) => {
                    tracing::error!(worker = %id, error = %e, "the API server refused to delete the pod");
                    return;
                }
                Err(e @ CallError::Transient { .. }) => {
                    let wait = retry_delay(attempt, retry_after(&e));
                    tracing::warn!(worker = %id, error = %e, "pod not deleted yet; trying again");
                    attempt = attempt.saturating_add(1);
                    tokio::time::sleep(wait).await;
                }
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
                let terminating = pod.metadata.deletion_timestamp.is_some();
                let extra = PodWorker {
                    pending_since: Some(now),
                    has_secret: reads_own_secret(pod),
                    // Being deleted already: timed as a stop from now.
                    stop_asked: terminating.then(|| {
                        let grace = pod
                            .metadata
                            .deletion_grace_period_seconds
                            .and_then(|g| u64::try_from(g).ok())
                            .unwrap_or(30);
                        (now, Duration::from_secs(grace))
                    }),
                    ..PodWorker::default()
                };
                let mut w = Worker::running(&node, gpus, extra);
                w.stopping = terminating;
                w
            });
            if entry.exited.is_some() {
                return;
            }
            entry.extra.created = true;
            entry.extra.confirm_when_created = false;
            let running = pod.status.as_ref().and_then(|s| s.phase.as_deref()) == Some("Running");
            match &state {
                // A Pod still Pending is timed by `check_timeouts`.
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
                PodState::NotAdmitted(reason) => {
                    book.record_not_admitted(&id, reason.clone());
                    drop(book);
                    // What the Node offers is looked at again now.
                    self.reprobe.notify_one();
                    return;
                }
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
            PodState::Stuck(_) | PodState::Running | PodState::NotAdmitted(_) => {
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
            (None, PodState::NotAdmitted(reason)) => {
                self.book.lock().record_not_admitted(&id, reason);
            }
            _ => self.record_exit(&id, None, "its pod was deleted".into()),
        }
    }

    /// Follows rank 0's log for progress until the Pod ends or this server
    /// stops leading. The log is read as bytes (a worker may print
    /// anything; lines are decoded lossily), a line at a time; a stream
    /// that ends before the container (the kubelet rotated the file, the
    /// connection broke) is opened again from the last line read.
    async fn follow_progress(self, id: WorkerId, generation: u64) {
        let name = pod_name(&id);
        loop {
            let resume = match self.book.lock().workers.get(&id) {
                Some(w) => w.extra.log_at.clone(),
                None => return,
            };
            let params = LogParams {
                container: Some("worker".into()),
                follow: true,
                timestamps: true,
                since_time: resume.since(),
                ..LogParams::default()
            };
            match bounded(
                self.config.call_timeout,
                self.pods().log_stream(&name, &params),
            )
            .await
            {
                Ok(stream) => {
                    let mut stream = std::pin::pin!(stream);
                    let mut replay = resume.reopened();
                    while let Some(line) = next_line(&mut stream).await {
                        if replay.read_before(&line) {
                            continue;
                        }
                        let mut book = self.book.lock();
                        if !book.is_current(generation) {
                            return;
                        }
                        let Some(w) = book.workers.get_mut(&id) else {
                            return;
                        };
                        let Some(text) = w.extra.log_at.take(&line) else {
                            continue;
                        };
                        let text = String::from_utf8_lossy(text);
                        let Some(sample) = parse_progress_line(&text, self.book.unix_ms()) else {
                            continue;
                        };
                        if w.extra.last_step.is_some_and(|s| sample.step <= s) {
                            continue;
                        }
                        w.extra.last_step = Some(sample.step);
                        book.add_progress(generation, id.job_id, [sample]);
                    }
                }
                Err(e) => {
                    tracing::debug!(worker = %id, error = %e, "log stream not opened")
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
                self.check_timeouts();
                last_check = Instant::now();
            }
            let next = tokio::select! {
                n = stream.try_next() => n,
                _ = tokio::time::sleep(Duration::from_millis(200)) => {
                    if !self.book.is_current(generation) {
                        return;
                    }
                    self.check_timeouts();
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
                    // were deleted while the watch was down. One launched
                    // in the last seconds may have been taken after the
                    // list was: it is asked for by name once its create
                    // was answered.
                    let (gone, to_confirm): (Vec<WorkerId>, Vec<WorkerId>) = {
                        let now = self.book.now();
                        let mut book = self.book.lock();
                        for (id, w) in book.workers.iter_mut() {
                            w.extra.confirm_when_created =
                                w.is_running() && !w.extra.created && !listed.contains(id);
                        }
                        let unlisted = book
                            .workers
                            .iter()
                            .filter(|(id, w)| w.is_running() && !listed.contains(*id));
                        let (old, recent): (Vec<_>, Vec<_>) = unlisted.partition(|(_, w)| {
                            w.extra.pending_since.is_none_or(|t| {
                                now.saturating_duration_since(t) > Duration::from_secs(5)
                            })
                        });
                        (
                            old.into_iter().map(|(id, _)| id.clone()).collect(),
                            recent
                                .into_iter()
                                .filter(|(_, w)| w.extra.created)
                                .map(|(id, _)| id.clone())
                                .collect(),
                        )
                    };
                    for id in gone {
                        self.record_exit(&id, None, "its pod was deleted".into());
                    }
                    for id in to_confirm {
                        tokio::spawn(self.clone().confirm_deleted(id, generation));
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

    /// Records that the API server has taken `id`'s Pod (and asks for it
    /// by name when a list taken meanwhile lacked it).
    fn mark_created(&self, id: &WorkerId, generation: u64) {
        let confirm = match self.book.lock().workers.get_mut(id) {
            Some(w) => {
                w.extra.created = true;
                std::mem::take(&mut w.extra.confirm_when_created)
            }
            None => false,
        };
        if confirm {
            tokio::spawn(self.clone().confirm_deleted(id.clone(), generation));
        }
    }

    /// A Pod the API server had taken and a new list lacks: asked for by
    /// name (a read at the latest version), and recorded as deleted when
    /// it is not there. An error leaves it to the next list.
    async fn confirm_deleted(self, id: WorkerId, generation: u64) {
        let name = pod_name(&id);
        match bounded(self.config.call_timeout, self.pods().get(&name)).await {
            Err(CallError::NotFound) => {
                let still = {
                    let book = self.book.lock();
                    book.is_current(generation)
                        && book.workers.get(&id).is_some_and(|w| w.is_running())
                };
                if still {
                    self.record_exit(&id, None, "its pod was deleted".into());
                }
            }
            Ok(_) => {}
            Err(e) => tracing::debug!(worker = %id, error = %e, "pod not looked up"),
        }
    }

    /// Pods Pending past the timeout (deleted, their workers reported as
    /// not started), and stopped Pods still terminating past their grace
    /// and `terminating_timeout` (reported once, their GPUs kept out of
    /// the Node's offer; given up on when the Node is not Ready; deleted
    /// by force when configured).
    fn check_timeouts(&self) {
        let pending_timeout = self.config.pending_timeout;
        let now = self.book.now();
        let mut stuck_pending = Vec::new();
        let mut newly_stuck = Vec::new();
        let mut lost = Vec::new();
        {
            let mut book = self.book.lock();
            let not_ready = book.shared.not_ready.clone();
            for (id, w) in book.workers.iter_mut() {
                if !w.is_running() {
                    continue;
                }
                if w.extra
                    .pending_since
                    .is_some_and(|t| now.saturating_duration_since(t) > pending_timeout)
                    && !w.stopping
                {
                    stuck_pending.push(id.clone());
                }
                let Some((asked, grace)) = w.extra.stop_asked else {
                    continue;
                };
                if now.saturating_duration_since(asked) <= grace + self.config.terminating_timeout {
                    continue;
                }
                if !w.extra.stuck {
                    w.extra.stuck = true;
                    newly_stuck.push((
                        id.clone(),
                        w.node.clone(),
                        now.saturating_duration_since(asked),
                    ));
                }
                if not_ready.contains(&w.node) {
                    lost.push((id.clone(), w.node.clone()));
                }
            }
        }
        let reason = format!(
            "pending for more than {:.0} s",
            pending_timeout.as_secs_f64()
        );
        for id in stuck_pending {
            self.abandon(&id, &reason);
        }
        for (id, node, waited) in &newly_stuck {
            tracing::warn!(
                worker = %id,
                pod = %pod_name(id),
                node = %node,
                waited_s = waited.as_secs(),
                "pod still terminating past its grace: the kubelet has not confirmed; \
                 its GPUs are not reused on the node until it does or the node is declared lost"
            );
            if self.config.force_delete {
                tracing::warn!(worker = %id, "force-deleting the pod (--k8s-force-delete)");
                tokio::spawn(self.clone().delete(id.clone(), 0, self.book.generation()));
            }
        }
        if !newly_stuck.is_empty() {
            self.reprobe.notify_one();
        }
        for (id, node) in lost {
            self.record_exit(
                &id,
                None,
                format!(
                    "its pod {} is still terminating on node {node}, which is not Ready: \
                     given up on (the kubelet removes it when the node is back)",
                    pod_name(&id)
                ),
            );
        }
    }

    /// A worker whose Pod cannot start: reported as not started, with why,
    /// and its Pod deleted.
    fn abandon(&self, id: &WorkerId, reason: &str) {
        self.record_exit(id, Some(127), format!("could not start: {reason}"));
        tokio::spawn(self.clone().delete(id.clone(), 1, self.book.generation()));
    }

    /// Watches every unfinished Pod in the cluster for those of other
    /// workloads that request GPUs (what they use is not Keel's to offer),
    /// until this server stops leading.
    async fn watch_others(self, generation: u64) {
        let api: Api<Pod> = Api::all(self.client.clone());
        let config =
            watcher::Config::default().fields("status.phase!=Succeeded,status.phase!=Failed");
        let mut stream = watcher(api, config).boxed();
        let mut fresh: Option<BTreeMap<String, (String, u32)>> = None;
        loop {
            let next = tokio::select! {
                n = stream.try_next() => n,
                _ = tokio::time::sleep(Duration::from_millis(500)) => {
                    if !self.book.is_current(generation) {
                        return;
                    }
                    continue;
                }
            };
            let failed = {
                let mut book = self.book.lock();
                if !book.is_current(generation) {
                    return;
                }
                match next {
                    Ok(Some(watcher::Event::Init)) => {
                        fresh = Some(BTreeMap::new());
                        false
                    }
                    Ok(Some(watcher::Event::InitApply(pod))) => {
                        if let (Some(f), Some((key, use_))) = (fresh.as_mut(), self.other_use(&pod))
                        {
                            f.insert(key, use_);
                        }
                        false
                    }
                    Ok(Some(watcher::Event::InitDone)) => {
                        if let Some(f) = fresh.take() {
                            book.shared.others = f;
                        }
                        book.shared.others_unseen = None;
                        false
                    }
                    Ok(Some(watcher::Event::Apply(pod))) => {
                        match self.other_use(&pod) {
                            Some((key, use_)) => {
                                book.shared.others.insert(key, use_);
                            }
                            None => {
                                book.shared.others.remove(&pod_key(&pod));
                            }
                        }
                        false
                    }
                    Ok(Some(watcher::Event::Delete(pod))) => {
                        book.shared.others.remove(&pod_key(&pod));
                        false
                    }
                    Ok(None) => return,
                    Err(e) => {
                        let why = e.to_string();
                        if book.shared.others_unseen.as_deref() != Some(why.as_str()) {
                            tracing::warn!(error = %why, "cannot watch other workloads' pods: their GPUs are not counted");
                            book.shared.others_unseen = Some(why);
                        }
                        true
                    }
                }
            };
            if failed {
                tokio::time::sleep(Duration::from_secs(2)).await;
            }
        }
    }

    /// An unfinished Pod that is not this executor's and requests GPUs on a
    /// Node: its key and (Node, GPUs).
    fn other_use(&self, pod: &Pod) -> Option<(String, (String, u32))> {
        if is_ours(pod, &self.config.namespace) {
            return None;
        }
        let phase = pod.status.as_ref().and_then(|s| s.phase.as_deref());
        if matches!(phase, Some("Succeeded" | "Failed")) {
            return None;
        }
        let node = pod.spec.as_ref()?.node_name.clone()?;
        let gpus = pod_gpus(pod, &self.config.gpu_resource);
        (gpus > 0).then(|| (pod_key(pod), (node, gpus)))
    }

    /// What uses `node`'s GPUs besides Keel's running workers.
    fn node_use(&self, node: &str, book: &crate::book::Book<PodWorker, Cluster>) -> NodeUse {
        let mut usage = NodeUse::default();
        for (key, (on, gpus)) in &book.shared.others {
            if on == node {
                usage.others.push((key.clone(), *gpus));
            }
        }
        for (id, w) in &book.workers {
            if w.node != node {
                continue;
            }
            let indexes = w.gpus.iter().map(|g| g.index);
            if w.stopping && w.extra.stuck && w.is_running() {
                usage.stuck.push((pod_name(id), indexes.collect()));
            } else if !w.stopping {
                usage.held.extend(indexes);
            }
        }
        usage.others_unseen = book.shared.others_unseen.clone();
        usage
    }

    /// Lists Nodes every `node_poll_interval` (or at once when woken) as
    /// their probes, until this server stops leading.
    async fn probe_nodes(self, generation: u64) {
        let nodes: Api<Node> = Api::all(self.client.clone());
        let rules = OfferRules {
            gpu_resource: &self.config.gpu_resource,
            gpu_type_label: &self.config.gpu_type_label,
            tolerations: &self.config.tolerations,
        };
        loop {
            let listing =
                bounded(self.config.call_timeout, nodes.list(&ListParams::default())).await;
            {
                let mut book = self.book.lock();
                if !book.is_current(generation) {
                    return;
                }
                match listing {
                    Ok(list) => {
                        let probes: Vec<NodeProbe> = list
                            .items
                            .iter()
                            .filter_map(|n| {
                                let name = n.metadata.name.as_deref()?;
                                offer(n, &rules, &self.node_use(name, &book))
                            })
                            .collect();
                        let mut listed = BTreeSet::new();
                        let mut not_ready = BTreeSet::new();
                        for p in &probes {
                            match p {
                                NodeProbe::Answered(r) => listed.insert(r.name.clone()),
                                NodeProbe::Unreachable { name, .. } => {
                                    not_ready.insert(name.clone());
                                    listed.insert(name.clone())
                                }
                            };
                        }
                        *self.listed_nodes.lock().unwrap_or_else(|e| e.into_inner()) = listed;
                        book.shared.not_ready = not_ready;
                        for p in probes {
                            book.set_probe(generation, p);
                        }
                    }
                    // A failed listing keeps the last one.
                    Err(e) => tracing::warn!(error = %e, "cannot list nodes"),
                }
            }
            tokio::select! {
                _ = tokio::time::sleep(self.config.node_poll_interval) => {}
                _ = self.reprobe.notified() => {}
            }
        }
    }
}

/// A Pod's `namespace/name`.
fn pod_key(pod: &Pod) -> String {
    format!(
        "{}/{}",
        pod.metadata.namespace.as_deref().unwrap_or(""),
        pod.metadata.name.as_deref().unwrap_or("")
    )
}

/// What the server asked a transient failure to wait.
fn retry_after(e: &CallError) -> Option<Duration> {
    match e {
        CallError::Transient { retry_after, .. } => *retry_after,
        _ => None,
    }
}

/// Why the Kubernetes executor runs no space-sharing policy.
pub const CANNOT_SHARE_GPUS: &str =
    "the Kubernetes executor cannot put two Pods on the same GPUs: \
     the device plugin hands each Pod whole GPUs of its own choosing (time-slicing and MPS \
     replicas are not pinned to a device either); use a policy without space sharing";

impl Executor for KubeExecutor {
    fn kind(&self) -> &'static str {
        "kubernetes"
    }

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
        self.launch_pod(launch);
        Ok(())
    }

    async fn stop(&self, id: &WorkerId, grace: Duration) -> Result<(), ExecutorError> {
        let Some(generation) = self.book.begin_stop(id) else {
            return Ok(());
        };
        let grace_s = grace_seconds(grace, self.config.force_delete);
        if let Some(w) = self.book.lock().workers.get_mut(id) {
            w.extra.stop_asked = Some((
                self.book.now(),
                Duration::from_secs(u64::try_from(grace_s).unwrap_or(0)),
            ));
        }
        // The Pod runs until the kubelet confirms; the watch records the
        // exit then. The delete itself is retried in the background.
        tokio::spawn(self.clone().delete(id.clone(), grace_s, generation));
        Ok(())
    }

    async fn observe(&self) -> Result<BTreeMap<WorkerId, Observed>, ExecutorError> {
        Ok(self.book.observe())
    }

    async fn forget(&self, id: &WorkerId) {
        let (known, has_secret) = self
            .book
            .lock()
            .workers
            .get(id)
            .map_or((false, false), |w| (!w.is_running(), w.extra.has_secret));
        if !known {
            return;
        }
        self.book.forget(id);
        // The exit is in the log: the finished Pod (and the epoch's Service,
        // with rank 0) can go, in the background.
        let (pods, services, secrets) = (self.pods(), self.services(), self.secrets());
        let (name, deadline) = (pod_name(id), self.config.call_timeout);
        let service = (id.rank == 0).then(|| service_name(id.job_id, id.epoch));
        tokio::spawn(async move {
            if let Err(e) = bounded(deadline, pods.delete(&name, &DeleteParams::default())).await {
                if e != CallError::NotFound {
                    tracing::debug!(pod = %name, error = %e, "finished pod not deleted");
                }
            }
            if has_secret {
                if let Err(e) =
                    bounded(deadline, secrets.delete(&name, &DeleteParams::default())).await
                {
                    if e != CallError::NotFound {
                        tracing::warn!(secret = %name, error = %e, "finished worker's secret not deleted");
                    }
                }
            }
            if let Some(svc) = service {
                let _ = bounded(deadline, services.delete(&svc, &DeleteParams::default())).await;
            }
        });
    }

    async fn take_progress(&self) -> BTreeMap<JobId, Vec<ProgressSample>> {
        self.book.take_progress()
    }

    async fn logs(&self, job_id: JobId, tail_bytes: u64) -> Result<Vec<WorkerLog>, ExecutorError> {
        let deadline = self.config.call_timeout;
        let list = bounded(
            deadline,
            self.pods().list(
                &ListParams::default()
                    .labels(&format!("{},{LABEL_JOB}={job_id}", Self::selector())),
            ),
        )
        .await
        .map_err(|e| ExecutorError::Other(e.to_string()))?;
        let keep = usize::try_from(tail_bytes).unwrap_or(usize::MAX);
        let mut out = Vec::new();
        for pod in list.items {
            let Some(id) = worker_of(&pod) else {
                continue;
            };
            let params = LogParams {
                container: Some("worker".into()),
                ..LogParams::default()
            };
            // Bytes, whatever the worker printed; the last `tail_bytes` kept.
            let read = async {
                let mut stream =
                    std::pin::pin!(self.pods().log_stream(&pod_name(&id), &params).await?);
                let (mut tail, mut total) = (Vec::new(), 0u64);
                let mut chunk = vec![0u8; 64 * 1024];
                loop {
                    let n = stream
                        .read(&mut chunk)
                        .await
                        .map_err(kube::Error::ReadEvents)?;
                    if n == 0 {
                        break;
                    }
                    total += n as u64;
                    tail.extend_from_slice(&chunk[..n]);
                    if tail.len() > keep {
                        tail.drain(..tail.len() - keep);
                    }
                }
                Ok::<_, kube::Error>((tail, total))
            };
            let (content, total_bytes) = bounded(deadline, read).await.unwrap_or_default();
            out.push(WorkerLog {
                id,
                content,
                total_bytes,
                paused: None,
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
        tokio::spawn(self.clone().watch_others(generation));
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
                reason: "out of memory: over the container's limit (exited with code 137)".into()
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
