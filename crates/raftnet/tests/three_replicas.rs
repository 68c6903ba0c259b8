//! Three stores in one process, each a replica of one shard's Raft group,
//! talking over the real transport on loopback: a write on the leader is
//! applied on every replica, a follower refuses writes as not executed,
//! and when the leader goes the other two elect one that has every
//! acknowledged write and takes new ones.

use forkless_raftnet::{serve, Groups, Links};
use forkless_store::{
    AppendRequest, NewEvent, RaftStatus, Replication, StartRequest, Store, StoreConfig, StoreError,
};
use forkless_types::{Epoch, ExecutionId, ShardCount, ShardId};
use std::collections::BTreeMap;
use std::sync::{Arc, OnceLock};
use std::time::{Duration, Instant};

const SHARD: ShardId = ShardId(0);

struct Node {
    store: Option<Arc<Store>>,
    stop: tokio::sync::watch::Sender<bool>,
}

impl Node {
    fn status(&self) -> Option<RaftStatus> {
        self.store.as_ref()?.shard(SHARD)?.raft_status()
    }
}

async fn cluster(dir: &std::path::Path) -> Vec<Node> {
    let mut listeners = Vec::new();
    let mut addrs = BTreeMap::new();
    for id in 1..=3u64 {
        let l = tokio::net::TcpListener::bind("127.0.0.1:0")
            .await
            .expect("bind");
        addrs.insert(id, l.local_addr().expect("addr").to_string());
        listeners.push((id, l));
    }
    let members: BTreeMap<u64, openraft::BasicNode> = addrs
        .iter()
        .map(|(id, a)| (*id, openraft::BasicNode::new(a.clone())))
        .collect();
    let mut nodes = Vec::new();
    for (id, listener) in listeners {
        let cell: Arc<OnceLock<Arc<Store>>> = Arc::default();
        let found = cell.clone();
        let groups: Groups = Arc::new(move |g| found.get()?.shard(ShardId(g)));
        let (stop, stopped) = tokio::sync::watch::channel(false);
        tokio::spawn(serve(listener, "secret".into(), groups, stopped));
        let members = members.clone();
        let rep = Replication {
            me: id,
            members: Arc::new(move |_| members.clone()),
            peers: Arc::new(Links::new(id, "secret".into(), addrs.clone())),
            timing: forkless_store::RaftTiming::default(),
        };
        let path = dir.join(id.to_string());
        let store = tokio::task::spawn_blocking(move || {
            let store = Store::open(
                &path,
                ShardCount::ONE,
                StoreConfig {
                    raft: true,
                    replication: Some(rep),
                    ..StoreConfig::default()
                },
            )
            .expect("open");
            store.open_shard(SHARD, Epoch(1)).expect("open shard");
            Arc::new(store)
        })
        .await
        .expect("opened");
        let _ = cell.set(store.clone());
        nodes.push(Node {
            store: Some(store),
            stop,
        });
    }
    nodes
}

/// The index of the node that leads and has applied its term's first
/// entry (so it takes writes), waiting for one at most 20 s.
async fn leader(nodes: &[Node]) -> usize {
    let until = Instant::now() + Duration::from_secs(20);
    loop {
        for (i, n) in nodes.iter().enumerate() {
            if let Some(s) = n.status() {
                if s.leader == Some(s.me) && s.state == "leader" {
                    return i;
                }
            }
        }
        assert!(Instant::now() < until, "no leader within 20 s");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

fn id(n: i64) -> ExecutionId {
    ExecutionId::new(n).expect("id")
}

async fn write(node: &Node, n: i64) -> Result<(), StoreError> {
    let st = node
        .store
        .as_ref()
        .expect("up")
        .shard(SHARD)
        .expect("shard");
    st.start(StartRequest {
        epoch: Epoch(1),
        id: id(n),
        workflow: "wf".into(),
        started_payload: b"{}".to_vec(),
        routing_key: None,
        idempotency_key: None,
    })
    .await?;
    st.append(AppendRequest {
        epoch: Epoch(1),
        id: id(n),
        events: vec![NewEvent {
            event_type: "step".into(),
            payload: format!("{{\"n\":{n}}}").into_bytes(),
            idempotency_key: Some(format!("k{n}")),
        }],
        expected_last_seq: Some(1),
    })
    .await?;
    Ok(())
}

/// Waits until node `i` has applied up to `index`, then checks it holds
/// executions `ns` with both their events.
async fn holds(nodes: &[Node], i: usize, ns: std::ops::RangeInclusive<i64>, index: u64) {
    let until = Instant::now() + Duration::from_secs(10);
    while nodes[i].status().and_then(|s| s.applied).unwrap_or(0) < index {
        assert!(
            Instant::now() < until,
            "node {i} did not apply up to {index}: {:?}",
            nodes[i].status()
        );
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    let st = nodes[i]
        .store
        .as_ref()
        .expect("up")
        .shard(SHARD)
        .expect("shard");
    for n in ns {
        let (meta, events) = st
            .read_events(id(n), 0, 10)
            .expect("read")
            .unwrap_or_else(|| panic!("node {i} lacks execution {n}"));
        assert_eq!(meta.last_seq, 2, "node {i}, execution {n}");
        assert_eq!(events.len(), 2);
        assert_eq!(events[1].payload, format!("{{\"n\":{n}}}").into_bytes());
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn writes_replicate_and_survive_the_leader() {
    let dir = tempfile::tempdir().expect("tempdir");
    let mut nodes = cluster(dir.path()).await;
    let l = leader(&nodes).await;
    for n in 1..=20 {
        write(&nodes[l], n).await.expect("a write on the leader");
    }
    let index = nodes[l]
        .status()
        .and_then(|s| s.last_log_index)
        .expect("log");
    for i in 0..3 {
        holds(&nodes, i, 1..=20, index).await;
    }
    // A follower refuses, untried.
    let f = (l + 1) % 3;
    match write(&nodes[f], 100).await {
        Err(StoreError::NotExecuted { reason, .. }) => {
            assert!(reason.contains("does not lead"), "{reason}")
        }
        other => panic!("a follower's write: {other:?}"),
    }

    // The leader goes: its shard and its listener.
    let _ = nodes[l].stop.send(true);
    nodes[l].store = None;
    let l2 = leader(&nodes).await;
    assert_ne!(l2, l);
    // Its first writes may meet the election's end.
    let until = Instant::now() + Duration::from_secs(10);
    while let Err(e) = write(&nodes[l2], 21).await {
        assert!(Instant::now() < until, "the new leader takes no write: {e}");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    for n in 22..=30 {
        write(&nodes[l2], n)
            .await
            .expect("a write on the new leader");
    }
    let index = nodes[l2]
        .status()
        .and_then(|s| s.last_log_index)
        .expect("log");
    let other = (0..3).find(|i| *i != l && *i != l2).expect("the third");
    holds(&nodes, l2, 1..=30, index).await;
    holds(&nodes, other, 1..=30, index).await;
}
