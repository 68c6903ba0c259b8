//! The partition table: maps execution ids and routing keys to one of
//! [`PARTITION_COUNT`] fixed partitions, and partitions to shards.
//!
//! Everything here is a pure function of its arguments. The hash function
//! (XxHash64), its seed (0), the byte order of an id (8 little-endian bytes)
//! and the partition count (4096) are part of the on-disk and on-the-wire
//! contract: every stored key is prefixed by its partition, and every node
//! must agree on where an execution lives. Changing any of them would silently
//! move every execution to another shard, so they are pinned by test vectors
//! produced by an independent implementation (`tests/vectors.json`, made by
//! `tests/make_vectors.py`).
//!
//! Because 4096 is a power of two, `(h % 4096) % n == h % n` for every legal
//! shard count `n` (a power of two that divides 4096): a deployment that used
//! `xxhash64 % n` adopts this table without moving any data.

use xxhash_rust::xxh64::xxh64;

/// The fixed number of partitions. Never changes.
pub const PARTITION_COUNT: u32 = 4096;

/// The seed of the partition hash. Never changes.
pub const HASH_SEED: u64 = 0;

/// The largest legal shard count (one partition per shard).
pub const MAX_SHARD_COUNT: u32 = PARTITION_COUNT;

/// A shard count that is not a power of two between 1 and 4096.
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
#[error(
    "shard count {0} is not legal: it must be a power of two from 1 to 4096 \
     (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 2048 or 4096) so that it divides \
     the 4096 partitions"
)]
pub struct IllegalShardCount(pub u64);

/// A validated shard count: a power of two from 1 to 4096.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct ShardCount(u32);

impl ShardCount {
    /// One shard: the embedded default, where routing is inert.
    pub const ONE: ShardCount = ShardCount(1);

    /// Validates `n`; any count that does not divide 4096 is refused.
    pub fn new(n: u64) -> Result<ShardCount, IllegalShardCount> {
        if partition_compatible(n) {
            Ok(ShardCount(n as u32))
        } else {
            Err(IllegalShardCount(n))
        }
    }

    pub fn get(self) -> u32 {
        self.0
    }
}

impl std::fmt::Display for ShardCount {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        self.0.fmt(f)
    }
}

/// True exactly for the powers of two from 1 to 4096.
pub fn partition_compatible(n: u64) -> bool {
    n >= 1 && n <= PARTITION_COUNT as u64 && n.is_power_of_two()
}

/// The raw 64-bit hash of an execution id: XxHash64, seed 0, over the id's
/// 8 little-endian bytes.
pub fn hash_id(id: i64) -> u64 {
    xxh64(&id.to_le_bytes(), HASH_SEED)
}

/// The raw 64-bit hash of a routing key: XxHash64, seed 0, over its UTF-8 bytes.
pub fn hash_key(key: &str) -> u64 {
    xxh64(key.as_bytes(), HASH_SEED)
}

/// The partition of an execution id.
pub fn partition_for(id: i64) -> u32 {
    (hash_id(id) % PARTITION_COUNT as u64) as u32
}

/// The partition of a routing key.
pub fn partition_for_key(key: &str) -> u32 {
    (hash_key(key) % PARTITION_COUNT as u64) as u32
}

/// The shard that holds partition `p` when there are `n` shards.
pub fn shard_for_partition(p: u32, n: ShardCount) -> u32 {
    debug_assert!(p < PARTITION_COUNT);
    p % n.get()
}

/// The shard of an execution id when there are `n` shards.
pub fn shard_for(id: i64, n: ShardCount) -> u32 {
    shard_for_partition(partition_for(id), n)
}

/// The shard of a routing key when there are `n` shards.
pub fn shard_for_key(key: &str, n: ShardCount) -> u32 {
    shard_for_partition(partition_for_key(key), n)
}

/// The partitions that shard `s` holds when there are `n` shards, in order.
pub fn partitions_of_shard(s: u32, n: ShardCount) -> impl Iterator<Item = u32> {
    debug_assert!(s < n.get());
    (s..PARTITION_COUNT).step_by(n.get() as usize)
}

#[cfg(test)]
mod tests {
    use super::*;

    const LEGAL: [u32; 13] = [1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096];

    #[test]
    fn legal_counts_are_exactly_the_powers_of_two_up_to_4096() {
        for n in 0..=10_000u64 {
            assert_eq!(
                partition_compatible(n),
                LEGAL.contains(&(n as u32)) && n <= 4096,
                "n = {n}"
            );
        }
        assert!(!partition_compatible(8192));
        assert!(!partition_compatible(u64::MAX));
        let err = ShardCount::new(3).unwrap_err();
        assert!(err.to_string().contains("power of two from 1 to 4096"));
    }

    #[test]
    fn two_level_mapping_equals_hash_mod_n_for_every_legal_count() {
        let ids = (-2000i64..2000)
            .chain([i64::MIN, i64::MIN + 1, i64::MAX, i64::MAX - 1, 0])
            .chain((0..2000).map(|i| (1i64 << 40) * 7 + i * 4_194_304 + 17));
        for id in ids {
            for n in LEGAL {
                let count = ShardCount::new(n as u64).unwrap();
                assert_eq!(
                    shard_for(id, count) as u64,
                    hash_id(id) % n as u64,
                    "id {id} n {n}"
                );
            }
        }
    }

    #[test]
    fn partitions_of_shard_cover_every_partition_once() {
        for n in LEGAL {
            let count = ShardCount::new(n as u64).unwrap();
            let mut seen = vec![false; PARTITION_COUNT as usize];
            for s in 0..n {
                for p in partitions_of_shard(s, count) {
                    assert_eq!(shard_for_partition(p, count), s);
                    assert!(!seen[p as usize]);
                    seen[p as usize] = true;
                }
            }
            assert!(seen.iter().all(|x| *x));
        }
    }

    #[test]
    fn sequential_snowflake_ids_spread_evenly() {
        // 409,600 consecutive snowflake-shaped ids (time | node | sequence):
        // every partition should get close to 100.
        let mut counts = vec![0u32; PARTITION_COUNT as usize];
        let base_ms: i64 = 60_000_000_000;
        let mut total = 0;
        for ms in 0..100i64 {
            for seq in 0..4096i64 {
                let id = ((base_ms + ms) << 22) | (3 << 12) | seq;
                counts[partition_for(id) as usize] += 1;
                total += 1;
            }
        }
        let mean = total as f64 / PARTITION_COUNT as f64;
        let chi2: f64 = counts
            .iter()
            .map(|c| {
                let d = *c as f64 - mean;
                d * d / mean
            })
            .sum();
        // 4095 degrees of freedom: mean 4095, sd ~90. 4600 is > 5 sd.
        assert!(chi2 < 4600.0, "chi2 {chi2}");
        let (min, max) = (counts.iter().min().unwrap(), counts.iter().max().unwrap());
        assert!(*min > 50 && *max < 160, "min {min} max {max}");
        // And shards at n = 16 are within 3% of each other.
        let n = ShardCount::new(16).unwrap();
        let mut shards = [0u32; 16];
        for (p, c) in counts.iter().enumerate() {
            shards[shard_for_partition(p as u32, n) as usize] += c;
        }
        let smean = total as f64 / 16.0;
        for s in shards {
            assert!((s as f64 - smean).abs() / smean < 0.03, "{shards:?}");
        }
    }

    proptest::proptest! {
        #[test]
        fn any_id_maps_inside_the_table(id in proptest::prelude::any::<i64>(), exp in 0u32..13) {
            let n = ShardCount::new(1u64 << exp).unwrap();
            let p = partition_for(id);
            proptest::prop_assert!(p < PARTITION_COUNT);
            proptest::prop_assert!(shard_for(id, n) < n.get());
            proptest::prop_assert_eq!(shard_for(id, n) as u64, hash_id(id) % n.get() as u64);
        }
    }
}
