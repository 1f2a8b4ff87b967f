//! The web console (issue 24, item 4) of a real server: time travel
//! through `/api/v1/cluster?at=N` against `keel replay --until N`, and the
//! page in a real headless browser (Debian's Chromium, required in CI:
//! `KEEL_REQUIRE_CHROMIUM`), its DOM read after its scripts ran.

mod support;

use std::process::Command;

use support::{
    available_or_skip, get, get_with, gpus_showing, start_with_http, submit_script, wait_for,
};

/// The page at `url` as headless Chromium draws it: the DOM once it has
/// loaded and its scripts have run (the server inlines what the page
/// first shows, so it is drawn by then; the page's event stream stays
/// open, so no wait for the network to fall quiet), and what the browser
/// logged.
fn rendered(url: &str) -> (String, String) {
    let out = Command::new("chromium")
        .args([
            "--headless",
            "--no-sandbox",
            "--disable-gpu",
            "--disable-dev-shm-usage",
            "--enable-logging=stderr",
            "--dump-dom",
            url,
        ])
        .output()
        .expect("chromium runs");
    assert!(
        out.status.success(),
        "chromium: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    (
        String::from_utf8_lossy(&out.stdout).into_owned(),
        String::from_utf8_lossy(&out.stderr).into_owned(),
    )
}

/// The first `want` events of the server-sent event stream at `path` on
/// `addr` (with `headers`), as (id, data); fewer if it has no more within
/// ten seconds.
fn sse_events(addr: &str, path: &str, headers: &str, want: usize) -> Vec<(String, String)> {
    sse_until(addr, path, headers, |events| events.len() == want)
}

/// The events of the stream at `path` until `enough` says so (or none
/// comes for ten seconds).
fn sse_until(
    addr: &str,
    path: &str,
    headers: &str,
    enough: impl Fn(&[(String, String)]) -> bool,
) -> Vec<(String, String)> {
    use std::io::{BufRead, BufReader, Write};
    let mut stream = std::net::TcpStream::connect(addr).expect("connects");
    stream
        .set_read_timeout(Some(std::time::Duration::from_secs(10)))
        .expect("timeout");
    write!(
        stream,
        "GET {path} HTTP/1.1\r\nHost: {addr}\r\nAccept: text/event-stream\r\n{headers}\r\n"
    )
    .expect("sent");
    let mut events = Vec::new();
    let (mut id, mut data) = (String::new(), String::new());
    for line in BufReader::new(stream).lines() {
        let Ok(line) = line else { break };
        // Chunked framing: the chunk sizes are lines of their own.
        if let Some(v) = line.strip_prefix("id: ") {
            id = v.to_string();
        } else if let Some(v) = line.strip_prefix("data: ") {
            data = v.to_string();
        } else if line.is_empty() && !data.is_empty() {
            events.push((std::mem::take(&mut id), std::mem::take(&mut data)));
            if enough(&events) {
                break;
            }
        }
    }
    events
}

/// The page's console messages in what Chromium logged (errors and
/// uncaught exceptions among them; the console page itself logs nothing).
fn console_lines(log: &str) -> Vec<String> {
    log.lines()
        .filter(|l| l.contains(":CONSOLE"))
        .map(str::to_string)
        .collect()
}

/// Time travel (issue 24, item 4): `/api/v1/cluster?at=N` draws the
/// cluster as it was at index N, rebuilt from the running replica's
/// journal; its state hash is the one `keel replay --until N` prints once
/// the server stops. Bad queries are refused, naming the parameter.
#[test]
fn the_console_rewinds_to_an_index_as_keel_replay_does() {
    let dir = tempfile::tempdir().expect("tempdir");
    let data = dir.path().join("data");
    let (server, http) = start_with_http(&data);
    let id = submit_script(&server, dir.path(), "sleeper", "sleep 60");
    let number: u64 = id.parse().expect("an id");
    let held = wait_for("the job placed", || {
        let job = server.json(&["job", &id]);
        job["allocation"]["gpus"][0].as_str().map(str::to_string)
    });
    let running_at = wait_for("the placement applied", || {
        let (_, body) = get(&http, "/api/v1/cluster").ok()?;
        let c: serde_json::Value = serde_json::from_str(&body).ok()?;
        let listed = c["jobs"].as_array()?.iter().any(|j| {
            j["id"].as_u64() == Some(number) && j["gpus"] == serde_json::json!([held.clone()])
        });
        listed.then(|| c["applied_index"].as_u64()).flatten()
    });
    server.cli_ok(&["cancel", &id]);
    wait_for("the cancel applied", || {
        (server.json(&["job", &id])["state"] == "cancelled").then_some(())
    });

    // Now: cancelled, holding nothing. Then: running on its GPU.
    let (_, body) = get(&http, "/api/v1/cluster").expect("now");
    let now: serde_json::Value = serde_json::from_str(&body).expect("JSON");
    assert!(now.get("at").is_none(), "{body}");
    assert!(now["nodes"][0]["gpus"]
        .as_array()
        .expect("gpus")
        .iter()
        .all(|g| g["jobs"] == serde_json::json!([])));
    let (status, body) = wait_for("the journal caught up", || {
        let (status, body) = get(&http, &format!("/api/v1/cluster?at={running_at}")).ok()?;
        let then: serde_json::Value = serde_json::from_str(&body).ok()?;
        (then["at"]["index"].as_u64() == Some(running_at)).then_some((status, body))
    });
    assert_eq!(status, 200, "{body}");
    let then: serde_json::Value = serde_json::from_str(&body).expect("JSON");
    let job = then["jobs"]
        .as_array()
        .expect("jobs")
        .iter()
        .find(|j| j["id"].as_u64() == Some(number))
        .cloned()
        .expect("the job, then");
    assert_eq!(job["state"], "running", "{body}");
    assert_eq!(job["gpus"], serde_json::json!([held.clone()]), "{body}");
    let on_gpu = gpus_showing(&then, number);
    assert_eq!(on_gpu, vec![held.clone()], "{body}");
    let hash_then = then["at"]["state_hash"]
        .as_str()
        .expect("a hash")
        .to_string();
    // The page has the slider that asks for it.
    let (_, page) = get(&http, "/").expect("the console");
    assert!(page.contains("id=\"index\"") && page.contains("\"at=\""));

    // Refused, naming what is wrong.
    for (query, names) in [
        ("at=soon", "at must be a log index"),
        ("at_time=yesterday", "at_time must be an RFC 3339 time"),
        ("at=1&at_time=2026-11-26T10:00:00Z", "not both"),
        ("index=3", "unknown field `index`"),
    ] {
        let (status, body) = get(&http, &format!("/api/v1/cluster?{query}")).expect("answers");
        assert_eq!(status, 400, "{query}: {body}");
        assert!(body.contains(names), "{query}: {body}");
    }

    // The job's page: its allocation from placement to cancel, and its
    // history entry by entry as `keel why` gives it.
    let why = wait_for("the worker's exit recorded", || {
        let why = server.json(&["why", &id]);
        let entries = why["entries"].as_array()?;
        entries
            .iter()
            .any(|e| e["command"] == "record_worker_exited")
            .then_some(why)
    });
    let (status, body) = get(&http, &format!("/api/v1/jobs/{id}")).expect("the job's page");
    assert_eq!(status, 200, "{body}");
    let page: serde_json::Value = serde_json::from_str(&body).expect("JSON");
    let allocations = page["allocations"].as_array().expect("allocations");
    assert_eq!(allocations.len(), 1, "{body}");
    assert_eq!(
        allocations[0]["gpus"],
        serde_json::json!([held.clone()]),
        "{body}"
    );
    assert_eq!(allocations[0]["ended_by"], "cancelled", "{body}");
    assert!(allocations[0]["from_index"].as_u64().expect("from") <= running_at);
    assert!(allocations[0]["to_index"].as_u64().expect("to") > running_at);
    // Its history is complete once the worker's exit is recorded.
    let indexes = |entries: &serde_json::Value| -> Vec<u64> {
        entries
            .as_array()
            .expect("entries")
            .iter()
            .filter_map(|e| e["index"].as_u64())
            .collect()
    };
    assert_eq!(
        indexes(&page["history"]),
        indexes(&why["entries"]),
        "{body}"
    );
    assert!(page["history"][0]["what"]
        .as_str()
        .is_some_and(|w| w.contains("submitted")));
    assert!(!body.contains("sleep 60"), "no command on the page: {body}");
    for (path, code) in [("/api/v1/jobs/x1", 400), ("/api/v1/jobs/999", 404)] {
        let (status, body) = get(&http, path).expect("answers");
        assert_eq!(status, code, "{path}: {body}");
    }

    // The log as it is applied: server-sent events from an index, and
    // from where a reconnecting browser left off.
    let first = sse_events(&http, "/api/v1/events?from=1", "", 3);
    assert_eq!(first.len(), 3, "{first:?}");
    let is_submission = |data: &str| data.contains(&format!("job {id} submitted: sleeper"));
    let submitted = sse_until(&http, "/api/v1/events?from=1", "", |events| {
        events.iter().any(|(_, data)| is_submission(data))
    })
    .into_iter()
    .find(|(_, data)| is_submission(data))
    .expect("the submission in the stream");
    let entry: serde_json::Value = serde_json::from_str(&submitted.1).expect("JSON");
    assert_eq!(entry["command"], "submit_job", "{entry}");
    assert_eq!(
        submitted.0,
        format!("{}.{}", entry["index"], entry["position"]),
        "{entry}"
    );
    let resumed = sse_events(
        &http,
        "/api/v1/events",
        &format!("Last-Event-ID: {}\r\n", submitted.0),
        1,
    );
    let next: serde_json::Value = serde_json::from_str(&resumed[0].1).expect("JSON");
    assert!(
        next["index"].as_u64() > entry["index"].as_u64()
            || (next["index"] == entry["index"]
                && next["position"].as_u64() > entry["position"].as_u64()),
        "{next} after {entry}"
    );
    for (path, headers, names) in [
        ("/api/v1/events?from=soon", "", "from must be a log index"),
        (
            "/api/v1/events",
            "Last-Event-ID: yesterday\r\n",
            "Last-Event-ID must be INDEX.POSITION",
        ),
    ] {
        let (status, body) = get_with(&http, path, headers);
        assert_eq!(status, 400, "{path}: {body}");
        assert!(body.contains(names), "{path}: {body}");
    }
    // At most so many streams at once: one more is refused.
    let streams: Vec<std::net::TcpStream> = (0..keel::http::EVENT_STREAMS_MAX)
        .map(|_| {
            use std::io::{Read, Write};
            let mut s = std::net::TcpStream::connect(&http).expect("connects");
            write!(s, "GET /api/v1/events HTTP/1.1\r\nHost: {http}\r\n\r\n").expect("sent");
            let mut head = [0u8; 12];
            s.read_exact(&mut head).expect("an answer");
            assert_eq!(&head, b"HTTP/1.1 200");
            s
        })
        .collect();
    let (status, body) = get_with(&http, "/api/v1/events", "");
    assert_eq!(status, 429, "{body}");
    assert!(body.contains("event streams already"), "{body}");
    drop(streams);

    // The same in a real browser: the page's scripts draw the job on its
    // GPU now-then, with no message on the browser's console.
    if available_or_skip(
        "chromium",
        "the_console_rewinds_to_an_index_as_keel_replay_does (headless Chromium)",
        "KEEL_REQUIRE_CHROMIUM",
    ) {
        // The check finds a page's error (it can fail).
        let (_, said) = rendered("data:text/html,<script>undefinedFunction()</script>");
        assert!(
            console_lines(&said)
                .iter()
                .any(|l| l.contains("undefinedFunction")),
            "{said}"
        );

        let (dom, said) = rendered(&format!("http://{http}/?at={running_at}"));
        assert_eq!(console_lines(&said), Vec::<String>::new(), "{said}");
        assert!(
            dom.contains(&format!("data-gpu=\"{held}\" data-jobs=\"{number}\"")),
            "{dom}"
        );
        assert!(
            dom.contains(&format!(
                "data-index=\"{running_at}\" data-state-hash=\"{hash_then}\""
            )),
            "{dom}"
        );
        let (dom, said) = rendered(&format!("http://{http}/?job={id}"));
        assert_eq!(console_lines(&said), Vec::<String>::new(), "{said}");
        assert!(
            dom.contains(&format!(
                "data-epoch=\"1\" data-gpus=\"{held}\" data-ended-by=\"cancelled\""
            )),
            "{dom}"
        );
        let rows = dom.matches("<tr data-index=").count();
        assert_eq!(rows, indexes(&why["entries"]).len(), "{dom}");
        let (dom, said) = rendered(&format!("http://{http}/"));
        assert_eq!(console_lines(&said), Vec::<String>::new(), "{said}");
        assert!(
            dom.contains(&format!("data-gpu=\"{held}\" data-jobs=\"\"")),
            "{dom}"
        );
        assert!(dom.contains("id=\"at\" class=\"\">live<"), "{dom}");
    }

    server.terminate();
    let replayed = support::json_of(Command::new(support::KEEL).args([
        "replay",
        "--data-dir",
        data.to_str().expect("a path"),
        "--until",
        &running_at.to_string(),
        "-o",
        "json",
    ]));
    assert_eq!(replayed["state_hash"], hash_then, "{replayed}");
    assert_eq!(replayed["last_index"], running_at, "{replayed}");
}

/// The console's what-if (issue 27, item 3): the replica's own history,
/// read from its journal while it serves, run through the policies that
/// decided and the ones asked for. It is the report `keel whatif` gives
/// on the data directory once the server stopped, up to the same index,
/// with the figures `keel whatif --plot` draws; the page shows it; bad
/// queries are refused, naming the parameter.
#[test]
fn the_console_runs_a_whatif_on_the_replicas_history_as_keel_whatif_does() {
    let dir = tempfile::tempdir().expect("tempdir");
    let data = dir.path().join("data");
    let (server, http) = start_with_http(&data);
    // Three jobs on two GPUs: one of them waits.
    let ids: Vec<String> = (0..3)
        .map(|i| submit_script(&server, dir.path(), &format!("short-{i}"), "sleep 1"))
        .collect();
    for id in &ids {
        wait_for("the job succeeded", || {
            (server.json(&["job", id])["state"] == "succeeded").then_some(())
        });
    }
    let whatif = wait_for("the journal caught up", || {
        let (status, body) = get(&http, "/api/v1/whatif?policy=fifo,srjf").ok()?;
        assert_eq!(status, 200, "{body}");
        let w: serde_json::Value = serde_json::from_str(&body).ok()?;
        (w["history"]["succeeded"] == 3).then_some(w)
    });
    let runs: Vec<&str> = whatif["runs"]
        .as_array()
        .expect("runs")
        .iter()
        .filter_map(|r| r["policy"].as_str())
        .collect();
    assert_eq!(runs, ["recorded", "fifo", "srjf"], "{whatif}");
    assert_eq!(whatif["history"]["jobs"], 3, "{whatif}");
    assert_eq!(whatif["validation"]["jobs_compared"], 3, "{whatif}");
    let figures: Vec<(&str, &str)> = whatif["figures"]
        .as_array()
        .expect("figures")
        .iter()
        .map(|f| {
            (
                f["name"].as_str().expect("a name"),
                f["svg"].as_str().expect("an SVG"),
            )
        })
        .collect();
    assert_eq!(
        figures.iter().map(|f| f.0).collect::<Vec<_>>(),
        ["jct_cdf.svg", "utilisation.svg", "queue.svg"]
    );
    assert!(
        figures.iter().all(|(_, svg)| svg.starts_with("<svg")
            && svg.contains("recorded")
            && svg.contains("srjf")),
        "{figures:?}"
    );
    let last_index = whatif["history"]["last_index"].as_u64().expect("an index");
    assert!(whatif.get("changed_cluster").is_none(), "{whatif}");

    // With two more GPUs: the runs have four, and jobs wait less; the
    // simulator's error is still the one on the recorded nodes.
    let (status, body) = get(
        &http,
        &format!("/api/v1/whatif?policy=fifo&until={last_index}&add_nodes=1x2xv100"),
    )
    .expect("answers");
    assert_eq!(status, 200, "{body}");
    let bigger: serde_json::Value = serde_json::from_str(&body).expect("JSON");
    assert_eq!(bigger["changed_cluster"], serde_json::json!({"v100": 4}));
    assert_eq!(bigger["validation"], whatif["validation"]);
    let (runs, runs_bigger) = (&whatif["runs"], &bigger["runs"]);
    let queueing = |w: &serde_json::Value, policy: &str| {
        w["runs"]
            .as_array()
            .expect("runs")
            .iter()
            .find(|r| r["policy"] == policy)
            .and_then(|r| r["mean_queueing_s"].as_f64())
            .expect("a run")
    };
    assert!(
        queueing(&bigger, "fifo") < queueing(&whatif, "fifo"),
        "{runs_bigger} against {runs}"
    );

    for (query, code, names) in [
        ("policy=fifo,nosuch", 400, "unknown policy \"nosuch\""),
        ("until=soon", 400, "until must be a log index"),
        (
            "until_time=yesterday",
            400,
            "until_time must be an RFC 3339 time",
        ),
        (
            "from_time=yesterday",
            400,
            "from_time must be an RFC 3339 time",
        ),
        ("until=3&until_time=2026-11-26T10:00:00Z", 400, "not both"),
        ("policies=fifo", 400, "unknown field `policies`"),
        ("until=0", 422, "holds no job submitted in the range"),
        (
            "add_nodes=2x8",
            400,
            "add_nodes: \"2x8\": expected COUNTxGPUSxTYPE",
        ),
    ] {
        let (status, body) = get(&http, &format!("/api/v1/whatif?{query}")).expect("answers");
        assert_eq!(status, code, "{query}: {body}");
        assert!(body.contains(names), "{query}: {body}");
    }

    if available_or_skip(
        "chromium",
        "the_console_runs_a_whatif_on_the_replicas_history_as_keel_whatif_does (headless Chromium)",
        "KEEL_REQUIRE_CHROMIUM",
    ) {
        let (dom, said) = rendered(&format!("http://{http}/?whatif=fifo"));
        assert_eq!(console_lines(&said), Vec::<String>::new(), "{said}");
        for drawn in [
            "<tr data-run=\"recorded\">",
            "<tr data-run=\"fifo\">",
            "<tr data-figure=\"mean JCT\">",
            "data-figure=\"jct_cdf.svg\"",
            "data-figure=\"queue.svg\"",
        ] {
            assert!(dom.contains(drawn), "{drawn} in {dom}");
        }
    }

    server.terminate();
    // `keel whatif` on the stopped replica's data directory, up to the same
    // index, with the server's own round (`start_with_http`): the same
    // report, figures aside.
    let offline = |policy: &str, more: &[&str]| {
        let until = last_index.to_string();
        let mut args = vec![
            "whatif",
            "--data-dir",
            data.to_str().expect("a path"),
            "--until",
            &until,
            "--policy",
            policy,
            "--round-s",
            "0.3",
            "-o",
            "json",
        ];
        args.extend(more);
        support::json_of(Command::new(support::KEEL).args(args))
    };
    let without_figures = |live: &serde_json::Value| {
        let mut live = live.clone();
        live.as_object_mut().expect("an object").remove("figures");
        live
    };
    assert_eq!(without_figures(&whatif), offline("fifo,srjf", &[]));
    assert_eq!(
        without_figures(&bigger),
        offline("fifo", &["--add-nodes", "1x2xv100"])
    );
}
