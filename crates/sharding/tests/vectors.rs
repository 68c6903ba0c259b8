//! Pins the partition table to vectors made by an independent implementation
//! (Python's `xxhash` package, see `make_vectors.py`). If this test fails, the
//! mapping from ids to partitions changed and every stored execution would
//! move: do not "fix" the vectors.

use forkless_sharding::{
    hash_id, hash_key, partition_for, partition_for_key, shard_for, shard_for_key, ShardCount,
};
use serde_json::Value;

fn check_row(row: &Value, hash: u64, partition: u32, shard: impl Fn(ShardCount) -> u32) {
    assert_eq!(row["hash"].as_str().unwrap(), hash.to_string(), "{row}");
    assert_eq!(
        row["partition"].as_u64().unwrap(),
        partition as u64,
        "{row}"
    );
    let shards = row["shards"].as_object().unwrap();
    assert_eq!(shards.len(), 13);
    for (n, s) in shards {
        let count = ShardCount::new(n.parse().unwrap()).unwrap();
        assert_eq!(s.as_u64().unwrap(), shard(count) as u64, "n={n} {row}");
    }
}

#[test]
fn ids_match_independent_vectors() {
    let v: Value = serde_json::from_str(include_str!("vectors.json")).unwrap();
    let ids = v["ids"].as_array().unwrap();
    assert!(ids.len() >= 20);
    for row in ids {
        let id: i64 = row["id"].as_str().unwrap().parse().unwrap();
        check_row(row, hash_id(id), partition_for(id), |n| shard_for(id, n));
    }
}

#[test]
fn keys_match_independent_vectors() {
    let v: Value = serde_json::from_str(include_str!("vectors.json")).unwrap();
    let keys = v["keys"].as_array().unwrap();
    assert!(keys.len() >= 7);
    for row in keys {
        let key = row["key"].as_str().unwrap();
        check_row(row, hash_key(key), partition_for_key(key), |n| {
            shard_for_key(key, n)
        });
    }
}
