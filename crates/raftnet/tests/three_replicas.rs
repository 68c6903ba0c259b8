//! Three stores in one process, each a replica of one shard's Raft group,
//! talking over the real transport on loopback: a write on the leader is
//! applied on every replica, a follower refuses writes as not executed,
//! and when the leader goes the other two elect one that has every
//! acknowledged write and takes new ones.

use forkless_raftnet::{serve, Groups, Links};
use forkless_store::{
    AppendRequest, NewEvent, RaftStatus, Replication, Rpc, StartRequest, Store, StoreConfig,
    StoreError,
};
use forkless_types::{Epoch, ExecutionId, ShardCount, ShardId};
use std::collections::BTreeMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, RwLock};
use std::time::{Duration, Instant};

const SHARD: ShardId = ShardId(0);

struct Node {
    id: u64,
    store: Option<Arc<Store>>,
    /// Its transport to the other two.
    peers: Arc<dyn forkless_store::Peers>,
    /// The same transport, whose links a test may point elsewhere (a cut).
    links: Links,
    stop: tokio::sync::watch::Sender<bool>,
    /// Where it listens for the other two.
    addr: String,
    /// Opens its store.
    opener: Arc<dyn Fn() -> Arc<Store> + Send + Sync>,
    /// The store its listener hands calls to.
    cell: Arc<RwLock<Option<Arc<Store>>>>,
    /// Its data directory.
    path: std::path::PathBuf,
    /// Set as it shuts down: its replica takes no leadership
    /// (`Replication::draining`).
    draining: Arc<std::sync::atomic::AtomicBool>,
    /// Notified as its replica comes to lead (`Replication::beat_now`).
    beat_now: Arc<tokio::sync::Notify>,
    /// Which of its calls to the others are lost on the way (none unless
    /// a test says).
    lost: Lost,
}

/// Picks the calls a node's transport loses, as a link that drops them
/// would ([`Lossy`]).
type Lost = Arc<RwLock<Option<Arc<dyn Fn(&Rpc) -> bool + Send + Sync>>>>;

/// A node's transport to the others, which loses the calls its [`Lost`]
/// picks: their senders see the peer as unreachable.
struct Lossy {
    links: Links,
    lost: Lost,
}

impl forkless_store::Peers for Lossy {
    fn send(
        &self,
        target: u64,
        group: u32,
        rpc: Rpc,
        within: Duration,
    ) -> futures_util::future::BoxFuture<
        'static,
        Result<forkless_store::Answer, forkless_store::CallError>,
    > {
        let lose = self.lost.read().expect("lost").clone();
        if lose.is_some_and(|lose| lose(&rpc)) {
            return Box::pin(async move {
                Err(forkless_store::CallError::Unreachable(format!(
                    "the test lost a call to node {target}"
                )))
            });
        }
        self.links.send(target, group, rpc, within)
    }

    fn link_down(&self, target: u64) -> bool {
        self.links.link_down(target)
    }
}

impl Node {
    /// Opens its store (a node left closed at first, or stopped).
    async fn open(&mut self) {
        let open = self.opener.clone();
        let store = tokio::task::spawn_blocking(move || open())
            .await
            .expect("opened");
        *self.cell.write().expect("cell") = Some(store.clone());
        self.store = Some(store);
    }

    /// Stops the node: its listener and its store.
    fn stop(&mut self) {
        let _ = self.stop.send(true);
        self.store = None;
        *self.cell.write().expect("cell") = None;
    }

    /// Starts a stopped node again on its data: its listener, then its
    /// store.
    async fn restart(&mut self) {
        let until = Instant::now() + Duration::from_secs(10);
        let listener = loop {
            match tokio::net::TcpListener::bind(&self.addr).await {
                Ok(l) => break l,
                Err(e) => {
                    assert!(Instant::now() < until, "rebinding {}: {e}", self.addr);
                    tokio::time::sleep(Duration::from_millis(20)).await;
                }
            }
        };
        let (stop, stopped) = tokio::sync::watch::channel(false);
        self.stop = stop;
        tokio::spawn(serve(
            listener,
            "secret".into(),
            groups(&self.cell),
            stopped,
        ));
        self.open().await;
    }
}

fn groups(cell: &Arc<RwLock<Option<Arc<Store>>>>) -> Groups {
    let cell = cell.clone();
    Arc::new(move |g| cell.read().ok()?.as_ref()?.shard(ShardId(g)))
}

impl Node {
    fn status(&self) -> Option<RaftStatus> {
        self.store.as_ref()?.shard(SHARD)?.raft_status()
    }

    /// Its replica of the shard (the node is up).
    fn shard(&self) -> Arc<forkless_store::ShardStore> {
        self.store
            .as_ref()
            .expect("up")
            .shard(SHARD)
            .expect("shard")
    }

    /// Whether its replica takes itself for the leader at `term`.
    fn leads_at(&self, term: u64) -> bool {
        self.status()
            .is_some_and(|s| s.state == "leader" && s.term == term)
    }

    /// Runs the node's balancer until the node stops, its shard read
    /// through the node (none once it stops), preferring its own replica
    /// (it hands no leadership on), and removing learners left behind
    /// after `learners_kept`.
    fn balance(&self, learners_kept: Duration) {
        self.balance_preferring(learners_kept, Arc::new(AtomicU64::new(self.id)));
    }

    /// [`Node::balance`], the shard's preferred replica the one `prefer`
    /// names when the balancer looks.
    fn balance_preferring(&self, learners_kept: Duration, prefer: Arc<AtomicU64>) {
        let cell = self.cell.clone();
        tokio::spawn(forkless_raftnet::balance::run(
            Arc::new(move || {
                cell.read()
                    .ok()
                    .and_then(|s| s.as_ref()?.shard(SHARD))
                    .into_iter()
                    .collect()
            }),
            Arc::new(move |_| vec![prefer.load(Ordering::Acquire)]),
            Arc::default(),
            self.peers.clone(),
            forkless_raftnet::balance::Settings {
                timing: forkless_store::RaftTiming::default(),
                learners_kept,
            },
            forkless_raftnet::balance::DrainState::default(),
            self.stop.subscribe(),
        ));
    }

    /// Runs the node's heartbeat, which lets its idle groups go quiet,
    /// until the node stops.
    fn quiesce(&self) {
        let st = self.shard();
        let me = self.id;
        tokio::spawn(forkless_raftnet::quiesce::run(
            self.peers.clone(),
            Arc::new(move || (1..=3).filter(|p| *p != me).collect()),
            Arc::new(move || vec![st.clone()]),
            forkless_store::RaftTiming::default(),
            Arc::default(),
            Arc::default(),
            self.stop.subscribe(),
        ));
    }
}

async fn cluster(dir: &std::path::Path) -> Vec<Node> {
    cluster_with(dir, &[]).await
}

/// Three nodes; those in `closed` listen but open their store only when
/// the test says ([`Node::open`]).
async fn cluster_with(dir: &std::path::Path, closed: &[u64]) -> Vec<Node> {
    cluster_of(dir, closed, forkless_store::RaftLogLimits::default()).await
}

/// [`cluster_with`], each group keeping its log in memory as `log` says.
async fn cluster_of(
    dir: &std::path::Path,
    closed: &[u64],
    log: forkless_store::RaftLogLimits,
) -> Vec<Node> {
    cluster_and_spares(dir, closed, log, 0).await
}

/// [`cluster_of`], and `spares` nodes more (ids 4, 5, ...), which every
/// node reaches but which hold no replica: a move may take one on.
async fn cluster_and_spares(
    dir: &std::path::Path,
    closed: &[u64],
    log: forkless_store::RaftLogLimits,
    spares: u64,
) -> Vec<Node> {
    let mut listeners = Vec::new();
    let mut addrs = BTreeMap::new();
    for id in 1..=3 + spares {
        let l = tokio::net::TcpListener::bind("127.0.0.1:0")
            .await
            .expect("bind");
        addrs.insert(id, l.local_addr().expect("addr").to_string());
        listeners.push((id, l));
    }
    let members: BTreeMap<u64, openraft::BasicNode> = addrs
        .iter()
        .filter(|(id, _)| **id <= 3)
        .map(|(id, a)| (*id, openraft::BasicNode::new(a.clone())))
        .collect();
    let mut nodes = Vec::new();
    for (id, listener) in listeners {
        let cell: Arc<RwLock<Option<Arc<Store>>>> = Arc::default();
        let (stop, stopped) = tokio::sync::watch::channel(false);
        tokio::spawn(serve(listener, "secret".into(), groups(&cell), stopped));
        let members = members.clone();
        let links = Links::new(id, "secret".into(), addrs.clone());
        let lost: Lost = Arc::default();
        let peers: Arc<dyn forkless_store::Peers> = Arc::new(Lossy {
            links: links.clone(),
            lost: lost.clone(),
        });
        let draining: Arc<std::sync::atomic::AtomicBool> = Arc::default();
        let beat_now: Arc<tokio::sync::Notify> = Arc::default();
        let rep = Replication {
            me: id,
            members: Arc::new(move |_| members.clone()),
            peers: peers.clone(),
            timing: forkless_store::RaftTiming::default(),
            log,
            draining: draining.clone(),
            beat_now: beat_now.clone(),
        };
        let path = dir.join(id.to_string());
        let opened = path.clone();
        let opener = Arc::new(move || {
            let store = Store::open(
                &path,
                ShardCount::ONE,
                StoreConfig {
                    raft: true,
                    replication: Some(rep.clone()),
                    ..StoreConfig::default()
                },
            )
            .expect("open");
            store.open_shard(SHARD, Epoch(1)).expect("open shard");
            let store = Arc::new(store);
            store.supervise().expect("the supervisor");
            store
        });
        let mut node = Node {
            id,
            store: None,
            peers,
            links,
            stop,
            addr: addrs[&id].clone(),
            opener,
            cell,
            path: opened,
            draining,
            beat_now,
            lost,
        };
        if !closed.contains(&id) {
            node.open().await;
        }
        nodes.push(node);
    }
    // Every replica of a new cluster starts careful (it cannot tell a new
    // cluster from a lost disk), and one that did not vote for the first
    // leader takes it only once that leader confirmed with the others: a
    // node stopped before then leaves its group waiting for it (a
    // documented cost, `docs/replication.md`). The tests fault a settled
    // cluster; CI once stopped a follower within that window.
    until_all(&nodes[..3], "caught up", |s| !s.fresh).await;
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
    let st = node.shard();
    st.start(start_of(n)).await?;
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

/// The start of execution `n`, at epoch 1, with no keys.
fn start_of(n: i64) -> StartRequest {
    StartRequest {
        epoch: Epoch(1),
        id: id(n),
        workflow: "wf".into(),
        started_payload: b"{}".to_vec(),
        routing_key: None,
        idempotency_key: None,
    }
}

/// Waits until `node` (node `i`) has applied up to `index`, at most 10 s.
async fn applied(node: &Node, i: usize, index: u64) {
    let until = Instant::now() + Duration::from_secs(10);
    while node.status().and_then(|s| s.applied).unwrap_or(0) < index {
        assert!(
            Instant::now() < until,
            "node {i} did not apply up to {index}: {:?}",
            node.status()
        );
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
}

/// Waits until node `i` has applied up to `index`, then checks it holds
/// executions `ns` with both their events.
async fn holds(nodes: &[Node], i: usize, ns: std::ops::RangeInclusive<i64>, index: u64) {
    applied(&nodes[i], i, index).await;
    let st = nodes[i].shard();
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
        Err(StoreError::NotLeader { leader, .. }) => {
            assert_eq!(leader, Some(nodes[l].id), "the leader named")
        }
        other => panic!("a follower's write: {other:?}"),
    }

    // The leader goes: its shard and its listener.
    after_the_leader_goes(&mut nodes, l, 21..=30).await;
}

/// A leader sends a follower its next AppendEntries before the answer to
/// the last (`PeerClient::stream_append` in the store), and the follower
/// takes them in order as they come. Each follower's appends take 30 ms,
/// as on a slow disk, while writes come every 2 ms: with one call in
/// flight at a time, as openraft's default client sends them, no follower
/// would count a call taken behind another.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_leader_keeps_several_appends_in_flight_to_a_follower() {
    let dir = tempfile::tempdir().expect("tempdir");
    let nodes = cluster(dir.path()).await;
    let l = leader(&nodes).await;
    for i in (0..3).filter(|i| *i != l) {
        forkless_store::failpoints::slow_appends(&nodes[i].path, SHARD, Duration::from_millis(30));
    }
    let writes = (1..=200).map(|n| {
        let node = &nodes[l];
        async move {
            tokio::time::sleep(Duration::from_millis(2 * n as u64)).await;
            write(node, n).await
        }
    });
    for r in futures_util::future::join_all(writes).await {
        r.expect("a write on the leader");
    }
    let index = nodes[l]
        .status()
        .and_then(|s| s.last_log_index)
        .expect("log");
    let mut behind = 0;
    for i in (0..3).filter(|i| *i != l) {
        holds(&nodes, i, 1..=200, index).await;
        let s = nodes[i].status().expect("status");
        assert!(s.appends_taken > 0, "node {i} took no AppendEntries: {s:?}");
        behind += s.appends_taken_behind_others;
    }
    assert!(
        behind > 0,
        "no follower took an AppendEntries while an earlier one was unanswered"
    );
}

/// A follower's group panics while its leader has several appends in
/// flight to it (its appends slowed to 20 ms, a write every 2 ms): the
/// follower's transport answers the calls its old group took with an
/// error, hands the next ones to the restarted group, and the follower
/// ends up holding every write. The leader and the other follower
/// acknowledge every write meanwhile.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_follower_whose_group_restarts_under_pipelined_appends_catches_up() {
    let dir = tempfile::tempdir().expect("tempdir");
    let nodes = cluster(dir.path()).await;
    let l = leader(&nodes).await;
    let f = (0..3).find(|i| *i != l).expect("a follower");
    forkless_store::failpoints::slow_appends(&nodes[f].path, SHARD, Duration::from_millis(20));
    let follower_path = nodes[f].path.clone();
    let writes = (1..=200).map(|n| {
        let node = &nodes[l];
        let path = follower_path.clone();
        async move {
            tokio::time::sleep(Duration::from_millis(2 * n as u64)).await;
            if n == 60 {
                forkless_store::failpoints::panic_at_next_append(&path, SHARD);
            }
            write(node, n).await
        }
    });
    for r in futures_util::future::join_all(writes).await {
        r.expect("a write on the leader");
    }
    restarted_once_after_a_panic(&nodes, f).await;
    let index = nodes[l]
        .status()
        .and_then(|s| s.last_log_index)
        .expect("log");
    for i in 0..3 {
        holds(&nodes, i, 1..=200, index).await;
    }
    let s = nodes[f].status().expect("status");
    assert!(
        s.appends_taken > 0,
        "the restarted group took no AppendEntries: {s:?}"
    );
}

/// Waits (at most 20 s) until node `i`'s store has restarted the shard's
/// group, once, after a panic, and the group runs.
async fn restarted_once_after_a_panic(nodes: &[Node], i: usize) {
    let store = nodes[i].store.clone().expect("up");
    let until = Instant::now() + Duration::from_secs(20);
    loop {
        let restarted = store.restarts().get(&SHARD).cloned();
        let up = store
            .shard(SHARD)
            .is_some_and(|st| st.group_stopped().is_none());
        if let Some(r) = restarted.clone().filter(|r| r.last_outcome.is_ok() && up) {
            assert_eq!(r.count, 1, "{r:?}");
            assert!(r.last_reason.contains("panic"), "{r:?}");
            return;
        }
        assert!(
            Instant::now() < until,
            "node {i}'s group was not restarted: {restarted:?}"
        );
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
}

/// Stops leader `l`; the other two elect one that takes writes `ns` (its
/// first may meet the election's end, and is retried for 10 s), and both
/// hold every write from 1 to the last of `ns`.
async fn after_the_leader_goes(nodes: &mut [Node], l: usize, ns: std::ops::RangeInclusive<i64>) {
    nodes[l].stop();
    let l2 = leader(nodes).await;
    assert_ne!(l2, l);
    let until = Instant::now() + Duration::from_secs(10);
    while let Err(e) = write(&nodes[l2], *ns.start()).await {
        assert!(Instant::now() < until, "the new leader takes no write: {e}");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    for n in ns.clone().skip(1) {
        write(&nodes[l2], n)
            .await
            .expect("a write on the new leader");
    }
    let index = nodes[l2]
        .status()
        .and_then(|s| s.last_log_index)
        .expect("log");
    let other = (0..3).find(|i| *i != l && *i != l2).expect("the third");
    holds(nodes, l2, 1..=*ns.end(), index).await;
    holds(nodes, other, 1..=*ns.end(), index).await;
}

/// The leader's group panics (in its log's append, where a bug in
/// openraft's core or in the log would) with a write, whose outcome is
/// then unknown: the store's supervisor restarts the group from the
/// node's data directory, the group has a leader again that takes writes,
/// and every acknowledged write is on all three replicas, the restarted
/// one among them.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_leader_whose_group_panics_is_restarted_and_catches_up() {
    let dir = tempfile::tempdir().expect("tempdir");
    let nodes = cluster(dir.path()).await;
    let l = leader(&nodes).await;
    for n in 1..=20 {
        write(&nodes[l], n).await.expect("a write on the leader");
    }
    forkless_store::failpoints::panic_at_next_append(&nodes[l].path, SHARD);
    write(&nodes[l], 21)
        .await
        .expect_err("the group panicked with this write");
    restarted_once_after_a_panic(&nodes, l).await;
    // Whoever leads now (the restarted replica may win again) takes
    // writes; its first may meet the election's end, and is retried.
    let until = Instant::now() + Duration::from_secs(20);
    let l2 = loop {
        let l2 = leader(&nodes).await;
        match write(&nodes[l2], 22).await {
            Ok(()) => break l2,
            Err(e) => {
                assert!(Instant::now() < until, "no leader takes writes: {e}");
                tokio::time::sleep(Duration::from_millis(20)).await;
            }
        }
    };
    for n in 23..=40 {
        write(&nodes[l2], n).await.expect("a write on the leader");
    }
    let index = nodes[l2]
        .status()
        .and_then(|s| s.last_log_index)
        .expect("log");
    for i in 0..3 {
        holds(&nodes, i, 1..=20, index).await;
        holds(&nodes, i, 22..=40, index).await;
    }
}

/// The leader's read of its state fails (a disk error) as it checks an
/// entry's preconditions at apply, the entry committed on a quorum: the
/// write's outcome is unknown, not "not executed" (the followers apply it,
/// and a client told "not executed" may send it again without a key: a
/// duplicate), and the leader's group stops and is restarted, applying
/// the entry then. Before, the failed read was taken for a precondition
/// that did not hold: the entry was refused on the leader alone, its
/// waiter told "not executed", and the leader's replica lacked what the
/// followers held, for good.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_read_that_fails_as_the_leader_applies_is_no_refusal() {
    let dir = tempfile::tempdir().expect("tempdir");
    let nodes = cluster(dir.path()).await;
    let l = leader(&nodes).await;
    for n in 1..=5 {
        write(&nodes[l], n).await.expect("a write on the leader");
    }
    forkless_store::failpoints::fail_next_apply_read(&nodes[l].path);
    let started = nodes[l].shard().start(start_of(6)).await;
    assert!(
        matches!(started, Err(StoreError::OutcomeUnknown { .. })),
        "a start whose entry committed, answered otherwise than unknown: {started:?}"
    );
    // Every replica holds it: the followers at once, the leader once its
    // group is restarted and applies the entry again.
    let until = Instant::now() + Duration::from_secs(20);
    for (i, node) in nodes.iter().enumerate() {
        loop {
            let there = node
                .store
                .as_ref()
                .and_then(|s| s.shard(SHARD))
                .and_then(|st| st.read_events(id(6), 0, 10).ok().flatten());
            if there.is_some() {
                break;
            }
            assert!(
                Instant::now() < until,
                "node {i} lacks execution 6 after 20 s: {:?}",
                node.status()
            );
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    }
    let r = nodes[l]
        .store
        .as_ref()
        .expect("up")
        .restarts()
        .get(&SHARD)
        .cloned();
    assert!(
        r.as_ref().is_some_and(|r| r.count == 1),
        "the leader's group was not restarted once: {r:?}"
    );
}

/// A follower that was away catches up on entries too many bytes for one
/// call: openraft asks for up to 300 entries a call, and entries of whole
/// group commits (up to 16 MiB each) would make a frame the transport
/// refuses, so the follower would never catch up; the network sends such
/// a call in part.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_follower_catches_up_on_more_bytes_than_one_call_holds() {
    let dir = tempfile::tempdir().expect("tempdir");
    let mut nodes = cluster_with(dir.path(), &[3]).await;
    let l = leader(&nodes).await;
    // Eight entries of 12 MiB: 96 MiB, over the transport's 80 MiB frame.
    let big = vec![b'x'; 12 * 1024 * 1024];
    for n in 1..=8 {
        let st = nodes[l].shard();
        let mut payload = b"\"".to_vec();
        payload.extend_from_slice(&big);
        payload.extend_from_slice(b"\"");
        st.start(StartRequest {
            epoch: Epoch(1),
            id: id(n),
            workflow: "wf".into(),
            started_payload: payload,
            routing_key: None,
            idempotency_key: None,
        })
        .await
        .expect("a big start on the leader");
    }
    let index = nodes[l]
        .status()
        .and_then(|s| s.last_log_index)
        .expect("log");
    nodes[2].open().await;
    let until = Instant::now() + Duration::from_secs(60);
    while nodes[2].status().and_then(|s| s.applied).unwrap_or(0) < index {
        assert!(
            Instant::now() < until,
            "the late follower did not catch up to {index} within 60 s: {:?}",
            nodes[2].status()
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let st = nodes[2].shard();
    for n in 1..=8 {
        let (_, events) = st.read_events(id(n), 0, 1).expect("read").expect("there");
        assert_eq!(events[0].payload.len(), big.len() + 2);
    }
}

/// Waits at most 10 s until `f` holds of every running node's status.
async fn until_all(nodes: &[Node], what: &str, f: impl Fn(&RaftStatus) -> bool) {
    let until = Instant::now() + Duration::from_secs(10);
    loop {
        let statuses: Vec<_> = nodes.iter().filter_map(|n| n.status()).collect();
        if statuses.iter().all(&f) {
            return;
        }
        assert!(
            Instant::now() < until,
            "not {what} within 10 s: {statuses:?}"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

/// An idle group turns its timers off on every replica and stays led
/// (no election while quiet, though its election timeout passes many
/// times); a write wakes it and commits; and when a quiet group's leader
/// goes, the followers notice its node's silence and elect a new one.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_idle_group_goes_quiet_wakes_for_a_write_and_replaces_a_dead_leader() {
    let dir = tempfile::tempdir().expect("tempdir");
    let mut nodes = cluster(dir.path()).await;
    let l = leader(&nodes).await;
    for n in 1..=5 {
        write(&nodes[l], n).await.expect("a write on the leader");
    }
    for n in &nodes {
        n.quiesce();
    }
    until_all(&nodes, "quiet", |s| s.quiet).await;
    let led = nodes[l].status().expect("up");
    // Four election timeouts' max (600 ms) with no heartbeat of the group.
    tokio::time::sleep(Duration::from_millis(2400)).await;
    for n in &nodes {
        let s = n.status().expect("up");
        assert!(s.quiet, "woke while idle: {s:?}");
        assert_eq!((s.leader, s.term), (led.leader, led.term), "{s:?}");
    }

    // A write wakes it, and is replicated.
    write(&nodes[l], 6).await.expect("a write to a quiet group");
    let index = nodes[l]
        .status()
        .and_then(|s| s.last_log_index)
        .expect("log");
    for i in 0..3 {
        holds(&nodes, i, 1..=6, index).await;
    }
    until_all(&nodes, "quiet again", |s| s.quiet).await;

    after_the_leader_goes(&mut nodes, l, 7..=7).await;
}

/// Three nodes, one write held by every replica, and the group quiet on
/// every one (each node's heartbeat running); returns the nodes and the
/// leader's index.
async fn quiet_after_a_write(dir: &std::path::Path) -> (Vec<Node>, usize) {
    let nodes = cluster(dir).await;
    let l = leader(&nodes).await;
    write(&nodes[l], 1).await.expect("a write on the leader");
    let index = nodes[l]
        .status()
        .and_then(|s| s.last_log_index)
        .expect("log");
    for i in 0..3 {
        holds(&nodes, i, 1..=1, index).await;
    }
    for n in &nodes {
        n.quiesce();
    }
    until_all(&nodes, "quiet", |s| s.quiet).await;
    (nodes, l)
}

/// A quiet leader whose calls to one follower fail (a one-way cut: the
/// follower's own calls reach it) keeps its group. The follower, told
/// nothing, wakes once the leader's node is silent to it and stands; its
/// pre-vote reaches the leader. Quiet, the leader had heard no quorum,
/// its lease had lapsed, and it granted the pre-vote and then the vote
/// (the other follower, hearing the leader's node, does not answer), so
/// the cut-off follower won the group from a live leader (a restarted
/// node whose election timer runs out before the leader's node heartbeat
/// comes does the same). The test failed so. Now the quiet leader
/// confirms with the other follower before it answers, and refuses.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_quiet_leader_cut_off_one_way_from_a_follower_keeps_its_group() {
    let dir = tempfile::tempdir().expect("tempdir");
    let (nodes, l) = quiet_after_a_write(dir.path()).await;
    let led = nodes[l].status().expect("up");
    let f = (l + 1) % 3;
    // The leader's calls to the follower fail; the follower's reach it.
    nodes[l].links.move_peer(nodes[f].id, NOWHERE.into());
    // The follower wakes (its leader's node silent to it) within the
    // election timeout's spread, and stands from then on: six election
    // timeouts' max (400 ms by default) after it woke, the leader still
    // leads at its term.
    let until = Instant::now() + Duration::from_secs(10);
    while nodes[f].status().is_some_and(|s| s.quiet) {
        assert!(Instant::now() < until, "the cut-off follower stayed quiet");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let watch = Instant::now() + Duration::from_millis(2400);
    while Instant::now() < watch {
        for i in [l, (l + 2) % 3] {
            let s = nodes[i].status().expect("up");
            assert_eq!(
                (s.leader, s.term),
                (led.leader, led.term),
                "a follower the leader could not reach took the group from it: {:?}",
                nodes.iter().map(|n| n.status()).collect::<Vec<_>>()
            );
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    // Joined again, the follower follows the leader and takes its writes.
    nodes[l].links.move_peer(nodes[f].id, nodes[f].addr.clone());
    write(&nodes[l], 2).await.expect("a write after the heal");
    let index = nodes[l]
        .status()
        .and_then(|s| s.last_log_index)
        .expect("log");
    holds(&nodes, f, 1..=2, index).await;
}

/// A handover of the leadership to a replica that cannot take it (its
/// node is down) leaves the old leader refusing writes (openraft's rule
/// once it hands over) and sending no heartbeats: the group must stay
/// awake, so that its followers elect. It did not (found in review): the
/// leader went quiet again at once, its follower with it, and the shard
/// refused every write for good.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_handover_to_a_dead_replica_does_not_leave_the_group_stuck() {
    let dir = tempfile::tempdir().expect("tempdir");
    let (mut nodes, l) = quiet_after_a_write(dir.path()).await;
    let dead = (l + 1) % 3;
    let dead_id = nodes[dead].id;
    nodes[dead].stop();
    let st = nodes[l].shard();
    st.transfer_leader(dead_id).await.expect("handover asked");
    // Someone leads again (a new term) and takes a write, within 10 s.
    let until = Instant::now() + Duration::from_secs(10);
    let mut n = 2;
    loop {
        let led = (0..3).filter(|i| *i != dead).find(|i| {
            nodes[*i]
                .status()
                .is_some_and(|s| s.state == "leader" && s.leader == Some(s.me))
        });
        if let Some(i) = led {
            if write(&nodes[i], n).await.is_ok() {
                break;
            }
            n += 1;
        }
        assert!(
            Instant::now() < until,
            "no write taken within 10 s of a handover to a dead replica: {:?}",
            nodes.iter().map(|n| n.status()).collect::<Vec<_>>()
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

/// A replica's log holds the bodies of only its share of its node's
/// cache (`RaftLogLimits::cache_bytes`, a node of many groups giving each
/// less): on the leader and on both followers, the rest as places.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn each_replica_holds_its_logs_share_of_the_cache() {
    let dir = tempfile::tempdir().expect("tempdir");
    let log = forkless_store::RaftLogLimits {
        cache_bytes: 8 << 10,
        ..forkless_store::RaftLogLimits::default()
    };
    let nodes = cluster_of(dir.path(), &[], log).await;
    let l = leader(&nodes).await;
    for n in 1..=300 {
        write(&nodes[l], n).await.expect("a write on the leader");
    }
    let last = nodes[l].status().expect("up").last_log_index;
    until_all(&nodes, "applied every write", |s| s.applied >= last).await;
    for node in &nodes {
        let s = node.status().expect("up");
        // 600 entries (a start and an append each): with the default
        // 1 MiB cache the whole log stayed in memory, bodies and map
        // slots, 181 KB on a follower when this test was written; here
        // 8 KiB of bodies and the rest as places (32 bytes each, in a
        // buffer of 1,024), 48 KB.
        assert!(s.log_held_entries >= 600, "node {}: {s:?}", node.id);
        assert!(
            s.log_memory_bytes < 100_000,
            "node {} holds {} bytes of its log: {s:?}",
            node.id,
            s.log_memory_bytes
        );
    }
}

/// A follower that was away while the leader's log forgot the entries it
/// needs catches up by a snapshot of the whole shard (its records,
/// idempotency keys and every event), takes the entries after it, keeps
/// it all across a restart, and can lead on it. The leader's log forgets
/// entries as it goes, so it holds a bounded number of them in memory
/// however long it runs.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_follower_behind_the_leaders_log_catches_up_by_a_snapshot() {
    let dir = tempfile::tempdir().expect("tempdir");
    let log = forkless_store::RaftLogLimits {
        snapshot_every: 40,
        kept: 5,
        ..forkless_store::RaftLogLimits::default()
    };
    let mut nodes = cluster_of(dir.path(), &[3], log).await;
    let l = leader(&nodes).await;
    for n in 1..=100 {
        write(&nodes[l], n).await.expect("a write on the leader");
    }
    // Its log forgets all but the last entries (a bounded log in memory;
    // snapshots are built in the background, so it may take a moment).
    let until = Instant::now() + Duration::from_secs(10);
    let index = loop {
        let status = nodes[l].status().expect("the leader's status");
        let index = status.last_log_index.expect("log");
        if status
            .purged
            .is_some_and(|p| p + 2 * (log.snapshot_every + log.kept) > index)
        {
            break index;
        }
        assert!(
            Instant::now() < until,
            "the leader's log did not forget its old entries: {status:?}"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    };

    nodes[2].open().await;
    holds(&nodes, 2, 1..=100, index).await;
    let log_bytes = |node: &Node| node.store.as_ref().expect("up").log_disk_bytes();
    // What the whole shard took on its disk: it held nothing before.
    let first_install = log_bytes(&nodes[2]);
    let late = nodes[2].status().expect("the late follower's status");
    assert!(
        late.snapshot.is_some_and(|s| s > 1),
        "the late follower caught up without a snapshot: {late:?}"
    );
    for n in 101..=110 {
        write(&nodes[l], n).await.expect("a write on the leader");
    }
    let index = nodes[l]
        .status()
        .and_then(|s| s.last_log_index)
        .expect("log");
    holds(&nodes, 2, 1..=110, index).await;

    // Its state survives a restart: reopened from its own disk.
    nodes[2].stop();
    nodes[2].restart().await;
    holds(&nodes, 2, 1..=110, index).await;

    // Away again while the log moves past it: a second snapshot, which
    // replaces the first.
    let had = nodes[2].status().and_then(|s| s.applied).expect("applied");
    let held = log_bytes(&nodes[2]);
    nodes[2].stop();
    for n in 111..=160 {
        write(&nodes[l], n).await.expect("a write on the leader");
    }
    let index = nodes[l]
        .status()
        .and_then(|s| s.last_log_index)
        .expect("log");
    // (Snapshots are built in the background: wait until the leader's
    // log forgot what the replica had, so that it needs a snapshot.)
    let until = Instant::now() + Duration::from_secs(10);
    while nodes[l].status().and_then(|s| s.purged).unwrap_or(0) <= had {
        assert!(Instant::now() < until, "the leader's log kept entry {had}");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let first = late.snapshot;
    nodes[2].restart().await;
    holds(&nodes, 2, 1..=160, index).await;
    let again = nodes[2].status().expect("status");
    assert!(
        again.snapshot > first,
        "no second snapshot: {again:?} (first {first:?})"
    );
    // It kept the 110 writes it held where they lay: its log grew by the
    // 50 it lacked, less than the 100 of the first install.
    let grown = log_bytes(&nodes[2]) - held;
    assert!(
        grown < first_install,
        "the second install grew the log by {grown} bytes, the first (100 writes) by {first_install}"
    );

    // It leads on it: a retried append (same idempotency key) applies
    // nothing, a new one lands after the snapshot's events.
    // (A handover is asked for again while it has not taken: one asked
    // for just as the group elected goes nowhere.)
    let until = Instant::now() + Duration::from_secs(30);
    loop {
        let l = leader(&nodes).await;
        if l == 2 {
            break;
        }
        let st = nodes[l].shard();
        st.transfer_leader(3).await.expect("asked for the handover");
        let asked = Instant::now();
        while nodes[2].status().is_none_or(|s| s.state != "leader")
            && asked.elapsed() < Duration::from_secs(2)
        {
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        assert!(Instant::now() < until, "node 3 did not take the leadership");
    }
    let st3 = nodes[2].shard();
    let append = |key: &str, payload: &[u8], expected: Option<u64>| AppendRequest {
        epoch: Epoch(1),
        id: id(5),
        events: vec![NewEvent {
            event_type: "step".into(),
            payload: payload.to_vec(),
            idempotency_key: Some(key.into()),
        }],
        expected_last_seq: expected,
    };
    let until = Instant::now() + Duration::from_secs(10);
    while let Err(e) = st3.append(append("k5", b"{\"n\":5}", None)).await {
        assert!(Instant::now() < until, "node 3 takes no write: {e}");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let (meta, _) = st3.read_events(id(5), 0, 10).expect("read").expect("there");
    assert_eq!(
        meta.last_seq, 2,
        "a retried append applied again after the snapshot"
    );
    st3.append(append("k5-new", b"{\"again\":true}", Some(2)))
        .await
        .expect("a new append on node 3");
    let (meta, events) = st3.read_events(id(5), 0, 10).expect("read").expect("there");
    assert_eq!(meta.last_seq, 3);
    assert_eq!(events.len(), 3);
    assert_eq!(events[2].payload, b"{\"again\":true}".to_vec());

    // Every replica's disk holds the same events (the offline check).
    let index = nodes[2]
        .status()
        .and_then(|s| s.last_log_index)
        .expect("log");
    for (i, node) in nodes.iter().enumerate() {
        applied(node, i, index).await;
    }
    drop((st3, append));
    for n in nodes.iter_mut() {
        n.stop();
    }
    tokio::time::sleep(Duration::from_millis(200)).await;
    let counts: Vec<(u64, u64)> = (1..=3)
        .map(|n| {
            let report =
                forkless_store::check::check(&dir.path().join(n.to_string())).expect("check");
            assert!(report.is_healthy(), "node {n}: {report}");
            let s = &report.shards[0];
            (s.events, s.indexed_events)
        })
        .collect();
    assert!(
        counts.iter().all(|c| c.0 == 2 * 160 + 1 && c.1 == c.0),
        "(events, indexed) on each node's disk: {counts:?}"
    );
}

/// Measures a snapshot's transfer and install: the leader holds
/// `FORKLESS_SNAPSHOT_EXECUTIONS` executions (default 1,000) of 100 events
/// each (about 90 bytes of payload), its log forgot all but the last of
/// them, and a replica that was away catches up. Prints events/s from
/// the replica's open to its applying the leader's last entry. Run with
/// `cargo test --release -p forkless-raftnet --test three_replicas
/// snapshot_catch_up -- --ignored --nocapture`.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "a measurement: run by hand, in release"]
async fn snapshot_catch_up() {
    let executions: i64 = std::env::var("FORKLESS_SNAPSHOT_EXECUTIONS")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(1_000);
    let dir = tempfile::tempdir().expect("tempdir");
    let log = forkless_store::RaftLogLimits {
        snapshot_every: 200,
        kept: 10,
        ..forkless_store::RaftLogLimits::default()
    };
    let mut nodes = cluster_of(dir.path(), &[3], log).await;
    let l = leader(&nodes).await;
    let st = nodes[l].shard();
    let written = Instant::now();
    for n in 1..=executions {
        st.start(start_of(n)).await.expect("start");
        st.append(AppendRequest {
            epoch: Epoch(1),
            id: id(n),
            events: (0..99)
                .map(|i| NewEvent {
                    event_type: "step".into(),
                    payload: format!("{{\"n\":{n},\"i\":{i},\"pad\":\"0123456789012345678901234567890123456789012345678901234567\"}}").into_bytes(),
                    idempotency_key: Some(format!("{n}-{i}")),
                })
                .collect(),
            expected_last_seq: Some(1),
        })
        .await
        .expect("append");
    }
    let events = executions as u64 * 100;
    eprintln!(
        "wrote {events} events in {:?} ({:.0} events/s)",
        written.elapsed(),
        events as f64 / written.elapsed().as_secs_f64()
    );
    let index = nodes[l]
        .status()
        .and_then(|s| s.last_log_index)
        .expect("log");
    let began = Instant::now();
    nodes[2].open().await;
    let until = Instant::now() + Duration::from_secs(600);
    while nodes[2].status().and_then(|s| s.applied).unwrap_or(0) < index {
        assert!(Instant::now() < until, "no catch-up within 600 s");
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    let took = began.elapsed();
    let late = nodes[2].status().expect("status");
    assert!(late.snapshot.is_some(), "{late:?}");
    eprintln!(
        "a replica away for {events} events caught up in {took:?}: {:.0} events/s (open included)",
        events as f64 / took.as_secs_f64()
    );
    holds_events(&nodes, 2, executions).await;
}

/// Node `i` holds every execution 1..=n with its 100 events.
async fn holds_events(nodes: &[Node], i: usize, n: i64) {
    let st = nodes[i].shard();
    for e in [1, n / 2, n] {
        let (meta, events) = st.read_events(id(e), 0, 200).expect("read").expect("there");
        assert_eq!(meta.last_seq, 100, "execution {e}");
        assert_eq!(events.len(), 100);
    }
}

/// A follower loses its disk again and again while the leader takes
/// writes and forgets its log every few entries: each time it comes back
/// empty under its id, is let start again, catches up by a snapshot, and
/// no core panics (openraft's debug checks are on in this build). The
/// window this exercises: the leader resets the follower's progress while
/// a replication stream of the old one still reads the log the reset let
/// it purge.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_follower_that_loses_its_disk_again_and_again_under_load_rejoins_each_time() {
    if std::env::var_os("RUST_LOG").is_some() {
        let _ = tracing_subscriber::fmt()
            .with_env_filter(tracing_subscriber::EnvFilter::from_default_env())
            .with_writer(std::io::stderr)
            .try_init();
    }
    let panics: Arc<std::sync::Mutex<Vec<String>>> = Arc::default();
    {
        let panics = panics.clone();
        let default = std::panic::take_hook();
        std::panic::set_hook(Box::new(move |info| {
            // The hook is the process's: another test's injected panic
            // (`failpoints`) is not this test's.
            let what = info.to_string();
            if !what.contains("a panic a test injected") {
                panics.lock().expect("panics").push(what);
            }
            default(info);
        }));
    }
    let dir = tempfile::tempdir().expect("tempdir");
    let log = forkless_store::RaftLogLimits {
        snapshot_every: 10,
        kept: 0,
        ..forkless_store::RaftLogLimits::default()
    };
    let mut nodes = cluster_of(dir.path(), &[], log).await;
    let l = leader(&nodes).await;
    let leader_store = nodes[l].store.clone().expect("up");
    let stop = Arc::new(std::sync::atomic::AtomicBool::new(false));
    let acked: Arc<std::sync::Mutex<Vec<i64>>> = Arc::default();
    let writers: Vec<_> = (0..4i64)
        .map(|w| {
            let (store, stop, acked) = (leader_store.clone(), stop.clone(), acked.clone());
            tokio::spawn(async move {
                let st = store.shard(SHARD).expect("shard");
                let mut n = w * 1_000_000;
                while !stop.load(std::sync::atomic::Ordering::Relaxed) {
                    n += 1;
                    let started = st.start(start_of(n)).await;
                    if started.is_ok() {
                        acked.lock().expect("acked").push(n);
                    } else {
                        tokio::time::sleep(Duration::from_millis(5)).await;
                    }
                }
            })
        })
        .collect();
    let followers: Vec<usize> = (0..3).filter(|i| *i != l).collect();
    for round in 0..12 {
        let f = followers[round % 2];
        eprintln!("round {round}: node {} loses its disk", nodes[f].id);
        nodes[f].stop();
        // Away long enough for the leader to forget what it had.
        let before = acked.lock().expect("acked").len();
        let until = Instant::now() + Duration::from_secs(20);
        while acked.lock().expect("acked").len() < before + 30 {
            assert!(
                Instant::now() < until,
                "round {round}: no writes while a follower was away: {:?}",
                nodes.iter().map(Node::status).collect::<Vec<_>>()
            );
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
        std::fs::remove_dir_all(dir.path().join(nodes[f].id.to_string())).expect("wiped");
        eprintln!("round {round}: wiped; restarting");
        nodes[f].restart().await;
        eprintln!("round {round}: restarted");
        let until = Instant::now() + Duration::from_secs(30);
        loop {
            let s = nodes[f].status();
            if s.as_ref().is_some_and(|s| !s.fresh && s.applied.is_some()) {
                break;
            }
            assert!(
                panics.lock().expect("panics").is_empty(),
                "round {round}: a panic: {:?}",
                panics.lock().expect("panics")
            );
            assert!(
                Instant::now() < until,
                "round {round}: node {} did not catch up: {s:?}; leader {:?}",
                nodes[f].id,
                nodes[l].status()
            );
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
    }
    stop.store(true, std::sync::atomic::Ordering::Relaxed);
    for w in writers {
        w.await.expect("writer");
    }
    assert!(
        panics.lock().expect("panics").is_empty(),
        "panics: {:?}",
        panics.lock().expect("panics")
    );
    // Every acknowledged start is on every replica.
    let index = nodes[l]
        .status()
        .and_then(|s| s.last_log_index)
        .expect("log");
    let acked = acked.lock().expect("acked").clone();
    for (i, node) in nodes.iter().enumerate() {
        applied(node, i, index).await;
        let st = node.shard();
        for n in &acked {
            assert!(
                st.read_events(id(*n), 0, 1).expect("read").is_some(),
                "node {i} lacks acknowledged execution {n}"
            );
        }
    }
}

/// What node `to` answers a heartbeat from node `from` that names the
/// shard among those `from` leads: the shards it says it cannot lead.
async fn cannot_lead(nodes: &[Node], from: usize, to: usize) -> Vec<u32> {
    let beat = forkless_store::Beat {
        led: vec![(SHARD.get(), 1)],
        ..Default::default()
    };
    match nodes[from]
        .peers
        .call(nodes[to].id, 0, Rpc::Beat(beat), Duration::from_secs(2))
        .await
    {
        Ok(forkless_store::RpcReply::Beat { cannot_lead, .. }) => cannot_lead,
        other => panic!("a heartbeat answered {other:?}"),
    }
}

/// This process's CPU time so far (user plus system), from
/// `/proc/self/stat`, in clock ticks.
fn cpu_ticks() -> u64 {
    let stat = std::fs::read_to_string("/proc/self/stat").unwrap_or_default();
    // The fields after the command's closing parenthesis, from the state
    // on: utime and stime are the 14th and 15th of the line, the 12th and
    // 13th after it.
    let rest = stat.rsplit_once(')').map_or("", |(_, r)| r);
    let f: Vec<&str> = rest.split_whitespace().collect();
    let field = |i: usize| f.get(i).and_then(|x| x.parse::<u64>().ok()).unwrap_or(0);
    field(11) + field(12)
}

/// How a linearizable read's confirmation costs by read index (a round of
/// heartbeats answered by a quorum) against the leader's lease (no round
/// trip): `readers` tasks on the leader, each confirming and then reading
/// an execution, for `FORKLESS_READ_SECONDS` (3) per point; 1 and 16
/// readers, both ways, alternated over three rounds; reads/s, p50 and p99
/// of one read, and the process's CPU per read (the three replicas are
/// this process). Run with `cargo test --release -p forkless-raftnet
/// --test three_replicas read_confirm -- --ignored --nocapture`.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "a measurement: run by hand, in release"]
async fn read_confirm_by_read_index_and_by_lease() {
    use forkless_store::ReadConfirm;
    let secs: u64 = std::env::var("FORKLESS_READ_SECONDS")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(3);
    let dir = tempfile::tempdir().expect("tempdir");
    let nodes = cluster(dir.path()).await;
    let l = leader(&nodes).await;
    write(&nodes[l], 1).await.expect("a write on the leader");
    let st = nodes[l].shard();
    let ticks_per_s = 100.0; // USER_HZ on Linux
    for round in 0..3 {
        let mut ways = [ReadConfirm::ReadIndex, ReadConfirm::Lease];
        if round % 2 == 1 {
            ways.reverse();
        }
        for readers in [1usize, 16] {
            for how in ways {
                let until = Instant::now() + Duration::from_secs(secs);
                let cpu = cpu_ticks();
                let tasks: Vec<_> = (0..readers)
                    .map(|_| {
                        let st = st.clone();
                        tokio::spawn(async move {
                            let mut took = Vec::new();
                            while Instant::now() < until {
                                let t = Instant::now();
                                st.linearize_by(how).await.expect("confirmed");
                                st.execution(id(1)).expect("read").expect("there");
                                took.push(t.elapsed().as_micros() as u64);
                            }
                            took
                        })
                    })
                    .collect();
                let mut took = Vec::new();
                for t in tasks {
                    took.extend(t.await.expect("reader"));
                }
                let cpu_s = (cpu_ticks() - cpu) as f64 / ticks_per_s;
                took.sort_unstable();
                let at = |q: f64| took[((took.len() - 1) as f64 * q) as usize];
                eprintln!(
                    "round {round} readers {readers:>2} {how:?}: {:>8.0} reads/s, p50 {} us, p99 {} us, CPU {:.1} us per read",
                    took.len() as f64 / secs as f64,
                    at(0.5),
                    at(0.99),
                    cpu_s * 1e6 / took.len() as f64
                );
            }
        }
    }
}

/// [`write`], tried again while the node is not ready to take it (a
/// leader elected a moment ago applies its term's first entry first), for
/// at most 10 s.
async fn write_soon(node: &Node, n: i64, what: &str) {
    let until = Instant::now() + Duration::from_secs(10);
    loop {
        match write(node, n).await {
            Ok(()) => return,
            Err(StoreError::NotLeader { leader: None, .. }) if Instant::now() < until => {
                eprintln!("{what}: not yet (no leader known)");
                tokio::time::sleep(Duration::from_millis(50)).await;
            }
            Err(StoreError::NotExecuted { reason, .. }) if Instant::now() < until => {
                eprintln!("{what}: not yet ({reason})");
                tokio::time::sleep(Duration::from_millis(50)).await;
            }
            Err(e) => panic!("{what}: {e:?}"),
        }
    }
}

/// A move's bounds: `catch_up_within`, its target's node answering all
/// along (so that is the only bound that ends it).
fn bounds(catch_up_within: Duration) -> forkless_store::MoveBounds<'static> {
    forkless_store::MoveBounds {
        catch_up_within,
        unreachable_within: catch_up_within,
        last_answered: &answers,
    }
}

/// A node that answers all along: it answered just now.
fn answers() -> Option<std::time::Instant> {
    Some(std::time::Instant::now())
}

/// Where a cut link points: nothing listens there.
const NOWHERE: &str = "127.0.0.1:1";

/// Cuts nodes `a` and `b` (indexes) from each other: the calls each makes
/// to the other fail as unreachable (the answers to a call come back on
/// its caller's connection, so this cuts both ways).
fn cut(nodes: &[Node], a: usize, b: usize) {
    nodes[a].links.move_peer(nodes[b].id, NOWHERE.into());
    nodes[b].links.move_peer(nodes[a].id, NOWHERE.into());
}

/// Joins nodes `a` and `b` again.
fn heal(nodes: &[Node], a: usize, b: usize) {
    nodes[a].links.move_peer(nodes[b].id, nodes[b].addr.clone());
    nodes[b].links.move_peer(nodes[a].id, nodes[a].addr.clone());
}

/// Cuts the leader off from the other two and waits (20 s at most) until
/// one of them leads at a later term: the old leader's index and term,
/// and the new leader's index. The old one still takes itself for the
/// leader until it hears otherwise.
async fn depose(nodes: &[Node]) -> (usize, u64, usize) {
    let old = leader(nodes).await;
    let old_term = nodes[old].status().expect("up").term;
    let others: Vec<usize> = (0..3).filter(|i| *i != old).collect();
    cut(nodes, old, others[0]);
    cut(nodes, old, others[1]);
    let until = Instant::now() + Duration::from_secs(20);
    loop {
        let led = others.iter().copied().find(|i| {
            nodes[*i]
                .status()
                .is_some_and(|s| s.state == "leader" && s.term > old_term)
        });
        if let Some(new) = led {
            return (old, old_term, new);
        }
        assert!(Instant::now() < until, "no new leader within 20 s");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

/// A leader deposed without knowing it (cut off from the other two, who
/// elected one of them) answers no refusal from its own state: appends
/// to an execution the new leader started are not "not found" there (a
/// definitive answer, which a client may act on), but not executed (or
/// unknown), for the leader to answer; whether they come in a group that
/// writes nothing (confirmed first by a quorum, which the deposed leader
/// cannot get) or ride in one with starts (whose entry never commits).
/// Before, both were answered from the replica's state alone until it
/// took itself for cut off (1.5 s with no quorum): the test failed so,
/// `NotFound`.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_deposed_leader_answers_no_refusal_from_its_own_state() {
    let dir = tempfile::tempdir().expect("tempdir");
    let nodes = cluster(dir.path()).await;
    write_soon(&nodes[leader(&nodes).await], 1, "a write before the cut").await;
    let (old, old_term, new) = depose(&nodes).await;
    let started = Instant::now();
    let until = started + Duration::from_secs(5);
    let start =
        |st: Arc<forkless_store::ShardStore>, n: i64| async move { st.start(start_of(n)).await };
    loop {
        match start(nodes[new].shard(), 2).await {
            // (A try answered otherwise may have landed.)
            Ok(_) | Err(StoreError::ExecutionExists(_)) => break,
            Err(e) => assert!(Instant::now() < until, "the new leader takes no start: {e}"),
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    let leading = nodes[old].leads_at(old_term);
    // Through the deposed leader, at once: starts (which write) and
    // appends to execution 2 (which it does not hold), some in the same
    // groups.
    let st = nodes[old].shard();
    let mut appends = Vec::new();
    for k in 0..8 {
        tokio::spawn(start(st.clone(), 10 + k));
        let st = st.clone();
        appends.push(tokio::spawn(async move {
            st.append(AppendRequest {
                epoch: Epoch(1),
                id: id(2),
                events: vec![NewEvent {
                    event_type: "step".into(),
                    payload: b"{}".to_vec(),
                    idempotency_key: None,
                }],
                expected_last_seq: Some(1),
            })
            .await
        }));
    }
    for a in appends {
        let answer = a.await.expect("an append's task");
        assert!(
            matches!(
                answer,
                Err(StoreError::NotLeader { .. }
                    | StoreError::NotExecuted { .. }
                    | StoreError::OutcomeUnknown { .. })
            ),
            "the deposed leader (term {old_term}, taking itself for the leader when asked: {leading}, \
             {} ms after the new leader was seen) answered from its own state: {answer:?}",
            started.elapsed().as_millis()
        );
    }
}

/// A replica that lost its disk forgot the highest term it saw. Here it
/// comes back reaching only a leader the other two deposed (cut off from
/// them): before a new replica took a leader's word, that leader did not
/// confirm with a quorum that it still led, so the new replica took the
/// deposed one at its old term, acknowledged its entries, and the two of
/// them, a quorum of three, committed entries at indices the newer leader
/// had committed others at with the replica's forgotten acknowledgements:
/// a fork from one lost disk and a partition. The test failed so (the
/// deposed leader acknowledged a write). Now the deposed leader cannot
/// confirm (the only other replica it could count is cut off), the new
/// replica takes nothing from it, and nothing is acknowledged through it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_new_replica_does_not_help_a_deposed_leader_commit() {
    let dir = tempfile::tempdir().expect("tempdir");
    let mut nodes = cluster(dir.path()).await;
    for n in 1..=5 {
        write_soon(
            &nodes[leader(&nodes).await],
            n,
            "a write before the partition",
        )
        .await;
    }
    // The leader is cut off; the other two elect one of them.
    let (old, old_term, new) = depose(&nodes).await;
    let others: Vec<usize> = (0..3).filter(|i| *i != old).collect();
    let lost = others
        .iter()
        .copied()
        .find(|i| *i != new)
        .expect("the third");
    for n in 6..=10 {
        write_soon(&nodes[new], n, "a write on the new leader").await;
    }
    // The third loses its disk, and comes back reaching only the deposed
    // leader.
    nodes[lost].stop();
    std::fs::remove_dir_all(&nodes[lost].path).expect("wiped");
    cut(&nodes, new, lost);
    heal(&nodes, old, lost);
    nodes[lost].restart().await;
    assert!(
        nodes[old].leads_at(old_term),
        "the deposed leader still takes itself for the leader: {:?}",
        nodes[old].status()
    );
    let until = Instant::now() + Duration::from_secs(6);
    let mut n = 100;
    while Instant::now() < until {
        n += 1;
        if write(&nodes[old], n).await.is_ok() {
            panic!(
                "the deposed leader (term {old_term}) acknowledged execution {n} with the new replica: {:?}, new leader {:?}",
                nodes[lost].status(),
                nodes[new].status()
            );
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    assert!(
        nodes[lost].status().is_some_and(|s| s.fresh),
        "the new replica took the deposed leader's word: {:?}",
        nodes[lost].status()
    );
    // Its node says so in answer to a heartbeat naming the shard among
    // those the sender leads: a leader's balancer hands it nothing.
    assert_eq!(
        cannot_lead(&nodes, old, lost).await,
        vec![SHARD.get()],
        "the new replica's node did not say it cannot lead"
    );
    // Joined again: the new replica catches up from the newer leader, and
    // every acknowledged write is on every replica.
    heal(&nodes, old, new);
    heal(&nodes, new, lost);
    let until = Instant::now() + Duration::from_secs(30);
    while nodes[lost].status().is_none_or(|s| s.fresh) {
        assert!(
            Instant::now() < until,
            "the new replica did not catch up: {:?}; leader {:?}",
            nodes[lost].status(),
            nodes[new].status()
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    assert_eq!(
        cannot_lead(&nodes, new, lost).await,
        Vec::<u32>::new(),
        "caught up, the replica's node still says it cannot lead"
    );
    let l = leader(&nodes).await;
    write_soon(&nodes[l], 200, "a write after the heal").await;
    let index = nodes[l]
        .status()
        .and_then(|s| s.last_log_index)
        .expect("log");
    for i in 0..3 {
        holds(&nodes, i, 1..=10, index).await;
        holds(&nodes, i, 200..=200, index).await;
    }
}

/// A leader cut off from the other two, which elected one of them, still
/// takes itself for the leader until it hears otherwise; its voter list
/// may be older than the group's. A replacement asked of it must not be
/// answered from that list ("nothing to move" for a node it does not
/// count): it is answered only by a leader a quorum confirmed. Before, a
/// node absent from the deposed leader's voters got `changed: false`
/// from it at once, and `forkless cluster remove-node` could take a shard
/// for done on a deposed leader's word.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_deposed_leader_does_not_answer_a_replacement() {
    let dir = tempfile::tempdir().expect("tempdir");
    let nodes = cluster(dir.path()).await;
    write_soon(&nodes[leader(&nodes).await], 1, "a write before the cut").await;
    let (old, old_term, _) = depose(&nodes).await;
    let st = nodes[old].shard();
    assert!(
        nodes[old].leads_at(old_term),
        "the deposed leader no longer takes itself for the leader: {:?}",
        nodes[old].status()
    );
    // Node 4 is in no voter list this leader knows of.
    let answer = st
        .replace_replica(4, 5, NOWHERE.into(), bounds(Duration::from_secs(1)))
        .await;
    match answer {
        Err(StoreError::NotLeader { .. }) | Err(StoreError::NotExecuted { .. }) => {}
        other => panic!(
            "a deposed leader (term {old_term}) answered a replacement from its own voter list: {other:?}"
        ),
    }
}

/// A move whose target never caught up leaves it a learner (asking again
/// goes on from there); a move of the shard to another node removes that
/// learner first. Before, it stayed for good: its leader replicated to it
/// forever, and its group, never all caught up, never went quiet. A move
/// still waiting for its learner's catch-up neither holds up another
/// move of the shard nor outlives the removal of its learner.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_move_to_another_node_removes_the_learner_a_move_cut_short_left() {
    let dir = tempfile::tempdir().expect("tempdir");
    let nodes = cluster(dir.path()).await;
    let l = leader(&nodes).await;
    write_soon(&nodes[l], 1, "a write before the moves").await;
    let from = nodes[(l + 1) % 3].id;
    let st = nodes[l].shard();
    let learners = || nodes[l].status().expect("status").learners;
    // A move to `to` (nothing listens there) for at most `within`: it
    // ends unfinished.
    let cut_short = |to: u64, within: Duration| {
        let st = st.clone();
        async move {
            let answer = st
                .replace_replica(from, to, NOWHERE.into(), bounds(within))
                .await;
            assert!(
                matches!(answer, Err(StoreError::MoveCatchUpTimeout { node, .. }) if node == to),
                "a move to node {to}, which never catches up: {answer:?}"
            );
        }
    };
    cut_short(4, Duration::from_secs(1)).await;
    assert_eq!(learners(), vec![4], "the move cut short leaves its learner");
    // Asked again to the same node: it goes on (the learner stays).
    cut_short(4, Duration::from_secs(1)).await;
    assert_eq!(learners(), vec![4]);
    // To another node: node 4 goes first.
    cut_short(5, Duration::from_secs(1)).await;
    assert_eq!(
        learners(),
        vec![5],
        "a move to node 5 kept the learner a move to node 4 left"
    );
    // A move still waiting for its learner (to node 5 again, for up to a
    // minute) ends once a move to another node removed it; that move
    // does not wait for it.
    let waiting = {
        let st = st.clone();
        tokio::spawn(async move {
            st.replace_replica(from, 5, NOWHERE.into(), bounds(Duration::from_secs(60)))
                .await
        })
    };
    // (It is waiting once it has asked for its learner again, which is
    // one already: nothing shows it but time.)
    tokio::time::sleep(Duration::from_millis(500)).await;
    let started = Instant::now();
    cut_short(4, Duration::from_secs(1)).await;
    assert!(
        started.elapsed() < Duration::from_secs(5),
        "a move waited {:?} for another move's catch-up",
        started.elapsed()
    );
    let ended = tokio::time::timeout(Duration::from_secs(5), waiting)
        .await
        .expect("the move to node 5 did not end once its learner was removed")
        .expect("the move's task");
    match ended {
        Err(StoreError::NotExecuted { reason, .. }) => {
            assert!(reason.contains("no longer a learner"), "{reason}")
        }
        other => panic!("the move whose learner was removed answered {other:?}"),
    }
    assert_eq!(learners(), vec![4]);
}

/// A move's change of voters is two entries, openraft's joint
/// configuration (the old voters and the new, both quorums needed) and
/// then the new voters alone. Here the leader's transport loses the
/// second entry (every AppendEntries that carries it), so the change is
/// left joint, and the leader then stops: the group its replicas elect
/// among themselves is in the joint configuration, where every write
/// needs a quorum of the old voters too, the stopped node among them.
/// The new leader's balancer finishes the change (to the voters the move
/// was going to) once it has led the group joint for
/// `JOINT_FINISHED_AFTER`; before, the group stayed joint until an
/// operator asked the move again.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_change_of_voters_its_leader_left_joint_is_finished_by_the_next_leader() {
    let dir = tempfile::tempdir().expect("tempdir");
    let mut nodes =
        cluster_and_spares(dir.path(), &[], forkless_store::RaftLogLimits::default(), 1).await;
    for n in &nodes {
        n.balance(Duration::from_secs(120));
    }
    let l = leader(&nodes).await;
    write_soon(&nodes[l], 1, "a write before the move").await;
    let (f, g) = match l {
        0 => (1, 2),
        1 => (0, 2),
        _ => (0, 1),
    };
    let (lid, gid) = (nodes[l].id, nodes[g].id);
    let target = nodes[3].id;
    let new_voters = vec![lid.min(gid), lid.max(gid), target];
    // The leader's transport loses the new voters' configuration.
    let into_new = move |rpc: &Rpc| match rpc {
        Rpc::AppendEntries(req) => req.entries.iter().any(|e| {
            matches!(&e.payload, openraft::EntryPayload::Membership(m)
                if m.get_joint_config().len() == 1 && m.voter_ids().any(|v| v == target))
        }),
        _ => false,
    };
    *nodes[l].lost.write().expect("lost") = Some(Arc::new(into_new));
    let moving = {
        let (st, from, addr) = (nodes[l].shard(), nodes[f].id, nodes[3].addr.clone());
        tokio::spawn(async move {
            st.replace_replica(from, target, addr, bounds(Duration::from_secs(30)))
                .await
        })
    };
    // The joint configuration committed: the leader appended the next
    // (it does once the joint one commits), and node `g` holds the joint
    // one. (So does any replica that can win the next election: the joint
    // one is committed, on a quorum of the old voters and of the new.
    // Node `f` or node 4 may not: the leader sends them the joint entry
    // and the next one together if it had not sent it before the next
    // was appended, and loses both.)
    let until = Instant::now() + Duration::from_secs(20);
    loop {
        let leader_went_on = nodes[l]
            .status()
            .is_some_and(|s| !s.joint && s.voters == new_voters && !s.membership_committed);
        let g_joint = nodes[g].status().is_some_and(|s| s.joint);
        if leader_went_on && g_joint {
            break;
        }
        assert!(
            Instant::now() < until,
            "the move's joint configuration was not committed within 20 s: leader {:?}, others {:?}",
            nodes[l].status(),
            [f, g, 3].map(|i| nodes[i].status())
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    moving.abort();
    let _ = moving.await;
    nodes[l].stop();
    // The next leader leads joint, then finishes the change.
    let (mut led_joint, until) = (false, Instant::now() + Duration::from_secs(30));
    loop {
        let statuses: Vec<RaftStatus> = [g, 3].iter().filter_map(|i| nodes[*i].status()).collect();
        let leading = [f, g, 3]
            .iter()
            .filter_map(|i| nodes[*i].status())
            .find(|s| s.state == "leader");
        led_joint |= leading.as_ref().is_some_and(|s| s.joint);
        if statuses.len() == 2
            && statuses
                .iter()
                .all(|s| !s.joint && s.voters == new_voters && s.membership_committed)
        {
            break;
        }
        assert!(
            Instant::now() < until,
            "the change was not finished within 30 s: {statuses:?} (led joint: {led_joint})"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    assert!(
        led_joint,
        "the test meant to see the group led in its joint configuration"
    );
    // The group takes writes with the stopped node one of its three
    // voters, and both live voters hold them.
    // (A leader the change took out hands its leadership on; a write
    // that meets a handover is tried again on the next leader.)
    let until = Instant::now() + Duration::from_secs(20);
    let l2 = loop {
        let leading = [g, 3]
            .into_iter()
            .find(|i| nodes[*i].status().is_some_and(|s| s.state == "leader"));
        if let Some(i) = leading {
            match write(&nodes[i], 2).await {
                Ok(()) => break i,
                Err(StoreError::NotLeader { .. } | StoreError::NotExecuted { .. }) => {}
                Err(e) => panic!("a write after the change: {e:?}"),
            }
        }
        assert!(
            Instant::now() < until,
            "no leader among the new voters took a write within 20 s"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    };
    let index = nodes[l2]
        .status()
        .and_then(|s| s.last_log_index)
        .expect("log");
    holds(&nodes, g, 1..=2, index).await;
    holds(&nodes, 3, 1..=2, index).await;
    nodes.iter_mut().for_each(Node::stop);
}

/// A learner a move cut short left behind (here the call that asked for
/// the move ended while its learner, on a node that is down, could not
/// catch up) is removed by the shard's leader once it has been so for
/// `learners_kept`, and not while a move is catching it up, however long
/// that takes. Before, it stayed until the next move of the shard: the
/// leader replicated to it for good, and its group, never all caught up,
/// never went quiet.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_learner_a_move_cut_short_left_is_removed_by_the_leader() {
    const KEPT: Duration = Duration::from_secs(1);
    let dir = tempfile::tempdir().expect("tempdir");
    let mut nodes =
        cluster_and_spares(dir.path(), &[], forkless_store::RaftLogLimits::default(), 1).await;
    for n in &nodes[..3] {
        n.balance(KEPT);
        n.quiesce();
    }
    let l = leader(&nodes).await;
    write_soon(&nodes[l], 1, "a write before the move").await;
    let f = (l + 1) % 3;
    // A move to a voter is refused, naming it.
    let g = (l + 2) % 3;
    let refused = nodes[l]
        .shard()
        .replace_replica(
            nodes[f].id,
            nodes[g].id,
            nodes[g].addr.clone(),
            bounds(Duration::from_secs(60)),
        )
        .await;
    assert!(
        matches!(refused, Err(StoreError::MoveTargetIsVoter { node, .. }) if node == nodes[g].id),
        "{refused:?}"
    );
    // The move's target is down: its learner takes nothing.
    let (target, moving) = move_to_a_stopped_spare(&mut nodes, l, f).await;
    // While the move waits for it, the learner stays: twice the time a
    // learner left behind is kept, and the balancer's tick.
    let watched = Instant::now() + KEPT * 2 + forkless_raftnet::balance::BALANCE_EVERY;
    while Instant::now() < watched {
        let s = nodes[l].status().expect("up");
        assert_eq!(
            s.learners,
            [target],
            "a move's own learner was removed: {s:?}"
        );
        assert!(!moving.is_finished(), "the move ended: {:?}", moving.await);
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    // The call that asked for the move ends (an operator's interrupted
    // `forkless cluster remove-node`, say): the learner is left behind,
    // and removed.
    moving.abort();
    let _ = moving.await;
    let until = Instant::now() + Duration::from_secs(15);
    loop {
        let s = nodes[l].status().expect("up");
        if s.learners.is_empty() && s.membership_committed {
            break;
        }
        assert!(
            Instant::now() < until,
            "the learner left behind was not removed within 15 s: {s:?}"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    // The voters are as before, every replica drops the learner, and the
    // group, all caught up, goes quiet.
    until_all(&nodes[..3], "without the learner, and quiet", |s| {
        s.learners.is_empty() && s.voters == [1, 2, 3] && s.quiet
    })
    .await;
    write_soon(&nodes[l], 2, "a write after the learner's removal").await;
    nodes.iter_mut().for_each(Node::stop);
}

/// Stops the spare node (index 3) and moves node `f`'s replica to it on
/// leader `l`, in a task of its own (a catch-up bound of 60 s), once the
/// spare is the group's learner: its id and the move's task. The learner
/// takes nothing: its node is down.
async fn move_to_a_stopped_spare(
    nodes: &mut [Node],
    l: usize,
    f: usize,
) -> (
    u64,
    tokio::task::JoinHandle<Result<forkless_store::Replaced, StoreError>>,
) {
    let target = nodes[3].id;
    nodes[3].stop();
    let moving = {
        let (st, from, addr) = (nodes[l].shard(), nodes[f].id, nodes[3].addr.clone());
        tokio::spawn(async move {
            st.replace_replica(from, target, addr, bounds(Duration::from_secs(60)))
                .await
        })
    };
    let until = Instant::now() + Duration::from_secs(10);
    while !nodes[l]
        .status()
        .is_some_and(|s| s.learners == [target] && s.membership_committed)
    {
        assert!(
            Instant::now() < until,
            "the move added no learner within 10 s: {:?}",
            nodes[l].status()
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    (target, moving)
}

/// A leader does not hand its shard to the preferred replica while a
/// move of one of the shard's replicas waits on it for its learner (a
/// large shard's snapshot may take minutes, and the handover would end
/// the move); it does once the move is over. Before, a handover at
/// start (the preferred replica back) ended a move asked then with
/// "this node stopped leading the shard's group".
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_leader_keeps_its_shard_while_a_move_waits_on_it_and_hands_it_over_after() {
    let dir = tempfile::tempdir().expect("tempdir");
    let mut nodes =
        cluster_and_spares(dir.path(), &[], forkless_store::RaftLogLimits::default(), 1).await;
    let l = leader(&nodes).await;
    // Each balancer prefers the leader at first: no handover.
    let prefer = Arc::new(AtomicU64::new(nodes[l].id));
    for n in &nodes[..3] {
        n.balance_preferring(Duration::from_secs(120), prefer.clone());
    }
    write_soon(&nodes[l], 1, "a write before the move").await;
    let (f, g) = ((l + 1) % 3, (l + 2) % 3);
    let (_, moving) = move_to_a_stopped_spare(&mut nodes, l, f).await;
    // Node g becomes the preferred replica, level and answering.
    prefer.store(nodes[g].id, Ordering::Release);
    let term = nodes[l].status().expect("up").term;
    let watched = Instant::now() + forkless_raftnet::balance::BALANCE_EVERY * 4;
    while Instant::now() < watched {
        assert!(
            nodes[l].leads_at(term),
            "the leader handed its shard over during the move: {:?}",
            nodes[l].status()
        );
        assert!(!moving.is_finished(), "the move ended: {:?}", moving.await);
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    moving.abort();
    let _ = moving.await;
    let until = Instant::now() + Duration::from_secs(15);
    while nodes[g].status().is_none_or(|s| s.state != "leader") {
        assert!(
            Instant::now() < until,
            "the preferred replica did not take the shard within 15 s of the move's end: {:?}",
            nodes[g].status()
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    nodes.iter_mut().for_each(Node::stop);
}

/// A move whose target's node answers nothing (down, or cut off from the
/// leader) ends at its unreachable bound, not at the end of its catch-up
/// bound (5 minutes in a server). One whose node answers is waited for
/// to the end, though its learner takes nothing: a learner installing a
/// large snapshot answers no heartbeat until the install ends, while its
/// node answers (a bound judged by the learner's own answers, tried
/// before, would have ended such a move as if its node were down).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_move_to_a_node_that_answers_nothing_ends_at_its_unreachable_bound() {
    let dir = tempfile::tempdir().expect("tempdir");
    let nodes = cluster(dir.path()).await;
    let l = leader(&nodes).await;
    write_soon(&nodes[l], 1, "a write before the moves").await;
    let from = nodes[(l + 1) % 3].id;
    let st = nodes[l].shard();
    let down = || None;
    let started = Instant::now();
    let answer = st
        .replace_replica(
            from,
            4,
            NOWHERE.into(),
            forkless_store::MoveBounds {
                catch_up_within: Duration::from_secs(60),
                unreachable_within: Duration::from_secs(1),
                last_answered: &down,
            },
        )
        .await;
    match answer {
        Err(StoreError::MoveTargetUnreachable { node: 4, .. }) => {}
        other => panic!("a move to a node that answers nothing answered {other:?}"),
    }
    assert!(
        started.elapsed() < Duration::from_secs(10),
        "a move waited {:?} for a node that answers nothing",
        started.elapsed()
    );
    assert_eq!(nodes[l].status().expect("status").learners, vec![4]);
    // Its node answering, a learner that takes nothing is waited for to
    // the end of the catch-up bound.
    let started = Instant::now();
    let answer = st
        .replace_replica(
            from,
            4,
            NOWHERE.into(),
            forkless_store::MoveBounds {
                catch_up_within: Duration::from_secs(3),
                unreachable_within: Duration::from_secs(1),
                last_answered: &answers,
            },
        )
        .await;
    match answer {
        Err(StoreError::MoveCatchUpTimeout {
            node: 4,
            within_s: 3,
            ..
        }) => {}
        other => panic!("a move to a node that answers answered {other:?}"),
    }
    assert!(
        started.elapsed() >= Duration::from_secs(3),
        "a move to a node that answers ended after {:?}, before its catch-up bound",
        started.elapsed()
    );
}

/// A quiet leader no quorum answers (its calls to both followers fail)
/// asked for a pre-vote first tries to confirm that it still leads, and
/// answers whatever came of it within half the election timeout's min:
/// the candidate waits the min for its answer, so a confirmation left to
/// run would turn every candidacy that reaches such a leader into a
/// timeout, and a group whose leader is cut off would elect only once the
/// leader stepped down (`confirm_before_a_vote`'s bound).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_quiet_leader_cut_off_answers_a_vote_within_its_confirmation_bound() {
    let dir = tempfile::tempdir().expect("tempdir");
    let (nodes, l) = quiet_after_a_write(dir.path()).await;
    let others: Vec<usize> = (0..3).filter(|i| *i != l).collect();
    cut(&nodes, l, others[0]);
    cut(&nodes, l, others[1]);
    // Its lease lapses: no follower answered it for the election
    // timeout's min (quiet, it sends nothing; cut off, nothing comes).
    let min_ms = forkless_store::RaftTiming::default().election_timeout_min_ms;
    let until = Instant::now() + Duration::from_secs(10);
    while !nodes[l].status().is_some_and(|s| {
        s.heard_ms_ago
            .iter()
            .all(|(_, ago)| ago.is_none_or(|ms| ms > min_ms))
    }) {
        assert!(
            Instant::now() < until,
            "the quiet leader's lease did not lapse: {:?}",
            nodes[l].status()
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let term = nodes[l].status().expect("up").term;
    let st = nodes[l].shard();
    let candidate = nodes[others[0]].id;
    let ask = Rpc::PreVote(openraft::raft::VoteRequest::new(
        openraft::impls::Vote::new(term + 1, candidate),
        None,
    ));
    let bound = Duration::from_millis(min_ms / 2);
    let asked = Instant::now();
    let answer = tokio::time::timeout(bound * 4, st.handle_rpc(ask)).await;
    let took = asked.elapsed();
    let Ok(answer) = answer else {
        panic!(
            "a quiet leader cut off did not answer a pre-vote within {:?} (its bound {bound:?}): {:?}",
            bound * 4,
            nodes[l].status()
        );
    };
    assert!(
        matches!(answer, Ok(forkless_store::RpcReply::Vote(_))),
        "a pre-vote answered {answer:?}"
    );
    assert!(
        took >= bound,
        "answered in {took:?}, before its confirmation's bound {bound:?}: did it try to confirm?"
    );
}

/// A leader shutting down (`forkless_raftnet::balance::drain`) hands its
/// group to another replica, which leads at a later term and takes writes.
/// Then every node is shutting down: the replica named refuses the
/// handover, nobody stands for election, and the drain reports it not
/// taken once its bound ran out, rather than counting it handed.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_leader_shutting_down_hands_its_group_over_and_a_refused_handover_is_not_counted() {
    use std::sync::atomic::Ordering;
    let dir = tempfile::tempdir().expect("tempdir");
    let nodes = cluster(dir.path()).await;
    let l = leader(&nodes).await;
    for n in 1..=20 {
        write(&nodes[l], n).await.expect("a write before the stop");
    }
    let before = nodes[l].status().expect("status");
    // No node heartbeat runs here: the group's own answers say who is up.
    let timing = forkless_store::RaftTiming {
        quiesce: false,
        ..forkless_store::RaftTiming::default()
    };
    let all: &(dyn Fn(ShardId) -> Vec<u64> + Send + Sync) = &|_| vec![1, 2, 3];
    nodes[l].draining.store(true, Ordering::Release);
    let done = forkless_raftnet::balance::drain(
        forkless_raftnet::balance::Why::Stop,
        vec![nodes[l].shard()],
        all,
        Arc::default(),
        &tokio::sync::Notify::new(),
        nodes[l].peers.as_ref(),
        timing,
        Duration::from_secs(2),
    )
    .await;
    assert_eq!(
        done,
        forkless_raftnet::balance::Drained {
            handed: 1,
            not_taken: 0,
            no_replica: 0
        }
    );
    // Another node leads at a later term, as the drained node sees it.
    let until = Instant::now() + Duration::from_secs(10);
    let after = loop {
        let s = nodes[l].status().expect("status");
        if s.term > before.term && s.leader.is_some_and(|x| x != nodes[l].id) {
            break s;
        }
        assert!(Instant::now() < until, "no other leader: {s:?}");
        tokio::time::sleep(Duration::from_millis(10)).await;
    };
    let new = after.leader.expect("a leader named") as usize - 1;
    assert_ne!(new, l);
    write(&nodes[new], 21)
        .await
        .expect("a write on the new leader");

    // Every node shutting down: the handover is refused.
    for n in &nodes {
        n.draining.store(true, Ordering::Release);
    }
    let term = nodes[new].status().expect("status").term;
    let started = Instant::now();
    let done = forkless_raftnet::balance::drain(
        forkless_raftnet::balance::Why::Stop,
        vec![nodes[new].shard()],
        all,
        Arc::default(),
        &tokio::sync::Notify::new(),
        nodes[new].peers.as_ref(),
        timing,
        Duration::from_millis(500),
    )
    .await;
    assert_eq!(
        done,
        forkless_raftnet::balance::Drained {
            handed: 0,
            not_taken: 1,
            no_replica: 0
        }
    );
    assert!(started.elapsed() >= Duration::from_millis(500));
    // No replica took it, nor stood for election: every term is as it was.
    for n in &nodes {
        let s = n.status().expect("status");
        assert!(
            s.term <= term,
            "node {} is at term {} (was {term}) though every node is shutting down",
            n.id,
            s.term
        );
    }
}

/// Runs each node's heartbeat (`forkless_raftnet::quiesce::run`) as
/// `timing` says, each recording its peers' answers in its `heard`.
fn heartbeats(
    nodes: &[Node],
    timing: forkless_store::RaftTiming,
    heard: &[Arc<forkless_raftnet::quiesce::PeersHeard>],
) {
    for (n, heard) in nodes.iter().zip(heard) {
        let st = n.shard();
        let me = n.id;
        tokio::spawn(forkless_raftnet::quiesce::run(
            n.peers.clone(),
            Arc::new(move || (1..=3).filter(|p| *p != me).collect()),
            Arc::new(move || vec![st.clone()]),
            timing,
            heard.clone(),
            n.beat_now.clone(),
            n.stop.subscribe(),
        ));
    }
}

/// Waits (at most 10 s) until node `i` heard both others answer its
/// heartbeat.
async fn answered_all(nodes: &[Node], i: usize, heard: &forkless_raftnet::quiesce::PeersHeard) {
    let until = Instant::now() + Duration::from_secs(10);
    while !nodes
        .iter()
        .enumerate()
        .filter(|(j, _)| *j != i)
        .all(|(_, n)| heard.within(n.id, Duration::from_secs(60)))
    {
        assert!(Instant::now() < until, "the peers did not answer a beat");
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
}

/// A drain with the node heartbeat configured long (a beat every 2 s:
/// the drain's wait for its beat's answers, a quarter of its 2 s bound,
/// is shorter than a beat) waits for the peers last heard a second ago,
/// whose answers to its beat come within a round trip, and hands the
/// shard over. Before, it did not wait for a peer it had not heard within
/// its wait's bound, found no peer that answered its beat, and counted
/// the shard as having no replica.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_drain_with_long_heartbeats_waits_for_its_beats_answers() {
    let dir = tempfile::tempdir().expect("tempdir");
    let nodes = cluster(dir.path()).await;
    let l = leader(&nodes).await;
    let timing = forkless_store::RaftTiming {
        heartbeat_ms: 2_000,
        quiesce: false,
        ..forkless_store::RaftTiming::default()
    };
    let heard: Vec<Arc<forkless_raftnet::quiesce::PeersHeard>> =
        nodes.iter().map(|_| Arc::default()).collect();
    heartbeats(&nodes, timing, &heard);
    answered_all(&nodes, l, &heard[l]).await;
    // The last answers a second old: more than the wait's 500 ms, less
    // than the next beat.
    tokio::time::sleep(Duration::from_secs(1)).await;
    nodes[l]
        .draining
        .store(true, std::sync::atomic::Ordering::Release);
    let all: &(dyn Fn(ShardId) -> Vec<u64> + Send + Sync) = &|_| vec![1, 2, 3];
    let done = forkless_raftnet::balance::drain(
        forkless_raftnet::balance::Why::Drain,
        vec![nodes[l].shard()],
        all,
        heard[l].clone(),
        &nodes[l].beat_now,
        nodes[l].peers.as_ref(),
        timing,
        forkless_raftnet::balance::DRAIN_WITHIN,
    )
    .await;
    assert_eq!(
        done,
        forkless_raftnet::balance::Drained {
            handed: 1,
            not_taken: 0,
            no_replica: 0
        }
    );
}

/// A drained leader's balancer (`forkless_raftnet::balance::run`) beats
/// before it hands a shard over, and hands it only to a peer whose answer
/// to that beat says it can lead. The node heartbeat here beats once a
/// minute (and at once when asked), so the peers' last answers, which
/// said they could lead, predate their own drains: a handover on that
/// word is refused, and the leader, having asked for it, takes no more
/// writes. Then one peer is undrained: the next beat's answer says so,
/// and the balancer hands it the shard.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_drained_leaders_balancer_hands_over_by_an_answer_to_a_fresh_beat() {
    use std::sync::atomic::Ordering;
    let dir = tempfile::tempdir().expect("tempdir");
    let nodes = cluster(dir.path()).await;
    let l = leader(&nodes).await;
    write(&nodes[l], 1)
        .await
        .expect("a write before the drains");
    let timing = forkless_store::RaftTiming {
        heartbeat_ms: 60_000,
        quiesce: false,
        ..forkless_store::RaftTiming::default()
    };
    let heard: Vec<Arc<forkless_raftnet::quiesce::PeersHeard>> =
        nodes.iter().map(|_| Arc::default()).collect();
    // The balancer first, the leader its shard's preferred replica (it
    // keeps the shard while not drained); its first round, at once, sees
    // the shard led here: only answers after it count.
    let me = nodes[l].id;
    let placed: Arc<dyn Fn(ShardId) -> Vec<u64> + Send + Sync> = Arc::new(move |_| {
        std::iter::once(me)
            .chain((1..=3).filter(|p| *p != me))
            .collect()
    });
    let st = nodes[l].shard();
    tokio::spawn(forkless_raftnet::balance::run(
        Arc::new(move || vec![st.clone()]),
        placed,
        heard[l].clone(),
        nodes[l].peers.clone(),
        forkless_raftnet::balance::Settings {
            timing,
            learners_kept: Duration::from_secs(120),
        },
        forkless_raftnet::balance::DrainState {
            on: nodes[l].draining.clone(),
            runs: Arc::default(),
            beat_now: nodes[l].beat_now.clone(),
        },
        nodes[l].stop.subscribe(),
    ));
    let balancing = Instant::now();
    heartbeats(&nodes, timing, &heard);
    answered_all(&nodes, l, &heard[l]).await;
    // Answers made after the balancer's first round (which comes at once,
    // and a second a round later: nothing shows it) saw the shard led
    // here: both peers can lead.
    tokio::time::sleep(
        (balancing + forkless_raftnet::balance::BALANCE_EVERY + Duration::from_millis(200))
            .saturating_duration_since(Instant::now()),
    )
    .await;
    let peers: Vec<usize> = (0..3).filter(|i| *i != l).collect();
    let asked = std::time::Instant::now();
    nodes[l].beat_now.notify_one();
    let until = Instant::now() + Duration::from_secs(10);
    while !peers
        .iter()
        .all(|p| heard[l].answered_since(nodes[*p].id, asked))
    {
        assert!(
            Instant::now() < until,
            "the peers did not answer a beat asked for"
        );
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    for p in &peers {
        nodes[*p].draining.store(true, Ordering::Release);
    }
    let term = nodes[l].status().expect("status").term;
    nodes[l].draining.store(true, Ordering::Release);
    // The balancer sees the drain within a round, waits out a drain's own
    // handovers (2 s), then looks every second: a round or two of it.
    tokio::time::sleep(
        forkless_raftnet::balance::DRAIN_WITHIN + forkless_raftnet::balance::BALANCE_EVERY * 3,
    )
    .await;
    let s = nodes[l].status().expect("status");
    assert!(
        s.state == "leader" && s.term == term,
        "the drained leader did not keep its shard though every replica is drained: {s:?}"
    );
    tokio::time::timeout(Duration::from_secs(5), write(&nodes[l], 2))
        .await
        .expect("a write on the drained leader did not end within 5 s")
        .expect("a write on the drained leader, which no replica can relieve (did it hand the shard to a drained peer?)");

    // One peer undrained: handed the shard by the next round's beat.
    let to = peers[0];
    nodes[to].draining.store(false, Ordering::Release);
    let until = Instant::now() + Duration::from_secs(10);
    loop {
        let s = nodes[to].status().expect("status");
        if s.state == "leader" && s.leader == Some(nodes[to].id) && s.term > term {
            break;
        }
        assert!(
            Instant::now() < until,
            "the undrained peer was not handed the shard within 10 s: {s:?}"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    write_soon(&nodes[to], 3, "a write on the peer handed the shard").await;
}

/// A replica that comes to lead its group has its node's heartbeat go out
/// at once (`Replication::beat_now`), naming the group with its new term:
/// a node that holds no replica of the shard (here a fourth listener with
/// no groups, which records what each beat says) learns the new leader
/// within moments, though the heartbeat's interval is a minute. Without
/// the beat at once it would hear of it a minute later.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_new_leader_tells_every_peer_at_once() {
    let dir = tempfile::tempdir().expect("tempdir");
    let nodes = cluster(dir.path()).await;
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
        .await
        .expect("bind");
    let addr = listener.local_addr().expect("addr").to_string();
    type Told = Arc<std::sync::Mutex<Vec<(u64, u32, u64)>>>;
    let told: Told = Arc::default();
    // The nodes whose beat node 4 has heard, leading or not.
    let beat: Arc<std::sync::Mutex<Vec<u64>>> = Arc::default();
    let hooks = {
        let (told, beat) = (told.clone(), beat.clone());
        forkless_raftnet::Hooks {
            join: None,
            told: Some(Arc::new(move |peer, led: &[(u32, u64)]| {
                beat.lock().expect("beat").push(peer);
                let mut t = told.lock().expect("told");
                t.extend(led.iter().map(|(s, term)| (peer, *s, *term)));
            })),
        }
    };
    let (_stop4, stopped4) = tokio::sync::watch::channel(false);
    tokio::spawn(forkless_raftnet::serve_node(
        listener,
        forkless_raftnet::Handshake::secret("secret".into()),
        Arc::new(|_| None),
        hooks,
        Arc::new(|_| Ok(())),
        stopped4,
    ));
    // Each node beats the others and node 4 once a minute (its first beat
    // at once), and at once for a leadership won.
    let timing = forkless_store::RaftTiming {
        heartbeat_ms: 60_000,
        ..forkless_store::RaftTiming::default()
    };
    for n in &nodes {
        assert!(n.links.add_peer(4, addr.clone()));
        let (me, st) = (n.id, n.shard());
        tokio::spawn(forkless_raftnet::quiesce::run(
            n.peers.clone(),
            Arc::new(move || [1, 2, 3, 4].into_iter().filter(|p| *p != me).collect()),
            Arc::new(move || vec![st.clone()]),
            timing,
            Arc::default(),
            n.beat_now.clone(),
            n.stop.subscribe(),
        ));
    }
    let heard = |leader: u64, term: u64| {
        told.lock()
            .expect("told")
            .iter()
            .any(|t| *t == (leader, SHARD.get(), term))
    };
    let l = leader(&nodes).await;
    let before = nodes[l].status().expect("status").term;
    let to = nodes[(l + 1) % 3].id;
    let until = Instant::now() + Duration::from_secs(10);
    while !heard(nodes[l].id, before) {
        assert!(Instant::now() < until, "node 4 never heard of the leader");
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    // A beat of the node the leadership goes to, asked for now, heard by
    // node 4: its node's last beat is a moment ago when it comes to lead
    // (beats sooner than their tick are spaced: a new leader's beat once
    // waited an eighth of the minute's interval, 7.5 s, after it).
    let beats_of_to = || {
        beat.lock()
            .expect("beat")
            .iter()
            .filter(|p| **p == to)
            .count()
    };
    let had = beats_of_to();
    nodes[(l + 1) % 3].beat_now.notify_one();
    let until = Instant::now() + Duration::from_secs(10);
    while beats_of_to() == had {
        assert!(Instant::now() < until, "node 4 never heard node {to} beat");
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    // The leadership handed to another replica: node 4 hears of it from
    // the new leader's node within moments.
    nodes[l]
        .shard()
        .transfer_leader(to)
        .await
        .expect("asked for the handover");
    let until = Instant::now() + Duration::from_secs(10);
    let (led, term) = loop {
        if let Some(s) = nodes.iter().find_map(|n| {
            n.status()
                .filter(|s| s.state == "leader" && s.term > before)
        }) {
            break (s.me, s.term);
        }
        assert!(Instant::now() < until, "no new leader after the handover");
        tokio::time::sleep(Duration::from_millis(10)).await;
    };
    let elected = Instant::now();
    while !heard(led, term) {
        assert!(
            elected.elapsed() < Duration::from_secs(5),
            "node 4 did not hear of node {led}'s leadership at term {term} within 5 s: {:?}",
            told.lock().expect("told")
        );
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    eprintln!(
        "node 4 heard of node {led}'s leadership at term {term} {:?} after it was seen",
        elected.elapsed()
    );
}
