//! The client commands: talk to a server, print tables or JSON.

use std::io::Read;
use std::path::Path;

use anyhow::{bail, Context};
use keel_proto::api::{self, keel_client::KeelClient};
use keel_state::codec::spec_to_proto;
use keel_state::JobSpec;
use tonic::transport::Channel;

use crate::render::{self, Output};

/// Largest spec file accepted.
const SPEC_FILE_MAX_BYTES: u64 = 1024 * 1024;

/// Whether reads may be served from the contacted replica's state as it is
/// (`--stale`), set once by `main`.
pub static STALE_READS: std::sync::OnceLock<bool> = std::sync::OnceLock::new();

/// How the CLI reaches the replicas: plaintext, or TLS with `--tls-ca` (and
/// the client's `--tls-cert` and `--tls-key`). Set once, from the flags.
pub static TRANSPORT: std::sync::OnceLock<keel::transport::Transport> = std::sync::OnceLock::new();

fn transport() -> keel::transport::Transport {
    TRANSPORT.get().cloned().unwrap_or_default()
}

/// The caller's token (`--token`, `KEEL_TOKEN`), set once by `main`.
pub static TOKEN: std::sync::OnceLock<String> = std::sync::OnceLock::new();

/// The trace the command's requests belong to (a W3C `traceparent`: the
/// command's own span with `--otlp-endpoint`, else `TRACEPARENT` from the
/// environment), set once by `main`.
pub static TRACE_PARENT: std::sync::OnceLock<String> = std::sync::OnceLock::new();

/// Adds the read mode, the caller's token and the trace context to every
/// request.
#[derive(Debug, Clone)]
pub struct ReadMode {
    stale: bool,
    /// `Bearer <token>`, as the `authorization` metadata carries it.
    authorization: Option<tonic::metadata::MetadataValue<tonic::metadata::Ascii>>,
    /// The `traceparent` metadata ([`TRACE_PARENT`]).
    traceparent: Option<tonic::metadata::MetadataValue<tonic::metadata::Ascii>>,
}

impl tonic::service::Interceptor for ReadMode {
    fn call(
        &mut self,
        mut request: tonic::Request<()>,
    ) -> Result<tonic::Request<()>, tonic::Status> {
        if self.stale {
            request.metadata_mut().insert(
                keel::api::READ_HEADER,
                tonic::metadata::MetadataValue::from_static("stale"),
            );
        }
        if let Some(value) = &self.authorization {
            request
                .metadata_mut()
                .insert(keel::authz::AUTHORIZATION_HEADER, value.clone());
        }
        if let Some(value) = &self.traceparent {
            request
                .metadata_mut()
                .insert(keel::traces::TRACEPARENT_HEADER, value.clone());
        }
        Ok(request)
    }
}

pub type Client = KeelClient<tonic::service::interceptor::InterceptedService<Channel, ReadMode>>;

/// Connects to the first reachable of the comma-separated addresses.
async fn connect(addrs: &str) -> anyhow::Result<Client> {
    Ok(connect_from(addrs, 0).await?.0)
}

/// The comma-separated addresses, in order.
fn address_list(addrs: &str) -> Vec<&str> {
    addrs
        .split(',')
        .map(str::trim)
        .filter(|a| !a.is_empty())
        .collect()
}

/// Connects to `addr` alone.
async fn connect_one(addr: &str) -> anyhow::Result<Client> {
    let transport = transport();
    if addr.starts_with("https://") && !transport.is_tls() {
        anyhow::bail!(
            "{addr}: an https address needs --tls-ca (and the client's --tls-cert and --tls-key)"
        );
    }
    let endpoint = transport
        .endpoint(addr)
        .with_context(|| format!("invalid server address {addr:?}"))?
        .connect_timeout(std::time::Duration::from_secs(2));
    let channel = transport
        .connect(endpoint, keel::transport::Peer::Address(addr))
        .await
        .map_err(|e| {
            let hint = if transport.is_tls() {
                " (with TLS: is the server's certificate from --tls-ca's CA, and does it name \
                 this host?)"
            } else {
                " (if the server uses TLS, give --tls-ca, --tls-cert and --tls-key)"
            };
            anyhow::Error::new(e).context(format!("{addr}{hint}"))
        })?;
    let authorization = match TOKEN.get() {
        Some(token) => Some(
            format!("Bearer {}", token.trim())
                .parse()
                .context("the token (--token, KEEL_TOKEN) is not printable ASCII")?,
        ),
        None => None,
    };
    let mode = ReadMode {
        stale: STALE_READS.get().copied().unwrap_or(false),
        authorization,
        traceparent: TRACE_PARENT.get().and_then(|t| t.parse().ok()),
    };
    Ok(KeelClient::with_interceptor(channel, mode)
        .max_decoding_message_size(64 * keel::MAX_REQUEST_BYTES))
}

/// Connects to the first reachable of the comma-separated addresses,
/// starting at the `first`-th (modulo their number): a write sent again
/// after a send that got no answer tries the next replica first. Returns
/// the client and the address it reached.
async fn connect_from(addrs: &str, first: usize) -> anyhow::Result<(Client, String)> {
    let mut last_error = None;
    let list = address_list(addrs);
    let start = first % list.len().max(1);
    for &addr in list[start..].iter().chain(&list[..start]) {
        match connect_one(addr).await {
            Ok(client) => return Ok((client, addr.to_string())),
            Err(e) => last_error = Some(e),
        }
    }
    Err(last_error
        .unwrap_or_else(|| anyhow::anyhow!("no address given"))
        .context(format!(
            "cannot connect to a Keel server at {addrs} (set --addr or KEEL_ADDR)"
        )))
}

/// Whether a replica's answer sends the CLI to the next address: it is not
/// the leader and knows none, it was removed from the cluster, or it
/// cannot serve now (all UNAVAILABLE). Another replica may answer.
fn ask_another(status: &tonic::Status) -> bool {
    status.code() == tonic::Code::Unavailable
}

/// The addresses tried and what each said, for an error when none answered.
#[derive(Debug, Default)]
struct Tried(Vec<(String, String)>);

impl Tried {
    fn note(&mut self, addr: &str, why: String) {
        match self.0.iter_mut().find(|(a, _)| a == addr) {
            Some((_, last)) => *last = why,
            None => self.0.push((addr.to_string(), why)),
        }
    }

    fn error(&self, what: &str) -> anyhow::Error {
        let tried: Vec<String> = self
            .0
            .iter()
            .map(|(a, why)| format!("{a}: {why}"))
            .collect();
        anyhow::anyhow!("{what}; tried {}", tried.join("; "))
    }
}

/// Runs a read on the first replica of `addrs` that can answer it: one
/// that cannot be reached, knows no leader or was removed is passed over
/// for the next; when none answers, the error names each address and why.
/// Returns the answer and the client that gave it (for follow-up reads).
pub(crate) async fn read<T, F, Fut>(addrs: &str, mut call: F) -> anyhow::Result<(T, Client)>
where
    F: FnMut(Client) -> Fut,
    Fut: std::future::Future<Output = Result<tonic::Response<T>, tonic::Status>>,
{
    let list = address_list(addrs);
    if list.is_empty() {
        bail!("no server address given (set --addr or KEEL_ADDR)");
    }
    let mut tried = Tried::default();
    for addr in list {
        let client = match connect_one(addr).await {
            Ok(client) => client,
            Err(e) => {
                tried.note(addr, format!("{e:#}"));
                continue;
            }
        };
        match call(client.clone()).await {
            Ok(resp) => return Ok((resp.into_inner(), client)),
            Err(status) if ask_another(&status) => tried.note(addr, status.message().to_string()),
            Err(status) => return Err(status_error(status)),
        }
    }
    Err(tried.error(&format!(
        "no Keel server at {addrs} could answer (set --addr or KEEL_ADDR)"
    )))
}

/// How long the CLI keeps sending a write that got no answer.
const WRITE_RETRY_FOR: std::time::Duration = std::time::Duration::from_secs(30);

/// How long one send of a write waits for its answer: a server that stopped
/// (SIGSTOP, a stall) keeps the connection open and answers nothing, so the
/// send counts as in doubt and goes again, to the next address that answers.
const WRITE_ATTEMPT_TIMEOUT: std::time::Duration = std::time::Duration::from_secs(5);

/// One send of a write, at most [`WRITE_ATTEMPT_TIMEOUT`] long (past it, a
/// `DEADLINE_EXCEEDED`: in doubt).
async fn attempt<T>(
    send: impl std::future::Future<Output = Result<tonic::Response<T>, tonic::Status>>,
) -> Result<tonic::Response<T>, tonic::Status> {
    tokio::time::timeout(WRITE_ATTEMPT_TIMEOUT, send)
        .await
        .unwrap_or_else(|_| {
            Err(tonic::Status::deadline_exceeded(format!(
                "no answer within {} s",
                WRITE_ATTEMPT_TIMEOUT.as_secs()
            )))
        })
}

/// Whether a write's failure leaves it in doubt or undone, so that it is
/// sent again (with the same request id, so it applies at most once): no
/// leader, not the leader, a lost connection, a deadline.
fn retryable(status: &tonic::Status) -> bool {
    matches!(
        status.code(),
        tonic::Code::Unavailable
            | tonic::Code::DeadlineExceeded
            | tonic::Code::Cancelled
            | tonic::Code::Aborted
            | tonic::Code::Unknown
    )
}

/// A new request id: this command's, for all its sends.
pub fn new_request_id() -> String {
    format!("cli-{:032x}", rand::random::<u128>())
}

/// Runs a write under one request id (see `keel_state::requests`),
/// sending it again (reconnecting, for at most [`WRITE_RETRY_FOR`]) while
/// there is no leader to take it or its answer was lost: the server
/// applies it once and answers a repeat with the first outcome.
pub(crate) async fn write<T, F, Fut>(addrs: &str, mut call: F) -> anyhow::Result<T>
where
    F: FnMut(Client, String) -> Fut,
    Fut: std::future::Future<Output = Result<tonic::Response<T>, tonic::Status>>,
{
    let request_id = new_request_id();
    let deadline = std::time::Instant::now() + WRITE_RETRY_FOR;
    let mut sent = false;
    let mut first = 0;
    let mut tried = Tried::default();
    let replicas = address_list(addrs).len().max(1);
    loop {
        match connect_from(addrs, first).await {
            Ok((client, addr)) => {
                sent = true;
                match attempt(call(client, request_id.clone())).await {
                    Ok(resp) => return Ok(resp.into_inner()),
                    Err(status) if retryable(&status) && std::time::Instant::now() < deadline => {
                        tracing::debug!(%request_id, %addr, %status, "write in doubt or not taken; sending it again");
                        tried.note(&addr, status.message().to_string());
                        // Not the leader and knowing none, removed, stopped:
                        // the next replica first (issue 34).
                        first += 1;
                        // A round of every replica without an answer: wait
                        // for an election before the next.
                        if first % replicas != 0 {
                            continue;
                        }
                    }
                    Err(status) if retryable(&status) && !tried.0.is_empty() => {
                        tried.note(&addr, status.message().to_string());
                        return Err(tried.error(&format!(
                            "no Keel server took the write within {} s",
                            WRITE_RETRY_FOR.as_secs()
                        )));
                    }
                    Err(status) => return Err(status_error(status)),
                }
            }
            // Nothing answers: fail at once, unless a send is in doubt.
            Err(e) if !sent || std::time::Instant::now() >= deadline => return Err(e),
            Err(e) => tracing::debug!(%request_id, "cannot reconnect: {e:#}"),
        }
        tokio::time::sleep(std::time::Duration::from_millis(200)).await;
    }
}

/// Runs a write the state machine does not deduplicate (a membership
/// change), sending it again only while it was refused before reaching the
/// log (no leader, or not the leader), for at most 10 s.
async fn write_once<T, F, Fut>(addrs: &str, mut call: F) -> anyhow::Result<T>
where
    F: FnMut(Client) -> Fut,
    Fut: std::future::Future<Output = Result<tonic::Response<T>, tonic::Status>>,
{
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(10);
    let mut first = 0;
    let mut tried = Tried::default();
    loop {
        let (client, addr) = connect_from(addrs, first).await?;
        match call(client).await {
            Ok(resp) => return Ok(resp.into_inner()),
            Err(status) if keel::grpc_status::not_proposed(&status) => {
                tried.note(&addr, status.message().to_string());
                if std::time::Instant::now() >= deadline {
                    return Err(tried.error("no Keel server took the change within 10 s"));
                }
                // The next replica may know the leader (issue 34).
                first += 1;
                tokio::time::sleep(std::time::Duration::from_millis(100)).await;
            }
            Err(status) => return Err(status_error(status)),
        }
    }
}

pub(crate) fn status_error(e: tonic::Status) -> anyhow::Error {
    // A connection the server's TLS refused reads, on the client's side,
    // as a broken HTTP/2 stream: say what to check.
    let hint = match e.code() {
        tonic::Code::Unknown
        | tonic::Code::Internal
        | tonic::Code::Unavailable
        | tonic::Code::Cancelled
            if e.metadata().is_empty() =>
        {
            if transport().is_tls() {
                "; with TLS, check that --tls-cert and --tls-key are a client certificate \
                 from the cluster's CA"
            } else {
                "; if the server uses TLS, give --tls-ca, --tls-cert and --tls-key"
            }
        }
        tonic::Code::Unauthenticated if TOKEN.get().is_none() => {
            "; give a token with --token or KEEL_TOKEN"
        }
        _ => "",
    };
    anyhow::anyhow!("{} ({:?}){hint}", e.message(), e.code())
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
        let mut spec: JobSpec = serde_saphyr::from_str(&text)
            .with_context(|| format!("{name} is not a valid job spec"))?;
        keep_plain_env_text(&text, &mut spec);
        spec
    };
    spec.validate()
        .with_context(|| format!("{name} is not a valid job spec"))?;
    Ok(spec)
}

/// Puts back the text of `env` values written as plain YAML scalars: the
/// spec's parse reads a value that may also be `{secret: NAME/KEY}`, and so
/// takes a plain number or boolean as its value (`0.10` as `0.1`, `010`
/// as `10`), where the text as written is what the variable should hold.
fn keep_plain_env_text(text: &str, spec: &mut JobSpec) {
    #[derive(serde::Deserialize)]
    struct EnvSpans {
        #[serde(default)]
        env: std::collections::BTreeMap<String, serde_saphyr::Spanned<serde::de::IgnoredAny>>,
    }
    let Ok(spans) = serde_saphyr::from_str::<EnvSpans>(text) else {
        return;
    };
    for (variable, spanned) in spans.env {
        let Some(value) = spec.env.get_mut(&variable) else {
            continue;
        };
        let span = spanned.referenced.span();
        let (Some(offset), Some(len)) = (span.byte_offset(), span.byte_len()) else {
            continue;
        };
        let (Ok(start), Ok(len)) = (usize::try_from(offset), usize::try_from(len)) else {
            continue;
        };
        let Some(raw) = text.get(start..start.saturating_add(len)) else {
            continue;
        };
        // A plain scalar on one line: its text is its value. Quoted,
        // block, tagged or aliased ones already came as their text.
        let plain = !raw.is_empty()
            && !raw.contains('\n')
            && !raw.starts_with(['"', '\'', '|', '>', '{', '[', '!', '&', '*']);
        if plain && raw.trim() != value.as_str() {
            *value = raw.trim().to_string();
        }
    }
}

pub async fn submit(addr: &str, file: &Path, out: Output) -> anyhow::Result<()> {
    let spec = spec_to_proto(&read_spec(file)?);
    let resp = write(addr, |mut client, request_id| {
        let spec = spec.clone();
        async move {
            client
                .submit_job(api::SubmitJobRequest {
                    spec: Some(spec),
                    request_id,
                })
                .await
        }
    })
    .await?;
    render::submitted(&resp, out)?;
    #[allow(clippy::print_stderr)]
    for warning in &resp.warnings {
        eprintln!("warning: {warning}");
    }
    // A job no node can run is accepted (nodes may join later), but the
    // submitter hears why it will wait.
    if let Ok(mut client) = connect(addr).await {
        if let Ok(job) = client
            .get_job(api::GetJobRequest {
                job_id: resp.job_id,
            })
            .await
        {
            let job = job.into_inner();
            if job.message.starts_with("waiting: ") {
                #[allow(clippy::print_stderr)]
                {
                    eprintln!("warning: job {} is {}", job.id, job.message);
                }
            }
        }
    }
    Ok(())
}

pub async fn jobs(
    addr: &str,
    state: Option<String>,
    user: Option<String>,
    queue: Option<String>,
    out: Output,
) -> anyhow::Result<()> {
    let mut request = api::ListJobsRequest {
        state: state.unwrap_or_default(),
        user: user.unwrap_or_default(),
        queue: queue.unwrap_or_default(),
        ..Default::default()
    };
    // Page after page: the server answers at most 10,000 jobs at a time.
    let mut jobs = Vec::new();
    loop {
        let (resp, _) = read(addr, |mut client| {
            let request = request.clone();
            async move { client.list_jobs(request).await }
        })
        .await?;
        jobs.extend(resp.jobs);
        if resp.next_page_token.is_empty() {
            break;
        }
        request.page_token = resp.next_page_token;
    }
    render::jobs(&jobs, out)
}

pub async fn job(addr: &str, id: u64, out: Output) -> anyhow::Result<()> {
    let (job, mut client) = read(addr, |mut client| async move {
        client.get_job(api::GetJobRequest { job_id: id }).await
    })
    .await?;
    let history = history(&mut client, id).await?;
    // A running job's logs that are paused for want of space (asked of the
    // leader's executor; a failure to ask leaves the job shown without).
    let mut logs_paused = Vec::new();
    if job.state == "running" {
        let logs = client
            .get_logs(api::GetLogsRequest {
                job_id: id,
                tail_bytes: 1,
            })
            .await;
        if let Ok(logs) = logs {
            logs_paused = logs
                .into_inner()
                .logs
                .into_iter()
                .filter(|l| !l.paused.is_empty())
                .map(|l| render::PausedLog {
                    epoch: l.epoch,
                    rank: l.rank,
                    why: l.paused,
                })
                .collect();
        }
    }
    render::job(&job, &history, logs_paused, out)
}

pub async fn logs(addr: &str, id: u64, tail_bytes: u64, out: Output) -> anyhow::Result<()> {
    let (resp, _) = read(addr, |mut client| async move {
        client
            .get_logs(api::GetLogsRequest {
                job_id: id,
                tail_bytes,
            })
            .await
    })
    .await?;
    render::logs(id, &resp, out)
}

/// Prints each worker log's tail, then what is appended, until the job has
/// ended and its logs stop growing. Polls the server twice a second.
pub async fn follow_logs(addr: &str, id: u64, tail_bytes: u64) -> anyhow::Result<()> {
    let (_, mut client) = read(addr, |mut client| async move {
        client.get_job(api::GetJobRequest { job_id: id }).await
    })
    .await?;
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
    let resp = write(addr, |mut client, request_id| {
        let request = api::SetNodeStateRequest {
            name: name.clone(),
            state: state.to_string(),
            reason: reason.clone(),
            request_id,
        };
        async move { client.set_node_state(request).await }
    })
    .await?;
    render::node_state_set(&name, state, resp.index, out)
}

pub async fn remove_node(addr: &str, name: String, force: bool, out: Output) -> anyhow::Result<()> {
    let resp = write(addr, |mut client, request_id| {
        let request = api::RemoveNodeRequest {
            name: name.clone(),
            force,
            request_id,
        };
        async move { client.remove_node(request).await }
    })
    .await?;
    render::node_removed(&name, &resp, out)
}

pub async fn set_policy(addr: &str, name: String, out: Output) -> anyhow::Result<()> {
    let resp = write(addr, |mut client, request_id| {
        let request = api::SetPolicyRequest {
            name: name.clone(),
            request_id,
        };
        async move { client.set_policy(request).await }
    })
    .await?;
    render::policy_set(&name, resp.index, out)
}

pub async fn show_policy(addr: &str, out: Output) -> anyhow::Result<()> {
    let (status, _) = read(addr, |mut client| async move {
        client.cluster_status(api::ClusterStatusRequest {}).await
    })
    .await?;
    render::policy_show(&status.policy, out)
}

pub async fn cancel(addr: &str, id: u64, reason: String, out: Output) -> anyhow::Result<()> {
    let resp = write(addr, |mut client, request_id| {
        let reason = reason.clone();
        async move {
            client
                .cancel_job(api::CancelJobRequest {
                    job_id: id,
                    reason,
                    request_id,
                })
                .await
        }
    })
    .await?;
    render::cancelled(id, &resp, out)
}

pub async fn nodes(addr: &str, out: Output) -> anyhow::Result<()> {
    let (resp, _) = read(addr, |mut client| async move {
        client.list_nodes(api::ListNodesRequest {}).await
    })
    .await?;
    render::nodes(&resp.nodes, out)
}

pub async fn events(addr: &str, from: u64, follow: bool, out: Output) -> anyhow::Result<()> {
    let (mut stream, _) = read(addr, |mut client| async move {
        client
            .watch_events(api::WatchEventsRequest {
                from_index: from,
                follow,
            })
            .await
    })
    .await?;
    while let Some(record) = stream.message().await.map_err(status_error)? {
        render::applied_entry(&record, out)?;
    }
    Ok(())
}

/// The contacted replica's status, then every member's own (asked
/// directly, so each row is that member's view), with replication lag from
/// the leader's view.
pub async fn cluster_status(addr: &str, out: Output) -> anyhow::Result<()> {
    let mut client = connect(addr).await?;
    let status = client
        .cluster_status(api::ClusterStatusRequest {})
        .await
        .map_err(status_error)?
        .into_inner();
    let mut views = Vec::new();
    for member in &status.members {
        let own = if member.id == status.member_id {
            Some(status.clone())
        } else {
            member_status(&member.address).await
        };
        views.push((member.clone(), own));
    }
    // Lag as the leader sees it: its last log index minus what it has
    // replicated to the member.
    let leader = views
        .iter()
        .find_map(|(_, s)| s.as_ref().filter(|s| s.role == "leader"))
        .cloned();
    render::cluster_status(&status, &views, leader.as_ref(), out)
}

pub async fn add_member(
    addr: &str,
    id: u64,
    member_addr: String,
    learner_only: bool,
    catch_up_timeout_s: u32,
    out: Output,
) -> anyhow::Result<()> {
    let resp = write_once(addr, |mut client| {
        let address = member_addr.clone();
        async move {
            client
                .add_member(api::AddMemberRequest {
                    id,
                    address,
                    learner_only,
                    catch_up_timeout_s,
                })
                .await
        }
    })
    .await?;
    render::membership(&resp, out)
}

pub async fn remove_member(addr: &str, id: u64, out: Output) -> anyhow::Result<()> {
    let resp = write_once(addr, |mut client| async move {
        client.remove_member(api::RemoveMemberRequest { id }).await
    })
    .await?;
    render::membership(&resp, out)
}

/// `keel cluster force-new-cluster`: offline, on a stopped replica's data
/// directory (its lock proves no server uses it).
pub fn force_new_cluster(
    data_dir: &Path,
    id: u64,
    member_addr: Option<&str>,
    out: Output,
) -> anyhow::Result<()> {
    let what = || format!("cannot recover {}", data_dir.display());
    if !data_dir.join("raft-log").is_dir() {
        anyhow::bail!(
            "{} holds no Raft log: it is not a Keel data directory (or never joined a cluster)",
            data_dir.display()
        );
    }
    if !keel::membership::is_member_id(id) {
        anyhow::bail!(
            "--id {id} is out of range: member ids are 1 to {}",
            keel::membership::MEMBER_ID_MAX
        );
    }
    let dir = keel_storage::DataDir::open(data_dir).with_context(what)?;
    let incarnation =
        keel::membership::load_or_create_incarnation(&dir.root().join("incarnation"), false)
            .with_context(what)?;
    let raft_id = keel::membership::raft_id(id, incarnation);
    let forced = keel_storage::force_single_voter(&dir, raft_id, member_addr).with_context(what)?;
    render::forced_membership(id, &forced, out)
}

async fn member_status(addr: &str) -> Option<api::ClusterStatusResponse> {
    let transport = transport();
    let endpoint = transport
        .endpoint(addr)
        .ok()?
        .connect_timeout(std::time::Duration::from_millis(500))
        .timeout(std::time::Duration::from_secs(2));
    let channel = transport
        .connect(endpoint, keel::transport::Peer::Address(addr))
        .await
        .ok()?;
    KeelClient::new(channel)
        .cluster_status(api::ClusterStatusRequest {})
        .await
        .ok()
        .map(|r| r.into_inner())
}

pub async fn why(addr: &str, id: u64, out: Output) -> anyhow::Result<()> {
    let (history, _) = read(addr, |mut client| async move {
        client
            .job_history(api::JobHistoryRequest {
                job_id: id,
                limit: 0,
            })
            .await
    })
    .await?;
    render::why(id, &history, out)
}

/// A job's whole history (up to the server's limit).
async fn history(client: &mut Client, id: u64) -> anyhow::Result<api::JobHistoryResponse> {
    Ok(client
        .job_history(api::JobHistoryRequest {
            job_id: id,
            limit: 0,
        })
        .await
        .map_err(status_error)?
        .into_inner())
}

/// Where an offline read of the log stops: after log index `index`, else
/// after the last entry stamped at or before `time` (RFC 3339, e.g.
/// 2026-11-26T10:00:00Z, given to `time_flag`), else at the end.
pub fn until(
    index: Option<u64>,
    time: Option<&str>,
    time_flag: &str,
) -> anyhow::Result<keel_storage::Until> {
    match (index, time) {
        (Some(i), _) => Ok(keel_storage::Until::Index(i)),
        (None, None) => Ok(keel_storage::Until::End),
        (None, Some(t)) => Ok(keel_storage::Until::Time(unix_ms(t, time_flag)?)),
    }
}

/// An RFC 3339 time given to `flag`, in Unix milliseconds.
pub fn unix_ms(time: &str, flag: &str) -> anyhow::Result<u64> {
    let at = humantime::parse_rfc3339_weak(time)
        .with_context(|| format!("{flag} {time:?} is not an RFC 3339 time"))?;
    Ok(at
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_millis() as u64)
        .unwrap_or(0))
}

pub fn replay(data_dir: &Path, until: keel_storage::Until, out: Output) -> anyhow::Result<()> {
    // Take the directory's lock: replaying a directory a server is writing
    // would read a moving journal.
    let dir = keel_storage::DataDir::open(data_dir)
        .with_context(|| format!("cannot replay {}", data_dir.display()))?;
    let summary = keel_storage::replay_data_dir(&dir, until)
        .with_context(|| format!("cannot replay {}", data_dir.display()))?;
    render::replay(&summary, out)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_plain_yaml_env_value_keeps_its_text_and_a_secret_is_a_reference() {
        let text = "name: t\ncommand: [x]\nenv:\n  LR: 0.10\n  N: 010\n  FLAG: yes\n  \
                    Q: '0.50'\n  S: plain words   # a comment\n  K: {secret: tracker/api_key}\n";
        let dir = tempfile::tempdir().expect("tempdir");
        let file = dir.path().join("spec.yaml");
        std::fs::write(&file, text).expect("write");
        let spec = read_spec(&file).expect("parses");
        let env = |k: &str| spec.env.get(k).map(String::as_str);
        assert_eq!(env("LR"), Some("0.10"));
        assert_eq!(env("N"), Some("010"));
        assert_eq!(env("FLAG"), Some("yes"));
        assert_eq!(env("Q"), Some("0.50"));
        assert_eq!(env("S"), Some("plain words"));
        assert_eq!(env("K"), None);
        assert_eq!(spec.secret_env["K"].to_string(), "tracker/api_key");
    }
}
