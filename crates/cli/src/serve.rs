//! `forkless serve`: runs one node until SIGTERM or Ctrl-C.

use anyhow::Context;
use forkless_server::config::{self, Overrides};
use std::path::PathBuf;

#[derive(clap::Args, Debug)]
pub struct ServeArgs {
    /// A TOML file: single-node settings, or a whole static cluster.
    #[arg(long, env = "FORKLESS_CONFIG")]
    config: Option<PathBuf>,
    /// Which member of the cluster file to run.
    #[arg(long, env = "FORKLESS_NODE")]
    node: Option<u64>,
    /// Where the node keeps its data [default: ./forkless-data].
    #[arg(long, env = "FORKLESS_DATA_DIR")]
    data_dir: Option<PathBuf>,
    /// The client API address [default: 127.0.0.1:7070].
    #[arg(long, env = "FORKLESS_LISTEN")]
    listen: Option<String>,
    /// Shards: a power of two from 1 to 4096 [default: 1].
    #[arg(long, env = "FORKLESS_SHARD_COUNT")]
    shard_count: Option<u64>,
    /// Largest JSON payload of one event, bytes [default: 1048576].
    #[arg(long, env = "FORKLESS_EVENT_PAYLOAD_BYTES_MAX")]
    event_payload_bytes_max: Option<usize>,
    /// Largest request body, bytes [default: 8388608].
    #[arg(long, env = "FORKLESS_REQUEST_BODY_BYTES_MAX")]
    request_body_bytes_max: Option<usize>,
    /// Most events in one append [default: 1000].
    #[arg(long, env = "FORKLESS_BATCH_EVENTS_MAX")]
    batch_events_max: Option<usize>,
    /// How long a client may take to send one whole request once it has
    /// begun, ms [default: 30000, at most 3600000]; then 408 and the
    /// connection is closed.
    #[arg(long, env = "FORKLESS_REQUEST_READ_TIMEOUT_MS")]
    request_read_timeout_ms: Option<u64>,
    /// Most connections open at once on each listener (the client API's,
    /// and the peer address's, counted apart) [default: 1024]; one more is
    /// answered 503 and closed. In a cluster, keep it the same on every
    /// node (set it in the cluster file's [limits]): a node forwards to
    /// each peer on at most its share of that peer's peer connections,
    /// reckoned with the lower of its own value and the peer's. With the
    /// forwards, the Raft
    /// transport's connections and 256 descriptors kept for the store it
    /// must fit in the open-file limit (raised to the hard limit at
    /// start), or the node refuses to start.
    #[arg(long, env = "FORKLESS_CONNECTIONS_MAX")]
    connections_max: Option<usize>,
    /// A kept-alive connection idle this long is closed, ms [default: 60000].
    #[arg(long, env = "FORKLESS_IDLE_TIMEOUT_MS")]
    idle_timeout_ms: Option<u64>,
    /// A client that does not take its answer for this long is
    /// disconnected, ms [default: 30000].
    #[arg(long, env = "FORKLESS_WRITE_TIMEOUT_MS")]
    write_timeout_ms: Option<u64>,
    /// A page of events stops once its payloads reach this many bytes
    /// (always at least one event; `next_after` says where to continue)
    /// [default: 4194304].
    #[arg(long, env = "FORKLESS_READ_PAGE_BYTES_MAX")]
    read_page_bytes_max: Option<usize>,
    /// Most long-polls waiting at once on this node [default: 1024]; one
    /// more is answered 503 too_many_long_polls with Retry-After.
    #[arg(long, env = "FORKLESS_LONG_POLLS_MAX")]
    long_polls_max: Option<usize>,
    /// Most bytes of request bodies the connections of each listener
    /// hold at once (read so far, not yet answered; counted as they
    /// arrive) [default: 268435456]; a request whose body would go over it
    /// is answered 503 too_many_body_bytes with Retry-After. At least
    /// --request-body-bytes-max.
    #[arg(long, env = "FORKLESS_BODY_BYTES_IN_FLIGHT_MAX")]
    body_bytes_in_flight_max: Option<usize>,
    /// Most bytes of pages of events (and of keys' executions) the
    /// connections of each listener hold at once, made and not yet
    /// written [default: 268435456]; a page is cut short to fit what is
    /// left, and a read whose answer does not fit is answered 503
    /// too_many_answer_bytes with Retry-After. At least what the largest
    /// page takes: --read-page-bytes-max, plus --event-payload-bytes-max,
    /// plus 1200 bytes for each of limits.read_events_max (1000) events,
    /// plus 256.
    #[arg(long, env = "FORKLESS_ANSWER_BYTES_IN_FLIGHT_MAX")]
    answer_bytes_in_flight_max: Option<usize>,
    /// How many nice steps below the request path the storage engine's
    /// flush and compaction threads run, 0 to 19 [default: 10]; 0 keeps
    /// them at the same priority. Linux only.
    #[arg(long, env = "FORKLESS_BACKGROUND_NICE")]
    background_nice: Option<i32>,
    /// How many nice steps above the request path each shard's writer
    /// thread runs, 0 to 20 [default: 5]; 0 keeps it at the same
    /// priority. Raising takes root or CAP_SYS_NICE (otherwise a warning,
    /// and the same priority). Linux only.
    #[arg(long, env = "FORKLESS_WRITER_PRIORITY")]
    writer_priority: Option<i32>,
    /// Experimental: every shard a Raft group this node runs alone, true
    /// or false [default: false] (docs/replication.md, step 5).
    #[arg(long, env = "FORKLESS_STORE_RAFT", value_name = "BOOL")]
    store_raft: Option<bool>,
    /// How long a forward may wait for the owner's answer, ms [default:
    /// 2000]; before it, up to half of it for a connection to the owner
    /// when this node's share of them is in use.
    #[arg(long, env = "FORKLESS_FORWARD_TIMEOUT_MS")]
    forward_timeout_ms: Option<u64>,
    /// Threads serving HTTP [default: one per core]. Each shard's writer
    /// has its own thread besides these.
    #[arg(long, env = "FORKLESS_WORKER_THREADS")]
    worker_threads: Option<usize>,
    /// Log as JSON lines instead of text.
    #[arg(long, env = "FORKLESS_LOG_JSON")]
    log_json: bool,
}

pub fn run(a: ServeArgs) -> anyhow::Result<()> {
    init_logging(a.log_json);
    let file = match &a.config {
        Some(p) => Some(config::read_file(p)?),
        None => None,
    };
    let overrides = Overrides {
        data_dir: a.data_dir,
        listen: a.listen,
        shard_count: a.shard_count,
        event_payload_bytes_max: a.event_payload_bytes_max,
        request_body_bytes_max: a.request_body_bytes_max,
        batch_events_max: a.batch_events_max,
        forward_timeout_ms: a.forward_timeout_ms,
        request_read_timeout_ms: a.request_read_timeout_ms,
        background_nice: a.background_nice,
        writer_priority: a.writer_priority,
        store_raft: a.store_raft,
        connections_max: a.connections_max,
        idle_timeout_ms: a.idle_timeout_ms,
        write_timeout_ms: a.write_timeout_ms,
        read_page_bytes_max: a.read_page_bytes_max,
        long_polls_max: a.long_polls_max,
        body_bytes_in_flight_max: a.body_bytes_in_flight_max,
        answer_bytes_in_flight_max: a.answer_bytes_in_flight_max,
    };
    let cfg = config::resolve(file, a.node, overrides.clone())?;
    // `forkless cluster reload` and SIGHUP read the same file again, with
    // the same flags.
    let reload: Option<forkless_server::reload::Reload> = a.config.clone().map(|path| {
        let node = a.node;
        let read: forkless_server::reload::Reload = std::sync::Arc::new(move || {
            config::resolve(Some(config::read_file(&path)?), node, overrides.clone())
        });
        read
    });
    let mut rt = tokio::runtime::Builder::new_multi_thread();
    if let Some(n) = a.worker_threads {
        anyhow::ensure!(n >= 1, "--worker-threads must be at least 1");
        rt.worker_threads(n);
    }
    let rt = rt.enable_all().build().context("starting the runtime")?;
    // SIGTERM and Ctrl-C keep their default action (the process ends)
    // until the node serves; from then on they stop it in order.
    rt.block_on(forkless_server::run(cfg, reload, || {
        let (stops_tx, stops) = tokio::sync::mpsc::channel(4);
        tokio::spawn(stop_signals(stops_tx));
        stops
    }))?;
    Ok(())
}

pub fn init_logging(json: bool) {
    let filter = tracing_subscriber::EnvFilter::try_from_env("FORKLESS_LOG").unwrap_or_else(|_| {
        tracing_subscriber::EnvFilter::new("info,fjall=warn,lsm_tree=warn,openraft=error")
    });
    // A log line that cannot be written (the log's disk is full) is lost,
    // not reported with `eprintln!`, which panics when stderr fails: the
    // thread that logged would die with it (a shard's writer, a Raft
    // group's task) on exactly the disk fault the node must survive.
    let b = tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_writer(std::io::stderr)
        .log_internal_errors(false);
    if json {
        b.json().init();
    } else {
        b.init();
    }
}

/// Takes SIGTERM and Ctrl-C (SIGINT) now, and returns what sends one
/// message on `stops` for each: the first starts the node's shutdown, a
/// second cuts its leaderships' handover short (`forkless_server::run`).
/// A signal that cannot be taken is said once and keeps its default
/// action.
#[cfg(unix)]
fn stop_signals(
    stops: tokio::sync::mpsc::Sender<()>,
) -> impl std::future::Future<Output = ()> + Send + 'static {
    use tokio::signal::unix::{signal, Signal, SignalKind};
    let take = |kind: SignalKind, name: &str| match signal(kind) {
        Ok(s) => Some(s),
        Err(e) => {
            tracing::error!(signal = name, error = %e, "could not take the signal: it keeps its default action");
            None
        }
    };
    let mut term = take(SignalKind::terminate(), "SIGTERM");
    let mut int = take(SignalKind::interrupt(), "SIGINT");
    async fn next(s: &mut Option<Signal>) {
        if let Some(s) = s {
            if s.recv().await.is_some() {
                return;
            }
        }
        std::future::pending::<()>().await;
    }
    async move {
        loop {
            tokio::select! {
                () = next(&mut term) => {}
                () = next(&mut int) => {}
            }
            if stops.send(()).await.is_err() {
                return;
            }
        }
    }
}

#[cfg(not(unix))]
fn stop_signals(
    stops: tokio::sync::mpsc::Sender<()>,
) -> impl std::future::Future<Output = ()> + Send + 'static {
    async move {
        while tokio::signal::ctrl_c().await.is_ok() {
            if stops.send(()).await.is_err() {
                return;
            }
        }
    }
}
