//! The Kubernetes executor against a stand-in API server that serves the
//! real core/v1 paths and shapes (`support/kube_standin.rs`), with the test
//! playing the kubelet; and, opt-in, against a live cluster.

mod support;

use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::{Duration, Instant};

use keel_executors::book::ManualClock;
use keel_executors::contract::{SecretEnv, WorkerLaunch};
use keel_executors::kubernetes::pod_name;
use keel_executors::{Executor, KubeConfig, KubeExecutor, NodeProbe, Observed, WorkerId};
use support::kube_standin::{CreateFault, NodeShape, StandIn};

fn launch(job_id: u64, epoch: u64, rank: u32, world_size: u32) -> WorkerLaunch {
    WorkerLaunch {
        id: WorkerId {
            job_id,
            epoch,
            rank,
        },
        job_name: format!("job{job_id}"),
        command: vec!["python3".into(), "train.py".into()],
        image: Some("registry.example/train:1".into()),
        env: BTreeMap::from([("MINE".to_string(), "x".to_string())]),
        secret_env: BTreeMap::new(),
        node: format!("gpu-{rank}"),
        gpus: vec![0, 1],
        gpu_type: "a100".into(),
        world_size,
        local_rank: 0,
        local_world_size: 1,
        rendezvous_addr: "ignored".into(),
        model: None,
        total_steps: Some(100),
        shared_with: None,
        resources: Default::default(),
        logs: Default::default(),
        trace_parent: None,
    }
}

fn config() -> KubeConfig {
    let mut c = KubeConfig::new("train");
    c.node_poll_interval = Duration::from_millis(100);
    c
}

async fn wait_for<T>(what: &str, mut f: impl AsyncFnMut() -> Option<T>) -> T {
    let deadline = Instant::now() + Duration::from_secs(20);
    loop {
        if let Some(t) = f().await {
            return t;
        }
        assert!(Instant::now() < deadline, "timed out waiting for {what}");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

async fn observed(exec: &KubeExecutor, id: &WorkerId) -> Option<Observed> {
    exec.observe().await.expect("observe").get(id).cloned()
}

async fn wait_exit(exec: &KubeExecutor, id: &WorkerId) -> (Option<i32>, String) {
    wait_for(&format!("{id} to exit"), async || {
        match observed(exec, id).await {
            Some(Observed::Exited { exit_code, reason }) => Some((exit_code, reason)),
            _ => None,
        }
    })
    .await
}

/// Waits for the Pod of `id` (created in the background) and returns it.
async fn created(api: &StandIn, id: &WorkerId) -> serde_json::Value {
    let name = pod_name(id);
    wait_for(&format!("pod {name}"), async || api.pod(&name)).await
}

fn env_of(pod: &serde_json::Value) -> BTreeMap<String, String> {
    pod["spec"]["containers"][0]["env"]
        .as_array()
        .into_iter()
        .flatten()
        .filter_map(|e| {
            Some((
                e["name"].as_str()?.to_string(),
                e["value"].as_str()?.to_string(),
            ))
        })
        .collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn workers_run_as_pinned_pods_with_gpus_labels_the_contract_and_a_rendezvous_service() {
    support::sshd::init_tracing();
    let api = StandIn::start().await;
    let exec = KubeExecutor::new(api.client("train"), config());
    exec.take_over().await;
    let (r0, r1) = (launch(7, 2, 0, 2), launch(7, 2, 1, 2));
    exec.launch(r0.clone()).await.expect("launch");
    exec.launch(r1.clone()).await.expect("launch");
    exec.launch(r0.clone())
        .await
        .expect("a second launch is a no-op");
    let pod = created(&api, &r0.id).await;
    assert_eq!(pod["spec"]["nodeName"], "gpu-0");
    assert_eq!(pod["spec"]["restartPolicy"], "Never");
    assert_eq!(
        pod["spec"]["containers"][0]["resources"]["limits"]["nvidia.com/gpu"],
        "2"
    );
    assert_eq!(
        pod["spec"]["containers"][0]["image"],
        "registry.example/train:1"
    );
    let labels = &pod["metadata"]["labels"];
    assert_eq!(
        (
            &labels["keel.dev/job"],
            &labels["keel.dev/epoch"],
            &labels["keel.dev/rank"]
        ),
        (&"7".into(), &"2".into(), &"0".into())
    );
    let env = env_of(&pod);
    assert_eq!(env["KEEL_JOB_ID"], "7");
    assert_eq!(env["WORLD_SIZE"], "2");
    assert_eq!(env["MINE"], "x");
    assert_eq!(env["MASTER_ADDR"], "keel-j7-e2.train.svc");
    assert_eq!(env["MASTER_PORT"], "29500");
    assert_eq!(env["KEEL_CHECKPOINT_DIR"], "/keel/checkpoints/job-7");
    assert!(
        !env.contains_key("CUDA_VISIBLE_DEVICES"),
        "the device plugin sets it"
    );
    assert_eq!(env_of(&created(&api, &r1.id).await)["RANK"], "1");
    let svc = api.service("keel-j7-e2").expect("headless service");
    assert_eq!(svc["spec"]["clusterIP"], "None");
    assert_eq!(svc["spec"]["selector"]["keel.dev/rank"], "0");

    // Pending, then running: both are "running" to the reconciler.
    let name = pod_name(&r0.id);
    wait_for("the watch to see the pod", async || {
        matches!(
            observed(&exec, &r0.id).await,
            Some(Observed::Running { .. })
        )
        .then_some(())
    })
    .await;
    api.run(&name);
    api.run(&pod_name(&r1.id));
    api.log(
        &name,
        "starting\nKEEL_PROGRESS {\"step\": 10, \"total_steps\": 100}\n",
    );
    api.log(&name, "KEEL_PROGRESS {\"step\": 20}\nnoise\n");
    let steps = wait_for("progress from rank 0's log", async || {
        let p = exec.take_progress().await.remove(&7)?;
        Some(p.iter().map(|s| s.step).collect::<Vec<_>>())
    })
    .await;
    let mut all = steps;
    api.exit(&name, 0);
    api.exit(&pod_name(&r1.id), 3);
    assert_eq!(wait_exit(&exec, &r0.id).await.0, Some(0));
    let (code, reason) = wait_exit(&exec, &r1.id).await;
    assert_eq!(code, Some(3));
    assert!(reason.contains("exited with code 3"), "{reason}");
    if let Some(p) = exec.take_progress().await.remove(&7) {
        all.extend(p.iter().map(|s| s.step));
    }
    assert_eq!(all, vec![10, 20]);
    let logs = exec.logs(7, 1 << 16).await.expect("logs");
    assert_eq!(logs.len(), 2);
    assert!(String::from_utf8_lossy(&logs[0].content).contains("starting"));
    // Once the exits are recorded, the pods and the service go.
    exec.forget(&r0.id).await;
    exec.forget(&r1.id).await;
    wait_for("the finished pods and the service to go", async || {
        (api.pod_names().is_empty() && api.service("keel-j7-e2").is_none()).then_some(())
    })
    .await;
}

/// A variable opened from a secret (issue 35), as the leader hands it to
/// the executor.
fn with_secret(name: &str, value: &str) -> BTreeMap<String, SecretEnv> {
    BTreeMap::from([(
        name.to_string(),
        SecretEnv {
            reference: keel_state::secret::SecretRef {
                name: "tracker".into(),
                key: "api_key".into(),
            },
            sealed: None,
            value: Some(value.into()),
        },
    )])
}

/// Issue 35: a worker's variable from a secret is in a Secret of its own,
/// read by the Pod through `secretKeyRef`: the Pod holds no value. The
/// Secret goes with the finished worker, and a new leader that finds the
/// Pod deletes it too.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_workers_secret_is_a_secret_object_the_pod_refers_to_and_goes_with_it() {
    const VALUE: &str = "k8s-tracker-credential-91c4";
    let api = StandIn::start().await;
    let exec = KubeExecutor::new(api.client("train"), config());
    exec.take_over().await;
    let mut l = launch(5, 1, 0, 1);
    l.secret_env = with_secret("TRACKER_KEY", VALUE);
    exec.launch(l.clone()).await.expect("launch");
    let pod = created(&api, &l.id).await;
    let name = pod_name(&l.id);
    assert!(
        !pod.to_string().contains(VALUE),
        "the pod holds the value: {pod}"
    );
    assert!(!env_of(&pod).contains_key("TRACKER_KEY"));
    let from = pod["spec"]["containers"][0]["env"]
        .as_array()
        .into_iter()
        .flatten()
        .find(|e| e["name"] == "TRACKER_KEY")
        .cloned()
        .expect("the variable");
    assert_eq!(
        from["valueFrom"]["secretKeyRef"],
        serde_json::json!({"name": name, "key": "TRACKER_KEY", "optional": false})
    );
    assert_eq!(env_of(&pod)["MINE"], "x", "plain variables stay");
    let secret = api
        .secret(&name)
        .expect("the worker's secret, made before its pod");
    let posts: Vec<String> = api
        .requests()
        .into_iter()
        .filter(|r| r.starts_with("POST"))
        .collect();
    assert_eq!(
        posts,
        [format!("POST secrets {name}"), format!("POST pods {name}")]
    );
    let stored: k8s_openapi::api::core::v1::Secret =
        serde_json::from_value(secret.clone()).expect("a Secret");
    assert_eq!(
        stored
            .data
            .as_ref()
            .and_then(|d| d.get("TRACKER_KEY"))
            .map(|b| b.0.as_slice()),
        Some(VALUE.as_bytes())
    );
    assert_eq!(secret["metadata"]["labels"]["keel.dev/job"], "5");

    // A new leader finds the pod, and deletes its secret with it.
    exec.release().await;
    let next = KubeExecutor::new(api.client("train"), config());
    next.take_over().await;
    wait_for("the new leader to find the pod", async || {
        matches!(observed(&next, &l.id).await, Some(Observed::Running { .. })).then_some(())
    })
    .await;
    api.run(&name);
    api.exit(&name, 0);
    assert_eq!(wait_exit(&next, &l.id).await.0, Some(0));
    next.forget(&l.id).await;
    wait_for("the pod and its secret to go", async || {
        (api.pod(&name).is_none() && api.secret(&name).is_none()).then_some(())
    })
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn stop_deletes_with_the_grace_period_and_bad_pods_become_exits_with_reasons() {
    let api = StandIn::start().await;
    let mut c = config();
    c.pending_timeout = Duration::from_secs(300);
    // The pending timeout is measured on the executor's clock, moved below.
    let clock = Arc::new(ManualClock::new(1_700_000_000_000));
    let exec = KubeExecutor::with_clock(api.client("train"), c, clock.clone());
    exec.take_over().await;
    let running = launch(1, 1, 0, 1);
    exec.launch(running.clone()).await.expect("launch");
    created(&api, &running.id).await;
    api.run(&pod_name(&running.id));
    wait_for("running", async || {
        matches!(
            observed(&exec, &running.id).await,
            Some(Observed::Running { .. })
        )
        .then_some(())
    })
    .await;
    exec.stop(&running.id, Duration::from_secs(7))
        .await
        .expect("stop");
    let (code, reason) = wait_exit(&exec, &running.id).await;
    assert_eq!(code, Some(143));
    assert!(reason.contains("stopped by keel"), "{reason}");
    assert!(
        api.requests()
            .iter()
            .any(|r| r == "DELETE pods keel-j1-e1-r0 grace=7"),
        "{:?}",
        api.requests()
    );

    // An image that does not exist.
    let bad_image = launch(2, 1, 0, 1);
    exec.launch(bad_image.clone()).await.expect("launch");
    created(&api, &bad_image.id).await;
    api.wait(
        &pod_name(&bad_image.id),
        "ErrImagePull",
        "rpc error: registry.example/train:1 not found",
    );
    let (code, reason) = wait_exit(&exec, &bad_image.id).await;
    assert_eq!(code, Some(127));
    assert!(
        reason.contains("ErrImagePull") && reason.contains("not found"),
        "{reason}"
    );
    wait_for("the stuck pod to be deleted", async || {
        api.pod(&pod_name(&bad_image.id)).is_none().then_some(())
    })
    .await;

    // A pod stuck Pending (the kubelet never starts it).
    let stuck = launch(3, 1, 0, 1);
    exec.launch(stuck.clone()).await.expect("launch");
    created(&api, &stuck.id).await;
    assert!(matches!(
        observed(&exec, &stuck.id).await,
        Some(Observed::Running { .. })
    ));
    clock.advance(Duration::from_secs(301));
    let (code, reason) = wait_exit(&exec, &stuck.id).await;
    assert_eq!(code, Some(127));
    assert!(reason.contains("pending for more than 300 s"), "{reason}");

    // An API server that is briefly unavailable: the pod is created once it
    // answers; one that forbids it (a quota): an exit with its message.
    api.refuse_creates(&[503, 503]);
    let retried = launch(5, 1, 0, 1);
    exec.launch(retried.clone())
        .await
        .expect("launch returns at once");
    wait_for("the pod after two refusals", async || {
        api.pod(&pod_name(&retried.id))
    })
    .await;
    assert!(matches!(
        observed(&exec, &retried.id).await,
        Some(Observed::Running { .. })
    ));
    api.refuse_creates(&[403]);
    let forbidden = launch(6, 1, 0, 1);
    exec.launch(forbidden.clone()).await.expect("launch");
    let (code, reason) = wait_exit(&exec, &forbidden.id).await;
    assert_eq!(code, Some(127));
    assert!(reason.contains("exceeded quota"), "{reason}");

    // No image and no default image.
    let mut no_image = launch(4, 1, 0, 1);
    no_image.image = None;
    exec.launch(no_image.clone()).await.expect("launch");
    let (code, reason) = wait_exit(&exec, &no_image.id).await;
    assert_eq!(code, Some(127));
    assert!(reason.contains("needs an image"), "{reason}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_new_leader_re_adopts_pods_by_label_and_reports_what_ended_meanwhile() {
    let api = StandIn::start().await;
    let first = KubeExecutor::new(api.client("train"), config());
    first.take_over().await;
    let (long, short) = (launch(1, 1, 0, 1), launch(2, 1, 0, 1));
    first.launch(long.clone()).await.expect("launch");
    first.launch(short.clone()).await.expect("launch");
    created(&api, &long.id).await;
    created(&api, &short.id).await;
    api.run(&pod_name(&long.id));
    api.run(&pod_name(&short.id));
    first.release().await;
    // While no leader watches: one ends.
    api.exit(&pod_name(&short.id), 5);
    let next = KubeExecutor::new(api.client("train"), config());
    next.take_over().await;
    let seen = wait_for("both pods found", async || {
        let seen = next.observe().await.expect("observe");
        (seen.len() == 2).then_some(seen)
    })
    .await;
    match &seen[&long.id] {
        Observed::Running { gpus } => {
            assert_eq!(
                gpus.iter()
                    .map(|g| (g.node.as_str(), g.index))
                    .collect::<Vec<_>>(),
                vec![("gpu-0", 0), ("gpu-0", 1)]
            );
        }
        o => panic!("{o:?}"),
    }
    assert!(matches!(
        &seen[&short.id],
        Observed::Exited {
            exit_code: Some(5),
            ..
        }
    ));
    // Launching the adopted worker creates nothing.
    let posts = api
        .requests()
        .iter()
        .filter(|r| r.starts_with("POST pods"))
        .count();
    next.launch(long.clone()).await.expect("launch");
    assert_eq!(
        api.requests()
            .iter()
            .filter(|r| r.starts_with("POST pods"))
            .count(),
        posts
    );
    // A pod deleted behind Keel's back is an exit.
    api.exit(&pod_name(&long.id), 0);
    assert_eq!(wait_exit(&next, &long.id).await.0, Some(0));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn gpu_nodes_are_probed_from_node_objects() {
    let api = StandIn::start().await;
    api.add_node("gpu-a", 4, "NVIDIA-A100-SXM4-80GB", true);
    api.add_node("gpu-b", 8, "Tesla-V100-SXM2-16GB", false);
    api.add_node("cpu-only", 0, "", true);
    let exec = KubeExecutor::new(api.client("train"), config());
    exec.take_over().await;
    let probes = wait_for("node probes", async || {
        let p = exec.take_node_probes().await;
        (p.len() == 2).then_some(p)
    })
    .await;
    for p in probes {
        match p {
            NodeProbe::Answered(r) => {
                assert_eq!(r.name, "gpu-a");
                assert_eq!(r.gpus.len(), 4);
                assert!(r.gpus.iter().all(|g| g.gpu_type == "a100"), "{r:?}");
                assert!(r.address.starts_with("10.0.0."), "{r:?}");
            }
            NodeProbe::Unreachable { name, reason } => {
                assert_eq!(name, "gpu-b");
                assert!(
                    reason.contains("not Ready") && reason.contains("runtime is down"),
                    "{reason}"
                );
            }
        }
    }
}

/// The RBAC manifest grants exactly the (resource, verb) pairs the executor
/// uses: every call of a run that launches a two-worker job, follows its
/// log, reads its logs, stops one worker, forgets both and lists Nodes.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_rbac_manifest_grants_exactly_what_the_executor_calls() {
    let api = StandIn::start().await;
    api.add_node("gpu-0", 2, "NVIDIA-A100-SXM4-80GB", true);
    let exec = KubeExecutor::new(api.client("train"), config());
    exec.take_over().await;
    let (mut r0, r1) = (launch(1, 1, 0, 2), launch(1, 1, 1, 2));
    // A worker with a variable from a secret: its Secret is made and
    // deleted.
    r0.secret_env = with_secret("TRACKER_KEY", "v");
    // One create is taken but answered 504: the retry's 409 reads the pod.
    api.fail_creates(&[CreateFault::PersistedButTimedOut]);
    exec.launch(r0.clone()).await.expect("launch");
    exec.launch(r1.clone()).await.expect("launch");
    created(&api, &r0.id).await;
    created(&api, &r1.id).await;
    wait_for("the 409 check", async || {
        api.requests()
            .iter()
            .any(|r| r.starts_with("GET pods"))
            .then_some(())
    })
    .await;
    api.run(&pod_name(&r0.id));
    api.run(&pod_name(&r1.id));
    wait_for("a node probe", async || {
        (!exec.take_node_probes().await.is_empty()).then_some(())
    })
    .await;
    wait_for("the log follower", async || {
        api.requests()
            .iter()
            .any(|r| r.starts_with("LOG"))
            .then_some(())
    })
    .await;
    exec.logs(1, 1024).await.expect("logs");
    exec.stop(&r1.id, Duration::from_secs(1))
        .await
        .expect("stop");
    api.exit(&pod_name(&r0.id), 0);
    wait_exit(&exec, &r0.id).await;
    wait_exit(&exec, &r1.id).await;
    exec.forget(&r0.id).await;
    exec.forget(&r1.id).await;
    wait_for(
        "the finished pods, the service and the secret to go",
        async || {
            (api.pod_names().is_empty()
                && api.service("keel-j1-e1").is_none()
                && api.secret(&pod_name(&r0.id)).is_none())
            .then_some(())
        },
    )
    .await;
    let used = api.rbac_uses();

    let text = std::fs::read_to_string(
        std::path::Path::new(env!("CARGO_MANIFEST_DIR"))
            .join("../deploy/kubernetes/base/rbac.yaml"),
    )
    .expect("deploy/kubernetes/base/rbac.yaml");
    let mut granted = std::collections::BTreeSet::new();
    let docs: Vec<serde_json::Value> = serde_saphyr::from_multiple(&text).expect("yaml");
    for doc in docs {
        let scope = match doc["kind"].as_str() {
            Some("Role") => "namespace",
            Some("ClusterRole") => "cluster",
            _ => continue,
        };
        for rule in doc["rules"].as_array().into_iter().flatten() {
            for resource in rule["resources"].as_array().into_iter().flatten() {
                for verb in rule["verbs"].as_array().into_iter().flatten() {
                    granted.insert((
                        scope.to_string(),
                        resource.as_str().unwrap_or("").to_string(),
                        verb.as_str().unwrap_or("").to_string(),
                    ));
                }
            }
        }
    }
    assert_eq!(granted, used, "granted vs used");
}

/// Opt-in: `KEEL_K8S_LIVE=1` with a kubeconfig (or in a cluster) runs one
/// busybox worker on the first Ready node, without GPUs, in namespace
/// `KEEL_K8S_NAMESPACE` (default `default`), and checks its progress and
/// exit. See the README's "Kubernetes executor".
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn live_cluster_runs_a_worker_when_asked() {
    if std::env::var("KEEL_K8S_LIVE").as_deref() != Ok("1") {
        return;
    }
    let namespace = std::env::var("KEEL_K8S_NAMESPACE").unwrap_or_else(|_| "default".into());
    let config = kube::Config::infer()
        .await
        .expect("a kubeconfig or in-cluster config");
    let client = keel_executors::kubernetes::calls::client(config).expect("client");
    let nodes: kube::Api<k8s_openapi::api::core::v1::Node> = kube::Api::all(client.clone());
    let node = nodes
        .list(&Default::default())
        .await
        .expect("list nodes")
        .items
        .into_iter()
        .find_map(|n| n.metadata.name)
        .expect("a node");
    let exec = KubeExecutor::new(client, KubeConfig::new(&namespace));
    exec.take_over().await;
    let mut l = launch(u64::from(std::process::id()), 1, 0, 1);
    l.node = node;
    l.gpus = vec![];
    l.image = Some("busybox:1.36".into());
    l.command = vec![
        "sh".into(),
        "-c".into(),
        "for s in 1 2 3; do echo \"KEEL_PROGRESS {\\\"step\\\": $s}\"; sleep 1; done".into(),
    ];
    let steps = run_live(&exec, &l, Duration::from_secs(300)).await;
    assert_eq!(steps, vec![1, 2, 3]);
    exec.forget(&l.id).await;
    if std::env::var("KEEL_K8S_LIVE_GPU").as_deref() == Ok("1") {
        live_gpu_worker_sees_one_gpu(&exec, &nodes).await;
    }
}

/// Runs `l` on a live cluster to its end (within `limit`), checks it
/// exited 0, and returns the steps it reported.
async fn run_live(exec: &KubeExecutor, l: &WorkerLaunch, limit: Duration) -> Vec<u64> {
    exec.launch(l.clone()).await.expect("launch");
    let deadline = Instant::now() + limit;
    let (code, reason) = loop {
        if let Some(Observed::Exited { exit_code, reason }) = observed(exec, &l.id).await {
            break (exit_code, reason);
        }
        assert!(
            Instant::now() < deadline,
            "the live pod did not finish in {limit:?}"
        );
        tokio::time::sleep(Duration::from_millis(500)).await;
    };
    assert_eq!(code, Some(0), "{reason}");
    exec.take_progress()
        .await
        .remove(&l.id.job_id)
        .unwrap_or_default()
        .iter()
        .map(|s| s.step)
        .collect()
}

/// Opt-in (`KEEL_K8S_LIVE_GPU=1`, with the live test): a one-GPU worker on
/// a node the NVIDIA device plugin serves runs `nvidia-smi -L` and reports
/// how many GPUs it sees as its step; it must see exactly one.
async fn live_gpu_worker_sees_one_gpu(
    exec: &KubeExecutor,
    nodes: &kube::Api<k8s_openapi::api::core::v1::Node>,
) {
    let node = nodes
        .list(&Default::default())
        .await
        .expect("list nodes")
        .items
        .into_iter()
        .find(|n| {
            n.status
                .as_ref()
                .and_then(|s| s.allocatable.as_ref()?.get("nvidia.com/gpu"))
                .and_then(|q| q.0.parse::<u32>().ok())
                .is_some_and(|g| g > 0)
        })
        .and_then(|n| n.metadata.name)
        .expect("a node with allocatable nvidia.com/gpu (the device plugin)");
    let mut l = launch(u64::from(std::process::id()) + 1, 1, 0, 1);
    l.node = node;
    l.gpus = vec![0];
    l.image = Some(
        std::env::var("KEEL_K8S_GPU_IMAGE")
            .unwrap_or_else(|_| "nvcr.io/nvidia/cuda:12.4.1-base-ubuntu22.04".into()),
    );
    l.command = vec![
        "sh".into(),
        "-c".into(),
        "n=$(nvidia-smi -L | grep -c '^GPU'); echo \"KEEL_PROGRESS {\\\"step\\\": $n}\"".into(),
    ];
    let steps = run_live(exec, &l, Duration::from_secs(600)).await;
    assert_eq!(steps, vec![1], "the worker sees exactly its one GPU");
    exec.forget(&l.id).await;
}

fn probes_by_name(probes: Vec<NodeProbe>) -> BTreeMap<String, NodeProbe> {
    probes
        .into_iter()
        .map(|p| match &p {
            NodeProbe::Answered(r) => (r.name.clone(), p),
            NodeProbe::Unreachable { name, .. } => (name.clone(), p),
        })
        .collect()
}

/// Waits for a probe of `node` that `accept` takes.
async fn probe_of(
    exec: &KubeExecutor,
    node: &str,
    mut accept: impl FnMut(&NodeProbe) -> bool,
) -> NodeProbe {
    wait_for(&format!("a probe of {node}"), async || {
        probes_by_name(exec.take_node_probes().await)
            .remove(node)
            .filter(|p| accept(p))
    })
    .await
}

fn offered(p: &NodeProbe) -> (usize, String) {
    match p {
        NodeProbe::Answered(r) => (r.gpus.len(), r.note.clone()),
        NodeProbe::Unreachable { reason, .. } => (0, reason.clone()),
    }
}

/// Issue 30, item 1: a Pod the kubelet rejects (no free device) is
/// reported as not admitted, which spends no retry, with the kubelet's
/// message; and the node's offer is corrected at once.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_pod_the_kubelet_does_not_admit_is_not_the_jobs_failure_and_the_node_offers_less() {
    let api = StandIn::start().await;
    api.add_node("gpu-0", 4, "NVIDIA-A100-SXM4-80GB", true);
    let exec = KubeExecutor::new(api.client("train"), config());
    exec.take_over().await;
    probe_of(&exec, "gpu-0", |p| offered(p).0 == 4).await;
    // Another tenant takes three GPUs before Keel's view catches up.
    api.add_tenant_pod("team-b", "bert-0", "gpu-0", 3);
    let l = launch(1, 1, 0, 1);
    exec.launch(l.clone()).await.expect("launch");
    let reason = wait_for("not admitted", async || {
        match observed(&exec, &l.id).await {
            Some(Observed::NotAdmitted { reason }) => Some(reason),
            Some(o @ Observed::Exited { .. }) => panic!("counted as the job's exit: {o:?}"),
            _ => None,
        }
    })
    .await;
    assert!(
        reason.starts_with("could not start")
            && reason.contains("UnexpectedAdmissionError")
            && reason.contains("Requested: 2, Available: 1"),
        "{reason}"
    );
    // Until its exit is recorded the job holds its GPUs in the log, so the
    // offer keeps them; once recorded (the reconciler forgets it), the
    // node offers what is free.
    exec.forget(&l.id).await;
    let p = probe_of(&exec, "gpu-0", |p| offered(p).0 == 1).await;
    let (_, note) = offered(&p);
    assert!(
        note.contains("offers 1 of 4")
            && note.contains("3 requested by other workloads (team-b/bert-0)"),
        "{note}"
    );
}

/// Issue 30, item 2: a node offers its allocatable GPUs less what other
/// tenants' Pods request; cordoned and NoSchedule-tainted nodes take no
/// new workers, a NoExecute taint makes it unreachable, and tolerations
/// configured lift both.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn gpus_offered_are_allocatable_less_other_tenants_and_closed_nodes_take_none() {
    let api = StandIn::start().await;
    let shaped = |allocatable, taints: &[(&str, &str, &str)], unschedulable| NodeShape {
        allocatable,
        taints: taints
            .iter()
            .map(|(k, v, e)| (k.to_string(), v.to_string(), e.to_string()))
            .collect(),
        unschedulable,
    };
    api.add_node_shaped(
        "a",
        8,
        "NVIDIA-A100-SXM4-80GB",
        true,
        shaped(Some(7), &[], false),
    );
    api.add_node_shaped(
        "b",
        4,
        "NVIDIA-A100-SXM4-80GB",
        true,
        shaped(None, &[], true),
    );
    api.add_node_shaped(
        "c",
        4,
        "NVIDIA-A100-SXM4-80GB",
        true,
        shaped(None, &[("maintenance", "kernel", "NoExecute")], false),
    );
    api.add_node_shaped(
        "d",
        4,
        "NVIDIA-A100-SXM4-80GB",
        true,
        shaped(None, &[("dedicated", "training", "NoSchedule")], false),
    );
    api.add_tenant_pod("team-b", "bert-0", "a", 2);
    api.add_tenant_pod("team-b", "bert-1", "a", 1);
    let mut c = config();
    c.tolerations =
        vec![KubeConfig::parse_toleration("dedicated=training:NoSchedule").expect("toleration")];
    let exec = KubeExecutor::new(api.client("train"), c);
    exec.take_over().await;
    let a = probe_of(&exec, "a", |p| offered(p).0 == 4).await;
    let (_, note) = offered(&a);
    assert!(
        note.contains("1 not allocatable") && note.contains("3 requested by other workloads"),
        "{note}"
    );
    let b = probe_of(&exec, "b", |_| true).await;
    assert_eq!(offered(&b).0, 0);
    assert!(offered(&b).1.contains("cordoned"), "{:?}", offered(&b));
    match probe_of(&exec, "c", |_| true).await {
        NodeProbe::Unreachable { reason, .. } => {
            assert!(reason.contains("maintenance=kernel:NoExecute"), "{reason}")
        }
        p => panic!("{p:?}"),
    }
    let d = probe_of(&exec, "d", |_| true).await;
    assert_eq!(offered(&d), (4, String::new()), "tolerated");
    // A tenant finishes: its GPUs are offered again.
    api.finish_tenant_pod("team-b", "bert-0");
    probe_of(&exec, "a", |p| offered(p).0 == 6).await;
}

/// Issue 30, item 3: a stop asks for its grace rounded up (never a force
/// delete), the worker runs until the kubelet confirms; a Pod stuck
/// Terminating past its grace and the bound keeps its GPUs out of the
/// node's offer, and is given up on once the node is not Ready.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_stop_waits_for_the_kubelet_and_a_pod_stuck_terminating_is_reported() {
    let api = StandIn::start().await;
    api.add_node("gpu-0", 4, "NVIDIA-A100-SXM4-80GB", true);
    let clock = Arc::new(ManualClock::new(1_700_000_000_000));
    let exec = KubeExecutor::with_clock(api.client("train"), config(), clock.clone());
    exec.take_over().await;
    let l = launch(1, 1, 0, 1);
    exec.launch(l.clone()).await.expect("launch");
    created(&api, &l.id).await;
    api.run(&pod_name(&l.id));
    wait_for("running", async || {
        matches!(observed(&exec, &l.id).await, Some(Observed::Running { .. })).then_some(())
    })
    .await;
    api.kubelet_gone("gpu-0");
    exec.stop(&l.id, Duration::from_millis(500))
        .await
        .expect("stop");
    wait_for("the pod to be terminating", async || {
        api.pod(&pod_name(&l.id))
            .filter(|p| !p["metadata"]["deletionTimestamp"].is_null())
    })
    .await;
    assert!(
        api.requests()
            .iter()
            .any(|r| r == "DELETE pods keel-j1-e1-r0 grace=1"),
        "0.5 s is asked as 1 s, not 0 (a force delete): {:?}",
        api.requests()
    );
    // Past its grace and the bound: its GPUs are out of the offer.
    clock.advance(Duration::from_secs(62));
    let p = probe_of(&exec, "gpu-0", |p| offered(p).0 == 2).await;
    assert!(
        offered(&p)
            .1
            .contains("held by Keel pods still terminating (keel-j1-e1-r0)"),
        "{p:?}"
    );
    assert!(
        matches!(observed(&exec, &l.id).await, Some(Observed::Running { .. })),
        "not reported ended while its containers may hold the GPUs"
    );
    // The node goes NotReady: given up on, with why.
    api.add_node("gpu-0", 4, "NVIDIA-A100-SXM4-80GB", false);
    let (code, reason) = wait_exit(&exec, &l.id).await;
    assert_eq!(code, None);
    assert!(
        reason.contains("still terminating on node gpu-0, which is not Ready"),
        "{reason}"
    );
}

/// Issue 30, item 4: a create that hangs holds no other launch or stop; a
/// 429's Retry-After is waited; a 500 from a webhook is retried; a 504 for
/// a create that was taken finds this worker's Pod; a Pod of the same name
/// that is not this worker's is a conflict reported as its exit.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_overloaded_api_server_holds_no_other_launch_and_its_retry_after_is_waited() {
    let api = StandIn::start().await;
    let mut c = config();
    c.call_timeout = Duration::from_secs(1);
    let exec = KubeExecutor::new(api.client("train"), c);
    exec.take_over().await;
    let running = launch(9, 1, 0, 1);
    exec.launch(running.clone()).await.expect("launch");
    created(&api, &running.id).await;
    api.run(&pod_name(&running.id));

    let (slow, other) = (launch(1, 1, 0, 1), launch(2, 1, 0, 1));
    api.stall_creates(&pod_name(&slow.id));
    exec.launch(slow.clone())
        .await
        .expect("launch returns at once");
    wait_for("the create to hang", async || {
        (api.stalled_now() > 0).then_some(())
    })
    .await;
    exec.launch(other.clone()).await.expect("launch");
    exec.stop(&running.id, Duration::from_secs(1))
        .await
        .expect("stop");
    created(&api, &other.id).await;
    wait_for("the stop's delete", async || {
        api.requests()
            .iter()
            .any(|r| r.starts_with("DELETE pods keel-j9-e1-r0"))
            .then_some(())
    })
    .await;
    assert!(api.pod(&pod_name(&slow.id)).is_none(), "still hanging");
    api.release_creates();
    created(&api, &slow.id).await;

    // 429 with Retry-After: 2, then a webhook's 500, then taken.
    api.fail_creates(&[CreateFault::TooManyRequests(2), CreateFault::Webhook]);
    let throttled = launch(3, 1, 0, 1);
    exec.launch(throttled.clone()).await.expect("launch");
    created(&api, &throttled.id).await;
    let times = api.create_times(&pod_name(&throttled.id));
    assert_eq!(times.len(), 3, "429, 500, then created");
    assert!(
        times[1].duration_since(times[0]) >= Duration::from_secs(2),
        "the retry came before the server's Retry-After"
    );

    // Taken but answered 504: the retry's 409 finds this worker's pod.
    api.fail_creates(&[CreateFault::PersistedButTimedOut]);
    let persisted = launch(4, 1, 0, 1);
    exec.launch(persisted.clone()).await.expect("launch");
    created(&api, &persisted.id).await;
    wait_for("the 409 check", async || {
        api.requests()
            .iter()
            .any(|r| r == "GET pods keel-j4-e1-r0")
            .then_some(())
    })
    .await;
    api.run(&pod_name(&persisted.id));
    api.exit(&pod_name(&persisted.id), 0);
    assert_eq!(wait_exit(&exec, &persisted.id).await.0, Some(0));

    // A pod of the same name that someone else made.
    api.add_tenant_pod("train", "keel-j5-e1-r0", "gpu-0", 0);
    let clash = launch(5, 1, 0, 1);
    exec.launch(clash.clone()).await.expect("launch");
    let (code, reason) = wait_exit(&exec, &clash.id).await;
    assert_eq!(code, Some(127));
    assert!(
        reason.contains("exists that is not this worker's"),
        "{reason}"
    );
}

/// Issue 30, item 5: a 4 KiB termination message is cut to fit the log
/// (never refused and relaunched); rank 0's log is read as bytes (invalid
/// UTF-8 decoded lossily), and a follow ended by rotation resumes after the
/// last line read, every step reported once.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn long_messages_are_cut_and_logs_are_bytes_that_rotate() {
    let api = StandIn::start().await;
    let exec = KubeExecutor::new(api.client("train"), config());
    exec.take_over().await;
    let l = launch(1, 1, 0, 1);
    let name = pod_name(&l.id);
    exec.launch(l.clone()).await.expect("launch");
    created(&api, &l.id).await;
    api.run(&name);
    api.log(&name, "KEEL_PROGRESS {\"step\": 1}\n");
    api.log_bytes(&name, b"\xff\xfe not text \xc3\x28\n");
    api.log(&name, "KEEL_PROGRESS {\"step\": 2}\n");
    let mut steps = Vec::new();
    wait_for("steps 1 and 2", async || {
        if let Some(p) = exec.take_progress().await.remove(&1) {
            steps.extend(p.iter().map(|s| s.step));
        }
        (steps.len() >= 2).then_some(())
    })
    .await;
    let logs = exec.logs(1, 1 << 16).await.expect("logs");
    assert!(logs[0].content.contains(&b'\xff'), "bytes kept as they are");
    api.rotate_log(&name);
    api.log(
        &name,
        "KEEL_PROGRESS {\"step\": 3}\nKEEL_PROGRESS {\"step\": 4}\n",
    );
    wait_for("steps 3 and 4 after the rotation", async || {
        if let Some(p) = exec.take_progress().await.remove(&1) {
            steps.extend(p.iter().map(|s| s.step));
        }
        (steps.len() >= 4).then_some(())
    })
    .await;
    assert_eq!(steps, vec![1, 2, 3, 4]);
    assert!(
        api.requests()
            .iter()
            .any(|r| r.starts_with("LOG keel-j1-e1-r0 follow=true since=")),
        "resumed from the last line's time: {:?}",
        api.requests()
    );
    let message = "x".repeat(4096);
    api.exit_with_message(&name, 1, Some(&message));
    let (code, reason) = wait_exit(&exec, &l.id).await;
    assert_eq!(code, Some(1));
    assert!(
        reason.len() <= 4096
            && reason.ends_with("[... cut to fit]")
            && reason.starts_with("exited with code 1"),
        "{} bytes: {}",
        reason.len(),
        &reason[..60]
    );
}

/// Issue 30, item 6: watches that end, resume from a compacted version
/// (410 Expired, a fresh list) and carry bookmarks; a Pod removed while no
/// watch saw it is an exit; one created afterwards is still followed.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn watches_survive_expiry_bookmarks_and_deletions_while_down() {
    support::sshd::init_tracing();
    let api = StandIn::start().await;
    let exec = KubeExecutor::new(api.client("train"), config());
    exec.take_over().await;
    let l = launch(1, 1, 0, 1);
    exec.launch(l.clone()).await.expect("launch");
    created(&api, &l.id).await;
    api.run(&pod_name(&l.id));
    wait_for("running", async || {
        matches!(observed(&exec, &l.id).await, Some(Observed::Running { .. })).then_some(())
    })
    .await;
    // The pod goes while the watch is down, and the history is compacted.
    api.vanish(&pod_name(&l.id));
    api.compact();
    api.end_watches();
    let (code, reason) = wait_exit(&exec, &l.id).await;
    assert_eq!(code, None);
    assert!(reason.contains("its pod was deleted"), "{reason}");
    assert!(
        api.requests()
            .iter()
            .filter(|r| r.starts_with("LIST pods train"))
            .count()
            >= 2,
        "re-listed after the 410: {:?}",
        api.requests()
    );
    let watches: Vec<String> = api
        .requests()
        .into_iter()
        .filter(|r| r.starts_with("WATCH pods train"))
        .collect();
    assert!(
        watches.iter().all(|w| w.ends_with("bookmarks=true")),
        "the watches ask for bookmarks: {watches:?}"
    );
    let next = launch(2, 1, 0, 1);
    exec.launch(next.clone()).await.expect("launch");
    created(&api, &next.id).await;
    api.run(&pod_name(&next.id));
    api.exit(&pod_name(&next.id), 0);
    assert_eq!(wait_exit(&exec, &next.id).await.0, Some(0));
}

/// A Pod deleted while the watch is down in the seconds after its launch
/// (still Pending, its create answered) is an exit once the watch is back,
/// not only after the pending timeout.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_pod_deleted_while_down_just_after_its_launch_is_an_exit() {
    let api = StandIn::start().await;
    let mut c = config();
    c.pending_timeout = Duration::from_secs(3600);
    let exec = KubeExecutor::new(api.client("train"), c);
    exec.take_over().await;
    let l = launch(3, 1, 0, 1);
    exec.launch(l.clone()).await.expect("launch");
    created(&api, &l.id).await;
    api.vanish(&pod_name(&l.id));
    api.compact();
    api.end_watches();
    let (code, reason) = wait_exit(&exec, &l.id).await;
    assert_eq!(code, None);
    assert!(reason.contains("its pod was deleted"), "{reason}");
    assert!(
        api.requests()
            .iter()
            .any(|r| r.starts_with("GET pods") && r.ends_with(&pod_name(&l.id))),
        "asked for by name: {:?}",
        api.requests()
    );
}

/// A job's `resources` become the container's CPU and memory limits, and
/// a container the kernel killed for going over its memory limit ends
/// "out of memory", not "exited with code 137".
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn resource_limits_go_on_the_container_and_an_oom_kill_says_out_of_memory() {
    support::sshd::init_tracing();
    let api = StandIn::start().await;
    let exec = KubeExecutor::new(api.client("train"), config());
    exec.take_over().await;
    let mut limited = launch(8, 1, 0, 1);
    limited.resources = keel_state::spec::Resources {
        cpu_millis: Some(1500),
        memory_bytes: Some(64 << 20),
    };
    let plain = launch(9, 1, 0, 1);
    exec.launch(limited.clone()).await.expect("launch");
    exec.launch(plain.clone()).await.expect("launch");
    let pod = created(&api, &limited.id).await;
    let limits = &pod["spec"]["containers"][0]["resources"]["limits"];
    assert_eq!(limits["cpu"], "1500m");
    assert_eq!(limits["memory"], (64u64 << 20).to_string());
    assert_eq!(limits["nvidia.com/gpu"], "2");
    let pod = created(&api, &plain.id).await;
    let limits = &pod["spec"]["containers"][0]["resources"]["limits"];
    assert!(
        limits["cpu"].is_null() && limits["memory"].is_null(),
        "{limits}"
    );

    api.run(&pod_name(&limited.id));
    api.oom_kill(&pod_name(&limited.id));
    let (code, reason) = wait_exit(&exec, &limited.id).await;
    assert_eq!(code, Some(137));
    assert!(reason.starts_with("out of memory"), "{reason}");
}
