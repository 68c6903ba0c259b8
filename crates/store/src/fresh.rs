//! A replica whose data directory is new, in a group that may have run
//! without it: a node that lost its disk and came back under its id, or a
//! node of a new cluster (it cannot tell the two apart, so it takes the
//! careful road in both; `docs/replication.md`, "A replica whose data
//! directory is new").
//!
//! Such a replica has forgotten whatever it had: entries a leader counted
//! towards a commit, and votes it granted. Two things follow.
//!
//! - **Its leader must know.** A leader that had this replica's log at
//!   some entry and finds it gone takes that for a bug (openraft's
//!   "follower log reversion": a debug build panics; a release build
//!   skips the check and keeps a matched position the follower no longer
//!   has, which was not studied further). So the replica answers no AppendEntries or
//!   snapshot of a leader until it told that leader it starts again
//!   ([`crate::Rpc::Reverted`]: the leader then calls openraft's
//!   `allow_next_revert` for it, the sanctioned way for a follower whose
//!   data was removed to rejoin under its id).
//! - **It votes for no one who has entries until it caught up.** A vote
//!   it granted before and forgot, or an entry a commit counted on it and
//!   it lost, could otherwise let a second leader in a term, or a leader
//!   without a committed entry, be elected. Until it applied through the
//!   commit index of the first leader that replicated to it (every entry
//!   committed before it lost its disk is at or below that), it grants no
//!   vote or pre-vote to a candidate whose log holds anything past the
//!   initial membership (index 0). Candidates of a cluster that never
//!   committed anything still get its vote, and in a new cluster the bar
//!   is met at once (nothing committed), so a new cluster, every replica
//!   of which is new, elects as usual. (Weak spot: a deposed leader that
//!   still reaches it, cut off from the new one, would set a bar below
//!   what the new leader committed: a partition on top of the lost disk.)
//!
//! The mark ([`FRESH_KEY`]) is written when the group is initialized on
//! this replica and removed once it caught up (or leads: a leader holds
//! every committed entry), so a replica that
//! restarts before it caught up stays careful.

use crate::raft_log::GroupConfig;
use crate::raft_net::{Peers, Rpc, RpcReply};
use std::collections::HashSet;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

/// `raft.fresh` -> (): the replica's data directory is new and it has
/// not caught up with its group yet.
pub(crate) const FRESH_KEY: &[u8] = b"raft.fresh";

/// How long a [`Rpc::Reverted`] call may take.
const TELL_WITHIN: Duration = Duration::from_secs(2);

/// While it has not caught up, a new replica tells its leader again this
/// often: each word holds the leader's group awake a while, and a leader
/// whose replication to it was backing off (it was unreachable for long)
/// may let that while pass before it sends anything.
const TELL_AGAIN_AFTER: Duration = Duration::from_secs(1);

/// A new replica's state until it caught up.
pub(crate) struct Fresh {
    me: u64,
    group: u32,
    peers: Arc<dyn Peers>,
    /// Leaders that know this replica starts again.
    told: Mutex<HashSet<u64>>,
    /// When it last told a leader, and which.
    last_told: Mutex<Option<(std::time::Instant, u64)>>,
    /// Leaders being told.
    telling: Mutex<HashSet<u64>>,
    /// The commit index of the first leader that replicated to it (its
    /// bar); `u64::MAX` until one did.
    bar: AtomicU64,
    caught_up: AtomicBool,
}

fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|e| e.into_inner())
}

impl Fresh {
    pub(crate) fn new(me: u64, group: u32, peers: Arc<dyn Peers>) -> Fresh {
        Fresh {
            me,
            group,
            peers,
            told: Mutex::default(),
            last_told: Mutex::default(),
            telling: Mutex::default(),
            bar: AtomicU64::new(u64::MAX),
            caught_up: AtomicBool::new(false),
        }
    }

    /// Whether it is still careful.
    pub(crate) fn active(&self) -> bool {
        !self.caught_up.load(Ordering::Acquire)
    }

    /// Before a call from `leader` that replicates to this replica: `Err`
    /// (the call is refused) until `leader` was told that this replica
    /// starts again; the first refusal tells it.
    pub(crate) fn admit(self: &Arc<Self>, leader: u64, commit: Option<u64>) -> Result<(), String> {
        if !self.active() {
            return Ok(());
        }
        if lock(&self.told).contains(&leader) {
            if let Some(c) = commit {
                let _ = self
                    .bar
                    .compare_exchange(u64::MAX, c, Ordering::AcqRel, Ordering::Acquire);
            }
            return Ok(());
        }
        self.tell(leader);
        Err(format!(
            "this replica's data directory is new: it takes entries from node {leader} once \
             that node knows it starts again (being told now)"
        ))
    }

    /// While careful, tells the leader (`leader`, or else the last one it
    /// told: a quiet group's new replica may know none) again if it was
    /// told over [`TELL_AGAIN_AFTER`] ago (called at every node heartbeat).
    pub(crate) fn nudge(self: &Arc<Self>, leader: Option<u64>) {
        if !self.active() {
            return;
        }
        let last = *lock(&self.last_told);
        let Some(leader) = leader.or(last.map(|(_, l)| l)).filter(|l| *l != self.me) else {
            return;
        };
        let due = last.is_none_or(|(t, _)| t.elapsed() >= TELL_AGAIN_AFTER);
        if due && lock(&self.told).contains(&leader) {
            self.tell(leader);
        }
    }

    /// A leader it heard of (one that leads the group quietly, naming it
    /// in its node's heartbeat, and sends it nothing): told, if it was not.
    pub(crate) fn hear_of(self: &Arc<Self>, leader: u64) {
        if self.active() && leader != self.me && !lock(&self.told).contains(&leader) {
            self.tell(leader);
        }
    }

    /// Tells `leader` that this replica starts again, in the background
    /// (once at a time per leader).
    fn tell(self: &Arc<Self>, leader: u64) {
        *lock(&self.last_told) = Some((std::time::Instant::now(), leader));
        if lock(&self.telling).insert(leader) {
            let again = lock(&self.told).contains(&leader);
            let me = self.clone();
            tokio::spawn(async move {
                let told = me
                    .peers
                    .call(leader, me.group, Rpc::Reverted { node: me.me }, TELL_WITHIN)
                    .await;
                match told {
                    Ok(RpcReply::Reverted) if again => {
                        tracing::debug!(group = me.group, leader, "told the leader again");
                    }
                    Ok(RpcReply::Reverted) => {
                        tracing::info!(
                            group = me.group,
                            leader,
                            "told the group's leader that this replica's data directory is new"
                        );
                        lock(&me.told).insert(leader);
                    }
                    Ok(other) => {
                        tracing::warn!(group = me.group, leader, reply = ?other, "an unexpected answer to a new replica's word")
                    }
                    Err(e) => {
                        tracing::debug!(group = me.group, leader, error = ?e, "could not tell the leader that this replica's data directory is new")
                    }
                }
                lock(&me.telling).remove(&leader);
            });
        }
    }

    /// Whether a vote for a candidate whose last entry is `last_index`
    /// is refused: while careful, for any candidate with entries.
    pub(crate) fn refuses_vote(&self, last_index: Option<u64>) -> Option<String> {
        (self.active() && last_index.is_some_and(|i| i > 0)).then(|| {
            "this replica's data directory is new and it has not caught up with its group: \
             it may have forgotten a vote or entries it acknowledged, so it votes for no \
             candidate with entries yet"
                .to_string()
        })
    }

    /// Whether it caught up just now, having applied through `applied`
    /// (its bar is set and it applied through it), or leading (a leader
    /// holds every committed entry: it was elected by a quorum's logs).
    pub(crate) fn caught_up(&self, applied: Option<u64>, leading: bool) -> bool {
        if !self.active() {
            return false;
        }
        let bar = self.bar.load(Ordering::Acquire);
        let done = leading || (bar != u64::MAX && applied.unwrap_or(0) >= bar);
        done && !self.caught_up.swap(true, Ordering::AcqRel)
    }
}

/// The leader's side of [`Rpc::Reverted`]: replicate to `node` from the
/// start at the next conflict.
pub(crate) async fn reverted(
    raft: &openraft::Raft<GroupConfig, crate::raft_group::ShardMachine>,
    node: u64,
) -> Result<RpcReply, String> {
    match raft.trigger().allow_next_revert(&node, true).await {
        Ok(Ok(())) => {
            // (Debug: a new replica says it again every second until it
            // caught up; its own log says it once.)
            tracing::debug!(
                node,
                "a replica's data directory is new: replicating to it from the start"
            );
            Ok(RpcReply::Reverted)
        }
        Ok(Err(e)) => Err(e.to_string()),
        Err(e) => Err(e.to_string()),
    }
}
