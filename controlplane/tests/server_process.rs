//! End-to-end tests against real `keel server` processes on 127.0.0.1:
//! the CLI, restart and crash recovery, and bad input. These servers have
//! no nodes (`--no-local-node`), so nothing is scheduled and the log holds
//! only what the tests write; scheduling is in `tests/scheduling.rs`.

use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};

use keel_proto::api::{self, keel_client::KeelClient};
use keel_proto::entry::JobSpec;

mod support;

use support::{json_of, ServerProcess, KEEL};

/// A server with no nodes.
fn start(data_dir: &Path) -> ServerProcess {
    start_with(data_dir, &[])
}

fn start_with(data_dir: &Path, extra: &[&str]) -> ServerProcess {
    let mut args = vec!["--no-local-node"];
    args.extend_from_slice(extra);
    ServerProcess::start(data_dir, &args)
}

/// `keel replay -o json` on a data directory no server is using.
fn replay_offline(data: &Path) -> serde_json::Value {
    json_of(
        Command::new(KEEL)
            .args(["replay", "-o", "json", "--data-dir"])
            .arg(data),
    )
}

fn write_spec(dir: &Path, name: &str, body: &str) -> PathBuf {
    let path = dir.join(name);
    std::fs::write(&path, body).expect("write spec");
    path
}

/// A valid one-GPU spec, as the API takes it.
fn small_spec(name: String) -> JobSpec {
    JobSpec {
        name,
        command: vec!["true".into()],
        gpus_per_worker: 1,
        min_workers: 1,
        max_workers: 1,
        ..Default::default()
    }
}

/// Submits `small_spec(name)` through gRPC, without a request id; its
/// job id.
async fn submit_small(client: &mut KeelClient<tonic::transport::Channel>, name: String) -> u64 {
    client
        .submit_job(api::SubmitJobRequest {
            spec: Some(small_spec(name)),
            request_id: String::new(),
        })
        .await
        .expect("submitted")
        .into_inner()
        .job_id
}

const SPEC: &str = "name: resnet\nuser: ada\ncommand: [python3, train.py]\ngpus: 2\nworkers: {min: 1, max: 2}\ngpu_types: {allowed: [v100]}\ntotal_steps: 500\n";

#[test]
fn cli_submit_list_cancel_and_watch() {
    let dir = tempfile::tempdir().expect("tempdir");
    let server = start(&dir.path().join("data"));
    let spec = write_spec(dir.path(), "job.yaml", SPEC);
    let spec = spec.to_str().expect("utf-8 path");

    let submitted = server.json(&["submit", "-f", spec]);
    let id = submitted["id"].as_u64().expect("id");
    server.cli_ok(&["submit", "-f", spec]);

    let jobs = server.json(&["jobs"]);
    assert_eq!(jobs.as_array().map(Vec::len), Some(2));
    assert_eq!(jobs[0]["id"], id);
    assert_eq!(jobs[0]["name"], "resnet");
    assert_eq!(jobs[0]["user"], "ada");
    assert_eq!(jobs[0]["state"], "pending");
    assert_eq!(jobs[0]["gpus"], 2);
    assert_eq!(jobs[0]["allocation"], serde_json::Value::Null);

    server.cli_ok(&["cancel", &id.to_string()]);
    let job = server.json(&["job", &id.to_string()]);
    assert_eq!(job["state"], "cancelled");
    assert_eq!(
        server
            .json(&["jobs", "--state", "pending"])
            .as_array()
            .map(Vec::len),
        Some(1)
    );
    assert_eq!(
        server
            .json(&["jobs", "--user", "bob"])
            .as_array()
            .map(Vec::len),
        Some(0)
    );

    // Cancelling again is refused with a clear message and a non-zero exit.
    let again = server.cli(&["cancel", &id.to_string()]);
    assert!(!again.status.success());
    assert!(String::from_utf8_lossy(&again.stderr).contains("has already ended (cancelled)"));

    let events = server.cli_ok(&["events", "-o", "json"]);
    let commands: Vec<String> = events
        .lines()
        .map(|l| serde_json::from_str::<serde_json::Value>(l).expect("one JSON object per line"))
        .map(|v| v["command"].as_str().unwrap_or_default().to_string())
        .collect();
    assert_eq!(
        commands,
        ["submit_job", "submit_job", "cancel_job", "cancel_job"]
    );
    assert!(events.lines().last().is_some_and(|l| l.contains("refused")));

    let status = server.json(&["cluster", "status"]);
    assert_eq!(status["role"], "leader");
    assert_eq!(status["member_id"], 1);
    assert_eq!(status["state_hash"].as_str().map(str::len), Some(64));
}

/// Issue 23, item 5: finished jobs leave the state beyond
/// `--retain-finished-max` (the oldest) and `--retain-finished-s` after
/// they finished, by logged `RemoveJob`s; a removed job is told apart from
/// one that never was, its history stays (`keel why`), and a restart
/// replays to the same state. Jobs that have not ended stay.
#[test]
fn finished_jobs_are_removed_past_their_retention_and_their_history_stays() {
    let dir = tempfile::tempdir().expect("tempdir");
    let data = dir.path().join("data");
    let spec = write_spec(dir.path(), "job.yaml", SPEC);
    let spec = spec.to_str().expect("utf-8 path");
    // By count only: at most one finished job kept.
    let server = start_with(
        &data,
        &["--retain-finished-s", "0", "--retain-finished-max", "1"],
    );
    let ids: Vec<String> = (0..4)
        .map(|_| server.json(&["submit", "-f", spec])["id"].to_string())
        .collect();
    for id in &ids[..3] {
        server.cli_ok(&["cancel", id]);
    }
    let removed = |server: &ServerProcess, id: &str| {
        let out = server.cli(&["job", id]);
        !out.status.success()
            && String::from_utf8_lossy(&out.stderr).contains("was removed from the state")
    };
    support::wait_for("the two oldest finished jobs to be removed", || {
        (removed(&server, &ids[0]) && removed(&server, &ids[1])).then_some(())
    });
    assert_eq!(server.json(&["job", &ids[2]])["state"], "cancelled");
    assert_eq!(server.json(&["job", &ids[3]])["state"], "pending");
    let never = server.cli(&["job", "99"]);
    assert!(
        String::from_utf8_lossy(&never.stderr).contains("job 99 does not exist"),
        "{}",
        String::from_utf8_lossy(&never.stderr)
    );
    // Its history is in the journal still.
    let why = server.cli_ok(&["why", &ids[0]]);
    assert!(
        why.contains("submit_job") && why.contains("cancel_job") && why.contains("remove_job"),
        "{why}"
    );
    let events = server.cli_ok(&["events", "-o", "json"]);
    assert_eq!(
        events
            .lines()
            .filter(|l| l.contains("\"remove_job\""))
            .count(),
        2,
        "{events}"
    );
    let hash = server.json(&["cluster", "status"])["state_hash"].clone();
    server.terminate();

    // The same log replays to the same state.
    let replayed = replay_offline(&data);
    assert_eq!(replayed["state_hash"], hash, "{replayed}");

    // By age: the last finished one goes a second after it finished; the
    // pending one stays.
    let server = start_with(&data, &["--retain-finished-s", "1"]);
    support::wait_for("the last finished job to be removed", || {
        removed(&server, &ids[2]).then_some(())
    });
    assert_eq!(server.json(&["job", &ids[3]])["state"], "pending");
    let jobs = server.json(&["jobs"]);
    assert_eq!(jobs.as_array().map(Vec::len), Some(1), "{jobs}");
    server.terminate();
}

/// Issue 23, item 1: queues through the CLI. Bad inputs are refused
/// naming the field, before anything is logged; a job names its queue and
/// `keel jobs --queue` finds it; a queue holding an unfinished job is kept;
/// `keel queue list` shows quota, use and what waits; the default queue
/// takes a quota.
#[test]
fn queues_are_made_listed_and_deleted_and_bad_ones_name_their_field() {
    let dir = tempfile::tempdir().expect("tempdir");
    let data = dir.path().join("data");
    let _reaper = support::WorkerReaper(data.clone());
    let server = ServerProcess::start(&data, &["--simulated-gpus", "2xv100", "--round-s", "0.2"]);
    support::wait_for("the node's GPUs", || {
        let nodes = server.json(&["nodes"]);
        (nodes.as_array().map(Vec::len) == Some(1)).then_some(())
    });
    let refused = |args: &[&str], field: &str| {
        let out = server.cli(args);
        let stderr = String::from_utf8_lossy(&out.stderr).to_string();
        assert!(!out.status.success(), "{args:?} was taken");
        assert!(stderr.contains(field), "{args:?}: {stderr}");
    };
    refused(&["queue", "create", "team-a", "--quota", "h100=2"], "quota");
    refused(&["queue", "create", "Team-A", "--quota", "v100=2"], "name");
    refused(
        &[
            "queue",
            "create",
            "team-a",
            "--quota",
            "v100=2",
            "--borrow-limit",
            "v100=1",
        ],
        "cohort",
    );
    refused(
        &[
            "queue", "create", "team-a", "--quota", "v100=2", "--weight", "0",
        ],
        "weight",
    );
    refused(&["queue", "create", "team-a"], "--quota");
    refused(
        &["queue", "create", "team-a", "--quota", "v100"],
        "is not TYPE=N",
    );
    refused(
        &["queue", "create", "team-a", "--quota", "v100=1,v100=2"],
        "given twice",
    );
    refused(
        &["queue", "delete", "default"],
        "default queue cannot be deleted",
    );
    let before = server.cli_ok(&["events", "-o", "json"]);
    assert!(!before.contains("queue"), "nothing was logged: {before}");

    server.cli_ok(&[
        "queue", "create", "team-a", "--quota", "v100=1", "--cohort", "research", "--weight", "2",
    ]);
    refused(
        &["queue", "create", "team-a", "--quota", "v100=1"],
        "exists already",
    );
    let job = support::submit_spec(
        &server,
        dir.path(),
        serde_json::json!({"name": "a", "command": ["sleep", "30"], "gpus": 1, "queue": "team-a"}),
    );
    let spec = dir.path().join("nowhere.json");
    std::fs::write(
        &spec,
        serde_json::json!({"name": "b", "command": ["true"], "queue": "nowhere"}).to_string(),
    )
    .expect("spec");
    refused(&["submit", "-f", spec.to_str().expect("utf-8")], "queue");
    let listed = server.json(&["jobs", "--queue", "team-a"]);
    assert_eq!(listed.as_array().map(Vec::len), Some(1), "{listed}");
    assert_eq!(listed[0]["id"].to_string(), job);
    assert_eq!(
        server
            .json(&["jobs", "--queue", "default"])
            .as_array()
            .map(Vec::len),
        Some(0)
    );
    let queue = support::wait_for("the job to run in its queue", || {
        let queues = server.json(&["queue", "list"]);
        let team = queues
            .as_array()?
            .iter()
            .find(|q| q["name"] == "team-a")?
            .clone();
        (team["running_jobs"] == 1).then_some(team)
    });
    assert_eq!(queue["quota"]["v100"], 1);
    assert_eq!(queue["used"]["v100"], 1);
    assert_eq!(queue["cohort"], "research");
    assert_eq!(queue["weight"], 2);
    let names: Vec<String> = server
        .json(&["queue", "list"])
        .as_array()
        .expect("list")
        .iter()
        .map(|q| q["name"].as_str().unwrap_or_default().to_string())
        .collect();
    assert_eq!(names, ["default", "team-a"]);
    // A second job of team-a, needing both GPUs, waits: the queue shows
    // what it waits for, by the types it may use.
    let waiting = support::submit_spec(
        &server,
        dir.path(),
        serde_json::json!({"name": "a2", "command": ["sleep", "30"], "gpus": 2, "queue": "team-a",
                           "gpu_types": {"allowed": ["v100"]}, "priority": 3, "preemptible": false}),
    );
    let shown_job = server.json(&["job", &waiting]);
    assert_eq!(shown_job["preemptible"], false, "{shown_job}");
    let table = server.cli_ok(&["job", &waiting]);
    assert!(
        table.contains("queue: team-a, priority 3, not preemptible"),
        "{table}"
    );
    let shown = server.json(&["queue", "show", "team-a"]);
    assert_eq!(
        (
            shown[0]["pending_jobs"].clone(),
            shown[0]["pending_by_type"].clone()
        ),
        (1.into(), serde_json::json!({"v100": 2})),
        "{shown}"
    );
    let table = server.cli_ok(&["queue", "show", "team-a"]);
    assert!(table.contains("1 (2 GPUs: v100=2)"), "{table}");
    server.cli_ok(&["cancel", &waiting]);
    // Update keeps what it is not given.
    server.cli_ok(&["queue", "update", "team-a", "--weight", "5"]);
    let shown = server.json(&["queue", "show", "team-a"]);
    assert_eq!(
        (
            shown[0]["weight"].clone(),
            shown[0]["quota"]["v100"].clone()
        ),
        (5.into(), 1.into())
    );
    refused(&["queue", "delete", "team-a"], "unfinished");
    server.cli_ok(&["cancel", &job]);
    support::wait_for("the queue to be deleted", || {
        server
            .cli(&["queue", "delete", "team-a"])
            .status
            .success()
            .then_some(())
    });
    server.cli_ok(&["queue", "update", "default", "--quota", "v100=1"]);
    let events = server.cli_ok(&["events", "-o", "json"]);
    for kind in ["create_queue", "update_queue", "delete_queue"] {
        assert!(events.contains(kind), "{kind}: {events}");
    }
    server.terminate();
}

/// `ListJobs` answers a page at a time: every job once, in submission
/// order, with a token for the rest; a filter applies before the page is
/// cut; a page too large or a token it never gave is refused naming the
/// field. `keel jobs` follows the pages.
#[test]
fn jobs_are_listed_a_page_at_a_time() {
    let dir = tempfile::tempdir().expect("tempdir");
    let server = start(&dir.path().join("data"));
    let addr = format!("http://{}", server.addr);
    let rt = tokio::runtime::Runtime::new().expect("runtime");
    rt.block_on(async move {
        let mut client = KeelClient::connect(addr).await.expect("connect");
        for i in 0..5 {
            submit_small(&mut client, format!("page-{i}")).await;
        }
        client
            .cancel_job(api::CancelJobRequest {
                job_id: 2,
                ..Default::default()
            })
            .await
            .expect("cancelled");
        let pages = |state: &'static str| {
            let mut client = client.clone();
            async move {
                let mut pages: Vec<Vec<u64>> = Vec::new();
                let mut page_token = String::new();
                loop {
                    let r = client
                        .list_jobs(api::ListJobsRequest {
                            state: state.into(),
                            page_size: 2,
                            page_token: page_token.clone(),
                            ..Default::default()
                        })
                        .await
                        .expect("a page")
                        .into_inner();
                    pages.push(r.jobs.iter().map(|j| j.id).collect());
                    if r.next_page_token.is_empty() {
                        return pages;
                    }
                    page_token = r.next_page_token;
                }
            }
        };
        assert_eq!(pages("").await, vec![vec![1, 2], vec![3, 4], vec![5]]);
        assert_eq!(pages("pending").await, vec![vec![1, 3], vec![4, 5]]);
        for (request, field) in [
            (
                api::ListJobsRequest {
                    page_size: 10_001,
                    ..Default::default()
                },
                "page_size",
            ),
            (
                api::ListJobsRequest {
                    page_token: "not-a-token".into(),
                    ..Default::default()
                },
                "page_token",
            ),
        ] {
            let refused = client.list_jobs(request).await.expect_err("refused");
            assert_eq!(refused.code(), tonic::Code::InvalidArgument);
            assert!(refused.message().contains(field), "{}", refused.message());
        }
        // More than one default page (1,000 jobs).
        let more = (5..1_003).map(|i| {
            let mut client = client.clone();
            async move { submit_small(&mut client, format!("page-{i}")).await }
        });
        futures::future::join_all(more).await;
        let first = client
            .list_jobs(api::ListJobsRequest::default())
            .await
            .expect("the first page")
            .into_inner();
        assert_eq!(first.jobs.len(), 1_000);
        assert_eq!(first.next_page_token, "1000");
    });
    let listed = server.json(&["jobs"]);
    let ids: Vec<u64> = listed
        .as_array()
        .expect("a list")
        .iter()
        .filter_map(|j| j["id"].as_u64())
        .collect();
    assert_eq!(
        ids,
        (1..=1_003).collect::<Vec<u64>>(),
        "keel jobs follows the pages"
    );
}

#[test]
fn events_follow_streams_new_entries() {
    let dir = tempfile::tempdir().expect("tempdir");
    let server = start(&dir.path().join("data"));
    let spec = write_spec(dir.path(), "job.yaml", SPEC);
    let mut follower = Command::new(KEEL)
        .args(["events", "--follow", "-o", "json"])
        .env("KEEL_ADDR", &server.addr)
        .stdout(Stdio::piped())
        .spawn()
        .expect("events --follow");
    let stdout = follower.stdout.take().expect("stdout");
    server.cli_ok(&["submit", "-f", spec.to_str().expect("utf-8")]);
    let mut lines = std::io::BufRead::lines(std::io::BufReader::new(stdout));
    let first = lines.next().expect("a streamed event").expect("read");
    assert!(first.contains("job_submitted"), "{first}");
    follower.kill().expect("stop follower");
    let _ = follower.wait();
}

#[test]
fn restart_and_sigkill_lose_nothing_acknowledged() {
    let dir = tempfile::tempdir().expect("tempdir");
    let data = dir.path().join("data");
    let spec = write_spec(dir.path(), "job.yaml", SPEC);
    let spec = spec.to_str().expect("utf-8");

    let server = start(&data);
    for _ in 0..5 {
        server.cli_ok(&["submit", "-f", spec]);
    }
    server.cli_ok(&["cancel", "3"]);
    let hash = server.json(&["cluster", "status"])["state_hash"].clone();
    server.terminate();

    let server = start(&data);
    assert_eq!(server.json(&["cluster", "status"])["state_hash"], hash);
    assert_eq!(server.json(&["job", "3"])["state"], "cancelled");

    // Submissions acknowledged right before a SIGKILL survive it.
    let addr = server.addr.clone();
    let acked = tokio::runtime::Runtime::new()
        .expect("runtime")
        .block_on(async move {
            let mut client = KeelClient::connect(format!("http://{addr}"))
                .await
                .expect("connect");
            let mut acked = Vec::new();
            for i in 0..50 {
                acked.push(submit_small(&mut client, format!("burst-{i}")).await);
            }
            acked
        });
    server.kill9();

    let server = start(&data);
    let jobs = server.json(&["jobs"]);
    let ids: Vec<u64> = jobs
        .as_array()
        .expect("array")
        .iter()
        .filter_map(|j| j["id"].as_u64())
        .collect();
    for id in &acked {
        assert!(ids.contains(id), "acknowledged job {id} lost after SIGKILL");
    }
    assert_eq!(ids.len(), 55);
    let live = server.json(&["cluster", "status"]);
    let hash = live["state_hash"].clone();
    server.terminate();

    // Offline replay of the journal reaches the live state.
    assert_eq!(replay_offline(&data)["state_hash"], hash);
}

#[test]
fn bad_input_gets_clear_errors_and_the_server_keeps_running() {
    let dir = tempfile::tempdir().expect("tempdir");
    let data = dir.path().join("data");
    let server = start(&data);

    // An invalid spec names the field and the limit.
    let bad = write_spec(dir.path(), "bad.yaml", "name: x\ncommand: [a]\ngpus: 100\n");
    let out = server.cli(&["submit", "-f", bad.to_str().expect("utf-8")]);
    assert!(!out.status.success());
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        err.contains("spec.gpus is 100; it must be between 1 and 64"),
        "{err}"
    );

    // An unknown field is rejected, not ignored.
    let typo = write_spec(dir.path(), "typo.yaml", "name: x\ncommand: [a]\ngpu: 1\n");
    let out = server.cli(&["submit", "-f", typo.to_str().expect("utf-8")]);
    assert!(String::from_utf8_lossy(&out.stderr).contains("unknown field `gpu`"));

    // Unknown job ids.
    let out = server.cli(&["job", "4242"]);
    assert!(!out.status.success());
    assert!(String::from_utf8_lossy(&out.stderr).contains("job 4242 does not exist"));

    // A second server on the same data directory is refused.
    let out = Command::new(KEEL)
        .args(["server", "--listen", "127.0.0.1:0", "--data-dir"])
        .arg(&data)
        .output()
        .expect("second server");
    assert!(!out.status.success());
    assert!(String::from_utf8_lossy(&out.stderr).contains("in use by another keel process"));

    let addr = server.addr.clone();
    tokio::runtime::Runtime::new()
        .expect("runtime")
        .block_on(async move {
            let url = format!("http://{addr}");
            let mut client = KeelClient::connect(url.clone()).await.expect("connect");
            // An oversized request is refused.
            let huge = client
                .submit_job(api::SubmitJobRequest {
                    spec: Some(JobSpec {
                        name: "x".repeat(2 * 1024 * 1024),
                        ..Default::default()
                    }),
                    request_id: String::new(),
                })
                .await
                .expect_err("oversized request");
            // Issue 19, item 7: the conventional code, and the sizes.
            assert_eq!(huge.code(), tonic::Code::ResourceExhausted, "{huge:?}");
            assert!(huge.message().contains("bytes"), "{huge:?}");

            // A spec that passes the wire but not validation (the server checks
            // too; clients cannot be trusted).
            let invalid = client
                .submit_job(api::SubmitJobRequest {
                    spec: Some(JobSpec {
                        name: "ok".into(),
                        command: vec!["a".into()],
                        gpus_per_worker: 1,
                        min_workers: 3,
                        max_workers: 1,
                        ..Default::default()
                    }),
                    request_id: String::new(),
                })
                .await
                .expect_err("invalid spec");
            assert_eq!(invalid.code(), tonic::Code::InvalidArgument);
            assert!(invalid.message().contains("spec.workers.max"));

            // Malformed protobuf on the wire (issue 19, item 7): the
            // client's mistake, with the decoder's words, for random
            // bytes, a truncated message and a string that is not UTF-8.
            let valid = prost::Message::encode_to_vec(&api::SubmitJobRequest {
                spec: Some(small_spec("x".into())),
                request_id: String::new(),
            });
            // spec (field 1) holding a name (field 1) of one invalid byte.
            let not_utf8 = vec![0x0a, 0x03, 0x0a, 0x01, 0xff];
            for body in [vec![0xff; 16], valid[..valid.len() - 3].to_vec(), not_utf8] {
                let malformed = raw_call(&url, "/keel.api.v1.Keel/SubmitJob", body)
                    .await
                    .expect_err("malformed");
                assert_eq!(
                    malformed.code(),
                    tonic::Code::InvalidArgument,
                    "{malformed:?}"
                );
                assert!(
                    malformed.message().contains("not a valid SubmitJobRequest"),
                    "{malformed:?}"
                );
            }

            // Still serving, nothing lost.
            let ok = client
                .submit_job(api::SubmitJobRequest {
                    spec: Some(small_spec("after".to_string())),
                    request_id: String::new(),
                })
                .await
                .expect("the server still accepts work");
            assert_eq!(ok.into_inner().job_id, 1);
        });
}

/// Issue 19, item 4: a write sent again under its request id (its answer
/// was lost) applies once and is answered with the first outcome, also
/// after the server was killed and restarted; the same id with another
/// command, or a malformed id, is refused with the field named.
#[test]
fn a_write_sent_again_with_its_request_id_applies_once() {
    let dir = tempfile::tempdir().expect("tempdir");
    let data = dir.path().join("data");
    let submit = |addr: String, name: &'static str, request_id: &'static str| async move {
        let mut client = KeelClient::connect(format!("http://{addr}"))
            .await
            .expect("connect");
        client
            .submit_job(api::SubmitJobRequest {
                spec: Some(small_spec(name.to_string())),
                request_id: request_id.into(),
            })
            .await
            .map(|r| r.into_inner())
    };
    let runtime = tokio::runtime::Runtime::new().expect("runtime");
    let server = start(&data);
    let first = runtime
        .block_on(submit(server.addr.clone(), "once", "client-7:1"))
        .expect("accepted");
    let again = runtime
        .block_on(submit(server.addr.clone(), "once", "client-7:1"))
        .expect("a repeat is answered");
    assert_eq!(again.job_id, first.job_id);
    let reused = runtime
        .block_on(submit(server.addr.clone(), "other", "client-7:1"))
        .expect_err("another command under the same id");
    assert_eq!(reused.code(), tonic::Code::AlreadyExists, "{reused:?}");
    assert!(reused.message().contains("client-7:1"), "{reused:?}");
    let bad = runtime
        .block_on(submit(server.addr.clone(), "bad", "no spaces allowed"))
        .expect_err("a malformed id");
    assert_eq!(bad.code(), tonic::Code::InvalidArgument, "{bad:?}");
    assert!(bad.message().contains("request_id"), "{bad:?}");
    // The memory is replicated state: it survives a kill -9 and a replay.
    server.kill9();
    let server = start(&data);
    let after_restart = runtime
        .block_on(submit(server.addr.clone(), "once", "client-7:1"))
        .expect("a repeat is answered after a restart");
    assert_eq!(after_restart.job_id, first.job_id);
    let jobs = server.json(&["jobs"]);
    assert_eq!(jobs.as_array().map(Vec::len), Some(1), "{jobs}");
    // The journal shows the repeats for what they were.
    let watched = server.cli_ok(&["events"]);
    assert!(watched.contains("request client-7:1 repeated"), "{watched}");
}

/// Sends raw bytes as the body of a unary gRPC call.
async fn raw_call(url: &str, path: &'static str, body: Vec<u8>) -> Result<Vec<u8>, tonic::Status> {
    let channel = tonic::transport::Endpoint::from_shared(url.to_string())
        .expect("url")
        .connect()
        .await
        .expect("connect");
    let mut grpc = tonic::client::Grpc::new(channel);
    grpc.ready().await.expect("ready");
    grpc.unary(
        tonic::Request::new(body),
        tonic::codegen::http::uri::PathAndQuery::from_static(path),
        RawCodec,
    )
    .await
    .map(tonic::Response::into_inner)
}

#[derive(Debug, Default, Clone)]
struct RawCodec;

impl tonic::codec::Codec for RawCodec {
    type Encode = Vec<u8>;
    type Decode = Vec<u8>;
    type Encoder = RawCodec;
    type Decoder = RawCodec;
    fn encoder(&mut self) -> RawCodec {
        RawCodec
    }
    fn decoder(&mut self) -> RawCodec {
        RawCodec
    }
}

impl tonic::codec::Encoder for RawCodec {
    type Item = Vec<u8>;
    type Error = tonic::Status;
    fn encode(
        &mut self,
        item: Vec<u8>,
        dst: &mut tonic::codec::EncodeBuf<'_>,
    ) -> Result<(), tonic::Status> {
        use bytes::BufMut;
        dst.put_slice(&item);
        Ok(())
    }
}

impl tonic::codec::Decoder for RawCodec {
    type Item = Vec<u8>;
    type Error = tonic::Status;
    fn decode(
        &mut self,
        src: &mut tonic::codec::DecodeBuf<'_>,
    ) -> Result<Option<Vec<u8>>, tonic::Status> {
        use bytes::Buf;
        let mut v = vec![0; src.remaining()];
        src.copy_to_slice(&mut v);
        Ok(Some(v))
    }
}

#[test]
fn concurrent_submissions_are_group_committed() {
    let dir = tempfile::tempdir().expect("tempdir");
    let server = start(&dir.path().join("data"));
    let addr = server.addr.clone();
    let results = tokio::runtime::Runtime::new()
        .expect("runtime")
        .block_on(async move {
            let mut tasks = Vec::new();
            for t in 0..50 {
                let url = format!("http://{addr}");
                tasks.push(tokio::spawn(async move {
                    let mut client = KeelClient::connect(url).await.expect("connect");
                    let mut out = Vec::new();
                    for i in 0..4 {
                        let resp = client
                            .submit_job(api::SubmitJobRequest {
                                spec: Some(small_spec(format!("c{t}-{i}"))),
                                request_id: String::new(),
                            })
                            .await
                            .expect("submit")
                            .into_inner();
                        out.push((resp.job_id, resp.index));
                    }
                    out
                }));
            }
            let mut all = Vec::new();
            for t in tasks {
                all.extend(t.await.expect("task"));
            }
            all
        });
    let ids: std::collections::BTreeSet<u64> = results.iter().map(|(id, _)| *id).collect();
    let indexes: std::collections::BTreeSet<u64> = results.iter().map(|(_, ix)| *ix).collect();
    assert_eq!(ids.len(), 200, "every submission got its own job id");
    assert!(
        indexes.len() < 200,
        "200 concurrent submissions took {} Raft entries: no group commit",
        indexes.len()
    );
    assert_eq!(server.json(&["jobs"]).as_array().map(Vec::len), Some(200));
}

#[test]
fn snapshots_compact_the_log_and_restarts_load_them() {
    let dir = tempfile::tempdir().expect("tempdir");
    let data = dir.path().join("data");
    let server = start_with(&data, &["--snapshot-every", "16"]);
    let addr = server.addr.clone();
    tokio::runtime::Runtime::new()
        .expect("runtime")
        .block_on(async move {
            let mut client = KeelClient::connect(format!("http://{addr}"))
                .await
                .expect("connect");
            for i in 0..120 {
                submit_small(&mut client, format!("s{i}")).await;
            }
        });
    let hash = server.json(&["cluster", "status"])["state_hash"].clone();
    server.terminate();

    // The state comes back from the snapshot plus the journal after it.
    let server = start_with(&data, &["--snapshot-every", "16"]);
    assert_eq!(server.json(&["cluster", "status"])["state_hash"], hash);
    assert_eq!(server.json(&["jobs"]).as_array().map(Vec::len), Some(120));
    // History before the snapshot is still there for audit.
    let events = server.cli_ok(&["events", "-o", "json"]);
    assert_eq!(events.lines().count(), 120);
    server.terminate();
    let replayed = replay_offline(&data);
    assert_eq!(replayed["state_hash"], hash);
    assert_eq!(replayed["entries"], 120);
}

/// The shutdown bound must leave the workers their stop grace: a server
/// started with a shorter one refuses to start, naming both flags.
#[test]
fn a_shutdown_timeout_shorter_than_the_stop_grace_is_refused() {
    let dir = tempfile::tempdir().expect("tempdir");
    let out = Command::new(support::KEEL)
        .args(["server", "--no-local-node", "--listen", "127.0.0.1:0"])
        .args(["--stop-grace-s", "5", "--shutdown-timeout-s", "5"])
        .arg("--data-dir")
        .arg(dir.path().join("data"))
        .output()
        .expect("keel server");
    assert!(!out.status.success());
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        err.contains("--shutdown-timeout-s (5) must be longer than --stop-grace-s (5)"),
        "{err}"
    );
}

/// Issue 30's flags refuse what they cannot take, naming the flag and the
/// limit, before anything starts.
#[test]
fn the_kubernetes_flags_refuse_bad_values() {
    let dir = tempfile::tempdir().expect("tempdir");
    for (args, expected) in [
        (
            ["--k8s-tolerate", "gpu:Sometimes"],
            "--k8s-tolerate \"gpu:Sometimes\": the effect must be NoSchedule, PreferNoSchedule or NoExecute",
        ),
        (
            ["--k8s-tolerate", "=v:NoSchedule"],
            "the key must be 1 to 316 characters",
        ),
        (
            ["--k8s-call-timeout-s", "0"],
            "--k8s-call-timeout-s must be between 0.1 and 600 seconds, not 0",
        ),
    ] {
        let out = Command::new(support::KEEL)
            .args(["server", "--listen", "127.0.0.1:0", "--kubernetes"])
            .args(["--k8s-api-url", "http://127.0.0.1:1"])
            .args(args)
            .arg("--data-dir")
            .arg(dir.path().join("data"))
            .output()
            .expect("keel server");
        assert!(!out.status.success(), "{args:?} was taken");
        let err = String::from_utf8_lossy(&out.stderr);
        assert!(err.contains(expected), "{args:?}: {err}");
    }
}

/// Issue 23: the retention flags refuse what is not a retention, naming
/// the flag and its range, before a data directory is made.
#[test]
fn the_retention_flags_refuse_bad_values() {
    let dir = tempfile::tempdir().expect("tempdir");
    for (args, expected) in [
        (
            ["--retain-finished-s=-1", "--retain-logs-s=1"],
            "--retain-finished-s must be between 0 and 315360000 seconds, not -1",
        ),
        (
            ["--retain-finished-s", "inf"],
            "--retain-finished-s must be between 0 and 315360000 seconds, not inf",
        ),
        (
            ["--retain-logs-s", "NaN"],
            "--retain-logs-s must be between 0 and 315360000 seconds, not NaN",
        ),
        (
            ["--retain-finished-max=-3", "--retain-logs-s=1"],
            "--retain-finished-max",
        ),
    ] {
        let out = Command::new(support::KEEL)
            .args(["server", "--listen", "127.0.0.1:0", "--no-local-node"])
            .args(args)
            .arg("--data-dir")
            .arg(dir.path().join("data"))
            .output()
            .expect("keel server");
        assert!(!out.status.success(), "{args:?} was taken");
        let err = String::from_utf8_lossy(&out.stderr);
        assert!(err.contains(expected), "{args:?}: {err}");
    }
    assert!(!dir.path().join("data").exists(), "nothing was made");
}

/// `keel cluster force-new-cluster` refuses what it cannot recover, naming
/// why, and writes nothing when it refuses: a directory a server holds, one
/// that is no data directory, a member id out of range, a member that is
/// not a voter.
#[test]
fn force_new_cluster_refuses_bad_inputs_and_writes_nothing() {
    let dir = tempfile::tempdir().expect("tempdir");
    let data = dir.path().join("data");
    let server = start(&data);
    server.cli_ok(&[
        "submit",
        "-f",
        write_spec(dir.path(), "s.yaml", SPEC)
            .to_str()
            .expect("utf-8"),
    ]);
    let force = |data: &Path, id: &str| {
        let out = Command::new(KEEL)
            .args(["cluster", "force-new-cluster", "--id", id, "--data-dir"])
            .arg(data)
            .output()
            .expect("run keel");
        assert!(!out.status.success(), "forced {} as {id}", data.display());
        String::from_utf8_lossy(&out.stderr).to_string()
    };
    let err = force(&data, "1");
    assert!(err.contains("in use by another keel process"), "{err}");
    server.terminate();
    // The Raft log's files (entries and vote) and the state, as they were.
    let wal = || -> Vec<Vec<u8>> {
        let mut files: Vec<PathBuf> = std::fs::read_dir(data.join("raft-log"))
            .expect("raft-log")
            .map(|e| e.expect("entry").path())
            .collect();
        files.sort();
        files
            .iter()
            .map(|f| std::fs::read(f).expect("read"))
            .collect()
    };
    let (before, wal_before) = (replay_offline(&data), wal());

    let empty = dir.path().join("empty");
    std::fs::create_dir_all(&empty).expect("mkdir");
    let err = force(&empty, "1");
    assert!(err.contains("holds no Raft log"), "{err}");
    for id in ["0", "70000"] {
        let err = force(&data, id);
        assert!(
            err.contains(&format!(
                "--id {id} is out of range: member ids are 1 to 65535"
            )),
            "{err}"
        );
    }
    let err = force(&data, "2");
    assert!(err.contains("is not a voter"), "{err}");

    assert_eq!(replay_offline(&data), before, "a refusal wrote nothing");
    assert!(wal() == wal_before, "a refusal left the Raft log as it was");
}

/// `keel trainer`'s hold takes both flags, and a step that is a number:
/// each refusal names the flag.
#[test]
fn the_trainers_hold_needs_both_flags_and_a_step_number() {
    let trainer = |args: &[&str]| {
        let out = Command::new(KEEL)
            .arg("trainer")
            .args(args)
            .output()
            .expect("run keel trainer");
        assert!(!out.status.success(), "{args:?} was accepted");
        String::from_utf8_lossy(&out.stderr).into_owned()
    };
    assert!(trainer(&["--hold-at-step", "5"]).contains("--hold-until-file"));
    assert!(trainer(&["--hold-until-file", "go"]).contains("--hold-at-step"));
    let error = trainer(&["--hold-at-step", "soon", "--hold-until-file", "go"]);
    assert!(
        error.contains("--hold-at-step") && error.contains("soon"),
        "{error}"
    );
}

/// Issue 22, item 4: without TLS and ACLs, a server listens on loopback
/// only. A non-loopback `--listen` is refused before anything is created,
/// saying why and what to do (TLS and ACLs, loopback, or `--insecure`);
/// with `--insecure` it serves, and says in its log that it is exposed.
/// (With TLS and ACLs it serves there: `tls.rs`.)
#[test]
fn a_non_loopback_listen_address_needs_insecure() {
    let dir = tempfile::tempdir().expect("tempdir");
    let data = dir.path().join("data");
    let out = Command::new(KEEL)
        .args(["server", "--no-local-node", "--listen", "0.0.0.0:0"])
        .arg("--data-dir")
        .arg(&data)
        .output()
        .expect("keel server");
    assert!(!out.status.success());
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        err.contains("refusing to serve on 0.0.0.0:0 without TLS and ACLs")
            && err.contains("Serve with TLS and ACLs (--tls-cert, --tls-key and")
            && err.contains("--insecure"),
        "{err}"
    );
    assert!(!data.exists(), "nothing is created before the refusal");

    std::fs::create_dir(&data).expect("data dir");
    let log = data.join("test-server.log");
    let mut server = Command::new(KEEL)
        .args([
            "server",
            "--no-local-node",
            "--insecure",
            "--listen",
            "0.0.0.0:0",
        ])
        .arg("--data-dir")
        .arg(&data)
        .stdout(Stdio::null())
        .stderr(std::fs::File::create(&log).expect("log"))
        .spawn()
        .expect("keel server");
    let addr: std::net::SocketAddr = support::wait_for("the server's address", || {
        std::fs::read_to_string(data.join("server.addr"))
            .ok()?
            .parse()
            .ok()
    });
    let port = addr.port();
    // It answers on loopback, and leads (its first answers may come before
    // its election).
    support::wait_for("the server to answer on loopback as the leader", || {
        let out = Command::new(KEEL)
            .args(["cluster", "status", "-o", "json"])
            .env("KEEL_ADDR", format!("127.0.0.1:{port}"))
            .output()
            .ok()?;
        (out.status.success() && String::from_utf8_lossy(&out.stdout).contains("\"leader\""))
            .then_some(())
    });
    let text = std::fs::read_to_string(&log).unwrap_or_default();
    let _ = server.kill();
    let _ = server.wait();
    assert!(text.contains("without TLS and ACLs (--insecure)"), "{text}");
}

/// Issue 22, item 5: a replica serves at most `--max-event-streams` event
/// streams at once. One more is refused (RESOURCE_EXHAUSTED, reason
/// `TOO_MANY_STREAMS`, naming the limit and the flag) and the open ones go
/// on; a stream whose client went away frees its place while it waits for
/// new entries, without one being applied.
#[test]
fn event_streams_beyond_the_limit_are_refused_and_a_closed_one_frees_its_place() {
    let dir = tempfile::tempdir().expect("tempdir");
    // A limit of none is refused before anything starts, naming the flag.
    let out = Command::new(KEEL)
        .args(["server", "--no-local-node", "--listen", "127.0.0.1:0"])
        .args(["--max-event-streams", "0"])
        .arg("--data-dir")
        .arg(dir.path().join("refused"))
        .output()
        .expect("keel server");
    assert!(!out.status.success());
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        err.contains("--max-event-streams") && err.contains("1..=65536"),
        "{err}"
    );
    let server = start_with(&dir.path().join("data"), &["--max-event-streams", "2"]);
    let addr = server.addr.clone();
    tokio::runtime::Runtime::new()
        .expect("runtime")
        .block_on(async move {
            let mut client = KeelClient::connect(format!("http://{addr}"))
                .await
                .expect("connect");
            // One entry for the streams to serve.
            client
                .submit_job(api::SubmitJobRequest {
                    spec: Some(small_spec("watched".into())),
                    request_id: String::new(),
                })
                .await
                .expect("submit");
            let follow = api::WatchEventsRequest {
                from_index: 0,
                follow: true,
            };
            let mut first = client
                .watch_events(follow)
                .await
                .expect("first stream")
                .into_inner();
            let second = client
                .watch_events(follow)
                .await
                .expect("second stream")
                .into_inner();
            let refused = client
                .watch_events(follow)
                .await
                .expect_err("a third stream is refused");
            assert_eq!(
                refused.code(),
                tonic::Code::ResourceExhausted,
                "{refused:?}"
            );
            assert_eq!(
                keel::grpc_status::reason_of(&refused).as_deref(),
                Some("TOO_MANY_STREAMS")
            );
            assert!(
                refused.message().contains("2 event streams")
                    && refused.message().contains("--max-event-streams"),
                "{}",
                refused.message()
            );
            // The open streams still serve: the first one gets the
            // submission.
            let entry = first.message().await.expect("a message");
            assert!(entry.is_some(), "the first stream serves");
            // The second stream's client goes away; its place comes back
            // though nothing new is applied.
            drop(second);
            let last_index = |c: &mut KeelClient<tonic::transport::Channel>| {
                let mut c = c.clone();
                async move {
                    c.cluster_status(api::ClusterStatusRequest {})
                        .await
                        .expect("status")
                        .into_inner()
                        .last_applied_index
                }
            };
            let before = last_index(&mut client).await;
            let mut third = None;
            for _ in 0..200 {
                match client.watch_events(follow).await {
                    Ok(stream) => {
                        third = Some(stream.into_inner());
                        break;
                    }
                    Err(status) => {
                        assert_eq!(status.code(), tonic::Code::ResourceExhausted);
                        tokio::time::sleep(std::time::Duration::from_millis(50)).await;
                    }
                }
            }
            assert!(third.is_some(), "a closed stream frees its place");
            assert_eq!(
                last_index(&mut client).await,
                before,
                "nothing was applied meanwhile"
            );
        });
    server.terminate();
}

/// Issue 25, item 1: a server takes its settings from `--config`, and
/// `KEEL_*` variables and flags override the file; `--print-config`
/// shows where each value came from without starting; a key no flag has
/// or a value its flag refuses stops the server, naming the key, before
/// a data directory is made.
#[test]
fn a_server_runs_on_its_config_file_and_refuses_a_bad_one() {
    let dir = tempfile::tempdir().expect("tempdir");
    let config = dir.path().join("keel.toml");
    std::fs::write(
        &config,
        "# a comment\nno_local_node = true\npolicy = \"srjf\"\nround-s = 0.5\n\
         data_dir = \"not-this-one\"\nhttp_listen = \"off\"\n",
    )
    .expect("write config");
    let config = config.to_str().expect("utf-8").to_string();
    let data = dir.path().join("data");

    // What it would run with, printed: nothing is made.
    let printed = support::printed_config(
        Command::new(KEEL)
            .args(["server", "--config", &config, "--print-config"])
            .args(["--data-dir", data.to_str().expect("utf-8")])
            .env("KEEL_POLICY", "tiresias"),
        &[
            "no_local_node = true  # config file",
            "round_s = 0.5  # config file",
            "policy = \"tiresias\"  # environment",
            "http_listen = \"off\"  # config file",
            "# snapshot_every = 10000  # default",
        ],
    );
    assert!(
        printed
            .lines()
            .any(|l| l.starts_with("data_dir = ") && l.ends_with("# command line")),
        "{printed}"
    );
    assert!(!data.exists() && !dir.path().join("not-this-one").exists());

    // Run on it: the file's settings, the environment's policy, the
    // command line's data directory.
    let server = ServerProcess::start_with_env(
        &data,
        &["--config", &config],
        &[("KEEL_POLICY", "tiresias".into())],
    );
    assert_eq!(server.json(&["policy", "show"])["policy"], "tiresias");
    assert_eq!(
        server.json(&["nodes"]).as_array().map(Vec::len),
        Some(0),
        "no_local_node from the file"
    );
    assert!(!dir.path().join("not-this-one").exists());
    assert!(
        !data.join("http.addr").exists(),
        "http_listen = \"off\" from the file"
    );
    server.terminate();

    // A file it cannot take.
    for (text, expected) in [
        ("round_seconds = 1\n", "unknown key `round_seconds`"),
        (
            "round_s = \"soon\"\n",
            "key `round_s`: invalid value 'soon'",
        ),
        (
            "no_local_node = 1\n",
            "key `no_local_node`: takes true or false",
        ),
    ] {
        let bad = dir.path().join("bad.toml");
        std::fs::write(&bad, text).expect("write");
        let fresh = dir.path().join("fresh");
        let out = Command::new(KEEL)
            .args(["server", "--listen", "127.0.0.1:0", "--config"])
            .arg(&bad)
            .arg("--data-dir")
            .arg(&fresh)
            .output()
            .expect("keel server");
        assert_eq!(out.status.code(), Some(2), "{text:?} was taken");
        let err = String::from_utf8_lossy(&out.stderr);
        assert!(
            err.contains(expected) && err.contains("bad.toml"),
            "{text:?}: {err}"
        );
        assert!(!fresh.exists(), "{text:?} made a data directory");
    }
}

/// Issue 25, item 6: `keel snapshot inspect` and `restore` refuse what
/// they cannot use, naming the flag or the file, and `restore` makes no
/// data directory when it refuses.
#[test]
fn the_snapshot_commands_refuse_bad_inputs_and_write_nothing() {
    let dir = tempfile::tempdir().expect("tempdir");
    let not_a_snapshot = dir.path().join("notes.snap");
    std::fs::write(&not_a_snapshot, "not a snapshot\n").expect("write");
    let missing = dir.path().join("missing.snap");
    let data = dir.path().join("data");
    let (bad, missing_s) = (
        not_a_snapshot.to_str().expect("utf-8"),
        missing.to_str().expect("utf-8"),
    );
    let data_s = data.to_str().expect("utf-8");
    fn restore<'a>(file: &'a str, data: &'a str, id: &'a str, addr: &'a str) -> Vec<&'a str> {
        vec![
            "snapshot",
            "restore",
            file,
            "--data-dir",
            data,
            "--id",
            id,
            "--member-addr",
            addr,
        ]
    }
    for (args, expected) in [
        (vec!["snapshot", "inspect", missing_s], "cannot read"),
        (vec!["snapshot", "inspect", bad], "notes.snap"),
        (restore(bad, data_s, "0", "h:1"), "--id"),
        (restore(bad, data_s, "70000", "h:1"), "--id"),
        (restore(bad, data_s, "1", "nowhere"), "is not HOST:PORT"),
        (restore(bad, data_s, "1", "h:1"), "notes.snap"),
        (restore(missing_s, data_s, "1", "h:1"), "cannot read"),
    ] {
        let out = Command::new(KEEL)
            .args(&args)
            .output()
            .expect("keel snapshot");
        assert!(!out.status.success(), "{args:?} was taken");
        let err = String::from_utf8_lossy(&out.stderr);
        assert!(err.contains(expected), "{args:?}: {err}");
        assert!(!data.exists(), "{args:?} made a data directory");
    }
}

/// Issue 27, item 4, through the CLI: `keel audit export` of a stopped
/// server's data directory verifies (`keel audit verify`) to the state
/// hash the server showed, holds each entry it was sent, and a byte
/// changed in one line fails verification naming that line.
#[test]
fn an_audit_export_verifies_to_the_servers_state_and_a_changed_byte_is_named() {
    let dir = tempfile::tempdir().expect("tempdir");
    let data = dir.path().join("data");
    let spec = write_spec(dir.path(), "job.yaml", SPEC);
    let spec = spec.to_str().expect("utf-8 path");
    let server = start(&data);
    let id = server.json(&["submit", "-f", spec])["id"].to_string();
    server.json(&["submit", "-f", spec]);
    server.cli_ok(&["cancel", &id]);
    let hash = server.json(&["cluster", "status"])["state_hash"].clone();
    server.terminate();

    let export = dir.path().join("audit.jsonl");
    let exported = json_of(
        Command::new(KEEL)
            .args(["audit", "export", "-o", "json", "--data-dir"])
            .arg(&data)
            .arg("--to")
            .arg(&export),
    );
    assert_eq!(exported["state_hash"], hash, "{exported}");
    let verified = json_of(
        Command::new(KEEL)
            .args(["audit", "verify", "-o", "json"])
            .arg(&export),
    );
    assert_eq!(verified["state_hash"], hash, "{verified}");
    assert_eq!(verified["last_line_hash"], exported["last_line_hash"]);
    let text = std::fs::read_to_string(&export).expect("read export");
    let kinds: Vec<String> = text
        .lines()
        .filter_map(|l| serde_json::from_str::<serde_json::Value>(l).ok())
        .filter_map(|v| v["kind"].as_str().map(str::to_string))
        .collect();
    assert_eq!(
        kinds.iter().filter(|k| *k == "submit_job").count(),
        2,
        "{kinds:?}"
    );
    assert!(kinds.iter().any(|k| k == "cancel_job"), "{kinds:?}");

    // One byte of the cancellation's line: its reason's job id.
    let (line, original) = text
        .lines()
        .enumerate()
        .find(|(_, l)| l.contains("\"kind\":\"cancel_job\""))
        .expect("the cancellation");
    let changed = original.replacen(
        &format!("\"job_id\":{id}"),
        &format!("\"job_id\":{}", id.parse::<u64>().expect("id") + 1),
        1,
    );
    assert_ne!(changed, original);
    std::fs::write(&export, text.replacen(original, &changed, 1)).expect("write");
    let out = Command::new(KEEL)
        .args(["audit", "verify"])
        .arg(&export)
        .output()
        .expect("run keel");
    assert!(!out.status.success());
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(stderr.contains(&format!("(line {})", line + 1)), "{stderr}");

    // Bad input names its flag; nothing is written (a range holding no
    // entry too: the file the export opened is taken away again).
    let bad = dir.path().join("bad.jsonl");
    let refused = |args: &[&str]| {
        let out = Command::new(KEEL)
            .args(["audit", "export"])
            .args(args)
            .arg("--data-dir")
            .arg(&data)
            .arg("--to")
            .arg(&bad)
            .output()
            .expect("run keel");
        assert!(!out.status.success());
        assert!(!bad.exists());
        String::from_utf8_lossy(&out.stderr).into_owned()
    };
    let stderr = refused(&["--until-time", "yesterday"]);
    assert!(stderr.contains("--until-time \"yesterday\""), "{stderr}");
    let stderr = refused(&["--from", "5", "--until", "2"]);
    assert!(
        stderr.contains("--from 5 is past the last entry"),
        "{stderr}"
    );
}
