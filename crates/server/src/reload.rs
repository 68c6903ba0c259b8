//! Nodes added to, moved in and retired from a running cluster: `forkless
//! cluster reload` (`POST /api/cluster/reload`, or SIGHUP) reads the
//! cluster file again and takes the nodes it gained, a peer's new
//! addresses and the nodes it retired, with no restart.
//!
//! Every node knows its peers from its cluster file. Before this, a node
//! added to the file reached the running nodes only once each restarted on
//! it; in a three-node cluster with a dead node, restarting a live one to
//! add the dead one's replacement took every shard's quorum away for that
//! restart, in the very hour the cluster had no spare. Now an operator adds
//! the node to every node's file, reloads the running nodes (one request
//! each, in any order), starts the new node, and moves replicas to it
//! (`forkless cluster remove-node N --to M`).
//!
//! What a reload takes, and what it refuses, is [`plan`]: it adds nodes,
//! takes a peer's new addresses (a node restarted elsewhere with its
//! data), and retires a node listed in `retired_nodes` once no group this
//! node knows of counts it. A reload that would change what the running
//! groups were made with (the shard count, the replication factor, the
//! secret, the placement of any shard), drop a node without retiring it,
//! retire one that still holds replicas or take a retired id back is
//! refused whole, naming the field, and changes nothing: those are a
//! resize, a restart of every node, or a move. Other settings (limits,
//! timers, store settings, this node's own addresses) are left as they
//! run, and the answer names them as waiting for a restart.

use crate::config::{ClusterConfig, ConfigError, Replicated, ServerConfig};
use crate::placement::{self, Placement};
use forkless_routing::NodeInfo;
use forkless_types::NodeId;
use std::net::SocketAddr;
use std::sync::Arc;

/// Reads the cluster file again and resolves this node's config from it,
/// with the same command-line overrides as at start.
pub type Reload = Arc<dyn Fn() -> Result<ServerConfig, ConfigError> + Send + Sync>;

/// A node the file gained: its addresses, and its Raft address when the
/// cluster replicates.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Added {
    pub node: NodeInfo,
    pub raft_addr: Option<SocketAddr>,
}

/// What a reload does.
#[derive(Debug, Clone)]
pub struct Plan {
    pub added: Vec<Added>,
    /// Nodes that retired (`retired_nodes`), holding no replica this node
    /// knows of.
    pub removed: Vec<NodeId>,
    /// Peers whose addresses the file changed (a node restarted on
    /// another machine, or other ports): reached there from now on.
    pub moved: Vec<Added>,
    /// The cluster as it runs from now on: the running one with the added
    /// nodes (and the file's pins, which place every shard as before).
    pub cluster: ClusterConfig,
    /// Settings the file changed that take effect only at a restart.
    pub restart_needed: Vec<&'static str>,
}

/// Why a reload is refused: the file's field, and the reason.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Refused {
    pub field: String,
    pub reason: String,
}

fn refuse<T>(field: impl Into<String>, reason: impl Into<String>) -> Result<T, Refused> {
    Err(Refused {
        field: field.into(),
        reason: reason.into(),
    })
}

/// Whether this node's connections fit its open-file limit `fd_limit`
/// with the nodes of `cluster` (each peer adds Raft connections), as the
/// start checked them with the nodes it started with
/// (`config::check_fd_budget`): refused, naming `nodes`, when not.
pub fn check_fds(
    running: &ServerConfig,
    cluster: &ClusterConfig,
    fd_limit: u64,
) -> Result<(), Refused> {
    let mut next = running.clone();
    next.cluster = Some(cluster.clone());
    crate::config::check_fd_budget(next.connection_fds(), fd_limit).or_else(|e| {
        refuse(
            "nodes",
            format!(
                "with {} nodes, this node's connections would not fit its open-file limit: {e}",
                cluster.nodes.len()
            ),
        )
    })
}

/// What reloading `file` (the config the file resolves to now) does to a
/// node running `running` with the cluster `now` (the file it started
/// on, plus any nodes earlier reloads added and less those they
/// retired). `still_member` says why a node still holds a replica, as
/// this node knows (a group it is a voter or learner of), if it does.
pub fn plan(
    running: &ServerConfig,
    now: &ClusterConfig,
    file: &ServerConfig,
    still_member: &dyn Fn(NodeId) -> Option<String>,
) -> Result<Plan, Refused> {
    let Some(new) = &file.cluster else {
        return refuse(
            "nodes",
            format!(
                "the cluster file lists no [[nodes]] now, and this node runs in a cluster of {}",
                now.nodes.len()
            ),
        );
    };
    if file.shard_count != running.shard_count {
        return refuse(
            "shard_count",
            format!(
                "the file has {} shard(s) and this node runs {}: changing it is a resize, not a reload",
                file.shard_count.get(),
                running.shard_count.get()
            ),
        );
    }
    if new.secret != now.secret {
        return refuse(
            "secret",
            "differs from the one this node runs with: peers share one secret, changed by restarting every node",
        );
    }
    let factor = |c: &ClusterConfig| c.replication.as_ref().map_or(1, |r| r.factor);
    if factor(new) != factor(now) {
        return refuse(
            "replication_factor",
            format!(
                "the file has {} and this node runs {}: the replication factor of running groups is not changed by a reload",
                factor(new),
                factor(now)
            ),
        );
    }
    let raft_addr = |c: &ClusterConfig, id: NodeId| {
        c.replication
            .as_ref()
            .and_then(|r| r.raft_addrs.get(&id).copied())
    };
    let retired = |c: &ClusterConfig, id: NodeId| {
        c.replication
            .as_ref()
            .is_some_and(|r| r.retired.contains(&id))
    };
    let mut removed = Vec::new();
    let mut moved = Vec::new();
    let mut own_moved = false;
    for n in &now.nodes {
        let field = |f: &str| format!("nodes[id={}].{f}", n.id);
        let Some(m) = new.node(n.id) else {
            if new.replication.is_none() {
                return refuse(
                    field("id"),
                    format!(
                        "node {} is gone from the file: a static cluster's node leaves with a restart of every \
                         node on the new file, once [[shards]] gives its shards to other nodes",
                        n.id
                    ),
                );
            }
            if !retired(new, n.id) {
                return refuse(
                    field("id"),
                    format!(
                        "node {} is gone from the file and not in retired_nodes: a node leaves the cluster by \
                         retiring (its replicas moved away with `forkless cluster remove-node {}`, then listed in \
                         retired_nodes instead of [[nodes]])",
                        n.id, n.id
                    ),
                );
            }
            if n.id == running.node_id {
                return refuse(
                    "retired_nodes",
                    format!(
                        "node {} is this node: a node does not retire itself while it runs",
                        n.id
                    ),
                );
            }
            if let Some(why) = still_member(n.id) {
                return refuse(
                    "retired_nodes",
                    format!(
                        "node {} still holds replicas ({why}): move them away first with `forkless cluster \
                         remove-node {}`",
                        n.id, n.id
                    ),
                );
            }
            removed.push(n.id);
            continue;
        };
        if m.api_addr != n.api_addr
            || m.peer_addr != n.peer_addr
            || raft_addr(new, n.id) != raft_addr(now, n.id)
        {
            if n.id == running.node_id {
                // Its listeners are bound: they move with its restart.
                own_moved = true;
            } else {
                moved.push(Added {
                    node: m.clone(),
                    raft_addr: raft_addr(new, n.id),
                });
            }
        }
    }
    if let (Some(old), Some(r)) = (&now.replication, &new.replication) {
        let was = Placement::of(old, running.shard_count);
        let is = Placement::of(r, running.shard_count);
        if let Some(why) = placement::refused(&is, &was, "this node") {
            let why = why.strip_prefix("placement: ").unwrap_or(&why).to_string();
            return refuse("placement", why);
        }
    }
    let added: Vec<Added> = new
        .nodes
        .iter()
        .filter(|m| now.node(m.id).is_none())
        .map(|m| Added {
            node: m.clone(),
            raft_addr: raft_addr(new, m.id),
        })
        .collect();
    if let Some(back) = added.iter().find(|a| retired(now, a.node.id)) {
        return refuse(
            format!("nodes[id={}].id", back.node.id),
            format!(
                "node {} retired from this cluster: a retired id does not come back (a machine joins under a \
                 new id)",
                back.node.id
            ),
        );
    }
    let mut cluster = now.clone();
    cluster
        .nodes
        .retain(|n| !removed.contains(&n.id) && !moved.iter().any(|m| m.node.id == n.id));
    cluster.nodes.extend(moved.iter().map(|m| m.node.clone()));
    cluster.nodes.extend(added.iter().map(|a| a.node.clone()));
    cluster.nodes.sort_by_key(|n| n.id);
    if let (Some(run), Some(r)) = (&mut cluster.replication, &new.replication) {
        // The pins, the Raft addresses and the retired nodes from the
        // file (the placement is the same, checked above); the timers as
        // they run.
        let mut raft_addrs = r.raft_addrs.clone();
        if let Some(mine) = run.raft_addrs.get(&running.node_id) {
            // Where this node listens until its restart.
            raft_addrs.insert(running.node_id, *mine);
        }
        *run = Replicated {
            raft_addrs,
            pinned: r.pinned.clone(),
            retired: r.retired.clone(),
            ..run.clone()
        };
    }
    let mut restart_needed = Vec::new();
    let raft = match (&now.replication, &new.replication) {
        (Some(a), Some(b)) => {
            a.timing != b.timing
                || a.snapshot_every != b.snapshot_every
                || a.log_kept != b.log_kept
                || a.learner_kept != b.learner_kept
        }
        _ => false,
    };
    for (field, changed) in [
        ("limits", file.limits != running.limits),
        ("peer", file.peer != running.peer),
        ("store", file.store != running.store),
        ("raft", raft),
        ("data_dir", file.data_dir != running.data_dir),
        // A replicated cluster's owners are elected (its assignments
        // only stand in until then); a static cluster's are the file's.
        (
            "shards",
            new.replication.is_none() && new.assignments != now.assignments,
        ),
    ] {
        if changed {
            restart_needed.push(field);
        }
    }
    if own_moved {
        restart_needed.push("this node's own addresses");
    }
    Ok(Plan {
        added,
        removed,
        moved,
        cluster,
        restart_needed,
    })
}

/// Why node `id` still holds a replica as this node knows, if it does:
/// a voter or learner of a group this node holds a replica of, or of a
/// group whose leader said so in answer to this node's probes. (A group
/// this node neither holds nor heard of is not known here; every node
/// checks its own when it reloads.)
pub(crate) fn still_member(app: &crate::App, id: NodeId) -> Option<String> {
    let me = u64::from(id.get());
    let mut shards = std::collections::BTreeSet::new();
    for st in app.store.hosted() {
        if let Some(g) = st.raft_status() {
            if g.voters.contains(&me) || g.learners.contains(&me) {
                shards.insert(st.id().get());
            }
        }
    }
    for (shard, h) in app
        .replicas_heard
        .lock()
        .unwrap_or_else(|e| e.into_inner())
        .iter()
    {
        // What a leader said is kept until a newer leader says more: a
        // shard this node leads since, or whose replica here has a newer
        // membership, goes by its own replica's (above).
        let local = app
            .store
            .shard(forkless_types::ShardId(*shard))
            .and_then(|st| st.raft_status());
        if h.counts(me) && h.newer_than(local.as_ref()) {
            shards.insert(*shard);
        }
    }
    (!shards.is_empty()).then(|| {
        let list: Vec<String> = shards.iter().take(8).map(u32::to_string).collect();
        let more = shards.len().saturating_sub(8);
        format!(
            "a member of shard(s) {}{}",
            list.join(", "),
            if more > 0 {
                format!(" and {more} more")
            } else {
                String::new()
            }
        )
    })
}

/// The nodes replica moves led by this node are going to, while each
/// move runs: a node is not retired while a move to it is under way (it
/// is no learner of the group until the move's first step, after a
/// confirmation round with a quorum). A move names its target here before
/// it checks that the node is in the running cluster, and a reload checks
/// here under the same lock it retires under: the move then either finds
/// the node retired (and is refused) or keeps it from retiring.
#[derive(Debug, Default)]
pub struct MoveTargets(std::sync::Mutex<std::collections::BTreeMap<NodeId, usize>>);

/// One move's hold on its target, released when dropped.
#[derive(Debug)]
pub struct MoveHold<'a> {
    targets: &'a MoveTargets,
    node: NodeId,
}

impl MoveTargets {
    fn lock(&self) -> std::sync::MutexGuard<'_, std::collections::BTreeMap<NodeId, usize>> {
        self.0.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Names `node` as a move's target until the hold is dropped.
    pub fn hold(&self, node: NodeId) -> MoveHold<'_> {
        *self.lock().entry(node).or_default() += 1;
        MoveHold {
            targets: self,
            node,
        }
    }

    /// Why `node` may not retire now, if a move to it is under way.
    pub fn moving_to(&self, node: NodeId) -> Option<String> {
        self.lock()
            .get(&node)
            .filter(|n| **n > 0)
            .map(|n| format!("the target of {n} replica move(s) under way on this node"))
    }
}

impl Drop for MoveHold<'_> {
    fn drop(&mut self) {
        let mut held = self.targets.lock();
        if let Some(n) = held.get_mut(&self.node) {
            *n = n.saturating_sub(1);
            if *n == 0 {
                held.remove(&self.node);
            }
        }
    }
}

/// Takes SIGHUP from the system for [`on_hangup`]; `None` (logged) when
/// the signal cannot be taken, which leaves its default action (the
/// process ends) in place.
#[cfg(unix)]
pub fn take_hangups() -> Option<tokio::signal::unix::Signal> {
    match tokio::signal::unix::signal(tokio::signal::unix::SignalKind::hangup()) {
        Ok(s) => Some(s),
        Err(e) => {
            tracing::warn!(error = %e, "cannot take SIGHUP (it would end the process): reload with `forkless cluster reload` instead");
            None
        }
    }
}

/// Reloads on every SIGHUP until `stop`, logging what each did. On a
/// node with nothing to read again (no cluster file, or a node running
/// alone) each SIGHUP is a refused reload, logged and counted, and the
/// node serves on.
#[cfg(unix)]
pub async fn on_hangup(
    app: Arc<crate::App>,
    mut hangups: tokio::signal::unix::Signal,
    mut stop: tokio::sync::watch::Receiver<bool>,
) {
    loop {
        tokio::select! {
            got = hangups.recv() => if got.is_none() { return },
            _ = stop.wait_for(|s| *s) => return,
        }
        match run(&app).await {
            Ok(done) => tracing::info!(
                added = ?done.added.iter().map(|a| a.node.id.get()).collect::<Vec<_>>(),
                retired = ?done.removed.iter().map(|n| n.get()).collect::<Vec<_>>(),
                nodes = ?done.nodes.iter().map(|n| n.get()).collect::<Vec<_>>(),
                "SIGHUP: the cluster file read again"
            ),
            Err(r) => tracing::warn!(
                field = %r.field, reason = %r.reason,
                "SIGHUP: reload refused, nothing changed"
            ),
        }
    }
}

/// Why a file that does not resolve for this node is refused: the field
/// that makes it so, when it is this node's own entry (left out of the
/// file, or retired in it), else the file as a whole.
fn refused_file(me: NodeId, e: ConfigError) -> Refused {
    match e {
        ConfigError::NotListed { retired: true, .. } => Refused {
            field: "retired_nodes".into(),
            reason: format!(
                "node {me} is this node: a node does not retire itself while it runs (its replicas moved \
                 away, it is stopped, and the other nodes retire it)"
            ),
        },
        ConfigError::NotListed { retired: false, .. } => Refused {
            field: format!("nodes[id={me}].id"),
            reason: format!(
                "node {me} is this node, and the file no longer lists it in [[nodes]]: a node leaves the \
                 cluster stopped, its replicas moved away, the other nodes retiring it"
            ),
        },
        e => Refused {
            field: "config".into(),
            reason: e.to_string(),
        },
    }
}

/// What a reload did.
#[derive(Debug, Clone)]
pub struct Outcome {
    pub added: Vec<Added>,
    pub removed: Vec<NodeId>,
    pub moved: Vec<Added>,
    /// Every node this node now knows, in id order.
    pub nodes: Vec<NodeId>,
    pub restart_needed: Vec<&'static str>,
}

/// Reads the cluster file again and adds the nodes it gained: to the
/// directory (probed and routed to from the next probe round), and to the
/// Raft transport and the heartbeat (replicas can then be moved to them).
/// Refused whole when the file changes anything else a reload cannot
/// take ([`plan`]); nothing is changed then.
pub async fn run(app: &crate::App) -> Result<Outcome, Refused> {
    let done = reload(app).await;
    let outcome = if done.is_ok() { "taken" } else { "refused" };
    app.metrics
        .cluster_reloads
        .get_or_create(&crate::metrics::OutcomeLabel { outcome })
        .inc();
    done
}

async fn reload(app: &crate::App) -> Result<Outcome, Refused> {
    // One reload at a time, from reading the file to applying it: each
    // plans against what the last one left, and the last file read is the
    // one that runs.
    let _one = app.reloading.lock().await;
    let Some(read) = app.reload.clone() else {
        return refuse(
            "config",
            "this node was started with no cluster file (--config): there is nothing to read again",
        );
    };
    let file = tokio::task::spawn_blocking(move || read())
        .await
        .map_err(|e| Refused {
            field: "config".into(),
            reason: format!("reading the cluster file failed: {e}"),
        })?
        .map_err(|e| refused_file(app.cfg.node_id, e))?;
    // Replica moves read the node list under this lock after naming their
    // target (`MoveTargets`), so a move either sees the retirement or is
    // seen by it.
    let mut held = app.cluster.write().unwrap_or_else(|e| e.into_inner());
    let Some(now) = held.clone() else {
        return refuse(
            "nodes",
            "this node runs alone (no [[nodes]] in the file it started on): a restart makes it a cluster member",
        );
    };
    let plan = plan(&app.cfg, &now, &file, &|id| {
        still_member(app, id).or_else(|| app.move_targets.moving_to(id))
    })?;
    check_fds(&app.cfg, &plan.cluster, app.fd_limit)?;
    if !plan.added.is_empty() {
        crate::warn_if_share_of_one(app.cfg.limits.connections_max, plan.cluster.nodes.len());
    }
    for &id in &plan.removed {
        app.dir.remove_node(id);
        crate::peer::forget_peer(app, id);
        if let Some(links) = &app.links {
            links.remove_peer(u64::from(id.get()));
        }
        tracing::info!(
            peer = %id,
            "node retired from the cluster file: no longer probed, routed to or replicated to"
        );
    }
    for m in &plan.moved {
        app.dir.move_node(m.node.clone());
        if let (Some(links), Some(addr)) = (&app.links, m.raft_addr) {
            links.move_peer(u64::from(m.node.id.get()), addr.to_string());
        }
        tracing::info!(
            peer = %m.node.id, api_addr = %m.node.api_addr, peer_addr = %m.node.peer_addr,
            raft_addr = ?m.raft_addr.map(|r| r.to_string()),
            "node's addresses changed in the cluster file: reached there from now on"
        );
    }
    for a in &plan.added {
        app.dir.add_node(a.node.clone());
        if let (Some(links), Some(addr)) = (&app.links, a.raft_addr) {
            links.add_peer(u64::from(a.node.id.get()), addr.to_string());
        }
        tracing::info!(
            peer = %a.node.id, api_addr = %a.node.api_addr, peer_addr = %a.node.peer_addr,
            raft_addr = ?a.raft_addr.map(|r| r.to_string()),
            "node added from the cluster file: probed, routed to and replicated to from now on"
        );
    }
    if !plan.restart_needed.is_empty() {
        tracing::warn!(
            fields = ?plan.restart_needed,
            "the cluster file changed settings a reload does not take: they take effect at this node's next restart"
        );
    }
    let nodes = plan.cluster.nodes.iter().map(|n| n.id).collect();
    *held = Some(Arc::new(plan.cluster));
    Ok(Outcome {
        added: plan.added,
        removed: plan.removed,
        moved: plan.moved,
        nodes,
        restart_needed: plan.restart_needed,
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::{parse_file, resolve, Overrides};

    const SECRET: &str = "a-secret-of-16-chars-or-more";

    /// A replicated cluster file: `nodes` (id, port base), four shards,
    /// and `extra` appended.
    fn file(nodes: &[(u64, u16)], extra: &str) -> String {
        let mut t = format!("shard_count = 4\nsecret = \"{SECRET}\"\n");
        for (id, p) in nodes {
            t += &format!(
                "[[nodes]]\nid = {id}\napi_addr = \"127.0.0.1:{p}\"\npeer_addr = \"127.0.0.1:{}\"\nraft_addr = \"127.0.0.1:{}\"\n",
                p + 1,
                p + 2
            );
        }
        t + extra
    }

    fn cfg(text: &str) -> ServerConfig {
        resolve(
            Some(parse_file(text).unwrap()),
            Some(2),
            Overrides::default(),
        )
        .unwrap()
    }

    /// Every shard of four pinned where the three-node spread put it.
    const PINS: &str = "[[placement]]\nshard = 0\nreplicas = [1, 2, 3]\n\
        [[placement]]\nshard = 1\nreplicas = [2, 3, 1]\n\
        [[placement]]\nshard = 2\nreplicas = [3, 1, 2]\n\
        [[placement]]\nshard = 3\nreplicas = [1, 2, 3]\n";

    const THREE: &[(u64, u16)] = &[(1, 7000), (2, 7010), (3, 7020)];
    const FOUR: &[(u64, u16)] = &[(1, 7000), (2, 7010), (3, 7020), (4, 7030)];

    fn planned(running: &str, now: &str) -> Result<Plan, Refused> {
        let running = cfg(running);
        let cluster = running.cluster.clone().unwrap();
        plan(&running, &cluster, &cfg(now), &|_| None)
    }

    #[test]
    fn a_node_added_to_a_pinned_file_is_taken_with_its_addresses() {
        let p = planned(&file(THREE, ""), &file(FOUR, PINS)).unwrap();
        assert_eq!(p.added.len(), 1);
        assert_eq!(p.added[0].node.id.get(), 4);
        assert_eq!(p.added[0].node.api_addr, "127.0.0.1:7030");
        assert_eq!(
            p.added[0].raft_addr,
            Some("127.0.0.1:7032".parse().unwrap())
        );
        let ids: Vec<u16> = p.cluster.nodes.iter().map(|n| n.id.get()).collect();
        assert_eq!(ids, vec![1, 2, 3, 4]);
        assert!(p.restart_needed.is_empty(), "{:?}", p.restart_needed);
        // The running cluster's placement is unchanged by the added node.
        let r = p.cluster.replication.as_ref().unwrap();
        let before = cfg(&file(THREE, ""));
        let before = before.cluster.unwrap().replication.unwrap();
        let shards = forkless_types::ShardCount::new(4).unwrap();
        assert_eq!(Placement::of(r, shards), Placement::of(&before, shards));
        // Read again, the same file adds nothing.
        let again = plan(
            &cfg(&file(THREE, "")),
            &p.cluster,
            &cfg(&file(FOUR, PINS)),
            &|_| None,
        )
        .unwrap();
        assert!(again.added.is_empty());
    }

    #[test]
    fn a_reload_whose_nodes_would_not_fit_the_open_file_limit_is_refused() {
        let running = cfg(&file(THREE, ""));
        let p = planned(&file(THREE, ""), &file(FOUR, PINS)).unwrap();
        // Three nodes: 1024 on each of two listeners, 1024 for forwards,
        // and the Raft transport's 64 + 3 x 2 peers; 256 for the store.
        let three = 3 * 1024 + 64 + 3 * 2 + 256;
        let now = running.cluster.clone().unwrap();
        assert!(check_fds(&running, &now, three).is_ok());
        // A fourth node is three more Raft connections.
        let e = check_fds(&running, &p.cluster, three).unwrap_err();
        assert_eq!(e.field, "nodes");
        assert!(e.reason.contains("with 4 nodes"), "{}", e.reason);
        assert!(e.reason.contains(&format!("{}", three + 3)), "{}", e.reason);
        assert!(check_fds(&running, &p.cluster, three + 3).is_ok());
    }

    #[test]
    fn what_a_reload_refuses_is_named_by_its_field() {
        let moved = [(1, 7000), (2, 7010), (3, 7020), (4, 7030)];
        let cases: &[(&str, String, &str)] = &[
            // Unpinned: the spread over four nodes moves shards.
            ("placement", file(&moved, ""), "Pin the placement"),
            (
                "nodes[id=3].id",
                file(&[(1, 7000), (2, 7010), (4, 7030)], ""),
                "gone from the file",
            ),
            (
                "shard_count",
                file(THREE, "").replace("shard_count = 4", "shard_count = 8"),
                "resize",
            ),
            (
                "secret",
                file(THREE, "").replace(SECRET, "another-secret-of-16-chars"),
                "restarting every node",
            ),
            (
                "replication_factor",
                file(THREE, "")
                    .replace("shard_count = 4", "shard_count = 4\nreplication_factor = 2"),
                "the file has 2",
            ),
        ];
        for (field, text, says) in cases {
            let r = planned(&file(THREE, ""), text).expect_err(field);
            assert_eq!(&r.field, field, "{r:?}");
            assert!(r.reason.contains(says), "{field}: {}", r.reason);
        }
    }

    #[test]
    fn a_peer_moved_is_reached_at_its_new_addresses_and_this_node_waits_for_a_restart() {
        let p = planned(
            &file(THREE, ""),
            &file(&[(1, 7000), (2, 7010), (3, 7040)], ""),
        )
        .unwrap();
        assert!(p.added.is_empty() && p.removed.is_empty());
        assert_eq!(p.moved.len(), 1);
        assert_eq!(p.moved[0].node.api_addr, "127.0.0.1:7040");
        assert_eq!(
            p.moved[0].raft_addr,
            Some("127.0.0.1:7042".parse().unwrap())
        );
        let three = p.cluster.node(NodeId::new(3).unwrap()).unwrap();
        assert_eq!(three.peer_addr, "127.0.0.1:7041");
        assert_eq!(
            p.cluster.replication.as_ref().unwrap().raft_addrs[&NodeId::new(3).unwrap()],
            "127.0.0.1:7042".parse().unwrap()
        );
        assert!(p.restart_needed.is_empty(), "{:?}", p.restart_needed);
        // This node's own (node 2's) addresses: its listeners move with a
        // restart.
        let p = planned(
            &file(THREE, ""),
            &file(&[(1, 7000), (2, 7050), (3, 7020)], ""),
        )
        .unwrap();
        assert!(p.moved.is_empty());
        assert_eq!(p.restart_needed, vec!["this node's own addresses"]);
    }

    /// Nodes 2, 3 and 4, node 1 retired: its pins stay as they were.
    fn retired_one() -> String {
        let after: &[(u64, u16)] = &[(2, 7010), (3, 7020), (4, 7030)];
        file(after, PINS).replace("shard_count = 4", "shard_count = 4\nretired_nodes = [1]")
    }

    #[test]
    fn a_node_retires_once_it_holds_no_replica_and_does_not_come_back() {
        let running = cfg(&file(FOUR, PINS));
        let now = running.cluster.clone().unwrap();
        let p = plan(&running, &now, &cfg(&retired_one()), &|_| None).unwrap();
        assert_eq!(p.removed, vec![NodeId::new(1).unwrap()]);
        assert!(p.added.is_empty());
        // The stand-in owners moved off node 1: nothing for a restart.
        assert!(p.restart_needed.is_empty(), "{:?}", p.restart_needed);
        let ids: Vec<u16> = p.cluster.nodes.iter().map(|n| n.id.get()).collect();
        assert_eq!(ids, vec![2, 3, 4]);
        // Still a member of a group, as this node knows: refused.
        let r = plan(&running, &now, &cfg(&retired_one()), &|n| {
            (n.get() == 1).then(|| "a member of shard(s) 3".to_string())
        })
        .expect_err("retired while a member");
        assert_eq!(r.field, "retired_nodes");
        assert!(
            r.reason.contains("a member of shard(s) 3") && r.reason.contains("remove-node 1"),
            "{r:?}"
        );
        // Gone without retiring: refused, saying how a node leaves.
        let gone = retired_one().replace("retired_nodes = [1]\n", "");
        let gone = gone.replace(PINS, "");
        let r = plan(&running, &now, &cfg(&gone), &|_| None).expect_err("gone");
        assert_eq!(r.field, "nodes[id=1].id");
        assert!(r.reason.contains("retired_nodes"), "{r:?}");
        // A retired id listed again: refused.
        let r = plan(&running, &p.cluster, &cfg(&file(FOUR, PINS)), &|_| None)
            .expect_err("a retired node back");
        assert_eq!(r.field, "nodes[id=1].id");
        assert!(r.reason.contains("does not come back"), "{r:?}");
        // This node retiring itself: refused.
        let me = resolve(
            Some(parse_file(&file(FOUR, PINS)).unwrap()),
            Some(1),
            Overrides::default(),
        )
        .unwrap();
        let r = plan(&me, &now, &cfg(&retired_one()), &|_| None).expect_err("itself");
        assert_eq!(r.field, "retired_nodes");
    }

    #[test]
    fn a_static_clusters_node_left_out_is_refused_with_its_own_way_out() {
        let stat = |nodes: &[(u64, u16)]| {
            file(nodes, "").replace("shard_count = 4", "shard_count = 4\nreplication_factor = 1")
        };
        let r = planned(&stat(THREE), &stat(&[(1, 7000), (2, 7010)])).expect_err("left out");
        assert_eq!(r.field, "nodes[id=3].id");
        // Not pointed at retired_nodes, which a static file refuses.
        assert!(
            r.reason.contains("static cluster") && !r.reason.contains("retired_nodes"),
            "{r:?}"
        );
    }

    #[test]
    fn a_file_that_leaves_out_or_retires_this_node_is_refused_naming_that_field() {
        // Node 2 runs; the file as it reads now, for node 2.
        let read = |text: &str| {
            resolve(
                Some(parse_file(text).unwrap()),
                Some(2),
                Overrides::default(),
            )
        };
        let me = NodeId::new(2).unwrap();
        let retiring_me = file(&[(1, 7000), (3, 7020), (4, 7030)], PINS)
            .replace("shard_count = 4", "shard_count = 4\nretired_nodes = [2]");
        let r = refused_file(me, read(&retiring_me).expect_err("node 2 retired"));
        assert_eq!(r.field, "retired_nodes", "{r:?}");
        assert!(r.reason.contains("does not retire itself"), "{r:?}");
        let without_me = file(&[(1, 7000), (3, 7020), (4, 7030)], "");
        let r = refused_file(me, read(&without_me).expect_err("node 2 left out"));
        assert_eq!(r.field, "nodes[id=2].id", "{r:?}");
        // Anything else about the file is the file's.
        let r = refused_file(me, read("shard_count = 3").expect_err("not a power of two"));
        assert_eq!(r.field, "config", "{r:?}");
    }

    #[test]
    fn a_pin_reordered_is_taken_and_moves_the_preferred_leader() {
        let reordered = PINS.replace(
            "shard = 0\nreplicas = [1, 2, 3]",
            "shard = 0\nreplicas = [2, 1, 3]",
        );
        let p = planned(&file(THREE, PINS), &file(THREE, &reordered)).unwrap();
        assert!(p.added.is_empty() && p.removed.is_empty() && p.moved.is_empty());
        assert!(p.restart_needed.is_empty(), "{:?}", p.restart_needed);
        let r = p.cluster.replication.as_ref().unwrap();
        let ids = |s: u32| -> Vec<u16> {
            r.replicas(forkless_types::ShardId(s))
                .iter()
                .map(|n| n.get())
                .collect()
        };
        assert_eq!(ids(0), vec![2, 1, 3]);
        assert_eq!(ids(1), vec![2, 3, 1]);
    }

    #[test]
    fn a_node_a_move_is_going_to_does_not_retire_until_the_move_ends() {
        let targets = MoveTargets::default();
        let one = NodeId::new(1).unwrap();
        let running = cfg(&file(FOUR, PINS));
        let now = running.cluster.clone().unwrap();
        let check = |targets: &MoveTargets| {
            plan(&running, &now, &cfg(&retired_one()), &|id| {
                targets.moving_to(id)
            })
        };
        {
            let _a = targets.hold(one);
            let _b = targets.hold(one);
            let r = check(&targets).expect_err("retired while a move goes to it");
            assert_eq!(r.field, "retired_nodes");
            assert!(r.reason.contains("2 replica move(s) under way"), "{r:?}");
        }
        assert!(targets.moving_to(one).is_none());
        assert_eq!(check(&targets).unwrap().removed, vec![one]);
    }

    #[test]
    fn other_changed_settings_wait_for_a_restart() {
        let p = planned(
            &file(THREE, ""),
            &file(
                FOUR,
                &format!("{PINS}[limits]\nconnections_max = 7\n[raft]\nheartbeat_ms = 70\n"),
            ),
        );
        let p = p.unwrap();
        assert_eq!(p.added.len(), 1);
        assert_eq!(p.restart_needed, vec!["limits", "raft"]);
        // The log's limits are the raft section's too, set or left out.
        for raft in [
            "[raft]\nlog_kept_entries = 100000\n",
            "[raft]\nsnapshot_every_entries = 500\n",
            "[raft]\nlearner_kept_s = 30\n",
        ] {
            let p = planned(&file(THREE, ""), &file(THREE, raft)).unwrap();
            assert_eq!(p.restart_needed, vec!["raft"], "{raft}");
        }
        let p = planned(&file(THREE, ""), &file(THREE, "[raft]\nquiesce = true\n")).unwrap();
        assert!(p.restart_needed.is_empty(), "the defaults, written out");
    }
}
