//! Making a cluster's certificates (`keel tls init` and `keel tls issue`):
//! a CA, member certificates that name their member
//! ([`super::member_name`]) and the hosts clients reach them by, and
//! client certificates that name their holder.

use std::time::{Duration, SystemTime, UNIX_EPOCH};

use rcgen::{
    BasicConstraints, CertificateParams, DnType, ExtendedKeyUsagePurpose, IsCa, Issuer, KeyPair,
    KeyUsagePurpose, SerialNumber,
};

/// How long a CA made by `keel tls init` is valid.
pub const CA_VALIDITY_DAYS: u32 = 3650;
/// The longest validity `keel tls issue --days` accepts.
pub const MAX_VALIDITY_DAYS: u32 = 3650;

/// Errors making certificates.
#[derive(Debug, thiserror::Error)]
pub enum CertError {
    #[error("making the certificate: {0}")]
    Rcgen(#[from] rcgen::Error),
    #[error("--days {0}: a certificate is valid for 1 to {MAX_VALIDITY_DAYS} days")]
    Days(u32),
    #[error("the name {0:?}: {1}")]
    Name(String, &'static str),
}

/// A certificate and its private key, both PEM.
#[derive(Debug, Clone)]
pub struct Issued {
    pub cert_pem: String,
    pub key_pem: String,
}

/// A CA that issues certificates.
pub struct Authority {
    pub cert_pem: String,
    pub key_pem: String,
    issuer: Issuer<'static, KeyPair>,
}

impl std::fmt::Debug for Authority {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Authority").finish_non_exhaustive()
    }
}

/// A new CA for the cluster `cluster`. Its common name says so, with a
/// random tag: two clusters' CAs never share a name, so a certificate
/// from the other is refused as from an unknown issuer.
pub fn new_ca(cluster: &str) -> Result<Authority, CertError> {
    let mut params = CertificateParams::new(Vec::<String>::new())?;
    let tag: u32 = rand::random();
    params.distinguished_name.push(
        DnType::CommonName,
        format!("Keel cluster CA {cluster} {tag:08x}"),
    );
    params.is_ca = IsCa::Ca(BasicConstraints::Constrained(0));
    params.key_usages = vec![
        KeyUsagePurpose::KeyCertSign,
        KeyUsagePurpose::CrlSign,
        KeyUsagePurpose::DigitalSignature,
    ];
    validity(&mut params, CA_VALIDITY_DAYS)?;
    let key = KeyPair::generate()?;
    let cert = params.self_signed(&key)?;
    let key_pem = key.serialize_pem();
    Ok(Authority {
        cert_pem: cert.pem(),
        key_pem,
        issuer: Issuer::new(params, key),
    })
}

/// The CA `keel tls init` made, read back to issue more.
pub fn load_ca(cert_pem: &str, key_pem: &str) -> Result<Authority, CertError> {
    let key = KeyPair::from_pem(key_pem)?;
    let issuer = Issuer::from_ca_cert_pem(cert_pem, key)?;
    Ok(Authority {
        cert_pem: cert_pem.to_string(),
        key_pem: key_pem.to_string(),
        issuer,
    })
}

impl Authority {
    /// A replica's certificate: it names member `id` and the `hosts` (DNS
    /// names or IP addresses) clients reach it by, and serves and calls
    /// (server and client authentication).
    pub fn issue_member(&self, id: u64, hosts: &[String], days: u32) -> Result<Issued, CertError> {
        let mut names = vec![super::member_name(id)];
        names.extend(hosts.iter().cloned());
        let mut params = CertificateParams::new(names)?;
        params
            .distinguished_name
            .push(DnType::CommonName, format!("keel member {id}"));
        params.extended_key_usages = vec![
            ExtendedKeyUsagePurpose::ServerAuth,
            ExtendedKeyUsagePurpose::ClientAuth,
        ];
        self.sign(params, days)
    }

    /// A client's certificate: it names its holder (its common name) and
    /// only calls.
    pub fn issue_client(&self, name: &str, days: u32) -> Result<Issued, CertError> {
        if name.is_empty() || name.len() > 64 {
            return Err(CertError::Name(name.into(), "1 to 64 characters"));
        }
        if name.ends_with(super::MEMBER_NAME_SUFFIX) {
            return Err(CertError::Name(
                name.into(),
                "a client is not named like a member",
            ));
        }
        let mut params = CertificateParams::new(Vec::<String>::new())?;
        params.distinguished_name.push(DnType::CommonName, name);
        params.extended_key_usages = vec![ExtendedKeyUsagePurpose::ClientAuth];
        self.sign(params, days)
    }

    fn sign(&self, mut params: CertificateParams, days: u32) -> Result<Issued, CertError> {
        if days == 0 || days > MAX_VALIDITY_DAYS {
            return Err(CertError::Days(days));
        }
        params.key_usages = vec![
            KeyUsagePurpose::DigitalSignature,
            KeyUsagePurpose::KeyEncipherment,
        ];
        params.use_authority_key_identifier_extension = true;
        validity(&mut params, days)?;
        let key = KeyPair::generate()?;
        let cert = params.signed_by(&key, &self.issuer)?;
        Ok(Issued {
            cert_pem: cert.pem(),
            key_pem: key.serialize_pem(),
        })
    }
}

/// Valid from an hour ago (clocks differ) for `days` days, with a random
/// serial number.
fn validity(params: &mut CertificateParams, days: u32) -> Result<(), CertError> {
    let now = SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .unwrap_or(Duration::ZERO)
        .as_secs() as i64;
    let at = |secs: i64| {
        time::OffsetDateTime::from_unix_timestamp(secs)
            .map_err(|_| CertError::Name(secs.to_string(), "not a time"))
    };
    params.not_before = at(now - 3600)?;
    params.not_after = at(now + i64::from(days) * 86_400)?;
    let serial: [u8; 16] = rand::random();
    // Positive (the top bit clear), as DER integers for serials must be.
    let mut serial = serial.to_vec();
    serial[0] &= 0x7f;
    params.serial_number = Some(SerialNumber::from_slice(&serial));
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_ca_read_back_issues_certificates_that_chain_to_it() {
        let ca = new_ca("test").expect("ca");
        let again = load_ca(&ca.cert_pem, &ca.key_pem).expect("read back");
        let member = again
            .issue_member(4, &["10.0.0.4".into(), "keel-3.keel".into()], 30)
            .expect("member 4");
        use rustls::pki_types::pem::PemObject;
        let der = rustls::pki_types::CertificateDer::from_pem_slice(member.cert_pem.as_bytes())
            .expect("pem");
        assert!(super::super::names_member(&der, 4));
        assert!(!super::super::names_member(&der, 3));
        assert!(matches!(
            ca.issue_client("alice", 0),
            Err(CertError::Days(0))
        ));
        assert!(matches!(
            ca.issue_client("3.members.keel", 30),
            Err(CertError::Name(..))
        ));
    }
}
