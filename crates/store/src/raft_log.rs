//! A shard's Raft log on the node log: openraft's [`RaftLogStorage`] for
//! one group, its entries, votes and truncations written as parts of the
//! node-wide log (`node_log.rs`), so one `fdatasync` a round makes every
//! group's appends durable (`docs/replication.md`, step 5).
//!
//! Part bodies (the node log frames them: `kind | group u32 | len u32 |
//! body`):
//!
//! ```text
//! entry    (6) = crc32 u32 | term u64 | index u64 | payload      (crc32 of what follows it)
//! payload      = 0                                              (blank)
//!              | 1 | bytes                                      (a proposal: a shard's group of records)
//!              | 2 | membership as JSON
//! vote     (5) = term u64 | node u64 | committed u8
//! truncate (7) = 0 | 1 | index u64                              (none, or the last index kept)
//! ```
//!
//! An entry carries a checksum of its own because it is read back alone,
//! by its place, long after its round's checksum was checked.
//!
//! What the group knows is kept in memory (`Tail`): every entry after the
//! purge mark, by index, with where its body lies once durable, and the
//! entry itself until it is durable (openraft reads an entry as soon as
//! `append` returns) and, within a small budget, after. A read of a range
//! is then `pread`s at known places, never a scan of other groups' rounds.
//! The entries out of memory, most of a long log, are held compactly
//! (`Cold`: a place of 32 bytes each, and the term once per run of one
//! term), so a log can keep many of them for a follower that was away.
//!
//! - **`append`** encodes the entries into parts, makes them readable, and
//!   queues them for the syncer thread; the flush callback runs after the
//!   round that makes the last of them durable. Rounds are written one at
//!   a time and in order, so the callback marks a durable prefix, which is
//!   what openraft's flushed watermark means.
//! - **An entry at index `i` voids the group's entries at `i` and after**
//!   that were written before it, at run time and when the log is read
//!   back, and a **truncate** part voids those after its index: the
//!   group's log is the last word written about each index.
//! - **`save_vote`** and **`truncate_after`** return after the round that
//!   makes their part durable.
//! - **`purge`** moves a mark in memory only: the entries stay in the log
//!   (they are the shard's events, read through its events index). At
//!   open the mark is what the caller says, the last log id its state
//!   machine had applied at its checkpoint (`RaftStart`).

use crate::log::Segments;
use crate::node_log::{self, NodeLog, ENTRY, TRUNCATE, VOTE};
use crate::StoreError;
use openraft::storage::{IOFlushed, LogState, RaftLogReader, RaftLogStorage};
use openraft::type_config::alias::{EntryOf, LogIdOf, VoteOf};
use openraft::vote::RaftLeaderId;
use openraft::{EntryPayload, OptionalSend};
use std::collections::{BTreeMap, VecDeque};
use std::fmt::Debug;
use std::io;
use std::ops::RangeBounds;
use std::sync::{Arc, Mutex, MutexGuard};

/// The types of a shard's Raft group: one leader per term
/// (`leader_id_std`), so a term names its leader and an entry's log id is
/// (term, index); a write is answered into a [`crate::write_slot::WriteSlot`]
/// (written out rather than with `declare_raft_types!`, which cannot name
/// a responder of our own).
#[derive(Debug, Clone, Copy, Default, Eq, PartialEq, Ord, PartialOrd)]
pub struct GroupConfig {}

impl openraft::RaftTypeConfig for GroupConfig {
    type D = Proposal;
    type R = crate::apply::Applied;
    type NodeId = u64;
    type Node = openraft::BasicNode;
    type Term = u64;
    type LeaderId = openraft::impls::leader_id_std::LeaderId<u64, u64>;
    type Vote = openraft::impls::Vote<Self::LeaderId>;
    type Payload = EntryPayload<Self::D, Self::NodeId, Self::Node>;
    type Entry = openraft::Entry<<Self::LeaderId as RaftLeaderId>::Committed, Self::Payload>;
    type Responder<T>
        = crate::write_slot::WriteSlot<T>
    where
        T: OptionalSend + 'static;
    type Batch<T>
        = openraft::impls::InlineBatch<T>
    where
        T: OptionalSend + 'static;
    type AsyncRuntime = openraft::impls::TokioRuntime;
    type ErrorSource = openraft::impls::BoxedErrorSource;
}

/// What a shard proposes: the bytes of one group of its records (events,
/// puts and the preconditions every replica checks, `machine.rs`), kept
/// in the entry as they were proposed, so the events index can point into
/// the entry (the Raft log is the event log).
#[derive(Clone, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct Proposal(pub bytes::Bytes);

impl Debug for Proposal {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "Proposal({} bytes)", self.0.len())
    }
}

/// How openraft names an entry's payload in its logs.
impl std::fmt::Display for Proposal {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{} bytes", self.0.len())
    }
}

type StdLeaderId = openraft::impls::leader_id_std::LeaderId<u64, u64>;
type Entry = EntryOf<GroupConfig>;
type LogId = LogIdOf<GroupConfig>;
type Vote = VoteOf<GroupConfig>;

const BLANK: u8 = 0;
const NORMAL: u8 = 1;
const MEMBERSHIP: u8 = 2;
/// crc, term, index.
const ENTRY_HEADER: usize = 4 + 8 + 8;
/// Entries kept in memory after they are durable, per group, in bytes of
/// their bodies: the ones just appended, which apply (and, with
/// followers, replication) read next. A replicated group's is its share of
/// its node's (`RaftLogLimits::cache_bytes`, set at its start).
const CACHE_BYTES: usize = 1 << 20;
/// An append's entries are queued in pieces of about this many bytes
/// (each its own round), so that no round grows past its frame's bound
/// whatever a catch-up hands over at once.
const PIECE_BYTES: usize = crate::GROUP_COMMIT_BYTES_MAX;

/// Where a group's log starts at open: what its state machine's
/// checkpoint says.
#[derive(Debug, Clone, Copy, Default)]
pub(crate) struct RaftStart {
    /// The round boundary to read the node log from (at or before the
    /// first entry the state machine had not applied).
    pub from: crate::log::Position,
    /// The last log id applied at the checkpoint: the purge mark.
    pub purged: Option<LogId>,
    /// The vote as of the checkpoint (a stable leader's last vote part can
    /// lie before `from`).
    pub vote: Option<Vote>,
}

/// Where an entry's body lies in the node log.
#[derive(Debug, Clone, Copy)]
struct At {
    segment: u32,
    offset: u64,
    len: u32,
    /// Where the round that holds it starts (a read of the node log may
    /// start there).
    round: crate::log::Position,
}

struct Slot {
    log_id: LogId,
    /// Set once the entry is durable.
    at: Option<At>,
    /// The entry itself: always until it is durable, then while the cache
    /// has room.
    entry: Option<Entry>,
    /// Which append wrote it: a late flush places only its own entries,
    /// not those a truncation and a later append put at the same index.
    append: u64,
    bytes: usize,
}

/// The oldest entries of a group's log, each durable and out of memory:
/// its place, by index from `first`, and the terms by runs. An entry here
/// costs its [`At`], 32 bytes; a [`Slot`] is 136, 144 with its key in the
/// map, before the map's own nodes. A log keeps up to
/// `RaftLogLimits::kept` entries past its last snapshot, nearly all here.
#[derive(Default)]
struct Cold {
    /// The index of `places[0]`.
    first: u64,
    places: VecDeque<At>,
    /// (first index, term) of each run of entries of one term, in order;
    /// the first run's index is `first` or before.
    terms: VecDeque<(u64, u64)>,
}

impl Cold {
    /// One past its last index (`first` when empty).
    fn end(&self) -> u64 {
        self.first + self.places.len() as u64
    }

    fn is_empty(&self) -> bool {
        self.places.is_empty()
    }

    /// Takes in the entry right after its last (or its first).
    fn push(&mut self, log_id: LogId, at: At) {
        if self.places.is_empty() {
            self.first = log_id.index;
            self.terms.clear();
        }
        debug_assert_eq!(log_id.index, self.end());
        let term = log_id.leader_id.term;
        if self.terms.back().is_none_or(|(_, t)| *t != term) {
            self.terms.push_back((log_id.index, term));
        }
        self.places.push_back(at);
    }

    fn get(&self, index: u64) -> Option<(LogId, At)> {
        let at = *self
            .places
            .get(usize::try_from(index.checked_sub(self.first)?).ok()?)?;
        Some((self.log_id(index), at))
    }

    /// The log id of `index`, which it holds.
    fn log_id(&self, index: u64) -> LogId {
        let run = self.terms.partition_point(|(from, _)| *from <= index);
        let term = self.terms.get(run.saturating_sub(1)).map_or(0, |(_, t)| *t);
        LogId::new(
            openraft::vote::leader_id_std::CommittedLeaderId::new(term),
            index,
        )
    }

    fn last(&self) -> Option<LogId> {
        (!self.is_empty()).then(|| self.log_id(self.end() - 1))
    }

    /// Drops every entry at `index` and after.
    fn cut_from(&mut self, index: u64) {
        if index <= self.first {
            self.places.clear();
            self.terms.clear();
        } else if index < self.end() {
            self.places.truncate((index - self.first) as usize);
            while self.terms.back().is_some_and(|(from, _)| *from >= index) {
                self.terms.pop_back();
            }
        }
    }

    /// Drops every entry at `index` and before.
    fn purge_through(&mut self, index: u64) {
        if index < self.first {
            return;
        }
        if index + 1 >= self.end() {
            self.places.clear();
            self.terms.clear();
        } else {
            self.places.drain(..(index + 1 - self.first) as usize);
            self.first = index + 1;
            while self
                .terms
                .get(1)
                .is_some_and(|(from, _)| *from <= self.first)
            {
                self.terms.pop_front();
            }
        }
        // A burst's capacity is given back once the log is much shorter.
        let keep = self.places.len().max(4096);
        if self.places.capacity() > 4 * keep {
            self.places.shrink_to(2 * keep);
        }
    }

    /// The bytes it holds in memory.
    fn memory(&self) -> usize {
        self.places.capacity() * std::mem::size_of::<At>()
            + self.terms.capacity() * std::mem::size_of::<(u64, u64)>()
    }

    /// (log id, place) of each entry it holds from `from` to `to`
    /// (exclusive).
    fn range(&self, from: u64, to: u64) -> impl Iterator<Item = (LogId, At)> + '_ {
        let lo = from.max(self.first);
        let hi = to.min(self.end());
        (lo..hi.max(lo)).filter_map(|i| self.get(i))
    }
}

#[derive(Default)]
struct Tail {
    purged: Option<LogId>,
    /// The oldest entries, durable and out of memory; `entries` follow it.
    cold: Cold,
    entries: BTreeMap<u64, Slot>,
    vote: Option<Vote>,
    /// Body bytes of the durable entries held in memory.
    cached: usize,
    /// No entry below this index is held in memory once durable (where
    /// the next eviction looks first).
    evict_from: u64,
    /// How many body bytes of durable entries may stay in memory
    /// ([`CACHE_BYTES`]; a test sets 0, so that every durable entry goes
    /// to the compact part at once).
    cache_bytes: usize,
    appends: u64,
}

impl Tail {
    /// Drops every entry at `index` and after.
    fn cut_from(&mut self, index: u64) {
        self.evict_from = self.evict_from.min(index);
        self.cold.cut_from(index);
        for (_, slot) in self.entries.split_off(&index) {
            if slot.at.is_some() && slot.entry.is_some() {
                self.cached -= slot.bytes;
            }
        }
    }

    fn last_log_id(&self) -> Option<LogId> {
        self.entries
            .last_key_value()
            .map(|(_, s)| s.log_id)
            .or_else(|| self.cold.last())
            .or(self.purged)
    }

    /// Where entry `index`'s body lies, once durable.
    fn place(&self, index: u64) -> Option<At> {
        match self.cold.get(index) {
            Some((_, at)) => Some(at),
            None => self.entries.get(&index)?.at,
        }
    }

    /// Takes in a durable entry read back from the node log (at open):
    /// into the compact part while it follows it, as it does in a log
    /// read in order. Says whether it did (else the log has a gap there,
    /// which no write makes: the entry goes into the map, and so does
    /// every entry after it, at a map slot's cost).
    fn push_durable(&mut self, log_id: LogId, at: At) -> bool {
        self.cut_from(log_id.index);
        if self.entries.is_empty() && (self.cold.is_empty() || log_id.index == self.cold.end()) {
            self.cold.push(log_id, at);
            return true;
        }
        let gap = self.entries.is_empty();
        self.entries.insert(
            log_id.index,
            Slot {
                log_id,
                at: Some(at),
                entry: None,
                append: 0,
                bytes: at.len as usize,
            },
        );
        !gap
    }

    /// Moves the oldest entries that are durable and out of memory from
    /// the map to the compact part.
    fn settle(&mut self) {
        while let Some(entry) = self.entries.first_entry() {
            let slot = entry.get();
            let follows = self.cold.is_empty() || *entry.key() == self.cold.end();
            let (Some(at), None, true) = (slot.at, &slot.entry, follows) else {
                return;
            };
            let log_id = slot.log_id;
            entry.remove();
            self.cold.push(log_id, at);
        }
    }

    /// Lets go of the oldest durable entries held in memory until the
    /// cache is within its budget.
    fn evict(&mut self) {
        if self.cached <= self.cache_bytes {
            return;
        }
        for (index, slot) in self.entries.range_mut(self.evict_from..) {
            if slot.at.is_none() {
                // Not durable yet, nor is anything after it.
                break;
            }
            self.evict_from = index + 1;
            if slot.entry.take().is_some() {
                self.cached -= slot.bytes;
                if self.cached <= self.cache_bytes {
                    break;
                }
            }
        }
        self.settle();
    }
}

/// A piece of an append: its parts, and (index, where the body starts in
/// the piece, body length) of each of its entries.
type Piece = (Vec<u8>, Vec<(u64, usize, usize)>);

/// A group's log as it is read back from the node log: what it holds
/// after `start.purged`, and its vote.
pub(crate) struct RaftReplay {
    group: u32,
    from: crate::log::Position,
    tail: Tail,
    /// The first part of the group that could not be read: the group's
    /// open fails, not the read every group shares.
    failed: Option<StoreError>,
}

impl RaftReplay {
    pub(crate) fn new(group: u32, start: RaftStart) -> RaftReplay {
        RaftReplay {
            group,
            from: start.from,
            tail: Tail {
                purged: start.purged,
                vote: start.vote,
                cache_bytes: CACHE_BYTES,
                ..Tail::default()
            },
            failed: None,
        }
    }

    /// Takes in one Raft part of group `g` (kind, body, where the body
    /// lies, where its round starts), in the node log's order; a part of
    /// another group, or in a round before this group's `from`, is not
    /// this replay's.
    pub(crate) fn part(
        &mut self,
        g: u32,
        kind: u8,
        body: &[u8],
        at: crate::log::Position,
        round: crate::log::Position,
    ) {
        if g != self.group || round < self.from || self.failed.is_some() {
            return;
        }
        let group = self.group;
        let bad = |what: String| {
            StoreError::Corrupt(format!(
                "node log segment {}, offset {}: group {group}: {what}",
                at.segment, at.offset
            ))
        };
        let tail = &mut self.tail;
        let took = match kind {
            ENTRY => entry_log_id(body).map(|log_id| {
                if tail.purged.is_some_and(|p| log_id.index <= p.index) {
                    return;
                }
                let place = At {
                    segment: at.segment,
                    offset: at.offset,
                    len: body.len() as u32,
                    round,
                };
                if !tail.push_durable(log_id, place) {
                    tracing::warn!(
                        group,
                        index = log_id.index,
                        after = tail.cold.end().saturating_sub(1),
                        "a group's log read back has a gap before this entry: its places are held in the map from here"
                    );
                }
            }),
            VOTE => decode_vote(body).map(|v| tail.vote = Some(v)),
            TRUNCATE => decode_truncate(body).map(|after| match after {
                Some(index) => tail.cut_from(index + 1),
                None => tail.cut_from(0),
            }),
            _ => Ok(()),
        };
        if let Err(what) = took {
            self.failed = Some(bad(what));
        }
    }
}

/// One Raft group's log storage on the node log.
pub struct RaftLog {
    node: NodeLog,
    group: u32,
    tail: Arc<Mutex<Tail>>,
    /// Rung whenever entries become durable (their places known).
    durable: Arc<tokio::sync::Notify>,
    /// A buffer for the next parts, handed back by the node log.
    spare: Vec<u8>,
}

/// A reader of one group's log (openraft's replication tasks and state
/// machine hold one each).
#[derive(Clone)]
pub struct RaftLogRead {
    segments: Arc<Segments>,
    tail: Arc<Mutex<Tail>>,
    durable: Arc<tokio::sync::Notify>,
}

fn lock(tail: &Mutex<Tail>) -> MutexGuard<'_, Tail> {
    tail.lock().unwrap_or_else(|e| e.into_inner())
}

fn io_error(e: StoreError) -> io::Error {
    io::Error::other(e.to_string())
}

impl RaftLog {
    /// Group `group`'s log, read back from the node log from
    /// `start.from`: its entries after `start.purged` and its last vote
    /// (`start.vote` when no vote part follows `from`).
    pub(crate) fn open(
        node: &NodeLog,
        group: u32,
        start: RaftStart,
    ) -> Result<RaftLog, StoreError> {
        let mut replay = RaftReplay::new(group, start);
        node.read_raft_parts(start.from, |g, kind, body, at, round| {
            replay.part(g, kind, body, at, round);
            Ok(())
        })?;
        RaftLog::replayed(node, replay)
    }

    /// The group's log from its replay (fed by one read of the node log
    /// for every group, at the store's open).
    pub(crate) fn replayed(node: &NodeLog, replay: RaftReplay) -> Result<RaftLog, StoreError> {
        let RaftReplay {
            group,
            tail,
            failed,
            ..
        } = replay;
        if let Some(e) = failed {
            return Err(e);
        }
        Ok(RaftLog {
            node: node.clone(),
            group,
            tail: Arc::new(Mutex::new(tail)),
            durable: Arc::default(),
            spare: Vec::new(),
        })
    }

    /// A reader of the group's log.
    pub(crate) fn reader(&self) -> RaftLogRead {
        RaftLogRead {
            segments: self.node.segments(),
            tail: self.tail.clone(),
            durable: self.durable.clone(),
        }
    }

    fn buffer(&mut self) -> Vec<u8> {
        let mut buf = std::mem::take(&mut self.spare);
        buf.clear();
        buf
    }

    /// Queues one part (a vote or a truncation) and waits for its round.
    async fn write_durably(&mut self, buf: Vec<u8>) -> Result<(), io::Error> {
        let (tx, rx) = tokio::sync::oneshot::channel();
        if let Some(spare) = self.node.append_parts(self.group, buf, move |made| {
            let _ = tx.send(made);
        }) {
            self.spare = spare;
        }
        match rx.await {
            Ok(made) => made.map(|_| ()).map_err(io_error),
            Err(_) => Err(io::Error::other("the node log's syncer stopped")),
        }
    }
}

impl RaftLogRead {
    /// Where entry `index`'s proposal lies (segment, offset), once the
    /// entry is durable here.
    pub(crate) fn proposal_place(&self, index: u64) -> Option<(u32, u64)> {
        let at = lock(&self.tail).place(index)?;
        Some((at.segment, at.offset + ENTRY_HEADER as u64 + 1))
    }

    /// Where entry `index`'s proposal lies, waiting at most `within` for
    /// the entry to become durable here. A follower may learn that an
    /// entry is committed (durable on a quorum of others) before its own
    /// round holding it has synced; it applies the entry only once it has.
    pub(crate) async fn durable_place(
        &self,
        index: u64,
        within: std::time::Duration,
    ) -> Option<(u32, u64)> {
        let until = tokio::time::Instant::now() + within;
        loop {
            let rung = self.durable.notified();
            tokio::pin!(rung);
            rung.as_mut().enable();
            if let Some(place) = self.proposal_place(index) {
                return Some(place);
            }
            tokio::time::timeout_at(until, rung).await.ok()?;
        }
    }

    /// Where a read of the node log must start to find every entry after
    /// `applied` (every entry, for `None`): the round of the first of
    /// them, if one is durable (else none is, and the log's end will do).
    pub(crate) fn replay_from(&self, applied: Option<u64>) -> Option<crate::log::Position> {
        let t = lock(&self.tail);
        let from = applied.map_or(0, |i| i + 1);
        if let Some((_, at)) = t.cold.range(from, u64::MAX).next() {
            return Some(at.round);
        }
        t.entries
            .range(from..)
            .next()
            .and_then(|(_, slot)| slot.at)
            .map(|at| at.round)
    }

    /// The entries of `range` the group holds (see [`read_entries`]).
    pub(crate) fn entries<RB: RangeBounds<u64>>(
        &self,
        range: RB,
    ) -> Result<Vec<Entry>, StoreError> {
        read_entries(&self.segments, &self.tail, range).map_err(|e| StoreError::Io(e.to_string()))
    }

    /// The group's vote.
    pub(crate) fn vote(&self) -> Option<Vote> {
        lock(&self.tail).vote
    }

    /// Holds the bodies of at most `bytes` of durable entries in memory
    /// from now on (the group's share of its node's cache:
    /// `RaftLogLimits::cache_bytes`), letting go of the oldest now if it
    /// holds more.
    pub(crate) fn limit_cache(&self, bytes: usize) {
        let mut t = lock(&self.tail);
        t.cache_bytes = bytes;
        t.evict();
    }

    /// How many entries the log holds (after its purge mark), and the
    /// bytes of memory that costs: their places (compact, or a map's
    /// slots) and the bodies held in memory.
    pub(crate) fn held(&self) -> (u64, u64) {
        let t = lock(&self.tail);
        let slots = t.entries.len() * (std::mem::size_of::<Slot>() + std::mem::size_of::<u64>());
        let bodies: usize = t
            .entries
            .values()
            .filter(|s| s.entry.is_some())
            .map(|s| s.bytes)
            .sum();
        (
            (t.cold.places.len() + t.entries.len()) as u64,
            (t.cold.memory() + slots + bodies) as u64,
        )
    }
}

impl RaftLogReader<GroupConfig> for RaftLogRead {
    async fn try_get_log_entries<RB>(&mut self, range: RB) -> Result<Vec<Entry>, io::Error>
    where
        RB: RangeBounds<u64> + Clone + Debug + OptionalSend,
    {
        read_entries(&self.segments, &self.tail, range)
    }

    async fn read_vote(&mut self) -> Result<Option<Vote>, io::Error> {
        Ok(lock(&self.tail).vote)
    }
}

impl RaftLogReader<GroupConfig> for RaftLog {
    async fn try_get_log_entries<RB>(&mut self, range: RB) -> Result<Vec<Entry>, io::Error>
    where
        RB: RangeBounds<u64> + Clone + Debug + OptionalSend,
    {
        read_entries(&self.node.segments(), &self.tail, range)
    }

    async fn read_vote(&mut self) -> Result<Option<Vote>, io::Error> {
        Ok(lock(&self.tail).vote)
    }
}

/// The entries of `range` the group holds: those in memory cloned, the
/// others read from their places (checked against their checksum and log
/// id) once the lock is let go.
fn read_entries<RB: RangeBounds<u64>>(
    segments: &Segments,
    tail: &Mutex<Tail>,
    range: RB,
) -> Result<Vec<Entry>, io::Error> {
    enum Got {
        Memory(Entry),
        Disk(LogId, At),
    }
    let got: Vec<Got> = {
        let t = lock(tail);
        let from = match range.start_bound() {
            std::ops::Bound::Included(i) => *i,
            std::ops::Bound::Excluded(i) => i.saturating_add(1),
            std::ops::Bound::Unbounded => 0,
        };
        let to = match range.end_bound() {
            std::ops::Bound::Included(i) => i.saturating_add(1),
            std::ops::Bound::Excluded(i) => *i,
            std::ops::Bound::Unbounded => u64::MAX,
        };
        let cold = t
            .cold
            .range(from, to)
            .map(|(log_id, at)| Ok(Got::Disk(log_id, at)));
        let hot = t
            .entries
            .range(range)
            .map(|(_, slot)| match (&slot.entry, slot.at) {
                (Some(e), _) => Ok(Got::Memory(e.clone())),
                (None, Some(at)) => Ok(Got::Disk(slot.log_id, at)),
                (None, None) => Err(io::Error::other(format!(
                    "entry {} is neither in memory nor placed",
                    slot.log_id.index
                ))),
            });
        cold.chain(hot).collect::<Result<_, _>>()?
    };
    got.into_iter()
        .map(|g| match g {
            Got::Memory(e) => Ok(e),
            Got::Disk(log_id, at) => {
                let body = segments
                    .read_at(at.segment, at.offset, at.len)
                    .map_err(io_error)?;
                let entry = decode_entry(&body).map_err(|what| {
                    io::Error::other(format!(
                        "node log segment {}, offset {}: entry {}: {what}",
                        at.segment, at.offset, log_id.index
                    ))
                })?;
                if entry.log_id != log_id {
                    return Err(io::Error::other(format!(
                        "node log segment {}, offset {}: holds entry {:?}, expected {:?}",
                        at.segment, at.offset, entry.log_id, log_id
                    )));
                }
                Ok(entry)
            }
        })
        .collect()
}

/// The groups (by node log folder and group) whose next append panics, as
/// a bug in openraft's core or in this log would: a test arms one to see
/// the group stop and the store's supervisor restart it.
#[cfg(any(test, feature = "failpoints"))]
pub(crate) static PANIC_AT_NEXT_APPEND: Mutex<Vec<(std::path::PathBuf, u32)>> =
    Mutex::new(Vec::new());

/// The groups (by node log folder and group) whose every append first
/// waits this long, as on a slow disk: a test arms one to see a leader
/// send the group's replica more while an append is unanswered.
#[cfg(any(test, feature = "failpoints"))]
pub(crate) static SLOW_APPENDS: Mutex<Vec<(std::path::PathBuf, u32, std::time::Duration)>> =
    Mutex::new(Vec::new());

#[cfg(any(test, feature = "failpoints"))]
fn slow_append(node: &NodeLog, group: u32) -> Option<std::time::Duration> {
    let dir = node.dir();
    let armed = SLOW_APPENDS.lock().unwrap_or_else(|e| e.into_inner());
    armed
        .iter()
        .find(|(d, g, _)| *d == dir && *g == group)
        .map(|(_, _, delay)| *delay)
}

#[cfg(any(test, feature = "failpoints"))]
fn panic_if_armed(node: &NodeLog, group: u32) {
    let key = (node.dir(), group);
    let mut armed = PANIC_AT_NEXT_APPEND
        .lock()
        .unwrap_or_else(|e| e.into_inner());
    if let Some(i) = armed.iter().position(|k| *k == key) {
        armed.remove(i);
        drop(armed);
        panic!("a panic a test injected into group {group}'s append");
    }
}

impl RaftLogStorage<GroupConfig> for RaftLog {
    type LogReader = RaftLogRead;

    async fn get_log_state(&mut self) -> Result<LogState<GroupConfig>, io::Error> {
        let t = lock(&self.tail);
        Ok(LogState {
            last_purged_log_id: t.purged,
            last_log_id: t.last_log_id(),
        })
    }

    async fn get_log_reader(&mut self) -> Self::LogReader {
        self.reader()
    }

    async fn save_vote(&mut self, vote: &Vote) -> Result<(), io::Error> {
        let mut buf = self.buffer();
        node_log::push_raft_part(&mut buf, VOTE, self.group, |b| encode_vote(b, vote));
        self.write_durably(buf).await?;
        lock(&self.tail).vote = Some(*vote);
        Ok(())
    }

    async fn append<I>(
        &mut self,
        entries: I,
        callback: IOFlushed<GroupConfig>,
    ) -> Result<(), io::Error>
    where
        I: IntoIterator<Item = Entry> + OptionalSend,
        I::IntoIter: OptionalSend,
    {
        #[cfg(any(test, feature = "failpoints"))]
        panic_if_armed(&self.node, self.group);
        #[cfg(any(test, feature = "failpoints"))]
        if let Some(d) = slow_append(&self.node, self.group) {
            tokio::time::sleep(d).await;
        }
        let mut pieces: Vec<Piece> = Vec::new();
        let mut buf = self.buffer();
        let mut placed = Vec::new();
        let mut slots = Vec::new();
        for entry in entries {
            if buf.len() >= PIECE_BYTES && !placed.is_empty() {
                pieces.push((std::mem::take(&mut buf), std::mem::take(&mut placed)));
            }
            let mut len = 0;
            let at = node_log::push_raft_part(&mut buf, ENTRY, self.group, |b| {
                let start = b.len();
                encode_entry(b, &entry);
                len = b.len() - start;
            });
            placed.push((entry.log_id.index, at, len));
            slots.push((entry, len));
        }
        if !placed.is_empty() {
            pieces.push((buf, placed));
        }
        let Some(last) = pieces.len().checked_sub(1) else {
            callback.io_completed(Ok(()));
            return Ok(());
        };
        let append = {
            let mut t = lock(&self.tail);
            t.appends += 1;
            let append = t.appends;
            for (entry, bytes) in slots {
                let index = entry.log_id.index;
                t.cut_from(index);
                t.entries.insert(
                    index,
                    Slot {
                        log_id: entry.log_id,
                        at: None,
                        entry: Some(entry),
                        append,
                        bytes,
                    },
                );
            }
            append
        };
        let mut callback = Some(callback);
        for (i, (parts, placed)) in pieces.into_iter().enumerate() {
            let tail = self.tail.clone();
            let durable_rung = self.durable.clone();
            let flushed = if i == last { callback.take() } else { None };
            let spare = self.node.append_parts(self.group, parts, move |made| {
                let result = match made {
                    Ok(durable) => {
                        let mut t = lock(&tail);
                        for (index, at, len) in placed {
                            let Some(slot) = t.entries.get_mut(&index) else {
                                continue;
                            };
                            if slot.append != append {
                                continue;
                            }
                            slot.at = Some(At {
                                segment: durable.start.segment,
                                offset: durable.start.offset + at as u64,
                                len: len as u32,
                                round: durable.round,
                            });
                            let bytes = slot.bytes;
                            t.cached += bytes;
                        }
                        t.evict();
                        drop(t);
                        durable_rung.notify_waiters();
                        Ok(())
                    }
                    Err(e) => Err(io_error(e)),
                };
                if let Some(cb) = flushed {
                    cb.io_completed(result);
                }
            });
            if let Some(spare) = spare {
                self.spare = spare;
            }
        }
        Ok(())
    }

    async fn truncate_after(&mut self, last_log_id: Option<LogId>) -> Result<(), io::Error> {
        let after = last_log_id.map(|l| l.index);
        lock(&self.tail).cut_from(after.map_or(0, |i| i + 1));
        let mut buf = self.buffer();
        node_log::push_raft_part(&mut buf, TRUNCATE, self.group, |b| match after {
            None => b.push(0),
            Some(index) => {
                b.push(1);
                b.extend_from_slice(&index.to_be_bytes());
            }
        });
        self.write_durably(buf).await
    }

    async fn purge(&mut self, log_id: LogId) -> Result<(), io::Error> {
        let mut t = lock(&self.tail);
        t.cold.purge_through(log_id.index);
        let kept = t.entries.split_off(&(log_id.index + 1));
        for (_, slot) in std::mem::replace(&mut t.entries, kept) {
            if slot.at.is_some() && slot.entry.is_some() {
                t.cached -= slot.bytes;
            }
        }
        if t.purged.is_none_or(|p| p < log_id) {
            t.purged = Some(log_id);
        }
        Ok(())
    }
}

fn encode_entry(buf: &mut Vec<u8>, entry: &Entry) {
    let start = buf.len();
    buf.extend_from_slice(&[0; 4]);
    buf.extend_from_slice(&entry.log_id.leader_id.term.to_be_bytes());
    buf.extend_from_slice(&entry.log_id.index.to_be_bytes());
    match &entry.payload {
        EntryPayload::Blank => buf.push(BLANK),
        EntryPayload::Normal(p) => {
            buf.push(NORMAL);
            buf.extend_from_slice(&p.0);
        }
        EntryPayload::Membership(m) => {
            buf.push(MEMBERSHIP);
            // A membership's JSON cannot fail to encode: it is maps of
            // integers and node addresses.
            if let Err(e) = serde_json::to_writer(&mut *buf, m) {
                tracing::error!(error = %e, "encoding a membership entry");
            }
        }
    }
    let crc = crc32fast::hash(&buf[start + 4..]);
    buf[start..start + 4].copy_from_slice(&crc.to_be_bytes());
}

fn u64_at(body: &[u8], at: usize) -> u64 {
    let mut b = [0u8; 8];
    b.copy_from_slice(&body[at..at + 8]);
    u64::from_be_bytes(b)
}

pub(crate) fn entry_log_id(body: &[u8]) -> Result<LogId, String> {
    if body.len() < ENTRY_HEADER + 1 {
        return Err(format!("an entry of {} bytes is too short", body.len()));
    }
    Ok(LogId::new(
        // Under `leader_id_std` a committed leader id is its term alone.
        openraft::vote::leader_id_std::CommittedLeaderId::new(u64_at(body, 4)),
        u64_at(body, 12),
    ))
}

/// A proposal in an entry's body, and where it starts in the body.
pub(crate) type BodyProposal<'a> = Option<(&'a [u8], u64)>;

/// An entry body's log id and, if it holds a proposal, the proposal and
/// where it starts in the body (checked against the entry's checksum).
pub(crate) fn entry_payload(body: &[u8]) -> Result<(LogId, BodyProposal<'_>), String> {
    let log_id = entry_log_id(body)?;
    let crc = u32::from_be_bytes([body[0], body[1], body[2], body[3]]);
    if crc32fast::hash(&body[4..]) != crc {
        return Err("checksum mismatch".into());
    }
    let at = ENTRY_HEADER + 1;
    Ok(match body[ENTRY_HEADER] {
        NORMAL => (log_id, Some((&body[at..], at as u64))),
        BLANK | MEMBERSHIP => (log_id, None),
        k => return Err(format!("unknown payload kind {k}")),
    })
}

fn decode_entry(body: &[u8]) -> Result<Entry, String> {
    let log_id = entry_log_id(body)?;
    let crc = u32::from_be_bytes([body[0], body[1], body[2], body[3]]);
    if crc32fast::hash(&body[4..]) != crc {
        return Err("checksum mismatch".into());
    }
    let payload = &body[ENTRY_HEADER + 1..];
    let payload = match body[ENTRY_HEADER] {
        BLANK => EntryPayload::Blank,
        NORMAL => EntryPayload::Normal(Proposal(bytes::Bytes::copy_from_slice(payload))),
        MEMBERSHIP => EntryPayload::Membership(
            serde_json::from_slice(payload).map_err(|e| format!("membership: {e}"))?,
        ),
        k => return Err(format!("unknown payload kind {k}")),
    };
    Ok(Entry { log_id, payload })
}

fn encode_vote(buf: &mut Vec<u8>, vote: &Vote) {
    buf.extend_from_slice(&vote.leader_id.term.to_be_bytes());
    buf.extend_from_slice(&vote.leader_id.voted_for.to_be_bytes());
    buf.push(u8::from(vote.committed));
}

fn decode_vote(body: &[u8]) -> Result<Vote, String> {
    if body.len() != 17 || body[16] > 1 {
        return Err(format!("not a vote ({} bytes)", body.len()));
    }
    let leader_id = StdLeaderId::new(u64_at(body, 0), u64_at(body, 8));
    Ok(Vote {
        leader_id,
        committed: body[16] == 1,
    })
}

pub(crate) fn decode_truncate(body: &[u8]) -> Result<Option<u64>, String> {
    match body {
        [0] => Ok(None),
        [1, rest @ ..] if rest.len() == 8 => Ok(Some(u64_at(rest, 0))),
        _ => Err(format!("not a truncation ({} bytes)", body.len())),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::log::Log;
    use futures_util::StreamExt;
    use openraft::storage::{EntryResponder, RaftSnapshotBuilder, RaftStateMachine};
    use openraft::testing::log::{StoreBuilder, Suite};
    use openraft::type_config::alias::{SnapshotMetaOf, SnapshotOf, StoredMembershipOf};
    use openraft::type_config::TypeConfigExt;
    use openraft::{Membership, Snapshot, SnapshotMeta, StorageError, StoredMembership};
    use std::collections::BTreeSet;
    use std::path::Path;

    const SEGMENT: u64 = 1 << 20;

    /// The state machine openraft's suite needs beside the log store it
    /// tests: it keeps what the suite looks at (the last applied log id,
    /// the membership, the current snapshot's meta). The shard's state
    /// machine replaces it once it exists.
    type Current = Arc<Mutex<Option<SnapshotOf<GroupConfig, Vec<u8>>>>>;

    #[derive(Default)]
    struct SuiteMachine {
        applied: Option<LogId>,
        membership: StoredMembershipOf<GroupConfig>,
        current: Current,
    }

    struct SuiteSnapshot {
        meta: SnapshotMetaOf<GroupConfig>,
        current: Current,
    }

    impl RaftSnapshotBuilder<GroupConfig> for SuiteSnapshot {
        type SnapshotData = Vec<u8>;

        async fn build_snapshot(&mut self) -> Result<SnapshotOf<GroupConfig, Vec<u8>>, io::Error> {
            let snapshot = Snapshot {
                meta: self.meta.clone(),
                snapshot: Vec::new(),
            };
            *self.current.lock().expect("not poisoned") = Some(snapshot.clone());
            Ok(snapshot)
        }
    }

    impl RaftStateMachine<GroupConfig> for SuiteMachine {
        type SnapshotData = Vec<u8>;
        type SnapshotBuilder = SuiteSnapshot;

        async fn applied_state(
            &mut self,
        ) -> Result<(Option<LogId>, StoredMembershipOf<GroupConfig>), io::Error> {
            Ok((self.applied, self.membership.clone()))
        }

        async fn apply<S>(&mut self, mut entries: S) -> Result<(), io::Error>
        where
            S: futures_util::Stream<Item = Result<EntryResponder<GroupConfig>, io::Error>>
                + Unpin
                + OptionalSend,
        {
            while let Some(item) = entries.next().await {
                let (entry, responder) = item?;
                self.applied = Some(entry.log_id);
                if let EntryPayload::Membership(m) = &entry.payload {
                    self.membership = StoredMembership::new(Some(entry.log_id), m.clone());
                }
                if let Some(r) = responder {
                    r.send(crate::apply::Applied::Done);
                }
            }
            Ok(())
        }

        async fn get_snapshot_builder(&mut self) -> Self::SnapshotBuilder {
            SuiteSnapshot {
                meta: SnapshotMeta {
                    last_log_id: self.applied,
                    last_membership: self.membership.clone(),
                },
                current: self.current.clone(),
            }
        }

        async fn install_snapshot(
            &mut self,
            meta: &SnapshotMetaOf<GroupConfig>,
            snapshot: Vec<u8>,
        ) -> Result<(), io::Error> {
            self.applied = meta.last_log_id;
            self.membership = meta.last_membership.clone();
            *self.current.lock().expect("not poisoned") = Some(Snapshot {
                meta: meta.clone(),
                snapshot,
            });
            Ok(())
        }

        async fn get_current_snapshot(
            &mut self,
        ) -> Result<Option<SnapshotOf<GroupConfig, Vec<u8>>>, io::Error> {
            Ok(self.current.lock().expect("not poisoned").clone())
        }
    }

    /// Builds each case's log; `Builder(true)` keeps no durable entry in
    /// memory, so every read after a flush goes by the compact part.
    struct Builder(bool);

    impl StoreBuilder<GroupConfig, RaftLog, SuiteMachine, tempfile::TempDir> for Builder {
        async fn build(
            &self,
        ) -> Result<(tempfile::TempDir, RaftLog, SuiteMachine), StorageError<GroupConfig>> {
            let tmp = tempfile::tempdir().expect("a folder");
            let node = NodeLog::open(tmp.path(), SEGMENT).expect("the node log opens");
            // Another group writing records in the same log, so every
            // case runs on a log shared as it is on a node.
            let mut other = node.group(1);
            other.begin().expect("begun");
            other.put(1, b"k", b"v");
            other.append(|_| {});
            let log = RaftLog::open(&node, 7, RaftStart::default_at(node_log::START))
                .expect("the group's log opens");
            if self.0 {
                lock(&log.tail).cache_bytes = 0;
            }
            Ok((tmp, log, SuiteMachine::default()))
        }
    }

    impl RaftStart {
        fn default_at(from: crate::log::Position) -> RaftStart {
            RaftStart {
                from,
                ..RaftStart::default()
            }
        }
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn openraft_s_storage_suite_passes() {
        Suite::test_all(Builder(false))
            .await
            .expect("the suite passes");
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn openraft_s_storage_suite_passes_with_every_durable_entry_out_of_memory() {
        Suite::test_all(Builder(true))
            .await
            .expect("the suite passes");
    }

    /// The compact part's own rules: contiguous places, terms by runs,
    /// cuts and purges at either end and inside a run.
    #[test]
    fn the_compact_part_keeps_places_and_terms_by_runs() {
        let at = |i: u64| At {
            segment: 1,
            offset: i * 100,
            len: 10,
            round: crate::log::Position {
                segment: 1,
                offset: i * 100,
            },
        };
        let mut c = Cold::default();
        assert!(c.is_empty() && c.last().is_none() && c.get(0).is_none());
        // Entries 5 to 14: terms 1 (5-7), 2 (8-11), 4 (12-14).
        for i in 5..15 {
            let term = match i {
                5..=7 => 1,
                8..=11 => 2,
                _ => 4,
            };
            c.push(log_id(term, i), at(i));
        }
        assert_eq!((c.first, c.end(), c.terms.len()), (5, 15, 3));
        assert_eq!(c.last(), Some(log_id(4, 14)));
        for (i, term) in [(5, 1), (7, 1), (8, 2), (11, 2), (12, 4), (14, 4)] {
            let (id, place) = c.get(i).expect("held");
            assert_eq!((id, place.offset), (log_id(term, i), i * 100));
        }
        assert!(c.get(4).is_none() && c.get(15).is_none());
        let ids: Vec<u64> = c.range(0, 9).map(|(id, _)| id.index).collect();
        assert_eq!(ids, vec![5, 6, 7, 8]);
        assert_eq!(c.range(20, 30).count(), 0);
        assert_eq!(c.range(9, 7).count(), 0);
        // A cut inside a run, then the same index in a newer term.
        c.cut_from(10);
        assert_eq!((c.end(), c.last()), (10, Some(log_id(2, 9))));
        c.push(log_id(5, 10), at(10));
        assert_eq!(c.get(10).map(|(id, _)| id), Some(log_id(5, 10)));
        assert_eq!(c.get(9).map(|(id, _)| id), Some(log_id(2, 9)));
        // A cut at a run's first index drops the run.
        c.cut_from(8);
        assert_eq!((c.terms.len(), c.last()), (1, Some(log_id(1, 7))));
        for i in 8..12 {
            c.push(log_id(3, i), at(i));
        }
        // A purge inside the first run, then past it.
        c.purge_through(6);
        assert_eq!(
            (c.first, c.get(7).map(|(id, _)| id)),
            (7, Some(log_id(1, 7)))
        );
        c.purge_through(8);
        assert_eq!((c.first, c.terms.len()), (9, 1));
        assert_eq!(c.get(9).map(|(id, _)| id), Some(log_id(3, 9)));
        assert_eq!(c.get(11).map(|(id, _)| id), Some(log_id(3, 11)));
        c.purge_through(3);
        assert_eq!(c.first, 9, "a purge before it changes nothing");
        c.purge_through(11);
        assert!(c.is_empty());
        // Empty, it starts again wherever it is given.
        c.push(log_id(6, 40), at(40));
        assert_eq!((c.first, c.last()), (40, Some(log_id(6, 40))));
        c.cut_from(0);
        assert!(c.is_empty());
    }

    /// A group's share of its node's cache, set at its start, lets go of
    /// the oldest bodies at once and holds to it after; what left memory
    /// reads back from the node log.
    #[tokio::test(flavor = "current_thread")]
    async fn a_groups_cache_holds_to_the_share_it_is_given() {
        let tmp = tempfile::tempdir().expect("a folder");
        let (_node, mut log) = open(tmp.path(), RaftStart::default_at(node_log::START));
        let body = "z".repeat(1_000);
        let cached = |log: &RaftLog| lock(&log.tail).cached;
        for i in 1..=400u64 {
            append(&mut log, vec![normal(1, i, &format!("{i}:{body}"))]).await;
        }
        assert!(cached(&log) > 256 << 10, "{} cached", cached(&log));
        log.reader().limit_cache(128 << 10);
        assert!(cached(&log) <= 128 << 10, "{} cached", cached(&log));
        for i in 401..=800u64 {
            append(&mut log, vec![normal(1, i, &format!("{i}:{body}"))]).await;
        }
        assert!(cached(&log) <= 128 << 10, "{} cached", cached(&log));
        assert!(
            cached(&log) > 64 << 10,
            "the latest stay: {} cached",
            cached(&log)
        );
        let got = held(&mut log).await;
        assert_eq!(got.len(), 800);
        for (k, (_, index, text)) in got.into_iter().enumerate() {
            assert_eq!(index, k as u64 + 1);
            assert_eq!(text, format!("{index}:{body}"));
        }
    }

    /// A long log of small entries is held compactly past the cache, read
    /// back whole (from memory and from the places), cut and purged across
    /// the boundary, and read back the same way at a reopen.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_long_log_is_held_compactly_and_reads_back_whole() {
        let tmp = tempfile::tempdir().expect("a folder");
        let (node, mut log) = open(tmp.path(), RaftStart::default_at(node_log::START));
        let body = "y".repeat(900);
        let mut batch = Vec::new();
        for i in 1..=5_000u64 {
            // A new term every 1,000 entries.
            batch.push(normal(1 + i / 1_000, i, &format!("{i}:{body}")));
            if batch.len() == 250 {
                append(&mut log, std::mem::take(&mut batch)).await;
            }
        }
        {
            let t = lock(&log.tail);
            assert!(
                t.cold.places.len() >= 3_000 && t.cold.first == 1,
                "{} entries compact, from {}; {} in the map",
                t.cold.places.len(),
                t.cold.first,
                t.entries.len()
            );
            assert_eq!(t.cold.end(), *t.entries.keys().next().expect("a hot part"));
            assert_eq!(t.cold.terms.len(), 6.min(t.cold.places.len() / 1_000 + 1));
        }
        let check = |got: Vec<(u64, u64, String)>, from: u64, to: u64| {
            assert_eq!(got.len() as u64, to - from + 1);
            for (k, (term, index, text)) in got.into_iter().enumerate() {
                let i = from + k as u64;
                assert_eq!((term, index), (1 + i / 1_000, i));
                assert_eq!(text, format!("{i}:{body}"));
            }
        };
        check(held(&mut log).await, 1, 5_000);
        let first_hot = *lock(&log.tail).entries.keys().next().expect("hot");
        // A cut inside the compact part drops the map; entries after it
        // come back at a newer term.
        log.truncate_after(Some(log_id(3, 2_500)))
            .await
            .expect("cut");
        assert!(lock(&log.tail).entries.is_empty());
        assert!(first_hot > 2_500);
        append(&mut log, vec![normal(9, 2_501, "after the cut")]).await;
        let state = log.get_log_state().await.expect("state");
        assert_eq!(state.last_log_id, Some(log_id(9, 2_501)));
        log.purge(log_id(2, 1_200)).await.expect("purged");
        let got = log.try_get_log_entries(1_199..1_203).await.expect("read");
        assert_eq!(
            got.iter().map(|e| e.log_id).collect::<Vec<_>>(),
            vec![log_id(2, 1_201), log_id(2, 1_202)]
        );
        {
            let t = lock(&log.tail);
            assert_eq!(
                t.place(1_201).map(|at| at.offset),
                t.cold.get(1_201).map(|(_, at)| at.offset)
            );
        }
        // Read back from the node log at a reopen: the same entries, in
        // the compact part.
        drop(log);
        drop(node);
        let start = RaftStart {
            from: node_log::START,
            purged: Some(log_id(2, 1_200)),
            vote: None,
        };
        let (_node, mut log) = open(tmp.path(), start);
        {
            let t = lock(&log.tail);
            assert_eq!((t.cold.first, t.cold.end()), (1_201, 2_502));
            assert!(t.entries.is_empty());
        }
        let got = held(&mut log).await;
        assert_eq!(got.last(), Some(&(9, 2_501, "after the cut".to_string())));
        check(got[..got.len() - 1].to_vec(), 1_201, 2_500);
    }

    fn log_id(term: u64, index: u64) -> LogId {
        LogId::new(
            openraft::vote::leader_id_std::CommittedLeaderId::new(term),
            index,
        )
    }

    fn normal(term: u64, index: u64, body: &str) -> Entry {
        Entry {
            log_id: log_id(term, index),
            payload: EntryPayload::Normal(Proposal(bytes::Bytes::copy_from_slice(body.as_bytes()))),
        }
    }

    /// Appends and waits for the flush.
    async fn append(log: &mut RaftLog, entries: Vec<Entry>) {
        let (tx, rx) = GroupConfig::oneshot();
        log.append(entries, IOFlushed::signal(tx))
            .await
            .expect("appended");
        rx.await.expect("called back").expect("flushed");
    }

    fn open(dir: &Path, start: RaftStart) -> (NodeLog, RaftLog) {
        let node = NodeLog::open(dir, SEGMENT).expect("the node log opens");
        let log = RaftLog::open(&node, 7, start).expect("the group's log opens");
        (node, log)
    }

    /// (term, index, payload) of every entry the group holds.
    async fn held(log: &mut RaftLog) -> Vec<(u64, u64, String)> {
        log.try_get_log_entries(..)
            .await
            .expect("read")
            .into_iter()
            .map(|e| {
                let body = match e.payload {
                    EntryPayload::Normal(p) => String::from_utf8_lossy(&p.0).into_owned(),
                    EntryPayload::Blank => "blank".into(),
                    EntryPayload::Membership(_) => "membership".into(),
                };
                (e.log_id.leader_id.term, e.log_id.index, body)
            })
            .collect()
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn entries_votes_and_truncations_come_back_after_a_reopen() {
        let tmp = tempfile::tempdir().expect("a folder");
        let vote = Vote::new(2, 3);
        let before = {
            let (_node, mut log) = open(tmp.path(), RaftStart::default_at(node_log::START));
            append(
                &mut log,
                (1..=5).map(|i| normal(1, i, &format!("e{i}"))).collect(),
            )
            .await;
            log.save_vote(&Vote::new(1, 1)).await.expect("voted");
            log.truncate_after(Some(log_id(1, 3))).await.expect("cut");
            log.save_vote(&vote).await.expect("voted");
            let mut members = BTreeSet::new();
            members.insert(3u64);
            let membership: Membership<u64, openraft::BasicNode> =
                Membership::new_with_defaults(vec![members], []);
            append(
                &mut log,
                vec![Entry {
                    log_id: log_id(2, 4),
                    payload: EntryPayload::Membership(membership),
                }],
            )
            .await;
            // A later entry at an index voids what was written at and
            // after it, with no truncation in between.
            append(&mut log, vec![normal(2, 5, "e5'"), normal(2, 6, "e6'")]).await;
            append(&mut log, vec![normal(2, 5, "e5''")]).await;
            held(&mut log).await
        };
        assert_eq!(
            before,
            vec![
                (1, 1, "e1".into()),
                (1, 2, "e2".into()),
                (1, 3, "e3".into()),
                (2, 4, "membership".into()),
                (2, 5, "e5''".into()),
            ]
        );
        let (_node, mut log) = open(tmp.path(), RaftStart::default_at(node_log::START));
        assert_eq!(
            held(&mut log).await,
            before,
            "the same entries after a reopen"
        );
        assert_eq!(log.read_vote().await.expect("read"), Some(vote));
        let state = log.get_log_state().await.expect("state");
        assert_eq!(state.last_log_id, Some(log_id(2, 5)));
        assert_eq!(state.last_purged_log_id, None);
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_reopen_from_a_checkpoint_holds_what_follows_its_applied_entry() {
        let tmp = tempfile::tempdir().expect("a folder");
        let vote = Vote::new_committed(1, 3);
        let from = {
            let (node, mut log) = open(tmp.path(), RaftStart::default_at(node_log::START));
            log.save_vote(&vote).await.expect("voted");
            append(
                &mut log,
                (1..=3).map(|i| normal(1, i, &format!("e{i}"))).collect(),
            )
            .await;
            // The checkpoint: entries up to 2 applied, 3 appended before it.
            let from = node.end();
            append(&mut log, vec![normal(1, 4, "e4")]).await;
            from
        };
        // Read from a point past entry 3's round, as a checkpoint taken
        // with 3 unapplied must not be: the log then starts at 4, a hole
        // after the purge mark, which openraft would refuse; the caller
        // places `from` at or before the first unapplied entry.
        let start = RaftStart {
            from,
            purged: Some(log_id(1, 2)),
            vote: Some(vote),
        };
        let (_node, mut log) = open(tmp.path(), start);
        assert_eq!(held(&mut log).await, vec![(1, 4, "e4".into())]);
        assert_eq!(
            log.read_vote().await.expect("read"),
            Some(vote),
            "the vote as of the checkpoint, with no vote part after it"
        );
        let start = RaftStart {
            from: node_log::START,
            purged: Some(log_id(1, 2)),
            vote: None,
        };
        let (_node, mut log) = open(tmp.path(), start);
        assert_eq!(
            held(&mut log).await,
            vec![(1, 3, "e3".into()), (1, 4, "e4".into())],
            "nothing at or before the purge mark"
        );
        assert_eq!(log.read_vote().await.expect("read"), Some(vote));
        let state = log.get_log_state().await.expect("state");
        assert_eq!(state.last_purged_log_id, Some(log_id(1, 2)));
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn entries_past_the_cache_are_read_from_the_disk_and_checked() {
        let tmp = tempfile::tempdir().expect("a folder");
        let (_node, mut log) = open(tmp.path(), RaftStart::default_at(node_log::START));
        let big = "x".repeat(64 * 1024);
        for i in 1..=40 {
            append(&mut log, vec![normal(1, i, &format!("{i}:{big}"))]).await;
        }
        let cached = lock(&log.tail).cached;
        assert!(cached <= CACHE_BYTES, "the cache holds {cached} bytes");
        assert!(
            lock(&log.tail)
                .entries
                .get(&1)
                .is_none_or(|s| s.entry.is_none()),
            "the oldest entries were let go"
        );
        let got = held(&mut log).await;
        assert_eq!(got.len(), 40);
        for (i, (_, index, body)) in got.iter().enumerate() {
            assert_eq!(*index, i as u64 + 1);
            assert_eq!(body, &format!("{index}:{big}"));
        }
        // One flipped byte in entry 1's body, on disk: its checksum says so.
        let at = lock(&log.tail).place(1).expect("placed");
        let path = crate::log::segment_path(tmp.path(), at.segment);
        let file = std::fs::OpenOptions::new()
            .write(true)
            .open(&path)
            .expect("the segment");
        use std::os::unix::fs::FileExt;
        file.write_all_at(b"y", at.offset + at.len as u64 - 1)
            .expect("written");
        let err = log
            .try_get_log_entries(1..2)
            .await
            .expect_err("a damaged entry is refused");
        assert!(err.to_string().contains("checksum"), "{err}");
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_flush_after_a_truncation_places_only_its_own_entries() {
        let tmp = tempfile::tempdir().expect("a folder");
        let (_node, mut log) = open(tmp.path(), RaftStart::default_at(node_log::START));
        append(&mut log, vec![normal(1, 1, "a")]).await;
        let (tx, rx) = GroupConfig::oneshot();
        log.append(vec![normal(1, 2, "b")], IOFlushed::signal(tx))
            .await
            .expect("appended");
        // Cut before its flush may have come, then another entry at 2.
        log.truncate_after(Some(log_id(1, 1))).await.expect("cut");
        append(&mut log, vec![normal(2, 2, "c")]).await;
        rx.await.expect("called back").expect("flushed");
        assert_eq!(
            held(&mut log).await,
            vec![(1, 1, "a".into()), (2, 2, "c".into())]
        );
        // Let the cache go, so the read goes by the places recorded.
        {
            let mut t = lock(&log.tail);
            for slot in t.entries.values_mut() {
                slot.entry = None;
            }
            t.cached = 0;
        }
        assert_eq!(
            held(&mut log).await,
            vec![(1, 1, "a".into()), (2, 2, "c".into())]
        );
    }
}
