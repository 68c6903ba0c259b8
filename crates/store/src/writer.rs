//! The shard's single writer: drains its queue into one atomic batch and one
//! fsync (group commit), then answers every command the batch covered.
//!
//! Being the only writer of its shard, it can check each command against
//! what is on disk plus what earlier commands of the same batch wrote, with
//! no locks: the checks and what a command writes are the state machine's
//! ([`crate::machine`]), and the writer gives it the shard's committed state
//! and the group being built ([`Group`]). Answers go out only after the
//! batch is durable; if the commit fails, every
//! command in it fails and the shard stops taking writes (the storage may be
//! in an unknown state after a failed fsync, so it fails stop).

use crate::codec;
use crate::index;
use crate::keyspaces::Keyspaces;
use crate::log::{Durable, Loc, Log, LogWriter};
use crate::machine::{self, HashMap, Machine};
use crate::read::SharedTail;
use crate::{
    AppendOutcome, AppendRequest, ExecutionMeta, StartOutcome, StartRequest, StoreError,
    StoredEvent, GROUP_COMMIT_BYTES_MAX, GROUP_COMMIT_COMMANDS_MAX,
};
use fjall::OwnedWriteBatch;
use forkless_types::{Epoch, ExecutionId, PartitionId, ShardId};
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Condvar, Mutex, OnceLock, TryLockError};
use std::thread::Thread;
use std::time::Instant;
use tokio::sync::{mpsc, oneshot, watch};

pub(crate) enum Command {
    Start(
        StartRequest,
        oneshot::Sender<Result<StartOutcome, StoreError>>,
    ),
    Append(
        AppendRequest,
        oneshot::Sender<Result<AppendOutcome, StoreError>>,
    ),
    AdvanceEpoch(Epoch, oneshot::Sender<Result<Epoch, StoreError>>),
}

impl Command {
    fn payload_bytes(&self) -> usize {
        match self {
            Command::Start(r, _) => r.started_payload.len() + r.workflow.len(),
            Command::Append(r, _) => r
                .events
                .iter()
                .map(|e| e.payload.len() + e.event_type.len())
                .sum(),
            Command::AdvanceEpoch(..) => 0,
        }
    }
}

enum Reply {
    Start(
        oneshot::Sender<Result<StartOutcome, StoreError>>,
        Result<StartOutcome, StoreError>,
    ),
    Append(
        oneshot::Sender<Result<AppendOutcome, StoreError>>,
        Result<AppendOutcome, StoreError>,
    ),
    Epoch(
        oneshot::Sender<Result<Epoch, StoreError>>,
        Result<Epoch, StoreError>,
    ),
}

impl Reply {
    fn send(self) {
        // A caller that went away (client disconnected) is not an error: the
        // write is durable either way.
        match self {
            Reply::Start(tx, r) => drop(tx.send(r)),
            Reply::Append(tx, r) => drop(tx.send(r)),
            Reply::Epoch(tx, r) => drop(tx.send(r)),
        }
    }

    fn fail(self, err: StoreError) -> Reply {
        match self {
            Reply::Start(tx, Ok(_)) => Reply::Start(tx, Err(err)),
            Reply::Append(tx, Ok(_)) => Reply::Append(tx, Err(err)),
            Reply::Epoch(tx, Ok(_)) => Reply::Epoch(tx, Err(err)),
            other => other,
        }
    }
}

/// The shard's writer state and its queue, shared by the writer thread and
/// by a submitting task that finds the shard idle.
///
/// Commits happen only under `core`'s lock, so the shard still has exactly
/// one writer at a time. Whoever holds the lock takes the next group off
/// the queue, commits it, and answers it after letting go of the lock.
/// Every queued command is committed by a caller that found the shard
/// idle, or by the writer thread, which a submitter rings ([`Shared::ring`])
/// whenever it does not see its command committed itself.
pub(crate) struct Shared {
    /// `None` after a commit panicked: the writer is gone and every queued
    /// and later command fails with `WriterGone`.
    core: Mutex<Option<Core>>,
    thread: Thread,
    /// Commands queued and not yet answered.
    in_flight: AtomicUsize,
    /// Lone commands committed in a row: a larger group, or a caller
    /// finding another one in flight, means callers overlap, and the
    /// writer thread should batch them, so the count starts again.
    solo_streak: AtomicUsize,
    /// See [`crate::StoreConfig::requests_in_progress`].
    requests_in_progress: Option<Arc<AtomicUsize>>,
    /// Groups committed by the writer thread and by callers, and the
    /// commands they carried.
    groups_by_thread: AtomicU64,
    groups_by_caller: AtomicU64,
    commands: AtomicU64,
    /// Shared with the writer, which counts its checkpoints here.
    checkpoints: Arc<CheckpointCounters>,
    /// Why the shard stopped taking writes, once it has (set by the
    /// writer when a write or sync fails, or when a commit panicked).
    pub(crate) failure: Arc<OnceLock<String>>,
    /// Readers waiting on an execution's new events; the writer wakes
    /// them (see `waiters.rs`).
    pub(crate) waiters: Arc<crate::waiters::Waiters>,
}

/// Checkpoints made and the time they took, in microseconds: building and
/// committing the index batch (readers wait for the commit, under the
/// tail's write lock) and syncing the keyspaces' journal after it (the
/// shard's next group waits for both, on the writer thread).
#[derive(Default)]
struct CheckpointCounters {
    made: AtomicU64,
    index_micros: AtomicU64,
    sync_micros: AtomicU64,
}

/// How a shard's commits were made, since it was opened. Only groups that
/// wrote something count (a group of refused commands commits nothing).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct CommitStats {
    /// Group commits (one atomic batch, one fsync each) made by the shard's
    /// writer thread.
    pub groups_by_writer_thread: u64,
    /// Group commits made on an idle shard by the caller's own thread.
    pub groups_by_caller: u64,
    /// Commands (starts, appends, epoch moves, refused ones included) those
    /// groups carried.
    pub commands: u64,
    /// Checkpoints of the log made (see
    /// [`crate::StoreConfig::log_checkpoint_bytes`]).
    pub checkpoints: u64,
    /// Time those checkpoints spent writing the tail to the index (readers
    /// wait for its commit only).
    pub checkpoint_index_micros: u64,
    /// Time they spent syncing the keyspaces' journal afterwards. The
    /// shard's next group waits for both.
    pub checkpoint_sync_micros: u64,
}

/// Lone commands in a row before a caller may commit on its own thread.
const SOLO_STREAK_FOR_INLINE: usize = 32;

struct Core {
    writer: Writer,
    rx: mpsc::Receiver<Command>,
    /// The group being committed (empty between groups; kept for its
    /// capacity).
    group: Vec<Command>,
}

/// A command counted in flight before it is queued (so that the count
/// never goes below the commands queued and unanswered). Dropped without
/// [`Shared::submitted`] (the queue was gone, or the caller gave up while
/// waiting for room in it), it takes the count back.
pub(crate) struct Ticket<'a> {
    shared: &'a Shared,
    /// Nothing else was in flight.
    first: bool,
    queued: bool,
}

impl Drop for Ticket<'_> {
    fn drop(&mut self) {
        if !self.queued {
            self.shared.in_flight.fetch_sub(1, Ordering::AcqRel);
        }
    }
}

/// If a commit panics, drops the writer and its queue (once the lock is
/// released by the unwinding), so that every queued caller learns at once
/// that the writer is gone instead of waiting for one that never comes.
struct DropCoreOnPanic<'a>(&'a Shared);

impl Drop for DropCoreOnPanic<'_> {
    fn drop(&mut self) {
        if std::thread::panicking() {
            let _ = self.0.failure.set("a commit panicked".into());
            let mut core = self.0.core.lock().unwrap_or_else(|p| p.into_inner());
            drop(core.take());
        }
    }
}

#[derive(Clone, Copy)]
enum Committer {
    WriterThread,
    Caller,
}

/// Why there was no group to commit.
enum NoGroup {
    /// The queue is empty.
    Empty,
    /// Every handle was dropped and the queue is empty: the writer stops.
    Closed,
}

impl Shared {
    /// Called after a command was queued. On an idle shard (nothing else in
    /// flight, nobody committing, and the last groups were lone commands)
    /// the caller commits the queue itself, on its own thread: at one
    /// client a request then costs no hand-off to the writer thread and
    /// back, two thread wake-ups that cost about as much as the fsync on
    /// this kind of disk. The caller blocks for one group commit, which is
    /// acceptable only because nothing else is waiting on this shard. As
    /// soon as callers arrive together the writer thread commits for them
    /// (measured: committing inline whenever nothing was in flight cost a
    /// quarter of the throughput at 16 clients, and after a single lone
    /// group a fifth at 4 clients; at 2 clients, inline commits that were
    /// never overlapped still cost a sixth).
    pub(crate) fn submitted(&self, mut ticket: Ticket<'_>) {
        ticket.queued = true;
        if !ticket.first {
            // Another caller is waiting too: this shard has concurrent
            // callers, whom the writer thread batches.
            self.solo_streak.store(0, Ordering::Release);
        } else if self.solo_streak.load(Ordering::Acquire) >= SOLO_STREAK_FOR_INLINE
            && self
                .requests_in_progress
                .as_ref()
                .is_none_or(|n| n.load(Ordering::Acquire) <= 1)
        {
            let _unwind = DropCoreOnPanic(self);
            match self.core.try_lock() {
                Ok(mut guard) => {
                    let step = guard.as_mut().map(|core| {
                        (
                            core.commit_next(self, Committer::Caller),
                            core.rx.is_empty(),
                        )
                    });
                    // Answers go out once the lock is free (see thread_main).
                    drop(guard);
                    match step {
                        Some((Ok(replies), empty)) => {
                            answer(replies);
                            // Ringing the writer thread for nothing costs
                            // it a wake-up, and, woken, it would hold the
                            // lock just when this caller's next command
                            // tries for it.
                            if empty {
                                return;
                            }
                        }
                        // Another committer took this command's group.
                        Some((Err(_), _)) => return,
                        None => {}
                    }
                }
                Err(TryLockError::Poisoned(p)) => drop(p.into_inner().take()),
                Err(TryLockError::WouldBlock) => {}
            }
        }
        self.ring();
    }

    /// Counts a command as in flight; take it before queueing the command
    /// and hand it to [`Shared::submitted`] once the command is queued.
    pub(crate) fn ticket(&self) -> Ticket<'_> {
        Ticket {
            shared: self,
            first: self.in_flight.fetch_add(1, Ordering::AcqRel) == 0,
            queued: false,
        }
    }

    pub(crate) fn stats(&self) -> CommitStats {
        CommitStats {
            groups_by_writer_thread: self.groups_by_thread.load(Ordering::Relaxed),
            groups_by_caller: self.groups_by_caller.load(Ordering::Relaxed),
            commands: self.commands.load(Ordering::Relaxed),
            checkpoints: self.checkpoints.made.load(Ordering::Relaxed),
            checkpoint_index_micros: self.checkpoints.index_micros.load(Ordering::Relaxed),
            checkpoint_sync_micros: self.checkpoints.sync_micros.load(Ordering::Relaxed),
        }
    }

    /// Wakes the writer thread to drain the queue (or to see that every
    /// handle is gone). A ring while it is busy is remembered.
    pub(crate) fn ring(&self) {
        self.thread.unpark();
    }

    /// Commits group after group until the queue is empty, then parks
    /// until rung. It tries the queue before its first park: a ring is an
    /// unpark, and a park anywhere else on this thread takes it (the
    /// hand-over's `recv` in [`spawn`] did, when the first command was rung
    /// while this thread was still waking from it, and a bounded channel
    /// inside the storage engine could). Every ring follows its command's
    /// queueing, so a look at the queue after a lost ring still finds the
    /// command; only a ring after the last look must reach the park below,
    /// and nothing else parks in between.
    ///
    /// Each group's answers go out after the lock is released: an answer
    /// wakes its caller, and on a busy machine the wake-up can preempt this
    /// thread on the spot. Holding the lock then would make a lone caller's
    /// next command find it taken, ring, and be committed here, and so on
    /// for every later one.
    fn thread_main(&self) {
        let _unwind = DropCoreOnPanic(self);
        loop {
            let mut guard = match self.core.lock() {
                Ok(g) => g,
                Err(p) => {
                    // A commit panicked: drop the queue so that every caller
                    // learns the writer is gone instead of waiting forever.
                    drop(p.into_inner().take());
                    return;
                }
            };
            let Some(core) = guard.as_mut() else { return };
            match core.commit_next(self, Committer::WriterThread) {
                Ok(replies) => {
                    drop(guard);
                    answer(replies);
                }
                Err(NoGroup::Closed) => {
                    core.writer.close();
                    let shard = core.writer.shard;
                    guard.take();
                    tracing::debug!(shard = %shard, "writer stopped: every handle was dropped");
                    return;
                }
                Err(NoGroup::Empty) => {
                    drop(guard);
                    std::thread::park();
                }
            }
        }
    }
}

fn answer(replies: Vec<Reply>) {
    for r in replies {
        r.send();
    }
}

impl Core {
    /// Takes the next group off the queue and commits it; the answers are
    /// for the caller to send once it has released the lock. `Err` if the
    /// queue is empty or closed.
    fn commit_next(&mut self, shared: &Shared, by: Committer) -> Result<Vec<Reply>, NoGroup> {
        let first = match self.rx.try_recv() {
            Ok(c) => c,
            Err(mpsc::error::TryRecvError::Empty) => return Err(NoGroup::Empty),
            Err(mpsc::error::TryRecvError::Disconnected) => return Err(NoGroup::Closed),
        };
        let cmds = &mut self.group;
        let mut bytes = first.payload_bytes();
        cmds.push(first);
        while cmds.len() < GROUP_COMMIT_COMMANDS_MAX && bytes < GROUP_COMMIT_BYTES_MAX {
            match self.rx.try_recv() {
                Ok(c) => {
                    bytes += c.payload_bytes();
                    cmds.push(c);
                }
                Err(_) => break,
            }
        }
        if cmds.len() == 1 {
            shared.solo_streak.fetch_add(1, Ordering::AcqRel);
        } else {
            shared.solo_streak.store(0, Ordering::Release);
        }
        let group = cmds.len() as u64;
        let (replies, wrote) = self.writer.commit_group(cmds);
        if wrote {
            match by {
                Committer::WriterThread => &shared.groups_by_thread,
                Committer::Caller => &shared.groups_by_caller,
            }
            .fetch_add(1, Ordering::Relaxed);
            shared.commands.fetch_add(group, Ordering::Relaxed);
        }
        // Counted down before the answers go out, so that a caller who
        // submits again right after its answer can find the shard idle.
        shared.in_flight.fetch_sub(replies.len(), Ordering::AcqRel);
        Ok(replies)
    }
}

/// Starts the shard's writer thread; submit commands on `tx`'s channel and
/// then call [`Shared::submitted`]. The thread stops (after a checkpoint)
/// once every sender is dropped and it is rung. It runs `priority` nice
/// steps above the process's main thread if the process may (see
/// [`crate::StoreConfig::writer_priority`]).
#[allow(clippy::too_many_arguments)]
pub(crate) fn spawn(
    shard: ShardId,
    ks: Keyspaces,
    log: LogWriter,
    tail: SharedTail,
    checkpoint_bytes: u64,
    priority: i32,
    rx: mpsc::Receiver<Command>,
    epoch: Arc<AtomicU64>,
    commits: watch::Sender<u64>,
    requests_in_progress: Option<Arc<AtomicUsize>>,
) -> Result<(Arc<Shared>, std::thread::JoinHandle<()>), StoreError> {
    let checkpoints = Arc::new(CheckpointCounters::default());
    let failure = Arc::new(OnceLock::new());
    let waiters = Arc::new(crate::waiters::Waiters::default());
    let writer = Writer {
        waiters: waiters.clone(),
        checkpoints: checkpoints.clone(),
        failure: failure.clone(),
        shard,
        ks,
        log,
        tail,
        pending: Vec::new(),
        since_checkpoint: 0,
        checkpoint_bytes: checkpoint_bytes.max(1),
        epoch,
        commits,
        failed: None,
        cache: MetaCache::new(META_CACHE_GENERATION_ENTRIES),
        machine: Machine::default(),
        durable: Arc::default(),
    };
    let core = Mutex::new(Some(Core {
        writer,
        rx,
        group: Vec::new(),
    }));
    // The thread needs the shared state and the shared state names the
    // thread: hand the state over once it exists.
    let (handover, received) = std::sync::mpsc::sync_channel::<Arc<Shared>>(1);
    let handle = std::thread::Builder::new()
        .name(format!("shard-{shard}-writer"))
        .spawn(move || {
            crate::priority::raise_own_priority(priority);
            if let Ok(shared) = received.recv() {
                shared.thread_main();
            }
        })
        .map_err(|e| StoreError::Io(format!("spawning writer thread: {e}")))?;
    let shared = Arc::new(Shared {
        core,
        thread: handle.thread().clone(),
        in_flight: AtomicUsize::new(0),
        solo_streak: AtomicUsize::new(0),
        requests_in_progress,
        groups_by_thread: AtomicU64::new(0),
        groups_by_caller: AtomicU64::new(0),
        commands: AtomicU64::new(0),
        checkpoints,
        failure,
        waiters,
    });
    handover
        .send(shared.clone())
        .map_err(|_| StoreError::Io("writer thread ended at start".into()))?;
    Ok((shared, handle))
}

struct Writer {
    shard: ShardId,
    ks: Keyspaces,
    /// The shard's log: every group is written and synced here first.
    log: LogWriter,
    /// The in-memory part of the events index, shared with readers.
    tail: SharedTail,
    /// Events of the group being built, indexed once it is durable.
    pending: Vec<PendingEvent>,
    /// Log bytes written since the last checkpoint.
    since_checkpoint: u64,
    /// See [`crate::StoreConfig::log_checkpoint_bytes`].
    checkpoint_bytes: u64,
    epoch: Arc<AtomicU64>,
    commits: watch::Sender<u64>,
    /// Woken for the executions each durable group wrote.
    waiters: Arc<crate::waiters::Waiters>,
    /// Set after a failed commit: every later write is refused with it
    /// (a [`StoreError::ShardFailed`]).
    failed: Option<StoreError>,
    /// The same reason, for readers of the shard's state.
    failure: Arc<OnceLock<String>>,
    /// Metadata of recently written executions, exactly as on disk: the
    /// writer is the shard's only writer and updates it only after a commit
    /// succeeded, so it can never be ahead of or behind the disk. Saves a
    /// memtable/table lookup per append on the hot path.
    cache: MetaCache,
    /// What the commands do; it holds what the group being built wrote so
    /// far (empty between groups; kept for its tables' capacity).
    machine: Machine,
    /// Where the log reports the group being committed durable.
    durable: Arc<DurableSlot>,
    checkpoints: Arc<CheckpointCounters>,
}

/// Where the log reports a group durable ([`Log::append`]'s callback),
/// for the writer that waits for it: the segment log calls back before
/// `append` returns, a log with a syncer of its own from that thread.
#[derive(Default)]
struct DurableSlot {
    made: Mutex<Option<Result<Durable, StoreError>>>,
    filled: Condvar,
}

impl DurableSlot {
    fn fill(&self, made: Result<Durable, StoreError>) {
        *self.made.lock().unwrap_or_else(|e| e.into_inner()) = Some(made);
        self.filled.notify_one();
    }

    fn wait(&self) -> Result<Durable, StoreError> {
        let mut made = self.made.lock().unwrap_or_else(|e| e.into_inner());
        loop {
            if let Some(made) = made.take() {
                return made;
            }
            made = self.filled.wait(made).unwrap_or_else(|e| e.into_inner());
        }
    }
}

/// An event of the group being built.
struct PendingEvent {
    partition: PartitionId,
    id: ExecutionId,
    seq: u64,
    loc: Loc,
    recorded_at: u64,
}

/// Entries in each of the metadata cache's two generations (about 200
/// bytes an entry, so the cache stays under ~13 MiB a shard).
const META_CACHE_GENERATION_ENTRIES: usize = 32_768;

/// The writer's cache of execution metadata, bounded by two generations:
/// writes go to the young one; when it is full it becomes the old one and
/// the previous old one is dropped. An execution written at least once per
/// generation (`per_generation` writes of other executions) therefore never
/// leaves it, and a full cache never goes cold at once: a lookup that
/// misses the young generation still finds what the old one has.
struct MetaCache {
    young: HashMap<ExecutionId, ExecutionMeta>,
    old: HashMap<ExecutionId, ExecutionMeta>,
    per_generation: usize,
}

impl MetaCache {
    fn new(per_generation: usize) -> Self {
        Self {
            young: HashMap::default(),
            old: HashMap::default(),
            per_generation: per_generation.max(1),
        }
    }

    fn get(&self, id: &ExecutionId) -> Option<&ExecutionMeta> {
        self.young.get(id).or_else(|| self.old.get(id))
    }

    /// Records what a commit wrote (never before the commit succeeded).
    fn extend(&mut self, metas: impl IntoIterator<Item = (ExecutionId, ExecutionMeta)>) {
        for (id, meta) in metas {
            if self.young.len() >= self.per_generation {
                // The old generation's table becomes the young one, emptied
                // but keeping its capacity: no regrowing on the writer's
                // path every generation.
                std::mem::swap(&mut self.old, &mut self.young);
                self.young.clear();
            }
            // A stale copy in the old generation is shadowed by this one
            // and dropped with the old generation at the next rotation.
            self.young.insert(id, meta);
        }
    }

    #[cfg(test)]
    fn len(&self) -> usize {
        self.young.len() + self.old.len()
    }
}

impl Writer {
    /// Applies `cmds` as one atomic batch with one fsync and returns their
    /// answers, to be sent by the caller (after the commit, never before).
    /// Also says whether the group wrote anything (a group of refused
    /// commands commits nothing and costs no fsync).
    fn commit_group(&mut self, cmds: &mut Vec<Command>) -> (Vec<Reply>, bool) {
        let now = now_ms();
        if self.failed.is_none() {
            if let Err(e) = self.log.begin() {
                self.fail_stop(e);
            }
        }
        self.pending.clear();
        // Applied to the keyspaces only once the group is durable in the
        // log, which is what makes them durable: no sync of fjall's own.
        let mut batch = self.ks.db.batch().durability(None);
        self.machine.begin();
        let mut group = Group {
            ks: &self.ks,
            tail: &self.tail,
            cache: &self.cache,
            epoch: &self.epoch,
            log: &mut self.log,
            batch: &mut batch,
            pending: &mut self.pending,
        };
        let mut replies = Vec::with_capacity(cmds.len());
        for cmd in cmds.drain(..) {
            // A failed disk is this replica's fact, not the shard's state:
            // checked here, before the machine sees the command.
            if let Some(e) = &self.failed {
                replies.push(match cmd {
                    Command::Start(_, tx) => Reply::Start(tx, Err(e.clone())),
                    Command::Append(_, tx) => Reply::Append(tx, Err(e.clone())),
                    Command::AdvanceEpoch(_, tx) => Reply::Epoch(tx, Err(e.clone())),
                });
                continue;
            }
            let machine = &mut self.machine;
            replies.push(match cmd {
                Command::Start(req, tx) => Reply::Start(tx, machine.start(&mut group, &req, now)),
                Command::Append(req, tx) => {
                    Reply::Append(tx, machine.append(&mut group, &req, now))
                }
                Command::AdvanceEpoch(e, tx) => {
                    Reply::Epoch(tx, machine.advance_epoch(&mut group, e))
                }
            });
        }
        let wrote = !self.log.is_empty();
        if wrote {
            let slot = self.durable.clone();
            self.log.append(move |made| slot.fill(made));
            let made = self.durable.wait().and_then(|durable| {
                self.since_checkpoint += durable.bytes;
                self.publish(batch)
            });
            if let Err(err) = made {
                self.fail_stop(err.clone());
                // The group reached the disk in part, in full or not at
                // all: its writes' outcome is unknown (a reopen finds out).
                let unknown = StoreError::OutcomeUnknown {
                    shard: self.shard,
                    reason: err.to_string(),
                };
                let failed = replies
                    .into_iter()
                    .map(|r| r.fail(unknown.clone()))
                    .collect();
                return (failed, false);
            }
            if let Some(e) = self.machine.epoch_moved() {
                self.epoch.store(e.get(), Ordering::Release);
            }
            self.waiters.wake(self.machine.written());
            self.cache.extend(self.machine.take_written());
            self.commits.send_modify(|c| *c += 1);
            if self.since_checkpoint >= self.checkpoint_bytes {
                if let Err(e) = self.checkpoint() {
                    // This group is durable and visible; later ones are
                    // refused, since the keyspaces' state is unknown.
                    self.fail_stop(e);
                }
            }
        }
        (replies, wrote)
    }

    /// Makes a durable group visible: its events in the tail and its puts
    /// in the keyspaces, together (readers take the tail's lock with their
    /// snapshot).
    fn publish(&mut self, batch: OwnedWriteBatch) -> Result<(), StoreError> {
        let mut tail = self.tail.write().unwrap_or_else(|e| e.into_inner());
        for e in self.pending.drain(..) {
            tail.push(e.partition, e.id, e.seq, e.loc, e.recorded_at)?;
        }
        if !batch.is_empty() {
            batch.commit()?;
        }
        Ok(())
    }

    /// Moves the tail into the sorted index (see
    /// [`crate::index::Tail::checkpoint`]), then makes it durable. Only the
    /// commit of the index batch holds the tail's write lock (this thread
    /// is the tail's only writer, so the batch is built under the read
    /// lock, and nothing changes in between): the entries and the
    /// checkpoint position are visible to readers once committed. Until
    /// the sync that follows, a crash finds the previous checkpoint and
    /// replays the log from there, which writes the same entries again.
    fn checkpoint(&mut self) -> Result<(), StoreError> {
        let start = Instant::now();
        let at = self.log.position();
        let (batch, written) = self
            .tail
            .read()
            .unwrap_or_else(|e| e.into_inner())
            .checkpoint_batch(&self.ks, at);
        self.tail
            .write()
            .unwrap_or_else(|e| e.into_inner())
            .commit_checkpoint(batch)?;
        let indexed = start.elapsed();
        self.ks
            .db
            .persist(fjall::PersistMode::SyncData)
            .map_err(StoreError::from)?;
        let synced = start.elapsed() - indexed;
        self.since_checkpoint = 0;
        let c = &self.checkpoints;
        c.made.fetch_add(1, Ordering::Relaxed);
        c.index_micros
            .fetch_add(indexed.as_micros() as u64, Ordering::Relaxed);
        c.sync_micros
            .fetch_add(synced.as_micros() as u64, Ordering::Relaxed);
        tracing::debug!(
            shard = %self.shard,
            entries = written.entries,
            events = written.events,
            index_us = indexed.as_micros() as u64,
            sync_us = synced.as_micros() as u64,
            "checkpoint"
        );
        Ok(())
    }

    /// Refuses every later write: after a failed write or sync the state
    /// of the log's end (and of the keyspaces) is unknown until reopened.
    /// The group being built is dropped and the log takes no more groups:
    /// a write the clients were told had failed must never become durable
    /// later (after a failed `fdatasync` the kernel may even have marked
    /// the unwritten pages clean, so a later sync would not say so).
    fn fail_stop(&mut self, e: StoreError) {
        if self.failed.is_some() {
            return;
        }
        self.log.fail_stop();
        let reason =
            format!("a write or sync of its log failed ({e}); restart the node to reopen it");
        tracing::error!(shard = %self.shard, error = %e, "commit failed; the shard refuses writes from now on");
        let _ = self.failure.set(reason.clone());
        self.failed = Some(StoreError::ShardFailed {
            shard: self.shard,
            reason,
        });
    }

    /// Checkpoints on the way out, so that the next open replays nothing.
    fn close(&mut self) {
        if self.failed.is_none() && self.since_checkpoint > 0 {
            if let Err(e) = self.checkpoint() {
                tracing::warn!(shard = %self.shard, error = %e, "checkpoint at close failed; the next open replays the log");
            }
        }
    }
}

/// The writer's side of the state machine for one group: the shard's
/// committed state (the metadata cache, the keyspaces, the log) to check
/// commands against, and the group being built to write them into.
struct Group<'a> {
    ks: &'a Keyspaces,
    tail: &'a SharedTail,
    cache: &'a MetaCache,
    epoch: &'a AtomicU64,
    log: &'a mut LogWriter,
    batch: &'a mut OwnedWriteBatch,
    pending: &'a mut Vec<PendingEvent>,
}

impl machine::State for Group<'_> {
    fn epoch(&self) -> Epoch {
        Epoch(self.epoch.load(Ordering::Acquire))
    }

    fn meta(&self, id: ExecutionId) -> Result<Option<ExecutionMeta>, StoreError> {
        if let Some(m) = self.cache.get(&id) {
            return Ok(Some(m.clone()));
        }
        // Only this thread writes the shard, so the latest committed state
        // is the state.
        let (snap, tail) = crate::read::view(self.ks, self.tail, id, u64::MAX, 0);
        crate::read::read_meta(self.ks, &snap, id, tail.as_ref())
    }

    fn start_idem(&self, key: &[u8]) -> Result<Option<ExecutionId>, StoreError> {
        self.ks
            .start_idem
            .get(key)?
            .map(|v| codec::decode_execution_id(&v, "start idempotency index"))
            .transpose()
    }

    fn event_idem(&self, key: &[u8]) -> Result<Option<u64>, StoreError> {
        self.ks
            .event_idem
            .get(key)?
            .map(|v| codec::decode_u64(&v, "event idempotency index"))
            .transpose()
    }

    /// From the group being built if an earlier command of it wrote the
    /// event, else from the log.
    fn stored_event(&self, id: ExecutionId, seq: u64) -> Result<StoredEvent, StoreError> {
        if let Some(p) = self.pending.iter().find(|p| p.id == id && p.seq == seq) {
            return codec::decode_event(seq, self.log.pending_event(p.loc)?);
        }
        let (snap, tail) = crate::read::view(self.ks, self.tail, id, seq - 1, 1);
        let locs = index::locations(self.ks, &snap, id, seq - 1, seq, tail.as_ref())?;
        let (_, loc) = locs.first().ok_or_else(|| {
            StoreError::Corrupt(format!("execution {id}: event {seq} is not indexed"))
        })?;
        let value = self.log.segments().read_event(*loc, id, seq)?;
        codec::decode_event(seq, &value)
    }
}

impl machine::Sink for Group<'_> {
    fn event(&mut self, id: ExecutionId, seq: u64, recorded_at: u64, value: &[u8]) {
        let partition = id.partition();
        let loc = self.log.event(partition, id, seq, value);
        self.pending.push(PendingEvent {
            partition,
            id,
            seq,
            loc,
            recorded_at,
        });
    }

    /// To the log now, to the keyspaces once the group is durable.
    fn put(&mut self, keyspace: u8, key: &[u8], value: &[u8]) {
        self.log.put(keyspace, key, value);
        if let Some(ks) = self.ks.by_id(keyspace) {
            self.batch.insert(ks, key, value);
        }
    }
}

fn now_ms() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_millis() as u64)
        .unwrap_or(0)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::ExecutionStatus;

    fn id(n: u64) -> ExecutionId {
        ExecutionId::new(n as i64 + 1).expect("a valid execution id")
    }

    fn meta(n: u64, last_seq: u64) -> (ExecutionId, ExecutionMeta) {
        let id = id(n);
        (
            id,
            ExecutionMeta {
                id,
                status: ExecutionStatus::Running,
                last_seq,
                created_at_ms: 1,
                updated_at_ms: 1,
                workflow: "w".into(),
                routing_key: None,
            },
        )
    }

    #[test]
    fn meta_cache_is_bounded_by_two_generations() {
        let mut c = MetaCache::new(100);
        for i in 0..10_000 {
            c.extend([meta(i, 1)]);
            assert!(c.len() <= 200, "{} entries after {i} writes", c.len());
        }
        // The last generation and the one before it are still there...
        assert!(c.get(&id(9_999)).is_some());
        assert!(c.get(&id(9_850)).is_some());
        // ...and nothing older.
        assert!(c.get(&id(9_000)).is_none());
    }

    #[test]
    fn meta_cache_keeps_an_execution_written_once_a_generation() {
        let mut c = MetaCache::new(100);
        for round in 0..50u64 {
            c.extend([meta(1, round + 1)]);
            // 99 writes of other executions: less than a generation.
            for i in 0..99 {
                c.extend([meta(1_000 + round * 100 + i, 1)]);
            }
            assert_eq!(c.get(&id(1)).map(|m| m.last_seq), Some(round + 1));
        }
    }

    #[test]
    fn meta_cache_answers_the_newest_state_across_rotations() {
        let mut c = MetaCache::new(3);
        c.extend([meta(7, 1), meta(8, 1), meta(9, 1)]);
        // 7 is rewritten in the next generation; its old copy is shadowed.
        c.extend([meta(7, 2)]);
        assert_eq!(c.get(&id(7)).map(|m| m.last_seq), Some(2));
        c.extend([meta(10, 1), meta(11, 1)]);
        assert_eq!(c.get(&id(7)).map(|m| m.last_seq), Some(2));
        // Another rotation drops the generation that had 7 at seq 1 and
        // moves the one with seq 2 to old: still the newest.
        c.extend([meta(12, 1)]);
        assert_eq!(c.get(&id(7)).map(|m| m.last_seq), Some(2));
        assert!(c.get(&id(8)).is_none());
    }
}
