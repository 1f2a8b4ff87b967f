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
        }
    }

    pub fn parse(s: &str) -> Option<FaultKind> {
        FaultKind::ALL
            .into_iter()
            .chain(FaultKind::DISK)
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
        assert_eq!(lagging_followers(&[2, 3], 3, 3), vec![2]);
        assert_eq!(lagging_followers(&[1, 2, 4, 5], 2, 5), vec![1, 4]);
        assert_ne!(
            a.iter().map(|r| r.kind).collect::<Vec<_>>(),
            c.iter().map(|r| r.kind).collect::<Vec<_>>()
        );
    }
}
