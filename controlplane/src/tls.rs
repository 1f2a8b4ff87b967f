//! TLS for the API and Raft port (issue 22): the certificates a replica or
//! a client holds, the rustls configurations made from them, and their
//! reload (SIGHUP) without a restart.
//!
//! One CA per cluster. A replica's certificate names its member id as the
//! DNS name `<id>.members.keel` ([`member_name`]), beside the hosts
//! clients reach it by; it serves with it and presents it when it calls a
//! peer. Every connection to the port is mutual: the caller's certificate
//! must chain to the cluster CA. Raft messages are further refused unless
//! the caller's certificate names the member that sent them
//! ([`crate::transport::PeerInfo::names_member`]), so a client's
//! certificate cannot vote or append entries.
//!
//! Nothing here reads a clock except rustls's own certificate validity
//! checks, and the start-time check that a replica's certificate chains
//! to its CA ([`TlsState::load`]).

use std::path::{Path, PathBuf};
use std::sync::{Arc, RwLock};

use rustls::pki_types::pem::PemObject;
use rustls::pki_types::{CertificateDer, PrivateKeyDer, ServerName, UnixTime};
use rustls::server::WebPkiClientVerifier;
use rustls::{ClientConfig, RootCertStore, ServerConfig};

pub mod certs;

/// The DNS name suffix of member names: `1.members.keel`.
pub const MEMBER_NAME_SUFFIX: &str = "members.keel";

/// The name a member's certificate carries, and that a replica verifies
/// when it calls that member.
pub fn member_name(id: u64) -> String {
    format!("{id}.{MEMBER_NAME_SUFFIX}")
}

/// Errors loading certificates and keys.
#[derive(Debug, thiserror::Error)]
pub enum TlsError {
    #[error("{flag} {path}: {message}")]
    File {
        flag: &'static str,
        path: PathBuf,
        message: String,
    },
    #[error("{flag} {path}: no {what} in it (a PEM file is expected)")]
    Empty {
        flag: &'static str,
        path: PathBuf,
        what: &'static str,
    },
    #[error(
        "--tls-cert {cert}: it does not name member {id} (a member's certificate carries the DNS \
         name {name}; make one with `keel tls issue DIR --member {id}`)"
    )]
    NotThisMember {
        cert: PathBuf,
        id: u64,
        name: String,
    },
    #[error("--tls-cert {cert} does not chain to the CA in --tls-ca {ca}: {message}")]
    NotFromCa {
        cert: PathBuf,
        ca: PathBuf,
        message: String,
    },
    #[error("the TLS configuration: {0}")]
    Config(String),
    #[error("{0} needs --tls-cert, --tls-key and --tls-ca together")]
    Incomplete(&'static str),
}

/// Where a process's certificate, key and CA are: read at start and again
/// at every reload.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TlsFiles {
    /// The process's certificate chain (PEM); `None` for a client without
    /// one.
    pub cert: Option<PathBuf>,
    pub key: Option<PathBuf>,
    /// The cluster CA's certificate(s) (PEM).
    pub ca: PathBuf,
}

impl TlsFiles {
    /// From the three flags: all or none (`None`); a certificate without
    /// its key, or the reverse, is refused.
    pub fn from_flags(
        cert: Option<PathBuf>,
        key: Option<PathBuf>,
        ca: Option<PathBuf>,
        who: &'static str,
    ) -> Result<Option<TlsFiles>, TlsError> {
        match (cert, key, ca) {
            (None, None, None) => Ok(None),
            (cert, key, Some(ca)) if cert.is_some() == key.is_some() => {
                Ok(Some(TlsFiles { cert, key, ca }))
            }
            _ => Err(TlsError::Incomplete(who)),
        }
    }
}

/// Who holds the certificates: a replica (serves, and calls its peers) or
/// a client (only calls).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Holder {
    /// Member `id`: its certificate must name it.
    Member(u64),
    Client,
}

/// The configurations in use; replaced whole on reload.
#[derive(Debug)]
struct Loaded {
    /// `None` for a client.
    server: Option<Arc<ServerConfig>>,
    /// The HTTP endpoint's (the same certificate, no client certificate
    /// asked: browsers and scrapers authenticate with tokens); `None` for
    /// a client.
    web: Option<Arc<ServerConfig>>,
    client: Arc<ClientConfig>,
}

/// A process's TLS: its files and the configurations made from them. New
/// connections, in and out, use the configurations current when they
/// start; a reload leaves open connections as they are.
#[derive(Debug)]
pub struct TlsState {
    files: TlsFiles,
    holder: Holder,
    loaded: RwLock<Arc<Loaded>>,
}

impl TlsState {
    /// Reads the files and makes the configurations. For a member, its
    /// certificate must name it and chain to the CA: checked here, so a
    /// wrong file is refused at start rather than at every handshake.
    pub fn load(files: TlsFiles, holder: Holder) -> Result<TlsState, TlsError> {
        let loaded = make(&files, holder)?;
        Ok(TlsState {
            files,
            holder,
            loaded: RwLock::new(Arc::new(loaded)),
        })
    }

    /// Reads the files again. On an error the configurations in use stay,
    /// and the error says why.
    pub fn reload(&self) -> Result<(), TlsError> {
        let loaded = make(&self.files, self.holder)?;
        *self.loaded.write().unwrap_or_else(|p| p.into_inner()) = Arc::new(loaded);
        Ok(())
    }

    fn current(&self) -> Arc<Loaded> {
        self.loaded
            .read()
            .unwrap_or_else(|p| p.into_inner())
            .clone()
    }

    /// The configuration new incoming connections use (`None` for a
    /// client).
    pub fn server_config(&self) -> Option<Arc<ServerConfig>> {
        self.current().server.clone()
    }

    /// The configuration new connections to the HTTP endpoint use (`None`
    /// for a client).
    pub fn web_config(&self) -> Option<Arc<ServerConfig>> {
        self.current().web.clone()
    }

    /// The configuration new outgoing connections use.
    pub fn client_config(&self) -> Arc<ClientConfig> {
        self.current().client.clone()
    }

    pub fn files(&self) -> &TlsFiles {
        &self.files
    }
}

fn provider() -> Arc<rustls::crypto::CryptoProvider> {
    Arc::new(rustls::crypto::ring::default_provider())
}

fn read_certs(flag: &'static str, path: &Path) -> Result<Vec<CertificateDer<'static>>, TlsError> {
    let file_error = |message: String| TlsError::File {
        flag,
        path: path.to_path_buf(),
        message,
    };
    let certs = CertificateDer::pem_file_iter(path)
        .map_err(|e| file_error(e.to_string()))?
        .collect::<Result<Vec<_>, _>>()
        .map_err(|e| file_error(e.to_string()))?;
    if certs.is_empty() {
        return Err(TlsError::Empty {
            flag,
            path: path.to_path_buf(),
            what: "certificate",
        });
    }
    Ok(certs)
}

fn read_key(path: &Path) -> Result<PrivateKeyDer<'static>, TlsError> {
    PrivateKeyDer::from_pem_file(path).map_err(|e| match e {
        rustls::pki_types::pem::Error::NoItemsFound => TlsError::Empty {
            flag: "--tls-key",
            path: path.to_path_buf(),
            what: "private key",
        },
        e => TlsError::File {
            flag: "--tls-key",
            path: path.to_path_buf(),
            message: e.to_string(),
        },
    })
}

fn make(files: &TlsFiles, holder: Holder) -> Result<Loaded, TlsError> {
    let config_error = |e: rustls::Error| TlsError::Config(e.to_string());
    let mut roots = RootCertStore::empty();
    for ca in read_certs("--tls-ca", &files.ca)? {
        roots.add(ca).map_err(|e| TlsError::File {
            flag: "--tls-ca",
            path: files.ca.clone(),
            message: e.to_string(),
        })?;
    }
    let roots = Arc::new(roots);
    let identity = match (&files.cert, &files.key) {
        (Some(cert), Some(key)) => Some((read_certs("--tls-cert", cert)?, read_key(key)?)),
        _ => None,
    };
    let client_builder = ClientConfig::builder_with_provider(provider())
        .with_safe_default_protocol_versions()
        .map_err(config_error)?
        .with_root_certificates(roots.clone());
    let mut client = match &identity {
        Some((chain, key)) => client_builder
            .with_client_auth_cert(chain.clone(), key.clone_key())
            .map_err(|e| key_error(files, e))?,
        None => client_builder.with_no_client_auth(),
    };
    client.alpn_protocols = vec![b"h2".to_vec()];
    let (server, web) = match holder {
        Holder::Client => (None, None),
        Holder::Member(id) => {
            let Some((chain, key)) = identity else {
                return Err(TlsError::Incomplete("a replica"));
            };
            let cert_path = files.cert.clone().unwrap_or_default();
            let verifier = WebPkiClientVerifier::builder_with_provider(roots, provider())
                .build()
                .map_err(|e| TlsError::Config(e.to_string()))?;
            // The replica's certificate must be one its peers accept.
            verifier
                .verify_client_cert(&chain[0], &chain[1..], UnixTime::now())
                .map_err(|e| TlsError::NotFromCa {
                    cert: cert_path.clone(),
                    ca: files.ca.clone(),
                    message: e.to_string(),
                })?;
            if !names_member(&chain[0], id) {
                return Err(TlsError::NotThisMember {
                    cert: cert_path,
                    id,
                    name: member_name(id),
                });
            }
            let mut web = ServerConfig::builder_with_provider(provider())
                .with_safe_default_protocol_versions()
                .map_err(config_error)?
                .with_no_client_auth()
                .with_single_cert(chain.clone(), key.clone_key())
                .map_err(|e| key_error(files, e))?;
            web.alpn_protocols = vec![b"http/1.1".to_vec()];
            let mut server = ServerConfig::builder_with_provider(provider())
                .with_safe_default_protocol_versions()
                .map_err(config_error)?
                .with_client_cert_verifier(verifier)
                .with_single_cert(chain, key)
                .map_err(|e| key_error(files, e))?;
            server.alpn_protocols = vec![b"h2".to_vec()];
            (Some(Arc::new(server)), Some(Arc::new(web)))
        }
    };
    Ok(Loaded {
        server,
        web,
        client: Arc::new(client),
    })
}

fn key_error(files: &TlsFiles, e: rustls::Error) -> TlsError {
    TlsError::File {
        flag: "--tls-key",
        path: files.key.clone().unwrap_or_default(),
        message: format!("{e} (is it the key of --tls-cert?)"),
    }
}

/// Whether `cert` names member `id` (carries [`member_name`]`(id)`).
pub fn names_member(cert: &CertificateDer<'_>, id: u64) -> bool {
    let Ok(name) = ServerName::try_from(member_name(id)) else {
        return false;
    };
    webpki::EndEntityCert::try_from(cert)
        .map(|c| c.verify_is_valid_for_subject_name(&name).is_ok())
        .unwrap_or(false)
}

/// The name a client verifies when it reaches `addr` (`host:port`, a URL,
/// or `[v6]:port`): an IP address or a DNS name.
pub fn server_name_of(addr: &str) -> Result<ServerName<'static>, TlsError> {
    let rest = addr.split_once("://").map_or(addr, |(_, r)| r);
    let authority = rest.split('/').next().unwrap_or(rest);
    let host = if let Some(v6) = authority.strip_prefix('[') {
        v6.split(']').next().unwrap_or(v6)
    } else {
        authority.rsplit_once(':').map_or(authority, |(h, _)| h)
    };
    ServerName::try_from(host.to_string())
        .map_err(|e| TlsError::Config(format!("server address {addr:?}: {e}")))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn write(dir: &Path, name: &str, text: &str) -> PathBuf {
        let path = dir.join(name);
        std::fs::write(&path, text).expect("write");
        path
    }

    #[test]
    fn a_replica_loads_its_own_certificate_and_refuses_another_members_or_another_cas() {
        let dir = tempfile::tempdir().expect("tempdir");
        let ca = certs::new_ca("test").expect("ca");
        let other_ca = certs::new_ca("other").expect("ca");
        let one = ca.issue_member(1, &["127.0.0.1".into()], 30).expect("1");
        let stranger = other_ca.issue_member(1, &[], 30).expect("1'");
        let ca_path = write(dir.path(), "ca.crt", &ca.cert_pem);
        let files = |cert: &certs::Issued| TlsFiles {
            cert: Some(write(dir.path(), "m.crt", &cert.cert_pem)),
            key: Some(write(dir.path(), "m.key", &cert.key_pem)),
            ca: ca_path.clone(),
        };
        let state = TlsState::load(files(&one), Holder::Member(1)).expect("member 1 loads");
        assert!(state.server_config().is_some());
        let wrong_member = TlsState::load(files(&one), Holder::Member(2)).expect_err("not 2");
        assert!(
            wrong_member
                .to_string()
                .contains("does not name member 2 (a member's certificate carries the DNS name 2.members.keel"),
            "{wrong_member}"
        );
        let wrong_ca = TlsState::load(files(&stranger), Holder::Member(1)).expect_err("other CA");
        assert!(
            wrong_ca.to_string().contains("does not chain to the CA"),
            "{wrong_ca}"
        );
        // A reload that finds a bad file keeps what it had.
        std::fs::write(dir.path().join("m.crt"), "not a certificate").expect("write");
        let refused = state.reload().expect_err("no certificate");
        assert!(
            refused.to_string().contains("--tls-cert") && refused.to_string().contains("m.crt"),
            "{refused}"
        );
        assert!(state.server_config().is_some());
    }

    #[test]
    fn missing_and_mismatched_files_are_named() {
        let dir = tempfile::tempdir().expect("tempdir");
        let ca = certs::new_ca("test").expect("ca");
        let one = ca.issue_member(1, &[], 30).expect("1");
        let two = ca.issue_member(2, &[], 30).expect("2");
        let files = TlsFiles {
            cert: Some(write(dir.path(), "1.crt", &one.cert_pem)),
            key: Some(write(dir.path(), "2.key", &two.key_pem)),
            ca: write(dir.path(), "ca.crt", &ca.cert_pem),
        };
        let mismatched = TlsState::load(files.clone(), Holder::Member(1)).expect_err("key of 2");
        assert!(
            mismatched.to_string().contains("--tls-key")
                && mismatched.to_string().contains("2.key"),
            "{mismatched}"
        );
        let missing = TlsState::load(
            TlsFiles {
                ca: dir.path().join("nowhere.crt"),
                ..files
            },
            Holder::Member(1),
        )
        .expect_err("no CA file");
        assert!(
            missing.to_string().starts_with("--tls-ca ")
                && missing.to_string().contains("nowhere.crt"),
            "{missing}"
        );
        assert!(matches!(
            TlsFiles::from_flags(Some("c".into()), None, Some("a".into()), "keel server"),
            Err(TlsError::Incomplete(_))
        ));
        assert_eq!(
            TlsFiles::from_flags(None, None, None, "keel server").expect("none"),
            None
        );
    }

    #[test]
    fn a_client_verifies_the_host_it_dialled() {
        let name = |a: &str| server_name_of(a).expect(a).to_str().into_owned();
        assert_eq!(name("127.0.0.1:7070"), "127.0.0.1");
        assert_eq!(name("https://keel-0.keel.svc:7070"), "keel-0.keel.svc");
        assert_eq!(name("[::1]:7070"), "::1");
        assert_eq!(name("localhost"), "localhost");
    }
}
