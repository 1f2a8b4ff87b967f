//! Golden bytes (issue 21, item 2): every kind of log entry, a proposal and
//! a snapshot, encoded once and committed under `tests/fixtures/golden/`,
//! must decode to the same values in every later version. A change that
//! breaks one of them breaks the disks and the peers of every cluster
//! running the version before.
//!
//! A new kind gets its golden file the first time this runs with
//! `KEEL_WRITE_GOLDEN=1` (written only where none exists; never
//! overwritten); commit it. Without that variable a missing file fails.

use std::path::{Path, PathBuf};

use keel_state::codec::{decode_entry, decode_proposal, encode_entry, encode_proposal};
use keel_state::command::{Command, JobOutcome, JobPlacement, LogEntry, Proposal};
use keel_state::fixtures::job_spec;
use keel_state::model::{Gpu, GpuRef, ProgressSample};
use keel_state::policy_memory::PolicyMemory;
use keel_state::ClusterState;
use keel_storage::snapshot_codec::{decode_snapshot, encode_snapshot};

/// The hash of the state the golden entries build, as when the snapshot
/// fixture was written.
const SNAPSHOT_STATE_HASH: &str =
    "5e1eeff7ddc94073dbbb18bb8d840ab2f8203130bf39b2070eaf5ee007986e83";

fn dir() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/golden")
}

/// The bytes committed under `name`, writing `fresh` there first if the
/// file is missing and `KEEL_WRITE_GOLDEN` is set.
fn golden(name: &str, fresh: &[u8]) -> Vec<u8> {
    let path = dir().join(name);
    if !path.exists() {
        assert!(
            std::env::var_os("KEEL_WRITE_GOLDEN").is_some(),
            "no golden file {}: run once with KEEL_WRITE_GOLDEN=1 and commit it",
            path.display()
        );
        std::fs::create_dir_all(dir()).expect("golden dir");
        std::fs::write(&path, fresh).expect("write golden");
    }
    std::fs::read(&path).expect("read golden")
}

/// Every command kind, by a match without a wildcard: a new kind does not
/// compile here until it is counted in `KINDS` and given an example below.
const fn every_kind(c: &Command) {
    match c {
        Command::RegisterNode { .. }
        | Command::MarkNodeLost { .. }
        | Command::MarkNodeRecovered { .. }
        | Command::RemoveNode { .. }
        | Command::SubmitJob { .. }
        | Command::CancelJob { .. }
        | Command::DecideAllocation { .. }
        | Command::RecordWorkerStarted { .. }
        | Command::RecordWorkerExited { .. }
        | Command::ReportProgress { .. }
        | Command::FinishJob { .. }
        | Command::RemoveJob { .. }
        | Command::SetPolicy { .. } => {}
    }
}
const KINDS: usize = 13;

fn gpu(index: u32) -> GpuRef {
    GpuRef {
        node: "n0".into(),
        index,
    }
}

/// One example of every kind, in an order that applies (each field set to
/// something other than its default where it has one), and the variants
/// that are written in newer formats: a shared placement (format 2), a
/// client's request id (format 3), a policy memory (format 4).
fn examples() -> Vec<(&'static str, LogEntry)> {
    let mut spec = job_spec("golden", 2, 1);
    spec.model = Some("resnet50".into());
    spec.priority = 3;
    spec.env.insert("SEED".into(), "7".into());
    let e = |at_ms: u64, command: Command| LogEntry::new(at_ms, command);
    vec![
        (
            "register_node",
            e(
                1_000,
                Command::RegisterNode {
                    name: "n0".into(),
                    address: "10.0.0.1:7070".into(),
                    gpus: (0..4)
                        .map(|index| Gpu {
                            index,
                            gpu_type: if index < 2 { "v100" } else { "k80" }.into(),
                        })
                        .collect(),
                },
            ),
        ),
        (
            "submit_job",
            e(2_000, Command::SubmitJob { spec: spec.clone() }),
        ),
        (
            "submit_job-request-id",
            LogEntry {
                request_id: Some("cli-golden-1".into()),
                ..e(
                    2_500,
                    Command::SubmitJob {
                        spec: job_spec("second", 1, 1),
                    },
                )
            },
        ),
        (
            "decide_allocation",
            e(
                3_000,
                Command::DecideAllocation {
                    based_on: 3,
                    policy: "fifo".into(),
                    round: 1,
                    placements: vec![JobPlacement::alone(1, vec![gpu(0), gpu(1)])],
                    memory: None,
                },
            ),
        ),
        (
            "decide_allocation-shared-with-memory",
            e(
                3_500,
                Command::DecideAllocation {
                    based_on: 4,
                    policy: "max_min_fairness_packed".into(),
                    round: 2,
                    placements: vec![JobPlacement {
                        job_id: 2,
                        gpus: vec![gpu(2)],
                        share_with: None,
                    }],
                    memory: Some(PolicyMemory {
                        policy: "max_min_fairness_packed".into(),
                        format: 1,
                        bytes: (0..=255).collect(),
                    }),
                },
            ),
        ),
        (
            "record_worker_started",
            e(
                4_000,
                Command::RecordWorkerStarted {
                    job_id: 1,
                    epoch: 1,
                    rank: 0,
                    node: "n0".into(),
                },
            ),
        ),
        (
            "report_progress",
            e(
                5_000,
                Command::ReportProgress {
                    job_id: 1,
                    samples: vec![ProgressSample {
                        step: 100,
                        total_steps: 1_000,
                        loss: Some(1.25),
                        samples_per_s: 320.5,
                        at_ms: 4_900,
                    }],
                },
            ),
        ),
        (
            "finish_job",
            e(
                6_000,
                Command::FinishJob {
                    job_id: 1,
                    outcome: JobOutcome::Succeeded,
                    reason: "done".into(),
                },
            ),
        ),
        (
            "record_worker_exited",
            e(
                7_000,
                Command::RecordWorkerExited {
                    job_id: 1,
                    epoch: 1,
                    rank: 0,
                    exit_code: Some(0),
                    reason: "exited".into(),
                },
            ),
        ),
        ("remove_job", e(8_000, Command::RemoveJob { job_id: 1 })),
        (
            "cancel_job",
            e(
                9_000,
                Command::CancelJob {
                    job_id: 2,
                    reason: "golden".into(),
                },
            ),
        ),
        (
            "set_policy",
            e(
                10_000,
                Command::SetPolicy {
                    // The memory's own policy: it keeps the memory.
                    name: "max_min_fairness_packed".into(),
                },
            ),
        ),
        (
            "mark_node_lost",
            e(
                11_000,
                Command::MarkNodeLost {
                    name: "n0".into(),
                    reason: "silent".into(),
                },
            ),
        ),
        (
            "mark_node_recovered",
            e(12_000, Command::MarkNodeRecovered { name: "n0".into() }),
        ),
        (
            "remove_node",
            e(
                13_000,
                Command::RemoveNode {
                    name: "n0".into(),
                    force: true,
                },
            ),
        ),
    ]
}

#[test]
fn every_entry_kind_decodes_from_its_golden_bytes() {
    let examples = examples();
    let kinds: std::collections::BTreeSet<&str> = examples
        .iter()
        .map(|(_, e)| {
            every_kind(&e.command);
            e.command.kind()
        })
        .collect();
    assert_eq!(kinds.len(), KINDS, "an example of every kind: {kinds:?}");
    for (name, entry) in &examples {
        let bytes = golden(&format!("entry-{name}.bin"), &encode_entry(entry));
        assert_eq!(
            decode_entry(&bytes).as_ref(),
            Ok(entry),
            "entry-{name}.bin no longer decodes to its value"
        );
    }
    // All of them as one proposal (one Raft entry's payload).
    let proposal = Proposal {
        entries: examples.into_iter().map(|(_, e)| e).collect(),
    };
    let bytes = golden("proposal.bin", &encode_proposal(&proposal));
    assert_eq!(decode_proposal(&bytes), Ok(proposal));
}

#[test]
fn a_snapshot_decodes_from_its_golden_bytes_to_the_same_state() {
    let mut state = ClusterState::new();
    for (i, (name, entry)) in examples().into_iter().enumerate() {
        // Every example applies (the snapshot holds what they built).
        if let Err(e) = state.apply(i as u64 + 1, &entry) {
            panic!("{name} was refused: {e}");
        }
    }
    assert!(state.policy_memory().is_some());
    let bytes = golden(
        "snapshot-v7.bin",
        &encode_snapshot(&state).expect("encodes"),
    );
    let decoded = decode_snapshot(&bytes).expect("the golden snapshot decodes");
    assert_eq!(decoded, state);
    assert_eq!(decoded.state_hash().to_string(), SNAPSHOT_STATE_HASH);
}

#[test]
fn an_entry_one_format_newer_is_refused_naming_both_versions() {
    use prost::Message;
    let (_, entry) = examples()
        .into_iter()
        .find(|(name, _)| *name == "set_policy")
        .expect("an example");
    let bytes = golden("entry-set_policy.bin", &encode_entry(&entry));
    let mut msg = keel_proto::entry::LogEntry::decode(bytes.as_slice()).expect("protobuf");
    let newer = keel_proto::ENTRY_FORMAT_VERSION + 1;
    msg.format_version = newer;
    let err = decode_entry(&msg.encode_to_vec()).expect_err("a newer format is refused");
    let text = err.to_string();
    assert!(
        text.contains(&format!("version {newer}"))
            && text.contains(&format!("({})", keel_proto::ENTRY_FORMAT_VERSION))
            && text.contains("upgrade"),
        "{text}"
    );
}
