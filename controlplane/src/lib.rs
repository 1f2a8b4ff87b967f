//! Keel's control plane: the Raft node, the gRPC API and the server process.
//!
//! - [`raft_node`]: openraft wired to Keel's storage.
//! - [`raft_network`]: Raft between replicas over gRPC.
//! - [`admission`]: the bound on API requests in flight (`--max-api-requests`).
//! - [`api`]: the `keel.api.v1.Keel` gRPC service.
//! - [`caller`]: who made a request: the actor its entries record.
//! - [`grpc_status`]: the one mapping from domain errors to gRPC status codes.
//! - [`history`]: a journal record in words (`keel events`, `keel why`, the console's job page).
//! - [`clock`]: log time and the replicas' clock offsets.
//! - [`proposer`]: group commit: concurrent commands share one Raft entry.
//! - [`convert`]: domain objects to their API messages.
//! - [`inventory`]: this server's nodes and GPUs (discovered or simulated)
//!   and their registration.
//! - [`leader`]: the leader's scheduling and reconcile loops.
//! - [`retention`]: finished jobs, and their worker logs, removed after
//!   `--retain-finished-s`, `--retain-finished-max` and `--retain-logs-s`.
//! - [`permissions`]: owner-only files (the server's umask) and the check
//!   of directories others can read.
//! - [`removal`]: a replica removed from its cluster says so and stops.
//! - [`server`]: the `keel server` process: data dir, Raft, API, loops,
//!   shutdown.
//! - [`tls`]: certificates, their rustls configurations and reload;
//!   [`tls::certs`] makes a cluster's (`keel tls init`).
//! - [`transport`]: plaintext or TLS, for every channel and the listener.

pub mod admission;
pub mod api;
pub mod authz;
pub mod caller;
pub mod clock;
pub mod console;
pub mod convert;
pub mod executors;
pub mod exposure;
pub mod grpc_status;
pub mod history;
pub mod http;
pub mod http_access;
pub mod inventory;
pub mod leader;
pub mod leader_loss;
pub mod log_limit;
pub mod membership;
pub mod metrics;
pub mod node_liveness;
pub mod permissions;
pub mod proposer;
pub mod raft_network;
pub mod raft_node;
pub mod removal;
pub mod retention;
pub mod secret_keys;
pub mod server;
pub mod sim_plot;
pub mod tls;
pub mod traces;
pub mod transport;
pub mod whatif;

/// Largest gRPC request the server accepts, in bytes.
pub const MAX_REQUEST_BYTES: usize = 1024 * 1024;
