//! A node's heartbeat, one a node pair: what lets an idle group turn its
//! timers off (`docs/replication.md`, "Many groups on two cores").
//!
//! Every heartbeat interval a node asks each group it leads whether it is
//! idle (nothing proposed for [`IDLE_BEATS`] intervals, every follower
//! has every entry: then its timers go off), and sends each peer one
//! [`Beat`] naming the groups it leads quietly, with their terms. A
//! follower that hears it turns its own group's timers off too. A quiet
//! follower whose leader has not named its group for the election
//! timeout's min (the leader's node died, is paused or cut off, or the
//! group woke), or that knows no leader, turns its timers back on, after a random part of the
//! election timeout's spread so that two followers do not stand at once;
//! the group then elects as usual, pre-vote first. A write to a quiet
//! group wakes its leader (the writer), and its entries wake the
//! followers.

use crate::Groups;
use forkless_store::{Beat, Peers, QuietAs, RaftTiming, Rpc};
use std::collections::HashMap;
use std::hash::BuildHasher;
use std::sync::Arc;
use std::sync::Mutex;
use std::time::{Duration, Instant};
use tokio::sync::watch;

/// Heartbeat intervals with nothing proposed before a leader's group goes
/// quiet.
pub const IDLE_BEATS: u32 = 3;

/// The longest a beat asked for sooner than its tick waits after the
/// node's last beat.
const SOONER_AT_MOST: Duration = Duration::from_millis(25);

/// What a node does with a peer's heartbeat: each group the peer leads
/// quietly goes quiet here too, if this replica follows that peer at that
/// term. Returns those of them quiet here with entries not applied (the
/// peer wakes them: `RpcReply::Beat::wake`).
pub(crate) fn heard(from: u64, beat: &Beat, groups: &Groups) -> Vec<u32> {
    let mut behind = Vec::new();
    for (shard, term) in &beat.quiet {
        if let Some(st) = groups(*shard) {
            if st.follow_quietly(from, *term) == forkless_store::Followed::QuietBehind {
                behind.push(*shard);
            }
        }
    }
    behind
}

/// When each peer last answered this node's heartbeat, and which of the
/// groups this node led then it said it could not take the leadership
/// of: which peers are alive, and which may be handed a shard, for the
/// leader balancer (a quiet group's followers answer nothing of their
/// group's, and a new replica's group says nothing of its being new).
#[derive(Debug, Default)]
pub struct PeersHeard {
    answers: Mutex<HashMap<u64, Heard>>,
    /// The node's heartbeat runs ([`run`]): a peer's answers to it then
    /// say whether it may be handed a shard.
    beating: std::sync::atomic::AtomicBool,
    /// Notified as each answer comes ([`PeersHeard::answers_since`]).
    answered: tokio::sync::Notify,
}

/// A peer's last answer to this node's heartbeat.
#[derive(Debug)]
struct Heard {
    /// When it came.
    at: Instant,
    /// When the beat it answers was made (the groups it said this node
    /// leads are those led then).
    asked: Instant,
    /// Of those groups, the ones the peer said it cannot lead.
    cannot_lead: Vec<u32>,
}

impl PeersHeard {
    /// Whether this node's heartbeat runs: its answers then say which
    /// peers may be handed a shard (`balance::Link::beats`).
    pub fn beating(&self) -> bool {
        self.beating.load(std::sync::atomic::Ordering::Acquire)
    }

    /// `peer` answered the beat made at `asked`. An answer to an older
    /// beat than the one kept (beats sent close together, answered out
    /// of order) changes nothing: it may predate the peer's shutdown.
    pub(crate) fn heard(&self, peer: u64, asked: Instant, cannot_lead: Vec<u32>) {
        let mut answers = self.answers.lock().unwrap_or_else(|e| e.into_inner());
        if answers.get(&peer).is_some_and(|h| h.asked > asked) {
            return;
        }
        answers.insert(
            peer,
            Heard {
                at: Instant::now(),
                asked,
                cannot_lead,
            },
        );
        drop(answers);
        self.answered.notify_waiters();
    }

    /// Waits until each of `peers` heard lately (within `lately`) has
    /// answered a beat made after `asked`, or `wait` has passed: what
    /// they then say they cannot lead speaks of every group this node led
    /// at `asked` (an answer to an older beat says nothing of a group
    /// this node came to lead since). A peer not heard within `lately` is
    /// not waited for.
    pub async fn answers_since(
        &self,
        peers: &[u64],
        asked: Instant,
        lately: Duration,
        wait: Duration,
    ) {
        let until = tokio::time::Instant::now() + wait;
        loop {
            // Made before the check: an answer between the two wakes it.
            let answer = self.answered.notified();
            if peers
                .iter()
                .all(|p| self.answered_since(*p, asked) || !self.within(*p, lately))
            {
                return;
            }
            if tokio::time::timeout_at(until, answer).await.is_err() {
                return;
            }
        }
    }

    /// Whether `peer` answered a heartbeat within `within`.
    pub fn within(&self, peer: u64, within: Duration) -> bool {
        self.answers
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .get(&peer)
            .is_some_and(|h| h.at.elapsed() <= within)
    }

    /// Whether `peer`'s last answer is to a beat made after `since` (so
    /// the groups it speaks of are those this node led then).
    pub fn answered_since(&self, peer: u64, since: Instant) -> bool {
        self.answers
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .get(&peer)
            .is_some_and(|h| h.asked > since)
    }

    /// Whether `peer`'s last answer, within `within`, said it could not
    /// take the leadership of `shard` (it held no replica of it, or a new
    /// one not caught up). No answer within it says nothing.
    pub fn cannot_lead(&self, peer: u64, shard: u32, within: Duration) -> bool {
        self.answers
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .get(&peer)
            .is_some_and(|h| h.at.elapsed() <= within && h.cannot_lead.contains(&shard))
    }
}

/// The peers a node's heartbeat goes to, asked every interval (a node
/// added at run time is beaten from then on).
pub type PeerIds = Arc<dyn Fn() -> Vec<u64> + Send + Sync>;

/// Sends this node's heartbeat to `peers` every heartbeat interval, and
/// at once when `now` is notified (one of this node's replicas came to
/// lead its group: every peer hears of it within a round trip, the nodes
/// that hold no replica of the shard among them), and wakes the quiet
/// followers among `shards` whose leader went silent, until `stop` turns
/// true. With `timing.quiesce` off no group goes quiet here, and the beat
/// names the groups led, for routing and for the leader balancer.
pub async fn run(
    peers: Arc<dyn Peers>,
    peer_ids: PeerIds,
    shards: crate::Hosted,
    timing: RaftTiming,
    heard: Arc<PeersHeard>,
    now: Arc<tokio::sync::Notify>,
    mut stop: watch::Receiver<bool>,
) {
    heard
        .beating
        .store(true, std::sync::atomic::Ordering::Release);
    let every = Duration::from_millis(timing.heartbeat_ms);
    let idle = every * IDLE_BEATS;
    let silent_after = Duration::from_millis(timing.election_timeout_min_ms);
    let spread_ms = timing
        .election_timeout_max_ms
        .saturating_sub(timing.election_timeout_min_ms)
        .max(1);
    let random = std::collections::hash_map::RandomState::new();
    let mut ticks = tokio::time::interval(every);
    ticks.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    // Beats sooner than their tick (for leaderships won, a drain's ask)
    // come at most this often: the elections of many shards at once (a
    // node's start, a failover) make a few beats, not one each. An eighth
    // of the interval, within [5 ms, SOONER_AT_MOST]: with the interval
    // configured long, an eighth of it kept a new leader's beat (and a
    // drain's, which waits at most a quarter of its 2 s for the answers)
    // waiting seconds after the node's last beat.
    let soonest = (every / 8).clamp(Duration::from_millis(5), SOONER_AT_MOST);
    let mut last = Instant::now();
    loop {
        let soon = tokio::select! {
            _ = ticks.tick() => false,
            _ = now.notified() => true,
            _ = stop.wait_for(|s| *s) => return,
        };
        if soon {
            tokio::select! {
                _ = tokio::time::sleep_until((last + soonest).into()) => {}
                _ = stop.wait_for(|s| *s) => return,
            }
        }
        last = Instant::now();
        // Before the groups are looked at: every group led from then on
        // is named in this beat.
        let asked = Instant::now();
        let mut quiet = Vec::new();
        // Each quiet group's members (voters and learners).
        let mut members = Vec::new();
        // Every group this node leads, quiet or not.
        let mut led = Vec::new();
        for st in &shards() {
            let quiet_as = if timing.quiesce {
                st.quiesce_if_idle(idle)
            } else {
                QuietAs::Awake
            };
            if let QuietAs::Leader { term } = quiet_as {
                quiet.push((st.id().get(), term));
                members.push(st.members());
                led.push((st.id().get(), term));
            } else if let Some(l) = st.leadership().filter(|l| l.this_node_leads()) {
                led.push((st.id().get(), l.term));
            }
        }
        for peer in peer_ids() {
            let yours = quiet
                .iter()
                .zip(&members)
                .filter(|(_, m)| m.contains(&peer))
                .map(|((shard, _), _)| *shard)
                .collect();
            let beat = Rpc::Beat(Beat {
                quiet: quiet.clone(),
                yours,
                led: led.clone(),
            });
            let call = peers.call(peer, 0, beat, every);
            // Not waited for: a slow peer must not delay the others' beats
            // (each call ends within `every`).
            let (heard, shards) = (heard.clone(), shards.clone());
            tokio::spawn(async move {
                match call.await {
                    Ok(forkless_store::RpcReply::Beat { cannot_lead, wake }) => {
                        heard.heard(peer, asked, cannot_lead);
                        // Said once per wake, not at every beat until the
                        // follower has applied.
                        let woke: Vec<u32> = shards()
                            .iter()
                            .filter(|st| wake.contains(&st.id().get()))
                            .filter(|st| st.hold_awake_for_a_follower())
                            .map(|st| st.id().get())
                            .collect();
                        if !woke.is_empty() {
                            tracing::info!(
                                node = peer,
                                shards = ?woke,
                                "a follower's replicas are quiet behind their logs (restarted): their groups wake to tell them the commit"
                            );
                        }
                    }
                    // An answer of another kind is still an answer.
                    Ok(_) => heard.heard(peer, asked, Vec::new()),
                    Err(_) => {}
                }
            });
        }
        let mut woke = Vec::new();
        for st in &shards() {
            let Some((leader, since)) = st.quiet_leader() else {
                continue;
            };
            // This node's own delay for the shard (each node draws its own).
            let jitter = Duration::from_millis(random.hash_one(st.id().get()) % spread_ms);
            if since >= silent_after + jitter && st.wake() {
                woke.push((st.id().get(), leader));
            }
        }
        if !woke.is_empty() {
            tracing::info!(
                shards = ?woke.iter().map(|(s, _)| s).collect::<Vec<_>>(),
                leaders = ?woke.iter().filter_map(|(_, l)| *l).collect::<std::collections::BTreeSet<_>>(),
                "quiet shards' leader went silent: their groups' timers are back on"
            );
        }
    }
}
