//! The shard's single writer: drains its queue into one atomic batch and one
//! fsync (group commit), then answers every command the batch covered.
//!
//! Being the only writer of its shard, it can check sequence numbers, the
//! closed state, idempotency keys and the epoch against what is on disk plus
//! what earlier commands of the same batch wrote (the overlay), with no locks.
//! Answers go out only after the batch is durable; if the commit fails, every
//! command in it fails and the shard stops taking writes (the storage may be
//! in an unknown state after a failed fsync, so it fails stop).

use crate::codec;
use crate::shard::{Keyspaces, EPOCH_KEY};
use crate::{
    terminal_status, AppendOutcome, AppendRequest, ExecutionMeta, ExecutionStatus, StartOutcome,
    StartRequest, StoreError, GROUP_COMMIT_BYTES_MAX, GROUP_COMMIT_COMMANDS_MAX,
    STARTED_EVENT_TYPE, STRING_BYTES_MAX,
};
use fjall::{OwnedWriteBatch, PersistMode};
use forkless_types::{Epoch, ExecutionId, PartitionId, ShardId};
use std::collections::{HashMap, HashSet};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use tokio::sync::{mpsc, oneshot, watch};

pub(crate) enum Command {
    Start(
        StartRequest,
        oneshot::Sender<Result<StartOutcome, StoreError>>,
    ),
    Append(
        AppendRequest,
        oneshot::Sender<Result<AppendOutcome, StoreError>>,
    ),
    AdvanceEpoch(Epoch, oneshot::Sender<Result<Epoch, StoreError>>),
}

impl Command {
    fn payload_bytes(&self) -> usize {
        match self {
            Command::Start(r, _) => r.started_payload.len() + r.workflow.len(),
            Command::Append(r, _) => r
                .events
                .iter()
                .map(|e| e.payload.len() + e.event_type.len())
                .sum(),
            Command::AdvanceEpoch(..) => 0,
        }
    }
}

enum Reply {
    Start(
        oneshot::Sender<Result<StartOutcome, StoreError>>,
        Result<StartOutcome, StoreError>,
    ),
    Append(
        oneshot::Sender<Result<AppendOutcome, StoreError>>,
        Result<AppendOutcome, StoreError>,
    ),
    Epoch(
        oneshot::Sender<Result<Epoch, StoreError>>,
        Result<Epoch, StoreError>,
    ),
}

impl Reply {
    fn send(self) {
        // A caller that went away (client disconnected) is not an error: the
        // write is durable either way.
        match self {
            Reply::Start(tx, r) => drop(tx.send(r)),
            Reply::Append(tx, r) => drop(tx.send(r)),
            Reply::Epoch(tx, r) => drop(tx.send(r)),
        }
    }

    fn fail(self, err: StoreError) -> Reply {
        match self {
            Reply::Start(tx, Ok(_)) => Reply::Start(tx, Err(err)),
            Reply::Append(tx, Ok(_)) => Reply::Append(tx, Err(err)),
            Reply::Epoch(tx, Ok(_)) => Reply::Epoch(tx, Err(err)),
            other => other,
        }
    }
}

pub(crate) fn spawn(
    shard: ShardId,
    ks: Keyspaces,
    rx: mpsc::Receiver<Command>,
    epoch: Arc<AtomicU64>,
    commits: watch::Sender<u64>,
) -> Result<(), StoreError> {
    std::thread::Builder::new()
        .name(format!("shard-{shard}-writer"))
        .spawn(move || {
            Writer {
                shard,
                ks,
                epoch,
                commits,
                failed: None,
                cache: HashMap::new(),
            }
            .run(rx)
        })
        .map(|_| ())
        .map_err(|e| StoreError::Io(format!("spawning writer thread: {e}")))
}

struct Writer {
    shard: ShardId,
    ks: Keyspaces,
    epoch: Arc<AtomicU64>,
    commits: watch::Sender<u64>,
    /// Set after a failed commit: every later write is refused with it.
    failed: Option<StoreError>,
    /// Metadata of recently written executions, exactly as on disk: the
    /// writer is the shard's only writer and updates it only after a commit
    /// succeeded, so it can never be ahead of or behind the disk. Saves a
    /// memtable/table lookup per append on the hot path.
    cache: HashMap<ExecutionId, ExecutionMeta>,
}

/// Entries the writer's metadata cache holds before it is emptied and
/// refilled (a crude but bounded policy: about 200 bytes an entry).
const META_CACHE_ENTRIES_MAX: usize = 65_536;

/// What earlier commands of the batch being built wrote.
#[derive(Default)]
struct Overlay {
    metas: HashMap<ExecutionId, ExecutionMeta>,
    event_idem: HashMap<Vec<u8>, u64>,
    start_idem: HashMap<Vec<u8>, ExecutionId>,
    epoch: Option<Epoch>,
}

impl Writer {
    fn run(mut self, mut rx: mpsc::Receiver<Command>) {
        let mut cmds = Vec::with_capacity(GROUP_COMMIT_COMMANDS_MAX);
        while let Some(first) = rx.blocking_recv() {
            let mut bytes = first.payload_bytes();
            cmds.push(first);
            while cmds.len() < GROUP_COMMIT_COMMANDS_MAX && bytes < GROUP_COMMIT_BYTES_MAX {
                match rx.try_recv() {
                    Ok(c) => {
                        bytes += c.payload_bytes();
                        cmds.push(c);
                    }
                    Err(_) => break,
                }
            }
            self.commit_group(&mut cmds);
        }
        tracing::debug!(shard = %self.shard, "writer stopped: every handle was dropped");
    }

    fn commit_group(&mut self, cmds: &mut Vec<Command>) {
        let now = now_ms();
        let mut batch = self.ks.db.batch().durability(Some(PersistMode::SyncData));
        let mut overlay = Overlay::default();
        let mut replies = Vec::with_capacity(cmds.len());
        for cmd in cmds.drain(..) {
            replies.push(match cmd {
                Command::Start(req, tx) => {
                    Reply::Start(tx, self.start(&mut batch, &mut overlay, req, now))
                }
                Command::Append(req, tx) => {
                    Reply::Append(tx, self.append(&mut batch, &mut overlay, req, now))
                }
                Command::AdvanceEpoch(e, tx) => {
                    Reply::Epoch(tx, self.advance_epoch(&mut batch, &mut overlay, e))
                }
            });
        }
        if !batch.is_empty() {
            if let Err(e) = batch.commit() {
                let err = StoreError::Io(format!("shard {} commit failed: {e}", self.shard));
                tracing::error!(shard = %self.shard, error = %e, "commit failed; the shard refuses writes from now on");
                self.failed = Some(err.clone());
                for r in replies {
                    r.fail(err.clone()).send();
                }
                return;
            }
            if let Some(e) = overlay.epoch {
                self.epoch.store(e.get(), Ordering::Release);
            }
            if self.cache.len() + overlay.metas.len() > META_CACHE_ENTRIES_MAX {
                self.cache.clear();
            }
            self.cache.extend(overlay.metas);
            self.commits.send_modify(|c| *c += 1);
        }
        for r in replies {
            r.send();
        }
    }

    fn current_epoch(&self, overlay: &Overlay) -> Epoch {
        overlay
            .epoch
            .unwrap_or(Epoch(self.epoch.load(Ordering::Acquire)))
    }

    fn check_writable(&self, overlay: &Overlay, presented: Epoch) -> Result<(), StoreError> {
        if let Some(e) = &self.failed {
            return Err(e.clone());
        }
        let current = self.current_epoch(overlay);
        if presented != current {
            return Err(StoreError::Fenced { presented, current });
        }
        Ok(())
    }

    fn advance_epoch(
        &self,
        batch: &mut OwnedWriteBatch,
        overlay: &mut Overlay,
        e: Epoch,
    ) -> Result<Epoch, StoreError> {
        if let Some(err) = &self.failed {
            return Err(err.clone());
        }
        let current = self.current_epoch(overlay);
        if e < current {
            return Err(StoreError::EpochRegression {
                current,
                requested: e,
            });
        }
        if e > current {
            batch.insert(&self.ks.meta, EPOCH_KEY, codec::u64_value(e.get()).to_vec());
            overlay.epoch = Some(e);
        }
        Ok(e)
    }

    fn meta(
        &self,
        overlay: &Overlay,
        id: ExecutionId,
    ) -> Result<Option<ExecutionMeta>, StoreError> {
        if let Some(m) = overlay.metas.get(&id).or_else(|| self.cache.get(&id)) {
            return Ok(Some(m.clone()));
        }
        // Only this thread writes the shard, so the latest committed state
        // is the state: no snapshot needed beyond the database's own.
        crate::shard::read_meta(&self.ks, &self.ks.db.snapshot(), id)
    }

    fn start(
        &self,
        batch: &mut OwnedWriteBatch,
        overlay: &mut Overlay,
        req: StartRequest,
        now: u64,
    ) -> Result<StartOutcome, StoreError> {
        self.check_writable(overlay, req.epoch)?;
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
            let existing = lookup(&overlay.start_idem, &self.ks.start_idem, k, |v| {
                codec::decode_execution_id(v, "start idempotency index")
            })?;
            if let Some(id) = existing {
                let meta = self.meta(overlay, id)?.ok_or_else(|| {
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
        if self.meta(overlay, req.id)?.is_some() {
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
        batch.insert(
            &self.ks.events,
            codec::event_key(p, req.id, 1).to_vec(),
            codec::encode_event(now, STARTED_EVENT_TYPE, None, &req.started_payload),
        );
        batch.insert(
            &self.ks.executions,
            codec::execution_key(p, req.id).to_vec(),
            codec::encode_meta(&meta),
        );
        if let Some(rk) = &req.routing_key {
            batch.insert(
                &self.ks.routing_keys,
                codec::routing_key_entry(PartitionId::for_key(rk), rk, req.id),
                Vec::new(),
            );
        }
        if let Some(k) = idem_key {
            batch.insert(
                &self.ks.start_idem,
                k.clone(),
                codec::u64_value(req.id.get() as u64).to_vec(),
            );
            overlay.start_idem.insert(k, req.id);
        }
        overlay.metas.insert(req.id, meta.clone());
        Ok(StartOutcome {
            meta,
            existing: false,
        })
    }

    fn append(
        &self,
        batch: &mut OwnedWriteBatch,
        overlay: &mut Overlay,
        req: AppendRequest,
        now: u64,
    ) -> Result<AppendOutcome, StoreError> {
        self.check_writable(overlay, req.epoch)?;
        validate_events(&req)?;
        let Some(mut meta) = self.meta(overlay, req.id)? else {
            return Err(StoreError::NotFound(req.id));
        };
        let p = req.id.partition();

        // Idempotency first: a retry of a batch that was applied must get the
        // original answer even though the log has moved on since.
        let mut found = Vec::new();
        for (i, e) in req.events.iter().enumerate() {
            if let Some(idem) = &e.idempotency_key {
                let k = codec::event_idem_key(p, req.id, idem);
                let seq = lookup(&overlay.event_idem, &self.ks.event_idem, &k, |v| {
                    codec::decode_u64(v, "event idempotency index")
                })?;
                if let Some(seq) = seq {
                    found.push((i, idem.clone(), seq));
                }
            }
        }
        if !found.is_empty() {
            if found.len() == req.events.len() {
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
            return Err(StoreError::IdempotencyConflict { index, key, seq });
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
        for e in &req.events {
            let seq = meta.last_seq + 1;
            batch.insert(
                &self.ks.events,
                codec::event_key(p, req.id, seq).to_vec(),
                codec::encode_event(now, &e.event_type, e.idempotency_key.as_deref(), &e.payload),
            );
            if let Some(idem) = &e.idempotency_key {
                let k = codec::event_idem_key(p, req.id, idem);
                batch.insert(
                    &self.ks.event_idem,
                    k.clone(),
                    codec::u64_value(seq).to_vec(),
                );
                overlay.event_idem.insert(k, seq);
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
            batch.insert(
                &self.ks.executions,
                codec::execution_key(p, req.id).to_vec(),
                codec::encode_meta(&meta),
            );
        }
        let (last_seq, status) = (meta.last_seq, meta.status);
        overlay.metas.insert(req.id, meta);
        Ok(AppendOutcome {
            first_seq,
            last_seq,
            deduplicated: false,
            status,
        })
    }
}

/// An index entry as of the batch being built: what an earlier command of
/// the batch wrote, else what is on disk.
fn lookup<T: Copy>(
    pending: &HashMap<Vec<u8>, T>,
    on_disk: &fjall::Keyspace,
    key: &[u8],
    decode: impl Fn(&[u8]) -> Result<T, StoreError>,
) -> Result<Option<T>, StoreError> {
    if let Some(v) = pending.get(key) {
        return Ok(Some(*v));
    }
    on_disk.get(key)?.map(|v| decode(&v)).transpose()
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

fn now_ms() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_millis() as u64)
        .unwrap_or(0)
}
