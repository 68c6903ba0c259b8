//! The shard's state machine: what a command does, as a function of the
//! shard's state, the command and the time, and nothing else.
//!
//! [`Machine`]'s `start`, `append` and `advance_epoch` check a command (the epoch it was sent under, its
//! fields, sequence numbers, the closed state, idempotency keys) against
//! the shard's state and what earlier commands of the same group wrote
//! (the overlay), and writes what it does into a [`Sink`]: events, and
//! puts into the keyspaces. It reads no clock (`now` is an input) and no
//! disk but through [`State`], so two replicas that apply the same
//! commands to the same state write the same records and give the same
//! answers (`docs/replication.md`, "The state machine").
//!
//! The writer ([`crate::writer`]) is its one user today: it applies a
//! group's commands, then makes what the sink collected durable in one log
//! group, and only then publishes the outcomes. A failed disk is the
//! writer's to check, before it applies: it is a fact of this replica, not
//! of the shard's state.

use crate::codec;
use crate::keyspaces::keyspace_id;
use crate::{
    terminal_status, AppendOutcome, AppendRequest, ExecutionMeta, ExecutionStatus, StartOutcome,
    StartRequest, StoreError, StoredEvent, STARTED_EVENT_TYPE, STRING_BYTES_MAX,
};
use forkless_types::{Epoch, ExecutionId, PartitionId};
use std::borrow::Cow;
use std::collections::HashSet;

/// The state machine's hash maps. Their keys are chosen by clients
/// (execution ids, idempotency keys), so the hasher is randomly seeded at
/// startup, like std's, and collisions cannot be precomputed; foldhash is
/// much cheaper than std's SipHash on such short keys (hashing was ~2.5%
/// of the writer's CPU with SipHash at 64 clients).
pub(crate) type HashMap<K, V> = std::collections::HashMap<K, V, foldhash::fast::RandomState>;

/// What the shard holds, as of the commands committed before the group
/// being applied. The machine adds what the group's earlier commands wrote.
pub(crate) trait State {
    /// The shard's epoch: a command sent under another one is fenced.
    fn epoch(&self) -> Epoch;
    fn meta(&self, id: ExecutionId) -> Result<Option<ExecutionMeta>, StoreError>;
    /// The execution a start idempotency key (`codec::start_idem_key`)
    /// created.
    fn start_idem(&self, key: &[u8]) -> Result<Option<ExecutionId>, StoreError>;
    /// The seq an event idempotency key (`codec::event_idem_key`) names.
    fn event_idem(&self, key: &[u8]) -> Result<Option<u64>, StoreError>;
    /// Event `seq` of `id` as written: committed before the group, or
    /// written into the sink by an earlier command of it.
    fn stored_event(&self, id: ExecutionId, seq: u64) -> Result<StoredEvent, StoreError>;
}

/// Where the machine writes what a command does. Nothing in it may reach
/// a reader before the group is durable.
pub(crate) trait Sink {
    /// A fact of the state that a command about to write rests on, as the
    /// machine read it. Under replication every replica checks these
    /// against its own state before it applies the command's records
    /// ([`Checker`]); a single replica that evaluates and applies against
    /// one state has nothing to check again.
    fn precondition(&mut self, p: Precondition<'_>);
    /// Event `seq` of `id`, encoded (`codec::encode_event_into`), recorded
    /// at `recorded_at`.
    fn event(&mut self, id: ExecutionId, seq: u64, recorded_at: u64, value: &[u8]);
    /// A put into the keyspace numbered `keyspace` (`keyspace_id`).
    fn put(&mut self, keyspace: u8, key: &[u8], value: &[u8]);
}

/// A fact of the shard's state that a command's records rest on
/// (`docs/replication.md`, "What an entry holds"). Emitted only by a
/// command that writes, before its first record; a refused or
/// deduplicated command writes nothing and rests on nothing.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) enum Precondition<'a> {
    /// The shard's epoch was this (the command was sent under it).
    Epoch(Epoch),
    /// The execution was open at this last seq.
    Open { id: ExecutionId, last_seq: u64 },
    /// No execution had this id.
    Absent(ExecutionId),
    /// No event carried this idempotency key (`codec::event_idem_key`).
    EventKeyUnused(Cow<'a, [u8]>),
    /// No start used this idempotency key (`codec::start_idem_key`).
    StartKeyUnused(Cow<'a, [u8]>),
}

#[cfg_attr(
    not(test),
    expect(
        dead_code,
        reason = "a replicated group's apply is its user; Raft comes next"
    )
)]
impl Precondition<'_> {
    pub(crate) fn into_owned(self) -> Precondition<'static> {
        match self {
            Precondition::Epoch(e) => Precondition::Epoch(e),
            Precondition::Open { id, last_seq } => Precondition::Open { id, last_seq },
            Precondition::Absent(id) => Precondition::Absent(id),
            Precondition::EventKeyUnused(k) => {
                Precondition::EventKeyUnused(Cow::Owned(k.into_owned()))
            }
            Precondition::StartKeyUnused(k) => {
                Precondition::StartKeyUnused(Cow::Owned(k.into_owned()))
            }
        }
    }
}

/// Checks commands' preconditions the way every replica does before it
/// applies a command's records: against the replica's own state plus what
/// the entry's earlier commands wrote (fed in with [`Checker::event`] and
/// [`Checker::put`] as they are applied). Deterministic: the same state
/// and entry give the same verdict on every replica.
#[derive(Default)]
pub(crate) struct Checker {
    /// Each execution the entry wrote: its last seq, and whether it is
    /// still open.
    executions: HashMap<ExecutionId, (u64, bool)>,
    event_keys: HashSet<Vec<u8>>,
    start_keys: HashSet<Vec<u8>>,
    epoch: Option<Epoch>,
}

impl Checker {
    /// Starts an entry.
    pub(crate) fn begin(&mut self) {
        self.executions.clear();
        self.event_keys.clear();
        self.start_keys.clear();
        self.epoch = None;
    }

    /// `Ok(Ok(()))` if every precondition holds; `Ok(Err(why))` for the
    /// first that does not, and what the replica has instead: the same on
    /// every replica, which refuses the entry alike. A read of the state
    /// that failed (`Err`) is this replica's failure, not the shard's
    /// state: never a refusal (the other replicas apply the entry; a
    /// refusal here would answer its waiters "not executed" and leave this
    /// replica without what they hold).
    pub(crate) fn check(
        &self,
        state: &impl State,
        pre: &[Precondition<'_>],
    ) -> Result<Result<(), String>, StoreError> {
        for p in pre {
            let holds = match p {
                Precondition::Epoch(e) => {
                    let current = self.epoch.unwrap_or_else(|| state.epoch());
                    (current == *e)
                        .then_some(())
                        .ok_or_else(|| format!("the epoch is {current}, not {e}"))
                }
                Precondition::Open { id, last_seq } => {
                    let now = match self.executions.get(id) {
                        Some(&(seq, open)) => Some((seq, open)),
                        None => state
                            .meta(*id)?
                            .map(|m| (m.last_seq, !m.status.is_terminal())),
                    };
                    match now {
                        Some((seq, true)) if seq == *last_seq => Ok(()),
                        Some((seq, open)) => Err(format!(
                            "execution {id} is {} at seq {seq}, not open at {last_seq}",
                            if open { "open" } else { "closed" }
                        )),
                        None => Err(format!("execution {id} does not exist")),
                    }
                }
                Precondition::Absent(id) => {
                    let exists = self.executions.contains_key(id) || state.meta(*id)?.is_some();
                    (!exists)
                        .then_some(())
                        .ok_or_else(|| format!("execution {id} exists"))
                }
                Precondition::EventKeyUnused(k) => {
                    let used =
                        self.event_keys.contains(k.as_ref()) || state.event_idem(k)?.is_some();
                    (!used)
                        .then_some(())
                        .ok_or_else(|| "an event idempotency key is used".to_string())
                }
                Precondition::StartKeyUnused(k) => {
                    let used =
                        self.start_keys.contains(k.as_ref()) || state.start_idem(k)?.is_some();
                    (!used)
                        .then_some(())
                        .ok_or_else(|| "a start idempotency key is used".to_string())
                }
            };
            if let Err(why) = holds {
                return Ok(Err(why));
            }
        }
        Ok(Ok(()))
    }

    /// An event the entry's command applied (its value as stored).
    pub(crate) fn event(
        &mut self,
        id: ExecutionId,
        seq: u64,
        value: &[u8],
    ) -> Result<(), StoreError> {
        let stored = codec::decode_event(seq, value)?;
        let open = terminal_status(&stored.event_type).is_none();
        self.executions.insert(id, (seq, open));
        Ok(())
    }

    /// A put the entry's command applied. One to a keyspace this version
    /// does not know is damage (or an entry of a newer version): the
    /// apply stops there, as a replay of the log does, rather than leave
    /// the put out on this replica.
    pub(crate) fn put(&mut self, keyspace: u8, key: &[u8], value: &[u8]) -> Result<(), StoreError> {
        use keyspace_id::*;
        if ![META, EXECUTIONS, EVENT_IDEM, ROUTING_KEYS, START_IDEM].contains(&keyspace) {
            return Err(StoreError::Corrupt(format!(
                "an entry's put to keyspace {keyspace}, which this version does not know"
            )));
        }
        match keyspace {
            keyspace_id::EVENT_IDEM => {
                self.event_keys.insert(key.to_vec());
            }
            keyspace_id::START_IDEM => {
                self.start_keys.insert(key.to_vec());
            }
            keyspace_id::META if key == crate::keyspaces::EPOCH_KEY => {
                self.epoch = Some(Epoch(codec::decode_u64(value, "the epoch")?));
            }
            _ => {}
        }
        Ok(())
    }
}

/// The state machine with the overlay of the group being applied, and
/// the overlays of the groups before it that are proposed to the shard's
/// Raft group and not yet applied (a leader's pipeline: `writer.rs`).
#[derive(Default)]
pub(crate) struct Machine {
    overlay: Overlay,
    /// What the groups in flight wrote, oldest first: a command is
    /// evaluated against the state as of all of them (the newest write
    /// wins), since every one of them is applied before it or none of
    /// what follows them stands (`docs/replication.md`, "Groups in
    /// flight").
    in_flight: std::collections::VecDeque<Overlay>,
    /// Overlays of settled groups, kept for their tables' capacity.
    spare: Vec<Overlay>,
    /// The event value being encoded (kept for its capacity; the sink
    /// copies it).
    value: Vec<u8>,
}

/// What earlier commands of the group being applied wrote.
#[derive(Default)]
struct Overlay {
    metas: HashMap<ExecutionId, ExecutionMeta>,
    event_idem: HashMap<Vec<u8>, u64>,
    start_idem: HashMap<Vec<u8>, ExecutionId>,
    epoch: Option<Epoch>,
}

impl Overlay {
    fn clear(&mut self) {
        self.metas.clear();
        self.event_idem.clear();
        self.start_idem.clear();
        self.epoch = None;
    }
}

impl Machine {
    /// Starts a group: forgets what the previous one wrote (keeping the
    /// tables' capacity). The groups in flight stay.
    pub(crate) fn begin(&mut self) {
        self.overlay.clear();
    }

    /// The group just built is in flight: later groups are evaluated as
    /// of what it wrote too, until it is settled.
    pub(crate) fn push_in_flight(&mut self) {
        let mut next = self.spare.pop().unwrap_or_default();
        next.clear();
        self.in_flight
            .push_back(std::mem::replace(&mut self.overlay, next));
    }

    /// The oldest group in flight is settled: applied (the shard's state
    /// holds what it wrote now) or not, and then every later one is
    /// settled before a new group is evaluated.
    pub(crate) fn settle_oldest(&mut self) {
        if let Some(mut o) = self.in_flight.pop_front() {
            o.clear();
            self.spare.push(o);
        }
    }

    /// How many groups are in flight.
    pub(crate) fn groups_in_flight(&self) -> usize {
        self.in_flight.len()
    }

    /// The newest value `get` finds: in the group being built, then in
    /// the groups in flight, newest first.
    fn newest<T>(&self, get: impl Fn(&Overlay) -> Option<T>) -> Option<T> {
        get(&self.overlay).or_else(|| self.in_flight.iter().rev().find_map(&get))
    }

    /// The epoch the group moved the shard to, if it did.
    pub(crate) fn epoch_moved(&self) -> Option<Epoch> {
        self.overlay.epoch
    }

    /// The executions the group wrote.
    pub(crate) fn written(&self) -> impl Iterator<Item = &ExecutionId> {
        self.overlay.metas.keys()
    }

    /// The executions the group wrote with their metadata after it, taken
    /// out of the overlay (once the group is committed).
    pub(crate) fn take_written(
        &mut self,
    ) -> impl Iterator<Item = (ExecutionId, ExecutionMeta)> + '_ {
        self.overlay.metas.drain()
    }

    fn epoch(&self, state: &impl State) -> Epoch {
        self.newest(|o| o.epoch).unwrap_or_else(|| state.epoch())
    }

    fn check_epoch(&self, state: &impl State, presented: Epoch) -> Result<(), StoreError> {
        let current = self.epoch(state);
        if presented != current {
            return Err(StoreError::Fenced { presented, current });
        }
        Ok(())
    }

    fn meta(
        &self,
        state: &impl State,
        id: ExecutionId,
    ) -> Result<Option<ExecutionMeta>, StoreError> {
        match self.newest(|o| o.metas.get(&id).cloned()) {
            Some(m) => Ok(Some(m)),
            None => state.meta(id),
        }
    }

    /// Moves the shard's epoch forward (never back); moving it to the
    /// epoch it has is a no-op that writes nothing.
    pub(crate) fn advance_epoch<S: State + Sink>(
        &mut self,
        shard: &mut S,
        e: Epoch,
    ) -> Result<Epoch, StoreError> {
        let current = self.epoch(shard);
        if e < current {
            return Err(StoreError::EpochRegression {
                current,
                requested: e,
            });
        }
        if e > current {
            shard.precondition(Precondition::Epoch(current));
            shard.put(
                keyspace_id::META,
                crate::keyspaces::EPOCH_KEY,
                &codec::u64_value(e.get()),
            );
            self.overlay.epoch = Some(e);
        }
        Ok(e)
    }

    /// Creates an execution with its first event, or answers the one an
    /// earlier start with the same idempotency key created.
    pub(crate) fn start<S: State + Sink>(
        &mut self,
        shard: &mut S,
        req: &StartRequest,
        now: u64,
    ) -> Result<StartOutcome, StoreError> {
        self.check_epoch(shard, req.epoch)?;
        for (field, s) in [
            ("workflow", Some(req.workflow.as_str())),
            ("routing_key", req.routing_key.as_deref()),
            ("idempotency_key", req.idempotency_key.as_deref()),
        ] {
            if s.is_some_and(|s| s.len() > STRING_BYTES_MAX) {
                return Err(StoreError::Invalid(format!(
                    "{field} is longer than {STRING_BYTES_MAX} bytes"
                )));
            }
        }
        // The start idempotency index lives in the steering key's partition,
        // which is on this shard (the edge routed the start here by it).
        let idem_key = req.idempotency_key.as_deref().map(|idem| {
            let steer = req.steering_key().unwrap_or(idem);
            codec::start_idem_key(
                PartitionId::for_key(steer),
                req.routing_key.as_deref(),
                idem,
            )
        });
        if let Some(k) = &idem_key {
            let existing = match self.newest(|o| o.start_idem.get(k).copied()) {
                Some(id) => Some(id),
                None => shard.start_idem(k)?,
            };
            if let Some(id) = existing {
                let meta = self.meta(shard, id)?.ok_or_else(|| {
                    StoreError::Corrupt(format!(
                        "start idempotency index names missing execution {id}"
                    ))
                })?;
                return Ok(StartOutcome {
                    meta,
                    existing: true,
                });
            }
        }
        if self.meta(shard, req.id)?.is_some() {
            return Err(StoreError::ExecutionExists(req.id));
        }
        let p = req.id.partition();
        let meta = ExecutionMeta {
            id: req.id,
            status: ExecutionStatus::Running,
            last_seq: 1,
            created_at_ms: now,
            updated_at_ms: now,
            workflow: req.workflow.clone(),
            routing_key: req.routing_key.clone(),
        };
        codec::encode_event_into(
            &mut self.value,
            now,
            STARTED_EVENT_TYPE,
            None,
            &req.started_payload,
        );
        shard.precondition(Precondition::Epoch(req.epoch));
        shard.precondition(Precondition::Absent(req.id));
        if let Some(k) = &idem_key {
            shard.precondition(Precondition::StartKeyUnused(Cow::Borrowed(k)));
        }
        shard.event(req.id, 1, now, &self.value);
        shard.put(
            keyspace_id::EXECUTIONS,
            &codec::execution_key(p, req.id),
            &codec::encode_meta(&meta),
        );
        if let Some(rk) = &req.routing_key {
            shard.put(
                keyspace_id::ROUTING_KEYS,
                &codec::routing_key_entry(PartitionId::for_key(rk), rk, req.id),
                &[],
            );
        }
        if let Some(k) = idem_key {
            shard.put(
                keyspace_id::START_IDEM,
                &k,
                &codec::u64_value(req.id.get() as u64),
            );
            self.overlay.start_idem.insert(k, req.id);
        }
        self.overlay.metas.insert(req.id, meta.clone());
        Ok(StartOutcome {
            meta,
            existing: false,
        })
    }

    /// Appends events to an execution, or answers a retry of an append
    /// that was applied with its original sequence numbers.
    pub(crate) fn append<S: State + Sink>(
        &mut self,
        shard: &mut S,
        req: &AppendRequest,
        now: u64,
    ) -> Result<AppendOutcome, StoreError> {
        self.check_epoch(shard, req.epoch)?;
        validate_events(req)?;
        let Some(mut meta) = self.meta(shard, req.id)? else {
            return Err(StoreError::NotFound(req.id));
        };
        let p = req.id.partition();

        // Idempotency first: a retry of a batch that was applied must get the
        // original answer even though the log has moved on since.
        let mut found = Vec::new();
        for (i, e) in req.events.iter().enumerate() {
            if let Some(idem) = &e.idempotency_key {
                let k = codec::event_idem_key(p, req.id, idem);
                let seq = match self.newest(|o| o.event_idem.get(&k).copied()) {
                    Some(seq) => Some(seq),
                    None => shard.event_idem(&k)?,
                };
                if let Some(seq) = seq {
                    found.push((i, idem.clone(), seq));
                }
            }
        }
        if !found.is_empty() {
            if found.len() == req.events.len() {
                // A retry must be the same batch: each key's event as it
                // was written (type and payload bytes).
                for (i, key, seq) in &found {
                    let stored = shard.stored_event(req.id, *seq)?;
                    let e = &req.events[*i];
                    let differs = if stored.event_type != e.event_type {
                        "type"
                    } else if stored.payload != e.payload {
                        "payload"
                    } else {
                        continue;
                    };
                    return Err(StoreError::IdempotencyKeyReused {
                        index: *i,
                        key: key.clone(),
                        seq: *seq,
                        differs,
                    });
                }
                let first_seq = found.iter().map(|f| f.2).min().unwrap_or(0);
                let last_seq = found.iter().map(|f| f.2).max().unwrap_or(0);
                return Ok(AppendOutcome {
                    first_seq,
                    last_seq,
                    deduplicated: true,
                    status: meta.status,
                });
            }
            let (index, key, seq) = found.swap_remove(0);
            let unkeyed = req.events.iter().position(|e| e.idempotency_key.is_none());
            return Err(StoreError::IdempotencyConflict {
                index,
                key,
                seq,
                unkeyed,
            });
        }

        if meta.status.is_terminal() {
            return Err(StoreError::ExecutionClosed {
                status: meta.status,
                last_seq: meta.last_seq,
            });
        }
        if let Some(expected) = req.expected_last_seq {
            if expected != meta.last_seq {
                return Err(StoreError::SequenceConflict {
                    expected,
                    last_seq: meta.last_seq,
                });
            }
        }
        let first_seq = meta.last_seq + 1;
        shard.precondition(Precondition::Epoch(req.epoch));
        shard.precondition(Precondition::Open {
            id: req.id,
            last_seq: meta.last_seq,
        });
        for e in &req.events {
            let seq = meta.last_seq + 1;
            codec::encode_event_into(
                &mut self.value,
                now,
                &e.event_type,
                e.idempotency_key.as_deref(),
                &e.payload,
            );
            shard.event(req.id, seq, now, &self.value);
            if let Some(idem) = &e.idempotency_key {
                let k = codec::event_idem_key(p, req.id, idem);
                shard.precondition(Precondition::EventKeyUnused(Cow::Borrowed(&k)));
                shard.put(keyspace_id::EVENT_IDEM, &k, &codec::u64_value(seq));
                self.overlay.event_idem.insert(k, seq);
            }
            if let Some(status) = terminal_status(&e.event_type) {
                meta.status = status;
            }
            meta.last_seq = seq;
        }
        meta.updated_at_ms = now;
        // The record changes only when the status does (a terminal event):
        // last_seq and updated_at are read off the last event.
        if meta.status.is_terminal() {
            shard.put(
                keyspace_id::EXECUTIONS,
                &codec::execution_key(p, req.id),
                &codec::encode_meta(&meta),
            );
        }
        let (last_seq, status) = (meta.last_seq, meta.status);
        self.overlay.metas.insert(req.id, meta);
        Ok(AppendOutcome {
            first_seq,
            last_seq,
            deduplicated: false,
            status,
        })
    }
}

/// The store's own checks of an append; the edge checks the same things
/// first and answers with field names, so these firing means an edge bug.
fn validate_events(req: &AppendRequest) -> Result<(), StoreError> {
    if req.events.is_empty() {
        return Err(StoreError::Invalid("events must not be empty".into()));
    }
    let mut keys = HashSet::new();
    for (i, e) in req.events.iter().enumerate() {
        if e.event_type.is_empty() || e.event_type.len() > STRING_BYTES_MAX {
            return Err(StoreError::Invalid(format!(
                "events[{i}].type must be 1 to {STRING_BYTES_MAX} bytes"
            )));
        }
        if e.event_type == STARTED_EVENT_TYPE {
            return Err(StoreError::Invalid(format!(
                "events[{i}].type {STARTED_EVENT_TYPE} is written only by a start"
            )));
        }
        if terminal_status(&e.event_type).is_some() && i + 1 != req.events.len() {
            return Err(StoreError::Invalid(format!(
                "events[{i}] ends the execution, so it must be the last event of the batch"
            )));
        }
        if let Some(k) = &e.idempotency_key {
            if k.is_empty() || k.len() > STRING_BYTES_MAX {
                return Err(StoreError::Invalid(format!(
                    "events[{i}].idempotency_key must be 1 to {STRING_BYTES_MAX} bytes"
                )));
            }
            if !keys.insert(k.as_str()) {
                return Err(StoreError::Invalid(format!(
                    "events[{i}].idempotency_key repeats an earlier key of the batch"
                )));
            }
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    //! The machine as a table: a committed state, one group of commands,
    //! and for each command its answer, and the records the group wrote.
    //! No disk: [`Mem`] is the state and the sink.

    use super::*;
    use crate::NewEvent;
    use std::collections::BTreeMap;

    const EPOCH: Epoch = Epoch(3);
    const SETUP_NOW: u64 = 1_000;
    const NOW: u64 = 2_000;

    fn id(n: i64) -> ExecutionId {
        ExecutionId::new(n).expect("a valid execution id")
    }

    /// A shard's committed state, and the records of the group being
    /// applied, described one line each.
    struct Mem {
        epoch: Epoch,
        metas: BTreeMap<ExecutionId, ExecutionMeta>,
        start_idem: BTreeMap<Vec<u8>, ExecutionId>,
        event_idem: BTreeMap<Vec<u8>, u64>,
        /// Committed events, and those the group wrote (as the writer's
        /// `stored_event` finds the group's own).
        events: BTreeMap<(ExecutionId, u64), StoredEvent>,
        records: Vec<String>,
        /// The group's puts, applied to the state at commit.
        puts: Vec<(u8, Vec<u8>, Vec<u8>)>,
        /// The group's preconditions and events, in order.
        pre: Vec<Precondition<'static>>,
        written: Vec<(ExecutionId, u64, Vec<u8>)>,
    }

    impl State for Mem {
        fn epoch(&self) -> Epoch {
            self.epoch
        }
        fn meta(&self, id: ExecutionId) -> Result<Option<ExecutionMeta>, StoreError> {
            Ok(self.metas.get(&id).cloned())
        }
        fn start_idem(&self, key: &[u8]) -> Result<Option<ExecutionId>, StoreError> {
            Ok(self.start_idem.get(key).copied())
        }
        fn event_idem(&self, key: &[u8]) -> Result<Option<u64>, StoreError> {
            Ok(self.event_idem.get(key).copied())
        }
        fn stored_event(&self, id: ExecutionId, seq: u64) -> Result<StoredEvent, StoreError> {
            self.events
                .get(&(id, seq))
                .cloned()
                .ok_or_else(|| StoreError::Corrupt(format!("no event {id}:{seq}")))
        }
    }

    impl Sink for Mem {
        fn precondition(&mut self, p: Precondition<'_>) {
            self.pre.push(p.into_owned());
        }
        fn event(&mut self, id: ExecutionId, seq: u64, recorded_at: u64, value: &[u8]) {
            self.written.push((id, seq, value.to_vec()));
            let e = codec::decode_event(seq, value).expect("the machine encodes events");
            assert_eq!(e.recorded_at_ms, recorded_at);
            self.records
                .push(format!("event {id}:{seq} {} @{recorded_at}", e.event_type));
            self.events.insert((id, seq), e);
        }
        fn put(&mut self, keyspace: u8, key: &[u8], value: &[u8]) {
            let what = match keyspace {
                keyspace_id::META => format!("meta epoch {}", decode(value)),
                keyspace_id::EXECUTIONS => "executions".to_string(),
                keyspace_id::EVENT_IDEM => format!("event_idem {}", decode(value)),
                keyspace_id::ROUTING_KEYS => "routing_keys".to_string(),
                keyspace_id::START_IDEM => format!("start_idem {}", decode(value)),
                other => format!("keyspace {other}"),
            };
            self.records.push(format!("put {what}"));
            self.puts.push((keyspace, key.to_vec(), value.to_vec()));
        }
    }

    fn decode(v: &[u8]) -> u64 {
        codec::decode_u64(v, "test").expect("a u64 value")
    }

    impl Mem {
        /// What the writer does once a group is durable: the overlay's
        /// metadata and the group's puts become the committed state.
        fn commit(&mut self, m: &mut Machine) {
            if let Some(e) = m.epoch_moved() {
                self.epoch = e;
            }
            self.metas.extend(m.take_written());
            for (ks, k, v) in self.puts.drain(..) {
                match ks {
                    keyspace_id::EVENT_IDEM => {
                        self.event_idem.insert(k, decode(&v));
                    }
                    keyspace_id::START_IDEM => {
                        let id = codec::decode_execution_id(&v, "test").expect("an id");
                        self.start_idem.insert(k, id);
                    }
                    _ => {}
                }
            }
            self.records.clear();
            self.pre.clear();
            self.written.clear();
        }
    }

    /// A command of the table.
    #[derive(Debug)]
    enum Cmd {
        Start(StartRequest),
        Append(AppendRequest),
        Epoch(Epoch),
    }

    fn start(n: i64, idem: Option<&str>, routing: Option<&str>) -> Cmd {
        Cmd::Start(StartRequest {
            epoch: EPOCH,
            id: id(n),
            workflow: "w".into(),
            started_payload: b"{}".to_vec(),
            routing_key: routing.map(Into::into),
            idempotency_key: idem.map(Into::into),
        })
    }

    /// `events`: (type, payload, idempotency key).
    fn append(n: i64, events: &[(&str, &str, Option<&str>)], expected: Option<u64>) -> Cmd {
        Cmd::Append(AppendRequest {
            epoch: EPOCH,
            id: id(n),
            events: events
                .iter()
                .map(|(t, p, k)| NewEvent {
                    event_type: (*t).into(),
                    payload: p.as_bytes().to_vec(),
                    idempotency_key: k.map(Into::into),
                })
                .collect(),
            expected_last_seq: expected,
        })
    }

    fn under(epoch: u64, cmd: Cmd) -> Cmd {
        match cmd {
            Cmd::Start(mut r) => {
                r.epoch = Epoch(epoch);
                Cmd::Start(r)
            }
            Cmd::Append(mut r) => {
                r.epoch = Epoch(epoch);
                Cmd::Append(r)
            }
            other => other,
        }
    }

    fn run(m: &mut Machine, s: &mut Mem, cmd: &Cmd, now: u64) -> String {
        match cmd {
            Cmd::Start(r) => match m.start(s, r, now) {
                Ok(o) => format!(
                    "started {} at {} existing {}",
                    o.meta.id, o.meta.created_at_ms, o.existing
                ),
                Err(e) => format!("{e:?}"),
            },
            Cmd::Append(r) => match m.append(s, r, now) {
                Ok(o) => format!(
                    "seqs {}..{} dedup {} {}",
                    o.first_seq,
                    o.last_seq,
                    o.deduplicated,
                    o.status.as_str()
                ),
                Err(e) => format!("{e:?}"),
            },
            Cmd::Epoch(e) => match m.advance_epoch(s, *e) {
                Ok(e) => format!("epoch {e}"),
                Err(e) => format!("{e:?}"),
            },
        }
    }

    /// The state every case starts from, committed in one group:
    /// execution 10 at seq 3 (keys k2 at 2, k3 at 3), created by start
    /// key s10 under routing key r; execution 20 completed at seq 2.
    fn setup() -> (Machine, Mem) {
        let mut m = Machine::default();
        let mut s = Mem {
            epoch: EPOCH,
            metas: BTreeMap::new(),
            start_idem: BTreeMap::new(),
            event_idem: BTreeMap::new(),
            events: BTreeMap::new(),
            records: Vec::new(),
            puts: Vec::new(),
            pre: Vec::new(),
            written: Vec::new(),
        };
        m.begin();
        for cmd in [
            start(10, Some("s10"), Some("r")),
            append(
                10,
                &[("a", "p2", Some("k2")), ("b", "p3", Some("k3"))],
                None,
            ),
            start(20, None, None),
            append(20, &[("execution.completed", "", None)], None),
        ] {
            let out = run(&mut m, &mut s, &cmd, SETUP_NOW);
            assert!(
                out.starts_with("started") || out.starts_with("seqs"),
                "{out}"
            );
        }
        s.commit(&mut m);
        (m, s)
    }

    /// A group in flight (proposed, not applied: the state does not hold
    /// it yet) is part of what the next group is evaluated against, with
    /// the preconditions resting on it, until it is settled.
    #[test]
    fn a_group_is_evaluated_after_the_groups_in_flight() {
        let (mut m, mut s) = setup();
        m.begin();
        let first = [
            start(30, Some("s30"), None),
            append(10, &[("c", "p4", Some("k4"))], None),
        ];
        for cmd in &first {
            run(&mut m, &mut s, cmd, NOW);
        }
        m.push_in_flight();
        assert_eq!(m.groups_in_flight(), 1);
        s.pre.clear();
        m.begin();
        m.push_in_flight();
        s.pre.clear();
        // Two groups in flight now (the second wrote nothing): the third
        // sees both, newest first, and rests on what they wrote.
        m.begin();
        let answers: Vec<String> = [
            append(10, &[("d", "p5", None)], Some(4)),
            start(30, None, None),
            start(31, Some("s30"), None),
            append(30, &[("e", "q", None)], None),
            append(10, &[("c", "p4", Some("k4"))], None),
        ]
        .iter()
        .map(|cmd| run(&mut m, &mut s, cmd, NOW))
        .collect();
        assert_eq!(answers[0], "seqs 5..5 dedup false running");
        assert_eq!(answers[1], "ExecutionExists(ExecutionId(30))");
        assert_eq!(answers[2], "started 30 at 2000 existing true");
        assert_eq!(answers[3], "seqs 2..2 dedup false running");
        // A retry of the group in flight's append (this state reads the
        // event back: the writer's cannot yet, and says "not executed").
        assert_eq!(answers[4], "seqs 4..4 dedup true running");
        assert!(s.pre.contains(&Precondition::Open {
            id: id(10),
            last_seq: 4
        }));
        assert!(s.pre.contains(&Precondition::Open {
            id: id(30),
            last_seq: 1
        }));
        // Settled (applied, but this state was never given them): what
        // they wrote is no longer in the overlays.
        m.settle_oldest();
        m.settle_oldest();
        assert_eq!(m.groups_in_flight(), 0);
        m.begin();
        assert_eq!(
            run(&mut m, &mut s, &append(30, &[("e", "q", None)], None), NOW),
            "NotFound(ExecutionId(30))"
        );
        assert_eq!(
            run(
                &mut m,
                &mut s,
                &append(10, &[("d", "p", None)], Some(4)),
                NOW
            ),
            "SequenceConflict { expected: 4, last_seq: 3 }"
        );
    }

    struct Case {
        name: &'static str,
        group: Vec<Cmd>,
        answers: &'static [&'static str],
        records: &'static [&'static str],
    }

    fn cases() -> Vec<Case> {
        let long = "x".repeat(STRING_BYTES_MAX + 1);
        let long: &'static str = Box::leak(long.into_boxed_str());
        vec![
            Case {
                name: "a start writes its first event and its record",
                group: vec![start(30, None, None)],
                answers: &["started 30 at 2000 existing false"],
                records: &["event 30:1 execution.started @2000", "put executions"],
            },
            Case {
                name: "a start with routing and idempotency keys indexes both",
                group: vec![start(30, Some("s30"), Some("r"))],
                answers: &["started 30 at 2000 existing false"],
                records: &[
                    "event 30:1 execution.started @2000",
                    "put executions",
                    "put routing_keys",
                    "put start_idem 30",
                ],
            },
            Case {
                name: "a start retried with its key answers the first, writes nothing",
                group: vec![start(31, Some("s10"), Some("r"))],
                answers: &["started 10 at 1000 existing true"],
                records: &[],
            },
            Case {
                name: "a start key used earlier in the same group",
                group: vec![start(30, Some("s30"), None), start(31, Some("s30"), None)],
                answers: &[
                    "started 30 at 2000 existing false",
                    "started 30 at 2000 existing true",
                ],
                records: &[
                    "event 30:1 execution.started @2000",
                    "put executions",
                    "put start_idem 30",
                ],
            },
            Case {
                name: "the same start key under another routing key is another start",
                group: vec![start(30, Some("s10"), Some("other"))],
                answers: &["started 30 at 2000 existing false"],
                records: &[
                    "event 30:1 execution.started @2000",
                    "put executions",
                    "put routing_keys",
                    "put start_idem 30",
                ],
            },
            Case {
                name: "an id that exists",
                group: vec![start(10, None, None)],
                answers: &["ExecutionExists(ExecutionId(10))"],
                records: &[],
            },
            Case {
                name: "an id started earlier in the same group",
                group: vec![start(30, None, None), start(30, None, None)],
                answers: &[
                    "started 30 at 2000 existing false",
                    "ExecutionExists(ExecutionId(30))",
                ],
                records: &["event 30:1 execution.started @2000", "put executions"],
            },
            Case {
                name: "a start under an old epoch is fenced",
                group: vec![under(2, start(30, None, None))],
                answers: &["Fenced { presented: Epoch(2), current: Epoch(3) }"],
                records: &[],
            },
            Case {
                name: "a start under a newer epoch than the shard's is fenced too",
                group: vec![under(4, start(30, None, None))],
                answers: &["Fenced { presented: Epoch(4), current: Epoch(3) }"],
                records: &[],
            },
            Case {
                name: "an oversize workflow name",
                group: vec![Cmd::Start(StartRequest {
                    epoch: EPOCH,
                    id: id(30),
                    workflow: long.into(),
                    started_payload: vec![],
                    routing_key: None,
                    idempotency_key: None,
                })],
                answers: &["Invalid(\"workflow is longer than 65535 bytes\")"],
                records: &[],
            },
            Case {
                name: "an oversize routing key",
                group: vec![start(30, None, Some(long))],
                answers: &["Invalid(\"routing_key is longer than 65535 bytes\")"],
                records: &[],
            },
            Case {
                name: "an append takes the next seqs, each key indexed",
                group: vec![append(
                    10,
                    &[("c", "p4", Some("k4")), ("d", "p5", None)],
                    Some(3),
                )],
                answers: &["seqs 4..5 dedup false running"],
                records: &[
                    "event 10:4 c @2000",
                    "put event_idem 4",
                    "event 10:5 d @2000",
                ],
            },
            Case {
                name: "appends in one group follow each other",
                group: vec![
                    append(10, &[("c", "", None)], Some(3)),
                    append(10, &[("d", "", None)], Some(3)),
                    append(10, &[("d", "", None)], Some(4)),
                ],
                answers: &[
                    "seqs 4..4 dedup false running",
                    "SequenceConflict { expected: 3, last_seq: 4 }",
                    "seqs 5..5 dedup false running",
                ],
                records: &["event 10:4 c @2000", "event 10:5 d @2000"],
            },
            Case {
                name: "a terminal event closes the execution and rewrites its record",
                group: vec![
                    append(10, &[("execution.failed", "", None)], None),
                    append(10, &[("late", "", None)], None),
                ],
                answers: &[
                    "seqs 4..4 dedup false failed",
                    "ExecutionClosed { status: Failed, last_seq: 4 }",
                ],
                records: &["event 10:4 execution.failed @2000", "put executions"],
            },
            Case {
                name: "an append to a closed execution",
                group: vec![append(20, &[("late", "", None)], None)],
                answers: &["ExecutionClosed { status: Completed, last_seq: 2 }"],
                records: &[],
            },
            Case {
                name: "an append to an execution that does not exist",
                group: vec![append(99, &[("a", "", None)], None)],
                answers: &["NotFound(ExecutionId(99))"],
                records: &[],
            },
            Case {
                name: "an append under another epoch is fenced before anything else",
                group: vec![under(2, append(99, &[], None))],
                answers: &["Fenced { presented: Epoch(2), current: Epoch(3) }"],
                records: &[],
            },
            Case {
                name: "a stale expected_last_seq",
                group: vec![append(10, &[("a", "", None)], Some(2))],
                answers: &["SequenceConflict { expected: 2, last_seq: 3 }"],
                records: &[],
            },
            Case {
                name: "a retry of an applied batch answers its seqs, writes nothing",
                group: vec![append(
                    10,
                    &[("a", "p2", Some("k2")), ("b", "p3", Some("k3"))],
                    Some(1),
                )],
                answers: &["seqs 2..3 dedup true running"],
                records: &[],
            },
            Case {
                name: "a retry of a closed execution's batch still answers",
                group: vec![
                    append(10, &[("execution.completed", "", Some("k4"))], None),
                    append(10, &[("execution.completed", "", Some("k4"))], None),
                ],
                answers: &[
                    "seqs 4..4 dedup false completed",
                    "seqs 4..4 dedup true completed",
                ],
                records: &[
                    "event 10:4 execution.completed @2000",
                    "put event_idem 4",
                    "put executions",
                ],
            },
            Case {
                name: "a used key with another payload",
                group: vec![append(10, &[("a", "other", Some("k2"))], None)],
                answers: &[
                    "IdempotencyKeyReused { index: 0, key: \"k2\", seq: 2, differs: \"payload\" }",
                ],
                records: &[],
            },
            Case {
                name: "a used key with another type",
                group: vec![append(10, &[("x", "p2", Some("k2"))], None)],
                answers: &[
                    "IdempotencyKeyReused { index: 0, key: \"k2\", seq: 2, differs: \"type\" }",
                ],
                records: &[],
            },
            Case {
                name: "a key used earlier in the same group, with another payload",
                group: vec![
                    append(10, &[("c", "one", Some("k9"))], None),
                    append(10, &[("c", "two", Some("k9"))], None),
                ],
                answers: &[
                    "seqs 4..4 dedup false running",
                    "IdempotencyKeyReused { index: 0, key: \"k9\", seq: 4, differs: \"payload\" }",
                ],
                records: &["event 10:4 c @2000", "put event_idem 4"],
            },
            Case {
                name: "a batch mixing a used key with new ones",
                group: vec![append(
                    10,
                    &[("c", "", Some("k5")), ("a", "p2", Some("k2")), ("d", "", None)],
                    None,
                )],
                answers: &[
                    "IdempotencyConflict { index: 1, key: \"k2\", seq: 2, unkeyed: Some(2) }",
                ],
                records: &[],
            },
            Case {
                name: "an empty batch",
                group: vec![append(10, &[], None)],
                answers: &["Invalid(\"events must not be empty\")"],
                records: &[],
            },
            Case {
                name: "an event typed as a start",
                group: vec![append(10, &[("execution.started", "", None)], None)],
                answers: &[
                    "Invalid(\"events[0].type execution.started is written only by a start\")",
                ],
                records: &[],
            },
            Case {
                name: "a terminal event before the end of the batch",
                group: vec![append(
                    10,
                    &[("execution.cancelled", "", None), ("a", "", None)],
                    None,
                )],
                answers: &[
                    "Invalid(\"events[0] ends the execution, so it must be the last event of the batch\")",
                ],
                records: &[],
            },
            Case {
                name: "a key repeated within a batch",
                group: vec![append(
                    10,
                    &[("a", "", Some("k")), ("b", "", Some("k"))],
                    None,
                )],
                answers: &[
                    "Invalid(\"events[1].idempotency_key repeats an earlier key of the batch\")",
                ],
                records: &[],
            },
            Case {
                name: "an empty type and an empty key",
                group: vec![
                    append(10, &[("", "", None)], None),
                    append(10, &[("a", "", Some(""))], None),
                ],
                answers: &[
                    "Invalid(\"events[0].type must be 1 to 65535 bytes\")",
                    "Invalid(\"events[0].idempotency_key must be 1 to 65535 bytes\")",
                ],
                records: &[],
            },
            Case {
                name: "the epoch moves forward and fences the group's later commands",
                group: vec![
                    Cmd::Epoch(Epoch(5)),
                    append(10, &[("a", "", None)], None),
                    under(5, append(10, &[("a", "", None)], None)),
                ],
                answers: &[
                    "epoch 5",
                    "Fenced { presented: Epoch(3), current: Epoch(5) }",
                    "seqs 4..4 dedup false running",
                ],
                records: &["put meta epoch 5", "event 10:4 a @2000"],
            },
            Case {
                name: "the epoch it has writes nothing; an older one is refused",
                group: vec![Cmd::Epoch(EPOCH), Cmd::Epoch(Epoch(2))],
                answers: &[
                    "epoch 3",
                    "EpochRegression { current: Epoch(3), requested: Epoch(2) }",
                ],
                records: &[],
            },
        ]
    }

    #[test]
    fn every_command_as_a_table() {
        for case in cases() {
            let (mut m, mut s) = setup();
            m.begin();
            let answers: Vec<String> = case
                .group
                .iter()
                .map(|cmd| run(&mut m, &mut s, cmd, NOW))
                .collect();
            assert_eq!(answers, case.answers, "answers: {}", case.name);
            assert_eq!(s.records, case.records, "records: {}", case.name);
        }
    }

    #[test]
    fn the_same_commands_on_the_same_state_write_the_same_bytes() {
        // Two replicas: same state, same group, same `now`.
        let group = || {
            vec![
                start(30, Some("s30"), Some("r")),
                append(30, &[("a", "p", Some("k")), ("b", "q", None)], Some(1)),
                append(10, &[("c", "x", Some("k2"))], None),
                append(10, &[("execution.completed", "", None)], Some(3)),
            ]
        };
        let mut replicas = [setup(), setup()];
        let mut written = Vec::new();
        for (m, s) in &mut replicas {
            m.begin();
            let answers: Vec<String> = group().iter().map(|c| run(m, s, c, NOW)).collect();
            let events: Vec<_> = s.events.clone().into_iter().collect();
            written.push((answers, s.records.clone(), s.puts.clone(), events));
        }
        assert_eq!(written[0], written[1]);
    }

    /// What one command did: its preconditions, events and puts.
    struct Did {
        answer: String,
        pre: Vec<Precondition<'static>>,
        events: Vec<(ExecutionId, u64, Vec<u8>)>,
        puts: Vec<(u8, Vec<u8>, Vec<u8>)>,
    }

    /// Runs `cmds` as one group on `s`, keeping what each command did.
    fn group_did(m: &mut Machine, s: &mut Mem, cmds: &[Cmd]) -> Vec<Did> {
        m.begin();
        cmds.iter()
            .map(|cmd| {
                let (p, e, u) = (s.pre.len(), s.written.len(), s.puts.len());
                let answer = run(m, s, cmd, NOW);
                Did {
                    answer,
                    pre: s.pre[p..].to_vec(),
                    events: s.written[e..].to_vec(),
                    puts: s.puts[u..].to_vec(),
                }
            })
            .collect()
    }

    fn describe(p: &Precondition<'_>) -> String {
        match p {
            Precondition::Epoch(e) => format!("epoch {e}"),
            Precondition::Open { id, last_seq } => format!("open {id} at {last_seq}"),
            Precondition::Absent(id) => format!("absent {id}"),
            Precondition::EventKeyUnused(_) => "event key unused".into(),
            Precondition::StartKeyUnused(_) => "start key unused".into(),
        }
    }

    /// Checks each command as a replica with `state` would, feeding the
    /// checker what the earlier ones applied; the first refusal, if any.
    fn replica_check(state: &Mem, did: &[Did]) -> Result<(), String> {
        let mut c = Checker::default();
        c.begin();
        for d in did {
            c.check(state, &d.pre).map_err(|e| e.to_string())??;
            for (id, seq, v) in &d.events {
                c.event(*id, *seq, v).map_err(|e| e.to_string())?;
            }
            for (ks, k, v) in &d.puts {
                c.put(*ks, k, v).map_err(|e| e.to_string())?;
            }
        }
        Ok(())
    }

    #[test]
    fn a_writing_command_names_what_it_read_and_a_refused_one_nothing() {
        let cases: Vec<(Cmd, &[&str])> = vec![
            (
                start(30, Some("s30"), Some("r")),
                &["epoch 3", "absent 30", "start key unused"],
            ),
            (start(30, None, None), &["epoch 3", "absent 30"]),
            (
                append(10, &[("c", "", Some("k4")), ("d", "", None)], Some(3)),
                &["epoch 3", "open 10 at 3", "event key unused"],
            ),
            (Cmd::Epoch(Epoch(5)), &["epoch 3"]),
            // Refused, deduplicated, or a no-op: nothing written, nothing read.
            (append(20, &[("late", "", None)], None), &[]),
            (
                append(
                    10,
                    &[("a", "p2", Some("k2")), ("b", "p3", Some("k3"))],
                    None,
                ),
                &[],
            ),
            (start(31, Some("s10"), Some("r")), &[]),
            (Cmd::Epoch(EPOCH), &[]),
        ];
        for (cmd, want) in cases {
            let (mut m, mut s) = setup();
            let did = group_did(&mut m, &mut s, std::slice::from_ref(&cmd));
            let got: Vec<String> = did[0].pre.iter().map(describe).collect();
            assert_eq!(got, want, "{}", did[0].answer);
        }
    }

    #[test]
    fn every_replica_checks_them_against_its_own_state() {
        let group = || {
            vec![
                start(30, Some("s30"), None),
                append(30, &[("a", "", Some("k"))], None),
                append(10, &[("c", "", Some("k4"))], Some(3)),
                append(10, &[("execution.completed", "", None)], None),
            ]
        };
        let (mut m, mut leader) = setup();
        let did = group_did(&mut m, &mut leader, &group());
        // A replica with the state the leader evaluated against agrees.
        let (_, same) = setup();
        assert_eq!(replica_check(&same, &did), Ok(()));
        // Replicas whose state differs refuse, naming what differs.
        type Diverge = fn(&mut Mem);
        let diverged: [(&str, Diverge, &str); 5] = [
            (
                "an event more",
                |s| {
                    if let Some(meta) = s.metas.get_mut(&id(10)) {
                        meta.last_seq = 4;
                    }
                },
                "execution 10 is open at seq 4, not open at 3",
            ),
            (
                "closed",
                |s| {
                    if let Some(meta) = s.metas.get_mut(&id(10)) {
                        meta.status = ExecutionStatus::Cancelled;
                    }
                },
                "execution 10 is closed at seq 3, not open at 3",
            ),
            (
                "the epoch moved",
                |s| s.epoch = Epoch(4),
                "the epoch is 4, not 3",
            ),
            (
                "the execution exists",
                |s| {
                    let mut meta = s.metas[&id(20)].clone();
                    meta.id = id(30);
                    s.metas.insert(id(30), meta);
                },
                "execution 30 exists",
            ),
            (
                "a key used",
                |s| {
                    let k = codec::event_idem_key(id(10).partition(), id(10), "k4");
                    s.event_idem.insert(k, 9);
                },
                "an event idempotency key is used",
            ),
        ];
        for (what, diverge, why) in diverged {
            let (_, mut replica) = setup();
            diverge(&mut replica);
            assert_eq!(
                replica_check(&replica, &did),
                Err(why.to_string()),
                "{what}"
            );
        }
    }

    #[test]
    fn a_later_command_rests_on_what_the_earlier_ones_of_its_entry_wrote() {
        let (mut m, mut leader) = setup();
        let did = group_did(
            &mut m,
            &mut leader,
            &[
                append(10, &[("c", "", None)], None),
                append(10, &[("d", "", None)], None),
            ],
        );
        let got: Vec<String> = did[1].pre.iter().map(describe).collect();
        assert_eq!(got, ["epoch 3", "open 10 at 4"]);
        let (_, replica) = setup();
        assert_eq!(replica_check(&replica, &did), Ok(()));
        // Without the first command's event the second does not hold.
        let mut c = Checker::default();
        c.begin();
        assert!(matches!(c.check(&replica, &did[1].pre), Ok(Err(_))));
    }

    #[test]
    fn a_put_to_a_keyspace_this_version_does_not_know_stops_the_apply() {
        let mut c = Checker::default();
        c.begin();
        assert!(c.put(keyspace_id::START_IDEM, b"k", b"v").is_ok());
        assert!(matches!(c.put(9, b"k", b"v"), Err(StoreError::Corrupt(_))));
    }

    #[test]
    fn a_read_that_fails_is_the_replicas_failure_not_a_precondition_that_does_not_hold() {
        // A replica whose reads of its state fail (a disk error).
        let (_, replica) = setup();
        let broken = crate::apply::FailingReads(&replica);
        let mut c = Checker::default();
        c.begin();
        let id = id(7);
        for p in [
            Precondition::Open { id, last_seq: 1 },
            Precondition::Absent(id),
            Precondition::EventKeyUnused(std::borrow::Cow::Borrowed(b"k")),
            Precondition::StartKeyUnused(std::borrow::Cow::Borrowed(b"k")),
        ] {
            let what = describe(&p);
            let checked = c.check(&broken, &[Precondition::Epoch(EPOCH), p]);
            assert!(
                matches!(checked, Err(StoreError::Io(_))),
                "{what}: {checked:?}"
            );
        }
        // What holds or not without a read is checked as ever.
        assert!(matches!(
            c.check(&broken, &[Precondition::Epoch(Epoch(EPOCH.get() + 1))]),
            Ok(Err(_))
        ));
        assert!(matches!(
            c.check(&broken, &[Precondition::Epoch(EPOCH)]),
            Ok(Ok(()))
        ));
    }

    mod agree {
        use super::*;
        use proptest::prelude::*;

        fn cmd() -> impl Strategy<Value = Cmd> {
            prop_oneof![
                (
                    30i64..34,
                    prop::option::of(0u8..2),
                    prop::option::of(0u8..2)
                )
                    .prop_map(|(n, k, r)| {
                        let k = k.map(|k| ["s1", "s2"][usize::from(k)]);
                        let r = r.map(|r| ["r1", "r2"][usize::from(r)]);
                        start(n, k, r)
                    }),
                (
                    prop::sample::select(vec![10i64, 20, 30, 31, 32, 33]),
                    prop::collection::vec((0u8..4, prop::option::of(0u8..4)), 1..3),
                    prop::option::of(1u64..7)
                )
                    .prop_map(|(n, events, expected)| {
                        let types = ["a", "b", "c", "execution.completed"];
                        let keys = ["k1", "k2", "k3", "k4"];
                        let mut events: Vec<(&str, &str, Option<&str>)> = events
                            .into_iter()
                            .map(|(t, k)| {
                                (types[usize::from(t)], "", k.map(|k| keys[usize::from(k)]))
                            })
                            .collect();
                        // One terminal event at most, and last.
                        let last = events.len() - 1;
                        for (i, e) in events.iter_mut().enumerate() {
                            if e.0 == "execution.completed" && i != last {
                                e.0 = "a";
                            }
                        }
                        append(n, &events, expected)
                    }),
                (3u64..6).prop_map(|e| Cmd::Epoch(Epoch(e))),
            ]
        }

        proptest! {
            /// Whatever the commands, a replica with the leader's state
            /// accepts every writing command's preconditions: the machine
            /// and the checker agree.
            #[test]
            fn the_machine_and_the_checker_agree(
                groups in prop::collection::vec(prop::collection::vec(cmd(), 1..6), 1..5)
            ) {
                let (mut m, mut leader) = setup();
                for cmds in &groups {
                    let did = group_did(&mut m, &mut leader, cmds);
                    prop_assert_eq!(replica_check(&leader, &did), Ok(()));
                    leader.commit(&mut m);
                }
            }
        }
    }
}
