//! The events index: where each event of an execution lies in the log.
//!
//! Events written since the last checkpoint are indexed in memory (the
//! [`Tail`]: one run of consecutive locations per execution). A checkpoint
//! writes each run to the `event_index` keyspace, one entry per (at most)
//! [`ENTRY_LOCS_MAX`] events, `partition | execution | first seq` ->
//! `version | last recorded_at | count | (segment u32, offset u64, len
//! u32) * count`, together with the log position it covers, and empties
//! the tail. Opening the shard replays
//! the log from that position, which rebuilds the tail. So an append costs
//! a push onto a vector, and the sorted index gets one entry per execution
//! per checkpoint instead of one per event.
//!
//! Readers take the tail's read lock, a database snapshot and a copy of
//! the locations they need, all at once; the writer changes the tail and
//! the keyspaces under the write lock, so a reader sees a group's events
//! and its index puts together or not at all, and a checkpoint's entries
//! either in the snapshot or still in the tail.

use crate::codec;
use crate::keyspaces::Keyspaces;
use crate::log::{Loc, Position};
use crate::StoreError;
use fjall::{OwnedWriteBatch, Readable};
use forkless_types::{ExecutionId, PartitionId};

type HashMap<K, V> = std::collections::HashMap<K, V, foldhash::fast::RandomState>;

const INDEX_VERSION: u8 = 1;
const LOC_BYTES: usize = 16;
/// Most locations in one index entry (64 KiB): a longer run is written as
/// several entries, so finding an execution's last event or the start of
/// a read decodes a bounded entry.
const ENTRY_LOCS_MAX: usize = 4096;
const ENTRY_HEADER: usize = 1 + 8 + 4;

/// The log position the last checkpoint covers, in the meta keyspace.
pub(crate) const CHECKPOINT_KEY: &[u8] = b"log_checkpoint";

/// Consecutive events of one execution, `first_seq` onwards.
#[derive(Debug, Clone)]
pub(crate) struct Run {
    partition: PartitionId,
    first_seq: u64,
    last_recorded_at: u64,
    locs: Vec<Loc>,
    /// The recorded_at of the last event of each full entry's worth of
    /// `locs` ([`ENTRY_LOCS_MAX`] each).
    entry_ends: Vec<u64>,
}

impl Run {
    fn last_seq(&self) -> u64 {
        self.first_seq + self.locs.len() as u64 - 1
    }
}

/// What a reader copies out of the tail for one execution.
#[derive(Debug, Clone)]
pub(crate) struct TailView {
    /// The execution's last event: `(seq, recorded_at_ms)`.
    pub last: (u64, u64),
    /// The first seq the tail holds for it.
    pub first_seq: u64,
    /// Locations of seq `from` onwards (as many as asked for).
    pub from: u64,
    pub locs: Vec<Loc>,
}

/// Events indexed in memory only (written since the last checkpoint).
#[derive(Default)]
pub(crate) struct Tail {
    runs: HashMap<ExecutionId, Run>,
}

impl Tail {
    /// Records that event `seq` of `id` lies at `loc`. Events of an
    /// execution must come in order without gaps.
    pub(crate) fn push(
        &mut self,
        partition: PartitionId,
        id: ExecutionId,
        seq: u64,
        loc: Loc,
        recorded_at: u64,
    ) -> Result<(), StoreError> {
        if seq == 0 {
            return Err(StoreError::Corrupt(format!(
                "execution {id}: an event with seq 0 in the log"
            )));
        }
        let run = self.runs.entry(id).or_insert_with(|| Run {
            partition,
            first_seq: seq,
            last_recorded_at: recorded_at,
            locs: Vec::new(),
            entry_ends: Vec::new(),
        });
        if !run.locs.is_empty() && seq != run.last_seq() + 1 {
            return Err(StoreError::Corrupt(format!(
                "execution {id}: event {seq} follows event {} in the log",
                run.last_seq()
            )));
        }
        if !run.locs.is_empty() && run.locs.len().is_multiple_of(ENTRY_LOCS_MAX) {
            run.entry_ends.push(run.last_recorded_at);
        }
        run.locs.push(loc);
        run.last_recorded_at = recorded_at;
        Ok(())
    }

    /// A copy of what the tail has for `id`: its last event, and the
    /// locations of up to `limit` events after `after`.
    pub(crate) fn view(&self, id: ExecutionId, after: u64, limit: usize) -> Option<TailView> {
        let run = self.runs.get(&id)?;
        let from = after.saturating_add(1).max(run.first_seq);
        let skip = (from - run.first_seq) as usize;
        let locs = run
            .locs
            .get(skip..)
            .map(|l| l[..l.len().min(limit)].to_vec())
            .unwrap_or_default();
        Some(TailView {
            last: (run.last_seq(), run.last_recorded_at),
            first_seq: run.first_seq,
            from,
            locs,
        })
    }

    /// Writes every run to the index and `at` as the checkpoint, in one
    /// batch, then empties the tail. The caller holds the tail's write
    /// lock, so no reader sees the entries twice or not at all, and makes
    /// the batch durable afterwards (a sync of the keyspaces' journal, which
    /// also holds every put written to the keyspaces before).
    pub(crate) fn checkpoint(
        &mut self,
        ks: &Keyspaces,
        at: Position,
    ) -> Result<Written, StoreError> {
        let (batch, written) = self.checkpoint_batch(ks, at);
        self.commit_checkpoint(batch)?;
        Ok(written)
    }

    /// Writes every run to the index, and no checkpoint position, then
    /// empties the tail (a snapshot's install, which bounds its memory so
    /// and checkpoints at its end: `snapshot.rs`).
    pub(crate) fn write_runs(&mut self, ks: &Keyspaces) -> Result<Written, StoreError> {
        let (batch, written) = self.runs_batch(ks);
        self.commit_checkpoint(batch)?;
        Ok(written)
    }

    /// The batch [`Tail::checkpoint`] commits; built under the tail's read
    /// lock by its only writer, so that readers go on meanwhile.
    pub(crate) fn checkpoint_batch(
        &self,
        ks: &Keyspaces,
        at: Position,
    ) -> (OwnedWriteBatch, Written) {
        let (mut batch, written) = self.runs_batch(ks);
        batch.insert(&ks.meta, CHECKPOINT_KEY, at.encode());
        (batch, written)
    }

    fn runs_batch(&self, ks: &Keyspaces) -> (OwnedWriteBatch, Written) {
        let mut batch = ks.db.batch().durability(None);
        let mut value = Vec::new();
        let mut written = Written::default();
        for (id, run) in &self.runs {
            written.events += run.locs.len() as u64;
            for (i, locs) in run.locs.chunks(ENTRY_LOCS_MAX).enumerate() {
                let last_recorded_at = run
                    .entry_ends
                    .get(i)
                    .copied()
                    .unwrap_or(run.last_recorded_at);
                encode_entry(&mut value, last_recorded_at, locs);
                let first_seq = run.first_seq + (i * ENTRY_LOCS_MAX) as u64;
                batch.insert(
                    &ks.event_index,
                    codec::event_key(run.partition, *id, first_seq),
                    &value[..],
                );
                written.entries += 1;
            }
        }
        (batch, written)
    }

    /// Commits a [`Tail::checkpoint_batch`] built since the tail last
    /// changed and empties the tail, under its write lock.
    pub(crate) fn commit_checkpoint(&mut self, batch: OwnedWriteBatch) -> Result<(), StoreError> {
        batch.commit()?;
        self.runs.clear();
        Ok(())
    }
}

/// What a checkpoint wrote to the index.
#[derive(Debug, Default, Clone, Copy)]
pub(crate) struct Written {
    pub(crate) entries: u64,
    pub(crate) events: u64,
}

fn encode_entry(out: &mut Vec<u8>, last_recorded_at: u64, locs: &[Loc]) {
    out.clear();
    out.reserve(ENTRY_HEADER + locs.len() * LOC_BYTES);
    out.push(INDEX_VERSION);
    out.extend_from_slice(&last_recorded_at.to_be_bytes());
    out.extend_from_slice(&(locs.len() as u32).to_be_bytes());
    for l in locs {
        out.extend_from_slice(&l.segment.to_be_bytes());
        out.extend_from_slice(&l.offset.to_be_bytes());
        out.extend_from_slice(&l.len.to_be_bytes());
    }
}

/// An index entry: its first seq and its events' locations.
struct Entry {
    first_seq: u64,
    locs: Vec<Loc>,
}

impl Entry {
    fn last_seq(&self) -> u64 {
        self.first_seq + self.locs.len() as u64 - 1
    }
}

fn entry_first_seq(key: &[u8]) -> Result<u64, StoreError> {
    if key.len() != 20 {
        return Err(StoreError::Corrupt(
            "events index entry: malformed key".into(),
        ));
    }
    codec::decode_u64(&key[12..], "events index key")
}

/// An index entry's first seq, last recorded_at and number of events,
/// without decoding its locations (checked to be all there).
fn entry_header(key: &[u8], value: &[u8]) -> Result<(u64, u64, usize), StoreError> {
    let bad = |what: &str| StoreError::Corrupt(format!("events index entry: {what}"));
    let first_seq = entry_first_seq(key)?;
    if value.len() < ENTRY_HEADER {
        return Err(bad("truncated"));
    }
    let mut r = codec::Reader::new(value, "events index entry");
    let version = r.u8()?;
    if version != INDEX_VERSION {
        return Err(bad(&format!("unknown version {version}")));
    }
    let last_recorded_at = r.u64()?;
    let n = r.u32()? as usize;
    if n == 0 || value.len() != ENTRY_HEADER + n * LOC_BYTES || first_seq == 0 {
        return Err(bad("wrong length"));
    }
    Ok((first_seq, last_recorded_at, n))
}

fn decode_entry(key: &[u8], value: &[u8]) -> Result<Entry, StoreError> {
    let (first_seq, _, n) = entry_header(key, value)?;
    let mut r = codec::Reader::new(&value[ENTRY_HEADER..], "events index entry");
    let locs = (0..n)
        .map(|_| {
            Ok(Loc {
                segment: r.u32()?,
                offset: r.u64()?,
                len: r.u32()?,
            })
        })
        .collect::<Result<_, StoreError>>()?;
    Ok(Entry { first_seq, locs })
}

/// An index entry as the offline check reads it: its execution, first seq
/// and locations.
pub(crate) fn decode_entry_public(
    key: &[u8],
    value: &[u8],
) -> Result<(ExecutionId, u64, Vec<Loc>), StoreError> {
    let entry = decode_entry(key, value)?;
    let id = codec::decode_execution_id(&key[4..12], "events index key")?;
    Ok((id, entry.first_seq, entry.locs))
}

/// The execution's last event `(seq, recorded_at_ms)` as of `snap` and the
/// tail view taken with it; `None` if it has no event.
pub(crate) fn last_event(
    ks: &Keyspaces,
    snap: &impl Readable,
    id: ExecutionId,
    tail: Option<&TailView>,
) -> Result<Option<(u64, u64)>, StoreError> {
    if let Some(t) = tail {
        return Ok(Some(t.last));
    }
    let prefix = codec::execution_key(id.partition(), id);
    match snap.prefix(&ks.event_index, prefix).next_back() {
        None => Ok(None),
        Some(item) => {
            let (k, v) = item.into_inner()?;
            let (first_seq, last_recorded_at, n) = entry_header(&k, &v)?;
            Ok(Some((first_seq + n as u64 - 1, last_recorded_at)))
        }
    }
}

/// Locations of the events `after + 1 ..= through` of `id`, from the index
/// as of `snap` and the tail view taken with it. A missing event is
/// corruption.
pub(crate) fn locations(
    ks: &Keyspaces,
    snap: &impl Readable,
    id: ExecutionId,
    after: u64,
    through: u64,
    tail: Option<&TailView>,
) -> Result<Vec<(u64, Loc)>, StoreError> {
    let mut out = Vec::with_capacity(through.saturating_sub(after) as usize);
    let mut next = after + 1;
    let indexed_through = tail.map_or(through, |t| through.min(t.first_seq - 1));
    if next <= indexed_through {
        let p = id.partition();
        // The entry holding `next` is the last one starting at or before it.
        let start = match snap
            .range(
                &ks.event_index,
                codec::event_key(p, id, 0)..=codec::event_key(p, id, next),
            )
            .next_back()
        {
            Some(item) => entry_first_seq(&item.key()?)?,
            None => 0,
        };
        for item in snap.range(
            &ks.event_index,
            codec::event_key(p, id, start)..=codec::event_key(p, id, u64::MAX),
        ) {
            if next > indexed_through {
                break;
            }
            let (k, v) = item.into_inner()?;
            let e = decode_entry(&k, &v)?;
            if e.last_seq() < next {
                continue;
            }
            if e.first_seq > next {
                break;
            }
            let skip = (next - e.first_seq) as usize;
            for loc in &e.locs[skip..] {
                if next > indexed_through {
                    break;
                }
                out.push((next, *loc));
                next += 1;
            }
        }
        if next <= indexed_through {
            return Err(StoreError::Corrupt(format!(
                "execution {id}: the events index has no entry for seq {next}"
            )));
        }
    }
    if let Some(t) = tail {
        while next <= through {
            let loc = next
                .checked_sub(t.from)
                .and_then(|i| t.locs.get(i as usize))
                .ok_or_else(|| {
                    StoreError::Corrupt(format!(
                        "execution {id}: the in-memory index has no entry for seq {next}"
                    ))
                })?;
            out.push((next, *loc));
            next += 1;
        }
    }
    Ok(out)
}
