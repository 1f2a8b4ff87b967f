//! The worker contract: what a training process is told, and how it talks
//! back.
//!
//! Every executor gives a worker the same environment ([`environment`]) and
//! reads the same progress lines ([`parse_progress_line`]). The README's
//! "Worker contract" section documents both for users.

use std::collections::BTreeMap;

use keel_state::{GpuRef, JobId, ProgressSample};
use serde::Deserialize;

use crate::WorkerId;

/// The prefix of a progress line on a worker's stdout, followed by one JSON
/// object: `KEEL_PROGRESS {"step": 120, "total_steps": 1000, "loss": 0.71,
/// "samples_per_s": 350.0}`.
pub const PROGRESS_MARKER: &str = "KEEL_PROGRESS ";

/// The longest progress line read (longer lines are ordinary log output).
pub const PROGRESS_LINE_MAX_LEN: usize = 4096;

/// Progress samples an executor buffers per job before the reconcile loop
/// takes them; older ones are dropped beyond this (the latest matter most).
pub const PROGRESS_BUFFER_MAX: usize = 1024;

/// Adds a job's new progress samples to an executor's buffer, dropping the
/// oldest beyond [`PROGRESS_BUFFER_MAX`].
pub fn buffer_progress(
    buffers: &mut BTreeMap<JobId, Vec<ProgressSample>>,
    job_id: JobId,
    samples: impl IntoIterator<Item = ProgressSample>,
) {
    let buf = buffers.entry(job_id).or_default();
    buf.extend(samples);
    if buf.len() > PROGRESS_BUFFER_MAX {
        let excess = buf.len() - PROGRESS_BUFFER_MAX;
        buf.drain(..excess);
    }
}

/// Variables of the server's environment a worker must not inherit: the
/// operators' secret key (`keel::secret_keys`).
pub const SERVER_ONLY_ENV: [&str; 1] = ["KEEL_SECRET_KEY"];

/// Exit code a worker uses when it stopped on SIGTERM after checkpointing.
pub const EXIT_STOPPED: i32 = 143;

/// Everything an executor needs to start one worker.
#[derive(Debug, Clone, PartialEq)]
pub struct WorkerLaunch {
    pub id: WorkerId,
    pub job_name: String,
    /// argv of the worker (for a container: its command, replacing the
    /// image's entrypoint when not empty).
    pub command: Vec<String>,
    /// The container image, for executors that run containers.
    pub image: Option<String>,
    /// The user's environment from the spec (the contract's variables win).
    pub env: BTreeMap<String, String>,
    /// The variables the spec takes from secrets (issue 35), sealed; the
    /// leader opens them just before the launch ([`SecretEnv::value`]).
    pub secret_env: BTreeMap<String, SecretEnv>,
    pub node: String,
    /// GPU indexes on `node` (what `CUDA_VISIBLE_DEVICES` lists).
    pub gpus: Vec<u32>,
    pub gpu_type: String,
    pub world_size: u32,
    /// This worker's position among the job's workers on the same node.
    pub local_rank: u32,
    /// Workers of the job on this node.
    pub local_world_size: u32,
    /// Address of rank 0's node, where the rendezvous listens.
    pub rendezvous_addr: String,
    pub model: Option<String>,
    pub total_steps: Option<u64>,
    /// Space sharing: the job whose workers run on the same GPUs at the
    /// same time, and its model.
    pub shared_with: Option<SharedWith>,
    /// The worker's CPU and memory limits (the job's `resources`).
    pub resources: keel_state::spec::Resources,
    /// How the job asks its workers' logs to be rotated (within the
    /// server's maximum).
    pub logs: keel_state::spec::LogLimits,
    /// The trace the job's submission belongs to (a W3C `traceparent`),
    /// for the span of this launch (issue 24).
    pub trace_parent: Option<String>,
}

/// A variable taken from a secret. Its `Debug` shows where from, never the
/// value.
#[derive(Clone, PartialEq, Eq)]
pub struct SecretEnv {
    pub reference: keel_state::secret::SecretRef,
    /// The sealed value, as the state holds it (`None`: the secret or its
    /// key is gone).
    pub sealed: Option<keel_state::secret::SealedValue>,
    /// The value, once opened by the leader's launch.
    pub value: Option<String>,
}

impl std::fmt::Debug for SecretEnv {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "<secret {}{}>",
            self.reference,
            if self.value.is_some() { ", opened" } else { "" }
        )
    }
}

/// The partner of a worker whose GPUs are shared (space sharing).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SharedWith {
    pub job_id: JobId,
    pub model: Option<String>,
}

#[cfg(test)]
impl WorkerLaunch {
    /// A one-worker launch of `command` on `node`'s `gpus` (v100s), for the
    /// executors' tests.
    pub(crate) fn for_test(
        id: WorkerId,
        node: &str,
        gpus: Vec<u32>,
        command: &[&str],
    ) -> WorkerLaunch {
        WorkerLaunch {
            id,
            job_name: "t".into(),
            command: command.iter().map(|s| s.to_string()).collect(),
            image: None,
            env: BTreeMap::new(),
            secret_env: BTreeMap::new(),
            node: node.into(),
            gpus,
            gpu_type: "v100".into(),
            world_size: 1,
            local_rank: 0,
            local_world_size: 1,
            rendezvous_addr: "127.0.0.1".into(),
            model: None,
            total_steps: None,
            shared_with: None,
            resources: Default::default(),
            logs: Default::default(),
            trace_parent: None,
        }
    }
}

/// GPUs `indexes` of `node`, as the reconciler compares them.
pub fn gpu_refs(node: &str, indexes: impl IntoIterator<Item = u32>) -> Vec<GpuRef> {
    indexes
        .into_iter()
        .map(|index| GpuRef {
            node: node.to_string(),
            index,
        })
        .collect()
}

/// The job's checkpoint directory name under an executor's checkpoint root.
/// Shared by every epoch and rank, so a relaunched job resumes.
pub fn checkpoint_dir_name(job_id: JobId) -> String {
    format!("job-{job_id}")
}

/// The environment of a worker: the user's variables, then the contract's.
/// `rendezvous_port` and `checkpoint_dir` are chosen by the executor.
pub fn environment(
    launch: &WorkerLaunch,
    rendezvous_port: u16,
    checkpoint_dir: &str,
) -> BTreeMap<String, String> {
    let mut env = launch.env.clone();
    for (name, secret) in &launch.secret_env {
        if let Some(value) = &secret.value {
            env.insert(name.clone(), value.clone());
        }
    }
    let gpus = launch
        .gpus
        .iter()
        .map(u32::to_string)
        .collect::<Vec<_>>()
        .join(",");
    let id = &launch.id;
    let mut set = |k: &str, v: String| {
        env.insert(k.to_string(), v);
    };
    set("CUDA_VISIBLE_DEVICES", gpus);
    set("KEEL_JOB_ID", id.job_id.to_string());
    set("KEEL_JOB_NAME", launch.job_name.clone());
    set("KEEL_ALLOCATION_EPOCH", id.epoch.to_string());
    set("KEEL_RANK", id.rank.to_string());
    set("KEEL_LOCAL_RANK", launch.local_rank.to_string());
    set("KEEL_WORLD_SIZE", launch.world_size.to_string());
    set("KEEL_NODE", launch.node.clone());
    set("KEEL_GPU_TYPE", launch.gpu_type.clone());
    set("KEEL_GPUS_PER_WORKER", launch.gpus.len().to_string());
    set("KEEL_CHECKPOINT_DIR", checkpoint_dir.to_string());
    set("KEEL_RENDEZVOUS_ADDR", launch.rendezvous_addr.clone());
    set("KEEL_RENDEZVOUS_PORT", rendezvous_port.to_string());
    if let Some(model) = &launch.model {
        set("KEEL_MODEL", model.clone());
    }
    if let Some(steps) = launch.total_steps {
        set("KEEL_TOTAL_STEPS", steps.to_string());
    }
    if let Some(partner) = &launch.shared_with {
        set("KEEL_SHARED_WITH_JOB", partner.job_id.to_string());
        if let Some(model) = &partner.model {
            set("KEEL_SHARED_WITH_MODEL", model.clone());
        }
    }
    // The names torch.distributed's env:// rendezvous and torchrun use.
    set("RANK", id.rank.to_string());
    set("LOCAL_RANK", launch.local_rank.to_string());
    set("WORLD_SIZE", launch.world_size.to_string());
    set("LOCAL_WORLD_SIZE", launch.local_world_size.to_string());
    set("MASTER_ADDR", launch.rendezvous_addr.clone());
    set("MASTER_PORT", rendezvous_port.to_string());
    env
}

#[derive(Deserialize)]
struct ProgressLine {
    step: u64,
    #[serde(default)]
    total_steps: u64,
    #[serde(default)]
    loss: Option<f64>,
    #[serde(default)]
    samples_per_s: f64,
}

/// A progress sample from one stdout line, or `None` for any other line
/// (including malformed progress lines, which stay in the log only).
pub fn parse_progress_line(line: &str, at_ms: u64) -> Option<ProgressSample> {
    if line.len() > PROGRESS_LINE_MAX_LEN {
        return None;
    }
    let json = line.trim_end().strip_prefix(PROGRESS_MARKER)?;
    let p: ProgressLine = serde_json::from_str(json).ok()?;
    let finite = |x: f64| x.is_finite().then_some(x);
    Some(ProgressSample {
        step: p.step,
        total_steps: p.total_steps,
        loss: p.loss.and_then(finite),
        samples_per_s: finite(p.samples_per_s).unwrap_or(0.0).max(0.0),
        at_ms,
    })
}

/// Splits a worker's output, read in chunks, into progress samples: keeps
/// the partial last line between chunks, and skips lines too long to be
/// progress lines without buffering them (its memory stays bounded).
#[derive(Debug, Default)]
pub struct ProgressLines {
    partial: Vec<u8>,
    /// Inside an over-long line: skip to its end.
    skipping: bool,
}

impl ProgressLines {
    /// The progress samples among the complete lines of `chunk` (with what
    /// earlier chunks left), stamped `at_ms`.
    pub fn push(&mut self, chunk: &[u8], at_ms: u64) -> Vec<ProgressSample> {
        let mut out = Vec::new();
        self.partial.extend_from_slice(chunk);
        let mut consumed = 0;
        while let Some(nl) = self.partial[consumed..].iter().position(|b| *b == b'\n') {
            let line = &self.partial[consumed..consumed + nl];
            consumed += nl + 1;
            if std::mem::take(&mut self.skipping) {
                continue;
            }
            if let Some(sample) = std::str::from_utf8(line)
                .ok()
                .and_then(|s| parse_progress_line(s, at_ms))
            {
                out.push(sample);
            }
        }
        self.partial.drain(..consumed);
        if self.partial.len() > PROGRESS_LINE_MAX_LEN {
            self.partial.clear();
            self.skipping = true;
        }
        out
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn progress_lines_parse_and_other_lines_do_not() {
        let s = parse_progress_line(
            r#"KEEL_PROGRESS {"step": 5, "total_steps": 10, "loss": 0.5, "samples_per_s": 12.5}"#,
            7,
        )
        .expect("a progress line");
        assert_eq!(
            (s.step, s.total_steps, s.loss, s.at_ms),
            (5, 10, Some(0.5), 7)
        );
        assert_eq!(parse_progress_line("epoch 1 done", 7), None);
        assert_eq!(parse_progress_line("KEEL_PROGRESS {not json", 7), None);
        assert_eq!(parse_progress_line(r#"KEEL_PROGRESS {"loss": 1}"#, 7), None);
    }

    #[test]
    fn progress_buffers_keep_the_latest_samples() {
        let sample = |step| ProgressSample {
            step,
            total_steps: 0,
            loss: None,
            samples_per_s: 0.0,
            at_ms: 0,
        };
        let mut buffers = BTreeMap::new();
        buffer_progress(&mut buffers, 1, (0..PROGRESS_BUFFER_MAX as u64).map(sample));
        buffer_progress(&mut buffers, 1, [sample(5000), sample(5001)]);
        let buf = &buffers[&1];
        assert_eq!(buf.len(), PROGRESS_BUFFER_MAX);
        assert_eq!((buf[0].step, buf[buf.len() - 1].step), (2, 5001));
    }

    #[test]
    fn progress_lines_survive_chunk_boundaries_and_skip_long_lines() {
        let mut lines = ProgressLines::default();
        assert!(lines.push(b"KEEL_PROGRESS {\"st", 1).is_empty());
        let got = lines.push(b"ep\": 4}\nnoise\nKEEL_PROGRESS {\"step\": 5}\n", 2);
        assert_eq!(got.iter().map(|s| s.step).collect::<Vec<_>>(), vec![4, 5]);
        // A line longer than the limit is dropped, even if it looks like one,
        // and the next line still counts.
        let mut long = b"KEEL_PROGRESS {\"step\": 6, \"pad\": \"".to_vec();
        long.extend(std::iter::repeat_n(b'x', PROGRESS_LINE_MAX_LEN + 10));
        assert!(lines.push(&long, 3).is_empty());
        let got = lines.push(b"\"}\nKEEL_PROGRESS {\"step\": 7}\n", 4);
        assert_eq!(got.iter().map(|s| s.step).collect::<Vec<_>>(), vec![7]);
    }

    fn secret_env(reference: &str, value: Option<&str>) -> SecretEnv {
        SecretEnv {
            reference: keel_state::secret::SecretRef::parse("t", reference).expect("ref"),
            sealed: None,
            value: value.map(str::to_string),
        }
    }

    #[test]
    fn the_contract_overrides_user_variables() {
        let launch = WorkerLaunch {
            id: WorkerId {
                job_id: 4,
                epoch: 2,
                rank: 1,
            },
            job_name: "bert".into(),
            command: vec!["train".into()],
            image: None,
            env: [
                ("RANK".to_string(), "99".to_string()),
                ("MINE".into(), "x".into()),
            ]
            .into_iter()
            .collect(),
            secret_env: [
                ("SEALED".to_string(), secret_env("db/pw", None)),
                ("OPENED".to_string(), secret_env("db/user", Some("ada"))),
            ]
            .into(),
            node: "n1".into(),
            gpus: vec![2, 3],
            gpu_type: "v100".into(),
            world_size: 2,
            local_rank: 0,
            local_world_size: 1,
            rendezvous_addr: "10.0.0.1".into(),
            model: None,
            total_steps: Some(100),
            shared_with: None,
            resources: Default::default(),
            logs: Default::default(),
            trace_parent: None,
        };
        let env = environment(&launch, 29500, "/ckpt/job-4");
        assert_eq!(env["RANK"], "1");
        assert_eq!(env["MINE"], "x");
        // A secret's value once opened; one not opened is left out.
        assert_eq!(env["OPENED"], "ada");
        assert!(!env.contains_key("SEALED"));
        let shown = format!("{launch:?}");
        assert!(
            shown.contains("<secret db/user, opened>") && !shown.contains("ada"),
            "{shown}"
        );
        assert_eq!(env["CUDA_VISIBLE_DEVICES"], "2,3");
        assert_eq!(env["MASTER_PORT"], "29500");
        assert_eq!(env["KEEL_TOTAL_STEPS"], "100");
        assert_eq!(env["KEEL_CHECKPOINT_DIR"], "/ckpt/job-4");
    }
}
