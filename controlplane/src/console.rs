//! The web console (issue 24, item 4; first part): a read-only page every
//! replica serves on its HTTP endpoint ([`crate::http`]) at `/`, drawn in
//! the browser from `/api/v1/cluster`: nodes as rows of GPU cells coloured
//! by the job holding them (a shared GPU split between its pair), the
//! jobs with their progress, the queues, and Raft as this replica sees it.
//!
//! The page is plain HTML, CSS and JavaScript compiled into the binary (no
//! CDN: it works on an air-gapped cluster). What it shows is the state this
//! replica applied, and nothing a job's owner may keep to themselves: no
//! command, environment or image of a job, only its name, queue, state,
//! GPUs and progress.
//!
//! [`view`] is a pure function of the state, tested without a server.

use std::collections::BTreeMap;

use keel_state::ClusterState;
use serde_json::{json, Value};

/// The page.
pub const INDEX_HTML: &str = include_str!("console/index.html");

/// What Raft says of this replica, for the page.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct RaftView {
    pub member: String,
    pub term: u64,
    pub leader: Option<String>,
    pub applied_index: u64,
    pub commit_index: u64,
    pub members: Vec<String>,
}

/// The most jobs the page lists (the unfinished ones first, then the most
/// recently ended): the page stays small on a cluster that keeps many.
pub const JOBS_SHOWN_MAX: usize = 1_000;

/// The cluster as the page draws it; `why_waiting` gives a waiting job's
/// reason (`keel job`'s).
pub fn view(
    state: &ClusterState,
    raft: &RaftView,
    why_waiting: impl Fn(&keel_state::model::Job) -> Option<String>,
) -> Value {
    // Which jobs hold each GPU (two for a shared one).
    let mut holders: BTreeMap<(&str, u32), Vec<u64>> = BTreeMap::new();
    for job in state.allocated_jobs() {
        if let Some(a) = &job.allocation {
            for g in &a.gpus {
                holders
                    .entry((g.node.as_str(), g.index))
                    .or_default()
                    .push(job.id);
            }
        }
    }
    let nodes: Vec<Value> = state
        .nodes()
        .values()
        .map(|n| {
            let gpus: Vec<Value> = n
                .gpus
                .iter()
                .map(|(index, gpu_type)| {
                    json!({
                        "index": index,
                        "type": gpu_type,
                        "jobs": holders.get(&(n.name.as_str(), *index)).cloned().unwrap_or_default(),
                    })
                })
                .collect();
            json!({ "name": n.name, "state": n.state.as_str(), "message": n.message, "gpus": gpus })
        })
        .collect();
    // The unfinished jobs, then the most recently ended, up to the limit.
    let mut shown: Vec<&keel_state::model::Job> = state.unfinished_jobs().collect();
    let mut ended: Vec<&keel_state::model::Job> = state
        .jobs()
        .values()
        .filter(|j| j.state.is_terminal())
        .collect();
    ended.sort_by_key(|j| std::cmp::Reverse((j.finished_at_ms, j.id)));
    shown.extend(ended);
    shown.truncate(JOBS_SHOWN_MAX);
    let jobs: Vec<Value> = shown
        .iter()
        .map(|j| {
            let progress = j.progress.as_ref().map(|p| {
                let remaining_s = (p.samples_per_s > 0.0 && p.total_steps > p.step)
                    .then(|| ((p.total_steps - p.step) as f64 / p.samples_per_s).round());
                json!({ "step": p.step, "total_steps": p.total_steps, "remaining_s": remaining_s })
            });
            json!({
                "id": j.id,
                "name": j.spec.name,
                "state": j.state.as_str(),
                "queue": keel_state::quota::queue_of(&j.spec.queue),
                "priority": j.spec.priority,
                "gpus": j.allocation.as_ref().map(|a| a.gpus.iter().map(|g| g.to_string()).collect::<Vec<_>>()).unwrap_or_default(),
                "shared_with": j.allocation.as_ref().and_then(|a| a.shared_with),
                "progress": progress,
                "message": why_waiting(j).unwrap_or_else(|| j.message.clone()),
            })
        })
        .collect();
    let usage = crate::api::queues::usage_by_queue(state);
    let queues: Vec<Value> = state
        .queues()
        .all()
        .keys()
        .map(|name| {
            let of_queue = usage.get(name.as_str());
            json!({
                "name": name,
                "pending": of_queue.map_or(0, |u| u.pending_jobs),
                "admitted": of_queue.map_or(0, |u| u.running_jobs),
            })
        })
        .collect();
    let counts: BTreeMap<&str, i64> = crate::metrics::jobs_by_state(state)
        .into_iter()
        .map(|(s, n)| (s.as_str(), n))
        .collect();
    json!({
        "applied_index": state.last_index(),
        "policy": state.policy(),
        "nodes": nodes,
        "jobs": jobs,
        "jobs_by_state": counts,
        "queues": queues,
        "raft": {
            "member": raft.member,
            "term": raft.term,
            "leader": raft.leader,
            "applied_index": raft.applied_index,
            "commit_index": raft.commit_index,
            "members": raft.members,
        },
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use keel_state::fixtures::{job_spec, TestCluster};
    use keel_state::model::GpuRef;

    #[test]
    fn the_view_puts_each_job_on_the_gpus_it_holds_and_no_command() {
        let mut c = TestCluster::v100_nodes(&[2, 2]);
        let a = c.submit(job_spec("a", 1, 2));
        let b = c.submit(job_spec("b", 4, 1));
        c.place(
            a,
            vec![
                GpuRef {
                    node: "n0".into(),
                    index: 1,
                },
                GpuRef {
                    node: "n1".into(),
                    index: 0,
                },
            ],
        );
        let v = view(&c.state, &RaftView::default(), |j| {
            (j.id == b).then(|| "waiting: the test's reason".to_string())
        });
        let gpu = |node: usize, index: usize| v["nodes"][node]["gpus"][index]["jobs"].clone();
        assert_eq!(gpu(0, 1), json!([a]));
        assert_eq!(gpu(1, 0), json!([a]));
        assert_eq!(gpu(0, 0), json!([]));
        assert_eq!(v["jobs_by_state"]["running"], json!(1));
        assert_eq!(v["jobs_by_state"]["pending"], json!(1));
        let jobs = v["jobs"].as_array().expect("jobs");
        assert_eq!(jobs.len(), 2);
        let job_b = jobs.iter().find(|j| j["id"] == json!(b)).expect("b shown");
        assert_eq!(job_b["state"], "pending");
        assert_eq!(job_b["queue"], "default");
        assert_eq!(job_b["message"], "waiting: the test's reason");
        assert_eq!(v["queues"][0]["pending"], json!(1));
        assert_eq!(v["queues"][0]["admitted"], json!(1));
        // Nothing of what a job runs.
        let text = v.to_string();
        assert!(!text.contains("train.py"), "{text}");
    }
}
