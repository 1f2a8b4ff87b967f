//! The deterministic simulation of the Raft layer in CI: fixed seeds pass
//! every check (election safety, nothing acknowledged lost or duplicated,
//! replicas equal live and replayed, invariants at every index, liveness
//! after the heal); a seed replays to the same trace; and a disk that
//! acknowledges before it is durable is caught. The leaders' scheduling
//! loops run in the fixed seeds, the 5-replica seed and the replayed
//! seed; the tests of one Raft-layer fault leave them out (they double a
//! seed's cost). The leaders' reconcile loops run there too, over
//! simulated machines, and a stale leader (paused between deciding and
//! acting, deposed meanwhile) must touch no worker; one that skips the
//! quorum's confirmation is caught. Thousands of seeds: `keel-dst --seeds 2000`
//! (RELIABILITY.md).

use keel_chaos::dst::{run_seed, DstConfig, Fault};

#[test]
fn fixed_seeds_pass_every_check() {
    for seed in 0..6 {
        let report = run_seed(&DstConfig::new(seed)).expect("the simulation runs");
        assert!(report.passed, "{}\n{:#?}", report.line(), report.violations);
        let submits = &report.operations["submit"];
        assert!(
            submits.get("committed").copied().unwrap_or(0) > 20,
            "the workload ran: {submits:?}"
        );
        assert!(
            report.terms_with_a_leader >= 2,
            "the faults moved the leadership"
        );
        assert!(report.messages_lost > 0, "the faults dropped messages");
        // The leaders scheduled, and what they decided was planned again
        // from the log alone and matched (a failed match is a violation).
        let scheduled = &report.operations["schedule"];
        assert!(
            scheduled.get("committed").copied().unwrap_or(0) > 5,
            "the scheduling loops ran: {scheduled:?}"
        );
        assert!(report.memory_decisions_checked > 10, "{}", report.line());
        // The leaders' reconcile loops ran workers on the simulated
        // machines (a stale one touching them is a violation).
        assert!(report.workers_launched > 20, "{}", report.line());
    }
}

/// The leader's reconcile loop is paused after it decided to launch or
/// stop, another replica leads and takes the workers over, and the paused
/// loop goes on: it must confirm its leadership, fail to, and touch
/// nothing.
#[test]
fn a_stale_leader_touches_no_worker() {
    for seed in 0..2 {
        let mut config = DstConfig::new(seed);
        config.faults = vec![Fault::StaleLeader];
        config.rounds = 6;
        let report = run_seed(&config).expect("the simulation runs");
        assert!(report.passed, "{}\n{:#?}", report.line(), report.violations);
        assert!(report.stale_leader_pauses >= 3, "{}", report.line());
        assert!(report.workers_launched > 20, "{}", report.line());
    }
}

/// The check of that check: loops that launch and stop without the
/// quorum's confirmation are caught acting as stale leaders.
#[test]
fn a_stale_leader_that_skips_the_confirmation_is_caught() {
    for seed in 0..2 {
        let mut config = DstConfig::new(seed);
        config.faults = vec![Fault::StaleLeader];
        config.rounds = 6;
        config.unconfirmed = true;
        let report = run_seed(&config).expect("the simulation runs");
        assert!(!report.passed, "{}", report.line());
        assert!(
            report
                .violations
                .iter()
                .all(|v| v.starts_with("stale leader: replica")),
            "{:#?}",
            report.violations
        );
    }
}

/// A replica whose log conflicts with a new leader's (an isolated old
/// leader's uncommitted suffix) truncates it and rejoins: the runs truncate
/// entries and still pass every check.
#[test]
fn conflicting_suffixes_are_truncated_and_the_replicas_rejoin() {
    let truncated: u64 = (0..4)
        .map(|seed| {
            let mut config = DstConfig::new(seed);
            config.scheduling = false;
            config.faults = vec![Fault::IsolateLeader, Fault::LeaderCannotSend];
            let report = run_seed(&config).expect("the simulation runs");
            assert!(report.passed, "{}\n{:#?}", report.line(), report.violations);
            report.entries_truncated
        })
        .sum();
    assert!(truncated > 0, "no run truncated a conflicting suffix");
}

/// A lost disk, alone and with the leader lost before the empty member has
/// caught up: nothing acknowledged is lost and the member is re-admitted
/// under its new incarnation (the final checks). Before incarnations, the
/// composite fault lost acknowledged entries in every seed.
#[test]
fn a_lost_disk_loses_nothing_and_the_member_is_re_admitted() {
    for seed in 0..4 {
        let mut config = DstConfig::new(seed);
        config.scheduling = false;
        config.faults = vec![Fault::WipeFollower, Fault::WipeFollowerThenCrashLeader];
        let report = run_seed(&config).expect("the simulation runs");
        assert!(report.passed, "{}\n{:#?}", report.line(), report.violations);
        let wipes: u64 = ["wipe_follower", "wipe_follower_then_crash_leader"]
            .iter()
            .filter_map(|k| report.faults.get(*k))
            .sum();
        assert!(wipes >= 4, "disks were lost: {:?}", report.faults);
    }
}

#[test]
fn five_replicas_pass_too() {
    let mut config = DstConfig::new(11);
    config.replicas = 5;
    let report = run_seed(&config).expect("the simulation runs");
    assert!(report.passed, "{}\n{:#?}", report.line(), report.violations);
}

#[test]
fn a_seed_replays_to_the_same_trace_and_another_seed_does_not() {
    let first = run_seed(&DstConfig::new(7)).expect("runs");
    let again = run_seed(&DstConfig::new(7)).expect("runs");
    assert_eq!(first.digest, again.digest, "the same seed, the same run");
    assert_eq!(
        (first.final_index, &first.state_hash),
        (again.final_index, &again.state_hash)
    );
    let other = run_seed(&DstConfig::new(8)).expect("runs");
    assert_ne!(first.digest, other.digest);
}

#[test]
fn a_disk_that_acknowledges_before_it_is_durable_is_caught() {
    let failed: Vec<_> = (0..8)
        .map(|seed| {
            let mut config = DstConfig::new(seed);
            config.scheduling = false;
            config.lying_disk = true;
            run_seed(&config).expect("runs")
        })
        .filter(|r| !r.passed)
        .collect();
    assert!(!failed.is_empty(), "no run caught the lying disk");
    let safety = |v: &String| {
        v.starts_with("lost") || v.starts_with("divergent") || v.starts_with("log matching")
    };
    assert!(
        failed.iter().any(|r| r.violations.iter().any(safety)),
        "a lost or divergent entry among {:#?}",
        failed.iter().map(|r| &r.violations).collect::<Vec<_>>()
    );
}
