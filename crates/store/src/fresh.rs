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
//!   data was removed to rejoin under its id). The leader answers only
//!   after it confirmed with a quorum of the others that it leads
//!   ([`reverted`]): the replica forgot the highest term it saw, so a
//!   deposed leader it alone can reach would otherwise be taken at its
//!   old term and commit with it, at indices the newer leader committed
//!   others at. A leader this process voted for in its term is taken
//!   untold (a new cluster's first leader, elected by new replicas).
//! - **It votes for no one who has entries until it caught up.** A vote
//!   it granted before and forgot, or an entry a commit counted on it and
//!   it lost, could otherwise let a second leader in a term, or a leader
//!   without a committed entry, be elected. Until it applied through its
//!   bar, the commit index of the first leader it took that had committed
//!   an entry of its own term (every entry committed before it lost its
//!   disk is at or below that: the leader confirmed it leads, and its
//!   commit index covers its predecessors'; from a leader it voted for,
//!   any commit index, since such a leader was elected with no entries),
//!   it grants no vote or
//!   pre-vote to a candidate whose log holds anything past the initial
//!   membership (index 0), and **stands for election itself only while
//!   it holds nothing** past it (a prefix of a leader's log could be as
//!   long as a lagging replica's, whose vote would elect it without the
//!   entries it lacks). Candidates of a cluster that never committed
//!   anything still get its vote, and in a new cluster the bar is met at
//!   once (nothing committed), so a new cluster, every replica of which
//!   is new, elects as usual. In a group of two voters it votes for the
//!   other freely (its log holds every commit: `raft_group::handle`).
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

/// What a leader's call says of its commit index: the index (0 when it
/// knows of none), and whether the entry there is of the leader's own
/// term.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Commit {
    pub(crate) index: u64,
    pub(crate) of_its_term: bool,
}

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
    /// The last vote this process granted while careful: (term, candidate).
    voted: Mutex<Option<(u64, u64)>>,
    /// Its bar ([`Fresh::admit`]); `u64::MAX` until a leader set it.
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
            voted: Mutex::default(),
            bar: AtomicU64::new(u64::MAX),
            caught_up: AtomicBool::new(false),
        }
    }

    /// This replica's id.
    pub(crate) fn me(&self) -> u64 {
        self.me
    }

    /// Whether it is still careful.
    pub(crate) fn active(&self) -> bool {
        !self.caught_up.load(Ordering::Acquire)
    }

    /// Records a vote this replica granted while careful: `candidate` at
    /// `term` (see [`Fresh::admit`]).
    pub(crate) fn granted(&self, term: u64, candidate: u64) {
        if self.active() {
            *lock(&self.voted) = Some((term, candidate));
        }
    }

    /// Before a call from `leader` at `term` that replicates to this
    /// replica: `Err` (the call is refused) until `leader` was told that
    /// this replica starts again (and confirmed with a quorum that it
    /// leads: [`reverted`]); the first refusal tells it. A leader this
    /// process voted for in that term ([`Fresh::granted`]) needs no telling:
    /// it was elected after this replica started again, so it never
    /// matched the replica's lost log, and while careful this replica votes
    /// only for candidates with no entries (a new cluster's). That is how
    /// a new cluster, every replica of which is new, starts: its leader
    /// could not confirm with a quorum of replicas that refuse it. (The
    /// vote in the replica's storage is not asked: a test that lost a
    /// replica's disk under a running group found it resurrected there.)
    pub(crate) fn admit(
        self: &Arc<Self>,
        leader: u64,
        term: u64,
        commit: Option<Commit>,
    ) -> Result<(), String> {
        if !self.active() {
            return Ok(());
        }
        let voted_for_it = *lock(&self.voted) == Some((term, leader));
        if voted_for_it || lock(&self.told).contains(&leader) {
            // The bar: from a leader it told, only a commit index of the
            // leader's own term (one elected a moment ago, or restarted,
            // may not know yet how far the group committed; one that
            // committed in its own term does). From a leader it voted for,
            // any: it was elected with no entries (this replica votes for
            // no other while careful), which within a minority's loss means
            // nothing was committed anywhere (a new cluster), so its
            // replicas are caught up at once and may elect again should it
            // die before its first commit.
            let bar = commit.and_then(|c| (voted_for_it || c.of_its_term).then_some(c.index));
            if let Some(c) = bar {
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

    /// Why it may not stand for election, its last log index being
    /// `last_index`: while careful, once it holds any entry past the
    /// initial membership (index 0). Such entries came from a leader of a
    /// group that ran, and a replica holding a prefix of that leader's
    /// log may have as long a log as a replica behind it, whose vote it
    /// could win without an entry the leader and it had committed (a
    /// review found it: a new replica elected so counted as caught up and
    /// lost the mark). With no entry it may stand: in a new cluster every
    /// replica is new, and someone must; a replica of a group that ran
    /// refuses an empty log its vote anyway.
    pub(crate) fn refuses_campaign(&self, last_index: Option<u64>) -> Option<String> {
        (self.active() && last_index.is_some_and(|i| i > 0)).then(|| {
            format!(
                "the replica on node {} of group {} has a new data directory and has not caught up: \
                 it does not stand for election",
                self.me, self.group
            )
        })
    }

    /// An operator's word that this replica is to be trusted as caught up
    /// (`ShardStore::trust_replica`): it is careful no more. Whether it
    /// was careful until now.
    pub(crate) fn trust(&self) -> bool {
        !self.caught_up.swap(true, Ordering::AcqRel)
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

/// How long a leader told of a new replica may take to confirm with a
/// quorum that it leads (within the caller's [`TELL_WITHIN`]).
const CONFIRM_WITHIN: Duration = Duration::from_millis(1500);

/// The leader's side of [`Rpc::Reverted`]: confirms with a quorum of the
/// group that it leads, then replicates to `node` from the start at the
/// next conflict.
///
/// The confirmation is what makes the new replica's word safe to give. It
/// forgot the highest term it saw, so a deposed leader that it alone can
/// reach (cut off from the group's newer leader) would otherwise be
/// taken at its old term: its entries acknowledged by this replica and
/// itself, a quorum of three, while the newer leader committed others at
/// the same indices with the replica's forgotten acknowledgements (a fork
/// from one lost disk and a partition; `docs/replication.md`). The new
/// replica refuses this leader's calls until it is answered here, so its
/// own answers are not counted: a quorum of the other replicas, which
/// intersects every quorum the replica helped form before it lost its
/// disk, has then taken this leader's term, and no leader of a later term
/// was elected with the replica's forgotten vote or acknowledged entries
/// with it. A leader that cannot confirm is not answered; the replica asks
/// again each second ([`TELL_AGAIN_AFTER`]).
///
/// With two voters there is nothing to confirm, and no quorum to confirm
/// with but the new replica's own: every quorum holds both, so no leader
/// of a later term was elected without this one's vote.
pub(crate) async fn reverted(
    raft: &openraft::Raft<GroupConfig, crate::raft_group::ShardMachine>,
    node: u64,
) -> Result<RpcReply, String> {
    if crate::raft_group::voters(raft) > 2 {
        let confirmed = tokio::time::timeout(
            CONFIRM_WITHIN,
            raft.ensure_linearizable(openraft::ReadPolicy::ReadIndex),
        )
        .await;
        match confirmed {
            Ok(Ok(_)) => {}
            Ok(Err(e)) => {
                return Err(format!(
                    "this node could not confirm with a quorum that it leads the group: {e}"
                ))
            }
            Err(_) => {
                return Err(format!(
                    "no quorum of the group confirmed this node's leadership within {} ms",
                    CONFIRM_WITHIN.as_millis()
                ))
            }
        }
    }
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

#[cfg(test)]
mod tests {
    use super::*;
    use crate::raft_net::{Answer, CallError};
    use futures_util::future::BoxFuture;

    /// A transport that answers every [`Rpc::Reverted`] (a leader that
    /// confirmed it leads), counting them.
    #[derive(Default)]
    struct Leaders(std::sync::atomic::AtomicUsize);

    impl Peers for Leaders {
        fn send(
            &self,
            _target: u64,
            _group: u32,
            rpc: Rpc,
            _within: Duration,
        ) -> BoxFuture<'static, Result<Answer, CallError>> {
            self.0.fetch_add(1, Ordering::SeqCst);
            Box::pin(async move {
                let answer: Answer = Box::pin(async move {
                    match rpc {
                        Rpc::Reverted { .. } => Ok(RpcReply::Reverted),
                        other => Err(CallError::Unreachable(format!("not {}", other.kind()))),
                    }
                });
                Ok(answer)
            })
        }
    }

    #[tokio::test]
    async fn a_new_replica_takes_a_leader_it_voted_for_or_told_and_stands_only_with_no_entries() {
        let peers = Arc::new(Leaders::default());
        let f = Arc::new(Fresh::new(2, 0, peers.clone()));
        // A leader it voted for in that term: taken untold.
        let own = |index| {
            Some(Commit {
                index,
                of_its_term: true,
            })
        };
        let older = |index| {
            Some(Commit {
                index,
                of_its_term: false,
            })
        };
        f.granted(5, 1);
        assert!(f.admit(1, 5, None).is_ok());
        assert!(
            peers.0.load(Ordering::SeqCst) == 0,
            "told a leader it voted for"
        );
        // The same node at another term, or another node: refused, and
        // told (once the answer comes, taken).
        assert!(f.admit(1, 6, own(3)).is_err());
        assert!(f.admit(3, 5, own(3)).is_err());
        let until = std::time::Instant::now() + Duration::from_secs(5);
        // Told: a commit of an older term sets no bar; one of its own does.
        while f.admit(3, 5, older(1)).is_err() {
            assert!(
                std::time::Instant::now() < until,
                "never taken after telling"
            );
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
        assert!(
            !f.caught_up(Some(2), false),
            "a bar from an older term's commit"
        );
        while f.admit(3, 5, own(3)).is_err() {
            assert!(
                std::time::Instant::now() < until,
                "never taken after telling"
            );
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
        // While careful: no vote for a candidate with entries, and no
        // candidacy of its own once it holds any.
        assert!(f.refuses_vote(Some(1)).is_some());
        assert!(f.refuses_vote(Some(0)).is_none());
        assert!(f.refuses_campaign(Some(4)).is_some());
        assert!(f.refuses_campaign(Some(0)).is_none() && f.refuses_campaign(None).is_none());
        // Caught up through the bar (3): careful no more.
        assert!(!f.caught_up(Some(2), false));
        assert!(f.caught_up(Some(3), false));
        assert!(f.refuses_campaign(Some(4)).is_none() && f.refuses_vote(Some(9)).is_none());
        // A vote granted once caught up is not recorded.
        f.granted(7, 3);
        assert_eq!(*lock(&f.voted), Some((5, 1)));
    }

    /// A leader it voted for (elected with no entries: a new cluster's)
    /// sets the bar with any commit it sends, none included: its
    /// replicas are caught up at once, and may elect again should it die
    /// before its first commit.
    #[tokio::test]
    async fn a_leader_it_voted_for_sets_the_bar_at_once() {
        let peers = Arc::new(Leaders::default());
        let f = Arc::new(Fresh::new(2, 0, peers.clone()));
        f.granted(1, 3);
        assert!(f
            .admit(
                3,
                1,
                Some(Commit {
                    index: 0,
                    of_its_term: false
                })
            )
            .is_ok());
        assert_eq!(
            peers.0.load(Ordering::SeqCst),
            0,
            "told a leader it voted for"
        );
        assert!(f.caught_up(None, false));
    }
}
