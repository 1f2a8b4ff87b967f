//! TLS on a real `keel server` (issue 22, item 1): certificates from
//! `keel tls init`, a reload on SIGHUP seen from a TLS client, Raft
//! messages refused to any certificate but the sending member's, and an
//! address beyond loopback served with TLS and ACLs and no `--insecure`.

mod support;

use std::ffi::OsString;
use std::path::Path;
use std::process::Command;

use rustls::pki_types::pem::PemObject;
use rustls::pki_types::CertificateDer;
use support::{init_certs, tls_client, tls_env, tls_member_flags, wait_for, ServerProcess, KEEL};

fn start_member_1(dir: &Path, certs: &Path) -> ServerProcess {
    let flags = tls_member_flags(certs, 1);
    let mut args: Vec<&str> = vec!["--no-local-node"];
    args.extend(flags.iter().map(String::as_str));
    ServerProcess::start_with_client_env(
        &dir.join("data"),
        &args,
        &[],
        &tls_env(certs, "client-admin"),
    )
}

fn der_of(path: &Path) -> Vec<u8> {
    CertificateDer::from_pem_file(path)
        .expect("a certificate")
        .to_vec()
}

/// The certificate the server at `addr` shows a new connection now.
fn served_certificate(certs: &Path, addr: &str) -> Vec<u8> {
    let keel::transport::Transport::Tls(tls) = tls_client(certs, "client-admin") else {
        unreachable!("a TLS transport");
    };
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .expect("runtime");
    runtime.block_on(async {
        let tcp = tokio::net::TcpStream::connect(addr).await.expect("connect");
        let name = rustls::pki_types::ServerName::try_from("1.members.keel").expect("name");
        let stream = tokio_rustls::TlsConnector::from(tls.client_config())
            .connect(name, tcp)
            .await
            .expect("TLS handshake");
        stream
            .get_ref()
            .1
            .peer_certificates()
            .expect("a certificate")[0]
            .to_vec()
    })
}

fn kill_hup(server: &ServerProcess) {
    let status = Command::new("kill")
        .args(["-HUP", &server.pid().to_string()])
        .status()
        .expect("kill -HUP");
    assert!(status.success());
}

#[test]
fn sighup_reloads_the_certificate_that_new_connections_see_and_a_bad_file_changes_nothing() {
    let dir = tempfile::tempdir().expect("tempdir");
    let certs = init_certs(dir.path());
    let server = start_member_1(dir.path(), &certs);
    let first = der_of(&certs.join("member-1.crt"));
    assert_eq!(served_certificate(&certs, &server.addr), first);

    // A renewal, copied over the files in use, then SIGHUP.
    let out = Command::new(KEEL)
        .args(["tls", "issue"])
        .arg(&certs)
        .args(["--member", "1", "--name", "member-1.next"])
        .output()
        .expect("keel tls issue");
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let next = der_of(&certs.join("member-1.next.crt"));
    assert_ne!(next, first);
    for ext in ["crt", "key"] {
        std::fs::copy(
            certs.join(format!("member-1.next.{ext}")),
            certs.join(format!("member-1.{ext}")),
        )
        .expect("copy");
    }
    kill_hup(&server);
    wait_for("the renewed certificate served", || {
        (served_certificate(&certs, &server.addr) == next).then_some(())
    });
    assert!(server.log_text().contains("SIGHUP: certificates reloaded"));

    // A file that does not load: said in the log, and the renewed
    // certificate stays in use.
    std::fs::write(certs.join("member-1.crt"), "not a certificate").expect("write");
    kill_hup(&server);
    wait_for("the refused reload logged", || {
        server
            .log_text()
            .contains("SIGHUP: the certificates did not load; the ones in use stay")
            .then_some(())
    });
    assert_eq!(served_certificate(&certs, &server.addr), next);
    server.cli_ok(&["cluster", "status"]);
}

#[test]
fn raft_messages_are_refused_unless_the_certificate_names_their_sender() {
    use keel_proto::raft::raft_client::RaftClient;
    use keel_proto::raft::RaftMessage;
    use keel_storage::raft_wire::WireMessage;
    let dir = tempfile::tempdir().expect("tempdir");
    let certs = init_certs(dir.path());
    let server = start_member_1(dir.path(), &certs);
    let before = server.json(&["cluster", "status"]);
    let incarnation = before["incarnation"].as_u64().expect("an incarnation");
    let me = keel::membership::raft_id(1, incarnation);
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .expect("runtime");
    // A vote request from candidate `member`, sent holding `holder`'s
    // certificate, addressed to the server's Raft id.
    let vote = |holder: &str, member: u64| {
        let transport = tls_client(&certs, holder);
        let addr = server.addr.clone();
        runtime.block_on(async move {
            let endpoint = transport.endpoint(&addr).expect("endpoint");
            let channel = transport
                .connect(endpoint, keel::transport::Peer::Member(1))
                .await
                .expect("a TLS connection");
            let request: openraft::raft::VoteRequest<u64> = openraft::raft::VoteRequest::new(
                openraft::Vote::new(9, keel::membership::raft_id(member, 1)),
                None,
            );
            let mut message = tonic::Request::new(RaftMessage {
                payload: request.encode(2).expect("encode"),
                format_version: 2,
                reads_up_to: 2,
                ..RaftMessage::default()
            });
            message
                .metadata_mut()
                .insert("keel-to", tonic::metadata::MetadataValue::from(me));
            RaftClient::new(channel).vote(message).await
        })
    };
    // A client's certificate, and another member's, vote nothing.
    for (holder, member) in [("client-admin", 2), ("member-2", 3), ("member-3", 2)] {
        let refused = vote(holder, member).expect_err(holder);
        assert_eq!(refused.code(), tonic::Code::PermissionDenied, "{holder}");
        assert!(
            refused.message().contains(&format!(
                "a Raft message from member {member} needs that member's certificate \
                 (a certificate naming {member}.members.keel)"
            )),
            "{holder}: {}",
            refused.message()
        );
    }
    // The member's own certificate passes that check (and meets the
    // next: the candidate is not a member of this one-replica cluster).
    let answered = vote("member-2", 2);
    assert!(
        answered
            .as_ref()
            .err()
            .is_none_or(|s| s.code() != tonic::Code::PermissionDenied),
        "{answered:?}"
    );
    // Nothing changed: still the leader, in the same term.
    let status = server.json(&["cluster", "status"]);
    assert_eq!(status["role"], "leader", "{status}");
    assert_eq!(status["term"], before["term"], "{status}");
    assert!(server.log_text().contains("refused a Raft message"));
}

#[test]
fn with_tls_and_acls_an_address_beyond_loopback_is_served_without_insecure() {
    let dir = tempfile::tempdir().expect("tempdir");
    let certs = init_certs(dir.path());
    let data = dir.path().join("data");
    // TLS alone says who calls, not what they may do: refused.
    let refused = Command::new(KEEL)
        .args([
            "server",
            "--listen",
            "0.0.0.0:0",
            "--no-local-node",
            "--data-dir",
        ])
        .arg(&data)
        .args(tls_member_flags(&certs, 1))
        .output()
        .expect("keel server");
    assert!(!refused.status.success());
    let said = String::from_utf8_lossy(&refused.stderr);
    assert!(
        said.contains("refusing to serve on 0.0.0.0:0 without ACLs (--acl)"),
        "{said}"
    );
    let mut child = Command::new(KEEL)
        .args([
            "server",
            "--listen",
            "0.0.0.0:0",
            "--acl",
            "--no-local-node",
            "--data-dir",
        ])
        .arg(&data)
        .args(tls_member_flags(&certs, 1))
        .stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::null())
        .spawn()
        .expect("spawn");
    let addr = wait_for("the server's address", || {
        std::fs::read_to_string(data.join("server.addr"))
            .ok()
            .and_then(|a| a.parse::<std::net::SocketAddr>().ok())
    });
    let loopback = format!("127.0.0.1:{}", addr.port());
    let status = |env: &[(&str, OsString)]| {
        Command::new(KEEL)
            .args(["--addr", &loopback, "cluster", "status"])
            .envs(env.iter().map(|(k, v)| (k, v)))
            .output()
            .expect("keel cluster status")
    };
    let with_tls = tls_env(&certs, "client-admin");
    wait_for("an answer over TLS", || {
        status(&with_tls).status.success().then_some(())
    });
    // Without TLS the caller gets nothing but a hint.
    let plain = status(&[]);
    assert!(!plain.status.success());
    assert!(
        String::from_utf8_lossy(&plain.stderr)
            .contains("if the server uses TLS, give --tls-ca, --tls-cert and --tls-key"),
        "{}",
        String::from_utf8_lossy(&plain.stderr)
    );
    // Nor with a certificate from another CA.
    let other = init_certs(&dir.path().join("other"));
    let stranger = status(&tls_env(&other, "client-admin"));
    assert!(!stranger.status.success());
    assert!(
        String::from_utf8_lossy(&stranger.stderr).contains("UnknownIssuer"),
        "{}",
        String::from_utf8_lossy(&stranger.stderr)
    );
    let _ = child.kill();
    let _ = child.wait();
}

#[test]
fn keel_tls_init_writes_owner_only_files_and_never_replaces_one() {
    let dir = tempfile::tempdir().expect("tempdir");
    let certs = init_certs(dir.path());
    assert_eq!(support::mode(&certs), 0o700);
    let mut names: Vec<String> = std::fs::read_dir(&certs)
        .expect("read")
        .map(|e| e.expect("entry").file_name().to_string_lossy().into_owned())
        .collect();
    names.sort();
    assert_eq!(
        names,
        [
            "ca.crt",
            "ca.key",
            "client-admin.crt",
            "client-admin.key",
            "member-1.crt",
            "member-1.key",
            "member-2.crt",
            "member-2.key",
            "member-3.crt",
            "member-3.key"
        ]
    );
    for name in &names {
        assert_eq!(support::mode(&certs.join(name)), 0o600, "{name}");
    }
    let ca = std::fs::read(certs.join("ca.key")).expect("ca.key");
    // Again: refused, and the CA's key is the one it was.
    let again = Command::new(KEEL)
        .args(["tls", "init"])
        .arg(&certs)
        .output()
        .expect("keel tls init");
    assert!(!again.status.success());
    assert!(
        String::from_utf8_lossy(&again.stderr).contains("an existing file is never replaced"),
        "{}",
        String::from_utf8_lossy(&again.stderr)
    );
    assert_eq!(std::fs::read(certs.join("ca.key")).expect("ca.key"), ca);
    // A member's certificate names the member; a client's, no member.
    let member = CertificateDer::from_pem_file(certs.join("member-2.crt")).expect("pem");
    assert!(keel::tls::names_member(&member, 2));
    assert!(!keel::tls::names_member(&member, 1));
    let client = CertificateDer::from_pem_file(certs.join("client-admin.crt")).expect("pem");
    assert!((1..=3).all(|id| !keel::tls::names_member(&client, id)));
}
