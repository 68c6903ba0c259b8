//! Per-shard durable state: execution logs, the routing-key and idempotency
//! indexes, the shard's epoch (the fence), and group commit.
//!
//! Each shard (`<data>/shards/<shard>/`) has one fjall database
//! (execution records and indexes), and every shard's writes go to the
//! node log (`node_log.rs`, `<data>/log/`: the events, and the
//! write-ahead record of every change, one `fdatasync` a round for every
//! shard that committed; `log.rs` is the segment log under it, and a
//! shard's own log of before). All writes to a shard go through one
//! writer at a time: the commit scheduler (`commit.rs`) takes a group of
//! queued commands, the state machine (`machine.rs`) decides what each
//! does, and the writer (`writer.rs`) writes the group to the log and
//! only once it is durable publishes it to the index and to fjall, so a
//! reader never sees an event that a crash could take back, and an append
//! is acknowledged only after it is durable.
//!
//! **Invariant:** this crate knows nothing of HTTP, JSON or peers. Payloads
//! are opaque bytes; the caller validated them.

#[cfg_attr(
    not(test),
    allow(
        dead_code,
        reason = "a shard's Raft group is its user (issue 16, step 5); its tests run it now"
    )
)]
mod apply;
pub mod check;
mod check_node;
mod checkpoints;
mod codec;
mod commit;
mod fresh;
mod index;
mod keyspaces;
mod latency;
mod log;
#[cfg(test)]
mod log_conformance;
#[doc(hidden)]
pub mod logbench;
mod machine;
mod meta_cache;
mod node_log;
mod priority;
mod quiet;
#[cfg_attr(
    not(test),
    allow(
        dead_code,
        reason = "a shard's Raft group of one is its user (issue 16, step 5); its tests run it now"
    )
)]
mod raft_group;
#[cfg_attr(
    not(test),
    allow(
        dead_code,
        reason = "a shard's Raft group is its user (issue 16, step 5); its tests run it now"
    )
)]
mod raft_log;
mod raft_net;
mod read;
mod shard;
mod shard_log;
mod snapshot;
mod supervise;

/// Faults a test arms (with the `failpoints` feature, for other crates'
/// tests; this crate's own tests have them always).
#[cfg(any(test, feature = "failpoints"))]
pub mod failpoints {
    /// The next append to the log of shard `shard`'s Raft group in the
    /// store at `store_dir` panics, as a bug in openraft's core or in the
    /// log would: the group stops, and the store's supervisor restarts it.
    pub fn panic_at_next_append(store_dir: &std::path::Path, shard: forkless_types::ShardId) {
        crate::raft_log::PANIC_AT_NEXT_APPEND
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .push((store_dir.join(crate::NODE_LOG_DIR), shard.get()));
    }

    /// The next entry a shard of the store at `store_dir` applies finds
    /// its state reads failing (a disk error) as it checks the entry's
    /// preconditions (an entry with none, a blank or membership entry,
    /// disarms it unharmed): the apply stops there, and so does the
    /// group.
    pub fn fail_next_apply_read(store_dir: &std::path::Path) {
        APPLY_READ_FAILS
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .push(store_dir.to_path_buf());
    }

    pub(crate) static APPLY_READ_FAILS: std::sync::Mutex<Vec<std::path::PathBuf>> =
        std::sync::Mutex::new(Vec::new());

    /// Whether the shard whose keyspaces are `ks` is in a store armed by
    /// [`fail_next_apply_read`] (disarmed then).
    pub(crate) fn apply_read_fails(ks: &crate::keyspaces::Keyspaces) -> bool {
        let mut armed = APPLY_READ_FAILS.lock().unwrap_or_else(|e| e.into_inner());
        let at = armed
            .iter()
            .position(|dir| ks.executions.path().starts_with(dir));
        at.map(|i| armed.remove(i)).is_some()
    }

    /// Every append to the log of shard `shard`'s Raft group in the store
    /// at `store_dir` first waits `delay`, as on a slow disk (until the
    /// process ends).
    pub fn slow_appends(
        store_dir: &std::path::Path,
        shard: forkless_types::ShardId,
        delay: std::time::Duration,
    ) {
        crate::raft_log::SLOW_APPENDS
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .push((store_dir.join(crate::NODE_LOG_DIR), shard.get(), delay));
    }
}
mod waiters;
mod write_slot;
mod writer;

pub use commit::CommitStats;
pub use latency::LatencySnapshot;
pub use openraft::BasicNode;
pub use quiet::{Followed, QuietAs};
pub use raft_group::{runtime_handle as raft_runtime, Leadership, RaftStatus, RaftWatch};
pub use raft_log::GroupConfig;
pub use raft_net::{
    Answer, Beat, CallError, Peers, RaftAppend, RaftAppendAnswer, RaftLogLimits, RaftTiming,
    Replication, Rpc, RpcReply, SnapshotChunk, APPENDS_IN_FLIGHT, APPEND_BYTES_MAX,
};
pub use shard::{
    Finished, Fit, MoveBounds, ReadConfirm, Replaced, ShardStore, StoreConfig,
    CACHE_BYTES_PER_SHARD, JOURNAL_BYTES_MIN, RAFT_GROUPS_IN_FLIGHT, WRITE_BUFFER_BYTES,
};
pub use supervise::{restart_backoff, Restarts, RESTARTS_FORGOTTEN_AFTER};
pub use waiters::Interest;
pub use writer::WRITE_WITHIN;

use forkless_types::{Epoch, ExecutionId, PartitionId, ShardCount, ShardId};
use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::sync::{Arc, RwLock};

/// Largest number of commands one group commit takes from the queue.
pub const GROUP_COMMIT_COMMANDS_MAX: usize = 1024;
/// Largest number of bytes (the commands' entry bytes: payloads, types,
/// keys and framing) one group commit takes from the queue (it always
/// takes at least one command, whatever its size).
pub const GROUP_COMMIT_BYTES_MAX: usize = 16 * 1024 * 1024;
/// Commands that may wait for a shard's writer before senders block.
pub const WRITER_QUEUE_DEPTH: usize = 4096;
/// Longest event type, routing key, idempotency key or workflow name the
/// on-disk format can hold (length-prefixed with a u16).
pub const STRING_BYTES_MAX: usize = u16::MAX as usize;

/// Where an execution is in its life.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ExecutionStatus {
    Running,
    Completed,
    Failed,
    Cancelled,
}

impl ExecutionStatus {
    pub fn as_str(self) -> &'static str {
        match self {
            ExecutionStatus::Running => "running",
            ExecutionStatus::Completed => "completed",
            ExecutionStatus::Failed => "failed",
            ExecutionStatus::Cancelled => "cancelled",
        }
    }
    pub fn is_terminal(self) -> bool {
        self != ExecutionStatus::Running
    }
    pub(crate) fn code(self) -> u8 {
        match self {
            ExecutionStatus::Running => 0,
            ExecutionStatus::Completed => 1,
            ExecutionStatus::Failed => 2,
            ExecutionStatus::Cancelled => 3,
        }
    }
    pub(crate) fn from_code(c: u8) -> Option<ExecutionStatus> {
        Some(match c {
            0 => ExecutionStatus::Running,
            1 => ExecutionStatus::Completed,
            2 => ExecutionStatus::Failed,
            3 => ExecutionStatus::Cancelled,
            _ => return None,
        })
    }
}

/// The event types that end an execution, and the status each leaves.
pub const TERMINAL_EVENT_TYPES: [(&str, ExecutionStatus); 3] = [
    ("execution.completed", ExecutionStatus::Completed),
    ("execution.failed", ExecutionStatus::Failed),
    ("execution.cancelled", ExecutionStatus::Cancelled),
];

/// The status an event of this type leaves its execution in, if it ends it.
pub fn terminal_status(event_type: &str) -> Option<ExecutionStatus> {
    TERMINAL_EVENT_TYPES
        .iter()
        .find(|(t, _)| *t == event_type)
        .map(|(_, s)| *s)
}

/// The type of the first event of every execution.
pub const STARTED_EVENT_TYPE: &str = "execution.started";

/// What the store keeps about one execution.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ExecutionMeta {
    pub id: ExecutionId,
    pub status: ExecutionStatus,
    pub last_seq: u64,
    pub created_at_ms: u64,
    pub updated_at_ms: u64,
    pub workflow: String,
    pub routing_key: Option<String>,
}

/// One event as stored. `payload` is the caller's opaque bytes.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct StoredEvent {
    pub seq: u64,
    pub event_type: String,
    pub idempotency_key: Option<String>,
    pub recorded_at_ms: u64,
    pub payload: Vec<u8>,
}

/// An event to append.
#[derive(Debug, Clone)]
pub struct NewEvent {
    pub event_type: String,
    pub payload: Vec<u8>,
    pub idempotency_key: Option<String>,
}

/// A request to create an execution. Its first event (seq 1) is
/// `execution.started` with `started_payload`.
#[derive(Debug, Clone)]
pub struct StartRequest {
    pub epoch: Epoch,
    pub id: ExecutionId,
    pub workflow: String,
    pub started_payload: Vec<u8>,
    pub routing_key: Option<String>,
    pub idempotency_key: Option<String>,
}

impl StartRequest {
    /// The key that steers this start and indexes its idempotency key: the
    /// routing key if given, else the idempotency key.
    pub fn steering_key(&self) -> Option<&str> {
        self.routing_key
            .as_deref()
            .or(self.idempotency_key.as_deref())
    }
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct StartOutcome {
    pub meta: ExecutionMeta,
    /// True when an earlier start with the same (routing key, idempotency
    /// key) already created this execution and nothing was written.
    pub existing: bool,
}

/// A request to append events to one execution.
#[derive(Debug, Clone)]
pub struct AppendRequest {
    pub epoch: Epoch,
    pub id: ExecutionId,
    pub events: Vec<NewEvent>,
    pub expected_last_seq: Option<u64>,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct AppendOutcome {
    pub first_seq: u64,
    pub last_seq: u64,
    /// True when every event carried an idempotency key that was already
    /// recorded: the original sequence numbers are returned, nothing written.
    pub deduplicated: bool,
    /// The execution's status once this append is applied (for a
    /// deduplicated one: its status now).
    pub status: ExecutionStatus,
}

/// Every way a store operation can fail, one variant per distinct reaction.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum StoreError {
    #[error("execution {0} not found")]
    NotFound(ExecutionId),
    #[error("expected_last_seq is {expected} but the execution's last seq is {last_seq}")]
    SequenceConflict { expected: u64, last_seq: u64 },
    #[error("execution is {} (last seq {last_seq}); no more events can be appended", status.as_str())]
    ExecutionClosed {
        status: ExecutionStatus,
        last_seq: u64,
    },
    /// Some events of the batch carry keys already used, others are new:
    /// the batch is neither a retry nor a fresh write.
    #[error("{}", idempotency_conflict_text(*.index, .key, *.seq, *.unkeyed))]
    IdempotencyConflict {
        index: usize,
        key: String,
        seq: u64,
        /// An event of the batch without a key, if there is one.
        unkeyed: Option<usize>,
    },
    /// An idempotency key already used for another event: a retry must
    /// carry the same event (type and payload bytes) under its key.
    #[error(
        "events[{index}].idempotency_key {key:?} was already used for a different event (seq {seq}, \
         whose {differs} differs); a retry must send the same event under its key, and a new event \
         needs a new key"
    )]
    IdempotencyKeyReused {
        index: usize,
        key: String,
        seq: u64,
        /// `"type"` or `"payload"`.
        differs: &'static str,
    },
    #[error("write carries epoch {presented} but the shard is at epoch {current}: this writer is not the owner")]
    Fenced { presented: Epoch, current: Epoch },
    #[error("epoch may only grow: shard is at {current}, asked for {requested}")]
    EpochRegression { current: Epoch, requested: Epoch },
    #[error("execution id {0} already exists")]
    ExecutionExists(ExecutionId),
    #[error("invalid request: {0}")]
    Invalid(String),
    #[error("shard {0} is not hosted on this node")]
    ShardNotHosted(ShardId),
    #[error(
        "data directory {dir} was written with shard count {on_disk}, but {requested} was asked for; \
         changing the shard count is a resize, not a restart"
    )]
    ShardCountMismatch {
        dir: String,
        on_disk: u32,
        requested: u32,
    },
    #[error("{0} is in use by another process (is another forkless node running on this data directory?)")]
    InUse(String),
    #[error("corrupt data: {0}")]
    Corrupt(String),
    #[error("storage I/O failed: {0}")]
    Io(String),
    #[error("the shard's writer has stopped")]
    WriterGone,
    /// The commit of the group carrying this write failed after the write
    /// was handed to the disk: it may or may not be durable (a reopen
    /// finds out). Only an idempotency key makes a retry safe.
    #[error("shard {shard}: the commit carrying this write failed ({reason}); it may or may not be on disk")]
    OutcomeUnknown { shard: ShardId, reason: String },
    /// The write was refused without being executed by the shard's Raft
    /// group (this node does not lead it, or its entry was refused at
    /// apply because the shard's state moved under it): safe to retry.
    #[error("shard {shard} did not execute the write: {reason}")]
    NotExecuted { shard: ShardId, reason: String },
    /// Refused before it was proposed: this node does not lead the shard's
    /// Raft group. `leader` does at `term`, as far as this node knows
    /// (`None`: it knows no leader; an election is under way). The
    /// group's leadership moved after the request was routed here, or is
    /// moving: safe to send again, to the leader once one is known.
    #[error("shard {shard} did not execute the request: {}", not_leader_text(*.leader, *.term))]
    NotLeader {
        shard: ShardId,
        leader: Option<u64>,
        term: u64,
    },
    /// The shard stopped taking writes (a failed write or sync), or could
    /// not be opened (damage found at open): refused without being tried.
    #[error("shard {shard} is out of service: {reason}")]
    ShardFailed { shard: ShardId, reason: String },
    /// A move of one of the shard's replicas to `node` ended unfinished
    /// (or was refused before it began): the node has answered nothing
    /// for `silent_s` seconds (it is down, or cut off from this one), and
    /// its learner, if it has one, took no entry in that time.
    #[error(
        "shard {shard}: node {node} has answered nothing for {silent_s} s and its learner took \
         nothing in that time (is it down, or cut off from this node?); it stays a learner for \
         a while: once the node answers again, asking again goes on, and a move of the shard \
         elsewhere removes it (as does the shard's leader, once no move has caught it up for \
         raft.learner_kept_s)"
    )]
    MoveTargetUnreachable {
        shard: ShardId,
        node: u64,
        silent_s: u64,
    },
    /// A move of one of the shard's replicas to `node` ended unfinished:
    /// its learner did not catch up within `within_s` seconds.
    #[error(
        "shard {shard}: node {node} did not catch up as a learner within {within_s} s; it stays \
         one for a while, and asking again within raft.learner_kept_s goes on (the shard's \
         leader removes a learner no move catches up after that)"
    )]
    MoveCatchUpTimeout {
        shard: ShardId,
        node: u64,
        within_s: u64,
    },
    /// A move of one of the shard's replicas was asked to go to `node`,
    /// which holds one of its voting replicas already (`voters`).
    #[error(
        "node {node} already holds a voting replica of shard {shard}: choose a node outside its \
         replicas ({voters:?})"
    )]
    MoveTargetIsVoter {
        shard: ShardId,
        node: u64,
        voters: Vec<u64>,
    },
}

fn not_leader_text(leader: Option<u64>, term: u64) -> String {
    match leader {
        Some(l) => {
            format!("this node does not lead the shard's Raft group; node {l} does, at term {term}")
        }
        None => format!(
            "this node does not lead the shard's Raft group, which has no leader at term {term} \
             (an election or a leadership transfer is under way)"
        ),
    }
}

fn idempotency_conflict_text(index: usize, key: &str, seq: u64, unkeyed: Option<usize>) -> String {
    match unkeyed {
        Some(u) => format!(
            "events[{index}].idempotency_key {key:?} was already used (seq {seq}), but events[{u}] has \
             no idempotency key, so the batch cannot be recognised as a retry: give every event of a \
             batch its own idempotency key (a retry of the whole batch is then answered as the \
             original), or send events without keys in a batch of their own"
        ),
        None => format!(
            "events[{index}].idempotency_key {key:?} was already used (seq {seq}) but other events in \
             the batch are new; retry the original batch exactly, or send the new events with fresh \
             keys in a batch of their own"
        ),
    }
}

impl StoreError {
    /// True for failures of the storage itself (as opposed to a refusal of
    /// this request): the caller should answer 5xx.
    pub fn is_fault(&self) -> bool {
        matches!(
            self,
            StoreError::Corrupt(_)
                | StoreError::Io(_)
                | StoreError::WriterGone
                | StoreError::OutcomeUnknown { .. }
                | StoreError::ShardFailed { .. }
        )
    }
}

impl From<fjall::Error> for StoreError {
    fn from(e: fjall::Error) -> Self {
        StoreError::Io(e.to_string())
    }
}

/// The node's store: one [`ShardStore`] per hosted shard under `<dir>/shards`.
pub struct Store {
    /// Declared first, so stopped first: it holds the shards for a moment
    /// each time it looks at them.
    sweep: Option<Sweep>,
    dir: PathBuf,
    shard_count: ShardCount,
    config: StoreConfig,
    /// The node log (`<dir>/log/`), if the shards write to it.
    node: Option<node_log::NodeLog>,
    shards: Arc<RwLock<BTreeMap<ShardId, Arc<ShardStore>>>>,
    /// Shards that could not be opened (damage found at open), with why.
    /// They stay out of service until the process is restarted on a
    /// repaired folder; the other shards serve.
    failed: RwLock<BTreeMap<ShardId, String>>,
    opening: [std::sync::Mutex<()>; OPEN_LOCKS],
    /// The restarts of shards whose Raft group stopped by itself.
    restarts: std::sync::Mutex<BTreeMap<ShardId, Restarts>>,
    /// Shards being restarted (closed, not yet open again), with why.
    restarting: RwLock<BTreeMap<ShardId, String>>,
}

const OPEN_LOCKS: usize = 16;

pub(crate) const LAYOUT_FILE: &str = "layout";

/// The node log's folder in the data directory.
pub(crate) const NODE_LOG_DIR: &str = "log";

/// How often the checkpoint sweep looks at the shards.
const SWEEP_EVERY: std::time::Duration = std::time::Duration::from_secs(1);

/// The node log's checkpoint sweep: a reopen reads the node log from the
/// oldest checkpoint of any shard, and a shard checkpoints by itself only
/// when it writes, so an idle shard is asked to checkpoint once the log has
/// written [`StoreConfig::log_checkpoint_bytes`] since its last one (which
/// costs it a sync of its database, with nothing to move into its index).
/// It also holds the shards' write buffers to
/// [`StoreConfig::write_buffer_bytes`] ([`to_seal`]). Stops when dropped.
struct Sweep {
    stop: Arc<(std::sync::Mutex<bool>, std::sync::Condvar)>,
    thread: Option<std::thread::JoinHandle<()>>,
}

impl Sweep {
    fn start(
        node: node_log::NodeLog,
        shards: Arc<RwLock<BTreeMap<ShardId, Arc<ShardStore>>>>,
        bytes: u64,
        write_buffer_bytes: u64,
    ) -> Result<Sweep, StoreError> {
        let stop = Arc::new((std::sync::Mutex::new(false), std::sync::Condvar::new()));
        let stopped = stop.clone();
        let thread = std::thread::Builder::new()
            .name("checkpoint-sweep".into())
            .spawn(move || {
                let (lock, wake) = &*stopped;
                loop {
                    // The lock only for the wait: a pass may commit (a
                    // checkpoint on this thread), and a drop of the sweep
                    // must not wait behind it for the lock.
                    let stop = lock.lock().unwrap_or_else(|e| e.into_inner());
                    let (stop, _) = wake
                        .wait_timeout_while(stop, SWEEP_EVERY, |stop| !*stop)
                        .unwrap_or_else(|e| e.into_inner());
                    if *stop {
                        break;
                    }
                    drop(stop);
                    let written = node.written();
                    let hosted: Vec<_> = shards
                        .read()
                        .unwrap_or_else(|e| e.into_inner())
                        .values()
                        .cloned()
                        .collect();
                    for shard in &hosted {
                        shard.checkpoint_if_behind(written, bytes);
                    }
                    bound_write_buffers(&hosted, write_buffer_bytes);
                }
            })
            .map_err(|e| StoreError::Io(format!("spawning the checkpoint sweep: {e}")))?;
        Ok(Sweep {
            stop,
            thread: Some(thread),
        })
    }
}

/// Seals the memtables of the shards [`to_seal`] names, so that fjall's
/// workers flush them.
fn bound_write_buffers(hosted: &[Arc<ShardStore>], budget: u64) {
    let held: Vec<u64> = hosted.iter().map(|s| s.write_buffer_bytes()).collect();
    for i in to_seal(&held, budget) {
        let shard = &hosted[i];
        if let Err(e) = shard.seal_write_buffer() {
            tracing::warn!(shard = shard.id().get(), error = %e, "sealing a shard's write buffer to keep the node's under store.write_buffer_bytes failed");
        }
    }
}

/// Which shards' write buffers to seal, given what each holds (`held[i]`
/// bytes): none while they hold `budget` or less together; past it, the
/// largest first until the rest hold at most three quarters of it, so
/// that the next sweeps find room and a busy node does not seal every
/// second. Sealed memtables still count until they are flushed.
fn to_seal(held: &[u64], budget: u64) -> Vec<usize> {
    let mut total: u64 = held.iter().sum();
    if total <= budget {
        return Vec::new();
    }
    let aim = budget / 4 * 3;
    let mut order: Vec<usize> = (0..held.len()).filter(|&i| held[i] > 0).collect();
    order.sort_by_key(|&i| std::cmp::Reverse(held[i]));
    let mut seal = Vec::new();
    for i in order {
        if total <= aim {
            break;
        }
        total -= held[i];
        seal.push(i);
    }
    seal
}

impl Drop for Sweep {
    fn drop(&mut self) {
        *self.stop.0.lock().unwrap_or_else(|e| e.into_inner()) = true;
        self.stop.1.notify_all();
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}

impl Store {
    /// The shards of `shard_count` that data directory `dir` has a folder
    /// of (`shards/<n>`), in no particular order; none if it has no
    /// `shards/` yet.
    pub fn shards_in(dir: &Path, shard_count: ShardCount) -> Result<Vec<ShardId>, StoreError> {
        let entries = match std::fs::read_dir(dir.join("shards")) {
            Ok(entries) => entries,
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(Vec::new()),
            Err(e) => return Err(StoreError::Io(e.to_string())),
        };
        let mut existing = Vec::new();
        for entry in entries {
            let entry = entry.map_err(|e| StoreError::Io(e.to_string()))?;
            if let Some(s) = entry
                .file_name()
                .to_str()
                .and_then(|n| n.parse::<u32>().ok())
            {
                if s < shard_count.get() {
                    existing.push(ShardId(s));
                }
            }
        }
        Ok(existing)
    }

    /// Opens (or creates) the node's data directory. Refuses a directory
    /// written with another shard count: that is a resize, not a restart.
    pub fn open(
        dir: &Path,
        shard_count: ShardCount,
        config: StoreConfig,
    ) -> Result<Store, StoreError> {
        log::create_dir_durably(&dir.join("shards"))?;
        let layout = dir.join(LAYOUT_FILE);
        match std::fs::read_to_string(&layout) {
            Ok(text) => {
                let on_disk = parse_layout(&text).ok_or_else(|| {
                    StoreError::Corrupt(format!("{}: unreadable layout file", layout.display()))
                })?;
                if on_disk != shard_count.get() {
                    return Err(StoreError::ShardCountMismatch {
                        dir: dir.display().to_string(),
                        on_disk,
                        requested: shard_count.get(),
                    });
                }
            }
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => {
                write_file_durably(
                    &layout,
                    format!("format = 1\nshard_count = {}\n", shard_count.get()).as_bytes(),
                )?;
            }
            Err(e) => return Err(StoreError::Io(format!("{}: {e}", layout.display()))),
        }
        let mut store = Store {
            sweep: None,
            dir: dir.to_path_buf(),
            shard_count,
            config,
            node: None,
            shards: Arc::new(RwLock::new(BTreeMap::new())),
            failed: RwLock::new(BTreeMap::new()),
            opening: Default::default(),
            restarts: Default::default(),
            restarting: Default::default(),
        };
        // Reopen every shard that has data here, owned or not: a shard this
        // node no longer owns must still be there to be fenced and read.
        // Each reopen replays its own journal, so they run in parallel. A
        // shard that fails to open is out of service and reported; the
        // others open and serve.
        let existing = Store::shards_in(dir, shard_count)?;
        if store.config.node_log {
            store.open_node_log(&existing)?;
            return Ok(store);
        }
        std::thread::scope(|scope| {
            let handles: Vec<_> = existing
                .iter()
                .map(|s| (*s, scope.spawn(|| store.open_shard(*s, Epoch(0)))))
                .collect();
            for (shard, h) in handles {
                store.opened(shard, h.join())?;
            }
            Ok::<(), StoreError>(())
        })?;
        Ok(store)
    }

    /// Takes in the outcome of opening a shard at the store's open: a
    /// shard that fails to open is out of service, the others serve; a
    /// folder another process holds fails the whole open.
    fn opened<T>(
        &self,
        shard: ShardId,
        outcome: std::thread::Result<Result<T, StoreError>>,
    ) -> Result<Option<T>, StoreError> {
        match outcome {
            Ok(Ok(t)) => return Ok(Some(t)),
            Ok(Err(StoreError::ShardFailed { .. })) => {}
            // Another process holds the folder: nothing here is ours.
            Ok(Err(e @ StoreError::InUse(_))) => return Err(e),
            Ok(Err(e)) => self.mark_failed(shard, e.to_string()),
            Err(_) => self.mark_failed(shard, "its reopen panicked".into()),
        }
        Ok(None)
    }

    /// The open with the node log: every shard's database first (in
    /// parallel), for their checkpoints; then the node log, read from the
    /// oldest of them (a damaged node log fails the whole open: every
    /// shard has writes in it); then one read of it replays every shard
    /// from its own checkpoint; then each shard starts on its group.
    fn open_node_log(&mut self, existing: &[ShardId]) -> Result<(), StoreError> {
        let mut databases = Vec::new();
        std::thread::scope(|scope| {
            let handles: Vec<_> = existing
                .iter()
                .map(|&s| {
                    let path = self.shard_dir(s);
                    let config = &self.config;
                    (
                        s,
                        scope.spawn(move || shard::ShardDatabase::open(&path, config)),
                    )
                })
                .collect();
            for (shard, h) in handles {
                let outcome = h.join().map(|r| r.map_err(|e| in_shard(shard, e)));
                if let Some(db) = self.opened(shard, outcome)? {
                    databases.push((shard, db));
                }
            }
            Ok::<(), StoreError>(())
        })?;
        let from = databases
            .iter()
            .filter_map(|(_, db)| db.node_checkpoint())
            .min()
            .unwrap_or(node_log::START);
        let node = node_log::NodeLog::open_from(
            &self.dir.join(NODE_LOG_DIR),
            from,
            self.config.log_segment_bytes,
            self.config.writer_priority,
        )?;
        let mut replays: BTreeMap<u32, shard::Replay> = databases
            .iter()
            .filter_map(|(s, db)| db.replay().map(|r| (s.get(), r)))
            .collect();
        node.read_parts(from, |group, part| {
            if let Some(r) = replays.get_mut(&group) {
                r.part(part);
            }
            Ok(())
        })?;
        // Every Raft group's log in one more read (not one read each). A
        // shard whose replay cannot be set up here reads its own at its
        // open, and fails there with the reason.
        let mut raft_replays: BTreeMap<u32, raft_log::RaftReplay> = BTreeMap::new();
        if self.config.raft {
            let end = node.end();
            raft_replays = databases
                .iter()
                .filter_map(|(s, db)| db.raft_replay(s.get(), end).ok().map(|r| (s.get(), r)))
                .collect();
            node.read_raft_parts(from, |group, kind, body, at, round| {
                if let Some(r) = raft_replays.get_mut(&group) {
                    r.part(group, kind, body, at, round);
                }
                Ok(())
            })?;
        }
        std::thread::scope(|scope| {
            let handles: Vec<_> = databases
                .into_iter()
                .map(|(s, db)| {
                    let replay = replays.remove(&s.get());
                    let raft_replay = raft_replays.remove(&s.get());
                    let (config, node) = (&self.config, &node);
                    let h = scope.spawn(move || {
                        ShardStore::open_on_node(db, s, Epoch(0), config, node, replay, raft_replay)
                            .map_err(|e| in_shard(s, e))
                    });
                    (s, h)
                })
                .collect();
            for (shard, h) in handles {
                if let Some(s) = self.opened(shard, h.join())? {
                    self.shards
                        .write()
                        .unwrap_or_else(|e| e.into_inner())
                        .insert(shard, Arc::new(s));
                }
            }
            Ok::<(), StoreError>(())
        })?;
        self.sweep = Some(Sweep::start(
            node.clone(),
            self.shards.clone(),
            self.config.log_checkpoint_bytes.max(1),
            self.config.write_buffer_bytes,
        )?);
        self.node = Some(node);
        Ok(())
    }

    fn shard_dir(&self, shard: ShardId) -> PathBuf {
        self.dir.join("shards").join(shard.get().to_string())
    }

    /// How long each round's `fdatasync` of the node log took (a round
    /// carries one group commit of every shard that had one waiting), if
    /// the shards write to it.
    pub fn node_log_sync_latency(&self) -> Option<LatencySnapshot> {
        self.node
            .as_ref()
            .map(|n| n.segments().sync_latency.snapshot())
    }

    /// Bytes the node log takes on disk (0 without one): every shard's
    /// writes since they moved to it.
    pub fn log_disk_bytes(&self) -> u64 {
        self.node.as_ref().map_or(0, |n| n.segments().disk_bytes())
    }

    fn mark_failed(&self, shard: ShardId, reason: String) {
        tracing::error!(shard = %shard, reason = %reason, "the shard cannot be opened; it is out of service, the node's other shards serve");
        self.failed
            .write()
            .unwrap_or_else(|e| e.into_inner())
            .insert(shard, reason);
    }

    /// The shards out of service, with why: those that could not be
    /// opened, and those that stopped taking writes after a failed write.
    pub fn failures(&self) -> BTreeMap<ShardId, String> {
        let mut out = self
            .failed
            .read()
            .unwrap_or_else(|e| e.into_inner())
            .clone();
        for s in self.hosted() {
            if let Some(why) = s.failure() {
                out.insert(s.id(), why);
            }
        }
        out
    }

    /// Why the shard is out of service, if it is.
    pub fn failure(&self, shard: ShardId) -> Option<String> {
        for map in [&self.failed, &self.restarting] {
            if let Some(why) = map.read().unwrap_or_else(|e| e.into_inner()).get(&shard) {
                return Some(why.clone());
            }
        }
        self.shard(shard).and_then(|s| s.failure())
    }

    /// Opens the shard, creating it at `initial_epoch` if it has no data yet.
    pub fn open_shard(
        &self,
        shard: ShardId,
        initial_epoch: Epoch,
    ) -> Result<Arc<ShardStore>, StoreError> {
        if shard.get() >= self.shard_count.get() {
            return Err(StoreError::Invalid(format!(
                "shard {shard} is outside shard count {}",
                self.shard_count
            )));
        }
        // One opener per shard at a time; different shards open in parallel.
        let _opening = self.opening_lock(shard);
        if let Some(s) = self.shard(shard) {
            return Ok(s);
        }
        self.open_locked(shard, initial_epoch)
    }

    fn opening_lock(&self, shard: ShardId) -> std::sync::MutexGuard<'_, ()> {
        self.opening[shard.get() as usize % OPEN_LOCKS]
            .lock()
            .unwrap_or_else(|e| e.into_inner())
    }

    /// [`Store::open_shard`] with the shard's opening lock held and the
    /// shard not open.
    fn open_locked(
        &self,
        shard: ShardId,
        initial_epoch: Epoch,
    ) -> Result<Arc<ShardStore>, StoreError> {
        if let Some(reason) = self
            .failed
            .read()
            .unwrap_or_else(|e| e.into_inner())
            .get(&shard)
        {
            return Err(StoreError::ShardFailed {
                shard,
                reason: reason.clone(),
            });
        }
        let path = self.shard_dir(shard);
        // The shard's folder must survive a crash before the shard takes
        // a write.
        log::create_dir_durably(&path)?;
        let opened = match &self.node {
            Some(node) => shard::ShardDatabase::open(&path, &self.config).and_then(|db| {
                ShardStore::open_on_node(db, shard, initial_epoch, &self.config, node, None, None)
            }),
            None => ShardStore::open(&path, shard, initial_epoch, &self.config),
        };
        let s = Arc::new(opened.map_err(|e| in_shard(shard, e))?);
        self.shards
            .write()
            .unwrap_or_else(|e| e.into_inner())
            .insert(shard, s.clone());
        Ok(s)
    }

    /// The shard's store, if this node hosts it.
    pub fn shard(&self, shard: ShardId) -> Option<Arc<ShardStore>> {
        self.shards
            .read()
            .unwrap_or_else(|e| e.into_inner())
            .get(&shard)
            .cloned()
    }

    pub fn hosted(&self) -> Vec<Arc<ShardStore>> {
        self.shards
            .read()
            .unwrap_or_else(|e| e.into_inner())
            .values()
            .cloned()
            .collect()
    }

    pub fn shard_count(&self) -> ShardCount {
        self.shard_count
    }

    pub fn dir(&self) -> &Path {
        &self.dir
    }

    /// The partition an execution lives in (a pure function of its id).
    pub fn partition_of(id: ExecutionId) -> PartitionId {
        id.partition()
    }
}

/// Names the shard in an error found while opening it.
fn in_shard(shard: ShardId, e: StoreError) -> StoreError {
    match e {
        StoreError::Corrupt(m) => StoreError::Corrupt(format!("shard {shard}: {m}")),
        StoreError::Io(m) => StoreError::Io(format!("shard {shard}: {m}")),
        e => e,
    }
}

pub(crate) fn parse_layout(text: &str) -> Option<u32> {
    text.lines()
        .filter_map(|l| l.split_once('='))
        .find(|(k, _)| k.trim() == "shard_count")
        .and_then(|(_, v)| v.trim().parse().ok())
}

/// Writes `bytes` to `path` durably: to a file beside it, synced, renamed
/// into place, and the directory synced.
pub fn write_file_durably(path: &Path, bytes: &[u8]) -> Result<(), StoreError> {
    use std::io::Write;
    let tmp = path.with_extension("tmp");
    let io = |e: std::io::Error| StoreError::Io(format!("{}: {e}", path.display()));
    let mut f = std::fs::File::create(&tmp).map_err(io)?;
    f.write_all(bytes).map_err(io)?;
    f.sync_all().map_err(io)?;
    std::fs::rename(&tmp, path).map_err(io)?;
    if let Some(parent) = path.parent() {
        log::sync_dir(parent)?;
    }
    Ok(())
}

#[cfg(test)]
mod write_buffer_tests {
    use super::to_seal;

    #[test]
    fn the_largest_write_buffers_are_sealed_until_the_rest_fit_three_quarters() {
        let cases: &[(&[u64], u64, &[usize])] = &[
            // Within the budget: nothing.
            (&[], 100, &[]),
            (&[40, 60], 100, &[]),
            // Past it: the largest, until the rest hold at most 75.
            (&[40, 61], 100, &[1]),
            (&[30, 30, 30, 30], 100, &[0, 1]),
            (&[10, 80, 20], 100, &[1]),
            (&[50, 50, 50], 100, &[0, 1]),
            // One shard over it alone: that one.
            (&[0, 500, 0], 100, &[1]),
            // Empty ones are never named, even when all are sealed.
            (&[0, 200, 0, 10], 0, &[1, 3]),
        ];
        for (held, budget, want) in cases {
            assert_eq!(
                to_seal(held, *budget),
                *want,
                "held {held:?}, budget {budget}"
            );
        }
    }
}
