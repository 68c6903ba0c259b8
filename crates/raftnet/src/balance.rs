//! Leaders spread over the nodes: each shard has a preferred replica (the
//! first its placement names, so the shards' preferred leaders are spread
//! evenly over the nodes), and a node that leads a shard whose preferred
//! replica is another hands the leadership to it once that replica has
//! (nearly) every entry. At start, whoever wins the first election hands
//! over; after a node comes back and catches up, its shards go back to
//! it. A transfer costs its shard's writes a moment (they are refused as
//! not executed while it runs; if the replica does not take it, until the
//! followers elect once the leader's lease ran out), so it goes only to a
//! replica that answered within [`HEARD_WITHIN_BEATS`] heartbeats, lacks
//! at most [`TRANSFER_LAG_MAX`] entries and did not say it cannot lead
//! the shard (its node's answer to the node heartbeat: a new replica not
//! caught up refuses a handover), and one that did not take
//! is tried again only after [`TRANSFER_BACKOFF`], doubling with each
//! failure in a row up to [`TRANSFER_BACKOFF_MAX`].
//!
//! A shard moved off a node (`forkless cluster remove-node`) prefers the
//! replica that took that node's place ([`preferred_replica`]): a node
//! that replaces another takes over the shards it was preferred for. A
//! shard is not handed to its preferred replica while a move of one of
//! its replicas waits on this leader for its learner
//! (`ShardStore::replacing`): the handover would end the move.
//!
//! A leader that no quorum has answered for a while (it still sends, and
//! hears nothing) hands its leadership away the same way
//! ([`steps_down_to`]), whichever replica is preferred.
//!
//! A shard this node leads in a joint configuration that a dead leader
//! left (a move's change of voters cut short between its two steps) has
//! its change finished ([`finish_if_cut_short`]), and one with learners
//! that moves cut short left behind (no move under way here catching them
//! up) has them removed after a while ([`remove_if_left`]).
//!
//! A node drained by an operator hands every shard it still leads to
//! any replica that can take it ([`hand_off_to`]), its own preferred
//! shards too, once its drain's own handovers are done ([`run`]).

use forkless_types::ShardId;
use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};
use tokio::sync::watch;

/// How often a node looks at the shards it leads.
pub const BALANCE_EVERY: Duration = Duration::from_secs(1);
/// A node's drain as its balancer sees it ([`run`]).
#[derive(Clone, Default)]
pub struct DrainState {
    /// The node is drained or stopping (`forkless_store::Replication::draining`).
    pub on: Arc<AtomicBool>,
    /// How many drains have started ([`drain`] runs, an operator's or a
    /// stop's): the balancer waits out the latest one's handovers.
    pub runs: Arc<AtomicU64>,
    /// Makes the node heartbeat beat at once
    /// (`forkless_store::Replication::beat_now`): the balancer of a
    /// drained node beats before it hands a shard over.
    pub beat_now: Arc<tokio::sync::Notify>,
}

/// What the balancer ([`run`]) goes by.
#[derive(Debug, Clone, Copy)]
pub struct Settings {
    /// The groups' timers (the windows within which a replica counts as
    /// heard lately).
    pub timing: forkless_store::RaftTiming,
    /// How long a learner that moves cut short left behind is kept before
    /// the shard's leader removes it (`[raft] learner_kept_s`,
    /// [`remove_if_left`]).
    pub learners_kept: Duration,
}

/// How long a node waits before it tries again to hand over a shard its
/// preferred replica did not take.
pub const TRANSFER_BACKOFF: Duration = Duration::from_secs(10);
/// The longest wait after handovers of a shard that kept failing (the
/// wait doubles with each).
pub const TRANSFER_BACKOFF_MAX: Duration = Duration::from_secs(160);
/// How long a handover has to take before it counts as failed.
const TAKES_WITHIN: Duration = Duration::from_secs(2);

/// A shard's last handover from this node.
#[derive(Debug, Clone, Copy)]
struct Try {
    at: Instant,
    /// Handovers in a row that did not take, this one included until it
    /// takes.
    failures: u32,
}

impl Try {
    fn wait(&self) -> Duration {
        TRANSFER_BACKOFF
            .saturating_mul(1 << self.failures.saturating_sub(1).min(4))
            .min(TRANSFER_BACKOFF_MAX)
    }
}
/// How many entries the preferred replica may lack and still be handed
/// the leadership (under load a follower is always a few behind; it
/// catches up before it stands).
pub const TRANSFER_LAG_MAX: u64 = 16;
/// How lately the preferred replica must have answered the leader, in
/// heartbeat intervals (a transfer to a replica that died meanwhile costs
/// the shard an election's time of refused writes).
pub const HEARD_WITHIN_BEATS: u32 = 3;

/// What this node knows of its link to another replica of a shard.
#[derive(Debug, Clone, Copy)]
pub struct Link {
    /// It answered this node's heartbeat within the window.
    pub node_heard_lately: bool,
    /// This node's connection to it broke, or could not be made, since.
    pub down: bool,
    /// Its last answer to this node's heartbeat, within the window, said
    /// it could not take the shard's leadership: it holds no replica of
    /// it, or a new one (its data directory was) that has not caught up,
    /// which refuses a handover (`forkless_store` `fresh`). The leader's
    /// view of it may be level then: from before its disk was lost.
    pub cannot_lead: bool,
    /// The node heartbeat runs (`PeersHeard::beating`): then only a
    /// replica whose node answered it within the window (and did not say
    /// it cannot lead) is handed a shard. Its group's answers alone do
    /// not do: a new replica's first answers to a leader it told come
    /// before its node's first answer to a beat, while the leader still
    /// takes it for level (a test saw a handover 17 ms after the word).
    pub beats: bool,
}

/// Whether the shard's leadership, as its leader's status `s` shows it,
/// can go to its preferred replica `want`: it answered lately, its group
/// or this node's heartbeat (a replica that is down keeps its last
/// matched index in the leader's view; a quiet group's followers answer
/// nothing of their group's), this node's connection to it is not known
/// to be down since (a node killed within the window resets it at once:
/// a handover to it would leave the shard leaderless until the
/// followers' election), it did not say it cannot lead the shard (a new
/// replica not caught up refuses, at the same cost), and it is nearly
/// level.
fn takes_over(
    s: &forkless_store::RaftStatus,
    want: u64,
    heard_within: Duration,
    link: Link,
) -> bool {
    level(s, want) && reachable(s, want, heard_within, link)
}

/// The last entry of the leader's log that replica `v` matched, as the
/// leader's status `s` shows it.
fn matched(s: &forkless_store::RaftStatus, v: u64) -> Option<u64> {
    s.matched
        .iter()
        .find(|(id, _)| *id == v)
        .and_then(|(_, m)| *m)
}

/// Whether replica `v` lacks at most [`TRANSFER_LAG_MAX`] of the leader's
/// entries.
fn level(s: &forkless_store::RaftStatus, v: u64) -> bool {
    let last = s.last_log_index.unwrap_or(0);
    matched(s, v).is_some_and(|m| last.saturating_sub(m) <= TRANSFER_LAG_MAX)
}

/// Whether replica `v` may be handed the shard's leadership, level or
/// not: its group or its node answered within `heard_within`, this node's
/// connection to it is not known to be down, and, when the node
/// heartbeat runs, its node answered it within the window without saying
/// it cannot lead the shard.
fn reachable(s: &forkless_store::RaftStatus, v: u64, heard_within: Duration, link: Link) -> bool {
    let heard = s.heard_ms_ago.iter().any(|(id, ago)| {
        *id == v && ago.is_some_and(|ms| u128::from(ms) <= heard_within.as_millis())
    }) || link.node_heard_lately;
    let can_lead = if link.beats {
        link.node_heard_lately && !link.cannot_lead
    } else {
        true
    };
    heard && !link.down && can_lead
}

/// The replica a shard's leadership goes to, given the replicas its
/// placement names (`placed`, the first preferred) and its group's
/// voters now: the first placed replica while it is a voter (or before
/// the voters are known). Once a move took it out, a voter the placement
/// does not name took its place: that one, so that a node's replacement
/// leads the shards it led and leaders stay spread; with several such
/// (more than one move), the one at the shard's id modulo their count,
/// in id order. With none (the group shrank), the first placed replica
/// still a voter, else the lowest voter.
pub fn preferred_replica(shard: ShardId, placed: &[u64], voters: &[u64]) -> u64 {
    let first = placed.first().copied().unwrap_or(0);
    if voters.is_empty() || voters.contains(&first) {
        return first;
    }
    let mut newcomers: Vec<u64> = voters
        .iter()
        .copied()
        .filter(|v| !placed.contains(v))
        .collect();
    newcomers.sort_unstable();
    if !newcomers.is_empty() {
        return newcomers[shard.get() as usize % newcomers.len()];
    }
    placed
        .iter()
        .copied()
        .find(|p| voters.contains(p))
        .or_else(|| voters.iter().copied().min())
        .unwrap_or(first)
}

/// How long a leader may go without an answer from a quorum of its
/// group's voters, in max election timeouts, before it hands its
/// leadership away ([`steps_down_to`]).
pub const STEP_DOWN_SILENT_TIMEOUTS: u32 = 2;

/// How long, in those silences, a node's word that its replica of a
/// shard cannot lead is heeded by a leader handing its leadership away.
const CANNOT_LEAD_KEPT: u32 = 4;

/// The voter a leader that no quorum has answered for `silent_for` hands
/// its leadership to, if it should. A voter counts as answering if its
/// group (`s.heard_ms_ago`) or its node (`node_heard`: the node
/// heartbeat, which goes on while a group is quiet, so a group just woken
/// from quiet with old answers in its metrics is not taken for cut off)
/// answered within `silent_for`. Such a leader's heartbeats and
/// replication go on reaching its followers, which keeps them from
/// standing (`crates/it/tests/link_faults.rs`: a leader that hears
/// nothing held its shards for as long as the cut lasted; openraft's
/// CheckQuorum, which stops only its heartbeats, still took 6.3 s, and
/// gates a quiet leader's read-index round on waking). Its transfer
/// reaches them as its replication does: every voter then drops its
/// lease, and the one named stands at once if it holds the leader's
/// last entry. Where nothing reaches them (a
/// partition), the transfer is lost and changes nothing; openraft
/// refuses the leader's writes from the transfer on, which a leader no
/// quorum answers could not commit anyway. The voter named is the one
/// that matched the most entries (ties: the lowest id), among those whose
/// node did not say lately that its replica cannot lead (`cannot_lead`: a
/// new replica not caught up refuses a handover to itself) if there is
/// one. A leader that
/// has led its term for less than `silent_for` (`led_for`) is never cut
/// off: it has had no time to hear from anyone (a new leader's followers
/// have no answers in its metrics yet).
pub fn steps_down_to(
    s: &forkless_store::RaftStatus,
    led_for: Duration,
    silent_for: Duration,
    node_heard: impl Fn(u64) -> bool,
    cannot_lead: impl Fn(u64) -> bool,
) -> Option<u64> {
    if s.state != "leader"
        || s.leader != Some(s.me)
        || s.quiet
        || !s.voters.contains(&s.me)
        || led_for < silent_for
    {
        return None;
    }
    let others: Vec<u64> = s.voters.iter().copied().filter(|v| *v != s.me).collect();
    if others.is_empty() {
        return None;
    }
    let quorum = s.voters.len() / 2 + 1;
    let answering = others
        .iter()
        .filter(|v| {
            node_heard(**v)
                || s.heard_ms_ago.iter().any(|(id, ago)| {
                    id == *v && ago.is_some_and(|ms| u128::from(ms) <= silent_for.as_millis())
                })
        })
        .count();
    if answering + 1 >= quorum {
        return None;
    }
    let rank = |v: u64| (!cannot_lead(v), matched(s, v));
    others
        .into_iter()
        .max_by(|a, b| rank(*a).cmp(&rank(*b)).then(b.cmp(a)))
}

/// Hands each of `shards` this node leads to its preferred replica
/// ([`preferred_replica`] of the replicas `placed` names), and hands away the leadership of a shard no quorum has
/// answered for a while ([`steps_down_to`]), until `stop` turns true.
/// While the node is drained (`drain.on`, `forkless cluster drain`) it
/// hands every shard it still leads to another replica that can take it
/// ([`hand_off_to`], nearly level and heard lately: with the node
/// heartbeat on, answering a beat made for the round, [`beat_first`]),
/// its preferred one or not: a shard the drain itself could not hand over
/// (no replica could take it then) goes once one can. It starts
/// [`DRAIN_WITHIN`] after it first sees the node drained or a drain start
/// (that drain's handovers are done by then), and asks the next replica
/// in turn after one that did not take it. Of the shards it leads, it
/// also finishes a change of voters cut short ([`finish_if_cut_short`])
/// and removes the learners moves cut short left behind once they have
/// been so for `settings.learners_kept` ([`remove_if_left`]).
pub async fn run(
    shards: crate::Hosted,
    placed: Arc<dyn Fn(ShardId) -> Vec<u64> + Send + Sync>,
    heard: Arc<crate::quiesce::PeersHeard>,
    peers: Arc<dyn forkless_store::Peers>,
    settings: Settings,
    drain: DrainState,
    mut stop: watch::Receiver<bool>,
) {
    let Settings {
        timing,
        learners_kept,
    } = settings;
    let heard_within = Duration::from_millis(timing.heartbeat_ms) * HEARD_WITHIN_BEATS;
    let silent_for =
        Duration::from_millis(timing.election_timeout_max_ms) * STEP_DOWN_SILENT_TIMEOUTS;
    // Each shard's last handover. One that took is forgotten (its watcher
    // sees the preferred replica lead within TAKES_WITHIN); one that did
    // not makes the next wait, longer after each failure in a row, so a
    // replica that cannot take the leadership (it lags under load, say)
    // does not cost its shard an election's time of refused writes every
    // few seconds.
    let tried: Arc<Mutex<HashMap<u32, Try>>> = Arc::default();
    // Each shard this node leads: the term, and when this loop first saw
    // it lead in that term.
    let mut leading: HashMap<u32, (u64, Instant)> = HashMap::new();
    // When this loop first saw the node drained, or saw a drain start
    // since (a drain asked again of a drained node). For DRAIN_WITHIN
    // from then that drain's own handovers may be under way: this loop
    // hands over nothing but a cut-off leader's shards (a second handover
    // of the same shard, to another replica, would have two replicas
    // stand in one term).
    let mut drained_since: Option<Instant> = None;
    let mut drains_seen = drain.runs.load(Ordering::Acquire);
    // Each shard this node leads in a joint configuration: the
    // membership's log id, and when this loop first saw it so.
    let mut joint_since: HashMap<u32, ((u64, u64), Instant)> = HashMap::new();
    // Each shard this node leads with learners that no replacement under
    // way here is catching up: the membership's log id, and when this loop
    // first saw it so.
    let mut learners_since: HashMap<u32, ((u64, u64), Instant)> = HashMap::new();
    let chores = Chores::default();

    let mut ticks = tokio::time::interval(BALANCE_EVERY);
    ticks.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        tokio::select! {
            _ = ticks.tick() => {}
            _ = stop.wait_for(|s| *s) => return,
        }
        let (on, drains) = (
            drain.on.load(Ordering::Acquire),
            drain.runs.load(Ordering::Acquire),
        );
        let started_since = drains != drains_seen;
        drains_seen = drains;
        // What failed before a drain (or while drained) does not hold back
        // the handovers after it (or after the undrain).
        if on && (drained_since.is_none() || started_since) {
            drained_since = Some(Instant::now());
            tried.lock().unwrap_or_else(|e| e.into_inner()).clear();
        } else if !on && drained_since.is_some() {
            drained_since = None;
            tried.lock().unwrap_or_else(|e| e.into_inner()).clear();
        }
        let drain_settled = drained_since.is_some_and(|t| t.elapsed() >= DRAIN_WITHIN);
        let hosted = shards();
        // Drained, with the beats on: a beat first, and the handovers
        // only to peers whose answer to it says they can lead (as in
        // `drain`). A peer's last answer may predate its own drain by up
        // to the beats' window, and a drained peer handed a shard refuses
        // it, which costs the shard an election's time of refused writes.
        let asked = if drain_settled && heard.beating() {
            // For the shards a round may hand over now: not those waiting
            // out a failed handover's backoff.
            let due: Vec<_> = {
                let t = tried.lock().unwrap_or_else(|e| e.into_inner());
                hosted
                    .iter()
                    .filter(|st| {
                        t.get(&st.id().get())
                            .is_none_or(|last| last.at.elapsed() >= last.wait())
                    })
                    .cloned()
                    .collect()
            };
            let asked = tokio::select! {
                asked = beat_first(
                    &due,
                    &heard,
                    &drain.beat_now,
                    peers.as_ref(),
                    heard_within,
                    heard_within.min(DRAIN_WITHIN / 4),
                ) => asked,
                _ = stop.wait_for(|s| *s) => return,
            };
            // A drain started, or the node undrained, during the wait:
            // no handover this round (a drain's own go first, and an
            // undrained node keeps its preferred shards).
            if drain.on.load(Ordering::Acquire) != on
                || drain.runs.load(Ordering::Acquire) != drains
            {
                continue;
            }
            Some(asked)
        } else {
            None
        };
        // What a drained node's handover may go by: an answer to the beat
        // just made, or (the beats off) any answer heard lately.
        let answered = |v: u64| match asked {
            Some(asked) => heard.answered_since(v, asked),
            None => heard.within(v, heard_within),
        };
        for st in &hosted {
            let Some(s) = st.raft_status() else { continue };
            let shard = st.id().get();
            finish_if_cut_short(st, &s, &mut joint_since, &chores);
            remove_if_left(st, &s, &mut learners_since, &chores, learners_kept);
            let led_for = if s.state == "leader" && s.leader == Some(s.me) {
                let since = leading.entry(shard).or_insert((s.term, Instant::now()));
                if since.0 != s.term {
                    *since = (s.term, Instant::now());
                }
                since.1.elapsed()
            } else {
                leading.remove(&shard);
                Duration::ZERO
            };
            let cut_off = steps_down_to(
                &s,
                led_for,
                silent_for,
                |v| heard.within(v, silent_for),
                // What a node said of its replicas a while ago still
                // counts: a leader cut off has heard nothing lately.
                |v| heard.cannot_lead(v, shard, silent_for * CANNOT_LEAD_KEPT),
            );
            let leads = s.state == "leader" && s.leader == Some(s.me);
            let preferred = preferred_replica(st.id(), &placed(st.id()), &s.voters);
            if leads && cut_off.is_none() && drained_since.is_some() && !drain_settled {
                continue;
            }
            // Drained: any replica that can take it, the preferred first
            // (this node, preferred or not, keeps it only if none can),
            // another after each that did not take it.
            let drained_now = leads && cut_off.is_none() && drain_settled;
            // (`drain_settled` implies the flag was on at this tick.)
            let want = match cut_off {
                Some(to) => to,
                None if drained_now => {
                    let turn = tried
                        .lock()
                        .unwrap_or_else(|e| e.into_inner())
                        .get(&shard)
                        .map_or(0, |t| t.failures);
                    hand_off_to(&s, shard, preferred, turn, heard_within, |v| Link {
                        node_heard_lately: answered(v),
                        down: peers.link_down(v),
                        cannot_lead: heard.cannot_lead(v, shard, heard_within),
                        beats: heard.beating(),
                    })
                    .unwrap_or(s.me)
                }
                None => preferred,
            };
            if !leads || want == s.me {
                continue;
            }
            // A move of one of the shard's replicas under way here waits
            // for its learner on this leader (up to minutes, for a large
            // shard's snapshot): the preferred replica takes the shard
            // once it is over. (A cut-off or drained leader hands it
            // over regardless: the move would end anyway.)
            if cut_off.is_none() && !drained_now && st.replacing() {
                continue;
            }
            // Only an answer to a beat made since this node led the shard
            // says whether `want` can lead it (a beat's answer speaks of
            // the shards the beat said its sender leads): a node shutting
            // down, just handed the shard by `drain`, said nothing of it
            // before, and would refuse it back.
            let answered_since_led = leading
                .get(&shard)
                .is_none_or(|(_, since)| heard.answered_since(want, *since));
            let up = Link {
                node_heard_lately: if drained_now {
                    answered(want)
                } else {
                    heard.within(want, heard_within)
                } && answered_since_led,
                down: peers.link_down(want),
                cannot_lead: heard.cannot_lead(want, shard, heard_within),
                beats: heard.beating(),
            };
            if cut_off.is_none() && !takes_over(&s, want, heard_within, up) {
                continue;
            }
            let failures = {
                let mut t = tried.lock().unwrap_or_else(|e| e.into_inner());
                match t.get(&shard) {
                    Some(last) if last.at.elapsed() < last.wait() => continue,
                    last => {
                        let failures = last.map_or(1, |l| l.failures + 1);
                        t.insert(
                            shard,
                            Try {
                                at: Instant::now(),
                                failures,
                            },
                        );
                        failures
                    }
                }
            };
            if cut_off.is_some() {
                tracing::warn!(
                    shard,
                    term = s.term,
                    to = want,
                    silent_ms = silent_for.as_millis() as u64,
                    failed_before = failures - 1,
                    "no quorum of the shard's replicas has answered this leader: handing its leadership away"
                );
            } else if drained_now {
                tracing::info!(
                    shard,
                    term = s.term,
                    to = want,
                    failed_before = failures - 1,
                    "this node is drained: handing the shard's leadership to another replica"
                );
            } else {
                tracing::info!(
                    shard,
                    term = s.term,
                    to = want,
                    failed_before = failures - 1,
                    "handing the shard's leadership to its preferred replica"
                );
            }
            if let Err(e) = st.transfer_leader(want).await {
                tracing::warn!(shard, to = want, error = %e, "handing over the shard's leadership failed");
                continue;
            }
            let (st, tried) = (st.clone(), tried.clone());
            tokio::spawn(async move {
                let until = Instant::now() + TAKES_WITHIN;
                while Instant::now() < until {
                    if st.raft_status().is_some_and(|s| s.leader == Some(want)) {
                        tried
                            .lock()
                            .unwrap_or_else(|e| e.into_inner())
                            .remove(&shard);
                        return;
                    }
                    tokio::time::sleep(Duration::from_millis(20)).await;
                }
            });
        }
    }
}

/// How long a shard this node leads may stay in a committed joint
/// configuration (a change of its voters under way) before the balancer
/// takes the change for cut short and finishes it ([`run`]). A move's own
/// two steps follow each other within a round trip; a change is left
/// joint only when its leader died or lost its leadership between them.
pub const JOINT_FINISHED_AFTER: Duration = Duration::from_secs(2);

/// Finishes shard `st`'s change of voters that a leader cut short
/// ([`forkless_store::ShardStore::finish_change_of_voters`]), once this
/// node has led the shard in the same committed joint configuration for
/// [`JOINT_FINISHED_AFTER`]: a group left joint needs a quorum of both
/// its old and its new voters for every write, the old still counting the
/// replica the change was taking out (a dead node, as often as not), until
/// the next move of the shard finishes it. A [`Chores`] task.
fn finish_if_cut_short(
    st: &Arc<forkless_store::ShardStore>,
    s: &forkless_store::RaftStatus,
    joint_since: &mut HashMap<u32, ((u64, u64), Instant)>,
    chores: &Chores,
) {
    let shard = st.id().get();
    let (true, Some(log)) = (
        leads_as_voter(s) && s.joint && s.membership_committed,
        s.membership_log,
    ) else {
        joint_since.remove(&shard);
        return;
    };
    if !seen_for(joint_since, shard, log, JOINT_FINISHED_AFTER) {
        return;
    }
    let (st2, term, voters) = (st.clone(), s.term, s.voters.clone());
    chores.start(
        shard,
        "finishing a change of voters cut short",
        move || {
            tracing::warn!(
                shard,
                term,
                voters = ?voters,
                "the shard's group was left in the middle of a change of its voters (its last leader died or lost its leadership between the change's two steps): finishing the change"
            );
        },
        async move { st2.finish_change_of_voters(CHORE_WITHIN).await },
        move |done| {
            if let Some(done) = done {
                tracing::info!(shard, voters = ?done.voters, joined = ?done.joined, "finished a change of voters its leader had cut short");
            }
        },
    );
}

/// Removes shard `st`'s learners that moves cut short left behind
/// ([`forkless_store::ShardStore::remove_left_learners`]), once this node
/// has led the shard with them, in the same committed membership and with
/// no replacement of a replica under way here, for `kept`
/// (`[raft] learner_kept_s`). A move's own learner is its replacement's
/// while it runs; one found without any was left by a move whose leader
/// died or lost its leadership, whose call ended, or whose learner did not
/// catch up in time. A move asked again within `kept` takes its learner up
/// where it stopped; later, it adds it again. A [`Chores`] task.
fn remove_if_left(
    st: &Arc<forkless_store::ShardStore>,
    s: &forkless_store::RaftStatus,
    learners_since: &mut HashMap<u32, ((u64, u64), Instant)>,
    chores: &Chores,
    kept: Duration,
) {
    let shard = st.id().get();
    let left = leads_as_voter(s)
        && !s.learners.is_empty()
        && !s.joint
        && s.membership_committed
        && !st.replacing();
    let (true, Some(log)) = (left, s.membership_log) else {
        learners_since.remove(&shard);
        return;
    };
    if !seen_for(learners_since, shard, log, kept) {
        return;
    }
    let st2 = st.clone();
    // (Logged as it is done: the store checks again, under the group's
    // lock, that no move has begun meanwhile.)
    chores.start(
        shard,
        "removing learners that moves cut short left",
        || {},
        async move { st2.remove_left_learners(log, CHORE_WITHIN).await },
        move |removed| {
            if !removed.is_empty() {
                tracing::info!(
                    shard,
                    learners = ?removed,
                    kept_s = kept.as_secs(),
                    "removed learners that moves cut short left behind: no move under way had caught them up for kept_s"
                );
            }
        },
    );
}

/// Whether the replica whose status `s` is leads its group as one of its
/// voters (the one that takes a membership step).
fn leads_as_voter(s: &forkless_store::RaftStatus) -> bool {
    s.state == "leader" && s.leader == Some(s.me) && s.voters.contains(&s.me)
}

/// Whether shard `shard` has been seen in the membership whose entry is
/// `log` (term, index) for `wait` since `since` first saw it so (it
/// notes the membership when it is new).
fn seen_for(
    since: &mut HashMap<u32, ((u64, u64), Instant)>,
    shard: u32,
    log: (u64, u64),
    wait: Duration,
) -> bool {
    let at = since.entry(shard).or_insert((log, Instant::now()));
    if at.0 != log {
        *at = (log, Instant::now());
    }
    at.1.elapsed() >= wait
}

/// The membership chores the balancer runs for the shards it leads
/// ([`finish_if_cut_short`], [`remove_if_left`]): each in a task of its
/// own, bounded by [`CHORE_WITHIN`], one at a time a shard, and one that
/// failed or timed out is followed by the shard's next only
/// [`TRANSFER_BACKOFF`] after it ended.
#[derive(Clone, Default)]
struct Chores {
    /// Each shard whose chore is running (when it started), or whose last
    /// one failed (when it ended).
    busy: Arc<Mutex<HashMap<u32, Instant>>>,
}

impl Chores {
    /// Starts `chore` for `shard` unless the shard's last is running or
    /// failed lately; `starting` runs first when it does, `done` with
    /// what a chore that succeeded came to.
    fn start<T: Send + 'static>(
        &self,
        shard: u32,
        what: &'static str,
        starting: impl FnOnce(),
        chore: impl std::future::Future<Output = Result<T, forkless_store::StoreError>> + Send + 'static,
        done: impl FnOnce(T) + Send + 'static,
    ) {
        {
            let mut busy = self.busy.lock().unwrap_or_else(|e| e.into_inner());
            if busy
                .get(&shard)
                .is_some_and(|at| at.elapsed() < TRANSFER_BACKOFF)
            {
                return;
            }
            busy.insert(shard, Instant::now());
        }
        starting();
        let busy = self.busy.clone();
        tokio::spawn(async move {
            let outcome = tokio::time::timeout(CHORE_WITHIN, chore).await;
            let mut busy = busy.lock().unwrap_or_else(|e| e.into_inner());
            match outcome {
                Ok(Ok(v)) => {
                    busy.remove(&shard);
                    drop(busy);
                    done(v);
                }
                // (This node no longer leads: the next leader's balancer
                // takes it up.)
                Ok(Err(e @ forkless_store::StoreError::NotLeader { .. })) => {
                    busy.insert(shard, Instant::now());
                    tracing::debug!(shard, error = %e, "{what}: this node no longer leads the shard");
                }
                Ok(Err(e)) => {
                    busy.insert(shard, Instant::now());
                    tracing::warn!(shard, error = %e, "{what} failed; tried again later");
                }
                Err(_) => {
                    busy.insert(shard, Instant::now());
                    tracing::warn!(
                        shard,
                        within_s = CHORE_WITHIN.as_secs(),
                        "{what} did not end in time; tried again later"
                    );
                }
            }
        });
    }
}

/// How long one of the balancer's membership chores may take
/// ([`Chores`]): a quorum's confirmation and one membership entry
/// committed. Shorter than [`TRANSFER_BACKOFF`], the wait before the next
/// try, so that two never overlap.
const CHORE_WITHIN: Duration = Duration::from_secs(5);

/// How long a node shutting down waits for the shards it led to be led
/// by another replica before it stops anyway ([`drain`]). A handover
/// takes a round trip and the new leader's election round when it goes
/// well; the bound is for one that does not (a replica that died just
/// then: its shard then elects once the others' timers run out, as
/// after a crash).
pub const DRAIN_WITHIN: Duration = TAKES_WITHIN;

/// The voter a leader that is shutting down hands shard `shard`'s
/// leadership to ([`drain`]): one whose link is up and that answered
/// lately (when the node heartbeat runs, its node's answer, which must not
/// say that it cannot lead the shard; without it, its group's answers or
/// its node's). Of those, the ones
/// nearly level ([`TRANSFER_LAG_MAX`]): the shard's `preferred` replica
/// ([`preferred_replica`]) if it is one (its balancer would move the
/// shard there anyway), else they take turns by shard id, so that a node
/// leading many shards spreads them over the others; with none level, the
/// one that matched the most (ties: the lowest id). `None` when no replica
/// can take it: the shard elects once the node is gone, as after a crash.
/// `turn` counts the handovers of the shard that did not take, in a row
/// (a drained node's balancer tries again): the choice moves on from the
/// first by that many among the nearly level, so a replica that keeps
/// not taking the shard is not the only one asked.
pub fn hand_off_to(
    s: &forkless_store::RaftStatus,
    shard: u32,
    preferred: u64,
    turn: u32,
    heard_within: Duration,
    link: impl Fn(u64) -> Link,
) -> Option<u64> {
    let mut able: Vec<u64> = s
        .voters
        .iter()
        .copied()
        .filter(|v| *v != s.me && reachable(s, *v, heard_within, link(*v)))
        .collect();
    able.sort_unstable();
    let nearly_level: Vec<u64> = able.iter().copied().filter(|v| level(s, *v)).collect();
    if !nearly_level.is_empty() {
        // The first choice: the preferred replica, else by shard id; each
        // turn after it the next one.
        let first = nearly_level
            .iter()
            .position(|v| *v == preferred)
            .unwrap_or(shard as usize % nearly_level.len());
        let at = first.wrapping_add(turn as usize) % nearly_level.len();
        return Some(nearly_level[at]);
    }
    able.into_iter()
        .max_by(|a, b| matched(s, *a).cmp(&matched(s, *b)).then(b.cmp(a)))
}

/// Why [`drain`] runs: what its log lines say.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Why {
    /// The node is shutting down.
    Stop,
    /// An operator drained it (`forkless cluster drain`); it runs on.
    Drain,
}

impl Why {
    /// What starts each of its log lines.
    pub fn label(self) -> &'static str {
        match self {
            Why::Stop => "shutting down",
            Why::Drain => "drained",
        }
    }

    /// What becomes of a shard no other replica took.
    fn stays(self) -> &'static str {
        match self {
            Why::Stop => "it elects a leader once this node is gone",
            Why::Drain => {
                "it stays led here until another replica can take it (the node's balancer hands it over then)"
            }
        }
    }
}

/// What [`drain`] did with the shards this node led.
#[derive(Debug, Default, Clone, Copy, PartialEq, Eq)]
pub struct Drained {
    /// Shards another replica leads now.
    pub handed: usize,
    /// Shards handed over that no other replica took within the bound
    /// (or whose handover could not be asked).
    pub not_taken: usize,
    /// Shards with no replica to hand them to (the others down, not
    /// heard lately, or saying they cannot lead it).
    pub no_replica: usize,
}

/// Makes the node heartbeat beat now (`beat_now`) and waits for the
/// answers of the other voters of every shard of `shards` this node
/// leads (those whose link is up and that answered within `lately`), at
/// most `wait`; returns when the beat was asked for. An answer to it
/// speaks of every shard this node leads now ([`crate::quiesce::PeersHeard::answers_since`]):
/// only such an answer tells whether a peer drained or stopping a moment
/// ago can lead a shard.
async fn beat_first(
    shards: &[Arc<forkless_store::ShardStore>],
    heard: &crate::quiesce::PeersHeard,
    beat_now: &tokio::sync::Notify,
    peers: &dyn forkless_store::Peers,
    lately: Duration,
    wait: Duration,
) -> Instant {
    let asked = Instant::now();
    let mut others: Vec<u64> = shards
        .iter()
        .filter_map(|st| st.raft_status())
        .filter(|s| s.state == "leader" && s.leader == Some(s.me))
        .flat_map(|s| s.voters.into_iter().filter(move |v| *v != s.me))
        .collect();
    others.retain(|p| !peers.link_down(*p));
    others.sort_unstable();
    others.dedup();
    if others.is_empty() {
        return asked;
    }
    beat_now.notify_one();
    heard.answers_since(&others, asked, lately, wait).await;
    asked
}

/// On a node shutting down, once its replicas take no leadership
/// ([`forkless_store::Replication::draining`]): hands the leadership of
/// every shard of `shards` this node leads to another replica
/// ([`hand_off_to`]), all at once, and waits at most `within` for each
/// to be led at a later term and for its log as it stood just after the
/// handover was asked to be applied here (the writes this node proposed
/// while it led are answered as their entries are). A shard
/// handed over stops taking writes
/// here (they are refused as not executed, and routed again to the new
/// leader) for the moment the handover takes, instead of for the
/// election its followers would hold once this node is gone.
#[allow(clippy::too_many_arguments)]
pub async fn drain(
    why: Why,
    shards: Vec<Arc<forkless_store::ShardStore>>,
    placed: &(dyn Fn(ShardId) -> Vec<u64> + Send + Sync),
    heard: Arc<crate::quiesce::PeersHeard>,
    beat_now: &tokio::sync::Notify,
    peers: &dyn forkless_store::Peers,
    timing: forkless_store::RaftTiming,
    within: Duration,
) -> Drained {
    let (stays, why) = (why.stays(), why.label());
    let started = tokio::time::Instant::now();
    let until = started + within;
    let beat = Duration::from_millis(timing.heartbeat_ms.max(1));
    let heard_within = beat * HEARD_WITHIN_BEATS;
    // A beat now, and its answers waited for (a round trip when the peers
    // are up; at most `heard_within` and a quarter of `within`): a peer's word that it cannot lead
    // a shard (it is drained or stopping too) comes only in answer to a
    // beat naming the shard, and this node may have come to lead some
    // a moment ago (another node's drain handed them here). Handed one
    // of those on older word, a drained peer refuses it, which costs the
    // shard an election's time of refused writes, or, with no replica
    // left to stand, its writes until one is undrained.
    let beating = heard.beating();
    let asked = if beating {
        // A quarter of the handover's bound at most (heartbeats may be
        // configured long): the rest is the handovers'.
        beat_first(
            &shards,
            &heard,
            beat_now,
            peers,
            heard_within,
            heard_within.min(within / 4),
        )
        .await
    } else {
        std::time::Instant::now()
    };
    let mut done = Drained::default();
    let mut handing = tokio::task::JoinSet::new();
    for st in shards {
        let Some(s) = st.raft_status() else { continue };
        if s.state != "leader" || s.leader != Some(s.me) {
            continue;
        }
        let shard = st.id().get();
        if s.voters.iter().all(|v| *v == s.me) {
            // A group of one: no other replica, nothing to hand over.
            continue;
        }
        let preferred = preferred_replica(st.id(), &placed(st.id()), &s.voters);
        let to = hand_off_to(&s, shard, preferred, 0, heard_within, |v| Link {
            // With the beats on, only an answer to the beat just made.
            node_heard_lately: if beating {
                heard.answered_since(v, asked)
            } else {
                heard.within(v, heard_within)
            },
            down: peers.link_down(v),
            cannot_lead: heard.cannot_lead(v, shard, heard_within),
            beats: heard.beating(),
        });
        let Some(to) = to else {
            tracing::warn!(
                shard,
                term = s.term,
                "{why}: no other replica of the shard answered lately; {stays}"
            );
            done.no_replica += 1;
            continue;
        };
        tracing::info!(
            shard,
            term = s.term,
            to,
            "{why}: handing the shard's leadership over"
        );
        let heard = heard.clone();
        handing.spawn(async move {
            if let Err(e) = st.transfer_leader(to).await {
                tracing::warn!(shard, to, error = %e, "{why}: handing the shard's leadership over failed");
                return false;
            }
            let left = until.saturating_duration_since(tokio::time::Instant::now());
            // A replica whose node says, since the handover began, that
            // it cannot lead the shard (it is shutting down too: a whole
            // cluster stopped at once) refused it: not waited for.
            let refused = async {
                loop {
                    tokio::time::sleep(beat).await;
                    if heard.cannot_lead(to, shard, started.elapsed()) {
                        return;
                    }
                }
            };
            // What it proposed up to the handover (openraft refuses its
            // writes from the handover on).
            let last = st.raft_status().and_then(|now| now.last_log_index);
            let led = tokio::select! {
                l = st.leader_after(s.term, left) => l,
                () = refused => {
                    tracing::info!(shard, to, "{why}: the replica handed the shard's leadership refused it (its node is drained or shutting down too)");
                    return false;
                }
            };
            match led {
                // (On a timeout `leader_after` says where the group stands:
                // a later term with no leader yet is not a handover.)
                Some(l) if l.term > s.term && l.leader.is_some_and(|x| x != s.me) => {
                    tracing::info!(shard, term = l.term, leader = ?l.leader, "{why}: the shard is led by another replica");
                    // The writes this node proposed while it led wait for
                    // their entries, which the new leader commits: once
                    // they are applied here, they are answered.
                    let left = until.saturating_duration_since(tokio::time::Instant::now());
                    if !st.applied_through(last, left).await {
                        tracing::warn!(
                            shard,
                            last_log_index = ?last,
                            "{why}: the entries this node proposed as the shard's leader were not applied here in time; their writes are answered when they are, or as unknown"
                        );
                    }
                    true
                }
                _ => {
                    tracing::warn!(
                        shard,
                        to,
                        within_ms = within.as_millis() as u64,
                        "{why}: no other replica took the shard's leadership in time; {stays}"
                    );
                    false
                }
            }
        });
    }
    while let Some(r) = handing.join_next().await {
        match r {
            Ok(true) => done.handed += 1,
            _ => done.not_taken += 1,
        }
    }
    done
}

#[cfg(test)]
mod tests {
    use super::*;

    fn leader_of(
        last: u64,
        want: u64,
        matched: u64,
        heard_ms_ago: u64,
    ) -> forkless_store::RaftStatus {
        forkless_store::RaftStatus {
            me: 3,
            leader: Some(3),
            term: 4,
            state: "leader",
            last_log_index: Some(last),
            committed: Some(last),
            applied: Some(last),
            snapshot: None,
            purged: None,
            voters: vec![want, 2, 3],
            joint: false,
            membership_log: None,
            membership_committed: true,
            learners: vec![],
            matched: vec![(want, Some(matched)), (2, Some(last))],
            heard_ms_ago: vec![(want, Some(heard_ms_ago)), (2, Some(0))],
            quiet: false,
            fresh: false,
            appends_taken: 0,
            appends_taken_behind_others: 0,
            log_held_entries: 0,
            log_memory_bytes: 0,
        }
    }

    #[test]
    fn the_leadership_goes_only_to_a_level_replica_heard_lately_whose_link_is_up() {
        let within = Duration::from_millis(150);
        let up = Link {
            node_heard_lately: false,
            down: false,
            cannot_lead: false,
            beats: false,
        };
        assert!(takes_over(&leader_of(100, 1, 95, 40), 1, within, up));
        // Too far behind.
        assert!(!takes_over(&leader_of(100, 1, 80, 40), 1, within, up));
        // Not heard within the window, by its group or by this node.
        assert!(!takes_over(&leader_of(100, 1, 100, 400), 1, within, up));
        let node_heard = Link {
            node_heard_lately: true,
            down: false,
            cannot_lead: false,
            beats: false,
        };
        assert!(takes_over(
            &leader_of(100, 1, 100, 400),
            1,
            within,
            node_heard
        ));
        // Heard 40 ms ago, but the connection to it broke since (its
        // node was killed): not handed to it.
        let broke = Link {
            node_heard_lately: true,
            down: true,
            cannot_lead: false,
            beats: false,
        };
        assert!(!takes_over(&leader_of(100, 1, 100, 40), 1, within, broke));
        // Level as the leader saw it before its disk was lost, and its
        // node answers: but it said its replica is new and not caught up
        // (or that it holds none), and would refuse.
        let new_replica = Link {
            cannot_lead: true,
            beats: true,
            ..node_heard
        };
        assert!(!takes_over(
            &leader_of(100, 1, 100, 400),
            1,
            within,
            new_replica
        ));
        // With the node heartbeat on, its group's answer alone does not
        // do (a new replica's group answers the leader it told before its
        // node answers a beat): its node must have answered lately, saying
        // it can lead.
        let beats = Link { beats: true, ..up };
        assert!(!takes_over(&leader_of(100, 1, 100, 40), 1, within, beats));
        let beats_heard = Link {
            beats: true,
            ..node_heard
        };
        assert!(takes_over(
            &leader_of(100, 1, 100, 40),
            1,
            within,
            beats_heard
        ));
        assert!(!takes_over(
            &leader_of(100, 1, 100, 40),
            1,
            within,
            Link {
                cannot_lead: true,
                ..beats_heard
            }
        ));
    }

    #[test]
    fn a_leader_no_quorum_answers_hands_its_leadership_to_the_voter_that_matched_most() {
        let silent = Duration::from_millis(800);
        let led = Duration::from_secs(5);
        let nobody = |_| false;
        // (voter 1 heard ms ago, voter 2 heard ms ago) -> handed to.
        let check = |heard1: Option<u64>, heard2: Option<u64>, node: &dyn Fn(u64) -> bool| {
            let mut s = leader_of(100, 1, 90, 0);
            s.matched = vec![(1, Some(90)), (2, Some(95))];
            s.heard_ms_ago = vec![(1, heard1), (2, heard2)];
            steps_down_to(&s, led, silent, node, |_| false)
        };
        // One follower answers: with the leader, a quorum of three.
        assert_eq!(check(Some(100), Some(5000), &nobody), None);
        assert_eq!(check(Some(5000), Some(800), &nobody), None);
        // Neither answers: to voter 2, which matched more.
        assert_eq!(check(Some(900), Some(5000), &nobody), Some(2));
        assert_eq!(check(None, None, &nobody), Some(2));
        // Unless voter 2's node said its replica cannot lead (a new one,
        // not caught up, refuses it): to voter 1. If both said so, still
        // by the entries matched.
        let mut s = leader_of(100, 1, 90, 0);
        s.matched = vec![(1, Some(90)), (2, Some(95))];
        s.heard_ms_ago = vec![(1, None), (2, None)];
        assert_eq!(steps_down_to(&s, led, silent, nobody, |v| v == 2), Some(1));
        assert_eq!(steps_down_to(&s, led, silent, nobody, |_| true), Some(2));
        // A leader new in its term has heard from nobody yet: not cut off
        // until it has led for the silence's length.
        let mut s = leader_of(100, 1, 90, 0);
        s.heard_ms_ago = vec![(1, None), (2, None)];
        assert_eq!(
            steps_down_to(&s, Duration::from_millis(10), silent, nobody, nobody),
            None
        );
        assert_eq!(steps_down_to(&s, silent, silent, nobody, nobody), Some(2));
        // The group's answers are old, its node answers (a group just
        // woken from quiet): not cut off.
        assert_eq!(check(None, None, &|v| v == 1), None);
        // Quiet, a follower, or alone: never.
        let mut s = leader_of(100, 1, 90, 5000);
        s.heard_ms_ago = vec![(1, None), (2, None)];
        assert_eq!(steps_down_to(&s, led, silent, nobody, nobody), Some(2));
        s.quiet = true;
        assert_eq!(steps_down_to(&s, led, silent, nobody, nobody), None);
        s.quiet = false;
        s.state = "follower";
        assert_eq!(steps_down_to(&s, led, silent, nobody, nobody), None);
        s.state = "leader";
        s.voters = vec![3];
        assert_eq!(steps_down_to(&s, led, silent, nobody, nobody), None);
        // Five voters: two answering of four others is a quorum with the
        // leader; one is not. Ties go to the lowest id.
        let mut s = leader_of(100, 1, 100, 0);
        s.voters = vec![1, 2, 3, 4, 5];
        s.matched = vec![
            (1, Some(100)),
            (2, Some(100)),
            (4, Some(100)),
            (5, Some(100)),
        ];
        s.heard_ms_ago = vec![(1, Some(0)), (2, Some(0)), (4, None), (5, None)];
        assert_eq!(steps_down_to(&s, led, silent, nobody, nobody), None);
        s.heard_ms_ago = vec![(1, Some(0)), (2, None), (4, None), (5, None)];
        assert_eq!(steps_down_to(&s, led, silent, nobody, nobody), Some(1));
    }

    #[test]
    fn a_moved_shard_prefers_the_replica_that_took_the_preferred_ones_place() {
        let p = |shard: u32, placed: &[u64], voters: &[u64]| {
            preferred_replica(ShardId(shard), placed, voters)
        };
        // Not moved, or the voters not known: the first placed.
        assert_eq!(p(0, &[1, 2, 3], &[1, 2, 3]), 1);
        assert_eq!(p(0, &[1, 2, 3], &[]), 1);
        // Another replica moved: still the first placed.
        assert_eq!(p(0, &[1, 2, 3], &[1, 3, 5]), 1);
        // The first moved to node 5: node 5, whatever the shard.
        assert_eq!(p(0, &[1, 2, 3], &[2, 3, 5]), 5);
        assert_eq!(p(7, &[1, 2, 3], &[5, 2, 3]), 5);
        // Two moved (to 5 and 6): one of them, by the shard's id.
        assert_eq!(p(0, &[1, 2, 3], &[3, 6, 5]), 5);
        assert_eq!(p(1, &[1, 2, 3], &[3, 6, 5]), 6);
        // The group shrank to placed replicas only: the first still a
        // voter; none placed at all: the lowest voter.
        assert_eq!(p(0, &[1, 2, 3], &[3, 2]), 2);
        assert_eq!(p(0, &[1, 2, 3], &[]), 1);
        assert_eq!(p(0, &[], &[9, 8]), 8);
    }

    #[test]
    fn the_wait_after_failed_handovers_doubles_up_to_its_max() {
        let wait = |failures| {
            Try {
                at: Instant::now(),
                failures,
            }
            .wait()
        };
        assert_eq!(wait(1), TRANSFER_BACKOFF);
        assert_eq!(wait(2), TRANSFER_BACKOFF * 2);
        assert_eq!(wait(3), TRANSFER_BACKOFF * 4);
        assert_eq!(wait(5), TRANSFER_BACKOFF_MAX);
        assert_eq!(wait(40), TRANSFER_BACKOFF_MAX);
    }

    #[test]
    fn a_leader_shutting_down_hands_each_shard_to_a_level_replica_in_turn() {
        let within = Duration::from_millis(150);
        // The leader itself: no preferred replica to pick among the others.
        const NONE: u64 = 3;
        let up = |_| Link {
            node_heard_lately: true,
            down: false,
            cannot_lead: false,
            beats: true,
        };
        // Leader 3; voters 1 and 2 both level: shards take turns.
        let both = leader_of(100, 1, 99, 10);
        assert_eq!(hand_off_to(&both, 0, NONE, 0, within, up), Some(1));
        assert_eq!(hand_off_to(&both, 1, NONE, 0, within, up), Some(2));
        assert_eq!(hand_off_to(&both, 2, NONE, 0, within, up), Some(1));
        // The shard's preferred replica first, when it is level.
        assert_eq!(hand_off_to(&both, 0, 2, 0, within, up), Some(2));
        assert_eq!(hand_off_to(&both, 1, 1, 0, within, up), Some(1));
        // Replica 1 far behind: the level one, whatever the shard.
        let behind = leader_of(100, 1, 10, 10);
        assert_eq!(hand_off_to(&behind, 0, NONE, 0, within, up), Some(2));
        assert_eq!(hand_off_to(&behind, 1, NONE, 0, within, up), Some(2));
        assert_eq!(hand_off_to(&behind, 1, 1, 0, within, up), Some(2));
        // A drained node's balancer asking again after handovers that did
        // not take: the turn moves on from the first choice (the preferred
        // replica, else by shard id).
        assert_eq!(hand_off_to(&both, 0, 2, 1, within, up), Some(1));
        assert_eq!(hand_off_to(&both, 0, 2, 2, within, up), Some(2));
        assert_eq!(hand_off_to(&both, 1, NONE, 1, within, up), Some(1));
        assert_eq!(hand_off_to(&both, 1, NONE, 2, within, up), Some(2));
        // Replica 2's node shutting down too (it says it cannot lead),
        // its link down, or not heard lately: replica 1, level or not.
        let not_2 = |say: Link| {
            move |v| {
                if v == 2 {
                    say
                } else {
                    up(v)
                }
            }
        };
        let mut refuses = up(2);
        refuses.cannot_lead = true;
        assert_eq!(
            hand_off_to(&behind, 1, NONE, 0, within, not_2(refuses)),
            Some(1)
        );
        let mut down = up(2);
        down.down = true;
        assert_eq!(
            hand_off_to(&behind, 1, NONE, 0, within, not_2(down)),
            Some(1)
        );
        let mut silent = up(2);
        silent.node_heard_lately = false;
        assert_eq!(
            hand_off_to(&behind, 1, NONE, 0, within, not_2(silent)),
            Some(1)
        );
        // With the beats off, the group's own answers count.
        let no_beats = |_| Link {
            node_heard_lately: false,
            down: false,
            cannot_lead: false,
            beats: false,
        };
        // Both answered their group lately; replica 1 is not level.
        assert_eq!(hand_off_to(&behind, 0, NONE, 0, within, no_beats), Some(2));
        let unheard = leader_of(100, 1, 100, 400);
        let only_2 = hand_off_to(&unheard, 0, NONE, 0, within, no_beats);
        assert_eq!(only_2, Some(2));
        // No one to take it.
        let nobody = |_| Link {
            node_heard_lately: false,
            down: true,
            cannot_lead: false,
            beats: true,
        };
        assert_eq!(hand_off_to(&both, 0, NONE, 0, within, nobody), None);
    }
}
