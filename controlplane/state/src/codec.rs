//! The byte encoding of log entries and proposals, and the protobuf forms
//! that are not derived ([`crate::proto_form`]: the commands, events and
//! job record derive theirs): the job spec's (its fields flattened), a
//! queue's, a token's secret hash.
//!
//! An entry is written in the oldest format version that expresses it
//! ([`entry_format_version`]: the newest `#[proto(since = N)]` among the
//! fields it carries), so a build one version older refuses exactly the
//! entries it would misread and reads every other.
//!
//! Decoding is strict: an entry with a newer `format_version`, or whose
//! command this build does not know (an unset oneof, which is what prost
//! leaves for an unknown field), is a [`DecodeError`], never skipped.

use keel_proto::entry as pb;
use keel_proto::{
    ENTRY_FORMAT_VERSION_ACTOR, ENTRY_FORMAT_VERSION_FIRST, ENTRY_FORMAT_VERSION_NOT_PREEMPTIBLE,
    ENTRY_FORMAT_VERSION_QUEUE, ENTRY_FORMAT_VERSION_REQUEST_ID, ENTRY_FORMAT_VERSION_SECRETS,
    ENTRY_FORMAT_VERSION_TRACE,
};
use prost::Message as _;

use crate::acl::SecretHash;
use crate::command::{Command, LogEntry, Proposal};
use crate::event::Event;
use crate::proto_form::{Message, ProtoForm, Versions};
use crate::queue::QueueSpec;
use crate::secret::SecretRef;
use crate::spec::{GpuTypes, JobSpec, Workers};

/// The newest log-entry format version this build reads and writes: the
/// newest `#[proto(since = N)]` of its commands and what they hold
/// ([`crate::proto_form`]), and of the entry's own fields (the request id,
/// the actor, the trace). The versions up to 10 are listed in
/// `keel_proto` (`ENTRY_FORMAT_VERSION_FIRST` and after).
pub const ENTRY_FORMAT_VERSION: u32 =
    crate::proto_form::max(<Command as Versions>::NEWEST, ENTRY_FORMAT_VERSION_TRACE);

/// Largest encoded log entry accepted, in bytes.
pub const ENTRY_MAX_BYTES: usize = 4 * 1024 * 1024;

#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum DecodeError {
    #[error("entry is not valid protobuf: {0}")]
    Protobuf(String),
    #[error("entry is {len} bytes; the limit is {limit}")]
    TooLarge { len: usize, limit: usize },
    #[error(
        "entry format version {found} is newer than this build reads ({supported}); upgrade keel"
    )]
    UnsupportedFormatVersion { found: u32, supported: u32 },
    #[error("entry (format version {format_version}) holds a command this build does not know; upgrade keel")]
    UnknownCommand { format_version: u32 },
    #[error("entry field {0} is missing")]
    MissingField(&'static str),
    #[error("entry field {field} has an unknown value {value}")]
    UnknownValue { field: &'static str, value: i32 },
    #[error("field {field} has an unknown value {value:?}")]
    UnknownName { field: &'static str, value: String },
    #[error("{0}")]
    Inconsistent(String),
}

/// Encodes an entry in the current format version.
pub fn encode_entry(entry: &LogEntry) -> Vec<u8> {
    entry_to_proto(entry).encode_to_vec()
}

/// Decodes an entry, refusing unknown versions and commands.
pub fn decode_entry(bytes: &[u8]) -> Result<LogEntry, DecodeError> {
    if bytes.len() > ENTRY_MAX_BYTES {
        return Err(DecodeError::TooLarge {
            len: bytes.len(),
            limit: ENTRY_MAX_BYTES,
        });
    }
    let msg = pb::LogEntry::decode(bytes).map_err(|e| DecodeError::Protobuf(e.to_string()))?;
    entry_from_proto(msg)
}

/// Encodes a proposal (the payload of one Raft entry).
pub fn encode_proposal(proposal: &Proposal) -> Vec<u8> {
    proposal_bytes(proposal).to_vec()
}

/// A proposal's encoding, made on first use and kept with it (shared by
/// its clones), or the bytes it was decoded from.
pub fn proposal_bytes(proposal: &Proposal) -> &[u8] {
    proposal.encoded.0.get_or_init(|| {
        pb::Proposal {
            entries: proposal.entries.iter().map(entry_to_proto).collect(),
        }
        .encode_to_vec()
    })
}

/// Decodes a proposal, refusing any entry of an unknown version or command.
pub fn decode_proposal(bytes: &[u8]) -> Result<Proposal, DecodeError> {
    decode_proposal_owned(bytes.to_vec())
}

/// [`decode_proposal`] from bytes it keeps as the proposal's encoding.
pub fn decode_proposal_owned(bytes: Vec<u8>) -> Result<Proposal, DecodeError> {
    let msg =
        pb::Proposal::decode(bytes.as_slice()).map_err(|e| DecodeError::Protobuf(e.to_string()))?;
    let proposal = Proposal {
        entries: msg
            .entries
            .into_iter()
            .map(entry_from_proto)
            .collect::<Result<_, _>>()?,
        encoded: crate::command::EncodedOnce::default(),
    };
    // The bytes read are its encoding: a proposal sent on or written again
    // is these bytes, not a new encoding of what they decoded to.
    let _ = proposal.encoded.0.set(bytes);
    Ok(proposal)
}

pub fn entry_to_proto(entry: &LogEntry) -> pb::LogEntry {
    let command = entry.command.to_proto();
    let mut proto = pb::LogEntry {
        format_version: ENTRY_FORMAT_VERSION_FIRST,
        at_ms: entry.at_ms,
        command: Some(command),
        request_id: entry.request_id.clone().unwrap_or_default(),
        actor: entry.actor.clone().unwrap_or_default(),
        trace_parent: entry.trace_parent.clone().unwrap_or_default(),
    };
    proto.format_version = entry_format_version(&proto);
    proto
}

/// The oldest entry format version that expresses `entry`, so a build one
/// version older refuses exactly the entries it would misread: the newest
/// `since` among the fields it carries (`#[proto(since = N)]` on the
/// commands and what they hold), and the entry's own fields'.
pub fn entry_format_version(entry: &pb::LogEntry) -> u32 {
    let command = entry.command.as_ref().map_or(
        ENTRY_FORMAT_VERSION_FIRST,
        <Command as ProtoForm<_>>::version_of,
    );
    let own = [
        (
            !entry.request_id.is_empty(),
            ENTRY_FORMAT_VERSION_REQUEST_ID,
        ),
        (!entry.actor.is_empty(), ENTRY_FORMAT_VERSION_ACTOR),
        (!entry.trace_parent.is_empty(), ENTRY_FORMAT_VERSION_TRACE),
    ];
    own.iter()
        .filter(|(carried, _)| *carried)
        .map(|(_, version)| *version)
        .fold(command, crate::proto_form::max)
}

pub fn entry_from_proto(msg: pb::LogEntry) -> Result<LogEntry, DecodeError> {
    if msg.format_version > ENTRY_FORMAT_VERSION || msg.format_version == 0 {
        return Err(DecodeError::UnsupportedFormatVersion {
            found: msg.format_version,
            supported: ENTRY_FORMAT_VERSION,
        });
    }
    let Some(command) = msg.command else {
        return Err(DecodeError::UnknownCommand {
            format_version: msg.format_version,
        });
    };
    let command = Command::from_proto(command, "log_entry.command")?;
    if msg.actor.len() > crate::command::ACTOR_MAX_LEN {
        return Err(DecodeError::Inconsistent(format!(
            "the entry's actor is {} bytes, more than {}",
            msg.actor.len(),
            crate::command::ACTOR_MAX_LEN
        )));
    }
    if msg.trace_parent.len() > crate::command::TRACE_PARENT_MAX_LEN {
        return Err(DecodeError::Inconsistent(format!(
            "the entry's trace_parent is {} bytes, more than {}",
            msg.trace_parent.len(),
            crate::command::TRACE_PARENT_MAX_LEN
        )));
    }
    Ok(LogEntry {
        at_ms: msg.at_ms,
        command,
        request_id: Some(msg.request_id).filter(|id| !id.is_empty()),
        actor: Some(msg.actor).filter(|a| !a.is_empty()),
        trace_parent: Some(msg.trace_parent).filter(|t| !t.is_empty()),
    })
}

pub fn spec_to_proto(s: &JobSpec) -> pb::JobSpec {
    pb::JobSpec {
        name: s.name.clone(),
        user: s.user.clone(),
        command: s.command.clone(),
        image: s.image.clone().unwrap_or_default(),
        env: s.env.clone(),
        gpus_per_worker: s.gpus,
        min_workers: s.workers.min,
        max_workers: s.workers.max,
        gpu_types_allowed: s.gpu_types.allowed.clone(),
        gpu_types_preferred: s.gpu_types.preferred.clone(),
        model: s.model.clone().unwrap_or_default(),
        total_steps: s.total_steps,
        epochs: s.epochs,
        priority: s.priority,
        max_retries: s.max_retries,
        retry_backoff_s: Some(s.retry_backoff_s),
        // Absent when unset, so specs without limits encode (and digest)
        // as they did before the field existed.
        resources: (!s.resources.is_unset()).then_some(pb::Resources {
            cpu_millis: s.resources.cpu_millis,
            memory_bytes: s.resources.memory_bytes,
        }),
        logs: (!s.logs.is_unset()).then_some(pb::LogLimits {
            max_file_bytes: s.logs.max_file_bytes,
            max_files: s.logs.max_files,
        }),
        queue: s.queue.clone(),
        not_preemptible: !s.preemptible,
        secret_env: s
            .secret_env
            .iter()
            .map(|(k, r)| (k.clone(), r.to_string()))
            .collect(),
    }
}

impl ProtoForm<pb::QueueSpec> for QueueSpec {
    fn to_proto(&self) -> pb::QueueSpec {
        pb::QueueSpec {
            quota: self
                .quota
                .as_ref()
                .map(|gpus| pb::GpuCounts { gpus: gpus.clone() }),
            cohort: self.cohort.clone(),
            borrow_limit: self.borrow_limit.clone(),
            lend_limit: self.lend_limit.clone(),
            weight: self.weight,
        }
    }

    /// Validation happens in [`QueueSpec::validate`], not here.
    fn from_proto(q: pb::QueueSpec, _field: &'static str) -> Result<Self, DecodeError> {
        Ok(QueueSpec {
            quota: q.quota.map(|c| c.gpus),
            cohort: q.cohort,
            borrow_limit: q.borrow_limit,
            lend_limit: q.lend_limit,
            weight: q.weight,
        })
    }
}

impl Message for QueueSpec {}

impl Versions for QueueSpec {
    const NEWEST: u32 = ENTRY_FORMAT_VERSION_FIRST;
}

impl ProtoForm<pb::JobSpec> for JobSpec {
    fn to_proto(&self) -> pb::JobSpec {
        spec_to_proto(self)
    }

    fn from_proto(s: pb::JobSpec, _field: &'static str) -> Result<Self, DecodeError> {
        Ok(spec_from_proto(s))
    }

    /// Its flattened fields carry their versions here, not in a derive.
    fn version_of(s: &pb::JobSpec) -> u32 {
        if !s.secret_env.is_empty() {
            ENTRY_FORMAT_VERSION_SECRETS
        } else if s.not_preemptible {
            ENTRY_FORMAT_VERSION_NOT_PREEMPTIBLE
        } else if !s.queue.is_empty() {
            ENTRY_FORMAT_VERSION_QUEUE
        } else {
            ENTRY_FORMAT_VERSION_FIRST
        }
    }
}

impl Message for JobSpec {}

impl Versions for JobSpec {
    const NEWEST: u32 = ENTRY_FORMAT_VERSION_SECRETS;
}

impl ProtoForm<Vec<u8>> for SecretHash {
    fn to_proto(&self) -> Vec<u8> {
        self.0.to_vec()
    }

    fn from_proto(bytes: Vec<u8>, field: &'static str) -> Result<Self, DecodeError> {
        Ok(SecretHash(bytes.as_slice().try_into().map_err(|_| {
            DecodeError::Inconsistent(format!(
                "{field}: a secret hash of {} bytes, not 32",
                bytes.len()
            ))
        })?))
    }
}

impl Versions for SecretHash {
    const NEWEST: u32 = ENTRY_FORMAT_VERSION_FIRST;
}

/// The proto form uses empty strings for "absent", and presence for the
/// optional numbers (an explicit 0 stays 0, for validation to refuse);
/// validation happens in
/// [`JobSpec::validate`], not here.
pub fn spec_from_proto(s: pb::JobSpec) -> JobSpec {
    fn non_empty(s: String) -> Option<String> {
        (!s.is_empty()).then_some(s)
    }
    JobSpec {
        name: s.name,
        user: s.user,
        command: s.command,
        image: non_empty(s.image),
        env: s.env,
        gpus: s.gpus_per_worker,
        workers: Workers {
            min: s.min_workers,
            max: s.max_workers,
        },
        gpu_types: GpuTypes {
            allowed: s.gpu_types_allowed,
            preferred: s.gpu_types_preferred,
        },
        model: non_empty(s.model),
        total_steps: s.total_steps,
        epochs: s.epochs,
        priority: s.priority,
        max_retries: s.max_retries,
        retry_backoff_s: s
            .retry_backoff_s
            .unwrap_or(crate::spec::DEFAULT_RETRY_BACKOFF_S),
        resources: s
            .resources
            .map(|r| crate::spec::Resources {
                cpu_millis: r.cpu_millis,
                memory_bytes: r.memory_bytes,
            })
            .unwrap_or_default(),
        logs: s
            .logs
            .map(|l| crate::spec::LogLimits {
                max_file_bytes: l.max_file_bytes,
                max_files: l.max_files,
            })
            .unwrap_or_default(),
        queue: s.queue,
        preemptible: !s.not_preemptible,
        // `NAME/KEY`; one that is not stays as it came, for validation to
        // refuse naming the variable.
        secret_env: s
            .secret_env
            .into_iter()
            .map(|(k, r)| {
                let (name, key) = r.split_once('/').unwrap_or((r.as_str(), ""));
                let reference = SecretRef {
                    name: name.into(),
                    key: key.into(),
                };
                (k, reference)
            })
            .collect(),
    }
}

pub fn event_to_proto(e: &Event) -> pb::Event {
    pb::Event {
        kind: Some(e.to_proto()),
    }
}

/// An event from its protobuf form (the snapshot keeps the events of the
/// requests it remembers); the inverse of [`event_to_proto`].
pub fn event_from_proto(e: pb::Event) -> Result<Event, DecodeError> {
    Event::from_proto(
        e.kind.ok_or(DecodeError::MissingField("event.kind"))?,
        "event.kind",
    )
}

/// The record of what applying `entry` at `index` did, as stored in the
/// journal and streamed to watchers.
pub fn applied_entry_to_proto(
    index: u64,
    position: u32,
    entry: &LogEntry,
    outcome: &Result<Vec<Event>, crate::ApplyError>,
) -> pb::AppliedEntry {
    let (events, refused) = match outcome {
        Ok(events) => (events.iter().map(event_to_proto).collect(), String::new()),
        Err(e) => (Vec::new(), e.to_string()),
    };
    pb::AppliedEntry {
        index,
        at_ms: entry.at_ms,
        command: entry.command.kind().to_string(),
        events,
        refused,
        position,
        request_id: entry.request_id.clone().unwrap_or_default(),
        actor: entry.actor.clone().unwrap_or_default(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::command::JobPlacement;
    use crate::model::GpuRef;
    use crate::policy_memory::PolicyMemory;

    /// A proposal is encoded once per replica: the bytes it was read from
    /// (WAL or wire) are what it is written and sent as, and clones share
    /// the encoding; the cache is no part of its value.
    #[test]
    fn a_proposal_keeps_the_bytes_it_was_read_from() {
        let fresh = Proposal::new(vec![LogEntry::new(
            7,
            Command::SetPolicy {
                name: "fifo".into(),
            },
        )]);
        let bytes = encode_proposal(&fresh);
        let read = decode_proposal(&bytes).expect("decodes");
        assert_eq!(read, fresh);
        assert!(std::ptr::eq(
            proposal_bytes(&read),
            proposal_bytes(&read.clone())
        ));
        assert_eq!(proposal_bytes(&read), bytes.as_slice());
        // Made once, on first use, and shared with the clones made before.
        let copy = fresh.clone();
        assert!(std::ptr::eq(proposal_bytes(&fresh), proposal_bytes(&copy)));
    }

    /// Issue 19, item 9: an explicit `total_steps: 0` (or `epochs: 0`) from
    /// a client is refused with the field and its range, not stored as
    /// "unknown"; absent stays absent, and a value round-trips.
    #[test]
    fn an_explicit_zero_for_an_optional_number_is_refused_not_dropped() {
        let spec = || crate::spec::JobSpec {
            total_steps: None,
            ..crate::fixtures::job_spec("j", 1, 1)
        };
        let mut p = spec_to_proto(&spec());
        assert_eq!(spec_from_proto(p.clone()).total_steps, None);
        p.total_steps = Some(0);
        let err = spec_from_proto(p.clone()).validate().expect_err("refused");
        assert!(err.to_string().contains("total_steps"), "{err}");
        p.total_steps = None;
        p.epochs = Some(0);
        let err = spec_from_proto(p.clone()).validate().expect_err("refused");
        assert!(err.to_string().contains("epochs"), "{err}");
        let mut with = spec();
        with.total_steps = Some(500);
        assert_eq!(spec_from_proto(spec_to_proto(&with)), with);
    }

    #[test]
    fn unknown_command_is_an_error_not_a_skip() {
        // Field 99 is a command this build does not know.
        let mut bytes = pb::LogEntry {
            format_version: 1,
            at_ms: 5,
            command: None,
            request_id: String::new(),
            actor: String::new(),
            trace_parent: String::new(),
        }
        .encode_to_vec();
        // tag = (99 << 3) | 2 (length-delimited), length 0
        bytes.extend_from_slice(&[0x9a, 0x06, 0x00]);
        assert_eq!(
            decode_entry(&bytes),
            Err(DecodeError::UnknownCommand { format_version: 1 })
        );
    }

    #[test]
    fn newer_format_version_is_refused() {
        let bytes = pb::LogEntry {
            format_version: ENTRY_FORMAT_VERSION + 1,
            at_ms: 5,
            command: Some(pb::log_entry::Command::RemoveJob(pb::RemoveJob {
                job_id: 1,
            })),
            request_id: String::new(),
            actor: String::new(),
            trace_parent: String::new(),
        }
        .encode_to_vec();
        assert!(matches!(
            decode_entry(&bytes),
            Err(DecodeError::UnsupportedFormatVersion { .. })
        ));
    }

    #[test]
    fn garbage_is_a_protobuf_error() {
        assert!(matches!(
            decode_entry(&[0xff, 0xff, 0xff]),
            Err(DecodeError::Protobuf(_))
        ));
    }

    /// Each entry is written in the oldest version that expresses it: the
    /// newest `since` among what it carries, whatever else it holds; the
    /// newest this build reads is the newest `since` of all.
    #[test]
    fn an_entry_is_written_in_the_version_of_the_newest_field_it_carries() {
        use crate::acl::Role;
        use crate::fixtures::job_spec;
        let version = |entry: LogEntry| {
            let proto = entry_to_proto(&entry);
            assert_eq!(decode_entry(&encode_entry(&entry)), Ok(entry), "round trip");
            proto.format_version
        };
        let submit = |spec: JobSpec| LogEntry::new(1, Command::submit_job(spec));
        let plain = job_spec("train", 1, 1);
        assert_eq!(version(submit(plain.clone())), 1);
        let queued = JobSpec {
            queue: "team-a".into(),
            ..plain.clone()
        };
        assert_eq!(version(submit(queued.clone())), 6);
        let pinned = JobSpec {
            preemptible: false,
            ..queued
        };
        assert_eq!(version(submit(pinned.clone())), 7);
        let with_secret = JobSpec {
            secret_env: [(
                "TOKEN".to_string(),
                SecretRef {
                    name: "hub".into(),
                    key: "token".into(),
                },
            )]
            .into(),
            ..pinned
        };
        assert_eq!(version(submit(with_secret)), 10);
        // The entry's own fields, and the newest wins.
        let mut entry = submit(plain.clone());
        entry.request_id = Some("cli-1".into());
        assert_eq!(version(entry.clone()), 3);
        entry.actor = Some("alice".into());
        assert_eq!(version(entry.clone()), 5);
        entry.trace_parent = Some("00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01".into());
        assert_eq!(version(entry), 9);
        // A field of a command: a token's queues; empty is not carried.
        let token = |queues: Vec<String>| {
            LogEntry::new(
                1,
                Command::CreateToken {
                    name: "ci".into(),
                    role: Role::User,
                    secret_hash: SecretHash([7; 32]),
                    ttl_ms: None,
                    queues,
                },
            )
        };
        assert_eq!(version(token(Vec::new())), 1);
        assert_eq!(version(token(vec!["team-a".into()])), 8);
        // A command added in a version needs it whatever it holds.
        assert_eq!(version(LogEntry::new(1, Command::delete_secret("hub"))), 10);
        assert_eq!(ENTRY_FORMAT_VERSION, ENTRY_FORMAT_VERSION_SECRETS);
    }

    /// What the protobuf form cannot hold in the domain is refused with the
    /// field: an unknown enum value, a hash of the wrong length, a missing
    /// required message.
    #[test]
    fn a_command_the_domain_cannot_hold_is_refused_naming_the_field() {
        use pb::log_entry::Command as C;
        let entry = |command: C| pb::LogEntry {
            format_version: 1,
            at_ms: 1,
            command: Some(command),
            ..Default::default()
        };
        let finish = entry(C::FinishJob(pb::FinishJob {
            job_id: 1,
            outcome: 9,
            ..Default::default()
        }));
        assert_eq!(
            entry_from_proto(finish),
            Err(DecodeError::UnknownValue {
                field: "finish_job.outcome",
                value: 9
            })
        );
        let unspecified = entry(C::CreateToken(pb::CreateToken {
            name: "ci".into(),
            role: pb::Role::Unspecified as i32,
            secret_hash: vec![7; 32],
            ..Default::default()
        }));
        assert_eq!(
            entry_from_proto(unspecified),
            Err(DecodeError::UnknownValue {
                field: "create_token.role",
                value: 0
            })
        );
        let short = entry(C::BootstrapAcl(pb::BootstrapAcl {
            name: "root".into(),
            secret_hash: vec![7; 31],
        }));
        assert!(matches!(
            entry_from_proto(short),
            Err(DecodeError::Inconsistent(m)) if m.contains("bootstrap_acl.secret_hash") && m.contains("31 bytes")
        ));
        let no_spec = entry(C::SubmitJob(pb::SubmitJob { spec: None }));
        assert_eq!(
            entry_from_proto(no_spec),
            Err(DecodeError::MissingField("submit_job.spec"))
        );
    }

    #[test]
    fn only_an_entry_that_shares_gpus_is_written_in_format_version_2() {
        let gpu = GpuRef {
            node: "n0".into(),
            index: 0,
        };
        let decision = |share: bool| LogEntry {
            at_ms: 5,
            command: Command::DecideAllocation {
                based_on: 3,
                policy: "max_min_fairness_packed".into(),
                round: 1,
                memory: None,
                placements: vec![
                    JobPlacement {
                        job_id: 1,
                        gpus: vec![gpu.clone()],
                        share_with: share.then_some(2),
                    },
                    JobPlacement {
                        job_id: 2,
                        gpus: vec![gpu.clone()],
                        share_with: share.then_some(1),
                    },
                ],
            },
            request_id: None,
            actor: None,
            trace_parent: None,
        };
        for (share, version) in [(false, 1), (true, 2)] {
            let entry = decision(share);
            assert_eq!(entry_to_proto(&entry).format_version, version);
            let bytes = encode_entry(&entry);
            assert_eq!(decode_entry(&bytes), Ok(entry), "round trip");
        }
        // A request id makes any entry version 3, and round-trips.
        let entry = LogEntry {
            request_id: Some("cli-1".into()),
            ..decision(true)
        };
        assert_eq!(entry_to_proto(&entry).format_version, 3);
        assert_eq!(decode_entry(&encode_entry(&entry)), Ok(entry.clone()));
        // A policy memory makes it version 4 (a version-3 reader would
        // drop the field and keep an older memory than its peers).
        let mut with_memory = entry;
        if let Command::DecideAllocation { memory, .. } = &mut with_memory.command {
            *memory = Some(PolicyMemory {
                policy: "max_min_fairness_packed".into(),
                format: 1,
                bytes: vec![1, 2, 3],
            });
        }
        assert_eq!(entry_to_proto(&with_memory).format_version, 4);
        assert_eq!(decode_entry(&encode_entry(&with_memory)), Ok(with_memory));
    }
}
