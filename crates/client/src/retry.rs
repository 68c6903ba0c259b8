//! When a failed request may be sent again, and after how long. Pure: no
//! clock, no socket, so the whole table is unit-tested.

use crate::error::Executed;
use std::time::Duration;

/// Bounds on retrying `503 owner_unavailable` and unreachable nodes.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RetryPolicy {
    /// Most attempts in all, the first included (1 = never retry).
    pub max_attempts: u32,
    /// No retry starts later than this after the first attempt.
    pub max_elapsed: Duration,
    /// Wait before the first retry; doubles each time.
    pub initial_backoff: Duration,
    /// Longest backoff (a server's `Retry-After` may still ask for more).
    pub max_backoff: Duration,
}

impl Default for RetryPolicy {
    fn default() -> Self {
        RetryPolicy {
            max_attempts: 6,
            max_elapsed: Duration::from_secs(15),
            initial_backoff: Duration::from_millis(100),
            max_backoff: Duration::from_secs(2),
        }
    }
}

/// What went wrong with one attempt, as far as retrying is concerned.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Failure {
    pub executed: Executed,
    /// The request is safe to repeat: a read, or a write carrying
    /// idempotency keys.
    pub idempotent: bool,
    /// The server's `Retry-After`.
    pub retry_after: Option<Duration>,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Decision {
    /// Wait this long, then send again.
    Retry(Duration),
    /// The request may have been applied and repeating it could apply it
    /// twice.
    Unsafe,
    /// Out of attempts or time.
    Exhausted,
}

impl RetryPolicy {
    /// Never retry.
    pub fn none() -> RetryPolicy {
        RetryPolicy {
            max_attempts: 1,
            ..RetryPolicy::default()
        }
    }

    /// The backoff before retry number `retry` (1-based), without
    /// `Retry-After`.
    pub fn backoff(&self, retry: u32) -> Duration {
        let shift = retry.saturating_sub(1).min(20);
        self.initial_backoff
            .saturating_mul(1u32 << shift)
            .min(self.max_backoff)
    }

    /// Whether to retry after `attempts` attempts (the failed one included)
    /// have taken `elapsed`.
    pub fn decide(&self, f: Failure, attempts: u32, elapsed: Duration) -> Decision {
        if f.executed == Executed::Unknown && !f.idempotent {
            return Decision::Unsafe;
        }
        if attempts >= self.max_attempts {
            return Decision::Exhausted;
        }
        let wait = self
            .backoff(attempts)
            .max(f.retry_after.unwrap_or(Duration::ZERO));
        if elapsed.saturating_add(wait) > self.max_elapsed {
            return Decision::Exhausted;
        }
        Decision::Retry(wait)
    }
}

/// Parses `Retry-After` in its delay-seconds form; an HTTP date or garbage
/// is ignored (the backoff still applies).
pub fn parse_retry_after(v: &str) -> Option<Duration> {
    v.trim()
        .parse::<u64>()
        .ok()
        .map(|s| Duration::from_secs(s.min(3600)))
}

#[cfg(test)]
mod tests {
    use super::*;

    const NO: Failure = Failure {
        executed: Executed::No,
        idempotent: false,
        retry_after: None,
    };

    #[test]
    fn executed_unknown_is_retried_only_when_idempotent() {
        let p = RetryPolicy::default();
        let unknown = Failure {
            executed: Executed::Unknown,
            ..NO
        };
        assert_eq!(p.decide(unknown, 1, Duration::ZERO), Decision::Unsafe);
        let idem = Failure {
            idempotent: true,
            ..unknown
        };
        assert!(matches!(
            p.decide(idem, 1, Duration::ZERO),
            Decision::Retry(_)
        ));
        // Not executed is always safe to repeat.
        assert!(matches!(
            p.decide(NO, 1, Duration::ZERO),
            Decision::Retry(_)
        ));
    }

    #[test]
    fn backoff_doubles_up_to_the_cap() {
        let p = RetryPolicy::default();
        assert_eq!(p.backoff(1), Duration::from_millis(100));
        assert_eq!(p.backoff(2), Duration::from_millis(200));
        assert_eq!(p.backoff(3), Duration::from_millis(400));
        assert_eq!(p.backoff(10), Duration::from_secs(2));
        assert_eq!(p.backoff(u32::MAX), Duration::from_secs(2));
    }

    #[test]
    fn retry_after_is_a_floor() {
        let p = RetryPolicy::default();
        let f = Failure {
            retry_after: Some(Duration::from_secs(1)),
            ..NO
        };
        assert_eq!(
            p.decide(f, 1, Duration::ZERO),
            Decision::Retry(Duration::from_secs(1))
        );
        let f = Failure {
            retry_after: Some(Duration::from_millis(10)),
            ..NO
        };
        assert_eq!(
            p.decide(f, 3, Duration::ZERO),
            Decision::Retry(Duration::from_millis(400))
        );
    }

    #[test]
    fn attempts_and_time_are_bounded() {
        let p = RetryPolicy {
            max_attempts: 3,
            max_elapsed: Duration::from_secs(2),
            ..RetryPolicy::default()
        };
        assert!(matches!(
            p.decide(NO, 2, Duration::ZERO),
            Decision::Retry(_)
        ));
        assert_eq!(p.decide(NO, 3, Duration::ZERO), Decision::Exhausted);
        // A wait that would end past max_elapsed is not started.
        let f = Failure {
            retry_after: Some(Duration::from_secs(1)),
            ..NO
        };
        assert_eq!(
            p.decide(f, 1, Duration::from_millis(1500)),
            Decision::Exhausted
        );
        assert_eq!(
            RetryPolicy::none().decide(NO, 1, Duration::ZERO),
            Decision::Exhausted
        );
    }

    #[test]
    fn retry_after_parsing() {
        assert_eq!(parse_retry_after("1"), Some(Duration::from_secs(1)));
        assert_eq!(parse_retry_after(" 30 "), Some(Duration::from_secs(30)));
        assert_eq!(
            parse_retry_after("999999999"),
            Some(Duration::from_secs(3600))
        );
        assert_eq!(parse_retry_after("Wed, 21 Oct 2015 07:28:00 GMT"), None);
        assert_eq!(parse_retry_after("-1"), None);
    }
}
