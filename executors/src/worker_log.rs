//! A worker's output on disk: rotated files of bounded size and number,
//! read as one stream addressed by byte offsets that never go back.
//!
//! A stream with base path `B` (`job-4/e1-r0.log`) is held in
//! - `B`, the current file, the only one appended to;
//! - `B.START`, files rotated out of it, each named by the stream offset of
//!   its first byte and never written again.
//!
//! The current file starts where the newest rotated file ends (at 0 with
//! none), so the stream's length is known from the directory alone and a
//! reader's offset stays valid across rotations: `keel logs -f` and the
//! progress followers read on through them. The writer keeps at most
//! `max_files - 1` rotated files (the oldest are deleted), so a stream
//! holds at most `max_files × max_file_bytes` plus one line cut short.
//!
//! [`StreamWriter`] is the one writer of a stream (Keel's supervisor, or
//! `keel log-writer` under the SSH host helper): it cuts files at a line's
//! end where it can, copies progress lines to a second, small stream
//! (`eE-rR.progress`) so that a fast writer's rotation never takes a
//! progress line before the executor read it, and stops writing while the
//! filesystem has less than its floor free ([`FreeSpaceFloor`]), saying so
//! in the stream and in a marker file the executor reports.

use std::fs::{File, OpenOptions};
use std::io::{Read, Seek, SeekFrom, Write};
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use crate::contract::{PROGRESS_LINE_MAX_LEN, PROGRESS_MARKER};

/// How a stream is rotated.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Rotation {
    /// A file is rotated out once it holds this many bytes.
    pub max_file_bytes: u64,
    /// Files kept, the current one included (at least 2, so that the
    /// current file's start is always known).
    pub max_files: u32,
}

/// The defaults of a worker log: the kubelet's (`containerLogMaxSize`
/// 10 MiB × `containerLogMaxFiles` 5); Nomad keeps 10 × 10 MB.
pub const DEFAULT_LOG_ROTATION: Rotation = Rotation {
    max_file_bytes: 10 * 1024 * 1024,
    max_files: 5,
};

/// How a server writes its workers' logs (`keel serve
/// --worker-log-max-file-bytes`, `--worker-log-max-files`,
/// `--worker-log-min-free-bytes`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct LogSettings {
    pub rotation: Rotation,
    /// Below this much free space on its filesystem a worker's log is
    /// paused (0: never).
    pub min_free_bytes: u64,
}

impl LogSettings {
    /// The rotation of a worker of a job that asks for `job` (its spec's
    /// `logs`): what it asks within this server's maximum, and a line for
    /// the worker's log for each part asked above it.
    pub fn for_job(&self, job: &keel_state::spec::LogLimits) -> (Rotation, Vec<String>) {
        use keel_state::resources::show_memory;
        let server = self.rotation;
        let mut notes = Vec::new();
        let max_file_bytes = match job.max_file_bytes {
            Some(b) if b > server.max_file_bytes => {
                notes.push(format!(
                    "logs.max_file_size {} is above this server's maximum of {} (--worker-log-max-file-bytes): {} it is",
                    show_memory(b),
                    show_memory(server.max_file_bytes),
                    show_memory(server.max_file_bytes)
                ));
                server.max_file_bytes
            }
            Some(b) => b,
            None => server.max_file_bytes,
        };
        let max_files = match job.max_files {
            Some(n) if n > server.max_files => {
                notes.push(format!(
                    "logs.max_files {n} is above this server's maximum of {} (--worker-log-max-files): {} it is",
                    server.max_files, server.max_files
                ));
                server.max_files
            }
            Some(n) => n,
            None => server.max_files,
        };
        (
            Rotation {
                max_file_bytes,
                max_files,
            },
            notes,
        )
    }
}

impl Default for LogSettings {
    fn default() -> Self {
        LogSettings {
            rotation: DEFAULT_LOG_ROTATION,
            min_free_bytes: DEFAULT_MIN_FREE_BYTES,
        }
    }
}

/// The progress stream's rotation: 2 × 256 KiB holds about 1,700 progress
/// lines of 150 bytes, more than the executor's buffer keeps
/// ([`crate::contract::PROGRESS_BUFFER_MAX`]), so rotation takes a progress
/// line unread only when the buffer would have dropped it anyway.
pub const PROGRESS_ROTATION: Rotation = Rotation {
    max_file_bytes: 256 * 1024,
    max_files: 2,
};

/// The smallest and largest rotation a server or a job may ask for (the
/// job spec's ranges).
pub const MIN_FILE_BYTES: u64 = keel_state::resources::log_limits::FILE_BYTES_MIN;
pub const MAX_FILE_BYTES: u64 = keel_state::resources::log_limits::FILE_BYTES_MAX;
pub const MAX_FILES: u32 = keel_state::resources::log_limits::FILES_MAX;

impl Rotation {
    /// The rotation, or why it is out of range (`field` names it).
    pub fn checked(self, field: &str) -> Result<Rotation, String> {
        if !(MIN_FILE_BYTES..=MAX_FILE_BYTES).contains(&self.max_file_bytes) {
            return Err(format!(
                "{field}: max file size {} bytes is outside {MIN_FILE_BYTES} to {MAX_FILE_BYTES}",
                self.max_file_bytes
            ));
        }
        let min_files = keel_state::resources::log_limits::FILES_MIN;
        if !(min_files..=MAX_FILES).contains(&self.max_files) {
            return Err(format!(
                "{field}: {} files is outside {min_files} to {MAX_FILES}",
                self.max_files
            ));
        }
        Ok(self)
    }

    /// The most bytes a stream holds on disk (one line cut short aside).
    pub fn max_bytes(&self) -> u64 {
        self.max_file_bytes * u64::from(self.max_files)
    }
}

/// The progress stream beside a worker log `…/eE-rR.log`.
pub fn progress_path(log: &Path) -> PathBuf {
    log.with_extension("progress")
}

/// The marker a writer keeps while it drops output for want of space; it
/// holds the sentence saying so.
pub fn paused_path(log: &Path) -> PathBuf {
    log.with_extension("paused")
}

/// A stream's files, as one consistent listing.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Segments {
    /// Rotated files, oldest first: (start offset, path, length).
    pub rotated: Vec<(u64, PathBuf, u64)>,
    /// Where the current file starts, and its length (0 when absent).
    pub current_start: u64,
    pub current_len: u64,
}

impl Segments {
    /// The stream's length: every byte ever written to it.
    pub fn total(&self) -> u64 {
        self.current_start + self.current_len
    }

    /// The first offset still on disk.
    pub fn first(&self) -> u64 {
        self.rotated.first().map_or(self.current_start, |r| r.0)
    }
}

/// The rotated files of stream `base`, oldest first: (start, path).
fn rotated_files(base: &Path) -> std::io::Result<Vec<(u64, PathBuf)>> {
    let (Some(dir), Some(name)) = (base.parent(), base.file_name()) else {
        return Ok(Vec::new());
    };
    let prefix = format!("{}.", name.to_string_lossy());
    let mut found = Vec::new();
    let entries = match std::fs::read_dir(dir) {
        Ok(e) => e,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(found),
        Err(e) => return Err(e),
    };
    for entry in entries.flatten() {
        let file = entry.file_name();
        let file = file.to_string_lossy();
        let Some(start) = file.strip_prefix(&prefix) else {
            continue;
        };
        if start.is_empty() || !start.bytes().all(|b| b.is_ascii_digit()) {
            continue;
        }
        if let Ok(start) = start.parse::<u64>() {
            found.push((start, entry.path()));
        }
    }
    found.sort();
    Ok(found)
}

fn len_of(path: &Path) -> std::io::Result<u64> {
    match std::fs::metadata(path) {
        Ok(m) => Ok(m.len()),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(0),
        Err(e) => Err(e),
    }
}

/// Lists stream `base`. A rotation between the listing and the current
/// file's length would pair a new file with an old start: the listing is
/// taken again until it is the same on both sides of that read.
pub fn segments(base: &Path) -> std::io::Result<Segments> {
    let mut before = rotated_files(base)?;
    loop {
        let current_len = len_of(base)?;
        let after = rotated_files(base)?;
        if after != before {
            before = after;
            continue;
        }
        let mut rotated = Vec::with_capacity(after.len());
        for (start, path) in after {
            // A file deleted since (the oldest, by the writer) is left out.
            if let Ok(m) = std::fs::metadata(&path) {
                rotated.push((start, path, m.len()));
            }
        }
        let current_start = rotated.last().map_or(0, |(s, _, l)| s + l);
        return Ok(Segments {
            rotated,
            current_start,
            current_len,
        });
    }
}

/// Bytes of stream `base` from offset `from`, at most `max` of them: the
/// offset they start at (later than `from` when the bytes there were
/// rotated away), the bytes, and the stream's length when listed.
pub fn read_from(base: &Path, from: u64, max: u64) -> std::io::Result<(u64, Vec<u8>, u64)> {
    let seg = segments(base)?;
    let total = seg.total();
    let start = from.max(seg.first()).min(total);
    let end = total.min(start.saturating_add(max));
    let mut out = Vec::new();
    let mut got_from = None;
    let files = seg
        .rotated
        .iter()
        .map(|(s, p, l)| (*s, p.as_path(), *l))
        .chain(std::iter::once((seg.current_start, base, seg.current_len)));
    for (s, path, len) in files {
        let want_from = start.max(s);
        let want_to = end.min(s + len);
        if want_from >= want_to {
            continue;
        }
        match File::open(path) {
            Ok(mut f) => {
                f.seek(SeekFrom::Start(want_from - s))?;
                got_from.get_or_insert(want_from);
                let before = out.len();
                f.take(want_to - want_from).read_to_end(&mut out)?;
                // A file shorter than listed (deleted and reused) ends the
                // read: what follows would not be contiguous.
                if ((out.len() - before) as u64) < want_to - want_from {
                    break;
                }
            }
            // Rotated away since the listing: the read starts later.
            Err(e) if e.kind() == std::io::ErrorKind::NotFound && out.is_empty() => continue,
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => break,
            Err(e) => return Err(e),
        }
    }
    Ok((got_from.unwrap_or(end), out, total))
}

/// The last `tail` bytes of stream `base`, and its length.
pub fn read_tail(base: &Path, tail: u64) -> std::io::Result<(Vec<u8>, u64)> {
    let total = segments(base)?.total();
    let (_, bytes, _) = read_from(base, total.saturating_sub(tail), tail)?;
    Ok((bytes, total))
}

/// Removes stream `base` whole (its current and rotated files).
pub fn remove_stream(base: &Path) -> std::io::Result<()> {
    for (_, path) in rotated_files(base)? {
        let _ = std::fs::remove_file(path);
    }
    match std::fs::remove_file(base) {
        Err(e) if e.kind() != std::io::ErrorKind::NotFound => Err(e),
        _ => Ok(()),
    }
}

/// One stream's files, appended to and rotated.
#[derive(Debug)]
struct RotatingFile {
    base: PathBuf,
    rotation: Rotation,
    file: File,
    /// The current file's length and start.
    len: u64,
    start: u64,
}

impl RotatingFile {
    fn open(base: &Path, rotation: Rotation) -> std::io::Result<RotatingFile> {
        let seg = segments(base)?;
        let file = OpenOptions::new().create(true).append(true).open(base)?;
        let len = file.metadata()?.len();
        Ok(RotatingFile {
            base: base.to_path_buf(),
            rotation,
            file,
            len,
            start: seg.current_start,
        })
    }

    /// Appends `buf`, rotating when the current file is full; a file is cut
    /// after a line's end where one falls in what it has room for.
    fn write(&mut self, mut buf: &[u8]) -> std::io::Result<()> {
        while !buf.is_empty() {
            let room = self.rotation.max_file_bytes.saturating_sub(self.len);
            if room == 0 {
                self.rotate()?;
                continue;
            }
            if buf.len() as u64 <= room {
                self.append(buf)?;
                if self.len >= self.rotation.max_file_bytes {
                    self.rotate()?;
                }
                return Ok(());
            }
            let room = usize::try_from(room).unwrap_or(usize::MAX);
            let cut = buf[..room]
                .iter()
                .rposition(|b| *b == b'\n')
                .map_or(room, |i| i + 1);
            self.append(&buf[..cut])?;
            buf = &buf[cut..];
            self.rotate()?;
        }
        Ok(())
    }

    fn append(&mut self, buf: &[u8]) -> std::io::Result<()> {
        self.file.write_all(buf)?;
        self.len += buf.len() as u64;
        Ok(())
    }

    /// The current file becomes `B.START`; the oldest beyond the count go.
    fn rotate(&mut self) -> std::io::Result<()> {
        // Something else may have appended (the executor's own lines).
        self.len = self.file.metadata().map_or(self.len, |m| m.len());
        let rotated = rotated_path(&self.base, self.start);
        std::fs::rename(&self.base, &rotated)?;
        self.start += self.len;
        let keep = usize::try_from(self.rotation.max_files - 1).unwrap_or(1);
        let all = rotated_files(&self.base)?;
        for (_, old) in all.iter().take(all.len().saturating_sub(keep)) {
            std::fs::remove_file(old)?;
        }
        self.file = OpenOptions::new()
            .create(true)
            .append(true)
            .open(&self.base)?;
        self.len = 0;
        Ok(())
    }
}

fn rotated_path(base: &Path, start: u64) -> PathBuf {
    let mut name = base.as_os_str().to_os_string();
    name.push(format!(".{start}"));
    PathBuf::from(name)
}

/// Below how much free space a writer stops writing (and how often it
/// looks).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct FreeSpaceFloor {
    pub min_free_bytes: u64,
}

/// The default floor: a worker log stops before the filesystem it shares
/// with the Raft log has less than 256 MiB free.
pub const DEFAULT_MIN_FREE_BYTES: u64 = 256 * 1024 * 1024;

/// How much is written between two looks at the free space (and how long a
/// paused writer waits between two).
const FREE_SPACE_CHECK_BYTES: u64 = 1024 * 1024;
const FREE_SPACE_CHECK_PAUSED: Duration = Duration::from_secs(1);

/// Bytes free to an unprivileged writer on the filesystem holding `path`.
// The conversions are no-ops on 64-bit Linux, not on every target.
#[allow(clippy::useless_conversion)]
pub fn free_bytes(path: &Path) -> std::io::Result<u64> {
    let s = nix::sys::statvfs::statvfs(path).map_err(std::io::Error::from)?;
    Ok(u64::from(s.blocks_available()).saturating_mul(u64::from(s.fragment_size())))
}

/// The one writer of a worker's output: its log, rotated; its progress
/// lines, copied to the progress stream; nothing while the filesystem is
/// below its floor.
#[derive(Debug)]
pub struct StreamWriter {
    log: RotatingFile,
    progress: RotatingFile,
    floor: Option<FreeSpaceFloor>,
    /// The progress stream's partial last line (a progress line is copied
    /// whole or not at all), and whether the current line is too long to be
    /// one.
    line: Vec<u8>,
    skipping: bool,
    since_check: u64,
    /// While paused: when the space was last looked at, and what was
    /// dropped.
    paused: Option<(Instant, u64)>,
}

impl StreamWriter {
    /// Opens the log `log` (and its progress stream) to append to.
    pub fn open(
        log: &Path,
        rotation: Rotation,
        floor: Option<FreeSpaceFloor>,
    ) -> std::io::Result<StreamWriter> {
        let mut w = StreamWriter {
            log: RotatingFile::open(log, rotation)?,
            progress: RotatingFile::open(&progress_path(log), PROGRESS_ROTATION)?,
            floor,
            line: Vec::new(),
            skipping: false,
            since_check: 0,
            paused: None,
        };
        // A writer that resumes after a pause starts unpaused.
        let _ = std::fs::remove_file(paused_path(log));
        w.check_space();
        Ok(w)
    }

    /// Writes what the worker printed. Errors writing (a full disk) drop
    /// the bytes and are counted, never returned: the worker goes on.
    pub fn write(&mut self, buf: &[u8]) {
        self.copy_progress(buf);
        self.since_check += buf.len() as u64;
        if self.since_check >= FREE_SPACE_CHECK_BYTES {
            self.check_space();
        }
        if let Some((at, dropped)) = &mut self.paused {
            *dropped += buf.len() as u64;
            if at.elapsed() >= FREE_SPACE_CHECK_PAUSED {
                self.check_space();
            }
            return;
        }
        if let Err(e) = self.log.write(buf) {
            tracing::warn!(log = %self.log.base.display(), "writing a worker log: {e}");
            self.pause(format!("writing failed: {e}"), buf.len() as u64);
        }
    }

    /// Copies each whole progress line of `buf` to the progress stream.
    fn copy_progress(&mut self, mut buf: &[u8]) {
        while let Some(nl) = buf.iter().position(|b| *b == b'\n') {
            if !std::mem::take(&mut self.skipping) {
                self.line.extend_from_slice(&buf[..=nl]);
                if self.line.starts_with(PROGRESS_MARKER.as_bytes())
                    && self.line.len() <= PROGRESS_LINE_MAX_LEN + 1
                {
                    // A full disk loses the sample, not the worker.
                    let _ = self.progress.write(&self.line);
                }
            }
            self.line.clear();
            buf = &buf[nl + 1..];
        }
        if !self.skipping {
            self.line.extend_from_slice(buf);
            if self.line.len() > PROGRESS_LINE_MAX_LEN {
                self.line.clear();
                self.skipping = true;
            }
        }
    }

    fn check_space(&mut self) {
        self.since_check = 0;
        let dir = self.log.base.parent().unwrap_or(Path::new("."));
        // Without a floor, a log paused by a failed write tries again.
        let below = match self.floor {
            Some(floor) => match free_bytes(dir) {
                Ok(free) => (free < floor.min_free_bytes).then_some((free, floor)),
                Err(_) => return,
            },
            None => None,
        };
        match (&mut self.paused, below) {
            (Some((at, _)), Some(_)) => *at = Instant::now(),
            (None, Some((free, floor))) => self.pause(
                format!(
                    "the filesystem holding it has {} free, under the floor of {}",
                    show_bytes(free),
                    show_bytes(floor.min_free_bytes)
                ),
                0,
            ),
            (Some((_, dropped)), None) => {
                let dropped = *dropped;
                self.paused = None;
                let _ = std::fs::remove_file(paused_path(&self.log.base));
                let line = format!(
                    "keel: {dropped} bytes of output were dropped while the log was paused\n"
                );
                let _ = self.log.write(line.as_bytes());
            }
            (None, None) => {}
        }
    }

    fn pause(&mut self, why: String, dropped: u64) {
        let sentence = format!("worker log paused: {why}");
        tracing::warn!(log = %self.log.base.display(), "{sentence}");
        // Said in the log (best effort: there may be no room) and in the
        // marker the executor reports on the node and the job.
        let _ = self.log.write(format!("keel: {sentence}\n").as_bytes());
        let _ = std::fs::write(paused_path(&self.log.base), &sentence);
        self.paused = Some((Instant::now(), dropped));
    }

    /// Whether output is being dropped for want of space.
    pub fn is_paused(&self) -> bool {
        self.paused.is_some()
    }
}

/// A byte count as people read it (`12.0 MiB`).
pub fn show_bytes(n: u64) -> String {
    const UNITS: [&str; 5] = ["B", "KiB", "MiB", "GiB", "TiB"];
    let mut v = n as f64;
    let mut unit = 0;
    while v >= 1024.0 && unit + 1 < UNITS.len() {
        v /= 1024.0;
        unit += 1;
    }
    if unit == 0 {
        format!("{n} B")
    } else {
        format!("{v:.1} {}", UNITS[unit])
    }
}

/// Copies `input` to `sink` until its end (what `keel log-writer` and the
/// supervisor run on a worker's output pipe).
pub fn copy_to_end(mut input: impl Read, mut sink: impl FnMut(&[u8])) -> std::io::Result<()> {
    let mut buf = vec![0u8; 64 * 1024];
    loop {
        match input.read(&mut buf) {
            Ok(0) => return Ok(()),
            Ok(n) => sink(&buf[..n]),
            Err(e) if e.kind() == std::io::ErrorKind::Interrupted => continue,
            Err(e) => return Err(e),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const SMALL: Rotation = Rotation {
        max_file_bytes: 100,
        max_files: 3,
    };

    fn lines(from: u64, to: u64) -> Vec<u8> {
        (from..to)
            .flat_map(|i| format!("line {i:05}\n").into_bytes())
            .collect()
    }

    #[test]
    fn a_stream_keeps_at_most_its_files_and_offsets_never_go_back() {
        let dir = tempfile::tempdir().unwrap();
        let base = dir.path().join("e1-r0.log");
        let mut w = StreamWriter::open(&base, SMALL, None).unwrap();
        let all = lines(0, 200); // 11 bytes a line, 2,200 bytes
        let mut last_total = 0;
        for chunk in all.chunks(37) {
            w.write(chunk);
            let seg = segments(&base).unwrap();
            assert!(
                seg.total() >= last_total,
                "the stream's length never goes back"
            );
            last_total = seg.total();
            assert!(seg.rotated.len() <= 2, "{seg:?}");
            for (_, _, len) in &seg.rotated {
                assert!(*len <= 100);
            }
        }
        let seg = segments(&base).unwrap();
        assert_eq!(seg.total(), all.len() as u64);
        let on_disk: u64 = seg.rotated.iter().map(|r| r.2).sum::<u64>() + seg.current_len;
        assert!(on_disk <= SMALL.max_bytes(), "{on_disk} bytes on disk");
        // Files are cut at lines' ends: every rotated file holds whole lines.
        for (_, path, _) in &seg.rotated {
            let body = std::fs::read(path).unwrap();
            assert_eq!(body.len() % 11, 0, "{}", path.display());
        }
        // The tail reads across files, and matches what was written.
        let (tail, total) = read_tail(&base, 150).unwrap();
        assert_eq!(total, all.len() as u64);
        assert_eq!(tail, all[all.len() - 150..]);
        // A reader whose offset was rotated away resumes at the first byte
        // still there.
        let (at, bytes, _) = read_from(&base, 5, 1000).unwrap();
        assert_eq!(at, seg.first());
        assert_eq!(bytes, all[usize::try_from(at).unwrap()..]);
    }

    #[test]
    fn a_reopened_stream_continues_where_it_was() {
        let dir = tempfile::tempdir().unwrap();
        let base = dir.path().join("e1-r0.log");
        let all = lines(0, 40);
        let (a, b) = all.split_at(150);
        StreamWriter::open(&base, SMALL, None).unwrap().write(a);
        StreamWriter::open(&base, SMALL, None).unwrap().write(b);
        let (at, bytes, total) = read_from(&base, 0, 10_000).unwrap();
        assert_eq!(total, all.len() as u64);
        assert_eq!(bytes, all[usize::try_from(at).unwrap()..]);
        remove_stream(&base).unwrap();
        assert_eq!(segments(&base).unwrap().total(), 0);
    }

    #[test]
    fn progress_lines_are_copied_whole_and_others_not() {
        let dir = tempfile::tempdir().unwrap();
        let base = dir.path().join("e1-r0.log");
        let mut w = StreamWriter::open(&base, SMALL, None).unwrap();
        w.write(b"noise\nKEEL_PROGRESS {\"st");
        w.write(b"ep\": 4}\nmore KEEL_PROGRESS {}\n");
        let mut long = b"KEEL_PROGRESS {\"pad\": \"".to_vec();
        long.extend(std::iter::repeat_n(b'x', PROGRESS_LINE_MAX_LEN + 10));
        w.write(&long);
        w.write(b"\"}\nKEEL_PROGRESS {\"step\": 5}\n");
        let (_, progress, _) = read_from(&progress_path(&base), 0, 1 << 20).unwrap();
        assert_eq!(
            progress,
            b"KEEL_PROGRESS {\"step\": 4}\nKEEL_PROGRESS {\"step\": 5}\n"
        );
    }

    #[test]
    fn a_writer_below_its_floor_drops_output_and_says_so() {
        let dir = tempfile::tempdir().unwrap();
        let base = dir.path().join("e1-r0.log");
        let floor = FreeSpaceFloor {
            min_free_bytes: u64::MAX,
        };
        let mut w = StreamWriter::open(&base, SMALL, Some(floor)).unwrap();
        assert!(w.is_paused());
        w.write(b"dropped\nKEEL_PROGRESS {\"step\": 1}\n");
        let (log, _) = read_tail(&base, 1 << 20).unwrap();
        let log = String::from_utf8_lossy(&log);
        assert!(
            log.contains("worker log paused: the filesystem holding it has"),
            "{log}"
        );
        assert!(!log.contains("dropped\n"), "{log}");
        let marker = std::fs::read_to_string(paused_path(&base)).unwrap();
        assert!(marker.contains("under the floor of"), "{marker}");
        // Progress lines still reach the executor (their stream is small).
        let (_, progress, _) = read_from(&progress_path(&base), 0, 1 << 20).unwrap();
        assert_eq!(progress, b"KEEL_PROGRESS {\"step\": 1}\n");
    }

    #[test]
    fn a_job_gets_what_it_asks_within_the_servers_maximum() {
        let server = LogSettings::default();
        let (r, notes) = server.for_job(&keel_state::spec::LogLimits {
            max_file_bytes: Some(256 << 10),
            max_files: Some(2),
        });
        assert_eq!(
            (r.max_file_bytes, r.max_files, notes.len()),
            (256 << 10, 2, 0)
        );
        let (r, notes) = server.for_job(&keel_state::spec::LogLimits {
            max_file_bytes: Some(1 << 30),
            max_files: None,
        });
        assert_eq!(r, DEFAULT_LOG_ROTATION);
        assert_eq!(
            notes,
            vec!["logs.max_file_size 1Gi is above this server's maximum of 10Mi (--worker-log-max-file-bytes): 10Mi it is"]
        );
    }

    #[test]
    fn rotations_out_of_range_are_refused_naming_the_field() {
        let bad = Rotation {
            max_file_bytes: 10,
            max_files: 5,
        };
        let e = bad.checked("--worker-log-max-file-bytes").unwrap_err();
        assert!(
            e.contains("--worker-log-max-file-bytes") && e.contains("65536"),
            "{e}"
        );
        let bad = Rotation {
            max_file_bytes: MIN_FILE_BYTES,
            max_files: 1,
        };
        assert!(bad
            .checked("x")
            .unwrap_err()
            .contains("1 files is outside 2 to 100"));
        assert_eq!(DEFAULT_LOG_ROTATION.checked("x"), Ok(DEFAULT_LOG_ROTATION));
    }
}
