//! Real processes: a dead node's replacement joins a running three-node
//! cluster with no restart of the live nodes (`forkless cluster reload`,
//! and SIGHUP). Three nodes, four shards, three replicas of each (every
//! node holds every shard), under a steady write load:
//!
//! - node 1 is killed; node 4 is added to the cluster file. Left
//!   unpinned, the spread over four nodes moves shards: node 2's reload
//!   is refused, naming the placement, and changes nothing.
//! - pinned as `forkless cluster placement` prints it, node 2 reloads by
//!   `forkless cluster reload` and node 3 by SIGHUP; reading the same
//!   file again adds nothing. Node 4 starts, `remove-node 1 --to 4` moves
//!   node 1's four replicas to it, and it comes to lead the shards node 1
//!   was the preferred leader of. Node 1 cannot retire while it holds
//!   replicas; once they moved, it retires (`retired_nodes`) by a reload
//!   of every live node and leaves their node lists.
//!
//! Before reloads, the live nodes knew only the nodes of the file they
//! started on: adding node 4 meant restarting node 2 and node 3 on the
//! new file, and with node 1 dead each restart took every shard's quorum
//! away. Here nodes 2 and 3 run throughout (their pids are checked), and
//! every acknowledged write is at its seq on every replica.

use forkless_it::workload::{
    histogram, settle_verify_and_compare, spawn_writers, start_spread, Shared,
};
use forkless_it::*;
use serde_json::Value;
use std::time::Duration;

const SHARDS: u32 = 4;

fn node_ids(cl: &Cluster, via: u16) -> Vec<u64> {
    cl.client(via).get("/api/cluster").json()["nodes"]
        .as_array()
        .expect("nodes")
        .iter()
        .filter_map(|n| n["id"].as_u64())
        .collect()
}

/// The name of the cluster file node `id` runs on (every node runs on
/// one file here: a reload reads it again).
fn config_name(cl: &Cluster, id: u16) -> String {
    cl.node(id)
        .config
        .file_name()
        .expect("a config file")
        .to_string_lossy()
        .to_string()
}

/// Each shard's leader as node `via` sees it.
fn leaders(cl: &Cluster, via: u16) -> Vec<u16> {
    cl.owners(via).iter().map(|o| o.0).collect()
}

/// Waits until every shard is led by its preferred replica (shard s is
/// placed from the (s mod 3)-th node on: shards 0 to 3 prefer nodes 1, 2,
/// 3, 1), and returns the placement `forkless cluster placement` prints.
fn spread_and_placement(cl: &Cluster) -> String {
    wait_until(
        "every shard led by its preferred leader",
        Duration::from_secs(30),
        || (leaders(cl, 1) == [1, 2, 3, 1]).then_some(()),
    );
    let n1 = format!("http://{}", cl.node(1).api);
    let (code, out, err) = run_cli(
        &["cluster", "placement", "--server", &n1],
        Duration::from_secs(30),
    );
    assert_eq!(code, Some(0), "cluster placement failed: {out}\n{err}");
    out
}

/// Whether node `via` sees `peer` run with the same node list.
fn same_nodes(cl: &Cluster, via: u16, peer: u64) -> Option<bool> {
    cl.client(via).get("/api/cluster").json()["nodes"]
        .as_array()
        .expect("nodes")
        .iter()
        .find(|n| n["id"] == peer)
        .and_then(|n| n["same_nodes"].as_bool())
}

#[test]
fn a_dead_nodes_replacement_joins_with_no_restart_of_the_live_nodes() {
    let _deadline = deadline("reload a node in", Duration::from_secs(240));
    let mut cl = Cluster::prepare_replicated(3, SHARDS, 3, PeerTiming::default());
    // A new replica catches up by a snapshot of its shard.
    cl.raft_log = Some((20, 5));
    cl.start_all_replicated();
    let file_name = config_name(&cl, 2);
    assert_eq!(cl.node(3).config, cl.node(2).config);
    let pids = [cl.node(2).proc().pid(), cl.node(3).proc().pid()];

    let execs = start_spread(&cl.client(2), "reload", 2 * SHARDS, SHARDS);
    let shared = Shared::default();
    let via: Vec<Client> = [2, 3].iter().map(|n| cl.client(*n)).collect();
    let writers = spawn_writers(&via, &execs, 4, 4, 4, &shared);
    shared.wait_acks(200, "200 acknowledged writes before node 1 dies");

    cl.kill9(1);
    cl.wait_leaders_known(2, &[1]);
    let dead_at = shared.acks();
    shared.wait_acks(dead_at + 100, "100 acknowledged writes with node 1 dead");

    // Node 4 in the file the live nodes run on, the placement left to the
    // spread: refused, nothing changed.
    let four = cl.add_node();
    cl.write_config(&file_name, &[]);
    let n2 = format!("http://{}", cl.node(2).api);
    let (code, out) = cl.reload(&[2]);
    assert_eq!(code, Some(1), "a reload that moves shards was taken: {out}");
    assert!(
        out.contains("reload_refused")
            && out.contains("\"message\":\"placement: the cluster file moves")
            && out.contains("forkless cluster placement"),
        "the refusal does not name the placement and what to do: {out}"
    );
    assert_eq!(
        node_ids(&cl, 2),
        vec![1, 2, 3],
        "a refused reload changed the nodes"
    );
    // A node this one does not run with is no target of a move, and the
    // refusal says how it joins.
    let r = cl.client(2).post(
        "/api/cluster/remove-node",
        &serde_json::json!({"node": 1, "to": four}),
    );
    assert_eq!(r.status, 400, "{}", r.text());
    assert!(r.text().contains("forkless cluster reload"), "{}", r.text());

    // Pinned as the cluster prints it.
    let (code, out, err) = run_cli(
        &["cluster", "placement", "--server", &n2],
        Duration::from_secs(30),
    );
    assert_eq!(code, Some(0), "cluster placement failed: {out}\n{err}");
    cl.file_tail = out;
    let file = cl.write_config(&file_name, &[]);
    let (code, out) = cl.reload(&[2]);
    assert_eq!(code, Some(0), "reload failed: {out}");
    let answer: Value = serde_json::from_str(out.trim()).unwrap_or_else(|e| panic!("{e}: {out}"));
    assert_eq!(answer["reloaded"]["added"][0]["id"], four, "{answer}");
    assert_eq!(
        answer["reloaded"]["nodes"],
        serde_json::json!([1, 2, 3, 4]),
        "{answer}"
    );
    assert_eq!(
        answer["reloaded"]["restart_needed"],
        serde_json::json!([]),
        "{answer}"
    );
    // Node 3 not reloaded yet: node 2 sees it run with another list.
    wait_until(
        "node 2 to see node 3's node list differ",
        Duration::from_secs(10),
        || (same_nodes(&cl, 2, 3) == Some(false)).then_some(()),
    );
    let status = cl.status(2);
    assert!(
        status.contains("node(s) 3 run with another node list than node 2"),
        "{status}"
    );
    // Node 3 by SIGHUP.
    cl.node(3).proc().sighup();
    wait_until(
        "node 3 to take node 4 on SIGHUP",
        Duration::from_secs(10),
        || (node_ids(&cl, 3) == [1, 2, 3, 4]).then_some(()),
    );
    wait_until(
        "node 2 to see node 3's node list the same again",
        Duration::from_secs(10),
        || (same_nodes(&cl, 2, 3) == Some(true)).then_some(()),
    );
    // Read again, the same file adds nothing (both nodes answer).
    let (code, out) = cl.reload(&[2, 3]);
    assert_eq!(code, Some(0), "reload again failed: {out}");
    assert_eq!(out.matches("\"added\":[]").count(), 2, "{out}");

    cl.spawn(four, &file);
    cl.wait_ready(four);
    cl.wait_leaders_known(four, &[1]);
    // Node 1 cannot retire while it still holds replicas.
    cl.retired = vec![1];
    cl.write_config(&file_name, &[]);
    let (code, out) = cl.reload(&[2]);
    assert_eq!(code, Some(1), "node 1 retired holding replicas: {out}");
    assert!(
        out.contains(
            "retired_nodes: node 1 still holds replicas (a member of shard(s) 0, 1, 2, 3)"
        ),
        "{out}"
    );
    cl.retired.clear();
    cl.write_config(&file_name, &[]);
    let report = cl.remove_node(1, Some(four), 2);
    assert_eq!(report["complete"], true, "{report}");
    let moved = report["shards"]
        .as_array()
        .expect("a shards list")
        .iter()
        .filter(|s| s["changed"] == true)
        .count();
    assert_eq!(moved, SHARDS as usize, "node 1 held every shard: {report}");
    // Node 1 was the preferred leader of shards 0 and 3 (the first their
    // placement names): node 4, which took its place, comes to lead them.
    let leaders = wait_until(
        "node 4 to lead the shards node 1 was preferred for",
        Duration::from_secs(30),
        || {
            let owners = cl.owners(2);
            (owners[0].0 == four && owners[3].0 == four).then_some(owners)
        },
    );
    eprintln!("leaders after the move: {leaders:?}");
    let after = shared.acks();
    shared.wait_acks(after + 100, "100 acknowledged writes after the move");

    let metrics = cl.client(2).get("/metrics").text();
    assert!(
        metrics.contains("forkless_peer_up{node=\"1\"} 0"),
        "node 1 is not reported down before it retires"
    );
    // Its replicas moved, node 1 retires: out of every node's list.
    cl.retired = vec![1];
    cl.write_config(&file_name, &[]);
    let (code, out) = cl.reload(&[2, 3, four]);
    assert_eq!(code, Some(0), "retiring node 1 failed: {out}");
    assert_eq!(out.matches("\"retired\":[1]").count(), 3, "{out}");
    for n in [2, 3, four] {
        assert_eq!(node_ids(&cl, n), vec![2, 3, 4], "node {n}'s nodes");
    }
    let metrics = cl.client(2).get("/metrics").text();
    for line in [
        "forkless_cluster_reloads_total{outcome=\"taken\"} 3",
        "forkless_cluster_reloads_total{outcome=\"refused\"} 2",
    ] {
        assert!(metrics.contains(line), "no {line:?} in node 2's /metrics");
    }
    assert!(
        !metrics.contains("forkless_peer_up{node=\"1\"}"),
        "node 1 retired and is still reported"
    );
    let retired_at = shared.acks();
    shared.wait_acks(
        retired_at + 100,
        "100 acknowledged writes after node 1 retired",
    );
    // Node 1 started again on a file from before it retired (an operator
    // who missed the retirement): its groups still count it a voter and
    // call their old peers, which refuse it at hello, saying why, and the
    // cluster goes on without it.
    cl.retired.clear();
    let stale = cl.write_config("node-1-before-it-retired.toml", &[]);
    cl.retired = vec![1];
    cl.spawn(1, &stale);
    let log2 = cl.node(2).log.clone();
    wait_until(
        "node 2 to refuse the retired node's Raft calls",
        Duration::from_secs(30),
        || {
            std::fs::read_to_string(&log2)
                .ok()?
                .lines()
                .any(|l| {
                    l.contains("refused the Raft calls of a node that is not a peer")
                        && l.contains("node 1 is retired")
                })
                .then_some(())
        },
    );
    let stale_at = shared.acks();
    shared.wait_acks(
        stale_at + 100,
        "100 acknowledged writes with the retired node 1 running",
    );
    cl.kill9(1);
    assert_eq!(
        [cl.node(2).proc().pid(), cl.node(3).proc().pid()],
        pids,
        "a live node was restarted"
    );

    let mut batches = shared.finish(writers);
    eprintln!("answers: {:?}", histogram(&batches));
    settle_verify_and_compare(&mut cl, &mut batches, &execs, 3, &[2, 3, four], 400);
}

/// A node restarted at other addresses (another machine, say) with its
/// data: the others reload the file that moves it, with no restart of
/// their own, and reach it there. Before, a node's address changed only
/// with a restart of every node.
#[test]
fn a_node_restarted_elsewhere_is_reached_there_after_a_reload() {
    let _deadline = deadline("reload a moved node", Duration::from_secs(180));
    let mut cl = Cluster::prepare_replicated(3, SHARDS, 3, PeerTiming::default());
    cl.start_all_replicated();
    let file_name = config_name(&cl, 1);
    let pids = [cl.node(1).proc().pid(), cl.node(2).proc().pid()];
    let execs = start_spread(&cl.client(1), "moved", 2 * SHARDS, SHARDS);
    let shared = Shared::default();
    let via: Vec<Client> = [1, 2].iter().map(|n| cl.client(*n)).collect();
    let writers = spawn_writers(&via, &execs, 4, 4, 4, &shared);
    shared.wait_acks(100, "100 acknowledged writes before node 3 moves");

    cl.kill9(3);
    let old_api = cl.node(3).api;
    cl.move_node(3);
    let file = cl.write_config(&file_name, &[]);
    cl.spawn(3, &file);
    cl.wait_ready(3);
    let (code, out) = cl.reload(&[1, 2]);
    assert_eq!(code, Some(0), "reload failed: {out}");
    assert_eq!(out.matches("\"moved\":[{").count(), 2, "{out}");
    assert!(out.contains(&cl.node(3).api.to_string()), "{out}");
    for n in [1, 2] {
        let v = cl.client(n).get("/api/cluster").json();
        let three = v["nodes"]
            .as_array()
            .expect("nodes")
            .iter()
            .find(|x| x["id"] == 3)
            .cloned()
            .expect("node 3");
        assert_eq!(
            three["api_addr"],
            cl.node(3).api.to_string(),
            "node {n}: {three}"
        );
        assert_ne!(three["api_addr"], old_api.to_string());
    }
    // Node 3 is replicated to at its new address: it leads its preferred
    // shard again (the balancer hands it over once it is level), and its
    // replicas hold what the others hold.
    let leaders = wait_until(
        "node 3 to lead shard 2 again",
        Duration::from_secs(30),
        || {
            let owners = cl.owners(1);
            (owners[2].0 == 3).then_some(owners)
        },
    );
    eprintln!("leaders after node 3 moved: {leaders:?}");
    let after = shared.acks();
    shared.wait_acks(after + 100, "100 acknowledged writes after node 3 moved");
    assert_eq!(
        [cl.node(1).proc().pid(), cl.node(2).proc().pid()],
        pids,
        "a live node was restarted"
    );
    let mut batches = shared.finish(writers);
    settle_verify_and_compare(&mut cl, &mut batches, &execs, 1, &[1, 2, 3], 200);
}

/// A pin's replicas reordered (the same set) and every node reloaded: the
/// shard's preferred leader is its new first replica, and the leader
/// hands the shard to it. Before, a reload took the new order but the
/// balancer and `/api/cluster` kept the order each node started with, so
/// only a restart of every node moved a preferred leader.
#[test]
fn a_reordered_pin_hands_its_shard_to_the_new_first_replica() {
    let _deadline = deadline("reordered pin", Duration::from_secs(120));
    let mut cl = Cluster::prepare_replicated(3, SHARDS, 3, PeerTiming::default());
    cl.start_all_replicated();
    let file_name = config_name(&cl, 1);
    let out = spread_and_placement(&cl);
    let from = "shard = 0\nreplicas = [1, 2, 3]";
    assert!(out.contains(from), "{out}");
    cl.file_tail = out.replace(from, "shard = 0\nreplicas = [2, 1, 3]");
    cl.write_config(&file_name, &[]);
    let (code, out) = cl.reload(&[1, 2, 3]);
    assert_eq!(code, Some(0), "reload failed: {out}");
    assert!(!out.contains("restart_needed\":[\""), "{out}");
    // Each node now prints the placement in the new order.
    for n in [1, 2, 3] {
        let server = format!("http://{}", cl.node(n).api);
        let (code, out, err) = run_cli(
            &["cluster", "placement", "--server", &server],
            Duration::from_secs(30),
        );
        assert_eq!(code, Some(0), "cluster placement failed: {out}\n{err}");
        assert!(
            out.contains("shard = 0\nreplicas = [2, 1, 3]"),
            "node {n}: {out}"
        );
    }
    // Node 2 comes to lead shard 0; the other shards keep theirs.
    wait_until("node 2 to lead shard 0", Duration::from_secs(30), || {
        (leaders(&cl, 3) == [2, 2, 3, 1]).then_some(())
    });
}

/// A replica whose data directory was lost, back while its shard's leader
/// cannot confirm with a quorum that it leads (the third replica is
/// down), stays new and untold: the leader still takes it for level (it
/// matched every entry before the loss) and its node answers the
/// leader's heartbeat. Made the shard's preferred replica by a reload, it
/// is handed nothing until it caught up: its node's answer to the
/// heartbeat names the shards it cannot lead. Before, the leader handed
/// it the shard, the new replica refused, and the shard had no leader
/// until the third node came back (a new replica votes for no candidate
/// with entries). With the third back, it catches up and is handed the
/// shard.
#[test]
fn a_new_replica_is_handed_no_shard_before_it_caught_up() {
    let _deadline = deadline("new replica handed nothing", Duration::from_secs(120));
    let mut cl = Cluster::prepare_replicated(3, SHARDS, 3, PeerTiming::default());
    cl.start_all_replicated();
    let file_name = config_name(&cl, 1);
    let placement = spread_and_placement(&cl);
    let from = "shard = 0\nreplicas = [1, 2, 3]";
    assert!(placement.contains(from), "{placement}");
    // Shard 0 idle and quiet on node 1: every follower matched its last
    // entry.
    wait_until("shard 0 quiet on node 1", Duration::from_secs(30), || {
        let v = cl.client(1).get("/api/cluster").json();
        (v["shards"][0]["raft"]["quiet"] == true).then_some(())
    });
    cl.kill9(3);
    std::fs::remove_dir_all(&cl.node(3).data_dir).expect("wiped node 3's data directory");
    cl.kill9(2);
    // Node 3 comes to be shard 0's preferred replica on node 1.
    cl.file_tail = placement.replace(from, "shard = 0\nreplicas = [3, 1, 2]");
    let file = cl.write_config(&file_name, &[]);
    let (code, out) = cl.reload(&[1]);
    assert_eq!(code, Some(0), "reload failed: {out}");
    // Handovers node 1 tried (the first elections' winners hand shards to
    // their preferred replicas at start). Shard 0 is the only one node 1
    // could hand over from here on until node 2 is back: shard 3 prefers
    // node 1, and shards 1 and 2 have no leader.
    let (log1, log3) = (cl.node(1).log.clone(), cl.node(3).log.clone());
    let handovers = || {
        std::fs::read_to_string(&log1)
            .unwrap_or_default()
            .matches("handing the shard's leadership to its preferred replica")
            .count()
    };
    let before = handovers();
    cl.spawn(3, &file);
    cl.wait_ready(3);
    // Five balancer rounds (one a second) with node 3 answering node 1's
    // heartbeat: no handover is tried.
    let until = std::time::Instant::now() + Duration::from_secs(5);
    while std::time::Instant::now() < until {
        assert_eq!(
            handovers(),
            before,
            "node 1 handed shard 0 to node 3, new and not caught up\n{}",
            cl.logs()
        );
        std::thread::sleep(Duration::from_millis(50));
    }
    let v = cl.client(3).get("/api/cluster").json();
    assert_eq!(
        v["shards"][0]["raft"]["fresh"], true,
        "node 3 caught up with no quorum to confirm its leader: {v}"
    );
    assert_eq!(leaders(&cl, 1)[0], 1, "node 1 no longer leads shard 0");
    // Node 2 back: node 1 confirms, node 3 catches up and is handed
    // shard 0.
    cl.spawn(2, &file);
    cl.wait_ready(2);
    wait_until("node 3 to lead shard 0", Duration::from_secs(30), || {
        (leaders(&cl, 1)[0] == 3).then_some(())
    });
    assert!(
        !std::fs::read_to_string(&log3)
            .unwrap_or_default()
            .contains("refused a leadership handover"),
        "node 3 was handed a shard before it caught up\n{}",
        cl.logs()
    );
}
