//! The SSH executor against a real OpenSSH server on 127.0.0.1.

mod support;

use std::collections::BTreeMap;
use std::time::{Duration, Instant};

use keel_executors::contract::WorkerLaunch;
use keel_executors::{Executor, NodeProbe, Observed, SshExecutor, WorkerId};
use support::sshd::{free_port, Proxy, Sshd};

fn launch(node: &str, job_id: u64, rank: u32, script: &str) -> WorkerLaunch {
    WorkerLaunch {
        id: WorkerId {
            job_id,
            epoch: 1,
            rank,
        },
        job_name: format!("job{job_id}"),
        command: vec!["sh".into(), "-c".into(), script.into()],
        image: None,
        env: BTreeMap::from([("MINE".to_string(), "it's mine".to_string())]),
        secret_env: BTreeMap::new(),
        node: node.into(),
        gpus: vec![rank * 2, rank * 2 + 1],
        gpu_type: "v100".into(),
        world_size: 2,
        local_rank: rank,
        local_world_size: 2,
        rendezvous_addr: "127.0.0.1".into(),
        model: None,
        total_steps: Some(10),
        shared_with: None,
        resources: Default::default(),
        logs: Default::default(),
        trace_parent: None,
    }
}

async fn wait_for<T>(what: &str, timeout: Duration, mut f: impl AsyncFnMut() -> Option<T>) -> T {
    let deadline = Instant::now() + timeout;
    loop {
        if let Some(t) = f().await {
            return t;
        }
        assert!(Instant::now() < deadline, "timed out waiting for {what}");
        tokio::time::sleep(Duration::from_millis(25)).await;
    }
}

/// One of a worker's files on the host of node `name` (`log`, `pid`,
/// `exit`, `claim`).
fn record_on_host(sshd: &Sshd, name: &str, id: &WorkerId, kind: &str) -> std::path::PathBuf {
    std::path::Path::new(&sshd.node(name, sshd.port, None).work_dir).join(format!(
        "workers/job-{}/e{}-r{}.{kind}",
        id.job_id, id.epoch, id.rank
    ))
}

async fn wait_exit(exec: &SshExecutor, id: &WorkerId) -> (Option<i32>, String) {
    wait_for(
        &format!("{id} to exit"),
        Duration::from_secs(30),
        async || match exec.observe().await.expect("observe").get(id) {
            Some(Observed::Exited { exit_code, reason }) => Some((*exit_code, reason.clone())),
            _ => None,
        },
    )
    .await
}

async fn wait_log(exec: &SshExecutor, job_id: u64, needle: &str) -> String {
    wait_for(
        &format!("job {job_id}'s log to say {needle:?}"),
        Duration::from_secs(30),
        async || {
            let logs = exec.logs(job_id, 1 << 16).await.ok()?;
            let text: String = logs
                .iter()
                .map(|l| String::from_utf8_lossy(&l.content).to_string())
                .collect();
            text.contains(needle).then_some(text)
        },
    )
    .await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_worker_runs_over_ssh_with_the_contract_and_reports_progress_logs_and_exit() {
    support::sshd::init_tracing();
    let Some(sshd) = Sshd::start_or_skip(
        "a_worker_runs_over_ssh_with_the_contract_and_reports_progress_logs_and_exit",
    ) else {
        return;
    };
    let exec = SshExecutor::new(sshd.config(vec![sshd.node("a", sshd.port, Some("4xv100"))]))
        .expect("executor");
    exec.take_over().await;
    let l = launch(
        "a",
        7,
        1,
        "echo \"gpus=$CUDA_VISIBLE_DEVICES rank=$RANK world=$WORLD_SIZE port=$MASTER_PORT mine=$MINE\"; \
         echo \"ckpt=$KEEL_CHECKPOINT_DIR\"; echo oops >&2; \
         for s in 1 2 3; do echo \"KEEL_PROGRESS {\\\"step\\\": $s, \\\"total_steps\\\": 3}\"; done; exit 4",
    );
    // Rank 1 does not report progress; rank 0 does.
    let mut l0 = launch(
        "a",
        7,
        0,
        "for s in 1 2 3; do echo \"KEEL_PROGRESS {\\\"step\\\": $s, \\\"total_steps\\\": 3}\"; done",
    );
    l0.gpus = vec![0];
    let id = l.id.clone();
    exec.launch(l.clone()).await.expect("launch");
    exec.launch(l0.clone()).await.expect("launch");
    exec.launch(l).await.expect("a second launch is a no-op");
    assert_eq!(
        wait_exit(&exec, &id).await,
        (Some(4), "exited with code 4".to_string())
    );
    assert_eq!(wait_exit(&exec, &l0.id).await.0, Some(0));
    let text = wait_log(&exec, 7, "oops").await;
    assert!(
        text.contains("gpus=2,3 rank=1 world=2 port=29500 mine=it's mine"),
        "{text}"
    );
    assert!(text.contains("/work-a/checkpoints/job-7"), "{text}");
    let logs = exec.logs(7, 1 << 16).await.expect("logs");
    assert_eq!(logs.len(), 2, "both ranks' logs");
    let steps: Vec<u64> = exec
        .take_progress()
        .await
        .remove(&7)
        .unwrap_or_default()
        .iter()
        .map(|s| s.step)
        .collect();
    assert_eq!(steps, vec![1, 2, 3], "rank 0's progress, once each");
    // The node answered, with its declared GPUs.
    let probes = exec.take_node_probes().await;
    match probes.as_slice() {
        [NodeProbe::Answered(r)] => assert_eq!(r.gpus.len(), 4),
        other => panic!("{other:?}"),
    }
    exec.forget(&id).await;
    assert!(!exec.observe().await.expect("observe").contains_key(&id));
    // Its exit record goes from the host with the next poll (the host is
    // this machine, so its files are looked at here), and a new executor
    // does not report it again.
    let record = record_on_host(&sshd, "a", &id, "exit");
    wait_for(
        "the forgotten exit record to go from the host",
        Duration::from_secs(20),
        async || (!record.exists()).then_some(()),
    )
    .await;
    exec.release().await;
    let next = SshExecutor::new(sshd.config(vec![sshd.node("a", sshd.port, Some("4xv100"))]))
        .expect("executor");
    next.take_over().await;
    let seen = wait_for(
        "the unforgotten exit",
        Duration::from_secs(20),
        async || {
            let seen = next.observe().await.expect("observe");
            seen.contains_key(&l0.id).then_some(seen)
        },
    )
    .await;
    assert!(
        !seen.contains_key(&id),
        "a forgotten exit came back: {seen:?}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn stop_sends_sigterm_then_sigkill_and_a_killed_worker_is_reported() {
    support::sshd::init_tracing();
    let Some(sshd) =
        Sshd::start_or_skip("stop_sends_sigterm_then_sigkill_and_a_killed_worker_is_reported")
    else {
        return;
    };
    let exec = SshExecutor::new(sshd.config(vec![sshd.node("a", sshd.port, Some("8xv100"))]))
        .expect("executor");
    exec.take_over().await;
    let polite = launch(
        "a",
        1,
        0,
        "trap 'echo checkpointed; exit 143' TERM; echo ready; while true; do sleep 0.05; done",
    );
    let stubborn = launch(
        "a",
        2,
        0,
        "trap '' TERM; echo ready; while true; do sleep 0.05; done",
    );
    let victim = launch(
        "a",
        3,
        0,
        "echo \"pid=$$\"; while true; do sleep 0.05; done",
    );
    for l in [&polite, &stubborn, &victim] {
        exec.launch(l.clone()).await.expect("launch");
    }
    wait_log(&exec, 1, "ready").await;
    wait_log(&exec, 2, "ready").await;
    let text = wait_log(&exec, 3, "pid=").await;
    exec.stop(&polite.id, Duration::from_secs(30))
        .await
        .expect("stop");
    exec.stop(&stubborn.id, Duration::from_millis(500))
        .await
        .expect("stop");
    let (code, reason) = wait_exit(&exec, &polite.id).await;
    // The reason says which path recorded it (a fresh .ci/run once saw
    // no code here, without saying why).
    assert_eq!(code, Some(143), "{reason}");
    assert!(reason.contains("stopped by keel"), "{reason}");
    wait_log(&exec, 1, "checkpointed").await;
    let (code, reason) = wait_exit(&exec, &stubborn.id).await;
    assert_eq!(code, Some(137), "{reason}");
    assert!(reason.contains("SIGKILL"), "{reason}");
    // kill -9 of the worker itself (not its supervisor).
    let pid: i32 = text
        .split("pid=")
        .nth(1)
        .and_then(|s| s.split_whitespace().next())
        .and_then(|s| s.parse().ok())
        .expect("the worker's pid");
    nix::sys::signal::kill(
        nix::unistd::Pid::from_raw(pid),
        nix::sys::signal::Signal::SIGKILL,
    )
    .expect("kill -9");
    let (code, reason) = wait_exit(&exec, &victim.id).await;
    assert_eq!(code, Some(137), "{reason}");
    assert!(reason.contains("killed by SIGKILL"), "{reason}");
    assert!(!reason.contains("stopped by keel"), "{reason}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_network_drop_mid_run_loses_no_progress_and_the_worker_runs_on() {
    support::sshd::init_tracing();
    let Some(sshd) =
        Sshd::start_or_skip("a_network_drop_mid_run_loses_no_progress_and_the_worker_runs_on")
    else {
        return;
    };
    let proxy = Proxy::start(sshd.port).await;
    let exec = SshExecutor::new(sshd.config(vec![sshd.node("a", proxy.port, Some("2xv100"))]))
        .expect("executor");
    exec.take_over().await;
    // 40 steps over ~4 s, then exit 0; the network is down for 2 s of it.
    let l = launch(
        "a",
        1,
        0,
        "echo \"pid=$$\"; for s in $(seq 1 40); do echo \"KEEL_PROGRESS {\\\"step\\\": $s}\"; sleep 0.1; done",
    );
    exec.launch(l.clone()).await.expect("launch");
    let mut steps = Vec::new();
    let first = wait_for("the first progress", Duration::from_secs(20), async || {
        let p = exec.take_progress().await.remove(&1)?;
        Some(p)
    })
    .await;
    steps.extend(first.iter().map(|s| s.step));
    proxy.cut();
    let cut_at = Instant::now();
    let mut unreachable = None;
    while cut_at.elapsed() < Duration::from_secs(2) {
        if let Some(p) = exec.take_progress().await.remove(&1) {
            steps.extend(p.iter().map(|s| s.step));
        }
        for probe in exec.take_node_probes().await {
            if let NodeProbe::Unreachable { reason, .. } = probe {
                unreachable = Some(reason);
            }
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    let during_cut = steps.len();
    let reason = unreachable.expect("the node was reported unreachable during the drop");
    assert!(!reason.is_empty());
    assert!(
        matches!(
            exec.observe().await.expect("observe").get(&l.id),
            Some(Observed::Running { .. })
        ),
        "a network drop is not an exit"
    );
    proxy.heal();
    let (code, reason) = wait_exit(&exec, &l.id).await;
    assert_eq!(code, Some(0), "{reason}");
    if let Some(p) = exec.take_progress().await.remove(&1) {
        steps.extend(p.iter().map(|s| s.step));
    }
    assert_eq!(
        steps,
        (1..=40).collect::<Vec<u64>>(),
        "every step once, in order ({during_cut} before the network came back)"
    );
    // One worker ran: a single pid line in the log.
    let text = wait_log(&exec, 1, "pid=").await;
    assert_eq!(text.matches("pid=").count(), 1, "{text}");
    let back = wait_for(
        "the node to answer again",
        Duration::from_secs(20),
        async || {
            exec.take_node_probes()
                .await
                .into_iter()
                .find(|p| matches!(p, NodeProbe::Answered(_)))
        },
    )
    .await;
    assert!(matches!(back, NodeProbe::Answered(_)));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_launch_during_a_network_drop_starts_when_the_host_answers_again() {
    support::sshd::init_tracing();
    let Some(sshd) =
        Sshd::start_or_skip("a_launch_during_a_network_drop_starts_when_the_host_answers_again")
    else {
        return;
    };
    let proxy = Proxy::start(sshd.port).await;
    let exec = SshExecutor::new(sshd.config(vec![sshd.node("a", proxy.port, Some("2xv100"))]))
        .expect("executor");
    exec.take_over().await;
    proxy.cut();
    let l = launch("a", 1, 0, "echo \"KEEL_PROGRESS {\\\"step\\\": 1}\"");
    exec.launch(l.clone())
        .await
        .expect("launch returns at once");
    // No sleep: the executor says when it met the cut host (twice, so a
    // whole poll went by after the launch was queued), and the worker is
    // then still waiting for the host, not failed.
    let mut unreachable = 0;
    wait_for(
        "two failed polls of the cut host",
        Duration::from_secs(30),
        async || {
            unreachable += exec
                .take_node_probes()
                .await
                .iter()
                .filter(|p| matches!(p, NodeProbe::Unreachable { name, .. } if name == "a"))
                .count();
            (unreachable >= 2).then_some(())
        },
    )
    .await;
    assert!(
        matches!(
            exec.observe().await.expect("observe").get(&l.id),
            Some(Observed::Running { .. })
        ),
        "waiting for the host, not failed"
    );
    proxy.heal();
    let (code, reason) = wait_exit(&exec, &l.id).await;
    assert_eq!(code, Some(0), "{reason}");
    let steps = exec.take_progress().await.remove(&1).unwrap_or_default();
    assert_eq!(steps.iter().map(|s| s.step).collect::<Vec<_>>(), vec![1]);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_new_leader_re_adopts_running_workers_and_reports_missed_exits() {
    support::sshd::init_tracing();
    let Some(sshd) =
        Sshd::start_or_skip("a_new_leader_re_adopts_running_workers_and_reports_missed_exits")
    else {
        return;
    };
    let config = sshd.config(vec![sshd.node("a", sshd.port, Some("4xv100"))]);
    let first = SshExecutor::new(config.clone()).expect("executor");
    first.take_over().await;
    let long = launch(
        "a",
        1,
        0,
        "echo \"pid=$$\"; i=0; while [ $i -lt 400 ]; do i=$((i+1)); sleep 0.05; \
         echo \"KEEL_PROGRESS {\\\"step\\\": $i}\"; done",
    );
    let short = launch("a", 2, 0, "sleep 0.5; exit 3");
    first.launch(long.clone()).await.expect("launch");
    first.launch(short.clone()).await.expect("launch");
    wait_log(&first, 1, "pid=").await;
    // This server stops leading: it lets go without touching anything.
    first.release().await;
    assert!(first.observe().await.expect("observe").is_empty());
    // The short one ends while no server watches: its supervisor records
    // the exit on the host.
    let record = record_on_host(&sshd, "a", &short.id, "exit");
    wait_for(
        "the short worker's exit record",
        Duration::from_secs(20),
        async || record.exists().then_some(()),
    )
    .await;
    let next = SshExecutor::new(config).expect("executor");
    next.take_over().await;
    let seen = wait_for(
        "the workers to be found",
        Duration::from_secs(20),
        async || {
            let seen = next.observe().await.expect("observe");
            (seen.len() == 2).then_some(seen)
        },
    )
    .await;
    match &seen[&long.id] {
        Observed::Running { gpus } => {
            assert_eq!(gpus.iter().map(|g| g.index).collect::<Vec<_>>(), vec![0, 1]);
        }
        o => panic!("{o:?}"),
    }
    assert_eq!(
        seen[&short.id],
        Observed::Exited {
            exit_code: Some(3),
            reason: "exited with code 3".into()
        }
    );
    // Launching the adopted worker again does nothing; its progress is
    // followed from where the new leader found it.
    next.launch(long.clone()).await.expect("launch");
    let p = wait_for(
        "progress after adoption",
        Duration::from_secs(20),
        async || next.take_progress().await.remove(&1),
    )
    .await;
    assert!(p[0].step > 1, "read from where it was found: {:?}", p[0]);
    next.stop(&long.id, Duration::from_millis(200))
        .await
        .expect("stop");
    let (_, reason) = wait_exit(&next, &long.id).await;
    assert!(reason.contains("stopped by keel"), "{reason}");
    let text = wait_log(&next, 1, "pid=").await;
    assert_eq!(text.matches("pid=").count(), 1, "launched once: {text}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn unreachable_hosts_wrong_keys_and_missing_nvidia_smi_are_clear_reasons() {
    support::sshd::init_tracing();
    let Some(sshd) = Sshd::start_or_skip(
        "unreachable_hosts_wrong_keys_and_missing_nvidia_smi_are_clear_reasons",
    ) else {
        return;
    };
    let mut refused = sshd.node("refused", free_port(), Some("1xv100"));
    refused.work_dir = "x".into();
    let mut wrong_key = sshd.node("wrong-key", sshd.port, Some("1xv100"));
    wrong_key.key = Some(sshd.wrong_key.clone());
    // No GPUs declared: discovery needs nvidia-smi, which this host lacks
    // (a PATH without it is forced so the test means the same everywhere).
    let no_smi = sshd.node("no-smi", sshd.port, None);
    let exec = SshExecutor::new(sshd.config(vec![refused, wrong_key, no_smi])).expect("executor");
    exec.take_over().await;
    let reasons = wait_for("three probes", Duration::from_secs(30), async || {
        let mut got = BTreeMap::new();
        let deadline = Instant::now() + Duration::from_secs(20);
        while got.len() < 3 && Instant::now() < deadline {
            for p in exec.take_node_probes().await {
                match p {
                    NodeProbe::Unreachable { name, reason } => {
                        got.insert(name, reason);
                    }
                    NodeProbe::Answered(r) => {
                        // Only a host with nvidia-smi answers for no-smi.
                        assert_eq!(r.name, "no-smi", "{r:?}");
                        assert!(which_nvidia_smi_exists(), "answered without nvidia-smi");
                        got.insert(r.name, "answered".into());
                    }
                }
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
        (got.len() == 3).then_some(got)
    })
    .await;
    assert!(
        reasons["refused"].contains("Connection refused"),
        "{reasons:?}"
    );
    assert!(
        reasons["wrong-key"].contains("Permission denied"),
        "{reasons:?}"
    );
    if !which_nvidia_smi_exists() {
        assert!(
            reasons["no-smi"].contains("nvidia-smi is not installed"),
            "{reasons:?}"
        );
    }
    // A worker sent to an unreachable node waits for it (a blip must not
    // fail the job); stopped meanwhile, it ends with the reason.
    let l = launch("refused", 9, 0, "true");
    exec.launch(l.clone())
        .await
        .expect("launch returns at once");
    // No sleep: once the executor has failed to reach the node again after
    // the launch, the worker still waits.
    wait_for(
        "a failed poll of the refused node",
        Duration::from_secs(30),
        async || {
            exec.take_node_probes()
                .await
                .into_iter()
                .find(|p| matches!(p, NodeProbe::Unreachable { name, .. } if name == "refused"))
        },
    )
    .await;
    assert!(matches!(
        exec.observe().await.expect("observe").get(&l.id),
        Some(Observed::Running { .. })
    ));
    exec.stop(&l.id, Duration::from_millis(100))
        .await
        .expect("stop");
    let (code, reason) = wait_exit(&exec, &l.id).await;
    assert_eq!(code, None);
    assert!(
        reason.contains("stopped before it started: node refused could not be reached"),
        "{reason}"
    );
    // And to a node not in the file.
    let l = launch("elsewhere", 10, 0, "true");
    exec.launch(l.clone()).await.expect("launch");
    let (_, reason) = wait_exit(&exec, &l.id).await;
    assert!(reason.contains("not in the SSH nodes file"), "{reason}");
    // A command that does not exist on the host.
    let exec2 = SshExecutor::new(sshd.config(vec![sshd.node("a", sshd.port, Some("1xv100"))]))
        .expect("executor");
    exec2.take_over().await;
    let mut l = launch("a", 11, 0, "");
    l.command = vec!["/no/such/trainer".into()];
    exec2.launch(l.clone()).await.expect("launch");
    let (code, reason) = wait_exit(&exec2, &l.id).await;
    assert_eq!(code, Some(127));
    assert!(reason.contains("could not start"), "{reason}");
}

fn which_nvidia_smi_exists() -> bool {
    std::process::Command::new("sh")
        .args(["-c", "command -v nvidia-smi"])
        .status()
        .map(|s| s.success())
        .unwrap_or(false)
}

/// The figure: 100 concurrent workers on loopback hosts, no lost
/// progress sample or exit code (the times go to BENCHMARKS.md; run with
/// `--nocapture` to see them).
#[allow(clippy::print_stderr)]
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_hundred_concurrent_workers_lose_no_progress_sample_or_exit_code() {
    const WORKERS: u64 = 100;
    const STEPS: u64 = 20;
    support::sshd::init_tracing();
    let Some(sshd) =
        Sshd::start_or_skip("a_hundred_concurrent_workers_lose_no_progress_sample_or_exit_code")
    else {
        return;
    };
    let nodes: Vec<_> = (0..4)
        .map(|i| sshd.node(&format!("host-{i}"), sshd.port, Some("32xv100")))
        .collect();
    let mut config = sshd.config(nodes);
    // The default poll interval, as a production server would run.
    config.poll_interval = Duration::from_secs(1);
    let exec = SshExecutor::new(config).expect("executor");
    exec.take_over().await;
    let mut ids = Vec::new();
    let started = Instant::now();
    for job in 0..WORKERS {
        let mut l = launch(
            &format!("host-{}", job % 4),
            job + 1,
            0,
            &format!(
                "for s in $(seq 1 {STEPS}); do echo \"KEEL_PROGRESS {{\\\"step\\\": $s}}\"; sleep 0.1; done; exit {}",
                job % 7
            ),
        );
        l.gpus = vec![(job / 4) as u32];
        ids.push(l.id.clone());
        exec.launch(l).await.expect("launch");
    }
    eprintln!("{WORKERS} launched in {:?}", started.elapsed());
    let mut steps: BTreeMap<u64, Vec<u64>> = BTreeMap::new();
    let deadline = Instant::now() + Duration::from_secs(120);
    loop {
        for (job, samples) in exec.take_progress().await {
            steps
                .entry(job)
                .or_default()
                .extend(samples.iter().map(|s| s.step));
        }
        let observed = exec.observe().await.expect("observe");
        let exited = observed
            .values()
            .filter(|o| matches!(o, Observed::Exited { .. }))
            .count();
        if exited == ids.len() {
            for (job, samples) in exec.take_progress().await {
                steps
                    .entry(job)
                    .or_default()
                    .extend(samples.iter().map(|s| s.step));
            }
            for id in &ids {
                match &observed[id] {
                    Observed::Exited { exit_code, .. } => {
                        assert_eq!(*exit_code, Some(((id.job_id - 1) % 7) as i32), "{id}")
                    }
                    o => panic!("{id}: {o:?}"),
                }
            }
            eprintln!("all exits recorded after {:?}", started.elapsed());
            break;
        }
        assert!(
            Instant::now() < deadline,
            "{exited} of {WORKERS} exited in 120 s"
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    for job in 1..=WORKERS {
        assert_eq!(
            steps.get(&job).cloned().unwrap_or_default(),
            (1..=STEPS).collect::<Vec<_>>(),
            "job {job}"
        );
    }
}

/// Issue 19, item 3, on the host's side: the helper launches one worker
/// identity once, however many servers ask. A second launch of a worker
/// that ended starts nothing and keeps its exit record (a stale leader
/// woken from a pause must not run it again); a claim held by a live agent
/// that has not started the worker yet holds off another launch; a claim
/// whose agent is gone is taken over. Runs the helper directly: the fence
/// is the host's file system, not SSH.
#[test]
fn the_helper_launches_one_worker_identity_once() {
    let dir = tempfile::tempdir().expect("tempdir");
    let helper = dir.path().join("keel-node.sh");
    std::fs::write(&helper, keel_executors::ssh::HELPER_SCRIPT).expect("helper");
    let marker = dir.path().join("started");
    let base = dir.path().join("workers/job-1/e1-r0");
    let ckpt = dir.path().join("ckpt");
    let run = |base: &std::path::Path| {
        let out = std::process::Command::new("sh")
            .arg(&helper)
            .arg("launch")
            .arg(base)
            .arg(&ckpt)
            .args(["0", "0", "0", "sh", "-c"])
            .arg(format!("echo once >> {}", marker.display()))
            .output()
            .expect("sh runs the helper");
        assert!(
            out.status.success(),
            "{}",
            String::from_utf8_lossy(&out.stderr)
        );
    };
    let wait_exit = |base: &std::path::Path| {
        let deadline = Instant::now() + Duration::from_secs(20);
        while !base.with_extension("exit").exists() {
            assert!(Instant::now() < deadline, "no exit record");
            std::thread::sleep(Duration::from_millis(10));
        }
    };
    run(&base);
    wait_exit(&base);
    run(&base);
    assert_eq!(std::fs::read_to_string(&marker).expect("ran"), "once\n");
    assert!(
        base.with_extension("exit").exists(),
        "the exit record was dropped"
    );

    // Another worker, claimed by a live agent that has not started it.
    let other = dir.path().join("workers/job-2/e1-r0");
    std::fs::create_dir_all(other.parent().expect("dir")).expect("dir");
    let mut agent = std::process::Command::new("sleep")
        .arg("30")
        .spawn()
        .expect("an agent");
    std::fs::write(other.with_extension("claim"), format!("{}\n", agent.id())).expect("claim");
    run(&other);
    assert!(!other.with_extension("pid").exists() && !other.with_extension("exit").exists());
    assert_eq!(std::fs::read_to_string(&marker).expect("ran"), "once\n");
    let _ = agent.kill();
    let _ = agent.wait();
    run(&other);
    wait_exit(&other);
    assert_eq!(
        std::fs::read_to_string(&marker).expect("ran"),
        "once\nonce\n"
    );
}

/// A host with nothing of Keel's installed runs job files that call bare
/// `keel`: the executor installs the binary it is given next to its helper
/// (once per version, whatever the number of connections) and puts it first
/// on the workers' PATH.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_host_without_keel_runs_the_keel_the_executor_installs() {
    support::sshd::init_tracing();
    let Some(sshd) = Sshd::start_or_skip("a_host_without_keel_runs_the_keel_the_executor_installs")
    else {
        return;
    };
    // A stand-in for the keel binary: it says what it was asked.
    let fake = sshd.dir.path().join("fake-keel");
    std::fs::write(&fake, "#!/bin/sh\necho \"shipped keel: $*\"\n").expect("fake keel");
    std::fs::set_permissions(&fake, std::os::unix::fs::PermissionsExt::from_mode(0o755))
        .expect("chmod");
    let mut config = sshd.config(vec![sshd.node("a", sshd.port, Some("2xv100"))]);
    config.install_keel = true;
    config.keel_binary = Some(fake);
    let exec = SshExecutor::new(config.clone()).expect("executor");
    exec.take_over().await;
    let mut l = launch("a", 3, 0, "");
    l.command = vec![
        "keel".into(),
        "trainer".into(),
        "--speedup".into(),
        "4".into(),
    ];
    exec.launch(l.clone()).await.expect("launch");
    assert_eq!(
        wait_exit(&exec, &l.id).await,
        (Some(0), "exited with code 0".to_string())
    );
    wait_log(&exec, 3, "shipped keel: trainer --speedup 4").await;
    let bin = std::path::Path::new(&sshd.node("a", sshd.port, None).work_dir).join("bin");
    let installed: Vec<_> = std::fs::read_dir(&bin)
        .expect("bin")
        .flatten()
        .map(|e| e.path().join("keel"))
        .collect();
    assert_eq!(installed.len(), 1, "{installed:?}");
    let modified = || {
        std::fs::metadata(&installed[0])
            .and_then(|m| m.modified())
            .ok()
    };
    let first = modified();
    // Another executor (a new leader) connects again: nothing is sent again.
    exec.release().await;
    let next = SshExecutor::new(config).expect("executor");
    next.take_over().await;
    let mut again = launch("a", 4, 0, "");
    again.command = vec!["keel".into(), "again".into()];
    next.launch(again.clone()).await.expect("launch");
    assert_eq!(wait_exit(&next, &again.id).await.0, Some(0));
    wait_log(&next, 4, "shipped keel: again").await;
    assert_eq!(modified(), first, "installed once per version");
    assert_eq!(std::fs::read_dir(&bin).expect("bin").count(), 1);
}
