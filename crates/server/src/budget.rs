//! Budgets of bytes a listener's connections hold at once: the request
//! bodies they are reading (`limits.body_bytes_in_flight_max`) and the
//! answers to reads they are writing (`limits.answer_bytes_in_flight_max`).
//!
//! A budget is counted in whole KiB. A request takes an empty [`Held`],
//! grows it to cover the bytes it is about to hold ([`Held::cover`]), and
//! gives them all back when the hold is dropped. A hold that cannot grow
//! leaves what it had: the caller refuses the request (503, nothing done).

use axum::body::Body;
use axum::response::{IntoResponse, Response};
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

/// A read's answer this small is not held against its listener's budget:
/// like the read buffer, it is part of what a connection costs
/// (`limits.connections_max` bounds it).
pub(crate) const ANSWER_UNCOUNTED_MAX: usize = 64 * 1024;

/// An answer's bytes with what they hold of their listener's budget: the
/// hold goes with the last of them (once written: `conn` keeps a large
/// answer's body until its last byte is written, and hands it to hyper
/// in steps that hyper copies).
struct HeldBytes {
    bytes: bytes::Bytes,
    _held: Held,
}

impl AsRef<[u8]> for HeldBytes {
    fn as_ref(&self) -> &[u8] {
        &self.bytes
    }
}

/// The answer to a read clients can make large (a page of events, the
/// executions of a key), held against its listener's `budget` from here
/// until it is written; or, when the budget has no room for it, 503
/// `too_many_answer_bytes` with the answer's route headers. Answers of at
/// most [`ANSWER_UNCOUNTED_MAX`] are not held. Only these reads are held:
/// what else a node answers (its status to a peer's probe, its metrics,
/// the cluster's map) is sized by the cluster, not by the client, and is
/// never refused for the budget.
pub(crate) async fn hold_answer(budget: &ByteBudget, resp: Response) -> Response {
    let (parts, body) = resp.into_parts();
    let bytes = match axum::body::to_bytes(body, usize::MAX).await {
        Ok(b) => b,
        Err(e) => {
            return crate::error::ApiError::Internal(format!("making the answer: {e}"))
                .into_response()
        }
    };
    if bytes.len() <= ANSWER_UNCOUNTED_MAX {
        return Response::from_parts(parts, Body::from(bytes));
    }
    let held = budget.hold();
    // An answer larger than the whole budget (a key's executions under a
    // small budget, an event written under a higher payload limit) can
    // never fit: it takes the whole budget, when nothing else holds any.
    if !held.cover(bytes.len().min(budget.max_bytes())) {
        let mut refused = answer_budget_refusal(budget.max_bytes()).into_response();
        // The route headers, not the node's: a relayed answer carries the
        // owner's, and this node refused it.
        for (name, value) in &parts.headers {
            if name.as_str().starts_with("x-forkless-") && name != crate::NODE_HEADER {
                refused.headers_mut().insert(name.clone(), value.clone());
            }
        }
        return refused;
    }
    let bytes = bytes::Bytes::from_owner(HeldBytes { bytes, _held: held });
    Response::from_parts(parts, Body::from(bytes))
}

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

    #[tokio::test]
    async fn a_large_answer_is_held_until_its_last_copy_goes_and_refused_past_the_budget() {
        let b = budget(200 * 1024);
        let answer = |len: usize| {
            let mut r = Response::new(Body::from(vec![b'x'; len]));
            r.headers_mut()
                .insert("x-forkless-shard", http::HeaderValue::from_static("3"));
            r.headers_mut()
                .insert("x-forkless-node", http::HeaderValue::from_static("1"));
            r
        };
        // Small: not held.
        let small = hold_answer(&b, answer(ANSWER_UNCOUNTED_MAX)).await;
        assert_eq!(b.room(), 200 * 1024);
        drop(small);
        let large = hold_answer(&b, answer(150 * 1024)).await;
        assert_eq!(b.room(), 50 * 1024);
        let refused = hold_answer(&b, answer(100 * 1024)).await;
        assert_eq!(refused.status(), http::StatusCode::SERVICE_UNAVAILABLE);
        assert_eq!(refused.headers()["x-forkless-shard"], "3");
        assert!(
            !refused.headers().contains_key("x-forkless-node"),
            "the node that refused stamps its own"
        );
        let body = axum::body::to_bytes(refused.into_body(), usize::MAX)
            .await
            .unwrap();
        assert!(
            String::from_utf8_lossy(&body).contains("too_many_answer_bytes"),
            "{body:?}"
        );
        // The hold goes with the last copy of the answer's bytes.
        let bytes = axum::body::to_bytes(large.into_body(), usize::MAX)
            .await
            .unwrap();
        let tail = bytes.slice(100..200);
        drop(bytes);
        assert_eq!(b.room(), 50 * 1024, "a slice of it still holds");
        drop(tail);
        assert_eq!(b.room(), 200 * 1024);
        // Larger than the whole budget: taken alone, refused beside another.
        let huge = hold_answer(&b, answer(300 * 1024)).await;
        assert_eq!(huge.status(), http::StatusCode::OK);
        assert_eq!(b.room(), 0);
        drop(huge);
        let other = hold_answer(&b, answer(100 * 1024)).await;
        let refused = hold_answer(&b, answer(300 * 1024)).await;
        assert_eq!(refused.status(), http::StatusCode::SERVICE_UNAVAILABLE);
        drop(other);
        assert_eq!(b.room(), 200 * 1024);
    }
}
