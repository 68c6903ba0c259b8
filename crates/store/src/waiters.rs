//! Per-execution wakeups for readers waiting on new events (long-polls).
//!
//! A reader registers interest in one execution ([`Waiters::register`])
//! and awaits its [`Interest::notified`]; the shard's writer, after a
//! group is durable and visible, wakes the interests of exactly the
//! executions that group wrote ([`Waiters::wake`]). When nobody waits on
//! the shard the writer's cost is one atomic load.

use forkless_types::ExecutionId;
use std::collections::HashMap;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use tokio::sync::Notify;

/// One shard's registry of interests.
#[derive(Debug, Default)]
pub(crate) struct Waiters {
    /// Interests registered now, over all executions.
    count: AtomicUsize,
    /// Each execution waited on: its notifier and how many wait on it.
    by_execution: Mutex<HashMap<ExecutionId, (Arc<Notify>, usize)>>,
}

impl Waiters {
    /// Registers interest in `id` until the returned handle is dropped.
    pub(crate) fn register(self: &Arc<Self>, id: ExecutionId) -> Interest {
        let notify = {
            let mut m = self.by_execution.lock().unwrap_or_else(|p| p.into_inner());
            let e = m.entry(id).or_insert_with(|| (Arc::new(Notify::new()), 0));
            e.1 += 1;
            e.0.clone()
        };
        self.count.fetch_add(1, Ordering::AcqRel);
        Interest {
            waiters: self.clone(),
            id,
            notify,
        }
    }

    /// Wakes every interest in any of `ids` (called by the writer after a
    /// group that wrote them is visible to readers).
    pub(crate) fn wake<'a>(&self, ids: impl IntoIterator<Item = &'a ExecutionId>) {
        if self.count.load(Ordering::Acquire) == 0 {
            return;
        }
        let m = self.by_execution.lock().unwrap_or_else(|p| p.into_inner());
        for id in ids {
            if let Some((n, _)) = m.get(id) {
                n.notify_waiters();
            }
        }
    }

    /// Wakes every interest (the shard's state was replaced: each waiter
    /// reads again).
    pub(crate) fn wake_all(&self) {
        let m = self.by_execution.lock().unwrap_or_else(|p| p.into_inner());
        for (n, _) in m.values() {
            n.notify_waiters();
        }
    }
}

/// Interest in one execution's new events; see [`Waiters`].
#[derive(Debug)]
pub struct Interest {
    waiters: Arc<Waiters>,
    id: ExecutionId,
    notify: Arc<Notify>,
}

impl Interest {
    /// Resolves after a commit that wrote this execution. Create (and
    /// `enable`) it before reading the execution, so a commit between the
    /// read and the wait is not missed.
    pub fn notified(&self) -> tokio::sync::futures::Notified<'_> {
        self.notify.notified()
    }
}

impl Drop for Interest {
    fn drop(&mut self) {
        let mut m = self
            .waiters
            .by_execution
            .lock()
            .unwrap_or_else(|p| p.into_inner());
        if let Some(e) = m.get_mut(&self.id) {
            e.1 -= 1;
            if e.1 == 0 {
                m.remove(&self.id);
            }
        }
        self.waiters.count.fetch_sub(1, Ordering::AcqRel);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn id(n: i64) -> ExecutionId {
        ExecutionId::new(n).expect("a valid id")
    }

    #[tokio::test]
    async fn only_the_executions_written_are_woken_and_interests_are_let_go() {
        let w = Arc::new(Waiters::default());
        let a = w.register(id(1));
        let a2 = w.register(id(1));
        let b = w.register(id(2));
        assert_eq!(w.count.load(Ordering::Acquire), 3);
        {
            let na = a.notified();
            let nb = b.notified();
            tokio::pin!(na, nb);
            na.as_mut().enable();
            nb.as_mut().enable();
            w.wake([&id(2), &id(3)]);
            assert!(
                futures_poll(nb.as_mut()),
                "the interest in the written execution is woken"
            );
            assert!(!futures_poll(na.as_mut()), "another execution's is not");
            w.wake([&id(1)]);
            assert!(futures_poll(na.as_mut()));
        }
        drop((a, b));
        assert_eq!(w.count.load(Ordering::Acquire), 1);
        assert_eq!(w.by_execution.lock().unwrap().len(), 1);
        drop(a2);
        assert_eq!(w.count.load(Ordering::Acquire), 0);
        assert!(w.by_execution.lock().unwrap().is_empty());
    }

    /// Whether the future is ready when polled once.
    fn futures_poll<F: std::future::Future>(f: std::pin::Pin<&mut F>) -> bool {
        let waker = std::task::Waker::noop();
        let mut cx = std::task::Context::from_waker(waker);
        f.poll(&mut cx).is_ready()
    }
}
