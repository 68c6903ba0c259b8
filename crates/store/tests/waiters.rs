//! Per-execution wakeups and byte-budgeted reads, through the public API.

use forkless_store::*;
use forkless_types::{Epoch, ExecutionId, ShardCount, ShardId};
use std::time::Duration;

fn id(n: i64) -> ExecutionId {
    ExecutionId::new(n).expect("a valid id")
}

fn start(n: i64) -> StartRequest {
    StartRequest {
        epoch: Epoch(1),
        id: id(n),
        workflow: "wf".into(),
        started_payload: b"{}".to_vec(),
        routing_key: None,
        idempotency_key: None,
    }
}

fn append(n: i64, payload: Vec<u8>) -> AppendRequest {
    AppendRequest {
        epoch: Epoch(1),
        id: id(n),
        events: vec![NewEvent {
            event_type: "t".into(),
            payload,
            idempotency_key: None,
        }],
        expected_last_seq: None,
    }
}

/// A reader waiting on execution A is not woken by appends to execution B
/// of the same shard, and is woken by an append to A.
#[tokio::test]
async fn a_waiter_on_one_execution_is_not_woken_by_another() {
    let dir = tempfile::tempdir().expect("tempdir");
    let store = Store::open(dir.path(), ShardCount::ONE, StoreConfig::default()).expect("open");
    let s = store.open_shard(ShardId(0), Epoch(1)).expect("shard");
    s.start(start(1)).await.expect("start a");
    s.start(start(2)).await.expect("start b");
    let interest = s.watch_execution(id(1));
    let woken = interest.notified();
    tokio::pin!(woken);
    woken.as_mut().enable();
    for _ in 0..20 {
        s.append(append(2, b"1".to_vec())).await.expect("append b");
    }
    assert!(
        tokio::time::timeout(Duration::from_millis(200), woken.as_mut())
            .await
            .is_err(),
        "20 appends to B woke the waiter on A"
    );
    s.append(append(1, b"1".to_vec())).await.expect("append a");
    tokio::time::timeout(Duration::from_secs(10), woken.as_mut())
        .await
        .expect("an append to A wakes the waiter on A");
}

/// A page stops once its payloads reach the byte budget, with at least
/// one event, and never past `limit`.
#[tokio::test]
async fn a_budgeted_read_stops_at_the_budget_with_at_least_one_event() {
    let dir = tempfile::tempdir().expect("tempdir");
    let store = Store::open(dir.path(), ShardCount::ONE, StoreConfig::default()).expect("open");
    let s = store.open_shard(ShardId(0), Epoch(1)).expect("shard");
    s.start(start(1)).await.expect("start");
    for _ in 0..10 {
        s.append(append(1, vec![b'7'; 1000])).await.expect("append");
    }
    // Seq 1 is the start (payload "{}", 2 bytes); 2..=11 carry 1000 each.
    let seqs = |after, limit, budget| -> Vec<u64> {
        let (_, events) = s
            .read_events_within(id(1), after, limit, budget)
            .expect("read")
            .expect("exists");
        events.iter().map(|e| e.seq).collect()
    };
    assert_eq!(seqs(1, 100, 2500), vec![2, 3, 4]);
    assert_eq!(seqs(1, 100, 3000), vec![2, 3, 4]);
    assert_eq!(seqs(1, 100, 3001), vec![2, 3, 4, 5]);
    assert_eq!(seqs(1, 2, 1_000_000), vec![2, 3]);
    assert_eq!(seqs(4, 100, 1), vec![5], "always at least one event");
    assert_eq!(seqs(0, 100, 1), vec![1]);
    assert_eq!(seqs(11, 100, 1), Vec::<u64>::new());
    assert_eq!(seqs(0, 100, usize::MAX).len(), 11);
}

/// A page read with a verdict per event ends before the first event it
/// ends at, or after it when told so; a first event is taken either way;
/// every event the page holds was asked of, in order.
#[tokio::test]
async fn a_fitted_read_ends_where_its_verdict_says() {
    let dir = tempfile::tempdir().expect("tempdir");
    let store = Store::open(dir.path(), ShardCount::ONE, StoreConfig::default()).expect("open");
    let s = store.open_shard(ShardId(0), Epoch(1)).expect("shard");
    s.start(start(1)).await.expect("start");
    for _ in 0..5 {
        s.append(append(1, b"1".to_vec())).await.expect("append");
    }
    let read = |after, verdict: &dyn Fn(u64) -> Fit| -> (Vec<u64>, Vec<u64>) {
        let mut asked = Vec::new();
        let (_, events) = s
            .read_events_fitting(id(1), after, 100, |e| {
                asked.push(e.seq);
                verdict(e.seq)
            })
            .expect("read")
            .expect("exists");
        (events.iter().map(|e| e.seq).collect(), asked)
    };
    let end_at = |n| move |seq| if seq == n { Fit::End } else { Fit::Take };
    assert_eq!(read(1, &end_at(4)), (vec![2, 3], vec![2, 3, 4]));
    assert_eq!(
        read(1, &end_at(2)),
        (vec![2], vec![2]),
        "a first event is taken"
    );
    let last_at = |n| move |seq| if seq == n { Fit::TakeAndEnd } else { Fit::Take };
    assert_eq!(read(1, &last_at(4)), (vec![2, 3, 4], vec![2, 3, 4]));
    assert_eq!(read(0, &|_| Fit::Take).0, vec![1, 2, 3, 4, 5, 6]);
    assert_eq!(read(6, &|_| Fit::End), (vec![], vec![]));
}
