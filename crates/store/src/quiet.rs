//! Quiescence of a replicated shard's group: an idle group turns its
//! timers off, on its leader and its followers, so that it costs nothing
//! while nothing is written (`docs/replication.md`, "Many groups on two
//! cores"). Raft's safety never depends on its timers, only its liveness
//! does: a quiet group still replicates, commits and votes; what it stops
//! is its heartbeats and its followers' election timers. What replaces
//! them is one heartbeat a node pair (the node's transport, which names
//! the groups a node leads quietly): a follower that stops hearing its
//! leader's node turns its group's timers back on and the group elects as
//! usual.
//!
//! This module holds one group's part: whether it is quiet, when it was
//! last written, and when this replica last heard that its leader is alive
//! and keeps the group quiet. The node-wide part (the heartbeats, and
//! noticing a silent peer) is the transport's.

/// A group's Raft handle, whatever its state machine (this module sits
/// below `raft_group`, which uses it).
type Raft<SM> = openraft::Raft<GroupConfig, SM>;

use crate::raft_log::GroupConfig;
use openraft::async_runtime::WatchReceiver;
use openraft::storage::RaftStateMachine;
use std::sync::Mutex;
use std::time::{Duration, Instant};

/// One group's quiescence, shared by its writer and the shard.
#[derive(Debug)]
pub(crate) struct Quiet {
    state: Mutex<State>,
}

#[derive(Debug)]
struct State {
    /// The group's timers are off.
    quiet: bool,
    /// The writer last proposed (or the group started).
    last_write: Instant,
    /// A follower's: the leader (node) that last said it keeps the group
    /// quiet at the current term, and when.
    leader_heard: Option<(u64, Instant)>,
    /// When the timers last went off.
    quiet_since: Instant,
    /// The term at which this replica, leading, asked to hand its
    /// leadership over: openraft then refuses its writes and stops its
    /// heartbeats until another leads, so the group must stay awake for
    /// its followers to elect if the handover does not take.
    transfer_term: Option<u64>,
    /// The group stays awake until then: a follower said it starts again
    /// (`crate::fresh`), and the leader, which took it for matched, must
    /// send it heartbeats to learn otherwise.
    awake_until: Option<Instant>,
    /// The group left this replica behind (its node heard, from the
    /// group's leader, a newer committed membership that counts it
    /// neither as a voter nor as a learner): its timers stay off, and
    /// neither silence nor a vote turns them on, so it stops standing for
    /// election in a group that refuses it (each candidacy woke the
    /// group's quiet leader, about once an election timeout, for good).
    /// Entries, a snapshot or a leadership transfer from a leader, this
    /// replica leading, or a later answer that counts it end it.
    left: bool,
}

impl State {
    /// Turns the timers back on if they were off; says whether they were.
    /// Not while the group left this replica behind ([`State::rejoin`]).
    fn wake<SM: RaftStateMachine<GroupConfig>>(&mut self, raft: &Raft<SM>) -> bool {
        let was = self.quiet && !self.left;
        if was {
            self.quiet = false;
            self.leader_heard = None;
            raft.runtime_config().tick(true);
        }
        was
    }

    /// Turns the timers off if they were on ([`State::wake`]'s twin).
    fn hush<SM: RaftStateMachine<GroupConfig>>(&mut self, raft: &Raft<SM>) {
        if !self.quiet {
            self.quiet = true;
            self.quiet_since = Instant::now();
            raft.runtime_config().tick(false);
        }
    }

    /// [`State::wake`], also for a replica the group left behind: what a
    /// member sees happened (a leader's entries, snapshot or transfer, or
    /// this replica leading).
    fn rejoin<SM: RaftStateMachine<GroupConfig>>(&mut self, raft: &Raft<SM>) -> bool {
        self.left = false;
        self.wake(raft)
    }
}

/// What a follower did when its leader's node said it leads quietly.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Followed {
    /// It stays awake (it does not follow that leader at that term).
    Awake,
    /// It is quiet.
    Quiet,
    /// It is quiet, with entries in its log it has not applied.
    QuietBehind,
}

/// What a replica did when asked to go quiet.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum QuietAs {
    /// It leads the group, quietly, at this term: its peers are told.
    Leader { term: u64 },
    /// It follows, quietly.
    Follower,
    /// It stays awake (written lately, a follower behind, no leader...).
    Awake,
}

impl Quiet {
    pub(crate) fn new() -> Quiet {
        Quiet {
            state: Mutex::new(State {
                quiet: false,
                last_write: Instant::now(),
                leader_heard: None,
                quiet_since: Instant::now(),
                transfer_term: None,
                awake_until: None,
                left: false,
            }),
        }
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(|e| e.into_inner())
    }

    pub(crate) fn is_quiet(&self) -> bool {
        self.lock().quiet
    }

    /// The writer is about to propose: the group is awake from now on.
    /// Says whether it was quiet (then its leader has not heard a quorum
    /// lately, and confirms it before it evaluates).
    pub(crate) fn touch<SM: RaftStateMachine<GroupConfig>>(&self, raft: &Raft<SM>) -> bool {
        let mut s = self.lock();
        s.last_write = Instant::now();
        s.rejoin(raft)
    }

    /// Turns the group's timers back on (a follower whose leader's node
    /// went silent, or asked for a vote); not on a replica the group left
    /// behind.
    pub(crate) fn wake<SM: RaftStateMachine<GroupConfig>>(&self, raft: &Raft<SM>) -> bool {
        self.lock().wake(raft)
    }

    /// Turns the group's timers back on for what only a member of the
    /// group sees (a leader's entries or snapshot), also on a replica
    /// that took itself for left behind: it is in the group.
    pub(crate) fn rejoin<SM: RaftStateMachine<GroupConfig>>(&self, raft: &Raft<SM>) -> bool {
        self.lock().rejoin(raft)
    }

    /// Whether the group left this replica behind, as this node last
    /// heard ([`Quiet::leave`]).
    pub(crate) fn has_left(&self) -> bool {
        self.lock().left
    }

    /// This replica's node heard whether the group's newer committed
    /// membership counts it: `left`, it does not. A replica left behind
    /// turns its timers off for good (see `State::left`); one counted
    /// again turns them back on. Not on a leader (it leads the group: what
    /// was heard is from an older term, or about to be corrected; see
    /// also [`Quiet::quiesce_leader`]). Says whether it changed.
    pub(crate) fn leave<SM: RaftStateMachine<GroupConfig>>(
        &self,
        raft: &Raft<SM>,
        left: bool,
    ) -> bool {
        let mut s = self.lock();
        if s.left == left {
            return false;
        }
        if !left {
            s.rejoin(raft);
            return true;
        }
        if raft.metrics().borrow_watched().state == openraft::ServerState::Leader {
            return false;
        }
        s.left = true;
        s.leader_heard = None;
        s.hush(raft);
        true
    }

    /// The leader is handing its leadership over: the group wakes, and
    /// stays awake at this term (see `State::transfer_term`).
    pub(crate) fn transferring<SM: RaftStateMachine<GroupConfig>>(&self, raft: &Raft<SM>) {
        let mut s = self.lock();
        let term = raft.metrics().borrow_watched().current_term;
        s.transfer_term = Some(term);
        s.last_write = Instant::now();
        s.rejoin(raft);
    }

    /// The group wakes and stays awake for at least `for_at_least` (a
    /// longer hold already on stands: two holds at once, a move's and a
    /// shorter one's, do not cut each other short).
    pub(crate) fn hold_awake<SM: RaftStateMachine<GroupConfig>>(
        &self,
        raft: &Raft<SM>,
        for_at_least: Duration,
    ) -> bool {
        let mut s = self.lock();
        let until = Instant::now() + for_at_least;
        s.awake_until = Some(s.awake_until.map_or(until, |t| t.max(until)));
        s.wake(raft)
    }

    /// Ends every hold ([`Self::hold_awake`]): the group may go quiet
    /// again once idle (the last membership step under way is over).
    pub(crate) fn end_holds(&self) {
        self.lock().awake_until = None;
    }

    /// On the leader: goes quiet if nothing was proposed for `idle`, no
    /// handover of its leadership is under way, and every follower it has
    /// heard has every entry (a follower behind keeps the group awake so
    /// that the leader keeps sending to it; a follower that went away
    /// after it had every entry does not: there is nothing to send it).
    pub(crate) fn quiesce_leader<SM: RaftStateMachine<GroupConfig>>(
        &self,
        raft: &Raft<SM>,
        idle: Duration,
    ) -> QuietAs {
        let mut s = self.lock();
        let m = raft.metrics();
        let m = m.borrow_watched();
        if s.left && m.state == openraft::ServerState::Leader {
            // Elected: it is in the group (a change that left it out was
            // cut short, or what was heard came from an older term).
            s.rejoin(raft);
        }
        if m.current_leader != Some(m.id) || m.state != openraft::ServerState::Leader {
            return if s.quiet {
                QuietAs::Follower
            } else {
                QuietAs::Awake
            };
        }
        if s.quiet {
            return QuietAs::Leader {
                term: m.current_term,
            };
        }
        let last = m.last_log_index;
        let caught_up = m.local_committed.map(|l| l.index) == last
            && m.last_applied.map(|l| l.index) == last
            && m.replication
                .as_ref()
                .is_some_and(|r| r.values().all(|matched| matched.map(|l| l.index) == last));
        let handing_over = s.transfer_term == Some(m.current_term);
        let held = s.awake_until.is_some_and(|t| Instant::now() < t);
        if !caught_up || handing_over || held || s.last_write.elapsed() < idle {
            return QuietAs::Awake;
        }
        s.hush(raft);
        QuietAs::Leader {
            term: m.current_term,
        }
    }

    /// On a follower: node `leader` says it leads the group quietly at
    /// `term`. The follower goes quiet too if it knows that leader at that
    /// term (it voted for it, or heard it), and is not a leader itself.
    /// Says whether it did, and whether its log then holds entries it has
    /// not applied: a follower restarted after a crash lost what it
    /// applied since its last checkpoint (that is not durable) and learns
    /// the commit index again only from its leader, which, quiet, sends
    /// nothing; its node asks the leader's node to wake the group
    /// (`RpcReply::Beat::wake`).
    pub(crate) fn follow<SM: RaftStateMachine<GroupConfig>>(
        &self,
        raft: &Raft<SM>,
        leader: u64,
        term: u64,
    ) -> Followed {
        let mut s = self.lock();
        let m = raft.metrics();
        let m = m.borrow_watched();
        let knows = m.current_term == term
            && m.vote.leader_id.term == term
            && (m.current_leader == Some(leader) || m.vote.leader_id.voted_for == leader);
        if s.left || !knows || m.id == leader || m.state == openraft::ServerState::Leader {
            return Followed::Awake;
        }
        s.leader_heard = Some((leader, Instant::now()));
        s.hush(raft);
        if m.last_applied.map(|l| l.index) < m.last_log_index {
            Followed::QuietBehind
        } else {
            Followed::Quiet
        }
    }

    /// On a quiet replica that does not lead: the leader it follows
    /// (`None` if it knows none: a quiet leader that was deposed without
    /// hearing entries), and how long since that leader's node last said
    /// it keeps the group quiet (or since the timers went off).
    pub(crate) fn quiet_leader<SM: RaftStateMachine<GroupConfig>>(
        &self,
        raft: &Raft<SM>,
    ) -> Option<(Option<u64>, Duration)> {
        let s = self.lock();
        if !s.quiet
            || s.left
            || raft.metrics().borrow_watched().state == openraft::ServerState::Leader
        {
            return None;
        }
        Some(match s.leader_heard {
            Some((l, at)) => (Some(l), at.elapsed()),
            None => (None, s.quiet_since.elapsed()),
        })
    }

    /// Why this quiet follower does not answer a (pre-)vote now, if it
    /// does not: its leader's node said within `fresh` that it keeps the
    /// group quiet, so it is alive and no election is needed. Not
    /// answering a vote is always safe; it only keeps a candidate that
    /// cannot hear a live leader from disrupting the group. A quiet leader
    /// answers (it wakes and confirms it leads first,
    /// `raft_group::confirm_before_a_vote`): it hears nothing while quiet,
    /// so it may have been deposed without knowing, and refusing would
    /// keep the group from electing.
    pub(crate) fn refuses_vote(&self, fresh: Duration) -> Option<String> {
        let s = self.lock();
        if !s.quiet {
            return None;
        }
        match s.leader_heard {
            Some((l, at)) if at.elapsed() < fresh => Some(format!(
                "its leader, node {l}, said {} ms ago that it keeps the group quiet",
                at.elapsed().as_millis()
            )),
            _ => None,
        }
    }
}
