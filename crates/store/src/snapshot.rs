//! A shard's snapshot, sent from one replica to another
//! (`docs/replication.md`, "Snapshots"): what a leader streams to a
//! follower that needs entries it no longer keeps, and how the follower
//! takes it in.
//!
//! **What it holds**: the shard's state as of one applied entry, as
//! records in the log's own format (`log.rs`): a put for every key of the
//! executions, idempotency and routing keyspaces and of the shard-level
//! facts in `meta` (not the replica's own: its Raft bookkeeping and log
//! checkpoint), then every event, execution by execution in seq order.
//! The events index is not sent: it says where events lie in the sender's
//! log, and the receiver builds its own.
//!
//! **The sender** reads a fjall snapshot taken with its checkpoint, under
//! the lock the apply holds, so the keyspaces it streams are exactly as of
//! the checkpoint's applied entry; the events are read by their places in
//! the log, which never change ([`Source`], [`Cursor`]: a chunk at a
//! time, each resumable from where the last stopped).
//!
//! **The receiver** stages the chunks in a file of the shard's folder
//! (`snapshot.<n>.incoming`, `len u32 | crc32 u32 | records` a chunk),
//! each checked as it arrives (every record one an install takes: a
//! malformed snapshot is refused before anything is emptied), synced
//! before the install starts. The install then:
//!
//! 1. records [`INSTALLING_KEY`] (the snapshot's meta and the staged
//!    file's name) durably, before it changes anything;
//! 2. empties the shard's keyspaces (leaving the replica's own meta: its
//!    vote, its log checkpoint), all but the events index, whose entries
//!    go execution by execution as step 3 comes to them (and, at its end,
//!    those of executions the snapshot does not hold);
//! 3. indexes the snapshot's events: one the replica holds already, byte
//!    for byte (read back at the place its index gave as the install
//!    began: [`Held`]), keeps that place; the others are written into the
//!    node log as import parts of the shard's group (`node_log.rs`, kinds 8
//!    and 9: no event lies elsewhere than in the node log), each indexed
//!    where it landed, and the kept ones are named, in runs, by parts of
//!    kind 10, in order with the imports (the log alone then tells the
//!    offline check what the install holds). The index is written to the
//!    keyspaces every so many events, to bound the install's memory, but
//!    never with a log checkpoint position: a reopen after a crash must
//!    read the group's log, and its votes, from the last real checkpoint.
//!    The snapshot's puts go into the keyspaces;
//! 4. records the snapshot's entry as applied and its membership,
//!    checkpoints (durably), and only then removes the marker and the
//!    staged file.
//!
//! A crash anywhere in 2-4 leaves the marker: the next open installs the
//! staged file again from the start (empties again, and keeps what the
//! index it left names, byte for byte, imports the rest again) before
//! the group starts, so a replica never runs on half a snapshot, and never
//! loses the state it acknowledged (what it had is only dropped once the
//! snapshot that replaces it is durable here). What an install keeps costs
//! no space; the node log reclaims none yet, so what it imports (the
//! events the replica lacked: the whole shard for a new one), the imports
//! of an attempt that did not finish, and events the replica held that
//! the snapshot does not hold, stay in the node log, the last two
//! unreferenced. A
//! replay never reads import parts (their events are in the index once
//! the install's checkpoint is), and the offline check counts only the
//! last install's (from its first part, kind 8), with the entries after
//! the snapshot's ([`IMPORTED_KEY`]).

use crate::apply::Applier;
use crate::codec;
use crate::keyspaces::{keyspace_id, Keyspaces};
use crate::log::{self, Log, Record};
use crate::node_log::GroupLog;
use crate::shard_log::EventFiles;
use crate::StoreError;
use fjall::Readable;
use std::fs::File;
use std::io::{Read, Write};
use std::ops::Bound;
use std::path::{Path, PathBuf};

/// About how many bytes of records a chunk carries (one record more, at
/// most, so a chunk holds at least one whatever its size).
pub(crate) const CHUNK_BYTES: usize = 1 << 20;

/// `raft.installing` -> the meta (JSON) of the snapshot being installed
/// and the staged file it is installed from: present from before the
/// install changes anything until after its checkpoint.
pub(crate) const INSTALLING_KEY: &[u8] = b"raft.installing";

/// `raft.imported` -> `index u64`: the entry the last snapshot installed
/// here was as of (the offline check counts the entries after it with the
/// install's imports).
pub(crate) const IMPORTED_KEY: &[u8] = b"raft.imported";

/// Events written to the node log in one part during an install.
const IMPORT_PART_BYTES: usize = if cfg!(test) { 4096 } else { 1 << 20 };
/// Puts written to the keyspaces in one batch during an install.
const PUT_BATCH_BYTES: usize = 4 << 20;
/// Events indexed in memory during an install before the index is
/// written to the keyspaces (bounds the install's memory).
const INDEX_EVERY_EVENTS: usize = if cfg!(test) { 64 } else { 1 << 20 };

/// Whether a `meta` key is the replica's own (its Raft bookkeeping, its
/// log checkpoint), not part of the shard's state.
pub(crate) fn replica_local(key: &[u8]) -> bool {
    key.starts_with(b"raft.") || key == crate::index::CHECKPOINT_KEY
}

/// What a replica streams a snapshot from: its keyspaces as of a
/// checkpoint, and the log files its events lie in.
pub(crate) struct Source {
    view: fjall::Snapshot,
    ks: Keyspaces,
    events: EventFiles,
}

impl std::fmt::Debug for Source {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Source").finish_non_exhaustive()
    }
}

/// Where a stream of chunks is: the stage (a keyspace, then the events),
/// the last key it sent of it, and, in the events, how many of that index
/// entry's events it sent.
#[derive(Debug, Clone, Default)]
pub(crate) struct Cursor {
    stage: usize,
    after: Option<Vec<u8>>,
    skip: usize,
}

/// The keyspaces streamed as puts, in order; the events come after them.
const PUT_STAGES: [u8; 5] = [
    keyspace_id::EXECUTIONS,
    keyspace_id::EVENT_IDEM,
    keyspace_id::ROUTING_KEYS,
    keyspace_id::START_IDEM,
    keyspace_id::META,
];
const EVENT_STAGE: usize = PUT_STAGES.len();

impl Source {
    /// A source over `view` (taken with the checkpoint it is as of).
    pub(crate) fn new(view: fjall::Snapshot, ks: Keyspaces, events: EventFiles) -> Source {
        Source { view, ks, events }
    }

    /// The next chunk of records after `cursor`, about `budget` bytes;
    /// `None` once everything was sent.
    pub(crate) fn next_chunk(
        &self,
        cursor: &mut Cursor,
        budget: usize,
    ) -> Result<Option<Vec<u8>>, StoreError> {
        let mut buf = Vec::with_capacity(budget.min(CHUNK_BYTES) + 4096);
        while cursor.stage < EVENT_STAGE && buf.len() < budget {
            let id = PUT_STAGES[cursor.stage];
            let ks = self
                .ks
                .by_id(id)
                .ok_or_else(|| StoreError::Corrupt(format!("no keyspace {id}")))?;
            let from = match &cursor.after {
                Some(k) => Bound::Excluded(k.as_slice()),
                None => Bound::Unbounded,
            };
            let mut ended = true;
            for item in self.view.range::<&[u8], _>(ks, (from, Bound::Unbounded)) {
                let (k, v) = item.into_inner()?;
                if id == keyspace_id::META && replica_local(&k) {
                    continue;
                }
                log::push_put(&mut buf, id, &k, &v);
                cursor.after = Some(k.to_vec());
                if buf.len() >= budget {
                    ended = false;
                    break;
                }
            }
            if ended {
                cursor.stage += 1;
                cursor.after = None;
            }
        }
        if cursor.stage == EVENT_STAGE && buf.len() < budget {
            let from = match &cursor.after {
                Some(k) if cursor.skip > 0 => Bound::Included(k.as_slice()),
                Some(k) => Bound::Excluded(k.as_slice()),
                None => Bound::Unbounded,
            };
            let mut ended = true;
            'entries: for item in self
                .view
                .range::<&[u8], _>(&self.ks.event_index, (from, Bound::Unbounded))
            {
                let (k, v) = item.into_inner()?;
                let (id, first_seq, locs) = crate::index::decode_entry_public(&k, &v)?;
                for (i, loc) in locs.iter().enumerate().skip(cursor.skip) {
                    let seq = first_seq + i as u64;
                    let value = self.events.read_event(*loc, id, seq)?;
                    log::push_event(&mut buf, id.partition(), id, seq, &value);
                    if buf.len() >= budget {
                        // Resume after this event: within the entry, or
                        // (all of it sent) after it.
                        cursor.after = Some(k.to_vec());
                        cursor.skip = if i + 1 < locs.len() { i + 1 } else { 0 };
                        ended = false;
                        break 'entries;
                    }
                }
                cursor.after = Some(k.to_vec());
                cursor.skip = 0;
            }
            if ended {
                cursor.stage += 1;
            }
        }
        Ok((!buf.is_empty()).then_some(buf))
    }
}

/// A snapshot being received: the staged file, and the chunk it expects
/// next.
pub(crate) struct Staging {
    /// Which snapshot (the sender's vote and the snapshot's id).
    pub(crate) id: String,
    pub(crate) path: PathBuf,
    file: File,
    pub(crate) next: u64,
}

impl Staging {
    /// Starts staging snapshot `id` in `dir`, in a file named by `n`.
    pub(crate) fn create(dir: &Path, id: String, n: u64) -> Result<Staging, StoreError> {
        let path = dir.join(format!("snapshot.{n}.incoming"));
        let file = File::create(&path).map_err(|e| io(&path, "creating", e))?;
        Ok(Staging {
            id,
            path,
            file,
            next: 0,
        })
    }

    /// Appends one chunk, once every record in it is one an install takes
    /// (so a malformed snapshot is refused while it arrives, before an
    /// install empties anything).
    pub(crate) fn write(&mut self, chunk: &[u8]) -> Result<(), StoreError> {
        check_chunk(chunk)?;
        let mut frame = Vec::with_capacity(8 + chunk.len());
        frame.extend_from_slice(&(chunk.len() as u32).to_be_bytes());
        frame.extend_from_slice(&crc32fast::hash(chunk).to_be_bytes());
        frame.extend_from_slice(chunk);
        self.file
            .write_all(&frame)
            .map_err(|e| io(&self.path, "writing", e))?;
        self.next += 1;
        Ok(())
    }

    /// Makes the staged file durable (its data and its name); returns its
    /// path.
    pub(crate) fn finish(self) -> Result<PathBuf, StoreError> {
        self.file
            .sync_all()
            .map_err(|e| io(&self.path, "syncing", e))?;
        if let Some(dir) = self.path.parent() {
            File::open(dir)
                .and_then(|d| d.sync_all())
                .map_err(|e| io(dir, "syncing", e))?;
        }
        Ok(self.path)
    }
}

/// Whether every record of `chunk` is one an install takes: an event, or
/// a put to a keyspace of the shard's state (not a key of its sender's
/// own).
fn check_chunk(chunk: &[u8]) -> Result<(), StoreError> {
    each_record(chunk, |record, _| {
        if let Record::Put { keyspace, key, .. } = record {
            if !PUT_STAGES.contains(&keyspace)
                || (keyspace == keyspace_id::META && replica_local(key))
            {
                return Err(StoreError::Corrupt(format!(
                    "a snapshot's put to keyspace {keyspace}, key {}: not part of a shard's state",
                    String::from_utf8_lossy(key)
                )));
            }
        }
        Ok(())
    })
}

/// Calls `visit` on each record of a chunk, in order, with its length.
fn each_record<'a>(
    chunk: &'a [u8],
    mut visit: impl FnMut(Record<'a>, usize) -> Result<(), StoreError>,
) -> Result<(), StoreError> {
    let mut pos = 0;
    while pos < chunk.len() {
        let (record, used) = log::parse_record(chunk, pos, 0, 0)?;
        visit(record, used)?;
        pos += used;
    }
    Ok(())
}

fn io(path: &Path, what: &str, e: std::io::Error) -> StoreError {
    StoreError::Io(format!("{what} {}: {e}", path.display()))
}

/// Calls `visit` on each chunk of the staged file at `path`, in order.
fn read_staged(
    path: &Path,
    mut visit: impl FnMut(&[u8]) -> Result<(), StoreError>,
) -> Result<(), StoreError> {
    let mut file = std::io::BufReader::new(File::open(path).map_err(|e| io(path, "opening", e))?);
    let mut chunk = Vec::new();
    let mut at = 0u64;
    loop {
        let mut header = [0u8; 8];
        match file.read_exact(&mut header[..1]) {
            Ok(()) => {}
            Err(e) if e.kind() == std::io::ErrorKind::UnexpectedEof => return Ok(()),
            Err(e) => return Err(io(path, "reading", e)),
        }
        file.read_exact(&mut header[1..])
            .map_err(|e| io(path, "reading", e))?;
        let len = u32::from_be_bytes([header[0], header[1], header[2], header[3]]) as usize;
        let crc = u32::from_be_bytes([header[4], header[5], header[6], header[7]]);
        chunk.resize(len, 0);
        file.read_exact(&mut chunk)
            .map_err(|e| io(path, "reading", e))?;
        if crc32fast::hash(&chunk) != crc {
            return Err(StoreError::Corrupt(format!(
                "{}: the chunk at byte {at} fails its checksum",
                path.display()
            )));
        }
        visit(&chunk)?;
        at += 8 + len as u64;
    }
}

/// The snapshot being installed, as [`INSTALLING_KEY`] records it.
#[derive(serde::Serialize, serde::Deserialize)]
pub(crate) struct Installing {
    pub(crate) meta: openraft::type_config::alias::SnapshotMetaOf<crate::raft_log::GroupConfig>,
    /// The staged file's name in the shard's folder.
    pub(crate) file: String,
}

impl Installing {
    pub(crate) fn read(ks: &Keyspaces) -> Result<Option<Installing>, StoreError> {
        ks.meta
            .get(INSTALLING_KEY)?
            .map(|v| {
                serde_json::from_slice(&v)
                    .map_err(|e| StoreError::Corrupt(format!("the snapshot being installed: {e}")))
            })
            .transpose()
    }

    /// Records it durably.
    pub(crate) fn record(&self, ks: &Keyspaces) -> Result<(), StoreError> {
        let v = serde_json::to_vec(self)
            .map_err(|e| StoreError::Invalid(format!("the snapshot's meta: {e}")))?;
        ks.meta.insert(INSTALLING_KEY, v)?;
        ks.db.persist(fjall::PersistMode::SyncData)?;
        Ok(())
    }
}

/// The entry the last snapshot installed here was as of, if one was.
pub(crate) fn imported(ks: &Keyspaces) -> Result<Option<u64>, StoreError> {
    ks.meta
        .get(IMPORTED_KEY)?
        .map(|v| codec::decode_u64(&v, "the last snapshot installed"))
        .transpose()
}

/// Empties the shard's state and takes in the staged snapshot at `path`
/// (steps 2 and 3 of the install, module docs): its events into `log`
/// (the shard's group of the node log) and the events index, its puts
/// into the keyspaces, then the snapshot's entry as applied. The caller
/// holds the apply (no entry is applied meanwhile), recorded
/// [`INSTALLING_KEY`] first, and checkpoints after.
pub(crate) fn take_in(
    applier: &mut Applier,
    log: &mut GroupLog,
    path: &Path,
    applied: (u64, u64),
    membership: Vec<u8>,
) -> Result<Imported, StoreError> {
    let ks = applier.keyspaces().clone();
    // What this replica holds already, as the install begins (before it
    // changes anything): an event of the snapshot found here, byte for
    // byte, keeps its place instead of being written again.
    let mut held = Held::new(applier);
    for k in [
        &ks.executions,
        &ks.event_idem,
        &ks.routing_keys,
        &ks.start_idem,
    ] {
        k.clear()?;
    }
    // The replica's own meta stays (the install's marker, its vote in
    // its Raft checkpoint, its log checkpoint, the mark of a new replica
    // that has not caught up): only the shard's state, and the Raft keys
    // the install writes again or that describe entries it replaces (the
    // last applied, the membership, refusals), go.
    let keep = |k: &[u8]| {
        replica_local(k)
            && k != crate::apply::APPLIED_KEY
            && k != crate::apply::MEMBERSHIP_KEY
            && !k.starts_with(crate::apply::REFUSED_PREFIX)
    };
    let mut stale = Vec::new();
    for item in ks.meta.iter() {
        let k = item.key()?;
        if !keep(&k) {
            stale.push(k);
        }
    }
    for k in stale {
        ks.meta.remove(k)?;
    }
    let mut tail = crate::index::Tail::default();
    let mut import = Import::default();
    // The install's first part, empty: where the offline check sees its
    // imports begin, whatever the snapshot holds. Once it is durable, so
    // is every part written before it, and with them every event the
    // replica held (a kept place is durable before the install indexes
    // it).
    log.begin()?;
    import.write(log, &mut tail, true)?;
    let mut batch = ks.db.batch().durability(None);
    let mut batch_bytes = 0usize;
    read_staged(path, |chunk| {
        each_record(chunk, |record, used| {
            match record {
                Record::Event {
                    partition,
                    id,
                    seq,
                    value,
                    ..
                } => {
                    let place = match held.place(partition, id, seq, value)? {
                        Some(loc) => {
                            import.keep(partition, id, seq, value)?;
                            Place::Kept(loc)
                        }
                        None => {
                            import.close_run();
                            if import.events == 0 {
                                log.begin()?;
                            }
                            import.events += 1;
                            import.bytes += used;
                            Place::Written(log.event(partition, id, seq, value))
                        }
                    };
                    import
                        .pending
                        .push((partition, id, seq, place, codec::recorded_at(value)?));
                    if import.bytes >= IMPORT_PART_BYTES || import.pending.len() >= PENDING_MAX {
                        import.write(log, &mut tail, false)?;
                        if import.indexed >= INDEX_EVERY_EVENTS {
                            // The index so far into the keyspaces (not
                            // durable: the marker covers a crash), and
                            // never the log checkpoint's position: a reopen
                            // after a crash here must read the group's log
                            // (its votes) from the last real checkpoint.
                            import.indexed = 0;
                            tail.write_runs(&ks)?;
                        }
                    }
                }
                Record::Put {
                    keyspace,
                    key,
                    value,
                } => {
                    if keyspace == keyspace_id::META && replica_local(key) {
                        return Err(StoreError::Corrupt(format!(
                            "the snapshot holds a key of its sender's own: {}",
                            String::from_utf8_lossy(key)
                        )));
                    }
                    let target = ks.by_id(keyspace).ok_or_else(|| {
                        StoreError::Corrupt(format!(
                            "the snapshot puts to unknown keyspace {keyspace}"
                        ))
                    })?;
                    batch.insert(target, key, value);
                    batch_bytes += key.len() + value.len();
                    if batch_bytes >= PUT_BATCH_BYTES {
                        std::mem::replace(&mut batch, ks.db.batch().durability(None)).commit()?;
                        batch_bytes = 0;
                    }
                }
            }
            Ok(())
        })
    })?;
    if !import.pending.is_empty() {
        import.write(log, &mut tail, false)?;
    }
    held.forget_through(None)?;
    batch.insert(
        &ks.meta,
        crate::apply::APPLIED_KEY,
        crate::apply::applied_value(applied.0, applied.1).to_vec(),
    );
    batch.insert(&ks.meta, crate::apply::MEMBERSHIP_KEY, membership);
    batch.insert(&ks.meta, IMPORTED_KEY, codec::u64_value(applied.1).to_vec());
    batch.commit()?;
    let outcome = Imported {
        events: import.total,
        kept: import.kept,
    };
    applier.installed(tail)?;
    Ok(outcome)
}

/// What an install took in.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Imported {
    /// Every event of the snapshot.
    pub(crate) events: u64,
    /// Those of them the replica held already, which kept their places.
    pub(crate) kept: u64,
}

/// Where an event of the snapshot goes in the index.
#[derive(Debug, Clone, Copy)]
enum Place {
    /// Into the import part being written, at this place within it.
    Written(crate::log::Loc),
    /// Where the replica held it already.
    Kept(crate::log::Loc),
}

/// Events placed but not yet indexed (an imported one is indexed only
/// once its part is durable, and the events of an execution go into the
/// index in order, so a kept one waits behind them).
#[derive(Default)]
struct Import {
    pending: Vec<(
        forkless_types::PartitionId,
        forkless_types::ExecutionId,
        u64,
        Place,
        u64,
    )>,
    /// Events written into the part being built, and their bytes.
    events: u64,
    bytes: usize,
    /// Runs of kept events not yet written (`node_log.rs`, part kind 10),
    /// and the run being extended: partition, execution, first seq, count,
    /// status.
    runs: Vec<u8>,
    run: Option<(
        forkless_types::PartitionId,
        forkless_types::ExecutionId,
        u64,
        u32,
        crate::ExecutionStatus,
    )>,
    /// Events in the tail since it was last written to the index.
    indexed: usize,
    total: u64,
    kept: u64,
}

impl Import {
    /// Counts event `seq` of `id` (whose bytes are `value`) as kept, in
    /// the run being extended or a new one.
    fn keep(
        &mut self,
        partition: forkless_types::PartitionId,
        id: forkless_types::ExecutionId,
        seq: u64,
        value: &[u8],
    ) -> Result<(), StoreError> {
        let event = codec::decode_event(seq, value)?;
        let status =
            crate::terminal_status(&event.event_type).unwrap_or(crate::ExecutionStatus::Running);
        match &mut self.run {
            Some((p, i, first, count, last))
                if *p == partition && *i == id && *first + u64::from(*count) == seq =>
            {
                *count += 1;
                *last = status;
            }
            _ => {
                self.close_run();
                self.run = Some((partition, id, seq, 1, status));
            }
        }
        self.kept += 1;
        Ok(())
    }

    /// Ends the run of kept events being extended.
    fn close_run(&mut self) {
        if let Some((partition, id, first, count, status)) = self.run.take() {
            crate::node_log::push_kept_run(&mut self.runs, partition, id, first, count, status);
        }
    }

    /// Writes the runs of kept events, then the part being built if it
    /// holds events or is the install's first (`first`), in that order (an
    /// execution's kept events come before any it imports), waits for
    /// them to be durable, and indexes every pending event where it lies.
    fn write(
        &mut self,
        log: &mut GroupLog,
        tail: &mut crate::index::Tail,
        first: bool,
    ) -> Result<(), StoreError> {
        self.close_run();
        let wait = |rx: std::sync::mpsc::Receiver<Result<crate::log::Durable, StoreError>>| {
            rx.recv()
                .map_err(|_| StoreError::Io("the node log's syncer stopped".into()))?
        };
        let kept = if self.runs.is_empty() {
            None
        } else {
            let (tx, rx) = std::sync::mpsc::sync_channel(1);
            log.append_kept(std::mem::take(&mut self.runs), move |made| {
                let _ = tx.send(made);
            });
            Some(rx)
        };
        let durable = if first || self.events > 0 {
            let (tx, rx) = std::sync::mpsc::sync_channel(1);
            log.append_import(first, move |made| {
                let _ = tx.send(made);
            });
            Some(wait(rx)?)
        } else {
            None
        };
        if let Some(rx) = kept {
            wait(rx)?;
        }
        let placed = self.pending.len();
        for (partition, id, seq, place, recorded_at) in self.pending.drain(..) {
            let loc = match (place, &durable) {
                (Place::Kept(loc), _) => loc,
                (Place::Written(at), Some(durable)) => durable.locate(at),
                (Place::Written(_), None) => {
                    return Err(StoreError::Invalid(
                        "an install placed an event in a part it did not write".into(),
                    ))
                }
            };
            tail.push(partition, id, seq, loc, recorded_at)?;
        }
        self.indexed += placed;
        self.total += placed as u64;
        self.events = 0;
        self.bytes = 0;
        Ok(())
    }
}

/// Events placed before the index takes them (an install of a shard this
/// replica holds in full places every event without writing a part).
const PENDING_MAX: usize = if cfg!(test) { 100 } else { 1 << 16 };
/// Places looked up at a time, of one execution.
const HELD_WINDOW: u64 = if cfg!(test) { 7 } else { 4096 };

/// The events a replica held as an install began: its events index then
/// (a database snapshot; the install rewrites the live index, execution
/// by execution, as the snapshot's events come) and the events it
/// indexed in memory since its last checkpoint (the tail the install
/// replaces at its end).
///
/// An event is kept only if the replica's copy is the snapshot's byte for
/// byte (read back, its checksum, execution and seq checked). A committed
/// event is the same on every replica, so a replica that was behind keeps
/// all it had; anything else it holds, or that its index names wrongly,
/// is written anew. The places kept lie in parts written before the
/// install's first part, durable once that part is.
struct Held {
    ks: Keyspaces,
    view: fjall::Snapshot,
    tail: crate::read::SharedTail,
    events: EventFiles,
    /// The execution the snapshot's events are at, and the places found
    /// for its events from `from` on.
    at: Option<forkless_types::ExecutionId>,
    from: u64,
    places: Vec<(u64, crate::log::Loc)>,
    /// Whether an event of that execution was not found held: the rest of
    /// it is written too (so that, in the log, an execution's kept events
    /// come before its imported ones).
    missed: bool,
    /// The last execution (`partition | execution`) whose index entries,
    /// and those of every execution before it, were taken out of the live
    /// index (the snapshot's events for them are indexed anew). A
    /// snapshot's events come in the order of the sender's events index,
    /// which is this one's key order, so one walk over the old entries
    /// does it.
    done_through: Option<[u8; 12]>,
}

impl Held {
    fn new(applier: &Applier) -> Held {
        let ks = applier.keyspaces().clone();
        Held {
            view: ks.db.snapshot(),
            ks,
            tail: applier.tail().clone(),
            events: applier.events().clone(),
            at: None,
            from: 0,
            places: Vec::new(),
            missed: false,
            done_through: None,
        }
    }

    /// Where the replica holds event `seq` of `id`, if it holds it with
    /// exactly `value`. The snapshot's events come execution by execution
    /// in seq order: at the first of an execution, its entries leave the
    /// live index.
    fn place(
        &mut self,
        partition: forkless_types::PartitionId,
        id: forkless_types::ExecutionId,
        seq: u64,
        value: &[u8],
    ) -> Result<Option<crate::log::Loc>, StoreError> {
        if self.at != Some(id) {
            self.at = Some(id);
            self.places.clear();
            self.missed = false;
            let key = codec::execution_key(partition, id);
            if self.done_through.is_some_and(|done| key <= done) {
                return Err(StoreError::Corrupt(format!(
                    "the snapshot's events of execution {id} come after those of a later one"
                )));
            }
            self.forget_through(Some(key))?;
        }
        if self.missed {
            return Ok(None);
        }
        let found = seq
            .checked_sub(self.from)
            .and_then(|i| self.places.get(i as usize))
            .filter(|(s, _)| *s == seq);
        let loc = match found {
            Some((_, loc)) => *loc,
            None => {
                self.from = seq;
                self.places = self.look_up(id, seq);
                match self.places.first() {
                    Some((s, loc)) if *s == seq => *loc,
                    _ => {
                        self.missed = true;
                        return Ok(None);
                    }
                }
            }
        };
        Ok(match self.events.read_event(loc, id, seq) {
            Ok(held) if held == value => Some(loc),
            _ => {
                self.missed = true;
                None
            }
        })
    }

    /// The places of up to [`HELD_WINDOW`] events of `id` from `seq` on,
    /// as the install began; none if it held no such event (or its index
    /// does not say, which is the same to an install: it writes them).
    fn look_up(&self, id: forkless_types::ExecutionId, seq: u64) -> Vec<(u64, crate::log::Loc)> {
        let Some(after) = seq.checked_sub(1) else {
            return Vec::new();
        };
        let tail = self.tail.read().unwrap_or_else(|e| e.into_inner()).view(
            id,
            after,
            HELD_WINDOW as usize,
        );
        let Ok(Some((last, _))) = crate::index::last_event(&self.ks, &self.view, id, tail.as_ref())
        else {
            return Vec::new();
        };
        crate::index::locations(
            &self.ks,
            &self.view,
            id,
            after,
            (after + HELD_WINDOW).min(last),
            tail.as_ref(),
        )
        .unwrap_or_default()
    }

    /// Takes out of the live index the old entries of every execution
    /// after the last one done through `upto` (`partition | execution`;
    /// `None`: to the end). Those before `upto` are executions the
    /// snapshot does not hold (a replica that held more than the snapshot,
    /// which a committed state does not, or an index left by an install a
    /// crash cut short).
    fn forget_through(&mut self, upto: Option<[u8; 12]>) -> Result<(), StoreError> {
        let last_of = |execution: [u8; 12]| {
            let mut k = [0xff; 20];
            k[..12].copy_from_slice(&execution);
            k
        };
        let from = match self.done_through {
            Some(done) => std::ops::Bound::Excluded(last_of(done)),
            None => std::ops::Bound::Unbounded,
        };
        let to = match upto {
            Some(x) => std::ops::Bound::Included(last_of(x)),
            None => std::ops::Bound::Unbounded,
        };
        let mut gone = Vec::new();
        for item in self.view.range(&self.ks.event_index, (from, to)) {
            gone.push(item.key()?);
            if gone.len() >= 4096 {
                for k in gone.drain(..) {
                    self.ks.event_index.remove(k)?;
                }
            }
        }
        for k in gone {
            self.ks.event_index.remove(k)?;
        }
        self.done_through = upto;
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::{AppendRequest, NewEvent, StartRequest, Store, StoreConfig};
    use forkless_types::{Epoch, ExecutionId, ShardCount, ShardId};

    const SHARD: ShardId = ShardId(0);

    fn id(n: i64) -> ExecutionId {
        ExecutionId::new(n).expect("id")
    }

    fn open(dir: &Path) -> Store {
        let store = Store::open(
            dir,
            ShardCount::ONE,
            StoreConfig {
                raft: true,
                ..StoreConfig::default()
            },
        )
        .expect("open");
        store.open_shard(SHARD, Epoch(1)).expect("open shard");
        store
    }

    async fn start(store: &Store, n: i64, key: &str) {
        let st = store.shard(SHARD).expect("shard");
        st.start(StartRequest {
            epoch: Epoch(1),
            id: id(n),
            workflow: "wf".into(),
            started_payload: format!("{{\"n\":{n}}}").into_bytes(),
            routing_key: None,
            idempotency_key: Some(key.into()),
        })
        .await
        .expect("start");
    }

    async fn append(store: &Store, n: i64, after: u64, count: usize) {
        let st = store.shard(SHARD).expect("shard");
        st.append(AppendRequest {
            epoch: Epoch(1),
            id: id(n),
            events: (0..count)
                .map(|i| NewEvent {
                    event_type: "step".into(),
                    payload: format!("{{\"i\":{}}}", after as usize + i).into_bytes(),
                    idempotency_key: Some(format!("{n}-{}", after as usize + i)),
                })
                .collect(),
            expected_last_seq: Some(after),
        })
        .await
        .expect("append");
    }

    /// A snapshot streamed in small chunks (so chunks end inside an
    /// execution's run of events) is staged on another replica, whose
    /// install a crash cuts short after it began (its marker recorded,
    /// part of its state emptied): the next open installs it again from
    /// the start, and the replica then holds exactly the snapshot's state
    /// (its own executions gone, every event and idempotency key of the
    /// snapshot's there), with no marker or staged file left.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn an_install_a_crash_cut_short_is_done_again_at_open() {
        let (from, to) = (
            tempfile::tempdir().expect("dir"),
            tempfile::tempdir().expect("dir"),
        );
        let source = open(from.path());
        for n in 1..=30 {
            start(&source, n, &format!("s{n}")).await;
            append(&source, n, 1, 1).await;
        }
        start(&source, 31, "s31").await;
        for k in 0..10 {
            append(&source, 31, 1 + 20 * k, 20).await;
        }
        let replica = source.shard(SHARD).expect("shard").replica().expect("raft");
        replica.checkpoint().expect("checkpoint");
        let (meta, snapshot) = replica.current_source().expect("a snapshot");

        let target = open(to.path());
        start(&target, 900, "t900").await;
        let theirs = target.shard(SHARD).expect("shard").replica().expect("raft");
        let mut staging = theirs.stage("test".into()).expect("stage");
        let mut cursor = Cursor::default();
        let mut chunks = 0;
        while let Some(chunk) = snapshot.next_chunk(&mut cursor, 2048).expect("chunk") {
            staging.write(&chunk).expect("staged");
            chunks += 1;
        }
        assert!(chunks > 5, "{chunks} chunks");
        let path = staging.finish().expect("finished");
        let ks = theirs.keyspaces().clone();
        // An install takes in the snapshot without moving the log
        // checkpoint (a reopen reads the group's log, its votes among it,
        // from there), however many times it writes the index on the way.
        let before = ks.meta.get(crate::index::CHECKPOINT_KEY).expect("read");
        theirs.take_in_only(&meta, &path).expect("taken in");
        assert_eq!(
            ks.meta.get(crate::index::CHECKPOINT_KEY).expect("read"),
            before,
            "the install moved the log checkpoint before its own"
        );
        // The mark of a new replica stays through an install.
        ks.meta.insert(crate::fresh::FRESH_KEY, []).expect("marked");
        Installing {
            meta,
            file: path.file_name().expect("name").to_string_lossy().into(),
        }
        .record(&ks)
        .expect("marker");
        ks.executions.clear().expect("cleared");
        ks.db
            .persist(fjall::PersistMode::SyncData)
            .expect("persist");
        drop((ks, theirs));
        drop(target);

        let target = open(to.path());
        let st = target.shard(SHARD).expect("shard");
        for n in 1..=30 {
            let (meta, events) = st.read_events(id(n), 0, 10).expect("read").expect("there");
            assert_eq!(meta.last_seq, 2, "execution {n}");
            assert_eq!(events[1].payload, b"{\"i\":1}".to_vec());
        }
        let (meta, events) = st
            .read_events(id(31), 0, 1000)
            .expect("read")
            .expect("there");
        assert_eq!(meta.last_seq, 201);
        assert_eq!(events.len(), 201);
        for (i, e) in events.iter().enumerate().skip(1) {
            assert_eq!(
                e.payload,
                format!("{{\"i\":{i}}}").into_bytes(),
                "event {}",
                i + 1
            );
        }
        assert!(st.read_events(id(900), 0, 10).expect("read").is_none());
        // The snapshot's idempotency keys came with it: a retried append
        // lands nowhere new.
        let again = st
            .append(AppendRequest {
                epoch: Epoch(1),
                id: id(31),
                events: vec![NewEvent {
                    event_type: "step".into(),
                    payload: b"{\"i\":1}".to_vec(),
                    idempotency_key: Some("31-1".into()),
                }],
                expected_last_seq: None,
            })
            .await
            .expect("a retried append");
        let (meta, _) = st.read_events(id(31), 0, 1).expect("read").expect("there");
        assert_eq!(meta.last_seq, 201, "{again:?}");
        let replica = st.replica().expect("raft");
        assert!(Installing::read(replica.keyspaces())
            .expect("read")
            .is_none());
        assert!(
            replica
                .keyspaces()
                .meta
                .get(crate::fresh::FRESH_KEY)
                .expect("read")
                .is_some(),
            "an install dropped the mark of a new replica"
        );
        let staged: Vec<_> = std::fs::read_dir(to.path().join("shards").join("0"))
            .expect("dir")
            .flatten()
            .filter(|e| e.file_name().to_string_lossy().ends_with(".incoming"))
            .collect();
        assert!(staged.is_empty(), "{staged:?}");
        drop((replica, st));
        drop(target);
        // And the offline check finds the installed replica whole.
        let report = crate::check::check(to.path()).expect("check");
        assert!(report.is_healthy(), "{report}");
        let expected = 30 * 2 + 201;
        assert_eq!(report.shards[0].events, expected, "{report}");
        assert_eq!(report.shards[0].indexed_events, expected, "{report}");
    }

    /// Copies a closed store's data directory.
    fn copy_dir(from: &Path, to: &Path) {
        std::fs::create_dir_all(to).expect("dir");
        for entry in std::fs::read_dir(from).expect("list") {
            let entry = entry.expect("entry");
            let dst = to.join(entry.file_name());
            if entry.file_type().expect("type").is_dir() {
                copy_dir(&entry.path(), &dst);
            } else {
                std::fs::copy(entry.path(), dst).expect("copied");
            }
        }
    }

    /// Stages `snapshot` on `replica`'s node.
    fn staged(replica: &crate::raft_group::Replica, snapshot: &Source) -> PathBuf {
        let mut staging = replica.stage("test".into()).expect("stage");
        let mut cursor = Cursor::default();
        while let Some(chunk) = snapshot.next_chunk(&mut cursor, 2048).expect("chunk") {
            staging.write(&chunk).expect("staged");
        }
        staging.finish().expect("finished")
    }

    /// A replica that was behind (it holds the first events of every
    /// execution, byte for byte) installs a snapshot of the whole shard:
    /// the events it held keep their places, so its node log grows by what
    /// it lacked (against the whole shard on a replica that held nothing);
    /// an event it wrote on its own that the snapshot has otherwise, and
    /// an execution the snapshot lacks, are replaced and gone. The install
    /// cut short by a crash and done again at open keeps them too, and the
    /// offline check finds the replica whole.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn an_install_keeps_the_events_the_replica_held_already() {
        let (from, to, bare) = (
            tempfile::tempdir().expect("dir"),
            tempfile::tempdir().expect("dir"),
            tempfile::tempdir().expect("dir"),
        );
        let source = open(from.path());
        for n in 1..=60 {
            start(&source, n, &format!("s{n}")).await;
            append(&source, n, 1, 20).await;
        }
        drop(source);
        copy_dir(from.path(), to.path());
        let source = open(from.path());
        for n in 1..=60 {
            append(&source, n, 21, 5).await;
        }
        for n in 61..=70 {
            start(&source, n, &format!("s{n}")).await;
            append(&source, n, 1, 3).await;
        }
        let replica = source.shard(SHARD).expect("shard").replica().expect("raft");
        replica.checkpoint().expect("checkpoint");
        let (meta, snapshot) = replica.current_source().expect("a snapshot");
        let total = 60 * 26 + 10 * 4;

        // What the whole shard takes, installed on a replica holding none.
        let empty = open(bare.path());
        let theirs = empty.shard(SHARD).expect("shard").replica().expect("raft");
        let path = staged(&theirs, &snapshot);
        let before = empty.log_disk_bytes();
        theirs.install(&meta, &path).expect("installed");
        let whole = empty.log_disk_bytes() - before;
        drop((theirs, empty));

        // The replica that was behind, with writes of its own since.
        let target = open(to.path());
        let st = target.shard(SHARD).expect("shard");
        st.append(AppendRequest {
            epoch: Epoch(1),
            id: id(7),
            events: vec![NewEvent {
                event_type: "step".into(),
                payload: b"{\"mine\":true}".to_vec(),
                idempotency_key: Some("mine".into()),
            }],
            expected_last_seq: Some(21),
        })
        .await
        .expect("an append of its own");
        start(&target, 900, "t900").await;
        let theirs = st.replica().expect("raft");
        let path = staged(&theirs, &snapshot);
        let before = target.log_disk_bytes();
        let taken = theirs.take_in_only(&meta, &path).expect("taken in");
        assert_eq!(taken.events, total);
        // Every event of executions 1-60 up to seq 21 but execution 7's
        // seq 22 (its own write) and after.
        assert_eq!(taken.kept, 60 * 21, "{taken:?}");
        // A crash before the install's checkpoint: done again at open.
        let ks = theirs.keyspaces().clone();
        Installing {
            meta: meta.clone(),
            file: path.file_name().expect("name").to_string_lossy().into(),
        }
        .record(&ks)
        .expect("marker");
        ks.db
            .persist(fjall::PersistMode::SyncData)
            .expect("persist");
        drop((ks, theirs, st));
        drop(target);
        let target = open(to.path());
        let grown = target.log_disk_bytes() - before;
        assert!(
            grown * 2 < whole,
            "the installs grew the node log by {grown} bytes, the whole shard takes {whole}"
        );
        let st = target.shard(SHARD).expect("shard");
        for n in 1..=70 {
            let (meta, events) = st.read_events(id(n), 0, 100).expect("read").expect("there");
            let last = if n <= 60 { 26 } else { 4 };
            assert_eq!(meta.last_seq, last, "execution {n}");
            assert_eq!(events.len() as u64, last, "execution {n}");
            for (i, e) in events.iter().enumerate().skip(1) {
                assert_eq!(
                    e.payload,
                    format!("{{\"i\":{i}}}").into_bytes(),
                    "execution {n} event {}",
                    i + 1
                );
            }
        }
        assert!(st.read_events(id(900), 0, 10).expect("read").is_none());
        drop(st);
        drop(target);
        let report = crate::check::check(to.path()).expect("check");
        assert!(report.is_healthy(), "{report}");
        assert_eq!(report.shards[0].events, total, "{report}");
        assert_eq!(report.shards[0].indexed_events, total, "{report}");
    }
}
