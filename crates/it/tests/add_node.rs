//! Real processes: a node the cluster file did not list joins a running
//! replicated cluster and takes over a dead node's replicas. Four nodes,
//! eight shards, three replicas of each, placed by the cluster file's
//! spread (nothing pinned). Node 5 is added to the file:
//!
//! - left unpinned, the spread over five nodes moves shards; a node
//!   restarted on that file refuses to start (its own record of the
//!   placement its groups were made with), and so does node 5 (a peer's
//!   record). Without the refusal, node 3 would open new, empty replicas
//!   of shards the new spread gives it (shard 7: nodes 3, 4 and 5, where
//!   its group is on nodes 4, 1 and 2) and initialize them with that
//!   membership, and node 5 likewise: two new replicas of three, a quorum
//!   of their own, a second group for the shard.
//! - pinned as `forkless cluster placement` prints it, every node
//!   restarts on the new file one by one and node 5 starts holding no
//!   replica; node 1 is killed and `forkless cluster remove-node 1 --to
//!   5` moves its replicas to node 5, under a steady write load, and node
//!   5 comes to lead the shards node 1 was the preferred leader of. Then
//!   writes go through node 5, every acknowledged write is at its seq,
//!   and every replica of a shard holds the same events.

use forkless_it::workload::{
    histogram, settle_verify_and_compare, spawn_writers, start_spread, Shared,
};
use forkless_it::*;
use serde_json::Value;
use std::time::Duration;

const SHARDS: u32 = 8;

#[test]
fn a_node_added_to_the_file_joins_once_the_placement_is_pinned() {
    let _deadline = deadline("add a node", Duration::from_secs(240));
    let mut cl = Cluster::prepare_replicated(4, SHARDS, 3, PeerTiming::default());
    // A new replica catches up by a snapshot of its shard.
    cl.raft_log = Some((20, 5));
    cl.start_all_replicated();
    let first_file = cl.node(3).config.clone();

    let execs = start_spread(&cl.client(2), "grow", 2 * SHARDS, SHARDS);
    let shared = Shared::default();
    // Through nodes 2 to 4 (node 1 dies for good), and node 5 once it runs.
    let via: Vec<Client> = [2, 3, 4].iter().map(|n| cl.client(*n)).collect();
    let writers = spawn_writers(&via, &execs, 4, 4, 4, &shared);
    let acked_at_least = |n: usize, what: &str| shared.wait_acks(n, what);
    acked_at_least(200, "200 acknowledged writes before node 5 is added");

    // Node 5 in the file, the placement left to the spread.
    let five = cl.add_node();
    let unpinned = cl.write_config("cluster-v2-unpinned.toml", &[]);
    let (status, log) = cl.start_expecting_refusal(3, &unpinned, Duration::from_secs(30));
    let log = strip_ansi(&log);
    assert!(!status.success(), "node 3 started on a moved placement");
    assert!(
        log.contains("moves 6 shard(s)")
            && log.contains("as this node's record")
            && log.contains("shard 7 on [3, 4, 5], not [4, 1, 2]")
            && log.contains("forkless cluster placement"),
        "node 3's refusal does not say what moved and what to do:\n{log}"
    );
    cl.restart(3, Some(&first_file));
    cl.wait_leaders_known(3, &[]);
    let (status, log) = cl.start_expecting_refusal(five, &unpinned, Duration::from_secs(30));
    let log = strip_ansi(&log);
    assert!(!status.success(), "node 5 started on a moved placement");
    assert!(
        log.contains("as node ") && log.contains("shard 7 on [3, 4, 5], not [4, 1, 2]"),
        "node 5's refusal does not name the peer whose placement differs:\n{log}"
    );
    // It recorded nothing: started again on the right file, it asks again.
    assert!(
        !cl.node(five).data_dir.join("placement.json").exists(),
        "node 5 recorded a placement it was refused on"
    );

    // Pinned as the cluster prints it.
    let server = format!("http://{}", cl.node(2).api);
    let (code, out, err) = run_cli(
        &["cluster", "placement", "--server", &server],
        Duration::from_secs(30),
    );
    assert_eq!(code, Some(0), "cluster placement failed: {out}\n{err}");
    assert!(
        out.contains("[[placement]]\nshard = 7\nreplicas = [4, 1, 2]\n"),
        "{out}"
    );
    cl.file_tail = out;
    let pinned = cl.write_config("cluster-v2.toml", &[]);
    // One by one, each waiting for every shard's leader to be known.
    for n in 1..=4 {
        cl.restart(n, Some(&pinned));
        cl.wait_leaders_known(n, &[]);
    }
    cl.spawn(five, &pinned);
    cl.wait_ready(five);
    cl.wait_leaders_known(five, &[]);
    let v = cl.client(five).get("/api/cluster").json();
    let hosted: Vec<&Value> = v["shards"]
        .as_array()
        .expect("shards")
        .iter()
        .filter(|s| s["raft"].is_object())
        .collect();
    assert!(
        hosted.is_empty(),
        "node 5 holds replicas the pinned file does not give it: {hosted:?}"
    );
    let before = shared.acks();
    acked_at_least(
        before + 100,
        "100 acknowledged writes after the rolling restart",
    );

    // Node 1 dies; its six replicas move to node 5.
    cl.kill9(1);
    cl.wait_leaders_known(2, &[1]);
    let started = std::time::Instant::now();
    let report = cl.remove_node(1, Some(5), 2);
    eprintln!(
        "remove-node 1 --to 5 took {:?}: {report}",
        started.elapsed()
    );
    assert_eq!(report["complete"], true, "{report}");
    let shards = report["shards"].as_array().expect("a shards list");
    let moved = shards.iter().filter(|s| s["changed"] == true).count();
    assert_eq!(moved, 6, "node 1 held six replicas: {report}");
    for s in shards {
        let voters: Vec<u64> = s["voters"]
            .as_array()
            .expect("voters")
            .iter()
            .filter_map(Value::as_u64)
            .collect();
        assert!(!voters.contains(&1), "{s}");
        assert_eq!(voters.contains(&5), s["changed"] == true, "{s}");
    }
    // Node 1 was the preferred leader of shards 0 and 4 (the first their
    // placement names): node 5, which took its place, comes to lead them,
    // and every other node its own two.
    let leaders = wait_until(
        "node 5 to lead the shards node 1 was preferred for",
        Duration::from_secs(30),
        || {
            let owners = cl.owners(2);
            let led = |n: u16| owners.iter().filter(|(o, _)| *o == n).count();
            (owners[0].0 == five && owners[4].0 == five && (2..=4).all(|n| led(n) == 2))
                .then_some(owners)
        },
    );
    eprintln!("leaders after the move: {leaders:?}");
    let after = shared.acks();
    acked_at_least(after + 100, "100 acknowledged writes after the move");

    // Writes through the new node, to every execution.
    let c5 = cl.client(five);
    for e in &execs {
        let r = settled(Duration::from_secs(20), || {
            c5.get(&format!("/api/executions/{e}"))
        });
        assert_eq!(r.status, 200, "{e} through node 5: {}", r.text());
    }
    let mut batches = shared.finish(writers);
    eprintln!("answers: {:?}", histogram(&batches));
    settle_verify_and_compare(&mut cl, &mut batches, &execs, 3, &[2, 3, 4, five], 400);
}

/// A node that skipped the start-up check of the placement takes no part
/// in the cluster's groups. Node 3 lost its record of the placement and
/// started while every other node was down, on a file with node 5 added
/// and nothing pinned (the spread moved): with no record and no peer to
/// ask, it recorded the file's placement, and node 5, asking node 3,
/// agreed. The two then made new groups of the shards the new spread
/// gives them, shard 7 among them (nodes 3, 4 and 5, where its group is
/// on nodes 4, 1 and 2), and elected a leader of it between them: a
/// second group of shard 7. Once nodes 1, 2 and 4 run again, their Raft
/// transports refuse the two nodes' calls (their placements' fingerprints
/// differ at hello), and their directories do not take the two nodes'
/// word for who leads: every write is acknowledged by the cluster's own
/// groups, and is there once nodes 3 and 5 are gone.
#[test]
fn a_node_placed_otherwise_takes_no_part_in_the_groups() {
    let _deadline = deadline("a node placed otherwise", Duration::from_secs(240));
    let mut cl = Cluster::prepare_replicated(4, SHARDS, 3, PeerTiming::default());
    cl.start_all_replicated();
    let first_file = cl.node(3).config.clone();
    let execs = start_spread(&cl.client(1), "placed", 2 * SHARDS, SHARDS);
    let shared = Shared::default();
    let via: Vec<Client> = [1, 2, 4].iter().map(|n| cl.client(*n)).collect();
    let writers = spawn_writers(&via, &execs, 4, 4, 4, &shared);
    shared.wait_acks(200, "200 acknowledged writes before the outage");

    // Every node down; node 3's record gone; node 3, then node 5, start
    // on a file whose spread moved.
    for n in 1..=4 {
        cl.kill9(n);
    }
    std::fs::remove_file(cl.node(3).data_dir.join("placement.json")).expect("node 3's record");
    let five = cl.add_node();
    let unpinned = cl.write_config("cluster-v2-unpinned.toml", &[]);
    cl.spawn(3, &unpinned);
    cl.wait_ready(3);
    cl.spawn(five, &unpinned);
    cl.wait_ready(five);
    // The second group of shard 7 elects a leader, on node 3 or 5.
    let forked = |n: u16| {
        let v = cl.client(n).get("/api/cluster").json();
        (v["shards"][7]["raft"]["voters"] == serde_json::json!([3, 4, five]))
            .then(|| v["shards"][7]["leader"].as_u64())
            .flatten()
            .filter(|l| [3, u64::from(five)].contains(l))
    };
    let fork_leader = wait_until(
        "nodes 3 and 5 to elect a leader of their own group of shard 7",
        Duration::from_secs(30),
        || forked(3),
    );
    eprintln!("the second group of shard 7 is led by node {fork_leader}");

    // The cluster's own nodes come back on the file they ran with.
    for n in [1, 2, 4] {
        cl.spawn(n, &first_file);
    }
    for n in [1, 2, 4] {
        cl.wait_ready(n);
    }
    let before = shared.acks();
    shared.wait_acks(before + 200, "200 acknowledged writes after the restart");
    // Starts on shard 7 through each of the cluster's nodes: acknowledged
    // by shard 7's own group (the second one, led by node 3 or 5, would
    // acknowledge them too, and lose them with those nodes).
    let started: Vec<String> = [1, 2, 4]
        .iter()
        .cycle()
        .take(12)
        .enumerate()
        .map(|(i, n)| {
            let key = key_on_shard(&format!("seven-{i}"), 7, SHARDS);
            let body = serde_json::json!({"workflow": "w", "routing_key": key, "idempotency_key": format!("seven-{i}")});
            let c = cl.client(*n);
            let r = settled(Duration::from_secs(20), || c.post("/api/executions", &body));
            assert!(r.status == 201 || r.status == 200, "start {body} through node {n}: {} {}", r.status, r.text());
            r.json()["execution_id"].as_str().expect("id").to_string()
        })
        .collect();
    for n in [1, 2, 4] {
        let v = cl.client(n).get("/api/cluster").json();
        let nodes = v["nodes"].as_array().expect("nodes");
        for (peer, alike) in [(1, true), (2, true), (3, false), (4, true)] {
            let seen = nodes.iter().find(|x| x["id"] == peer).expect("listed");
            let same = wait_until(
                "each node to have compared its peers' placements",
                Duration::from_secs(10),
                || {
                    cl.client(n).get("/api/cluster").json()["nodes"]
                        .as_array()
                        .and_then(|ns| ns.iter().find(|x| x["id"] == peer).cloned())
                        .and_then(|x| x["same_placement"].as_bool())
                },
            );
            assert_eq!(same, alike, "node {n} on node {peer}: {seen}");
        }
        // Shard 7's leader, as each of the cluster's nodes has it, is one
        // of its group's replicas.
        let leader = v["shards"][7]["leader"].as_u64();
        assert!(
            leader.is_none_or(|l| [4, 1, 2].contains(&l)),
            "node {n} routes shard 7 to node {leader:?}: {}",
            v["shards"][7]
        );
    }
    let refused = strip_ansi(&cl.node(4).proc().log());
    assert!(
        refused.contains("refused the Raft calls of a node that is not a peer")
            && refused.contains("placement (fingerprint"),
        "node 4 did not refuse the Raft calls of nodes 3 and 5 for their placement:\n{refused}"
    );
    // And the node placed otherwise says in its own log that it is
    // refused, and why.
    let told = strip_ansi(&cl.node(3).proc().log());
    assert!(
        told.contains("a peer refused this node's Raft connection")
            && told.contains("refused this node: its groups' placement"),
        "node 3's log does not say that its peers refuse it:\n{told}"
    );
    let status = cl.status(1);
    assert!(
        status.contains("node(s) 3 run groups made with another placement than node 1's"),
        "{status}"
    );

    // Nodes 3 and 5 go; every acknowledged write is in the cluster's own
    // groups, and their replicas on nodes 1, 2 and 4 are alike.
    cl.kill9(3);
    cl.kill9(five);
    let c1 = cl.client(1);
    for e in &started {
        let r = settled(Duration::from_secs(20), || {
            c1.get(&format!("/api/executions/{e}"))
        });
        assert_eq!(r.status, 200, "{e}, started on shard 7: {}", r.text());
    }
    let mut batches = shared.finish(writers);
    let answers = histogram(&batches);
    eprintln!("answers: {answers:?}");
    // An execution started and acknowledged is never not found: a node
    // that routed a write to the second group of shard 7 got that answer.
    assert!(
        !answers
            .iter()
            .any(|(a, _)| a.contains("execution_not_found")),
        "{answers:?}"
    );
    settle_verify_and_compare(&mut cl, &mut batches, &execs, 1, &[1, 2, 4], 400);
}
