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
