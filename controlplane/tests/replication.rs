//! A three-replica cluster of real `keel server` processes on 127.0.0.1:
//! election, kill -9 of the leader under writes, re-election, the dead
//! member's restart, every acknowledged job on every replica, equal state
//! hashes at equal applied indexes, and a wiped member rejoining through a
//! snapshot. Waits are bounded polls, never fixed sleeps.

#[path = "support/otlp.rs"]
mod collector;
mod support;

use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Output, Stdio};
use std::time::{Duration, Instant};

use serde_json::Value;
use support::json_of;

const KEEL: &str = env!("CARGO_BIN_EXE_keel");

struct Replica {
    id: u64,
    addr: String,
    data: PathBuf,
    child: Option<Child>,
}

struct Cluster {
    replicas: Vec<Replica>,
    peers: String,
    /// What the cluster's helpers run the CLI with (a TLS client's
    /// `KEEL_TLS_*`; empty: plaintext).
    client_env: Vec<(&'static str, String)>,
    _dir: tempfile::TempDir,
}

/// A port no other test of this binary uses, free when chosen. Ports come
/// from below the kernel's ephemeral range (so servers binding port 0
/// elsewhere never take them) and each is handed out once per process (a
/// killed replica's port stays its own for its restart).
fn free_port() -> u16 {
    use std::sync::atomic::{AtomicU16, Ordering};
    static NEXT: AtomicU16 = AtomicU16::new(0);
    let base = 20_000 + (std::process::id() % 400) as u16 * 30;
    loop {
        let port = base + NEXT.fetch_add(1, Ordering::Relaxed) % 30_000;
        if std::net::TcpListener::bind(("127.0.0.1", port)).is_ok() {
            return port;
        }
    }
}

/// Polls `f` until it returns `Some`, for at most 60 s.
fn wait_for<T>(what: &str, mut f: impl FnMut() -> Option<T>) -> T {
    let deadline = Instant::now() + Duration::from_secs(60);
    loop {
        if let Some(v) = f() {
            return v;
        }
        assert!(Instant::now() < deadline, "timed out waiting for {what}");
        std::thread::sleep(Duration::from_millis(50));
    }
}

fn cli(addr: &str, args: &[&str]) -> Output {
    Command::new(KEEL)
        .args(args)
        .env("KEEL_ADDR", addr)
        .output()
        .expect("run keel CLI")
}

fn json(addr: &str, args: &[&str]) -> Option<Value> {
    let mut all = args.to_vec();
    all.extend(["-o", "json"]);
    let out = cli(addr, &all);
    if !out.status.success() {
        return None;
    }
    serde_json::from_slice(&out.stdout).ok()
}

impl Cluster {
    /// [`json`], as a client of this cluster ([`Cluster::client_env`]).
    fn json(&self, addr: &str, args: &[&str]) -> Option<Value> {
        let mut all = args.to_vec();
        all.extend(["-o", "json"]);
        let out = Command::new(KEEL)
            .args(&all)
            .env("KEEL_ADDR", addr)
            .envs(self.client_env.iter().map(|(k, v)| (k, v)))
            .output()
            .expect("run keel CLI");
        if !out.status.success() {
            return None;
        }
        serde_json::from_slice(&out.stdout).ok()
    }

    fn start(extra: &[&str]) -> Cluster {
        let mut cluster = Cluster::new();
        for id in 1..=3 {
            cluster.spawn(id, extra);
        }
        cluster
    }

    /// Three replicas' addresses and directories; none started.
    fn new() -> Cluster {
        let dir = tempfile::tempdir().expect("tempdir");
        let replicas: Vec<Replica> = (1..=3)
            .map(|id| Replica {
                id,
                addr: format!("127.0.0.1:{}", free_port()),
                data: dir.path().join(format!("r{id}")),
                child: None,
            })
            .collect();
        let peers = replicas
            .iter()
            .map(|r| format!("{}={}", r.id, r.addr))
            .collect::<Vec<_>>()
            .join(",");
        Cluster {
            replicas,
            peers,
            client_env: Vec::new(),
            _dir: dir,
        }
    }

    fn spawn(&mut self, id: u64, extra: &[&str]) {
        self.spawn_with_env(id, extra, &[]);
    }

    fn spawn_with_env(&mut self, id: u64, extra: &[&str], env: &[(&str, &str)]) {
        let peers = self.peers.clone();
        let r = &mut self.replicas[id as usize - 1];
        let log = std::fs::File::create(r.data.with_extension(format!("log{}", rand_suffix())))
            .expect("log file");
        // A replica given simulated GPUs declares a node (its own, `r{id}-0`,
        // unless the test names it); the others run none.
        let node = if !extra.contains(&"--simulated-gpus") {
            vec!["--no-local-node".to_string()]
        } else if extra.contains(&"--node-name") {
            Vec::new()
        } else {
            vec!["--node-name".to_string(), format!("r{id}")]
        };
        let child = Command::new(KEEL)
            .args(["server", "--id", &id.to_string()])
            .args(&node)
            .args(["--peers", &peers, "--listen", &r.addr, "--data-dir"])
            .arg(&r.data)
            .args(extra)
            .envs(env.iter().copied())
            .stdout(Stdio::null())
            .stderr(log)
            .spawn()
            .expect("spawn keel server");
        r.child = Some(child);
    }

    /// SIGTERM, and wait for a clean exit (the journal is flushed).
    fn terminate(&mut self, id: u64) {
        if let Some(mut c) = self.replicas[id as usize - 1].child.take() {
            let status = Command::new("kill")
                .args(["-TERM", &c.id().to_string()])
                .status()
                .expect("kill -TERM");
            assert!(status.success());
            let status = c.wait().expect("wait");
            assert!(status.success(), "replica {id} exited with {status}");
        }
    }

    /// SIGSTOP or SIGCONT.
    fn signal(&self, id: u64, signal: &str) {
        let c = self.replicas[id as usize - 1]
            .child
            .as_ref()
            .expect("a running replica");
        let status = Command::new("kill")
            .args([signal, &c.id().to_string()])
            .status()
            .expect("kill");
        assert!(status.success());
    }

    /// Everything replica `id` has logged so far (all its starts).
    fn logs(&self, id: u64) -> String {
        let prefix = format!("r{id}.log");
        std::fs::read_dir(self._dir.path())
            .map(|entries| {
                entries
                    .flatten()
                    .filter(|e| e.file_name().to_string_lossy().starts_with(&prefix))
                    .filter_map(|e| std::fs::read_to_string(e.path()).ok())
                    .collect()
            })
            .unwrap_or_default()
    }

    fn kill9(&mut self, id: u64) {
        if let Some(mut c) = self.replicas[id as usize - 1].child.take() {
            c.kill().expect("SIGKILL");
            c.wait().expect("reap");
        }
    }

    fn all_addrs(&self) -> String {
        self.replicas
            .iter()
            .map(|r| r.addr.clone())
            .collect::<Vec<_>>()
            .join(",")
    }

    fn status(&self, id: u64) -> Option<Value> {
        self.json(&self.replicas[id as usize - 1].addr, &["cluster", "status"])
    }

    /// The leader as the live replicas agree on it: the replica that says
    /// it leads in the highest term any live replica reports, named as the
    /// leader in that term by a majority of its voters (itself included).
    /// A replica restarted after a kill -9 may say for a moment that it
    /// still leads its old term (openraft resumes a committed vote of its
    /// own) while the others have elected a new leader; that is no leader.
    fn leader(&self) -> u64 {
        wait_for("a leader the live replicas agree on", || {
            let statuses: Vec<Value> = self
                .replicas
                .iter()
                .filter(|r| r.child.is_some())
                .filter_map(|r| self.status(r.id))
                .collect();
            let term = statuses.iter().filter_map(|s| s["term"].as_u64()).max()?;
            let claim = statuses
                .iter()
                .find(|s| s["role"] == "leader" && s["term"].as_u64() == Some(term))?;
            let id = claim["member_id"].as_u64()?;
            let voters: Vec<u64> = claim["voters"]
                .as_array()?
                .iter()
                .filter_map(Value::as_u64)
                .collect();
            let agree = statuses
                .iter()
                .filter(|s| s["term"].as_u64() == Some(term))
                .filter(|s| s["member_id"].as_u64().is_some_and(|m| voters.contains(&m)))
                .filter(|s| {
                    s["member_id"].as_u64() == Some(id) || s["leader_id"].as_u64() == Some(id)
                })
                .count();
            (agree > voters.len() / 2).then_some(id)
        })
    }

    /// Every replica's address, `leader`'s first, comma-separated: a CLI
    /// talks to the leader until it dies or stops answering.
    fn addrs_leader_first(&self, leader: u64) -> String {
        let (first, rest): (Vec<&Replica>, Vec<&Replica>) =
            self.replicas.iter().partition(|r| r.id == leader);
        first
            .iter()
            .chain(&rest)
            .map(|r| r.addr.as_str())
            .collect::<Vec<_>>()
            .join(",")
    }

    /// Waits until every live replica has applied the same index with the
    /// same state hash; returns (index, hash).
    fn converged(&self) -> (u64, String) {
        wait_for("the replicas to converge", || {
            let statuses: Vec<Value> = self
                .replicas
                .iter()
                .filter(|r| r.child.is_some())
                .map(|r| self.status(r.id))
                .collect::<Option<_>>()?;
            let first = statuses.first()?;
            let index = first["last_applied_index"].as_u64()?;
            let hash = first["state_hash"].as_str()?.to_string();
            statuses
                .iter()
                .all(|s| s["last_applied_index"] == index && s["state_hash"] == hash.as_str())
                .then_some((index, hash))
        })
    }

    fn submit(&self, addrs: &str, name: &str) -> Option<u64> {
        let spec = self._dir.path().join(format!("{name}.yaml"));
        std::fs::write(&spec, format!("name: {name}\ncommand: [\"true\"]\n")).expect("spec");
        self.json(addrs, &["submit", "-f", spec.to_str().expect("utf-8")])?["id"].as_u64()
    }

    /// Each node's (state, message), as the cluster sees it now.
    fn nodes(&self) -> Option<Vec<(String, String, String)>> {
        let v = self.json(&self.all_addrs(), &["nodes"])?;
        v.as_array().map(|a| {
            a.iter()
                .map(|n| {
                    let s = |k: &str| n[k].as_str().unwrap_or_default().to_string();
                    (s("name"), s("state"), s("message"))
                })
                .collect()
        })
    }

    /// Waits until node `name` is in `state`; fails if meanwhile a node in
    /// `stay_alive` is seen lost.
    fn wait_node(&self, name: &str, state: &str, stay_alive: &[String]) -> String {
        wait_for(&format!("node {name} to be {state}"), || {
            let nodes = self.nodes()?;
            for (n, s, m) in &nodes {
                assert!(
                    !(stay_alive.contains(n) && s == "lost"),
                    "node {n} was marked lost ({m}) though its replica runs"
                );
            }
            nodes
                .into_iter()
                .find(|(n, s, _)| n == name && s == state)
                .map(|(_, _, m)| m)
        })
    }

    /// The three first members are the voters and the only members, and
    /// the cluster still commits (a membership call that failed changed
    /// nothing).
    fn membership_is_as_it_was(&self, all: &str) {
        let status = self.json(all, &["cluster", "status"]).expect("status");
        assert_eq!(status["voters"], serde_json::json!([1, 2, 3]), "{status}");
        assert_eq!(
            status["members"].as_array().map(Vec::len),
            Some(3),
            "{status}"
        );
        self.submit(all, "after")
            .expect("the cluster still commits");
    }

    fn jobs_on(&self, id: u64) -> BTreeSet<u64> {
        self.json(&self.replicas[id as usize - 1].addr, &["--stale", "jobs"])
            .and_then(|v| {
                v.as_array()
                    .map(|a| a.iter().filter_map(|j| j["id"].as_u64()).collect())
            })
            .unwrap_or_default()
    }
}

/// A distinct suffix for each log file of a replica (one per start).
fn rand_suffix() -> String {
    use std::sync::atomic::{AtomicU32, Ordering};
    static NEXT: AtomicU32 = AtomicU32::new(0);
    NEXT.fetch_add(1, Ordering::Relaxed).to_string()
}

impl Drop for Cluster {
    #[allow(clippy::print_stderr)]
    fn drop(&mut self) {
        if std::thread::panicking() {
            // The replicas' own words, for the failure report.
            if let Ok(entries) = std::fs::read_dir(self._dir.path()) {
                for e in entries.flatten() {
                    let name = e.file_name().to_string_lossy().to_string();
                    if name.contains(".log") {
                        let text = std::fs::read_to_string(e.path()).unwrap_or_default();
                        let tail: Vec<&str> = text.lines().rev().take(40).collect();
                        eprintln!("==> {name} <==");
                        let mut lines = text.lines();
                        while let Some(line) = lines.next() {
                            if line.contains("panicked at") {
                                eprintln!("{line}");
                                for more in lines.by_ref().take(3) {
                                    eprintln!("{more}");
                                }
                            }
                        }
                        eprintln!("[...]");
                        for line in tail.into_iter().rev() {
                            eprintln!("{line}");
                        }
                    }
                }
            }
        }
        for r in &mut self.replicas {
            if let Some(mut c) = r.child.take() {
                let _ = c.kill();
                let _ = c.wait();
            }
        }
    }
}

#[test]
fn killing_the_leader_loses_nothing_and_the_replicas_agree() {
    let mut cluster = Cluster::start(&[]);
    let first = cluster.leader();
    let all = cluster.all_addrs();
    let mut acked = BTreeSet::new();
    // Writes through a follower are forwarded to the leader.
    let follower = cluster
        .replicas
        .iter()
        .find(|r| r.id != first)
        .map(|r| r.addr.clone())
        .expect("a follower");
    for i in 0..10 {
        acked.insert(
            cluster
                .submit(&follower, &format!("before-{i}"))
                .expect("acknowledged"),
        );
    }
    // Issue 26: each follower holds a stream to the leader's process, so
    // that it sees the process end at once.
    let survivors: Vec<u64> = (1..=3).filter(|id| *id != first).collect();
    wait_for("the followers to follow the leader's process", || {
        survivors
            .iter()
            .all(|id| cluster.logs(*id).contains("following the leader's process"))
            .then_some(())
    });
    cluster.kill9(first);
    // The CLI fails over between addresses and retries while there is no
    // leader; every write that returns is acknowledged.
    for i in 0..10 {
        if let Some(id) = cluster.submit(&all, &format!("during-{i}")) {
            acked.insert(id);
        }
    }
    let second = cluster.leader();
    assert_ne!(first, second, "a new leader was elected");
    // They stood at once rather than after their election timeout.
    let stood: Vec<u64> = survivors
        .iter()
        .copied()
        .filter(|id| cluster.logs(*id).contains("the leader's process is gone"))
        .collect();
    assert!(
        !stood.is_empty(),
        "no survivor saw the leader's process end: {}",
        cluster.logs(second)
    );
    assert!(
        acked.len() >= 15,
        "writes went on after the failover: {acked:?}"
    );
    // The dead member comes back and catches up.
    cluster.spawn(first, &[]);
    let (index, hash) = cluster.converged();
    assert!(index > 0);
    for r in 1..=3 {
        let jobs = cluster.jobs_on(r);
        assert!(
            acked.is_subset(&jobs),
            "replica {r} lacks {:?}",
            acked.difference(&jobs)
        );
        assert_eq!(
            jobs.len(),
            acked.len(),
            "replica {r} has jobs nobody acknowledged"
        );
    }
    // SIGKILLed: the journal (written behind the state machine) may have
    // lost its tail; the replay takes the committed entries past it from the
    // Raft log.
    cluster.kill9(1);
    let replica = &cluster.replicas[0];
    // Offline replay of its data directory reaches the live replicas' hash
    // at the index they agreed on, and a replay up to now reaches at least
    // that.
    let replay = |extra: &[&str]| -> Value {
        json_of(
            Command::new(KEEL)
                .args(["replay", "-o", "json", "--data-dir"])
                .arg(&replica.data)
                .args(extra),
        )
    };
    let at_index = replay(&["--until", &index.to_string()]);
    assert_eq!(at_index["state_hash"], hash.as_str(), "{at_index}");
    let now = humantime::format_rfc3339_millis(std::time::SystemTime::now()).to_string();
    let at_now = replay(&["--at", &now]);
    assert!(at_now["last_index"].as_u64() >= Some(index), "{at_now}");
    let before = replay(&["--at", "2000-01-01T00:00:00Z"]);
    assert_eq!(before["last_index"], 0, "{before}");
    // A data directory of this cluster refuses a different member set.
    let refused = Command::new(KEEL)
        .args([
            "server",
            "--no-local-node",
            "--id",
            "1",
            "--listen",
            "127.0.0.1:0",
        ])
        .args([
            "--peers",
            &format!("1={},9=127.0.0.1:1", replica.addr),
            "--data-dir",
        ])
        .arg(&replica.data)
        .stderr(Stdio::piped())
        .output()
        .expect("run");
    assert!(!refused.status.success());
    let err = String::from_utf8_lossy(&refused.stderr);
    assert!(err.contains("different members"), "{err}");
    assert!(err.contains("{1,2,3}") && err.contains("{1,9}"), "{err}");
}

/// Issue 22, item 1: three replicas over mutual TLS, with the certificates
/// `keel tls init` made, elect, replicate, forward writes and fail over
/// (every Raft message and forwarded write carries a member certificate),
/// a killed member catches up again, and a caller without a certificate
/// from their CA gets nothing.
#[test]
fn a_cluster_over_mutual_tls_replicates_and_fails_over_and_refuses_plaintext() {
    let mut cluster = Cluster::new();
    let certs = support::init_certs(cluster._dir.path());
    let env_of = |holder: &str| tls_env(&certs, holder);
    cluster.client_env = env_of("client-admin");
    let spawn = |cluster: &mut Cluster, id: u64| {
        let env = env_of(&format!("member-{id}"));
        let env: Vec<(&str, &str)> = env.iter().map(|(k, v)| (*k, v.as_str())).collect();
        cluster.spawn_with_env(id, &[], &env);
    };
    for id in 1..=3 {
        spawn(&mut cluster, id);
    }
    let first = cluster.leader();
    let follower = cluster
        .replicas
        .iter()
        .find(|r| r.id != first)
        .map(|r| r.addr.clone())
        .expect("a follower");
    let mut acked = BTreeSet::new();
    for i in 0..3 {
        acked.insert(
            cluster
                .submit(&follower, &format!("before-{i}"))
                .expect("acknowledged through a follower"),
        );
    }
    cluster.kill9(first);
    let second = cluster.leader();
    assert_ne!(first, second, "a new leader was elected over TLS");
    acked.insert(
        cluster
            .submit(&cluster.all_addrs(), "after")
            .expect("acknowledged after the failover"),
    );
    spawn(&mut cluster, first);
    cluster.converged();
    for r in 1..=3 {
        assert_eq!(cluster.jobs_on(r), acked, "replica {r}");
    }
    // Who asked is in the log (issue 22, item 3): the submissions through
    // a follower were forwarded with the client's identity, and every
    // replica keeps it.
    for r in &cluster.replicas {
        for id in &acked {
            let view = cluster
                .json(&r.addr, &["--stale", "job", &id.to_string()])
                .expect("the job");
            assert_eq!(
                view["submitted_by"], "cert:admin",
                "replica {}: {view}",
                r.id
            );
        }
    }
    let first_job = acked.iter().next().expect("a job").to_string();
    let why = Command::new(KEEL)
        .args(["why", &first_job])
        .env("KEEL_ADDR", &follower)
        .envs(cluster.client_env.iter().map(|(k, v)| (k, v)))
        .output()
        .expect("keel why");
    let why = String::from_utf8_lossy(&why.stdout);
    assert!(
        why.contains("submit_job") && why.contains("(by cert:admin)"),
        "{why}"
    );
    // Without TLS: nothing, and a hint.
    let plain = cli(&follower, &["jobs"]);
    assert!(!plain.status.success());
    let said = String::from_utf8_lossy(&plain.stderr);
    assert!(
        said.contains("if the server uses TLS, give --tls-ca"),
        "{said}"
    );
    assert!(
        (1..=3).any(|r| cluster.logs(r).contains("its TLS handshake failed")),
        "a replica logged the refused handshake"
    );
}

/// Issue 22, item 2: with ACLs on, a follower forwards its caller's token
/// and certificate name, and the leader decides from them: a user's write
/// through a follower is recorded as the user's, a right the user lacks is
/// refused there too, a revocation holds on every replica, and the tokens
/// survive a failover.
#[test]
fn a_cluster_with_acls_decides_on_the_leader_for_callers_of_its_followers() {
    let mut cluster = Cluster::new();
    let certs = support::init_certs(cluster._dir.path());
    let env_of = |holder: &str| tls_env(&certs, holder);
    cluster.client_env = env_of("client-admin");
    for id in 1..=3 {
        let mut env = env_of(&format!("member-{id}"));
        env.push(("KEEL_ACL", "1".into()));
        let env: Vec<(&str, &str)> = env.iter().map(|(k, v)| (*k, v.as_str())).collect();
        cluster.spawn_with_env(id, &[], &env);
    }
    let leader = cluster.leader();
    let followers: Vec<String> = cluster
        .replicas
        .iter()
        .filter(|r| r.id != leader)
        .map(|r| r.addr.clone())
        .collect();
    let root_file = cluster._dir.path().join("root.token");
    let alice_file = cluster._dir.path().join("alice.token");
    let client_env = cluster.client_env.clone();
    let as_holder = |addr: &str, token: Option<&std::path::Path>, args: &[&str]| {
        let mut command = Command::new(KEEL);
        command
            .args(args)
            .env("KEEL_ADDR", addr)
            .envs(client_env.iter().map(|(k, v)| (k, v)));
        if let Some(file) = token {
            command.env("KEEL_TOKEN_FILE", file);
        }
        command.output().expect("keel")
    };
    let ok = |out: Output| {
        assert!(
            out.status.success(),
            "{}",
            String::from_utf8_lossy(&out.stderr)
        );
        String::from_utf8_lossy(&out.stdout).to_string()
    };
    // Bootstrap and a user token, both through a follower.
    ok(as_holder(
        &followers[0],
        None,
        &[
            "acl",
            "bootstrap",
            "--secret-file",
            root_file.to_str().expect("utf-8"),
        ],
    ));
    ok(as_holder(
        &followers[0],
        Some(&root_file),
        &[
            "acl",
            "token",
            "create",
            "--name",
            "alice",
            "--role",
            "user",
            "--secret-file",
            alice_file.to_str().expect("utf-8"),
        ],
    ));
    // A certificate alone, forwarded: a user named by the certificate.
    let who = ok(as_holder(&followers[1], None, &["acl", "whoami"]));
    assert_eq!(who.trim(), "cert:admin, role user");
    // Alice submits through a follower: the job is hers on every replica.
    let spec = cluster._dir.path().join("alices.yaml");
    std::fs::write(&spec, "name: alices\ncommand: [\"true\"]\n").expect("spec");
    let submitted = ok(as_holder(
        &followers[1],
        Some(&alice_file),
        &["-o", "json", "submit", "-f", spec.to_str().expect("utf-8")],
    ));
    let job: Value = serde_json::from_str(&submitted).expect("json");
    let job = job["id"].as_u64().expect("an id").to_string();
    cluster.converged();
    for r in &cluster.replicas {
        let view = ok(as_holder(
            &r.addr,
            Some(&root_file),
            &["--stale", "-o", "json", "job", &job],
        ));
        let view: Value = serde_json::from_str(&view).expect("json");
        assert_eq!(view["submitted_by"], "token:alice", "replica {}", r.id);
    }
    // What a user may not do, it may not do through a follower either.
    let refused = as_holder(&followers[0], Some(&alice_file), &["policy", "set", "fifo"]);
    assert!(!refused.status.success());
    let said = String::from_utf8_lossy(&refused.stderr);
    assert!(
        said.contains("token:alice (role user) may not set-policy"),
        "{said}"
    );
    // Revoked through one follower, refused through the other (once it
    // has applied the revocation: no stale read says otherwise for long).
    ok(as_holder(
        &followers[0],
        Some(&root_file),
        &["acl", "token", "revoke", "alice"],
    ));
    let refused = as_holder(&followers[1], Some(&alice_file), &["jobs"]);
    assert!(!refused.status.success());
    let said = String::from_utf8_lossy(&refused.stderr);
    assert!(said.contains("not one of this cluster's"), "{said}");
    // The tokens outlive the leader.
    cluster.kill9(leader);
    let second = cluster.leader();
    assert_ne!(second, leader);
    let list = ok(as_holder(
        &cluster.all_addrs(),
        Some(&root_file),
        &["-o", "json", "acl", "token", "list"],
    ));
    let list: Value = serde_json::from_str(&list).expect("json");
    let names: Vec<&str> = list
        .as_array()
        .expect("a list")
        .iter()
        .filter_map(|t| t["name"].as_str())
        .collect();
    assert_eq!(names, ["root"]);
    // A membership change records who asked, as an audit entry beside the
    // Raft membership entry (which carries no actor).
    ok(as_holder(
        &cluster.all_addrs(),
        Some(&root_file),
        &["cluster", "remove", "--id", &leader.to_string()],
    ));
    let events = ok(as_holder(
        &cluster.all_addrs(),
        Some(&root_file),
        &["events"],
    ));
    let audit = events
        .lines()
        .find(|l| l.contains("record_membership_change"))
        .unwrap_or_else(|| panic!("no audit entry for the removal:\n{events}"));
    assert!(
        audit.contains(&format!("member {leader} removed")) && audit.ends_with("(by token:root)"),
        "{audit}"
    );
}

/// The `KEEL_TLS_*` environment of `holder`'s certificate, as text.
fn tls_env(certs: &Path, holder: &str) -> Vec<(&'static str, String)> {
    support::tls_env(certs, holder)
        .into_iter()
        .map(|(k, v)| (k, v.to_string_lossy().into_owned()))
        .collect()
}

/// Issue 19, item 4: submissions in flight when the leader is killed are
/// sent again by the CLI under the same request id (their answers were
/// lost); each is one job, under the id its CLI printed.
#[test]
fn submissions_in_flight_at_a_kill_9_are_retried_and_applied_once() {
    let mut cluster = Cluster::start(&[]);
    let leader = cluster.leader();
    // The leader first: the CLIs talk to it until it dies.
    let addrs = cluster.addrs_leader_first(leader);
    let (done_tx, done_rx) = std::sync::mpsc::channel();
    let submitters: Vec<_> = (0..16)
        .map(|t| {
            let addrs = addrs.clone();
            let dir = cluster._dir.path().to_path_buf();
            let done = done_tx.clone();
            std::thread::spawn(move || {
                (0..3)
                    .map(|i| {
                        let name = format!("inflight-{t}-{i}");
                        let spec = dir.join(format!("{name}.yaml"));
                        std::fs::write(&spec, format!("name: {name}\ncommand: [\"true\"]\n"))
                            .expect("spec");
                        let id = json(&addrs, &["submit", "-f", spec.to_str().expect("utf-8")])
                            .and_then(|v| v["id"].as_u64());
                        let _ = done.send(());
                        (name, id)
                    })
                    .collect::<Vec<_>>()
            })
        })
        .collect();
    // Killed once the first answer came: the others are in flight.
    done_rx.recv().expect("a first answer");
    cluster.kill9(leader);
    let answers: Vec<(String, Option<u64>)> = submitters
        .into_iter()
        .flat_map(|s| s.join().expect("submitter"))
        .collect();
    for (name, id) in &answers {
        assert!(id.is_some(), "{name} was not acknowledged");
    }
    cluster.spawn(leader, &[]);
    cluster.converged();
    for r in 1..=3 {
        let jobs = json(&cluster.replicas[r - 1].addr, &["--stale", "jobs"]).expect("jobs");
        let by_name: BTreeMap<String, Vec<u64>> =
            jobs.as_array()
                .expect("a list")
                .iter()
                .fold(BTreeMap::new(), |mut m, j| {
                    m.entry(j["name"].as_str().unwrap_or_default().to_string())
                        .or_insert_with(Vec::new)
                        .push(j["id"].as_u64().unwrap_or_default());
                    m
                });
        assert_eq!(by_name.len(), answers.len(), "replica {r}: {by_name:?}");
        for (name, id) in &answers {
            assert_eq!(
                by_name.get(name),
                Some(&vec![id.unwrap_or_default()]),
                "replica {r}: {name} is not exactly the job its client was told"
            );
        }
    }
}

/// Issue 19, item 11: a shutdown is bounded. A leader whose peers are gone
/// holds a write that can never commit (an answer the API waits for);
/// SIGTERM still ends it, at --shutdown-timeout-s, with status 2 and the
/// step it was stuck at in its log.
#[test]
fn a_shutdown_that_cannot_finish_ends_at_its_deadline() {
    let extra = ["--stop-grace-s", "0.2", "--shutdown-timeout-s", "3"];
    let mut cluster = Cluster::start(&extra);
    let leader = cluster.leader();
    let addr = cluster.replicas[leader as usize - 1].addr.clone();
    // One write committed first: the leader has stamped in its term (its
    // first stamp waits until it applied its log, which needs a quorum).
    cluster.submit(&addr, "first").expect("acknowledged");
    for id in (1..=3).filter(|id| *id != leader) {
        cluster.kill9(id);
    }
    let spec = cluster._dir.path().join("stuck.yaml");
    std::fs::write(&spec, "name: stuck\ncommand: [\"true\"]\n").expect("spec");
    let mut submit = Command::new(KEEL)
        .args(["submit", "-f", spec.to_str().expect("utf-8")])
        .env("KEEL_ADDR", &addr)
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .expect("keel submit");
    // The write is in the leader's log, and not committed.
    wait_for("the write appended but not committed", || {
        let s = cluster.status(leader)?;
        (s["last_log_index"].as_u64()? > s["last_applied_index"].as_u64()?).then_some(())
    });
    // SIGTERM while the client still waits for its answer.
    cluster.signal(leader, "-TERM");
    let child = cluster.replicas[leader as usize - 1]
        .child
        .as_mut()
        .expect("the leader runs");
    let status = wait_for("the leader to exit after SIGTERM", || {
        child.try_wait().expect("wait")
    });
    cluster.replicas[leader as usize - 1].child = None;
    let _ = submit.kill();
    let _ = submit.wait();
    assert_eq!(status.code(), Some(2), "{status}");
    let log = cluster.logs(leader);
    assert!(log.contains("the shutdown did not finish in time"), "{log}");
}

#[test]
fn a_wiped_member_rejoins_through_a_snapshot() {
    let args = ["--snapshot-every", "20", "--keep-log-entries", "0"];
    let mut cluster = Cluster::start(&args);
    let leader = cluster.leader();
    let victim = (1..=3).find(|r| *r != leader).expect("a follower");
    cluster.kill9(victim);
    let data: &Path = &cluster.replicas[victim as usize - 1].data;
    std::fs::remove_dir_all(data).expect("wipe");
    let leader_addr = cluster.replicas[leader as usize - 1].addr.clone();
    let mut acked = BTreeSet::new();
    for i in 0..60 {
        acked.insert(
            cluster
                .submit(&leader_addr, &format!("job-{i}"))
                .expect("acknowledged"),
        );
    }
    // The leader has snapshotted and purged its log: the wiped member can
    // only catch up by installing the snapshot.
    cluster.spawn(victim, &args);
    let (_, hash) = cluster.converged();
    assert_eq!(cluster.jobs_on(victim), acked);
    assert_eq!(
        cluster.status(victim).expect("status")["state_hash"],
        hash.as_str()
    );
}

/// Issue 28's reproduction: an acknowledged job must survive a member that
/// lost its disk meeting a member that fell behind while the leader is
/// paused. The empty member is a new incarnation: it refuses to vote, so
/// the two cannot elect a leader that lacks the job; when the old leader
/// wakes, it re-admits the empty member (a learner, then a voter) and
/// every replica holds the job.
#[test]
fn a_member_that_lost_its_disk_cannot_elect_a_leader_that_lacks_acknowledged_jobs() {
    let mut cluster = Cluster::start(&[]);
    let leader = cluster.leader();
    let leader_addr = cluster.replicas[leader as usize - 1].addr.clone();
    let followers: Vec<u64> = (1..=3).filter(|r| *r != leader).collect();
    let (lagging, wiped) = (followers[0], followers[1]);
    let before = cluster
        .submit(&leader_addr, "before")
        .expect("acknowledged");
    cluster.converged();
    let old_incarnation = cluster.status(wiped).expect("status")["incarnation"].clone();
    // One follower falls behind; the leader commits X with the other.
    cluster.signal(lagging, "-STOP");
    let x = cluster.submit(&leader_addr, "x").expect("acknowledged");
    // The leader freezes; the follower that holds X loses its disk.
    cluster.signal(leader, "-STOP");
    cluster.kill9(wiped);
    std::fs::remove_dir_all(&cluster.replicas[wiped as usize - 1].data).expect("wipe");
    cluster.spawn(wiped, &[]);
    cluster.signal(lagging, "-CONT");
    // The lagging member asks the empty one for its vote: refused, or (were
    // there no incarnations) granted, and the two elect a leader without X.
    wait_for(
        "the lagging member to ask the empty one for its vote",
        || {
            let refused = cluster
                .logs(wiped)
                .contains("a member whose data directory is new takes no part");
            let elected = [lagging, wiped]
                .iter()
                .any(|r| cluster.status(*r).is_some_and(|s| s["role"] == "leader"));
            (refused || elected).then_some(())
        },
    );
    // The old leader wakes, leads (or steps down to the one with its log)
    // and re-admits the empty member.
    cluster.signal(leader, "-CONT");
    let (_, hash) = cluster.converged();
    for r in 1..=3 {
        let jobs = cluster.jobs_on(r);
        assert!(
            jobs.contains(&before) && jobs.contains(&x),
            "replica {r} holds {jobs:?}, not the acknowledged {before} and {x}"
        );
        assert_eq!(
            cluster.status(r).expect("status")["state_hash"],
            hash.as_str()
        );
    }
    let new_incarnation = cluster.status(wiped).expect("status")["incarnation"].clone();
    assert_ne!(
        new_incarnation, old_incarnation,
        "a new data directory, a new incarnation"
    );
    wait_for(
        "the empty member to be a voter under its new incarnation",
        || {
            let status = json(&cluster.all_addrs(), &["cluster", "status"])?;
            let members = status["members"].as_array()?;
            (members.len() == 3
                && members.iter().any(|m| {
                    m["id"] == wiped && m["incarnation"] == new_incarnation && m["voter"] == true
                }))
            .then_some(())
        },
    );
    // And the cluster goes on with all three.
    let after = cluster
        .submit(&cluster.all_addrs(), "after")
        .expect("acknowledged");
    cluster.converged();
    for r in 1..=3 {
        assert!(cluster.jobs_on(r).contains(&after));
    }
}

/// The lowest id, wiped and started while the rest of its cluster is down,
/// must not found a cluster of its own: it waits for a majority of its
/// peers to answer, finds the cluster there and rejoins it.
#[test]
fn a_wiped_first_member_waits_for_its_peers_instead_of_founding_a_cluster() {
    let mut cluster = Cluster::start(&[]);
    let leader = cluster.leader();
    let leader_addr = cluster.replicas[leader as usize - 1].addr.clone();
    let job = cluster
        .submit(&leader_addr, "before")
        .expect("acknowledged");
    cluster.converged();
    let cluster_id = cluster.status(1).expect("status")["cluster_id"].clone();
    for id in 1..=3 {
        cluster.terminate(id);
    }
    std::fs::remove_dir_all(&cluster.replicas[0].data).expect("wipe");
    // Replica 1's log files (one per start).
    let logs_of_1 = |dir: &Path| -> BTreeSet<PathBuf> {
        std::fs::read_dir(dir)
            .map(|entries| {
                entries
                    .flatten()
                    .filter(|e| e.file_name().to_string_lossy().starts_with("r1.log"))
                    .map(|e| e.path())
                    .collect()
            })
            .unwrap_or_default()
    };
    let before = logs_of_1(cluster._dir.path());
    cluster.spawn(1, &[]);
    let restarted = || -> String {
        logs_of_1(cluster._dir.path())
            .difference(&before)
            .filter_map(|p| std::fs::read_to_string(p).ok())
            .collect()
    };
    wait_for("replica 1 to wait for a majority of its peers", || {
        restarted()
            .contains("waiting for a majority of --peers to answer")
            .then_some(())
    });
    assert!(
        !restarted().contains("initialised the cluster"),
        "replica 1 founded a cluster alone"
    );
    cluster.spawn(2, &[]);
    cluster.spawn(3, &[]);
    cluster.converged();
    assert_eq!(cluster.status(1).expect("status")["cluster_id"], cluster_id);
    assert!(cluster.jobs_on(1).contains(&job));
}

#[test]
fn members_are_added_as_learners_promoted_and_removed() {
    let mut cluster = Cluster::start(&[]);
    let leader = cluster.leader();
    let leader_addr = cluster.replicas[leader as usize - 1].addr.clone();
    cluster
        .submit(&leader_addr, "before")
        .expect("acknowledged");
    // A fourth replica starts knowing the cluster; it waits to be added.
    let addr4 = format!("127.0.0.1:{}", free_port());
    let data4 = cluster._dir.path().join("r4");
    cluster.peers = format!("{},4={addr4}", cluster.peers);
    cluster.replicas.push(Replica {
        id: 4,
        addr: addr4.clone(),
        data: data4,
        child: None,
    });
    cluster.spawn(4, &[]);
    let added = json(
        &cluster.all_addrs(),
        &["cluster", "add", "--id", "4", "--member-addr", &addr4],
    )
    .expect("added");
    assert_eq!(added["voters"], serde_json::json!([1, 2, 3, 4]));
    // A learner only: it answers with the index of its membership entry.
    let addr5 = format!("127.0.0.1:{}", free_port());
    cluster.peers = format!("{},5={addr5}", cluster.peers);
    cluster.replicas.push(Replica {
        id: 5,
        addr: addr5.clone(),
        data: cluster._dir.path().join("r5"),
        child: None,
    });
    cluster.spawn(5, &[]);
    let learner = json(
        &cluster.all_addrs(),
        &[
            "cluster",
            "add",
            "--id",
            "5",
            "--member-addr",
            &addr5,
            "--learner-only",
        ],
    )
    .expect("added as a learner");
    assert_eq!(learner["learners"], serde_json::json!([5]), "{learner}");
    assert!(learner["index"].as_u64() > Some(0), "{learner}");
    cluster
        .submit(&addr4, "through-the-new-member")
        .expect("acknowledged");
    cluster.converged();
    assert_eq!(cluster.jobs_on(4).len(), 2);

    // Remove a follower; the cluster goes on without it.
    let gone = (1..=3).find(|r| *r != leader).expect("a follower");
    let removed = json(
        &cluster.all_addrs(),
        &["cluster", "remove", "--id", &gone.to_string()],
    )
    .expect("removed");
    let voters: Vec<u64> = removed["voters"]
        .as_array()
        .expect("voters")
        .iter()
        .filter_map(Value::as_u64)
        .collect();
    assert!(!voters.contains(&gone) && voters.len() == 3, "{removed}");
    cluster.kill9(gone);
    cluster
        .submit(&cluster.all_addrs(), "after")
        .expect("acknowledged");
    let status = json(&leader_addr, &["cluster", "status"]).expect("status");
    let members: Vec<u64> = status["members_status"]
        .as_array()
        .expect("members")
        .iter()
        .filter_map(|m| m["id"].as_u64())
        .collect();
    assert!(!members.contains(&gone), "{status}");
    assert!(status["members_status"]
        .as_array()
        .expect("members")
        .iter()
        .all(|m| m["replication_lag"].as_u64().is_some()));
}

/// Issue 19's one-call wedge: a member added at an address where nothing
/// answers used to become a voter nobody could reach (every later write
/// timed out). The leader now asks the address who it is first (its member
/// id and incarnation), so the call fails at once and the membership and
/// the cluster's writes are as before.
#[test]
fn adding_a_member_where_nothing_answers_changes_nothing() {
    let cluster = Cluster::start(&[]);
    cluster.leader();
    let all = cluster.all_addrs();
    let dead = format!("127.0.0.1:{}", free_port());
    for extra in [&[][..], &["--learner-only"][..]] {
        let mut args = vec!["cluster", "add", "--id", "4", "--member-addr", &dead];
        args.extend(extra);
        let out = cli(&all, &args);
        assert!(!out.status.success(), "added a member nobody runs");
        let err = String::from_utf8_lossy(&out.stderr);
        assert!(err.contains("who it is"), "{err}");
    }
    // A member id beyond the 16 bits a Raft id keeps for it.
    let out = cli(
        &all,
        &["cluster", "add", "--id", "70000", "--member-addr", &dead],
    );
    assert!(!out.status.success(), "added member 70000");
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        err.contains("id: 70000 is more than the largest member id, 65535"),
        "{err}"
    );
    cluster.membership_is_as_it_was(&all);
}

/// Issue 19, item 1: a new member that answers who it is but never catches
/// up (here: a replica of another cluster, which refuses this cluster's
/// messages) is removed again at the deadline; the call fails with the
/// reason and the membership is as it was.
#[test]
fn a_learner_that_does_not_catch_up_is_removed_at_the_deadline() {
    let mut cluster = Cluster::start(&[]);
    cluster.leader();
    let all = cluster.all_addrs();
    // Member 4 of a cluster of its own.
    let addr4 = format!("127.0.0.1:{}", free_port());
    cluster.replicas.push(Replica {
        id: 4,
        addr: addr4.clone(),
        data: cluster._dir.path().join("r4"),
        child: None,
    });
    let saved = std::mem::replace(&mut cluster.peers, format!("4={addr4}"));
    cluster.spawn(4, &[]);
    cluster.peers = saved;
    // Its own cluster exists (a blank replica would join ours instead).
    wait_for("member 4 to lead its own cluster", || {
        (cluster.status(4)?["role"] == "leader").then_some(())
    });
    let out = cli(
        &all,
        &[
            "cluster",
            "add",
            "--id",
            "4",
            "--member-addr",
            &addr4,
            "--catch-up-timeout-s",
            "2",
        ],
    );
    assert!(
        !out.status.success(),
        "added a member that cannot catch up: {}\n{}",
        String::from_utf8_lossy(&out.stdout),
        cluster.logs(4)
    );
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("did not catch up within 2 s"), "{err}");
    assert!(err.contains("removed again"), "{err}");
    assert!(err.contains("FailedPrecondition"), "{err}");
    cluster.membership_is_as_it_was(&all);
}

#[test]
fn a_snapshot_of_tens_of_megabytes_installs() {
    let args = ["--snapshot-every", "8", "--keep-log-entries", "0"];
    let mut cluster = Cluster::start(&args);
    let leader = cluster.leader();
    let victim = (1..=3).find(|r| *r != leader).expect("a follower");
    cluster.kill9(victim);
    std::fs::remove_dir_all(&cluster.replicas[victim as usize - 1].data).expect("wipe");
    // 32 jobs of about 1 MB each (250 arguments of 4,000 bytes).
    let arg = "a".repeat(4000);
    let mut body = String::from("name: big\ncommand:\n  - \"true\"\n");
    for _ in 0..250 {
        body.push_str(&format!("  - {arg}\n"));
    }
    let spec = cluster._dir.path().join("big.yaml");
    std::fs::write(&spec, body).expect("spec");
    let leader_addr = cluster.replicas[leader as usize - 1].addr.clone();
    for _ in 0..32 {
        json(
            &leader_addr,
            &["submit", "-f", spec.to_str().expect("utf-8")],
        )
        .expect("acknowledged");
    }
    cluster.spawn(victim, &args);
    let (_, hash) = cluster.converged();
    assert_eq!(cluster.jobs_on(victim).len(), 32);
    assert_eq!(
        cluster.status(victim).expect("status")["state_hash"],
        hash.as_str()
    );
}

/// Node liveness follows leadership: every replica reports its own node to
/// the leader; a SIGKILLed replica's node is marked lost after the timeout
/// and recovers when the replica is back; a new leader starts its timers
/// afresh and loses no node that still reports.
#[test]
fn a_silent_node_is_marked_lost_and_timers_follow_the_leader() {
    let mut cluster = Cluster::start(&["--simulated-gpus", "1xv100", "--node-timeout-s", "2"]);
    let extra = ["--simulated-gpus", "1xv100", "--node-timeout-s", "2"];
    let name = |id: u64| format!("r{id}-0");
    let leader = cluster.leader();
    for id in 1..=3 {
        cluster.wait_node(&name(id), "alive", &[]);
    }
    let follower = (1..=3).find(|id| *id != leader).expect("a follower");
    let others =
        |dead: u64| -> Vec<String> { (1..=3).filter(|id| *id != dead).map(name).collect() };

    // A follower dies: its node goes lost, the others do not.
    cluster.kill9(follower);
    let why = cluster.wait_node(&name(follower), "lost", &others(follower));
    assert!(why.contains("no heartbeat"), "reason: {why}");
    cluster.spawn(follower, &extra);
    cluster.wait_node(&name(follower), "alive", &others(follower));

    // The leader dies: the new leader's timers start, the dead leader's
    // node goes lost, and no node that still reports is lost meanwhile.
    cluster.kill9(leader);
    let second = cluster.leader();
    assert_ne!(second, leader);
    let why = cluster.wait_node(&name(leader), "lost", &others(leader));
    assert!(why.contains("no heartbeat"), "reason: {why}");
    cluster.spawn(leader, &extra);
    cluster.wait_node(&name(leader), "alive", &[]);
    cluster.converged();
}

/// A new leader re-adopts the workers the last one started: three replicas
/// on one machine share the executor's directory and declare the same node;
/// the leader is SIGKILLed while a job runs; the job's worker goes on under
/// its supervisor, the new leader takes it over (no second launch, no new
/// epoch) and records its exit when it finishes.
#[test]
fn a_new_leader_re_adopts_the_running_workers() {
    let shared = tempfile::tempdir().expect("tempdir");
    let _reaper = support::WorkerReaper(shared.path().to_path_buf());
    let shared_dir = shared.path().to_str().expect("utf-8").to_string();
    let extra = [
        "--simulated-gpus",
        "1xv100",
        "--node-name",
        "m",
        "--executor-dir",
        &shared_dir,
    ];
    let mut cluster = Cluster::start(&extra);
    let leader = cluster.leader();
    let all = cluster.all_addrs();
    cluster.wait_node("m-0", "alive", &[]);
    let spec = shared.path().join("long.yaml");
    std::fs::write(
        &spec,
        "name: long\ncommand: [keel, trainer, --speedup, \"20\", --report-every-s, \"0.1\", --checkpoint-every-steps, \"10\"]\n\
         gpus: 1\nmodel: resnet50\ntotal_steps: 3000\n",
    )
    .expect("spec");
    let id = json(&all, &["submit", "-f", spec.to_str().expect("utf-8")])
        .and_then(|v| v["id"].as_u64())
        .expect("submitted");
    let job = |field: &str| json(&all, &["job", &id.to_string()]).map(|j| j[field].clone());
    let before = wait_for("progress", || {
        let step = job("progress")?["step"].as_u64()?;
        (step >= 20).then_some(step)
    });
    let pid_file = shared.path().join(format!("workers/job-{id}/e1-r0.pid"));
    let record: Value =
        serde_json::from_slice(&std::fs::read(&pid_file).expect("pid file")).expect("json");
    let pid = record["pid"].as_u64().expect("a pid");

    cluster.kill9(leader);
    assert!(
        Path::new(&format!("/proc/{pid}")).exists(),
        "the worker died with its leader"
    );
    let second = cluster.leader();
    assert_ne!(second, leader);
    // The same process goes on reporting to the new leader.
    wait_for("progress reported to the new leader", || {
        let step = job("progress")?["step"].as_u64()?;
        (step > before + 20).then_some(())
    });
    let record: Value =
        serde_json::from_slice(&std::fs::read(&pid_file).expect("pid file")).expect("json");
    assert_eq!(record["pid"].as_u64(), Some(pid), "the worker was replaced");
    let logs = String::from_utf8_lossy(&cli(&all, &["logs", &id.to_string()]).stdout).to_string();
    assert_eq!(
        logs.matches(", from step ").count(),
        1,
        "launched twice: {logs}"
    );
    let history = wait_for("the job to succeed", || {
        (job("state")? == "succeeded").then(|| job("history"))?
    });
    let commands: Vec<String> = history
        .as_array()
        .expect("history")
        .iter()
        .filter_map(|r| r["command"].as_str().map(str::to_string))
        .collect();
    let count = |c: &str| commands.iter().filter(|k| *k == c).count();
    assert_eq!(
        count("record_worker_started"),
        1,
        "relaunched: {commands:?}"
    );
    assert_eq!(count("decide_allocation"), 1, "re-placed: {commands:?}");
    let text = history.to_string();
    assert!(text.contains("worker_exited"), "{text}");
    cluster.spawn(leader, &extra);
    cluster.converged();
}

/// A member of one cluster restarted at another cluster's address, with
/// that cluster's `--peers` (the same ids, so the data directory's member
/// check passes), never mixes the two logs: every Raft message between them
/// is refused for its cluster id, and it keeps its own history.
#[test]
fn a_replica_of_another_cluster_is_refused_not_overwritten() {
    let mut a = Cluster::start(&[]);
    let mut b = Cluster::start(&[]);
    a.leader();
    b.leader();
    let a_addrs = a.all_addrs();
    let b_addrs = b.all_addrs();
    a.submit(&a_addrs, "in-a").expect("submitted to a");
    b.submit(&b_addrs, "in-b").expect("submitted to b");
    b.converged();
    let a_id = a.status(1).expect("a status")["cluster_id"].clone();
    let b_id = b.status(1).expect("b status")["cluster_id"].clone();
    assert!(a_id.as_str().is_some_and(|s| !s.is_empty()), "{a_id}");
    assert_ne!(a_id, b_id);
    for id in 1..=3 {
        b.terminate(id);
    }
    // A's member 3 dies; B's member 3 comes up in its place.
    a.kill9(3);
    let intruder_addr = a.replicas[2].addr.clone();
    let log_path = a._dir.path().join("intruder.log");
    let log = std::fs::File::create(&log_path).expect("log file");
    let intruder = Command::new(KEEL)
        .args([
            "server",
            "--no-local-node",
            "--id",
            "3",
            "--peers",
            &a.peers,
        ])
        .args(["--listen", &intruder_addr, "--data-dir"])
        .arg(&b.replicas[2].data)
        .stdout(Stdio::null())
        .stderr(log)
        .spawn()
        .expect("spawn the intruder");
    a.replicas[2].child = Some(intruder);
    let names = |addr: &str| -> Option<Vec<String>> {
        json(addr, &["--stale", "jobs"]).and_then(|v| {
            v.as_array().map(|a| {
                a.iter()
                    .filter_map(|j| j["name"].as_str().map(str::to_string))
                    .collect()
            })
        })
    };
    // A goes on with two members.
    a.submit(&a_addrs, "in-a-later").expect("a still commits");
    // Until A's leader has reached the intruder: refused, or (were there no
    // check) the intruder's log overwritten with A's.
    wait_for("A's leader to reach the intruder", || {
        let refused = std::fs::read_to_string(&log_path)
            .is_ok_and(|l| l.contains("refused a Raft message from another cluster"));
        let overwritten = names(&intruder_addr).is_some_and(|n| n != ["in-b"]);
        (refused || overwritten).then_some(())
    });
    assert_eq!(
        names(&intruder_addr),
        Some(vec!["in-b".to_string()]),
        "the intruder took the other cluster's log"
    );
    let intruder_status = json(&intruder_addr, &["cluster", "status"]).expect("status");
    assert_eq!(intruder_status["cluster_id"], b_id);
}

/// Issue 19, item 3: a leader frozen between deciding an allocation and
/// launching its worker (SIGSTOP, here by a failpoint at that very point)
/// launches nothing when it wakes: the new leader has launched the worker,
/// and the woken replica neither confirms its leadership nor can claim the
/// worker's identity in the executor directory the replicas share. The
/// worker starts once (its log says so once; one "worker started" in all
/// the replicas' logs) and the job succeeds.
#[test]
fn a_leader_paused_between_deciding_and_launching_launches_nothing_when_it_wakes() {
    let shared = tempfile::tempdir().expect("tempdir");
    let _reaper = support::WorkerReaper(shared.path().to_path_buf());
    let shared_dir = shared.path().to_str().expect("utf-8").to_string();
    let extra = [
        "--simulated-gpus",
        "1xv100",
        "--node-name",
        "m",
        "--executor-dir",
        &shared_dir,
    ];
    let pause = [("FAILPOINTS", "reconcile-before-side-effects=1*return")];
    let mut cluster = Cluster::start(&extra);
    // Replica 1 leads, armed to freeze itself at its first launch.
    for _ in 0..10 {
        let leader = cluster.leader();
        if leader == 1 {
            break;
        }
        cluster.kill9(leader);
        cluster.spawn(leader, &extra);
    }
    cluster.kill9(1);
    cluster.spawn_with_env(1, &extra, &pause);
    let leader = wait_for("replica 1 to lead, armed", || {
        let l = cluster.leader();
        if l != 1 {
            cluster.kill9(l);
            cluster.spawn(l, &extra);
            return None;
        }
        Some(l)
    });
    cluster.wait_node("m-0", "alive", &[]);
    let spec = shared.path().join("once.yaml");
    std::fs::write(
        &spec,
        "name: once\ncommand: [sh, -c, \"echo started; sleep 2\"]\ngpus: 1\n",
    )
    .expect("spec");
    // To the leader first, then the others: the leader may freeze before
    // it answers, and the CLI then sends the write again (one request id)
    // to the next replica.
    let out = cli(
        &cluster.addrs_leader_first(leader),
        &["submit", "-f", spec.to_str().expect("utf-8")],
    );
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    // Frozen by its own failpoint, between deciding and launching.
    let pid = cluster.replicas[0].child.as_ref().expect("replica 1").id();
    wait_for("replica 1 to freeze itself", || {
        let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
        let state = stat.rsplit(") ").next()?.chars().next()?;
        (state == 'T').then_some(())
    });
    let others: Vec<String> = cluster.replicas[1..]
        .iter()
        .map(|r| r.addr.clone())
        .collect();
    let others = others.join(",");
    // The new leader launches the worker (it may have ended already when
    // the frozen replica wakes: it must not run it again either).
    wait_for("the worker to start under the new leader", || {
        let job = json(&others, &["job", "1"])?;
        (job["workers"].as_array().is_some_and(|w| !w.is_empty()) || job["state"] == "succeeded")
            .then_some(())
    });
    cluster.signal(1, "-CONT");
    wait_for("the job to succeed", || {
        (json(&others, &["job", "1"])?["state"] == "succeeded").then_some(())
    });
    let log = std::fs::read_to_string(shared.path().join("workers/job-1/e1-r0.log"))
        .expect("the worker's log");
    assert_eq!(log.matches("started").count(), 1, "{log}");
    let starts: usize = (1..=3)
        .map(|id| cluster.logs(id).matches("worker started").count())
        .sum();
    assert_eq!(starts, 1, "{}", cluster.logs(1));
}

/// Issue 19, item 1: a membership change that cannot complete can be
/// abandoned by an operator. Both followers of a three-member cluster die
/// for good and the operator removes one: the joint configuration needs a
/// quorum of both the old and the new voters, so the call ends at its
/// deadline and the next change is refused, each naming the way out. The
/// operator stops the survivor, forces it to be the only voter, starts it
/// again: it leads, holds every acknowledged job, commits, and a wiped
/// member joins it again.
#[test]
fn an_operator_abandons_a_membership_change_that_cannot_complete() {
    let mut cluster = Cluster::start(&[]);
    let leader = cluster.leader();
    let leader_addr = cluster.replicas[leader as usize - 1].addr.clone();
    let mut acked = BTreeSet::new();
    for i in 0..3 {
        acked.insert(
            cluster
                .submit(&leader_addr, &format!("before-{i}"))
                .expect("acknowledged"),
        );
    }
    let followers: Vec<u64> = (1..=3).filter(|r| *r != leader).collect();
    for f in &followers {
        cluster.kill9(*f);
    }
    let out = cli(
        &leader_addr,
        &["cluster", "remove", "--id", &followers[1].to_string()],
    );
    assert!(!out.status.success(), "a change without a quorum committed");
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("did not commit within 10 s"), "{err}");
    assert!(err.contains("DeadlineExceeded"), "{err}");
    let out = cli(
        &leader_addr,
        &["cluster", "remove", "--id", &followers[0].to_string()],
    );
    assert!(!out.status.success(), "a second change went in");
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("has not committed yet"), "{err}");
    assert!(err.contains("keel cluster force-new-cluster"), "{err}");
    assert!(err.contains("FailedPrecondition"), "{err}");

    let data = cluster.replicas[leader as usize - 1].data.clone();
    let force = |data: &Path| {
        Command::new(KEEL)
            .args(["cluster", "force-new-cluster", "--id", &leader.to_string()])
            .arg("--data-dir")
            .arg(data)
            .args(["-o", "json"])
            .output()
            .expect("run keel")
    };
    // Not while a server uses the directory.
    let out = force(&data);
    assert!(!out.status.success(), "forced a running replica");
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("in use by another keel process"), "{err}");
    // Stopped (kill -9: what it acknowledged is synced), then forced.
    cluster.kill9(leader);
    let out = force(&data);
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let forced: Value = serde_json::from_slice(&out.stdout).expect("json");
    let mut stuck_at = vec![leader, followers[0]];
    stuck_at.sort_unstable();
    assert_eq!(
        forced["previous_voters"],
        serde_json::json!([[1, 2, 3], stuck_at]),
        "{forced}"
    );
    cluster.spawn(leader, &[]);
    let status = wait_for("the survivor to lead alone", || {
        cluster
            .status(leader)
            .filter(|s| s["role"] == "leader" && s["voters"] == serde_json::json!([leader]))
    });
    assert_eq!(
        status["members"].as_array().map(Vec::len),
        Some(1),
        "{status}"
    );
    let jobs = cluster.jobs_on(leader);
    assert!(acked.is_subset(&jobs), "{acked:?} not all in {jobs:?}");
    let after = cluster
        .submit(&leader_addr, "after")
        .expect("the forced cluster commits");

    // A wiped member joins it again, as a new member.
    let back = followers[0];
    std::fs::remove_dir_all(&cluster.replicas[back as usize - 1].data).expect("wipe");
    cluster.spawn(back, &[]);
    let back_addr = cluster.replicas[back as usize - 1].addr.clone();
    let added = json(
        &leader_addr,
        &[
            "cluster",
            "add",
            "--id",
            &back.to_string(),
            "--member-addr",
            &back_addr,
        ],
    )
    .expect("added");
    let mut voters = vec![leader, back];
    voters.sort_unstable();
    assert_eq!(added["voters"], serde_json::json!(voters), "{added}");
    cluster.converged();
    let jobs = cluster.jobs_on(back);
    assert!(acked.is_subset(&jobs) && jobs.contains(&after), "{jobs:?}");
}

/// Issue 21, item 3: the heterogeneity-aware LAS runs live on three
/// replicas in 1-second rounds, six jobs taking turns on four GPUs of two
/// types; the leader is SIGKILLed mid-run. Every round's decision carries
/// the policy's memory (time received per type, deficits, the allocation),
/// so the new leader plans its next rounds from the memory the old one
/// logged. Shown on the log afterwards: every decision with memory,
/// recomputed offline from the state at its `based_on` index (the memory
/// the log held there included) and its round's start, is exactly the
/// entry the leader logged, across the failover; the new leader's first
/// round is the old leader's last round plus one; and the same round
/// planned from a forgotten memory (what a failover did before) differs.
#[test]
fn a_new_leader_plans_the_next_rounds_from_the_policy_memory_in_the_log() {
    use keel_scheduling::policy::{decide, describe_memory, GavelOptions, GavelRounds};
    use keel_state::{ClusterState, Command as Entry};

    let shared = tempfile::tempdir().expect("tempdir");
    let _reaper = support::WorkerReaper(shared.path().to_path_buf());
    let shared_dir = shared.path().to_str().expect("utf-8").to_string();
    let extra = [
        "--simulated-gpus",
        "2xv100,2xk80",
        "--simulated-nodes",
        "2",
        "--node-name",
        "m",
        "--executor-dir",
        &shared_dir,
        "--policy",
        "max_min_fairness_perf",
        "--round-s",
        "0.3",
        "--gavel-round-s",
        "1",
        "--resolve-interval-s",
        "0",
        "--stop-grace-s",
        "1",
    ];
    let mut cluster = Cluster::start(&extra);
    let leader = cluster.leader();
    let all = cluster.all_addrs();
    cluster.wait_node("m-0", "alive", &[]);
    cluster.wait_node("m-1", "alive", &[]);
    for (i, model) in [
        "resnet50",
        "resnet18",
        "transformer",
        "lm",
        "resnet50",
        "recommendation",
    ]
    .iter()
    .enumerate()
    {
        let spec = shared.path().join(format!("j{i}.yaml"));
        std::fs::write(
            &spec,
            format!("name: j{i}\ncommand: [sleep, \"600\"]\ngpus: 1\nmodel: {model}\n"),
        )
        .expect("spec");
        json(&all, &["submit", "-f", spec.to_str().expect("utf-8")]).expect("submitted");
    }
    let rounds_on = |cluster: &Cluster, id: u64| -> Option<u64> {
        let s = cluster.status(id)?;
        (s["role"] == "leader").then(|| s["policy_counters"]["rounds"].as_u64())?
    };
    let before = wait_for("four rounds on the first leader", || {
        rounds_on(&cluster, leader).filter(|r| *r >= 4)
    });
    cluster.kill9(leader);
    let second = cluster.leader();
    assert_ne!(second, leader);
    wait_for("four more rounds on the new leader", || {
        rounds_on(&cluster, second).filter(|r| *r >= before + 4)
    });
    // Stopped as a crash stops them (two cannot both shut down cleanly:
    // the first to go takes the second's quorum); the replay below reads
    // the committed entries of the Raft log past the journal's end.
    for id in 1..=3 {
        cluster.kill9(id);
    }

    // The log of the new leader's replica: every decision with memory, with
    // the term of the leader that proposed it.
    let data = cluster.replicas[second as usize - 1].data.clone();
    let dir = keel_storage::DataDir::open(&data).expect("open the data dir");
    let decisions: Vec<(u64, u64, Entry)> = {
        let log = keel_storage::LogStore::open(&dir.raft_log_dir()).expect("open the log");
        let end = log.committed_index().expect("a committed index") + 1;
        log.entries(0, end)
            .expect("entries")
            .into_iter()
            .filter_map(|e| match e.payload {
                openraft::EntryPayload::Normal(p) => Some((e.log_id, p)),
                _ => None,
            })
            .flat_map(|(id, p)| {
                p.entries
                    .into_iter()
                    .map(move |x| (id.index, id.leader_id.term, x.command))
            })
            .filter(|(_, _, c)| {
                matches!(
                    c,
                    Entry::DecideAllocation {
                        memory: Some(_),
                        ..
                    }
                )
            })
            .collect()
    };
    let state_at = |index: u64| -> ClusterState {
        keel_storage::replay_data_dir(&dir, keel_storage::Until::Index(index))
            .expect("replay")
            .state
    };
    let options = GavelOptions {
        round_s: 1.0,
        min_resolve_interval_s: 0.0,
        ..GavelOptions::default()
    };
    let rounds_of = |c: &Entry| -> (u64, u64) {
        let Entry::DecideAllocation {
            memory: Some(m), ..
        } = c
        else {
            unreachable!("filtered")
        };
        let d = describe_memory(m).expect("a memory this build reads");
        (
            d["rounds"].as_u64().expect("rounds"),
            d["round_started_ms"].as_u64().expect("a round start"),
        )
    };
    let first_term = decisions.first().map(|(_, t, _)| *t).expect("decisions");
    let old = || decisions.iter().filter(|(_, t, _)| *t == first_term);
    let new = || decisions.iter().filter(|(_, t, _)| *t > first_term);
    assert!(old().count() >= 3, "{decisions:?}");
    assert!(new().count() >= 3, "{decisions:?}");
    for (index, term, logged) in &decisions {
        let Entry::DecideAllocation { based_on, .. } = logged else {
            unreachable!("filtered")
        };
        let state = state_at(*based_on);
        let (_, started_ms) = rounds_of(logged);
        // A policy instance that never ran: all it knows is the log.
        let policy = GavelRounds::new("max_min_fairness_perf", options.clone());
        let recomputed = decide(&policy, &state, started_ms);
        assert_eq!(
            recomputed.as_ref(),
            Some(logged),
            "the decision at index {index} (term {term}) is not what the log's memory gives"
        );
    }
    // The new leader's first round continues the old leader's last.
    let (last_index, _, last_old) = old().next_back().expect("a decision by the old leader");
    let (_, _, first_new) = new().next().expect("a decision by the new leader");
    assert_eq!(
        rounds_of(first_new).0,
        rounds_of(last_old).0 + 1,
        "the new leader started its memory afresh (old leader's last at index {last_index})"
    );
    // Planned from a forgotten memory, the same round differs.
    let Entry::DecideAllocation { based_on, .. } = first_new else {
        unreachable!("filtered")
    };
    let mut forgotten = state_at(*based_on);
    forgotten.restore_policy_memory(Default::default());
    let afresh = decide(
        &GavelRounds::new("max_min_fairness_perf", options),
        &forgotten,
        rounds_of(first_new).1,
    );
    assert_ne!(afresh.as_ref(), Some(first_new));
    // `keel replay` shows the memory as of an index: here, the last
    // decision's.
    let (last_decision, _, last) = decisions.last().expect("decisions");
    drop(dir);
    let out = Command::new(KEEL)
        .args(["replay", "--data-dir"])
        .arg(&data)
        .args(["--until", &last_decision.to_string(), "-o", "json"])
        .output()
        .expect("keel replay");
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let replayed: Value = serde_json::from_slice(&out.stdout).expect("json");
    let memory = &replayed["policy_memory"];
    assert_eq!(memory["policy"], "max_min_fairness_perf", "{replayed}");
    assert_eq!(memory["memory"]["rounds"].as_u64(), Some(rounds_of(last).0));
    assert_eq!(
        memory["memory"]["jobs"].as_object().map(|j| j.len()),
        Some(6)
    );
}

/// Issue 21, item 2: a rolling upgrade from the release before Raft wire
/// format 2. The cluster starts as that release (every replica pinned to
/// wire format 1 and snapshot format 7, which is what it spoke and wrote:
/// openraft's types and the state in postcard), and its members are
/// replaced one at a time by today's build: a leader is killed while
/// releases are mixed, and an old member far behind is brought up to date
/// by a new leader's snapshot, which it must receive in the format it
/// reads. Nothing acknowledged is lost, the replicas agree, and the
/// upgraded ones end up writing format 2 to each other.
#[test]
fn a_cluster_upgraded_one_member_at_a_time_keeps_committing() {
    // Snapshots every 20 entries, 5 kept behind: a member that misses 40
    // entries needs a snapshot.
    const NEW: &[&str] = &["--snapshot-every", "20", "--keep-log-entries", "5"];
    const OLD: &[&str] = &[
        "--snapshot-every",
        "20",
        "--keep-log-entries",
        "5",
        "--raft-wire-format",
        "1",
    ];
    let mut cluster = Cluster::start(OLD);
    // Submitted only once a leader is known: before the replicas serve, a
    // CLI finds every address refusing connections and gives up.
    cluster.leader();
    let all = cluster.all_addrs();
    let mut acked = BTreeSet::new();
    let mut submit = |cluster: &Cluster, name: String| {
        acked.insert(cluster.submit(&all, &name).expect("acknowledged"));
    };
    for i in 0..3 {
        submit(&cluster, format!("old-{i}"));
    }
    cluster.converged();
    let mut upgraded = BTreeSet::new();
    for id in 1..=2 {
        cluster.terminate(id);
        cluster.spawn(id, NEW);
        upgraded.insert(id);
        for i in 0..3 {
            submit(&cluster, format!("mixed-{id}-{i}"));
        }
        if id == 1 {
            // A failover while one member runs the new release: votes and
            // entries cross formats both ways.
            let leader = cluster.leader();
            cluster.kill9(leader);
            submit(&cluster, "after-kill".into());
            let args = if upgraded.contains(&leader) { NEW } else { OLD };
            cluster.spawn(leader, args);
        }
        cluster.converged();
    }
    // The old member stops; the new ones commit 40 entries and compact
    // their logs; it comes back and needs a new leader's snapshot.
    cluster.terminate(3);
    for i in 0..40 {
        submit(&cluster, format!("behind-{i}"));
    }
    cluster.spawn(3, OLD);
    cluster.converged();
    let leader = cluster.leader();
    assert!(
        cluster
            .logs(leader)
            .contains("sending the snapshot in format 7"),
        "the old member was not sent a snapshot: {}",
        cluster.logs(leader)
    );
    // The last member is upgraded.
    cluster.terminate(3);
    cluster.spawn(3, NEW);
    submit(&cluster, "new".into());
    cluster.converged();
    for r in 1..=3 {
        assert_eq!(cluster.jobs_on(r), acked, "replica {r}");
    }
    // The old release wrote format 1 only; after the upgrade the leader
    // writes format 2 to its followers.
    let logs: String = (1..=3).map(|id| cluster.logs(id)).collect();
    assert!(logs.contains("writing Raft wire format 1"), "{logs}");
    let leader = cluster.leader();
    wait_for("the upgraded leader to write format 2", || {
        let said = cluster.logs(leader);
        (said.matches("writing Raft wire format 2").count() >= 2).then_some(())
    });
}

/// libfaketime's preload library, to run a replica whose clock is off;
/// `None` (the test says it skipped) where it is not installed. CI installs
/// it and sets `KEEL_REQUIRE_FAKETIME`.
fn libfaketime(test: &str) -> Option<PathBuf> {
    if !support::available_or_skip("faketime", test, "KEEL_REQUIRE_FAKETIME") {
        return None;
    }
    let found = keel_chaos::faults::libfaketime();
    assert!(
        found.is_some(),
        "faketime is installed, but its libfaketime.so.1 was not found"
    );
    found
}

/// The times of every applied entry, in log order.
fn entry_times(addrs: &str) -> Vec<(u64, u64)> {
    let out = cli(addrs, &["events", "-o", "json"]);
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    serde_json::Deserializer::from_slice(&out.stdout)
        .into_iter::<Value>()
        .map(|r| {
            let r = r.expect("a JSON record");
            (
                r["index"].as_u64().expect("an index"),
                r["at_ms"].as_u64().expect("a time"),
            )
        })
        .collect()
}

/// Log time across leaders whose clocks are an hour off (issue 29). A
/// replica an hour ahead founds the cluster and leads it alone, so the log
/// is stamped an hour ahead; a job fails under it and waits out a 10 s
/// backoff. Once two replicas with true clocks join, it steps down and
/// says why; the new leader carries log time on from where it was, so the
/// backoff ends 10 s (of log time) after the failure, not an hour later.
/// Then a replica an hour behind leads: the next job's backoff ends on
/// time too, no entry's time is earlier than the one before it, and
/// `keel cluster status` shows the offsets.
#[test]
fn a_clock_an_hour_off_neither_leads_nor_stalls_log_time() {
    let Some(lib) = libfaketime("a_clock_an_hour_off_neither_leads_nor_stalls_log_time") else {
        return;
    };
    const HOUR_MS: i64 = 3_600_000;
    let skewed = |hours: i64| keel_chaos::faults::skewed_clock_env(&lib, hours * 3600);
    let shared = tempfile::tempdir().expect("tempdir");
    let _reaper = support::WorkerReaper(shared.path().to_path_buf());
    let shared_dir = shared.path().to_str().expect("utf-8").to_string();
    let extra = [
        "--simulated-gpus",
        "1xv100",
        "--node-name",
        "m",
        "--executor-dir",
        &shared_dir,
    ];
    // A job that fails its first attempt and succeeds its second, 10 s of
    // log time later.
    let flaky = |name: &str| {
        let flag = shared.path().join(format!("{name}.failed-once"));
        let spec = shared.path().join(format!("{name}.yaml"));
        std::fs::write(
            &spec,
            format!(
                "name: {name}\ncommand: [sh, -c, \"test -e {flag} || {{ touch {flag}; exit 3; }}\"]\n\
                 gpus: 1\nmax_retries: 1\nretry_backoff_s: 10\n",
                flag = flag.display()
            ),
        )
        .expect("spec");
        spec
    };
    let mut cluster = Cluster::new();
    let all = cluster.all_addrs();
    let everyone = cluster.peers.clone();

    // Replica 1, an hour ahead, founds the cluster alone and leads.
    cluster.peers = format!("1={}", cluster.replicas[0].addr);
    let env = skewed(1);
    let pairs: Vec<(&str, &str)> = env.iter().map(|(k, v)| (*k, v.as_str())).collect();
    cluster.spawn_with_env(1, &extra, &pairs);
    wait_for("replica 1 to lead", || {
        (cluster.status(1)?["role"] == "leader").then_some(())
    });
    cluster.wait_node("m-0", "alive", &[]);
    let first = json(
        &all,
        &["submit", "-f", flaky("first").to_str().expect("utf-8")],
    )
    .and_then(|v| v["id"].as_u64())
    .expect("submitted");
    let job = |id: u64| json(&all, &["job", &id.to_string()]);
    wait_for("the first attempt to fail", || {
        (job(first)?["retries"].as_u64()? == 1).then_some(())
    });

    // Two replicas with true clocks join; replica 1 steps down.
    cluster.peers = everyone;
    for id in [2, 3] {
        cluster.spawn(id, &extra);
        let addr = cluster.replicas[id as usize - 1].addr.clone();
        wait_for(&format!("member {id} to be a voter"), || {
            let status = json(&all, &["cluster", "status"])?;
            let voters = status["voters"].as_array()?.clone();
            if voters.iter().any(|v| v.as_u64() == Some(id)) {
                return Some(());
            }
            // Sent again if a change of leader cut it short.
            let _ = cli(
                &all,
                &[
                    "cluster",
                    "add",
                    "--id",
                    &id.to_string(),
                    "--member-addr",
                    &addr,
                ],
            );
            None
        });
    }
    let leader = wait_for("a leader other than replica 1", || {
        let l = (2..=3).find(|id| cluster.status(*id).is_some_and(|s| s["role"] == "leader"))?;
        Some(l)
    });
    let refused = wait_for("replica 1 to say why it does not lead", || {
        let s = cluster.status(1)?;
        let why = s["clock_refusal"].as_str()?.to_string();
        (!why.is_empty() && s["role"] != "leader").then_some(why)
    });
    assert!(refused.contains("ahead of the middle"), "{refused}");
    assert!(
        cluster
            .logs(1)
            .contains("does not lead until its clock is fixed"),
        "replica 1 did not say it in its log"
    );
    // The leader measured replica 1 an hour ahead of the middle.
    let offset = wait_for("the leader's measure of replica 1", || {
        let s = cluster.status(leader)?;
        s["members"].as_array()?.iter().find(|m| m["id"] == 1)?["clock_offset_ms"].as_i64()
    });
    assert!(
        (offset - HOUR_MS).abs() < 60_000,
        "replica 1 measured {offset} ms off"
    );
    let table = String::from_utf8_lossy(&cli(&all, &["cluster", "status"]).stdout).to_string();
    assert!(
        table.contains("CLOCK") && table.contains("member 1 does not lead"),
        "{table}"
    );

    // The backoff begun under replica 1 ends 10 s of log time after the
    // failure, under a leader whose clock is an hour behind that time.
    let backoff_kept = |id: u64| {
        let history = wait_for("the retry to succeed", || {
            let j = job(id)?;
            (j["state"] == "succeeded").then(|| j["history"].clone())
        });
        let at = |command: &str| -> Vec<u64> {
            history
                .as_array()
                .expect("history")
                .iter()
                .filter(|r| r["command"] == command)
                .filter_map(|r| r["at_ms"].as_u64())
                .collect()
        };
        let failed_at = at("record_worker_exited")[0];
        let placed = at("decide_allocation");
        assert_eq!(placed.len(), 2, "{history}");
        assert!(
            placed[1] >= failed_at + 10_000,
            "retried {} ms after the failure",
            placed[1] - failed_at
        );
    };
    backoff_kept(first);

    // A replica an hour behind takes over: the other true one goes, and
    // the leader is killed.
    let behind = if leader == 2 { 3 } else { 2 };
    cluster.terminate(behind);
    let env = skewed(-1);
    let pairs: Vec<(&str, &str)> = env.iter().map(|(k, v)| (*k, v.as_str())).collect();
    cluster.spawn_with_env(behind, &extra, &pairs);
    cluster.converged();
    cluster.kill9(leader);
    wait_for("the replica an hour behind to lead", || {
        (cluster.status(behind)?["role"] == "leader").then_some(())
    });
    let second = json(
        &all,
        &["submit", "-f", flaky("second").to_str().expect("utf-8")],
    )
    .and_then(|v| v["id"].as_u64())
    .expect("submitted");
    backoff_kept(second);
    assert_eq!(
        cluster.status(1).expect("replica 1")["role"],
        "follower",
        "replica 1 still does not lead"
    );

    // No entry's time is earlier than the one before it.
    let times = entry_times(&all);
    assert!(times.len() > 10, "{times:?}");
    for pair in times.windows(2) {
        assert!(pair[1].1 >= pair[0].1, "time went backwards: {pair:?}");
    }
}

/// Issue 34: a leader removed from its cluster, with `KEEL_ADDR` listing it
/// first. It says so on every request and in `keel cluster status`; the
/// CLI goes on to the next address, so the submit after the removal is
/// taken; the other members show it removed; it stops within its grace,
/// and its data directory refuses to start as a member again, naming the
/// way back. A follower removed by its leader never gets the entry that
/// removes it: it is told when it stands for election, and stops too.
#[test]
fn a_removed_member_says_so_stops_and_the_cli_goes_on_to_the_next_address() {
    // The grace outlasts the removed leader's own bounded wait for the
    // removal's audit entry (5 s, `MEMBERSHIP_AUDIT_TIMEOUT`), after which
    // it answers `cluster remove`: a grace shorter than that could end
    // before the test's first request (seen on a loaded machine).
    let mut cluster = Cluster::start(&["--removed-grace-s", "10"]);
    let leader = cluster.leader();
    let addrs = cluster.addrs_leader_first(leader);
    let leader_addr = cluster.replicas[leader as usize - 1].addr.clone();
    cluster.submit(&addrs, "before").expect("acknowledged");
    let out = cli(&addrs, &["cluster", "remove", "--id", &leader.to_string()]);
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    // Every request but the status is answered with the removal.
    let words = wait_for("the removed replica to say so", || {
        let out = cli(&leader_addr, &["jobs"]);
        let err = String::from_utf8_lossy(&out.stderr).to_string();
        err.contains("was removed from cluster").then_some(err)
    });
    assert!(
        words.contains(&format!("replica {leader}")) && words.contains("it serves nothing"),
        "{words}"
    );
    let status = json(&leader_addr, &["cluster", "status"]).expect("status");
    assert!(
        status["removed"]
            .as_str()
            .is_some_and(|r| r.contains("was removed from cluster")),
        "{status}"
    );
    // The same KEEL_ADDR, the removed replica first: the next one takes it.
    let after = cluster
        .submit(&addrs, "after")
        .expect("taken through the next address");
    let other = (1..=3).find(|r| *r != leader).expect("another member");
    let status = json(
        &cluster.replicas[other as usize - 1].addr,
        &["cluster", "status"],
    )
    .expect("status");
    assert_eq!(status["removed_members"][0]["id"], leader, "{status}");
    let table = String::from_utf8_lossy(
        &cli(
            &cluster.replicas[other as usize - 1].addr,
            &["cluster", "status"],
        )
        .stdout,
    )
    .to_string();
    assert!(table.contains("removed at index"), "{table}");
    // It stops on its own.
    let exit = wait_for("the removed replica to stop", || {
        cluster.replicas[leader as usize - 1]
            .child
            .as_mut()?
            .try_wait()
            .ok()?
    });
    cluster.replicas[leader as usize - 1].child = None;
    assert!(!exit.success(), "{exit}");
    assert!(cluster.logs(leader).contains("was removed from cluster"));
    // Its data directory refuses to serve as a member again.
    let out = Command::new(KEEL)
        .args(["server", "--id", &leader.to_string(), "--no-local-node"])
        .args([
            "--peers",
            &cluster.peers,
            "--listen",
            &leader_addr,
            "--data-dir",
        ])
        .arg(&cluster.replicas[leader as usize - 1].data)
        .output()
        .expect("run keel server");
    assert!(!out.status.success());
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        err.contains("was removed from cluster")
            && err.contains(&format!("keel cluster add --id {leader}")),
        "{err}"
    );
    let jobs = cluster.jobs_on(other);
    assert!(jobs.contains(&after), "{jobs:?}");

    // A follower removed by the new leader: told when it stands for
    // election (its leader no longer sends it anything), it stops too.
    let new_leader = cluster.leader();
    let follower = (1..=3)
        .find(|r| *r != leader && *r != new_leader)
        .expect("a follower");
    let survivor_addr = cluster.replicas[new_leader as usize - 1].addr.clone();
    let out = cli(
        &survivor_addr,
        &["cluster", "remove", "--id", &follower.to_string()],
    );
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let exit = wait_for("the removed follower to stop", || {
        cluster.replicas[follower as usize - 1]
            .child
            .as_mut()?
            .try_wait()
            .ok()?
    });
    cluster.replicas[follower as usize - 1].child = None;
    assert!(!exit.success(), "{exit}");
    let log = cluster.logs(follower);
    assert!(log.contains("which refused its vote"), "{log}");
    cluster
        .submit(&survivor_addr, "alone")
        .expect("the last member commits alone");
    // Nothing answers at the two stopped addresses: the error names both.
    let gone = format!(
        "{},{}",
        leader_addr,
        cluster.replicas[follower as usize - 1].addr
    );
    let out = cli(&gone, &["jobs"]);
    assert!(!out.status.success());
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        err.contains(&format!("tried {leader_addr}: "))
            && err.contains(&cluster.replicas[follower as usize - 1].addr),
        "{err}"
    );
}

/// Issue 23, items 2 and 3, live: three replicas share one node of four
/// simulated v100s; queues `a` and `b` hold two each in one cohort. `a`
/// fills the node, borrowing `b`'s two; `b` submits, and the leader is
/// killed at once. Whichever leader runs the round, `a`'s newest job is
/// preempted once, `b`'s starts, `a`'s first job never moves, and `a`'s
/// waiting job says it is over quota — all read from the log.
#[test]
fn a_queue_below_its_quota_reclaims_from_a_borrower_across_a_failover() {
    let shared = tempfile::tempdir().expect("tempdir");
    let _reaper = support::WorkerReaper(shared.path().to_path_buf());
    let shared_dir = shared.path().to_str().expect("utf-8").to_string();
    let extra = [
        "--simulated-gpus",
        "4xv100",
        "--node-name",
        "m",
        "--executor-dir",
        &shared_dir,
        "--round-s",
        "0.5",
    ];
    let mut cluster = Cluster::start(&extra);
    let leader = cluster.leader();
    let all = cluster.all_addrs();
    cluster.wait_node("m-0", "alive", &[]);
    for name in ["a", "b"] {
        let out = cli(
            &all,
            &[
                "queue", "create", name, "--quota", "v100=2", "--cohort", "teams",
            ],
        );
        assert!(out.status.success(), "{out:?}");
    }
    let submit = |name: &str, queue: &str| -> u64 {
        let spec = shared.path().join(format!("{name}.yaml"));
        std::fs::write(
            &spec,
            format!(
                "name: {name}\nqueue: {queue}\ngpus: 2\ncommand: [keel, trainer, --speedup, \"1\", --report-every-s, \"0.2\"]\nmodel: resnet50\ntotal_steps: 100000000\n"
            ),
        )
        .expect("spec");
        json(&all, &["submit", "-f", spec.to_str().expect("utf-8")])
            .and_then(|v| v["id"].as_u64())
            .expect("submitted")
    };
    let job = |id: u64| json(&all, &["job", &id.to_string()]).expect("the job");
    let running = |id: u64| job(id)["state"] == "running";
    let a1 = submit("a1", "a");
    wait_for("a1 to run", || running(a1).then_some(()));
    let a2 = submit("a2", "a");
    wait_for("a2 to run on b's lent GPUs", || running(a2).then_some(()));
    let b1 = submit("b1", "b");
    cluster.kill9(leader);
    let second = cluster.leader();
    assert_ne!(second, leader);
    wait_for("b1 to run", || running(b1).then_some(()));
    let a2_now = job(a2);
    assert_ne!(a2_now["state"], "running", "{a2_now}");
    let message = a2_now["message"].as_str().unwrap_or_default();
    assert!(message.contains("over quota"), "{a2_now}");
    // From the log: one preemption of a2, none of a1, whose allocation
    // was decided once.
    let commands = |id: u64| -> Vec<String> {
        job(id)["history"]
            .as_array()
            .expect("history")
            .iter()
            .filter_map(|r| r["command"].as_str().map(str::to_string))
            .collect()
    };
    let events = |id: u64| job(id)["history"].to_string();
    assert_eq!(
        commands(a1)
            .iter()
            .filter(|c| *c == "decide_allocation")
            .count(),
        1,
        "a1 moved: {}",
        events(a1)
    );
    assert!(!events(a1).contains("job_preempted"), "{}", events(a1));
    assert_eq!(
        events(a2).matches("job_preempted").count(),
        1,
        "{}",
        events(a2)
    );
    // Nothing moves afterwards: a second look after more rounds finds the
    // same holders.
    let holders = |ids: &[u64]| -> Vec<Value> {
        ids.iter()
            .map(|id| job(*id)["allocation"]["gpus"].clone())
            .collect()
    };
    let before = holders(&[a1, a2, b1]);
    cluster.spawn(leader, &extra);
    let (index, _) = cluster.converged();
    // Progress reports keep the log moving: 20 entries later, rounds have
    // run on the same state.
    wait_for("more entries", || {
        let status = cluster.json(&all, &["cluster", "status"])?;
        (status["last_applied_index"].as_u64()? > index + 20).then_some(())
    });
    assert_eq!(holders(&[a1, a2, b1]), before);
    for id in [a1, a2, b1] {
        let _ = cli(&all, &["cancel", &id.to_string()]);
    }
}

/// Issue 24, item 2: one submission is one trace across processes and a
/// change of leader. The CLI's span, the API's on the follower it reached
/// and on the leader it was forwarded to, the WAL append and the apply of
/// the entry on the replicas, and, after the leader that took it is
/// killed, the new leader's decision placing the job, its launch and the
/// job's first progress: every one reaches an OTLP collector under the
/// CLI's trace id. The job waits behind another holding the only GPU until
/// the new leader is elected, so the decision can only come from the
/// context the log carried.
#[test]
fn a_submission_is_one_trace_across_replicas_and_a_failover() {
    let collector = collector::Collector::start();
    let shared = tempfile::tempdir().expect("tempdir");
    let _reaper = support::WorkerReaper(shared.path().to_path_buf());
    let shared_dir = shared.path().to_str().expect("utf-8").to_string();
    let extra = [
        "--simulated-gpus",
        "1xv100",
        "--node-name",
        "m",
        "--executor-dir",
        &shared_dir,
        "--round-s",
        "0.3",
        "--progress-interval-s",
        "0.2",
        "--otlp-endpoint",
        &collector.endpoint,
    ];
    let mut cluster = Cluster::new();
    for id in 1..=3 {
        // Spans leave a replica in batches every 100 ms.
        cluster.spawn_with_env(id, &extra, &[("OTEL_BSP_SCHEDULE_DELAY", "100")]);
    }
    let first = cluster.leader();
    cluster.wait_node("m-0", "alive", &[]);
    let all = cluster.all_addrs();
    // The only GPU is taken: the traced job waits.
    let spec = shared.path().join("blocker.yaml");
    std::fs::write(&spec, "name: blocker\ncommand: [\"sleep\", \"600\"]\n").expect("spec");
    let blocker = cluster
        .json(&all, &["submit", "-f", spec.to_str().expect("utf-8")])
        .and_then(|v| v["id"].as_u64())
        .expect("the blocker's id");
    wait_for("the blocker to run", || {
        let job = cluster.json(&all, &["job", &blocker.to_string()])?;
        (job["state"] == "running").then_some(())
    });
    // Submitted through a follower, traced by the CLI.
    let follower = cluster
        .replicas
        .iter()
        .find(|r| r.id != first)
        .map(|r| r.addr.clone())
        .expect("a follower");
    let spec = shared.path().join("traced.yaml");
    std::fs::write(
        &spec,
        "name: traced\ncommand: [\"sh\", \"-c\", \
         \"echo 'KEEL_PROGRESS {\\\"step\\\": 1, \\\"total_steps\\\": 10}'; sleep 600\"]\n",
    )
    .expect("spec");
    let id = support::json_of(
        Command::new(KEEL)
            .args(["submit", "-o", "json", "-f"])
            .arg(&spec)
            .env("KEEL_ADDR", &follower)
            .env("KEEL_OTLP_ENDPOINT", &collector.endpoint),
    )["id"]
        .as_u64()
        .expect("a job id");
    // The CLI exported its span before it exited.
    let trace = collector
        .spans()
        .into_iter()
        .find(|s| s.name == "keel submit")
        .expect("the CLI's span")
        .trace_id;
    let in_trace = |name: &str| -> Vec<collector::Received> {
        collector
            .spans()
            .into_iter()
            .filter(|s| s.trace_id == trace && s.name == name)
            .collect()
    };
    // Every replica applied the submission under its trace, and the
    // leader's spans of the forwarded request and its proposal are in.
    let first_instance = format!("member {first}");
    wait_for("the submission applied on every replica, traced", || {
        let appliers: BTreeSet<String> = in_trace("keel.apply")
            .into_iter()
            .map(|s| s.instance)
            .collect();
        let from_leader = |name: &str| in_trace(name).iter().any(|s| s.instance == first_instance);
        (appliers.len() == 3
            && from_leader("keel.api.v1.Keel/SubmitJob")
            && from_leader("keel.propose"))
        .then_some(())
    });
    let job = cluster.json(&all, &["job", &id.to_string()]).expect("job");
    assert_eq!(job["state"], "pending", "{job}");
    // `keel job` names the trace, to look it up in a tracing backend.
    assert_eq!(job["trace_id"], trace.as_str(), "{job}");
    // The leader that took it dies before anything places the job.
    cluster.kill9(first);
    let second = cluster.leader();
    assert_ne!(first, second);
    let out = cli(&all, &["cancel", &blocker.to_string()]);
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    wait_for("the job's first progress", || {
        let job = cluster.json(&all, &["job", &id.to_string()])?;
        (job["state"] == "running" && job["progress"]["step"] == 1).then_some(())
    });
    let second_instance = format!("member {second}");
    wait_for("the new leader's spans in the submitter's trace", || {
        let from_second = |name: &str| in_trace(name).iter().any(|s| s.instance == second_instance);
        (from_second("keel.decide")
            && from_second("keel.launch")
            && !in_trace("keel.first_progress").is_empty())
        .then_some(())
    });
    let spans: Vec<collector::Received> = collector
        .spans()
        .into_iter()
        .filter(|s| s.trace_id == trace)
        .collect();
    let names: BTreeSet<&str> = spans.iter().map(|s| s.name.as_str()).collect();
    for name in [
        "keel submit",
        "keel.api.v1.Keel/SubmitJob",
        "keel.propose",
        "keel.wal_append",
        "keel.apply",
        "keel.decide",
        "keel.launch",
        "keel.first_progress",
    ] {
        assert!(
            names.contains(name),
            "{name} missing from the trace: {names:?}"
        );
    }
    // The API's spans: the follower's under the CLI's, the leader's
    // (forwarded) under the follower's.
    let cli_span = spans.iter().find(|s| s.name == "keel submit").expect("cli");
    let api = |instance: &str| -> &collector::Received {
        spans
            .iter()
            .find(|s| s.name == "keel.api.v1.Keel/SubmitJob" && s.instance == instance)
            .unwrap_or_else(|| panic!("no SubmitJob span from {instance}: {spans:?}"))
    };
    let follower_instance = format!(
        "member {}",
        cluster
            .replicas
            .iter()
            .find(|r| r.addr == follower)
            .map(|r| r.id)
            .expect("the follower")
    );
    assert_eq!(api(&follower_instance).parent_span_id, cli_span.span_id);
    let served = api(&first_instance);
    assert_eq!(served.parent_span_id, api(&follower_instance).span_id);
    // The leader proposed it in a span of its own (queue, WAL, commit,
    // apply), whose context the entry carries: what acted on the entry
    // hangs under it, in whichever process, the new leader's decision and
    // launch included.
    let proposed = spans
        .iter()
        .find(|s| s.name == "keel.propose" && s.instance == first_instance)
        .unwrap_or_else(|| panic!("no proposal span from the leader: {spans:?}"));
    assert_eq!(proposed.parent_span_id, served.span_id);
    for s in spans.iter().filter(|s| {
        s.name.starts_with("keel.") && !s.name.contains('/') && s.name != "keel.propose"
    }) {
        assert_eq!(s.parent_span_id, proposed.span_id, "{s:?}");
    }
    let instances: BTreeSet<&str> = spans.iter().map(|s| s.instance.as_str()).collect();
    assert_eq!(
        instances,
        BTreeSet::from(["client", "member 1", "member 2", "member 3"]),
        "{spans:?}"
    );
    let _ = cli(&all, &["cancel", &id.to_string()]);
}

/// Where nss_wrapper is (Debian's libnss-wrapper): preloaded, it makes a
/// process resolve host names from the file `NSS_WRAPPER_HOSTS` names,
/// read again whenever it changes, as a DNS record changes.
fn nss_wrapper_or_skip(test: &str) -> Option<PathBuf> {
    let found = [
        "/usr/lib/x86_64-linux-gnu",
        "/usr/lib/aarch64-linux-gnu",
        "/usr/lib64",
        "/usr/lib",
    ]
    .iter()
    .map(|d| Path::new(d).join("libnss_wrapper.so"))
    .find(|p| p.exists());
    support::present_or_skip(
        found.is_some(),
        "libnss_wrapper.so (Debian's libnss-wrapper)",
        test,
        "KEEL_REQUIRE_NSS_WRAPPER",
    );
    found
}

/// Issue 25, item 2: `--peers` by name. Three replicas know each other as
/// `keel-a.test`, `keel-b.test` and `keel-c.test` (names resolved through
/// a hosts file, as DNS would); one is killed and comes back on another
/// address under the same name, as a rescheduled Pod does, and rejoins
/// with no change to anyone's flags: its peers resolve the name again
/// when their connections to the old address fail.
#[test]
fn a_member_back_on_a_new_address_under_its_name_rejoins() {
    let Some(wrapper) =
        nss_wrapper_or_skip("a_member_back_on_a_new_address_under_its_name_rejoins")
    else {
        return;
    };
    let mut cluster = Cluster::new();
    let hosts = cluster._dir.path().join("hosts");
    let names = ["keel-a.test", "keel-b.test", "keel-c.test"];
    let ports: Vec<String> = cluster
        .replicas
        .iter()
        .map(|r| r.addr.rsplit(':').next().unwrap_or_default().to_string())
        .collect();
    let write_hosts = |ips: [&str; 3]| {
        let text: String = ips
            .iter()
            .zip(names)
            .map(|(ip, name)| format!("{ip} {name}\n"))
            .collect();
        // A new file renamed over the old one: nss_wrapper notices a new
        // inode at once, a rewrite only when its mtime's second moves.
        let fresh = hosts.with_extension("new");
        std::fs::write(&fresh, text).expect("hosts file");
        std::fs::rename(&fresh, &hosts).expect("hosts file renamed");
    };
    write_hosts(["127.0.0.11", "127.0.0.12", "127.0.0.13"]);
    for (i, r) in cluster.replicas.iter_mut().enumerate() {
        r.addr = format!("127.0.0.{}:{}", 11 + i, ports[i]);
    }
    cluster.peers = (0..3)
        .map(|i| format!("{}={}:{}", i + 1, names[i], ports[i]))
        .collect::<Vec<_>>()
        .join(",");
    let wrapper = wrapper.to_str().expect("utf-8").to_string();
    let hosts_path = hosts.to_str().expect("utf-8").to_string();
    let env = [
        ("LD_PRELOAD", wrapper.as_str()),
        ("NSS_WRAPPER_HOSTS", hosts_path.as_str()),
    ];
    for id in 1..=3 {
        cluster.spawn_with_env(id, &[], &env);
    }
    let leader = cluster.leader();
    let status = cluster.status(leader).expect("status");
    assert!(
        status.to_string().contains("keel-c.test"),
        "the members are known by name: {status}"
    );
    let all = cluster.all_addrs();
    cluster.submit(&all, "before").expect("submitted");
    cluster.converged();

    // Replica 3 (or, if it leads, replica 2) dies and comes back elsewhere.
    let moved = if leader == 3 { 2 } else { 3 };
    cluster.kill9(moved);
    let mut ips = ["127.0.0.11", "127.0.0.12", "127.0.0.13"];
    ips[moved as usize - 1] = if moved == 3 {
        "127.0.0.23"
    } else {
        "127.0.0.22"
    };
    write_hosts(ips);
    let r = &mut cluster.replicas[moved as usize - 1];
    r.addr = format!("{}:{}", ips[moved as usize - 1], ports[moved as usize - 1]);
    cluster.spawn_with_env(moved, &[], &env);

    // Writes reach it at its new address: the three converge.
    let all = cluster.all_addrs();
    for i in 0..3 {
        cluster
            .submit(&all, &format!("after-{i}"))
            .expect("submitted");
    }
    let (index, _) = cluster.converged();
    let jobs = cluster.jobs_on(moved);
    assert_eq!(
        jobs.len(),
        4,
        "replica {moved} has every job at index {index}: {jobs:?}"
    );
    let status = cluster.status(leader).expect("status");
    assert!(
        status.to_string().contains(names[moved as usize - 1]),
        "still known by its name, not its new address: {status}"
    );
}

/// Issue 25, item 6: a backup saved through a follower (the leader
/// answers, after a linearizable read) holds the state as of then, owner
/// only; `inspect` checks its hash and a damaged copy is refused; restored
/// into an empty data directory it founds a new cluster (a new cluster
/// id) whose first member serves exactly that state (the same hash), and
/// two members added on empty disks take it whole; a non-empty directory
/// is refused.
#[test]
fn a_saved_snapshot_founds_a_new_three_replica_cluster_with_the_same_state() {
    let source = Cluster::start(&[]);
    let leader = source.leader();
    let all = source.all_addrs();
    let mut submitted = BTreeSet::new();
    for i in 0..5 {
        submitted.insert(source.submit(&all, &format!("job-{i}")).expect("submitted"));
    }
    let (index, hash) = source.converged();
    let source_id = source.status(leader).expect("status")["cluster_id"]
        .as_str()
        .expect("cluster id")
        .to_string();
    let follower = (1..=3).find(|id| *id != leader).expect("a follower");
    let dir = tempfile::tempdir().expect("tempdir");
    let file = dir.path().join("backup.snap");
    let file_arg = file.to_str().expect("utf-8");
    let saved = source
        .json(
            &source.replicas[follower as usize - 1].addr,
            &["snapshot", "save", file_arg],
        )
        .expect("saved");
    assert_eq!(saved["index"], index, "{saved}");
    assert_eq!(saved["state_hash"], hash.as_str(), "{saved}");
    assert_eq!(saved["cluster_id"], source_id.as_str(), "{saved}");
    assert_eq!(saved["unfinished_jobs"], 5, "{saved}");
    assert_eq!(support::mode(&file), 0o600, "owner-only");
    let inspected = json(&all, &["snapshot", "inspect", file_arg]).expect("inspected");
    assert_eq!(inspected["state_hash"], hash.as_str());
    assert_eq!(inspected["members"].as_array().map(Vec::len), Some(3));

    // A damaged copy is refused, naming what is wrong.
    let mut bytes = std::fs::read(&file).expect("read");
    let at = bytes.len() - 20;
    bytes[at] ^= 0x5a;
    let damaged = dir.path().join("damaged.snap");
    std::fs::write(&damaged, &bytes).expect("write");
    let out = cli(
        &all,
        &["snapshot", "inspect", damaged.to_str().expect("utf-8")],
    );
    assert!(!out.status.success());
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("damaged.snap"), "{err}");

    // A new cluster from it: member 1 restored, started; 2 and 3 added.
    let mut restored = Cluster::new();
    let r1 = restored.replicas[0].data.clone();
    let member_addr = restored.replicas[0].addr.clone();
    let restore = || {
        cli(
            &all,
            &[
                "snapshot",
                "restore",
                file_arg,
                "--data-dir",
                r1.to_str().expect("utf-8"),
                "--id",
                "1",
                "--member-addr",
                &member_addr,
            ],
        )
    };
    let out = restore();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    // Not into a directory that holds anything.
    let out = restore();
    assert!(!out.status.success());
    assert!(String::from_utf8_lossy(&out.stderr).contains("is not empty"));

    restored.spawn(1, &[]);
    assert_eq!(restored.leader(), 1);
    let first = restored.status(1).expect("status");
    assert_eq!(
        first["state_hash"],
        hash.as_str(),
        "the saved state, served: {first}"
    );
    assert_ne!(first["cluster_id"], source_id.as_str(), "a new cluster");
    let mut ids = BTreeSet::new();
    ids.extend(restored.jobs_on(1));
    assert_eq!(ids, submitted);
    for id in [2, 3] {
        restored.spawn(id, &[]);
        let addr = restored.replicas[id as usize - 1].addr.clone();
        let id_arg = id.to_string();
        let out = cli(
            &restored.replicas[0].addr,
            &["cluster", "add", "--id", &id_arg, "--member-addr", &addr],
        );
        assert!(
            out.status.success(),
            "{}",
            String::from_utf8_lossy(&out.stderr)
        );
    }
    restored.converged();
    for id in [2, 3] {
        assert_eq!(restored.jobs_on(id), submitted, "member {id}");
    }
    let after = restored
        .submit(&restored.all_addrs(), "after")
        .expect("it takes writes");
    assert!(!submitted.contains(&after));
}

/// Issue 25, item 7: a rolling restart under client load. Each member in
/// turn (the followers first, the leader last) is restarted once `keel
/// cluster status` says it is safe (every voter answering and caught up),
/// and the next waits until it says so again. A follower's restart changes
/// no leader (the term stays); the leader's, at most once. Every
/// submission acknowledged meanwhile is on every replica, once.
#[test]
fn a_rolling_restart_under_load_loses_nothing_and_changes_the_leader_at_most_once() {
    use std::sync::atomic::{AtomicBool, Ordering};
    use std::sync::{Arc, Mutex};

    let mut cluster = Cluster::start(&[]);
    let leader = cluster.leader();
    cluster.converged();
    let all = cluster.all_addrs();
    let spec = cluster._dir.path().join("load.yaml");
    std::fs::write(&spec, "name: load\ncommand: [\"true\"]\n").expect("spec");
    let stop = Arc::new(AtomicBool::new(false));
    let acked = Arc::new(Mutex::new(Vec::<u64>::new()));
    let load = {
        let (stop, acked, all) = (stop.clone(), acked.clone(), all.clone());
        let spec = spec.to_str().expect("utf-8").to_string();
        std::thread::spawn(move || {
            while !stop.load(Ordering::Relaxed) {
                // A submission the CLI could not get acknowledged (it tried
                // every address) is not counted; one it did is.
                if let Some(id) =
                    json(&all, &["submit", "-f", &spec]).and_then(|v| v["id"].as_u64())
                {
                    acked.lock().expect("lock").push(id);
                }
            }
        })
    };
    let safe = |cluster: &Cluster| -> Value {
        wait_for("cluster status to say a restart is safe", || {
            let status = cluster.json(&cluster.all_addrs(), &["cluster", "status"])?;
            (status["restart_safe"] == true).then_some(status)
        })
    };
    let leader_term = |status: &Value| -> u64 {
        status["members_status"]
            .as_array()
            .into_iter()
            .flatten()
            .find(|m| m["role"] == "leader")
            .and_then(|m| m["term"].as_u64())
            .expect("a leader's term")
    };
    let order: Vec<u64> = (1..=3).filter(|id| *id != leader).chain([leader]).collect();
    for id in order {
        let before = safe(&cluster);
        assert!(
            before["restart_advice"]
                .as_str()
                .is_some_and(|a| a.contains(&format!("the leader (member {leader}) last"))),
            "{before}"
        );
        let acked_before = acked.lock().expect("lock").len();
        cluster.terminate(id);
        cluster.spawn(id, &[]);
        let after = safe(&cluster);
        let (t0, t1) = (leader_term(&before), leader_term(&after));
        if id == leader {
            // At most one election (a split vote may take a second term,
            // still electing one leader); none when the restarted leader
            // is back before its followers' election timeouts.
            assert!(
                (t0..=t0 + 2).contains(&t1),
                "the leader's restart: term {t0} -> {t1}"
            );
        } else {
            assert_eq!(t1, t0, "member {id}'s restart changed the leader");
        }
        // The load went on through it.
        wait_for("more submissions acknowledged", || {
            (acked.lock().expect("lock").len() > acked_before + 3).then_some(())
        });
    }
    stop.store(true, Ordering::Relaxed);
    load.join().expect("the load's thread");
    let acked: BTreeSet<u64> = acked.lock().expect("lock").iter().copied().collect();
    assert!(acked.len() > 12, "{} submissions acknowledged", acked.len());
    cluster.converged();
    for id in 1..=3 {
        let on = cluster.jobs_on(id);
        assert!(
            acked.is_subset(&on),
            "member {id} lacks {:?}",
            acked.difference(&on).collect::<Vec<_>>()
        );
        // Nothing applied twice: every job is one acknowledged submission
        // (a submission whose answer was lost and not retried would be the
        // only other kind; the CLI retries with its request id).
        assert_eq!(
            on.len(),
            acked.len(),
            "member {id}: {} jobs for {} acknowledged",
            on.len(),
            acked.len()
        );
    }
}
