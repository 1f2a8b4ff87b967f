//! `keel secret`: put, list, delete and re-seal secrets (issue 35), and
//! make a key. A job takes a secret's key into a variable with
//! `env: {NAME: {secret: SECRET/KEY}}` in its spec; no command prints a
//! value.

use std::collections::BTreeMap;
use std::io::Write;
use std::path::PathBuf;

use anyhow::Context;
use clap::Subcommand;
use keel_proto::api;

use crate::cli;
use crate::render::{self, Output};

#[derive(Subcommand, Debug)]
pub enum SecretCmd {
    /// Create a secret, or replace one's keys and values as a whole (its
    /// owner or an admin).
    Create {
        /// 1 to 63 lower-case letters, digits and '-'.
        name: String,
        /// A key and its value, `KEY=VALUE` (repeatable). The value is on
        /// your command line: prefer --from-file.
        #[arg(long = "from-literal", value_name = "KEY=VALUE", value_parser = parse_literal)]
        from_literal: Vec<(String, String)>,
        /// A key and the file holding its value, `KEY=PATH` (repeatable;
        /// `-` reads standard input).
        #[arg(long = "from-file", value_name = "KEY=PATH", value_parser = parse_file)]
        from_file: Vec<(String, PathBuf)>,
        /// The queue whose jobs may use it besides yours.
        #[arg(long, default_value = "")]
        queue: String,
    },
    /// The secrets you may manage: keys, owner, queue, the keys sealing
    /// them; never a value.
    List,
    /// Delete a secret; refused while an unfinished job uses it.
    Delete { name: String },
    /// Re-seal every secret with the servers' first --secret-key-file
    /// (admin), so an old key can then be dropped.
    RotateKey,
    /// Print a fresh key (64 hex digits) for --secret-key-file.
    NewKey,
}

fn parse_literal(text: &str) -> Result<(String, String), String> {
    let (key, value) = text
        .split_once('=')
        .ok_or_else(|| format!("{text:?} is not KEY=VALUE"))?;
    Ok((key.to_string(), value.to_string()))
}

fn parse_file(text: &str) -> Result<(String, PathBuf), String> {
    let (key, path) = text
        .split_once('=')
        .ok_or_else(|| format!("{text:?} is not KEY=PATH"))?;
    Ok((key.to_string(), PathBuf::from(path)))
}

/// The values a `create` gives, read (files at most the value limit).
fn values(
    literals: Vec<(String, String)>,
    files: Vec<(String, PathBuf)>,
) -> anyhow::Result<BTreeMap<String, Vec<u8>>> {
    use std::io::Read;
    let limit = keel_state::secret::limits::SECRET_VALUE_MAX_LEN as u64;
    let mut out = BTreeMap::new();
    for (key, value) in literals {
        if out.insert(key.clone(), value.into_bytes()).is_some() {
            anyhow::bail!("key {key:?} is given twice");
        }
    }
    for (key, path) in files {
        let mut bytes = Vec::new();
        if path.as_os_str() == "-" {
            std::io::stdin()
                .take(limit + 1)
                .read_to_end(&mut bytes)
                .context("cannot read the value from stdin")?;
        } else {
            std::fs::File::open(&path)
                .with_context(|| format!("cannot open {}", path.display()))?
                .take(limit + 1)
                .read_to_end(&mut bytes)
                .with_context(|| format!("cannot read {}", path.display()))?;
        }
        if bytes.len() as u64 > limit {
            anyhow::bail!(
                "{} is larger than a value's limit of {limit} bytes",
                path.display()
            );
        }
        // A file's one trailing newline is the file's, not the value's.
        if bytes.ends_with(b"\n") {
            bytes.pop();
        }
        if out.insert(key.clone(), bytes).is_some() {
            anyhow::bail!("key {key:?} is given twice");
        }
    }
    if out.is_empty() {
        anyhow::bail!(
            "a secret needs at least one --from-literal KEY=VALUE or --from-file KEY=PATH"
        );
    }
    Ok(out)
}

pub async fn run(addr: &str, command: SecretCmd, out: Output) -> anyhow::Result<()> {
    match command {
        SecretCmd::Create {
            name,
            from_literal,
            from_file,
            queue,
        } => {
            let values = values(from_literal, from_file)?;
            let resp = cli::write(addr, |mut client, request_id| {
                let request = api::PutSecretRequest {
                    name: name.clone(),
                    values: values.clone(),
                    queue: queue.clone(),
                    request_id,
                };
                async move { client.put_secret(request).await }
            })
            .await?;
            render::changed(
                "secret",
                &format!("put (revision {})", resp.revision),
                &name,
                resp.index,
                out,
            )
        }
        SecretCmd::Delete { name } => {
            let resp = cli::write(addr, |mut client, request_id| {
                let request = api::DeleteSecretRequest {
                    name: name.clone(),
                    request_id,
                };
                async move { client.delete_secret(request).await }
            })
            .await?;
            render::changed("secret", "deleted", &name, resp.index, out)
        }
        SecretCmd::List => {
            let (list, _) = cli::read(addr, |mut client| async move {
                client.list_secrets(api::ListSecretsRequest {}).await
            })
            .await?;
            render::secrets(&list, out)
        }
        SecretCmd::RotateKey => {
            let resp = cli::write(addr, |mut client, _| async move {
                client
                    .rotate_secret_key(api::RotateSecretKeyRequest {})
                    .await
            })
            .await?;
            match out {
                Output::Json => render::print_json(&serde_json::json!({
                    "key_id": resp.key_id,
                    "resealed": resp.resealed,
                    "already_current": resp.already_current,
                })),
                Output::Table => {
                    writeln!(
                        std::io::stdout().lock(),
                        "every secret is sealed with key {}: {} re-sealed, {} already were",
                        resp.key_id,
                        resp.resealed,
                        resp.already_current
                    )?;
                    Ok(())
                }
            }
        }
        SecretCmd::NewKey => {
            let key = keel::secret_keys::new_key_hex()
                .map_err(|e| anyhow::anyhow!("no randomness for a key: {e}"))?;
            writeln!(std::io::stdout().lock(), "{key}")?;
            Ok(())
        }
    }
}
