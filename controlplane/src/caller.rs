//! Who made a request (issue 22, item 3): the identity the entries it
//! proposes record as their actor (`LogEntry::actor`).
//!
//! - A client certificate's holder is `cert:<common name>`.
//! - A replica (a member certificate) is the caller it forwarded for, named
//!   in the `keel-caller` header, or else `member <id>`. Only a member's
//!   connection is believed about another caller: the header from anyone
//!   else is ignored, so a client cannot pass for another.
//! - Without TLS there is no identity: `None`, and the header is ignored.

use tonic::Request;

use crate::transport::PeerInfo;

/// Metadata a replica sets on a request it forwards: whom for.
pub const CALLER_HEADER: &str = "keel-caller";

/// The longest common name an actor keeps (longer ones are cut).
const COMMON_NAME_MAX_LEN: usize = 128;

/// What a connection's certificate says of its holder (read once per
/// connection, [`crate::transport::Conn`]).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct CertIdentity {
    /// The subject's common name (empty when it has none).
    pub common_name: String,
    /// The member it names (`ID.members.keel`), for a replica's.
    pub member: Option<u64>,
}

impl CertIdentity {
    /// Reads a certificate (DER); `None` if it does not parse.
    pub fn of(der: &[u8]) -> Option<CertIdentity> {
        let (_, cert) = x509_parser::parse_x509_certificate(der).ok()?;
        let common_name = cert
            .subject()
            .iter_common_name()
            .next()
            .and_then(|cn| cn.as_str().ok())
            .unwrap_or_default();
        let member = cert
            .subject_alternative_name()
            .ok()
            .flatten()
            .and_then(|san| {
                san.value.general_names.iter().find_map(|name| match name {
                    x509_parser::extensions::GeneralName::DNSName(dns) => dns
                        .strip_suffix(crate::tls::MEMBER_NAME_SUFFIX)?
                        .strip_suffix('.')?
                        .parse::<u64>()
                        .ok(),
                    _ => None,
                })
            });
        Some(CertIdentity {
            common_name: cut(common_name, COMMON_NAME_MAX_LEN).to_string(),
            member,
        })
    }
}

/// `text` cut to at most `max` bytes, at a character boundary.
fn cut(text: &str, max: usize) -> &str {
    let mut end = text.len().min(max);
    while !text.is_char_boundary(end) {
        end -= 1;
    }
    &text[..end]
}

/// The identity of the request's caller (see the module's doc).
pub fn caller_of<T>(request: &Request<T>) -> Option<String> {
    let identity = request.extensions().get::<PeerInfo>()?.identity.as_ref()?;
    match identity.member {
        Some(member) => Some(
            request
                .metadata()
                .get(CALLER_HEADER)
                .and_then(|v| v.to_str().ok())
                .filter(|v| !v.is_empty() && v.len() <= keel_state::command::ACTOR_MAX_LEN)
                .map_or_else(|| format!("member {member}"), str::to_string),
        ),
        None => Some(format!("cert:{}", identity.common_name)),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn request(identity: Option<CertIdentity>, header: Option<&str>) -> Request<()> {
        let mut r = Request::new(());
        r.extensions_mut().insert(PeerInfo {
            remote: None,
            certs: None,
            identity,
        });
        if let Some(h) = header {
            r.metadata_mut()
                .insert(CALLER_HEADER, h.parse().expect("ascii"));
        }
        r
    }

    #[test]
    fn only_a_member_is_believed_about_whom_it_forwards_for() {
        let alice = CertIdentity {
            common_name: "alice".into(),
            member: None,
        };
        let member = CertIdentity {
            common_name: "keel member 2".into(),
            member: Some(2),
        };
        assert_eq!(
            caller_of(&request(Some(alice.clone()), None)).as_deref(),
            Some("cert:alice")
        );
        assert_eq!(
            caller_of(&request(Some(alice), Some("cert:admin"))).as_deref(),
            Some("cert:alice"),
            "a client cannot pass for another"
        );
        assert_eq!(
            caller_of(&request(Some(member.clone()), Some("cert:alice"))).as_deref(),
            Some("cert:alice")
        );
        assert_eq!(
            caller_of(&request(Some(member), None)).as_deref(),
            Some("member 2")
        );
        assert_eq!(
            caller_of(&request(None, Some("cert:admin"))),
            None,
            "plaintext"
        );
        assert_eq!(caller_of(&Request::new(())), None, "in-process");
    }

    #[test]
    fn a_certificates_name_and_member_are_read() {
        let ca = crate::tls::certs::new_ca("test").expect("ca");
        let der = |pem: &str| {
            use rustls::pki_types::pem::PemObject;
            rustls::pki_types::CertificateDer::from_pem_slice(pem.as_bytes())
                .expect("pem")
                .to_vec()
        };
        let member = ca.issue_member(3, &["127.0.0.1".into()], 30).expect("3");
        let client = ca.issue_client("alice", 30).expect("alice");
        assert_eq!(
            CertIdentity::of(&der(&member.cert_pem)),
            Some(CertIdentity {
                common_name: "keel member 3".into(),
                member: Some(3)
            })
        );
        assert_eq!(
            CertIdentity::of(&der(&client.cert_pem)),
            Some(CertIdentity {
                common_name: "alice".into(),
                member: None
            })
        );
        assert_eq!(CertIdentity::of(b"not a certificate"), None);
        assert_eq!(cut("ééé", 3), "é");
    }
}
