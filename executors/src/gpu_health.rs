//! Which of a machine's GPUs can be offered, and why the others cannot
//! (issue 33).
//!
//! - [`parse_gpu_listing`]: `nvidia-smi --query-gpu=index,name,pci.bus_id`
//!   as the driver prints it, including the lines it writes for a GPU it
//!   lost ("Unable to determine the device handle for GPU 0000:3B:00.0:
//!   GPU is lost. Reboot the system to recover this GPU").
//! - [`KernelLog`]: the kernel's log (`/dev/kmsg`) read from the moment it
//!   is opened, for the driver's Xid records ("NVRM: Xid (PCI:0000:3b:00):
//!   79, ... GPU has fallen off the bus.").
//! - [`GpuHealth`]: what a node reports, from listings over time and the
//!   kernel log: the GPUs it offers, the ones it has lost or that had a
//!   critical Xid (with why), and what it cannot tie to a GPU index (for
//!   the node's note).
//!
//! A GPU with a critical Xid stays failed for the life of this
//! `GpuHealth` (the server, or the SSH host's entry): the driver does not
//! say when a GPU is healthy again, so, as NVIDIA's Kubernetes device
//! plugin does, it comes back when the operator has reset the GPU and
//! restarts the server. Xid records written before the log was opened are
//! not read (the device plugin, subscribed to NVML's events, does not see
//! those either); a GPU the driver lost is listed as lost by `nvidia-smi`
//! whenever it is asked.

use std::collections::{BTreeMap, BTreeSet};
use std::io::Read;
use std::path::Path;

use keel_state::{FailedGpu, Gpu};

use crate::discovery::{gpu_type_of, DiscoveryError};

/// The arguments Keel lists GPUs with.
pub const NVIDIA_SMI_ARGS: &[&str] =
    &["--query-gpu=index,name,pci.bus_id", "--format=csv,noheader"];

/// Xids of an application's own errors, which leave the GPU usable: 13
/// (graphics engine exception), 31 (GPU memory page fault), 43 (GPU
/// stopped processing), 45 (preemptive cleanup), 68 (video processor
/// exception), 109 (context switch timeout). NVIDIA's device plugin skips
/// the same ones; every other Xid fails the GPU.
pub const APPLICATION_XIDS: &[u32] = &[13, 31, 43, 45, 68, 109];

/// Most lines kept for the node's note about failures not tied to a GPU.
const UNPLACED_MAX: usize = 8;

/// A PCI address as (domain, bus, device): `00000000:3B:00.0` from
/// `nvidia-smi` and `0000:3b:00` from the kernel's Xid records are the
/// same GPU.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
pub struct PciAddress {
    pub domain: u32,
    pub bus: u32,
    pub device: u32,
}

impl PciAddress {
    /// Parses `DOMAIN:BUS:DEVICE[.FUNCTION]` or `BUS:DEVICE[.FUNCTION]`
    /// (hexadecimal, any case, an optional `PCI:` before).
    pub fn parse(s: &str) -> Option<PciAddress> {
        let s = s.trim();
        let s = s.strip_prefix("PCI:").unwrap_or(s);
        let parts: Vec<&str> = s.split(':').collect();
        let (domain, bus, device) = match parts.as_slice() {
            [domain, bus, device] => (*domain, *bus, *device),
            [bus, device] => ("0", *bus, *device),
            _ => return None,
        };
        let device = device.split('.').next().unwrap_or(device);
        let hex = |x: &str| u32::from_str_radix(x.trim(), 16).ok();
        Some(PciAddress {
            domain: hex(domain)?,
            bus: hex(bus)?,
            device: hex(device)?,
        })
    }
}

impl std::fmt::Display for PciAddress {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "{:04x}:{:02x}:{:02x}",
            self.domain, self.bus, self.device
        )
    }
}

/// One listing of a machine's GPUs.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct GpuListing {
    /// The GPUs listed, by index: type, and PCI address when given.
    pub gpus: BTreeMap<u32, (String, Option<PciAddress>)>,
    /// GPUs the driver could not reach: where, and what it said.
    pub lost: Vec<(PciAddress, String)>,
}

impl GpuListing {
    pub fn offered(&self) -> Vec<Gpu> {
        self.gpus
            .iter()
            .map(|(index, (gpu_type, _))| Gpu {
                index: *index,
                gpu_type: gpu_type.clone(),
            })
            .collect()
    }
}

/// Parses what `nvidia-smi --query-gpu=index,name[,pci.bus_id]
/// --format=csv,noheader` printed (its output and error together): one
/// `INDEX, NAME[, BUS_ID]` line per GPU, and an "Unable to determine the
/// device handle for GPU BUS_ID: WHY" line per GPU it lost. Any other
/// line is an error naming it.
pub fn parse_gpu_listing(output: &str) -> Result<GpuListing, DiscoveryError> {
    const LOST: &str = "Unable to determine the device handle for GPU";
    let mut listing = GpuListing::default();
    for line in output.lines().map(str::trim).filter(|l| !l.is_empty()) {
        if let Some(rest) = line.strip_prefix(LOST) {
            let rest = rest.trim_start();
            let (bus, why) = rest.split_once(": ").unwrap_or((rest, "lost"));
            let bus = PciAddress::parse(bus)
                .ok_or_else(|| DiscoveryError::NvidiaSmi(format!("no PCI address in {line:?}")))?;
            listing.lost.push((bus, why.trim().to_string()));
            continue;
        }
        let fields: Vec<&str> = line.split(',').map(str::trim).collect();
        let (index, name, bus) = match fields.as_slice() {
            [index, name] => (*index, *name, None),
            [index, name, bus] => (*index, *name, PciAddress::parse(bus)),
            _ => {
                return Err(DiscoveryError::NvidiaSmi(format!(
                    "unexpected line {line:?}"
                )))
            }
        };
        let index: u32 = index
            .parse()
            .map_err(|_| DiscoveryError::NvidiaSmi(format!("bad GPU index in {line:?}")))?;
        listing.gpus.insert(index, (gpu_type_of(name), bus));
    }
    Ok(listing)
}

/// Runs `nvidia-smi` with [`NVIDIA_SMI_ARGS`]. `Ok(None)` when it is not
/// installed (no GPUs here). A non-zero exit is an error unless the
/// output names the GPUs it lost (the driver then exits non-zero and
/// lists the others).
pub fn list_nvidia_gpus() -> Result<Option<GpuListing>, DiscoveryError> {
    let out = match std::process::Command::new("nvidia-smi")
        .args(NVIDIA_SMI_ARGS)
        .output()
    {
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(None),
        Err(e) => return Err(DiscoveryError::NvidiaSmi(e.to_string())),
        Ok(out) => out,
    };
    let text = format!(
        "{}\n{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    let parsed = parse_gpu_listing(&text);
    if out.status.success() {
        return parsed.map(Some);
    }
    match parsed {
        Ok(listing) if !listing.lost.is_empty() => Ok(Some(listing)),
        _ => Err(DiscoveryError::NvidiaSmi(format!(
            "{}: {}",
            out.status,
            String::from_utf8_lossy(&out.stderr).trim()
        ))),
    }
}

/// An Xid record of the NVIDIA driver: which GPU, the code, and the text.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Xid {
    pub pci: PciAddress,
    pub code: u32,
    pub text: String,
}

impl Xid {
    /// Whether it leaves the GPU unusable (see [`APPLICATION_XIDS`]).
    pub fn is_critical(&self) -> bool {
        !APPLICATION_XIDS.contains(&self.code)
    }
}

/// Parses a kernel log message such as `NVRM: Xid (PCI:0000:3b:00): 79,
/// pid=1234, name=python, GPU has fallen off the bus.` (a `/dev/kmsg`
/// record's `PRI,SEQ,TIME,FLAGS;` prefix, or a `dmesg` time stamp, may
/// come before it).
pub fn parse_xid(line: &str) -> Option<Xid> {
    let at = line.find("NVRM: Xid (")?;
    let rest = &line[at + "NVRM: Xid (".len()..];
    let (pci, rest) = rest.split_once("):")?;
    let pci = PciAddress::parse(pci)?;
    let rest = rest.trim_start();
    let digits: String = rest.chars().take_while(char::is_ascii_digit).collect();
    let code: u32 = digits.parse().ok()?;
    let text = rest[digits.len()..]
        .trim_start_matches(',')
        .split(',')
        .map(str::trim)
        .filter(|part| !part.starts_with("pid=") && !part.starts_with("name="))
        .collect::<Vec<_>>()
        .join(", ");
    Some(Xid {
        pci,
        code,
        text: text.trim().to_string(),
    })
}

/// The kernel's log, read from where it ended when opened: `/dev/kmsg`
/// (one record per read, `EAGAIN` at the end, `EPIPE` when records were
/// overwritten before they were read) or a plain file of lines.
#[derive(Debug)]
pub struct KernelLog {
    file: std::fs::File,
    partial: Vec<u8>,
}

impl KernelLog {
    /// Opens `path` without blocking and skips what it holds already.
    pub fn open_at_end(path: &Path) -> std::io::Result<KernelLog> {
        use std::io::Seek;
        use std::os::unix::fs::OpenOptionsExt;
        let mut file = std::fs::OpenOptions::new()
            .read(true)
            .custom_flags(nix::libc::O_NONBLOCK)
            .open(path)?;
        file.seek(std::io::SeekFrom::End(0))?;
        Ok(KernelLog {
            file,
            partial: Vec::new(),
        })
    }

    /// The whole lines written since the last call (at most 1 MiB of them
    /// per call; the rest come next time).
    pub fn read_new(&mut self) -> Vec<String> {
        let mut lines = Vec::new();
        let mut buf = vec![0u8; 16 * 1024];
        let mut read_total = 0usize;
        while read_total < 1 << 20 {
            match self.file.read(&mut buf) {
                Ok(0) => break,
                Ok(n) => {
                    read_total += n;
                    self.partial.extend_from_slice(&buf[..n]);
                    while let Some(end) = self.partial.iter().position(|b| *b == b'\n') {
                        let line: Vec<u8> = self.partial.drain(..=end).collect();
                        lines.push(String::from_utf8_lossy(&line).trim_end().to_string());
                    }
                }
                // kmsg: records overwritten before they were read; go on.
                Err(e) if e.raw_os_error() == Some(nix::libc::EPIPE) => continue,
                Err(e) if e.kind() == std::io::ErrorKind::Interrupted => continue,
                Err(_) => break,
            }
        }
        lines
    }
}

/// What a node reports about its GPUs now.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct HealthReport {
    /// The GPUs it offers.
    pub gpus: Vec<Gpu>,
    /// The GPUs it has and cannot offer, with why.
    pub failed: Vec<FailedGpu>,
    /// Failures it cannot tie to a GPU index (a GPU lost before it was
    /// ever listed), for the node's note.
    pub note: String,
}

/// A machine's GPUs over time: every GPU ever listed, and the ones failed
/// by a critical Xid. See the module's notes.
#[derive(Debug, Default)]
pub struct GpuHealth {
    /// Every GPU listed since this was made: type and PCI address.
    known: BTreeMap<u32, (String, Option<PciAddress>)>,
    /// GPUs with a critical Xid: the first one's reason.
    xids: BTreeMap<u32, String>,
    /// Xids and lost GPUs at an address no listed GPU has.
    unplaced: BTreeSet<String>,
    kernel_log: Option<KernelLog>,
}

impl GpuHealth {
    /// A machine whose kernel log, if given, is read for Xids.
    pub fn new(kernel_log: Option<KernelLog>) -> GpuHealth {
        GpuHealth {
            kernel_log,
            ..GpuHealth::default()
        }
    }

    /// The node's report from a new `listing` and the kernel log's new
    /// records: a GPU listed before and not now is failed ("lost by the
    /// driver: WHY" when the listing says so, "no longer listed by
    /// nvidia-smi" otherwise), and so is a GPU with a critical Xid.
    pub fn check(&mut self, listing: &GpuListing) -> HealthReport {
        for (index, gpu) in &listing.gpus {
            self.known.insert(*index, gpu.clone());
        }
        let lines = match self.kernel_log.as_mut() {
            Some(log) => log.read_new(),
            None => Vec::new(),
        };
        for xid in lines.iter().filter_map(|l| parse_xid(l)) {
            if !xid.is_critical() {
                continue;
            }
            let reason = if xid.text.is_empty() {
                format!("Xid {}", xid.code)
            } else {
                format!("Xid {}: {}", xid.code, xid.text)
            };
            match self.index_at(xid.pci) {
                Some(index) => {
                    self.xids.entry(index).or_insert(reason);
                }
                None => self.note_unplaced(format!("GPU at PCI {}: {reason}", xid.pci)),
            }
        }
        let mut failed = Vec::new();
        for (index, (gpu_type, pci)) in &self.known {
            let reason = if let Some(xid) = self.xids.get(index) {
                xid.clone()
            } else if listing.gpus.contains_key(index) {
                continue;
            } else {
                match listing.lost.iter().find(|(at, _)| Some(*at) == *pci) {
                    Some((_, why)) => format!("lost by the driver: {why}"),
                    None => "no longer listed by nvidia-smi".to_string(),
                }
            };
            failed.push(FailedGpu {
                index: *index,
                gpu_type: gpu_type.clone(),
                reason,
            });
        }
        for (pci, why) in &listing.lost {
            if self.index_at(*pci).is_none() {
                self.note_unplaced(format!("GPU at PCI {pci} lost by the driver: {why}"));
            }
        }
        let gpus = listing
            .offered()
            .into_iter()
            .filter(|g| !self.xids.contains_key(&g.index))
            .collect();
        HealthReport {
            gpus,
            failed,
            note: self.unplaced.iter().cloned().collect::<Vec<_>>().join("; "),
        }
    }

    fn index_at(&self, pci: PciAddress) -> Option<u32> {
        self.known
            .iter()
            .find(|(_, (_, at))| *at == Some(pci))
            .map(|(index, _)| *index)
    }

    fn note_unplaced(&mut self, line: String) {
        if self.unplaced.len() < UNPLACED_MAX {
            self.unplaced.insert(line);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const TWO: &str = "0, NVIDIA H100 80GB HBM3, 00000000:3B:00.0\n\
                       1, NVIDIA H100 80GB HBM3, 00000000:86:00.0\n";

    #[test]
    fn a_listing_with_bus_ids_and_a_lost_gpu_parses() {
        let l = parse_gpu_listing(TWO).expect("parses");
        assert_eq!(l.gpus.len(), 2);
        assert_eq!(
            l.gpus[&1],
            (
                "h100".to_string(),
                Some(PciAddress {
                    domain: 0,
                    bus: 0x86,
                    device: 0
                })
            )
        );
        let lost = parse_gpu_listing(
            "0, NVIDIA H100 80GB HBM3, 00000000:3B:00.0\n\
             Unable to determine the device handle for GPU 0000:86:00.0: GPU is lost.  Reboot the system to recover this GPU\n",
        )
        .expect("parses");
        assert_eq!(lost.gpus.len(), 1);
        assert_eq!(lost.lost.len(), 1);
        assert_eq!(lost.lost[0].0.to_string(), "0000:86:00");
        assert!(
            lost.lost[0].1.starts_with("GPU is lost."),
            "{:?}",
            lost.lost
        );
        // The old two-column form still parses; garbage does not.
        assert_eq!(
            parse_gpu_listing("0, Tesla V100-SXM2-16GB")
                .expect("parses")
                .gpus[&0]
                .0,
            "v100"
        );
        let err = parse_gpu_listing(
            "NVIDIA-SMI has failed because it couldn't communicate with the NVIDIA driver",
        )
        .expect_err("refused");
        assert!(err.to_string().contains("couldn't communicate"), "{err}");
    }

    #[test]
    fn xid_records_parse_from_kmsg_and_dmesg_lines() {
        let kmsg = "4,1234,5678901,-;NVRM: Xid (PCI:0000:86:00): 79, pid=2211, name=python, GPU has fallen off the bus.";
        let xid = parse_xid(kmsg).expect("an Xid");
        assert_eq!(xid.code, 79);
        assert_eq!(xid.pci, PciAddress::parse("00000000:86:00.0").expect("pci"));
        assert_eq!(xid.text, "GPU has fallen off the bus.");
        assert!(xid.is_critical());
        let app = parse_xid("[ 12.5] NVRM: Xid (PCI:0000:3b:00): 13, pid=1, Graphics Exception")
            .expect("an Xid");
        assert!(!app.is_critical(), "an application's own error");
        assert_eq!(parse_xid("usb 1-1: new device"), None);
    }

    #[test]
    fn a_gpu_gone_from_the_listing_or_with_a_critical_xid_is_failed_with_why() {
        let dir = tempfile::tempdir().expect("tempdir");
        let kmsg = dir.path().join("kmsg");
        std::fs::write(
            &kmsg,
            "4,1,1,-;NVRM: Xid (PCI:0000:3b:00): 79, pid=1, GPU has fallen off the bus.\n",
        )
        .expect("write");
        let mut health = GpuHealth::new(Some(KernelLog::open_at_end(&kmsg).expect("opens")));
        let two = parse_gpu_listing(TWO).expect("parses");
        let first = health.check(&two);
        assert_eq!(first.gpus.len(), 2, "an Xid from before is not read");
        assert!(first.failed.is_empty());
        // An application's Xid, then a critical one on GPU 0.
        let mut append = std::fs::OpenOptions::new()
            .append(true)
            .open(&kmsg)
            .expect("append");
        std::io::Write::write_all(
            &mut append,
            b"4,2,2,-;NVRM: Xid (PCI:0000:86:00): 13, pid=1, Graphics Exception\n\
              4,3,3,-;NVRM: Xid (PCI:0000:3b:00): 48, pid=1, An uncorrectable double bit error\n",
        )
        .expect("append");
        let report = health.check(&two);
        assert_eq!(
            report.gpus.iter().map(|g| g.index).collect::<Vec<_>>(),
            vec![1]
        );
        assert_eq!(
            report.failed,
            vec![FailedGpu {
                index: 0,
                gpu_type: "h100".into(),
                reason: "Xid 48: An uncorrectable double bit error".into()
            }]
        );
        // Still failed while listed (the driver does not say it healed).
        assert_eq!(health.check(&two).failed.len(), 1);
        // GPU 1 lost by the driver, then missing without a word.
        let lost = parse_gpu_listing(
            "0, NVIDIA H100 80GB HBM3, 00000000:3B:00.0\n\
             Unable to determine the device handle for GPU 0000:86:00.0: GPU is lost\n",
        )
        .expect("parses");
        let report = health.check(&lost);
        assert!(report.gpus.is_empty());
        assert_eq!(report.failed[1].reason, "lost by the driver: GPU is lost");
        let none = parse_gpu_listing("").expect("parses");
        assert_eq!(
            health.check(&none).failed[1].reason,
            "no longer listed by nvidia-smi"
        );
        // A lost GPU at an address never listed goes to the note.
        let stranger = parse_gpu_listing(
            "Unable to determine the device handle for GPU 0000:AF:00.0: Unknown Error\n",
        )
        .expect("parses");
        let report = health.check(&stranger);
        assert_eq!(
            report.note,
            "GPU at PCI 0000:af:00 lost by the driver: Unknown Error"
        );
    }
}
