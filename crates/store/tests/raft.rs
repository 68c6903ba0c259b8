//! Every shard a Raft group run by this node alone (`StoreConfig::raft`):
//! writes are proposed as entries of the node log and applied on commit;
//! crash images reopen with every acknowledged write, and a clean reopen
//! keeps them too.

mod common;

use common::*;
use forkless_store::*;

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
