//! The Python SDK (`sdk/python`) against the real thing: its own unit
//! tests (standard library only), and Python workers using it under a real
//! `keel server` that time-shares one GPU between them, so every worker is
//! stopped by SIGTERM, checkpoints through the SDK, exits 143 and is
//! relaunched from its checkpoint.

use std::path::{Path, PathBuf};
use std::process::Command;

use serde_json::Value;

mod support;

use support::{wait_for, ServerProcess};

fn repo_root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .parent()
        .expect("the repository root")
        .to_path_buf()
}

#[test]
fn the_sdk_unit_tests_pass() {
    if !support::available_or_skip("python3", "the_sdk_unit_tests_pass", "KEEL_REQUIRE_PYTHON") {
        return;
    }
    let out = Command::new("python3")
        .args(["-m", "unittest", "discover", "-v", "-s"])
        .arg(repo_root().join("sdk/python/tests"))
        .output()
        .expect("python3 runs (the SDK's tests need CPython 3.8 or later)");
    assert!(
        out.status.success(),
        "{}\n{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    let report = String::from_utf8_lossy(&out.stderr);
    assert!(report.contains("OK") && report.contains("Ran "), "{report}");
}

#[test]
fn python_workers_stop_checkpoint_and_resume_through_the_sdk() {
    if !support::available_or_skip(
        "python3",
        "python_workers_stop_checkpoint_and_resume_through_the_sdk",
        "KEEL_REQUIRE_PYTHON",
    ) {
        return;
    }
    let dir = tempfile::tempdir().expect("tempdir");
    let server = ServerProcess::start(
        &dir.path().join("data"),
        &[
            "--progress-interval-s",
            "0.2",
            "--stop-grace-s",
            "5",
            "--simulated-gpus",
            "1xv100",
            "--policy",
            "max_min_fairness_perf",
            "--round-s",
            "0.5",
            "--gavel-round-s",
            "2",
            "--resolve-interval-s",
            "0",
        ],
    );
    let root = repo_root();
    let script = root.join("examples/pytorch/minimal.py");
    let sdk = root.join("sdk/python");
    let submit = |name: &str| -> u64 {
        let spec = format!(
            "name: {name}\ncommand: [python3, \"{}\", --steps-per-s, \"100\"]\n\
             env:\n  PYTHONPATH: \"{}\"\ngpus: 1\ntotal_steps: 500\n",
            script.display(),
            sdk.display()
        );
        let path = dir.path().join(format!("{name}.yaml"));
        std::fs::write(&path, spec).expect("write spec");
        server.json(&["submit", "-f", path.to_str().expect("utf-8")])["id"]
            .as_u64()
            .expect("job id")
    };
    let jobs = [submit("a"), submit("b")];
    let job = |id: u64| -> Value { server.json(&["job", &id.to_string()]) };
    for id in jobs {
        wait_for("both Python jobs to succeed", || {
            let view = job(id);
            assert_ne!(view["state"], "failed", "{view}");
            (view["state"] == "succeeded").then_some(())
        });
    }
    for id in jobs {
        let view = job(id);
        let epoch = view["workers"][0]["epoch"].as_u64().unwrap_or(0);
        let history = view["history"].to_string();
        assert!(
            epoch >= 2 && history.contains("preempted"),
            "job {id} was never stopped and relaunched: epoch {epoch}, {history}"
        );
        // The relaunched worker found the checkpoint its predecessor wrote
        // on SIGTERM: a later epoch starts past step 0.
        let logs = server.cli_ok(&["logs", &id.to_string()]);
        let resumed = logs
            .lines()
            .filter_map(|l| l.split("from step ").nth(1))
            .filter_map(|s| s.trim().parse::<u64>().ok())
            .any(|step| step > 0);
        assert!(resumed, "job {id} never resumed from a checkpoint:\n{logs}");
        assert!(view.to_string().contains("500"), "{view}");
    }
    server.terminate();
}
