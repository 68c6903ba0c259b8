//! A data directory written by a binary of the format before the node log
//! (a log per shard; `fixtures/shard-logs-v1.tar.gz`, made by
//! `fixtures/make-shard-logs-v1.sh` with the build of e90375b and killed
//! with SIGKILL after its writes) opens with today's binary and keeps
//! every acknowledged event: the first open replays each shard's own log
//! from its checkpoint, its events stay where they are and are read there,
//! its idempotency keys still deduplicate, and new writes go to the node
//! log. `tar` unpacks it (Debian has it; the test fails if it does not).

use forkless_it::*;
use serde_json::{json, Value};
use std::collections::BTreeMap;
use std::path::Path;
use std::process::Command;
use std::time::Duration;

fn unpack(to: &Path) {
    let fixture = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/shard-logs-v1.tar.gz");
    let status = Command::new("tar")
        .arg("-C")
        .arg(to)
        .arg("-xzf")
        .arg(&fixture)
        .status()
        .expect("tar runs (this test needs it to unpack its fixture)");
    assert!(status.success(), "unpacking {}", fixture.display());
}

fn expected() -> BTreeMap<String, Vec<Value>> {
    let path = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/expected.json");
    serde_json::from_str(&std::fs::read_to_string(&path).expect("expected.json")).expect("json")
}

fn segment_files(dir: &Path) -> BTreeMap<String, Vec<u8>> {
    let mut out = BTreeMap::new();
    for shard in std::fs::read_dir(dir.join("shards")).expect("shards/") {
        let log = shard.expect("dirent").path().join("eventlog");
        for seg in std::fs::read_dir(&log).expect("a shard's own log") {
            let p = seg.expect("dirent").path();
            if p.extension().is_some_and(|x| x == "seg") {
                out.insert(p.display().to_string(), std::fs::read(&p).expect("read"));
            }
        }
    }
    out
}

/// Every execution's events read back exactly as the old binary
/// acknowledged them (seq, type, payload, key, recorded time).
fn same_events(c: &Client, want: &BTreeMap<String, Vec<Value>>, what: &str) {
    for (id, events) in want {
        assert_eq!(&c.events(id), events, "{what}: execution {id}");
    }
}

#[test]
fn a_data_directory_of_shard_logs_opens_with_every_event() {
    let _d = deadline("migration", Duration::from_secs(90));
    let tmp = tempfile::tempdir().unwrap();
    unpack(tmp.path());
    let data = tmp.path().join("data");
    assert!(
        !data.join("log").exists(),
        "the fixture is of the format before"
    );
    let before = segment_files(&data);
    assert_eq!(before.len(), 2, "a segment each for the two shards");
    let want = expected();
    assert_eq!(want.len(), 8);

    let mut node = Node::start_single(&data, &["--shard-count", "2"]);
    let c = node.client;
    same_events(&c, &want, "first open");
    // A key the old binary recorded deduplicates: answered with the
    // original seq, nothing written.
    let (id, keyed) = want
        .iter()
        .find_map(|(id, evs)| {
            evs.iter()
                .find(|e| e["idempotency_key"].is_string())
                .map(|e| (id.clone(), e.clone()))
        })
        .expect("a keyed event");
    let retry = c.post(
        &format!("/api/executions/{id}/events"),
        &json!({"events": [{
            "type": keyed["type"],
            "payload": keyed["payload"],
            "idempotency_key": keyed["idempotency_key"],
        }]}),
    );
    retry.expect(200);
    let v = retry.json();
    assert_eq!(v["deduplicated"], true, "{v}");
    assert_eq!(v["first_seq"], keyed["seq"], "{v}");
    // New writes go to the node log.
    let last = c.last_seq(&id);
    c.post(
        &format!("/api/executions/{id}/events"),
        &json!({"events": [{"type": "after-the-move", "payload": {}}]}),
    )
    .expect(200);
    assert_eq!(c.last_seq(&id), last + 1);
    assert!(data.join("log").exists());

    node.restart();
    same_events(
        &c,
        &want
            .iter()
            .filter(|(k, _)| **k != id)
            .map(|(k, v)| (k.clone(), v.clone()))
            .collect(),
        "reopened",
    );
    assert_eq!(c.last_seq(&id), last + 1);
    node.kill9();
    assert_eq!(
        segment_files(&data),
        before,
        "nothing is written to a shard's own log once it moved"
    );
    let dir = data.display().to_string();
    let (code, out, _) = run_cli(
        &["store", "check", "--data-dir", &dir],
        Duration::from_secs(20),
    );
    assert_eq!(code, Some(0), "{out}");
    assert!(out.contains("all 2 shards ok"), "{out}");
}
