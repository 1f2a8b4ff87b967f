//! Access control on real processes over mutual TLS (issue 22, item 2):
//! every RPC of the API called by every role, by a certificate alone, and
//! with tokens that are revoked, expired, another cluster's or malformed;
//! each cell of the matrix is written out below, not derived from the
//! server's own table.

mod support;

use std::collections::BTreeMap;
use std::path::Path;

use keel_proto::api::{self, keel_client::KeelClient};
use support::{init_certs, tls_client, tls_env, tls_member_flags, ServerProcess};
use tonic::transport::Channel;

/// Member 1 over TLS, with ACLs.
fn start(dir: &Path, certs: &Path) -> ServerProcess {
    // A key for secrets (issue 35), in a file beside the data directory.
    let key = dir.with_extension("key");
    let made = std::process::Command::new(support::KEEL)
        .args(["secret", "new-key"])
        .output()
        .expect("keel secret new-key");
    std::fs::write(&key, &made.stdout).expect("key file");
    let mut flags = vec![
        "--acl".to_string(),
        "--no-local-node".to_string(),
        "--secret-key-file".to_string(),
        key.display().to_string(),
    ];
    flags.extend(tls_member_flags(certs, 1));
    let args: Vec<&str> = flags.iter().map(String::as_str).collect();
    ServerProcess::start_with_client_env(dir, &args, &[], &tls_env(certs, "client-admin"))
}

/// Adds the caller's `authorization` metadata to each request.
type AddToken =
    Box<dyn FnMut(tonic::Request<()>) -> Result<tonic::Request<()>, tonic::Status> + Send>;

type Client = KeelClient<tonic::service::interceptor::InterceptedService<Channel, AddToken>>;

/// A client with the `admin` client certificate and, if given, the
/// `authorization` metadata `header`.
async fn client(certs: &Path, addr: &str, header: Option<String>) -> Client {
    let transport = tls_client(certs, "client-admin");
    let endpoint = transport.endpoint(addr).expect("endpoint");
    let channel = transport
        .connect(endpoint, keel::transport::Peer::Address(addr))
        .await
        .expect("connect");
    let header = header.map(|h| {
        h.parse::<tonic::metadata::MetadataValue<tonic::metadata::Ascii>>()
            .expect("ascii")
    });
    let add: AddToken = Box::new(move |mut request: tonic::Request<()>| {
        if let Some(h) = &header {
            request.metadata_mut().insert("authorization", h.clone());
        }
        Ok(request)
    });
    KeelClient::with_interceptor(channel, add)
}

/// A submission of a small job named `name`.
fn submission(name: &str) -> api::SubmitJobRequest {
    api::SubmitJobRequest {
        spec: Some(keel_state::codec::spec_to_proto(
            &keel_state::fixtures::job_spec(name, 1, 1),
        )),
        request_id: String::new(),
    }
}

fn secret(name: &str) -> String {
    format!("test-secret-for-{name}-0123456789abcdefghijklmnop")
}

fn bearer(secret: &str) -> Option<String> {
    Some(format!("Bearer {secret}"))
}

/// How a call came out, as far as access goes.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
enum Access {
    /// Let through (it may still have failed for another reason: a job
    /// that ended, a member that does not exist...).
    Allowed,
    Denied,
    Unauthenticated,
}

fn access<T>(result: Result<tonic::Response<T>, tonic::Status>) -> Access {
    match result {
        Ok(_) => Access::Allowed,
        Err(s) if s.code() == tonic::Code::PermissionDenied => {
            assert_eq!(
                keel::grpc_status::reason_of(&s).as_deref(),
                Some("PERMISSION_DENIED")
            );
            assert!(s.message().contains("needs role"), "{}", s.message());
            Access::Denied
        }
        Err(s) if s.code() == tonic::Code::Unauthenticated => {
            assert_eq!(
                keel::grpc_status::reason_of(&s).as_deref(),
                Some("UNAUTHENTICATED")
            );
            Access::Unauthenticated
        }
        Err(_) => Access::Allowed,
    }
}

const RPCS: [&str; 29] = [
    "SubmitJob",
    "CancelJob",
    "GetJob",
    "ListJobs",
    "ListNodes",
    "WatchEvents",
    "ClusterStatus",
    "JobHistory",
    "GetLogs",
    "SetNodeState",
    "RemoveNode",
    "SetPolicy",
    "NodeHeartbeat",
    "AddMember",
    "RemoveMember",
    "BootstrapAcl",
    "CreateToken",
    "ListTokens",
    "RevokeToken",
    "WhoAmI",
    "CreateQueue",
    "UpdateQueue",
    "DeleteQueue",
    "ListQueues",
    "SaveSnapshot",
    "PutSecret",
    "DeleteSecret",
    "ListSecrets",
    "RotateSecretKey",
];

/// Calls `rpc` with a request that changes nothing that matters (or
/// nothing at all: a node that does not exist, an invalid role...), about
/// job `job` where it concerns one.
async fn call(client: &mut Client, rpc: &str, job: u64) -> Access {
    match rpc {
        "SubmitJob" => access(client.submit_job(submission("matrix")).await),
        "CancelJob" => access(
            client
                .cancel_job(api::CancelJobRequest {
                    job_id: job,
                    reason: "matrix".into(),
                    request_id: String::new(),
                })
                .await,
        ),
        "GetJob" => access(client.get_job(api::GetJobRequest { job_id: job }).await),
        "ListJobs" => access(client.list_jobs(api::ListJobsRequest::default()).await),
        "ListNodes" => access(client.list_nodes(api::ListNodesRequest::default()).await),
        "WatchEvents" => access(
            client
                .watch_events(api::WatchEventsRequest {
                    from_index: 0,
                    follow: false,
                })
                .await,
        ),
        "ClusterStatus" => access(client.cluster_status(api::ClusterStatusRequest {}).await),
        "JobHistory" => access(
            client
                .job_history(api::JobHistoryRequest {
                    job_id: job,
                    limit: 1,
                })
                .await,
        ),
        "GetLogs" => access(
            client
                .get_logs(api::GetLogsRequest {
                    job_id: job,
                    tail_bytes: 16,
                })
                .await,
        ),
        "SetNodeState" => access(
            client
                .set_node_state(api::SetNodeStateRequest {
                    name: "no-such-node".into(),
                    state: "lost".into(),
                    ..Default::default()
                })
                .await,
        ),
        "RemoveNode" => access(
            client
                .remove_node(api::RemoveNodeRequest {
                    name: "no-such-node".into(),
                    ..Default::default()
                })
                .await,
        ),
        "SetPolicy" => access(
            client
                .set_policy(api::SetPolicyRequest {
                    name: "fifo".into(),
                    request_id: String::new(),
                })
                .await,
        ),
        "NodeHeartbeat" => access(
            client
                .node_heartbeat(api::NodeHeartbeatRequest::default())
                .await,
        ),
        "AddMember" => access(
            client
                .add_member(api::AddMemberRequest {
                    id: 0,
                    ..Default::default()
                })
                .await,
        ),
        "RemoveMember" => access(
            client
                .remove_member(api::RemoveMemberRequest { id: 99 })
                .await,
        ),
        "BootstrapAcl" => access(
            client
                .bootstrap_acl(api::BootstrapAclRequest::default())
                .await,
        ),
        "CreateToken" => access(
            client
                .create_token(api::CreateTokenRequest {
                    name: "never".into(),
                    role: "no-such-role".into(),
                    ..Default::default()
                })
                .await,
        ),
        "ListTokens" => access(client.list_tokens(api::ListTokensRequest {}).await),
        "RevokeToken" => access(
            client
                .revoke_token(api::RevokeTokenRequest {
                    name: "no-such-token".into(),
                    request_id: String::new(),
                })
                .await,
        ),
        "WhoAmI" => access(client.who_am_i(api::WhoAmIRequest {}).await),
        // A quota of a GPU type the cluster does not have: refused once
        // allowed.
        "CreateQueue" => access(
            client
                .create_queue(api::CreateQueueRequest {
                    name: "matrix".into(),
                    spec: Some(unknown_quota()),
                    request_id: String::new(),
                })
                .await,
        ),
        "UpdateQueue" => access(
            client
                .update_queue(api::UpdateQueueRequest {
                    name: "default".into(),
                    spec: Some(unknown_quota()),
                    request_id: String::new(),
                })
                .await,
        ),
        "DeleteQueue" => access(
            client
                .delete_queue(api::DeleteQueueRequest {
                    name: "no-such-queue".into(),
                    request_id: String::new(),
                })
                .await,
        ),
        "ListQueues" => access(client.list_queues(api::ListQueuesRequest {}).await),
        "SaveSnapshot" => access(client.save_snapshot(api::SaveSnapshotRequest {}).await),
        // No values: refused once allowed.
        "PutSecret" => access(
            client
                .put_secret(api::PutSecretRequest {
                    name: "matrix".into(),
                    ..Default::default()
                })
                .await,
        ),
        "DeleteSecret" => access(
            client
                .delete_secret(api::DeleteSecretRequest {
                    name: "no-such-secret".into(),
                    request_id: String::new(),
                })
                .await,
        ),
        "ListSecrets" => access(client.list_secrets(api::ListSecretsRequest {}).await),
        // Nothing to re-seal: allowed changes nothing.
        "RotateSecretKey" => access(
            client
                .rotate_secret_key(api::RotateSecretKeyRequest {})
                .await,
        ),
        other => unreachable!("{other}"),
    }
}

/// A queue spec whose quota names a GPU type no cluster here has.
fn unknown_quota() -> keel_proto::entry::QueueSpec {
    keel_proto::entry::QueueSpec {
        quota: Some(keel_proto::entry::GpuCounts {
            gpus: [("no-such-type".to_string(), 1)].into(),
        }),
        weight: 1,
        ..Default::default()
    }
}

/// Every RPC but those named, for the matrix's rows.
fn all_but(but: &[&str]) -> Vec<&'static str> {
    RPCS.into_iter().filter(|r| !but.contains(r)).collect()
}

#[test]
fn every_rpc_is_allowed_or_refused_as_the_callers_role_says_over_tls() {
    let dir = tempfile::tempdir().expect("tempdir");
    let certs = init_certs(dir.path());
    let server = start(&dir.path().join("one"), &certs);
    let other = start(&dir.path().join("other"), &certs);
    let runtime = tokio::runtime::Runtime::new().expect("runtime");
    runtime.block_on(async {
        let addr = server.addr.as_str();
        // Before the bootstrap a certificate holder is a user.
        let mut cert_only = client(&certs, addr, None).await;
        let who = cert_only
            .who_am_i(api::WhoAmIRequest {})
            .await
            .expect("whoami")
            .into_inner();
        assert_eq!(
            (who.acl, who.actor.as_str(), who.role.as_str()),
            (true, "cert:admin", "user")
        );
        let root = cert_only
            .bootstrap_acl(api::BootstrapAclRequest {
                name: "root".into(),
                secret: secret("root"),
                request_id: "bootstrap-1".into(),
            })
            .await
            .expect("bootstrap")
            .into_inner();
        assert_eq!(
            (root.role.as_str(), root.secret.as_str()),
            ("admin", secret("root").as_str())
        );
        // Another cluster's own root token.
        let mut other_client = client(&certs, &other.addr, None).await;
        other_client
            .bootstrap_acl(api::BootstrapAclRequest {
                name: "root".into(),
                secret: secret("other-root"),
                request_id: String::new(),
            })
            .await
            .expect("the other cluster's bootstrap");

        let mut admin = client(&certs, addr, bearer(&secret("root"))).await;
        for (name, role, ttl_s) in [
            ("operator", "operator", 0),
            ("alice", "user", 0),
            ("bob", "user", 0),
            ("viewer", "viewer", 0),
            ("node", "node", 0),
            ("revoked", "admin", 0),
            ("expired", "admin", 1),
        ] {
            let made = admin
                .create_token(api::CreateTokenRequest {
                    name: name.into(),
                    role: role.into(),
                    ttl_s,
                    secret: secret(name),
                    request_id: format!("create-{name}"),
                    queues: Vec::new(),
                })
                .await
                .unwrap_or_else(|e| panic!("create {name}: {e}"))
                .into_inner();
            assert_eq!(made.secret, secret(name));
        }
        admin
            .revoke_token(api::RevokeTokenRequest {
                name: "revoked".into(),
                request_id: String::new(),
            })
            .await
            .expect("revoke");
        // The expired token expires (a second after it was made).
        let mut expired = client(&certs, addr, bearer(&secret("expired"))).await;
        let mut tries = 0;
        while access(expired.who_am_i(api::WhoAmIRequest {}).await) != Access::Unauthenticated {
            tries += 1;
            assert!(tries < 300, "the token with a 1 s TTL never expired");
            tokio::time::sleep(std::time::Duration::from_millis(100)).await;
        }

        // Alice's job, which the per-job calls are about.
        let mut alice = client(&certs, addr, bearer(&secret("alice"))).await;
        let job = alice
            .submit_job(submission("alices"))
            .await
            .expect("alice submits")
            .into_inner()
            .job_id;
        let submitter = admin
            .get_job(api::GetJobRequest { job_id: job })
            .await
            .expect("admin reads it")
            .into_inner()
            .submitted_by;
        assert_eq!(
            submitter, "token:alice",
            "the entry records the token's name"
        );

        let reads_own = ["GetJob", "JobHistory", "GetLogs"];
        let user_rights = [
            "SubmitJob",
            "ListJobs",
            "ClusterStatus",
            "ListQueues",
            "BootstrapAcl",
            "WhoAmI",
            // Their own secrets (issue 35); re-sealing every one is an
            // admin's.
            "PutSecret",
            "DeleteSecret",
            "ListSecrets",
        ];
        let alices: Vec<&str> = user_rights
            .iter()
            .chain(&reads_own)
            .chain(&["CancelJob"])
            .copied()
            .collect();
        let expected: Vec<(&str, Option<String>, Vec<&str>)> = vec![
            (
                "admin",
                bearer(&secret("root")),
                all_but(&["NodeHeartbeat"]),
            ),
            (
                "operator",
                bearer(&secret("operator")),
                vec![
                    "SubmitJob",
                    "CancelJob",
                    "GetJob",
                    "ListJobs",
                    "ListNodes",
                    "WatchEvents",
                    "ClusterStatus",
                    "JobHistory",
                    "GetLogs",
                    "SetNodeState",
                    "RemoveNode",
                    "BootstrapAcl",
                    "WhoAmI",
                    "ListQueues",
                ],
            ),
            (
                "bob (another user)",
                bearer(&secret("bob")),
                user_rights.to_vec(),
            ),
            ("a certificate alone", None, user_rights.to_vec()),
            (
                "viewer",
                bearer(&secret("viewer")),
                vec![
                    "GetJob",
                    "ListJobs",
                    "ListNodes",
                    "WatchEvents",
                    "ClusterStatus",
                    "JobHistory",
                    "GetLogs",
                    "BootstrapAcl",
                    "WhoAmI",
                    "ListQueues",
                ],
            ),
            (
                "node",
                bearer(&secret("node")),
                vec![
                    "ClusterStatus",
                    "NodeHeartbeat",
                    "BootstrapAcl",
                    "WhoAmI",
                    "ListQueues",
                ],
            ),
            // Last: alice cancels her own job.
            ("alice (the job's owner)", bearer(&secret("alice")), alices),
        ];
        let unknown: Vec<(&str, Option<String>)> = vec![
            ("a revoked token", bearer(&secret("revoked"))),
            ("an expired token", bearer(&secret("expired"))),
            ("another cluster's token", bearer(&secret("other-root"))),
            ("a token never made", bearer(&secret("nobody"))),
            ("a malformed header", Some("Basic dXNlcjpwYXNz".into())),
        ];

        let mut seen: BTreeMap<(String, &str), Access> = BTreeMap::new();
        let mut want: BTreeMap<(String, &str), Access> = BTreeMap::new();
        for (who, header, allowed) in &expected {
            let mut c = client(&certs, addr, header.clone()).await;
            for rpc in RPCS {
                seen.insert((who.to_string(), rpc), call(&mut c, rpc, job).await);
                let cell = if allowed.contains(&rpc) {
                    Access::Allowed
                } else {
                    Access::Denied
                };
                want.insert((who.to_string(), rpc), cell);
            }
        }
        for (who, header) in &unknown {
            let mut c = client(&certs, addr, header.clone()).await;
            for rpc in RPCS {
                seen.insert((who.to_string(), rpc), call(&mut c, rpc, job).await);
                want.insert((who.to_string(), rpc), Access::Unauthenticated);
            }
        }
        let wrong: Vec<String> = want
            .iter()
            .filter(|(cell, a)| seen.get(cell) != Some(a))
            .map(|((who, rpc), a)| {
                format!(
                    "{who} × {rpc}: wanted {a:?}, got {:?}",
                    seen[&(who.clone(), *rpc)]
                )
            })
            .collect();
        assert!(
            wrong.is_empty(),
            "cells of the matrix that differ:\n{}",
            wrong.join("\n")
        );

        // A user lists its own jobs only.
        let mut bob = client(&certs, addr, bearer(&secret("bob"))).await;
        let bobs: Vec<u64> = bob
            .list_jobs(api::ListJobsRequest::default())
            .await
            .expect("bob lists")
            .into_inner()
            .jobs
            .iter()
            .map(|j| j.id)
            .collect();
        assert!(!bobs.is_empty() && !bobs.contains(&job), "{bobs:?}");
        let every: usize = admin
            .list_jobs(api::ListJobsRequest::default())
            .await
            .expect("admin lists")
            .into_inner()
            .jobs
            .len();
        assert!(every > bobs.len());
        // Secrets (issue 35): a user manages its own, and only its own
        // jobs (or its queue's) use them.
        let put = |name: &str| api::PutSecretRequest {
            name: name.into(),
            values: [("k".to_string(), b"alice's value".to_vec())].into(),
            queue: String::new(),
            request_id: String::new(),
        };
        alice.put_secret(put("alices")).await.expect("alice puts");
        for refused in [
            bob.put_secret(put("alices")).await.map(|_| ()),
            bob.delete_secret(api::DeleteSecretRequest {
                name: "alices".into(),
                request_id: String::new(),
            })
            .await
            .map(|_| ()),
        ] {
            let e = refused.expect_err("bob may not touch alice's secret");
            assert_eq!(e.code(), tonic::Code::PermissionDenied, "{e:?}");
            assert!(e.message().contains("token:alice"), "{}", e.message());
        }
        let listed = |r: api::ListSecretsResponse| -> Vec<(String, String)> {
            r.secrets.into_iter().map(|s| (s.name, s.owner)).collect()
        };
        let bobs_list = bob
            .list_secrets(api::ListSecretsRequest {})
            .await
            .expect("bob lists")
            .into_inner();
        assert_eq!(listed(bobs_list), vec![]);
        let every_secret = admin
            .list_secrets(api::ListSecretsRequest {})
            .await
            .expect("admin lists")
            .into_inner();
        assert_eq!(
            listed(every_secret),
            vec![("alices".to_string(), "token:alice".to_string())]
        );
        let mut uses = submission("uses-alices");
        if let Some(spec) = uses.spec.as_mut() {
            spec.secret_env.insert("K".into(), "alices/k".into());
        }
        let e = bob
            .submit_job(uses.clone())
            .await
            .expect_err("bob's job may not use alice's secret");
        assert_eq!(e.code(), tonic::Code::PermissionDenied, "{e:?}");
        assert!(e.message().contains("env.K"), "{}", e.message());
        alice.submit_job(uses).await.expect("alice's job may");
        // A node token reports its own nodes only (NAME, NAME-*): the
        // node appears; a node of another name is refused, and never does.
        let mut node = client(&certs, addr, bearer(&secret("node"))).await;
        let report = |name: &str| api::NodeHeartbeatRequest {
            nodes: Vec::new(),
            reports: vec![keel_proto::entry::RecordNodeInventory {
                name: name.into(),
                address: "10.0.0.9:1".into(),
                gpus: vec![keel_proto::entry::Gpu {
                    index: 0,
                    gpu_type: "v100".into(),
                }],
                failed: Vec::new(),
                note: String::new(),
            }],
        };
        let refused = node
            .node_heartbeat(report("elsewhere"))
            .await
            .expect_err("another node's name");
        assert_eq!(refused.code(), tonic::Code::PermissionDenied);
        assert!(
            refused
                .message()
                .contains("reports only node node or node-*"),
            "{}",
            refused.message()
        );
        node.node_heartbeat(report("node-0"))
            .await
            .expect("its own node");
        let mut tries = 0;
        loop {
            let nodes: Vec<String> = admin
                .list_nodes(api::ListNodesRequest::default())
                .await
                .expect("nodes")
                .into_inner()
                .nodes
                .into_iter()
                .map(|n| n.name)
                .collect();
            if !nodes.is_empty() {
                assert_eq!(nodes, ["node-0"], "the refused report registered nothing");
                break;
            }
            tries += 1;
            assert!(tries < 300, "the node never registered");
            tokio::time::sleep(std::time::Duration::from_millis(100)).await;
        }
        // Issue 23: a user token limited to queues submits to those only.
        admin
            .create_queue(api::CreateQueueRequest {
                name: "team-a".into(),
                spec: Some(keel_proto::entry::QueueSpec {
                    quota: Some(keel_proto::entry::GpuCounts::default()),
                    weight: 1,
                    ..Default::default()
                }),
                request_id: String::new(),
            })
            .await
            .expect("a queue");
        let limited = |name: &str, role: &str, queues: &[&str]| api::CreateTokenRequest {
            name: name.into(),
            role: role.into(),
            ttl_s: 0,
            secret: secret(name),
            request_id: String::new(),
            queues: queues.iter().map(|q| q.to_string()).collect(),
        };
        for (request, why) in [
            (
                limited("carol", "operator", &["team-a"]),
                "only a user token",
            ),
            (
                limited("carol", "user", &["team-z"]),
                "no queue is named \"team-z\"",
            ),
        ] {
            let refused = admin.create_token(request).await.expect_err(why);
            assert_eq!(refused.code(), tonic::Code::InvalidArgument, "{refused:?}");
            assert!(
                refused.message().contains("queues") && refused.message().contains(why),
                "{}",
                refused.message()
            );
        }
        admin
            .create_token(limited("carol", "user", &["team-a"]))
            .await
            .expect("a token limited to team-a");
        let mut carol = client(&certs, addr, bearer(&secret("carol"))).await;
        let who = carol
            .who_am_i(api::WhoAmIRequest {})
            .await
            .expect("who")
            .into_inner();
        assert_eq!((who.role.as_str(), who.queues), ("user", vec!["team-a".to_string()]));
        let refused = carol
            .submit_job(submission("carols-default"))
            .await
            .expect_err("the default queue is not hers");
        assert_eq!(refused.code(), tonic::Code::PermissionDenied);
        assert!(
            refused
                .message()
                .contains("token:carol may submit to queue \"team-a\" only, and the job names queue \"default\""),
            "{}",
            refused.message()
        );
        let mut in_team_a = submission("carols");
        if let Some(spec) = in_team_a.spec.as_mut() {
            spec.queue = "team-a".into();
        }
        carol
            .submit_job(in_team_a)
            .await
            .expect("carol submits to team-a");
        let tokens = admin
            .list_tokens(api::ListTokensRequest {})
            .await
            .expect("tokens")
            .into_inner()
            .tokens;
        let carols = tokens.iter().find(|t| t.name == "carol").expect("carol's");
        assert_eq!(carols.queues, ["team-a"]);
        assert!(tokens.iter().filter(|t| t.name != "carol").all(|t| t.queues.is_empty()));

        // Alice's cancel went through: her job is cancelled, by her.
        let cancelled = admin
            .get_job(api::GetJobRequest { job_id: job })
            .await
            .expect("admin reads it")
            .into_inner();
        assert_eq!(cancelled.state, "cancelled");
    });
    // No secret reaches the data directory (WAL, state, journal) or the
    // server's log: only hashes do.
    let mut files = 0;
    let mut pending = vec![dir.path().join("one")];
    while let Some(path) = pending.pop() {
        if path.is_dir() {
            pending.extend(
                std::fs::read_dir(&path)
                    .expect("dir")
                    .flatten()
                    .map(|e| e.path()),
            );
            continue;
        }
        let bytes = std::fs::read(&path).unwrap_or_default();
        files += 1;
        for name in ["root", "alice", "operator"] {
            let s = secret(name);
            assert!(
                !bytes.windows(s.len()).any(|w| w == s.as_bytes()),
                "{}'s secret is in {}",
                name,
                path.display()
            );
        }
    }
    assert!(files > 3, "the data directory was read ({files} files)");
}

/// `--acl` without TLS is refused at start, saying why.
#[test]
fn acl_without_tls_is_refused_at_start() {
    let dir = tempfile::tempdir().expect("tempdir");
    let out = std::process::Command::new(support::KEEL)
        .args(["server", "--acl", "--no-local-node", "--data-dir"])
        .arg(dir.path())
        .output()
        .expect("keel server");
    assert!(!out.status.success());
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(stderr.contains("--acl needs TLS"), "{stderr}");
}

/// A TLS client of the HTTP endpoint that trusts the cluster's CA (in
/// `certs`) and shows no certificate, as a browser or a scraper.
fn https_client(certs: &Path) -> std::sync::Arc<rustls::ClientConfig> {
    use rustls::pki_types::pem::PemObject;
    let mut roots = rustls::RootCertStore::empty();
    for ca in
        rustls::pki_types::CertificateDer::pem_file_iter(certs.join("ca.crt")).expect("ca.crt")
    {
        roots.add(ca.expect("a certificate")).expect("a CA");
    }
    std::sync::Arc::new(
        rustls::ClientConfig::builder_with_provider(std::sync::Arc::new(
            rustls::crypto::ring::default_provider(),
        ))
        .with_safe_default_protocol_versions()
        .expect("versions")
        .with_root_certificates(roots)
        .with_no_client_auth(),
    )
}

/// One HTTP/1.1 exchange on `addr` (over TLS with `tls`): the request's
/// head lines after the request line, and a body; the answer's status,
/// head and body (status 0: no HTTP answer).
fn http_exchange(
    tls: Option<&std::sync::Arc<rustls::ClientConfig>>,
    addr: &str,
    request_line: &str,
    head: &str,
    body: &str,
) -> (u16, String, String) {
    use std::io::{Read, Write};
    let tcp = std::net::TcpStream::connect(addr).expect("connect");
    tcp.set_read_timeout(Some(std::time::Duration::from_secs(10)))
        .expect("timeout");
    let mut stream: Box<dyn ReadWrite> = match tls {
        Some(config) => {
            let ip: std::net::SocketAddr = addr.parse().expect("an address");
            let name = rustls::pki_types::ServerName::IpAddress(ip.ip().into());
            let connection =
                rustls::ClientConnection::new(config.clone(), name).expect("a TLS client");
            Box::new(rustls::StreamOwned::new(connection, tcp))
        }
        None => Box::new(tcp),
    };
    let _ = write!(
        stream,
        "{request_line} HTTP/1.1\r\nHost: {addr}\r\nConnection: close\r\n{head}\
         Content-Length: {}\r\n\r\n{body}",
        body.len()
    );
    // To its end, or for an event stream (which never ends) to the end of
    // its head.
    let mut bytes = Vec::new();
    let mut buf = [0u8; 4096];
    loop {
        let n = stream.read(&mut buf).unwrap_or(0);
        if n == 0 {
            break;
        }
        bytes.extend_from_slice(&buf[..n]);
        let text = String::from_utf8_lossy(&bytes);
        if text.contains("text/event-stream") && text.contains("\r\n\r\n") {
            break;
        }
    }
    let answer = String::from_utf8_lossy(&bytes).to_string();
    let status = answer
        .split_whitespace()
        .nth(1)
        .and_then(|s| s.parse().ok())
        .unwrap_or(0);
    let (head, body) = answer.split_once("\r\n\r\n").unwrap_or((&answer, ""));
    (status, head.to_ascii_lowercase(), body.to_string())
}

trait ReadWrite: std::io::Read + std::io::Write {}
impl<T: std::io::Read + std::io::Write> ReadWrite for T {}

/// Issue 24, item 4: with `--acl`, the HTTP endpoint shows the cluster only
/// to a token that may read it (viewer, operator, admin), as a bearer
/// token (a scraper) or in the cookie `POST /login` sets (a browser);
/// `/healthz` and `/readyz` stay open; a user's token, another cluster's
/// token and none are refused, the browser without one getting the login
/// form. With the server's TLS it is HTTPS (the member's certificate, no
/// client certificate asked), and so may listen beyond loopback.
#[test]
fn the_http_endpoint_shows_the_cluster_only_to_a_token_that_may_read_it() {
    let dir = tempfile::tempdir().expect("tempdir");
    let certs = init_certs(dir.path());
    let data = dir.path().join("one");
    let mut flags = vec![
        "--acl".to_string(),
        "--no-local-node".to_string(),
        "--http-listen".to_string(),
        "0.0.0.0:0".to_string(),
    ];
    flags.extend(tls_member_flags(&certs, 1));
    let args: Vec<&str> = flags.iter().map(String::as_str).collect();
    let server =
        ServerProcess::start_with_client_env(&data, &args, &[], &tls_env(&certs, "client-admin"));
    let port = support::http_addr(&data)
        .parse::<std::net::SocketAddr>()
        .expect("an address")
        .port();
    let http = format!("127.0.0.1:{port}");
    let tls = https_client(&certs);
    // Plaintext gets no HTTP answer from it.
    assert_eq!(http_exchange(None, &http, "GET /healthz", "", "").0, 0);
    let runtime = tokio::runtime::Runtime::new().expect("runtime");
    runtime.block_on(async {
        let mut cert_only = client(&certs, &server.addr, None).await;
        cert_only
            .bootstrap_acl(api::BootstrapAclRequest {
                name: "root".into(),
                secret: secret("root"),
                request_id: String::new(),
            })
            .await
            .expect("bootstrap");
        let mut admin = client(&certs, &server.addr, bearer(&secret("root"))).await;
        for (name, role) in [("viewer", "viewer"), ("alice", "user")] {
            admin
                .create_token(api::CreateTokenRequest {
                    name: name.into(),
                    role: role.into(),
                    ttl_s: 0,
                    secret: secret(name),
                    request_id: String::new(),
                    queues: Vec::new(),
                })
                .await
                .unwrap_or_else(|e| panic!("create {name}: {e}"));
        }
    });
    let get =
        |path: &str, head: &str| http_exchange(Some(&tls), &http, &format!("GET {path}"), head, "");
    let as_bearer = |who: &str| format!("Authorization: Bearer {}\r\n", secret(who));
    // Probes need nothing.
    assert_eq!(get("/healthz", "").0, 200);
    assert_ne!(get("/readyz", "").0, 401);
    // A scraper: the metrics with a viewer's (or an admin's) token only.
    let (status, head, body) = get("/metrics", "");
    assert_eq!(status, 401, "{body}");
    assert!(head.contains("www-authenticate: bearer"), "{head}");
    assert!(body.contains("viewer, operator or admin"), "{body}");
    for who in ["viewer", "root"] {
        let (status, _, body) = get("/metrics", &as_bearer(who));
        assert_eq!(status, 200, "{who}: {body}");
        assert!(body.contains("keel_raft_has_leader"), "{who}");
    }
    let (status, _, body) = get("/metrics", &as_bearer("alice"));
    assert_eq!(status, 403, "{body}");
    assert!(body.contains("\"alice\" is a user"), "{body}");
    let (status, _, body) = get("/api/v1/cluster", "Authorization: Bearer not-a-token\r\n");
    assert_eq!(status, 401, "{body}");
    assert!(body.contains("not one of this cluster's"), "{body}");
    // The what-if reads the whole history: for readers of the cluster only.
    let whatif = "/api/v1/whatif?policy=fifo";
    assert_eq!(get(whatif, "").0, 401);
    let (status, _, body) = get(whatif, &as_bearer("alice"));
    assert_eq!(status, 403, "{body}");
    let (status, _, body) = get(whatif, &as_bearer("viewer"));
    assert!(![401, 403].contains(&status), "{status}: {body}");
    // A browser: the login form, then the console with the cookie.
    let (status, _, body) = get("/", "");
    assert_eq!(status, 401);
    assert!(
        body.contains("<form method=\"post\" action=\"/login\""),
        "{body}"
    );
    assert!(!body.contains("keel_raft"), "{body}");
    let login = |token: &str| {
        http_exchange(
            Some(&tls),
            &http,
            "POST /login",
            "Content-Type: application/x-www-form-urlencoded\r\n",
            &format!("token={token}"),
        )
    };
    let (status, head, body) = login(&secret("alice"));
    assert_eq!(status, 403, "{body}");
    assert!(!head.contains("set-cookie"), "{head}");
    assert!(body.contains("is a user"), "{body}");
    let (status, head, _) = login(&secret("viewer"));
    assert_eq!(status, 303, "{head}");
    let cookie = head
        .lines()
        .find_map(|l| l.strip_prefix("set-cookie: "))
        .expect("a cookie")
        .to_string();
    assert!(
        cookie.contains("httponly")
            && cookie.contains("samesite=strict")
            && cookie.contains("secure"),
        "{cookie}"
    );
    let pair = cookie.split(';').next().expect("name=value").to_string();
    let with_cookie = format!("Cookie: {pair}\r\n");
    let (status, _, body) = get("/", &with_cookie);
    assert_eq!(status, 200);
    assert!(
        body.contains("<title>Keel"),
        "{}",
        &body[..body.len().min(300)]
    );
    assert_eq!(get("/api/v1/cluster", &with_cookie).0, 200);
    let (status, head, _) =
        http_exchange(Some(&tls), &http, "GET /api/v1/events", &with_cookie, "");
    assert_eq!(status, 200, "{head}");
    assert!(head.contains("text/event-stream"), "{head}");
    // Logging out forgets it.
    let (status, head, _) = http_exchange(Some(&tls), &http, "POST /logout", &with_cookie, "");
    assert_eq!(status, 303);
    assert!(head.contains("max-age=0"), "{head}");
}
