//! What a worker may use of its node besides its GPUs: `resources: {cpus,
//! memory}` in a job spec, enforced by the executor (a cgroup's `cpu.max`
//! and `memory.max`, a container's limits), so one worker cannot starve
//! the others on a shared node.
//!
//! Kept as integers (thousandths of a CPU, bytes), so specs compare and
//! hash exactly. In YAML and JSON, `cpus` is a number of CPUs (`2`, `0.5`)
//! or Kubernetes' millicores (`"500m"`), and `memory` a number of bytes or
//! a quantity with a unit (`"512Mi"`, `"4Gi"`, `"2G"`).

use serde::{Deserialize, Serialize};

/// Limits on a worker's CPU and memory. Unset: no limit.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct Resources {
    /// Thousandths of a CPU (Kubernetes' millicores): 1500 is 1.5 CPUs.
    pub cpu_millis: Option<u32>,
    pub memory_bytes: Option<u64>,
}

/// The ranges [`crate::JobSpec::validate`] checks.
pub mod limits {
    /// 0.01 CPU: less leaves a worker unable to start.
    pub const CPU_MILLIS_MIN: u32 = 10;
    /// 4096 CPUs.
    pub const CPU_MILLIS_MAX: u32 = 4_096_000;
    /// 4 MiB: less is not enough for a process to start.
    pub const MEMORY_BYTES_MIN: u64 = 4 << 20;
    /// 64 TiB.
    pub const MEMORY_BYTES_MAX: u64 = 64 << 40;
}

impl Resources {
    /// Whether no limit is asked for.
    pub fn is_unset(&self) -> bool {
        self.cpu_millis.is_none() && self.memory_bytes.is_none()
    }

    /// Checks both against [`limits`], naming the field and the range.
    pub fn validate(&self) -> Result<(), crate::SpecError> {
        use limits::*;
        if let Some(m) = self.cpu_millis {
            if !(CPU_MILLIS_MIN..=CPU_MILLIS_MAX).contains(&m) {
                return Err(crate::SpecError::Invalid {
                    field: "resources.cpus".into(),
                    reason: format!(
                        "{} CPUs is outside {} to {}",
                        show_cpus(m),
                        show_cpus(CPU_MILLIS_MIN),
                        show_cpus(CPU_MILLIS_MAX)
                    ),
                });
            }
        }
        if let Some(b) = self.memory_bytes {
            if !(MEMORY_BYTES_MIN..=MEMORY_BYTES_MAX).contains(&b) {
                return Err(crate::SpecError::Invalid {
                    field: "resources.memory".into(),
                    reason: format!(
                        "{} bytes is outside {} to {}",
                        b,
                        show_memory(MEMORY_BYTES_MIN),
                        show_memory(MEMORY_BYTES_MAX)
                    ),
                });
            }
        }
        Ok(())
    }
}

/// Parses a CPU count: `2`, `0.5`, `"1.5"` or `"500m"`, into thousandths.
pub fn parse_cpus(text: &str) -> Result<u32, String> {
    let t = text.trim();
    let bad = || format!("{text:?} is not a number of CPUs such as 2, 0.5 or \"500m\"");
    if let Some(m) = t.strip_suffix('m') {
        return m.parse::<u32>().map_err(|_| bad());
    }
    let cpus: f64 = t.parse().map_err(|_| bad())?;
    if !cpus.is_finite() || cpus < 0.0 {
        return Err(bad());
    }
    let millis = (cpus * 1000.0).round();
    if millis > f64::from(u32::MAX) {
        return Err(format!("{text:?} CPUs is too many"));
    }
    Ok(millis as u32)
}

/// Parses a memory size: bytes (`1073741824`) or a number with a unit:
/// `Ki Mi Gi Ti` (powers of 1024, also `KiB`...), `K M G T` (powers of
/// 1000, also `KB`...).
pub fn parse_memory(text: &str) -> Result<u64, String> {
    let t = text.trim();
    let bad = || format!("{text:?} is not a memory size such as \"512Mi\", \"4Gi\" or \"2G\"");
    let split = t
        .find(|c: char| !(c.is_ascii_digit() || c == '.'))
        .unwrap_or(t.len());
    let (number, unit) = t.split_at(split);
    let unit = unit.trim();
    let unit = unit
        .strip_suffix('B')
        .filter(|u| !u.is_empty())
        .unwrap_or(unit);
    let scale: u64 = match unit {
        "" => 1,
        "Ki" => 1 << 10,
        "Mi" => 1 << 20,
        "Gi" => 1 << 30,
        "Ti" => 1 << 40,
        "K" | "k" => 1_000,
        "M" => 1_000_000,
        "G" => 1_000_000_000,
        "T" => 1_000_000_000_000,
        _ => return Err(bad()),
    };
    if number.is_empty() {
        return Err(bad());
    }
    if let Ok(n) = number.parse::<u64>() {
        return n
            .checked_mul(scale)
            .ok_or_else(|| format!("{text:?} is too large"));
    }
    let n: f64 = number.parse().map_err(|_| bad())?;
    let bytes = (n * scale as f64).round();
    if !bytes.is_finite() || bytes > u64::MAX as f64 {
        return Err(format!("{text:?} is too large"));
    }
    Ok(bytes as u64)
}

/// A memory size as users write it: the largest binary unit it is a whole
/// number of (`4Gi`), else bytes.
pub fn show_memory(bytes: u64) -> String {
    for (unit, scale) in [
        ("Ti", 1u64 << 40),
        ("Gi", 1 << 30),
        ("Mi", 1 << 20),
        ("Ki", 1 << 10),
    ] {
        if bytes >= scale && bytes.is_multiple_of(scale) {
            return format!("{}{unit}", bytes / scale);
        }
    }
    bytes.to_string()
}

/// A CPU count as users write it: `2`, `1.5`, `0.25`.
pub fn show_cpus(millis: u32) -> String {
    if millis.is_multiple_of(1000) {
        (millis / 1000).to_string()
    } else {
        let s = format!("{}.{:03}", millis / 1000, millis % 1000);
        s.trim_end_matches('0').to_string()
    }
}

impl std::fmt::Display for Resources {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let mut parts = Vec::new();
        if let Some(m) = self.cpu_millis {
            parts.push(format!("cpus {}", show_cpus(m)));
        }
        if let Some(b) = self.memory_bytes {
            parts.push(format!("memory {}", show_memory(b)));
        }
        if parts.is_empty() {
            f.write_str("no limits")
        } else {
            f.write_str(&parts.join(", "))
        }
    }
}

/// A number or a string, as YAML and JSON give either.
#[derive(Deserialize)]
#[serde(untagged)]
enum NumberOrText {
    Unsigned(u64),
    Float(f64),
    Text(String),
}

impl NumberOrText {
    fn text(self) -> String {
        match self {
            NumberOrText::Unsigned(n) => n.to_string(),
            NumberOrText::Float(x) => x.to_string(),
            NumberOrText::Text(s) => s,
        }
    }
}

/// The written form (YAML, JSON): `{cpus, memory}`, both optional.
#[derive(Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
struct Written {
    #[serde(default, skip_serializing_if = "Option::is_none")]
    cpus: Option<serde_json::Value>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    memory: Option<serde_json::Value>,
}

/// The binary form (postcard: the state's hash).
#[derive(Serialize, Deserialize)]
struct Binary {
    cpu_millis: Option<u32>,
    memory_bytes: Option<u64>,
}

impl Serialize for Resources {
    fn serialize<S: serde::Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        if s.is_human_readable() {
            Written {
                cpus: self.cpu_millis.map(|m| {
                    if m.is_multiple_of(1000) {
                        serde_json::Value::from(m / 1000)
                    } else {
                        serde_json::Value::from(f64::from(m) / 1000.0)
                    }
                }),
                memory: self
                    .memory_bytes
                    .map(|b| serde_json::Value::from(show_memory(b))),
            }
            .serialize(s)
        } else {
            Binary {
                cpu_millis: self.cpu_millis,
                memory_bytes: self.memory_bytes,
            }
            .serialize(s)
        }
    }
}

impl<'de> Deserialize<'de> for Resources {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        use serde::de::Error;
        if !d.is_human_readable() {
            let b = Binary::deserialize(d)?;
            return Ok(Resources {
                cpu_millis: b.cpu_millis,
                memory_bytes: b.memory_bytes,
            });
        }
        let w = Written::deserialize(d)?;
        let text = |v: serde_json::Value, field: &str| -> Result<String, D::Error> {
            serde_json::from_value::<NumberOrText>(v)
                .map(NumberOrText::text)
                .map_err(|_| D::Error::custom(format!("resources.{field}: a number or a string")))
        };
        let cpu_millis = match w.cpus {
            Some(v) => Some(
                parse_cpus(&text(v, "cpus")?)
                    .map_err(|e| D::Error::custom(format!("resources.cpus: {e}")))?,
            ),
            None => None,
        };
        let memory_bytes = match w.memory {
            Some(v) => Some(
                parse_memory(&text(v, "memory")?)
                    .map_err(|e| D::Error::custom(format!("resources.memory: {e}")))?,
            ),
            None => None,
        };
        Ok(Resources {
            cpu_millis,
            memory_bytes,
        })
    }
}

/// How a job's worker logs are rotated, where the job asks (`logs:
/// {max_file_size, max_files}` in its spec): within the server's own
/// maximum (`--worker-log-max-file-bytes`, `--worker-log-max-files`),
/// which the executor applies when the job asks for more. Unset: the
/// server's.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct LogLimits {
    pub max_file_bytes: Option<u64>,
    pub max_files: Option<u32>,
}

/// The ranges of [`LogLimits`] (and of the servers' settings).
pub mod log_limits {
    /// 64 KiB: a few hundred lines.
    pub const FILE_BYTES_MIN: u64 = 64 << 10;
    /// 1 GiB.
    pub const FILE_BYTES_MAX: u64 = 1 << 30;
    /// Two: the current file and one rotated out (the stream's offsets
    /// need the newest rotated file).
    pub const FILES_MIN: u32 = 2;
    pub const FILES_MAX: u32 = 100;
}

impl LogLimits {
    /// Whether the job leaves both to the server.
    pub fn is_unset(&self) -> bool {
        self.max_file_bytes.is_none() && self.max_files.is_none()
    }

    /// Checks both against [`log_limits`], naming the field and the range.
    pub fn validate(&self) -> Result<(), crate::SpecError> {
        use log_limits::*;
        if let Some(b) = self.max_file_bytes {
            if !(FILE_BYTES_MIN..=FILE_BYTES_MAX).contains(&b) {
                return Err(crate::SpecError::Invalid {
                    field: "logs.max_file_size".into(),
                    reason: format!(
                        "{b} bytes is outside {} to {}",
                        show_memory(FILE_BYTES_MIN),
                        show_memory(FILE_BYTES_MAX)
                    ),
                });
            }
        }
        if let Some(n) = self.max_files {
            if !(FILES_MIN..=FILES_MAX).contains(&n) {
                return Err(crate::SpecError::Invalid {
                    field: "logs.max_files".into(),
                    reason: format!("{n} files is outside {FILES_MIN} to {FILES_MAX}"),
                });
            }
        }
        Ok(())
    }
}

impl std::fmt::Display for LogLimits {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let files = self
            .max_files
            .map_or("the server's number of".to_string(), |n| n.to_string());
        let size = self
            .max_file_bytes
            .map_or("the server's size".to_string(), show_memory);
        write!(f, "{files} files of {size}")
    }
}

/// The written form of [`LogLimits`]: `{max_file_size, max_files}`.
#[derive(Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
struct WrittenLogs {
    #[serde(default, skip_serializing_if = "Option::is_none")]
    max_file_size: Option<serde_json::Value>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    max_files: Option<u32>,
}

/// The binary form (postcard: the state's hash).
#[derive(Serialize, Deserialize)]
struct BinaryLogs {
    max_file_bytes: Option<u64>,
    max_files: Option<u32>,
}

impl Serialize for LogLimits {
    fn serialize<S: serde::Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        if s.is_human_readable() {
            WrittenLogs {
                max_file_size: self
                    .max_file_bytes
                    .map(|b| serde_json::Value::from(show_memory(b))),
                max_files: self.max_files,
            }
            .serialize(s)
        } else {
            BinaryLogs {
                max_file_bytes: self.max_file_bytes,
                max_files: self.max_files,
            }
            .serialize(s)
        }
    }
}

impl<'de> Deserialize<'de> for LogLimits {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        use serde::de::Error;
        if !d.is_human_readable() {
            let b = BinaryLogs::deserialize(d)?;
            return Ok(LogLimits {
                max_file_bytes: b.max_file_bytes,
                max_files: b.max_files,
            });
        }
        let w = WrittenLogs::deserialize(d)?;
        let max_file_bytes = match w.max_file_size {
            Some(v) => {
                let text = serde_json::from_value::<NumberOrText>(v)
                    .map(NumberOrText::text)
                    .map_err(|_| D::Error::custom("logs.max_file_size: a number or a string"))?;
                Some(
                    parse_memory(&text)
                        .map_err(|e| D::Error::custom(format!("logs.max_file_size: {e}")))?,
                )
            }
            None => None,
        };
        Ok(LogLimits {
            max_file_bytes,
            max_files: w.max_files,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn log_limits_are_written_as_sizes_and_checked() {
        let l: LogLimits =
            serde_json::from_str(r#"{"max_file_size": "1Mi", "max_files": 3}"#).unwrap();
        assert_eq!(l.max_file_bytes, Some(1 << 20));
        assert_eq!(l.max_files, Some(3));
        assert_eq!(
            serde_json::to_string(&l).unwrap(),
            r#"{"max_file_size":"1Mi","max_files":3}"#
        );
        let e = LogLimits {
            max_files: Some(1),
            ..l
        }
        .validate()
        .unwrap_err()
        .to_string();
        assert!(
            e.contains("logs.max_files") && e.contains("1 files is outside 2 to 100"),
            "{e}"
        );
        let e = LogLimits {
            max_file_bytes: Some(1000),
            ..l
        }
        .validate()
        .unwrap_err()
        .to_string();
        assert!(
            e.contains("logs.max_file_size") && e.contains("64Ki to 1Gi"),
            "{e}"
        );
        assert!(serde_json::from_str::<LogLimits>(r#"{"max_file_size": "lots"}"#).is_err());
    }

    #[test]
    fn cpus_parse_as_numbers_or_millicores() {
        assert_eq!(parse_cpus("2"), Ok(2000));
        assert_eq!(parse_cpus("0.5"), Ok(500));
        assert_eq!(parse_cpus("1.25"), Ok(1250));
        assert_eq!(parse_cpus("500m"), Ok(500));
        assert!(parse_cpus("two").is_err());
        assert!(parse_cpus("-1").is_err());
        assert!(parse_cpus("1e30").is_err());
    }

    #[test]
    fn memory_parses_with_binary_and_decimal_units() {
        assert_eq!(parse_memory("1024"), Ok(1024));
        assert_eq!(parse_memory("512Mi"), Ok(512 << 20));
        assert_eq!(parse_memory("4GiB"), Ok(4 << 30));
        assert_eq!(parse_memory("2G"), Ok(2_000_000_000));
        assert_eq!(parse_memory("1.5Gi"), Ok(3 << 29));
        assert!(parse_memory("4 gigs").is_err());
        assert!(parse_memory("Gi").is_err());
        assert!(parse_memory("99999999999999999999Ti").is_err());
    }

    #[test]
    fn written_forms_read_back_as_they_were_written() {
        let r: Resources =
            serde_json::from_str(r#"{"cpus": 1.5, "memory": "4Gi"}"#).expect("parses");
        assert_eq!(
            r,
            Resources {
                cpu_millis: Some(1500),
                memory_bytes: Some(4 << 30)
            }
        );
        let json = serde_json::to_string(&r).expect("encodes");
        assert_eq!(json, r#"{"cpus":1.5,"memory":"4Gi"}"#);
        assert_eq!(serde_json::from_str::<Resources>(&json).expect("back"), r);
        let r: Resources =
            serde_json::from_str(r#"{"cpus": "250m", "memory": 1000000}"#).expect("parses");
        assert_eq!(r.cpu_millis, Some(250));
        assert_eq!(r.memory_bytes, Some(1_000_000));
        assert_eq!(r.to_string(), "cpus 0.25, memory 1000000");
        let e = serde_json::from_str::<Resources>(r#"{"cpus": 1, "gpu": 2}"#)
            .expect_err("unknown field");
        assert!(e.to_string().contains("unknown field `gpu`"), "{e}");
        let e = serde_json::from_str::<Resources>(r#"{"memory": "lots"}"#).expect_err("bad");
        assert!(e.to_string().contains("resources.memory"), "{e}");
        let e = Resources {
            cpu_millis: Some(5),
            memory_bytes: None,
        }
        .validate()
        .expect_err("too few");
        assert_eq!(
            e.to_string(),
            "spec.resources.cpus is invalid: 0.005 CPUs is outside 0.01 to 4096"
        );
        let e = Resources {
            cpu_millis: None,
            memory_bytes: Some(1000),
        }
        .validate()
        .expect_err("too little");
        assert_eq!(
            e.to_string(),
            "spec.resources.memory is invalid: 1000 bytes is outside 4Mi to 64Ti"
        );
        let bytes = postcard::to_stdvec(&r).expect("postcard");
        assert_eq!(postcard::from_bytes::<Resources>(&bytes).expect("back"), r);
    }
}
