//! What if: a recorded history ([`keel_sim::history`]) run through the
//! simulator under the policies that decided (`recorded`, validated
//! against what happened, [`keel_sim::whatif`]) and under others. One
//! comparison for `keel whatif` (a data directory or a snapshot file) and
//! the console's `/api/v1/whatif` (the replica's own journal,
//! [`crate::http`]).

use keel_scheduling::policy::{Policy, PolicyOptions, UnknownPolicy};
use keel_sim::history::{History, RecordedEnd, RecordedWorkload};
use keel_sim::whatif::{summarise, validate, RunSummary, Validation};
use keel_sim::{self as sim, SimConfig, SimNode, SimQueues, SimReport};
use serde::Serialize;

/// The name of the run that replays the policies the log says decided.
pub const RECORDED: &str = "recorded";

/// How to run a history.
#[derive(Debug, Clone)]
pub struct Settings {
    /// The policies to run it through besides `recorded`, which always
    /// runs first.
    pub policies: Vec<String>,
    pub options: PolicyOptions,
    /// Seconds between scheduling rounds, as the server's `--round-s`.
    pub round_s: f64,
    /// A running job reports progress at least this often (seconds), as
    /// the server's `--progress-interval-s`.
    pub progress_interval_s: f64,
    /// Seconds without progress each time a job (re)starts.
    pub restart_s: f64,
    /// Only the jobs submitted at or after this log time (Unix ms).
    pub submitted_from_ms: Option<u64>,
    /// Other nodes (and their queues, if any) instead of the recorded
    /// ones; the recorded node losses are not replayed then.
    pub cluster: Option<(Vec<SimNode>, SimQueues)>,
    /// Nodes added to the recorded ones (or to `cluster`'s): "what with
    /// 16 more A100s?" ([`added_nodes`]).
    pub added_nodes: Vec<SimNode>,
}

/// The most nodes `added_nodes` makes.
pub const ADDED_NODES_MAX: u32 = 10_000;

/// Nodes to add, from `COUNTxGPUSxTYPE[,...]` (e.g. `2x8xa100`: two nodes
/// of eight A100s), named `added-TYPE-N`; refused naming `field`.
pub fn added_nodes(field: &str, spec: &str) -> Result<Vec<SimNode>, WhatifError> {
    let invalid = |item: &str, reason: String| WhatifError::AddedNodes {
        field: field.to_string(),
        item: item.to_string(),
        reason,
    };
    let mut specs = Vec::new();
    let mut nodes: u64 = 0;
    for item in spec.split(',').map(str::trim).filter(|i| !i.is_empty()) {
        let parts: Vec<&str> = item.splitn(3, 'x').collect();
        let [count, gpus, gpu_type] = parts[..] else {
            return Err(invalid(
                item,
                "expected COUNTxGPUSxTYPE, e.g. 2x8xa100".into(),
            ));
        };
        let number = |what: &str, v: &str| {
            v.parse::<u32>().ok().filter(|n| *n > 0).ok_or_else(|| {
                invalid(
                    item,
                    format!("{what} must be a whole number ≥ 1, not {v:?}"),
                )
            })
        };
        let count = number("COUNT", count)?;
        nodes += u64::from(count);
        if nodes > u64::from(ADDED_NODES_MAX) {
            return Err(invalid(
                item,
                format!("more than {ADDED_NODES_MAX} nodes in all"),
            ));
        }
        specs.push(keel_sim::NodeSpec {
            name: Some(format!("added-{}", gpu_type.to_ascii_lowercase())),
            gpu_type: gpu_type.to_string(),
            gpus: number("GPUS", gpus)?,
            count,
        });
    }
    if specs.is_empty() {
        return Ok(Vec::new());
    }
    keel_sim::cluster_from_specs(&specs).map_err(|e| invalid(spec, e.to_string()))
}

/// Why a comparison could not run.
#[derive(Debug, thiserror::Error)]
pub enum WhatifError {
    /// Named by the caller (`--policy`, `policy`).
    #[error(transparent)]
    UnknownPolicy(#[from] UnknownPolicy),
    #[error("the log names policy {name:?}, which this build does not know")]
    RecordedPolicyUnknown { name: String },
    #[error(
        "the history holds no job submitted in the range asked for (entries {first}..={last})"
    )]
    NoJobs { first: u64, last: u64 },
    #[error("{field}: {item:?}: {reason}")]
    AddedNodes {
        field: String,
        item: String,
        reason: String,
    },
}

/// What the log holds, as the report shows it.
#[derive(Debug, Serialize)]
pub struct HistorySummary {
    pub first_index: u64,
    pub last_index: u64,
    pub entries: u64,
    pub state_hash: String,
    pub jobs: usize,
    pub succeeded: usize,
    pub failed: usize,
    pub cancelled: usize,
    pub unfinished: usize,
    pub nodes: usize,
    pub gpus: u32,
    pub node_changes: usize,
    pub span_s: f64,
    /// The policies that decided, each from its first decision (seconds
    /// after the first submission).
    pub policies: Vec<PolicyFrom>,
    /// Jobs with at least one speed measured, and the figures (job × GPU
    /// type × allocation size) measured in all.
    pub jobs_measured: usize,
    pub speeds_measured: usize,
    /// Measured speeds over the table's (median): what unmeasured jobs
    /// run at, times the table.
    pub table_scale: f64,
    pub mean_jct_s: f64,
    pub utilisation: f64,
}

#[derive(Debug, Serialize)]
pub struct PolicyFrom {
    pub from_s: f64,
    pub name: String,
}

/// `keel whatif -o json`, and the console's what-if.
#[derive(Debug, Serialize)]
pub struct Report {
    pub history: HistorySummary,
    /// The `recorded` run on the recorded nodes against what happened.
    pub validation: Validation,
    /// The GPUs of each type the runs had, when not the recorded ones
    /// (another cluster, or nodes added).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub changed_cluster: Option<std::collections::BTreeMap<String, u32>>,
    pub runs: Vec<RunSummary>,
}

/// A comparison: its report, each run whole (`recorded` first), and the
/// history they ran (the jobs asked for).
#[derive(Debug)]
pub struct Compared {
    pub report: Report,
    pub runs: Vec<SimReport>,
    pub history: History,
}

/// The runs `policies` ask for, in order: `recorded` first, once, then
/// each other name once. Refused when one names no policy this build
/// knows, before any history is read.
pub fn run_names(policies: &[String], options: &PolicyOptions) -> Result<Vec<String>, WhatifError> {
    let mut names = vec![RECORDED.to_string()];
    for name in policies {
        if !names.contains(name) {
            if name != RECORDED {
                keel_scheduling::policy::by_name_with(name, options)?;
            }
            names.push(name.clone());
        }
    }
    Ok(names)
}

/// Runs `history` through `recorded` and the other policies of
/// `settings`, and reports each run and the `recorded` run's error on
/// what happened. Pure: the same history and settings give the same
/// report.
pub fn compare(mut history: History, settings: &Settings) -> Result<Compared, WhatifError> {
    let names = run_names(&settings.policies, &settings.options)?;
    let by_name = |name: &str| keel_scheduling::policy::by_name_with(name, &settings.options);
    if let Some(from_ms) = settings.submitted_from_ms {
        history.keep_submitted_from(from_ms);
    }
    if history.jobs.is_empty() {
        return Err(WhatifError::NoJobs {
            first: history.first_index,
            last: history.last_index,
        });
    }
    let workload = history.workload();
    let mut recorded = SimConfig::new(workload.nodes.clone(), workload.jobs.clone());
    recorded.node_changes = workload.node_changes.clone();
    recorded.queues = workload.queues.clone();
    recorded.table_scale = workload.table_scale;
    recorded.round_s = settings.round_s;
    recorded.progress_interval_s = settings.progress_interval_s;
    recorded.restart_s = settings.restart_s;
    let mut config = recorded.clone();
    if let Some((nodes, queues)) = &settings.cluster {
        config.nodes = nodes.clone();
        // Its queues, if it names any; else the recorded ones.
        if !queues.is_empty() {
            config.queues = queues.clone();
        }
        config.node_changes.clear();
    }
    config.nodes.extend(settings.added_nodes.iter().cloned());
    let changed = settings.cluster.is_some() || !settings.added_nodes.is_empty();
    let mut runs: Vec<SimReport> = Vec::new();
    for name in &names {
        let mut report = if name == RECORDED {
            run_recorded(&config, &workload, &settings.options)?
        } else {
            sim::simulate(&config, by_name(name)?.as_ref())
        };
        report.policy = name.clone();
        runs.push(report);
    }
    // The simulator's error is measured on the history's own nodes, so it
    // says how far to trust the runs on others.
    let validation = if changed {
        validate(
            &history,
            &run_recorded(&recorded, &workload, &settings.options)?,
        )
    } else {
        validate(&history, &runs[0])
    };
    let report = Report {
        history: summarise_history(&history, &workload),
        validation,
        changed_cluster: changed.then(|| gpus_by_type(&config.nodes)),
        runs: runs.iter().map(|r| summarise(&r.policy, r)).collect(),
    };
    Ok(Compared {
        report,
        runs,
        history,
    })
}

fn gpus_by_type(nodes: &[SimNode]) -> std::collections::BTreeMap<String, u32> {
    let mut by_type = std::collections::BTreeMap::new();
    for gpu in nodes.iter().flat_map(|n| &n.gpus) {
        *by_type.entry(gpu.gpu_type.clone()).or_default() += 1;
    }
    by_type
}

/// Runs the policies that decided, each from its first decision on (FIFO
/// throughout when none decided: the log does not name the server's
/// configured policy until one decides).
fn run_recorded(
    config: &SimConfig,
    workload: &RecordedWorkload,
    options: &PolicyOptions,
) -> Result<SimReport, WhatifError> {
    let mut boxed: Vec<(f64, Box<dyn Policy>)> = Vec::new();
    for (at, name) in &workload.policies {
        let policy = keel_scheduling::policy::by_name_with(name, options)
            .map_err(|_| WhatifError::RecordedPolicyUnknown { name: name.clone() })?;
        boxed.push((*at, policy));
    }
    let schedule: Vec<(f64, &dyn Policy)> = boxed.iter().map(|(at, p)| (*at, p.as_ref())).collect();
    Ok(sim::simulate_policies(config, &schedule))
}

fn summarise_history(history: &History, workload: &RecordedWorkload) -> HistorySummary {
    let ended = |end: RecordedEnd| {
        history
            .jobs
            .iter()
            .filter(|j| j.end.map(|(_, e)| e) == Some(end))
            .count()
    };
    let jcts: Vec<f64> = history.jobs.iter().filter_map(|j| j.jct_s()).collect();
    HistorySummary {
        first_index: history.first_index,
        last_index: history.last_index,
        entries: history.entries,
        state_hash: history.state_hash.clone(),
        jobs: history.jobs.len(),
        succeeded: ended(RecordedEnd::Succeeded),
        failed: ended(RecordedEnd::Failed),
        cancelled: ended(RecordedEnd::Cancelled),
        unfinished: history.jobs.iter().filter(|j| j.end.is_none()).count(),
        nodes: history.nodes.len(),
        gpus: history.total_gpus(),
        node_changes: history.node_changes.len(),
        span_s: history.end_ms().saturating_sub(history.first_ms) as f64 / 1000.0,
        policies: workload
            .policies
            .iter()
            .map(|(from_s, name)| PolicyFrom {
                from_s: *from_s,
                name: name.clone(),
            })
            .collect(),
        jobs_measured: workload.jobs_measured,
        speeds_measured: workload.speeds_measured,
        table_scale: workload.table_scale,
        mean_jct_s: if jcts.is_empty() {
            0.0
        } else {
            jcts.iter().sum::<f64>() / jcts.len() as f64
        },
        utilisation: history.utilisation(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// `COUNTxGPUSxTYPE` items become nodes named after their type; a bad
    /// item is refused naming the field, the item and what is wrong.
    #[test]
    fn added_nodes_are_read_from_count_gpus_and_type() {
        let nodes = added_nodes("add", "2x8xA100, 1x4xv100").expect("read");
        let shown: Vec<(String, usize, String)> = nodes
            .iter()
            .map(|n| (n.name.clone(), n.gpus.len(), n.gpus[0].gpu_type.clone()))
            .collect();
        assert_eq!(
            shown,
            [
                ("added-a100-0".to_string(), 8, "a100".to_string()),
                ("added-a100-1".to_string(), 8, "a100".to_string()),
                ("added-v100-0".to_string(), 4, "v100".to_string()),
            ]
        );
        assert!(added_nodes("add", " , ").expect("none").is_empty());
        for (spec, says) in [
            ("2x8", "expected COUNTxGPUSxTYPE"),
            ("0x8xa100", "COUNT must be a whole number ≥ 1, not \"0\""),
            (
                "2xeightxa100",
                "GPUS must be a whole number ≥ 1, not \"eight\"",
            ),
            ("2x2000xa100", "gpus must be between 1 and 1024"),
            ("6000x1xa100,5000x1xv100", "more than 10000 nodes in all"),
        ] {
            let refused = added_nodes("add", spec).expect_err(spec).to_string();
            assert!(refused.starts_with("add: "), "{refused}");
            assert!(refused.contains(says), "{spec}: {refused}");
        }
    }
}
