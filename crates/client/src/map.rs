//! The cluster map as `GET /api/cluster` describes it, and the pure owner
//! computation a routing-aware client does with it.

use crate::error::Error;
use forkless_sharding::{shard_for_key, ShardCount};
use forkless_types::ExecutionId;
use serde::{Deserialize, Serialize};

/// One node of the cluster.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct NodeInfo {
    pub id: u16,
    /// The client API address (`host:port`).
    pub api_addr: String,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub peer_addr: Option<String>,
    /// The answering node's view of this node's liveness.
    #[serde(default = "yes")]
    pub alive: bool,
    /// The answering node's probes of this node: `up`, `down`,
    /// `never_answered` (taken for alive: it may be starting), or `self`
    /// (`None`: an older server).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub probe: Option<String>,
    /// Whether this node runs with the same node list as the answering
    /// node (`None`: not known yet, or an older server).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub same_nodes: Option<bool>,
    /// Whether this node's groups were made with the same placement as the
    /// answering node's (`None`: not known yet, not a replicated cluster,
    /// or an older server).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub same_placement: Option<bool>,
    /// Whether this node is drained or stopping (it takes no leadership),
    /// as it last told the answering node (`None`: not known yet, or an
    /// older server).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub draining: Option<bool>,
}

fn yes() -> bool {
    true
}

/// One shard's owner as the answering node sees it.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ShardInfo {
    pub shard: u32,
    #[serde(default)]
    pub owner: Option<u16>,
    #[serde(default)]
    pub epoch: Option<u64>,
    /// In a replicated cluster: the nodes holding a replica.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub replicas: Option<Vec<u16>>,
    /// Where the answering node has `replicas` from: `this replica` (its
    /// own replica's membership), `leader N at term T` (what the leader
    /// said), or `cluster_file` (the file's placement: it holds no replica
    /// and has not heard from the leader).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub replicas_from: Option<String>,
    /// In a replicated cluster: the leader the answering node knows of
    /// (none during an election), and its term.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub leader: Option<u16>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub term: Option<u64>,
    /// The answering node's replica of the shard's group, if it holds one.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub raft: Option<RaftInfo>,
    /// Why the answering node's replica of the shard failed (it serves
    /// none of the shard's requests until restarted).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub failed: Option<String>,
}

/// One replica's view of its shard's Raft group.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct RaftInfo {
    pub state: String,
    #[serde(default)]
    pub last_log_index: Option<u64>,
    #[serde(default)]
    pub committed: Option<u64>,
    #[serde(default)]
    pub applied: Option<u64>,
    /// On the leader: each follower's progress.
    #[serde(default)]
    pub followers: Vec<FollowerInfo>,
    /// The group is idle with its timers off on this replica.
    #[serde(default)]
    pub quiet: bool,
    /// Whether the group's newer membership, as its leader said it, no
    /// longer counts this replica (its node was removed while away).
    #[serde(default)]
    pub left_group: bool,
    /// This replica's data directory is new (a lost disk, back under its
    /// id) and it has not caught up: it votes for no candidate with
    /// entries yet.
    #[serde(default)]
    pub fresh: bool,
    /// A change of the group's voters is under way (openraft's joint
    /// configuration: the shard's `replicas` list the old voters and the
    /// new, and a quorum of each is needed for every write). One its
    /// leader left unfinished (it died between the change's two steps)
    /// is finished by the next leader.
    #[serde(default)]
    pub joint: bool,
    /// Nodes the group replicates to that do not vote: a move's target
    /// catching up, or one a move cut short left.
    #[serde(default)]
    pub learners: Vec<u64>,
}

/// A follower's progress, as its leader knows it.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct FollowerInfo {
    pub node: u64,
    #[serde(default)]
    pub matched: Option<u64>,
    #[serde(default)]
    pub lag: Option<u64>,
}

#[derive(Deserialize)]
struct Wire {
    node: u16,
    shard_count: u64,
    map_version: u64,
    #[serde(default)]
    routing_active: bool,
    #[serde(default)]
    draining: bool,
    nodes: Vec<NodeInfo>,
    shards: Vec<ShardInfo>,
}

/// A validated cluster map, remembered with the base URL it was fetched from.
#[derive(Debug, Clone, Serialize)]
pub struct ClusterMap {
    /// The node that answered.
    pub node: u16,
    pub shard_count: u32,
    pub map_version: u64,
    /// False on a single node (one shard): everything is local there.
    pub routing_active: bool,
    /// The answering node takes no leadership: drained by an operator
    /// (`forkless cluster drain`), or stopping.
    pub draining: bool,
    pub nodes: Vec<NodeInfo>,
    pub shards: Vec<ShardInfo>,
    /// The base URL the map was fetched from (`http://host:port`).
    pub fetched_from: String,
    #[serde(skip)]
    count: ShardCount,
}

/// Where one request goes.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Destination {
    /// `http://host:port`.
    pub base: String,
    /// The node, when the map names it.
    pub node: Option<u16>,
}

impl ClusterMap {
    /// Parses and checks a `GET /api/cluster` answer. Never panics on what
    /// the server sent.
    pub fn from_json(body: &[u8], fetched_from: &str) -> Result<ClusterMap, Error> {
        let w: Wire = serde_json::from_slice(body)
            .map_err(|e| Error::Protocol(format!("cluster map from {fetched_from}: {e}")))?;
        let count = ShardCount::new(w.shard_count).map_err(|e| {
            Error::Protocol(format!("cluster map from {fetched_from}: shard_count: {e}"))
        })?;
        let mut shards = w.shards;
        shards.sort_by_key(|s| s.shard);
        let dense = shards.len() == count.get() as usize
            && shards
                .iter()
                .enumerate()
                .all(|(i, s)| s.shard as usize == i);
        if !dense {
            return Err(Error::Protocol(format!(
                "cluster map from {fetched_from}: shard_count is {} but the shards listed are not exactly 0..{}",
                count.get(),
                count.get()
            )));
        }
        Ok(ClusterMap {
            node: w.node,
            shard_count: count.get(),
            map_version: w.map_version,
            routing_active: w.routing_active,
            draining: w.draining,
            nodes: w.nodes,
            shards,
            fetched_from: fetched_from.trim_end_matches('/').to_string(),
            count,
        })
    }

    pub fn count(&self) -> ShardCount {
        self.count
    }

    /// The shard of an execution id.
    pub fn shard_of(&self, id: ExecutionId) -> u32 {
        id.shard(self.count).get()
    }

    /// The shard a routing key steers to.
    pub fn shard_of_key(&self, key: &str) -> u32 {
        shard_for_key(key, self.count)
    }

    pub fn node_info(&self, id: u16) -> Option<&NodeInfo> {
        self.nodes.iter().find(|n| n.id == id)
    }

    /// The owner node of a shard, if the map names one.
    pub fn owner(&self, shard: u32) -> Option<&NodeInfo> {
        let s = self.shards.get(shard as usize)?;
        self.node_info(s.owner?)
    }

    /// The base URL of a node. The node that answered the map is reached the
    /// way the map was reached (it may know itself by an address this client
    /// cannot use); a wildcard listen address keeps the fetch host.
    pub fn base_of(&self, n: &NodeInfo) -> String {
        if n.id == self.node {
            return self.fetched_from.clone();
        }
        let (host, port) = split_host_port(&n.api_addr);
        if matches!(host, "0.0.0.0" | "[::]" | "::" | "") {
            let (fhost, _) = split_host_port(strip_scheme(&self.fetched_from));
            return format!("http://{fhost}:{port}");
        }
        format!("http://{}", n.api_addr)
    }

    /// Where a request for `shard` goes: its owner's API address; the node
    /// the map came from when routing is inactive, no owner is known or the
    /// owner is believed down (it then answers for the shard itself:
    /// forwards, or fails closed).
    pub fn destination(&self, shard: Option<u32>) -> Destination {
        let fallback = Destination {
            base: self.fetched_from.clone(),
            node: Some(self.node),
        };
        if !self.routing_active {
            return fallback;
        }
        match shard.and_then(|s| self.owner(s)) {
            // An owner the answering node believes down is not tried: the
            // answering node fails closed at once (503, nothing written),
            // where a paused owner would leave the outcome unknown.
            Some(n) if n.alive => Destination {
                base: self.base_of(n),
                node: Some(n.id),
            },
            _ => fallback,
        }
    }

    /// Base URLs worth asking for a fresh map: alive nodes first.
    pub fn refresh_candidates(&self) -> Vec<String> {
        let mut nodes: Vec<&NodeInfo> = self.nodes.iter().collect();
        nodes.sort_by_key(|n| (!n.alive, n.id));
        nodes.into_iter().map(|n| self.base_of(n)).collect()
    }
}

fn strip_scheme(url: &str) -> &str {
    url.strip_prefix("http://").unwrap_or(url)
}

/// Splits `host:port` (or `[v6]:port`); a missing port is empty.
fn split_host_port(addr: &str) -> (&str, &str) {
    let addr = addr.trim_end_matches('/');
    match addr.rfind(':') {
        Some(i) if !addr[i..].contains(']') => (&addr[..i], &addr[i + 1..]),
        _ => (addr, ""),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn three_nodes(n: u32) -> ClusterMap {
        let shards: Vec<_> = (0..n)
            .map(|s| {
                format!(
                    r#"{{"shard":{s},"owner":{},"epoch":1,"local":false,"store_epoch":null}}"#,
                    s % 3 + 1
                )
            })
            .collect();
        let body = format!(
            r#"{{"node":1,"shard_count":{n},"partition_count":4096,"map_version":3,"routing_active":true,
               "nodes":[{{"id":1,"api_addr":"127.0.0.1:7071","peer_addr":"127.0.0.1:7171","alive":true,"self":true}},
                        {{"id":2,"api_addr":"127.0.0.1:7072","peer_addr":"127.0.0.1:7172","alive":true,"self":false}},
                        {{"id":3,"api_addr":"0.0.0.0:7073","peer_addr":"127.0.0.1:7173","alive":false,"self":false}}],
               "shards":[{}]}}"#,
            shards.join(",")
        );
        ClusterMap::from_json(body.as_bytes(), "http://localhost:7071/").expect("valid map")
    }

    #[test]
    fn owner_of_an_id_follows_the_partition_table() {
        let m = three_nodes(16);
        for raw in [1i64, 2, 3, 42, 1 << 40, i64::MAX] {
            let id = ExecutionId::new(raw).expect("positive");
            let shard = forkless_sharding::shard_for(raw, ShardCount::new(16).expect("legal"));
            assert_eq!(m.shard_of(id), shard);
            let d = m.destination(Some(shard));
            let owner = shard % 3 + 1;
            // Node 3 is down in this map: its shards go to the answering node.
            let (node, want) = match owner {
                1 => (1, "http://localhost:7071".to_string()),
                2 => (2, "http://127.0.0.1:7072".to_string()),
                _ => (1, "http://localhost:7071".to_string()),
            };
            assert_eq!(d.node, Some(node));
            assert_eq!(d.base, want, "id {raw} shard {shard}");
        }
    }

    #[test]
    fn owner_of_a_key_matches_the_server_steering() {
        let m = three_nodes(8);
        let key = "tenant-a/order-1";
        let s = m.shard_of_key(key);
        assert_eq!(
            s,
            forkless_types::PartitionId::for_key(key)
                .shard(ShardCount::new(8).expect("legal"))
                .get()
        );
        let owner = (s % 3 + 1) as u16;
        let want = if owner == 3 { 1 } else { owner };
        assert_eq!(m.destination(Some(s)).node, Some(want));
    }

    #[test]
    fn a_wildcard_api_address_keeps_the_fetch_host() {
        let mut m = three_nodes(4);
        m.nodes[2].alive = true;
        assert_eq!(m.base_of(&m.nodes[2]), "http://localhost:7073");
        assert_eq!(m.destination(Some(2)).base, "http://localhost:7073");
    }

    #[test]
    fn inactive_routing_and_unowned_shards_go_to_the_answering_node() {
        let single = ClusterMap::from_json(
            br#"{"node":1,"shard_count":1,"map_version":1,"routing_active":false,
                "nodes":[{"id":1,"api_addr":"0.0.0.0:7070","alive":true}],
                "shards":[{"shard":0,"owner":1,"epoch":1}]}"#,
            "http://127.0.0.1:9999",
        )
        .expect("valid");
        assert_eq!(
            single.destination(Some(0)).base,
            "http://127.0.0.1:9999".to_string()
        );
        let mut m = three_nodes(4);
        m.shards[2].owner = None;
        assert_eq!(m.destination(Some(2)).node, Some(1));
        m.shards[3].owner = Some(99);
        assert_eq!(m.destination(Some(3)).node, Some(1));
        assert_eq!(m.destination(None).node, Some(1));
    }

    #[test]
    fn refuses_inconsistent_maps() {
        for body in [
            &br#"{"node":1,"shard_count":3,"map_version":1,"nodes":[],"shards":[]}"#[..],
            br#"{"node":1,"shard_count":2,"map_version":1,"nodes":[],"shards":[{"shard":0}]}"#,
            br#"{"node":1,"shard_count":2,"map_version":1,"nodes":[],"shards":[{"shard":0},{"shard":5}]}"#,
            br#"{"node":1}"#,
            b"garbage",
        ] {
            assert!(matches!(
                ClusterMap::from_json(body, "http://x:1"),
                Err(Error::Protocol(_))
            ));
        }
    }

    #[test]
    fn refresh_prefers_alive_nodes() {
        let m = three_nodes(4);
        assert_eq!(
            m.refresh_candidates(),
            vec![
                "http://localhost:7071".to_string(),
                "http://127.0.0.1:7072".to_string(),
                "http://localhost:7073".to_string(),
            ]
        );
    }
}
