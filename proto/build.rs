//! Compiles Keel's `.proto` files with `protox` (pure Rust), so no system
//! `protoc` is needed. The log-entry and replication packages are always
//! generated; the gRPC
//! client API only with the `grpc` feature, so the pure core depends on
//! prost alone.

use std::path::PathBuf;

/// Every message serialises to JSON (the CLI's `--output json`) with its
/// proto field names.
const SERDE: &str = "#[derive(serde::Serialize)] #[serde(rename_all = \"snake_case\")]";

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let out_dir = PathBuf::from(std::env::var("OUT_DIR")?);
    println!("cargo:rerun-if-changed=proto");

    let entry_fds = protox::compile(
        ["keel/entry/v1/entry.proto", "keel/entry/v1/snapshot.proto"],
        ["proto"],
    )?;
    tonic_prost_build::configure()
        .build_client(false)
        .build_server(false)
        .btree_map(".")
        .type_attribute(".", SERDE)
        .out_dir(&out_dir)
        .compile_fds(entry_fds)?;

    let replication_fds = protox::compile(["keel/replication/v1/replication.proto"], ["proto"])?;
    tonic_prost_build::configure()
        .build_client(false)
        .build_server(false)
        .out_dir(&out_dir)
        .compile_fds(replication_fds)?;

    if std::env::var_os("CARGO_FEATURE_GRPC").is_some() {
        let api_dir = out_dir.join("api");
        std::fs::create_dir_all(&api_dir)?;
        let api_fds = protox::compile(["keel/api/v1/api.proto"], ["proto"])?;
        tonic_prost_build::configure()
            .btree_map(".")
            .type_attribute(".", SERDE)
            .codec_path("crate::grpc_codec::KeelCodec")
            .extern_path(".keel.entry.v1", "crate::entry")
            .out_dir(&api_dir)
            .compile_fds(api_fds)?;

        let raft_dir = out_dir.join("raft");
        std::fs::create_dir_all(&raft_dir)?;
        let raft_fds = protox::compile(["keel/raft/v1/raft.proto"], ["proto"])?;
        tonic_prost_build::configure()
            .out_dir(&raft_dir)
            .compile_fds(raft_fds)?;
    }
    Ok(())
}
