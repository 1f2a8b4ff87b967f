//! The pure core stays pure: no async runtime, network, Raft, storage engine
//! or Kubernetes client in its dependency tree.

use std::process::Command;

#[test]
fn core_depends_on_no_runtime_network_raft_or_storage_crate() {
    let cargo = std::env::var("CARGO").unwrap_or_else(|_| "cargo".into());
    let out = Command::new(cargo)
        .args([
            "tree",
            "-p",
            "keel-core",
            "-e",
            "normal",
            "--prefix",
            "none",
            "--format",
            "{p}",
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
    let crates: Vec<&str> = tree
        .lines()
        .filter_map(|l| l.split_whitespace().next())
        .collect();
    assert!(
        crates.contains(&"keel-core"),
        "unexpected cargo tree output:\n{tree}"
    );
    for forbidden in ["tokio", "tonic", "openraft", "sled", "kube", "hyper", "mio"] {
        assert!(
            !crates.contains(&forbidden),
            "keel-core depends on {forbidden}:\n{tree}"
        );
    }
}
