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
use keel_state::model::{FailedGpu, Gpu, GpuRef, ProgressSample};
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
        | Command::RecordNodeInventory { .. }
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
        | Command::SetPolicy { .. }
        | Command::BootstrapAcl { .. }
        | Command::CreateToken { .. }
        | Command::RevokeToken { .. }
        | Command::RecordMembershipChange { .. }
        | Command::CreateQueue { .. }
        | Command::UpdateQueue { .. }
        | Command::DeleteQueue { .. }
        | Command::PutSecret { .. }
        | Command::DeleteSecret { .. } => {}
    }
}
const KINDS: usize = 23;

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
                Command::register_node(
                    "n0",
                    "10.0.0.1:7070",
                    (0..4)
                        .map(|index| Gpu {
                            index,
                            gpu_type: if index < 2 { "v100" } else { "k80" }.into(),
                        })
                        .collect(),
                ),
            ),
        ),
        ("submit_job", e(2_000, Command::submit_job(spec.clone()))),
        (
            "submit_job-request-id",
            LogEntry {
                request_id: Some("cli-golden-1".into()),
                ..e(2_500, Command::submit_job(job_spec("second", 1, 1)))
            },
        ),
        (
            "decide_allocation",
            e(
                3_000,
                Command::decide_allocation(
                    3,
                    "fifo",
                    1,
                    vec![JobPlacement::alone(1, vec![gpu(0), gpu(1)])],
                ),
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
            e(4_000, Command::record_worker_started(1, 1, 0, "n0")),
        ),
        (
            "report_progress",
            e(
                5_000,
                Command::report_progress(
                    1,
                    vec![ProgressSample {
                        step: 100,
                        total_steps: 1_000,
                        loss: Some(1.25),
                        samples_per_s: 320.5,
                        at_ms: 4_900,
                    }],
                ),
            ),
        ),
        (
            "finish_job",
            e(6_000, Command::finish_job(1, JobOutcome::Succeeded, "done")),
        ),
        (
            "record_worker_exited",
            e(
                7_000,
                Command::record_worker_exited(1, 1, 0, Some(0), "exited"),
            ),
        ),
        ("remove_job", e(8_000, Command::remove_job(1))),
        ("cancel_job", e(9_000, Command::cancel_job(2, "golden"))),
        (
            "set_policy",
            e(10_000, Command::set_policy("max_min_fairness_packed")),
        ),
        (
            "mark_node_lost",
            e(11_000, Command::mark_node_lost("n0", "silent")),
        ),
        (
            "mark_node_recovered",
            e(12_000, Command::mark_node_recovered("n0")),
        ),
        ("remove_node", e(13_000, Command::remove_node("n0", true))),
    ]
}

/// Kinds added after the proposal, journal page and snapshot fixtures
/// were written (which hold [`examples`] only), each with the entry that
/// goes before it when applied (not a golden of its own).
fn later_examples() -> Vec<(&'static str, LogEntry, LogEntry)> {
    let v100 = |index| Gpu {
        index,
        gpu_type: "v100".into(),
    };
    vec![(
        // Issue 33: a node's inventory with a GPU failed, one gone missing
        // and one added.
        "record_node_inventory",
        LogEntry::new(
            20_000,
            Command::register_node("n1", "10.0.0.2:7070", (0..3).map(v100).collect()),
        ),
        LogEntry::new(
            21_000,
            Command::RecordNodeInventory {
                name: "n1".into(),
                address: "10.0.0.2:7070".into(),
                gpus: vec![v100(0), v100(3)],
                failed: vec![FailedGpu {
                    index: 1,
                    gpu_type: "v100".into(),
                    reason: "Xid 79: GPU has fallen off the bus.".into(),
                }],
                note: "offers 2 of 4 GPUs".into(),
            },
        ),
    )]
}

/// Issue 22: the access-control commands, in an order that applies; the
/// one made by a client records its actor.
fn acl_examples() -> Vec<(&'static str, LogEntry)> {
    use keel_state::acl::{Role, SecretHash};
    let mut create = LogEntry::new(
        41_000,
        Command::create_token(
            "alice",
            Role::User,
            SecretHash::of("alice-secret-0123456789abcdefghij"),
            Some(30 * 24 * 3600 * 1000),
        ),
    );
    create.actor = Some("token:root".into());
    create.request_id = Some("req-create-alice".into());
    vec![
        (
            "bootstrap_acl",
            LogEntry::new(
                40_000,
                Command::bootstrap_acl("root", SecretHash::of("root-secret-0123456789abcdefghijk")),
            ),
        ),
        ("create_token", create),
        (
            "revoke_token",
            LogEntry::new(42_000, Command::revoke_token("alice")),
        ),
        ("record_membership_change", {
            let mut e = LogEntry::new(
                43_000,
                Command::record_membership_change(4, "added as a voter", 42),
            );
            e.actor = Some("token:root".into());
            e
        }),
    ]
}

/// Issue 23: the queue commands, and a submission naming a queue (entry
/// format 6), in an order that applies after `examples()`'s first entry
/// (node n0, with v100 and k80 GPUs).
fn queue_examples() -> Vec<(&'static str, LogEntry)> {
    use keel_state::queue::QueueSpec;
    let mut team = QueueSpec::with_quota([("v100".to_string(), 2)].into());
    team.cohort = Some("research".into());
    team.borrow_limit = [("k80".to_string(), 1)].into();
    team.lend_limit = [("v100".to_string(), 1)].into();
    team.weight = 3;
    let mut create = LogEntry::new(50_000, Command::create_queue("team-a", team.clone()));
    create.actor = Some("token:root".into());
    let mut wider = team;
    wider.quota = Some([("v100".to_string(), 2), ("k80".to_string(), 2)].into());
    let mut spec = job_spec("queued", 1, 1);
    spec.queue = "team-a".into();
    vec![
        ("create_queue", create),
        (
            "update_queue",
            LogEntry::new(51_000, Command::update_queue("team-a", wider)),
        ),
        (
            "submit_job-queue",
            LogEntry::new(52_000, Command::submit_job(spec)),
        ),
        (
            "create_queue-second",
            LogEntry::new(
                53_000,
                Command::create_queue(
                    "team-b",
                    QueueSpec::with_quota([("k80".to_string(), 1)].into()),
                ),
            ),
        ),
        (
            "delete_queue",
            LogEntry::new(54_000, Command::delete_queue("team-b")),
        ),
    ]
}

/// Issue 35: a secret put, a job using it, a re-seal and a delete.
fn secret_examples() -> Vec<(&'static str, LogEntry)> {
    use keel_state::secret::{SealedValue, SecretRef};
    let sealed = |byte: u8| SealedValue {
        key_id: "a1b2c3d4e5f60718".into(),
        nonce: vec![byte; 24],
        ciphertext: vec![byte ^ 0x5a; 33],
    };
    let by_root = |at_ms: u64, command: Command| LogEntry {
        actor: Some("token:root".into()),
        ..LogEntry::new(at_ms, command)
    };
    let mut spec = job_spec("with-secret", 1, 1);
    spec.secret_env.insert(
        "WANDB_API_KEY".into(),
        SecretRef {
            name: "tracker".into(),
            key: "api_key".into(),
        },
    );
    vec![
        (
            "put_secret",
            by_root(
                60_000,
                Command::put_secret(
                    "tracker",
                    [("api_key".to_string(), sealed(1))].into(),
                    String::new(),
                ),
            ),
        ),
        (
            "submit_job-secret",
            by_root(61_000, Command::submit_job(spec)),
        ),
        (
            "put_secret-reseal",
            by_root(
                62_000,
                Command::PutSecret {
                    name: "tracker".into(),
                    values: [("api_key".to_string(), sealed(2))].into(),
                    queue: String::new(),
                    replaces_revision: Some(1),
                },
            ),
        ),
        (
            "put_secret-second",
            LogEntry::new(
                63_000,
                Command::put_secret(
                    "old",
                    [("a".to_string(), sealed(3)), ("b".to_string(), sealed(4))].into(),
                    String::new(),
                ),
            ),
        ),
        (
            "delete_secret",
            LogEntry::new(64_000, Command::delete_secret("old")),
        ),
    ]
}

/// Issue 35: a state with a sealed secret and a job referring to it
/// (snapshot field 17 and the spec's field 21, hashed apart) decodes from
/// its golden bytes to the same state and hash.
#[test]
fn a_snapshot_with_secrets_decodes_from_its_golden_bytes() {
    let mut state = ClusterState::new();
    let mut entries = vec![examples().remove(0)];
    entries.extend(secret_examples());
    for (index, (name, entry)) in entries.iter().enumerate() {
        state
            .apply(index as u64 + 1, entry)
            .unwrap_or_else(|e| panic!("{name} applies: {e}"));
    }
    let tracker = state.secrets().get("tracker").expect("kept");
    assert_eq!(tracker.revision, 2);
    assert_eq!(tracker.owner.as_deref(), Some("token:root"));
    assert!(state.secrets().get("old").is_none());
    for (name, entry) in &entries[1..] {
        assert_eq!(
            keel_state::codec::entry_to_proto(entry).format_version,
            keel_state::codec::ENTRY_FORMAT_VERSION,
            "{name} is the newest format"
        );
    }
    assert!(!state.postcard_carries_whole());
    let bytes = golden("snapshot-v8-secrets.bin", &encode_snapshot(&state));
    let decoded = decode_snapshot(&bytes).expect("the golden snapshot decodes");
    assert_eq!(decoded, state);
    assert_eq!(decoded.state_hash(), state.state_hash());
    assert_eq!(decoded.secrets(), state.secrets());
    let job = decoded.jobs().values().next().expect("the job");
    assert_eq!(
        job.spec.secret_env["WANDB_API_KEY"].to_string(),
        "tracker/api_key"
    );
}

/// Issue 23: a state with queues and a job naming one (snapshot field 16
/// and the spec's field 19, hashed apart) decodes from its golden bytes
/// to the same state and hash.
#[test]
fn a_snapshot_with_queues_decodes_from_its_golden_bytes() {
    let mut state = ClusterState::new();
    let mut entries = vec![examples().remove(0)];
    entries.extend(queue_examples());
    for (index, (name, entry)) in entries.iter().enumerate() {
        state
            .apply(index as u64 + 1, entry)
            .unwrap_or_else(|e| panic!("{name} applies: {e}"));
    }
    assert!(state.queues().exists("team-a") && !state.queues().exists("team-b"));
    // A submission naming a queue is the newest entry format; the rest
    // keep theirs.
    let format = |name: &str| {
        let (_, e) = entries.iter().find(|(n, _)| *n == name).expect("example");
        keel_state::codec::entry_to_proto(e).format_version
    };
    assert_eq!(
        format("submit_job-queue"),
        keel_proto::ENTRY_FORMAT_VERSION_QUEUE
    );
    assert_eq!(
        format("create_queue"),
        keel_proto::ENTRY_FORMAT_VERSION_ACTOR
    );
    assert_eq!(
        format("update_queue"),
        keel_proto::ENTRY_FORMAT_VERSION_FIRST
    );
    assert!(!state.postcard_carries_whole());
    let bytes = golden("snapshot-v8-queues.bin", &encode_snapshot(&state));
    let decoded = decode_snapshot(&bytes).expect("the golden snapshot decodes");
    assert_eq!(decoded, state);
    assert_eq!(decoded.state_hash(), state.state_hash());
    assert_eq!(decoded.queues(), state.queues());
    let job = decoded.jobs().values().next().expect("the queued job");
    assert_eq!(job.spec.queue, "team-a");
}

/// Issue 22: a snapshot of a cluster with tokens (snapshot field 15,
/// hashed apart) decodes to the same state and hash.
#[test]
fn a_snapshot_with_tokens_decodes_from_its_golden_bytes() {
    let mut state = ClusterState::new();
    let before = state.state_hash();
    let mut entries = acl_examples();
    entries.truncate(2); // the bootstrap and alice's token
    for (index, (_, entry)) in entries.iter().enumerate() {
        state.apply(index as u64 + 1, entry).expect("applies");
    }
    assert_eq!(state.acl().tokens().len(), 2);
    assert_ne!(state.state_hash(), before, "the tokens are hashed");
    let bytes = golden("snapshot-v8-acl.bin", &encode_snapshot(&state));
    let decoded = decode_snapshot(&bytes).expect("the golden snapshot decodes");
    assert_eq!(decoded, state);
    assert_eq!(decoded.state_hash(), state.state_hash());
    let (name, token) = decoded
        .acl()
        .token_for_secret("alice-secret-0123456789abcdefghij")
        .expect("alice's secret is known after decoding");
    assert_eq!(
        (name, token.created_by.as_deref()),
        ("alice", Some("token:root"))
    );
}

/// Issue 23, item 4: a submission that may not be preempted (the spec's
/// field 20, format version 7, hashed apart) decodes from its golden bytes.
#[test]
fn a_submission_that_may_not_be_preempted_decodes_from_its_golden_bytes() {
    let mut spec = job_spec("fixed", 1, 1);
    spec.queue = "team-a".into();
    spec.preemptible = false;
    let entry = LogEntry::new(55_000, Command::submit_job(spec));
    assert_eq!(
        keel_state::codec::entry_to_proto(&entry).format_version,
        keel_proto::ENTRY_FORMAT_VERSION_NOT_PREEMPTIBLE
    );
    let bytes = golden(
        "entry-submit_job-not_preemptible.bin",
        &encode_entry(&entry),
    );
    assert_eq!(decode_entry(&bytes).as_ref(), Ok(&entry));
    // A state holding such a job hashes apart from one where it may be.
    let state_with = |preemptible: bool| {
        let mut spec = job_spec("fixed", 1, 1);
        spec.preemptible = preemptible;
        let mut state = ClusterState::new();
        state
            .apply(1, &LogEntry::new(55_000, Command::submit_job(spec)))
            .expect("applies");
        state
    };
    assert_ne!(
        state_with(false).state_hash(),
        state_with(true).state_hash()
    );
    // The postcard snapshot (format 7, the release before) has no place for
    // the flag: such a state is never written in it.
    assert!(!state_with(false).postcard_carries_whole());
    assert!(state_with(true).postcard_carries_whole());
}

/// Issue 23, item 1: a token limited to queues (`CreateToken.queues`,
/// format version 8; snapshot `AclToken.queues`, hashed apart) decodes
/// from its golden bytes, entry and snapshot.
#[test]
fn a_token_limited_to_queues_decodes_from_its_golden_bytes() {
    use keel_state::acl::{Role, SecretHash};
    let mut state = ClusterState::new();
    let mut entries: Vec<LogEntry> = acl_examples().into_iter().take(2).map(|(_, e)| e).collect();
    entries.push(LogEntry::new(
        50_000,
        Command::create_queue(
            "team-a",
            keel_state::queue::QueueSpec::with_quota(Default::default()),
        ),
    ));
    let mut create = LogEntry::new(
        51_000,
        Command::CreateToken {
            name: "carol".into(),
            role: Role::User,
            secret_hash: SecretHash::of("carol-secret-0123456789abcdefghij"),
            ttl_ms: None,
            queues: vec!["team-a".into(), "default".into()],
        },
    );
    create.actor = Some("token:root".into());
    assert_eq!(
        keel_state::codec::entry_to_proto(&create).format_version,
        keel_proto::ENTRY_FORMAT_VERSION_TOKEN_QUEUES
    );
    let bytes = golden("entry-create_token-queues.bin", &encode_entry(&create));
    assert_eq!(decode_entry(&bytes).as_ref(), Ok(&create));
    entries.push(create);
    for (index, entry) in entries.iter().enumerate() {
        state.apply(index as u64 + 1, entry).expect("applies");
    }
    let (_, carol) = state
        .acl()
        .token_for_secret("carol-secret-0123456789abcdefghij")
        .expect("carol's token");
    assert!(carol.may_submit_to("team-a") && carol.may_submit_to(""));
    assert!(!carol.may_submit_to("team-b"));
    let bytes = golden("snapshot-v8-token-queues.bin", &encode_snapshot(&state));
    let decoded = decode_snapshot(&bytes).expect("the golden snapshot decodes");
    assert_eq!(decoded, state);
    assert_eq!(decoded.state_hash(), state.state_hash());
    let (_, decoded_carol) = decoded
        .acl()
        .token_for_secret("carol-secret-0123456789abcdefghij")
        .expect("carol's token after decoding");
    assert_eq!(decoded_carol.queues, carol.queues);
    // The same token unlimited hashes apart from the limited one.
    let mut unlimited = ClusterState::new();
    for (index, entry) in entries.iter().enumerate() {
        let mut entry = entry.clone();
        if let Command::CreateToken { queues, .. } = &mut entry.command {
            queues.clear();
        }
        unlimited.apply(index as u64 + 1, &entry).expect("applies");
    }
    assert_ne!(unlimited.state_hash(), state.state_hash());
}

#[test]
fn every_entry_kind_decodes_from_its_golden_bytes() {
    let mut examples = examples();
    let first = examples.len();
    examples.extend(later_examples().into_iter().map(|(name, _, e)| (name, e)));
    let later = examples.len();
    examples.extend(acl_examples());
    let queues = examples.len();
    examples.extend(queue_examples());
    examples.extend(secret_examples());
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
    // The ACL commands apply in order.
    let mut state = ClusterState::new();
    for (index, (name, entry)) in examples[later..queues].iter().enumerate() {
        state
            .apply(index as u64 + 1, entry)
            .unwrap_or_else(|e| panic!("{name} applies: {e}"));
    }
    // The first ones as one proposal (one Raft entry's payload).
    examples.truncate(first);
    let proposal = Proposal::new(examples.into_iter().map(|(_, e)| e).collect());
    let bytes = golden("proposal.bin", &encode_proposal(&proposal));
    assert_eq!(decode_proposal(&bytes), Ok(proposal));
}

#[test]
fn a_journal_page_and_applied_records_decode_from_their_golden_bytes() {
    use keel_state::codec::applied_entry_to_proto;
    use keel_storage::journal_codec::{decode_page_entries, encode_page};
    use prost::Message;

    // Every example on one page, at the indexes they apply at (two share
    // an index: a proposal of two commands).
    let page: Vec<(u64, LogEntry)> = examples()
        .into_iter()
        .enumerate()
        .map(|(i, (_, e))| (10 + (i as u64).max(1), e))
        .collect();
    let bytes = golden("journal-page.bin", &encode_page(&page));
    assert_eq!(decode_page_entries(11, &bytes).expect("decodes"), page);
    // What applying them did, as the journal keeps it per command (events,
    // or the refusal's words).
    let mut state = ClusterState::new();
    for (i, (name, entry)) in examples().into_iter().enumerate() {
        let outcome = state.apply(i as u64 + 1, &entry);
        let record = applied_entry_to_proto(i as u64 + 1, 0, &entry, &outcome);
        let bytes = golden(&format!("applied-{name}.bin"), &record.encode_to_vec());
        assert_eq!(
            keel_proto::entry::AppliedEntry::decode(bytes.as_slice()).as_ref(),
            Ok(&record),
            "applied-{name}.bin decodes to another record"
        );
    }
    for (name, before, entry) in later_examples() {
        let mut state = ClusterState::new();
        state.apply(1, &before).expect("applies");
        let outcome = state.apply(2, &entry);
        let record = applied_entry_to_proto(2, 0, &entry, &outcome);
        let bytes = golden(&format!("applied-{name}.bin"), &record.encode_to_vec());
        assert_eq!(
            keel_proto::entry::AppliedEntry::decode(bytes.as_slice()).as_ref(),
            Ok(&record),
            "applied-{name}.bin decodes to another record"
        );
    }
    let refused = state.apply(99, &LogEntry::new(99_000, Command::remove_job(404)));
    assert!(refused.is_err());
    let record = applied_entry_to_proto(
        99,
        1,
        &LogEntry::new(99_000, Command::remove_job(404)),
        &refused,
    );
    let bytes = golden("applied-refused.bin", &record.encode_to_vec());
    assert_eq!(
        keel_proto::entry::AppliedEntry::decode(bytes.as_slice()),
        Ok(record)
    );
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
    let bytes = golden("snapshot-v8.bin", &encode_snapshot(&state));
    let decoded = decode_snapshot(&bytes).expect("the golden snapshot decodes");
    assert_eq!(decoded, state);
    assert_eq!(decoded.state_hash().to_string(), SNAPSHOT_STATE_HASH);
    // The postcard snapshot of the format before (7), written by the
    // release before, still decodes to the same state.
    let bytes = std::fs::read(dir().join("snapshot-v7.bin")).expect("read golden");
    let decoded = decode_snapshot(&bytes).expect("the format-7 snapshot decodes");
    assert_eq!(decoded, state);
    assert_eq!(decoded.state_hash().to_string(), SNAPSHOT_STATE_HASH);
}

/// Issue 33: a snapshot of a node with gone GPUs (snapshot field 7 of a
/// node record) decodes to the same state and hash.
#[test]
fn a_snapshot_with_gone_gpus_decodes_from_its_golden_bytes() {
    let mut state = ClusterState::new();
    for (_, before, entry) in later_examples() {
        state.apply(1, &before).expect("applies");
        state.apply(2, &entry).expect("applies");
    }
    assert_eq!(state.nodes()["n1"].gone_gpus.len(), 2);
    let bytes = golden("snapshot-v8-gone-gpus.bin", &encode_snapshot(&state));
    let decoded = decode_snapshot(&bytes).expect("the golden snapshot decodes");
    assert_eq!(decoded, state);
    assert_eq!(decoded.state_hash(), state.state_hash());
}

/// Issue 22: an entry that records who asked (entry format 5), and a
/// snapshot of the job it submitted, which keeps its submitter (snapshot
/// field 18 of a job record, hashed apart).
#[test]
fn an_entry_with_an_actor_and_a_snapshot_with_a_submitter_decode_from_their_golden_bytes() {
    let mut entry = LogEntry::new(30_000, Command::submit_job(job_spec("audited", 1, 1)));
    entry.actor = Some("cert:alice".into());
    entry.request_id = Some("req-audited".into());
    let bytes = golden("entry-submit_job-with-actor.bin", &encode_entry(&entry));
    assert_eq!(decode_entry(&bytes).as_ref(), Ok(&entry));
    assert_eq!(
        keel_state::codec::entry_to_proto(&entry).format_version,
        keel_proto::ENTRY_FORMAT_VERSION_ACTOR
    );
    assert!(!Proposal::new(vec![entry.clone()]).postcard_carries_whole());
    let mut state = ClusterState::new();
    state.apply(1, &entry).expect("applies");
    assert_eq!(state.jobs()[&1].submitted_by.as_deref(), Some("cert:alice"));
    let bytes = golden("snapshot-v8-submitter.bin", &encode_snapshot(&state));
    let decoded = decode_snapshot(&bytes).expect("the golden snapshot decodes");
    assert_eq!(decoded, state);
    assert_eq!(decoded.state_hash(), state.state_hash());
    // The submitter is part of the hash: the same job without one differs.
    let mut anonymous = ClusterState::new();
    entry.actor = None;
    anonymous.apply(1, &entry).expect("applies");
    assert_ne!(anonymous.state_hash(), state.state_hash());
}

/// Issue 24, item 2: a submission that carries its trace's context
/// (format 9) and a snapshot whose job keeps it decode from their golden
/// bytes; the release before refuses the entry (it would keep no trace),
/// its Raft wire's postcard does not carry it, and the trace is part of
/// the state's hash.
#[test]
fn an_entry_with_a_trace_and_a_snapshot_that_keeps_it_decode_from_their_golden_bytes() {
    let mut entry = LogEntry::new(60_000, Command::submit_job(job_spec("traced", 1, 1)));
    entry.trace_parent = Some("00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01".into());
    let bytes = golden("entry-submit_job-with-trace.bin", &encode_entry(&entry));
    assert_eq!(decode_entry(&bytes).as_ref(), Ok(&entry));
    assert_eq!(
        keel_state::codec::entry_to_proto(&entry).format_version,
        keel_proto::ENTRY_FORMAT_VERSION_TRACE
    );
    assert!(!Proposal::new(vec![entry.clone()]).postcard_carries_whole());
    let mut state = ClusterState::new();
    state.apply(1, &entry).expect("applies");
    assert_eq!(state.jobs()[&1].trace_parent, entry.trace_parent);
    assert!(!state.postcard_carries_whole());
    let bytes = golden("snapshot-v8-trace.bin", &encode_snapshot(&state));
    let decoded = decode_snapshot(&bytes).expect("the golden snapshot decodes");
    assert_eq!(decoded, state);
    assert_eq!(decoded.state_hash(), state.state_hash());
    let mut untraced = ClusterState::new();
    entry.trace_parent = None;
    untraced.apply(1, &entry).expect("applies");
    assert_ne!(untraced.state_hash(), state.state_hash());
    // A context longer than any W3C version's is refused, naming it.
    let mut msg = keel_state::codec::entry_to_proto(&entry);
    msg.trace_parent = "0".repeat(keel_state::command::TRACE_PARENT_MAX_LEN + 1);
    let err = decode_entry(&prost::Message::encode_to_vec(&msg)).expect_err("refused");
    assert!(err.to_string().contains("trace_parent"), "{err}");
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
    let newer = keel_state::codec::ENTRY_FORMAT_VERSION + 1;
    msg.format_version = newer;
    let err = decode_entry(&msg.encode_to_vec()).expect_err("a newer format is refused");
    let text = err.to_string();
    assert!(
        text.contains(&format!("version {newer}"))
            && text.contains(&format!("({})", keel_state::codec::ENTRY_FORMAT_VERSION))
            && text.contains("upgrade"),
        "{text}"
    );
}

/// Raft's messages (`keel_storage::raft_wire`): one example of every
/// request and every kind of reply, in both formats a replica reads. A
/// golden file must decode to the value it was written from (compared by
/// re-encoding in today's format, since openraft's request types have no
/// equality).
mod raft_messages {
    use std::collections::{BTreeMap, BTreeSet};

    use keel_state::command::{Command, LogEntry, Proposal};
    use keel_storage::raft_wire::{
        WireError, WireMessage, RAFT_WIRE_FORMAT, RAFT_WIRE_FORMAT_PREVIOUS,
    };
    use keel_storage::{Entry, LogId, TypeConfig};
    use openraft::error::{Fatal, Infallible, InstallSnapshotError, RaftError, SnapshotMismatch};
    use openraft::raft::{
        AppendEntriesRequest, AppendEntriesResponse, InstallSnapshotRequest,
        InstallSnapshotResponse, VoteRequest, VoteResponse,
    };
    use openraft::{
        BasicNode, CommittedLeaderId, EntryPayload, Membership, SnapshotMeta, SnapshotSegmentId,
        StoredMembership, Vote,
    };

    use super::golden;

    fn log_id(term: u64, leader: u64, index: u64) -> LogId {
        LogId::new(CommittedLeaderId::new(term, leader), index)
    }

    fn membership() -> Membership<u64, BasicNode> {
        let voters: BTreeSet<u64> = [1, 2, 3].into();
        let nodes: BTreeMap<u64, BasicNode> = (1..=4)
            .map(|id| (id, BasicNode::new(format!("10.0.0.{id}:7070"))))
            .collect();
        Membership::new(vec![voters.clone(), [1, 2, 4].into()], nodes)
    }

    fn append_request() -> AppendEntriesRequest<TypeConfig> {
        let proposal = Proposal::new(vec![LogEntry::new(42_000, Command::set_policy("fifo"))]);
        AppendEntriesRequest {
            vote: Vote::new_committed(7, 2),
            prev_log_id: Some(log_id(6, 1, 40)),
            entries: vec![
                Entry {
                    log_id: log_id(7, 2, 41),
                    payload: EntryPayload::Blank,
                },
                Entry {
                    log_id: log_id(7, 2, 42),
                    payload: EntryPayload::Normal(proposal),
                },
                Entry {
                    log_id: log_id(7, 2, 43),
                    payload: EntryPayload::Membership(membership()),
                },
            ],
            leader_commit: Some(log_id(6, 1, 39)),
        }
    }

    fn snapshot_request() -> InstallSnapshotRequest<TypeConfig> {
        InstallSnapshotRequest {
            vote: Vote::new_committed(7, 2),
            meta: SnapshotMeta {
                last_log_id: Some(log_id(7, 2, 10_000)),
                last_membership: StoredMembership::new(Some(log_id(5, 1, 3)), membership()),
                snapshot_id: "7-2-10000-1".into(),
            },
            offset: 1_048_576,
            data: (0..=255).collect(),
            done: true,
        }
    }

    fn mismatch() -> InstallSnapshotError {
        InstallSnapshotError::SnapshotMismatch(SnapshotMismatch {
            expect: SnapshotSegmentId {
                id: "7-2-10000-1".into(),
                offset: 0,
            },
            got: SnapshotSegmentId {
                id: "7-2-10000-1".into(),
                offset: 1_048_576,
            },
        })
    }

    type AppendReply = Result<AppendEntriesResponse<u64>, RaftError<u64>>;
    type VoteReply = Result<VoteResponse<u64>, RaftError<u64>>;
    type SnapshotReply = Result<InstallSnapshotResponse<u64>, RaftError<u64, InstallSnapshotError>>;

    /// `value`'s golden file in `format` decodes, and encodes again as
    /// `value` does.
    fn check<T: WireMessage>(name: &str, format: u32, value: &T) {
        let fresh = value.encode(format).expect("encodes");
        let bytes = golden(&format!("raft-v{format}-{name}.bin"), &fresh);
        let decoded = T::decode(&bytes, format)
            .unwrap_or_else(|e| panic!("raft-v{format}-{name}.bin no longer decodes: {e}"));
        assert_eq!(
            decoded.encode(RAFT_WIRE_FORMAT).expect("encodes"),
            value.encode(RAFT_WIRE_FORMAT).expect("encodes"),
            "raft-v{format}-{name}.bin decodes to another value"
        );
    }

    #[test]
    fn every_raft_message_decodes_from_its_golden_bytes_in_both_formats() {
        let fatal = |f: Fatal<u64>| -> RaftError<u64, Infallible> { RaftError::Fatal(f) };
        for format in [RAFT_WIRE_FORMAT_PREVIOUS, RAFT_WIRE_FORMAT] {
            check("append_entries", format, &append_request());
            for (name, reply) in [
                ("success", Ok(AppendEntriesResponse::Success)),
                (
                    "partial_success",
                    Ok(AppendEntriesResponse::PartialSuccess(Some(log_id(
                        7, 2, 42,
                    )))),
                ),
                ("conflict", Ok(AppendEntriesResponse::Conflict)),
                (
                    "higher_vote",
                    Ok(AppendEntriesResponse::HigherVote(Vote::new(8, 3))),
                ),
                ("stopped", Err(fatal(Fatal::Stopped))),
                ("panicked", Err(fatal(Fatal::Panicked))),
            ] {
                let reply: AppendReply = reply;
                check(&format!("append_entries-reply-{name}"), format, &reply);
            }
            check(
                "vote",
                format,
                &VoteRequest::new(Vote::new(8, 3), Some(log_id(7, 2, 43))),
            );
            let granted: VoteReply = Ok(VoteResponse::new(
                Vote::new(8, 3),
                Some(log_id(7, 2, 43)),
                true,
            ));
            check("vote-reply", format, &granted);
            check("install_snapshot", format, &snapshot_request());
            let installed: SnapshotReply = Ok(InstallSnapshotResponse {
                vote: Vote::new_committed(7, 2),
            });
            check("install_snapshot-reply", format, &installed);
            let refused: SnapshotReply = Err(RaftError::APIError(mismatch()));
            check("install_snapshot-reply-mismatch", format, &refused);
        }
    }

    #[test]
    fn a_raft_message_one_format_newer_is_refused_naming_both_versions() {
        let newer = RAFT_WIRE_FORMAT + 1;
        let err = VoteRequest::<u64>::decode(&[], newer).expect_err("refused");
        assert!(matches!(err, WireError::Format { found, .. } if found == newer));
        let text = err.to_string();
        assert!(
            text.contains(&format!("format {newer}"))
                && text.contains(&format!(
                    "formats {RAFT_WIRE_FORMAT_PREVIOUS} to {RAFT_WIRE_FORMAT}"
                ))
                && text.contains("upgrade"),
            "{text}"
        );
    }
}

/// A WAL record's payload of every kind, and the state store's values for
/// Raft's records, in today's format; and the JSON the releases before
/// wrote for membership, still read.
mod records {
    use std::collections::{BTreeMap, BTreeSet};

    use keel_state::command::{Command, LogEntry, Proposal};
    use keel_storage::meta_codec::{
        decode_last_applied, decode_membership, decode_snapshot_meta, encode_last_applied,
        encode_membership, encode_snapshot_meta,
    };
    use keel_storage::wal_codec::{decode_payload, encode_payload};
    use keel_storage::LogId;
    use openraft::{
        BasicNode, CommittedLeaderId, EntryPayload, Membership, SnapshotMeta, StoredMembership,
    };

    use super::golden;

    fn membership() -> Membership<u64, BasicNode> {
        let voters: BTreeSet<u64> = [1, 2, 3].into();
        let nodes: BTreeMap<u64, BasicNode> = (1..=4)
            .map(|id| (id, BasicNode::new(format!("10.0.0.{id}:7070"))))
            .collect();
        Membership::new(vec![voters], nodes)
    }

    fn log_id(index: u64) -> LogId {
        LogId::new(CommittedLeaderId::new(3, 2), index)
    }

    #[test]
    fn every_wal_record_kind_decodes_from_its_golden_bytes() {
        let proposal = Proposal::new(vec![LogEntry::new(1_000, Command::set_policy("fifo"))]);
        for (name, payload) in [
            ("blank", EntryPayload::Blank),
            ("proposal", EntryPayload::Normal(proposal)),
            ("membership", EntryPayload::Membership(membership())),
        ] {
            let bytes = golden(&format!("wal-{name}.bin"), &encode_payload(&payload));
            let decoded = decode_payload(7, &bytes)
                .unwrap_or_else(|e| panic!("wal-{name}.bin no longer decodes: {e}"));
            assert_eq!(
                encode_payload(&decoded),
                encode_payload(&payload),
                "wal-{name}.bin decodes to another value"
            );
        }
        // The JSON membership record of the releases before protobuf (tag
        // 2), as the data-directory fixture holds it.
        let mut json = vec![2u8];
        json.extend(serde_json::to_vec(&membership()).expect("json"));
        let bytes = golden("wal-membership-json.bin", &json);
        let decoded = decode_payload(7, &bytes).expect("JSON membership still read");
        assert_eq!(
            encode_payload(&decoded),
            encode_payload(&EntryPayload::Membership(membership()))
        );
        // A tag from the future is refused, naming it.
        let err = decode_payload(7, &[9]).expect_err("refused").to_string();
        assert!(err.contains("tag Some(9)") && err.contains("7"), "{err}");
    }

    #[test]
    fn the_state_stores_raft_records_decode_from_their_golden_bytes() {
        let stored = StoredMembership::new(Some(log_id(5)), membership());
        let bytes = golden("meta-membership.bin", &encode_membership(&stored));
        assert_eq!(decode_membership(&bytes), Ok(stored.clone()));
        let bytes = golden("meta-applied.bin", &encode_last_applied(&Some(log_id(9))));
        assert_eq!(decode_last_applied(&bytes), Ok(Some(log_id(9))));
        let bytes = golden("meta-applied-none.bin", &encode_last_applied(&None));
        assert_eq!(decode_last_applied(&bytes), Ok(None));
        let meta = SnapshotMeta {
            last_log_id: Some(log_id(9)),
            last_membership: stored.clone(),
            snapshot_id: "3-2-9-1".into(),
        };
        let bytes = golden("meta-snapshot.bin", &encode_snapshot_meta(&meta));
        assert_eq!(decode_snapshot_meta(&bytes), Ok(meta.clone()));
        // JSON, as the releases before wrote them, is still read.
        let json = serde_json::to_vec(&meta).expect("json");
        assert_eq!(decode_snapshot_meta(&json), Ok(meta));
        assert_eq!(decode_last_applied(b"null"), Ok(None));
        assert_eq!(
            decode_membership(&serde_json::to_vec(&stored).expect("json")),
            Ok(stored)
        );
        // A newer format is refused, naming it.
        let err = decode_last_applied(&[3, 0]).expect_err("refused");
        assert!(err.contains("format 3") && err.contains("upgrade"), "{err}");
    }
}
