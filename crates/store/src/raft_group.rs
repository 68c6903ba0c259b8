//! A shard's Raft group: its state machine over the shard's state
//! ([`ShardMachine`], applying entries with [`Applier`]), the network of
//! a group whose only member is this node ([`Alone`]), its configuration,
//! and how it starts (`docs/replication.md`, step 5).
//!
//! What a replica keeps in its `meta` keyspace for Raft, beside the
//! events index's checkpoint (`index::CHECKPOINT_KEY`, the node-log
//! position a reopen reads from):
//!
//! - `raft.applied`: the last entry applied, in the batch of the entry's
//!   own puts ([`crate::apply::APPLIED_KEY`]);
//! - `raft.membership`: the last membership applied (JSON);
//! - `raft.checkpoint`: the last entry applied as of the checkpoint, and
//!   the vote then: at open, the group's log starts after that entry (its
//!   purge mark), and its vote is the last vote part after the
//!   checkpoint's position, else this one.
//!
//! **Snapshots are checkpoints.** A checkpoint makes the shard's state as
//! of an applied entry durable in its keyspaces (the events stay in the
//! log), which is what openraft needs a snapshot for on this replica: to
//! know which entries it may purge. Each checkpoint also keeps a fjall
//! snapshot of the keyspaces as they were then, which is what a leader
//! streams to a replica that needs entries it no longer keeps (the
//! shard's keyspaces and every event: `crate::snapshot`, which also says
//! how a replica installs one and how a crash during an install is
//! recovered from).

use crate::apply::{self, Applied, Applier};
use crate::checkpoints::CheckpointCounters;
use crate::keyspaces::Keyspaces;
use crate::node_log::NodeLog;
use crate::raft_log::{GroupConfig, RaftLogRead};
use crate::StoreError;
use futures_util::StreamExt;
use openraft::errors::{RPCError, ReplicationClosed, StreamingError, Unreachable};
use openraft::network::RPCOption;
use openraft::raft::{
    AppendEntriesRequest, AppendEntriesResponse, SnapshotResponse, VoteRequest, VoteResponse,
};
use openraft::storage::{EntryResponder, RaftSnapshotBuilder, RaftStateMachine};
use openraft::type_config::alias::{
    LogIdOf, SnapshotMetaOf, SnapshotOf, StoredMembershipOf, VoteOf,
};
use openraft::{BasicNode, EntryPayload, OptionalSend, RaftNetworkFactory, RaftNetworkV2};
use std::io;
use std::sync::atomic::Ordering;
use std::sync::{Arc, Mutex, MutexGuard};

type LogId = LogIdOf<GroupConfig>;
type Vote = VoteOf<GroupConfig>;
type Membership = StoredMembershipOf<GroupConfig>;
type Meta = SnapshotMetaOf<GroupConfig>;

pub(crate) use crate::apply::{CHECKPOINT_KEY, MEMBERSHIP_KEY};

pub use crate::raft_net::ShardSnapshot;
use crate::raft_net::SnapshotData;

fn io_error(e: StoreError) -> io::Error {
    io::Error::other(e.to_string())
}

/// The applied state as the keyspaces hold it: the last entry applied and
/// the membership.
pub(crate) fn applied_state(ks: &Keyspaces) -> Result<(Option<LogId>, Membership), StoreError> {
    let applied = ks
        .meta
        .get(apply::APPLIED_KEY)?
        .map(|v| apply::decode_applied(&v))
        .transpose()?
        .map(|(term, index)| log_id(term, index));
    let membership = match ks.meta.get(MEMBERSHIP_KEY)? {
        Some(v) => serde_json::from_slice(&v)
            .map_err(|e| StoreError::Corrupt(format!("the group's membership: {e}")))?,
        None => Membership::default(),
    };
    Ok((applied, membership))
}

/// The group's state as of its last checkpoint: the last entry applied
/// then, and the vote then.
pub(crate) fn checkpointed(ks: &Keyspaces) -> Result<(Option<LogId>, Option<Vote>), StoreError> {
    let Some(v) = ks.meta.get(CHECKPOINT_KEY)? else {
        return Ok((None, None));
    };
    let bad = || StoreError::Corrupt("the group's checkpoint record".into());
    let applied = match v.first() {
        Some(0) => None,
        Some(1) if v.len() >= 17 => {
            let (term, index) = apply::decode_applied(&v[1..17])?;
            Some(log_id(term, index))
        }
        _ => return Err(bad()),
    };
    let rest = if applied.is_some() { &v[17..] } else { &v[1..] };
    let vote = match rest {
        [] => None,
        [t @ .., committed] if t.len() == 16 && *committed <= 1 => {
            let term = u64::from_be_bytes(t[..8].try_into().map_err(|_| bad())?);
            let node = u64::from_be_bytes(t[8..].try_into().map_err(|_| bad())?);
            let mut vote = Vote::new(term, node);
            vote.committed = *committed == 1;
            Some(vote)
        }
        _ => return Err(bad()),
    };
    Ok((applied, vote))
}

fn encode_checkpointed(applied: Option<LogId>, vote: Option<Vote>) -> Vec<u8> {
    let mut v = Vec::with_capacity(34);
    match applied {
        None => v.push(0),
        Some(l) => {
            v.push(1);
            v.extend_from_slice(&apply::applied_value(l.leader_id.term, l.index));
        }
    }
    if let Some(vote) = vote {
        v.extend_from_slice(&vote.leader_id.term.to_be_bytes());
        v.extend_from_slice(&vote.leader_id.voted_for.to_be_bytes());
        v.push(u8::from(vote.committed));
    }
    v
}

pub(crate) fn log_id(term: u64, index: u64) -> LogId {
    LogId::new(
        openraft::vote::leader_id_std::CommittedLeaderId::new(term),
        index,
    )
}

/// A shard's replica state behind its Raft group: what applies entries
/// and checkpoints, shared by the state machine openraft drives and the
/// shard's writer (which asks for checkpoints: the sweep's, and the one at
/// close).
pub(crate) struct Replica {
    applier: Mutex<Applier>,
    ks: Keyspaces,
    node: NodeLog,
    log: RaftLogRead,
    /// Node-log bytes written between checkpoints
    /// ([`crate::StoreConfig::log_checkpoint_bytes`]).
    every: u64,
    /// Shared with the shard's writer, which reports them.
    checkpoints: Arc<CheckpointCounters>,
    /// The last checkpoint, as a snapshot: its meta, and the keyspaces as
    /// of it.
    current: Mutex<Option<(Meta, Arc<crate::snapshot::Source>)>>,
    /// The shard's folder (where snapshots are staged) and its group.
    dir: std::path::PathBuf,
    group: u32,
    /// Numbers the files snapshots are staged in.
    staged: std::sync::atomic::AtomicU64,
    /// Set while this replica's data directory is new and it has not
    /// caught up (`crate::fresh`).
    fresh: std::sync::OnceLock<Arc<crate::fresh::Fresh>>,
}

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|e| e.into_inner())
}

impl Replica {
    /// Entries the group's log holds here, and the memory they cost
    /// (`RaftLogRead::held`).
    pub(crate) fn log_held(&self) -> (u64, u64) {
        self.log.held()
    }

    pub(crate) fn new(
        applier: Applier,
        node: NodeLog,
        log: RaftLogRead,
        every: u64,
        checkpoints: Arc<CheckpointCounters>,
        dir: std::path::PathBuf,
        group: u32,
    ) -> Replica {
        checkpoints
            .at_written
            .store(node.written(), Ordering::Relaxed);
        Replica {
            ks: applier.keyspaces().clone(),
            applier: Mutex::new(applier),
            every: every.max(1),
            checkpoints,
            node,
            log,
            current: Mutex::new(None),
            dir,
            group,
            staged: std::sync::atomic::AtomicU64::new(0),
            fresh: std::sync::OnceLock::new(),
        }
    }

    /// Checkpoints the shard as of the last entry applied (see
    /// [`Replica::checkpoint_locked`]).
    pub(crate) fn checkpoint(&self) -> Result<(), StoreError> {
        let mut applier = lock(&self.applier);
        self.checkpoint_locked(&mut applier, true)
    }

    /// The checkpoint of the shard's open, before its group starts: not
    /// counted with those it makes as it applies (as a shard's open
    /// checkpoint never was).
    pub(crate) fn checkpoint_at_open(&self) -> Result<(), StoreError> {
        let mut applier = lock(&self.applier);
        self.checkpoint_locked(&mut applier, false)
    }

    /// Whether the node log has written `every` bytes since the last
    /// checkpoint.
    pub(crate) fn due(&self) -> bool {
        self.since_checkpoint() >= self.every
    }

    /// Node-log bytes written since the last checkpoint.
    pub(crate) fn since_checkpoint(&self) -> u64 {
        self.node
            .written()
            .saturating_sub(self.checkpoints.at_written.load(Ordering::Relaxed))
    }

    /// The checkpoint with the applier held (no entry is applied
    /// meanwhile): the events index, the position a reopen reads the node
    /// log from (the round of the first entry not yet applied, or the
    /// log's end), the last entry applied and the vote, made durable
    /// together.
    fn checkpoint_locked(&self, applier: &mut Applier, counted: bool) -> Result<(), StoreError> {
        let start = std::time::Instant::now();
        let written = self.node.written();
        let (applied, membership) = applied_state(&self.ks)?;
        let end = self.node.end();
        let from = self
            .log
            .replay_from(applied.map(|a| a.index))
            .map_or(end, |p| p.min(end));
        let extra = encode_checkpointed(applied, self.log.vote());
        let (written_index, indexed) = applier.checkpoint(from, CHECKPOINT_KEY, extra)?;
        let c = &self.checkpoints;
        c.at_written.store(written, Ordering::Relaxed);
        if counted {
            c.made.fetch_add(1, Ordering::Relaxed);
            let took = start.elapsed();
            c.index_micros
                .fetch_add(indexed.as_micros() as u64, Ordering::Relaxed);
            c.sync_micros
                .fetch_add((took - indexed).as_micros() as u64, Ordering::Relaxed);
        }
        tracing::debug!(
            entries = written_index.entries,
            events = written_index.events,
            at = ?from,
            "checkpoint of a Raft group"
        );
        // The keyspaces as of this checkpoint, for a snapshot sent from
        // it (no entry is applied meanwhile: the applier is held).
        let source = crate::snapshot::Source::new(
            self.ks.db.snapshot(),
            self.ks.clone(),
            applier.events().clone(),
        );
        *lock(&self.current) = Some((
            Meta {
                last_log_id: applied,
                last_membership: membership,
            },
            Arc::new(source),
        ));
        Ok(())
    }

    /// The last checkpoint, as a snapshot openraft can send.
    fn current(&self) -> Option<SnapshotOf<GroupConfig, ShardSnapshot>> {
        lock(&self.current)
            .as_ref()
            .map(|(meta, source)| openraft::Snapshot {
                meta: meta.clone(),
                snapshot: ShardSnapshot(SnapshotData::Local(source.clone())),
            })
    }

    /// The last checkpoint's snapshot meta and what it streams from.
    #[cfg(test)]
    pub(crate) fn current_source(&self) -> Option<(Meta, Arc<crate::snapshot::Source>)> {
        lock(&self.current).clone()
    }

    #[cfg(test)]
    pub(crate) fn keyspaces(&self) -> &Keyspaces {
        &self.ks
    }

    /// The install's taking in of a staged snapshot alone, without its
    /// marker or checkpoint.
    #[cfg(test)]
    pub(crate) fn take_in_only(
        &self,
        meta: &Meta,
        path: &std::path::Path,
    ) -> Result<crate::snapshot::Imported, StoreError> {
        let mut applier = lock(&self.applier);
        let last = meta.last_log_id.expect("a snapshot as of an entry");
        let membership = serde_json::to_vec(&meta.last_membership).expect("json");
        let mut log = self.node.group(self.group);
        crate::snapshot::take_in(
            &mut applier,
            &mut log,
            path,
            (last.leader_id.term, last.index),
            membership,
        )
    }

    /// Whether this replica's data directory is new and it has not caught
    /// up with its group yet (`crate::fresh`).
    pub(crate) fn is_fresh(&self) -> Result<bool, StoreError> {
        Ok(self.ks.meta.get(crate::fresh::FRESH_KEY)?.is_some())
    }

    /// Marks it so, durably, before the group is initialized here.
    fn mark_fresh(&self) -> Result<(), StoreError> {
        self.ks.meta.insert(crate::fresh::FRESH_KEY, [])?;
        self.ks.db.persist(fjall::PersistMode::SyncData)?;
        Ok(())
    }

    /// If this replica was new and has just caught up (applied through
    /// `applied`), forgets that it was (made durable with the next
    /// checkpoint; a crash before that leaves it careful, which is safe).
    fn maybe_caught_up(&self, applied: Option<u64>, leading: bool) {
        let Some(f) = self.fresh.get() else {
            return;
        };
        if f.caught_up(applied, leading) {
            tracing::info!(group = self.group, applied = ?applied, "a replica whose data directory was new caught up with its group");
            if let Err(e) = self.ks.meta.remove(crate::fresh::FRESH_KEY) {
                tracing::warn!(group = self.group, error = %e, "could not record that a new replica caught up; it stays careful until it does");
            }
        }
    }

    /// An operator's override (`ShardStore::trust_replica`): this new
    /// replica is careful no more, durably. Whether it was careful.
    pub(crate) fn trust(&self) -> Result<bool, StoreError> {
        let Some(f) = self.fresh.get().filter(|f| f.active()) else {
            return Ok(false);
        };
        // On disk first: a failure leaves it careful, here and after a
        // restart.
        self.ks.meta.remove(crate::fresh::FRESH_KEY)?;
        self.ks.db.persist(fjall::PersistMode::SyncData)?;
        if !f.trust() {
            return Ok(false);
        }
        tracing::warn!(
            group = self.group,
            "an operator trusted this new replica as caught up: it votes and stands as any replica (entries only its lost disk and a dead replica held may be lost)"
        );
        Ok(true)
    }

    /// A file to stage a snapshot being received in.
    pub(crate) fn stage(&self, stream: String) -> Result<crate::snapshot::Staging, StoreError> {
        let n = self.staged.fetch_add(1, Ordering::Relaxed);
        crate::snapshot::Staging::create(&self.dir, stream, n)
    }

    /// Installs the snapshot staged at `path` (`crate::snapshot`, module
    /// docs): records the install, replaces the shard's state with the
    /// snapshot's, checkpoints, and only then forgets the install and the
    /// staged file.
    pub(crate) fn install(&self, meta: &Meta, path: &std::path::Path) -> Result<(), StoreError> {
        let mut applier = lock(&self.applier);
        let file = path
            .file_name()
            .and_then(|f| f.to_str())
            .ok_or_else(|| StoreError::Invalid(format!("a staged snapshot at {}", path.display())))?
            .to_string();
        crate::snapshot::Installing {
            meta: meta.clone(),
            file,
        }
        .record(&self.ks)?;
        self.install_locked(&mut applier, meta, path)
    }

    fn install_locked(
        &self,
        applier: &mut Applier,
        meta: &Meta,
        path: &std::path::Path,
    ) -> Result<(), StoreError> {
        let start = std::time::Instant::now();
        let last = meta.last_log_id.ok_or_else(|| {
            StoreError::Invalid("a snapshot as of no entry cannot be installed".into())
        })?;
        let membership = serde_json::to_vec(&meta.last_membership)
            .map_err(|e| StoreError::Invalid(format!("the snapshot's membership: {e}")))?;
        let mut log = self.node.group(self.group);
        let imported = crate::snapshot::take_in(
            applier,
            &mut log,
            path,
            (last.leader_id.term, last.index),
            membership,
        )?;
        self.checkpoint_locked(applier, true)?;
        self.ks.meta.remove(crate::snapshot::INSTALLING_KEY)?;
        self.ks.db.persist(fjall::PersistMode::SyncData)?;
        if let Err(e) = std::fs::remove_file(path) {
            tracing::warn!(path = %path.display(), error = %e, "could not remove a snapshot installed from");
        }
        self.maybe_caught_up(Some(last.index), false);
        tracing::info!(
            group = self.group,
            snapshot = ?meta.last_log_id,
            applied = last.index,
            events = imported.events,
            kept = imported.kept,
            took_ms = start.elapsed().as_millis() as u64,
            "installed a snapshot of the shard"
        );
        Ok(())
    }

    /// At open, before the group starts: finishes an install a crash cut
    /// short (installs its staged file again from the start), and removes
    /// staged files no install needs.
    pub(crate) fn recover_install(&self) -> Result<(), StoreError> {
        let mut applier = lock(&self.applier);
        let installing = crate::snapshot::Installing::read(&self.ks)?;
        if let Some(i) = &installing {
            let path = self.dir.join(&i.file);
            if !path.exists() {
                return Err(StoreError::Corrupt(format!(
                    "the shard was installing a snapshot as of entry {:?} from {}, which is \
                     gone: its state is incomplete; nothing was deleted",
                    i.meta.last_log_id.map(|l| l.index),
                    path.display()
                )));
            }
            tracing::warn!(group = self.group, snapshot = ?i.meta.last_log_id, "installing again a snapshot whose install a crash cut short");
            self.install_locked(&mut applier, &i.meta, &path)?;
        }
        for entry in std::fs::read_dir(&self.dir)
            .map_err(|e| StoreError::Io(format!("reading {}: {e}", self.dir.display())))?
            .flatten()
        {
            let name = entry.file_name();
            let name = name.to_string_lossy();
            if name.starts_with("snapshot.") && name.ends_with(".incoming") {
                let _ = std::fs::remove_file(entry.path());
            }
        }
        Ok(())
    }
}

/// A shard's state machine: openraft applies the group's committed
/// entries through it, on every replica.
pub(crate) struct ShardMachine {
    replica: Arc<Replica>,
    /// Declared after `replica`, so dropped after it: tells once openraft
    /// lets go of the machine, and of the shard's database with it, which
    /// it does on a task of its own after the group is shut down. The
    /// shard's drop waits for it, so that a reopen (or the offline check)
    /// right after finds the folder free.
    _released: Released,
}

struct Released(std::sync::mpsc::SyncSender<()>);

impl Drop for Released {
    fn drop(&mut self) {
        let _ = self.0.try_send(());
    }
}

/// A checkpoint's meta, handed to openraft as a snapshot.
pub(crate) struct CheckpointSnapshot {
    replica: Arc<Replica>,
}

impl RaftSnapshotBuilder<GroupConfig> for CheckpointSnapshot {
    type SnapshotData = ShardSnapshot;

    /// The last checkpoint (the state machine makes them as it applies,
    /// so this never races an apply).
    async fn build_snapshot(
        &mut self,
    ) -> Result<SnapshotOf<GroupConfig, ShardSnapshot>, io::Error> {
        let replica = self.replica.clone();
        tokio::task::spawn_blocking(move || {
            replica.checkpoint()?;
            replica
                .current()
                .ok_or_else(|| StoreError::Io("no checkpoint was made".into()))
        })
        .await
        .map_err(io::Error::other)?
        .map_err(io_error)
    }
}

/// How long the apply of a committed entry waits for the entry to become
/// durable on this replica (its round's sync) before the group stops.
const DURABLE_WITHIN: std::time::Duration = std::time::Duration::from_secs(30);

impl RaftStateMachine<GroupConfig> for ShardMachine {
    type SnapshotData = ShardSnapshot;
    type SnapshotBuilder = CheckpointSnapshot;

    async fn applied_state(&mut self) -> Result<(Option<LogId>, Membership), io::Error> {
        applied_state(&self.replica.ks).map_err(io_error)
    }

    async fn apply<S>(&mut self, mut entries: S) -> Result<(), io::Error>
    where
        S: futures_util::Stream<Item = Result<EntryResponder<GroupConfig>, io::Error>>
            + Unpin
            + OptionalSend,
    {
        while let Some(item) = entries.next().await {
            let (entry, responder) = item?;
            let term = entry.log_id.leader_id.term;
            let index = entry.log_id.index;
            let r = &*self.replica;
            // Every entry, not only those with events: fjall must never
            // record as applied an entry a crash could take from this
            // replica's log.
            let (segment, offset) = r
                .log
                .durable_place(index, DURABLE_WITHIN)
                .await
                .ok_or_else(|| {
                    io::Error::other(format!(
                        "entry {index} is committed but did not become durable on this replica within {} s",
                        DURABLE_WITHIN.as_secs()
                    ))
                })?;
            let mut applier = lock(&r.applier);
            let applied = match &entry.payload {
                EntryPayload::Normal(p) => applier
                    .apply(term, index, &p.0, segment, offset)
                    .map_err(io_error)?,
                EntryPayload::Blank => {
                    applier.apply_other(term, index, None).map_err(io_error)?;
                    Applied::Done
                }
                EntryPayload::Membership(m) => {
                    let stored = Membership::new(Some(entry.log_id), m.clone());
                    let json = serde_json::to_vec(&stored).map_err(io::Error::other)?;
                    applier
                        .apply_other(term, index, Some((MEMBERSHIP_KEY, json)))
                        .map_err(io_error)?;
                    Applied::Done
                }
            };
            if r.due() {
                r.checkpoint_locked(&mut applier, true).map_err(io_error)?;
            }
            drop(applier);
            r.maybe_caught_up(Some(index), false);
            if let Some(r) = responder {
                r.send(applied);
            }
        }
        Ok(())
    }

    async fn get_snapshot_builder(&mut self) -> Self::SnapshotBuilder {
        CheckpointSnapshot {
            replica: self.replica.clone(),
        }
    }

    async fn install_snapshot(
        &mut self,
        meta: &Meta,
        snapshot: ShardSnapshot,
    ) -> Result<(), io::Error> {
        let SnapshotData::Received(path) = snapshot.0 else {
            return Err(io::Error::other(
                "a snapshot made on this replica is not installed on it",
            ));
        };
        let (replica, meta) = (self.replica.clone(), meta.clone());
        tokio::task::spawn_blocking(move || replica.install(&meta, &path))
            .await
            .map_err(io::Error::other)?
            .map_err(io_error)
    }

    async fn get_current_snapshot(
        &mut self,
    ) -> Result<Option<SnapshotOf<GroupConfig, ShardSnapshot>>, io::Error> {
        Ok(self.replica.current())
    }
}

/// The network of a group whose only member is this node: there is no
/// one to send to, and any attempt is an error (never a granted vote).
/// The transport between nodes replaces it.
#[derive(Clone, Copy, Default)]
pub(crate) struct Alone;

fn nobody() -> Unreachable<GroupConfig> {
    Unreachable::from_string("this node runs the group alone: there is no transport to its peers")
}

impl RaftNetworkFactory<GroupConfig> for Alone {
    type Network = Alone;

    async fn new_client(&mut self, _target: u64, _node: &BasicNode) -> Alone {
        Alone
    }
}

impl RaftNetworkV2<GroupConfig> for Alone {
    type SnapshotData = ShardSnapshot;

    async fn append_entries(
        &mut self,
        _rpc: AppendEntriesRequest<GroupConfig>,
        _option: RPCOption,
    ) -> Result<AppendEntriesResponse<GroupConfig>, RPCError<GroupConfig>> {
        Err(RPCError::Unreachable(nobody()))
    }

    async fn vote(
        &mut self,
        _rpc: VoteRequest<GroupConfig>,
        _option: RPCOption,
    ) -> Result<VoteResponse<GroupConfig>, RPCError<GroupConfig>> {
        Err(RPCError::Unreachable(nobody()))
    }

    async fn pre_vote(
        &mut self,
        _rpc: VoteRequest<GroupConfig>,
        _option: RPCOption,
    ) -> Result<VoteResponse<GroupConfig>, RPCError<GroupConfig>> {
        Err(RPCError::Unreachable(nobody()))
    }

    async fn full_snapshot(
        &mut self,
        _vote: Vote,
        _snapshot: SnapshotOf<GroupConfig, ShardSnapshot>,
        _cancel: impl std::future::Future<Output = ReplicationClosed> + OptionalSend + 'static,
        _option: RPCOption,
    ) -> Result<SnapshotResponse<GroupConfig>, StreamingError<GroupConfig>> {
        Err(StreamingError::Unreachable(nobody()))
    }
}

/// The configuration of every shard's group: one leader per term, pre-vote
/// on, leader restore off (a restarted leader is elected again: it does
/// not save the commit index), snapshots only as checkpoints.
pub(crate) fn config() -> Result<Arc<openraft::Config>, StoreError> {
    config_with(
        &crate::raft_net::RaftLogLimits {
            snapshot_every: crate::raft_net::RaftLogLimits::default().snapshot_every,
            // No follower to keep entries for.
            kept: 0,
            // Not used: a group of one keeps the log's own cache size.
            cache_bytes: crate::raft_net::RaftLogLimits::default().cache_bytes,
        },
        &crate::raft_net::RaftTiming::ALONE,
    )
}

fn config_with(
    log: &crate::raft_net::RaftLogLimits,
    timing: &crate::raft_net::RaftTiming,
) -> Result<Arc<openraft::Config>, StoreError> {
    let config = openraft::Config {
        max_in_snapshot_log_to_keep: log.kept,
        cluster_name: "forkless".into(),
        heartbeat_interval: timing.heartbeat_ms,
        election_timeout_min: timing.election_timeout_min_ms,
        election_timeout_max: timing.election_timeout_max_ms,
        enable_pre_vote: Some(true),
        enable_leader_restore: Some(false),
        // The state machine also checkpoints by itself as it applies
        // (every so many bytes of the node log); this is what makes the
        // log purge what it no longer needs in memory.
        snapshot_policy: openraft::SnapshotPolicy::LogsSinceLast(log.snapshot_every.max(1)),
        ..Default::default()
    };
    config
        .validate()
        .map(Arc::new)
        .map_err(|e| StoreError::Invalid(format!("the Raft configuration: {e}")))
}

/// A shard's Raft group, as the writer and the shard hold it.
pub(crate) type ShardRaft = openraft::Raft<GroupConfig, ShardMachine>;

/// This node's id in a group it runs alone (the one-node default). A
/// replicated group's ids are the nodes' incarnations
/// (`docs/replication.md`, "Node ids").
pub(crate) const ALONE_ID: u64 = 1;

/// How long a group may take to elect its leader and apply what its log
/// held at open before the shard's open gives up.
const READY_WITHIN: std::time::Duration = std::time::Duration::from_secs(30);

/// The runtime every shard's group runs on (openraft's core, state
/// machine and tick tasks). Its own, so that a wait for a group from any
/// thread (the shard's writer thread; a caller committing on its own
/// thread of the API's runtime) never blocks the runtime the group needs.
fn runtime() -> Result<&'static tokio::runtime::Runtime, StoreError> {
    static RUNTIME: std::sync::OnceLock<Result<tokio::runtime::Runtime, String>> =
        std::sync::OnceLock::new();
    RUNTIME
        .get_or_init(|| {
            tokio::runtime::Builder::new_multi_thread()
                .worker_threads(2)
                .thread_name("raft")
                .enable_all()
                .build()
                .map_err(|e| e.to_string())
        })
        .as_ref()
        .map_err(|e| StoreError::Io(format!("starting the Raft runtime: {e}")))
}

/// A handle on the runtime every shard's group runs on, for the Raft
/// transport: its connections and its server run there too, so that a
/// call goes from openraft to the socket and from the socket to openraft
/// without waking another runtime's threads.
pub fn runtime_handle() -> Result<tokio::runtime::Handle, StoreError> {
    Ok(runtime()?.handle().clone())
}

/// Runs `f` on the groups' runtime and waits for it, from any thread, for
/// at most `within` (`None` once that has passed: `f` goes on, and its
/// outcome is not known here).
pub(crate) fn run<F>(f: F, within: std::time::Duration) -> Result<Option<F::Output>, StoreError>
where
    F: std::future::Future + Send + 'static,
    F::Output: Send + 'static,
{
    let (tx, rx) = std::sync::mpsc::sync_channel(1);
    runtime()?.spawn(async move {
        let _ = tx.send(f.await);
    });
    match rx.recv_timeout(within) {
        Ok(out) => Ok(Some(out)),
        Err(std::sync::mpsc::RecvTimeoutError::Timeout) => Ok(None),
        Err(std::sync::mpsc::RecvTimeoutError::Disconnected) => {
            Err(StoreError::Io("the Raft runtime stopped a task".into()))
        }
    }
}

/// A shard's group as openraft starts it on this replica's log and state
/// (`on_release` hears when openraft lets go of the state machine), and
/// whether it had been initialized before.
async fn new_raft<N>(
    shard: forkless_types::ShardId,
    me: u64,
    config: Arc<openraft::Config>,
    network: N,
    log: crate::raft_log::RaftLog,
    replica: Arc<Replica>,
    released: std::sync::mpsc::SyncSender<()>,
) -> Result<(ShardRaft, bool), StoreError>
where
    N: RaftNetworkFactory<GroupConfig>,
    N::Network: openraft::network::NetSnapshot<GroupConfig, SnapshotData = ShardSnapshot>,
{
    let machine = ShardMachine {
        replica,
        _released: Released(released),
    };
    let raft = ShardRaft::new(me, config, network, log, machine)
        .await
        .map_err(|e| group_error(shard, "starting", &e))?;
    let initialized = raft
        .is_initialized()
        .await
        .map_err(|e| group_error(shard, "reading its state", &e))?;
    Ok((raft, initialized))
}

fn group_error(
    shard: forkless_types::ShardId,
    what: &str,
    e: &dyn std::fmt::Display,
) -> StoreError {
    StoreError::Io(format!("shard {shard}'s Raft group: {what}: {e}"))
}

/// Starts the group of shard `shard` run by this node alone, on its log
/// and state: initializes it if it is new, else elects this node again
/// (a restarted leader is not restored), and waits until it leads and has
/// applied every entry its log held, so that reads see every write
/// acknowledged before the open. Its timers are then turned off: a group
/// with no other member has no one to hear from.
pub(crate) fn start_alone(
    shard: forkless_types::ShardId,
    log: crate::raft_log::RaftLog,
    replica: Arc<Replica>,
) -> Result<Group, StoreError> {
    let config = config()?;
    let held = replica.clone();
    let (released, on_release) = std::sync::mpsc::sync_channel(1);
    let started = run(
        async move {
            let fail = |what: &str, e: &dyn std::fmt::Display| group_error(shard, what, e);
            let (raft, initialized) =
                new_raft(shard, ALONE_ID, config, Alone, log, replica, released).await?;
            if initialized {
                raft.trigger()
                    .elect(false)
                    .await
                    .map_err(|e| fail("electing", &e))?;
            } else {
                let mut members = std::collections::BTreeMap::new();
                members.insert(ALONE_ID, BasicNode::default());
                raft.initialize(members)
                    .await
                    .map_err(|e| fail("initializing", &e))?;
            }
            let led = raft
                .wait(Some(READY_WITHIN))
                .state(openraft::ServerState::Leader, "the group's leader")
                .await
                .map_err(|e| fail("waiting for its leader", &e))?;
            raft.wait(Some(READY_WITHIN))
                .applied_index_at_least(led.last_log_index, "every entry applied")
                .await
                .map_err(|e| fail("applying its log", &e))?;
            let rc = raft.runtime_config();
            rc.tick(false);
            rc.heartbeat(false);
            Ok::<_, StoreError>(raft)
        },
        READY_WITHIN * 3,
    )?;
    let raft = started.unwrap_or_else(|| {
        Err(StoreError::Io(format!(
            "shard {shard}'s Raft group did not start within {} s",
            (READY_WITHIN * 3).as_secs()
        )))
    })?;
    let (stopped, closing) = watch_stop(shard, &raft, None, None)?;
    Ok(Group {
        raft,
        replicated: false,
        fresh: None,
        quiet: Arc::new(crate::quiet::Quiet::new()),
        vote_fresh: std::time::Duration::ZERO,
        replica: held,
        staging: tokio::sync::Mutex::new(None),
        moving: tokio::sync::Mutex::new(()),
        moves_under_way: std::sync::atomic::AtomicUsize::new(0),
        replacing: std::sync::atomic::AtomicUsize::new(0),
        appends: AppendCounts::default(),
        released: Mutex::new(on_release),
        stopped,
        closing,
        draining: None,
    })
}

/// Starts the group of shard `shard` as one replica of several: on its
/// log and state, with `rep`'s transport to the others. A new group is
/// initialized with the shard's replicas as the config names them, on
/// every replica alike (openraft allows it on each member when the
/// membership is the same: the vote decides who leads). It does not wait
/// for a leader: the group elects one once a quorum of its replicas is up,
/// and until then this node refuses the shard's writes as not its leader.
pub(crate) fn start_replicated(
    shard: forkless_types::ShardId,
    log: crate::raft_log::RaftLog,
    replica: Arc<Replica>,
    rep: &crate::raft_net::Replication,
) -> Result<Group, StoreError> {
    let config = config_with(&rep.log, &rep.timing)?;
    log.reader().limit_cache(rep.log.cache_bytes);
    let members = (rep.members)(shard);
    // A replica the cluster file does not place here was added by a
    // membership change (`ShardStore::replace_replica`): it never
    // initializes its group (its membership is the group's, which it
    // learns from the leader), and it starts as a new replica until it
    // caught up. One the file places here and whose group is new
    // initializes it with the file's placement, the group's first
    // membership on every replica alike.
    let placed_here = members.contains_key(&rep.me);
    let me = rep.me;
    let held = replica.clone();
    let careful = || Arc::new(crate::fresh::Fresh::new(me, shard.get(), rep.peers.clone()));
    if held.is_fresh()? {
        // Careful since before this start: so from the group's first
        // moment (its election timer runs before the group is returned).
        let _ = held.fresh.set(careful());
    }
    let campaigner = Arc::downgrade(&replica);
    let draining = rep.draining.clone();
    let network = crate::raft_net::PeerNetwork {
        me,
        group: shard.get(),
        peers: rep.peers.clone(),
        campaign: Arc::new(move |last| {
            if draining.load(std::sync::atomic::Ordering::Acquire) {
                return Some(format!(
                    "node {me} is drained or shutting down: its replica of group {} does not stand for election",
                    shard.get()
                ));
            }
            campaigner
                .upgrade()
                .and_then(|r| r.fresh.get().and_then(|f| f.refuses_campaign(last)))
        }),
    };
    let (released, on_release) = std::sync::mpsc::sync_channel(1);
    let started = run(
        async move {
            let (raft, initialized) =
                new_raft(shard, me, config, network, log, replica.clone(), released).await?;
            if !initialized && !placed_here {
                replica.mark_fresh()?;
                tracing::info!(
                    shard = shard.get(),
                    "a replica the cluster file does not place here: waiting for the group's leader to replicate to it"
                );
            } else if !initialized {
                use openraft::errors::{InitializeError, RaftError};
                replica.mark_fresh()?;
                match raft.initialize(members).await {
                    Ok(()) => {}
                    // Another replica's entries reached it first.
                    Err(RaftError::APIError(InitializeError::NotAllowed(_))) => {}
                    Err(e) => return Err(group_error(shard, "initializing", &e)),
                }
            }
            Ok::<_, StoreError>(raft)
        },
        READY_WITHIN,
    )?;
    let raft = started.unwrap_or_else(|| {
        Err(StoreError::Io(format!(
            "shard {shard}'s Raft group did not start within {} s",
            READY_WITHIN.as_secs()
        )))
    })?;
    let fresh = held
        .is_fresh()?
        .then(|| held.fresh.get_or_init(careful).clone());
    // Watched only while careful: whether it is is known by now (marked
    // above, or from before this start), and only a trust or catching up
    // changes it, to not careful.
    let careful_replica = fresh.as_ref().map(|_| Arc::downgrade(&held));
    let (stopped, closing) = watch_stop(shard, &raft, careful_replica, Some(rep.beat_now.clone()))?;
    Ok(Group {
        raft,
        replicated: true,
        fresh,
        quiet: Arc::new(crate::quiet::Quiet::new()),
        vote_fresh: std::time::Duration::from_millis(rep.timing.election_timeout_min_ms),
        replica: held,
        staging: tokio::sync::Mutex::new(None),
        moving: tokio::sync::Mutex::new(()),
        moves_under_way: std::sync::atomic::AtomicUsize::new(0),
        replacing: std::sync::atomic::AtomicUsize::new(0),
        appends: AppendCounts::default(),
        released: Mutex::new(on_release),
        stopped,
        closing,
        draining: Some(rep.draining.clone()),
    })
}

/// How long a group may take to stop.
const STOPS_WITHIN: std::time::Duration = std::time::Duration::from_secs(10);

/// A started group: shut down, and its state machine let go of, when
/// dropped.
pub(crate) struct Group {
    pub(crate) raft: ShardRaft,
    /// Whether the group has replicas on other nodes (else this node runs
    /// it alone).
    pub(crate) replicated: bool,
    /// Whether its timers are off (a replicated group's, when idle).
    pub(crate) quiet: Arc<crate::quiet::Quiet>,
    /// How recently a quiet follower must have heard that its leader is
    /// alive to refuse a vote (`Quiet::refuses_vote`).
    pub(crate) vote_fresh: std::time::Duration,
    /// The replica's state (where a snapshot is staged and installed).
    pub(crate) replica: Arc<Replica>,
    /// The snapshot being received, if one is.
    staging: tokio::sync::Mutex<Option<crate::snapshot::Staging>>,
    /// Held by each membership step of a move of one of the group's
    /// replicas (`ShardStore::replace_replica`), not by its catch-up
    /// wait: a learner other than its own found at a move's start is one
    /// a move cut short left (or one still waiting, which then ends).
    pub(crate) moving: tokio::sync::Mutex<()>,
    /// Moves of the group's replicas under way on this replica (its
    /// leader): the last one over lets the group go quiet again.
    pub(crate) moves_under_way: std::sync::atomic::AtomicUsize,
    /// Of those, the replacements of a replica (`ShardStore::replace_
    /// replica`, which add a learner and wait for it): while one runs, a
    /// learner of the group is not one a move left behind.
    pub(crate) replacing: std::sync::atomic::AtomicUsize,
    /// Set while this replica's data directory is new and it has not
    /// caught up (`crate::fresh`).
    fresh: Option<Arc<crate::fresh::Fresh>>,
    /// In a mutex only so that the shard is `Sync`; used once, at drop.
    released: Mutex<std::sync::mpsc::Receiver<()>>,
    /// The AppendEntries with entries this replica took from its leaders.
    pub(crate) appends: AppendCounts,
    /// Why the group stopped by itself, once it has (`watch_stop`).
    stopped: Arc<std::sync::OnceLock<String>>,
    /// Set as the group is shut down on purpose, which is no stop.
    closing: Arc<std::sync::atomic::AtomicBool>,
    /// The node's shutdown flag ([`crate::Replication::draining`]); `None`
    /// for a group this node runs alone.
    pub(crate) draining: Option<Arc<std::sync::atomic::AtomicBool>>,
}

/// Counts of the AppendEntries carrying entries that a replica took.
#[derive(Default)]
pub(crate) struct AppendCounts {
    pub(crate) taken: std::sync::atomic::AtomicU64,
    /// Of those, the ones taken while an earlier one with entries of the
    /// same leader's stream was not yet answered (pipelined).
    pub(crate) behind_others: std::sync::atomic::AtomicU64,
}

/// Watches `raft` until its core stops, and records why if it stopped by
/// itself (a panic, a storage error) rather than being shut down: the
/// store's supervisor restarts such a group (`Store::supervise`). A core
/// that panicked drops its metrics without saying so; any call to it then
/// returns the reason.
///
/// A replica whose data directory was new (`crate::fresh`) counts as
/// caught up the moment it leads: else a leader that takes no calls
/// (nothing is sent to a leader) would stay careful until its node's
/// next heartbeat, and one handing its leadership on, or restarted,
/// before that would refuse votes it has no reason to (a test cluster
/// without heartbeats kept its leader careful for good).
///
/// Each time the replica comes to lead its group, `led` is notified
/// ([`crate::Replication::beat_now`]: the node's heartbeat then tells
/// every peer at once).
fn watch_stop(
    shard: forkless_types::ShardId,
    raft: &ShardRaft,
    careful: Option<std::sync::Weak<Replica>>,
    led: Option<Arc<tokio::sync::Notify>>,
) -> Result<
    (
        Arc<std::sync::OnceLock<String>>,
        Arc<std::sync::atomic::AtomicBool>,
    ),
    StoreError,
> {
    use openraft::async_runtime::WatchReceiver;
    let stopped: Arc<std::sync::OnceLock<String>> = Arc::default();
    let closing: Arc<std::sync::atomic::AtomicBool> = Arc::default();
    let (raft, out, shut) = (raft.clone(), stopped.clone(), closing.clone());
    let mut careful = careful;
    runtime()?.spawn(async move {
        let mut rx = raft.metrics();
        // The term it last led at.
        let mut led_at = None;
        let fatal = loop {
            let leading = {
                let m = rx.borrow_watched();
                if let Err(f) = &m.running_state {
                    break f.to_string();
                }
                (m.state == openraft::ServerState::Leader)
                    .then(|| m.last_applied.map(|l| l.index))
            };
            if leading.is_some() {
                let term = rx.borrow_watched().current_term;
                if led_at != Some(term) {
                    led_at = Some(term);
                    if let Some(led) = &led {
                        led.notify_one();
                    }
                }
            }
            if let (Some(applied), Some(r)) = (leading, careful.as_ref().and_then(|r| r.upgrade())) {
                r.maybe_caught_up(applied, true);
                // Caught up for good: nothing more to watch it for.
                if r.fresh.get().is_none_or(|f| !f.active()) {
                    careful = None;
                }
            }
            if rx.changed().await.is_err() {
                break match raft.trigger().heartbeat().await {
                    Err(f) => f.to_string(),
                    Ok(()) => "its core ended".into(),
                };
            }
        };
        if !shut.load(Ordering::Acquire) {
            tracing::error!(shard = %shard, reason = %fatal, "a shard's Raft group stopped by itself; the store's supervisor restarts it");
            let _ = out.set(fatal);
        }
    });
    Ok((stopped, closing))
}

impl Drop for Group {
    fn drop(&mut self) {
        self.closing.store(true, Ordering::Release);
        let raft = self.raft.clone();
        match run(async move { raft.shutdown().await }, STOPS_WITHIN) {
            Ok(Some(Ok(()))) => {}
            Ok(Some(Err(e))) => {
                tracing::warn!(error = %e, "a shard's Raft group stopped with an error")
            }
            Ok(None) => tracing::warn!("a shard's Raft group did not stop within its time"),
            Err(e) => tracing::warn!(error = %e, "a shard's Raft group could not be stopped"),
        }
        // A machine that never started was dropped with the open that
        // failed; one that ran goes with the group's tasks.
        if lock(&self.released).recv_timeout(STOPS_WITHIN).is_err() {
            tracing::warn!(
                "a shard's state machine was not let go of in time; its folder may stay locked"
            );
        }
    }
}

/// A shard's Raft group as this replica sees it now.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct RaftStatus {
    /// This replica's id.
    pub me: u64,
    /// The leader it knows of, if any.
    pub leader: Option<u64>,
    pub term: u64,
    /// `leader`, `follower`, `candidate` or `learner`.
    pub state: &'static str,
    pub last_log_index: Option<u64>,
    pub committed: Option<u64>,
    pub applied: Option<u64>,
    /// The entry its last snapshot (checkpoint) is as of, and the last
    /// entry its log forgot (from memory: a follower that needs one it
    /// forgot is sent a snapshot).
    pub snapshot: Option<u64>,
    pub purged: Option<u64>,
    /// The voters of its membership (both sets while `joint`).
    pub voters: Vec<u64>,
    /// Whether that membership is a change of voters under way (openraft's
    /// joint consensus: the old voters and the new), as a leader that died
    /// between a change's two steps leaves it to the next
    /// (`ShardStore::replace_replica` finishes it).
    pub joint: bool,
    /// The log id (term, index) of the entry that membership is from
    /// (`None`: the group's first, from no entry): of two views of one
    /// group's membership, the one from the later entry is the newer.
    pub membership_log: Option<(u64, u64)>,
    /// Whether that membership is committed (a change of it fully made:
    /// on a leader, its entry is on a quorum).
    pub membership_committed: bool,
    /// Its learners: replicas being caught up, which do not vote yet
    /// (`ShardStore::replace_replica`).
    pub learners: Vec<u64>,
    /// On the leader: each follower's last entry known to match its own.
    pub matched: Vec<(u64, Option<u64>)>,
    /// On the leader: how long ago each follower last acknowledged an
    /// AppendEntries or heartbeat (ms; `None`: never).
    pub heard_ms_ago: Vec<(u64, Option<u64>)>,
    /// Whether the group's timers are off here (idle: `crate::quiet`).
    pub quiet: bool,
    /// Whether this replica's data directory is new and it has not caught
    /// up with its group yet (`crate::fresh`: it votes for no candidate
    /// with entries meanwhile).
    pub fresh: bool,
    /// AppendEntries with entries this replica took from its leaders, and
    /// of those the ones taken while an earlier one of the same leader's
    /// stream was unanswered (the leader pipelines them).
    pub appends_taken: u64,
    pub appends_taken_behind_others: u64,
    /// Entries this replica's log holds (after its purge mark), and the
    /// bytes of memory they cost (their places and the bodies cached).
    pub log_held_entries: u64,
    pub log_memory_bytes: u64,
}

impl RaftStatus {
    pub(crate) fn of(m: &openraft::RaftMetrics<GroupConfig>) -> RaftStatus {
        RaftStatus {
            me: m.id,
            leader: m.current_leader,
            term: m.current_term,
            state: match m.state {
                openraft::ServerState::Leader => "leader",
                openraft::ServerState::Follower => "follower",
                openraft::ServerState::Candidate => "candidate",
                openraft::ServerState::Learner => "learner",
                openraft::ServerState::Shutdown => "shutdown",
            },
            last_log_index: m.last_log_index,
            committed: m.local_committed.map(|l| l.index),
            applied: m.last_applied.map(|l| l.index),
            snapshot: m.snapshot.map(|l| l.index),
            purged: m.purged.map(|l| l.index),
            voters: m.membership_config.membership().voter_ids().collect(),
            joint: m.membership_config.membership().get_joint_config().len() > 1,
            membership_log: m
                .membership_config
                .log_id()
                .as_ref()
                .map(|l| (l.leader_id.term, l.index)),
            membership_committed: m.committed_membership_config.log_id()
                == m.membership_config.log_id(),
            learners: m.membership_config.membership().learner_ids().collect(),
            matched: m
                .replication
                .as_ref()
                .map(|r| {
                    r.iter()
                        .filter(|(id, _)| **id != m.id)
                        .map(|(id, l)| (*id, l.map(|l| l.index)))
                        .collect()
                })
                .unwrap_or_default(),
            heard_ms_ago: m
                .heartbeat
                .as_ref()
                .map(|h| {
                    h.iter()
                        .filter(|(id, _)| **id != m.id)
                        .map(|(id, at)| {
                            let ago = at
                                .as_ref()
                                .map(|at| openraft::Instant::elapsed(&**at).as_millis() as u64);
                            (*id, ago)
                        })
                        .collect()
                })
                .unwrap_or_default(),
            quiet: false,
            fresh: false,
            appends_taken: 0,
            appends_taken_behind_others: 0,
            log_held_entries: 0,
            log_memory_bytes: 0,
        }
    }
}

/// Who leads a shard's group, as this replica knows.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Leadership {
    pub me: u64,
    pub leader: Option<u64>,
    pub term: u64,
}

impl Leadership {
    /// Whether this replica takes itself for the group's leader.
    pub fn this_node_leads(&self) -> bool {
        self.leader == Some(self.me)
    }
}

/// Waits for a change of who leads a shard's group (or its term).
pub struct RaftWatch(
    openraft::type_config::alias::WatchReceiverOf<
        GroupConfig,
        openraft::metrics::RaftServerMetrics<GroupConfig>,
    >,
);

impl RaftWatch {
    pub(crate) fn new(raft: &ShardRaft) -> RaftWatch {
        use openraft::async_runtime::WatchReceiver;
        // (A new receiver takes the value it was made with for unseen: its
        // first `changed` would return at once, for no change.)
        let mut rx = raft.server_metrics();
        let _ = rx.borrow_and_update();
        RaftWatch(rx)
    }

    /// Who leads after the group's next change of leader, term or state;
    /// `None` once it stopped.
    pub async fn changed(&mut self) -> Option<Leadership> {
        use openraft::async_runtime::WatchReceiver;
        self.0.changed().await.ok()?;
        Some(self.now())
    }

    /// Who leads now.
    pub fn now(&self) -> Leadership {
        use openraft::async_runtime::WatchReceiver;
        let m = self.0.borrow_watched();
        Leadership {
            me: m.id,
            leader: m.current_leader,
            term: m.vote.leader_id.term,
        }
    }
}

/// Why this node (`me`) cannot serve a shard's leader's part: `leader`
/// leads the group at `term`, or no leader is known
/// ([`StoreError::NotLeader`]; the edge routes the request again once the
/// group's leadership settles).
pub(crate) fn not_leader(
    shard: forkless_types::ShardId,
    me: u64,
    leader: Option<u64>,
    term: u64,
) -> StoreError {
    StoreError::NotLeader {
        shard,
        leader: leader.filter(|&l| l != me),
        term,
    }
}

/// Why the group refused a call made here as its leader: [`not_leader`]
/// if it says to go elsewhere (`forward`; during a leadership transfer it
/// names the node taking over), else `other` says why. The term is the
/// one this node is at: the leader named was learned at it, or after it.
pub(crate) fn forwarded(
    raft: &ShardRaft,
    shard: forkless_types::ShardId,
    forward: Option<&openraft::errors::ForwardToLeader<GroupConfig>>,
    other: impl FnOnce() -> String,
) -> StoreError {
    use openraft::async_runtime::WatchReceiver;
    // A leader whose lease lapsed (no quorum heard for an election
    // timeout) still leads at its term: that is not a moving leadership
    // but a leader that may be cut off, and nothing settles it.
    let Some(forward) =
        forward.filter(|f| f.reason != openraft::errors::ForwardReason::LeaseExpired)
    else {
        return StoreError::NotExecuted {
            shard,
            reason: other(),
        };
    };
    let (me, term) = {
        let m = raft.metrics();
        let m = m.borrow_watched();
        (m.id, m.current_term)
    };
    not_leader(shard, me, forward.leader_id, term)
}

/// How many voters a group's membership has (those of both
/// configurations, in a joint one).
pub(crate) fn voters(raft: &openraft::Raft<GroupConfig, ShardMachine>) -> usize {
    use openraft::async_runtime::WatchReceiver;
    raft.metrics()
        .borrow_watched()
        .membership_config
        .membership()
        .voter_ids()
        .count()
}

/// What a replica does with a call from another: hands it to its group
/// and returns the group's answer (an error is the group's, as text).
pub(crate) async fn handle(
    group: &Group,
    rpc: crate::raft_net::Rpc,
) -> Result<crate::raft_net::RpcReply, String> {
    if let crate::raft_net::Rpc::AppendEntries(r) = &rpc {
        admit_append(group, r, false)?;
        let answer = handle_now(group, rpc).await;
        group.fresh_caught_up();
        return answer;
    }
    group.fresh_caught_up();
    if let crate::raft_net::Rpc::TransferLeader(r) = &rpc {
        if group.is_draining() && *r.to_node_id() == group.me() {
            // Costs the group an election's time of refused writes; the
            // leaders' balancers ask the node first (`Beat::led`), and it
            // answers that it cannot lead (with the beats off they cannot
            // ask: `Replication::draining`).
            tracing::warn!(
                shard = group.replica.group,
                "refused a leadership handover: this node is drained or shutting down"
            );
            return Err(
                "this node is drained or shutting down: it does not take the leadership".into(),
            );
        }
    }
    if let Some(f) = group.fresh.as_ref().filter(|f| f.active()) {
        match &rpc {
            crate::raft_net::Rpc::Snapshot(c) => {
                f.admit(c.vote.leader_id.voted_for, c.vote.leader_id.term, None)?
            }
            // It may not stand for election (`Fresh::refuses_campaign`), so
            // it does not take the leadership handed to it. (A handover to
            // another replica comes to every voter: passed on, it only
            // lets this one's vote go to that replica, which it still
            // refuses while careful.)
            crate::raft_net::Rpc::TransferLeader(r) if *r.to_node_id() == f.me() => {
                // Costs the group an election's time of refused writes: a
                // leader's balancer asks the node first (`Beat::led`).
                tracing::warn!(
                    shard = group.replica.group,
                    "refused a leadership handover: this replica's data directory is new and it has not caught up"
                );
                return Err(
                    "this replica's data directory is new and it has not caught up with its group: \
                     it does not take the leadership"
                        .into(),
                );
            }
            // With two voters the candidate is the other one, whose vote
            // every commit and every election needed: its log holds every
            // committed entry, and a vote this replica forgot elected no
            // one without it. So the vote is safe, and needed: refused, a
            // shard whose leader lost its disk could never elect again.
            crate::raft_net::Rpc::Vote(r) | crate::raft_net::Rpc::PreVote(r)
                if group.voters() > 2 =>
            {
                if let Some(why) = f.refuses_vote(r.last_log_id.map(|l| l.index)) {
                    return Err(why);
                }
            }
            _ => {}
        }
    }
    // A vote granted while careful: the leader it elects needs no telling
    // (`Fresh::admit`).
    let candidate = match (&rpc, group.fresh.as_ref()) {
        (crate::raft_net::Rpc::Vote(r), Some(f)) if f.active() => {
            Some((f.clone(), r.vote.leader_id.term, r.vote.leader_id.voted_for))
        }
        _ => None,
    };
    let answer = handle_now(group, rpc).await;
    if let (Some((f, term, who)), Ok(crate::raft_net::RpcReply::Vote(v))) = (candidate, &answer) {
        if v.vote_granted {
            f.granted(term, who);
        }
    }
    group.fresh_caught_up();
    answer
}

/// The checks an AppendEntries passes before the group sees it, whether
/// it comes alone ([`handle`]) or in its leader's stream of them
/// ([`append_stream`]): its entries follow its `prev_log_id`, and a
/// replica whose data directory is new takes it only from a leader that
/// knows so (`crate::fresh`). Entries wake a quiet group, and are
/// counted (`behind_others`: taken while an earlier call with entries of
/// the same stream is unanswered).
pub(crate) fn admit_append(
    group: &Group,
    r: &AppendEntriesRequest<GroupConfig>,
    behind_others: bool,
) -> Result<(), String> {
    if let Err(why) = contiguous(r) {
        tracing::warn!("refused an AppendEntries: {why}");
        return Err(why);
    }
    group.fresh_caught_up();
    if let Some(f) = group.fresh.as_ref().filter(|f| f.active()) {
        // The leader's commit index, and whether the entry there is of its
        // own term: only then does it cover every entry committed before
        // (`Fresh::admit` takes a bar from a leader it told only so).
        let commit = crate::fresh::Commit {
            index: r.leader_commit.map_or(0, |c| c.index),
            of_its_term: r
                .leader_commit
                .is_some_and(|c| c.leader_id.term == r.vote.leader_id.term),
        };
        f.admit(
            r.vote.leader_id.voted_for,
            r.vote.leader_id.term,
            Some(commit),
        )?;
    }
    if !r.entries.is_empty() {
        use std::sync::atomic::Ordering::Relaxed;
        group.appends.taken.fetch_add(1, Relaxed);
        if behind_others {
            group.appends.behind_others.fetch_add(1, Relaxed);
        }
        // A leader sends entries only to its group's members: a replica
        // that took itself for left behind is in the group again. (Taken
        // before openraft checks the sender's term: a deposed leader's
        // entries end it too, until its node's next probe round.)
        group.quiet.rejoin(&group.raft);
    }
    Ok(())
}

/// The group's answers to a stream of AppendEntries from one leader, one
/// for each, in order: each is handed to the group as it comes (after
/// [`admit_append`]), without waiting for the answer to the one before,
/// so a follower's log writes and syncs go on while the next calls are
/// on their way. The stream ends after the first answer that is not a
/// success (a conflict, a higher vote) or an error of the group (it
/// stopped); the calls taken after that one are not answered.
///
/// It holds the group's Raft handle, not the shard: a shard replaced (its
/// group restarted) is let go of whatever streams were open to it.
pub(crate) fn append_stream<S>(
    group: &Group,
    input: S,
) -> futures_util::stream::BoxStream<'static, Result<AppendEntriesResponse<GroupConfig>, String>>
where
    S: futures_util::Stream<Item = AppendEntriesRequest<GroupConfig>> + Send + 'static,
{
    group
        .raft
        .stream_append(input)
        .map(|r| match r {
            Ok(answer) => Ok(AppendEntriesResponse::from(answer)),
            Err(fatal) => Err(fatal.to_string()),
        })
        .boxed()
}

/// Whether an AppendEntries' entries follow its `prev_log_id` without a
/// gap: a leader's bug (openraft once sent one, `vendor/PATCHES.md`) must
/// not leave a hole in this replica's log, so such a call is refused
/// before openraft sees it (the leader takes the refusal for a failed
/// call and replicates again).
fn contiguous(r: &AppendEntriesRequest<GroupConfig>) -> Result<(), String> {
    let first = r.prev_log_id.map_or(0, |p| p.index + 1);
    for (next, e) in (first..).zip(&r.entries) {
        if e.log_id.index != next {
            return Err(format!(
                "its entries do not follow its prev_log_id {:?} without a gap: entry {} where {next} was due",
                r.prev_log_id.map(|p| p.index),
                e.log_id.index
            ));
        }
    }
    Ok(())
}

impl Group {
    /// Why the group stopped by itself, if it has (a panic of its core, an
    /// error of its storage): it takes nothing more until restarted.
    pub(crate) fn stopped(&self) -> Option<String> {
        self.stopped.get().cloned()
    }

    fn voters(&self) -> usize {
        voters(&self.raft)
    }

    /// This replica's id in its group.
    pub(crate) fn me(&self) -> u64 {
        use openraft::async_runtime::WatchReceiver;
        self.raft.metrics().borrow_watched().id
    }

    /// Whether this node is shutting down and takes no leadership
    /// ([`crate::Replication::draining`]).
    pub(crate) fn is_draining(&self) -> bool {
        self.draining
            .as_ref()
            .is_some_and(|d| d.load(std::sync::atomic::Ordering::Acquire))
    }

    /// Whether this replica's data directory is new and it has not caught
    /// up yet.
    pub(crate) fn is_fresh(&self) -> bool {
        self.fresh.as_ref().is_some_and(|f| f.active())
    }

    /// A new replica heard that `leader` leads its group quietly: it tells
    /// that leader it starts from nothing, if it has not yet.
    pub(crate) fn fresh_heard_of(&self, leader: u64) {
        if let Some(f) = self.fresh.as_ref().filter(|f| f.active()) {
            f.hear_of(leader);
        }
    }

    /// If this replica's data directory was new, whether it has caught up
    /// by now (`crate::fresh`): checked at every call it takes and at every
    /// node heartbeat, so a leader (caught up by being one) and a quiet
    /// follower are not left careful.
    pub(crate) fn fresh_caught_up(&self) {
        if let Some(f) = self.fresh.as_ref().filter(|f| f.active()) {
            use openraft::async_runtime::WatchReceiver;
            let m = self.raft.metrics().borrow_watched().clone();
            let leading = m.state == openraft::ServerState::Leader;
            self.replica
                .maybe_caught_up(m.last_applied.map(|l| l.index), leading);
            f.nudge(m.current_leader);
            // Awake until caught up (see `ShardStore::follow_quietly`): its
            // election timer then stands, and (while it holds no entries
            // and may stand) a quiet leader answering its pre-vote wakes and
            // replicates to it; once it holds some, the leader hears of it
            // through the node heartbeat (`hear_of`) and the word it says
            // every second (`nudge`).
            if f.active() && self.quiet.is_quiet() {
                self.quiet.wake(&self.raft);
            }
        }
    }
}

async fn handle_now(
    group: &Group,
    rpc: crate::raft_net::Rpc,
) -> Result<crate::raft_net::RpcReply, String> {
    let raft = &group.raft;
    match &rpc {
        // (Entries wake the group in `admit_append`.)
        // An election the leader asked for (a leadership transfer): every
        // voter takes part, quiet or not.
        // (Only a member of the group is sent either: a replica that took
        // itself for left behind is in the group again.)
        crate::raft_net::Rpc::TransferLeader(_) | crate::raft_net::Rpc::Snapshot(_) => {
            group.quiet.rejoin(raft);
        }
        // A replica starts again: a quiet leader, which took it for
        // matched, would send it nothing, and it would never catch up;
        // awake, its heartbeats find the replica's log gone, and a
        // follower behind keeps the group awake from then on.
        crate::raft_net::Rpc::Reverted { .. } => {
            group
                .quiet
                .hold_awake(raft, std::time::Duration::from_secs(2));
        }
        crate::raft_net::Rpc::Vote(r) | crate::raft_net::Rpc::PreVote(r)
            if r.leadership_transfer =>
        {
            group.quiet.wake(raft);
        }
        crate::raft_net::Rpc::Vote(_) | crate::raft_net::Rpc::PreVote(_) => {
            if let Some(why) = group.quiet.refuses_vote(group.vote_fresh) {
                return Err(format!("this replica does not vote now: {why}"));
            }
            // Answered: an election is under way, which needs this
            // replica's timers (and a quiet leader's heartbeats, which
            // tell it whether it still leads).
            group.quiet.wake(raft);
            if lease_lapsed(group) {
                confirm_before_a_vote(group).await;
            }
        }
        _ => {}
    }
    match rpc {
        crate::raft_net::Rpc::Beat(_) => {
            Err("a node's heartbeat is for the node, not for one of its groups".into())
        }
        crate::raft_net::Rpc::TransferLeader(r) => raft
            .handle_transfer_leader(r)
            .await
            .map(crate::raft_net::RpcReply::TransferLeader)
            .map_err(|e| e.to_string()),
        crate::raft_net::Rpc::AppendEntries(r) => raft
            .append_entries(r)
            .await
            .map(crate::raft_net::RpcReply::AppendEntries)
            .map_err(|e| e.to_string()),
        crate::raft_net::Rpc::Vote(r) => raft
            .vote(r)
            .await
            .map(crate::raft_net::RpcReply::Vote)
            .map_err(|e| e.to_string()),
        crate::raft_net::Rpc::PreVote(r) => raft
            .pre_vote(r)
            .await
            .map(crate::raft_net::RpcReply::Vote)
            .map_err(|e| e.to_string()),
        crate::raft_net::Rpc::Snapshot(chunk) => receive_snapshot(group, chunk).await,
        crate::raft_net::Rpc::Reverted { node } => crate::fresh::reverted(raft, node).await,
    }
}

/// Whether this replica leads and no quorum has answered it for the
/// election timeout's min (`vote_fresh`): a leader that was quiet (it
/// sends nothing, so hears nothing), or one cut off. openraft's lease
/// (the election timeout's max since a quorum's last answer) has lapsed,
/// or soon will.
fn lease_lapsed(group: &Group) -> bool {
    use openraft::async_runtime::WatchReceiver;
    let m = group.raft.metrics();
    let m = m.borrow_watched();
    m.state == openraft::ServerState::Leader
        && m.last_quorum_acked
            .as_ref()
            .is_none_or(|at| openraft::Instant::elapsed(&**at) > group.vote_fresh)
}

/// A leader asked for a vote or a pre-vote while no quorum answered it
/// lately ([`lease_lapsed`]) first confirms with a quorum that it still
/// leads, within half the election timeout's min (the candidate waits
/// the min for its answer), and the vote is answered after, whatever came
/// of it. A quiet leader heard no quorum, so its lease had lapsed and
/// openraft granted any candidate with as long a log: a follower that
/// lost the leader's calls (a one-way cut, or a restarted node whose
/// election timer ran out before the leader's node heartbeat came) won
/// the group with the leader's own vote, an election an awake leader
/// refuses. Confirmed, its lease is fresh and openraft refuses; deposed
/// (a quorum answers with a newer term), it is a follower by then and
/// votes by Raft's rules; not answered in time, its lease stays lapsed
/// and it votes as before, still within the candidate's time. Every
/// vote that finds the lease lapsed confirms, so two candidates at once
/// both wait for a confirmation. Holding a vote back is always safe.
async fn confirm_before_a_vote(group: &Group) {
    let confirmed = tokio::time::timeout(
        group.vote_fresh / 2,
        group
            .raft
            .ensure_linearizable(openraft::ReadPolicy::ReadIndex),
    )
    .await;
    if !matches!(confirmed, Ok(Ok(_))) {
        tracing::debug!(
            shard = group.replica.group,
            "a leader no quorum answered lately, asked for a vote, could not confirm it leads in time; it answers as its lease says"
        );
    }
}

/// A chunk of a snapshot the leader streams here: staged in order (a
/// chunk 0 starts a new stream, and drops one that did not finish); the
/// last one makes the staged file durable and hands it to openraft, which
/// installs it through the state machine and answers once it has.
async fn receive_snapshot(
    group: &Group,
    chunk: crate::raft_net::SnapshotChunk,
) -> Result<crate::raft_net::RpcReply, String> {
    let stream = chunk.stream();
    {
        // Checked here, not left to openraft, which asserts them (a
        // malformed call must not stop the group).
        use openraft::async_runtime::WatchReceiver;
        let term = group.raft.metrics().borrow_watched().vote.leader_id.term;
        if chunk.vote.leader_id.term < term {
            return Err(format!(
                "a snapshot from the leader of term {}, older than this replica's term {term}",
                chunk.vote.leader_id.term
            ));
        }
        if chunk
            .meta
            .last_log_id
            .is_some_and(|l| l.leader_id.term > chunk.vote.leader_id.term)
        {
            return Err(format!(
                "a snapshot as of an entry of a term after its sender's ({stream})"
            ));
        }
    }
    let mut staging = group.staging.lock().await;
    if chunk.n == 0 {
        if let Some(old) = staging.take() {
            let _ = std::fs::remove_file(&old.path);
        }
        *staging = Some(
            group
                .replica
                .stage(stream.clone())
                .map_err(|e| e.to_string())?,
        );
    }
    let Some(st) = staging
        .as_mut()
        .filter(|s| s.id == stream && s.next == chunk.n)
    else {
        return Err(format!(
            "chunk {} of the snapshot ({stream}) is not the one this replica expects next: \
             the sender starts again",
            chunk.n
        ));
    };
    if !chunk.done {
        tokio::task::block_in_place(|| st.write(&chunk.data)).map_err(|e| e.to_string())?;
        return Ok(crate::raft_net::RpcReply::Snapshot(None));
    }
    let Some(st) = staging.take() else {
        return Err("no snapshot is being staged".into());
    };
    drop(staging);
    let path = tokio::task::block_in_place(|| st.finish()).map_err(|e| e.to_string())?;
    let snapshot = openraft::Snapshot {
        meta: chunk.meta,
        snapshot: ShardSnapshot(SnapshotData::Received(path.clone())),
    };
    let installed = group.raft.install_full_snapshot(chunk.vote, snapshot).await;
    // Installed, the file is gone; still there, openraft did not need it
    // (not newer than what this replica has committed).
    if installed.is_ok() && path.exists() {
        let _ = std::fs::remove_file(&path);
    }
    installed
        .map(|r| crate::raft_net::RpcReply::Snapshot(Some(r)))
        .map_err(|e| e.to_string())
}

#[cfg(test)]
mod tests {
    use super::*;
    use openraft::vote::leader_id_std::CommittedLeaderId;

    fn request(prev: Option<u64>, indexes: &[u64]) -> AppendEntriesRequest<GroupConfig> {
        let log_id = |index| openraft::LogId::new(CommittedLeaderId::new(2), index);
        AppendEntriesRequest {
            vote: openraft::impls::Vote::new_committed(2, 1),
            prev_log_id: prev.map(log_id),
            leader_commit: None,
            entries: indexes
                .iter()
                .map(|i| openraft::Entry {
                    log_id: log_id(*i),
                    payload: openraft::EntryPayload::Blank,
                })
                .collect(),
        }
    }

    #[test]
    fn an_append_with_a_gap_after_its_prev_log_id_is_refused() {
        assert!(contiguous(&request(Some(32), &[33, 34, 35])).is_ok());
        assert!(contiguous(&request(None, &[0, 1])).is_ok());
        assert!(contiguous(&request(Some(32), &[])).is_ok(), "a heartbeat");
        // What openraft sent once (prev 2.32, entries from 40 on).
        let why = contiguous(&request(Some(32), &[40, 41])).expect_err("a gap");
        assert!(why.contains("entry 40 where 33 was due"), "{why}");
        assert!(contiguous(&request(None, &[3])).is_err());
        assert!(
            contiguous(&request(Some(5), &[6, 8])).is_err(),
            "a gap within"
        );
    }
}
