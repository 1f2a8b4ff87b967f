//! Issue 35: secrets. A job's variable taken from a secret reaches its
//! worker's environment and nowhere else: not the WAL, the state, the
//! journal, a snapshot, the worker logs or any answer of the API. A
//! replica without the sealing key says so on the job and loses nothing;
//! with both keys the job runs, and a key rotation lets the old key go.

mod support;

use std::path::{Path, PathBuf};

use support::{submit_spec, wait_for, ServerProcess, WorkerReaper, KEEL};

/// The value: lower case here; the worker prints it upper-cased, so the
/// worker's log holds another string.
const VALUE: &str = "zq-tracker-credential-7f3a9c1e";

fn new_key(dir: &Path, name: &str) -> PathBuf {
    let out = std::process::Command::new(KEEL)
        .args(["secret", "new-key"])
        .output()
        .expect("keel secret new-key");
    assert!(out.status.success());
    let key = String::from_utf8_lossy(&out.stdout).trim().to_string();
    assert_eq!(key.len(), 64, "{key}");
    let path = dir.join(name);
    std::fs::write(&path, format!("{key}\n")).expect("key file");
    path
}

/// Every file under `dir` whose bytes hold `needle`.
fn files_holding(dir: &Path, needle: &[u8]) -> Vec<PathBuf> {
    let mut found = Vec::new();
    let mut stack = vec![dir.to_path_buf()];
    while let Some(d) = stack.pop() {
        for entry in std::fs::read_dir(&d).expect("read_dir").flatten() {
            let path = entry.path();
            if entry.file_type().is_ok_and(|t| t.is_dir()) {
                stack.push(path);
            } else if std::fs::read(&path)
                .is_ok_and(|bytes| bytes.windows(needle.len()).any(|w| w == needle))
            {
                found.push(path);
            }
        }
    }
    found
}

fn submit_user(server: &ServerProcess, dir: &Path, name: &str) -> String {
    submit_spec(
        server,
        dir,
        serde_json::json!({
            "name": name,
            "command": ["sh", "-c", "printf 'got %s\\n' \"$(printf %s \"$TRACKER_KEY\" | tr a-z A-Z)\""],
            "env": {"TRACKER_KEY": {"secret": "tracker/api_key"}, "PLAIN": "x"},
            "gpus": 1,
        }),
    )
}

fn state_of(server: &ServerProcess, id: &str) -> serde_json::Value {
    server.json(&["job", id])
}

#[test]
fn a_secret_reaches_its_worker_only_and_a_replica_without_its_key_loses_nothing() {
    let dir = tempfile::tempdir().expect("tempdir");
    let data = dir.path().join("data");
    let old_key = new_key(dir.path(), "old.key");
    let new_key_file = new_key(dir.path(), "new.key");
    let start = |keys: &[&PathBuf]| {
        let mut args: Vec<String> = [
            "--simulated-gpus",
            "1xv100",
            "--round-s",
            "0.2",
            "--snapshot-every",
            "8",
        ]
        .map(String::from)
        .to_vec();
        for key in keys {
            args.push("--secret-key-file".into());
            args.push(key.display().to_string());
        }
        let args: Vec<&str> = args.iter().map(String::as_str).collect();
        ServerProcess::start(&data, &args)
    };
    // A key file that holds no key: refused at start, naming the file,
    // before a data directory exists.
    let bad_key = dir.path().join("bad.key");
    std::fs::write(&bad_key, "not a key\n").expect("bad key file");
    let refused = std::process::Command::new(KEEL)
        .args(["server", "--listen", "127.0.0.1:0", "--secret-key-file"])
        .arg(&bad_key)
        .arg("--data-dir")
        .arg(&data)
        .output()
        .expect("run keel server");
    assert!(!refused.status.success());
    let err = String::from_utf8_lossy(&refused.stderr);
    assert!(
        err.contains("bad.key") && err.contains("64 hex digits"),
        "{err}"
    );
    assert!(!data.exists(), "nothing made for a refused start");
    let server = start(&[&old_key]);
    let _reaper = WorkerReaper(data.join("workers"));

    // Refusals name the field.
    let out = server.cli(&["secret", "create", "Bad Name", "--from-literal", "a=b"]);
    assert!(!out.status.success());
    assert!(String::from_utf8_lossy(&out.stderr).contains("name"));
    server.cli_ok(&[
        "secret",
        "create",
        "tracker",
        "--from-literal",
        &format!("api_key={VALUE}"),
    ]);
    let listed = server.json(&["secret", "list"]);
    assert_eq!(listed["secrets"][0]["keys"], serde_json::json!(["api_key"]));
    assert_eq!(listed["secrets"][0]["opens_here"], true);
    // A job naming a key the secret lacks is refused at submission.
    let spec = dir.path().join("missing.json");
    std::fs::write(
        &spec,
        serde_json::json!({"name": "m", "command": ["true"],
            "env": {"K": {"secret": "tracker/nope"}}})
        .to_string(),
    )
    .expect("spec");
    let out = server.cli(&["submit", "-f", spec.to_str().expect("utf-8")]);
    assert!(!out.status.success());
    assert!(
        String::from_utf8_lossy(&out.stderr).contains("has no key \"nope\""),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );

    let first = submit_user(&server, dir.path(), "first");
    // More entries than --snapshot-every: a snapshot holds the secret too.
    for i in 0..4 {
        support::submit_script(&server, dir.path(), &format!("filler-{i}"), "true");
    }
    wait_for("the job to succeed", || {
        (state_of(&server, &first)["state"] == "succeeded").then_some(())
    });
    let logs = server.cli_ok(&["logs", &first]);
    assert!(
        logs.contains(&format!("got {}", VALUE.to_uppercase())),
        "the worker sees the value: {logs}"
    );
    // No answer holds the value.
    for args in [
        vec!["job", first.as_str(), "-o", "json"],
        vec!["secret", "list", "-o", "json"],
        vec!["events", "-o", "json"],
        vec!["why", first.as_str()],
    ] {
        let out = server.cli_ok(&args);
        assert!(!out.contains(VALUE), "keel {args:?} shows the value: {out}");
    }
    let job = state_of(&server, &first);
    assert!(
        job.to_string().contains("tracker/api_key"),
        "the reference is shown: {job}"
    );
    let before_restart = server.json(&["secret", "list"]);
    server.terminate();
    let holding = files_holding(&data, VALUE.as_bytes());
    assert!(holding.is_empty(), "files holding the value: {holding:?}");

    // A replica with another key: the job says why and waits; nothing is
    // lost.
    let server = start(&[&new_key_file]);
    assert_eq!(
        server.json(&["secret", "list"])["secrets"][0]["revision"],
        before_restart["secrets"][0]["revision"]
    );
    assert_eq!(
        server.json(&["secret", "list"])["secrets"][0]["opens_here"],
        false
    );
    let second = submit_user(&server, dir.path(), "second");
    let why = wait_for("the job to say the key is missing", || {
        let job = state_of(&server, &second);
        let text = job.to_string();
        text.contains("which this server does not hold")
            .then_some(text)
    });
    assert!(why.contains("env.TRACKER_KEY"), "{why}");
    assert_ne!(
        state_of(&server, &second)["state"],
        "failed",
        "no retry spent"
    );
    server.terminate();

    // Both keys, the new one first: the job runs; a rotation re-seals
    // with the new key, after which the old one is not needed.
    let server = start(&[&new_key_file, &old_key]);
    wait_for("the waiting job to succeed", || {
        (state_of(&server, &second)["state"] == "succeeded").then_some(())
    });
    let rotated = server.json(&["secret", "rotate-key"]);
    assert_eq!(rotated["resealed"], 1, "{rotated}");
    let again = server.json(&["secret", "rotate-key"]);
    assert_eq!(again["resealed"], 0, "{again}");
    assert_eq!(again["already_current"], 1, "{again}");
    server.terminate();
    let server = start(&[&new_key_file]);
    let third = submit_user(&server, dir.path(), "third");
    wait_for("a job to succeed on the new key alone", || {
        (state_of(&server, &third)["state"] == "succeeded").then_some(())
    });
    // A used secret is kept; once its jobs ended it may go.
    server.cli_ok(&["secret", "delete", "tracker"]);
    assert_eq!(
        server.json(&["secret", "list"])["secrets"],
        serde_json::json!([])
    );
    server.terminate();
    let holding = files_holding(&data, VALUE.as_bytes());
    assert!(holding.is_empty(), "files holding the value: {holding:?}");
}
