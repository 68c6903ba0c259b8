//! The commit scheduler: who commits a shard's next group, and when. A
//! shard's commands wait in one bounded queue; the shard's writer thread
//! takes them off it in groups, and on an idle shard the lone caller
//! commits its own command on its thread. Either way one group is
//! committed at a time, under one lock, and its answers go out only after
//! the group is durable and published (then the lock is let go first).
//! What committing a group does is the writer's ([`crate::writer`]).

use crate::checkpoints::CheckpointCounters;
use crate::keyspaces::Keyspaces;
use crate::read::SharedTail;
use crate::shard_log::ShardLog;
use crate::writer::{Command, Reply, Writer};
use crate::{StoreError, GROUP_COMMIT_BYTES_MAX, GROUP_COMMIT_COMMANDS_MAX};
use forkless_types::ShardId;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, OnceLock, TryLockError};
use std::thread::Thread;
use tokio::sync::{mpsc, watch};

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
    /// Groups that wrote and were proposed while earlier ones were still
    /// in flight (`docs/replication.md`, "Groups in flight").
    groups_behind_others: AtomicU64,
    /// Shared with the writer, which counts its checkpoints here.
    checkpoints: Arc<CheckpointCounters>,
    /// Why the shard stopped taking writes, once it has (set by the
    /// writer when a write or sync fails, or when a commit panicked).
    pub(crate) failure: Arc<OnceLock<String>>,
    /// Readers waiting on an execution's new events; the writer wakes
    /// them (see `waiters.rs`).
    pub(crate) waiters: Arc<crate::waiters::Waiters>,
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
    /// Of those groups, the ones a shard's Raft leader proposed while
    /// earlier ones were still in flight (not yet applied).
    pub groups_behind_others: u64,
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
    /// The queue is empty, or as many groups are in flight as may be, and
    /// their outcome is not known yet: an answer (or a new command)
    /// unparks the writer thread.
    InFlight,
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
                        // The writer thread has groups in flight: it
                        // takes this command once one settles.
                        Some((Err(NoGroup::InFlight), _)) => {}
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
            groups_behind_others: self.groups_behind_others.load(Ordering::Relaxed),
            checkpoints: self.checkpoints.made.load(Ordering::Relaxed),
            checkpoint_index_micros: self.checkpoints.index_micros.load(Ordering::Relaxed),
            checkpoint_sync_micros: self.checkpoints.sync_micros.load(Ordering::Relaxed),
        }
    }

    /// What the log's [`crate::log::Log::written`] said at the shard's
    /// last checkpoint.
    pub(crate) fn checkpointed_at(&self) -> u64 {
        self.checkpoints.at_written.load(Ordering::Relaxed)
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
                    let shard = core.writer.shard();
                    guard.take();
                    tracing::debug!(shard = %shard, "writer stopped: every handle was dropped");
                    return;
                }
                Err(NoGroup::Empty) => {
                    drop(guard);
                    std::thread::park();
                }
                Err(NoGroup::InFlight) => {
                    drop(guard);
                    // Bounded: an entry that never answers is settled as
                    // unknown at its deadline, looked at every slice.
                    std::thread::park_timeout(crate::writer::WAIT_SLICE);
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
    ///
    /// Groups in flight whose entries were applied are answered first,
    /// before the next group is evaluated (as soon as the writer thread
    /// is woken by their answer), so that their callers do not wait for
    /// one more evaluation and proposal.
    fn commit_next(&mut self, shared: &Shared, by: Committer) -> Result<Vec<Reply>, NoGroup> {
        if self.writer.has_in_flight() {
            let replies = self.writer.settle_ready();
            if !replies.is_empty() {
                shared.in_flight.fetch_sub(replies.len(), Ordering::AcqRel);
                return Ok(replies);
            }
        }
        if self.writer.pipeline_full() {
            return Err(NoGroup::InFlight);
        }
        let first = match self.rx.try_recv() {
            Ok(c) => c,
            Err(mpsc::error::TryRecvError::Empty) if self.writer.has_in_flight() => {
                return Err(NoGroup::InFlight)
            }
            Err(mpsc::error::TryRecvError::Empty) => return Err(NoGroup::Empty),
            Err(mpsc::error::TryRecvError::Disconnected) if self.writer.has_in_flight() => {
                let replies = self.writer.settle_all();
                shared.in_flight.fetch_sub(replies.len(), Ordering::AcqRel);
                return Ok(replies);
            }
            Err(mpsc::error::TryRecvError::Disconnected) => return Err(NoGroup::Closed),
        };
        let cmds = &mut self.group;
        let mut bytes = first.entry_bytes();
        cmds.push(first);
        while cmds.len() < GROUP_COMMIT_COMMANDS_MAX && bytes < GROUP_COMMIT_BYTES_MAX {
            match self.rx.try_recv() {
                Ok(c) => {
                    bytes += c.entry_bytes();
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
        // Only the writer thread leaves groups in flight: a caller
        // committing on its own thread waits for its own answer.
        let pipeline = match by {
            Committer::WriterThread => Some(&shared.thread),
            Committer::Caller => None,
        };
        let behind = self.writer.behind_others;
        let (replies, wrote) = self.writer.commit_group(cmds, pipeline);
        if self.writer.behind_others > behind {
            shared.groups_behind_others.fetch_add(1, Ordering::Relaxed);
        }
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

/// What the writer shares with the rest of the shard (its Raft group's
/// apply, when it has one, updates the same counters, waiters and cache).
pub(crate) struct WriterState {
    pub(crate) checkpoints: Arc<CheckpointCounters>,
    pub(crate) waiters: Arc<crate::waiters::Waiters>,
    pub(crate) cache: crate::apply::SharedCache,
    pub(crate) raft: Option<crate::writer::RaftWrite>,
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
    log: ShardLog,
    tail: SharedTail,
    checkpoint_bytes: u64,
    priority: i32,
    rx: mpsc::Receiver<Command>,
    epoch: Arc<AtomicU64>,
    commits: watch::Sender<u64>,
    requests_in_progress: Option<Arc<AtomicUsize>>,
    state: WriterState,
) -> Result<(Arc<Shared>, std::thread::JoinHandle<()>), StoreError> {
    let WriterState {
        checkpoints,
        waiters,
        cache,
        raft,
    } = state;
    let failure = Arc::new(OnceLock::new());
    let writer = Writer::new(
        shard,
        ks,
        log,
        tail,
        checkpoint_bytes,
        epoch,
        commits,
        checkpoints.clone(),
        failure.clone(),
        waiters.clone(),
        cache,
        raft,
    );
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
        groups_behind_others: AtomicU64::new(0),
        checkpoints,
        failure,
        waiters,
    });
    handover
        .send(shared.clone())
        .map_err(|_| StoreError::Io("writer thread ended at start".into()))?;
    Ok((shared, handle))
}
