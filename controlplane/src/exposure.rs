//! What a server may listen on (issue 22, item 4: safe by default).
//!
//! Without TLS, whoever reaches a replica's port can submit and cancel any
//! job, switch the policy, change the Raft membership, declare nodes and
//! read every job's spec. So a server without TLS serves on loopback
//! addresses only, unless the operator says, with `--insecure`, that the
//! network it listens on is trusted. With TLS ([`crate::tls`]) every
//! connection is mutual: a caller without a certificate from the cluster's
//! CA is refused at the handshake, so any address may be served.

use std::net::SocketAddr;

/// A listen address beyond this machine, refused without `--insecure`.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error(
    "refusing to serve on {listen} without TLS: it is reachable beyond this machine, so anyone \
     who reaches it could submit and cancel any job, change the policy and the Raft \
     membership, and read every job's spec. Serve with TLS (--tls-cert, --tls-key and --tls-ca; \
     `keel tls init` makes a cluster's certificates), or on a loopback address (127.0.0.1:PORT, \
     [::1]:PORT) reached through an SSH tunnel, or, on a network you trust, add --insecure"
)]
pub struct ExposedWithoutTls {
    pub listen: SocketAddr,
}

/// Whether a server may listen on `listen`: a loopback address or any
/// address with TLS always, any other only when `insecure`. `Ok(true)`:
/// allowed but exposed (the caller says so in its log).
pub fn check_listen(
    listen: SocketAddr,
    insecure: bool,
    tls: bool,
) -> Result<bool, ExposedWithoutTls> {
    if listen.ip().is_loopback() || tls {
        return Ok(false);
    }
    if insecure {
        return Ok(true);
    }
    Err(ExposedWithoutTls { listen })
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
            assert_eq!(check_listen(addr(ok), false, false), Ok(false), "{ok}");
        }
        for exposed in [
            "0.0.0.0:7070",
            "10.1.2.3:7070",
            "[::]:7070",
            "192.168.0.5:1",
        ] {
            let err = check_listen(addr(exposed), false, false).expect_err(exposed);
            assert_eq!(err.listen, addr(exposed));
            assert!(err.to_string().contains("--insecure"), "{err}");
            assert!(err.to_string().contains("--tls-cert"), "{err}");
            assert_eq!(
                check_listen(addr(exposed), true, false),
                Ok(true),
                "{exposed}"
            );
            assert_eq!(
                check_listen(addr(exposed), false, true),
                Ok(false),
                "{exposed}"
            );
        }
    }
}
