//! The storage engine's background threads run below the request path
//! (`StoreConfig::background_nice`), and the shard writers above it
//! (`StoreConfig::writer_priority`) when the process may raise a thread.
//! A file of its own: its own process, so every storage and writer thread
//! it sees was started by this test.
#![cfg(target_os = "linux")]

use forkless_store::{StartRequest, Store, StoreConfig};
use forkless_types::{Epoch, ExecutionId, ShardCount, ShardId};
use std::time::{Duration, Instant};

/// (thread name, nice) of every thread of this process.
fn threads() -> Vec<(String, i32)> {
    std::fs::read_dir("/proc/self/task")
        .expect("/proc/self/task")
        .flatten()
        .filter_map(|t| {
            let stat = std::fs::read_to_string(t.path().join("stat")).ok()?;
            let comm = std::fs::read_to_string(t.path().join("comm")).ok()?;
            // Fields after the parenthesised name: state is the 3rd field
            // of the line, nice the 19th.
            let rest = &stat[stat.rfind(')')? + 2..];
            let nice = rest.split(' ').nth(16)?.parse().ok()?;
            Some((comm.trim().to_string(), nice))
        })
        .collect()
}

/// Whether this process may raise a thread's priority: tried on a thread
/// of its own, which then ends.
fn may_raise() -> bool {
    // Named, so that its entry in /proc, which may linger a moment after
    // the join, is not taken for one of the store's threads.
    std::thread::Builder::new()
        .name(MAY_RAISE_PROBE.into())
        .spawn(|| {
            // SAFETY: plain integer arguments; `who` 0 is this thread.
            unsafe {
                let own = libc::getpriority(libc::PRIO_PROCESS, 0);
                own > -20 && libc::setpriority(libc::PRIO_PROCESS, 0, own - 1) == 0
            }
        })
        .expect("the probe thread starts")
        .join()
        .expect("the probe thread")
}

const MAY_RAISE_PROBE: &str = "may-raise-probe";

#[tokio::test]
async fn storage_threads_run_at_their_configured_priorities() {
    let own = threads()
        .into_iter()
        .map(|(_, n)| n)
        .min()
        .expect("this thread");
    let dir = tempfile::tempdir().expect("tempdir");
    let store = Store::open(
        dir.path(),
        ShardCount::new(2).expect("a power of two"),
        StoreConfig {
            background_nice: 7,
            writer_priority: 7,
            ..StoreConfig::default()
        },
    )
    .expect("open");
    let shards: Vec<_> = (0..2)
        .map(|s| {
            store
                .open_shard(ShardId(s), Epoch(1))
                .expect("the shard opens even if its writer may not be raised")
        })
        .collect();
    // One worker per shard by default. A new thread names itself once it
    // runs: wait (bounded) for both names.
    let fjall = || -> Vec<(String, i32)> {
        threads()
            .into_iter()
            .filter(|(name, _)| name.starts_with("fjall"))
            .collect()
    };
    let deadline = Instant::now() + Duration::from_secs(10);
    while fjall().len() < 2 {
        assert!(
            Instant::now() < deadline,
            "fjall's threads not found: {:?}",
            threads()
        );
        std::thread::yield_now();
    }
    let background = fjall();
    let want = (own + 7).min(19);
    assert_ne!(want, own, "run this test below nice 19");
    assert!(
        background.iter().all(|(_, n)| *n == want),
        "expected nice {want}: {background:?}"
    );
    // The first command of each shard is committed by its writer thread,
    // which tries to raise itself before anything else.
    for (n, shard) in shards.iter().enumerate() {
        let out = shard
            .start(StartRequest {
                epoch: Epoch(1),
                id: (1..)
                    .filter_map(|i| ExecutionId::new(i).ok())
                    .find(|id| id.partition().get() % 2 == n as u32)
                    .expect("an id on this shard"),
                workflow: "wf".into(),
                started_payload: b"{}".to_vec(),
                routing_key: None,
                idempotency_key: None,
            })
            .await
            .expect("a write through the writer");
        assert!(!out.existing);
    }
    // The shards' writers, and the node log's syncer, which every
    // acknowledged write may wait for as well.
    let writers: Vec<_> = threads()
        .into_iter()
        .filter(|(name, _)| name.ends_with("-writer") || name == "node-log-syncer")
        .collect();
    assert_eq!(writers.len(), 3, "{:?}", threads());
    let writer_at = if may_raise() { (own - 7).max(-20) } else { own };
    assert!(
        writers.iter().all(|(_, n)| *n == writer_at),
        "writers should be at {writer_at} (unprivileged: the process's own): {writers:?}"
    );
    // Everything else keeps the process's priority (the opening thread
    // lowered itself; it has been joined, but its entry may linger).
    assert!(
        threads()
            .iter()
            .filter(|(name, _)| {
                !name.starts_with("fjall")
                    && name != "shard-open"
                    && name != MAY_RAISE_PROBE
                    && !name.ends_with("-writer")
                    && name != "node-log-syncer"
            })
            .all(|(_, n)| *n == own),
        "{:?}",
        threads()
    );
}
