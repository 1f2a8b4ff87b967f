//! Log time: the time a leader stamps on the entries it proposes.
//!
//! Replicas run on different machines and their clocks differ. Entries carry
//! the time their leader stamped (`LogEntry::at_ms`), and `apply` measures
//! every duration in it (backoffs, waits, attained service, rounds), so log
//! time must never go backwards, and one skewed clock must not move it far.
//! A [`LogClock`] is one replica's reckoning of it, a hybrid clock in the
//! spirit of CockroachDB's:
//!
//! - **Never backwards.** A stamp is later than every entry the replica
//!   stamped or saw applied (`last + 1 ms`); a new leader proposes only
//!   after it applied every entry of the terms before its own.
//! - **Carried at the local rate.** What a replica hears live (a leader's
//!   log time in the heartbeats it accepted, or its peers' in their
//!   replies, so a new leader fresh from a restart learns it too) is
//!   carried forward by the local monotonic clock. A leader whose wall clock is behind that
//!   reckoning stamps the carried time: a job's 20 s backoff ends 20 s later
//!   under any leader, however wrong its clock.
//! - **Moved forward a bounded step.** A wall clock ahead of the carried
//!   time moves log time forward by at most `max_offset_ms` (the bound on
//!   how far healthy clocks differ), so a clock an hour ahead cannot end
//!   every backoff at once or add an hour of attained service.
//!
//! With nothing heard live (an empty log, or a whole cluster restarted), the
//! wall clock is all there is: time the cluster was down counts. Keeping a
//! replica whose clock is far off from leading is the replicas' business
//! (the server's clock checks); this module has no clock of its own: every
//! time arrives as an argument.

use serde::{Deserialize, Serialize};

/// How far replicas' clocks may differ before one counts as skewed, unless
/// configured (`--max-clock-offset-ms`).
pub const MAX_CLOCK_OFFSET_MS_DEFAULT: u64 = 500;

/// One replica's reckoning of log time.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct LogClock {
    max_offset_ms: u64,
    /// The latest time stamped or seen on an entry: the next stamp is later.
    last_ms: u64,
    /// The log's time as last heard live, and the local monotonic time it
    /// was heard at. Of two readings, the one that reckons the later time
    /// now is kept.
    heard: Option<Reading>,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
struct Reading {
    log_ms: u64,
    mono_ms: u64,
}

impl Reading {
    fn at(self, mono_ms: u64) -> u64 {
        self.log_ms
            .saturating_add(mono_ms.saturating_sub(self.mono_ms))
    }
}

impl LogClock {
    /// A clock that has heard nothing yet.
    pub fn new(max_offset_ms: u64) -> LogClock {
        LogClock {
            max_offset_ms,
            last_ms: 0,
            heard: None,
        }
    }

    /// The bound on clock offsets it was made with.
    pub fn max_offset_ms(&self) -> u64 {
        self.max_offset_ms
    }

    /// An entry stamped `at_ms` is in the log (applied, or replayed at
    /// start): no later stamp is earlier. Not a reading of the log's time
    /// now: an entry replayed at start may be hours old.
    pub fn saw_entry(&mut self, at_ms: u64) {
        self.last_ms = self.last_ms.max(at_ms);
    }

    /// The log's time was `log_ms` when this replica heard it live (a
    /// leader's heartbeat it accepted) at local monotonic time `mono_ms`.
    pub fn heard(&mut self, log_ms: u64, mono_ms: u64) {
        let reading = Reading { log_ms, mono_ms };
        let later = match self.heard {
            None => true,
            Some(kept) => {
                reading.at(mono_ms.max(kept.mono_ms)) > kept.at(mono_ms.max(kept.mono_ms))
            }
        };
        if later {
            self.heard = Some(reading);
        }
    }

    /// The log's time now as carried from the last live reading, if any.
    pub fn carried_ms(&self, mono_ms: u64) -> Option<u64> {
        self.heard.map(|r| r.at(mono_ms))
    }

    /// The log's time now, by this replica's reckoning: its wall clock held
    /// within `[carried, carried + max_offset_ms]`, and never before the
    /// latest entry.
    pub fn now_ms(&self, wall_ms: u64, mono_ms: u64) -> u64 {
        let reckoned = match self.carried_ms(mono_ms) {
            None => wall_ms,
            Some(carried) => wall_ms.clamp(carried, carried.saturating_add(self.max_offset_ms)),
        };
        reckoned.max(self.last_ms)
    }

    /// The log time this replica tells its peers (a leader in its
    /// AppendEntries, any replica in its replies): what it carries, not its
    /// own stamps (so that echoes cannot ratchet log time forward); `None`
    /// until it carries something. A replica fresh from a restart says
    /// nothing until it has heard, so it cannot spread its own clock.
    pub fn told_ms(&self, mono_ms: u64) -> Option<u64> {
        self.carried_ms(mono_ms)
    }

    /// A leader that caught up (its peers' replies heard) and carries
    /// nothing: nobody it heard has a reference, so its own reckoning
    /// becomes the one it carries and tells.
    pub fn seed(&mut self, wall_ms: u64, mono_ms: u64) {
        if self.heard.is_none() {
            let log_ms = self.now_ms(wall_ms, mono_ms);
            self.heard = Some(Reading { log_ms, mono_ms });
        }
    }

    /// The time for the next proposal: the log's time now, and later than
    /// every entry before it.
    pub fn stamp(&mut self, wall_ms: u64, mono_ms: u64) -> u64 {
        let at_ms = self
            .now_ms(wall_ms, mono_ms)
            .max(self.last_ms.saturating_add(1));
        self.last_ms = at_ms;
        at_ms
    }

    /// How far the wall clock is ahead of the log's carried time (negative:
    /// behind); `None` until something was heard live.
    pub fn wall_ahead_of_log_ms(&self, wall_ms: u64, mono_ms: u64) -> Option<i64> {
        self.carried_ms(mono_ms)
            .map(|carried| signed_difference(wall_ms, carried))
    }
}

/// What is wrong with an entry stamped `at_ms` after entries up to
/// `latest_ms`: its time is earlier (an invariant of the log that replays
/// check, as they check the state's after every entry).
pub fn earlier_than_before(latest_ms: u64, at_ms: u64) -> Option<String> {
    (at_ms < latest_ms).then(|| {
        format!(
            "log time went backwards: an entry stamped {at_ms} ms after one stamped {latest_ms} ms"
        )
    })
}

/// The median of `values` (the mean of the two middle ones for an even
/// count, rounded toward zero); `None` for none. The middle of a cluster's
/// clocks, which a replica too far ahead of may not lead.
pub fn median_ms(mut values: Vec<i64>) -> Option<i64> {
    values.sort_unstable();
    let n = values.len();
    match n {
        0 => None,
        _ if n % 2 == 1 => Some(values[n / 2]),
        _ => Some(values[n / 2 - 1] / 2 + values[n / 2] / 2),
    }
}

/// `a - b` as a signed number of milliseconds (saturating).
pub fn signed_difference(a: u64, b: u64) -> i64 {
    if a >= b {
        i64::try_from(a - b).unwrap_or(i64::MAX)
    } else {
        i64::try_from(b - a).map_or(i64::MIN, |d| -d)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const HOUR_MS: u64 = 3_600_000;
    const T0: u64 = 1_800_000_000_000;

    #[test]
    fn with_nothing_heard_the_wall_clock_is_log_time() {
        let mut clock = LogClock::new(500);
        assert_eq!(clock.now_ms(T0, 7), T0);
        assert_eq!(clock.stamp(T0, 7), T0);
        // The same wall time again: one millisecond later, never equal.
        assert_eq!(clock.stamp(T0, 7), T0 + 1);
    }

    #[test]
    fn a_leader_whose_clock_is_behind_carries_the_log_time_forward() {
        let mut clock = LogClock::new(500);
        // The last leader's heartbeat said T0 + 1 h, heard at mono 1,000.
        clock.heard(T0 + HOUR_MS, 1_000);
        // This replica's wall clock says T0 (an hour behind); 20 s pass.
        assert_eq!(clock.stamp(T0, 21_000), T0 + HOUR_MS + 20_000);
        assert_eq!(clock.now_ms(T0 + 5, 26_000), T0 + HOUR_MS + 25_000);
    }

    #[test]
    fn a_clock_far_ahead_moves_log_time_by_the_bound_at_most() {
        let mut clock = LogClock::new(500);
        clock.heard(T0, 0);
        assert_eq!(
            clock.wall_ahead_of_log_ms(T0 + HOUR_MS, 0),
            Some(HOUR_MS as i64)
        );
        assert_eq!(clock.stamp(T0 + HOUR_MS, 0), T0 + 500);
        // Its own stamps are not readings: the bound holds against what it
        // heard, so however many it stamps, log time runs at the local
        // rate, the bound ahead of the last leader's.
        for _ in 0..1_000 {
            clock.stamp(T0 + HOUR_MS, 10);
        }
        assert_eq!(clock.stamp(T0 + HOUR_MS, 10_000), T0 + 10_500);
    }

    #[test]
    fn a_clock_a_little_ahead_is_followed() {
        let mut clock = LogClock::new(500);
        clock.heard(T0, 0);
        assert_eq!(clock.stamp(T0 + 300, 0), T0 + 300);
        assert_eq!(clock.wall_ahead_of_log_ms(T0 + 300, 100), Some(200));
    }

    #[test]
    fn no_stamp_is_before_an_entry_seen() {
        let mut clock = LogClock::new(500);
        clock.saw_entry(T0 + HOUR_MS);
        // A replayed entry is no live reading: the wall clock still leads
        // while it is later...
        assert_eq!(clock.carried_ms(0), None);
        assert_eq!(clock.stamp(T0 + 2 * HOUR_MS, 0), T0 + 2 * HOUR_MS);
        // ...and a wall clock before the entry stamps just after it.
        let mut clock = LogClock::new(500);
        clock.saw_entry(T0 + HOUR_MS);
        assert_eq!(clock.stamp(T0, 0), T0 + HOUR_MS + 1);
    }

    #[test]
    fn of_two_readings_the_later_reckoning_is_kept() {
        let mut clock = LogClock::new(500);
        clock.heard(T0 + 10_000, 0);
        // A reading heard later that reckons an earlier time (a slow
        // message) does not pull the clock back.
        clock.heard(T0 + 10_500, 1_000);
        assert_eq!(clock.carried_ms(1_000), Some(T0 + 11_000));
        clock.heard(T0 + 12_000, 1_000);
        assert_eq!(clock.carried_ms(2_000), Some(T0 + 13_000));
    }

    #[test]
    fn what_it_tells_is_what_it_carries_so_echoes_do_not_ratchet() {
        let mut leader = LogClock::new(500);
        // Nothing heard: nothing to tell, until it seeds its own.
        assert_eq!(leader.told_ms(0), None);
        leader.seed(T0, 0);
        assert_eq!(leader.told_ms(0), Some(T0));
        // Its clock an hour ahead: it stamps at most 500 ms ahead...
        assert_eq!(leader.stamp(T0 + 3_600_000, 0), T0 + 500);
        // ...and tells what it carries, which a follower echoes back.
        let told = leader.told_ms(10).expect("carried");
        assert_eq!(told, T0 + 10);
        let mut follower = LogClock::new(500);
        follower.heard(told, 0);
        leader.heard(follower.told_ms(5).expect("carried"), 15);
        assert_eq!(leader.stamp(T0 + 3_600_000, 20), T0 + 520);
        // A seed changes nothing once something is carried.
        leader.seed(T0 + 3_600_000, 20);
        assert_eq!(leader.told_ms(20), Some(T0 + 20));
    }

    #[test]
    fn the_median_of_an_even_count_is_between_the_middle_two() {
        assert_eq!(median_ms(vec![]), None);
        assert_eq!(median_ms(vec![5, -3, 0]), Some(0));
        assert_eq!(median_ms(vec![0, -3_600_000]), Some(-1_800_000));
        assert_eq!(median_ms(vec![i64::MAX, i64::MAX]), Some(i64::MAX - 1));
    }

    #[test]
    fn signed_differences_saturate() {
        assert_eq!(signed_difference(5, 3), 2);
        assert_eq!(signed_difference(3, 5), -2);
        assert_eq!(signed_difference(u64::MAX, 0), i64::MAX);
        assert_eq!(signed_difference(0, u64::MAX), i64::MIN);
    }

    proptest::proptest! {
        /// Whatever the wall clock does, stamps only increase, and none is
        /// more than the bound ahead of both the wall clock and the carried
        /// time.
        #[test]
        fn stamps_only_increase(steps in proptest::collection::vec((0u64..2 * HOUR_MS, 0u64..5_000, proptest::bool::ANY), 1..64)) {
            let mut clock = LogClock::new(500);
            let mut mono = 0;
            let mut previous = 0;
            for (wall_offset, elapsed, hear) in steps {
                mono += elapsed;
                let wall = T0 + wall_offset;
                if hear {
                    clock.heard(T0 + mono, mono);
                }
                let carried = clock.carried_ms(mono);
                let at = clock.stamp(wall, mono);
                proptest::prop_assert!(at > previous);
                if let Some(carried) = carried {
                    proptest::prop_assert!(at <= carried.max(wall.min(carried + 500)).max(previous + 1));
                }
                previous = at;
            }
        }
    }
}
