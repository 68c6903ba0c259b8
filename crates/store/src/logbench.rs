//! Appends through the store's real logs, for `forkless-logbench`
//! (`crates/storebench/src/bin/logbench.rs`; `docs/replication.md`, "One
//! log per node"): K groups, each on a thread of its own, append one event
//! at a time and wait until it is durable, either each into a segment log
//! of its own (one `fdatasync` per group per append, as every shard does
//! today) or all into one node log (one `fdatasync` a round, for every
//! group that appended). Not part of the store's API.

use crate::log::{self, Log, Position};
use crate::node_log::NodeLog;
use crate::StoreError;
use forkless_types::ExecutionId;
use std::path::Path;
use std::sync::mpsc;
use std::time::{Duration, Instant};

/// Where the groups append.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Layout {
    /// A segment log per group.
    SegmentLogs,
    /// One node log, a group's view of it each.
    NodeLog,
}

impl Layout {
    pub fn name(self) -> &'static str {
        match self {
            Layout::SegmentLogs => "segment-log-per-group",
            Layout::NodeLog => "node-log",
        }
    }
}

/// What a run did.
#[derive(Debug, Clone)]
pub struct Report {
    /// Appends made durable, over all groups.
    pub appends: u64,
    pub elapsed: Duration,
    /// Each append's time from `append` to its durability callback.
    pub p50: Duration,
    pub p99: Duration,
}

/// Runs `groups` appending threads for `seconds` in `dir` (which must not
/// exist), each event `event_bytes` long.
pub fn run(
    dir: &Path,
    layout: Layout,
    groups: usize,
    seconds: f64,
    event_bytes: usize,
) -> Result<Report, StoreError> {
    let segment_bytes = log::SEGMENT_BYTES;
    let node = match layout {
        Layout::NodeLog => Some(NodeLog::open(dir, segment_bytes)?),
        Layout::SegmentLogs => None,
    };
    let value = vec![7u8; event_bytes];
    let until = Instant::now() + Duration::from_secs_f64(seconds);
    let start = Instant::now();
    let threads: Vec<_> = (0..groups)
        .map(|g| {
            let group = u32::try_from(g).unwrap_or(u32::MAX);
            let value = value.clone();
            let node = node.clone();
            let dir = dir.join(format!("group-{g}"));
            std::thread::spawn(move || -> Result<Vec<Duration>, StoreError> {
                match node {
                    Some(node) => append_until(&mut node.group(group), group, &value, until),
                    None => append_until(
                        &mut log::open(&dir, Position::default(), segment_bytes, |_| Ok(()))?,
                        group,
                        &value,
                        until,
                    ),
                }
            })
        })
        .collect();
    let mut times = Vec::new();
    for t in threads {
        let mine = t
            .join()
            .map_err(|_| StoreError::Io("an appending thread panicked".into()))??;
        times.extend(mine);
    }
    let elapsed = start.elapsed();
    times.sort_unstable();
    let at = |q: f64| {
        times
            .get(((times.len() as f64 * q) as usize).min(times.len().saturating_sub(1)))
            .copied()
            .unwrap_or_default()
    };
    Ok(Report {
        appends: times.len() as u64,
        elapsed,
        p50: at(0.50),
        p99: at(0.99),
    })
}

fn append_until<L: Log>(
    log: &mut L,
    group: u32,
    value: &[u8],
    until: Instant,
) -> Result<Vec<Duration>, StoreError> {
    let id = ExecutionId::new(i64::from(group) + 1)
        .map_err(|e| StoreError::Invalid(format!("group {group}: {e}")))?;
    let mut times = Vec::new();
    let mut seq = 0;
    while Instant::now() < until {
        seq += 1;
        log.begin()?;
        log.event(id.partition(), id, seq, value);
        let (tx, rx) = mpsc::channel();
        let asked = Instant::now();
        log.append(move |made| {
            let _ = tx.send(made.map(|_| Instant::now()));
        });
        let durable = rx
            .recv()
            .map_err(|_| StoreError::Io("no durability callback".into()))??;
        times.push(durable - asked);
    }
    Ok(times)
}
