//! A shard's Raft entries: the proposal a leader's writer builds from a
//! group of commands, and what every replica's apply does with it
//! (`docs/replication.md`, "What an entry holds: the leader evaluates,
//! every replica checks").
//!
//! The leader runs the commands through the state machine
//! ([`crate::machine`]) as the writer always has, and proposes what they
//! wrote, with the facts each command rested on:
//!
//! ```text
//! proposal = 1 (version) | term u64 | item*      (the term it was proposed under)
//! item     = record                               (an event or a put, as in a log group: log.rs)
//!          | 16 | epoch u64                       (the shard's epoch was this)
//!          | 17 | execution u64 | last_seq u64    (the execution was open at this seq)
//!          | 18 | execution u64                   (no execution had this id)
//!          | 19 | len u32 | key                   (no event used this idempotency key)
//!          | 20 | len u32 | key                   (no start used this idempotency key)
//! ```
//!
//! A command's preconditions come before its records. Apply walks the
//! items in order on every replica: each precondition is checked against
//! the replica's state plus what the entry's earlier records wrote
//! ([`Checker`]), and each record is collected. An entry proposed under
//! another term than the one it was committed in, or with a precondition
//! that does not hold, applies nothing: every replica refuses it alike,
//! so an entry of a deposed leader that still commits can neither fork an
//! execution nor apply an idempotency key twice. Otherwise its records
//! are published as the writer publishes a durable group: events into the
//! tail at their place inside the entry (the Raft log is the event log),
//! puts into the keyspaces, then the metadata cache, the epoch, the
//! waiters.

use crate::codec;
use crate::index;
use crate::keyspaces::{keyspace_id, Keyspaces, EPOCH_KEY};
use crate::log::{self, Loc, Record};
use crate::machine::{self, Checker, HashMap, Precondition};
use crate::meta_cache::MetaCache;
use crate::read::SharedTail;
use crate::shard_log::EventFiles;
use crate::{ExecutionMeta, StoreError, StoredEvent};
use forkless_types::{Epoch, ExecutionId, PartitionId};
use std::borrow::Cow;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use tokio::sync::watch;

const VERSION: u8 = 1;
/// version, term.
const HEADER: usize = 1 + 8;
const EVENT: u8 = 1;
const PUT: u8 = 2;
const PRE_EPOCH: u8 = 16;
const PRE_OPEN: u8 = 17;
const PRE_ABSENT: u8 = 18;
const PRE_EVENT_KEY: u8 = 19;
const PRE_START_KEY: u8 = 20;

/// The last entry applied, `term u64 | index u64`, in the `meta`
/// keyspace: written in the same batch as the entry's puts, so the
/// keyspaces never hold an entry's effects without knowing it was
/// applied (fjall may keep batches written after the last checkpoint,
/// and a replica then re-applies only what follows).
pub(crate) const APPLIED_KEY: &[u8] = b"raft.applied";
/// The last membership applied (JSON; `raft_group.rs`).
pub(crate) const MEMBERSHIP_KEY: &[u8] = b"raft.membership";
/// The last entry applied as of the checkpoint, and the vote then
/// (`raft_group.rs`).
pub(crate) const CHECKPOINT_KEY: &[u8] = b"raft.checkpoint";
/// `raft.refused.<index u64><term u64>` -> why: an entry refused at its
/// apply, so a reopen that indexes the applied entries since the
/// checkpoint again leaves its events out. Keyed by the term too: an
/// entry that replaces a truncated one at its index has a higher term.
pub(crate) const REFUSED_PREFIX: &[u8] = b"raft.refused.";

/// The key of entry `index` of `term`'s refusal.
pub(crate) fn refused_key(index: u64, term: u64) -> Vec<u8> {
    let mut key = REFUSED_PREFIX.to_vec();
    key.extend_from_slice(&index.to_be_bytes());
    key.extend_from_slice(&term.to_be_bytes());
    key
}

/// The put that records entry `index` of `term` as refused at its apply,
/// under the key its readers look up ([`refused_key`]: a reopen's
/// reindex, `forkless store check`).
fn refusal(index: u64, term: u64, why: &str) -> (u8, Vec<u8>, Vec<u8>) {
    (
        keyspace_id::META,
        refused_key(index, term),
        why.as_bytes().to_vec(),
    )
}

/// The metadata cache, shared by the writer (which evaluates against it)
/// and the apply (which updates it).
pub(crate) type SharedCache = Arc<Mutex<MetaCache>>;

/// A proposal being built: the machine's [`machine::Sink`] writes into it.
#[derive(Default)]
pub(crate) struct ProposalBuf {
    buf: Vec<u8>,
    records: bool,
}

impl ProposalBuf {
    /// Starts a proposal under `term`.
    pub(crate) fn begin(&mut self, term: u64) {
        self.buf.clear();
        self.buf.push(VERSION);
        self.buf.extend_from_slice(&term.to_be_bytes());
        self.records = false;
    }

    pub(crate) fn precondition(&mut self, p: &Precondition<'_>) {
        let b = &mut self.buf;
        match p {
            Precondition::Epoch(e) => {
                b.push(PRE_EPOCH);
                b.extend_from_slice(&e.get().to_be_bytes());
            }
            Precondition::Open { id, last_seq } => {
                b.push(PRE_OPEN);
                b.extend_from_slice(&(id.get() as u64).to_be_bytes());
                b.extend_from_slice(&last_seq.to_be_bytes());
            }
            Precondition::Absent(id) => {
                b.push(PRE_ABSENT);
                b.extend_from_slice(&(id.get() as u64).to_be_bytes());
            }
            Precondition::EventKeyUnused(k) | Precondition::StartKeyUnused(k) => {
                b.push(match p {
                    Precondition::EventKeyUnused(_) => PRE_EVENT_KEY,
                    _ => PRE_START_KEY,
                });
                b.extend_from_slice(&(k.len() as u32).to_be_bytes());
                b.extend_from_slice(k);
            }
        }
    }

    /// Adds an event; returns where it lies in the proposal.
    pub(crate) fn event(
        &mut self,
        partition: PartitionId,
        id: ExecutionId,
        seq: u64,
        value: &[u8],
    ) -> Loc {
        self.records = true;
        log::push_event(&mut self.buf, partition, id, seq, value)
    }

    pub(crate) fn put(&mut self, keyspace: u8, key: &[u8], value: &[u8]) {
        self.records = true;
        log::push_put(&mut self.buf, keyspace, key, value);
    }

    /// An event added to this proposal, by the place [`ProposalBuf::event`]
    /// gave it.
    pub(crate) fn pending_event(&self, loc: Loc) -> Result<&[u8], StoreError> {
        log::event_in(&self.buf, loc)
    }

    /// Whether it holds a record (a proposal of refused commands only is
    /// never proposed).
    pub(crate) fn has_records(&self) -> bool {
        self.records
    }

    /// The proposal's bytes, taken out.
    pub(crate) fn take(&mut self) -> bytes::Bytes {
        self.records = false;
        bytes::Bytes::from(std::mem::take(&mut self.buf))
    }
}

/// What applying an entry came to, on every replica alike.
#[derive(Debug, Clone, PartialEq, Eq, Default, serde::Serialize, serde::Deserialize)]
pub enum Applied {
    /// Its records were applied (or it had none: a blank or membership
    /// entry).
    #[default]
    Done,
    /// Nothing of it was applied, for this reason: the commands it carried
    /// were not executed (safe to retry).
    Refused(String),
}

/// A state whose reads of executions and idempotency keys fail, as on a
/// disk that returned an error: what a test arms
/// (`failpoints::fail_next_apply_read`).
#[cfg(any(test, feature = "failpoints"))]
pub(crate) struct FailingReads<'a, S>(pub(crate) &'a S);

#[cfg(any(test, feature = "failpoints"))]
impl<S: machine::State> machine::State for FailingReads<'_, S> {
    fn epoch(&self) -> Epoch {
        self.0.epoch()
    }

    fn meta(&self, _: ExecutionId) -> Result<Option<ExecutionMeta>, StoreError> {
        Err(StoreError::Io("a read a test failed".into()))
    }

    fn start_idem(&self, _: &[u8]) -> Result<Option<ExecutionId>, StoreError> {
        Err(StoreError::Io("a read a test failed".into()))
    }

    fn event_idem(&self, _: &[u8]) -> Result<Option<u64>, StoreError> {
        Err(StoreError::Io("a read a test failed".into()))
    }

    fn stored_event(&self, id: ExecutionId, seq: u64) -> Result<StoredEvent, StoreError> {
        self.0.stored_event(id, seq)
    }
}

/// The shard's committed state, as a replica reads it to check an entry
/// (and the writer, to evaluate commands).
pub(crate) struct Committed<'a> {
    pub ks: &'a Keyspaces,
    pub tail: &'a SharedTail,
    pub cache: &'a MetaCache,
    pub epoch: &'a AtomicU64,
    pub events: &'a EventFiles,
}

impl machine::State for Committed<'_> {
    fn epoch(&self) -> Epoch {
        Epoch(self.epoch.load(Ordering::Acquire))
    }

    fn meta(&self, id: ExecutionId) -> Result<Option<ExecutionMeta>, StoreError> {
        if let Some(m) = self.cache.get(&id) {
            return Ok(Some(m.clone()));
        }
        // Only the shard's applier changes its state, and not while this
        // view is in use, so the latest committed state is the state.
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

    fn stored_event(&self, id: ExecutionId, seq: u64) -> Result<StoredEvent, StoreError> {
        let (snap, tail) = crate::read::view(self.ks, self.tail, id, seq - 1, 1);
        let locs = index::locations(self.ks, &snap, id, seq - 1, seq, tail.as_ref())?;
        let (_, loc) = locs.first().ok_or_else(|| {
            StoreError::Corrupt(format!("execution {id}: event {seq} is not indexed"))
        })?;
        codec::decode_event(seq, &self.events.read_event(*loc, id, seq)?)
    }
}

/// An event of the entry being applied, at its place in the log.
struct Event {
    partition: PartitionId,
    id: ExecutionId,
    seq: u64,
    loc: Loc,
    recorded_at: u64,
}

/// What an entry wrote of one execution: its last event (seq, recorded
/// at; zeros for none) and its record, if it wrote one.
#[derive(Default)]
struct Wrote {
    last: (u64, u64),
    record: Option<Vec<u8>>,
}

/// Applies a shard's entries to its state, on every replica.
pub(crate) struct Applier {
    ks: Keyspaces,
    tail: SharedTail,
    cache: SharedCache,
    epoch: Arc<AtomicU64>,
    events: EventFiles,
    waiters: Arc<crate::waiters::Waiters>,
    commits: watch::Sender<u64>,
    checker: Checker,
    /// The entry's events, puts and execution records (kept for their
    /// capacity).
    pending: Vec<Event>,
    puts: Vec<(u8, Vec<u8>, Vec<u8>)>,
    written: HashMap<ExecutionId, Wrote>,
}

impl Applier {
    #[allow(clippy::too_many_arguments)]
    pub(crate) fn new(
        ks: Keyspaces,
        tail: SharedTail,
        cache: SharedCache,
        epoch: Arc<AtomicU64>,
        events: EventFiles,
        waiters: Arc<crate::waiters::Waiters>,
        commits: watch::Sender<u64>,
    ) -> Applier {
        Applier {
            ks,
            tail,
            cache,
            epoch,
            events,
            waiters,
            commits,
            checker: Checker::default(),
            pending: Vec::new(),
            puts: Vec::new(),
            written: HashMap::default(),
        }
    }

    /// Applies the proposal `payload` of entry `index` committed in
    /// `term`, which lies at `offset` of node-log segment `segment` (so
    /// that its events are indexed where they are). `Err` only for what
    /// stops the replica (a damaged entry, a failed write of the
    /// keyspaces); a refusal every replica makes alike is
    /// `Ok(Applied::Refused)`, recorded as applied.
    pub(crate) fn apply(
        &mut self,
        term: u64,
        index: u64,
        payload: &[u8],
        segment: u32,
        offset: u64,
    ) -> Result<Applied, StoreError> {
        let applied = self.evaluate(term, payload, segment, offset)?;
        if let Applied::Refused(why) = &applied {
            self.pending.clear();
            self.puts.clear();
            self.written.clear();
            self.puts.push(refusal(index, term, why));
        }
        self.puts.push((
            keyspace_id::META,
            APPLIED_KEY.to_vec(),
            applied_value(term, index).to_vec(),
        ));
        self.publish()?;
        Ok(applied)
    }

    /// Records entry `index` of `term`, which holds no proposal (a blank
    /// or a membership entry, whose `extra` put goes with it), as applied.
    pub(crate) fn apply_other(
        &mut self,
        term: u64,
        index: u64,
        extra: Option<(&[u8], Vec<u8>)>,
    ) -> Result<(), StoreError> {
        self.pending.clear();
        self.puts.clear();
        self.written.clear();
        if let Some((key, value)) = extra {
            self.puts.push((keyspace_id::META, key.to_vec(), value));
        }
        self.puts.push((
            keyspace_id::META,
            APPLIED_KEY.to_vec(),
            applied_value(term, index).to_vec(),
        ));
        self.publish()
    }

    /// The shard's keyspaces.
    pub(crate) fn keyspaces(&self) -> &Keyspaces {
        &self.ks
    }

    /// The events indexed in memory since the last checkpoint.
    pub(crate) fn tail(&self) -> &SharedTail {
        &self.tail
    }

    /// Where the shard's durable events are read from.
    pub(crate) fn events(&self) -> &EventFiles {
        &self.events
    }

    /// After an install replaced the shard's state in the keyspaces
    /// (`snapshot.rs`): `tail` becomes the events index in memory, what
    /// was cached of the old state goes, the epoch is read again, and
    /// every reader waiting on an execution looks again.
    pub(crate) fn installed(&mut self, tail: index::Tail) -> Result<(), StoreError> {
        *self.tail.write().unwrap_or_else(|e| e.into_inner()) = tail;
        self.cache.lock().unwrap_or_else(|e| e.into_inner()).clear();
        if let Some(v) = self.ks.meta.get(EPOCH_KEY)? {
            self.epoch
                .store(codec::decode_u64(&v, "the epoch")?, Ordering::Release);
        }
        self.waiters.wake_all();
        self.commits.send_modify(|c| *c += 1);
        Ok(())
    }

    /// Indexes the events of an entry the keyspaces already hold as
    /// applied (written after the last checkpoint, found again at a
    /// reopen): into the tail only, with no checks and no puts.
    pub(crate) fn reindex(
        &mut self,
        payload: &[u8],
        segment: u32,
        offset: u64,
    ) -> Result<(), StoreError> {
        let mut tail = self.tail.write().unwrap_or_else(|e| e.into_inner());
        each_item(payload, segment, offset, |item| {
            if let Item::Record(Record::Event {
                partition,
                id,
                seq,
                value,
                loc,
            }) = item
            {
                tail.push(partition, id, seq, loc, codec::recorded_at(value)?)?;
            }
            Ok(true)
        })?;
        Ok(())
    }

    /// Moves the tail into the events index with `at` as the position a
    /// reopen reads the log from and `extra` under `key` in the `meta`
    /// keyspace, then makes the keyspaces durable (the writes of every
    /// entry applied so far with them). Only the index batch's commit
    /// holds the tail's write lock.
    pub(crate) fn checkpoint(
        &mut self,
        at: crate::log::Position,
        key: &[u8],
        extra: Vec<u8>,
    ) -> Result<(index::Written, std::time::Duration), StoreError> {
        let start = std::time::Instant::now();
        let (mut batch, written) = self
            .tail
            .read()
            .unwrap_or_else(|e| e.into_inner())
            .checkpoint_batch(&self.ks, at);
        batch.insert(&self.ks.meta, key, extra);
        self.tail
            .write()
            .unwrap_or_else(|e| e.into_inner())
            .commit_checkpoint(batch)?;
        let indexed = start.elapsed();
        self.ks.db.persist(fjall::PersistMode::SyncData)?;
        Ok((written, indexed))
    }

    /// Checks the entry and collects what it writes; publishes nothing.
    fn evaluate(
        &mut self,
        term: u64,
        payload: &[u8],
        segment: u32,
        offset: u64,
    ) -> Result<Applied, StoreError> {
        if payload.len() < HEADER || payload[0] != VERSION {
            return Err(not_a_proposal(segment, offset));
        }
        let proposed = u64_at(payload, 1);
        if proposed != term {
            return Ok(Applied::Refused(format!(
                "proposed in term {proposed}, committed in term {term}"
            )));
        }
        self.checker.begin();
        self.pending.clear();
        self.puts.clear();
        self.written.clear();
        let mut refused = None;
        #[cfg(any(test, feature = "failpoints"))]
        let fail_reads = crate::failpoints::apply_read_fails(&self.ks);
        each_item(payload, segment, offset, |item| {
            match item {
                Item::Record(Record::Event {
                    partition,
                    id,
                    seq,
                    value,
                    loc,
                }) => {
                    self.checker.event(id, seq, value)?;
                    let recorded_at = codec::recorded_at(value)?;
                    self.pending.push(Event {
                        partition,
                        id,
                        seq,
                        loc,
                        recorded_at,
                    });
                    self.written.entry(id).or_default().last = (seq, recorded_at);
                }
                Item::Record(Record::Put {
                    keyspace,
                    key,
                    value,
                }) => {
                    self.checker.put(keyspace, key, value)?;
                    if keyspace == keyspace_id::EXECUTIONS {
                        let id = execution_in_key(key).ok_or_else(|| {
                            StoreError::Corrupt(format!(
                                "node log segment {segment}, offset {offset}: proposal: an execution record's key"
                            ))
                        })?;
                        self.written.entry(id).or_default().record = Some(value.to_vec());
                    }
                    self.puts.push((keyspace, key.to_vec(), value.to_vec()));
                }
                Item::Precondition(p) => {
                    let cache = self.cache.lock().unwrap_or_else(|e| e.into_inner());
                    let state = Committed {
                        ks: &self.ks,
                        tail: &self.tail,
                        cache: &cache,
                        epoch: &self.epoch,
                        events: &self.events,
                    };
                    // (A read that failed stops the apply, and with it the
                    // group: its waiters' outcome is unknown.)
                    #[cfg(any(test, feature = "failpoints"))]
                    let checked = if fail_reads {
                        self.checker
                            .check(&FailingReads(&state), std::slice::from_ref(&p))?
                    } else {
                        self.checker.check(&state, std::slice::from_ref(&p))?
                    };
                    #[cfg(not(any(test, feature = "failpoints")))]
                    let checked = self.checker.check(&state, std::slice::from_ref(&p))?;
                    if let Err(why) = checked {
                        refused = Some(why);
                        return Ok(false);
                    }
                }
            }
            Ok(true)
        })?;
        Ok(match refused {
            Some(why) => Applied::Refused(why),
            None => Applied::Done,
        })
    }

    /// Makes the entry's records visible: its events in the tail and its
    /// puts in the keyspaces, together (readers take the tail's lock with
    /// their snapshot), then the cache, the epoch and the waiters.
    fn publish(&mut self) -> Result<(), StoreError> {
        // Durable already: the entry is (the keyspaces are made durable by
        // the checkpoints, and replayed from the log after a crash).
        let mut batch = self.ks.db.batch().durability(None);
        let mut epoch = None;
        for (keyspace, key, value) in &self.puts {
            if *keyspace == keyspace_id::META && key.as_slice() == EPOCH_KEY {
                epoch = Some(codec::decode_u64(value, "the epoch")?);
            }
            if let Some(ks) = self.ks.by_id(*keyspace) {
                batch.insert(ks, key.as_slice(), value.as_slice());
            }
        }
        {
            let mut tail = self.tail.write().unwrap_or_else(|e| e.into_inner());
            for e in self.pending.drain(..) {
                tail.push(e.partition, e.id, e.seq, e.loc, e.recorded_at)?;
            }
            if !batch.is_empty() {
                batch.commit()?;
            }
        }
        if let Some(e) = epoch {
            self.epoch.store(e, Ordering::Release);
        }
        {
            let mut cache = self.cache.lock().unwrap_or_else(|e| e.into_inner());
            let mut metas = Vec::new();
            for (id, Wrote { last, record }) in &self.written {
                let meta = match (record, cache.get(id)) {
                    (Some(record), _) => {
                        let last = if last.0 == 0 {
                            // A record with no event of the entry: the
                            // execution's last event is as before.
                            match cache.get(id) {
                                Some(m) => (m.last_seq, m.updated_at_ms),
                                None => continue,
                            }
                        } else {
                            *last
                        };
                        codec::decode_meta(*id, record, last)?
                    }
                    (None, Some(m)) => ExecutionMeta {
                        last_seq: last.0,
                        updated_at_ms: last.1,
                        ..m.clone()
                    },
                    // Not cached: the next lookup reads it from the disk.
                    (None, None) => continue,
                };
                metas.push((*id, meta));
            }
            cache.extend(metas);
        }
        if !self.written.is_empty() {
            self.waiters.wake(self.written.keys());
            self.commits.send_modify(|c| *c += 1);
        }
        Ok(())
    }
}

/// One item of a proposal.
pub(crate) enum Item<'a> {
    Record(Record<'a>),
    Precondition(Precondition<'a>),
}

fn not_a_proposal(segment: u32, offset: u64) -> StoreError {
    StoreError::Corrupt(format!(
        "node log segment {segment}, offset {offset}: not a proposal of this version"
    ))
}

/// Calls `visit` on each item of the proposal `payload` (which lies at
/// `offset` of node-log segment `segment`, so that its events' places are
/// where they are), in order, until it says stop (`false`).
pub(crate) fn each_item<'a>(
    payload: &'a [u8],
    segment: u32,
    offset: u64,
    mut visit: impl FnMut(Item<'a>) -> Result<bool, StoreError>,
) -> Result<(), StoreError> {
    if payload.len() < HEADER || payload[0] != VERSION {
        return Err(not_a_proposal(segment, offset));
    }
    let mut pos = HEADER;
    while pos < payload.len() {
        let (item, used) = match payload[pos] {
            EVENT | PUT => {
                let (record, used) = log::parse_record(payload, pos, segment, offset)?;
                (Item::Record(record), used)
            }
            kind => {
                let (p, used) = parse_precondition(&payload[pos..]).ok_or_else(|| {
                    StoreError::Corrupt(format!(
                        "node log segment {segment}, offset {}: proposal: a precondition of kind {kind}",
                        offset + pos as u64
                    ))
                })?;
                (Item::Precondition(p), used)
            }
        };
        if !visit(item)? {
            break;
        }
        pos += used;
    }
    Ok(())
}

/// [`APPLIED_KEY`]'s value.
pub(crate) fn applied_value(term: u64, index: u64) -> [u8; 16] {
    let mut v = [0u8; 16];
    v[..8].copy_from_slice(&term.to_be_bytes());
    v[8..].copy_from_slice(&index.to_be_bytes());
    v
}

/// The (term, index) of [`APPLIED_KEY`]'s value.
pub(crate) fn decode_applied(v: &[u8]) -> Result<(u64, u64), StoreError> {
    if v.len() != 16 {
        return Err(StoreError::Corrupt(format!(
            "the last applied entry: expected 16 bytes, found {}",
            v.len()
        )));
    }
    Ok((u64_at(v, 0), u64_at(v, 8)))
}

fn u64_at(b: &[u8], at: usize) -> u64 {
    let mut x = [0u8; 8];
    x.copy_from_slice(&b[at..at + 8]);
    u64::from_be_bytes(x)
}

/// The execution an execution record's key (`codec::execution_key`) names.
fn execution_in_key(key: &[u8]) -> Option<ExecutionId> {
    if key.len() != 12 {
        return None;
    }
    ExecutionId::new(u64_at(key, 4) as i64).ok()
}

/// A precondition at the start of `b`, and the bytes it takes.
fn parse_precondition(b: &[u8]) -> Option<(Precondition<'_>, usize)> {
    let u64_from = |at: usize| b.get(at..at + 8).map(|_| u64_at(b, at));
    let id_from = |at: usize| u64_from(at).and_then(|v| ExecutionId::new(v as i64).ok());
    match *b.first()? {
        PRE_EPOCH => Some((Precondition::Epoch(Epoch(u64_from(1)?)), 9)),
        PRE_OPEN => Some((
            Precondition::Open {
                id: id_from(1)?,
                last_seq: u64_from(9)?,
            },
            17,
        )),
        PRE_ABSENT => Some((Precondition::Absent(id_from(1)?), 9)),
        kind @ (PRE_EVENT_KEY | PRE_START_KEY) => {
            let len = u32::from_be_bytes(b.get(1..5)?.try_into().ok()?) as usize;
            let key = Cow::Borrowed(b.get(5..5 + len)?);
            let p = if kind == PRE_EVENT_KEY {
                Precondition::EventKeyUnused(key)
            } else {
                Precondition::StartKeyUnused(key)
            };
            Some((p, 5 + len))
        }
        _ => None,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A refusal is recorded under the key a reopen's reindex and the
    /// offline check look up. It was not (the index alone, without the
    /// term): a refused entry's events were counted by `store check` as
    /// the shard's (the fault suite saw "event 291 follows event 291" on a
    /// replica) and would have been indexed again at a reopen.
    #[test]
    fn a_refusal_is_recorded_where_its_readers_look() {
        let (keyspace, key, why) = refusal(7, 3, "proposed in term 2, committed in term 3");
        assert_eq!(keyspace, keyspace_id::META);
        assert_eq!(key, refused_key(7, 3));
        assert_ne!(key, refused_key(7, 2), "the term is part of the key");
        assert_eq!(why, b"proposed in term 2, committed in term 3");
    }
}
