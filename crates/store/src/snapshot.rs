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
//!    vote, its log checkpoint);
//! 3. writes the snapshot's events into the node log as import parts of
//!    the shard's group (`node_log.rs`, kinds 8 and 9: no event lies
//!    elsewhere than in the node log), indexing each where it landed (the
//!    index is written to the keyspaces every so many events, to bound
//!    the install's memory, but never with a log checkpoint position: a
//!    reopen after a crash must read the group's log, and its votes, from
//!    the last real checkpoint), and its puts into the keyspaces;
//! 4. records the snapshot's entry as applied and its membership,
//!    checkpoints (durably), and only then removes the marker and the
//!    staged file.
//!
//! A crash anywhere in 2-4 leaves the marker: the next open installs the
//! staged file again from the start (empties again, imports again) before
//! the group starts, so a replica never runs on half a snapshot, and never
//! loses the state it acknowledged (what it had is only dropped once the
//! snapshot that replaces it is durable here). The imports of an attempt
//! that did not finish stay in the node log unreferenced (space only, and
//! so do the events the replica held before an install: the node log
//! reclaims no space yet, so each install grows the disk by the shard's
//! size): a
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
    for k in [
        &ks.executions,
        &ks.event_index,
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
    // imports begin, whatever the snapshot holds.
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
                    if import.events == 0 {
                        log.begin()?;
                    }
                    let at = log.event(partition, id, seq, value);
                    import
                        .pending
                        .push((partition, id, seq, at, codec::recorded_at(value)?));
                    import.events += 1;
                    import.bytes += used;
                    if import.bytes >= IMPORT_PART_BYTES {
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
    if import.events > 0 {
        import.write(log, &mut tail, false)?;
    }
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
    };
    applier.installed(tail)?;
    Ok(outcome)
}

/// What an install took in.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Imported {
    pub(crate) events: u64,
}

/// Events written to the log and not yet known durable.
#[derive(Default)]
struct Import {
    pending: Vec<(
        forkless_types::PartitionId,
        forkless_types::ExecutionId,
        u64,
        crate::log::Loc,
        u64,
    )>,
    events: u64,
    bytes: usize,
    /// Events in the tail since it was last written to the index.
    indexed: usize,
    total: u64,
}

impl Import {
    /// Writes the pending events' part (the install's first if `first`),
    /// waits for it to be durable, and indexes them where they landed.
    fn write(
        &mut self,
        log: &mut GroupLog,
        tail: &mut crate::index::Tail,
        first: bool,
    ) -> Result<(), StoreError> {
        let (tx, rx) = std::sync::mpsc::sync_channel(1);
        log.append_import(first, move |made| {
            let _ = tx.send(made);
        });
        let durable = rx
            .recv()
            .map_err(|_| StoreError::Io("the node log's syncer stopped".into()))??;
        for (partition, id, seq, at, recorded_at) in self.pending.drain(..) {
            tail.push(partition, id, seq, durable.locate(at), recorded_at)?;
        }
        self.indexed += self.events as usize;
        self.total += self.events;
        self.events = 0;
        self.bytes = 0;
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
}
