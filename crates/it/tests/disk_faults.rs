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

/// Damage in the node log (every shard has writes in it) stops the node
/// from starting, with an error naming the segment and offset; `forkless
/// store check` names the same place and the cut that drops it; after
/// the cut the node starts and serves what was acknowledged before the
/// damaged round, on every shard, and takes writes.
#[test]
fn damage_in_the_node_log_stops_the_node_until_the_check_cuts_it() {
    let _d = deadline("damaged node log", Duration::from_secs(90));
    let tmp = tempfile::tempdir().unwrap();
    let data = tmp.path().join("data");
    let mut node = Node::start_single(&data, &["--shard-count", "2"]);
    let c = node.client;
    // One request at a time: each acknowledged command is a round of its
    // own, in this order.
    let mut acked: Vec<(String, u64)> = Vec::new();
    let mut shards = [false, false];
    let seg = data.join("log/2147483648.seg");
    // The rounds written before any command (under Raft, each shard's
    // group's membership, votes and its leader's first entry).
    let before = group_starts(&std::fs::read(&seg).unwrap()).len();
    for i in 0..8 {
        let v = c.start(&json!({"workflow": "w", "routing_key": format!("k-{i}")}));
        shards[v["shard"].as_u64().unwrap() as usize] = true;
        let id = v["execution_id"].as_str().unwrap().to_string();
        acked.push((id.clone(), 1));
        for k in 0..3 {
            append(&c, &id, &format!("t{k}"), &json!({"k": k})).expect(200);
            acked.push((id.clone(), k + 2));
        }
    }
    assert_eq!(shards, [true, true], "executions on both shards");
    // A crash (no checkpoint at close: the restart replays from the
    // open's), then one flipped byte in an early round, with later rounds
    // after it.
    node.kill9();
    let mut bytes = std::fs::read(&seg).unwrap();
    let starts = group_starts(&bytes)[before..].to_vec();
    assert_eq!(starts.len(), acked.len(), "a round per command");
    let damaged = 10;
    bytes[starts[damaged] + 12] ^= 0x01;
    std::fs::write(&seg, &bytes).unwrap();
    let place = format!("segment 2147483648, offset {}", starts[damaged]);
    let (status, log) = node.restart_expecting_refusal(Duration::from_secs(30));
    assert!(!status.success(), "{status}");
    assert!(log.contains(&place) && log.contains("bad group"), "{log}");
    assert_eq!(log.matches(&place).count(), 1, "said once: {log}");

    let dir = data.display().to_string();
    let t = Duration::from_secs(20);
    let (code, out, _) = run_cli(&["store", "check", "--data-dir", &dir], t);
    assert_eq!(code, Some(1), "{out}");
    let cut = format!("2147483648:{}", starts[damaged]);
    assert!(
        out.contains("DAMAGED")
            && out.contains(&place)
            && out.contains(&format!("--truncate-after {cut}")),
        "{out}"
    );
    // A cut of the node log needs no --shard: it is every shard's.
    let (code, out, err) = run_cli(
        &[
            "store",
            "check",
            "--data-dir",
            &dir,
            "--truncate-after",
            &cut,
        ],
        t,
    );
    assert_eq!(code, Some(0), "{out}{err}");
    assert!(
        out.contains("every shard") && out.contains("all 2 shards ok"),
        "{out}"
    );

    node.restart();
    assert_eq!(c.get("/readyz").json()["status"], "ready");
    // What was acknowledged before the damaged round is there, and
    // nothing after it.
    let (kept, dropped) = acked.split_at(damaged);
    let last_kept = |id: &str| kept.iter().filter(|(k, _)| k == id).map(|(_, s)| *s).max();
    for (id, _) in kept.iter().chain(dropped) {
        let r = c.get(&format!("/api/executions/{id}"));
        match last_kept(id) {
            Some(seq) => assert_eq!(c.last_seq(id), seq, "{id}"),
            None => assert_eq!(r.status, 404, "{id}: {}", r.text()),
        }
    }
    let (id, seq) = &kept[kept.len() - 1];
    append(&c, id, "after-the-cut", &json!({})).expect(200);
    assert_eq!(c.last_seq(id), seq + 1);
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
    let seg = data.join("log/2147483648.seg");
    let mut bytes = std::fs::read(&seg).unwrap();
    let starts = group_starts(&bytes);
    // A round of a start (the group's own first rounds come before the
    // starts'), with rounds after it: damage, not a torn tail.
    let damaged = starts[starts.len() - 3];
    bytes[damaged + 40] ^= 0x10;
    std::fs::write(&seg, &bytes).unwrap();
    let (code, out, _) = run_cli(&["store", "check", "--data-dir", &dir], t);
    assert_eq!(code, Some(1), "{out}");
    assert!(
        out.contains("DAMAGED") && out.contains(&format!("segment 2147483648, offset {damaged}")),
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
