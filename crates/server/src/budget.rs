//! Budgets of bytes a listener's connections hold at once: the request
//! bodies they are reading (`limits.body_bytes_in_flight_max`) and the
//! answers to reads they are writing (`limits.answer_bytes_in_flight_max`).
//!
//! A budget is counted in whole KiB. A request takes an empty [`Held`],
//! grows it to cover the bytes it is about to hold ([`Held::cover`]), and
//! gives them all back when the hold is dropped. A hold that cannot grow
//! leaves what it had: the caller refuses the request (503, nothing done).

use prometheus_client::metrics::{counter::Counter, gauge::Gauge};
use std::sync::atomic::{AtomicU32, Ordering::Relaxed};
use std::sync::Arc;
use tokio::sync::Semaphore;

/// One listener's budget of bytes of one kind.
pub(crate) struct ByteBudget {
    kib: Arc<Semaphore>,
    max_bytes: usize,
    /// The bytes held now, across the node's listeners.
    gauge: Gauge,
    /// Holds refused for want of room, across the node's listeners.
    refused: Counter,
}

impl ByteBudget {
    pub(crate) fn new(max_bytes: usize, gauge: Gauge, refused: Counter) -> ByteBudget {
        ByteBudget {
            kib: Arc::new(Semaphore::new(
                max_bytes.div_ceil(1024).min(Semaphore::MAX_PERMITS),
            )),
            max_bytes,
            gauge,
            refused,
        }
    }

    /// An empty hold, for one request.
    pub(crate) fn hold(&self) -> Held {
        Held {
            budget: self.kib.clone(),
            kib: AtomicU32::new(0),
            gauge: self.gauge.clone(),
            refused: self.refused.clone(),
        }
    }

    /// The bytes no request holds now (a hint: others may take them
    /// before the caller does).
    pub(crate) fn room(&self) -> usize {
        self.kib.available_permits().saturating_mul(1024)
    }

    pub(crate) fn max_bytes(&self) -> usize {
        self.max_bytes
    }
}

/// What one request holds of a [`ByteBudget`], grown as it needs more
/// ([`Held::cover`]) and given back whole when dropped.
pub(crate) struct Held {
    budget: Arc<Semaphore>,
    kib: AtomicU32,
    gauge: Gauge,
    refused: Counter,
}

impl Held {
    /// Grows the hold to cover `bytes` in all; false when the budget has
    /// no room for them (the hold then stays as it was).
    pub(crate) fn cover(&self, bytes: usize) -> bool {
        let want = bytes.div_ceil(1024);
        let have = self.kib.load(Relaxed) as usize;
        if want <= have {
            return true;
        }
        let Some(more) = u32::try_from(want - have)
            .ok()
            .filter(|_| want <= u32::MAX as usize)
        else {
            self.refused.inc();
            return false;
        };
        match self.budget.try_acquire_many(more) {
            Ok(permit) => {
                permit.forget();
                self.kib.fetch_add(more, Relaxed);
                self.gauge.inc_by(i64::from(more) * 1024);
                true
            }
            Err(_) => {
                self.refused.inc();
                false
            }
        }
    }
}

impl Drop for Held {
    fn drop(&mut self) {
        let kib = *self.kib.get_mut();
        if kib > 0 {
            self.budget.add_permits(kib as usize);
            self.gauge.dec_by(i64::from(kib) * 1024);
        }
    }
}

/// What a request whose body would go over `max_bytes` is answered.
pub(crate) fn body_budget_refusal(max_bytes: usize) -> crate::error::ApiError {
    crate::error::ApiError::Overloaded {
        code: "too_many_body_bytes",
        message: format!(
            "with this request's body, the connections of the listener it came in on would hold more than {max_bytes} bytes of request bodies, its limit (limits.body_bytes_in_flight_max); nothing was done, retry later"
        ),
        limit: max_bytes,
    }
}

/// What a read whose answer would take its listener's answers over
/// `max_bytes` is answered.
pub(crate) fn answer_budget_refusal(max_bytes: usize) -> crate::error::ApiError {
    crate::error::ApiError::Overloaded {
        code: "too_many_answer_bytes",
        message: format!(
            "with this read's answer, the connections of the listener it came in on would hold more than {max_bytes} bytes of answers not yet written, its limit (limits.answer_bytes_in_flight_max); retry later"
        ),
        limit: max_bytes,
    }
}

/// The listener a request came in on (its index in [`crate::App::body_budgets`]
/// and [`crate::App::answer_budgets`]), in the request's extensions.
#[derive(Debug, Clone, Copy)]
pub(crate) struct ListenerIndex(pub(crate) usize);

/// Reading a body took its listener's body bytes past their budget.
#[derive(Debug)]
pub(crate) struct OverBodyBudget;

impl std::fmt::Display for OverBodyBudget {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("the request bodies held would go over limits.body_bytes_in_flight_max")
    }
}

impl std::error::Error for OverBodyBudget {}

#[cfg(test)]
mod tests {
    use super::*;

    fn budget(max: usize) -> ByteBudget {
        ByteBudget::new(max, Gauge::default(), Counter::default())
    }

    #[test]
    fn a_hold_grows_within_the_budget_and_gives_everything_back() {
        let b = budget(10 * 1024);
        let one = b.hold();
        assert!(one.cover(4 * 1024));
        assert!(one.cover(3000), "less than held is covered already");
        assert_eq!(b.room(), 6 * 1024);
        let two = b.hold();
        assert!(two.cover(6 * 1024));
        assert!(!two.cover(6 * 1024 + 1), "one byte past is a KiB past");
        assert!(!b.hold().cover(1));
        assert_eq!(b.refused.get(), 2);
        assert_eq!(b.gauge.get(), 10 * 1024);
        drop(one);
        assert_eq!(b.room(), 4 * 1024);
        drop(two);
        assert_eq!(b.room(), 10 * 1024);
        assert_eq!(b.gauge.get(), 0);
    }
}
