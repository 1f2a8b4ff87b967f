//! The job spec users submit (YAML or JSON), and its validation.
//!
//! Every string and list has a size limit; [`JobSpec::validate`] names the
//! field and the limit it broke. Unknown fields are rejected at parse time
//! (`deny_unknown_fields`), so a typo never silently becomes a default.

use std::collections::BTreeMap;

use serde::{Deserialize, Serialize};

pub use crate::resources::{LogLimits, Resources};
pub use crate::secret::SecretRef;

/// Size and range limits on a job spec. Public so clients can show them.
pub mod limits {
    pub const NAME_MAX_LEN: usize = 128;
    pub const USER_MAX_LEN: usize = 64;
    pub const COMMAND_MAX_ARGS: usize = 256;
    pub const COMMAND_ARG_MAX_LEN: usize = 4096;
    pub const IMAGE_MAX_LEN: usize = 512;
    pub const ENV_MAX_ENTRIES: usize = 128;
    pub const ENV_KEY_MAX_LEN: usize = 256;
    pub const ENV_VALUE_MAX_LEN: usize = 8192;
    pub const GPUS_PER_WORKER_MAX: u32 = 64;
    pub const WORKERS_MAX: u32 = 1024;
    pub const GPU_TYPES_MAX: usize = 16;
    pub const GPU_TYPE_MAX_LEN: usize = 32;
    pub const MODEL_MAX_LEN: usize = 128;
    pub const TOTAL_STEPS_MAX: u64 = 1_000_000_000_000;
    pub const EPOCHS_MAX: u32 = 1_000_000;
    pub const PRIORITY_MIN: i32 = -1000;
    pub const PRIORITY_MAX: i32 = 1000;
    pub const MAX_RETRIES_MAX: u32 = 100;
    pub const RETRY_BACKOFF_MAX_S: u32 = 3600;
    /// The wait before a retry doubles with each failure, up to this.
    pub const RETRY_BACKOFF_CAP_S: u64 = 600;
}

/// What a user asks to run.
///
/// Its written form (YAML, JSON: human-readable serde) is derived; its
/// binary form (postcard: the state's hash, snapshots up to format 6 and
/// Raft wire format 1) is [`SpecRecord`], the layout before `resources`
/// existed, so states and snapshots of earlier releases read and hash as
/// they did. `resources` and `logs` travel in protobuf (entries,
/// snapshots, Raft wire format 2) and are hashed apart
/// ([`crate::ClusterState::state_hash`]).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(remote = "Self", deny_unknown_fields)]
pub struct JobSpec {
    pub name: String,
    #[serde(default)]
    pub user: String,
    /// The program and its arguments (argv). Either this or `image` is required.
    #[serde(default)]
    pub command: Vec<String>,
    /// A container image, for executors that run containers.
    #[serde(default)]
    pub image: Option<String>,
    /// Plain variables. In the written form a variable may instead name a
    /// secret (`WANDB_API_KEY: {secret: tracker/key}`), which goes to
    /// `secret_env`.
    #[serde(default, with = "env_form")]
    pub env: BTreeMap<String, String>,
    /// Variables whose value the executor takes from a secret at launch
    /// (issue 35): the spec, the log and every answer hold the reference
    /// only. Written inside `env` (see there); like `queue`, not in the
    /// binary form: hashed apart when set.
    #[serde(skip)]
    pub secret_env: BTreeMap<String, SecretRef>,
    /// GPUs per worker.
    #[serde(default = "one")]
    pub gpus: u32,
    #[serde(default)]
    pub workers: Workers,
    #[serde(default)]
    pub gpu_types: GpuTypes,
    /// Model name, used to look up throughput tables.
    #[serde(default)]
    pub model: Option<String>,
    #[serde(default)]
    pub total_steps: Option<u64>,
    #[serde(default)]
    pub epochs: Option<u32>,
    /// Higher runs first under priority-aware policies.
    #[serde(default)]
    pub priority: i32,
    /// How many times a failed attempt (a worker exiting non-zero) is retried
    /// before the job fails. 0: the first failure fails the job.
    #[serde(default)]
    pub max_retries: u32,
    /// Seconds before the first retry; each further retry waits twice as
    /// long as the one before, up to `limits::RETRY_BACKOFF_CAP_S`.
    #[serde(default = "default_retry_backoff_s")]
    pub retry_backoff_s: u32,
    /// CPU and memory limits on each worker (none: unlimited).
    #[serde(default, skip_serializing_if = "Resources::is_unset")]
    pub resources: Resources,
    /// How each worker's log is rotated, within the server's maximum
    /// (none: the server's settings).
    #[serde(default, skip_serializing_if = "LogLimits::is_unset")]
    pub logs: LogLimits,
    /// The queue it waits in (issue 23; empty: the default queue). Like
    /// `resources`, not in the binary form: hashed apart when set.
    #[serde(default, skip_serializing_if = "String::is_empty")]
    pub queue: String,
    /// Whether a running job may lose its GPUs to a policy's preemption or
    /// to reclaim (issue 23, item 4; default yes). Losing its node still
    /// stops it. Like `queue`, not in the binary form: hashed apart when
    /// false.
    #[serde(default = "yes", skip_serializing_if = "is_yes")]
    pub preemptible: bool,
}

fn yes() -> bool {
    true
}

fn is_yes(b: &bool) -> bool {
    *b
}

/// The binary layout of a [`JobSpec`] (without `resources`), frozen: see
/// [`JobSpec`].
#[derive(Serialize)]
struct SpecRecordRef<'a> {
    name: &'a String,
    user: &'a String,
    command: &'a Vec<String>,
    image: &'a Option<String>,
    env: &'a BTreeMap<String, String>,
    gpus: u32,
    workers: Workers,
    gpu_types: &'a GpuTypes,
    model: &'a Option<String>,
    total_steps: Option<u64>,
    epochs: Option<u32>,
    priority: i32,
    max_retries: u32,
    retry_backoff_s: u32,
}

/// [`SpecRecordRef`], read back.
#[derive(Deserialize)]
struct SpecRecord {
    name: String,
    user: String,
    command: Vec<String>,
    image: Option<String>,
    env: BTreeMap<String, String>,
    gpus: u32,
    workers: Workers,
    gpu_types: GpuTypes,
    model: Option<String>,
    total_steps: Option<u64>,
    epochs: Option<u32>,
    priority: i32,
    max_retries: u32,
    retry_backoff_s: u32,
}

impl Serialize for JobSpec {
    fn serialize<S: serde::Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        if s.is_human_readable() {
            if self.secret_env.is_empty() {
                return JobSpec::serialize(self, s);
            }
            // The written form keeps the references inside `env`.
            let mut written = self.clone();
            for (name, reference) in std::mem::take(&mut written.secret_env) {
                written.env.insert(name, env_form::encode(&reference));
            }
            return JobSpec::serialize(&written, s);
        }
        SpecRecordRef {
            name: &self.name,
            user: &self.user,
            command: &self.command,
            image: &self.image,
            env: &self.env,
            gpus: self.gpus,
            workers: self.workers,
            gpu_types: &self.gpu_types,
            model: &self.model,
            total_steps: self.total_steps,
            epochs: self.epochs,
            priority: self.priority,
            max_retries: self.max_retries,
            retry_backoff_s: self.retry_backoff_s,
        }
        .serialize(s)
    }
}

impl<'de> Deserialize<'de> for JobSpec {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        if d.is_human_readable() {
            let mut spec = JobSpec::deserialize(d)?;
            let (plain, secrets) = env_form::split(std::mem::take(&mut spec.env));
            spec.env = plain;
            spec.secret_env = secrets;
            return Ok(spec);
        }
        let r = SpecRecord::deserialize(d)?;
        Ok(JobSpec {
            name: r.name,
            user: r.user,
            command: r.command,
            image: r.image,
            env: r.env,
            secret_env: BTreeMap::new(),
            gpus: r.gpus,
            workers: r.workers,
            gpu_types: r.gpu_types,
            model: r.model,
            total_steps: r.total_steps,
            epochs: r.epochs,
            priority: r.priority,
            max_retries: r.max_retries,
            retry_backoff_s: r.retry_backoff_s,
            resources: Resources::default(),
            logs: LogLimits::default(),
            queue: String::new(),
            preemptible: true,
        })
    }
}

/// The written form of `env`: each value a string, or `{secret: NAME/KEY}`
/// for a variable taken from a secret. Inside the derived form a reference
/// travels as a value no plain variable can hold (it starts with a NUL,
/// which [`JobSpec::validate`] refuses in plain values), and
/// [`JobSpec`]'s own impls move it to and from `secret_env`.
mod env_form {
    use std::collections::BTreeMap;

    use serde::de::{self, MapAccess, Visitor};
    use serde::ser::SerializeMap;
    use serde::{Deserializer, Serializer};

    use super::SecretRef;

    const MARK: &str = "\0secret:";

    pub(super) fn encode(reference: &SecretRef) -> String {
        format!("{MARK}{reference}")
    }

    /// The plain variables and the references, apart.
    pub(super) fn split(
        env: BTreeMap<String, String>,
    ) -> (BTreeMap<String, String>, BTreeMap<String, SecretRef>) {
        let mut plain = BTreeMap::new();
        let mut secrets = BTreeMap::new();
        for (name, value) in env {
            match value.strip_prefix(MARK).and_then(|r| r.split_once('/')) {
                Some((secret, key)) => {
                    secrets.insert(
                        name,
                        SecretRef {
                            name: secret.into(),
                            key: key.into(),
                        },
                    );
                }
                None => {
                    plain.insert(name, value);
                }
            }
        }
        (plain, secrets)
    }

    pub(super) fn serialize<S: Serializer>(
        env: &BTreeMap<String, String>,
        s: S,
    ) -> Result<S::Ok, S::Error> {
        let mut map = s.serialize_map(Some(env.len()))?;
        for (name, value) in env {
            match value.strip_prefix(MARK) {
                Some(reference) => {
                    let one: BTreeMap<&str, &str> = [("secret", reference)].into();
                    map.serialize_entry(name, &one)?
                }
                None => map.serialize_entry(name, value)?,
            }
        }
        map.end()
    }

    pub(super) fn deserialize<'de, D: Deserializer<'de>>(
        d: D,
    ) -> Result<BTreeMap<String, String>, D::Error> {
        d.deserialize_map(EnvVisitor)
    }

    struct EnvVisitor;

    impl<'de> Visitor<'de> for EnvVisitor {
        type Value = BTreeMap<String, String>;
        fn expecting(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
            f.write_str("a map of variable names to values or {secret: NAME/KEY}")
        }
        fn visit_map<A: MapAccess<'de>>(self, mut map: A) -> Result<Self::Value, A::Error> {
            let mut env = BTreeMap::new();
            while let Some(name) = map.next_key::<String>()? {
                let value = map.next_value::<Value>()?;
                env.insert(name, value.0);
            }
            Ok(env)
        }
    }

    /// One variable's value, a plain scalar's text or an encoded
    /// reference. A YAML number or boolean comes as its value, not its
    /// text (`0.10` as `0.1`): `keel submit` puts the text back
    /// (`keel::cli::read_spec`).
    struct Value(String);

    impl<'de> serde::Deserialize<'de> for Value {
        fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
            d.deserialize_any(ValueVisitor)
        }
    }

    struct ValueVisitor;

    impl<'de> Visitor<'de> for ValueVisitor {
        type Value = Value;
        fn expecting(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
            f.write_str("a string, or {secret: NAME/KEY}")
        }
        fn visit_str<E: de::Error>(self, v: &str) -> Result<Value, E> {
            Ok(Value(v.into()))
        }
        fn visit_string<E: de::Error>(self, v: String) -> Result<Value, E> {
            Ok(Value(v))
        }
        fn visit_bool<E: de::Error>(self, v: bool) -> Result<Value, E> {
            Ok(Value(v.to_string()))
        }
        fn visit_i64<E: de::Error>(self, v: i64) -> Result<Value, E> {
            Ok(Value(v.to_string()))
        }
        fn visit_u64<E: de::Error>(self, v: u64) -> Result<Value, E> {
            Ok(Value(v.to_string()))
        }
        fn visit_f64<E: de::Error>(self, v: f64) -> Result<Value, E> {
            Ok(Value(v.to_string()))
        }
        fn visit_map<A: MapAccess<'de>>(self, mut map: A) -> Result<Value, A::Error> {
            let mut reference = None;
            while let Some(key) = map.next_key::<String>()? {
                if key != "secret" || reference.is_some() {
                    return Err(de::Error::custom(format!(
                        "a variable from a secret is {{secret: NAME/KEY}}, not {key:?}"
                    )));
                }
                let text: String = map.next_value()?;
                let parsed = SecretRef::parse("secret", &text).map_err(de::Error::custom)?;
                reference = Some(parsed);
            }
            let reference = reference.ok_or_else(|| {
                de::Error::custom("a variable from a secret is {secret: NAME/KEY}")
            })?;
            Ok(Value(encode(&reference)))
        }
    }
}

/// The default wait before a first retry.
pub const DEFAULT_RETRY_BACKOFF_S: u32 = 10;

fn default_retry_backoff_s() -> u32 {
    DEFAULT_RETRY_BACKOFF_S
}

fn one() -> u32 {
    1
}

/// Worker count: a fixed number (`workers: 2`) or a range for elastic jobs
/// (`workers: {min: 1, max: 4}`). Binary formats (snapshots) always use the
/// `{min, max}` form.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
pub struct Workers {
    pub min: u32,
    pub max: u32,
}

impl Default for Workers {
    fn default() -> Self {
        Workers { min: 1, max: 1 }
    }
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct WorkersRange {
    min: u32,
    max: u32,
}

impl<'de> Deserialize<'de> for Workers {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        struct CountOrRange;
        impl<'de> serde::de::Visitor<'de> for CountOrRange {
            type Value = Workers;
            fn expecting(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
                f.write_str("a worker count, or {min, max}")
            }
            fn visit_u64<E: serde::de::Error>(self, n: u64) -> Result<Workers, E> {
                let n =
                    u32::try_from(n).map_err(|_| E::custom(format!("{n} workers is too many")))?;
                Ok(Workers { min: n, max: n })
            }
            fn visit_i64<E: serde::de::Error>(self, n: i64) -> Result<Workers, E> {
                let n =
                    u64::try_from(n).map_err(|_| E::custom("a worker count cannot be negative"))?;
                self.visit_u64(n)
            }
            fn visit_map<A: serde::de::MapAccess<'de>>(self, map: A) -> Result<Workers, A::Error> {
                let r =
                    WorkersRange::deserialize(serde::de::value::MapAccessDeserializer::new(map))?;
                Ok(Workers {
                    min: r.min,
                    max: r.max,
                })
            }
        }
        if d.is_human_readable() {
            d.deserialize_any(CountOrRange)
        } else {
            let r = WorkersRange::deserialize(d)?;
            Ok(Workers {
                min: r.min,
                max: r.max,
            })
        }
    }
}

/// Which GPU types a job may run on, and which it prefers.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct GpuTypes {
    /// Empty: any type.
    #[serde(default)]
    pub allowed: Vec<String>,
    #[serde(default)]
    pub preferred: Vec<String>,
}

/// A spec field broke a rule. The message names the field and the limit.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error, Serialize, Deserialize)]
pub enum SpecError {
    #[error("spec.{field} is required")]
    Missing { field: String },
    #[error("spec.{field} is {len} bytes long; the limit is {limit}")]
    TooLong {
        field: String,
        len: usize,
        limit: usize,
    },
    #[error("spec.{field} has {count} entries; the limit is {limit}")]
    TooMany {
        field: String,
        count: usize,
        limit: usize,
    },
    #[error("spec.{field} is {value}; it must be between {min} and {max}")]
    OutOfRange {
        field: String,
        value: i64,
        min: i64,
        max: i64,
    },
    #[error("spec.{field} is invalid: {reason}")]
    Invalid { field: String, reason: String },
}

fn check_len(field: &str, s: &str, limit: usize) -> Result<(), SpecError> {
    if s.len() > limit {
        return Err(SpecError::TooLong {
            field: field.to_string(),
            len: s.len(),
            limit,
        });
    }
    Ok(())
}

/// [`check_len`] for a field whose name is made (only when it is too
/// long: a spec's every argument is checked on every submission).
fn check_len_of(field: impl FnOnce() -> String, s: &str, limit: usize) -> Result<(), SpecError> {
    if s.len() > limit {
        return Err(SpecError::TooLong {
            field: field(),
            len: s.len(),
            limit,
        });
    }
    Ok(())
}

/// Checks an environment variable's name.
fn check_env_name(k: &str) -> Result<(), SpecError> {
    check_len("env key", k, limits::ENV_KEY_MAX_LEN)?;
    let valid_key = k
        .bytes()
        .next()
        .is_some_and(|b| b.is_ascii_alphabetic() || b == b'_')
        && k.bytes().all(|b| b.is_ascii_alphanumeric() || b == b'_');
    if !valid_key {
        return Err(SpecError::Invalid {
            field: format!("env.{k}"),
            reason: "a variable name is letters, digits and '_', not starting with a digit".into(),
        });
    }
    Ok(())
}

fn check_count(field: &str, count: usize, limit: usize) -> Result<(), SpecError> {
    if count > limit {
        return Err(SpecError::TooMany {
            field: field.to_string(),
            count,
            limit,
        });
    }
    Ok(())
}

fn check_range(field: &str, value: i64, min: i64, max: i64) -> Result<(), SpecError> {
    if value < min || value > max {
        return Err(SpecError::OutOfRange {
            field: field.to_string(),
            value,
            min,
            max,
        });
    }
    Ok(())
}

/// Whether `name` follows the rule for names (jobs, nodes): letters,
/// digits, '-', '_' and '.', not starting with '.'.
pub fn is_valid_name(name: &str) -> bool {
    !name.is_empty()
        && !name.starts_with('.')
        && name
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || b == b'-' || b == b'_' || b == b'.')
}

/// Whether `t` is a GPU type name: lower-case letters, digits, '-', '_'.
pub fn is_valid_gpu_type(t: &str) -> bool {
    !t.is_empty()
        && t.bytes()
            .all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b == b'-' || b == b'_')
}

fn check_gpu_types(field: &str, types: &[String]) -> Result<(), SpecError> {
    use limits::*;
    check_count(field, types.len(), GPU_TYPES_MAX)?;
    for (i, t) in types.iter().enumerate() {
        let f = format!("{field}[{i}]");
        check_len(&f, t, GPU_TYPE_MAX_LEN)?;
        if !is_valid_gpu_type(t) {
            return Err(SpecError::Invalid {
                field: f,
                reason: format!("{t:?} is not a lower-case GPU type name such as \"v100\""),
            });
        }
    }
    Ok(())
}

impl JobSpec {
    /// Checks every field against [`limits`]. The first broken rule is returned.
    pub fn validate(&self) -> Result<(), SpecError> {
        use limits::*;
        if self.name.is_empty() {
            return Err(SpecError::Missing {
                field: "name".into(),
            });
        }
        check_len("name", &self.name, NAME_MAX_LEN)?;
        if !self
            .name
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || b == b'-' || b == b'_' || b == b'.')
        {
            return Err(SpecError::Invalid {
                field: "name".into(),
                reason: "only letters, digits, '-', '_' and '.' are allowed".into(),
            });
        }
        check_len("user", &self.user, USER_MAX_LEN)?;
        if !self.queue.is_empty() {
            crate::queue::validate_queue_name("queue", &self.queue).map_err(|e| {
                SpecError::Invalid {
                    field: "queue".into(),
                    reason: match e {
                        crate::queue::QueueError::Invalid { reason, .. } => reason,
                        other => other.to_string(),
                    },
                }
            })?;
        }
        if self.command.is_empty() && self.image.as_deref().is_none_or(str::is_empty) {
            return Err(SpecError::Missing {
                field: "command (or image)".into(),
            });
        }
        check_count("command", self.command.len(), COMMAND_MAX_ARGS)?;
        for (i, arg) in self.command.iter().enumerate() {
            check_len_of(|| format!("command[{i}]"), arg, COMMAND_ARG_MAX_LEN)?;
        }
        if self.command.first().is_some_and(String::is_empty) {
            return Err(SpecError::Invalid {
                field: "command[0]".into(),
                reason: "the program name is empty".into(),
            });
        }
        if let Some(image) = &self.image {
            check_len("image", image, IMAGE_MAX_LEN)?;
        }
        check_count("env", self.env.len(), ENV_MAX_ENTRIES)?;
        for (k, v) in &self.env {
            check_env_name(k)?;
            check_len_of(|| format!("env.{k}"), v, ENV_VALUE_MAX_LEN)?;
            if v.contains('\0') {
                return Err(SpecError::Invalid {
                    field: format!("env.{k}"),
                    reason: "a variable's value cannot hold a NUL byte".into(),
                });
            }
        }
        check_count(
            "env",
            self.env.len() + self.secret_env.len(),
            ENV_MAX_ENTRIES,
        )?;
        for (k, reference) in &self.secret_env {
            let field = format!("env.{k}");
            check_env_name(k)?;
            if self.env.contains_key(k) {
                return Err(SpecError::Invalid {
                    field,
                    reason: "a variable is either a plain value or a secret, not both".into(),
                });
            }
            if reference.key.is_empty() {
                return Err(SpecError::Invalid {
                    field,
                    reason: format!(
                        "{:?} is not a secret reference: NAME/KEY, e.g. tracker/api_key",
                        reference.name
                    ),
                });
            }
            reference.validate(&field).map_err(|e| SpecError::Invalid {
                field: field.clone(),
                reason: match e {
                    crate::secret::SecretError::Invalid { reason, .. } => reason,
                    other => other.to_string(),
                },
            })?;
        }
        check_range("gpus", self.gpus.into(), 1, GPUS_PER_WORKER_MAX.into())?;
        check_range(
            "workers.min",
            self.workers.min.into(),
            1,
            WORKERS_MAX.into(),
        )?;
        check_range(
            "workers.max",
            self.workers.max.into(),
            self.workers.min.into(),
            WORKERS_MAX.into(),
        )?;
        check_gpu_types("gpu_types.allowed", &self.gpu_types.allowed)?;
        check_gpu_types("gpu_types.preferred", &self.gpu_types.preferred)?;
        if let Some(model) = &self.model {
            check_len("model", model, MODEL_MAX_LEN)?;
        }
        if let Some(steps) = self.total_steps {
            check_range(
                "total_steps",
                i64::try_from(steps).unwrap_or(i64::MAX),
                1,
                TOTAL_STEPS_MAX as i64,
            )?;
        }
        if let Some(epochs) = self.epochs {
            check_range("epochs", epochs.into(), 1, EPOCHS_MAX.into())?;
        }
        check_range(
            "priority",
            self.priority.into(),
            PRIORITY_MIN.into(),
            PRIORITY_MAX.into(),
        )?;
        check_range(
            "max_retries",
            self.max_retries.into(),
            0,
            MAX_RETRIES_MAX.into(),
        )?;
        check_range(
            "retry_backoff_s",
            self.retry_backoff_s.into(),
            0,
            RETRY_BACKOFF_MAX_S.into(),
        )?;
        self.resources.validate()?;
        self.logs.validate()?;
        Ok(())
    }

    /// How long a job waits before retry number `retry` (1 = the first).
    pub fn retry_backoff_ms(&self, retry: u32) -> u64 {
        let doublings = retry.saturating_sub(1).min(32);
        let s = u64::from(self.retry_backoff_s).saturating_mul(1u64 << doublings);
        s.min(limits::RETRY_BACKOFF_CAP_S.max(u64::from(self.retry_backoff_s)))
            .saturating_mul(1000)
    }

    /// The most GPUs this job can hold at once.
    pub fn max_gpus(&self) -> u32 {
        self.gpus.saturating_mul(self.workers.max)
    }

    /// The `env` names that look like credentials (`*_TOKEN`, `*_KEY`,
    /// `*_SECRET`, `*PASSWORD*`, in any case), in order: a plain value is
    /// kept in the log, the journal and snapshots on every replica and
    /// shown by `keel job`, so the submitter is warned, not refused.
    pub fn credential_like_env(&self) -> Vec<&str> {
        self.env
            .keys()
            .filter(|name| {
                let upper = name.to_ascii_uppercase();
                ["_TOKEN", "_KEY", "_SECRET"]
                    .iter()
                    .any(|end| upper.ends_with(end))
                    || upper.contains("PASSWORD")
            })
            .map(String::as_str)
            .collect()
    }

    /// What the server says of a spec it accepts: one line per `env`
    /// name that looks like a credential ([`JobSpec::credential_like_env`]).
    pub fn warnings(&self) -> Vec<String> {
        self.credential_like_env()
            .into_iter()
            .map(|name| {
                format!(
                    "env.{name} looks like a credential: a plain env value is written to the \
                     replicated log and snapshots on every replica and shown by `keel job` to \
                     anyone who can reach the API; put it in a secret instead (`keel secret \
                     create NAME --from-file KEY=PATH`) and write `{name}: {{secret: NAME/KEY}}` \
                     in the spec's env"
                )
            })
            .collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn minimal() -> JobSpec {
        crate::fixtures::job_spec("resnet", 1, 1)
    }

    #[test]
    fn minimal_spec_is_valid() {
        assert_eq!(minimal().validate(), Ok(()));
    }

    /// Issue 35: names that look like credentials are found (and only
    /// those); the spec stays valid.
    #[test]
    fn env_names_that_look_like_credentials_are_warned_of() {
        let mut s = minimal();
        for name in [
            "WANDB_API_KEY",
            "HF_TOKEN",
            "aws_secret",
            "DB_PASSWORD",
            "PASSWORD_FILE",
            "EPOCHS",
            "KEYBOARD",
            "TOKENS",
        ] {
            s.env.insert(name.into(), "x".into());
        }
        assert_eq!(
            s.credential_like_env(),
            [
                "DB_PASSWORD",
                "HF_TOKEN",
                "PASSWORD_FILE",
                "WANDB_API_KEY",
                "aws_secret"
            ]
        );
        let warnings = s.warnings();
        assert_eq!(warnings.len(), 5);
        assert!(
            warnings[0].starts_with("env.DB_PASSWORD looks like a credential")
                && warnings[0].contains("DB_PASSWORD: {secret: NAME/KEY}"),
            "{warnings:?}"
        );
        assert_eq!(s.validate(), Ok(()));
        assert!(minimal().warnings().is_empty());
    }

    #[test]
    fn errors_name_the_field_and_the_limit() {
        let mut s = minimal();
        s.name = "x".repeat(200);
        let e = s.validate().unwrap_err().to_string();
        assert_eq!(e, "spec.name is 200 bytes long; the limit is 128");

        let mut s = minimal();
        s.gpus = 65;
        let e = s.validate().unwrap_err().to_string();
        assert_eq!(e, "spec.gpus is 65; it must be between 1 and 64");

        let mut s = minimal();
        s.workers = Workers { min: 4, max: 2 };
        let e = s.validate().unwrap_err().to_string();
        assert_eq!(e, "spec.workers.max is 2; it must be between 4 and 1024");

        let mut s = minimal();
        s.command.clear();
        assert!(matches!(s.validate(), Err(SpecError::Missing { .. })));

        let mut s = minimal();
        s.env.insert("1BAD".into(), "v".into());
        assert!(s.validate().unwrap_err().to_string().contains("env.1BAD"));

        let mut s = minimal();
        s.gpu_types.allowed = vec!["V100".into()];
        assert!(s
            .validate()
            .unwrap_err()
            .to_string()
            .contains("gpu_types.allowed[0]"));
    }

    #[test]
    fn unknown_fields_are_rejected() {
        let err = serde_json::from_str::<JobSpec>(r#"{"name":"a","command":["x"],"gpu":2}"#)
            .unwrap_err()
            .to_string();
        assert!(err.contains("unknown field `gpu`"), "{err}");
    }

    #[test]
    fn resources_are_written_in_the_spec_and_checked() {
        let s: JobSpec = serde_json::from_str(
            r#"{"name":"a","command":["x"],"resources":{"cpus":2,"memory":"1Gi"}}"#,
        )
        .expect("parses");
        assert_eq!(s.resources.cpu_millis, Some(2000));
        assert_eq!(s.resources.memory_bytes, Some(1 << 30));
        assert_eq!(s.validate(), Ok(()));
        // Written back the same way; a spec without them has no such key.
        let json = serde_json::to_string(&s).expect("encodes");
        assert!(
            json.contains(r#""resources":{"cpus":2,"memory":"1Gi"}"#),
            "{json}"
        );
        assert!(!serde_json::to_string(&minimal())
            .expect("encodes")
            .contains("resources"));
        let mut s = minimal();
        s.resources.memory_bytes = Some(1 << 10);
        let e = s.validate().expect_err("too little memory").to_string();
        assert!(e.starts_with("spec.resources.memory is invalid"), "{e}");
        let e = serde_json::from_str::<JobSpec>(
            r#"{"name":"a","command":["x"],"resources":{"cpus":"lots"}}"#,
        )
        .expect_err("not a number")
        .to_string();
        assert!(e.contains("resources.cpus"), "{e}");
    }

    #[test]
    fn workers_accepts_a_number_or_a_range() {
        let s: JobSpec = serde_json::from_str(r#"{"name":"a","command":["x"],"workers":3}"#)
            .expect("fixed workers parse");
        assert_eq!(s.workers, Workers { min: 3, max: 3 });
        let s: JobSpec =
            serde_json::from_str(r#"{"name":"a","command":["x"],"workers":{"min":1,"max":4}}"#)
                .expect("ranged workers parse");
        assert_eq!(s.workers, Workers { min: 1, max: 4 });
    }
}

#[cfg(test)]
mod env_form_tests {
    use super::*;

    #[test]
    fn a_variable_from_a_secret_is_written_inside_env_and_read_back_apart() {
        let text = r#"{"name": "t", "command": ["x"], "env": {"A": "1", "KEY": {"secret": "tracker/api_key"}}}"#;
        let spec: JobSpec = serde_json::from_str(text).expect("parses");
        assert_eq!(spec.env, [("A".to_string(), "1".to_string())].into());
        assert_eq!(spec.secret_env["KEY"].to_string(), "tracker/api_key");
        spec.validate().expect("valid");
        let written = serde_json::to_value(&spec).expect("writes");
        assert_eq!(
            written["env"],
            serde_json::json!({"A": "1", "KEY": {"secret": "tracker/api_key"}})
        );
        let back: JobSpec = serde_json::from_value(written).expect("reads back");
        assert_eq!(back, spec);
        for (bad, says) in [
            (r#"{"KEY": {"secret": "tracker"}}"#, "NAME/KEY"),
            (r#"{"KEY": {"vault": "a/b"}}"#, "not \"vault\""),
            (r#"{"KEY": {}}"#, "{secret: NAME/KEY}"),
        ] {
            let text = format!(r#"{{"name": "t", "command": ["x"], "env": {bad}}}"#);
            let e = serde_json::from_str::<JobSpec>(&text)
                .unwrap_err()
                .to_string();
            assert!(e.contains(says), "{bad}: {e}");
        }
        // A plain value cannot pose as a reference.
        let mut forged = spec.clone();
        forged
            .env
            .insert("B".into(), "\0secret:tracker/api_key".into());
        let e = forged.validate().unwrap_err().to_string();
        assert!(e.contains("env.B") && e.contains("NUL"), "{e}");
        let mut both = spec;
        both.env.insert("KEY".into(), "x".into());
        let e = both.validate().unwrap_err().to_string();
        assert!(e.contains("env.KEY") && e.contains("not both"), "{e}");
    }
}
