//! The storage engine's background threads run below the request path
//! (`StoreConfig::background_nice`). A file of its own: its own process,
//! so every storage thread it sees was started by this test.
#![cfg(target_os = "linux")]

use forkless_store::{Store, StoreConfig};
use forkless_types::{Epoch, ShardCount, ShardId};
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

#[test]
fn storage_background_threads_run_below_the_request_path() {
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
            ..StoreConfig::default()
        },
    )
    .expect("open");
    for s in 0..2 {
        store.open_shard(ShardId(s), Epoch(1)).expect("open shard");
    }
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
    // Everything else keeps the process's priority (the opening thread
    // lowered itself; it has been joined, but its entry may linger; the
    // shard writers run above it, see tests/priority.rs).
    assert!(
        threads()
            .iter()
            .filter(|(name, _)| {
                !name.starts_with("fjall") && name != "shard-open" && !name.ends_with("-writer")
            })
            .all(|(_, n)| *n == own),
        "{:?}",
        threads()
    );
}
