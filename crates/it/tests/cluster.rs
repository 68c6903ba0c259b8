//! Three real nodes of a static cluster on loopback: forwarding, start
//! placement, fail-closed routing when an owner is killed or paused, the hop
//! header, and the epoch fence against a stale config.

use forkless_it::workload::{histogram, verify, writer, Batch, Shared};
use forkless_it::*;
use serde_json::Value;
use std::time::{Duration, Instant};

const NODES: u16 = 3;
const SHARDS: u32 = 8;

/// The even spread of a config without `[[shards]]`: shard s to node s%3+1.
fn owner_of_shard(s: u32) -> u16 {
    (s % NODES as u32) as u16 + 1
}

fn owner_of_id(id: &str) -> u16 {
    owner_of_shard(shard_of_id(id, SHARDS))
}

fn ev(t: &str, n: u64) -> Value {
    json!({"type": t, "payload": {"n": n}})
}

/// A cluster with the brief's short peer timeouts, for failure tests.
fn cluster() -> Cluster {
    Cluster::start(NODES, SHARDS, &[], PeerTiming::default())
}

/// A cluster slower to call a starved peer down, for tests that kill nobody.
fn calm_cluster() -> Cluster {
    Cluster::start(NODES, SHARDS, &[], PeerTiming::relaxed())
}

/// Asserts `r` is the owner's answer relayed (or given) to a client of `asked`.
#[track_caller]
fn assert_routed(r: &Resp, asked: u16, owner: u16, shard: u32) {
    assert_eq!(
        r.header_u64("x-forkless-owner"),
        Some(owner as u64),
        "owner header: {:?}",
        r.headers
    );
    assert_eq!(
        r.header_u64("x-forkless-node"),
        Some(owner as u64),
        "the answer should come from the owner: {:?}",
        r.headers
    );
    assert_eq!(
        r.header_u64("x-forkless-shard"),
        Some(shard as u64),
        "{:?}",
        r.headers
    );
    let hops = if asked == owner { 0 } else { 1 };
    assert_eq!(
        r.header_u64("x-forkless-hops"),
        Some(hops),
        "asked {asked}, owner {owner}: {:?}",
        r.headers
    );
    assert!(r.header("x-forkless-epoch").is_some());
    assert!(r.header("x-forkless-map-version").is_some());
}

/// Answers stripped of what legitimately differs between two reads.
fn same_answer(a: &Resp, b: &Resp) -> bool {
    a.status == b.status && a.json() == b.json()
}

#[test]
fn every_endpoint_through_every_node_gives_the_owners_answer() {
    let _d = deadline("every_endpoint_through_every_node", TEST_DEADLINE);
    let cl = calm_cluster();
    // One execution started on each node (unsteered: lands on that node).
    let mut ids = Vec::new();
    for (n, c) in cl.clients() {
        let r = c.post("/api/executions", &json!({"workflow": format!("w{n}")}));
        r.expect(201);
        let id = id_of(&r.json());
        assert_eq!(owner_of_id(&id), n);
        ids.push(id);
    }
    for id in &ids {
        let owner = owner_of_id(id);
        let shard = shard_of_id(id, SHARDS);
        let mut seq = 1;
        for (n, c) in cl.clients() {
            // Append by path and by body, with expected_last_seq.
            let r = c.post(
                &format!("/api/executions/{id}/events"),
                &json!({"events": [ev("a", n as u64)], "expected_last_seq": seq}),
            );
            r.expect(200);
            assert_routed(&r, n, owner, shard);
            assert_eq!(r.json()["first_seq"], seq + 1);
            let r = c.post(
                "/api/events",
                &json!({"execution_id": id, "events": [ev("b", n as u64)], "expected_last_seq": seq + 1}),
            );
            r.expect(200);
            assert_routed(&r, n, owner, shard);
            let r = c.post(
                &format!("/api/executions/{id}/signals"),
                &json!({"name": format!("s{n}")}),
            );
            r.expect(200);
            assert_routed(&r, n, owner, shard);
            assert_eq!(r.json()["seq"], seq + 3);
            seq += 3;
            // Errors are the owner's too.
            let r = c.post(
                &format!("/api/executions/{id}/events"),
                &json!({"events": [ev("x", 0)], "expected_last_seq": 1}),
            );
            let v = r.expect_error(409, "sequence_conflict");
            assert_eq!(v["last_seq"], seq);
            assert_routed(&r, n, owner, shard);
        }
        // Reads: the same body from every node.
        for path in [
            format!("/api/executions/{id}"),
            format!("/api/executions/{id}/events"),
            format!("/api/executions/{id}/events?after=3&limit=2"),
        ] {
            let answers: Vec<Resp> = cl.clients().iter().map(|(_, c)| c.get(&path)).collect();
            for (i, r) in answers.iter().enumerate() {
                r.expect(200);
                assert_routed(r, i as u16 + 1, owner, shard);
                assert!(
                    same_answer(r, &answers[0]),
                    "{path}: node {} answered {} but node 1 answered {}",
                    i + 1,
                    r.text(),
                    answers[0].text()
                );
            }
        }
        assert_eq!(cl.client(1).last_seq(id), seq);
        assert_eq!(cl.client(2).events(id).len() as u64, seq);
    }
    // Unknown execution on each owner: 404 from the owner, via anyone.
    for s in 0..SHARDS {
        let missing = (1i64..)
            .find(|i| forkless_sharding::shard_for(*i, shard_count(SHARDS)) == s)
            .unwrap();
        for (n, c) in cl.clients() {
            let r = c.get(&format!("/api/executions/{missing}"));
            r.expect_error(404, "execution_not_found");
            assert_routed(&r, n, owner_of_shard(s), s);
        }
    }
    // Cancel through a non-owner; then the closed answer, from everyone.
    let id = &ids[0];
    let owner = owner_of_id(id);
    let other = owner % NODES + 1;
    let r = cl.client(other).post(
        &format!("/api/executions/{id}/cancel"),
        &json!({"reason": "done"}),
    );
    r.expect(200);
    assert_eq!(r.json()["status"], "cancelled");
    for (_, c) in cl.clients() {
        let v = c
            .post(
                &format!("/api/executions/{id}/events"),
                &json!({"events": [ev("late", 0)]}),
            )
            .expect_error(409, "execution_closed");
        assert_eq!(v["status"], "cancelled");
    }
    // Keys (with a '/') resolve on the key's shard from every node.
    let key = "tenant-z/order-9";
    let started = cl
        .client(1)
        .start(&json!({"workflow": "w", "routing_key": key}));
    let sid = id_of(&started);
    let answers: Vec<Resp> = cl
        .clients()
        .iter()
        .map(|(_, c)| c.get(&format!("/api/keys/{key}")))
        .collect();
    for (i, r) in answers.iter().enumerate() {
        r.expect(200);
        assert_routed(
            r,
            i as u16 + 1,
            owner_of_shard(shard_of_key(key, SHARDS)),
            shard_of_key(key, SHARDS),
        );
        assert!(same_answer(r, &answers[0]));
        assert_eq!(id_of(&r.json()["executions"][0]), sid);
    }
    // The cluster map agrees everywhere.
    for (n, c) in cl.clients() {
        let v = c.get("/api/cluster").json();
        assert_eq!(v["node"], n);
        assert_eq!(v["shard_count"], SHARDS);
        assert_eq!(v["routing_active"], true);
        for s in v["shards"].as_array().unwrap() {
            let shard = s["shard"].as_u64().unwrap() as u32;
            assert_eq!(s["owner"], owner_of_shard(shard), "{s}");
            assert_eq!(s["epoch"], 1);
            assert_eq!(s["local"], owner_of_shard(shard) == n);
        }
    }
}

#[test]
fn long_polls_through_a_non_owner_get_their_wait() {
    let _d = deadline("long_polls_through_a_non_owner", TEST_DEADLINE);
    let cl = cluster();
    let id = id_of(&cl.client(2).start(&json!({"workflow": "w"})));
    assert_eq!(owner_of_id(&id), 2);
    // Longer than forward_timeout_ms (1000): still an empty 200, not a 503.
    let t = Instant::now();
    let r = cl
        .client(1)
        .get(&format!("/api/executions/{id}/events?after=1&wait_ms=1500"));
    let took = t.elapsed();
    r.expect(200);
    assert_eq!(r.json()["events"], json!([]));
    assert!(took >= Duration::from_millis(1400), "{took:?}");
    assert!(took < Duration::from_millis(4000), "{took:?}");
    // An event appended via a third node wakes a poll relayed by the first.
    let c1 = cl.client(1);
    let pid = id.clone();
    let poll = std::thread::spawn(move || {
        let t = Instant::now();
        let r = c1.get(&format!(
            "/api/executions/{pid}/events?after=1&wait_ms=15000"
        ));
        (r, t.elapsed())
    });
    std::thread::sleep(Duration::from_millis(300));
    cl.client(3)
        .post(
            &format!("/api/executions/{id}/events"),
            &json!({"events": [ev("wake", 1)]}),
        )
        .expect(200);
    let (r, took) = poll.join().unwrap();
    r.expect(200);
    assert_eq!(r.json()["events"][0]["type"], "wake");
    assert!(took < Duration::from_secs(5), "{took:?}");
}

#[test]
fn unsteered_starts_never_forward() {
    let _d = deadline("unsteered_starts_never_forward", TEST_DEADLINE);
    let cl = calm_cluster();
    for (n, c) in cl.clients() {
        let fwd = "forkless_route_total{outcome=\"forwarded_ok\"}";
        let before = c.metric(fwd);
        for i in 0..40 {
            let r = c.post(
                "/api/executions",
                &json!({"workflow": "w", "input": {"i": i}}),
            );
            r.expect(201);
            let id = id_of(&r.json());
            let shard = shard_of_id(&id, SHARDS);
            assert_eq!(
                owner_of_shard(shard),
                n,
                "start on node {n} landed on shard {shard}"
            );
            assert_routed(&r, n, n, shard);
        }
        assert_eq!(
            c.metric(fwd),
            before,
            "an unsteered start on node {n} forwarded"
        );
    }
}

#[test]
fn steered_starts_land_on_the_key_shard_from_any_node() {
    let _d = deadline("steered_starts_land_on_the_key_shard", TEST_DEADLINE);
    let cl = calm_cluster();
    for s in 0..SHARDS {
        let key = key_on_shard(&format!("tenant-{s}/order"), s, SHARDS);
        let owner = owner_of_shard(s);
        let via = (s as u16 % NODES) + 1; // sometimes the owner, mostly not
        let via = if s % 2 == 0 { via } else { via % NODES + 1 };
        let body =
            json!({"workflow": "w", "routing_key": key, "idempotency_key": format!("idem-{s}")});
        let r = cl.client(via).post("/api/executions", &body);
        r.expect(201);
        assert_routed(&r, via, owner, s);
        let v = r.json();
        let id = id_of(&v);
        assert_eq!(shard_of_id(&id, SHARDS), s, "{key} -> {id}");
        assert_eq!(v["shard"], s);
        // A repeat through every node: the same execution.
        for (n, c) in cl.clients() {
            let r = c.post("/api/executions", &body);
            r.expect(200);
            assert_routed(&r, n, owner, s);
            assert_eq!(id_of(&r.json()), id);
            assert_eq!(r.json()["existing"], true);
            let k = c.get(&format!("/api/keys/{key}")).json();
            let ids: Vec<_> = k["executions"]
                .as_array()
                .unwrap()
                .iter()
                .map(id_of)
                .collect();
            assert_eq!(ids, vec![id.clone()]);
        }
    }
}

#[test]
fn forged_hop_header_is_refused_on_every_node_and_a_peer_hop_gets_421() {
    let _d = deadline("forged_hop_header_is_refused_on_every_node", TEST_DEADLINE);
    let cl = calm_cluster();
    let ids: Vec<String> = cl
        .clients()
        .iter()
        .map(|(_, c)| id_of(&c.start(&json!({"workflow": "w"}))))
        .collect();
    for (n, c) in cl.clients() {
        for id in &ids {
            let ev_body = json!({"events": [ev("t", 0)]}).to_string();
            for (m, p, b) in [
                ("GET", format!("/api/executions/{id}"), None),
                ("GET", format!("/api/executions/{id}/events"), None),
                (
                    "POST",
                    format!("/api/executions/{id}/events"),
                    Some(ev_body.clone()),
                ),
                (
                    "POST",
                    format!("/api/executions/{id}/cancel"),
                    Some("{}".to_string()),
                ),
                (
                    "POST",
                    "/api/executions".to_string(),
                    Some(json!({"workflow": "w"}).to_string()),
                ),
            ] {
                let r = c.req(
                    m,
                    &p,
                    &[("x-forkless-hops", "1")],
                    b.as_deref().map(str::as_bytes),
                );
                r.expect_error(403, "forbidden");
                assert_eq!(
                    r.header_u64("x-forkless-node"),
                    Some(n as u64),
                    "refused by the node asked"
                );
            }
        }
    }
    for id in &ids {
        assert_eq!(
            cl.client(1).last_seq(id),
            1,
            "a forged request wrote to {id}"
        );
    }
    // A real peer hop (authenticated) that reaches a non-owner is refused
    // with a typed 421 carrying the owner hint, never forwarded again.
    let id = &ids[1]; // owned by node 2
    let shard = shard_of_id(id, SHARDS);
    let peer_headers = [
        ("x-forkless-hops", "1"),
        ("x-forkless-peer-token", cl.secret.as_str()),
    ];
    let r = cl.client(1).req(
        "POST",
        &format!("/api/executions/{id}/events"),
        &peer_headers,
        Some(json!({"events": [ev("t", 0)]}).to_string().as_bytes()),
    );
    let v = r.expect_error(421, "not_owner");
    assert_eq!(v["shard"], shard, "{v}");
    assert_eq!(
        v["partition"],
        forkless_sharding::partition_for(id.parse().unwrap()),
        "{v}"
    );
    assert_eq!(v["owner_hint"]["node"], 2, "{v}");
    assert_eq!(
        v["owner_hint"]["address"],
        cl.node(2).api.to_string(),
        "{v}"
    );
    assert_eq!(v["owner_epoch"], 1, "{v}");
    assert!(v["map_version"].is_u64(), "{v}");
    assert_eq!(v["executed"], false, "{v}");
    assert_eq!(cl.client(2).last_seq(id), 1);
    // The same peer hop at the owner is handled there.
    let r = cl
        .client(2)
        .req("GET", &format!("/api/executions/{id}"), &peer_headers, None);
    r.expect(200);
    // A peer's append whose hop count is not a number is refused by the
    // owner with a 400 naming the header (never taken for zero hops), and
    // nothing is written; the same append with a real count is written.
    let append = json!({"events": [ev("t", 0)]}).to_string();
    for hops in ["x", "-1", "256", ""] {
        let r = cl.client(2).req(
            "POST",
            &format!("/api/executions/{id}/events"),
            &[
                ("x-forkless-hops", hops),
                ("x-forkless-peer-token", cl.secret.as_str()),
            ],
            Some(append.as_bytes()),
        );
        let v = r.expect_error(400, "invalid_request");
        assert_eq!(v["field"], "x-forkless-hops", "{hops:?}: {v}");
    }
    assert_eq!(cl.client(2).last_seq(id), 1);
    let r = cl.client(2).req(
        "POST",
        &format!("/api/executions/{id}/events"),
        &peer_headers,
        Some(append.as_bytes()),
    );
    r.expect(200);
    assert_eq!(r.header_u64("x-forkless-hops"), Some(1));
    assert_eq!(cl.client(2).last_seq(id), 2);
}

/// Records writes sent to a dead or paused owner, to check none landed.
struct Attempt {
    id: String,
    marker: String,
    executed: Value,
}

#[test]
fn killed_owner_fails_closed_and_keeps_its_acknowledged_events() {
    let _d = deadline("killed_owner_fails_closed", TEST_DEADLINE);
    let mut cl = cluster();
    // Two executions per node, with a few acknowledged events each.
    let mut ids = Vec::new();
    for (_, c) in cl.clients() {
        for _ in 0..2 {
            ids.push(id_of(&c.start(&json!({"workflow": "w"}))));
        }
    }
    for id in &ids {
        for (n, c) in cl.clients() {
            c.post(
                &format!("/api/executions/{id}/events"),
                &json!({"events": [ev("pre", n as u64)]}),
            )
            .expect(200);
        }
    }
    let before: Vec<(String, Vec<Value>)> = ids
        .iter()
        .map(|id| (id.clone(), cl.client(1).events(id)))
        .collect();
    let victim = 3u16;
    let victims: Vec<&String> = ids.iter().filter(|i| owner_of_id(i) == victim).collect();
    let others: Vec<&String> = ids.iter().filter(|i| owner_of_id(i) != victim).collect();

    cl.kill9(victim);
    let mut attempts = Vec::new();
    // Immediately, and again after the probes noticed: 503 quickly.
    for round in 0..3 {
        for id in &victims {
            for n in [1u16, 2] {
                let c = cl.client(n);
                let marker = format!("dead-{round}-{n}-{id}");
                let t = Instant::now();
                let r = c.post(
                    &format!("/api/executions/{id}/events"),
                    &json!({"events": [{"type": "t", "payload": marker, "idempotency_key": marker}]}),
                );
                let took = t.elapsed();
                let v = r.expect_error(503, "owner_unavailable");
                assert!(took < Duration::from_secs(2), "503 took {took:?}");
                assert!(
                    r.header("retry-after").is_some(),
                    "no Retry-After: {:?}",
                    r.headers
                );
                assert_eq!(
                    v["executed"], false,
                    "the request never reached the dead owner: {v}"
                );
                assert_eq!(v["shard"], shard_of_id(id, SHARDS), "{v}");
                assert_eq!(v["owner_hint"]["node"], victim, "{v}");
                assert_eq!(r.header_u64("x-forkless-node"), Some(n as u64));
                attempts.push(Attempt {
                    id: id.to_string(),
                    marker,
                    executed: v["executed"].clone(),
                });
                // Reads and signals fail closed too.
                let t = Instant::now();
                c.get(&format!("/api/executions/{id}"))
                    .expect_error(503, "owner_unavailable");
                c.get(&format!("/api/executions/{id}/events?wait_ms=500"))
                    .expect_error(503, "owner_unavailable");
                c.post(
                    &format!("/api/executions/{id}/signals"),
                    &json!({"name": "s"}),
                )
                .expect_error(503, "owner_unavailable");
                assert!(t.elapsed() < Duration::from_secs(3), "{:?}", t.elapsed());
            }
        }
        if round == 0 {
            // Wait for both survivors to see the victim down.
            cl.wait_peer_seen(&[1, 2], victim, false);
        }
    }
    // Steered starts for the victim's shards fail closed; others work.
    let dead_shard = (0..SHARDS).find(|s| owner_of_shard(*s) == victim).unwrap();
    let dead_key = key_on_shard("dead", dead_shard, SHARDS);
    cl.client(1)
        .post(
            "/api/executions",
            &json!({"workflow": "w", "routing_key": dead_key}),
        )
        .expect_error(503, "owner_unavailable");
    // Appends to other shards keep working, through both survivors.
    for id in &others {
        for n in [1u16, 2] {
            let r = cl.client(n).post(
                &format!("/api/executions/{id}/events"),
                &json!({"events": [ev("during", n as u64)]}),
            );
            r.expect(200);
        }
    }
    for n in [1u16, 2] {
        cl.client(n).start(&json!({"workflow": "w"}));
        let live_key = key_on_shard(
            "live",
            (0..SHARDS).find(|s| owner_of_shard(*s) != victim).unwrap(),
            SHARDS,
        );
        cl.client(n)
            .start(&json!({"workflow": "w", "routing_key": live_key}));
    }

    // Restart the owner on its data dir: exactly the acknowledged events.
    cl.restart(victim, None);
    for n in [1u16, 2] {
        wait_until(
            "the survivors to route to the restarted owner",
            Duration::from_secs(10),
            || {
                (cl.client(n)
                    .get(&format!("/api/executions/{}", victims[0]))
                    .status
                    == 200)
                    .then_some(())
            },
        );
    }
    for (id, evs) in &before {
        if owner_of_id(id) != victim {
            continue;
        }
        for (n, c) in cl.clients() {
            let now = c.events(id);
            assert_eq!(
                &now, evs,
                "execution {id} via node {n} changed while its owner was dead"
            );
            let r = c.get(&format!("/api/executions/{id}"));
            r.expect(200);
            assert_routed(&r, n, victim, shard_of_id(id, SHARDS));
        }
    }
    for a in &attempts {
        let found = cl
            .client(victim)
            .events(&a.id)
            .iter()
            .any(|e| e["payload"] == a.marker.as_str());
        assert!(
            !found,
            "a write refused with executed={} landed: {}",
            a.executed, a.marker
        );
    }
}

#[test]
fn paused_owner_fails_closed_within_the_forward_timeout_then_recovers() {
    let _d = deadline("paused_owner_fails_closed", TEST_DEADLINE);
    let cl = cluster();
    let victim = 2u16;
    let id = id_of(&cl.client(victim).start(&json!({"workflow": "w"})));
    cl.client(1)
        .post(
            &format!("/api/executions/{id}/events"),
            &json!({"events": [ev("pre", 1)]}),
        )
        .expect(200);
    let acked_before = cl.client(1).events(&id);
    let other = id_of(&cl.client(3).start(&json!({"workflow": "w"})));
    let forward_timeout = Duration::from_millis(cl.timing.forward_timeout_ms);
    let margin = Duration::from_millis(1500);

    cl.node(victim).proc().sigstop();
    let paused_at = Instant::now();
    let mut attempts = Vec::new();
    let mut saw_fast_false = false;
    for i in 0..12 {
        for n in [1u16, 3] {
            let marker = format!("paused-{i}-{n}");
            let t = Instant::now();
            let r = cl.client(n).post(
                &format!("/api/executions/{id}/events"),
                &json!({"events": [{"type": "t", "payload": marker, "idempotency_key": marker}]}),
            );
            let took = t.elapsed();
            let v = r.expect_error(503, "owner_unavailable");
            assert!(r.header("retry-after").is_some());
            assert!(
                took < forward_timeout + margin,
                "a request to a paused owner took {took:?} (forward timeout {forward_timeout:?})"
            );
            assert!(
                v["executed"] == false || v["executed"] == "unknown",
                "executed must be false or \"unknown\": {v}"
            );
            if v["executed"] == false && took < Duration::from_millis(500) {
                saw_fast_false = true;
            }
            attempts.push(Attempt {
                id: id.clone(),
                marker,
                executed: v["executed"].clone(),
            });
        }
        // Meanwhile, other owners keep answering.
        cl.client(1)
            .post(
                &format!("/api/executions/{other}/events"),
                &json!({"events": [ev("ok", 1)]}),
            )
            .expect(200);
    }
    assert!(
        saw_fast_false,
        "once the probes mark the paused owner down, requests should fail closed at once"
    );
    // The first write was sent to the paused owner before any probe could
    // notice: it timed out, and nobody can know whether it was applied.
    assert_eq!(
        attempts[0].executed, "unknown",
        "the first write after SIGSTOP"
    );
    let unknown = attempts.iter().filter(|a| a.executed == "unknown").count();
    eprintln!(
        "[cluster] {} writes refused during a {:?} pause ({unknown} with executed=unknown)",
        attempts.len(),
        paused_at.elapsed()
    );

    cl.node(victim).proc().sigcont();
    for n in [1u16, 3] {
        wait_until(
            "requests to work again after SIGCONT",
            Duration::from_secs(10),
            || (cl.client(n).get(&format!("/api/executions/{id}")).status == 200).then_some(()),
        );
        cl.client(n)
            .post(
                &format!("/api/executions/{id}/events"),
                &json!({"events": [ev("after", n as u64)]}),
            )
            .expect(200);
    }
    // What was acknowledged before is intact; a write refused with
    // executed=false never landed; one with "unknown" landed at most once.
    let now = cl.client(victim).events(&id);
    assert_eq!(&now[..acked_before.len()], &acked_before[..]);
    for a in &attempts {
        let count = now
            .iter()
            .filter(|e| e["payload"] == a.marker.as_str())
            .count();
        if a.executed == false {
            assert_eq!(
                count, 0,
                "{} was refused with executed=false but landed",
                a.marker
            );
        } else {
            assert!(count <= 1, "{} landed {count} times", a.marker);
        }
    }
    for (i, e) in now.iter().enumerate() {
        assert_eq!(e["seq"], i as u64 + 1);
    }
    let landed = attempts
        .iter()
        .filter(|a| now.iter().any(|e| e["payload"] == a.marker.as_str()))
        .count();
    eprintln!("[cluster] {landed} of the {unknown} executed=unknown writes landed after SIGCONT");
}

#[test]
fn a_stale_config_is_fenced_by_a_newer_epoch() {
    let _d = deadline("a_stale_config_is_fenced", TEST_DEADLINE);
    let v1: Vec<(u32, u16, u64)> = (0..SHARDS).map(|s| (s, owner_of_shard(s), 1)).collect();
    let mut cl = Cluster::start(NODES, SHARDS, &v1, PeerTiming::relaxed());
    assert_eq!(owner_of_shard(0), 1);
    // Executions on shard 0, owned by node 1 at epoch 1.
    let key = key_on_shard("fence", 0, SHARDS);
    let mut shard0 = Vec::new();
    for (n, c) in cl.clients() {
        let r = c.post(
            "/api/executions",
            &json!({"workflow": "w", "routing_key": key}),
        );
        r.expect(201);
        assert_routed(&r, n, 1, 0);
        shard0.push(id_of(&r.json()));
    }
    for id in &shard0 {
        cl.client(1)
            .post(
                &format!("/api/executions/{id}/events"),
                &json!({"events": [ev("v1", 1)]}),
            )
            .expect(200);
    }
    let before: Vec<Vec<Value>> = shard0.iter().map(|id| cl.client(1).events(id)).collect();

    // v2: shard 0 moves to node 2 at epoch 2. Only node 2 gets it.
    let mut v2 = v1.clone();
    v2[0] = (0, 2, 2);
    let cfg2 = cl.write_config("cluster-v2.toml", &v2);
    cl.restart(2, Some(&cfg2));
    let restarted = Instant::now();

    // Node 1 (and 3) learn the newer epoch from node 2's probe answers, and
    // node 1 fences its own copy.
    for n in [1u16, 3] {
        let took = wait_until(
            "the stale nodes to learn shard 0's new owner",
            Duration::from_secs(10),
            || {
                let v = cl.client(n).get("/api/cluster").json();
                let s = &v["shards"][0];
                (s["owner"] == 2 && s["epoch"] == 2 && (n != 1 || s["store_epoch"] == 2))
                    .then(|| restarted.elapsed())
            },
        );
        assert!(
            took < Duration::from_millis(20 * cl.timing.probe_interval_ms),
            "node {n} took {took:?} to learn the new owner"
        );
    }
    let v = cl.client(1).get("/api/cluster").json();
    let s0 = &v["shards"][0];
    assert_eq!(s0["owner"], 2, "{s0}");
    assert_eq!(s0["epoch"], 2, "{s0}");
    assert_eq!(s0["local"], false, "{s0}");
    assert_eq!(
        s0["store_epoch"], 2,
        "node 1 must fence its copy of shard 0: {s0}"
    );
    let v3 = cl.client(3).get("/api/cluster").json();
    assert_eq!(v3["shards"][0]["owner"], 2);
    assert_eq!(
        v3["shards"][0]["store_epoch"],
        Value::Null,
        "node 3 never hosted shard 0"
    );
    assert_eq!(v["map_version"], 2);

    // A shard-0 write sent to node 1 is not appended there: it goes to node 2
    // (which has no such execution) or is refused.
    for id in &shard0 {
        for (n, c) in cl.clients() {
            let r = c.post(
                &format!("/api/executions/{id}/events"),
                &json!({"events": [ev("stale", n as u64)]}),
            );
            assert!(
                matches!(r.status, 404 | 421 | 503),
                "a shard-0 write via node {n} after the move answered {} {}",
                r.status,
                r.text()
            );
            if r.status == 404 {
                assert_eq!(
                    r.header_u64("x-forkless-node"),
                    Some(2),
                    "404 must be node 2's: {:?}",
                    r.headers
                );
                assert_eq!(r.header_u64("x-forkless-epoch"), Some(2));
            }
        }
    }
    // New shard-0 starts now land on node 2, from any node.
    for (n, c) in cl.clients() {
        let r = c.post(
            "/api/executions",
            &json!({"workflow": "w", "routing_key": key}),
        );
        r.expect(201);
        assert_routed(&r, n, 2, 0);
        assert_eq!(r.header_u64("x-forkless-epoch"), Some(2));
    }

    // Node 1 restarted on the stale v1 config: its store still refuses
    // shard-0 writes at epoch 1 until it re-learns the owner.
    cl.restart(1, None);
    for id in &shard0 {
        let r = cl.client(1).post(
            &format!("/api/executions/{id}/events"),
            &json!({"events": [ev("stale-restart", 1)]}),
        );
        assert!(
            matches!(r.status, 404 | 421 | 503),
            "a shard-0 write on the restarted stale node answered {} {}",
            r.status,
            r.text()
        );
    }
    wait_until(
        "the restarted node to re-learn shard 0's owner",
        Duration::from_secs(10),
        || {
            let v = cl.client(1).get("/api/cluster").json();
            (v["shards"][0]["owner"] == 2).then_some(())
        },
    );

    // Finally, read node 1's own copy of shard 0 with a one-node config that
    // routes everything locally: nothing was appended after the move.
    for n in 1..=NODES {
        cl.kill9(n);
    }
    let solo_cfg = cl.write_solo_config(1);
    cl.restart(1, Some(&solo_cfg));
    let c1 = cl.client(1);
    for (id, evs) in shard0.iter().zip(&before) {
        assert_eq!(
            &c1.events(id),
            evs,
            "node 1's copy of {id} changed after the move"
        );
    }
    // And the fence holds: a write at epoch 1 is refused by the store.
    let r = c1.post(
        &format!("/api/executions/{}/events", shard0[0]),
        &json!({"events": [ev("fenced", 1)]}),
    );
    r.expect_error(421, "not_owner");
    assert_eq!(c1.events(&shard0[0]), before[0]);
    assert_eq!(c1.get("/api/cluster").json()["shards"][0]["store_epoch"], 2);
}

#[test]
fn a_config_switch_under_load_never_forks_a_log() {
    let _d = deadline(
        "a_config_switch_under_load_never_forks_a_log",
        TEST_DEADLINE,
    );
    let v1: Vec<(u32, u16, u64)> = (0..SHARDS).map(|s| (s, owner_of_shard(s), 1)).collect();
    let mut cl = Cluster::start(NODES, SHARDS, &v1, PeerTiming::relaxed());
    // Four executions on shard 0 (node 1), two elsewhere on nodes 1 and 3.
    let c1 = cl.client(1);
    let shard0: Vec<String> = (0..4)
        .map(|i| {
            let key = key_on_shard(&format!("switch-{i}"), 0, SHARDS);
            id_of(&c1.start(&json!({"workflow": "w", "routing_key": key})))
        })
        .collect();
    // Two more on shards owned by nodes 1 and 3 that do not move.
    let elsewhere: Vec<String> = [3u32, 2]
        .iter()
        .map(|s| {
            let key = key_on_shard(&format!("stay-{s}"), *s, SHARDS);
            id_of(&c1.start(&json!({"workflow": "w", "routing_key": key})))
        })
        .collect();
    let mut execs = shard0.clone();
    execs.extend(elsewhere.iter().cloned());

    let shared = Shared::default();
    let via = vec![cl.client(1), cl.client(3)];
    let handles: Vec<_> = (0..8)
        .map(|t| {
            let mine: Vec<String> = (0..3)
                .map(|k| execs[(t + k) % execs.len()].clone())
                .collect();
            let mut via = via.clone();
            via.rotate_left(t % 2);
            let shared = shared.clone();
            std::thread::spawn(move || writer(via, mine, format!("s-t{t}"), shared, false))
        })
        .collect();
    wait_until("acknowledgements under v1", Duration::from_secs(30), || {
        (shared.acks() >= 100).then_some(())
    });

    // Node 2 comes back owning shard 0 at epoch 2.
    let mut v2 = v1.clone();
    v2[0] = (0, 2, 2);
    let cfg2 = cl.write_config("cluster-v2.toml", &v2);
    cl.restart(2, Some(&cfg2));
    let fenced_at = wait_until("node 1 to fence shard 0", Duration::from_secs(10), || {
        let v = cl.client(1).get("/api/cluster").json();
        let s = &v["shards"][0];
        (s["owner"] == 2 && s["epoch"] == 2 && s["store_epoch"] == 2).then(Instant::now)
    });
    let sent = shared.sent();
    wait_until("writes after the switch", Duration::from_secs(30), || {
        (shared.sent() >= sent + 300 && fenced_at.elapsed() > Duration::from_millis(2500))
            .then_some(())
    });
    shared.stop.set();
    for h in handles {
        h.join()
            .expect("writer panicked")
            .expect("writer saw a wrong answer");
    }
    let batches = shared.take();
    eprintln!(
        "[cluster] config switch under load: answers {:?}",
        histogram(&batches)
    );

    let is0 = |id: &str| shard_of_id(id, SHARDS) == 0;
    let margin = Duration::from_millis(1000);
    for b in &batches {
        if b.status == Some(200) && is0(&b.exec) {
            // Shard-0 writes were acknowledged only by node 1, at epoch 1
            // (node 2's shard 0 is a new, empty one), and not after the fence.
            assert_eq!((b.node, b.epoch), (Some(1), Some(1)), "{b:?}");
            assert!(
                b.answered_at < fenced_at + margin,
                "node 1 acknowledged a shard-0 write {:?} after its store was fenced: {b:?}",
                b.answered_at - fenced_at
            );
        }
    }
    let late: Vec<_> = batches
        .iter()
        .filter(|b| is0(&b.exec) && b.answered_at > fenced_at + margin)
        .collect();
    assert!(
        late.len() > 20,
        "too few shard-0 writes after the fence to tell: {}",
        late.len()
    );
    // Other shards kept working through the switch.
    let other_acks = batches
        .iter()
        .filter(|b| !is0(&b.exec) && b.status == Some(200) && b.answered_at > fenced_at)
        .count();
    assert!(
        other_acks > 0,
        "no writes to other shards were acknowledged after the switch"
    );
    let others: Vec<Batch> = batches.iter().filter(|b| !is0(&b.exec)).cloned().collect();
    verify(&cl.client(3), &elsewhere, &others);

    // Node 1's own copy of shard 0: exactly what it acknowledged (plus
    // whole in-flight batches), nothing refused, nothing after the fence.
    for n in 1..=NODES {
        cl.kill9(n);
    }
    let solo = cl.write_solo_config(1);
    cl.restart(1, Some(&solo));
    let zero: Vec<Batch> = batches.iter().filter(|b| is0(&b.exec)).cloned().collect();
    let rep = verify(&cl.client(1), &shard0, &zero);
    eprintln!("[cluster] node 1's shard 0 after the switch: {rep:?}");
    assert_eq!(
        cl.client(1).get("/api/cluster").json()["shards"][0]["store_epoch"],
        2
    );
}

/// A node restarted on a config that moves one of its shards away (to a
/// newer epoch) still hosts its old copy of that shard. Its map knows the
/// newer epoch, so its store's fence should be moved to it at startup: the
/// old copy must refuse writes at the old epoch from then on, whatever a
/// later (stale, rolled-back) config says.
///
/// Regression: `App::open` used to fence only shards the map names as
/// local, and `peer::learn` only when the map itself moved, so the old copy
/// stayed at epoch 1 and a rolled-back node accepted writes on it.
#[test]
fn a_config_that_moves_a_shard_away_fences_the_old_copy_at_startup() {
    let _d = deadline(
        "a_config_that_moves_a_shard_away_fences_the_old_copy",
        TEST_DEADLINE,
    );
    let v1: Vec<(u32, u16, u64)> = (0..SHARDS).map(|s| (s, owner_of_shard(s), 1)).collect();
    let mut cl = Cluster::start(NODES, SHARDS, &v1, PeerTiming::relaxed());
    let key = key_on_shard("moved", 0, SHARDS);
    let id = id_of(
        &cl.client(1)
            .start(&json!({"workflow": "w", "routing_key": key})),
    );
    assert_eq!(shard_of_id(&id, SHARDS), 0);
    cl.client(1)
        .post(
            &format!("/api/executions/{id}/events"),
            &json!({"events": [ev("v1", 1)]}),
        )
        .expect(200);

    // Every node moves to v2 together (node 1 was down while it was rolled out).
    for n in 1..=NODES {
        cl.kill9(n);
    }
    let mut v2 = v1.clone();
    v2[0] = (0, 2, 2);
    let cfg2 = cl.write_config("cluster-v2.toml", &v2);
    for n in 1..=NODES {
        cl.restart(n, Some(&cfg2));
    }
    cl.wait_all_alive();
    let v = cl.client(1).get("/api/cluster").json();
    let s0 = &v["shards"][0];
    assert_eq!(
        (s0["owner"].as_u64(), s0["epoch"].as_u64()),
        (Some(2), Some(2)),
        "{s0}"
    );
    let fence = s0["store_epoch"].clone();

    // The consequence: node 1 rolled back alone to a stale config (no peer
    // to learn from) that names it owner at epoch 1 accepts a write on a
    // shard that node 2 owns at epoch 2: a forked log.
    for n in 1..=NODES {
        cl.kill9(n);
    }
    let solo = cl.write_solo_config(1);
    cl.restart(1, Some(&solo));
    let r = cl.client(1).post(
        &format!("/api/executions/{id}/events"),
        &json!({"events": [ev("stale", 1)]}),
    );
    assert!(
        fence == 2 && r.status == 421,
        "node 1 hosts an old copy of shard 0 and its v2 map says shard 0 is at epoch 2 on node 2, \
         but the copy's fence was left at {fence} (want 2); after a rollback to a stale config \
         node 1 answered a write at epoch 1 for that shard with {} {}",
        r.status,
        r.text()
    );
}

/// With fewer shards than nodes, a node that owns no shard still serves
/// unsteered starts (placed on an owner's shard and forwarded once) and
/// steered ones.
#[test]
fn a_node_that_owns_no_shard_still_serves_starts() {
    let _d = deadline(
        "a_node_that_owns_no_shard_still_serves_starts",
        TEST_DEADLINE,
    );
    let cl = Cluster::start(NODES, 2, &[], PeerTiming::relaxed());
    let c3 = cl.client(3);
    for i in 0..10 {
        let r = c3.post("/api/executions", &json!({"workflow": "w", "input": i}));
        r.expect(201);
        let id = id_of(&r.json());
        let owner = (shard_of_id(&id, 2) % 3) as u64 + 1;
        assert!(owner == 1 || owner == 2, "{id}");
        assert_eq!(r.header_u64("x-forkless-node"), Some(owner));
        assert_eq!(r.header_u64("x-forkless-hops"), Some(1));
        assert_eq!(c3.last_seq(&id), 1);
    }
    let key = "nobody/owns/me";
    let a = c3.start(&json!({"workflow": "w", "routing_key": key, "idempotency_key": "k"}));
    let b = cl.client(1).post(
        "/api/executions",
        &json!({"workflow": "w", "routing_key": key, "idempotency_key": "k"}),
    );
    b.expect(200);
    assert_eq!(id_of(&a), id_of(&b.json()));
}

/// A multi-node cluster configured with one shard: the non-owners forward
/// to the owner, or at least name it.
///
/// Regression: the 421 from a non-owner used to drop the owner hint the
/// node knows (`decide` answered `NotOwner { hint: None }` whenever routing
/// was inactive). Now such a cluster routes.
#[test]
fn one_shard_on_three_nodes_forwards_or_names_the_owner() {
    let _d = deadline("one_shard_on_three_nodes", TEST_DEADLINE);
    let cl = Cluster::start(NODES, 1, &[], PeerTiming::relaxed());
    let id = id_of(&cl.client(1).start(&json!({"workflow": "w"})));
    for n in [2u16, 3] {
        let r = cl.client(n).get(&format!("/api/executions/{id}"));
        let ok = r.status == 200 || (r.status == 421 && r.json()["owner_hint"]["node"] == 1);
        assert!(ok, "node {n} answered {} {}", r.status, r.text());
        let r = cl
            .client(n)
            .post("/api/executions", &json!({"workflow": "w"}));
        let ok = r.status == 201 || (r.status == 421 && r.json()["owner_hint"]["node"] == 1);
        assert!(ok, "a start on node {n} answered {} {}", r.status, r.text());
    }
}

/// Two configs that name different owners for a shard at the SAME epoch
/// (an operator moved it without bumping the epoch). If both kept accepting
/// writes, the same routing key and idempotency key would start two
/// different executions.
///
/// Regression: a peer that claims a shard this node owns at the same epoch
/// is a conflict; both must fail closed (and say so in the log) rather than
/// both write.
#[test]
fn two_owners_at_the_same_epoch_do_not_both_write() {
    let _d = deadline("two_owners_at_the_same_epoch", TEST_DEADLINE);
    let v1: Vec<(u32, u16, u64)> = (0..SHARDS).map(|s| (s, owner_of_shard(s), 1)).collect();
    let mut cl = Cluster::start(NODES, SHARDS, &v1, PeerTiming::relaxed());
    let mut bad = v1.clone();
    bad[0] = (0, 2, 1);
    let cfg = cl.write_config("cluster-same-epoch.toml", &bad);
    cl.restart(2, Some(&cfg));
    cl.wait_all_alive();
    // A few probe rounds for the nodes to compare notes.
    let settle = Instant::now();
    wait_until("a few probe intervals", Duration::from_secs(5), || {
        (settle.elapsed() > Duration::from_millis(10 * cl.timing.probe_interval_ms)).then_some(())
    });
    let key = key_on_shard("split", 0, SHARDS);
    let body = json!({"workflow": "w", "routing_key": key, "idempotency_key": "once"});
    let a = cl.client(1).post("/api/executions", &body);
    let b = cl.client(2).post("/api/executions", &body);
    let both = a.status == 201 && b.status == 201;
    assert!(
        !both || id_of(&a.json()) == id_of(&b.json()),
        "one start (same routing key and idempotency key) made two executions: \
         node 1 answered {} {} and node 2 answered {} {}",
        a.status,
        a.text(),
        b.status,
        b.text()
    );
}

/// How the fake owner answers forwarded requests.
#[derive(Clone, Copy, Debug, PartialEq)]
enum Garbage {
    /// 200, stamped by the owner, body not JSON.
    NotJson,
    /// 200 JSON stamped by another node.
    WrongNode,
    /// A proxy's 502 page: no node stamp, HTML.
    ProxyPage,
    /// Reads the request, closes without answering.
    Close,
    /// Promises 100 bytes, sends 10, closes.
    Truncated,
    /// Never answers.
    Hang,
}

/// A fake node 3 on its peer address: answers probes like a healthy node
/// that owns nothing, and every other request with `mode`'s garbage.
fn fake_peer(
    listener: std::net::TcpListener,
    mode: std::sync::Arc<std::sync::Mutex<Garbage>>,
    stop: Stop,
) {
    use std::io::{Read, Write};
    listener.set_nonblocking(true).unwrap();
    while !stop.is_set() {
        let (mut s, _) = match listener.accept() {
            Ok(x) => x,
            Err(_) => {
                std::thread::sleep(Duration::from_millis(5));
                continue;
            }
        };
        let mode = mode.clone();
        let stop = stop.clone();
        std::thread::spawn(move || {
            s.set_nonblocking(false).unwrap();
            s.set_read_timeout(Some(Duration::from_secs(10))).unwrap();
            // Keep-alive: serve requests on this connection until it closes.
            let mut buf = Vec::new();
            let mut chunk = [0u8; 8192];
            loop {
                let Some(end) = buf.windows(4).position(|w| w == b"\r\n\r\n") else {
                    match s.read(&mut chunk) {
                        Ok(0) | Err(_) => return,
                        Ok(n) => {
                            buf.extend_from_slice(&chunk[..n]);
                            continue;
                        }
                    }
                };
                let head = String::from_utf8_lossy(&buf[..end]).to_string();
                let len = head
                    .lines()
                    .find_map(|l| {
                        let (k, v) = l.split_once(':')?;
                        k.eq_ignore_ascii_case("content-length")
                            .then(|| v.trim().parse::<usize>().ok())
                            .flatten()
                    })
                    .unwrap_or(0);
                while buf.len() < end + 4 + len {
                    match s.read(&mut chunk) {
                        Ok(0) | Err(_) => return,
                        Ok(n) => buf.extend_from_slice(&chunk[..n]),
                    }
                }
                buf.drain(..end + 4 + len);
                let path = head.split(' ').nth(1).unwrap_or("").to_string();
                if path.starts_with("/internal/v1/status") {
                    let body = r#"{"node":3,"map_version":1,"owned":[]}"#;
                    let resp = format!(
                        "HTTP/1.1 200 OK\r\ncontent-type: application/json\r\nx-forkless-node: 3\r\ncontent-length: {}\r\n\r\n{body}",
                        body.len()
                    );
                    if s.write_all(resp.as_bytes()).is_err() {
                        return;
                    }
                    continue;
                }
                let m = *mode.lock().unwrap();
                let resp: &[u8] = match m {
                    Garbage::NotJson => b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\nx-forkless-node: 3\r\ncontent-length: 9\r\n\r\nnot json!",
                    Garbage::WrongNode => b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\nx-forkless-node: 2\r\ncontent-length: 11\r\n\r\n{\"ok\":true}",
                    Garbage::ProxyPage => b"HTTP/1.1 502 Bad Gateway\r\ncontent-type: text/html\r\ncontent-length: 22\r\n\r\n<h1>bad gateway</h1>\r\n",
                    Garbage::Close => return,
                    Garbage::Truncated => b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\nx-forkless-node: 3\r\ncontent-length: 100\r\n\r\n{\"seq\": 12",
                    Garbage::Hang => {
                        while !stop.is_set() {
                            std::thread::sleep(Duration::from_millis(20));
                        }
                        return;
                    }
                };
                let _ = s.write_all(resp);
                if m == Garbage::Truncated {
                    return;
                }
            }
        });
    }
}

/// Invariant 2 with an owner that answers, but not with an answer the
/// forwarder can vouch for: every such forward fails closed with 503
/// `owner_unavailable`, `executed: "unknown"`, Retry-After, within the
/// forward timeout; nothing is answered as if it succeeded.
#[test]
fn garbage_from_the_owner_fails_closed() {
    let _d = deadline("garbage_from_the_owner_fails_closed", TEST_DEADLINE);
    let mut cl = Cluster::prepare(NODES, SHARDS, PeerTiming::default());
    let peer3 = cl.node(3).peer;
    let listener = cl.take_listener(peer3);
    let mode = std::sync::Arc::new(std::sync::Mutex::new(Garbage::NotJson));
    let stop = Stop::default();
    let fake = {
        let (mode, stop) = (mode.clone(), stop.clone());
        std::thread::spawn(move || fake_peer(listener, mode, stop))
    };
    cl.start_nodes(&[1, 2], &[]);
    // Node 3 is the fake: it must be seen alive.
    cl.wait_peer_seen(&[1, 2], 3, true);
    // An id on a shard of node 3 (that it never created: the fake owns it).
    let id = (1i64..)
        .find(|i| owner_of_shard(forkless_sharding::shard_for(*i, shard_count(SHARDS))) == 3)
        .unwrap()
        .to_string();
    let key = key_on_shard(
        "fake",
        (0..SHARDS).find(|s| owner_of_shard(*s) == 3).unwrap(),
        SHARDS,
    );
    let forward_timeout = Duration::from_millis(cl.timing.forward_timeout_ms);
    for m in [
        Garbage::NotJson,
        Garbage::WrongNode,
        Garbage::ProxyPage,
        Garbage::Close,
        Garbage::Truncated,
        Garbage::Hang,
    ] {
        *mode.lock().unwrap() = m;
        for n in [1u16, 2] {
            let c = cl.client(n);
            let reqs: Vec<(&str, String, Option<Value>)> = vec![
                ("GET", format!("/api/executions/{id}"), None),
                (
                    "POST",
                    format!("/api/executions/{id}/events"),
                    Some(json!({"events": [ev("t", 0)]})),
                ),
                (
                    "POST",
                    "/api/executions".into(),
                    Some(json!({"workflow": "w", "routing_key": key})),
                ),
            ];
            for (method, path, body) in &reqs {
                let t = Instant::now();
                let b = body.as_ref().map(|b| b.to_string());
                let r = c.req(method, path, &[], b.as_deref().map(str::as_bytes));
                let took = t.elapsed();
                let v = r.expect_error(503, "owner_unavailable");
                assert_eq!(
                    v["executed"], "unknown",
                    "{m:?} {method} {path} via {n}: {v}"
                );
                assert!(r.header("retry-after").is_some(), "{m:?}: {:?}", r.headers);
                assert_eq!(r.header_u64("x-forkless-node"), Some(n as u64), "{m:?}");
                assert!(
                    took < forward_timeout + Duration::from_millis(1500),
                    "{m:?} {method} {path}: {took:?}"
                );
            }
        }
    }
    assert!(
        cl.client(1)
            .metric("forkless_route_total{outcome=\"forward_failed\"}")
            >= 18.0
    );
    assert_eq!(
        cl.client(1)
            .metric("forkless_route_total{outcome=\"forwarded_ok\"}"),
        0.0
    );
    stop.set();
    drop(cl);
    let _ = fake.join();
}
