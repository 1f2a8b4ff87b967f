//! `keel`: the server and the command-line client.

mod acl_cmd;
mod audit_cmd;
mod cli;
mod config_file;
mod queue_cmd;
mod render;
mod secret_cmd;
mod sim_cmd;
mod snapshot_cmd;
mod tls_cmd;
mod whatif_cmd;

/// mimalloc instead of glibc's malloc: the server allocates and frees small
/// buffers per request, per entry and per RPC; with three replicas and 64
/// clients on two cores, glibc's malloc and free took about an eighth of
/// all CPU time (perf).
#[global_allocator]
static ALLOCATOR: mimalloc::MiMalloc = mimalloc::MiMalloc;

use std::net::SocketAddr;
use std::path::PathBuf;

use anyhow::Context;
use clap::{Parser, Subcommand};
use std::time::Duration;

use keel::inventory::{NodeInventory, DEFAULT_SIMULATED_GPUS, DEFAULT_SIMULATED_NODES};
use keel::leader::LoopSettings;
use keel::raft_node::RaftSettings;
use keel::server::{shutdown_signal, Server, ServerConfig};
use keel_scheduling::policy::QueueOptions;

/// The heading of the client commands' options in every `--help` (clap
/// lists global options under each subcommand; `keel server` ignores them).
const CLIENT_OPTIONS: &str = "Client options (not used by `keel server`)";

#[derive(Parser, Debug)]
#[command(
    name = "keel",
    version,
    about = "Keel: a highly available scheduler for deep-learning training jobs"
)]
struct Args {
    /// Addresses of Keel replicas, comma-separated: the first that answers
    /// is used, and writes go to the leader from any of them.
    #[arg(
        long,
        global = true,
        env = "KEEL_ADDR",
        default_value = "127.0.0.1:7070",
        help_heading = CLIENT_OPTIONS
    )]
    addr: String,
    /// Read this replica's state as it is, without a linearizable read
    /// (answers from a follower may lag the leader).
    #[arg(long, global = true, help_heading = CLIENT_OPTIONS)]
    stale: bool,
    /// Output format of read commands.
    #[arg(long, short = 'o', global = true, value_enum, default_value_t = render::Output::Table, help_heading = CLIENT_OPTIONS)]
    output: render::Output,
    /// The caller's token (with a server started with `--acl`), sent as
    /// `authorization: Bearer TOKEN`.
    #[arg(long, global = true, env = "KEEL_TOKEN", hide_env_values = true,
          conflicts_with = "token_file", help_heading = CLIENT_OPTIONS)]
    token: Option<String>,
    /// A file holding the caller's token (`keel acl ... --secret-file`).
    #[arg(long, global = true, env = "KEEL_TOKEN_FILE", help_heading = CLIENT_OPTIONS)]
    token_file: Option<PathBuf>,
    #[command(flatten)]
    tls: TlsArgs,
    /// Export spans over OTLP/gRPC to this collector (`http://HOST:4317`):
    /// a server's spans of the writes it serves, applies and acts on; a
    /// client's span of its command, every one sampled, whose trace the
    /// servers join (README, "Traces").
    #[arg(long, global = true, env = "KEEL_OTLP_ENDPOINT", value_name = "URL")]
    otlp_endpoint: Option<String>,
    #[command(subcommand)]
    command: Cmd,
}

/// The heading of the TLS options, which the server and the clients share.
const TLS_OPTIONS: &str = "TLS (a server's certificate, or a client's)";

/// The certificates a server serves and calls its peers with, or a client
/// calls with. All three, or none (plaintext). `keel tls init` makes them.
#[derive(clap::Args, Debug)]
struct TlsArgs {
    /// This process's certificate (PEM): a member's for `keel server`
    /// (it must name the member: `ID.members.keel`), a client's otherwise.
    #[arg(long, global = true, env = "KEEL_TLS_CERT", help_heading = TLS_OPTIONS)]
    tls_cert: Option<PathBuf>,
    /// Its private key (PEM).
    #[arg(long, global = true, env = "KEEL_TLS_KEY", help_heading = TLS_OPTIONS)]
    tls_key: Option<PathBuf>,
    /// The cluster CA's certificate (PEM): peers and callers must have a
    /// certificate from it, and servers must show one.
    #[arg(long, global = true, env = "KEEL_TLS_CA", help_heading = TLS_OPTIONS)]
    tls_ca: Option<PathBuf>,
}

impl TlsArgs {
    fn files(&self, who: &'static str) -> anyhow::Result<Option<keel::tls::TlsFiles>> {
        Ok(keel::tls::TlsFiles::from_flags(
            self.tls_cert.clone(),
            self.tls_key.clone(),
            self.tls_ca.clone(),
            who,
        )?)
    }
}

// Parsed once per process: the size of the largest variant costs nothing.
#[allow(clippy::large_enum_variant)]
#[derive(Subcommand, Debug)]
enum Cmd {
    /// Make and issue the cluster's TLS certificates.
    Tls {
        #[command(subcommand)]
        command: tls_cmd::TlsCmd,
    },
    /// Access control: bootstrap, tokens, who am I (with `keel server
    /// --acl`).
    Acl {
        #[command(subcommand)]
        command: acl_cmd::AclCmd,
    },
    /// Back up the cluster's state, and found a new cluster on a backup.
    Snapshot {
        #[command(subcommand)]
        command: snapshot_cmd::SnapshotCmd,
    },
    /// Queues: quotas of GPUs per type for teams sharing the cluster.
    Queue {
        #[command(subcommand)]
        command: queue_cmd::QueueCmd,
    },
    /// Secrets: credentials a job's environment takes by reference,
    /// sealed with the operators' key (`env: {VAR: {secret: NAME/KEY}}`).
    Secret {
        #[command(subcommand)]
        command: secret_cmd::SecretCmd,
    },
    /// Run a Keel server (a Raft replica serving the API).
    Server {
        /// Read the settings from this TOML file: each key is a flag's
        /// name (`round_s = 5` for `--round-s 5`); flags and `KEEL_*`
        /// variables (`KEEL_ROUND_S`) override it. Unknown keys are refused.
        #[arg(long, env = "KEEL_CONFIG", value_name = "FILE")]
        config: Option<PathBuf>,
        /// Print the effective configuration (as a config file, each value
        /// with where it came from) and exit without starting.
        #[arg(long)]
        print_config: bool,
        /// Where the Raft log, state and journal live.
        #[arg(long, default_value = "keel-data")]
        data_dir: PathBuf,
        /// Address to serve the API (and Raft) on. Without TLS
        /// (`--tls-cert`, `--tls-key`, `--tls-ca`), loopback only unless
        /// `--insecure`.
        #[arg(long, default_value = "127.0.0.1:7070")]
        listen: SocketAddr,
        /// Serve on a non-loopback `--listen` address without TLS or
        /// authentication: anyone who reaches it can do anything. Only on a
        /// network you trust.
        #[arg(long)]
        insecure: bool,
        /// Check every caller: a token's role (`authorization: Bearer`), or
        /// `user` for a client certificate alone; `keel acl bootstrap`
        /// makes the first token. Needs TLS. Give it to every replica.
        #[arg(long, env = "KEEL_ACL", value_parser = clap::builder::BoolishValueParser::new())]
        acl: bool,
        /// This replica's Raft member id.
        #[arg(long, default_value_t = 1)]
        id: u64,
        /// The cluster's members at bootstrap, `ID=HOST:PORT,...` (this
        /// replica included; each serves the API and Raft on that address).
        /// HOST may be a DNS name, resolved at each connection and again
        /// after a failed one. Without it, the replica forms a one-member
        /// cluster.
        #[arg(long, value_delimiter = ',', value_parser = parse_peer)]
        peers: Vec<(u64, String)>,
        /// Build a snapshot and compact the log every this many entries.
        #[arg(long, default_value_t = 10_000)]
        snapshot_every: u64,
        /// The local IP this replica's connections to its peers bind to (a
        /// fault-injecting proxy tells replicas apart by it; keel-chaos).
        #[arg(long)]
        peer_source_ip: Option<std::net::IpAddr>,
        /// The newest Raft wire format this replica reads and writes: 2
        /// (protobuf), or 1 to behave as the releases before format 2 did
        /// (to test a cluster of mixed releases). Peers agree on the newest
        /// both read.
        #[arg(long, default_value_t = keel_storage::raft_wire::RAFT_WIRE_FORMAT,
              value_parser = clap::value_parser!(u32).range(
                  keel_storage::raft_wire::RAFT_WIRE_FORMAT_PREVIOUS as i64
                      ..=keel_storage::raft_wire::RAFT_WIRE_FORMAT as i64))]
        raft_wire_format: u32,
        /// How far (ms) this replica's clock may be from the middle of the
        /// cluster's clocks: beyond it, a replica warns, and one ahead does
        /// not lead until its clock is fixed. Log time never goes backwards
        /// and moves at most this far at a change of leader.
        #[arg(long, default_value_t = keel_state::log_time::MAX_CLOCK_OFFSET_MS_DEFAULT,
              value_parser = clap::value_parser!(u64).range(1..=3_600_000))]
        max_clock_offset_ms: u64,
        /// Log entries kept behind a snapshot (a follower further behind
        /// catches up by installing the snapshot).
        #[arg(long, default_value_t = 1000)]
        keep_log_entries: u64,
        /// Declare simulated GPUs instead of discovering real ones, e.g.
        /// `4xv100,2xk80`. Without this flag, GPUs are discovered with
        /// nvidia-smi; where there are none, a small simulated cluster
        /// (4xv100,4xk80 over 2 nodes) is used.
        #[arg(long)]
        simulated_gpus: Option<String>,
        /// Split the simulated GPUs over this many nodes (sim-0, sim-1, ...).
        #[arg(long)]
        simulated_nodes: Option<u32>,
        /// This machine's node name (default: the hostname); with simulated
        /// GPUs, the prefix of the simulated nodes' names (default: `sim`).
        #[arg(long, conflicts_with = "no_local_node")]
        node_name: Option<String>,
        /// With real GPUs: the kernel log read for the driver's Xid
        /// records (a GPU with a critical Xid is offered no more, and its
        /// job goes back to the queue). Read from the server's start.
        #[arg(long, default_value = "/dev/kmsg")]
        gpu_kernel_log: PathBuf,
        /// Where the local executor keeps worker logs, pid and exit records
        /// and checkpoints (default: the data directory). Replicas on one
        /// machine that share one let a new leader re-adopt the workers the
        /// last leader started instead of launching them again.
        #[arg(long)]
        executor_dir: Option<PathBuf>,
        /// Run workers on the SSH hosts this YAML file declares (host, port,
        /// user, key, GPUs or discovery with nvidia-smi), instead of local
        /// processes; no local node is registered. See the README's "SSH
        /// executor".
        #[arg(long, conflicts_with_all = ["simulated_gpus", "simulated_nodes", "node_name", "executor_dir"])]
        ssh_nodes: Option<PathBuf>,
        /// Run the simulated nodes' workers as hollow workers: real to the
        /// control plane (launched, observed, progressing at their model's
        /// speed from the throughput table, checkpointed, exiting) but
        /// without a process each, so one machine can host thousands of
        /// nodes (`--simulated-gpus 10000xv100 --simulated-nodes 1250`).
        /// A job's `keel trainer` flags are honoured. For scale tests.
        #[arg(long, requires = "simulated_gpus",
              conflicts_with_all = ["ssh_nodes", "no_local_node", "kubernetes"])]
        hollow: bool,
        #[command(flatten)]
        kubernetes: KubernetesArgs,
        /// Seconds without a heartbeat after which the leader marks a node
        /// lost (its jobs go back to the queue).
        #[arg(long, default_value_t = 10.0)]
        node_timeout_s: f64,
        /// Register no node for this machine: the server schedules and serves
        /// the API but runs no workers itself.
        #[arg(long, conflicts_with_all = ["simulated_gpus", "simulated_nodes"])]
        no_local_node: bool,
        /// Scheduling policy.
        #[arg(long, default_value = "fifo")]
        policy: String,
        /// Let jobs behind a blocked head of the queue start when they fit.
        #[arg(long)]
        backfill: bool,
        #[command(flatten)]
        tiresias: TiresiasArgs,
        /// Seconds between scheduling rounds (changes also wake the scheduler).
        #[arg(long, default_value_t = 10.0)]
        round_s: f64,
        #[command(flatten)]
        gavel: GavelArgs,
        /// Seconds a stopped worker gets between SIGTERM and SIGKILL.
        #[arg(long, default_value_t = 10.0)]
        stop_grace_s: f64,
        /// Seconds a shutdown (SIGTERM) may take before the server exits
        /// anyway, naming the step it was stuck at (longer than
        /// --stop-grace-s).
        #[arg(long, default_value_t = 30.0)]
        shutdown_timeout_s: f64,
        /// Seconds a replica removed from its cluster keeps answering each
        /// request with its removal before it stops.
        #[arg(long, default_value_t = 5.0)]
        removed_grace_s: f64,
        /// The most event streams (`keel events`, `WatchEvents`) this
        /// replica serves at once; one more is refused (RESOURCE_EXHAUSTED).
        #[arg(long, default_value_t = keel::api::MAX_EVENT_STREAMS as u32,
              value_parser = clap::value_parser!(u32).range(1..=65_536))]
        max_event_streams: u32,
        /// The most API requests this replica works on at once; one more is
        /// refused at once (RESOURCE_EXHAUSTED, OVERLOADED). Raft, health
        /// (`ClusterStatus`) and node heartbeats are never refused for it.
        #[arg(long, default_value_t = keel::admission::MAX_API_REQUESTS as u32,
              value_parser = clap::value_parser!(u32).range(1..=1_000_000))]
        max_api_requests: u32,
        /// Seconds one API request may take before it is answered
        /// DEADLINE_EXCEEDED (a write may still be applied; the CLI sends it
        /// again with its request id). `AddMember` and event streams are
        /// not cut.
        #[arg(long, default_value_t = keel::admission::REQUEST_TIMEOUT.as_secs_f64())]
        request_timeout_s: f64,
        /// The most requests one connection may have open at once (HTTP/2
        /// streams); more wait on the caller's side.
        #[arg(long, default_value_t = keel::server::MAX_STREAMS_PER_CONNECTION,
              value_parser = clap::value_parser!(u32).range(1..=65_536))]
        max_streams_per_connection: u32,
        /// Refuse to start on a data or executor directory that other users
        /// may read (without it, a warning).
        #[arg(long)]
        strict_permissions: bool,
        /// A file holding a key that seals and opens secrets (64 hex
        /// digits, `keel secret new-key`); repeat it while rotating: the
        /// first seals, every one opens. Give every replica the same keys.
        /// A key may also come in KEEL_SECRET_KEY.
        #[arg(long = "secret-key-file", value_name = "FILE")]
        secret_key_file: Vec<PathBuf>,
        /// At most one progress entry per job this often, in seconds.
        #[arg(long, default_value_t = 2.0)]
        progress_interval_s: f64,
        /// Where to serve `/metrics` (Prometheus), `/healthz` and `/readyz`,
        /// or `off`. Without it: 127.0.0.1:7080, or a port the system picks
        /// when that one is taken (written to DATA/http.addr). HTTPS when
        /// the server has TLS; beyond loopback only with TLS and `--acl`,
        /// or `--insecure`.
        #[arg(long, value_name = "ADDR|off")]
        http_listen: Option<String>,
        /// The share of the traces that start at this server (requests
        /// without a sampled `traceparent`, the leader's own rounds) that
        /// are exported, with `--otlp-endpoint`; spans under a sampled
        /// caller's trace always are.
        #[arg(long, default_value_t = 0.01)]
        trace_sample_ratio: f64,
        #[command(flatten)]
        worker_logs: ServerLogArgs,
    },
    /// Show the logs of a job's workers (every epoch and rank).
    Logs {
        id: u64,
        /// Bytes from the end of each worker's log (at most 4 MiB).
        #[arg(long, default_value_t = 64 * 1024)]
        tail_bytes: u64,
        /// Keep printing what the workers write until the job ends.
        #[arg(long, short = 'f')]
        follow: bool,
    },
    /// Mark a node lost (its jobs go back to the queue) or alive again.
    Node {
        #[command(subcommand)]
        command: NodeCmd,
    },
    /// Show or switch the scheduling policy (a switch is a logged entry).
    Policy {
        #[command(subcommand)]
        command: PolicyCmd,
    },
    /// A simulated training job for demos and tests: advances at the speed
    /// of its model on the GPUs it was given, reports progress, checkpoints
    /// on SIGTERM and resumes. Reads the worker contract's environment.
    Trainer(keel_executors::trainer::TrainerArgs),
    /// Run a worker and record its exit (used by the local executor).
    #[command(hide = true)]
    Supervise {
        #[arg(long)]
        exit_file: PathBuf,
        /// Run the worker in this cgroup (made if missing) and stop what it
        /// leaves in it before writing the exit.
        #[arg(long)]
        cgroup: Option<PathBuf>,
        /// How long processes the worker left get between SIGTERM and the
        /// kill, in milliseconds.
        #[arg(long, default_value_t = 10_000)]
        leftover_grace_ms: u64,
        /// The cgroup holding the worker's memory limit (its own on v2).
        #[arg(long)]
        memory_cgroup: Option<PathBuf>,
        /// The cgroup holding its CPU limit.
        #[arg(long)]
        cpu_cgroup: Option<PathBuf>,
        /// The worker's memory limit, in bytes.
        #[arg(long)]
        memory_max_bytes: Option<u64>,
        /// The worker's CPU limit, in thousandths of a CPU.
        #[arg(long)]
        cpu_max_millis: Option<u32>,
        /// The worker's umask (octal, e.g. 0022): the server's own runs
        /// under 077.
        #[arg(long)]
        worker_umask: Option<String>,
        #[command(flatten)]
        log: WorkerLogArgs,
        #[arg(trailing_var_arg = true, allow_hyphen_values = true, required = true)]
        command: Vec<String>,
    },
    /// Copy standard input to a worker's log, rotated (used by the SSH
    /// executor's host helper, where the supervisor is a shell).
    #[command(hide = true)]
    LogWriter {
        /// Only say `keel-log-writer 1` (the host helper's check that the
        /// `keel` it finds is one that writes logs).
        #[arg(long)]
        probe: bool,
        #[command(flatten)]
        log: WorkerLogArgs,
    },
    /// Submit a job from a YAML or JSON spec file (`-` reads stdin).
    Submit {
        /// The job's YAML spec (name, command or image, gpus, workers, ...;
        /// see examples/).
        #[arg(short = 'f', long = "file")]
        file: PathBuf,
    },
    /// List jobs.
    Jobs {
        /// Only jobs in this state.
        #[arg(long)]
        state: Option<String>,
        /// Only jobs of this user.
        #[arg(long)]
        user: Option<String>,
        /// Only jobs of this queue.
        #[arg(long)]
        queue: Option<String>,
    },
    /// Show one job.
    Job { id: u64 },
    /// Cancel a job.
    Cancel {
        id: u64,
        #[arg(long, default_value = "cancelled by the user")]
        reason: String,
    },
    /// List nodes and their GPUs.
    Nodes,
    /// Show applied entries and their events.
    Events {
        /// First log index to show.
        #[arg(long, default_value_t = 0)]
        from: u64,
        /// Keep streaming new events.
        #[arg(long)]
        follow: bool,
    },
    /// The Raft cluster.
    Cluster {
        #[command(subcommand)]
        command: ClusterCmd,
    },
    /// Rebuild the state offline from a data directory's journal.
    Replay {
        #[arg(long)]
        data_dir: PathBuf,
        /// Stop after this log index.
        #[arg(long, conflicts_with = "at")]
        until: Option<u64>,
        /// Stop after the last entry stamped at or before this time
        /// (RFC 3339, e.g. 2026-11-26T10:00:00Z).
        #[arg(long)]
        at: Option<String>,
    },
    /// A tamper-evident export of a data directory's log, and its check.
    Audit {
        #[command(subcommand)]
        command: audit_cmd::AuditCmd,
    },
    /// Why a job is where it is: its history from the log (submission,
    /// every allocation decision that touched it with policy, round,
    /// based-on index and GPUs, preemptions, worker exits), with times.
    Why { id: u64 },
    /// Simulate a workload on a cluster with a policy: the real state
    /// machine and policies on a virtual clock (no server needed).
    Sim(Box<sim_cmd::SimArgs>),
    /// Run a data directory's recorded history through the simulator: the
    /// policies that decided (`recorded`), checked against what happened,
    /// then other policies or another cluster.
    Whatif(Box<whatif_cmd::WhatifArgs>),
}

#[derive(Subcommand, Debug)]
enum NodeCmd {
    /// Mark a node lost: the jobs on it are preempted and go back to the queue.
    Lost {
        name: String,
        #[arg(long, default_value = "")]
        reason: String,
    },
    /// Mark a lost node alive again.
    Alive { name: String },
    /// Forget a node (retired, or registered by mistake). Refused while
    /// jobs hold its GPUs, unless --force. A node whose agent still reports
    /// is registered again by its next report: stop the agent (or take the
    /// host out of the nodes file) first.
    Remove {
        name: String,
        /// Remove it even though jobs hold its GPUs: they go back to the
        /// queue.
        #[arg(long)]
        force: bool,
    },
}

/// Tiresias's knobs (`tiresias`, `elastic_tiresias`).
#[derive(clap::Args, Debug, Clone)]
pub struct TiresiasArgs {
    /// Queue thresholds in GPU-seconds of attained service, ascending.
    #[arg(long, value_delimiter = ',', default_value = "3600")]
    pub tiresias_thresholds_gpu_s: Vec<u64>,
    /// Promote a waiting job to the first queue after it waited this many
    /// times as long as it has run (0: never).
    #[arg(long, default_value_t = 8)]
    pub starvation_factor: u64,
}

impl TiresiasArgs {
    pub fn options(&self) -> anyhow::Result<keel_scheduling::policy::TiresiasOptions> {
        let options = keel_scheduling::policy::TiresiasOptions {
            thresholds_gpu_s: self.tiresias_thresholds_gpu_s.clone(),
            starvation_factor: self.starvation_factor,
        };
        options
            .validate()
            .map_err(|e| anyhow::anyhow!("--tiresias-thresholds-gpu-s: {e}"))?;
        Ok(options)
    }
}

/// The heterogeneity-aware policies' round constants.
#[derive(clap::Args, Debug, Clone)]
pub struct GavelArgs {
    /// Heterogeneity-aware policies: seconds per round of time sharing
    /// (a job placed differently next round is checkpointed and relaunched).
    #[arg(long, default_value_t = 360.0)]
    pub gavel_round_s: f64,
    /// Heterogeneity-aware policies: least seconds between two solves of
    /// the fractional allocation.
    #[arg(long, default_value_t = 1920.0)]
    pub resolve_interval_s: f64,
    /// Price per hour of each GPU type, for
    /// `max_sum_throughput_normalized_by_cost_perf`: `v100=2.48,k80=0.45`
    /// (types not named cost 1).
    #[arg(long, value_parser = parse_price, value_delimiter = ',')]
    pub gpu_prices: Vec<(String, f64)>,
}

/// `TYPE=DOLLARS_PER_HOUR`.
pub fn parse_price(s: &str) -> Result<(String, f64), String> {
    let (t, p) = s
        .split_once('=')
        .ok_or_else(|| format!("{s:?} is not TYPE=DOLLARS_PER_HOUR"))?;
    let p: f64 = p.trim().parse().map_err(|e| format!("price of {t}: {e}"))?;
    if !(p.is_finite() && p > 0.0 && p <= 1e6) {
        return Err(format!(
            "price of {t}: {p} is not between 0 and 1e6 dollars per hour"
        ));
    }
    Ok((t.trim().to_ascii_lowercase(), p))
}

impl GavelArgs {
    pub fn options(&self) -> anyhow::Result<keel_scheduling::policy::GavelOptions> {
        let options = keel_scheduling::policy::GavelOptions {
            round_s: self.gavel_round_s,
            min_resolve_interval_s: self.resolve_interval_s,
            instance_costs: self.gpu_prices.iter().cloned().collect(),
        };
        options
            .validate()
            .map_err(|e| anyhow::anyhow!("--{}", e.replace('_', "-")))?;
        Ok(options)
    }
}

#[derive(Subcommand, Debug)]
enum PolicyCmd {
    /// The policy rounds use now, and the known ones.
    Show,
    /// Switch every later round to this policy.
    Set { name: String },
    /// Evaluate heterogeneity-aware policies on a JSON input shaped like a
    /// case of Gavel's `policy_golden.json` (cluster_spec, throughputs,
    /// scale_factors, priority_weights, ...); prints each policy's
    /// allocation and effective throughputs as JSON. Runs locally.
    Eval {
        /// The JSON input (for instance examples/policy-case.json).
        #[arg(long)]
        input: PathBuf,
        /// One policy (default: every one Keel has).
        #[arg(long)]
        policy: Option<String>,
    },
}

#[derive(Subcommand, Debug)]
enum ClusterCmd {
    /// Every member: role, term, indexes, replication lag, state hash.
    Status,
    /// Add a replica (started with `keel server --id N --peers ...`, where it
    /// waits): it joins as a learner, catches up, then becomes a voter.
    Add {
        #[arg(long)]
        id: u64,
        /// The new replica's HOST:PORT.
        #[arg(long)]
        member_addr: String,
        /// Keep it a learner (it replicates but does not vote).
        #[arg(long)]
        learner_only: bool,
        /// Seconds it may take to catch up as a learner; past them it is
        /// removed again and nothing changed.
        #[arg(long, default_value_t = 60)]
        catch_up_timeout_s: u32,
    },
    /// Remove a replica from the cluster.
    Remove {
        #[arg(long)]
        id: u64,
    },
    /// Offline, on a stopped replica: make it the only voter of its cluster
    /// (etcd's --force-new-cluster). For a cluster that lost a quorum of its
    /// voters or is stuck in a membership change that cannot complete. Run
    /// it on the survivor with the most log; it keeps everything its log
    /// holds. Wipe the other members' data directories before adding them
    /// back with `keel cluster add`.
    ForceNewCluster {
        /// The stopped replica's data directory.
        #[arg(long)]
        data_dir: PathBuf,
        /// Its member id (as given to `keel server --id`).
        #[arg(long)]
        id: u64,
        /// The address it serves on (default: its address in the
        /// membership).
        #[arg(long)]
        member_addr: Option<String>,
    },
}

/// Largest `keel policy eval` input read.
const POLICY_EVAL_INPUT_MAX_BYTES: u64 = 64 * 1024 * 1024;

fn policy_eval(input: &std::path::Path, policy: Option<&str>) -> anyhow::Result<()> {
    use anyhow::Context;
    let text = sim_cmd::read_text_limited(input, POLICY_EVAL_INPUT_MAX_BYTES)?;
    let problem: keel_scheduling::gavel::AllocationProblem =
        serde_json::from_str(&text).with_context(|| format!("in {}", input.display()))?;
    let mut results = std::collections::BTreeMap::new();
    match policy {
        Some(name) => {
            let result = keel_scheduling::gavel::solve(name, &problem)?;
            results.insert(name, serde_json::to_value(result)?);
        }
        None => {
            // Bad input fails the command; a policy that does not take
            // this input (AlloX and multi-GPU jobs) says so in its entry.
            problem.validate()?;
            for name in keel_scheduling::gavel::GAVEL_POLICY_NAMES {
                let value = match keel_scheduling::gavel::solve(name, &problem) {
                    Ok(result) => serde_json::to_value(result)?,
                    Err(e) => serde_json::json!({ "error": e.to_string() }),
                };
                results.insert(*name, value);
            }
        }
    }
    render::print_json(&results)
}

/// How the server's executor writes its workers' logs.
#[derive(clap::Args, Debug)]
struct ServerLogArgs {
    /// Rotate each worker's log at this many bytes (64 KiB to 1 GiB).
    #[arg(long, default_value_t = keel_executors::worker_log::DEFAULT_LOG_ROTATION.max_file_bytes)]
    worker_log_max_file_bytes: u64,
    /// Keep this many files of each worker's log, the current one included
    /// (2 to 100): a log holds at most this times the file size.
    #[arg(long, default_value_t = keel_executors::worker_log::DEFAULT_LOG_ROTATION.max_files)]
    worker_log_max_files: u32,
    /// Pause a worker's log (dropping its output, saying so) while the
    /// filesystem it is on has less than this many bytes free, so that a
    /// noisy job cannot fill the disk the Raft log needs (0: never).
    #[arg(long, default_value_t = keel_executors::worker_log::DEFAULT_MIN_FREE_BYTES)]
    worker_log_min_free_bytes: u64,
    /// Remove a finished job's worker logs this many seconds after it
    /// finished (0: keep them, even after the job is removed). A job's
    /// logs go with it at the latest (`--retain-finished-s`).
    #[arg(long, default_value_t = 7.0 * 86_400.0)]
    retain_logs_s: f64,
    /// Remove a finished job from the state this many seconds after it
    /// finished, by a logged `RemoveJob` (0: keep finished jobs this long
    /// without a limit). `keel why`, `keel events` and `keel replay`
    /// still find it in the journal.
    #[arg(long, default_value_t = keel::retention::DEFAULT_RETAIN_FINISHED.as_secs_f64())]
    retain_finished_s: f64,
    /// Keep at most this many finished jobs in the state: the oldest beyond
    /// it are removed (0: no limit).
    #[arg(long, default_value_t = keel::retention::DEFAULT_RETAIN_FINISHED_MAX as u64)]
    retain_finished_max: u64,
}

/// A retention in seconds as a duration (`None` for 0: kept).
fn retention_s(flag: &str, s: f64) -> anyhow::Result<Option<Duration>> {
    if !(s.is_finite() && (0.0..=3_650.0 * 86_400.0).contains(&s)) {
        anyhow::bail!("--{flag} must be between 0 and 315360000 seconds, not {s}");
    }
    Ok((s > 0.0).then(|| Duration::from_secs_f64(s)))
}

impl ServerLogArgs {
    fn retention(&self) -> anyhow::Result<keel::retention::Retention> {
        Ok(keel::retention::Retention {
            logs: retention_s("retain-logs-s", self.retain_logs_s)?,
            finished: retention_s("retain-finished-s", self.retain_finished_s)?,
            finished_max: match usize::try_from(self.retain_finished_max) {
                Ok(0) => None,
                Ok(n) => Some(n),
                Err(_) => anyhow::bail!(
                    "--retain-finished-max must be at most {}, not {}",
                    usize::MAX,
                    self.retain_finished_max
                ),
            },
        })
    }

    fn settings(&self) -> anyhow::Result<keel_executors::worker_log::LogSettings> {
        let rotation = keel_executors::worker_log::Rotation {
            max_file_bytes: self.worker_log_max_file_bytes,
            max_files: self.worker_log_max_files,
        }
        .checked("--worker-log-max-file-bytes/--worker-log-max-files")
        .map_err(anyhow::Error::msg)?;
        Ok(keel_executors::worker_log::LogSettings {
            rotation,
            min_free_bytes: self.worker_log_min_free_bytes,
        })
    }
}

/// Where and how a worker's output is written (`keel supervise`, `keel
/// log-writer`).
#[derive(clap::Args, Debug)]
struct WorkerLogArgs {
    /// The worker's log; without it, the output goes where stdout does.
    #[arg(long)]
    log: Option<PathBuf>,
    /// Rotate the log at this many bytes.
    #[arg(long, default_value_t = keel_executors::worker_log::DEFAULT_LOG_ROTATION.max_file_bytes)]
    log_max_file_bytes: u64,
    /// Keep this many of its files.
    #[arg(long, default_value_t = keel_executors::worker_log::DEFAULT_LOG_ROTATION.max_files)]
    log_max_files: u32,
    /// Pause the log while its filesystem has less than this free (0: never).
    #[arg(long, default_value_t = 0)]
    log_min_free_bytes: u64,
}

impl WorkerLogArgs {
    fn output(&self) -> anyhow::Result<Option<keel_executors::supervisor::WorkerOutput>> {
        use keel_executors::worker_log::{FreeSpaceFloor, Rotation};
        let Some(log) = &self.log else {
            return Ok(None);
        };
        let rotation = Rotation {
            max_file_bytes: self.log_max_file_bytes,
            max_files: self.log_max_files,
        }
        .checked("--log-max-file-bytes/--log-max-files")
        .map_err(anyhow::Error::msg)?;
        Ok(Some(keel_executors::supervisor::WorkerOutput {
            log: log.clone(),
            rotation,
            floor: (self.log_min_free_bytes > 0).then_some(FreeSpaceFloor {
                min_free_bytes: self.log_min_free_bytes,
            }),
        }))
    }
}

fn init_tracing(traces: Option<keel::traces::TraceLayer>) {
    use tracing_subscriber::layer::SubscriberExt;
    // The span export first: its filter names only the trace's target.
    // Never an `Option` layer that is `None`: it answers "always" for
    // every call site, so every debug span of openraft's would be built
    // (BENCHMARKS.md, "What watching costs").
    let (set, log_level) = match traces {
        Some(traces) => {
            let (log, level) = log_layer();
            let subscriber = tracing_subscriber::registry().with(traces).with(log);
            (tracing::subscriber::set_global_default(subscriber), level)
        }
        None => {
            let (log, level) = log_layer();
            let subscriber = tracing_subscriber::registry().with(log);
            (tracing::subscriber::set_global_default(subscriber), level)
        }
    };
    set.expect("the process's subscriber is set once, at start");
    // The `log` crate's records (sled's) are for the log alone: capped at
    // its filter's most verbose level, not at the span export's (TRACE),
    // so a `log::debug!` of sled's is dropped at its call site instead of
    // being handed to the subscriber to refuse (BENCHMARKS.md, "Beside
    // the commit before issue 21").
    tracing_log::LogTracer::builder()
        .with_max_level(log_level)
        .init()
        .expect("the process's `log` logger is set once, at start");
}

/// The server's log on stderr, filtered by `KEEL_LOG`, and the most
/// verbose level that filter passes.
fn log_layer<S>() -> (
    impl tracing_subscriber::Layer<S> + Send + Sync,
    tracing_log::log::LevelFilter,
)
where
    S: tracing::Subscriber + for<'a> tracing_subscriber::registry::LookupSpan<'a>,
{
    let filter = tracing_subscriber::EnvFilter::try_from_env("KEEL_LOG")
        .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new(keel::log_limit::DEFAULT_FILTER));
    // Colour only on a terminal: a log redirected to a file stays plain text.
    // openraft's repeated warnings and errors (one per failed heartbeat
    // while a member is down) at most once a minute per place in its code.
    //
    // One filter, the two joined with `and`: two per-layer filters stacked
    // (`with_filter(a).with_filter(b)`) have their interests summed as if
    // they were two layers', so a call site one of them never wants (every
    // debug span of openraft's) is checked at run time at every hit, and
    // its spans built: about 8 % of the replicas' CPU in a profile of the
    // write benchmark (BENCHMARKS.md, "Beside the commit before issue 21").
    use tracing_log::AsLog;
    use tracing_subscriber::filter::FilterExt;
    use tracing_subscriber::layer::Filter;
    use tracing_subscriber::Layer;
    let repeats = keel::log_limit::RepeatLimit::new(vec!["openraft"], Duration::from_secs(60));
    let filter = filter.and(repeats);
    let level = <_ as Filter<S>>::max_level_hint(&filter)
        .map_or(tracing_log::log::LevelFilter::Trace, |l| l.as_log());
    let layer = tracing_subscriber::fmt::layer()
        .with_ansi(std::io::IsTerminal::is_terminal(&std::io::stderr()))
        .with_writer(std::io::stderr)
        .with_filter(filter);
    (layer, level)
}

/// The Kubernetes executor's flags.
#[derive(Debug, clap::Args)]
struct KubernetesArgs {
    /// Run workers as Pods on a Kubernetes cluster (the kubeconfig, or the
    /// in-cluster service account) instead of local processes; its Nodes
    /// with GPUs are Keel's nodes. See the README's "Kubernetes executor".
    #[arg(long, conflicts_with_all = ["ssh_nodes", "simulated_gpus", "simulated_nodes", "node_name", "executor_dir"])]
    kubernetes: bool,
    /// The namespace Keel's Pods and Services go in.
    #[arg(long, default_value = "default", requires = "kubernetes")]
    k8s_namespace: String,
    /// The image for jobs that give a command and no image.
    #[arg(long, requires = "kubernetes")]
    k8s_default_image: Option<String>,
    /// A PersistentVolumeClaim for checkpoints (each job in its own
    /// directory); without one, checkpoints are lost with the Pod.
    #[arg(long, requires = "kubernetes")]
    k8s_checkpoint_claim: Option<String>,
    /// Seconds a Pod may stay Pending before its worker is reported as not
    /// started.
    #[arg(long, default_value_t = 300.0, requires = "kubernetes")]
    k8s_pending_timeout_s: f64,
    /// Talk to this API server URL without credentials (e.g. `kubectl
    /// proxy`'s `http://127.0.0.1:8001`) instead of the kubeconfig.
    #[arg(long, requires = "kubernetes")]
    k8s_api_url: Option<String>,
    /// A taint Keel's Pods tolerate, `KEY[=VALUE][:EFFECT]` (repeat for
    /// more): put on every Pod, and a Node tainted only with these takes
    /// workers.
    #[arg(
        long = "k8s-tolerate",
        value_name = "KEY[=VALUE][:EFFECT]",
        requires = "kubernetes"
    )]
    k8s_tolerate: Vec<String>,
    /// Seconds one API call may take before it counts as failed (creates
    /// and deletes are then tried again in the background).
    #[arg(long, default_value_t = 10.0, requires = "kubernetes")]
    k8s_call_timeout_s: f64,
    /// Force-delete a stopped Pod still Terminating 60 s after its grace
    /// (its containers may still run on the GPUs: only where the node is
    /// known to be gone).
    #[arg(long, requires = "kubernetes")]
    k8s_force_delete: bool,
}

impl KubernetesArgs {
    fn target(&self) -> anyhow::Result<Option<keel::server::KubernetesTarget>> {
        if !self.kubernetes {
            return Ok(None);
        }
        let s = self.k8s_pending_timeout_s;
        if !(s.is_finite() && s > 0.0 && s <= 86_400.0) {
            anyhow::bail!("--k8s-pending-timeout-s must be between 0 and 86400 seconds, not {s}");
        }
        let namespace = &self.k8s_namespace;
        let dns_label = !namespace.is_empty()
            && namespace.len() <= 63
            && namespace
                .chars()
                .all(|c| c.is_ascii_lowercase() || c.is_ascii_digit() || c == '-')
            && !namespace.starts_with('-')
            && !namespace.ends_with('-');
        if !dns_label {
            anyhow::bail!(
                "--k8s-namespace {namespace:?} is not a DNS label (lower-case letters, digits and '-', at most 63)"
            );
        }
        let mut config = keel_executors::KubeConfig::new(namespace);
        config.default_image = self.k8s_default_image.clone();
        config.checkpoint_claim = self.k8s_checkpoint_claim.clone();
        config.pending_timeout = Duration::from_secs_f64(s);
        let t = self.k8s_call_timeout_s;
        if !(t.is_finite() && (0.1..=600.0).contains(&t)) {
            anyhow::bail!("--k8s-call-timeout-s must be between 0.1 and 600 seconds, not {t}");
        }
        config.call_timeout = Duration::from_secs_f64(t);
        config.force_delete = self.k8s_force_delete;
        for text in &self.k8s_tolerate {
            let toleration = keel_executors::KubeConfig::parse_toleration(text)
                .map_err(|e| anyhow::anyhow!("--k8s-tolerate {e}"))?;
            config.tolerations.push(toleration);
        }
        Ok(Some(keel::server::KubernetesTarget {
            api_url: self.k8s_api_url.clone(),
            config,
        }))
    }
}

/// Reads and checks an SSH nodes file. Host keys go to the file it names
/// (`known_hosts_file`), else to `DATA_DIR/ssh_known_hosts`: Keel's own,
/// not the operator's `~/.ssh/known_hosts`.
fn read_ssh_nodes(
    path: &std::path::Path,
    data_dir: &std::path::Path,
) -> anyhow::Result<keel_executors::SshConfig> {
    use keel_executors::ssh::{parse_nodes_file, NODES_FILE_MAX_BYTES};
    let len = std::fs::metadata(path)
        .with_context(|| format!("--ssh-nodes {}", path.display()))?
        .len();
    if len > NODES_FILE_MAX_BYTES as u64 {
        anyhow::bail!(
            "--ssh-nodes {}: {len} bytes, more than {NODES_FILE_MAX_BYTES}",
            path.display()
        );
    }
    let text =
        std::fs::read_to_string(path).with_context(|| format!("--ssh-nodes {}", path.display()))?;
    // Control sockets need a short path (at most 107 bytes).
    let control_dir = std::env::temp_dir().join("keel-ssh");
    let mut config = parse_nodes_file(&text, control_dir)
        .with_context(|| format!("--ssh-nodes {}", path.display()))?;
    if config.known_hosts_file.is_none() {
        config.known_hosts_file = Some(data_dir.join("ssh_known_hosts"));
    }
    // This binary goes to the hosts, so job files run `keel trainer` there.
    config.keel_binary = Some(std::env::current_exe().context("finding the keel binary")?);
    Ok(config)
}

#[tokio::main]
async fn main() -> std::process::ExitCode {
    // Chaos builds: failpoints from the FAILPOINTS environment variable.
    #[cfg(feature = "failpoints")]
    let _failpoints = fail::FailScenario::setup();
    let command = <Args as clap::CommandFactory>::command();
    let argv = match config_file::prepare(&command, std::env::args_os().collect(), &|var| {
        std::env::var(var).ok()
    }) {
        Ok(config_file::Prepared::Run(argv)) => argv,
        Ok(config_file::Prepared::Print(text)) => {
            #[allow(clippy::print_stdout)]
            {
                print!("{text}");
            }
            return std::process::ExitCode::SUCCESS;
        }
        Err(e) => {
            #[allow(clippy::print_stderr)]
            {
                eprintln!("error: {e:#}");
            }
            return std::process::ExitCode::from(2);
        }
    };
    let matches = command.get_matches_from(argv);
    let args = match <Args as clap::FromArgMatches>::from_arg_matches(&matches) {
        Ok(args) => args,
        Err(e) => e.exit(),
    };
    let (traces, span) = match client_traces(&args, matches.subcommand_name().unwrap_or("")) {
        Ok(Some((traces, span))) => (Some(traces), span),
        Ok(None) => (None, tracing::Span::none()),
        Err(e) => {
            #[allow(clippy::print_stderr)]
            {
                eprintln!("error: {e:#}");
            }
            return std::process::ExitCode::FAILURE;
        }
    };
    let outcome = tracing::Instrument::instrument(run(args), span.clone()).await;
    if outcome.is_err() {
        span.record("otel.status_code", "ERROR");
    }
    drop(span);
    if let Some(traces) = traces {
        traces.shutdown().await;
    }
    match outcome {
        Ok(()) => std::process::ExitCode::SUCCESS,
        // The reader went away (`keel jobs | head`): nothing more to say.
        Err(e) if closed_pipe(&e) => std::process::ExitCode::SUCCESS,
        Err(e) => {
            #[allow(clippy::print_stderr)]
            {
                eprintln!("error: {e:#}");
            }
            std::process::ExitCode::FAILURE
        }
    }
}

/// A client command's trace: with `--otlp-endpoint`, its span (a child of
/// `TRACEPARENT` from the environment, when set), whose context every
/// request carries; without, `TRACEPARENT` passed on as it is. The server
/// sets up its own export.
fn client_traces(
    args: &Args,
    command: &str,
) -> anyhow::Result<Option<(keel::traces::TraceExport, tracing::Span)>> {
    if matches!(args.command, Cmd::Server { .. }) {
        return Ok(None);
    }
    let inherited = std::env::var("TRACEPARENT")
        .ok()
        .filter(|t| keel::traces::parent_context(t).is_some());
    let Some(endpoint) = &args.otlp_endpoint else {
        if let Some(parent) = inherited {
            let _ = cli::TRACE_PARENT.set(parent);
        }
        return Ok(None);
    };
    let (traces, layer) =
        keel::traces::TraceExport::start(endpoint, keel::traces::Sampling::Always, "client")?;
    use tracing_subscriber::layer::SubscriberExt;
    use tracing_subscriber::util::SubscriberInitExt;
    tracing_subscriber::registry().with(layer).init();
    let span = tracing::trace_span!(
        target: keel::traces::TARGET,
        "keel.cli",
        otel.name = format!("keel {command}"),
        otel.kind = "client",
        otel.status_code = tracing::field::Empty,
    );
    if let Some(parent) = &inherited {
        keel::traces::join(&span, parent);
    }
    if let Some(parent) = keel::traces::trace_parent_of(&span) {
        let _ = cli::TRACE_PARENT.set(parent);
    }
    Ok(Some((traces, span)))
}

/// Whether `e` is a write to a pipe whose reader has gone.
fn closed_pipe(e: &anyhow::Error) -> bool {
    e.chain().any(|cause| {
        cause
            .downcast_ref::<std::io::Error>()
            .is_some_and(|io| io.kind() == std::io::ErrorKind::BrokenPipe)
    })
}

async fn run(args: Args) -> anyhow::Result<()> {
    let out = args.output;
    let _ = cli::STALE_READS.set(args.stale);
    if let Some(token) = args.token.clone() {
        let _ = cli::TOKEN.set(token);
    } else if let Some(file) = &args.token_file {
        let token = std::fs::read_to_string(file)
            .with_context(|| format!("cannot read the token file {}", file.display()))?;
        let _ = cli::TOKEN.set(token.trim().to_string());
    }
    if !matches!(args.command, Cmd::Server { .. } | Cmd::Tls { .. }) {
        if let Some(files) = args.tls.files("a client")? {
            let tls = keel::tls::TlsState::load(files, keel::tls::Holder::Client)?;
            let _ = cli::TRANSPORT.set(keel::transport::Transport::Tls(std::sync::Arc::new(tls)));
        }
    }
    match args.command {
        Cmd::Tls { command } => tls_cmd::run(command, out),
        Cmd::Audit { command } => audit_cmd::run(command, out),
        Cmd::Acl { command } => acl_cmd::run(&args.addr, command, out).await,
        Cmd::Queue { command } => queue_cmd::run(&args.addr, command, out).await,
        Cmd::Secret { command } => secret_cmd::run(&args.addr, command, out).await,
        Cmd::Snapshot { command } => snapshot_cmd::run(&args.addr, command, out).await,
        Cmd::Server {
            config: _,
            print_config: _,
            data_dir,
            listen,
            insecure,
            acl,
            id,
            peers,
            snapshot_every,
            peer_source_ip,
            raft_wire_format,
            max_clock_offset_ms,
            keep_log_entries,
            simulated_gpus,
            simulated_nodes,
            node_name,
            gpu_kernel_log,
            executor_dir,
            ssh_nodes,
            hollow,
            kubernetes,
            node_timeout_s,
            no_local_node,
            policy,
            backfill,
            tiresias,
            round_s,
            gavel,
            stop_grace_s,
            shutdown_timeout_s,
            removed_grace_s,
            max_event_streams,
            max_api_requests,
            request_timeout_s,
            max_streams_per_connection,
            strict_permissions,
            secret_key_file,
            progress_interval_s,
            http_listen,
            trace_sample_ratio,
            worker_logs,
        } => {
            let sampling = keel::traces::Sampling::ratio(trace_sample_ratio)?;
            let traces = match &args.otlp_endpoint {
                Some(endpoint) => Some(keel::traces::TraceExport::start(
                    endpoint,
                    sampling,
                    &format!("member {id}"),
                )?),
                None => None,
            };
            let (traces, trace_layer) = traces.unzip();
            init_tracing(trace_layer);
            let http = keel::http::HttpListen::from_flag(http_listen.as_deref())
                .map_err(anyhow::Error::msg)?;
            let transport = match args.tls.files("keel server")? {
                Some(files) => {
                    if files.cert.is_none() {
                        anyhow::bail!(
                            "keel server needs --tls-cert, --tls-key and --tls-ca together"
                        );
                    }
                    let tls = keel::tls::TlsState::load(files, keel::tls::Holder::Member(id))?;
                    keel::transport::Transport::Tls(std::sync::Arc::new(tls))
                }
                None => keel::transport::Transport::Plain,
            };
            if acl && !transport.is_tls() {
                anyhow::bail!(
                    "--acl needs TLS (--tls-cert, --tls-key and --tls-ca; `keel tls init` makes \
                     them): replicas tell each other from clients by their certificates, and \
                     tokens must not cross the network in plaintext"
                );
            }
            if let Some(addr) = http.addr() {
                if keel::http::check_listen(addr, insecure, transport.is_tls(), acl)? {
                    tracing::warn!(
                        "serving the console and /metrics on {addr} without TLS and ACLs \
                         (--insecure): anyone who reaches it sees the cluster's jobs, queues \
                         and nodes"
                    );
                }
            }
            if keel::exposure::check_listen(listen, insecure, transport.is_tls(), acl)? {
                tracing::warn!(
                    "serving on {listen} without TLS and ACLs (--insecure): anyone who \
                     reaches it can submit, cancel, change the policy and the membership"
                );
            }
            // Before anything is created: owner-only files from here on;
            // workers get the umask back (issue 35).
            let worker_umask = keel::permissions::restrict_umask();
            let dirs = [
                Some((data_dir.as_path(), "the data directory")),
                executor_dir
                    .as_deref()
                    .map(|d| (d, "the executor directory")),
            ];
            for (dir, what) in dirs.into_iter().flatten() {
                if let Some(why) = keel::permissions::not_private(dir, what) {
                    if strict_permissions {
                        anyhow::bail!("{why}");
                    }
                    tracing::warn!("{why}");
                }
            }
            let retention = worker_logs.retention()?;
            let worker_logs = worker_logs.settings()?;
            let seconds = |name: &str, s: f64| -> anyhow::Result<Duration> {
                if !(s.is_finite() && s > 0.0 && s <= 86_400.0) {
                    anyhow::bail!("--{name} must be between 0 and 86400 seconds, not {s}");
                }
                Ok(Duration::from_secs_f64(s))
            };
            let policy_options = keel_scheduling::policy::PolicyOptions {
                queue: QueueOptions { backfill },
                tiresias: tiresias.options()?,
                gavel: gavel.options()?,
            };
            let policy = keel_scheduling::policy::by_name_with(&policy, &policy_options)?;
            if kubernetes.kubernetes && keel_scheduling::gavel::shares_gpus(policy.name()) {
                anyhow::bail!(
                    "--policy {}: {}",
                    policy.name(),
                    keel_executors::kubernetes::CANNOT_SHARE_GPUS
                );
            }
            let ssh = ssh_nodes
                .as_deref()
                .map(|path| read_ssh_nodes(path, &data_dir))
                .transpose()?
                .map(|mut ssh| {
                    ssh.logs = worker_logs;
                    ssh
                });
            if !acl {
                tracing::warn!(
                    "ACLs are off (no --acl): every caller that reaches {listen} may do anything"
                );
            }
            let request_timeout = seconds("request-timeout-s", request_timeout_s)?;
            let config = ServerConfig {
                http,
                acl,
                request_timeout,
                max_streams_per_connection,
                id,
                data_dir,
                listen,
                peers: peers.into_iter().collect(),
                raft: RaftSettings {
                    snapshot_every_entries: snapshot_every,
                    keep_log_after_snapshot: keep_log_entries,
                    peer_source_ip,
                    wire_format: raft_wire_format,
                    max_clock_offset_ms,
                    transport,
                    ..RaftSettings::default()
                },
                nodes: if no_local_node || ssh_nodes.is_some() || kubernetes.kubernetes {
                    Vec::new()
                } else {
                    inventory(simulated_gpus, simulated_nodes, node_name)?
                },
                executor_dir,
                gpu_kernel_log: Some(gpu_kernel_log),
                worker_logs,
                retention,
                ssh,
                hollow,
                kubernetes: kubernetes.target()?,
                policy: policy.into(),
                policy_options,
                removed_grace: seconds("removed-grace-s", removed_grace_s)?,
                max_event_streams: max_event_streams as usize,
                max_api_requests: max_api_requests as usize,
                worker_umask: Some(worker_umask),
                loops: LoopSettings {
                    round: seconds("round-s", round_s)?,
                    stop_grace: seconds("stop-grace-s", stop_grace_s)?,
                    shutdown_timeout: {
                        let t = seconds("shutdown-timeout-s", shutdown_timeout_s)?;
                        if t <= seconds("stop-grace-s", stop_grace_s)? {
                            anyhow::bail!(
                                "--shutdown-timeout-s ({shutdown_timeout_s}) must be longer than --stop-grace-s ({stop_grace_s})"
                            );
                        }
                        t
                    },
                    progress_every: seconds("progress-interval-s", progress_interval_s)?,
                    node_timeout: seconds("node-timeout-s", node_timeout_s)?,
                    // A few beats per timeout, so one lost beat loses nothing.
                    heartbeat_every: seconds("node-timeout-s", node_timeout_s)?
                        .div_f64(4.0)
                        .min(Duration::from_secs(1)),
                    secret_keys: std::sync::Arc::new(keel::secret_keys::SecretKeys::load(
                        &secret_key_file,
                        std::env::var(keel::secret_keys::SECRET_KEY_ENV)
                            .ok()
                            .as_deref(),
                    )?),
                    ..LoopSettings::default()
                },
            };
            for n in &config.nodes {
                let gpus: Vec<String> = n
                    .gpus
                    .iter()
                    .map(|g| format!("{}:{}", g.index, g.gpu_type))
                    .collect();
                tracing::info!(node = %n.name, gpus = %gpus.join(","), "inventory");
            }
            let server = Server::start(&config, keel::api::system_clock())
                .await
                .with_context(|| {
                    format!("cannot start the server on {}", config.data_dir.display())
                })?;
            tracing::info!(addr = %server.addr, data_dir = %config.data_dir.display(), "keel server started");
            server.serve(shutdown_signal()).await?;
            if let Some(traces) = traces {
                traces.shutdown().await;
            }
            Ok(())
        }
        Cmd::Replay {
            data_dir,
            until,
            at,
        } => {
            let until = cli::until(until, at.as_deref(), "--at")?;
            cli::replay(&data_dir, until, out)
        }
        Cmd::Why { id } => cli::why(&args.addr, id, out).await,
        Cmd::Sim(sim) => sim_cmd::run(*sim, out),
        Cmd::Whatif(args) => whatif_cmd::run(*args, out),
        Cmd::Submit { file } => cli::submit(&args.addr, &file, out).await,
        Cmd::Jobs { state, user, queue } => cli::jobs(&args.addr, state, user, queue, out).await,
        Cmd::Job { id } => cli::job(&args.addr, id, out).await,
        Cmd::Cancel { id, reason } => cli::cancel(&args.addr, id, reason, out).await,
        Cmd::Nodes => cli::nodes(&args.addr, out).await,
        Cmd::Logs {
            id,
            tail_bytes,
            follow: false,
        } => cli::logs(&args.addr, id, tail_bytes, out).await,
        Cmd::Logs {
            id,
            tail_bytes,
            follow: true,
        } => cli::follow_logs(&args.addr, id, tail_bytes).await,
        Cmd::Node {
            command: NodeCmd::Lost { name, reason },
        } => cli::set_node_state(&args.addr, name, "lost", reason, out).await,
        Cmd::Node {
            command: NodeCmd::Alive { name },
        } => cli::set_node_state(&args.addr, name, "alive", String::new(), out).await,
        Cmd::Node {
            command: NodeCmd::Remove { name, force },
        } => cli::remove_node(&args.addr, name, force, out).await,
        Cmd::Policy {
            command: PolicyCmd::Show,
        } => cli::show_policy(&args.addr, out).await,
        Cmd::Policy {
            command: PolicyCmd::Set { name },
        } => cli::set_policy(&args.addr, name, out).await,
        Cmd::Policy {
            command: PolicyCmd::Eval { input, policy },
        } => policy_eval(&input, policy.as_deref()),
        Cmd::Trainer(t) => trainer(t).await,
        Cmd::Supervise {
            exit_file,
            command,
            cgroup,
            leftover_grace_ms,
            memory_cgroup,
            cpu_cgroup,
            memory_max_bytes,
            cpu_max_millis,
            worker_umask,
            log,
        } => {
            let output = log.output()?;
            if let Some(mask) = &worker_umask {
                if mask.is_empty()
                    || mask.len() > 4
                    || !mask.bytes().all(|b| (b'0'..=b'7').contains(&b))
                {
                    anyhow::bail!("--worker-umask must be octal digits such as 0022, not {mask:?}");
                }
            }
            let containment = keel_executors::supervisor::Containment {
                cgroup,
                limits: keel_executors::containment::Limits {
                    memory_dir: memory_cgroup,
                    cpu_dir: cpu_cgroup,
                },
                resources: keel_state::spec::Resources {
                    cpu_millis: cpu_max_millis,
                    memory_bytes: memory_max_bytes,
                },
                leftover_grace: Duration::from_millis(leftover_grace_ms),
                umask: worker_umask,
            };
            let code =
                keel_executors::supervisor::supervise(exit_file, command, containment, output)
                    .await;
            std::process::exit(code);
        }
        Cmd::LogWriter { probe: true, .. } => {
            use std::io::Write;
            writeln!(std::io::stdout(), "keel-log-writer 1")?;
            Ok(())
        }
        Cmd::LogWriter { probe: false, log } => {
            let output = log.output()?.context("keel log-writer needs --log")?;
            // The host helper's supervisor and the group's signals are for
            // the worker: this copies on until its input ends.
            let _ = tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate());
            tokio::task::spawn_blocking(move || -> anyhow::Result<()> {
                let mut writer = keel_executors::worker_log::StreamWriter::open(
                    &output.log,
                    output.rotation,
                    output.floor,
                )
                .with_context(|| format!("opening {}", output.log.display()))?;
                keel_executors::worker_log::copy_to_end(std::io::stdin().lock(), |b| {
                    writer.write(b)
                })?;
                Ok(())
            })
            .await??;
            Ok(())
        }
        Cmd::Events { from, follow } => cli::events(&args.addr, from, follow, out).await,
        Cmd::Cluster {
            command: ClusterCmd::Status,
        } => cli::cluster_status(&args.addr, out).await,
        Cmd::Cluster {
            command:
                ClusterCmd::Add {
                    id,
                    member_addr,
                    learner_only,
                    catch_up_timeout_s,
                },
        } => {
            cli::add_member(
                &args.addr,
                id,
                member_addr,
                learner_only,
                catch_up_timeout_s,
                out,
            )
            .await
        }
        Cmd::Cluster {
            command: ClusterCmd::Remove { id },
        } => cli::remove_member(&args.addr, id, out).await,
        Cmd::Cluster {
            command:
                ClusterCmd::ForceNewCluster {
                    data_dir,
                    id,
                    member_addr,
                },
        } => cli::force_new_cluster(&data_dir, id, member_addr.as_deref(), out),
    }
}

/// The server's nodes: simulated when asked, else discovered, else the
/// default simulated cluster.
fn inventory(
    simulated_gpus: Option<String>,
    simulated_nodes: Option<u32>,
    node_name: Option<String>,
) -> anyhow::Result<Vec<NodeInventory>> {
    let simulated = |spec: &str, nodes: u32| {
        keel::inventory::simulated(spec, nodes, node_name.as_deref().unwrap_or("sim"))
    };
    if let Some(spec) = &simulated_gpus {
        return Ok(simulated(spec, simulated_nodes.unwrap_or(1))?);
    }
    if simulated_nodes.is_some() {
        anyhow::bail!("--simulated-nodes needs --simulated-gpus");
    }
    match keel::inventory::discovered() {
        Ok(Some(mut node)) => {
            if let Some(name) = &node_name {
                node.name.clone_from(name);
            }
            return Ok(vec![node]);
        }
        Ok(None) => {}
        Err(e) => tracing::warn!(error = %e, "GPU discovery failed"),
    }
    tracing::info!(
        gpus = DEFAULT_SIMULATED_GPUS,
        nodes = DEFAULT_SIMULATED_NODES,
        "no GPUs found: using a simulated cluster"
    );
    Ok(simulated(DEFAULT_SIMULATED_GPUS, DEFAULT_SIMULATED_NODES)?)
}

/// `keel trainer`: each setting from its flag, else the worker contract's
/// environment, else its default (clap reads all three).
async fn trainer(t: keel_executors::trainer::TrainerArgs) -> anyhow::Result<()> {
    use keel_executors::trainer::run;
    let opts = t.options();
    let mut stdout = std::io::stdout();
    let code = run(opts, &mut stdout).await?;
    // The exit code is the trainer's answer (0, 143 on SIGTERM, or the
    // failure asked for).
    std::process::exit(code);
}

/// `ID=HOST:PORT`.
fn parse_peer(s: &str) -> Result<(u64, String), String> {
    let (id, addr) = s
        .split_once('=')
        .ok_or_else(|| format!("{s:?} is not ID=HOST:PORT"))?;
    let id: u64 = id
        .trim()
        .parse()
        .map_err(|_| format!("{id:?} in {s:?} is not a member id"))?;
    let addr = parse_address(addr).map_err(|e| format!("{e} in {s:?}"))?;
    Ok((id, addr))
}

/// A member's address, `HOST:PORT` (a host name or an IP address).
fn parse_address(addr: &str) -> Result<String, String> {
    let addr = addr.trim();
    if addr.is_empty() || !addr.contains(':') {
        return Err(format!("{addr:?} is not HOST:PORT"));
    }
    Ok(addr.to_string())
}

#[cfg(test)]
mod tests {
    /// clap's own checks of the whole command line (conflicting argument
    /// settings otherwise panic only when that subcommand is parsed).
    #[test]
    fn the_command_line_is_well_formed() {
        use clap::CommandFactory;
        super::Args::command().debug_assert();
    }
}
