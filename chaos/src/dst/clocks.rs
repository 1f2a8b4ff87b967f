//! Each simulated replica's clocks: a wall clock off the virtual one by a
//! seeded skew and running fast or slow by a seeded drift, and the log
//! clock ([`keel_state::log_time::LogClock`]) that stamps what it proposes,
//! as the server's proposer does: after applying every entry of the terms
//! before its own, later than every entry before, carrying the log time its
//! leader's heartbeats said.
//!
//! Most replicas' clocks are within a few hundred milliseconds of the
//! virtual one; in some runs one replica is off by seconds to hours, ahead
//! or behind. One ahead of the voters' median by more than the bound does
//! not lead, as in the server ([`Clocks::may_lead`]). The checked replay
//! at the end of a run finds any entry stamped earlier than the one before
//! it.

use std::collections::BTreeMap;
use std::sync::{Mutex, MutexGuard};

use keel_state::log_time::{median_ms, LogClock};
use keel_state::rng::SplitMix64;

use super::run::EPOCH_MS;

/// The member ids of the voters `raft`'s membership names.
pub fn voters_of(raft: &super::net::Raft) -> Vec<u64> {
    raft.metrics()
        .borrow()
        .membership_config
        .membership()
        .voter_ids()
        .map(keel::membership::member_of)
        .collect()
}

/// The bound on healthy clock offsets (the server's default).
const MAX_OFFSET_MS: u64 = keel_state::log_time::MAX_CLOCK_OFFSET_MS_DEFAULT;

#[derive(Debug)]
struct SimClock {
    skew_ms: i64,
    /// Parts per million the wall clock gains (negative: loses).
    drift_ppm: i64,
    log: LogClock,
    /// The term this replica last caught up in before stamping.
    stamping_term: Option<u64>,
}

/// Every replica's clocks, drawn from the run's seed.
#[derive(Debug)]
pub struct Clocks {
    seed: u64,
    start: tokio::time::Instant,
    clocks: Mutex<BTreeMap<u64, SimClock>>,
}

/// A replica's skew and drift for `seed`: within ±300 ms and ±200 ppm,
/// except, in one run of four, member 1's (seconds to hours off).
fn draw(seed: u64, member: u64) -> (i64, i64) {
    let mut rng = SplitMix64::new(seed ^ member.wrapping_mul(0x9e37_79b9_7f4a_7c15));
    let mut skew_ms = rng.below(601) as i64 - 300;
    let drift_ppm = rng.below(401) as i64 - 200;
    let mut run = SplitMix64::new(seed);
    if member == 1 && run.below(4) == 0 {
        let magnitude = 10i64.pow(run.below(5) as u32) * (1 + run.below(10) as i64) * 1_000;
        skew_ms = if run.below(2) == 0 {
            magnitude
        } else {
            -magnitude
        };
    }
    (skew_ms, drift_ppm)
}

impl Clocks {
    pub fn new(seed: u64) -> Clocks {
        Clocks {
            seed,
            start: tokio::time::Instant::now(),
            clocks: Mutex::new(BTreeMap::new()),
        }
    }

    fn lock(&self) -> MutexGuard<'_, BTreeMap<u64, SimClock>> {
        self.clocks.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Virtual milliseconds since the run began: every replica's monotonic
    /// clock.
    fn mono_ms(&self) -> u64 {
        u64::try_from(self.start.elapsed().as_millis()).unwrap_or(u64::MAX)
    }

    fn with<T>(&self, member: u64, f: impl FnOnce(&mut SimClock, u64, u64) -> T) -> T {
        let mono = self.mono_ms();
        let mut clocks = self.lock();
        let clock = clocks.entry(member).or_insert_with(|| {
            let (skew_ms, drift_ppm) = draw(self.seed, member);
            SimClock {
                skew_ms,
                drift_ppm,
                log: LogClock::new(MAX_OFFSET_MS),
                stamping_term: None,
            }
        });
        let drifted = mono as i64 + mono as i64 * clock.drift_ppm / 1_000_000;
        let wall = (EPOCH_MS as i64 + drifted + clock.skew_ms).max(0) as u64;
        f(clock, wall, mono)
    }

    /// Replica `member`'s skew, for the trace.
    pub fn skew_ms(&self, member: u64) -> i64 {
        self.with(member, |c, _, _| c.skew_ms)
    }

    /// The log's time now by `member`'s reckoning (what its loops measure
    /// durations in).
    pub fn now_ms(&self, member: u64) -> u64 {
        self.with(member, |c, wall, mono| c.log.now_ms(wall, mono))
    }

    /// The time for `member`'s next proposal.
    pub fn stamp(&self, member: u64) -> u64 {
        self.with(member, |c, wall, mono| c.log.stamp(wall, mono))
    }

    /// The log time `member` tells its peers ([`LogClock::told_ms`]; 0:
    /// nothing yet).
    pub fn told_ms(&self, member: u64) -> u64 {
        self.with(member, |c, _, mono| c.log.told_ms(mono).unwrap_or(0))
    }

    /// `member` accepted its leader's AppendEntries saying the log's time
    /// was `log_ms`, or got a reply from a peer carrying it (0: nothing).
    pub fn heard(&self, member: u64, log_ms: u64) {
        if log_ms > 0 {
            self.with(member, |c, _, mono| c.log.heard(log_ms, mono));
        }
    }

    /// Whether `member` must catch up before stamping in `term`.
    pub fn needs_catch_up(&self, member: u64, term: u64) -> bool {
        self.with(member, |c, _, _| c.stamping_term != Some(term))
    }

    /// `member` applied everything up to its term's first entry: entries
    /// up to `latest_ms` are in the log.
    pub fn caught_up(&self, member: u64, term: u64, latest_ms: u64) {
        self.with(member, |c, wall, mono| {
            c.log.saw_entry(latest_ms);
            c.log.seed(wall, mono);
            c.stamping_term = Some(term);
        });
    }

    /// How far `member`'s wall clock is ahead of the median of `voters'`
    /// (the server measures it from the clocks its Raft messages carry;
    /// here it is known).
    pub fn ahead_of_middle_ms(&self, member: u64, voters: &[u64]) -> i64 {
        let wall = |id: u64| self.with(id, |_, wall, _| wall as i64);
        let Some(middle) = median_ms(voters.iter().map(|v| wall(*v)).collect()) else {
            return 0;
        };
        wall(member) - middle
    }

    /// Whether `member` may lead among `voters`: not while its clock is
    /// ahead of theirs by more than the bound (the server's rule).
    pub fn may_lead(&self, member: u64, voters: &[u64]) -> bool {
        self.ahead_of_middle_ms(member, voters) <= MAX_OFFSET_MS as i64
    }

    /// `member` restarted: a new process has heard nothing.
    pub fn restarted(&self, member: u64) {
        self.with(member, |c, _, _| {
            c.log = LogClock::new(MAX_OFFSET_MS);
            c.stamping_term = None;
        });
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test(start_paused = true)]
    async fn a_clock_far_ahead_of_the_others_may_not_lead() {
        let seed = (0..64)
            .find(|seed| draw(*seed, 1).0 > 10_000)
            .expect("a run with member 1 far ahead");
        let clocks = Clocks::new(seed);
        assert!(!clocks.may_lead(1, &[1, 2, 3]));
        assert!(clocks.may_lead(2, &[1, 2, 3]));
        assert!(clocks.may_lead(1, &[1]), "alone, it is the middle");
    }

    #[test]
    fn most_clocks_are_close_and_some_runs_have_one_far_off() {
        let far: Vec<i64> = (0..64)
            .map(|seed| draw(seed, 1).0)
            .filter(|s| s.abs() > 300)
            .collect();
        assert!(!far.is_empty() && far.len() < 32, "{far:?}");
        assert!(far.iter().any(|s| *s > 0) && far.iter().any(|s| *s < 0));
        assert!((0..64).all(|seed| draw(seed, 2).0.abs() <= 300));
        assert_eq!(draw(7, 3), draw(7, 3));
    }
}
