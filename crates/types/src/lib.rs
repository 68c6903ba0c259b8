//! Identities shared by every forkless crate, each a newtype whose
//! constructor enforces its invariant, and the execution id minter.

pub mod id;

pub use forkless_sharding::{ShardCount, PARTITION_COUNT};
pub use id::{IdMinter, MintError};

use std::fmt;
use std::str::FromStr;

/// An execution id: a positive `i64`, minted by the server. In JSON it is
/// always a decimal string, because JavaScript loses integers above 2^53.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct ExecutionId(i64);

/// Why a string is not an execution id.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum BadExecutionId {
    #[error("must be a positive decimal integer that fits in 63 bits, got {0:?}")]
    NotANumber(String),
    #[error("must be positive, got {0}")]
    NotPositive(i64),
}

impl ExecutionId {
    pub fn new(raw: i64) -> Result<ExecutionId, BadExecutionId> {
        if raw > 0 {
            Ok(ExecutionId(raw))
        } else {
            Err(BadExecutionId::NotPositive(raw))
        }
    }

    pub fn get(self) -> i64 {
        self.0
    }

    pub fn partition(self) -> PartitionId {
        PartitionId(forkless_sharding::partition_for(self.0))
    }

    pub fn shard(self, n: ShardCount) -> ShardId {
        ShardId(forkless_sharding::shard_for(self.0, n))
    }
}

impl FromStr for ExecutionId {
    type Err = BadExecutionId;
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        // Only plain ASCII digits: no sign, no whitespace, no leading '+'.
        if s.is_empty() || s.len() > 19 || !s.bytes().all(|b| b.is_ascii_digit()) {
            return Err(BadExecutionId::NotANumber(truncate(s, 40)));
        }
        let raw: i64 = s
            .parse()
            .map_err(|_| BadExecutionId::NotANumber(truncate(s, 40)))?;
        ExecutionId::new(raw)
    }
}

fn truncate(s: &str, max: usize) -> String {
    s.chars().take(max).collect()
}

impl fmt::Display for ExecutionId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        self.0.fmt(f)
    }
}

/// One of the 4096 fixed partitions.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct PartitionId(u32);

impl PartitionId {
    pub fn new(p: u32) -> Option<PartitionId> {
        (p < PARTITION_COUNT).then_some(PartitionId(p))
    }
    pub fn for_key(key: &str) -> PartitionId {
        PartitionId(forkless_sharding::partition_for_key(key))
    }
    pub fn get(self) -> u32 {
        self.0
    }
    pub fn shard(self, n: ShardCount) -> ShardId {
        ShardId(forkless_sharding::shard_for_partition(self.0, n))
    }
}

impl fmt::Display for PartitionId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        self.0.fmt(f)
    }
}

/// A shard index, `0..shard_count`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct ShardId(pub u32);

impl ShardId {
    pub fn get(self) -> u32 {
        self.0
    }
}

impl fmt::Display for ShardId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        self.0.fmt(f)
    }
}

/// A node id. Ten bits of it go into every id the node mints, so it is
/// limited to `0..=MAX_NODE_ID`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct NodeId(u16);

impl NodeId {
    pub const MAX: u16 = (1 << id::NODE_BITS) - 1;

    pub fn new(n: u64) -> Option<NodeId> {
        (n <= Self::MAX as u64).then_some(NodeId(n as u16))
    }
    pub fn get(self) -> u16 {
        self.0
    }
}

impl fmt::Display for NodeId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        self.0.fmt(f)
    }
}

/// The ownership epoch of a shard: grows every time its owner changes. Every
/// write carries the writer's epoch, and the store refuses a stale one.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct Epoch(pub u64);

impl Epoch {
    pub fn get(self) -> u64 {
        self.0
    }
}

impl fmt::Display for Epoch {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        self.0.fmt(f)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn execution_id_parsing() {
        let check = |s: &str, ok: Option<i64>| {
            assert_eq!(s.parse::<ExecutionId>().ok().map(|i| i.get()), ok, "{s:?}");
        };
        check("1", Some(1));
        check("9223372036854775807", Some(i64::MAX));
        check("9223372036854775808", None);
        check("0", None);
        check("-1", None);
        check("+1", None);
        check(" 1", None);
        check("1e3", None);
        check("", None);
        check("abc", None);
        check("00000000000000000001", None);
    }
}
