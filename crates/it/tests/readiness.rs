//! Readiness and first contact between nodes started one after another.
//! Real `forkless` processes on loopback.

use forkless_it::*;
use std::time::Duration;

/// The new user's first steps: three nodes started one after another,
/// each waited for, then a request through node 1 for a shard of node 3.
/// Node 1 probed node 3 before node 3 existed; a peer that has never
/// answered a probe is not believed down, so the request is tried
/// (forwarded), and node 3 answers it. The probe interval is long, so
/// node 1 does not re-probe node 3 before the request.
#[test]
fn nodes_started_one_after_another_forward_to_each_other_at_once() {
    let _d = deadline("nodes_started_one_after_another", TEST_DEADLINE);
    let timing = PeerTiming {
        probe_interval_ms: 30_000,
        ..PeerTiming::relaxed()
    };
    let mut cl = Cluster::prepare(3, 4, timing);
    // Spread evenly: shard s on node s mod 3 + 1.
    let cfg = cl.write_config("cluster.toml", &[]);
    for id in 1..=3 {
        cl.spawn(id, &cfg);
        cl.wait_ready(id);
    }
    // `forkless status` through node 1 says so: node 3 is taken for
    // alive (the request below is sent there) but marked as never heard.
    let out = cl.status(1);
    let row3 = out
        .lines()
        .find(|l| l.split_whitespace().next() == Some("3"))
        .unwrap_or_else(|| panic!("no row for node 3 in:\n{out}"));
    assert_eq!(
        row3.split_whitespace().nth(3),
        Some("never"),
        "node 3's row in node 1's status:\n{out}"
    );
    assert!(
        out.contains("never answered node 1's probes"),
        "status names the nodes never heard from:\n{out}"
    );
    let key = key_on_shard("new-user", 2, 4);
    let r = cl.client(1).post(
        "/api/executions",
        &json!({"workflow": "w", "routing_key": key}),
    );
    assert_eq!(
        r.status,
        201,
        "the first start through node 1 for node 3's shard: {} {}\n{}",
        r.status,
        r.text(),
        cl.logs()
    );
    assert_eq!(r.header_u64("x-forkless-node"), Some(3));
    assert_eq!(r.header_u64("x-forkless-hops"), Some(1));
    let id = r.json()["execution_id"].as_str().expect("id").to_string();
    // And the other way round: node 3 to node 1's shard.
    cl.client(3)
        .get(&format!("/api/executions/{id}"))
        .expect(200);
    let key1 = key_on_shard("new-user-1", 0, 4);
    let r = cl.client(3).post(
        "/api/executions",
        &json!({"workflow": "w", "routing_key": key1}),
    );
    r.expect(201);
    assert_eq!(r.header_u64("x-forkless-node"), Some(1));
}

/// `/readyz` says not ready until the node has completed one probe round
/// of its peers, and a round completes when a peer does not answer: here
/// node 2's peer address accepts connections and never answers, so node 1
/// is not ready while its first probe waits, and is ready once that probe
/// has timed out.
#[test]
fn readiness_waits_for_one_probe_round_and_not_for_a_peer_that_never_answers() {
    let _d = deadline("readiness_waits_for_one_probe_round", TEST_DEADLINE);
    let timing = PeerTiming {
        probe_timeout_ms: 4_000,
        ..PeerTiming::relaxed()
    };
    let mut cl = Cluster::prepare(2, 2, timing);
    // Node 2 is a black hole: its peer port is bound (the kernel completes
    // connections) but nothing reads or answers.
    let peer2 = cl.node(2).peer;
    let _black_hole = cl.take_listener(peer2);
    let cfg = cl.write_config("cluster.toml", &[]);
    let spawned = std::time::Instant::now();
    cl.spawn(1, &cfg);
    let c = cl.client(1);
    let health = |path: &str| {
        c.try_req("GET", path, &[], None, Duration::from_millis(500))
            .ok()
            .map(|r| r.status)
    };
    wait_until("node 1 to answer /healthz", READY_TIMEOUT, || {
        (health("/healthz") == Some(200)).then_some(())
    });
    let r = c.get("/readyz");
    assert!(
        spawned.elapsed() < Duration::from_millis(3_500),
        "too slow a start to tell: {:?}",
        spawned.elapsed()
    );
    assert_eq!(
        r.status,
        503,
        "node 1 says ready before its first probe round completed: {}",
        r.text()
    );
    assert_eq!(r.json()["status"], "starting");
    wait_until(
        "node 1 to be ready once its probe of node 2 timed out",
        Duration::from_secs(15),
        || (health("/readyz") == Some(200)).then_some(()),
    );
    assert!(spawned.elapsed() >= Duration::from_millis(3_500));
}
