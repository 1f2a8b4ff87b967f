//! This replica's clocks: log time for the entries it stamps, and how far
//! its wall clock is from its peers'.
//!
//! - **Log time** ([`keel_state::log_time::LogClock`]): the proposer stamps
//!   with [`ServerClock::stamp`], the leader's loops measure durations with
//!   [`ServerClock::now_ms`], a follower carries the log time its leader's
//!   heartbeats say ([`ServerClock::heard_leader`]).
//! - **Offsets**: every Raft message carries its sender's wall clock and
//!   every reply the replier's, so the leader measures each peer's offset
//!   (the NTP estimate: the reply's clock against the middle of the round
//!   trip) and tells each follower how far it is from the middle (the
//!   median) of the cluster's clocks. A replica whose clock is ahead of the
//!   middle by more than `max_offset_ms` does not lead: a leader steps down
//!   (it stops heartbeats and proposes nothing), a follower stops standing
//!   for election, until its clock is back within the bound
//!   ([`clock_watch_loop`]). Either way it says so, loudly and in
//!   `keel cluster status`. A clock behind the middle is reported too but
//!   harms nothing: log time is carried forward at the local rate.

use std::collections::BTreeMap;
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::{Duration, Instant};

use keel_state::log_time::{median_ms, signed_difference, LogClock};

use crate::api::Clock;

/// A peer's offset reading is used for this long.
const READING_FRESH_MS: u64 = 10_000;
/// What a leader told this replica of its clock is used for this long.
const TOLD_FRESH_MS: u64 = 10_000;
/// How often the watch loop re-checks, and repeats a warning.
const WATCH_INTERVAL: Duration = Duration::from_millis(200);
/// The most watch intervals a leader refused for its clock keeps leading
/// while no other voter has its whole log ([`step_down_now`]): 2 s.
const STEP_DOWN_POSTPONED_MAX: u32 = 10;
const WARN_AGAIN_MS: u64 = 30_000;

/// Why this replica does not lead: its clock is too far ahead.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("this replica's clock is {ahead_ms} ms ahead of the middle of the cluster's clocks (the bound is {max_offset_ms} ms, --max-clock-offset-ms): it does not lead until its clock is fixed")]
pub struct ClockTooFarAhead {
    pub ahead_ms: i64,
    pub max_offset_ms: u64,
}

/// A peer's wall clock against this replica's, as last measured.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct PeerReading {
    /// Its clock minus this replica's.
    offset_ms: i64,
    at_mono_ms: u64,
}

#[derive(Debug)]
struct Inner {
    log: LogClock,
    peers: BTreeMap<u64, PeerReading>,
    /// How far a leader last said this replica's clock is from the middle,
    /// and when.
    told: Option<(i64, u64)>,
    /// Set while this replica does not lead because of its clock.
    refused: Option<ClockTooFarAhead>,
    /// When (monotonic) the refusal began, or this replica last stepped
    /// down under it.
    refused_since_mono_ms: u64,
    /// The voters: only their clocks make the cluster's middle (a learner
    /// catching up does not vote on it). Empty: not known, every peer
    /// counts.
    voters: std::collections::BTreeSet<u64>,
}

/// One replica's clocks. Shared by the proposer, the Raft network, the
/// leader's loops and the API.
pub struct ServerClock {
    wall: Clock,
    origin: Instant,
    max_offset_ms: u64,
    inner: Mutex<Inner>,
}

impl std::fmt::Debug for ServerClock {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ServerClock")
            .field("max_offset_ms", &self.max_offset_ms)
            .finish_non_exhaustive()
    }
}

/// What this replica knows of its own clock.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ClockStatus {
    pub wall_ms: u64,
    pub log_time_ms: u64,
    /// Its clock minus the middle of the cluster's (None: not measured).
    pub offset_ms: Option<i64>,
    pub refused: Option<ClockTooFarAhead>,
}

impl ServerClock {
    /// Clocks over `wall` (Unix milliseconds), with healthy clocks at most
    /// `max_offset_ms` apart.
    pub fn new(wall: Clock, max_offset_ms: u64) -> Arc<ServerClock> {
        Arc::new(ServerClock {
            wall,
            origin: Instant::now(),
            max_offset_ms,
            inner: Mutex::new(Inner {
                log: LogClock::new(max_offset_ms),
                peers: BTreeMap::new(),
                told: None,
                refused: None,
                refused_since_mono_ms: 0,
                voters: Default::default(),
            }),
        })
    }

    fn lock(&self) -> MutexGuard<'_, Inner> {
        self.inner.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// This machine's wall clock, Unix milliseconds.
    pub fn wall_ms(&self) -> u64 {
        (self.wall)()
    }

    /// Milliseconds since this clock was made, on the monotonic clock.
    pub fn mono_ms(&self) -> u64 {
        u64::try_from(self.origin.elapsed().as_millis()).unwrap_or(u64::MAX)
    }

    /// The bound on clock offsets.
    pub fn max_offset_ms(&self) -> u64 {
        self.max_offset_ms
    }

    /// The log's time now, by this replica's reckoning.
    pub fn now_ms(&self) -> u64 {
        let (wall, mono) = (self.wall_ms(), self.mono_ms());
        self.lock().log.now_ms(wall, mono)
    }

    /// Log time as a [`Clock`], for the loops that measure durations.
    pub fn log_time(self: &Arc<Self>) -> Clock {
        let me = self.clone();
        Arc::new(move || me.now_ms())
    }

    /// The time for the next proposal, later than every entry before it;
    /// refused while this replica's clock is too far ahead to lead.
    pub fn stamp(&self) -> Result<u64, ClockTooFarAhead> {
        let (wall, mono) = (self.wall_ms(), self.mono_ms());
        let mut inner = self.lock();
        if let Some(refused) = &inner.refused {
            return Err(refused.clone());
        }
        Ok(inner.log.stamp(wall, mono))
    }

    /// The log time this replica tells its peers
    /// ([`LogClock::told_ms`]; 0: nothing yet).
    pub fn told_ms(&self) -> u64 {
        let mono = self.mono_ms();
        self.lock().log.told_ms(mono).unwrap_or(0)
    }

    /// After catching up as a new leader: carries its own reckoning if it
    /// heard none ([`LogClock::seed`]).
    pub fn seed(&self) {
        let (wall, mono) = (self.wall_ms(), self.mono_ms());
        self.lock().log.seed(wall, mono);
    }

    /// A peer's reply said it carries log time `log_time_ms` (0: nothing),
    /// `round_trip_ms` ago at most: a replica fresh from a restart learns
    /// the log's time before it stamps.
    pub fn heard_peer(&self, log_time_ms: u64, round_trip_ms: u64) {
        if log_time_ms > 0 {
            let mono = self.mono_ms();
            self.lock()
                .log
                .heard(log_time_ms.saturating_add(round_trip_ms / 2), mono);
        }
    }

    /// An entry stamped `at_ms` is in the log.
    pub fn saw_entry(&self, at_ms: u64) {
        self.lock().log.saw_entry(at_ms);
    }

    /// A leader's AppendEntries was accepted: the log's time it said, and
    /// how far it measured this replica's clock from the middle.
    pub fn heard_leader(&self, log_time_ms: u64, offset_ms: Option<i64>) {
        let mono = self.mono_ms();
        let mut inner = self.lock();
        if log_time_ms > 0 {
            inner.log.heard(log_time_ms, mono);
        }
        if let Some(offset) = offset_ms {
            inner.told = Some((offset, mono));
        }
    }

    /// A peer answered a message sent at `sent_wall_ms` (this clock), its
    /// reply saying its clock read `peer_wall_ms`; `round_trip_ms` on the
    /// monotonic clock. A reading whose round trip is longer than the
    /// bound is not taken: the estimate can be off by half the round trip
    /// (a reply read after this process was paused, or a congested link,
    /// would make a healthy clock look far off).
    pub fn peer_answered(
        &self,
        peer: u64,
        sent_wall_ms: u64,
        peer_wall_ms: u64,
        round_trip_ms: u64,
    ) {
        if peer_wall_ms == 0 {
            // A release before clock checks says nothing of its clock.
            return;
        }
        if round_trip_ms > self.max_offset_ms {
            return;
        }
        let middle = sent_wall_ms.saturating_add(round_trip_ms / 2);
        let reading = PeerReading {
            offset_ms: signed_difference(peer_wall_ms, middle),
            at_mono_ms: self.mono_ms(),
        };
        self.lock().peers.insert(peer, reading);
    }

    /// The voters, from the membership this replica knows.
    pub fn set_voters(&self, voters: impl IntoIterator<Item = u64>) {
        self.lock().voters = voters.into_iter().collect();
    }

    /// Takes the voters from Raft's metrics; whether this replica leads.
    pub fn observe(&self, raft: &crate::raft_node::Raft) -> bool {
        let metrics = raft.metrics();
        let m = metrics.borrow();
        self.set_voters(m.membership_config.membership().voter_ids());
        m.current_leader == Some(m.id)
    }

    /// The fresh readings (of voters only, once the voters are known).
    fn fresh_readings(inner: &Inner, mono: u64) -> impl Iterator<Item = (&u64, &PeerReading)> {
        inner
            .peers
            .iter()
            .filter(move |(_, r)| mono.saturating_sub(r.at_mono_ms) <= READING_FRESH_MS)
    }

    /// The offset of the middle of the voters' measured clocks (this
    /// replica's included, at 0) from this replica's clock, over fresh
    /// readings.
    fn middle_ms(inner: &Inner, mono: u64) -> Option<i64> {
        let offsets: Vec<i64> = Self::fresh_readings(inner, mono)
            .filter(|(id, _)| inner.voters.is_empty() || inner.voters.contains(id))
            .map(|(_, r)| r.offset_ms)
            .chain([0])
            .collect();
        if offsets.len() < 2 {
            return None;
        }
        median_ms(offsets)
    }

    /// How far `peer`'s clock is from the middle of the cluster's, as this
    /// replica (leading) measured it; told to the peer in each message.
    pub fn offset_of_peer(&self, peer: u64) -> Option<i64> {
        let mono = self.mono_ms();
        let inner = self.lock();
        let (_, reading) = Self::fresh_readings(&inner, mono).find(|(id, _)| **id == peer)?;
        let middle = Self::middle_ms(&inner, mono)?;
        Some(reading.offset_ms.saturating_sub(middle))
    }

    /// Every peer's offset from the middle, as measured here (leader).
    pub fn peer_offsets(&self) -> BTreeMap<u64, i64> {
        let mono = self.mono_ms();
        let inner = self.lock();
        let Some(middle) = Self::middle_ms(&inner, mono) else {
            return BTreeMap::new();
        };
        Self::fresh_readings(&inner, mono)
            .map(|(id, r)| (*id, r.offset_ms.saturating_sub(middle)))
            .collect()
    }

    /// This replica's clock against the middle of the cluster's: measured
    /// here while leading, else as the leader last said.
    pub fn own_offset_ms(&self, leading: bool) -> Option<i64> {
        let mono = self.mono_ms();
        let inner = self.lock();
        if leading {
            Self::middle_ms(&inner, mono).map(|m| m.saturating_neg())
        } else {
            inner
                .told
                .filter(|(_, at)| mono.saturating_sub(*at) <= TOLD_FRESH_MS)
                .map(|(offset, _)| offset)
        }
    }

    /// Re-checks this replica's clock: refused leadership while it is
    /// ahead of the middle by more than the bound, allowed again once it is
    /// back within it. Returns the refusal now in force.
    pub fn check(&self, leading: bool) -> Option<ClockTooFarAhead> {
        let offset = self.own_offset_ms(leading);
        let mut inner = self.lock();
        let refused = match offset {
            Some(ahead_ms) if ahead_ms > i64::try_from(self.max_offset_ms).unwrap_or(i64::MAX) => {
                Some(ClockTooFarAhead {
                    ahead_ms,
                    max_offset_ms: self.max_offset_ms,
                })
            }
            // Not measured: as it was (a follower keeps what its last
            // leader said until a new one says otherwise).
            None => inner.refused.clone(),
            Some(_) => None,
        };
        if refused.is_some() && inner.refused.is_none() {
            // Only what a leader says from now on lifts it.
            inner.told = None;
            inner.refused_since_mono_ms = self.mono_ms();
        }
        inner.refused = refused.clone();
        refused
    }

    /// Whether this replica, refused for its clock and not leading, stands
    /// for election all the same: no leader has told it anything for
    /// [`TOLD_FRESH_MS`] since the refusal began (or since it last stepped
    /// down). Without a leader nobody can lift the refusal, and this
    /// replica may hold entries no other voter has, so it refuses their
    /// votes: standing is what lets the cluster elect again. It still
    /// stamps nothing ([`ServerClock::stamp`]); if it wins, it measures
    /// the clocks as a leader and steps down again once another voter has
    /// its whole log.
    pub fn stands_though_refused(&self) -> bool {
        self.stands_though_refused_at(self.mono_ms())
    }

    fn stands_though_refused_at(&self, mono: u64) -> bool {
        let inner = self.lock();
        let told_lately = inner
            .told
            .is_some_and(|(_, at)| mono.saturating_sub(at) <= TOLD_FRESH_MS);
        inner.refused.is_some()
            && !told_lately
            && mono.saturating_sub(inner.refused_since_mono_ms) > TOLD_FRESH_MS
    }

    /// This replica stepped down for its clock: it waits [`TOLD_FRESH_MS`]
    /// again before it stands though refused.
    pub fn stepped_down(&self) {
        let mono = self.mono_ms();
        self.lock().refused_since_mono_ms = mono;
    }

    /// What `keel cluster status` shows of this replica's clock.
    pub fn status(&self, leading: bool) -> ClockStatus {
        let offset_ms = self.own_offset_ms(leading);
        ClockStatus {
            wall_ms: self.wall_ms(),
            log_time_ms: self.now_ms(),
            offset_ms,
            refused: self.lock().refused.clone(),
        }
    }
}

/// Whether a leader refused for its clock steps down now: once another
/// voter has its whole log, or after [`STEP_DOWN_POSTPONED_MAX`] intervals
/// regardless. A leader that stepped down with entries no other voter
/// holds would refuse its vote to every candidate (their logs are older)
/// while it does not stand itself: no one could lead until its clock is
/// fixed.
fn step_down_now(another_voter_has_the_whole_log: bool, postponed: u32) -> bool {
    another_voter_has_the_whole_log || postponed >= STEP_DOWN_POSTPONED_MAX
}

/// Whether a voter other than this leader has matched its last log entry.
fn another_voter_has_the_whole_log(raft: &crate::raft_node::Raft) -> bool {
    let metrics = raft.metrics();
    let m = metrics.borrow();
    let Some(last) = m.last_log_index else {
        return true;
    };
    let Some(replication) = &m.replication else {
        return false;
    };
    m.membership_config
        .membership()
        .voter_ids()
        .filter(|v| *v != m.id)
        .any(|v| {
            replication
                .get(&v)
                .and_then(|matched| matched.as_ref())
                .is_some_and(|l| l.index >= last)
        })
}

/// Keeps this replica from leading while its clock is too far ahead of the
/// cluster's, and says so: a leader stops heartbeats (its followers elect
/// another) and its proposer refuses to stamp; a follower stops standing
/// for election. Warns while any clock it knows of is beyond the bound.
pub async fn clock_watch_loop(
    raft: crate::raft_node::Raft,
    clock: Arc<ServerClock>,
    mut stop: tokio::sync::watch::Receiver<bool>,
) {
    let mut last_warned: BTreeMap<u64, u64> = BTreeMap::new();
    // Whether Raft was last set to let this replica lead.
    let mut allowed = true;
    // Intervals a refused leader has kept leading for want of a voter with
    // its whole log.
    let mut postponed = 0u32;
    loop {
        tokio::select! {
            _ = stop.changed() => return,
            _ = tokio::time::sleep(WATCH_INTERVAL) => {}
        }
        let leading = clock.observe(&raft);
        let refused = clock.check(leading);
        if refused.is_some() && allowed && leading {
            if !step_down_now(another_voter_has_the_whole_log(&raft), postponed) {
                // Its proposer stamps nothing meanwhile (`check`), so the
                // log stops growing and the others catch up.
                postponed += 1;
                continue;
            }
        } else {
            postponed = 0;
        }
        // Refused and not leading, it stands all the same once no leader
        // has spoken for a while (see `stands_though_refused`).
        let stand = refused.is_none() || (!leading && clock.stands_though_refused());
        if stand != allowed {
            allowed = stand;
            match &refused {
                Some(refused) if stand => tracing::warn!(
                    "{refused}; but no leader has spoken for {} s, and this replica may hold                      entries no other voter has: standing for election again (it stamps nothing                      until its clock is back within the bound)",
                    TOLD_FRESH_MS / 1000
                ),
                Some(refused) => {
                    if leading {
                        clock.stepped_down();
                    }
                    tracing::error!(
                        "{refused}; {}",
                        if leading {
                            "stepping down"
                        } else {
                            "not standing for election"
                        }
                    )
                }
                None => tracing::warn!(
                    "this replica's clock is back within the bound: it may lead again"
                ),
            }
            raft.runtime_config().elect(allowed);
            raft.runtime_config().heartbeat(allowed);
        }
        let bound = i64::try_from(clock.max_offset_ms()).unwrap_or(i64::MAX);
        let now = clock.mono_ms();
        let mut warn = |who: u64, offset: i64| {
            let due = last_warned
                .get(&who)
                .is_none_or(|at| now.saturating_sub(*at) >= WARN_AGAIN_MS);
            if offset.abs() > bound && due {
                last_warned.insert(who, now);
                tracing::warn!(
                    member = who,
                    offset_ms = offset,
                    max_offset_ms = bound,
                    "a replica's clock is beyond the bound from the middle of the cluster's clocks; fix its time (NTP)"
                );
            }
        };
        if leading {
            for (peer, offset) in clock.peer_offsets() {
                warn(crate::membership::member_of(peer), offset);
            }
        }
        if let Some(offset) = clock.own_offset_ms(leading) {
            let me = crate::membership::member_of(raft.metrics().borrow().id);
            warn(me, offset);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_leader_refused_for_its_clock_steps_down_once_another_voter_has_its_log() {
        assert!(!step_down_now(false, 0), "its last entries are its alone");
        assert!(!step_down_now(false, STEP_DOWN_POSTPONED_MAX - 1));
        assert!(step_down_now(true, 0));
        assert!(step_down_now(false, STEP_DOWN_POSTPONED_MAX), "not forever");
    }
    use std::sync::atomic::{AtomicU64, Ordering};

    const T0: u64 = 1_800_000_000_000;
    const HOUR_MS: i64 = 3_600_000;

    fn clock_at(wall: Arc<AtomicU64>) -> Arc<ServerClock> {
        ServerClock::new(Arc::new(move || wall.load(Ordering::SeqCst)), 500)
    }

    #[test]
    fn a_leader_an_hour_ahead_of_both_followers_refuses_to_stamp() {
        let wall = Arc::new(AtomicU64::new(T0));
        let clock = clock_at(wall);
        // Both followers read an hour behind this replica (0 ms trips).
        clock.peer_answered(2, T0, T0 - HOUR_MS as u64, 0);
        clock.peer_answered(3, T0, T0 - HOUR_MS as u64, 0);
        assert_eq!(clock.own_offset_ms(true), Some(HOUR_MS));
        assert_eq!(clock.offset_of_peer(2), Some(0));
        assert_eq!(
            clock.check(true),
            Some(ClockTooFarAhead {
                ahead_ms: HOUR_MS,
                max_offset_ms: 500
            })
        );
        let refused = clock.stamp().expect_err("refused");
        assert!(
            refused.to_string().contains("3600000 ms ahead"),
            "{refused}"
        );
    }

    #[test]
    fn a_leader_with_one_follower_an_hour_ahead_tells_it_so_and_leads_on() {
        let wall = Arc::new(AtomicU64::new(T0));
        let clock = clock_at(wall);
        clock.peer_answered(2, T0, T0 + HOUR_MS as u64, 0);
        clock.peer_answered(3, T0, T0 + 20, 0);
        assert_eq!(clock.own_offset_ms(true), Some(-20));
        assert_eq!(clock.offset_of_peer(2), Some(HOUR_MS - 20));
        assert_eq!(clock.check(true), None);
        assert!(clock.stamp().is_ok());
    }

    #[test]
    fn a_follower_acts_on_what_its_leader_said_until_told_otherwise() {
        let wall = Arc::new(AtomicU64::new(T0));
        let clock = clock_at(wall);
        assert_eq!(clock.check(false), None, "nothing said: nothing refused");
        clock.heard_leader(T0, Some(HOUR_MS));
        assert!(clock.check(false).is_some());
        clock.heard_leader(T0, None);
        assert!(clock.check(false).is_some(), "still refused");
        assert!(clock.status(false).refused.is_some());
        clock.heard_leader(T0, Some(100));
        assert_eq!(clock.check(false), None, "lifted");
        assert!(clock.stamp().is_ok());
    }

    #[test]
    fn a_reading_whose_round_trip_is_longer_than_the_bound_is_not_taken() {
        let wall = Arc::new(AtomicU64::new(T0));
        let clock = clock_at(wall);
        // A reply read 1.7 s after it was sent (this process was paused
        // meanwhile): the peer answered at once, in step, but the middle of
        // the trip would put its clock 850 ms behind, and this one 850 ms
        // ahead of the middle.
        clock.peer_answered(2, T0, T0 + 5, 1_700);
        clock.peer_answered(3, T0, T0 + 5, 1_700);
        assert_eq!(clock.peer_offsets(), BTreeMap::new(), "not taken");
        assert_eq!(clock.own_offset_ms(true), None);
        assert_eq!(clock.check(true), None, "not refused for a pause");
        // Within the bound, taken.
        clock.peer_answered(2, T0, T0 + 5, 10);
        clock.peer_answered(3, T0, T0 + 5, 10);
        assert_eq!(clock.own_offset_ms(true), Some(0));
    }

    #[test]
    fn a_follower_refused_for_its_clock_stands_again_once_no_leader_speaks() {
        let wall = Arc::new(AtomicU64::new(T0));
        let clock = clock_at(wall);
        assert!(!clock.stands_though_refused(), "not refused");
        clock.heard_leader(T0, Some(HOUR_MS));
        assert!(clock.check(false).is_some());
        let since = clock.lock().refused_since_mono_ms;
        // Told nothing since: it stands once TOLD_FRESH_MS have passed.
        assert!(!clock.stands_though_refused_at(since + TOLD_FRESH_MS));
        assert!(clock.stands_though_refused_at(since + TOLD_FRESH_MS + 1));
        assert!(clock.stamp().is_err(), "standing, it still stamps nothing");
        // A leader that keeps telling it is ahead keeps it from standing.
        clock.heard_leader(T0, Some(HOUR_MS));
        let told_at = clock.lock().told.map(|(_, at)| at).unwrap_or_default();
        assert!(!clock.stands_though_refused_at(told_at + TOLD_FRESH_MS));
        assert!(clock.stands_though_refused_at(told_at.max(since) + TOLD_FRESH_MS + 1));
        // Having stepped down, it waits again.
        clock.stepped_down();
        let since = clock.lock().refused_since_mono_ms;
        assert!(!clock.stands_though_refused_at(since + TOLD_FRESH_MS));
    }

    #[test]
    fn only_the_voters_clocks_make_the_middle() {
        let wall = Arc::new(AtomicU64::new(T0));
        let clock = clock_at(wall);
        // A learner catching up an hour behind: this sole voter is the
        // middle, and leads on.
        clock.set_voters([1]);
        clock.peer_answered(2, T0, T0 - HOUR_MS as u64, 0);
        assert_eq!(clock.own_offset_ms(true), None);
        assert_eq!(clock.check(true), None);
        // Promoted to voter: two clocks an hour apart; the one ahead does
        // not lead.
        clock.set_voters([1, 2]);
        assert_eq!(clock.own_offset_ms(true), Some(HOUR_MS / 2));
        assert!(clock.check(true).is_some());
    }

    #[test]
    fn the_round_trip_is_split_in_the_middle() {
        let wall = Arc::new(AtomicU64::new(T0));
        let clock = clock_at(wall);
        // Sent at T0, answered 40 ms later by a clock reading T0 + 20:
        // in step with this one.
        clock.peer_answered(2, T0, T0 + 20, 40);
        assert_eq!(clock.offset_of_peer(2), Some(0));
        // A release that does not say its clock is not measured.
        clock.peer_answered(3, T0, 0, 40);
        assert_eq!(clock.peer_offsets().len(), 1);
    }

    #[test]
    fn a_replica_fresh_from_a_restart_takes_the_log_time_its_peers_carry() {
        let wall = Arc::new(AtomicU64::new(T0));
        let clock = clock_at(wall);
        // The log runs two hours behind this replica's clock (a clock that
        // far behind founded the cluster); a peer's reply says so.
        let log = T0 - 2 * HOUR_MS as u64;
        clock.heard_peer(log, 0);
        let stamped = clock.stamp().expect("stamps");
        // Within the bound of the carried time (the test's own run time
        // aside), not two hours on.
        assert!((log + 500..log + 1_500).contains(&stamped), "{stamped}");
        assert!((log..log + 1_000).contains(&clock.told_ms()));
    }

    #[test]
    fn log_time_is_carried_from_the_leader_when_this_clock_is_behind() {
        let wall = Arc::new(AtomicU64::new(T0));
        let clock = clock_at(wall.clone());
        clock.heard_leader(T0 + HOUR_MS as u64, Some(-HOUR_MS));
        let stamped = clock.stamp().expect("behind is no reason to refuse");
        assert!(stamped >= T0 + HOUR_MS as u64, "{stamped}");
        assert!(clock.now_ms() >= stamped);
    }
}
