//! What the store's tests on a real disk share: a model of what was
//! acknowledged, a deterministic workload that fills it, a check that
//! everything in it reads back, and crash images.
#![allow(dead_code, reason = "each test file uses some of these")]

use forkless_store::*;
use forkless_types::{Epoch, ExecutionId, ShardCount, ShardId};
use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::sync::Arc;

pub fn id(n: i64) -> ExecutionId {
    ExecutionId::new(n).expect("a valid execution id")
}

/// Small segments and checkpoints, so a few hundred appends cross many of
/// each and an execution's log spans several index entries and segments.
pub fn small() -> StoreConfig {
    StoreConfig {
        log_segment_bytes: 8 * 1024,
        log_checkpoint_bytes: 6 * 1024,
        ..StoreConfig::default()
    }
}

pub fn open(dir: &Path, config: StoreConfig) -> (Store, Arc<ShardStore>) {
    let store = Store::open(dir, ShardCount::ONE, config).expect("the store opens");
    let shard = store
        .open_shard(ShardId(0), Epoch(1))
        .expect("the shard opens");
    (store, shard)
}

/// A copy of a live data directory: what a crash at this moment could
/// leave, at best (everything the processes wrote, synced or not, reached
/// the page cache; what fjall still buffers in the process did not).
pub fn crash_image(from: &Path, to: &Path) {
    std::fs::create_dir_all(to).expect("mkdir");
    for entry in std::fs::read_dir(from).expect("readdir") {
        let entry = entry.expect("dirent");
        let target = to.join(entry.file_name());
        if entry.file_type().expect("file type").is_dir() {
            crash_image(&entry.path(), &target);
        } else {
            std::fs::copy(entry.path(), &target).expect("copy");
        }
    }
}

pub fn segments(data: &Path) -> Vec<PathBuf> {
    segments_in(&data.join("shards/0/eventlog"))
}

/// The segments of the log in `dir`, in order.
pub fn segments_in(dir: &Path) -> Vec<PathBuf> {
    let mut out: Vec<PathBuf> = std::fs::read_dir(dir)
        .expect("the log's folder")
        .map(|e| e.expect("dirent").path())
        .filter(|p| p.extension().is_some_and(|x| x == "seg"))
        .collect();
    out.sort();
    out
}

/// An acknowledged event: type, idempotency key, payload.
pub type Acked = (String, Option<String>, Vec<u8>);

/// What was acknowledged, per execution: its events (type, idempotency
/// key, payload) from seq 1, and whether it is closed.
#[derive(Default, Clone)]
pub struct Model {
    pub logs: BTreeMap<i64, Vec<Acked>>,
    pub closed: BTreeMap<i64, ExecutionStatus>,
}

/// A small deterministic generator (the test must not depend on luck).
pub struct Rng(pub u64);

impl Rng {
    pub fn next(&mut self) -> u64 {
        self.0 ^= self.0 << 13;
        self.0 ^= self.0 >> 7;
        self.0 ^= self.0 << 17;
        self.0
    }
    pub fn below(&mut self, n: u64) -> u64 {
        self.next() % n
    }
}

pub async fn start(s: &ShardStore, model: &mut Model, n: i64) {
    let out = s
        .start(StartRequest {
            epoch: Epoch(1),
            id: id(n),
            workflow: format!("wf-{n}"),
            started_payload: format!("{{\"n\":{n}}}").into_bytes(),
            routing_key: (n % 3 == 0).then(|| format!("tenant/{n}")),
            idempotency_key: (n % 2 == 0).then(|| format!("start-{n}")),
        })
        .await
        .expect("start");
    assert!(!out.existing);
    model.logs.insert(
        n,
        vec![(
            "execution.started".into(),
            None,
            format!("{{\"n\":{n}}}").into_bytes(),
        )],
    );
}

pub async fn append_some(s: &ShardStore, model: &mut Model, rng: &mut Rng, step: u64) {
    let open: Vec<i64> = model
        .logs
        .keys()
        .copied()
        .filter(|n| !model.closed.contains_key(n))
        .collect();
    let n = open[rng.below(open.len() as u64) as usize];
    let count = 1 + rng.below(3);
    let mut events = Vec::new();
    for i in 0..count {
        let size = rng.below(700) as usize;
        let payload = format!(
            "{{\"s\":{step},\"i\":{i},\"pad\":\"{}\"}}",
            "x".repeat(size)
        );
        let idem = (rng.below(4) == 0).then(|| format!("k-{step}-{i}"));
        events.push(NewEvent {
            event_type: format!("t{}", rng.below(5)),
            payload: payload.into_bytes(),
            idempotency_key: idem,
        });
    }
    let last = model.logs[&n].len() as u64;
    let out = s
        .append(AppendRequest {
            epoch: Epoch(1),
            id: id(n),
            events: events.clone(),
            expected_last_seq: Some(last),
        })
        .await
        .expect("append");
    assert_eq!((out.first_seq, out.last_seq), (last + 1, last + count));
    let log = model.logs.get_mut(&n).expect("in the model");
    for e in events {
        log.push((e.event_type, e.idempotency_key, e.payload));
    }
}

pub async fn close(s: &ShardStore, model: &mut Model, n: i64) {
    let last = model.logs[&n].len() as u64;
    s.append(AppendRequest {
        epoch: Epoch(1),
        id: id(n),
        events: vec![NewEvent {
            event_type: "execution.completed".into(),
            payload: b"{}".to_vec(),
            idempotency_key: None,
        }],
        expected_last_seq: Some(last),
    })
    .await
    .expect("close");
    model.logs.get_mut(&n).expect("in the model").push((
        "execution.completed".into(),
        None,
        b"{}".to_vec(),
    ));
    model.closed.insert(n, ExecutionStatus::Completed);
}

/// Everything in the model reads back, whole and in windows, with the
/// right metadata; an idempotent retry gets its original seq; a closed
/// execution refuses appends.
pub async fn verify(s: &ShardStore, model: &Model, what: &str) {
    for (&n, log) in &model.logs {
        let meta = s
            .execution(id(n))
            .expect("read")
            .unwrap_or_else(|| panic!("{what}: execution {n} is gone"));
        assert_eq!(meta.last_seq, log.len() as u64, "{what}: execution {n}");
        assert_eq!(meta.workflow, format!("wf-{n}"), "{what}: execution {n}");
        let status = model
            .closed
            .get(&n)
            .copied()
            .unwrap_or(ExecutionStatus::Running);
        assert_eq!(meta.status, status, "{what}: execution {n}");
        let (_, all) = s
            .read_events(id(n), 0, 100_000)
            .expect("read")
            .expect("exists");
        assert_eq!(all.len(), log.len(), "{what}: execution {n}");
        for (e, (seq, (t, idem, payload))) in all.iter().zip((1u64..).zip(log)) {
            assert_eq!(e.seq, seq, "{what}: execution {n}");
            assert_eq!(&e.event_type, t, "{what}: execution {n} seq {seq}");
            assert_eq!(&e.idempotency_key, idem, "{what}: execution {n} seq {seq}");
            assert_eq!(&e.payload, payload, "{what}: execution {n} seq {seq}");
        }
        for after in [1u64, 2, 7, 30, log.len() as u64 - 1] {
            let (_, window) = s
                .read_events(id(n), after, 5)
                .expect("read")
                .expect("exists");
            let want: Vec<u64> = (after + 1..=log.len() as u64).take(5).collect();
            let got: Vec<u64> = window.iter().map(|e| e.seq).collect();
            assert_eq!(got, want, "{what}: execution {n} after {after}");
        }
        // The first and the last idempotency key of the log (the last one
        // is the likeliest to exist only in the log's tail).
        let keyed: Vec<_> = log
            .iter()
            .enumerate()
            .filter(|(_, (_, k, _))| k.is_some())
            .collect();
        for (i, (t, k, payload)) in keyed.first().into_iter().chain(keyed.last()) {
            let Some(k) = k else { continue };
            let out = s
                .append(AppendRequest {
                    epoch: Epoch(1),
                    id: id(n),
                    events: vec![NewEvent {
                        event_type: t.clone(),
                        payload: payload.clone(),
                        idempotency_key: Some(k.clone()),
                    }],
                    expected_last_seq: None,
                })
                .await
                .expect("a retry");
            assert!(out.deduplicated, "{what}: execution {n} key {k}");
            assert_eq!(
                out.first_seq,
                *i as u64 + 1,
                "{what}: execution {n} key {k}"
            );
        }
    }
    for &n in model.closed.keys() {
        let refused = s
            .append(AppendRequest {
                epoch: Epoch(1),
                id: id(n),
                events: vec![NewEvent {
                    event_type: "late".into(),
                    payload: b"{}".to_vec(),
                    idempotency_key: None,
                }],
                expected_last_seq: None,
            })
            .await;
        assert!(
            matches!(refused, Err(StoreError::ExecutionClosed { .. })),
            "{what}: execution {n}: {refused:?}"
        );
    }
}

/// Where each frame of a segment begins (a group of a shard's log, a
/// round of the node log), read from their headers (the
/// segment must be undamaged).
pub fn group_starts(bytes: &[u8]) -> Vec<usize> {
    let mut out = Vec::new();
    let mut at = 0;
    while at + 8 <= bytes.len() {
        let len = u32::from_be_bytes(bytes[at..at + 4].try_into().expect("4 bytes")) as usize;
        if len == 0 {
            break;
        }
        out.push(at);
        at += 8 + len;
    }
    out
}
