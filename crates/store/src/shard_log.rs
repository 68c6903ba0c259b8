//! The log a shard's writer commits to: a segment log of its own, or its
//! group's view of the node-wide log (`node_log.rs`). One type, so the
//! writer and the commit scheduler need no type parameter; each call is
//! a match, which costs nothing next to the work behind it.

use crate::log::{Durable, GroupRead, Loc, Log, LogWriter, Position, Segments};
use crate::node_log::{GroupLog, SEGMENT_BASE};
use crate::StoreError;
use forkless_types::{ExecutionId, PartitionId};
use std::sync::Arc;

pub(crate) enum ShardLog {
    /// A segment log of the shard's own.
    Own(LogWriter),
    /// The shard's group in the node log, and where the shard's events
    /// are read from (the node log, and the shard's own log of before, if
    /// it had one, for the events that stay in it).
    Node(GroupLog, EventFiles),
}

impl ShardLog {
    /// What readers read durable events through.
    pub(crate) fn events(&self) -> EventFiles {
        match self {
            ShardLog::Own(l) => EventFiles {
                log: l.segments().clone(),
                own: None,
            },
            ShardLog::Node(_, files) => files.clone(),
        }
    }
}

/// Where a shard's durable events are read from: the log it writes, and,
/// for a shard written before the node log, its own log's segments, which
/// keep the events they held (a location says which: the node log's
/// segments are numbered from [`SEGMENT_BASE`]).
#[derive(Clone)]
pub(crate) struct EventFiles {
    log: Arc<Segments>,
    own: Option<Arc<Segments>>,
}

impl EventFiles {
    /// The node log's segments `log`, and the shard's own log of before.
    pub(crate) fn new(log: Arc<Segments>, own: Option<Arc<Segments>>) -> EventFiles {
        EventFiles { log, own }
    }

    pub(crate) fn read_event(
        &self,
        loc: Loc,
        id: ExecutionId,
        seq: u64,
    ) -> Result<Vec<u8>, StoreError> {
        match &self.own {
            Some(own) if loc.segment < SEGMENT_BASE => own.read_event(loc, id, seq),
            _ => self.log.read_event(loc, id, seq),
        }
    }

    /// `len` bytes at `offset` of node-log segment `segment` (a Raft
    /// entry's body).
    pub(crate) fn read_at(
        &self,
        segment: u32,
        offset: u64,
        len: u32,
    ) -> Result<Vec<u8>, StoreError> {
        self.log.read_at(segment, offset, len)
    }

    /// The log the shard writes, if it is a log of its own (the node
    /// log's syncs and bytes are the node's, not one shard's).
    pub(crate) fn own_log(&self) -> Option<&Segments> {
        (self.log.base() < SEGMENT_BASE).then_some(&*self.log)
    }

    /// Bytes the shard's own log takes: the one it writes, or the one it
    /// wrote before it moved to the node log.
    pub(crate) fn own_bytes(&self) -> u64 {
        self.own_log()
            .or(self.own.as_deref())
            .map_or(0, |own| own.disk_bytes())
    }
}

impl Log for ShardLog {
    fn begin(&mut self) -> Result<(), StoreError> {
        match self {
            ShardLog::Own(l) => l.begin(),
            ShardLog::Node(l, _) => l.begin(),
        }
    }

    fn event(&mut self, partition: PartitionId, id: ExecutionId, seq: u64, value: &[u8]) -> Loc {
        match self {
            ShardLog::Own(l) => l.event(partition, id, seq, value),
            ShardLog::Node(l, _) => l.event(partition, id, seq, value),
        }
    }

    fn put(&mut self, keyspace: u8, key: &[u8], value: &[u8]) {
        match self {
            ShardLog::Own(l) => l.put(keyspace, key, value),
            ShardLog::Node(l, _) => l.put(keyspace, key, value),
        }
    }

    fn pending_event(&self, loc: Loc) -> Result<&[u8], StoreError> {
        match self {
            ShardLog::Own(l) => l.pending_event(loc),
            ShardLog::Node(l, _) => l.pending_event(loc),
        }
    }

    fn is_empty(&self) -> bool {
        match self {
            ShardLog::Own(l) => l.is_empty(),
            ShardLog::Node(l, _) => l.is_empty(),
        }
    }

    fn read_event(&self, loc: Loc, id: ExecutionId, seq: u64) -> Result<Vec<u8>, StoreError> {
        match self {
            ShardLog::Own(l) => l.read_event(loc, id, seq),
            ShardLog::Node(_, files) => files.read_event(loc, id, seq),
        }
    }

    fn append<F>(&mut self, durable: F)
    where
        F: FnOnce(Result<Durable, StoreError>) + Send + 'static,
    {
        match self {
            ShardLog::Own(l) => l.append(durable),
            ShardLog::Node(l, _) => l.append(durable),
        }
    }

    fn position(&self) -> Position {
        match self {
            ShardLog::Own(l) => l.position(),
            ShardLog::Node(l, _) => l.position(),
        }
    }

    fn first(&self) -> Position {
        match self {
            ShardLog::Own(l) => l.first(),
            ShardLog::Node(l, _) => l.first(),
        }
    }

    fn read<V>(&self, from: Position, visit: V) -> Result<(), StoreError>
    where
        V: FnMut(&GroupRead<'_>) -> Result<bool, StoreError>,
    {
        match self {
            ShardLog::Own(l) => l.read(from, visit),
            ShardLog::Node(l, _) => l.read(from, visit),
        }
    }

    fn truncate_after(&mut self, at: Position) -> Result<(), StoreError> {
        match self {
            ShardLog::Own(l) => l.truncate_after(at),
            ShardLog::Node(l, _) => l.truncate_after(at),
        }
    }

    fn purge_before(&mut self, at: Position) -> Result<(), StoreError> {
        match self {
            ShardLog::Own(l) => l.purge_before(at),
            ShardLog::Node(l, _) => l.purge_before(at),
        }
    }

    fn fail_stop(&mut self) {
        match self {
            ShardLog::Own(l) => l.fail_stop(),
            ShardLog::Node(l, _) => l.fail_stop(),
        }
    }

    fn checkpoint_position(&self) -> Position {
        match self {
            ShardLog::Own(l) => l.checkpoint_position(),
            ShardLog::Node(l, _) => l.checkpoint_position(),
        }
    }

    fn written(&self) -> u64 {
        match self {
            ShardLog::Own(l) => l.written(),
            ShardLog::Node(l, _) => l.written(),
        }
    }
}
