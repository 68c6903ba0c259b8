//! Directory entries are durable: every folder the node creates for its
//! data (the data directory, `shards/`, `shards/<n>`, the node log's folder) is
//! synced into its parent before the shard takes its first write, so a
//! crash cannot make an acknowledged shard vanish with its folder. Read
//! off the real system calls of a real node with strace (which `.ci/run`
//! installs); without strace the test fails, saying so.

use forkless_it::*;
use serde_json::json;
use std::collections::HashMap;
use std::path::Path;
use std::process::{Command, Stdio};
use std::time::Duration;

/// One system call of the trace: the thread, its name and arguments'
/// text, and its result.
struct Call {
    _thread: u32,
    name: String,
    args: String,
    result: i64,
}

fn parse(trace: &str) -> Vec<Call> {
    trace
        .lines()
        .filter_map(|l| {
            let (pid, rest) = l.split_once(' ')?;
            let pid = pid.trim().parse().ok()?;
            let rest = rest.trim_start();
            let open = rest.find('(')?;
            // strace pads a short call: `fsync(9)      = 0`.
            let eq = rest.rfind(" = ")?;
            let close = rest[..eq].rfind(')')?;
            let result = rest[eq + 3..].split_whitespace().next()?.parse().ok()?;
            Some(Call {
                _thread: pid,
                name: rest[..open].to_string(),
                args: rest[open + 1..close].to_string(),
                result,
            })
        })
        .collect()
}

/// The quoted path among a call's arguments.
fn path_arg(args: &str) -> Option<&str> {
    let start = args.find('"')? + 1;
    let end = start + args[start..].find('"')?;
    Some(&args[start..end])
}

#[test]
fn every_data_folder_is_synced_into_its_parent_before_the_first_write() {
    let _d = deadline("durable dirs", Duration::from_secs(60));
    let strace = Command::new("strace").arg("-V").output();
    assert!(
        strace.is_ok_and(|o| o.status.success()),
        "strace is needed to read the node's system calls (Debian: apt-get install strace; .ci/run installs it)"
    );
    let tmp = tempfile::tempdir().unwrap();
    let base = tmp.path().join("base");
    std::fs::create_dir(&base).unwrap();
    let data = base.join("data");
    let trace_path = tmp.path().join("trace");
    let port = free_ports(1)[0];
    let mut strace = Command::new("strace")
        .args([
            "-f",
            "-qq",
            "-e",
            "trace=mkdir,mkdirat,openat,fsync,fdatasync,pwrite64",
            "-o",
        ])
        .arg(&trace_path)
        .arg(forkless_bin())
        .args(["serve", "--listen", &addr(port).to_string(), "--data-dir"])
        .arg(&data)
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .expect("strace starts");
    let client = Client::new(addr(port));
    wait_until("the node is ready", Duration::from_secs(30), || {
        client.ready().then_some(())
    });
    client.start(&json!({"workflow": "w"}));
    // SIGTERM to the node (strace's child), then strace ends with it.
    let node_pid = wait_until("the node's pid", Duration::from_secs(5), || {
        let children = std::fs::read_to_string(format!(
            "/proc/{}/task/{}/children",
            strace.id(),
            strace.id()
        ))
        .ok()?;
        children.split_whitespace().next()?.parse::<i32>().ok()
    });
    // SAFETY: kill(2) on the node we started (strace's only child).
    unsafe {
        libc::kill(node_pid, libc::SIGTERM);
    }
    let _ = strace.wait();
    let calls = parse(&std::fs::read_to_string(&trace_path).unwrap());
    assert!(calls.len() > 50, "{} calls traced", calls.len());

    // Which path each descriptor names, as of each call (one process: its
    // threads share one table; strace names the thread).
    let mut fds: HashMap<i64, String> = HashMap::new();
    let mut made: HashMap<String, usize> = HashMap::new();
    let mut synced: Vec<(usize, String)> = Vec::new();
    let mut first_log_write = None;
    for (i, c) in calls.iter().enumerate() {
        match c.name.as_str() {
            "mkdir" | "mkdirat" if c.result == 0 => {
                if let Some(p) = path_arg(&c.args) {
                    made.entry(p.to_string()).or_insert(i);
                }
            }
            "openat" if c.result >= 0 => {
                if let Some(p) = path_arg(&c.args) {
                    fds.insert(c.result, p.to_string());
                }
            }
            "fsync" | "fdatasync" => {
                let fd: i64 = c.args.trim().parse().unwrap_or(-1);
                if let Some(p) = fds.get(&fd) {
                    synced.push((i, p.clone()));
                }
            }
            "pwrite64" => {
                let fd: i64 = c
                    .args
                    .split(',')
                    .next()
                    .and_then(|f| f.trim().parse().ok())
                    .unwrap_or(-1);
                if fds.get(&fd).is_some_and(|p| p.ends_with(".seg")) && first_log_write.is_none() {
                    first_log_write = Some(i);
                }
            }
            _ => {}
        }
    }
    let first_write = first_log_write.expect("the start wrote a log group");
    let shards = data.join("shards");
    let shard = shards.join("0");
    let log = data.join("log");
    for (child, parent) in [
        (&data, &base),
        (&shards, &data),
        (&shard, &shards),
        (&log, &data),
    ] {
        let child = child.display().to_string();
        let parent: &Path = parent;
        let parent = parent.display().to_string();
        let at = *made
            .get(&child)
            .unwrap_or_else(|| panic!("{child} was not created by the node"));
        assert!(
            synced
                .iter()
                .any(|(i, p)| *i > at && *i < first_write && *p == parent),
            "{child} was created (call {at}) but {parent} was not synced before the first write of the log (call {first_write})"
        );
    }
}
