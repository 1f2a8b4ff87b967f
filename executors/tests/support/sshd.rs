//! A real OpenSSH server on 127.0.0.1 for the SSH executor's tests: its own
//! host key, a generated user key, this user's login, and a TCP proxy in
//! front of it that a test can cut and heal (a network drop).
//!
//! Needs `sshd`, `ssh-keygen` and `ssh` (Debian: `apt-get install
//! openssh-server openssh-client`; `.ci/run` installs them). Where they are
//! missing, [`Sshd::start_or_skip`] says so on the terminal and the test
//! passes without running, so that `cargo test` needs nothing but the Rust
//! toolchain; with `KEEL_REQUIRE_SSHD` set (CI sets it), a missing OpenSSH
//! fails the test instead.

#![allow(dead_code)]

use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use keel_executors::ssh::{HostKeyCheck, SshConfig, SshNode};

/// A running sshd; stopped on drop.
#[derive(Debug)]
pub struct Sshd {
    pub dir: tempfile::TempDir,
    pub port: u16,
    pub user: String,
    /// The user key sshd accepts.
    pub key: PathBuf,
    /// A key sshd does not accept.
    pub wrong_key: PathBuf,
    child: Child,
}

fn find_sshd() -> Option<PathBuf> {
    ["/usr/sbin/sshd", "/usr/local/sbin/sshd", "/sbin/sshd"]
        .into_iter()
        .map(PathBuf::from)
        .find(|p| p.exists())
}

fn sshd_binary() -> PathBuf {
    find_sshd().unwrap_or_else(|| {
        panic!("sshd is not installed: the SSH executor's tests need a real OpenSSH server (apt-get install -y openssh-server)")
    })
}

/// Whether `program` can be started (it is on the PATH).
fn runs(program: &str) -> bool {
    Command::new(program)
        .arg("-V")
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .status()
        .is_ok()
}

/// What of OpenSSH is missing here, if anything.
fn missing_openssh() -> Option<&'static str> {
    if find_sshd().is_none() {
        return Some("sshd");
    }
    if !runs("ssh-keygen") {
        return Some("ssh-keygen");
    }
    if !runs("ssh") {
        return Some("the ssh client");
    }
    None
}

/// Says on the terminal (past the test harness's capture) that `test` did
/// not run, and why.
pub fn say_skipped(test: &str, why: &str, require: &str) {
    use std::io::Write;
    let _ = writeln!(
        std::io::stderr(),
        "SKIPPED {test}: {why} (set {require}=1 to make this a failure)"
    );
}

fn keygen(path: &Path) {
    let ok = Command::new("ssh-keygen")
        .args(["-q", "-t", "ed25519", "-N", "", "-f"])
        .arg(path)
        .status()
        .expect("ssh-keygen runs")
        .success();
    assert!(ok, "ssh-keygen failed");
}

/// A port nothing listens on right now.
pub fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0")
        .and_then(|l| l.local_addr())
        .expect("a free port")
        .port()
}

fn wait_listening(port: u16) -> bool {
    let deadline = Instant::now() + Duration::from_secs(10);
    while Instant::now() < deadline {
        if std::net::TcpStream::connect(("127.0.0.1", port)).is_ok() {
            return true;
        }
        std::thread::sleep(Duration::from_millis(20));
    }
    false
}

impl Sshd {
    /// A running sshd, or `None` where OpenSSH is not installed (said on the
    /// terminal); with `KEEL_REQUIRE_SSHD` set, a missing OpenSSH fails.
    pub fn start_or_skip(test: &str) -> Option<Sshd> {
        if let Some(missing) = missing_openssh() {
            let why = format!(
                "{missing} is not installed: the SSH executor's tests need OpenSSH \
                 (apt-get install -y openssh-server openssh-client)"
            );
            assert!(
                std::env::var_os("KEEL_REQUIRE_SSHD").is_none(),
                "KEEL_REQUIRE_SSHD is set and {why}"
            );
            say_skipped(test, &why, "KEEL_REQUIRE_SSHD");
            return None;
        }
        Some(Sshd::start())
    }

    pub fn start() -> Sshd {
        Sshd::start_with("")
    }

    /// [`Sshd::start`] with `extra` lines in its configuration (e.g.
    /// `SetEnv PATH=...` for the sessions).
    pub fn start_with(extra: &str) -> Sshd {
        let sshd = sshd_binary();
        // sshd started as root wants its privilege-separation directory.
        let _ = std::fs::create_dir_all("/run/sshd");
        let dir = tempfile::tempdir().expect("tempdir");
        let host_key = dir.path().join("host_key");
        let key = dir.path().join("user_key");
        let wrong_key = dir.path().join("wrong_key");
        keygen(&host_key);
        keygen(&key);
        keygen(&wrong_key);
        std::fs::copy(
            key.with_extension("pub"),
            dir.path().join("authorized_keys"),
        )
        .expect("authorized_keys");
        let user = String::from_utf8(
            Command::new("id")
                .arg("-un")
                .output()
                .expect("id runs")
                .stdout,
        )
        .expect("utf-8")
        .trim()
        .to_string();
        let mut failures = String::new();
        for attempt in 0..5 {
            let port = free_port();
            let config = dir.path().join("sshd_config");
            std::fs::write(
                &config,
                format!(
                    "Port {port}\nListenAddress 127.0.0.1\nHostKey {host}\nAuthorizedKeysFile {auth}\n\
                     PidFile {pid}\nStrictModes no\nPasswordAuthentication no\n\
                     KbdInteractiveAuthentication no\nUsePAM no\nPermitRootLogin yes\n\
                     MaxSessions 100\nMaxStartups 100\nLogLevel ERROR\n{extra}",
                    host = host_key.display(),
                    auth = dir.path().join("authorized_keys").display(),
                    pid = dir.path().join("sshd.pid").display(),
                ),
            )
            .expect("sshd_config");
            let child = Command::new(&sshd)
                .arg("-D")
                .arg("-f")
                .arg(&config)
                .arg("-E")
                .arg(dir.path().join("sshd.log"))
                .stdin(Stdio::null())
                .spawn()
                .expect("sshd starts");
            if wait_listening(port) {
                return Sshd {
                    dir,
                    port,
                    user,
                    key,
                    wrong_key,
                    child,
                };
            }
            let mut child = child;
            let _ = child.kill();
            let _ = child.wait();
            failures.push_str(&format!(
                "attempt {attempt}: {}\n",
                std::fs::read_to_string(dir.path().join("sshd.log")).unwrap_or_default()
            ));
        }
        panic!("sshd did not start:\n{failures}");
    }

    /// A node on this sshd, reached through `port` (the sshd's own, or a
    /// proxy's), with its own work directory.
    pub fn node(&self, name: &str, port: u16, gpus: Option<&str>) -> SshNode {
        SshNode {
            name: name.into(),
            host: "127.0.0.1".into(),
            port,
            user: Some(self.user.clone()),
            key: Some(self.key.clone()),
            gpus: gpus.map(|spec| {
                let mut out = Vec::new();
                for (gpu_type, count) in
                    keel_executors::discovery::parse_simulated_gpus(spec).expect("gpus")
                {
                    for _ in 0..count {
                        out.push(keel_state::Gpu {
                            index: out.len() as u32,
                            gpu_type: gpu_type.clone(),
                        });
                    }
                }
                out
            }),
            address: "127.0.0.1".into(),
            work_dir: self
                .dir
                .path()
                .join(format!("work-{name}"))
                .display()
                .to_string(),
        }
    }

    /// An executor configuration over `nodes`, polling every 100 ms.
    pub fn config(&self, nodes: Vec<SshNode>) -> SshConfig {
        let control_dir = self.dir.path().join("ctl");
        SshConfig {
            nodes,
            host_key_check: HostKeyCheck::Accept,
            known_hosts_file: Some(self.dir.path().join("known_hosts")),
            connect_timeout: Duration::from_secs(2),
            poll_interval: Duration::from_millis(100),
            control_dir,
            install_keel: false,
            keel_binary: None,
            logs: Default::default(),
        }
    }
}

impl Drop for Sshd {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// A TCP proxy in front of a port: `cut` drops every connection and
/// refuses new ones until `heal`.
#[derive(Debug, Clone)]
pub struct Proxy {
    pub port: u16,
    up: Arc<AtomicBool>,
    epoch: Arc<tokio::sync::watch::Sender<u64>>,
}

impl Proxy {
    pub async fn start(target: u16) -> Proxy {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
            .await
            .expect("bind");
        let port = listener.local_addr().expect("addr").port();
        let up = Arc::new(AtomicBool::new(true));
        let (tx, _) = tokio::sync::watch::channel(0u64);
        let epoch = Arc::new(tx);
        let proxy = Proxy {
            port,
            up: up.clone(),
            epoch: epoch.clone(),
        };
        tokio::spawn(async move {
            loop {
                let Ok((mut inbound, _)) = listener.accept().await else {
                    return;
                };
                if !up.load(Ordering::SeqCst) {
                    drop(inbound);
                    continue;
                }
                let mut cut = epoch.subscribe();
                tokio::spawn(async move {
                    let Ok(mut outbound) =
                        tokio::net::TcpStream::connect(("127.0.0.1", target)).await
                    else {
                        return;
                    };
                    tokio::select! {
                        _ = tokio::io::copy_bidirectional(&mut inbound, &mut outbound) => {}
                        _ = cut.changed() => {}
                    }
                });
            }
        });
        proxy
    }

    pub fn cut(&self) {
        self.up.store(false, Ordering::SeqCst);
        self.epoch.send_modify(|e| *e += 1);
    }

    pub fn heal(&self) {
        self.up.store(true, Ordering::SeqCst);
    }
}

/// Logs to the test's output when `KEEL_LOG` is set (e.g. `KEEL_LOG=debug`).
pub fn init_tracing() {
    if let Ok(filter) = std::env::var("KEEL_LOG") {
        let _ = tracing_subscriber::fmt()
            .with_env_filter(tracing_subscriber::EnvFilter::new(filter))
            .with_test_writer()
            .try_init();
    }
}
