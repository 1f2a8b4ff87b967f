//! The hollow runs' journal: one append-only file of JSON lines (a run
//! launched, stopped, forgotten) from which the next leader rebuilds the
//! runs it takes over.
//!
//! One file, not one per run: creating and removing a file per worker
//! cost the leader a quarter of its CPU at 2,000 launches a second (ext4's
//! inode allocation; BENCHMARKS, "Scale"). Lines are appended with one
//! `write` each (`O_APPEND`), not synced; a torn last line (a kill -9
//! mid-write) is skipped when read. When the file holds many more lines
//! than live runs it is rewritten with the live runs alone (a new file
//! renamed over it).

use std::collections::BTreeMap;
use std::fs::{File, OpenOptions};
use std::io::{BufRead, BufReader, Write};
use std::path::{Path, PathBuf};

use serde::{Deserialize, Serialize};

use super::Run;
use crate::WorkerId;

/// One line of the journal.
#[derive(Debug, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub(super) enum Line {
    Launched { worker: WorkerId, run: Run },
    Stopped { worker: WorkerId, at_ms: u64 },
    Forgotten { worker: WorkerId },
}

/// Lines beyond the live runs after which the file is rewritten.
const SLACK_LINES: u64 = 10_000;

#[derive(Debug)]
pub(super) struct Journal {
    path: PathBuf,
    file: File,
    /// Lines in the file now.
    lines: u64,
}

impl Journal {
    /// Opens (or makes) the journal at `path`, for appending.
    pub(super) fn open(path: &Path) -> std::io::Result<Journal> {
        let lines = match File::open(path) {
            Ok(f) => BufReader::new(f).lines().count() as u64,
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => 0,
            Err(e) => return Err(e),
        };
        Ok(Journal {
            path: path.to_path_buf(),
            file: open_to_append(path)?,
            lines,
        })
    }

    /// Appends `line` in one write.
    pub(super) fn append(&mut self, line: &Line) -> std::io::Result<()> {
        let mut bytes = serde_json::to_vec(line).map_err(std::io::Error::other)?;
        bytes.push(b'\n');
        self.file.write_all(&bytes)?;
        self.lines += 1;
        Ok(())
    }

    /// Whether the file is due a rewrite, `live` runs being live.
    pub(super) fn wants_compaction(&self, live: usize) -> bool {
        self.lines > (live as u64).saturating_mul(2) + SLACK_LINES
    }

    /// Rewrites the file with `live` alone.
    pub(super) fn compact<'a>(
        &mut self,
        live: impl Iterator<Item = (&'a WorkerId, &'a Run)>,
    ) -> std::io::Result<()> {
        let tmp = self.path.with_extension("jsonl.tmp");
        let mut out = std::io::BufWriter::new(File::create(&tmp)?);
        let mut lines = 0;
        for (id, run) in live {
            let line = Line::Launched {
                worker: id.clone(),
                run: run.clone(),
            };
            serde_json::to_writer(&mut out, &line).map_err(std::io::Error::other)?;
            out.write_all(b"\n")?;
            lines += 1;
        }
        out.into_inner().map_err(|e| e.into_error())?;
        std::fs::rename(&tmp, &self.path)?;
        self.file = open_to_append(&self.path)?;
        self.lines = lines;
        Ok(())
    }
}

fn open_to_append(path: &Path) -> std::io::Result<File> {
    OpenOptions::new().create(true).append(true).open(path)
}

/// The live runs the journal at `path` holds (none when there is none).
pub(super) fn read(path: &Path) -> BTreeMap<WorkerId, Run> {
    let mut runs = BTreeMap::new();
    let Ok(file) = File::open(path) else {
        return runs;
    };
    for line in BufReader::new(file).lines() {
        let Ok(line) = line else { break };
        // A torn last line, or a line of a format this version does not
        // know: skipped.
        let Ok(line) = serde_json::from_str::<Line>(&line) else {
            continue;
        };
        match line {
            Line::Launched { worker, run } => {
                runs.insert(worker, run);
            }
            Line::Stopped { worker, at_ms } => {
                if let Some(run) = runs.get_mut(&worker) {
                    run.stopped_ms = Some(at_ms);
                }
            }
            Line::Forgotten { worker } => {
                runs.remove(&worker);
            }
        }
    }
    runs
}

#[cfg(test)]
mod tests {
    use super::*;

    fn run(node: &str) -> Run {
        Run {
            node: node.into(),
            gpus: vec![0],
            model: "resnet50".into(),
            launched_ms: 5,
            start_step: 0,
            total_steps: 10,
            steps_per_s: 1.0,
            samples_per_s: 1.0,
            fail_at_step: None,
            exit_code: 1,
            checkpoint_every_steps: 1,
            reports: true,
            report_every_ms: 1000,
            seed: 0,
            stopped_ms: None,
        }
    }

    fn id(job_id: u64) -> WorkerId {
        WorkerId {
            job_id,
            epoch: 1,
            rank: 0,
        }
    }

    #[test]
    fn lines_fold_into_the_live_runs_a_torn_line_skipped_and_compaction_keeps_them() {
        let dir = tempfile::tempdir().expect("tempdir");
        let path = dir.path().join("runs.jsonl");
        let mut journal = Journal::open(&path).expect("open");
        for job in 1..=3 {
            journal
                .append(&Line::Launched {
                    worker: id(job),
                    run: run("n0"),
                })
                .expect("append");
        }
        journal
            .append(&Line::Stopped {
                worker: id(2),
                at_ms: 9,
            })
            .expect("append");
        journal
            .append(&Line::Forgotten { worker: id(3) })
            .expect("append");
        // A kill -9 in the middle of a line.
        std::fs::OpenOptions::new()
            .append(true)
            .open(&path)
            .and_then(|mut f| f.write_all(b"{\"launched\":{\"worker\":{\"job_id\":4,\"epo"))
            .expect("torn");

        let runs = read(&path);
        assert_eq!(runs.keys().cloned().collect::<Vec<_>>(), vec![id(1), id(2)]);
        assert_eq!(runs[&id(2)].stopped_ms, Some(9));
        assert_eq!(Journal::open(&path).expect("reopen").lines, 6);

        assert!(!journal.wants_compaction(2));
        journal.compact(runs.iter()).expect("compact");
        assert_eq!(journal.lines, 2);
        assert_eq!(read(&path), runs);
        // Appends go on in the new file.
        journal
            .append(&Line::Forgotten { worker: id(1) })
            .expect("append");
        assert_eq!(read(&path).keys().cloned().collect::<Vec<_>>(), vec![id(2)]);
    }
}
