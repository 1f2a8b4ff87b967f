//! The README's command blocks, run as written against real processes, so
//! the README cannot drift from the binary (issue 20): the command that
//! starts Keel, the short tour (policy eval on the shipped example
//! included) and the replay after it, and the three-replica walkthrough
//! with its kill -9 of the leader.
//!
//! The blocks are read from README.md itself (its `sh` code blocks, by the
//! heading they follow, parsed with pulldown-cmark). Every command in them
//! must be one this test knows how to check: a command added to the README
//! fails here until the test says what it should do.

mod support;

#[path = "../../executors/tests/support/sshd.rs"]
mod sshd;

use std::collections::BTreeMap;
use std::io::{BufRead, BufReader};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Output, Stdio};

use pulldown_cmark::{CodeBlockKind, Event, Parser, Tag, TagEnd};
use serde_json::Value;
use support::{wait_for, ServerProcess, KEEL};

/// The repository's root (README.md, examples/).
fn root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .parent()
        .expect("the workspace root")
        .to_path_buf()
}

/// One line of a README `sh` block: the command and what its comment says.
#[derive(Debug)]
struct Line {
    command: String,
    comment: String,
}

/// The code blocks in `lang` under `heading`, in order.
fn code_blocks(heading: &str, lang: &str) -> Vec<String> {
    let text = std::fs::read_to_string(root().join("README.md")).expect("README.md");
    let (mut current, mut in_heading, mut in_sh) = (String::new(), false, false);
    let mut blocks: Vec<String> = Vec::new();
    for event in Parser::new(&text) {
        match event {
            Event::Start(Tag::Heading { .. }) => {
                in_heading = true;
                current.clear();
            }
            Event::End(TagEnd::Heading(_)) => in_heading = false,
            Event::Start(Tag::CodeBlock(CodeBlockKind::Fenced(kind))) => {
                in_sh = &*kind == lang && current == heading;
                if in_sh {
                    blocks.push(String::new());
                }
            }
            Event::End(TagEnd::CodeBlock) => in_sh = false,
            Event::Text(t) | Event::Code(t) => {
                if in_heading {
                    current.push_str(&t);
                } else if in_sh {
                    if let Some(block) = blocks.last_mut() {
                        block.push_str(&t);
                    }
                }
            }
            _ => {}
        }
    }
    assert!(
        !blocks.is_empty(),
        "README.md has no {lang} block under {heading:?}"
    );
    blocks
}

/// The `sh` blocks under `heading`, in order, each as its lines (a line
/// that is only a comment continues the comment of the line before).
fn sh_blocks(heading: &str) -> Vec<Vec<Line>> {
    code_blocks(heading, "sh")
        .iter()
        .map(|block| {
            let mut lines: Vec<Line> = Vec::new();
            for raw in block.lines() {
                let (command, comment) = raw.split_once('#').unwrap_or((raw, ""));
                let (command, comment) = (command.trim(), comment.trim());
                match lines.last_mut() {
                    Some(last) if command.is_empty() => {
                        last.comment.push(' ');
                        last.comment.push_str(comment);
                    }
                    _ if command.is_empty() => {}
                    _ => lines.push(Line {
                        command: command.to_string(),
                        comment: comment.to_string(),
                    }),
                }
            }
            lines
        })
        .collect()
}

/// Runs `keel ARGS` in `dir` against `addr`, until it succeeds (a person
/// would run it again while the cluster elects a leader), at most 30 s.
fn keel_ok(dir: &Path, addr: &str, args: &[&str]) -> String {
    wait_for(&format!("keel {} to succeed", args.join(" ")), || {
        let out = keel(dir, addr, args);
        out.status
            .success()
            .then(|| String::from_utf8_lossy(&out.stdout).into_owned())
    })
}

fn keel(dir: &Path, addr: &str, args: &[&str]) -> Output {
    let mut command = Command::new(KEEL);
    command.args(args).current_dir(dir).env_remove("KEEL_ADDR");
    if !addr.is_empty() {
        command.env("KEEL_ADDR", addr);
    }
    command.output().expect("run keel")
}

/// A command that never ends by itself (`-f`, `--follow`): its first line
/// of output, then it is killed (the README says Ctrl-C ends it).
fn first_line_of(dir: &Path, addr: &str, args: &[&str]) -> String {
    let mut child: Child = Command::new(KEEL)
        .args(args)
        .current_dir(dir)
        .env("KEEL_ADDR", addr)
        .stdout(Stdio::piped())
        .stderr(Stdio::null())
        .spawn()
        .expect("spawn keel");
    let mut line = String::new();
    if let Some(out) = child.stdout.take() {
        let _ = BufReader::new(out).read_line(&mut line);
    }
    let _ = child.kill();
    let _ = child.wait();
    line
}

fn job(dir: &Path, addr: &str, id: u64) -> Value {
    serde_json::from_str(&keel_ok(dir, addr, &["job", &id.to_string(), "-o", "json"]))
        .expect("JSON")
}

/// "The two commands" and "A short tour", line by line: each command runs
/// and does what its comment says; then the server is stopped and `keel
/// replay` rebuilds the state `keel cluster status` showed, hash for hash.
#[test]
fn the_readme_tour_runs_as_written() {
    let start = &sh_blocks("The two commands")[0];
    let server_args: Vec<&str> = start[0]
        .command
        .strip_prefix("cargo run --release --bin keel -- server")
        .unwrap_or_else(|| panic!("the README starts Keel otherwise: {start:?}"))
        .split_whitespace()
        .collect();
    assert_eq!(
        sh_blocks("The two commands")[1][0].command,
        "cargo test --workspace"
    );
    let dir = tempfile::tempdir().expect("tempdir");
    let server = ServerProcess::start(&dir.path().join("keel-data"), &server_args);
    let (root, addr) = (root(), server.addr.clone());
    let run = |args: &[&str]| keel_ok(&root, &addr, args);
    let mut submitted: BTreeMap<String, u64> = BTreeMap::new();
    let mut policy = String::new();
    let tour = &sh_blocks("A short tour")[0];
    for line in tour {
        let words: Vec<&str> = line.command.split_whitespace().collect();
        let Some((&"keel", args)) = words.split_first() else {
            assert!(
                line.command
                    .starts_with("cargo build --release && export PATH="),
                "a line of the tour this test does not know: {line:?}"
            );
            continue;
        };
        match args {
            ["nodes"] => {
                // The nodes register with their first heartbeat, within a
                // second of the start.
                wait_for("sim-0 and sim-1 with their GPUs", || {
                    let out = run(args);
                    ["sim-0", "sim-1", "v100", "k80"]
                        .iter()
                        .all(|want| out.contains(want))
                        .then_some(())
                });
            }
            ["submit", "-f", file] => {
                let out = run(args);
                let id = submitted.len() as u64 + 1;
                assert!(
                    out.contains(&format!("job {id} submitted")),
                    "{line:?}:\n{out}"
                );
                submitted.insert(file.to_string(), id);
            }
            ["node", "lost", node] => {
                run(args);
                // resnet needs both nodes' v100s: with one node lost it
                // cannot run.
                let resnet = submitted["examples/resnet.yaml"];
                let view = job(&root, &addr, resnet);
                assert_ne!(view["state"], "running", "{line:?}: {view}");
                let nodes = run(&["nodes", "-o", "json"]);
                assert!(nodes.contains(node), "{nodes}");
            }
            ["node", "alive", _] => {
                run(args);
                let resnet = submitted["examples/resnet.yaml"];
                wait_for("resnet to be placed and run", || {
                    let view = job(&root, &addr, resnet);
                    (view["state"] == "running" || view["state"] == "succeeded").then_some(())
                });
            }
            ["jobs"] => {
                let out = run(args);
                for want in ["hello-resnet", "resnet50-imagenet", "flaky-transformer"] {
                    assert!(out.contains(want), "{line:?}:\n{out}");
                }
            }
            ["job", id] => {
                let out = run(args);
                assert!(out.contains("resnet50-imagenet"), "{line:?} {id}:\n{out}");
            }
            ["logs", id, "-f"] => {
                let first = first_line_of(&root, &addr, args);
                assert!(!first.is_empty(), "{line:?}: no output from job {id}");
            }
            ["cancel", id] => {
                // The examples run for seconds: by now the job may have
                // ended, and then the refusal says so.
                let out = keel(&root, &addr, args);
                let view = job(&root, &addr, id.parse().expect("a job id"));
                if out.status.success() {
                    assert_eq!(view["state"], "cancelled", "{line:?}: {view}");
                } else {
                    let error = String::from_utf8_lossy(&out.stderr);
                    assert!(
                        error.contains(&format!("job {id} has already ended")),
                        "{line:?}: {error}"
                    );
                }
            }
            ["events", "--follow"] => {
                let first = first_line_of(&root, &addr, args);
                assert!(!first.is_empty(), "{line:?}: no event");
            }
            ["cluster", "status"] => {
                let out = run(args);
                assert!(out.contains("leader"), "{line:?}:\n{out}");
            }
            ["policy", "set", name] => {
                run(args);
                policy = name.to_string();
            }
            ["policy", "show"] => {
                let out = run(args);
                assert!(out.contains(&policy), "{line:?} after {policy}:\n{out}");
            }
            ["policy", "eval", "--input", file] => {
                let out = run(args);
                assert!(
                    out.contains("max_min_fairness"),
                    "{line:?} on {file}:\n{out}"
                );
            }
            _ => panic!("a keel command of the tour this test does not know: {line:?}"),
        }
    }
    assert_eq!(submitted.len(), 4, "the tour submits the four examples");
    let hello = submitted["examples/hello.yaml"];
    wait_for("hello to succeed", || {
        let view = job(&root, &addr, hello);
        (view["state"] == "succeeded").then_some(())
    });

    // Stopped, the journal replays to the state the server showed.
    let status: Value =
        serde_json::from_str(&run(&["cluster", "status", "-o", "json"])).expect("JSON");
    let (index, hash) = (
        status["last_applied_index"].as_u64().expect("index"),
        status["state_hash"].as_str().expect("hash").to_string(),
    );
    server.terminate();
    let replay = &sh_blocks("A short tour")[1][0];
    assert_eq!(replay.command, "keel replay --data-dir keel-data");
    let mut args: Vec<String> = replay
        .command
        .split_whitespace()
        .skip(1)
        .map(String::from)
        .collect();
    args.extend(["--until".into(), index.to_string()]);
    let args: Vec<&str> = args.iter().map(String::as_str).collect();
    let out = keel(dir.path(), "", &args);
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(
        text.contains(&format!("state hash: {hash}")),
        "{hash} at {index}:\n{text}"
    );
}

/// "A three-replica cluster", as written (on free ports instead of
/// 7001-7003): three replicas sharing an executor directory, a job that
/// runs, the leader killed with kill -9, another leader, and the job on in
/// its first epoch to success.
#[test]
fn the_readme_three_replica_walkthrough_runs_as_written() {
    let dir = tempfile::tempdir().expect("tempdir");
    std::os::unix::fs::symlink(root().join("examples"), dir.path().join("examples"))
        .expect("examples");
    let free_port = || {
        std::net::TcpListener::bind("127.0.0.1:0")
            .and_then(|l| l.local_addr())
            .map(|a| a.port())
            .expect("a free port")
    };
    let ports: BTreeMap<String, String> = (1..=3)
        .map(|i| {
            (
                format!("127.0.0.1:700{i}"),
                format!("127.0.0.1:{}", free_port()),
            )
        })
        .collect();
    let on_free_ports = |text: &str| {
        ports
            .iter()
            .fold(text.to_string(), |t, (from, to)| t.replace(from, to))
    };
    let mut vars: BTreeMap<String, String> = BTreeMap::new();
    let mut servers: Vec<(u64, Child)> = Vec::new();
    let mut addr = String::new();
    let mut leader_killed = None;
    let walkthrough = &sh_blocks("A three-replica cluster")[0];
    for line in walkthrough {
        let mut command = on_free_ports(&line.command);
        if let Some((name, value)) = command
            .split_once('=')
            .filter(|(n, _)| n.chars().all(|c| c.is_ascii_uppercase()) && !n.is_empty())
        {
            vars.insert(name.to_string(), value.trim_matches('"').to_string());
            continue;
        }
        for (name, value) in &vars {
            command = command.replace(&format!("${name}"), value);
        }
        let words: Vec<&str> = command.split_whitespace().collect();
        match words.as_slice() {
            ["keel", "server", args @ .., "&"] => {
                let id: u64 = args
                    .windows(2)
                    .find(|w| w[0] == "--id")
                    .and_then(|w| w[1].parse().ok())
                    .expect("--id");
                let log =
                    std::fs::File::create(dir.path().join(format!("server{id}.log"))).expect("log");
                let child = Command::new(KEEL)
                    .arg("server")
                    .args(args)
                    .current_dir(dir.path())
                    .stdout(Stdio::null())
                    .stderr(log)
                    .spawn()
                    .expect("spawn keel server");
                servers.push((id, child));
            }
            ["export", assignment] => {
                addr = assignment
                    .strip_prefix("KEEL_ADDR=")
                    .expect("KEEL_ADDR")
                    .to_string();
            }
            ["keel", "cluster", "status"] => {
                // "every member: role, term, indexes, lag, state hash", and
                // after the kill "another leader, about a second later".
                let status = wait_for("three members and a leader", || {
                    let out = keel(dir.path(), &addr, &["cluster", "status", "-o", "json"]);
                    let status: Value = serde_json::from_slice(&out.stdout).ok()?;
                    let members = status["members_status"].as_array().map_or(0, Vec::len);
                    let leader = leader_id(&status)?;
                    (members == 3 && Some(leader) != leader_killed).then_some(status)
                });
                assert!(
                    status["members_status"][0]["state_hash"].is_string()
                        || leader_killed.is_some(),
                    "{line:?}: {status}"
                );
            }
            ["keel", "submit", "-f", file] => {
                let out = keel_ok(dir.path(), &addr, &["submit", "-f", file]);
                assert!(out.contains("job 1 submitted"), "{line:?}:\n{out}");
            }
            ["keel", "jobs"] => {
                // "running on sim-0"
                wait_for("the job to run", || {
                    let view = job(dir.path(), &addr, 1);
                    (view["state"] == "running").then_some(())
                });
                let out = keel_ok(dir.path(), &addr, &["jobs"]);
                assert!(out.contains("running"), "{line:?}:\n{out}");
            }
            ["kill", "-9", "%1"] => {
                // "the leader, if replica 1 leads (cluster status says)": a
                // person kills whichever replica leads.
                let out = keel_ok(dir.path(), &addr, &["cluster", "status", "-o", "json"]);
                let status: Value = serde_json::from_str(&out).expect("JSON");
                let leader = leader_id(&status).expect("a leader");
                let (_, child) = servers
                    .iter_mut()
                    .find(|(id, _)| *id == leader)
                    .expect("the leader is one of ours");
                child.kill().expect("kill -9");
                child.wait().expect("reap");
                leader_killed = Some(leader);
            }
            ["keel", "job", "1"] => {
                // "still epoch 1: the worker ran on, and the job succeeds"
                let done = wait_for("the job to succeed", || {
                    let view = job(dir.path(), &addr, 1);
                    assert_ne!(view["state"], "failed", "{view}");
                    (view["state"] == "succeeded").then_some(view)
                });
                assert_eq!(done["workers"][0]["epoch"], 1, "relaunched: {done}");
            }
            _ => panic!("a line of the walkthrough this test does not know: {line:?}"),
        }
    }
    assert!(leader_killed.is_some(), "the walkthrough kills the leader");
    for (_, mut child) in servers {
        let _ = child.kill();
        let _ = child.wait();
    }
}

/// "Securing a cluster": `keel tls init`, three replicas over mutual TLS
/// with ACLs, a client holding the client certificate, the bootstrap token
/// and a user's token, as written (on free ports); and the same client
/// without its certificate gets nothing.
#[test]
fn the_readme_tls_walkthrough_runs_as_written() {
    let dir = tempfile::tempdir().expect("tempdir");
    std::os::unix::fs::symlink(root().join("examples"), dir.path().join("examples"))
        .expect("examples");
    let ports: BTreeMap<String, String> = (1..=3)
        .map(|i| {
            let port = std::net::TcpListener::bind("127.0.0.1:0")
                .and_then(|l| l.local_addr())
                .map(|a| a.port())
                .expect("a free port");
            (format!("127.0.0.1:700{i}"), format!("127.0.0.1:{port}"))
        })
        .collect();
    let mut vars: BTreeMap<String, String> = BTreeMap::new();
    let mut env: BTreeMap<String, String> = BTreeMap::new();
    let mut servers: Vec<Child> = Vec::new();
    let client = |env: &BTreeMap<String, String>, args: &[&str]| {
        Command::new(KEEL)
            .args(args)
            .current_dir(dir.path())
            .env_remove("KEEL_ADDR")
            .envs(env)
            .output()
            .expect("run keel")
    };
    let mut ran = Vec::new();
    for line in &sh_blocks("Securing a cluster")[0] {
        let mut command = ports
            .iter()
            .fold(line.command.clone(), |t, (from, to)| t.replace(from, to));
        if let Some((name, value)) = command
            .split_once('=')
            .filter(|(n, _)| n.chars().all(|c| c.is_ascii_uppercase()) && !n.is_empty())
        {
            vars.insert(name.to_string(), value.to_string());
            continue;
        }
        for (name, value) in &vars {
            command = command.replace(&format!("${name}"), value);
        }
        let words: Vec<&str> = command.split_whitespace().collect();
        match words.as_slice() {
            ["keel", "tls", "init", certs] => {
                let out = client(&env, &["tls", "init", certs]);
                assert!(out.status.success(), "{line:?}: {out:?}");
                // "owner-only"
                assert_eq!(
                    std::fs::metadata(dir.path().join(certs).join("ca.key"))
                        .map(|m| std::os::unix::fs::PermissionsExt::mode(&m.permissions()) & 0o777)
                        .expect("ca.key"),
                    0o600
                );
            }
            ["keel", "server", args @ .., "&"] => {
                let log = std::fs::File::create(dir.path().join(format!("s{}.log", servers.len())))
                    .expect("log");
                servers.push(
                    Command::new(KEEL)
                        .arg("server")
                        .args(args)
                        .current_dir(dir.path())
                        .stdout(Stdio::null())
                        .stderr(log)
                        .spawn()
                        .expect("spawn keel server"),
                );
            }
            ["export", assignments @ ..] => {
                for a in assignments {
                    let (k, v) = a.split_once('=').expect("NAME=VALUE");
                    env.insert(k.to_string(), v.to_string());
                }
            }
            ["keel", "cluster", "status"] => {
                // "three members, over mutual TLS"
                wait_for("three members and a leader over TLS", || {
                    let out = client(&env, &["cluster", "status", "-o", "json"]);
                    let status: Value = serde_json::from_slice(&out.stdout).ok()?;
                    let members = status["members_status"].as_array().map_or(0, Vec::len);
                    (members == 3 && leader_id(&status).is_some()).then_some(())
                });
            }
            ["keel", "acl", "bootstrap", "--secret-file", file] => {
                let out = client(&env, &["acl", "bootstrap", "--secret-file", file]);
                assert!(out.status.success(), "{line:?}: {out:?}");
                // Written owner-only, and not shown.
                assert_eq!(
                    std::fs::metadata(dir.path().join(file))
                        .map(|m| std::os::unix::fs::PermissionsExt::mode(&m.permissions()) & 0o777)
                        .expect("the secret file"),
                    0o600
                );
                let secret = std::fs::read_to_string(dir.path().join(file)).expect("secret");
                assert!(!String::from_utf8_lossy(&out.stdout).contains(secret.trim()));
            }
            ["keel", "acl", "token", "create", rest @ ..] => {
                let mut args = vec!["acl", "token", "create"];
                args.extend(rest);
                let out = client(&env, &args);
                assert!(out.status.success(), "{line:?}: {out:?}");
                assert!(
                    String::from_utf8_lossy(&out.stdout).contains("(role user) created"),
                    "{line:?}: {out:?}"
                );
            }
            ["keel", "--token-file", token, "submit", "-f", file] => {
                let out = wait_for("the submission", || {
                    let out = client(&env, &["--token-file", token, "submit", "-f", file]);
                    out.status.success().then_some(out)
                });
                assert!(
                    String::from_utf8_lossy(&out.stdout).contains("job 1 submitted"),
                    "{line:?}: {out:?}"
                );
                // The user may not do an admin's work, and the job is hers.
                let refused = client(&env, &["--token-file", token, "policy", "set", "fifo"]);
                assert!(
                    String::from_utf8_lossy(&refused.stderr).contains("PermissionDenied"),
                    "{refused:?}"
                );
                let job = client(&env, &["job", "1", "-o", "json"]);
                let job: Value = serde_json::from_slice(&job.stdout).expect("job 1");
                assert_eq!(job["submitted_by"], "token:alice", "{job}");
            }
            _ => panic!("a line of the walkthrough this test does not know: {line:?}"),
        }
        ran.push(words[..2.min(words.len())].join(" "));
    }
    assert_eq!(ran.iter().filter(|w| *w == "keel server").count(), 3);
    // Without the client's certificate: nothing.
    let mut plain = env.clone();
    plain.retain(|k, _| !k.starts_with("KEEL_TLS_"));
    let refused = client(&plain, &["jobs"]);
    assert!(!refused.status.success(), "{refused:?}");
    for mut child in servers {
        let _ = child.kill();
        let _ = child.wait();
    }
}

/// "The SSH executor": the README's nodes file, its first node pointed at
/// a real sshd on 127.0.0.1 (with GPUs declared, as there is no
/// `nvidia-smi`, and a work directory of the test's), its other settings as
/// written; then `examples/hello.yaml`, which runs bare `keel trainer`, to
/// success on a host whose login PATH has no keel: the server installs
/// itself there. Host keys go to Keel's own known-hosts file under the data
/// directory (the README's default when `known_hosts_file` is left out).
#[test]
fn the_readme_ssh_walkthrough_runs_hello_on_a_host_with_nothing_installed() {
    let Some(sshd) = sshd::Sshd::start_or_skip(
        "the_readme_ssh_walkthrough_runs_hello_on_a_host_with_nothing_installed",
    ) else {
        return;
    };
    let yaml = &code_blocks("The SSH executor", "yaml")[0];
    let mut file: Value = serde_saphyr::from_str(yaml).expect("the README's nodes file parses");
    for key in [
        "known_hosts",
        "install_keel",
        "connect_timeout_s",
        "poll_interval_s",
    ] {
        assert!(
            file.get(key).is_some(),
            "the README's file sets {key}: {file}"
        );
    }
    assert_eq!(file["known_hosts"], "accept-new", "{file}");
    let dir = tempfile::tempdir().expect("tempdir");
    let data = dir.path().join("keel-data");
    let object = file.as_object_mut().expect("a mapping");
    object.remove("known_hosts_file");
    object.insert(
        "work_dir".into(),
        Value::from(dir.path().join("work").to_str().expect("utf-8")),
    );
    let mut node = object["nodes"][0].clone();
    node["host"] = "127.0.0.1".into();
    node["port"] = sshd.port.into();
    node["user"] = sshd.user.clone().into();
    node["key"] = sshd.key.to_str().expect("utf-8").into();
    node["gpus"] = "2xv100".into();
    object.insert("nodes".into(), Value::Array(vec![node]));
    let nodes = dir.path().join("nodes.yaml");
    std::fs::write(&nodes, serde_json::to_string(&file).expect("JSON is YAML")).expect("nodes");
    let server = ServerProcess::start(&data, &["--ssh-nodes", nodes.to_str().expect("utf-8")]);
    let root = root();
    let out = keel_ok(
        &root,
        &server.addr,
        &["submit", "-f", "examples/hello.yaml"],
    );
    assert!(out.contains("job 1 submitted"), "{out}");
    let done = wait_for("hello to succeed over SSH", || {
        let view = job(&root, &server.addr, 1);
        assert_ne!(view["state"], "failed", "{view}");
        (view["state"] == "succeeded").then_some(view)
    });
    assert_eq!(done["workers"][0]["node"], "gpu-a", "{done}");
    let known_hosts = std::fs::read_to_string(data.join("ssh_known_hosts")).unwrap_or_default();
    // One key, the host's (its name hashed, as OpenSSH writes it).
    assert_eq!(known_hosts.lines().count(), 1, "{known_hosts}");
    assert!(known_hosts.contains(" ssh-ed25519 "), "{known_hosts}");
    server.terminate();
}

/// The id of the member `keel cluster status -o json` shows leading.
fn leader_id(status: &Value) -> Option<u64> {
    status["members_status"]
        .as_array()?
        .iter()
        .find(|m| m["role"] == "leader")?["id"]
        .as_u64()
}

/// "Queues" (issue 23), line by line against a server whose simulated
/// GPUs are of the types the block names: each command is taken, and
/// `keel queue list` and `keel queue show` show what the lines before it
/// made.
#[test]
fn the_readme_queue_block_runs_as_written() {
    let dir = tempfile::tempdir().expect("tempdir");
    let server = ServerProcess::start(
        &dir.path().join("keel-data"),
        &["--simulated-gpus", "4xv100,2xa100,2xk80"],
    );
    let (root, addr) = (root(), server.addr.clone());
    wait_for("the node's GPUs", || {
        let nodes = keel_ok(&root, &addr, &["nodes", "-o", "json"]);
        nodes.contains("a100").then_some(())
    });
    let block = &sh_blocks("Queues")[0];
    let mut seen = Vec::new();
    for line in block {
        let words: Vec<&str> = line.command.split_whitespace().collect();
        let args = words
            .strip_prefix(&["keel"])
            .unwrap_or_else(|| panic!("not a keel command: {line:?}"));
        let out = keel_ok(&root, &addr, args);
        match args {
            ["queue", "list"] => {
                for name in ["default", "team-a", "team-b"] {
                    assert!(out.contains(name), "{line:?}: {out}");
                }
                assert!(out.contains("k80=4"), "the default queue's quota: {out}");
            }
            ["queue", "show", name] => {
                assert!(
                    out.contains(name) && out.contains("a100=8,v100=16"),
                    "{out}"
                );
                assert!(
                    out.lines().any(|l| l.contains(name) && l.contains(" 3 ")),
                    "weight 3: {out}"
                );
            }
            _ => {}
        }
        seen.push(args.join(" "));
    }
    let left = keel_ok(&root, &addr, &["queue", "list", "-o", "json"]);
    let names: Vec<String> = serde_json::from_str::<Value>(&left)
        .expect("JSON")
        .as_array()
        .expect("a list")
        .iter()
        .map(|q| q["name"].as_str().unwrap_or_default().to_string())
        .collect();
    assert_eq!(names, ["default", "team-a"], "after {seen:?}");
    server.terminate();
}

/// "Secrets": the block as written against a server holding a key; the
/// example job sees the value, and the delete waits for it to end (the
/// README says it is refused while the job is unfinished).
#[test]
fn the_readme_secrets_block_runs_as_written() {
    let dir = tempfile::tempdir().expect("tempdir");
    let made = std::process::Command::new(support::KEEL)
        .args(["secret", "new-key"])
        .output()
        .expect("keel secret new-key");
    let key = dir.path().join("secret.key");
    std::fs::write(&key, &made.stdout).expect("key file");
    let key_arg = key.display().to_string();
    let server = ServerProcess::start(
        &dir.path().join("keel-data"),
        &[
            "--simulated-gpus",
            "1xv100",
            "--round-s",
            "0.2",
            "--secret-key-file",
            &key_arg,
        ],
    );
    let (root, addr) = (root(), server.addr.clone());
    let block = &sh_blocks("Secrets")[0];
    let mut submitted = None;
    let mut seen = Vec::new();
    for line in block {
        let words: Vec<&str> = line.command.split_whitespace().collect();
        let args = words
            .strip_prefix(&["keel"])
            .unwrap_or_else(|| panic!("not a keel command: {line:?}"));
        if args.starts_with(&["secret", "delete"]) {
            let id = submitted.expect("the block submits before it deletes");
            wait_for("the example job to end", || {
                (job(&root, &addr, id)["state"] == "succeeded").then_some(())
            });
            let logs = keel_ok(&root, &addr, &["logs", &id.to_string()]);
            assert!(
                logs.contains("the tracker key is set, 12 bytes"),
                "the worker sees the value: {logs}"
            );
        }
        let out = keel_ok(&root, &addr, args);
        match args {
            ["secret", "list"] => {
                assert!(out.contains("tracker") && out.contains("api_key"), "{out}");
                assert!(!out.contains("wandb-abc123"), "a value shown: {out}");
            }
            ["submit", ..] => {
                let id: u64 = out
                    .split_whitespace()
                    .find_map(|w| w.parse().ok())
                    .unwrap_or_else(|| panic!("a job id in {out:?}"));
                let shown = keel_ok(&root, &addr, &["job", &id.to_string()]);
                assert!(
                    shown.contains("WANDB_API_KEY=<secret tracker/api_key>")
                        && shown.contains("LEARNING_RATE=0.10"),
                    "{shown}"
                );
                submitted = Some(id);
            }
            ["secret", "rotate-key"] => {
                assert!(out.contains("0 re-sealed, 1 already were"), "{out}");
            }
            _ => {}
        }
        seen.push(args.join(" "));
    }
    let left = keel_ok(&root, &addr, &["secret", "list", "-o", "json"]);
    assert!(left.contains("\"secrets\": []"), "after {seen:?}: {left}");
    server.terminate();
}
