//! Peers: the internal status endpoint and the prober that keeps liveness
//! and learned epochs up to date.
//!
//! Each node probes every peer every `probe_interval_ms`. A peer that has
//! answered once and then does not answer within `probe_timeout_ms` is
//! believed down, and its shards resolve `Unknown` (requests for them fail
//! closed at once instead of waiting for a forward timeout); a peer that
//! has never answered is not believed down, and is tried. The node says
//! it is ready (`/readyz`) once its first round has completed: every peer
//! answered or timed out. A peer's answer lists the shards it owns
//! and their epochs; an epoch newer than this node's map moves the map, and
//! fences this node's own copy of that shard, if it has one.

use crate::headers::peer_authenticated;
use crate::App;
use axum::extract::State;
use axum::http::{HeaderMap, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::Json;
use forkless_routing::{Directory, Observation, PeerState};
use forkless_types::{Epoch, NodeId, ShardId};
use serde::Deserialize;
use serde_json::json;
use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::Duration;

pub async fn status(State(app): State<Arc<App>>, headers: HeaderMap) -> Response {
    if !peer_authenticated(&app.secret, &headers) {
        return (
            StatusCode::FORBIDDEN,
            Json(json!({"error": "forbidden", "message": "peer credentials required"})),
        )
            .into_response();
    }
    let me = u64::from(app.cfg.node_id.get());
    let shards: Vec<_> = app
        .dir
        .claimed()
        .into_iter()
        .map(|(s, e)| {
            let mut o = json!({"shard": s.get(), "epoch": e.get()});
            // A replicated shard this node leads at that term: its voters,
            // so that a node holding no replica of it shows them.
            let replicated = app.store.shard(s).filter(|st| st.is_replicated());
            if let Some(g) = replicated.and_then(|st| st.raft_status()) {
                if g.leader == Some(me) && g.term == e.get() && !g.voters.is_empty() {
                    o["voters"] = json!(g.voters);
                    o["learners"] = json!(g.learners);
                    o["membership_log"] = json!(g.membership_log);
                    o["membership_committed"] = json!(g.membership_committed);
                }
            }
            o
        })
        .collect();
    Json(json!({
        "node": app.cfg.node_id.get(),
        "map_version": app.dir.map_version(),
        "owned": shards,
        "nodes": node_ids(&app),
        "placement": placement_fingerprint(&app),
        // Takes no leadership (drained by an operator, or stopping).
        "draining": app.drainer.get().is_some_and(|d| d.draining()),
        // What its peers' shares of its connections assume it runs with.
        "connections_max": app.cfg.limits.connections_max,
    }))
    .into_response()
}

/// The ids of the nodes a node runs with, in order: what a peer's
/// answer is compared by. Ids only: peers may reach one node at different
/// addresses (through a proxy, say), and a node whose address a peer did
/// not take shows as down there anyway.
fn node_ids(app: &App) -> Vec<u16> {
    app.dir.nodes().iter().map(|n| n.id.get()).collect()
}

/// The fingerprint of the placement this node's groups were made with
/// (`placement::Placement::fingerprint`, as its Raft transport says it at
/// hello), in hex; `None` in a cluster that does not replicate.
fn placement_fingerprint(app: &App) -> Option<String> {
    app.links
        .as_ref()
        .map(|l| format!("{:016x}", l.handshake().placement))
}

/// Whether peer `node`'s groups were made with the placement this node's
/// were (`theirs` and `mine` their fingerprints), recording it and logging
/// when that changes. A peer placed otherwise skipped the start-up check
/// (its record deleted by hand, every peer down when it started without
/// one): its Raft calls are refused at hello, and what it says it leads is
/// not taken either, or this node would route writes to a second group of
/// a shard, which such a node and another like it can make (a fork).
fn compare_placements(app: &App, node: NodeId, theirs: &str, mine: &str) -> bool {
    let same = theirs == mine;
    if record_sameness(&app.same_placement, node, same) {
        if same {
            tracing::info!(peer = %node, "peer's groups were made with the same placement as this node's again");
        } else {
            tracing::warn!(
                peer = %node, theirs, ours = mine,
                "peer's groups were made with another placement than this node's (its cluster file places some shard on other nodes, and it did not start on this cluster's record): what it says it leads is not taken, and its Raft calls are refused; compare `forkless cluster placement` on both nodes"
            );
        }
    }
    same
}

#[derive(Deserialize)]
struct PeerStatus {
    node: u16,
    owned: Vec<OwnedShard>,
    /// The fingerprint of the placement the peer's groups were made with
    /// (absent from an older build's answer, and in a cluster that does
    /// not replicate).
    #[serde(default)]
    placement: Option<String>,
    /// The ids of the nodes the peer runs with (absent from an older
    /// build's answer).
    #[serde(default)]
    nodes: Option<Vec<u16>>,
    /// The peer is drained or stopping: it takes no leadership (absent
    /// from an older build's answer).
    #[serde(default)]
    draining: Option<bool>,
    /// The peer's `limits.connections_max` (absent from an older build's
    /// answer).
    #[serde(default)]
    connections_max: Option<usize>,
}

/// Records whether peer `node` runs with the same node ids as this node
/// (the file, as each last read it), logging when that changes: a node
/// the operator did not reload after editing the files.
fn compare_node_lists(app: &App, node: NodeId, theirs: &[u16], mine: &[u16]) {
    let same = theirs == mine;
    if record_sameness(&app.same_nodes, node, same) {
        if same {
            tracing::info!(peer = %node, "peer runs with the same node list as this node again");
        } else {
            tracing::warn!(
                peer = %node, theirs = ?theirs, ours = ?mine,
                "peer runs with another node list than this node: a cluster file edited and not reloaded everywhere? (`forkless cluster reload`)"
            );
        }
    }
}

/// Records whether peer `node` runs with this node's
/// `limits.connections_max` (`theirs`), logging when that changes. Each
/// node forwards to a peer within a share of that peer's connections
/// reckoned with the lower of the two values (`forward::share`), so a
/// node with the higher one forwards less to its peers than they could
/// take, and the numbers its operator reads (the shares, the descriptor
/// check) are not the ones in force.
fn compare_connections_max(app: &App, node: NodeId, theirs: usize) {
    let mine = app.cfg.limits.connections_max;
    if record_sameness(&app.same_connections_max, node, theirs == mine) {
        if theirs == mine {
            tracing::info!(peer = %node, "peer runs with the same limits.connections_max as this node again");
        } else {
            tracing::warn!(
                peer = %node, theirs, ours = mine,
                "peer runs with another limits.connections_max than this node: the two forward to each other within shares reckoned with the lower value; set the same one on every node (the cluster file's [limits])"
            );
        }
    }
}

/// Records whether peer `node` said it is drained (`None`: an older build
/// that does not say), logging when that changes.
fn record_drained(app: &App, node: NodeId, draining: Option<bool>) {
    let mut seen = app.drained_peers.lock().unwrap_or_else(|e| e.into_inner());
    let before = match draining {
        Some(d) => seen.insert(node.get(), d),
        None => seen.remove(&node.get()),
    };
    match (before, draining) {
        (Some(false) | None, Some(true)) => {
            tracing::info!(peer = %node, "peer is drained: it takes no leadership")
        }
        (Some(true), Some(false)) => {
            tracing::info!(peer = %node, "peer is no longer drained")
        }
        _ => {}
    }
}

/// Records in `seen` whether peer `node` agrees with this node on one
/// thing (`same`: its node list, its placement), and says whether that is
/// worth a log line: a change, or a first answer that differs.
fn record_sameness(
    seen: &std::sync::Mutex<std::collections::HashMap<u16, bool>>,
    node: NodeId,
    same: bool,
) -> bool {
    let before = seen
        .lock()
        .unwrap_or_else(|e| e.into_inner())
        .insert(node.get(), same);
    before != Some(same) && (before.is_some() || !same)
}

/// Drops what this node reports of peer `node` (its `forkless_peer_up`
/// gauge, whether it runs with the same node list and placement, and
/// whether it said it is drained): it retired.
pub(crate) fn forget_peer(app: &App, node: NodeId) {
    app.metrics
        .peer_up
        .remove(&crate::metrics::NodeLabel { node: node.get() });
    for seen in [
        &app.same_nodes,
        &app.same_placement,
        &app.drained_peers,
        &app.same_connections_max,
    ] {
        seen.lock()
            .unwrap_or_else(|e| e.into_inner())
            .remove(&node.get());
    }
}

#[derive(Deserialize)]
struct OwnedShard {
    shard: u32,
    epoch: u64,
    /// The shard's voters, when the peer leads its group at `epoch`, and
    /// the log id (term, index) of the entry they are from.
    #[serde(default)]
    voters: Option<Vec<u64>>,
    #[serde(default)]
    learners: Vec<u64>,
    #[serde(default)]
    membership_log: Option<(u64, u64)>,
    /// Whether that membership is committed on the leader (left out by
    /// an older node: taken as not).
    #[serde(default)]
    membership_committed: bool,
}

pub async fn probe_loop(app: Arc<App>, mut stop: tokio::sync::watch::Receiver<bool>) {
    let interval = Duration::from_millis(app.cfg.peer.probe_interval_ms.max(10));
    let timeout = Duration::from_millis(app.cfg.peer.probe_timeout_ms.max(10));
    let mut ready = false;
    let mut ticker = tokio::time::interval(interval);
    ticker.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        tokio::select! {
            _ = ticker.tick() => {}
            _ = stop.wait_for(|s| *s) => return,
        }
        // Probe every peer at once: a paused peer must not delay news of
        // the others. The peers are read each round: a node a reload
        // added is probed from the next.
        let peers: Vec<_> = app
            .dir
            .nodes()
            .into_iter()
            .filter(|n| n.id != app.cfg.node_id)
            .collect();
        // Every answer of this round says its peer was alive after this.
        let asked = std::time::Instant::now();
        let mut probes = tokio::task::JoinSet::new();
        for p in &peers {
            let app = app.clone();
            let (id, addr) = (p.id, p.peer_addr.clone());
            probes.spawn(async move {
                let r = app
                    .forwarder
                    .probe(&addr, "/internal/v1/status", timeout)
                    .await;
                (id, addr, r)
            });
        }
        let mine = node_ids(&app);
        let placed = placement_fingerprint(&app);
        while let Some(Ok((node, addr, r))) = probes.join_next().await {
            let mut theirs = None;
            let alive = match r {
                Ok(body) => match serde_json::from_slice::<PeerStatus>(&body) {
                    Ok(st) if st.node == node.get() => {
                        let alike = match (&st.placement, &placed) {
                            (Some(theirs), Some(mine)) => {
                                compare_placements(&app, node, theirs, mine)
                            }
                            _ => true,
                        };
                        if alike {
                            learn(&app, node, &st).await;
                        }
                        theirs = st.nodes;
                        record_drained(&app, node, st.draining);
                        if let Some(max) = st.connections_max {
                            compare_connections_max(&app, node, max);
                            app.forwarder.peer_says(&addr, max);
                        }
                        true
                    }
                    _ => false,
                },
                Err(_) => false,
            };
            if app.dir.node(node).is_none() {
                // Retired while it was probed: no longer reported.
                continue;
            }
            if let Some(theirs) = &theirs {
                compare_node_lists(&app, node, theirs, &mine);
            }
            let (was, now) = app.dir.liveness().record_asked(node, alive, asked);
            if alive {
                app.peer_answered();
            }
            app.metrics
                .peer_up
                .get_or_create(&crate::metrics::NodeLabel { node: node.get() })
                .set(alive as i64);
            match (was, now) {
                (PeerState::Up, PeerState::Up) | (PeerState::Down, PeerState::Down) => {}
                (_, PeerState::Up) => tracing::info!(peer = %node, "peer is up"),
                (_, PeerState::Down) => {
                    tracing::warn!(peer = %node, "peer stopped answering probes; its shards fail closed until it returns")
                }
                (_, PeerState::NeverAnswered) if !ready => tracing::info!(
                    peer = %node,
                    "peer has not answered its first probe; requests for its shards are still tried until it has answered once"
                ),
                (_, PeerState::NeverAnswered) => {}
            }
        }
        // A peer a reload retired while the round ran may have had its
        // gauge and node-list entry put back above after the reload took
        // them away: they go now, and no later round probes it.
        for p in &peers {
            if app.dir.node(p.id).is_none() {
                forget_peer(&app, p.id);
            }
        }
        // One round done: every peer answered or timed out. Only now does
        // the node know its peers' liveness and the newer epochs they own
        // shards at, so only now is it ready.
        if !ready {
            ready = true;
            app.ready.store(true, Ordering::Release);
            tracing::info!(
                peers = peers.len(),
                "first probe round of every peer completed: ready"
            );
        }
    }
}

async fn learn(app: &App, node: NodeId, st: &PeerStatus) {
    for o in &st.owned {
        let shard = ShardId(o.shard);
        if o.shard >= app.dir.shard_count().get() {
            continue;
        }
        let epoch = Epoch(o.epoch);
        if let Some(voters) = o.voters.as_ref().filter(|v| !v.is_empty()) {
            let mut heard = app.replicas_heard.lock().unwrap_or_else(|e| e.into_inner());
            let before = heard.get(&o.shard).cloned();
            if before.as_ref().is_none_or(|h| h.term <= o.epoch) {
                let now = crate::ReplicasHeard {
                    from: node.get(),
                    term: o.epoch,
                    voters: voters.clone(),
                    learners: o.learners.clone(),
                    membership_log: o.membership_log,
                    committed: o.membership_committed,
                };
                // A replica here that the group's newer membership no
                // longer counts (this node was removed while it was
                // away, or it was the learner of a move that did not
                // finish, removed since): said when it is taken for left
                // behind, and when it is counted again; the data stays.
                let me = u64::from(app.cfg.node_id.get());
                if let Some(st) = app.store.shard(shard).filter(|st| st.is_replicated()) {
                    let local = st.raft_status();
                    // Its candidacies, refused, would wake the group's
                    // quiet leader about once an election timeout, for
                    // good: it stops standing once the membership that
                    // leaves it out is committed (until then the group
                    // may still need it to elect: a change cut short by
                    // its leader's death, this replica holding entries the
                    // others lack, can leave it the only one that can
                    // win), and stands again once an answer counts it.
                    // Otherwise (a change under way) it is left as it is.
                    let left = now.leaves(me, local.as_ref());
                    match left.map(|l| (l, st.set_left_group(l))) {
                        Some((true, true)) => tracing::warn!(
                            shard = o.shard,
                            leader = %node,
                            term = o.epoch,
                            voters = ?now.voters,
                            "this node holds a replica of a shard whose group no longer counts it (it was removed while away, or it was a learner a move left unfinished): the replica follows no group and stands for no election; its data stays until it is deleted by hand, or a move of the shard to this node takes it up again"
                        ),
                        Some((false, true)) => tracing::info!(
                            shard = o.shard,
                            leader = %node,
                            term = o.epoch,
                            "the shard's group counts this node's replica again: it stands for election again"
                        ),
                        _ => {}
                    }
                }
                heard.insert(o.shard, now);
            }
        }
        match app.observe(shard, node, epoch) {
            Observation::Moved => tracing::warn!(
                shard = o.shard, owner = %node, epoch = o.epoch,
                "learned a newer owner from a peer; this node's map was stale"
            ),
            Observation::Conflict => tracing::error!(
                shard = o.shard, peer = %node, epoch = o.epoch,
                "this node and a peer both own the shard at the same epoch (a config moved it without \
                 raising the epoch); failing closed for it until one of them is given a newer epoch"
            ),
            Observation::Unchanged => {}
        }
        // Whether or not the map moved just now: a copy of the shard hosted
        // here that is behind the owner's epoch is fenced at it.
        fence_hosted_copy(app, shard).await;
    }
}

/// If this node hosts a copy of `shard` but the map names another owner at
/// a newer epoch than the copy's, moves the copy's fence to that epoch
/// (durably): from then on a write carrying an older epoch is refused by
/// the store itself, even if this node is later restarted on a stale config.
pub async fn fence_hosted_copy(app: &App, shard: ShardId) {
    let (Some(local), Some(a)) = (app.store.shard(shard), app.dir.assignment(shard)) else {
        return;
    };
    // A replicated shard is fenced by its group's terms, not by epochs
    // learned from peers.
    if a.owner == app.cfg.node_id || local.epoch() >= a.epoch || local.is_replicated() {
        return;
    }
    match local.advance_epoch(a.epoch).await {
        Ok(_) => {
            tracing::warn!(shard = shard.get(), epoch = a.epoch.get(), owner = %a.owner, "fenced this node's copy of a shard owned elsewhere")
        }
        Err(e) => {
            tracing::error!(shard = shard.get(), error = %e, "could not fence the local copy of the shard")
        }
    }
}
