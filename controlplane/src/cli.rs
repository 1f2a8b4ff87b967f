//! The client commands: talk to a server, print tables or JSON.

use std::io::Read;
use std::path::Path;

use anyhow::{bail, Context};
use keel_core::codec::spec_to_proto;
use keel_core::JobSpec;
use keel_proto::api::{self, keel_client::KeelClient};
use tonic::transport::Channel;

use crate::render::{self, Output};

/// Largest spec file accepted.
const SPEC_FILE_MAX_BYTES: u64 = 1024 * 1024;

async fn connect(addr: &str) -> anyhow::Result<KeelClient<Channel>> {
    let url = if addr.contains("://") {
        addr.to_string()
    } else {
        format!("http://{addr}")
    };
    let channel = tonic::transport::Endpoint::from_shared(url.clone())
        .with_context(|| format!("invalid server address {addr:?}"))?
        .connect_timeout(std::time::Duration::from_secs(5))
        .connect()
        .await
        .with_context(|| {
            format!("cannot connect to a Keel server at {addr} (set --addr or KEEL_ADDR)")
        })?;
    Ok(KeelClient::new(channel).max_decoding_message_size(64 * keel::MAX_REQUEST_BYTES))
}

fn status_error(e: tonic::Status) -> anyhow::Error {
    anyhow::anyhow!("{} ({:?})", e.message(), e.code())
}

/// Reads and parses a spec file: JSON if it ends in `.json`, YAML otherwise.
pub fn read_spec(file: &Path) -> anyhow::Result<JobSpec> {
    let mut text = String::new();
    let name = file.display().to_string();
    if name == "-" {
        std::io::stdin()
            .take(SPEC_FILE_MAX_BYTES + 1)
            .read_to_string(&mut text)
            .context("cannot read the spec from stdin")?;
    } else {
        std::fs::File::open(file)
            .with_context(|| format!("cannot open {name}"))?
            .take(SPEC_FILE_MAX_BYTES + 1)
            .read_to_string(&mut text)
            .with_context(|| format!("cannot read {name}"))?;
    }
    if text.len() as u64 > SPEC_FILE_MAX_BYTES {
        bail!("{name} is larger than the limit of {SPEC_FILE_MAX_BYTES} bytes");
    }
    let spec: JobSpec = if name.ends_with(".json") {
        serde_json::from_str(&text).with_context(|| format!("{name} is not a valid job spec"))?
    } else {
        serde_yaml::from_str(&text).with_context(|| format!("{name} is not a valid job spec"))?
    };
    spec.validate()
        .with_context(|| format!("{name} is not a valid job spec"))?;
    Ok(spec)
}

pub async fn submit(addr: &str, file: &Path, out: Output) -> anyhow::Result<()> {
    let spec = read_spec(file)?;
    let mut client = connect(addr).await?;
    let resp = client
        .submit_job(api::SubmitJobRequest {
            spec: Some(spec_to_proto(&spec)),
        })
        .await
        .map_err(status_error)?
        .into_inner();
    render::submitted(&resp, out)
}

pub async fn jobs(
    addr: &str,
    state: Option<String>,
    user: Option<String>,
    out: Output,
) -> anyhow::Result<()> {
    let mut client = connect(addr).await?;
    let resp = client
        .list_jobs(api::ListJobsRequest {
            state: state.unwrap_or_default(),
            user: user.unwrap_or_default(),
        })
        .await
        .map_err(status_error)?
        .into_inner();
    render::jobs(&resp.jobs, out)
}

pub async fn job(addr: &str, id: u64, out: Output) -> anyhow::Result<()> {
    let mut client = connect(addr).await?;
    let job = client
        .get_job(api::GetJobRequest { job_id: id })
        .await
        .map_err(status_error)?
        .into_inner();
    let history = client
        .job_history(api::JobHistoryRequest {
            job_id: id,
            limit: 0,
        })
        .await
        .map_err(status_error)?
        .into_inner();
    render::job(&job, &history, out)
}

pub async fn logs(addr: &str, id: u64, tail_bytes: u64, out: Output) -> anyhow::Result<()> {
    let mut client = connect(addr).await?;
    let resp = client
        .get_logs(api::GetLogsRequest {
            job_id: id,
            tail_bytes,
        })
        .await
        .map_err(status_error)?
        .into_inner();
    render::logs(id, &resp, out)
}

/// Prints each worker log's tail, then what is appended, until the job has
/// ended and its logs stop growing. Polls the server twice a second.
pub async fn follow_logs(addr: &str, id: u64, tail_bytes: u64) -> anyhow::Result<()> {
    let mut client = connect(addr).await?;
    // Bytes of each (epoch, rank) log already printed.
    let mut printed: std::collections::BTreeMap<(u64, u32), u64> = Default::default();
    let mut last: Option<(u64, u32)> = None;
    loop {
        let resp = client
            .get_logs(api::GetLogsRequest {
                job_id: id,
                tail_bytes,
            })
            .await
            .map_err(status_error)?
            .into_inner();
        let mut grew = false;
        for log in &resp.logs {
            let key = (log.epoch, log.rank);
            let seen = printed.get(&key).copied();
            if seen == Some(log.total_bytes) {
                continue;
            }
            grew = true;
            let start = log.total_bytes - log.content.len() as u64;
            let from = seen.unwrap_or(start).max(start);
            let skipped = from.saturating_sub(seen.unwrap_or(from));
            let new = &log.content[usize::try_from(from - start).unwrap_or(0)..];
            let header = last != Some(key);
            render::log_chunk(id, log.epoch, log.rank, header, skipped, new)?;
            printed.insert(key, log.total_bytes);
            last = Some(key);
        }
        if !grew {
            let job = client
                .get_job(api::GetJobRequest { job_id: id })
                .await
                .map_err(status_error)?
                .into_inner();
            let ended = matches!(job.state.as_str(), "succeeded" | "failed" | "cancelled");
            if ended {
                return Ok(());
            }
        }
        tokio::time::sleep(std::time::Duration::from_millis(500)).await;
    }
}

pub async fn set_node_state(
    addr: &str,
    name: String,
    state: &str,
    reason: String,
    out: Output,
) -> anyhow::Result<()> {
    let mut client = connect(addr).await?;
    let resp = client
        .set_node_state(api::SetNodeStateRequest {
            name: name.clone(),
            state: state.to_string(),
            reason,
        })
        .await
        .map_err(status_error)?
        .into_inner();
    render::node_state_set(&name, state, resp.index, out)
}

pub async fn cancel(addr: &str, id: u64, reason: String, out: Output) -> anyhow::Result<()> {
    let mut client = connect(addr).await?;
    let resp = client
        .cancel_job(api::CancelJobRequest { job_id: id, reason })
        .await
        .map_err(status_error)?
        .into_inner();
    render::cancelled(id, &resp, out)
}

pub async fn nodes(addr: &str, out: Output) -> anyhow::Result<()> {
    let mut client = connect(addr).await?;
    let resp = client
        .list_nodes(api::ListNodesRequest {})
        .await
        .map_err(status_error)?
        .into_inner();
    render::nodes(&resp.nodes, out)
}

pub async fn events(addr: &str, from: u64, follow: bool, out: Output) -> anyhow::Result<()> {
    let mut client = connect(addr).await?;
    let mut stream = client
        .watch_events(api::WatchEventsRequest {
            from_index: from,
            follow,
        })
        .await
        .map_err(status_error)?
        .into_inner();
    while let Some(record) = stream.message().await.map_err(status_error)? {
        render::applied_entry(&record, out)?;
    }
    Ok(())
}

pub async fn cluster_status(addr: &str, out: Output) -> anyhow::Result<()> {
    let mut client = connect(addr).await?;
    let status = client
        .cluster_status(api::ClusterStatusRequest {})
        .await
        .map_err(status_error)?
        .into_inner();
    render::cluster_status(&status, out)
}

pub fn replay(data_dir: &Path, until: Option<u64>, out: Output) -> anyhow::Result<()> {
    // Take the directory's lock: replaying a directory a server is writing
    // would read a moving journal.
    let dir = keel_storage::DataDir::open(data_dir)
        .with_context(|| format!("cannot replay {}", data_dir.display()))?;
    let summary = keel_storage::replay(&dir.state_dir(), until)
        .with_context(|| format!("cannot replay {}", data_dir.display()))?;
    render::replay(&summary, out)
}
