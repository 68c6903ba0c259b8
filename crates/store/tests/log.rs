//! A shard's own log on a real disk: crash images, torn and corrupt
//! groups, checkpoints and segment rotation at small sizes, and moving a
//! shard written before the log into it. A shard's own log is the format
//! of before the node log (`tests/node_log.rs`): a shard written by an
//! earlier version keeps it, replays it once and reads its events there,
//! so these tests write it on purpose (`node_log: false`).

mod common;

use common::*;
use forkless_store::*;
use forkless_types::{Epoch, ExecutionId, ShardCount, ShardId};
use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::sync::Arc;

/// `config`, writing a log per shard.
fn own(config: StoreConfig) -> StoreConfig {
    StoreConfig {
        node_log: false,
        ..config
    }
}

/// The small sizes, writing a log per shard.
fn small() -> StoreConfig {
    own(common::small())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn crash_images_reopen_with_every_acknowledged_write() {
    let dir = tempfile::tempdir().expect("tempdir");
    let live = dir.path().join("live");
    let (store, s) = open(&live, small());
    let mut model = Model::default();
    let mut rng = Rng(0x9e37_79b9_7f4a_7c15);
    for n in 1..=12 {
        start(&s, &mut model, n).await;
    }
    for step in 0..600u64 {
        append_some(&s, &mut model, &mut rng, step).await;
        // Right before an image: a new execution (its record, routing key
        // and start idempotency key), a closed one (its record changes).
        if step == 299 {
            start(&s, &mut model, 14).await;
        }
        if step == 399 {
            close(&s, &mut model, 4).await;
        }
        if step == 499 {
            close(&s, &mut model, 9).await;
        }
        if step % 100 == 99 {
            let image = dir.path().join(format!("crash-{step}"));
            crash_image(&live, &image);
            let (copy_store, copy) = open(&image, small());
            verify(&copy, &model, &format!("crash image at step {step}")).await;
            drop(copy);
            drop(copy_store);
            // Reopened a second time (after the first reopen's replay and
            // checkpoint), it still holds the same.
            let (copy_store, copy) = open(&image, small());
            verify(
                &copy,
                &model,
                &format!("crash image at step {step}, reopened"),
            )
            .await;
            drop(copy);
            drop(copy_store);
        }
    }
    assert!(
        segments(&live).len() > 40,
        "the test should cross many segments: {}",
        segments(&live).len()
    );
    verify(&s, &model, "live").await;
    // Every 6 KiB of log was checkpointed, and the time it took counted.
    let stats = s.commit_stats();
    let log_bytes: u64 = segments(&live)
        .iter()
        .map(|p| std::fs::metadata(p).expect("segment").len())
        .sum();
    assert!(
        stats.checkpoints >= log_bytes / (16 * 1024) && stats.checkpoints <= log_bytes / (6 * 1024),
        "{} checkpoints for {log_bytes} bytes of log",
        stats.checkpoints
    );
    assert!(stats.checkpoint_index_micros > 0 && stats.checkpoint_sync_micros > 0);
    // Reading every segment did not leave every segment open.
    let open_segments = std::fs::read_dir("/proc/self/fd")
        .expect("/proc/self/fd")
        .filter_map(|e| std::fs::read_link(e.ok()?.path()).ok())
        .filter(|target| target.starts_with(live.join("shards/0/eventlog")))
        .count();
    assert!(
        (1..=34).contains(&open_segments),
        "{open_segments} segment files open of {}",
        segments(&live).len()
    );
    drop(s);
    drop(store);
    let (store, s) = open(&live, small());
    verify(&s, &model, "reopened after a clean close").await;
    for step in 600..700u64 {
        append_some(&s, &mut model, &mut rng, step).await;
    }
    verify(&s, &model, "written after the reopen").await;
    drop(s);
    drop(store);
    // The default sizes read what the small ones wrote.
    let (_store, s) = open(&live, own(StoreConfig::default()));
    verify(&s, &model, "reopened with the default sizes").await;
}

#[tokio::test]
async fn a_torn_group_at_the_end_is_cut_off_and_the_rest_kept() {
    // With the default sizes the last segment is one that grows with
    // every group; with the small ones, after this many appends, it is
    // (most likely) one that was zero-filled before use.
    for config in [own(StoreConfig::default()), small()] {
        torn_group_is_cut_off(config).await;
    }
}

async fn torn_group_is_cut_off(config: StoreConfig) {
    let dir = tempfile::tempdir().expect("tempdir");
    let live = dir.path().join("live");
    let (_store, s) = open(&live, config.clone());
    let mut model = Model::default();
    let mut rng = Rng(7);
    for n in 1..=3 {
        start(&s, &mut model, n).await;
    }
    for step in 0..40 {
        append_some(&s, &mut model, &mut rng, step).await;
    }
    // A group whose header promises more than reached the disk, and one
    // whose bytes are all there but fail the checksum: writes torn by the
    // crash, never acknowledged, and nothing written after them.
    for (i, torn) in [
        [&0x100u32.to_be_bytes()[..], &[0u8; 4], b"partial"].concat(),
        [&4u32.to_be_bytes()[..], &[1, 2, 3, 4], b"abcd"].concat(),
    ]
    .into_iter()
    .enumerate()
    {
        let image = dir.path().join(format!("torn-{i}"));
        crash_image(&live, &image);
        let last = segments(&image).pop().expect("a segment");
        // A segment ends with its last group, or with zeros (one that was
        // zero-filled before use); the last write ended with a payload's
        // closing brace.
        let original = std::fs::read(&last).expect("read");
        let durable = original.iter().rposition(|b| *b != 0).map_or(0, |i| i + 1);
        assert!(durable > 0, "an empty last segment");
        let mut bytes = original.clone();
        bytes.resize(bytes.len().max(durable + torn.len()), 0);
        bytes[durable..durable + torn.len()].copy_from_slice(&torn);
        std::fs::write(&last, &bytes).expect("write");
        let (copy_store, copy) = open(&image, config.clone());
        let after = std::fs::read(&last).expect("read");
        assert_eq!(after.len(), bytes.len(), "the segment keeps its length");
        assert_eq!(
            after[..durable],
            original[..durable],
            "the groups before are kept"
        );
        assert!(
            after[durable..].iter().all(|b| *b == 0),
            "the torn group is cut off"
        );
        verify(&copy, &model, "after a torn group").await;
        drop(copy);
        drop(copy_store);
    }
    // Writing goes on after the cut.
    let (_copy_store, copy) = open(&dir.path().join("torn-1"), config.clone());
    let mut model2 = model.clone();
    append_some(&copy, &mut model2, &mut rng, 99).await;
    verify(&copy, &model2, "written after the cut").await;
}

#[tokio::test]
async fn a_bad_group_before_the_end_refuses_to_open() {
    let dir = tempfile::tempdir().expect("tempdir");
    let live = dir.path().join("live");
    let (store, s) = open(&live, small());
    let mut model = Model::default();
    let mut rng = Rng(11);
    start(&s, &mut model, 1).await;
    for step in 0..200 {
        append_some(&s, &mut model, &mut rng, step).await;
    }
    drop(s);
    drop(store);
    let segs = segments(&live);
    assert!(segs.len() >= 3, "{} segments", segs.len());
    // One flipped bit in the middle of a closed segment: acknowledged data
    // is damaged, and cutting the log there would drop later groups.
    let mut bytes = std::fs::read(&segs[1]).expect("read");
    let mid = bytes.len() / 2;
    bytes[mid] ^= 0x10;
    std::fs::write(&segs[1], &bytes).expect("write");
    let store = Store::open(&live, ShardCount::ONE, small()).expect("the store opens");
    // The checkpoint after the clean close means nothing is replayed, and
    // the bad group is found when read.
    let s = store
        .open_shard(ShardId(0), Epoch(1))
        .expect("the shard opens");
    let read = s.read_events(id(1), 0, 100_000);
    assert!(
        matches!(read, Err(StoreError::Corrupt(_))),
        "a read through the damaged record: {:?}",
        read.map(|r| r.map(|(m, e)| (m.last_seq, e.len())))
    );
    drop(s);
    drop(store);
    // Without that checkpoint (a crash image taken before it) the replay
    // meets the bad group and refuses to open.
    let dir2 = tempfile::tempdir().expect("tempdir");
    let live2 = dir2.path().join("live");
    let (store2, s2) = open(
        &live2,
        StoreConfig {
            log_checkpoint_bytes: u64::MAX,
            ..small()
        },
    );
    let mut model2 = Model::default();
    start(&s2, &mut model2, 1).await;
    for step in 0..200 {
        append_some(&s2, &mut model2, &mut rng, step).await;
    }
    let image = dir2.path().join("image");
    crash_image(&live2, &image);
    drop(s2);
    drop(store2);
    let segs = segments(&image);
    let mut bytes = std::fs::read(&segs[1]).expect("read");
    let mid = bytes.len() / 2;
    bytes[mid] ^= 0x10;
    std::fs::write(&segs[1], &bytes).expect("write");
    match open_damaged(&image, small()) {
        Err(why) => assert!(
            why.contains("shard 0") && why.contains("segment 1") && why.contains("bad group"),
            "{why}"
        ),
        Ok(_) => panic!("a shard with a bad group before the end opened"),
    }
}

/// A shard written before the log kept its events in fjall's `events`
/// keyspace; opening it moves them into the log, once.
#[tokio::test]
async fn a_shard_written_before_the_log_is_moved_into_it() {
    let dir = tempfile::tempdir().expect("tempdir");
    let data = dir.path();
    std::fs::create_dir_all(data.join("shards")).expect("mkdir");
    std::fs::write(data.join("layout"), "format = 1\nshard_count = 1\n").expect("layout");
    let mut model = Model::default();
    {
        let db = fjall::Database::builder(data.join("shards/0"))
            .open()
            .expect("fjall opens");
        let opts = fjall::KeyspaceCreateOptions::default;
        let meta = db.keyspace("meta", opts).expect("keyspace");
        let executions = db.keyspace("executions", opts).expect("keyspace");
        let events = db.keyspace("events", opts).expect("keyspace");
        meta.insert("epoch", 1u64.to_be_bytes()).expect("insert");
        for n in 1..=3i64 {
            let x = id(n);
            let mut key = x.partition().get().to_be_bytes().to_vec();
            key.extend_from_slice(&(n as u64).to_be_bytes());
            // version, status running, created_at, workflow, no routing key
            let mut record = vec![1u8, 0];
            record.extend_from_slice(&5u64.to_be_bytes());
            let wf = format!("wf-{n}");
            record.extend_from_slice(&(wf.len() as u16).to_be_bytes());
            record.extend_from_slice(wf.as_bytes());
            record.push(0);
            executions.insert(&key, record).expect("insert");
            let mut log = Vec::new();
            for seq in 1..=(n as u64 * 3) {
                let t = if seq == 1 {
                    "execution.started".to_string()
                } else {
                    format!("t{seq}")
                };
                let payload = format!("{{\"n\":{n},\"seq\":{seq}}}").into_bytes();
                let mut k = key.clone();
                k.extend_from_slice(&seq.to_be_bytes());
                let mut v = vec![1u8];
                v.extend_from_slice(&(1000 + seq).to_be_bytes());
                v.extend_from_slice(&(t.len() as u16).to_be_bytes());
                v.extend_from_slice(t.as_bytes());
                v.push(0);
                v.extend_from_slice(&payload);
                events.insert(&k, v).expect("insert");
                log.push((t, None, payload));
            }
            model.logs.insert(n, log);
        }
        db.persist(fjall::PersistMode::SyncAll).expect("persist");
    }
    let (store, s) = open(data, small());
    verify(&s, &model, "moved into the log").await;
    let meta = s.execution(id(3)).expect("read").expect("exists");
    assert_eq!(meta.updated_at_ms, 1009, "updated_at is the last event's");
    let mut rng = Rng(3);
    for step in 0..50 {
        append_some(&s, &mut model, &mut rng, step).await;
    }
    verify(&s, &model, "appended after the move").await;
    drop(s);
    drop(store);
    let (store, s) = open(data, small());
    verify(&s, &model, "reopened after the move").await;
    drop(s);
    drop(store);
    let db = fjall::Database::builder(data.join("shards/0"))
        .open()
        .expect("fjall opens");
    assert!(!db.keyspace_exists("events"), "the old keyspace is gone");
    drop(db);
    // And on to the node log, which reads them where they are.
    let on_node = StoreConfig {
        node_log: true,
        ..common::small()
    };
    let (_store, s) = open(data, on_node);
    verify(&s, &model, "moved on to the node log").await;
}

/// How opening a damaged data directory came out: refused (with why), or
/// open with the shard to check.
fn open_damaged(dir: &Path, config: StoreConfig) -> Result<(Store, Arc<ShardStore>), String> {
    let store = Store::open(dir, ShardCount::ONE, config).map_err(|e| e.to_string())?;
    match store.open_shard(ShardId(0), Epoch(1)) {
        Ok(s) => Ok((store, s)),
        Err(e) => {
            let failures = store.failures();
            let why = failures
                .get(&ShardId(0))
                .unwrap_or_else(|| panic!("a shard that fails to open is reported: {e}"));
            assert!(matches!(e, StoreError::ShardFailed { .. }), "{e}");
            Err(why.clone())
        }
    }
}

/// Default sizes, but no checkpoint after the one at open: a crash image
/// replays the whole log.
fn never_checkpointed() -> StoreConfig {
    StoreConfig {
        log_checkpoint_bytes: u64::MAX,
        ..own(StoreConfig::default())
    }
}

/// Writes `starts` executions and `steps` random appends into `<dir>/live`,
/// takes a crash image of it while it is open (`<dir>/image`), then closes
/// it cleanly. Returns both folders and what was acknowledged.
async fn written_then_imaged(
    dir: &Path,
    config: &StoreConfig,
    seed: u64,
    starts: i64,
    steps: u64,
) -> (PathBuf, PathBuf, Model) {
    let live = dir.join("live");
    let (store, s) = open(&live, config.clone());
    let mut model = Model::default();
    let mut rng = Rng(seed);
    for n in 1..=starts {
        start(&s, &mut model, n).await;
    }
    for step in 0..steps {
        append_some(&s, &mut model, &mut rng, step).await;
    }
    let image = dir.join("image");
    crash_image(&live, &image);
    drop(s);
    drop(store);
    (live, image, model)
}

/// One flipped byte in a group of the last segment with groups written
/// after it is damage, not a torn tail: whatever byte it is (a length, a
/// checksum, a record), the shard never opens with an acknowledged event
/// gone. It refuses to open, saying which shard, segment and offset, or
/// (a flip the checksums cannot see does not exist) it opens whole.
#[tokio::test]
async fn a_damaged_group_followed_by_others_in_the_last_segment_is_never_cut() {
    let dir = tempfile::tempdir().expect("tempdir");
    let config = never_checkpointed();
    let (_live, base, model) = written_then_imaged(dir.path(), &config, 23, 4, 60).await;
    let last = segments(&base).pop().expect("a segment");
    let original = std::fs::read(&last).expect("read");
    let starts = group_starts(&original);
    assert!(starts.len() > 40, "{} groups", starts.len());
    // Early groups, and each byte class of a group: the length (its high
    // byte makes it run past everything written, its low byte lands it
    // inside later groups), the checksum, a record header, a payload byte.
    let mut flips = Vec::new();
    for g in [1usize, 2, 5, 20] {
        let at = starts[g];
        let next = starts[g + 1];
        for (what, off, mask) in [
            ("length, high byte", 0, 0x01u8),
            ("length, second byte", 1, 0x10),
            ("length, low byte", 3, 0x04),
            ("checksum", 5, 0x80),
            ("record kind", 8, 0x02),
            ("event length", 8 + 1 + 4 + 8 + 8 + 2, 0x01),
            ("payload", (next - at) - 3, 0x20),
        ] {
            flips.push((format!("group {g} at {at}, {what}"), at + off, mask));
        }
    }
    let mut refused = 0;
    for (i, (what, pos, mask)) in flips.iter().enumerate() {
        let image = dir.path().join(format!("flip-{i}"));
        crash_image(&base, &image);
        let seg = segments(&image).pop().expect("a segment");
        let mut bytes = original.clone();
        bytes[*pos] ^= mask;
        std::fs::write(&seg, &bytes).expect("write");
        match open_damaged(&image, config.clone()) {
            Err(why) => {
                refused += 1;
                assert!(
                    why.contains("shard 0")
                        && why.contains("segment 0")
                        && why.contains("offset")
                        && why.contains("bad group"),
                    "{what}: the refusal names the shard, segment and offset: {why}"
                );
                assert_eq!(
                    std::fs::read(&seg).expect("read"),
                    bytes,
                    "{what}: a refused open changes nothing in the segment"
                );
            }
            Ok((_store, s)) => verify(&s, &model, what).await,
        }
    }
    assert_eq!(refused, flips.len(), "every flip is seen");
}

/// A node with a damaged shard serves its other shards, and reports the
/// damaged one.
#[tokio::test]
async fn a_damaged_shard_does_not_stop_the_others() {
    let dir = tempfile::tempdir().expect("tempdir");
    let data = dir.path().join("data");
    let two = ShardCount::new(2).expect("2 shards");
    let config = never_checkpointed();
    // An execution on each shard.
    let ids: Vec<ExecutionId> = (1..)
        .map(id)
        .scan([false, false], |seen, x| {
            let s = x.partition().get() as usize % 2;
            let new = !seen[s];
            seen[s] = true;
            Some((new, x))
        })
        .filter(|(new, _)| *new)
        .map(|(_, x)| x)
        .take(2)
        .collect();
    {
        let store = Store::open(&data, two, config.clone()).expect("opens");
        for x in &ids {
            let s = store
                .open_shard(ShardId(x.partition().get() % 2), Epoch(1))
                .expect("opens");
            for _ in 0..3 {
                s.start(StartRequest {
                    epoch: Epoch(1),
                    id: *x,
                    workflow: "w".into(),
                    started_payload: b"{}".to_vec(),
                    routing_key: None,
                    idempotency_key: None,
                })
                .await
                .map(|_| ())
                .or_else(|e| match e {
                    StoreError::ExecutionExists(_) => Ok(()),
                    e => Err(e),
                })
                .expect("start");
            }
            for k in 0..5 {
                s.append(AppendRequest {
                    epoch: Epoch(1),
                    id: *x,
                    events: vec![NewEvent {
                        event_type: format!("t{k}"),
                        payload: b"{\"k\":1}".to_vec(),
                        idempotency_key: None,
                    }],
                    expected_last_seq: None,
                })
                .await
                .expect("append");
            }
        }
        // Taken while open: a close checkpoints, and the reopen of the
        // image has the log to replay.
        crash_image(&data, &dir.path().join("image"));
    }
    let image = dir.path().join("image");
    let seg = image.join("shards/1/eventlog/0000000000.seg");
    let mut bytes = std::fs::read(&seg).expect("read");
    let starts = group_starts(&bytes);
    bytes[starts[1] + 9] ^= 0x40;
    std::fs::write(&seg, &bytes).expect("write");
    let store = Store::open(&image, two, config).expect("the store opens with a damaged shard");
    let failures = store.failures();
    assert_eq!(failures.len(), 1, "{failures:?}");
    let why = &failures[&ShardId(1)];
    assert!(
        why.contains("shard 1") && why.contains("bad group"),
        "{why}"
    );
    assert!(matches!(
        store.open_shard(ShardId(1), Epoch(1)),
        Err(StoreError::ShardFailed { .. })
    ));
    let healthy = store.shard(ShardId(0)).expect("shard 0 serves");
    let x0 = ids
        .iter()
        .find(|x| x.partition().get() % 2 == 0)
        .expect("an execution on shard 0");
    let (meta, events) = healthy
        .read_events(*x0, 0, 100)
        .expect("read")
        .expect("exists");
    assert_eq!((meta.last_seq, events.len()), (6, 6));
}

/// A shard whose database lost its checkpoint record (or the whole
/// database) while its log holds events refuses to open and deletes
/// nothing.
#[tokio::test]
async fn a_log_without_its_checkpoint_is_never_deleted() {
    let dir = tempfile::tempdir().expect("tempdir");
    let live = dir.path().join("live");
    let (store, s) = open(&live, small());
    let mut model = Model::default();
    let mut rng = Rng(5);
    start(&s, &mut model, 1).await;
    for step in 0..30 {
        append_some(&s, &mut model, &mut rng, step).await;
    }
    drop(s);
    drop(store);
    // The database is gone (a lost or replaced folder); the log is there.
    let shard = live.join("shards/0");
    for entry in std::fs::read_dir(&shard).expect("readdir") {
        let p = entry.expect("dirent").path();
        if p.file_name().is_some_and(|n| n != "eventlog") {
            if p.is_dir() {
                std::fs::remove_dir_all(&p).expect("rm");
            } else {
                std::fs::remove_file(&p).expect("rm");
            }
        }
    }
    let before: Vec<(PathBuf, Vec<u8>)> = segments(&live)
        .into_iter()
        .map(|p| {
            let b = std::fs::read(&p).expect("read");
            (p, b)
        })
        .collect();
    assert!(before.len() > 2);
    let why = match open_damaged(&live, small()) {
        Err(why) => why,
        Ok(_) => panic!("a log with no checkpoint opened"),
    };
    assert!(
        why.contains("no checkpoint") && why.contains("nothing was deleted"),
        "{why}"
    );
    for (p, b) in &before {
        assert_eq!(
            &std::fs::read(p).unwrap_or_default(),
            b,
            "{} is unchanged",
            p.display()
        );
    }
}

/// Every file under `dir` and its bytes.
fn snapshot_files(dir: &Path) -> BTreeMap<PathBuf, Vec<u8>> {
    let mut out = BTreeMap::new();
    for entry in std::fs::read_dir(dir).expect("readdir") {
        let p = entry.expect("dirent").path();
        if p.is_dir() {
            out.extend(snapshot_files(&p));
        } else {
            out.insert(p.clone(), std::fs::read(&p).expect("read"));
        }
    }
    out
}

/// The offline check: a healthy folder is ok; a torn tail is a note, not
/// damage; a flipped byte is damage named by segment and offset; the check
/// changes no file; and `truncate_after` at the last whole group before
/// the damage leaves a folder that opens with a prefix of every log.
#[tokio::test]
async fn the_offline_check_finds_damage_and_changes_nothing() {
    let dir = tempfile::tempdir().expect("tempdir");
    let config = never_checkpointed();
    let (live, image, model) = written_then_imaged(dir.path(), &config, 31, 5, 80).await;

    // Closed cleanly: everything indexed, all ok.
    let report = check::check(&live).expect("the check runs");
    assert!(report.is_healthy(), "{report}");
    let events: usize = model.logs.values().map(Vec::len).sum();
    assert_eq!(report.shards[0].events, events as u64, "{report}");
    assert_eq!(report.shards[0].indexed_events, events as u64, "{report}");

    // A crash image: nothing indexed yet, still ok; with a torn group
    // appended, ok with a note.
    let torn = dir.path().join("torn");
    crash_image(&image, &torn);
    let seg = segments(&torn).pop().expect("a segment");
    let mut bytes = std::fs::read(&seg).expect("read");
    bytes.extend_from_slice(&[&0x100u32.to_be_bytes()[..], &[0u8; 4], b"partial"].concat());
    std::fs::write(&seg, &bytes).expect("write");
    let report = check::check(&torn).expect("the check runs");
    assert!(report.is_healthy(), "{report}");
    assert!(report.shards[0].torn_tail.is_some(), "{report}");
    assert!(report.to_string().contains("torn last group"), "{report}");

    // One flipped byte in group 30: damage, named, nothing changed.
    let damaged = dir.path().join("damaged");
    crash_image(&image, &damaged);
    let seg = segments(&damaged).pop().expect("a segment");
    let mut bytes = std::fs::read(&seg).expect("read");
    let starts = group_starts(&bytes);
    let (g30, g31) = (starts[30], starts[31]);
    bytes[g30 + 20] ^= 0x01;
    std::fs::write(&seg, &bytes).expect("write");
    let before = snapshot_files(&damaged);
    let report = check::check(&damaged).expect("the check runs");
    assert!(!report.is_healthy(), "{report}");
    let text = report.to_string();
    assert!(
        text.contains(&format!("segment 0, offset {g30}: a bad group")),
        "{text}"
    );
    assert_eq!(report.shards[0].last_good, Some((0, g30 as u64)), "{text}");
    assert!(
        text.contains(&format!("--truncate-after 0:{g30}")),
        "{text}"
    );
    assert_eq!(before, snapshot_files(&damaged), "the check changed a file");

    // What fjall may hold of the groups the cut drops (it applies a
    // group's puts once the group is durable, and its journal reaches the
    // disk on its own schedule): the record of an execution started in a
    // dropped group, the closed status of an execution whose closing event
    // is dropped, and an idempotency key of a dropped event. Planted here
    // as such a crash would have left them.
    let ghost = id(99);
    let reopened = *model.logs.keys().next().expect("an execution");
    {
        let db = fjall::Database::builder(damaged.join("shards/0"))
            .open()
            .expect("fjall opens");
        let opts = fjall::KeyspaceCreateOptions::default;
        let executions = db.keyspace("executions", opts).expect("keyspace");
        let event_idem = db.keyspace("event_idem", opts).expect("keyspace");
        let key = |x: ExecutionId| {
            let mut k = x.partition().get().to_be_bytes().to_vec();
            k.extend_from_slice(&(x.get() as u64).to_be_bytes());
            k
        };
        let record = |status: u8| {
            let mut r = vec![1u8, status];
            r.extend_from_slice(&5u64.to_be_bytes());
            r.extend_from_slice(&1u16.to_be_bytes());
            r.push(b'w');
            r.push(0);
            r
        };
        executions.insert(key(ghost), record(0)).expect("insert");
        executions
            .insert(key(id(reopened)), record(1))
            .expect("insert");
        let mut idem = key(id(reopened));
        idem.extend_from_slice(b"ghost-key");
        event_idem
            .insert(idem, 10_000u64.to_be_bytes())
            .expect("insert");
        db.persist(fjall::PersistMode::SyncAll).expect("persist");
    }
    // Cutting elsewhere than a group's end is refused.
    let refused = check::truncate_after(&damaged, ShardId(0), (0, g30 as u64 + 1));
    assert!(
        matches!(refused, Err(StoreError::Invalid(_))),
        "{refused:?}"
    );
    let _ = g31;
    // The operator drops the damaged tail: the shard opens with a prefix
    // of every execution's log, and the check is clean.
    let done = check::truncate_after(&damaged, ShardId(0), (0, g30 as u64)).expect("cut");
    assert!(done.contains(&format!("after 0:{g30}")), "{done}");
    // Every start is before the cut and nothing was closed; the dropped
    // groups' own idempotency keys may have reached fjall too.
    assert!(
        done.contains(": 1 execution records of executions that no longer have events removed")
            && done.contains(", 1 records of executions whose closing event was dropped reopened"),
        "{done}"
    );
    assert!(!done.contains(", 0 idempotency"), "{done}");
    let report = check::check(&damaged).expect("the check runs");
    assert!(report.is_healthy(), "{report}");
    let (_store, s) = open(&damaged, config);
    let mut kept = 0;
    for (&n, log) in &model.logs {
        let Some((_, got)) = s.read_events(id(n), 0, 100_000).expect("read") else {
            continue;
        };
        assert!(got.len() <= log.len());
        for (e, (t, _, payload)) in got.iter().zip(log) {
            assert_eq!((&e.event_type, &e.payload), (t, payload), "execution {n}");
        }
        kept += got.len();
    }
    assert!(kept > 0 && kept < events, "{kept} of {events} events kept");
    // What the dropped groups left in the database is gone.
    assert!(s.execution(ghost).expect("read").is_none());
    let meta = s.execution(id(reopened)).expect("read").expect("exists");
    assert_eq!(meta.status, ExecutionStatus::Running);
    let out = s
        .append(AppendRequest {
            epoch: Epoch(1),
            id: id(reopened),
            events: vec![NewEvent {
                event_type: "t".into(),
                payload: b"{}".to_vec(),
                idempotency_key: Some("ghost-key".into()),
            }],
            expected_last_seq: None,
        })
        .await
        .expect("an append with the dropped event's key");
    assert!(!out.deduplicated && out.first_seq == meta.last_seq + 1);
}
