//! `keel server --kubernetes` end to end, against the stand-in API server
//! (the real core/v1 paths and shapes) with the test as the kubelet: GPU
//! Nodes registered from their objects (a NotReady one shown lost, with
//! why), a job's worker created as a Pod pinned to the chosen node, its
//! progress read from the Pod's log, and its exit code from the Pod's
//! status; the space-sharing policies refused with the reason.

mod support;

#[path = "../../executors/tests/support/kube_standin.rs"]
mod kube_standin;

use serde_json::Value;

use kube_standin::StandIn;
use support::{wait_for, ServerProcess};

fn node<'a>(nodes: &'a Value, name: &str) -> Option<&'a Value> {
    nodes.as_array()?.iter().find(|n| n["name"] == name)
}

/// A server on the stand-in, in namespace `train`, with `extra` flags.
fn start(api: &StandIn, dir: &std::path::Path, extra: &[&str]) -> ServerProcess {
    let mut args = vec![
        "--kubernetes",
        "--k8s-api-url",
        &api.url,
        "--k8s-namespace",
        "train",
        "--k8s-default-image",
        "registry.example/train:1",
        "--progress-interval-s",
        "0.2",
        "--round-s",
        "0.5",
    ];
    args.extend_from_slice(extra);
    ServerProcess::start(&dir.join("data"), &args)
}

#[test]
fn a_job_runs_as_a_pod_on_the_node_keel_chose() {
    let rt = tokio::runtime::Runtime::new().expect("runtime");
    let api = rt.block_on(StandIn::start());
    api.add_node("gpu-a", 4, "NVIDIA-A100-SXM4-80GB", true);
    api.add_node("gpu-b", 2, "Tesla-V100-SXM2-16GB", false);
    let dir = tempfile::tempdir().expect("tempdir");
    let server = start(&api, dir.path(), &["--node-timeout-s", "3"]);
    let nodes = wait_for("the GPU nodes to be shown", || {
        let nodes = server.json(&["nodes"]);
        let ready = node(&nodes, "gpu-a").is_some_and(|n| n["state"] == "alive")
            && node(&nodes, "gpu-b").is_some_and(|n| n["state"] == "lost");
        ready.then_some(nodes)
    });
    assert_eq!(
        node(&nodes, "gpu-a").map(|n| n["gpus"].as_array().map_or(0, Vec::len)),
        Some(4)
    );
    let message = node(&nodes, "gpu-b")
        .map(|n| n["message"].to_string())
        .unwrap_or_default();
    assert!(message.contains("not Ready"), "{nodes}");

    let spec = dir.path().join("job.yaml");
    std::fs::write(
        &spec,
        "name: on-k8s\ncommand: [python3, train.py]\ngpus: 2\nworkers: 1\ntotal_steps: 100\n",
    )
    .expect("spec");
    let id = server.json(&["submit", "-f", spec.to_str().expect("utf-8")])["id"]
        .as_u64()
        .expect("job id");
    let pod_name = format!("keel-j{id}-e1-r0");
    let pod = wait_for("the worker's pod", || api.pod(&pod_name));
    assert_eq!(pod["spec"]["nodeName"], "gpu-a");
    assert_eq!(
        pod["spec"]["containers"][0]["resources"]["limits"]["nvidia.com/gpu"],
        "2"
    );
    assert_eq!(
        pod["spec"]["containers"][0]["image"],
        "registry.example/train:1"
    );
    api.run(&pod_name);
    api.log(
        &pod_name,
        "KEEL_PROGRESS {\"step\": 40, \"total_steps\": 100}\n",
    );
    wait_for("progress from the pod's log", || {
        let view = server.json(&["job", &id.to_string()]);
        (view["progress"]["step"] == 40 && view["state"] == "running").then_some(())
    });
    api.log(
        &pod_name,
        "KEEL_PROGRESS {\"step\": 100, \"total_steps\": 100}\ndone\n",
    );
    // The container ends right after its last line: the exit is recorded
    // only once the log has been read to its end.
    api.exit(&pod_name, 0);
    let done = wait_for("the job to succeed", || {
        let view = server.json(&["job", &id.to_string()]);
        assert_ne!(view["state"], "failed", "{view}");
        (view["state"] == "succeeded").then_some(view)
    });
    assert_eq!(done["progress"]["step"], 100, "{done}");
    // The finished pod is deleted once its exit is in the log.
    wait_for("the pod to be cleaned up", || {
        api.pod(&pod_name).is_none().then_some(())
    });
    // Pods cannot share GPUs: the space-sharing policies are refused, with
    // the reason, and nothing is logged.
    let refused = server.cli(&["policy", "set", "max_min_fairness_packed"]);
    let stderr = String::from_utf8_lossy(&refused.stderr);
    assert!(!refused.status.success());
    assert!(
        stderr.contains("cannot put two Pods on the same GPUs"),
        "{stderr}"
    );
    assert!(!server.cli_ok(&["events"]).contains("policy changed"));
    server.terminate();
    drop(rt);
}

/// Issue 30, items 1 and 2 end to end: another tenant's Pod holds three of
/// a node's four GPUs before Keel has seen it; the kubelet rejects Keel's
/// two-GPU Pod. The job goes back to the queue without spending its only
/// try, `keel nodes` shows the node offering one GPU and why, and once the
/// tenant is done the job runs there and succeeds.
#[test]
fn a_pod_the_kubelet_rejects_costs_the_job_no_retry() {
    let rt = tokio::runtime::Runtime::new().expect("runtime");
    let api = rt.block_on(StandIn::start());
    api.add_node("gpu-a", 4, "NVIDIA-A100-SXM4-80GB", true);
    let dir = tempfile::tempdir().expect("tempdir");
    let server = start(&api, dir.path(), &[]);
    wait_for("gpu-a with 4 GPUs", || {
        let nodes = server.json(&["nodes"]);
        node(&nodes, "gpu-a")
            .is_some_and(|n| n["gpus"].as_array().map_or(0, Vec::len) == 4)
            .then_some(())
    });
    // Another tenant lands on gpu-a while the API server's watches lag:
    // the kubelet sees it, Keel does not yet.
    api.lag_watches_of("team-b");
    api.add_tenant_pod("team-b", "bert-0", "gpu-a", 3);
    let spec = dir.path().join("job.yaml");
    std::fs::write(
        &spec,
        "name: strict\ncommand: [python3, train.py]\ngpus: 2\nworkers: 1\nmax_retries: 0\n",
    )
    .expect("spec");
    let id = server.json(&["submit", "-f", spec.to_str().expect("utf-8")])["id"]
        .as_u64()
        .expect("job id");
    let job = id.to_string();
    let view = wait_for("the rejection to requeue the job", || {
        let view = server.json(&["job", &job]);
        assert_ne!(
            view["state"], "failed",
            "a rejection spent the job's only try: {view}"
        );
        view["message"]
            .as_str()
            .is_some_and(|m| m.contains("was not admitted on node gpu-a"))
            .then_some(view)
    });
    let message = view["message"].as_str().unwrap_or_default();
    assert!(
        message.contains("no retry spent") && message.contains("UnexpectedAdmissionError"),
        "{view}"
    );
    assert_eq!(view["retries"], 0, "{view}");
    // The watch catches up: gpu-a offers the one GPU left, and says why.
    api.catch_up_watches();
    let nodes = wait_for("gpu-a to offer 1 GPU", || {
        let nodes = server.json(&["nodes"]);
        node(&nodes, "gpu-a")
            .is_some_and(|n| n["gpus"].as_array().map_or(0, Vec::len) == 1)
            .then_some(nodes)
    });
    let message = node(&nodes, "gpu-a")
        .map(|n| n["message"].to_string())
        .unwrap_or_default();
    assert!(
        message.contains("offers 1 of 4") && message.contains("team-b/bert-0"),
        "{nodes}"
    );
    // The tenant finishes: the job runs on gpu-a and succeeds.
    api.finish_tenant_pod("team-b", "bert-0");
    let pod = wait_for("the job's pod, admitted", || {
        api.pod_names()
            .into_iter()
            .filter(|n| n.starts_with(&format!("keel-j{id}-")))
            .filter_map(|n| api.pod(&n).map(|p| (n, p)))
            .find(|(_, p)| p["status"]["phase"] == "Pending")
    });
    api.run(&pod.0);
    api.exit(&pod.0, 0);
    let done = wait_for("the job to succeed", || {
        let view = server.json(&["job", &job]);
        (view["state"] == "succeeded").then_some(view)
    });
    assert_eq!(done["retries"], 0, "{done}");
    server.terminate();
    drop(rt);
}
