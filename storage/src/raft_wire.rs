//! Raft's records and messages in protobuf (`keel.replication.v1`), and the
//! versioned encoding of the Raft service's payloads.
//!
//! - [`WireMessage`]: one request or reply of the Raft service, encoded in a
//!   given wire format: [`RAFT_WIRE_FORMAT_PREVIOUS`] (1, openraft's types
//!   in postcard, as the releases before format 2 wrote them) or
//!   [`RAFT_WIRE_FORMAT`] (2, protobuf). Any other format is refused with a
//!   [`WireError`] naming both.
//! - [`membership_to_proto`] and [`membership_from_proto`]: membership as
//!   the WAL stores it.
//!
//! Decoding checks what openraft would otherwise trust: required fields
//! present, at least one voter set. Which format to send a peer is the
//! network's choice ([`send_format`]).

use std::collections::{BTreeMap, BTreeSet};

use keel_proto::replication as pb;
use keel_state::codec::{decode_proposal_owned, encode_proposal};
use openraft::error::{Fatal, Infallible, InstallSnapshotError, RaftError, SnapshotMismatch};
use openraft::raft::{
    AppendEntriesRequest, AppendEntriesResponse, InstallSnapshotRequest, InstallSnapshotResponse,
    VoteRequest, VoteResponse,
};
use openraft::{
    AnyError, BasicNode, CommittedLeaderId, EntryPayload, ErrorSubject, ErrorVerb, Membership,
    SnapshotMeta, SnapshotSegmentId, StorageIOError, StoredMembership, Vote,
};
use prost::Message;
use serde::Serialize;

use crate::{Entry, LogId, TypeConfig};

/// The Raft wire format this build writes: protobuf.
pub const RAFT_WIRE_FORMAT: u32 = 2;
/// The format before it, which this build still reads and writes to peers
/// that read nothing newer: openraft's types in postcard.
pub const RAFT_WIRE_FORMAT_PREVIOUS: u32 = 1;

/// A Raft payload that cannot be encoded or decoded.
#[derive(Debug, thiserror::Error)]
pub enum WireError {
    #[error(
        "Raft wire format {found} is not one this replica reads (formats \
         {RAFT_WIRE_FORMAT_PREVIOUS} to {newest}){}",
        if *found > *newest { "; upgrade this replica" } else { "" }
    )]
    Format { found: u32, newest: u32 },
    #[error("undecodable Raft message (format 1, postcard): {0}")]
    Postcard(#[from] postcard::Error),
    #[error("undecodable Raft message (format 2, protobuf): {0}")]
    Protobuf(#[from] prost::DecodeError),
    #[error(
        "Raft wire format {format} cannot carry this message whole (it needs format {oldest})"
    )]
    NotCarried { format: u32, oldest: u32 },
    #[error("Raft message without its required field {0}")]
    Missing(&'static str),
    #[error("Raft message with an invalid {field}: {reason}")]
    Invalid { field: &'static str, reason: String },
}

/// The format to write to a peer that said it reads up to `peer_reads`
/// (`None`: it has not answered since the connection was made), by a build
/// that reads up to `mine`: the newest both read; before the peer has
/// answered, the one before `mine`, which the release before reads too.
pub fn send_format(mine: u32, peer_reads: Option<u32>) -> u32 {
    match peer_reads {
        Some(theirs) => theirs.min(mine),
        None => mine.saturating_sub(1),
    }
    .max(RAFT_WIRE_FORMAT_PREVIOUS)
}

/// The format a received message names (0, unset: format 1).
pub fn received_format(format_version: u32) -> u32 {
    format_version.max(RAFT_WIRE_FORMAT_PREVIOUS)
}

/// One request or reply of the Raft service.
pub trait WireMessage: Sized {
    /// Encodes in `format` (1 or 2).
    fn encode(&self, format: u32) -> Result<Vec<u8>, WireError>;
    /// Decodes from `format` (1 or 2).
    fn decode(bytes: &[u8], format: u32) -> Result<Self, WireError>;
    /// The oldest format that carries it whole: format 1 leaves out what
    /// entries gained after it (a job's `resources`), so such a message
    /// goes in format 2, which a replica of the release before refuses
    /// rather than apply less than the leader did.
    fn oldest_format(&self) -> u32 {
        RAFT_WIRE_FORMAT_PREVIOUS
    }
}

/// Implements [`WireMessage`] by postcard (format 1) and by conversion to
/// and from protobuf message `$pb` (format 2).
macro_rules! wire_message {
    ($t:ty, $pb:ty, $to:expr, $from:expr) => {
        wire_message!($t, $pb, $to, $from, |_| RAFT_WIRE_FORMAT_PREVIOUS);
    };
    ($t:ty, $pb:ty, $to:expr, $from:expr, $oldest:expr) => {
        impl WireMessage for $t {
            fn oldest_format(&self) -> u32 {
                let oldest: fn(&$t) -> u32 = $oldest;
                oldest(self)
            }

            fn encode(&self, format: u32) -> Result<Vec<u8>, WireError> {
                match format {
                    RAFT_WIRE_FORMAT_PREVIOUS if self.oldest_format() > format => {
                        Err(WireError::NotCarried {
                            format,
                            oldest: self.oldest_format(),
                        })
                    }
                    RAFT_WIRE_FORMAT_PREVIOUS => postcard_encode(self),
                    RAFT_WIRE_FORMAT => {
                        let to: fn(&$t) -> $pb = $to;
                        Ok(to(self).encode_to_vec())
                    }
                    found => Err(WireError::Format {
                        found,
                        newest: RAFT_WIRE_FORMAT,
                    }),
                }
            }

            fn decode(bytes: &[u8], format: u32) -> Result<Self, WireError> {
                match format {
                    RAFT_WIRE_FORMAT_PREVIOUS => Ok(postcard::from_bytes(bytes)?),
                    RAFT_WIRE_FORMAT => {
                        let from: fn($pb) -> Result<$t, WireError> = $from;
                        from(<$pb>::decode(bytes)?)
                    }
                    found => Err(WireError::Format {
                        found,
                        newest: RAFT_WIRE_FORMAT,
                    }),
                }
            }
        }
    };
}

fn postcard_encode<T: Serialize>(value: &T) -> Result<Vec<u8>, WireError> {
    Ok(postcard::to_allocvec(value)?)
}

type AppendReply = Result<AppendEntriesResponse<u64>, RaftError<u64>>;
type VoteReply = Result<VoteResponse<u64>, RaftError<u64>>;
type SnapshotReply = Result<InstallSnapshotResponse<u64>, RaftError<u64, InstallSnapshotError>>;

wire_message!(
    AppendEntriesRequest<TypeConfig>,
    pb::AppendEntriesRequest,
    append_request_to_proto,
    append_request_from_proto,
    |r| {
        let whole = r.entries.iter().all(|e| match &e.payload {
            EntryPayload::Normal(p) => p.postcard_carries_whole(),
            _ => true,
        });
        if whole {
            RAFT_WIRE_FORMAT_PREVIOUS
        } else {
            RAFT_WIRE_FORMAT
        }
    }
);
wire_message!(
    VoteRequest<u64>,
    pb::VoteRequest,
    |r| pb::VoteRequest {
        vote: Some(vote_to_proto(&r.vote)),
        last_log_id: r.last_log_id.as_ref().map(log_id_to_proto),
    },
    |r| Ok(VoteRequest {
        vote: vote_from_proto(required(r.vote, "vote")?),
        last_log_id: r.last_log_id.map(log_id_from_proto),
    })
);
wire_message!(
    InstallSnapshotRequest<TypeConfig>,
    pb::InstallSnapshotRequest,
    |r| pb::InstallSnapshotRequest {
        vote: Some(vote_to_proto(&r.vote)),
        meta: Some(snapshot_meta_to_proto(&r.meta)),
        offset: r.offset,
        data: r.data.clone(),
        done: r.done,
    },
    |r| Ok(InstallSnapshotRequest {
        vote: vote_from_proto(required(r.vote, "vote")?),
        meta: snapshot_meta_from_proto(required(r.meta, "meta")?)?,
        offset: r.offset,
        data: r.data,
        done: r.done,
    })
);
wire_message!(
    AppendReply,
    pb::AppendEntriesReply,
    |r| pb::AppendEntriesReply {
        result: Some(match r {
            Ok(ok) => pb::append_entries_reply::Result::Ok(append_response_to_proto(ok)),
            Err(e) => pb::append_entries_reply::Result::Error(raft_error_to_proto(e)),
        }),
    },
    |r| match required(r.result, "result")? {
        pb::append_entries_reply::Result::Ok(ok) => Ok(Ok(append_response_from_proto(ok)?)),
        pb::append_entries_reply::Result::Error(e) => Ok(Err(raft_error_from_proto(e)?)),
    }
);
wire_message!(
    VoteReply,
    pb::VoteReply,
    |r| pb::VoteReply {
        result: Some(match r {
            Ok(ok) => pb::vote_reply::Result::Ok(pb::VoteResponse {
                vote: Some(vote_to_proto(&ok.vote)),
                vote_granted: ok.vote_granted,
                last_log_id: ok.last_log_id.as_ref().map(log_id_to_proto),
            }),
            Err(e) => pb::vote_reply::Result::Error(raft_error_to_proto(e)),
        }),
    },
    |r| match required(r.result, "result")? {
        pb::vote_reply::Result::Ok(ok) => Ok(Ok(VoteResponse {
            vote: vote_from_proto(required(ok.vote, "vote")?),
            vote_granted: ok.vote_granted,
            last_log_id: ok.last_log_id.map(log_id_from_proto),
        })),
        pb::vote_reply::Result::Error(e) => Ok(Err(raft_error_from_proto(e)?)),
    }
);
wire_message!(
    SnapshotReply,
    pb::InstallSnapshotReply,
    |r| pb::InstallSnapshotReply {
        result: Some(match r {
            Ok(ok) => pb::install_snapshot_reply::Result::Ok(pb::InstallSnapshotResponse {
                vote: Some(vote_to_proto(&ok.vote)),
            }),
            Err(e) => pb::install_snapshot_reply::Result::Error(raft_error_to_proto(e)),
        }),
    },
    |r| match required(r.result, "result")? {
        pb::install_snapshot_reply::Result::Ok(ok) => Ok(Ok(InstallSnapshotResponse {
            vote: vote_from_proto(required(ok.vote, "vote")?),
        })),
        pb::install_snapshot_reply::Result::Error(e) => Ok(Err(raft_error_from_proto(e)?)),
    }
);

fn required<T>(field: Option<T>, name: &'static str) -> Result<T, WireError> {
    field.ok_or(WireError::Missing(name))
}

pub fn log_id_to_proto(id: &LogId) -> pb::LogId {
    pb::LogId {
        term: id.leader_id.term,
        leader: id.leader_id.node_id,
        index: id.index,
    }
}

pub fn log_id_from_proto(id: pb::LogId) -> LogId {
    LogId::new(CommittedLeaderId::new(id.term, id.leader), id.index)
}

fn vote_to_proto(vote: &Vote<u64>) -> pb::Vote {
    pb::Vote {
        term: vote.leader_id.term,
        node: vote.leader_id.node_id,
        committed: vote.committed,
    }
}

fn vote_from_proto(vote: pb::Vote) -> Vote<u64> {
    if vote.committed {
        Vote::new_committed(vote.term, vote.node)
    } else {
        Vote::new(vote.term, vote.node)
    }
}

/// Membership as the WAL and the wire carry it.
pub fn membership_to_proto(m: &Membership<u64, BasicNode>) -> pb::Membership {
    pb::Membership {
        configs: m
            .get_joint_config()
            .iter()
            .map(|set| pb::VoterSet {
                ids: set.iter().copied().collect(),
            })
            .collect(),
        nodes: m
            .nodes()
            .map(|(id, node)| pb::Node {
                id: *id,
                addr: node.addr.clone(),
            })
            .collect(),
    }
}

/// Membership from the WAL or the wire: at least one voter set; a node
/// named twice is refused.
pub fn membership_from_proto(m: pb::Membership) -> Result<Membership<u64, BasicNode>, WireError> {
    if m.configs.is_empty() {
        return Err(WireError::Invalid {
            field: "membership.configs",
            reason: "no voter set".into(),
        });
    }
    let configs: Vec<BTreeSet<u64>> = m
        .configs
        .into_iter()
        .map(|set| set.ids.into_iter().collect())
        .collect();
    let mut nodes = BTreeMap::new();
    for node in m.nodes {
        if nodes
            .insert(node.id, BasicNode { addr: node.addr })
            .is_some()
        {
            return Err(WireError::Invalid {
                field: "membership.nodes",
                reason: format!("member {} is named twice", node.id),
            });
        }
    }
    Ok(Membership::new(configs, nodes))
}

pub(crate) fn stored_membership_to_proto(
    m: &StoredMembership<u64, BasicNode>,
) -> pb::StoredMembership {
    pb::StoredMembership {
        log_id: m.log_id().as_ref().map(log_id_to_proto),
        membership: Some(membership_to_proto(m.membership())),
    }
}

pub(crate) fn stored_membership_from_proto(
    m: pb::StoredMembership,
) -> Result<StoredMembership<u64, BasicNode>, WireError> {
    let membership = required(m.membership, "membership")?;
    // The initial membership (no log id) is the empty one openraft starts
    // from; any other needs a voter set.
    let membership = match (&m.log_id, membership.configs.is_empty()) {
        (None, true) if membership.nodes.is_empty() => Membership::default(),
        _ => membership_from_proto(membership)?,
    };
    Ok(StoredMembership::new(
        m.log_id.map(log_id_from_proto),
        membership,
    ))
}

pub(crate) fn snapshot_meta_to_proto(meta: &SnapshotMeta<u64, BasicNode>) -> pb::SnapshotMeta {
    pb::SnapshotMeta {
        last_log_id: meta.last_log_id.as_ref().map(log_id_to_proto),
        last_membership: Some(stored_membership_to_proto(&meta.last_membership)),
        snapshot_id: meta.snapshot_id.clone(),
    }
}

pub(crate) fn snapshot_meta_from_proto(
    meta: pb::SnapshotMeta,
) -> Result<SnapshotMeta<u64, BasicNode>, WireError> {
    Ok(SnapshotMeta {
        last_log_id: meta.last_log_id.map(log_id_from_proto),
        last_membership: stored_membership_from_proto(required(
            meta.last_membership,
            "meta.last_membership",
        )?)?,
        snapshot_id: meta.snapshot_id,
    })
}

fn entry_to_proto(entry: &Entry) -> pb::Entry {
    use pb::entry::Payload;
    pb::Entry {
        log_id: Some(log_id_to_proto(&entry.log_id)),
        payload: Some(match &entry.payload {
            EntryPayload::Blank => Payload::Blank(pb::Blank {}),
            EntryPayload::Normal(proposal) => Payload::Proposal(encode_proposal(proposal)),
            EntryPayload::Membership(m) => Payload::Membership(membership_to_proto(m)),
        }),
    }
}

fn entry_from_proto(entry: pb::Entry) -> Result<Entry, WireError> {
    use pb::entry::Payload;
    let log_id = log_id_from_proto(required(entry.log_id, "entry.log_id")?);
    let payload = match required(entry.payload, "entry.payload")? {
        Payload::Blank(_) => EntryPayload::Blank,
        Payload::Proposal(bytes) => EntryPayload::Normal(decode_proposal_owned(bytes).map_err(
            |e| WireError::Invalid {
                field: "entry.proposal",
                reason: format!("entry {}: {e}", log_id.index),
            },
        )?),
        Payload::Membership(m) => EntryPayload::Membership(membership_from_proto(m)?),
    };
    Ok(Entry { log_id, payload })
}

fn append_request_to_proto(r: &AppendEntriesRequest<TypeConfig>) -> pb::AppendEntriesRequest {
    pb::AppendEntriesRequest {
        vote: Some(vote_to_proto(&r.vote)),
        prev_log_id: r.prev_log_id.as_ref().map(log_id_to_proto),
        entries: r.entries.iter().map(entry_to_proto).collect(),
        leader_commit: r.leader_commit.as_ref().map(log_id_to_proto),
    }
}

fn append_request_from_proto(
    r: pb::AppendEntriesRequest,
) -> Result<AppendEntriesRequest<TypeConfig>, WireError> {
    Ok(AppendEntriesRequest {
        vote: vote_from_proto(required(r.vote, "vote")?),
        prev_log_id: r.prev_log_id.map(log_id_from_proto),
        entries: r
            .entries
            .into_iter()
            .map(entry_from_proto)
            .collect::<Result<_, _>>()?,
        leader_commit: r.leader_commit.map(log_id_from_proto),
    })
}

fn append_response_to_proto(r: &AppendEntriesResponse<u64>) -> pb::AppendEntriesResponse {
    use pb::append_entries_response::Outcome;
    pb::AppendEntriesResponse {
        outcome: Some(match r {
            AppendEntriesResponse::Success => Outcome::Success(pb::Blank {}),
            AppendEntriesResponse::PartialSuccess(matching) => {
                Outcome::PartialSuccess(pb::PartialSuccess {
                    matching: matching.as_ref().map(log_id_to_proto),
                })
            }
            AppendEntriesResponse::Conflict => Outcome::Conflict(pb::Blank {}),
            AppendEntriesResponse::HigherVote(vote) => Outcome::HigherVote(vote_to_proto(vote)),
        }),
    }
}

fn append_response_from_proto(
    r: pb::AppendEntriesResponse,
) -> Result<AppendEntriesResponse<u64>, WireError> {
    use pb::append_entries_response::Outcome;
    Ok(match required(r.outcome, "outcome")? {
        Outcome::Success(_) => AppendEntriesResponse::Success,
        Outcome::PartialSuccess(p) => {
            AppendEntriesResponse::PartialSuccess(p.matching.map(log_id_from_proto))
        }
        Outcome::Conflict(_) => AppendEntriesResponse::Conflict,
        Outcome::HigherVote(vote) => AppendEntriesResponse::HigherVote(vote_from_proto(vote)),
    })
}

/// The error a Raft call's handler can return besides a fatal one: none
/// ([`Infallible`]), or a snapshot chunk out of sequence.
pub trait ApiError: Sized {
    fn to_proto(&self) -> pb::raft_error::Kind;
    fn from_mismatch(m: SnapshotMismatch) -> Option<Self>;
}

impl ApiError for Infallible {
    fn to_proto(&self) -> pb::raft_error::Kind {
        match *self {}
    }

    fn from_mismatch(_: SnapshotMismatch) -> Option<Self> {
        None
    }
}

impl ApiError for InstallSnapshotError {
    fn to_proto(&self) -> pb::raft_error::Kind {
        let InstallSnapshotError::SnapshotMismatch(m) = self;
        let segment = |s: &SnapshotSegmentId| pb::SnapshotSegmentId {
            id: s.id.clone(),
            offset: s.offset,
        };
        pb::raft_error::Kind::SnapshotMismatch(pb::SnapshotMismatch {
            expect: Some(segment(&m.expect)),
            got: Some(segment(&m.got)),
        })
    }

    fn from_mismatch(m: SnapshotMismatch) -> Option<Self> {
        Some(InstallSnapshotError::SnapshotMismatch(m))
    }
}

fn raft_error_to_proto<E: ApiError + std::error::Error>(e: &RaftError<u64, E>) -> pb::RaftError {
    use pb::raft_error::Kind;
    pb::RaftError {
        kind: Some(match e {
            RaftError::APIError(e) => e.to_proto(),
            RaftError::Fatal(Fatal::Panicked) => Kind::Panicked(pb::Blank {}),
            RaftError::Fatal(Fatal::Stopped) => Kind::Stopped(pb::Blank {}),
            RaftError::Fatal(Fatal::StorageError(e)) => Kind::StorageError(e.to_string()),
        }),
    }
}

fn raft_error_from_proto<E: ApiError + std::error::Error>(
    e: pb::RaftError,
) -> Result<RaftError<u64, E>, WireError> {
    use pb::raft_error::Kind;
    Ok(match required(e.kind, "error.kind")? {
        Kind::Panicked(_) => RaftError::Fatal(Fatal::Panicked),
        Kind::Stopped(_) => RaftError::Fatal(Fatal::Stopped),
        Kind::StorageError(text) => RaftError::Fatal(Fatal::StorageError(
            StorageIOError::new(ErrorSubject::Store, ErrorVerb::Read, AnyError::error(text)).into(),
        )),
        Kind::SnapshotMismatch(m) => {
            let segment = |s: Option<pb::SnapshotSegmentId>| {
                let s = s.unwrap_or_default();
                SnapshotSegmentId {
                    id: s.id,
                    offset: s.offset,
                }
            };
            let mismatch = SnapshotMismatch {
                expect: segment(m.expect),
                got: segment(m.got),
            };
            RaftError::APIError(E::from_mismatch(mismatch).ok_or(WireError::Invalid {
                field: "error.kind",
                reason:
                    "a snapshot mismatch in a reply to another call than install snapshot".into(),
            })?)
        }
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn entries_with_resource_limits_travel_in_protobuf_only() {
        use keel_state::{Command, LogEntry, Proposal};
        let request = |limited: bool| {
            let mut spec = keel_state::fixtures::job_spec("limited", 1, 1);
            if limited {
                spec.resources.memory_bytes = Some(64 << 20);
                spec.resources.cpu_millis = Some(1500);
            }
            let proposal = Proposal::new(vec![LogEntry::new(1_000, Command::submit_job(spec))]);
            AppendEntriesRequest::<TypeConfig> {
                vote: Vote::new_committed(1, 1),
                prev_log_id: None,
                entries: vec![crate::Entry {
                    log_id: openraft::LogId::new(CommittedLeaderId::new(1, 1), 1),
                    payload: EntryPayload::Normal(proposal),
                }],
                leader_commit: None,
            }
        };
        let spec_of = |r: &AppendEntriesRequest<TypeConfig>| match &r.entries[0].payload {
            EntryPayload::Normal(p) => match &p.entries[0].command {
                keel_state::Command::SubmitJob { spec, .. } => spec.clone(),
                other => panic!("not a submission: {other:?}"),
            },
            other => panic!("not a proposal: {other:?}"),
        };
        // Without limits, format 1 carries it as before.
        let plain = request(false);
        assert_eq!(plain.oldest_format(), RAFT_WIRE_FORMAT_PREVIOUS);
        let back = AppendEntriesRequest::<TypeConfig>::decode(
            &plain.encode(RAFT_WIRE_FORMAT_PREVIOUS).expect("format 1"),
            RAFT_WIRE_FORMAT_PREVIOUS,
        )
        .expect("decodes");
        assert_eq!(spec_of(&back), spec_of(&plain));
        // With them, format 1 refuses rather than drop them; format 2 keeps them.
        let limited = request(true);
        assert_eq!(limited.oldest_format(), RAFT_WIRE_FORMAT);
        let refused = limited
            .encode(RAFT_WIRE_FORMAT_PREVIOUS)
            .expect_err("format 1 cannot carry resources");
        assert!(
            matches!(
                refused,
                WireError::NotCarried {
                    format: 1,
                    oldest: 2
                }
            ),
            "{refused}"
        );
        let back = AppendEntriesRequest::<TypeConfig>::decode(
            &limited.encode(RAFT_WIRE_FORMAT).expect("format 2"),
            RAFT_WIRE_FORMAT,
        )
        .expect("decodes");
        assert_eq!(spec_of(&back).resources, spec_of(&limited).resources);
        assert_eq!(spec_of(&back).resources.memory_bytes, Some(64 << 20));
    }

    #[test]
    fn a_sender_writes_the_newest_format_both_ends_read() {
        // Before the peer answered: the format before its own.
        assert_eq!(send_format(2, None), 1);
        assert_eq!(send_format(3, None), 2);
        // After: the newest both read.
        assert_eq!(send_format(2, Some(1)), 1);
        assert_eq!(send_format(2, Some(2)), 2);
        assert_eq!(send_format(2, Some(3)), 2);
        // A replica pinned to format 1 writes format 1 only.
        assert_eq!(send_format(1, None), 1);
        assert_eq!(send_format(1, Some(2)), 1);
        // A release before format 2 sets no format: it is format 1.
        assert_eq!(received_format(0), 1);
        assert_eq!(received_format(2), 2);
    }

    #[test]
    fn a_message_without_a_required_field_is_refused_naming_it() {
        let bytes = pb::VoteRequest {
            vote: None,
            last_log_id: None,
        }
        .encode_to_vec();
        let err = VoteRequest::<u64>::decode(&bytes, RAFT_WIRE_FORMAT).expect_err("refused");
        assert!(matches!(err, WireError::Missing("vote")), "{err}");
        let reply = pb::AppendEntriesReply { result: None }.encode_to_vec();
        let err = AppendReply::decode(&reply, RAFT_WIRE_FORMAT).expect_err("refused");
        assert!(matches!(err, WireError::Missing("result")), "{err}");
        let entry = pb::AppendEntriesRequest {
            vote: Some(pb::Vote::default()),
            entries: vec![pb::Entry {
                log_id: Some(pb::LogId::default()),
                payload: None,
            }],
            ..Default::default()
        }
        .encode_to_vec();
        let err = AppendEntriesRequest::<TypeConfig>::decode(&entry, RAFT_WIRE_FORMAT)
            .expect_err("refused");
        assert!(matches!(err, WireError::Missing("entry.payload")), "{err}");
    }

    #[test]
    fn a_membership_without_voters_or_with_a_member_twice_is_refused() {
        let empty = pb::Membership {
            configs: vec![],
            nodes: vec![],
        };
        assert!(matches!(
            membership_from_proto(empty),
            Err(WireError::Invalid {
                field: "membership.configs",
                ..
            })
        ));
        let twice = pb::Membership {
            configs: vec![pb::VoterSet { ids: vec![1] }],
            nodes: vec![
                pb::Node {
                    id: 1,
                    addr: "a:1".into(),
                },
                pb::Node {
                    id: 1,
                    addr: "b:1".into(),
                },
            ],
        };
        assert!(matches!(
            membership_from_proto(twice),
            Err(WireError::Invalid {
                field: "membership.nodes",
                ..
            })
        ));
        // Voters without an address get openraft's default node, as
        // `Membership::new` gives them.
        let m = membership_from_proto(pb::Membership {
            configs: vec![pb::VoterSet { ids: vec![1, 2] }],
            nodes: vec![pb::Node {
                id: 3,
                addr: "c:1".into(),
            }],
        })
        .expect("valid");
        assert_eq!(m.voter_ids().collect::<Vec<_>>(), vec![1, 2]);
        assert_eq!(m.learner_ids().collect::<Vec<_>>(), vec![3]);
    }

    #[test]
    fn a_proposal_that_does_not_decode_is_refused_naming_its_index() {
        let bytes = pb::AppendEntriesRequest {
            vote: Some(pb::Vote::default()),
            entries: vec![pb::Entry {
                log_id: Some(pb::LogId {
                    term: 1,
                    leader: 1,
                    index: 17,
                }),
                payload: Some(pb::entry::Payload::Proposal(vec![0xff, 0xff, 0xff])),
            }],
            ..Default::default()
        }
        .encode_to_vec();
        let err = AppendEntriesRequest::<TypeConfig>::decode(&bytes, RAFT_WIRE_FORMAT)
            .expect_err("refused");
        assert!(
            matches!(&err, WireError::Invalid { field: "entry.proposal", reason } if reason.contains("entry 17")),
            "{err}"
        );
    }

    #[test]
    fn a_snapshot_mismatch_is_refused_in_a_reply_to_another_call() {
        let bytes = pb::AppendEntriesReply {
            result: Some(pb::append_entries_reply::Result::Error(pb::RaftError {
                kind: Some(pb::raft_error::Kind::SnapshotMismatch(
                    pb::SnapshotMismatch::default(),
                )),
            })),
        }
        .encode_to_vec();
        assert!(matches!(
            AppendReply::decode(&bytes, RAFT_WIRE_FORMAT),
            Err(WireError::Invalid {
                field: "error.kind",
                ..
            })
        ));
    }

    #[test]
    fn a_peers_storage_failure_arrives_with_its_text() {
        let failed: VoteReply = Err(RaftError::Fatal(Fatal::StorageError(
            StorageIOError::new(
                ErrorSubject::Vote,
                ErrorVerb::Write,
                AnyError::error("disk full"),
            )
            .into(),
        )));
        let bytes = failed.encode(RAFT_WIRE_FORMAT).expect("encodes");
        let decoded = VoteReply::decode(&bytes, RAFT_WIRE_FORMAT).expect("decodes");
        let text = decoded.expect_err("an error").to_string();
        assert!(text.contains("disk full"), "{text}");
    }
}
