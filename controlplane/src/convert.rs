//! Domain objects to their API messages, and the one way back a client
//! needs (an older server's job as a record).

use std::borrow::Cow;

use keel_proto::api;
use keel_proto::entry::{JobRecord, WorkerRecord};
use keel_state::proto_form::ProtoForm;
use keel_state::{Job, Node};

/// The job as the API answers it: its state record (`Job::to_record`,
/// one encoding of a job), and the v1 summary read from that record, the
/// inverse of [`record_of`].
pub fn job_to_proto(job: &Job) -> api::Job {
    let record = job.to_record();
    api::Job {
        id: record.id,
        spec: record.spec.clone(),
        state: record.state.clone(),
        submitted_at_ms: record.submitted_at_ms,
        started_at_ms: record.started_at_ms.unwrap_or(0),
        finished_at_ms: record.finished_at_ms.unwrap_or(0),
        allocation: record.allocation.as_ref().map(|a| api::Allocation {
            epoch: a.epoch,
            gpus: a.gpus.clone(),
            based_on: a.based_on,
            policy: a.policy.clone(),
            decided_at_ms: a.decided_at_ms,
            shared_with: a.shared_with,
        }),
        progress: record.progress,
        workers: record
            .workers
            .iter()
            .map(|w| api::Worker {
                rank: w.rank,
                epoch: w.epoch,
                node: w.node.clone(),
                state: w.state.clone(),
                exit_code: w.exit_code,
            })
            .collect(),
        message: record.message.clone(),
        retries: record.retries,
        max_retries: job.spec.max_retries,
        not_before_ms: record.not_before_ms.unwrap_or(0),
        estimate: None,
        submitted_by: record.submitted_by.clone().unwrap_or_default(),
        trace_id: record
            .trace_parent
            .as_deref()
            .and_then(crate::traces::trace_id_of)
            .unwrap_or_default(),
        record: Some(record),
    }
}

/// The job's record (`api::Job.record`), what `keel job` shows. A server
/// from before that field sends only the v1 summary; the record is then
/// rebuilt from it, with what the summary does not carry left empty. This
/// function knows only the summary's fields, which gain nothing new, so a
/// field a job gains never touches it.
pub fn record_of(job: &api::Job) -> Cow<'_, JobRecord> {
    if let Some(record) = &job.record {
        return Cow::Borrowed(record);
    }
    Cow::Owned(JobRecord {
        id: job.id,
        spec: job.spec.clone(),
        state: job.state.clone(),
        submitted_at_ms: job.submitted_at_ms,
        started_at_ms: (job.started_at_ms != 0).then_some(job.started_at_ms),
        finished_at_ms: (job.finished_at_ms != 0).then_some(job.finished_at_ms),
        allocation: job
            .allocation
            .as_ref()
            .map(|a| keel_proto::entry::Allocation {
                epoch: a.epoch,
                gpus: a.gpus.clone(),
                based_on: a.based_on,
                policy: a.policy.clone(),
                round: 0,
                decided_at_ms: a.decided_at_ms,
                shared_with: a.shared_with,
            }),
        workers: job
            .workers
            .iter()
            .map(|w| WorkerRecord {
                rank: w.rank,
                epoch: w.epoch,
                node: w.node.clone(),
                state: w.state.clone(),
                exit_code: w.exit_code,
            })
            .collect(),
        progress: job.progress,
        retries: job.retries,
        not_before_ms: (job.not_before_ms != 0).then_some(job.not_before_ms),
        message: job.message.clone(),
        submitted_by: Some(job.submitted_by.clone()).filter(|s| !s.is_empty()),
        ..JobRecord::default()
    })
}

/// The performance models' estimate for `job`, as `GetJob` returns it.
pub fn estimate_to_proto(e: &keel_scheduling::perf::Estimate) -> api::JobEstimate {
    api::JobEstimate {
        remaining_steps: e.remaining_steps,
        steps_per_s: e.steps_per_s,
        remaining_s: e.remaining_s,
        gpus: e.gpus,
        gpu_type: e.gpu_type.clone(),
        speed_source: e.speed_source.as_str().to_string(),
    }
}

pub fn node_to_proto<'a>(
    node: &Node,
    holders: impl Iterator<Item = (&'a keel_state::GpuRef, &'a keel_state::GpuHolders)>,
    owned: bool,
) -> api::Node {
    let here: Vec<(u32, keel_state::GpuHolders)> = holders
        .filter(|(g, _)| g.node == node.name)
        .map(|(g, h)| (g.index, *h))
        .collect();
    api::Node {
        name: node.name.clone(),
        address: node.address.clone(),
        state: node.state.as_str().to_string(),
        gpus: node
            .gpus
            .iter()
            .map(|(index, gpu_type)| {
                keel_state::Gpu {
                    index: *index,
                    gpu_type: gpu_type.clone(),
                }
                .to_proto()
            })
            .collect(),
        gpu_holders: here.iter().map(|(i, h)| (*i, h.job)).collect(),
        gpu_sharers: here
            .iter()
            .filter_map(|(i, h)| Some((*i, h.sharer?)))
            .collect(),
        unowned: !owned,
        message: node.message.clone(),
        gone_gpus: node
            .gone_gpus
            .iter()
            .map(|(index, g)| keel_proto::entry::GoneGpu {
                index: *index,
                gpu_type: g.gpu_type.clone(),
                reason: g.reason.clone(),
                since_ms: g.since_ms,
            })
            .collect(),
    }
}
