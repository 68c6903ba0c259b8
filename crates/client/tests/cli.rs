//! The `forkless` client verbs as a user runs them: JSON lines on stdout,
//! a refusal as one JSON object on stderr with exit code 1.

use std::process::{Command, Stdio};
use std::time::Duration;

mod common;
use common::{forkless_bin, free_ports, Node};

struct Out {
    code: Option<i32>,
    stdout: String,
    stderr: String,
}

fn forkless(server: &str, args: &[&str]) -> Out {
    let o = Command::new(forkless_bin())
        .args(args)
        .env("FORKLESS_SERVER", server)
        .stdin(Stdio::null())
        .output()
        .expect("running forkless");
    Out {
        code: o.status.code(),
        stdout: String::from_utf8_lossy(&o.stdout).into_owned(),
        stderr: String::from_utf8_lossy(&o.stderr).into_owned(),
    }
}

fn json(line: &str) -> serde_json::Value {
    serde_json::from_str(line).unwrap_or_else(|e| panic!("not JSON ({e}): {line:?}"))
}

#[test]
fn verbs_print_json_and_refusals_exit_1() {
    let dir = tempfile::tempdir().expect("tempdir");
    let port = free_ports(1)[0];
    let listen = format!("127.0.0.1:{port}");
    let data = dir.path().join("data");
    let node = Node::spawn(
        &[
            "--data-dir",
            data.to_str().expect("utf-8"),
            "--listen",
            &listen,
        ],
        port,
        dir.path().join("node.log"),
    );
    let s = node.url();

    let o = forkless(&s, &["start", "--workflow", "w", "--input", r#"{"a":1}"#]);
    assert_eq!(o.code, Some(0), "{}", o.stderr);
    let started = json(o.stdout.trim());
    let id = started["execution_id"]
        .as_str()
        .expect("id string")
        .to_string();

    let o = forkless(
        &s,
        &[
            "append",
            &id,
            "--type",
            "t",
            "--payload",
            "1",
            "--expected-last-seq",
            "1",
        ],
    );
    assert_eq!(o.code, Some(0), "{}", o.stderr);
    assert_eq!(json(o.stdout.trim())["last_seq"], 2);

    // A conflict: error JSON on stderr, nothing on stdout, exit 1.
    let o = forkless(
        &s,
        &["append", &id, "--type", "t", "--expected-last-seq", "1"],
    );
    assert_eq!(o.code, Some(1));
    assert!(o.stdout.is_empty());
    let e = json(o.stderr.trim());
    assert_eq!(e["error"], "sequence_conflict");
    assert_eq!(e["last_seq"], 2);
    assert_eq!(e["http_status"], 409);

    // Bad input is caught before sending, with a hint.
    let o = forkless(&s, &["append", &id, "--type", "t", "--payload", "hello"]);
    assert_eq!(o.code, Some(1));
    assert!(o.stderr.contains("--payload must be JSON"), "{}", o.stderr);

    // Follow in the background; completing the execution ends it.
    let follower = Command::new(forkless_bin())
        .args(["events", &id, "--follow", "--server", &s])
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("spawning events --follow");
    std::thread::sleep(Duration::from_millis(300));
    let o = forkless(&s, &["signal", &id, "--name", "go"]);
    assert_eq!(o.code, Some(0), "{}", o.stderr);
    let o = forkless(&s, &["append", &id, "--type", "execution.completed"]);
    assert_eq!(o.code, Some(0), "{}", o.stderr);
    let out = follower.wait_with_output().expect("follower output");
    assert!(out.status.success());
    let types: Vec<String> = String::from_utf8_lossy(&out.stdout)
        .lines()
        .map(|l| json(l)["type"].as_str().unwrap_or("?").to_string())
        .collect();
    assert_eq!(
        types,
        [
            "execution.started",
            "t",
            "execution.signaled",
            "execution.completed"
        ]
    );

    let o = forkless(&s, &["events", &id, "--after", "1", "--limit", "2"]);
    assert_eq!(o.code, Some(0), "{}", o.stderr);
    let seqs: Vec<u64> = o
        .stdout
        .lines()
        .filter_map(|l| json(l)["seq"].as_u64())
        .collect();
    assert_eq!(seqs, [2, 3]);

    let o = forkless(&s, &["cancel", &id]);
    assert_eq!(o.code, Some(1));
    assert_eq!(json(o.stderr.trim())["error"], "execution_closed");

    let o = forkless(&s, &["get", "999"]);
    assert_eq!(o.code, Some(1));
    assert_eq!(json(o.stderr.trim())["error"], "execution_not_found");

    let o = forkless(&s, &["status"]);
    assert_eq!(o.code, Some(0), "{}", o.stderr);
    assert!(o.stdout.contains("1 shard"), "{}", o.stdout);
    let o = forkless(&s, &["status", "--json"]);
    assert_eq!(json(o.stdout.trim())["shard_count"], 1);

    drop(node);
    let o = forkless(&s, &["get", &id]);
    assert_eq!(o.code, Some(1));
    let e = json(o.stderr.trim());
    assert_eq!(e["error"], "transport");
    assert_eq!(e["executed"], false);
}
