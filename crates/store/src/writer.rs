//! The shard's single writer: what committing one group does. The group's
//! commands go through the state machine ([`crate::machine`]) into one log
//! group, the log makes it durable (one fsync), and only then are its
//! events published to the index and its puts to the keyspaces; the
//! answers are handed back to the commit scheduler ([`crate::commit`]),
//! which decides when groups are committed and sends the answers.
//!
//! Being the only writer of its shard, it can check each command against
//! what is on disk plus what earlier commands of the same batch wrote, with
//! no locks: the writer gives the machine the shard's committed state and
//! the group being built ([`Group`]). If the commit fails, every command in
//! it fails and the shard stops taking writes (the storage may be in an
//! unknown state after a failed fsync, so it fails stop).

use crate::apply::{Applied, Committed, ProposalBuf, SharedCache};
use crate::checkpoints::CheckpointCounters;
use crate::codec;
use crate::keyspaces::Keyspaces;
use crate::log::{Durable, Loc, Log};
use crate::machine::{self, Machine};
use crate::raft_group::{self, Replica, ShardRaft};
use crate::raft_log::{GroupConfig, Proposal};
use crate::read::SharedTail;
use crate::shard_log::{EventFiles, ShardLog};
use crate::write_slot::SlotWait;
use crate::write_slot::{Answer, WriteSlot};
use crate::{
    AppendOutcome, AppendRequest, ExecutionMeta, StartOutcome, StartRequest, StoreError,
    StoredEvent,
};
use fjall::OwnedWriteBatch;
use forkless_types::{Epoch, ExecutionId, PartitionId, ShardId};
use openraft::async_runtime::WatchReceiver;
use openraft::raft::ClientWriteResult;
use std::collections::VecDeque;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Condvar, Mutex, OnceLock};
use std::time::Instant;
use tokio::sync::{oneshot, watch};

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
    /// Checkpoint after this group, whether it writes or not: an idle
    /// shard on the node log is asked to, so that its checkpoint keeps up
    /// with what other shards wrote (see `Store`'s checkpoint sweep).
    Checkpoint(oneshot::Sender<Result<(), StoreError>>),
}

impl Command {
    /// About how many bytes the command takes in its log entry: what a
    /// client sent (payloads, types, keys) and a fixed share for each
    /// event's framing. A group commit is bounded by it
    /// (`GROUP_COMMIT_BYTES_MAX`), and so is a Raft entry, which a leader
    /// sends to its followers whole in one transport frame: counting the
    /// payloads alone let many events with small payloads and long keys
    /// make an entry far larger than the bound.
    pub(crate) fn entry_bytes(&self) -> usize {
        const FRAMING: usize = 32;
        let key = |k: &Option<String>| k.as_ref().map_or(0, String::len);
        match self {
            Command::Start(r, _) => {
                r.started_payload.len()
                    + r.workflow.len()
                    + key(&r.routing_key)
                    + key(&r.idempotency_key)
                    + FRAMING
            }
            Command::Append(r, _) => r
                .events
                .iter()
                .map(|e| e.payload.len() + e.event_type.len() + key(&e.idempotency_key) + FRAMING)
                .sum(),
            Command::AdvanceEpoch(..) | Command::Checkpoint(_) => 0,
        }
    }
}

pub(crate) enum Reply {
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
    Checkpoint(
        oneshot::Sender<Result<(), StoreError>>,
        Result<(), StoreError>,
    ),
}

impl Reply {
    pub(crate) fn send(self) {
        // A caller that went away (client disconnected) is not an error: the
        // write is durable either way.
        match self {
            Reply::Start(tx, r) => drop(tx.send(r)),
            Reply::Append(tx, r) => drop(tx.send(r)),
            Reply::Epoch(tx, r) => drop(tx.send(r)),
            Reply::Checkpoint(tx, r) => drop(tx.send(r)),
        }
    }

    /// Whether the answer was read from the shard's state (a refusal such
    /// as a sequence conflict, a retry found done), not a failure of this
    /// replica or of its leadership.
    fn rests_on_state(&self) -> bool {
        let result = match self {
            Reply::Start(_, r) => r.as_ref().err(),
            Reply::Append(_, r) => r.as_ref().err(),
            Reply::Epoch(_, r) => r.as_ref().err(),
            Reply::Checkpoint(..) => return false,
        };
        !matches!(
            result,
            Some(
                StoreError::NotLeader { .. }
                    | StoreError::NotExecuted { .. }
                    | StoreError::OutcomeUnknown { .. }
                    | StoreError::ShardFailed { .. }
                    | StoreError::WriterGone
                    | StoreError::Io(_)
                    | StoreError::Corrupt(_)
                    | StoreError::Invalid(_)
            )
        )
    }

    /// The reply, whatever it was, becomes `err` (a group evaluated as
    /// of a group in flight that failed: its refusals rest on a state
    /// that may never have been, as much as its successes).
    fn fail_all(self, err: StoreError) -> Reply {
        match self {
            Reply::Start(tx, _) => Reply::Start(tx, Err(err)),
            Reply::Append(tx, _) => Reply::Append(tx, Err(err)),
            Reply::Epoch(tx, _) => Reply::Epoch(tx, Err(err)),
            Reply::Checkpoint(tx, _) => Reply::Checkpoint(tx, Err(err)),
        }
    }

    /// [`Reply::fail`] for a group whose entry did not commit at its
    /// term (not led when proposed, discarded, or abandoned): no quorum's
    /// word covers the state its refusals were read from either (its
    /// leader may have been deposed), so a refusal is not executed (it
    /// wrote nothing), to be asked again of the leader; a failure of this
    /// replica stays as it was.
    fn fail_unconfirmed(self, err: StoreError, shard: ShardId) -> Reply {
        if !self.rests_on_state() {
            return self.fail(err);
        }
        let unconfirmed = |refusal: &StoreError| StoreError::NotExecuted {
            shard,
            reason: format!(
                "its group's entry did not commit ({err}), so no quorum confirmed the state it was \
                 answered from ({refusal}); nothing was written"
            ),
        };
        match self {
            Reply::Start(tx, Err(r)) => Reply::Start(tx, Err(unconfirmed(&r))),
            Reply::Append(tx, Err(r)) => Reply::Append(tx, Err(unconfirmed(&r))),
            Reply::Epoch(tx, Err(r)) => Reply::Epoch(tx, Err(unconfirmed(&r))),
            other => other.fail(err),
        }
    }

    fn fail(self, err: StoreError) -> Reply {
        match self {
            Reply::Start(tx, Ok(_)) => Reply::Start(tx, Err(err)),
            Reply::Append(tx, Ok(_)) => Reply::Append(tx, Err(err)),
            Reply::Epoch(tx, Ok(_)) => Reply::Epoch(tx, Err(err)),
            Reply::Checkpoint(tx, Ok(())) => Reply::Checkpoint(tx, Err(err)),
            other => other,
        }
    }
}

pub(crate) struct Writer {
    shard: ShardId,
    ks: Keyspaces,
    /// The shard's log: every group is written and synced here first.
    log: ShardLog,
    /// The in-memory part of the events index, shared with readers.
    tail: SharedTail,
    /// Events of the group being built, indexed once it is durable.
    pending: Vec<PendingEvent>,
    /// See [`crate::StoreConfig::log_checkpoint_bytes`]: measured in the
    /// log's bytes, every group's (see [`Log::written`]).
    checkpoint_bytes: u64,
    epoch: Arc<AtomicU64>,
    commits: watch::Sender<u64>,
    /// Woken for the executions each durable group wrote.
    waiters: Arc<crate::waiters::Waiters>,
    /// Set after a failed commit: every later write is refused with it
    /// (a [`StoreError::ShardFailed`]).
    failed: Option<StoreError>,
    /// The same reason, for readers of the shard's state.
    failure: Arc<OnceLock<String>>,
    /// Metadata of recently written executions, exactly as on disk: it is
    /// updated only after a commit succeeded (by the writer, or by the
    /// shard's Raft apply), so it can never be ahead of or behind the
    /// disk. Saves a memtable/table lookup per append on the hot path.
    cache: SharedCache,
    /// Where durable events are read from.
    events: EventFiles,
    /// The shard's Raft group, if it has one: its groups are proposed to
    /// it and published by its apply, not written to `log`.
    raft: Option<RaftWrite>,
    /// What the commands do; it holds what the group being built wrote so
    /// far (empty between groups; kept for its tables' capacity).
    machine: Machine,
    /// Where the log reports the group being committed durable.
    durable: Arc<DurableSlot>,
    checkpoints: Arc<CheckpointCounters>,
    /// Groups proposed to the shard's Raft group and not yet settled,
    /// oldest first ([`RaftWrite::depth`] at most; `docs/replication.md`,
    /// "Groups in flight"). Their answers go out in order, each once its
    /// entry is applied and every group before it stood.
    in_flight: VecDeque<InFlight>,
    /// The term the groups in flight were proposed under.
    in_flight_term: u64,
    /// Why a group in flight did not stand: every later group in flight
    /// was evaluated as of what it wrote, so their answers are unknown,
    /// and no group is evaluated until all are settled.
    poisoned: Option<StoreError>,
    /// Groups that wrote and were proposed while others were in flight.
    pub(crate) behind_others: u64,
}

/// A group proposed and not yet settled.
struct InFlight {
    replies: Vec<Reply>,
    /// Where its entry's outcome arrives; `None` for a group that wrote
    /// nothing (its answers stand once the groups before it did).
    answer: Option<SlotWait<ClientWriteResult<GroupConfig>>>,
    proposed: Instant,
    /// A checkpoint was asked for after it.
    asked: bool,
}

/// A shard's Raft group as its writer uses it.
pub(crate) struct RaftWrite {
    pub(crate) raft: ShardRaft,
    /// Whether the group has replicas on other nodes.
    pub(crate) replicated: bool,
    /// Whether the group's timers are off: a write wakes it.
    pub(crate) quiet: Arc<crate::quiet::Quiet>,
    pub(crate) replica: Arc<Replica>,
    pub(crate) proposal: ProposalBuf,
    /// How many groups may be in flight at once (1: each group is
    /// applied before the next is evaluated).
    pub(crate) depth: usize,
}

/// How long a new leader's writer waits for its term's first entry to be
/// applied before it evaluates a group (the entries of the terms before
/// are applied with it); then the group is refused, not executed.
const LEADER_READY_WITHIN: std::time::Duration = std::time::Duration::from_secs(2);

/// How long a leader of a replicated group may go without a quorum of
/// its group answering (its heartbeats are every 100 ms) before it takes
/// itself for cut off: it evaluates no new group, and a write waiting on
/// its entry is answered as unknown then rather than at [`WRITE_WITHIN`].
const QUORUM_SILENT_MAX: std::time::Duration = std::time::Duration::from_millis(1500);

/// How often a write waiting on its entry looks at its leader's quorum.
pub(crate) const WAIT_SLICE: std::time::Duration = std::time::Duration::from_millis(100);

impl RaftWrite {
    /// Why this node, though it leads, should take itself for cut off from
    /// its group (no quorum has answered it for [`QUORUM_SILENT_MAX`]).
    fn cut_off(&self) -> Option<String> {
        self.cut_off_since(None)
    }

    /// [`RaftWrite::cut_off`], for a group proposed at `proposed`: only the
    /// silence since then counts. The group was proposed while this node
    /// led and was not cut off, or had just confirmed it leads (a quiet
    /// group woken: its metrics may still show the quorum's last answer
    /// from before it went quiet, and a group proposed then was answered
    /// unknown at once by the writer's first look: the quiescence test of
    /// `forkless-raftnet` failed so in 2 of 8 runs).
    fn cut_off_since(&self, proposed: Option<std::time::Instant>) -> Option<String> {
        if !self.replicated {
            return None;
        }
        let m = self.raft.metrics();
        let m = m.borrow_watched();
        let acked = m.last_quorum_acked.as_ref()?;
        let mut silent = openraft::Instant::elapsed(&**acked);
        if let Some(p) = proposed {
            silent = silent.min(p.elapsed());
        }
        (m.current_leader == Some(m.id) && silent > QUORUM_SILENT_MAX).then(|| {
            format!(
                "no quorum of the shard's group has answered this node, its leader at term {}, for {} ms: it may be cut off",
                m.current_term,
                silent.as_millis()
            )
        })
    }

    /// Wakes the group if it was quiet. A quiet leader has not heard a
    /// quorum for as long as it was quiet, so it confirms it still leads
    /// (a heartbeat round, as for a read) before it evaluates a group:
    /// else [`RaftWrite::cut_off`] would take it for cut off, and a leader
    /// deposed meanwhile would evaluate against a stale state only to have
    /// its entry discarded.
    fn wake(&self, shard: ShardId) -> Result<bool, StoreError> {
        if !self.replicated {
            return Ok(false);
        }
        // Only the leader's writes wake the group (a follower's refuses
        // them, in `leading`).
        let leads = {
            let m = self.raft.metrics();
            let m = m.borrow_watched();
            m.current_leader == Some(m.id)
        };
        if !leads || !self.quiet.touch(&self.raft) {
            return Ok(false);
        }
        self.confirm_leads(shard, "the shard's group was idle")?;
        Ok(true)
    }

    /// Confirms with a quorum that this node still leads the group (a
    /// read-index round, as a linearizable read makes), waiting at most
    /// [`LEADER_READY_WITHIN`]; else why not, `since` saying why it was
    /// asked.
    fn confirm_leads(&self, shard: ShardId, since: &str) -> Result<(), StoreError> {
        let raft = self.raft.clone();
        let confirmed = raft_group::run(
            async move {
                tokio::time::timeout(
                    LEADER_READY_WITHIN,
                    raft.ensure_linearizable(openraft::ReadPolicy::ReadIndex),
                )
                .await
            },
            LEADER_READY_WITHIN * 2,
        )?;
        match confirmed {
            Some(Ok(Ok(_))) => Ok(()),
            Some(Ok(Err(e))) => Err(raft_group::forwarded(&self.raft, shard, e.forward_to_leader(), || {
                format!("{since}, and this node could not confirm it still leads the shard's group: {e}")
            })),
            _ => Err(StoreError::NotExecuted {
                shard,
                reason: format!(
                    "{since}, and no quorum confirmed this node still leads the shard's group within {} s",
                    LEADER_READY_WITHIN.as_secs()
                ),
            }),
        }
    }

    /// The term this node leads the shard's group at, once it has applied
    /// an entry of that term; else why the shard's writes cannot be
    /// evaluated here (not executed: safe to retry, at the leader).
    /// `confirmed`: a quorum has just confirmed this node's leadership
    /// (the group woke), which the metrics may not show yet.
    fn leading(&self, shard: ShardId, confirmed: bool) -> Result<u64, StoreError> {
        let ready = |m: &openraft::RaftMetrics<crate::raft_log::GroupConfig>| {
            m.current_leader == Some(m.id)
                && m.last_applied
                    .is_some_and(|l| l.leader_id.term == m.current_term)
        };
        let (id, leader, term) = {
            let m = self.raft.metrics();
            let m = m.borrow_watched();
            if ready(&m) {
                drop(m);
                if let Some(why) = self.cut_off().filter(|_| !confirmed) {
                    return Err(StoreError::NotExecuted { shard, reason: why });
                }
                return Ok(self.raft.metrics().borrow_watched().current_term);
            }
            (m.id, m.current_leader, m.current_term)
        };
        // No leader known: an election is under way. The group waits for
        // its outcome (an election timeout at most, and at most
        // `LEADER_READY_WITHIN`; the groups behind it queue) rather than
        // being refused at once: if this node wins, it is evaluated here;
        // if another does, the edge sends it there. (On an idle shard the
        // caller commits on its own thread, an API worker, which waits
        // with it, as it does for `wake` and for a new leader's first
        // entry.)
        let (leader, term) = match leader {
            Some(_) => (leader, term),
            None => {
                let raft = self.raft.clone();
                let within =
                    std::time::Duration::from_millis(self.raft.config().election_timeout_max)
                        .min(LEADER_READY_WITHIN);
                let elected = raft_group::run(
                    async move {
                        raft.wait(Some(within))
                            .metrics(|m| m.current_leader.is_some(), "a leader known")
                            .await
                    },
                    within * 2,
                )?;
                match elected {
                    Some(Ok(m)) => (m.current_leader, m.current_term),
                    _ => (None, self.raft.metrics().borrow_watched().current_term),
                }
            }
        };
        if leader != Some(id) {
            return Err(raft_group::not_leader(shard, id, leader, term));
        }
        // Elected: wait for its first entry to apply.
        let raft = self.raft.clone();
        let waited = raft_group::run(
            async move {
                raft.wait(Some(LEADER_READY_WITHIN))
                    .metrics(ready, "the leader's first entry applied")
                    .await
            },
            LEADER_READY_WITHIN * 2,
        )?;
        match waited {
            Some(Ok(m)) => Ok(m.current_term),
            _ => {
                let m = self.raft.metrics();
                let m = m.borrow_watched();
                Err(StoreError::NotExecuted {
                    shard,
                    reason: format!(
                        "this node was elected at term {} but has not applied that term's first entry within {} s",
                        m.current_term,
                        LEADER_READY_WITHIN.as_secs()
                    ),
                })
            }
        }
    }
}

/// How long a write waits for its group to commit and apply its entry;
/// then its outcome is unknown (a leader cut off from its group never
/// hears; `docs/replication.md`, "Writes whose outcome Raft cannot tell").
pub const WRITE_WITHIN: std::time::Duration = std::time::Duration::from_secs(10);

/// Where the log reports a group durable ([`Log::append`]'s callback),
/// for the writer that waits for it: the segment log calls back before
/// `append` returns, a log with a syncer of its own from that thread.
#[derive(Default)]
struct DurableSlot {
    made: Mutex<Option<Result<Durable, StoreError>>>,
    filled: Condvar,
}

impl DurableSlot {
    fn fill(&self, made: Result<Durable, StoreError>) {
        *self.made.lock().unwrap_or_else(|e| e.into_inner()) = Some(made);
        self.filled.notify_one();
    }

    fn wait(&self) -> Result<Durable, StoreError> {
        let mut made = self.made.lock().unwrap_or_else(|e| e.into_inner());
        loop {
            if let Some(made) = made.take() {
                return made;
            }
            made = self.filled.wait(made).unwrap_or_else(|e| e.into_inner());
        }
    }
}

/// An event of the group being built (`loc` within the group, see
/// [`Log::event`]).
struct PendingEvent {
    partition: PartitionId,
    id: ExecutionId,
    seq: u64,
    loc: Loc,
    recorded_at: u64,
}

impl Writer {
    #[allow(clippy::too_many_arguments)]
    pub(crate) fn new(
        shard: ShardId,
        ks: Keyspaces,
        log: ShardLog,
        tail: SharedTail,
        checkpoint_bytes: u64,
        epoch: Arc<AtomicU64>,
        commits: watch::Sender<u64>,
        checkpoints: Arc<CheckpointCounters>,
        failure: Arc<OnceLock<String>>,
        waiters: Arc<crate::waiters::Waiters>,
        cache: SharedCache,
        raft: Option<RaftWrite>,
    ) -> Writer {
        let events = log.events();
        Writer {
            events,
            raft,
            waiters,
            checkpoints,
            failure,
            shard,
            ks,
            log,
            tail,
            pending: Vec::new(),
            checkpoint_bytes: checkpoint_bytes.max(1),
            epoch,
            commits,
            failed: None,
            cache,
            machine: Machine::default(),
            durable: Arc::default(),
            in_flight: VecDeque::new(),
            in_flight_term: 0,
            poisoned: None,
            behind_others: 0,
        }
    }

    /// Whether groups are in flight (proposed, not yet settled).
    pub(crate) fn has_in_flight(&self) -> bool {
        !self.in_flight.is_empty()
    }

    /// Whether as many groups are in flight as may be: the next group is
    /// taken off the queue only once one settles, so that it holds every
    /// command that came meanwhile (taken now, it would hold only those
    /// that came during the last evaluation, and wait as long).
    pub(crate) fn pipeline_full(&self) -> bool {
        self.raft
            .as_ref()
            .is_some_and(|r| self.in_flight.len() >= r.depth.max(1))
    }

    pub(crate) fn shard(&self) -> ShardId {
        self.shard
    }

    /// Applies `cmds` as one atomic batch with one fsync and returns
    /// answers to be sent by the caller (after the commit, never before).
    /// Also says whether the group wrote anything (a group of refused
    /// commands commits nothing and costs no fsync).
    ///
    /// Under Raft the answers returned are those of the groups settled
    /// meanwhile: with `pipeline` (the thread to wake when an answer
    /// arrives: the shard's writer thread) this group may be left in
    /// flight, to be settled by a later call or by
    /// [`Writer::settle_ready`]; without, every group in flight is
    /// settled before it returns.
    pub(crate) fn commit_group(
        &mut self,
        cmds: &mut Vec<Command>,
        pipeline: Option<&std::thread::Thread>,
    ) -> (Vec<Reply>, bool) {
        let now = now_ms();
        // A log that failed refuses the group before it is tried (the node
        // log, under a Raft group too: its entries would go there).
        if self.failed.is_none() {
            if let Err(e) = self.log.begin() {
                self.fail_stop(e);
            }
        }
        // Under Raft the group is evaluated against this replica's applied
        // state plus what the groups in flight wrote, which is the group's
        // only once this node leads and has applied its term's first entry
        // (everything committed before it), and the groups in flight are
        // of that term and none of them failed.
        let mut settled = self.settle_ready();
        let mut not_leading = None;
        // Whether a quorum confirmed this node leads since the group's
        // commands came (its group woke from quiet): then a group that
        // writes nothing needs no second round.
        let mut confirmed = false;
        let lead = self.raft.as_ref().map(|r| {
            r.wake(self.shard)
                .and_then(|woke| r.leading(self.shard, woke).map(|term| (term, woke)))
        });
        match lead {
            Some(Ok((term, woke))) => {
                confirmed = woke;
                if !self.in_flight.is_empty() && self.in_flight_term != term {
                    settled.extend(self.settle_all());
                }
                while self.pipeline_full() && self.poisoned.is_none() {
                    settled.extend(self.settle_oldest(true).unwrap_or_default());
                }
                if self.poisoned.is_some() {
                    settled.extend(self.settle_all());
                }
                self.in_flight_term = term;
                if let Some(r) = &mut self.raft {
                    r.proposal.begin(term);
                }
            }
            Some(Err(e)) => {
                settled.extend(self.settle_all());
                not_leading = Some(e);
            }
            None => {}
        }
        let in_flight = self.machine.groups_in_flight();
        self.pending.clear();
        // Applied to the keyspaces only once the group is durable in the
        // log, which is what makes them durable: no sync of fjall's own.
        let mut batch = self.ks.db.batch().durability(None);
        self.machine.begin();
        let cache = self.cache.lock().unwrap_or_else(|e| e.into_inner());
        let out = match &mut self.raft {
            Some(r) => Out::Proposal(&mut r.proposal),
            None => Out::Log {
                log: &mut self.log,
                batch: &mut batch,
            },
        };
        let mut group = Group {
            committed: Committed {
                ks: &self.ks,
                tail: &self.tail,
                cache: &cache,
                epoch: &self.epoch,
                events: &self.events,
            },
            out,
            pending: &mut self.pending,
            in_flight,
            shard: self.shard,
        };
        let mut replies = Vec::with_capacity(cmds.len());
        let mut asked = false;
        for cmd in cmds.drain(..) {
            // A failed disk is this replica's fact, not the shard's state:
            // checked here, before the machine sees the command.
            if let Some(e) = &self.failed {
                replies.push(match cmd {
                    Command::Start(_, tx) => Reply::Start(tx, Err(e.clone())),
                    Command::Append(_, tx) => Reply::Append(tx, Err(e.clone())),
                    Command::AdvanceEpoch(_, tx) => Reply::Epoch(tx, Err(e.clone())),
                    Command::Checkpoint(tx) => Reply::Checkpoint(tx, Err(e.clone())),
                });
                continue;
            }
            if let Some(e) = &not_leading {
                replies.push(match cmd {
                    Command::Start(_, tx) => Reply::Start(tx, Err(e.clone())),
                    Command::Append(_, tx) => Reply::Append(tx, Err(e.clone())),
                    Command::AdvanceEpoch(_, tx) => Reply::Epoch(tx, Err(e.clone())),
                    // A replica checkpoints what it applied, leader or not.
                    Command::Checkpoint(tx) => {
                        asked = true;
                        Reply::Checkpoint(tx, Ok(()))
                    }
                });
                continue;
            }
            let machine = &mut self.machine;
            replies.push(match cmd {
                Command::Start(req, tx) => Reply::Start(tx, machine.start(&mut group, &req, now)),
                Command::Append(req, tx) => {
                    Reply::Append(tx, machine.append(&mut group, &req, now))
                }
                Command::AdvanceEpoch(e, tx) => {
                    Reply::Epoch(tx, machine.advance_epoch(&mut group, e))
                }
                // Answered once the checkpoint after the group is made.
                Command::Checkpoint(tx) => {
                    asked = true;
                    Reply::Checkpoint(tx, Ok(()))
                }
            });
        }
        // The cache's lock goes before the entry is proposed: the apply
        // takes it.
        drop(cache);
        if self.raft.is_some() {
            let (mut proposed, wrote) = self.propose(replies, asked, pipeline, confirmed);
            settled.append(&mut proposed);
            match pipeline {
                Some(_) => settled.extend(self.settle_ready()),
                None => settled.extend(self.settle_all()),
            }
            return (settled, wrote);
        }
        let wrote = !self.log.is_empty();
        if wrote {
            let slot = self.durable.clone();
            self.log.append(move |made| slot.fill(made));
            let made = self
                .durable
                .wait()
                .and_then(|durable| self.publish(batch, &durable));
            if let Err(err) = made {
                self.fail_stop(err.clone());
                // The group reached the disk in part, in full or not at
                // all: its writes' outcome is unknown (a reopen finds out).
                let unknown = StoreError::OutcomeUnknown {
                    shard: self.shard,
                    reason: err.to_string(),
                };
                let failed = replies
                    .into_iter()
                    .map(|r| r.fail(unknown.clone()))
                    .collect();
                return (failed, false);
            }
            if let Some(e) = self.machine.epoch_moved() {
                self.epoch.store(e.get(), Ordering::Release);
            }
            self.waiters.wake(self.machine.written());
            self.cache
                .lock()
                .unwrap_or_else(|e| e.into_inner())
                .extend(self.machine.take_written());
            self.commits.send_modify(|c| *c += 1);
        }
        if self.failed.is_none()
            && ((wrote && self.since_checkpoint() >= self.checkpoint_bytes) || asked)
        {
            if let Err(e) = self.checkpoint() {
                // This group is durable and visible; later ones are
                // refused, since the keyspaces' state is unknown.
                self.fail_stop(e.clone());
                replies = checkpoint_failed(replies, &e);
            }
        }
        (replies, wrote)
    }

    /// Proposes the group's proposal to the shard's Raft group and puts
    /// the group in flight (a group that wrote nothing too: its answers
    /// rest on the groups in flight before it). Returns answers only if
    /// the group could not be proposed; says whether it wrote.
    fn propose(
        &mut self,
        replies: Vec<Reply>,
        asked: bool,
        waker: Option<&std::thread::Thread>,
        confirmed: bool,
    ) -> (Vec<Reply>, bool) {
        let Some(r) = &mut self.raft else {
            return (replies, false);
        };
        let wrote = r.proposal.has_records();
        // A group that writes nothing is answered from this replica's
        // state alone (a refusal, a retry found done): no entry of it
        // commits to prove that this node still leads. A leader deposed
        // without knowing it (cut off, or handing its leadership over)
        // would answer from a state the new leader has moved on from (a
        // start there answered "not found" here, say), until it takes
        // itself for cut off. So a quorum confirms first, as for a read
        // (unless one did as the group woke, after its commands came);
        // refused so, the answers are not executed (nothing was written)
        // and the edge asks the leader.
        if !wrote && !confirmed && r.replicated && replies.iter().any(Reply::rests_on_state) {
            if let Err(e) = r.confirm_leads(self.shard, "the group writes nothing") {
                self.machine.begin();
                return (
                    replies.into_iter().map(|r| r.fail_all(e.clone())).collect(),
                    false,
                );
            }
        }
        let mut answer = None;
        if wrote {
            let proposal = Proposal(r.proposal.take());
            // Handed to the group's core from this thread (its queue takes
            // it at once, with room for 65,536), answered by its apply.
            // Unconstrained: on a caller's thread of a runtime, tokio's
            // cooperative budget would keep refusing the send, and this
            // thread would poll it forever.
            let (slot, wait) = WriteSlot::new(waker.cloned());
            let sent = futures_executor::block_on(tokio::task::unconstrained(
                r.raft.client_write_ff(proposal, Some(slot)),
            ));
            if let Err(fatal) = sent {
                let e = StoreError::OutcomeUnknown {
                    shard: self.shard,
                    reason: format!("the shard's Raft group stopped: {fatal}"),
                };
                self.fail_stop(e.clone());
                // Never in flight: what it wrote goes (the groups in
                // flight are answered as their group lets them go).
                self.machine.begin();
                return (
                    replies.into_iter().map(|r| r.fail(e.clone())).collect(),
                    false,
                );
            }
            answer = Some(wait);
            if !self.in_flight.is_empty() {
                self.behind_others += 1;
            }
        }
        self.machine.push_in_flight();
        self.in_flight.push_back(InFlight {
            replies,
            answer,
            proposed: Instant::now(),
            asked,
        });
        (Vec::new(), wrote)
    }

    /// Settles the groups in flight whose outcome is known, oldest first,
    /// without waiting; also settles (as unknown) the oldest one whose
    /// entry has waited [`WRITE_WITHIN`] or whose leader seems cut off.
    pub(crate) fn settle_ready(&mut self) -> Vec<Reply> {
        let mut out = Vec::new();
        while let Some(mut replies) = self.settle_oldest(false) {
            out.append(&mut replies);
        }
        out
    }

    /// Settles every group in flight, waiting for each.
    pub(crate) fn settle_all(&mut self) -> Vec<Reply> {
        let mut out = Vec::new();
        while let Some(mut replies) = self.settle_oldest(true) {
            out.append(&mut replies);
        }
        out
    }

    /// Settles the oldest group in flight: its answers stand if its entry
    /// was committed and applied and every group before it stood; else
    /// they fail with what Raft said (not executed: this node does not
    /// lead, or the entry was refused at its apply; or not known), or, if
    /// an earlier group failed, as unknown. `None` if no group is in
    /// flight, or, with `wait` false, the oldest's outcome is not known
    /// yet.
    fn settle_oldest(&mut self, wait: bool) -> Option<Vec<Reply>> {
        let front = self.in_flight.front()?;
        let answer = match &front.answer {
            None => None,
            Some(slot) => Some(loop {
                let slice = if wait {
                    WAIT_SLICE
                } else {
                    std::time::Duration::ZERO
                };
                let a = slot.wait(slice);
                if !matches!(a, Answer::Waiting) || front.proposed.elapsed() >= WRITE_WITHIN {
                    break a;
                }
                let proposed = Some(front.proposed);
                if let Some(why) = self.raft.as_ref().and_then(|r| r.cut_off_since(proposed)) {
                    break Answer::Abandoned(why);
                }
                if !wait {
                    return None;
                }
            }),
        };
        // (Refused at apply: the entry committed at its term.)
        let committed = matches!(
            &answer,
            Some(Answer::Done(Ok(r))) if matches!(r.data, Applied::Refused(_))
        );
        let failed = answer.and_then(|a| self.failure_of(a));
        let group = self.in_flight.pop_front()?;
        self.machine.settle_oldest();
        let replies = match (failed, &self.poisoned) {
            // The first to fail was evaluated against a state that stood:
            // its refusals stand if its entry committed at its term (and
            // was refused at apply), which confirms this node led as it
            // answered; else nothing confirms it, and they are not
            // executed. A later one's rest on the failed group's writes,
            // so all its answers become its own failure.
            (Some(e), None) => {
                self.poisoned = Some(e.clone());
                let shard = self.shard;
                group
                    .replies
                    .into_iter()
                    .map(|r| {
                        if committed {
                            r.fail(e.clone())
                        } else {
                            r.fail_unconfirmed(e.clone(), shard)
                        }
                    })
                    .collect()
            }
            (Some(e), Some(_)) => group
                .replies
                .into_iter()
                .map(|r| r.fail_all(e.clone()))
                .collect(),
            (None, Some(p)) => {
                let e = StoreError::OutcomeUnknown {
                    shard: self.shard,
                    reason: format!(
                        "a group proposed before it, which it was evaluated after, failed ({p})"
                    ),
                };
                group
                    .replies
                    .into_iter()
                    .map(|r| r.fail_all(e.clone()))
                    .collect()
            }
            (None, None) => {
                let mut replies = group.replies;
                if group.asked && self.failed.is_none() {
                    if let Some(r) = &self.raft {
                        if let Err(e) = r.replica.checkpoint() {
                            self.fail_stop(e.clone());
                            replies = checkpoint_failed(replies, &e);
                        }
                    }
                }
                replies
            }
        };
        if self.in_flight.is_empty() {
            self.poisoned = None;
        }
        Some(replies)
    }

    /// Why a proposed group's answers do not stand, from what its entry
    /// came to; `None` if they do.
    fn failure_of(&mut self, answer: Answer<ClientWriteResult<GroupConfig>>) -> Option<StoreError> {
        use openraft::errors::ClientWriteError;
        let shard = self.shard;
        let not_executed = |reason: String| StoreError::NotExecuted { shard, reason };
        let unknown = |reason: String| StoreError::OutcomeUnknown { shard, reason };
        match answer {
            Answer::Done(Ok(resp)) => match resp.data {
                Applied::Done => None,
                Applied::Refused(why) => Some(not_executed(format!(
                    "its entry was refused at apply: {why}"
                ))),
            },
            // Refused before its entry was appended (openraft answers an
            // appended entry that did not commit `LogEntryDiscarded`,
            // below): never executed, so the edge may send it on. Not
            // `ClientWriteError::forward_to_leader()`, which says `Some`
            // for `LogEntryDiscarded` too.
            Answer::Done(Err(ClientWriteError::ForwardToLeader(f))) => Some(match &self.raft {
                Some(r) => raft_group::forwarded(&r.raft, shard, Some(&f), || {
                    format!("this node does not lead the shard's group ({f})")
                }),
                None => not_executed(format!("this node does not lead the shard's group ({f})")),
            }),
            Answer::Done(Err(ClientWriteError::LogEntryDiscarded(_))) => Some(unknown(
                "its entry was discarded by a newer leader; it may have been committed".into(),
            )),
            // Refused before anything was appended (the shard's writes
            // carry no membership change and no precondition of
            // openraft's, so these do not come). Each variant is named,
            // none taken by a catch-all: one a later openraft adds must be
            // decided here, not answered "not executed" unseen.
            Answer::Done(Err(
                e @ (ClientWriteError::ChangeMembershipError(_)
                | ClientWriteError::PreconditionFailed(_)),
            )) => Some(not_executed(e.to_string())),
            // The group stopped with the entry (a failed write of its
            // log, a panic): what it did is unknown, and so is its state.
            Answer::Dropped => {
                let fatal = self.raft.as_ref().and_then(|r| {
                    match &r.raft.metrics().borrow_watched().running_state {
                        Err(fatal) => Some(fatal.to_string()),
                        Ok(()) => None,
                    }
                });
                // The group's metrics may not say yet; a failed node
                // log does.
                let why = fatal
                    .or_else(|| self.log.begin().err().map(|e| e.to_string()))
                    .unwrap_or_else(|| "no reason given".into());
                let e = unknown(format!(
                    "the shard's Raft group stopped with this write: {why}"
                ));
                self.fail_stop(e.clone());
                Some(e)
            }
            Answer::Waiting => Some(unknown(format!(
                "its entry was not committed and applied within {} s",
                WRITE_WITHIN.as_secs()
            ))),
            Answer::Abandoned(why) => Some(unknown(format!(
                "its entry was proposed but not yet committed when {why}"
            ))),
        }
    }

    /// The log's bytes written since the last checkpoint.
    fn since_checkpoint(&self) -> u64 {
        self.log
            .written()
            .saturating_sub(self.checkpoints.at_written.load(Ordering::Relaxed))
    }

    /// Makes a durable group visible: its events in the tail and its puts
    /// in the keyspaces, together (readers take the tail's lock with their
    /// snapshot).
    fn publish(&mut self, batch: OwnedWriteBatch, durable: &Durable) -> Result<(), StoreError> {
        let mut tail = self.tail.write().unwrap_or_else(|e| e.into_inner());
        for e in self.pending.drain(..) {
            tail.push(
                e.partition,
                e.id,
                e.seq,
                durable.locate(e.loc),
                e.recorded_at,
            )?;
        }
        if !batch.is_empty() {
            batch.commit()?;
        }
        Ok(())
    }

    /// Moves the tail into the sorted index (see
    /// [`crate::index::Tail::checkpoint`]), then makes it durable. Only the
    /// commit of the index batch holds the tail's write lock (this thread
    /// is the tail's only writer, so the batch is built under the read
    /// lock, and nothing changes in between): the entries and the
    /// checkpoint position are visible to readers once committed. Until
    /// the sync that follows, a crash finds the previous checkpoint and
    /// replays the log from there, which writes the same entries again.
    fn checkpoint(&mut self) -> Result<(), StoreError> {
        let start = Instant::now();
        let at = self.log.checkpoint_position();
        let log_written = self.log.written();
        let (batch, written) = self
            .tail
            .read()
            .unwrap_or_else(|e| e.into_inner())
            .checkpoint_batch(&self.ks, at);
        self.tail
            .write()
            .unwrap_or_else(|e| e.into_inner())
            .commit_checkpoint(batch)?;
        let indexed = start.elapsed();
        self.ks
            .db
            .persist(fjall::PersistMode::SyncData)
            .map_err(StoreError::from)?;
        let synced = start.elapsed() - indexed;
        let c = &self.checkpoints;
        c.at_written.store(log_written, Ordering::Relaxed);
        c.made.fetch_add(1, Ordering::Relaxed);
        c.index_micros
            .fetch_add(indexed.as_micros() as u64, Ordering::Relaxed);
        c.sync_micros
            .fetch_add(synced.as_micros() as u64, Ordering::Relaxed);
        tracing::debug!(
            shard = %self.shard,
            entries = written.entries,
            events = written.events,
            index_us = indexed.as_micros() as u64,
            sync_us = synced.as_micros() as u64,
            "checkpoint"
        );
        Ok(())
    }

    /// Refuses every later write: after a failed write or sync the state
    /// of the log's end (and of the keyspaces) is unknown until reopened.
    /// The group being built is dropped and the log takes no more groups:
    /// a write the clients were told had failed must never become durable
    /// later (after a failed `fdatasync` the kernel may even have marked
    /// the unwritten pages clean, so a later sync would not say so).
    fn fail_stop(&mut self, e: StoreError) {
        if self.failed.is_some() {
            return;
        }
        self.log.fail_stop();
        let reason =
            format!("a write or sync of its log failed ({e}); restart the node to reopen it");
        tracing::error!(shard = %self.shard, error = %e, "commit failed; the shard refuses writes from now on");
        let _ = self.failure.set(reason.clone());
        self.failed = Some(StoreError::ShardFailed {
            shard: self.shard,
            reason,
        });
    }

    /// Checkpoints on the way out, so that the next open replays nothing.
    pub(crate) fn close(&mut self) {
        if let Some(r) = &self.raft {
            if self.failed.is_none() && r.replica.since_checkpoint() > 0 {
                if let Err(e) = r.replica.checkpoint() {
                    tracing::warn!(shard = %self.shard, error = %e, "checkpoint at close failed; the next open replays the log");
                }
            }
            return;
        }
        if self.failed.is_none() && self.since_checkpoint() > 0 {
            if let Err(e) = self.checkpoint() {
                tracing::warn!(shard = %self.shard, error = %e, "checkpoint at close failed; the next open replays the log");
            }
        }
    }
}

/// The checkpoint after a group failed: the group's own answers stand
/// (it is durable and visible); the checkpoint's answer fails.
fn checkpoint_failed(replies: Vec<Reply>, e: &StoreError) -> Vec<Reply> {
    replies
        .into_iter()
        .map(|r| match r {
            Reply::Checkpoint(tx, Ok(())) => Reply::Checkpoint(tx, Err(e.clone())),
            r => r,
        })
        .collect()
}

/// Where a group's records go: the shard's log (and its puts into the
/// batch applied once the group is durable), or a proposal to the shard's
/// Raft group.
enum Out<'a> {
    Log {
        log: &'a mut ShardLog,
        batch: &'a mut OwnedWriteBatch,
    },
    Proposal(&'a mut ProposalBuf),
}

/// The writer's side of the state machine for one group: the shard's
/// committed state to check commands against, and the group being built
/// to write them into.
struct Group<'a> {
    committed: Committed<'a>,
    out: Out<'a>,
    pending: &'a mut Vec<PendingEvent>,
    /// Groups in flight before this one (their events are not readable
    /// until applied).
    in_flight: usize,
    shard: ShardId,
}

impl machine::State for Group<'_> {
    fn epoch(&self) -> Epoch {
        self.committed.epoch()
    }

    fn meta(&self, id: ExecutionId) -> Result<Option<ExecutionMeta>, StoreError> {
        self.committed.meta(id)
    }

    fn start_idem(&self, key: &[u8]) -> Result<Option<ExecutionId>, StoreError> {
        self.committed.start_idem(key)
    }

    fn event_idem(&self, key: &[u8]) -> Result<Option<u64>, StoreError> {
        self.committed.event_idem(key)
    }

    /// From the group being built if an earlier command of it wrote the
    /// event, else from the log.
    fn stored_event(&self, id: ExecutionId, seq: u64) -> Result<StoredEvent, StoreError> {
        if let Some(p) = self.pending.iter().find(|p| p.id == id && p.seq == seq) {
            let value = match &self.out {
                Out::Log { log, .. } => log.pending_event(p.loc)?,
                Out::Proposal(proposal) => proposal.pending_event(p.loc)?,
            };
            return codec::decode_event(seq, value);
        }
        match self.committed.stored_event(id, seq) {
            // Written by a group in flight: readable once it is applied.
            // The command asking (a retry of that write) writes nothing.
            Err(e) if self.in_flight > 0 => Err(StoreError::NotExecuted {
                shard: self.shard,
                reason: format!(
                    "event {seq} of execution {id}, which this retry's idempotency keys name, is being committed; retry ({e})"
                ),
            }),
            r => r,
        }
    }
}

impl machine::Sink for Group<'_> {
    /// Kept in a proposal, for every replica to check at apply; a single
    /// log evaluated and applied against one state has nothing to check
    /// again.
    fn precondition(&mut self, p: machine::Precondition<'_>) {
        if let Out::Proposal(proposal) = &mut self.out {
            proposal.precondition(&p);
        }
    }

    fn event(&mut self, id: ExecutionId, seq: u64, recorded_at: u64, value: &[u8]) {
        let partition = id.partition();
        let loc = match &mut self.out {
            Out::Log { log, .. } => log.event(partition, id, seq, value),
            Out::Proposal(proposal) => proposal.event(partition, id, seq, value),
        };
        self.pending.push(PendingEvent {
            partition,
            id,
            seq,
            loc,
            recorded_at,
        });
    }

    /// To the log now, to the keyspaces once the group is durable (or to
    /// the proposal, which the apply puts into the keyspaces).
    fn put(&mut self, keyspace: u8, key: &[u8], value: &[u8]) {
        match &mut self.out {
            Out::Log { log, batch } => {
                log.put(keyspace, key, value);
                if let Some(ks) = self.committed.ks.by_id(keyspace) {
                    batch.insert(ks, key, value);
                }
            }
            Out::Proposal(proposal) => proposal.put(keyspace, key, value),
        }
    }
}

fn now_ms() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_millis() as u64)
        .unwrap_or(0)
}
