//! The SSH nodes file: which hosts the SSH executor runs workers on.
//!
//! ```yaml
//! work_dir: .keel              # on every host; relative to the login directory
//! known_hosts: accept-new      # strict | accept-new | accept
//! connect_timeout_s: 5
//! poll_interval_s: 1           # each host is asked about its workers this often
//! nodes:
//!   - name: gpu-a
//!     host: 10.0.0.5
//!     port: 22                 # default 22
//!     user: train              # default: ssh's (your login name)
//!     key: /home/me/.ssh/keel  # default: ssh's identities
//!     gpus: 8xa100             # omit to discover them with nvidia-smi over SSH
//!     address: 10.1.0.5        # rendezvous address for its workers (default: host)
//!     work_dir: /scratch/keel  # this host's own work directory (default: the one above)
//! ```

use std::path::PathBuf;
use std::time::Duration;

use keel_state::Gpu;
use serde::Deserialize;

use crate::discovery::parse_simulated_gpus;

/// The largest nodes file read.
pub const NODES_FILE_MAX_BYTES: usize = 1 << 20;
/// Most nodes in one file.
pub const NODES_MAX: usize = 4096;
/// Longest host, user, address or work directory.
pub const FIELD_MAX_LEN: usize = 255;

/// A nodes file that cannot be used, naming the field and the limit.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("nodes file: {field}: {reason}")]
pub struct NodesFileError {
    pub field: String,
    pub reason: String,
}

fn invalid(field: impl Into<String>, reason: impl Into<String>) -> NodesFileError {
    NodesFileError {
        field: field.into(),
        reason: reason.into(),
    }
}

/// How a host's key is checked against the known-hosts file.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum HostKeyCheck {
    /// The host must already be known.
    Strict,
    /// Unknown hosts are added on first contact; a changed key is refused.
    #[default]
    AcceptNew,
    /// Any key is accepted (test clusters only).
    Accept,
}

/// One host the SSH executor runs workers on.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SshNode {
    /// The node's name in Keel (`keel nodes`).
    pub name: String,
    pub host: String,
    pub port: u16,
    pub user: Option<String>,
    /// The private key to log in with (only this one is offered).
    pub key: Option<PathBuf>,
    /// Declared GPUs; `None`: discovered with `nvidia-smi` over SSH.
    pub gpus: Option<Vec<Gpu>>,
    /// Where the node's workers reach each other (default: `host`).
    pub address: String,
    /// Keel's directory on this host (worker logs and records,
    /// checkpoints, the helper script); relative paths start at the login
    /// directory. Two nodes on one host need different ones.
    pub work_dir: String,
}

/// The SSH executor's configuration.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SshConfig {
    pub nodes: Vec<SshNode>,
    pub host_key_check: HostKeyCheck,
    /// The known-hosts file (default: ssh's, `~/.ssh/known_hosts`).
    pub known_hosts_file: Option<PathBuf>,
    pub connect_timeout: Duration,
    /// How often each host is asked about its workers (and so how often it
    /// proves alive).
    pub poll_interval: Duration,
    /// Where the local control sockets live (short: a socket path has at
    /// most 107 bytes).
    pub control_dir: PathBuf,
    /// Whether to install `keel_binary` on the hosts (the file's
    /// `install_keel`, default true).
    pub install_keel: bool,
    /// The `keel` binary installed on every host next to the helper (once
    /// per version, under `WORK_DIR/bin/keel-<hash>/keel`) and put first on
    /// the workers' PATH, so job files run `keel trainer` on hosts where
    /// nothing of Keel's is installed. The server sets it to itself; `None`
    /// ships nothing.
    pub keel_binary: Option<PathBuf>,
    /// How the hosts rotate workers' logs (`keel log-writer`, where keel is
    /// on the host) and pause them below a free-space floor: the server's
    /// `--worker-log-*` settings.
    pub logs: crate::worker_log::LogSettings,
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct RawFile {
    #[serde(default)]
    work_dir: Option<String>,
    #[serde(default)]
    known_hosts: Option<String>,
    #[serde(default)]
    known_hosts_file: Option<PathBuf>,
    #[serde(default)]
    install_keel: Option<bool>,
    #[serde(default)]
    connect_timeout_s: Option<f64>,
    #[serde(default)]
    poll_interval_s: Option<f64>,
    nodes: Vec<RawNode>,
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct RawNode {
    name: String,
    host: String,
    #[serde(default)]
    port: Option<u16>,
    #[serde(default)]
    user: Option<String>,
    #[serde(default)]
    key: Option<PathBuf>,
    #[serde(default)]
    gpus: Option<String>,
    #[serde(default)]
    address: Option<String>,
    #[serde(default)]
    work_dir: Option<String>,
}

/// A word passed to ssh or the remote shell: not empty, not an option,
/// no whitespace or control characters, at most [`FIELD_MAX_LEN`].
fn check_word(field: &str, value: &str) -> Result<(), NodesFileError> {
    if value.is_empty() {
        return Err(invalid(field, "empty"));
    }
    if value.len() > FIELD_MAX_LEN {
        return Err(invalid(
            field,
            format!("{} bytes, more than {FIELD_MAX_LEN}", value.len()),
        ));
    }
    if value.starts_with('-') {
        return Err(invalid(field, format!("{value:?} may not start with '-'")));
    }
    if value.chars().any(|c| c.is_whitespace() || c.is_control()) {
        return Err(invalid(
            field,
            format!("{value:?} may not contain spaces or control characters"),
        ));
    }
    Ok(())
}

fn seconds(field: &str, value: Option<f64>, default_s: f64) -> Result<Duration, NodesFileError> {
    let s = value.unwrap_or(default_s);
    if !(s.is_finite() && s > 0.0 && s <= 3600.0) {
        return Err(invalid(
            field,
            format!("{s} is not between 0 and 3600 seconds"),
        ));
    }
    Ok(Duration::from_secs_f64(s))
}

/// Parses and checks a nodes file (YAML). `control_dir` is where the local
/// control sockets go.
pub fn parse_nodes_file(text: &str, control_dir: PathBuf) -> Result<SshConfig, NodesFileError> {
    if text.len() > NODES_FILE_MAX_BYTES {
        return Err(invalid(
            "(file)",
            format!("{} bytes, more than {NODES_FILE_MAX_BYTES}", text.len()),
        ));
    }
    let raw: RawFile =
        serde_saphyr::from_str(text).map_err(|e| invalid("(file)", e.to_string()))?;
    if raw.nodes.is_empty() {
        return Err(invalid("nodes", "no nodes declared"));
    }
    if raw.nodes.len() > NODES_MAX {
        return Err(invalid(
            "nodes",
            format!("{} nodes, more than {NODES_MAX}", raw.nodes.len()),
        ));
    }
    let work_dir = raw.work_dir.unwrap_or_else(|| ".keel".into());
    check_word("work_dir", &work_dir)?;
    let host_key_check = match raw.known_hosts.as_deref() {
        None | Some("accept-new") => HostKeyCheck::AcceptNew,
        Some("strict") => HostKeyCheck::Strict,
        Some("accept") => HostKeyCheck::Accept,
        Some(other) => {
            return Err(invalid(
                "known_hosts",
                format!("{other:?} is not one of strict, accept-new, accept"),
            ))
        }
    };
    let mut nodes: Vec<SshNode> = Vec::with_capacity(raw.nodes.len());
    for (i, n) in raw.nodes.into_iter().enumerate() {
        let at = |f: &str| format!("nodes[{i}].{f}");
        check_word(&at("name"), &n.name)?;
        if n.name.len() > keel_state::state::limits::NODE_NAME_MAX_LEN {
            return Err(invalid(
                at("name"),
                format!(
                    "{} bytes, more than {}",
                    n.name.len(),
                    keel_state::state::limits::NODE_NAME_MAX_LEN
                ),
            ));
        }
        if nodes.iter().any(|m| m.name == n.name) {
            return Err(invalid(
                at("name"),
                format!("{:?} is declared twice", n.name),
            ));
        }
        check_word(&at("host"), &n.host)?;
        if let Some(user) = &n.user {
            check_word(&at("user"), user)?;
            if user.contains('@') {
                return Err(invalid(at("user"), format!("{user:?} may not contain '@'")));
            }
        }
        if let Some(address) = &n.address {
            check_word(&at("address"), address)?;
        }
        if let Some(dir) = &n.work_dir {
            check_word(&at("work_dir"), dir)?;
        }
        if n.port == Some(0) {
            return Err(invalid(at("port"), "0 is not a port"));
        }
        if let Some(key) = &n.key {
            if let Err(e) = std::fs::metadata(key) {
                return Err(invalid(at("key"), format!("{}: {e}", key.display())));
            }
        }
        let gpus = match &n.gpus {
            None => None,
            Some(spec) => {
                let parsed =
                    parse_simulated_gpus(spec).map_err(|e| invalid(at("gpus"), e.to_string()))?;
                let mut gpus = Vec::new();
                for (gpu_type, count) in parsed {
                    for _ in 0..count {
                        gpus.push(Gpu {
                            index: u32::try_from(gpus.len()).unwrap_or(u32::MAX),
                            gpu_type: gpu_type.clone(),
                        });
                    }
                }
                Some(gpus)
            }
        };
        nodes.push(SshNode {
            address: n.address.unwrap_or_else(|| n.host.clone()),
            name: n.name,
            host: n.host,
            port: n.port.unwrap_or(22),
            user: n.user,
            key: n.key,
            gpus,
            work_dir: n.work_dir.unwrap_or_else(|| work_dir.clone()),
        });
    }
    Ok(SshConfig {
        nodes,
        host_key_check,
        known_hosts_file: raw.known_hosts_file,
        connect_timeout: seconds("connect_timeout_s", raw.connect_timeout_s, 5.0)?,
        poll_interval: seconds("poll_interval_s", raw.poll_interval_s, 1.0)?,
        control_dir,
        install_keel: raw.install_keel.unwrap_or(true),
        keel_binary: None,
        logs: Default::default(),
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn parse(text: &str) -> Result<SshConfig, NodesFileError> {
        parse_nodes_file(text, PathBuf::from("/tmp"))
    }

    #[test]
    fn a_nodes_file_parses_with_defaults() {
        let c = parse(
            "nodes:\n  - name: a\n    host: 10.0.0.5\n    gpus: 2xv100,1xk80\n  - name: b\n    host: gpu-b\n    port: 2222\n    user: train\n    address: 10.1.0.2\n",
        )
        .expect("parses");
        assert_eq!(c.nodes[0].work_dir, ".keel");
        assert_eq!(c.host_key_check, HostKeyCheck::AcceptNew);
        assert_eq!(c.nodes[0].port, 22);
        assert_eq!(c.nodes[0].address, "10.0.0.5");
        let gpus = c.nodes[0].gpus.as_ref().expect("declared");
        assert_eq!(
            gpus.iter()
                .map(|g| (g.index, g.gpu_type.as_str()))
                .collect::<Vec<_>>(),
            vec![(0, "v100"), (1, "v100"), (2, "k80")]
        );
        assert_eq!(c.nodes[1].gpus, None, "discovered");
        assert_eq!(c.nodes[1].user.as_deref(), Some("train"));
        assert_eq!(c.nodes[1].address, "10.1.0.2");
        assert_eq!(c.poll_interval, Duration::from_secs(1));
        assert!(c.install_keel, "keel is installed on the hosts by default");
        assert_eq!(c.keel_binary, None, "the server names itself");
        let off =
            parse("install_keel: false\nnodes:\n  - name: a\n    host: h\n    gpus: 1xv100\n")
                .expect("parses");
        assert!(!off.install_keel);
    }

    #[test]
    fn bad_nodes_files_name_the_field() {
        let cases = [
            ("nodes: []\n", "nodes: no nodes declared"),
            (
                "nodes:\n  - name: a\n    host: -oProxyCommand=x\n",
                "nodes[0].host",
            ),
            (
                "nodes:\n  - name: a\n    host: h\n  - name: a\n    host: h\n",
                "nodes[1].name",
            ),
            (
                "nodes:\n  - name: a\n    host: h\n    gpus: lots\n",
                "nodes[0].gpus",
            ),
            (
                "nodes:\n  - name: a\n    host: h\n    key: /no/such/key\n",
                "nodes[0].key",
            ),
            (
                "nodes:\n  - name: a\n    host: h\n    user: a@b\n",
                "nodes[0].user",
            ),
            (
                "nodes:\n  - name: a\n    host: h\n    port: 0\n",
                "nodes[0].port",
            ),
            ("nodes:\n  - name: a\n    host: 'h h'\n", "nodes[0].host"),
            (
                "known_hosts: yes\nnodes:\n  - name: a\n    host: h\n",
                "known_hosts",
            ),
            (
                "poll_interval_s: 0\nnodes:\n  - name: a\n    host: h\n",
                "poll_interval_s",
            ),
            (
                "nodes:\n  - name: a\n    host: h\n    colour: red\n",
                "unknown field",
            ),
        ];
        for (text, needle) in cases {
            let e = parse(text).expect_err(text).to_string();
            assert!(e.contains(needle), "{text:?}: {e}");
        }
        let long = format!("nodes:\n  - name: a\n    host: {}\n", "h".repeat(300));
        assert!(parse(&long)
            .expect_err("too long")
            .to_string()
            .contains("more than 255"));
    }
}
