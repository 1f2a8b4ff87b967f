//! The simulator: hand-checked runs (FIFO, Tiresias, SRJF), determinism,
//! windows, and a property test that every job that fits the cluster
//! finishes under every policy.

use keel_scheduling::policy::{by_name, Fifo, QueueOptions, Srjf, Tiresias, POLICY_NAMES};
use keel_scheduling::throughput;
use keel_sim::{
    cluster_from_counts, simulate, Generator, SimConfig, SimJob, SimNode, SimRetention,
    ThroughputTable,
};
use proptest::prelude::*;

fn job(id: u64, arrival_s: f64, workers: u32, total_steps: u64) -> SimJob {
    SimJob {
        id,
        arrival_s,
        model: "resnet50".into(),
        gpus_per_worker: 1,
        workers_min: workers,
        workers_max: workers,
        total_steps,
        priority: 0,
        job_type: None,
        queue: String::new(),
        measured: Vec::new(),
        cancel_at_s: None,
        restart_s: None,
    }
}

fn v100s(n: u32) -> Vec<SimNode> {
    cluster_from_counts(&format!("{n}:0:0"), n).expect("cluster")
}

#[test]
fn fifo_on_two_gpus_matches_the_hand_computed_schedule() {
    let one = throughput::profile("resnet50").steps_per_s("v100", 1);
    let two = throughput::profile("resnet50").steps_per_s("v100", 2);
    // a: 100 s on one GPU; b: 200 s on one GPU; c (arrives at 10 s) needs
    // both GPUs, waits for b, then runs 100 s.
    let jobs = vec![
        job(0, 0.0, 1, (one * 100.0) as u64),
        job(1, 0.0, 1, (one * 200.0) as u64),
        job(2, 10.0, 2, (two * 100.0) as u64),
    ];
    let report = simulate(&SimConfig::new(v100s(2), jobs), &Fifo::default());
    let jct: Vec<f64> = report
        .jobs
        .iter()
        .map(|j| j.jct_s().expect("finished"))
        .collect();
    let close = |a: f64, b: f64| (a - b).abs() < 0.1;
    assert!(close(jct[0], 100.0), "{jct:?}");
    assert!(close(jct[1], 200.0), "{jct:?}");
    assert!(close(jct[2], 290.0), "{jct:?}");
    assert!(close(report.makespan_s, 300.0), "{}", report.makespan_s);
    // Busy: 2 GPUs for 300 s except a's GPU idle 100..200.
    assert!(
        (report.utilisation - 500.0 / 600.0).abs() < 0.01,
        "{}",
        report.utilisation
    );
    assert_eq!(report.refused_entries, 0);
    assert_eq!(report.preemptions, 0);
    let summary = report.jct(None);
    assert_eq!((summary.finished, summary.unfinished), (3, 0));
}

#[test]
fn a_restart_cost_delays_each_start() {
    let one = throughput::profile("resnet50").steps_per_s("v100", 1);
    let mut config = SimConfig::new(v100s(1), vec![job(0, 0.0, 1, (one * 100.0) as u64)]);
    config.restart_s = 30.0;
    let report = simulate(&config, &Fifo::default());
    let jct = report.jobs[0].jct_s().expect("finished");
    assert!((jct - 130.0).abs() < 0.1, "{jct}");
}

fn generated(seed: u64, jobs: usize) -> Vec<SimJob> {
    Generator {
        jobs,
        rate_per_hour: 20.0,
        seed,
        multi_gpu: true,
        elastic: false,
    }
    .generate()
    .expect("generates")
}

/// Issue 23, item 5: with retention the state holds at most the finished
/// jobs kept and those not finished, whatever the run's length; what the
/// jobs lived through is the same as without it (a removed job had ended),
/// only the state (and its hash) differs.
#[test]
fn retention_bounds_the_state_and_changes_no_schedule() {
    let mut config = SimConfig::new(
        cluster_from_counts("8:4:4", 4).expect("cluster"),
        generated(5, 300),
    );
    config.state_size_samples = 10;
    let kept = simulate(&config, &Fifo::default());
    config.retention = Some(SimRetention {
        finished_s: Some(3600.0),
        finished_max: Some(20),
    });
    let retained = simulate(&config, &Fifo::default());
    assert_eq!(kept.jobs, retained.jobs, "the same schedule");
    assert_eq!(retained.jct(None).finished, 300);
    assert_ne!(kept.state_hash, retained.state_hash);
    assert_eq!(kept.jobs_removed, 0);
    assert!(retained.jobs_removed >= 280, "{}", retained.jobs_removed);
    assert_eq!(kept.state_sizes.len(), 11, "ten samples and the end");
    assert_eq!(kept.state_sizes.last().map(|z| z.jobs), Some(300));
    for (k, r) in kept.state_sizes.iter().zip(&retained.state_sizes) {
        assert_eq!(k.submitted, r.submitted);
        let unfinished = retained
            .jobs
            .iter()
            .filter(|j| j.arrival_s <= r.at_s && j.finish_s.is_none_or(|f| f > r.at_s))
            .count() as u64;
        assert!(
            r.jobs <= unfinished + 20 + 1,
            "{r:?}, {unfinished} unfinished"
        );
        assert!(r.snapshot_bytes <= k.snapshot_bytes, "{r:?} against {k:?}");
    }
    let last = retained.state_sizes.last().expect("the end");
    assert!(last.jobs <= 20, "{last:?}");
    assert!(
        last.snapshot_bytes * 5 < kept.state_sizes.last().expect("end").snapshot_bytes,
        "{last:?}"
    );
}

#[test]
fn the_same_inputs_give_the_same_report() {
    let config = SimConfig::new(
        // FIFO gives a job one GPU type: 8 v100s hold the largest jobs.
        cluster_from_counts("8:4:4", 4).expect("cluster"),
        generated(3, 120),
    );
    let a = simulate(&config, &Fifo::default());
    let b = simulate(&config, &Fifo::default());
    assert_eq!(a, b);
    assert_eq!(a.jct(None).finished, 120);
    let backfill = simulate(&config, &Fifo::new(QueueOptions { backfill: true }));
    assert_ne!(
        a.state_hash, backfill.state_hash,
        "a different policy, a different history"
    );
    assert!(backfill.jct(None).mean_s <= a.jct(None).mean_s * 1.05);
}

#[test]
fn every_policy_is_deterministic_on_an_elastic_workload() {
    let jobs = Generator {
        jobs: 80,
        rate_per_hour: 20.0,
        seed: 5,
        multi_gpu: true,
        elastic: true,
    }
    .generate()
    .expect("generates");
    let mut config = SimConfig::new(cluster_from_counts("8:4:4", 4).expect("cluster"), jobs);
    config.restart_s = 30.0;
    for name in POLICY_NAMES {
        let policy = by_name(name, QueueOptions::default()).expect("known");
        let a = simulate(&config, policy.as_ref());
        let b = simulate(&config, policy.as_ref());
        assert_eq!(a, b, "{name}");
        assert_eq!(a.jct(None).finished, 80, "{name}");
    }
}

#[test]
fn a_window_run_stops_once_its_jobs_finished() {
    let mut config = SimConfig::new(
        cluster_from_counts("8:2:2", 2).expect("cluster"),
        generated(5, 300),
    );
    config.window = Some((50, 99));
    let report = simulate(&config, &Fifo::default());
    let window = report.jct(Some((50, 99)));
    assert_eq!((window.finished, window.unfinished), (50, 0));
    assert!(
        report.jobs.len() < 300 || report.jct(None).unfinished > 0,
        "the run went on past the window"
    );
}

#[test]
fn a_job_larger_than_the_cluster_ends_the_run_unfinished() {
    let jobs = vec![job(0, 0.0, 4, 10), job(1, 0.0, 1, 10)];
    let report = simulate(&SimConfig::new(v100s(2), jobs), &Fifo::default());
    let s = report.jct(None);
    assert_eq!((s.finished, s.unfinished), (1, 1));
}

#[test]
fn tiresias_lets_a_new_job_preempt_one_past_the_first_threshold() {
    let one = throughput::profile("resnet50").steps_per_s("v100", 1);
    // a: 2 h alone; b arrives at 1.5 h (a has 5,400 GPU·s, past 3,600) and
    // needs 10 min.
    let jobs = vec![
        job(0, 0.0, 1, (one * 7200.0) as u64),
        job(1, 5400.0, 1, (one * 600.0) as u64),
    ];
    let report = simulate(&SimConfig::new(v100s(1), jobs), &Tiresias::default());
    let b = &report.jobs[1];
    assert!(
        (b.jct_s().expect("b finished") - 600.0).abs() < 1.0,
        "{b:?}"
    );
    let a = &report.jobs[0];
    assert_eq!(a.restarts, 1, "{a:?}");
    assert!(
        (a.finish_s.expect("a finished") - 7800.0).abs() < 1.0,
        "{a:?}"
    );
    assert_eq!(report.preemptions, 1);
    // FIFO lets b wait for a: 1,800 s, then its 600 s.
    let fifo = simulate(
        &SimConfig::new(
            v100s(1),
            vec![
                job(0, 0.0, 1, (one * 7200.0) as u64),
                job(1, 5400.0, 1, (one * 600.0) as u64),
            ],
        ),
        &Fifo::default(),
    );
    let b = fifo.jobs[1].jct_s().expect("finished");
    assert!((b - 2400.0).abs() < 1.0, "{b}");
}

#[test]
fn srjf_runs_the_shorter_job_first_and_preempts_a_longer_one() {
    let one = throughput::profile("resnet50").steps_per_s("v100", 1);
    let jobs = vec![
        job(0, 0.0, 1, (one * 3600.0) as u64),
        job(1, 60.0, 1, (one * 300.0) as u64),
    ];
    let report = simulate(&SimConfig::new(v100s(1), jobs), &Srjf);
    let b = &report.jobs[1];
    assert!((b.jct_s().expect("finished") - 300.0).abs() < 1.0, "{b:?}");
    assert_eq!(report.jobs[0].restarts, 1);
}

#[test]
fn a_gavel_throughput_table_sets_the_speed_of_the_job_types_it_holds() {
    let table = ThroughputTable::from_gavel_json(
        r#"{"v100": {"('ResNet-50 (batch size 64)', 1)": {"null": 2.0}}}"#,
    )
    .expect("table");
    let mut typed = job(0, 0.0, 1, 200);
    typed.job_type = Some("ResNet-50 (batch size 64)".into());
    let untyped = job(
        1,
        0.0,
        1,
        (throughput::profile("resnet50").steps_per_s("v100", 1) * 50.0) as u64,
    );
    let mut config = SimConfig::new(v100s(2), vec![typed, untyped]);
    config.throughputs = Some(table);
    let report = simulate(&config, &Fifo::default());
    let jct: Vec<f64> = report
        .jobs
        .iter()
        .map(|j| j.jct_s().expect("finished"))
        .collect();
    assert!(
        (jct[0] - 100.0).abs() < 0.1,
        "200 steps at 2 steps/s: {jct:?}"
    );
    assert!((jct[1] - 50.0).abs() < 0.1, "the project's table: {jct:?}");
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 32, .. ProptestConfig::default() })]

    #[test]
    fn every_job_that_fits_finishes_under_every_policy(
        seed in 0u64..1000,
        counts in (1u32..6, 0u32..6, 0u32..6),
        per_server in 1u32..5,
        backfill in any::<bool>(),
    ) {
        let nodes = cluster_from_counts(&format!("{}:{}:{}", counts.0, counts.1, counts.2), per_server)
            .expect("cluster");
        // A job gets GPUs of one type: the largest type's count bounds it.
        let largest = counts.0.max(counts.1).max(counts.2);
        let jobs: Vec<SimJob> = generated(seed, 40)
            .into_iter()
            .enumerate()
            .map(|(i, mut j)| {
                j.workers_min = j.workers_min.min(largest);
                // Every third job is elastic: up to twice its minimum.
                j.workers_max = if i % 3 == 0 {
                    (2 * j.workers_min).min(largest)
                } else {
                    j.workers_min
                };
                j.total_steps = j.total_steps.min(200_000);
                j
            })
            .collect();
        let mut config = SimConfig::new(nodes, jobs);
        config.restart_s = 10.0;
        for name in POLICY_NAMES {
            let policy = by_name(name, QueueOptions { backfill }).expect("known");
            let report = simulate(&config, policy.as_ref());
            let s = report.jct(None);
            prop_assert_eq!((s.finished, s.unfinished), (40, 0), "{}", name);
            prop_assert_eq!(report.refused_entries, 0, "{}", name);
            prop_assert!(report.utilisation <= 1.0 + 1e-9);
            for j in &report.jobs {
                prop_assert!(j.first_start_s.is_some_and(|s| s >= j.arrival_s));
            }
        }
    }
}

#[test]
fn an_elastic_job_is_resized_and_each_resize_costs_a_restart() {
    let mut elastic = job(0, 0.0, 1, 44_000); // 1,000 s on 4 v100s (speed-up 3.386)
    elastic.workers_max = 4;
    let jobs = vec![elastic, job(1, 100.0, 1, 1_100)]; // 100 s on one v100
    let policy = by_name("elastic_fifo", QueueOptions::default()).expect("known");
    let run = |restart_s: f64| {
        let mut config = SimConfig::new(v100s(4), jobs.clone());
        config.restart_s = restart_s;
        simulate(&config, policy.as_ref())
    };
    let free = run(0.0);
    // Shrunk to 3 when job 1 arrived, grown back to 4 when it finished.
    assert_eq!(free.resizes, 2, "{free:?}");
    assert_eq!(free.migrations, 0, "a resize keeps workers where they were");
    assert_eq!(free.jobs[0].restarts, 2);
    let costly = run(30.0);
    assert_eq!(costly.resizes, 2);
    let (a, b) = (
        free.jobs[0].jct_s().expect("finishes"),
        costly.jobs[0].jct_s().expect("finishes"),
    );
    // Three starts (the first and two resizes) each without progress for
    // 30 s; job 1's own start delays its finish and so the grow-back.
    assert!(b - a >= 90.0 - 1e-6, "{a} -> {b}");
    assert!(b - a <= 90.0 + 30.0 + 1e-6, "{a} -> {b}");
}
