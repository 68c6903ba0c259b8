//! Configuration: defaults, the optional TOML file, and its validation.
//!
//! A file may describe a single node (`data_dir`, `listen`, `shard_count`,
//! `[limits]`, `[store]`) or a static cluster (`[[nodes]]`, optional `[[shards]]`, a
//! `secret`). Every node validates a cluster file the same way and refuses to
//! start on a bad one, saying what is wrong.

use forkless_routing::{NodeInfo, ShardAssignment, StaticDirectory};
use forkless_types::{Epoch, NodeId, ShardCount, ShardId};
use serde::Deserialize;
use std::collections::BTreeSet;
use std::net::SocketAddr;
use std::path::PathBuf;
use std::time::Duration;

pub const DEFAULT_LISTEN: &str = "127.0.0.1:7070";
pub const DEFAULT_DATA_DIR: &str = "./forkless-data";

/// The longest `limits.request_read_timeout_ms` accepted (one hour).
pub const REQUEST_READ_TIMEOUT_MS_MAX: u64 = 3_600_000;

/// Request limits. Over any of the sizes is `413 payload_too_large`; a
/// request not received in full in time is `408 request_timeout`.
#[derive(Debug, Clone, Copy, Deserialize, PartialEq, Eq)]
#[serde(deny_unknown_fields, default)]
pub struct Limits {
    /// Largest JSON payload of one event (or start input, or signal), bytes.
    pub event_payload_bytes_max: usize,
    /// Largest request body, bytes.
    pub request_body_bytes_max: usize,
    /// Most events in one append.
    pub batch_events_max: usize,
    /// Longest long-poll a client may ask for, milliseconds.
    pub wait_ms_max: u64,
    /// Most events one read returns.
    pub read_events_max: usize,
    /// A request whose first byte has arrived must be received in full
    /// (head and body) within this, milliseconds, or the connection is
    /// answered 408 and closed; on a connection handed to hyper, its head
    /// and its body get this bound each. An idle kept-alive connection has
    /// no limit (see `idle_timeout_ms`).
    pub request_read_timeout_ms: u64,
    /// Most connections open at once on each listener (the client API's,
    /// and the peer address's when it is a listener of its own, counted
    /// apart so that clients cannot take the peers' connections); one over
    /// it is answered 503 `too_many_connections` and closed. Times the
    /// listeners, plus [`FD_RESERVE`], it must fit in the process's
    /// open-file limit (checked at start). Taken to be every node's: a
    /// node forwards to each peer on at most its share of that peer's
    /// peer connections (`forward::share`).
    pub connections_max: usize,
    /// A kept-alive connection with no request begun for this long is
    /// closed, milliseconds.
    pub idle_timeout_ms: u64,
    /// A client that does not take an answer for this long (the write
    /// makes no progress) has its connection dropped, milliseconds.
    pub write_timeout_ms: u64,
    /// A page of `GET /api/executions/{id}/events` stops once its events'
    /// payloads reach this many bytes (always at least one event), and
    /// says where to continue (`next_after`).
    pub read_page_bytes_max: usize,
    /// Most long-polls waiting at once on this node; one over it is
    /// answered 503 `too_many_long_polls` with `Retry-After`.
    pub long_polls_max: usize,
    /// Most bytes of request bodies the connections of each listener hold
    /// at once (read so far, and not yet answered), counted as they
    /// arrive: a request whose body would go over it is answered 503
    /// `too_many_body_bytes` with `Retry-After`, the rest of its body read
    /// and dropped. At least `request_body_bytes_max`.
    pub body_bytes_in_flight_max: usize,
    /// Most bytes of the answers clients can make large (pages of events,
    /// a key's executions) the connections of each listener hold at once,
    /// from the moment an answer is made until it is written to its
    /// client. A page of events is cut short to fit what is left (it says
    /// where to continue); a read whose answer does not fit is answered
    /// 503 `too_many_answer_bytes` with `Retry-After`. At least what the
    /// largest page takes ([`page_overhead_bytes_max`]).
    pub answer_bytes_in_flight_max: usize,
}

/// File descriptors kept free for the store (the node log's segments,
/// the next segment, rotations, the node's own files), over
/// `limits.connections_max`: running out of descriptors must never make a
/// shard's log rotation fail (that fail-stops the shard). The shards'
/// own descriptors and table files share what is left
/// ([`cached_files_per_shard`]).
pub const FD_RESERVE: u64 = 256;

/// The longest idle and write timeouts accepted (one hour).
pub const CONNECTION_TIMEOUT_MS_MAX: u64 = 3_600_000;

/// The largest `limits.request_body_bytes_max` accepted: one request's
/// events go into one Raft entry (with others' commands, up to
/// `forkless_store::GROUP_COMMIT_BYTES_MAX` before it), which a leader
/// sends its followers whole in one transport frame (at most
/// `forkless_raftnet::FRAME_BYTES_MAX`); a larger entry would break the
/// connection between two nodes each time it was sent, for every shard
/// they share.
pub const REQUEST_BODY_BYTES_CAP: usize = forkless_store::APPEND_BYTES_MAX;
/// The most `limits.read_page_bytes_max` plus
/// `limits.event_payload_bytes_max` accepted: a page stops only after the
/// event that reaches its byte budget (so it may hold one payload more),
/// and a page read through another node is relayed whole (at most 64
/// MiB with its encoding), so half of that.
pub const READ_PAGE_BYTES_CAP: usize = crate::forward::FORWARD_RESPONSE_BYTES_MAX / 2;

/// The most bytes one event of a page takes besides its payload: its
/// `seq`, `type` and `idempotency_key` (each at most
/// `wire::NAME_BYTES_MAX`, doubled by escaping at worst: names hold no
/// control characters), `recorded_at`, and the punctuation
/// (`wire::encode_events_page`; a test there holds it to this).
pub const EVENT_FRAME_BYTES_MAX: usize = 1_200;
/// The most bytes a page of events takes besides its events.
pub const PAGE_FRAME_BYTES_MAX: usize = 256;

/// The most bytes a page's answer takes besides `read_page_bytes_max` of
/// payloads, for a page of at most `events` events: a page stops after
/// the event whose payload reaches its budget, so one payload more, and
/// every event's frame.
pub fn page_overhead_bytes_max(limits: &Limits, events: usize) -> usize {
    limits
        .event_payload_bytes_max
        .saturating_add(events.saturating_mul(EVENT_FRAME_BYTES_MAX))
        .saturating_add(PAGE_FRAME_BYTES_MAX)
}

impl Default for Limits {
    fn default() -> Self {
        Limits {
            event_payload_bytes_max: 1024 * 1024,
            request_body_bytes_max: 8 * 1024 * 1024,
            batch_events_max: 1000,
            wait_ms_max: 30_000,
            read_events_max: 1000,
            request_read_timeout_ms: 30_000,
            connections_max: 1024,
            idle_timeout_ms: 60_000,
            write_timeout_ms: 30_000,
            read_page_bytes_max: 4 * 1024 * 1024,
            long_polls_max: 1024,
            body_bytes_in_flight_max: 256 * 1024 * 1024,
            answer_bytes_in_flight_max: 256 * 1024 * 1024,
        }
    }
}

/// Peer-to-peer timing.
#[derive(Debug, Clone, Copy, Deserialize, PartialEq, Eq)]
#[serde(deny_unknown_fields, default)]
pub struct PeerTiming {
    /// Connecting to the owner longer than this fails the forward closed.
    pub forward_connect_timeout_ms: u64,
    /// The owner answering later than this fails the forward closed
    /// (`executed: unknown`). Long-polls get their wait on top. Before
    /// it starts, a forward may wait up to half of it for a connection of
    /// this node's share of the owner's (then 503, not sent).
    pub forward_timeout_ms: u64,
    /// How often each node probes every peer.
    pub probe_interval_ms: u64,
    /// A probe not answered within this marks the peer down.
    pub probe_timeout_ms: u64,
}

impl Default for PeerTiming {
    fn default() -> Self {
        PeerTiming {
            forward_connect_timeout_ms: 500,
            forward_timeout_ms: 2_000,
            probe_interval_ms: 250,
            probe_timeout_ms: 500,
        }
    }
}

impl PeerTiming {
    pub fn forward_connect_timeout(&self) -> Duration {
        Duration::from_millis(self.forward_connect_timeout_ms)
    }
    pub fn forward_timeout(&self) -> Duration {
        Duration::from_millis(self.forward_timeout_ms)
    }
}

/// The lowest `store.journal_bytes_max` accepted: the storage engine's own
/// minimum (64 MiB), which it would otherwise raise the value to silently.
pub use forkless_store::JOURNAL_BYTES_MIN;
/// The lowest `store.write_buffer_bytes` accepted (1 MiB).
pub const WRITE_BUFFER_BYTES_MIN: u64 = 1024 * 1024;
/// The lowest `store.cache_bytes_per_shard` accepted (1 MiB).
pub const CACHE_BYTES_MIN: u64 = 1024 * 1024;
/// The most nice steps `store.background_nice` may lower the storage
/// engine's background threads by (Linux's range is 0 to 19).
pub const BACKGROUND_NICE_MAX: i32 = 19;
/// The most nice steps `store.writer_priority` may raise the shard writers
/// by (Linux's range is -20 to 19).
pub const WRITER_PRIORITY_MAX: i32 = 20;

/// Each shard's embedded database (`docs/storage.md`). Defaults are the
/// store's own.
#[derive(Debug, Clone, Copy, Deserialize, PartialEq, Eq)]
#[serde(deny_unknown_fields, default)]
pub struct StoreSettings {
    /// Block cache per shard, bytes (for reads of tables already flushed
    /// from memory). Left out: [`StoreSettings::cache_bytes_per_shard_for`].
    pub cache_bytes_per_shard: Option<u64>,
    /// Journal bytes kept before memtables are flushed, bytes: bounds how
    /// much a restart after a crash replays.
    pub journal_bytes_max: u64,
    /// The most bytes all shards' write buffers (memtables not yet
    /// flushed into tables) hold together on this node, bytes; past it the
    /// largest are flushed.
    pub write_buffer_bytes: u64,
    /// How many nice steps below the request path the storage engine's
    /// flush and compaction threads run (0: the same priority). Linux only.
    pub background_nice: i32,
    /// How many nice steps above the request path each shard's writer
    /// thread runs (0: the same priority), if the process may (root or
    /// CAP_SYS_NICE; otherwise a warning at start). Linux only.
    pub writer_priority: i32,
    /// Experimental, off by default: every shard a Raft group this node
    /// runs alone (`docs/replication.md`, step 5). Not yet as fast as the
    /// default at one client (`BENCHMARKS.md`).
    pub raft: bool,
    /// How many groups of a shard's writes its Raft leader keeps proposed
    /// and not yet applied at once (1 to 64; 1: each group is applied
    /// before the next is evaluated).
    pub groups_in_flight: usize,
}

/// The most `store.groups_in_flight` accepted.
pub const GROUPS_IN_FLIGHT_MAX: usize = 64;

impl Default for StoreSettings {
    fn default() -> Self {
        let d = forkless_store::StoreConfig::default();
        StoreSettings {
            cache_bytes_per_shard: None,
            journal_bytes_max: d.journal_bytes_max,
            write_buffer_bytes: d.write_buffer_bytes,
            background_nice: d.background_nice,
            writer_priority: d.writer_priority,
            raft: d.raft,
            groups_in_flight: d.raft_groups_in_flight,
        }
    }
}

impl StoreSettings {
    fn validate(&self) -> Result<(), ConfigError> {
        let bad = |m: String| Err(ConfigError::Invalid(m));
        if !(0..=BACKGROUND_NICE_MAX).contains(&self.background_nice) {
            return bad(format!(
                "store.background_nice must be 0 to {BACKGROUND_NICE_MAX} (nice steps below the request path; 0 keeps the same priority), not {}",
                self.background_nice
            ));
        }
        if !(0..=WRITER_PRIORITY_MAX).contains(&self.writer_priority) {
            return bad(format!(
                "store.writer_priority must be 0 to {WRITER_PRIORITY_MAX} (nice steps above the request path; 0 keeps the same priority), not {}",
                self.writer_priority
            ));
        }
        if !(1..=GROUPS_IN_FLIGHT_MAX).contains(&self.groups_in_flight) {
            return bad(format!(
                "store.groups_in_flight must be 1 to {GROUPS_IN_FLIGHT_MAX} (groups a shard's leader keeps proposed and not yet applied), not {}",
                self.groups_in_flight
            ));
        }
        if self.journal_bytes_max < JOURNAL_BYTES_MIN {
            return bad(format!(
                "store.journal_bytes_max must be at least {JOURNAL_BYTES_MIN} (64 MiB, the storage engine's minimum), not {}",
                self.journal_bytes_max
            ));
        }
        if self.write_buffer_bytes < WRITE_BUFFER_BYTES_MIN {
            return bad(format!(
                "store.write_buffer_bytes must be at least {WRITE_BUFFER_BYTES_MIN} (1 MiB; the shards' memtables held in memory on this node), not {}",
                self.write_buffer_bytes
            ));
        }
        if let Some(c) = self.cache_bytes_per_shard.filter(|c| *c < CACHE_BYTES_MIN) {
            return bad(format!(
                "store.cache_bytes_per_shard must be at least {CACHE_BYTES_MIN} (1 MiB), not {c}"
            ));
        }
        Ok(())
    }

    /// The block cache of each of a node's `shards` shards: as set, or
    /// else 32 MiB a shard while the node holds 8 shards or fewer, and
    /// [`CACHE_BYTES_NODE`] shared among them past that (1 MiB a shard at
    /// the least). Each shard's database has a cache of its own (fjall's
    /// caches cannot be shared: their keys do not name the database), so
    /// a fixed size a shard made the node's grow with its shards: 2 GiB at
    /// 64.
    pub fn cache_bytes_per_shard_for(&self, shards: usize) -> u64 {
        self.cache_bytes_per_shard.unwrap_or_else(|| {
            let shards = u64::try_from(shards.max(1)).unwrap_or(u64::MAX);
            (CACHE_BYTES_NODE / shards).clamp(CACHE_BYTES_MIN, CACHE_BYTES_SHARD)
        })
    }
}

/// The block caches of a node's shards together, by default
/// ([`StoreSettings::cache_bytes_per_shard_for`]).
pub const CACHE_BYTES_NODE: u64 = 256 * 1024 * 1024;
/// The most a shard's block cache takes by default (what it took before
/// the default was shared: fjall's tables of one shard rarely need more).
pub const CACHE_BYTES_SHARD: u64 = forkless_store::CACHE_BYTES_PER_SHARD;

/// The file as written. Every field is optional; flags override it.
#[derive(Debug, Clone, Default, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct FileConfig {
    pub data_dir: Option<PathBuf>,
    pub listen: Option<String>,
    pub shard_count: Option<u64>,
    pub node_id: Option<u64>,
    /// Shared by the cluster's nodes; authenticates forwarded requests.
    pub secret: Option<String>,
    #[serde(default)]
    pub limits: Option<Limits>,
    #[serde(default)]
    pub peer: Option<PeerTiming>,
    #[serde(default)]
    pub store: Option<StoreSettings>,
    #[serde(default)]
    pub nodes: Vec<FileNode>,
    #[serde(default)]
    pub shards: Vec<FileShard>,
    /// How many nodes hold a replica of each shard. 2 or more makes every
    /// shard a Raft group on that many nodes, its leader the owner (every
    /// node then needs a `raft_addr`, and `[[shards]]` is left out); 1 is
    /// the static cluster: one copy, owners from the file. Left out: 3
    /// with three nodes or more ([`DEFAULT_REPLICATION_FACTOR`]), else 1.
    pub replication_factor: Option<u64>,
    /// A replicated cluster's Raft timers.
    #[serde(default)]
    pub raft: Option<RaftTimingFile>,
    /// A replicated cluster's pinned placement: the replicas of each shard
    /// listed here, the deterministic spread for the others.
    #[serde(default)]
    pub placement: Vec<FilePlacement>,
    /// Nodes that left a replicated cluster for good (their replicas moved
    /// away by `forkless cluster remove-node`): no longer in `[[nodes]]`,
    /// still named by the `[[placement]]` pins their shards' groups were
    /// made with.
    #[serde(default)]
    pub retired_nodes: Vec<u64>,
}

/// `[[placement]]`: the nodes that hold a replica of one shard (the
/// group's first membership; pinned so that adding a node to the file
/// does not move it).
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct FilePlacement {
    pub shard: u64,
    pub replicas: Vec<u64>,
}

/// `[raft]`: a replicated group's timers, in milliseconds, how much of
/// its log it keeps in memory, and how long a learner left behind is kept
/// (in seconds).
#[derive(Debug, Clone, Copy, Deserialize, PartialEq, Eq)]
#[serde(deny_unknown_fields, default)]
pub struct RaftTimingFile {
    pub heartbeat_ms: u64,
    pub election_timeout_min_ms: u64,
    pub election_timeout_max_ms: u64,
    /// An idle group turns its timers off (on by default).
    pub quiesce: bool,
    /// A group snapshots (checkpoints) every this many entries...
    pub snapshot_every_entries: u64,
    /// ...and its log then forgets (from memory) the entries more than
    /// this many behind: a follower further behind gets a snapshot. Left
    /// out: `RaftLogLimits::for_groups`, by the groups the node holds.
    pub log_kept_entries: Option<u64>,
    /// A learner that moves cut short left behind (no move under way
    /// catching it up) is removed by its shard's leader after this many
    /// seconds so.
    pub learner_kept_s: u64,
}

/// How long a learner that moves cut short left behind is kept by
/// default (`[raft] learner_kept_s`): long enough for an operator to ask
/// a move that failed again and have it take its learner up where it
/// stopped.
pub const LEARNER_KEPT_S: u64 = 120;

/// `[raft]`, checked: what a replicated cluster's groups run with.
struct RaftSection {
    timing: forkless_store::RaftTiming,
    snapshot_every: u64,
    log_kept: Option<u64>,
    learner_kept: std::time::Duration,
}

impl Default for RaftTimingFile {
    fn default() -> Self {
        let d = forkless_store::RaftTiming::default();
        RaftTimingFile {
            heartbeat_ms: d.heartbeat_ms,
            election_timeout_min_ms: d.election_timeout_min_ms,
            election_timeout_max_ms: d.election_timeout_max_ms,
            quiesce: d.quiesce,
            snapshot_every_entries: forkless_store::RaftLogLimits::default().snapshot_every,
            log_kept_entries: None,
            learner_kept_s: LEARNER_KEPT_S,
        }
    }
}

impl RaftTimingFile {
    /// The timers, the log's limits (the snapshot distance and the
    /// entries kept, if set) and how long a learner left behind is kept.
    fn validate(&self) -> Result<RaftSection, ConfigError> {
        let bad = |m: String| Err(ConfigError::Invalid(m));
        let RaftTimingFile {
            heartbeat_ms: h,
            election_timeout_min_ms: lo,
            election_timeout_max_ms: hi,
            quiesce,
            snapshot_every_entries: every,
            log_kept_entries: kept,
            learner_kept_s,
        } = *self;
        if !(1..=604_800).contains(&learner_kept_s) {
            return bad(format!(
                "raft.learner_kept_s must be 1 to 604800 (a week), not {learner_kept_s}"
            ));
        }
        if !(10..=10_000_000).contains(&every) {
            return bad(format!(
                "raft.snapshot_every_entries must be 10 to 10000000, not {every}"
            ));
        }
        if let Some(kept) = kept.filter(|k| *k > 10_000_000) {
            return bad(format!(
                "raft.log_kept_entries must be at most 10000000, not {kept}"
            ));
        }
        if !(10..=10_000).contains(&h) {
            return bad(format!("raft.heartbeat_ms must be 10 to 10000, not {h}"));
        }
        if lo <= h {
            return bad(format!(
                "raft.election_timeout_min_ms ({lo}) must be more than raft.heartbeat_ms ({h}): a follower would stand for election between two heartbeats"
            ));
        }
        if hi <= lo || hi > 60_000 {
            return bad(format!(
                "raft.election_timeout_max_ms ({hi}) must be more than raft.election_timeout_min_ms ({lo}) and at most 60000"
            ));
        }
        Ok(RaftSection {
            timing: forkless_store::RaftTiming {
                heartbeat_ms: h,
                election_timeout_min_ms: lo,
                election_timeout_max_ms: hi,
                quiesce,
            },
            snapshot_every: every,
            log_kept: kept,
            learner_kept: std::time::Duration::from_secs(learner_kept_s),
        })
    }
}

#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct FileNode {
    pub id: u64,
    pub api_addr: String,
    pub peer_addr: String,
    /// Where the node's Raft transport listens (a replicated cluster).
    pub raft_addr: Option<String>,
}

#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct FileShard {
    pub shard: u64,
    pub owner: u64,
    #[serde(default = "one")]
    pub epoch: u64,
}

fn one() -> u64 {
    1
}

#[derive(Debug, thiserror::Error)]
pub enum ConfigError {
    #[error("cannot read config file {path}: {reason}")]
    Read { path: String, reason: String },
    #[error("config file {path}: {reason}")]
    Parse { path: String, reason: String },
    #[error("{0}")]
    Invalid(String),
    /// `--node` names no node of the file's `[[nodes]]`: one it retired
    /// (`retired_nodes`), or none at all.
    #[error("--node {node}: {}", if *retired {
        format!("node {node} retired from this cluster (retired_nodes): a machine joins under a new id")
    } else {
        "no such node in the config's [[nodes]]".to_string()
    })]
    NotListed { node: u64, retired: bool },
}

/// A static cluster, validated.
#[derive(Debug, Clone)]
pub struct ClusterConfig {
    pub nodes: Vec<NodeInfo>,
    pub assignments: Vec<ShardAssignment>,
    pub secret: String,
    /// Set when every shard is a Raft group on several nodes.
    pub replication: Option<Replicated>,
}

/// A replicated cluster: each shard on `factor` nodes, placed by
/// [`Replicated::replicas`].
#[derive(Debug, Clone)]
pub struct Replicated {
    pub factor: usize,
    pub timing: forkless_store::RaftTiming,
    /// `raft.snapshot_every_entries`.
    pub snapshot_every: u64,
    /// `raft.log_kept_entries`, if set.
    pub log_kept: Option<u64>,
    /// `raft.learner_kept_s`.
    pub learner_kept: std::time::Duration,
    /// Every node's Raft address.
    pub raft_addrs: std::collections::BTreeMap<NodeId, SocketAddr>,
    /// The shards whose replicas the file pins (`[[placement]]`).
    pub pinned: std::collections::BTreeMap<ShardId, Vec<NodeId>>,
    /// Nodes that left the cluster for good (`retired_nodes`): not members,
    /// but the pins may name them.
    pub retired: BTreeSet<NodeId>,
}

impl Replicated {
    /// The log's limits of each group of a node that holds `groups` of
    /// them: the entries kept as set, or else shared with the node's
    /// other groups, as the cache of entries is
    /// (`RaftLogLimits::for_groups`).
    pub fn log_for(&self, groups: usize) -> forkless_store::RaftLogLimits {
        let shared = forkless_store::RaftLogLimits::for_groups(groups);
        forkless_store::RaftLogLimits {
            snapshot_every: self.snapshot_every,
            kept: self.log_kept.unwrap_or(shared.kept),
            cache_bytes: shared.cache_bytes,
        }
    }

    /// The nodes holding a replica of `shard`: as the file pins them, else
    /// `factor` nodes in id order, starting at the (shard mod nodes)-th,
    /// so that each node holds as many replicas as any other (within one)
    /// and the first replicas of consecutive shards fall on different
    /// nodes. The spread depends on the node list: a node added to the
    /// file moves it, which is why a running cluster pins its placement
    /// before a node is added (`crate::placement`).
    pub fn replicas(&self, shard: ShardId) -> Vec<NodeId> {
        if let Some(pinned) = self.pinned.get(&shard) {
            return pinned.clone();
        }
        let ids: Vec<NodeId> = self.raft_addrs.keys().copied().collect();
        let n = ids.len();
        (0..self.factor.min(n))
            .map(|i| ids[(shard.get() as usize + i) % n])
            .collect()
    }
}

impl ClusterConfig {
    pub fn node(&self, id: NodeId) -> Option<&NodeInfo> {
        self.nodes.iter().find(|n| n.id == id)
    }
}

/// Everything a node needs to run, resolved and validated.
#[derive(Debug, Clone)]
pub struct ServerConfig {
    pub node_id: NodeId,
    pub data_dir: PathBuf,
    /// The client API address.
    pub listen: SocketAddr,
    /// The peer address (forwarded requests, probes), if distinct.
    pub peer_listen: Option<SocketAddr>,
    pub shard_count: ShardCount,
    pub limits: Limits,
    pub peer: PeerTiming,
    pub store: StoreSettings,
    pub cluster: Option<ClusterConfig>,
}

impl ServerConfig {
    /// How many listeners take connections, each up to
    /// `limits.connections_max`: the client API's, and the peer address's
    /// when it has its own.
    pub fn listeners(&self) -> usize {
        if self.peer_listen.is_some() {
            2
        } else {
            1
        }
    }

    /// The descriptors this node's connections may hold at once (what
    /// [`check_fd_budget`] and [`cached_files_per_shard`] count).
    pub fn connection_fds(&self) -> ConnectionFds {
        let peers = self
            .cluster
            .as_ref()
            .map_or(0, |c| c.nodes.len().saturating_sub(1));
        let raft = match self.cluster.as_ref().and_then(|c| c.replication.as_ref()) {
            Some(_) => {
                forkless_raftnet::AWAITING_HELLO_MAX as u64
                    + (forkless_raftnet::PER_PEER_MAX as u64 + 1) * peers as u64
            }
            None => 0,
        };
        ConnectionFds {
            connections_max: self.limits.connections_max,
            listeners: self.listeners(),
            forwards: peers > 0,
            raft,
        }
    }

    /// The embedded default: one node, one shard, `./forkless-data`,
    /// 127.0.0.1:7070.
    pub fn single_node_default() -> ServerConfig {
        ServerConfig {
            node_id: NodeId::new(0).unwrap_or_else(|| unreachable!()),
            data_dir: PathBuf::from(DEFAULT_DATA_DIR),
            listen: DEFAULT_LISTEN.parse().unwrap_or_else(|_| unreachable!()),
            peer_listen: None,
            shard_count: ShardCount::ONE,
            limits: Limits::default(),
            peer: PeerTiming::default(),
            store: StoreSettings::default(),
            cluster: None,
        }
    }

    /// The directory this node routes by.
    pub fn directory(&self) -> Result<StaticDirectory, ConfigError> {
        match &self.cluster {
            None => Ok(StaticDirectory::single_node(
                self.node_id,
                self.shard_count,
                self.listen.to_string(),
            )),
            Some(c) => StaticDirectory::new(
                self.node_id,
                self.shard_count,
                c.nodes.clone(),
                c.assignments.clone(),
            )
            .map(|d| match c.replication {
                Some(_) => d.always_route(),
                None => d,
            })
            .map_err(|e| ConfigError::Invalid(e.to_string())),
        }
    }
}

pub fn read_file(path: &std::path::Path) -> Result<FileConfig, ConfigError> {
    let text = std::fs::read_to_string(path).map_err(|e| ConfigError::Read {
        path: path.display().to_string(),
        reason: e.to_string(),
    })?;
    parse_file(&text).map_err(|reason| ConfigError::Parse {
        path: path.display().to_string(),
        reason,
    })
}

pub fn parse_file(text: &str) -> Result<FileConfig, String> {
    toml::from_str(text).map_err(|e| e.to_string())
}

pub fn parse_shard_count(n: u64) -> Result<ShardCount, ConfigError> {
    ShardCount::new(n).map_err(|e| ConfigError::Invalid(format!("shard_count: {e}")))
}

fn parse_addr(field: &str, s: &str) -> Result<SocketAddr, ConfigError> {
    s.parse().map_err(|e| {
        ConfigError::Invalid(format!(
            "{field} {s:?} is not an address like 127.0.0.1:7070: {e}"
        ))
    })
}

/// Validates a cluster description: legal shard count, unique node ids and
/// addresses, every shard owned exactly once by a listed node (or spread
/// evenly when `shards` is empty), a secret.
pub fn validate_cluster(
    file: &FileConfig,
    shard_count: ShardCount,
) -> Result<ClusterConfig, ConfigError> {
    let bad = |m: String| Err(ConfigError::Invalid(m));
    if file.nodes.is_empty() {
        return bad("nodes: a cluster needs at least one [[nodes]] entry".into());
    }
    let mut ids = BTreeSet::new();
    let mut addrs = BTreeSet::new();
    let mut nodes = Vec::new();
    for (i, n) in file.nodes.iter().enumerate() {
        let Some(id) = NodeId::new(n.id) else {
            return bad(format!(
                "nodes[{i}].id {} is out of range: node ids are 0 to {}",
                n.id,
                NodeId::MAX
            ));
        };
        if !ids.insert(id) {
            return bad(format!("nodes[{i}].id {id} is listed twice"));
        }
        let api = parse_addr(&format!("nodes[{i}].api_addr"), &n.api_addr)?;
        let peer = parse_addr(&format!("nodes[{i}].peer_addr"), &n.peer_addr)?;
        for a in [api, peer] {
            if !addrs.insert(a) {
                return bad(format!(
                    "nodes[{i}]: address {a} is used twice in the cluster"
                ));
            }
        }
        nodes.push(NodeInfo {
            id,
            api_addr: api.to_string(),
            peer_addr: peer.to_string(),
        });
    }
    let n = shard_count.get() as usize;
    // Left out, a cluster of three nodes or more replicates every shard
    // three times; a static cluster of one copy says `replication_factor
    // = 1`. The errors below name the default when it is what asked.
    let defaulted = file.replication_factor.is_none() && nodes.len() >= 3;
    let factor = file
        .replication_factor
        .or(defaulted.then_some(DEFAULT_REPLICATION_FACTOR));
    let by_default = if defaulted {
        format!(" (the default with {} nodes; set replication_factor = 1 for a static cluster of one copy)", nodes.len())
    } else {
        String::new()
    };
    let replication = match factor {
        None | Some(1) => None,
        Some(0) => return bad("replication_factor must be at least 1".into()),
        Some(f) if f as usize > nodes.len() => {
            return bad(format!(
                "replication_factor {f} is more than the {} node(s) listed: each replica needs a node of its own",
                nodes.len()
            ))
        }
        Some(f) => {
            if !file.shards.is_empty() {
                return bad(format!("shards: a replicated cluster's owners are its shards' Raft leaders, elected; leave [[shards]] out{by_default}"));
            }
            let mut raft_addrs = std::collections::BTreeMap::new();
            for (i, fnode) in file.nodes.iter().enumerate() {
                let Some(a) = &fnode.raft_addr else {
                    return bad(format!(
                        "nodes[{i}].raft_addr is missing: with replication_factor {f}{by_default} every node needs the address its Raft transport listens on"
                    ));
                };
                let a = parse_addr(&format!("nodes[{i}].raft_addr"), a)?;
                if !addrs.insert(a) {
                    return bad(format!(
                        "nodes[{i}]: address {a} is used twice in the cluster"
                    ));
                }
                raft_addrs.insert(nodes[i].id, a);
            }
            let RaftSection {
                timing,
                snapshot_every,
                log_kept,
                learner_kept,
            } = file.raft.unwrap_or_default().validate()?;
            let retired = retired_nodes(&file.retired_nodes, &ids)?;
            let placeable: BTreeSet<NodeId> = ids.union(&retired).copied().collect();
            Some(Replicated {
                factor: f as usize,
                timing,
                snapshot_every,
                log_kept,
                learner_kept,
                raft_addrs,
                pinned: pinned_placement(&file.placement, f as usize, n, &placeable)?,
                retired,
            })
        }
    };
    if replication.is_none() && file.raft.is_some() {
        return bad("raft: the [raft] timers are for a replicated cluster; set replication_factor to 2 or more, or leave [raft] out".into());
    }
    if replication.is_none() && !file.retired_nodes.is_empty() {
        return bad("retired_nodes: nodes retire from a replicated cluster (its pins may name them); a static cluster's file just leaves a node out".into());
    }
    if replication.is_none() && !file.placement.is_empty() {
        return bad("placement: [[placement]] pins a replicated cluster's replicas; set replication_factor to 2 or more, or leave it out (a static cluster names owners in [[shards]])".into());
    }
    let assignments = if let Some(r) = &replication {
        // No owner until a leader is elected: the first replica that is a
        // member stands in at epoch 0 (else the first member, when every
        // node the pin names retired), which any elected leader's term (1
        // or more) replaces.
        (0..n)
            .map(|s| ShardAssignment {
                owner: r
                    .replicas(ShardId(s as u32))
                    .into_iter()
                    .find(|id| ids.contains(id))
                    .unwrap_or(nodes[0].id),
                epoch: Epoch(0),
            })
            .collect()
    } else if file.shards.is_empty() {
        // Spread evenly: shard s goes to the (s mod nodes)-th node by id.
        let mut sorted: Vec<_> = nodes.iter().map(|x| x.id).collect();
        sorted.sort();
        (0..n)
            .map(|s| ShardAssignment {
                owner: sorted[s % sorted.len()],
                epoch: Epoch(1),
            })
            .collect()
    } else {
        let mut slots: Vec<Option<ShardAssignment>> = vec![None; n];
        for (i, s) in file.shards.iter().enumerate() {
            if s.shard >= n as u64 {
                return bad(format!(
                    "shards[{i}].shard {} is outside shard_count {n} (shards are 0 to {})",
                    s.shard,
                    n - 1
                ));
            }
            let owner = NodeId::new(s.owner).filter(|o| ids.contains(o));
            let Some(owner) = owner else {
                return bad(format!(
                    "shards[{i}].owner {} is not a listed node",
                    s.owner
                ));
            };
            if s.epoch == 0 {
                return bad(format!("shards[{i}].epoch must be at least 1"));
            }
            let slot = &mut slots[s.shard as usize];
            if slot.is_some() {
                return bad(format!(
                    "shards[{i}]: shard {} is assigned twice; every shard needs exactly one owner",
                    s.shard
                ));
            }
            *slot = Some(ShardAssignment {
                owner,
                epoch: Epoch(s.epoch),
            });
        }
        let missing: Vec<_> = slots
            .iter()
            .enumerate()
            .filter(|(_, a)| a.is_none())
            .map(|(s, _)| s.to_string())
            .collect();
        if !missing.is_empty() {
            return bad(format!(
                "shards: shard(s) {} have no owner; list every shard 0 to {} or leave [[shards]] out to spread them evenly",
                missing.join(", "),
                n - 1
            ));
        }
        slots.into_iter().flatten().collect()
    };
    let secret = match &file.secret {
        Some(s) => {
            check_secret(s)?;
            s.clone()
        }
        None if file.nodes.len() == 1 => String::new(),
        None => return bad("secret: a cluster of more than one node needs a shared secret to authenticate forwarded requests".into()),
    };
    Ok(ClusterConfig {
        nodes,
        assignments,
        secret,
        replication,
    })
}

/// Validates `retired_nodes`: node ids, each once, none of them listed in
/// `[[nodes]]` (a retired node is not a member).
fn retired_nodes(
    entries: &[u64],
    members: &BTreeSet<NodeId>,
) -> Result<BTreeSet<NodeId>, ConfigError> {
    let mut retired = BTreeSet::new();
    for (i, &r) in entries.iter().enumerate() {
        let Some(id) = NodeId::new(r) else {
            return Err(ConfigError::Invalid(format!(
                "retired_nodes[{i}]: {r} is out of range: node ids are 0 to {}",
                NodeId::MAX
            )));
        };
        if members.contains(&id) {
            return Err(ConfigError::Invalid(format!(
                "retired_nodes[{i}]: node {r} is also in [[nodes]]: a retired node is no member (leave it out of [[nodes]])"
            )));
        }
        if !retired.insert(id) {
            return Err(ConfigError::Invalid(format!(
                "retired_nodes[{i}]: node {r} is listed twice"
            )));
        }
    }
    Ok(retired)
}

/// Validates `[[placement]]`: each entry a shard of the cluster, listed
/// once, on `factor` distinct nodes, listed or retired.
fn pinned_placement(
    entries: &[FilePlacement],
    factor: usize,
    shards: usize,
    nodes: &BTreeSet<NodeId>,
) -> Result<std::collections::BTreeMap<ShardId, Vec<NodeId>>, ConfigError> {
    let bad = |m: String| Err(ConfigError::Invalid(m));
    let mut pinned = std::collections::BTreeMap::new();
    for (i, p) in entries.iter().enumerate() {
        if p.shard >= shards as u64 {
            return bad(format!(
                "placement[{i}].shard {} is outside shard_count {shards} (shards are 0 to {})",
                p.shard,
                shards - 1
            ));
        }
        let shard = ShardId(p.shard as u32);
        if p.replicas.len() != factor {
            return bad(format!(
                "placement[{i}].replicas names {} node(s) for shard {}: replication_factor is {factor}",
                p.replicas.len(),
                p.shard
            ));
        }
        let mut seen = BTreeSet::new();
        let mut ids = Vec::with_capacity(factor);
        for &r in &p.replicas {
            let Some(id) = NodeId::new(r).filter(|id| nodes.contains(id)) else {
                return bad(format!(
                    "placement[{i}].replicas: node {r} is not a listed node (nor a retired one)"
                ));
            };
            if !seen.insert(id) {
                return bad(format!(
                    "placement[{i}].replicas names node {r} twice: each replica needs a node of its own"
                ));
            }
            ids.push(id);
        }
        if pinned.insert(shard, ids).is_some() {
            return bad(format!("placement[{i}]: shard {} is pinned twice", p.shard));
        }
    }
    Ok(pinned)
}

/// The cluster secret travels as a header value: leading or trailing
/// whitespace would be trimmed off by the peer that reads it, and a control
/// character cannot be sent at all, so either would make every forward and
/// probe fail authentication. Refused here instead, naming why.
fn check_secret(s: &str) -> Result<(), ConfigError> {
    let bad = |m: String| Err(ConfigError::Invalid(m));
    if s.starts_with(char::is_whitespace) || s.ends_with(char::is_whitespace) {
        return bad("secret has leading or trailing whitespace, which a peer reading it from a header would not see; remove it".into());
    }
    if let Some((i, c)) = s.char_indices().find(|(_, c)| c.is_control()) {
        return bad(format!(
            "secret contains a control character ({:?} at byte {i}), which cannot be sent in a header; use printable characters",
            c
        ));
    }
    if s.len() < 16 {
        return bad("secret must be at least 16 characters".into());
    }
    Ok(())
}

/// Resolves a node's config from an optional file and the member to run.
pub fn resolve(
    file: Option<FileConfig>,
    node: Option<u64>,
    overrides: Overrides,
) -> Result<ServerConfig, ConfigError> {
    let file = file.unwrap_or_default();
    let mut cfg = ServerConfig::single_node_default();
    let shard_count = match overrides.shard_count.or(file.shard_count) {
        Some(n) => parse_shard_count(n)?,
        None => ShardCount::ONE,
    };
    cfg.shard_count = shard_count;
    if let Some(l) = file.limits {
        cfg.limits = l;
    }
    if let Some(p) = file.peer {
        cfg.peer = p;
    }
    if let Some(st) = file.store {
        cfg.store = st;
    }
    if let Some(n) = overrides.background_nice {
        cfg.store.background_nice = n;
    }
    if let Some(n) = overrides.writer_priority {
        cfg.store.writer_priority = n;
    }
    if let Some(raft) = overrides.store_raft {
        cfg.store.raft = raft;
    }
    cfg.store.validate()?;
    overrides.apply_limits(&mut cfg.limits);
    if let Some(t) = overrides.forward_timeout_ms {
        cfg.peer.forward_timeout_ms = t;
    }
    let node = node.or(file.node_id);
    if !file.nodes.is_empty() {
        let cluster = validate_cluster(&file, shard_count)?;
        let Some(node) = node else {
            return Err(ConfigError::Invalid(
                "the config describes a cluster: say which member to run with --node <id>".into(),
            ));
        };
        let id = NodeId::new(node)
            .ok_or_else(|| ConfigError::Invalid(format!("--node {node} is out of range")))?;
        let retired = cluster
            .replication
            .as_ref()
            .is_some_and(|r| r.retired.contains(&id));
        let me = cluster
            .node(id)
            .ok_or(ConfigError::NotListed { node, retired })?
            .clone();
        cfg.node_id = id;
        cfg.listen = parse_addr("api_addr", &me.api_addr)?;
        let peer = parse_addr("peer_addr", &me.peer_addr)?;
        cfg.peer_listen = (peer != cfg.listen).then_some(peer);
        cfg.data_dir = PathBuf::from(DEFAULT_DATA_DIR).join(format!("node-{id}"));
        cfg.cluster = Some(cluster);
    } else if let Some(n) = node {
        cfg.node_id = NodeId::new(n).ok_or_else(|| {
            ConfigError::Invalid(format!(
                "node id {n} is out of range (0 to {})",
                NodeId::MAX
            ))
        })?;
    }
    if let Some(d) = overrides.data_dir.or(file.data_dir) {
        cfg.data_dir = d;
    }
    if cfg.cluster.is_none() {
        if let Some(l) = overrides.listen.or(file.listen) {
            cfg.listen = parse_addr("listen", &l)?;
        }
    } else if overrides.listen.is_some() {
        return Err(ConfigError::Invalid("--listen cannot be combined with a cluster config: the node's api_addr is its listen address".into()));
    }
    if !(1..=REQUEST_READ_TIMEOUT_MS_MAX).contains(&cfg.limits.request_read_timeout_ms) {
        return Err(ConfigError::Invalid(format!(
            "limits.request_read_timeout_ms must be positive and at most {REQUEST_READ_TIMEOUT_MS_MAX} (one hour)"
        )));
    }
    for (field, v) in [
        ("limits.idle_timeout_ms", cfg.limits.idle_timeout_ms),
        ("limits.write_timeout_ms", cfg.limits.write_timeout_ms),
    ] {
        if !(1..=CONNECTION_TIMEOUT_MS_MAX).contains(&v) {
            return Err(ConfigError::Invalid(format!(
                "{field} must be positive and at most {CONNECTION_TIMEOUT_MS_MAX} (one hour), not {v}"
            )));
        }
    }
    for (field, v) in [
        ("limits.connections_max", cfg.limits.connections_max),
        ("limits.read_page_bytes_max", cfg.limits.read_page_bytes_max),
        ("limits.long_polls_max", cfg.limits.long_polls_max),
    ] {
        if v == 0 {
            return Err(ConfigError::Invalid(format!("{field} must be positive")));
        }
    }
    if cfg.limits.batch_events_max == 0 || cfg.limits.event_payload_bytes_max == 0 {
        return Err(ConfigError::Invalid("limits must be positive".into()));
    }
    let (body, page, payload) = (
        cfg.limits.request_body_bytes_max,
        cfg.limits.read_page_bytes_max,
        cfg.limits.event_payload_bytes_max,
    );
    if body > REQUEST_BODY_BYTES_CAP {
        return Err(ConfigError::Invalid(format!(
            "limits.request_body_bytes_max must be at most {REQUEST_BODY_BYTES_CAP} ({} MiB), not {body}: a request's events are one Raft entry, which a leader sends to its followers whole",
            REQUEST_BODY_BYTES_CAP >> 20
        )));
    }
    if page.saturating_add(payload) > READ_PAGE_BYTES_CAP {
        return Err(ConfigError::Invalid(format!(
            "limits.read_page_bytes_max ({page}) plus limits.event_payload_bytes_max ({payload}) must be at most {READ_PAGE_BYTES_CAP} ({} MiB): a page may hold one payload past its budget, and a page read through another node is relayed whole",
            READ_PAGE_BYTES_CAP >> 20
        )));
    }
    if cfg.limits.event_payload_bytes_max > cfg.limits.request_body_bytes_max {
        return Err(ConfigError::Invalid(
            "limits.event_payload_bytes_max cannot exceed limits.request_body_bytes_max".into(),
        ));
    }
    if cfg.limits.body_bytes_in_flight_max < body {
        return Err(ConfigError::Invalid(format!(
            "limits.body_bytes_in_flight_max ({}) must be at least limits.request_body_bytes_max ({body}): a body of the largest size must fit",
            cfg.limits.body_bytes_in_flight_max
        )));
    }
    let largest_page = page.saturating_add(page_overhead_bytes_max(
        &cfg.limits,
        cfg.limits.read_events_max,
    ));
    if cfg.limits.answer_bytes_in_flight_max < largest_page {
        return Err(ConfigError::Invalid(format!(
            "limits.answer_bytes_in_flight_max ({}) must be at least {largest_page}: a page of the largest size must fit (limits.read_page_bytes_max, plus limits.event_payload_bytes_max, plus {EVENT_FRAME_BYTES_MAX} bytes for each of limits.read_events_max events, plus {PAGE_FRAME_BYTES_MAX})",
            cfg.limits.answer_bytes_in_flight_max,
        )));
    }
    Ok(cfg)
}

/// The descriptors a node's connections may hold at once:
/// `connections_max` on each of its `listeners` (the client API's, and the
/// peer address's when it has its own), as many again for its forwards
/// and probes to its peers when it has any (each peer's share,
/// `forward::share`, keeps them within one `connections_max` in all), and
/// its Raft transport's `raft` (the connections its listener holds before
/// their hello and from each peer, and one to each peer).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ConnectionFds {
    pub connections_max: usize,
    pub listeners: usize,
    pub forwards: bool,
    pub raft: u64,
}

impl ConnectionFds {
    /// How many sets of `connections_max` there are.
    fn sets(&self) -> u64 {
        self.listeners.max(1) as u64 + u64::from(self.forwards)
    }

    fn total(&self) -> u64 {
        (self.connections_max as u64)
            .saturating_mul(self.sets())
            .saturating_add(self.raft)
    }

    /// Says what they are, for an error.
    fn describe(&self) -> String {
        let (c, n) = (self.connections_max, self.listeners.max(1));
        let mut s = format!("limits.connections_max {c} on each of {n} listeners");
        if self.forwards {
            s.push_str(&format!(", {c} for forwards and probes to the peers"));
        }
        if self.raft > 0 {
            s.push_str(&format!(", {} for the Raft transport", self.raft));
        }
        s
    }
}

/// Raises the soft open-file limit (RLIMIT_NOFILE) to the hard one and
/// checks that the connections' descriptors plus [`FD_RESERVE`] fit in
/// it. Returns the limit now in force.
pub fn reserve_file_descriptors(connections: ConnectionFds) -> Result<u64, ConfigError> {
    let limit = raise_nofile_limit().map_err(|e| {
        ConfigError::Invalid(format!(
            "cannot read the open-file limit (RLIMIT_NOFILE): {e}"
        ))
    })?;
    check_fd_budget(connections, limit)?;
    Ok(limit)
}

/// Whether the connections' descriptors plus [`FD_RESERVE`] fit in an
/// open-file limit of `limit`.
pub fn check_fd_budget(connections: ConnectionFds, limit: u64) -> Result<(), ConfigError> {
    let need = connections.total().saturating_add(FD_RESERVE);
    let fixed = FD_RESERVE.saturating_add(connections.raft);
    if need > limit && limit <= fixed {
        return Err(ConfigError::Invalid(format!(
            "the open-file limit (RLIMIT_NOFILE) of {limit} is too low: {} plus {FD_RESERVE} file descriptors \
             kept for the store need {need}; raise the limit (ulimit -n, LimitNOFILE)",
            connections.describe()
        )));
    }
    if need > limit {
        return Err(ConfigError::Invalid(format!(
            "{} plus {FD_RESERVE} file descriptors kept for the store is {need}, over the open-file \
             limit (RLIMIT_NOFILE) of {limit}: lower limits.connections_max (--connections-max) to at \
             most {} or raise the limit (ulimit -n)",
            connections.describe(),
            limit
                .saturating_sub(FD_RESERVE)
                .saturating_sub(connections.raft)
                / connections.sets()
        )));
    }
    Ok(())
}

/// Descriptors a shard's database holds besides its cached table files:
/// its journal, the next one during a rotation, its lock file, and its
/// version file while it is rewritten (measured: about 2 a shard idle).
pub const FDS_PER_SHARD: u64 = 4;
/// The fewest table files a shard's database keeps open (fjall refuses
/// fewer than 10); one that needs more opens and closes them as it reads.
pub const CACHED_FILES_MIN: u64 = 16;
/// The most: fjall's own default on Linux.
pub const CACHED_FILES_MAX: u64 = 900;

/// How many table files each shard's database keeps open in its cache
/// of descriptors: the open-file `limit` less the `connections`'
/// descriptors and [`FD_RESERVE`], shared
/// evenly among `shards`, less [`FDS_PER_SHARD`]; between
/// [`CACHED_FILES_MIN`] and [`CACHED_FILES_MAX`]. fjall keeps up to 900 a
/// database by default, whatever the limit: a node of many shards
/// reading over many tables could take every descriptor, and a shard
/// whose journal then could not rotate would stop. Not counted, and
/// left to the reserve's slack: a shard's own segment log from before
/// the node log (up to 34 open while it is read), the tables a flush or
/// a compaction is writing, a descriptor a reader still holds after the
/// cache let it go, and replicas moved to the node after its start
/// (counted at start only). `Err` (with the minimum) when the limit is
/// too low even for the minimum: the caller warns, since a node that ran
/// before must still start.
pub fn cached_files_per_shard(
    limit: u64,
    fds: ConnectionFds,
    shards: usize,
) -> Result<usize, (usize, String)> {
    let shards = (shards.max(1)) as u64;
    let connections = fds.total();
    let left = limit.saturating_sub(connections).saturating_sub(FD_RESERVE);
    let per = (left / shards).saturating_sub(FDS_PER_SHARD);
    let as_usize = |n: u64| usize::try_from(n).unwrap_or(usize::MAX);
    if per < CACHED_FILES_MIN {
        let need = connections
            .saturating_add(FD_RESERVE)
            .saturating_add(shards.saturating_mul(FDS_PER_SHARD + CACHED_FILES_MIN));
        return Err((
            as_usize(CACHED_FILES_MIN),
            format!(
                "the open-file limit (RLIMIT_NOFILE) of {limit} is too low for {shards} shards: {}, \
                 {FD_RESERVE} descriptors kept for the store, and \
                 {} a shard ({FDS_PER_SHARD} of its own and {CACHED_FILES_MIN} table files) need {need}; a read-heavy \
                 load could run out of descriptors. Raise the limit (ulimit -n, LimitNOFILE) to {need} or more, or \
                 lower limits.connections_max",
                fds.describe(),
                FDS_PER_SHARD + CACHED_FILES_MIN
            ),
        ));
    }
    Ok(as_usize(per.min(CACHED_FILES_MAX)))
}

#[cfg(unix)]
fn raise_nofile_limit() -> std::io::Result<u64> {
    let mut l = libc::rlimit {
        rlim_cur: 0,
        rlim_max: 0,
    };
    // SAFETY: getrlimit/setrlimit with a valid pointer to a local struct.
    unsafe {
        if libc::getrlimit(libc::RLIMIT_NOFILE, &mut l) != 0 {
            return Err(std::io::Error::last_os_error());
        }
        if l.rlim_cur < l.rlim_max {
            let raised = libc::rlimit {
                rlim_cur: l.rlim_max,
                rlim_max: l.rlim_max,
            };
            if libc::setrlimit(libc::RLIMIT_NOFILE, &raised) == 0 {
                l.rlim_cur = l.rlim_max;
            }
        }
    }
    #[allow(clippy::unnecessary_cast)] // rlim_t is u64 on Linux, not everywhere
    Ok(l.rlim_cur as u64)
}

#[cfg(not(unix))]
fn raise_nofile_limit() -> std::io::Result<u64> {
    Ok(u64::MAX)
}

/// Command-line / environment values, which win over the file.
#[derive(Debug, Clone, Default)]
pub struct Overrides {
    pub data_dir: Option<PathBuf>,
    pub listen: Option<String>,
    pub shard_count: Option<u64>,
    pub event_payload_bytes_max: Option<usize>,
    pub request_body_bytes_max: Option<usize>,
    pub batch_events_max: Option<usize>,
    pub forward_timeout_ms: Option<u64>,
    pub request_read_timeout_ms: Option<u64>,
    pub background_nice: Option<i32>,
    pub writer_priority: Option<i32>,
    pub store_raft: Option<bool>,
    pub connections_max: Option<usize>,
    pub idle_timeout_ms: Option<u64>,
    pub write_timeout_ms: Option<u64>,
    pub read_page_bytes_max: Option<usize>,
    pub long_polls_max: Option<usize>,
    pub body_bytes_in_flight_max: Option<usize>,
    pub answer_bytes_in_flight_max: Option<usize>,
}

impl Overrides {
    fn apply_limits(&self, l: &mut Limits) {
        if let Some(v) = self.event_payload_bytes_max {
            l.event_payload_bytes_max = v;
        }
        if let Some(v) = self.request_body_bytes_max {
            l.request_body_bytes_max = v;
        }
        if let Some(v) = self.batch_events_max {
            l.batch_events_max = v;
        }
        if let Some(v) = self.request_read_timeout_ms {
            l.request_read_timeout_ms = v;
        }
        if let Some(v) = self.connections_max {
            l.connections_max = v;
        }
        if let Some(v) = self.idle_timeout_ms {
            l.idle_timeout_ms = v;
        }
        if let Some(v) = self.write_timeout_ms {
            l.write_timeout_ms = v;
        }
        if let Some(v) = self.read_page_bytes_max {
            l.read_page_bytes_max = v;
        }
        if let Some(v) = self.long_polls_max {
            l.long_polls_max = v;
        }
        if let Some(v) = self.body_bytes_in_flight_max {
            l.body_bytes_in_flight_max = v;
        }
        if let Some(v) = self.answer_bytes_in_flight_max {
            l.answer_bytes_in_flight_max = v;
        }
    }
}

/// The replication factor of a cluster file that lists three nodes or
/// more and leaves `replication_factor` out: a shard then survives the
/// loss of any one of its replicas.
pub const DEFAULT_REPLICATION_FACTOR: u64 = 3;

#[cfg(test)]
mod tests {
    use super::*;

    fn check(text: &str, node: Option<u64>, expect_err: Option<&str>) -> Option<ServerConfig> {
        let file = parse_file(text).map_err(ConfigError::Invalid);
        let r = file.and_then(|f| resolve(Some(f), node, Overrides::default()));
        match (r, expect_err) {
            (Ok(c), None) => Some(c),
            (Err(e), Some(want)) => {
                assert!(
                    e.to_string().contains(want),
                    "error {e:?} should mention {want:?}"
                );
                None
            }
            (r, want) => panic!("got {r:?}, wanted error {want:?}"),
        }
    }

    const NODES: &str = r#"
secret = "0123456789abcdef"
shard_count = 4
[[nodes]]
id = 1
api_addr = "127.0.0.1:7071"
peer_addr = "127.0.0.1:7171"
[[nodes]]
id = 2
api_addr = "127.0.0.1:7072"
peer_addr = "127.0.0.1:7172"
"#;

    /// Three nodes with Raft addresses, `extra` before the nodes.
    /// Shard `s`'s replicas as node ids.
    fn replica_ids(r: &Replicated, s: u32) -> Vec<u16> {
        r.replicas(ShardId(s)).iter().map(|n| n.get()).collect()
    }

    fn replicated(extra: &str) -> String {
        let mut t = format!("secret = \"0123456789abcdef\"\nshard_count = 4\n{extra}\n");
        for id in 1..=3 {
            t.push_str(&format!(
                "[[nodes]]\nid = {id}\napi_addr = \"127.0.0.1:71{id}0\"\npeer_addr = \"127.0.0.1:71{id}1\"\nraft_addr = \"127.0.0.1:71{id}2\"\n"
            ));
        }
        t
    }

    #[test]
    fn replicated_clusters_are_validated_and_spread_their_replicas() {
        let c = check(&replicated("replication_factor = 3"), Some(2), None).expect("valid");
        let r = c
            .cluster
            .as_ref()
            .and_then(|c| c.replication.clone())
            .expect("replicated");
        let ids = |s: u32| replica_ids(&r, s);
        assert_eq!(
            (ids(0), ids(1), ids(2), ids(3)),
            (vec![1, 2, 3], vec![2, 3, 1], vec![3, 1, 2], vec![1, 2, 3])
        );
        assert_eq!(r.timing, forkless_store::RaftTiming::default());
        assert_eq!(
            r.learner_kept,
            std::time::Duration::from_secs(LEARNER_KEPT_S)
        );
        // No owner until one is elected: every epoch 0.
        let a = &c.cluster.as_ref().expect("cluster").assignments;
        assert!(a.iter().all(|a| a.epoch == Epoch(0)));
        assert!(forkless_routing::Directory::routing_active(
            &c.directory().expect("directory")
        ));

        let two = check(&replicated("replication_factor = 2"), Some(1), None).expect("valid");
        let r2 = two.cluster.and_then(|c| c.replication).expect("replicated");
        assert_eq!(
            r2.replicas(ShardId(2))
                .iter()
                .map(|n| n.get())
                .collect::<Vec<_>>(),
            vec![3, 1]
        );
        // One copy is the static cluster.
        let one = check(&replicated("replication_factor = 1"), Some(1), None).expect("valid");
        assert!(one.cluster.expect("cluster").replication.is_none());

        let timers = "replication_factor = 3\n[raft]\nheartbeat_ms = 50\nelection_timeout_min_ms = 200\nelection_timeout_max_ms = 400\nquiesce = false\nsnapshot_every_entries = 500\nlog_kept_entries = 0\nlearner_kept_s = 30";
        let t = check(&replicated(timers), Some(1), None).expect("valid");
        assert_eq!(
            t.cluster
                .as_ref()
                .and_then(|c| c.replication.as_ref())
                .map(|r| r.log_for(256)),
            Some(forkless_store::RaftLogLimits {
                snapshot_every: 500,
                kept: 0,
                cache_bytes: 256 << 10,
            })
        );
        assert_eq!(
            t.cluster
                .as_ref()
                .and_then(|c| c.replication.as_ref())
                .map(|r| r.learner_kept),
            Some(std::time::Duration::from_secs(30))
        );
        // Left out: 100,000 entries and a 1 MiB cache a group up to 64
        // groups on the node, 6,400,000 and 64 MiB shared past that.
        assert_eq!(r.log_for(1), forkless_store::RaftLogLimits::default());
        assert_eq!(r.log_for(64), forkless_store::RaftLogLimits::default());
        let l = r.log_for(256);
        assert_eq!((l.kept, l.cache_bytes), (25_000, 256 << 10));
        let l = r.log_for(4096);
        assert_eq!((l.kept, l.cache_bytes), (10_000, 128 << 10));
        assert_eq!(
            t.cluster.and_then(|c| c.replication).map(|r| r.timing),
            Some(forkless_store::RaftTiming {
                heartbeat_ms: 50,
                election_timeout_min_ms: 200,
                election_timeout_max_ms: 400,
                quiesce: false,
            })
        );

        for (extra, why) in [
            ("replication_factor = 4", "replication_factor 4 is more than the 3 node(s)"),
            ("replication_factor = 0", "replication_factor must be at least 1"),
            ("replication_factor = 3\n[raft]\nheartbeat_ms = 100\nelection_timeout_min_ms = 100", "must be more than raft.heartbeat_ms"),
            ("replication_factor = 3\n[raft]\nelection_timeout_min_ms = 500\nelection_timeout_max_ms = 400", "raft.election_timeout_max_ms (400)"),
            ("replication_factor = 3\n[raft]\nheartbeat_ms = 5", "raft.heartbeat_ms must be 10 to 10000"),
            ("replication_factor = 1\n[raft]\nheartbeat_ms = 50", "the [raft] timers are for a replicated cluster"),
            ("replication_factor = 3\n[raft]\nsnapshot_every_entries = 5", "raft.snapshot_every_entries must be 10 to 10000000, not 5"),
            ("replication_factor = 3\n[raft]\nlog_kept_entries = 20000000", "raft.log_kept_entries must be at most 10000000"),
            ("replication_factor = 3\n[raft]\nlearner_kept_s = 0", "raft.learner_kept_s must be 1 to 604800 (a week), not 0"),
        ] {
            check(&replicated(extra), Some(1), Some(why));
        }
        let missing = replicated("replication_factor = 3").replacen(
            "raft_addr = \"127.0.0.1:7122\"\n",
            "",
            1,
        );
        check(&missing, Some(1), Some("nodes[1].raft_addr is missing"));
        let reused =
            replicated("replication_factor = 3").replacen("127.0.0.1:7122", "127.0.0.1:7121", 1);
        check(
            &reused,
            Some(1),
            Some("address 127.0.0.1:7121 is used twice"),
        );
        let with_shards = format!(
            "{}[[shards]]\nshard = 0\nowner = 1\n",
            replicated("replication_factor = 3")
        );
        check(&with_shards, Some(1), Some("leave [[shards]] out"));
    }

    #[test]
    fn a_pinned_placement_keeps_its_shards_where_it_says_and_is_validated() {
        let pin = |p: &str| format!("{}{p}", replicated("replication_factor = 2"));
        let c = check(
            &pin("[[placement]]\nshard = 1\nreplicas = [3, 1]\n"),
            Some(1),
            None,
        )
        .expect("valid");
        let r = c.cluster.and_then(|c| c.replication).expect("replicated");
        let ids = |s: u32| replica_ids(&r, s);
        // Shard 1 as pinned, the others spread.
        assert_eq!(
            (ids(0), ids(1), ids(2)),
            (vec![1, 2], vec![3, 1], vec![3, 1])
        );
        for (p, why) in [
            ("[[placement]]\nshard = 4\nreplicas = [1, 2]\n", "placement[0].shard 4 is outside shard_count 4"),
            ("[[placement]]\nshard = 0\nreplicas = [1, 2, 3]\n", "placement[0].replicas names 3 node(s) for shard 0: replication_factor is 2"),
            ("[[placement]]\nshard = 0\nreplicas = [1, 9]\n", "placement[0].replicas: node 9 is not a listed node"),
            ("[[placement]]\nshard = 0\nreplicas = [2, 2]\n", "placement[0].replicas names node 2 twice"),
            ("[[placement]]\nshard = 0\nreplicas = [1, 2]\n[[placement]]\nshard = 0\nreplicas = [2, 3]\n", "placement[1]: shard 0 is pinned twice"),
            ("[[placement]]\nshard = 0\nreplicas = [1, 2]\nowner = 1\n", "unknown field `owner`"),
        ] {
            check(&pin(p), Some(1), Some(why));
        }
        let static_cluster = format!(
            "{}[[placement]]\nshard = 0\nreplicas = [1]\n",
            replicated("replication_factor = 1")
        );
        check(
            &static_cluster,
            Some(1),
            Some("[[placement]] pins a replicated cluster's replicas"),
        );
    }

    #[test]
    fn a_retired_node_may_be_pinned_but_is_no_member() {
        let pinned = |top: &str| {
            format!(
                "{}[[placement]]\nshard = 0\nreplicas = [9, 1]\n",
                replicated(&format!("replication_factor = 2\n{top}"))
            )
        };
        let c = check(&pinned("retired_nodes = [9]"), Some(1), None).expect("valid");
        let cluster = c.cluster.as_ref().expect("cluster");
        let r = cluster.replication.as_ref().expect("replicated");
        assert_eq!(replica_ids(r, 0), vec![9, 1]);
        assert!(cluster.node(NodeId::new(9).unwrap()).is_none());
        // The stand-in owner is the first replica that is a member.
        assert_eq!(cluster.assignments[0].owner.get(), 1);
        c.directory().expect("a directory");
        for (top, why) in [
            (
                "",
                "placement[0].replicas: node 9 is not a listed node (nor a retired one)",
            ),
            (
                "retired_nodes = [9, 9]",
                "retired_nodes[1]: node 9 is listed twice",
            ),
            (
                "retired_nodes = [2]",
                "retired_nodes[0]: node 2 is also in [[nodes]]",
            ),
        ] {
            check(&pinned(top), Some(1), Some(why));
        }
        check(
            &pinned("retired_nodes = [9]"),
            Some(9),
            Some("--node 9: node 9 retired from this cluster"),
        );
        check(
            &replicated("replication_factor = 1\nretired_nodes = [9]"),
            Some(1),
            Some("retired_nodes: nodes retire from a replicated cluster"),
        );
    }

    #[test]
    fn three_nodes_or_more_replicate_three_times_unless_told_otherwise() {
        let c = check(&replicated(""), Some(1), None).expect("valid");
        let r = c.cluster.and_then(|c| c.replication).expect("replicated");
        assert_eq!(r.factor, DEFAULT_REPLICATION_FACTOR as usize);
        assert_eq!(r.replicas(ShardId(1)).len(), 3);
        // Two nodes: the static cluster, as before.
        assert!(check(NODES, Some(1), None)
            .and_then(|c| c.cluster)
            .expect("cluster")
            .replication
            .is_none());
        // A file of the static cluster of before (no Raft addresses,
        // perhaps its owners listed) is refused by name, with the way to
        // keep it as it was.
        let without_raft: String = replicated("")
            .lines()
            .filter(|l| !l.starts_with("raft_addr"))
            .map(|l| format!("{l}\n"))
            .collect();
        let hint = "(the default with 3 nodes; set replication_factor = 1 for a static cluster of one copy)";
        check(&without_raft, Some(1), Some(hint));
        check(
            &without_raft,
            Some(1),
            Some("nodes[0].raft_addr is missing"),
        );
        let listed = (0..4).fold(without_raft.clone(), |t, s| {
            format!("{t}[[shards]]\nshard = {s}\nowner = {}\n", s % 3 + 1)
        });
        check(&listed, Some(1), Some(hint));
        let kept = format!("replication_factor = 1\n{listed}");
        assert!(check(&kept, Some(1), None)
            .and_then(|c| c.cluster)
            .expect("cluster")
            .replication
            .is_none());
    }

    #[test]
    fn cluster_files_are_validated() {
        let c = check(NODES, Some(2), None).unwrap();
        assert_eq!(c.listen.to_string(), "127.0.0.1:7072");
        assert_eq!(c.peer_listen.unwrap().to_string(), "127.0.0.1:7172");
        let owners: Vec<_> = c
            .cluster
            .unwrap()
            .assignments
            .iter()
            .map(|a| a.owner.get())
            .collect();
        assert_eq!(owners, vec![1, 2, 1, 2]);
        check(NODES, None, Some("--node"));
        check(NODES, Some(3), Some("no such node"));
        check(
            &NODES.replace("shard_count = 4", "shard_count = 3"),
            Some(1),
            Some("power of two"),
        );
        check(
            &NODES.replace("secret = \"0123456789abcdef\"", ""),
            Some(1),
            Some("secret"),
        );
        check(
            &NODES.replace("127.0.0.1:7172", "127.0.0.1:7171"),
            Some(1),
            Some("used twice"),
        );
        check(
            &NODES.replace("127.0.0.1:7172", "nowhere"),
            Some(1),
            Some("nodes[1].peer_addr"),
        );
        check(
            &NODES.replace("id = 2", "id = 1"),
            Some(1),
            Some("listed twice"),
        );
        check(
            &format!("{NODES}\n[[shards]]\nshard = 0\nowner = 1\n"),
            Some(1),
            Some("have no owner"),
        );
        let all = "[[shards]]\nshard = 0\nowner = 1\n[[shards]]\nshard = 1\nowner = 2\nepoch = 3\n[[shards]]\nshard = 2\nowner = 2\n[[shards]]\nshard = 3\nowner = 1\n";
        let c = check(&format!("{NODES}\n{all}"), Some(1), None).unwrap();
        assert_eq!(
            c.cluster.unwrap().assignments[1],
            ShardAssignment {
                owner: NodeId::new(2).unwrap(),
                epoch: Epoch(3)
            }
        );
        check(
            &format!("{NODES}\n{all}[[shards]]\nshard = 3\nowner = 2\n"),
            Some(1),
            Some("assigned twice"),
        );
        check(
            &format!("{NODES}\n[[shards]]\nshard = 9\nowner = 1\n"),
            Some(1),
            Some("outside shard_count"),
        );
        check(
            &format!("{NODES}\n[[shards]]\nshard = 0\nowner = 7\n"),
            Some(1),
            Some("not a listed node"),
        );
        check(
            &format!("{NODES}\nbogus = 1\n"),
            Some(1),
            Some("unknown field"),
        );
    }

    #[test]
    fn a_secret_that_would_not_survive_a_header_is_refused_naming_the_field() {
        let with = |secret: &str| {
            let text = NODES.replace(
                "secret = \"0123456789abcdef\"",
                &format!("secret = {}", toml::Value::String(secret.into())),
            );
            let file = parse_file(&text).expect("the file parses");
            resolve(Some(file), Some(1), Overrides::default())
        };
        for (bad, why) in [
            (" 0123456789abcdef", "leading or trailing whitespace"),
            ("0123456789abcdef ", "leading or trailing whitespace"),
            ("0123456789abcdef\n", "leading or trailing whitespace"),
            ("\t0123456789abcdef", "leading or trailing whitespace"),
            ("0123456789\u{0}abcdef", "control character"),
            ("0123456789\u{7f}abcdef", "control character"),
            ("0123456789\rabcdef", "control character"),
            ("0123456789\u{85}abcdef", "control character"),
        ] {
            let e = with(bad).expect_err(&format!("secret {bad:?} was accepted"));
            let m = e.to_string();
            assert!(m.starts_with("secret"), "{bad:?}: {m}");
            assert!(m.contains(why), "{bad:?}: {m}");
        }
        // Spaces inside are fine: they survive a header.
        let c = with("correct horse battery staple").expect("an inner space is fine");
        assert_eq!(
            c.cluster.map(|c| c.secret),
            Some("correct horse battery staple".to_string())
        );
    }

    #[test]
    fn connection_and_page_limits_come_from_file_or_flag_and_are_checked() {
        let d = resolve(None, None, Overrides::default()).unwrap();
        assert_eq!(
            (
                d.limits.connections_max,
                d.limits.idle_timeout_ms,
                d.limits.write_timeout_ms,
                d.limits.read_page_bytes_max,
                d.limits.long_polls_max
            ),
            (1024, 60_000, 30_000, 4 << 20, 1024)
        );
        let text = "[limits]\nconnections_max = 10\nidle_timeout_ms = 5\nwrite_timeout_ms = 6\nread_page_bytes_max = 7\nlong_polls_max = 8\n";
        let c = check(text, None, None).unwrap();
        assert_eq!(
            (
                c.limits.connections_max,
                c.limits.idle_timeout_ms,
                c.limits.write_timeout_ms,
                c.limits.read_page_bytes_max,
                c.limits.long_polls_max
            ),
            (10, 5, 6, 7, 8)
        );
        let o = Overrides {
            connections_max: Some(20),
            long_polls_max: Some(3),
            body_bytes_in_flight_max: Some(9 << 20),
            answer_bytes_in_flight_max: Some(10 << 20),
            ..Default::default()
        };
        let c = resolve(Some(parse_file(text).unwrap()), None, o).unwrap();
        assert_eq!((c.limits.connections_max, c.limits.long_polls_max), (20, 3));
        assert_eq!(c.limits.body_bytes_in_flight_max, 9 << 20);
        assert_eq!(c.limits.answer_bytes_in_flight_max, 10 << 20);
        for (bad, want) in [
            (
                "connections_max = 0",
                "limits.connections_max must be positive",
            ),
            (
                "long_polls_max = 0",
                "limits.long_polls_max must be positive",
            ),
            (
                "body_bytes_in_flight_max = 1000",
                "limits.body_bytes_in_flight_max (1000) must be at least limits.request_body_bytes_max (8388608)",
            ),
            (
                "answer_bytes_in_flight_max = 6443135",
                "limits.answer_bytes_in_flight_max (6443135) must be at least 6443136: a page of the largest size must fit",
            ),
            (
                "read_page_bytes_max = 0",
                "limits.read_page_bytes_max must be positive",
            ),
            (
                "idle_timeout_ms = 0",
                "limits.idle_timeout_ms must be positive",
            ),
            (
                "write_timeout_ms = 3600001",
                "limits.write_timeout_ms must be positive",
            ),
            (
                "request_body_bytes_max = 33554433",
                "limits.request_body_bytes_max must be at most 33554432 (32 MiB), not 33554433",
            ),
            (
                "read_page_bytes_max = 32505857",
                "limits.read_page_bytes_max (32505857) plus limits.event_payload_bytes_max (1048576) must be at most 33554432 (32 MiB)",
            ),
        ] {
            check(&format!("[limits]\n{bad}\n"), None, Some(want));
        }
        assert!(check_fd_budget(fds(1024, 1), 1280).is_ok());
        let e = check_fd_budget(fds(1025, 1), 1280).unwrap_err().to_string();
        assert!(e.contains("limits.connections_max 1025"), "{e}");
        assert!(e.contains("RLIMIT_NOFILE"), "{e}");
        assert!(e.contains("at most 1024"), "{e}");
        assert!(check_fd_budget(fds(usize::MAX, 1), u64::MAX - 1).is_err());
        // A peer listener of its own takes as many again.
        assert!(check_fd_budget(fds(512, 2), 1280).is_ok());
        let e = check_fd_budget(fds(1024, 2), 1280).unwrap_err().to_string();
        assert!(
            e.contains("each of 2 listeners") && e.contains("at most 512"),
            "{e}"
        );
        // So do the forwards to peers, and the Raft transport has its own.
        let clustered = ConnectionFds {
            forwards: true,
            raft: 70,
            ..fds(512, 2)
        };
        let e = check_fd_budget(clustered, 1280).unwrap_err().to_string();
        assert!(
            e.contains("512 for forwards and probes to the peers")
                && e.contains("70 for the Raft transport")
                && e.contains("at most 318"),
            "{e}"
        );
        assert!(check_fd_budget(
            ConnectionFds {
                connections_max: 318,
                ..clustered
            },
            1280
        )
        .is_ok());
        // What a config gives: a replicated three-node cluster, its peer
        // listeners apart.
        let c = check(&replicated("replication_factor = 3"), Some(2), None).expect("valid");
        assert_eq!(
            c.connection_fds(),
            ConnectionFds {
                connections_max: 1024,
                listeners: c.listeners(),
                forwards: true,
                // Two peers: 2 connections from each, 1 to each.
                raft: 64 + 2 * (2 + 1),
            }
        );
        // A single node: its listener alone.
        assert_eq!(
            ServerConfig::single_node_default().connection_fds(),
            fds(1024, 1)
        );
    }

    #[test]
    fn the_shards_table_files_share_what_the_connections_leave() {
        // One shard: fjall's own default, the most.
        assert_eq!(cached_files_per_shard(20_000, fds(1024, 1), 1), Ok(900));
        // 128 shards: (20000 - 1024 - 256) / 128 = 146, less 4 of their own.
        assert_eq!(cached_files_per_shard(20_000, fds(1024, 1), 128), Ok(142));
        // The peers' listener counts its connections too.
        assert_eq!(cached_files_per_shard(20_000, fds(1024, 2), 128), Ok(134));
        // Exactly the minimum: 1280 + 64 x 20.
        assert_eq!(cached_files_per_shard(2_560, fds(1024, 1), 64), Ok(16));
        // Too low: the minimum, and what would do.
        let (files, why) = cached_files_per_shard(2_559, fds(1024, 1), 64).unwrap_err();
        assert_eq!(files, 16);
        assert!(
            why.contains("too low for 64 shards") && why.contains("need 2560"),
            "{why}"
        );
        // No shard counted, or a limit below the connections: no panic.
        assert_eq!(cached_files_per_shard(20_000, fds(1024, 1), 0), Ok(900));
        assert!(cached_files_per_shard(100, fds(1024, 1), 1).is_err());
    }

    /// `connections_max` on each of `listeners`, no peers.
    fn fds(connections_max: usize, listeners: usize) -> ConnectionFds {
        ConnectionFds {
            connections_max,
            listeners,
            forwards: false,
            raft: 0,
        }
    }

    #[test]
    fn single_node_files_and_overrides() {
        let c = check(
            "shard_count = 8\nlisten = \"127.0.0.1:9000\"\n[limits]\nbatch_events_max = 5\n",
            None,
            None,
        )
        .unwrap();
        assert_eq!(
            (
                c.shard_count.get(),
                c.listen.port(),
                c.limits.batch_events_max
            ),
            (8, 9000, 5)
        );
        assert!(c.cluster.is_none());
        let o = Overrides {
            shard_count: Some(16),
            listen: Some("127.0.0.1:9001".into()),
            ..Default::default()
        };
        let c = resolve(Some(parse_file("shard_count = 8").unwrap()), None, o).unwrap();
        assert_eq!((c.shard_count.get(), c.listen.port()), (16, 9001));
        let bad = Overrides {
            shard_count: Some(12),
            ..Default::default()
        };
        assert!(resolve(None, None, bad)
            .unwrap_err()
            .to_string()
            .contains("power of two"));
        let d = resolve(None, None, Overrides::default()).unwrap();
        assert_eq!(d.listen.to_string(), DEFAULT_LISTEN);
        assert_eq!(d.data_dir, PathBuf::from(DEFAULT_DATA_DIR));
        assert_eq!(d.limits.request_read_timeout_ms, 30_000);
    }

    #[test]
    fn store_settings_come_from_the_file_or_the_flag_and_are_checked() {
        let d = resolve(None, None, Overrides::default()).unwrap();
        assert_eq!(d.store, StoreSettings::default());
        assert_eq!(d.store.background_nice, 10);
        assert_eq!(d.store.writer_priority, 5);
        assert_eq!(d.store.write_buffer_bytes, 256 << 20);
        // The block cache: 32 MiB a shard up to 8 shards, 256 MiB shared
        // past that, 1 MiB a shard at the least; as set when it is.
        for (shards, each) in [
            (0, 32),
            (1, 32),
            (8, 32),
            (16, 16),
            (64, 4),
            (256, 1),
            (4096, 1),
        ] {
            assert_eq!(
                d.store.cache_bytes_per_shard_for(shards),
                each << 20,
                "{shards}"
            );
        }
        assert!(!d.store.raft, "Raft groups are not the default yet");
        let c = check(
            "[store]\nbackground_nice = 0\nwriter_priority = 0\ncache_bytes_per_shard = 1048576\njournal_bytes_max = 134217728\nwrite_buffer_bytes = 16777216\nraft = true\n",
            None,
            None,
        )
        .unwrap();
        assert_eq!(
            c.store,
            StoreSettings {
                cache_bytes_per_shard: Some(1 << 20),
                journal_bytes_max: 128 << 20,
                write_buffer_bytes: 16 << 20,
                background_nice: 0,
                writer_priority: 0,
                raft: true,
                groups_in_flight: forkless_store::RAFT_GROUPS_IN_FLIGHT,
            }
        );
        assert_eq!(c.store.cache_bytes_per_shard_for(64), 1 << 20, "as set");
        // The flag (or FORKLESS_STORE_RAFT) wins over the file.
        let off = Overrides {
            store_raft: Some(false),
            ..Default::default()
        };
        let file = parse_file("[store]\nraft = true\n").unwrap();
        assert!(!resolve(Some(file), None, off).unwrap().store.raft);
        // The flag wins over the file, and is checked the same way.
        let file = || parse_file("[store]\nbackground_nice = 3\n").unwrap();
        let o = |n| Overrides {
            background_nice: Some(n),
            ..Default::default()
        };
        assert_eq!(
            resolve(Some(file()), None, o(19))
                .unwrap()
                .store
                .background_nice,
            19
        );
        assert!(resolve(Some(file()), None, o(20))
            .unwrap_err()
            .to_string()
            .contains("store.background_nice must be 0 to 19"));
        let w = |n| Overrides {
            writer_priority: Some(n),
            ..Default::default()
        };
        assert_eq!(
            resolve(Some(file()), None, w(20))
                .unwrap()
                .store
                .writer_priority,
            20
        );
        assert!(resolve(Some(file()), None, w(21))
            .unwrap_err()
            .to_string()
            .contains("store.writer_priority must be 0 to 20"));
        for (bad, field) in [
            (
                "writer_priority = -1",
                "store.writer_priority must be 0 to 20",
            ),
            (
                "background_nice = -1",
                "store.background_nice must be 0 to 19",
            ),
            (
                "background_nice = 20",
                "store.background_nice must be 0 to 19",
            ),
            (
                "journal_bytes_max = 1000",
                "store.journal_bytes_max must be at least 67108864",
            ),
            (
                "cache_bytes_per_shard = 0",
                "store.cache_bytes_per_shard must be at least 1048576",
            ),
            (
                "write_buffer_bytes = 1048575",
                "store.write_buffer_bytes must be at least 1048576",
            ),
        ] {
            check(&format!("[store]\n{bad}\n"), None, Some(field));
        }
        // A misspelt setting is refused, not ignored.
        assert!(parse_file("[store]\nbackground_niceness = 3\n")
            .unwrap_err()
            .contains("unknown field"));
    }

    #[test]
    fn the_request_read_timeout_is_set_by_file_or_flag_and_must_be_positive() {
        let c = check("[limits]\nrequest_read_timeout_ms = 500\n", None, None).unwrap();
        assert_eq!(c.limits.request_read_timeout_ms, 500);
        let o = Overrides {
            request_read_timeout_ms: Some(250),
            ..Default::default()
        };
        let file = parse_file("[limits]\nrequest_read_timeout_ms = 500\n").unwrap();
        assert_eq!(
            resolve(Some(file), None, o)
                .unwrap()
                .limits
                .request_read_timeout_ms,
            250
        );
        for bad in ["0", "3600001", "18446744073709551615"] {
            check(
                &format!("[limits]\nrequest_read_timeout_ms = {bad}\n"),
                None,
                Some("request_read_timeout_ms must be positive and at most 3600000"),
            );
        }
    }
}
