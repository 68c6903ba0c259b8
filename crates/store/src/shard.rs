//! One shard's database: reads straight from fjall, writes through the
//! shard's single writer thread (see `writer.rs`).

use crate::codec;
use crate::writer::{self, Command};
use crate::{
    AppendOutcome, AppendRequest, ExecutionMeta, StartOutcome, StartRequest, StoreError,
    StoredEvent, WRITER_QUEUE_DEPTH,
};
use fjall::{Database, Keyspace, KeyspaceCreateOptions, Readable};
use forkless_types::{Epoch, ExecutionId, PartitionId, ShardId};
use std::path::Path;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::Arc;
use tokio::sync::{mpsc, oneshot, watch};

/// The smallest journal fjall keeps before flushing (its own minimum):
/// `StoreConfig::journal_bytes_max` below it is raised to it.
pub const JOURNAL_BYTES_MIN: u64 = 64 * 1024 * 1024;

/// Tuning of each shard's database.
#[derive(Debug, Clone)]
pub struct StoreConfig {
    /// Block cache per shard.
    pub cache_bytes_per_shard: u64,
    /// Background flush/compaction threads per shard.
    pub worker_threads_per_shard: usize,
    /// Journal bytes kept before memtables are flushed; bounds how much a
    /// restart after a crash replays (fjall's minimum is 64 MiB; its default
    /// of 512 MiB made a crashed shard take seconds to reopen).
    pub journal_bytes_max: u64,
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
}

impl Default for StoreConfig {
    fn default() -> Self {
        StoreConfig {
            cache_bytes_per_shard: 32 * 1024 * 1024,
            worker_threads_per_shard: 1,
            journal_bytes_max: JOURNAL_BYTES_MIN,
            requests_in_progress: None,
            background_nice: 10,
        }
    }
}

/// The keyspaces of one shard.
#[derive(Clone)]
pub(crate) struct Keyspaces {
    pub db: Database,
    /// Shard-level facts: the epoch.
    pub meta: Keyspace,
    /// `partition | execution` -> execution metadata.
    pub executions: Keyspace,
    /// `partition | execution | seq` -> event.
    pub events: Keyspace,
    /// `partition | execution | idempotency key` -> seq.
    pub event_idem: Keyspace,
    /// `key partition | len | routing key | execution` -> ().
    pub routing_keys: Keyspace,
    /// `key partition | len | routing key | idempotency key` -> execution.
    pub start_idem: Keyspace,
}

pub(crate) const EPOCH_KEY: &[u8] = b"epoch";

/// An execution's metadata as of `snap`: its record plus its last event.
pub(crate) fn read_meta(
    ks: &Keyspaces,
    snap: &impl Readable,
    id: ExecutionId,
) -> Result<Option<ExecutionMeta>, StoreError> {
    let key = codec::execution_key(id.partition(), id);
    let Some(record) = snap.get(&ks.executions, key)? else {
        return Ok(None);
    };
    // Every execution has at least its `execution.started` event, written
    // in the same batch as the record.
    let Some(last) = snap.prefix(&ks.events, key).next_back() else {
        return Err(StoreError::Corrupt(format!(
            "execution {id} has a record but no events"
        )));
    };
    let (k, v) = last.into_inner()?;
    Ok(Some(codec::decode_meta(
        id,
        &record,
        codec::last_event(&k, &v)?,
    )?))
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

#[cfg(target_os = "linux")]
fn lower_own_priority(by: i32) {
    if by <= 0 {
        return;
    }
    // SAFETY: errno is thread-local; get/setpriority only read their
    // integer arguments. `who` 0 with PRIO_PROCESS is the calling thread
    // on Linux.
    unsafe {
        // -1 is both a nice value and getpriority's error: errno tells.
        *libc::__errno_location() = 0;
        let own = libc::getpriority(libc::PRIO_PROCESS, 0);
        if own == -1 && *libc::__errno_location() != 0 {
            return;
        }
        if libc::setpriority(libc::PRIO_PROCESS, 0, (own + by).min(19)) != 0 {
            tracing::debug!(error = %std::io::Error::last_os_error(), "could not lower the storage threads' priority");
        }
    }
}

#[cfg(not(target_os = "linux"))]
fn lower_own_priority(_by: i32) {}

/// The writer's shared state; rings the writer thread when dropped.
struct WriterRef(Arc<writer::Shared>);

impl Drop for WriterRef {
    fn drop(&mut self) {
        self.0.ring();
    }
}

/// A handle on one shard's durable state. Cheap to share (`Arc`).
pub struct ShardStore {
    shard: ShardId,
    ks: Keyspaces,
    tx: mpsc::Sender<Command>,
    /// Declared after `tx`, so dropped after it: its drop rings the writer
    /// thread, which then finds every handle gone and stops.
    writer: WriterRef,
    epoch: Arc<AtomicU64>,
    commits: watch::Receiver<u64>,
}

impl ShardStore {
    pub(crate) fn open(
        path: &Path,
        shard: ShardId,
        initial_epoch: Epoch,
        config: &StoreConfig,
    ) -> Result<ShardStore, StoreError> {
        let builder = Database::builder(path)
            .cache_size(config.cache_bytes_per_shard)
            .worker_threads(config.worker_threads_per_shard.max(1))
            .max_journaling_size(config.journal_bytes_max.max(JOURNAL_BYTES_MIN));
        let db = open_below(builder, config.background_nice, path)?;
        let opts = KeyspaceCreateOptions::default;
        let ks = Keyspaces {
            meta: db.keyspace("meta", opts)?,
            executions: db.keyspace("executions", opts)?,
            // Events are only ever read by range (an execution's log, its
            // last event), never by point lookup, so a bloom filter would
            // be built at every flush and never consulted.
            events: db.keyspace("events", || {
                opts().filter_policy(fjall::config::FilterPolicy::disabled())
            })?,
            event_idem: db.keyspace("event_idem", opts)?,
            routing_keys: db.keyspace("routing_keys", opts)?,
            start_idem: db.keyspace("start_idem", opts)?,
            db,
        };
        let epoch = match ks.meta.get(EPOCH_KEY)? {
            Some(v) => Epoch(codec::decode_u64(&v, "shard epoch")?),
            None => {
                let mut batch = ks.db.batch().durability(Some(fjall::PersistMode::SyncAll));
                batch.insert(
                    &ks.meta,
                    EPOCH_KEY,
                    codec::u64_value(initial_epoch.get()).to_vec(),
                );
                batch.commit()?;
                initial_epoch
            }
        };
        let epoch = Arc::new(AtomicU64::new(epoch.get()));
        let (tx, rx) = mpsc::channel(WRITER_QUEUE_DEPTH);
        let (commits_tx, commits) = watch::channel(0u64);
        let writer = WriterRef(writer::spawn(
            shard,
            ks.clone(),
            rx,
            epoch.clone(),
            commits_tx,
            config.requests_in_progress.clone(),
        )?);
        Ok(ShardStore {
            shard,
            ks,
            tx,
            writer,
            epoch,
            commits,
        })
    }

    pub fn id(&self) -> ShardId {
        self.shard
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
        let ticket = self.writer.0.ticket();
        self.tx
            .send(cmd)
            .await
            .map_err(|_| StoreError::WriterGone)?;
        self.writer.0.submitted(ticket);
        Ok(())
    }

    /// How this shard's commits were made since it was opened.
    pub fn commit_stats(&self) -> crate::CommitStats {
        self.writer.0.stats()
    }

    /// A counter bumped after every durable commit; long-polls wait on it.
    pub fn commits(&self) -> watch::Receiver<u64> {
        self.commits.clone()
    }

    pub fn execution(&self, id: ExecutionId) -> Result<Option<ExecutionMeta>, StoreError> {
        read_meta(&self.ks, &self.ks.db.snapshot(), id)
    }

    /// The execution and up to `limit` of its events with seq > `after`, in
    /// order, read from one consistent snapshot. `None` if it does not exist.
    pub fn read_events(
        &self,
        id: ExecutionId,
        after: u64,
        limit: usize,
    ) -> Result<Option<(ExecutionMeta, Vec<StoredEvent>)>, StoreError> {
        let snap = self.ks.db.snapshot();
        let p = id.partition();
        let Some(meta) = read_meta(&self.ks, &snap, id)? else {
            return Ok(None);
        };
        let mut events = Vec::new();
        if after < meta.last_seq && limit > 0 {
            let from = codec::event_key(p, id, after.saturating_add(1));
            let to = codec::event_key(p, id, meta.last_seq);
            let range = snap.range(&self.ks.events, from..=to).take(limit);
            for (expect, item) in (after + 1..).zip(range) {
                let (k, v) = item.into_inner()?;
                let seq = codec::decode_u64(&k[12..], "event key")?;
                // Logs are gap-free by construction; a gap here is corruption
                // and must not be papered over.
                if seq != expect {
                    return Err(StoreError::Corrupt(format!(
                        "execution {id}: expected seq {expect}, found {seq}"
                    )));
                }
                events.push(codec::decode_event(seq, &v)?);
            }
            let want = (meta.last_seq - after).min(limit as u64);
            if events.len() as u64 != want {
                return Err(StoreError::Corrupt(format!(
                    "execution {id}: metadata says last seq {} but {} of {want} events were found after {after}",
                    meta.last_seq,
                    events.len()
                )));
            }
        }
        Ok(Some((meta, events)))
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

    /// Bytes this shard takes on disk.
    pub fn disk_bytes(&self) -> u64 {
        self.ks.db.disk_space().unwrap_or(0)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::Duration;

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
        // A second writer over the same keyspaces, fed by a queue of its
        // own; the shard's own writer stays idle.
        let (tx, rx) = mpsc::channel(WRITER_QUEUE_DEPTH);
        let (reply, answer) = oneshot::channel();
        tx.try_send(Command::AdvanceEpoch(Epoch(2), reply))
            .unwrap_or_else(|_| panic!("the queue has room"));
        let (commits_tx, _commits) = watch::channel(0u64);
        let writer = writer::spawn(
            ShardId(0),
            shard.ks.clone(),
            rx,
            Arc::new(AtomicU64::new(1)),
            commits_tx,
            None,
        )
        .expect("the writer thread starts");
        let moved = tokio::time::timeout(Duration::from_secs(10), answer)
            .await
            .expect("a command queued before the writer started, never rung, is committed")
            .expect("the writer answers")
            .expect("the epoch moves");
        assert_eq!(moved, Epoch(2));
        // Lets the second writer thread stop.
        drop(tx);
        writer.ring();
    }
}
