//! The short chaos pass CI runs on every change: `keel-chaos` against three
//! real replicas of this build, every fault kind dealt once per seed
//! (SIGKILL of the leader, a follower and a majority; SIGSTOP of the
//! leader; the leader or a follower cut off; one-way drops both ways; a
//! follower wiped; a follower's disk slow or full, since the tests build
//! `keel` with `--features failpoints`; a replica restarted with its clock
//! seconds to hours off, where libfaketime is installed), with fixed seeds.
//! Every check must pass: nothing
//! acknowledged lost or duplicated, the replicas equal (live and replayed
//! from disk after a kill -9), no invariant broken at any index, the job
//! registry linearizable, and the cluster committing and scheduling again
//! within the bound after each fault. Longer runs: `keel-chaos --rounds 200
//! --seed S` (RELIABILITY.md).

use keel_chaos::RunConfig;

const KEEL: &str = env!("CARGO_BIN_EXE_keel");

#[test]
#[allow(clippy::print_stderr)]
fn a_short_chaos_pass_finds_nothing() {
    let runtime = tokio::runtime::Runtime::new().expect("runtime");
    let mut kinds = keel_chaos::faults::FaultKind::ALL.to_vec();
    kinds.extend(keel_chaos::faults::FaultKind::DISK);
    if keel_chaos::faults::libfaketime().is_some() {
        kinds.extend(keel_chaos::faults::FaultKind::CLOCK);
    } else {
        assert!(
            std::env::var_os("KEEL_REQUIRE_FAKETIME").is_none(),
            "KEEL_REQUIRE_FAKETIME is set and libfaketime is not installed"
        );
        eprintln!("the short chaos pass deals no skewed clock: libfaketime is not installed (apt-get install faketime)");
    }
    for seed in [1, 2] {
        let mut config = RunConfig::new(KEEL.into(), seed, kinds.len() as u32);
        config.kinds = kinds.clone();
        let report = runtime
            .block_on(keel_chaos::run(&config))
            .expect("the run completes");
        assert_found_nothing(&report, kinds.len());
        assert!(
            report.failover.count >= 3,
            "failovers were timed: {:?}",
            report.failover
        );
        assert!(report.replicas_final.iter().all(|r| r.replay.is_some()));
    }
}

/// Issue 22: the same checks with the replicas and the clients over mutual
/// TLS (certificates made for the run) and ACLs on (bootstrapped by the
/// harness; its clients present an operator's token): every network fault
/// and kill, once each. Not the skewed clock: a replica whose clock is
/// hours behind its certificates' start refuses them, as TLS must.
#[test]
#[allow(clippy::print_stderr)]
fn a_short_chaos_pass_over_tls_with_acls_finds_nothing() {
    let runtime = tokio::runtime::Runtime::new().expect("runtime");
    let kinds = keel_chaos::faults::FaultKind::ALL.to_vec();
    let mut config = RunConfig::new(KEEL.into(), 3, kinds.len() as u32);
    config.kinds = kinds.clone();
    config.tls = true;
    config.acl = true;
    let report = runtime
        .block_on(keel_chaos::run(&config))
        .expect("the run completes");
    assert!(config.command_line().contains("--acl"));
    assert_found_nothing(&report, kinds.len());
    assert!(report.failover.count >= 1, "{:?}", report.failover);
}

/// The run passed: every one of `kinds` kinds dealt, nothing lost,
/// duplicated or divergent, no invariant broken, and the workload ran.
#[allow(clippy::print_stderr)]
fn assert_found_nothing(report: &keel_chaos::report::Report, kinds: usize) {
    if !report.passed {
        eprintln!("{}", report.text());
    }
    assert!(report.passed, "seed {}: {}", report.seed, report.text());
    assert_eq!(report.faults_by_kind.len(), kinds, "every kind dealt");
    assert_eq!(
        (
            report.lost,
            report.duplicated,
            report.divergent,
            report.invariant_violations
        ),
        (0, 0, 0, 0)
    );
    let submits = &report.operations["submit"];
    assert!(submits.acknowledged > 20, "the workload ran: {submits:?}");
}
