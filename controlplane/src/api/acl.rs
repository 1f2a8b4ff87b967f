//! The access-control calls of the API (issue 22, item 2): bootstrap,
//! tokens, and who the caller is. Who may call what is
//! [`crate::authz`]'s table.
//!
//! A secret is chosen by the client (the CLI always does, so a retry with
//! the same request id repeats the same command and gets the first answer)
//! or, for a client that sends no request id, made here. Only its hash is
//! proposed: no log entry, snapshot or journal record holds a secret.

use keel_proto::api;
use keel_state::acl::{self, Role, SecretHash};
use keel_state::{Command, Event};
use tonic::{Request, Response, Status};

use super::KeelApi;
use crate::authz::Right;
use crate::grpc_status::ApiError;

/// The bootstrap token's name when the request gives none.
pub const BOOTSTRAP_TOKEN_NAME: &str = "root";

/// The secret a request chose, checked, or a new one.
fn secret_of(secret: String, request_id: &str) -> Result<String, ApiError> {
    if secret.is_empty() {
        if !request_id.is_empty() {
            return Err(ApiError::InvalidArgument {
                field: "secret",
                message: "a request with a request_id must choose its secret: a retry repeats \
                          its command, and a secret made here would differ each time"
                    .into(),
            });
        }
        return crate::authz::new_secret();
    }
    acl::validate_secret(&secret).map_err(|e| ApiError::Refused(e.into()))?;
    Ok(secret)
}

impl KeelApi {
    pub(super) async fn bootstrap_acl_call(
        &self,
        request: Request<api::BootstrapAclRequest>,
    ) -> Result<Response<api::TokenSecret>, Status> {
        self.require_acl()?;
        let actor = self.authorize(&request, Right::BootstrapAcl)?.actor();
        let req = request.into_inner();
        let name = if req.name.is_empty() {
            BOOTSTRAP_TOKEN_NAME.to_string()
        } else {
            req.name
        };
        acl::validate_token_name(&name).map_err(|e| ApiError::Refused(e.into()))?;
        let secret = secret_of(req.secret, &req.request_id)?;
        let (index, _) = self
            .propose_request(
                Command::bootstrap_acl(name.clone(), SecretHash::of(&secret)),
                req.request_id,
                actor,
            )
            .await?;
        tracing::info!(token = %name, index, "ACLs bootstrapped");
        Ok(Response::new(api::TokenSecret {
            name,
            role: Role::Admin.as_str().into(),
            secret,
            expires_at_ms: None,
            index,
        }))
    }

    pub(super) async fn create_token_call(
        &self,
        request: Request<api::CreateTokenRequest>,
    ) -> Result<Response<api::TokenSecret>, Status> {
        self.require_acl()?;
        let actor = self.authorize(&request, Right::ManageTokens)?.actor();
        let req = request.into_inner();
        acl::validate_token_name(&req.name).map_err(|e| ApiError::Refused(e.into()))?;
        let role = Role::parse(&req.role).ok_or_else(|| ApiError::InvalidArgument {
            field: "role",
            message: format!(
                "{:?} is not one of {}",
                req.role,
                Role::ALL.map(Role::as_str).join(", ")
            ),
        })?;
        let ttl_ms = match req.ttl_s {
            0 => None,
            s if s > acl::limits::TOKEN_TTL_MAX_MS / 1000 => {
                return Err(ApiError::InvalidArgument {
                    field: "ttl_s",
                    message: format!(
                        "{s} s; the limit is {} s (ten years)",
                        acl::limits::TOKEN_TTL_MAX_MS / 1000
                    ),
                }
                .into())
            }
            s => Some(s * 1000),
        };
        // Checked here too (apply decides), so a bad list is not logged.
        {
            let shared = self.node.state_machine.shared();
            let applied = shared.read();
            let known = applied.state.queues();
            acl::validate_token_queues(role, &req.queues, |q| known.exists(q))
                .map_err(|e| ApiError::Refused(e.into()))?;
        }
        let secret = secret_of(req.secret, &req.request_id)?;
        let (index, events) = self
            .propose_request(
                Command::CreateToken {
                    name: req.name.clone(),
                    role,
                    secret_hash: SecretHash::of(&secret),
                    ttl_ms,
                    queues: req.queues.clone(),
                },
                req.request_id,
                actor,
            )
            .await?;
        let expires_at_ms = events.iter().find_map(|e| match e {
            Event::TokenCreated { expires_at_ms, .. } => *expires_at_ms,
            _ => None,
        });
        tracing::info!(token = %req.name, %role, index, "token created");
        Ok(Response::new(api::TokenSecret {
            name: req.name,
            role: role.as_str().into(),
            secret,
            expires_at_ms,
            index,
        }))
    }

    pub(super) async fn list_tokens_call(
        &self,
        request: Request<api::ListTokensRequest>,
        stale: bool,
    ) -> Result<Response<api::ListTokensResponse>, Status> {
        self.require_acl()?;
        self.authorize(&request, Right::ManageTokens)?;
        if !stale {
            self.linearizable().await?;
        }
        let now_ms = (self.clock)();
        let shared = self.node.state_machine.shared();
        let applied = shared.read();
        let tokens = applied
            .state
            .acl()
            .tokens()
            .iter()
            .map(|(name, t)| api::TokenInfo {
                name: name.clone(),
                role: t.role.as_str().into(),
                created_at_ms: t.created_at_ms,
                expires_at_ms: t.expires_at_ms,
                created_by: t.created_by.clone().unwrap_or_default(),
                expired: t.expired_at(now_ms),
                queues: t.queues.iter().cloned().collect(),
            })
            .collect();
        Ok(Response::new(api::ListTokensResponse { tokens }))
    }

    pub(super) async fn revoke_token_call(
        &self,
        request: Request<api::RevokeTokenRequest>,
    ) -> Result<Response<api::RevokeTokenResponse>, Status> {
        self.require_acl()?;
        let actor = self.authorize(&request, Right::ManageTokens)?.actor();
        let req = request.into_inner();
        // Checked before it is logged, as a create's name is.
        acl::validate_token_name(&req.name).map_err(|e| ApiError::Refused(e.into()))?;
        let (index, _) = self
            .propose_request(
                Command::revoke_token(req.name.clone()),
                req.request_id,
                actor,
            )
            .await?;
        tracing::info!(token = %req.name, index, "token revoked");
        Ok(Response::new(api::RevokeTokenResponse { index }))
    }

    pub(super) async fn who_am_i_call(
        &self,
        request: Request<api::WhoAmIRequest>,
    ) -> Result<Response<api::WhoAmIResponse>, Status> {
        let caller = self.caller(&request)?;
        Ok(Response::new(api::WhoAmIResponse {
            acl: self.acl,
            actor: caller.actor().unwrap_or_default(),
            role: caller.role_name().into(),
            queues: caller.queues().into_iter().collect(),
        }))
    }
}
