//! Every shard a Raft group run by this node alone (`StoreConfig::raft`):
//! writes are proposed as entries of the node log and applied on commit;
//! crash images reopen with every acknowledged write, and a clean reopen
//! keeps them too.

mod common;

use common::*;
use forkless_store::*;
use forkless_types::Epoch;

fn raft() -> StoreConfig {
    StoreConfig {
        node_log: true,
        raft: true,
        ..small()
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn crash_images_of_a_raft_shard_reopen_with_every_acknowledged_write() {
    let dir = tempfile::tempdir().expect("tempdir");
    let live = dir.path().join("live");
    let (store, s) = open(&live, raft());
    let mut model = Model::default();
    let mut rng = Rng(0x7a1f_0c3e_99b2_4d55);
    for n in 1..=8 {
        start(&s, &mut model, n).await;
    }
    for step in 0..300u64 {
        append_some(&s, &mut model, &mut rng, step).await;
        if step == 149 {
            close(&s, &mut model, 3).await;
        }
        if step % 100 == 99 {
            let image = dir.path().join(format!("crash-{step}"));
            crash_image(&live, &image);
            let report = check::check(&image).expect("the check runs");
            assert!(report.is_healthy(), "crash image at step {step}: {report}");
            let events: usize = model.logs.values().map(|l| l.len()).sum();
            assert_eq!(report.shards[0].events as usize, events, "{report}");
            for pass in ["", ", reopened"] {
                let (copy_store, copy) = open(&image, raft());
                verify(&copy, &model, &format!("crash image at step {step}{pass}")).await;
                drop(copy);
                drop(copy_store);
            }
        }
    }
    assert!(s.commit_stats().checkpoints > 5, "{:?}", s.commit_stats());
    drop(s);
    drop(store);
    let (store, s) = open(&live, raft());
    verify(&s, &model, "reopened after a clean close").await;
    drop(s);
    drop(store);
}

/// Two crashes in a row, the second after the first reopen wrote (an
/// epoch move, as a node's startup fence makes): the group's log still
/// holds every entry the next open needs.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_crash_after_a_reopen_that_wrote_reopens() {
    let dir = tempfile::tempdir().expect("tempdir");
    let live = dir.path().join("live");
    let (store, s) = open(&live, raft());
    let mut model = Model::default();
    start(&s, &mut model, 1).await;
    let first = dir.path().join("first");
    crash_image(&live, &first);
    drop(s);
    drop(store);
    let (store, s) = open(&first, raft());
    s.advance_epoch(forkless_types::Epoch(2))
        .await
        .expect("the epoch moves");
    let second = dir.path().join("second");
    crash_image(&first, &second);
    drop(s);
    drop(store);
    let (store, s) = open(&second, raft());
    verify(&s, &model, "after the second crash").await;
    assert_eq!(s.epoch(), forkless_types::Epoch(2));
    drop(s);
    drop(store);
}

/// Many writers at once on one shard, with groups in flight and with one
/// group at a time: the leader evaluates each group after the groups in
/// flight before it, so every execution's log is gap-free, every
/// acknowledged append holds its events at the seqs it was answered, and
/// a retry with the same idempotency keys gets the original seqs.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn concurrent_writers_with_groups_in_flight_keep_every_log_gap_free() {
    const EXECUTIONS: i64 = 4;
    const WRITERS: u64 = 32;
    const APPENDS: u64 = 40;
    for depth in [1, 8] {
        let dir = tempfile::tempdir().expect("tempdir");
        let (store, s) = open(
            dir.path(),
            StoreConfig {
                raft_groups_in_flight: depth,
                ..raft()
            },
        );
        let mut model = Model::default();
        for n in 1..=EXECUTIONS {
            start(&s, &mut model, n).await;
        }
        let mut tasks = Vec::new();
        for w in 0..WRITERS {
            let s = s.clone();
            tasks.push(tokio::spawn(async move {
                let mut acked = Vec::new();
                for i in 0..APPENDS {
                    let n = 1 + ((w + i) % EXECUTIONS as u64) as i64;
                    let events: Vec<NewEvent> = (0..1 + (i % 2))
                        .map(|j| NewEvent {
                            event_type: "t".into(),
                            payload: format!("w{w}-i{i}-j{j}").into_bytes(),
                            idempotency_key: Some(format!("w{w}-i{i}-j{j}")),
                        })
                        .collect();
                    let req = AppendRequest {
                        epoch: Epoch(1),
                        id: id(n),
                        events,
                        expected_last_seq: None,
                    };
                    let out = s.append(req.clone()).await.expect("append");
                    assert!(!out.deduplicated);
                    if i % 8 == 0 {
                        let again = s.append(req.clone()).await.expect("retry");
                        assert!(again.deduplicated);
                        assert_eq!(
                            (again.first_seq, again.last_seq),
                            (out.first_seq, out.last_seq)
                        );
                    }
                    acked.push((n, out.first_seq, req.events));
                }
                acked
            }));
        }
        let mut by_seq = std::collections::BTreeMap::new();
        for t in tasks {
            for (n, first, events) in t.await.expect("writer") {
                for (seq, e) in (first..).zip(events) {
                    let was = by_seq.insert((n, seq), e.payload);
                    assert!(
                        was.is_none(),
                        "depth {depth}: execution {n} seq {seq} acknowledged twice"
                    );
                }
            }
        }
        for n in 1..=EXECUTIONS {
            let (_, all) = s
                .read_events(id(n), 0, 100_000)
                .expect("read")
                .expect("exists");
            let acked = by_seq.keys().filter(|(m, _)| *m == n).count();
            assert_eq!(all.len(), 1 + acked, "depth {depth}: execution {n}");
            for (e, seq) in all.iter().zip(1u64..) {
                assert_eq!(e.seq, seq, "depth {depth}: execution {n}: a gap");
                if seq > 1 {
                    assert_eq!(
                        Some(&e.payload),
                        by_seq.get(&(n, seq)),
                        "depth {depth}: execution {n} seq {seq}"
                    );
                }
            }
        }
        let st = s.commit_stats();
        if depth == 1 {
            assert_eq!(st.groups_behind_others, 0, "{st:?}");
        } else {
            assert!(
                st.groups_behind_others > 0,
                "no group was proposed behind another: {st:?}"
            );
        }
        drop(s);
        drop(store);
        let (store, s) = open(dir.path(), raft());
        let total: u64 = (1..=EXECUTIONS)
            .map(|n| s.execution(id(n)).expect("read").expect("exists").last_seq)
            .sum();
        assert_eq!(
            total as usize,
            EXECUTIONS as usize + by_seq.len(),
            "depth {depth}: reopened"
        );
        drop(s);
        drop(store);
    }
}
