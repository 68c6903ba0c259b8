//! One shard's database: its log (`log.rs`, the events and the write-ahead
//! record of every change) and its fjall keyspaces (execution records and
//! indexes). Reads go straight to both; writes go through the shard's
//! single writer thread (see `writer.rs`).

use crate::apply::{Applier, ProposalBuf};
use crate::codec;
use crate::commit;
use crate::index::{self, Tail, CHECKPOINT_KEY};
use crate::keyspaces::{Keyspaces, EPOCH_KEY};
use crate::log::{self, Log, Position, Record, Segments};
use crate::meta_cache::{MetaCache, META_CACHE_GENERATION_ENTRIES};
use crate::node_log::{NodeLog, SEGMENT_BASE};
use crate::priority::lower_own_priority;
use crate::quiet::QuietAs;
use crate::raft_group::{self, Replica};
use crate::raft_log::{RaftLog, RaftReplay, RaftStart};
use crate::read::{read_meta, view, SharedTail};
use crate::shard_log::{EventFiles, ShardLog};
use crate::writer::{Command, RaftWrite};
use crate::{
    AppendOutcome, AppendRequest, ExecutionMeta, StartOutcome, StartRequest, StoreError,
    StoredEvent, WRITER_QUEUE_DEPTH,
};
use fjall::{Database, KeyspaceCreateOptions};
use forkless_types::{Epoch, ExecutionId, PartitionId, ShardId};
use std::path::Path;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, RwLock};
use tokio::sync::{mpsc, oneshot, watch};

/// The smallest journal fjall keeps before flushing (its own minimum):
/// `StoreConfig::journal_bytes_max` below it is raised to it.
pub const JOURNAL_BYTES_MIN: u64 = 64 * 1024 * 1024;

/// [`StoreConfig::cache_bytes_per_shard`]'s default.
pub const CACHE_BYTES_PER_SHARD: u64 = 32 * 1024 * 1024;

/// [`StoreConfig::write_buffer_bytes`]'s default: a shard alone fills its
/// keyspaces' memtables to 64 MiB each as before, nearly (its six together
/// past this are sealed at once), and a node of 64 shards holds this much
/// of their writes in memory together, not up to 64 MiB a keyspace of
/// each.
pub const WRITE_BUFFER_BYTES: u64 = 256 * 1024 * 1024;

/// How long a read on a replicated shard waits for a quorum to confirm
/// this node's leadership ([`ShardStore::linearize`]).
pub const READ_CONFIRM_WITHIN: std::time::Duration = std::time::Duration::from_secs(2);

/// How a leader confirms, before a read, that it still leads.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ReadConfirm {
    /// A round of heartbeats answered by a quorum (openraft's read
    /// index): no trust in clocks, a round trip per read (reads waiting
    /// at once share one).
    ReadIndex,
    /// The leader's lease, still running since a quorum last answered
    /// (openraft's lease read): no round trip, but it rests on the nodes'
    /// clocks running at about the same rate, and it lapses on a quiet
    /// group.
    Lease,
}

/// [`StoreConfig::cached_files_per_shard`]'s default: fjall's own on
/// Linux.
pub const CACHED_FILES_PER_SHARD: usize = 900;
/// The fewest fjall takes (it panics under 10).
const CACHED_FILES_MIN: usize = 10;

/// [`StoreConfig::raft_groups_in_flight`]'s default.
pub const RAFT_GROUPS_IN_FLIGHT: usize = 8;

/// Tuning of each shard's database.
#[derive(Debug, Clone)]
pub struct StoreConfig {
    /// Block cache per shard.
    pub cache_bytes_per_shard: u64,
    /// Background flush/compaction threads per shard.
    pub worker_threads_per_shard: usize,
    /// Most table files a shard's database keeps open (fjall's descriptor
    /// cache; fjall's default 900, at least 10): what a node of many
    /// shards shares its open-file limit by.
    pub cached_files_per_shard: usize,
    /// Journal bytes kept before memtables are flushed; bounds how much a
    /// restart after a crash replays (fjall's minimum is 64 MiB; its default
    /// of 512 MiB made a crashed shard take seconds to reopen). fjall looks
    /// at it only when a memtable is flushed, which it does by itself only
    /// once one holds 64 MiB: [`StoreConfig::write_buffer_bytes`] is what
    /// makes the flushes happen on a node of many shards.
    pub journal_bytes_max: u64,
    /// The most bytes every shard's write buffer (fjall's memtables,
    /// active and sealed, not yet flushed into tables) may hold together
    /// on this node, give or take a second of writes. fjall bounds them
    /// per keyspace (a memtable is flushed at 64 MiB), so a node of many
    /// shards, each of its keyspaces filling slowly, held up to shards x
    /// keyspaces x 64 MiB; and its journals, not rotated without a flush,
    /// grew with them. Once a second the node log's sweep seals the
    /// memtables of the shards holding the most until the rest fit in
    /// three quarters of this, and fjall's workers flush them
    /// (`crate::Store`, `bound_write_buffers`). Only with `node_log`.
    pub write_buffer_bytes: u64,
    /// How many requests the process is serving right now, counted by the
    /// caller (the API edge). A shard commits on a caller's own thread only
    /// while this says the caller is alone; without it, only the shard's
    /// own signs of concurrency decide.
    pub requests_in_progress: Option<Arc<AtomicUsize>>,
    /// How much lower than the request path the storage engine's
    /// background threads (fjall's flush and compaction workers) run, in
    /// nice steps (0: the same priority). A flush of a 64 MiB memtable is
    /// a burst of a few hundred ms of CPU; on a machine whose cores the
    /// request path keeps busy it would take one of them from the commit
    /// and the connections for that long. Lowered, it runs in the gaps,
    /// and it still gets its share when it falls behind, because then
    /// fjall stalls the writer and the request path goes idle. Measured
    /// (BENCHMARKS.md): at 64 clients p99 lower and events/s higher.
    /// Linux only; elsewhere nothing is changed.
    pub background_nice: i32,
    /// Size of a log segment: the next one is zero-filled to this size
    /// ahead of use, and a segment is closed once it holds this much.
    pub log_segment_bytes: u64,
    /// Log bytes written between checkpoints of the events index: the most
    /// a reopen replays (plus one group), and what the in-memory part of
    /// the index covers (about 16 bytes an event).
    pub log_checkpoint_bytes: u64,
    /// How much higher than the request path each shard's writer thread
    /// runs, in nice steps (0: the same priority), if the process may
    /// raise a thread's priority (root, or `CAP_SYS_NICE`); if it may not,
    /// the writer runs at the request path's priority and a warning says
    /// so once. Every acknowledged write waits for the writer, and on a
    /// machine whose cores the connections keep busy, a writer woken by
    /// its `fdatasync` otherwise waits for a core behind them. Measured
    /// (BENCHMARKS.md): at 64 clients, syncs slower than 300 us (their wait
    /// for a core included) fell from 7-10% to 2-3%, and the p99.9 from
    /// 4.3-4.9 ms to 2.8-4.5. Linux only; elsewhere nothing is changed.
    pub writer_priority: i32,
    /// Whether the shards write to one log for the whole node
    /// (`<data>/log/`, one `fdatasync` a round for every shard:
    /// `docs/replication.md`; the default) instead of a log each (the
    /// format of before, which the store's tests still write on purpose).
    /// A shard written with a log of its own opens on the node log with
    /// every event (its old log is read where it is); the way back is not
    /// supported.
    pub node_log: bool,
    /// Whether each shard is a Raft group (run by this node alone: the
    /// one-node default), its writes proposed as entries of the node log
    /// and applied on commit (`docs/replication.md`, step 5). Needs
    /// `node_log`.
    pub raft: bool,
    /// Set on a node of a replicated cluster: each shard this node opens
    /// is a replica of a Raft group whose other replicas it reaches
    /// through this (`docs/replication.md`). Needs `raft`.
    pub replication: Option<crate::raft_net::Replication>,
    /// How many groups of a shard's writes its Raft leader keeps
    /// proposed and not yet applied at once (1: each group is applied
    /// before the next is evaluated). More overlap a group's replication
    /// round trip with the evaluation and proposal of the next ones
    /// (`docs/replication.md`, "Groups in flight"; measured in
    /// BENCHMARKS.md).
    pub raft_groups_in_flight: usize,
}

impl Default for StoreConfig {
    fn default() -> Self {
        StoreConfig {
            cache_bytes_per_shard: CACHE_BYTES_PER_SHARD,
            worker_threads_per_shard: 1,
            cached_files_per_shard: CACHED_FILES_PER_SHARD,
            journal_bytes_max: JOURNAL_BYTES_MIN,
            write_buffer_bytes: WRITE_BUFFER_BYTES,
            requests_in_progress: None,
            background_nice: 10,
            log_segment_bytes: log::SEGMENT_BYTES,
            log_checkpoint_bytes: 32 * 1024 * 1024,
            writer_priority: 5,
            node_log: true,
            raft: false,
            replication: None,
            raft_groups_in_flight: RAFT_GROUPS_IN_FLIGHT,
        }
    }
}

/// The log's folder inside the shard's. fjall leaves it alone: it reads
/// only its own journal files (`*.jnl`) and its `keyspaces` folder there.
pub(crate) const LOG_DIR: &str = "eventlog";

/// Where a shard written before the log kept its events, keyed
/// `partition | execution | seq`, with the same event values.
const LEGACY_EVENTS: &str = "events";

/// How long a leader's group stays awake when a follower's node asks for
/// it (`ShardStore::hold_awake_for_a_follower`): heartbeats enough for the
/// follower to hear the commit index and apply.
const FOLLOWER_WAKE: std::time::Duration = std::time::Duration::from_secs(1);

/// Events moved from the legacy keyspace per log group while converting.
const CONVERT_GROUP_BYTES: usize = 4 * 1024 * 1024;

/// Opens the shard's log. With a checkpoint, replays the log from it:
/// puts go back into the keyspaces (fjall may have lost the last ones,
/// which were never synced there), events into the tail; then checkpoints
/// again. Without one, the log must hold nothing (the first checkpoint is
/// written before the writer starts, so no group in a log without one was
/// acknowledged), and the events of a shard written before the log
/// existed are moved into it first; a log that holds data without a
/// checkpoint refuses to open.
fn recover(
    ks: &Keyspaces,
    dir: &Path,
    segment_bytes: u64,
) -> Result<(log::LogWriter, Tail), StoreError> {
    let checkpoint = read_checkpoint(ks)?;
    let mut tail = Tail::default();
    let log = match checkpoint {
        Some(from) => {
            let mut replay = Replay::new(ks, from);
            let log = log::open(dir, from, segment_bytes, |record| replay.record(record))?;
            let (replayed_tail, replayed) = replay.finish()?;
            tail = replayed_tail;
            if replayed > 0 {
                checkpoint_durably(&mut tail, ks, log.position())?;
                tracing::info!(path = %dir.display(), records = replayed, "replayed the log since its last checkpoint");
            }
            log
        }
        None => {
            // The first checkpoint is written before the writer starts, so
            // a log without one was never acknowledged from; but a log
            // that holds data next to a database without its checkpoint
            // (the database lost, replaced or damaged) cannot be
            // accounted for, and is never deleted to make the shard open.
            let legacy = ks.db.keyspace_exists(LEGACY_EVENTS);
            let (segments, written) = log::written(dir)?;
            let indexed = ks.event_index.iter().next().is_some();
            match written {
                // A move of a shard written before the log into it was cut
                // short: every event in the log is a copy of one the old
                // keyspace still holds, so the move starts again.
                Some(_) if legacy && !indexed => {
                    tracing::warn!(path = %dir.display(), "starting again the move of an older shard's events into its log, which was interrupted");
                    log::remove_all(dir)?;
                }
                Some(at) => {
                    return Err(StoreError::Corrupt(format!(
                        "{}: the log holds data ({segments} segments, the first written byte at \
                         {}:{}) but the database has no checkpoint of it: the database was lost \
                         or damaged; nothing was deleted",
                        dir.display(),
                        at.segment,
                        at.offset
                    )));
                }
                None if indexed => {
                    return Err(StoreError::Corrupt(format!(
                        "{}: the events index has entries but the database has no checkpoint of \
                         the log: the database is damaged; nothing was deleted",
                        dir.display()
                    )));
                }
                // Empty segments (a crash between creating the log and its
                // first checkpoint): opened as they are.
                None => {}
            }
            let mut log = log::open(dir, Position::default(), segment_bytes, |_| Ok(()))?;
            if legacy {
                convert_legacy(ks, &mut log, &mut tail)?;
            }
            checkpoint_durably(&mut tail, ks, log.position())?;
            log
        }
    };
    if ks.db.keyspace_exists(LEGACY_EVENTS) {
        // Every legacy event is in the log and indexed, durably (the
        // checkpoint above, or the one a crashed earlier open wrote).
        let legacy = ks
            .db
            .keyspace(LEGACY_EVENTS, KeyspaceCreateOptions::default)?;
        ks.db.delete_keyspace(legacy)?;
    }
    Ok((log, tail))
}

/// The log position the shard's database is checkpointed at, if any.
fn read_checkpoint(ks: &Keyspaces) -> Result<Option<Position>, StoreError> {
    ks.meta
        .get(CHECKPOINT_KEY)?
        .map(|v| Position::decode(&v))
        .transpose()
}

/// A shard's replay of its log from its checkpoint: puts go back into the
/// keyspaces (fjall may have lost the last ones, which were never synced
/// there; each is a whole value, so applying one again changes nothing),
/// events into the tail.
pub(crate) struct Replay {
    ks: Keyspaces,
    /// The checkpoint: only what lies after it is replayed.
    from: Position,
    batch: fjall::OwnedWriteBatch,
    tail: Tail,
    records: u64,
    /// The first record that could not be applied: the shard does not open.
    failed: Option<StoreError>,
}

impl Replay {
    pub(crate) fn new(ks: &Keyspaces, from: Position) -> Replay {
        Replay {
            ks: ks.clone(),
            from,
            batch: ks.db.batch().durability(None),
            tail: Tail::default(),
            records: 0,
            failed: None,
        }
    }

    fn record(&mut self, record: Record<'_>) -> Result<(), StoreError> {
        self.records += 1;
        match record {
            Record::Event {
                partition,
                id,
                seq,
                value,
                loc,
            } => self
                .tail
                .push(partition, id, seq, loc, codec::recorded_at(value)?),
            Record::Put {
                keyspace,
                key,
                value,
            } => {
                let target = self.ks.by_id(keyspace).ok_or_else(|| {
                    StoreError::Corrupt(format!("log: a put to unknown keyspace {keyspace}"))
                })?;
                self.batch.insert(target, key, value);
                Ok(())
            }
        }
    }

    /// Replays one of the shard's parts of the node log, if it lies after
    /// the checkpoint. A record that cannot be applied fails this shard's
    /// open, not the read of the log every shard replays from.
    pub(crate) fn part(&mut self, part: &log::GroupRead<'_>) {
        if part.end <= self.from || self.failed.is_some() {
            return;
        }
        for record in part.records() {
            if let Err(e) = record.and_then(|r| self.record(r)) {
                self.failed = Some(e);
                return;
            }
        }
    }

    /// Applies the puts; returns the tail of events since the checkpoint
    /// and how many records were replayed.
    fn finish(self) -> Result<(Tail, u64), StoreError> {
        if let Some(e) = self.failed {
            return Err(e);
        }
        if !self.batch.is_empty() {
            self.batch.commit()?;
        }
        Ok((self.tail, self.records))
    }
}

/// A shard's database, opened before its log: the store's open reads
/// every shard's checkpoint first, to open the node log from the oldest
/// and replay every shard in one read of it.
pub(crate) struct ShardDatabase {
    path: std::path::PathBuf,
    ks: Keyspaces,
    checkpoint: Option<Position>,
}

impl ShardDatabase {
    pub(crate) fn open(path: &Path, config: &StoreConfig) -> Result<ShardDatabase, StoreError> {
        let ks = open_keyspaces(path, config)?;
        Ok(ShardDatabase {
            path: path.to_path_buf(),
            checkpoint: read_checkpoint(&ks)?,
            ks,
        })
    }

    /// Its checkpoint, if that is in the node log.
    pub(crate) fn node_checkpoint(&self) -> Option<Position> {
        self.checkpoint.filter(|p| p.segment >= SEGMENT_BASE)
    }

    /// A replay of the node log from its checkpoint, if it has one there.
    pub(crate) fn replay(&self) -> Option<Replay> {
        self.node_checkpoint()
            .map(|from| Replay::new(&self.ks, from))
    }

    /// A replay of group `group`'s Raft log, for a node log that ends at
    /// `end` (see [`raft_start`]).
    pub(crate) fn raft_replay(&self, group: u32, end: Position) -> Result<RaftReplay, StoreError> {
        Ok(RaftReplay::new(
            group,
            raft_start(&self.ks, self.checkpoint, end)?,
        ))
    }
}

/// Where a shard's Raft group's log starts at open: read from the shard's
/// checkpoint in the node log (or the log's end, for a shard with none
/// there), after the entry its checkpoint had applied, with the vote of
/// then.
fn raft_start(
    ks: &Keyspaces,
    checkpoint: Option<Position>,
    end: Position,
) -> Result<RaftStart, StoreError> {
    let (purged, vote) = raft_group::checkpointed(ks)?;
    Ok(RaftStart {
        from: checkpoint
            .filter(|p| p.segment >= SEGMENT_BASE)
            .unwrap_or(end),
        purged,
        vote,
    })
}

fn open_keyspaces(path: &Path, config: &StoreConfig) -> Result<Keyspaces, StoreError> {
    let builder = Database::builder(path)
        .cache_size(config.cache_bytes_per_shard)
        .worker_threads(config.worker_threads_per_shard.max(1))
        .max_cached_files(Some(config.cached_files_per_shard.max(CACHED_FILES_MIN)))
        .max_journaling_size(config.journal_bytes_max.max(JOURNAL_BYTES_MIN));
    Keyspaces::open(open_below(builder, config.background_nice, path)?)
}

/// The segments of the shard's own log, read only, if it has one: a
/// shard written before the node log keeps its events there.
fn own_log(dir: &Path) -> Result<Option<Arc<Segments>>, StoreError> {
    if !dir.exists() {
        return Ok(None);
    }
    let ids = log::list_segments_read_only(dir, 0)?;
    Ok(Some(Arc::new(Segments::existing(
        dir,
        0,
        ids.len() as u32,
    )?)))
}

/// Checkpoints at open, before the writer starts, and syncs it.
fn checkpoint_durably(tail: &mut Tail, ks: &Keyspaces, at: Position) -> Result<(), StoreError> {
    tail.checkpoint(ks, at)?;
    ks.db.persist(fjall::PersistMode::SyncData)?;
    Ok(())
}

/// Moves the events of a shard written before the log into it, in key
/// order (so each execution's events come in sequence).
fn convert_legacy(
    ks: &Keyspaces,
    log: &mut log::LogWriter,
    tail: &mut Tail,
) -> Result<(), StoreError> {
    let legacy = ks
        .db
        .keyspace(LEGACY_EVENTS, KeyspaceCreateOptions::default)?;
    let mut pending = Vec::new();
    let mut bytes = 0usize;
    let mut moved = 0u64;
    let flush = |log: &mut log::LogWriter,
                 tail: &mut Tail,
                 pending: &mut Vec<(PartitionId, ExecutionId, u64, log::Loc, u64)>|
     -> Result<(), StoreError> {
        if !log.is_empty() {
            let start = log.position();
            let bytes = log.commit()?;
            let durable = log::Durable {
                start,
                round: start,
                end: log.position(),
                bytes,
            };
            for (p, id, seq, loc, at) in pending.drain(..) {
                tail.push(p, id, seq, durable.locate(loc), at)?;
            }
        }
        log.begin()
    };
    log.begin()?;
    for item in legacy.iter() {
        let (k, v) = item.into_inner()?;
        if k.len() != 20 {
            return Err(StoreError::Corrupt("legacy event: malformed key".into()));
        }
        let id = codec::decode_execution_id(&k[4..12], "legacy event key")?;
        let partition = id.partition();
        if k[..4] != partition.get().to_be_bytes() {
            return Err(StoreError::Corrupt(format!(
                "legacy event of execution {id}: the key's partition is not the execution's"
            )));
        }
        let seq = codec::decode_u64(&k[12..], "legacy event key")?;
        let loc = log.event(partition, id, seq, &v);
        pending.push((partition, id, seq, loc, codec::recorded_at(&v)?));
        bytes += v.len();
        moved += 1;
        if bytes >= CONVERT_GROUP_BYTES {
            flush(log, tail, &mut pending)?;
            bytes = 0;
        }
    }
    flush(log, tail, &mut pending)?;
    tracing::info!(
        events = moved,
        "moved the events of a shard written by an older version into its log"
    );
    Ok(())
}

/// Opens the database on a short-lived thread `by` nice steps below the
/// caller (at most 19), so that the flush and compaction threads fjall
/// starts while opening inherit that priority (Linux: nice is per thread
/// and a new thread takes its creator's).
fn open_below(
    builder: fjall::DatabaseBuilder<Database>,
    by: i32,
    path: &Path,
) -> Result<Database, StoreError> {
    let io = |what: String| StoreError::Io(format!("{}: {what}", path.display()));
    let opened = std::thread::scope(|scope| {
        std::thread::Builder::new()
            .name("shard-open".into())
            .spawn_scoped(scope, || {
                lower_own_priority(by);
                builder.open()
            })
            .map_err(|e| io(format!("spawning the opening thread: {e}")))?
            .join()
            .map_err(|_| io("opening panicked".into()))
    })?;
    opened.map_err(|e| match e {
        fjall::Error::Locked => StoreError::InUse(path.display().to_string()),
        e => StoreError::from(e),
    })
}

/// The writer's shared state and thread. Dropped (after the command
/// queue's sender, so the thread finds every handle gone), it rings the
/// thread and waits for it to stop, so that once a shard's last handle is
/// gone its log is checkpointed and its database released (a reopen right
/// after would otherwise find it still locked).
struct WriterRef {
    shared: Arc<commit::Shared>,
    thread: Option<std::thread::JoinHandle<()>>,
}

impl Drop for WriterRef {
    fn drop(&mut self) {
        self.shared.ring();
        if let Some(t) = self.thread.take() {
            // A writer that panicked has already failed its callers.
            let _ = t.join();
        }
    }
}

/// The shard's epoch as its database holds it, or `initial` (written
/// durably) for a new shard.
fn open_epoch(ks: &Keyspaces, initial: Epoch) -> Result<Arc<AtomicU64>, StoreError> {
    let epoch = match ks.meta.get(EPOCH_KEY)? {
        Some(v) => Epoch(codec::decode_u64(&v, "shard epoch")?),
        None => {
            let mut batch = ks.db.batch().durability(Some(fjall::PersistMode::SyncAll));
            batch.insert(
                &ks.meta,
                EPOCH_KEY,
                codec::u64_value(initial.get()).to_vec(),
            );
            batch.commit()?;
            initial
        }
    };
    Ok(Arc::new(AtomicU64::new(epoch.get())))
}

fn new_cache() -> crate::apply::SharedCache {
    Arc::new(std::sync::Mutex::new(MetaCache::new(
        META_CACHE_GENERATION_ENTRIES,
    )))
}

/// Indexes again the events of the entries the keyspaces hold as applied
/// after the checkpoint (`checkpointed`, through `applied`): fjall kept
/// their puts, the in-memory index did not survive. Returns how many.
fn reindex(
    ks: &Keyspaces,
    reader: &crate::raft_log::RaftLogRead,
    applier: &mut Applier,
    checkpointed: Option<openraft::type_config::alias::LogIdOf<crate::raft_log::GroupConfig>>,
    applied: Option<openraft::type_config::alias::LogIdOf<crate::raft_log::GroupConfig>>,
) -> Result<u64, StoreError> {
    let Some(applied) = applied else {
        return Ok(0);
    };
    let first = checkpointed.map_or(0, |c| c.index + 1);
    if first > applied.index {
        return Ok(0);
    }
    let entries = reader.entries(first..=applied.index)?;
    let held = entries.first().map(|e| e.log_id.index);
    if held != Some(first) || entries.len() as u64 != applied.index + 1 - first {
        return Err(StoreError::Corrupt(format!(
            "the shard's database holds entries {first} to {} as applied, but the node log holds              {} of them: the node log lost acknowledged writes",
            applied.index,
            entries.len()
        )));
    }
    let mut n = 0;
    for entry in entries {
        let openraft::EntryPayload::Normal(p) = &entry.payload else {
            continue;
        };
        let index = entry.log_id.index;
        if ks
            .meta
            .get(crate::apply::refused_key(
                index,
                entry.log_id.leader_id.term,
            ))?
            .is_some()
        {
            continue;
        }
        let (segment, offset) = reader.proposal_place(index).ok_or_else(|| {
            StoreError::Corrupt(format!("entry {index} has no place in the node log"))
        })?;
        applier.reindex(&p.0, segment, offset)?;
        n += 1;
    }
    Ok(n)
}

/// What a page of events read with [`ShardStore::read_events_fitting`]
/// does with the next event.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Fit {
    /// Takes it, and asks of the one after.
    Take,
    /// Takes it, and ends after it.
    TakeAndEnd,
    /// Ends before it (after it, if it is the page's first).
    End,
}

/// A handle on one shard's durable state. Cheap to share (`Arc`).
pub struct ShardStore {
    shard: ShardId,
    ks: Keyspaces,
    tail: SharedTail,
    events: EventFiles,
    /// The node log, if the shard writes to it: its failure is the
    /// shard's.
    node: Option<NodeLog>,
    tx: mpsc::Sender<Command>,
    /// Declared after `tx`, so dropped after it: its drop rings the writer
    /// thread, which then finds every handle gone and stops.
    writer: WriterRef,
    /// The shard's Raft group, if it has one; after the writer, so shut
    /// down once the writer has stopped (and checkpointed).
    raft: Option<raft_group::Group>,
    epoch: Arc<AtomicU64>,
    commits: watch::Receiver<u64>,
}

impl ShardStore {
    /// Opens the shard on a log of its own (`<shard>/eventlog/`).
    pub(crate) fn open(
        path: &Path,
        shard: ShardId,
        initial_epoch: Epoch,
        config: &StoreConfig,
    ) -> Result<ShardStore, StoreError> {
        let ks = open_keyspaces(path, config)?;
        let (log, tail) = recover(&ks, &path.join(LOG_DIR), config.log_segment_bytes)?;
        Self::with_log(
            shard,
            ks,
            ShardLog::Own(log),
            None,
            tail,
            initial_epoch,
            config,
        )
    }

    /// Opens the shard on its group of the node log, from its database
    /// opened with [`ShardDatabase::open`]. `replayed` is its replay of the
    /// node log, if the store's open read the log for every shard at once;
    /// without it the shard reads the log from its checkpoint itself.
    ///
    /// A shard whose checkpoint is not in the node log was written by an
    /// earlier version, on a log of its own: that log is replayed from its
    /// checkpoint (as [`ShardStore::open`] does), its events stay where
    /// they are and are read there, and the shard's checkpoint moves into
    /// the node log before its writer starts, so nothing is written to
    /// the old log again. A new shard starts at the node log's end.
    pub(crate) fn open_on_node(
        db: ShardDatabase,
        shard: ShardId,
        initial_epoch: Epoch,
        config: &StoreConfig,
        node: &NodeLog,
        replayed: Option<Replay>,
        raft_replay: Option<RaftReplay>,
    ) -> Result<ShardStore, StoreError> {
        let ShardDatabase {
            path,
            ks,
            checkpoint,
        } = db;
        let own_dir = path.join(LOG_DIR);
        let group = shard.get();
        let unaccounted = || {
            StoreError::Corrupt(
                "the node log holds writes of this shard, but its database has no checkpoint in \
                 the node log (the database was lost, replaced or damaged); nothing was deleted"
                    .into(),
            )
        };
        let end = node.end();
        let (mut tail, own, replayed) = match checkpoint {
            Some(from) if from.segment >= SEGMENT_BASE => {
                if from > end {
                    return Err(StoreError::Corrupt(format!(
                        "the checkpoint is at {}:{} but the node log ends at {}:{}: the node log \
                         lost acknowledged writes",
                        from.segment, from.offset, end.segment, end.offset
                    )));
                }
                let replay = match replayed {
                    Some(r) => r,
                    None => {
                        let mut r = Replay::new(&ks, from);
                        node.read_parts(from, |g, part| {
                            if g == group {
                                r.part(part);
                            }
                            Ok(())
                        })?;
                        r
                    }
                };
                let (tail, n) = replay.finish()?;
                (tail, own_log(&own_dir)?, n)
            }
            _ if node.knows(group) => return Err(unaccounted()),
            None if !own_dir.exists() && !ks.db.keyspace_exists(LEGACY_EVENTS) => {
                (Tail::default(), None, 0)
            }
            _ => {
                // Written by an earlier version: its own log is replayed
                // (and a shard from before the log moved into it) as it
                // was, and read where it is from now on.
                let (own, tail) = recover(&ks, &own_dir, config.log_segment_bytes)?;
                tracing::info!(shard = %shard, log = %own_dir.display(), "the shard's own log stays where it is, read only; its new writes go to the node log");
                (tail, Some(own.segments().clone()), 0)
            }
        };
        if config.raft {
            if replayed > 0 {
                tracing::info!(shard = %shard, records = replayed, "replayed the node log since the shard's last checkpoint");
            }
            return Self::open_raft(
                shard,
                &path,
                ks,
                tail,
                own,
                checkpoint,
                node,
                raft_replay,
                initial_epoch,
                config,
            );
        }
        if replayed > 0 || checkpoint != Some(end) {
            checkpoint_durably(&mut tail, &ks, end)?;
            if replayed > 0 {
                tracing::info!(shard = %shard, records = replayed, "replayed the node log since the shard's last checkpoint");
            }
        }
        let files = EventFiles::new(node.segments(), own);
        let log = ShardLog::Node(node.group_at(group, end), files);
        Self::with_log(
            shard,
            ks,
            log,
            Some(node.clone()),
            tail,
            initial_epoch,
            config,
        )
    }

    #[allow(clippy::too_many_arguments)]
    fn with_log(
        shard: ShardId,
        ks: Keyspaces,
        log: ShardLog,
        node: Option<NodeLog>,
        tail: Tail,
        initial_epoch: Epoch,
        config: &StoreConfig,
    ) -> Result<ShardStore, StoreError> {
        let epoch = open_epoch(&ks, initial_epoch)?;
        let (commits_tx, commits) = watch::channel(0u64);
        let state = commit::WriterState {
            checkpoints: Arc::default(),
            waiters: Arc::default(),
            cache: new_cache(),
            raft: None,
        };
        Self::spawn(
            shard,
            ks,
            log,
            node,
            Arc::new(RwLock::new(tail)),
            epoch,
            (commits_tx, commits),
            state,
            config,
        )
    }

    /// Opens the shard on its Raft group, run by this node alone, after
    /// its history of before Raft was replayed into `tail` (`own`: its own
    /// log of before, if it had one): the group's log is read from the
    /// checkpoint, the entries the keyspaces hold as applied since are
    /// indexed again, the shard checkpoints, and the group starts (it
    /// applies the rest: the entries committed and not yet applied).
    #[allow(clippy::too_many_arguments)]
    fn open_raft(
        shard: ShardId,
        dir: &Path,
        ks: Keyspaces,
        tail: Tail,
        own: Option<Arc<Segments>>,
        checkpoint: Option<Position>,
        node: &NodeLog,
        replay: Option<RaftReplay>,
        initial_epoch: Epoch,
        config: &StoreConfig,
    ) -> Result<ShardStore, StoreError> {
        let group = shard.get();
        let end = node.end();
        let start = raft_start(&ks, checkpoint, end)?;
        let checkpointed = start.purged;
        let (applied, _) = raft_group::applied_state(&ks)?;
        // Read with every other shard's at the store's open; alone, for a
        // shard opened later.
        let log = match replay {
            Some(replay) => RaftLog::replayed(node, replay)?,
            None => RaftLog::open(node, group, start)?,
        };
        let reader = log.reader();
        let epoch = open_epoch(&ks, initial_epoch)?;
        let (commits_tx, commits) = watch::channel(0u64);
        let tail = Arc::new(RwLock::new(tail));
        let cache = new_cache();
        let waiters: Arc<crate::waiters::Waiters> = Arc::default();
        let files = EventFiles::new(node.segments(), own);
        let mut applier = Applier::new(
            ks.clone(),
            tail.clone(),
            cache.clone(),
            epoch.clone(),
            files.clone(),
            waiters.clone(),
            commits_tx.clone(),
        );
        // An install a crash cut short is finished below, and replaces
        // the shard's state: nothing of the old one is indexed again.
        let installing = crate::snapshot::Installing::read(&ks)?.is_some();
        let reindexed = if installing {
            0
        } else {
            reindex(&ks, &reader, &mut applier, checkpointed, applied)?
        };
        if reindexed > 0 {
            tracing::info!(shard = %shard, entries = reindexed, "indexed again the entries applied since the shard's last checkpoint");
        }
        let checkpoints: Arc<crate::checkpoints::CheckpointCounters> = Arc::default();
        let replica = Arc::new(Replica::new(
            applier,
            node.clone(),
            reader,
            config.log_checkpoint_bytes,
            checkpoints.clone(),
            dir.to_path_buf(),
            group,
        ));
        replica.recover_install()?;
        // Before the group writes: a reopen reads the node log from here.
        replica.checkpoint_at_open()?;
        let started = match &config.replication {
            Some(rep) => raft_group::start_replicated(shard, log, replica.clone(), rep)?,
            None => raft_group::start_alone(shard, log, replica.clone())?,
        };

        let state = commit::WriterState {
            checkpoints,
            waiters,
            cache,
            raft: Some(RaftWrite {
                raft: started.raft.clone(),
                replicated: started.replicated,
                quiet: started.quiet.clone(),
                replica,
                proposal: ProposalBuf::default(),
                depth: config.raft_groups_in_flight.max(1),
            }),
        };
        let mut store = Self::spawn(
            shard,
            ks,
            ShardLog::Node(node.group_at(group, end), files),
            Some(node.clone()),
            tail,
            epoch,
            (commits_tx, commits),
            state,
            config,
        )?;
        store.raft = Some(started);
        Ok(store)
    }

    #[allow(clippy::too_many_arguments)]
    fn spawn(
        shard: ShardId,
        ks: Keyspaces,
        log: ShardLog,
        node: Option<NodeLog>,
        tail: SharedTail,
        epoch: Arc<AtomicU64>,
        (commits_tx, commits): (watch::Sender<u64>, watch::Receiver<u64>),
        state: commit::WriterState,
        config: &StoreConfig,
    ) -> Result<ShardStore, StoreError> {
        let (tx, rx) = mpsc::channel(WRITER_QUEUE_DEPTH);
        let events = log.events();
        let (shared, thread) = commit::spawn(
            shard,
            ks.clone(),
            log,
            tail.clone(),
            config.log_checkpoint_bytes,
            config.writer_priority,
            rx,
            epoch.clone(),
            commits_tx,
            config.requests_in_progress.clone(),
            state,
        )?;
        let writer = WriterRef {
            shared,
            thread: Some(thread),
        };
        Ok(ShardStore {
            shard,
            ks,
            tail,
            events,
            node,
            tx,
            writer,
            raft: None,
            epoch,
            commits,
        })
    }

    pub fn id(&self) -> ShardId {
        self.shard
    }

    /// The replica state behind the shard's Raft group, if it has one.
    #[cfg(test)]
    pub(crate) fn replica(&self) -> Option<Arc<raft_group::Replica>> {
        self.raft.as_ref().map(|g| g.replica.clone())
    }

    /// Why the shard's Raft group stopped by itself, if it has: the
    /// shard takes nothing until the store's supervisor restarts it.
    pub fn group_stopped(&self) -> Option<String> {
        self.raft.as_ref().and_then(|g| g.stopped())
    }

    /// Whether the shard is a Raft group with replicas on other nodes.
    pub fn is_replicated(&self) -> bool {
        self.raft.as_ref().is_some_and(|g| g.replicated)
    }

    /// The shard's Raft group as this replica sees it, if it has one.
    pub fn raft_status(&self) -> Option<raft_group::RaftStatus> {
        self.raft.as_ref().map(|g| {
            use openraft::async_runtime::WatchReceiver;
            let mut status = raft_group::RaftStatus::of(&g.raft.metrics().borrow_watched());
            status.quiet = g.replicated && g.quiet.is_quiet();
            status.fresh = g.is_fresh();
            status.appends_taken = g.appends.taken.load(Ordering::Relaxed);
            status.appends_taken_behind_others = g.appends.behind_others.load(Ordering::Relaxed);
            (status.log_held_entries, status.log_memory_bytes) = g.replica.log_held();
            status
        })
    }

    /// Whether this replica of the shard's replicated group is new (its
    /// data directory was) and has not caught up with its group yet
    /// (`crate::fresh`): it then takes no leadership handed to it.
    pub fn is_fresh(&self) -> bool {
        self.raft
            .as_ref()
            .filter(|g| g.replicated)
            .is_some_and(|g| g.is_fresh())
    }

    /// Waits at most `within` until this replica has applied its log
    /// through `index`; says whether it has. On a node that handed its
    /// leadership over: the entries it proposed while it led are committed
    /// by the new leader, and its writes waiting on them are answered once
    /// they are applied here. `None` index: nothing to wait for.
    pub async fn applied_through(&self, index: Option<u64>, within: std::time::Duration) -> bool {
        let (Some(g), Some(index)) = (self.raft.as_ref(), index) else {
            return true;
        };
        g.raft
            .wait(Some(within))
            .applied_index_at_least(Some(index), "the entries proposed while it led")
            .await
            .is_ok()
    }

    /// Whether this replica may be handed its group's leadership: not
    /// while it is new and has not caught up, nor once its node is
    /// shutting down ([`crate::Replication::draining`]). A node answers
    /// its peers' heartbeats with the shards it cannot lead.
    pub fn takes_leadership(&self) -> bool {
        self.raft
            .as_ref()
            .filter(|g| g.replicated)
            .is_none_or(|g| !g.is_fresh() && !g.is_draining())
    }

    /// An operator's override for a group that cannot elect: this replica,
    /// new (its data directory was) and not caught up, is trusted as
    /// caught up from now on, durably, and votes and stands as any
    /// replica (`crate::fresh`). Its group then elects by Raft's own rules
    /// among the replicas that answer; what it risks is an entry that only
    /// the lost disk and a replica that is gone held, which the group then
    /// no longer has. `Ok(false)` when it was not careful (nothing done).
    pub fn trust_replica(&self) -> Result<bool, StoreError> {
        match self.raft.as_ref().filter(|g| g.replicated) {
            Some(g) => g.replica.trust(),
            None => Err(StoreError::Invalid(self.not_replicated())),
        }
    }

    /// Who leads the shard's replicated Raft group, as this replica knows
    /// now (`None` if the shard is not replicated).
    pub fn leadership(&self) -> Option<raft_group::Leadership> {
        self.raft
            .as_ref()
            .filter(|g| g.replicated)
            .map(|g| raft_group::RaftWatch::new(&g.raft).now())
    }

    /// Waits, at most `within`, until this replica knows a leader of the
    /// shard's group at a term after `term`; the leadership then known
    /// (`None`: the shard is not a replicated group here, or it stopped).
    pub async fn leader_after(
        &self,
        term: u64,
        within: std::time::Duration,
    ) -> Option<raft_group::Leadership> {
        self.leadership_until(within, |l| l.leader.is_some() && l.term > term)
            .await
    }

    /// After this node was refused as the group's leader at `term`
    /// ([`StoreError::NotLeader`]): waits at most `within` for the group's
    /// leadership to settle, as this node sees it, and returns it.
    /// Settled: a leader is known, and it is not this node at the term it
    /// was refused at (which it still believes for a moment while it
    /// hands its leadership over, or hears of a newer term). `None` if the
    /// shard is not a Raft group or its group stopped.
    pub async fn leadership_settled(
        &self,
        term: u64,
        within: std::time::Duration,
    ) -> Option<raft_group::Leadership> {
        self.leadership_until(within, |l| {
            l.leader.is_some() && !(l.this_node_leads() && l.term <= term)
        })
        .await
    }

    /// Waits, at most `within`, until the group's leadership as this
    /// replica knows it is `done`, and returns it as it then is (`done`
    /// or not); `None` if the shard is not a Raft group or its group
    /// stopped.
    async fn leadership_until(
        &self,
        within: std::time::Duration,
        done: impl Fn(&raft_group::Leadership) -> bool,
    ) -> Option<raft_group::Leadership> {
        let mut watch = self.raft_watch()?;
        let until = tokio::time::Instant::now() + within;
        let mut now = watch.now();
        while !done(&now) {
            match tokio::time::timeout_at(until, watch.changed()).await {
                Ok(Some(l)) => now = l,
                Ok(None) => return None,
                Err(_) => break,
            }
        }
        Some(now)
    }

    /// On the leader of the shard's replicated group: turns the group's
    /// timers off if nothing was written to it for `idle` and every
    /// follower has every entry; says whether it leads quietly, and at
    /// which term (`crate::quiet`).
    pub fn quiesce_if_idle(&self, idle: std::time::Duration) -> QuietAs {
        match self.raft.as_ref().filter(|g| g.replicated) {
            Some(g) => {
                g.fresh_caught_up();
                g.quiet.quiesce_leader(&g.raft, idle)
            }
            None => QuietAs::Awake,
        }
    }

    /// On a follower: node `leader` says it leads the group quietly at
    /// `term`; the follower turns its timers off too if it follows that
    /// leader at that term. Says whether it did, and whether it is behind
    /// its own log (`Quiet::follow`).
    pub fn follow_quietly(&self, leader: u64, term: u64) -> crate::Followed {
        // A new replica that has not caught up stays awake: quiet, and
        // knowing no leader, it would hear from nobody (its quiet leader
        // takes it for matched), and never catch up. It tells that leader
        // it starts from nothing, which wakes the leader's group.
        let Some(g) = self.raft.as_ref().filter(|g| g.replicated) else {
            return crate::Followed::Awake;
        };
        if g.is_fresh() {
            g.fresh_heard_of(leader);
            return crate::Followed::Awake;
        }
        g.quiet.follow(&g.raft, leader, term)
    }

    /// On the leader: a follower's node asked for the group to be awake
    /// (it is quiet and behind its own log): the group wakes, and stays
    /// awake long enough for its heartbeats to reach that follower. Says
    /// whether it was quiet.
    pub fn hold_awake_for_a_follower(&self) -> bool {
        let leads = self.leadership().is_some_and(|l| l.this_node_leads());
        self.raft
            .as_ref()
            .filter(|g| g.replicated && leads)
            .is_some_and(|g| g.quiet.hold_awake(&g.raft, FOLLOWER_WAKE))
    }

    /// The replicas of the shard's group (voters and learners) as this
    /// replica has its membership; empty for a shard run alone.
    pub fn members(&self) -> Vec<u64> {
        use openraft::async_runtime::WatchReceiver;
        self.raft
            .as_ref()
            .filter(|g| g.replicated)
            .map(|g| {
                let m = g.raft.metrics();
                let m = m.borrow_watched();
                m.membership_config
                    .membership()
                    .nodes()
                    .map(|(id, _)| *id)
                    .collect()
            })
            .unwrap_or_default()
    }

    /// This node heard whether the shard's group, at a membership newer
    /// than this replica's, counts this replica: `left`, it does not (it
    /// was removed while away). A replica left behind stops standing for
    /// election: its timers stay off until a leader's entries or snapshot
    /// reach it, or `left` is heard false (`crate::quiet`). Says whether
    /// that changed.
    pub fn set_left_group(&self, left: bool) -> bool {
        self.raft
            .as_ref()
            .filter(|g| g.replicated)
            .is_some_and(|g| g.quiet.leave(&g.raft, left))
    }

    /// Whether this replica takes itself for left behind by its group
    /// ([`ShardStore::set_left_group`]).
    pub fn has_left_group(&self) -> bool {
        self.raft
            .as_ref()
            .filter(|g| g.replicated)
            .is_some_and(|g| g.quiet.has_left())
    }

    /// Turns the group's timers back on; says whether they were off (not
    /// on a replica its group left behind).
    pub fn wake(&self) -> bool {
        self.raft
            .as_ref()
            .filter(|g| g.replicated)
            .is_some_and(|g| g.quiet.wake(&g.raft))
    }

    /// On the leader of the shard's replicated group: hands its
    /// leadership to replica `to` (openraft's leadership transfer: `to`
    /// stands once it has the leader's last entry, and the other voters
    /// let it, lease or not). From then on this node refuses the shard's
    /// writes (not executed) and stops its heartbeats until another node
    /// leads: if `to` does not take it, the group stays awake (not quiet)
    /// and its followers elect once the leader's lease has run out, about
    /// an election's time of refused writes.
    pub async fn transfer_leader(&self, to: u64) -> Result<(), StoreError> {
        let Some(g) = self.raft.as_ref().filter(|g| g.replicated) else {
            return Err(StoreError::Invalid(format!(
                "shard {} is not a replicated Raft group on this node",
                self.shard
            )));
        };
        g.quiet.transferring(&g.raft);
        g.raft
            .trigger()
            .transfer_leader(to)
            .await
            .map_err(|e| StoreError::Io(format!("shard {}'s Raft group stopped: {e}", self.shard)))
    }

    /// On the leader of the shard's replicated group: moves the replica on
    /// node `from` to node `to` (at Raft address `to_addr`) by Raft
    /// membership changes: `to` joins as a learner and is caught up (from
    /// the log, or by a snapshot of the shard once the log forgot what it
    /// needs), waiting at most `bounds.catch_up_within`, and at most
    /// `bounds.unreachable_within` while `to`'s node answers nothing
    /// and its learner holds no more than before; then one change of the
    /// voters swaps `from` for `to` (openraft's joint consensus: the old and
    /// the new voters' quorums both agree). `from` may be down: the other
    /// replicas are a quorum of both. Resumable: a replacement already
    /// made is reported so, and one cut short (the learner added, not yet
    /// a voter) is taken up where it stopped. Every answer, "nothing to
    /// move" too, comes after a quorum confirmed that this node leads (so
    /// a deposed leader's older voter list never answers it). `NotLeader`
    /// when this node does not lead the group.
    pub async fn replace_replica(
        &self,
        from: u64,
        to: u64,
        to_addr: String,
        bounds: MoveBounds<'_>,
    ) -> Result<Replaced, StoreError> {
        let catch_up_within = bounds.catch_up_within;
        let Some(g) = self.raft.as_ref().filter(|g| g.replicated) else {
            return Err(StoreError::Invalid(format!(
                "shard {} is not a replicated Raft group on this node",
                self.shard
            )));
        };
        let not_executed = |reason: String| StoreError::NotExecuted {
            shard: self.shard,
            reason,
        };
        let status = self
            .raft_status()
            .ok_or_else(|| self.group_stopped_error())?;
        if status.state != "leader" {
            return Err(raft_group::not_leader(
                self.shard,
                status.me,
                status.leader,
                status.term,
            ));
        }
        // The leader keeps its timers on while it catches the learner up
        // (a quiet leader sends nothing), and first confirms with a
        // quorum that it still leads (a quiet leader has not heard one
        // lately, and openraft refuses its membership changes until it
        // has).
        let _awake = AwakeForMove::hold(g, catch_up_within);
        let _replacing = Replacing::hold(g);
        self.linearize().await?;
        let refused = |what: String, e: MembershipRefusal| self.refused(g, what, e);
        // The membership steps of the group's moves go one at a time
        // (`Group::moving`); a move's catch-up wait does not hold it.
        let upto = {
            let _step = g.moving.lock().await;
            self.leading_voter()?;
            let finished = self.finish_cut_short(g).await?;
            let status = self
                .raft_status()
                .ok_or_else(|| self.group_stopped_error())?;
            let voters: std::collections::BTreeSet<u64> = status.voters.iter().copied().collect();
            // Nothing (more) to move: `from` holds no voting replica, as a
            // quorum has just confirmed this node leads (a deposed leader
            // that does not know it yet, its voter list older than the
            // group's, cannot answer so: it is refused above). (So too
            // when the change finished just now took this node out.)
            if !voters.contains(&from) {
                return Ok(Replaced {
                    voters: voters.into_iter().collect(),
                    changed: finished.is_some(),
                    to: finished.and_then(|f| f.joined),
                });
            }
            self.leading_voter()?;
            if voters.contains(&to) {
                return Err(StoreError::MoveTargetIsVoter {
                    shard: self.shard,
                    node: to,
                    voters: voters.into_iter().collect(),
                });
            }
            // A learner other than `to`: one a move cut short left (its
            // target died, or did not catch up in time, and the move went
            // to another node; a move still waiting for it then ends).
            // Removed first: the leader would replicate to it for good,
            // and its group, never all caught up, would never go quiet.
            let left_by_moves: std::collections::BTreeSet<u64> =
                status.learners.into_iter().filter(|l| *l != to).collect();
            if !left_by_moves.is_empty() {
                tracing::info!(
                    shard = self.shard.get(),
                    learners = ?left_by_moves,
                    "removing learners that moves cut short left, before moving a replica to node {to}"
                );
                g.raft
                    .change_membership(openraft::ChangeMembers::RemoveNodes(left_by_moves), false)
                    .await
                    .map_err(|e| {
                        refused("removing learners that moves cut short left".into(), e)
                    })?;
            }
            tracing::info!(
                shard = self.shard.get(),
                from,
                to,
                "adding a learner to replace a replica"
            );
            let added = g
                .raft
                .add_learner(to, crate::BasicNode::new(to_addr), false)
                .await
                .map_err(|e| refused(format!("adding node {to} as a learner"), e))?;
            added.log_id().index
        };
        // openraft's own wait ("blocking") takes a learner within 5,000
        // entries for caught up; this one waits until it holds every entry
        // up to its own addition, so that it becomes a voter with the
        // whole shard (every entry acknowledged before the move).
        let learner = |m: &openraft::RaftMetrics<crate::raft_log::GroupConfig>| {
            m.membership_config
                .membership()
                .learner_ids()
                .any(|l| l == to)
        };
        let wait = g.raft.wait(Some(catch_up_within));
        let caught_up = wait.metrics(
            // (Or this node leads no more, or a later move removed the
            // learner: nothing to wait for.)
            |m| {
                !learner(m)
                    || m.replication.as_ref().is_none_or(|r| {
                        r.get(&to)
                            .is_some_and(|l| l.is_some_and(|l| l.index >= upto))
                    })
            },
            "the new learner holds every entry up to its addition",
        );
        let caught_up = tokio::select! {
            caught_up = caught_up => caught_up,
            gone = self.unreachable(to, &bounds) => {
                return Err(StoreError::MoveTargetUnreachable {
                    shard: self.shard,
                    node: to,
                    silent_s: gone.as_secs(),
                })
            }
        };
        match caught_up {
            Ok(m) if m.replication.is_none() => {
                return Err(not_executed(format!(
                    "this node stopped leading the shard's group while node {to} caught up as a \
                     learner; it stays one, and asking again (the new leader) goes on"
                )))
            }
            // (Caught up, or no learner any more: the step below tells
            // which.)
            Ok(_) => {}
            Err(e) => {
                // (openraft's timeout says the whole of the group's
                // metrics: the log has it, the answer does not.)
                tracing::info!(shard = self.shard.get(), to, error = %e, "a move's learner did not catch up in time");
                return Err(StoreError::MoveCatchUpTimeout {
                    shard: self.shard,
                    node: to,
                    within_s: catch_up_within.as_secs(),
                });
            }
        }
        let _step = g.moving.lock().await;
        // The voters as they are now: another move may have ended
        // meanwhile. One that took `from` out (the same move asked
        // twice, say) leaves nothing (more) to move; one that took this
        // node out leaves the step to the next leader.
        let voters: std::collections::BTreeSet<u64> =
            self.leading_voter()?.voters.into_iter().collect();
        if !voters.contains(&from) {
            return Ok(Replaced {
                voters: voters.into_iter().collect(),
                changed: false,
                to: None,
            });
        }
        {
            use openraft::async_runtime::WatchReceiver;
            if !learner(&g.raft.metrics().borrow_watched()) {
                return Err(not_executed(format!(
                    "node {to} is no longer a learner of the shard's group (a later move of the \
                     shard removed it, or made it a voter): this move ends"
                )));
            }
        }
        let mut next = voters;
        next.remove(&from);
        next.insert(to);
        tracing::info!(shard = self.shard.get(), from, to, voters = ?next, "the learner caught up: changing the voters");
        let changed = g
            .raft
            .change_membership(openraft::ChangeMembers::ReplaceAllVoters(next), false)
            .await
            .map_err(|e| refused("changing the group's voters".into(), e))?;
        let voters = changed
            .membership()
            .as_ref()
            .map(|m| m.voter_ids().collect())
            .unwrap_or_default();
        tracing::info!(shard = self.shard.get(), from, to, voters = ?voters, "a replica replaced");
        Ok(Replaced {
            voters,
            changed: true,
            to: Some(to),
        })
    }

    /// On the leader of the shard's replicated group: finishes a change of
    /// its voters that a leader cut short (it died, or lost its
    /// leadership, with the group in openraft's joint configuration: the
    /// old voters and the new, whose quorums must both agree to anything
    /// until the change is finished), to the voters that change was going
    /// to, as the next move of the shard would. `Ok(None)`: nothing was
    /// under way. Confirms with a quorum first that this node leads, and
    /// takes its turn with the group's moves (a move's own change is never
    /// finished from under it). `NotLeader` when this node does not lead
    /// the group; a refusal of openraft's (the joint membership not
    /// committed in this leader's term yet) as `NotExecuted`, to be asked
    /// again.
    pub async fn finish_change_of_voters(
        &self,
        within: std::time::Duration,
    ) -> Result<Option<Finished>, StoreError> {
        let Some(g) = self.raft.as_ref().filter(|g| g.replicated) else {
            return Ok(None);
        };
        if !self.leading_voter()?.joint {
            return Ok(None);
        }
        let _awake = AwakeForMove::hold(g, within);
        self.linearize().await?;
        let _step = g.moving.lock().await;
        self.leading_voter()?;
        self.finish_cut_short(g).await
    }

    /// Whether a replacement of one of the group's replicas
    /// ([`ShardStore::replace_replica`]) is under way on this replica.
    pub fn replacing(&self) -> bool {
        self.raft
            .as_ref()
            .is_some_and(|g| g.replacing.load(Ordering::Acquire) > 0)
    }

    /// On the leader of the shard's replicated group: removes the learners
    /// that moves cut short left behind (a move's target that never became
    /// a voter: its leader died or lost its leadership, the call that
    /// asked for it ended, or its learner did not catch up in time, and
    /// the move was not asked again), while no replacement runs here and
    /// the group's membership is still the one its entry `seen` (term,
    /// index) made. Such a learner is replicated to for good, and keeps
    /// its group from going quiet while it does not hold every entry (a
    /// dead node's never will). The learners removed, none when there was
    /// nothing to do. Confirms with a quorum first that this node leads,
    /// and takes its turn with the group's moves; `NotLeader` when this
    /// node does not lead the group as a voter.
    pub async fn remove_left_learners(
        &self,
        seen: (u64, u64),
        within: std::time::Duration,
    ) -> Result<Vec<u64>, StoreError> {
        let Some(g) = self.raft.as_ref().filter(|g| g.replicated) else {
            return Ok(Vec::new());
        };
        let current = |s: &raft_group::RaftStatus| {
            !s.joint && s.membership_committed && s.membership_log == Some(seen)
        };
        let status = self.leading_voter()?;
        if self.replacing() || status.learners.is_empty() || !current(&status) {
            return Ok(Vec::new());
        }
        let _awake = AwakeForMove::hold(g, within);
        self.linearize().await?;
        let _step = g.moving.lock().await;
        let status = self.leading_voter()?;
        // (A replacement that starts from here on waits for this step, and
        // then finds its learner gone, if it was one of these: it adds it
        // again.)
        if self.replacing() || status.learners.is_empty() || !current(&status) {
            return Ok(Vec::new());
        }
        // The membership's log id, for the precondition below: the one the
        // learners were read from (`seen`), or nothing is done.
        let last = {
            use openraft::async_runtime::WatchReceiver;
            *g.raft.metrics().borrow_watched().membership_config.log_id()
        };
        if last.as_ref().map(|l| (l.leader_id.term, l.index)) != Some(seen) {
            return Ok(Vec::new());
        }
        let learners: std::collections::BTreeSet<u64> = status.learners.into_iter().collect();
        tracing::info!(
            shard = self.shard.get(),
            learners = ?learners,
            "removing learners that moves cut short left behind"
        );
        self.change_membership_while(
            g,
            openraft::ChangeMembers::RemoveNodes(learners.clone()),
            last,
            "removing learners that moves cut short left",
        )
        .await?;
        Ok(learners.into_iter().collect())
    }

    /// The group's status, read before a membership step: refused
    /// (`NotLeader`, routed again) unless this node leads the group as
    /// one of its voters. A leader that has just removed its own replica
    /// leads on for a moment (openraft hands its leadership over 150 ms
    /// after the removal commits), and a membership change it took then
    /// would be appended by a node outside the group (a debug build's
    /// openraft panicked: "Only leader is allowed to call
    /// update_effective_membership()"; a release build's would have taken
    /// it).
    fn leading_voter(&self) -> Result<raft_group::RaftStatus, StoreError> {
        let status = self
            .raft_status()
            .ok_or_else(|| self.group_stopped_error())?;
        if status.state != "leader" || !status.voters.contains(&status.me) {
            // (A leader that removed itself names none: the group's next
            // is not known yet.)
            let leader = status.leader.filter(|_| status.state != "leader");
            return Err(raft_group::not_leader(
                self.shard,
                status.me,
                leader,
                status.term,
            ));
        }
        Ok(status)
    }

    fn group_stopped_error(&self) -> StoreError {
        StoreError::NotExecuted {
            shard: self.shard,
            reason: "the shard's Raft group has stopped".into(),
        }
    }

    /// A membership step the group refused: not the leader (it names the
    /// one it knows: the edge routes the request there), or why.
    fn refused(&self, g: &raft_group::Group, what: String, e: MembershipRefusal) -> StoreError {
        raft_group::forwarded(&g.raft, self.shard, e.forward_to_leader(), || {
            format!("{what}: {e}")
        })
    }

    /// With the group's `moving` lock held, this node its leading voter: a
    /// change of voters cut short between its two steps (its leader died
    /// with the group in the joint configuration) is finished, to the
    /// configuration it was going to. `None`: the group was not joint.
    async fn finish_cut_short(
        &self,
        g: &raft_group::Group,
    ) -> Result<Option<Finished>, StoreError> {
        let (last, joined, seen) = {
            use openraft::async_runtime::WatchReceiver;
            let m = g.raft.metrics();
            let m = m.borrow_watched();
            let joint = m.membership_config.membership().get_joint_config();
            match (joint.len() > 1, joint.first(), joint.last()) {
                // The node that change brings in (a move's target).
                (true, Some(old), Some(new)) => (
                    new.clone(),
                    new.iter().copied().find(|n| !old.contains(n)),
                    *m.membership_config.log_id(),
                ),
                _ => return Ok(None),
            }
        };
        tracing::info!(shard = self.shard.get(), voters = ?last, "finishing a change of voters cut short");
        self.change_membership_while(
            g,
            openraft::ChangeMembers::ReplaceAllVoters(last.clone()),
            seen,
            "finishing a change of voters cut short",
        )
        .await?;
        Ok(Some(Finished {
            voters: last.into_iter().collect(),
            joined,
        }))
    }

    /// Makes `change` to the group's membership only while its membership
    /// is still the one whose entry is `seen` (openraft checks it as it
    /// proposes the change); a refusal says `what` was refused.
    async fn change_membership_while(
        &self,
        g: &raft_group::Group,
        change: openraft::ChangeMembers<u64, crate::BasicNode>,
        seen: Option<openraft::type_config::alias::LogIdOf<crate::raft_log::GroupConfig>>,
        what: &str,
    ) -> Result<(), StoreError> {
        g.raft
            .change_membership_if(
                change,
                false,
                [openraft::Precondition::LastMembershipLogId {
                    last_membership_log_id: seen,
                }],
            )
            .await
            .map_err(|e| self.refused(g, what.into(), e))?;
        Ok(())
    }

    /// Ends (with how long) once `to`'s node has answered nothing
    /// (`bounds.last_answered`) for `bounds.unreachable_within`, its
    /// learner having taken no entry in that time either; else never.
    /// Judged by the node, not by the learner's own answers: a learner
    /// installing a large snapshot answers no heartbeat until the install
    /// ends (openraft holds those answers behind the snapshot's IO), while
    /// its node still answers.
    async fn unreachable(&self, to: u64, bounds: &MoveBounds<'_>) -> std::time::Duration {
        let taken = || {
            self.raft.as_ref().and_then(|g| {
                use openraft::async_runtime::WatchReceiver;
                let m = g.raft.metrics();
                let m = m.borrow_watched();
                m.replication
                    .as_ref()
                    .and_then(|r| r.get(&to).and_then(|l| l.as_ref().map(|l| l.index)))
            })
        };
        let started = std::time::Instant::now();
        let (mut last_taken, mut took_at) = (taken(), started);
        loop {
            tokio::time::sleep(MOVE_LOOK_EVERY).await;
            let now = taken();
            if now != last_taken {
                (last_taken, took_at) = (now, std::time::Instant::now());
            }
            let heard = (bounds.last_answered)().map_or(took_at, |a| a.max(took_at));
            let gone = heard.elapsed();
            if gone >= bounds.unreachable_within {
                return gone;
            }
        }
    }

    /// Whether the shard's replicated group has its timers off here.
    pub fn is_quiet(&self) -> bool {
        self.raft
            .as_ref()
            .filter(|g| g.replicated)
            .is_some_and(|g| g.quiet.is_quiet())
    }

    /// On a quiet replica that does not lead: the leader it follows, if
    /// it knows one, and how long since that leader's node last said it
    /// keeps the group quiet (or since its timers went off).
    pub fn quiet_leader(&self) -> Option<(Option<u64>, std::time::Duration)> {
        self.raft
            .as_ref()
            .filter(|g| g.replicated)
            .and_then(|g| g.quiet.quiet_leader(&g.raft))
    }

    /// A watch on the shard's Raft group, if it has one.
    pub fn raft_watch(&self) -> Option<raft_group::RaftWatch> {
        self.raft
            .as_ref()
            .map(|g| raft_group::RaftWatch::new(&g.raft))
    }

    /// Makes a read that follows linearizable: on a replicated shard,
    /// confirms with a quorum of its group that this node still leads
    /// (read index) and waits until its state has applied everything
    /// committed before the read began; then a read of this replica sees
    /// every write acknowledged before it, wherever it was acknowledged.
    /// A shard run alone has nothing to confirm. Not executed (safe to
    /// retry at the leader) when this node does not lead, or no quorum
    /// answers within [`READ_CONFIRM_WITHIN`].
    pub async fn linearize(&self) -> Result<(), StoreError> {
        self.linearize_by(ReadConfirm::ReadIndex).await
    }

    /// [`ShardStore::linearize`] by the given means: what the served
    /// reads use ([`ReadConfirm::ReadIndex`]) and what it was measured
    /// against (`BENCHMARKS.md`, "Reads: read index against a lease").
    pub async fn linearize_by(&self, how: ReadConfirm) -> Result<(), StoreError> {
        let policy = match how {
            ReadConfirm::ReadIndex => openraft::ReadPolicy::ReadIndex,
            ReadConfirm::Lease => openraft::ReadPolicy::LeaseRead,
        };
        let Some(g) = self.raft.as_ref().filter(|g| g.replicated) else {
            return Ok(());
        };
        let not_executed = |reason: String| StoreError::NotExecuted {
            shard: self.shard,
            reason,
        };
        match tokio::time::timeout(
            READ_CONFIRM_WITHIN,
            g.raft.ensure_linearizable(policy),
        )
        .await
        {
            Ok(Ok(_)) => Ok(()),
            Ok(Err(e)) => Err(raft_group::forwarded(
                &g.raft,
                self.shard,
                e.forward_to_leader(),
                || format!("this node could not confirm it leads the shard's group for a read: {e}"),
            )),
            Err(_) => Err(not_executed(format!(
                "no quorum of the shard's group confirmed this node's leadership for a read within {} ms",
                READ_CONFIRM_WITHIN.as_millis()
            ))),
        }
    }

    /// Hands a call from another replica of the shard's group to the
    /// group, and returns its answer.
    pub async fn handle_rpc(
        &self,
        rpc: crate::raft_net::Rpc,
    ) -> Result<crate::raft_net::RpcReply, String> {
        match &self.raft {
            Some(g) if g.replicated => raft_group::handle(g, rpc).await,
            _ => Err(self.not_replicated()),
        }
    }

    /// Checks an AppendEntries from the shard's leader before it joins
    /// [`ShardStore::append_stream`]: an error is the call's answer, and
    /// the call is not handed to the group. `behind_others`: an earlier
    /// call with entries of the same stream is not answered yet (counted
    /// in [`RaftStatus`](raft_group::RaftStatus)).
    pub fn admit_append(
        &self,
        rpc: &crate::raft_net::RaftAppend,
        behind_others: bool,
    ) -> Result<(), String> {
        match &self.raft {
            Some(g) if g.replicated => raft_group::admit_append(g, rpc, behind_others),
            _ => Err(self.not_replicated()),
        }
    }

    /// The group's answers to the AppendEntries of one leader's stream,
    /// one for each in order, each call handed to the group without
    /// waiting for the answer to the one before (each admitted first, by
    /// [`ShardStore::admit_append`]). The stream ends after an answer
    /// that is not a success, or once the group stops; it holds the
    /// group's Raft handle, not this shard.
    pub fn append_stream<S>(
        &self,
        input: S,
    ) -> Result<
        futures_util::stream::BoxStream<'static, Result<crate::raft_net::RaftAppendAnswer, String>>,
        String,
    >
    where
        S: futures_util::Stream<Item = crate::raft_net::RaftAppend> + Send + 'static,
    {
        match &self.raft {
            Some(g) if g.replicated => Ok(raft_group::append_stream(g, input)),
            _ => Err(self.not_replicated()),
        }
    }

    /// After the group answered a call of the stream: a replica whose data
    /// directory was new may have caught up by now.
    pub fn appended(&self) {
        if let Some(g) = self.raft.as_ref().filter(|g| g.replicated) {
            g.fresh_caught_up();
        }
    }

    fn not_replicated(&self) -> String {
        format!(
            "shard {} is not a replicated Raft group on this node",
            self.shard
        )
    }

    /// The shard's current epoch: writes must carry exactly this.
    pub fn epoch(&self) -> Epoch {
        Epoch(self.epoch.load(Ordering::Acquire))
    }

    /// Creates an execution (durably), or returns the one an earlier start
    /// with the same steering and idempotency key created.
    pub async fn start(&self, req: StartRequest) -> Result<StartOutcome, StoreError> {
        let (reply, rx) = oneshot::channel();
        self.send(Command::Start(req, reply)).await?;
        rx.await.map_err(|_| StoreError::WriterGone)?
    }

    /// Appends events (durably): acknowledged only after fsync.
    pub async fn append(&self, req: AppendRequest) -> Result<AppendOutcome, StoreError> {
        let (reply, rx) = oneshot::channel();
        self.send(Command::Append(req, reply)).await?;
        rx.await.map_err(|_| StoreError::WriterGone)?
    }

    /// Moves the shard to a newer epoch (durably). Writes carrying an older
    /// epoch are refused from then on. An older epoch than the current one
    /// is refused; the same one is a no-op.
    pub async fn advance_epoch(&self, epoch: Epoch) -> Result<Epoch, StoreError> {
        let (reply, rx) = oneshot::channel();
        self.send(Command::AdvanceEpoch(epoch, reply)).await?;
        rx.await.map_err(|_| StoreError::WriterGone)?
    }

    async fn send(&self, cmd: Command) -> Result<(), StoreError> {
        let ticket = self.writer.shared.ticket();
        self.tx
            .send(cmd)
            .await
            .map_err(|_| StoreError::WriterGone)?;
        self.writer.shared.submitted(ticket);
        Ok(())
    }

    /// Why the shard stopped taking writes, if it has (a failed write or
    /// sync of its log, or a commit that panicked). Reads still serve
    /// what was durable before.
    pub fn failure(&self) -> Option<String> {
        self.writer
            .shared
            .failure
            .get()
            .cloned()
            .or_else(|| self.node.as_ref().and_then(|n| n.failure()))
            .or_else(|| {
                self.group_stopped()
                    .map(|why| format!("its Raft group stopped ({why}); it is being restarted"))
            })
    }

    /// Asks the shard to checkpoint if the log has written `bytes` since
    /// its last checkpoint (`written` is the log's [`Log::written`]); a
    /// shard whose queue is full is busy, and checkpoints by itself.
    pub(crate) fn checkpoint_if_behind(&self, written: u64, bytes: u64) {
        let shared = &self.writer.shared;
        if written.saturating_sub(shared.checkpointed_at()) < bytes {
            return;
        }
        let (reply, _) = oneshot::channel();
        let ticket = shared.ticket();
        if self.tx.try_send(Command::Checkpoint(reply)).is_ok() {
            shared.submitted(ticket);
        }
    }

    /// Bytes in this shard's write buffer: its database's memtables,
    /// active and sealed, not yet flushed into tables.
    pub fn write_buffer_bytes(&self) -> u64 {
        self.ks.db.write_buffer_size()
    }

    /// Seals the memtable of every keyspace of the shard that holds writes
    /// and has none sealed already, and queues their flush to fjall's
    /// workers. A keyspace with a sealed memtable still unflushed is left
    /// alone: sealing more would not free memory sooner, and fjall stalls
    /// the writer at four. Whether any was sealed; every keyspace is
    /// tried, and the first failure is the answer.
    pub(crate) fn seal_write_buffer(&self) -> Result<bool, StoreError> {
        let mut sealed = false;
        let mut failed = None;
        for ks in self.ks.all() {
            if ks.sealed_memtable_count() == 0 {
                match ks.rotate_memtable() {
                    Ok(s) => sealed |= s,
                    Err(e) => failed = failed.or(Some(e)),
                }
            }
        }
        match failed {
            Some(e) => Err(e.into()),
            None => Ok(sealed),
        }
    }

    /// How this shard's commits were made since it was opened.
    pub fn commit_stats(&self) -> crate::CommitStats {
        self.writer.shared.stats()
    }

    /// How long the `fdatasync` of each group written to this shard's log
    /// took, since it was opened, if the shard writes a log of its own (on
    /// the node log: [`crate::Store::node_log_sync_latency`]).
    pub fn log_sync_latency(&self) -> Option<crate::LatencySnapshot> {
        self.events.own_log().map(|l| l.sync_latency.snapshot())
    }

    /// A counter bumped after every durable commit; long-polls wait on it.
    pub fn commits(&self) -> watch::Receiver<u64> {
        self.commits.clone()
    }

    pub fn execution(&self, id: ExecutionId) -> Result<Option<ExecutionMeta>, StoreError> {
        let (snap, tail) = view(&self.ks, &self.tail, id, u64::MAX, 0);
        read_meta(&self.ks, &snap, id, tail.as_ref())
    }

    /// The execution and up to `limit` of its events with seq > `after`, in
    /// order, read from one consistent snapshot. `None` if it does not exist.
    pub fn read_events(
        &self,
        id: ExecutionId,
        after: u64,
        limit: usize,
    ) -> Result<Option<(ExecutionMeta, Vec<StoredEvent>)>, StoreError> {
        self.read_events_fitting(id, after, limit, |_| Fit::Take)
    }

    /// Like [`ShardStore::read_events`], but the page also stops once the
    /// payloads of the events in it add up to `bytes_max` or more: always
    /// at least one event (if any follows `after`), and never more than
    /// `limit`. A caller continues after the last event returned.
    pub fn read_events_within(
        &self,
        id: ExecutionId,
        after: u64,
        limit: usize,
        bytes_max: usize,
    ) -> Result<Option<(ExecutionMeta, Vec<StoredEvent>)>, StoreError> {
        let mut bytes = 0usize;
        self.read_events_fitting(id, after, limit, |e| {
            bytes = bytes.saturating_add(e.payload.len());
            if bytes >= bytes_max {
                Fit::TakeAndEnd
            } else {
                Fit::Take
            }
        })
    }

    /// Like [`ShardStore::read_events`], but the page ends where `fit`
    /// says: it is asked of each event in turn, the first too (so that it
    /// can count it), and the page always holds at least one event (if
    /// any follows `after`: a first event it would end before, it takes
    /// and ends after). A caller continues after the last event returned.
    pub fn read_events_fitting(
        &self,
        id: ExecutionId,
        after: u64,
        limit: usize,
        mut fit: impl FnMut(&StoredEvent) -> Fit,
    ) -> Result<Option<(ExecutionMeta, Vec<StoredEvent>)>, StoreError> {
        let (snap, tail) = view(&self.ks, &self.tail, id, after, limit);
        let Some(meta) = read_meta(&self.ks, &snap, id, tail.as_ref())? else {
            return Ok(None);
        };
        let mut events = Vec::new();
        if after < meta.last_seq && limit > 0 {
            let through = meta.last_seq.min(after.saturating_add(limit as u64));
            // Logs are gap-free by construction; a gap in the index is
            // corruption and must not be papered over.
            let locs = index::locations(&self.ks, &snap, id, after, through, tail.as_ref())?;
            events.reserve(locs.len());
            for (seq, loc) in locs {
                let value = self.events.read_event(loc, id, seq)?;
                let event = codec::decode_event(seq, &value)?;
                match fit(&event) {
                    Fit::Take => events.push(event),
                    Fit::End if !events.is_empty() => break,
                    Fit::End | Fit::TakeAndEnd => {
                        events.push(event);
                        break;
                    }
                }
            }
        }
        Ok(Some((meta, events)))
    }

    /// Registers interest in `id`'s new events: the handle's
    /// [`crate::Interest::notified`] resolves after a durable commit that
    /// wrote `id` (not after commits of other executions of the shard).
    pub fn watch_execution(&self, id: ExecutionId) -> crate::Interest {
        self.writer.shared.waiters.register(id)
    }

    /// The executions started with this routing key (oldest id first).
    pub fn executions_for_key(
        &self,
        key: &str,
        limit: usize,
    ) -> Result<Vec<ExecutionId>, StoreError> {
        let prefix = codec::routing_key_prefix(PartitionId::for_key(key), key);
        let mut out = Vec::new();
        for item in self.ks.routing_keys.prefix(&prefix).take(limit) {
            let k = item.key()?;
            out.push(codec::decode_execution_id(
                &k[prefix.len()..],
                "routing key index",
            )?);
        }
        Ok(out)
    }

    /// Number of executions whose keys lie in this shard (approximate).
    pub fn approximate_executions(&self) -> usize {
        self.ks.executions.approximate_len()
    }

    /// Bytes this shard takes on disk: its database, and its own log if
    /// it has one (the node log's bytes are the node's:
    /// [`crate::Store::log_disk_bytes`]).
    pub fn disk_bytes(&self) -> u64 {
        self.ks.db.disk_space().unwrap_or(0) + self.events.own_bytes()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::Duration;

    /// A second writer over `shard`'s keyspaces, with a log, an index tail
    /// and a queue of its own (the shard's own writer stays idle), at
    /// epoch 1.
    fn second_writer(
        shard: &ShardStore,
        log: ShardLog,
        tail: SharedTail,
        rx: mpsc::Receiver<Command>,
    ) -> (Arc<commit::Shared>, std::thread::JoinHandle<()>) {
        let (commits_tx, _commits) = watch::channel(0u64);
        commit::spawn(
            ShardId(0),
            shard.ks.clone(),
            log,
            tail,
            StoreConfig::default().log_checkpoint_bytes,
            0,
            rx,
            Arc::new(AtomicU64::new(1)),
            commits_tx,
            None,
            commit::WriterState {
                checkpoints: Arc::default(),
                waiters: Arc::default(),
                cache: new_cache(),
                raft: None,
            },
        )
        .expect("the writer thread starts")
    }

    /// A ring can be taken by another park on the writer thread before the
    /// writer's own (the hand-over's `recv`, when the first command arrives
    /// while the thread is still waking from it): the writer must still
    /// commit a command that was queued before it first parked. Here the
    /// command is queued before the thread exists and never rung at all.
    #[tokio::test]
    async fn the_writer_commits_what_was_queued_before_it_first_parked() {
        let dir = tempfile::tempdir().expect("a temporary directory");
        let shard = ShardStore::open(dir.path(), ShardId(0), Epoch(1), &StoreConfig::default())
            .expect("the shard opens");
        // A second writer over the same keyspaces, with a log and a queue
        // of its own; the shard's own writer stays idle.
        let second_log = log::open(
            &dir.path().join("second-log"),
            Position::default(),
            log::SEGMENT_BYTES,
            |_| Ok(()),
        )
        .expect("a second log opens");
        let (tx, rx) = mpsc::channel(WRITER_QUEUE_DEPTH);
        let (reply, answer) = oneshot::channel();
        tx.try_send(Command::AdvanceEpoch(Epoch(2), reply))
            .unwrap_or_else(|_| panic!("the queue has room"));
        let (writer, thread) = second_writer(
            &shard,
            ShardLog::Own(second_log),
            Arc::new(RwLock::new(Tail::default())),
            rx,
        );
        let moved = tokio::time::timeout(Duration::from_secs(10), answer)
            .await
            .expect("a command queued before the writer started, never rung, is committed")
            .expect("the writer answers")
            .expect("the epoch moves");
        assert_eq!(moved, Epoch(2));
        // Lets the second writer thread stop.
        drop(tx);
        writer.ring();
        thread.join().expect("the second writer stops");
    }

    /// The writer commits to the node log as it does to a shard's own:
    /// the answers, the events where the index says they are (their
    /// locations resolved from where the syncer placed each part), and an
    /// idempotent retry answered from the group's own earlier event.
    #[tokio::test]
    async fn a_writer_over_the_node_log_commits_and_its_events_read_back() {
        let dir = tempfile::tempdir().expect("a temporary directory");
        let shard = ShardStore::open(dir.path(), ShardId(0), Epoch(1), &StoreConfig::default())
            .expect("the shard opens");
        let node = crate::node_log::NodeLog::open(&dir.path().join("node-log"), log::SEGMENT_BYTES)
            .expect("the node log opens");
        // Another group's parts between this one's, so that no location
        // is right by accident.
        let mut other = node.group(1);
        let log = ShardLog::Node(node.group(0), EventFiles::new(node.segments(), None));
        let segments = log.events();
        let tail = Arc::new(RwLock::new(Tail::default()));
        let (tx, rx) = mpsc::channel(WRITER_QUEUE_DEPTH);
        let (writer, thread) = second_writer(&shard, log, tail.clone(), rx);
        let id = ExecutionId::new(42).expect("an id");
        let (reply, started) = oneshot::channel();
        let start = crate::StartRequest {
            epoch: Epoch(1),
            id,
            workflow: "w".into(),
            started_payload: b"{}".to_vec(),
            routing_key: None,
            idempotency_key: None,
        };
        tx.send(Command::Start(start, reply)).await.expect("queued");
        writer.ring();
        started.await.expect("answered").expect("started");
        for n in 0..5u64 {
            other.begin().expect("begun");
            other.put(1, format!("other {n}").as_bytes(), b"x");
            other.append(|_| {});
            let (reply, appended) = oneshot::channel();
            let append = crate::AppendRequest {
                epoch: Epoch(1),
                id,
                events: vec![crate::NewEvent {
                    event_type: "step".into(),
                    payload: format!("payload {n}").into_bytes(),
                    idempotency_key: Some(format!("k{n}")),
                }],
                expected_last_seq: None,
            };
            tx.send(Command::Append(append, reply))
                .await
                .expect("queued");
            writer.ring();
            let out = appended.await.expect("answered").expect("appended");
            assert_eq!((out.first_seq, out.deduplicated), (n + 2, false));
        }
        // A retry of the third append: answered from the event as written.
        let (reply, retried) = oneshot::channel();
        let retry = crate::AppendRequest {
            epoch: Epoch(1),
            id,
            events: vec![crate::NewEvent {
                event_type: "step".into(),
                payload: b"payload 2".to_vec(),
                idempotency_key: Some("k2".into()),
            }],
            expected_last_seq: None,
        };
        tx.send(Command::Append(retry, reply))
            .await
            .expect("queued");
        writer.ring();
        let out = retried.await.expect("answered").expect("deduplicated");
        assert_eq!((out.first_seq, out.deduplicated), (4, true));
        let view = tail
            .read()
            .unwrap_or_else(|e| e.into_inner())
            .view(id, 0, 100)
            .expect("the tail holds the execution");
        assert_eq!(view.locs.len(), 6);
        for (i, loc) in view.locs.iter().enumerate() {
            let seq = i as u64 + 1;
            let value = segments.read_event(*loc, id, seq).expect("read back");
            let event = codec::decode_event(seq, &value).expect("an event");
            let want = if seq == 1 {
                b"{}".to_vec()
            } else {
                format!("payload {}", seq - 2).into_bytes()
            };
            assert_eq!(event.payload, want, "seq {seq}");
        }
        drop(tx);
        writer.ring();
        thread.join().expect("the writer stops");
    }
}

/// How long a move of a replica ([`ShardStore::replace_replica`]) waits
/// for its new node to catch up as a learner: at most `catch_up_within`
/// in all, and at most `unreachable_within` while the node answers
/// nothing and its learner takes no entry. `last_answered` is the
/// caller's word on when the node last answered (the server's probes of
/// its peers; `None`: never).
#[derive(Clone, Copy)]
pub struct MoveBounds<'a> {
    pub catch_up_within: std::time::Duration,
    pub unreachable_within: std::time::Duration,
    pub last_answered: &'a (dyn Fn() -> Option<std::time::Instant> + Send + Sync),
}

impl std::fmt::Debug for MoveBounds<'_> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("MoveBounds")
            .field("catch_up_within", &self.catch_up_within)
            .field("unreachable_within", &self.unreachable_within)
            .finish_non_exhaustive()
    }
}

/// How often a move's wait looks at its node's reachability.
const MOVE_LOOK_EVERY: std::time::Duration = std::time::Duration::from_millis(250);

/// A membership step openraft refused.
type MembershipRefusal = openraft::errors::RaftError<
    crate::raft_log::GroupConfig,
    openraft::errors::ClientWriteError<crate::raft_log::GroupConfig>,
>;

/// Holds a group's leader awake (its timers on, `quiet::hold_awake`) while
/// a membership step of it is under way, and lets it go quiet again once
/// the last one is over, done or not.
struct AwakeForMove<'a>(&'a raft_group::Group);

impl<'a> AwakeForMove<'a> {
    fn hold(g: &'a raft_group::Group, within: std::time::Duration) -> AwakeForMove<'a> {
        g.moves_under_way.fetch_add(1, Ordering::AcqRel);
        g.quiet.hold_awake(&g.raft, within);
        AwakeForMove(g)
    }
}

impl Drop for AwakeForMove<'_> {
    fn drop(&mut self) {
        if self.0.moves_under_way.fetch_sub(1, Ordering::AcqRel) == 1 {
            self.0.quiet.end_holds();
        }
    }
}

/// Counts a replacement of a replica under way on the group's leader
/// (`Group::replacing`) for as long as it is held.
struct Replacing<'a>(&'a raft_group::Group);

impl<'a> Replacing<'a> {
    fn hold(g: &'a raft_group::Group) -> Replacing<'a> {
        g.replacing.fetch_add(1, Ordering::AcqRel);
        Replacing(g)
    }
}

impl Drop for Replacing<'_> {
    fn drop(&mut self) {
        self.0.replacing.fetch_sub(1, Ordering::AcqRel);
    }
}

/// A change of voters [`ShardStore::finish_change_of_voters`] finished:
/// the voters it left, and the node it brought in (a move's target).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Finished {
    pub voters: Vec<u64>,
    pub joined: Option<u64>,
}

/// What [`ShardStore::replace_replica`] came to: the group's voters after
/// it, and whether it changed them (`false`: the replica to move was not
/// among them, so there was nothing to do, or it was done before).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Replaced {
    pub voters: Vec<u64>,
    pub changed: bool,
    /// The node that took the replica's place, when the call changed the
    /// voters: the one asked for, or, when the call finished a change its
    /// leader cut short (which took `from` out), that change's own target.
    pub to: Option<u64>,
}
