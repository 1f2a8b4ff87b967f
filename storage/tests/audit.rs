//! Issue 27, item 4: the audit export of a real data directory (the
//! committed fixture: WAL and sled files written by an earlier Keel)
//! verifies, is the same bytes every time, and fails at the line that was
//! changed, whichever field of it was.

use keel_storage::audit::{export, verify, AuditError};
use keel_storage::{replay_data_dir, DataDir, Until};

#[path = "support/fixture.rs"]
mod fixture;

use fixture::fixture;

fn export_of(dir: &DataDir, after: u64, until: Until) -> String {
    let mut out = Vec::new();
    export(dir, after, until, &mut out).expect("exports");
    String::from_utf8(out).expect("utf-8")
}

/// The line (counted from 1) verification fails at.
fn failing_line(text: &str) -> u64 {
    match verify(text.as_bytes()) {
        Err(AuditError::Disagrees { line, .. }) => line,
        other => panic!("verified: {other:?}"),
    }
}

/// `text` with line `line` (from 1) changed by `change`.
fn with_line(text: &str, line: usize, change: impl Fn(&str) -> String) -> String {
    text.lines()
        .enumerate()
        .map(|(n, l)| {
            if n + 1 == line {
                change(l)
            } else {
                l.to_string()
            }
        })
        .collect::<Vec<_>>()
        .join("\n")
        + "\n"
}

/// Changes one character of field `field`'s value in a JSON line: a digit
/// to another digit, a letter to another letter, `null` to a number.
fn change_field(line: &str, field: &str) -> String {
    let at = line
        .find(&format!("\"{field}\":"))
        .unwrap_or_else(|| panic!("{field} in {line}"))
        + field.len()
        + 3;
    let rest = &line[at..];
    if let Some(after) = rest.strip_prefix("null") {
        return format!("{}1234{after}", &line[..at]);
    }
    let (offset, c) = rest
        .char_indices()
        .find(|(_, c)| c.is_ascii_alphanumeric())
        .expect("a digit or letter");
    let changed = match c {
        '0'..='8' => (c as u8 + 1) as char,
        '9' => '0',
        'a'..='y' | 'A'..='Y' => (c as u8 + 1) as char,
        _ => 'a',
    };
    format!("{}{changed}{}", &line[..at + offset], &rest[offset + 1..])
}

#[test]
fn an_export_verifies_to_the_replayed_state_and_is_the_same_bytes_twice() {
    let tmp = fixture();
    let dir = DataDir::open(tmp.path()).expect("data dir");
    let replayed = replay_data_dir(&dir, Until::End).expect("replays");
    let text = export_of(&dir, 0, Until::End);
    assert_eq!(text, export_of(&dir, 0, Until::End), "the same bytes");
    let summary = verify(text.as_bytes()).expect("verifies");
    assert_eq!(summary.last_index, replayed.last_index);
    assert_eq!(summary.state_hash, replayed.state_hash.to_string());
    assert_eq!(summary.entries, replayed.entries);
    assert_eq!(text.lines().count() as u64, summary.entries + 2);
    // Terms come from the Raft log while it holds the entry: the fixture
    // kept its last few.
    let terms: Vec<serde_json::Value> = text
        .lines()
        .filter_map(|l| serde_json::from_str::<serde_json::Value>(l).ok())
        .filter(|v| v["record"] == "entry")
        .map(|v| v["term"].clone())
        .collect();
    assert!(terms.first().is_some_and(serde_json::Value::is_null));
    assert!(terms.last().is_some_and(serde_json::Value::is_u64));

    // A part: the state before it is in the header, and the part verifies
    // to the same end.
    let part = export_of(&dir, 20, Until::End);
    let part_summary = verify(part.as_bytes()).expect("a part verifies");
    assert_eq!(part_summary.after_index, 20);
    assert_eq!(part_summary.state_hash, summary.state_hash);
    assert!(part
        .lines()
        .next()
        .is_some_and(|h| h.contains("\"snapshot\":\"")));
    // Up to an index.
    let head = export_of(&dir, 0, Until::Index(12));
    assert_eq!(verify(head.as_bytes()).expect("verifies").last_index, 12);
    // A first index past the last one is refused, naming both, and
    // nothing is written.
    let mut out = Vec::new();
    match export(&dir, 20, Until::Index(12), &mut out) {
        Err(AuditError::EmptyRange { from: 21, last: 12 }) => {}
        other => panic!("{other:?}"),
    }
    assert!(out.is_empty());
    // Past the end, `--until` not named: found only by reading to the
    // end, and still nothing written.
    let last = summary.last_index;
    match export(&dir, last, Until::End, &mut out) {
        Err(AuditError::EmptyRange { from, last: l }) if from == last + 1 && l == last => {}
        other => panic!("{other:?}"),
    }
    assert!(out.is_empty());
    let last = export_of(&dir, summary.last_index - 1, Until::End);
    assert_eq!(verify(last.as_bytes()).expect("verifies").entries, 1);
}

#[test]
fn a_change_to_any_field_of_a_line_fails_at_that_line() {
    let tmp = fixture();
    let dir = DataDir::open(tmp.path()).expect("data dir");
    let text = export_of(&dir, 0, Until::End);
    let lines: Vec<&str> = text.lines().collect();
    // A submission in the middle, and the last entry (which has a term).
    let submission = lines
        .iter()
        .position(|l| l.contains("\"kind\":\"submit_job\""))
        .expect("a submission")
        + 1;
    let last_entry = lines.len() - 1;
    for (line, field) in [
        (submission, "index"),
        (submission, "term"),
        (last_entry, "term"),
        (submission, "at_ms"),
        (submission, "time"),
        (submission, "actor"),
        (submission, "request_id"),
        (submission, "kind"),
        (submission, "command"),
        (submission, "entry"),
        (submission, "outcome"),
        (submission, "state_hash"),
        (submission, "prev"),
        (last_entry, "prev"),
        (1, "state_hash"),
        (1, "after_index"),
        (lines.len(), "entries"),
        (lines.len(), "seal"),
    ] {
        let changed = with_line(&text, line, |l| change_field(l, field));
        assert_ne!(changed, text, "{field} changed");
        assert_eq!(
            failing_line(&changed),
            line as u64,
            "a change to {field} on line {line}: {:?}",
            verify(changed.as_bytes()).err().map(|e| e.to_string())
        );
    }
    // A line taken out, and the end cut off.
    let without = with_line(&text, submission, |_| String::new()).replace("\n\n", "\n");
    assert!(verify(without.as_bytes()).is_err());
    let cut: String = lines[..lines.len() - 1]
        .iter()
        .map(|l| format!("{l}\n"))
        .collect();
    let cut_error = verify(cut.as_bytes()).expect_err("cut short");
    assert!(cut_error.to_string().contains("end record"), "{cut_error}");
}
