//! Fuzz targets for what the executors read from outside (issue 22, item
//! 5): the SSH nodes file, nvidia-smi's listings and its processes, the
//! kernel log's Xid lines, a worker's progress lines and the simulated
//! GPUs flag, fed arbitrary text and mutations of valid inputs. Each must
//! answer with a value or an error: no panic. `KEEL_FUZZ_CASES` sets the
//! inputs per target (default 2,000).

use keel_executors::contract::parse_progress_line;
use keel_executors::discovery::{parse_gpu_processes, parse_simulated_gpus};
use keel_executors::gpu_health::{parse_gpu_listing, parse_xid};
use keel_executors::ssh::parse_nodes_file;
use keel_state::fixtures::{mutate, Mutation};
use proptest::prelude::*;

const NODES_FILE: &str = r"known_hosts: accept-new
install_keel: true
connect_timeout_s: 5
poll_interval_s: 1
work_dir: .keel
nodes:
  - name: gpu-a
    host: 10.0.0.5
    port: 22
    user: train
    gpus: 8xa100
  - name: gpu-b
    host: gpu-b.example
    address: 10.1.0.6
    gpus: 2xv100
    work_dir: /scratch/keel
";
const GPU_LISTING: &str =
    "0, NVIDIA H200, 00000000:3B:00.0\n1, Tesla V100-SXM2-16GB, 00000000:86:00.0\n\
Unable to determine the device handle for GPU 0000:AF:00.0: Unknown Error\n";
const GPU_UUIDS: &str = "0, GPU-aaa\n1, GPU-bbb\n";
const GPU_APPS: &str = "GPU-bbb, 4242, /usr/bin/python3\nGPU-aaa, 17, train\n";
const XID: &str = "[ 12.5] NVRM: Xid (PCI:0000:3b:00): 79, pid=1, GPU has fallen off the bus.";
const PROGRESS: &str =
    r#"KEEL_PROGRESS {"step": 5, "total_steps": 10, "loss": 0.5, "samples_per_s": 12.5}"#;

/// Arbitrary text, or a seed mutated (as bytes, read back lossily).
fn texts(seed: &'static str) -> impl Strategy<Value = String> {
    prop_oneof![
        any::<String>(),
        prop::collection::vec(any::<Mutation>(), 1..6)
            .prop_map(move |m| String::from_utf8_lossy(&mutate(seed.as_bytes(), &m)).into_owned()),
    ]
}

fn config() -> ProptestConfig {
    ProptestConfig {
        cases: keel_state::fixtures::fuzz_cases(),
        max_shrink_iters: 2_000,
        ..ProptestConfig::default()
    }
}

proptest! {
    #![proptest_config(config())]

    #[test]
    fn a_nodes_file_parses_or_is_refused(text in texts(NODES_FILE)) {
        let _ = parse_nodes_file(&text, std::env::temp_dir());
    }

    #[test]
    fn an_nvidia_smi_listing_parses_or_is_refused(text in texts(GPU_LISTING)) {
        let _ = parse_gpu_listing(&text);
    }

    #[test]
    fn gpu_processes_parse_or_are_refused(uuids in texts(GPU_UUIDS), apps in texts(GPU_APPS)) {
        let _ = parse_gpu_processes(&uuids, &apps);
    }

    #[test]
    fn a_kernel_log_line_is_read_or_passed_over(line in texts(XID)) {
        let _ = parse_xid(&line);
    }

    #[test]
    fn a_progress_line_is_read_or_passed_over(line in texts(PROGRESS), at_ms in any::<u64>()) {
        let _ = parse_progress_line(&line, at_ms);
    }

    #[test]
    fn the_simulated_gpus_flag_parses_or_is_refused(text in texts("4xv100,2xk80")) {
        let _ = parse_simulated_gpus(&text);
    }
}

/// The seeds are valid: the mutations start from inputs that parse.
#[test]
fn the_seeds_parse() {
    if let Err(e) = parse_nodes_file(NODES_FILE, std::env::temp_dir()) {
        panic!("{e}");
    }
    assert!(parse_gpu_listing(GPU_LISTING).is_ok());
    assert!(parse_gpu_processes(GPU_UUIDS, GPU_APPS).is_ok());
    assert!(parse_xid(XID).is_some());
    assert!(parse_progress_line(PROGRESS, 1).is_some());
    assert!(parse_simulated_gpus("4xv100,2xk80").is_ok());
}
