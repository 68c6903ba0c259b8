//! The writer's cache of execution metadata (a leaf: it knows the
//! metadata type and the store's hash map, nothing else).

use crate::machine::HashMap;
use crate::ExecutionMeta;
use forkless_types::ExecutionId;

/// Entries in each of the metadata cache's two generations (about 200
/// bytes an entry, so the cache stays under ~13 MiB a shard).
pub(crate) const META_CACHE_GENERATION_ENTRIES: usize = 32_768;

/// The writer's cache of execution metadata, bounded by two generations:
/// writes go to the young one; when it is full it becomes the old one and
/// the previous old one is dropped. An execution written at least once per
/// generation (`per_generation` writes of other executions) therefore never
/// leaves it, and a full cache never goes cold at once: a lookup that
/// misses the young generation still finds what the old one has.
pub(crate) struct MetaCache {
    young: HashMap<ExecutionId, ExecutionMeta>,
    old: HashMap<ExecutionId, ExecutionMeta>,
    per_generation: usize,
}

impl MetaCache {
    pub(crate) fn new(per_generation: usize) -> Self {
        Self {
            young: HashMap::default(),
            old: HashMap::default(),
            per_generation: per_generation.max(1),
        }
    }

    pub(crate) fn get(&self, id: &ExecutionId) -> Option<&ExecutionMeta> {
        self.young.get(id).or_else(|| self.old.get(id))
    }

    /// Records what a commit wrote (never before the commit succeeded).
    pub(crate) fn extend(&mut self, metas: impl IntoIterator<Item = (ExecutionId, ExecutionMeta)>) {
        for (id, meta) in metas {
            if self.young.len() >= self.per_generation {
                // The old generation's table becomes the young one, emptied
                // but keeping its capacity: no regrowing on the writer's
                // path every generation.
                std::mem::swap(&mut self.old, &mut self.young);
                self.young.clear();
            }
            // A stale copy in the old generation is shadowed by this one
            // and dropped with the old generation at the next rotation.
            self.young.insert(id, meta);
        }
    }

    /// Forgets everything (the shard's state was replaced).
    pub(crate) fn clear(&mut self) {
        self.young.clear();
        self.old.clear();
    }

    #[cfg(test)]
    fn len(&self) -> usize {
        self.young.len() + self.old.len()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::ExecutionStatus;

    fn id(n: u64) -> ExecutionId {
        ExecutionId::new(n as i64 + 1).expect("a valid execution id")
    }

    fn meta(n: u64, last_seq: u64) -> (ExecutionId, ExecutionMeta) {
        let id = id(n);
        (
            id,
            ExecutionMeta {
                id,
                status: ExecutionStatus::Running,
                last_seq,
                created_at_ms: 1,
                updated_at_ms: 1,
                workflow: "w".into(),
                routing_key: None,
            },
        )
    }

    #[test]
    fn meta_cache_is_bounded_by_two_generations() {
        let mut c = MetaCache::new(100);
        for i in 0..10_000 {
            c.extend([meta(i, 1)]);
            assert!(c.len() <= 200, "{} entries after {i} writes", c.len());
        }
        // The last generation and the one before it are still there...
        assert!(c.get(&id(9_999)).is_some());
        assert!(c.get(&id(9_850)).is_some());
        // ...and nothing older.
        assert!(c.get(&id(9_000)).is_none());
    }

    #[test]
    fn meta_cache_keeps_an_execution_written_once_a_generation() {
        let mut c = MetaCache::new(100);
        for round in 0..50u64 {
            c.extend([meta(1, round + 1)]);
            // 99 writes of other executions: less than a generation.
            for i in 0..99 {
                c.extend([meta(1_000 + round * 100 + i, 1)]);
            }
            assert_eq!(c.get(&id(1)).map(|m| m.last_seq), Some(round + 1));
        }
    }

    #[test]
    fn meta_cache_answers_the_newest_state_across_rotations() {
        let mut c = MetaCache::new(3);
        c.extend([meta(7, 1), meta(8, 1), meta(9, 1)]);
        // 7 is rewritten in the next generation; its old copy is shadowed.
        c.extend([meta(7, 2)]);
        assert_eq!(c.get(&id(7)).map(|m| m.last_seq), Some(2));
        c.extend([meta(10, 1), meta(11, 1)]);
        assert_eq!(c.get(&id(7)).map(|m| m.last_seq), Some(2));
        // Another rotation drops the generation that had 7 at seq 1 and
        // moves the one with seq 2 to old: still the newest.
        c.extend([meta(12, 1)]);
        assert_eq!(c.get(&id(7)).map(|m| m.last_seq), Some(2));
        assert!(c.get(&id(8)).is_none());
    }
}
