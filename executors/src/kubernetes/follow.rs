//! Reading a container's log as the API server streams it: bytes, not
//! text (a worker may print anything), a line at a time with a bound on
//! its length, and a place to resume from when the stream ends before the
//! container does (the kubelet rotated the file, the connection broke).
//!
//! The API server has no byte offsets for logs; it has timestamps
//! (`timestamps=true` puts each line's RFC 3339 time first) and
//! `sinceTime` (whole seconds). [`ResumePoint`] keeps the last line's time
//! and how many lines carried it, so a reopened stream from that second on
//! skips exactly what was read.

use futures::{AsyncBufRead, AsyncBufReadExt};
use k8s_openapi::jiff::Timestamp;

/// The longest line kept; the rest of a longer one is dropped.
pub const LINE_MAX_BYTES: usize = 64 * 1024;

/// Reads one line (without its `\n`) of at most [`LINE_MAX_BYTES`];
/// `None` at the end of the stream. A stream that breaks mid-line ends
/// it there.
pub async fn next_line<R: AsyncBufRead + Unpin>(reader: &mut R) -> Option<Vec<u8>> {
    let mut line = Vec::new();
    loop {
        let chunk = match reader.fill_buf().await {
            Ok(c) => c,
            Err(e) => {
                tracing::debug!(error = %e, "log stream broke");
                return (!line.is_empty()).then_some(line);
            }
        };
        if chunk.is_empty() {
            return (!line.is_empty()).then_some(line);
        }
        let (used, done) = match chunk.iter().position(|b| *b == b'\n') {
            Some(i) => (i + 1, true),
            None => (chunk.len(), false),
        };
        let room = LINE_MAX_BYTES.saturating_sub(line.len());
        let take = if done { used - 1 } else { used };
        line.extend_from_slice(&chunk[..take.min(room)]);
        reader.consume_unpin(used);
        if done {
            return Some(line);
        }
    }
}

/// Where a followed log was read to.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct ResumePoint {
    /// The time of the last line read, and how many lines read had it.
    last: Option<(Timestamp, u32)>,
}

impl ResumePoint {
    /// The `sinceTime` to reopen the stream with: the last line's second
    /// (the API server takes whole seconds), or from the start.
    pub fn since(&self) -> Option<Timestamp> {
        let (t, _) = self.last?;
        Timestamp::from_second(t.as_second()).ok()
    }

    /// Splits a timestamped line into its text, or `None` when it was read
    /// before (a reopened stream repeats its last second). Lines without a
    /// timestamp are passed on as they are.
    pub fn take<'a>(&mut self, line: &'a [u8]) -> Option<&'a [u8]> {
        let space = line.iter().position(|b| *b == b' ');
        let parsed = space.and_then(|i| {
            let t: Timestamp = std::str::from_utf8(&line[..i]).ok()?.parse().ok()?;
            Some((t, &line[i + 1..]))
        });
        let Some((t, text)) = parsed else {
            return Some(line);
        };
        match self.last {
            Some((last, _)) if t < last => None,
            Some((last, n)) if t == last => {
                // Lines of the same instant: count them; a repeat is
                // skipped by the count kept on the way back.
                self.last = Some((last, n + 1));
                Some(text)
            }
            _ => {
                self.last = Some((t, 1));
                Some(text)
            }
        }
    }

    /// Starts a reopened stream: lines at the last instant are skipped
    /// until as many as were read have gone by.
    pub fn reopened(&self) -> Replay {
        Replay {
            at: self.last,
            seen: 0,
        }
    }
}

/// Skips, at the start of a reopened stream, the lines read before.
#[derive(Debug)]
pub struct Replay {
    at: Option<(Timestamp, u32)>,
    seen: u32,
}

impl Replay {
    /// Whether `line` (timestamped) was read before the stream reopened.
    pub fn read_before(&mut self, line: &[u8]) -> bool {
        let Some((last, count)) = self.at else {
            return false;
        };
        let t = line.iter().position(|b| *b == b' ').and_then(|i| {
            std::str::from_utf8(&line[..i])
                .ok()?
                .parse::<Timestamp>()
                .ok()
        });
        match t {
            Some(t) if t < last => true,
            Some(t) if t == last && self.seen < count => {
                self.seen += 1;
                true
            }
            _ => {
                // Past the point: nothing more to skip.
                self.at = None;
                false
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn lines_are_bytes_bounded_and_a_broken_last_line_is_kept() {
        let mut bytes: Vec<u8> = b"one\n\xff\xfe bad\n".to_vec();
        bytes.extend(std::iter::repeat_n(b'x', LINE_MAX_BYTES + 10));
        bytes.extend(b"\nlast");
        let mut r = futures::io::Cursor::new(bytes);
        assert_eq!(next_line(&mut r).await.as_deref(), Some(&b"one"[..]));
        assert_eq!(
            next_line(&mut r).await.as_deref(),
            Some(&b"\xff\xfe bad"[..])
        );
        assert_eq!(
            next_line(&mut r).await.map(|l| l.len()),
            Some(LINE_MAX_BYTES)
        );
        assert_eq!(next_line(&mut r).await.as_deref(), Some(&b"last"[..]));
        assert_eq!(next_line(&mut r).await, None);
    }

    #[test]
    fn a_reopened_stream_skips_exactly_what_was_read() {
        let mut at = ResumePoint::default();
        let lines: Vec<&[u8]> = vec![
            b"2026-11-28T10:00:00.100Z a",
            b"2026-11-28T10:00:00.700Z b",
            b"2026-11-28T10:00:00.700Z c",
        ];
        for l in &lines {
            assert!(at.take(l).is_some());
        }
        assert_eq!(
            at.since().map(|t| t.to_string()).as_deref(),
            Some("2026-11-28T10:00:00Z")
        );
        // The reopened stream repeats the second, then goes on.
        let mut replay = at.reopened();
        let again: Vec<&[u8]> = vec![
            b"2026-11-28T10:00:00.100Z a",
            b"2026-11-28T10:00:00.700Z b",
            b"2026-11-28T10:00:00.700Z c",
            b"2026-11-28T10:00:00.700Z d",
            b"2026-11-28T10:00:01.000Z e",
        ];
        let fresh: Vec<&[u8]> = again
            .into_iter()
            .filter(|l| !replay.read_before(l))
            .collect();
        assert_eq!(
            fresh,
            vec![
                &b"2026-11-28T10:00:00.700Z d"[..],
                &b"2026-11-28T10:00:01.000Z e"[..]
            ]
        );
    }
}
