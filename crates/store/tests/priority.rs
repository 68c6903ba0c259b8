//! The shard writer runs `writer_priority` nice steps above the process's
//! main thread when the process may raise a thread's priority, and at the
//! main thread's priority (the shard still opening and writing) when it
//! may not. Alone in its test binary, so the only writer threads are its
//! own.

use forkless_store::*;
use forkless_types::{Epoch, ExecutionId, ShardCount, ShardId};

/// A thread's nice value, from /proc.
fn nice_of(tid: &str) -> i32 {
    let stat = std::fs::read_to_string(format!("/proc/self/task/{tid}/stat")).expect("stat");
    // Fields after the command name (which is in parentheses and may hold
    // spaces): state is field 3, nice field 19.
    let after = &stat[stat.rfind(')').expect("comm") + 2..];
    after
        .split(' ')
        .nth(19 - 3)
        .expect("nice field")
        .parse()
        .expect("a number")
}

fn threads_named(name: &str) -> Vec<String> {
    std::fs::read_dir("/proc/self/task")
        .expect("/proc/self/task")
        .filter_map(|e| {
            let tid = e.ok()?.file_name().into_string().ok()?;
            let comm = std::fs::read_to_string(format!("/proc/self/task/{tid}/comm")).ok()?;
            (comm.trim_end() == name).then_some(tid)
        })
        .collect()
}

/// Whether this process may raise a thread's priority: tried on a thread
/// of its own, which then ends.
fn may_raise() -> bool {
    std::thread::spawn(|| {
        // SAFETY: plain integer arguments; `who` 0 is this thread.
        unsafe {
            let own = libc::getpriority(libc::PRIO_PROCESS, 0);
            own > -20 && libc::setpriority(libc::PRIO_PROCESS, 0, own - 1) == 0
        }
    })
    .join()
    .expect("the probe thread")
}

#[cfg(target_os = "linux")]
#[tokio::test]
async fn the_writer_runs_above_the_request_path_when_allowed() {
    let main = nice_of(&std::process::id().to_string());
    let dir = tempfile::tempdir().expect("tempdir");
    let store = Store::open(
        dir.path(),
        ShardCount::ONE,
        StoreConfig {
            writer_priority: 7,
            ..StoreConfig::default()
        },
    )
    .expect("the store opens");
    let shard = store
        .open_shard(ShardId(0), Epoch(1))
        .expect("the shard opens even if its writer may not be raised");
    // The first command is committed by the writer thread, which tries
    // to raise itself before anything else.
    let out = shard
        .start(StartRequest {
            epoch: Epoch(1),
            id: ExecutionId::new(1).expect("an id"),
            workflow: "wf".into(),
            started_payload: b"{}".to_vec(),
            routing_key: None,
            idempotency_key: None,
        })
        .await
        .expect("a write through the writer");
    assert!(!out.existing);
    let writers = threads_named("shard-0-writer");
    assert_eq!(writers.len(), 1, "{writers:?}");
    let writer = nice_of(&writers[0]);
    if may_raise() {
        assert_eq!(writer, (main - 7).max(-20), "main thread at {main}");
    } else {
        assert_eq!(
            writer, main,
            "unprivileged: the writer stays at the main thread's priority"
        );
    }
    drop(shard);
    drop(store);
}
