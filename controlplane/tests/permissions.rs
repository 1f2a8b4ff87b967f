//! Issue 35, first part: what a server writes is its owner's alone (the
//! data directory, WAL, state, journal, snapshots, worker logs, records
//! and checkpoint directories: `0700`/`0600`), its workers keep the umask
//! it was started with, and a data directory other users may read is
//! said at start, and refused with `--strict-permissions`.

mod support;

use std::os::unix::fs::PermissionsExt;
use std::path::{Path, PathBuf};

use support::{mode, process_umask, submit_script, wait_for, ServerProcess, WorkerReaper, KEEL};

/// Every path under `dir`, depth first.
fn walk(dir: &Path, out: &mut Vec<PathBuf>) {
    for entry in std::fs::read_dir(dir).expect("read_dir").flatten() {
        let path = entry.path();
        out.push(path.clone());
        if entry.file_type().is_ok_and(|t| t.is_dir()) {
            walk(&path, out);
        }
    }
}

#[test]
fn a_servers_files_are_its_owners_alone_and_its_workers_keep_their_umask() {
    let dir = tempfile::tempdir().expect("tempdir");
    let data = dir.path().join("data");
    std::fs::create_dir(&data).expect("data dir");
    std::fs::set_permissions(&data, std::fs::Permissions::from_mode(0o700)).expect("chmod");
    // This process's umask, which the server's workers should get back.
    let ours = process_umask();
    let server = ServerProcess::start(
        &data,
        &[
            "--simulated-gpus",
            "1xv100",
            "--round-s",
            "0.2",
            "--snapshot-every",
            "8",
        ],
    );
    let _reaper = WorkerReaper(data.join("workers"));
    let writer = submit_script(
        &server,
        dir.path(),
        "writer",
        "echo hi > \"$KEEL_CHECKPOINT_DIR/out\"; echo \"umask $(umask)\"",
    );
    // More entries than --snapshot-every: a snapshot is written too.
    let more: Vec<String> = (0..3)
        .map(|i| submit_script(&server, dir.path(), &format!("more-{i}"), "true"))
        .collect();
    wait_for("the jobs to succeed", || {
        more.iter()
            .chain([&writer])
            .all(|id| server.json(&["job", id])["state"] == "succeeded")
            .then_some(())
    });
    let logs = server.cli_ok(&["logs", &writer]);
    assert!(
        logs.contains(&format!("umask {:04o}", ours)),
        "the worker runs under the umask the server was started with: {logs}"
    );
    server.terminate();

    let mut paths = Vec::new();
    walk(&data, &mut paths);
    let out = paths
        .iter()
        .find(|p| p.ends_with("out"))
        .cloned()
        .expect("the worker's file");
    assert_eq!(mode(&out), 0o666 & !ours, "the worker's own file");
    assert!(
        paths
            .iter()
            .any(|p| p.to_string_lossy().contains("snapshot")
                || p.to_string_lossy().contains("raft-log")),
        "{paths:?}"
    );
    let open: Vec<String> = paths
        .iter()
        .filter(|p| **p != out && !p.ends_with("test-server.log"))
        .filter(|p| mode(p) & 0o077 != 0)
        .map(|p| format!("{} {:04o}", p.display(), mode(p)))
        .collect();
    assert!(open.is_empty(), "open to other users: {open:#?}");
    assert!(paths.len() > 10, "{paths:?}");

    // A data directory others may read: said at start ...
    std::fs::set_permissions(&data, std::fs::Permissions::from_mode(0o755)).expect("chmod");
    let server = ServerProcess::start(&data, &["--simulated-gpus", "1xv100"]);
    let log = server.log_text();
    assert!(
        log.contains("is open to other users (mode 0755)") && log.contains("chmod 700"),
        "{log}"
    );
    server.terminate();
    // ... and refused with --strict-permissions.
    let refused = std::process::Command::new(KEEL)
        .args(["server", "--strict-permissions", "--listen", "127.0.0.1:0"])
        .arg("--data-dir")
        .arg(&data)
        .output()
        .expect("run keel server");
    assert!(!refused.status.success());
    let err = String::from_utf8_lossy(&refused.stderr);
    assert!(err.contains("mode 0755"), "{err}");
}

/// Issue 35: a plain `env` value whose name looks like a credential is
/// accepted, and `keel submit` says that it is kept and shown in plain
/// (on stderr, and in its JSON answer); a spec without one says nothing.
#[test]
fn keel_submit_warns_of_an_env_name_that_looks_like_a_credential() {
    let dir = tempfile::tempdir().expect("tempdir");
    let server = ServerProcess::start(&dir.path().join("data"), &["--simulated-gpus", "1xv100"]);
    let submit = |name: &str, env: &str| {
        let spec = dir.path().join(format!("{name}.yaml"));
        std::fs::write(
            &spec,
            format!("name: {name}\ncommand: [\"true\"]\nenv: {{{env}}}\n"),
        )
        .expect("spec");
        server.cli(&["submit", "-f", spec.to_str().expect("utf-8"), "-o", "json"])
    };
    let out = submit("tracked", "HF_TOKEN: hf_x, EPOCHS: \"3\"");
    assert!(out.status.success(), "{out:?}");
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        err.contains("warning: env.HF_TOKEN looks like a credential") && !err.contains("EPOCHS"),
        "{err}"
    );
    let answer: serde_json::Value = serde_json::from_slice(&out.stdout).expect("JSON answer");
    assert_eq!(
        answer["warnings"].as_array().map(Vec::len),
        Some(1),
        "{answer}"
    );
    let plain = submit("plain", "EPOCHS: \"3\"");
    assert!(plain.status.success(), "{plain:?}");
    assert!(
        !String::from_utf8_lossy(&plain.stderr).contains("looks like a credential"),
        "{plain:?}"
    );
    server.terminate();
}
