//! The HTTP edge of a forkless node: the client API, validation, routing to
//! the owner (locally or one forwarded hop), peer probing, config and
//! metrics. The only crate that knows HTTP and JSON.
//!
//! Request flow: parse and validate (400/413 before any routing), resolve
//! the shard, ask `forkless_routing::decide`, then perform the answer:
//! the local store, a forward, `421 not_owner` or `503 owner_unavailable`.

pub mod api;
mod budget;
pub mod config;
mod conn;
pub mod error;
pub mod forward;
mod headers;
pub mod metrics;
pub mod peer;
pub mod placement;
pub mod reload;
pub mod wire;

use config::ServerConfig;
use forkless_routing::{Directory, StaticDirectory};
use forkless_store::{Store, StoreConfig};
use forkless_types::{IdMinter, ShardId};
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::Arc;

/// Hops a forwarded request has taken. Only peers may set it.
pub const HOPS_HEADER: &str = "x-forkless-hops";
/// The version of the protocol replicated nodes speak to each other (the
/// Raft transport and the node heartbeat): nodes of different versions
/// refuse each other's connections, so an upgrade across it is not a
/// rolling one (`forkless --version` names it).
pub const PEER_PROTOCOL_VERSION: u32 = forkless_raftnet::PROTOCOL_VERSION;
/// The cluster secret, proving a request comes from a peer.
pub const PEER_TOKEN_HEADER: &str = "x-forkless-peer-token";
/// The node that produced an answer.
pub const NODE_HEADER: &str = "x-forkless-node";
/// On a page of events forwarded by a peer: the bytes its listener has
/// room for in its answer budget, which the owner cuts the page to as it
/// does to its own room (read only with a peer's credentials).
pub const ANSWER_ROOM_HEADER: &str = "x-forkless-answer-room";

/// Everything a request handler needs.
pub struct App {
    pub cfg: ServerConfig,
    pub dir: Arc<StaticDirectory>,
    pub store: Arc<Store>,
    pub minter: IdMinter,
    pub forwarder: forward::Forwarder,
    pub metrics: metrics::Metrics,
    pub secret: String,
    /// This node's id as the value of [`NODE_HEADER`], made once.
    pub node_header: axum::http::HeaderValue,
    /// API requests being served right now (the store commits on a
    /// request's own thread only when it is alone).
    pub in_progress: Arc<AtomicUsize>,
    /// `/readyz`: true once the node serves and, in a cluster, its first
    /// round of peer probes has completed (every peer answered or timed
    /// out), so it knows its peers' liveness and newer epochs.
    pub ready: AtomicBool,
    /// Turns true when the node stops taking connections: long-polls
    /// answer with what they have instead of holding the shutdown up.
    pub stopping: tokio::sync::watch::Sender<bool>,
    /// Set when the node is asked to stop, before it hands its leaderships
    /// over: `/readyz` says it is stopping.
    pub leaving: AtomicBool,
    /// What hands this node's leaderships over, set once it serves in a
    /// replicated cluster: at a stop, and on an operator's request
    /// (`POST /api/cluster/drain`, `forkless cluster drain`).
    pub drainer: std::sync::OnceLock<Drain>,
    /// Connections open now on each listener: the client API's, and the
    /// peer address's when it is a listener of its own. Each is bounded by
    /// `limits.connections_max` on its own, so clients that fill their
    /// listener cannot take the connections peers forward and probe on.
    pub connections: [AtomicUsize; 2],
    /// Long-polls waiting now (`limits.long_polls_max` bounds it).
    pub long_polls: AtomicUsize,
    /// The bytes of request bodies each listener's connections may hold
    /// at once (`limits.body_bytes_in_flight_max`), by listener as
    /// [`App::connections`]: with a peer address of its own, clients
    /// filling theirs cannot refuse the peers' forwarded writes.
    pub(crate) body_budgets: [budget::ByteBudget; 2],
    /// The bytes of answers to reads each listener's connections hold at
    /// once, from the moment an answer is made until it is written
    /// (`limits.answer_bytes_in_flight_max`), by listener as
    /// [`App::body_budgets`].
    pub(crate) answer_budgets: [budget::ByteBudget; 2],
    /// How this node's replicated shards reach their other replicas.
    pub replication: Option<forkless_store::Replication>,
    /// Each replicated shard's voters as its leader last said in answer
    /// to this node's probes, with that leader's term: what `/api/cluster`
    /// shows of a shard this node holds no replica of (or a replica the
    /// group has since left), instead of the cluster file's placement.
    pub replicas_heard: std::sync::Mutex<std::collections::HashMap<u32, ReplicasHeard>>,
    /// The cluster as this node runs it: the file it started on, plus the
    /// nodes reloads added (`reload`). `None` on a node with no cluster.
    pub cluster: std::sync::RwLock<Option<Arc<config::ClusterConfig>>>,
    /// Reads the cluster file again (`reload`); `None` when the node was
    /// started with no file to read.
    pub reload: Option<reload::Reload>,
    /// This node's Raft connections to its peers, which a reload adds to.
    pub links: Option<forkless_raftnet::Links>,
    /// Whether each peer answered its last probe with the same node ids
    /// as this node runs with: a peer not reloaded after the files were
    /// edited differs.
    pub same_nodes: std::sync::Mutex<std::collections::HashMap<u16, bool>>,
    /// Each peer's word, in its last answer to a probe, on whether it is
    /// drained or stopping (absent: not known yet, or an older build).
    pub drained_peers: std::sync::Mutex<std::collections::HashMap<u16, bool>>,
    /// Whether each peer answered its last probe with the fingerprint of
    /// the placement this node's groups were made with (a replicated
    /// cluster's): a peer placed otherwise is not learned from.
    pub same_placement: std::sync::Mutex<std::collections::HashMap<u16, bool>>,
    /// Whether each peer answered its last probe with this node's
    /// `limits.connections_max` (what each node's share of a peer's
    /// connections is reckoned with: `forward::share`).
    pub same_connections_max: std::sync::Mutex<std::collections::HashMap<u16, bool>>,
    /// The open-file limit in force (raised at start): a reload's nodes
    /// must fit it as the start's did (`reload::check_fds`).
    pub fd_limit: u64,
    /// Held for a whole reload (reading the file, planning, applying), so
    /// that two reloads (a SIGHUP and a request) cannot apply out of the
    /// order they read the file in.
    pub reloading: tokio::sync::Mutex<()>,
    /// The nodes replica moves this node leads are going to: a reload
    /// does not retire one (`reload::MoveTargets`).
    pub move_targets: reload::MoveTargets,
    /// Counts the times the directory took a shard's newer owner
    /// ([`App::observe`]) or a peer answered a probe
    /// ([`App::peer_answered`]): what a request waiting for its shard's
    /// leader to be reachable waits on (`api::leader_reachable`).
    pub routes_changed: tokio::sync::watch::Sender<u64>,
}

/// A shard's voters as its leader `from` said at `term`, and the log id
/// (term, index) of the entry they are from.
#[derive(Debug, Clone)]
pub struct ReplicasHeard {
    pub from: u16,
    pub term: u64,
    pub voters: Vec<u64>,
    pub learners: Vec<u64>,
    pub membership_log: Option<(u64, u64)>,
    /// Whether that membership was committed (as its leader said).
    pub committed: bool,
}

impl ReplicasHeard {
    /// Whether node `me` is a voter or a learner of this membership.
    pub fn counts(&self, me: u64) -> bool {
        self.voters.contains(&me) || self.learners.contains(&me)
    }

    /// Whether this membership is newer than what this node's own replica
    /// of the shard knows (`local`; none: it holds no replica): it comes
    /// from a later log entry.
    pub fn newer_than(&self, local: Option<&forkless_store::RaftStatus>) -> bool {
        local.is_none_or(|g| self.membership_log > g.membership_log)
    }

    /// What this answer of the shard's leader says of node `me`'s replica
    /// (`local`): `Some(true)`, its group left it behind (this membership
    /// counts it neither as a voter nor as a learner, is committed, and
    /// is the one the replica holds or a newer one); `Some(false)`, the
    /// group counts it (or there is no replica here); `None`, a change is
    /// under way (not committed): left as it is. A replica removed just
    /// after it took the entry that removes it holds that membership
    /// itself: it is left behind as surely as one that never heard of it
    /// (the fault suite's moves found such a replica taken for a member,
    /// naming no leader for good). Equal log ids are the same entry: a
    /// term has one leader (`leader_id_std`), so (term, index) names one
    /// entry.
    pub fn leaves(&self, me: u64, local: Option<&forkless_store::RaftStatus>) -> Option<bool> {
        match local {
            None => Some(false),
            Some(_) if self.counts(me) => Some(false),
            Some(g) if self.committed && self.membership_log >= g.membership_log => Some(true),
            Some(_) => None,
        }
    }
}

#[derive(Debug, thiserror::Error)]
pub enum StartupError {
    // Transparent: the inner error is the message, not also its cause
    // (printed with its causes, `{0}` said it twice).
    #[error(transparent)]
    Config(#[from] config::ConfigError),
    #[error(transparent)]
    Store(#[from] forkless_store::StoreError),
    #[error("cannot listen on {addr}: {reason}")]
    Bind { addr: String, reason: String },
}

impl App {
    /// The directory's [`StaticDirectory::observe`], waking the requests
    /// that wait for a shard's next owner when the map moves.
    pub fn observe(
        &self,
        shard: ShardId,
        owner: forkless_types::NodeId,
        epoch: forkless_types::Epoch,
    ) -> forkless_routing::Observation {
        let seen = self.dir.observe(shard, owner, epoch);
        if seen == forkless_routing::Observation::Moved {
            self.routes_changed.send_modify(|n| *n = n.wrapping_add(1));
        }
        seen
    }

    /// A peer answered a probe: wakes the requests waiting for a leader
    /// there to be reachable (one they could not reach is taken for back
    /// once it answers a probe asked after that).
    pub fn peer_answered(&self) {
        self.routes_changed.send_modify(|n| *n = n.wrapping_add(1));
    }

    /// Opens the store and the shards this node owns, moving each to the
    /// epoch the map gives it.
    /// `fd_limit`: the open-file limit in force, which the shards' table
    /// files share with the connections (`config::cached_files_per_shard`).
    pub async fn open(
        cfg: ServerConfig,
        reload: Option<reload::Reload>,
        fd_limit: u64,
    ) -> Result<Arc<App>, StartupError> {
        let dir = Arc::new(cfg.directory()?);
        let in_progress = Arc::new(AtomicUsize::new(0));
        let replicated = cfg.cluster.as_ref().and_then(|c| c.replication.clone());
        if let (Some(r), Some(c)) = (&replicated, &cfg.cluster) {
            // Before any group is opened (and a new one initialized).
            check_placement(&cfg, c, r).await?;
        }
        // Their block caches, and their Raft logs' memory, share the
        // node's by default.
        let held = shards_held(&cfg, replicated.as_ref(), &dir);
        let cache_per_shard = cfg.store.cache_bytes_per_shard_for(held);
        let log = replicated.as_ref().map(|r| r.log_for(held));
        let files_per_shard = config::cached_files_per_shard(fd_limit, cfg.connection_fds(), held)
            .unwrap_or_else(|(files, why)| {
                tracing::warn!("{why}");
                files
            });
        tracing::info!(
            shards_held = held,
            table_files_per_shard = files_per_shard,
            block_cache_per_shard = cache_per_shard,
            write_buffers = cfg.store.write_buffer_bytes,
            raft_log_kept_entries = log.map(|l| l.kept),
            raft_log_cache_per_group = log.map(|l| l.cache_bytes),
            "memory and files: the shards' shares"
        );
        let replication = replicated.as_ref().zip(log).map(|(r, log)| {
            let hello = forkless_raftnet::Handshake {
                secret: cfg
                    .cluster
                    .as_ref()
                    .map(|c| c.secret.clone())
                    .unwrap_or_default(),
                // The file's, which the check above found the same (as
                // sets) as the recorded one; a reload keeps it so.
                placement: placement::Placement::of(r, cfg.shard_count).fingerprint(),
            };
            store_replication(cfg.node_id, r, hello, log)
        });
        let (replication, links) = match replication.transpose()? {
            Some((r, l)) => (Some(r), Some(l)),
            None => (None, None),
        };
        let store = Arc::new(Store::open(
            &cfg.data_dir,
            cfg.shard_count,
            StoreConfig {
                cache_bytes_per_shard: cache_per_shard,
                cached_files_per_shard: files_per_shard,
                journal_bytes_max: cfg.store.journal_bytes_max,
                write_buffer_bytes: cfg.store.write_buffer_bytes,
                background_nice: cfg.store.background_nice,
                writer_priority: cfg.store.writer_priority,
                // A replicated shard is a Raft group whatever the setting.
                raft: cfg.store.raft || replication.is_some(),
                replication: replication.clone(),
                requests_in_progress: Some(in_progress.clone()),
                raft_groups_in_flight: cfg.store.groups_in_flight,
                ..StoreConfig::default()
            },
        )?);
        if cfg.store.raft || replication.is_some() {
            // A shard whose Raft group stops by itself (a panic) is
            // restarted; the node's other shards serve meanwhile.
            store.supervise()?;
        }
        for s in 0..cfg.shard_count.get() {
            let shard = ShardId(s);
            if let Some(r) = &replicated {
                // Every shard this node holds a replica of; its epoch is
                // its group's term, never moved by the config.
                if r.replicas(shard).contains(&cfg.node_id) {
                    match store.open_shard(shard, forkless_types::Epoch(1)) {
                        Ok(_) | Err(forkless_store::StoreError::ShardFailed { .. }) => {}
                        Err(e) => return Err(e.into()),
                    }
                }
                continue;
            }
            if let forkless_routing::Owner::Local { epoch } = dir.owner_of(shard) {
                let st = match store.open_shard(shard, epoch) {
                    Ok(st) => st,
                    // Damage found at open: reported by the store, and the
                    // shard answers 503 while the others serve.
                    Err(forkless_store::StoreError::ShardFailed { .. }) => continue,
                    Err(e) => return Err(e.into()),
                };
                if st.epoch() < epoch {
                    st.advance_epoch(epoch).await?;
                } else if st.epoch() > epoch {
                    tracing::warn!(
                        shard = s, config_epoch = epoch.get(), store_epoch = st.epoch().get(),
                        "the store has seen a newer owner of this shard than the config names: writes stay fenced"
                    );
                }
            }
        }
        let secret = cfg
            .cluster
            .as_ref()
            .map(|c| c.secret.clone())
            .unwrap_or_default();
        let metrics = metrics::Metrics::new(store.clone());
        let budgets =
            |max: usize,
             gauge: &prometheus_client::metrics::gauge::Gauge,
             refused: &prometheus_client::metrics::counter::Counter| {
                [(); 2].map(|()| budget::ByteBudget::new(max, gauge.clone(), refused.clone()))
            };
        let body_budgets = budgets(
            cfg.limits.body_bytes_in_flight_max,
            &metrics.body_bytes_in_flight,
            &metrics.body_bytes_refused,
        );
        let answer_budgets = budgets(
            cfg.limits.answer_bytes_in_flight_max,
            &metrics.answer_bytes_in_flight,
            &metrics.answer_bytes_refused,
        );
        let app = Arc::new(App {
            minter: IdMinter::new(cfg.node_id),
            forwarder: forward::Forwarder::new(
                cfg.peer.forward_connect_timeout(),
                &secret,
                cfg.limits.connections_max,
            ),
            metrics,
            secret,
            node_header: axum::http::HeaderValue::from(cfg.node_id.get()),
            in_progress,
            ready: AtomicBool::new(false),
            stopping: tokio::sync::watch::channel(false).0,
            leaving: AtomicBool::new(false),
            drainer: std::sync::OnceLock::new(),
            connections: Default::default(),
            long_polls: AtomicUsize::new(0),
            body_budgets,
            answer_budgets,
            fd_limit,
            replication,
            replicas_heard: Default::default(),
            routes_changed: tokio::sync::watch::channel(0).0,
            cluster: std::sync::RwLock::new(cfg.cluster.clone().map(Arc::new)),
            reload,
            links,
            same_nodes: Default::default(),
            drained_peers: Default::default(),
            same_placement: Default::default(),
            same_connections_max: Default::default(),
            reloading: Default::default(),
            move_targets: Default::default(),
            dir,
            store,
            cfg,
        });
        // A copy of a shard that the map now gives to another node at a
        // newer epoch (the config moved it away) is fenced at that epoch
        // before this node serves anything.
        for st in app.store.hosted() {
            peer::fence_hosted_copy(&app, st.id()).await;
        }
        if let Some(r) = &replicated {
            warn_of_retired_members(&app, r);
        }
        Ok(app)
    }

    /// `shard`'s replicas as the running cluster places them (the cluster
    /// file as last read: `reload`), in the pin's order; empty when this
    /// node does not replicate.
    pub fn placed(&self, shard: ShardId) -> Vec<u64> {
        self.cluster
            .read()
            .unwrap_or_else(|e| e.into_inner())
            .as_ref()
            .and_then(|c| c.replication.as_ref())
            .map(|r| {
                r.replicas(shard)
                    .iter()
                    .map(|n| u64::from(n.get()))
                    .collect()
            })
            .unwrap_or_default()
    }

    /// Whether node `node` may make Raft calls to this node now
    /// (`forkless_raftnet::Admit`): one of the running cluster's nodes
    /// other than this one. A retired node that still runs gets no say in
    /// a group here, nor a node this node's file does not list (yet).
    pub fn admits_peer(&self, node: u64) -> Result<(), String> {
        let cluster = self.cluster.read().unwrap_or_else(|e| e.into_inner());
        let Some(r) = cluster.as_ref().and_then(|c| c.replication.as_ref()) else {
            return Err("this node replicates no shards".into());
        };
        let id = forkless_types::NodeId::new(node);
        if id == Some(self.cfg.node_id) {
            return Err(format!("node {node} is this node"));
        }
        if id.is_some_and(|id| r.raft_addrs.contains_key(&id)) {
            return Ok(());
        }
        if id.is_some_and(|id| r.retired.contains(&id)) {
            return Err(format!(
                "node {node} is retired (the cluster file's retired_nodes): it has no say in this node's groups"
            ));
        }
        Err(format!(
            "node {node} is not in this node's cluster file (if it was added, reload this node: SIGHUP or `forkless cluster reload`)"
        ))
    }
}

/// Logs each node the file retires that a group this node holds still
/// counts: it has no link to it here, so the group runs one replica short
/// until the replica is moved (`forkless cluster remove-node`).
fn warn_of_retired_members(app: &App, r: &config::Replicated) {
    for &id in &r.retired {
        if let Some(why) = reload::still_member(app, id) {
            tracing::warn!(
                retired = %id, groups = %why,
                "a node the cluster file retires still holds replicas: it is not reached from here; move them with `forkless cluster remove-node`"
            );
        }
    }
}

/// Refuses to start when the cluster file places a shard elsewhere than
/// this cluster made its group with (`placement`): as this node recorded
/// at its first start, or, when it has no record (a new node, a lost
/// disk), as any peer that answers recorded. Records the file's placement
/// when it has none and no peer's differs.
async fn check_placement(
    cfg: &ServerConfig,
    cluster: &config::ClusterConfig,
    r: &config::Replicated,
) -> Result<(), StartupError> {
    let refuse = |m: String| Err(StartupError::Config(config::ConfigError::Invalid(m)));
    let file = placement::Placement::of(r, cfg.shard_count);
    let here = format!(
        "this node's record ({})",
        placement::path(&cfg.data_dir).display()
    );
    if let Some(recorded) = placement::read(&cfg.data_dir).map_err(config::ConfigError::Invalid)? {
        if let Some(why) = placement::refused(&file, &recorded, &here) {
            return refuse(why);
        }
        return Ok(());
    }
    // No record: what the peers that answer recorded. A peer that does not
    // answer (down, or starting with this node in a new cluster) says
    // nothing.
    let forwarder = Arc::new(forward::Forwarder::new(
        cfg.peer.forward_connect_timeout(),
        &cluster.secret,
        cfg.limits.connections_max,
    ));
    let within = std::time::Duration::from_millis(cfg.peer.probe_timeout_ms.max(100));
    let mut asks = tokio::task::JoinSet::new();
    for n in cluster.nodes.iter().filter(|n| n.id != cfg.node_id) {
        let (forwarder, n) = (forwarder.clone(), n.clone());
        asks.spawn(async move {
            let answer = forwarder
                .probe(&n.peer_addr, "/api/cluster/placement", within)
                .await;
            (n, answer)
        });
    }
    let mut answered = 0;
    while let Some(done) = asks.join_next().await {
        let Ok((n, Ok(body))) = done else { continue };
        let Ok(theirs) = serde_json::from_slice::<placement::Placement>(&body) else {
            tracing::warn!(
                peer = n.id.get(),
                "a peer's placement answer is not one: not compared"
            );
            continue;
        };
        answered += 1;
        let source = format!("node {} (at {})", n.id, n.peer_addr);
        if let Some(why) = placement::refused(&file, &theirs, &source) {
            return refuse(why);
        }
    }
    placement::record(&cfg.data_dir, &file).map_err(config::ConfigError::Invalid)?;
    tracing::info!(
        peers_compared = answered,
        path = %placement::path(&cfg.data_dir).display(),
        "recorded the cluster file's placement of every shard's replicas: later starts keep to it"
    );
    Ok(())
}

/// How this node's shards reach their other replicas: the Raft transport
/// to every peer, and each shard's replicas as the cluster file places them.
fn store_replication(
    me: forkless_types::NodeId,
    r: &config::Replicated,
    hello: forkless_raftnet::Handshake,
    log: forkless_store::RaftLogLimits,
) -> Result<(forkless_store::Replication, forkless_raftnet::Links), forkless_store::StoreError> {
    let addrs: std::collections::BTreeMap<u64, String> = r
        .raft_addrs
        .iter()
        .map(|(id, a)| (u64::from(id.get()), a.to_string()))
        .collect();
    let placement = r.clone();
    let members = addrs.clone();
    let links = forkless_raftnet::Links::on(
        u64::from(me.get()),
        hello,
        addrs,
        Some(forkless_store::raft_runtime()?),
    );
    let replication = forkless_store::Replication {
        me: u64::from(me.get()),
        members: Arc::new(move |shard| {
            placement
                .replicas(shard)
                .into_iter()
                .map(|n| {
                    let id = u64::from(n.get());
                    let addr = members.get(&id).cloned().unwrap_or_default();
                    (id, forkless_store::BasicNode::new(addr))
                })
                .collect()
        }),
        timing: r.timing,
        log,
        peers: Arc::new(links.clone()),
        draining: Default::default(),
        beat_now: Default::default(),
    };
    Ok((replication, links))
}

/// How many shards this node holds, as far as it can tell at start: a
/// replica of each its placement names or that its data directory has (a
/// replica a move gave it), or each it owns or has; and on a replicated
/// node at least its even share of the cluster's replicas, since a node
/// added to a running cluster starts with none and is given them by moves
/// (`docs/replication.md`). What the node's default block caches and Raft
/// logs' memory are shared by ([`config::StoreSettings::cache_bytes_per_shard_for`],
/// [`config::Replicated::log_for`]); counted once, at start.
fn shards_held(
    cfg: &ServerConfig,
    replicated: Option<&config::Replicated>,
    dir: &StaticDirectory,
) -> usize {
    let n = cfg.shard_count.get();
    // Unreadable here, it fails the store's open just after, with why.
    let on_disk: std::collections::BTreeSet<ShardId> =
        Store::shards_in(&cfg.data_dir, cfg.shard_count)
            .unwrap_or_default()
            .into_iter()
            .collect();
    let held = (0..n)
        .map(ShardId)
        .filter(|s| {
            on_disk.contains(s)
                || match replicated {
                    Some(r) => r.replicas(*s).contains(&cfg.node_id),
                    None => matches!(dir.owner_of(*s), forkless_routing::Owner::Local { .. }),
                }
        })
        .count();
    let nodes = cfg.cluster.as_ref().map_or(1, |c| c.nodes.len().max(1));
    let even = replicated.map_or(0, |r| (n as usize * r.factor).div_ceil(nodes));
    held.max(even)
}

/// Keeps the directory's owner of each replicated shard this node holds a
/// replica of at its group's leader (the higher term wins), and logs every
/// change of leader, until the node stops; a group that stopped is
/// followed again once the store's supervisor restarted it.
async fn follow_leaders(app: Arc<App>, mut stop: tokio::sync::watch::Receiver<bool>) {
    let mut tasks = tokio::task::JoinSet::new();
    let mut followed = std::collections::BTreeSet::new();
    loop {
        // A replica opened since (one a membership change added here) is
        // followed from the next look, within a second.
        for st in app.store.hosted() {
            if st.is_replicated() && followed.insert(st.id()) {
                follow_shard(&mut tasks, app.clone(), st.id());
            }
        }
        tokio::select! {
            _ = stop.wait_for(|s| *s) => break,
            _ = tokio::time::sleep(std::time::Duration::from_secs(1)) => {}
        }
    }
    tasks.abort_all();
}

/// A peer's heartbeat says it leads each of `led` (shard, term): the
/// directory routes the shard to it from then on, unless it knows a later
/// term (a beat sent before a newer election changes nothing).
fn told_led(app: &App, peer: u64, led: &[(u32, u64)]) {
    let Some(node) = forkless_types::NodeId::new(peer) else {
        return;
    };
    for &(shard, term) in led {
        let shard = ShardId(shard);
        let known = app.dir.assignment(shard);
        if known.is_none_or(|a| a.epoch.get() >= term) {
            continue;
        }
        if app.observe(shard, node, forkless_types::Epoch(term))
            == forkless_routing::Observation::Moved
        {
            tracing::info!(
                shard = shard.get(),
                leader = peer,
                term,
                "shard leader known (its node said so)"
            );
        }
    }
}

/// Spawns the task that follows `shard`'s leader (`follow_leaders`).
fn follow_shard(tasks: &mut tokio::task::JoinSet<()>, app: Arc<App>, shard: ShardId) {
    tasks.spawn(async move {
        let mut seen = None;
        loop {
            // The shard as it is now: absent or stopped while the
            // supervisor restarts it (looked at again every 200 ms).
            let watch = app
                .store
                .shard(shard)
                .filter(|st| st.group_stopped().is_none())
                .and_then(|st| st.raft_watch());
            match watch {
                Some(watch) => follow_leader(&app, shard, watch, &mut seen).await,
                None => tokio::time::sleep(std::time::Duration::from_millis(200)).await,
            }
        }
    });
}

/// Follows one group's leader (see `follow_leaders`) until the group stops.
async fn follow_leader(
    app: &App,
    shard: ShardId,
    mut watch: forkless_store::RaftWatch,
    seen: &mut Option<(Option<u64>, u64)>,
) {
    let mut now = Some(watch.now());
    while let Some(l) = now {
        if *seen != Some((l.leader, l.term)) {
            *seen = Some((l.leader, l.term));
            match l.leader.and_then(forkless_types::NodeId::new) {
                Some(leader) => {
                    app.observe(shard, leader, forkless_types::Epoch(l.term));
                    app.metrics
                        .raft_leader_changes
                        .get_or_create(&crate::metrics::ShardLabel { shard: shard.get() })
                        .inc();
                    tracing::info!(
                        shard = shard.get(),
                        leader = l.leader,
                        term = l.term,
                        this_node_leads = l.this_node_leads(),
                        "shard leader known"
                    );
                }
                None => tracing::info!(
                    shard = shard.get(),
                    term = l.term,
                    "shard has no leader (an election is under way)"
                ),
            }
        }
        now = watch.changed().await;
    }
}

/// Warns when a cluster of `nodes` nodes leaves each node a share of one
/// connection of each peer's (`limits.connections_max` under four a
/// peer): it then forwards no long-poll or replica move (at start, and at
/// a reload that adds nodes).
pub(crate) fn warn_if_share_of_one(connections_max: usize, nodes: usize) {
    let peers = nodes.saturating_sub(1);
    if peers > 0 && forward::share(connections_max, peers).waiting == 0 {
        tracing::warn!(
            connections_max,
            peers,
            "limits.connections_max is under 4 connections a peer: this node forwards to each peer on one connection and forwards no long-poll or replica move (503 too_many_forwards); raise it to at least {}",
            4 * peers
        );
    }
}

/// Runs the node until it is asked to stop: the client listener, the
/// peer listener (if distinct) and the peer prober. `stops` is called once
/// the node serves (a request to stop before then is the caller's to
/// handle: `forkless serve` leaves SIGTERM's default action until then),
/// and each message on the channel it returns is one request to stop
/// (SIGTERM or Ctrl-C). At the first, the node stops being ready and a
/// replicated node hands the leadership of the shards it leads to other
/// replicas, waiting at most [`forkless_raftnet::balance::DRAIN_WITHIN`]
/// (a second request ends the wait); then it stops taking connections and
/// finishes the requests in flight. The channel closed counts as no
/// request.
pub async fn run(
    cfg: ServerConfig,
    reload: Option<reload::Reload>,
    stops: impl FnOnce() -> tokio::sync::mpsc::Receiver<()>,
) -> Result<(), StartupError> {
    // First of all: SIGHUP's default action ends the process, and a
    // service manager's `reload` may send it while the node starts (the
    // placement check, the store's open) or to a node with nothing to
    // read again. Taken now, a SIGHUP during the start is answered once
    // the node serves.
    #[cfg(unix)]
    let hangups = reload::take_hangups();
    // Before the store opens anything: the connections' descriptors plus
    // the store's reserve must fit, so that no connection can take the
    // descriptor a shard's log rotation needs.
    let fd_limit = config::reserve_file_descriptors(cfg.connection_fds())?;
    tracing::info!(
        open_file_limit = fd_limit,
        connections_max = cfg.limits.connections_max,
        reserved_for_store = config::FD_RESERVE,
        "file descriptors"
    );
    if let Some(c) = &cfg.cluster {
        warn_if_share_of_one(cfg.limits.connections_max, c.nodes.len());
    }
    let app = App::open(cfg, reload, fd_limit).await?;
    let bind = |addr: std::net::SocketAddr| async move {
        tokio::net::TcpListener::bind(addr)
            .await
            .map_err(|e| StartupError::Bind {
                addr: addr.to_string(),
                reason: e.to_string(),
            })
    };
    let api_listener = bind(app.cfg.listen).await?;
    let peer_listener = match app.cfg.peer_listen {
        Some(a) => Some(bind(a).await?),
        None => None,
    };
    let raft_listener = match app
        .cfg
        .cluster
        .as_ref()
        .and_then(|c| c.replication.as_ref())
        .and_then(|r| r.raft_addrs.get(&app.cfg.node_id))
    {
        Some(a) => Some(bind(*a).await?),
        None => None,
    };
    let (stop_tx, stop_rx) = tokio::sync::watch::channel(false);
    // Turns true once the listeners have stopped and every request in
    // flight was answered: the Raft transport and the node heartbeat run
    // until then, so a write this node proposed while it led (its entry
    // committed by the leader it handed the shard to) hears that it was
    // applied, instead of waiting out its write timeout.
    let (raft_stop_tx, raft_stop_rx) = tokio::sync::watch::channel(false);
    // Turns true as the node starts shutting down, before it stops: what
    // must not outlive the leaderships' handover (the leader balancer).
    let (draining_tx, draining_rx) = tokio::sync::watch::channel(false);
    let service = api::service(app.clone());
    let mut tasks = Vec::new();
    for (listener, which) in std::iter::once((api_listener, Listener::Api))
        .chain(peer_listener.map(|l| (l, Listener::Peer)))
    {
        tasks.push(tokio::spawn(accept_loop(
            app.clone(),
            listener,
            which,
            service.clone(),
            stop_rx.clone(),
        )));
    }
    if let Some(listener) = raft_listener {
        let store = app.store.clone();
        let groups: forkless_raftnet::Groups = Arc::new(move |g| store.shard(ShardId(g)));
        // A leader that replicates to this node a shard it holds no
        // replica of (a membership change added it, or its data
        // directory was lost) has it opened: the group, never initialized
        // here, learns its membership from that leader.
        let join: Option<forkless_raftnet::Join> = app.replication.as_ref().map(|_| {
            let store = app.store.clone();
            let shards = app.dir.shard_count().get();
            let join: forkless_raftnet::Join = Arc::new(move |g| {
                // (A peer's call naming a group past the shard count names
                // no shard: nothing to open, nothing to warn of.)
                if g >= shards {
                    return None;
                }
                // A shard out of service here (damage found at open) stays
                // so: reported once by the store, not reopened at every
                // call of its leader.
                if store.failure(ShardId(g)).is_some() {
                    return None;
                }
                match store.open_shard(ShardId(g), forkless_types::Epoch(1)) {
                    Ok(st) => Some(st),
                    Err(e) => {
                        tracing::warn!(shard = g, error = %e, "could not open a replica a leader replicates to");
                        None
                    }
                }
            });
            join
        });
        // On the groups' runtime, as the connections to peers are: a
        // call goes from the socket to its group's openraft task, and its
        // answer back, without waking this runtime's threads.
        let raft_rt = forkless_store::raft_runtime()?;
        let addr = listener
            .local_addr()
            .map_or_else(|_| "the Raft address".into(), |a| a.to_string());
        let moved = listener.into_std().and_then(|l| {
            let _on = raft_rt.enter();
            tokio::net::TcpListener::from_std(l)
        });
        let listener = moved.map_err(|e| StartupError::Bind {
            addr,
            reason: format!("moving the listener to the groups' runtime: {e}"),
        })?;
        let admit: forkless_raftnet::Admit = {
            let app = app.clone();
            Arc::new(move |node| app.admits_peer(node))
        };
        // What its peers say at hello is checked against what this node
        // says to them: the secret, and its groups' placement.
        let hello = app.links.as_ref().map_or_else(
            || forkless_raftnet::Handshake::secret(app.secret.clone()),
            forkless_raftnet::Links::handshake,
        );
        // A peer's heartbeat names the groups it leads: a node learns so
        // the leaders of the shards it holds no replica of within a round
        // trip of their election (a new leader's node beats at once),
        // not at its next probe.
        let told: forkless_raftnet::Told = {
            let app = app.clone();
            Arc::new(move |peer, led| told_led(&app, peer, led))
        };
        let hooks = forkless_raftnet::Hooks {
            join,
            told: Some(told),
        };
        raft_rt.spawn(forkless_raftnet::serve_node(
            listener,
            hello,
            groups,
            hooks,
            admit,
            raft_stop_rx.clone(),
        ));
        tokio::spawn(follow_leaders(app.clone(), raft_stop_rx.clone()));
        if let (Some(rep), Some(links)) = (&app.replication, app.links.clone()) {
            // Asked every beat: a node a reload added is beaten from then on.
            let peer_ids: forkless_raftnet::quiesce::PeerIds = Arc::new(move || links.peer_ids());
            let store = app.store.clone();
            let shards: forkless_raftnet::Hosted = Arc::new(move || {
                store
                    .hosted()
                    .into_iter()
                    .filter(|st| st.is_replicated())
                    .collect()
            });
            let heard = Arc::new(forkless_raftnet::quiesce::PeersHeard::default());
            tokio::spawn(forkless_raftnet::quiesce::run(
                rep.peers.clone(),
                peer_ids,
                shards.clone(),
                rep.timing,
                heard.clone(),
                rep.beat_now.clone(),
                raft_stop_rx.clone(),
            ));
            {
                // A shard's preferred leader is the first replica its
                // placement names (spread evenly over the nodes), or the
                // replica that took its place (`balance::preferred_replica`).
                // The placement as the node runs it: a reload may reorder
                // a pin's replicas (the same set), which moves the shard's
                // preferred leader.
                let running = app.clone();
                let placed: Arc<dyn Fn(ShardId) -> Vec<u64> + Send + Sync> =
                    Arc::new(move |shard| running.placed(shard));
                let drains = forkless_raftnet::balance::DrainState {
                    on: rep.draining.clone(),
                    runs: Arc::default(),
                    beat_now: rep.beat_now.clone(),
                };
                let _ = app.drainer.set(Drain {
                    shards: shards.clone(),
                    placed: placed.clone(),
                    heard: heard.clone(),
                    rep: rep.clone(),
                    runs: drains.runs.clone(),
                    one_at_a_time: tokio::sync::Mutex::new(()),
                });
                tokio::spawn(forkless_raftnet::balance::run(
                    shards,
                    placed,
                    heard,
                    rep.peers.clone(),
                    forkless_raftnet::balance::Settings {
                        timing: rep.timing,
                        learners_kept: app
                            .cfg
                            .cluster
                            .as_ref()
                            .and_then(|c| c.replication.as_ref())
                            .map_or(
                                std::time::Duration::from_secs(crate::config::LEARNER_KEPT_S),
                                |r| r.learner_kept,
                            ),
                    },
                    drains,
                    draining_rx.clone(),
                ));
            }
        }
    }
    {
        let app = app.clone();
        let mut stops = stops();
        tokio::spawn(async move {
            if stops.recv().await.is_none() {
                // No request to stop will come: the node runs on (the
                // senders below, dropped, would stop it).
                std::future::pending::<()>().await;
            }
            app.leaving.store(true, Ordering::SeqCst);
            let _ = draining_tx.send(true);
            if let Some(d) = app.drainer.get() {
                // A second request to stop ends the wait; the channel
                // closed does not.
                let again = async {
                    if stops.recv().await.is_none() {
                        std::future::pending::<()>().await;
                    }
                };
                tokio::select! {
                    _ = d.run(forkless_raftnet::balance::Why::Stop) => {}
                    () = again => tracing::warn!(
                        "asked again to stop: stopping without waiting for the leaderships' handover"
                    ),
                }
            }
            tracing::info!("shutting down: finishing requests in flight");
            app.stopping.send_replace(true);
            let _ = stop_tx.send(true);
        });
    }
    #[cfg(unix)]
    if let Some(hangups) = hangups {
        tokio::spawn(reload::on_hangup(app.clone(), hangups, stop_rx.clone()));
    }
    if app.cfg.cluster.is_some() {
        // Ready once its first round of probes has completed (at once
        // with no peer yet: a cluster of one probes the nodes a reload
        // adds).
        tokio::spawn(peer::probe_loop(app.clone(), stop_rx.clone()));
    } else {
        app.ready.store(true, Ordering::Release);
    }
    tracing::info!(
        node = %app.cfg.node_id, listen = %app.cfg.listen, peer = ?app.cfg.peer_listen,
        shards = app.cfg.shard_count.get(), data_dir = %app.cfg.data_dir.display(),
        owned = ?(0..app.cfg.shard_count.get()).filter(|s| app.dir.owns(ShardId(*s))).collect::<Vec<_>>(),
        "forkless node serving"
    );
    for t in tasks {
        if let Err(e) = t.await {
            tracing::error!(error = %e, "listener task failed");
        }
    }
    let _ = raft_stop_tx.send(true);
    tracing::info!("forkless node stopped");
    Ok(())
}

/// What a replicated node needs to hand its leaderships over: as it
/// shuts down, and when an operator drains it.
pub struct Drain {
    shards: forkless_raftnet::Hosted,
    /// Each shard's replicas as the node runs its placement (the first
    /// preferred).
    placed: Arc<dyn Fn(ShardId) -> Vec<u64> + Send + Sync>,
    heard: Arc<forkless_raftnet::quiesce::PeersHeard>,
    rep: forkless_store::Replication,
    /// The drains started, for the balancer (`balance::DrainState`).
    runs: Arc<std::sync::atomic::AtomicU64>,
    /// One drain at a time (two at once could hand one shard to two
    /// replicas): a second waits for the first, then finds what is left.
    one_at_a_time: tokio::sync::Mutex<()>,
}

impl Drain {
    /// Its replicas take no leadership from now on, and every shard it
    /// leads is handed to another replica (`forkless_raftnet::balance::drain`).
    /// `why` says what its log lines start with.
    async fn run(
        &self,
        why: forkless_raftnet::balance::Why,
    ) -> (forkless_raftnet::balance::Drained, u64) {
        let _alone = self.one_at_a_time.lock().await;
        // SeqCst, as `undo`'s check of `App::leaving` is: a stop and an
        // undrain at once leave the node draining.
        self.rep.draining.store(true, Ordering::SeqCst);
        // The balancer hands over nothing of its own until this drain's
        // handovers are done.
        self.runs.fetch_add(1, Ordering::SeqCst);
        let shards = (self.shards)();
        let within = forkless_raftnet::balance::DRAIN_WITHIN;
        let label = why.label();
        // (A stop's line says how to skip the wait, as it said before
        // drains shared it.)
        let skip = if why == forkless_raftnet::balance::Why::Stop {
            " (stop again to skip)"
        } else {
            ""
        };
        tracing::info!(
            within_ms = within.as_millis() as u64,
            "{label}: handing the leadership of the shards this node leads to other replicas{skip}"
        );
        let started = std::time::Instant::now();
        let done = forkless_raftnet::balance::drain(
            why,
            shards,
            self.placed.as_ref(),
            self.heard.clone(),
            &self.rep.beat_now,
            self.rep.peers.as_ref(),
            self.rep.timing,
            within,
        )
        .await;
        let took_ms = started.elapsed().as_millis() as u64;
        tracing::info!(
            handed = done.handed,
            not_taken = done.not_taken,
            no_replica = done.no_replica,
            took_ms,
            "{label}: leaderships handed over"
        );
        (done, took_ms)
    }

    /// An operator drains the node: its replicas take no leadership until
    /// [`Drain::undo`], and the shards it leads are handed over now.
    pub async fn drain(&self) -> (forkless_raftnet::balance::Drained, u64) {
        self.run(forkless_raftnet::balance::Why::Drain).await
    }

    /// The node takes leaderships again (its balancer's peers hand it its
    /// preferred shards back, and its replicas stand for election). Not
    /// once it is stopping.
    pub fn undo(&self) {
        self.rep.draining.store(false, Ordering::SeqCst);
        tracing::info!("undrained: this node's replicas take leaderships again");
    }

    /// Takes no leadership again, handing nothing over (a stop that came
    /// as [`Drain::undo`] ran hands over on its own).
    pub fn redo(&self) {
        self.rep.draining.store(true, Ordering::SeqCst);
    }

    /// Whether the node takes no leadership now (drained, or stopping).
    pub fn draining(&self) -> bool {
        self.rep.draining.load(Ordering::Acquire)
    }
}

/// Accepts connections until `stop`, then waits for every connection it
/// accepted to finish (idle ones close at once; a request in progress is
/// answered first, and a client that does not take its answer is dropped
/// after [`conn::SHUTDOWN_WRITE_GRACE`]). A connection over
/// `limits.connections_max` is answered 503 and closed at once.
async fn accept_loop<S>(
    app: Arc<App>,
    listener: tokio::net::TcpListener,
    which: Listener,
    service: S,
    stop: tokio::sync::watch::Receiver<bool>,
) where
    S: tower::Service<
            axum::extract::Request,
            Response = axum::response::Response,
            Error = std::convert::Infallible,
        > + Clone
        + Send
        + 'static,
    S::Future: Send + 'static,
{
    // Every connection holds a sender; recv() ends when all are dropped.
    let (open_tx, mut open_rx) = tokio::sync::mpsc::channel::<()>(1);
    let mut stopping = stop.clone();
    loop {
        let accepted = tokio::select! {
            r = listener.accept() => r,
            _ = stopping.wait_for(|s| *s) => break,
        };
        match accepted {
            Ok((tcp, _peer)) => {
                let _ = tcp.set_nodelay(true);
                let Some(slot) = ConnectionSlot::take(&app, which) else {
                    refuse_connection(&app, tcp, which);
                    continue;
                };
                let open = open_tx.clone();
                let (app, service, stop) = (app.clone(), service.clone(), stop.clone());
                tokio::spawn(async move {
                    conn::serve(app, tcp, service, stop, which as usize).await;
                    drop(slot);
                    drop(open);
                });
            }
            // The client gave up before it was accepted: nothing to do.
            Err(e) if is_connection_error(&e) => {}
            // Out of file descriptors or memory: wait for some to be freed
            // rather than spin.
            Err(e) => {
                tracing::error!(error = %e, "accepting a connection failed; retrying in 1 s");
                tokio::time::sleep(std::time::Duration::from_secs(1)).await;
            }
        }
    }
    drop(listener);
    drop(open_tx);
    let _ = open_rx.recv().await;
}

/// Which listener a connection came in on.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Listener {
    /// The client API address (also the peers', when they share it).
    Api = 0,
    /// The peer address, when it is a listener of its own.
    Peer = 1,
}

impl Listener {
    fn what(self) -> &'static str {
        match self {
            Listener::Api => "client",
            Listener::Peer => "peer",
        }
    }
}

/// One open connection counted in [`App::connections`] until dropped.
struct ConnectionSlot(Arc<App>, Listener);

impl ConnectionSlot {
    fn take(app: &Arc<App>, which: Listener) -> Option<ConnectionSlot> {
        let max = app.cfg.limits.connections_max;
        let taken = app.connections[which as usize]
            .fetch_update(Ordering::AcqRel, Ordering::Acquire, |n| {
                (n < max).then_some(n + 1)
            })
            .is_ok();
        if !taken {
            return None;
        }
        app.metrics.connections_open.inc();
        Some(ConnectionSlot(app.clone(), which))
    }
}

impl Drop for ConnectionSlot {
    fn drop(&mut self) {
        self.0.connections[self.1 as usize].fetch_sub(1, Ordering::AcqRel);
        self.0.metrics.connections_open.dec();
    }
}

/// Answers a connection over `limits.connections_max` with a 503 (if the
/// socket takes it at once: a fresh socket always has room for it) and
/// closes it, never waiting on the client.
fn refuse_connection(app: &App, tcp: tokio::net::TcpStream, which: Listener) {
    app.metrics.connections_refused.inc();
    app.metrics.response(503);
    let body = format!(
        "{{\"error\":\"too_many_connections\",\"message\":\"this node has {} {} connections open, its limit (limits.connections_max); nothing was read of the request, retry later\",\"limit\":{},\"executed\":false}}",
        app.cfg.limits.connections_max,
        which.what(),
        app.cfg.limits.connections_max
    );
    let answer = format!(
        "HTTP/1.1 503 Service Unavailable\r\ncontent-type: application/json\r\nretry-after: 1\r\nconnection: close\r\n{}: {}\r\ncontent-length: {}\r\n\r\n{body}",
        NODE_HEADER,
        app.cfg.node_id.get(),
        body.len()
    );
    let _ = tcp.try_write(answer.as_bytes());
    tracing::debug!(
        limit = app.cfg.limits.connections_max,
        "refused a connection over limits.connections_max"
    );
    // Dropped: closed.
}

fn is_connection_error(e: &std::io::Error) -> bool {
    use std::io::ErrorKind::*;
    matches!(
        e.kind(),
        ConnectionRefused | ConnectionAborted | ConnectionReset
    )
}

#[cfg(test)]
mod tests {
    use super::ReplicasHeard;

    /// Node 4's replica of a shard, holding the membership at log id
    /// `membership_log` with these voters.
    fn replica(voters: Vec<u64>, membership_log: (u64, u64)) -> forkless_store::RaftStatus {
        forkless_store::RaftStatus {
            me: 4,
            term: 4,
            state: "learner",
            voters,
            membership_log: Some(membership_log),
            ..Default::default()
        }
    }

    /// The leader's word: voters 1, 2, 3 from the entry at (4, 180).
    fn heard(committed: bool, voters: Vec<u64>, learners: Vec<u64>) -> ReplicasHeard {
        ReplicasHeard {
            from: 1,
            term: 4,
            voters,
            learners,
            membership_log: Some((4, 180)),
            committed,
        }
    }

    #[test]
    fn a_replica_is_left_behind_once_a_committed_membership_it_holds_or_is_behind_leaves_it_out() {
        let out = heard(true, vec![1, 2, 3], vec![]);
        // Removed before it took the entry that removes it (it holds the
        // joint configuration, which counts it).
        assert_eq!(
            out.leaves(4, Some(&replica(vec![1, 2, 3, 4], (4, 170)))),
            Some(true)
        );
        // Removed just after it took that entry: it holds the membership
        // that leaves it out (the fault suite's moves found this one
        // taken for a member, naming no leader for good).
        assert_eq!(
            out.leaves(4, Some(&replica(vec![1, 2, 3], (4, 180)))),
            Some(true)
        );
        // Not committed yet: a change under way is left as it is.
        let pending = heard(false, vec![1, 2, 3], vec![]);
        assert_eq!(
            pending.leaves(4, Some(&replica(vec![1, 2, 3, 4], (4, 170)))),
            None
        );
        // An older word than the replica's own membership: as it is.
        assert_eq!(
            out.leaves(4, Some(&replica(vec![1, 2, 3, 4], (5, 190)))),
            None
        );
        // Counted, as a voter or a learner, or no replica here.
        let counted = heard(true, vec![1, 2, 4], vec![]);
        assert_eq!(
            counted.leaves(4, Some(&replica(vec![1, 2, 3], (4, 170)))),
            Some(false)
        );
        let learner = heard(true, vec![1, 2, 3], vec![4]);
        assert_eq!(
            learner.leaves(4, Some(&replica(vec![1, 2, 3], (4, 180)))),
            Some(false)
        );
        assert_eq!(out.leaves(4, None), Some(false));
    }
}
