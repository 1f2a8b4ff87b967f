//! Issue 33: a node's GPUs change while jobs run. A GPU that disappears
//! (the node restarted with fewer, the driver lost it, a critical Xid) is
//! gone with its reason, in one logged entry; the job on it goes back to
//! the queue and runs again elsewhere; a GPU that appears is added. Real
//! servers, real workers, a stand-in `nvidia-smi` and kernel log where the
//! GPUs are "real".

mod support;

use std::path::Path;

use serde_json::Value;
use support::{a100_at, node_entries, submit_script, wait_for, FakeNvidiaSmi, ServerProcess};

/// A job that runs until `release` exists.
fn held(server: &ServerProcess, dir: &Path, name: &str, release: &Path) -> String {
    submit_script(
        server,
        dir,
        name,
        &format!("until [ -f {} ]; do sleep 0.1; done", release.display()),
    )
}

fn job(server: &ServerProcess, id: &str) -> Value {
    server.json(&["job", id])
}

/// The GPU index a running job holds ("node/index" in `keel job`).
fn gpu_of(server: &ServerProcess, id: &str) -> Option<u64> {
    let view = job(server, id);
    (view["state"] == "running").then_some(())?;
    view["allocation"]["gpus"][0]
        .as_str()?
        .rsplit_once('/')?
        .1
        .parse()
        .ok()
}

fn node_named(server: &ServerProcess, name: &str) -> Option<Value> {
    server
        .json(&["nodes"])
        .as_array()?
        .iter()
        .find(|n| n["name"] == name)
        .cloned()
}

/// The case: two one-GPU jobs on `gx-0/0` and `gx-0/1`; the server
/// restarts (kill -9, its workers live on) with one GPU. The node's
/// re-registration is one entry: GPU 1 gone with why, the job on it
/// requeued (no retry spent), the other re-adopted; it runs again on GPU 0
/// once that is free. Restarted with three GPUs, the node offers them all.
#[test]
fn a_node_restarted_with_fewer_gpus_loses_one_and_with_more_offers_them() {
    let dir = tempfile::tempdir().expect("tempdir");
    let data = dir.path().join("data");
    let args = |gpus: &'static str| {
        [
            "--simulated-gpus",
            gpus,
            "--node-name",
            "gx",
            "--round-s",
            "0.3",
        ]
    };
    let server = ServerProcess::start(&data, &args("2xv100"));
    let _reaper = support::WorkerReaper(data.join("workers"));
    let release_a = dir.path().join("release-a");
    let release_b = dir.path().join("release-b");
    let a = held(&server, dir.path(), "a", &release_a);
    let b = held(&server, dir.path(), "b", &release_b);
    let (on_0, on_1) = wait_for("both jobs to run", || {
        match (gpu_of(&server, &a)?, gpu_of(&server, &b)?) {
            (0, 1) => Some((a.clone(), b.clone())),
            (1, 0) => Some((b.clone(), a.clone())),
            _ => None,
        }
    });
    let release = |id: &str| if id == a { &release_a } else { &release_b };
    server.kill9();

    // As after a GPU fell off the bus: the node comes back with one.
    let server = ServerProcess::start(&data, &args("1xv100"));
    let node = wait_for("GPU 1 to be gone", || {
        node_named(&server, "gx-0")
            .filter(|n| n["gone_gpus"].as_array().is_some_and(|g| !g.is_empty()))
    });
    assert_eq!(node["gpus"].as_array().map(Vec::len), Some(1), "{node}");
    assert_eq!(node["gone_gpus"][0]["index"], 1, "{node}");
    assert_eq!(
        node["gone_gpus"][0]["reason"], "no longer in the node's inventory",
        "{node}"
    );
    let nodes_table = server.cli_ok(&["nodes"]);
    assert!(
        nodes_table.contains("GPU 1 (v100) gone: no longer in the node's inventory"),
        "{nodes_table}"
    );
    let requeued = wait_for("the job on GPU 1 to be requeued", || {
        let view = job(&server, &on_1);
        (view["state"] == "pending" || view["state"] == "preempted").then_some(view)
    });
    assert_eq!(
        requeued["message"], "GPU gx-0/1 gone: no longer in the node's inventory",
        "{requeued}"
    );
    assert_eq!(requeued["retries"], 0, "{requeued}");
    let kept = job(&server, &on_0);
    assert_eq!(kept["state"], "running", "re-adopted on GPU 0: {kept}");
    assert_eq!(kept["workers"][0]["epoch"], 1, "{kept}");

    // GPU 0 freed: the requeued job runs there.
    std::fs::write(release(&on_0), b"").expect("release");
    wait_for("the requeued job to run on GPU 0", || {
        (gpu_of(&server, &on_1)? == 0).then_some(())
    });
    std::fs::write(release(&on_1), b"").expect("release");
    wait_for("both jobs to succeed", || {
        (job(&server, &on_0)["state"] == "succeeded" && job(&server, &on_1)["state"] == "succeeded")
            .then_some(())
    });
    // The change was one entry: the first registration and the shrink, no
    // refusal, however long the job took to run again.
    assert_eq!(node_entries(&server), (2, 0));
    let events = server.cli_ok(&["events"]);
    assert!(
        events.contains("node gx-0: GPU 1 (v100) gone: no longer in the node's inventory"),
        "{events}"
    );
    server.terminate();

    // More GPUs: added, nothing gone.
    let server = ServerProcess::start(&data, &args("3xv100"));
    let node = wait_for("three GPUs", || {
        node_named(&server, "gx-0").filter(|n| n["gpus"].as_array().is_some_and(|g| g.len() == 3))
    });
    assert!(
        node["gone_gpus"].as_array().is_none_or(Vec::is_empty),
        "{node}"
    );
    let events = server.cli_ok(&["events"]);
    assert!(
        events.contains("node gx-0: GPUs added: 1 (v100), 2 (v100)"),
        "{events}"
    );
    assert_eq!(node_entries(&server), (3, 0));
    server.terminate();
}

/// With real GPUs (a stand-in `nvidia-smi` and kernel log): a critical
/// Xid on GPU 1 and, later, GPU 0 lost by the driver each take the GPU
/// out of the node with the driver's words, requeue the job on it, and
/// are one entry each.
#[test]
fn a_gpu_with_a_critical_xid_or_lost_by_the_driver_is_gone_with_why() {
    let dir = tempfile::tempdir().expect("tempdir");
    let driver = FakeNvidiaSmi::new(dir.path(), "GPU-33aa-test");
    driver.lists_gpus(&format!("{}{}", a100_at(0, "3B"), a100_at(1, "86")));
    let kmsg = dir.path().join("kmsg");
    std::fs::write(
        &kmsg,
        "6,1,100,-;NVRM: loading NVIDIA UNIX x86_64 Kernel Module\n",
    )
    .expect("kernel log");
    let data = dir.path().join("data");
    let server = ServerProcess::start_with_env(
        &data,
        &[
            "--round-s",
            "0.3",
            "--node-name",
            "gpu-host",
            "--gpu-kernel-log",
            kmsg.to_str().expect("utf-8"),
        ],
        &[("PATH", driver.path())],
    );
    let _reaper = support::WorkerReaper(data.join("workers"));
    let release = dir.path().join("release");
    let a = held(&server, dir.path(), "a", &release);
    let b = held(&server, dir.path(), "b", &release);
    let (on_0, on_1) = wait_for("both jobs to run", || {
        match (gpu_of(&server, &a)?, gpu_of(&server, &b)?) {
            (0, 1) => Some((a.clone(), b.clone())),
            (1, 0) => Some((b.clone(), a.clone())),
            _ => None,
        }
    });
    let mut log = std::fs::OpenOptions::new()
        .append(true)
        .open(&kmsg)
        .expect("kernel log");
    std::io::Write::write_all(
        &mut log,
        b"4,2,200,-;NVRM: Xid (PCI:0000:86:00): 13, pid=77, Graphics Exception\n\
          4,3,300,-;NVRM: Xid (PCI:0000:86:00): 79, pid=77, name=python, GPU has fallen off the bus.\n",
    )
    .expect("an Xid");
    let xid = "Xid 79: GPU has fallen off the bus.";
    let view = wait_for("the job on GPU 1 to be requeued", || {
        let view = job(&server, &on_1);
        (view["state"] == "pending" || view["state"] == "preempted").then_some(view)
    });
    assert_eq!(
        view["message"],
        format!("GPU gpu-host/1 gone: {xid}"),
        "{view}"
    );
    let node = node_named(&server, "gpu-host").expect("the node");
    assert_eq!(node["gone_gpus"][0]["reason"], xid, "{node}");
    assert_eq!(node["gpus"].as_array().map(Vec::len), Some(1), "{node}");
    assert_eq!(job(&server, &on_0)["state"], "running");

    // GPU 0 lost by the driver: nvidia-smi says so and exits 15.
    driver.lists_gpus(&format!(
        "{}Unable to determine the device handle for GPU 0000:3B:00.0: GPU is lost.  Reboot the system to recover this GPU\n",
        a100_at(1, "86")
    ));
    let view = wait_for("the job on GPU 0 to be requeued", || {
        let view = job(&server, &on_0);
        (view["state"] == "pending" || view["state"] == "preempted").then_some(view)
    });
    let lost = "lost by the driver: GPU is lost.  Reboot the system to recover this GPU";
    assert_eq!(
        view["message"],
        format!("GPU gpu-host/0 gone: {lost}"),
        "{view}"
    );
    let node = node_named(&server, "gpu-host").expect("the node");
    assert_eq!(node["gpus"].as_array().map(Vec::len), Some(0), "{node}");
    let reasons: Vec<&str> = node["gone_gpus"]
        .as_array()
        .expect("gone")
        .iter()
        .filter_map(|g| g["reason"].as_str())
        .collect();
    assert_eq!(reasons, vec![lost, xid], "{node}");
    // Registration, the Xid, the loss: one entry each, none refused. The
    // jobs wait (no GPU left), nothing more is written.
    let job_b = job(&server, &on_1);
    assert_eq!(job_b["retries"], 0, "{job_b}");
    assert_eq!(node_entries(&server), (3, 0));
    server.terminate();
}
