//! The store's supervisor: a shard whose Raft group stopped by itself (a
//! panic of its core, an error of its storage) is closed and opened again
//! from its data directory, as a process restart would, while the node's
//! other shards serve (issue 16 item 8; `docs/replication.md`,
//! "Supervision").

use crate::{Store, StoreError};
use forkless_types::ShardId;
use std::collections::BTreeMap;
use std::sync::Arc;

/// A shard's restarts by the store's supervisor ([`Store::supervise`]).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Restarts {
    /// Restarts since the process started.
    pub count: u64,
    /// Restarts in a row, each less than [`RESTARTS_FORGOTTEN_AFTER`]
    /// after the one before: the next waits [`restart_backoff`] of it.
    pub in_a_row: u32,
    /// Why the group stopped, the last time.
    pub last_reason: String,
    /// How the last restart ended (`Err`: the shard stays stopped, and is
    /// tried again after the backoff).
    pub last_outcome: Result<(), String>,
    at: std::time::Instant,
}

/// How often the supervisor looks for stopped groups.
const SUPERVISE_EVERY: std::time::Duration = std::time::Duration::from_millis(200);

/// How long a restart waits for the stopped shard to be let go of: a
/// request that holds it ends within its own timeouts (a long-poll's
/// longest wait is 30 s by default).
const RELEASE_WITHIN: std::time::Duration = std::time::Duration::from_secs(60);

/// How long a restart waits for what the stopped group handed the node log
/// to be written.
const SETTLE_WITHIN: std::time::Duration = std::time::Duration::from_secs(10);

/// A restart this long after the one before starts the backoff over.
pub const RESTARTS_FORGOTTEN_AFTER: std::time::Duration = std::time::Duration::from_secs(600);

/// The wait before a group's restart after `in_a_row` restarts in a row:
/// none for the first, then 1 s doubling to at most 5 min, so a group
/// that stops again at once (a bug that replays with its log) costs the
/// node a restart every few minutes, not a loop.
pub fn restart_backoff(in_a_row: u32) -> std::time::Duration {
    match in_a_row {
        0 => std::time::Duration::ZERO,
        n => std::time::Duration::from_secs((1u64 << (n - 1).min(9)).min(300)),
    }
}

impl Store {
    /// Starts the supervisor: a thread that, every [`SUPERVISE_EVERY`],
    /// restarts the shards whose Raft group stopped by itself
    /// ([`Store::restart_stopped`]); it ends with the store.
    pub fn supervise(self: &Arc<Self>) -> Result<(), StoreError> {
        let store = Arc::downgrade(self);
        std::thread::Builder::new()
            .name("supervisor".into())
            .spawn(move || loop {
                std::thread::sleep(SUPERVISE_EVERY);
                let Some(store) = store.upgrade() else { return };
                store.restart_stopped();
            })
            .map(drop)
            .map_err(|e| StoreError::Io(format!("spawning the store's supervisor: {e}")))
    }

    /// Restarts every shard whose Raft group stopped by itself (a panic of
    /// its core, an error of its storage) and whose backoff has passed,
    /// one after the other; the node's other shards serve meanwhile. A
    /// shard whose node log failed is not restarted: the disk is the
    /// node's, and so is its failure (restart the node). Returns the
    /// shards it tried, with how each went.
    pub fn restart_stopped(&self) -> Vec<(ShardId, Result<(), StoreError>)> {
        let mut tried = Vec::new();
        for st in self.hosted() {
            let Some(why) = st.group_stopped() else {
                continue;
            };
            let shard = st.id();
            drop(st);
            if self.node.as_ref().is_some_and(|n| n.failure().is_some()) {
                continue;
            }
            let in_a_row = {
                let restarts = self.restarts.lock().unwrap_or_else(|e| e.into_inner());
                match restarts.get(&shard) {
                    Some(r) if r.at.elapsed() >= RESTARTS_FORGOTTEN_AFTER => 0,
                    Some(r) if r.at.elapsed() < restart_backoff(r.in_a_row) => continue,
                    Some(r) => r.in_a_row,
                    None => 0,
                }
            };
            let started = std::time::Instant::now();
            self.restarting
                .write()
                .unwrap_or_else(|e| e.into_inner())
                .insert(
                    shard,
                    format!("its Raft group stopped ({why}); it is being restarted"),
                );
            let outcome = self.restart_shard(shard);
            self.restarting
                .write()
                .unwrap_or_else(|e| e.into_inner())
                .remove(&shard);
            match &outcome {
                Ok(()) => {
                    tracing::warn!(shard = %shard, reason = %why, took_ms = started.elapsed().as_millis() as u64, restarts_in_a_row = in_a_row + 1, "restarted a shard whose Raft group had stopped")
                }
                Err(e) => {
                    tracing::error!(shard = %shard, reason = %why, error = %e, next_try_in_s = restart_backoff(in_a_row + 1).as_secs(), "a shard whose Raft group stopped could not be restarted")
                }
            }
            let mut restarts = self.restarts.lock().unwrap_or_else(|e| e.into_inner());
            let r = restarts.entry(shard).or_insert(Restarts {
                count: 0,
                in_a_row: 0,
                last_reason: String::new(),
                last_outcome: Ok(()),
                at: started,
            });
            r.count += 1;
            r.in_a_row = in_a_row + 1;
            r.last_reason = why;
            r.last_outcome = outcome.as_ref().map(|_| ()).map_err(|e| e.to_string());
            r.at = std::time::Instant::now();
            tried.push((shard, outcome));
        }
        tried
    }

    /// The restarts of each shard the supervisor restarted.
    pub fn restarts(&self) -> BTreeMap<ShardId, Restarts> {
        self.restarts
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .clone()
    }

    /// Closes the shard and opens it again from its data directory, as a
    /// process restart would: taken out of service first (a lookup finds
    /// nothing, and [`Store::failure`] says it is being restarted), let go of by
    /// every holder, its group and writer stopped, what its group handed
    /// the node log written, then opened. A shard still held after
    /// [`RELEASE_WITHIN`] is put back as it was (stopped) and the restart
    /// fails; one whose open fails is out of service, as at start.
    fn restart_shard(&self, shard: ShardId) -> Result<(), StoreError> {
        let _opening = self.opening_lock(shard);
        let Some(old) = self
            .shards
            .write()
            .unwrap_or_else(|e| e.into_inner())
            .remove(&shard)
        else {
            return Ok(());
        };
        let deadline = std::time::Instant::now() + RELEASE_WITHIN;
        while Arc::strong_count(&old) > 1 {
            if std::time::Instant::now() >= deadline {
                let held = Arc::strong_count(&old) - 1;
                self.shards
                    .write()
                    .unwrap_or_else(|e| e.into_inner())
                    .insert(shard, old);
                return Err(StoreError::Io(format!(
                    "the stopped shard was still held ({held} holder(s)) after {} s",
                    RELEASE_WITHIN.as_secs()
                )));
            }
            std::thread::sleep(std::time::Duration::from_millis(5));
        }
        let epoch = old.epoch();
        drop(old);
        if let Some(node) = &self.node {
            node.settle(shard.get(), SETTLE_WITHIN)?;
        }
        match self.open_locked(shard, epoch) {
            Ok(_) => Ok(()),
            Err(e) => {
                self.mark_failed(shard, e.to_string());
                Err(e)
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::{StartRequest, StoreConfig};
    use forkless_types::{Epoch, ExecutionId, ShardCount};
    use std::time::{Duration, Instant};

    /// The next id on `shard` of `count` from `*next`, which moves past it.
    fn id_on(shard: ShardId, count: ShardCount, next: &mut i64) -> ExecutionId {
        let id = (*next..)
            .filter_map(|n| ExecutionId::new(n).ok())
            .find(|id| id.shard(count) == shard)
            .expect("an id on the shard");
        *next = id.get() + 1;
        id
    }

    fn start_of(id: ExecutionId) -> StartRequest {
        StartRequest {
            epoch: Epoch(1),
            id,
            workflow: "wf".into(),
            started_payload: b"{}".to_vec(),
            routing_key: None,
            idempotency_key: Some(format!("start-{id}")),
        }
    }

    async fn wait_for<T>(what: &str, mut f: impl FnMut() -> Option<T>) -> T {
        let deadline = Instant::now() + Duration::from_secs(30);
        loop {
            if let Some(t) = f() {
                return t;
            }
            assert!(Instant::now() < deadline, "timed out waiting for {what}");
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
    }

    /// Shard 0's group panics (in its log's append, where a bug in
    /// openraft's core or in the log would): its write's outcome is
    /// unknown, the shard reports why it stopped, shard 1 serves all along,
    /// and the supervisor restarts shard 0 from its data directory with
    /// every write acknowledged before, after which it takes writes again
    /// (a retry of the unknown one with its idempotency key settles it).
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_group_that_panics_is_restarted_and_the_other_shards_serve_meanwhile() {
        let dir = tempfile::tempdir().expect("tempdir");
        let count = ShardCount::new(2).expect("count");
        let store = Arc::new(
            Store::open(
                dir.path(),
                count,
                StoreConfig {
                    raft: true,
                    ..StoreConfig::default()
                },
            )
            .expect("open"),
        );
        let (zero, one) = (ShardId(0), ShardId(1));
        for s in [zero, one] {
            store.open_shard(s, Epoch(1)).expect("open shard");
        }
        store.supervise().expect("supervisor");
        let mut acked = Vec::new();
        let mut next = 1;
        for _ in 0..20 {
            for s in [zero, one] {
                let id = id_on(s, count, &mut next);
                let st = store.shard(s).expect("open");
                st.start(start_of(id)).await.expect("start");
                acked.push(id);
            }
        }
        let first = store.shard(zero).expect("open");
        crate::failpoints::panic_at_next_append(dir.path(), zero);
        let unknown = id_on(zero, count, &mut next);
        let e = first
            .start(start_of(unknown))
            .await
            .expect_err("the group panicked with this write");
        drop(first);
        assert!(
            e.to_string().contains("may or may not")
                || e.to_string().contains("stopped")
                || e.to_string().contains("unknown"),
            "{e}"
        );
        // Shard 1 serves while shard 0 is stopped and restarted.
        for _ in 0..10 {
            let id = id_on(one, count, &mut next);
            let st = store.shard(one).expect("shard 1 stays open");
            st.start(start_of(id)).await.expect("shard 1 serves");
            acked.push(id);
        }
        let restarted = wait_for("shard 0 restarted", || {
            let r = store.restarts().get(&zero).cloned()?;
            let st = store.shard(zero)?;
            (r.last_outcome.is_ok() && st.group_stopped().is_none()).then_some((r, st))
        })
        .await;
        let (r, st) = restarted;
        assert_eq!(r.count, 1, "{r:?}");
        assert!(r.last_reason.contains("panic"), "{r:?}");
        assert!(store.failure(zero).is_none(), "{:?}", store.failure(zero));
        // Every acknowledged start is there, on both shards.
        for id in &acked {
            let st = store.shard(id.shard(count)).expect("open");
            assert!(
                st.execution(*id).expect("read").is_some(),
                "{id} was acknowledged and is missing"
            );
        }
        // The write whose outcome was unknown is settled by its retry.
        st.start(start_of(unknown)).await.expect("the retry");
        assert!(st.execution(unknown).expect("read").is_some());
        let fresh = id_on(zero, count, &mut next);
        st.start(start_of(fresh))
            .await
            .expect("shard 0 takes writes again");
        // After a clean reopen of the whole store, all of it is there.
        drop(st);
        drop(store);
        let store = Store::open(
            dir.path(),
            count,
            StoreConfig {
                raft: true,
                ..StoreConfig::default()
            },
        )
        .expect("reopen");
        for id in acked.iter().chain([&unknown, &fresh]) {
            let st = store.open_shard(id.shard(count), Epoch(1)).expect("open");
            assert!(
                st.execution(*id).expect("read").is_some(),
                "{id} after the reopen"
            );
        }
    }
}
