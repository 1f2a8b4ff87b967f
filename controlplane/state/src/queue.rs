//! Queues (issue 23, item 1): how teams share one cluster. A queue has a
//! quota of GPUs per type (its nominal share), may belong to a cohort whose
//! members borrow each other's unused quota within limits, and a weight
//! for sharing what lies beyond every quota. A job names its queue
//! (`queue` in its spec; none: [`DEFAULT_QUEUE`]).
//!
//! Queues are replicated state, made and changed by `CreateQueue`,
//! `UpdateQueue` and `DeleteQueue`. The default queue always exists: until
//! an operator gives it a quota (`UpdateQueue`) it has none, and its jobs
//! may use any GPU.
//!
//! Absences: no clock, no scheduling (admission within quotas is the
//! scheduler's, above the policies); this module knows what a queue is
//! and which changes are valid.

use std::collections::BTreeMap;

use serde::{Deserialize, Serialize};

/// The queue of a job whose spec names none.
pub const DEFAULT_QUEUE: &str = "default";

/// Limits on what the queue commands carry.
pub mod limits {
    /// A queue's or a cohort's name: 1 to this many bytes (a DNS label).
    pub const QUEUE_NAME_MAX_LEN: usize = 63;
    /// The most queues a cluster keeps (the default one aside).
    pub const QUEUES_MAX: usize = 1_000;
    /// The most GPU types one quota or limit names.
    pub const QUOTA_TYPES_MAX: usize = 64;
    /// The most GPUs of one type a quota or limit gives.
    pub const QUOTA_GPUS_MAX: u32 = 1_000_000;
    /// A queue's weight: 1 to this.
    pub const WEIGHT_MAX: u32 = 1_000;
}

/// What an operator says of a queue.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct QueueSpec {
    /// GPUs of each type the queue is guaranteed (its nominal quota); a
    /// type it does not name: none. `None`: no quota at all, its jobs may
    /// use any GPU (the default queue until it is given one).
    pub quota: Option<BTreeMap<String, u32>>,
    /// The cohort whose members lend each other unused quota (`None`: it
    /// neither borrows nor lends).
    pub cohort: Option<String>,
    /// At most this many GPUs of a type borrowed beyond its quota; a type
    /// not named: as many as the cohort has unused.
    pub borrow_limit: BTreeMap<String, u32>,
    /// At most this many of its unused GPUs of a type lent to the cohort;
    /// a type not named: all of them.
    pub lend_limit: BTreeMap<String, u32>,
    /// Its share of the GPUs beyond every quota, against the other queues'
    /// weights (1 to [`limits::WEIGHT_MAX`]).
    pub weight: u32,
}

/// A queue as the state keeps it.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Queue {
    pub spec: QueueSpec,
    /// When it was created, or last changed (log time).
    pub changed_at_ms: u64,
    /// Who made the last change (the entry's actor).
    pub changed_by: Option<String>,
}

/// Why a queue command is refused.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error, Serialize, Deserialize)]
pub enum QueueError {
    #[error("a queue named {0:?} exists already")]
    Exists(String),
    #[error("no queue is named {0:?}")]
    Unknown(String),
    #[error("queue {name:?} holds {jobs} unfinished jobs (job {first} the first); cancel them, or wait for them to end, before deleting it")]
    HoldsJobs {
        name: String,
        jobs: usize,
        first: u64,
    },
    #[error("the default queue cannot be deleted")]
    DefaultKept,
    #[error("the cluster holds {limit} queues, the limit; delete some first")]
    TooMany { limit: usize },
    #[error("{field} is invalid: {reason}")]
    Invalid { field: String, reason: String },
}

fn invalid(field: &str, reason: String) -> QueueError {
    QueueError::Invalid {
        field: field.into(),
        reason,
    }
}

/// Checks a queue's (or a cohort's, `field`) name: 1 to
/// [`limits::QUEUE_NAME_MAX_LEN`] lower-case letters, digits and `-`,
/// starting with a letter or digit.
pub fn validate_queue_name(field: &str, name: &str) -> Result<(), QueueError> {
    let ok = !name.is_empty()
        && name.len() <= limits::QUEUE_NAME_MAX_LEN
        && !name.starts_with('-')
        && name
            .bytes()
            .all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b == b'-');
    if ok {
        Ok(())
    } else {
        Err(invalid(
            field,
            format!(
                "{name:?} is not a queue name (1 to {} lower-case letters, digits and '-', not starting with '-')",
                limits::QUEUE_NAME_MAX_LEN
            ),
        ))
    }
}

impl QueueSpec {
    /// A queue with a quota and weight 1, in no cohort.
    pub fn with_quota(quota: BTreeMap<String, u32>) -> QueueSpec {
        QueueSpec {
            quota: Some(quota),
            weight: 1,
            ..QueueSpec::default()
        }
    }

    /// Checks the spec's form and that every GPU type it names is one of
    /// `known_types` (the cluster's); names the field at fault.
    pub fn validate<'a>(&self, known_types: impl Fn(&str) -> bool + 'a) -> Result<(), QueueError> {
        let check = |field: &str, map: &BTreeMap<String, u32>| -> Result<(), QueueError> {
            if map.len() > limits::QUOTA_TYPES_MAX {
                return Err(invalid(
                    field,
                    format!(
                        "names {} GPU types; the limit is {}",
                        map.len(),
                        limits::QUOTA_TYPES_MAX
                    ),
                ));
            }
            for (gpu_type, gpus) in map {
                if !known_types(gpu_type) {
                    return Err(invalid(
                        field,
                        format!(
                            "GPU type {gpu_type:?} is not one of this cluster's (keel nodes lists them)"
                        ),
                    ));
                }
                if *gpus > limits::QUOTA_GPUS_MAX {
                    return Err(invalid(
                        field,
                        format!(
                            "{gpus} {gpu_type} GPUs is more than the limit of {}",
                            limits::QUOTA_GPUS_MAX
                        ),
                    ));
                }
            }
            Ok(())
        };
        if let Some(quota) = &self.quota {
            check("quota", quota)?;
        }
        check("borrow_limit", &self.borrow_limit)?;
        check("lend_limit", &self.lend_limit)?;
        if let Some(cohort) = &self.cohort {
            validate_queue_name("cohort", cohort)?;
        } else if !self.borrow_limit.is_empty() || !self.lend_limit.is_empty() {
            return Err(invalid(
                "cohort",
                "borrowing and lending limits need a cohort to borrow from and lend to".into(),
            ));
        }
        if !(1..=limits::WEIGHT_MAX).contains(&self.weight) {
            return Err(invalid(
                "weight",
                format!("{} is outside 1 to {}", self.weight, limits::WEIGHT_MAX),
            ));
        }
        Ok(())
    }
}

/// The cluster's queues (the default one only once it is changed).
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct Queues {
    queues: BTreeMap<String, Queue>,
}

impl Queues {
    /// The queues, by name, as [`Queues::create`] and
    /// [`Queues::update`] left them (for snapshots).
    pub fn from_parts(queues: BTreeMap<String, Queue>) -> Queues {
        Queues { queues }
    }

    /// Whether none was ever made or changed: a state without queues
    /// encodes and hashes as before queues existed.
    pub fn is_unset(&self) -> bool {
        self.queues.is_empty()
    }

    /// Every queue but an unchanged default one, by name.
    pub fn stored(&self) -> &BTreeMap<String, Queue> {
        &self.queues
    }

    /// Whether jobs may name `name` (the default queue always exists).
    pub fn exists(&self, name: &str) -> bool {
        name == DEFAULT_QUEUE || self.queues.contains_key(name)
    }

    /// The spec of queue `name`: the default queue's is "no quota, weight
    /// 1" until it is changed.
    pub fn spec(&self, name: &str) -> Option<QueueSpec> {
        match self.queues.get(name) {
            Some(q) => Some(q.spec.clone()),
            None if name == DEFAULT_QUEUE => Some(QueueSpec {
                weight: 1,
                ..QueueSpec::default()
            }),
            None => None,
        }
    }

    /// Every queue, the default one included, by name.
    pub fn all(&self) -> BTreeMap<String, QueueSpec> {
        let mut all: BTreeMap<String, QueueSpec> = self
            .queues
            .iter()
            .map(|(n, q)| (n.clone(), q.spec.clone()))
            .collect();
        if let Some(default) = self.spec(DEFAULT_QUEUE) {
            all.entry(DEFAULT_QUEUE.into()).or_insert(default);
        }
        all
    }

    /// Every queue, the default one included, by name, borrowed (the
    /// default one's spec made when no operator changed it).
    pub fn each(&self) -> BTreeMap<&str, std::borrow::Cow<'_, QueueSpec>> {
        let mut each: BTreeMap<&str, std::borrow::Cow<'_, QueueSpec>> = self
            .queues
            .iter()
            .map(|(n, q)| (n.as_str(), std::borrow::Cow::Borrowed(&q.spec)))
            .collect();
        if !each.contains_key(DEFAULT_QUEUE) {
            if let Some(default) = self.spec(DEFAULT_QUEUE) {
                each.insert(DEFAULT_QUEUE, std::borrow::Cow::Owned(default));
            }
        }
        each
    }

    /// Makes queue `name` (validated already, see [`QueueSpec::validate`]).
    pub fn create(
        &mut self,
        name: &str,
        spec: &QueueSpec,
        at_ms: u64,
        actor: Option<&String>,
    ) -> Result<(), QueueError> {
        validate_queue_name("name", name)?;
        if self.exists(name) {
            return Err(QueueError::Exists(name.into()));
        }
        if spec.quota.is_none() {
            return Err(invalid(
                "quota",
                "a queue needs a quota (GPUs per type; an empty one for a queue that only borrows)"
                    .into(),
            ));
        }
        if self.queues.len() >= limits::QUEUES_MAX {
            return Err(QueueError::TooMany {
                limit: limits::QUEUES_MAX,
            });
        }
        self.put(name, spec, at_ms, actor);
        Ok(())
    }

    fn put(&mut self, name: &str, spec: &QueueSpec, at_ms: u64, actor: Option<&String>) {
        self.queues.insert(
            name.into(),
            Queue {
                spec: spec.clone(),
                changed_at_ms: at_ms,
                changed_by: actor.cloned(),
            },
        );
    }

    /// Replaces queue `name`'s spec (validated already).
    pub fn update(
        &mut self,
        name: &str,
        spec: &QueueSpec,
        at_ms: u64,
        actor: Option<&String>,
    ) -> Result<(), QueueError> {
        validate_queue_name("name", name)?;
        if !self.exists(name) {
            return Err(QueueError::Unknown(name.into()));
        }
        if spec.quota.is_none() && name != DEFAULT_QUEUE {
            return Err(invalid("quota", "a queue needs a quota".into()));
        }
        self.put(name, spec, at_ms, actor);
        Ok(())
    }

    /// Removes queue `name`; `unfinished` are the unfinished jobs that
    /// name it (it is refused while there are any).
    pub fn delete(&mut self, name: &str, unfinished: &[u64]) -> Result<(), QueueError> {
        validate_queue_name("name", name)?;
        if name == DEFAULT_QUEUE {
            return Err(QueueError::DefaultKept);
        }
        if !self.queues.contains_key(name) {
            return Err(QueueError::Unknown(name.into()));
        }
        if let Some(first) = unfinished.first() {
            return Err(QueueError::HoldsJobs {
                name: name.into(),
                jobs: unfinished.len(),
                first: *first,
            });
        }
        self.queues.remove(name);
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn quota(pairs: &[(&str, u32)]) -> BTreeMap<String, u32> {
        pairs.iter().map(|(t, n)| (t.to_string(), *n)).collect()
    }

    #[test]
    fn names_and_specs_are_checked_naming_the_field() {
        let known = |t: &str| ["v100", "a100"].contains(&t);
        for bad in ["", "Team", "-a", "a_b", &"a".repeat(64)] {
            let e = validate_queue_name("name", bad).expect_err(bad);
            assert!(
                matches!(&e, QueueError::Invalid { field, .. } if field == "name"),
                "{e}"
            );
        }
        validate_queue_name("name", "team-a1").expect("valid");
        let field_of = |spec: QueueSpec| match spec.validate(known) {
            Err(QueueError::Invalid { field, .. }) => field,
            other => panic!("{other:?}"),
        };
        assert_eq!(
            field_of(QueueSpec::with_quota(quota(&[("h100", 4)]))),
            "quota",
            "an unknown type"
        );
        assert_eq!(
            field_of(QueueSpec::with_quota(quota(&[(
                "v100",
                limits::QUOTA_GPUS_MAX + 1
            )]))),
            "quota"
        );
        let mut spec = QueueSpec::with_quota(quota(&[("v100", 4)]));
        spec.borrow_limit = quota(&[("v100", 2)]);
        assert_eq!(field_of(spec.clone()), "cohort", "limits need a cohort");
        spec.cohort = Some("Research".into());
        assert_eq!(field_of(spec.clone()), "cohort");
        spec.cohort = Some("research".into());
        spec.lend_limit = quota(&[("k80", 1)]);
        assert_eq!(field_of(spec.clone()), "lend_limit");
        spec.lend_limit.clear();
        spec.weight = 0;
        assert_eq!(field_of(spec.clone()), "weight");
        spec.weight = 3;
        spec.validate(known).expect("valid");
    }

    #[test]
    fn the_default_queue_exists_and_is_kept_and_a_queue_holding_jobs_is_kept() {
        let mut queues = Queues::default();
        assert!(queues.is_unset() && queues.exists(DEFAULT_QUEUE) && !queues.exists("a"));
        assert_eq!(queues.spec(DEFAULT_QUEUE).and_then(|s| s.quota), None);
        let spec = QueueSpec::with_quota(quota(&[("v100", 4)]));
        assert_eq!(
            queues.create(DEFAULT_QUEUE, &spec, 1, None),
            Err(QueueError::Exists(DEFAULT_QUEUE.into()))
        );
        queues.create("a", &spec, 1, None).expect("created");
        assert_eq!(
            queues.create("a", &spec, 2, None),
            Err(QueueError::Exists("a".into()))
        );
        assert!(matches!(
            queues.create("b", &QueueSpec::default(), 2, None),
            Err(QueueError::Invalid { field, .. }) if field == "quota"
        ));
        assert_eq!(
            queues.update("b", &spec, 2, None),
            Err(QueueError::Unknown("b".into()))
        );
        // The default queue may be given a quota, and back to none.
        queues
            .update(DEFAULT_QUEUE, &spec, 3, None)
            .expect("updated");
        assert_eq!(queues.spec(DEFAULT_QUEUE), Some(spec.clone()));
        assert_eq!(
            queues.delete(DEFAULT_QUEUE, &[]),
            Err(QueueError::DefaultKept)
        );
        assert_eq!(
            queues.delete("a", &[4, 7]),
            Err(QueueError::HoldsJobs {
                name: "a".into(),
                jobs: 2,
                first: 4
            })
        );
        queues.delete("a", &[]).expect("deleted");
        assert!(!queues.exists("a"));
        assert_eq!(
            queues.delete("a", &[]),
            Err(QueueError::Unknown("a".into()))
        );
        assert_eq!(queues.all().keys().collect::<Vec<_>>(), vec![DEFAULT_QUEUE]);
    }
}
