//! `keel audit export` and `keel audit verify`: a data directory's log as
//! hash-chained JSON lines, and the replay that checks them
//! ([`keel_storage::audit`]).

use std::io::Write;
use std::path::{Path, PathBuf};

use anyhow::Context;
use clap::Subcommand;
use keel_storage::audit::AuditSummary;
use serde::Serialize;

use crate::render::Output;

#[derive(Subcommand, Debug)]
pub enum AuditCmd {
    /// Write every entry of a data directory (its journal, then what the
    /// Raft log committed past it) as JSON lines, each with its index,
    /// term, time, actor, command, outcome and the state hash after it,
    /// chained by the hash of the line before. The hash of the last line,
    /// printed at the end, pins the export: keep it apart from the file.
    Export {
        /// A stopped replica's data directory (or a copy of one).
        #[arg(long)]
        data_dir: PathBuf,
        /// The first log index to write (the state before it goes in the
        /// header); default: the first the journal holds.
        #[arg(long, default_value_t = 1)]
        from: u64,
        /// The last log index to write.
        #[arg(long, conflicts_with = "until_time")]
        until: Option<u64>,
        /// Stop after the last entry stamped at or before this time (RFC
        /// 3339).
        #[arg(long)]
        until_time: Option<String>,
        /// Where to write it (default: standard output, with the summary
        /// on standard error).
        #[arg(long)]
        to: Option<PathBuf>,
    },
    /// Replay an export: rebuild the state its header gives, apply every
    /// entry, and check each line's fields, state hash and link to the
    /// line before. Names the first index where they disagree.
    Verify { file: PathBuf },
}

/// What `export` and `verify` print.
#[derive(Debug, Serialize)]
struct Report {
    entries: u64,
    after_index: u64,
    last_index: u64,
    state_hash: String,
    last_line_hash: String,
}

impl From<AuditSummary> for Report {
    fn from(s: AuditSummary) -> Report {
        Report {
            entries: s.entries,
            after_index: s.after_index,
            last_index: s.last_index,
            state_hash: s.state_hash,
            last_line_hash: s.last_line_hash,
        }
    }
}

pub fn run(command: AuditCmd, out: Output) -> anyhow::Result<()> {
    match command {
        AuditCmd::Export {
            data_dir,
            from,
            until,
            until_time,
            to,
        } => {
            let until = crate::cli::until(until, until_time.as_deref(), "--until-time")?;
            let summary = export(&data_dir, from, until, to.as_deref())?;
            let report = Report::from(summary);
            if to.is_some() {
                print(&report, out, "exported")
            } else {
                // Standard output holds the export.
                let text = serde_json::to_string(&report)?;
                let mut stderr = std::io::stderr().lock();
                writeln!(stderr, "exported {text}")?;
                Ok(())
            }
        }
        AuditCmd::Verify { file } => {
            let reader = std::fs::File::open(&file)
                .with_context(|| format!("cannot open {}", file.display()))?;
            let summary = keel_storage::audit::verify(std::io::BufReader::new(reader))
                .with_context(|| format!("{} does not verify", file.display()))?;
            print(&Report::from(summary), out, "verified")
        }
    }
}

fn export(
    data_dir: &Path,
    from: u64,
    until: keel_storage::Until,
    to: Option<&Path>,
) -> anyhow::Result<AuditSummary> {
    // Take the directory's lock: a directory a server is writing would
    // give a moving journal.
    let dir = keel_storage::DataDir::open(data_dir)
        .with_context(|| format!("cannot export {}", data_dir.display()))?;
    let after = from.saturating_sub(1);
    let summary = match to {
        Some(path) => {
            let file = std::fs::File::create(path)
                .with_context(|| format!("cannot write {}", path.display()))?;
            let mut writer = std::io::BufWriter::new(file);
            let summary = match keel_storage::audit::export(&dir, after, until, &mut writer) {
                Ok(summary) => summary,
                Err(e) => {
                    // A failed export leaves no file to be taken for one.
                    drop(writer);
                    let _ = std::fs::remove_file(path);
                    return Err(e.into());
                }
            };
            writer.flush()?;
            writer
                .into_inner()
                .map_err(|e| e.into_error())?
                .sync_all()?;
            summary
        }
        None => {
            let mut writer = std::io::BufWriter::new(std::io::stdout().lock());
            let summary = keel_storage::audit::export(&dir, after, until, &mut writer)?;
            writer.flush()?;
            summary
        }
    };
    Ok(summary)
}

fn print(report: &Report, out: Output, done: &str) -> anyhow::Result<()> {
    match out {
        Output::Json => crate::render::print_json(report),
        Output::Table => {
            let mut stdout = std::io::stdout().lock();
            writeln!(
                stdout,
                "{done} {} entries after index {} through {}\nstate hash     {}\nlast line hash {}",
                report.entries,
                report.after_index,
                report.last_index,
                report.state_hash,
                report.last_line_hash
            )?;
            Ok(())
        }
    }
}
