//! The fault kinds and the seeded schedule.
//!
//! A run is a number of rounds; each round injects one fault, holds it for
//! a seeded 1–3 s while the workload runs, heals it, and waits for the
//! cluster to commit again. The kinds are dealt from a seeded shuffle of
//! all of them, so every kind comes up equally often.

use keel_state::rng::SplitMix64;
use serde::Serialize;

/// One kind of fault.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum FaultKind {
    /// SIGKILL the leader; restart it at the heal.
    KillLeader,
    /// SIGKILL a follower; restart it at the heal.
    KillFollower,
    /// SIGKILL a majority (the leader among them); restart them.
    KillMajority,
    /// SIGSTOP the leader; SIGCONT at the heal: it wakes as a stale leader.
    PauseLeader,
    /// Cut the leader off from every peer, both ways.
    IsolateLeader,
    /// Cut one follower off, both ways.
    IsolateFollower,
    /// Drop what the leader sends its peers, but not what it receives.
    LeaderCannotSend,
    /// Drop what the leader receives from its peers, but not what it sends.
    LeaderCannotHear,
    /// SIGKILL a follower, delete its data directory, start it empty.
    WipeFollower,
    /// A lost disk with one more fault before the wiped member has caught
    /// up: SIGSTOP half the other followers (they fall behind while the
    /// leader commits), SIGSTOP the leader, wipe the follower that holds
    /// the new entries and start it empty, SIGCONT the lagging ones; the
    /// leader wakes at the heal. The empty member and the lagging ones are
    /// a majority that lacks acknowledged entries.
    WipeFollowerThenPauseLeader,
    /// Restart a follower whose WAL appends each take 150 ms longer (a
    /// failpoint: `keel` built with `--features failpoints`).
    SlowDiskFollower,
    /// Restart a follower whose disk fills after 20 appends: its Raft stops
    /// and the process exits (fail-stop); the heal restarts it with room.
    FullDiskFollower,
    /// The leader freezes itself (a failpoint: SIGSTOP) between deciding an
    /// allocation and launching its worker; it wakes at the heal, believing
    /// it still leads, while the new leader has launched the worker. The
    /// process table is watched for two live workers of one identity.
    PauseLeaderBeforeLaunch,
    /// Restart a replica (the leader or a follower, as drawn) with its
    /// clock off by a seeded offset from a second to hours, ahead or behind
    /// (libfaketime); the heal restarts it with the true clock. One ahead
    /// by more than the bound does not lead, and log time never goes
    /// backwards: the replays check every entry.
    SkewedClock,
}

impl FaultKind {
    pub const ALL: [FaultKind; 10] = [
        FaultKind::KillLeader,
        FaultKind::KillFollower,
        FaultKind::KillMajority,
        FaultKind::PauseLeader,
        FaultKind::IsolateLeader,
        FaultKind::IsolateFollower,
        FaultKind::LeaderCannotSend,
        FaultKind::LeaderCannotHear,
        FaultKind::WipeFollower,
        FaultKind::WipeFollowerThenPauseLeader,
    ];

    /// The kinds that need a `keel` built with failpoints: the disk faults
    /// and the leader that freezes itself before a launch.
    pub const DISK: [FaultKind; 3] = [
        FaultKind::SlowDiskFollower,
        FaultKind::FullDiskFollower,
        FaultKind::PauseLeaderBeforeLaunch,
    ];

    /// The kinds that need libfaketime ([`libfaketime`]).
    pub const CLOCK: [FaultKind; 1] = [FaultKind::SkewedClock];

    pub fn as_str(self) -> &'static str {
        match self {
            FaultKind::KillLeader => "kill_leader",
            FaultKind::KillFollower => "kill_follower",
            FaultKind::KillMajority => "kill_majority",
            FaultKind::PauseLeader => "pause_leader",
            FaultKind::IsolateLeader => "isolate_leader",
            FaultKind::IsolateFollower => "isolate_follower",
            FaultKind::LeaderCannotSend => "leader_cannot_send",
            FaultKind::LeaderCannotHear => "leader_cannot_hear",
            FaultKind::WipeFollower => "wipe_follower",
            FaultKind::WipeFollowerThenPauseLeader => "wipe_follower_then_pause_leader",
            FaultKind::SlowDiskFollower => "slow_disk_follower",
            FaultKind::FullDiskFollower => "full_disk_follower",
            FaultKind::PauseLeaderBeforeLaunch => "pause_leader_before_launch",
            FaultKind::SkewedClock => "skewed_clock",
        }
    }

    pub fn parse(s: &str) -> Option<FaultKind> {
        FaultKind::ALL
            .into_iter()
            .chain(FaultKind::DISK)
            .chain(FaultKind::CLOCK)
            .find(|k| k.as_str() == s)
    }

    /// Whether the fault takes the leader out (a failover is expected).
    pub fn hits_leader(self) -> bool {
        matches!(
            self,
            FaultKind::KillLeader
                | FaultKind::KillMajority
                | FaultKind::PauseLeader
                | FaultKind::IsolateLeader
                | FaultKind::LeaderCannotHear
                | FaultKind::LeaderCannotSend
                | FaultKind::WipeFollowerThenPauseLeader
                | FaultKind::PauseLeaderBeforeLaunch
        )
    }
}

/// The followers that lag behind in a lost-disk composite fault: half the
/// cluster's followers (`others`, every member but the leader), leaving out
/// `wiped`, the one that loses its disk. With the wiped member they make a
/// majority that lacks what the leader commits meanwhile.
pub fn lagging_followers(others: &[u64], wiped: u64, replicas: u64) -> Vec<u64> {
    others
        .iter()
        .copied()
        .filter(|r| *r != wiped)
        .take((replicas / 2) as usize)
        .collect()
}

/// A skewed clock's offset in seconds, drawn from `pick`: ahead or behind,
/// from a second to about three hours, each power of ten as likely.
pub fn clock_skew_s(pick: u64) -> i64 {
    let magnitude = 10i64.pow(((pick >> 1) % 4) as u32) * (1 + ((pick >> 3) % 10) as i64);
    if pick & 1 == 0 {
        magnitude
    } else {
        -magnitude
    }
}

/// libfaketime's preload library, where Debian's `faketime` package (or a
/// local build) installs it; `None` where it is not installed.
pub fn libfaketime() -> Option<std::path::PathBuf> {
    let roots = ["/usr/lib", "/usr/local/lib", "/usr/lib64"];
    roots
        .iter()
        .flat_map(|root| {
            let nested = std::fs::read_dir(root)
                .into_iter()
                .flatten()
                .flatten()
                .map(|e| e.path().join("faketime/libfaketime.so.1"));
            std::iter::once(std::path::Path::new(root).join("faketime/libfaketime.so.1"))
                .chain(nested)
        })
        .find(|p| p.exists())
}

/// The environment that runs a replica with its clock `skew_s` seconds off.
pub fn skewed_clock_env(lib: &std::path::Path, skew_s: i64) -> Vec<(&'static str, String)> {
    vec![
        ("LD_PRELOAD", lib.display().to_string()),
        ("FAKETIME", format!("{skew_s:+}")),
        // Only the wall clock: timers run as they would.
        ("FAKETIME_DONT_FAKE_MONOTONIC", "1".to_string()),
    ]
}

/// One round of the schedule.
#[derive(Debug, Clone, Serialize)]
pub struct Round {
    pub kind: FaultKind,
    /// How long the fault is held.
    pub hold_ms: u64,
    /// A draw for choices made at injection (which follower, which members).
    pub pick: u64,
}

/// The schedule of `rounds` rounds for `seed`, over `kinds`.
pub fn schedule(seed: u64, rounds: u32, kinds: &[FaultKind]) -> Vec<Round> {
    let mut rng = SplitMix64::new(seed);
    let mut deck: Vec<FaultKind> = Vec::new();
    (0..rounds)
        .map(|_| {
            if deck.is_empty() {
                deck = kinds.to_vec();
                // Fisher–Yates on the seeded stream.
                for i in (1..deck.len()).rev() {
                    let j = rng.below(i as u64 + 1) as usize;
                    deck.swap(i, j);
                }
            }
            let kind = deck.pop().unwrap_or(FaultKind::KillLeader);
            Round {
                kind,
                hold_ms: 1000 + rng.below(2001),
                pick: rng.next_u64(),
            }
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_schedule_is_seeded_and_deals_every_kind_evenly() {
        let a = schedule(7, 20, &FaultKind::ALL);
        let b = schedule(7, 20, &FaultKind::ALL);
        assert_eq!(
            a.iter().map(|r| (r.kind, r.hold_ms)).collect::<Vec<_>>(),
            b.iter().map(|r| (r.kind, r.hold_ms)).collect::<Vec<_>>()
        );
        for kind in FaultKind::ALL {
            assert_eq!(a.iter().filter(|r| r.kind == kind).count(), 2, "{kind:?}");
            assert_eq!(FaultKind::parse(kind.as_str()), Some(kind));
        }
        assert!(a.iter().all(|r| (1000..=3000).contains(&r.hold_ms)));
        let c = schedule(8, 20, &FaultKind::ALL);
        let skews: Vec<i64> = (0..64).map(clock_skew_s).collect();
        assert!(skews.iter().any(|s| *s < 0) && skews.iter().any(|s| *s > 0));
        assert!(skews.iter().all(|s| (1..=10_000).contains(&s.abs())));
        assert!(skews.iter().any(|s| s.abs() < 10) && skews.iter().any(|s| s.abs() >= 1000));
        assert_eq!(
            FaultKind::parse("skewed_clock"),
            Some(FaultKind::SkewedClock)
        );
        assert_eq!(lagging_followers(&[2, 3], 3, 3), vec![2]);
        assert_eq!(lagging_followers(&[1, 2, 4, 5], 2, 5), vec![1, 4]);
        assert_ne!(
            a.iter().map(|r| r.kind).collect::<Vec<_>>(),
            c.iter().map(|r| r.kind).collect::<Vec<_>>()
        );
    }
}
