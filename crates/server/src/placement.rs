//! The placement a replicated cluster's groups were made with: recorded in
//! each node's data directory at its first start, and checked against the
//! cluster file at every start after.
//!
//! A shard's replicas as the cluster file places them are its group's
//! first membership: a replica that finds its group new initializes it
//! with them, on every replica alike. Left unpinned, the placement is a
//! spread over the node list, so a node added to the file moves it; a node
//! restarted on such a file would then open replicas of shards it never
//! held, new and empty, and initialize them with a membership the running
//! group never had. Two such new replicas of one shard are a quorum of
//! their own three and elect a leader: a second group for the shard, a
//! fork. So a node refuses to start when the file places any shard
//! elsewhere than the recorded placement, and a node without a record
//! (a new node, a lost disk) first asks its peers for theirs. The way to
//! add a node is to pin the running placement in the file first
//! (`[[placement]]`; `forkless cluster placement` prints it).

use crate::config::Replicated;
use forkless_types::{ShardCount, ShardId};
use serde::{Deserialize, Serialize};
use std::collections::BTreeSet;
use std::path::{Path, PathBuf};

pub const PLACEMENT_FILE: &str = "placement.json";

/// Each shard's replicas (node ids, in the file's order: the first is the
/// shard's stand-in owner until a leader is elected).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Placement {
    pub shard_count: u32,
    pub replicas: Vec<Vec<u64>>,
}

/// One shard placed differently: by the cluster file, and by the record.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Moved {
    pub shard: u32,
    pub file: Vec<u64>,
    pub recorded: Vec<u64>,
}

impl Placement {
    /// The placement the cluster file gives.
    pub fn of(r: &Replicated, shards: ShardCount) -> Placement {
        Placement {
            shard_count: shards.get(),
            replicas: (0..shards.get())
                .map(|s| {
                    r.replicas(ShardId(s))
                        .iter()
                        .map(|n| u64::from(n.get()))
                        .collect()
                })
                .collect(),
        }
    }

    /// The shards `self` (the file's) places on other nodes than
    /// `recorded` does (as sets: the order names no more than the
    /// stand-in owner). A different shard count moves every shard.
    pub fn moved_from(&self, recorded: &Placement) -> Vec<Moved> {
        let set = |v: &[u64]| v.iter().copied().collect::<BTreeSet<u64>>();
        let n = self.replicas.len().max(recorded.replicas.len());
        (0..n)
            .filter_map(|s| {
                let file = self.replicas.get(s).cloned().unwrap_or_default();
                let rec = recorded.replicas.get(s).cloned().unwrap_or_default();
                (self.shard_count != recorded.shard_count || set(&file) != set(&rec)).then_some(
                    Moved {
                        shard: s as u32,
                        file,
                        recorded: rec,
                    },
                )
            })
            .collect()
    }

    /// A fingerprint of the placement as sets (the order of a shard's
    /// replicas is not part of it, as it is not of [`Placement::moved_from`]),
    /// said at every Raft connection's hello: a peer whose fingerprint
    /// differs is refused, so a node that skipped the start-up check (its
    /// record deleted by hand; every peer down when it started without
    /// one) cannot take part in a group made with another membership.
    /// FNV-1a over the shard count and each shard's sorted node ids: stable
    /// across builds and machines, which a `Hasher` of std is not.
    pub fn fingerprint(&self) -> u64 {
        const PRIME: u64 = 0x0000_0100_0000_01b3;
        let mut h: u64 = 0xcbf2_9ce4_8422_2325;
        let mut eat = |x: u64| {
            for b in x.to_le_bytes() {
                h ^= u64::from(b);
                h = h.wrapping_mul(PRIME);
            }
        };
        eat(u64::from(self.shard_count));
        for replicas in &self.replicas {
            let mut sorted = replicas.clone();
            sorted.sort_unstable();
            eat(sorted.len() as u64);
            sorted.into_iter().for_each(&mut eat);
        }
        h
    }

    /// The placement as `[[placement]]` entries of a cluster file.
    pub fn to_toml(&self) -> String {
        let mut s = String::new();
        for (shard, replicas) in self.replicas.iter().enumerate() {
            let ids: Vec<String> = replicas.iter().map(u64::to_string).collect();
            s.push_str(&format!(
                "[[placement]]\nshard = {shard}\nreplicas = [{}]\n\n",
                ids.join(", ")
            ));
        }
        s
    }
}

pub fn path(data_dir: &Path) -> PathBuf {
    data_dir.join(PLACEMENT_FILE)
}

/// The recorded placement, if this data directory has one.
pub fn read(data_dir: &Path) -> Result<Option<Placement>, String> {
    let p = path(data_dir);
    match std::fs::read(&p) {
        Ok(bytes) => serde_json::from_slice(&bytes)
            .map(Some)
            .map_err(|e| format!("{}: unreadable placement record: {e}", p.display())),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(None),
        Err(e) => Err(format!("{}: {e}", p.display())),
    }
}

/// Records `placement` durably (written whole, then renamed into place).
pub fn record(data_dir: &Path, placement: &Placement) -> Result<(), String> {
    std::fs::create_dir_all(data_dir).map_err(|e| format!("{}: {e}", data_dir.display()))?;
    let bytes = serde_json::to_vec_pretty(placement).map_err(|e| e.to_string())?;
    forkless_store::write_file_durably(&path(data_dir), &bytes).map_err(|e| e.to_string())
}

/// Why a start on `file` is refused, if it is: another shard count than
/// `recorded`'s (a resize), or shards moved off the placement as `source`
/// has it.
pub fn refused(file: &Placement, recorded: &Placement, source: &str) -> Option<String> {
    if file.shard_count != recorded.shard_count {
        return Some(format!(
            "placement: the cluster file has {} shard(s), and this cluster's Raft groups were made with {}, as {source} \
             has them: changing shard_count is a resize, not a restart",
            file.shard_count, recorded.shard_count
        ));
    }
    let moved = file.moved_from(recorded);
    (!moved.is_empty()).then(|| refusal(&moved, source))
}

/// Why a start is refused: the file moves `moved` (the first few named)
/// off the placement as `source` has it.
pub fn refusal(moved: &[Moved], source: &str) -> String {
    const NAMED: usize = 8;
    let list: Vec<String> = moved
        .iter()
        .take(NAMED)
        .map(|m| format!("shard {} on {:?}, not {:?}", m.shard, m.file, m.recorded))
        .collect();
    let more = match moved.len().saturating_sub(NAMED) {
        0 => String::new(),
        k => format!(" and {k} more"),
    };
    format!(
        "placement: the cluster file moves {} shard(s) off the replicas their Raft groups were made with, as {source} \
         has them ({}{more}); a group's first membership must not change (the spread moves when a node is added to \
         the file, and a moved shard would get a second, empty group that could elect its own leader). Pin the \
         placement the cluster runs with in the cluster file: `forkless cluster placement --server <a running node>` \
         prints it as [[placement]] entries",
        moved.len(),
        list.join("; ")
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    fn p(shards: &[&[u64]]) -> Placement {
        Placement {
            shard_count: shards.len() as u32,
            replicas: shards.iter().map(|s| s.to_vec()).collect(),
        }
    }

    #[test]
    fn a_placement_moved_is_found_shard_by_shard_and_order_is_not_a_move() {
        let recorded = p(&[&[1, 2, 3], &[2, 3, 4], &[3, 4, 1], &[4, 1, 2]]);
        assert!(recorded.moved_from(&recorded).is_empty());
        // Only the order differs: the same members.
        assert!(p(&[&[2, 1, 3], &[2, 3, 4], &[1, 3, 4], &[4, 1, 2]])
            .moved_from(&recorded)
            .is_empty());
        // Node 5 added to the file, the spread recomputed.
        let spread = p(&[&[1, 2, 3], &[2, 3, 4], &[3, 4, 5], &[4, 5, 1]]);
        assert_eq!(
            spread.moved_from(&recorded),
            vec![
                Moved {
                    shard: 2,
                    file: vec![3, 4, 5],
                    recorded: vec![3, 4, 1]
                },
                Moved {
                    shard: 3,
                    file: vec![4, 5, 1],
                    recorded: vec![4, 1, 2]
                },
            ]
        );
        // Another shard count moves them all, and is named as a resize.
        let one: &[u64] = &[1, 2, 3];
        let eight = p(&[one; 8]);
        assert_eq!(eight.moved_from(&recorded).len(), 8);
        let resize = refused(&eight, &recorded, "node 2").unwrap_or_default();
        assert!(
            resize.contains("has 8 shard(s)")
                && resize.contains("made with 4")
                && resize.contains("a resize"),
            "{resize}"
        );
        assert_eq!(refused(&recorded, &recorded, "node 2"), None);
        let why = refusal(&spread.moved_from(&recorded), "this node");
        assert!(
            why.contains("moves 2 shard(s)") && why.contains("shard 2 on [3, 4, 5], not [3, 4, 1]"),
            "{why}"
        );
    }

    #[test]
    fn the_fingerprint_is_of_the_sets_and_tells_moved_placements_apart() {
        let recorded = p(&[&[1, 2, 3], &[2, 3, 4], &[3, 4, 1], &[4, 1, 2]]);
        let f = recorded.fingerprint();
        // Stable across builds: the hello of one version's nodes must match
        // another's that places alike.
        assert_eq!(f, 0x3c1a_2493_920c_b705, "{f:#x}");
        assert_eq!(
            p(&[&[2, 1, 3], &[2, 3, 4], &[1, 3, 4], &[4, 1, 2]]).fingerprint(),
            f,
            "the order of a shard's replicas is no move"
        );
        let moved = p(&[&[1, 2, 3], &[2, 3, 4], &[3, 4, 5], &[4, 5, 1]]);
        assert_ne!(moved.fingerprint(), f);
        // Shards swapped, and a shard's replicas split differently.
        assert_ne!(
            p(&[&[2, 3, 4], &[1, 2, 3], &[3, 4, 1], &[4, 1, 2]]).fingerprint(),
            f
        );
        assert_ne!(
            p(&[&[1, 2], &[3, 2, 3, 4]]).fingerprint(),
            p(&[&[1, 2, 3], &[2, 3, 4]]).fingerprint()
        );
        assert_ne!(
            p(&[&[1, 2, 3]]).fingerprint(),
            p(&[&[1, 2, 3], &[]]).fingerprint()
        );
    }

    #[test]
    fn the_record_survives_a_restart_and_prints_as_pinned_entries() {
        let dir = tempfile::tempdir().expect("tempdir");
        assert_eq!(read(dir.path()), Ok(None));
        let placed = p(&[&[1, 2, 3], &[2, 3, 1]]);
        record(dir.path(), &placed).expect("recorded");
        assert_eq!(read(dir.path()), Ok(Some(placed.clone())));
        assert_eq!(
            placed.to_toml(),
            "[[placement]]\nshard = 0\nreplicas = [1, 2, 3]\n\n[[placement]]\nshard = 1\nreplicas = [2, 3, 1]\n\n"
        );
        std::fs::write(path(dir.path()), b"{not json").expect("write");
        assert!(read(dir.path())
            .err()
            .is_some_and(|e| e.contains("unreadable placement record")));
    }
}
