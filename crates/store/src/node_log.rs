//! The node-wide log: every group's appends (one group per shard replica)
//! in one segment log, made durable with one `fdatasync` a round for all
//! of them (`docs/replication.md`, "One log per node" and "The node-wide
//! log's format"). A round is written by whoever finds the log's writing
//! end free: an appender, on its own thread, when no round is being
//! written (so a lone writer pays no hand-off), else the syncer thread,
//! which takes what was appended while a round was being written.
//!
//! The physical log is today's segment log ([`LogWriter`]), with one
//! change of meaning: a checksummed frame is a **round**, and its payload
//! is **parts**, each one group's records or a cut of one group:
//!
//! ```text
//! part = 3 | group u32 | len u32 | record*                        (len: bytes of the records)
//!      | 4 | group u32 | after_segment u32 | after_offset u64     (the group's parts after that are void)
//!      | 5 | group u32 | len u32 | vote                           (a Raft group's vote)
//!      | 6 | group u32 | len u32 | entry                          (one Raft entry)
//!      | 7 | group u32 | len u32 | truncate                       (a Raft group's entries after an index are void)
//!      | 8 | group u32 | len u32 | record*                        (the first events a snapshot's install imports)
//!      | 9 | group u32 | len u32 | record*                        (more of them)
//!      | 10 | group u32 | len u32 | kept*                         (events the install found held already)
//! kept = partition u32 | execution u64 | first_seq u64 | count u32 | status u8
//! ```
//!
//! An import (8, 9, 10: `crate::snapshot`) is indexed by the install that
//! writes it, before the install's checkpoint; a replay never reads one
//! (an install a crash cut short is done again from the start, and a part
//! of kind 8 tells the offline check where an install's imports begin).
//! A part of kind 10 names runs of events the replica held, byte for byte,
//! when the install began: they keep the places they had (in parts written
//! before the install's first), and the part tells the offline check that
//! they are the install's too, in order with its imported events (`status`
//! is what the run's last event leaves its execution, as in a record).
//!
//! The node log frames the Raft parts (5-7) and keeps them in order; what
//! their bodies hold is [`crate::raft_log`]'s.
//!
//! A crash tears only the last round, all of whose appends were never
//! acknowledged (their callbacks run after its sync), so the torn tail
//! and damage stay apart exactly as in a shard's log. A group's part is
//! addressed by the end of its round, a frame boundary where a read can
//! start; a group has at most one part per round (a round holds a
//! group's second append back for the next one), so that position
//! names the part. A cut cannot zero bytes other groups share: it is a
//! part of its own, and reads (and a reopen) drop the group's parts
//! between the cut's position and the cut.
//!
//! Built behind the [`Log`] trait and held to its conformance suite; the
//! store uses it when [`crate::StoreConfig::node_log`] is on.

use crate::log::{self, Durable, GroupRead, Loc, Log, LogWriter, Position, Segments};
use crate::StoreError;
use forkless_types::{ExecutionId, PartitionId};
use std::collections::{HashMap, VecDeque};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Condvar, Mutex, MutexGuard};

/// The node log's first segment id: a shard's own log numbers its
/// segments from 0, so an event's location says which of the two logs it
/// is in, with no change to the events index's format (a shard written
/// before the node log keeps its events where they are).
pub(crate) const SEGMENT_BASE: u32 = 1 << 31;

/// Where an empty node log starts.
pub(crate) const START: Position = Position {
    segment: SEGMENT_BASE,
    offset: 0,
};

const PART: u8 = 3;
const CUT: u8 = 4;
/// The kinds of a Raft group's parts ([`crate::raft_log`]): framed as a
/// records part is, read back as [`PartRead::Raft`].
pub(crate) const VOTE: u8 = 5;
pub(crate) const ENTRY: u8 = 6;
pub(crate) const TRUNCATE: u8 = 7;
/// The kinds of a snapshot's imported events: the first part of an
/// install, and the rest.
pub(crate) const IMPORT_FIRST: u8 = 8;
pub(crate) const IMPORT: u8 = 9;
/// Runs of a snapshot's events the install found held already.
pub(crate) const KEPT: u8 = 10;
/// partition, execution, first seq, count, status.
const KEPT_RUN_BYTES: usize = 4 + 8 + 8 + 4 + 1;

/// Appends one run of kept events to a [`KEPT`] part's body: `count`
/// events of `id` from seq `first`, the last leaving it `status`.
pub(crate) fn push_kept_run(
    buf: &mut Vec<u8>,
    partition: PartitionId,
    id: ExecutionId,
    first: u64,
    count: u32,
    status: crate::ExecutionStatus,
) {
    buf.extend_from_slice(&partition.get().to_be_bytes());
    buf.extend_from_slice(&(id.get() as u64).to_be_bytes());
    buf.extend_from_slice(&first.to_be_bytes());
    buf.extend_from_slice(&count.to_be_bytes());
    buf.push(status.code());
}

/// The runs of a [`KEPT`] part's body ([`push_kept_run`]): execution,
/// first seq, count and status of each; or what is wrong with the body.
pub(crate) fn kept_runs(
    body: &[u8],
) -> Result<Vec<(ExecutionId, u64, u32, crate::ExecutionStatus)>, String> {
    let runs = body.chunks_exact(KEPT_RUN_BYTES);
    if !runs.remainder().is_empty() {
        return Err(format!("a part of kept events of {} bytes", body.len()));
    }
    runs.map(|run| {
        let mut f = crate::codec::Reader::new(run, "kept events");
        let parsed = (|| -> Result<_, StoreError> {
            let _partition = f.u32()?;
            let id = f.u64()?;
            let id = ExecutionId::new(id as i64)
                .map_err(|e| StoreError::Corrupt(format!("kept events: {e}")))?;
            let first = f.u64()?;
            let count = f.u32()?;
            let status = crate::ExecutionStatus::from_code(f.u8()?)
                .ok_or_else(|| StoreError::Corrupt("kept events: an unknown status".into()))?;
            Ok((id, first, count, status))
        })();
        match parsed {
            Ok(run) if run.2 > 0 && run.1 > 0 => Ok(run),
            Ok(_) => Err("an empty run of kept events".to_string()),
            Err(e) => Err(e.to_string()),
        }
    })
    .collect()
}
/// kind, group, len.
const PART_HEADER: usize = 1 + 4 + 4;
/// kind, group, segment, offset.
const CUT_BYTES: usize = 1 + 4 + 4 + 8;
/// A round takes parts until it holds this many bytes (always at least
/// one part, whatever its size): a shard's group is at most about
/// [`crate::GROUP_COMMIT_BYTES_MAX`], so many busy shards cannot make one
/// round too large for its frame's length field.
const ROUND_BYTES_MAX: usize = crate::GROUP_COMMIT_BYTES_MAX;

type Callback = Box<dyn FnOnce(Result<Durable, StoreError>) + Send>;

/// What a group has in the log, as of its last durable part or cut.
#[derive(Debug, Clone, Default)]
struct GroupState {
    /// The end of the round of its last part (or the position its last
    /// cut cut after).
    end: Position,
    /// See [`Log::purge_before`].
    first: Position,
    /// Each cut: the position it cut after, and the end of its round.
    cuts: Vec<(Position, Position)>,
}

impl GroupState {
    /// Whether a part of this group in the round ending at `round_end`
    /// was cut away.
    fn cut_away(&self, round_end: Position) -> bool {
        self.cuts
            .iter()
            .any(|(after, cut_end)| *after < round_end && round_end < *cut_end)
    }
}

enum Body {
    Records(Vec<u8>),
    Cut(Position),
    /// Parts encoded whole, headers and all ([`push_raft_part`]): a Raft
    /// group's entries, vote or truncation.
    Parts(Vec<u8>),
    /// Records a snapshot's install imports, as a part of this kind
    /// ([`IMPORT_FIRST`] or [`IMPORT`]), or the runs of events it kept
    /// ([`KEPT`]).
    Import(u8, Vec<u8>),
}

struct Queued {
    group: u32,
    body: Body,
    done: Callback,
}

impl Queued {
    /// The bytes it takes in a round.
    fn bytes(&self) -> usize {
        match &self.body {
            Body::Records(records) | Body::Import(_, records) => PART_HEADER + records.len(),
            Body::Cut(_) => CUT_BYTES,
            Body::Parts(parts) => parts.len(),
        }
    }
}

struct Queue {
    waiting: VecDeque<Queued>,
    groups: HashMap<u32, GroupState>,
    /// The end of the last durable round.
    end: Position,
    /// Why the log takes no more rounds, once it does not.
    failed: Option<StoreError>,
    stop: bool,
    /// Buffers of parts already written, emptied, for the groups' next
    /// parts (at most [`SPARE_BUFFERS`], none over [`SPARE_BUFFER_BYTES`]):
    /// an append then allocates nothing.
    spare: Vec<Vec<u8>>,
}

const SPARE_BUFFERS: usize = 64;
const SPARE_BUFFER_BYTES: usize = 1 << 20;

struct Shared {
    dir: PathBuf,
    /// Where the open's read of the rounds began: no group reads before it.
    opened_from: Position,
    segments: Arc<Segments>,
    /// Bytes of the rounds written since the open (see [`Log::written`]).
    written: AtomicU64,
    queue: Mutex<Queue>,
    /// Rings the syncer thread.
    wake: Condvar,
    /// The log's writing end: whoever holds it writes the next round (an
    /// appender that finds it free, or the syncer thread).
    rounds: Mutex<Rounds>,
}

/// The log's writing end, and the round being built (kept for the
/// capacity of its tables).
struct Rounds {
    writer: LogWriter,
    round: Vec<Queued>,
    later: VecDeque<Queued>,
    taken: std::collections::HashSet<u32>,
    /// Where each part of the round starts in it.
    placed: Vec<u64>,
    /// The round's emptied buffers, on their way to [`Queue::spare`].
    emptied: Vec<Vec<u8>>,
}

impl Shared {
    fn lock(&self) -> MutexGuard<'_, Queue> {
        self.queue.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Writes what is waiting, if anything is, as one round (at most one
    /// part per group, within the round's budget): one pwrite and one
    /// fdatasync, then where each part landed is recorded and its
    /// callback called, in the order of the rounds (the caller holds
    /// `rounds`). Returns whether it wrote one.
    fn write_round(&self, r: &mut Rounds) -> bool {
        let Rounds {
            writer,
            round,
            later,
            taken,
            placed,
            emptied,
        } = r;
        {
            let mut q = self.lock();
            taken.clear();
            let mut bytes = 0;
            while let Some(item) = q.waiting.pop_front() {
                // At least one part; then as many as fit the round's budget.
                let full = !round.is_empty() && bytes + item.bytes() > ROUND_BYTES_MAX;
                if !full && taken.insert(item.group) {
                    bytes += item.bytes();
                    round.push(item);
                } else {
                    later.push_back(item);
                }
            }
            // Held back for the next round, in their order, ahead of
            // anything appended meanwhile.
            while let Some(item) = later.pop_back() {
                q.waiting.push_front(item);
            }
        }
        if round.is_empty() {
            return false;
        }
        placed.clear();
        let made = writer.begin().and_then(|()| {
            let start = writer.position();
            for item in round.iter() {
                let mut header = [0u8; CUT_BYTES];
                let group = item.group.to_be_bytes();
                placed.push(match &item.body {
                    Body::Records(records) | Body::Import(_, records) => {
                        header[0] = match &item.body {
                            Body::Import(kind, _) => *kind,
                            _ => PART,
                        };
                        header[1..5].copy_from_slice(&group);
                        header[5..9].copy_from_slice(&(records.len() as u32).to_be_bytes());
                        writer.push_raw(&header[..PART_HEADER]);
                        writer.push_raw(records)
                    }
                    Body::Cut(after) => {
                        header[0] = CUT;
                        header[1..5].copy_from_slice(&group);
                        header[5..9].copy_from_slice(&after.segment.to_be_bytes());
                        header[9..17].copy_from_slice(&after.offset.to_be_bytes());
                        writer.push_raw(&header)
                    }
                    Body::Parts(parts) => writer.push_raw(parts),
                });
            }
            writer.commit().map(|bytes| (start, bytes))
        });
        match made {
            Ok((round_start, bytes)) => {
                self.written.fetch_add(bytes, Ordering::Relaxed);
                let end = writer.position();
                {
                    let mut q = self.lock();
                    q.end = end;
                    for item in round.iter() {
                        let g = q.groups.entry(item.group).or_insert_with(|| self.fresh());
                        match item.body {
                            Body::Records(_) | Body::Parts(_) | Body::Import(..) => g.end = end,
                            Body::Cut(after) => {
                                g.end = after;
                                g.cuts.push((after, end));
                            }
                        }
                    }
                }
                for (item, at) in round.drain(..).zip(placed.iter()) {
                    let start = Position {
                        segment: round_start.segment,
                        offset: round_start.offset + at,
                    };
                    // Its own bytes: what its shard counts towards its
                    // next checkpoint.
                    let bytes = item.bytes() as u64;
                    (item.done)(Ok(Durable {
                        start,
                        round: round_start,
                        end,
                        bytes,
                    }));
                    if let Body::Records(mut records)
                    | Body::Parts(mut records)
                    | Body::Import(_, mut records) = item.body
                    {
                        if records.capacity() <= SPARE_BUFFER_BYTES {
                            records.clear();
                            emptied.push(records);
                        }
                    }
                }
                if !emptied.is_empty() {
                    let mut q = self.lock();
                    let room = SPARE_BUFFERS.saturating_sub(q.spare.len());
                    q.spare.extend(emptied.drain(..).take(room));
                }
            }
            Err(e) => {
                writer.fail_stop();
                let failed: Vec<Queued> = {
                    let mut q = self.lock();
                    q.failed = Some(e.clone());
                    q.waiting.drain(..).collect()
                };
                tracing::error!(log = %self.dir.display(), error = %e, "a round of the node log failed; it takes no more");
                for item in round.drain(..).chain(failed) {
                    (item.done)(Err(e.clone()));
                }
            }
        }
        true
    }

    /// Queues a part of `group`; `done` runs after its round, which this
    /// call writes itself if `inline` and nobody is writing one (see
    /// below), else the syncer thread does. Returns an emptied buffer for
    /// the group's next part, if the log has one spare.
    fn queue(&self, group: u32, body: Body, done: Callback, inline: bool) -> Option<Vec<u8>> {
        let (refused, spare) = {
            let mut q = self.lock();
            match &q.failed {
                Some(e) => (Some((e.clone(), done)), None),
                None => {
                    q.waiting.push_back(Queued { group, body, done });
                    (None, q.spare.pop())
                }
            }
        };
        if let Some((e, done)) = refused {
            done(Err(e));
            return None;
        }
        let shared = self;
        if !inline {
            shared.wake.notify_one();
            return spare;
        }
        // Nobody is writing a round: this appender writes it, with
        // whatever else is waiting, on its own thread (no hand-off to the
        // syncer and back, two thread wake-ups, at one writer). Someone is:
        // they ring the syncer for what they leave waiting.
        let rounds = match shared.rounds.try_lock() {
            Ok(r) => Some(r),
            Err(std::sync::TryLockError::Poisoned(p)) => Some(p.into_inner()),
            Err(std::sync::TryLockError::WouldBlock) => None,
        };
        if let Some(mut rounds) = rounds {
            shared.write_round(&mut rounds);
            drop(rounds);
            // Appended during the round: the syncer thread takes it, so
            // that this appender's caller goes on at once. Looked at only
            // once the round is let go, so an appender that found it
            // taken is never left waiting.
            if !shared.lock().waiting.is_empty() {
                shared.wake.notify_one();
            }
        }
        spare
    }

    /// Refuses a read of the whole log from `from` unless it lies between
    /// where the open read it from and `end`.
    fn check_from(&self, from: Position, end: Position) -> Result<(), StoreError> {
        if from < self.opened_from || from > end {
            return Err(StoreError::Invalid(format!(
                "{}: cannot read from {}:{}: the log was read from {}:{} and ends at {}:{}",
                self.dir.display(),
                from.segment,
                from.offset,
                self.opened_from.segment,
                self.opened_from.offset,
                end.segment,
                end.offset
            )));
        }
        Ok(())
    }

    /// A group with no part since the log was opened.
    fn fresh(&self) -> GroupState {
        GroupState {
            end: self.opened_from,
            first: self.opened_from,
            cuts: Vec::new(),
        }
    }
}

/// Stops the syncer (after the rounds already queued) when the last
/// handle is dropped.
struct Keeper {
    shared: Arc<Shared>,
    syncer: Mutex<Option<std::thread::JoinHandle<()>>>,
}

impl Drop for Keeper {
    fn drop(&mut self) {
        self.shared.lock().stop = true;
        self.shared.wake.notify_all();
        let handle = self.syncer.lock().unwrap_or_else(|e| e.into_inner()).take();
        // The last handle may go on the syncer itself (with a callback
        // that held it): it then stops by itself once it sees `stop`.
        if let Some(h) = handle.filter(|h| h.thread().id() != std::thread::current().id()) {
            let _ = h.join();
        }
    }
}

/// The node's log. [`NodeLog::group`] hands out one group's view of it.
#[derive(Clone)]
pub(crate) struct NodeLog {
    keeper: Arc<Keeper>,
}

impl NodeLog {
    /// Opens (or creates) the node log in `dir`: reads every round from
    /// the start (cutting a torn last round, refusing damage, as a shard's
    /// log does), learns each group's end and cuts, and starts the syncer.
    pub(crate) fn open(dir: &Path, segment_bytes: u64) -> Result<NodeLog, StoreError> {
        Self::open_from(dir, START, segment_bytes, 0)
    }

    /// [`NodeLog::open`], reading the rounds from `from` on only (a round
    /// boundary: the oldest of the groups' checkpoints, so that a reopen
    /// reads what some group must replay and no more). What lies before
    /// `from` is not read, so every group's reads start at `from` at the
    /// earliest, and a group with no part after it is placed with
    /// [`NodeLog::group_at`]. The syncer runs `priority` nice steps above
    /// the caller, if the process may (every acknowledged write waits for
    /// it, as for a shard's writer: [`crate::StoreConfig::writer_priority`]).
    pub(crate) fn open_from(
        dir: &Path,
        from: Position,
        segment_bytes: u64,
        priority: i32,
    ) -> Result<NodeLog, StoreError> {
        let fresh = || GroupState {
            end: from,
            first: from,
            cuts: Vec::new(),
        };
        let mut groups: HashMap<u32, GroupState> = HashMap::new();
        let writer = log::open_groups(dir, SEGMENT_BASE, from, segment_bytes, |round| {
            for part in parts(round) {
                let (group, _, body) = part?;
                let g = groups.entry(group).or_insert_with(fresh);
                match body {
                    PartRead::Records(_)
                    | PartRead::Raft(..)
                    | PartRead::Import(..)
                    | PartRead::Kept(_) => g.end = round.end,
                    PartRead::Cut(after) => {
                        g.end = after;
                        g.cuts.push((after, round.end));
                    }
                }
            }
            Ok(())
        })?;
        let shared = Arc::new(Shared {
            dir: dir.to_path_buf(),
            opened_from: from,
            segments: writer.segments().clone(),
            written: AtomicU64::new(0),
            queue: Mutex::new(Queue {
                waiting: VecDeque::new(),
                groups,
                end: writer.position(),
                failed: None,
                stop: false,
                spare: Vec::new(),
            }),
            wake: Condvar::new(),
            rounds: Mutex::new(Rounds {
                writer,
                round: Vec::new(),
                later: VecDeque::new(),
                taken: std::collections::HashSet::new(),
                placed: Vec::new(),
                emptied: Vec::new(),
            }),
        });
        let for_syncer = shared.clone();
        let syncer = std::thread::Builder::new()
            .name("node-log-syncer".into())
            .spawn(move || {
                crate::priority::raise_own_priority(priority);
                sync_rounds(&for_syncer)
            })
            .map_err(|e| StoreError::Io(format!("spawning the node log's syncer: {e}")))?;
        Ok(NodeLog {
            keeper: Arc::new(Keeper {
                shared,
                syncer: Mutex::new(Some(syncer)),
            }),
        })
    }

    /// The end of the last durable round.
    pub(crate) fn end(&self) -> Position {
        self.keeper.shared.lock().end
    }

    /// See [`Log::written`].
    pub(crate) fn written(&self) -> u64 {
        self.keeper.shared.written.load(Ordering::Relaxed)
    }

    /// Why the log takes no more rounds, once a round failed: every group
    /// on it is out of service (the disk is shared, so is its failure).
    pub(crate) fn failure(&self) -> Option<String> {
        self.keeper.shared.lock().failed.as_ref().map(|e| {
            format!("a write or sync of the node log failed ({e}); restart the node to reopen it")
        })
    }

    /// Whether the log holds a part or a cut of `group` after the position
    /// it was opened from, or has been given the group.
    pub(crate) fn knows(&self, group: u32) -> bool {
        self.keeper.shared.lock().groups.contains_key(&group)
    }

    /// Waits until nothing of `group` is queued or being written (for at
    /// most `within`): what a group that stopped handed the log is then
    /// durable, or failed, and a reopen of the group reads all of it.
    /// Nothing may append for the group meanwhile.
    pub(crate) fn settle(&self, group: u32, within: std::time::Duration) -> Result<(), StoreError> {
        let shared = &self.keeper.shared;
        let deadline = std::time::Instant::now() + within;
        loop {
            // Under the queue's lock a part is either waiting or in the
            // round being written, which holds `rounds` until its end is
            // recorded: taking that lock waits the round out.
            let pending = shared.lock().waiting.iter().any(|q| q.group == group);
            drop(shared.rounds.lock().unwrap_or_else(|e| e.into_inner()));
            if !pending {
                return Ok(());
            }
            if std::time::Instant::now() >= deadline {
                return Err(StoreError::Io(format!(
                    "group {group}'s appends to the node log were not written within {} s",
                    within.as_secs()
                )));
            }
            shared.wake.notify_one();
            std::thread::sleep(std::time::Duration::from_millis(1));
        }
    }

    /// The log's folder.
    #[cfg(any(test, feature = "failpoints"))]
    pub(crate) fn dir(&self) -> PathBuf {
        self.keeper.shared.dir.clone()
    }

    /// The segments readers read the log's events through.
    pub(crate) fn segments(&self) -> Arc<Segments> {
        self.keeper.shared.segments.clone()
    }

    /// Calls `visit` on every group's parts from `from` (a round boundary
    /// at or after the position the log was opened from) to the end, in
    /// order, with the group each belongs to, leaving out parts a later
    /// cut voided: one read of the log for every group's replay at open.
    pub(crate) fn read_parts<V>(&self, from: Position, mut visit: V) -> Result<(), StoreError>
    where
        V: FnMut(u32, &GroupRead<'_>) -> Result<(), StoreError>,
    {
        let shared = &self.keeper.shared;
        let (groups, end) = {
            let q = shared.lock();
            (q.groups.clone(), q.end)
        };
        shared.check_from(from, end)?;
        each_part(
            &shared.segments,
            from,
            end,
            |group, round_end| groups.get(&group).is_some_and(|g| g.cut_away(round_end)),
            |group, part| visit(group, part).map(|()| true),
        )
    }

    /// Queues `parts` (whole Raft parts of `group`, [`push_raft_part`])
    /// for a round, which the caller writes itself if no round is being
    /// written (as a shard's appender does: a Raft group's core then waits
    /// out the sync on its runtime's thread, which costs that thread but
    /// saves the hand-off to the syncer and back), else the syncer thread
    /// does. `done` runs once they are durable (or failed), with where they
    /// start; the rounds keep their order, so the parts of an earlier call
    /// are durable first. Returns a spare buffer for the next call's parts,
    /// if the log has one.
    pub(crate) fn append_parts(
        &self,
        group: u32,
        parts: Vec<u8>,
        done: impl FnOnce(Result<Durable, StoreError>) + Send + 'static,
    ) -> Option<Vec<u8>> {
        self.keeper
            .shared
            .queue(group, Body::Parts(parts), Box::new(done), true)
    }

    /// Calls `visit` on every Raft part ([`PartRead::Raft`]) from `from`
    /// (a round boundary at or after the position the log was opened
    /// from) to the end, in order, with its group, kind, body, where the
    /// body lies and where its round starts.
    pub(crate) fn read_raft_parts<V>(&self, from: Position, mut visit: V) -> Result<(), StoreError>
    where
        V: FnMut(u32, u8, &[u8], Position, Position) -> Result<(), StoreError>,
    {
        let shared = &self.keeper.shared;
        let end = shared.lock().end;
        shared.check_from(from, end)?;
        shared.segments.read_groups(from, end, |round| {
            for part in parts(round) {
                let (group, at, body) = part?;
                if let PartRead::Raft(kind, body) = body {
                    let at = Position {
                        segment: round.start.segment,
                        offset: at,
                    };
                    visit(group, kind, body, at, round.start)?;
                }
            }
            Ok(true)
        })
    }

    /// Group `group`'s view of the log, which ended at `end` when it was
    /// last checkpointed (at or after the position the log was opened
    /// from): a group whose parts all lie before that position is known
    /// by it only.
    #[cfg_attr(
        not(test),
        allow(dead_code, reason = "the store's switch to the node log is its user")
    )]
    pub(crate) fn group_at(&self, group: u32, end: Position) -> GroupLog {
        {
            let shared = &self.keeper.shared;
            let mut q = shared.lock();
            let g = q.groups.entry(group).or_insert_with(|| shared.fresh());
            g.end = g.end.max(end);
        }
        self.group(group)
    }

    /// Group `group`'s view of the log.
    pub(crate) fn group(&self, group: u32) -> GroupLog {
        GroupLog {
            keeper: self.keeper.clone(),
            group,
            buf: Vec::new(),
            failed: false,
        }
    }
}

/// One part of a round, as read back.
pub(crate) enum PartRead<'a> {
    Records(&'a [u8]),
    Cut(Position),
    /// A Raft group's part: its kind ([`VOTE`], [`ENTRY`], [`TRUNCATE`])
    /// and body.
    Raft(u8, &'a [u8]),
    /// A snapshot's imported records, and whether they are the first of
    /// an install.
    Import(bool, &'a [u8]),
    /// Runs of a snapshot's events its install found held already.
    Kept(&'a [u8]),
}

/// Appends a Raft part of `kind` for `group` to `buf`, its body written
/// by `body` (which must only append); returns where the body starts in
/// `buf`.
pub(crate) fn push_raft_part(
    buf: &mut Vec<u8>,
    kind: u8,
    group: u32,
    body: impl FnOnce(&mut Vec<u8>),
) -> usize {
    debug_assert!(matches!(kind, VOTE | ENTRY | TRUNCATE));
    let header = buf.len();
    buf.push(kind);
    buf.extend_from_slice(&group.to_be_bytes());
    buf.extend_from_slice(&[0; 4]);
    let at = buf.len();
    body(buf);
    let len = (buf.len() - at) as u32;
    buf[header + 5..header + 9].copy_from_slice(&len.to_be_bytes());
    at
}

/// The parts of a round: each one's group, where its records start in the
/// round's segment (0 for a cut), and what it holds.
pub(crate) fn parts<'a>(
    round: &'a GroupRead<'a>,
) -> impl Iterator<Item = Result<(u32, u64, PartRead<'a>), StoreError>> + 'a {
    let payload = round.payload();
    let base = round.payload_at();
    let mut pos = 0usize;
    std::iter::from_fn(move || {
        if pos >= payload.len() {
            return None;
        }
        let bad = |what: &str| {
            StoreError::Corrupt(format!(
                "node log segment {}, offset {}: {what}",
                round.start.segment,
                base + pos as u64
            ))
        };
        let rest = &payload[pos..];
        let u32_at = |i: usize| {
            rest.get(i..i + 4)
                .map(|b| u32::from_be_bytes([b[0], b[1], b[2], b[3]]))
        };
        let part = match rest[0] {
            kind @ (PART | VOTE | ENTRY | TRUNCATE | IMPORT_FIRST | IMPORT | KEPT) => {
                let (Some(group), Some(len)) = (u32_at(1), u32_at(5)) else {
                    return Some(Err(bad("truncated part header")));
                };
                let Some(body) = rest.get(PART_HEADER..PART_HEADER + len as usize) else {
                    return Some(Err(bad("a part longer than its round")));
                };
                let at = base + (pos + PART_HEADER) as u64;
                pos += PART_HEADER + len as usize;
                let read = match kind {
                    PART => PartRead::Records(body),
                    IMPORT_FIRST | IMPORT => PartRead::Import(kind == IMPORT_FIRST, body),
                    KEPT => PartRead::Kept(body),
                    _ => PartRead::Raft(kind, body),
                };
                (group, at, read)
            }
            CUT => {
                let (Some(group), Some(segment), Some(offset)) = (
                    u32_at(1),
                    u32_at(5),
                    rest.get(9..17).map(|b| {
                        u64::from_be_bytes([b[0], b[1], b[2], b[3], b[4], b[5], b[6], b[7]])
                    }),
                ) else {
                    return Some(Err(bad("truncated cut")));
                };
                pos += CUT_BYTES;
                (group, 0, PartRead::Cut(Position { segment, offset }))
            }
            k => return Some(Err(bad(&format!("unknown part kind {k}")))),
        };
        Some(Ok(part))
    })
}

/// Calls `visit` on the records part of every round from `from` to `end`
/// (round boundaries), in order, with its group, leaving out those `void`
/// says a cut voided (given the group and the end of the part's round),
/// until `visit` says stop (`false`).
fn each_part(
    segments: &Segments,
    from: Position,
    end: Position,
    void: impl Fn(u32, Position) -> bool,
    mut visit: impl FnMut(u32, &GroupRead<'_>) -> Result<bool, StoreError>,
) -> Result<(), StoreError> {
    let mut go_on = true;
    segments.read_groups(from, end, |round| {
        for part in parts(round) {
            let (group, at, body) = part?;
            let PartRead::Records(records) = body else {
                continue;
            };
            if void(group, round.end) {
                continue;
            }
            let start = Position {
                segment: round.start.segment,
                offset: at,
            };
            go_on = visit(group, &GroupRead::new(start, round.end, at, records))?;
            if !go_on {
                break;
            }
        }
        Ok(go_on)
    })
}

/// The syncer thread: writes rounds while anything is waiting that the
/// appenders left to it (what was appended while a round was being
/// written), then waits to be rung.
fn sync_rounds(shared: &Shared) {
    loop {
        {
            let mut q = shared.lock();
            while q.waiting.is_empty() && !q.stop {
                q = shared.wake.wait(q).unwrap_or_else(|e| e.into_inner());
            }
            if q.waiting.is_empty() {
                return;
            }
        }
        let mut rounds = shared.rounds.lock().unwrap_or_else(|e| e.into_inner());
        while shared.write_round(&mut rounds) {}
    }
}

/// Why a group that failed stop refuses what follows.
fn stopped() -> StoreError {
    StoreError::Io("this group's log failed; it takes no more groups".into())
}

/// One group's view of the node log: a [`Log`] of its own parts.
pub(crate) struct GroupLog {
    keeper: Arc<Keeper>,
    group: u32,
    /// The records of the group being built.
    buf: Vec<u8>,
    failed: bool,
}

impl GroupLog {
    fn shared(&self) -> &Shared {
        &self.keeper.shared
    }

    fn state(&self) -> GroupState {
        self.shared()
            .lock()
            .groups
            .get(&self.group)
            .cloned()
            .unwrap_or_else(|| self.shared().fresh())
    }

    fn refused(&self) -> Option<StoreError> {
        if self.failed {
            return Some(stopped());
        }
        self.shared().lock().failed.clone()
    }

    fn queue(&self, body: Body, done: Callback) -> Option<Vec<u8>> {
        self.shared().queue(self.group, body, done, true)
    }

    /// Refuses `at` unless it is the group's first position, its end, or
    /// the end of one of its parts.
    fn check_boundary(&self, at: Position, what: &str) -> Result<(), StoreError> {
        let state = self.state();
        if at < state.first || at > state.end {
            return Err(StoreError::Invalid(format!(
                "{}: group {}: cannot {what} {}:{}: the group holds {}:{} to {}:{}",
                self.shared().dir.display(),
                self.group,
                at.segment,
                at.offset,
                state.first.segment,
                state.first.offset,
                state.end.segment,
                state.end.offset
            )));
        }
        if at == state.first || at == state.end {
            return Ok(());
        }
        let mut boundary = false;
        self.read(state.first, |part| {
            boundary = part.end == at;
            Ok(part.end < at)
        })?;
        if !boundary {
            return Err(StoreError::Invalid(format!(
                "{}: group {}: cannot {what} {}:{}: not the end of one of its parts",
                self.shared().dir.display(),
                self.group,
                at.segment,
                at.offset
            )));
        }
        Ok(())
    }
}

impl GroupLog {
    /// Writes the records built since [`Log::begin`] as a snapshot's
    /// imported events (the install's first part if `first`); `durable`
    /// as for [`Log::append`].
    pub(crate) fn append_import<F>(&mut self, first: bool, durable: F)
    where
        F: FnOnce(Result<Durable, StoreError>) + Send + 'static,
    {
        let kind = if first { IMPORT_FIRST } else { IMPORT };
        self.send(|records| Body::Import(kind, records), Box::new(durable));
    }

    /// Writes `runs` (each [`KEPT_RUN_BYTES`], as the module docs say) as
    /// a part naming events a snapshot's install found held already; the
    /// records built since [`Log::begin`] stay for the next part.
    /// `durable` as for [`Log::append`].
    pub(crate) fn append_kept<F>(&mut self, runs: Vec<u8>, durable: F)
    where
        F: FnOnce(Result<Durable, StoreError>) + Send + 'static,
    {
        if self.failed {
            return durable(Err(stopped()));
        }
        self.queue(Body::Import(KEPT, runs), Box::new(durable));
    }

    /// Queues the records built since [`Log::begin`] as the part `body`
    /// makes of them ([`Log::append`], [`GroupLog::append_import`]).
    fn send(&mut self, body: impl FnOnce(Vec<u8>) -> Body, durable: Callback) {
        if self.failed {
            self.buf.clear();
            return durable(Err(stopped()));
        }
        // A failed log is refused in `queue`, under the lock it takes anyway.
        let records = std::mem::take(&mut self.buf);
        if let Some(spare) = self.queue(body(records), durable) {
            self.buf = spare;
        }
    }
}

impl Log for GroupLog {
    /// Refused once the log failed: a write that was never tried is
    /// known not to have happened, which the writer can say.
    fn begin(&mut self) -> Result<(), StoreError> {
        self.buf.clear();
        match self.refused() {
            Some(e) => Err(e),
            None => Ok(()),
        }
    }

    fn event(&mut self, partition: PartitionId, id: ExecutionId, seq: u64, value: &[u8]) -> Loc {
        log::push_event(&mut self.buf, partition, id, seq, value)
    }

    fn put(&mut self, keyspace: u8, key: &[u8], value: &[u8]) {
        log::push_put(&mut self.buf, keyspace, key, value);
    }

    fn pending_event(&self, loc: Loc) -> Result<&[u8], StoreError> {
        log::event_in(&self.buf, loc)
    }

    fn is_empty(&self) -> bool {
        self.buf.is_empty()
    }

    fn append<F>(&mut self, durable: F)
    where
        F: FnOnce(Result<Durable, StoreError>) + Send + 'static,
    {
        self.send(Body::Records, Box::new(durable));
    }

    fn position(&self) -> Position {
        self.state().end
    }

    fn read_event(&self, loc: Loc, id: ExecutionId, seq: u64) -> Result<Vec<u8>, StoreError> {
        self.shared().segments.read_event(loc, id, seq)
    }

    fn first(&self) -> Position {
        self.state().first
    }

    fn read<V>(&self, from: Position, mut visit: V) -> Result<(), StoreError>
    where
        V: FnMut(&GroupRead<'_>) -> Result<bool, StoreError>,
    {
        let (state, end) = {
            let q = self.shared().lock();
            (
                q.groups
                    .get(&self.group)
                    .cloned()
                    .unwrap_or_else(|| self.shared().fresh()),
                q.end,
            )
        };
        if from < state.first || from > state.end {
            return Err(StoreError::Invalid(format!(
                "{}: group {}: cannot read from {}:{}: the group holds {}:{} to {}:{}",
                self.shared().dir.display(),
                self.group,
                from.segment,
                from.offset,
                state.first.segment,
                state.first.offset,
                state.end.segment,
                state.end.offset
            )));
        }
        each_part(
            &self.shared().segments,
            from,
            end,
            |group, round_end| group != self.group || state.cut_away(round_end),
            |_, part| visit(part),
        )
    }

    fn truncate_after(&mut self, at: Position) -> Result<(), StoreError> {
        if let Some(e) = self.refused() {
            return Err(e);
        }
        self.check_boundary(at, "cut after")?;
        if at == self.state().end {
            return Ok(());
        }
        let (tx, rx) = std::sync::mpsc::channel();
        self.queue(
            Body::Cut(at),
            Box::new(move |made| {
                let _ = tx.send(made);
            }),
        );
        self.buf.clear();
        rx.recv()
            .map_err(|_| StoreError::Io("the node log's syncer stopped".into()))?
            .map(|_| ())
    }

    fn purge_before(&mut self, at: Position) -> Result<(), StoreError> {
        self.check_boundary(at, "purge before")?;
        let shared = self.shared();
        shared
            .lock()
            .groups
            .entry(self.group)
            .or_insert_with(|| shared.fresh())
            .first = at;
        Ok(())
    }

    fn fail_stop(&mut self) {
        self.failed = true;
        self.buf.clear();
    }

    /// The log's end: every part of this group before it is durable, and
    /// the caller has published them (see [`Log::checkpoint_position`]);
    /// a part still waiting for its round ends after it, so a replay from
    /// here finds it.
    fn checkpoint_position(&self) -> Position {
        let q = self.shared().lock();
        let own = q.groups.get(&self.group).map(|g| g.end);
        own.map_or(q.end, |own| own.max(q.end))
    }

    fn written(&self) -> u64 {
        self.shared().written.load(Ordering::Relaxed)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::log::Record;
    use std::sync::mpsc;
    use std::time::Duration;

    fn id(n: i64) -> ExecutionId {
        ExecutionId::new(n).expect("a valid execution id")
    }

    /// Appends one event (`n` of group `g`) and waits until it is durable.
    fn append(log: &mut GroupLog, g: u32, n: u64) -> Durable {
        append_async(log, g, n)
            .recv_timeout(Duration::from_secs(10))
            .expect("called back")
            .expect("durable")
    }

    type Made = mpsc::Receiver<Result<Durable, StoreError>>;

    fn append_async(log: &mut GroupLog, g: u32, n: u64) -> Made {
        log.begin().expect("begun");
        let e = id(i64::from(g) + 1);
        log.event(
            e.partition(),
            e,
            n + 1,
            format!("group {g} event {n}").as_bytes(),
        );
        let (tx, rx) = mpsc::channel();
        log.append(move |made| {
            let _ = tx.send(made);
        });
        rx
    }

    /// The seqs of the events a group reads back, in order.
    fn seqs(log: &GroupLog) -> Vec<u64> {
        let mut out = Vec::new();
        log.read(log.first(), |part| {
            for r in part.records() {
                match r? {
                    Record::Event {
                        id: e, seq, value, ..
                    } => {
                        let g = e.get() - 1;
                        assert_eq!(value, format!("group {g} event {}", seq - 1).as_bytes());
                        out.push(seq);
                    }
                    Record::Put { .. } => {}
                }
            }
            Ok(true)
        })
        .expect("read");
        out
    }

    #[test]
    fn groups_appending_at_once_share_rounds_and_each_reads_only_its_own() {
        let tmp = tempfile::tempdir().expect("a folder");
        let node = NodeLog::open(&tmp.path().join("log"), 4096).expect("opened");
        let threads: Vec<_> = (0..8u32)
            .map(|g| {
                let mut log = node.group(g);
                std::thread::spawn(move || {
                    for n in 0..40 {
                        append(&mut log, g, n);
                    }
                    log
                })
            })
            .collect();
        let logs: Vec<GroupLog> = threads
            .into_iter()
            .map(|t| t.join().expect("appended"))
            .collect();
        for log in &logs {
            assert_eq!(
                seqs(log),
                (1..=40).collect::<Vec<_>>(),
                "group {}",
                log.group
            );
        }
        // Again after a reopen.
        drop(logs);
        drop(node);
        let node = NodeLog::open(&tmp.path().join("log"), 4096).expect("reopened");
        for g in 0..8 {
            assert_eq!(
                seqs(&node.group(g)),
                (1..=40).collect::<Vec<_>>(),
                "group {g}"
            );
        }
    }

    #[test]
    fn a_groups_second_append_goes_in_the_next_round() {
        let tmp = tempfile::tempdir().expect("a folder");
        let node = NodeLog::open(&tmp.path().join("log"), 1 << 20).expect("opened");
        let mut log = node.group(1);
        let first = append_async(&mut log, 1, 0);
        let second = append_async(&mut log, 1, 1);
        let wait = |rx: Made| {
            rx.recv_timeout(Duration::from_secs(10))
                .expect("called back")
                .expect("durable")
        };
        let (first, second) = (wait(first), wait(second));
        assert!(first.end < second.end, "{first:?} then {second:?}");
        assert!(second.start > first.end);
        assert_eq!(seqs(&log), vec![1, 2]);
    }

    #[test]
    fn a_cut_of_one_group_leaves_the_others_alone() {
        let tmp = tempfile::tempdir().expect("a folder");
        let dir = tmp.path().join("log");
        let node = NodeLog::open(&dir, 4096).expect("opened");
        let (mut a, mut b) = (node.group(1), node.group(2));
        let (mut a_ends, mut b_ends) = (Vec::new(), Vec::new());
        for n in 0..20 {
            a_ends.push(append(&mut a, 1, n).end);
            b_ends.push(append(&mut b, 2, n).end);
        }
        a.truncate_after(a_ends[4]).expect("cut");
        assert_eq!(seqs(&a), (1..=5).collect::<Vec<_>>());
        assert_eq!(seqs(&b), (1..=20).collect::<Vec<_>>());
        assert_eq!(a.position(), a_ends[4]);
        // The group goes on after its cut: a new event 6, and later ones.
        for n in 5..8 {
            append(&mut a, 1, n);
        }
        append(&mut b, 2, 20);
        assert_eq!(seqs(&a), (1..=8).collect::<Vec<_>>());
        drop((a, b, node));
        let node = NodeLog::open(&dir, 4096).expect("reopened");
        assert_eq!(seqs(&node.group(1)), (1..=8).collect::<Vec<_>>());
        assert_eq!(seqs(&node.group(2)), (1..=21).collect::<Vec<_>>());
        // A cut refuses what is not one of the group's boundaries: the
        // end of one of the other group's parts, and the end of one of its
        // own parts that were cut away.
        let mut a = node.group(1);
        for at in [b_ends[10], a_ends[10]] {
            assert!(at < a.position(), "{at:?} lies within the group's range");
            assert!(
                matches!(a.truncate_after(at), Err(StoreError::Invalid(_))),
                "{at:?}"
            );
        }
        assert_eq!(seqs(&a), (1..=8).collect::<Vec<_>>());
    }

    /// A real ENOSPC (a tmpfs filled up; needs root, as CI runs): the round
    /// that fails is answered with the error, every later append of any
    /// group is refused, even once space is back, and a reopen holds
    /// exactly what was acknowledged.
    #[test]
    fn a_failed_round_fails_every_later_append_of_every_group() {
        let fs = forkless_it::Tmpfs::new(8 << 20);
        let dir = fs.mount.join("log");
        let node = NodeLog::open(&dir, 1 << 20).expect("opened");
        let (mut a, mut b) = (node.group(1), node.group(2));
        append(&mut a, 1, 0);
        append(&mut b, 2, 0);
        let filler = forkless_it::fill(&fs.mount);
        // The segment's last page still has room for a few appends.
        let mut acked = 1;
        let failed = loop {
            assert!(acked < 1_000, "a full disk never failed an append");
            match append_async(&mut a, 1, acked)
                .recv_timeout(Duration::from_secs(10))
                .expect("called back")
            {
                Ok(_) => acked += 1,
                Err(e) => break e,
            }
        };
        assert!(matches!(failed, StoreError::Io(_)), "{failed:?}");
        // Refused before anything is built: a write never tried is known
        // not to have happened.
        let refused = |log: &mut GroupLog| log.begin().is_err();
        assert!(refused(&mut b), "another group's append after the failure");
        std::fs::remove_file(filler).expect("space freed");
        assert!(refused(&mut a), "an append once space is back");
        assert!(a.truncate_after(Position::default()).is_err());
        drop((a, b, node));
        let node = NodeLog::open(&dir, 1 << 20).expect("reopened");
        assert_eq!(seqs(&node.group(1)), (1..=acked).collect::<Vec<_>>());
        assert_eq!(seqs(&node.group(2)), vec![1]);
    }

    #[test]
    fn a_round_holds_no_more_than_its_budget() {
        let tmp = tempfile::tempdir().expect("a folder");
        let node = NodeLog::open(&tmp.path().join("log"), 64 << 20).expect("opened");
        let big = vec![9u8; 6 << 20];
        // The syncer busy with a first round (6 MiB to write and sync)
        // while four more groups' parts queue up behind it.
        let mut busy = node.group(9);
        busy.begin().expect("begun");
        busy.event(id(10).partition(), id(10), 1, &big);
        let (tx, first) = mpsc::channel();
        busy.append(move |made| {
            let _ = tx.send(made);
        });
        let mut logs: Vec<GroupLog> = (0..4).map(|g| node.group(g)).collect();
        let made: Vec<Made> = logs
            .iter_mut()
            .enumerate()
            .map(|(g, log)| {
                log.begin().expect("begun");
                let e = id(g as i64 + 1);
                log.event(e.partition(), e, 1, &big);
                let (tx, rx) = mpsc::channel();
                log.append(move |made| {
                    let _ = tx.send(made);
                });
                rx
            })
            .collect();
        first
            .recv_timeout(Duration::from_secs(30))
            .expect("called back")
            .expect("durable");
        let mut rounds: std::collections::BTreeMap<Position, (usize, u64)> = Default::default();
        for rx in made {
            let d = rx
                .recv_timeout(Duration::from_secs(30))
                .expect("called back")
                .expect("durable");
            let r = rounds.entry(d.end).or_default();
            r.0 += 1;
            r.1 += d.bytes;
        }
        for (end, (parts, bytes)) in rounds {
            assert!(
                parts == 1 || bytes <= ROUND_BYTES_MAX as u64,
                "the round ending at {end:?}: {parts} parts, {bytes} bytes"
            );
        }
    }

    /// A crash that tears the last round takes every part in it, of every
    /// group (none was acknowledged: the callbacks run after the sync),
    /// and nothing before it; damage to an earlier round is refused.
    #[test]
    fn a_torn_last_round_goes_whole_and_earlier_damage_is_refused() {
        let tmp = tempfile::tempdir().expect("a folder");
        let dir = tmp.path().join("log");
        let node = NodeLog::open(&dir, 1 << 20).expect("opened");
        let (mut a, mut b) = (node.group(1), node.group(2));
        let mut ends = Vec::new();
        for n in 0..4 {
            ends.push(append(&mut a, 1, n).end);
            ends.push(append(&mut b, 2, n).end);
        }
        drop((a, b, node));
        let seg = log::segment_path(&dir, SEGMENT_BASE);
        let whole = std::fs::read(&seg).expect("the segment");
        let last_start = ends[ends.len() - 2].offset as usize;
        // Torn: the last round's header and half its payload reached the
        // disk, the rest is zeros.
        let mut torn = whole.clone();
        let cut =
            last_start + (whole.len().min(ends[ends.len() - 1].offset as usize) - last_start) / 2;
        torn[cut..].iter_mut().for_each(|b| *b = 0);
        std::fs::write(&seg, &torn).expect("torn");
        let node = NodeLog::open(&dir, 1 << 20).expect("a torn tail opens");
        assert_eq!(seqs(&node.group(1)), vec![1, 2, 3, 4]);
        assert_eq!(
            seqs(&node.group(2)),
            vec![1, 2, 3],
            "the torn round's part is gone"
        );
        drop(node);
        // A flipped byte in the first round, with rounds after it: damage.
        let mut damaged = whole;
        damaged[log_header_payload_byte()] ^= 0x40;
        std::fs::write(&seg, &damaged).expect("damaged");
        match NodeLog::open(&dir, 1 << 20) {
            Err(StoreError::Corrupt(why)) => assert!(why.contains("offset 0"), "{why}"),
            Err(e) => panic!("refused, but not as damage: {e}"),
            Ok(_) => panic!("a damaged round before others opened"),
        }
    }

    /// A byte inside the first round's payload (past its 8-byte header and
    /// the first part's 9-byte header).
    fn log_header_payload_byte() -> usize {
        8 + PART_HEADER + 3
    }

    /// The last handle to the log may be let go by a callback, on the
    /// syncer's own thread: the syncer must not try to join itself.
    #[test]
    fn the_last_handle_may_go_in_a_callback() {
        let tmp = tempfile::tempdir().expect("a folder");
        let node = NodeLog::open(&tmp.path().join("log"), 1 << 20).expect("opened");
        let shared = node.keeper.shared.clone();
        let keep = node.group(2);
        let mut a = node.group(1);
        drop(node);
        a.begin().expect("begun");
        a.put(1, b"k", b"v");
        let (tx, rx) = mpsc::channel();
        // A round being written elsewhere: the append is left to the
        // syncer thread, whose callback then lets go of the last handle
        // (`a` is gone by then).
        let held = shared.rounds.lock().expect("the writing end");
        a.append(move |made| {
            drop(keep);
            let _ = tx.send(made.is_ok());
        });
        drop(a);
        drop(held);
        shared.wake.notify_one();
        assert_eq!(rx.recv_timeout(Duration::from_secs(10)), Ok(true));
    }

    /// An append that finds no round being written writes its own, on
    /// the appender's thread: its callback has run when `append` returns.
    /// One that finds a round being written is left to the syncer thread.
    #[test]
    fn a_lone_append_writes_its_own_round() {
        let tmp = tempfile::tempdir().expect("a folder");
        let node = NodeLog::open(&tmp.path().join("log"), 1 << 20).expect("opened");
        let mut a = node.group(1);
        let made = append_async(&mut a, 1, 0);
        assert!(
            matches!(made.try_recv(), Ok(Ok(_))),
            "durable when append returned"
        );
        let held = node.keeper.shared.rounds.lock().expect("the writing end");
        let made = append_async(&mut a, 1, 1);
        assert!(
            made.try_recv().is_err(),
            "waiting for the round in progress"
        );
        drop(held);
        // What the holder leaves waiting goes to the syncer thread.
        node.keeper.shared.wake.notify_one();
        let done = made
            .recv_timeout(Duration::from_secs(10))
            .expect("called back");
        assert!(done.is_ok());
    }

    /// A reopen from the oldest checkpoint reads only the rounds after
    /// it: each group replays from its own checkpoint, a cut after that
    /// position still applies, reads before it are refused, and a group
    /// with no part after it is placed by its checkpoint.
    #[test]
    fn a_reopen_from_the_oldest_checkpoint_reads_only_after_it() {
        let tmp = tempfile::tempdir().expect("a folder");
        let dir = tmp.path().join("log");
        let node = NodeLog::open(&dir, 4096).expect("opened");
        let (mut a, mut b, mut c) = (node.group(1), node.group(2), node.group(3));
        // Group 3 writes first and then no more: its checkpoint is its end.
        let c_end = append(&mut c, 3, 0).end;
        let (mut a_ends, mut b_ends) = (Vec::new(), Vec::new());
        for n in 0..10 {
            a_ends.push(append(&mut a, 1, n).end);
            b_ends.push(append(&mut b, 2, n).end);
        }
        // Checkpoints: a at its 4th part, b at its 7th; a cuts after its
        // 8th part (after both checkpoints).
        let (a_checkpoint, b_checkpoint) = (a_ends[3], b_ends[6]);
        a.truncate_after(a_ends[7]).expect("cut");
        drop((a, b, c, node));
        let from = a_checkpoint.min(b_checkpoint).min(c_end);
        assert_eq!(from, c_end);
        let node =
            NodeLog::open_from(&dir, from, 4096, 0).expect("reopened from the oldest checkpoint");
        let a = node.group_at(1, a_checkpoint);
        let b = node.group_at(2, b_checkpoint);
        let c = node.group_at(3, c_end);
        let seqs_from = |log: &GroupLog, at: Position| {
            let mut out = Vec::new();
            log.read(at, |part| {
                for r in part.records() {
                    if let Record::Event { seq, .. } = r? {
                        out.push(seq);
                    }
                }
                Ok(true)
            })
            .map(|()| out)
        };
        assert_eq!(seqs_from(&a, a_checkpoint).expect("read"), vec![5, 6, 7, 8]);
        assert_eq!(seqs_from(&b, b_checkpoint).expect("read"), vec![8, 9, 10]);
        assert!(
            seqs_from(&a, Position::default()).is_err(),
            "before the open's start"
        );
        assert_eq!(a.position(), a_ends[7]);
        assert_eq!(b.position(), b_ends[9]);
        // Group 3 has no part after the start; its checkpoint places it,
        // and it takes appends after it.
        assert_eq!(c.position(), c_end);
        assert_eq!(seqs_from(&c, c_end).expect("read"), Vec::<u64>::new());
        let mut c = c;
        let d = append(&mut c, 3, 1);
        assert!(d.end > b_ends[9]);
    }
}
