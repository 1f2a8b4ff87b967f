//! A stand-in for a Kubernetes API server, for the Kubernetes executor's
//! tests: the real paths and object shapes of the core/v1 API that the
//! executor uses (Pods: create, list, watch, get logs, delete; Services:
//! create, delete; Nodes: list), with resource versions and watch streams
//! of `ADDED`/`MODIFIED`/`DELETED` events, and a handle through which the
//! test plays the kubelet: it moves Pods through their phases, writes their
//! logs, and makes Nodes ready or not.
//!
//! It behaves as a real API server and kubelet do where the executor can
//! go wrong:
//! - **Watches** end (`end_watches`), a resource version older than the
//!   compacted history gets `410 Expired` (`compact`), and bookmarks come
//!   when asked for (`allowWatchBookmarks`).
//! - **Deletion is graceful**: DELETE sets `deletionTimestamp`; the Pod
//!   stays, Terminating, until its node's kubelet confirms (the container
//!   exits 143, then the Pod is removed), or forever on a node whose kubelet
//!   is gone (`kubelet_gone`). `gracePeriodSeconds: 0` removes it at once.
//! - **The kubelet admits** a Pod pinned to a known node only if the node's
//!   allocatable GPUs, less what the Pods present on it request (Terminating
//!   ones included), cover it; else the Pod fails with
//!   `UnexpectedAdmissionError` and no container status.
//! - **Nodes** have allocatable below capacity, taints, `unschedulable`;
//!   **other tenants' Pods** run in other namespaces (a cluster-wide list
//!   and watch, with `fieldSelector` on `status.phase`).
//! - **Overload and failures**: 429 with `Retry-After`, 500 from a webhook,
//!   a create persisted but answered 504, a create held without an answer.
//! - **Logs** are bytes with timestamps (`timestamps`, `sinceTime`), may be
//!   invalid UTF-8, and rotate (a follow ends; what came before is gone).

#![allow(dead_code)]

use std::collections::BTreeMap;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use axum::body::Body;
use axum::extract::{Path, Query, State};
use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use axum::routing::{delete, get};
use axum::{Json, Router};
use serde_json::{json, Value};

/// One log line: when (nanoseconds since the Unix epoch) and its bytes.
type LogLine = (u64, Vec<u8>);

/// A failure the next pod create meets.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum CreateFault {
    /// 503, nothing stored.
    Unavailable,
    /// 403 (a quota), nothing stored.
    Forbidden,
    /// 429 with `Retry-After: s`, nothing stored.
    TooManyRequests(u32),
    /// 500 from an admission webhook, nothing stored.
    Webhook,
    /// Stored, but answered 504.
    PersistedButTimedOut,
}

#[derive(Debug, Default)]
struct World {
    resource_version: u64,
    /// Pods by `namespace/name`.
    pods: BTreeMap<String, Value>,
    logs: BTreeMap<String, Vec<LogLine>>,
    /// Bumped when a pod's log rotates: its follows end.
    log_generation: BTreeMap<String, u64>,
    log_clock_ns: u64,
    services: BTreeMap<String, Value>,
    /// Secrets by name, as a real API server keeps them: `stringData`
    /// merged into `data`, base64.
    secrets: BTreeMap<String, Value>,
    nodes: BTreeMap<String, Value>,
    /// Every Pod change: (resource version, type, object).
    events: Vec<(u64, &'static str, Value)>,
    /// Resource versions at or below this are compacted: a watch from
    /// them gets 410.
    compacted: u64,
    /// Bumped to end every open watch.
    watch_generation: u64,
    /// The next pod creations' failures, in order.
    create_faults: Vec<CreateFault>,
    /// Pod names whose creates are held without an answer until released.
    stalled: std::collections::BTreeSet<String>,
    /// Creates held now.
    stalled_now: usize,
    /// When each pod create arrived (for the spacing of retries).
    create_times: Vec<(String, std::time::Instant)>,
    /// Nodes whose kubelet never confirms a deletion.
    kubelet_gone: std::collections::BTreeSet<String>,
    /// Namespaces whose changes watches deliver late (held until
    /// `catch_up_watches`), as a loaded API server's watch cache lags.
    lagging: std::collections::BTreeSet<String>,
    /// Requests seen, "VERB resource name" (for assertions on what was
    /// called: WATCH, LIST, POST, DELETE, LOG).
    requests: Vec<String>,
}

impl World {
    fn bump(&mut self) -> u64 {
        self.resource_version += 1;
        self.resource_version
    }

    fn record(&mut self, kind: &'static str, mut pod: Value) -> Value {
        let rv = self.bump();
        pod["metadata"]["resourceVersion"] = json!(rv.to_string());
        self.events.push((rv, kind, pod.clone()));
        pod
    }

    /// Stores `pod` (changed) and says so to the watches.
    fn put(&mut self, key: &str, pod: Value) {
        let pod = self.record("MODIFIED", pod);
        self.pods.insert(key.to_string(), pod);
    }

    /// Removes a pod and says so.
    fn remove(&mut self, key: &str) -> Option<Value> {
        let pod = self.pods.remove(key)?;
        Some(self.record("DELETED", pod))
    }

    fn key_of(&self, name: &str) -> Option<String> {
        self.pods
            .keys()
            .find(|k| k.rsplit('/').next() == Some(name))
            .cloned()
    }

    /// GPUs the pods present on `node` request (Terminating ones too:
    /// their containers may still hold the devices), but `except`.
    fn gpus_in_use(&self, node: &str, except: &str) -> u64 {
        self.pods
            .iter()
            .filter(|(k, p)| {
                k.as_str() != except
                    && p["spec"]["nodeName"] == json!(node)
                    && !matches!(p["status"]["phase"].as_str(), Some("Succeeded" | "Failed"))
            })
            .map(|(_, p)| pod_gpus(p))
            .sum()
    }

    /// The kubelet's confirmation of a deletion: the container exits on
    /// SIGTERM (143), then the pod goes.
    fn confirm_deletion(&mut self, key: &str) {
        let Some(mut pod) = self.pods.get(key).cloned() else {
            return;
        };
        let phase = pod["status"]["phase"].as_str().unwrap_or("").to_string();
        if phase == "Running" || phase == "Pending" {
            pod["status"]["phase"] = json!("Failed");
            pod["status"]["containerStatuses"] = json!([{"name": "worker", "ready": false,
                "restartCount": 0, "image": "", "imageID": "",
                "state": {"terminated": {"exitCode": 143, "reason": "Error"}}}]);
            self.put(key, pod);
        }
        self.remove(key);
    }

    fn now_rfc3339(&self) -> String {
        "2026-11-28T12:00:00Z".into()
    }
}

fn pod_gpus(pod: &Value) -> u64 {
    pod["spec"]["containers"]
        .as_array()
        .into_iter()
        .flatten()
        .map(|c| {
            let r = &c["resources"];
            r["requests"]["nvidia.com/gpu"]
                .as_str()
                .or(r["limits"]["nvidia.com/gpu"].as_str())
                .and_then(|q| q.parse::<u64>().ok())
                .unwrap_or(0)
        })
        .sum()
}

/// Nanoseconds as RFC 3339 with nanoseconds, as the kubelet writes them.
fn rfc3339_nanos(ns: u64) -> String {
    let secs = ns / 1_000_000_000;
    let nanos = ns % 1_000_000_000;
    let days = secs / 86_400;
    let rem = secs % 86_400;
    // 2026-11-28 is day 20_420 since the epoch; the stand-in's log clock
    // starts there and never runs for a day.
    let day_of = days.saturating_sub(20_420);
    format!(
        "2026-11-{:02}T{:02}:{:02}:{:02}.{nanos:09}Z",
        28 + day_of,
        rem / 3600,
        rem % 3600 / 60,
        rem % 60
    )
}

/// Parses what `rfc3339_nanos` writes (whole seconds, as `sinceTime` is).
fn parse_since(text: &str) -> Option<u64> {
    let t = text.strip_prefix("2026-11-")?;
    let day: u64 = t.get(0..2)?.parse().ok()?;
    let h: u64 = t.get(3..5)?.parse().ok()?;
    let m: u64 = t.get(6..8)?.parse().ok()?;
    let sec: u64 = t.get(9..11)?.parse().ok()?;
    Some(((20_420 + day - 28) * 86_400 + h * 3600 + m * 60 + sec) * 1_000_000_000)
}

/// The stand-in's address and the test's handle on it.
#[derive(Debug, Clone)]
pub struct StandIn {
    pub url: String,
    world: Arc<Mutex<World>>,
}

/// A JSON path such as `status.phase` in `v`.
fn field<'a>(v: &'a Value, path: &str) -> &'a Value {
    path.split('.').fold(v, |v, k| &v[k])
}

fn matches(selector: Option<&String>, labels: &Value) -> bool {
    let Some(selector) = selector else {
        return true;
    };
    selector.split(',').filter(|s| !s.is_empty()).all(|term| {
        let (k, v) = term.split_once('=').unwrap_or((term, ""));
        labels.get(k).and_then(Value::as_str) == Some(v)
    })
}

/// `fieldSelector` terms `path=value`, `path==value`, `path!=value`.
fn fields_match(selector: Option<&String>, obj: &Value) -> bool {
    let Some(selector) = selector else {
        return true;
    };
    selector.split(',').filter(|s| !s.is_empty()).all(|term| {
        if let Some((k, v)) = term.split_once("!=") {
            field(obj, k).as_str().unwrap_or("") != v
        } else {
            let (k, v) = term.split_once('=').unwrap_or((term, ""));
            field(obj, k).as_str().unwrap_or("") == v.trim_start_matches('=')
        }
    })
}

fn status(code: u16, reason: &str, message: &str) -> Response {
    (
        StatusCode::from_u16(code).unwrap_or(StatusCode::INTERNAL_SERVER_ERROR),
        Json(json!({
            "kind": "Status", "apiVersion": "v1", "metadata": {},
            "status": "Failure", "message": message, "reason": reason, "code": code
        })),
    )
        .into_response()
}

type Shared = Arc<Mutex<World>>;

async fn list_or_watch_pods(
    State(world): State<Shared>,
    ns: Option<Path<String>>,
    Query(q): Query<BTreeMap<String, String>>,
) -> Response {
    let ns = ns.map(|Path(n)| n);
    let scope = ns.clone().unwrap_or_else(|| "*".into());
    let selector = q.get("labelSelector").cloned();
    let fields = q.get("fieldSelector").cloned();
    let in_scope = move |pod: &Value| {
        ns.as_ref()
            .is_none_or(|ns| pod["metadata"]["namespace"] == json!(ns))
            && matches(selector.as_ref(), &pod["metadata"]["labels"])
    };
    if q.get("watch").map(String::as_str) == Some("true") {
        let from: u64 = q
            .get("resourceVersion")
            .and_then(|v| v.parse().ok())
            .unwrap_or(0);
        let bookmarks = q.get("allowWatchBookmarks").map(String::as_str) == Some("true");
        let timeout_s: u64 = q
            .get("timeoutSeconds")
            .and_then(|v| v.parse().ok())
            .unwrap_or(290)
            .min(30);
        let (generation, expired) = {
            let mut w = world.lock().expect("world");
            w.requests.push(format!(
                "WATCH pods {scope} from={from} bookmarks={bookmarks}"
            ));
            (w.watch_generation, from != 0 && from < w.compacted)
        };
        let (tx, rx) = tokio::sync::mpsc::channel::<Result<String, std::io::Error>>(64);
        tokio::spawn(async move {
            if expired {
                // As the real API server says it: a 200 whose one event is
                // an ERROR with a 410 Status.
                let event = json!({"type": "ERROR", "object": {
                    "kind": "Status", "apiVersion": "v1", "metadata": {}, "status": "Failure",
                    "message": format!("too old resource version: {from}"),
                    "reason": "Expired", "code": 410}});
                let _ = tx.send(Ok(format!("{event}\n"))).await;
                return;
            }
            let mut seen = from;
            let mut last_bookmark = tokio::time::Instant::now();
            let deadline = tokio::time::Instant::now() + Duration::from_secs(timeout_s);
            while tokio::time::Instant::now() < deadline {
                let (batch, ended, rv): (Vec<String>, bool, u64) = {
                    let w = world.lock().expect("world");
                    let after = seen;
                    let mut out = Vec::new();
                    let mut held = false;
                    // A watch with a field selector sees an object that
                    // stops matching as deleted, as the watch cache does.
                    for (rv, kind, pod) in &w.events {
                        if *rv > after
                            && in_scope(pod)
                            && pod["metadata"]["namespace"]
                                .as_str()
                                .is_some_and(|n| w.lagging.contains(n))
                        {
                            // Held back, and everything after it.
                            held = true;
                            break;
                        }
                        if *rv > after && in_scope(pod) {
                            seen = seen.max(*rv);
                            let now = fields_match(fields.as_ref(), pod);
                            let kind = match (*kind, now) {
                                ("DELETED", _) => "DELETED",
                                (_, true) => *kind,
                                (_, false) => "DELETED",
                            };
                            out.push(format!("{}\n", json!({"type": kind, "object": pod})));
                        }
                    }
                    // A bookmark never claims what was held back.
                    let upto = if held { seen } else { w.resource_version };
                    (out, w.watch_generation != generation, upto)
                };
                if ended {
                    return;
                }
                for line in batch {
                    if tx.send(Ok(line)).await.is_err() {
                        return;
                    }
                }
                if bookmarks && last_bookmark.elapsed() > Duration::from_millis(300) {
                    last_bookmark = tokio::time::Instant::now();
                    let mark = json!({"type": "BOOKMARK", "object": {"kind": "Pod", "apiVersion": "v1",
                        "metadata": {"resourceVersion": rv.max(seen).to_string()}}});
                    seen = seen.max(rv);
                    if tx.send(Ok(format!("{mark}\n"))).await.is_err() {
                        return;
                    }
                }
                tokio::time::sleep(Duration::from_millis(20)).await;
            }
        });
        return Response::builder()
            .header("content-type", "application/json")
            .body(Body::from_stream(
                tokio_stream::wrappers::ReceiverStream::new(rx),
            ))
            .unwrap_or_else(|_| status(500, "InternalError", "body"));
    }
    let mut w = world.lock().expect("world");
    w.requests.push(format!("LIST pods {scope}"));
    let items: Vec<Value> = w
        .pods
        .values()
        .filter(|p| in_scope(p) && fields_match(fields.as_ref(), p))
        .cloned()
        .collect();
    Json(json!({
        "kind": "PodList", "apiVersion": "v1",
        "metadata": {"resourceVersion": w.resource_version.to_string()},
        "items": items
    }))
    .into_response()
}

async fn list_all_pods(world: State<Shared>, q: Query<BTreeMap<String, String>>) -> Response {
    list_or_watch_pods(world, None, q).await
}

async fn list_ns_pods(
    world: State<Shared>,
    ns: Path<String>,
    q: Query<BTreeMap<String, String>>,
) -> Response {
    list_or_watch_pods(world, Some(ns), q).await
}

async fn create_pod(
    State(world): State<Shared>,
    Path(ns): Path<String>,
    Json(mut pod): Json<Value>,
) -> Response {
    let Some(name) = pod["metadata"]["name"].as_str().map(String::from) else {
        return status(422, "Invalid", "metadata.name: Required value");
    };
    let stall = {
        let mut w = world.lock().expect("world");
        w.requests.push(format!("POST pods {name}"));
        w.create_times
            .push((name.clone(), std::time::Instant::now()));
        let stall = w.stalled.contains(&name);
        if stall {
            w.stalled_now += 1;
        }
        stall
    };
    if stall {
        // Held without an answer until the test releases it (the client
        // gives up first, or sees the answer afterwards).
        loop {
            tokio::time::sleep(Duration::from_millis(20)).await;
            let mut w = world.lock().expect("world");
            if !w.stalled.contains(&name) {
                w.stalled_now -= 1;
                break;
            }
        }
    }
    let mut w = world.lock().expect("world");
    let fault = (!w.create_faults.is_empty()).then(|| w.create_faults.remove(0));
    match &fault {
        Some(CreateFault::Forbidden) => {
            return status(
                403,
                "Forbidden",
                &format!("pods \"{name}\" is forbidden: exceeded quota: gpu-quota"),
            )
        }
        Some(CreateFault::Unavailable) => {
            return status(503, "ServiceUnavailable", "etcdserver: request timed out")
        }
        Some(CreateFault::Webhook) => {
            return status(
                500,
                "InternalError",
                "Internal error occurred: failed calling webhook \"validate.policy.example\": context deadline exceeded",
            )
        }
        Some(CreateFault::TooManyRequests(s)) => {
            let mut r = (
                StatusCode::TOO_MANY_REQUESTS,
                Json(json!({
                    "kind": "Status", "apiVersion": "v1", "metadata": {}, "status": "Failure",
                    "message": "Too many requests, please try again later.",
                    "reason": "TooManyRequests", "code": 429,
                    "details": {"retryAfterSeconds": s}
                })),
            )
                .into_response();
            r.headers_mut()
                .insert("retry-after", s.to_string().parse().expect("header"));
            return r;
        }
        _ => {}
    }
    let key = format!("{ns}/{name}");
    if w.pods.contains_key(&key) {
        return status(
            409,
            "AlreadyExists",
            &format!("pods \"{name}\" already exists"),
        );
    }
    pod["apiVersion"] = json!("v1");
    pod["kind"] = json!("Pod");
    pod["metadata"]["namespace"] = json!(ns);
    pod["metadata"]["uid"] = json!(format!("uid-{name}"));
    pod["status"] = json!({"phase": "Pending"});
    let pod = w.record("ADDED", pod);
    w.pods.insert(key.clone(), pod.clone());
    w.logs.entry(name.clone()).or_default();
    // The kubelet of a known node admits the pod only if its devices
    // cover it.
    let node = pod["spec"]["nodeName"].as_str().unwrap_or("").to_string();
    if let Some(n) = w.nodes.get(&node) {
        let allocatable: u64 = n["status"]["allocatable"]["nvidia.com/gpu"]
            .as_str()
            .and_then(|q| q.parse().ok())
            .unwrap_or(0);
        let want = pod_gpus(&pod);
        let used = w.gpus_in_use(&node, &key);
        if want > 0 && used + want > allocatable {
            let mut rejected = pod.clone();
            rejected["status"] = json!({
                "phase": "Failed",
                "reason": "UnexpectedAdmissionError",
                "message": format!(
                    "Allocate failed due to requested number of devices unavailable for nvidia.com/gpu. Requested: {want}, Available: {}, which is unexpected",
                    allocatable.saturating_sub(used)
                ),
                "startTime": w.now_rfc3339()
            });
            w.put(&key, rejected);
        }
    }
    if fault == Some(CreateFault::PersistedButTimedOut) {
        return status(
            504,
            "Timeout",
            "Timeout: request did not complete within requested timeout - context deadline exceeded",
        );
    }
    (StatusCode::CREATED, Json(pod)).into_response()
}

async fn get_pod(
    State(world): State<Shared>,
    Path((ns, name)): Path<(String, String)>,
) -> Response {
    let mut w = world.lock().expect("world");
    w.requests.push(format!("GET pods {name}"));
    match w.pods.get(&format!("{ns}/{name}")) {
        Some(p) => Json(p.clone()).into_response(),
        None => status(404, "NotFound", &format!("pods \"{name}\" not found")),
    }
}

async fn delete_pod(
    State(world): State<Shared>,
    Path((ns, name)): Path<(String, String)>,
    Query(q): Query<BTreeMap<String, String>>,
    body: axum::body::Bytes,
) -> Response {
    // The grace period comes as a query parameter or in the DeleteOptions
    // body, as the real API server accepts both.
    let options: Value = serde_json::from_slice(&body).unwrap_or(Value::Null);
    let grace = q
        .get("gracePeriodSeconds")
        .cloned()
        .or_else(|| {
            options["gracePeriodSeconds"]
                .as_u64()
                .map(|g| g.to_string())
        })
        .unwrap_or_default();
    let mut w = world.lock().expect("world");
    w.requests.push(format!("DELETE pods {name} grace={grace}"));
    let key = format!("{ns}/{name}");
    let Some(mut pod) = w.pods.get(&key).cloned() else {
        return status(404, "NotFound", &format!("pods \"{name}\" not found"));
    };
    let phase = pod["status"]["phase"].as_str().unwrap_or("").to_string();
    if grace == "0" || matches!(phase.as_str(), "Succeeded" | "Failed") {
        // Force, or nothing runs: gone at once.
        let pod = w.remove(&key).unwrap_or(pod);
        return Json(pod).into_response();
    }
    if pod["metadata"]["deletionTimestamp"].is_null() {
        pod["metadata"]["deletionTimestamp"] = json!(w.now_rfc3339());
        pod["metadata"]["deletionGracePeriodSeconds"] = json!(grace.parse::<u64>().unwrap_or(30));
        w.put(&key, pod.clone());
    }
    let node = pod["spec"]["nodeName"].as_str().unwrap_or("").to_string();
    if !w.kubelet_gone.contains(&node) {
        w.confirm_deletion(&key);
    }
    Json(pod).into_response()
}

async fn pod_log(
    State(world): State<Shared>,
    Path((_ns, name)): Path<(String, String)>,
    Query(q): Query<BTreeMap<String, String>>,
) -> Response {
    let follow = q.get("follow").map(String::as_str) == Some("true");
    let timestamps = q.get("timestamps").map(String::as_str) == Some("true");
    let since_ns = q.get("sinceTime").and_then(|t| parse_since(t)).unwrap_or(0);
    let render = move |lines: &[LogLine]| -> Vec<u8> {
        let mut out = Vec::new();
        for (t, bytes) in lines.iter().filter(|(t, _)| *t >= since_ns) {
            if timestamps {
                out.extend_from_slice(rfc3339_nanos(*t).as_bytes());
                out.push(b' ');
            }
            out.extend_from_slice(bytes);
        }
        out
    };
    let generation = {
        let mut w = world.lock().expect("world");
        w.requests.push(format!(
            "LOG {name} follow={follow}{}",
            q.get("sinceTime")
                .map(|t| format!(" since={t}"))
                .unwrap_or_default()
        ));
        let Some(lines) = w.logs.get(&name) else {
            return status(404, "NotFound", &format!("pods \"{name}\" not found"));
        };
        if !follow {
            return render(lines).into_response();
        }
        w.log_generation.get(&name).copied().unwrap_or(0)
    };
    let (tx, rx) = tokio::sync::mpsc::channel::<Result<Vec<u8>, std::io::Error>>(64);
    tokio::spawn(async move {
        let mut sent = 0;
        loop {
            let (chunk, finished) = {
                let w = world.lock().expect("world");
                // The file rotated: the kubelet ends the follow.
                if w.log_generation.get(&name).copied().unwrap_or(0) != generation {
                    return;
                }
                let lines = w.logs.get(&name).cloned().unwrap_or_default();
                let phase = w
                    .key_of(&name)
                    .and_then(|k| w.pods.get(&k))
                    .and_then(|p| p["status"]["phase"].as_str().map(String::from))
                    .unwrap_or_else(|| "Gone".into());
                let from = sent.min(lines.len());
                (
                    render(&lines[from..]),
                    matches!(phase.as_str(), "Succeeded" | "Failed" | "Gone"),
                )
                    .pipe(|(c, f)| {
                        sent = lines.len();
                        (c, f)
                    })
            };
            if !chunk.is_empty() && tx.send(Ok(chunk)).await.is_err() {
                return;
            }
            if finished {
                return;
            }
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    });
    Response::builder()
        .header("content-type", "text/plain")
        .body(Body::from_stream(
            tokio_stream::wrappers::ReceiverStream::new(rx),
        ))
        .unwrap_or_else(|_| status(500, "InternalError", "body"))
}

trait Pipe: Sized {
    fn pipe<T>(self, f: impl FnOnce(Self) -> T) -> T {
        f(self)
    }
}
impl<T> Pipe for T {}

async fn create_service(
    State(world): State<Shared>,
    Path(ns): Path<String>,
    Json(mut svc): Json<Value>,
) -> Response {
    let mut w = world.lock().expect("world");
    let Some(name) = svc["metadata"]["name"].as_str().map(String::from) else {
        return status(422, "Invalid", "metadata.name: Required value");
    };
    w.requests.push(format!("POST services {name}"));
    if w.services.contains_key(&name) {
        return status(
            409,
            "AlreadyExists",
            &format!("services \"{name}\" already exists"),
        );
    }
    svc["apiVersion"] = json!("v1");
    svc["kind"] = json!("Service");
    svc["metadata"]["namespace"] = json!(ns);
    w.services.insert(name, svc.clone());
    (StatusCode::CREATED, Json(svc)).into_response()
}

async fn delete_service(
    State(world): State<Shared>,
    Path((_ns, name)): Path<(String, String)>,
) -> Response {
    let mut w = world.lock().expect("world");
    w.requests.push(format!("DELETE services {name}"));
    match w.services.remove(&name) {
        Some(svc) => Json(svc).into_response(),
        None => status(404, "NotFound", &format!("services \"{name}\" not found")),
    }
}

async fn create_secret(
    State(world): State<Shared>,
    Path(ns): Path<String>,
    Json(mut secret): Json<Value>,
) -> Response {
    let mut w = world.lock().expect("world");
    let Some(name) = secret["metadata"]["name"].as_str().map(String::from) else {
        return status(422, "Invalid", "metadata.name: Required value");
    };
    w.requests.push(format!("POST secrets {name}"));
    if w.secrets.contains_key(&name) {
        return status(
            409,
            "AlreadyExists",
            &format!("secrets \"{name}\" already exists"),
        );
    }
    // `stringData` is write-only: the API server keeps it in `data`
    // (base64 in JSON, as k8s-openapi's `ByteString` writes it).
    let Ok(mut typed) =
        serde_json::from_value::<k8s_openapi::api::core::v1::Secret>(secret.clone())
    else {
        return status(422, "Invalid", "not a Secret");
    };
    if let Some(strings) = typed.string_data.take() {
        let data = typed.data.get_or_insert_with(Default::default);
        for (k, v) in strings {
            data.insert(k, k8s_openapi::ByteString(v.into_bytes()));
        }
    }
    secret = serde_json::to_value(&typed).unwrap_or(secret);
    secret["apiVersion"] = json!("v1");
    secret["kind"] = json!("Secret");
    secret["metadata"]["namespace"] = json!(ns);
    w.secrets.insert(name, secret.clone());
    (StatusCode::CREATED, Json(secret)).into_response()
}

async fn delete_secret(
    State(world): State<Shared>,
    Path((_ns, name)): Path<(String, String)>,
) -> Response {
    let mut w = world.lock().expect("world");
    w.requests.push(format!("DELETE secrets {name}"));
    match w.secrets.remove(&name) {
        Some(secret) => Json(secret).into_response(),
        None => status(404, "NotFound", &format!("secrets \"{name}\" not found")),
    }
}

async fn list_nodes(State(world): State<Shared>) -> Response {
    let mut w = world.lock().expect("world");
    w.requests.push("LIST nodes".into());
    Json(json!({
        "kind": "NodeList", "apiVersion": "v1",
        "metadata": {"resourceVersion": w.resource_version.to_string()},
        "items": w.nodes.values().cloned().collect::<Vec<_>>()
    }))
    .into_response()
}

/// What a test node looks like beyond its GPUs and readiness.
#[derive(Debug, Clone, Default)]
pub struct NodeShape {
    /// Allocatable GPUs when fewer than the capacity (unhealthy devices).
    pub allocatable: Option<u32>,
    /// `key=value:Effect` taints.
    pub taints: Vec<(String, String, String)>,
    /// Cordoned.
    pub unschedulable: bool,
}

impl StandIn {
    pub async fn start() -> StandIn {
        let world: Shared = Arc::default();
        {
            let mut w = world.lock().expect("world");
            w.log_clock_ns = 20_420 * 86_400 * 1_000_000_000;
            // A real API server's versions never start at 0 ("any version"
            // to a watch): a list of the empty store is at a real one.
            w.resource_version = 1000;
        }
        let app = Router::new()
            .route("/api/v1/nodes", get(list_nodes))
            .route("/api/v1/pods", get(list_all_pods))
            .route(
                "/api/v1/namespaces/{ns}/pods",
                get(list_ns_pods).post(create_pod),
            )
            .route(
                "/api/v1/namespaces/{ns}/pods/{name}",
                get(get_pod).delete(delete_pod),
            )
            .route("/api/v1/namespaces/{ns}/pods/{name}/log", get(pod_log))
            .route(
                "/api/v1/namespaces/{ns}/services",
                axum::routing::post(create_service),
            )
            .route(
                "/api/v1/namespaces/{ns}/services/{name}",
                delete(delete_service),
            )
            .route(
                "/api/v1/namespaces/{ns}/secrets",
                axum::routing::post(create_secret),
            )
            .route(
                "/api/v1/namespaces/{ns}/secrets/{name}",
                delete(delete_secret),
            )
            .with_state(world.clone());
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
            .await
            .expect("bind");
        let url = format!("http://{}", listener.local_addr().expect("addr"));
        tokio::spawn(async move {
            let _ = axum::serve(listener, app).await;
        });
        StandIn { url, world }
    }

    /// A kube client for the stand-in, in namespace `ns`, built as Keel
    /// builds its own (without the client's retries).
    pub fn client(&self, ns: &str) -> kube::Client {
        let mut config = kube::Config::new(self.url.parse().expect("url"));
        config.default_namespace = ns.to_string();
        keel_executors::kubernetes::calls::client(config).expect("client")
    }

    /// Adds (or replaces) a Node with `gpus` GPUs of model `product`.
    pub fn add_node(&self, name: &str, gpus: u32, product: &str, ready: bool) {
        self.add_node_shaped(name, gpus, product, ready, NodeShape::default());
    }

    /// Adds (or replaces) a Node, shaped.
    pub fn add_node_shaped(
        &self,
        name: &str,
        gpus: u32,
        product: &str,
        ready: bool,
        shape: NodeShape,
    ) {
        let mut w = self.world.lock().expect("world");
        let rv = w.bump();
        let taints: Vec<Value> = shape
            .taints
            .iter()
            .map(|(k, v, e)| json!({"key": k, "value": v, "effect": e}))
            .collect();
        w.nodes.insert(
            name.to_string(),
            json!({
                "kind": "Node", "apiVersion": "v1",
                "metadata": {"name": name, "resourceVersion": rv.to_string(),
                    "labels": {"nvidia.com/gpu.product": product}},
                "spec": {"unschedulable": shape.unschedulable, "taints": taints},
                "status": {
                    "capacity": {"nvidia.com/gpu": gpus.to_string(), "cpu": "8"},
                    "allocatable": {"nvidia.com/gpu": shape.allocatable.unwrap_or(gpus).to_string(), "cpu": "8"},
                    "addresses": [{"type": "InternalIP", "address": format!("10.0.0.{}", 1 + name.len())}],
                    "conditions": [{"type": "Ready", "status": if ready { "True" } else { "False" },
                        "reason": if ready { "KubeletReady" } else { "KubeletNotReady" },
                        "message": if ready { "kubelet is posting ready status" } else { "container runtime is down" }}]
                }
            }),
        );
    }

    /// Another tenant's Pod, running on `node` in namespace `ns` with
    /// `gpus` GPUs.
    pub fn add_tenant_pod(&self, ns: &str, name: &str, node: &str, gpus: u32) {
        let mut w = self.world.lock().expect("world");
        let pod = json!({
            "kind": "Pod", "apiVersion": "v1",
            "metadata": {"name": name, "namespace": ns, "uid": format!("uid-{ns}-{name}"),
                "labels": {"app": "bert"}},
            "spec": {"nodeName": node, "containers": [{"name": "main", "image": "bert:1",
                "resources": {"limits": {"nvidia.com/gpu": gpus.to_string()}}}]},
            "status": {"phase": "Running"}
        });
        let pod = w.record("ADDED", pod);
        w.pods.insert(format!("{ns}/{name}"), pod);
    }

    /// Another tenant's Pod finished.
    pub fn finish_tenant_pod(&self, ns: &str, name: &str) {
        let mut w = self.world.lock().expect("world");
        let key = format!("{ns}/{name}");
        if let Some(mut pod) = w.pods.get(&key).cloned() {
            pod["status"]["phase"] = json!("Succeeded");
            w.put(&key, pod);
        }
    }

    /// The next pod creations' failures, in order.
    pub fn fail_creates(&self, faults: &[CreateFault]) {
        self.world.lock().expect("world").create_faults = faults.to_vec();
    }

    /// Refuses the next pod creations with these status codes, in order
    /// (503: try again; 403: a quota).
    pub fn refuse_creates(&self, codes: &[u16]) {
        let faults: Vec<CreateFault> = codes
            .iter()
            .map(|c| match c {
                403 => CreateFault::Forbidden,
                _ => CreateFault::Unavailable,
            })
            .collect();
        self.fail_creates(&faults);
    }

    /// Holds every create of pod `name` without an answer until
    /// [`StandIn::release_creates`].
    pub fn stall_creates(&self, name: &str) {
        self.world
            .lock()
            .expect("world")
            .stalled
            .insert(name.to_string());
    }

    pub fn release_creates(&self) {
        self.world.lock().expect("world").stalled.clear();
    }

    /// When the creates of pod `name` arrived.
    pub fn create_times(&self, name: &str) -> Vec<std::time::Instant> {
        self.world
            .lock()
            .expect("world")
            .create_times
            .iter()
            .filter(|(n, _)| n == name)
            .map(|(_, t)| *t)
            .collect()
    }

    /// How many creates are held without an answer now.
    pub fn stalled_now(&self) -> usize {
        self.world.lock().expect("world").stalled_now
    }

    /// The kubelet of `node` no longer confirms deletions (the node is cut
    /// off): its Pods stay Terminating.
    pub fn kubelet_gone(&self, node: &str) {
        self.world
            .lock()
            .expect("world")
            .kubelet_gone
            .insert(node.to_string());
    }

    /// The kubelet of `node` is back: it confirms what waits.
    pub fn kubelet_back(&self, node: &str) {
        let mut w = self.world.lock().expect("world");
        w.kubelet_gone.remove(node);
        let waiting: Vec<String> = w
            .pods
            .iter()
            .filter(|(_, p)| {
                !p["metadata"]["deletionTimestamp"].is_null()
                    && p["spec"]["nodeName"] == json!(node)
            })
            .map(|(k, _)| k.clone())
            .collect();
        for k in waiting {
            w.confirm_deletion(&k);
        }
    }

    /// Watches deliver changes in namespace `ns` late, until
    /// [`StandIn::catch_up_watches`].
    pub fn lag_watches_of(&self, ns: &str) {
        self.world
            .lock()
            .expect("world")
            .lagging
            .insert(ns.to_string());
    }

    pub fn catch_up_watches(&self) {
        self.world.lock().expect("world").lagging.clear();
    }

    /// Compacts the watch history: a watch resumed from any version seen
    /// so far gets 410 Expired.
    pub fn compact(&self) {
        let mut w = self.world.lock().expect("world");
        // As etcd's compaction: every version before the new current one
        // is gone; a list (and a watch from it) goes on from there.
        w.compacted = w.bump();
        w.events.clear();
    }

    /// Ends every open watch (an API server restart, a load balancer's
    /// idle timeout).
    pub fn end_watches(&self) {
        self.world.lock().expect("world").watch_generation += 1;
    }

    /// A Pod vanishes without the watch's help (removed while no watch
    /// is open): its DELETED event is compacted away.
    pub fn vanish(&self, name: &str) {
        let mut w = self.world.lock().expect("world");
        if let Some(k) = w.key_of(name) {
            w.pods.remove(&k);
            w.bump();
        }
    }

    pub fn pod(&self, name: &str) -> Option<Value> {
        let w = self.world.lock().expect("world");
        w.key_of(name).and_then(|k| w.pods.get(&k).cloned())
    }

    pub fn pod_names(&self) -> Vec<String> {
        self.world
            .lock()
            .expect("world")
            .pods
            .keys()
            .filter_map(|k| k.rsplit('/').next().map(String::from))
            .collect()
    }

    pub fn service(&self, name: &str) -> Option<Value> {
        self.world
            .lock()
            .expect("world")
            .services
            .get(name)
            .cloned()
    }

    /// The (scope, resource, RBAC verb) of every request seen: scope
    /// `cluster` for Nodes and requests across namespaces, else
    /// `namespace`.
    pub fn rbac_uses(&self) -> std::collections::BTreeSet<(String, String, String)> {
        self.requests()
            .iter()
            .filter_map(|r| {
                let mut words = r.split(' ');
                let (verb, resource) = (words.next()?, words.next().unwrap_or(""));
                let target = words.next().unwrap_or("");
                let scope = if resource == "nodes" || target == "*" {
                    "cluster"
                } else {
                    "namespace"
                };
                let (resource, verb) = match verb {
                    "WATCH" => (resource, "watch"),
                    "LIST" => (resource, "list"),
                    "GET" => (resource, "get"),
                    "POST" => (resource, "create"),
                    "DELETE" => (resource, "delete"),
                    "LOG" => ("pods/log", "get"),
                    _ => return None,
                };
                Some((scope.to_string(), resource.to_string(), verb.to_string()))
            })
            .collect()
    }

    /// Secret `name` as the API server keeps it (`data`, base64).
    pub fn secret(&self, name: &str) -> Option<Value> {
        self.world.lock().expect("world").secrets.get(name).cloned()
    }

    pub fn requests(&self) -> Vec<String> {
        self.world.lock().expect("world").requests.clone()
    }

    fn update(&self, name: &str, status: Value) {
        let mut w = self.world.lock().expect("world");
        let Some(key) = w.key_of(name) else {
            panic!("no pod {name}");
        };
        let Some(mut pod) = w.pods.get(&key).cloned() else {
            panic!("no pod {name}");
        };
        pod["status"] = status;
        w.put(&key, pod);
    }

    /// The kubelet started the container.
    pub fn run(&self, name: &str) {
        self.update(
            name,
            json!({"phase": "Running", "containerStatuses": [{"name": "worker", "ready": true,
                "restartCount": 0, "image": "", "imageID": "",
                "state": {"running": {"startedAt": "2026-11-26T00:00:00Z"}}}]}),
        );
    }

    /// The container exited with `code`.
    pub fn exit(&self, name: &str, code: i32) {
        self.exit_with_message(name, code, None);
    }

    /// The container exited with `code` and a termination message (what it
    /// wrote to `/dev/termination-log`, up to 4 KiB).
    pub fn exit_with_message(&self, name: &str, code: i32, message: Option<&str>) {
        self.update(
            name,
            json!({"phase": if code == 0 { "Succeeded" } else { "Failed" },
                "containerStatuses": [{"name": "worker", "ready": false, "restartCount": 0,
                "image": "", "imageID": "",
                "state": {"terminated": {"exitCode": code, "message": message,
                    "reason": if code == 0 { "Completed" } else { "Error" }}}}]}),
        );
    }

    /// The kernel killed the container for going over its memory limit:
    /// as the kubelet reports it (`OOMKilled`, exit code 137). Only a
    /// container with a memory limit is killed so (panics otherwise: the
    /// test asked for what a cluster does not do).
    pub fn oom_kill(&self, name: &str) {
        let limited = self.pod(name).is_some_and(|p| {
            !p["spec"]["containers"][0]["resources"]["limits"]["memory"].is_null()
        });
        assert!(limited, "{name} has no memory limit to go over");
        self.update(
            name,
            json!({"phase": "Failed",
                "containerStatuses": [{"name": "worker", "ready": false, "restartCount": 0,
                "image": "", "imageID": "",
                "state": {"terminated": {"exitCode": 137, "reason": "OOMKilled"}}}]}),
        );
    }

    /// The container is waiting, e.g. `ErrImagePull`.
    pub fn wait(&self, name: &str, reason: &str, message: &str) {
        self.update(
            name,
            json!({"phase": "Pending", "containerStatuses": [{"name": "worker", "ready": false,
                "restartCount": 0, "image": "", "imageID": "",
                "state": {"waiting": {"reason": reason, "message": message}}}]}),
        );
    }

    /// The container writes `text` to its log.
    pub fn log(&self, name: &str, text: &str) {
        self.log_bytes(name, text.as_bytes());
    }

    /// The container writes `bytes` (any bytes) to its log: one entry per
    /// line, each 250 ms after the last (so lines share seconds).
    pub fn log_bytes(&self, name: &str, bytes: &[u8]) {
        let mut w = self.world.lock().expect("world");
        for line in bytes.split_inclusive(|b| *b == b'\n') {
            w.log_clock_ns += 250_000_000;
            let t = w.log_clock_ns;
            w.logs
                .entry(name.to_string())
                .or_default()
                .push((t, line.to_vec()));
        }
    }

    /// The kubelet rotates the container's log file: follows end, and what
    /// was written before is no longer served.
    pub fn rotate_log(&self, name: &str) {
        let mut w = self.world.lock().expect("world");
        w.logs.insert(name.to_string(), Vec::new());
        *w.log_generation.entry(name.to_string()).or_default() += 1;
    }
}
