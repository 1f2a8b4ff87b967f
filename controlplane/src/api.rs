//! The `keel.api.v1.Keel` gRPC service.
//!
//! Writes become log entries stamped with the leader's clock and return once
//! applied; reads are linearizable (read index) against the local state.

use std::pin::Pin;
use std::sync::Arc;

use futures::Stream;
use keel_executors::Executor;
use keel_proto::api::{self, keel_client::KeelClient, keel_server::Keel};
use keel_proto::entry::AppliedEntry;
use keel_state::codec::spec_from_proto;
use keel_state::{Command, JobState};
use openraft::ServerState;
use tonic::transport::Channel;
use tonic::{Request, Response, Status};

use crate::authz::{Caller, Granted, Right};
use crate::grpc_status::ApiError;
use crate::node_liveness::{reports_from_proto, HeartbeatInbox, HEARTBEAT_NODES_MAX};
use crate::proposer::Proposer;
use crate::raft_node::RaftNode;

/// Where the API gets the time it stamps on entries. Injected so tests can
/// fix it.
pub type Clock = Arc<dyn Fn() -> u64 + Send + Sync>;

/// The wall clock, in Unix milliseconds.
pub fn system_clock() -> Clock {
    Arc::new(|| {
        std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map(|d| d.as_millis() as u64)
            .unwrap_or(0)
    })
}

mod acl;
pub(crate) mod queues;
mod secrets;
mod snapshots;
mod streams;
pub use acl::BOOTSTRAP_TOKEN_NAME;
pub use snapshots::SNAPSHOT_FILE_FORMAT;
pub use streams::MAX_EVENT_STREAMS_PER_CALLER;

/// Records sent per read of the journal while streaming events.
const WATCH_BATCH: usize = 512;
/// Longest user filter accepted by ListJobs.
const USER_FILTER_MAX_LEN: usize = keel_state::spec::limits::USER_MAX_LEN;

/// Default and largest tail of each worker log that GetLogs returns.
const LOG_TAIL_DEFAULT_BYTES: u64 = 64 * 1024;
const LOG_TAIL_MAX_BYTES: u64 = 4 * 1024 * 1024;
/// Default and largest number of entries JobHistory returns.
const HISTORY_MAX_ENTRIES: usize = 10_000;
/// Jobs in one `ListJobs` answer when its `page_size` is 0 (well under
/// the 4 MiB a gRPC client takes by default), and the most it may ask.
const LIST_JOBS_PAGE_DEFAULT: usize = 1_000;
const LIST_JOBS_PAGE_MAX: usize = 10_000;

/// Metadata a replica sets on a request it forwards to the leader, so the
/// leader never forwards it again.
const FORWARDED_HEADER: &str = "keel-forwarded";
/// Metadata a client sets to read this replica's state as it is, without a
/// linearizable read index (`keel --stale`).
pub const READ_HEADER: &str = "keel-read";

/// The longest a request forwarded to the leader may take.
pub const FORWARD_TIMEOUT: std::time::Duration = std::time::Duration::from_secs(30);

pub struct KeelApi {
    node: Arc<RaftNode>,
    proposer: Proposer,
    /// The executor this server runs workers with (when it leads): worker
    /// logs, which nodes it owns, whether it can share GPUs.
    executor: Arc<crate::executors::AnyExecutor>,
    heartbeats: Arc<HeartbeatInbox>,
    /// The server's configured policy (rounds use it until `SetPolicy`).
    default_policy: &'static str,
    /// What the scheduling loop last did (policy counters, the index it
    /// last planned on).
    scheduling: crate::leader::SchedulingReports,
    /// A channel to the current leader (its address, the client), reused
    /// while the leader stays the same.
    leader: tokio::sync::Mutex<Option<(String, KeelClient<Channel>)>>,
    /// One permit per open `WatchEvents` stream, held by its task until
    /// the stream ends or its client goes away.
    event_streams: Arc<tokio::sync::Semaphore>,
    max_event_streams: usize,
    /// The same by caller ([`streams`]).
    streams_by_caller: Arc<streams::StreamsByCaller>,
    /// Whether callers are checked ([`crate::authz`], `--acl`).
    acl: bool,
    /// The clock tokens' expiry is read against.
    clock: Clock,
    /// The operators' keys that seal secrets ([`crate::secret_keys`]).
    secret_keys: Arc<crate::secret_keys::SecretKeys>,
}

/// The most `WatchEvents` streams one replica serves at once, unless
/// `--max-event-streams` says otherwise.
pub const MAX_EVENT_STREAMS: usize = 256;

/// Forwards a request to the leader when this replica should not answer it
/// itself (see [`KeelApi::forward_to`]).
macro_rules! route {
    ($self:ident, $request:ident, $method:ident, $write:expr) => {
        route!($self, $request, $method, $write, |answer| answer)
    };
    // `$answer` turns the leader's answer into this call's (a stream's
    // type differs between a client and a server).
    ($self:ident, $request:ident, $method:ident, $write:expr, $answer:expr) => {
        if let Some(mut leader) = $self.forward_to(&$request, $write).await? {
            // Whom for: the leader believes it of a member's connection only.
            let caller = crate::caller::caller_of(&$request);
            // The caller's token, for the leader to check again.
            let token = $request
                .metadata()
                .get(crate::authz::AUTHORIZATION_HEADER)
                .cloned();
            let mut forwarded = Request::new($request.into_inner());
            forwarded.metadata_mut().insert(
                FORWARDED_HEADER,
                tonic::metadata::MetadataValue::from_static("1"),
            );
            if let Some(value) = caller.and_then(|c| c.parse().ok()) {
                forwarded
                    .metadata_mut()
                    .insert(crate::caller::CALLER_HEADER, value);
            }
            if let Some(token) = token {
                forwarded
                    .metadata_mut()
                    .insert(crate::authz::AUTHORIZATION_HEADER, token);
            }
            // The leader's span a child of this one ([`crate::traces`]).
            if let Some(value) = crate::traces::current_trace_parent().and_then(|t| t.parse().ok())
            {
                forwarded
                    .metadata_mut()
                    .insert(crate::traces::TRACEPARENT_HEADER, value);
            }
            return leader
                .$method(forwarded)
                .await
                .map($answer)
                .map_err(forward_error);
        }
    };
}

/// A forwarded request that could not even reach the leader (it is down
/// and no new one is elected yet) was never proposed: say so with the
/// reason `NO_LEADER`, which clients retry on.
fn forward_error(status: Status) -> Status {
    // A status the leader answered carries its reason; the transport's own
    // says the request was not sent only if the connection was never made
    // (one lost midway stays in doubt: UNAVAILABLE without a reason).
    if crate::grpc_status::never_connected(&status) {
        return crate::grpc_status::status_with_reason(
            tonic::Code::Unavailable,
            format!("no leader is reachable ({}); retry", status.message()),
            crate::grpc_status::reason::NO_LEADER,
            None,
            Default::default(),
        );
    }
    status
}

fn is_stale<T>(request: &Request<T>) -> bool {
    request
        .metadata()
        .get(READ_HEADER)
        .is_some_and(|v| v.as_bytes() == b"stale")
}

impl std::fmt::Debug for KeelApi {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("KeelApi")
            .field("node", &self.node.id)
            .finish()
    }
}

impl KeelApi {
    pub fn new(
        node: Arc<RaftNode>,
        proposer: Proposer,
        executor: Arc<crate::executors::AnyExecutor>,
        heartbeats: Arc<HeartbeatInbox>,
        default_policy: &'static str,
        scheduling: crate::leader::SchedulingReports,
        max_event_streams: usize,
    ) -> Self {
        KeelApi {
            node,
            proposer,
            executor,
            heartbeats,
            default_policy,
            scheduling,
            leader: tokio::sync::Mutex::new(None),
            event_streams: Arc::new(tokio::sync::Semaphore::new(max_event_streams)),
            max_event_streams,
            streams_by_caller: Default::default(),
            acl: false,
            clock: system_clock(),
            secret_keys: Default::default(),
        }
    }

    /// Seals secrets with `keys` ([`crate::secret_keys`]).
    pub fn with_secret_keys(mut self, keys: Arc<crate::secret_keys::SecretKeys>) -> Self {
        self.secret_keys = keys;
        self
    }

    /// Checks every caller against its role ([`crate::authz`]).
    pub fn with_acl(mut self, acl: bool) -> Self {
        self.acl = acl;
        self
    }

    /// The request's caller, if it may use `right` ([`crate::authz`]).
    fn authorize<T>(&self, request: &Request<T>, right: Right) -> Result<Granted, ApiError> {
        self.caller(request)?.authorize(right)
    }

    /// The request's caller ([`crate::authz::caller_of`]).
    fn caller<T>(&self, request: &Request<T>) -> Result<Caller, ApiError> {
        // The state and the clock are read only for a token.
        crate::authz::caller_of(request, self.acl, |secret| {
            let shared = self.node.state_machine.shared();
            let applied = shared.read();
            crate::authz::token_role(applied.state.acl(), secret, (self.clock)())
        })
    }

    /// Whether a granted right reaches job `job_id` (a job not known is
    /// left for the call to find).
    /// Why job `job_id` is not in the state: never submitted, or removed
    /// once it had ended.
    fn job_missing(state: &keel_state::ClusterState, job_id: u64) -> ApiError {
        if state.was_removed(job_id) {
            ApiError::JobRemoved(job_id)
        } else {
            ApiError::JobNotFound(job_id)
        }
    }

    fn check_job(&self, granted: &Granted, job_id: u64) -> Result<(), ApiError> {
        let shared = self.node.state_machine.shared();
        let applied = shared.read();
        match applied.state.job(job_id) {
            Some(job) => granted.check_job(job_id, job.submitted_by.as_deref()),
            None => Ok(()),
        }
    }

    /// Logs who asked for a membership change (a Raft membership entry
    /// carries no actor): an audit entry that changes no state. Not
    /// logged if the proposal fails; the change stands either way.
    async fn record_membership_change(
        &self,
        member: u64,
        change: &str,
        membership_index: u64,
        actor: Option<String>,
    ) {
        let command =
            Command::record_membership_change(member, change.to_string(), membership_index);
        // Bounded: a leader that removed itself may be unable to commit
        // anything more (its successor is being elected), and the change
        // stands either way, so the caller is answered.
        let proposed = tokio::time::timeout(
            MEMBERSHIP_AUDIT_TIMEOUT,
            self.proposer.propose_request(command, None, actor),
        )
        .await;
        let error = match proposed {
            Ok(Ok(_)) => return,
            Ok(Err(e)) => e.to_string(),
            Err(_) => format!(
                "not committed within {} s",
                MEMBERSHIP_AUDIT_TIMEOUT.as_secs()
            ),
        };
        tracing::warn!(member, change, %error, "the membership change is not in the audit log");
    }

    /// Refuses the ACL calls on a replica that does not check callers.
    fn require_acl(&self) -> Result<(), ApiError> {
        if self.acl {
            return Ok(());
        }
        Err(ApiError::Unsupported(
            "this replica does not check callers: start every replica with --acl (and TLS) \
             before managing tokens"
                .into(),
        ))
    }

    fn membership(&self, index: u64) -> api::MembershipResponse {
        let m = self.node.raft.metrics();
        let m = m.borrow();
        let membership = m.membership_config.membership();
        api::MembershipResponse {
            voters: crate::membership::member_ids(membership.voter_ids()),
            learners: crate::membership::member_ids(membership.learner_ids()),
            index,
        }
    }

    /// Where a request goes: `None` to answer here, or a client to the
    /// leader. Writes always go to the leader; reads too, unless the client
    /// asked for a stale read. A request already forwarded once is never
    /// forwarded again (the answer is then "not the leader", and the client
    /// retries).
    async fn forward_to<T>(
        &self,
        request: &Request<T>,
        write: bool,
    ) -> Result<Option<KeelClient<Channel>>, Status> {
        if !write && is_stale(request) {
            return Ok(None);
        }
        let (leader_id, leader_addr) = {
            let m = self.node.raft.metrics();
            let m = m.borrow();
            let addr = m.current_leader.and_then(|l| {
                m.membership_config
                    .membership()
                    .get_node(&l)
                    .map(|n| n.addr.clone())
            });
            (m.current_leader, addr)
        };
        if leader_id == Some(self.node.id) {
            return Ok(None);
        }
        if request.metadata().get(FORWARDED_HEADER).is_some() {
            return Err(ApiError::NotLeader {
                leader: leader_addr,
            }
            .into());
        }
        let Some(addr) = leader_addr else {
            return Err(ApiError::NoLeader.into());
        };
        let mut cached = self.leader.lock().await;
        if let Some((a, c)) = cached.as_ref() {
            if *a == addr {
                return Ok(Some(c.clone()));
            }
        }
        let transport = &self.node.transport;
        let endpoint = transport
            .endpoint(&addr)
            .map_err(|e| ApiError::Unavailable(format!("leader address {addr:?}: {e}")))?
            .connect_timeout(std::time::Duration::from_secs(1))
            // A forwarded request never waits forever on a connection whose
            // answer was lost (a half-open connection after a partition):
            // keep-alive pings find it dead, and every call has a deadline.
            .http2_keep_alive_interval(std::time::Duration::from_secs(1))
            .keep_alive_timeout(std::time::Duration::from_secs(2))
            .timeout(FORWARD_TIMEOUT)
            .tcp_nodelay(true);
        // The leader's certificate must name the member it is.
        let member = crate::membership::member_of(leader_id.unwrap_or_default());
        let channel = transport
            .lazy(
                endpoint,
                crate::transport::Peer::Member(member),
                self.node.peer_source_ip,
            )
            .map_err(|e| ApiError::Unavailable(format!("leader address {addr:?}: {e}")))?;
        let client = KeelClient::new(channel)
            .max_decoding_message_size(64 * crate::MAX_REQUEST_BYTES)
            .max_encoding_message_size(crate::MAX_REQUEST_BYTES);
        *cached = Some((addr, client.clone()));
        Ok(Some(client))
    }

    /// Proposes a command (stamped with the leader's clock, group-committed
    /// with concurrent ones) and waits until it is applied. A refusal by the
    /// state machine is an error.
    /// Proposes a client's write under its request id (empty: none), checked
    /// here so a bad one is refused before anything is logged.
    async fn propose_request(
        &self,
        command: Command,
        request_id: String,
        actor: Option<String>,
    ) -> Result<(u64, Vec<keel_state::Event>), ApiError> {
        let request_id = Some(request_id).filter(|id| !id.is_empty());
        if let Some(id) = &request_id {
            keel_state::requests::validate_request_id(id)?;
        }
        self.proposer
            .propose_request(command, request_id, actor)
            .await
    }

    /// Why a job's workers are not launched although it holds GPUs: a node
    /// of its allocation is one this server's executor does not own.
    /// `owned` remembers the answer per node across the jobs of one reply
    /// (the local executor's answer is a file lookup, and a listing holds
    /// the state's read lock).
    fn not_launched<'a>(
        &self,
        job: &'a keel_state::Job,
        owned: &mut std::collections::BTreeMap<&'a str, bool>,
    ) -> Option<String> {
        let allocation = job.allocation.as_ref()?;
        let node = allocation
            .gpus
            .iter()
            .map(|g| g.node.as_str())
            .find(|n| !*owned.entry(n).or_insert_with(|| self.executor.owns(n)))?;
        Some(format!(
            "not launched: no executor runs workers on node {node} (it is known from heartbeats only)"
        ))
    }

    async fn linearizable(&self) -> Result<(), ApiError> {
        self.node.raft.ensure_linearizable().await?;
        Ok(())
    }
}

/// How long a membership change's audit entry may take to commit before
/// the change is answered without it.
const MEMBERSHIP_AUDIT_TIMEOUT: std::time::Duration = std::time::Duration::from_secs(5);

type WatchStream = Pin<Box<dyn Stream<Item = Result<AppliedEntry, Status>> + Send>>;

/// Sends the journal's records from `next` on to `tx`, in order (by
/// index and position: a batch may end inside a proposal's records);
/// with `follow`, then waits for more and sends them as they are
/// journaled. Everything applied before the call is in the journal before
/// the first read. Ends when `tx`'s receiver goes away (noticed while
/// waiting too), at the end without `follow`, or after sending a journal
/// error. What `WatchEvents` and the console's event stream serve.
pub(crate) async fn follow_journal(
    store: keel_storage::StateMachineStore,
    mut next: keel_storage::JournalCursor,
    follow: bool,
    tx: tokio::sync::mpsc::Sender<Result<AppliedEntry, keel_storage::StoreError>>,
) {
    let mut journaled = store.shared().subscribe_journal();
    let applied = store.shared().read().last_applied.map_or(0, |l| l.index);
    tokio::select! {
        caught_up = journaled.wait_for(|i| *i >= applied) => {
            if caught_up.is_err() {
                return;
            }
        }
        _ = tx.closed() => return,
    }
    loop {
        // Mark the current index seen before reading, so an apply that
        // lands after the read wakes the wait below.
        journaled.borrow_and_update();
        let batch = match store.applied_entries_at(next, WATCH_BATCH) {
            Ok(b) => b,
            Err(e) => {
                let _ = tx.send(Err(e)).await;
                return;
            }
        };
        let exhausted = batch.len() < WATCH_BATCH;
        for record in batch {
            next = keel_storage::JournalCursor::after(&record);
            if tx.send(Ok(record)).await.is_err() {
                return; // the receiver went away
            }
        }
        if !exhausted {
            continue;
        }
        if !follow {
            return;
        }
        tokio::select! {
            changed = journaled.changed() => {
                if changed.is_err() {
                    return;
                }
            }
            _ = tx.closed() => return,
        }
    }
}

#[tonic::async_trait]
impl Keel for KeelApi {
    async fn submit_job(
        &self,
        request: Request<api::SubmitJobRequest>,
    ) -> Result<Response<api::SubmitJobResponse>, Status> {
        route!(self, request, submit_job, true);
        let granted = self.authorize(&request, Right::SubmitJobs)?;
        let actor = granted.actor();
        let req = request.into_inner();
        let spec = req.spec.ok_or(ApiError::InvalidArgument {
            field: "spec",
            message: "is required".into(),
        })?;
        let spec = spec_from_proto(spec);
        spec.validate().map_err(ApiError::from)?;
        granted.check_queue(&spec.queue)?;
        let warnings = spec.warnings();
        let (index, events) = self
            .propose_request(Command::submit_job(spec), req.request_id, actor)
            .await?;
        let job_id = events
            .iter()
            .find_map(|e| match e {
                keel_state::Event::JobSubmitted { job_id, .. } => Some(*job_id),
                _ => None,
            })
            .ok_or_else(|| ApiError::Storage("submission applied without a job id".into()))?;
        Ok(Response::new(api::SubmitJobResponse {
            job_id,
            index,
            warnings,
        }))
    }

    async fn cancel_job(
        &self,
        request: Request<api::CancelJobRequest>,
    ) -> Result<Response<api::CancelJobResponse>, Status> {
        route!(self, request, cancel_job, true);
        let granted = self.authorize(&request, Right::CancelJobs)?;
        let req = request.into_inner();
        self.check_job(&granted, req.job_id)?;
        let actor = granted.actor();
        let (index, _) = self
            .propose_request(
                Command::cancel_job(req.job_id, req.reason),
                req.request_id,
                actor,
            )
            .await?;
        Ok(Response::new(api::CancelJobResponse { index }))
    }

    async fn get_job(
        &self,
        request: Request<api::GetJobRequest>,
    ) -> Result<Response<api::Job>, Status> {
        let stale = is_stale(&request);
        route!(self, request, get_job, false);
        let granted = self.authorize(&request, Right::ReadJobs)?;
        let job_id = request.into_inner().job_id;
        if !stale {
            self.linearizable().await?;
        }
        let shared = self.node.state_machine.shared();
        let applied = shared.read();
        let job = applied
            .state
            .job(job_id)
            .ok_or_else(|| Self::job_missing(&applied.state, job_id))?;
        granted.check_job(job_id, job.submitted_by.as_deref())?;
        let mut reply = crate::convert::job_to_proto(job);
        if let Some(why) = waiting(job)
            .then(|| never_fits(&applied.state, &job.spec))
            .flatten()
        {
            reply.message = why;
        } else if let Some(why) =
            AdmissionView::of(&applied.state, self.default_policy).why_waiting(job)
        {
            reply.message = with_reason(&reply.message, &why);
        }
        if let Some(why) = self.not_launched(job, &mut Default::default()) {
            reply.message = why;
        }
        reply.estimate = keel_scheduling::perf::estimate(&applied.state, job)
            .as_ref()
            .map(crate::convert::estimate_to_proto);
        Ok(Response::new(reply))
    }

    async fn list_jobs(
        &self,
        request: Request<api::ListJobsRequest>,
    ) -> Result<Response<api::ListJobsResponse>, Status> {
        let stale = is_stale(&request);
        route!(self, request, list_jobs, false);
        let granted = self.authorize(&request, Right::ReadJobs)?;
        let req = request.into_inner();
        let state = if req.state.is_empty() {
            None
        } else {
            Some(
                JobState::parse(&req.state).ok_or_else(|| ApiError::InvalidArgument {
                    field: "state",
                    message: format!(
                    "{:?} is not one of pending, running, preempted, succeeded, failed, cancelled",
                    req.state
                ),
                })?,
            )
        };
        if req.user.len() > USER_FILTER_MAX_LEN {
            return Err(ApiError::InvalidArgument {
                field: "user",
                message: format!(
                    "is {} bytes long; the limit is {USER_FILTER_MAX_LEN}",
                    req.user.len()
                ),
            }
            .into());
        }
        let page_size = match req.page_size as usize {
            0 => LIST_JOBS_PAGE_DEFAULT,
            n if n > LIST_JOBS_PAGE_MAX => {
                return Err(ApiError::InvalidArgument {
                    field: "page_size",
                    message: format!("{n} is more than the limit of {LIST_JOBS_PAGE_MAX}"),
                }
                .into())
            }
            n => n,
        };
        // The token is the last job id of the page before.
        let after: u64 = if req.page_token.is_empty() {
            0
        } else {
            req.page_token
                .parse()
                .map_err(|_| ApiError::InvalidArgument {
                    field: "page_token",
                    message: format!(
                        "{:?} is not a token this server gave (next_page_token)",
                        req.page_token
                    ),
                })?
        };
        if !stale {
            self.linearizable().await?;
        }
        let shared = self.node.state_machine.shared();
        let applied = shared.read();
        let mut why_by_shape: std::collections::BTreeMap<(u32, u32, &Vec<String>), Option<String>> =
            std::collections::BTreeMap::new();
        let mut owned = std::collections::BTreeMap::new();
        let admission = AdmissionView::of(&applied.state, self.default_policy);
        let mut jobs: Vec<api::Job> = applied
            .state
            .jobs()
            .range(after.saturating_add(1)..)
            .map(|(_, j)| j)
            .filter(|j| state.is_none_or(|s| j.state == s))
            .filter(|j| req.user.is_empty() || j.spec.user == req.user)
            .filter(|j| {
                req.queue.is_empty()
                    || j.spec.queue == req.queue
                    || (j.spec.queue.is_empty() && req.queue == keel_state::queue::DEFAULT_QUEUE)
            })
            // A user lists its own jobs only.
            .filter(|j| granted.reaches(j.submitted_by.as_deref()))
            .map(|j| {
                let mut reply = crate::convert::job_to_proto(j);
                // One answer per job shape: thousands of waiting jobs cost
                // one look at the nodes each shape.
                let shape = (j.spec.gpus, j.spec.workers.min, &j.spec.gpu_types.allowed);
                let why = waiting(j).then(|| {
                    why_by_shape
                        .entry(shape)
                        .or_insert_with(|| never_fits(&applied.state, &j.spec))
                        .clone()
                });
                if let Some(why) = why.flatten().or_else(|| self.not_launched(j, &mut owned)) {
                    reply.message = why;
                } else if let Some(why) = admission.why_waiting(j) {
                    reply.message = with_reason(&reply.message, &why);
                }
                reply
            })
            .take(page_size + 1)
            .collect();
        let next_page_token = if jobs.len() > page_size {
            jobs.truncate(page_size);
            jobs.last().map(|j| j.id.to_string()).unwrap_or_default()
        } else {
            String::new()
        };
        Ok(Response::new(api::ListJobsResponse {
            jobs,
            next_page_token,
        }))
    }

    async fn list_nodes(
        &self,
        request: Request<api::ListNodesRequest>,
    ) -> Result<Response<api::ListNodesResponse>, Status> {
        let stale = is_stale(&request);
        route!(self, request, list_nodes, false);
        self.authorize(&request, Right::ReadCluster)?;
        if !stale {
            self.linearizable().await?;
        }
        let shared = self.node.state_machine.shared();
        let applied = shared.read();
        let holders = applied.state.gpu_holders();
        let nodes = applied
            .state
            .nodes()
            .values()
            .map(|n| crate::convert::node_to_proto(n, holders.iter(), self.executor.owns(&n.name)))
            .collect();
        Ok(Response::new(api::ListNodesResponse { nodes }))
    }

    type WatchEventsStream = WatchStream;

    async fn watch_events(
        &self,
        request: Request<api::WatchEventsRequest>,
    ) -> Result<Response<WatchStream>, Status> {
        let granted = self.authorize(&request, Right::ReadCluster)?;
        let caller = granted.actor().unwrap_or_else(|| {
            request
                .extensions()
                .get::<crate::transport::PeerInfo>()
                .and_then(|p| p.remote)
                .map_or_else(|| "in-process".to_string(), |a| a.ip().to_string())
        });
        let req = request.into_inner();
        let permit = self
            .event_streams
            .clone()
            .try_acquire_owned()
            .map_err(|_| ApiError::TooManyStreams {
                limit: self.max_event_streams,
            })?;
        let place = self
            .streams_by_caller
            .open(caller.clone(), MAX_EVENT_STREAMS_PER_CALLER)
            .ok_or(ApiError::TooManyStreamsForCaller {
                caller,
                limit: MAX_EVENT_STREAMS_PER_CALLER,
            })?;
        let store = self.node.state_machine.clone();
        let (tx, rx) = tokio::sync::mpsc::channel(WATCH_BATCH);
        tokio::spawn(async move {
            // Held until the stream ends: by its end, an error, or its client
            // going away.
            let _permit = permit;
            let _place = place;
            follow_journal(
                store,
                keel_storage::JournalCursor::at_index(req.from_index),
                req.follow,
                tx,
            )
            .await;
        });
        use tokio_stream::StreamExt;
        Ok(Response::new(Box::pin(
            tokio_stream::wrappers::ReceiverStream::new(rx)
                .map(|r| r.map_err(|e| Status::from(ApiError::from(e)))),
        )))
    }

    async fn cluster_status(
        &self,
        request: Request<api::ClusterStatusRequest>,
    ) -> Result<Response<api::ClusterStatusResponse>, Status> {
        self.authorize(&request, Right::ReadStatus)?;
        let metrics = self.node.raft.metrics().borrow().clone();
        let role = match metrics.state {
            ServerState::Leader => "leader",
            ServerState::Follower => "follower",
            ServerState::Candidate => "candidate",
            ServerState::Learner => "learner",
            ServerState::Shutdown => "shutdown",
        };
        let shared = self.node.state_machine.shared();
        let (last_applied_index, state_hash, policy, removed_members, jobs, finished) = {
            let applied = shared.read();
            (
                applied.last_applied.map_or(0, |l| l.index),
                applied.state.state_hash().to_string(),
                applied
                    .state
                    .policy()
                    .unwrap_or(self.default_policy)
                    .to_string(),
                applied.removed_members.clone(),
                applied.state.jobs().len(),
                applied.state.ended_job_count(),
            )
        };
        let snapshot_bytes = self
            .node
            .state_machine
            .snapshot_bytes()
            .map_err(ApiError::from)?;
        let scheduling = match self.scheduling.read() {
            Ok(r) => r.clone(),
            Err(poisoned) => poisoned.into_inner().clone(),
        };
        use crate::membership::{incarnation_of, member_of};
        let leading = metrics.state == ServerState::Leader;
        let clock = self.node.clock.status(leading);
        let peer_offsets = if leading {
            self.node.clock.peer_offsets()
        } else {
            Default::default()
        };
        Ok(Response::new(api::ClusterStatusResponse {
            wall_clock_ms: clock.wall_ms,
            log_time_ms: clock.log_time_ms,
            clock_offset_ms: clock.offset_ms,
            max_clock_offset_ms: self.node.clock.max_offset_ms(),
            clock_refusal: clock.refused.map(|r| r.to_string()).unwrap_or_default(),
            member_id: member_of(metrics.id),
            incarnation: incarnation_of(metrics.id),
            role: role.to_string(),
            term: metrics.current_term,
            last_log_index: metrics.last_log_index.unwrap_or(0),
            last_applied_index,
            state_hash,
            leader_id: metrics.current_leader.map(member_of),
            cluster_id: self.node.identity.get().unwrap_or_default(),
            policy,
            policy_counters: scheduling.policy_counters,
            last_planned_index: scheduling.last_planned_index,
            voters: crate::membership::member_ids(
                metrics.membership_config.membership().voter_ids(),
            ),
            members: {
                let membership = metrics.membership_config.membership();
                let voters: std::collections::BTreeSet<u64> = membership.voter_ids().collect();
                membership
                    .nodes()
                    .map(|(id, node)| api::Member {
                        id: member_of(*id),
                        incarnation: incarnation_of(*id),
                        address: node.addr.clone(),
                        voter: voters.contains(id),
                        clock_offset_ms: if *id == metrics.id {
                            clock.offset_ms.filter(|_| leading)
                        } else {
                            peer_offsets.get(id).copied()
                        },
                        matched_index: metrics.replication.as_ref().and_then(|r| {
                            if *id == metrics.id {
                                metrics.last_log_index
                            } else {
                                r.get(id).and_then(|m| m.map(|l| l.index))
                            }
                        }),
                    })
                    .collect()
            },
            jobs_in_state: jobs as u64,
            finished_jobs_in_state: finished as u64,
            snapshot_bytes,
            removed: self
                .node
                .removal
                .get()
                .map(|r| r.to_string())
                .unwrap_or_default(),
            removed_members: {
                // A member replaced by a new incarnation is not removed.
                let members: std::collections::BTreeSet<u64> = metrics
                    .membership_config
                    .membership()
                    .nodes()
                    .map(|(id, _)| member_of(*id))
                    .collect();
                removed_members
                    .0
                    .iter()
                    .filter(|(id, _)| !members.contains(&member_of(**id)))
                    .map(|(id, (address, index))| api::RemovedMember {
                        id: member_of(*id),
                        incarnation: incarnation_of(*id),
                        address: address.clone(),
                        removed_at_index: *index,
                    })
                    .collect()
            },
        }))
    }

    async fn job_history(
        &self,
        request: Request<api::JobHistoryRequest>,
    ) -> Result<Response<api::JobHistoryResponse>, Status> {
        let stale = is_stale(&request);
        route!(self, request, job_history, false);
        let granted = self.authorize(&request, Right::ReadJobs)?;
        let req = request.into_inner();
        let limit = match req.limit as usize {
            0 => HISTORY_MAX_ENTRIES,
            n if n > HISTORY_MAX_ENTRIES => {
                return Err(ApiError::InvalidArgument {
                    field: "limit",
                    message: format!("{n} is more than the limit of {HISTORY_MAX_ENTRIES}"),
                }
                .into())
            }
            n => n,
        };
        if !stale {
            self.linearizable().await?;
        }
        // The history is journaled when the state's applied index moves past
        // it; wait for the journal to catch up with what we just read.
        // A job retention removed still has its history in the journal;
        // who submitted it is the actor of its first entry.
        let (target, removed) = {
            let shared = self.node.state_machine.shared();
            let applied = shared.read();
            let removed = match applied.state.job(req.job_id) {
                Some(job) => {
                    granted.check_job(req.job_id, job.submitted_by.as_deref())?;
                    false
                }
                None if applied.state.was_removed(req.job_id) => true,
                None => return Err(ApiError::JobNotFound(req.job_id).into()),
            };
            (applied.last_applied.map_or(0, |l| l.index), removed)
        };
        let mut journaled = self.node.state_machine.shared().subscribe_journal();
        while *journaled.borrow_and_update() < target {
            if journaled.changed().await.is_err() {
                break;
            }
        }
        let (entries, truncated) = self
            .node
            .state_machine
            .job_history(req.job_id, limit)
            .map_err(ApiError::from)?;
        if removed {
            let submitter = entries
                .first()
                .map(|e| e.actor.as_str())
                .filter(|a| !a.is_empty());
            granted.check_job(req.job_id, submitter)?;
        }
        Ok(Response::new(api::JobHistoryResponse {
            entries,
            truncated,
        }))
    }

    async fn get_logs(
        &self,
        request: Request<api::GetLogsRequest>,
    ) -> Result<Response<api::GetLogsResponse>, Status> {
        // Workers run under the leader's executor, so their logs are there.
        route!(self, request, get_logs, true);
        let granted = self.authorize(&request, Right::ReadJobs)?;
        let req = request.into_inner();
        let tail = match req.tail_bytes {
            0 => LOG_TAIL_DEFAULT_BYTES,
            n if n > LOG_TAIL_MAX_BYTES => {
                return Err(ApiError::InvalidArgument {
                    field: "tail_bytes",
                    message: format!("{n} is more than the limit of {LOG_TAIL_MAX_BYTES}"),
                }
                .into())
            }
            n => n,
        };
        self.check_job(&granted, req.job_id)?;
        {
            let shared = self.node.state_machine.shared();
            let applied = shared.read();
            if applied.state.job(req.job_id).is_none() {
                return Err(Self::job_missing(&applied.state, req.job_id).into());
            }
        }
        let logs = self
            .executor
            .logs(req.job_id, tail)
            .await
            .map_err(|e| ApiError::Storage(e.to_string()))?;
        Ok(Response::new(api::GetLogsResponse {
            logs: logs
                .into_iter()
                .map(|l| api::WorkerLog {
                    epoch: l.id.epoch,
                    rank: l.id.rank,
                    content: l.content,
                    total_bytes: l.total_bytes,
                    paused: l.paused.unwrap_or_default(),
                })
                .collect(),
        }))
    }

    async fn set_node_state(
        &self,
        request: Request<api::SetNodeStateRequest>,
    ) -> Result<Response<api::SetNodeStateResponse>, Status> {
        route!(self, request, set_node_state, true);
        let actor = self.authorize(&request, Right::ManageNodes)?.actor();
        let req = request.into_inner();
        let command = match req.state.as_str() {
            "lost" => Command::mark_node_lost(
                req.name,
                if req.reason.is_empty() {
                    "marked lost by an operator".into()
                } else {
                    req.reason
                },
            ),
            "alive" => Command::mark_node_recovered(req.name),
            other => {
                return Err(ApiError::InvalidArgument {
                    field: "state",
                    message: format!("{other:?} is not \"lost\" or \"alive\""),
                }
                .into())
            }
        };
        let (index, _) = self.propose_request(command, req.request_id, actor).await?;
        Ok(Response::new(api::SetNodeStateResponse { index }))
    }

    async fn remove_node(
        &self,
        request: Request<api::RemoveNodeRequest>,
    ) -> Result<Response<api::RemoveNodeResponse>, Status> {
        route!(self, request, remove_node, true);
        let actor = self.authorize(&request, Right::ManageNodes)?.actor();
        let req = request.into_inner();
        let name = req.name.clone();
        let (index, events) = self
            .propose_request(
                Command::remove_node(req.name, req.force),
                req.request_id,
                actor,
            )
            .await?;
        let requeued = events
            .iter()
            .filter_map(|e| match e {
                keel_state::Event::JobPreempted { job_id, .. } => Some(*job_id),
                _ => None,
            })
            .collect::<Vec<_>>();
        tracing::info!(node = %name, index, ?requeued, "node removed");
        Ok(Response::new(api::RemoveNodeResponse { index, requeued }))
    }

    async fn set_policy(
        &self,
        request: Request<api::SetPolicyRequest>,
    ) -> Result<Response<api::SetPolicyResponse>, Status> {
        route!(self, request, set_policy, true);
        let actor = self.authorize(&request, Right::SetPolicy)?.actor();
        let api::SetPolicyRequest { name, request_id } = request.into_inner();
        // Which policies exist is checked here, before anything is logged;
        // `apply` checks only the name's form, so no version's policy list
        // changes how a log replays.
        keel_scheduling::policy::by_name(&name, Default::default()).map_err(|e| {
            ApiError::InvalidArgument {
                field: "name",
                message: e.to_string(),
            }
        })?;
        if let Some(why) = self
            .executor
            .cannot_share_gpus()
            .filter(|_| keel_scheduling::gavel::shares_gpus(&name))
        {
            return Err(ApiError::Unsupported(format!("policy {name:?}: {why}")).into());
        }
        let (index, _) = self
            .propose_request(Command::set_policy(name), request_id, actor)
            .await?;
        Ok(Response::new(api::SetPolicyResponse { index }))
    }

    async fn node_heartbeat(
        &self,
        request: Request<api::NodeHeartbeatRequest>,
    ) -> Result<Response<api::NodeHeartbeatResponse>, Status> {
        route!(self, request, node_heartbeat, true);
        let caller = self.caller(&request)?;
        caller.authorize(Right::SendHeartbeats)?;
        let req = request.into_inner();
        for (field, len) in [("nodes", req.nodes.len()), ("reports", req.reports.len())] {
            if len > HEARTBEAT_NODES_MAX {
                return Err(ApiError::InvalidArgument {
                    field,
                    message: format!(
                        "{len} nodes in one heartbeat; the limit is {HEARTBEAT_NODES_MAX}"
                    ),
                }
                .into());
            }
        }
        let reports = reports_from_proto(req).map_err(|e| ApiError::InvalidArgument {
            field: "reports",
            message: e.to_string(),
        })?;
        for r in &reports {
            r.validate().map_err(ApiError::from)?;
            crate::authz::may_report_node(&caller, &r.name)?;
        }
        self.heartbeats.record(reports);
        Ok(Response::new(api::NodeHeartbeatResponse {}))
    }

    async fn add_member(
        &self,
        request: Request<api::AddMemberRequest>,
    ) -> Result<Response<api::MembershipResponse>, Status> {
        route!(self, request, add_member, true);
        let actor = self.authorize(&request, Right::ManageMembers)?.actor();
        let req = request.into_inner();
        if req.id == 0 {
            return Err(ApiError::InvalidArgument {
                field: "id",
                message: "member ids start at 1".into(),
            }
            .into());
        }
        if req.address.is_empty() || req.address.len() > 512 || !req.address.contains(':') {
            return Err(ApiError::InvalidArgument {
                field: "address",
                message: format!("{:?} is not HOST:PORT (at most 512 bytes)", req.address),
            }
            .into());
        }
        if req.catch_up_timeout_s > 3600 {
            return Err(ApiError::InvalidArgument {
                field: "catch_up_timeout_s",
                message: format!("{} s; the limit is 3600 s", req.catch_up_timeout_s),
            }
            .into());
        }
        if req.id > crate::membership::MEMBER_ID_MAX {
            return Err(ApiError::InvalidArgument {
                field: "id",
                message: format!(
                    "{} is more than the largest member id, {}",
                    req.id,
                    crate::membership::MEMBER_ID_MAX
                ),
            }
            .into());
        }
        // The new member's Raft id: its member id and the incarnation of its
        // data directory, as it says itself.
        // Asked for up to NEW_MEMBER_ANSWER_WAIT: a replica started just
        // before the call may not listen yet.
        let deadline = tokio::time::Instant::now() + NEW_MEMBER_ANSWER_WAIT;
        let status = loop {
            match crate::raft_node::status_of(&self.node.transport, req.id, &req.address).await {
                Ok(status) => break status,
                Err(reason) if tokio::time::Instant::now() >= deadline => {
                    return Err(ApiError::NewMemberUnreachable {
                        id: req.id,
                        address: req.address.clone(),
                        reason,
                    }
                    .into())
                }
                Err(_) => tokio::time::sleep(std::time::Duration::from_millis(200)).await,
            }
        };
        if status.member_id != req.id {
            return Err(ApiError::InvalidArgument {
                field: "id",
                message: format!(
                    "the replica at {} is member {}, not {}",
                    req.address, status.member_id, req.id
                ),
            }
            .into());
        }
        let raft_id = crate::membership::raft_id(req.id, status.incarnation);
        let other = self
            .node
            .raft
            .metrics()
            .borrow()
            .membership_config
            .membership()
            .nodes()
            .map(|(id, _)| *id)
            .find(|id| crate::membership::member_of(*id) == req.id && *id != raft_id);
        if let Some(other) = other {
            return Err(ApiError::InvalidArgument {
                field: "id",
                message: format!(
                    "member {} is in the cluster already as {} (the replica at {} is {}); \
                     remove it first, or let the leader re-admit it",
                    req.id,
                    crate::membership::show(other),
                    req.address,
                    crate::membership::show(raft_id)
                ),
            }
            .into());
        }
        let node = openraft::BasicNode {
            addr: req.address.clone(),
        };
        // Blocks until the learner has caught up with the leader's log. One
        // that does not within the deadline is removed again: the call
        // fails with the membership as it was (issue 19, item 1).
        let catch_up = std::time::Duration::from_secs(match req.catch_up_timeout_s {
            0 => 60,
            s => u64::from(s),
        });
        // (openraft's own blocking add_learner gives up waiting after half
        // a second and answers Ok all the same: the wait is ours.)
        let membership_index = membership_committed(
            self.node.raft.add_learner(raft_id, node, false),
            format!("adding learner {}", req.id),
        )
        .await?;
        let caught_up = self
            .node
            .raft
            .wait(Some(catch_up))
            .metrics(
                |m| {
                    m.replication
                        .as_ref()
                        .and_then(|r| r.get(&raft_id))
                        .and_then(|matched| matched.as_ref())
                        .is_some_and(|matched| matched.index >= membership_index)
                },
                "the new member to catch up",
            )
            .await;
        match caught_up {
            Ok(_) => {}
            Err(_) => {
                let removed = change_membership(
                    &self.node,
                    openraft::ChangeMembers::RemoveNodes(std::collections::BTreeSet::from([
                        raft_id,
                    ])),
                    format!("removing learner {}", req.id),
                )
                .await;
                let outcome = match removed {
                    Ok(_) => "it was removed again; the membership is as it was".to_string(),
                    Err(e) => format!("removing it again failed ({e}); remove it with keel cluster remove --id {}", req.id),
                };
                tracing::warn!(member = req.id, address = %req.address, %outcome, "a new member did not catch up");
                return Err(ApiError::LearnerDidNotCatchUp {
                    id: req.id,
                    address: req.address,
                    timeout_s: catch_up.as_secs(),
                    outcome,
                }
                .into());
            }
        }
        // The learner's membership entry (issue 19, item 13: a learner-only
        // call answered no index).
        let mut index = membership_index;
        if !req.learner_only {
            let mut voters: std::collections::BTreeSet<u64> = self
                .node
                .raft
                .metrics()
                .borrow()
                .membership_config
                .membership()
                .voter_ids()
                .collect();
            if voters.insert(raft_id) {
                index =
                    change_membership(&self.node, voters, format!("promoting {}", req.id)).await?;
            }
        }
        let change = if req.learner_only {
            "added as a learner"
        } else {
            "added as a voter"
        };
        self.record_membership_change(req.id, change, index, actor)
            .await;
        Ok(Response::new(self.membership(index)))
    }

    async fn bootstrap_acl(
        &self,
        request: Request<api::BootstrapAclRequest>,
    ) -> Result<Response<api::TokenSecret>, Status> {
        route!(self, request, bootstrap_acl, true);
        self.bootstrap_acl_call(request).await
    }

    async fn create_token(
        &self,
        request: Request<api::CreateTokenRequest>,
    ) -> Result<Response<api::TokenSecret>, Status> {
        route!(self, request, create_token, true);
        self.create_token_call(request).await
    }

    async fn list_tokens(
        &self,
        request: Request<api::ListTokensRequest>,
    ) -> Result<Response<api::ListTokensResponse>, Status> {
        let stale = is_stale(&request);
        route!(self, request, list_tokens, false);
        self.list_tokens_call(request, stale).await
    }

    async fn revoke_token(
        &self,
        request: Request<api::RevokeTokenRequest>,
    ) -> Result<Response<api::RevokeTokenResponse>, Status> {
        route!(self, request, revoke_token, true);
        self.revoke_token_call(request).await
    }

    async fn create_queue(
        &self,
        request: Request<api::CreateQueueRequest>,
    ) -> Result<Response<api::QueueChangeResponse>, Status> {
        route!(self, request, create_queue, true);
        self.create_queue_call(request).await
    }

    async fn update_queue(
        &self,
        request: Request<api::UpdateQueueRequest>,
    ) -> Result<Response<api::QueueChangeResponse>, Status> {
        route!(self, request, update_queue, true);
        self.update_queue_call(request).await
    }

    async fn delete_queue(
        &self,
        request: Request<api::DeleteQueueRequest>,
    ) -> Result<Response<api::QueueChangeResponse>, Status> {
        route!(self, request, delete_queue, true);
        self.delete_queue_call(request).await
    }

    async fn list_queues(
        &self,
        request: Request<api::ListQueuesRequest>,
    ) -> Result<Response<api::ListQueuesResponse>, Status> {
        let stale = is_stale(&request);
        route!(self, request, list_queues, false);
        self.list_queues_call(request, stale).await
    }

    async fn put_secret(
        &self,
        request: Request<api::PutSecretRequest>,
    ) -> Result<Response<api::SecretChangeResponse>, Status> {
        route!(self, request, put_secret, true);
        self.put_secret_call(request).await
    }

    async fn delete_secret(
        &self,
        request: Request<api::DeleteSecretRequest>,
    ) -> Result<Response<api::SecretChangeResponse>, Status> {
        route!(self, request, delete_secret, true);
        self.delete_secret_call(request).await
    }

    async fn list_secrets(
        &self,
        request: Request<api::ListSecretsRequest>,
    ) -> Result<Response<api::ListSecretsResponse>, Status> {
        let stale = is_stale(&request);
        route!(self, request, list_secrets, false);
        self.list_secrets_call(request, stale).await
    }

    async fn rotate_secret_key(
        &self,
        request: Request<api::RotateSecretKeyRequest>,
    ) -> Result<Response<api::RotateSecretKeyResponse>, Status> {
        route!(self, request, rotate_secret_key, true);
        self.rotate_secret_key_call(request).await
    }

    type SaveSnapshotStream = snapshots::SnapshotStream;

    async fn save_snapshot(
        &self,
        request: Request<api::SaveSnapshotRequest>,
    ) -> Result<Response<snapshots::SnapshotStream>, Status> {
        route!(self, request, save_snapshot, false, |answer: Response<
            tonic::Streaming<api::SnapshotChunk>,
        >| answer
            .map(|chunks| Box::pin(chunks) as snapshots::SnapshotStream));
        self.save_snapshot_call(request).await
    }

    async fn who_am_i(
        &self,
        request: Request<api::WhoAmIRequest>,
    ) -> Result<Response<api::WhoAmIResponse>, Status> {
        route!(self, request, who_am_i, false);
        self.who_am_i_call(request).await
    }

    async fn remove_member(
        &self,
        request: Request<api::RemoveMemberRequest>,
    ) -> Result<Response<api::MembershipResponse>, Status> {
        route!(self, request, remove_member, true);
        let actor = self.authorize(&request, Right::ManageMembers)?.actor();
        let member = request.into_inner().id;
        let (voters, learners) = {
            let m = self.node.raft.metrics();
            let m = m.borrow();
            let membership = m.membership_config.membership();
            let voters: std::collections::BTreeSet<u64> = membership.voter_ids().collect();
            let learners: std::collections::BTreeSet<u64> = membership.learner_ids().collect();
            (voters, learners)
        };
        // Every incarnation of the member (two while one is re-admitted).
        let of_member = |ids: &std::collections::BTreeSet<u64>| -> std::collections::BTreeSet<u64> {
            ids.iter()
                .copied()
                .filter(|id| crate::membership::member_of(*id) == member)
                .collect()
        };
        let (gone_voters, gone_learners) = (of_member(&voters), of_member(&learners));
        if gone_voters.is_empty() && gone_learners.is_empty() {
            return Err(ApiError::InvalidArgument {
                field: "id",
                message: format!("{member} is not a member"),
            }
            .into());
        }
        let mut index = 0;
        if !gone_voters.is_empty() {
            let remaining: std::collections::BTreeSet<u64> =
                voters.difference(&gone_voters).copied().collect();
            if remaining.is_empty() {
                return Err(ApiError::InvalidArgument {
                    field: "id",
                    message: format!("{member} is the last voter; a cluster cannot remove it"),
                }
                .into());
            }
            // Not retained as a learner: it leaves the membership.
            index = change_membership(&self.node, remaining, format!("removing {member}")).await?;
        }
        if !gone_learners.is_empty() {
            index = change_membership(
                &self.node,
                openraft::ChangeMembers::RemoveNodes(gone_learners),
                format!("removing {member}"),
            )
            .await?;
        }
        self.record_membership_change(member, "removed", index, actor)
            .await;
        Ok(Response::new(self.membership(index)))
    }
}

/// Why no node of the cluster as it is can run `spec` (issue 19, item 8),
/// as `keel job` and `keel jobs` show it for a [`waiting`] job; `None` when
/// some node could.
fn never_fits(state: &keel_state::ClusterState, spec: &keel_state::JobSpec) -> Option<String> {
    keel_scheduling::placement::never_fits(state, spec)
        .map(|why| format!("waiting: {why} (nodes may still join)"))
}

/// The leader's admission as the state stands (issue 23, item 6): why a
/// waiting job is not admitted (over quota, its quota held by borrowers,
/// no fitting GPU free, retry backoff, behind its queue). Worked out once
/// per request, and only when queues are defined; each queue's jobs in
/// the running policy's order, as the scheduling loop takes them.
pub(crate) struct AdmissionView(Option<keel_scheduling::admission::Admission>);

impl AdmissionView {
    pub(crate) fn of(state: &keel_state::ClusterState, default_policy: &str) -> AdmissionView {
        if state.queues().is_unset() {
            return AdmissionView(None);
        }
        let now_ms = state.last_entry_at_ms();
        let policy = state.policy().unwrap_or(default_policy);
        let order = keel_scheduling::policy::by_name(policy, Default::default())
            .ok()
            .and_then(|p| {
                p.admission_order(&keel_scheduling::policy::SchedulingInput::everyone(
                    state, now_ms,
                ))
            });
        AdmissionView(Some(keel_scheduling::admission::Admission::in_order(
            state,
            now_ms,
            order.as_deref(),
        )))
    }

    fn why_waiting(&self, job: &keel_state::Job) -> Option<String> {
        if !matches!(job.state, JobState::Pending | JobState::Preempted) {
            return None;
        }
        let reason = self.0.as_ref()?.wait_reason(job)?;
        Some(format!("waiting: {reason}"))
    }
}

/// `why` after a job's own message (a preemption's, say), or alone.
/// Why waiting job `job` waits, as `keel job` says it: no node could hold
/// it, else what admission says (with queues), after its own message;
/// `None` for a job that does not wait or has no reason to give.
pub(crate) fn wait_message(
    state: &keel_state::ClusterState,
    job: &keel_state::Job,
    admission: &AdmissionView,
) -> Option<String> {
    if let Some(why) = waiting(job).then(|| never_fits(state, &job.spec)).flatten() {
        return Some(why);
    }
    admission
        .why_waiting(job)
        .map(|why| with_reason(&job.message, &why))
}

fn with_reason(message: &str, why: &str) -> String {
    if message.is_empty() {
        why.to_string()
    } else {
        format!("{message}; {why}")
    }
}

/// A job waiting for GPUs with no message of its own.
fn waiting(job: &keel_state::Job) -> bool {
    matches!(job.state, JobState::Pending | JobState::Preempted) && job.message.is_empty()
}

/// How long `AddMember` keeps asking a new member who it is before it
/// gives up (the replica may have been started just before the call).
/// How long a membership change may take to commit before the call
/// answers (it stays in the log and completes if its voters answer later).
const MEMBERSHIP_COMMIT_WAIT: std::time::Duration = std::time::Duration::from_secs(10);

/// Changes the membership through Raft and waits for it to commit, at most
/// [`MEMBERSHIP_COMMIT_WAIT`]. `what` names the change for the error.
async fn change_membership(
    node: &RaftNode,
    change: impl Into<openraft::ChangeMembers<u64, openraft::BasicNode>>,
    what: String,
) -> Result<u64, ApiError> {
    membership_committed(node.raft.change_membership(change, false), what).await
}

/// Waits for a membership change (`change`, openraft's call) to commit, at
/// most [`MEMBERSHIP_COMMIT_WAIT`]; returns its index.
async fn membership_committed(
    change: impl std::future::Future<
        Output = Result<
            openraft::raft::ClientWriteResponse<keel_storage::TypeConfig>,
            openraft::error::RaftError<
                u64,
                openraft::error::ClientWriteError<u64, openraft::BasicNode>,
            >,
        >,
    >,
    what: String,
) -> Result<u64, ApiError> {
    use openraft::error::{ChangeMembershipError, ClientWriteError, RaftError};
    match tokio::time::timeout(MEMBERSHIP_COMMIT_WAIT, change).await {
        Ok(Ok(resp)) => Ok(resp.log_id.index),
        Ok(Err(RaftError::APIError(ClientWriteError::ChangeMembershipError(
            ChangeMembershipError::InProgress(p),
        )))) => Err(ApiError::MembershipChangeInProgress {
            what,
            pending_index: p.membership_log_id.map_or(0, |l| l.index),
        }),
        Ok(Err(e @ RaftError::APIError(ClientWriteError::ForwardToLeader(_)))) => Err(e.into()),
        Ok(Err(e)) => Err(ApiError::Unavailable(format!("{what}: {e}"))),
        Err(_) => Err(ApiError::MembershipChangeNotCommitted {
            what,
            timeout_s: MEMBERSHIP_COMMIT_WAIT.as_secs(),
        }),
    }
}

const NEW_MEMBER_ANSWER_WAIT: std::time::Duration = std::time::Duration::from_secs(10);

#[cfg(test)]
mod tests {
    use super::*;

    /// Only a connection never made says a forwarded request was not sent;
    /// one lost midway stays in doubt, and the leader's own answer is kept.
    #[test]
    fn a_forward_that_never_connected_is_no_leader_and_one_lost_midway_is_in_doubt() {
        use crate::grpc_status::{reason, reason_of};
        let never = forward_error(Status::unavailable(
            "error trying to connect: tcp connect error: Connection refused",
        ));
        assert_eq!(reason_of(&never).as_deref(), Some(reason::NO_LEADER));
        let midway = forward_error(Status::unavailable("transport error: connection reset"));
        assert_eq!(midway.code(), tonic::Code::Unavailable);
        assert_eq!(reason_of(&midway), None);
        let answered = forward_error(Status::from(ApiError::NotLeader { leader: None }));
        assert_eq!(reason_of(&answered).as_deref(), Some(reason::NOT_LEADER));
    }
}
