//! `keel snapshot`: back up a cluster's state and found a new cluster on
//! it (issue 25, item 6). `save` asks a replica for the state as of a
//! linearizable read (the leader answers) and writes it, owner-only, as a
//! `SnapshotFile` (protobuf, `proto/keel/api/v1/api.proto`); `inspect`
//! reads one back and checks its state hash; `restore` founds a new
//! one-member cluster on it in an empty data directory, offline.

use std::io::Write;
use std::path::{Path, PathBuf};

use anyhow::{bail, Context};
use clap::Subcommand;
use keel_proto::api;
use prost::Message;
use serde::Serialize;

use crate::cli;
use crate::render::{self, Output};

/// The largest file `save` takes from a server (and `inspect` or
/// `restore` read): far above a state of 100,000 jobs.
const SNAPSHOT_FILE_MAX_BYTES: usize = 4 << 30;

#[derive(Subcommand, Debug)]
pub enum SnapshotCmd {
    /// Write the cluster's state, as of now, to FILE (admin; owner-only).
    Save { file: PathBuf },
    /// Say what FILE holds, after checking its state hash.
    Inspect { file: PathBuf },
    /// Found a new one-member cluster on FILE in an empty data directory
    /// (offline): start `keel server` on it, then add members with `keel
    /// cluster add`. The new cluster has a new cluster id.
    Restore {
        file: PathBuf,
        /// The new replica's data directory (absent or empty).
        #[arg(long)]
        data_dir: PathBuf,
        /// The new replica's member id.
        #[arg(long, value_parser = clap::value_parser!(u64)
            .range(1..=keel::membership::MEMBER_ID_MAX))]
        id: u64,
        /// The address it will serve on (its `--listen`), as its peers
        /// reach it.
        #[arg(long, value_name = "HOST:PORT", value_parser = crate::parse_address)]
        member_addr: String,
    },
}

pub async fn run(addr: &str, command: SnapshotCmd, out: Output) -> anyhow::Result<()> {
    match command {
        SnapshotCmd::Save { file } => save(addr, &file, out).await,
        SnapshotCmd::Inspect { file } => {
            let (snapshot, state) = read(&file)?;
            print(&summary(&snapshot, &state, file_len(&file)), out)
        }
        SnapshotCmd::Restore {
            file,
            data_dir,
            id,
            member_addr,
        } => restore(&file, &data_dir, id, &member_addr, out),
    }
}

/// What `save`, `inspect` and `restore` say of a snapshot.
#[derive(Serialize)]
struct Summary {
    cluster_id: String,
    index: u64,
    term: u64,
    state_hash: String,
    taken_at: String,
    taken_by_member: u64,
    members: Vec<String>,
    jobs: usize,
    unfinished_jobs: usize,
    nodes: usize,
    queues: usize,
    bytes: u64,
    #[serde(skip_serializing_if = "Option::is_none")]
    file: Option<String>,
    #[serde(skip_serializing_if = "Option::is_none")]
    restored: Option<Restored>,
}

#[derive(Serialize)]
struct Restored {
    data_dir: String,
    member_id: u64,
    member_addr: String,
    new_cluster_id: String,
}

fn summary(file: &api::SnapshotFile, state: &keel_state::ClusterState, bytes: u64) -> Summary {
    Summary {
        cluster_id: file.cluster_id.clone(),
        index: file.index,
        term: file.term,
        state_hash: file.state_hash.clone(),
        taken_at: render::time(file.taken_at_ms),
        taken_by_member: file.taken_by_member,
        members: file
            .members
            .iter()
            .map(|m| format!("{}={}", m.id, m.address))
            .collect(),
        jobs: state.jobs().len(),
        unfinished_jobs: state.unfinished_jobs().count(),
        nodes: state.nodes().len(),
        queues: state.queues().each().len(),
        bytes,
        file: None,
        restored: None,
    }
}

fn print(s: &Summary, out: Output) -> anyhow::Result<()> {
    if matches!(out, Output::Json) {
        return render::print_json(s);
    }
    let mut stdout = std::io::stdout().lock();
    if let Some(file) = &s.file {
        writeln!(stdout, "written to   {file}")?;
    }
    writeln!(stdout, "cluster      {}", s.cluster_id)?;
    writeln!(stdout, "index        {} (term {})", s.index, s.term)?;
    writeln!(stdout, "state hash   {} (checked)", s.state_hash)?;
    writeln!(
        stdout,
        "taken        {} by member {}",
        s.taken_at, s.taken_by_member
    )?;
    writeln!(stdout, "members      {}", s.members.join(","))?;
    writeln!(
        stdout,
        "holds        {} jobs ({} unfinished), {} nodes, {} queues",
        s.jobs, s.unfinished_jobs, s.nodes, s.queues
    )?;
    writeln!(stdout, "size         {} bytes", s.bytes)?;
    if let Some(r) = &s.restored {
        writeln!(
            stdout,
            "restored     into {} as member {} at {}: a new cluster, {}",
            r.data_dir, r.member_id, r.member_addr, r.new_cluster_id
        )?;
        writeln!(
            stdout,
            "next         keel server --data-dir {} --id {} --listen {}; then keel cluster add \
             --id N --member-addr HOST:PORT for each other member (started with --id N on an \
             empty data directory)",
            r.data_dir, r.member_id, r.member_addr
        )?;
    }
    Ok(())
}

fn file_len(path: &Path) -> u64 {
    std::fs::metadata(path).map_or(0, |m| m.len())
}

/// Decodes a snapshot file's bytes and checks them: its format, its
/// state, and the state's hash against the one recorded.
fn decode(
    bytes: &[u8],
    what: &str,
) -> anyhow::Result<(api::SnapshotFile, keel_state::ClusterState)> {
    let file = api::SnapshotFile::decode(bytes)
        .with_context(|| format!("{what} is not a Keel snapshot file"))?;
    let newest = keel::api::SNAPSHOT_FILE_FORMAT;
    if file.format == 0 || file.format > newest {
        bail!(
            "{what} is a snapshot file of format {}, which this build does not read \
             (it reads format {newest}); upgrade keel",
            file.format
        );
    }
    let state = keel_storage::snapshot_codec::decode_snapshot(&file.state)
        .map_err(|e| anyhow::anyhow!("{what}: its state cannot be read: {e}"))?;
    let hash = state.state_hash().to_string();
    if hash != file.state_hash {
        bail!(
            "{what} is damaged: its state hashes to {hash}, not the {} it was saved with",
            file.state_hash
        );
    }
    Ok((file, state))
}

/// A snapshot file, read and checked (its state hash), and its state.
pub(crate) fn read(path: &Path) -> anyhow::Result<(api::SnapshotFile, keel_state::ClusterState)> {
    let len = file_len(path);
    if len > SNAPSHOT_FILE_MAX_BYTES as u64 {
        bail!(
            "{} is {len} bytes, more than the {SNAPSHOT_FILE_MAX_BYTES} a snapshot file may be",
            path.display()
        );
    }
    let bytes = std::fs::read(path).with_context(|| format!("cannot read {}", path.display()))?;
    decode(&bytes, &path.display().to_string())
}

async fn save(addr: &str, path: &Path, out: Output) -> anyhow::Result<()> {
    let (mut chunks, _) = cli::read(addr, |mut client| async move {
        client.save_snapshot(api::SaveSnapshotRequest {}).await
    })
    .await?;
    let mut bytes: Vec<u8> = Vec::new();
    while let Some(chunk) = chunks.message().await.map_err(cli::status_error)? {
        if bytes.len() + chunk.data.len() > SNAPSHOT_FILE_MAX_BYTES {
            bail!("the server's snapshot is more than {SNAPSHOT_FILE_MAX_BYTES} bytes");
        }
        bytes.extend_from_slice(&chunk.data);
    }
    // Checked before anything is written: a damaged answer writes no file.
    let (file, state) = decode(&bytes, "the server's answer")?;
    write_owner_only(path, &bytes)?;
    let mut s = summary(&file, &state, bytes.len() as u64);
    s.file = Some(path.display().to_string());
    print(&s, out)
}

/// Writes `bytes` to `path` whole or not at all, owner-only (a synced
/// temporary file renamed over it, the directory synced: what
/// `atomic_write_file` does; an older file's mode is not kept).
fn write_owner_only(path: &Path, bytes: &[u8]) -> anyhow::Result<()> {
    use atomic_write_file::unix::OpenOptionsExt as _;
    use std::os::unix::fs::OpenOptionsExt as _;
    let what = || format!("cannot write {}", path.display());
    let mut options = atomic_write_file::OpenOptions::new();
    options.mode(0o600).preserve_mode(false);
    let mut file = options.open(path).with_context(what)?;
    file.write_all(bytes).with_context(what)?;
    file.commit().with_context(what)
}

fn restore(
    path: &Path,
    data_dir: &Path,
    id: u64,
    member_addr: &str,
    out: Output,
) -> anyhow::Result<()> {
    let (file, state) = read(path)?;
    let empty = match std::fs::read_dir(data_dir) {
        Ok(mut entries) => entries.next().is_none(),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => true,
        Err(e) => return Err(e).with_context(|| format!("cannot read {}", data_dir.display())),
    };
    if !empty {
        bail!(
            "{} is not empty: a snapshot is restored into a new data directory \
             (to recover a member that holds a log, see `keel cluster force-new-cluster`)",
            data_dir.display()
        );
    }
    let what = || format!("cannot restore into {}", data_dir.display());
    let dir = keel_storage::DataDir::open(data_dir).with_context(what)?;
    let incarnation =
        keel::membership::load_or_create_incarnation(&dir.root().join("incarnation"), true)
            .with_context(what)?;
    let raft_id = keel::membership::raft_id(id, incarnation);
    keel_storage::found_from_snapshot(
        &dir,
        raft_id,
        member_addr,
        file.term,
        file.index,
        &file.state,
    )
    .with_context(what)?;
    let identity = keel::raft_network::ClusterIdentity::load(dir.root().join("cluster-id"))
        .with_context(what)?;
    let new_cluster_id = identity.create(id).with_context(what)?;
    let mut s = summary(&file, &state, file_len(path));
    s.restored = Some(Restored {
        data_dir: data_dir.display().to_string(),
        member_id: id,
        member_addr: member_addr.to_string(),
        new_cluster_id,
    });
    print(&s, out)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A state with a job in it, and its snapshot file as a server writes
    /// it.
    fn file_of_a_state() -> (api::SnapshotFile, keel_state::ClusterState) {
        let mut state = keel_state::ClusterState::new();
        state
            .apply(
                1,
                &keel_state::LogEntry::new(
                    1_700_000_000_000,
                    keel_state::Command::submit_job(keel_state::fixtures::job_spec("saved", 2, 1)),
                ),
            )
            .expect("applied");
        let file = api::SnapshotFile {
            format: keel::api::SNAPSHOT_FILE_FORMAT,
            cluster_id: "18ee64d227d3a8b8-6d02-1".into(),
            index: 1,
            term: 1,
            state_hash: state.state_hash().to_string(),
            taken_at_ms: 1_700_000_000_500,
            taken_by_member: 1,
            members: vec![api::SnapshotMember {
                id: 1,
                address: "127.0.0.1:7070".into(),
            }],
            state: keel_storage::snapshot_codec::encode_snapshot(&state),
        };
        (file, state)
    }

    /// Golden bytes (issue 21's rule for what reaches a disk): the file
    /// format 1 as first written must read the same in every later
    /// version. Written once with `KEEL_WRITE_GOLDEN=1`, then committed.
    #[test]
    fn a_snapshot_file_of_format_1_reads_forever() {
        let (file, state) = file_of_a_state();
        let path =
            Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/golden/snapshot-file-1.bin");
        if !path.exists() {
            assert!(
                std::env::var_os("KEEL_WRITE_GOLDEN").is_some(),
                "no golden file {}: run once with KEEL_WRITE_GOLDEN=1 and commit it",
                path.display()
            );
            std::fs::create_dir_all(path.parent().expect("a parent")).expect("golden dir");
            std::fs::write(&path, file.encode_to_vec()).expect("write golden");
        }
        let bytes = std::fs::read(&path).expect("read golden");
        let (read, read_state) = decode(&bytes, "the golden file").expect("decodes");
        assert_eq!(read, file);
        assert_eq!(read_state.state_hash(), state.state_hash());
        assert_eq!(read_state.jobs().len(), 1);
    }

    #[test]
    fn a_newer_format_a_damaged_state_or_another_file_is_refused() {
        let (file, _) = file_of_a_state();
        let newer = api::SnapshotFile {
            format: 2,
            ..file.clone()
        };
        let e = decode(&newer.encode_to_vec(), "x.snap").expect_err("newer");
        let e = format!("{e:#}");
        assert!(
            e.contains("format 2") && e.contains("reads format 1") && e.contains("upgrade keel"),
            "{e}"
        );
        let mut other = file.clone();
        other.state_hash = "0".repeat(64);
        let e = format!(
            "{:#}",
            decode(&other.encode_to_vec(), "x.snap").expect_err("hash")
        );
        assert!(e.contains("x.snap is damaged"), "{e}");
        let e = format!(
            "{:#}",
            decode(b"\x01\x02garbage", "x.snap").expect_err("garbage")
        );
        assert!(e.contains("x.snap"), "{e}");
    }
}
