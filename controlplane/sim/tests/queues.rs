//! Queues in the simulator (issue 23): two teams with equal quotas and
//! weights on a loaded 36:36:36 cluster, one submitting three times the
//! other's load, share the GPUs evenly while both wait; a queue that was
//! idle gets its quota back within a round of submitting again.

use std::collections::BTreeMap;

use keel_scheduling::policy::{by_name, QueueOptions};
use keel_sim::{assign_queues, cluster_from_counts, simulate, Generator, SimConfig, SimJob};
use keel_state::queue::QueueSpec;

const ROUND_S: f64 = 360.0;

fn two_teams() -> Vec<(String, QueueSpec)> {
    ["a", "b"]
        .iter()
        .map(|name| {
            let quota: BTreeMap<String, u32> = ["v100", "p100", "k80"]
                .iter()
                .map(|t| (t.to_string(), 18))
                .collect();
            let mut spec = QueueSpec::with_quota(quota);
            spec.cohort = Some("teams".into());
            (name.to_string(), spec)
        })
        .collect()
}

fn generated(jobs: usize, seed: u64) -> Vec<SimJob> {
    Generator {
        jobs,
        rate_per_hour: 20.0,
        seed,
        multi_gpu: true,
        elastic: false,
    }
    .generate()
    .expect("generated")
}

#[test]
fn two_queues_share_a_loaded_cluster_by_their_quotas_whatever_their_load() {
    let mut jobs = generated(600, 1);
    assign_queues(&mut jobs, &[("a".into(), 3), ("b".into(), 1)], 1).expect("assigned");
    let mut config = SimConfig::new(cluster_from_counts("36:36:36", 1).expect("cluster"), jobs);
    config.round_s = ROUND_S;
    config.queues = two_teams();
    for name in ["fifo", "srjf", "tiresias"] {
        let policy = by_name(name, QueueOptions::default()).expect("policy");
        let report = simulate(&config, policy.as_ref());
        assert!(
            report.contended_s > 20.0 * 3600.0,
            "{name}: both queues waited for {} h only",
            report.contended_s / 3600.0
        );
        let contended: f64 = report.queues.values().map(|q| q.contended_gpu_s).sum();
        for queue in ["a", "b"] {
            let share = report.queues[queue].contended_gpu_s / contended;
            assert!(
                (share - 0.5).abs() <= 0.05,
                "{name}: queue {queue} had {:.1} % of the GPUs while both waited",
                100.0 * share
            );
        }
        // A job arriving to its idle queue with quota unused starts within
        // a round, whatever the other queue borrowed.
        let within: Vec<_> = report.jobs.iter().filter(|j| j.within_quota).collect();
        assert!(within.len() > 20, "{name}: {} such jobs", within.len());
        for job in within {
            let waited = job.first_start_s.map(|s| s - job.arrival_s);
            assert!(
                waited.is_some_and(|w| w <= ROUND_S),
                "{name}: job {} of queue {} waited {waited:?} s",
                job.id,
                job.queue
            );
        }
        assert_eq!(report.refused_entries, 0, "{name}");
    }
}

#[test]
fn an_idle_queue_lends_everything_and_gets_its_quota_back_within_a_round() {
    // Queue a floods the cluster from the start; b submits 1-GPU jobs
    // only after 10 h, one every two hours.
    let mut jobs = generated(300, 2);
    for job in &mut jobs {
        job.queue = "a".into();
    }
    let first_b = jobs.len() as u64;
    for i in 0..10u64 {
        jobs.push(SimJob {
            id: first_b + i,
            arrival_s: 36_000.0 + 7_200.0 * i as f64,
            model: "resnet50".into(),
            gpus_per_worker: 1,
            workers_min: 1,
            workers_max: 1,
            total_steps: 2_000,
            priority: 0,
            job_type: None,
            queue: "b".into(),
            measured: Vec::new(),
            cancel_at_s: None,
            restart_s: None,
        });
    }
    let mut config = SimConfig::new(cluster_from_counts("36:36:36", 1).expect("cluster"), jobs);
    config.round_s = ROUND_S;
    config.queues = two_teams();
    let policy = by_name("fifo", QueueOptions::default()).expect("policy");
    let report = simulate(&config, policy.as_ref());
    // Before b arrives, a holds far beyond its 54: b lent all it had.
    let busy_before: u32 = report
        .samples
        .iter()
        .filter(|s| s.at_s < 36_000.0 && s.at_s > 3_600.0)
        .map(|s| s.busy_gpus)
        .max()
        .unwrap_or(0);
    assert!(busy_before > 100, "a used at most {busy_before} GPUs");
    assert!(report.preemptions > 0, "reclaim preempted a's borrowing");
    for job in report.jobs.iter().filter(|j| j.queue == "b") {
        let waited = job.first_start_s.map(|s| s - job.arrival_s);
        assert!(
            waited.is_some_and(|w| w <= ROUND_S),
            "b's job {} waited {waited:?} s",
            job.id
        );
    }
}
