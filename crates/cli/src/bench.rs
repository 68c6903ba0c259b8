//! `forkless bench`: the built-in load generator. forkless-loadgen's closed
//! loop and histogram over a forkless-client target: in `owner` mode each
//! append goes straight to its shard's owner; in `fixed` mode everything
//! goes to the one `--server` node, which forwards what it does not own.

use anyhow::{bail, Context};
use bytes::Bytes;
use forkless_client::{Client, Error, Routing, StartExecution};
use forkless_loadgen::{AppendError, Connection, Payload, SetupError, Target, Workload};
use forkless_types::ExecutionId;
use std::sync::Arc;
use std::time::Duration;

#[derive(Clone, Copy, Debug, PartialEq, Eq, clap::ValueEnum)]
pub enum Mode {
    /// Routing-aware: each request goes to the shard's owner.
    Owner,
    /// Everything to --server; the server forwards to owners.
    Fixed,
}

#[derive(clap::Args, Debug)]
pub struct BenchArgs {
    #[command(flatten)]
    server: crate::client_cmds::ServerArg,
    /// Concurrent clients, one append in flight each.
    #[arg(long, default_value_t = 16)]
    clients: usize,
    /// Executions appended to (spread over all shards by routing keys).
    #[arg(long, default_value_t = 1000)]
    executions: usize,
    /// Bytes of JSON payload per event.
    #[arg(long, default_value_t = 256)]
    payload: usize,
    /// Measured time (e.g. 15s, 500ms, 1m).
    #[arg(long, default_value = "15s", value_parser = parse_duration)]
    duration: Duration,
    /// Load before measuring starts.
    #[arg(long, default_value = "2s", value_parser = parse_duration)]
    warmup: Duration,
    /// owner: route each append to its owner; fixed: send all to --server.
    #[arg(long, value_enum, default_value_t = Mode::Owner)]
    mode: Mode,
    /// An append without an answer after this long counts as an error.
    #[arg(long, default_value = "10s", value_parser = parse_duration)]
    append_timeout: Duration,
    /// Also report the CPU of this process and its children (the server).
    #[arg(long)]
    server_pid: Option<u32>,
    /// Print the report as one JSON object.
    #[arg(long)]
    json: bool,
}

/// `15s`, `500ms`, `2m`, or bare seconds.
pub fn parse_duration(s: &str) -> Result<Duration, String> {
    let s = s.trim();
    let (num, unit) = match s.find(|c: char| !(c.is_ascii_digit() || c == '.')) {
        Some(i) => (&s[..i], &s[i..]),
        None => (s, "s"),
    };
    let n: f64 = num
        .parse()
        .map_err(|_| format!("{s:?}: expected a duration like 15s, 500ms or 2m"))?;
    let secs = match unit {
        "ms" => n / 1000.0,
        "s" => n,
        "m" => n * 60.0,
        _ => return Err(format!("{s:?}: unit must be ms, s or m")),
    };
    Duration::try_from_secs_f64(secs).map_err(|e| format!("{s:?}: {e}"))
}

pub fn run(a: BenchArgs) -> anyhow::Result<()> {
    if a.clients == 0 {
        bail!("--clients must be at least 1");
    }
    if a.executions < a.clients {
        bail!(
            "--executions ({}) must be at least --clients ({}): each client appends to its own executions",
            a.executions,
            a.clients
        );
    }
    if a.duration.is_zero() {
        bail!("--duration must be more than 0");
    }
    let routing = match a.mode {
        Mode::Owner => Routing::Owner,
        Mode::Fixed => Routing::Fixed,
    };
    let mut cfg = a.server.config();
    cfg.routing = routing;
    cfg.request_timeout = a.append_timeout;
    let client = Client::with_config(cfg).map_err(|e| anyhow::anyhow!("--server: {e}"))?;
    let workload = Workload {
        clients: a.clients,
        keys: a.executions,
        payload_bytes: a.payload,
        warmup: a.warmup,
        duration: a.duration,
        append_timeout: a.append_timeout,
        server_pid: a.server_pid,
    };
    let rt = tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
        .context("starting the runtime")?;
    let mode = match a.mode {
        Mode::Owner => "owner",
        Mode::Fixed => "fixed",
    };
    let (report, map) = rt.block_on(async {
        // Fail fast, with the real reason, if the server is not there.
        let map = client.cluster().await.map_err(|e| {
            anyhow::anyhow!("fetching the cluster map from {}: {e}", a.server.server)
        })?;
        if !a.json {
            eprintln!(
                "bench: {} node(s), {} shard(s), mode {mode}; starting {} executions...",
                map.nodes.len(),
                map.shard_count,
                a.executions
            );
        }
        let target = RoutedTarget::new(client.clone(), mode);
        let report = forkless_loadgen::run(target, &workload)
            .await
            .map_err(|e| anyhow::anyhow!("{e}"))?;
        Ok::<_, anyhow::Error>((report, map))
    })?;
    if a.json {
        let mut v = serde_json::to_value(&report).context("encoding the report")?;
        v["mode"] = serde_json::json!(mode);
        v["server"] = serde_json::json!(a.server.server);
        v["nodes"] = serde_json::json!(map.nodes.len());
        v["shard_count"] = serde_json::json!(map.shard_count);
        println!("{v}");
    } else {
        print!("{report}");
    }
    if report.events == 0 {
        bail!("no append succeeded in the measured window");
    }
    Ok(())
}

/// Executions started in parallel during setup.
const SETUP_CONCURRENCY: usize = 16;

/// A loadgen target over the forkless client. Executions are started with
/// routing keys, so they spread over every shard (an unsteered start would
/// put them all on shards of the node that received it) and the two modes
/// append to the same layout.
pub struct RoutedTarget {
    client: Client,
    mode: &'static str,
    ids: Arc<Vec<ExecutionId>>,
}

impl RoutedTarget {
    pub fn new(client: Client, mode: &'static str) -> Self {
        RoutedTarget {
            client,
            mode,
            ids: Arc::default(),
        }
    }
}

fn run_tag() -> String {
    let nanos = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_nanos())
        .unwrap_or(0);
    format!("{:x}-{}", nanos, std::process::id())
}

impl Target for RoutedTarget {
    type Conn = RoutedConn;

    fn name(&self) -> String {
        format!("forkless ({} routing)", self.mode)
    }

    async fn setup(&mut self, keys: usize) -> Result<(), SetupError> {
        let tag = run_tag();
        let mut tasks = Vec::new();
        for worker in 0..SETUP_CONCURRENCY.min(keys) {
            let client = self.client.clone();
            let tag = tag.clone();
            tasks.push(tokio::spawn(async move {
                let mut ids = Vec::new();
                for k in (worker..keys).step_by(SETUP_CONCURRENCY) {
                    let mut req = StartExecution::new("bench");
                    req.routing_key = Some(format!("bench/{tag}/{k}"));
                    let e = client.start(&req).await.map_err(|e| {
                        SetupError(format!("starting execution {k} of {keys}: {e}"))
                    })?;
                    if e.last_seq != 1 {
                        return Err(SetupError(format!(
                            "new execution {} has last_seq {}, expected 1",
                            e.execution_id, e.last_seq
                        )));
                    }
                    ids.push((k, e.execution_id));
                }
                Ok::<_, SetupError>(ids)
            }));
        }
        let mut ids = vec![None; keys];
        for t in tasks {
            for (k, id) in t.await.map_err(SetupError::new)?? {
                ids[k] = Some(id);
            }
        }
        let ids: Option<Vec<ExecutionId>> = ids.into_iter().collect();
        self.ids = Arc::new(ids.ok_or_else(|| SetupError("an execution was not started".into()))?);
        Ok(())
    }

    async fn connect(&self, _client: usize) -> Result<RoutedConn, SetupError> {
        Ok(RoutedConn {
            client: self.client.fresh_pool(),
            ids: self.ids.clone(),
        })
    }
}

/// One benchmark client: its own connection pool, the shared map.
pub struct RoutedConn {
    client: Client,
    ids: Arc<Vec<ExecutionId>>,
}

impl Connection for RoutedConn {
    async fn append(&mut self, key: usize, seq: u64, payload: &Payload) -> Result<(), AppendError> {
        let id = *self
            .ids
            .get(key)
            .ok_or_else(|| AppendError::Refused(format!("no execution for key {key}")))?;
        // The start wrote event 1, so this run's append `seq` follows event `seq`.
        let expected_last = seq;
        let body = forkless_loadgen::forkless::append_body(payload, expected_last);
        match self.client.append_raw(id, Bytes::from(body), false).await {
            Ok(a) => forkless_loadgen::forkless::check_ack(
                expected_last,
                Some(a.first_seq),
                Some(a.last_seq),
            ),
            Err(Error::SequenceConflict { last_seq, .. }) => Err(AppendError::Conflict(format!(
                "expected last_seq {expected_last}, server has {last_seq}"
            ))),
            Err(e @ Error::Transport { .. }) => Err(AppendError::Transport(e.to_string())),
            Err(e @ Error::Protocol(_)) => Err(AppendError::BadAnswer(e.to_string())),
            Err(e) => Err(AppendError::Refused(e.to_string())),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn durations() {
        assert_eq!(parse_duration("15s"), Ok(Duration::from_secs(15)));
        assert_eq!(parse_duration("500ms"), Ok(Duration::from_millis(500)));
        assert_eq!(parse_duration("2m"), Ok(Duration::from_secs(120)));
        assert_eq!(parse_duration("3"), Ok(Duration::from_secs(3)));
        assert_eq!(parse_duration("1.5s"), Ok(Duration::from_millis(1500)));
        assert!(parse_duration("fast").is_err());
        assert!(parse_duration("3h").is_err());
        assert!(parse_duration("").is_err());
    }
}
