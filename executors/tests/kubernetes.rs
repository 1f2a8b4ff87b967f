//! The Kubernetes executor against a stand-in API server that serves the
//! real core/v1 paths and shapes (`support/kube_standin.rs`), with the test
//! playing the kubelet; and, opt-in, against a live cluster.

mod support;

use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::{Duration, Instant};

use keel_executors::book::ManualClock;
use keel_executors::contract::WorkerLaunch;
use keel_executors::kubernetes::pod_name;
use keel_executors::{Executor, KubeConfig, KubeExecutor, NodeProbe, Observed, WorkerId};
use support::kube_standin::StandIn;

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
    let pod = api.pod("keel-j7-e2-r0").expect("rank 0's pod");
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
    assert_eq!(
        env_of(&api.pod("keel-j7-e2-r1").expect("rank 1"))["RANK"],
        "1"
    );
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
    assert!(api.pod_names().is_empty(), "{:?}", api.pod_names());
    assert!(api.service("keel-j7-e2").is_none());
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
    let (r0, r1) = (launch(1, 1, 0, 2), launch(1, 1, 1, 2));
    exec.launch(r0.clone()).await.expect("launch");
    exec.launch(r1.clone()).await.expect("launch");
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
    let used = api.rbac_uses();

    let text = std::fs::read_to_string(
        std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../deploy/kubernetes/rbac.yaml"),
    )
    .expect("deploy/kubernetes/rbac.yaml");
    let mut granted = std::collections::BTreeSet::new();
    let docs: Vec<serde_json::Value> = serde_saphyr::from_multiple(&text).expect("yaml");
    for doc in docs {
        if !matches!(doc["kind"].as_str(), Some("Role" | "ClusterRole")) {
            continue;
        }
        for rule in doc["rules"].as_array().into_iter().flatten() {
            for resource in rule["resources"].as_array().into_iter().flatten() {
                for verb in rule["verbs"].as_array().into_iter().flatten() {
                    granted.insert((
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
    let client = kube::Client::try_default()
        .await
        .expect("a kubeconfig or in-cluster config");
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
    exec.launch(l.clone()).await.expect("launch");
    let deadline = Instant::now() + Duration::from_secs(300);
    let (code, reason) = loop {
        if let Some(Observed::Exited { exit_code, reason }) = observed(&exec, &l.id).await {
            break (exit_code, reason);
        }
        assert!(
            Instant::now() < deadline,
            "the live pod did not finish in 5 minutes"
        );
        tokio::time::sleep(Duration::from_millis(500)).await;
    };
    assert_eq!(code, Some(0), "{reason}");
    let steps: Vec<u64> = exec
        .take_progress()
        .await
        .remove(&l.id.job_id)
        .unwrap_or_default()
        .iter()
        .map(|s| s.step)
        .collect();
    assert_eq!(steps, vec![1, 2, 3]);
    exec.forget(&l.id).await;
}
