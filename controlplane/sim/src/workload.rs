//! Workloads for the simulator: Keel's own trace format, Gavel's trace
//! format, and a generator with Gavel's distributions.

use serde::{Deserialize, Serialize};

use keel_scheduling::throughput;
use keel_state::rng::SplitMix64;

/// One job of a workload.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct SimJob {
    /// The job's id in the workload (its line in a trace, from 0), used by
    /// `--window` and in per-job results.
    pub id: u64,
    pub arrival_s: f64,
    pub model: String,
    /// GPUs per worker.
    #[serde(default = "one")]
    pub gpus_per_worker: u32,
    /// Workers: `min == max` for a rigid job.
    pub workers_min: u32,
    pub workers_max: u32,
    pub total_steps: u64,
    #[serde(default)]
    pub priority: i32,
    /// The workload's own name for the job's type (Gavel's job type, e.g.
    /// `ResNet-50 (batch size 64)`), looked up in a Gavel throughput table
    /// when one is given.
    #[serde(default)]
    pub job_type: Option<String>,
    /// The queue it is submitted to (empty: the default queue).
    #[serde(default, skip_serializing_if = "String::is_empty")]
    pub queue: String,
    /// Speeds measured on a cluster (a recorded history's, `keel whatif`),
    /// by GPU type and allocation size: used before any table.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub measured: Vec<MeasuredSpeed>,
    /// When its user cancels it, unless it finished before (seconds on
    /// the workload's clock).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub cancel_at_s: Option<f64>,
    /// Its own seconds without progress at each (re)start, instead of the
    /// run's (a recorded history's measured launch and exit time).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub restart_s: Option<f64>,
}

/// A job's speed measured on `gpus` GPUs of `gpu_type` (all its workers'
/// GPUs together).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct MeasuredSpeed {
    pub gpu_type: String,
    pub gpus: u32,
    pub steps_per_s: f64,
}

fn one() -> u32 {
    1
}

/// A workload that cannot be read, naming the line and the field.
#[derive(Debug, thiserror::Error, PartialEq)]
pub enum WorkloadError {
    #[error("line {line}: {message}")]
    Line { line: usize, message: String },
    #[error("{0}")]
    Invalid(String),
}

/// Most jobs a workload may hold.
pub const JOBS_MAX: usize = 1_000_000;

fn line_error(line: usize, message: impl Into<String>) -> WorkloadError {
    WorkloadError::Line {
        line,
        message: message.into(),
    }
}

/// One line of Keel's trace format (JSON lines).
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct TraceLine {
    arrival_s: f64,
    model: String,
    #[serde(default = "one")]
    gpus_per_worker: u32,
    /// A number (rigid) or `{min, max}` (elastic).
    #[serde(default)]
    workers: Option<WorkersField>,
    total_steps: u64,
    #[serde(default)]
    priority: i32,
    /// The queue (empty or absent: the default queue).
    #[serde(default)]
    queue: String,
}

#[derive(Debug, Deserialize)]
#[serde(untagged)]
enum WorkersField {
    Fixed(u32),
    Range { min: u32, max: u32 },
}

fn check_job(job: &SimJob, line: usize) -> Result<(), WorkloadError> {
    if !job.queue.is_empty() {
        keel_state::queue::validate_queue_name("queue", &job.queue)
            .map_err(|e| line_error(line, e.to_string()))?;
    }
    if !(job.arrival_s.is_finite() && job.arrival_s >= 0.0) {
        return Err(line_error(line, "arrival_s must be a finite number ≥ 0"));
    }
    if job.gpus_per_worker == 0 || job.gpus_per_worker > 64 {
        return Err(line_error(line, "gpus_per_worker must be between 1 and 64"));
    }
    if job.workers_min == 0 || job.workers_min > job.workers_max || job.workers_max > 1024 {
        return Err(line_error(
            line,
            "workers must satisfy 1 ≤ min ≤ max ≤ 1024",
        ));
    }
    if job.total_steps == 0 {
        return Err(line_error(line, "total_steps must be ≥ 1"));
    }
    Ok(())
}

/// Parses Keel's trace format: one JSON object per line, e.g.
/// `{"arrival_s": 0, "model": "resnet50", "workers": {"min": 1, "max": 4},
/// "total_steps": 20000}`. Blank lines and lines starting with `#` are
/// skipped; ids are the job's position among the jobs, from 0.
pub fn parse_keel_trace(text: &str) -> Result<Vec<SimJob>, WorkloadError> {
    let mut jobs = Vec::new();
    for (n, raw) in text.lines().enumerate() {
        let line = n + 1;
        let raw = raw.trim();
        if raw.is_empty() || raw.starts_with('#') {
            continue;
        }
        let t: TraceLine =
            serde_json::from_str(raw).map_err(|e| line_error(line, e.to_string()))?;
        let (workers_min, workers_max) = match t.workers {
            None => (1, 1),
            Some(WorkersField::Fixed(w)) => (w, w),
            Some(WorkersField::Range { min, max }) => (min, max),
        };
        let job = SimJob {
            id: jobs.len() as u64,
            arrival_s: t.arrival_s,
            model: t.model,
            gpus_per_worker: t.gpus_per_worker,
            workers_min,
            workers_max,
            total_steps: t.total_steps,
            priority: t.priority,
            job_type: None,
            queue: t.queue,
            measured: Vec::new(),
            cancel_at_s: None,
            restart_s: None,
        };
        check_job(&job, line)?;
        push(&mut jobs, job, line)?;
    }
    Ok(jobs)
}

fn push(jobs: &mut Vec<SimJob>, job: SimJob, line: usize) -> Result<(), WorkloadError> {
    if jobs.len() >= JOBS_MAX {
        return Err(line_error(line, format!("more than {JOBS_MAX} jobs")));
    }
    jobs.push(job);
    Ok(())
}

/// Parses Gavel's trace format: 10 tab-separated columns (job_type,
/// command, working_directory, num_steps_arg, needs_data_dir, total_steps,
/// scale_factor, priority_weight, SLO, arrival_time_s). A job with scale
/// factor `s` is `s` workers of one GPU; its model is mapped onto the
/// project's throughput table by name ([`model_for_gavel_job_type`]).
pub fn parse_gavel_trace(text: &str) -> Result<Vec<SimJob>, WorkloadError> {
    let mut jobs = Vec::new();
    for (n, raw) in text.lines().enumerate() {
        let line = n + 1;
        if raw.trim().is_empty() {
            continue;
        }
        let cols: Vec<&str> = raw.split('\t').collect();
        if cols.len() != 10 {
            return Err(line_error(
                line,
                format!(
                    "{} tab-separated columns; Gavel's format has 10",
                    cols.len()
                ),
            ));
        }
        let num = |i: usize, name: &str| -> Result<f64, WorkloadError> {
            cols[i]
                .trim()
                .parse::<f64>()
                .map_err(|e| line_error(line, format!("{name} {:?}: {e}", cols[i])))
        };
        let total_steps = num(5, "total_steps")?;
        let scale_factor = num(6, "scale_factor")?;
        let priority_weight = num(7, "priority_weight")?;
        let arrival_s = num(9, "arrival_time_s")?;
        if !(scale_factor >= 1.0 && scale_factor.fract() == 0.0) {
            return Err(line_error(line, "scale_factor must be a whole number ≥ 1"));
        }
        let job = SimJob {
            id: jobs.len() as u64,
            arrival_s,
            model: model_for_gavel_job_type(cols[0]).to_string(),
            gpus_per_worker: 1,
            workers_min: scale_factor as u32,
            workers_max: scale_factor as u32,
            total_steps: total_steps.max(1.0) as u64,
            priority: priority_weight.round() as i32,
            job_type: Some(cols[0].to_string()),
            queue: String::new(),
            measured: Vec::new(),
            cancel_at_s: None,
            restart_s: None,
        };
        check_job(&job, line)?;
        push(&mut jobs, job, line)?;
    }
    Ok(jobs)
}

/// Parses the generated-stream CSV of Gavel's generator
/// (`job_id,model,scale_factor,duration_s_on_v100,total_steps,unit_arrival`,
/// as in `shared/data/gavel/generated/`): arrivals are `unit_arrival ·
/// 3600 / rate_per_hour` seconds, so one stream serves every rate. Jobs
/// keep the file's ids; fractional steps round up.
pub fn parse_gavel_generated_csv(
    text: &str,
    rate_per_hour: f64,
) -> Result<Vec<SimJob>, WorkloadError> {
    if !(rate_per_hour.is_finite() && rate_per_hour > 0.0) {
        return Err(WorkloadError::Invalid(format!(
            "--rate {rate_per_hour}: must be a finite number > 0 to convert unit arrivals"
        )));
    }
    let mut jobs = Vec::new();
    let mut lines = text.lines().enumerate();
    let header = lines.next().map(|(_, h)| h.trim()).unwrap_or_default();
    const HEADER: &str = "job_id,model,scale_factor,duration_s_on_v100,total_steps,unit_arrival";
    if header != HEADER {
        return Err(line_error(1, format!("the header must be {HEADER:?}")));
    }
    for (n, raw) in lines {
        let line = n + 1;
        if raw.trim().is_empty() {
            continue;
        }
        // The model may hold commas only inside parentheses; split from
        // the right.
        let cols: Vec<&str> = raw.rsplitn(5, ',').collect();
        let [unit_arrival, total_steps, _duration, scale_factor, head] = cols[..] else {
            return Err(line_error(line, "expected 6 comma-separated columns"));
        };
        let Some((id, model)) = head.split_once(',') else {
            return Err(line_error(line, "expected 6 comma-separated columns"));
        };
        let num = |v: &str, name: &str| -> Result<f64, WorkloadError> {
            v.trim()
                .parse::<f64>()
                .map_err(|e| line_error(line, format!("{name} {v:?}: {e}")))
        };
        let id: u64 = id
            .trim()
            .parse()
            .map_err(|e| line_error(line, format!("job_id {id:?}: {e}")))?;
        let scale_factor = num(scale_factor, "scale_factor")?;
        if !((1.0..=1024.0).contains(&scale_factor) && scale_factor.fract() == 0.0) {
            return Err(line_error(
                line,
                "scale_factor must be a whole number from 1 to 1024",
            ));
        }
        let total_steps = num(total_steps, "total_steps")?;
        if !(total_steps.is_finite() && total_steps > 0.0 && total_steps < 1e15) {
            return Err(line_error(
                line,
                "total_steps must be a number > 0 and < 1e15",
            ));
        }
        let job = SimJob {
            id,
            arrival_s: num(unit_arrival, "unit_arrival")? * 3600.0 / rate_per_hour,
            model: model_for_gavel_job_type(model).to_string(),
            gpus_per_worker: 1,
            workers_min: scale_factor as u32,
            workers_max: scale_factor as u32,
            total_steps: total_steps.ceil() as u64,
            priority: 0,
            job_type: Some(model.to_string()),
            queue: String::new(),
            measured: Vec::new(),
            cancel_at_s: None,
            restart_s: None,
        };
        check_job(&job, line)?;
        push(&mut jobs, job, line)?;
    }
    Ok(jobs)
}

/// The project's model closest to a Gavel job type such as
/// `ResNet-50 (batch size 64)` (the table has no per-batch-size rows).
pub fn model_for_gavel_job_type(job_type: &str) -> &'static str {
    let t = job_type.to_ascii_lowercase();
    let table: [(&str, &'static str); 7] = [
        ("resnet-50", "resnet50"),
        ("resnet-18", "resnet18"),
        ("transformer", "transformer"),
        ("lm (", "lstm"),
        ("recommendation", "recommendation"),
        ("cyclegan", "cyclegan"),
        ("vgg", "vgg16"),
    ];
    table
        .iter()
        .find(|(needle, _)| t.contains(needle))
        .map_or("generic", |(_, model)| model)
}

/// Puts each of `jobs` in one of the queues of `mix` (name, share), drawn
/// with probability proportional to its share from a generator of its
/// own seeded by `seed`, so the jobs themselves are the same with or
/// without queues.
pub fn assign_queues(
    jobs: &mut [SimJob],
    mix: &[(String, u32)],
    seed: u64,
) -> Result<(), WorkloadError> {
    let total: u64 = mix.iter().map(|(_, share)| u64::from(*share)).sum();
    if total == 0 {
        return Err(WorkloadError::Invalid(
            "--generate-queues needs at least one queue with a share above 0".into(),
        ));
    }
    for (name, _) in mix {
        keel_state::queue::validate_queue_name("--generate-queues", name)
            .map_err(|e| WorkloadError::Invalid(e.to_string()))?;
    }
    let mut rng = SplitMix64::new(seed ^ 0x7175_6575_6573);
    for job in jobs {
        let mut draw = rng.below(total);
        for (name, share) in mix {
            let share = u64::from(*share);
            if draw < share {
                job.queue.clone_from(name);
                break;
            }
            draw -= share;
        }
    }
    Ok(())
}

/// A generated workload with Gavel's distributions.
#[derive(Debug, Clone, PartialEq)]
pub struct Generator {
    pub jobs: usize,
    /// Poisson arrivals, jobs per hour (0: every job arrives at time 0).
    pub rate_per_hour: f64,
    pub seed: u64,
    /// Scale factors 1, 2, 4, 8 with probability 70/10/15/5 %; else 1.
    pub multi_gpu: bool,
    /// Elastic jobs: each may run on 1 to 4 × its scale factor workers
    /// (its steps are still sized at the scale factor); else rigid.
    pub elastic: bool,
}

impl Generator {
    /// The jobs: durations on a v100 of `60·10^U(3,4)` s with probability
    /// 0.2, else `60·10^U(1.5,3)` s; models uniform over the throughput
    /// table; total steps = duration × the job's v100 speed at its size.
    pub fn generate(&self) -> Result<Vec<SimJob>, WorkloadError> {
        if self.jobs > JOBS_MAX {
            return Err(WorkloadError::Invalid(format!(
                "--generate {} is more than {JOBS_MAX} jobs",
                self.jobs
            )));
        }
        if !(self.rate_per_hour.is_finite() && self.rate_per_hour >= 0.0) {
            return Err(WorkloadError::Invalid(
                "--rate must be a finite number ≥ 0".into(),
            ));
        }
        let models: Vec<&throughput::ModelProfile> = throughput::PROFILES
            .iter()
            .filter(|p| p.model != "generic")
            .collect();
        let mut rng = SplitMix64::new(self.seed);
        let mut arrival_s = 0.0;
        let mut jobs = Vec::with_capacity(self.jobs);
        for id in 0..self.jobs {
            let exponent = if rng.unit() < 0.2 {
                3.0 + rng.unit()
            } else {
                1.5 + 1.5 * rng.unit()
            };
            let duration_s = 60.0 * 10f64.powf(exponent);
            let profile = models[(rng.below(models.len() as u64)) as usize];
            let scale = if self.multi_gpu {
                match rng.unit() {
                    u if u < 0.70 => 1,
                    u if u < 0.80 => 2,
                    u if u < 0.95 => 4,
                    _ => 8,
                }
            } else {
                1
            };
            let total_steps = (duration_s * profile.steps_per_s("v100", scale)).max(1.0) as u64;
            jobs.push(SimJob {
                id: id as u64,
                arrival_s,
                model: profile.model.to_string(),
                gpus_per_worker: 1,
                workers_min: if self.elastic { 1 } else { scale },
                workers_max: if self.elastic { scale * 4 } else { scale },
                total_steps,
                priority: 0,
                job_type: None,
                queue: String::new(),
                measured: Vec::new(),
                cancel_at_s: None,
                restart_s: None,
            });
            if self.rate_per_hour > 0.0 {
                arrival_s += -(1.0 - rng.unit()).ln() * 3600.0 / self.rate_per_hour;
            }
        }
        Ok(jobs)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn keel_trace_lines_parse_and_bad_ones_name_the_line() {
        let jobs = parse_keel_trace(
            "# a comment\n\
             {\"arrival_s\": 0, \"model\": \"resnet50\", \"total_steps\": 100}\n\
             \n\
             {\"arrival_s\": 5.5, \"model\": \"vgg16\", \"workers\": {\"min\": 1, \"max\": 4}, \"total_steps\": 9, \"priority\": 2}\n",
        )
        .expect("parses");
        assert_eq!(jobs.len(), 2);
        assert_eq!(
            (jobs[1].id, jobs[1].workers_min, jobs[1].workers_max),
            (1, 1, 4)
        );
        let bad = parse_keel_trace("{\"arrival_s\": 0, \"model\": \"x\", \"total_steps\": 0}\n");
        assert_eq!(
            bad,
            Err(WorkloadError::Line {
                line: 1,
                message: "total_steps must be ≥ 1".into()
            })
        );
        assert!(matches!(
            parse_keel_trace(
                "{\"arrival_s\": 0, \"model\": \"x\", \"total_steps\": 1, \"oops\": 1}"
            ),
            Err(WorkloadError::Line { line: 1, .. })
        ));
    }

    #[test]
    fn gavel_trace_lines_parse() {
        let jobs = parse_gavel_trace(
            "ResNet-50 (batch size 64)\tcmd\tdir\t--num_steps\t1\t52000\t4\t1\t-1\t3600.5\n",
        )
        .expect("parses");
        assert_eq!(jobs[0].model, "resnet50");
        assert_eq!(jobs[0].total_steps, 52_000);
        assert_eq!(jobs[0].workers_min, 4);
        assert_eq!(jobs[0].arrival_s, 3600.5);
        assert!(matches!(
            parse_gavel_trace("a\tb\n"),
            Err(WorkloadError::Line { line: 1, .. })
        ));
    }

    #[test]
    fn generated_csv_converts_unit_arrivals() {
        let text = "job_id,model,scale_factor,duration_s_on_v100,total_steps,unit_arrival\n\
                    0,ResNet-18 (batch size 64),1,68344.3,1646636.27,0.0\n\
                    1,LM (batch size 80),4,3100.5,3431.2,0.5\n";
        let jobs = parse_gavel_generated_csv(text, 3.2).expect("parses");
        assert_eq!(jobs.len(), 2);
        assert_eq!(jobs[0].total_steps, 1_646_637);
        assert_eq!(jobs[1].job_type.as_deref(), Some("LM (batch size 80)"));
        assert_eq!(jobs[1].workers_min, 4);
        assert!((jobs[1].arrival_s - 0.5 * 3600.0 / 3.2).abs() < 1e-9);
        assert!(matches!(
            parse_gavel_generated_csv("id,model\n", 3.2),
            Err(WorkloadError::Line { line: 1, .. })
        ));
        assert!(matches!(
            parse_gavel_generated_csv(text, 0.0),
            Err(WorkloadError::Invalid(_))
        ));
        let bad = text.replace(",4,3100.5", ",x,3100.5");
        assert!(matches!(
            parse_gavel_generated_csv(&bad, 3.2),
            Err(WorkloadError::Line { line: 3, .. })
        ));
    }

    #[test]
    fn the_generator_is_seeded() {
        let g = Generator {
            jobs: 200,
            rate_per_hour: 3.2,
            seed: 7,
            multi_gpu: true,
            elastic: false,
        };
        let a = g.generate().expect("generates");
        assert_eq!(a, g.generate().expect("generates"));
        assert_ne!(
            a,
            Generator {
                seed: 8,
                ..g.clone()
            }
            .generate()
            .expect("generates")
        );
        assert!(a.windows(2).all(|w| w[0].arrival_s <= w[1].arrival_s));
        assert!(a.iter().any(|j| j.workers_min > 1));
        // Mean gap ≈ 3600 / 3.2 s.
        let mean_gap = a[199].arrival_s / 199.0;
        assert!((800.0..1500.0).contains(&mean_gap), "{mean_gap}");
    }
}
