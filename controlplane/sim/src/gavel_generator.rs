//! Gavel's job generator, draw for draw: the same jobs, in the same order,
//! with the same arrival times as Gavel's simulator makes for a seed, for
//! as many jobs as asked (Gavel's continuous runs keep generating until
//! the measured window has finished; a fixed file of its first jobs runs
//! out at high rates).
//!
//! Gavel draws from Python's `random`: job parameters from
//! `Random(seed + 2)` — a scale factor (`uniform(0, 1)`, 1/2/4/8 at
//! 70/10/15/5 %, kept only for multi-GPU runs), a duration on a v100
//! (`random() ≥ 0.8`: `60·10^uniform(3, 4)` s, else `60·10^uniform(1.5,
//! 3)` s), then templates by `choice` from its 26-row job table until one
//! fits the scale factor (multi-GPU jobs need a distributed template) —
//! and inter-arrival gaps `−ln(1 − random())` (in units of 1/rate hours)
//! from `Random(seed + 3)`, on [`PyRandom`], CPython's generator. A job's steps are its duration times its
//! v100 speed alone in Gavel's throughput table.
//!
//! Pure: the seed is the only source of randomness.

use super::gavel_throughputs::ThroughputTable;
use super::workload::{model_for_gavel_job_type, SimJob, WorkloadError, JOBS_MAX};
use keel_state::rng::PyRandom;

/// Gavel's job table (`job_table.json`): each template's job type and
/// whether it runs on several GPUs, in Gavel's order (the order `choice`
/// draws from).
pub const GAVEL_JOB_TABLE: [(&str, bool); 26] = [
    ("ResNet-18 (batch size 16)", true),
    ("ResNet-18 (batch size 32)", true),
    ("ResNet-18 (batch size 64)", true),
    ("ResNet-18 (batch size 128)", true),
    ("ResNet-18 (batch size 256)", true),
    ("ResNet-50 (batch size 16)", true),
    ("ResNet-50 (batch size 32)", true),
    ("ResNet-50 (batch size 64)", true),
    ("ResNet-50 (batch size 128)", true),
    ("Transformer (batch size 16)", true),
    ("Transformer (batch size 32)", true),
    ("Transformer (batch size 64)", true),
    ("Transformer (batch size 128)", true),
    ("Transformer (batch size 256)", true),
    ("LM (batch size 5)", true),
    ("LM (batch size 10)", true),
    ("LM (batch size 20)", true),
    ("LM (batch size 40)", true),
    ("LM (batch size 80)", true),
    ("Recommendation (batch size 512)", false),
    ("Recommendation (batch size 1024)", false),
    ("Recommendation (batch size 2048)", false),
    ("Recommendation (batch size 4096)", false),
    ("Recommendation (batch size 8192)", false),
    ("A3C", false),
    ("CycleGAN", false),
];

/// Gavel's generator for one seed.
#[derive(Debug, Clone, PartialEq)]
pub struct GavelGenerator {
    pub jobs: usize,
    /// Arrivals per hour (the unit gaps are in 1/rate hours).
    pub rate_per_hour: f64,
    pub seed: u32,
    /// Keep the drawn scale factors (Gavel's `generate_multi_gpu_jobs`).
    pub multi_gpu: bool,
}

impl GavelGenerator {
    /// The jobs, with steps from `table`'s v100 figures. An error names
    /// the field when the rate, the count or the seed is out of range, or
    /// the table lacks a drawn job type.
    pub fn generate(&self, table: &ThroughputTable) -> Result<Vec<SimJob>, WorkloadError> {
        if self.jobs > JOBS_MAX {
            return Err(WorkloadError::Invalid(format!(
                "--gavel-generate {} is more than {JOBS_MAX} jobs",
                self.jobs
            )));
        }
        if !(self.rate_per_hour.is_finite() && self.rate_per_hour > 0.0) {
            return Err(WorkloadError::Invalid(format!(
                "--rate {}: must be a finite number > 0",
                self.rate_per_hour
            )));
        }
        let seed_for = |offset: u32| {
            self.seed.checked_add(offset).ok_or_else(|| {
                WorkloadError::Invalid(format!(
                    "--seed {}: Gavel's streams use seed + 2 and seed + 3, which must stay below 2^32",
                    self.seed
                ))
            })
        };
        let mut job_rng = PyRandom::new(seed_for(2)?);
        let mut arrival_rng = PyRandom::new(seed_for(3)?);
        let table_len = u32::try_from(GAVEL_JOB_TABLE.len()).unwrap_or(u32::MAX);
        let mut unit_arrival = 0.0f64;
        let mut jobs = Vec::with_capacity(self.jobs);
        for id in 0..self.jobs {
            let r = job_rng.uniform(0.0, 1.0);
            let drawn_scale = if (0.7..=0.8).contains(&r) {
                2
            } else if (0.8..=0.95).contains(&r) {
                4
            } else if 0.95 <= r {
                8
            } else {
                1
            };
            let duration_s = if job_rng.random() >= 0.8 {
                60.0 * 10f64.powf(job_rng.uniform(3.0, 4.0))
            } else {
                60.0 * 10f64.powf(job_rng.uniform(1.5, 3.0))
            };
            let scale = if self.multi_gpu { drawn_scale } else { 1 };
            let job_type = loop {
                let (model, distributed) = GAVEL_JOB_TABLE[job_rng.below(table_len) as usize];
                if scale == 1 || distributed {
                    break model;
                }
            };
            let speed = table.steps_per_s(job_type, scale, "v100").ok_or_else(|| {
                WorkloadError::Invalid(format!(
                    "--throughputs: no v100 figure for ('{job_type}', {scale})"
                ))
            })?;
            let total_steps = duration_s * speed;
            if !(total_steps.is_finite() && total_steps > 0.0 && total_steps < 1e15) {
                return Err(WorkloadError::Invalid(format!(
                    "--throughputs: ('{job_type}', {scale}) on v100 gives {total_steps} steps"
                )));
            }
            jobs.push(SimJob {
                id: id as u64,
                arrival_s: unit_arrival * 3600.0 / self.rate_per_hour,
                model: model_for_gavel_job_type(job_type).to_string(),
                gpus_per_worker: 1,
                workers_min: scale,
                workers_max: scale,
                total_steps: total_steps.ceil() as u64,
                priority: 0,
                job_type: Some(job_type.to_string()),
                queue: String::new(),
                measured: Vec::new(),
                cancel_at_s: None,
                restart_s: None,
            });
            unit_arrival += -(1.0 - arrival_rng.random()).ln();
        }
        Ok(jobs)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Every template at every size, 10⁶ steps/s on a v100, so a job's
    /// steps are its duration in µs (rounded up).
    fn micro_table() -> ThroughputTable {
        let mut jobs = serde_json::Map::new();
        for (model, _) in GAVEL_JOB_TABLE {
            for scale in [1, 2, 4, 8] {
                jobs.insert(
                    format!("('{model}', {scale})"),
                    serde_json::json!({"null": 1e6}),
                );
            }
        }
        ThroughputTable::from_gavel_json(&serde_json::json!({ "v100": jobs }).to_string())
            .expect("table")
    }

    /// Rows of Gavel's generated streams for seed 0
    /// (`shared/data/gavel/generated/jobs_seed=0.csv` and
    /// `jobs_seed=0_multigpu.csv`, Gavel commit c4fa400): job id, job type,
    /// scale factor, duration on a v100, unit arrival.
    const SINGLE_GPU_ROWS: [(u64, &str, u32, f64, f64); 6] = [
        (0, "ResNet-18 (batch size 64)", 1, 68344.35010595087, 0.0),
        (
            1,
            "Transformer (batch size 16)",
            1,
            31016.60914593223,
            0.27176230323366835,
        ),
        (
            2,
            "Recommendation (batch size 2048)",
            1,
            2146.6088374387864,
            1.05752758614344,
        ),
        (
            5997,
            "Recommendation (batch size 8192)",
            1,
            2384.737733110762,
            5948.524081994653,
        ),
        (
            5998,
            "Transformer (batch size 32)",
            1,
            55768.6023788794,
            5949.060707353275,
        ),
        (
            5999,
            "LM (batch size 5)",
            1,
            13226.65913211364,
            5949.753658620709,
        ),
    ];
    const MULTI_GPU_ROWS: [(u64, &str, u32, f64, f64); 4] = [
        (0, "ResNet-18 (batch size 64)", 8, 68344.35010595087, 0.0),
        (
            1,
            "Transformer (batch size 16)",
            1,
            31016.60914593223,
            0.27176230323366835,
        ),
        (
            5998,
            "ResNet-50 (batch size 128)",
            1,
            3587.2204189406193,
            5949.060707353275,
        ),
        (
            5999,
            "LM (batch size 5)",
            1,
            3091.4078602190352,
            5949.753658620709,
        ),
    ];

    #[test]
    fn the_stream_is_gavels_for_seed_0() {
        let table = micro_table();
        for (multi_gpu, rows) in [(false, &SINGLE_GPU_ROWS[..]), (true, &MULTI_GPU_ROWS[..])] {
            let jobs = GavelGenerator {
                jobs: 6000,
                rate_per_hour: 3.2,
                seed: 0,
                multi_gpu,
            }
            .generate(&table)
            .expect("generates");
            for (id, job_type, scale, duration_s, unit_arrival) in rows {
                let job = &jobs[*id as usize];
                assert_eq!(job.job_type.as_deref(), Some(*job_type), "job {id}");
                assert_eq!(job.workers_min, *scale, "job {id}");
                assert_eq!(
                    job.total_steps,
                    (duration_s * 1e6).ceil() as u64,
                    "job {id}"
                );
                assert_eq!(job.arrival_s, unit_arrival * 3600.0 / 3.2, "job {id}");
            }
        }
        // Bad input names the field.
        let bad_rate = GavelGenerator {
            jobs: 1,
            rate_per_hour: 0.0,
            seed: 0,
            multi_gpu: false,
        };
        assert!(bad_rate
            .generate(&table)
            .is_err_and(|e| e.to_string().contains("--rate")));
        let empty = ThroughputTable::from_gavel_json(r#"{"v100": {"('A3C', 1)": {"null": 1.0}}}"#)
            .expect("table");
        let missing = GavelGenerator {
            jobs: 50,
            rate_per_hour: 1.0,
            seed: 0,
            multi_gpu: false,
        };
        assert!(missing
            .generate(&empty)
            .is_err_and(|e| e.to_string().contains("--throughputs")));
    }
}
