//! The client verbs: `start`, `append`, `signal`, `cancel`, `get`,
//! `events`, `key`, `status`, `cluster remove-node`. Data goes to stdout as JSON, one object per
//! line; a refusal goes to stderr as the error's JSON object, exit code 1.

use anyhow::{bail, Context};
use forkless_client::{
    AppendEvents, Cancel, Client, ClusterMap, Config, Error, NewEvent, ReadEvents, RetryPolicy,
    Signal, StartExecution,
};
use forkless_types::ExecutionId;
use serde::Serialize;
use serde_json::value::RawValue;
use std::io::Write;
use std::time::Duration;

/// Where the cluster is.
#[derive(clap::Args, Debug, Clone)]
pub struct ServerArg {
    /// Any node of the cluster (http://host:port, or host:port); several,
    /// comma-separated, are tried in turn for the cluster map.
    #[arg(long, env = "FORKLESS_SERVER", default_value = "http://127.0.0.1:7070")]
    pub server: String,
}

impl ServerArg {
    /// A client configuration for these servers.
    pub fn config(&self) -> Config {
        let mut cfg = Config::new(&self.server);
        cfg.servers = self
            .server
            .split(',')
            .map(str::trim)
            .filter(|s| !s.is_empty())
            .map(str::to_string)
            .collect();
        cfg
    }
}

#[derive(clap::Subcommand, Debug)]
pub enum Verb {
    /// Start an execution; prints it.
    Start(StartArgs),
    /// Append one event to an execution; prints the new seq.
    Append(AppendArgs),
    /// Signal an execution (appends an execution.signaled event).
    Signal(SignalArgs),
    /// Cancel an execution (appends execution.cancelled and closes it).
    Cancel(CancelArgs),
    /// Print an execution's metadata.
    Get(GetArgs),
    /// Print an execution's events, one JSON object per line.
    Events(EventsArgs),
    /// List the executions started with a routing key.
    Key(KeyArgs),
    /// Print the cluster map: nodes, shard owners and epochs.
    Status(StatusArgs),
    /// Change a replicated cluster's replicas.
    #[command(subcommand)]
    Cluster(ClusterVerb),
}

#[derive(clap::Subcommand, Debug)]
pub enum ClusterVerb {
    /// Move every replica a node holds (a dead one, or one to retire) to
    /// other nodes of the cluster file, by Raft membership changes: the
    /// new replica joins as a learner, catches up, then takes the old
    /// one's vote, one shard at a time. Prints the server's report (one
    /// JSON object, each shard listed); exit 1 if a shard could not be
    /// moved (run it again to go on).
    RemoveNode(RemoveNodeArgs),
    /// Print every shard's replicas as the cluster's Raft groups were made
    /// with, as `[[placement]]` entries to add to the cluster file before
    /// a node is added to it (the spread of an unpinned file moves when
    /// the node list changes, and a node refuses to start on a file that
    /// moves a shard).
    Placement(PlacementArgs),
    /// Have each node named by --server (comma-separated: every running
    /// node, once every node's file was edited) read its cluster file
    /// again, with no restart: the nodes it gained are probed, routed to
    /// and replicated to from then on, a peer restarted at new addresses
    /// is reached there, and nodes moved to `retired_nodes` (their
    /// replicas moved away) are dropped. Anything else the file changed
    /// that a running node cannot take (a shard's placement, the shard
    /// count, the replication factor, the secret, a node dropped without
    /// retiring) is refused, naming the field, and nothing changes. Prints
    /// one JSON object per node; exit 1 if any node refused or did not
    /// answer.
    Reload(ReloadArgs),
    /// An override for a shard that cannot elect: its replica on the node
    /// named by --server lost its data directory and has not caught up
    /// (it votes for no candidate with entries until it has), and a
    /// replica the shard needs to elect without it is gone for good.
    /// That replica is trusted as caught up, and the shard elects by
    /// Raft's rules among the replicas that answer. An entry only the
    /// lost disk and the gone replica held is lost: say so with
    /// --accept-loss. Prints the node's answer.
    TrustReplica(TrustReplicaArgs),
    /// Wait until every node of the cluster answers and every shard's
    /// replicas are level with its leader: every shard led, each replica
    /// the leader counts at most --lag-max entries behind its log, none
    /// new and catching up. The moment to stop the next node of a rolling
    /// restart. Exit 0 once level; exit 1 at --timeout, naming what is
    /// not.
    WaitLevel(WaitLevelArgs),
    /// Drain the node named by --server: it takes no leadership from now
    /// on and hands the shards it leads to other replicas (2 s at most),
    /// and still serves and forwards every request. For a node under
    /// maintenance that is not restarted (a restart's SIGTERM does the
    /// same by itself). Until `forkless cluster undrain`, or its restart.
    /// Prints the node's answer (what it handed over).
    Drain(DrainArgs),
    /// Undrain the node named by --server: it takes leaderships again, and
    /// its preferred shards come back to it.
    Undrain(DrainArgs),
}

#[derive(clap::Args, Debug)]
pub struct DrainArgs {
    #[command(flatten)]
    server: ServerArg,
}

#[derive(clap::Args, Debug)]
pub struct TrustReplicaArgs {
    #[command(flatten)]
    server: ServerArg,
    /// The shard whose replica on that node is trusted.
    #[arg(long)]
    shard: u32,
    /// Required: an acknowledged entry only the lost disk and a replica
    /// that is gone held may be lost.
    #[arg(long)]
    accept_loss: bool,
}

#[derive(clap::Args, Debug)]
pub struct WaitLevelArgs {
    #[command(flatten)]
    server: ServerArg,
    /// How long to wait (e.g. 30s, 5m).
    #[arg(long, default_value = "5m", value_parser = crate::bench::parse_duration)]
    timeout: Duration,
    /// The most entries a replica may lack of its leader's log and count
    /// as level (16: what a leader hands its leadership over at).
    #[arg(long, default_value_t = 16)]
    lag_max: u64,
}

#[derive(clap::Args, Debug)]
pub struct ReloadArgs {
    #[command(flatten)]
    server: ServerArg,
}

#[derive(clap::Args, Debug)]
pub struct PlacementArgs {
    #[command(flatten)]
    server: ServerArg,
    /// Print the server's JSON instead of the cluster file's entries.
    #[arg(long)]
    json: bool,
}

#[derive(clap::Args, Debug)]
pub struct RemoveNodeArgs {
    #[command(flatten)]
    server: ServerArg,
    /// The node whose replicas move (an id of the cluster file).
    node: u16,
    /// Where they move; left out, each shard's leader picks a live node
    /// outside the shard's replicas.
    #[arg(long)]
    to: Option<u16>,
}

#[derive(clap::Args, Debug)]
pub struct StartArgs {
    #[command(flatten)]
    server: ServerArg,
    /// The workflow name.
    #[arg(long)]
    workflow: String,
    /// Input as JSON (e.g. '{"order":42}').
    #[arg(long)]
    input: Option<String>,
    /// Places the execution on this key's shard; `forkless key` finds it again.
    #[arg(long)]
    routing_key: Option<String>,
    /// A repeated start with the same key returns the same execution.
    #[arg(long)]
    idempotency_key: Option<String>,
}

#[derive(clap::Args, Debug)]
pub struct AppendArgs {
    #[command(flatten)]
    server: ServerArg,
    /// The execution id.
    id: String,
    /// The event type, e.g. order.paid (execution.completed or
    /// execution.failed closes the execution).
    #[arg(long = "type")]
    event_type: String,
    /// Payload as JSON.
    #[arg(long)]
    payload: Option<String>,
    /// Makes the append safe to repeat: a repeat returns the first seq.
    #[arg(long)]
    idempotency_key: Option<String>,
    /// Refuse unless the execution's last seq is exactly this.
    #[arg(long)]
    expected_last_seq: Option<u64>,
}

#[derive(clap::Args, Debug)]
pub struct SignalArgs {
    #[command(flatten)]
    server: ServerArg,
    id: String,
    /// The signal name.
    #[arg(long)]
    name: String,
    /// Payload as JSON.
    #[arg(long)]
    payload: Option<String>,
    #[arg(long)]
    idempotency_key: Option<String>,
}

#[derive(clap::Args, Debug)]
pub struct CancelArgs {
    #[command(flatten)]
    server: ServerArg,
    id: String,
    /// Why (free text, stored in the event).
    #[arg(long)]
    reason: Option<String>,
    #[arg(long)]
    idempotency_key: Option<String>,
}

#[derive(clap::Args, Debug)]
pub struct GetArgs {
    #[command(flatten)]
    server: ServerArg,
    id: String,
}

#[derive(clap::Args, Debug)]
pub struct EventsArgs {
    #[command(flatten)]
    server: ServerArg,
    id: String,
    /// Only events with a seq greater than this.
    #[arg(long, default_value_t = 0)]
    after: u64,
    /// Print at most this many events [default: all].
    #[arg(long)]
    limit: Option<u64>,
    /// Keep waiting for new events (long-poll) until the execution closes.
    #[arg(long, short = 'f')]
    follow: bool,
    /// With --follow: how long each long-poll waits, ms (server maximum 30000).
    #[arg(long, default_value_t = 25_000)]
    wait_ms: u64,
}

#[derive(clap::Args, Debug)]
pub struct KeyArgs {
    #[command(flatten)]
    server: ServerArg,
    /// The routing key given at start.
    routing_key: String,
}

#[derive(clap::Args, Debug)]
pub struct StatusArgs {
    #[command(flatten)]
    server: ServerArg,
    /// Print the map as JSON instead of a table.
    #[arg(long)]
    json: bool,
}

pub fn run(v: Verb) -> anyhow::Result<()> {
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .context("starting the runtime")?;
    match rt.block_on(run_verb(v)) {
        Ok(()) => Ok(()),
        Err(Failed::Api(e)) => {
            // The refusal as JSON for scripts; exit 1.
            let mut err = std::io::stderr().lock();
            let _ = writeln!(err, "{}", e.to_json());
            let _ = err.flush();
            drop(rt);
            std::process::exit(1);
        }
        Err(Failed::Other(e)) => Err(e),
    }
}

enum Failed {
    Api(Error),
    Other(anyhow::Error),
}

impl From<Error> for Failed {
    fn from(e: Error) -> Self {
        match e {
            Error::Config(m) => Failed::Other(anyhow::anyhow!("--server: {m}")),
            e => Failed::Api(e),
        }
    }
}

impl From<anyhow::Error> for Failed {
    fn from(e: anyhow::Error) -> Self {
        Failed::Other(e)
    }
}

fn client(s: &ServerArg) -> Result<Client, Failed> {
    Ok(Client::with_config(client_config(s))?)
}

/// A client configuration for a person waiting: safe retries, given up
/// within seconds.
/// [`client_config`] for what asks a node about itself: sent to the node
/// `s` names and no other, not whichever node the cluster map would pick.
fn one_node(s: &ServerArg) -> Config {
    let mut cfg = client_config(s);
    cfg.routing = forkless_client::Routing::Fixed;
    cfg
}

fn client_config(s: &ServerArg) -> Config {
    let mut cfg = s.config();
    // A person is waiting: retry what is safe, but give up within seconds.
    cfg.retry = RetryPolicy {
        max_attempts: 4,
        max_elapsed: Duration::from_secs(5),
        ..RetryPolicy::default()
    };
    cfg
}

fn parse_id(raw: &str) -> anyhow::Result<ExecutionId> {
    raw.parse::<ExecutionId>()
        .with_context(|| format!("execution id {raw:?}"))
}

fn parse_json(flag: &str, raw: Option<String>) -> anyhow::Result<Option<Box<RawValue>>> {
    match raw {
        None => Ok(None),
        Some(s) => match RawValue::from_string(s.clone()) {
            Ok(v) => Ok(Some(v)),
            Err(e) => bail!(
                "--{flag} must be JSON ({e}); a string needs its own quotes, e.g. --{flag} '\"{}\"', an object looks like --{flag} '{{\"k\":1}}'",
                s.chars().take(40).collect::<String>()
            ),
        },
    }
}

fn print(v: &impl Serialize) -> anyhow::Result<()> {
    let mut out = std::io::stdout().lock();
    serde_json::to_writer(&mut out, v).context("writing JSON")?;
    writeln!(out).context("writing to stdout")?;
    out.flush().context("writing to stdout")?;
    Ok(())
}

async fn run_verb(v: Verb) -> Result<(), Failed> {
    match v {
        Verb::Start(a) => {
            let c = client(&a.server)?;
            let req = StartExecution {
                workflow: a.workflow,
                input: parse_json("input", a.input)?,
                routing_key: a.routing_key,
                idempotency_key: a.idempotency_key,
            };
            print(&c.start(&req).await?)?;
        }
        Verb::Append(a) => {
            let id = parse_id(&a.id)?;
            let c = client(&a.server)?;
            let req = AppendEvents {
                events: vec![NewEvent {
                    event_type: a.event_type,
                    payload: parse_json("payload", a.payload)?,
                    idempotency_key: a.idempotency_key,
                }],
                expected_last_seq: a.expected_last_seq,
            };
            print(&c.append(id, &req).await?)?;
        }
        Verb::Signal(a) => {
            let id = parse_id(&a.id)?;
            let c = client(&a.server)?;
            let req = Signal {
                name: a.name,
                payload: parse_json("payload", a.payload)?,
                idempotency_key: a.idempotency_key,
            };
            print(&c.signal(id, &req).await?)?;
        }
        Verb::Cancel(a) => {
            let id = parse_id(&a.id)?;
            let c = client(&a.server)?;
            let req = Cancel {
                reason: a.reason,
                idempotency_key: a.idempotency_key,
            };
            print(&c.cancel(id, &req).await?)?;
        }
        Verb::Get(a) => {
            let id = parse_id(&a.id)?;
            print(&client(&a.server)?.get(id).await?)?;
        }
        Verb::Events(a) => events(a).await?,
        Verb::Key(a) => {
            let c = client(&a.server)?;
            print(&c.find_by_key(&a.routing_key).await?)?;
        }
        Verb::Cluster(ClusterVerb::RemoveNode(a)) => {
            let report = client(&a.server)?.remove_node(a.node, a.to).await?;
            print(&report)?;
            if report.get("complete") != Some(&serde_json::Value::Bool(true)) {
                return Err(anyhow::anyhow!(
                    "not every shard's replica on node {} could be moved (see the report's shards); run it again to go on",
                    a.node
                )
                .into());
            }
        }
        Verb::Cluster(ClusterVerb::Reload(a)) => {
            let mut failed = Vec::new();
            for server in a.server.config().servers {
                let cfg = one_node(&ServerArg {
                    server: server.clone(),
                });
                let answer = match Client::with_config(cfg) {
                    Ok(c) => c.reload_cluster().await.map_err(|e| e.to_json()),
                    Err(e) => Err(e.to_json()),
                };
                let line = match answer {
                    Ok(v) => serde_json::json!({"server": server, "reloaded": v}),
                    Err(e) => {
                        failed.push(server.clone());
                        serde_json::json!({"server": server, "error": e})
                    }
                };
                print(&line)?;
            }
            if !failed.is_empty() {
                return Err(anyhow::anyhow!(
                    "{} of the nodes did not reload: {} (see above)",
                    failed.len(),
                    failed.join(", ")
                )
                .into());
            }
        }
        Verb::Cluster(ClusterVerb::TrustReplica(a)) => {
            if !a.accept_loss {
                return Err(anyhow::anyhow!(
                    "--accept-loss is required: a trusted replica may let its shard elect a leader without an entry that only its lost disk and a replica that is gone held"
                )
                .into());
            }
            // This node's replica.
            let answer = Client::with_config(one_node(&a.server))?
                .trust_replica(a.shard)
                .await?;
            print(&answer)?;
        }
        Verb::Cluster(ClusterVerb::Placement(a)) => {
            let answer = client(&a.server)?.placement().await?;
            if a.json {
                print(&answer)?;
            } else {
                let placed: forkless_server::placement::Placement =
                    serde_json::from_value(answer).context("the server's placement answer")?;
                print!(
                    "# Every shard's replicas, as this cluster's Raft groups were made with.\n\
                     # Add these entries to every node's cluster file before adding a node to it.\n\n{}",
                    placed.to_toml()
                );
            }
        }
        Verb::Cluster(ClusterVerb::WaitLevel(a)) => wait_level(&a).await?,
        Verb::Cluster(ClusterVerb::Drain(a)) | Verb::Cluster(ClusterVerb::Undrain(a))
            if a.server.server.contains(',') =>
        {
            return Err(anyhow::anyhow!(
                "--server: name one node (its own leaderships are drained), not a list"
            )
            .into());
        }
        Verb::Cluster(ClusterVerb::Drain(a)) => drain_node(&a, true).await?,
        Verb::Cluster(ClusterVerb::Undrain(a)) => drain_node(&a, false).await?,
        Verb::Status(a) => {
            let map = client(&a.server)?.cluster().await?;
            if a.json {
                print(&*map)?;
            } else {
                print_status(&map, &mut std::io::stdout().lock()).context("writing to stdout")?;
            }
        }
    }
    Ok(())
}

/// `forkless cluster drain` / `undrain`: asks the node named, and no other.
async fn drain_node(a: &DrainArgs, drain: bool) -> Result<(), Failed> {
    let answer = Client::with_config(one_node(&a.server))?
        .drain_node(drain)
        .await?;
    print(&answer)?;
    // A shard no other replica took (or had none to take it) is still led
    // there: said, and exit 1 (the node's balancer hands it over once a
    // replica can take it).
    let left = ["not_taken", "no_replica"]
        .iter()
        .filter_map(|k| answer.get(*k).and_then(|v| v.as_u64()))
        .sum::<u64>();
    if drain && left > 0 {
        return Err(anyhow::anyhow!(
            "{left} shard(s) are still led by the node drained (no other replica took them, or none could): it hands them over once another replica can take them (`forkless status` shows where they are)"
        )
        .into());
    }
    Ok(())
}

/// `forkless cluster wait-level`: asks every node for its map, each round,
/// until [`not_level`] finds nothing, or the timeout.
async fn wait_level(a: &WaitLevelArgs) -> Result<(), Failed> {
    // One ask of a node: at most this long, and at least the floor below
    // even when less of the timeout is left (a round cut shorter would
    // take a loaded node for one that does not answer).
    const ASK_MAX: Duration = Duration::from_secs(2);
    const ASK_MIN: Duration = Duration::from_millis(500);
    let started = tokio::time::Instant::now();
    let until = started + a.timeout;
    let left = || until.saturating_duration_since(tokio::time::Instant::now());
    // The node named may be the one just restarted, not serving yet: asked
    // again until the timeout; what it last said is what is reported.
    let first = loop {
        let c = client(&a.server)?;
        match tokio::time::timeout(left().clamp(ASK_MIN, ASK_MAX), c.cluster()).await {
            Ok(Ok(m)) => break m,
            Ok(Err(e)) if left().is_zero() => return Err(e.into()),
            Ok(Err(_)) => tokio::time::sleep(Duration::from_millis(250).min(left())).await,
            Err(_) if left().is_zero() => {
                return Err(anyhow::anyhow!(
                    "{} did not answer within {:?}",
                    a.server.server,
                    a.timeout
                )
                .into())
            }
            Err(_) => {}
        }
    };
    if !first.shards.iter().any(|s| s.replicas.is_some()) || first.nodes.is_empty() {
        return Err(anyhow::anyhow!(
            "node {} runs no replicated cluster: there are no replicas to wait for",
            first.node
        )
        .into());
    }
    let mut said = tokio::time::Instant::now();
    // What the last round found not level.
    let mut last: Vec<String> = Vec::new();
    loop {
        // Not enough time left for a round: the last round's word stands.
        if !last.is_empty() && left() < ASK_MIN {
            for p in &last {
                eprintln!("not level: {p}");
            }
            return Err(anyhow::anyhow!(
                "not level within {:?} ({} reason(s) above)",
                a.timeout,
                last.len()
            )
            .into());
        }
        // Every node the first answer names, each asked for its own view,
        // all at once: nodes that do not answer cost one ask's bound, not
        // one each.
        let ask_within = left().clamp(ASK_MIN, ASK_MAX);
        let mut asks = tokio::task::JoinSet::new();
        for n in &first.nodes {
            // This node's own view.
            let mut cfg = one_node(&ServerArg {
                server: first.base_of(n),
            });
            cfg.retry = RetryPolicy {
                max_attempts: 1,
                ..RetryPolicy::default()
            };
            cfg.request_timeout = ask_within;
            let id = n.id;
            asks.spawn(async move {
                let map = match Client::with_config(cfg) {
                    Ok(c) => match tokio::time::timeout(ask_within, c.cluster()).await {
                        Ok(m) => m.map(|m| (*m).clone()).map_err(|e| e.to_string()),
                        Err(_) => Err(format!("no answer within {ask_within:?}")),
                    },
                    Err(e) => Err(e.to_string()),
                };
                (id, map)
            });
        }
        let mut maps = Vec::new();
        while let Some(done) = asks.join_next().await {
            match done {
                Ok(m) => maps.push(m),
                Err(e) => return Err(anyhow::anyhow!("asking a node for its map: {e}").into()),
            }
        }
        // In the order the first answer names the nodes.
        maps.sort_by_key(|(id, _)| first.nodes.iter().position(|n| n.id == *id));
        let pending = not_level(&maps, a.lag_max);
        if pending.is_empty() {
            println!(
                "every shard's replicas are level with their leader ({} shards on {} nodes), after {:.1} s",
                first.shards.len(),
                first.nodes.len(),
                started.elapsed().as_secs_f64()
            );
            return Ok(());
        }
        let now = tokio::time::Instant::now();
        if now.duration_since(said) >= Duration::from_secs(5) {
            said = now;
            eprintln!(
                "waiting: {}{}",
                pending[0],
                if pending.len() > 1 {
                    format!(" (and {} more)", pending.len() - 1)
                } else {
                    String::new()
                }
            );
        }
        last = pending;
        tokio::time::sleep(Duration::from_millis(250).min(left())).await;
    }
}

/// What keeps a replicated cluster from being level, given each node's
/// own map (`Err`: it did not answer): a node that did not answer, a
/// shard no node leads, a replica its leader counts that lacks more than
/// `lag_max` entries of the leader's log (or that its leader has not
/// heard), and a replica that is new and catching up. Empty: level.
fn not_level(maps: &[(u16, Result<ClusterMap, String>)], lag_max: u64) -> Vec<String> {
    let mut pending = Vec::new();
    let answered: Vec<(u16, &ClusterMap)> = maps
        .iter()
        .filter_map(|(n, m)| match m {
            Ok(m) => Some((*n, m)),
            Err(e) => {
                pending.push(format!("node {n} does not answer ({e})"));
                None
            }
        })
        .collect();
    let shards = answered
        .iter()
        .map(|(_, m)| m.shards.len())
        .max()
        .unwrap_or(0);
    for shard in 0..shards {
        let at = |m: &ClusterMap| m.shards.iter().find(|s| s.shard as usize == shard).cloned();
        // The node whose own replica leads, at the highest term.
        let leader = answered
            .iter()
            .filter_map(|(n, m)| {
                let s = at(m)?;
                let r = s.raft.clone()?;
                (r.state == "leader").then(|| (s.term.unwrap_or(0), *n, s, r))
            })
            .max_by_key(|(term, n, _, _)| (*term, *n));
        let Some((_, led_by, s, r)) = leader else {
            pending.push(format!("shard {shard}: no node leads it"));
            continue;
        };
        for v in s.replicas.iter().flatten().filter(|v| **v != led_by) {
            match r.followers.iter().find(|f| f.node == u64::from(*v)) {
                // Never matched: the leader's lag for it is its whole log,
                // which may be short; not taken for level.
                Some(f) if f.matched.is_none() => pending.push(format!(
                    "shard {shard}: its leader, node {led_by}, has not heard how far node {v} is"
                )),
                Some(f) => match f.lag {
                    Some(lag) if lag <= lag_max => {}
                    Some(lag) => pending.push(format!(
                        "shard {shard}: node {v} is {lag} entries behind its leader, node {led_by}"
                    )),
                    None => pending.push(format!(
                        "shard {shard}: its leader, node {led_by}, does not know how far node {v} is"
                    )),
                },
                None => pending.push(format!(
                    "shard {shard}: its leader, node {led_by}, does not replicate to node {v}"
                )),
            }
        }
        if r.joint {
            pending.push(format!(
                "shard {shard}: a change of its voters is under way (its leader, node {led_by}, has the old voters and the new)"
            ));
        }
        for (n, m) in &answered {
            if at(m).and_then(|s| s.raft).is_some_and(|r| r.fresh) {
                pending.push(format!(
                    "shard {shard}: node {n}'s replica is new (its data directory was lost) and catching up"
                ));
            }
        }
    }
    pending
}

/// Most events the server returns in one page.
const PAGE_MAX: u64 = 1000;

async fn events(a: EventsArgs) -> Result<(), Failed> {
    let id = parse_id(&a.id)?;
    if a.follow && (a.wait_ms == 0 || a.wait_ms > 30_000) {
        return Err(anyhow::anyhow!("--wait-ms must be 1 to 30000").into());
    }
    if a.limit == Some(0) {
        return Err(anyhow::anyhow!("--limit must be at least 1").into());
    }
    let c = client(&a.server)?;
    let mut after = a.after;
    let mut left = a.limit.unwrap_or(u64::MAX);
    loop {
        let page = c
            .read_events(
                id,
                ReadEvents {
                    after,
                    limit: Some(left.min(PAGE_MAX) as u32),
                    wait: a.follow.then(|| Duration::from_millis(a.wait_ms)),
                },
            )
            .await?;
        for e in &page.events {
            print(e)?;
            after = after.max(e.seq);
            left -= 1;
        }
        let caught_up = after >= page.last_seq;
        if left == 0 || (caught_up && (!a.follow || page.is_closed())) {
            return Ok(());
        }
        if page.events.is_empty() && !a.follow {
            // Nothing more to read (defensive: a gap in seqs).
            return Ok(());
        }
    }
}

/// Shards listed one by one up to this count; above it, grouped by owner.
const SHARDS_LISTED_MAX: u32 = 64;

pub fn print_status(m: &ClusterMap, out: &mut impl Write) -> std::io::Result<()> {
    let alive = m.nodes.iter().filter(|n| n.alive).count();
    writeln!(
        out,
        "cluster: {} node{} ({} alive), {} shard{}, map version {}, routing {}",
        m.nodes.len(),
        if m.nodes.len() == 1 { "" } else { "s" },
        alive,
        m.shard_count,
        if m.shard_count == 1 { "" } else { "s" },
        m.map_version,
        if m.routing_active {
            "active"
        } else {
            "inactive: every request is served locally"
        },
    )?;
    writeln!(
        out,
        "as seen by node {} at {} (liveness is that node's view)",
        m.node, m.fetched_from
    )?;
    writeln!(out)?;
    let replicated = m.shards.iter().any(|s| s.replicas.is_some());
    writeln!(
        out,
        "{:<6} {:<22} {:<22} {:<6} {:>6}",
        "NODE",
        "API ADDRESS",
        "PEER ADDRESS",
        "ALIVE",
        // A replicated shard's owner is its elected leader.
        if replicated { "LEADS" } else { "SHARDS" }
    )?;
    for n in &m.nodes {
        // (Replicated: the leader the shard table below shows, which is
        // none during an election; the routing table's owner of record
        // stays the last leader until a new one is heard.)
        let owned = m
            .shards
            .iter()
            .filter(|s| {
                if replicated {
                    s.leader == Some(n.id)
                } else {
                    s.owner == Some(n.id)
                }
            })
            .count();
        writeln!(
            out,
            "{:<6} {:<22} {:<22} {:<6} {:>6}",
            n.id,
            n.api_addr,
            n.peer_addr.as_deref().unwrap_or("-"),
            match (n.alive, n.probe.as_deref(), n.draining) {
                (false, _, _) => "NO",
                (true, Some("never_answered"), _) => "never",
                (true, _, Some(true)) => "drained",
                (true, _, _) => "yes",
            },
            owned
        )?;
    }
    // Taken for alive (requests are sent to them), but never heard from.
    let never: Vec<String> = m
        .nodes
        .iter()
        .filter(|n| n.alive && n.probe.as_deref() == Some("never_answered"))
        .map(|n| n.id.to_string())
        .collect();
    if !never.is_empty() {
        writeln!(
            out,
            "node(s) {} never answered node {}'s probes since it started (\"never\"): not started yet, or unreachable from it; requests are still sent there, and moves pick no such node",
            never.join(", "),
            m.node
        )?;
    }
    // The nodes the answering node found differing from it in one thing.
    let differing = |agrees: fn(&forkless_client::NodeInfo) -> Option<bool>| -> Vec<String> {
        m.nodes
            .iter()
            .filter(|n| agrees(n) == Some(false))
            .map(|n| n.id.to_string())
            .collect()
    };
    let differ = differing(|n| n.same_nodes);
    if !differ.is_empty() {
        writeln!(
            out,
            "node(s) {} run with another node list than node {}: a cluster file edited and not reloaded there? (forkless cluster reload)",
            differ.join(", "),
            m.node
        )?;
    }
    if m.draining {
        writeln!(
            out,
            "node {} is drained (or stopping): it takes no leadership (forkless cluster undrain --server ...)",
            m.node
        )?;
    }
    // Other nodes that said they are drained ("drained" under ALIVE).
    let drained: Vec<String> = m
        .nodes
        .iter()
        .filter(|n| n.id != m.node && n.alive && n.draining == Some(true))
        .map(|n| n.id.to_string())
        .collect();
    if !drained.is_empty() {
        writeln!(
            out,
            "node(s) {} are drained (or stopping): they take no leadership (forkless cluster undrain --server <that node>)",
            drained.join(", ")
        )?;
    }
    let placed_otherwise = differing(|n| n.same_placement);
    if !placed_otherwise.is_empty() {
        writeln!(
            out,
            "node(s) {} run groups made with another placement than node {}'s: their Raft calls are refused and their leaders not taken (compare forkless cluster placement on each)",
            placed_otherwise.join(", "),
            m.node
        )?;
    }
    // Shards whose replica on the answering node failed.
    for sh in m.shards.iter().filter(|sh| sh.failed.is_some()) {
        writeln!(
            out,
            "shard {} is out of service on node {}: {} (it serves none of the shard's requests there until it is back)",
            sh.shard,
            m.node,
            sh.failed.as_deref().unwrap_or_default()
        )?;
    }
    writeln!(out)?;
    let owner_text = |o: Option<u16>| {
        o.map_or_else(
            || "none".to_string(),
            |id| match m.node_info(id) {
                Some(n) if n.alive => id.to_string(),
                Some(_) => format!("{id} (down)"),
                None => format!("{id} (unknown node)"),
            },
        )
    };
    if replicated {
        // A replicated cluster: each shard's group, as that node sees it.
        writeln!(
            out,
            "{:<6} {:<18} {:>6} {:<12} {:<16} {:>8} {:>8} {:>8} {:>9}",
            "SHARD", "LEADER", "TERM", "REPLICAS", "HERE", "LAST", "COMMIT", "APPLIED", "MAX LAG"
        )?;
        let num = |n: Option<u64>| n.map_or_else(|| "-".into(), |n| n.to_string());
        for s in &m.shards {
            let mut replicas = s
                .replicas
                .iter()
                .flatten()
                .map(|n| n.to_string())
                .collect::<Vec<_>>()
                .join(",");
            if s.replicas_from.as_deref() == Some("cluster_file") {
                replicas.push('*');
            }
            let r = s.raft.as_ref();
            if r.is_some_and(|r| r.joint) {
                replicas.push('~');
            }
            for l in r.map(|r| r.learners.as_slice()).unwrap_or_default() {
                replicas.push_str(&format!("+{l}"));
            }
            let lag = r.and_then(|r| r.followers.iter().filter_map(|f| f.lag).max());
            writeln!(
                out,
                "{:<6} {:<18} {:>6} {:<12} {:<16} {:>8} {:>8} {:>8} {:>9}",
                s.shard,
                owner_text(s.leader),
                num(s.term),
                replicas,
                if s.failed.is_some() {
                    "failed".to_string()
                } else {
                    r.map_or("-".to_string(), |r| {
                        if r.left_group {
                            "left the group".to_string()
                        } else if r.fresh {
                            format!("{} (new)", r.state)
                        } else if r.quiet {
                            format!("{} (quiet)", r.state)
                        } else {
                            r.state.clone()
                        }
                    })
                },
                num(r.and_then(|r| r.last_log_index)),
                num(r.and_then(|r| r.committed)),
                num(r.and_then(|r| r.applied)),
                num(lag),
            )?;
        }
        if m.shards
            .iter()
            .any(|s| s.replicas_from.as_deref() == Some("cluster_file"))
        {
            writeln!(
                out,
                "* as the cluster file places them: node {} holds no replica of the shard and has not heard from its leader",
                m.node
            )?;
        }
        if m.shards
            .iter()
            .any(|s| s.raft.as_ref().is_some_and(|r| !r.learners.is_empty()))
        {
            writeln!(
                out,
                "+N: node N is a learner of the shard's group (a move's target catching up, or one a move cut short left: asking the move again goes on, a move elsewhere removes it)"
            )?;
        }
        if m.shards
            .iter()
            .any(|s| s.raft.as_ref().is_some_and(|r| r.joint))
        {
            writeln!(
                out,
                "~ a change of the shard's voters is under way: the old voters and the new are listed, and a quorum of each is needed for every write (the next leader finishes a change its leader left unfinished)"
            )?;
        }
        if m.shards
            .iter()
            .any(|s| s.raft.as_ref().is_some_and(|r| r.fresh))
        {
            writeln!(
                out,
                "(new): node {}'s replica is new (its data directory was lost) and catching up; it votes for no candidate with entries until it has. A shard that cannot elect meanwhile because a replica is gone for good: forkless cluster trust-replica --shard S --accept-loss",
                m.node
            )?;
        }
        return Ok(());
    }
    if m.shard_count <= SHARDS_LISTED_MAX {
        writeln!(out, "{:<6} {:<18} {:>6}", "SHARD", "OWNER", "EPOCH")?;
        for s in &m.shards {
            writeln!(
                out,
                "{:<6} {:<18} {:>6}",
                s.shard,
                owner_text(s.owner),
                s.epoch.map_or_else(|| "-".into(), |e| e.to_string())
            )?;
        }
    } else {
        writeln!(
            out,
            "{} shards, grouped by owner (--json lists each):",
            m.shard_count
        )?;
        writeln!(out, "{:<18} {:>6}  {:<12}", "OWNER", "SHARDS", "EPOCHS")?;
        let mut owners: Vec<Option<u16>> = m.shards.iter().map(|s| s.owner).collect();
        owners.sort();
        owners.dedup();
        for o in owners {
            let of: Vec<_> = m.shards.iter().filter(|s| s.owner == o).collect();
            let lo = of.iter().filter_map(|s| s.epoch).min();
            let hi = of.iter().filter_map(|s| s.epoch).max();
            let epochs = match (lo, hi) {
                (Some(l), Some(h)) if l == h => l.to_string(),
                (Some(l), Some(h)) => format!("{l}-{h}"),
                _ => "-".into(),
            };
            writeln!(out, "{:<18} {:>6}  {:<12}", owner_text(o), of.len(), epochs)?;
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Node `me`'s map of a two-shard cluster of three replicas on nodes
    /// 1-3: each shard as `(leader, this node's state, followers as (node,
    /// lag) if it leads, fresh)`.
    /// A follower's node and lag, as its leader says.
    type Lags<'a> = &'a [(u64, Option<u64>)];

    fn map(me: u16, shards: &[(u16, &str, Lags, bool)]) -> ClusterMap {
        let shards: Vec<String> = shards
            .iter()
            .enumerate()
            .map(|(i, (leader, state, followers, fresh))| {
                let followers: Vec<String> = followers
                    .iter()
                    .map(|(n, lag)| {
                        // No lag given: the leader never heard it (no
                        // matched index; the server's lag is then the
                        // whole log's length).
                        let matched = if lag.is_none() { "null" } else { "1" };
                        let lag = lag.map_or("2".to_string(), |l| l.to_string());
                        format!(r#"{{"node":{n},"matched":{matched},"lag":{lag}}}"#)
                    })
                    .collect();
                format!(
                    r#"{{"shard":{i},"owner":{leader},"epoch":4,"leader":{leader},"term":4,"replicas":[1,2,3],
                       "raft":{{"state":"{state}","followers":[{}],"fresh":{fresh}}}}}"#,
                    followers.join(",")
                )
            })
            .collect();
        let body = format!(
            r#"{{"node":{me},"shard_count":2,"map_version":1,"routing_active":true,
               "nodes":[{{"id":1,"api_addr":"127.0.0.1:7071"}},{{"id":2,"api_addr":"127.0.0.1:7072"}},{{"id":3,"api_addr":"127.0.0.1:7073"}}],
               "shards":[{}]}}"#,
            shards.join(",")
        );
        ClusterMap::from_json(body.as_bytes(), "http://127.0.0.1:7071").expect("a valid map")
    }

    #[test]
    fn level_once_every_node_answers_and_every_replica_is_caught_up() {
        const UP: Lags = &[(2, Some(0)), (3, Some(3))];
        let leader = || map(1, &[(1, "leader", UP, false), (1, "leader", UP, false)]);
        let follower = |me: u16, fresh: bool| {
            map(
                me,
                &[(1, "follower", &[], fresh), (1, "follower", &[], false)],
            )
        };
        let all = |n3: Result<ClusterMap, String>| {
            vec![(1, Ok(leader())), (2, Ok(follower(2, false))), (3, n3)]
        };
        assert!(not_level(&all(Ok(follower(3, false))), 16).is_empty());
        // Three entries behind is level at 16, not at 2.
        assert_eq!(
            not_level(&all(Ok(follower(3, false))), 2),
            vec![
                "shard 0: node 3 is 3 entries behind its leader, node 1".to_string(),
                "shard 1: node 3 is 3 entries behind its leader, node 1".to_string(),
            ]
        );
        assert_eq!(
            not_level(&all(Err("connection refused".into())), 16),
            vec!["node 3 does not answer (connection refused)".to_string()]
        );
        assert_eq!(
            not_level(&all(Ok(follower(3, true))), 16),
            vec![
                "shard 0: node 3's replica is new (its data directory was lost) and catching up"
                    .to_string()
            ]
        );
        // A follower its leader never heard from is not level, however
        // short the log (its lag is then the log's length, 2 here).
        let never: Lags = &[(2, Some(0)), (3, None)];
        let unheard = vec![
            (
                1,
                Ok(map(
                    1,
                    &[(1, "leader", UP, false), (1, "leader", never, false)],
                )),
            ),
            (2, Ok(follower(2, false))),
            (3, Ok(follower(3, false))),
        ];
        assert_eq!(
            not_level(&unheard, 16),
            vec!["shard 1: its leader, node 1, has not heard how far node 3 is".to_string()]
        );
        // Nobody leads shard 1; shard 0's leader does not know node 3.
        let part: Lags = &[(2, Some(0))];
        let unled = vec![
            (
                1,
                Ok(map(
                    1,
                    &[(1, "leader", part, false), (1, "candidate", &[], false)],
                )),
            ),
            (2, Ok(follower(2, false))),
            (3, Ok(follower(3, false))),
        ];
        assert_eq!(
            not_level(&unled, 16),
            vec![
                "shard 0: its leader, node 1, does not replicate to node 3".to_string(),
                "shard 1: no node leads it".to_string(),
            ]
        );
    }

    /// A group in the middle of a change of its voters (openraft's joint
    /// configuration) is not level, and `forkless status` marks it.
    #[test]
    fn a_change_of_voters_under_way_is_not_level_and_is_marked() {
        const UP: Lags = &[(2, Some(0)), (3, Some(0))];
        let mut led = map(1, &[(1, "leader", UP, false), (1, "leader", UP, false)]);
        let follower = |me: u16| {
            map(
                me,
                &[(1, "follower", &[], false), (1, "follower", &[], false)],
            )
        };
        let maps = |led: &ClusterMap| {
            vec![
                (1, Ok(led.clone())),
                (2, Ok(follower(2))),
                (3, Ok(follower(3))),
            ]
        };
        assert!(not_level(&maps(&led), 16).is_empty());
        let mut shown = Vec::new();
        print_status(&led, &mut shown).expect("printed");
        let shown = String::from_utf8(shown).expect("utf-8");
        assert!(!shown.contains('~'), "{shown}");
        // Node 1 leads both shards; with shard 0's leader unknown (an
        // election), the LEADS column counts one, whatever the routing
        // table's owner of record.
        let leads = |m: &ClusterMap| {
            let mut shown = Vec::new();
            print_status(m, &mut shown).expect("printed");
            let shown = String::from_utf8(shown).expect("utf-8");
            shown
                .lines()
                .skip_while(|l| !l.starts_with("NODE"))
                .nth(1)
                .and_then(|l| l.split_whitespace().last().map(String::from))
                .expect("node 1's row")
        };
        assert_eq!(leads(&led), "2");
        let mut electing = led.clone();
        electing.shards[0].leader = None;
        assert_eq!(electing.shards[0].owner, Some(1));
        assert_eq!(leads(&electing), "1");
        led.shards[1].raft.as_mut().expect("a replica").joint = true;
        assert_eq!(
            not_level(&maps(&led), 16),
            vec![
                "shard 1: a change of its voters is under way (its leader, node 1, has the old voters and the new)"
                    .to_string()
            ]
        );
        let mut shown = Vec::new();
        print_status(&led, &mut shown).expect("printed");
        let shown = String::from_utf8(shown).expect("utf-8");
        let row = shown
            .lines()
            .skip_while(|l| !l.starts_with("SHARD"))
            .find(|l| l.starts_with("1 "))
            .expect("shard 1's row");
        assert!(row.contains("1,2,3~"), "{shown}");
        assert!(
            shown.contains("~ a change of the shard's voters is under way"),
            "{shown}"
        );
    }

    /// `forkless status` names a node that said it is drained, a shard
    /// whose replica failed, and a group's learners.
    #[test]
    fn status_shows_drained_peers_failed_shards_and_learners() {
        const UP: Lags = &[(2, Some(0)), (3, Some(0))];
        let mut m = map(1, &[(1, "leader", UP, false), (1, "leader", UP, false)]);
        m.nodes[1].draining = Some(true);
        m.shards[0].failed = Some("the node log's sync failed".into());
        // (A replica that failed to open, or is being restarted, has no
        // group to show.)
        m.shards[0].raft = None;
        m.shards[1].raft.as_mut().expect("a replica").learners = vec![4];
        let mut shown = Vec::new();
        print_status(&m, &mut shown).expect("printed");
        let shown = String::from_utf8(shown).expect("utf-8");
        let row = |start: &str, after: &str| {
            shown
                .lines()
                .skip_while(|l| !l.starts_with(after))
                .find(|l| l.starts_with(start))
                .unwrap_or_else(|| panic!("no row {start:?} after {after:?}: {shown}"))
                .to_string()
        };
        assert!(row("2 ", "NODE").contains("drained"), "{shown}");
        assert!(shown.contains("node(s) 2 are drained"), "{shown}");
        assert!(row("0 ", "SHARD").contains("failed"), "{shown}");
        assert!(
            shown.contains("shard 0 is out of service on node 1: the node log's sync failed"),
            "{shown}"
        );
        assert!(row("1 ", "SHARD").contains("1,2,3+4"), "{shown}");
        assert!(shown.contains("+N: node N is a learner"), "{shown}");
    }
}
