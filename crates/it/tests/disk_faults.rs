//! Disk faults seen through the API of a real node: a shard whose log is
//! damaged is out of service and reported while the node's other shards
//! serve; a data directory on a small tmpfs that fills up (real ENOSPC)
//! answers the write in the failed commit with `503 executed: "unknown"`,
//! refuses every later write at once, never commits the failed write
//! later, and after space is freed and the node restarted holds exactly
//! what was acknowledged.
//!
//! The tmpfs needs root, as CI runs; as another user the test fails,
//! saying so.

use forkless_it::*;
use serde_json::json;
use std::time::Duration;

fn append(c: &Client, id: &str, t: &str, payload: &serde_json::Value) -> Resp {
    c.post(
        &format!("/api/executions/{id}/events"),
        &json!({"events": [{"type": t, "payload": payload}]}),
    )
}

#[test]
fn a_full_disk_fails_the_commit_as_unknown_and_nothing_failed_is_written_later() {
    let _d = deadline("full disk", Duration::from_secs(90));
    let fs = Tmpfs::new(24 * 1024 * 1024);
    let data = fs.mount.join("data");
    let mut node = Node::start_single(&data, &[]);
    let c = node.client;
    let id = c.start(&json!({"workflow": "w"}))["execution_id"]
        .as_str()
        .unwrap()
        .to_string();
    append(&c, &id, "before", &json!({"n": 1})).expect(200);

    let filler = fill(&fs.mount);
    let big = json!({"pad": "x".repeat(256 * 1024)});
    let failed = append(&c, &id, "failed", &big);
    let v = failed.expect_error(503, "shard_unavailable");
    assert_eq!(v["executed"], "unknown", "{v}");
    assert!(failed.header("retry-after").is_some());
    // Every later write is refused at once, nothing tried: executed false.
    for (what, r) in [
        ("append", append(&c, &id, "refused", &json!({}))),
        (
            "start",
            c.post("/api/executions", &json!({"workflow": "w"})),
        ),
    ] {
        let v = r.expect_error(503, "shard_unavailable");
        assert_eq!(v["executed"], false, "{what}: {v}");
    }
    std::fs::remove_file(&filler).unwrap();
    let v =
        append(&c, &id, "refused-after-free", &json!({})).expect_error(503, "shard_unavailable");
    assert_eq!(v["executed"], false, "{v}");
    // The node says which shard is out of service, and why.
    let ready = c.get("/readyz");
    ready.expect(200);
    let r = ready.json();
    assert_eq!(r["status"], "degraded", "{r}");
    assert_eq!(r["failed_shards"][0]["shard"], 0, "{r}");
    assert!(
        r["failed_shards"][0]["reason"]
            .as_str()
            .is_some_and(|s| s.contains("No space left on device")),
        "{r}"
    );
    assert_eq!(c.metric("forkless_store_shard_failed{shard=\"0\"}"), 1.0);
    // Reads still serve what was durable.
    assert_eq!(c.last_seq(&id), 2);

    // Restarted with space: exactly what was acknowledged (the failed
    // group reached the disk in part, and is cut off as a torn tail).
    node.restart();
    let types: Vec<String> = c
        .events(&id)
        .iter()
        .map(|e| e["type"].as_str().unwrap().to_string())
        .collect();
    assert_eq!(types, ["execution.started", "before"]);
    assert_eq!(c.get("/readyz").json()["status"], "ready");
    append(&c, &id, "after-restart", &big).expect(200);
    assert_eq!(c.last_seq(&id), 3);
}

/// Each group's header starts where the one before it ends.
fn group_starts(bytes: &[u8]) -> Vec<usize> {
    let mut out = Vec::new();
    let mut at = 0;
    while at + 8 <= bytes.len() {
        let len = u32::from_be_bytes(bytes[at..at + 4].try_into().unwrap()) as usize;
        if len == 0 {
            break;
        }
        out.push(at);
        at += 8 + len;
    }
    out
}

#[test]
fn a_damaged_shard_is_reported_and_the_others_serve() {
    let _d = deadline("damaged shard", Duration::from_secs(60));
    let tmp = tempfile::tempdir().unwrap();
    let data = tmp.path().join("data");
    let mut node = Node::start_single(&data, &["--shard-count", "2"]);
    let c = node.client;
    // Executions on both shards, a few events each.
    let mut on: [Vec<String>; 2] = [Vec::new(), Vec::new()];
    for i in 0..12 {
        let v = c.start(&json!({"workflow": "w", "routing_key": format!("k-{i}")}));
        let shard = v["shard"].as_u64().unwrap() as usize;
        let id = v["execution_id"].as_str().unwrap().to_string();
        for k in 0..3 {
            append(&c, &id, &format!("t{k}"), &json!({"k": k})).expect(200);
        }
        on[shard].push(id);
    }
    assert!(!on[0].is_empty() && !on[1].is_empty());
    // A crash (no checkpoint at close), then one flipped byte in an early
    // group of shard 1's log, with later groups after it.
    node.kill9();
    let seg = data.join("shards/1/eventlog/0000000000.seg");
    let mut bytes = std::fs::read(&seg).unwrap();
    let starts = group_starts(&bytes);
    assert!(starts.len() > 4);
    bytes[starts[2] + 12] ^= 0x01;
    std::fs::write(&seg, &bytes).unwrap();
    node.restart();

    let ready = c.get("/readyz");
    ready.expect(200);
    let r = ready.json();
    assert_eq!(r["status"], "degraded", "{r}");
    assert_eq!(r["failed_shards"].as_array().map(Vec::len), Some(1), "{r}");
    assert_eq!(r["failed_shards"][0]["shard"], 1, "{r}");
    let why = r["failed_shards"][0]["reason"].as_str().unwrap();
    assert!(
        why.contains("shard 1")
            && why.contains("segment 0")
            && why.contains(&format!("offset {}", starts[2])),
        "{why}"
    );
    let cluster = c.get("/api/cluster").json();
    assert!(cluster["shards"][1]["failed"].is_string(), "{cluster}");
    assert!(cluster["shards"][0].get("failed").is_none(), "{cluster}");
    assert_eq!(c.metric("forkless_store_shard_failed{shard=\"1\"}"), 1.0);
    assert_eq!(c.metric("forkless_store_shard_failed{shard=\"0\"}"), 0.0);
    assert!(node_log(&node).contains("the shard cannot be opened"));
    // Shard 0 serves reads and writes; shard 1 refuses, writing nothing.
    for id in &on[0] {
        assert_eq!(c.last_seq(id), 4);
        append(&c, id, "more", &json!({})).expect(200);
    }
    for id in &on[1] {
        let v = append(&c, id, "more", &json!({})).expect_error(503, "shard_unavailable");
        assert_eq!(v["executed"], false, "{v}");
    }
    let v = c
        .post(
            "/api/executions",
            &json!({"workflow": "w", "routing_key": "k-on-1"}),
        )
        .json();
    // The key's shard decides: either served (shard 0) or refused.
    assert!(
        v["execution_id"].is_string() || v["error"] == "shard_unavailable",
        "{v}"
    );
}

fn node_log(node: &Node) -> String {
    std::fs::read_to_string(&node.log).unwrap_or_default()
}

/// `forkless store check` as an operator runs it: refuses a running node's
/// folder, passes a healthy one (exit 0), fails a damaged one (exit 1,
/// naming the place), and names the flag of a malformed argument.
#[test]
fn store_check_from_the_command_line() {
    let _d = deadline("store check cli", Duration::from_secs(60));
    let tmp = tempfile::tempdir().unwrap();
    let data = tmp.path().join("data");
    let mut node = Node::start_single(&data, &[]);
    let c = node.client;
    for i in 0..10 {
        c.start(&json!({"workflow": "w", "input": {"i": i}}));
    }
    let dir = data.display().to_string();
    let t = Duration::from_secs(20);
    let (code, out, _) = run_cli(&["store", "check", "--data-dir", &dir], t);
    assert_eq!(code, Some(1), "{out}");
    assert!(
        out.contains("NOT CHECKED") && out.contains("running"),
        "{out}"
    );
    node.kill9();
    let (code, out, _) = run_cli(&["store", "check", "--data-dir", &dir], t);
    assert_eq!(code, Some(0), "{out}");
    assert!(
        out.contains("all 1 shards ok") && out.contains("10 events"),
        "{out}"
    );
    let seg = data.join("shards/0/eventlog/0000000000.seg");
    let mut bytes = std::fs::read(&seg).unwrap();
    let starts = group_starts(&bytes);
    bytes[starts[3] + 40] ^= 0x10;
    std::fs::write(&seg, &bytes).unwrap();
    let (code, out, _) = run_cli(&["store", "check", "--data-dir", &dir], t);
    assert_eq!(code, Some(1), "{out}");
    assert!(
        out.contains("DAMAGED") && out.contains(&format!("segment 0, offset {}", starts[3])),
        "{out}"
    );
    let (code, _, err) = run_cli(
        &[
            "store",
            "check",
            "--data-dir",
            &dir,
            "--truncate-after",
            "zero",
        ],
        t,
    );
    assert_eq!(code, Some(1));
    assert!(err.contains("--truncate-after"), "{err}");
    let (code, _, err) = run_cli(&["store", "check", "--data-dir", "/nonexistent"], t);
    assert_eq!(code, Some(1));
    assert!(
        err.contains("--data-dir") && err.contains("not a forkless data directory"),
        "{err}"
    );
}
