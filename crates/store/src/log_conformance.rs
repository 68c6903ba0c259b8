//! The conformance suite of [`Log`]: what every implementation must do,
//! written once and run against each (today the per-shard segment log;
//! the node-wide log of `docs/replication.md` next). Each case opens a
//! log in a fresh folder through a [`Harness`], with small segments so
//! that groups cross segment boundaries.

use crate::log::{self, Durable, GroupRead, Log, Position, Record};
use crate::StoreError;
use forkless_types::ExecutionId;
use std::path::Path;
use std::time::Duration;

/// Opens an implementation's log in a folder, afresh or again.
pub(crate) trait Harness {
    type L: Log;
    fn open(&self, dir: &Path, segment_bytes: u64) -> Result<Self::L, StoreError>;
}

/// Small enough that a few groups fill a segment.
const SEGMENT_BYTES: u64 = 2048;
/// How long a case waits for a durability callback.
const DURABLE_WAIT: Duration = Duration::from_secs(10);

/// One record of a group, as the suite writes and expects it.
#[derive(Debug, Clone, PartialEq, Eq)]
enum Rec {
    Event {
        id: i64,
        seq: u64,
        value: Vec<u8>,
    },
    Put {
        keyspace: u8,
        key: Vec<u8>,
        value: Vec<u8>,
    },
}

/// The records of group `n`: an event of its own (about 300 bytes), and
/// a put every third group.
fn group(n: u64) -> Vec<Rec> {
    let mut g = vec![Rec::Event {
        id: 1 + (n % 7) as i64,
        seq: n + 1,
        value: format!("event {n} ").repeat(30).into_bytes(),
    }];
    if n.is_multiple_of(3) {
        g.push(Rec::Put {
            keyspace: 1,
            key: format!("key {n}").into_bytes(),
            value: n.to_be_bytes().to_vec(),
        });
    }
    g
}

fn id(n: i64) -> ExecutionId {
    ExecutionId::new(n).expect("a valid execution id")
}

/// Appends one group and waits until the log says it is durable; then
/// reads each of its events back where the callback says it landed.
fn append<L: Log>(log: &mut L, recs: &[Rec]) -> Result<Durable, StoreError> {
    log.begin()?;
    let mut events = Vec::new();
    for r in recs {
        match r {
            Rec::Event { id: n, seq, value } => {
                let loc = log.event(id(*n).partition(), id(*n), *seq, value);
                assert_eq!(
                    log.pending_event(loc)?,
                    &value[..],
                    "an event added to the group reads back before the append"
                );
                events.push((loc, *n, *seq, value));
            }
            Rec::Put {
                keyspace,
                key,
                value,
            } => log.put(*keyspace, key, value),
        }
    }
    assert!(!log.is_empty() || recs.is_empty());
    let (tx, rx) = std::sync::mpsc::channel();
    log.append(move |made| {
        let _ = tx.send(made);
    });
    let made = rx
        .recv_timeout(DURABLE_WAIT)
        .expect("the durability callback is called");
    assert!(
        rx.recv_timeout(Duration::from_millis(1)).is_err(),
        "the durability callback is called once"
    );
    if let Ok(durable) = &made {
        for (loc, n, seq, value) in events {
            assert_eq!(
                &log.read_event(durable.locate(loc), id(n), seq)?,
                value,
                "event {n}:{seq} where the durability callback placed it"
            );
        }
    }
    made
}

fn records(g: &GroupRead<'_>) -> Result<Vec<Rec>, StoreError> {
    g.records()
        .map(|r| {
            r.map(|r| match r {
                Record::Event { id, seq, value, .. } => Rec::Event {
                    id: id.get(),
                    seq,
                    value: value.to_vec(),
                },
                Record::Put {
                    keyspace,
                    key,
                    value,
                } => Rec::Put {
                    keyspace,
                    key: key.to_vec(),
                    value: value.to_vec(),
                },
            })
        })
        .collect()
}

/// Every group from `from`, with where it starts and ends; each event is
/// read back by the location the read gave it too.
fn read_all<L: Log>(
    log: &L,
    from: Position,
) -> Result<Vec<(Position, Position, Vec<Rec>)>, StoreError> {
    let mut out = Vec::new();
    let mut located = Vec::new();
    log.read(from, |g| {
        for r in g.records() {
            if let Record::Event {
                id,
                seq,
                value,
                loc,
                ..
            } = r?
            {
                located.push((loc, id, seq, value.to_vec()));
            }
        }
        out.push((g.start, g.end, records(g)?));
        Ok(true)
    })?;
    for (loc, id, seq, value) in located {
        assert_eq!(
            log.read_event(loc, id, seq)?,
            value,
            "event {id}:{seq} where a read found it"
        );
    }
    Ok(out)
}

/// Appends groups `0..n` and returns each one's end.
fn fill<L: Log>(log: &mut L, n: u64) -> Result<Vec<Position>, StoreError> {
    (0..n)
        .map(|i| append(log, &group(i)).map(|d| d.end))
        .collect()
}

/// Checks that `log` holds exactly groups `0..n` followed by `extra`,
/// each starting where the one before it ended.
fn assert_holds<L: Log>(log: &L, n: u64, extra: &[Vec<Rec>]) -> Result<(), StoreError> {
    let read = read_all(log, log.first())?;
    let want: Vec<Vec<Rec>> = (0..n).map(group).chain(extra.iter().cloned()).collect();
    let got: Vec<Vec<Rec>> = read.iter().map(|(_, _, r)| r.clone()).collect();
    // Named by their events' seqs first, so that a failure reads short.
    let seqs = |groups: &[Vec<Rec>]| -> Vec<Vec<u64>> {
        groups
            .iter()
            .map(|g| {
                g.iter()
                    .filter_map(|r| match r {
                        Rec::Event { seq, .. } => Some(*seq),
                        Rec::Put { .. } => None,
                    })
                    .collect()
            })
            .collect()
    };
    assert_eq!(seqs(&got), seqs(&want), "the groups' event seqs");
    assert!(got == want, "the groups' records differ");
    for pair in read.windows(2) {
        let (prev_end, next_start) = (pair[0].1, pair[1].0);
        // In order, and apart (other groups' parts, or a part's header,
        // may lie between).
        assert!(next_start >= prev_end, "{prev_end:?} then {next_start:?}");
    }
    if let Some((_, end, _)) = read.last() {
        assert_eq!(*end, log.position());
    }
    Ok(())
}

fn appends_read_back_in_order<H: Harness>(h: &H, dir: &Path) -> Result<(), StoreError> {
    let mut log = h.open(dir, SEGMENT_BYTES)?;
    assert_eq!(read_all(&log, log.first())?, vec![]);
    let ends = fill(&mut log, 40)?;
    assert!(ends.windows(2).all(|w| w[0] < w[1]), "{ends:?}");
    assert!(
        ends.last().is_some_and(|e| e.segment >= 3),
        "the groups span several segments: {ends:?}"
    );
    assert_holds(&log, 40, &[])?;
    // A read from any group boundary starts there.
    let read = read_all(&log, ends[16])?;
    assert_eq!(read.len(), 40 - 17);
    assert_eq!(read[0].2, group(17));
    // A read told to stop, stops.
    let mut seen = 0;
    log.read(log.first(), |_| {
        seen += 1;
        Ok(seen < 5)
    })?;
    assert_eq!(seen, 5);
    Ok(())
}

fn a_reopen_keeps_every_durable_group<H: Harness>(h: &H, dir: &Path) -> Result<(), StoreError> {
    let mut log = h.open(dir, SEGMENT_BYTES)?;
    let ends = fill(&mut log, 25)?;
    // Not closed: dropped, as a crash after the last callback would.
    drop(log);
    let mut log = h.open(dir, SEGMENT_BYTES)?;
    assert_eq!(log.position(), ends[24]);
    assert_holds(&log, 25, &[])?;
    let d = append(&mut log, &group(25))?;
    assert!(d.end > ends[24]);
    drop(log);
    assert_holds(&h.open(dir, SEGMENT_BYTES)?, 26, &[])
}

fn truncate_after_cuts_a_suffix_at_run_time<H: Harness>(
    h: &H,
    dir: &Path,
) -> Result<(), StoreError> {
    let mut log = h.open(dir, SEGMENT_BYTES)?;
    let ends = fill(&mut log, 30)?;
    let cut = ends[11];
    assert!(
        cut.segment < ends[29].segment,
        "the cut drops whole segments too"
    );
    log.truncate_after(cut)?;
    assert_eq!(log.position(), cut);
    assert_holds(&log, 12, &[])?;
    // The next group goes where the cut was, and reads back after it.
    let replacement = vec![Rec::Event {
        id: 3,
        seq: 99,
        value: b"after the cut".to_vec(),
    }];
    let d = append(&mut log, &replacement)?;
    assert!(d.end > cut);
    assert_holds(&log, 12, std::slice::from_ref(&replacement))?;
    // And all of it is what a reopen finds: no cut group comes back.
    drop(log);
    let mut log = h.open(dir, SEGMENT_BYTES)?;
    assert_holds(&log, 12, std::slice::from_ref(&replacement))?;
    // More groups after the cut fill new segments again.
    for i in 0..20 {
        append(&mut log, &group(100 + i))?;
    }
    let extra: Vec<Vec<Rec>> = std::iter::once(replacement)
        .chain((0..20).map(|i| group(100 + i)))
        .collect();
    assert_holds(&log, 12, &extra)?;
    drop(log);
    assert_holds(&h.open(dir, SEGMENT_BYTES)?, 12, &extra)
}

fn truncate_after_the_end_or_the_start<H: Harness>(h: &H, dir: &Path) -> Result<(), StoreError> {
    let mut log = h.open(dir, SEGMENT_BYTES)?;
    let start = log.first();
    let ends = fill(&mut log, 10)?;
    // At the end: nothing changes.
    log.truncate_after(ends[9])?;
    assert_holds(&log, 10, &[])?;
    // At the very start: the log is empty, and takes groups again.
    log.truncate_after(start)?;
    assert_eq!(log.position(), start);
    assert_holds(&log, 0, &[])?;
    fill(&mut log, 3)?;
    assert_holds(&log, 3, &[])?;
    drop(log);
    assert_holds(&h.open(dir, SEGMENT_BYTES)?, 3, &[])
}

fn truncate_after_refuses_what_is_not_a_boundary<H: Harness>(
    h: &H,
    dir: &Path,
) -> Result<(), StoreError> {
    let mut log = h.open(dir, SEGMENT_BYTES)?;
    let ends = fill(&mut log, 12)?;
    let end = log.position();
    let inside = Position {
        segment: ends[5].segment,
        offset: ends[5].offset + 3,
    };
    let past = Position {
        segment: end.segment,
        offset: end.offset + 1,
    };
    let later_segment = Position {
        segment: end.segment + 1,
        offset: 0,
    };
    for at in [inside, past, later_segment] {
        let refused = log.truncate_after(at);
        assert!(
            matches!(refused, Err(StoreError::Invalid(_))),
            "{at:?}: {refused:?}"
        );
        assert_holds(&log, 12, &[])?;
    }
    Ok(())
}

fn purge_before_moves_the_first_position<H: Harness>(h: &H, dir: &Path) -> Result<(), StoreError> {
    let mut log = h.open(dir, SEGMENT_BYTES)?;
    let ends = fill(&mut log, 15)?;
    log.purge_before(ends[4])?;
    assert_eq!(log.first(), ends[4]);
    let read = read_all(&log, log.first())?;
    assert_eq!(read.len(), 10);
    assert_eq!(read[0].2, group(5));
    // Reads before the mark are refused.
    assert!(read_all(&log, Position::default()).is_err());
    // A cut before the mark is refused; at or after it is not.
    assert!(log.truncate_after(ends[2]).is_err());
    log.truncate_after(ends[9])?;
    assert_eq!(read_all(&log, log.first())?.len(), 5);
    // Appends go on as before.
    append(&mut log, &group(10))?;
    assert_eq!(read_all(&log, log.first())?.len(), 6);
    // The mark must be a boundary within the log.
    let inside = Position {
        segment: ends[6].segment,
        offset: ends[6].offset + 1,
    };
    assert!(log.purge_before(inside).is_err());
    assert!(log
        .purge_before(Position {
            segment: log.position().segment + 1,
            offset: 0,
        })
        .is_err());
    assert_eq!(log.first(), ends[4]);
    Ok(())
}

fn a_failed_log_takes_nothing_more<H: Harness>(h: &H, dir: &Path) -> Result<(), StoreError> {
    let mut log = h.open(dir, SEGMENT_BYTES)?;
    let ends = fill(&mut log, 4)?;
    log.fail_stop();
    assert!(append(&mut log, &group(4)).is_err());
    assert!(log.truncate_after(ends[1]).is_err());
    assert_eq!(log.position(), ends[3]);
    drop(log);
    assert_holds(&h.open(dir, SEGMENT_BYTES)?, 4, &[])
}

/// Runs every case against `h`, each in a folder of its own.
pub(crate) fn run<H: Harness>(h: &H) {
    type Case<H> = fn(&H, &Path) -> Result<(), StoreError>;
    let cases: [(&str, Case<H>); 7] = [
        ("appends_read_back_in_order", appends_read_back_in_order),
        (
            "a_reopen_keeps_every_durable_group",
            a_reopen_keeps_every_durable_group,
        ),
        (
            "truncate_after_cuts_a_suffix_at_run_time",
            truncate_after_cuts_a_suffix_at_run_time,
        ),
        (
            "truncate_after_the_end_or_the_start",
            truncate_after_the_end_or_the_start,
        ),
        (
            "truncate_after_refuses_what_is_not_a_boundary",
            truncate_after_refuses_what_is_not_a_boundary,
        ),
        (
            "purge_before_moves_the_first_position",
            purge_before_moves_the_first_position,
        ),
        (
            "a_failed_log_takes_nothing_more",
            a_failed_log_takes_nothing_more,
        ),
    ];
    for (name, case) in cases {
        let dir = tempfile::tempdir().expect("a temporary folder");
        if let Err(e) = case(h, &dir.path().join("log")) {
            panic!("{name}: {e}");
        }
    }
}

/// Today's segment log.
struct SegmentLog;

impl Harness for SegmentLog {
    type L = log::LogWriter;
    fn open(&self, dir: &Path, segment_bytes: u64) -> Result<log::LogWriter, StoreError> {
        log::open(dir, Position::default(), segment_bytes, |_| Ok(()))
    }
}

#[test]
fn the_segment_log_conforms() {
    run(&SegmentLog);
}

/// One group's view of a node log of its own (the node log's cases with
/// many groups are in `node_log.rs`'s tests).
struct NodeLogGroup;

impl Harness for NodeLogGroup {
    type L = crate::node_log::GroupLog;
    fn open(&self, dir: &Path, segment_bytes: u64) -> Result<Self::L, StoreError> {
        Ok(crate::node_log::NodeLog::open(dir, segment_bytes)?.group(7))
    }
}

#[test]
fn a_group_of_the_node_log_conforms() {
    run(&NodeLogGroup);
}

/// A cut interrupted part way (here: the last segment cannot be removed)
/// leaves a prefix of the log, never a log with a hole: the later
/// segments go first, last to first, and `at`'s own segment is cut only
/// after them. Cut in the other order, an interruption would leave the
/// cut segment short while later ones still hold groups, which a reopen
/// would read on from.
#[test]
fn an_interrupted_cut_leaves_a_prefix_of_the_log() {
    let tmp = tempfile::tempdir().expect("a temporary folder");
    let dir = tmp.path().join("log");
    let mut log = SegmentLog.open(&dir, SEGMENT_BYTES).expect("opened");
    let ends = fill(&mut log, 30).expect("appended");
    let last = log.position().segment;
    drop(log);
    let cut = ends[3];
    assert!(cut.segment + 2 <= last, "{cut:?} of {last}");
    // The last segment becomes a folder of that name, which removing a
    // file cannot remove.
    let last_path = log::segment_path(&dir, last);
    let saved = std::fs::read(&last_path).expect("read");
    std::fs::remove_file(&last_path).expect("removed");
    std::fs::create_dir(&last_path).expect("a folder");
    std::fs::write(last_path.join("keep"), b"x").expect("written");
    assert!(log::cut_after(&dir, cut, last).is_err());
    std::fs::remove_dir_all(&last_path).expect("removed");
    std::fs::write(&last_path, saved).expect("restored");
    // Nothing was cut: the whole log, as before.
    assert_holds(
        &SegmentLog.open(&dir, SEGMENT_BYTES).expect("reopened"),
        30,
        &[],
    )
    .expect("the whole log");
}
