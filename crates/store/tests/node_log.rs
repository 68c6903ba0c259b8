//! The shards on the node log (`<data>/log/`): crash images, a data
//! directory of shard logs moving to it, the checkpoint sweep of idle
//! shards, and a failed round taking every shard out of service.

mod common;

use common::*;
use forkless_store::*;
use forkless_types::{Epoch, ExecutionId, ShardCount, ShardId};
use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::{Duration, Instant};

/// The small sizes, on the node log.
fn node() -> StoreConfig {
    StoreConfig {
        node_log: true,
        ..small()
    }
}

/// The small sizes, on a log per shard: the format of before.
fn shard_logs() -> StoreConfig {
    StoreConfig {
        node_log: false,
        ..small()
    }
}

fn node_segments(data: &Path) -> Vec<PathBuf> {
    segments_in(&data.join("log"))
}

fn contents(files: &[PathBuf]) -> BTreeMap<PathBuf, Vec<u8>> {
    files
        .iter()
        .map(|p| (p.clone(), std::fs::read(p).expect("read")))
        .collect()
}

/// Waits for `f` to hold, for at most `limit`.
async fn until(what: &str, limit: Duration, mut f: impl FnMut() -> bool) {
    let start = Instant::now();
    while !f() {
        assert!(start.elapsed() < limit, "{what}: not within {limit:?}");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn crash_images_of_the_node_log_reopen_with_every_acknowledged_write() {
    let dir = tempfile::tempdir().expect("tempdir");
    let live = dir.path().join("live");
    let (store, s) = open(&live, node());
    let mut model = Model::default();
    let mut rng = Rng(0x51ed_270b_27a3_b9f1);
    for n in 1..=8 {
        start(&s, &mut model, n).await;
    }
    for step in 0..400u64 {
        append_some(&s, &mut model, &mut rng, step).await;
        if step == 199 {
            close(&s, &mut model, 3).await;
        }
        if step % 100 == 99 {
            let image = dir.path().join(format!("crash-{step}"));
            crash_image(&live, &image);
            healthy(&image, &format!("crash image at step {step}"));
            for pass in ["", ", reopened"] {
                let (copy_store, copy) = open(&image, node());
                verify(&copy, &model, &format!("crash image at step {step}{pass}")).await;
                drop(copy);
                drop(copy_store);
            }
        }
    }
    assert!(
        node_segments(&live).len() > 20,
        "the test should cross many segments: {}",
        node_segments(&live).len()
    );
    assert!(
        !live.join("shards/0/eventlog").exists(),
        "a new shard has no log of its own"
    );
    assert!(s.commit_stats().checkpoints > 10, "{:?}", s.commit_stats());
    drop(s);
    drop(store);
    let (store, s) = open(&live, node());
    verify(&s, &model, "reopened after a clean close").await;
    drop(s);
    drop(store);
    let report = healthy(&live, "closed");
    let node = report.node_log.as_ref().expect("a node log");
    assert_eq!(node.segments, node_segments(&live).len());
    let events: usize = model.logs.values().map(|l| l.len()).sum();
    assert_eq!(report.shards[0].events as usize, events, "{report}");
    assert_eq!(report.shards[0].indexed_events as usize, events, "{report}");
}

/// The offline check of the directory finds nothing wrong.
fn healthy(data: &Path, what: &str) -> check::Report {
    let report = check::check(data).expect("the check runs");
    assert!(report.is_healthy(), "{what}: {report}");
    report
}

/// The offline check on the node log: damage in a round is found and
/// named, nothing is changed, and `--truncate-after` at the last whole
/// round before it cuts the node log for every shard and leaves a
/// directory that checks healthy and opens with what was before the cut.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_offline_check_reads_the_node_log() {
    let dir = tempfile::tempdir().expect("tempdir");
    let data = dir.path().join("data");
    let config = StoreConfig {
        node_log: true,
        log_checkpoint_bytes: u64::MAX,
        ..StoreConfig::default()
    };
    let (store, s) = open(&data, config.clone());
    let mut model = Model::default();
    let mut rng = Rng(0x0bad_5eed);
    for n in 1..=3 {
        start(&s, &mut model, n).await;
    }
    let early = model.clone();
    for step in 0..60u64 {
        append_some(&s, &mut model, &mut rng, step).await;
    }
    // A crash image: its checkpoint is the one of the open, so damage
    // after it can be cut.
    let image = dir.path().join("image");
    crash_image(&data, &image);
    drop(s);
    drop(store);
    healthy(&image, "the image");
    let seg = node_segments(&image).pop().expect("a segment");
    let mut bytes = std::fs::read(&seg).expect("read");
    let rounds = group_starts(&bytes);
    assert!(rounds.len() > 40, "{} rounds", rounds.len());
    // The last start's round is in the model's prefix `early` plus what
    // came before the damaged round.
    let damaged = rounds[30];
    bytes[damaged + 20] ^= 0x08;
    std::fs::write(&seg, &bytes).expect("write");
    let report = check::check(&image).expect("the check runs");
    assert!(!report.is_healthy(), "{report}");
    let node = report.node_log.as_ref().expect("a node log");
    let text = report.to_string();
    assert!(
        node.problems
            .iter()
            .any(|p| p.contains(&format!("offset {damaged}"))),
        "{text}"
    );
    let good = node.last_good.expect("a last good round");
    assert_eq!(good.1, damaged as u64, "{text}");
    assert!(text.contains("--truncate-after"), "{text}");
    assert_eq!(
        std::fs::read(&seg).expect("read"),
        bytes,
        "the check changes nothing"
    );
    let done = check::truncate_after(&image, ShardId(0), good).expect("cut");
    assert!(done.contains("every shard"), "{done}");
    healthy(&image, "after the cut");
    let (_store, s) = open(&image, config);
    let (meta, _) = s
        .read_events(id(1), 0, 100_000)
        .expect("read")
        .expect("exists");
    assert!(meta.last_seq >= early.logs[&1].len() as u64);
    assert!(
        appended(&s, id(1), 10).await.is_ok(),
        "writes go on after the cut"
    );
}

/// A data directory written with a log per shard (what the version
/// before the node log writes) opens on the node log with every event:
/// a shard's own log is replayed from its checkpoint (here a crash image,
/// so there is something to replay), stays where it is and is only read
/// from then on, and new writes go to the node log; idempotency keys of
/// events in the old log still deduplicate.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn shard_logs_move_to_the_node_log_and_keep_every_event() {
    let dir = tempfile::tempdir().expect("tempdir");
    let live = dir.path().join("live");
    let (store, s) = open(&live, shard_logs());
    let mut model = Model::default();
    let mut rng = Rng(0x2545_f491_4f6c_dd1d);
    for n in 1..=6 {
        start(&s, &mut model, n).await;
    }
    for step in 0..150u64 {
        append_some(&s, &mut model, &mut rng, step).await;
    }
    close(&s, &mut model, 2).await;
    let data = dir.path().join("image");
    crash_image(&live, &data);
    drop(s);
    drop(store);
    assert!(!data.join("log").exists());
    let (store, s) = open(&data, node());
    let own = segments(&data);
    let before = contents(&own);
    verify(&s, &model, "moved to the node log").await;
    for step in 150..300u64 {
        append_some(&s, &mut model, &mut rng, step).await;
    }
    verify(&s, &model, "written on the node log").await;
    assert!(!node_segments(&data).is_empty());
    drop(s);
    drop(store);
    for pass in ["reopened", "reopened again"] {
        let (store, s) = open(&data, node());
        verify(&s, &model, pass).await;
        drop(s);
        drop(store);
    }
    assert_eq!(
        contents(&segments(&data)),
        before,
        "nothing is written to a shard's own log once it moved"
    );
    let report = healthy(&data, "moved");
    let events: usize = model.logs.values().map(|l| l.len()).sum();
    assert_eq!(report.shards[0].indexed_events as usize, events, "{report}");
}

/// Executions, one on each of the shards of a two-shard store.
fn one_on_each_shard() -> [ExecutionId; 2] {
    let mut found = [None, None];
    for n in 1.. {
        let x = id(n);
        let s = x.partition().get() as usize % 2;
        found[s].get_or_insert(x);
        if let [Some(a), Some(b)] = found {
            return [a, b];
        }
    }
    unreachable!("the ids run out")
}

async fn started(s: &ShardStore, x: ExecutionId) {
    s.start(StartRequest {
        epoch: Epoch(1),
        id: x,
        workflow: "w".into(),
        started_payload: b"{}".to_vec(),
        routing_key: None,
        idempotency_key: None,
    })
    .await
    .expect("start");
}

async fn appended(s: &ShardStore, x: ExecutionId, bytes: usize) -> Result<u64, StoreError> {
    s.append(AppendRequest {
        epoch: Epoch(1),
        id: x,
        events: vec![NewEvent {
            event_type: "step".into(),
            payload: vec![b'x'; bytes],
            idempotency_key: None,
        }],
        expected_last_seq: None,
    })
    .await
    .map(|out| out.last_seq)
}

/// A reopen reads the node log from the oldest checkpoint of any shard,
/// and a shard checkpoints by itself only when it writes: an idle shard
/// is asked to by the store's sweep once the log has moved on.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_idle_shard_is_checkpointed_as_the_node_log_moves_on() {
    let dir = tempfile::tempdir().expect("tempdir");
    let two = ShardCount::new(2).expect("2 shards");
    let store = Store::open(dir.path(), two, node()).expect("opens");
    let [x0, x1] = one_on_each_shard();
    let busy = store.open_shard(ShardId(0), Epoch(1)).expect("opens");
    let idle = store.open_shard(ShardId(1), Epoch(1)).expect("opens");
    started(&busy, x0).await;
    started(&idle, x1).await;
    let idle_before = idle.commit_stats().checkpoints;
    // Well past the checkpoint distance (6 KiB), from the other shard.
    for _ in 0..40 {
        appended(&busy, x0, 1000).await.expect("append");
    }
    until(
        "the idle shard checkpoints",
        Duration::from_secs(20),
        || idle.commit_stats().checkpoints > idle_before,
    )
    .await;
    assert_eq!(
        idle.commit_stats().groups_by_writer_thread + idle.commit_stats().groups_by_caller,
        1,
        "a checkpoint is not a commit"
    );
    let (meta, _) = idle.read_events(x1, 0, 10).expect("read").expect("exists");
    assert_eq!(meta.last_seq, 1);
    drop((busy, idle, store));
    let report = healthy(dir.path(), "two shards");
    assert_eq!(report.shards.len(), 2);
    assert_eq!(report.shards[1].indexed_events, 1, "{report}");
}

/// A failed round of the node log (a full disk here) fails the shard
/// that wrote, and every other shard with it: the disk is shared, so is
/// its failure. Later writes are refused as not executed, every shard
/// reports why, and a reopen once space is back holds what was
/// acknowledged.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_failed_round_takes_every_shard_out_of_service() {
    let fs = forkless_it::Tmpfs::new(16 << 20);
    let data = fs.mount.join("data");
    let two = ShardCount::new(2).expect("2 shards");
    let config = StoreConfig {
        log_segment_bytes: 1 << 20,
        ..node()
    };
    let [x0, x1] = one_on_each_shard();
    let mut acked = [1u64, 1];
    {
        let store = Store::open(&data, two, config.clone()).expect("opens");
        let shards = [
            store.open_shard(ShardId(0), Epoch(1)).expect("opens"),
            store.open_shard(ShardId(1), Epoch(1)).expect("opens"),
        ];
        started(&shards[0], x0).await;
        started(&shards[1], x1).await;
        let filler = forkless_it::fill(&fs.mount);
        let failed = loop {
            match appended(&shards[0], x0, 4096).await {
                Ok(seq) => acked[0] = seq,
                Err(e) => break e,
            }
        };
        assert!(
            matches!(failed, StoreError::OutcomeUnknown { .. }),
            "the write that met the full disk: {failed:?}"
        );
        let refused = appended(&shards[1], x1, 10).await;
        assert!(
            matches!(refused, Err(StoreError::ShardFailed { .. })),
            "the other shard's next write is refused, not tried: {refused:?}"
        );
        let failures = store.failures();
        assert_eq!(failures.len(), 2, "{failures:?}");
        assert!(
            failures
                .values()
                .all(|why| why.contains("log/2147483648.seg") && why.contains("No space left")),
            "{failures:?}"
        );
        std::fs::remove_file(filler).expect("space freed");
        let still = appended(&shards[1], x1, 10).await;
        assert!(
            matches!(still, Err(StoreError::ShardFailed { .. })),
            "nothing is written once the log failed, even with space back: {still:?}"
        );
    }
    let store = Store::open(&data, two, config).expect("reopens");
    for (x, acked) in [x0, x1].into_iter().zip(acked) {
        let s = store
            .open_shard(ShardId(x.partition().get() % 2), Epoch(1))
            .expect("opens");
        let (meta, events) = s.read_events(x, 0, 100_000).expect("read").expect("exists");
        assert!(
            meta.last_seq >= acked && meta.last_seq <= acked + 1,
            "{x}: {} events, {acked} acknowledged",
            meta.last_seq
        );
        assert_eq!(events.len() as u64, meta.last_seq);
        assert!(appended(&s, x, 10).await.is_ok(), "writes go on");
    }
}

/// Every shard's write buffer (fjall's memtables) is held to the node's
/// budget: fjall flushes a keyspace's memtable by itself only at 64 MiB,
/// so a node of many shards, each filling slowly, kept everything they
/// wrote in memory (and in journals never rotated). The sweep seals the
/// largest, fjall's workers flush them, and what was written reads back,
/// reopened too.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_shards_write_buffers_are_held_to_the_nodes_budget() {
    const SHARDS: u32 = 4;
    const BUDGET: u64 = 192 * 1024;
    let dir = tempfile::tempdir().expect("tempdir");
    let count = ShardCount::new(SHARDS.into()).expect("4 shards");
    let config = || StoreConfig {
        write_buffer_bytes: BUDGET,
        ..node()
    };
    let store = Store::open(dir.path(), count, config()).expect("opens");
    let shards: Vec<_> = (0..SHARDS)
        .map(|s| store.open_shard(ShardId(s), Epoch(1)).expect("opens"))
        .collect();
    let mut on: Vec<Vec<ExecutionId>> = vec![Vec::new(); SHARDS as usize];
    for n in 1.. {
        let x = id(n);
        let s = x.partition().get() as usize % SHARDS as usize;
        if on[s].len() < 4 {
            on[s].push(x);
        }
        if on.iter().all(|v| v.len() == 4) {
            break;
        }
    }
    for (s, xs) in shards.iter().zip(&on) {
        for x in xs {
            started(s, *x).await;
        }
    }
    // Each event carries a 187-byte idempotency key, which the shard
    // keeps in a keyspace of its own: with the rest, the shards' write
    // buffers held 543 KB in all without the bound, nearly three times
    // the budget.
    let key = |x: ExecutionId, n: u64| format!("{x}-{n:0>160}");
    let mut written = 0u64;
    for round in 0..20u64 {
        for (s, xs) in shards.iter().zip(&on) {
            let x = xs[(round % 4) as usize];
            let events = (0..25)
                .map(|i| NewEvent {
                    event_type: "step".into(),
                    payload: b"{}".to_vec(),
                    idempotency_key: Some(key(x, round * 100 + i)),
                })
                .collect();
            s.append(AppendRequest {
                epoch: Epoch(1),
                id: x,
                events,
                expected_last_seq: None,
            })
            .await
            .expect("append");
            written += 25;
        }
    }
    let held = || shards.iter().map(|s| s.write_buffer_bytes()).sum::<u64>();
    until(
        "the shards' write buffers fit the node's budget",
        Duration::from_secs(20),
        || held() <= BUDGET,
    )
    .await;
    let events = |shards: &[Arc<ShardStore>]| {
        let mut n = 0u64;
        for (s, xs) in shards.iter().zip(&on) {
            for x in xs {
                let (meta, evs) = s.read_events(*x, 0, 10_000).expect("read").expect("exists");
                assert_eq!(meta.last_seq as usize, evs.len());
                n += meta.last_seq - 1;
            }
        }
        n
    };
    assert_eq!(events(&shards), written);
    drop((shards, store));
    let store = Store::open(dir.path(), count, config()).expect("reopens");
    let shards: Vec<_> = (0..SHARDS)
        .map(|s| store.open_shard(ShardId(s), Epoch(1)).expect("opens"))
        .collect();
    assert_eq!(events(&shards), written, "reopened");
    // An idempotency key kept through the flush still deduplicates.
    let x = on[0][0];
    let again = shards[0]
        .append(AppendRequest {
            epoch: Epoch(1),
            id: x,
            events: vec![NewEvent {
                event_type: "step".into(),
                payload: b"{}".to_vec(),
                idempotency_key: Some(key(x, 0)),
            }],
            expected_last_seq: None,
        })
        .await
        .expect("a retry");
    assert!(again.deduplicated, "{again:?}");
    assert_eq!(
        again.first_seq, 2,
        "the retry is the first append's first event"
    );
}
