//! Backup (issue 25, item 6): `SaveSnapshot` answers with the replicated
//! state as of a linearizable read, as a [`api::SnapshotFile`] in pieces
//! (`keel snapshot save` writes them to a file; `keel snapshot restore`
//! founds a new cluster on it).

use std::pin::Pin;

use futures::Stream;
use keel_proto::api;
use prost::Message;
use tonic::{Request, Response, Status};

use super::KeelApi;
use crate::authz::Right;
use crate::grpc_status::ApiError;

/// The answer: the file's encoding, a piece at a time.
pub(crate) type SnapshotStream =
    Pin<Box<dyn Stream<Item = Result<api::SnapshotChunk, Status>> + Send>>;

/// The format of [`api::SnapshotFile`] this build writes and reads.
pub const SNAPSHOT_FILE_FORMAT: u32 = 1;

/// The largest piece of a file in one message (well under the 4 MiB a
/// gRPC client accepts by default).
const SNAPSHOT_CHUNK_BYTES: usize = 1 << 20;

impl KeelApi {
    pub(super) async fn save_snapshot_call(
        &self,
        request: Request<api::SaveSnapshotRequest>,
    ) -> Result<Response<SnapshotStream>, Status> {
        self.authorize(&request, Right::SaveSnapshots)?;
        // Everything acknowledged before the call is in the state read.
        self.linearizable().await?;
        let (state, index, term, state_hash, members) = {
            let shared = self.node.state_machine.shared();
            let applied = shared.read();
            let last = applied.last_applied.ok_or_else(|| {
                ApiError::Unavailable("this replica has applied nothing yet".into())
            })?;
            let state = keel_storage::snapshot_codec::encode_snapshot(&applied.state);
            let membership = applied.membership.membership();
            let members: Vec<api::SnapshotMember> = membership
                .voter_ids()
                .map(|id| api::SnapshotMember {
                    id: crate::membership::member_of(id),
                    address: membership
                        .get_node(&id)
                        .map(|n| n.addr.clone())
                        .unwrap_or_default(),
                })
                .collect();
            (
                state,
                last.index,
                last.leader_id.term,
                applied.state.state_hash().to_string(),
                members,
            )
        };
        let file = api::SnapshotFile {
            format: SNAPSHOT_FILE_FORMAT,
            cluster_id: self.node.identity.get().unwrap_or_default(),
            index,
            term,
            state_hash,
            taken_at_ms: self.node.clock.wall_ms(),
            taken_by_member: crate::membership::member_of(self.node.id),
            members,
            state,
        }
        .encode_to_vec();
        tracing::info!(
            index,
            bytes = file.len(),
            "a snapshot was saved by a client"
        );
        let chunks: Vec<Result<api::SnapshotChunk, Status>> = file
            .chunks(SNAPSHOT_CHUNK_BYTES)
            .map(|piece| {
                Ok(api::SnapshotChunk {
                    data: piece.to_vec(),
                })
            })
            .collect();
        Ok(Response::new(Box::pin(tokio_stream::iter(chunks))))
    }
}
