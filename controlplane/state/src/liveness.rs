//! Node liveness: which nodes have stopped reporting, and which are back.
//!
//! Every node has an agent (the server that declares it; later the SSH and
//! Kubernetes executors' probes) that reports it to the leader every second
//! or so, with its inventory. Reports are not log entries: the leader keeps
//! them in memory, in a [`NodeLiveness`] created when it starts to lead, and
//! turns what they mean into entries ([`NodeLiveness::due`]):
//!
//! - an Alive node not heard from for `timeout_ms` is marked lost (its jobs
//!   go back to the queue); a new leader counts every node as heard at the
//!   moment it started to lead, so a failover alone never loses a node;
//! - a node heard with an inventory that differs from the state's (or not in
//!   the state at all) is recorded (`RecordNodeInventory`: GPUs gone with
//!   why, GPUs added, decided by `apply` against the state it meets);
//! - a report whose entry was refused is not proposed again blindly: the
//!   same report waits [`REFUSED_BACKOFF_MIN_MS`], doubling up to
//!   [`REFUSED_BACKOFF_MAX_MS`] ([`NodeLiveness::refused`]); a changed
//!   report is tried at once;
//! - a node that this mechanism marked lost and that reports again is marked
//!   recovered;
//! - a node that an executor's probe could not reach ([`NodeLiveness::unreachable`])
//!   is lost after the same timeout, with the probe's reason in the entry;
//!   a declared node that was never reached is registered without GPUs and
//!   marked lost at once, so `keel nodes` shows it and why. A node an operator marked lost stays lost until the operator
//!   says otherwise (`keel node alive`).
//!
//! Pure: time comes in as arguments, maps are ordered.

use std::collections::BTreeMap;

use crate::command::Command;
use crate::model::{FailedGpu, Gpu, NodeState};
use crate::state::{validate_failed_gpus, validate_node, ApplyError, ClusterState};

/// The start of the reason recorded when liveness marks a node lost; how a
/// later leader knows that a returning node may be marked recovered.
pub const LOST_BY_LIVENESS: &str = "no heartbeat";

/// The longest probe failure kept (it goes into a `MarkNodeLost` reason).
pub const UNREACHABLE_REASON_MAX_LEN: usize = 1024;

/// How long a refused report waits before it is proposed again, at first.
pub const REFUSED_BACKOFF_MIN_MS: u64 = 1_000;
/// The longest wait between proposals of a report that keeps being refused.
pub const REFUSED_BACKOFF_MAX_MS: u64 = 300_000;

/// What a node's agent reports about it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct NodeReport {
    pub name: String,
    /// Where its workers reach each other (the rendezvous address).
    pub address: String,
    pub gpus: Vec<Gpu>,
    /// GPUs it has but cannot offer, with why (none of them in `gpus`).
    pub failed: Vec<FailedGpu>,
    /// Why it offers these GPUs when it has more (empty when it offers
    /// all): recorded with the registration, shown by `keel nodes`.
    pub note: String,
}

impl NodeReport {
    /// Checks the report against the same limits as a node's registration,
    /// and its names against the rules of a job spec's (a node name is a
    /// name, a GPU type a GPU type name). Only reports are held to the
    /// naming rules: entries already in a log replay as they were.
    pub fn validate(&self) -> Result<(), ApplyError> {
        let offered = validate_node(&self.name, &self.address, &self.gpus)?;
        if self.note.len() > crate::state::limits::NODE_NOTE_MAX_LEN {
            return Err(ApplyError::TooLarge {
                field: "note".into(),
                len: self.note.len(),
                limit: crate::state::limits::NODE_NOTE_MAX_LEN,
            });
        }
        if !crate::spec::is_valid_name(&self.name) {
            return Err(ApplyError::Invalid {
                field: "node name".into(),
                reason: format!(
                    "{:?}: only letters, digits, '-', '_' and '.' are allowed, not first '.'",
                    self.name
                ),
            });
        }
        // The same check `apply` makes of the entry: a failed GPU listed
        // twice, or also offered, is refused here rather than proposed.
        validate_failed_gpus(&self.name, &offered, &self.failed)?;
        let failed_types = self.failed.iter().map(|f| Gpu {
            index: f.index,
            gpu_type: f.gpu_type.clone(),
        });
        if let Some(gpu) = self
            .gpus
            .iter()
            .cloned()
            .chain(failed_types)
            .find(|g| !crate::spec::is_valid_gpu_type(&g.gpu_type))
        {
            return Err(ApplyError::Invalid {
                field: format!("node {} gpu {} type", self.name, gpu.index),
                reason: format!(
                    "{:?} is not a lower-case GPU type name such as \"v100\"",
                    gpu.gpu_type
                ),
            });
        }
        Ok(())
    }
}

/// The leader's view of when each node was last heard from.
#[derive(Debug, Clone)]
pub struct NodeLiveness {
    timeout_ms: u64,
    /// When this replica started to lead: nodes not heard from since are
    /// counted from here.
    leading_since_ms: u64,
    heard: BTreeMap<String, (u64, NodeReport)>,
    /// The latest failed probe per node: when, and why.
    failed: BTreeMap<String, (u64, String)>,
    /// The nodes the state held, or that were about to be registered, when
    /// last looked at ([`NodeLiveness::forget_removed`]).
    in_state: std::collections::BTreeSet<String>,
    /// Reports whose entry was refused, by node.
    refusals: BTreeMap<String, Refusal>,
}

/// A report whose entry the state machine refused, and when to try it again.
#[derive(Debug, Clone)]
struct Refusal {
    report: NodeReport,
    wait_ms: u64,
    next_try_ms: u64,
}

impl NodeLiveness {
    pub fn new(timeout_ms: u64, leading_since_ms: u64) -> Self {
        NodeLiveness {
            timeout_ms,
            leading_since_ms,
            heard: BTreeMap::new(),
            failed: BTreeMap::new(),
            in_state: Default::default(),
            refusals: BTreeMap::new(),
        }
    }

    /// Records that the entry proposed for `command` was refused at
    /// `now_ms`: the report it came from waits before it is proposed again
    /// (see the module's notes). Returns true when this report was not
    /// refused before, so the caller says once what is wrong.
    pub fn refused(&mut self, command: &Command, now_ms: u64) -> bool {
        let Command::RecordNodeInventory { name, .. } = command else {
            return false;
        };
        let Some((_, report)) = self.heard.get(name) else {
            return false;
        };
        let first = self.refusals.get(name).is_none_or(|r| r.report != *report);
        let wait_ms = match self.refusals.get(name) {
            Some(r) if !first => (r.wait_ms * 2).min(REFUSED_BACKOFF_MAX_MS),
            _ => REFUSED_BACKOFF_MIN_MS,
        };
        self.refusals.insert(
            name.clone(),
            Refusal {
                report: report.clone(),
                wait_ms,
                next_try_ms: now_ms.saturating_add(wait_ms),
            },
        );
        first
    }

    /// Whether the report heard from `name` waits after a refusal.
    fn waits_after_refusal(&self, name: &str, report: &NodeReport, now_ms: u64) -> bool {
        self.refusals
            .get(name)
            .is_some_and(|r| r.report == *report && now_ms < r.next_try_ms)
    }

    /// Forgets what was heard of nodes that left the state since the last
    /// call (an operator removed them): a report from before the removal
    /// does not register the node again; only one heard after it does (its
    /// agent still runs). Call before [`NodeLiveness::due`], whose
    /// registrations count as in the state (a removal may come before the
    /// next call sees them applied; a registration not yet applied by then
    /// waits for the node's next report).
    pub fn forget_removed(&mut self, state: &ClusterState) {
        let nodes = state.nodes();
        for name in &self.in_state {
            if !nodes.contains_key(name) {
                self.heard.remove(name);
                self.failed.remove(name);
                self.refusals.remove(name);
            }
        }
        self.in_state = nodes
            .keys()
            .chain(self.heard.keys())
            .chain(self.failed.keys())
            .cloned()
            .collect();
    }

    /// Records that a probe could not reach node `name` at `at_ms`.
    pub fn unreachable(&mut self, name: &str, reason: &str, at_ms: u64) {
        let mut reason = reason.to_string();
        crate::state::limits::cut_to(&mut reason, UNREACHABLE_REASON_MAX_LEN);
        match self.failed.get(name) {
            Some((last, _)) if *last > at_ms => {}
            _ => {
                self.failed.insert(name.to_string(), (at_ms, reason));
            }
        }
    }

    /// Why node `name` did not answer, if its latest probe failed after its
    /// latest report.
    fn failure(&self, name: &str) -> Option<&(u64, String)> {
        let failed = self.failed.get(name)?;
        match self.heard.get(name) {
            Some((at, _)) if *at >= failed.0 => None,
            _ => Some(failed),
        }
    }

    /// Records a report received at `at_ms`.
    pub fn heard(&mut self, report: NodeReport, at_ms: u64) {
        match self.heard.get(&report.name) {
            Some((last, _)) if *last > at_ms => {}
            _ => {
                self.heard.insert(report.name.clone(), (at_ms, report));
            }
        }
    }

    fn fresh(&self, at_ms: u64, now_ms: u64) -> bool {
        now_ms.saturating_sub(at_ms) <= self.timeout_ms
    }

    /// The entries that bring the state in line with what was heard by
    /// `now_ms`, in node-name order.
    pub fn due(&self, state: &ClusterState, now_ms: u64) -> Vec<Command> {
        let mut out = Vec::new();
        for (name, node) in state.nodes() {
            if node.state != NodeState::Alive {
                continue;
            }
            let last = self
                .heard
                .get(name)
                .map_or(self.leading_since_ms, |(at, _)| {
                    (*at).max(self.leading_since_ms)
                });
            if !self.fresh(last, now_ms) {
                let why = self
                    .failure(name)
                    .map(|(_, reason)| format!(": {reason}"))
                    .unwrap_or_default();
                out.push(Command::mark_node_lost(
                    name.clone(),
                    format!(
                        "{LOST_BY_LIVENESS} for {:.1} s{why}",
                        now_ms.saturating_sub(last) as f64 / 1000.0
                    ),
                ));
            }
        }
        // Declared nodes that were never reached: shown, lost, with why.
        for (name, (at_ms, reason)) in &self.failed {
            if state.nodes().contains_key(name)
                || self.heard.contains_key(name)
                || !self.fresh(*at_ms, now_ms)
            {
                continue;
            }
            out.push(Command::register_node(
                name.clone(),
                String::new(),
                Vec::new(),
            ));
            out.push(Command::mark_node_lost(
                name.clone(),
                format!("{LOST_BY_LIVENESS} since it was declared: {reason}"),
            ));
        }
        for (name, (at_ms, report)) in &self.heard {
            if !self.fresh(*at_ms, now_ms) {
                continue;
            }
            let known = state.nodes().get(name);
            let lost_by_us = known.is_some_and(|n| {
                n.state == NodeState::Lost && n.message.starts_with(LOST_BY_LIVENESS)
            });
            if known.is_some_and(|n| n.state == NodeState::Lost) && !lost_by_us {
                continue;
            }
            let same_inventory = known.is_some_and(|n| {
                n.address == report.address
                    && (n.state == NodeState::Lost || n.message == report.note)
                    && n.gpus.len() == report.gpus.len()
                    && report
                        .gpus
                        .iter()
                        .all(|g| n.gpus.get(&g.index) == Some(&g.gpu_type))
                    && report.failed.iter().all(|f| {
                        n.gone_gpus
                            .get(&f.index)
                            .is_some_and(|g| g.gpu_type == f.gpu_type && g.reason == f.reason)
                    })
            });
            if !same_inventory {
                if self.waits_after_refusal(name, report, now_ms) {
                    continue;
                }
                out.push(Command::RecordNodeInventory {
                    name: name.clone(),
                    address: report.address.clone(),
                    gpus: report.gpus.clone(),
                    failed: report.failed.clone(),
                    note: report.note.clone(),
                });
            } else if lost_by_us {
                out.push(Command::mark_node_recovered(name.clone()));
            }
        }
        out
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::command::LogEntry;

    const TIMEOUT_MS: u64 = 10_000;

    fn report(name: &str, gpus: u32) -> NodeReport {
        NodeReport {
            name: name.into(),
            address: "10.0.0.1".into(),
            gpus: (0..gpus)
                .map(|index| Gpu {
                    index,
                    gpu_type: "v100".into(),
                })
                .collect(),
            failed: Vec::new(),
            note: String::new(),
        }
    }

    /// Issue 19, item 6: a heartbeat's names follow the job spec's rules.
    #[test]
    fn a_report_with_a_path_for_a_name_or_a_shouted_gpu_type_is_refused() {
        assert!(report("gpu-a_1.rack2", 2).validate().is_ok());
        for bad in ["../../x", "a/b", ".hidden", "", "a b"] {
            let err = report(bad, 1).validate().expect_err(bad);
            assert!(err.to_string().contains("node name"), "{bad}: {err}");
        }
        let mut shouted = report("n", 1);
        shouted.gpus[0].gpu_type = "V100!".into();
        let err = shouted.validate().expect_err("refused");
        assert!(err.to_string().contains("V100!"), "{err}");
    }

    /// A failed GPU that is also offered, or listed twice, is refused by
    /// the report's own check, as `apply` would refuse the entry.
    #[test]
    fn a_report_listing_a_gpu_twice_is_refused_before_it_is_proposed() {
        let failed = |index: u32| FailedGpu {
            index,
            gpu_type: "v100".into(),
            reason: "Xid 79".into(),
        };
        let mut fine = report("n", 1);
        fine.failed = vec![failed(1)];
        assert!(fine.validate().is_ok());
        let mut offered_and_failed = report("n", 2);
        offered_and_failed.failed = vec![failed(1)];
        let mut failed_twice = report("n", 1);
        failed_twice.failed = vec![failed(1), failed(1)];
        for bad in [offered_and_failed, failed_twice] {
            let err = bad.validate().expect_err("refused");
            assert_eq!(
                err,
                ApplyError::DuplicateGpu {
                    node: "n".into(),
                    index: 1
                }
            );
        }
    }

    struct World {
        state: ClusterState,
        index: u64,
    }

    impl World {
        fn new() -> World {
            World {
                state: ClusterState::new(),
                index: 0,
            }
        }

        /// Applies what liveness asks for at `now_ms`; returns the command kinds.
        fn settle(&mut self, liveness: &NodeLiveness, now_ms: u64) -> Vec<&'static str> {
            let due = liveness.due(&self.state, now_ms);
            let kinds = due.iter().map(Command::kind).collect();
            for command in due {
                self.apply(command, now_ms);
            }
            kinds
        }

        fn apply(&mut self, command: Command, at_ms: u64) {
            self.index += 1;
            self.state
                .apply(self.index, &LogEntry::new(at_ms, command))
                .expect("applies");
        }

        fn node_state(&self, name: &str) -> NodeState {
            self.state.nodes()[name].state
        }
    }

    #[test]
    fn a_reported_node_is_registered_once() {
        let mut w = World::new();
        let mut l = NodeLiveness::new(TIMEOUT_MS, 0);
        l.heard(report("a", 4), 100);
        assert_eq!(w.settle(&l, 200), vec!["record_node_inventory"]);
        l.heard(report("a", 4), 1_100);
        assert!(
            w.settle(&l, 1_200).is_empty(),
            "same inventory: nothing to do"
        );
        l.heard(report("a", 8), 2_100);
        assert_eq!(
            w.settle(&l, 2_200),
            vec!["record_node_inventory"],
            "GPUs added"
        );
    }

    /// Issue 19, item 5: a removed node is not registered again from a
    /// report heard before its removal; a report after it (its agent still
    /// runs) registers it again.
    #[test]
    fn a_removed_node_stays_removed_until_it_reports_again() {
        let mut w = World::new();
        let mut l = NodeLiveness::new(TIMEOUT_MS, 0);
        l.heard(report("a", 1), 0);
        l.forget_removed(&w.state);
        // Registered, and removed before liveness looks again.
        w.settle(&l, 0);
        w.apply(Command::remove_node("a", false), 1_000);
        assert!(w.state.nodes().is_empty());
        l.forget_removed(&w.state);
        assert!(
            w.settle(&l, 2_000).is_empty(),
            "the report from before the removal is forgotten"
        );
        l.heard(report("a", 1), 3_000);
        l.forget_removed(&w.state);
        assert_eq!(w.settle(&l, 3_000), vec!["record_node_inventory"]);
    }

    #[test]
    fn a_silent_node_is_lost_after_the_timeout_and_recovers_when_heard() {
        let mut w = World::new();
        let mut l = NodeLiveness::new(TIMEOUT_MS, 0);
        l.heard(report("a", 1), 0);
        l.heard(report("b", 1), 0);
        w.settle(&l, 0);
        l.heard(report("a", 1), 9_000);
        assert!(
            w.settle(&l, TIMEOUT_MS).is_empty(),
            "not yet past the timeout"
        );
        assert_eq!(w.settle(&l, TIMEOUT_MS + 1), vec!["mark_node_lost"]);
        assert_eq!(w.node_state("b"), NodeState::Lost);
        assert_eq!(w.node_state("a"), NodeState::Alive);
        assert!(w.state.nodes()["b"].message.starts_with(LOST_BY_LIVENESS));
        assert!(w.settle(&l, TIMEOUT_MS + 2).is_empty(), "lost once");
        l.heard(report("b", 1), 12_000);
        assert_eq!(w.settle(&l, 12_000), vec!["mark_node_recovered"]);
        assert_eq!(w.node_state("b"), NodeState::Alive);
    }

    #[test]
    fn an_unreachable_node_is_lost_with_the_reason_and_a_never_reached_one_is_shown() {
        let mut w = World::new();
        let mut l = NodeLiveness::new(TIMEOUT_MS, 0);
        l.heard(report("a", 2), 0);
        w.settle(&l, 0);
        l.unreachable("a", "ssh 10.0.0.1:22: Connection refused", 3_000);
        assert!(w.settle(&l, 5_000).is_empty(), "a blip is not a loss");
        assert_eq!(w.settle(&l, TIMEOUT_MS + 1), vec!["mark_node_lost"]);
        let message = &w.state.nodes()["a"].message;
        assert!(message.starts_with(LOST_BY_LIVENESS), "{message}");
        assert!(
            message.ends_with(": ssh 10.0.0.1:22: Connection refused"),
            "{message}"
        );
        l.heard(report("a", 2), 12_000);
        assert_eq!(w.settle(&l, 12_000), vec!["mark_node_recovered"]);
        // Declared, never reached: registered without GPUs and lost at once.
        l.unreachable("b", "Permission denied (publickey)", 13_000);
        assert_eq!(
            w.settle(&l, 13_000),
            vec!["register_node", "mark_node_lost"]
        );
        let b = &w.state.nodes()["b"];
        assert_eq!((b.state, b.gpus.len()), (NodeState::Lost, 0));
        assert!(b.message.contains("Permission denied"), "{}", b.message);
        assert!(w.settle(&l, 14_000).is_empty(), "shown once");
        // Reached at last: registered with its GPUs, alive.
        l.heard(report("b", 4), 15_000);
        assert_eq!(w.settle(&l, 15_000), vec!["record_node_inventory"]);
        assert_eq!(w.node_state("b"), NodeState::Alive);
        assert_eq!(w.state.nodes()["b"].gpus.len(), 4);
    }

    #[test]
    fn a_new_leader_counts_every_node_as_heard_when_it_started() {
        let mut w = World::new();
        let mut first = NodeLiveness::new(TIMEOUT_MS, 0);
        first.heard(report("a", 1), 0);
        w.settle(&first, 0);
        // Leadership moves at 50 s; the new leader has heard nothing yet.
        let second = NodeLiveness::new(TIMEOUT_MS, 50_000);
        assert!(w.settle(&second, 50_000 + TIMEOUT_MS).is_empty());
        assert_eq!(
            w.settle(&second, 50_001 + TIMEOUT_MS),
            vec!["mark_node_lost"]
        );
    }

    #[test]
    fn a_node_an_operator_marked_lost_stays_lost() {
        let mut w = World::new();
        let mut l = NodeLiveness::new(TIMEOUT_MS, 0);
        l.heard(report("a", 1), 0);
        w.settle(&l, 0);
        w.apply(Command::mark_node_lost("a", "maintenance"), 1);
        l.heard(report("a", 2), 1_000);
        assert!(w.settle(&l, 1_000).is_empty());
        assert_eq!(w.node_state("a"), NodeState::Lost);
    }

    #[test]
    fn an_old_report_does_not_replace_a_newer_one() {
        let mut l = NodeLiveness::new(TIMEOUT_MS, 0);
        l.heard(report("a", 1), 5_000);
        l.heard(report("a", 2), 4_000);
        let mut w = World::new();
        w.settle(&l, 5_000);
        assert_eq!(w.state.nodes()["a"].gpus.len(), 1);
    }

    /// Issue 33: a refused report is not proposed again every tick; it
    /// waits 1 s, then 2 s, 4 s ... up to 5 min; a changed report is tried
    /// at once, and the caller is told to say so once per report.
    #[test]
    fn a_refused_report_backs_off_and_a_changed_one_is_tried_at_once() {
        let w = World::new();
        let mut l = NodeLiveness::new(TIMEOUT_MS, 0);
        l.heard(report("a", 2), 0);
        let due = l.due(&w.state, 0);
        assert_eq!(due.len(), 1);
        assert!(l.refused(&due[0], 0), "first refusal of this report");
        assert!(l.due(&w.state, 999).is_empty(), "waits 1 s");
        l.heard(report("a", 2), 1_000);
        let again = l.due(&w.state, 1_000);
        assert_eq!(again.len(), 1, "tried again after 1 s");
        assert!(!l.refused(&again[0], 1_000), "said once");
        l.heard(report("a", 2), 2_999);
        assert!(l.due(&w.state, 2_999).is_empty(), "then 2 s");
        let mut at = 3_000;
        let mut proposals = 1;
        // An hour of refusals: a bounded number of entries.
        while at < 3_600_000 {
            l.heard(report("a", 2), at);
            for command in l.due(&w.state, at) {
                proposals += 1;
                l.refused(&command, at);
            }
            at += 200;
        }
        assert!(proposals < 25, "{proposals} proposals in an hour");
        // Another report is tried at once.
        l.heard(report("a", 3), at);
        assert_eq!(l.due(&w.state, at).len(), 1);
    }

    /// Issue 33: a GPU the node reports failed is recorded gone with its
    /// reason, once; the same report again changes nothing.
    #[test]
    fn a_failed_gpu_is_recorded_once_with_its_reason() {
        let mut w = World::new();
        let mut l = NodeLiveness::new(TIMEOUT_MS, 0);
        l.heard(report("a", 2), 0);
        w.settle(&l, 0);
        let mut failing = report("a", 1);
        failing.failed.push(FailedGpu {
            index: 1,
            gpu_type: "v100".into(),
            reason: "Xid 79: GPU has fallen off the bus".into(),
        });
        l.heard(failing.clone(), 1_000);
        assert_eq!(w.settle(&l, 1_000), vec!["record_node_inventory"]);
        let gone = &w.state.nodes()["a"].gone_gpus;
        assert_eq!(gone[&1].reason, "Xid 79: GPU has fallen off the bus");
        l.heard(failing, 2_000);
        assert!(w.settle(&l, 2_000).is_empty(), "recorded once");
    }
}
