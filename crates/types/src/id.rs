//! Snowflake-style execution ids: `ms since 2025-01-01 (41 bits) | node (10
//! bits) | sequence (12 bits)`, always positive.
//!
//! Uniqueness across restarts comes from time moving forward; the store also
//! refuses to create an execution whose id already exists, so a clock that
//! jumps back cannot make two executions share an id (the caller re-mints).

use crate::{ExecutionId, NodeId, ShardCount, ShardId};

pub const NODE_BITS: u32 = 10;
pub const SEQUENCE_BITS: u32 = 12;
/// 2025-01-01T00:00:00Z in Unix milliseconds.
pub const ID_EPOCH_UNIX_MS: u64 = 1_735_689_600_000;
/// Re-mint attempts allowed per shard of the cluster when looking for an id
/// on a wanted shard. With `n` shards and `k` wanted, `16 * n` attempts fail
/// with probability about `e^(-16 k)`.
pub const MINT_ATTEMPTS_PER_SHARD: u32 = 16;

/// No id was found on a wanted shard within the attempt budget.
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
#[error("no id landed on a wanted shard after {attempts} attempts")]
pub struct MintError {
    pub attempts: u32,
}

/// Mints execution ids for one node. Thread-safe; the clock is injected so
/// tests can drive it.
pub struct IdMinter {
    node: NodeId,
    /// The last value handed out, as `ms << 12 | seq` (node bits excluded).
    last: std::sync::Mutex<u64>,
    clock: Box<dyn Fn() -> u64 + Send + Sync>,
}

impl IdMinter {
    pub fn new(node: NodeId) -> IdMinter {
        IdMinter::with_clock(node, Box::new(unix_ms))
    }

    pub fn with_clock(node: NodeId, clock: Box<dyn Fn() -> u64 + Send + Sync>) -> IdMinter {
        IdMinter {
            node,
            last: std::sync::Mutex::new(0),
            clock,
        }
    }

    /// A fresh id, greater than every id this minter handed out before.
    pub fn mint(&self) -> ExecutionId {
        let now_ms = (self.clock)().saturating_sub(ID_EPOCH_UNIX_MS);
        let mut last = self.last.lock().unwrap_or_else(|e| e.into_inner());
        // When the sequence of this millisecond runs out, borrow from the
        // next one: ids stay unique and increasing even if the clock stalls
        // or steps back.
        let candidate = (now_ms << SEQUENCE_BITS).max(*last + 1);
        *last = candidate;
        let ms = candidate >> SEQUENCE_BITS;
        let seq = candidate & ((1 << SEQUENCE_BITS) - 1);
        let raw =
            (ms << (NODE_BITS + SEQUENCE_BITS)) | ((self.node.get() as u64) << SEQUENCE_BITS) | seq;
        // 41 bits of milliseconds last until 2094; past that the top bit
        // would make the id negative.
        let raw = (raw & (i64::MAX as u64)).max(1);
        ExecutionId::new(raw as i64).expect("masked to 63 bits and at least 1")
    }

    /// Mints until the id lands on a shard for which `wanted` is true,
    /// at most `MINT_ATTEMPTS_PER_SHARD * n` times.
    pub fn mint_on(
        &self,
        n: ShardCount,
        wanted: impl Fn(ShardId) -> bool,
    ) -> Result<ExecutionId, MintError> {
        let attempts = MINT_ATTEMPTS_PER_SHARD * n.get();
        for _ in 0..attempts {
            let id = self.mint();
            if wanted(id.shard(n)) {
                return Ok(id);
            }
        }
        Err(MintError { attempts })
    }

    pub fn node(&self) -> NodeId {
        self.node
    }
}

fn unix_ms() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_millis() as u64)
        .unwrap_or(0)
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::atomic::{AtomicU64, Ordering};
    use std::sync::Arc;

    #[test]
    fn ids_are_positive_unique_and_increasing_even_when_the_clock_steps_back() {
        let t = Arc::new(AtomicU64::new(ID_EPOCH_UNIX_MS + 1_000_000));
        let t2 = t.clone();
        let m = IdMinter::with_clock(
            NodeId::new(1023).unwrap(),
            Box::new(move || t2.load(Ordering::SeqCst)),
        );
        let mut prev = 0;
        for i in 0..20_000u64 {
            if i == 10_000 {
                t.fetch_sub(5_000, Ordering::SeqCst);
            }
            let id = m.mint().get();
            assert!(id > prev, "{id} after {prev}");
            assert_eq!((id >> SEQUENCE_BITS) & 1023, 1023);
            prev = id;
        }
    }

    #[test]
    fn mint_on_lands_on_the_wanted_shard() {
        let m = IdMinter::new(NodeId::new(3).unwrap());
        for n in [1u64, 2, 16, 256, 4096] {
            let n = ShardCount::new(n).unwrap();
            let want = ShardId(n.get() - 1);
            let id = m.mint_on(n, |s| s == want).unwrap();
            assert_eq!(id.shard(n), want);
        }
        let err = m
            .mint_on(ShardCount::new(4).unwrap(), |_| false)
            .unwrap_err();
        assert_eq!(err.attempts, 64);
    }
}
