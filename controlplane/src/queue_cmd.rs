//! `keel queue`: make, change, list, show and delete queues (issue 23,
//! item 1). Quotas and limits are written `TYPE=N,...`, e.g.
//! `--quota v100=16,a100=8`.

use std::collections::BTreeMap;

use clap::Subcommand;
use keel_proto::api;
use keel_proto::entry as pb;

use crate::cli;
use crate::render::{self, Output};

#[derive(Subcommand, Debug)]
pub enum QueueCmd {
    /// Make a queue (admin).
    Create {
        /// 1 to 63 lower-case letters, digits and '-'.
        name: String,
        #[command(flatten)]
        spec: SpecArgs,
    },
    /// Change a queue (admin): what is given replaces what it had; the
    /// rest is kept. The default queue takes a quota too.
    Update {
        name: String,
        #[command(flatten)]
        spec: SpecArgs,
    },
    /// Every queue: quota, what it uses and borrows, what waits.
    List,
    /// One queue.
    Show { name: String },
    /// Delete a queue (admin); refused while an unfinished job names it.
    Delete { name: String },
}

/// A queue's settings as flags.
#[derive(clap::Args, Debug, Default)]
pub struct SpecArgs {
    /// GPUs guaranteed per type, `TYPE=N,...` (required to create).
    #[arg(long, value_parser = parse_counts)]
    quota: Option<BTreeMap<String, u32>>,
    /// The cohort whose members lend each other unused quota.
    #[arg(long)]
    cohort: Option<String>,
    /// At most this many GPUs of a type borrowed beyond the quota,
    /// `TYPE=N,...` (a type not named: no limit).
    #[arg(long, value_parser = parse_counts)]
    borrow_limit: Option<BTreeMap<String, u32>>,
    /// At most this many unused GPUs of a type lent to the cohort,
    /// `TYPE=N,...` (a type not named: all).
    #[arg(long, value_parser = parse_counts)]
    lend_limit: Option<BTreeMap<String, u32>>,
    /// Its share of the GPUs beyond every quota, 1 to 1000 (default 1).
    #[arg(long)]
    weight: Option<u32>,
}

/// `v100=16,a100=8` as counts by type (an empty string: none).
fn parse_counts(s: &str) -> Result<BTreeMap<String, u32>, String> {
    let mut counts = BTreeMap::new();
    for part in s.split(',').map(str::trim).filter(|p| !p.is_empty()) {
        let (gpu_type, n) = part
            .split_once('=')
            .ok_or_else(|| format!("{part:?} is not TYPE=N"))?;
        let n: u32 = n
            .trim()
            .parse()
            .map_err(|e| format!("{part:?}: the count: {e}"))?;
        if counts.insert(gpu_type.trim().to_string(), n).is_some() {
            return Err(format!("GPU type {gpu_type:?} is given twice"));
        }
    }
    Ok(counts)
}

impl SpecArgs {
    /// These flags over `base` (what the queue had, or nothing).
    fn over(self, base: Option<pb::QueueSpec>) -> pb::QueueSpec {
        let mut spec = base.unwrap_or(pb::QueueSpec {
            weight: 1,
            ..Default::default()
        });
        if let Some(quota) = self.quota {
            spec.quota = Some(pb::GpuCounts {
                gpus: quota.into_iter().collect(),
            });
        }
        if let Some(cohort) = self.cohort {
            spec.cohort = (!cohort.is_empty()).then_some(cohort);
        }
        if let Some(limit) = self.borrow_limit {
            spec.borrow_limit = limit.into_iter().collect();
        }
        if let Some(limit) = self.lend_limit {
            spec.lend_limit = limit.into_iter().collect();
        }
        if let Some(weight) = self.weight {
            spec.weight = weight;
        }
        spec
    }
}

async fn list(addr: &str) -> anyhow::Result<Vec<api::QueueStatus>> {
    let (list, _) = cli::read(addr, |mut client| async move {
        client.list_queues(api::ListQueuesRequest {}).await
    })
    .await?;
    Ok(list.queues)
}

pub async fn run(addr: &str, command: QueueCmd, out: Output) -> anyhow::Result<()> {
    match command {
        QueueCmd::Create { name, spec } => {
            if spec.quota.is_none() {
                anyhow::bail!("--quota is required to create a queue, e.g. --quota v100=16,a100=8");
            }
            let spec = spec.over(None);
            let resp = cli::write(addr, |mut client, request_id| {
                let request = api::CreateQueueRequest {
                    name: name.clone(),
                    spec: Some(spec.clone()),
                    request_id,
                };
                async move { client.create_queue(request).await }
            })
            .await?;
            render::changed("queue", "created", &name, resp.index, out)
        }
        QueueCmd::Update { name, spec } => {
            let current = list(addr)
                .await?
                .into_iter()
                .find(|q| q.name == name)
                .ok_or_else(|| anyhow::anyhow!("no queue is named {name:?} (keel queue list)"))?;
            let spec = spec.over(current.spec);
            let resp = cli::write(addr, |mut client, request_id| {
                let request = api::UpdateQueueRequest {
                    name: name.clone(),
                    spec: Some(spec.clone()),
                    request_id,
                };
                async move { client.update_queue(request).await }
            })
            .await?;
            render::changed("queue", "changed", &name, resp.index, out)
        }
        QueueCmd::Delete { name } => {
            let resp = cli::write(addr, |mut client, request_id| {
                let request = api::DeleteQueueRequest {
                    name: name.clone(),
                    request_id,
                };
                async move { client.delete_queue(request).await }
            })
            .await?;
            render::changed("queue", "deleted", &name, resp.index, out)
        }
        QueueCmd::List => render::queues(&list(addr).await?, out),
        QueueCmd::Show { name } => {
            let queue = list(addr)
                .await?
                .into_iter()
                .find(|q| q.name == name)
                .ok_or_else(|| anyhow::anyhow!("no queue is named {name:?} (keel queue list)"))?;
            render::queues(std::slice::from_ref(&queue), out)
        }
    }
}
