//! Keel's chaos suite: a cluster of real `keel server` processes on
//! 127.0.0.1, a concurrent client workload, faults injected on a seeded
//! schedule, and a checker over what the clients saw and what the replicas
//! hold afterwards. In the spirit of Jepsen and etcd's robustness tests.
//!
//! - [`proxy`]: a fault-injecting TCP proxy in front of each replica. Every
//!   replica's connections to its peers leave from its own 127.0.0.x
//!   (`keel server --peer-source-ip`), so the proxy knows each connection's
//!   link and can cut it, one way or both.
//! - [`cluster`]: the replicas as processes: start, SIGKILL, SIGSTOP and
//!   SIGCONT, wipe and rejoin, restart with failpoints; their status over gRPC.
//! - [`workload`]: clients submitting, cancelling and reading jobs at a
//!   bounded rate, each operation recorded with its invocation and
//!   completion times and outcome (acknowledged, failed, indeterminate).
//! - [`faults`]: the fault kinds and the seeded schedule.
//! - [`checker`]: the checks over the history and the final states.
//! - [`report`]: a run's report (text or JSON).
//! - [`run`]: one run, start to report.
//! - [`dst`]: the deterministic simulation of the Raft layer (`keel-dst`):
//!   the same Raft configuration and state machine store in one thread on
//!   a virtual clock, with a simulated network and disk, every choice from
//!   a seed.
//!
//! Nothing here is part of Keel's serving path; the one hook in the server
//! is `--peer-source-ip`.

pub mod checker;
pub mod cluster;
pub mod dst;
pub mod faults;
pub mod proxy;
pub mod report;
pub mod run;
pub mod workers;
pub mod workload;

pub use run::{run, RunConfig};
