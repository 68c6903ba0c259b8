//! Real processes: a three-node replicated cluster (every shard a Raft
//! group on all three nodes, its leader the owner) under a steady write
//! load. The leader of the shards is killed with SIGKILL: the other two
//! elect new leaders and go on taking writes; the killed node restarts
//! and catches up. Afterwards every acknowledged write is at its seq,
//! nothing refused or never sent is there, and every replica holds the
//! same events (checked offline on each node's data directory).

use forkless_it::workload::{histogram, verify, writer, Outcome, Shared};
use forkless_it::*;
use serde_json::Value;
use std::time::{Duration, Instant};

const NODES: u16 = 3;
const SHARDS: u32 = 2;

fn id_of(v: &Value) -> String {
    v["execution_id"]
        .as_str()
        .unwrap_or_else(|| panic!("no string execution_id in {v}"))
        .to_string()
}

/// Waits until every running node has applied every entry of every shard
/// its group's leader holds, so that the replicas can be compared.
fn wait_replicas_level(cl: &Cluster) {
    let mut seen = String::new();
    let until = Instant::now() + Duration::from_secs(20);
    let mut level = || {
        let mut by_shard: Vec<Vec<(Option<u64>, Option<u64>)>> = vec![vec![]; SHARDS as usize];
        for (_, c) in cl.clients() {
            let v = c
                .try_req("GET", "/api/cluster", &[], None, Duration::from_secs(2))
                .ok()?
                .json();
            for s in v["shards"].as_array()? {
                let i = s["shard"].as_u64()? as usize;
                let r = &s["raft"];
                by_shard[i].push((r["last_log_index"].as_u64(), r["applied"].as_u64()));
            }
        }
        seen = format!("(last log index, applied) per shard, per node: {by_shard:?}");
        by_shard
            .iter()
            .all(|v| {
                let last = v.iter().filter_map(|(l, _)| *l).max();
                v.len() == NODES as usize && v.iter().all(|(l, a)| *l == last && *a == last)
            })
            .then_some(())
    };
    while level().is_none() {
        assert!(
            Instant::now() < until,
            "the replicas did not level within 20 s: {seen}"
        );
        std::thread::sleep(Duration::from_millis(20));
    }
}

/// Each shard's event count, as `forkless store check` reads it from a
/// stopped node's data directory.
fn events_on_disk(data_dir: &std::path::Path) -> Vec<u64> {
    let (code, out, err) = run_cli(
        &[
            "store",
            "check",
            "--data-dir",
            &data_dir.display().to_string(),
        ],
        Duration::from_secs(60),
    );
    assert_eq!(
        code,
        Some(0),
        "store check of {}: {out}\n{err}",
        data_dir.display()
    );
    out.lines()
        .filter(|l| l.starts_with("shard "))
        .map(|l| {
            let before = l.split(" events of ").next().unwrap_or("");
            before
                .rsplit(' ')
                .next()
                .and_then(|n| n.parse().ok())
                .unwrap_or_else(|| panic!("no event count in {l:?}"))
        })
        .collect()
}

#[test]
fn a_killed_leader_is_replaced_and_no_acknowledged_write_is_lost() {
    let _deadline = deadline("replication: leader killed", Duration::from_secs(180));
    let mut cl = Cluster::start_replicated(NODES, SHARDS, 3, PeerTiming::default());
    let leaders = cl.wait_leaders_known(1, &[]);
    // The node leading shard 0 goes; writers never talk to it, so every
    // write of theirs is routed (one hop) to whoever leads.
    let victim = leaders[0].0;
    let others: Vec<u16> = (1..=NODES).filter(|n| *n != victim).collect();
    let c = cl.client(others[0]);
    let execs: Vec<String> = (0..6)
        .map(|i| {
            let key = key_on_shard(&format!("repl-{i}"), i % SHARDS, SHARDS);
            id_of(&c.start(&json!({"workflow": "w", "routing_key": key})))
        })
        .collect();
    let shared = Shared::default();
    let via: Vec<Client> = others.iter().map(|n| cl.client(*n)).collect();
    let writers: Vec<_> = (0..4)
        .map(|t| {
            let mine: Vec<String> = (0..3)
                .map(|k| execs[(t + k) % execs.len()].clone())
                .collect();
            let mut via = via.clone();
            let n = via.len();
            via.rotate_left(t % n);
            let shared = shared.clone();
            std::thread::spawn(move || writer(via, mine, format!("t{t}"), shared, false))
        })
        .collect();
    let acked_at_least = |n: usize, what: &str| {
        wait_until(what, Duration::from_secs(30), || {
            (shared.acks() >= n).then_some(())
        })
    };
    acked_at_least(200, "200 acknowledged writes before the kill");

    let killed_at = Instant::now();
    cl.kill9(victim);
    let after = cl.wait_leaders_known(others[0], &[victim]);
    let elected = killed_at.elapsed();
    let before_kill = shared.acks();
    acked_at_least(before_kill + 200, "200 acknowledged writes after the kill");

    cl.spawn(victim, &cl.node(victim).config.clone());
    cl.wait_ready(victim);
    let rejoined = shared.acks();
    acked_at_least(rejoined + 100, "100 acknowledged writes after the restart");
    shared.stop.set();
    for w in writers {
        w.join()
            .expect("writer thread")
            .expect("the API kept its promises");
    }
    let batches = shared.take();
    // The first acknowledgement after the kill, on any shard.
    let first_ack = batches
        .iter()
        .filter(|b| matches!(b.outcome, Outcome::Acked { .. }) && b.answered_at > killed_at)
        .map(|b| b.answered_at.duration_since(killed_at))
        .min();
    eprintln!(
        "leaders {leaders:?} -> {after:?}; every shard led again {elected:?} after the kill, first ack after {first_ack:?}; answers {:?}",
        histogram(&batches)
    );

    wait_replicas_level(&cl);
    for n in 1..=NODES {
        let report = verify(&cl.client(n), &execs, &batches);
        assert!(report.acked >= 500, "{report:?}");
    }
    // Every replica holds the same events, read offline from its disk.
    for n in 1..=NODES {
        cl.node(n).proc().sigterm();
    }
    let mut counts = Vec::new();
    for n in 1..=NODES {
        let exited = cl
            .node_mut(n)
            .proc
            .as_mut()
            .and_then(|p| p.wait_exit(Duration::from_secs(20)));
        assert!(
            exited.is_some(),
            "node {n} did not stop on SIGTERM:\n{}",
            cl.logs()
        );
        cl.node_mut(n).proc = None;
        counts.push(events_on_disk(&cl.node(n).data_dir));
    }
    assert!(
        counts.iter().all(|c| *c == counts[0]),
        "replicas differ: {counts:?}"
    );
    assert!(counts[0].iter().sum::<u64>() >= 500, "{counts:?}");
}
