//! Reads that ask for `consistency=stale` on a replicated cluster (three
//! nodes, one shard on all three): a follower answers them itself, from
//! its replica as it stands, marked stale with its applied index, and
//! goes on answering them when its group has no leader (the other two
//! nodes killed), where a linearizable read fails closed. A read that
//! does not ask goes to the leader; a long-poll cannot be stale; an
//! unknown consistency is a 400 naming the field.

use forkless_it::*;
use std::time::Duration;

const SHARDS: u32 = 1;

#[test]
fn a_follower_answers_a_stale_read_itself_marked_stale_even_without_a_leader() {
    let _deadline = deadline("stale reads", Duration::from_secs(120));
    let mut cl = Cluster::start_replicated(3, SHARDS, 3, PeerTiming::default());
    let leaders = cl.wait_leaders_known(1, &[]);
    let leader = leaders[0].0;
    let follower = (1..=3u16).find(|n| *n != leader).expect("a follower");
    let c = cl.client(follower);
    let started = settled(Duration::from_secs(20), || {
        c.post(
            "/api/executions",
            &json!({"workflow": "w", "idempotency_key": "stale-1"}),
        )
    });
    let id = id_of(&started.json());
    let r = settled(Duration::from_secs(20), || {
        c.post(
            &format!("/api/executions/{id}/events"),
            &json!({"events": [{"type": "a"}, {"type": "b"}], "expected_last_seq": 1}),
        )
    });
    r.expect(200);
    cl.wait_replicas_level();

    // Linearizable (the default): forwarded to the leader, not marked.
    let r = c.get(&format!("/api/executions/{id}"));
    r.expect(200);
    assert_eq!(r.header_u64("x-forkless-node"), Some(u64::from(leader)));
    assert_eq!(r.header("x-forkless-read"), None);

    // Stale: answered by the follower itself, marked, with every event
    // it had applied.
    let stale_get = |c: &Client| c.get(&format!("/api/executions/{id}?consistency=stale"));
    let r = stale_get(&c);
    r.expect(200);
    assert_eq!(r.header_u64("x-forkless-node"), Some(u64::from(follower)));
    assert_eq!(r.header("x-forkless-read"), Some("stale"));
    assert!(r
        .header_u64("x-forkless-applied-index")
        .is_some_and(|i| i >= 2));
    assert_eq!(r.json()["last_seq"], 3, "{}", r.text());
    let r = c.get(&format!("/api/executions/{id}/events?consistency=stale"));
    r.expect(200);
    assert_eq!(r.header("x-forkless-read"), Some("stale"));
    assert_eq!(r.json()["events"].as_array().map(Vec::len), Some(3));

    // Bad asks, answered before any routing.
    let v = c
        .get(&format!("/api/executions/{id}?consistency=eventual"))
        .expect_error(400, "invalid_request");
    assert_eq!(v["field"], "consistency", "{v}");
    let v = c
        .get(&format!(
            "/api/executions/{id}/events?consistency=stale&wait_ms=100"
        ))
        .expect_error(400, "invalid_request");
    assert_eq!(v["field"], "consistency", "{v}");

    // The follower alone: its group has no quorum. A linearizable read
    // fails closed; a stale one is still answered, from its replica.
    for n in (1..=3u16).filter(|n| *n != follower) {
        cl.kill9(n);
    }
    let r = wait_until(
        "a linearizable read through the lone follower to fail closed",
        Duration::from_secs(20),
        || {
            let r = c.get(&format!("/api/executions/{id}"));
            (r.status == 503).then_some(r)
        },
    );
    assert!(
        ["owner_unavailable", "shard_unavailable"].contains(&r.error().as_str()),
        "{}",
        r.text()
    );
    assert_eq!(r.header("x-forkless-read"), None);
    let r = stale_get(&c);
    r.expect(200);
    assert_eq!(r.header("x-forkless-read"), Some("stale"));
    assert_eq!(r.json()["last_seq"], 3, "{}", r.text());
}
