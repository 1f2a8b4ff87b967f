//! The pure core stays pure: no async runtime, network, Raft, storage engine
//! or Kubernetes client in its dependency tree.

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

#[test]
fn core_depends_on_no_runtime_network_raft_or_storage_crate() {
    let crates = dependencies("keel-core");
    for forbidden in RUNTIME_NETWORK_RAFT_OR_STORAGE.iter().chain(&["keel-sim"]) {
        assert!(
            !crates.iter().any(|c| c == forbidden),
            "keel-core depends on {forbidden}: {crates:?}"
        );
    }
}

#[test]
fn the_simulators_are_as_pure_as_the_core() {
    let crates = dependencies("keel-sim");
    for forbidden in RUNTIME_NETWORK_RAFT_OR_STORAGE {
        assert!(
            !crates.iter().any(|c| c == forbidden),
            "keel-sim depends on {forbidden}: {crates:?}"
        );
    }
}
