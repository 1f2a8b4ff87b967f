//! The agent protocol: what the executor says to `keel-node.sh serve` on a
//! host and what it answers. Pure: bytes in, values out.
//!
//! - A **request** is one line: an id, then the helper command and its
//!   arguments, each single-quoted for the agent's `eval` (a newline inside
//!   an argument travels as `$nl`).
//! - A **reply** is a header line `@@ ID STATUS OUT_LEN ERR_LEN`, then
//!   `OUT_LEN` bytes of the command's stdout and `ERR_LEN` of its stderr.
//!
//! [`AgentCodec`] frames both (tokio-util's codec traits), so the
//! connection reads whole replies and writes whole requests. The `poll` and
//! `logs` commands' stdout have their own line formats, parsed by
//! [`parse_poll`] and [`parse_logs`].

use keel_state::JobId;
use tokio_util::bytes::{Buf, BufMut, BytesMut};
use tokio_util::codec::{Decoder, Encoder};

use crate::executor::WorkerLog;
use crate::WorkerId;

/// The helper run on every host.
pub const HELPER_SCRIPT: &str = include_str!("keel-node.sh");

/// The most bytes of one log a poll returns (the helper's limit).
pub(super) const POLL_CHUNK_MAX: usize = 256 * 1024;

/// The longest reason kept for a node or a worker (a state limit).
pub(super) const REASON_MAX_LEN: usize = 1024;

/// The longest reply header the codec waits for.
const HEADER_MAX_LEN: usize = 128;

/// The largest reply (stdout and stderr together) the codec accepts; a
/// larger one is out of frame and ends the connection.
pub const REPLY_MAX_BYTES: usize = 256 * 1024 * 1024;

/// The helper's file name: versioned by its content, so hosts may keep
/// several versions while older supervisors finish.
pub fn helper_name() -> String {
    // FNV-1a: stable across builds and platforms.
    let mut h: u64 = 0xcbf2_9ce4_8422_2325;
    for b in HELPER_SCRIPT.bytes() {
        h ^= u64::from(b);
        h = h.wrapping_mul(0x0100_0000_01b3);
    }
    format!("keel-node-{h:016x}.sh")
}

/// Text on one line, at most [`REASON_MAX_LEN`] bytes.
pub(super) fn clip(s: &str) -> String {
    let mut one_line = s.split_whitespace().collect::<Vec<_>>().join(" ");
    keel_state::state::limits::cut_to(&mut one_line, REASON_MAX_LEN);
    one_line
}

/// A worker's files, relative to the workers directory: `job-J/eE-rR`.
pub(super) fn relative_base(id: &WorkerId) -> String {
    format!("job-{}/e{}-r{}", id.job_id, id.epoch, id.rank)
}

pub(super) fn parse_base(base: &str) -> Option<WorkerId> {
    let (job, rest) = base.split_once('/')?;
    let (e, r) = rest.split_once('-')?;
    Some(WorkerId {
        job_id: job.strip_prefix("job-")?.parse().ok()?,
        epoch: e.strip_prefix('e')?.parse().ok()?,
        rank: r.strip_prefix('r')?.parse().ok()?,
    })
}

/// One request to the agent.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(super) struct Request {
    pub id: u64,
    /// The helper command and its arguments.
    pub argv: Vec<String>,
}

/// What the agent answered to one request.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(super) struct Reply {
    pub id: u64,
    pub status: i32,
    pub stdout: Vec<u8>,
    pub stderr: Vec<u8>,
}

/// Why a request could not be written or a reply read.
#[derive(Debug, thiserror::Error)]
pub(super) enum ProtocolError {
    #[error("an argument or environment value contains a NUL byte")]
    Nul,
    #[error("the agent answered out of frame: {0:?}")]
    OutOfFrame(String),
    #[error("the agent's reply of {0} bytes is over the limit of {REPLY_MAX_BYTES}")]
    TooLarge(usize),
    #[error(transparent)]
    Io(#[from] std::io::Error),
}

/// Quotes `arg` for the agent's `eval`: single quotes, and a newline as
/// `$nl` (a request is one line).
pub(super) fn quote_for_agent(arg: &str) -> String {
    let mut out = String::with_capacity(arg.len() + 2);
    out.push('\'');
    for c in arg.chars() {
        match c {
            '\'' => out.push_str("'\\''"),
            '\n' => out.push_str("'\"$nl\"'"),
            c => out.push(c),
        }
    }
    out.push('\'');
    out
}

/// Frames requests (encoder) and replies (decoder).
#[derive(Debug, Default)]
pub(super) struct AgentCodec {
    /// The header of the reply being read: (id, status, stdout and stderr
    /// lengths).
    header: Option<(u64, i32, usize, usize)>,
}

fn parse_header(line: &str) -> Option<(u64, i32, usize, usize)> {
    let f: Vec<&str> = line.split(' ').collect();
    match f.as_slice() {
        ["@@", id, status, out_len, err_len] => Some((
            id.parse().ok()?,
            status.parse().ok()?,
            out_len.parse().ok()?,
            err_len.parse().ok()?,
        )),
        _ => None,
    }
}

impl Encoder<Request> for AgentCodec {
    type Error = ProtocolError;

    fn encode(&mut self, request: Request, dst: &mut BytesMut) -> Result<(), ProtocolError> {
        if request.argv.iter().any(|a| a.contains('\0')) {
            return Err(ProtocolError::Nul);
        }
        let mut line = request.id.to_string();
        for a in &request.argv {
            line.push(' ');
            line.push_str(&quote_for_agent(a));
        }
        line.push('\n');
        dst.put_slice(line.as_bytes());
        Ok(())
    }
}

impl Decoder for AgentCodec {
    type Item = Reply;
    type Error = ProtocolError;

    fn decode(&mut self, src: &mut BytesMut) -> Result<Option<Reply>, ProtocolError> {
        if self.header.is_none() {
            let Some(nl) = src.iter().position(|b| *b == b'\n') else {
                if src.len() > HEADER_MAX_LEN {
                    let start = String::from_utf8_lossy(&src[..HEADER_MAX_LEN]).into_owned();
                    return Err(ProtocolError::OutOfFrame(start));
                }
                return Ok(None);
            };
            let line = String::from_utf8_lossy(&src[..nl]).into_owned();
            let header = parse_header(&line).ok_or(ProtocolError::OutOfFrame(line))?;
            let body = header.2.saturating_add(header.3);
            if body > REPLY_MAX_BYTES {
                return Err(ProtocolError::TooLarge(body));
            }
            src.advance(nl + 1);
            src.reserve(body);
            self.header = Some(header);
        }
        let Some((id, status, out_len, err_len)) = self.header else {
            return Ok(None);
        };
        if src.len() < out_len + err_len {
            return Ok(None);
        }
        self.header = None;
        let stdout = src.split_to(out_len).to_vec();
        let stderr = src.split_to(err_len).to_vec();
        Ok(Some(Reply {
            id,
            status,
            stdout,
            stderr,
        }))
    }
}

/// A worker's state on its host, as a poll found it.
#[derive(Debug, PartialEq, Eq)]
pub(super) enum RemoteWorker {
    Running {
        port: u16,
        gpus: Vec<u32>,
    },
    Exited {
        code: Option<i32>,
        reason: String,
    },
    /// Its supervisor is gone and left no exit record.
    Gone,
}

/// What one `poll` answered.
#[derive(Debug, Default)]
pub(super) struct PollReport {
    pub workers: Vec<(WorkerId, RemoteWorker)>,
    /// (worker, offset the chunk starts at, the chunk) of rank 0's logs.
    pub chunks: Vec<(WorkerId, u64, Vec<u8>)>,
}

/// How far to read a log: from an offset, or from its end (a worker
/// re-adopted is followed from there).
pub(super) type ReadFrom = Option<u64>;

/// The `poll` request: delete the exit records of `forgets`, report every
/// worker, and read the logs of `reads` from their offsets.
pub(super) fn poll_request(
    workers_dir: String,
    forgets: &[WorkerId],
    reads: &[(WorkerId, ReadFrom)],
) -> Vec<String> {
    let mut argv = vec!["poll".to_string(), workers_dir];
    argv.extend(forgets.iter().map(|id| format!("F:{}", relative_base(id))));
    argv.extend(reads.iter().map(|(id, offset)| match offset {
        Some(o) => format!("{}:{o}", relative_base(id)),
        None => format!("{}:end", relative_base(id)),
    }));
    argv
}

/// The `poll` request a server shutting down sends: release `ids` (their
/// claims and exit records go, so the next leader launches them again).
pub(super) fn release_request(workers_dir: String, ids: &[WorkerId]) -> Vec<String> {
    let mut argv = vec!["poll".to_string(), workers_dir];
    argv.extend(ids.iter().map(|id| format!("R:{}", relative_base(id))));
    argv
}

/// Splits `out` at the first newline: (line, rest).
fn next_line(out: &[u8]) -> Option<(&str, &[u8])> {
    let nl = out.iter().position(|b| *b == b'\n')?;
    Some((std::str::from_utf8(&out[..nl]).ok()?, &out[nl + 1..]))
}

fn parse_gpus(csv: &str) -> Vec<u32> {
    csv.split(',').filter_map(|g| g.parse().ok()).collect()
}

/// Parses the helper's `poll` output.
pub(super) fn parse_poll(mut out: &[u8]) -> Result<PollReport, String> {
    let mut report = PollReport::default();
    loop {
        let (line, rest) =
            next_line(out).ok_or_else(|| "the poll's answer ended early".to_string())?;
        out = rest;
        let mut words = line.splitn(3, ' ');
        let kind = words.next().unwrap_or("");
        if kind == "END" {
            return Ok(report);
        }
        let base = words.next().unwrap_or("");
        let rest = words.next().unwrap_or("");
        let id = parse_base(base).ok_or_else(|| format!("unexpected poll line {line:?}"))?;
        match kind {
            "R" => {
                let f: Vec<&str> = rest.split(' ').collect();
                let port = f.first().and_then(|p| p.parse().ok()).unwrap_or(0);
                let gpus = f.get(1).map(|g| parse_gpus(g)).unwrap_or_default();
                report
                    .workers
                    .push((id, RemoteWorker::Running { port, gpus }));
            }
            "X" => {
                let (code, reason) = rest.split_once(' ').unwrap_or((rest, ""));
                report.workers.push((
                    id,
                    RemoteWorker::Exited {
                        code: code.parse().ok(),
                        reason: clip(reason),
                    },
                ));
            }
            "G" => report.workers.push((id, RemoteWorker::Gone)),
            "P" => {
                let mut f = rest.split(' ');
                let offset: u64 = f.next().and_then(|s| s.parse().ok()).unwrap_or(0);
                let len: usize = f
                    .next()
                    .and_then(|s| s.parse().ok())
                    .ok_or_else(|| format!("unexpected poll line {line:?}"))?;
                if out.len() < len {
                    return Err("a log chunk ended early".into());
                }
                report.chunks.push((id, offset, out[..len].to_vec()));
                out = &out[len..];
            }
            _ => return Err(format!("unexpected poll line {line:?}")),
        }
    }
}

/// Parses the helper's `logs` output for one job.
pub(super) fn parse_logs(job_id: JobId, mut out: &[u8]) -> Vec<WorkerLog> {
    let mut logs = Vec::new();
    while let Some((line, rest)) = next_line(out) {
        let f: Vec<&str> = line.split(' ').collect();
        let (Some(&"L"), Some(name), Some(total), Some(len)) =
            (f.first(), f.get(1), f.get(2), f.get(3))
        else {
            break;
        };
        let (Ok(total_bytes), Ok(len)) = (total.parse::<u64>(), len.parse::<usize>()) else {
            break;
        };
        // Why the log is paused, when it is: that many more bytes.
        let why_len = f.get(4).and_then(|n| n.parse::<usize>().ok()).unwrap_or(0);
        let Some(id) = name
            .strip_suffix(".log")
            .and_then(|stem| parse_base(&format!("job-{job_id}/{stem}")))
        else {
            break;
        };
        if rest.len() < len + why_len {
            break;
        }
        let why = &rest[len..len + why_len];
        logs.push(WorkerLog {
            id,
            content: rest[..len].to_vec(),
            total_bytes,
            paused: (why_len > 0).then(|| clip(&String::from_utf8_lossy(why))),
        });
        out = &rest[len + why_len..];
    }
    logs
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn bases_round_trip() {
        let id = WorkerId {
            job_id: 12,
            epoch: 3,
            rank: 1,
        };
        assert_eq!(parse_base(&relative_base(&id)), Some(id));
        assert_eq!(parse_base("job-x/e1-r0"), None);
        assert!(helper_name().starts_with("keel-node-"));
    }

    #[test]
    fn agent_words_quote_quotes_and_newlines() {
        assert_eq!(quote_for_agent("a b"), "'a b'");
        assert_eq!(quote_for_agent("it's"), "'it'\\''s'");
        assert_eq!(quote_for_agent("x\ny"), "'x'\"$nl\"'y'");
        assert_eq!(quote_for_agent(""), "''");
    }

    #[test]
    fn requests_are_one_line_and_refuse_nul() {
        let mut codec = AgentCodec::default();
        let mut out = BytesMut::new();
        codec
            .encode(
                Request {
                    id: 7,
                    argv: vec!["signal".into(), "TERM".into(), "a b\nc".into()],
                },
                &mut out,
            )
            .expect("encodes");
        assert_eq!(&out[..], b"7 'signal' 'TERM' 'a b'\"$nl\"'c'\n");
        let nul = Request {
            id: 8,
            argv: vec!["x\0y".into()],
        };
        assert!(matches!(
            codec.encode(nul, &mut out),
            Err(ProtocolError::Nul)
        ));
    }

    #[test]
    fn replies_are_framed_across_reads() {
        let mut codec = AgentCodec::default();
        let wire = b"@@ 3 0 5 2\nab\ncdE!@@ 4 1 0 0\n";
        let mut src = BytesMut::new();
        let mut replies = Vec::new();
        // One byte at a time: every split of a frame is read whole.
        for b in wire {
            src.put_u8(*b);
            while let Some(r) = codec.decode(&mut src).expect("decodes") {
                replies.push(r);
            }
        }
        assert_eq!(
            replies,
            vec![
                Reply {
                    id: 3,
                    status: 0,
                    stdout: b"ab\ncd".to_vec(),
                    stderr: b"E!".to_vec()
                },
                Reply {
                    id: 4,
                    status: 1,
                    stdout: Vec::new(),
                    stderr: Vec::new()
                }
            ]
        );
        assert!(src.is_empty());
    }

    #[test]
    fn a_reply_out_of_frame_or_too_large_is_an_error() {
        let mut codec = AgentCodec::default();
        let mut src = BytesMut::from(&b"hello there\n"[..]);
        assert!(matches!(
            codec.decode(&mut src),
            Err(ProtocolError::OutOfFrame(l)) if l == "hello there"
        ));
        let mut codec = AgentCodec::default();
        let mut src = BytesMut::from(&[b'x'; HEADER_MAX_LEN + 1][..]);
        assert!(matches!(
            codec.decode(&mut src),
            Err(ProtocolError::OutOfFrame(_))
        ));
        let mut codec = AgentCodec::default();
        let mut src = BytesMut::from(format!("@@ 1 0 {REPLY_MAX_BYTES} 1\n").as_bytes());
        assert!(matches!(
            codec.decode(&mut src),
            Err(ProtocolError::TooLarge(n)) if n == REPLY_MAX_BYTES + 1
        ));
    }

    #[test]
    fn poll_answers_parse_with_binary_chunks() {
        let mut out = b"R job-1/e1-r0 29500 0,1\nX job-2/e1-r0 137 killed by SIGKILL (status 137)\nG job-3/e2-r1\n".to_vec();
        out.extend_from_slice(b"P job-1/e1-r0 10 5\nab\ncdP job-1/e1-r1 0 0\nEND\n");
        let r = parse_poll(&out).expect("parses");
        assert_eq!(r.workers.len(), 3);
        assert_eq!(
            r.workers[0].1,
            RemoteWorker::Running {
                port: 29500,
                gpus: vec![0, 1]
            }
        );
        assert_eq!(
            r.workers[1].1,
            RemoteWorker::Exited {
                code: Some(137),
                reason: "killed by SIGKILL (status 137)".into()
            }
        );
        assert_eq!(r.workers[2].1, RemoteWorker::Gone);
        assert_eq!(r.chunks[0].2, b"ab\ncd");
        assert_eq!(r.chunks[1].2, b"");
        assert!(parse_poll(b"R job-1/e1-r0 1 0\n").is_err(), "no END");
        assert!(parse_poll(b"P job-1/e1-r0 0 50\nshort").is_err());
        assert!(parse_poll(b"Q what\nEND\n").is_err());
    }

    #[test]
    fn poll_requests_name_forgets_and_reads() {
        let id = |job_id| WorkerId {
            job_id,
            epoch: 2,
            rank: 0,
        };
        assert_eq!(
            poll_request("/w".into(), &[id(1)], &[(id(2), Some(10)), (id(3), None)]),
            vec![
                "poll",
                "/w",
                "F:job-1/e2-r0",
                "job-2/e2-r0:10",
                "job-3/e2-r0:end"
            ]
        );
        assert_eq!(
            release_request("/w".into(), &[id(4)]),
            vec!["poll", "/w", "R:job-4/e2-r0"]
        );
    }

    #[test]
    fn log_answers_parse() {
        let logs = parse_logs(4, b"L e1-r0.log 100 3\nabcL e2-r1.log 2 2 5\nxyfull!");
        assert_eq!(logs.len(), 2);
        assert_eq!(logs[0].paused, None);
        assert_eq!(logs[1].paused.as_deref(), Some("full!"));
        assert_eq!(logs[0].content, b"abc");
        assert_eq!(logs[0].total_bytes, 100);
        assert_eq!(
            logs[1].id,
            WorkerId {
                job_id: 4,
                epoch: 2,
                rank: 1
            }
        );
    }
}
