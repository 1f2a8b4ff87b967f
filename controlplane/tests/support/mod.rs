//! What the end-to-end tests share: a real `keel server` child process and
//! bounded waiting.

#![allow(dead_code)]

use std::path::Path;
use std::process::{Child, Command, Output, Stdio};
use std::time::{Duration, Instant};

pub const KEEL: &str = env!("CARGO_BIN_EXE_keel");

/// A file's permission bits (`0o600`, ...), not following a symlink.
pub fn mode(path: &Path) -> u32 {
    use std::os::unix::fs::PermissionsExt;
    std::fs::symlink_metadata(path)
        .unwrap_or_else(|e| panic!("{}: {e}", path.display()))
        .permissions()
        .mode()
        & 0o777
}

/// This process's umask, which the processes it starts (a server, sshd)
/// inherit. Read by setting one and putting it back: the only way.
pub fn process_umask() -> u32 {
    let ours = nix::sys::stat::umask(nix::sys::stat::Mode::from_bits_truncate(0o022));
    nix::sys::stat::umask(ours);
    ours.bits()
}

/// Runs `command` (a `keel` that needs no server: `replay`, `policy eval`,
/// ...), which must succeed, and parses its JSON output.
/// What `keel server ... --print-config` printed (it must succeed), and
/// a check that each of `lines` is one of its lines.
#[allow(dead_code)]
pub fn printed_config(command: &mut Command, lines: &[&str]) -> String {
    let out = command.output().expect("keel server --print-config");
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let printed = String::from_utf8_lossy(&out.stdout).to_string();
    for line in lines {
        assert!(
            printed.lines().any(|l| l == *line),
            "{line:?} not in:\n{printed}"
        );
    }
    printed
}

pub fn json_of(command: &mut Command) -> serde_json::Value {
    let out = command.output().expect("run keel");
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    serde_json::from_slice(&out.stdout).expect("JSON output")
}

/// Whether this machine lets Keel make a cgroup per worker. Where it does
/// not, says on the terminal that `test` did not run and why; with
/// `KEEL_REQUIRE_CGROUP` set (`.ci/run` sets it where a hierarchy is
/// writable), that fails the test.
pub fn cgroups_or_skip(test: &str) -> bool {
    use std::io::Write;
    let tag = format!("probe-{}", std::process::id());
    match keel_executors::containment::Cgroups::detect(&tag) {
        Ok(_) => true,
        Err(why) => {
            assert!(
                std::env::var_os("KEEL_REQUIRE_CGROUP").is_none(),
                "KEEL_REQUIRE_CGROUP is set and {why}"
            );
            let _ = writeln!(
                std::io::stderr(),
                "SKIPPED {test}: {why} (set KEEL_REQUIRE_CGROUP=1 to make this a failure)"
            );
            false
        }
    }
}

/// The processes whose environment holds `KEEL_MARK=mark`, from the
/// process table (not from Keel's records).
pub fn marked(mark: &str) -> Vec<u32> {
    let needle = format!("KEEL_MARK={mark}\0");
    std::fs::read_dir("/proc")
        .into_iter()
        .flatten()
        .flatten()
        .filter_map(|e| e.file_name().to_str()?.parse::<u32>().ok())
        .filter(|pid| {
            std::fs::read(format!("/proc/{pid}/environ"))
                .is_ok_and(|env| env.windows(needle.len()).any(|w| w == needle.as_bytes()))
        })
        .collect()
}

/// Submits a one-GPU, one-worker job that runs `script` with `sh -c`;
/// its id.
pub fn submit_script(server: &ServerProcess, dir: &Path, name: &str, script: &str) -> String {
    submit_spec(
        server,
        dir,
        serde_json::json!({
            "name": name, "command": ["sh", "-c", script], "gpus": 1, "workers": 1
        }),
    )
}

/// Submits the job spec `body` (written as a JSON file in `dir`); its id.
pub fn submit_spec(server: &ServerProcess, dir: &Path, body: serde_json::Value) -> String {
    let name = body["name"].as_str().expect("a spec has a name");
    let spec = dir.join(format!("{name}.json"));
    std::fs::write(&spec, body.to_string()).expect("spec");
    server.json(&["submit", "-f", spec.to_str().expect("utf-8")])["id"]
        .as_u64()
        .expect("job id")
        .to_string()
}

/// A stand-in `nvidia-smi` in `DIR/bin`: one GPU at first (index 0, an
/// A100 with UUID `uuid` at PCI 0000:3B:00.0; [`FakeNvidiaSmi::lists_gpus`]
/// changes the listing), and the processes on it that
/// [`FakeNvidiaSmi::lists`] says, as the driver's `--query-compute-apps`
/// would. Like the driver, it exits 15 when the listing names a GPU it
/// lost ("Unable to determine the device handle ...").
pub struct FakeNvidiaSmi {
    pub bin: std::path::PathBuf,
    apps: std::path::PathBuf,
    listing: std::path::PathBuf,
    uuid: String,
}

/// The stand-in driver's listing of one A100 (`index`) at PCI bus `bus`.
pub fn a100_at(index: u32, bus: &str) -> String {
    format!("{index}, NVIDIA A100-SXM4-40GB, 00000000:{bus}:00.0\n")
}

impl FakeNvidiaSmi {
    pub fn new(dir: &Path, uuid: &str) -> FakeNvidiaSmi {
        use std::os::unix::fs::PermissionsExt;
        let bin = dir.join("bin");
        std::fs::create_dir_all(&bin).expect("bin");
        let apps = dir.join("compute-apps.csv");
        std::fs::write(&apps, "").expect("apps");
        let listing = dir.join("gpus.csv");
        std::fs::write(&listing, a100_at(0, "3B")).expect("listing");
        let fake = bin.join("nvidia-smi");
        std::fs::write(
            &fake,
            format!(
                "#!/bin/sh\ncase \"$1\" in\n\
                 --query-gpu=index,name*) cat '{listing}'; \
                 if grep -q '^Unable' '{listing}'; then exit 15; fi ;;\n\
                 --query-gpu=index,uuid) echo '0, {uuid}' ;;\n\
                 --query-compute-apps=*) cat '{apps}' ;;\n\
                 *) echo \"unexpected: $*\" >&2; exit 2 ;;\nesac\n",
                listing = listing.display(),
                apps = apps.display()
            ),
        )
        .expect("fake nvidia-smi");
        std::fs::set_permissions(&fake, std::fs::Permissions::from_mode(0o755)).expect("chmod");
        FakeNvidiaSmi {
            bin,
            apps,
            listing,
            uuid: uuid.to_string(),
        }
    }

    /// From now on `--query-gpu=index,name,pci.bus_id` prints `listing`
    /// (written whole, then renamed: a reader sees one or the other).
    pub fn lists_gpus(&self, listing: &str) {
        let tmp = self.listing.with_extension("tmp");
        std::fs::write(&tmp, listing).expect("listing");
        std::fs::rename(&tmp, &self.listing).expect("listing");
    }

    /// PATH with the stand-in first.
    pub fn path(&self) -> std::ffi::OsString {
        std::env::join_paths(
            std::iter::once(self.bin.clone()).chain(std::env::split_paths(
                &std::env::var_os("PATH").unwrap_or_default(),
            )),
        )
        .expect("PATH")
    }

    /// From now on the driver lists `pid` (called `name`) on GPU 0; `None`:
    /// nothing.
    pub fn lists(&self, process: Option<(u32, &str)>) {
        let body = process.map_or(String::new(), |(pid, name)| {
            format!("{}, {pid}, {name}\n", self.uuid)
        });
        std::fs::write(&self.apps, body).expect("apps");
    }
}

/// Preemption on a server with one GPU under `srjf`: a long job whose
/// worker left a `setsid` child (marked `mark`) is preempted by a short
/// one, which counts the long job's processes in the process table when
/// it starts: none.
pub fn assert_preemption_leaves_nothing(server: &ServerProcess, dir: &Path, mark: &str) {
    let trainer = "keel trainer --speedup 50 --report-every-s 0.1 --checkpoint-every-steps 50";
    let job = |name: &str, script: String, steps: u64| {
        submit_spec(
            server,
            dir,
            serde_json::json!({
                "name": name, "command": ["sh", "-c", script], "gpus": 1,
                "model": "resnet50", "total_steps": steps
            }),
        )
    };
    let long = job(
        "long",
        format!("KEEL_MARK={mark} setsid sleep 3001 & exec {trainer}"),
        10_000_000,
    );
    wait_for("the long job to make progress", || {
        let step = server.json(&["job", &long])["progress"]["step"].as_u64()?;
        (step >= 50 && !marked(mark).is_empty()).then_some(())
    });
    let short = job(
        "short",
        format!(
            "echo leftovers=$(grep -l -a 'KEEL_MARK={mark}' /proc/[0-9]*/environ 2>/dev/null | wc -l); exec {trainer}"
        ),
        500,
    );
    wait_for("the short job to succeed", || {
        (server.json(&["job", &short])["state"] == "succeeded").then_some(())
    });
    let history = server.json(&["job", &long])["history"].to_string();
    assert!(history.contains("preempted"), "{history}");
    let log = server.cli_ok(&["logs", &short]);
    assert!(
        log.contains("leftovers=0"),
        "the short job started beside the preempted job's process: {log}"
    );
    server.cli_ok(&["cancel", &long]);
}

/// Kills process group `pgid` with SIGKILL (as an operator's `kill -9
/// -PGID`), which must exist.
pub fn kill9_group(pgid: u32) {
    let killed = Command::new("kill")
        .args(["-9", "--", &format!("-{pgid}")])
        .status()
        .expect("kill");
    assert!(killed.success(), "process group {pgid} was there to kill");
}

/// A process of no job (`sleep SECONDS`, no `KEEL_JOB_ID`), killed when
/// dropped.
pub struct Stranger(pub Child);

impl Stranger {
    pub fn start(seconds: &str) -> Stranger {
        Stranger(
            Command::new("sleep")
                .arg(seconds)
                .env_remove("KEEL_JOB_ID")
                .spawn()
                .expect("a process of no job"),
        )
    }

    pub fn pid(&self) -> u32 {
        self.0.id()
    }
}

impl Drop for Stranger {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

/// Waits for job `id` to succeed, then checks from the process table that
/// nothing marked `mark` runs, and from the worker's log that its
/// supervisor stopped the one process the worker left.
pub fn assert_succeeded_leaving_nothing(server: &ServerProcess, id: &str, mark: &str) {
    wait_for(&format!("job {id} to succeed"), || {
        (server.json(&["job", id])["state"] == "succeeded").then_some(())
    });
    assert_eq!(marked(mark), Vec::<u32>::new(), "left running");
    let log = server.cli_ok(&["logs", id]);
    assert!(
        log.contains("stopped 1 process(es) the worker left running"),
        "the escaped process was there to stop: {log}"
    );
}

/// Job `id` waits on a GPU a process of no job uses: it says `busy`
/// ("GPU 0 busy: pid P (name)"), is not failed and spent no retry, and its
/// node says the same; once `free` ran, it runs and succeeds, and the
/// node's note clears.
pub fn assert_refused_while_busy_then_run(
    server: &ServerProcess,
    id: &str,
    busy: &str,
    free: impl FnOnce(),
) {
    wait_for("the job to say the GPU is busy", || {
        server
            .json(&["job", id])
            .to_string()
            .contains(busy)
            .then_some(())
    });
    let job = server.json(&["job", id]);
    assert_ne!(job["state"], "failed", "{job}");
    assert_eq!(job["retries"], 0, "a busy GPU spends no retry: {job}");
    wait_for("the node to say the GPU is busy", || {
        server.json(&["nodes"])[0]["message"]
            .as_str()
            .is_some_and(|m| m.contains(busy))
            .then_some(())
    });
    free();
    wait_for("the job to run once the GPU is free", || {
        (server.json(&["job", id])["state"] == "succeeded").then_some(())
    });
    assert!(server.cli_ok(&["logs", id]).contains("ran"));
    wait_for("the node's note to clear", || {
        server.json(&["nodes"])[0]["message"]
            .as_str()
            .is_some_and(|m| !m.contains("busy"))
            .then_some(())
    });
}

/// Kills, when dropped, every worker still running under the executor
/// directory `0` (supervised workers outlive their servers by design, so a
/// test whose servers end leaves them otherwise): each supervisor's process
/// group, and what is left in the worker's cgroup.
pub struct WorkerReaper(pub std::path::PathBuf);

impl Drop for WorkerReaper {
    fn drop(&mut self) {
        let jobs = std::fs::read_dir(self.0.join("workers"))
            .into_iter()
            .flatten();
        for job in jobs.flatten() {
            for file in std::fs::read_dir(job.path())
                .into_iter()
                .flatten()
                .flatten()
            {
                if file.path().extension().is_none_or(|e| e != "pid") {
                    continue;
                }
                let Ok(record) = std::fs::read(file.path()) else {
                    continue;
                };
                let Ok(record) = serde_json::from_slice::<serde_json::Value>(&record) else {
                    continue;
                };
                if let Some(pid) = record["pid"].as_u64() {
                    let _ = Command::new("kill")
                        .args(["-9", "--", &format!("-{pid}")])
                        .stderr(Stdio::null())
                        .status();
                }
                if let Some(cgroup) = record["cgroup"].as_str() {
                    let _ = std::fs::write(Path::new(cgroup).join("cgroup.kill"), "1");
                    let deadline = Instant::now() + Duration::from_secs(5);
                    while std::fs::remove_dir(cgroup).is_err() && Instant::now() < deadline {
                        std::thread::sleep(Duration::from_millis(20));
                    }
                }
            }
        }
    }
}

/// Whether `program` runs here. Where it does not, says on the terminal
/// (past the harness's capture) that `test` did not run and why, so that
/// `cargo test` needs nothing but the Rust toolchain; with the environment
/// variable `require` set (CI sets it), its absence fails the test.
pub fn available_or_skip(program: &str, test: &str, require: &str) -> bool {
    let runs = Command::new(program)
        .arg("--version")
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .status()
        .is_ok();
    present_or_skip(runs, program, test, require)
}

/// [`available_or_skip`] for anything `present` says is here or not
/// (`what`: its name, as the message gives it).
pub fn present_or_skip(present: bool, what: &str, test: &str, require: &str) -> bool {
    use std::io::Write;
    if !present {
        assert!(
            std::env::var_os(require).is_none(),
            "{require} is set and {what} is not installed"
        );
        let _ = writeln!(
            std::io::stderr(),
            "SKIPPED {test}: {what} is not installed (set {require}=1 to make this a failure)"
        );
    }
    present
}

/// Where a server's log goes: the file `KEEL_TEST_SERVER_LOG` names, else
/// `DATA_DIR/test-server.log` (removed with the test's temporary
/// directory). Appended to, so a restarted server's log follows the killed
/// one's; its end is printed when a test fails.
fn server_log(data_dir: &Path) -> (std::path::PathBuf, Stdio) {
    let path = std::env::var_os("KEEL_TEST_SERVER_LOG")
        .map(std::path::PathBuf::from)
        .unwrap_or_else(|| {
            let _ = std::fs::create_dir_all(data_dir);
            data_dir.join("test-server.log")
        });
    let stdio = std::fs::OpenOptions::new()
        .create(true)
        .append(true)
        .open(&path)
        .map_or_else(|_| Stdio::null(), Stdio::from);
    (path, stdio)
}

/// The last `lines` lines of the file at `path` (empty if unreadable).
fn tail(path: &Path, lines: usize) -> String {
    let text = std::fs::read_to_string(path).unwrap_or_default();
    let all: Vec<&str> = text.lines().collect();
    all[all.len().saturating_sub(lines)..].join("\n")
}

/// `keel tls init DIR/certs`: a CA, members 1 to 3 and the client
/// `admin`; the directory.
pub fn init_certs(dir: &Path) -> std::path::PathBuf {
    let certs = dir.join("certs");
    let out = Command::new(KEEL)
        .args(["tls", "init"])
        .arg(&certs)
        .output()
        .expect("keel tls init");
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    certs
}

/// The `KEEL_TLS_*` environment of a client holding `holder`'s
/// certificate from `certs` (`client-admin`, `member-2`, ...).
pub fn tls_env(certs: &Path, holder: &str) -> Vec<(&'static str, std::ffi::OsString)> {
    vec![
        ("KEEL_TLS_CA", certs.join("ca.crt").into()),
        ("KEEL_TLS_CERT", certs.join(format!("{holder}.crt")).into()),
        ("KEEL_TLS_KEY", certs.join(format!("{holder}.key")).into()),
    ]
}

/// The flags of a replica serving as member `id` with the certificates in
/// `certs`.
pub fn tls_member_flags(certs: &Path, id: u64) -> Vec<String> {
    let file = |name: String| certs.join(name).display().to_string();
    vec![
        "--tls-cert".into(),
        file(format!("member-{id}.crt")),
        "--tls-key".into(),
        file(format!("member-{id}.key")),
        "--tls-ca".into(),
        file("ca.crt".into()),
    ]
}

/// A TLS client's transport, holding `holder`'s certificate from `certs`.
pub fn tls_client(certs: &Path, holder: &str) -> keel::transport::Transport {
    let files = keel::tls::TlsFiles {
        cert: Some(certs.join(format!("{holder}.crt"))),
        key: Some(certs.join(format!("{holder}.key"))),
        ca: certs.join("ca.crt"),
    };
    let tls = keel::tls::TlsState::load(files, keel::tls::Holder::Client).expect("client TLS");
    keel::transport::Transport::Tls(std::sync::Arc::new(tls))
}

/// A `keel server` child process on a free port, killed when dropped.
pub struct ServerProcess {
    child: Child,
    pub addr: String,
    log: std::path::PathBuf,
    /// What every [`ServerProcess::cli`] is run with (a TLS client's
    /// `KEEL_TLS_*`).
    client_env: Vec<(String, std::ffi::OsString)>,
}

impl ServerProcess {
    /// Starts `keel server --listen 127.0.0.1:0 --data-dir DIR ARGS...` and
    /// waits until it has a leader and answers.
    pub fn start(data_dir: &Path, args: &[&str]) -> ServerProcess {
        ServerProcess::start_with_env(data_dir, args, &[])
    }

    /// [`ServerProcess::start`] with `env` set for the server.
    pub fn start_with_env(
        data_dir: &Path,
        args: &[&str],
        env: &[(&str, std::ffi::OsString)],
    ) -> ServerProcess {
        ServerProcess::start_with_client_env(data_dir, args, env, &[])
    }

    /// [`ServerProcess::start_with_env`], and `client_env` set for every
    /// CLI call made through it (the wait for a leader included).
    pub fn start_with_client_env(
        data_dir: &Path,
        args: &[&str],
        env: &[(&str, std::ffi::OsString)],
        client_env: &[(&str, std::ffi::OsString)],
    ) -> ServerProcess {
        let _ = std::fs::remove_file(data_dir.join("server.addr"));
        let (log, stderr) = server_log(data_dir);
        let child = Command::new(KEEL)
            .envs(env.iter().map(|(k, v)| (k, v)))
            .args(["server", "--listen", "127.0.0.1:0", "--data-dir"])
            .arg(data_dir)
            .args(args)
            .stdout(Stdio::null())
            .env(
                "KEEL_LOG",
                std::env::var("KEEL_LOG")
                    .unwrap_or_else(|_| "info,keel_executors=debug,openraft=warn,sled=warn,chunked_wal=warn,raft_log=warn".into()),
            )
            .stderr(stderr)
            .spawn()
            .expect("spawn keel server");
        // Only a whole address: a file read while an older server wrote it
        // could hold part of one.
        let addr = wait_for("the server's address", || {
            std::fs::read_to_string(data_dir.join("server.addr"))
                .ok()
                .filter(|a| a.parse::<std::net::SocketAddr>().is_ok())
        });
        let server = ServerProcess {
            child,
            addr,
            log,
            client_env: client_env
                .iter()
                .map(|(k, v)| (k.to_string(), v.clone()))
                .collect(),
        };
        wait_for("a leader", || {
            let out = server.cli(&["cluster", "status", "-o", "json"]);
            (out.status.success() && String::from_utf8_lossy(&out.stdout).contains("\"leader\""))
                .then_some(())
        });
        server
    }

    /// What the server has logged so far.
    #[allow(dead_code)]
    pub fn log_text(&self) -> String {
        std::fs::read_to_string(&self.log).unwrap_or_default()
    }

    pub fn pid(&self) -> u32 {
        self.child.id()
    }

    pub fn cli(&self, args: &[&str]) -> Output {
        Command::new(KEEL)
            .args(args)
            .env("KEEL_ADDR", &self.addr)
            .envs(self.client_env.iter().map(|(k, v)| (k, v)))
            .output()
            .expect("run keel CLI")
    }

    pub fn cli_ok(&self, args: &[&str]) -> String {
        let out = self.cli(args);
        assert!(
            out.status.success(),
            "keel {args:?} failed: {}",
            String::from_utf8_lossy(&out.stderr)
        );
        String::from_utf8_lossy(&out.stdout).into_owned()
    }

    pub fn json(&self, args: &[&str]) -> serde_json::Value {
        let mut all = args.to_vec();
        all.extend(["-o", "json"]);
        serde_json::from_str(&self.cli_ok(&all)).expect("JSON output")
    }

    /// SIGTERM, and a clean exit within 30 s.
    pub fn terminate(mut self) {
        let pid = self.child.id().to_string();
        let status = Command::new("kill")
            .args(["-TERM", &pid])
            .status()
            .expect("kill -TERM");
        assert!(status.success());
        let deadline = Instant::now() + Duration::from_secs(30);
        loop {
            if let Some(status) = self.child.try_wait().expect("wait") {
                assert!(status.success(), "server exited with {status} on SIGTERM");
                return;
            }
            assert!(Instant::now() < deadline, "server ignored SIGTERM");
            std::thread::sleep(Duration::from_millis(20));
        }
    }

    pub fn kill9(mut self) {
        self.child.kill().expect("SIGKILL");
        self.child.wait().expect("reap");
    }
}

impl Drop for ServerProcess {
    /// Kills the server; when the test is failing, prints the end of its
    /// log (and of the servers before it on the same data directory).
    #[allow(clippy::print_stderr)]
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
        if std::thread::panicking() {
            eprintln!(
                "--- the end of the server log {} ---\n{}\n---",
                self.log.display(),
                tail(&self.log, 120)
            );
        }
    }
}

/// Polls `f` until it returns `Some`, for at most 90 s.
pub fn wait_for<T>(what: &str, mut f: impl FnMut() -> Option<T>) -> T {
    let deadline = Instant::now() + Duration::from_secs(90);
    loop {
        if let Some(v) = f() {
            return v;
        }
        assert!(Instant::now() < deadline, "timed out waiting for {what}");
        std::thread::sleep(Duration::from_millis(25));
    }
}

/// A tmpfs of its own at a path, unmounted when dropped: a small
/// filesystem for a data directory, so a test can fill it.
pub struct SmallFilesystem(std::path::PathBuf);

impl SmallFilesystem {
    /// Mounts a tmpfs of `mib` MiB at `at` (made), or says on the terminal
    /// that `test` did not run and why (mounting needs root); with
    /// `KEEL_REQUIRE_MOUNT` set (`.ci/run` sets it where it can mount),
    /// that fails the test.
    pub fn mount_or_skip(test: &str, at: &Path, mib: u32) -> Option<SmallFilesystem> {
        use std::io::Write;
        std::fs::create_dir_all(at).expect("mount point");
        let out = Command::new("mount")
            .args(["-t", "tmpfs", "-o", &format!("size={mib}m"), "tmpfs"])
            .arg(at)
            .output();
        match out {
            Ok(o) if o.status.success() => Some(SmallFilesystem(at.to_path_buf())),
            other => {
                let why = match other {
                    Ok(o) => String::from_utf8_lossy(&o.stderr).trim().to_string(),
                    Err(e) => e.to_string(),
                };
                assert!(
                    std::env::var_os("KEEL_REQUIRE_MOUNT").is_none(),
                    "KEEL_REQUIRE_MOUNT is set and a tmpfs cannot be mounted: {why}"
                );
                let _ = writeln!(
                    std::io::stderr(),
                    "SKIPPED {test}: cannot mount a tmpfs ({why}; set KEEL_REQUIRE_MOUNT=1 to make this a failure)"
                );
                None
            }
        }
    }

    pub fn path(&self) -> &Path {
        &self.0
    }
}

impl Drop for SmallFilesystem {
    fn drop(&mut self) {
        // Lazily: a process of the test may still hold a file there.
        let _ = Command::new("umount").arg("-l").arg(&self.0).status();
    }
}

/// Bytes free on the filesystem holding `path`.
pub fn free_bytes(path: &Path) -> u64 {
    keel_executors::worker_log::free_bytes(path).expect("statvfs")
}

/// A shell script that prints `mb` MB as fast as it can (100-byte lines),
/// a progress line after each MB, then a last progress line and `the-end`.
pub fn noisy_script(mb: u32) -> String {
    format!(
        "i=0; while [ $i -lt {mb} ]; do \
           yes xxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxx | head -c 1000000; \
           i=$((i+1)); echo \"KEEL_PROGRESS {{\\\"step\\\": $i, \\\"total_steps\\\": {total}}}\"; \
         done; echo \"KEEL_PROGRESS {{\\\"step\\\": {total}, \\\"total_steps\\\": {total}}}\"; echo the-end",
        total = mb + 1
    )
}

/// The bytes on disk under `dir`, and its largest file.
fn disk_use(dir: &Path) -> (u64, u64, Vec<String>) {
    let mut total = 0;
    let mut largest = 0;
    let mut names = Vec::new();
    for entry in std::fs::read_dir(dir)
        .expect("the job's log directory")
        .flatten()
    {
        let len = entry.metadata().map(|m| m.len()).unwrap_or(0);
        total += len;
        largest = largest.max(len);
        names.push(entry.file_name().to_string_lossy().to_string());
    }
    names.sort();
    (total, largest, names)
}

/// Follows job `id` (a [`noisy_script`] of 200 MB under a 5 × 1 MiB
/// rotation) with `keel logs -f` to its end, then checks that its log
/// directory `job_dir` holds at most the rotation, that the log's length
/// counts every byte and its tail is the last line, and that the last
/// progress line was recorded.
pub fn assert_noisy_job_kept_its_rotation(server: &ServerProcess, id: &str, job_dir: &Path) {
    // `keel logs -f` from the start: it follows through every rotation and
    // ends with the job.
    let follower = Command::new(KEEL)
        .args(["--addr", &server.addr, "logs", "-f", id])
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("keel logs -f");
    wait_for("the noisy job to succeed", || {
        let job = server.json(&["job", id]);
        assert_ne!(job["state"], "failed", "{job}");
        (job["state"] == "succeeded").then_some(())
    });
    let followed = follower.wait_with_output().expect("keel logs -f ends");
    assert!(followed.status.success(), "{followed:?}");
    let out = String::from_utf8_lossy(&followed.stdout);
    assert!(
        out.trim_end().ends_with("the-end"),
        "keel logs -f did not follow to the end: ...{}",
        &out[out.len().saturating_sub(300)..]
    );

    // On disk: at most 5 files of at most 1 MiB, whatever was printed.
    let (total, largest, names) = disk_use(job_dir);
    let logs: Vec<&String> = names.iter().filter(|n| n.contains(".log")).collect();
    assert!(logs.len() <= 5, "{names:?}");
    assert!(
        largest <= 1024 * 1024,
        "a file of {largest} bytes: {names:?}"
    );
    // The log's 5 MiB, the progress stream's 512 KiB, the exit record.
    assert!(
        total <= 5 * 1024 * 1024 + 512 * 1024 + 4096,
        "{total} bytes on disk: {names:?}"
    );

    // The stream's length counts every byte printed.
    let logs = server.json(&["logs", id, "--tail-bytes", "100"]);
    let printed = logs["logs"][0]["total_bytes"]
        .as_u64()
        .expect("total_bytes");
    assert!(printed > 200_000_000, "{logs}");
    assert!(
        logs["logs"][0]["content"]
            .as_str()
            .is_some_and(|c| c.ends_with("the-end\n")),
        "{logs}"
    );

    // The last progress line was recorded (it reached the log last).
    let job = server.json(&["job", id]);
    assert_eq!(job["progress"]["step"], 201, "{job}");
}

/// How many `record_node_inventory` entries the server's log holds, and how
/// many of its node entries (those and `register_node`) were refused.
#[allow(dead_code)]
pub fn node_entries(server: &ServerProcess) -> (usize, usize) {
    let mut inventories = 0;
    let mut refused = 0;
    for line in server.cli_ok(&["events", "-o", "json"]).lines() {
        let record: serde_json::Value =
            serde_json::from_str(line).expect("one JSON object per line");
        let command = record["command"].as_str().unwrap_or_default();
        if command == "record_node_inventory" {
            inventories += 1;
        }
        let node_entry = matches!(command, "register_node" | "record_node_inventory");
        if node_entry && !record["refused"].as_str().unwrap_or_default().is_empty() {
            refused += 1;
        }
    }
    (inventories, refused)
}

/// `GET path` on `addr`: the status code and the body.
pub fn get(addr: &str, path: &str) -> std::io::Result<(u16, String)> {
    get_with_headers(addr, path, "")
}

/// [`get`] with more request headers (`Name: value\r\n` each); panics
/// where the request cannot be made.
pub fn get_with(addr: &str, path: &str, headers: &str) -> (u16, String) {
    get_with_headers(addr, path, headers).expect("an HTTP answer")
}

fn get_with_headers(addr: &str, path: &str, headers: &str) -> std::io::Result<(u16, String)> {
    use std::io::{Read, Write};
    let mut stream = std::net::TcpStream::connect(addr)?;
    stream.set_read_timeout(Some(std::time::Duration::from_secs(10)))?;
    write!(
        stream,
        "GET {path} HTTP/1.1\r\nHost: {addr}\r\nConnection: close\r\n{headers}\r\n"
    )?;
    let mut response = String::new();
    stream.read_to_string(&mut response)?;
    let status = response
        .split_whitespace()
        .nth(1)
        .and_then(|s| s.parse().ok())
        .unwrap_or(0);
    let body = response
        .split_once("\r\n\r\n")
        .map(|(_, b)| b.to_string())
        .unwrap_or_default();
    Ok((status, dechunk(&body)))
}

/// A chunked HTTP/1.1 body joined (a body that is not chunked, as is).
fn dechunk(body: &str) -> String {
    let mut out = String::new();
    let mut rest = body;
    loop {
        let Some((size, after)) = rest.split_once("\r\n") else {
            return body.to_string();
        };
        let Ok(n) = usize::from_str_radix(size.trim(), 16) else {
            return body.to_string();
        };
        if n == 0 {
            return out;
        }
        let Some(chunk) = after.get(..n) else {
            return body.to_string();
        };
        out.push_str(chunk);
        rest = after.get(n + 2..).unwrap_or_default();
    }
}

/// The HTTP endpoint's address a server in `data` wrote (`http.addr`).
pub fn http_addr(data: &Path) -> String {
    wait_for("the HTTP address", || {
        std::fs::read_to_string(data.join("http.addr"))
            .ok()
            .filter(|a| a.parse::<std::net::SocketAddr>().is_ok())
    })
}

/// A one-replica server in `data` with two simulated v100s, a round every
/// 0.3 s and its HTTP endpoint on a port the system picks; and that
/// endpoint's address.
pub fn start_with_http(data: &Path) -> (ServerProcess, String) {
    let server = ServerProcess::start(
        data,
        &[
            "--simulated-gpus",
            "2xv100",
            "--round-s",
            "0.3",
            "--http-listen",
            "127.0.0.1:0",
        ],
    );
    let http = http_addr(data);
    (server, http)
}

/// The GPUs (`node/index`) whose cells in a `/api/v1/cluster` answer show
/// job `id` alone.
pub fn gpus_showing(cluster: &serde_json::Value, id: u64) -> Vec<String> {
    let nodes = cluster["nodes"].as_array().cloned().unwrap_or_default();
    nodes
        .iter()
        .flat_map(|n| {
            let name = n["name"].as_str().unwrap_or_default().to_string();
            n["gpus"]
                .as_array()
                .cloned()
                .unwrap_or_default()
                .into_iter()
                .filter(|g| g["jobs"] == serde_json::json!([id]))
                .map(move |g| format!("{name}/{}", g["index"]))
        })
        .collect()
}
