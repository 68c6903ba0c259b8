//! Real I/O errors: a shard whose data directory is on a small tmpfs that
//! fills up (ENOSPC from the kernel, no mock of the store). A write that
//! failed stays failed: the shard refuses every later write at once, the
//! failed group is never committed later (not even once space is freed),
//! and a restart finds exactly the writes that were acknowledged.
//!
//! Needs root (it mounts a tmpfs), as the test suite runs in CI; run as
//! another user it fails, saying so, rather than skip.

use forkless_it::{fill, Tmpfs};
use forkless_store::*;
use forkless_types::{Epoch, ExecutionId, ShardCount, ShardId};

fn id(n: i64) -> ExecutionId {
    ExecutionId::new(n).expect("a valid execution id")
}

fn ev(t: &str, payload: Vec<u8>) -> NewEvent {
    NewEvent {
        event_type: t.into(),
        payload,
        idempotency_key: None,
    }
}

async fn append(s: &ShardStore, t: &str, payload: Vec<u8>) -> Result<AppendOutcome, StoreError> {
    s.append(AppendRequest {
        epoch: Epoch(1),
        id: id(1),
        events: vec![ev(t, payload)],
        expected_last_seq: None,
    })
    .await
}

async fn start(s: &ShardStore, n: i64) -> Result<StartOutcome, StoreError> {
    s.start(StartRequest {
        epoch: Epoch(1),
        id: id(n),
        workflow: "w".into(),
        started_payload: b"{}".to_vec(),
        routing_key: None,
        idempotency_key: None,
    })
    .await
}

#[tokio::test]
async fn a_write_that_failed_on_a_full_disk_is_never_committed_later() {
    let fs = Tmpfs::new(24 * 1024 * 1024);
    let data = fs.mount.join("data");
    let store = Store::open(&data, ShardCount::ONE, StoreConfig::default()).expect("opens");
    let s = store.open_shard(ShardId(0), Epoch(1)).expect("opens");
    start(&s, 1).await.expect("start");
    let acked = append(&s, "before", b"{\"n\":1}".to_vec())
        .await
        .expect("an append with room to spare");
    assert_eq!(acked.last_seq, 2);

    let filler = fill(&fs.mount);
    // Larger than any slack left in the log's last page: the kernel says
    // ENOSPC part way through the group.
    let big = format!("{{\"pad\":\"{}\"}}", "x".repeat(256 * 1024)).into_bytes();
    let failed = append(&s, "failed", big.clone()).await;
    assert!(
        matches!(&failed, Err(StoreError::OutcomeUnknown { .. })),
        "the write in the failed commit has an unknown outcome: {failed:?}"
    );
    // From now on every write is refused at once, without being tried.
    let refused = append(&s, "refused-while-full", b"{}".to_vec()).await;
    assert!(
        matches!(&refused, Err(StoreError::ShardFailed { .. })),
        "{refused:?}"
    );
    // Space comes back; the shard stays failed until it is reopened, and
    // the failed group is not written by the next command.
    std::fs::remove_file(&filler).expect("free the space");
    let after_free = append(&s, "refused-after-free", b"{}".to_vec()).await;
    assert!(
        matches!(&after_free, Err(StoreError::ShardFailed { .. })),
        "{after_free:?}"
    );
    let started = start(&s, 2).await;
    assert!(
        matches!(&started, Err(StoreError::ShardFailed { .. })),
        "{started:?}"
    );
    let why = store
        .failures()
        .remove(&ShardId(0))
        .expect("the failed shard is reported");
    assert!(why.contains("No space left on device"), "{why}");
    // Reads still serve what was durable.
    let meta = s.execution(id(1)).expect("read").expect("exists");
    assert_eq!(meta.last_seq, 2);
    drop(s);
    drop(store);

    // Restarted with space: exactly the acknowledged writes. The failed
    // group reached the disk only in part, so it is a torn tail and cut.
    let store = Store::open(&data, ShardCount::ONE, StoreConfig::default()).expect("reopens");
    let s = store.open_shard(ShardId(0), Epoch(1)).expect("reopens");
    assert!(store.failures().is_empty());
    let (meta, events) = s.read_events(id(1), 0, 100).expect("read").expect("exists");
    let types: Vec<&str> = events.iter().map(|e| e.event_type.as_str()).collect();
    assert_eq!(types, ["execution.started", "before"]);
    assert_eq!(meta.last_seq, 2);
    assert!(s.execution(id(2)).expect("read").is_none());
    // And it takes writes again.
    let next = append(&s, "after-restart", big).await.expect("append");
    assert_eq!((next.first_seq, next.last_seq), (3, 3));
}

/// On a disk with less room than a segment, zero-filling the next segment
/// ahead must not be what fills it: the log's own appends keep the space
/// (before, a 64 MiB zero-fill on a 24 MiB filesystem took it all, left its
/// file behind, and the next append fail-stopped the shard).
#[tokio::test]
async fn zero_filling_ahead_never_takes_the_space_appends_need() {
    let fs = Tmpfs::new(24 * 1024 * 1024);
    let data = fs.mount.join("data");
    let store = Store::open(&data, ShardCount::ONE, StoreConfig::default()).expect("opens");
    let s = store.open_shard(ShardId(0), Epoch(1)).expect("opens");
    start(&s, 1).await.expect("start");
    // 12 MiB of appends: past the point (1 MiB) where the next segment
    // starts being zero-filled, and well within the filesystem.
    let big = format!("{{\"pad\":\"{}\"}}", "x".repeat(256 * 1024)).into_bytes();
    for i in 0..48 {
        append(&s, "big", big.clone())
            .await
            .unwrap_or_else(|e| panic!("append {i} on a disk with room: {e}"));
        // Give a zero-filling thread time to run between appends.
        tokio::time::sleep(std::time::Duration::from_millis(5)).await;
    }
    assert!(store.failures().is_empty(), "{:?}", store.failures());
    let leftovers: Vec<_> = std::fs::read_dir(data.join("log"))
        .expect("the log's folder")
        .filter_map(|e| e.ok())
        .filter(|e| e.file_name().to_string_lossy().ends_with(".prepared"))
        .collect();
    assert!(leftovers.is_empty(), "{leftovers:?}");
}
