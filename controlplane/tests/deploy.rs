//! Issue 25, item 4: the Kubernetes manifests. Each overlay is rendered
//! with `kubectl kustomize` (offline) and checked: every object against
//! the Kubernetes API's schemas (`kubernetes-validate --strict`, from PyPI,
//! in the black-box suite's virtual environment), the peers and member ids
//! against the replica count, and the rendered `keel.toml` with those
//! peers against the real `keel server --print-config`.

mod support;

use std::path::{Path, PathBuf};
use std::process::Command;

use serde_json::Value;

/// The Kubernetes version the manifests are validated against.
const KUBERNETES_VERSION: &str = "1.32.0";

fn repo() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("..")
}

/// `kubernetes-validate` where `.ci/run` installs it, if there.
fn validator() -> Option<PathBuf> {
    let path = repo().join("target/blackbox-venv/bin/kubernetes-validate");
    support::present_or_skip(
        path.exists(),
        "kubernetes-validate (pip install it into target/blackbox-venv)",
        "the manifests' schema check in every_overlay_renders_valid_objects_whose_peers_match_the_replicas",
        "KEEL_REQUIRE_KUBERNETES_VALIDATE",
    )
    .then_some(path)
}

fn of_kind<'a>(docs: &'a [Value], kind: &str) -> Vec<&'a Value> {
    docs.iter().filter(|d| d["kind"] == kind).collect()
}

#[test]
fn every_overlay_renders_valid_objects_whose_peers_match_the_replicas() {
    if !support::available_or_skip(
        "kubectl",
        "every_overlay_renders_valid_objects_whose_peers_match_the_replicas",
        "KEEL_REQUIRE_KUBECTL",
    ) {
        return;
    }
    let validator = validator();
    let tmp = tempfile::tempdir().expect("tempdir");
    for (overlay, replicas) in [("three-replicas", 3u64), ("five-replicas", 5)] {
        let out = Command::new("kubectl")
            .arg("kustomize")
            .arg(repo().join("deploy/kubernetes/overlays").join(overlay))
            .output()
            .expect("kubectl kustomize");
        assert!(
            out.status.success(),
            "{overlay}: {}",
            String::from_utf8_lossy(&out.stderr)
        );
        let text = String::from_utf8(out.stdout).expect("utf-8");
        let rendered = tmp.path().join(format!("{overlay}.yaml"));
        std::fs::write(&rendered, &text).expect("write");
        if let Some(v) = &validator {
            let out = Command::new(v)
                .args(["--strict", "--kubernetes-version", KUBERNETES_VERSION])
                .arg(&rendered)
                .output()
                .expect("kubernetes-validate");
            let said = String::from_utf8_lossy(&out.stdout).to_string()
                + &String::from_utf8_lossy(&out.stderr);
            assert!(out.status.success(), "{overlay}: {said}");
            assert!(
                !said.contains("WARN") && !said.contains("ERROR"),
                "{overlay}: {said}"
            );
        }
        let docs: Vec<Value> = serde_saphyr::from_multiple(&text).expect("yaml");
        for kind in [
            "StatefulSet",
            "Service",
            "PodDisruptionBudget",
            "ConfigMap",
            "ServiceAccount",
            "Role",
            "RoleBinding",
            "ClusterRole",
            "ClusterRoleBinding",
        ] {
            assert!(!of_kind(&docs, kind).is_empty(), "{overlay}: no {kind}");
        }
        let set = of_kind(&docs, "StatefulSet")[0];
        let namespace = set["metadata"]["namespace"].as_str().expect("namespace");
        assert_eq!(set["spec"]["replicas"], replicas, "{overlay}");
        let service = set["spec"]["serviceName"].as_str().expect("serviceName");
        let headless = of_kind(&docs, "Service")
            .into_iter()
            .find(|s| s["metadata"]["name"] == service)
            .expect("the peers' Service");
        assert_eq!(headless["spec"]["clusterIP"], "None");
        assert_eq!(headless["spec"]["publishNotReadyAddresses"], true);
        // The executor's service account may do what its RBAC says, in
        // the namespace it runs in.
        let binding = of_kind(&docs, "ClusterRoleBinding")[0];
        assert_eq!(binding["subjects"][0]["namespace"], namespace, "{overlay}");

        // The peers: member i is Pod keel-(i-1) by its stable name, on the
        // API port; ids 1 to the replica count, each once.
        let container = &set["spec"]["template"]["spec"]["containers"][0];
        let peers = container["env"]
            .as_array()
            .into_iter()
            .flatten()
            .find(|e| e["name"] == "KEEL_PEERS")
            .and_then(|e| e["value"].as_str())
            .expect("KEEL_PEERS");
        let api_port = container["ports"]
            .as_array()
            .into_iter()
            .flatten()
            .find(|p| p["name"] == "api")
            .and_then(|p| p["containerPort"].as_u64())
            .expect("the api port");
        let set_name = set["metadata"]["name"].as_str().expect("name");
        let expected: Vec<String> = (1..=replicas)
            .map(|id| {
                format!(
                    "{id}={set_name}-{}.{service}.{namespace}.svc.cluster.local:{api_port}",
                    id - 1
                )
            })
            .collect();
        assert_eq!(peers.split(',').collect::<Vec<_>>(), expected, "{overlay}");
        let command = container["command"].to_string();
        assert!(
            command.contains("${HOSTNAME##*-} + 1"),
            "the id from the ordinal: {command}"
        );
        // One replica down at a time leaves a quorum.
        let pdb = of_kind(&docs, "PodDisruptionBudget")[0];
        let down = pdb["spec"]["maxUnavailable"]
            .as_u64()
            .expect("maxUnavailable");
        assert!(
            replicas - down > replicas / 2,
            "{overlay}: {down} down of {replicas}"
        );
        assert_eq!(
            set["spec"]["template"]["spec"]["affinity"]["podAntiAffinity"]
                ["requiredDuringSchedulingIgnoredDuringExecution"][0]["topologyKey"],
            "kubernetes.io/hostname"
        );

        // The rendered keel.toml, with those peers and a member's id, is
        // what the real server takes.
        let config = of_kind(&docs, "ConfigMap")[0]["data"]["keel.toml"]
            .as_str()
            .expect("keel.toml")
            .to_string();
        let file = tmp.path().join(format!("{overlay}.toml"));
        std::fs::write(&file, config).expect("write");
        let out = Command::new(support::KEEL)
            .args([
                "server",
                "--print-config",
                "--id",
                &replicas.to_string(),
                "--config",
            ])
            .arg(&file)
            .env("KEEL_PEERS", peers)
            .output()
            .expect("keel server --print-config");
        assert!(
            out.status.success(),
            "{overlay}: {}",
            String::from_utf8_lossy(&out.stderr)
        );
        let printed = String::from_utf8_lossy(&out.stdout);
        let peers_line = printed
            .lines()
            .find(|l| l.starts_with("peers = "))
            .expect("peers printed");
        assert_eq!(
            peers_line.matches("svc.cluster.local").count() as u64,
            replicas
        );
        assert!(peers_line.ends_with("# environment"), "{peers_line}");
        for line in [
            "acl = true  # config file",
            "kubernetes = true  # config file",
        ] {
            assert!(printed.lines().any(|l| l == line), "{line:?} in {printed}");
        }
    }
}

/// Issue 25, item 5: the systemd unit passes `systemd-analyze verify`
/// (with the paths of this checkout), and its keel.toml and keel.env are
/// what the real server takes.
#[test]
fn the_systemd_unit_verifies_and_its_settings_are_the_servers() {
    let units = repo().join("deploy/systemd");
    let tmp = tempfile::tempdir().expect("tempdir");
    let env_text = std::fs::read_to_string(units.join("keel.env")).expect("keel.env");
    let env: Vec<(String, String)> = env_text
        .lines()
        .map(str::trim)
        .filter(|l| !l.is_empty() && !l.starts_with('#'))
        .map(|l| {
            let (k, v) = l.split_once('=').expect("KEY=VALUE");
            (k.to_string(), v.to_string())
        })
        .collect();
    support::printed_config(
        Command::new(support::KEEL)
            .args(["server", "--print-config", "--config"])
            .arg(units.join("keel.toml"))
            .envs(env.iter().map(|(k, v)| (k, v))),
        &[
            "id = 1  # environment",
            "tls_cert = \"/etc/keel/tls/member-1.crt\"  # environment",
            "acl = true  # config file",
            "ssh_nodes = \"/etc/keel/nodes.yaml\"  # config file",
        ],
    );

    if !support::available_or_skip(
        "systemd-analyze",
        "the_systemd_unit_verifies_and_its_settings_are_the_servers",
        "KEEL_REQUIRE_SYSTEMD_ANALYZE",
    ) {
        return;
    }
    let unit = std::fs::read_to_string(units.join("keel.service")).expect("keel.service");
    for needed in [
        "NoNewPrivileges=yes",
        "ProtectSystem=strict",
        "CapabilityBoundingSet=",
        "UMask=0077",
    ] {
        assert!(unit.lines().any(|l| l == needed), "{needed} in the unit");
    }
    let env_file = tmp.path().join("keel.env");
    std::fs::write(&env_file, &env_text).expect("write");
    let local = unit
        .replace("/usr/local/bin/keel", support::KEEL)
        .replace("/etc/keel/keel.env", env_file.to_str().expect("utf-8"));
    let path = tmp.path().join("keel.service");
    std::fs::write(&path, local).expect("write");
    let out = Command::new("systemd-analyze")
        .arg("verify")
        .arg(&path)
        .output()
        .expect("systemd-analyze verify");
    let said =
        String::from_utf8_lossy(&out.stderr).to_string() + &String::from_utf8_lossy(&out.stdout);
    assert!(out.status.success(), "{said}");
    assert!(
        !said.contains("keel.service:"),
        "a complaint about the unit: {said}"
    );
}

/// Issue 25, item 3: the container image. Its Containerfile is read for
/// what an operator relies on (a non-root user, the data directory a
/// volume, the server's own default ports exposed, a health check on
/// `/healthz`); where podman runs and can reach its base image, the
/// runtime stage is assembled from the binary this build made, and the
/// image runs `keel` as that user.
#[test]
fn the_container_image_runs_keel_as_a_user_on_a_volume() {
    let file = std::fs::read_to_string(repo().join("deploy/container/Containerfile"))
        .expect("Containerfile");
    let lines: Vec<&str> = file.lines().map(str::trim).collect();
    for needed in [
        "FROM docker.io/library/rust:1-bookworm AS build",
        "FROM docker.io/library/debian:bookworm-slim AS runtime",
        "USER 10001:10001",
        "VOLUME [\"/var/lib/keel\"]",
        "ENTRYPOINT [\"keel\"]",
    ] {
        assert!(lines.contains(&needed), "{needed} in the Containerfile");
    }
    assert!(file.contains("/healthz"), "a health check");
    // The ports exposed are the server's defaults.
    let out = Command::new(support::KEEL)
        .args(["server", "--print-config"])
        .output()
        .expect("print-config");
    let printed = String::from_utf8_lossy(&out.stdout);
    let expose = lines
        .iter()
        .find(|l| l.starts_with("EXPOSE "))
        .expect("EXPOSE");
    assert!(printed.contains("listen = \"127.0.0.1:7070\""), "{printed}");
    assert_eq!(*expose, "EXPOSE 7070 7080");

    if !support::available_or_skip(
        "podman",
        "the_container_image_runs_keel_as_a_user_on_a_volume (its build)",
        "KEEL_REQUIRE_PODMAN",
    ) {
        return;
    }
    let context = tempfile::tempdir().expect("tempdir");
    std::fs::copy(support::KEEL, context.path().join("keel")).expect("copy keel");
    let tag = format!("localhost/keel-test:{}", std::process::id());
    let out = Command::new("podman")
        .args([
            "build",
            "--target",
            "runtime",
            "--build-arg",
            "KEEL_BINARY_STAGE=host",
        ])
        .args(["-t", &tag, "-f"])
        .arg(repo().join("deploy/container/Containerfile"))
        .arg(context.path())
        .output()
        .expect("podman build");
    let said = String::from_utf8_lossy(&out.stderr).to_string();
    if !out.status.success() && std::env::var_os("KEEL_REQUIRE_PODMAN").is_none() {
        #[allow(clippy::print_stderr)]
        {
            eprintln!("SKIPPED the image's build: podman could not build it here: {said}");
        }
        return;
    }
    assert!(out.status.success(), "{said}");
    let run = Command::new("podman")
        .args([
            "run",
            "--rm",
            "--entrypoint",
            "/bin/sh",
            &tag,
            "-c",
            "id -u && keel --version",
        ])
        .output()
        .expect("podman run");
    let _ = Command::new("podman").args(["rmi", "-f", &tag]).output();
    let said = String::from_utf8_lossy(&run.stdout);
    assert!(
        run.status.success(),
        "{}",
        String::from_utf8_lossy(&run.stderr)
    );
    assert!(said.starts_with("10001\nkeel "), "{said}");
}
