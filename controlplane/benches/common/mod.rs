//! Helpers the end-to-end benchmarks share (each bench includes this
//! module; not every one uses every helper).

#![allow(dead_code)]

use std::process::{Child, Command, Stdio};
use std::time::Duration;

/// The `keel` binary the benchmarks run.
pub const KEEL: &str = env!("CARGO_BIN_EXE_keel");

/// The `keel` binary a benchmark starts its servers from: this build's,
/// or `KEEL_BENCH_BIN`'s when set (a build of another commit, to measure
/// both in one sitting with the same harness).
pub fn server_binary() -> String {
    std::env::var("KEEL_BENCH_BIN").unwrap_or_else(|_| KEEL.to_string())
}

/// Where server `id`'s log goes: `KEEL_BENCH_LOG_DIR/keelID.log` when that
/// variable is set (appended to), else nowhere.
pub fn server_log(id: usize) -> Stdio {
    let Some(dir) = std::env::var_os("KEEL_BENCH_LOG_DIR") else {
        return Stdio::null();
    };
    std::fs::OpenOptions::new()
        .create(true)
        .append(true)
        .open(std::path::Path::new(&dir).join(format!("keel{id}.log")))
        .map_or_else(|_| Stdio::null(), Stdio::from)
}

/// A size from the environment variable `var`, or `default`.
pub fn count(var: &str, default: u64) -> u64 {
    std::env::var(var)
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(default)
}

/// A port nothing listens on now, on 127.0.0.1.
pub fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0")
        .and_then(|l| l.local_addr())
        .expect("a free port")
        .port()
}

/// The `p` quantile (0 to 1) of `sorted`, nearest rank.
pub fn percentile(sorted: &[Duration], p: f64) -> Duration {
    if sorted.is_empty() {
        return Duration::ZERO;
    }
    sorted[(((sorted.len() as f64) - 1.0) * p).round() as usize]
}

/// A `/proc/PID/status` field in kB (`VmRSS:`, `VmHWM:`), as MiB.
pub fn status_mib(pid: u32, field: &str) -> f64 {
    std::fs::read_to_string(format!("/proc/{pid}/status"))
        .ok()
        .and_then(|s| {
            s.lines()
                .find(|l| l.starts_with(field))
                .and_then(|l| l.split_whitespace().nth(1))
                .and_then(|kb| kb.parse::<f64>().ok())
        })
        .map_or(0.0, |kb| kb / 1024.0)
}

/// Three `keel server` replicas on 127.0.0.1, member `id` (1 to 3) in
/// `dir/keelID`, each started as `keel server --id ID --peers ... --listen
/// ADDR --data-dir DIR` with what `more` adds, their output discarded
/// (or kept, [`server_log`]); and their addresses.
pub fn spawn_three(
    dir: &std::path::Path,
    more: impl Fn(usize, &mut Command),
) -> (Vec<Child>, Vec<String>) {
    let addrs: Vec<String> = (0..3)
        .map(|_| format!("127.0.0.1:{}", free_port()))
        .collect();
    let peers = addrs
        .iter()
        .enumerate()
        .map(|(i, a)| format!("{}={a}", i + 1))
        .collect::<Vec<_>>()
        .join(",");
    let children = (1..=3)
        .zip(&addrs)
        .map(|(id, addr)| {
            let mut command = Command::new(server_binary());
            command
                .args(["server", "--id", &id.to_string()])
                .args(["--peers", &peers, "--listen", addr, "--data-dir"])
                .arg(dir.join(format!("keel{id}")));
            more(id, &mut command);
            command
                .stdout(Stdio::null())
                .stderr(server_log(id))
                .spawn()
                .expect("spawn keel")
        })
        .collect();
    (children, addrs)
}
