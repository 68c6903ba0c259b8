//! The log a shard's writer commits to: a segment log of its own (every
//! shard today), or its group's view of the node-wide log
//! (`node_log.rs`, which the store switches to next). One type, so the
//! writer and the commit scheduler need no type parameter; each call is
//! a match, which costs nothing next to the work behind it.

use crate::log::{Durable, GroupRead, Loc, Log, LogWriter, Position, Segments};
use crate::node_log::GroupLog;
use crate::StoreError;
use forkless_types::{ExecutionId, PartitionId};
use std::sync::Arc;

pub(crate) enum ShardLog {
    /// A segment log of the shard's own.
    Own(LogWriter),
    /// The shard's group in the node log.
    #[cfg_attr(
        not(test),
        expect(dead_code, reason = "the store switches shards to the node log next")
    )]
    Node(GroupLog),
}

impl ShardLog {
    /// What readers read durable events through.
    pub(crate) fn segments(&self) -> Arc<Segments> {
        match self {
            ShardLog::Own(l) => l.segments().clone(),
            ShardLog::Node(l) => l.segments(),
        }
    }
}

impl Log for ShardLog {
    fn begin(&mut self) -> Result<(), StoreError> {
        match self {
            ShardLog::Own(l) => l.begin(),
            ShardLog::Node(l) => l.begin(),
        }
    }

    fn event(&mut self, partition: PartitionId, id: ExecutionId, seq: u64, value: &[u8]) -> Loc {
        match self {
            ShardLog::Own(l) => l.event(partition, id, seq, value),
            ShardLog::Node(l) => l.event(partition, id, seq, value),
        }
    }

    fn put(&mut self, keyspace: u8, key: &[u8], value: &[u8]) {
        match self {
            ShardLog::Own(l) => l.put(keyspace, key, value),
            ShardLog::Node(l) => l.put(keyspace, key, value),
        }
    }

    fn pending_event(&self, loc: Loc) -> Result<&[u8], StoreError> {
        match self {
            ShardLog::Own(l) => l.pending_event(loc),
            ShardLog::Node(l) => l.pending_event(loc),
        }
    }

    fn is_empty(&self) -> bool {
        match self {
            ShardLog::Own(l) => l.is_empty(),
            ShardLog::Node(l) => l.is_empty(),
        }
    }

    fn read_event(&self, loc: Loc, id: ExecutionId, seq: u64) -> Result<Vec<u8>, StoreError> {
        match self {
            ShardLog::Own(l) => l.read_event(loc, id, seq),
            ShardLog::Node(l) => l.read_event(loc, id, seq),
        }
    }

    fn append<F>(&mut self, durable: F)
    where
        F: FnOnce(Result<Durable, StoreError>) + Send + 'static,
    {
        match self {
            ShardLog::Own(l) => l.append(durable),
            ShardLog::Node(l) => l.append(durable),
        }
    }

    fn position(&self) -> Position {
        match self {
            ShardLog::Own(l) => l.position(),
            ShardLog::Node(l) => l.position(),
        }
    }

    fn first(&self) -> Position {
        match self {
            ShardLog::Own(l) => l.first(),
            ShardLog::Node(l) => l.first(),
        }
    }

    fn read<V>(&self, from: Position, visit: V) -> Result<(), StoreError>
    where
        V: FnMut(&GroupRead<'_>) -> Result<bool, StoreError>,
    {
        match self {
            ShardLog::Own(l) => l.read(from, visit),
            ShardLog::Node(l) => l.read(from, visit),
        }
    }

    fn truncate_after(&mut self, at: Position) -> Result<(), StoreError> {
        match self {
            ShardLog::Own(l) => l.truncate_after(at),
            ShardLog::Node(l) => l.truncate_after(at),
        }
    }

    fn purge_before(&mut self, at: Position) -> Result<(), StoreError> {
        match self {
            ShardLog::Own(l) => l.purge_before(at),
            ShardLog::Node(l) => l.purge_before(at),
        }
    }

    fn fail_stop(&mut self) {
        match self {
            ShardLog::Own(l) => l.fail_stop(),
            ShardLog::Node(l) => l.fail_stop(),
        }
    }
}
