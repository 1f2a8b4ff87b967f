//! A stand-in for a Kubernetes API server, for the Kubernetes executor's
//! tests: the real paths and object shapes of the core/v1 API that the
//! executor uses (Pods: create, list, watch, get logs, delete; Services:
//! create, delete; Nodes: list), with resource versions and watch streams
//! of `ADDED`/`MODIFIED`/`DELETED` events, and a handle through which the
//! test plays the kubelet: it moves Pods through their phases, writes their
//! logs, and makes Nodes ready or not.
//!
//! Deleting a Pod behaves like a kubelet with a container that exits on
//! SIGTERM: the Pod is marked terminated (exit 143), then removed.

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

#[derive(Debug, Default)]
struct World {
    resource_version: u64,
    pods: BTreeMap<String, Value>,
    logs: BTreeMap<String, String>,
    services: BTreeMap<String, Value>,
    nodes: BTreeMap<String, Value>,
    /// Every Pod change: (resource version, type, object).
    events: Vec<(u64, &'static str, Value)>,
    /// The next pod creations to refuse, with this status code.
    refuse_creates: Vec<u16>,
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
}

/// The stand-in's address and the test's handle on it.
#[derive(Debug, Clone)]
pub struct StandIn {
    pub url: String,
    world: Arc<Mutex<World>>,
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
    Path(ns): Path<String>,
    Query(q): Query<BTreeMap<String, String>>,
) -> Response {
    let selector = q.get("labelSelector").cloned();
    if q.get("watch").map(String::as_str) == Some("true") {
        let from: u64 = q
            .get("resourceVersion")
            .and_then(|v| v.parse().ok())
            .unwrap_or(0);
        let timeout_s: u64 = q
            .get("timeoutSeconds")
            .and_then(|v| v.parse().ok())
            .unwrap_or(290)
            .min(30);
        world
            .lock()
            .expect("world")
            .requests
            .push(format!("WATCH pods {ns}"));
        let (tx, rx) = tokio::sync::mpsc::channel::<Result<String, std::io::Error>>(64);
        tokio::spawn(async move {
            let mut seen = from;
            let deadline = tokio::time::Instant::now() + Duration::from_secs(timeout_s);
            while tokio::time::Instant::now() < deadline {
                let batch: Vec<String> = {
                    let w = world.lock().expect("world");
                    let after = seen;
                    let mut out = Vec::new();
                    for (rv, kind, pod) in &w.events {
                        if *rv > after
                            && pod["metadata"]["namespace"] == json!(ns)
                            && matches(selector.as_ref(), &pod["metadata"]["labels"])
                        {
                            seen = seen.max(*rv);
                            out.push(format!("{}\n", json!({"type": kind, "object": pod})));
                        }
                    }
                    out
                };
                for line in batch {
                    if tx.send(Ok(line)).await.is_err() {
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
    w.requests.push(format!("LIST pods {ns}"));
    let items: Vec<Value> = w
        .pods
        .values()
        .filter(|p| {
            p["metadata"]["namespace"] == json!(ns)
                && matches(selector.as_ref(), &p["metadata"]["labels"])
        })
        .cloned()
        .collect();
    Json(json!({
        "kind": "PodList", "apiVersion": "v1",
        "metadata": {"resourceVersion": w.resource_version.to_string()},
        "items": items
    }))
    .into_response()
}

async fn create_pod(
    State(world): State<Shared>,
    Path(ns): Path<String>,
    Json(mut pod): Json<Value>,
) -> Response {
    let mut w = world.lock().expect("world");
    let Some(name) = pod["metadata"]["name"].as_str().map(String::from) else {
        return status(422, "Invalid", "metadata.name: Required value");
    };
    w.requests.push(format!("POST pods {name}"));
    if !w.refuse_creates.is_empty() {
        let code = w.refuse_creates.remove(0);
        return match code {
            403 => status(
                403,
                "Forbidden",
                &format!("pods \"{name}\" is forbidden: exceeded quota: gpu-quota"),
            ),
            _ => status(code, "ServiceUnavailable", "etcdserver: request timed out"),
        };
    }
    if w.pods.contains_key(&name) {
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
    w.pods.insert(name.clone(), pod.clone());
    w.logs.entry(name).or_default();
    (StatusCode::CREATED, Json(pod)).into_response()
}

async fn delete_pod(
    State(world): State<Shared>,
    Path((_ns, name)): Path<(String, String)>,
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
    let Some(mut pod) = w.pods.remove(&name) else {
        return status(404, "NotFound", &format!("pods \"{name}\" not found"));
    };
    let phase = pod["status"]["phase"].as_str().unwrap_or("").to_string();
    if phase == "Running" || phase == "Pending" {
        // The kubelet's SIGTERM: the container exits 143.
        pod["status"] = json!({
            "phase": "Failed",
            "containerStatuses": [{"name": "worker", "ready": false, "restartCount": 0,
                "image": "", "imageID": "",
                "state": {"terminated": {"exitCode": 143, "reason": "Error"}}}]
        });
        pod = w.record("MODIFIED", pod);
    }
    let pod = w.record("DELETED", pod);
    Json(pod).into_response()
}

async fn pod_log(
    State(world): State<Shared>,
    Path((_ns, name)): Path<(String, String)>,
    Query(q): Query<BTreeMap<String, String>>,
) -> Response {
    let follow = q.get("follow").map(String::as_str) == Some("true");
    {
        let mut w = world.lock().expect("world");
        w.requests.push(format!("LOG {name} follow={follow}"));
        if !w.logs.contains_key(&name) {
            return status(404, "NotFound", &format!("pods \"{name}\" not found"));
        }
        if !follow {
            let text = w.logs.get(&name).cloned().unwrap_or_default();
            return text.into_response();
        }
    }
    let (tx, rx) = tokio::sync::mpsc::channel::<Result<String, std::io::Error>>(64);
    tokio::spawn(async move {
        let mut sent = 0;
        loop {
            let (chunk, finished) = {
                let w = world.lock().expect("world");
                let text = w.logs.get(&name).cloned().unwrap_or_default();
                let phase = w
                    .pods
                    .get(&name)
                    .and_then(|p| p["status"]["phase"].as_str().map(String::from))
                    .unwrap_or_else(|| "Gone".into());
                (
                    text[sent.min(text.len())..].to_string(),
                    matches!(phase.as_str(), "Succeeded" | "Failed" | "Gone"),
                )
            };
            sent += chunk.len();
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

impl StandIn {
    pub async fn start() -> StandIn {
        let world: Shared = Arc::default();
        let app = Router::new()
            .route("/api/v1/nodes", get(list_nodes))
            .route(
                "/api/v1/namespaces/{ns}/pods",
                get(list_or_watch_pods).post(create_pod),
            )
            .route("/api/v1/namespaces/{ns}/pods/{name}", delete(delete_pod))
            .route("/api/v1/namespaces/{ns}/pods/{name}/log", get(pod_log))
            .route(
                "/api/v1/namespaces/{ns}/services",
                axum::routing::post(create_service),
            )
            .route(
                "/api/v1/namespaces/{ns}/services/{name}",
                delete(delete_service),
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

    /// A kube client for the stand-in, in namespace `ns`.
    pub fn client(&self, ns: &str) -> kube::Client {
        let mut config = kube::Config::new(self.url.parse().expect("url"));
        config.default_namespace = ns.to_string();
        kube::Client::try_from(config).expect("client")
    }

    /// Adds (or replaces) a Node with `gpus` GPUs of model `product`.
    pub fn add_node(&self, name: &str, gpus: u32, product: &str, ready: bool) {
        let mut w = self.world.lock().expect("world");
        let rv = w.bump();
        w.nodes.insert(
            name.to_string(),
            json!({
                "kind": "Node", "apiVersion": "v1",
                "metadata": {"name": name, "resourceVersion": rv.to_string(),
                    "labels": {"nvidia.com/gpu.product": product}},
                "status": {
                    "capacity": {"nvidia.com/gpu": gpus.to_string(), "cpu": "8"},
                    "addresses": [{"type": "InternalIP", "address": format!("10.0.0.{}", 1 + name.len())}],
                    "conditions": [{"type": "Ready", "status": if ready { "True" } else { "False" },
                        "reason": if ready { "KubeletReady" } else { "KubeletNotReady" },
                        "message": if ready { "kubelet is posting ready status" } else { "container runtime is down" }}]
                }
            }),
        );
    }

    /// Refuses the next pod creations with these status codes, in order
    /// (503: try again; 403: a quota).
    pub fn refuse_creates(&self, codes: &[u16]) {
        self.world.lock().expect("world").refuse_creates = codes.to_vec();
    }

    pub fn pod(&self, name: &str) -> Option<Value> {
        self.world.lock().expect("world").pods.get(name).cloned()
    }

    pub fn pod_names(&self) -> Vec<String> {
        self.world
            .lock()
            .expect("world")
            .pods
            .keys()
            .cloned()
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

    /// The (resource, RBAC verb) pairs of every request seen.
    pub fn rbac_uses(&self) -> std::collections::BTreeSet<(String, String)> {
        self.requests()
            .iter()
            .filter_map(|r| {
                let mut words = r.split(' ');
                let (verb, resource) = (words.next()?, words.next().unwrap_or(""));
                Some(match verb {
                    "WATCH" => (resource.to_string(), "watch".to_string()),
                    "LIST" => (resource.to_string(), "list".to_string()),
                    "POST" => (resource.to_string(), "create".to_string()),
                    "DELETE" => (resource.to_string(), "delete".to_string()),
                    "LOG" => ("pods/log".to_string(), "get".to_string()),
                    _ => return None,
                })
            })
            .collect()
    }

    pub fn requests(&self) -> Vec<String> {
        self.world.lock().expect("world").requests.clone()
    }

    fn update(&self, name: &str, status: Value) {
        let mut w = self.world.lock().expect("world");
        let Some(mut pod) = w.pods.get(name).cloned() else {
            panic!("no pod {name}");
        };
        pod["status"] = status;
        let pod = w.record("MODIFIED", pod);
        w.pods.insert(name.to_string(), pod);
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
        self.update(
            name,
            json!({"phase": if code == 0 { "Succeeded" } else { "Failed" },
                "containerStatuses": [{"name": "worker", "ready": false, "restartCount": 0,
                "image": "", "imageID": "",
                "state": {"terminated": {"exitCode": code,
                    "reason": if code == 0 { "Completed" } else { "Error" }}}}]}),
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
        let mut w = self.world.lock().expect("world");
        w.logs.entry(name.to_string()).or_default().push_str(text);
    }
}
