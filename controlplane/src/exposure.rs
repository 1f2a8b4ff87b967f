//! What a server may listen on (issue 22, item 4: safe by default).
//!
//! Without TLS, whoever reaches a replica's port can submit and cancel any
//! job, switch the policy, change the Raft membership, declare nodes and
//! read every job's spec. So a server without TLS serves on loopback
//! addresses only, unless the operator says, with `--insecure`, that the
//! network it listens on is trusted. With TLS ([`crate::tls`]) every
//! connection is mutual (a caller without a certificate from the cluster's
//! CA is refused at the handshake), and with ACLs ([`crate::authz`]) every
//! call is checked against the caller's role: with both, any address may
//! be served.

use std::net::SocketAddr;

/// A listen address beyond this machine, refused without `--insecure`.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error(
    "refusing to serve on {listen} without {missing}: it is reachable beyond this machine, so \
     anyone who reaches it could submit and cancel any job, change the policy and the Raft \
     membership, and read every job's spec. Serve with TLS and ACLs (--tls-cert, --tls-key and \
     --tls-ca, which `keel tls init` makes, and --acl; then `keel acl bootstrap`), or on a \
     loopback address (127.0.0.1:PORT, [::1]:PORT) reached through an SSH tunnel, or, on a \
     network you trust, add --insecure"
)]
pub struct Exposed {
    pub listen: SocketAddr,
    /// What it lacks: "TLS and ACLs", "ACLs (--acl)".
    pub missing: &'static str,
}

/// Whether a server may listen on `listen`: a loopback address, or any
/// address with both TLS and ACLs, always; any other only when
/// `insecure`. `Ok(true)`: allowed but exposed (the caller says so in its
/// log).
pub fn check_listen(
    listen: SocketAddr,
    insecure: bool,
    tls: bool,
    acl: bool,
) -> Result<bool, Exposed> {
    if listen.ip().is_loopback() || (tls && acl) {
        return Ok(false);
    }
    if insecure {
        return Ok(true);
    }
    let missing = match (tls, acl) {
        (false, false) => "TLS and ACLs",
        (false, true) => "TLS",
        (true, _) => "ACLs (--acl)",
    };
    Err(Exposed { listen, missing })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn addr(s: &str) -> SocketAddr {
        s.parse().expect("an address")
    }

    #[test]
    fn loopback_is_served_and_anything_else_needs_insecure() {
        for ok in ["127.0.0.1:7070", "127.0.0.3:7001", "[::1]:7070"] {
            assert_eq!(
                check_listen(addr(ok), false, false, false),
                Ok(false),
                "{ok}"
            );
        }
        for exposed in [
            "0.0.0.0:7070",
            "10.1.2.3:7070",
            "[::]:7070",
            "192.168.0.5:1",
        ] {
            let err = check_listen(addr(exposed), false, false, false).expect_err(exposed);
            assert_eq!(err.listen, addr(exposed));
            assert!(err.to_string().contains("--insecure"), "{err}");
            assert!(err.to_string().contains("--tls-cert"), "{err}");
            assert!(err.to_string().contains("without TLS and ACLs"), "{err}");
            assert_eq!(
                check_listen(addr(exposed), true, false, false),
                Ok(true),
                "{exposed}"
            );
            // TLS alone is not enough: mutual TLS says who, ACLs what.
            let err = check_listen(addr(exposed), false, true, false).expect_err(exposed);
            assert!(err.to_string().contains("without ACLs (--acl)"), "{err}");
            assert_eq!(
                check_listen(addr(exposed), false, true, true),
                Ok(false),
                "{exposed}"
            );
        }
    }
}
