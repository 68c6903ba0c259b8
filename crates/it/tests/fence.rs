//! Reads from a fenced copy: a node whose copy of a shard has been fenced
//! by a newer epoch never answers a read for that shard from that copy.
//! Two real nodes on loopback.

use forkless_it::*;
use std::time::Duration;

/// The reads of `id`, each as (method, path).
fn reads(id: &str) -> [String; 3] {
    [
        format!("/api/executions/{id}"),
        format!("/api/executions/{id}/events"),
        format!("/api/executions/{id}/events?after=1&limit=10"),
    ]
}

/// Node 1 knows shard 0 is node 2's at epoch 2: a client's read through
/// node 1 is forwarded to node 2 (which has no such execution: 404, from
/// node 2), and a peer's read (hop header) is refused with 421 naming
/// node 2 at epoch 2.
#[track_caller]
fn reads_go_to_the_new_owner(cl: &Cluster, id: &str) {
    let peer = [
        ("x-forkless-hops", "1"),
        ("x-forkless-peer-token", cl.secret.as_str()),
    ];
    for path in reads(id) {
        let r = cl.client(1).get(&path);
        assert_eq!(
            (r.status, r.header_u64("x-forkless-node")),
            (404, Some(2)),
            "GET {path} through node 1 must be forwarded to node 2: {} {}",
            r.status,
            r.text()
        );
        let r = cl.client(1).req("GET", &path, &peer, None);
        let v = r.expect_error(421, "not_owner");
        assert_eq!(v["owner_hint"]["node"], 2, "{path}: {v}");
        assert_eq!(v["owner_epoch"], 2, "{path}: {v}");
        assert_eq!(v["map_version"], 2, "{path}: {v}");
        assert_eq!(v["shard"], 0, "{path}: {v}");
        assert_eq!(v["executed"], false, "{path}: {v}");
        assert_eq!(r.header_u64("x-forkless-node"), Some(1));
    }
}

#[test]
fn reads_of_a_fenced_copy_are_refused_or_forwarded_never_answered_from_it() {
    let _d = deadline("reads_of_a_fenced_copy", TEST_DEADLINE);
    let v1 = [(0, 1, 1), (1, 2, 1)];
    let mut cl = Cluster::start(2, 2, &v1, PeerTiming::relaxed());
    let key = key_on_shard("fenced-read", 0, 2);
    let r = cl.client(1).post(
        "/api/executions",
        &json!({"workflow": "w", "routing_key": key}),
    );
    r.expect(201);
    assert_eq!(r.header_u64("x-forkless-node"), Some(1));
    let id = id_of(&r.json());
    cl.client(1)
        .post(
            &format!("/api/executions/{id}/events"),
            &json!({"events": [{"type": "v1"}, {"type": "v1"}]}),
        )
        .expect(200);
    cl.client(1)
        .get(&format!("/api/executions/{id}"))
        .expect(200);

    // Shard 0 is handed to node 2 at epoch 2; node 1 learns it by probe
    // and fences its copy.
    let v2 = [(0, 2, 2), (1, 2, 1)];
    let cfg2 = cl.write_config("cluster-v2.toml", &v2);
    cl.restart(2, Some(&cfg2));
    wait_until(
        "node 1 to learn shard 0's new owner and fence its copy",
        Duration::from_secs(10),
        || {
            let v = cl.client(1).get("/api/cluster").json();
            let s = &v["shards"][0];
            (s["owner"] == 2 && s["epoch"] == 2 && s["store_epoch"] == 2).then_some(())
        },
    );
    reads_go_to_the_new_owner(&cl, &id);

    // Node 1 restarted on the stale config (it names node 1 owner at
    // epoch 1) while node 2 is paused, so it cannot learn the new owner:
    // its copy is fenced at epoch 2, so it is not the owner at the current
    // epoch, and it refuses reads of shard 0 instead of answering them
    // from the stale copy.
    cl.node(2).proc().sigstop();
    cl.restart(1, None);
    let peer = [
        ("x-forkless-hops", "1"),
        ("x-forkless-peer-token", cl.secret.as_str()),
    ];
    for path in reads(&id) {
        for headers in [&peer[..], &[]] {
            let r = cl.client(1).req("GET", &path, headers, None);
            let v = r.expect_error(421, "not_owner");
            assert_eq!(v["shard"], 0, "{path}: {v}");
            assert_eq!(v["executed"], false, "{path}: {v}");
            assert!(v["map_version"].is_u64(), "{path}: {v}");
            assert!(v.get("owner_hint").is_some(), "{path}: {v}");
        }
    }
    // Writes were already refused (the store's fence).
    let r = cl.client(1).post(
        &format!("/api/executions/{id}/events"),
        &json!({"events": [{"type": "stale"}]}),
    );
    r.expect_error(421, "not_owner");

    // Once node 2 answers again, node 1 learns the owner and forwards.
    cl.node(2).proc().sigcont();
    wait_until(
        "the restarted node 1 to re-learn shard 0's owner",
        Duration::from_secs(10),
        || {
            let v = cl.client(1).get("/api/cluster").json();
            (v["shards"][0]["owner"] == 2).then_some(())
        },
    );
    cl.wait_all_alive();
    reads_go_to_the_new_owner(&cl, &id);
}
