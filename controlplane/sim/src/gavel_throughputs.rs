//! Gavel's throughput table (`simulation_throughputs.json`): steps per
//! second by GPU type, then by `('job type', scale factor)`, alone
//! (`"null"`) or beside another job. The simulator uses the "alone" figure
//! for jobs whose job type and size the table holds, and the pair figures
//! for the space-sharing policies (two jobs of one size on the same GPUs).

use std::collections::BTreeMap;

use serde_json::Value;

/// A job type at a scale factor: `('ResNet-18 (batch size 16)', 1)`.
type JobKey = (String, u32);

/// Steps per second by (job type, scale factor), then GPU type.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct ThroughputTable {
    rates: BTreeMap<(String, u32), BTreeMap<String, f64>>,
    /// (job, other job) → GPU type → [job's, other's] steps per second
    /// when the two share the GPUs.
    pairs: BTreeMap<(JobKey, JobKey), BTreeMap<String, [f64; 2]>>,
}

/// A table that cannot be read, naming what is wrong.
#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum ThroughputTableError {
    #[error("throughput table: {0}")]
    Invalid(String),
}

/// `('ResNet-18 (batch size 16)', 1)` → (`ResNet-18 (batch size 16)`, 1).
fn parse_key(key: &str) -> Option<(String, u32)> {
    let inner = key.trim().strip_prefix("('")?.strip_suffix(')')?;
    let (name, scale) = inner.rsplit_once("',")?;
    Some((name.to_string(), scale.trim().parse().ok()?))
}

impl ThroughputTable {
    /// Parses Gavel's JSON layout. GPU types ending in `_unconsolidated`
    /// are skipped (the simulator places each worker's GPUs on one node).
    pub fn from_gavel_json(text: &str) -> Result<ThroughputTable, ThroughputTableError> {
        let invalid = |m: String| ThroughputTableError::Invalid(m);
        let root: Value = serde_json::from_str(text).map_err(|e| invalid(e.to_string()))?;
        let types = root
            .as_object()
            .ok_or_else(|| invalid("the top level must map GPU types to jobs".into()))?;
        let mut table = ThroughputTable::default();
        for (gpu_type, jobs) in types {
            if gpu_type.ends_with("_unconsolidated") {
                continue;
            }
            let jobs = jobs
                .as_object()
                .ok_or_else(|| invalid(format!("{gpu_type}: must map jobs to figures")))?;
            for (key, figures) in jobs {
                let job = parse_key(key).ok_or_else(|| {
                    invalid(format!(
                        "{gpu_type}: {key:?} is not ('job type', scale factor)"
                    ))
                })?;
                let alone = figures.get("null").and_then(Value::as_f64).ok_or_else(|| {
                    invalid(format!("{gpu_type}: {key}: no \"null\" (alone) figure"))
                })?;
                if !(alone.is_finite() && alone >= 0.0) {
                    return Err(invalid(format!("{gpu_type}: {key}: {alone} steps/s")));
                }
                let gpu = gpu_type.to_ascii_lowercase();
                for (other_key, pair) in figures.as_object().into_iter().flatten() {
                    if other_key == "null" {
                        continue;
                    }
                    let other = parse_key(other_key).ok_or_else(|| {
                        invalid(format!(
                            "{gpu_type}: {key}: {other_key:?} is not ('job type', scale factor)"
                        ))
                    })?;
                    let figures = pair
                        .as_array()
                        .filter(|a| a.len() == 2)
                        .and_then(|a| Some([a[0].as_f64()?, a[1].as_f64()?]))
                        .filter(|f| f.iter().all(|v| v.is_finite() && *v >= 0.0))
                        .ok_or_else(|| {
                            invalid(format!(
                                "{gpu_type}: {key}: beside {other_key}: not two steps/s figures ≥ 0"
                            ))
                        })?;
                    table
                        .pairs
                        .entry((job.clone(), other))
                        .or_default()
                        .insert(gpu.clone(), figures);
                }
                table.rates.entry(job).or_default().insert(gpu, alone);
            }
        }
        if table.rates.is_empty() {
            return Err(invalid("no job in the table".into()));
        }
        Ok(table)
    }

    /// Steps per second of `job_type` at `scale_factor` GPUs of `gpu_type`.
    pub fn steps_per_s(&self, job_type: &str, scale_factor: u32, gpu_type: &str) -> Option<f64> {
        self.rates
            .get(&(job_type.to_string(), scale_factor))?
            .get(gpu_type)
            .copied()
    }

    /// Steps per second of `job_type` and `other_type`, both at
    /// `scale_factor` GPUs, sharing the same GPUs of `gpu_type`: `[job's,
    /// other's]`.
    pub fn pair_steps_per_s(
        &self,
        job_type: &str,
        other_type: &str,
        scale_factor: u32,
        gpu_type: &str,
    ) -> Option<[f64; 2]> {
        let key = |t: &str| (t.to_string(), scale_factor);
        if let Some(f) = self
            .pairs
            .get(&(key(job_type), key(other_type)))
            .and_then(|g| g.get(gpu_type))
        {
            return Some(*f);
        }
        self.pairs
            .get(&(key(other_type), key(job_type)))
            .and_then(|g| g.get(gpu_type))
            .map(|[a, b]| [*b, *a])
    }

    /// How many (job type, scale factor) rows the table has.
    pub fn len(&self) -> usize {
        self.rates.len()
    }

    pub fn is_empty(&self) -> bool {
        self.rates.is_empty()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn gavel_layout_parses_alone_figures() {
        let table = ThroughputTable::from_gavel_json(
            r#"{"v100": {"('ResNet-18 (batch size 16)', 1)": {"null": 32.5, "('A3C', 1)": [1.0, 2.0]},
                         "('Transformer (batch size 16)', 4)": {"null": 10.0}},
                "k80": {"('ResNet-18 (batch size 16)', 1)": {"null": 4.8}},
                "k80_unconsolidated": {"('ResNet-18 (batch size 16)', 1)": {"null": 1.0}}}"#,
        )
        .expect("parses");
        assert_eq!(table.len(), 2);
        assert_eq!(
            table.steps_per_s("ResNet-18 (batch size 16)", 1, "v100"),
            Some(32.5)
        );
        assert_eq!(
            table.steps_per_s("ResNet-18 (batch size 16)", 1, "k80"),
            Some(4.8)
        );
        assert_eq!(
            table.steps_per_s("Transformer (batch size 16)", 4, "v100"),
            Some(10.0)
        );
        assert_eq!(
            table.steps_per_s("Transformer (batch size 16)", 1, "v100"),
            None
        );
        assert_eq!(
            table.pair_steps_per_s("ResNet-18 (batch size 16)", "A3C", 1, "v100"),
            Some([1.0, 2.0])
        );
        assert_eq!(
            table.pair_steps_per_s("A3C", "ResNet-18 (batch size 16)", 1, "v100"),
            Some([2.0, 1.0]),
            "the other order reads the figures the other way round"
        );
        assert_eq!(
            table.pair_steps_per_s("ResNet-18 (batch size 16)", "A3C", 1, "k80"),
            None
        );
        assert!(ThroughputTable::from_gavel_json(
            r#"{"v100": {"('A', 1)": {"null": 1.0, "('B', 1)": [1.0]}}}"#
        )
        .is_err());
        assert!(ThroughputTable::from_gavel_json("{\"v100\": {\"bad\": {\"null\": 1}}}").is_err());
        assert!(ThroughputTable::from_gavel_json("[]").is_err());
    }
}
