//! `keel tls init` and `keel tls issue`: a cluster's CA and certificates,
//! written owner-only into one directory.

use std::io::Write;
use std::path::{Path, PathBuf};

use anyhow::Context;
use clap::Subcommand;
use keel::tls::certs::{self, Authority, Issued};
use serde::Serialize;

use crate::render::Output;

/// The hosts a member's certificate names when none are given.
const DEFAULT_HOSTS: [&str; 2] = ["localhost", "127.0.0.1"];

#[derive(Subcommand, Debug)]
pub enum TlsCmd {
    /// Make a new cluster CA and certificates for its members and one
    /// client, in DIR (created, owner-only). Each replica then starts with
    /// `--tls-cert DIR/member-ID.crt --tls-key DIR/member-ID.key --tls-ca
    /// DIR/ca.crt`, and the CLI with the client's pair and the same CA.
    Init {
        dir: PathBuf,
        /// The member ids to make certificates for.
        #[arg(long, value_delimiter = ',', default_values_t = [1u64, 2, 3])]
        members: Vec<u64>,
        /// A DNS name or IP address clients reach the members by
        /// (repeatable; default: localhost and 127.0.0.1). Each member's
        /// certificate names them all; `keel tls issue` makes one that
        /// names a member's own.
        #[arg(long = "host")]
        hosts: Vec<String>,
        /// The client certificate's name.
        #[arg(long, default_value = "admin")]
        client: String,
        /// How long the members' and the client's certificates are valid.
        #[arg(long, default_value_t = 365)]
        days: u32,
    },
    /// Issue one more certificate from the CA in DIR (a new member, a new
    /// client, or a renewal: then copy it over the old files and send the
    /// replica SIGHUP).
    Issue {
        dir: PathBuf,
        /// For member ID (writes DIR/member-ID.crt and .key).
        #[arg(long, conflicts_with = "client", required_unless_present = "client")]
        member: Option<u64>,
        /// For the client NAME (writes DIR/client-NAME.crt and .key).
        #[arg(long)]
        client: Option<String>,
        /// A DNS name or IP address the member is reached by (repeatable;
        /// default: localhost and 127.0.0.1).
        #[arg(long = "host")]
        hosts: Vec<String>,
        #[arg(long, default_value_t = 365)]
        days: u32,
        /// Write to this file name stem instead (e.g. `member-1.next`).
        #[arg(long)]
        name: Option<String>,
    },
}

#[derive(Debug, Serialize)]
struct Written {
    files: Vec<PathBuf>,
}

pub fn run(cmd: TlsCmd, out: Output) -> anyhow::Result<()> {
    let written = match cmd {
        TlsCmd::Init {
            dir,
            members,
            hosts,
            client,
            days,
        } => init(&dir, &members, &hosts_or_default(hosts), &client, days)?,
        TlsCmd::Issue {
            dir,
            member,
            client,
            hosts,
            days,
            name,
        } => {
            let ca = read_ca(&dir)?;
            let (stem, issued) = match (member, client) {
                (Some(id), _) => (
                    format!("member-{id}"),
                    ca.issue_member(id, &hosts_or_default(hosts), days)?,
                ),
                (None, Some(client)) => {
                    (format!("client-{client}"), ca.issue_client(&client, days)?)
                }
                (None, None) => anyhow::bail!("--member or --client is needed"),
            };
            let stem = name.unwrap_or(stem);
            Written {
                files: write_pair(&dir, &stem, &issued)?.to_vec(),
            }
        }
    };
    match out {
        Output::Json => crate::render::print_json(&written),
        Output::Table => {
            let mut stdout = std::io::stdout().lock();
            for f in &written.files {
                writeln!(stdout, "wrote {}", f.display())?;
            }
            Ok(())
        }
    }
}

fn hosts_or_default(hosts: Vec<String>) -> Vec<String> {
    if hosts.is_empty() {
        DEFAULT_HOSTS.iter().map(|h| h.to_string()).collect()
    } else {
        hosts
    }
}

fn init(
    dir: &Path,
    members: &[u64],
    hosts: &[String],
    client: &str,
    days: u32,
) -> anyhow::Result<Written> {
    if members.is_empty() {
        anyhow::bail!("--members: at least one member id");
    }
    if let Some(bad) = members
        .iter()
        .find(|m| !keel::membership::is_member_id(**m))
    {
        anyhow::bail!(
            "--members: {bad} is not a member id (1 to {})",
            keel::membership::MEMBER_ID_MAX
        );
    }
    {
        use std::os::unix::fs::DirBuilderExt;
        std::fs::DirBuilder::new()
            .recursive(true)
            .mode(0o700)
            .create(dir)
            .with_context(|| format!("cannot create {}", dir.display()))?;
    }
    let name = dir
        .file_name()
        .map_or_else(|| "keel".into(), |n| n.to_string_lossy().into_owned());
    let ca = certs::new_ca(&name)?;
    // The CA's key first: if it exists already, nothing is overwritten.
    let mut files = write_pair(
        dir,
        "ca",
        &Issued {
            cert_pem: ca.cert_pem.clone(),
            key_pem: ca.key_pem.clone(),
        },
    )?
    .to_vec();
    for id in members {
        let issued = ca.issue_member(*id, hosts, days)?;
        files.extend(write_pair(dir, &format!("member-{id}"), &issued)?);
    }
    let issued = ca.issue_client(client, days)?;
    files.extend(write_pair(dir, &format!("client-{client}"), &issued)?);
    Ok(Written { files })
}

fn read_ca(dir: &Path) -> anyhow::Result<Authority> {
    let read = |name: &str| {
        let path = dir.join(name);
        std::fs::read_to_string(&path).with_context(|| format!("cannot read {}", path.display()))
    };
    certs::load_ca(&read("ca.crt")?, &read("ca.key")?)
        .with_context(|| format!("the CA in {}", dir.display()))
}

/// Writes `STEM.crt` and `STEM.key`, owner-only, refusing to replace
/// either.
fn write_pair(dir: &Path, stem: &str, issued: &Issued) -> anyhow::Result<[PathBuf; 2]> {
    let cert = dir.join(format!("{stem}.crt"));
    let key = dir.join(format!("{stem}.key"));
    for (path, text) in [(&key, &issued.key_pem), (&cert, &issued.cert_pem)] {
        use std::os::unix::fs::OpenOptionsExt;
        let mut file = std::fs::OpenOptions::new()
            .write(true)
            .create_new(true)
            .mode(0o600)
            .open(path)
            .with_context(|| {
                format!(
                    "cannot write {} (an existing file is never replaced; --name writes \
                     another)",
                    path.display()
                )
            })?;
        file.write_all(text.as_bytes())?;
        file.sync_all()?;
    }
    Ok([cert, key])
}
