//! Prompt elections when the leader's process is gone.
//!
//! openraft 0.9 stands a follower for election only once its leader lease
//! (the longest election timeout) and its own election timeout have both
//! passed since it last heard the leader: 450–600 ms with the default
//! timeouts, before the vote and the client's retry. Shorter timeouts cost
//! spurious elections on a loaded machine. But the common way a leader is
//! lost, its process ending (a crash, an OOM kill, `kill -9`, a restart),
//! can be seen at once, without waiting:
//!
//! - every follower holds a `FollowLeader` stream open to the leader it
//!   follows ([`follow_leader_loop`]); the leader answers once and keeps it
//!   open while it leads ([`leader_present`]);
//! - when the stream breaks, the follower connects to the leader's address:
//!   refused means nothing listens there any more, so the process is gone
//!   (a network fault or a frozen process times out instead, and is left to
//!   the election timeout as before);
//! - then every follower that saw it stands at once, which also gives up
//!   its vote for the lost leader (openraft refuses votes while that vote
//!   is committed and its lease runs); the first surviving voter by id
//!   stands once more a heartbeat later, in a term the others' first
//!   attempts have made them accept ([`stands_again`]). Otherwise the
//!   usual timeouts finish the election, as before.
//!
//! Absences: nothing here decides who leads (the election is Raft's, and
//! safe whenever it is held); no election is started while a leader is
//! heard, nor by a replica whose clock the cluster refuses
//! ([`crate::clock`]); a peer of the release before (no `FollowLeader`)
//! only costs its followers the timeout.

use std::sync::Arc;
use std::time::Duration;

use futures::{Stream, StreamExt};
use keel_proto::raft::raft_client::RaftClient;
use keel_proto::raft::{FollowLeaderRequest, LeaderPresent};
use openraft::ServerState;
use tokio::sync::watch;
use tonic::{Code, Request, Status};

use crate::membership;
use crate::raft_node::{Raft, RaftNode};

/// Followers a leader serves `FollowLeader` streams to at once (a cluster
/// has a handful of voters; more streams than this are refused).
pub const MAX_FOLLOWERS: usize = 16;

/// How long a follower waits for the leader to answer `FollowLeader`, or
/// for a connection to its address when the stream broke.
const CONNECT_TIMEOUT: Duration = Duration::from_millis(500);

/// How long a follower waits before asking again when the leader refused
/// or did not answer the stream.
const RETRY_AFTER: Duration = Duration::from_millis(200);

/// The stream a leader answers `FollowLeader` with.
pub type LeaderStream = std::pin::Pin<Box<dyn Stream<Item = Result<LeaderPresent, Status>> + Send>>;

/// The leader's side: one `LeaderPresent` now, then the stream stays open
/// until this replica (`me`) stops leading in its current term or the
/// server begins to close (`closing`). Refused when it does not lead.
pub fn leader_present(
    raft: &Raft,
    me: u64,
    closing: watch::Receiver<bool>,
    permit: tokio::sync::OwnedSemaphorePermit,
) -> Result<LeaderStream, Status> {
    if *closing.borrow() {
        return Err(Status::unavailable("this replica is shutting down"));
    }
    let mut metrics = raft.server_metrics();
    let term = {
        let m = metrics.borrow_and_update();
        if m.state != ServerState::Leader || m.current_leader != Some(me) {
            return Err(Status::failed_precondition(format!(
                "replica {} is not the leader",
                membership::show(me)
            )));
        }
        m.vote.leader_id().term
    };
    let first = futures::stream::once(async move { Ok(LeaderPresent { term }) });
    let end = futures::stream::once(async move {
        let mut closing = closing;
        loop {
            let leading = {
                let m = metrics.borrow_and_update();
                m.state == ServerState::Leader && m.vote.leader_id().term == term
            };
            if !leading || *closing.borrow_and_update() {
                break;
            }
            tokio::select! {
                changed = metrics.changed() => if changed.is_err() { break },
                changed = closing.changed() => if changed.is_err() { break },
            }
        }
        drop(permit);
        None
    })
    .filter_map(|end: Option<Result<LeaderPresent, Status>>| async move { end });
    Ok(Box::pin(first.chain(end)))
}

/// Whether `me` stands a second time after leader `lost` is gone: the
/// first of the surviving voters by id does (one of them, so two second
/// attempts do not split the vote again).
pub fn stands_again(me: u64, lost: u64, voters: impl IntoIterator<Item = u64>) -> bool {
    voters.into_iter().filter(|v| *v != lost).min() == Some(me)
}

/// The leader this replica follows: its Raft id, term and address, when
/// this replica is a follower and knows one other than itself.
fn followed(raft: &Raft) -> Option<(u64, u64, String)> {
    let m = raft.server_metrics();
    let m = m.borrow();
    let leader = m.current_leader?;
    if m.state != ServerState::Follower || leader == m.id {
        return None;
    }
    let addr = m
        .membership_config
        .membership()
        .get_node(&leader)?
        .addr
        .clone();
    Some((leader, m.vote.leader_id().term, addr))
}

/// How a follow of the leader ended.
#[derive(Debug, PartialEq, Eq)]
enum FollowEnded {
    /// The leader or the term changed, or the leader ended the stream
    /// (stepping down, closing): nothing to do.
    Changed,
    /// The leader does not serve the stream (a release before it): wait
    /// for the next leader.
    Unsupported,
    /// Could not be opened: try again shortly.
    NotOpened,
    /// Opened, then broke.
    Broke,
}

/// A follower's side: while this replica follows a leader, holds a
/// `FollowLeader` stream open to it; when the stream breaks and the
/// leader's address refuses connections, stands for election at once.
pub async fn follow_leader_loop(node: Arc<RaftNode>, mut stop: watch::Receiver<bool>) {
    let mut server = node.raft.server_metrics();
    let mut skip: Option<(u64, u64)> = None;
    loop {
        let Some((leader, term, addr)) =
            followed(&node.raft).filter(|(l, t, _)| skip != Some((*l, *t)))
        else {
            tokio::select! {
                _ = stop.changed() => return,
                changed = server.changed() => if changed.is_err() { return },
            }
            continue;
        };
        let ended = tokio::select! {
            _ = stop.changed() => return,
            ended = follow(&node, leader, term, &addr) => ended,
        };
        tracing::debug!(leader = %membership::show(leader), ?ended, "following the leader ended");
        match ended {
            FollowEnded::Changed => {}
            FollowEnded::Unsupported => {
                tracing::info!(
                    leader = %membership::show(leader),
                    "the leader does not serve FollowLeader (an older release): its loss is found by the election timeout"
                );
                skip = Some((leader, term));
            }
            FollowEnded::NotOpened => {
                tokio::select! {
                    _ = stop.changed() => return,
                    _ = tokio::time::sleep(RETRY_AFTER) => {}
                }
            }
            FollowEnded::Broke => {
                if followed(&node.raft).map(|(l, t, _)| (l, t)) != Some((leader, term)) {
                    continue;
                }
                if !refuses_connections(&addr, node.peer_source_ip).await {
                    // Something still listens there (a network fault, a
                    // restart already done): the timeout decides.
                    tracing::debug!(leader = %membership::show(leader), "the leader's address still accepts connections");
                    continue;
                }
                if node.clock.status(false).refused.is_some() {
                    continue;
                }
                stand(&node, leader, &addr).await;
            }
        }
    }
}

/// Opens the stream to `leader` and waits until it ends or the leader or
/// term this replica follows changes.
async fn follow(node: &RaftNode, leader: u64, term: u64, addr: &str) -> FollowEnded {
    let mut stream = match open(node, leader, addr).await {
        Ok(stream) => stream,
        Err(status) if status.code() == Code::Unimplemented => return FollowEnded::Unsupported,
        Err(status) => {
            tracing::debug!(leader = %membership::show(leader), error = %status, "FollowLeader not opened");
            return FollowEnded::NotOpened;
        }
    };
    tracing::info!(
        leader = %membership::show(leader),
        %addr,
        term,
        "following the leader's process (its end is seen at once)"
    );
    let mut server = node.raft.server_metrics();
    loop {
        tokio::select! {
            message = stream.message() => match message {
                Ok(Some(_)) => {}
                Ok(None) => return FollowEnded::Changed,
                Err(_) => return FollowEnded::Broke,
            },
            changed = server.changed() => {
                if changed.is_err() {
                    return FollowEnded::Changed;
                }
                let now = followed(&node.raft).map(|(l, t, _)| (l, t));
                if now != Some((leader, term)) {
                    return FollowEnded::Changed;
                }
            }
        }
    }
}

/// Calls `FollowLeader` on `leader` at `addr` and waits for its first
/// answer.
async fn open(
    node: &RaftNode,
    leader: u64,
    addr: &str,
) -> Result<tonic::Streaming<LeaderPresent>, Status> {
    let unavailable = |e: &dyn std::fmt::Display| Status::unavailable(e.to_string());
    let endpoint = node
        .transport
        .endpoint(addr)
        .map_err(|e| unavailable(&e))?
        .connect_timeout(CONNECT_TIMEOUT)
        .tcp_nodelay(true);
    let channel = node
        .transport
        .lazy(
            endpoint,
            crate::transport::Peer::Member(membership::member_of(leader)),
            node.peer_source_ip,
        )
        .map_err(|e| unavailable(&e))?;
    let mut request = Request::new(FollowLeaderRequest { follower: node.id });
    crate::raft_network::address(&mut request, &node.identity, leader);
    let opening = async {
        let mut stream = RaftClient::new(channel)
            .follow_leader(request)
            .await?
            .into_inner();
        match stream.message().await? {
            Some(_) => Ok(stream),
            None => Err(Status::unavailable("the leader ended the stream at once")),
        }
    };
    tokio::time::timeout(CONNECT_TIMEOUT, opening)
        .await
        .map_err(|_| Status::unavailable("no answer"))?
}

/// Whether `addr` refuses connections within [`PROBE_FOR`]: nothing
/// listens there any more. Asked again every [`PROBE_EVERY`], because a
/// process being killed breaks its connections a moment before it stops
/// listening (a connection made then is accepted, then reset).
async fn refuses_connections(addr: &str, source_ip: Option<std::net::IpAddr>) -> bool {
    let started = tokio::time::Instant::now();
    loop {
        if refused_now(addr, source_ip).await {
            return true;
        }
        if started.elapsed() >= PROBE_FOR {
            return false;
        }
        tokio::time::sleep(PROBE_EVERY).await;
    }
}

/// How long [`refuses_connections`] asks, and how often.
const PROBE_FOR: Duration = Duration::from_millis(250);
const PROBE_EVERY: Duration = Duration::from_millis(10);

/// Whether a connection to `addr` is refused now.
async fn refused_now(addr: &str, source_ip: Option<std::net::IpAddr>) -> bool {
    let connect = async {
        let target = tokio::net::lookup_host(addr)
            .await?
            .next()
            .ok_or_else(|| std::io::Error::other("no address"))?;
        let socket = if target.is_ipv4() {
            tokio::net::TcpSocket::new_v4()?
        } else {
            tokio::net::TcpSocket::new_v6()?
        };
        if let Some(ip) = source_ip {
            socket.bind(std::net::SocketAddr::new(ip, 0))?;
        }
        socket.connect(target).await.map(drop)
    };
    matches!(
        tokio::time::timeout(CONNECT_TIMEOUT, connect).await,
        Ok(Err(e)) if e.kind() == std::io::ErrorKind::ConnectionRefused
    )
}

/// Stands for election after leader `lost` (at `addr`) is gone: once now,
/// and, for the first surviving voter, once more a heartbeat later if no
/// other leader has been heard by then.
async fn stand(node: &RaftNode, lost: u64, addr: &str) {
    tracing::info!(
        leader = %membership::show(lost),
        %addr,
        "the leader's process is gone (its stream broke and its address refuses connections): standing for election now"
    );
    node.metrics.leader_lost_elections.inc();
    if node.raft.trigger().elect().await.is_err() {
        return;
    }
    let voters: Vec<u64> = {
        let m = node.raft.server_metrics();
        let m = m.borrow();
        m.membership_config.membership().voter_ids().collect()
    };
    if !stands_again(node.id, lost, voters) {
        return;
    }
    tokio::time::sleep(Duration::from_millis(node.raft.config().heartbeat_interval)).await;
    let heard = {
        let m = node.raft.server_metrics();
        let m = m.borrow();
        m.state == ServerState::Leader || m.current_leader.is_some_and(|l| l != lost)
    };
    if !heard {
        let _ = node.raft.trigger().elect().await;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn only_the_first_surviving_voter_stands_twice() {
        assert!(stands_again(2, 1, [1, 2, 3]));
        assert!(!stands_again(3, 1, [1, 2, 3]));
        assert!(stands_again(1, 3, [1, 2, 3]));
        assert!(!stands_again(2, 3, [1, 2, 3]));
        assert!(!stands_again(4, 1, [1, 2, 3]), "not a voter");
    }

    /// Golden bytes (issue 21's rule for every Raft message): the
    /// `FollowLeader` request and answer as first written must decode the
    /// same in every later version. Written once with `KEEL_WRITE_GOLDEN=1`,
    /// then committed.
    #[test]
    fn follow_leader_messages_decode_from_their_golden_bytes() {
        use prost::Message;
        let request = FollowLeaderRequest {
            follower: membership::raft_id(2, 0x5538_cddb_ef8c),
        };
        let answer = LeaderPresent { term: 7 };
        let dir = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/golden");
        let golden = |name: &str, fresh: Vec<u8>| -> Vec<u8> {
            let path = dir.join(name);
            if !path.exists() {
                assert!(
                    std::env::var_os("KEEL_WRITE_GOLDEN").is_some(),
                    "no golden file {}: run once with KEEL_WRITE_GOLDEN=1 and commit it",
                    path.display()
                );
                std::fs::write(&path, fresh).expect("write golden");
            }
            std::fs::read(&path).expect("read golden")
        };
        let bytes = golden("raft-follow_leader.bin", request.encode_to_vec());
        assert_eq!(
            FollowLeaderRequest::decode(bytes.as_slice()).expect("decodes"),
            request
        );
        let bytes = golden("raft-leader_present.bin", answer.encode_to_vec());
        assert_eq!(
            LeaderPresent::decode(bytes.as_slice()).expect("decodes"),
            answer
        );
    }
}
