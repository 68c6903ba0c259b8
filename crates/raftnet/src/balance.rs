//! Leaders spread over the nodes: each shard has a preferred replica (the
//! first its placement names, so the shards' preferred leaders are spread
//! evenly over the nodes), and a node that leads a shard whose preferred
//! replica is another hands the leadership to it once that replica has
//! (nearly) every entry. At start, whoever wins the first election hands
//! over; after a node comes back and catches up, its shards go back to
//! it. A transfer costs its shard's writes a moment (they are refused as
//! not executed while it runs; if the replica does not take it, until the
//! followers elect once the leader's lease ran out), so it goes only to a
//! replica that answered within [`HEARD_WITHIN_BEATS`] heartbeats and
//! lacks at most [`TRANSFER_LAG_MAX`] entries, and one that did not take
//! is tried again only after [`TRANSFER_BACKOFF`].

use forkless_store::ShardStore;
use forkless_types::ShardId;
use std::collections::HashMap;
use std::sync::Arc;
use std::time::{Duration, Instant};
use tokio::sync::watch;

/// How often a node looks at the shards it leads.
pub const BALANCE_EVERY: Duration = Duration::from_secs(1);
/// How long a node waits before it tries again to hand over a shard its
/// preferred replica did not take.
pub const TRANSFER_BACKOFF: Duration = Duration::from_secs(10);
/// How many entries the preferred replica may lack and still be handed
/// the leadership (under load a follower is always a few behind; it
/// catches up before it stands).
pub const TRANSFER_LAG_MAX: u64 = 16;
/// How lately the preferred replica must have answered the leader, in
/// heartbeat intervals (a transfer to a replica that died meanwhile costs
/// the shard an election's time of refused writes).
pub const HEARD_WITHIN_BEATS: u32 = 3;

/// Hands each of `shards` this node leads to its preferred replica
/// (`preferred`), until `stop` turns true.
pub async fn run(
    shards: Vec<Arc<ShardStore>>,
    preferred: Arc<dyn Fn(ShardId) -> u64 + Send + Sync>,
    heard: Arc<crate::quiesce::PeersHeard>,
    heartbeat: Duration,
    mut stop: watch::Receiver<bool>,
) {
    let heard_within = heartbeat * HEARD_WITHIN_BEATS;
    // The term each shard was last handed over at, and when: a try that
    // did not take (this node still leads at that term) waits; one at a
    // later term does not.
    let mut tried: HashMap<u32, (u64, Instant)> = HashMap::new();
    let mut ticks = tokio::time::interval(BALANCE_EVERY);
    ticks.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        tokio::select! {
            _ = ticks.tick() => {}
            _ = stop.wait_for(|s| *s) => return,
        }
        for st in &shards {
            let Some(s) = st.raft_status() else { continue };
            let want = preferred(st.id());
            let shard = st.id().get();
            if s.state != "leader" || s.leader != Some(s.me) || want == s.me {
                continue;
            }
            let last = s.last_log_index.unwrap_or(0);
            // It answered lately, its group or this node's heartbeat (a
            // replica that is down keeps its last matched index in the
            // leader's view; a quiet group's followers answer nothing of
            // their group's), and is nearly level.
            let keeps_up = s.matched.iter().any(|(id, m)| {
                *id == want && m.is_some_and(|m| last.saturating_sub(m) <= TRANSFER_LAG_MAX)
            }) && (s.heard_ms_ago.iter().any(|(id, ago)| {
                *id == want && ago.is_some_and(|ms| u128::from(ms) <= heard_within.as_millis())
            }) || heard.within(want, heard_within));
            if !keeps_up
                || tried
                    .get(&shard)
                    .is_some_and(|(term, at)| *term == s.term && at.elapsed() < TRANSFER_BACKOFF)
            {
                continue;
            }
            tried.insert(shard, (s.term, Instant::now()));
            tracing::info!(
                shard,
                term = s.term,
                to = want,
                "handing the shard's leadership to its preferred replica"
            );
            if let Err(e) = st.transfer_leader(want).await {
                tracing::warn!(shard, to = want, error = %e, "handing over the shard's leadership failed");
            }
        }
    }
}
