//! Issue 32: a worker's log cannot fill the control plane's disk. Real
//! `keel server` processes with the local executor: the supervisor rotates
//! what a worker prints, copies its progress lines aside so that rotation
//! never loses the last one, and pauses the log while the filesystem is
//! below its floor; `keel logs -f` follows through every rotation.

mod support;

use support::{
    assert_noisy_job_kept_its_rotation, noisy_script, submit_script, wait_for, ServerProcess,
    WorkerReaper,
};

#[test]
fn a_worker_printing_200_mb_leaves_its_rotation_on_disk_and_its_last_progress_line() {
    let dir = tempfile::tempdir().expect("tempdir");
    let data = dir.path().join("data");
    let _reaper = WorkerReaper(data.clone());
    let server = ServerProcess::start(
        &data,
        &[
            "--simulated-gpus",
            "1xv100",
            "--round-s",
            "0.3",
            "--worker-log-max-file-bytes",
            "1048576",
            "--worker-log-max-files",
            "5",
        ],
    );
    let id = submit_script(&server, dir.path(), "noisy", &noisy_script(200));
    assert_noisy_job_kept_its_rotation(
        &server,
        &id,
        &data.join("workers").join(format!("job-{id}")),
    );
    server.terminate();
}

/// A data directory on a filesystem of its own, 96 MiB (tmpfs), and a job
/// that prints without end under a rotation far larger than the disk: the
/// floor pauses its log, the replica goes on committing, and `keel nodes`
/// and the log say why.
#[test]
fn a_noisy_job_cannot_fill_the_disk_the_raft_log_needs() {
    let test = "a_noisy_job_cannot_fill_the_disk_the_raft_log_needs";
    let dir = tempfile::tempdir().expect("tempdir");
    let Some(mount) = support::SmallFilesystem::mount_or_skip(test, &dir.path().join("small"), 96)
    else {
        return;
    };
    let data = mount.path().join("data");
    let _reaper = WorkerReaper(data.clone());
    let server = ServerProcess::start(
        &data,
        &[
            "--simulated-gpus",
            "2xv100",
            "--round-s",
            "0.3",
            "--worker-log-max-file-bytes",
            "104857600",
            "--worker-log-max-files",
            "10",
            "--worker-log-min-free-bytes",
            "33554432",
        ],
    );
    let noisy = submit_script(
        &server,
        dir.path(),
        "noisy",
        "yes 'a noisy job prints this line without end, as fast as it can' ",
    );
    wait_for("the noisy job's log to pause", || {
        let free = support::free_bytes(mount.path());
        let nodes = server.cli_ok(&["nodes"]);
        assert!(free > 0, "the disk filled up");
        nodes.contains("worker logs paused").then_some(nodes)
    });
    // The replica still commits: a job submitted now runs and succeeds,
    // and the noisy one's log says why it stopped growing.
    let quiet = submit_script(&server, dir.path(), "quiet", "echo quiet-done");
    wait_for("the quiet job to succeed", || {
        (server.json(&["job", &quiet])["state"] == "succeeded").then_some(())
    });
    let log = server.cli_ok(&["logs", &noisy, "--tail-bytes", "4096"]);
    assert!(
        log.contains("keel: worker log paused: the filesystem holding it has"),
        "{log}"
    );
    // `keel job` says so too, while the job runs.
    let job = server.cli_ok(&["job", &noisy]);
    assert!(
        job.contains("log of rank 0 epoch 1: worker log paused: the filesystem holding it has"),
        "{job}"
    );
    assert!(
        support::free_bytes(mount.path()) >= 16 * 1024 * 1024,
        "the floor was not kept"
    );
    server.cli_ok(&["cancel", &noisy]);
    wait_for("the noisy job to be cancelled", || {
        (server.json(&["job", &noisy])["state"] == "cancelled").then_some(())
    });
    server.terminate();
}

/// `--retain-logs-s`: a finished job's logs are removed that long after it
/// finished, and the server says so.
#[test]
fn a_finished_jobs_logs_are_removed_after_the_retention() {
    let dir = tempfile::tempdir().expect("tempdir");
    let data = dir.path().join("data");
    let server = ServerProcess::start(
        &data,
        &[
            "--simulated-gpus",
            "1xv100",
            "--round-s",
            "0.3",
            "--retain-logs-s",
            "3",
        ],
    );
    let _reaper = WorkerReaper(data.clone());
    let id = submit_script(&server, dir.path(), "short", "echo short-lived");
    wait_for("the job to succeed", || {
        (server.json(&["job", &id])["state"] == "succeeded").then_some(())
    });
    let job_dir = data.join("workers").join(format!("job-{id}"));
    wait_for("its logs to be removed", || {
        (!job_dir.exists()).then_some(())
    });
    // Logged once the files went.
    let removed = wait_for("the removal to be logged", || {
        server
            .log_text()
            .lines()
            .find(|l| l.contains("removed the logs of a finished job (--retain-logs-s)"))
            .map(str::to_string)
    });
    assert!(removed.contains(&format!("job_id={id}")), "{removed}");
    assert!(
        server.cli_ok(&["logs", &id]).contains("has no worker logs"),
        "the logs are gone for keel logs too"
    );
    server.terminate();
}

/// A job's `logs: {max_file_size, max_files}` rotate its workers' logs
/// within the server's maximum; what it asks above that is cut to it, and
/// its log says so.
#[test]
fn a_job_rotates_its_logs_as_it_asks_within_the_servers_maximum() {
    let dir = tempfile::tempdir().expect("tempdir");
    let data = dir.path().join("data");
    let _reaper = WorkerReaper(data.clone());
    let server = ServerProcess::start(
        &data,
        &[
            "--simulated-gpus",
            "2xv100",
            "--round-s",
            "0.3",
            "--worker-log-max-file-bytes",
            "1048576",
            "--worker-log-max-files",
            "5",
        ],
    );
    let script = |mb: u32| serde_json::json!(["sh", "-c", noisy_script(mb)]);
    let small = support::submit_spec(
        &server,
        dir.path(),
        serde_json::json!({
            "name": "small", "command": script(20), "gpus": 1, "workers": 1,
            "logs": {"max_file_size": "256Ki", "max_files": 2}
        }),
    );
    let greedy = support::submit_spec(
        &server,
        dir.path(),
        serde_json::json!({
            "name": "greedy", "command": script(2), "gpus": 1, "workers": 1,
            "logs": {"max_file_size": "1Gi", "max_files": 3}
        }),
    );
    for id in [&small, &greedy] {
        wait_for("the job to succeed", || {
            (server.json(&["job", id])["state"] == "succeeded").then_some(())
        });
    }
    let on_disk = |id: &str| -> Vec<(String, u64)> {
        let mut files: Vec<(String, u64)> =
            std::fs::read_dir(data.join("workers").join(format!("job-{id}")))
                .expect("the job's log directory")
                .flatten()
                .filter(|e| e.file_name().to_string_lossy().contains(".log"))
                .map(|e| {
                    let len = e.metadata().map(|m| m.len()).unwrap_or(0);
                    (e.file_name().to_string_lossy().to_string(), len)
                })
                .collect();
        files.sort();
        files
    };
    let small_files = on_disk(&small);
    assert!(small_files.len() <= 2, "{small_files:?}");
    assert!(
        small_files.iter().all(|(_, len)| *len <= 256 * 1024),
        "{small_files:?}"
    );
    let greedy_files = on_disk(&greedy);
    assert!(greedy_files.len() <= 3, "{greedy_files:?}");
    assert!(
        greedy_files.iter().all(|(_, len)| *len <= 1024 * 1024),
        "the server's 1 MiB is the most: {greedy_files:?}"
    );
    assert_eq!(
        server.json(&["job", &small])["logs"],
        serde_json::json!({"max_file_size": "256Ki", "max_files": 2})
    );
    // Its log says where it got less than it asked.
    let log = server.cli_ok(&["logs", &greedy, "--tail-bytes", "4000000"]);
    assert!(
        log.contains("keel: logs.max_file_size 1Gi is above this server's maximum of 1Mi"),
        "{}",
        &log[..log.len().min(500)]
    );
    server.terminate();
}
