//! The client against real `forkless serve` processes on loopback: every
//! verb on one node, then owner routing versus fixed routing on a 2-node
//! static cluster (checked with the nodes' own routing metrics).
//!
//! The binary is `$FORKLESS_BIN`, else `cargo build -p forkless` is run and
//! `target/debug/forkless` used.

use forkless_client::{
    AppendEvents, Cancel, Client, Config, Error, Executed, NewEvent, ReadEvents, RetryPolicy,
    Routing, Signal, StartExecution,
};
use serde_json::value::RawValue;
use std::time::Duration;

mod common;
use common::{free_ports, Node};

fn raw(s: &str) -> Option<Box<RawValue>> {
    Some(RawValue::from_string(s.to_string()).expect("valid JSON"))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_verb_against_one_node() {
    let dir = tempfile::tempdir().expect("tempdir");
    let port = free_ports(1)[0];
    let listen = format!("127.0.0.1:{port}");
    let data = dir.path().join("data");
    let node = Node::spawn(
        &[
            "--data-dir",
            data.to_str().expect("utf-8 path"),
            "--listen",
            &listen,
        ],
        port,
        dir.path().join("node.log"),
    );
    let c = Client::new(&node.url()).expect("client");

    let map = c.cluster().await.expect("cluster map");
    assert_eq!(map.shard_count, 1);
    assert!(!map.routing_active);

    // Start, steered and idempotent.
    let mut s = StartExecution::new("order");
    s.input = raw(r#"{"order":42}"#);
    s.routing_key = Some("tenant-a/order 1".into());
    s.idempotency_key = Some("start-1".into());
    let e = c.start(&s).await.expect("start");
    assert_eq!((e.last_seq, e.status.as_str()), (1, "running"));
    assert_eq!(e.existing, Some(false));
    let again = c.start(&s).await.expect("repeated start");
    assert_eq!(again.execution_id, e.execution_id);
    assert_eq!(again.existing, Some(true));
    let id = e.execution_id;

    let found = c.find_by_key("tenant-a/order 1").await.expect("by key");
    assert_eq!(found.executions.len(), 1);
    assert_eq!(
        found.executions[0]["execution_id"].as_str(),
        Some(id.to_string().as_str())
    );

    // Appends: ordered, checked, deduplicated.
    let mut ev = NewEvent::new("order.paid");
    ev.payload = raw(r#"{"amount":10}"#);
    let a = c
        .append(
            id,
            &AppendEvents {
                events: vec![ev.clone()],
                expected_last_seq: Some(1),
            },
        )
        .await
        .expect("append");
    assert_eq!((a.first_seq, a.last_seq), (2, 2));
    let conflict = c
        .append(
            id,
            &AppendEvents {
                events: vec![ev.clone()],
                expected_last_seq: Some(1),
            },
        )
        .await;
    assert!(
        matches!(
            conflict,
            Err(Error::SequenceConflict {
                last_seq: 2,
                expected_last_seq: Some(1),
                ..
            })
        ),
        "{conflict:?}"
    );
    let mut keyed = NewEvent::new("order.shipped");
    keyed.idempotency_key = Some("ship-1".into());
    let req = AppendEvents {
        events: vec![keyed],
        expected_last_seq: None,
    };
    let first = c.append(id, &req).await.expect("keyed append");
    let repeat = c.append(id, &req).await.expect("repeated keyed append");
    assert_eq!(first.last_seq, repeat.last_seq);
    assert!(repeat.deduplicated);

    let bad = c
        .append(
            id,
            &AppendEvents {
                events: vec![NewEvent::new("execution.started")],
                expected_last_seq: None,
            },
        )
        .await;
    assert!(
        matches!(bad, Err(Error::Invalid { ref field, .. }) if field == "events[0].type"),
        "{bad:?}"
    );

    // Long-poll: a read waiting for seq 4 is woken by the signal.
    let reader = {
        let c = c.clone();
        tokio::spawn(async move {
            c.read_events(
                id,
                ReadEvents {
                    after: 3,
                    limit: None,
                    wait: Some(Duration::from_secs(10)),
                },
            )
            .await
        })
    };
    tokio::time::sleep(Duration::from_millis(200)).await;
    let sig = c
        .signal(
            id,
            &Signal {
                name: "approve".into(),
                payload: raw(r#""yes""#),
                idempotency_key: None,
            },
        )
        .await
        .expect("signal");
    assert_eq!(sig.seq, 4);
    let page = reader.await.expect("reader task").expect("long-poll");
    assert_eq!(page.events.len(), 1);
    assert_eq!(page.events[0].event_type, "execution.signaled");

    let g = c.get(id).await.expect("get");
    assert_eq!(g.last_seq, 4);

    let cancel = c
        .cancel(
            id,
            &Cancel {
                reason: Some("customer asked".into()),
                idempotency_key: None,
            },
        )
        .await
        .expect("cancel");
    assert_eq!(cancel.status.as_deref(), Some("cancelled"));
    let closed = c.append(id, &req_untyped()).await;
    assert!(
        matches!(closed, Err(Error::Closed { ref status, last_seq: 5, .. }) if status == "cancelled"),
        "{closed:?}"
    );

    let all = c
        .read_events(id, ReadEvents::default())
        .await
        .expect("read");
    let seqs: Vec<u64> = all.events.iter().map(|e| e.seq).collect();
    assert_eq!(seqs, vec![1, 2, 3, 4, 5]);
    assert!(all.is_closed());

    let missing = c
        .get(forkless_types::ExecutionId::new(12345).expect("positive"))
        .await;
    assert!(
        matches!(missing, Err(Error::NotFound { .. })),
        "{missing:?}"
    );

    // The node goes away: an append without a key reports "nothing sent".
    drop(node);
    let mut cfg = Config::new(&format!("http://{listen}"));
    cfg.retry = RetryPolicy {
        max_attempts: 2,
        initial_backoff: Duration::from_millis(10),
        ..RetryPolicy::default()
    };
    let c2 = Client::with_config(cfg).expect("client");
    let gone = c2.append(id, &req_untyped()).await;
    assert!(
        matches!(
            gone,
            Err(Error::Transport {
                executed: Executed::No,
                attempts: 2,
                ..
            })
        ),
        "{gone:?}"
    );
}

fn req_untyped() -> AppendEvents {
    AppendEvents {
        events: vec![NewEvent::new("x")],
        expected_last_seq: None,
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn owner_routing_never_forwards_and_fixed_routing_does() {
    let dir = tempfile::tempdir().expect("tempdir");
    let ports = free_ports(4);
    let (api, peer) = (&ports[..2], &ports[2..]);
    let mut toml = String::from(
        "shard_count = 8\nsecret = \"client-test-secret-0123456789\"\n\n[peer]\nforward_connect_timeout_ms = 500\nforward_timeout_ms = 2000\nprobe_interval_ms = 250\nprobe_timeout_ms = 500\n",
    );
    for i in 0..2 {
        toml.push_str(&format!(
            "\n[[nodes]]\nid = {}\napi_addr = \"127.0.0.1:{}\"\npeer_addr = \"127.0.0.1:{}\"\n",
            i + 1,
            api[i],
            peer[i]
        ));
    }
    let config = dir.path().join("cluster.toml");
    std::fs::write(&config, toml).expect("writing the config");
    let nodes: Vec<Node> = (0..2)
        .map(|i| {
            let data = dir.path().join(format!("node-{}", i + 1));
            Node::spawn(
                &[
                    "--config",
                    config.to_str().expect("utf-8"),
                    "--node",
                    &(i + 1).to_string(),
                    "--data-dir",
                    data.to_str().expect("utf-8"),
                ],
                api[i],
                dir.path().join(format!("node-{}.log", i + 1)),
            )
        })
        .collect();

    let owner = Client::new(&nodes[0].url()).expect("client");
    let map = owner.cluster().await.expect("map");
    assert_eq!(map.shard_count, 8);
    assert!(map.routing_active);
    assert_eq!(map.nodes.len(), 2);

    // Executions on every shard (steered by routing keys), both nodes.
    let mut ids = Vec::new();
    for k in 0..32 {
        let mut s = StartExecution::new("w");
        s.routing_key = Some(format!("client-test/{k}"));
        ids.push(owner.start(&s).await.expect("start").execution_id);
    }
    let shards: std::collections::HashSet<u32> = ids.iter().map(|id| map.shard_of(*id)).collect();
    assert!(shards.len() > 4, "keys spread over shards: {shards:?}");

    let forwarded =
        |nodes: &[Node]| -> u64 { nodes.iter().map(|n| n.route_count("forwarded_ok")).sum() };
    let before = forwarded(&nodes);
    for id in &ids {
        owner.append(*id, &req_untyped()).await.expect("append");
        owner.get(*id).await.expect("get");
    }
    assert_eq!(
        forwarded(&nodes),
        before,
        "owner routing took no forwarding hop"
    );

    let mut cfg = Config::new(&nodes[0].url());
    cfg.routing = Routing::Fixed;
    let fixed = Client::with_config(cfg).expect("client");
    for id in &ids {
        let a = fixed.append(*id, &req_untyped()).await.expect("append");
        assert_eq!(a.last_seq, 3);
    }
    let hops = forwarded(&nodes) - before;
    let remote = ids
        .iter()
        .filter(|id| map.owner(map.shard_of(**id)).map(|n| n.id) != Some(1))
        .count() as u64;
    assert!(remote > 0);
    assert_eq!(
        hops, remote,
        "fixed routing forwarded exactly the non-owned appends"
    );
}
