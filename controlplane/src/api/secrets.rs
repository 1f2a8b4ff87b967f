//! The secret calls of the API (issue 35): put, delete, list and re-seal
//! secrets. The leader seals a put's values with the operators' key
//! ([`crate::secret_keys`]) before proposing it, so the log holds only
//! ciphertext; no call answers with a value. An admin manages every
//! secret, a user those it put.

use std::collections::BTreeMap;

use keel_proto::api;
use keel_state::secret::{self, limits, SealedValue, SecretError};
use keel_state::Command;
use tonic::{Request, Response, Status};

use super::KeelApi;
use crate::authz::{Granted, Right};
use crate::grpc_status::ApiError;
use crate::secret_keys::SecretKeyError;

fn refused(e: SecretError) -> ApiError {
    ApiError::Refused(e.into())
}

/// A key problem as the API says it: the server cannot seal.
fn key_error(e: SecretKeyError) -> ApiError {
    ApiError::SecretKey(e.to_string())
}

/// Checks a put's values before sealing: names, sizes, UTF-8 text without
/// NUL (each becomes an environment variable's value).
fn checked_values(values: &BTreeMap<String, Vec<u8>>) -> Result<(), ApiError> {
    if values.is_empty() || values.len() > limits::SECRET_KEYS_MAX {
        return Err(ApiError::InvalidArgument {
            field: "values",
            message: format!(
                "a secret holds 1 to {} keys, not {}",
                limits::SECRET_KEYS_MAX,
                values.len()
            ),
        });
    }
    for (key, value) in values {
        secret::validate_key_name("values", key).map_err(refused)?;
        if value.len() > limits::SECRET_VALUE_MAX_LEN {
            return Err(refused(SecretError::TooLarge {
                field: format!("values.{key}"),
                len: value.len(),
                limit: limits::SECRET_VALUE_MAX_LEN,
            }));
        }
        if std::str::from_utf8(value).is_err() || value.contains(&0) {
            return Err(refused(SecretError::Invalid {
                field: format!("values.{key}"),
                reason:
                    "a value is UTF-8 text without NUL bytes (it becomes an environment variable)"
                        .into(),
            }));
        }
    }
    Ok(())
}

/// Refuses a caller that may not touch a secret owned by `owner`.
fn check_owner(granted: &Granted, name: &str, owner: Option<&str>) -> Result<(), ApiError> {
    if granted.reaches(owner) {
        return Ok(());
    }
    Err(ApiError::PermissionDenied {
        right: Right::ManageSecrets.name(),
        message: format!(
            "{} may manage its own secrets only, and secret {name:?} is {}'s: that needs role admin",
            granted.actor().unwrap_or_else(|| "this caller".into()),
            owner.unwrap_or("nobody")
        ),
    })
}

impl KeelApi {
    pub(super) async fn put_secret_call(
        &self,
        request: Request<api::PutSecretRequest>,
    ) -> Result<Response<api::SecretChangeResponse>, Status> {
        let granted = self.authorize(&request, Right::ManageSecrets)?;
        let req = request.into_inner();
        secret::validate_secret_name("name", &req.name).map_err(refused)?;
        checked_values(&req.values)?;
        {
            let shared = self.node.state_machine.shared();
            let applied = shared.read();
            if !req.queue.is_empty() && !applied.state.queues().exists(&req.queue) {
                return Err(ApiError::InvalidArgument {
                    field: "queue",
                    message: format!(
                        "no queue is named {:?} (keel queue list shows them)",
                        req.queue
                    ),
                }
                .into());
            }
            if let Some(existing) = applied.state.secrets().get(&req.name) {
                check_owner(&granted, &req.name, existing.owner.as_deref())?;
            }
        }
        let mut values: BTreeMap<String, SealedValue> = BTreeMap::new();
        for (key, value) in &req.values {
            let sealed = self
                .secret_keys
                .seal(&req.name, key, value, &req.request_id)
                .map_err(key_error)?;
            values.insert(key.clone(), sealed);
        }
        let command = Command::put_secret(req.name.clone(), values, req.queue);
        let (index, events) = self
            .propose_request(command, req.request_id, granted.actor())
            .await?;
        let revision = events
            .iter()
            .find_map(|e| match e {
                keel_state::Event::SecretPut { revision, .. } => Some(*revision),
                _ => None,
            })
            .unwrap_or_default();
        tracing::info!(secret = %req.name, index, revision, "secret put");
        Ok(Response::new(api::SecretChangeResponse { index, revision }))
    }

    pub(super) async fn delete_secret_call(
        &self,
        request: Request<api::DeleteSecretRequest>,
    ) -> Result<Response<api::SecretChangeResponse>, Status> {
        let granted = self.authorize(&request, Right::ManageSecrets)?;
        let req = request.into_inner();
        secret::validate_secret_name("name", &req.name).map_err(refused)?;
        {
            let shared = self.node.state_machine.shared();
            let applied = shared.read();
            let existing = applied
                .state
                .secrets()
                .get(&req.name)
                .ok_or_else(|| refused(SecretError::Unknown(req.name.clone())))?;
            check_owner(&granted, &req.name, existing.owner.as_deref())?;
        }
        let command = Command::delete_secret(req.name.clone());
        let (index, _) = self
            .propose_request(command, req.request_id, granted.actor())
            .await?;
        tracing::info!(secret = %req.name, index, "secret deleted");
        Ok(Response::new(api::SecretChangeResponse {
            index,
            revision: 0,
        }))
    }

    pub(super) async fn list_secrets_call(
        &self,
        request: Request<api::ListSecretsRequest>,
        stale: bool,
    ) -> Result<Response<api::ListSecretsResponse>, Status> {
        let granted = self.authorize(&request, Right::ManageSecrets)?;
        if !stale {
            self.linearizable().await?;
        }
        let shared = self.node.state_machine.shared();
        let applied = shared.read();
        let secrets = applied
            .state
            .secrets()
            .all()
            .iter()
            .filter(|(_, s)| granted.reaches(s.owner.as_deref()))
            .map(|(name, s)| {
                let mut key_ids: Vec<String> =
                    s.values.values().map(|v| v.key_id.clone()).collect();
                key_ids.sort();
                key_ids.dedup();
                api::SecretInfo {
                    name: name.clone(),
                    keys: s.values.keys().cloned().collect(),
                    owner: s.owner.clone().unwrap_or_default(),
                    queue: s.queue.clone(),
                    revision: s.revision,
                    changed_at_ms: s.changed_at_ms,
                    opens_here: key_ids.iter().all(|id| self.secret_keys.holds(id)),
                    key_ids,
                }
            })
            .collect();
        Ok(Response::new(api::ListSecretsResponse {
            secrets,
            key_ids_held: self.secret_keys.ids(),
        }))
    }

    pub(super) async fn rotate_secret_key_call(
        &self,
        request: Request<api::RotateSecretKeyRequest>,
    ) -> Result<Response<api::RotateSecretKeyResponse>, Status> {
        let granted = self.authorize(&request, Right::ManageSecrets)?;
        if !granted.reaches(None) {
            return Err(ApiError::PermissionDenied {
                right: Right::ManageSecrets.name(),
                message: format!(
                    "{} may not re-seal every secret: that needs role admin",
                    granted.actor().unwrap_or_else(|| "this caller".into())
                ),
            }
            .into());
        }
        let key_id = self
            .secret_keys
            .sealing_id()
            .ok_or_else(|| key_error(SecretKeyError::NoKey))?
            .to_string();
        self.linearizable().await?;
        // Re-sealed from what was read: each put names the revision it
        // read, so a secret put in between is refused, not overwritten.
        let (todo, already_current) = {
            let shared = self.node.state_machine.shared();
            let applied = shared.read();
            let mut todo = Vec::new();
            let mut current = 0u32;
            for (name, s) in applied.state.secrets().all() {
                if s.values.values().all(|v| v.key_id == key_id) {
                    current += 1;
                    continue;
                }
                let mut values = BTreeMap::new();
                for (key, sealed) in &s.values {
                    let value = self
                        .secret_keys
                        .open(name, key, sealed)
                        .map_err(key_error)?;
                    let context = format!("reseal {}", s.revision);
                    let resealed = self
                        .secret_keys
                        .seal(name, key, value.as_bytes(), &context)
                        .map_err(key_error)?;
                    values.insert(key.clone(), resealed);
                }
                todo.push(Command::PutSecret {
                    name: name.clone(),
                    values,
                    queue: s.queue.clone(),
                    replaces_revision: Some(s.revision),
                });
            }
            (todo, current)
        };
        let mut resealed = 0u32;
        for command in todo {
            self.propose_request(command, String::new(), granted.actor())
                .await?;
            resealed += 1;
        }
        tracing::info!(key_id = %key_id, resealed, "secrets re-sealed");
        Ok(Response::new(api::RotateSecretKeyResponse {
            key_id,
            resealed,
            already_current,
        }))
    }
}
