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

/// Where the page holds what it first shows (`null` until the server
/// inlines it: [`crate::http`]'s `/`).
pub const INITIAL_MARK: &str = "/*KEEL_INITIAL*/null";

/// The page with `initial` inlined where [`INITIAL_MARK`] is: JSON whose
/// `<`, `>` and `&` are escaped, so no text in it (a message a worker's
/// exit or a node's report gave) can close the script element it sits in.
pub fn page_with(initial: &Value) -> String {
    let inlined = initial
        .to_string()
        .replace('<', "\\u003c")
        .replace('>', "\\u003e")
        .replace('&', "\\u0026");
    INDEX_HTML.replacen(INITIAL_MARK, &inlined, 1)
}

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
        .map(Box::as_ref)
        .collect();
    ended.sort_by_key(|j| std::cmp::Reverse((j.finished_at_ms, j.id)));
    shown.extend(ended);
    shown.truncate(JOBS_SHOWN_MAX);
    let jobs: Vec<Value> = shown
        .iter()
        .map(|j| job_json(j, why_waiting(j).unwrap_or_else(|| j.message.clone())))
        .collect();
    let usage = crate::api::queues::usage_by_queue(state);
    let queues: Vec<Value> = state
        .queues()
        .each()
        .keys()
        .map(|name| {
            let of_queue = usage.get(*name);
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

/// A job as the page lists it, with `message` (why it waits, or its own).
fn job_json(j: &keel_state::model::Job, message: String) -> Value {
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
        "submitted_at_ms": j.submitted_at_ms,
        "finished_at_ms": j.finished_at_ms,
        "message": message,
    })
}

/// An applied entry as the page shows it: where it is in the log, when,
/// what it did in the words of `keel events` (its `events`, or why it
/// was refused) and who asked.
fn entry_json(
    record: &keel_proto::entry::AppliedEntry,
    events: &[&keel_proto::entry::Event],
) -> Value {
    let what = if record.refused.is_empty() {
        events
            .iter()
            .map(|e| crate::history::describe_event(e))
            .collect::<Vec<_>>()
            .join("; ")
    } else {
        format!("refused: {}", record.refused)
    };
    json!({
        "index": record.index,
        "position": record.position,
        "at_ms": record.at_ms,
        "command": record.command,
        "what": what,
        "by": crate::history::actor(record),
    })
}

/// An applied entry as the page's live feed shows it (all its events).
pub fn feed_entry(record: &keel_proto::entry::AppliedEntry) -> Value {
    let events: Vec<&keel_proto::entry::Event> = record.events.iter().collect();
    entry_json(record, &events)
}

/// A job's page (`/api/v1/jobs/ID`): the job as the list shows it
/// (`null` once retention removed it), its history entry by entry in the
/// words of `keel why`, and its allocations over log time (the Gantt):
/// each from the entry that placed it to the one that took it away
/// (preemption, a requeue, its end; none yet: it still holds it).
pub fn job_page(
    job_id: u64,
    job: Option<(&keel_state::model::Job, String)>,
    history: &[keel_proto::entry::AppliedEntry],
    truncated: bool,
) -> Value {
    use keel_proto::entry::event::Kind as K;
    let mut allocations: Vec<Value> = Vec::new();
    let mut open: Option<usize> = None;
    let mut entries: Vec<Value> = Vec::new();
    for record in history {
        let mine: Vec<&keel_proto::entry::Event> = record
            .events
            .iter()
            .filter(|e| crate::history::event_job_id(e) == Some(job_id))
            .collect();
        for e in &mine {
            // What takes the allocation away (a new one replaces it).
            let ends = match &e.kind {
                Some(K::JobAllocated(_)) => Some("moved"),
                Some(K::JobPreempted(_)) => Some("preempted"),
                Some(K::JobRequeued(_)) => Some("requeued"),
                Some(K::JobFinished(x)) => Some(x.state.as_str()),
                Some(K::JobCancelled(_)) => Some("cancelled"),
                Some(K::JobRemoved(_)) => Some("removed"),
                _ => None,
            };
            if let (Some(how), Some(i)) = (ends, open) {
                allocations[i]["to_index"] = json!(record.index);
                allocations[i]["to_ms"] = json!(record.at_ms);
                allocations[i]["ended_by"] = json!(how);
                open = None;
            }
            if let Some(K::JobAllocated(x)) = &e.kind {
                open = Some(allocations.len());
                allocations.push(json!({
                    "epoch": x.epoch,
                    "gpus": x.gpus.iter().map(|g| format!("{}/{}", g.node, g.index)).collect::<Vec<_>>(),
                    "shared_with": x.shared_with,
                    "policy": x.policy,
                    "round": x.round,
                    "from_index": record.index,
                    "from_ms": record.at_ms,
                    "to_index": null,
                    "to_ms": null,
                    "ended_by": null,
                }));
            }
        }
        entries.push(entry_json(record, &mine));
    }
    json!({
        "id": job_id,
        "job": job.map(|(j, message)| job_json(j, message)),
        "history": entries,
        "truncated": truncated,
        "allocations": allocations,
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

    #[test]
    fn a_job_page_draws_each_allocation_from_its_placement_to_what_ended_it() {
        use keel_proto::entry::{event::Kind, AppliedEntry, Event};
        use keel_proto::entry::{GpuRef as Gpu, JobAllocated, JobFinished, JobPreempted};
        let record = |index: u64, command: &str, kinds: Vec<Kind>| AppliedEntry {
            index,
            at_ms: index * 1_000,
            command: command.into(),
            events: kinds.into_iter().map(|k| Event { kind: Some(k) }).collect(),
            ..AppliedEntry::default()
        };
        let allocated = |epoch: u64, gpu: u32| {
            Kind::JobAllocated(JobAllocated {
                job_id: 7,
                epoch,
                gpus: vec![Gpu {
                    node: "n".into(),
                    index: gpu,
                }],
                policy: "fifo".into(),
                round: epoch,
                ..JobAllocated::default()
            })
        };
        let history = vec![
            record(3, "decide_allocation", vec![allocated(1, 0)]),
            record(
                5,
                "decide_allocation",
                vec![Kind::JobPreempted(JobPreempted {
                    job_id: 7,
                    reason: "a job of higher priority".into(),
                })],
            ),
            // Another job's event in the same entry is not this job's.
            record(
                8,
                "decide_allocation",
                vec![
                    allocated(2, 1),
                    Kind::JobAllocated(JobAllocated {
                        job_id: 8,
                        epoch: 1,
                        ..JobAllocated::default()
                    }),
                ],
            ),
            record(
                9,
                "finish_job",
                vec![Kind::JobFinished(JobFinished {
                    job_id: 7,
                    state: "succeeded".into(),
                    reason: String::new(),
                })],
            ),
        ];
        let page = job_page(7, None, &history, false);
        let a = page["allocations"].as_array().expect("allocations");
        assert_eq!(a.len(), 2, "{page}");
        assert_eq!(
            (
                &a[0]["gpus"],
                &a[0]["from_index"],
                &a[0]["to_index"],
                &a[0]["ended_by"]
            ),
            (&json!(["n/0"]), &json!(3), &json!(5), &json!("preempted"))
        );
        assert_eq!(
            (
                &a[1]["gpus"],
                &a[1]["from_ms"],
                &a[1]["to_ms"],
                &a[1]["ended_by"]
            ),
            (
                &json!(["n/1"]),
                &json!(8_000),
                &json!(9_000),
                &json!("succeeded")
            )
        );
        assert_eq!(page["job"], Value::Null, "removed");
        let words: Vec<&str> = page["history"]
            .as_array()
            .expect("history")
            .iter()
            .filter_map(|h| h["what"].as_str())
            .collect();
        assert_eq!(words[1], "job 7 preempted: a job of higher priority");
        assert_eq!(page["history"][0]["by"], "leader");
        // Still holding: no end yet.
        let holding = job_page(7, None, &history[..1], false);
        assert_eq!(holding["allocations"][0]["to_index"], Value::Null);
    }

    #[test]
    fn what_the_page_inlines_cannot_close_its_script() {
        let initial = json!({ "error": "</script><script>alert(1)</script> & more" });
        let page = page_with(&initial);
        assert!(!page.contains("</script><script>alert"), "{page}");
        assert!(!page.contains(INITIAL_MARK));
        // The browser reads the same text back.
        let inlined = page
            .split("<script id=\"initial\" type=\"application/json\">")
            .nth(1)
            .and_then(|rest| rest.split("</script>").next())
            .expect("the inlined JSON");
        let read: Value = serde_json::from_str(inlined).expect("JSON");
        assert_eq!(read, initial);
    }
}
