//! The pure crates stay pure and layered: no async runtime, network, Raft,
//! storage engine or Kubernetes client in their dependency trees, and
//! dependencies only downward (simulation → scheduling → state).

use std::process::Command;

/// The crates `package` depends on (normal dependencies, itself included).
fn dependencies(package: &str) -> Vec<String> {
    let cargo = std::env::var("CARGO").unwrap_or_else(|_| "cargo".into());
    let out = Command::new(cargo)
        .args([
            "tree", "-p", package, "-e", "normal", "--prefix", "none", "--format", "{p}",
        ])
        .current_dir(env!("CARGO_MANIFEST_DIR"))
        .output()
        .expect("run cargo tree");
    assert!(
        out.status.success(),
        "cargo tree failed: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    let tree = String::from_utf8_lossy(&out.stdout);
    let crates: Vec<String> = tree
        .lines()
        .filter_map(|l| l.split_whitespace().next())
        .map(str::to_string)
        .collect();
    assert!(
        crates.iter().any(|c| c == package),
        "unexpected cargo tree output:\n{tree}"
    );
    crates
}

const RUNTIME_NETWORK_RAFT_OR_STORAGE: [&str; 7] =
    ["tokio", "tonic", "openraft", "sled", "kube", "hyper", "mio"];

/// Each pure crate and the Keel crates it must not depend on: the state
/// knows neither scheduling nor simulation; scheduling does not know the
/// simulators.
const PURE_CRATES: [(&str, &[&str]); 3] = [
    ("keel-state", &["keel-scheduling", "keel-sim"]),
    ("keel-scheduling", &["keel-sim"]),
    ("keel-sim", &[]),
];

/// Fails naming the first of `forbidden` that `package` depends on.
fn assert_depends_on_none(package: &str, forbidden: &[&str]) {
    let crates = dependencies(package);
    for f in forbidden {
        assert!(
            !crates.iter().any(|c| c == f),
            "{package} depends on {f}: {crates:?}"
        );
    }
}

#[test]
fn the_pure_crates_depend_on_no_runtime_network_raft_or_storage_crate() {
    for (package, _) in PURE_CRATES {
        assert_depends_on_none(package, &RUNTIME_NETWORK_RAFT_OR_STORAGE);
    }
}

#[test]
fn dependencies_point_from_simulation_to_scheduling_to_state() {
    for (package, below) in PURE_CRATES {
        assert_depends_on_none(package, below);
    }
    assert!(dependencies("keel-sim")
        .iter()
        .any(|c| c == "keel-scheduling"));
    assert!(dependencies("keel-scheduling")
        .iter()
        .any(|c| c == "keel-state"));
}
