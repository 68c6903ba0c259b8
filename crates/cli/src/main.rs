//! The `forkless` binary: one entry point for the server, the local dev
//! cluster, the client verbs, `route`, and the load generator.

mod bench;
mod client_cmds;
mod dev_cluster;
mod route;
mod serve;
mod store_cmd;

use clap::{Parser, Subcommand};

// glibc malloc showed as ~15% of server CPU on the append path; mimalloc's
// thread-local free lists cut that (see BENCHMARKS.md). Built with `no_thp`:
// mimalloc otherwise asks for transparent huge pages, and every fresh 2 MiB
// page is zeroed on first touch, often by the shard writer in the middle of
// a commit (p99 at 64 clients lower in each of 11 interleaved pairs:
// 1.8-3.1 ms without, 2.4-4.1 ms with; BENCHMARKS.md).
#[global_allocator]
static GLOBAL: mimalloc::MiMalloc = mimalloc::MiMalloc;
use std::process::ExitCode;

/// `forkless --version`: the release and the peer protocol, which an
/// operator compares before a rolling upgrade.
static VERSION: std::sync::LazyLock<String> = std::sync::LazyLock::new(|| {
    format!(
        "{} (peer protocol {})",
        env!("CARGO_PKG_VERSION"),
        forkless_server::PEER_PROTOCOL_VERSION
    )
});

#[derive(Parser)]
#[command(
    name = "forkless",
    version = VERSION.as_str(),
    about = "Single-owner, never-forking event logs for workflow executions"
)]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand)]
enum Command {
    /// Run a node. With no arguments: one node, one shard, data in
    /// ./forkless-data, listening on 127.0.0.1:7070.
    Serve(serve::ServeArgs),
    /// Run a local cluster of real nodes on loopback until Ctrl-C.
    DevCluster(dev_cluster::DevClusterArgs),
    /// Print the partition and shard of an execution id or routing key.
    Route(route::RouteArgs),
    #[command(flatten)]
    Client(client_cmds::Verb),
    /// Load generator: closed-loop appends, events/s and latency percentiles.
    Bench(bench::BenchArgs),
    /// Offline tools for a stopped node's data directory.
    Store(store_cmd::StoreArgs),
}

fn main() -> ExitCode {
    let cli = Cli::parse();
    let result = match cli.command {
        Command::Serve(a) => serve::run(a),
        Command::Route(a) => route::run(a),
        Command::DevCluster(a) => dev_cluster::run(a),
        Command::Client(v) => client_cmds::run(v),
        Command::Bench(a) => bench::run(a),
        Command::Store(a) => match store_cmd::run(a) {
            Ok(true) => Ok(()),
            Ok(false) => return ExitCode::FAILURE,
            Err(e) => Err(e),
        },
    };
    match result {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("error: {e:#}");
            ExitCode::FAILURE
        }
    }
}
