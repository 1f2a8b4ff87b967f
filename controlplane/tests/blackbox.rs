//! The black-box suite (`tests/blackbox/`): Keel's API driven as an outside
//! client would, through Python stubs generated from `proto/` by
//! grpcio-tools, against real `keel server` processes built here.
//!
//! It needs a Python with grpcio and grpcio-tools: `KEEL_BLACKBOX_PYTHON`,
//! else `target/blackbox-venv/bin/python`, which `.ci/run` makes
//! (`python3 -m venv target/blackbox-venv && target/blackbox-venv/bin/pip
//! install -r tests/blackbox/requirements.txt`). Where neither exists the
//! test says so and passes, so that `cargo test` needs nothing but the Rust
//! toolchain; CI sets `KEEL_REQUIRE_BLACKBOX=1`, which makes a missing
//! Python a failure.

use std::path::{Path, PathBuf};
use std::process::Command;

mod support;

fn repo_root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .parent()
        .expect("the repository root")
        .to_path_buf()
}

fn python() -> Option<PathBuf> {
    if let Some(p) = std::env::var_os("KEEL_BLACKBOX_PYTHON") {
        return Some(PathBuf::from(p));
    }
    let venv = repo_root().join("target/blackbox-venv/bin/python");
    venv.exists().then_some(venv)
}

#[test]
#[allow(clippy::print_stderr)]
fn an_outside_client_gets_clear_errors_and_applies_nothing_twice() {
    let Some(python) = python() else {
        assert!(
            std::env::var_os("KEEL_REQUIRE_BLACKBOX").is_none(),
            "KEEL_REQUIRE_BLACKBOX is set but there is no Python with grpcio \
             (set KEEL_BLACKBOX_PYTHON or make target/blackbox-venv)"
        );
        eprintln!(
            "the black-box suite did not run: no Python with grpcio (see tests/blackbox/README.md)"
        );
        return;
    };
    let out = Command::new(&python)
        .args(["-m", "unittest", "-v", "test_outside_client"])
        .current_dir(repo_root().join("tests/blackbox"))
        .env("KEEL_BIN", support::KEEL)
        .output()
        .expect("the black-box suite's Python runs");
    let report = String::from_utf8_lossy(&out.stderr);
    assert!(
        out.status.success(),
        "{}\n{report}",
        String::from_utf8_lossy(&out.stdout)
    );
    // Every test ran: none skipped, none missing.
    assert!(report.contains("\nOK"), "{report}");
    assert!(!report.contains("skipped"), "{report}");
    let ran: usize = report
        .lines()
        .find_map(|l| l.strip_prefix("Ran ")?.split(' ').next()?.parse().ok())
        .unwrap_or(0);
    assert!(ran >= 10, "only {ran} black-box tests ran:\n{report}");
}
