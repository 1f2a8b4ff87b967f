//! Human tables and JSON for the CLI. JSON field names are stable.

use std::io::Write;

/// `println!` that returns the write's error instead of panicking: a reader
/// that closed the pipe (`keel jobs | head`) ends the command quietly
/// (`main` treats a broken pipe as the end of the output).
macro_rules! outln {
    ($($arg:tt)*) => {
        writeln!(std::io::stdout().lock(), $($arg)*)?
    };
}

use keel::history::{by_actor, describe_event, event_job_id};
use keel_proto::api;
use keel_proto::entry as pb;
use serde::Serialize;

#[derive(Debug, Clone, Copy, clap::ValueEnum)]
pub enum Output {
    Table,
    Json,
}

pub(crate) fn print_json<T: Serialize>(value: &T) -> anyhow::Result<()> {
    let mut stdout = std::io::stdout().lock();
    // As an io::Error, so a closed pipe reads as one (`main`).
    serde_json::to_writer_pretty(&mut stdout, value).map_err(std::io::Error::from)?;
    writeln!(stdout)?;
    Ok(())
}

/// Prints rows as columns aligned under a header.
pub(crate) fn print_table(header: &[&str], rows: &[Vec<String>]) -> anyhow::Result<()> {
    let mut widths: Vec<usize> = header.iter().map(|h| h.len()).collect();
    for row in rows {
        for (w, cell) in widths.iter_mut().zip(row) {
            *w = (*w).max(cell.chars().count());
        }
    }
    let mut stdout = std::io::stdout().lock();
    let line = |cells: Vec<&str>| -> String {
        cells
            .iter()
            .zip(&widths)
            .map(|(c, w)| format!("{c:<w$}"))
            .collect::<Vec<_>>()
            .join("  ")
            .trim_end()
            .to_string()
    };
    writeln!(stdout, "{}", line(header.to_vec()))?;
    for row in rows {
        writeln!(stdout, "{}", line(row.iter().map(String::as_str).collect()))?;
    }
    Ok(())
}

pub(crate) use keel::history::time;

fn gpu_ref(g: &pb::GpuRef) -> String {
    format!("{}/{}", g.node, g.index)
}

#[derive(Serialize)]
struct AllocationView {
    epoch: u64,
    gpus: Vec<String>,
    policy: String,
    based_on: u64,
    decided_at_ms: u64,
    /// The job sharing these GPUs (space sharing), if any.
    #[serde(skip_serializing_if = "Option::is_none")]
    shared_with: Option<u64>,
}

#[derive(Serialize)]
struct ProgressView {
    step: u64,
    total_steps: u64,
    loss: Option<f64>,
    samples_per_s: f64,
    at_ms: u64,
}

/// A job as `--output json` shows it.
#[derive(Serialize)]
struct JobView {
    id: u64,
    name: String,
    user: String,
    /// The queue it waits in (issue 23).
    queue: String,
    state: String,
    /// GPUs per worker.
    gpus: u32,
    min_workers: u32,
    max_workers: u32,
    gpu_types: Vec<String>,
    model: String,
    priority: i32,
    /// Whether a policy's preemption or reclaim may take its GPUs (issue
    /// 23, item 4).
    preemptible: bool,
    command: Vec<String>,
    image: String,
    /// Its variables: plain ones as given, one taken from a secret as
    /// `<secret NAME/KEY>` (issue 35: the value is nowhere but in its
    /// workers).
    #[serde(skip_serializing_if = "std::collections::BTreeMap::is_empty")]
    env: std::collections::BTreeMap<String, String>,
    /// The worker's CPU and memory limits (`{cpus, memory}`), when it has any.
    #[serde(skip_serializing_if = "Option::is_none")]
    resources: Option<keel_state::spec::Resources>,
    /// How its workers' logs are rotated (`{max_file_size, max_files}`),
    /// when the job asks.
    #[serde(skip_serializing_if = "Option::is_none")]
    logs: Option<keel_state::spec::LogLimits>,
    allocation: Option<AllocationView>,
    progress: Option<ProgressView>,
    submitted_at_ms: u64,
    started_at_ms: Option<u64>,
    finished_at_ms: Option<u64>,
    retries: u32,
    max_retries: u32,
    workers: Vec<WorkerView>,
    message: String,
    #[serde(skip_serializing_if = "Option::is_none")]
    estimate: Option<EstimateView>,
    /// Who submitted it, when the submission had an identity (issue 22).
    #[serde(skip_serializing_if = "Option::is_none")]
    submitted_by: Option<String>,
    /// The trace of its submission, when it was sampled (issue 24).
    #[serde(skip_serializing_if = "Option::is_none")]
    trace_id: Option<String>,
    /// The record's fields that hold a value and have no place above, by
    /// their protobuf names ([`other_record_fields`]).
    #[serde(skip_serializing_if = "std::collections::BTreeMap::is_empty")]
    other: std::collections::BTreeMap<String, serde_json::Value>,
}

/// The fields of the state's record of a job (`keel.entry.v1.JobRecord`)
/// that [`JobView`] shows in words of its own.
const RECORD_FIELDS_SHOWN: [&str; 12] = [
    "id",
    "spec",
    "state",
    "submitted_at_ms",
    "started_at_ms",
    "finished_at_ms",
    "allocation",
    "workers",
    "progress",
    "retries",
    "message",
    "submitted_by",
];

/// The fields kept for the scheduler and left out of `keel job`: the
/// epoch counter, the counts and clocks the policies order jobs by, the
/// performance history (shown as the estimate) and the trace (shown as its
/// id).
const RECORD_FIELDS_LEFT_OUT: [&str; 7] = [
    "last_epoch",
    "progress_samples",
    "not_before_ms",
    "service_gpu_ms",
    "queued_since_ms",
    "perf",
    "trace_parent",
];

/// The record's other fields that hold a value (not absent, empty or
/// zero), by their protobuf names: so a field the state's job gains shows
/// in `keel job` (and its JSON, under `other`) without code of its own,
/// until it is given words here (ARCHITECTURE.md, "What one new field
/// costs").
fn other_record_fields(
    record: &pb::JobRecord,
) -> std::collections::BTreeMap<String, serde_json::Value> {
    record_fields_not_in(record, &[&RECORD_FIELDS_SHOWN, &RECORD_FIELDS_LEFT_OUT])
}

/// The fields of `record` that hold a value and no list names.
fn record_fields_not_in(
    record: &pb::JobRecord,
    lists: &[&[&str]],
) -> std::collections::BTreeMap<String, serde_json::Value> {
    use serde_json::Value;
    let Ok(Value::Object(fields)) = serde_json::to_value(record) else {
        return Default::default();
    };
    let holds_a_value = |v: &Value| match v {
        Value::Null => false,
        Value::Bool(b) => *b,
        Value::Number(n) => n.as_f64() != Some(0.0),
        Value::String(s) => !s.is_empty(),
        Value::Array(a) => !a.is_empty(),
        Value::Object(o) => !o.is_empty(),
    };
    fields
        .into_iter()
        .filter(|(name, value)| {
            !lists.iter().any(|list| list.contains(&name.as_str())) && holds_a_value(value)
        })
        .collect()
}

#[derive(Serialize)]
struct EstimateView {
    remaining_steps: f64,
    steps_per_s: f64,
    /// `None` (null) when the speed is unknown.
    remaining_s: Option<f64>,
    gpus: u32,
    gpu_type: String,
    speed_source: String,
}

#[derive(Serialize)]
struct WorkerView {
    rank: u32,
    epoch: u64,
    node: String,
    state: String,
    exit_code: Option<i32>,
}

/// The job as `keel job` and `keel jobs` show it: what the state holds
/// (`api::Job.record`), with what the API adds of its own (its words for
/// why the job waits, the estimate, the trace id).
fn job_view(job: &api::Job) -> JobView {
    let record = keel::convert::record_of(job);
    let spec = record.spec.clone().unwrap_or_default();
    JobView {
        id: record.id,
        name: spec.name,
        user: spec.user,
        queue: if spec.queue.is_empty() {
            keel_state::queue::DEFAULT_QUEUE.to_string()
        } else {
            spec.queue
        },
        state: record.state.clone(),
        gpus: spec.gpus_per_worker,
        min_workers: spec.min_workers,
        max_workers: spec.max_workers,
        gpu_types: spec.gpu_types_allowed,
        model: spec.model,
        priority: spec.priority,
        preemptible: !spec.not_preemptible,
        command: spec.command,
        image: spec.image,
        env: spec
            .env
            .into_iter()
            .chain(
                spec.secret_env
                    .into_iter()
                    .map(|(k, r)| (k, format!("<secret {r}>"))),
            )
            .collect(),
        resources: spec.resources.map(|r| keel_state::spec::Resources {
            cpu_millis: r.cpu_millis,
            memory_bytes: r.memory_bytes,
        }),
        logs: spec.logs.map(|l| keel_state::spec::LogLimits {
            max_file_bytes: l.max_file_bytes,
            max_files: l.max_files,
        }),
        allocation: record.allocation.as_ref().map(|a| AllocationView {
            epoch: a.epoch,
            gpus: a.gpus.iter().map(gpu_ref).collect(),
            policy: a.policy.clone(),
            based_on: a.based_on,
            decided_at_ms: a.decided_at_ms,
            shared_with: a.shared_with,
        }),
        progress: record.progress.as_ref().map(|p| ProgressView {
            step: p.step,
            total_steps: p.total_steps,
            loss: p.loss,
            samples_per_s: p.samples_per_s,
            at_ms: p.at_ms,
        }),
        submitted_at_ms: record.submitted_at_ms,
        started_at_ms: record.started_at_ms,
        finished_at_ms: record.finished_at_ms,
        retries: record.retries,
        max_retries: spec.max_retries,
        submitted_by: record.submitted_by.clone().filter(|s| !s.is_empty()),
        trace_id: Some(job.trace_id.clone()).filter(|s| !s.is_empty()),
        other: other_record_fields(&record),
        workers: record
            .workers
            .iter()
            .map(|w| WorkerView {
                rank: w.rank,
                epoch: w.epoch,
                node: w.node.clone(),
                state: w.state.clone(),
                exit_code: w.exit_code,
            })
            .collect(),
        // The API's words: the state's message, or why the job waits now.
        message: job.message.clone(),
        estimate: job.estimate.as_ref().map(|e| EstimateView {
            remaining_steps: e.remaining_steps,
            steps_per_s: e.steps_per_s,
            remaining_s: e.remaining_s.is_finite().then_some(e.remaining_s),
            gpus: e.gpus,
            gpu_type: e.gpu_type.clone(),
            speed_source: e.speed_source.clone(),
        }),
    }
}

/// The estimate in words: how long, from what speed, and how sure (a
/// speed from the throughput table is the model's published pace on that
/// GPU type, a guess until the job reports its own).
fn describe_estimate(e: &EstimateView) -> String {
    let left = e
        .remaining_s
        .map(|s| {
            humantime::format_duration(std::time::Duration::from_secs(s.round() as u64)).to_string()
        })
        .unwrap_or_else(|| "unknown".into());
    let at = format!(
        "{:.0} steps at {:.2} steps/s on {}x{}",
        e.remaining_steps, e.steps_per_s, e.gpus, e.gpu_type
    );
    match e.speed_source.as_str() {
        "table" => format!(
            "estimated remaining: {left}, a guess ({at}: the throughput table's pace for its \
             model; nothing measured yet, its own speed replaces it once it reports progress)"
        ),
        "measured" => format!("estimated remaining: {left} ({at}, its measured speed)"),
        "fitted" => format!(
            "estimated remaining: {left} ({at}, from its speed model fitted to its progress)"
        ),
        other => format!("estimated remaining: {left} ({at}, speed {other})"),
    }
}

fn job_row(v: &JobView) -> Vec<String> {
    let workers = if v.min_workers == v.max_workers {
        v.max_workers.to_string()
    } else {
        format!("{}-{}", v.min_workers, v.max_workers)
    };
    vec![
        v.id.to_string(),
        v.name.clone(),
        v.user.clone(),
        v.state.clone(),
        format!("{}x{}", workers, v.gpus),
        v.allocation
            .as_ref()
            .map(|a| match a.shared_with {
                Some(p) => format!("{} (shared with {p})", a.gpus.join(",")),
                None => a.gpus.join(","),
            })
            .unwrap_or_else(|| "-".into()),
        v.progress
            .as_ref()
            .map(|p| {
                if p.total_steps > 0 {
                    format!(
                        "{}/{} ({:.0}%)",
                        p.step,
                        p.total_steps,
                        100.0 * p.step as f64 / p.total_steps as f64
                    )
                } else {
                    p.step.to_string()
                }
            })
            .unwrap_or_else(|| "-".into()),
        v.progress
            .as_ref()
            .map(|p| format!("{:.1}", p.samples_per_s))
            .unwrap_or_else(|| "-".into()),
        v.progress
            .as_ref()
            .and_then(|p| p.loss)
            .map(|l| format!("{l:.4}"))
            .unwrap_or_else(|| "-".into()),
        time(v.submitted_at_ms),
    ]
}

const JOB_HEADER: [&str; 10] = [
    "ID",
    "NAME",
    "USER",
    "STATE",
    "WORKERSxGPUS",
    "ALLOCATION",
    "PROGRESS",
    "SAMPLES/S",
    "LOSS",
    "SUBMITTED",
];

pub fn jobs(jobs: &[api::Job], out: Output) -> anyhow::Result<()> {
    let views: Vec<JobView> = jobs.iter().map(job_view).collect();
    match out {
        Output::Json => print_json(&views),
        Output::Table => print_table(&JOB_HEADER, &views.iter().map(job_row).collect::<Vec<_>>()),
    }
}

#[derive(Serialize)]
struct JobWithHistory<'a> {
    #[serde(flatten)]
    job: JobView,
    history: &'a [pb::AppliedEntry],
    history_truncated: bool,
    #[serde(skip_serializing_if = "Vec::is_empty")]
    logs_paused: Vec<PausedLog>,
}

/// A worker log whose writer drops output (below the free-space floor).
#[derive(Serialize)]
pub struct PausedLog {
    pub epoch: u64,
    pub rank: u32,
    pub why: String,
}

pub fn job(
    job: &api::Job,
    history: &api::JobHistoryResponse,
    logs_paused: Vec<PausedLog>,
    out: Output,
) -> anyhow::Result<()> {
    let view = job_view(job);
    match out {
        Output::Json => print_json(&JobWithHistory {
            job: view,
            history: &history.entries,
            history_truncated: history.truncated,
            logs_paused,
        }),
        Output::Table => {
            print_table(&JOB_HEADER, &[job_row(&view)])?;
            outln!(
                "queue: {}, priority {}{}",
                view.queue,
                view.priority,
                if view.preemptible {
                    ""
                } else {
                    ", not preemptible"
                }
            );
            if let Some(by) = &view.submitted_by {
                outln!("submitted by: {by}");
            }
            if let Some(trace) = &view.trace_id {
                outln!("trace: {trace}");
            }
            if !view.env.is_empty() {
                let env: Vec<String> = view.env.iter().map(|(k, v)| format!("{k}={v}")).collect();
                outln!("env: {}", env.join(" "));
            }
            if !view.message.is_empty() {
                outln!("message: {}", view.message);
            }
            if view.max_retries > 0 {
                outln!("retries: {} of {}", view.retries, view.max_retries);
            }
            if let Some(r) = &view.resources {
                outln!("limits per worker: {r}");
            }
            if let Some(l) = &view.logs {
                outln!("logs per worker: at most {l} (within the server's maximum)");
            }
            if let Some(e) = &view.estimate {
                outln!("{}", describe_estimate(e));
            }
            for (name, value) in &view.other {
                match value {
                    serde_json::Value::String(text) => outln!("{name}: {text}"),
                    other => outln!("{name}: {other}"),
                }
            }
            for w in &view.workers {
                outln!(
                    "worker rank {} epoch {} on {}: {}{}",
                    w.rank,
                    w.epoch,
                    w.node,
                    w.state,
                    w.exit_code
                        .map(|c| format!(" (exit {c})"))
                        .unwrap_or_default()
                );
            }
            for p in &logs_paused {
                outln!("log of rank {} epoch {}: {}", p.rank, p.epoch, p.why);
            }
            outln!("history:");
            for record in &history.entries {
                let what = record
                    .events
                    .iter()
                    .filter(|e| event_job_id(e) == Some(view.id))
                    .map(describe_event)
                    .collect::<Vec<_>>()
                    .join("; ");
                outln!(
                    "{:>8}  {}  {}{}",
                    record.index,
                    time(record.at_ms),
                    what,
                    by_actor(record)
                );
            }
            if history.truncated {
                outln!("(older entries only; the history is longer)");
            }
            Ok(())
        }
    }
}

/// `keel why`: one line per entry that concerns the job, only its events.
pub fn why(job_id: u64, history: &api::JobHistoryResponse, out: Output) -> anyhow::Result<()> {
    match out {
        Output::Json => print_json(history),
        Output::Table => {
            let mut stdout = std::io::stdout().lock();
            for record in &history.entries {
                let what = record
                    .events
                    .iter()
                    .filter(|e| event_job_id(e) == Some(job_id))
                    .map(describe_event)
                    .collect::<Vec<_>>()
                    .join("; ");
                writeln!(
                    stdout,
                    "{}  index {:>8}  {:<22} {}{}",
                    time(record.at_ms),
                    record.index,
                    record.command,
                    what,
                    by_actor(record)
                )?;
            }
            if history.truncated {
                writeln!(
                    stdout,
                    "(the first {} entries; the history is longer)",
                    history.entries.len()
                )?;
            }
            Ok(())
        }
    }
}

pub fn logs(job_id: u64, resp: &api::GetLogsResponse, out: Output) -> anyhow::Result<()> {
    match out {
        Output::Json => {
            let logs: Vec<serde_json::Value> = resp
                .logs
                .iter()
                .map(|l| {
                    serde_json::json!({
                        "epoch": l.epoch,
                        "rank": l.rank,
                        "total_bytes": l.total_bytes,
                        "paused": l.paused,
                        "content": String::from_utf8_lossy(&l.content),
                    })
                })
                .collect();
            print_json(&serde_json::json!({"job_id": job_id, "logs": logs}))
        }
        Output::Table => {
            let mut stdout = std::io::stdout().lock();
            if resp.logs.is_empty() {
                writeln!(stdout, "job {job_id} has no worker logs yet")?;
            }
            for l in &resp.logs {
                let shown = l.content.len() as u64;
                let note = if shown < l.total_bytes {
                    format!(", last {shown} of {} bytes", l.total_bytes)
                } else {
                    String::new()
                };
                writeln!(
                    stdout,
                    "==> job {job_id} epoch {} rank {}{note} <==",
                    l.epoch, l.rank
                )?;
                if !l.paused.is_empty() {
                    writeln!(stdout, "(keel: {})", l.paused)?;
                }
                stdout.write_all(&l.content)?;
                if !l.content.ends_with(b"\n") && !l.content.is_empty() {
                    writeln!(stdout)?;
                }
            }
            Ok(())
        }
    }
}

/// Part of a followed log, with a header when it comes from another worker
/// than the last part.
pub fn log_chunk(
    job_id: u64,
    epoch: u64,
    rank: u32,
    header: bool,
    skipped: u64,
    content: &[u8],
) -> anyhow::Result<()> {
    let mut stdout = std::io::stdout().lock();
    if header {
        writeln!(stdout, "==> job {job_id} epoch {epoch} rank {rank} <==")?;
    }
    if skipped > 0 {
        writeln!(stdout, "[... {skipped} bytes not shown ...]")?;
    }
    stdout.write_all(content)?;
    stdout.flush()?;
    Ok(())
}

pub fn node_state_set(name: &str, state: &str, index: u64, out: Output) -> anyhow::Result<()> {
    match out {
        Output::Json => {
            print_json(&serde_json::json!({"node": name, "state": state, "index": index}))
        }
        Output::Table => {
            outln!("node {name} marked {state} (log index {index})");
            Ok(())
        }
    }
}

pub fn node_removed(name: &str, resp: &api::RemoveNodeResponse, out: Output) -> anyhow::Result<()> {
    match out {
        Output::Json => print_json(&serde_json::json!({
            "node": name,
            "index": resp.index,
            "requeued": resp.requeued,
        })),
        Output::Table => {
            outln!("node {name} removed (log index {})", resp.index);
            if !resp.requeued.is_empty() {
                let ids: Vec<String> = resp.requeued.iter().map(u64::to_string).collect();
                outln!("jobs back in the queue: {}", ids.join(", "));
            }
            Ok(())
        }
    }
}

pub fn policy_set(name: &str, index: u64, out: Output) -> anyhow::Result<()> {
    match out {
        Output::Json => print_json(&serde_json::json!({"policy": name, "index": index})),
        Output::Table => {
            outln!("policy set to {name} (log index {index})");
            Ok(())
        }
    }
}

pub fn policy_show(policy: &str, out: Output) -> anyhow::Result<()> {
    let known = keel_scheduling::policy::all_policy_names();
    match out {
        Output::Json => print_json(&serde_json::json!({"policy": policy, "known": known})),
        Output::Table => {
            outln!("policy {policy}");
            outln!("known: {}", known.join(", "));
            Ok(())
        }
    }
}

pub fn submitted(resp: &api::SubmitJobResponse, out: Output) -> anyhow::Result<()> {
    match out {
        Output::Json => print_json(&serde_json::json!({
            "id": resp.job_id,
            "index": resp.index,
            "warnings": resp.warnings,
        })),
        Output::Table => {
            outln!("job {} submitted (log index {})", resp.job_id, resp.index);
            Ok(())
        }
    }
}

pub fn cancelled(id: u64, resp: &api::CancelJobResponse, out: Output) -> anyhow::Result<()> {
    match out {
        Output::Json => print_json(&serde_json::json!({"id": id, "index": resp.index})),
        Output::Table => {
            outln!("job {id} cancelled (log index {})", resp.index);
            Ok(())
        }
    }
}

pub fn nodes(nodes: &[api::Node], out: Output) -> anyhow::Result<()> {
    match out {
        Output::Json => print_json(&nodes),
        Output::Table => {
            let rows: Vec<Vec<String>> = nodes
                .iter()
                .map(|n| {
                    let mut types: std::collections::BTreeMap<&str, usize> = Default::default();
                    for g in &n.gpus {
                        *types.entry(g.gpu_type.as_str()).or_default() += 1;
                    }
                    vec![
                        n.name.clone(),
                        n.state.clone(),
                        types
                            .iter()
                            .map(|(t, c)| format!("{c}x{t}"))
                            .collect::<Vec<_>>()
                            .join(","),
                        format!("{}/{}", n.gpu_holders.len(), n.gpus.len()),
                        n.address.clone(),
                        node_message(n),
                    ]
                })
                .collect();
            print_table(
                &["NAME", "STATE", "GPUS", "IN USE", "ADDRESS", "MESSAGE"],
                &rows,
            )
        }
    }
}

/// What `keel nodes` says of a node: unowned, its message, and each GPU
/// it no longer offers with why ("GPU 1 (v100) gone: Xid 79: ...").
fn node_message(n: &api::Node) -> String {
    let mut parts = Vec::new();
    if n.unowned {
        parts.push(
            "unowned: no executor runs workers here (known from heartbeats only)".to_string(),
        );
    }
    if !n.message.is_empty() {
        parts.push(n.message.clone());
    }
    for g in &n.gone_gpus {
        parts.push(format!(
            "GPU {} ({}) gone: {}",
            g.index, g.gpu_type, g.reason
        ));
    }
    parts.join("; ")
}

pub fn applied_entry(record: &pb::AppliedEntry, out: Output) -> anyhow::Result<()> {
    match out {
        Output::Json => {
            let mut stdout = std::io::stdout().lock();
            serde_json::to_writer(&mut stdout, record).map_err(std::io::Error::from)?;
            writeln!(stdout)?;
            stdout.flush()?;
            Ok(())
        }
        Output::Table => {
            let what = if !record.refused.is_empty() {
                format!("refused: {}", record.refused)
            } else {
                record
                    .events
                    .iter()
                    .map(describe_event)
                    .collect::<Vec<_>>()
                    .join("; ")
            };
            let mut stdout = std::io::stdout().lock();
            writeln!(
                stdout,
                "{:>6}  {}  {:<22} {}{}",
                record.index,
                time(record.at_ms),
                record.command,
                what,
                by_actor(record)
            )?;
            stdout.flush()?;
            Ok(())
        }
    }
}

pub fn membership(m: &api::MembershipResponse, out: Output) -> anyhow::Result<()> {
    match out {
        Output::Json => print_json(m),
        Output::Table => {
            let ids = |v: &[u64]| v.iter().map(u64::to_string).collect::<Vec<_>>().join(",");
            outln!(
                "voters {{{}}}, learners {{{}}} (log index {})",
                ids(&m.voters),
                ids(&m.learners),
                m.index
            );
            Ok(())
        }
    }
}

pub fn forced_membership(
    member: u64,
    forced: &keel_storage::ForcedMembership,
    out: Output,
) -> anyhow::Result<()> {
    let configs: Vec<Vec<u64>> = forced
        .previous_configs
        .iter()
        .map(|c| keel::membership::member_ids(c.iter().copied()))
        .collect();
    match out {
        Output::Json => print_json(&serde_json::json!({
            "member_id": member,
            "address": forced.address,
            "previous_voters": configs,
            "committed_index": forced.committed_index,
            "membership_index": forced.log_id.index,
            "term": forced.log_id.leader_id.term,
        })),
        Output::Table => {
            let shown: Vec<String> = configs
                .iter()
                .map(|c| {
                    let ids: Vec<String> = c.iter().map(u64::to_string).collect();
                    format!("{{{}}}", ids.join(","))
                })
                .collect();
            outln!(
                "member {member} ({}) is now the only voter (membership entry {}, term {}); \
                 it was {}{}.",
                forced.address,
                forced.log_id.index,
                forced.log_id.leader_id.term,
                if shown.len() > 1 {
                    "in the joint configuration "
                } else {
                    ""
                },
                shown.join(" + "),
            );
            outln!(
                "Start it again: it elects itself and commits its whole log (entries after {} \
                 were not known committed). Wipe the other members' data directories before \
                 adding them back with `keel cluster add`.",
                forced
                    .committed_index
                    .map_or_else(|| "none".to_string(), |i| format!("index {i}"))
            );
            Ok(())
        }
    }
}

#[derive(Serialize, Clone)]
struct MemberView {
    id: u64,
    /// The incarnation the membership records (hexadecimal; `-`: named by
    /// its member id alone).
    incarnation: String,
    /// The incarnation that answers at the address, when it is another one
    /// (the member lost its data directory and is being re-admitted).
    answered_as: Option<String>,
    address: String,
    voter: bool,
    reachable: bool,
    role: Option<String>,
    term: Option<u64>,
    last_log_index: Option<u64>,
    last_applied_index: Option<u64>,
    state_hash: Option<String>,
    cluster_id: Option<String>,
    /// Entries the leader has that it has not yet replicated to the member.
    replication_lag: Option<u64>,
    /// Its clock against the middle of the cluster's (ms): as the leader
    /// measured it, else as the member said.
    clock_offset_ms: Option<i64>,
    /// Why it does not lead (its clock too far ahead), if so.
    clock_refusal: Option<String>,
}

#[derive(Serialize)]
struct ClusterView<'a> {
    #[serde(flatten)]
    contacted: &'a api::ClusterStatusResponse,
    members_status: Vec<MemberView>,
    /// Whether one member may be restarted now (a rolling restart or
    /// upgrade), and why, or why not ([`restart_verdict`]).
    restart_safe: bool,
    restart_advice: String,
}

/// How far behind the leader a member may be and still count as caught
/// up (as for re-admitting a member on a new disk).
const CAUGHT_UP_ENTRIES: u64 = 64;

/// Whether one member may be restarted now without the cluster losing its
/// quorum, and the advice: every voter answers and is within
/// [`CAUGHT_UP_ENTRIES`] of the leader (so the last member restarted has
/// caught up), and the voters but one are still a majority. The leader is
/// restarted last (one change of leader in all).
fn restart_verdict(views: &[MemberView]) -> (bool, String) {
    let voters: Vec<&MemberView> = views.iter().filter(|v| v.voter).collect();
    let Some(leader) = voters.iter().find(|v| v.role.as_deref() == Some("leader")) else {
        return (false, "no: no member leads now".into());
    };
    if voters.len() < 3 {
        return (
            false,
            format!(
                "no: with {} voter(s), restarting one stops the cluster until it is back",
                voters.len()
            ),
        );
    }
    for v in &voters {
        if v.answered_as.is_some() {
            return (
                false,
                format!("no: member {} is being re-admitted on a new disk", v.id),
            );
        }
        if !v.reachable {
            return (false, format!("no: member {} does not answer", v.id));
        }
        match v.replication_lag {
            Some(lag) if lag <= CAUGHT_UP_ENTRIES => {}
            Some(lag) => {
                return (
                    false,
                    format!("no: member {} is {lag} entries behind the leader", v.id),
                )
            }
            None => {
                return (
                    false,
                    format!("no: the leader has not reached member {} yet", v.id),
                )
            }
        }
    }
    (
        true,
        format!(
            "yes: every voter answers and has caught up; restart one member at a time, \
             waiting for this to say yes again, the followers first and the leader (member {}) last",
            leader.id
        ),
    )
}

pub fn cluster_status(
    contacted: &api::ClusterStatusResponse,
    members: &[(api::Member, Option<api::ClusterStatusResponse>)],
    leader: Option<&api::ClusterStatusResponse>,
    out: Output,
) -> anyhow::Result<()> {
    let views: Vec<MemberView> = members
        .iter()
        .map(|(m, s)| {
            let at_leader = leader.and_then(|l| {
                l.members
                    .iter()
                    .find(|x| x.id == m.id && x.incarnation == m.incarnation)
            });
            let lag = leader.and_then(|l| {
                let matched = at_leader.and_then(|x| x.matched_index)?;
                Some(l.last_log_index.saturating_sub(matched))
            });
            let incarnation = |i: u64| {
                if i == 0 {
                    "-".to_string()
                } else {
                    format!("{i:012x}")
                }
            };
            // What answers at the address is this incarnation, or another
            // (then its view is not this member's).
            let answered_as = s
                .as_ref()
                .filter(|s| m.incarnation != 0 && s.incarnation != m.incarnation)
                .map(|s| incarnation(s.incarnation));
            let s = &s.as_ref().filter(|_| answered_as.is_none()).cloned();
            MemberView {
                id: m.id,
                incarnation: incarnation(m.incarnation),
                answered_as,
                address: m.address.clone(),
                voter: m.voter,
                reachable: s.is_some(),
                role: s.as_ref().map(|s| s.role.clone()),
                term: s.as_ref().map(|s| s.term),
                last_log_index: s.as_ref().map(|s| s.last_log_index),
                last_applied_index: s.as_ref().map(|s| s.last_applied_index),
                state_hash: s.as_ref().map(|s| s.state_hash.clone()),
                cluster_id: s.as_ref().map(|s| s.cluster_id.clone()),
                replication_lag: lag,
                clock_offset_ms: at_leader
                    .and_then(|x| x.clock_offset_ms)
                    .or_else(|| s.as_ref().and_then(|s| s.clock_offset_ms)),
                clock_refusal: s
                    .as_ref()
                    .map(|s| s.clock_refusal.clone())
                    .filter(|r| !r.is_empty()),
            }
        })
        .collect();
    let (restart_safe, restart_advice) = restart_verdict(&views);
    match out {
        Output::Json => print_json(&ClusterView {
            contacted,
            members_status: views,
            restart_safe,
            restart_advice,
        }),
        Output::Table => {
            let opt = |v: Option<u64>| v.map(|x| x.to_string()).unwrap_or_else(|| "-".into());
            outln!("cluster {}", contacted.cluster_id);
            if !contacted.removed.is_empty() {
                outln!(
                    "this replica (member {}) is no longer a member: {}; the members below are as it last saw them",
                    contacted.member_id,
                    contacted.removed
                );
            }
            if !contacted.policy.is_empty() {
                outln!("policy {}", contacted.policy);
            }
            outln!(
                "jobs in state {} ({} finished; retention removes the oldest), last snapshot {} bytes",
                contacted.jobs_in_state,
                contacted.finished_jobs_in_state,
                contacted.snapshot_bytes
            );
            if !contacted.policy_counters.is_empty() {
                let counters: Vec<String> = contacted
                    .policy_counters
                    .iter()
                    .map(|(k, v)| format!("{k} {v}"))
                    .collect();
                outln!("policy counters: {}", counters.join(", "));
            }
            for v in &views {
                if let Some(other) = v
                    .cluster_id
                    .as_ref()
                    .filter(|c| !c.is_empty() && **c != contacted.cluster_id)
                {
                    outln!("member {} belongs to another cluster: {other}", v.id);
                }
            }
            if contacted.log_time_ms > 0 {
                outln!(
                    "log time {} (member {}'s clock {})",
                    time(contacted.log_time_ms),
                    contacted.member_id,
                    signed_ms(keel_state::log_time::signed_difference(
                        contacted.wall_clock_ms,
                        contacted.log_time_ms
                    ))
                );
            }
            for v in &views {
                if let Some(why) = &v.clock_refusal {
                    outln!("member {} does not lead: {why}", v.id);
                } else if let Some(off) = v
                    .clock_offset_ms
                    .filter(|o| o.unsigned_abs() > contacted.max_clock_offset_ms)
                {
                    outln!(
                        "member {}'s clock is {} from the middle of the cluster's, beyond the {} ms bound: fix its time (NTP)",
                        v.id,
                        signed_ms(off),
                        contacted.max_clock_offset_ms
                    );
                }
            }
            outln!("safe to restart a member: {restart_advice}");
            let mut rows: Vec<Vec<String>> = views
                .iter()
                .map(|v| {
                    vec![
                        v.id.to_string(),
                        v.incarnation.clone(),
                        v.address.clone(),
                        if v.voter { "voter" } else { "learner" }.to_string(),
                        match (&v.role, &v.answered_as) {
                            (_, Some(other)) => format!("replaced by {other}"),
                            (Some(role), None) => role.clone(),
                            (None, None) => "unreachable".into(),
                        },
                        opt(v.term),
                        opt(v.last_log_index),
                        opt(v.last_applied_index),
                        opt(v.replication_lag),
                        v.clock_offset_ms.map_or_else(|| "-".into(), signed_ms),
                        v.state_hash.clone().unwrap_or_else(|| "-".into()),
                    ]
                })
                .collect();
            // Members the contacted replica saw removed (issue 34).
            for r in &contacted.removed_members {
                let mut row = vec![
                    r.id.to_string(),
                    if r.incarnation == 0 {
                        "-".to_string()
                    } else {
                        format!("{:012x}", r.incarnation)
                    },
                    r.address.clone(),
                    format!("removed at index {}", r.removed_at_index),
                ];
                row.resize(11, "-".to_string());
                rows.push(row);
            }
            print_table(
                &[
                    "ID",
                    "INCARNATION",
                    "ADDRESS",
                    "MEMBER",
                    "ROLE",
                    "TERM",
                    "LAST LOG",
                    "APPLIED",
                    "LAG",
                    "CLOCK",
                    "STATE HASH",
                ],
                &rows,
            )
        }
    }
}

/// A signed duration in milliseconds, as an operator reads it: `+3600000 ms`.
fn signed_ms(ms: i64) -> String {
    format!("{ms:+} ms")
}

pub fn replay(s: &keel_storage::ReplaySummary, out: Output) -> anyhow::Result<()> {
    match out {
        Output::Json => print_json(&serde_json::json!({
            "entries": s.entries,
            "refused": s.refused,
            "started_after": s.started_after,
            "last_index": s.last_index,
            "from_log": s.from_log,
            "state_hash": s.state_hash.to_string(),
            "jobs_by_state": s.jobs_by_state,
            "nodes": s.nodes,
            "policy_memory": s.state.policy_memory().map(|m| serde_json::json!({
                "policy": m.policy,
                "format": m.format,
                "bytes": m.bytes.len(),
                "memory": keel_scheduling::policy::describe_memory(m),
            })),
        })),
        Output::Table => {
            // A log index holds a batch of commands: say both.
            outln!(
                "replayed log indexes {} to {}: {} commands ({} refused)",
                s.started_after + 1,
                s.last_index,
                s.entries,
                s.refused
            );
            if s.started_after > 0 {
                outln!("started from the checkpoint at index {}", s.started_after);
            }
            if s.from_log > 0 {
                outln!(
                    "{} entries past the journal's end came from the Raft log",
                    s.from_log
                );
            }
            outln!("nodes: {}", s.nodes);
            for (state, n) in &s.jobs_by_state {
                outln!("jobs {state}: {n}");
            }
            if let Some(m) = s.state.policy_memory() {
                outln!(
                    "policy memory: {} (format {}, {} bytes){}",
                    m.policy,
                    m.format,
                    m.bytes.len(),
                    match keel_scheduling::policy::describe_memory(m) {
                        Some(d) => format!(
                            ": {} rounds, {} solves, {} jobs, round started at {} ms",
                            d["rounds"],
                            d["solves"],
                            d["jobs"].as_object().map_or(0, |j| j.len()),
                            d["round_started_ms"]
                        ),
                        None => " that this build does not read".into(),
                    }
                );
            }
            outln!("state hash: {}", s.state_hash);
            Ok(())
        }
    }
}

/// `TYPE=N,...` of counts by type (`-` for none).
fn counts(map: &std::collections::BTreeMap<String, u32>) -> String {
    if map.is_empty() {
        return "-".into();
    }
    map.iter()
        .map(|(t, n)| format!("{t}={n}"))
        .collect::<Vec<_>>()
        .join(",")
}

/// `keel queue list` and `keel queue show`.
/// What a queue or secret change says: `NOUN NAME WHAT at index N`, or
/// `{name, index}` in JSON.
pub fn changed(noun: &str, what: &str, name: &str, index: u64, out: Output) -> anyhow::Result<()> {
    match out {
        Output::Json => print_json(&serde_json::json!({"name": name, "index": index})),
        Output::Table => {
            outln!("{noun} {name} {what} at index {index}");
            Ok(())
        }
    }
}

/// `keel secret list`: names, keys and who may use them; never a value.
pub fn secrets(list: &api::ListSecretsResponse, out: Output) -> anyhow::Result<()> {
    match out {
        Output::Json => {
            let secrets: Vec<serde_json::Value> = list
                .secrets
                .iter()
                .map(|s| {
                    serde_json::json!({
                        "name": s.name,
                        "keys": s.keys,
                        "owner": s.owner,
                        "queue": s.queue,
                        "revision": s.revision,
                        "changed_at_ms": s.changed_at_ms,
                        "key_ids": s.key_ids,
                        "opens_here": s.opens_here,
                    })
                })
                .collect();
            print_json(&serde_json::json!({
                "secrets": secrets,
                "key_ids_held": list.key_ids_held,
            }))
        }
        Output::Table => {
            let rows: Vec<Vec<String>> = list
                .secrets
                .iter()
                .map(|s| {
                    vec![
                        s.name.clone(),
                        s.keys.join(","),
                        if s.owner.is_empty() {
                            "-".into()
                        } else {
                            s.owner.clone()
                        },
                        if s.queue.is_empty() {
                            "-".into()
                        } else {
                            s.queue.clone()
                        },
                        s.revision.to_string(),
                        format!(
                            "{}{}",
                            s.key_ids.join(","),
                            if s.opens_here { "" } else { " (not held here)" }
                        ),
                    ]
                })
                .collect();
            print_table(
                &["NAME", "KEYS", "OWNER", "QUEUE", "REVISION", "SEALED WITH"],
                &rows,
            )?;
            if list.key_ids_held.is_empty() {
                writeln!(
                    std::io::stdout().lock(),
                    "this server holds no secret key (--secret-key-file)"
                )?;
            }
            Ok(())
        }
    }
}

pub fn queues(list: &[api::QueueStatus], out: Output) -> anyhow::Result<()> {
    match out {
        Output::Json => {
            let queues: Vec<serde_json::Value> = list
                .iter()
                .map(|q| {
                    let spec = q.spec.clone().unwrap_or_default();
                    let sorted = |m: &std::collections::BTreeMap<String, u32>| m.clone();
                    serde_json::json!({
                        "name": q.name,
                        "quota": spec.quota.as_ref().map(|c| sorted(&c.gpus)),
                        "cohort": spec.cohort,
                        "borrow_limit": sorted(&spec.borrow_limit),
                        "lend_limit": sorted(&spec.lend_limit),
                        "weight": spec.weight,
                        "used": sorted(&q.used),
                        "borrowed": sorted(&q.borrowed),
                        "running_jobs": q.running_jobs,
                        "pending_jobs": q.pending_jobs,
                        "pending_gpus": q.pending_gpus,
                        "pending_by_type": sorted(&q.pending_by_type),
                        "changed_at_ms": q.changed_at_ms,
                        "changed_by": q.changed_by,
                    })
                })
                .collect();
            print_json(&queues)
        }
        Output::Table => {
            let rows: Vec<Vec<String>> = list
                .iter()
                .map(|q| {
                    let spec = q.spec.clone().unwrap_or_default();
                    vec![
                        q.name.clone(),
                        spec.quota
                            .as_ref()
                            .map_or_else(|| "none (any GPU)".into(), |c| counts(&c.gpus)),
                        spec.cohort.clone().unwrap_or_else(|| "-".into()),
                        spec.weight.to_string(),
                        counts(&q.used),
                        counts(&q.borrowed),
                        q.running_jobs.to_string(),
                        if q.pending_jobs == 0 {
                            "0".into()
                        } else {
                            format!(
                                "{} ({} GPUs: {})",
                                q.pending_jobs,
                                q.pending_gpus,
                                counts(&q.pending_by_type)
                            )
                        },
                    ]
                })
                .collect();
            print_table(
                &[
                    "QUEUE", "QUOTA", "COHORT", "WEIGHT", "USED", "BORROWED", "RUNNING", "PENDING",
                ],
                &rows,
            )
        }
    }
}

/// `keel acl token list`.
pub fn tokens(list: &api::ListTokensResponse, out: Output) -> anyhow::Result<()> {
    match out {
        Output::Json => {
            let tokens: Vec<serde_json::Value> = list
                .tokens
                .iter()
                .map(|t| {
                    serde_json::json!({
                        "name": t.name,
                        "role": t.role,
                        "created_at_ms": t.created_at_ms,
                        "expires_at_ms": t.expires_at_ms,
                        "created_by": t.created_by,
                        "expired": t.expired,
                        "queues": t.queues,
                    })
                })
                .collect();
            print_json(&tokens)
        }
        Output::Table => print_table(
            &["NAME", "ROLE", "QUEUES", "CREATED", "EXPIRES", "BY"],
            &list
                .tokens
                .iter()
                .map(|t| {
                    vec![
                        t.name.clone(),
                        t.role.clone(),
                        if t.queues.is_empty() {
                            "any".into()
                        } else {
                            t.queues.join(",")
                        },
                        time(t.created_at_ms),
                        match (t.expires_at_ms, t.expired) {
                            (None, _) => "never".into(),
                            (Some(at), true) => format!("{} (expired)", time(at)),
                            (Some(at), false) => time(at),
                        },
                        if t.created_by.is_empty() {
                            "-".into()
                        } else {
                            t.created_by.clone()
                        },
                    ]
                })
                .collect::<Vec<_>>(),
        ),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn an_entry_names_who_asked_or_the_leader() {
        let record = |command: &str, actor: &str| pb::AppliedEntry {
            command: command.into(),
            actor: actor.into(),
            ..Default::default()
        };
        assert_eq!(
            by_actor(&record("submit_job", "cert:alice")),
            "  (by cert:alice)"
        );
        assert_eq!(by_actor(&record("decide_allocation", "")), "  (by leader)");
        assert_eq!(by_actor(&record("submit_job", "")), "", "no identity");
        assert_eq!(
            by_actor(&record("mark_node_lost", "")),
            "",
            "the leader's or a caller's"
        );
    }

    /// `keel job` shows the record the state keeps (`api::Job.record`);
    /// a server from before that field sends only the v1 summary, and the
    /// same job then shows the same.
    #[test]
    fn a_job_shows_its_record_and_the_same_from_an_older_servers_summary() {
        use keel_state::fixtures::{job_spec, TestCluster};
        use keel_state::{Command, GpuRef, ProgressSample};
        let mut c = TestCluster::v100_nodes(&[2]);
        let mut spec = job_spec("train", 1, 2);
        spec.max_retries = 2;
        let id = c.submit(spec);
        let gpus = (0..2).map(|index| GpuRef {
            node: "n0".into(),
            index,
        });
        c.place(id, gpus.collect());
        c.apply(Command::record_worker_started(id, 1, 0, "n0"));
        c.apply(Command::report_progress(
            id,
            vec![ProgressSample {
                step: 10,
                total_steps: 10_000,
                loss: Some(2.5),
                samples_per_s: 40.0,
                at_ms: 1,
            }],
        ));
        let job = &c.state.jobs()[&id];
        let answered = keel::convert::job_to_proto(job);
        assert_eq!(answered.record, Some(job.to_record()));
        let mut older = answered.clone();
        older.record = None;
        let shown = serde_json::to_value(job_view(&answered)).expect("json");
        assert_eq!(shown, serde_json::to_value(job_view(&older)).expect("json"));
        assert_eq!(shown["workers"][0]["node"], "n0");
        assert_eq!(shown["progress"]["step"], 10);
        assert_eq!(shown["max_retries"], 2);
        assert_eq!(shown["allocation"]["gpus"][1], "n0/1");
        assert!(shown.get("other").is_none(), "every field has its place");
    }

    /// A field the record gains shows in `keel job` by its protobuf name
    /// once it holds a value, without a line here; the two lists name
    /// fields the record has.
    #[test]
    fn a_record_field_with_no_words_of_its_own_is_shown_by_its_name() {
        let record = pb::JobRecord {
            id: 7,
            message: "waiting for 2 GPUs".into(),
            retries: 0,
            ..Default::default()
        };
        let serde_json::Value::Object(all) = serde_json::to_value(&record).expect("json") else {
            panic!("a record is a JSON object");
        };
        for name in RECORD_FIELDS_SHOWN.iter().chain(&RECORD_FIELDS_LEFT_OUT) {
            assert!(all.contains_key(*name), "{name} is no field of JobRecord");
        }
        assert!(other_record_fields(&record).is_empty());
        // As if `message` had just been added: shown, by name, with its
        // value; `retries` (zero) and the rest hold nothing, so are not.
        let shown: Vec<&str> = RECORD_FIELDS_SHOWN
            .iter()
            .copied()
            .filter(|f| *f != "message" && *f != "retries")
            .collect();
        let other = record_fields_not_in(&record, &[&shown, &RECORD_FIELDS_LEFT_OUT]);
        assert_eq!(
            other.into_iter().collect::<Vec<_>>(),
            vec![(
                "message".to_string(),
                serde_json::json!("waiting for 2 GPUs")
            )]
        );
    }

    fn estimate(source: &str) -> EstimateView {
        EstimateView {
            remaining_steps: 9_000.0,
            steps_per_s: 10.0,
            remaining_s: Some(900.0),
            gpus: 1,
            gpu_type: "v100".into(),
            speed_source: source.into(),
        }
    }

    #[test]
    fn an_estimate_says_where_its_speed_comes_from_and_how_sure_it_is() {
        let table = describe_estimate(&estimate("table"));
        assert!(
            table.starts_with("estimated remaining: 15m, a guess"),
            "{table}"
        );
        assert!(table.contains("nothing measured yet"), "{table}");
        let measured = describe_estimate(&estimate("measured"));
        assert_eq!(
            measured,
            "estimated remaining: 15m (9000 steps at 10.00 steps/s on 1xv100, its measured speed)"
        );
        assert!(describe_estimate(&estimate("fitted")).contains("fitted to its progress"));
        let unknown = EstimateView {
            remaining_s: None,
            ..estimate("table")
        };
        assert!(describe_estimate(&unknown).starts_with("estimated remaining: unknown"));
    }

    fn member(id: u64, role: &str, lag: Option<u64>) -> MemberView {
        MemberView {
            id,
            incarnation: "-".into(),
            answered_as: None,
            address: format!("127.0.0.1:{}", 7000 + id),
            voter: true,
            reachable: role != "unreachable",
            role: (role != "unreachable").then(|| role.to_string()),
            term: Some(2),
            last_log_index: Some(100),
            last_applied_index: Some(100),
            state_hash: None,
            cluster_id: None,
            replication_lag: lag,
            clock_offset_ms: None,
            clock_refusal: None,
        }
    }

    #[test]
    fn a_member_may_be_restarted_only_while_every_voter_answers_caught_up() {
        let healthy = vec![
            member(1, "follower", Some(0)),
            member(2, "leader", Some(0)),
            member(3, "follower", Some(3)),
        ];
        let (safe, advice) = restart_verdict(&healthy);
        assert!(safe, "{advice}");
        assert!(advice.contains("the leader (member 2) last"), "{advice}");
        for (members, why) in [
            (
                vec![
                    member(1, "follower", Some(0)),
                    member(2, "leader", Some(0)),
                    member(3, "unreachable", None),
                ],
                "member 3 does not answer",
            ),
            (
                vec![
                    member(1, "follower", Some(0)),
                    member(2, "leader", Some(0)),
                    member(3, "follower", Some(65)),
                ],
                "member 3 is 65 entries behind",
            ),
            (
                vec![
                    member(1, "follower", Some(0)),
                    member(2, "candidate", None),
                    member(3, "follower", Some(0)),
                ],
                "no member leads",
            ),
            (vec![member(1, "leader", Some(0))], "with 1 voter(s)"),
        ] {
            let (safe, advice) = restart_verdict(&members);
            assert!(!safe, "{why}: {advice}");
            assert!(advice.contains(why), "{why}: {advice}");
        }
        // A learner's state does not count.
        let mut with_learner = healthy.clone();
        let mut learner = member(4, "unreachable", None);
        learner.voter = false;
        with_learner.push(learner);
        assert!(restart_verdict(&with_learner).0);
    }
}
