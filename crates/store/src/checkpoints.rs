//! What a shard's checkpoints made and took (a leaf: shared by the
//! writer, the commit scheduler and a Raft group's state machine).

use std::sync::atomic::AtomicU64;

/// Checkpoints made and the time they took, in microseconds: building and
/// committing the index batch (readers wait for the commit, under the
/// tail's write lock) and syncing the keyspaces' journal after it (the
/// shard's next group waits for both, on the writer thread).
#[derive(Default)]
pub(crate) struct CheckpointCounters {
    pub(crate) made: AtomicU64,
    pub(crate) index_micros: AtomicU64,
    pub(crate) sync_micros: AtomicU64,
    /// What the log's `Log::written` said at the last checkpoint.
    pub(crate) at_written: AtomicU64,
}
