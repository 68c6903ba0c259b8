//! Real processes: replacing a dead node's replicas by Raft membership
//! changes. Four nodes, four shards, three replicas of each (so each shard
//! has one node outside its replicas). Under a steady write load node 1 is
//! killed for good and `forkless cluster remove-node 1` moves each of its
//! replicas to the node outside that shard's replicas: a learner, caught
//! up (by a snapshot: the groups keep few entries), then a voter in node
//! 1's place. Then a second node is killed: every shard still elects and
//! takes writes, which needs the new replicas' votes and copies. At the
//! end the removed node (back on its old data) forwards writes to the
//! leaders rather than failing them, a node whose disk is lost catches up
//! on every shard (the one moved to it too), every acknowledged write is
//! at its seq, and every replica of a shard holds the same events.

use forkless_it::workload::{
    histogram, settle_unknowns, spawn_writers, start_spread, verify, Shared,
};
use forkless_it::*;
use serde_json::{json, Value};
use std::time::Duration;

const NODES: u16 = 4;
const SHARDS: u32 = 4;

#[test]
fn a_dead_nodes_replicas_move_to_the_other_nodes_and_count_towards_their_quorums() {
    let _deadline = deadline("membership: remove a dead node", Duration::from_secs(240));
    let mut cl = Cluster::prepare_replicated(NODES, SHARDS, 3, PeerTiming::default());
    // A snapshot every 20 entries, 5 kept: a new replica catches up by a
    // snapshot of the shard, not from the log.
    cl.raft_log = Some((20, 5));
    let ids: Vec<u16> = (1..=NODES).collect();
    cl.start_nodes(&ids, &[]);
    cl.wait_leaders_known(2, &[]);

    // Two executions on every shard, written through nodes 2 to 4 (never
    // node 1, which dies for good).
    // Each start retried (same idempotency key) while its shard is
    // between leaders: at start leaders are handed to their preferred
    // replicas (CI once saw a start answered 503, not executed, by a
    // leader just elected by such a handover that had not yet applied its
    // term's first entry, two clusters of this binary starting at once).
    let c = cl.client(2);
    let execs = start_spread(&c, "member", 2 * SHARDS, SHARDS);
    let shared = Shared::default();
    let via: Vec<Client> = [2, 3, 4].iter().map(|n| cl.client(*n)).collect();
    let writers = spawn_writers(&via, &execs, 4, 4, 2, &shared);
    let acked_at_least = |n: usize, what: &str| shared.wait_acks(n, what);
    acked_at_least(200, "200 acknowledged writes before node 1 dies");

    cl.kill9(1);
    cl.wait_leaders_known(2, &[1]);
    let before = shared.acks();
    acked_at_least(before + 100, "100 acknowledged writes with node 1 dead");

    // Its replicas move, under the load. Node 1 held replicas of shards
    // 0, 2 and 3 (shard s is placed on the nodes s+1, s+2, s+3, wrapping).
    let started = std::time::Instant::now();
    let report = cl.remove_node(1, None, 2);
    eprintln!("remove-node 1 took {:?}: {report}", started.elapsed());
    assert_eq!(report["complete"], true, "{report}");
    let shards = report["shards"].as_array().expect("a shards list");
    assert_eq!(shards.len(), SHARDS as usize, "{report}");
    for s in shards {
        let shard = s["shard"].as_u64().expect("a shard");
        let voters: Vec<u64> = s["voters"]
            .as_array()
            .expect("voters")
            .iter()
            .filter_map(Value::as_u64)
            .collect();
        assert_eq!(s["changed"], shard != 1, "shard {shard}: {s}");
        assert_eq!(voters.len(), 3, "shard {shard}: {s}");
        assert!(!voters.contains(&1), "shard {shard}: {s}");
    }
    // Each new replica caught up by a snapshot of its shard.
    for s in shards.iter().filter(|s| s["changed"] == true) {
        let (shard, to) = (s["shard"].as_u64(), s["to"].as_u64());
        let (Some(shard), Some(to)) = (shard, to) else {
            panic!("a moved shard without its shard or node: {s}");
        };
        let log = strip_ansi(&cl.node(to as u16).proc().log());
        let line = format!("group={shard} ");
        assert!(
            log.lines()
                .any(|l| l.contains("installed a snapshot of the shard") && l.contains(&line)),
            "node {to} did not install a snapshot of shard {shard}:\n{log}"
        );
    }
    // Asked again, there is nothing left to do.
    let again = cl.remove_node(1, None, 3);
    assert!(
        again["shards"]
            .as_array()
            .expect("a shards list")
            .iter()
            .all(|s| s["changed"] == false),
        "{again}"
    );
    let moved = shared.acks();
    acked_at_least(moved + 100, "100 acknowledged writes after the move");

    // Every shard's replicas are now nodes 2, 3 and 4. With node 2 dead
    // too, shard 0's quorum is node 3 and its new replica on node 4, and
    // shard 3's is node 4 and its new replica on node 3.
    cl.kill9(2);
    let after = cl.wait_leaders_known(3, &[1, 2]);
    let twice = shared.acks();
    acked_at_least(
        twice + 200,
        "200 acknowledged writes with nodes 1 and 2 dead",
    );
    eprintln!("leaders with nodes 1 and 2 dead: {after:?}");

    // Node 2 comes back and catches up; node 1 comes back on its old
    // data: none of its groups has it as a voter any more, and it
    // forwards writes to the shards' leaders.
    let cfg = cl.node(2).config.clone();
    cl.spawn(2, &cfg);
    cl.wait_ready(2);
    // (Its log file is appended to: what the restarted node writes
    // follows what its first run wrote.)
    let first_run_log = std::fs::read(&cl.node(1).log).map_or(0, |l| l.len());
    assert!(first_run_log > 0, "node 1's first run logged nothing");
    let cfg = cl.node(1).config.clone();
    cl.spawn(1, &cfg);
    cl.wait_ready(1);
    let c1 = cl.client(1);
    // Node 1's own replicas never heard of the move: its /api/cluster
    // shows every shard's replicas as the shard's leader says them, and
    // `forkless status` with it.
    // Its left-behind replicas also stop standing for election once node
    // 1 hears that their groups no longer count them: their timers go off
    // (`raft.quiet`) and stay off, under the writers' load. Before, each
    // stood again every election timeout, was refused, and (its group
    // idle) woke the group's quiet leader each time, for good; and its
    // refused candidacies took it to the leader's term knowing no leader
    // there, where node 1's view named none for the shard.
    let shown = wait_until(
        "node 1, removed, to show every shard's replicas as its leader says them, \
         its left-behind replicas standing for no election (timers off)",
        Duration::from_secs(20),
        || {
            let v = c1
                .try_req("GET", "/api/cluster", &[], None, Duration::from_secs(2))
                .ok()?
                .json();
            let shards = v["shards"].as_array()?.clone();
            let right = shards.len() == SHARDS as usize
                && shards.iter().all(|s| {
                    let replicas: Vec<u64> = s["replicas"]
                        .as_array()
                        .map(|a| a.iter().filter_map(Value::as_u64).collect())
                        .unwrap_or_default();
                    replicas.len() == 3
                        && !replicas.contains(&1)
                        && s["replicas_from"]
                            .as_str()
                            .is_some_and(|f| f.starts_with("leader "))
                        // Its own stale replicas (shards 0, 2, 3) are
                        // marked as left behind, their timers off.
                        && (s["raft"].is_null()
                            || (s["raft"]["left_group"] == true && s["raft"]["quiet"] == true))
                });
            right.then_some(v)
        },
    );
    eprintln!("node 1's view after the move: {shown}");
    let left: Vec<u64> = shown["shards"]
        .as_array()
        .map(|a| {
            a.iter()
                .filter(|s| s["raft"]["left_group"] == true)
                .filter_map(|s| s["shard"].as_u64())
                .collect()
        })
        .unwrap_or_default();
    assert!(
        !left.is_empty(),
        "node 1 took no replica for left behind: {shown}"
    );
    for s in shown["shards"].as_array().expect("shards") {
        assert!(
            s["leader"].as_u64().is_some() && s["leader"] == s["owner"],
            "node 1 names no leader, or not the owner, for a shard: {s}"
        );
    }
    // ...and so does its /metrics.
    for shard in &left {
        let series = format!("forkless_raft_left_group{{shard=\"{shard}\"}}");
        assert_eq!(c1.metric(&series), 1.0, "node 1's {series}");
    }
    let log = strip_ansi(&cl.node(1).proc().log());
    assert!(
        log.contains("whose group no longer counts it"),
        "node 1 did not say that its replicas were left behind:\n{log}"
    );
    // A replica the group counts is never marked so.
    let v = cl.client(3).get("/api/cluster").json();
    for s in v["shards"].as_array().expect("shards") {
        assert!(
            s["raft"].is_null() || s["raft"]["left_group"] == false,
            "node 3 marks a replica of its as left behind: {s}"
        );
    }
    // Executions of their own (the writers' are checked against what the
    // writers sent), one on every shard.
    let own: Vec<String> = (0..SHARDS)
        .map(|i| {
            let key = key_on_shard(&format!("via-removed-{i}"), i, SHARDS);
            id_of(
                &cl.client(3)
                    .start(&json!({"workflow": "w", "routing_key": key})),
            )
        })
        .collect();
    for e in &own {
        let r = settled(Duration::from_secs(20), || {
            c1.post(
                &format!("/api/executions/{e}/events"),
                &workload::batch_body(&[format!("{e}-via-removed-node-1")], None),
            )
        });
        // (200: a retry of an answer that was unknown, deduplicated.)
        assert!(
            r.status == 201 || r.status == 200,
            "{}: {}: {}\n{}",
            e,
            r.status,
            r.text(),
            cl.logs()
        );
    }
    for e in &own {
        let markers: Vec<String> = cl
            .client(4)
            .events(e)
            .iter()
            .filter_map(|v| v["payload"]["marker"].as_str().map(String::from))
            .collect();
        assert_eq!(markers, vec![format!("{e}-via-removed-node-1")]);
        // A stale read through node 1 is not answered by its left-behind
        // replica, which never took these executions (it answered 404):
        // it goes to the shard's replicas.
        let r = c1.get(&format!("/api/executions/{e}/events?consistency=stale"));
        assert_eq!(
            r.status,
            200,
            "a stale read of {e} through node 1: {}",
            r.text()
        );
        let markers: Vec<String> = r.json()["events"]
            .as_array()
            .into_iter()
            .flatten()
            .filter_map(|v| v["payload"]["marker"].as_str().map(String::from))
            .collect();
        assert_eq!(markers, vec![format!("{e}-via-removed-node-1")]);
    }
    let mut batches = shared.finish(writers);
    eprintln!("answers: {:?}", histogram(&batches));
    settle_unknowns(&cl.client(3), &mut batches);
    // Node 1's left-behind replicas still stand for no election (the
    // writes through node 1 above were forwarded to the leaders).
    let v = c1.get("/api/cluster").json();
    for s in v["shards"].as_array().expect("shards") {
        if left.contains(&s["shard"].as_u64().unwrap_or(u64::MAX)) {
            assert!(
                s["raft"]["quiet"] == true && s["raft"]["left_group"] == true,
                "a left-behind replica of node 1 woke: {s}"
            );
        }
    }
    let log = std::fs::read(&cl.node(1).log).expect("node 1's log");
    let log = strip_ansi(&String::from_utf8_lossy(
        log.get(first_run_log..)
            .expect("node 1's log holds its first run's"),
    ));
    assert!(
        !log.contains("quiet shards' leader went silent"),
        "node 1 woke a left-behind replica for its leader's silence:\n{log}"
    );
    // The removed node's replicas follow no group: it is stopped before
    // the replicas are compared.
    cl.kill9(1);
    // Node 4 loses its disk: it comes back empty and catches up on every
    // shard by itself, shard 0 too, whose replica the cluster file does
    // not place there (the move did): its leader's first call opens it.
    cl.kill9(4);
    let data = cl.node(4).data_dir.clone();
    std::fs::remove_dir_all(&data).expect("wiped node 4's data directory");
    let cfg = cl.node(4).config.clone();
    cl.spawn(4, &cfg);
    cl.wait_ready(4);
    let c4 = cl.client(4);
    let wiped_at = std::time::Instant::now();
    loop {
        let v = c4
            .try_req("GET", "/api/cluster", &[], None, Duration::from_secs(2))
            .map(|r| r.json())
            .unwrap_or_default();
        let shards = v["shards"].as_array().cloned().unwrap_or_default();
        if !shards.is_empty()
            && shards
                .iter()
                .all(|s| s["raft"].is_object() && s["raft"]["fresh"] == false)
        {
            break;
        }
        assert!(
            wiped_at.elapsed() < Duration::from_secs(30),
            "node 4, wiped, did not hold a caught-up replica of every shard within 30 s: {v}\n{}",
            cl.logs()
        );
        std::thread::sleep(Duration::from_millis(20));
    }
    eprintln!("node 4, wiped, caught up in {:?}", wiped_at.elapsed());
    cl.wait_replicas_level();
    for n in 2..=NODES {
        let report = verify(&cl.client(n), &execs, &batches);
        assert!(report.acked >= 500, "{report:?}");
    }
    let counts = cl.stop_and_compare_replicas();
    assert!(counts.values().sum::<u64>() >= 500, "{counts:?}");
}

/// A shard that has no leader when a node's removal reaches it (its
/// leader's node just died, a handover is under way) is asked again
/// until it has one, within the removal's own bound: the removal does
/// not end incomplete over an election. Five nodes, four shards: shard 0
/// is on nodes 1, 2 and 3, and shard 3 on nodes 4, 5 and 1, so with
/// nodes 1 and 2 dead shard 0 has no quorum and every other shard has a
/// live node outside its replicas to move node 1's to.
#[test]
fn a_node_removal_waits_out_a_shard_without_a_leader() {
    let _deadline = deadline(
        "membership: a removal waits for a leader",
        Duration::from_secs(180),
    );
    let mut cl = Cluster::prepare_replicated(5, SHARDS, 3, PeerTiming::default());
    let ids: Vec<u16> = (1..=5).collect();
    cl.start_nodes(&ids, &[]);
    cl.wait_leaders_known(3, &[]);
    // Every replica holds its leader's first entry before two die: a
    // replica whose data directory is new votes for no candidate with
    // entries until it caught up once (docs/replication.md, "A replica
    // whose data directory is new"), so a shard whose leader died before
    // that would wait for its dead nodes, not for an election.
    cl.wait_replicas_level();
    cl.kill9(1);
    cl.kill9(2);
    let removal = cl.remove_node_in_background(1, 3, Duration::from_secs(120));
    // Node 3 has found shard 0 without a leader and asks again (a
    // removal that gave up on it instead has ended: its report is
    // checked below)...
    wait_until(
        "node 3 to ask shard 0 again for the move",
        Duration::from_secs(30),
        || {
            (removal.is_finished()
                || strip_ansi(&cl.node(3).proc().log())
                    .lines()
                    .any(|l| l.contains("asking again") && l.contains("shard=0")))
            .then_some(())
        },
    );
    // ...until node 2 is back and the shard elects.
    let cfg = cl.node(2).config.clone();
    cl.spawn(2, &cfg);
    cl.wait_ready(2);
    let report = cl.removal_done(removal);
    eprintln!("remove-node 1 with shard 0 leaderless at first: {report}");
    assert_eq!(report["complete"], true, "{report}");
    for s in report["shards"].as_array().expect("a shards list") {
        let voters: Vec<u64> = s["voters"]
            .as_array()
            .expect("voters")
            .iter()
            .filter_map(Value::as_u64)
            .collect();
        let shard = s["shard"].as_u64().expect("a shard");
        assert_eq!(s["changed"], shard == 0 || shard == 3, "shard {shard}: {s}");
        assert_eq!(voters.len(), 3, "shard {shard}: {s}");
        assert!(!voters.contains(&1), "shard {shard}: {s}");
    }
}

/// A move to a node that answers nothing (here one never started) ends
/// at its unreachable bound (30 s), not at the 5-minute catch-up bound,
/// and leaves that node a learner; the next removal, naming no node,
/// passes over it (it never answered a probe), removes the learner it
/// left, and moves the replica to a live node. The same move asked twice
/// at once, through two nodes, is made once. A move to a node seen down
/// is refused at once. Five nodes, one shard on nodes 1, 2 and 3; node 4
/// never runs.
#[test]
fn a_move_to_a_node_that_answers_nothing_ends_and_the_next_goes_to_a_live_node() {
    let _deadline = deadline(
        "membership: a move to a node that answers nothing",
        Duration::from_secs(180),
    );
    // (Relaxed: a probe missed on a loaded machine is not taken for a
    // node down, which a move to it would be refused for.)
    let mut cl = Cluster::prepare_replicated(5, 1, 3, PeerTiming::relaxed());
    cl.start_nodes(&[1, 2, 3, 5], &[]);
    cl.wait_leaders_known(2, &[]);
    cl.wait_replicas_level();
    // Node 1 leads (the balancer hands the shard to its first replica):
    // its removal below is the leader's own, and the moves after it meet
    // a leader that has just removed itself (it leads on for 150 ms).
    wait_until("node 1 to lead shard 0", Duration::from_secs(20), || {
        (cl.shard_voters()[&0].leader == 1).then_some(())
    });
    // A removal that ended incomplete: its one shard's move to `node`
    // answered `target_unreachable`, having left a learner or not.
    let unreachable = |code: Option<i32>, report: &Value, node: u64, learner_left: bool| {
        assert_ne!(code, Some(0), "{report}");
        assert_eq!(report["complete"], false, "{report}");
        let shard = &report["shards"][0];
        assert_eq!(shard["status"], 503, "{report}");
        assert_eq!(shard["error"]["error"], "target_unreachable", "{report}");
        assert_eq!(shard["error"]["node"], node, "{report}");
        assert_eq!(shard["error"]["learner_left"], learner_left, "{report}");
    };

    let started = std::time::Instant::now();
    let (code, report) = cl.try_remove_node(1, Some(4), 2);
    let took = started.elapsed();
    eprintln!("remove-node 1 --to 4 (never started) took {took:?}: {report}");
    unreachable(code, &report, 4, true);
    // The bound is 30 s; the catch-up bound it no longer waits out, 300 s.
    assert!(
        took < Duration::from_secs(90),
        "the move waited {took:?} for a node that answers nothing"
    );
    let members = &cl.shard_voters()[&0];
    assert_eq!(members.voters, vec![1, 2, 3], "{members:?}");
    assert_eq!(members.learners, vec![4], "{members:?}");

    let report = cl.remove_node(1, None, 2);
    eprintln!("remove-node 1 after it: {report}");
    assert_eq!(report["complete"], true, "{report}");
    assert_eq!(report["shards"][0]["to"], 5, "{report}");
    let members = &cl.shard_voters()[&0];
    assert_eq!(members.voters, vec![2, 3, 5], "{members:?}");
    assert!(members.learners.is_empty(), "{members:?}");

    // Node 2's replica to node 1 (back over the log it kept), asked
    // through nodes 3 and 5 at once: one changes the voters, the other
    // finds it done. Each is asked again while the shard has no leader
    // to take it (421, 503: nothing done), as node 1 hands its
    // leadership over after its own removal.
    let moving: Vec<_> = [3, 5]
        .iter()
        .map(|via| {
            let c = cl.client(*via);
            std::thread::spawn(move || {
                let until = std::time::Instant::now() + Duration::from_secs(30);
                loop {
                    let r = c.try_req(
                        "POST",
                        "/api/shards/0/replace",
                        &[("content-type", "application/json")],
                        Some(br#"{"from": 2, "to": 1}"#),
                        Duration::from_secs(120),
                    );
                    let (status, v) = match r {
                        Ok(r) => (r.status, r.json()),
                        Err(e) => panic!("a move not answered: {e}"),
                    };
                    let again = (status == 421 || status == 503)
                        && v["error"] != "target_unreachable"
                        && std::time::Instant::now() < until;
                    if !again {
                        return (status, v);
                    }
                    eprintln!(
                        "the move through node {}: {status} {v}; asking again",
                        c.addr
                    );
                    std::thread::sleep(Duration::from_millis(100));
                }
            })
        })
        .collect();
    let answers: Vec<(u16, Value)> = moving
        .into_iter()
        .map(|m| m.join().expect("a move's thread"))
        .collect();
    eprintln!("the same move twice at once: {answers:?}");
    assert!(
        answers.iter().all(|(s, _)| *s == 200),
        "{answers:?}\n{}",
        cl.logs()
    );
    assert_eq!(
        answers.iter().filter(|(_, v)| v["changed"] == true).count(),
        1,
        "{answers:?}"
    );
    let members = &cl.shard_voters()[&0];
    assert_eq!(members.voters, vec![1, 3, 5], "{members:?}");
    assert!(members.learners.is_empty(), "{members:?}");

    // Node 2, no longer a replica, dies: a move named to it is refused at
    // once (no wait, no learner added).
    cl.kill9(2);
    cl.wait_peer_seen(&[1, 3, 5], 2, false);
    let started = std::time::Instant::now();
    let (code, report) = cl.try_remove_node(3, Some(2), 5);
    eprintln!("remove-node 3 --to 2 (down): {report}");
    unreachable(code, &report, 2, false);
    assert!(
        report["shards"][0]["error"]["message"]
            .as_str()
            .is_some_and(|m| m.contains("the move was not begun")),
        "{report}"
    );
    assert!(started.elapsed() < Duration::from_secs(10), "{report}");
    let members = &cl.shard_voters()[&0];
    assert_eq!(members.voters, vec![1, 3, 5], "{members:?}");
    assert!(members.learners.is_empty(), "{members:?}");
}

/// A removal naming no node whose picked node stops answering during the
/// move (its learner still catching up) asks the shard's leader once
/// more when the move ends at the unreachable bound: the leader picks a
/// node that answers, removes the learner left, and the removal
/// completes. Five nodes behind fault-injecting proxies, one shard on
/// nodes 1, 2 and 3: every direction into node 4 is delayed a second (its
/// probes still answered within their 2.5 s timeout; the leader's calls
/// to its learner time out, so the learner takes nothing), and node 4 is
/// cut off once it is a learner.
#[test]
fn a_removal_picks_again_when_the_node_it_moved_to_stops_answering() {
    let _deadline = deadline(
        "membership: a removal picks again",
        Duration::from_secs(180),
    );
    let timing = PeerTiming {
        probe_timeout_ms: 2500,
        ..PeerTiming::relaxed()
    };
    let mut cl = Cluster::prepare_behind_proxies(5, 1, 3, timing);
    cl.start_nodes(&[1, 2, 3, 4, 5], &[]);
    cl.wait_leaders_known(2, &[]);
    cl.wait_replicas_level();
    let faults = cl.faults.clone().expect("the proxies");
    let slow = forkless_it::faultproxy::LinkFault {
        delay: Duration::from_secs(1),
        ..Default::default()
    };
    for n in [1, 2, 3, 5] {
        faults.link(n, 4, slow);
    }
    // Node 4, first outside the shard's replicas in the node list, is
    // the one the leader picks.
    let removal = cl.remove_node_in_background(1, 2, Duration::from_secs(150));
    wait_until(
        "node 4 to be a learner of shard 0",
        Duration::from_secs(20),
        || cl.shard_voters()[&0].learners.contains(&4).then_some(()),
    );
    faults.cut_into(4);
    faults.cut_out_of(4);
    let report = cl.removal_done(removal);
    eprintln!("remove-node 1, node 4 cut off mid-move: {report}");
    assert_eq!(report["complete"], true, "{report}");
    assert_eq!(report["shards"][0]["to"], 5, "{report}");
    let log = strip_ansi(&cl.node(2).proc().log());
    assert!(
        log.contains("asking the leader to pick another"),
        "node 2 did not ask again:\n{log}"
    );
    let members = &cl.shard_voters()[&0];
    assert_eq!(members.voters, vec![2, 3, 5], "{members:?}");
    assert!(members.learners.is_empty(), "{members:?}");
    faults.heal_all();
}
