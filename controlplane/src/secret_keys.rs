//! The operators' secret keys (issue 35): sealing a secret's values when a
//! server takes them, and opening them when the leader launches a worker.
//!
//! A key is 32 random bytes, written as 64 hex digits (`keel secret
//! new-key`), given to every replica by `--secret-key-file` (repeatable;
//! the first seals, every one opens) or `KEEL_SECRET_KEY`. A key never
//! enters the log: a sealed value names its key by a digest (`key_id`).
//!
//! The cipher is XChaCha20-Poly1305. The associated data binds a value to
//! its secret and key, so a sealed value moved to another place does not
//! open. The nonce is derived from the value, its place and the request
//! (a keyed BLAKE3 of them, as in a synthetic-IV construction): a client's
//! retry seals to the same bytes, so the log's request-id check sees the
//! same command, and two different values never share a nonce.
//!
//! Absences: no key is logged, hashed into the state or sent anywhere; no
//! value is opened but by the leader's launch.

use std::fmt;
use std::path::Path;

use chacha20poly1305::aead::{Aead, KeyInit, Payload};
use chacha20poly1305::{XChaCha20Poly1305, XNonce};
use keel_state::secret::SealedValue;

/// The environment variable a key may come in (64 hex digits).
pub const SECRET_KEY_ENV: &str = "KEEL_SECRET_KEY";

/// Why a key cannot be read or a value cannot be sealed or opened.
#[derive(Debug, thiserror::Error)]
pub enum SecretKeyError {
    #[error("{source_name}: a secret key is 64 hex digits (keel secret new-key makes one)")]
    Malformed { source_name: String },
    #[error("cannot read the secret key file {path}: {error}")]
    Unreadable { path: String, error: String },
    #[error("this server holds no secret key: start every replica with --secret-key-file (or {SECRET_KEY_ENV}) to keep secrets")]
    NoKey,
    #[error("{what} is sealed with key {key_id}, which this server does not hold (its keys: {held}); start it with that key's --secret-key-file")]
    UnknownKey {
        what: String,
        key_id: String,
        held: String,
    },
    #[error("{what} does not open with key {key_id}: the key file holds another key under that id, or the value was altered")]
    DoesNotOpen { what: String, key_id: String },
    #[error("{what} opened to bytes that are not UTF-8 text")]
    NotText { what: String },
}

/// One key and its id.
#[derive(Clone)]
struct Key {
    id: String,
    bytes: [u8; 32],
}

/// The keys a server holds, the sealing one first. Its `Debug` shows ids
/// only.
#[derive(Clone, Default)]
pub struct SecretKeys {
    keys: Vec<Key>,
}

impl fmt::Debug for SecretKeys {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_list()
            .entries(self.keys.iter().map(|k| &k.id))
            .finish()
    }
}

/// A key's id: the first 8 bytes of a BLAKE3 key derivation, in hex.
fn key_id(bytes: &[u8; 32]) -> String {
    let derived = blake3::derive_key("keel 2026 secret key id v1", bytes);
    derived[..8].iter().map(|b| format!("{b:02x}")).collect()
}

/// Reads 64 hex digits (surrounding whitespace allowed).
fn parse_hex_key(source_name: &str, text: &str) -> Result<[u8; 32], SecretKeyError> {
    let malformed = || SecretKeyError::Malformed {
        source_name: source_name.into(),
    };
    let text = text.trim();
    if text.len() != 64 || !text.is_ascii() {
        return Err(malformed());
    }
    let mut bytes = [0u8; 32];
    for (i, byte) in bytes.iter_mut().enumerate() {
        *byte = u8::from_str_radix(&text[2 * i..2 * i + 2], 16).map_err(|_| malformed())?;
    }
    Ok(bytes)
}

/// A fresh key from the operating system's generator, in hex.
pub fn new_key_hex() -> Result<String, rand::Error> {
    use rand::RngCore;
    let mut bytes = [0u8; 32];
    rand::rngs::OsRng.try_fill_bytes(&mut bytes)?;
    Ok(bytes.iter().map(|b| format!("{b:02x}")).collect())
}

impl SecretKeys {
    /// The keys of `files` in order, then `env_key` (a key in hex, as
    /// [`SECRET_KEY_ENV`] holds it); the first seals. A key given twice
    /// counts once.
    pub fn load(files: &[impl AsRef<Path>], env_key: Option<&str>) -> Result<Self, SecretKeyError> {
        let mut keys = SecretKeys::default();
        for file in files {
            let path = file.as_ref();
            let text = std::fs::read_to_string(path).map_err(|e| SecretKeyError::Unreadable {
                path: path.display().to_string(),
                error: e.to_string(),
            })?;
            keys.add(parse_hex_key(&path.display().to_string(), &text)?);
        }
        if let Some(text) = env_key.filter(|t| !t.trim().is_empty()) {
            keys.add(parse_hex_key(SECRET_KEY_ENV, text)?);
        }
        Ok(keys)
    }

    fn add(&mut self, bytes: [u8; 32]) {
        let id = key_id(&bytes);
        if !self.keys.iter().any(|k| k.id == id) {
            self.keys.push(Key { id, bytes });
        }
    }

    /// The ids of the keys held, the sealing one first.
    pub fn ids(&self) -> Vec<String> {
        self.keys.iter().map(|k| k.id.clone()).collect()
    }

    /// The id of the key that seals, if any.
    pub fn sealing_id(&self) -> Option<&str> {
        self.keys.first().map(|k| k.id.as_str())
    }

    /// Whether a value sealed with `key_id` opens here.
    pub fn holds(&self, key_id: &str) -> bool {
        self.keys.iter().any(|k| k.id == key_id)
    }

    /// Seals `value` as key `key` of secret `name` with the sealing key;
    /// `context` (the request's id, or a re-seal's revision) goes into the
    /// nonce, so the same request seals to the same bytes.
    pub fn seal(
        &self,
        name: &str,
        key: &str,
        value: &[u8],
        context: &str,
    ) -> Result<SealedValue, SecretKeyError> {
        let sealing = self.keys.first().ok_or(SecretKeyError::NoKey)?;
        let nonce_key = blake3::derive_key("keel 2026 secret nonce v1", &sealing.bytes);
        let mut hasher = blake3::Hasher::new_keyed(&nonce_key);
        for part in [name.as_bytes(), key.as_bytes(), context.as_bytes(), value] {
            hasher.update(&(part.len() as u64).to_le_bytes());
            hasher.update(part);
        }
        let digest = hasher.finalize();
        let nonce = XNonce::from_slice(&digest.as_bytes()[..24]);
        let cipher = XChaCha20Poly1305::new((&sealing.bytes).into());
        let aad = associated_data(name, key);
        let ciphertext = cipher
            .encrypt(
                nonce,
                Payload {
                    msg: value,
                    aad: &aad,
                },
            )
            .map_err(|_| SecretKeyError::DoesNotOpen {
                what: format!("secret {name}/{key}"),
                key_id: sealing.id.clone(),
            })?;
        Ok(SealedValue {
            key_id: sealing.id.clone(),
            nonce: nonce.to_vec(),
            ciphertext,
        })
    }

    /// Opens key `key` of secret `name` to its text.
    pub fn open(
        &self,
        name: &str,
        key: &str,
        sealed: &SealedValue,
    ) -> Result<String, SecretKeyError> {
        let what = format!("secret {name}/{key}");
        let held = self
            .keys
            .iter()
            .find(|k| k.id == sealed.key_id)
            .ok_or_else(|| SecretKeyError::UnknownKey {
                what: what.clone(),
                key_id: sealed.key_id.clone(),
                held: if self.keys.is_empty() {
                    "none".into()
                } else {
                    self.ids().join(", ")
                },
            })?;
        let does_not_open = || SecretKeyError::DoesNotOpen {
            what: what.clone(),
            key_id: sealed.key_id.clone(),
        };
        if sealed.nonce.len() != 24 {
            return Err(does_not_open());
        }
        let cipher = XChaCha20Poly1305::new((&held.bytes).into());
        let aad = associated_data(name, key);
        let plain = cipher
            .decrypt(
                XNonce::from_slice(&sealed.nonce),
                Payload {
                    msg: &sealed.ciphertext,
                    aad: &aad,
                },
            )
            .map_err(|_| does_not_open())?;
        String::from_utf8(plain).map_err(|_| SecretKeyError::NotText { what })
    }
}

/// What a sealed value is bound to: its secret and key.
fn associated_data(name: &str, key: &str) -> Vec<u8> {
    let mut aad = b"keel secret v1\0".to_vec();
    aad.extend_from_slice(name.as_bytes());
    aad.push(0);
    aad.extend_from_slice(key.as_bytes());
    aad
}

#[cfg(test)]
mod tests {
    use super::*;

    fn keys(hex: &[&str]) -> SecretKeys {
        let mut k = SecretKeys::default();
        for h in hex {
            k.add(parse_hex_key("test", h).expect("hex"));
        }
        k
    }

    const A: &str = "000102030405060708090a0b0c0d0e0f101112131415161718191a1b1c1d1e1f";
    const B: &str = "ff0102030405060708090a0b0c0d0e0f101112131415161718191a1b1c1d1e1f";

    #[test]
    fn a_value_opens_where_it_was_sealed_only_with_its_key() {
        let a = keys(&[A]);
        let sealed = a
            .seal("tracker", "api_key", b"s3cr3t-value", "req-1")
            .expect("seals");
        assert!(!sealed
            .ciphertext
            .windows(b"s3cr3t-value".len())
            .any(|w| w == b"s3cr3t-value"));
        assert_eq!(
            a.open("tracker", "api_key", &sealed).expect("opens"),
            "s3cr3t-value"
        );
        // The same request seals to the same bytes; another does not.
        assert_eq!(
            a.seal("tracker", "api_key", b"s3cr3t-value", "req-1").ok(),
            Some(sealed.clone())
        );
        assert_ne!(
            a.seal("tracker", "api_key", b"s3cr3t-value", "req-2").ok(),
            Some(sealed.clone())
        );
        // Moved to another place, or altered: it does not open.
        let e = a.open("tracker", "other", &sealed).unwrap_err().to_string();
        assert!(e.contains("does not open"), "{e}");
        let mut altered = sealed.clone();
        altered.ciphertext[0] ^= 1;
        assert!(a.open("tracker", "api_key", &altered).is_err());
        // Another key: named, with the keys held.
        let b = keys(&[B]);
        let e = b
            .open("tracker", "api_key", &sealed)
            .unwrap_err()
            .to_string();
        assert!(
            e.contains(&format!("sealed with key {}", sealed.key_id)) && e.contains(&b.ids()[0]),
            "{e}"
        );
        // Both keys, the new one first: it seals, and the old still opens.
        let both = keys(&[B, A]);
        assert_eq!(both.sealing_id(), Some(b.ids()[0].as_str()));
        assert_eq!(
            both.open("tracker", "api_key", &sealed).expect("opens"),
            "s3cr3t-value"
        );
        let e = SecretKeys::default().seal("t", "k", b"v", "").unwrap_err();
        assert!(e.to_string().contains("--secret-key-file"), "{e}");
    }

    #[test]
    fn keys_are_read_from_files_and_the_environment_and_bad_ones_named() {
        let dir = tempfile::tempdir().expect("tempdir");
        let file = dir.path().join("key");
        std::fs::write(&file, format!("{A}\n")).expect("write");
        let loaded = SecretKeys::load(&[&file], Some(B)).expect("loads");
        assert_eq!(loaded.ids(), keys(&[A, B]).ids());
        let twice = SecretKeys::load(&[&file], Some(A)).expect("loads");
        assert_eq!(twice.ids().len(), 1, "a key given twice counts once");
        std::fs::write(&file, "not a key").expect("write");
        let e = SecretKeys::load(&[&file], None).unwrap_err().to_string();
        assert!(e.contains("64 hex digits") && e.contains("key"), "{e}");
        let e = SecretKeys::load(&[dir.path().join("missing")], None)
            .unwrap_err()
            .to_string();
        assert!(e.contains("cannot read the secret key file"), "{e}");
        let fresh = new_key_hex().expect("random");
        assert_eq!(parse_hex_key("x", &fresh).map(|_| ()).ok(), Some(()));
        assert_ne!(fresh, new_key_hex().expect("random"));
        assert_eq!(
            format!("{:?}", keys(&[A])),
            format!("[{:?}]", keys(&[A]).ids()[0])
        );
    }
}
