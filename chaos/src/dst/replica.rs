//! A simulated replica: openraft with Keel's configuration, Keel's state
//! machine store (`ClusterState` on sled, in a temporary directory), the
//! in-memory log on its simulated disk, and the simulated network. A crash
//! stops it without a flush and loses what its disk had not made durable;
//! a restart reopens the same state directory and disk.

use std::collections::{BTreeMap, BTreeSet};
use std::path::PathBuf;
use std::sync::{Arc, Mutex, MutexGuard};

use keel_storage::{SharedState, StateMachineStore};
use openraft::ServerState;
use tokio::task::JoinHandle;

use super::log_store::{SimDisk, SimLogStore};
use super::net::{Net, Raft, SimNetwork};
use super::DstError;

/// The leaders seen: leader id (term, node) → the incarnations (starts) of
/// that node that led with it, from every replica's metrics at every
/// change. openraft (in its default mode, which Keel runs) lets several
/// candidates win one term, told apart by node id (its log ids carry the
/// whole leader id, and votes are ordered by it), and a replica that
/// restarts with a committed vote of its own resumes leading under the same
/// id. Both are by design; what must hold is log matching (`run`).
#[derive(Debug, Default, Clone)]
pub struct Leaders(Arc<Mutex<LeadersById>>);

/// Leader id (term, node) → the starts of that node that led under it.
pub type LeadersById = BTreeMap<(u64, u64), BTreeSet<u32>>;

impl Leaders {
    fn lock(&self) -> MutexGuard<'_, LeadersById> {
        self.0.lock().unwrap_or_else(|p| p.into_inner())
    }

    fn saw(&self, term: u64, leader: u64, incarnation: u32) -> bool {
        self.lock()
            .entry((term, leader))
            .or_default()
            .insert(incarnation)
    }

    pub fn by_leader_id(&self) -> LeadersById {
        self.lock().clone()
    }
}

/// What happened, in virtual time: the run's trace, hashed into its
/// digest (the same seed must give the same trace).
#[derive(Debug, Clone)]
pub struct Trace {
    start: tokio::time::Instant,
    lines: Arc<Mutex<Vec<String>>>,
}

impl Trace {
    pub fn new() -> Trace {
        Trace {
            start: tokio::time::Instant::now(),
            lines: Arc::default(),
        }
    }

    /// Virtual milliseconds since the run began.
    pub fn now_ms(&self) -> u64 {
        u64::try_from(self.start.elapsed().as_millis()).unwrap_or(u64::MAX)
    }

    pub fn note(&self, what: impl std::fmt::Display) {
        let line = format!("{} {what}", self.now_ms());
        self.lines
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .push(line);
    }

    pub fn lines(&self) -> Vec<String> {
        self.lines.lock().unwrap_or_else(|p| p.into_inner()).clone()
    }
}

impl Default for Trace {
    fn default() -> Self {
        Trace::new()
    }
}

struct Running {
    raft: Raft,
    state_machine: StateMachineStore,
    flusher: JoinHandle<()>,
    watcher: JoinHandle<()>,
}

/// One replica, running or down.
pub struct Replica {
    /// Its member id.
    pub id: u64,
    /// Its Raft id: the member id and the incarnation of its disk (a new
    /// one after each wipe, drawn from `incarnations`).
    pub raft_id: u64,
    incarnations: keel_state::fixtures::SplitMix64,
    pub disk: SimDisk,
    pub state_dir: PathBuf,
    running: Option<Running>,
    /// Starts so far (this incarnation's number).
    starts: u32,
}

impl std::fmt::Debug for Replica {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Replica")
            .field("id", &self.id)
            .field("running", &self.running.is_some())
            .finish_non_exhaustive()
    }
}

impl Replica {
    /// `lying_disk`: see [`super::DstConfig`].
    pub fn new(id: u64, state_dir: PathBuf, disk_seed: u64, lying_disk: bool) -> Replica {
        let mut incarnations = keel_state::fixtures::SplitMix64::new(disk_seed ^ 0x1ca7);
        Replica {
            id,
            raft_id: keel::membership::raft_id(id, 1 + incarnations.below(1 << 40)),
            incarnations,
            disk: SimDisk::new(disk_seed, lying_disk),
            state_dir,
            running: None,
            starts: 0,
        }
    }

    pub fn is_running(&self) -> bool {
        self.running.is_some()
    }

    pub fn raft(&self) -> Option<Raft> {
        self.running.as_ref().map(|r| r.raft.clone())
    }

    pub fn shared(&self) -> Option<Arc<SharedState>> {
        self.running.as_ref().map(|r| r.state_machine.shared())
    }

    /// Starts the replica on its state directory and disk (recovering
    /// whatever they hold) and puts it on the network.
    pub async fn start(
        &mut self,
        net: &Arc<Net>,
        config: &Arc<openraft::Config>,
        leaders: &Leaders,
        trace: &Trace,
    ) -> Result<(), DstError> {
        if self.running.is_some() {
            return Ok(());
        }
        let mut state_machine = StateMachineStore::open(&self.state_dir)?;
        // On the one simulated thread: a build on Tokio's blocking pool
        // would finish at a moment real time decides, not the seed.
        state_machine.build_snapshots_inline();
        let (log, flusher) = SimLogStore::open(self.disk.clone());
        let epoch = net.begin(self.id);
        // A new process: its log clock has heard nothing.
        net.clocks.restarted(self.id);
        let strangers = keel::membership::Strangers::default();
        let raft = Raft::new(
            self.raft_id,
            config.clone(),
            SimNetwork {
                net: net.clone(),
                from: self.id,
                epoch,
                strangers: strangers.clone(),
            },
            log,
            state_machine.clone(),
        )
        .await
        .map_err(|e| DstError::Raft(format!("replica {}: {e}", self.id)))?;
        // A clock too far ahead of the voters' does not stand for election
        // (the server's `clock_watch_loop`, told by its leader).
        let voters = super::clocks::voters_of(&raft);
        if !net.clocks.may_lead(self.id, &voters) {
            raft.runtime_config().elect(false);
            trace.note(format_args!(
                "replica {} does not stand for election: its clock is {} ms ahead",
                self.id,
                net.clocks.ahead_of_middle_ms(self.id, &voters)
            ));
        }
        self.starts += 1;
        let mut metrics = raft.metrics();
        let (id, incarnation, leaders, trace) =
            (self.id, self.starts, leaders.clone(), trace.clone());
        let watcher = tokio::spawn(async move {
            loop {
                let (state, term, vote, last_log) = {
                    let m = metrics.borrow_and_update();
                    (m.state, m.current_term, m.vote, m.last_log_index)
                };
                if state == ServerState::Leader && leaders.saw(term, id, incarnation) {
                    trace.note(format_args!(
                        "leader {id} term {term} (start {incarnation}, vote {vote}, last log {last_log:?})"
                    ));
                }
                if metrics.changed().await.is_err() {
                    break;
                }
            }
        });
        net.join(
            self.id,
            self.raft_id,
            raft.clone(),
            state_machine.shared(),
            strangers.clone(),
        );
        self.running = Some(Running {
            raft,
            state_machine,
            flusher,
            watcher,
        });
        Ok(())
    }

    /// A crash: off the network at once, Raft stopped, the disk's pending
    /// flushes abandoned and what they covered lost. The state machine's
    /// sled store is closed (it may have journaled less than it applied:
    /// openraft re-applies the rest from the log on restart).
    pub async fn crash(&mut self, net: &Net, trace: &Trace) {
        let Some(running) = self.running.take() else {
            return;
        };
        // The process is gone at once: it sends nothing more, and its disk
        // keeps only what was durable, whatever its tasks still do while
        // they are torn down.
        net.leave(self.id);
        running.flusher.abort();
        let mut lost = self.disk.crash();
        let _ = running.raft.shutdown().await;
        running.watcher.abort();
        lost += self.disk.crash();
        trace.note(format_args!(
            "replica {} crashed, {lost} unflushed entries lost",
            self.id
        ));
        drop(running.state_machine);
        drop(running.raft);
        settle().await;
    }

    /// A lost disk: the replica crashes, and its log, vote and state
    /// directory are gone; it starts again empty (at its next `start`).
    pub async fn wipe(&mut self, net: &Net, trace: &Trace) -> Result<(), DstError> {
        self.crash(net, trace).await;
        self.disk.wipe();
        self.raft_id = keel::membership::raft_id(self.id, 1 + self.incarnations.below(1 << 40));
        match std::fs::remove_dir_all(&self.state_dir) {
            Ok(()) => {}
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
            Err(e) => return Err(DstError::Setup(format!("wiping replica {}: {e}", self.id))),
        }
        trace.note(format_args!(
            "replica {} lost its disk; it comes back as {}",
            self.id,
            keel::membership::show(self.raft_id)
        ));
        Ok(())
    }

    /// A clean stop: Raft stopped and the state machine flushed, so the
    /// state directory can be replayed offline.
    pub async fn stop(&mut self, net: &Net) -> Result<(), DstError> {
        let Some(running) = self.running.take() else {
            return Ok(());
        };
        net.leave(self.id);
        let _ = running.raft.shutdown().await;
        running.state_machine.flush()?;
        running.flusher.abort();
        running.watcher.abort();
        drop(running.state_machine);
        drop(running.raft);
        settle().await;
        Ok(())
    }
}

/// Lets the stopped replica's tasks finish (and drop their handles on its
/// sled store) before anything reopens it.
async fn settle() {
    for _ in 0..64 {
        tokio::task::yield_now().await;
    }
    tokio::time::sleep(std::time::Duration::from_millis(1)).await;
}
