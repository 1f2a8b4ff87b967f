//! `/metrics`, `/healthz` and `/readyz` of a real server (issue 24, item
//! 1), read over HTTP as Prometheus reads them; `promtool check metrics`
//! on what it serves where Prometheus's tools are installed (required in
//! CI: `KEEL_REQUIRE_PROMETHEUS`).

mod support;

use std::io::Write;
use std::path::Path;
use std::process::{Command, Stdio};

use support::{available_or_skip, get, gpus_showing, start_with_http, submit_script, wait_for};

/// The value of the sample `name{labels}` (labels as written, in order),
/// if the text has it.
fn sample(text: &str, series: &str) -> Option<f64> {
    text.lines().filter(|l| !l.starts_with('#')).find_map(|l| {
        let (s, v) = l.rsplit_once(' ')?;
        (s == series).then(|| v.parse().ok()).flatten()
    })
}

/// Every `keel_...` name in `text`.
fn metric_names(text: &str) -> std::collections::BTreeSet<String> {
    let mut names = std::collections::BTreeSet::new();
    let mut rest = text;
    while let Some(at) = rest.find("keel_") {
        let tail = &rest[at..];
        let end = tail
            .find(|c: char| !(c.is_ascii_lowercase() || c.is_ascii_digit() || c == '_'))
            .unwrap_or(tail.len());
        names.insert(tail[..end].to_string());
        rest = &tail[end..];
    }
    names
}

/// Whether the exposition `text` (classic format) declares the series
/// `name` (a histogram's `_bucket`, `_sum` and `_count` by its family).
fn declares(text: &str, name: &str) -> bool {
    let family = ["_bucket", "_sum", "_count"]
        .iter()
        .find_map(|s| name.strip_suffix(s))
        .filter(|f| text.contains(&format!("# TYPE {f} histogram")));
    family.is_some()
        || text
            .lines()
            .any(|l| l.starts_with(&format!("# TYPE {name} ")))
}

/// The repository's root (README.md, deploy/).
fn root() -> std::path::PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .parent()
        .expect("the workspace root")
        .to_path_buf()
}

#[test]
fn a_server_shows_its_jobs_gpus_raft_and_requests_to_prometheus() {
    let dir = tempfile::tempdir().expect("tempdir");
    let data = dir.path().join("data");
    let (server, http) = start_with_http(&data);
    assert_eq!(get(&http, "/healthz").expect("healthz").0, 200);
    wait_for("ready", || {
        (get(&http, "/readyz").ok()?.0 == 200).then_some(())
    });
    let (status, missing) = get(&http, "/nothing-here").expect("answers");
    assert_eq!(status, 404, "{missing}");

    let id = submit_script(&server, dir.path(), "sleeper", "sleep 60");
    let text = wait_for("the job running in the metrics", || {
        let (status, text) = get(&http, "/metrics").ok()?;
        assert_eq!(status, 200);
        // Placed (the state), then launched (the executor, just after).
        (sample(&text, "keel_jobs{state=\"running\"}") == Some(1.0)
            && sample(
                &text,
                "keel_executor_launches_total{executor=\"local\",result=\"ok\"}",
            ) == Some(1.0))
        .then_some(text)
    });
    assert_eq!(
        sample(&text, "keel_gpus{gpu_type=\"v100\"}"),
        Some(2.0),
        "{text}"
    );
    // The policy's own plan is timed in each round that ran it.
    let solves = sample(
        &text,
        "keel_scheduling_policy_solve_duration_seconds_count{policy=\"fifo\"}",
    )
    .expect("the policy's solve time");
    let rounds = sample(&text, "keel_scheduling_rounds_total{policy=\"fifo\"}").expect("rounds");
    assert!(solves >= 1.0 && solves <= rounds, "{text}");
    assert_eq!(
        sample(&text, "keel_gpus_in_use{gpu_type=\"v100\"}"),
        Some(1.0),
        "{text}"
    );
    assert_eq!(
        sample(&text, "keel_jobs_submitted_total"),
        Some(1.0),
        "{text}"
    );
    assert_eq!(
        sample(&text, "keel_queue_admitted_jobs{queue=\"default\"}"),
        Some(1.0),
        "{text}"
    );
    assert_eq!(
        sample(&text, "keel_nodes{state=\"alive\"}"),
        Some(1.0),
        "{text}"
    );
    assert_eq!(sample(&text, "keel_raft_has_leader"), Some(1.0), "{text}");
    assert_eq!(sample(&text, "keel_raft_is_leader"), Some(1.0), "{text}");
    // Every append so far waited for its fdatasync, and was timed.
    assert!(
        sample(&text, "keel_wal_fsync_duration_seconds_count").is_some_and(|n| n >= 3.0),
        "{text}"
    );
    assert!(
        sample(&text, "keel_wal_fsync_duration_seconds_bucket{le=\"+Inf\"}")
            == sample(&text, "keel_wal_fsync_duration_seconds_count"),
        "{text}"
    );
    assert_eq!(
        sample(&text, "keel_snapshot_duration_seconds_count"),
        Some(0.0),
        "{text}"
    );
    for phase in ["read", "encode", "save", "compact"] {
        assert_eq!(
            sample(
                &text,
                &format!("keel_snapshot_phase_duration_seconds_count{{phase=\"{phase}\"}}")
            ),
            Some(0.0),
            "{text}"
        );
    }
    let applied = sample(&text, "keel_raft_applied_index").expect("applied index");
    assert!(applied >= 3.0, "{text}");
    assert_eq!(
        sample(
            &text,
            "keel_api_requests_total{method=\"SubmitJob\",code=\"OK\"}"
        ),
        Some(1.0),
        "{text}"
    );
    assert!(
        sample(
            &text,
            "keel_api_request_duration_seconds_count{method=\"SubmitJob\"}"
        ) == Some(1.0),
        "{text}"
    );
    assert!(
        sample(&text, "keel_scheduling_decisions_total").is_some_and(|n| n >= 1.0),
        "{text}"
    );
    assert!(
        sample(&text, "keel_scheduling_rounds_total{policy=\"fifo\"}").is_some_and(|n| n >= 1.0),
        "{text}"
    );
    assert!(
        sample(&text, "keel_raft_proposals_total").is_some_and(|n| n >= 2.0),
        "{text}"
    );
    assert_eq!(
        sample(
            &text,
            "keel_executor_launch_duration_seconds_count{executor=\"local\"}"
        ),
        Some(1.0),
        "{text}"
    );

    // The console: its page, and the job on the GPU the API says it holds.
    let (status, page) = get(&http, "/").expect("the console");
    assert_eq!(status, 200);
    assert!(page.contains("<title>Keel</title>") && page.contains("/api/v1/cluster"));
    let held = server.json(&["job", &id])["allocation"]["gpus"][0]
        .as_str()
        .expect("a GPU")
        .to_string();
    let (status, body) = get(&http, "/api/v1/cluster").expect("the cluster");
    assert_eq!(status, 200);
    let cluster: serde_json::Value = serde_json::from_str(&body).expect("JSON");
    let shown = gpus_showing(&cluster, id.parse().expect("an id"));
    assert_eq!(shown, vec![held], "{body}");
    assert_eq!(
        cluster["raft"]["leader"], cluster["raft"]["member"],
        "{body}"
    );

    // A job cancelled is counted once its end is applied; a request for a
    // job that does not exist is counted with its code.
    server.cli_ok(&["cancel", &id]);
    let missing = server.cli(&["job", "999"]);
    assert!(!missing.status.success());
    let text = wait_for("the cancel counted", || {
        let (_, text) = get(&http, "/metrics").ok()?;
        (sample(&text, "keel_jobs_finished_total{outcome=\"cancelled\"}") == Some(1.0))
            .then_some(text)
    });
    assert_eq!(
        sample(
            &text,
            "keel_api_requests_total{method=\"GetJob\",code=\"NOT_FOUND\"}"
        ),
        Some(1.0),
        "{text}"
    );
    assert_eq!(
        sample(&text, "keel_jobs{state=\"cancelled\"}"),
        Some(1.0),
        "{text}"
    );

    // Every metric the Grafana dashboard and the README name is served.
    let dashboard =
        std::fs::read_to_string(root().join("deploy/grafana/keel.json")).expect("the dashboard");
    let readme = std::fs::read_to_string(root().join("README.md")).expect("README.md");
    let section = readme
        .split("## Metrics and health")
        .nth(1)
        .and_then(|s| s.split("\n## ").next())
        .expect("README's metrics section");
    let named: Vec<String> = metric_names(&dashboard)
        .into_iter()
        .chain(metric_names(section))
        .collect();
    assert!(named.len() > 20, "{named:?}");
    let missing: Vec<&String> = named.iter().filter(|n| !declares(&text, n)).collect();
    assert!(
        missing.is_empty(),
        "named but not served: {missing:?}\n{text}"
    );

    // What Prometheus's own checker says of the exposition.
    if available_or_skip(
        "promtool",
        "a_server_shows_its_jobs_gpus_raft_and_requests_to_prometheus (promtool check metrics)",
        "KEEL_REQUIRE_PROMETHEUS",
    ) {
        assert_promtool_passes(&text, "the replica");
    }
    // The console says why a job waits, as `keel job` does.
    let big = support::submit_spec(
        &server,
        dir.path(),
        serde_json::json!({"name": "too-big", "command": ["sleep", "60"], "gpus": 4, "workers": 1}),
    );
    let (_, body) = get(&http, "/api/v1/cluster").expect("the cluster");
    let cluster: serde_json::Value = serde_json::from_str(&body).expect("JSON");
    let shown = cluster["jobs"]
        .as_array()
        .expect("jobs")
        .iter()
        .find(|j| j["id"].as_u64().map(|id| id.to_string()).as_deref() == Some(big.as_str()))
        .cloned()
        .expect("the waiting job listed");
    let said = server.json(&["job", &big])["message"].clone();
    assert!(
        shown["message"]
            .as_str()
            .is_some_and(|m| m.contains("no node")),
        "{shown}"
    );
    assert_eq!(shown["message"], said);
    server.terminate();
}

/// `promtool check metrics` passes on the exposition `text` (of `whose`).
fn assert_promtool_passes(text: &str, whose: &str) {
    let mut check = Command::new("promtool")
        .args(["check", "metrics"])
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("promtool runs");
    check
        .stdin
        .take()
        .expect("stdin")
        .write_all(text.as_bytes())
        .expect("written");
    let out = check.wait_with_output().expect("promtool ends");
    assert!(
        out.status.success(),
        "promtool check metrics on {whose}'s: {}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
}

/// A port from below the kernel's ephemeral range, free when chosen and
/// handed out once per process (servers binding port 0 never take it).
fn free_port() -> u16 {
    use std::sync::atomic::{AtomicU16, Ordering};
    static NEXT: AtomicU16 = AtomicU16::new(0);
    let base = 21_000 + (std::process::id() % 300) as u16 * 37;
    loop {
        let port = base + NEXT.fetch_add(1, Ordering::Relaxed) % 20_000;
        if std::net::TcpListener::bind(("127.0.0.1", port)).is_ok() {
            return port;
        }
    }
}

/// Kills the children when dropped (a failed assertion leaves no process
/// behind).
struct Children(Vec<std::process::Child>);

impl Drop for Children {
    fn drop(&mut self) {
        for c in &mut self.0 {
            let _ = c.kill();
            let _ = c.wait();
        }
    }
}

/// What Prometheus's HTTP API answers for the instant query `promql`: the
/// values of the result's series, in its order.
fn query(prometheus: &str, promql: &str) -> Option<Vec<f64>> {
    let encoded: String = promql
        .bytes()
        .map(|b| match b {
            b'A'..=b'Z' | b'a'..=b'z' | b'0'..=b'9' | b'-' | b'_' | b'.' | b'~' => {
                (b as char).to_string()
            }
            _ => format!("%{b:02X}"),
        })
        .collect();
    let (status, body) = get(prometheus, &format!("/api/v1/query?query={encoded}")).ok()?;
    if status != 200 {
        return None;
    }
    let answer: serde_json::Value = serde_json::from_str(&body).ok()?;
    answer["data"]["result"]
        .as_array()?
        .iter()
        .map(|series| series["value"][1].as_str()?.parse().ok())
        .collect()
}

/// A real Prometheus scrapes a three-replica cluster; PromQL over what it
/// stored gives the GPUs in use and the jobs of a scripted workload, the
/// same on every replica, and one leader.
#[test]
fn prometheus_scrapes_three_replicas_and_promql_sees_the_workload() {
    if !available_or_skip(
        "prometheus",
        "prometheus_scrapes_three_replicas_and_promql_sees_the_workload",
        "KEEL_REQUIRE_PROMETHEUS",
    ) {
        return;
    }
    let dir = tempfile::tempdir().expect("tempdir");
    let api: Vec<String> = (0..3)
        .map(|_| format!("127.0.0.1:{}", free_port()))
        .collect();
    let http: Vec<String> = (0..3)
        .map(|_| format!("127.0.0.1:{}", free_port()))
        .collect();
    let peers = api
        .iter()
        .enumerate()
        .map(|(i, a)| format!("{}={a}", i + 1))
        .collect::<Vec<_>>()
        .join(",");
    let mut children = Children(Vec::new());
    for i in 0..3 {
        let id = (i + 1).to_string();
        let log = std::fs::File::create(dir.path().join(format!("r{id}.log"))).expect("log");
        children.0.push(
            Command::new(env!("CARGO_BIN_EXE_keel"))
                .args([
                    "server", "--id", &id, "--peers", &peers, "--listen", &api[i],
                ])
                .args(["--http-listen", &http[i], "--round-s", "0.3"])
                .args([
                    "--simulated-gpus",
                    "2xv100",
                    "--node-name",
                    &format!("r{id}"),
                ])
                .arg("--data-dir")
                .arg(dir.path().join(format!("r{id}")))
                .stdout(Stdio::null())
                .stderr(log)
                .spawn()
                .expect("spawn keel server"),
        );
    }
    // Prometheus, scraping every second.
    let prometheus = format!("127.0.0.1:{}", free_port());
    let targets = http
        .iter()
        .map(|h| format!("'{h}'"))
        .collect::<Vec<_>>()
        .join(", ");
    let config = dir.path().join("prometheus.yml");
    std::fs::write(
        &config,
        format!(
            "global:\n  scrape_interval: 1s\n  evaluation_interval: 1s\n\
             scrape_configs:\n  - job_name: keel\n    static_configs:\n      - targets: [{targets}]\n"
        ),
    )
    .expect("config");
    let log = std::fs::File::create(dir.path().join("prometheus.log")).expect("log");
    children.0.push(
        Command::new("prometheus")
            .arg(format!("--config.file={}", config.display()))
            .arg(format!(
                "--storage.tsdb.path={}",
                dir.path().join("tsdb").display()
            ))
            .arg(format!("--web.listen-address={prometheus}"))
            .stdout(Stdio::null())
            .stderr(log)
            .spawn()
            .expect("spawn prometheus"),
    );
    // Every target up, one leader among them.
    wait_for("Prometheus scraping three replicas", || {
        (query(&prometheus, "sum(up{job=\"keel\"})")? == vec![3.0]).then_some(())
    });
    wait_for("one leader, seen by all", || {
        (query(&prometheus, "sum(keel_raft_is_leader)")? == vec![1.0]
            && query(&prometheus, "sum(keel_raft_has_leader)")? == vec![3.0])
        .then_some(())
    });
    // The workload: three jobs of one GPU each, and one that no node can
    // hold (it waits).
    let all = api.join(",");
    let submit = |name: &str, gpus: &str| {
        let spec = dir.path().join(format!("{name}.json"));
        std::fs::write(
            &spec,
            format!(
                "{{\"name\": \"{name}\", \"command\": [\"sleep\", \"60\"], \"gpus\": {gpus}, \"workers\": 1}}"
            ),
        )
        .expect("spec");
        let out = Command::new(env!("CARGO_BIN_EXE_keel"))
            .args(["submit", "-f"])
            .arg(&spec)
            .env("KEEL_ADDR", &all)
            .output()
            .expect("keel submit");
        assert!(
            out.status.success(),
            "{}",
            String::from_utf8_lossy(&out.stderr)
        );
    };
    for name in ["a", "b", "c"] {
        submit(name, "1");
    }
    submit("too-big", "4");
    // Every replica applied it: the same figures from each of the three.
    wait_for("the workload in Prometheus", || {
        (query(&prometheus, "keel_gpus_in_use{gpu_type=\"v100\"}")? == vec![3.0; 3]
            && query(&prometheus, "keel_gpus{gpu_type=\"v100\"}")? == vec![6.0; 3]
            && query(&prometheus, "keel_jobs_submitted_total")? == vec![4.0; 3]
            && query(&prometheus, "keel_queue_pending_jobs{queue=\"default\"}")? == vec![1.0; 3])
        .then_some(())
    });
    // Each submission counted by the replica it reached, and once more by
    // the leader when a follower forwarded it.
    let submits = wait_for("the submissions scraped", || {
        let v = query(
            &prometheus,
            "sum(keel_api_requests_total{method=\"SubmitJob\",code=\"OK\"})",
        )?;
        v.first().copied().filter(|n| *n >= 4.0)
    });
    assert!(submits <= 8.0, "{submits} SubmitJob requests counted for 4");
    assert!(
        query(&prometheus, "sum(keel_scheduling_decisions_total)")
            .is_some_and(|v| v.first().is_some_and(|n| *n >= 1.0)),
        "the leader's decisions"
    );
    // Prometheus's own checker passes on every replica's exposition (the
    // leader's has the followers' lag too).
    for (i, addr) in http.iter().enumerate() {
        let (status, text) = get(addr, "/metrics").expect("/metrics");
        assert_eq!(status, 200);
        assert_promtool_passes(&text, &format!("replica {}", i + 1));
    }
    // Every query of the Grafana dashboard, as Grafana would send it
    // (its `$job` variable set to this job), runs on what Prometheus
    // scraped, and the cluster's panels show the workload. (Grafana itself
    // is in none of the registries CI reaches.)
    let dashboard: serde_json::Value = serde_json::from_str(
        &std::fs::read_to_string(root().join("deploy/grafana/keel.json")).expect("dashboard"),
    )
    .expect("the dashboard is JSON");
    let queries: Vec<(String, String)> = dashboard["panels"]
        .as_array()
        .expect("panels")
        .iter()
        .flat_map(|panel| {
            let title = panel["title"].as_str().unwrap_or_default().to_string();
            panel["targets"]
                .as_array()
                .cloned()
                .unwrap_or_default()
                .into_iter()
                .filter_map(move |t| {
                    Some((title.clone(), t["expr"].as_str()?.replace("$job", "keel")))
                })
        })
        .collect();
    assert!(queries.len() > 20, "{queries:?}");
    for (title, promql) in &queries {
        assert!(
            query(&prometheus, promql).is_some(),
            "{title}: Prometheus refused {promql}"
        );
    }
    let shows = |title: &str, expected: &[f64]| {
        wait_for(&format!("the panel {title:?}"), || {
            queries
                .iter()
                .filter(|(t, _)| t == title)
                .any(|(_, q)| query(&prometheus, q).as_deref() == Some(expected))
                .then_some(())
        })
    };
    shows("GPUs in use by type", &[3.0]);
    shows("Raft health", &[1.0]);
    shows("Queue depth", &[1.0]);
}

/// `keel server` refuses a bad `--http-listen` before it starts anything,
/// naming the flag: an address that is not one, and an address beyond
/// loopback without `--insecure`.
#[test]
fn a_bad_http_listen_is_refused_with_the_flag_named() {
    let dir = tempfile::tempdir().expect("tempdir");
    for (value, says) in [
        ("metrics-please", "--http-listen"),
        ("0.0.0.0:0", "--insecure"),
    ] {
        let out = Command::new(env!("CARGO_BIN_EXE_keel"))
            .args(["server", "--listen", "127.0.0.1:0", "--http-listen", value])
            .arg("--data-dir")
            .arg(dir.path().join("data"))
            .output()
            .expect("keel server runs");
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert!(!out.status.success(), "{value}: started");
        assert!(stderr.contains(says), "{value}: {stderr}");
        assert!(
            !dir.path().join("data").join("server.addr").exists(),
            "{value}: it served"
        );
    }
}
