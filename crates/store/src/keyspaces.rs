//! The keyspaces of a shard's fjall database, and the numbers the log's
//! puts name them by. A leaf: it knows fjall and nothing else of the store.

use crate::StoreError;
use fjall::{Database, Keyspace, KeyspaceCreateOptions};

/// The keyspaces of one shard.
#[derive(Clone)]
pub(crate) struct Keyspaces {
    pub db: Database,
    /// Shard-level facts: the epoch.
    pub meta: Keyspace,
    /// `partition | execution` -> execution metadata.
    pub executions: Keyspace,
    /// `partition | execution | first seq` -> where a run of the
    /// execution's events lies in the log (see `index.rs`).
    pub event_index: Keyspace,
    /// `partition | execution | idempotency key` -> seq.
    pub event_idem: Keyspace,
    /// `key partition | len | routing key | execution` -> ().
    pub routing_keys: Keyspace,
    /// `key partition | len | routing key | idempotency key` -> execution.
    pub start_idem: Keyspace,
}

pub(crate) const EPOCH_KEY: &[u8] = b"epoch";

/// The keyspaces the log's puts name, by their number in the log.
pub(crate) mod keyspace_id {
    pub const META: u8 = 0;
    pub const EXECUTIONS: u8 = 1;
    pub const EVENT_IDEM: u8 = 2;
    pub const ROUTING_KEYS: u8 = 3;
    pub const START_IDEM: u8 = 4;
}

impl Keyspaces {
    /// Opens (or creates) the shard's keyspaces in `db`.
    pub(crate) fn open(db: Database) -> Result<Keyspaces, StoreError> {
        let opts = KeyspaceCreateOptions::default;
        Ok(Keyspaces {
            meta: db.keyspace("meta", opts)?,
            executions: db.keyspace("executions", opts)?,
            // Index entries are only ever read by range (an execution's
            // runs, its last run), never by point lookup, so a bloom
            // filter would be built at every flush and never consulted.
            event_index: db.keyspace("event_index", || {
                opts().filter_policy(fjall::config::FilterPolicy::disabled())
            })?,
            event_idem: db.keyspace("event_idem", opts)?,
            routing_keys: db.keyspace("routing_keys", opts)?,
            start_idem: db.keyspace("start_idem", opts)?,
            db,
        })
    }

    /// Every keyspace of the shard.
    pub(crate) fn all(&self) -> [&Keyspace; 6] {
        [
            &self.meta,
            &self.executions,
            &self.event_index,
            &self.event_idem,
            &self.routing_keys,
            &self.start_idem,
        ]
    }

    /// The keyspace a put in the log names.
    pub(crate) fn by_id(&self, id: u8) -> Option<&Keyspace> {
        use keyspace_id::*;
        Some(match id {
            META => &self.meta,
            EXECUTIONS => &self.executions,
            EVENT_IDEM => &self.event_idem,
            ROUTING_KEYS => &self.routing_keys,
            START_IDEM => &self.start_idem,
            _ => return None,
        })
    }
}
