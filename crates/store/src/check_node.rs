//! The offline check of a data directory whose shards write to the node
//! log (`<data>/log/`, `node_log.rs`): the node log's rounds are read
//! once for the cuts and once for every shard's parts, each shard's
//! records are checked as in a shard's own log (continuing from its own
//! log of before, if it has one), and each shard's database against
//! them. A cut (`--truncate-after` at a node-log position) is node-wide:
//! it drops every shard's writes after a round.

use crate::check::{
    check_database, in_own_log, lock_database, own_segments, reconcile, scan_frames, scan_log,
    Frames, LogScan, RaftFound, ShardReport,
};
use crate::log::{GroupRead, Position};
use crate::node_log::{parts, PartRead, SEGMENT_BASE, START};
use crate::shard_log::EventFiles;
use crate::StoreError;
use std::collections::{BTreeMap, HashMap};
use std::fs::File;
use std::path::Path;
use std::sync::Arc;

/// What the check found in the node log itself.
#[derive(Debug, Default)]
pub struct NodeLogReport {
    pub segments: usize,
    pub bytes: u64,
    pub rounds: u64,
    /// The end of the last whole round before any damage: where
    /// `--truncate-after` would cut to drop the damage.
    pub last_good: Option<(u32, u64)>,
    /// A torn last round (what a crash leaves; the next open cuts it).
    pub torn_tail: Option<(u32, u64)>,
    pub problems: Vec<String>,
}

/// One shard, as the check goes.
struct Shard {
    report: ShardReport,
    scan: LogScan,
    /// The segments of its own log of before (0: it has none).
    own_segments: u32,
    own_ends: Option<Position>,
    _lock: Option<File>,
}

/// Everything the check read: the node log's report and rounds, and
/// each shard's.
pub(crate) struct Scanned {
    pub(crate) node: NodeLogReport,
    frames: Frames,
    shards: BTreeMap<u32, Shard>,
    /// Shards with writes in the node log but no folder.
    pub(crate) strays: Vec<u32>,
}

/// Reads every shard's own log (if any) and the node log up to `until`.
/// `None` if a running node holds a shard (then `reports` says which).
pub(crate) fn scan(
    dir: &Path,
    shards: &[u32],
    until: Option<Position>,
    reports: &mut Vec<ShardReport>,
) -> Result<Option<Scanned>, StoreError> {
    let mut held = BTreeMap::new();
    for &s in shards {
        let shard_dir = dir.join("shards").join(s.to_string());
        let mut report = ShardReport {
            shard: s,
            ..ShardReport::default()
        };
        let lock = match lock_database(&shard_dir) {
            Ok(l) => l,
            Err(p) => {
                report.problems.push(p);
                report.in_use = true;
                reports.push(report);
                continue;
            }
        };
        let own_dir = shard_dir.join(crate::shard::LOG_DIR);
        let scan = if own_dir.exists() {
            scan_log(&own_dir, None, &mut report)?
        } else {
            LogScan::default()
        };
        held.insert(
            s,
            Shard {
                own_segments: scan.segments as u32,
                own_ends: scan.event_positions.last().map(|(p, _)| *p),
                report,
                scan,
                _lock: lock,
            },
        );
    }
    if !reports.is_empty() {
        // A node is running on the directory: the node log is live, so
        // no shard of it can be checked.
        for (_, shard) in held {
            let mut r = shard.report;
            r.problems = vec!["not checked: a running node holds other shards of this \
                 directory, and they share the node log"
                .into()];
            r.in_use = true;
            reports.push(r);
        }
        reports.sort_by_key(|r| r.shard);
        return Ok(None);
    }
    let node_dir = dir.join(crate::NODE_LOG_DIR);
    // The cuts first: a part is void if a later cut of its group cut
    // before it (`node_log.rs`).
    let mut cuts: HashMap<u32, Vec<(Position, Position)>> = HashMap::new();
    let mut problems = Vec::new();
    let mut frames = Frames::default();
    scan_frames(
        &node_dir,
        SEGMENT_BASE,
        until,
        &mut frames,
        |segment, at, end, payload| {
            let round = GroupRead::whole(segment, at, end.offset - at, payload);
            for part in parts(&round) {
                match part {
                    Ok((g, _, PartRead::Cut(after))) => {
                        cuts.entry(g).or_default().push((after, end))
                    }
                    Ok(_) => {}
                    Err(e) => {
                        problems.push(e.to_string());
                        return false;
                    }
                }
            }
            true
        },
    )?;
    let mut strays = Vec::new();
    let mut again = Frames::default();
    scan_frames(
        &node_dir,
        SEGMENT_BASE,
        until,
        &mut again,
        |segment, at, end, payload| {
            let round = GroupRead::whole(segment, at, end.offset - at, payload);
            for part in parts(&round) {
                let (g, records_at, records) = match part {
                    Ok((g, records_at, PartRead::Records(records))) => (g, records_at, records),
                    Ok((g, records_at, PartRead::Import(first, records))) => {
                        if let Some(shard) = held.get_mut(&g) {
                            let r = &mut shard.report;
                            match shard
                                .scan
                                .import(r, first, records, segment, at, records_at, end)
                            {
                                Some(events) => {
                                    r.events += events;
                                    r.log_bytes += records.len() as u64;
                                }
                                None => return false,
                            }
                        } else if !strays.contains(&g) {
                            strays.push(g);
                        }
                        continue;
                    }
                    Ok((g, body_at, PartRead::Kept(body))) => {
                        if let Some(shard) = held.get_mut(&g) {
                            let r = &mut shard.report;
                            match shard.scan.kept(r, body, segment, body_at, end) {
                                Some(events) => r.events += events,
                                None => return false,
                            }
                        } else if !strays.contains(&g) {
                            strays.push(g);
                        }
                        continue;
                    }
                    Ok((g, body_at, PartRead::Raft(kind, body))) => {
                        if let Some(shard) = held.get_mut(&g) {
                            if let Err(e) =
                                raft_part(&mut shard.scan, kind, body, segment, body_at, end)
                            {
                                shard.report.problems.push(format!(
                                    "node log segment {segment}, offset {body_at}: group {g}: {e}"
                                ));
                                return false;
                            }
                            shard.report.log_bytes += body.len() as u64;
                        } else if !strays.contains(&g) {
                            strays.push(g);
                        }
                        continue;
                    }
                    _ => continue,
                };
                let void = cuts
                    .get(&g)
                    .is_some_and(|c| c.iter().any(|(after, cut)| *after < end && end < *cut));
                if void {
                    continue;
                }
                let Some(shard) = held.get_mut(&g) else {
                    if !strays.contains(&g) {
                        strays.push(g);
                    }
                    continue;
                };
                let r = &mut shard.report;
                match shard.scan.records(r, records, segment, at, records_at) {
                    Some(events) => {
                        r.events += events;
                        r.groups += 1;
                        r.log_bytes += records.len() as u64;
                        r.last_good = Some((end.segment, end.offset));
                        shard.scan.event_positions.push((end, events));
                    }
                    // Damage inside a whole round: reported for its shard.
                    None => return false,
                }
            }
            true
        },
    )?;
    frames.problems.extend(problems);
    let node = NodeLogReport {
        segments: frames.segments,
        bytes: frames.bytes,
        rounds: frames.frames,
        last_good: frames.last_good,
        torn_tail: frames.torn_tail,
        problems: frames.problems.clone(),
    };
    Ok(Some(Scanned {
        node,
        frames,
        shards: held,
        strays,
    }))
}

/// Takes in one of a Raft shard's parts (an entry or a truncation; a vote
/// says nothing the check looks at), in the node log's order.
fn raft_part(
    scan: &mut LogScan,
    kind: u8,
    body: &[u8],
    segment: u32,
    body_at: u64,
    round_end: Position,
) -> Result<(), String> {
    match kind {
        crate::node_log::ENTRY => {
            let index = crate::raft_log::entry_log_id(body)?.index;
            scan.raft.split_off(&index);
            scan.raft.insert(
                index,
                RaftFound {
                    round_end,
                    segment,
                    body_at,
                    len: body.len() as u32,
                },
            );
        }
        crate::node_log::TRUNCATE => match crate::raft_log::decode_truncate(body)? {
            Some(after) => drop(scan.raft.split_off(&(after + 1))),
            None => scan.raft.clear(),
        },
        _ => {}
    }
    Ok(())
}

/// Checks every shard's database against what the scan read.
pub(crate) fn check_databases(
    dir: &Path,
    scanned: &mut Scanned,
) -> Result<Vec<ShardReport>, StoreError> {
    let node_dir = dir.join(crate::NODE_LOG_DIR);
    let node_segments = Arc::new(crate::log::Segments::read_only(
        &node_dir,
        SEGMENT_BASE,
        SEGMENT_BASE + scanned.frames.segments as u32,
    ));
    // In the order they were read: sorted.
    let rounds = &scanned.frames.ends;
    let mut out = Vec::new();
    for (&s, shard) in scanned.shards.iter_mut() {
        let shard_dir = dir.join("shards").join(s.to_string());
        let own_dir = shard_dir.join(crate::shard::LOG_DIR);
        let own = (shard.own_segments > 0).then(|| own_segments(&own_dir, shard.own_segments));
        let events = EventFiles::new(node_segments.clone(), own);
        let (own_count, own_ends) = (shard.own_segments, shard.own_ends.unwrap_or_default());
        let checkpoint_ok = |c: Position| {
            if c.segment >= SEGMENT_BASE {
                c == START || rounds.binary_search(&c).is_ok()
            } else {
                in_own_log(c, own_ends, own_count)
            }
        };
        shard.report.executions = shard.scan.last.len();
        check_database(
            &shard_dir,
            &events,
            &checkpoint_ok,
            &shard.scan,
            &mut shard.report,
        )?;
        out.push(std::mem::take(&mut shard.report));
    }
    Ok(out)
}

/// Cuts the node log after `at` (the end of a whole round, at or after
/// every shard's checkpoint): zeroes the rest of that segment, removes the
/// later segments, and makes every shard's records and indexes agree with
/// what is left. Returns what it did.
pub(crate) fn truncate_after(
    dir: &Path,
    shards: &[u32],
    at: Position,
) -> Result<String, StoreError> {
    let refuse = |m: String| Err(StoreError::Invalid(m));
    let mut reports = Vec::new();
    let Some(mut scanned) = scan(dir, shards, None, &mut reports)? else {
        return refuse(
            reports
                .into_iter()
                .flat_map(|r| r.problems)
                .collect::<Vec<_>>()
                .join("; "),
        );
    };
    let checked = check_databases(dir, &mut scanned)?;
    for r in &checked {
        match r.checkpoint {
            Some((cs, co)) => {
                let checkpoint = Position {
                    segment: cs,
                    offset: co,
                };
                if at < checkpoint {
                    return refuse(format!(
                        "{}:{} is before shard {}'s checkpoint at {cs}:{co}: its events index covers \
                         the log up to the checkpoint, so the log cannot be cut before it",
                        at.segment, at.offset, r.shard
                    ));
                }
            }
            None => {
                return refuse(format!(
                    "shard {} has no checkpoint to replay from; the log cannot be cut",
                    r.shard
                ))
            }
        }
    }
    let boundary = at == START || at.offset == 0 || scanned.frames.ends.contains(&at);
    if !boundary {
        return refuse(format!(
            "{}:{} is not the end of a whole round of the node log before any damage",
            at.segment, at.offset
        ));
    }
    let node_dir = dir.join(crate::NODE_LOG_DIR);
    let last = SEGMENT_BASE + (scanned.frames.segments as u32).saturating_sub(1);
    if at.segment < SEGMENT_BASE || at.segment > last {
        return refuse(format!("the node log has no segment {}", at.segment));
    }
    // The check's locks go before the cut's read (a lock is per open
    // file, so a second one of this process would find the first).
    drop(scanned);
    let zeroed = crate::log::cut_after(&node_dir, at, last)?;
    let removed = last - at.segment;
    let mut reports = Vec::new();
    let Some(cut) = scan(dir, shards, Some(at), &mut reports)? else {
        return refuse("a node started on the directory during the cut".into());
    };
    // Unlocked, for the databases to open.
    let scans: Vec<(u32, LogScan)> = cut.shards.into_iter().map(|(s, sh)| (s, sh.scan)).collect();
    let mut fixed = Vec::new();
    let node_segments = Arc::new(crate::log::Segments::read_only(
        &node_dir,
        SEGMENT_BASE,
        at.segment + 1,
    ));
    for (s, scan) in &scans {
        let shard_dir = dir.join("shards").join(s.to_string());
        let events = EventFiles::new(node_segments.clone(), None);
        fixed.push(format!(
            "shard {s}: {}",
            reconcile(&shard_dir, scan, &events)?
        ));
    }
    Ok(format!(
        "cut the node log after {}:{} ({zeroed} bytes zeroed in segment {}{}), for every shard; {}",
        at.segment,
        at.offset,
        at.segment,
        if removed == 0 {
            String::new()
        } else {
            format!(", {removed} later segments removed")
        },
        fixed.join("; ")
    ))
}
