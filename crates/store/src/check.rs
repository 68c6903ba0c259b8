//! The offline check of a data directory (`forkless store check`): reads
//! every shard's log, verifies every group's and every event's checksum
//! and every execution's sequence, and checks the events index and the
//! execution records against the log. It changes nothing: the log is
//! opened read-only, and the database is read from a copy (opening fjall
//! recovers its journal, which writes), taken while holding the database's
//! lock so that a running node is never read half-way.
//!
//! [`truncate_after`] is the one change it can make, when an operator has
//! decided to drop a damaged tail: it cuts the shard's log after a whole
//! group at or after its checkpoint.

pub use crate::check_node::NodeLogReport;
use crate::index;
use crate::keyspaces::Keyspaces;
use crate::log::{self, Group, Position, Record};
use crate::shard_log::EventFiles;
use crate::{ExecutionStatus, StoreError};
use fjall::{Database, Readable};
use forkless_types::{ExecutionId, ShardId};
use std::collections::{BTreeMap, HashMap, HashSet};
use std::fs::File;
use std::path::{Path, PathBuf};

/// What the check found in one shard.
#[derive(Debug, Default)]
pub struct ShardReport {
    pub shard: u32,
    pub segments: usize,
    pub log_bytes: u64,
    pub groups: u64,
    pub events: u64,
    pub executions: usize,
    /// The log position the database's checkpoint covers.
    pub checkpoint: Option<(u32, u64)>,
    /// Index entries' events read back from the log and found to match.
    pub indexed_events: u64,
    /// The end of the last whole group before any damage: where
    /// `--truncate-after` would cut to drop the damage.
    pub last_good: Option<(u32, u64)>,
    /// A torn last group (what a crash leaves; the next open cuts it).
    pub torn_tail: Option<(u32, u64)>,
    /// Damage: each a sentence naming where and what.
    pub problems: Vec<String>,
    /// A running node holds the shard: it was not checked.
    pub in_use: bool,
}

/// What the check found in a data directory.
#[derive(Debug, Default)]
pub struct Report {
    pub dir: PathBuf,
    pub shard_count: Option<u32>,
    pub shards: Vec<ShardReport>,
    /// The node log, if the shards write to one.
    pub node_log: Option<NodeLogReport>,
    /// Problems of the directory itself (layout file, folders).
    pub problems: Vec<String>,
}

impl Report {
    pub fn is_healthy(&self) -> bool {
        self.problems.is_empty()
            && self.node_log.as_ref().is_none_or(|n| n.problems.is_empty())
            && self.shards.iter().all(|s| s.problems.is_empty())
    }
}

impl std::fmt::Display for Report {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        writeln!(
            f,
            "data directory {} (shard count {})",
            self.dir.display(),
            self.shard_count
                .map_or("unknown".to_string(), |n| n.to_string())
        )?;
        for p in &self.problems {
            writeln!(f, "  PROBLEM: {p}")?;
        }
        if let Some(n) = &self.node_log {
            writeln!(
                f,
                "node log: {}: {} segments, {} bytes, {} rounds",
                if n.problems.is_empty() {
                    "ok"
                } else {
                    "DAMAGED"
                },
                n.segments,
                n.bytes,
                n.rounds
            )?;
            if let Some((seg, off)) = n.torn_tail {
                writeln!(
                    f,
                    "  note: a torn last round at {seg}:{off} (a crash's unacknowledged write; the next open cuts it)"
                )?;
            }
            for p in &n.problems {
                writeln!(f, "  PROBLEM: {p}")?;
            }
            if let Some((seg, off)) = n.last_good.filter(|_| !n.problems.is_empty()) {
                writeln!(
                    f,
                    "  the last whole round before the damage ends at {seg}:{off} \
                     (`--truncate-after {seg}:{off}` drops everything after it, for every shard)"
                )?;
            }
        }
        for s in &self.shards {
            let state = match (s.in_use, s.problems.is_empty()) {
                (true, _) => "NOT CHECKED",
                (false, true) => "ok",
                (false, false) => "DAMAGED",
            };
            if s.in_use {
                for p in &s.problems {
                    writeln!(f, "shard {}: {state}: {p}", s.shard)?;
                }
                continue;
            }
            if self.node_log.is_some() {
                // Its groups are parts of the node log's rounds; the
                // segments are those of its own log of before, if any.
                let own = match s.segments {
                    0 => String::new(),
                    n => format!(" (with its own log of before, {n} segments)"),
                };
                writeln!(
                    f,
                    "shard {}: {state}: {} groups, {} bytes of log{own}, {} events of {} executions",
                    s.shard, s.groups, s.log_bytes, s.events, s.executions
                )?;
            } else {
                writeln!(
                    f,
                    "shard {}: {state}: {} segments, {} bytes of log, {} groups, {} events of {} executions",
                    s.shard, s.segments, s.log_bytes, s.groups, s.events, s.executions
                )?;
            }
            if let Some((seg, off)) = s.checkpoint {
                writeln!(
                    f,
                    "  checkpoint at {seg}:{off}; {} indexed events read back from the log and matched",
                    s.indexed_events
                )?;
            }
            if let Some((seg, off)) = s.torn_tail {
                writeln!(
                    f,
                    "  note: a torn last group at {seg}:{off} (a crash's unacknowledged write; the next open cuts it)"
                )?;
            }
            for p in &s.problems {
                writeln!(f, "  PROBLEM: {p}")?;
            }
            if !s.problems.is_empty() {
                let cuttable = |at: (u32, u64)| s.checkpoint.is_none_or(|c| at >= c);
                if let Some((seg, off)) = s.last_good.filter(|at| !cuttable(*at)) {
                    writeln!(
                        f,
                        "  the damage is before the checkpoint (the last whole group before it ends at {seg}:{off}): \
                         the log cannot be cut there; restore this shard's folder from a copy"
                    )?;
                }
                if let Some((seg, off)) = s.last_good.filter(|at| cuttable(*at)) {
                    writeln!(
                        f,
                        "  the last whole group before the damage ends at {seg}:{off} \
                         (`--shard {} --truncate-after {seg}:{off}` drops everything after it)",
                        s.shard
                    )?;
                }
            }
        }
        let damaged = self
            .shards
            .iter()
            .filter(|s| !s.in_use && !s.problems.is_empty())
            .count();
        let in_use = self.shards.iter().filter(|s| s.in_use).count();
        if in_use > 0 {
            write!(
                f,
                "{in_use} of {} shards in use by a running node and not checked; {damaged} damaged",
                self.shards.len()
            )
        } else if self.is_healthy() {
            write!(f, "all {} shards ok", self.shards.len())
        } else {
            let node_damaged = self
                .node_log
                .as_ref()
                .is_some_and(|n| !n.problems.is_empty());
            write!(
                f,
                "{}{damaged} of {} shards damaged{}",
                if node_damaged {
                    "the node log is damaged (every shard has writes in it); "
                } else {
                    ""
                },
                self.shards.len(),
                if self.problems.is_empty() {
                    ""
                } else {
                    "; the directory has problems"
                }
            )
        }
    }
}

/// Checks every shard under `dir`.
pub fn check(dir: &Path) -> Result<Report, StoreError> {
    let mut report = Report {
        dir: dir.to_path_buf(),
        ..Report::default()
    };
    match std::fs::read_to_string(dir.join(crate::LAYOUT_FILE)) {
        Ok(text) => match crate::parse_layout(&text) {
            Some(n) => report.shard_count = Some(n),
            None => report
                .problems
                .push("the layout file is unreadable".to_string()),
        },
        Err(e) => report
            .problems
            .push(format!("the layout file cannot be read: {e}")),
    }
    let shards_dir = dir.join("shards");
    let entries = std::fs::read_dir(&shards_dir).map_err(|e| log::io(&shards_dir, "listing", e))?;
    let mut shards = Vec::new();
    for entry in entries {
        let entry = entry.map_err(|e| StoreError::Io(e.to_string()))?;
        let name = entry.file_name();
        match name.to_str().and_then(|n| n.parse::<u32>().ok()) {
            Some(s) => shards.push(s),
            None => report.problems.push(format!(
                "unexpected entry {} in shards/",
                name.to_string_lossy()
            )),
        }
    }
    shards.sort_unstable();
    for &s in &shards {
        if report.shard_count.is_some_and(|n| s >= n) {
            report
                .problems
                .push(format!("shards/{s} is outside the shard count"));
        }
    }
    if dir.join(crate::NODE_LOG_DIR).exists() {
        let mut in_use = Vec::new();
        match crate::check_node::scan(dir, &shards, None, &mut in_use)? {
            None => report.shards = in_use,
            Some(mut scanned) => {
                report.shards = crate::check_node::check_databases(dir, &mut scanned)?;
                for g in &scanned.strays {
                    report.problems.push(format!(
                        "the node log holds writes of shard {g}, which has no folder in shards/"
                    ));
                }
                report.node_log = Some(scanned.node);
            }
        }
        return Ok(report);
    }
    for s in shards {
        report
            .shards
            .push(check_shard(&shards_dir.join(s.to_string()), s)?);
    }
    Ok(report)
}

/// The lock a running node holds on the shard's database.
pub(crate) fn lock_database(shard_dir: &Path) -> Result<Option<File>, String> {
    let path = shard_dir.join("lock");
    let file = match File::open(&path) {
        Ok(f) => f,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(None),
        Err(e) => return Err(format!("{}: {e}", path.display())),
    };
    match file.try_lock() {
        Ok(()) => Ok(Some(file)),
        Err(std::fs::TryLockError::WouldBlock) => Err(format!(
            "{} is locked: a forkless node is running on this data directory (stop it first; the check reads a stopped node's folder)",
            shard_dir.display()
        )),
        Err(std::fs::TryLockError::Error(e)) => Err(format!("{}: {e}", path.display())),
    }
}

fn check_shard(shard_dir: &Path, shard: u32) -> Result<ShardReport, StoreError> {
    Ok(check_shard_and_scan(shard_dir, shard)?.0)
}

/// [`check_shard`], with the scan of the log it made.
fn check_shard_and_scan(
    shard_dir: &Path,
    shard: u32,
) -> Result<(ShardReport, LogScan), StoreError> {
    let mut r = ShardReport {
        shard,
        ..ShardReport::default()
    };
    let _lock = match lock_database(shard_dir) {
        Ok(l) => l,
        Err(p) => {
            r.problems.push(p);
            r.in_use = true;
            return Ok((r, LogScan::default()));
        }
    };
    let log_dir = shard_dir.join(crate::shard::LOG_DIR);
    let scan = scan_log(&log_dir, None, &mut r)?;
    r.executions = scan.last.len();
    let segments = scan.segments as u32;
    let events = EventFiles::new(own_segments(&log_dir, segments), None);
    let ends = scan
        .event_positions
        .last()
        .map(|(p, _)| *p)
        .unwrap_or_default();
    let checkpoint_ok = |c: Position| in_own_log(c, ends, segments);
    check_database(shard_dir, &events, &checkpoint_ok, &scan, &mut r)?;
    Ok((r, scan))
}

/// The `segments` segments of a shard's own log, for reading.
pub(crate) fn own_segments(log_dir: &Path, segments: u32) -> std::sync::Arc<log::Segments> {
    std::sync::Arc::new(log::Segments::read_only(log_dir, 0, segments))
}

/// Whether a checkpoint names a place in a shard's own log, whose whole
/// groups end at `ends` and which has `segments` segments: the end of a
/// group, or the start of a segment.
pub(crate) fn in_own_log(checkpoint: Position, ends: Position, segments: u32) -> bool {
    checkpoint <= ends || (checkpoint.offset == 0 && checkpoint.segment < segments)
}

/// Where one of a Raft shard's entries lies in the node log.
#[derive(Debug, Clone, Copy)]
pub(crate) struct RaftFound {
    /// The end of its round.
    pub(crate) round_end: Position,
    pub(crate) segment: u32,
    pub(crate) body_at: u64,
    pub(crate) len: u32,
}

/// What a scan of a shard's log found, up to where it stopped.
#[derive(Default, Clone)]
pub(crate) struct LogScan {
    pub(crate) segments: usize,
    /// Each execution's last event: its seq and the status it leaves the
    /// execution in.
    pub(crate) last: HashMap<ExecutionId, (u64, ExecutionStatus)>,
    /// The end of each whole group and the events it holds.
    pub(crate) event_positions: Vec<(Position, u64)>,
    /// Executions whose record a put in the log writes (a replay puts them
    /// back into the database even if it lost them).
    records: HashSet<ExecutionId>,
    /// A Raft shard's entries, by index, as the node log's order leaves
    /// them: an entry at an index voids what the group wrote at and after
    /// it, and a truncation what follows its index (`raft_log.rs`).
    pub(crate) raft: BTreeMap<u64, RaftFound>,
    /// The events the last snapshot installed imported (`snapshot.rs`),
    /// and the end of the last round holding them: all indexed by the
    /// install, wherever they lie.
    pub(crate) imported: u64,
    pub(crate) import_end: Option<Position>,
}

impl LogScan {
    /// Takes in a part of a snapshot's imported events, in the round that
    /// ends at `end`; the first part of an install starts the shard's
    /// history again (the snapshot replaced what it had).
    #[allow(clippy::too_many_arguments)]
    pub(crate) fn import(
        &mut self,
        r: &mut ShardReport,
        first: bool,
        payload: &[u8],
        segment: u32,
        at: u64,
        payload_at: u64,
        end: Position,
    ) -> Option<u64> {
        if first {
            // What the shard held before (its groups' events, an earlier
            // install's imports) is superseded: not counted either.
            let superseded =
                self.event_positions.iter().map(|(_, n)| n).sum::<u64>() + self.imported;
            r.events = r.events.saturating_sub(superseded);
            self.last.clear();
            self.records.clear();
            self.event_positions.clear();
            self.imported = 0;
        }
        let events = self.records(r, payload, segment, at, payload_at)?;
        self.imported += events;
        self.import_end = Some(end);
        Some(events)
    }

    /// Takes in a part naming runs of events an install found held
    /// already (`node_log.rs`, kind 10), in the round that ends at `end`:
    /// they count as the install's, in order with its imports (where they
    /// lie is the events index's, checked with it). Returns the events
    /// they are, or `None` after recording a malformed part.
    pub(crate) fn kept(
        &mut self,
        r: &mut ShardReport,
        body: &[u8],
        segment: u32,
        at: u64,
        end: Position,
    ) -> Option<u64> {
        let runs = match crate::node_log::kept_runs(body) {
            Ok(runs) => runs,
            Err(e) => {
                r.problems
                    .push(format!("node log segment {segment}, offset {at}: {e}"));
                return None;
            }
        };
        let mut events = 0u64;
        for (id, first, count, status) in runs {
            let last = first + u64::from(count) - 1;
            let prev = self.last.insert(id, (last, status)).map_or(0, |p| p.0);
            if first != prev + 1 {
                r.problems.push(format!(
                    "node log segment {segment}, offset {at}: execution {id}'s kept events {first}..={last} follow event {prev}"
                ));
            }
            events += u64::from(count);
        }
        self.imported += events;
        self.import_end = Some(end);
        Some(events)
    }

    /// Checks the records of one group (a shard's log) or part (the node
    /// log): `payload` starts at `payload_at` of `segment`, in the group
    /// that starts at `at` (for messages). Returns the events it holds, or
    /// `None` after recording a record that does not parse (nothing after
    /// it can be trusted).
    pub(crate) fn records(
        &mut self,
        r: &mut ShardReport,
        payload: &[u8],
        segment: u32,
        at: u64,
        payload_at: u64,
    ) -> Option<u64> {
        let mut pos = 0;
        let mut events = 0u64;
        while pos < payload.len() {
            match log::parse_record(payload, pos, segment, payload_at) {
                Ok((record, used)) => {
                    events += self.record(r, &record, segment, at);
                    pos += used;
                }
                Err(e) => {
                    r.problems.push(e.to_string());
                    r.events += events;
                    return None;
                }
            }
        }
        Some(events)
    }

    /// Takes in one record (of a group or part at `at` of `segment`, for
    /// messages); returns 1 for an event, else 0.
    fn record(&mut self, r: &mut ShardReport, record: &Record<'_>, segment: u32, at: u64) -> u64 {
        match record {
            Record::Put {
                keyspace: crate::keyspaces::keyspace_id::EXECUTIONS,
                key,
                ..
            } => {
                if let Some(id) = key
                    .get(4..)
                    .and_then(|k| crate::codec::decode_execution_id(k, "execution key").ok())
                {
                    self.records.insert(id);
                }
                0
            }
            Record::Event { id, seq, value, .. } => {
                let (id, seq) = (*id, *seq);
                let status = match crate::codec::decode_event(seq, value) {
                    Ok(e) => {
                        crate::terminal_status(&e.event_type).unwrap_or(ExecutionStatus::Running)
                    }
                    Err(e) => {
                        r.problems.push(format!(
                            "segment {segment}, offset {at}: execution {id} event {seq}: {e}"
                        ));
                        ExecutionStatus::Running
                    }
                };
                let prev = self.last.insert(id, (seq, status)).map_or(0, |p| p.0);
                if seq != prev + 1 {
                    r.problems.push(format!(
                        "segment {segment}, offset {at}: execution {id} event {seq} follows event {prev}"
                    ));
                }
                1
            }
            Record::Put { .. } => 0,
        }
    }

    /// Takes in a Raft shard's entries that count (every entry that holds
    /// a proposal and was not refused at its apply, `refused`), in index
    /// order, read from `events`. Returns the events of the entries at or
    /// before `checkpointed` (what the events index must hold) and the end
    /// of the last of their rounds.
    fn raft_entries(
        &mut self,
        r: &mut ShardReport,
        events: &EventFiles,
        checkpointed: Option<u64>,
        installed: Option<u64>,
        refused: &dyn Fn(u64, u64) -> Result<bool, StoreError>,
    ) -> Result<(u64, Option<Position>), StoreError> {
        let mut before = 0;
        let mut end = None;
        let entries: Vec<(u64, RaftFound)> = self.raft.iter().map(|(i, f)| (*i, *f)).collect();
        for (index, found) in entries {
            let body = events.read_at(found.segment, found.body_at, found.len)?;
            let (log_id, payload) = match crate::raft_log::entry_payload(&body) {
                Ok(e) => e,
                Err(e) => {
                    r.problems.push(format!(
                        "node log segment {}, offset {}: entry {index}: {e}",
                        found.segment, found.body_at
                    ));
                    return Ok((before, end));
                }
            };
            if log_id.index != index {
                r.problems.push(format!(
                    "node log segment {}, offset {}: holds entry {}, expected {index}",
                    found.segment, found.body_at, log_id.index
                ));
                return Ok((before, end));
            }
            let Some((payload, payload_at)) = payload else {
                continue;
            };
            // What an installed snapshot holds came with its imports.
            if installed.is_some_and(|i| index <= i) {
                continue;
            }
            if refused(index, log_id.leader_id.term)? {
                continue;
            }
            let mut n = 0;
            let walked = crate::apply::each_item(
                payload,
                found.segment,
                found.body_at + payload_at,
                |item| {
                    if let crate::apply::Item::Record(record) = item {
                        n += self.record(r, &record, found.segment, found.body_at);
                    }
                    Ok(true)
                },
            );
            if let Err(e) = walked {
                r.problems.push(e.to_string());
                return Ok((before, end));
            }
            r.events += n;
            if checkpointed.is_some_and(|c| index <= c) {
                before += n;
                end = Some(found.round_end);
            }
        }
        Ok((before, end))
    }
}

/// What a read of a log's frames (a shard log's groups, the node log's
/// rounds) found, up to where it stopped.
#[derive(Debug, Default)]
pub(crate) struct Frames {
    pub(crate) segments: usize,
    pub(crate) bytes: u64,
    pub(crate) frames: u64,
    pub(crate) last_good: Option<(u32, u64)>,
    pub(crate) torn_tail: Option<(u32, u64)>,
    pub(crate) problems: Vec<String>,
    /// The end of every whole frame, in order.
    pub(crate) ends: Vec<Position>,
}

/// Reads the log in `dir` (segments numbered from `base`) from its start,
/// checking every frame's checksum, up to the first damage (reported in
/// `f`) or `until` (a frame boundary). `visit` gets each whole frame (its
/// segment, its start, its end and its payload) and may stop the read
/// (`false`: what it found is damage it reported).
pub(crate) fn scan_frames(
    dir: &Path,
    base: u32,
    until: Option<Position>,
    f: &mut Frames,
    mut visit: impl FnMut(u32, u64, Position, &[u8]) -> bool,
) -> Result<(), StoreError> {
    let ids = match log::list_segments_read_only(dir, base) {
        Ok(ids) => ids,
        Err(e) => {
            f.problems.push(e.to_string());
            Vec::new()
        }
    };
    f.segments = ids.len();
    let mut payload = Vec::new();
    'segments: for &segment in &ids {
        let path = log::segment_path(dir, segment);
        let file = File::open(&path).map_err(|e| log::io(&path, "opening", e))?;
        let size = log::file_len(&file, &path)?;
        let mut at = 0;
        while at < size {
            if until.is_some_and(|u| {
                Position {
                    segment,
                    offset: at,
                } >= u
            }) {
                f.bytes += at;
                break 'segments;
            }
            match log::read_group(&file, at, size, &mut payload, &path)? {
                Group::End => break,
                Group::Whole(len) => {
                    let end = Position {
                        segment,
                        offset: at + len,
                    };
                    if !visit(segment, at, end, &payload) {
                        f.bytes += at;
                        break 'segments;
                    }
                    f.frames += 1;
                    at += len;
                    f.last_good = Some((segment, at));
                    f.ends.push(end);
                }
                Group::Bad => {
                    let last = Some(&segment) == ids.last();
                    match last
                        .then(|| log::written_after_bad_group(&file, at, size, &path))
                        .transpose()?
                    {
                        Some(None) => f.torn_tail = Some((segment, at)),
                        Some(Some(why)) => f.problems.push(format!(
                            "segment {segment}, offset {at}: a bad group ({why}); not checked past it"
                        )),
                        None => f.problems.push(format!(
                            "segment {segment}, offset {at}: a bad group, and later segments follow; not checked past it"
                        )),
                    }
                    f.bytes += at;
                    break 'segments;
                }
            }
        }
        f.bytes += at;
        if f.last_good.is_none_or(|(s, _)| s != segment) {
            // A segment with no group still counts as a place to cut.
            f.last_good = Some((segment, 0));
        }
    }
    Ok(())
}

/// Reads a shard's own log from its start, checking every group and
/// record, up to the first damage (reported in `r`) or `until` (a group
/// boundary).
pub(crate) fn scan_log(
    log_dir: &Path,
    until: Option<Position>,
    r: &mut ShardReport,
) -> Result<LogScan, StoreError> {
    let mut scan = LogScan::default();
    let mut frames = Frames::default();
    scan_frames(
        log_dir,
        0,
        until,
        &mut frames,
        |segment, at, end, payload| match scan.records(r, payload, segment, at, at + 8) {
            Some(events) => {
                r.events += events;
                scan.event_positions.push((end, events));
                true
            }
            None => false,
        },
    )?;
    scan.segments = frames.segments;
    r.segments = frames.segments;
    r.log_bytes += frames.bytes;
    r.groups += frames.frames;
    r.last_good = frames.last_good;
    r.torn_tail = frames.torn_tail;
    r.problems.extend(frames.problems);
    Ok(scan)
}

/// Reads a copy of the shard's database and checks it against the log:
/// `events` reads the log's events back, and `checkpoint_ok` says whether
/// a checkpoint names a place in the log.
pub(crate) fn check_database(
    shard_dir: &Path,
    events: &EventFiles,
    checkpoint_ok: &dyn Fn(Position) -> bool,
    log: &LogScan,
    r: &mut ShardReport,
) -> Result<(), StoreError> {
    let copy = tempfile::Builder::new()
        .prefix("forkless-check-")
        .tempdir()
        .map_err(|e| log::io(&std::env::temp_dir(), "creating a folder for the copy", e))?;
    copy_tree(shard_dir, copy.path(), true)?;
    let db = match Database::builder(copy.path()).open() {
        Ok(db) => db,
        Err(e) => {
            r.problems.push(format!("the database does not open: {e}"));
            return Ok(());
        }
    };
    let ks = Keyspaces::open(db)?;
    let checkpoint = match ks.meta.get(index::CHECKPOINT_KEY)? {
        Some(v) => match Position::decode(&v) {
            Ok(p) => p,
            Err(e) => {
                r.problems.push(e.to_string());
                return Ok(());
            }
        },
        None => {
            if r.groups > 0 {
                r.problems.push(
                    "the database has no checkpoint of the log, but the log holds groups (the database was lost or damaged)".into(),
                );
            }
            return Ok(());
        }
    };
    r.checkpoint = Some((checkpoint.segment, checkpoint.offset));
    // A Raft shard's entries: the events index holds those applied as of
    // its checkpoint, whatever round they lie in.
    let mut scanned = log.clone();
    let (raft_before, raft_end) = if log.raft.is_empty() {
        (0, None)
    } else {
        let (checkpointed, _) = crate::raft_group::checkpointed(&ks)?;
        let refused = |index: u64, term: u64| -> Result<bool, StoreError> {
            Ok(ks
                .meta
                .get(crate::apply::refused_key(index, term))?
                .is_some())
        };
        let installed = crate::snapshot::imported(&ks)?;
        let found = scanned.raft_entries(
            r,
            events,
            checkpointed.map(|c| c.index),
            installed,
            &refused,
        )?;
        r.executions = scanned.last.len();
        found
    };
    let log = &scanned;
    let (log_last_seq, event_positions) = (&log.last, &log.event_positions);
    if !checkpoint_ok(checkpoint) {
        let ends = event_positions.last().map(|(p, _)| *p).unwrap_or_default();
        r.problems.push(format!(
            "the checkpoint is at {}:{}, which is not a place in the log (its whole groups end at {}:{})",
            checkpoint.segment, checkpoint.offset, ends.segment, ends.offset
        ));
    }
    // Events in the log before the checkpoint: what the index must hold.
    let before: u64 = event_positions
        .iter()
        .filter(|(end, _)| *end <= checkpoint)
        .map(|(_, n)| n)
        .sum::<u64>()
        + raft_before
        + log.imported;
    // Indexed events lie before the checkpoint, or in a Raft entry
    // applied as of it, or among a snapshot's imports.
    let indexed_through = raft_end
        .map_or(checkpoint, |e| e.max(checkpoint))
        .max(log.import_end.unwrap_or_default());
    let snap = ks.db.snapshot();
    let mut indexed_last: BTreeMap<ExecutionId, u64> = BTreeMap::new();
    let mut index_problems = 0usize;
    for item in snap.iter(&ks.event_index) {
        let (k, v) = item.into_inner()?;
        let (id, first_seq, locs) = match index::decode_entry_public(&k, &v) {
            Ok(e) => e,
            Err(e) => {
                r.problems.push(format!("events index: {e}"));
                index_problems += 1;
                continue;
            }
        };
        let prev = indexed_last.get(&id).copied().unwrap_or(0);
        if first_seq != prev + 1 {
            r.problems.push(format!(
                "events index: execution {id}'s entry starts at seq {first_seq} after seq {prev}"
            ));
            index_problems += 1;
        }
        for (i, loc) in locs.iter().enumerate() {
            let seq = first_seq + i as u64;
            let end = Position {
                segment: loc.segment,
                offset: loc.offset + u64::from(loc.len),
            };
            if end > indexed_through {
                r.problems.push(format!(
                    "events index: execution {id} seq {seq} lies at {}:{}, after the checkpoint",
                    loc.segment, loc.offset
                ));
                index_problems += 1;
            } else if let Err(e) = events.read_event(*loc, id, seq) {
                r.problems.push(format!("events index: {e}"));
                index_problems += 1;
            } else {
                r.indexed_events += 1;
            }
            if index_problems > 20 {
                r.problems
                    .push("events index: more problems not listed".into());
                return Ok(());
            }
        }
        indexed_last.insert(id, first_seq + locs.len() as u64 - 1);
    }
    if r.problems.is_empty() && r.indexed_events != before {
        r.problems.push(format!(
            "events index: {} events indexed but the log holds {before} before the checkpoint",
            r.indexed_events
        ));
    }
    // Every execution record has its events in the log, and every
    // execution in the log has a record.
    let mut records: HashSet<ExecutionId> = log.records.clone();
    for item in snap.iter(&ks.executions) {
        let k = item.key()?;
        let Ok(id) = crate::codec::decode_execution_id(&k[4.min(k.len())..], "execution key")
        else {
            r.problems.push("executions: a malformed key".into());
            continue;
        };
        records.insert(id);
        if !log_last_seq.contains_key(&id) && r.problems.is_empty() {
            r.problems.push(format!(
                "execution {id} has a record but no events in the log"
            ));
        }
    }
    if r.problems.is_empty() {
        if let Some(id) = log_last_seq.keys().find(|id| !records.contains(id)) {
            r.problems.push(format!(
                "execution {id} has events in the log but no record (of {} with events, {} have records)",
                log_last_seq.len(),
                records.len()
            ));
        }
    }
    Ok(())
}

/// Copies the shard's database files (all but its log).
fn copy_tree(from: &Path, to: &Path, top: bool) -> Result<(), StoreError> {
    std::fs::create_dir_all(to).map_err(|e| log::io(to, "creating", e))?;
    for entry in std::fs::read_dir(from).map_err(|e| log::io(from, "listing", e))? {
        let entry = entry.map_err(|e| log::io(from, "listing", e))?;
        let name = entry.file_name();
        if top && name == crate::shard::LOG_DIR {
            continue;
        }
        let src = entry.path();
        let dst = to.join(&name);
        if entry
            .file_type()
            .map_err(|e| log::io(&src, "reading", e))?
            .is_dir()
        {
            copy_tree(&src, &dst, false)?;
        } else {
            std::fs::copy(&src, &dst).map_err(|e| log::io(&src, "copying", e))?;
        }
    }
    Ok(())
}

/// Whether a cut in `segment` is a cut of the node log, which every
/// shard writes to (then [`truncate_after`]'s shard is not used).
pub fn cuts_every_shard(segment: u32) -> bool {
    segment >= crate::node_log::SEGMENT_BASE
}

/// Cuts shard `shard`'s log after `at` (the end of a whole group, at or
/// after the database's checkpoint): zeroes the rest of that segment,
/// removes the segments after it, and makes the database's records and
/// indexes agree with the log that is left ([`reconcile`]). The next open
/// replays the log from the checkpoint to the cut. Refuses anything else,
/// and a running node. Returns what it did.
pub fn truncate_after(dir: &Path, shard: ShardId, at: (u32, u64)) -> Result<String, StoreError> {
    if cuts_every_shard(at.0) {
        let mut shards: Vec<u32> = std::fs::read_dir(dir.join("shards"))
            .map_err(|e| log::io(&dir.join("shards"), "listing", e))?
            .filter_map(|e| e.ok()?.file_name().to_str()?.parse().ok())
            .collect();
        shards.sort_unstable();
        let at = Position {
            segment: at.0,
            offset: at.1,
        };
        return crate::check_node::truncate_after(dir, &shards, at);
    }
    let shard_dir = dir.join("shards").join(shard.get().to_string());
    let refuse = |m: String| Err(StoreError::Invalid(m));
    let (report, scan) = check_shard_and_scan(&shard_dir, shard.get())?;
    if report.in_use {
        return refuse(report.problems.join("; "));
    }
    let cut = Position {
        segment: at.0,
        offset: at.1,
    };
    let Some((cs, co)) = report.checkpoint else {
        return refuse(format!(
            "shard {shard} has no checkpoint to replay from; the log cannot be cut"
        ));
    };
    let checkpoint = Position {
        segment: cs,
        offset: co,
    };
    if cut < checkpoint {
        return refuse(format!(
            "{}:{} is before the checkpoint at {cs}:{co}: the events index covers the log up to \
             the checkpoint, so the log cannot be cut before it",
            at.0, at.1
        ));
    }
    // The cut must be the end of a whole group found by the check (or the
    // start of a segment).
    let log_dir = shard_dir.join(crate::shard::LOG_DIR);
    if at.1 != 0 && !scan.event_positions.iter().any(|(end, _)| *end == cut) {
        return refuse(format!(
            "{}:{} is not the end of a whole group of segment {} before any damage",
            at.0, at.1, at.0
        ));
    }
    let ids = log::list_segments_read_only(&log_dir, 0)?;
    if !ids.contains(&at.0) {
        return refuse(format!("shard {shard} has no segment {}", at.0));
    }
    let last = ids.last().copied().unwrap_or(at.0);
    let zeroed = log::cut_after(&log_dir, cut, last)?;
    let removed = last - at.0;
    // The database may hold what the dropped groups wrote (fjall applied
    // their puts after they were durable in the log): make it agree with
    // the log that is left.
    let mut scratch = ShardReport::default();
    let scan = scan_log(&log_dir, Some(cut), &mut scratch)?;
    let events = EventFiles::new(own_segments(&log_dir, scan.segments as u32), None);
    let fixed = reconcile(&shard_dir, &scan, &events)?;
    Ok(format!(
        "shard {shard}: cut the log after {}:{} ({zeroed} bytes zeroed in segment {}{}); {fixed}",
        at.0,
        at.1,
        at.0,
        if removed == 0 {
            String::new()
        } else {
            format!(", {removed} later segments removed")
        }
    ))
}

/// What [`reconcile`] changed.
#[derive(Debug, Default)]
pub(crate) struct Reconciled {
    records_removed: usize,
    records_reopened: usize,
    index_entries_removed: usize,
    /// A Raft shard's applied entries that the cut dropped.
    entries_unapplied: u64,
}

impl std::fmt::Display for Reconciled {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "the database now agrees with the log: {} execution records of executions that no longer have events removed, {} records of executions whose closing event was dropped reopened, {} idempotency and routing-key entries naming dropped events removed",
            self.records_removed, self.records_reopened, self.index_entries_removed
        )?;
        if self.entries_unapplied > 0 {
            write!(
                f,
                ", {} applied entries of its Raft group dropped",
                self.entries_unapplied
            )?;
        }
        Ok(())
    }
}

/// Makes the shard's records and indexes agree with its log as scanned:
/// a record of an execution with no events left is removed (its start
/// was dropped), and so are its routing-key and start idempotency entries;
/// a record whose status its last event left does not say is given that
/// status; an event idempotency entry naming a seq past its execution's
/// last is removed. The next open replays the log from the checkpoint to
/// the cut, which agrees with all of this.
/// A Raft shard's entries are read through `events` (the node log).
pub(crate) fn reconcile(
    shard_dir: &Path,
    scan: &LogScan,
    events: &EventFiles,
) -> Result<Reconciled, StoreError> {
    use crate::codec;
    let db = Database::builder(shard_dir).open().map_err(|e| match e {
        fjall::Error::Locked => StoreError::InUse(shard_dir.display().to_string()),
        e => StoreError::from(e),
    })?;
    let ks = Keyspaces::open(db)?;
    let mut batch = ks.db.batch().durability(Some(fjall::PersistMode::SyncAll));
    let mut n = Reconciled::default();
    // A Raft shard: what its entries left is the log's word, and the last
    // entry applied is at most the last entry left.
    let mut fed = scan.clone();
    let scan = if scan.raft.is_empty() {
        scan
    } else {
        let refused = |index: u64, term: u64| -> Result<bool, StoreError> {
            Ok(ks
                .meta
                .get(crate::apply::refused_key(index, term))?
                .is_some())
        };
        let mut r = ShardReport::default();
        fed.raft_entries(&mut r, events, None, None, &refused)?;
        if let Some(p) = r.problems.first() {
            return Err(StoreError::Corrupt(p.clone()));
        }
        let (applied, _) = crate::raft_group::applied_state(&ks)?;
        let kept = fed.raft.keys().next_back().copied();
        if let Some(applied) = applied.filter(|a| kept.is_none_or(|k| a.index > k)) {
            // Every entry past the last one left was applied; the last one
            // left was too (entries are applied in order).
            let last = match kept {
                Some(k) => {
                    let found = fed.raft[&k];
                    let body = events.read_at(found.segment, found.body_at, found.len)?;
                    let (log_id, _) = crate::raft_log::entry_payload(&body)
                        .map_err(|e| StoreError::Corrupt(format!("entry {k}: {e}")))?;
                    Some(log_id)
                }
                None => None,
            };
            match last {
                Some(l) => batch.insert(
                    &ks.meta,
                    crate::apply::APPLIED_KEY,
                    crate::apply::applied_value(l.leader_id.term, l.index).to_vec(),
                ),
                None => batch.remove(&ks.meta, crate::apply::APPLIED_KEY),
            }
            n.entries_unapplied = applied.index - kept.unwrap_or(0);
        }
        // Refusals of entries that are gone: the index may be taken again.
        for item in ks.meta.prefix(crate::apply::REFUSED_PREFIX) {
            let k = item.key()?;
            let index = k
                .get(crate::apply::REFUSED_PREFIX.len()..)
                .and_then(|b| b.get(..8))
                .and_then(|b| <[u8; 8]>::try_from(b).ok())
                .map(u64::from_be_bytes);
            if index.is_some_and(|i| kept.is_none_or(|k| i > k)) {
                batch.remove(&ks.meta, k.to_vec());
            }
        }
        &fed
    };
    let Keyspaces {
        executions,
        event_idem,
        routing_keys,
        start_idem,
        db,
        ..
    } = ks;
    let id_at =
        |bytes: Option<&[u8]>| bytes.and_then(|b| codec::decode_execution_id(b, "key").ok());
    for item in executions.iter() {
        let (k, v) = item.into_inner()?;
        let Some(id) = id_at(k.get(4..12)) else {
            continue;
        };
        match scan.last.get(&id) {
            None => {
                batch.remove(&executions, k.to_vec());
                n.records_removed += 1;
            }
            Some((seq, status)) => {
                let mut meta = codec::decode_meta(id, &v, (*seq, 0))?;
                if meta.status != *status {
                    meta.status = *status;
                    batch.insert(&executions, k.to_vec(), codec::encode_meta(&meta));
                    n.records_reopened += 1;
                }
            }
        }
    }
    for item in event_idem.iter() {
        let (k, v) = item.into_inner()?;
        let seq = codec::decode_u64(&v, "event idempotency index").unwrap_or(u64::MAX);
        let live = id_at(k.get(4..12))
            .and_then(|id| scan.last.get(&id))
            .is_some_and(|(last, _)| seq <= *last);
        if !live {
            batch.remove(&event_idem, k.to_vec());
            n.index_entries_removed += 1;
        }
    }
    for item in routing_keys.iter() {
        let k = item.key()?;
        let live = k
            .len()
            .checked_sub(8)
            .and_then(|at| id_at(k.get(at..)))
            .is_some_and(|id| scan.last.contains_key(&id));
        if !live {
            batch.remove(&routing_keys, k.to_vec());
            n.index_entries_removed += 1;
        }
    }
    for item in start_idem.iter() {
        let (k, v) = item.into_inner()?;
        if !id_at(Some(&v)).is_some_and(|id| scan.last.contains_key(&id)) {
            batch.remove(&start_idem, k.to_vec());
            n.index_entries_removed += 1;
        }
    }
    if !batch.is_empty() {
        batch.commit()?;
    }
    db.persist(fjall::PersistMode::SyncAll)?;
    Ok(n)
}
