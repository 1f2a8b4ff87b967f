//! The replica's HTTP endpoint (issue 24), on `--http-listen`:
//! - `/metrics`: the figures of [`crate::metrics`], in OpenMetrics 1.0 to
//!   a scraper that asks for it, else in Prometheus's classic text format;
//! - `/`: the web console ([`crate::console`]), drawn from
//!   `/api/v1/cluster`; `?at=INDEX` or `?at_time=RFC3339` gives the
//!   cluster as it was then (time travel: rebuilt from this replica's
//!   journal, one request at a time, at most
//!   [`TIME_TRAVEL_MAX_ENTRIES`] entries replayed for one);
//! - `/api/v1/whatif?policy=fifo,srjf`: this replica's own history run
//!   through the simulator under the policies that decided (validated
//!   against what happened) and the ones asked for, on the recorded nodes
//!   or with more (`&add_nodes=2x8xa100`) ([`crate::whatif`],
//!   what `keel whatif` reports), with its figures; one at a time, at most
//!   [`WHATIF_MAX_ENTRIES`] journal indexes read;
//! - `/api/v1/jobs/ID`: a job's page ([`crate::console::job_page`]): its
//!   history in `keel why`'s words and its allocations over log time;
//! - `/api/v1/events`: the applied entries as they come, server-sent
//!   events (what the console's live feed and refreshes follow), from
//!   `?from=INDEX`, or after the `Last-Event-ID` a reconnecting browser
//!   sends, or from now; at most [`EVENT_STREAMS_MAX`] at once;
//! - `/healthz`: 200 while the process serves;
//! - `/readyz`: 200 once this replica knows a leader and has applied every
//!   entry it knows committed, else 503 and why (what a load balancer or a
//!   Kubernetes readiness probe reads).
//!
//! - `/login`, `/logout`: a browser's token kept in a cookie, or
//!   forgotten ([`crate::http_access`]).
//!
//! Read-only: nothing here proposes, and no request reaches the state's
//! write path. With `--acl`, all but `/healthz`, `/readyz` and the login
//! need a token that may read the cluster ([`crate::http_access`]). With
//! the server's TLS it is HTTPS (the member's certificate, no client
//! certificate asked: [`serve`]); beyond loopback only with TLS and ACLs,
//! or `--insecure` ([`check_listen`]).

use std::net::SocketAddr;
use std::sync::Arc;

use axum::extract::{Path, Query, State};
use axum::http::{header, StatusCode};
use axum::response::IntoResponse;
use axum::routing::{get, post};
use axum::Router;

use crate::raft_node::RaftNode;

/// Where the HTTP endpoint listens unless `--http-listen` says otherwise:
/// beside the API's default port (7070).
pub const DEFAULT_HTTP_LISTEN: &str = "127.0.0.1:7080";

/// Where a server's HTTP endpoint listens.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum HttpListen {
    /// Not served (`--http-listen off`).
    Off,
    /// At this address, or the server does not start (`--http-listen`
    /// given).
    At(SocketAddr),
    /// At this address if it is free, else at a port the system picks on
    /// the same address (the default: a second replica on one machine
    /// still starts; `DATA/http.addr` says where it went).
    Preferably(SocketAddr),
}

impl HttpListen {
    /// From `--http-listen`: `None` (not given) is the default address,
    /// preferably; `off` turns the endpoint off.
    pub fn from_flag(flag: Option<&str>) -> Result<HttpListen, String> {
        match flag {
            None => DEFAULT_HTTP_LISTEN
                .parse()
                .map(HttpListen::Preferably)
                .map_err(|e| format!("{DEFAULT_HTTP_LISTEN}: {e}")),
            Some("off") => Ok(HttpListen::Off),
            Some(addr) => addr.parse().map(HttpListen::At).map_err(|e| {
                format!("--http-listen {addr:?}: {e} (an address such as 127.0.0.1:7080, or off)")
            }),
        }
    }

    /// The address to try first.
    pub fn addr(&self) -> Option<SocketAddr> {
        match self {
            HttpListen::Off => None,
            HttpListen::At(a) | HttpListen::Preferably(a) => Some(*a),
        }
    }
}

/// An HTTP address beyond this machine without TLS and ACLs, refused
/// without `--insecure`.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error(
    "refusing to serve HTTP (the console, /metrics) on {} without {}: it would \
     show the cluster's jobs, queues and nodes to anyone who reaches it. Serve it on a loopback \
     address (the default, {DEFAULT_HTTP_LISTEN}); or give the server TLS (--tls-cert, \
     --tls-key, --tls-ca) and --acl, so that it is HTTPS and asks for a viewer's token; or, on \
     a network you trust, add --insecure",
    .0.listen,
    .0.missing
)]
pub struct HttpExposed(pub crate::exposure::Exposed);

/// Whether the HTTP endpoint may listen on `listen`: the API's rule
/// ([`crate::exposure::check_listen`]): loopback always, any other address
/// with TLS (the endpoint is then HTTPS) and ACLs (it then asks for a
/// token), or when `insecure` (`Ok(true)`: allowed but exposed).
pub fn check_listen(
    listen: SocketAddr,
    insecure: bool,
    tls: bool,
    acl: bool,
) -> Result<bool, HttpExposed> {
    crate::exposure::check_listen(listen, insecure, tls, acl).map_err(HttpExposed)
}

/// Binds `how`'s address (`None`: off). A preferred address that is taken
/// gives way to a port the system picks on the same address.
pub async fn bind(how: HttpListen) -> std::io::Result<Option<tokio::net::TcpListener>> {
    let Some(addr) = how.addr() else {
        return Ok(None);
    };
    match tokio::net::TcpListener::bind(addr).await {
        Ok(l) => Ok(Some(l)),
        Err(e)
            if e.kind() == std::io::ErrorKind::AddrInUse
                && matches!(how, HttpListen::Preferably(_)) =>
        {
            let l = tokio::net::TcpListener::bind(SocketAddr::new(addr.ip(), 0)).await?;
            tracing::warn!(
                wanted = %addr,
                serving = ?l.local_addr().ok(),
                "the default HTTP address is taken (another replica on this machine?): \
                 /metrics is served on a port the system picked; give --http-listen to choose"
            );
            Ok(Some(l))
        }
        Err(e) => Err(e),
    }
}

/// What `/metrics` answers with.
pub const METRICS_CONTENT_TYPE: &str = "application/openmetrics-text; version=1.0.0; charset=utf-8";

/// The most log entries one time-travel request may replay (from the
/// nearest checkpoint at or before the index asked for): about two
/// seconds of one core (BENCHMARKS, replay).
pub const TIME_TRAVEL_MAX_ENTRIES: u64 = 1_000_000;

/// The most journal indexes one `/api/v1/whatif` request reads. `keel
/// whatif` on 525,439 entries (10,000 jobs) took 2.3 s and peaked at
/// 547 MiB RSS, the whole process (BENCHMARKS, "The console's what-if").
/// A longer history is for `keel whatif --data-dir` on a copy.
pub const WHATIF_MAX_ENTRIES: u64 = 500_000;

/// How the console's what-if runs a history: as this server's loops run
/// (their policies' options, round and progress interval).
#[derive(Debug, Clone)]
pub struct WhatifDefaults {
    pub options: keel_scheduling::policy::PolicyOptions,
    pub round_s: f64,
    pub progress_interval_s: f64,
}

impl Default for WhatifDefaults {
    fn default() -> Self {
        WhatifDefaults::of(&Default::default(), &crate::leader::LoopSettings::default())
    }
}

impl WhatifDefaults {
    pub fn of(
        options: &keel_scheduling::policy::PolicyOptions,
        loops: &crate::leader::LoopSettings,
    ) -> WhatifDefaults {
        WhatifDefaults {
            options: options.clone(),
            round_s: loops.round.as_secs_f64(),
            progress_interval_s: loops.progress_every.as_secs_f64(),
        }
    }
}

/// What the routes read: the replica, and the policy it runs when the log
/// names none (admission's order, for why a job waits).
#[derive(Clone)]
pub struct Http {
    pub node: Arc<RaftNode>,
    pub default_policy: &'static str,
    /// One time-travel replay at a time: a second is answered 429 at
    /// once, so no client's requests take more than a core.
    pub rewinds: Arc<tokio::sync::Semaphore>,
    /// The event streams served now, at most [`EVENT_STREAMS_MAX`].
    pub streams: Arc<tokio::sync::Semaphore>,
    /// One what-if at a time (a second is answered 429), run as
    /// `whatif_defaults` say.
    pub whatifs: Arc<tokio::sync::Semaphore>,
    pub whatif_defaults: WhatifDefaults,
    /// Whether callers need a token (`--acl`), and the clock its expiry
    /// is read against ([`crate::http_access`]).
    pub acl: bool,
    pub clock: crate::api::Clock,
    /// Whether the endpoint is served over TLS (a login cookie is then
    /// `Secure`).
    pub tls: bool,
}

/// The most `/api/v1/events` streams a replica serves at once (one more
/// is answered 429).
pub const EVENT_STREAMS_MAX: usize = 64;

impl std::fmt::Debug for Http {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Http")
            .field("default_policy", &self.default_policy)
            .field("acl", &self.acl)
            .finish_non_exhaustive()
    }
}

impl Http {
    pub fn new(node: Arc<RaftNode>, default_policy: &'static str) -> Http {
        Http {
            node,
            default_policy,
            rewinds: Arc::new(tokio::sync::Semaphore::new(1)),
            streams: Arc::new(tokio::sync::Semaphore::new(EVENT_STREAMS_MAX)),
            whatifs: Arc::new(tokio::sync::Semaphore::new(1)),
            whatif_defaults: WhatifDefaults::default(),
            acl: false,
            clock: crate::api::system_clock(),
            tls: false,
        }
    }

    /// Callers need a token that may read the cluster (`--acl`), its
    /// expiry read against `clock`.
    pub fn with_acl(mut self, acl: bool, clock: crate::api::Clock) -> Http {
        self.acl = acl;
        self.clock = clock;
        self
    }

    /// What-ifs run as this server's loops do.
    pub fn with_whatif_defaults(mut self, defaults: WhatifDefaults) -> Http {
        self.whatif_defaults = defaults;
        self
    }

    /// Served over TLS.
    pub fn with_tls(mut self, tls: bool) -> Http {
        self.tls = tls;
        self
    }

    /// Whether `secret` may read the cluster now.
    fn check(&self, secret: Option<&str>) -> Result<String, crate::http_access::Refused> {
        let shared = self.node.state_machine.shared();
        let applied = shared.read();
        crate::http_access::check(applied.state.acl(), secret, (self.clock)())
    }
}

/// The routes, on `http`.
pub fn router(http: Http) -> Router {
    let readers_only = Router::new()
        .route("/", get(console))
        .route("/api/v1/cluster", get(cluster))
        .route("/api/v1/jobs/{id}", get(job_page))
        .route("/api/v1/whatif", get(whatif))
        .route("/api/v1/events", get(events))
        .route("/metrics", get(metrics))
        .route_layer(axum::middleware::from_fn_with_state(
            http.clone(),
            readers_only,
        ));
    Router::new()
        .merge(readers_only)
        .route("/login", post(login))
        .route("/logout", post(logout))
        .route("/healthz", get(healthz))
        .route("/readyz", get(readyz))
        .with_state(http)
}

/// With `--acl`, lets through only a request whose token may read the
/// cluster; a browser without one gets the login form at `/`.
async fn readers_only(
    State(http): State<Http>,
    request: axum::extract::Request,
    next: axum::middleware::Next,
) -> axum::response::Response {
    if !http.acl {
        return next.run(request).await;
    }
    match http.check(crate::http_access::presented(request.headers())) {
        Ok(_) => next.run(request).await,
        Err(refused) if request.uri().path() == "/" => crate::http_access::login_page(&refused),
        Err(refused) => refused.into_response(),
    }
}

/// A browser's login: the token checked, then kept in a cookie.
async fn login(
    State(http): State<Http>,
    axum::Form(form): axum::Form<crate::http_access::LoginForm>,
) -> axum::response::Response {
    let secret = form.token.trim();
    if !http.acl {
        return axum::response::Redirect::to("/").into_response();
    }
    match http.check(Some(secret)) {
        Ok(name) => match crate::http_access::login_cookie(secret, http.tls) {
            Some(cookie) => {
                tracing::info!(token = %name, "console login");
                (
                    [(header::SET_COOKIE, cookie)],
                    axum::response::Redirect::to("/"),
                )
                    .into_response()
            }
            None => (
                StatusCode::BAD_REQUEST,
                "this token's secret cannot travel in a cookie: send it as \
                 `Authorization: Bearer SECRET`\n",
            )
                .into_response(),
        },
        Err(refused) => crate::http_access::login_page(&refused),
    }
}

/// Forgets the browser's token.
async fn logout(State(http): State<Http>) -> axum::response::Response {
    (
        [(
            header::SET_COOKIE,
            crate::http_access::logout_cookie(http.tls),
        )],
        axum::response::Redirect::to("/"),
    )
        .into_response()
}

/// What `/metrics` answers a scraper that does not ask for OpenMetrics.
pub const TEXT_CONTENT_TYPE: &str = "text/plain; version=0.0.4; charset=utf-8";

/// OpenMetrics to a scraper that accepts it (Prometheus asks for it
/// first), Prometheus's classic text format to any other (`curl`,
/// `promtool`, older scrapers).
async fn metrics(State(http): State<Http>, headers: axum::http::HeaderMap) -> impl IntoResponse {
    let node = &http.node;
    let open = headers
        .get_all(header::ACCEPT)
        .iter()
        .filter_map(|v| v.to_str().ok())
        .any(|v| v.contains("application/openmetrics-text"));
    let rendered = if open {
        node.metrics.render().map(|t| (METRICS_CONTENT_TYPE, t))
    } else {
        node.metrics.render_text().map(|t| (TEXT_CONTENT_TYPE, t))
    };
    match rendered {
        Ok((content_type, text)) => {
            (StatusCode::OK, [(header::CONTENT_TYPE, content_type)], text).into_response()
        }
        Err(e) => (
            StatusCode::INTERNAL_SERVER_ERROR,
            format!("the metrics did not encode: {e}\n"),
        )
            .into_response(),
    }
}

/// What the page's address may ask for: a moment (as `/api/v1/cluster`)
/// and a job whose page is open.
#[derive(Debug, Default, serde::Deserialize)]
#[serde(deny_unknown_fields)]
struct ConsoleQuery {
    at: Option<String>,
    at_time: Option<String>,
    job: Option<String>,
    /// The policies of a what-if to show ([`whatif`]), and nodes added.
    whatif: Option<String>,
    add_nodes: Option<String>,
}

/// The console's page, with what it first shows inlined (the cluster now
/// or at the moment its address asks for, the open job's page, and the
/// what-if it asks for): the
/// page draws before any request of its own, and a browser that runs its
/// scripts once shows the cluster.
async fn console(
    State(http): State<Http>,
    query: Result<Query<ConsoleQuery>, axum::extract::rejection::QueryRejection>,
) -> axum::response::Response {
    let initial = match query {
        Err(e) => serde_json::json!({ "error": e.body_text() }),
        Ok(Query(q)) => {
            let moment = ClusterQuery {
                at: q.at,
                at_time: q.at_time,
            };
            let cluster = match moment.until() {
                Ok(until) => cluster_view(&http, until).await,
                Err(why) => Err((StatusCode::BAD_REQUEST, why)),
            };
            let job = match &q.job {
                Some(id) => Some(job_view(&http, id).await),
                None => None,
            };
            let whatif = match q.whatif {
                Some(policy) => {
                    let asked = WhatifQuery {
                        policy: Some(policy),
                        add_nodes: q.add_nodes,
                        ..WhatifQuery::default()
                    };
                    Some(match asked.read() {
                        Ok(asked) => whatif_view(&http, asked).await,
                        Err(why) => Err((StatusCode::BAD_REQUEST, why)),
                    })
                }
                None => None,
            };
            let error = [
                cluster.as_ref().err(),
                job.as_ref().and_then(|j| j.as_ref().err()),
                whatif.as_ref().and_then(|w| w.as_ref().err()),
            ]
            .into_iter()
            .flatten()
            .map(|(_, why)| why.clone())
            .collect::<Vec<_>>()
            .join("; ");
            serde_json::json!({
                "cluster": cluster.ok(),
                "job": job.and_then(Result::ok),
                "whatif": whatif.and_then(Result::ok),
                "error": (!error.is_empty()).then_some(error),
            })
        }
    };
    let page = crate::console::page_with(&initial);
    (
        [
            (header::CONTENT_TYPE, "text/html; charset=utf-8"),
            (header::CACHE_CONTROL, "no-cache"),
        ],
        page,
    )
        .into_response()
}

/// When `/api/v1/cluster` is asked about the past.
#[derive(Debug, Default, serde::Deserialize)]
#[serde(deny_unknown_fields)]
struct ClusterQuery {
    /// A log index.
    at: Option<String>,
    /// An RFC 3339 time: the last entry stamped at or before it.
    at_time: Option<String>,
}

impl ClusterQuery {
    /// Where to rewind to (`None`: now), or what is wrong with the query.
    fn until(&self) -> Result<Option<keel_storage::Until>, String> {
        match (&self.at, &self.at_time) {
            (Some(_), Some(_)) => Err("give at (a log index) or at_time (a time), not both".into()),
            (Some(at), None) => at
                .parse::<u64>()
                .map(|i| Some(keel_storage::Until::Index(i)))
                .map_err(|_| format!("at must be a log index (0 to {}), not {at:?}", u64::MAX)),
            (None, Some(t)) => Ok(Some(keel_storage::Until::Time(rfc3339_ms("at_time", t)?))),
            (None, None) => Ok(None),
        }
    }
}

/// The cluster as this replica applied it ([`crate::console::view`]), or,
/// with `at` or `at_time`, as it was then: rebuilt from the journal, with
/// `"at"` saying the index reached, its time and the state's hash (what
/// `keel replay --until` prints).
async fn cluster(
    State(http): State<Http>,
    query: Result<Query<ClusterQuery>, axum::extract::rejection::QueryRejection>,
) -> axum::response::Response {
    let until = match query.map_err(|e| e.body_text()).and_then(|q| q.until()) {
        Ok(until) => until,
        Err(why) => return (StatusCode::BAD_REQUEST, format!("{why}\n")).into_response(),
    };
    answer(cluster_view(&http, until).await)
}

/// A view as JSON, or its refusal as text.
fn answer(view: Result<serde_json::Value, (StatusCode, String)>) -> axum::response::Response {
    match view {
        Ok(view) => axum::Json(view).into_response(),
        Err((StatusCode::TOO_MANY_REQUESTS, why)) => (
            StatusCode::TOO_MANY_REQUESTS,
            [(header::RETRY_AFTER, "1")],
            format!("{why}\n"),
        )
            .into_response(),
        Err((status, why)) => (status, format!("{why}\n")).into_response(),
    }
}

/// [`cluster`]'s view: now (`until` none), or rebuilt at `until`.
async fn cluster_view(
    http: &Http,
    until: Option<keel_storage::Until>,
) -> Result<serde_json::Value, (StatusCode, String)> {
    let node = &http.node;
    let m = node.raft.metrics().borrow().clone();
    let raft = crate::console::RaftView {
        member: crate::membership::show(m.id),
        term: m.current_term,
        leader: m.current_leader.map(crate::membership::show),
        applied_index: m.last_applied.map_or(0, |l| l.index),
        commit_index: node.log.committed_index().unwrap_or(0),
        members: m
            .membership_config
            .membership()
            .voter_ids()
            .map(crate::membership::show)
            .collect(),
    };
    let Some(until) = until else {
        let shared = node.state_machine.shared();
        let applied = shared.read();
        let admission = crate::api::AdmissionView::of(&applied.state, http.default_policy);
        return Ok(crate::console::view(&applied.state, &raft, |job| {
            crate::api::wait_message(&applied.state, job, &admission)
        }));
    };
    let Ok(_permit) = http.rewinds.clone().try_acquire_owned() else {
        return Err((
            StatusCode::TOO_MANY_REQUESTS,
            "another time-travel request is being rebuilt on this replica; try again".into(),
        ));
    };
    let store = node.state_machine.clone();
    let rebuilt =
        tokio::task::spawn_blocking(move || store.state_at(until, TIME_TRAVEL_MAX_ENTRIES)).await;
    let summary = match rebuilt {
        Ok(Ok(summary)) => summary,
        Ok(Err(e @ keel_storage::ReplayError::TooFar { .. })) => {
            return Err((StatusCode::UNPROCESSABLE_ENTITY, e.to_string()))
        }
        Ok(Err(e)) => return Err((StatusCode::INTERNAL_SERVER_ERROR, e.to_string())),
        Err(e) => {
            return Err((
                StatusCode::INTERNAL_SERVER_ERROR,
                format!("the rebuild stopped: {e}"),
            ))
        }
    };
    let state = &summary.state;
    let admission = crate::api::AdmissionView::of(state, http.default_policy);
    let mut view = crate::console::view(state, &raft, |job| {
        crate::api::wait_message(state, job, &admission)
    });
    view["at"] = serde_json::json!({
        "index": summary.last_index,
        "at_ms": state.last_entry_at_ms(),
        "state_hash": summary.state_hash.to_string(),
        "replayed_from": summary.started_after,
    });
    Ok(view)
}

/// What `/api/v1/whatif` is asked.
#[derive(Debug, Default, serde::Deserialize)]
#[serde(deny_unknown_fields)]
struct WhatifQuery {
    /// Policies besides `recorded`, comma-separated.
    policy: Option<String>,
    /// Only the jobs submitted at or after this time (RFC 3339).
    from_time: Option<String>,
    /// The history up to this log index.
    until: Option<String>,
    /// The history up to the last entry stamped at or before this time
    /// (RFC 3339).
    until_time: Option<String>,
    /// Nodes added to the recorded ones, `COUNTxGPUSxTYPE[,...]`.
    add_nodes: Option<String>,
}

/// An RFC 3339 time given to `field`, in Unix milliseconds.
fn rfc3339_ms(field: &str, time: &str) -> Result<u64, String> {
    let at = humantime::parse_rfc3339_weak(time).map_err(|_| {
        format!("{field} must be an RFC 3339 time such as 2026-11-26T10:00:00Z, not {time:?}")
    })?;
    Ok(at
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| u64::try_from(d.as_millis()).unwrap_or(u64::MAX)))
}

/// What a what-if asks, read from its query.
#[derive(Debug)]
struct WhatifAsked {
    policies: Vec<String>,
    /// Where the history ends.
    until: keel_storage::Until,
    /// The first submission kept (Unix ms).
    from_ms: Option<u64>,
    added_nodes: Vec<keel_sim::SimNode>,
}

impl WhatifQuery {
    /// What the query asks, or what is wrong with it.
    fn read(&self) -> Result<WhatifAsked, String> {
        let policies = self
            .policy
            .as_deref()
            .unwrap_or("")
            .split(',')
            .map(str::trim)
            .filter(|p| !p.is_empty())
            .map(str::to_string)
            .collect();
        let until = match (&self.until, &self.until_time) {
            (Some(_), Some(_)) => {
                return Err("give until (a log index) or until_time (a time), not both".into())
            }
            (Some(i), None) => keel_storage::Until::Index(i.parse::<u64>().map_err(|_| {
                format!("until must be a log index (0 to {}), not {i:?}", u64::MAX)
            })?),
            (None, Some(t)) => keel_storage::Until::Time(rfc3339_ms("until_time", t)?),
            (None, None) => keel_storage::Until::End,
        };
        let from = self
            .from_time
            .as_deref()
            .map(|t| rfc3339_ms("from_time", t))
            .transpose()?;
        let added_nodes = match &self.add_nodes {
            Some(spec) => {
                crate::whatif::added_nodes("add_nodes", spec).map_err(|e| e.to_string())?
            }
            None => Vec::new(),
        };
        Ok(WhatifAsked {
            policies,
            until,
            from_ms: from,
            added_nodes,
        })
    }
}

/// This replica's history run through `recorded` and the policies asked
/// for ([`crate::whatif::compare`]): the report `keel whatif -o json`
/// gives on the same history, and `"figures"`, its SVG figures as `keel
/// whatif --plot` draws them. Read from the replica's journal on a
/// blocking thread, one request at a time.
async fn whatif(
    State(http): State<Http>,
    query: Result<Query<WhatifQuery>, axum::extract::rejection::QueryRejection>,
) -> axum::response::Response {
    let asked = match query.map_err(|e| e.body_text()).and_then(|q| q.read()) {
        Ok(asked) => asked,
        Err(why) => return (StatusCode::BAD_REQUEST, format!("{why}\n")).into_response(),
    };
    answer(whatif_view(&http, asked).await)
}

async fn whatif_view(
    http: &Http,
    WhatifAsked {
        policies,
        until,
        from_ms,
        added_nodes,
    }: WhatifAsked,
) -> Result<serde_json::Value, (StatusCode, String)> {
    let defaults = &http.whatif_defaults;
    crate::whatif::run_names(&policies, &defaults.options)
        .map_err(|e| (StatusCode::BAD_REQUEST, format!("policy: {e}")))?;
    let Ok(_permit) = http.whatifs.clone().try_acquire_owned() else {
        return Err((
            StatusCode::TOO_MANY_REQUESTS,
            "another what-if is running on this replica; try again".into(),
        ));
    };
    let settings = crate::whatif::Settings {
        policies,
        options: defaults.options.clone(),
        round_s: defaults.round_s,
        progress_interval_s: defaults.progress_interval_s,
        restart_s: 0.0,
        submitted_from_ms: from_ms,
        cluster: None,
        added_nodes,
    };
    let store = http.node.state_machine.clone();
    let ran = tokio::task::spawn_blocking(move || run_whatif(&store, until, &settings)).await;
    match ran {
        Ok(answer) => answer,
        Err(e) => Err((
            StatusCode::INTERNAL_SERVER_ERROR,
            format!("the what-if stopped: {e}"),
        )),
    }
}

/// [`whatif_view`]'s work, on a blocking thread.
fn run_whatif(
    store: &keel_storage::StateMachineStore,
    until: keel_storage::Until,
    settings: &crate::whatif::Settings,
) -> Result<serde_json::Value, (StatusCode, String)> {
    let mut history = store
        .history(until, WHATIF_MAX_ENTRIES)
        .map_err(|e| match e {
            keel_storage::ReplayError::HistoryTooLong { .. } => (
                StatusCode::UNPROCESSABLE_ENTITY,
                format!(
                    "{e}; ask for less (until, until_time) or run `keel whatif --data-dir` on a \
                     copy of a data directory"
                ),
            ),
            e => (StatusCode::INTERNAL_SERVER_ERROR, e.to_string()),
        })?;
    let mut recorder =
        keel_sim::history::Recorder::starting_from(std::mem::take(&mut history.state_before));
    history
        .for_each(&mut |index, entry| recorder.record(index, entry))
        .map_err(|e| (StatusCode::INTERNAL_SERVER_ERROR, e.to_string()))?;
    let compared = crate::whatif::compare(recorder.finish(), settings).map_err(|e| match e {
        crate::whatif::WhatifError::UnknownPolicy(_) => {
            (StatusCode::BAD_REQUEST, format!("policy: {e}"))
        }
        e => (StatusCode::UNPROCESSABLE_ENTITY, e.to_string()),
    })?;
    let runs: Vec<&keel_sim::SimReport> = compared.runs.iter().collect();
    let figures = crate::sim_plot::figures(&runs, None)
        .map_err(|e| (StatusCode::INTERNAL_SERVER_ERROR, e.to_string()))?;
    let mut view = serde_json::to_value(&compared.report)
        .map_err(|e| (StatusCode::INTERNAL_SERVER_ERROR, e.to_string()))?;
    view["figures"] = figures
        .into_iter()
        .map(|f| serde_json::json!({"name": f.name, "svg": f.svg}))
        .collect();
    Ok(view)
}

/// The most history entries a job's page reads (as `keel why`).
pub const JOB_PAGE_MAX_ENTRIES: usize = 10_000;

/// A job's page, read from this replica's state and journal.
async fn job_page(State(http): State<Http>, Path(id): Path<String>) -> axum::response::Response {
    answer(job_view(&http, &id).await)
}

/// [`job_page`]'s view of job `id` (as the address gave it).
async fn job_view(http: &Http, id: &str) -> Result<serde_json::Value, (StatusCode, String)> {
    let Ok(id) = id.parse::<u64>() else {
        return Err((
            StatusCode::BAD_REQUEST,
            format!("the job id must be a number, not {id:?}"),
        ));
    };
    let node = &http.node;
    let (job, removed) = {
        let shared = node.state_machine.shared();
        let applied = shared.read();
        let state = &applied.state;
        let job = state.job(id).map(|j| {
            let admission = crate::api::AdmissionView::of(state, http.default_policy);
            let message =
                crate::api::wait_message(state, j, &admission).unwrap_or_else(|| j.message.clone());
            (j.clone(), message)
        });
        (job, state.was_removed(id))
    };
    if job.is_none() && !removed {
        return Err((StatusCode::NOT_FOUND, format!("job {id} does not exist")));
    }
    let store = node.state_machine.clone();
    let read =
        tokio::task::spawn_blocking(move || store.job_history(id, JOB_PAGE_MAX_ENTRIES)).await;
    let (history, truncated) = match read {
        Ok(Ok(read)) => read,
        Ok(Err(e)) => return Err((StatusCode::INTERNAL_SERVER_ERROR, e.to_string())),
        Err(e) => {
            return Err((
                StatusCode::INTERNAL_SERVER_ERROR,
                format!("the read stopped: {e}"),
            ))
        }
    };
    Ok(crate::console::job_page(
        id,
        job.as_ref().map(|(j, m)| (j, m.clone())),
        &history,
        truncated,
    ))
}

/// Where `/api/v1/events` starts.
#[derive(Debug, Default, serde::Deserialize)]
#[serde(deny_unknown_fields)]
struct EventsQuery {
    /// A log index: its entry's records first.
    from: Option<String>,
}

/// The applied entries as they come, as server-sent events: each an
/// `entry` event whose id is `INDEX.POSITION` and whose data is
/// [`crate::console::feed_entry`]'s JSON.
async fn events(
    State(http): State<Http>,
    headers: axum::http::HeaderMap,
    query: Result<Query<EventsQuery>, axum::extract::rejection::QueryRejection>,
) -> axum::response::Response {
    use axum::response::sse::{Event, KeepAlive, Sse};
    use tokio_stream::StreamExt;
    let bad = |why: String| (StatusCode::BAD_REQUEST, format!("{why}\n")).into_response();
    let from = match query {
        Ok(q) => q.0.from,
        Err(e) => return bad(e.body_text()),
    };
    let resume = headers
        .get("last-event-id")
        .and_then(|v| v.to_str().ok())
        .map(str::to_string);
    let store = http.node.state_machine.clone();
    let cursor = match (from, resume) {
        (Some(from), _) => match from.parse::<u64>() {
            Ok(i) => keel_storage::JournalCursor::at_index(i),
            Err(_) => return bad(format!("from must be a log index, not {from:?}")),
        },
        (None, Some(id)) => match id.split_once('.').and_then(|(i, p)| {
            Some(keel_storage::JournalCursor {
                index: i.parse().ok()?,
                position: p.parse::<u32>().ok()?.checked_add(1)?,
            })
        }) {
            Some(cursor) => cursor,
            None => return bad(format!("Last-Event-ID must be INDEX.POSITION, not {id:?}")),
        },
        (None, None) => keel_storage::JournalCursor::at_index(
            store.shared().read().last_applied.map_or(0, |l| l.index) + 1,
        ),
    };
    let Ok(permit) = http.streams.clone().try_acquire_owned() else {
        return (
            StatusCode::TOO_MANY_REQUESTS,
            [(header::RETRY_AFTER, "5")],
            format!("this replica serves {EVENT_STREAMS_MAX} event streams already; try again\n"),
        )
            .into_response();
    };
    let (tx, rx) = tokio::sync::mpsc::channel(512);
    tokio::spawn(async move {
        let _permit = permit; // held until the stream ends
        crate::api::follow_journal(store, cursor, true, tx).await;
    });
    let stream = tokio_stream::wrappers::ReceiverStream::new(rx).map(|read| {
        Ok::<_, std::convert::Infallible>(match read {
            Ok(record) => Event::default()
                .event("entry")
                .id(format!("{}.{}", record.index, record.position))
                .json_data(crate::console::feed_entry(&record))
                .unwrap_or_else(|e| Event::default().event("error").data(e.to_string())),
            Err(e) => Event::default().event("error").data(e.to_string()),
        })
    });
    Sse::new(stream)
        .keep_alive(KeepAlive::default())
        .into_response()
}

async fn healthz() -> &'static str {
    "ok\n"
}

async fn readyz(State(http): State<Http>) -> impl IntoResponse {
    match crate::metrics::readiness(&http.node.raft, &http.node.log) {
        Ok(()) => (StatusCode::OK, "ready\n".to_string()),
        Err(why) => (
            StatusCode::SERVICE_UNAVAILABLE,
            format!("not ready: {why}\n"),
        ),
    }
}

/// Serves the routes on `listener` until `stop` turns true: over TLS with
/// the replica's certificate when it has one (HTTPS, no client
/// certificate asked), else in plaintext.
pub async fn serve(
    listener: tokio::net::TcpListener,
    http: Http,
    tls: Option<Arc<crate::tls::TlsState>>,
    mut stop: tokio::sync::watch::Receiver<bool>,
) {
    let stopped = async move {
        let _ = stop.wait_for(|s| *s).await;
    };
    let served = match tls {
        Some(tls) => {
            axum::serve(
                https::TlsListener::new(listener, tls),
                router(http.with_tls(true)),
            )
            .with_graceful_shutdown(stopped)
            .await
        }
        None => {
            axum::serve(listener, router(http))
                .with_graceful_shutdown(stopped)
                .await
        }
    };
    if let Err(e) = served {
        tracing::error!(error = %e, "the HTTP endpoint stopped");
    }
}

/// The endpoint over TLS: connections handshaken apart from the accept
/// loop, by the API's own ([`crate::transport::accept_tls`]).
mod https {
    use std::net::SocketAddr;
    use std::sync::Arc;

    use tokio::net::{TcpListener, TcpStream};
    use tokio_rustls::server::TlsStream;

    pub struct TlsListener {
        ready: tokio::sync::mpsc::Receiver<(TlsStream<TcpStream>, SocketAddr)>,
        local: std::io::Result<SocketAddr>,
    }

    impl TlsListener {
        pub fn new(tcp: TcpListener, tls: Arc<crate::tls::TlsState>) -> TlsListener {
            let local = tcp.local_addr();
            let (tx, ready) = tokio::sync::mpsc::channel(64);
            tokio::spawn(crate::transport::accept_tls(
                tcp,
                move || tls.web_config(),
                tx,
                |tls_stream, peer| (tls_stream, peer),
                "a client without TLS?",
            ));
            TlsListener { ready, local }
        }
    }

    impl axum::serve::Listener for TlsListener {
        type Io = TlsStream<TcpStream>;
        type Addr = SocketAddr;

        async fn accept(&mut self) -> (Self::Io, Self::Addr) {
            match self.ready.recv().await {
                Some(connection) => connection,
                // The accept loop ended (no certificate): nothing more
                // comes.
                None => std::future::pending().await,
            }
        }

        fn local_addr(&self) -> std::io::Result<SocketAddr> {
            match &self.local {
                Ok(a) => Ok(*a),
                Err(e) => Err(std::io::Error::new(e.kind(), e.to_string())),
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_flag_reads_an_address_off_or_the_default() {
        assert_eq!(
            HttpListen::from_flag(None),
            Ok(HttpListen::Preferably(
                DEFAULT_HTTP_LISTEN.parse().expect("an address")
            ))
        );
        assert_eq!(HttpListen::from_flag(Some("off")), Ok(HttpListen::Off));
        assert_eq!(
            HttpListen::from_flag(Some("127.0.0.1:0")),
            Ok(HttpListen::At("127.0.0.1:0".parse().expect("an address")))
        );
        let bad = HttpListen::from_flag(Some("metrics")).expect_err("refused");
        assert!(
            bad.contains("--http-listen") && bad.contains("off"),
            "{bad}"
        );
    }

    #[test]
    fn beyond_loopback_only_with_tls_and_acls_or_insecure() {
        let lo: SocketAddr = "127.0.0.1:7080".parse().expect("an address");
        let any: SocketAddr = "0.0.0.0:7080".parse().expect("an address");
        assert_eq!(check_listen(lo, false, false, false), Ok(false));
        assert_eq!(check_listen(any, false, true, true), Ok(false));
        assert_eq!(check_listen(any, true, false, false), Ok(true));
        for (tls, acl, missing) in [
            (false, false, "TLS and ACLs"),
            (true, false, "ACLs"),
            (false, true, "without TLS"),
        ] {
            let refused = check_listen(any, false, tls, acl).expect_err("refused");
            let text = refused.to_string();
            assert!(
                text.contains("--insecure") && text.contains(missing),
                "{text}"
            );
        }
    }

    #[tokio::test]
    async fn a_taken_default_gives_way_and_a_chosen_address_does_not() {
        let taken = tokio::net::TcpListener::bind("127.0.0.1:0")
            .await
            .expect("binds");
        let addr = taken.local_addr().expect("an address");
        let moved = bind(HttpListen::Preferably(addr))
            .await
            .expect("binds elsewhere")
            .expect("a listener");
        assert_ne!(moved.local_addr().expect("an address"), addr);
        let err = bind(HttpListen::At(addr)).await.expect_err("taken");
        assert_eq!(err.kind(), std::io::ErrorKind::AddrInUse);
        assert!(bind(HttpListen::Off)
            .await
            .expect("nothing to bind")
            .is_none());
    }
}
