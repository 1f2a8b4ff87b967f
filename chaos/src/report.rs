//! A run's report: what was injected, what the clients saw, what the
//! checks found, and how long the cluster took to recover.

use std::collections::BTreeMap;

use serde::Serialize;

use crate::checker::{FinalReplica, Findings};
use crate::faults::Round;
use crate::workload::{Op, Outcome, Request};

/// Milliseconds at the 50th and 99th percentile and the maximum.
#[derive(Debug, Clone, Default, Serialize)]
pub struct Percentiles {
    pub count: usize,
    pub p50_ms: u64,
    pub p99_ms: u64,
    pub max_ms: u64,
}

impl Percentiles {
    pub fn of(mut samples: Vec<u64>) -> Percentiles {
        samples.sort_unstable();
        let at = |q: f64| -> u64 {
            if samples.is_empty() {
                return 0;
            }
            let i = ((samples.len() as f64 - 1.0) * q).round() as usize;
            samples[i.min(samples.len() - 1)]
        };
        Percentiles {
            count: samples.len(),
            p50_ms: at(0.5),
            p99_ms: at(0.99),
            max_ms: samples.last().copied().unwrap_or(0),
        }
    }
}

/// Operations by outcome.
#[derive(Debug, Clone, Default, Serialize)]
pub struct OpCounts {
    pub acknowledged: u64,
    pub failed: u64,
    pub indeterminate: u64,
}

/// What happened in one round.
#[derive(Debug, Clone, Serialize)]
pub struct RoundReport {
    pub round: Round,
    /// The replicas the fault hit.
    pub victims: Vec<u64>,
    pub injected_at_ms: u64,
    /// From injection to the first write acknowledged by the replicas left
    /// (faults that take the leader while a majority remains).
    pub failover_ms: Option<u64>,
    /// From the heal to a write acknowledged again.
    pub heal_ms: Option<u64>,
}

/// The whole run.
#[derive(Debug, Clone, Serialize)]
pub struct Report {
    pub seed: u64,
    pub replicas: u64,
    pub rounds: Vec<RoundReport>,
    pub faults_by_kind: BTreeMap<String, u64>,
    /// By operation kind (`submit`, `cancel`, `get`, `set_node`).
    pub operations: BTreeMap<String, OpCounts>,
    pub lost: usize,
    pub duplicated: usize,
    pub divergent: usize,
    pub invariant_violations: usize,
    pub linearizability_violations: usize,
    pub failover: Percentiles,
    pub heal: Percentiles,
    /// Liveness failures: a heal or the final scheduling check that took
    /// longer than the bound.
    pub liveness: Vec<String>,
    /// Replicas whose process ended without the harness stopping it (a
    /// crash, or a failure to start again): how it ended and the end of
    /// its log. Any fails the run.
    pub crashes: Vec<String>,
    pub findings: Findings,
    pub replicas_final: Vec<FinalReplica>,
    pub wall_s: f64,
    pub passed: bool,
    /// For a failed run: how to run it again, and the operations the
    /// findings name.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub reproduce: Option<String>,
}

impl Report {
    pub fn operations_of(history: &[Op]) -> BTreeMap<String, OpCounts> {
        let mut out: BTreeMap<String, OpCounts> = BTreeMap::new();
        for op in history {
            let kind = match op.request {
                Request::Submit { .. } => "submit",
                Request::Cancel { .. } => "cancel",
                Request::Get { .. } => "get",
                Request::SetNode { .. } => "set_node",
            };
            let c = out.entry(kind.to_string()).or_default();
            match op.outcome {
                Outcome::Ok { .. } => c.acknowledged += 1,
                Outcome::Failed { .. } => c.failed += 1,
                Outcome::Indeterminate { .. } => c.indeterminate += 1,
            }
        }
        out
    }

    /// The report for a person.
    pub fn text(&self) -> String {
        let mut s = String::new();
        let verdict = if self.passed { "PASSED" } else { "FAILED" };
        s.push_str(&format!(
            "keel-chaos: {verdict}: seed {}, {} replicas, {} rounds, {:.1} s\n",
            self.seed,
            self.replicas,
            self.rounds.len(),
            self.wall_s
        ));
        s.push_str("faults:");
        for (k, n) in &self.faults_by_kind {
            s.push_str(&format!(" {k} {n},"));
        }
        s.push('\n');
        for (k, c) in &self.operations {
            s.push_str(&format!(
                "{k}: {} acknowledged, {} failed, {} indeterminate\n",
                c.acknowledged, c.failed, c.indeterminate
            ));
        }
        s.push_str(&format!(
            "lost {}, duplicated {}, divergent {}, invariant violations {}, linearizability violations {}\n",
            self.lost,
            self.duplicated,
            self.divergent,
            self.invariant_violations,
            self.linearizability_violations
        ));
        s.push_str(&format!(
            "failover (n={}): p50 {} ms, p99 {} ms, max {} ms; heal (n={}): p50 {} ms, p99 {} ms, max {} ms\n",
            self.failover.count,
            self.failover.p50_ms,
            self.failover.p99_ms,
            self.failover.max_ms,
            self.heal.count,
            self.heal.p50_ms,
            self.heal.p99_ms,
            self.heal.max_ms
        ));
        for l in &self.liveness {
            s.push_str(&format!("liveness: {l}\n"));
        }
        for c in &self.crashes {
            s.push_str(&format!("crash: {c}\n"));
        }
        let f = &self.findings;
        for (what, list) in [
            ("lost", &f.lost),
            ("duplicated", &f.duplicated),
            ("divergent", &f.divergent),
            ("invariant", &f.invariant_violations),
            ("linearizability", &f.linearizability),
        ] {
            for item in list.iter().take(5) {
                s.push_str(&format!("{what}: {item}\n"));
            }
        }
        if let Some(r) = &self.reproduce {
            s.push_str(r);
            s.push('\n');
        }
        s
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn percentiles_pick_ranks() {
        let p = Percentiles::of((1..=100).collect());
        assert_eq!((p.count, p.p50_ms, p.p99_ms, p.max_ms), (100, 51, 99, 100));
        assert_eq!(Percentiles::of(Vec::new()).max_ms, 0);
    }
}
