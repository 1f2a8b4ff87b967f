//! What GPUs a node has: discovered with `nvidia-smi`, or declared
//! (`--simulated-gpus 4xv100,2xk80`).

use std::collections::BTreeMap;

use keel_state::Gpu;

#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum DiscoveryError {
    #[error("--simulated-gpus: {0:?} is not COUNTxTYPE (e.g. 4xv100)")]
    BadSimulatedItem(String),
    #[error("--simulated-gpus: {count} {gpu_type} GPUs is more than the limit of {limit}")]
    TooMany {
        count: u64,
        gpu_type: String,
        limit: u32,
    },
    #[error("--simulated-nodes must be between 1 and {limit}, not {nodes}")]
    BadNodeCount { nodes: u32, limit: u32 },
    #[error("--simulated-gpus: {gpus} GPUs cannot be split over {nodes} nodes (each needs at least one)")]
    TooFewGpus { gpus: u32, nodes: u32 },
    #[error("nvidia-smi: {0}")]
    NvidiaSmi(String),
}

/// Most GPUs a simulated cluster may declare in all.
pub const SIMULATED_GPUS_MAX: u32 = 65_536;
/// Most simulated nodes.
pub const SIMULATED_NODES_MAX: u32 = 4096;

/// Parses `4xv100,2xk80` into (type, count) in the order given.
pub fn parse_simulated_gpus(spec: &str) -> Result<Vec<(String, u32)>, DiscoveryError> {
    let mut out: Vec<(String, u32)> = Vec::new();
    let mut total: u64 = 0;
    for item in spec.split(',').map(str::trim).filter(|s| !s.is_empty()) {
        let bad = || DiscoveryError::BadSimulatedItem(item.to_string());
        let (count, gpu_type) = item.split_once('x').ok_or_else(bad)?;
        let count: u64 = count.trim().parse().map_err(|_| bad())?;
        let gpu_type = gpu_type.trim().to_ascii_lowercase();
        let valid_type = !gpu_type.is_empty()
            && gpu_type.len() <= keel_state::spec::limits::GPU_TYPE_MAX_LEN
            && gpu_type
                .bytes()
                .all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b == b'-' || b == b'_');
        if count == 0 || !valid_type {
            return Err(bad());
        }
        total += count;
        if total > u64::from(SIMULATED_GPUS_MAX) {
            return Err(DiscoveryError::TooMany {
                count,
                gpu_type,
                limit: SIMULATED_GPUS_MAX,
            });
        }
        match out.iter_mut().find(|(t, _)| *t == gpu_type) {
            Some((_, c)) => *c += count as u32,
            None => out.push((gpu_type, count as u32)),
        }
    }
    if out.is_empty() {
        return Err(DiscoveryError::BadSimulatedItem(spec.to_string()));
    }
    Ok(out)
}

/// Splits a simulated GPU spec over `nodes` nodes: each type's count is
/// divided evenly, the remainder going to the first nodes. Node `i` gets
/// indexes from 0, types in the order of the spec.
pub fn split_over_nodes(
    spec: &[(String, u32)],
    nodes: u32,
) -> Result<Vec<Vec<Gpu>>, DiscoveryError> {
    if nodes == 0 || nodes > SIMULATED_NODES_MAX {
        return Err(DiscoveryError::BadNodeCount {
            nodes,
            limit: SIMULATED_NODES_MAX,
        });
    }
    let mut out: Vec<Vec<Gpu>> = vec![Vec::new(); nodes as usize];
    for (gpu_type, count) in spec {
        for (n, node) in out.iter_mut().enumerate() {
            let n = n as u32;
            let here = count / nodes + u32::from(n < count % nodes);
            for _ in 0..here {
                let index = node.len() as u32;
                node.push(Gpu {
                    index,
                    gpu_type: gpu_type.clone(),
                });
            }
        }
    }
    if out.iter().any(Vec::is_empty) {
        return Err(DiscoveryError::TooFewGpus {
            gpus: spec.iter().map(|(_, c)| c).sum(),
            nodes,
        });
    }
    Ok(out)
}

/// A short, lower-case type name from a marketing name:
/// "Tesla V100-SXM2-16GB" → "v100", "NVIDIA H100 80GB HBM3" → "h100",
/// "NVIDIA GeForce RTX 4090" → "rtx4090".
pub fn gpu_type_of(name: &str) -> String {
    let lower = name.to_ascii_lowercase();
    let words: Vec<&str> = lower
        .split(|c: char| c.is_whitespace() || c == '-')
        .filter(|w| !w.is_empty() && !matches!(*w, "nvidia" | "tesla" | "geforce" | "quadro"))
        .collect();
    // "RTX 4090", "RTX A6000": join the family with the model.
    let raw = match words.as_slice() {
        ["rtx", model, ..] | ["gtx", model, ..] => format!("{}{}", words[0], model),
        [first, ..] => first.to_string(),
        [] => "gpu".to_string(),
    };
    let cleaned: String = raw
        .chars()
        .filter(|c| c.is_ascii_alphanumeric() || *c == '_')
        .take(keel_state::spec::limits::GPU_TYPE_MAX_LEN)
        .collect();
    if cleaned.is_empty() {
        "gpu".into()
    } else {
        cleaned
    }
}

/// A process using a GPU, as `nvidia-smi --query-compute-apps` lists it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct GpuProcess {
    pub gpu_index: u32,
    pub pid: u32,
    /// Its name as the driver reports it (often the executable's path).
    pub name: String,
}

impl std::fmt::Display for GpuProcess {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "GPU {} busy: pid {} ({})",
            self.gpu_index, self.pid, self.name
        )
    }
}

/// The arguments that list the GPUs' UUIDs.
pub const NVIDIA_SMI_UUID_ARGS: &[&str] = &["--query-gpu=index,uuid", "--format=csv,noheader"];
/// The arguments that list the processes using GPUs.
pub const NVIDIA_SMI_APPS_ARGS: &[&str] = &[
    "--query-compute-apps=gpu_uuid,pid,process_name",
    "--format=csv,noheader",
];

/// Parses the two listings into the processes on each GPU (by index).
/// A process on a GPU not in `uuids` (it vanished between the two calls)
/// is left out.
pub fn parse_gpu_processes(uuids: &str, apps: &str) -> Result<Vec<GpuProcess>, DiscoveryError> {
    let bad = |line: &str| DiscoveryError::NvidiaSmi(format!("unexpected line {line:?}"));
    let mut index_of = BTreeMap::new();
    for line in uuids.lines().map(str::trim).filter(|l| !l.is_empty()) {
        let (index, uuid) = line.split_once(',').ok_or_else(|| bad(line))?;
        let index: u32 = index.trim().parse().map_err(|_| bad(line))?;
        index_of.insert(uuid.trim().to_string(), index);
    }
    let mut out = Vec::new();
    for line in apps.lines().map(str::trim).filter(|l| !l.is_empty()) {
        // "No running processes found" in some driver versions.
        if !line.contains(',') {
            continue;
        }
        let mut parts = line.splitn(3, ',').map(str::trim);
        let (uuid, pid, name) = (
            parts.next().unwrap_or(""),
            parts.next().unwrap_or(""),
            parts.next().unwrap_or(""),
        );
        let pid: u32 = pid.parse().map_err(|_| bad(line))?;
        if let Some(&gpu_index) = index_of.get(uuid) {
            out.push(GpuProcess {
                gpu_index,
                pid,
                name: name.to_string(),
            });
        }
    }
    out.sort_by_key(|p| (p.gpu_index, p.pid));
    Ok(out)
}

fn run_nvidia_smi(args: &[&str]) -> Result<String, DiscoveryError> {
    let out = std::process::Command::new("nvidia-smi")
        .args(args)
        .output()
        .map_err(|e| DiscoveryError::NvidiaSmi(e.to_string()))?;
    if !out.status.success() {
        return Err(DiscoveryError::NvidiaSmi(format!(
            "{}: {}",
            out.status,
            String::from_utf8_lossy(&out.stderr).trim()
        )));
    }
    Ok(String::from_utf8_lossy(&out.stdout).into_owned())
}

/// The processes using this machine's GPUs now (`nvidia-smi`).
pub fn gpu_processes() -> Result<Vec<GpuProcess>, DiscoveryError> {
    let uuids = run_nvidia_smi(NVIDIA_SMI_UUID_ARGS)?;
    let apps = run_nvidia_smi(NVIDIA_SMI_APPS_ARGS)?;
    parse_gpu_processes(&uuids, &apps)
}

/// The Keel job a process belongs to, from the `KEEL_JOB_ID` of its
/// environment (`None`: not a Keel worker's, or not readable).
pub fn keel_job_of(pid: u32) -> Option<keel_state::JobId> {
    let env = std::fs::read(format!("/proc/{pid}/environ")).ok()?;
    env.split(|b| *b == 0).find_map(|var| {
        std::str::from_utf8(var.strip_prefix(b"KEEL_JOB_ID=")?)
            .ok()?
            .parse()
            .ok()
    })
}

/// The processes on `gpus` that belong to no job in `allowed`: what makes
/// those GPUs busy for a worker of another job.
pub fn busy(
    processes: &[GpuProcess],
    gpus: &[u32],
    allowed: &[keel_state::JobId],
    job_of: impl Fn(u32) -> Option<keel_state::JobId>,
) -> Vec<GpuProcess> {
    processes
        .iter()
        .filter(|p| gpus.contains(&p.gpu_index))
        .filter(|p| job_of(p.pid).is_none_or(|j| !allowed.contains(&j)))
        .cloned()
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::gpu_health::parse_gpu_listing;

    #[test]
    fn gpu_processes_parse_and_only_strangers_make_a_gpu_busy() {
        let uuids = "0, GPU-aaa\n1, GPU-bbb\n";
        let apps = "GPU-bbb, 4242, /usr/bin/python3\nGPU-aaa, 17, train\nGPU-zzz, 9, gone\n";
        let procs = parse_gpu_processes(uuids, apps).expect("parses");
        assert_eq!(
            procs,
            vec![
                GpuProcess {
                    gpu_index: 0,
                    pid: 17,
                    name: "train".into()
                },
                GpuProcess {
                    gpu_index: 1,
                    pid: 4242,
                    name: "/usr/bin/python3".into()
                },
            ]
        );
        assert_eq!(
            procs[1].to_string(),
            "GPU 1 busy: pid 4242 (/usr/bin/python3)"
        );
        assert_eq!(
            parse_gpu_processes(uuids, "No running processes found\n").expect("none"),
            vec![]
        );
        assert!(parse_gpu_processes(uuids, "GPU-aaa, nope, x").is_err());
        // Pid 17 is job 5's; 4242 is nobody's.
        let job_of = |pid: u32| (pid == 17).then_some(5);
        assert_eq!(busy(&procs, &[0], &[5], job_of), vec![]);
        assert_eq!(busy(&procs, &[0], &[6], job_of), vec![procs[0].clone()]);
        assert_eq!(busy(&procs, &[0, 1], &[5], job_of), vec![procs[1].clone()]);
        assert_eq!(busy(&procs, &[2], &[], job_of), vec![]);
    }

    #[test]
    fn simulated_specs_parse_and_split() {
        let spec = parse_simulated_gpus("4xv100, 2xK80").expect("parses");
        assert_eq!(spec, vec![("v100".to_string(), 4), ("k80".to_string(), 2)]);
        let nodes = split_over_nodes(&spec, 2).expect("splits");
        assert_eq!(nodes.len(), 2);
        let types = |n: &Vec<Gpu>| n.iter().map(|g| g.gpu_type.clone()).collect::<Vec<_>>();
        assert_eq!(types(&nodes[0]), vec!["v100", "v100", "k80"]);
        assert_eq!(
            nodes[1].iter().map(|g| g.index).collect::<Vec<_>>(),
            vec![0, 1, 2]
        );
        let odd =
            split_over_nodes(&parse_simulated_gpus("3xv100").expect("parses"), 2).expect("splits");
        assert_eq!((odd[0].len(), odd[1].len()), (2, 1));
    }

    #[test]
    fn bad_simulated_specs_name_the_problem() {
        for bad in ["", "v100", "0xv100", "4x", "4xV 100", "-1xk80"] {
            assert!(parse_simulated_gpus(bad).is_err(), "{bad:?} accepted");
        }
        let e = split_over_nodes(&parse_simulated_gpus("2xv100").expect("parses"), 3).unwrap_err();
        assert!(
            e.to_string().contains("cannot be split over 3 nodes"),
            "{e}"
        );
        assert!(parse_simulated_gpus("70000xv100").is_err());
    }

    #[test]
    fn nvidia_smi_output_parses_into_short_types() {
        let out = "0, Tesla V100-SXM2-16GB\n1, Tesla V100-SXM2-16GB\n2, NVIDIA H100 80GB HBM3\n3, NVIDIA GeForce RTX 4090\n4, NVIDIA A100-SXM4-80GB\n";
        let gpus = parse_gpu_listing(out).expect("parses").offered();
        let types: Vec<&str> = gpus.iter().map(|g| g.gpu_type.as_str()).collect();
        assert_eq!(types, vec!["v100", "v100", "h100", "rtx4090", "a100"]);
        // Captured from a lent H200 machine (2026-11-26).
        let h200 = parse_gpu_listing("0, NVIDIA H200\n").expect("parses");
        assert_eq!(h200.offered()[0].gpu_type, "h200");
        assert!(parse_gpu_listing("garbage").is_err());
        assert_eq!(parse_gpu_listing("").expect("empty").offered(), vec![]);
    }
}
