//! `keel`: the server and the command-line client.

mod cli;
mod render;

use std::net::SocketAddr;
use std::path::PathBuf;

use anyhow::Context;
use clap::{Parser, Subcommand};
use keel::raft_node::RaftSettings;
use keel::server::{shutdown_signal, Server, ServerConfig};

#[derive(Parser, Debug)]
#[command(
    name = "keel",
    version,
    about = "Keel: a highly available scheduler for deep-learning training jobs"
)]
struct Args {
    /// Address of a Keel server.
    #[arg(
        long,
        global = true,
        env = "KEEL_ADDR",
        default_value = "127.0.0.1:7070"
    )]
    addr: String,
    /// Output format of read commands.
    #[arg(long, short = 'o', global = true, value_enum, default_value_t = render::Output::Table)]
    output: render::Output,
    #[command(subcommand)]
    command: Cmd,
}

#[derive(Subcommand, Debug)]
enum Cmd {
    /// Run a Keel server (a Raft replica serving the API).
    Server {
        /// Where the Raft log, state and journal live.
        #[arg(long, default_value = "keel-data")]
        data_dir: PathBuf,
        /// Address to serve the API on.
        #[arg(long, default_value = "127.0.0.1:7070")]
        listen: SocketAddr,
        /// This replica's Raft member id.
        #[arg(long, default_value_t = 1)]
        id: u64,
        /// Build a snapshot and compact the log every this many entries.
        #[arg(long, default_value_t = 10_000)]
        snapshot_every: u64,
    },
    /// Submit a job from a YAML or JSON spec file (`-` reads stdin).
    Submit {
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
        #[arg(long)]
        until: Option<u64>,
    },
}

#[derive(Subcommand, Debug)]
enum ClusterCmd {
    /// This replica's role, term, indexes and state hash.
    Status,
}

fn init_tracing() {
    let filter = tracing_subscriber::EnvFilter::try_from_env("KEEL_LOG").unwrap_or_else(|_| {
        tracing_subscriber::EnvFilter::new(
            "info,openraft=warn,sled=warn,chunked_wal=warn,raft_log=warn",
        )
    });
    tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_writer(std::io::stderr)
        .init();
}

#[tokio::main]
async fn main() -> std::process::ExitCode {
    let args = Args::parse();
    match run(args).await {
        Ok(()) => std::process::ExitCode::SUCCESS,
        Err(e) => {
            #[allow(clippy::print_stderr)]
            {
                eprintln!("error: {e:#}");
            }
            std::process::ExitCode::FAILURE
        }
    }
}

async fn run(args: Args) -> anyhow::Result<()> {
    let out = args.output;
    match args.command {
        Cmd::Server {
            data_dir,
            listen,
            id,
            snapshot_every,
        } => {
            init_tracing();
            let config = ServerConfig {
                id,
                data_dir,
                listen,
                raft: RaftSettings {
                    snapshot_every_entries: snapshot_every,
                    ..RaftSettings::default()
                },
            };
            let server = Server::start(&config, keel::api::system_clock())
                .await
                .with_context(|| {
                    format!("cannot start the server on {}", config.data_dir.display())
                })?;
            tracing::info!(addr = %server.addr, data_dir = %config.data_dir.display(), "keel server started");
            server.serve(shutdown_signal()).await?;
            Ok(())
        }
        Cmd::Replay { data_dir, until } => cli::replay(&data_dir, until, out),
        Cmd::Submit { file } => cli::submit(&args.addr, &file, out).await,
        Cmd::Jobs { state, user } => cli::jobs(&args.addr, state, user, out).await,
        Cmd::Job { id } => cli::job(&args.addr, id, out).await,
        Cmd::Cancel { id, reason } => cli::cancel(&args.addr, id, reason, out).await,
        Cmd::Nodes => cli::nodes(&args.addr, out).await,
        Cmd::Events { from, follow } => cli::events(&args.addr, from, follow, out).await,
        Cmd::Cluster {
            command: ClusterCmd::Status,
        } => cli::cluster_status(&args.addr, out).await,
    }
}
