//! The shard's log: append-only segment files that are at once the
//! write-ahead log of every change to the shard and the home of its events.
//!
//! Each group commit is one record group, written with one `pwrite` and made
//! durable with one `fdatasync`:
//!
//! ```text
//! group   = payload_len u32 | crc32(payload) u32 | payload
//! payload = record*
//! record  = 1 | partition u32 | execution u64 | seq u64 | len u32 | crc32(value) u32 | value
//!                                                                        (an event)
//!         | 2 | keyspace u8 | key_len u32 | key | value_len u32 | value  (an index put)
//! ```
//!
//! An event carries a checksum of its own because it is read back alone,
//! long after the group's checksum was last checked (at replay).
//!
//! All integers are big-endian. An event stays where it was written: the
//! events index (see [`crate::index`]) maps an execution's sequence numbers
//! to `(segment, offset, len)` locations, and a read is a `pread` of the
//! record. Puts are the changes to the shard's fjall keyspaces (execution
//! records, idempotency and routing-key indexes, the epoch); the writer
//! applies them to fjall only after the group is durable here, without
//! asking fjall to sync, so fjall never holds a change the log does not.
//! Opening the shard replays the log from the last checkpoint, which
//! re-applies those puts (each put is a whole value, so applying one twice
//! is the same as once) and rebuilds the index of events written since.
//!
//! Segments are `<shard>/eventlog/<id>.seg`, numbered from 0 without gaps
//! (the node log's, `<data>/log/<id>.seg`, from `node_log::SEGMENT_BASE`),
//! and never deleted (they hold the events). A shard's first segment grows
//! with every group; once a shard has written a little, the next segment
//! is written full of zeros on a thread of its own
//! ([`crate::StoreConfig::log_segment_bytes`] long, under a name that is
//! not a segment's) and renamed into place at the next rotation, which
//! comes when the current one holds that much, or at once if the current
//! one was not zero-filled. A new segment's name is synced before
//! anything is written to it. An empty group is never written, so a zero
//! header followed by nothing but zeros is the end of a segment's groups.
//!
//! A crash can leave the last group of the last segment torn (short, or
//! failing its checksum): it was never acknowledged, since its fsync did
//! not return, so opening cuts it off (zeroes it). Only the last thing
//! ever written can be torn: a bad group with anything written after its
//! extent (see [`written_after_bad_group`]), or a bad group in any other
//! segment, is damage to acknowledged data, and the shard refuses to open
//! with an error naming the segment, the offset and what is wrong.

use crate::codec;
use crate::latency::Latency;
use crate::StoreError;
use forkless_types::{ExecutionId, PartitionId};
use std::collections::HashMap;
use std::fs::{File, OpenOptions};
use std::os::unix::fs::FileExt;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU32, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Instant;

/// By default a segment is closed once it holds this many bytes (the group
/// that crosses the mark is the last one written to it).
pub(crate) const SEGMENT_BYTES: u64 = 64 * 1024 * 1024;
const GROUP_HEADER: usize = 8;
const EVENT: u8 = 1;
const PUT: u8 = 2;
/// kind, partition, execution, seq, len, crc.
const EVENT_HEADER: usize = 1 + 4 + 8 + 8 + 4 + 4;
/// Largest group payload opening will believe (a group is at most
/// [`crate::GROUP_COMMIT_BYTES_MAX`] plus one command of any size the API
/// lets through; this only guards against reading a garbage length).
const GROUP_PAYLOAD_MAX: u64 = 1 << 31;

/// Where one event record lies in the log.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Loc {
    pub segment: u32,
    pub offset: u64,
    pub len: u32,
}

/// A position in the log: the end of a group.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Default)]
pub(crate) struct Position {
    pub segment: u32,
    pub offset: u64,
}

impl Position {
    pub(crate) fn encode(self) -> [u8; 12] {
        let mut out = [0u8; 12];
        out[..4].copy_from_slice(&self.segment.to_be_bytes());
        out[4..].copy_from_slice(&self.offset.to_be_bytes());
        out
    }

    pub(crate) fn decode(bytes: &[u8]) -> Result<Position, StoreError> {
        if bytes.len() != 12 {
            return Err(StoreError::Corrupt(format!(
                "log checkpoint: expected 12 bytes, found {}",
                bytes.len()
            )));
        }
        let mut r = codec::Reader::new(bytes, "log checkpoint");
        Ok(Position {
            segment: r.u32()?,
            offset: r.u64()?,
        })
    }
}

/// A record read back from the log.
pub(crate) enum Record<'a> {
    Event {
        partition: PartitionId,
        id: ExecutionId,
        seq: u64,
        value: &'a [u8],
        loc: Loc,
    },
    Put {
        keyspace: u8,
        key: &'a [u8],
        value: &'a [u8],
    },
}

/// A group made durable: where it starts and ends, and how many bytes it
/// took.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Durable {
    /// Where the group landed: what [`Log::event`]'s locations are
    /// relative to.
    pub start: Position,
    /// Where the frame that holds it starts (a round of the node log, in
    /// which `start` is one part's place; the group itself in a log of its
    /// own): a boundary a read may start at.
    pub round: Position,
    pub end: Position,
    pub bytes: u64,
}

impl Durable {
    /// Where an event that [`Log::event`] placed at `relative` lies.
    pub(crate) fn locate(&self, relative: Loc) -> Loc {
        Loc {
            segment: self.start.segment,
            offset: self.start.offset + relative.offset,
            len: relative.len,
        }
    }
}

/// A whole group read back from the log.
pub(crate) struct GroupRead<'a> {
    /// Where the group starts and where it ends (the next one's start).
    pub start: Position,
    pub end: Position,
    /// Where `payload` begins in `start`'s segment.
    payload_at: u64,
    payload: &'a [u8],
}

impl<'a> GroupRead<'a> {
    pub(crate) fn new(
        start: Position,
        end: Position,
        payload_at: u64,
        payload: &'a [u8],
    ) -> GroupRead<'a> {
        GroupRead {
            start,
            end,
            payload_at,
            payload,
        }
    }

    /// The whole group at `at` of `segment`, `len` bytes with its header.
    pub(crate) fn whole(segment: u32, at: u64, len: u64, payload: &'a [u8]) -> GroupRead<'a> {
        GroupRead {
            start: Position {
                segment,
                offset: at,
            },
            end: Position {
                segment,
                offset: at + len,
            },
            payload_at: at + GROUP_HEADER as u64,
            payload,
        }
    }

    /// Where the payload begins in the group's segment.
    pub(crate) fn payload_at(&self) -> u64 {
        self.payload_at
    }

    /// The group's bytes after its header.
    pub(crate) fn payload(&self) -> &'a [u8] {
        self.payload
    }

    /// The group's records, in the order they were added.
    pub(crate) fn records(&self) -> impl Iterator<Item = Result<Record<'a>, StoreError>> + '_ {
        let base = self.payload_at;
        let segment = self.start.segment;
        let payload = self.payload;
        let mut pos = 0;
        std::iter::from_fn(move || {
            if pos >= payload.len() {
                return None;
            }
            Some(
                parse_record(payload, pos, segment, base).map(|(record, used)| {
                    pos += used;
                    record
                }),
            )
        })
    }
}

/// What a log of groups does, whatever keeps it: today's per-shard
/// segment log ([`LogWriter`]) is the first implementation, and the
/// node-wide log that Raft's entries go into is the next
/// (`docs/replication.md`). Every implementation passes one conformance
/// suite (`log_conformance.rs`).
///
/// A group is built record by record ([`Log::begin`], [`Log::event`],
/// [`Log::put`]) and handed over whole ([`Log::append`]); the log tells
/// when it is durable through a callback, and nothing the group holds may
/// reach a reader before that. Positions are group boundaries.
#[cfg_attr(
    not(test),
    allow(
        dead_code,
        reason = "first, read, truncate_after and purge_before: a Raft group's log storage is their user; the conformance suite runs them now"
    )
)]
pub(crate) trait Log {
    /// Starts a group, dropping whatever an unfinished one held.
    fn begin(&mut self) -> Result<(), StoreError>;
    /// Adds an event to the group; returns where it lies within the group
    /// (a log that places groups only when it writes them cannot say more
    /// yet): [`Durable::locate`] turns it into its place in the log.
    fn event(&mut self, partition: PartitionId, id: ExecutionId, seq: u64, value: &[u8]) -> Loc;
    /// Adds a put into one of the shard's keyspaces to the group.
    fn put(&mut self, keyspace: u8, key: &[u8], value: &[u8]);
    /// The value of an event added to the group being built, by the
    /// location [`Log::event`] gave it.
    fn pending_event(&self, loc: Loc) -> Result<&[u8], StoreError>;
    /// Whether the group holds no record.
    fn is_empty(&self) -> bool;
    /// The value of durable event `seq` of `id`, at `loc` (as
    /// [`Durable::locate`] or a [`Log::read`] gave it), checked to be that
    /// event.
    fn read_event(&self, loc: Loc, id: ExecutionId, seq: u64) -> Result<Vec<u8>, StoreError>;
    /// Writes the group. `durable` is called exactly once: with where the
    /// group ends once it is durable, or with why it failed (then the log
    /// takes no more groups, and whether the group reached the disk is
    /// unknown until a reopen). It may be called before `append` returns,
    /// or later from another thread; groups become durable in the order
    /// they were appended.
    fn append<F>(&mut self, durable: F)
    where
        F: FnOnce(Result<Durable, StoreError>) + Send + 'static;
    /// The end of the last group made durable (or the position the last
    /// cut cut after).
    fn position(&self) -> Position;
    /// The first position reads may start at (moved by [`Log::purge_before`]).
    fn first(&self) -> Position;
    /// Calls `visit` on every durable group from `from` (a group boundary
    /// at or after [`Log::first`]) to the end, in order, until it says
    /// stop (`false`).
    fn read<V>(&self, from: Position, visit: V) -> Result<(), StoreError>
    where
        V: FnMut(&GroupRead<'_>) -> Result<bool, StoreError>;
    /// Cuts every group after `at`, a group boundary at or after
    /// [`Log::first`] and at or before the end; the next group lands
    /// after `at` (right at it, in a log of one group's own). Durable when
    /// it returns: a crash during the cut leaves a prefix of the log as it
    /// was, at least as long as `at`. The caller must not have published
    /// anything the cut groups hold.
    fn truncate_after(&mut self, at: Position) -> Result<(), StoreError>;
    /// Reads before `at` (a group boundary at or before the end) are
    /// refused from now on. No space comes back: the events live in the
    /// log and are read by their locations, whatever the mark. The mark
    /// is not kept across a reopen; a caller that needs it (Raft's
    /// `last_purged`) keeps it durable itself.
    fn purge_before(&mut self, at: Position) -> Result<(), StoreError>;
    /// Drops the group being built and refuses every later one.
    fn fail_stop(&mut self);
    /// Where a replay after a checkpoint taken now may start: every group
    /// this log made durable before it must already be published (the
    /// writer, its only appender, checkpoints between groups). Its own
    /// end for a log of one group's own; a node log's end, even when
    /// other groups wrote last, so that an idle group's checkpoint keeps
    /// up with the log and a reopen reads no more than it must.
    fn checkpoint_position(&self) -> Position {
        self.position()
    }
    /// Bytes the log has written since it was opened, of every group it
    /// holds: what a checkpoint's distance is measured in (a reopen
    /// reads the whole log from the oldest checkpoint of any group).
    fn written(&self) -> u64;
}

/// Closed segments kept open for reading at most, per shard (a shard of
/// 100 GiB has 1,600 segments, and a process's default limit on open files
/// is often 1,024).
const OPEN_SEGMENTS_MAX: usize = 32;

/// The log's segments as readers see them, shared by the writer and every
/// reader.
pub(crate) struct Segments {
    dir: PathBuf,
    /// The first segment's id (0 for a shard's own log; a node log's are
    /// numbered from [`crate::node_log::SEGMENT_BASE`], so a location says
    /// which log it is in).
    base: u32,
    /// Segments that exist: ids `base..count`.
    count: AtomicU32,
    /// Bytes the segments hold (durable groups only).
    bytes: AtomicU64,
    /// How long each group's `fdatasync` took.
    pub(crate) sync_latency: Latency,
    /// Open handles: the segment being written (always), and up to
    /// [`OPEN_SEGMENTS_MAX`] others, opened on first read.
    open: Mutex<HashMap<u32, Arc<File>>>,
}

impl Segments {
    /// Segments `base..count` of `dir`, for reading only (the offline
    /// check, and a shard's own log once it writes to the node log).
    pub(crate) fn read_only(dir: &Path, base: u32, count: u32) -> Segments {
        Segments {
            dir: dir.to_path_buf(),
            base,
            count: AtomicU32::new(count),
            bytes: AtomicU64::new(0),
            sync_latency: Latency::default(),
            open: Mutex::new(HashMap::new()),
        }
    }

    /// Segments `base..base + count` of `dir`, which exist and are no
    /// longer written, for reading (a shard's own log once it writes to
    /// the node log), with the bytes they take.
    pub(crate) fn existing(dir: &Path, base: u32, count: u32) -> Result<Segments, StoreError> {
        let end = base + count;
        let segments = Segments::read_only(dir, base, end);
        segments
            .bytes
            .store(bytes_before(dir, base, end)?, Ordering::Relaxed);
        Ok(segments)
    }

    /// The first segment's id.
    pub(crate) fn base(&self) -> u32 {
        self.base
    }

    fn file(&self, segment: u32) -> Result<Option<Arc<File>>, StoreError> {
        let count = self.count.load(Ordering::Acquire);
        if segment < self.base || segment >= count {
            return Ok(None);
        }
        let mut open = self.open.lock().unwrap_or_else(|e| e.into_inner());
        if let Some(f) = open.get(&segment) {
            return Ok(Some(f.clone()));
        }
        let path = segment_path(&self.dir, segment);
        let file = Arc::new(File::open(&path).map_err(|e| io(&path, "opening", e))?);
        keep_open(&mut open, segment, file.clone(), count - 1);
        Ok(Some(file))
    }

    /// Reads the event at `loc`, checking that it is the event the index
    /// says it is; returns its value.
    pub(crate) fn read_event(
        &self,
        loc: Loc,
        id: ExecutionId,
        seq: u64,
    ) -> Result<Vec<u8>, StoreError> {
        let buf = self.pread(loc.segment, loc.offset, loc.len, || {
            StoreError::Corrupt(format!(
                "execution {id} seq {seq}: index names segment {} which does not exist",
                loc.segment
            ))
        })?;
        match parse_record(&buf, 0, loc.segment, loc.offset)? {
            (
                Record::Event {
                    id: found,
                    seq: at,
                    value,
                    ..
                },
                used,
            ) if found == id && at == seq && used == buf.len() => Ok(value.to_vec()),
            _ => Err(StoreError::Corrupt(format!(
                "execution {id} seq {seq}: the index points at another record ({}:{})",
                loc.segment, loc.offset
            ))),
        }
    }

    /// Reads `len` bytes at `offset` of `segment` (a place an earlier
    /// durable write gave; what they hold is the caller's to check).
    pub(crate) fn read_at(
        &self,
        segment: u32,
        offset: u64,
        len: u32,
    ) -> Result<Vec<u8>, StoreError> {
        self.pread(segment, offset, len, || {
            StoreError::Corrupt(format!(
                "{}: segment {segment} does not exist",
                self.dir.display()
            ))
        })
    }

    /// `len` bytes at `offset` of `segment`; `missing` if there is no
    /// such segment.
    fn pread(
        &self,
        segment: u32,
        offset: u64,
        len: u32,
        missing: impl FnOnce() -> StoreError,
    ) -> Result<Vec<u8>, StoreError> {
        let file = self.file(segment)?.ok_or_else(missing)?;
        let mut buf = vec![0u8; len as usize];
        file.read_exact_at(&mut buf, offset).map_err(|e| {
            StoreError::Io(format!(
                "{}: reading {len} bytes at {offset}: {e}",
                segment_path(&self.dir, segment).display()
            ))
        })?;
        Ok(buf)
    }

    /// Calls `visit` on every group from `from` (a group boundary) to
    /// `end` (the end of the last durable group), in order, until it says
    /// stop (`false`).
    pub(crate) fn read_groups<V>(
        &self,
        from: Position,
        end: Position,
        mut visit: V,
    ) -> Result<(), StoreError>
    where
        V: FnMut(&GroupRead<'_>) -> Result<bool, StoreError>,
    {
        let mut payload = Vec::new();
        for segment in from.segment..=end.segment {
            let path = segment_path(&self.dir, segment);
            let file = self.file(segment)?.ok_or_else(|| {
                StoreError::Corrupt(format!(
                    "{}: segment {segment} is missing",
                    self.dir.display()
                ))
            })?;
            let limit = if segment == end.segment {
                end.offset
            } else {
                file_len(&file, &path)?
            };
            let mut at = if segment == from.segment {
                from.offset
            } else {
                0
            };
            while at < limit {
                match read_group(&file, at, limit, &mut payload, &path)? {
                    Group::Whole(len) => {
                        if !visit(&GroupRead::whole(segment, at, len, &payload))? {
                            return Ok(());
                        }
                        at += len;
                    }
                    // A closed segment's groups end where its zeros begin.
                    Group::End if segment != end.segment => break,
                    Group::End | Group::Bad => {
                        return Err(StoreError::Corrupt(format!(
                            "{}: offset {at}: not a whole group (a read must start at a group boundary)",
                            path.display()
                        )));
                    }
                }
            }
        }
        Ok(())
    }

    /// Bytes the segments take.
    pub(crate) fn disk_bytes(&self) -> u64 {
        self.bytes.load(Ordering::Relaxed)
    }
}

/// Adds a handle, first closing closed segments' handles beyond the bound
/// (any will do: a read in flight keeps its own).
fn keep_open(open: &mut HashMap<u32, Arc<File>>, segment: u32, file: Arc<File>, current: u32) {
    while open.len() > OPEN_SEGMENTS_MAX {
        let Some(old) = open.keys().copied().find(|s| *s != current) else {
            break;
        };
        open.remove(&old);
    }
    open.insert(segment, file);
}

/// The writer's end of the log: builds a group, writes it, syncs it.
pub(crate) struct LogWriter {
    segments: Arc<Segments>,
    file: Arc<File>,
    segment: u32,
    /// Bytes of the current segment that hold durable groups.
    len: u64,
    /// A segment is closed once it holds this many bytes.
    segment_bytes: u64,
    /// Whether the current segment was written full of zeros before use
    /// (then a group overwrites zeros and its fsync writes data only).
    zeroed: bool,
    /// The next segment, being zero-filled on a thread of its own.
    next: Option<std::thread::JoinHandle<Result<(PathBuf, File), StoreError>>>,
    /// The group being built: header space, then records.
    buf: Vec<u8>,
    /// Set once a write or sync failed: no group is written after it.
    failed: bool,
    /// See [`Log::purge_before`].
    first: Position,
    /// See [`Log::written`].
    written: u64,
}

impl LogWriter {
    pub(crate) fn segments(&self) -> &Arc<Segments> {
        &self.segments
    }

    /// Writes the group and waits until it is durable. On error nothing
    /// more may be written (the segment's end is unknown): the caller
    /// fails stop, and the next open cuts off whatever part of the group
    /// reached the disk.
    pub(crate) fn commit(&mut self) -> Result<u64, StoreError> {
        if self.failed {
            self.buf.truncate(GROUP_HEADER);
            return Err(StoreError::Io(
                "an earlier write or sync of the log failed; it takes no more groups".into(),
            ));
        }
        let payload = u32::try_from(self.buf.len() - GROUP_HEADER).map_err(|_| {
            StoreError::Invalid(format!(
                "a group of {} bytes is larger than the log takes",
                self.buf.len()
            ))
        })?;
        let crc = crc32fast::hash(&self.buf[GROUP_HEADER..]);
        self.buf[..4].copy_from_slice(&payload.to_be_bytes());
        self.buf[4..8].copy_from_slice(&crc.to_be_bytes());
        if let Err(e) = self.file.write_all_at(&self.buf, self.len) {
            return Err(self.failed_io("write", e));
        }
        let start = Instant::now();
        if let Err(e) = self.file.sync_data() {
            return Err(self.failed_io("fdatasync", e));
        }
        self.segments.sync_latency.record(start.elapsed());
        let written = self.buf.len() as u64;
        self.len += written;
        self.written += written;
        self.segments.bytes.fetch_add(written, Ordering::Relaxed);
        self.buf.truncate(GROUP_HEADER);
        Ok(written)
    }

    /// Adds bytes to the group being built as they are (a node log's
    /// parts, `node_log.rs`); returns where they start, from the group's
    /// first byte.
    pub(crate) fn push_raw(&mut self, bytes: &[u8]) -> u64 {
        let at = self.buf.len() as u64;
        self.buf.extend_from_slice(bytes);
        at
    }

    /// Fails stop after an I/O error of the current segment.
    fn failed_io(&mut self, what: &str, e: std::io::Error) -> StoreError {
        self.fail_stop();
        io(&segment_path(&self.segments.dir, self.segment), what, e)
    }

    /// Moves to a new segment: the zero-filled one if it is ready, else
    /// a new empty one (and the zero-filled one is taken at the first
    /// group after it is ready).
    fn rotate(&mut self) -> Result<(), StoreError> {
        let next = self.segment + 1;
        let dir = &self.segments.dir;
        let prepared = match self.next.take_if(|h| h.is_finished()).map(|h| h.join()) {
            Some(Ok(Ok((tmp, file)))) => {
                let path = segment_path(dir, next);
                std::fs::rename(&tmp, &path).map_err(|e| io(&path, "renaming into place", e))?;
                sync_dir(dir)?;
                Some(file)
            }
            Some(Ok(Err(e))) => {
                tracing::warn!(error = %e, "zero-filling the next log segment failed; using an empty one");
                None
            }
            Some(Err(_)) => {
                tracing::warn!("zero-filling the next log segment panicked; using an empty one");
                None
            }
            None => None,
        };
        self.zeroed = prepared.is_some();
        let file = Arc::new(match prepared {
            Some(f) => f,
            None => create_segment(dir, next)?,
        });
        keep_open(
            &mut self.segments.open.lock().unwrap_or_else(|e| e.into_inner()),
            next,
            file.clone(),
            next,
        );
        // Published after the handle, so a reader that sees the segment
        // finds it open.
        self.segments.count.store(next + 1, Ordering::Release);
        self.file = file;
        self.segment = next;
        self.len = 0;
        Ok(())
    }
}

impl Log for LogWriter {
    /// The end of the last durable group.
    fn position(&self) -> Position {
        Position {
            segment: self.segment,
            offset: self.len,
        }
    }

    /// Starts a group (dropping whatever an unfinished one held), first
    /// moving to a new segment if the current one is full.
    fn begin(&mut self) -> Result<(), StoreError> {
        // A shard that has written a little starts getting its next
        // segment ready (one that never does costs no zero-filling); a
        // segment that was not zero-filled is left as soon as one is.
        let prepare_at = (self.segment_bytes / 2).min(PREPARE_AFTER_BYTES);
        if self.next.is_none() && self.len >= prepare_at {
            let dir = self.segments.dir.clone();
            let bytes = self.segment_bytes;
            self.next = std::thread::Builder::new()
                .name("log-prepare".into())
                .spawn(move || prepare_segment(&dir, bytes))
                .map_err(|e| {
                    tracing::warn!(error = %e, "could not start zero-filling the next log segment");
                })
                .ok();
        }
        let ready = self.next.as_ref().is_some_and(|h| h.is_finished());
        if self.len >= self.segment_bytes || (!self.zeroed && ready && self.len > 0) {
            self.rotate()?;
        }
        self.buf.clear();
        self.buf.resize(GROUP_HEADER, 0);
        Ok(())
    }

    /// Whether the group holds no record.
    fn is_empty(&self) -> bool {
        self.buf.len() <= GROUP_HEADER
    }

    /// Adds an event to the group; returns where it will lie once written.
    fn event(&mut self, partition: PartitionId, id: ExecutionId, seq: u64, value: &[u8]) -> Loc {
        push_event(&mut self.buf, partition, id, seq, value)
    }

    /// The value of an event added to the group being built.
    fn pending_event(&self, loc: Loc) -> Result<&[u8], StoreError> {
        event_in(&self.buf, loc)
    }

    /// Adds a put to one of the shard's keyspaces to the group.
    fn put(&mut self, keyspace: u8, key: &[u8], value: &[u8]) {
        push_put(&mut self.buf, keyspace, key, value);
    }

    /// Drops the group being built and refuses every later one.
    fn fail_stop(&mut self) {
        self.failed = true;
        self.buf.truncate(GROUP_HEADER);
    }

    /// Writes and syncs the group on the caller's thread: `durable` is
    /// called before this returns.
    fn append<F>(&mut self, durable: F)
    where
        F: FnOnce(Result<Durable, StoreError>) + Send + 'static,
    {
        let start = self.position();
        durable(self.commit().map(|bytes| Durable {
            start,
            round: start,
            end: self.position(),
            bytes,
        }));
    }

    fn first(&self) -> Position {
        self.first
    }

    fn read_event(&self, loc: Loc, id: ExecutionId, seq: u64) -> Result<Vec<u8>, StoreError> {
        self.segments.read_event(loc, id, seq)
    }

    fn read<V>(&self, from: Position, visit: V) -> Result<(), StoreError>
    where
        V: FnMut(&GroupRead<'_>) -> Result<bool, StoreError>,
    {
        if from < self.first {
            return Err(StoreError::Invalid(format!(
                "{}: {}:{} is before the log's first position {}:{} (purged)",
                self.segments.dir.display(),
                from.segment,
                from.offset,
                self.first.segment,
                self.first.offset
            )));
        }
        if from > self.position() {
            return Err(StoreError::Invalid(format!(
                "{}: {}:{} is past the log's end",
                self.segments.dir.display(),
                from.segment,
                from.offset
            )));
        }
        self.segments.read_groups(from, self.position(), visit)
    }

    fn truncate_after(&mut self, at: Position) -> Result<(), StoreError> {
        if self.failed {
            return Err(StoreError::Io(
                "an earlier write or sync of the log failed; it takes no more changes".into(),
            ));
        }
        self.check_boundary(at, "cut after")?;
        if at == self.position() {
            return Ok(());
        }
        let dir = self.segments.dir.clone();
        // Readers must not open what is about to go.
        self.segments.count.store(at.segment + 1, Ordering::Release);
        cut_after(&dir, at, self.segment)?;
        let mut open = self.segments.open.lock().unwrap_or_else(|e| e.into_inner());
        for id in at.segment + 1..=self.segment {
            open.remove(&id);
        }
        if at.segment != self.segment {
            let path = segment_path(&dir, at.segment);
            let file = Arc::new(
                OpenOptions::new()
                    .read(true)
                    .write(true)
                    .open(&path)
                    .map_err(|e| io(&path, "opening", e))?,
            );
            open.insert(at.segment, file.clone());
            self.file = file;
            self.segment = at.segment;
        }
        drop(open);
        // As `open` counts them: the whole files before the last segment,
        // and the last one's groups.
        let bytes = bytes_before(&dir, self.segments.base, at.segment)? + at.offset;
        self.segments.bytes.store(bytes, Ordering::Relaxed);
        self.len = at.offset;
        // The cut leaves a hole, not written zeros: the next rotation
        // takes a zero-filled segment as soon as one is ready.
        self.zeroed = false;
        self.buf.truncate(GROUP_HEADER);
        Ok(())
    }

    fn purge_before(&mut self, at: Position) -> Result<(), StoreError> {
        self.check_boundary(at, "purge before")?;
        self.first = at;
        Ok(())
    }

    fn written(&self) -> u64 {
        self.written
    }
}

impl LogWriter {
    /// Refuses `at` unless it is a group boundary of this log between its
    /// first position and its end.
    fn check_boundary(&self, at: Position, what: &str) -> Result<(), StoreError> {
        let dir = self.segments.dir.display();
        if at < self.first || at > self.position() {
            return Err(StoreError::Invalid(format!(
                "{dir}: cannot {what} {}:{}: the log holds {}:{} to {}:{}",
                at.segment,
                at.offset,
                self.first.segment,
                self.first.offset,
                self.segment,
                self.len
            )));
        }
        if at.offset == 0 || at == self.position() {
            return Ok(());
        }
        let mut boundary = false;
        self.read(
            Position {
                segment: at.segment,
                offset: 0,
            }
            .max(self.first),
            |g| {
                boundary = g.end == at;
                Ok(g.end < at)
            },
        )?;
        if !boundary {
            return Err(StoreError::Invalid(format!(
                "{dir}: cannot {what} {}:{}: not the end of a group",
                at.segment, at.offset
            )));
        }
        Ok(())
    }
}

/// Cuts the log in `dir` after `at` (a group boundary), whose last
/// segment is `last`: removes the later segments, last first, then zeroes
/// `at`'s segment from `at` on, keeping its length, and syncs each step.
/// In that order a crash at any point leaves a prefix of the log as it
/// was: a segment is gone only after every later one, and the groups
/// after `at` in its segment go last. Returns the bytes zeroed in `at`'s
/// segment.
pub(crate) fn cut_after(dir: &Path, at: Position, last: u32) -> Result<u64, StoreError> {
    for id in (at.segment + 1..=last).rev() {
        let path = segment_path(dir, id);
        std::fs::remove_file(&path).map_err(|e| io(&path, "removing", e))?;
        sync_dir(dir)?;
    }
    let path = segment_path(dir, at.segment);
    let f = OpenOptions::new()
        .write(true)
        .open(&path)
        .map_err(|e| io(&path, "opening", e))?;
    let size = file_len(&f, &path)?;
    zero_from(&f, at.offset, size, &path, "cutting")?;
    Ok(size.saturating_sub(at.offset))
}

/// Zeroes `file` from `at` to its end, keeping its length `size` (a
/// zero-filled segment stays preallocated), and syncs it.
fn zero_from(file: &File, at: u64, size: u64, path: &Path, what: &str) -> Result<(), StoreError> {
    file.set_len(at)
        .and_then(|()| file.set_len(size))
        .and_then(|()| file.sync_all())
        .map_err(|e| io(path, what, e))
}

/// Adds an event record to `buf`; returns where it lies in `buf`.
pub(crate) fn push_event(
    buf: &mut Vec<u8>,
    partition: PartitionId,
    id: ExecutionId,
    seq: u64,
    value: &[u8],
) -> Loc {
    let start = buf.len();
    buf.push(EVENT);
    buf.extend_from_slice(&partition.get().to_be_bytes());
    buf.extend_from_slice(&(id.get() as u64).to_be_bytes());
    buf.extend_from_slice(&seq.to_be_bytes());
    buf.extend_from_slice(&(value.len() as u32).to_be_bytes());
    buf.extend_from_slice(&crc32fast::hash(value).to_be_bytes());
    buf.extend_from_slice(value);
    Loc {
        segment: 0,
        offset: start as u64,
        len: (buf.len() - start) as u32,
    }
}

/// The value of the event record [`push_event`] put at `loc` in `buf`.
pub(crate) fn event_in(buf: &[u8], loc: Loc) -> Result<&[u8], StoreError> {
    let start = usize::try_from(loc.offset)
        .ok()
        .filter(|s| *s < buf.len())
        .ok_or_else(|| {
            StoreError::Corrupt(format!(
                "offset {} is not in the group being built",
                loc.offset
            ))
        })?;
    match parse_record(buf, start, 0, 0)? {
        (Record::Event { value, .. }, _) => Ok(value),
        _ => Err(StoreError::Corrupt(format!(
            "offset {} of the group being built is not an event",
            loc.offset
        ))),
    }
}

/// Adds a put record to `buf`.
pub(crate) fn push_put(buf: &mut Vec<u8>, keyspace: u8, key: &[u8], value: &[u8]) {
    buf.push(PUT);
    buf.push(keyspace);
    buf.extend_from_slice(&(key.len() as u32).to_be_bytes());
    buf.extend_from_slice(key);
    buf.extend_from_slice(&(value.len() as u32).to_be_bytes());
    buf.extend_from_slice(value);
}

/// The length of an open file.
pub(crate) fn file_len(file: &File, path: &Path) -> Result<u64, StoreError> {
    Ok(file
        .metadata()
        .map_err(|e| io(path, "reading metadata", e))?
        .len())
}

/// The bytes segments `base..segment` of `dir` take, as `Segments` counts
/// them for `disk_bytes` (whole files).
fn bytes_before(dir: &Path, base: u32, segment: u32) -> Result<u64, StoreError> {
    let mut bytes = 0;
    for id in base..segment {
        let path = segment_path(dir, id);
        bytes += std::fs::metadata(&path)
            .map_err(|e| io(&path, "reading metadata", e))?
            .len();
    }
    Ok(bytes)
}

pub(crate) fn segment_path(dir: &Path, segment: u32) -> PathBuf {
    dir.join(format!("{segment:010}.seg"))
}

pub(crate) fn io(path: &Path, what: &str, e: std::io::Error) -> StoreError {
    StoreError::Io(format!("{}: {what}: {e}", path.display()))
}

pub(crate) fn sync_dir(dir: &Path) -> Result<(), StoreError> {
    File::open(dir)
        .and_then(|d| d.sync_all())
        .map_err(|e| io(dir, "syncing the directory", e))
}

/// Creates `dir` and every missing folder above it, each synced into its
/// parent, so that none of them can vanish in a crash after the call.
pub(crate) fn create_dir_durably(dir: &Path) -> Result<(), StoreError> {
    if dir.is_dir() {
        return Ok(());
    }
    let parent = dir
        .parent()
        .filter(|p| !p.as_os_str().is_empty())
        .unwrap_or(Path::new("."));
    create_dir_durably(parent)?;
    match std::fs::create_dir(dir) {
        Ok(()) => {}
        Err(e) if e.kind() == std::io::ErrorKind::AlreadyExists => {}
        Err(e) => return Err(io(dir, "creating", e)),
    }
    sync_dir(parent)
}

/// Creates a new file for reading and writing; an existing one is an
/// error (names are never reused).
fn create_new(path: &Path) -> Result<File, StoreError> {
    OpenOptions::new()
        .read(true)
        .write(true)
        .create_new(true)
        .open(path)
        .map_err(|e| io(path, "creating", e))
}

/// Creates an empty segment (it grows with every group).
fn create_segment(dir: &Path, segment: u32) -> Result<File, StoreError> {
    let file = create_new(&segment_path(dir, segment))?;
    // The new file's name must survive a crash before any group in it is
    // acknowledged.
    sync_dir(dir)?;
    Ok(file)
}

/// A segment is prepared once the current one holds this much (or half of
/// itself, if smaller).
const PREPARE_AFTER_BYTES: u64 = 1024 * 1024;
const PREPARED_SUFFIX: &str = ".prepared";

/// Writes a new segment full of zeros and syncs it, under a name of its
/// own (`<n>.prepared`, never a segment's); [`LogWriter::rotate`] renames
/// it into place. A group written over zeros changes neither the file's
/// size nor its block map, so its `fdatasync` writes the data alone: at
/// one client that made appends 10-20% faster than on a file growing with
/// every group (a sparse or `fallocate`d file cost more CPU per write on
/// this kernel than either; BENCHMARKS.md).
fn prepare_segment(dir: &Path, bytes: u64) -> Result<(PathBuf, File), StoreError> {
    static NEXT: AtomicU64 = AtomicU64::new(0);
    crate::priority::lower_own_priority(10);
    let unique = format!(
        "{}-{}{PREPARED_SUFFIX}",
        std::process::id(),
        NEXT.fetch_add(1, Ordering::Relaxed)
    );
    // Zero-filling takes the segment's size of disk at once, ahead of
    // need; with less free than twice that, it would be the log's own
    // next writes that find the disk full. Then the next segment grows.
    if let Some(free) = free_bytes(dir) {
        if free < bytes.saturating_mul(2) {
            return Err(StoreError::Io(format!(
                "{}: {free} bytes free, under twice the segment size ({bytes}): not zero-filling ahead",
                dir.display()
            )));
        }
    }
    let path = dir.join(unique);
    let file = create_new(&path)?;
    // Synced a quarter MiB at a time: one flush of 64 MiB would hold the
    // disk for a fifth of a second, and the appends' fsyncs with it.
    let zeros = vec![0u8; 256 * 1024];
    let mut at = 0;
    let filled = (|| {
        while at < bytes {
            let n = (bytes - at).min(zeros.len() as u64) as usize;
            file.write_all_at(&zeros[..n], at)
                .and_then(|()| file.sync_data())
                .map_err(|e| io(&path, "zero-filling", e))?;
            at += n as u64;
        }
        file.sync_all().map_err(|e| io(&path, "syncing", e))
    })();
    if let Err(e) = filled {
        // A full disk: give the space back to the log's own writes (the
        // writer then uses an empty segment that grows).
        let _ = std::fs::remove_file(&path);
        return Err(e);
    }
    Ok((path, file))
}

/// Bytes an unprivileged writer may still take on the filesystem of
/// `dir`, if the system says.
#[cfg(target_os = "linux")]
fn free_bytes(dir: &Path) -> Option<u64> {
    use std::os::unix::ffi::OsStrExt;
    let path = std::ffi::CString::new(dir.as_os_str().as_bytes()).ok()?;
    // SAFETY: statvfs writes only into the struct we pass; `path` is a
    // valid NUL-terminated string for the call's duration.
    unsafe {
        let mut st: libc::statvfs = std::mem::zeroed();
        if libc::statvfs(path.as_ptr(), &mut st) != 0 {
            return None;
        }
        Some((st.f_bavail as u64).saturating_mul(st.f_frsize as u64))
    }
}

#[cfg(not(target_os = "linux"))]
fn free_bytes(_dir: &Path) -> Option<u64> {
    None
}

/// The segment ids in `dir`, in order; they must run from `base` without
/// gaps. Removes the zero-filled files a stopped process left unused.
fn list_segments(dir: &Path, base: u32) -> Result<Vec<u32>, StoreError> {
    list_segments_and(dir, base, true)
}

/// [`list_segments`], changing nothing.
pub(crate) fn list_segments_read_only(dir: &Path, base: u32) -> Result<Vec<u32>, StoreError> {
    list_segments_and(dir, base, false)
}

fn list_segments_and(dir: &Path, base: u32, remove_prepared: bool) -> Result<Vec<u32>, StoreError> {
    let mut ids = Vec::new();
    for entry in std::fs::read_dir(dir).map_err(|e| io(dir, "listing", e))? {
        let entry = entry.map_err(|e| io(dir, "listing", e))?;
        let name = entry.file_name();
        if name.to_str().is_some_and(|n| n.ends_with(PREPARED_SUFFIX)) {
            if !remove_prepared {
                continue;
            }
            // Being zero-filled when the process stopped.
            std::fs::remove_file(entry.path()).map_err(|e| io(&entry.path(), "removing", e))?;
            continue;
        }
        let Some(stem) = name.to_str().and_then(|n| n.strip_suffix(".seg")) else {
            continue;
        };
        let id = stem.parse::<u32>().map_err(|_| {
            StoreError::Corrupt(format!(
                "{}: unexpected segment file {stem}.seg",
                dir.display()
            ))
        })?;
        ids.push(id);
    }
    ids.sort_unstable();
    if let Some((i, id)) = ids
        .iter()
        .enumerate()
        .find(|(i, id)| u64::from(**id) != u64::from(base) + *i as u64)
    {
        return Err(StoreError::Corrupt(format!(
            "{}: segment {} is missing (found {id})",
            dir.display(),
            u64::from(base) + i as u64
        )));
    }
    Ok(ids)
}

/// What the segments in `dir` hold, if the folder exists: how many there
/// are and the first byte written in any of them (a segment that holds
/// nothing is empty or all zeros).
pub(crate) fn written(dir: &Path) -> Result<(usize, Option<Position>), StoreError> {
    if !dir.exists() {
        return Ok((0, None));
    }
    let ids = list_segments(dir, 0)?;
    for &id in &ids {
        let path = segment_path(dir, id);
        let f = File::open(&path).map_err(|e| io(&path, "opening", e))?;
        let size = file_len(&f, &path)?;
        if let Some(offset) = first_non_zero(&f, 0, size, &path)? {
            return Ok((
                ids.len(),
                Some(Position {
                    segment: id,
                    offset,
                }),
            ));
        }
    }
    Ok((ids.len(), None))
}

/// Removes every segment. Used only while moving a shard written before
/// the log into it, when every event in the log is a copy of one the old
/// keyspace still holds (see [`crate::shard`]).
pub(crate) fn remove_all(dir: &Path) -> Result<(), StoreError> {
    match std::fs::remove_dir_all(dir) {
        Ok(()) => Ok(()),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(()),
        Err(e) => Err(io(dir, "removing", e)),
    }
}

/// Opens the log in `dir` (creating it if absent), calls `apply` on every
/// record after `from` in order, cuts off a torn last group, and returns
/// the writer positioned at the end.
pub(crate) fn open(
    dir: &Path,
    from: Position,
    segment_bytes: u64,
    mut apply: impl FnMut(Record<'_>) -> Result<(), StoreError>,
) -> Result<LogWriter, StoreError> {
    open_groups(dir, 0, from, segment_bytes, |group| {
        for record in group.records() {
            apply(record?)?;
        }
        Ok(())
    })
}

/// [`open`], handing over whole groups (a node log's rounds, whose
/// payload is parts of many groups' records: `node_log.rs`), for a log
/// whose segments are numbered from `base`.
pub(crate) fn open_groups(
    dir: &Path,
    base: u32,
    from: Position,
    segment_bytes: u64,
    mut visit: impl FnMut(&GroupRead<'_>) -> Result<(), StoreError>,
) -> Result<LogWriter, StoreError> {
    create_dir_durably(dir)?;
    let ids = list_segments(dir, base)?;
    let start = Position {
        segment: base,
        offset: 0,
    };
    if ids.is_empty() {
        if from != start {
            return Err(StoreError::Corrupt(format!(
                "{}: the checkpoint is at {}:{} but there are no segments",
                dir.display(),
                from.segment,
                from.offset
            )));
        }
        drop(create_segment(dir, base)?);
    }
    let last = base + ids.len().saturating_sub(1) as u32;
    if from.segment < base || from.segment > last {
        return Err(StoreError::Corrupt(format!(
            "{}: the checkpoint is in segment {} but the segments are {base} to {last}",
            dir.display(),
            from.segment
        )));
    }
    let mut bytes = bytes_before(dir, base, from.segment)?;
    let mut end = 0;
    let mut payload = Vec::new();
    let mut file = None;
    let mut zeroed = false;
    for segment in from.segment..=last {
        let path = segment_path(dir, segment);
        let f = OpenOptions::new()
            .read(true)
            .write(segment == last)
            .open(&path)
            .map_err(|e| io(&path, "opening", e))?;
        let size = file_len(&f, &path)?;
        let mut at = if segment == from.segment {
            from.offset
        } else {
            0
        };
        if at > size {
            return Err(StoreError::Corrupt(format!(
                "{}: the checkpoint is at offset {at} but the segment has {size} bytes",
                path.display()
            )));
        }
        while at < size {
            match read_group(&f, at, size, &mut payload, &path)? {
                Group::End => break,
                Group::Whole(len) => {
                    visit(&GroupRead::whole(segment, at, len, &payload))?;
                    at += len;
                }
                Group::Bad if segment == last => {
                    if let Some(why) = written_after_bad_group(&f, at, size, &path)? {
                        return Err(StoreError::Corrupt(format!(
                            "{}: segment {segment}, offset {at}: a bad group ({why}); \
                             acknowledged groups may follow it, so it is not cut off",
                            path.display()
                        )));
                    }
                    tracing::warn!(
                        segment = %path.display(),
                        offset = at,
                        "cutting off a torn group at the end of the log (nothing was written after it, so it was never acknowledged)"
                    );
                    zero_from(&f, at, size, &path, "cutting off a torn group")?;
                    break;
                }
                Group::Bad => {
                    return Err(StoreError::Corrupt(format!(
                        "{}: segment {segment}, offset {at} of {size}: a bad group, and later segments follow",
                        path.display()
                    )));
                }
            }
        }
        bytes += at;
        end = at;
        if segment == last {
            // Zeros after its groups: it was zero-filled before use (or
            // a torn group was cut off, which leaves zeros too).
            zeroed = size > at;
            file = Some(Arc::new(f));
        }
    }
    let file = file.ok_or_else(|| io(dir, "opening", std::io::ErrorKind::NotFound.into()))?;
    Ok(LogWriter {
        segments: Arc::new(Segments {
            dir: dir.to_path_buf(),
            base,
            count: AtomicU32::new(last + 1),
            bytes: AtomicU64::new(bytes),
            sync_latency: Latency::default(),
            open: Mutex::new(HashMap::from([(last, file.clone())])),
        }),
        file,
        segment: last,
        len: end,
        segment_bytes: segment_bytes.max(1),
        zeroed,
        next: None,
        buf: Vec::new(),
        failed: false,
        first: start,
        written: 0,
    })
}

/// What lies at a position of a segment.
pub(crate) enum Group {
    /// A whole group, this many bytes long.
    Whole(u64),
    /// Zeros to the end of the file: the end of the segment's groups
    /// (segments are created full of zeros).
    End,
    /// Anything else: a short group, one failing its checksum, or bytes
    /// after a zero header.
    Bad,
}

/// Reads the group at `at` into `payload`.
pub(crate) fn read_group(
    file: &File,
    at: u64,
    size: u64,
    payload: &mut Vec<u8>,
    path: &Path,
) -> Result<Group, StoreError> {
    let mut header = [0u8; GROUP_HEADER];
    let have = (size - at).min(GROUP_HEADER as u64) as usize;
    file.read_exact_at(&mut header[..have], at)
        .map_err(|e| io(path, "reading", e))?;
    if header == [0u8; GROUP_HEADER] {
        // An empty group is never written, so a zero header is the end
        // of the groups if nothing but zeros follows.
        return if zeros_to_end(file, at, size, path)? {
            Ok(Group::End)
        } else {
            Ok(Group::Bad)
        };
    }
    if have < GROUP_HEADER {
        return Ok(Group::Bad);
    }
    let mut r = codec::Reader::new(&header, "log group header");
    let len = u64::from(r.u32()?);
    let crc = r.u32()?;
    if len > GROUP_PAYLOAD_MAX || size - at - (GROUP_HEADER as u64) < len {
        return Ok(Group::Bad);
    }
    payload.clear();
    payload.resize(len as usize, 0);
    file.read_exact_at(payload, at + GROUP_HEADER as u64)
        .map_err(|e| io(path, "reading", e))?;
    if crc32fast::hash(payload) != crc {
        return Ok(Group::Bad);
    }
    Ok(Group::Whole(GROUP_HEADER as u64 + len))
}

/// Why the bad group at `at` of the last segment is not a torn tail, if
/// it is not: a crash can only tear the last group ever written, so
/// anything written after it means acknowledged groups follow and the
/// group was damaged after the fact. Written after it means: a non-zero
/// byte past the group's extent (its header's length, or just the header
/// if that is zero), or a whole, checksummed group where its records stop
/// parsing inside its extent (a length grown by damage swallows the groups
/// after it, which then start right where its real records end).
///
/// A zero header followed by non-zero bytes is therefore damage, never a
/// torn tail: a crash that lost the header's page but kept a later one
/// cannot be told from an acknowledged group whose header was zeroed.
/// Such a shard refuses to open; `forkless store check` shows where, and
/// `--truncate-after` lets an operator who decided to drop the tail cut
/// it.
pub(crate) fn written_after_bad_group(
    file: &File,
    at: u64,
    size: u64,
    path: &Path,
) -> Result<Option<String>, StoreError> {
    let mut header = [0u8; GROUP_HEADER];
    let have = (size - at).min(GROUP_HEADER as u64) as usize;
    file.read_exact_at(&mut header[..have], at)
        .map_err(|e| io(path, "reading", e))?;
    if have < GROUP_HEADER {
        // A header cut short by the end of the file: nothing follows.
        return Ok(None);
    }
    let len = u64::from(u32::from_be_bytes([
        header[0], header[1], header[2], header[3],
    ]));
    let body = at + GROUP_HEADER as u64;
    let extent = if header == [0u8; GROUP_HEADER] {
        body
    } else {
        body.saturating_add(len).min(size)
    };
    if let Some(first) = first_non_zero(file, extent, size, path)? {
        return Ok(Some(format!(
            "data is written at offset {first}, after the group's end at {extent}"
        )));
    }
    // The records of the group, as far as they parse.
    let mut payload = vec![0u8; (extent - body) as usize];
    file.read_exact_at(&mut payload, body)
        .map_err(|e| io(path, "reading", e))?;
    let mut pos = 0;
    while pos < payload.len() {
        match parse_record(&payload, pos, 0, body) {
            Ok((_, used)) => pos += used,
            Err(_) => break,
        }
    }
    let stop = body + pos as u64;
    if stop < extent && whole_group_at(&payload[pos..]) {
        return Ok(Some(format!(
            "its records end at offset {stop}, where a whole group begins: its length was damaged"
        )));
    }
    Ok(None)
}

/// Whether `bytes` begins with a whole group whose checksum holds.
fn whole_group_at(bytes: &[u8]) -> bool {
    if bytes.len() < GROUP_HEADER {
        return false;
    }
    let len = u32::from_be_bytes([bytes[0], bytes[1], bytes[2], bytes[3]]) as usize;
    let crc = u32::from_be_bytes([bytes[4], bytes[5], bytes[6], bytes[7]]);
    len > 0
        && bytes.len() - GROUP_HEADER >= len
        && crc32fast::hash(&bytes[GROUP_HEADER..GROUP_HEADER + len]) == crc
}

/// The offset of the first non-zero byte of `file` in `at..size`.
fn first_non_zero(
    file: &File,
    mut at: u64,
    size: u64,
    path: &Path,
) -> Result<Option<u64>, StoreError> {
    let mut buf = vec![0u8; 1 << 20];
    while at < size {
        let n = (size - at).min(buf.len() as u64) as usize;
        file.read_exact_at(&mut buf[..n], at)
            .map_err(|e| io(path, "reading", e))?;
        if let Some(i) = buf[..n].iter().position(|b| *b != 0) {
            return Ok(Some(at + i as u64));
        }
        at += n as u64;
    }
    Ok(None)
}

/// Whether `file` holds only zero bytes from `at` to `size`.
fn zeros_to_end(file: &File, at: u64, size: u64, path: &Path) -> Result<bool, StoreError> {
    Ok(first_non_zero(file, at, size, path)?.is_none())
}

/// Parses the record at `buf[pos..]`; `base` is the file offset of
/// `buf[0]`. Returns the record and its length. A record that does not
/// parse inside a group whose checksum held is corruption.
pub(crate) fn parse_record(
    buf: &[u8],
    pos: usize,
    segment: u32,
    base: u64,
) -> Result<(Record<'_>, usize), StoreError> {
    let bad = |what: &str| {
        StoreError::Corrupt(format!(
            "log segment {segment}, offset {}: {what}",
            base + pos as u64
        ))
    };
    let rest = &buf[pos..];
    let mut r = codec::Reader::new(rest, "log record");
    let kind = r.u8().map_err(|_| bad("truncated record"))?;
    match kind {
        EVENT => {
            let partition = r.u32().map_err(|_| bad("truncated event"))?;
            let id = r.u64().map_err(|_| bad("truncated event"))?;
            let seq = r.u64().map_err(|_| bad("truncated event"))?;
            let len = r.u32().map_err(|_| bad("truncated event"))? as usize;
            let crc = r.u32().map_err(|_| bad("truncated event"))?;
            debug_assert_eq!(rest.len() - r.remaining(), EVENT_HEADER);
            let value = r.take(len).map_err(|_| bad("truncated event value"))?;
            if crc32fast::hash(value) != crc {
                return Err(bad(&format!("event {id} seq {seq} fails its checksum")));
            }
            let id = ExecutionId::new(id as i64).map_err(|e| bad(&format!("event id: {e}")))?;
            let partition = PartitionId::new(partition)
                .filter(|p| *p == id.partition())
                .ok_or_else(|| bad("event partition does not match its execution"))?;
            let used = rest.len() - r.remaining();
            Ok((
                Record::Event {
                    partition,
                    id,
                    seq,
                    value,
                    loc: Loc {
                        segment,
                        offset: base + pos as u64,
                        len: used as u32,
                    },
                },
                used,
            ))
        }
        PUT => {
            let keyspace = r.u8().map_err(|_| bad("truncated put"))?;
            let klen = r.u32().map_err(|_| bad("truncated put"))? as usize;
            let key = r.take(klen).map_err(|_| bad("truncated put key"))?;
            let vlen = r.u32().map_err(|_| bad("truncated put"))? as usize;
            let value = r.take(vlen).map_err(|_| bad("truncated put value"))?;
            Ok((
                Record::Put {
                    keyspace,
                    key,
                    value,
                },
                rest.len() - r.remaining(),
            ))
        }
        k => Err(bad(&format!("unknown record kind {k}"))),
    }
}
