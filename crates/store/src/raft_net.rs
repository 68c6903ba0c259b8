//! How a shard's Raft group reaches the group's other replicas: the
//! messages one replica sends another ([`Rpc`], [`RpcReply`]), the
//! transport the store is given to carry them ([`Peers`]: the store knows
//! nothing of sockets), and openraft's network over it ([`PeerNetwork`],
//! one per group and target).
//!
//! A call that the transport cannot deliver, or whose answer does not come
//! within the time openraft gives it, is an error, never an answer: a vote
//! or pre-vote that was not heard is never counted as granted.

use crate::raft_log::GroupConfig;
use futures_util::future::BoxFuture;
use openraft::errors::{
    NetworkError, RPCError, ReplicationClosed, StreamingError, Timeout, Unreachable,
};
use openraft::network::{RPCOption, RPCTypes};
use openraft::raft::{
    AppendEntriesRequest, AppendEntriesResponse, SnapshotResponse, TransferLeaderRequest,
    TransferLeaderResponse, VoteRequest, VoteResponse,
};
use openraft::type_config::alias::{SnapshotOf, VoteOf};
use openraft::{BasicNode, OptionalSend, RaftNetworkFactory, RaftNetworkV2};
use serde::{Deserialize, Serialize};
use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::Duration;

/// A shard's snapshot as openraft hands it around (`crate::snapshot`): on
/// the replica that made it, what it is streamed from; on one that
/// received it, the staged file it is installed from.
pub struct ShardSnapshot(pub(crate) SnapshotData);

pub(crate) enum SnapshotData {
    Local(Arc<crate::snapshot::Source>),
    Received(std::path::PathBuf),
}

impl std::fmt::Debug for ShardSnapshot {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match &self.0 {
            SnapshotData::Local(_) => f.write_str("ShardSnapshot(local)"),
            SnapshotData::Received(p) => write!(f, "ShardSnapshot(received: {})", p.display()),
        }
    }
}

/// One piece of a snapshot a leader streams to a replica: chunks are sent
/// one at a time, in order, each answered; the last (`done`, with no
/// data) asks the replica to install what it staged, and is answered
/// with the install's outcome.
#[derive(Debug, Serialize, Deserialize)]
pub struct SnapshotChunk {
    /// The sender's vote (openraft's `install_full_snapshot` checks it).
    pub vote: VoteOf<GroupConfig>,
    pub meta: openraft::type_config::alias::SnapshotMetaOf<GroupConfig>,
    /// Its place in the stream, from 0.
    pub n: u64,
    pub data: bytes::Bytes,
    pub done: bool,
}

impl SnapshotChunk {
    /// Which stream it belongs to: a chunk of another is not staged with
    /// this one's.
    pub(crate) fn stream(&self) -> String {
        format!(
            "vote {}-{}, as of {:?}",
            self.vote.leader_id.term,
            self.vote.leader_id.voted_for,
            self.meta.last_log_id.map(|l| (l.leader_id.term, l.index))
        )
    }
}

/// A message from one replica of a group to another.
#[derive(Debug, Serialize, Deserialize)]
pub enum Rpc {
    AppendEntries(AppendEntriesRequest<GroupConfig>),
    Vote(VoteRequest<GroupConfig>),
    PreVote(VoteRequest<GroupConfig>),
    /// A node's heartbeat to a peer: one a node pair and heartbeat
    /// interval, whatever the number of groups (sent for no group).
    Beat(Beat),
    /// The leader hands its leadership to one of the group's voters (sent
    /// to every voter).
    TransferLeader(TransferLeaderRequest<GroupConfig>),
    /// A piece of a snapshot the leader streams to this replica.
    Snapshot(SnapshotChunk),
    /// From a replica whose data directory is new (`crate::fresh`) to its
    /// group's leader: replicate to `node` from the start, though it once
    /// had more of the log.
    Reverted {
        node: u64,
    },
}

/// What a node's heartbeat says: the groups it leads quietly, and at
/// which term (`crate::quiet`).
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct Beat {
    /// (shard, term) of each group the sender leads with its timers off.
    pub quiet: Vec<(u32, u64)>,
    /// Those of them whose membership has the receiver (a voter or a
    /// learner): a replica it may not hold yet (a move added it, or its
    /// disk was lost), which a quiet leader sends nothing to.
    pub yours: Vec<u32>,
    /// (shard, term) of every group the sender leads now, quiet or not:
    /// the receiver answers which of them it could not take the
    /// leadership of ([`RpcReply::Beat`]), for the sender's leader
    /// balancer, and routes them to the sender from then on (a later term
    /// wins; a new leader's node sends a beat at once, so that a node
    /// holding no replica of the shard learns it without waiting for a
    /// probe).
    pub led: Vec<(u32, u64)>,
}

impl Rpc {
    /// What kind of call it is, for errors and metrics.
    pub fn kind(&self) -> &'static str {
        match self {
            Rpc::AppendEntries(_) => "append_entries",
            Rpc::Vote(_) => "vote",
            Rpc::PreVote(_) => "pre_vote",
            Rpc::Beat(_) => "beat",
            Rpc::TransferLeader(_) => "transfer_leader",
            Rpc::Snapshot(_) => "snapshot",
            Rpc::Reverted { .. } => "reverted",
        }
    }

    fn rpc_type(&self) -> RPCTypes {
        match self {
            Rpc::AppendEntries(_) => RPCTypes::AppendEntries,
            Rpc::Vote(_) | Rpc::PreVote(_) => RPCTypes::Vote,
            Rpc::Beat(_) => RPCTypes::AppendEntries,
            Rpc::TransferLeader(_) => RPCTypes::TransferLeader,
            Rpc::Snapshot(_) => RPCTypes::InstallSnapshot,
            Rpc::Reverted { .. } => RPCTypes::AppendEntries,
        }
    }
}

/// The receiving replica's answer.
#[derive(Debug, Serialize, Deserialize)]
pub enum RpcReply {
    AppendEntries(AppendEntriesResponse<GroupConfig>),
    Vote(VoteResponse<GroupConfig>),
    /// A heartbeat was heard. `cannot_lead`: of the groups the beat's
    /// sender leads ([`Beat::led`]), those the receiver could not take the
    /// leadership of now: it holds no replica of them, or a new one that
    /// has not caught up (`crate::fresh`: it refuses a handover). `wake`:
    /// of the groups the sender leads quietly ([`Beat::quiet`]), those
    /// whose replica here is quiet with entries it has not applied (its
    /// node restarted after a crash): the sender wakes them, so that
    /// their heartbeats tell it the commit index.
    Beat {
        cannot_lead: Vec<u32>,
        wake: Vec<u32>,
    },
    TransferLeader(TransferLeaderResponse<GroupConfig>),
    /// A snapshot's chunk was staged (`None`), or the snapshot installed.
    Snapshot(Option<SnapshotResponse<GroupConfig>>),
    /// The leader replicates to the replica from the start.
    Reverted,
}

/// Why a call brought no answer.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum CallError {
    /// The peer could not be reached (no connection, or it broke): openraft
    /// backs off before it tries again.
    Unreachable(String),
    /// The peer took the call but answered with an error of its own (it does
    /// not hold the group, or the group is stopping).
    Remote(String),
    /// No answer within the call's time.
    Timeout,
}

/// A call on its way: its answer, once it comes.
pub type Answer = BoxFuture<'static, Result<RpcReply, CallError>>;

/// An AppendEntries call, and a follower's answer to one.
pub type RaftAppend = AppendEntriesRequest<GroupConfig>;
pub type RaftAppendAnswer = AppendEntriesResponse<GroupConfig>;

/// Carries calls to other nodes: a connection per node pair, shared by
/// every group (built outside the store, by the node's transport).
pub trait Peers: Send + Sync + 'static {
    /// Sends `rpc` for `group` to node `target`: done once the call is on
    /// its way, behind every call sent before it to that node (calls to
    /// one node reach it in the order they were sent). The answer it
    /// returns waits at most `within`, from now, for the call's answer.
    fn send(
        &self,
        target: u64,
        group: u32,
        rpc: Rpc,
        within: Duration,
    ) -> BoxFuture<'static, Result<Answer, CallError>>;

    /// Whether this node's connection to `target` is known to be down:
    /// it broke, or the last try to make one failed, and none was made
    /// since. False when that is not known (no connection was ever made,
    /// or one is being made now).
    fn link_down(&self, _target: u64) -> bool {
        false
    }

    /// Sends `rpc` for `group` to node `target` and waits at most
    /// `within` for its answer.
    fn call(
        &self,
        target: u64,
        group: u32,
        rpc: Rpc,
        within: Duration,
    ) -> BoxFuture<'static, Result<RpcReply, CallError>> {
        let sent = self.send(target, group, rpc, within);
        Box::pin(async move { sent.await?.await })
    }
}

/// How the shards of a replicated node reach their other replicas.
#[derive(Clone)]
pub struct Replication {
    /// This node's id in every group it is a replica of.
    pub me: u64,
    /// Every shard's replicas, by id, with their addresses: the same on
    /// every node (a group is initialized with it, on every replica alike).
    pub members: Arc<dyn Fn(forkless_types::ShardId) -> BTreeMap<u64, BasicNode> + Send + Sync>,
    pub peers: Arc<dyn Peers>,
    pub timing: RaftTiming,
    pub log: RaftLogLimits,
    /// Set once this node shuts down and hands its leaderships away
    /// (`forkless_raftnet::balance::drain`): from then on none of its
    /// replicas takes a leadership. It stands for no election, refuses a
    /// handover to itself, and answers its peers' heartbeats that it
    /// cannot lead (a leader's balancer hands a shard only to a replica
    /// whose node answered a beat made since it led it, so nothing is
    /// handed back).
    pub draining: Arc<std::sync::atomic::AtomicBool>,
    /// Notified when one of this node's replicas comes to lead its group
    /// (its group's watcher, `raft_group::watch_stop`): the node heartbeat
    /// then goes out at once (`forkless_raftnet::quiesce::run`), telling
    /// every peer.
    pub beat_now: Arc<tokio::sync::Notify>,
}

/// How much of its log a replicated group keeps in memory: it snapshots
/// (checkpoints) every `snapshot_every` entries, and then forgets the
/// entries more than `kept` behind the snapshot; a follower further
/// behind than that catches up by a snapshot of the whole shard. Of the
/// entries it holds, the latest `cache_bytes` of bodies stay in memory
/// whole (what a leader sends its followers from), the rest as their
/// places in the node log (32 bytes each).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct RaftLogLimits {
    pub snapshot_every: u64,
    pub kept: u64,
    pub cache_bytes: usize,
}

impl RaftLogLimits {
    /// The most entries the groups of a node keep together by default,
    /// past their snapshots ([`RaftLogLimits::for_groups`]): about 200
    /// MiB of places.
    pub const KEPT_NODE: u64 = 6_400_000;
    /// The fewest entries a group keeps by default, however many groups
    /// its node holds.
    pub const KEPT_MIN: u64 = 10_000;
    /// The most bytes of entry bodies the groups of a node cache together
    /// by default.
    pub const CACHE_NODE: usize = 64 << 20;
    /// The least a group caches by default.
    pub const CACHE_MIN: usize = 128 << 10;

    /// The limits of each of a node's `groups` groups by default: the
    /// defaults' 100,000 entries and 1 MiB cache while the node holds 64
    /// groups or fewer, and past that [`Self::KEPT_NODE`] entries and
    /// [`Self::CACHE_NODE`] shared evenly among them, down to
    /// [`Self::KEPT_MIN`] and [`Self::CACHE_MIN`] each. A group holds its
    /// entries in memory (`crate::raft_log`), so limits per group alone
    /// made a node's memory grow with its shards: about 4.8 MiB a busy
    /// group, 1.2 GiB at 256. A group of a node with more shards takes a
    /// share of its writes, so fewer entries still cover about the same
    /// time away.
    pub fn for_groups(groups: usize) -> RaftLogLimits {
        let d = RaftLogLimits::default();
        let n = groups.max(1);
        let n64 = u64::try_from(n).unwrap_or(u64::MAX);
        RaftLogLimits {
            kept: (Self::KEPT_NODE / n64).clamp(Self::KEPT_MIN, d.kept),
            cache_bytes: (Self::CACHE_NODE / n).clamp(Self::CACHE_MIN, d.cache_bytes),
            ..d
        }
    }
}

impl Default for RaftLogLimits {
    /// A group's log then holds about 120,000 entries' places in memory
    /// however long it runs (32 bytes each once out of its 1 MiB cache:
    /// about 4 MiB; a purge openraft delays while it replicates may hold
    /// more for a while), and a follower away for up to 100,000 entries
    /// (about 24 s of one shard's writes from 16 clients on the 2-core
    /// bench machine, `BENCHMARKS.md`, "A follower away catches up from
    /// the log") catches up from the log rather than by a snapshot of the
    /// whole shard.
    fn default() -> Self {
        RaftLogLimits {
            snapshot_every: 20_000,
            kept: 100_000,
            cache_bytes: 1 << 20,
        }
    }
}

impl std::fmt::Debug for Replication {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Replication")
            .field("me", &self.me)
            .field("timing", &self.timing)
            .finish_non_exhaustive()
    }
}

/// openraft's network of one group: a client per target over [`Peers`].
#[derive(Clone)]
pub(crate) struct PeerNetwork {
    pub(crate) me: u64,
    pub(crate) group: u32,
    pub(crate) peers: Arc<dyn Peers>,
    /// Why this replica may not stand for election now, given its last
    /// log index (a new replica with a leader's entries that it has not
    /// caught up with: `crate::fresh`); its vote and pre-vote requests
    /// are then not sent.
    pub(crate) campaign: Arc<dyn Fn(Option<u64>) -> Option<String> + Send + Sync>,
}

/// One group's client to one target.
pub(crate) struct PeerClient {
    net: PeerNetwork,
    target: u64,
}

impl RaftNetworkFactory<GroupConfig> for PeerNetwork {
    type Network = PeerClient;

    async fn new_client(&mut self, target: u64, _node: &BasicNode) -> PeerClient {
        PeerClient {
            net: self.clone(),
            target,
        }
    }
}

impl PeerClient {
    /// Refuses to ask for a vote (or pre-vote) while this replica may not
    /// stand for election ([`PeerNetwork::campaign`]): the candidate gets
    /// no vote, as from a peer it cannot reach.
    fn may_campaign(&self, rpc: &VoteRequest<GroupConfig>) -> Result<(), RPCError<GroupConfig>> {
        match (self.net.campaign)(rpc.last_log_id.map(|l| l.index)) {
            Some(why) => Err(RPCError::Unreachable(Unreachable::from_string(why))),
            None => Ok(()),
        }
    }

    async fn call(&self, rpc: Rpc, option: &RPCOption) -> Result<RpcReply, RPCError<GroupConfig>> {
        self.call_within(rpc, option.hard_ttl()).await
    }

    async fn call_within(
        &self,
        rpc: Rpc,
        within: Duration,
    ) -> Result<RpcReply, RPCError<GroupConfig>> {
        let action = rpc.rpc_type();
        let r = self
            .net
            .peers
            .call(self.target, self.net.group, rpc, within)
            .await;
        r.map_err(|e| self.net.rpc_error(e, action, self.target, within))
    }
}

impl PeerNetwork {
    fn rpc_error(
        &self,
        e: CallError,
        action: RPCTypes,
        target: u64,
        within: Duration,
    ) -> RPCError<GroupConfig> {
        match e {
            CallError::Unreachable(why) => RPCError::Unreachable(Unreachable::from_string(why)),
            CallError::Remote(why) => RPCError::Network(NetworkError::from_string(why)),
            CallError::Timeout => RPCError::Timeout(Timeout {
                action,
                id: self.me,
                target,
                timeout: within,
            }),
        }
    }
}

/// AppendEntries calls one group's leader keeps unanswered to one
/// follower ([`PeerClient::stream_append`]); a call also waits while the
/// entry bytes of those in flight are [`APPEND_BYTES_MAX`] or more.
pub const APPENDS_IN_FLIGHT: usize = 8;

/// One AppendEntries sent in a leader's stream, and what its answer
/// acknowledges.
struct SentAppend {
    prev: Option<openraft::type_config::alias::LogIdOf<GroupConfig>>,
    last: Option<openraft::type_config::alias::LogIdOf<GroupConfig>>,
    /// Where the call was cut to fit [`APPEND_BYTES_MAX`], if it was.
    cut: Option<openraft::type_config::alias::LogIdOf<GroupConfig>>,
    bytes: usize,
    answer: Result<RpcReply, CallError>,
}

/// The state of one leader's stream of AppendEntries to one follower.
struct AppendPipe<S> {
    net: PeerNetwork,
    target: u64,
    within: Duration,
    input: S,
    /// The calls sent and not yet answered, oldest first.
    sent: futures_util::stream::FuturesOrdered<BoxFuture<'static, SentAppend>>,
    bytes: usize,
    /// No more calls are sent: openraft's input ended, a call was cut
    /// (openraft continues from the partial success in a new stream), or
    /// one could not be sent (`failed`, yielded after the answers before).
    done: bool,
    failed: Option<RPCError<GroupConfig>>,
}

type AppendItem = Result<openraft::raft::StreamAppendResult<GroupConfig>, RPCError<GroupConfig>>;

impl<S> AppendPipe<S>
where
    S: futures_util::Stream<Item = AppendEntriesRequest<GroupConfig>> + Unpin,
{
    /// The next answer, in the order the calls were sent; `None` once the
    /// stream is over.
    async fn next(&mut self) -> Option<(AppendItem, bool)> {
        use futures_util::StreamExt;
        loop {
            let room = !self.done
                && self.sent.len() < APPENDS_IN_FLIGHT
                && (self.sent.is_empty() || self.bytes < APPEND_BYTES_MAX);
            if !room && self.sent.is_empty() {
                return self.failed.take().map(|e| (Err(e), true));
            }
            tokio::select! {
                biased;
                Some(a) = self.sent.next(), if !self.sent.is_empty() => {
                    self.bytes -= a.bytes;
                    return Some(self.answered(a));
                }
                // Cancel-safe: the input is openraft's `unfold` stream,
                // which keeps a request being made across polls.
                req = self.input.next(), if room => match req {
                    None => self.done = true,
                    Some(req) => self.send(req).await,
                },
            }
        }
    }

    async fn send(&mut self, mut req: AppendEntriesRequest<GroupConfig>) {
        let prev = req.prev_log_id;
        let last = req.entries.last().map(|e| e.log_id).or(prev);
        let cut = within_budget(&mut req);
        let bytes: usize = req.entries.iter().map(entry_bytes).sum();
        let sent = self
            .net
            .peers
            .send(
                self.target,
                self.net.group,
                Rpc::AppendEntries(req),
                self.within,
            )
            .await;
        match sent {
            Ok(answer) => {
                self.bytes += bytes;
                self.sent.push_back(Box::pin(async move {
                    SentAppend {
                        prev,
                        last,
                        cut,
                        bytes,
                        answer: answer.await,
                    }
                }));
                // A cut call is answered as a partial success, from which
                // openraft starts a new stream.
                if cut.is_some() {
                    self.done = true;
                }
            }
            Err(e) => {
                self.done = true;
                self.failed =
                    Some(
                        self.net
                            .rpc_error(e, RPCTypes::AppendEntries, self.target, self.within),
                    );
            }
        }
    }

    /// An answer as openraft's stream takes it, and whether it ends the
    /// stream (anything but a success does).
    fn answered(&self, a: SentAppend) -> (AppendItem, bool) {
        let reply = match a.answer {
            Err(e) => {
                let e = self
                    .net
                    .rpc_error(e, RPCTypes::AppendEntries, self.target, self.within);
                return (Err(e), true);
            }
            Ok(RpcReply::AppendEntries(AppendEntriesResponse::Success)) if a.cut.is_some() => {
                AppendEntriesResponse::PartialSuccess(a.cut)
            }
            Ok(RpcReply::AppendEntries(r)) => r,
            Ok(other) => return (Err(unexpected(other, "append_entries")), true),
        };
        let r = reply.into_stream_result(a.prev, a.last);
        let ends = r.is_err();
        (Ok(r), ends)
    }
}

fn unexpected(reply: RpcReply, wanted: &str) -> RPCError<GroupConfig> {
    RPCError::Network(NetworkError::from_string(format!(
        "the peer answered a {wanted} call with {reply:?}"
    )))
}

/// The most entry bytes one AppendEntries call carries (openraft bounds
/// a call by its count of entries, and an entry may be a whole group
/// commit, up to [`crate::GROUP_COMMIT_BYTES_MAX`]): a longer request is
/// sent in part, and answered as a partial success, which openraft
/// continues from. A transport's frames must hold this plus one entry.
pub const APPEND_BYTES_MAX: usize = 32 * 1024 * 1024;

/// About what an entry takes in a call.
fn entry_bytes(e: &openraft::type_config::alias::EntryOf<GroupConfig>) -> usize {
    64 + match &e.payload {
        openraft::EntryPayload::Normal(p) => p.0.len(),
        openraft::EntryPayload::Membership(_) => 1024,
        openraft::EntryPayload::Blank => 0,
    }
}

/// Cuts `rpc`'s entries to those within [`APPEND_BYTES_MAX`] (at least
/// one), and returns the last log id kept if any were cut.
fn within_budget(
    rpc: &mut AppendEntriesRequest<GroupConfig>,
) -> Option<openraft::type_config::alias::LogIdOf<GroupConfig>> {
    let mut bytes = 0;
    let keep = rpc
        .entries
        .iter()
        .position(|e| {
            bytes += entry_bytes(e);
            bytes > APPEND_BYTES_MAX
        })
        .map(|over| over.max(1))?;
    if keep >= rpc.entries.len() {
        return None;
    }
    rpc.entries.truncate(keep);
    rpc.entries.last().map(|e| e.log_id)
}

impl RaftNetworkV2<GroupConfig> for PeerClient {
    type SnapshotData = ShardSnapshot;

    /// Pipelined: each AppendEntries openraft makes is sent at once, up to
    /// [`APPENDS_IN_FLIGHT`] unanswered (the follower hands each to its
    /// group as it comes, in order: `ShardStore::append_stream`), and the
    /// answers are yielded in the order sent. One at a time (openraft's
    /// default), a shard's rate to a follower was its entries per call
    /// over a whole round trip (the call, the follower's sync, the
    /// answer); pipelined, the follower syncs what came while it synced
    /// the last. Every call has its own time (`option`'s), from when it
    /// is sent. The stream ends after the first answer that is not a
    /// success, and after a call cut to fit [`APPEND_BYTES_MAX`].
    fn stream_append<'s, S>(
        &'s mut self,
        input: S,
        option: RPCOption,
    ) -> BoxFuture<'s, Result<futures_util::stream::BoxStream<'s, AppendItem>, RPCError<GroupConfig>>>
    where
        S: futures_util::Stream<Item = AppendEntriesRequest<GroupConfig>>
            + OptionalSend
            + Unpin
            + 'static,
    {
        let pipe = AppendPipe {
            net: self.net.clone(),
            target: self.target,
            within: option.hard_ttl(),
            input,
            sent: futures_util::stream::FuturesOrdered::new(),
            bytes: 0,
            done: false,
            failed: None,
        };
        let strm = futures_util::stream::unfold(Some(pipe), |pipe| async move {
            let mut pipe = pipe?;
            let (item, ends) = pipe.next().await?;
            Some((item, (!ends).then_some(pipe)))
        });
        Box::pin(async move { Ok(Box::pin(strm) as futures_util::stream::BoxStream<'s, _>) })
    }

    async fn append_entries(
        &mut self,
        mut rpc: AppendEntriesRequest<GroupConfig>,
        option: RPCOption,
    ) -> Result<AppendEntriesResponse<GroupConfig>, RPCError<GroupConfig>> {
        let sent_up_to = within_budget(&mut rpc);
        match self.call(Rpc::AppendEntries(rpc), &option).await? {
            RpcReply::AppendEntries(AppendEntriesResponse::Success) if sent_up_to.is_some() => {
                Ok(AppendEntriesResponse::PartialSuccess(sent_up_to))
            }
            RpcReply::AppendEntries(r) => Ok(r),
            other => Err(unexpected(other, "append_entries")),
        }
    }

    async fn vote(
        &mut self,
        rpc: VoteRequest<GroupConfig>,
        option: RPCOption,
    ) -> Result<VoteResponse<GroupConfig>, RPCError<GroupConfig>> {
        self.may_campaign(&rpc)?;
        match self.call(Rpc::Vote(rpc), &option).await? {
            RpcReply::Vote(r) => Ok(r),
            other => Err(unexpected(other, "vote")),
        }
    }

    async fn pre_vote(
        &mut self,
        rpc: VoteRequest<GroupConfig>,
        option: RPCOption,
    ) -> Result<VoteResponse<GroupConfig>, RPCError<GroupConfig>> {
        self.may_campaign(&rpc)?;
        match self.call(Rpc::PreVote(rpc), &option).await? {
            RpcReply::Vote(r) => Ok(r),
            other => Err(unexpected(other, "pre_vote")),
        }
    }

    async fn transfer_leader(
        &mut self,
        rpc: TransferLeaderRequest<GroupConfig>,
        option: RPCOption,
    ) -> Result<TransferLeaderResponse<GroupConfig>, RPCError<GroupConfig>> {
        match self.call(Rpc::TransferLeader(rpc), &option).await? {
            RpcReply::TransferLeader(r) => Ok(r),
            other => Err(unexpected(other, "transfer_leader")),
        }
    }

    /// Streams the snapshot a chunk at a time ([`SnapshotChunk`]), each
    /// read from the shard's data on a blocking thread and answered before
    /// the next is read, so a slow receiver holds back the sender, and a
    /// snapshot's size costs no memory. Each chunk has its own time
    /// ([`CHUNK_WITHIN`]), the install at the end its own
    /// ([`INSTALL_WITHIN`]): openraft's `install_snapshot_timeout` is for a
    /// whole snapshot of one call, which is not how one is sent here.
    async fn full_snapshot(
        &mut self,
        vote: VoteOf<GroupConfig>,
        snapshot: SnapshotOf<GroupConfig, ShardSnapshot>,
        cancel: impl std::future::Future<Output = ReplicationClosed> + OptionalSend + 'static,
        _option: RPCOption,
    ) -> Result<SnapshotResponse<GroupConfig>, StreamingError<GroupConfig>> {
        let SnapshotData::Local(source) = snapshot.snapshot.0 else {
            return Err(StreamingError::Unreachable(Unreachable::from_string(
                "a snapshot received from another replica is not sent on",
            )));
        };
        let meta = snapshot.meta;
        let mut cancel = std::pin::pin!(cancel);
        let mut cursor = crate::snapshot::Cursor::default();
        let mut n = 0u64;
        let started = std::time::Instant::now();
        let mut bytes = 0u64;
        loop {
            let (src, mut at) = (source.clone(), cursor.clone());
            let read = tokio::task::spawn_blocking(move || {
                src.next_chunk(&mut at, crate::snapshot::CHUNK_BYTES)
                    .map(|chunk| (chunk, at))
            });
            let (chunk, next) = match read.await {
                Ok(Ok(read)) => read,
                Ok(Err(e)) => {
                    return Err(StreamingError::Unreachable(Unreachable::from_string(
                        format!("reading the snapshot to send: {e}"),
                    )))
                }
                Err(e) => {
                    return Err(StreamingError::Unreachable(Unreachable::from_string(
                        format!("reading the snapshot to send: {e}"),
                    )))
                }
            };
            cursor = next;
            let done = chunk.is_none();
            let data = bytes::Bytes::from(chunk.unwrap_or_default());
            bytes += data.len() as u64;
            let rpc = Rpc::Snapshot(SnapshotChunk {
                vote,
                meta: meta.clone(),
                n,
                data,
                done,
            });
            let within = if done { INSTALL_WITHIN } else { CHUNK_WITHIN };
            let reply = tokio::select! {
                r = self.call_within(rpc, within) => r?,
                closed = &mut cancel => return Err(StreamingError::Closed(closed)),
            };
            match reply {
                RpcReply::Snapshot(None) if !done => n += 1,
                RpcReply::Snapshot(Some(r)) if done => {
                    tracing::info!(
                        group = self.net.group,
                        target = self.target,
                        snapshot = ?meta.last_log_id,
                        chunks = n,
                        bytes,
                        took_ms = started.elapsed().as_millis() as u64,
                        "sent a snapshot to a replica"
                    );
                    return Ok(r);
                }
                other => return Err(StreamingError::from(unexpected(other, "snapshot"))),
            }
        }
    }
}

/// How long one chunk of a snapshot may take to be staged.
const CHUNK_WITHIN: Duration = Duration::from_secs(30);
/// How long a replica may take to install a snapshot it staged (it
/// writes every event of the shard again): one that takes longer is sent
/// again.
const INSTALL_WITHIN: Duration = Duration::from_secs(30 * 60);

/// A replicated group's timers (`[raft]` in the cluster file).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct RaftTiming {
    /// How often a leader tells its followers it is alive.
    pub heartbeat_ms: u64,
    /// A follower that has not heard its leader for a random time in
    /// [min, max) stands for election. A leader's lease (no follower votes
    /// for another while it runs) is the max, so a dead leader is replaced
    /// about max plus an election after it died.
    pub election_timeout_min_ms: u64,
    pub election_timeout_max_ms: u64,
    /// Whether an idle group turns its timers off (`crate::quiet`), its
    /// leader then known alive by its node's heartbeat alone.
    pub quiesce: bool,
}

impl RaftTiming {
    /// A group run alone: elected once at open, its timers then off.
    pub(crate) const ALONE: RaftTiming = RaftTiming {
        heartbeat_ms: 100,
        election_timeout_min_ms: 500,
        election_timeout_max_ms: 1000,
        quiesce: false,
    };
}

impl Default for RaftTiming {
    /// Failover about 0.8 s (`BENCHMARKS.md`, "Replicated: failover and
    /// idle CPU"); idle groups' timers are off, so the short heartbeat
    /// costs nothing while a group is idle.
    fn default() -> Self {
        RaftTiming {
            heartbeat_ms: 50,
            election_timeout_min_ms: 200,
            election_timeout_max_ms: 400,
            quiesce: true,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn entry(index: u64, bytes: usize) -> openraft::type_config::alias::EntryOf<GroupConfig> {
        openraft::Entry {
            log_id: openraft::LogId::new(
                openraft::vote::leader_id_std::CommittedLeaderId::new(1),
                index,
            ),
            payload: openraft::EntryPayload::Normal(crate::raft_log::Proposal(bytes::Bytes::from(
                vec![0u8; bytes],
            ))),
        }
    }

    fn request(sizes: &[usize]) -> AppendEntriesRequest<GroupConfig> {
        AppendEntriesRequest {
            vote: openraft::impls::Vote::new_committed(1, 1),
            prev_log_id: None,
            leader_commit: None,
            entries: sizes
                .iter()
                .enumerate()
                .map(|(i, b)| entry(i as u64 + 1, *b))
                .collect(),
        }
    }

    #[test]
    fn an_append_over_its_byte_budget_is_sent_in_part() {
        const MIB: usize = 1024 * 1024;
        // (entry sizes, entries sent, the partial success's last index)
        let table: &[(&[usize], usize, Option<u64>)] = &[
            (&[100, 100, 100], 3, None),
            (&[], 0, None),
            (&[16 * MIB, 16 * MIB, 16 * MIB], 1, Some(1)),
            (&[10 * MIB, 10 * MIB, 10 * MIB, 10 * MIB], 3, Some(3)),
            // One entry alone goes, whatever its size.
            (&[40 * MIB, 1], 1, Some(1)),
            (&[40 * MIB], 1, None),
        ];
        for (sizes, sent, partial) in table {
            let mut rpc = request(sizes);
            let cut = within_budget(&mut rpc);
            assert_eq!(rpc.entries.len(), *sent, "{sizes:?}");
            assert_eq!(cut.map(|l| l.index), *partial, "{sizes:?}");
        }
    }
}
