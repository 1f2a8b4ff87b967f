//! The simulated network between the replicas.
//!
//! Every Raft message goes through [`Net`]: it takes a seeded 0.2–10 ms each
//! way, is lost while its directed link is cut or with the run's loss rate
//! (the sender then times out, as on a real network), is refused at once
//! if the target is down, and is otherwise handed to the target's `Raft`
//! after a round trip through Raft wire format 2 (protobuf,
//! `keel_storage::raft_wire`), the encoding Keel's gRPC transport carries
//! between replicas of this release. Replies travel back the same way.

use std::collections::{BTreeMap, BTreeSet};
use std::future::Future;
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::Duration;

use keel::membership::{member_of, Strangers};
use keel_state::fixtures::SplitMix64;
use keel_storage::raft_wire::{WireMessage, RAFT_WIRE_FORMAT};
use keel_storage::{SharedState, TypeConfig};
use openraft::error::{
    InstallSnapshotError, NetworkError, RPCError, RaftError, RemoteError, Timeout, Unreachable,
};
use openraft::network::{RPCOption, RaftNetwork, RaftNetworkFactory};
use openraft::raft::{
    AppendEntriesRequest, AppendEntriesResponse, InstallSnapshotRequest, InstallSnapshotResponse,
    VoteRequest, VoteResponse,
};
use openraft::{BasicNode, RPCTypes};

/// openraft's handle on a replica, for this type config.
pub type Raft = openraft::Raft<TypeConfig>;

/// A running replica on the network.
#[derive(Clone)]
struct Member {
    /// Its Raft id (member id and incarnation): messages for another
    /// incarnation of the member are refused.
    raft_id: u64,
    raft: Raft,
    state: Arc<SharedState>,
    strangers: Strangers,
}

struct NetState {
    /// The running replicas by member id.
    rafts: BTreeMap<u64, Member>,
    /// Each replica's incarnation: a message is sent only by the current
    /// one (a crashed process sends nothing more; what it sent before may
    /// still arrive).
    epochs: BTreeMap<u64, u64>,
    /// Directed links that drop everything.
    cut: BTreeSet<(u64, u64)>,
    /// Messages lost at random, per thousand.
    loss_per_mille: u64,
    rng: SplitMix64,
    delivered: u64,
    lost: u64,
}

impl NetState {
    /// One message from `from` to `to`: its seeded delay, or `None` if the
    /// link is cut or the draw loses it.
    fn transmit(&mut self, from: u64, to: u64) -> Option<Duration> {
        let delay = Duration::from_micros(200 + self.rng.below(9_800));
        let dropped = self.loss_per_mille > 0 && self.rng.below(1000) < self.loss_per_mille;
        if dropped || self.cut.contains(&(from, to)) {
            self.lost += 1;
            None
        } else {
            self.delivered += 1;
            Some(delay)
        }
    }
}

/// The network: which replicas run, which links are cut, and the seeded
/// draws of delay and loss.
pub struct Net {
    state: Mutex<NetState>,
    /// Every replica's clocks (skewed, drifting; their log clocks).
    pub clocks: super::clocks::Clocks,
}

impl std::fmt::Debug for Net {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let s = self.lock();
        f.debug_struct("Net")
            .field("running", &s.rafts.keys().collect::<Vec<_>>())
            .field("cut", &s.cut)
            .field("loss_per_mille", &s.loss_per_mille)
            .finish_non_exhaustive()
    }
}

impl Net {
    pub fn new(seed: u64) -> Arc<Net> {
        Arc::new(Net {
            state: Mutex::new(NetState {
                rafts: BTreeMap::new(),
                epochs: BTreeMap::new(),
                cut: BTreeSet::new(),
                loss_per_mille: 0,
                rng: SplitMix64::new(seed),
                delivered: 0,
                lost: 0,
            }),
            clocks: super::clocks::Clocks::new(seed),
        })
    }

    fn lock(&self) -> MutexGuard<'_, NetState> {
        self.state.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// A new incarnation of replica `id` is starting: its number, for its
    /// [`SimNetwork`].
    pub fn begin(&self, id: u64) -> u64 {
        let mut s = self.lock();
        let epoch = s.epochs.entry(id).or_insert(0);
        *epoch += 1;
        *epoch
    }

    /// Replica `id`'s current incarnation (0 before it first started).
    pub fn incarnation(&self, id: u64) -> u64 {
        self.lock().epochs.get(&id).copied().unwrap_or(0)
    }

    /// Replica `id` runs and answers, as Raft id `raft_id`; what its
    /// network learns of other incarnations goes to `strangers`.
    pub fn join(
        &self,
        id: u64,
        raft_id: u64,
        raft: Raft,
        state: Arc<SharedState>,
        strangers: Strangers,
    ) {
        self.lock().rafts.insert(
            id,
            Member {
                raft_id,
                raft,
                state,
                strangers,
            },
        );
    }

    /// Replica `id` is down: messages to it are refused.
    pub fn leave(&self, id: u64) {
        self.lock().rafts.remove(&id);
    }

    /// The running replica `id`.
    pub fn raft(&self, id: u64) -> Option<Raft> {
        self.lock().rafts.get(&id).map(|m| m.raft.clone())
    }

    /// The running replica `id`'s record of other members' incarnations.
    pub fn strangers(&self, id: u64) -> Option<Strangers> {
        self.lock().rafts.get(&id).map(|m| m.strangers.clone())
    }

    /// The running replica of member `member_of(raft_id)`: its Raft if it
    /// is that incarnation, else the Raft id it is.
    fn addressed(&self, raft_id: u64) -> Option<Result<Raft, u64>> {
        self.lock().rafts.get(&member_of(raft_id)).map(|m| {
            if m.raft_id == raft_id {
                Ok(m.raft.clone())
            } else {
                Err(m.raft_id)
            }
        })
    }

    /// The running replica `id`'s applied state.
    pub fn shared(&self, id: u64) -> Option<Arc<SharedState>> {
        self.lock().rafts.get(&id).map(|m| m.state.clone())
    }

    /// The replicas that run.
    pub fn running(&self) -> Vec<u64> {
        self.lock().rafts.keys().copied().collect()
    }

    /// Drops everything from `from` to `to`.
    pub fn cut(&self, from: u64, to: u64) {
        self.lock().cut.insert((from, to));
    }

    /// Cuts every link between the two groups, both ways.
    pub fn partition(&self, a: &[u64], b: &[u64]) {
        let mut s = self.lock();
        for x in a {
            for y in b {
                s.cut.insert((*x, *y));
                s.cut.insert((*y, *x));
            }
        }
    }

    pub fn set_loss_per_mille(&self, per_mille: u64) {
        self.lock().loss_per_mille = per_mille;
    }

    /// Every link up, no random loss.
    pub fn heal(&self) {
        let mut s = self.lock();
        s.cut.clear();
        s.loss_per_mille = 0;
    }

    /// (delivered, lost) messages so far.
    pub fn counts(&self) -> (u64, u64) {
        let s = self.lock();
        (s.delivered, s.lost)
    }

    /// A message leaves incarnation `epoch` of `from` for `to`: its delay,
    /// or `None` if it is lost (or its sender is no longer running).
    fn send(&self, from: u64, epoch: u64, to: u64) -> Option<Duration> {
        let mut s = self.lock();
        if !s.rafts.contains_key(&from) || s.epochs.get(&from) != Some(&epoch) {
            return None;
        }
        s.transmit(from, to)
    }

    /// A reply leaves `from` for `to`: its delay, or `None` if it is lost.
    fn reply(&self, from: u64, to: u64) -> Option<Duration> {
        self.lock().transmit(from, to)
    }

    /// Whether the link from `from` to `to` is up now.
    fn link_up(&self, from: u64, to: u64) -> bool {
        !self.lock().cut.contains(&(from, to))
    }
}

/// Makes a [`SimPeer`] for each peer a replica replicates to.
#[derive(Debug, Clone)]
pub struct SimNetwork {
    pub net: Arc<Net>,
    /// The sender's member id.
    pub from: u64,
    /// The start of `from` ([`Net::begin`]).
    pub epoch: u64,
    /// Where peers that answer as another incarnation are kept.
    pub strangers: Strangers,
}

impl RaftNetworkFactory<TypeConfig> for SimNetwork {
    type Network = SimPeer;

    async fn new_client(&mut self, target: u64, _node: &BasicNode) -> SimPeer {
        SimPeer {
            net: self.net.clone(),
            from: self.from,
            epoch: self.epoch,
            to: member_of(target),
            target,
            strangers: self.strangers.clone(),
        }
    }
}

/// The link from one replica to another.
#[derive(Debug)]
pub struct SimPeer {
    net: Arc<Net>,
    /// Member ids.
    from: u64,
    epoch: u64,
    to: u64,
    /// The Raft id messages are for.
    target: u64,
    strangers: Strangers,
}

/// A value as the other side decodes it.
fn wire<T: WireMessage>(value: &T) -> Result<T, String> {
    let bytes = value.encode(RAFT_WIRE_FORMAT).map_err(|e| e.to_string())?;
    T::decode(&bytes, RAFT_WIRE_FORMAT).map_err(|e| e.to_string())
}

impl SimPeer {
    async fn call<Req, Resp, E, F, Fut>(
        &mut self,
        action: RPCTypes,
        request: Req,
        option: &RPCOption,
        deliver: F,
    ) -> Result<Resp, RPCError<u64, BasicNode, E>>
    where
        Req: WireMessage,
        Result<Resp, E>: WireMessage,
        E: std::error::Error,
        F: FnOnce(Raft, Req) -> Fut,
        Fut: Future<Output = Result<Resp, E>>,
    {
        let ttl = option.hard_ttl();
        let timeout = || {
            RPCError::Timeout(Timeout {
                action,
                id: self.from,
                target: self.target,
                timeout: ttl,
            })
        };
        let broken = |e: String| RPCError::Network(NetworkError::new(&std::io::Error::other(e)));
        let started = tokio::time::Instant::now();
        let Some(delay) = self.net.send(self.from, self.epoch, self.to) else {
            tokio::time::sleep(ttl).await;
            return Err(timeout());
        };
        tokio::time::sleep(delay).await;
        if !self.net.link_up(self.from, self.to) {
            tokio::time::sleep(ttl.saturating_sub(started.elapsed())).await;
            return Err(timeout());
        }
        let raft = match self.net.addressed(self.target) {
            None => {
                return Err(RPCError::Unreachable(Unreachable::new(
                    &std::io::Error::other("connection refused"),
                )))
            }
            // Another incarnation answers (as `raft_network` refuses): the
            // refusal travels back and names it.
            Some(Err(found)) => {
                if let Some(back) = self.net.reply(self.to, self.from) {
                    tokio::time::sleep(back).await;
                    if self.net.link_up(self.to, self.from) {
                        self.strangers.saw(self.target, found);
                    }
                }
                return Err(RPCError::Unreachable(Unreachable::new(
                    &std::io::Error::other("another incarnation of the member"),
                )));
            }
            Some(Ok(raft)) => raft,
        };
        let request = wire(&request).map_err(broken)?;
        let left = ttl.saturating_sub(started.elapsed());
        let Ok(result) = tokio::time::timeout(left, deliver(raft, request)).await else {
            return Err(timeout());
        };
        // Every reply carries the log time its sender carries (as
        // `raft_network`'s do), so a replica fresh from a restart learns it.
        let told_ms = self.net.clocks.told_ms(self.to);
        let Some(back) = self.net.reply(self.to, self.from) else {
            tokio::time::sleep(ttl.saturating_sub(started.elapsed())).await;
            return Err(timeout());
        };
        tokio::time::sleep(back).await;
        if !self.net.link_up(self.to, self.from) {
            tokio::time::sleep(ttl.saturating_sub(started.elapsed())).await;
            return Err(timeout());
        }
        let result = wire(&result).map_err(broken)?;
        self.net.clocks.heard(self.from, told_ms);
        self.strangers.answered(self.target);
        result.map_err(|e| RPCError::RemoteError(RemoteError::new(self.target, e)))
    }
}

impl RaftNetwork<TypeConfig> for SimPeer {
    async fn append_entries(
        &mut self,
        rpc: AppendEntriesRequest<TypeConfig>,
        option: RPCOption,
    ) -> Result<AppendEntriesResponse<u64>, RPCError<u64, BasicNode, RaftError<u64>>> {
        // The leader's log time travels with the message; a follower that
        // accepts it carries it on (as `raft_network` does).
        let log_ms = self.net.clocks.told_ms(self.from);
        let (net, to) = (self.net.clone(), self.to);
        self.call(
            RPCTypes::AppendEntries,
            rpc,
            &option,
            |raft, r| async move {
                let result = raft.append_entries(r).await;
                if matches!(
                    result,
                    Ok(AppendEntriesResponse::Success
                        | AppendEntriesResponse::PartialSuccess(_)
                        | AppendEntriesResponse::Conflict)
                ) {
                    net.clocks.heard(to, log_ms);
                }
                result
            },
        )
        .await
    }

    async fn install_snapshot(
        &mut self,
        rpc: InstallSnapshotRequest<TypeConfig>,
        option: RPCOption,
    ) -> Result<
        InstallSnapshotResponse<u64>,
        RPCError<u64, BasicNode, RaftError<u64, InstallSnapshotError>>,
    > {
        self.call(
            RPCTypes::InstallSnapshot,
            rpc,
            &option,
            |raft, r| async move { raft.install_snapshot(r).await },
        )
        .await
    }

    async fn vote(
        &mut self,
        rpc: VoteRequest<u64>,
        option: RPCOption,
    ) -> Result<VoteResponse<u64>, RPCError<u64, BasicNode, RaftError<u64>>> {
        self.call(RPCTypes::Vote, rpc, &option, |raft, r| async move {
            raft.vote(r).await
        })
        .await
    }
}
