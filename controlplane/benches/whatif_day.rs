//! Issue 27's live figure: a compressed day on a three-replica cluster of
//! real `keel server` processes, then `keel whatif` on one replica's data
//! directory.
//!
//! The day: 12 simulated GPUs (4 v100, 4 p100, 4 k80 over three nodes),
//! Tiresias, a seeded stream of jobs (`KEEL_WHATIF_JOBS`, default 300)
//! arriving as a Poisson process over one simulated day, each a `keel
//! trainer` of a model of the throughput table on one or two GPUs,
//! running 5 minutes to 1 hour on a v100 at the table's speed times a
//! noise factor per job and GPUs (`--speed-noise 0.1`); one in twenty
//! fails half way, two are cancelled, and node `sim-1` is lost for a
//! while. Trainers run `KEEL_WHATIF_SPEEDUP` (default 720) simulated
//! seconds per second, so the day takes about two minutes.
//!
//! Then `keel whatif --policy recorded,fifo,srjf,optimus` on replica 1's
//! data directory: the error of the recorded run on what happened, and
//! the other policies' figures.
//!
//! Run: `cargo bench -p keel --bench whatif_day` (`KEEL_WHATIF_KEEP=DIR`
//! keeps a copy of the data directory).

#![allow(clippy::print_stdout)]

use std::path::Path;
use std::process::Command;
use std::time::{Duration, Instant};

use keel_scheduling::throughput;
use keel_state::rng::SplitMix64;

mod common;

use common::{count, spawn_three, KEEL};

const DAY_S: f64 = 86_400.0;

/// `keel ARGS` against the cluster; its standard output.
fn keel(addrs: &str, args: &[&str]) -> Option<String> {
    let out = Command::new(KEEL)
        .env("KEEL_ADDR", addrs)
        .args(args)
        .output()
        .ok()?;
    out.status
        .success()
        .then(|| String::from_utf8_lossy(&out.stdout).into_owned())
}

fn json(addrs: &str, args: &[&str]) -> Option<serde_json::Value> {
    let mut args = args.to_vec();
    args.extend(["-o", "json"]);
    serde_json::from_str(&keel(addrs, &args)?).ok()
}

/// One job of the day: when it arrives (simulated seconds) and its spec.
struct DayJob {
    at_s: f64,
    spec: String,
}

fn day(jobs: usize, speedup: f64, seed: u64) -> Vec<DayJob> {
    let mut rng = SplitMix64::new(seed);
    let models: Vec<&throughput::ModelProfile> = throughput::PROFILES
        .iter()
        .filter(|p| p.model != throughput::GENERIC_MODEL)
        .collect();
    let mut at_s = 0.0;
    let mut out = Vec::with_capacity(jobs);
    for i in 0..jobs {
        // Poisson arrivals, `jobs` a day on average.
        at_s += -(1.0 - rng.unit()).ln() * DAY_S / jobs as f64;
        let model = models[(rng.unit() * models.len() as f64) as usize % models.len()];
        // The simulated nodes hold at most two GPUs of a type.
        let gpus = if rng.unit() < 0.75 { 1 } else { 2 };
        // 5 minutes to 1 hour on v100s, log-uniform: the cluster busy
        // most of the day, not saturated.
        let duration_s = 300.0 * 12f64.powf(rng.unit());
        let total_steps = (duration_s * model.steps_per_s("v100", gpus)).max(1.0) as u64;
        let fails = rng.unit() < 0.05;
        let mut command = format!(
            "[keel, trainer, --speedup, \"{speedup}\", --report-every-s, \"0.5\", --speed-noise, \"0.1\""
        );
        if fails {
            command.push_str(&format!(", --fail-at-step, \"{}\"", total_steps / 2));
        }
        command.push(']');
        out.push(DayJob {
            at_s,
            spec: format!(
                "name: day-{i}\nuser: day\ncommand: {command}\ngpus: {gpus}\nworkers: 1\n\
                 model: {}\ntotal_steps: {total_steps}\nmax_retries: 0\n",
                model.model
            ),
        });
    }
    out
}

fn terminal(state: &str) -> bool {
    matches!(state, "succeeded" | "failed" | "cancelled")
}

fn main() {
    let jobs = count("KEEL_WHATIF_JOBS", 300) as usize;
    let speedup = count("KEEL_WHATIF_SPEEDUP", 720) as f64;
    let dir = tempfile::tempdir().expect("tempdir");
    let shared = dir.path().join("shared");
    let (mut children, addrs) = spawn_three(dir.path(), |_, c| {
        c.args(["--executor-dir"])
            .arg(&shared)
            .args(["--simulated-gpus", "4xv100,4xp100,4xk80"])
            .args(["--simulated-nodes", "3", "--policy", "tiresias"])
            .args(["--progress-interval-s", "1", "--round-s", "10"]);
    });
    let addrs = addrs.join(",");
    let wait = |what: &str, f: &dyn Fn() -> bool| {
        let until = Instant::now() + Duration::from_secs(60);
        while !f() {
            assert!(Instant::now() < until, "{what} did not happen in 60 s");
            std::thread::sleep(Duration::from_millis(200));
        }
    };
    wait("three nodes", &|| {
        json(&addrs, &["nodes"])
            .and_then(|n| n.as_array().map(Vec::len))
            .is_some_and(|n| n == 3)
    });
    let specs = dir.path().join("specs");
    std::fs::create_dir_all(&specs).expect("specs dir");
    let stream = day(jobs, speedup, 27);
    let started = Instant::now();
    let lost_at = Duration::from_secs_f64(DAY_S / 3.0 / speedup);
    let back_at = Duration::from_secs_f64(DAY_S / 2.0 / speedup);
    let (mut lost, mut back) = (false, false);
    let mut ids = Vec::new();
    println!(
        "a day of {jobs} jobs at {speedup}x: {:.0} s of arrivals",
        stream.last().map_or(0.0, |j| j.at_s) / speedup
    );
    for (i, job) in stream.iter().enumerate() {
        let due = Duration::from_secs_f64(job.at_s / speedup);
        if let Some(left) = due.checked_sub(started.elapsed()) {
            std::thread::sleep(left);
        }
        if !lost && started.elapsed() >= lost_at {
            keel(&addrs, &["node", "lost", "sim-1"]).expect("mark sim-1 lost");
            lost = true;
        }
        if lost && !back && started.elapsed() >= back_at {
            keel(&addrs, &["node", "alive", "sim-1"]).expect("mark sim-1 alive");
            back = true;
        }
        let path = specs.join(format!("{i}.yaml"));
        std::fs::write(&path, &job.spec).expect("write spec");
        let submitted =
            json(&addrs, &["submit", "-f", path.to_str().expect("utf-8")]).expect("submit");
        let id = submitted["id"].as_u64().expect("id");
        ids.push(id);
        // Two jobs cancelled by their users a little after they came.
        if i == jobs / 4 || i == jobs / 2 {
            let victim = ids[i.saturating_sub(3)].to_string();
            let _ = keel(&addrs, &["cancel", &victim]);
        }
    }
    if !back {
        keel(&addrs, &["node", "alive", "sim-1"]).expect("mark sim-1 alive");
    }
    let until = Instant::now() + Duration::from_secs(1800);
    loop {
        let done = json(&addrs, &["jobs"])
            .and_then(|j| {
                j.as_array().map(|all| {
                    all.len() == jobs
                        && all
                            .iter()
                            .all(|j| terminal(j["state"].as_str().unwrap_or("")))
                })
            })
            .unwrap_or(false);
        if done {
            break;
        }
        assert!(Instant::now() < until, "the day did not end in 30 minutes");
        std::thread::sleep(Duration::from_secs(1));
    }
    println!(
        "the day ended after {:.0} s",
        started.elapsed().as_secs_f64()
    );
    for child in &children {
        let _ = Command::new("kill")
            .args(["-TERM", &child.id().to_string()])
            .status();
    }
    for child in &mut children {
        let _ = child.wait();
    }
    let data = dir.path().join("keel1");
    whatif(&data);
    // Kept for a closer look when asked (`KEEL_WHATIF_KEEP=DIR`).
    if let Ok(keep) = std::env::var("KEEL_WHATIF_KEEP") {
        let status = Command::new("cp")
            .args(["-a"])
            .arg(&data)
            .arg(&keep)
            .status();
        println!("data directory copied to {keep}: {status:?}");
    }
}

fn whatif(data: &Path) {
    let run = |output: &[&str]| {
        let out = Command::new(KEEL)
            .args(["whatif", "--policy", "recorded,fifo,srjf,optimus"])
            .args(["--round-s", "10", "--progress-interval-s", "1"])
            .args(output)
            .arg("--data-dir")
            .arg(data)
            .output()
            .expect("run keel whatif");
        assert!(
            out.status.success(),
            "{}",
            String::from_utf8_lossy(&out.stderr)
        );
        out.stdout
    };
    let started = Instant::now();
    let table = run(&[]);
    let wall_s = started.elapsed().as_secs_f64();
    println!("{}", String::from_utf8_lossy(&table));
    println!("keel whatif took {wall_s:.2} s");
    let first = run(&["-o", "json"]);
    let second = run(&["-o", "json"]);
    println!(
        "the same history twice: {}",
        if first == second {
            "the same bytes"
        } else {
            "DIFFERENT bytes"
        }
    );
    let report: serde_json::Value = serde_json::from_slice(&first).expect("JSON");
    println!("validation: {}", report["validation"]);
}
