//! Who a member is, and how a member that lost its disk comes back.
//!
//! A member is named by operators with its member id (`--id`, 1 to
//! [`MEMBER_ID_MAX`]). Raft knows each member by a Raft id that adds an
//! **incarnation**: a random number made together with the data directory
//! (`DATA/incarnation`) and recorded in the membership. A replica whose
//! disk was lost starts with a new incarnation, so it is not the voter the
//! membership names: every Raft message names the Raft id it is for
//! (`raft_network`), and a replica refuses messages for another
//! incarnation of itself. It therefore votes for no one and counts toward
//! no quorum while it holds nothing; before, an empty replica with its old
//! identity could grant the vote that elects a leader lacking committed
//! entries (openraft's FAQ, "Can I wipe out the data of ONE node").
//!
//! The refusal names the new incarnation, and the sender keeps it in
//! [`Strangers`]. The leader's repair ([`plan`], run by [`Repairer`])
//! then replaces the old incarnation by the new one, each step a
//! membership entry in the log: the new incarnation joins as a learner,
//! and once it has caught up one joint change retires the old voter and
//! makes the learner a voter. A learner that shares its member id with a
//! voter is the record of a replacement under way, so a new leader
//! finishes it. Members the bootstrap could not ask (down at the first
//! start) are named by their member id alone (incarnation 0) until they
//! answer, and join the same way.
//!
//! Everything here but [`Repairer::step`] and the incarnation file is pure.

use std::collections::{BTreeMap, BTreeSet};
use std::path::Path;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use openraft::{BasicNode, ChangeMembers, RaftMetrics, ServerState};

use crate::raft_node::Raft;

/// The largest member id: the low 16 bits of a Raft id.
pub const MEMBER_ID_MAX: u64 = 0xFFFF;

/// Whether `id` is a member id: 1 to [`MEMBER_ID_MAX`].
pub fn is_member_id(id: u64) -> bool {
    (1..=MEMBER_ID_MAX).contains(&id)
}

const INCARNATION_SHIFT: u32 = 16;

/// The Raft id of incarnation `incarnation` of member `member`.
pub fn raft_id(member: u64, incarnation: u64) -> u64 {
    (incarnation << INCARNATION_SHIFT) | (member & MEMBER_ID_MAX)
}

/// The member id a Raft id names.
pub fn member_of(raft_id: u64) -> u64 {
    raft_id & MEMBER_ID_MAX
}

/// The incarnation a Raft id names (0: a member not asked yet, or a data
/// directory older than incarnations).
pub fn incarnation_of(raft_id: u64) -> u64 {
    raft_id >> INCARNATION_SHIFT
}

/// The member ids of `raft_ids`, each once, in order (two incarnations of
/// a member are listed together while it is re-admitted).
pub fn member_ids(raft_ids: impl IntoIterator<Item = u64>) -> Vec<u64> {
    raft_ids
        .into_iter()
        .map(member_of)
        .collect::<BTreeSet<u64>>()
        .into_iter()
        .collect()
}

/// A Raft id for people: `3` or `3.9f2c41a0b7d5`.
pub fn show(raft_id: u64) -> String {
    match incarnation_of(raft_id) {
        0 => member_of(raft_id).to_string(),
        i => format!("{}.{i:012x}", member_of(raft_id)),
    }
}

/// Errors of the incarnation file.
#[derive(Debug, thiserror::Error)]
pub enum IncarnationError {
    #[error("cannot read or write {path}: {source}")]
    Io {
        path: String,
        source: std::io::Error,
    },
    #[error("{path} holds {found:?}, not an incarnation (1 to 48 bits, hexadecimal)")]
    Corrupt { path: String, found: String },
}

/// This data directory's incarnation: read from `path`, or made and kept
/// there (synced, renamed, the directory synced) when the directory holds
/// no Raft state yet (`fresh`). A directory with Raft state but no file
/// predates incarnations: it keeps incarnation 0.
pub fn load_or_create_incarnation(path: &Path, fresh: bool) -> Result<u64, IncarnationError> {
    let io = |source| IncarnationError::Io {
        path: path.display().to_string(),
        source,
    };
    match std::fs::read_to_string(path) {
        Ok(text) => {
            let text = text.trim();
            u64::from_str_radix(text, 16)
                .ok()
                .filter(|i| *i != 0 && *i >> (64 - INCARNATION_SHIFT) == 0)
                .ok_or_else(|| IncarnationError::Corrupt {
                    path: path.display().to_string(),
                    found: text.chars().take(40).collect(),
                })
        }
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => {
            if !fresh {
                return Ok(0);
            }
            let incarnation = loop {
                let i = rand::random::<u64>() >> INCARNATION_SHIFT;
                if i != 0 {
                    break i;
                }
            };
            use std::io::Write;
            let mut file = atomic_write_file::AtomicWriteFile::open(path).map_err(io)?;
            file.write_all(format!("{incarnation:012x}\n").as_bytes())
                .map_err(io)?;
            file.commit().map_err(io)?;
            Ok(incarnation)
        }
        Err(e) => Err(io(e)),
    }
}

/// What peers answered when addressed under a Raft id they no longer have:
/// addressed Raft id → the Raft id found at that member's address. Kept by
/// the network (in memory), read by the leader's repair.
#[derive(Debug, Default, Clone)]
pub struct Strangers(Arc<Mutex<BTreeMap<u64, u64>>>);

impl Strangers {
    /// `found` answered a message for `addressed`. Only another incarnation
    /// of the same member counts.
    pub fn saw(&self, addressed: u64, found: u64) {
        if member_of(addressed) != member_of(found) || addressed == found {
            return;
        }
        let mut map = self.0.lock().unwrap_or_else(|p| p.into_inner());
        if map.insert(addressed, found) != Some(found) {
            tracing::warn!(
                addressed = %show(addressed),
                found = %show(found),
                "a member answered with another incarnation (its data directory is new): \
                 it takes no part in votes or quorums until the leader has re-admitted it"
            );
        }
    }

    /// `addressed` answered as itself: whatever was seen at its address
    /// before no longer holds.
    pub fn answered(&self, addressed: u64) {
        self.0
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .remove(&addressed);
    }

    /// Whether `other` is this very record (a clone of it).
    pub fn same(&self, other: &Strangers) -> bool {
        Arc::ptr_eq(&self.0, &other.0)
    }

    pub fn snapshot(&self) -> BTreeMap<u64, u64> {
        self.0.lock().unwrap_or_else(|p| p.into_inner()).clone()
    }

    /// Forgets what concerns Raft ids no longer in `nodes`.
    fn forget_outside(&self, nodes: &BTreeMap<u64, String>) {
        self.0
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .retain(|addressed, _| nodes.contains_key(addressed));
    }
}

/// The leader's view of the membership, as the repair needs it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct MembershipView {
    /// Raft ids of the voters (both configurations while a change is joint).
    pub voters: BTreeSet<u64>,
    /// The voters a joint change leads to (its last configuration; the
    /// voters themselves when the membership is uniform).
    pub goal: BTreeSet<u64>,
    /// Every node (voters and learners): Raft id → address.
    pub nodes: BTreeMap<u64, String>,
    /// Raft id → the last log index known replicated to it.
    pub matched: BTreeMap<u64, u64>,
    /// The leader's last log index.
    pub last_index: u64,
    /// Whether the membership is in a joint configuration (a change is
    /// under way; openraft takes one at a time).
    pub joint: bool,
    /// The log index of the membership in effect.
    pub membership_index: Option<u64>,
    /// Whether the joint configuration is one an earlier pass saw already
    /// (so no change in flight on this leader is about to finish it).
    pub joint_seen_before: bool,
}

impl MembershipView {
    /// The view of the leader whose metrics these are; `None` on any other
    /// replica.
    pub fn of(m: &RaftMetrics<u64, BasicNode>) -> Option<MembershipView> {
        if m.state != ServerState::Leader {
            return None;
        }
        let membership = m.membership_config.membership();
        let replication = m.replication.as_ref()?;
        let mut matched: BTreeMap<u64, u64> = replication
            .iter()
            .filter_map(|(id, l)| l.map(|l| (*id, l.index)))
            .collect();
        matched.insert(m.id, m.last_log_index.unwrap_or(0));
        Some(MembershipView {
            voters: membership.voter_ids().collect(),
            goal: membership
                .get_joint_config()
                .last()
                .cloned()
                .unwrap_or_default(),
            nodes: membership
                .nodes()
                .map(|(id, n)| (*id, n.addr.clone()))
                .collect(),
            matched,
            last_index: m.last_log_index.unwrap_or(0),
            joint: membership.get_joint_config().len() > 1,
            membership_index: m.membership_config.log_id().map(|l| l.index),
            joint_seen_before: false,
        })
    }
}

/// How far behind the leader's last index a learner may be and still count
/// as caught up (a busy cluster appends while it catches up). Promoting it
/// is safe at any lag; the slack only keeps the new voter from slowing
/// commits at once.
pub const CATCH_UP_SLACK_ENTRIES: u64 = 64;

/// One step of re-admitting a member that came back with a new incarnation.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Repair {
    /// `raft_id` answered at `replacing`'s address: add it as a learner.
    AddLearner {
        raft_id: u64,
        addr: String,
        replacing: u64,
    },
    /// The learner `by` has caught up: one joint change makes it a voter
    /// and retires `retired` (the voters become `voters`).
    Replace {
        retired: u64,
        by: u64,
        voters: BTreeSet<u64>,
    },
    /// A learner whose member answered with a newer incarnation since:
    /// remove it (the newer one is added next).
    RemoveLearner { raft_id: u64 },
    /// A joint membership whose second step never came (its leader was
    /// lost between the two): change to its goal. Until then every commit
    /// needs majorities of both configurations.
    FinishJoint { voters: BTreeSet<u64> },
}

/// The next repair step, if any (pure): a joint change left half done (seen
/// by an earlier pass already, so not one whose second step is on its way)
/// is finished first, then promotions, stale learners, new incarnations;
/// one step at a time, none while a joint change may still finish itself.
pub fn plan(view: &MembershipView, strangers: &BTreeMap<u64, u64>) -> Option<Repair> {
    if view.joint {
        return view.joint_seen_before.then(|| Repair::FinishJoint {
            voters: view.goal.clone(),
        });
    }
    let learners = || view.nodes.keys().filter(|id| !view.voters.contains(id));
    for learner in learners() {
        let member = member_of(*learner);
        let Some(retired) = view
            .voters
            .iter()
            .find(|v| member_of(**v) == member && *v != learner)
        else {
            continue;
        };
        let superseded = strangers
            .get(learner)
            .is_some_and(|found| !view.nodes.contains_key(found));
        let matched = view.matched.get(learner).copied();
        if !superseded && matched.is_some_and(|m| m + CATCH_UP_SLACK_ENTRIES >= view.last_index) {
            let mut voters = view.voters.clone();
            voters.remove(retired);
            voters.insert(*learner);
            return Some(Repair::Replace {
                retired: *retired,
                by: *learner,
                voters,
            });
        }
    }
    for learner in learners() {
        if strangers
            .get(learner)
            .is_some_and(|found| !view.nodes.contains_key(found))
        {
            return Some(Repair::RemoveLearner { raft_id: *learner });
        }
    }
    for (addressed, found) in strangers {
        let Some(addr) = view.nodes.get(addressed) else {
            continue;
        };
        let member = member_of(*found);
        let taken = view
            .nodes
            .keys()
            .any(|id| member_of(*id) == member && id != addressed);
        if member_of(*addressed) == member && !view.nodes.contains_key(found) && !taken {
            return Some(Repair::AddLearner {
                raft_id: *found,
                addr: addr.clone(),
                replacing: *addressed,
            });
        }
    }
    None
}

/// How long one repair step may take before the next pass tries again.
const REPAIR_STEP_TIMEOUT: Duration = Duration::from_secs(10);

/// The leader's repair: what the network learnt of other incarnations, and
/// what the last pass saw.
#[derive(Debug, Default)]
pub struct Repairer {
    pub strangers: Strangers,
    /// The index of the joint membership the last pass saw, if any.
    joint_seen: Option<u64>,
}

impl Repairer {
    pub fn new(strangers: Strangers) -> Repairer {
        Repairer {
            strangers,
            joint_seen: None,
        }
    }

    /// Plans and takes one repair step on `raft` if it leads.
    pub async fn step(&mut self, raft: &Raft) -> Result<Option<Repair>, String> {
        let Some(mut view) = MembershipView::of(&raft.metrics().borrow()) else {
            self.joint_seen = None;
            return Ok(None);
        };
        view.joint_seen_before = view.joint && self.joint_seen == view.membership_index;
        self.joint_seen = view.membership_index.filter(|_| view.joint);
        repair_once(raft, &self.strangers, &view).await
    }
}

/// Takes the step [`plan`] names for `view` (the leader's, read just now)
/// on `raft`: a membership change through openraft, so it is an entry in
/// the log. Returns the step taken.
async fn repair_once(
    raft: &Raft,
    strangers: &Strangers,
    view: &MembershipView,
) -> Result<Option<Repair>, String> {
    strangers.forget_outside(&view.nodes);
    let Some(step) = plan(view, &strangers.snapshot()) else {
        return Ok(None);
    };
    announce(&step);
    let change = async {
        match &step {
            Repair::AddLearner { raft_id, addr, .. } => {
                raft.add_learner(*raft_id, BasicNode { addr: addr.clone() }, false)
                    .await
            }
            Repair::Replace { voters, .. } | Repair::FinishJoint { voters } => {
                raft.change_membership(ChangeMembers::ReplaceAllVoters(voters.clone()), false)
                    .await
            }
            Repair::RemoveLearner { raft_id } => {
                raft.change_membership(
                    ChangeMembers::RemoveNodes(BTreeSet::from([*raft_id])),
                    false,
                )
                .await
            }
        }
        .map(|_| ())
        .map_err(|e| e.to_string())
    };
    match tokio::time::timeout(REPAIR_STEP_TIMEOUT, change).await {
        Err(_) => Err(format!(
            "{step:?}: no answer within {REPAIR_STEP_TIMEOUT:?}"
        )),
        Ok(Err(e)) => Err(format!("{step:?}: {e}")),
        Ok(Ok(())) => Ok(Some(step)),
    }
}

/// Logs a repair step as it is taken, for the operator.
fn announce(step: &Repair) {
    match step {
        Repair::AddLearner {
            raft_id,
            addr,
            replacing,
        } => tracing::info!(
            new = %show(*raft_id),
            old = %show(*replacing),
            addr,
            "re-admitting a member with a new data directory: adding it as a learner"
        ),
        Repair::Replace { retired, by, .. } => tracing::info!(
            new = %show(*by),
            old = %show(*retired),
            "the new incarnation has caught up: it replaces the old one as a voter"
        ),
        Repair::FinishJoint { voters } => tracing::info!(
            voters = %voters.iter().map(|v| show(*v)).collect::<Vec<_>>().join(","),
            "finishing a joint membership change"
        ),
        Repair::RemoveLearner { raft_id } => tracing::info!(
            learner = %show(*raft_id),
            "removing a learner whose member came back with another incarnation"
        ),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn view(voters: &[u64], learners: &[u64], matched: &[(u64, u64)], last: u64) -> MembershipView {
        MembershipView {
            voters: voters.iter().copied().collect(),
            goal: voters.iter().copied().collect(),
            nodes: voters
                .iter()
                .chain(learners)
                .map(|id| (*id, format!("addr-{}", member_of(*id))))
                .collect(),
            matched: matched.iter().copied().collect(),
            last_index: last,
            joint: false,
            membership_index: Some(1),
            joint_seen_before: false,
        }
    }

    #[test]
    fn ids_carry_the_member_and_its_incarnation() {
        let id = raft_id(3, 0xabc);
        assert_eq!(member_of(id), 3);
        assert_eq!(incarnation_of(id), 0xabc);
        assert_eq!(raft_id(3, 0), 3, "incarnation 0 is the bare member id");
        assert_eq!(show(id), "3.000000000abc");
        assert_eq!(show(3), "3");
    }

    #[test]
    fn a_new_incarnation_is_a_learner_until_it_has_caught_up_then_replaces_the_old() {
        let (one, two, old3, new3) = (raft_id(1, 1), raft_id(2, 2), raft_id(3, 3), raft_id(3, 9));
        let strangers = BTreeMap::from([(old3, new3)]);
        // Nothing seen: nothing to do.
        let v = view(&[one, two, old3], &[], &[], 100);
        assert_eq!(plan(&v, &BTreeMap::new()), None);
        // The old incarnation's address answered with a new one.
        assert_eq!(
            plan(&v, &strangers),
            Some(Repair::AddLearner {
                raft_id: new3,
                addr: "addr-3".into(),
                replacing: old3
            })
        );
        // A learner, behind: wait.
        let v = view(&[one, two, old3], &[new3], &[(new3, 10)], 100);
        assert_eq!(plan(&v, &strangers), None);
        // Caught up (within the slack): replace in one change.
        let v = view(&[one, two, old3], &[new3], &[(new3, 90)], 100);
        assert_eq!(
            plan(&v, &strangers),
            Some(Repair::Replace {
                retired: old3,
                by: new3,
                voters: BTreeSet::from([one, two, new3])
            })
        );
        // Without the stranger (a new leader that never contacted the old
        // incarnation), the learner sharing a voter's member id is enough.
        assert!(matches!(
            plan(&v, &BTreeMap::new()),
            Some(Repair::Replace { .. })
        ));
        // Done: nothing more, even with the stale record.
        let v = view(&[one, two, new3], &[], &[], 100);
        assert_eq!(plan(&v, &strangers), None);
        // A joint change whose leader was lost before its second step:
        // finished first (to its goal), whatever else is pending.
        let mut v = view(&[one, two, old3, new3], &[], &[(new3, 100)], 100);
        v.goal = BTreeSet::from([one, two, new3]);
        v.joint = true;
        assert_eq!(
            plan(&v, &strangers),
            None,
            "first seen: its own leader's second step may be on its way"
        );
        v.joint_seen_before = true;
        assert_eq!(
            plan(&v, &strangers),
            Some(Repair::FinishJoint {
                voters: BTreeSet::from([one, two, new3])
            })
        );
    }

    #[test]
    fn a_learner_wiped_again_is_swapped_for_the_newest_incarnation() {
        let (one, two, old3, new3, newer3) = (
            raft_id(1, 1),
            raft_id(2, 2),
            raft_id(3, 3),
            raft_id(3, 9),
            raft_id(3, 12),
        );
        let v = view(&[one, two, old3], &[new3], &[(new3, 100)], 100);
        let strangers = BTreeMap::from([(old3, new3), (new3, newer3)]);
        assert_eq!(
            plan(&v, &strangers),
            Some(Repair::RemoveLearner { raft_id: new3 })
        );
        let v = view(&[one, two, old3], &[], &[], 100);
        assert_eq!(
            plan(&v, &BTreeMap::from([(old3, newer3)])),
            Some(Repair::AddLearner {
                raft_id: newer3,
                addr: "addr-3".into(),
                replacing: old3
            })
        );
    }

    #[test]
    fn a_member_not_asked_at_bootstrap_joins_the_same_way() {
        let (one, two, three) = (raft_id(1, 1), raft_id(2, 2), raft_id(3, 5));
        // Member 3 was down at the first start: named by its member id.
        let v = view(&[one, two, 3], &[], &[], 10);
        assert_eq!(
            plan(&v, &BTreeMap::from([(3, three)])),
            Some(Repair::AddLearner {
                raft_id: three,
                addr: "addr-3".into(),
                replacing: 3
            })
        );
    }

    #[test]
    fn another_members_answer_is_not_a_stranger() {
        let strangers = Strangers::default();
        strangers.saw(raft_id(3, 1), raft_id(4, 1));
        strangers.saw(raft_id(3, 1), raft_id(3, 1));
        assert!(strangers.snapshot().is_empty());
        strangers.saw(raft_id(3, 1), raft_id(3, 2));
        assert_eq!(strangers.snapshot().len(), 1);
        // The addressed incarnation answers as itself again: forgotten.
        strangers.answered(raft_id(3, 1));
        assert!(strangers.snapshot().is_empty());
    }

    #[test]
    fn the_incarnation_is_made_once_and_only_for_a_fresh_directory() {
        let dir = tempfile::tempdir().expect("tempdir");
        let path = dir.path().join("incarnation");
        assert_eq!(
            load_or_create_incarnation(&path, false).expect("old"),
            0,
            "a directory with Raft state and no file predates incarnations"
        );
        assert!(!path.exists());
        let made = load_or_create_incarnation(&path, true).expect("made");
        assert_ne!(made, 0);
        assert_eq!(load_or_create_incarnation(&path, true).expect("read"), made);
        std::fs::write(&path, "zz").expect("write");
        assert!(matches!(
            load_or_create_incarnation(&path, false),
            Err(IncarnationError::Corrupt { .. })
        ));
    }
}
