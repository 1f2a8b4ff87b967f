//! The simulated trainer: behaves like a training job without a GPU.
//!
//! It learns its allocation from the worker contract (GPU type, GPUs per
//! worker, world size, rank, checkpoint directory), advances at the speed the
//! project's throughput table gives for its model on that hardware (times
//! `speedup`, so simulated hours pass in seconds), prints progress lines with
//! a loss falling along Optimus's curve `1/(b0·k + b1) + b2` (with seeded
//! noise), checkpoints its step (periodically and on SIGTERM) and resumes
//! from the checkpoint when relaunched. It can be told to fail at a step,
//! or to hold at a step until a file exists (a run that waits for a test or
//! a demo to let it finish, instead of one sized to outlast it).
//!
//! Exit codes: 0 when all steps are done, 143 after a SIGTERM checkpoint,
//! `exit_code` (default 1) when told to fail, 2 on bad configuration.

use std::io::Write;
use std::path::{Path, PathBuf};
use std::time::Duration;

use keel_scheduling::throughput::{profile, LossCurve};
use keel_state::rng::SplitMix64;
use serde::{Deserialize, Serialize};
use tokio::signal::unix::{signal, SignalKind};

use crate::contract::{EXIT_STOPPED, PROGRESS_MARKER};

/// How the trainer is configured (flags, falling back on the contract's
/// environment variables).
#[derive(Debug, Clone, PartialEq)]
pub struct TrainerOptions {
    pub model: String,
    pub total_steps: u64,
    /// Simulated seconds per wall-clock second.
    pub speedup: f64,
    /// Exit with `exit_code` on reaching this step (counts from the start
    /// of the job, across relaunches).
    pub fail_at_step: Option<u64>,
    pub exit_code: i32,
    /// Wall-clock seconds between progress lines.
    pub report_every_s: f64,
    /// Checkpoint every this many steps (and always on SIGTERM and at the end).
    pub checkpoint_every_steps: u64,
    pub gpu_type: String,
    /// GPUs of the whole job (GPUs per worker × world size).
    pub gpus: u32,
    pub rank: u32,
    pub checkpoint_dir: Option<PathBuf>,
    pub seed: u64,
    /// Space sharing: the model of the job on the same GPUs. A simulated
    /// GPU is shared as the table's interference model says
    /// ([`keel_scheduling::throughput::ModelProfile::shared_fraction`]).
    pub shared_with_model: Option<String>,
    /// Hold at this step (reporting it) until the file exists, then go on.
    /// A relaunch that resumes at or before the step holds there again.
    pub hold: Option<Hold>,
    /// The run's speed is the table's times a factor drawn once in
    /// `1 ± speed_noise`, seeded by the job, its GPU type and size: the
    /// same job on the same GPUs always gets the same factor.
    pub speed_noise: f64,
}

/// `keel trainer`'s flags, each falling back on the worker contract's
/// environment where it has one. The real trainer reads them from its
/// command line; a hollow worker ([`crate::hollow`]) from its job's
/// command, with the contract's values given as flags.
#[derive(clap::Parser, Debug, Clone, PartialEq)]
#[command(name = "keel trainer", args_override_self = true)]
pub struct TrainerArgs {
    /// Model (throughput table row).
    #[arg(long, env = "KEEL_MODEL", default_value = keel_scheduling::throughput::GENERIC_MODEL)]
    pub model: String,
    /// Steps to train.
    #[arg(long, env = "KEEL_TOTAL_STEPS", default_value_t = 1000)]
    pub total_steps: u64,
    /// Simulated seconds per real second.
    #[arg(long, default_value_t = 1.0)]
    pub speedup: f64,
    /// Fail (exit with --exit-code) on reaching this step.
    #[arg(long)]
    pub fail_at_step: Option<u64>,
    #[arg(long, default_value_t = 1)]
    pub exit_code: i32,
    /// Hold at this step (still reporting it) until --hold-until-file
    /// exists: a run that waits for you rather than one sized to outlast
    /// you.
    #[arg(long, requires = "hold_until_file")]
    pub hold_at_step: Option<u64>,
    /// The file that lets a run held at --hold-at-step go on.
    #[arg(long, requires = "hold_at_step")]
    pub hold_until_file: Option<PathBuf>,
    /// Seconds between progress lines.
    #[arg(long, default_value_t = 1.0)]
    pub report_every_s: f64,
    /// Checkpoint every this many steps (default: a tenth of the run).
    #[arg(long)]
    pub checkpoint_every_steps: Option<u64>,
    // The worker contract's environment (README, "The worker contract"),
    // each also a flag.
    /// GPU type of this worker's GPUs.
    #[arg(long, env = "KEEL_GPU_TYPE", default_value = "v100")]
    pub gpu_type: String,
    /// GPUs per worker.
    #[arg(long, env = "KEEL_GPUS_PER_WORKER", default_value_t = 1)]
    pub gpus_per_worker: u32,
    /// Workers of the job.
    #[arg(long, env = "KEEL_WORLD_SIZE", default_value_t = 1)]
    pub world_size: u32,
    /// This worker's rank.
    #[arg(long, env = "KEEL_RANK", default_value_t = 0)]
    pub rank: u32,
    /// Where checkpoints go (none: no checkpoints).
    #[arg(long, env = "KEEL_CHECKPOINT_DIR")]
    pub checkpoint_dir: Option<PathBuf>,
    /// Space sharing: the model of the job on the same GPUs.
    #[arg(long, env = "KEEL_SHARED_WITH_MODEL")]
    pub shared_with_model: Option<String>,
    /// Space sharing: the job on the same GPUs (its model, when not given,
    /// counts as the generic one).
    #[arg(long, env = "KEEL_SHARED_WITH_JOB")]
    pub shared_with_job: Option<u64>,
    /// The job's id (seeds the simulated loss curve and the speed noise).
    #[arg(long, env = "KEEL_JOB_ID", default_value_t = 0)]
    pub job_id: u64,
    /// Run at the table's speed times a factor in 1 ± this (0 to 0.9),
    /// drawn once per job, GPU type and size: jobs of one model that do
    /// not run alike.
    #[arg(long, default_value_t = 0.0)]
    pub speed_noise: f64,
}

impl TrainerArgs {
    /// The trainer's options these flags ask for.
    pub fn options(self) -> TrainerOptions {
        TrainerOptions {
            model: self.model,
            total_steps: self.total_steps,
            speedup: self.speedup,
            fail_at_step: self.fail_at_step,
            exit_code: self.exit_code,
            report_every_s: self.report_every_s,
            checkpoint_every_steps: self
                .checkpoint_every_steps
                .unwrap_or((self.total_steps / 10).max(1)),
            gpu_type: self.gpu_type,
            gpus: self.gpus_per_worker.saturating_mul(self.world_size),
            rank: self.rank,
            checkpoint_dir: self.checkpoint_dir,
            shared_with_model: self.shared_with_model.or_else(|| {
                self.shared_with_job
                    .map(|_| keel_scheduling::throughput::GENERIC_MODEL.into())
            }),
            seed: self.job_id,
            hold: self
                .hold_at_step
                .zip(self.hold_until_file)
                .map(|(at_step, until_file)| Hold {
                    at_step,
                    until_file,
                }),
            speed_noise: self.speed_noise,
        }
    }
}

/// A step the trainer stops at until a file exists.
#[derive(Debug, Clone, PartialEq)]
pub struct Hold {
    pub at_step: u64,
    pub until_file: PathBuf,
}

/// Where the run is: steps advance with the wall clock from an origin, and
/// stop at a hold until its file exists (the origin then moves there).
struct Pace {
    origin: tokio::time::Instant,
    origin_step: u64,
    steps_per_wall_s: f64,
    total_steps: u64,
    hold: Option<Hold>,
}

impl Pace {
    fn step(&mut self) -> u64 {
        let run = (self.origin.elapsed().as_secs_f64() * self.steps_per_wall_s) as u64;
        let step = (self.origin_step + run).min(self.total_steps);
        let Some(hold) = &self.hold else {
            return step;
        };
        if step < hold.at_step {
            return step;
        }
        let at = hold.at_step;
        if hold.until_file.exists() {
            self.origin = tokio::time::Instant::now();
            self.origin_step = at;
            self.hold = None;
        }
        at
    }

    /// The next step the run stops at on its own: the end or the hold.
    fn next_stop(&self) -> u64 {
        self.hold
            .as_ref()
            .map_or(self.total_steps, |h| h.at_step.min(self.total_steps))
    }
}

#[derive(Debug, thiserror::Error)]
pub enum TrainerError {
    #[error("checkpoint {path}: {source}")]
    Checkpoint {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    #[error("writing progress: {0}")]
    Output(#[source] std::io::Error),
    #[error("installing the SIGTERM handler: {0}")]
    Signal(#[source] std::io::Error),
    #[error("{0}")]
    Config(String),
}

#[derive(Debug, Serialize, Deserialize)]
struct Checkpoint {
    step: u64,
    model: String,
}

const CHECKPOINT_FILE: &str = "keel-trainer.json";

/// The step a checkpoint directory holds (0: none yet).
pub(crate) fn read_checkpoint(dir: &Path) -> Result<u64, TrainerError> {
    let path = dir.join(CHECKPOINT_FILE);
    match std::fs::read(&path) {
        Ok(bytes) => serde_json::from_slice::<Checkpoint>(&bytes)
            .map(|c| c.step)
            .map_err(|e| TrainerError::Checkpoint {
                path,
                source: std::io::Error::new(std::io::ErrorKind::InvalidData, e),
            }),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(0),
        Err(source) => Err(TrainerError::Checkpoint { path, source }),
    }
}

/// Writes `step` as the checkpoint in `dir`, durably.
pub(crate) fn write_checkpoint(dir: &Path, step: u64, model: &str) -> Result<(), TrainerError> {
    let path = dir.join(CHECKPOINT_FILE);
    let err = |source| TrainerError::Checkpoint {
        path: path.clone(),
        source,
    };
    let body = serde_json::to_vec(&Checkpoint {
        step,
        model: model.to_string(),
    })
    .map_err(|e| err(std::io::Error::other(e)))?;
    // Whole or not at all, durably: a synced temporary file renamed over
    // the last checkpoint, the directory synced.
    let mut file = atomic_write_file::AtomicWriteFile::open(&path).map_err(err)?;
    file.write_all(&body).map_err(err)?;
    file.commit().map_err(err)
}

impl TrainerOptions {
    /// Refuses options no run can follow (what the real and the hollow
    /// trainer both check).
    pub fn check(&self) -> Result<(), TrainerError> {
        if !(self.speedup.is_finite() && self.speedup > 0.0) {
            return Err(TrainerError::Config(format!(
                "--speedup must be a positive number, not {}",
                self.speedup
            )));
        }
        if self.total_steps == 0 {
            return Err(TrainerError::Config(
                "--total-steps must be at least 1".into(),
            ));
        }
        if !(0.0..=0.9).contains(&self.speed_noise) {
            return Err(TrainerError::Config(format!(
                "--speed-noise must be between 0 and 0.9, not {}",
                self.speed_noise
            )));
        }
        Ok(())
    }

    /// Steps per simulated second on its GPUs: the table's speed for its
    /// model, GPU type and size, less what sharing costs, times its noise
    /// factor.
    pub fn steps_per_s(&self) -> f64 {
        let model = profile(&self.model);
        let gpus = self.gpus.max(1);
        let shared = self
            .shared_with_model
            .as_deref()
            .map_or(1.0, |m| model.shared_fraction(profile(m)));
        model.steps_per_s(&self.gpu_type, gpus) * shared * self.speed_factor()
    }

    /// The factor in `1 ± speed_noise` of this job on these GPUs.
    fn speed_factor(&self) -> f64 {
        if self.speed_noise <= 0.0 {
            return 1.0;
        }
        let mut seed = self.seed ^ u64::from(self.gpus.max(1)).rotate_left(32);
        for byte in self.gpu_type.bytes() {
            seed = seed.rotate_left(8) ^ u64::from(byte);
        }
        let mut rng = SplitMix64::new(seed);
        1.0 + self.speed_noise * (2.0 * rng.unit() - 1.0)
    }
}

/// Runs the trainer to its end. Returns the process exit code.
pub async fn run(opts: TrainerOptions, out: &mut (dyn Write + Send)) -> Result<i32, TrainerError> {
    opts.check()?;
    let mut sigterm = signal(SignalKind::terminate()).map_err(TrainerError::Signal)?;
    let leader = opts.rank == 0;
    let start_step = match &opts.checkpoint_dir {
        Some(dir) => read_checkpoint(dir)?.min(opts.total_steps),
        None => 0,
    };
    let profile = profile(&opts.model);
    let gpus = opts.gpus.max(1);
    let shared = opts.shared_with_model.as_deref().map_or(1.0, |m| {
        profile.shared_fraction(keel_scheduling::throughput::profile(m))
    });
    let steps_per_wall_s = opts.steps_per_s() * opts.speedup;
    let samples_per_s = profile.samples_per_s(&opts.gpu_type, gpus) * shared;
    let curve = LossCurve::for_run(2.5, 0.1, opts.total_steps);
    let mut rng = SplitMix64::new(opts.seed);
    let mut noise = move |amplitude: f64| 1.0 + amplitude * (2.0 * rng.unit() - 1.0);
    if leader {
        writeln!(
            out,
            "keel trainer: {} on {gpus}x{} at {:.2} steps/s (x{} speed-up), from step {start_step} of {}",
            profile.model,
            opts.gpu_type,
            steps_per_wall_s / opts.speedup,
            opts.speedup,
            opts.total_steps
        )
        .map_err(TrainerError::Output)?;
    }
    let mut pace = Pace {
        origin: tokio::time::Instant::now(),
        origin_step: start_step,
        steps_per_wall_s,
        total_steps: opts.total_steps,
        hold: opts.hold.clone().filter(|h| h.at_step >= start_step),
    };
    let mut last_checkpoint = start_step;
    let report_every = Duration::from_secs_f64(opts.report_every_s.max(0.01));
    loop {
        let step = pace.step();
        if let Some(fail) = opts.fail_at_step {
            if step >= fail && start_step < fail {
                writeln!(out, "keel trainer: failing at step {step} as asked")
                    .map_err(TrainerError::Output)?;
                return Ok(opts.exit_code);
            }
        }
        if leader {
            let loss = curve.loss(step) * noise(0.03);
            writeln!(
                out,
                "{PROGRESS_MARKER}{}",
                serde_json::json!({
                    "step": step,
                    "total_steps": opts.total_steps,
                    "loss": (loss * 1e4).round() / 1e4,
                    "samples_per_s": (samples_per_s * noise(0.02) * 10.0).round() / 10.0,
                })
            )
            .map_err(TrainerError::Output)?;
            out.flush().map_err(TrainerError::Output)?;
            if let Some(dir) = &opts.checkpoint_dir {
                let due = step >= last_checkpoint + opts.checkpoint_every_steps.max(1);
                if due || step == opts.total_steps {
                    write_checkpoint(dir, step, profile.model)?;
                    last_checkpoint = step;
                }
            }
        }
        if step >= opts.total_steps {
            return Ok(0);
        }
        // Sleep until the next report, the end or hold, or the failure step.
        let mut target = pace.next_stop().max(step);
        if let Some(fail) = opts.fail_at_step.filter(|f| *f > step) {
            target = target.min(fail);
        }
        let until_target = match target - step {
            // Held: look for the file at every report.
            0 => report_every,
            steps => Duration::from_secs_f64(steps as f64 / steps_per_wall_s),
        };
        let nap = report_every.min(until_target + Duration::from_millis(1));
        tokio::select! {
            _ = tokio::time::sleep(nap) => {}
            _ = sigterm.recv() => {
                let step = pace.step();
                if leader {
                    if let Some(dir) = &opts.checkpoint_dir {
                        write_checkpoint(dir, step, profile.model)?;
                    }
                    writeln!(out, "keel trainer: SIGTERM at step {step}; checkpointed, exiting")
                        .map_err(TrainerError::Output)?;
                }
                return Ok(EXIT_STOPPED);
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn opts(dir: &Path) -> TrainerOptions {
        TrainerOptions {
            model: "resnet50".into(),
            total_steps: 200,
            speedup: 1000.0,
            fail_at_step: None,
            exit_code: 1,
            report_every_s: 0.01,
            checkpoint_every_steps: 50,
            gpu_type: "v100".into(),
            gpus: 1,
            rank: 0,
            checkpoint_dir: Some(dir.to_path_buf()),
            seed: 1,
            shared_with_model: None,
            hold: None,
            speed_noise: 0.0,
        }
    }

    #[tokio::test]
    async fn runs_to_the_end_with_falling_loss_and_checkpoints() {
        let dir = tempfile::tempdir().expect("tempdir");
        let mut out = Vec::new();
        let code = run(opts(dir.path()), &mut out).await.expect("runs");
        assert_eq!(code, 0);
        let text = String::from_utf8(out).expect("utf8");
        let samples: Vec<keel_state::ProgressSample> = text
            .lines()
            .filter_map(|l| crate::contract::parse_progress_line(l, 0))
            .collect();
        assert!(samples.len() >= 2, "{text}");
        let last = samples.last().expect("a sample");
        assert_eq!((last.step, last.total_steps), (200, 200));
        assert!(last.loss < samples[0].loss, "{text}");
        assert_eq!(read_checkpoint(dir.path()).expect("checkpoint"), 200);
    }

    #[tokio::test]
    async fn fails_when_asked_and_resumes_past_the_failure_from_its_checkpoint() {
        let dir = tempfile::tempdir().expect("tempdir");
        let mut o = opts(dir.path());
        // About 2 steps per progress line, so it checkpoints on the way.
        o.speedup = 20.0;
        o.fail_at_step = Some(120);
        o.exit_code = 7;
        o.checkpoint_every_steps = 10;
        let code = run(o.clone(), &mut Vec::new()).await.expect("runs");
        assert_eq!(code, 7);
        let saved = read_checkpoint(dir.path()).expect("checkpoint");
        assert!(saved > 0 && saved < 120, "checkpoint at {saved}");
        // The relaunch starts from the checkpoint, before the failure step,
        // so it reaches it and fails again.
        let mut out = Vec::new();
        let code = run(o, &mut out).await.expect("runs");
        let text = String::from_utf8(out).expect("utf8");
        assert!(text.contains(&format!("from step {saved}")), "{text}");
        assert_eq!(code, 7, "{text}");
    }

    /// On tokio's paused clock: ten seconds pass (the run would be over in
    /// a fraction of one) and it is still at its hold; the file lets it end.
    #[tokio::test(start_paused = true)]
    async fn holds_at_its_step_until_the_file_exists() {
        let dir = tempfile::tempdir().expect("tempdir");
        let release = dir.path().join("release");
        let mut o = opts(dir.path());
        o.hold = Some(Hold {
            at_step: 100,
            until_file: release.clone(),
        });
        let run = tokio::spawn(async move {
            let mut out = Vec::new();
            let code = run(o, &mut out).await;
            (code, out)
        });
        tokio::time::sleep(Duration::from_secs(10)).await;
        assert!(!run.is_finished(), "it waits for the file");
        assert_eq!(read_checkpoint(dir.path()).expect("checkpoint"), 100);
        std::fs::write(&release, b"").expect("release");
        let (code, out) = run.await.expect("joins");
        assert_eq!(code.expect("runs"), 0);
        let text = String::from_utf8(out).expect("utf8");
        let steps: Vec<u64> = text
            .lines()
            .filter_map(|l| crate::contract::parse_progress_line(l, 0))
            .map(|s| s.step)
            .collect();
        assert!(steps.iter().filter(|s| **s == 100).count() > 1, "{text}");
        assert_eq!(steps.last(), Some(&200), "{text}");
    }

    #[test]
    fn speed_noise_draws_one_factor_per_job_and_gpus_within_its_bound() {
        let dir = Path::new("/nonexistent");
        let table = opts(dir).steps_per_s();
        assert_eq!(
            table,
            profile("resnet50").steps_per_s("v100", 1),
            "no noise: the table"
        );
        let noisy = |seed: u64, gpu_type: &str| {
            let mut o = opts(dir);
            o.speed_noise = 0.2;
            o.seed = seed;
            o.gpu_type = gpu_type.into();
            o.steps_per_s() / profile("resnet50").steps_per_s(gpu_type, 1)
        };
        let factors: Vec<f64> = (0..50).map(|job| noisy(job, "v100")).collect();
        assert!(
            factors.iter().all(|f| (0.8..=1.2).contains(f)),
            "{factors:?}"
        );
        assert_eq!(
            factors[7],
            noisy(7, "v100"),
            "the same job, the same factor"
        );
        assert_ne!(noisy(7, "v100"), noisy(7, "k80"), "another GPU type");
        let spread = factors.iter().cloned().fold(f64::NAN, f64::max)
            - factors.iter().cloned().fold(f64::NAN, f64::min);
        assert!(spread > 0.2, "the jobs differ: {factors:?}");
        let mut bad = opts(dir);
        bad.speed_noise = 1.5;
        assert!(bad.check().is_err());
    }
}
