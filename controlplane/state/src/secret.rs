//! Secrets (issue 35): values a job's environment takes from a named
//! secret instead of its spec, so credentials are never in the log, the
//! journal, snapshots or any answer in the clear.
//!
//! A secret is a name and a few keys, each with a sealed value: the
//! ciphertext of an authenticated cipher under one of the operators' keys
//! (the key's id, a nonce and the ciphertext; the server seals and the
//! leader opens, see `keel::secret_keys`). The state holds only sealed
//! values, and a spec only references (`NAME/KEY`), so every replica, the
//! journal and every snapshot carry ciphertext alone.
//!
//! Who may use a secret: the actor that put it (its owner), and every job
//! of the queue it names, if it names one. A secret put without an actor
//! (ACLs off, no client certificate) may be used by any job.
//!
//! Absences: no cipher, no key and no clock here; this module knows what
//! a secret is and which changes are valid.

use std::collections::BTreeMap;
use std::fmt;

use serde::{Deserialize, Serialize};

/// Limits on what the secret commands carry.
pub mod limits {
    /// A secret's name: 1 to this many bytes (a DNS label).
    pub const SECRET_NAME_MAX_LEN: usize = 63;
    /// A key's name within a secret: 1 to this many bytes.
    pub const SECRET_KEY_MAX_LEN: usize = 128;
    /// The most keys one secret holds.
    pub const SECRET_KEYS_MAX: usize = 64;
    /// The longest value, in bytes (before sealing; it becomes an
    /// environment variable's value: `spec::limits::ENV_VALUE_MAX_LEN`).
    pub const SECRET_VALUE_MAX_LEN: usize = 8192;
    /// The most secrets a cluster keeps.
    pub const SECRETS_MAX: usize = 10_000;
    /// A sealed value's key id: this many bytes or fewer.
    pub const KEY_ID_MAX_LEN: usize = 64;
    /// A sealed value's nonce: this many bytes or fewer.
    pub const NONCE_MAX_LEN: usize = 64;
    /// The authentication tag and framing a cipher may add to a value.
    pub const SEAL_OVERHEAD_MAX: usize = 64;
}

/// Where a job's environment variable takes its value: key `key` of secret
/// `name`, written `NAME/KEY`.
#[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize)]
pub struct SecretRef {
    pub name: String,
    pub key: String,
}

impl SecretRef {
    /// Reads `NAME/KEY`, checking both parts; `field` names the place in a
    /// refusal.
    pub fn parse(field: &str, text: &str) -> Result<SecretRef, SecretError> {
        let Some((name, key)) = text.split_once('/') else {
            return Err(invalid(
                field,
                format!("{text:?} is not a secret reference: NAME/KEY, e.g. tracker/api_key"),
            ));
        };
        let reference = SecretRef {
            name: name.into(),
            key: key.into(),
        };
        reference.validate(field)?;
        Ok(reference)
    }

    /// Checks both parts' form; `field` names the place in a refusal.
    pub fn validate(&self, field: &str) -> Result<(), SecretError> {
        validate_secret_name(field, &self.name)?;
        validate_key_name(field, &self.key)
    }
}

impl fmt::Display for SecretRef {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}/{}", self.name, self.key)
    }
}

/// A value sealed by an authenticated cipher. Its `Debug` shows sizes
/// only.
#[derive(Clone, PartialEq, Eq, Serialize, Deserialize, crate::proto_form::ProtoForm)]
#[proto(message = "keel_proto::entry::SealedValue")]
pub struct SealedValue {
    /// Which of the operators' keys sealed it (a digest of the key, never
    /// the key).
    pub key_id: String,
    pub nonce: Vec<u8>,
    pub ciphertext: Vec<u8>,
}

impl fmt::Debug for SealedValue {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("SealedValue")
            .field("key_id", &self.key_id)
            .field("nonce_len", &self.nonce.len())
            .field("ciphertext_len", &self.ciphertext.len())
            .finish()
    }
}

impl SealedValue {
    /// Checks its sizes; `field` names the key in a refusal.
    pub fn validate(&self, field: &str) -> Result<(), SecretError> {
        let key_id_ok = !self.key_id.is_empty()
            && self.key_id.len() <= limits::KEY_ID_MAX_LEN
            && self.key_id.bytes().all(|b| b.is_ascii_alphanumeric());
        if !key_id_ok {
            return Err(invalid(
                field,
                format!(
                    "the key id is 1 to {} letters and digits",
                    limits::KEY_ID_MAX_LEN
                ),
            ));
        }
        if self.nonce.is_empty() || self.nonce.len() > limits::NONCE_MAX_LEN {
            return Err(invalid(
                field,
                format!(
                    "the nonce is {} bytes; 1 to {} are allowed",
                    self.nonce.len(),
                    limits::NONCE_MAX_LEN
                ),
            ));
        }
        let most = limits::SECRET_VALUE_MAX_LEN + limits::SEAL_OVERHEAD_MAX;
        if self.ciphertext.len() > most {
            return Err(SecretError::TooLarge {
                field: field.into(),
                len: self.ciphertext.len(),
                limit: most,
            });
        }
        Ok(())
    }
}

/// A secret as the state keeps it.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Secret {
    /// Each key's sealed value, by key.
    pub values: BTreeMap<String, SealedValue>,
    /// Who put it (the entry's actor); `None`: any job may use it.
    pub owner: Option<String>,
    /// The queue whose jobs may use it besides its owner's (empty: none).
    pub queue: String,
    /// 1 when created, one more at each put: a re-seal names the revision
    /// it read, so it never overwrites a newer value.
    pub revision: u64,
    /// When it was last put (log time).
    pub changed_at_ms: u64,
}

/// Why a secret command, or a job's reference, is refused.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error, Serialize, Deserialize)]
pub enum SecretError {
    #[error("no secret is named {0:?} (keel secret list shows them)")]
    Unknown(String),
    #[error("secret {name:?} has no key {key:?} (it has {keys})")]
    UnknownKey {
        name: String,
        key: String,
        keys: String,
    },
    #[error("secret {name:?} is at revision {current}, not {expected}: it changed since it was read; read it again")]
    RevisionMoved {
        name: String,
        expected: u64,
        current: u64,
    },
    #[error("secret {name:?} is used by {jobs} unfinished jobs (job {first} the first); cancel them, or wait for them to end, before deleting it")]
    InUse {
        name: String,
        jobs: usize,
        first: u64,
    },
    #[error("{field}: {reason}")]
    NotYours { field: String, reason: String },
    #[error("the cluster holds {limit} secrets, the limit; delete some first")]
    TooMany { limit: usize },
    #[error("{field} is {len} bytes; the limit is {limit}")]
    TooLarge {
        field: String,
        len: usize,
        limit: usize,
    },
    #[error("{field} is invalid: {reason}")]
    Invalid { field: String, reason: String },
}

fn invalid(field: &str, reason: String) -> SecretError {
    SecretError::Invalid {
        field: field.into(),
        reason,
    }
}

/// Checks a secret's name: 1 to [`limits::SECRET_NAME_MAX_LEN`] lower-case
/// letters, digits and `-`, starting with a letter or digit.
pub fn validate_secret_name(field: &str, name: &str) -> Result<(), SecretError> {
    let ok = !name.is_empty()
        && name.len() <= limits::SECRET_NAME_MAX_LEN
        && !name.starts_with('-')
        && name
            .bytes()
            .all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b == b'-');
    if ok {
        return Ok(());
    }
    Err(invalid(
        field,
        format!(
            "{name:?} is not a secret name (1 to {} lower-case letters, digits and '-', not starting with '-')",
            limits::SECRET_NAME_MAX_LEN
        ),
    ))
}

/// Checks a key's name within a secret: 1 to [`limits::SECRET_KEY_MAX_LEN`]
/// letters, digits, `_`, `-` and `.`.
pub fn validate_key_name(field: &str, key: &str) -> Result<(), SecretError> {
    let ok = !key.is_empty()
        && key.len() <= limits::SECRET_KEY_MAX_LEN
        && key
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || matches!(b, b'_' | b'-' | b'.'));
    if ok {
        return Ok(());
    }
    Err(invalid(
        field,
        format!(
            "{key:?} is not a key name (1 to {} letters, digits, '_', '-' and '.')",
            limits::SECRET_KEY_MAX_LEN
        ),
    ))
}

/// The cluster's secrets, by name.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct Secrets {
    secrets: BTreeMap<String, Secret>,
}

impl Secrets {
    /// The secrets, by name, as [`Secrets::put`] left them (snapshots).
    pub fn from_parts(secrets: BTreeMap<String, Secret>) -> Secrets {
        Secrets { secrets }
    }

    /// Whether there is none: a state without secrets encodes and hashes
    /// as before they existed.
    pub fn is_unset(&self) -> bool {
        self.secrets.is_empty()
    }

    /// Every secret, by name.
    pub fn all(&self) -> &BTreeMap<String, Secret> {
        &self.secrets
    }

    pub fn get(&self, name: &str) -> Option<&Secret> {
        self.secrets.get(name)
    }

    /// Creates or replaces secret `name`; `replaces_revision`: the
    /// revision its writer read (a re-seal), refused if it moved. Returns
    /// the new revision.
    pub fn put(
        &mut self,
        name: &str,
        values: &BTreeMap<String, SealedValue>,
        queue: &str,
        replaces_revision: Option<u64>,
        at_ms: u64,
        actor: Option<&String>,
    ) -> Result<u64, SecretError> {
        validate_secret_name("name", name)?;
        if values.is_empty() {
            return Err(invalid("values", "a secret needs at least one key".into()));
        }
        if values.len() > limits::SECRET_KEYS_MAX {
            return Err(invalid(
                "values",
                format!(
                    "{} keys; the limit is {}",
                    values.len(),
                    limits::SECRET_KEYS_MAX
                ),
            ));
        }
        for (key, value) in values {
            validate_key_name("values", key)?;
            value.validate(&format!("values.{key}"))?;
        }
        let existing = self.secrets.get(name);
        if let Some(expected) = replaces_revision {
            let current = existing.map_or(0, |s| s.revision);
            if current != expected {
                return Err(SecretError::RevisionMoved {
                    name: name.into(),
                    expected,
                    current,
                });
            }
        }
        if existing.is_none() && self.secrets.len() >= limits::SECRETS_MAX {
            return Err(SecretError::TooMany {
                limit: limits::SECRETS_MAX,
            });
        }
        // Who made it owns it: a replace (an admin's, a re-seal) keeps the
        // owner, so the owner's jobs go on using it.
        let owner = match existing {
            Some(s) => s.owner.clone(),
            None => actor.cloned(),
        };
        let revision = existing.map_or(0, |s| s.revision) + 1;
        self.secrets.insert(
            name.into(),
            Secret {
                values: values.clone(),
                owner,
                queue: queue.into(),
                revision,
                changed_at_ms: at_ms,
            },
        );
        Ok(revision)
    }

    /// Removes secret `name`; refused while `users` (unfinished jobs that
    /// reference it) is not empty.
    pub fn delete(&mut self, name: &str, users: &[u64]) -> Result<(), SecretError> {
        if !self.secrets.contains_key(name) {
            return Err(SecretError::Unknown(name.into()));
        }
        if let Some(first) = users.first() {
            return Err(SecretError::InUse {
                name: name.into(),
                jobs: users.len(),
                first: *first,
            });
        }
        self.secrets.remove(name);
        Ok(())
    }

    /// Checks that a job submitted by `job_owner` to queue `job_queue` may
    /// use `reference` (at `field`): the secret and key exist, and the job
    /// is its owner's or its queue's.
    pub fn check_use(
        &self,
        field: &str,
        reference: &SecretRef,
        job_owner: Option<&String>,
        job_queue: &str,
    ) -> Result<(), SecretError> {
        let secret = self
            .secrets
            .get(&reference.name)
            .ok_or_else(|| SecretError::Unknown(reference.name.clone()))?;
        if !secret.values.contains_key(&reference.key) {
            return Err(SecretError::UnknownKey {
                name: reference.name.clone(),
                key: reference.key.clone(),
                keys: secret.values.keys().cloned().collect::<Vec<_>>().join(", "),
            });
        }
        let Some(owner) = &secret.owner else {
            return Ok(());
        };
        let queue_of = |q: &str| crate::quota::queue_of(q).to_string();
        if job_owner == Some(owner)
            || (!secret.queue.is_empty() && queue_of(&secret.queue) == queue_of(job_queue))
        {
            return Ok(());
        }
        Err(SecretError::NotYours {
            field: field.into(),
            reason: format!(
                "secret {:?} belongs to {owner}{}; a job of {} in queue {:?} may not use it",
                reference.name,
                if secret.queue.is_empty() {
                    String::new()
                } else {
                    format!(" and queue {:?}", secret.queue)
                },
                job_owner.map_or("nobody", String::as_str),
                queue_of(job_queue),
            ),
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn sealed(len: usize) -> SealedValue {
        SealedValue {
            key_id: "k1".into(),
            nonce: vec![7; 24],
            ciphertext: vec![1; len],
        }
    }

    fn values(keys: &[&str]) -> BTreeMap<String, SealedValue> {
        keys.iter().map(|k| (k.to_string(), sealed(16))).collect()
    }

    #[test]
    fn references_and_names_are_checked_naming_the_field() {
        let r = SecretRef::parse("env.KEY", "tracker/api_key").expect("valid");
        assert_eq!(r.to_string(), "tracker/api_key");
        for bad in ["tracker", "Tracker/k", "/k", "tracker/", "t/k k", "-t/k"] {
            let e = SecretRef::parse("env.KEY", bad).unwrap_err().to_string();
            assert!(e.starts_with("env.KEY is invalid"), "{bad}: {e}");
        }
        let mut s = Secrets::default();
        let e = s
            .put("x", &values(&["a"; 0]), "", None, 1, None)
            .unwrap_err();
        assert!(e.to_string().contains("at least one key"), "{e}");
        let mut too_big = values(&["a"]);
        too_big.insert(
            "b".into(),
            sealed(limits::SECRET_VALUE_MAX_LEN + limits::SEAL_OVERHEAD_MAX + 1),
        );
        let e = s.put("x", &too_big, "", None, 1, None).unwrap_err();
        assert!(e.to_string().starts_with("values.b is 8257 bytes"), "{e}");
        let many: Vec<String> = (0..=limits::SECRET_KEYS_MAX)
            .map(|i| format!("k{i}"))
            .collect();
        let many: Vec<&str> = many.iter().map(String::as_str).collect();
        let e = s.put("x", &values(&many), "", None, 1, None).unwrap_err();
        assert!(e.to_string().contains("the limit is 64"), "{e}");
        assert!(s.is_unset());
    }

    #[test]
    fn a_reseal_names_the_revision_it_read_and_keeps_the_owner() {
        let mut s = Secrets::default();
        let alice = "token:alice".to_string();
        let admin = "token:root".to_string();
        assert_eq!(
            s.put("db", &values(&["pw"]), "", None, 1, Some(&alice)),
            Ok(1)
        );
        assert_eq!(
            s.put("db", &values(&["pw"]), "", Some(1), 2, Some(&admin)),
            Ok(2)
        );
        assert_eq!(
            s.get("db").and_then(|d| d.owner.clone()),
            Some(alice.clone())
        );
        // A plain replace by another (an admin) keeps the owner too.
        assert_eq!(
            s.put("db", &values(&["pw"]), "", None, 3, Some(&admin)),
            Ok(3)
        );
        assert_eq!(s.get("db").and_then(|d| d.owner.clone()), Some(alice));
        // A re-seal of what was read before a newer put changes nothing.
        assert_eq!(
            s.put("db", &values(&["pw"]), "", Some(1), 4, Some(&admin)),
            Err(SecretError::RevisionMoved {
                name: "db".into(),
                expected: 1,
                current: 3
            })
        );
        assert_eq!(s.get("db").map(|d| d.changed_at_ms), Some(3));
    }

    #[test]
    fn only_its_owner_and_its_queue_use_a_secret_and_a_used_one_is_kept() {
        let mut s = Secrets::default();
        let alice = "token:alice".to_string();
        let bob = "token:bob".to_string();
        s.put("db", &values(&["pw"]), "team-a", None, 1, Some(&alice))
            .expect("put");
        s.put("open", &values(&["pw"]), "", None, 1, None)
            .expect("put");
        let r = |name: &str, key: &str| SecretRef {
            name: name.into(),
            key: key.into(),
        };
        assert_eq!(
            s.check_use("env.P", &r("db", "pw"), Some(&alice), ""),
            Ok(())
        );
        assert_eq!(
            s.check_use("env.P", &r("db", "pw"), Some(&bob), "team-a"),
            Ok(())
        );
        assert_eq!(
            s.check_use("env.P", &r("open", "pw"), Some(&bob), ""),
            Ok(())
        );
        let e = s
            .check_use("env.P", &r("db", "pw"), Some(&bob), "")
            .unwrap_err()
            .to_string();
        assert!(
            e.contains("env.P: secret \"db\" belongs to token:alice and queue \"team-a\"")
                && e.contains("token:bob in queue \"default\""),
            "{e}"
        );
        let e = s
            .check_use("env.P", &r("db", "user"), Some(&alice), "")
            .unwrap_err();
        assert!(
            e.to_string().contains("has no key \"user\" (it has pw)"),
            "{e}"
        );
        assert_eq!(
            s.check_use("env.P", &r("nope", "pw"), None, ""),
            Err(SecretError::Unknown("nope".into()))
        );
        assert_eq!(
            s.delete("db", &[4, 9]),
            Err(SecretError::InUse {
                name: "db".into(),
                jobs: 2,
                first: 4
            })
        );
        assert_eq!(s.delete("db", &[]), Ok(()));
        assert_eq!(s.delete("db", &[]), Err(SecretError::Unknown("db".into())));
    }

    #[test]
    fn a_sealed_value_shows_no_bytes_in_debug() {
        let v = SealedValue {
            key_id: "k1".into(),
            nonce: vec![0xAB; 24],
            ciphertext: b"opaque-bytes".to_vec(),
        };
        let shown = format!("{v:?}");
        assert!(
            shown.contains("ciphertext_len: 12") && !shown.contains("171"),
            "{shown}"
        );
    }
}
