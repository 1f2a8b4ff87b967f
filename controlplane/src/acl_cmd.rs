//! `keel acl`: bootstrap a cluster's access control, and make, list and
//! revoke its tokens (issue 22, item 2).
//!
//! The secret of a new token is made here, by the CLI, and sent with the
//! request: a write sent again after a lost answer repeats the same command
//! under the same request id and gets the first answer, so the secret shown
//! is always the one the cluster keeps the hash of.

use std::io::Write;
use std::path::{Path, PathBuf};

use anyhow::Context;
use clap::Subcommand;
use keel_proto::api;
use serde::Serialize;

use crate::cli;
use crate::render::{self, Output};

#[derive(Subcommand, Debug)]
pub enum AclCmd {
    /// Turn access control on for good, once per cluster: makes the first
    /// token, an admin one, and shows its secret once. Every replica must
    /// run with `--acl` (and TLS).
    Bootstrap {
        /// The token's name.
        #[arg(long, default_value = keel::api::BOOTSTRAP_TOKEN_NAME)]
        name: String,
        #[command(flatten)]
        secret: SecretOut,
    },
    /// Tokens: make, list, revoke (admin).
    Token {
        #[command(subcommand)]
        command: TokenCmd,
    },
    /// Who the server takes this caller for, and its role.
    Whoami,
}

#[derive(Subcommand, Debug)]
pub enum TokenCmd {
    /// Make a token and show its secret once.
    Create {
        /// 1 to 64 letters, digits, '.', '_', '-' or '@'.
        #[arg(long)]
        name: String,
        /// admin (policy, membership, nodes, tokens), operator (nodes, any
        /// job), user (submit; its own jobs), viewer (read only), node
        /// (heartbeats only).
        #[arg(long)]
        role: String,
        /// How long it lives, e.g. `30d`, `12h` (default: until revoked).
        #[arg(long, value_parser = humantime::parse_duration)]
        ttl: Option<std::time::Duration>,
        /// A user token only: the queues its holder may submit jobs to
        /// (repeat, or comma-separated; `default` is the default queue).
        /// Default: any queue.
        #[arg(long = "queue", value_delimiter = ',')]
        queues: Vec<String>,
        #[command(flatten)]
        secret: SecretOut,
    },
    /// Every token: role, queues, expiry, who made it (never secrets).
    List,
    /// Revoke a token: its secret is refused from now on.
    Revoke { name: String },
}

/// Where a new token's secret goes.
#[derive(clap::Args, Debug)]
pub struct SecretOut {
    /// Write the secret to this file (created owner-only; never
    /// overwritten) instead of showing it: then `--token-file FILE`.
    #[arg(long)]
    secret_file: Option<PathBuf>,
}

#[derive(Serialize)]
struct Made<'a> {
    name: &'a str,
    role: &'a str,
    #[serde(skip_serializing_if = "Option::is_none")]
    secret: Option<&'a str>,
    #[serde(skip_serializing_if = "Option::is_none")]
    secret_file: Option<String>,
    expires_at_ms: Option<u64>,
    index: u64,
}

pub async fn run(addr: &str, command: AclCmd, out: Output) -> anyhow::Result<()> {
    match command {
        AclCmd::Bootstrap { name, secret } => {
            let chosen = keel::authz::new_secret().map_err(|e| anyhow::anyhow!("{e}"))?;
            check_free(secret.secret_file.as_deref())?;
            let made = cli::write(addr, |mut client, request_id| {
                let request = api::BootstrapAclRequest {
                    name: name.clone(),
                    secret: chosen.clone(),
                    request_id,
                };
                async move { client.bootstrap_acl(request).await }
            })
            .await?;
            show_made(&made, secret.secret_file.as_deref(), out)
        }
        AclCmd::Token {
            command:
                TokenCmd::Create {
                    name,
                    role,
                    ttl,
                    queues,
                    secret,
                },
        } => {
            let chosen = keel::authz::new_secret().map_err(|e| anyhow::anyhow!("{e}"))?;
            check_free(secret.secret_file.as_deref())?;
            let ttl_s = match ttl {
                None => 0,
                Some(d) if d.as_secs() == 0 => anyhow::bail!("--ttl must be at least 1 s"),
                Some(d) => d.as_secs(),
            };
            let made = cli::write(addr, |mut client, request_id| {
                let request = api::CreateTokenRequest {
                    name: name.clone(),
                    role: role.clone(),
                    ttl_s,
                    secret: chosen.clone(),
                    request_id,
                    queues: queues.clone(),
                };
                async move { client.create_token(request).await }
            })
            .await?;
            show_made(&made, secret.secret_file.as_deref(), out)
        }
        AclCmd::Token {
            command: TokenCmd::List,
        } => {
            let (list, _) = cli::read(addr, |mut client| async move {
                client.list_tokens(api::ListTokensRequest {}).await
            })
            .await?;
            render::tokens(&list, out)
        }
        AclCmd::Token {
            command: TokenCmd::Revoke { name },
        } => {
            let resp = cli::write(addr, |mut client, request_id| {
                let request = api::RevokeTokenRequest {
                    name: name.clone(),
                    request_id,
                };
                async move { client.revoke_token(request).await }
            })
            .await?;
            match out {
                Output::Json => render::print_json(&serde_json::json!({
                    "name": name, "index": resp.index
                })),
                Output::Table => {
                    writeln!(
                        std::io::stdout().lock(),
                        "token {name} revoked at index {}",
                        resp.index
                    )?;
                    Ok(())
                }
            }
        }
        AclCmd::Whoami => {
            let (who, _) = cli::read(addr, |mut client| async move {
                client.who_am_i(api::WhoAmIRequest {}).await
            })
            .await?;
            match out {
                Output::Json => render::print_json(&serde_json::json!({
                    "acl": who.acl, "actor": who.actor, "role": who.role, "queues": who.queues
                })),
                Output::Table => {
                    let actor = if who.actor.is_empty() {
                        "no identity (plaintext)"
                    } else {
                        &who.actor
                    };
                    let mut stdout = std::io::stdout().lock();
                    if who.acl && !who.queues.is_empty() {
                        writeln!(
                            stdout,
                            "{actor}, role {}, submits to queues {}",
                            who.role,
                            who.queues.join(", ")
                        )?;
                    } else if who.acl {
                        writeln!(stdout, "{actor}, role {}", who.role)?;
                    } else {
                        writeln!(
                            stdout,
                            "{actor} (this replica does not check callers: no --acl)"
                        )?;
                    }
                    Ok(())
                }
            }
        }
    }
}

/// Refuses, before anything is sent, a secret file that exists already.
fn check_free(file: Option<&Path>) -> anyhow::Result<()> {
    if let Some(file) = file.filter(|f| f.exists()) {
        anyhow::bail!(
            "{} exists already; a secret file is never overwritten",
            file.display()
        );
    }
    Ok(())
}

fn show_made(made: &api::TokenSecret, file: Option<&Path>, out: Output) -> anyhow::Result<()> {
    if let Some(file) = file {
        write_secret(file, &made.secret)?;
    }
    let shown = Made {
        name: &made.name,
        role: &made.role,
        secret: file.is_none().then_some(made.secret.as_str()),
        secret_file: file.map(|f| f.display().to_string()),
        expires_at_ms: made.expires_at_ms,
        index: made.index,
    };
    match out {
        Output::Json => render::print_json(&shown),
        Output::Table => {
            let mut stdout = std::io::stdout().lock();
            writeln!(
                stdout,
                "token {} (role {}) created at index {}{}",
                made.name,
                made.role,
                made.index,
                made.expires_at_ms
                    .map(|at| format!(", expires at {}", render::time(at)))
                    .unwrap_or_default()
            )?;
            match file {
                Some(file) => writeln!(
                    stdout,
                    "its secret is in {} (use it with --token-file)",
                    file.display()
                )?,
                None => {
                    writeln!(
                        stdout,
                        "secret (shown this once; the cluster keeps only its hash):"
                    )?;
                    writeln!(stdout, "{}", made.secret)?;
                }
            }
            Ok(())
        }
    }
}

/// Writes a secret to a new owner-only file.
fn write_secret(file: &Path, secret: &str) -> anyhow::Result<()> {
    use std::os::unix::fs::OpenOptionsExt;
    let mut f = std::fs::OpenOptions::new()
        .write(true)
        .create_new(true)
        .mode(0o600)
        .open(file)
        .with_context(|| format!("cannot create {}", file.display()))?;
    writeln!(f, "{secret}").with_context(|| format!("cannot write {}", file.display()))?;
    f.sync_all()
        .with_context(|| format!("cannot write {}", file.display()))?;
    Ok(())
}
