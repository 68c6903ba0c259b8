//! Consistent reads of a shard's state: a snapshot of its keyspaces taken
//! together with what the in-memory part of its events index holds.

use crate::codec;
use crate::index::{self, Tail, TailView};
use crate::keyspaces::Keyspaces;
use crate::{ExecutionMeta, StoreError};
use fjall::Readable;
use forkless_types::ExecutionId;
use std::sync::{Arc, RwLock};

/// The shard's in-memory index, shared by its writer and its readers.
pub(crate) type SharedTail = Arc<RwLock<Tail>>;

/// A consistent view for a reader: a snapshot of the keyspaces and what
/// the tail has for `id`, taken together under the tail's lock.
pub(crate) fn view(
    ks: &Keyspaces,
    tail: &SharedTail,
    id: ExecutionId,
    after: u64,
    limit: usize,
) -> (fjall::Snapshot, Option<TailView>) {
    let t = tail.read().unwrap_or_else(|e| e.into_inner());
    (ks.db.snapshot(), t.view(id, after, limit))
}

/// An execution's metadata as of `snap` and the tail view taken with it:
/// its record plus its last event.
pub(crate) fn read_meta(
    ks: &Keyspaces,
    snap: &impl Readable,
    id: ExecutionId,
    tail: Option<&TailView>,
) -> Result<Option<ExecutionMeta>, StoreError> {
    let key = codec::execution_key(id.partition(), id);
    let Some(record) = snap.get(&ks.executions, key)? else {
        return Ok(None);
    };
    // Every execution has at least its `execution.started` event, written
    // in the same group as the record.
    let Some(last) = index::last_event(ks, snap, id, tail)? else {
        return Err(StoreError::Corrupt(format!(
            "execution {id} has a record but no events"
        )));
    };
    Ok(Some(codec::decode_meta(id, &record, last)?))
}
