//! `forkless dev-cluster`, run as a new user runs it: three replicated
//! nodes; one is killed and the others keep serving (a replicated cluster
//! is meant to outlive a node: the dev cluster used to stop every node
//! when one exited), and SIGTERM stops them all.

use forkless_it::*;
use std::time::Duration;

/// One dev cluster at a time: its ports are picked free but not held (the
/// dev cluster binds them), and two picked at once came out overlapping.
static ONE_AT_A_TIME: std::sync::Mutex<()> = std::sync::Mutex::new(());

fn one_at_a_time() -> std::sync::MutexGuard<'static, ()> {
    ONE_AT_A_TIME.lock().unwrap_or_else(|e| e.into_inner())
}

#[test]
fn a_replicated_dev_cluster_outlives_a_killed_node_and_stops_on_sigterm() {
    let _serial = one_at_a_time();
    let _deadline = deadline("dev-cluster", Duration::from_secs(120));
    let dir = tempfile::tempdir().expect("tempdir");
    let (mut dc, data, base) = dev_cluster(dir.path(), 4);
    let node = |i: u16| Client::new(addr(base + i - 1));
    let start = |c: &Client| {
        settled(Duration::from_secs(20), || {
            c.post("/api/executions", &serde_json::json!({"workflow": "dev"}))
        })
    };
    let r = start(&node(2));
    assert_eq!(r.status, 201, "{}", r.text());

    let pid = node_pid(&data, 1).expect("node 1's process");
    // SAFETY: kill(2) of a process the dev cluster started and still owns.
    unsafe {
        libc::kill(pid, libc::SIGKILL);
    }
    wait_until(
        "the dev cluster to report node 1",
        Duration::from_secs(10),
        || {
            strip_ansi(&dc.log())
                .contains("node 1 exited (signal: 9 (SIGKILL)); the others keep serving")
                .then_some(())
        },
    );
    assert!(
        dc.try_exit().is_none(),
        "dev-cluster stopped with node 1:\n{}",
        dc.log()
    );
    // The other two elect leaders for node 1's shards and take writes.
    for i in [2, 3] {
        let r = start(&node(i));
        assert_eq!(r.status, 201, "a start through node {i}: {}", r.text());
    }

    dc.sigterm();
    let status = dc
        .wait_exit(Duration::from_secs(20))
        .expect("dev-cluster stops on SIGTERM");
    assert!(status.success(), "{status}:\n{}", dc.log());
    for i in [2, 3] {
        assert!(
            node(i)
                .try_req("GET", "/healthz", &[], None, Duration::from_secs(2))
                .is_err(),
            "node {i} still serves after the dev cluster stopped"
        );
    }
}

/// `forkless dev-cluster --nodes 3 --shards <shards>` with its data under
/// `dir`, once it serves: its process, its data directory and its base
/// port (node i: clients on base + i - 1, peers on base + 100 + i - 1,
/// Raft on base + 200 + i - 1).
fn dev_cluster(dir: &std::path::Path, shards: u32) -> (Proc, std::path::PathBuf, u16) {
    let data = dir.join("dc");
    let base = free_port_block(&[0, 1, 2, 100, 101, 102, 200, 201, 202]);
    let args: Vec<String> = vec![
        "dev-cluster".to_string(),
        "--nodes".into(),
        "3".into(),
        "--shards".into(),
        shards.to_string(),
        "--data-dir".into(),
        data.display().to_string(),
        "--base-port".into(),
        base.to_string(),
    ];
    let mut dc = Proc::spawn(&args, &dir.join("dev-cluster.log"));
    wait_until("the dev cluster to serve", Duration::from_secs(60), || {
        let out = strip_ansi(&dc.log());
        assert!(dc.try_exit().is_none(), "dev-cluster exited:\n{out}");
        out.contains("press Ctrl-C").then_some(())
    });
    (dc, data, base)
}

/// The pid of the dev cluster's node `id`, found by its data directory
/// under `data`, while it runs (a zombie does not count).
fn node_pid(data: &std::path::Path, id: u16) -> Option<i32> {
    let dir = data.join(format!("node-{id}")).display().to_string();
    std::fs::read_dir("/proc")
        .expect("/proc")
        .filter_map(|e| e.ok()?.file_name().to_str()?.parse::<i32>().ok())
        .find(|pid| {
            std::fs::read(format!("/proc/{pid}/cmdline")).is_ok_and(|c| {
                let args: Vec<String> = c
                    .split(|b| *b == 0)
                    .map(|a| String::from_utf8_lossy(a).into_owned())
                    .collect();
                args.iter().any(|a| a == "serve") && args.contains(&dir)
            })
        })
}

/// A dev cluster killed with SIGKILL (it cannot stop its nodes itself)
/// takes its nodes with it: each gets SIGTERM as its parent ends. Before,
/// they ran on, holding their ports (CI found two left an hour after a
/// failed test).
#[test]
fn a_killed_dev_cluster_takes_its_nodes_with_it() {
    let _serial = one_at_a_time();
    let _deadline = deadline("dev-cluster killed", Duration::from_secs(60));
    let dir = tempfile::tempdir().expect("tempdir");
    let (mut dc, data, _) = dev_cluster(dir.path(), 2);
    for id in 1..=3 {
        assert!(node_pid(&data, id).is_some(), "node {id} is not running");
    }
    dc.kill9();
    wait_until(
        "every node to end with the dev cluster",
        Duration::from_secs(20),
        || {
            (1..=3)
                .all(|id| node_pid(&data, id).is_none())
                .then_some(())
        },
    );
}
