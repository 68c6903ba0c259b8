//! The client's reactions to `421 not_owner` and `503 owner_unavailable`,
//! against scripted fake nodes on loopback (a real cluster rarely answers
//! these on demand).

use axum::extract::State;
use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::{Json, Router};
use forkless_client::{
    AppendEvents, Client, Config, Error, Executed, GaveUp, NewEvent, RetryPolicy, Routing,
};
use forkless_sharding::ShardCount;
use forkless_types::ExecutionId;
use serde_json::json;
use std::collections::VecDeque;
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

/// One canned answer: status, body, Retry-After.
type Canned = (u16, serde_json::Value, Option<&'static str>);

#[derive(Default)]
struct Node {
    /// Answers to appends, in order; when empty, a 200 success.
    script: Mutex<VecDeque<Canned>>,
    appends: AtomicUsize,
    map_fetches: AtomicUsize,
    /// The map this node serves: which node owns shard 1.
    shard1_owner: AtomicU64,
    map_version: AtomicU64,
    /// Whether this node's map says node 2 is alive.
    b_alive: AtomicBool,
    /// Whether this node's map lists the shards' replicas (a replicated
    /// cluster).
    replicated: AtomicBool,
    addrs: Vec<String>,
    id: u16,
}

async fn cluster(State(n): State<Arc<Node>>) -> Json<serde_json::Value> {
    n.map_fetches.fetch_add(1, Ordering::SeqCst);
    let mut map = json!({
        "node": n.id, "shard_count": 2, "map_version": n.map_version.load(Ordering::SeqCst),
        "routing_active": true,
        "nodes": [
            {"id": 1, "api_addr": n.addrs[0], "alive": true},
            {"id": 2, "api_addr": n.addrs[1], "alive": n.b_alive.load(Ordering::SeqCst)},
        ],
        "shards": [
            {"shard": 0, "owner": 1, "epoch": 1},
            {"shard": 1, "owner": n.shard1_owner.load(Ordering::SeqCst), "epoch": 2},
        ],
    });
    if n.replicated.load(Ordering::SeqCst) {
        for s in 0..2 {
            map["shards"][s]["replicas"] = json!([1, 2]);
        }
    }
    Json(map)
}

async fn append(State(n): State<Arc<Node>>) -> Response {
    n.appends.fetch_add(1, Ordering::SeqCst);
    let next = n.script.lock().ok().and_then(|mut s| s.pop_front());
    let (status, body, retry_after) = next.unwrap_or((
        200,
        json!({"execution_id": "1", "first_seq": 2, "last_seq": 2, "deduplicated": false}),
        None,
    ));
    let mut r = (
        StatusCode::from_u16(status).unwrap_or(StatusCode::INTERNAL_SERVER_ERROR),
        Json(body),
    )
        .into_response();
    if let Some(ra) = retry_after {
        r.headers_mut()
            .insert("retry-after", ra.parse().expect("static header"));
    }
    r.headers_mut().insert(
        "x-forkless-map-version",
        n.map_version.load(Ordering::SeqCst).into(),
    );
    r
}

struct Fake {
    a: Arc<Node>,
    b: Arc<Node>,
    a_url: String,
}

async fn fake_cluster() -> Fake {
    let la = tokio::net::TcpListener::bind("127.0.0.1:0")
        .await
        .expect("bind");
    let lb = tokio::net::TcpListener::bind("127.0.0.1:0")
        .await
        .expect("bind");
    let addrs = vec![
        la.local_addr().expect("addr").to_string(),
        lb.local_addr().expect("addr").to_string(),
    ];
    let mk = |id| {
        Arc::new(Node {
            id,
            addrs: addrs.clone(),
            shard1_owner: AtomicU64::new(2),
            map_version: AtomicU64::new(1),
            b_alive: AtomicBool::new(true),
            ..Node::default()
        })
    };
    let (a, b) = (mk(1), mk(2));
    for (l, n) in [(la, a.clone()), (lb, b.clone())] {
        let app = Router::new()
            .route("/api/cluster", get(cluster))
            .route("/api/executions/{id}/events", post(append))
            .with_state(n);
        tokio::spawn(async move {
            let _ = axum::serve(l, app).await;
        });
    }
    Fake {
        a,
        b,
        a_url: format!("http://{}", addrs[0]),
    }
}

/// An id on shard 1 of 2 (owned by node 2 in the fake map).
fn id_on_shard_1() -> ExecutionId {
    let n = ShardCount::new(2).expect("legal");
    (1..1000)
        .map(|i| ExecutionId::new(i).expect("positive"))
        .find(|id| id.shard(n).get() == 1)
        .expect("some id lands on shard 1")
}

fn client(url: &str, retry: RetryPolicy) -> Client {
    let mut cfg = Config::new(url);
    cfg.retry = retry;
    cfg.request_timeout = Duration::from_secs(5);
    Client::with_config(cfg).expect("client")
}

fn one_event(idempotency_key: Option<&str>) -> AppendEvents {
    let mut e = NewEvent::new("x");
    e.idempotency_key = idempotency_key.map(str::to_string);
    AppendEvents {
        events: vec![e],
        expected_last_seq: None,
    }
}

fn fast_retry() -> RetryPolicy {
    RetryPolicy {
        max_attempts: 5,
        max_elapsed: Duration::from_secs(10),
        initial_backoff: Duration::from_millis(10),
        max_backoff: Duration::from_millis(50),
    }
}

fn push(n: &Node, c: Canned) {
    n.script.lock().expect("lock").push_back(c);
}

fn appends(n: &Node) -> usize {
    n.appends.load(Ordering::SeqCst)
}

#[tokio::test]
async fn appends_go_straight_to_the_owner() {
    let f = fake_cluster().await;
    let c = client(&f.a_url, fast_retry());
    c.append(id_on_shard_1(), &one_event(None))
        .await
        .expect("append");
    assert_eq!(appends(&f.a), 0, "seed not used");
    assert_eq!(appends(&f.b), 1, "owner used");
}

#[tokio::test]
async fn fixed_routing_never_leaves_the_seed_and_does_not_follow_421() {
    let f = fake_cluster().await;
    let mut cfg = Config::new(&f.a_url);
    cfg.routing = Routing::Fixed;
    let c = Client::with_config(cfg).expect("client");
    c.append(id_on_shard_1(), &one_event(None))
        .await
        .expect("append");
    assert_eq!(appends(&f.a), 1);
    assert_eq!(appends(&f.b), 0);
    push(
        &f.a,
        (
            421,
            json!({"error":"not_owner","message":"m","shard":1,"owner_hint":{"node":2,"address":f.a.addrs[1]},"map_version":1,"executed":false}),
            None,
        ),
    );
    let e = c.append(id_on_shard_1(), &one_event(None)).await;
    assert!(matches!(e, Err(Error::NotOwner { .. })), "{e:?}");
    assert_eq!(appends(&f.b), 0);
}

#[tokio::test]
async fn not_owner_refreshes_the_map_and_follows_the_hint_once() {
    let f = fake_cluster().await;
    // A replicated cluster: a second 421 is its leadership moving.
    for n in [&f.a, &f.b] {
        n.replicated.store(true, Ordering::SeqCst);
    }
    // Node 1's map is stale: it says it owns shard 1 itself.
    f.a.shard1_owner.store(1, Ordering::SeqCst);
    let c = client(&f.a_url, fast_retry());
    push(
        &f.a,
        (
            421,
            json!({"error":"not_owner","message":"m","shard":1,"owner_hint":{"node":2,"address":f.a.addrs[1]},"map_version":2,"executed":false}),
            None,
        ),
    );
    let fetches_before = f.a.map_fetches.load(Ordering::SeqCst);
    c.append(id_on_shard_1(), &one_event(None))
        .await
        .expect("append after following the hint");
    assert_eq!(appends(&f.a), 1);
    assert_eq!(appends(&f.b), 1);
    assert!(
        f.a.map_fetches.load(Ordering::SeqCst) > fetches_before,
        "the map was refreshed"
    );

    // A second 421 after following (the shard's leadership moving: an
    // election, a transfer) is tried again by a fresh map, within the
    // retry policy; here the next try is answered.
    // (Node 1's map names itself the owner, and so does the hint.)
    let back_to_a = json!({"error":"not_owner","message":"m","shard":1,"owner_hint":{"node":1,"address":f.a.addrs[0]},"executed":false});
    for _ in 0..2 {
        push(&f.a, (421, back_to_a.clone(), None));
    }
    let before = appends(&f.a) + appends(&f.b);
    c.append(id_on_shard_1(), &one_event(None))
        .await
        .expect("append once the leadership settled");
    assert_eq!(
        appends(&f.a) + appends(&f.b) - before,
        3,
        "one attempt, one follow, one retry by a fresh map"
    );

    // One that keeps coming is returned once the policy's attempts are
    // spent, not chased in a loop.
    for n in [&f.a, &f.b] {
        for _ in 0..10 {
            push(n, (421, back_to_a.clone(), None));
        }
    }
    let before = appends(&f.a) + appends(&f.b);
    let e = c.append(id_on_shard_1(), &one_event(None)).await;
    assert!(matches!(e, Err(Error::NotOwner { .. })), "{e:?}");
    assert_eq!(
        appends(&f.a) + appends(&f.b) - before,
        fast_retry().max_attempts as usize,
        "the policy's attempts, no more"
    );
}

#[tokio::test]
async fn a_static_clusters_second_not_owner_is_returned_at_once() {
    let f = fake_cluster().await;
    // No replicas listed: a static cluster, where a second 421 after the
    // hint was followed means two maps that disagree, which retrying
    // does not mend.
    let c = client(&f.a_url, fast_retry());
    let to_a = json!({"error":"not_owner","message":"m","shard":1,"owner_hint":{"node":1,"address":f.a.addrs[0]},"executed":false});
    for n in [&f.a, &f.b] {
        for _ in 0..10 {
            push(n, (421, to_a.clone(), None));
        }
    }
    let e = c.append(id_on_shard_1(), &one_event(None)).await;
    assert!(matches!(e, Err(Error::NotOwner { .. })), "{e:?}");
    assert_eq!(
        appends(&f.a) + appends(&f.b),
        2,
        "one attempt and one follow of the hint, no retry"
    );
}

fn unavailable(executed: serde_json::Value) -> serde_json::Value {
    json!({"error":"owner_unavailable","message":"owner down","shard":1,"executed":executed})
}

#[tokio::test]
async fn owner_unavailable_not_executed_is_retried_honouring_retry_after() {
    let f = fake_cluster().await;
    let c = client(&f.a_url, fast_retry());
    push(&f.b, (503, unavailable(json!(false)), Some("1")));
    push(&f.b, (503, unavailable(json!(false)), Some("0")));
    let t = Instant::now();
    c.append(id_on_shard_1(), &one_event(None))
        .await
        .expect("succeeds on the third attempt");
    assert!(
        t.elapsed() >= Duration::from_secs(1),
        "Retry-After honoured"
    );
    assert_eq!(appends(&f.b), 3);
}

#[tokio::test]
async fn outcome_unknown_is_not_retried_without_an_idempotency_key() {
    let f = fake_cluster().await;
    let c = client(&f.a_url, fast_retry());
    push(&f.b, (503, unavailable(json!("unknown")), Some("0")));
    let e = c.append(id_on_shard_1(), &one_event(None)).await;
    match e {
        Err(
            ref err @ Error::OwnerUnavailable {
                executed: Executed::Unknown,
                attempts: 1,
                gave_up: GaveUp::UnsafeToRepeat,
                ..
            },
        ) => {
            assert!(err.maybe_executed());
            assert!(err.to_string().contains("idempotency key"), "{err}");
        }
        other => panic!("expected an unknown-outcome error, got {other:?}"),
    }
    assert_eq!(appends(&f.b), 1, "sent exactly once");

    // The same failure on an idempotent append is retried.
    push(&f.b, (503, unavailable(json!("unknown")), Some("0")));
    c.append(id_on_shard_1(), &one_event(Some("k1")))
        .await
        .expect("idempotent append retried");
    assert_eq!(appends(&f.b), 3);
}

#[tokio::test]
async fn retries_are_bounded() {
    let f = fake_cluster().await;
    let c = client(
        &f.a_url,
        RetryPolicy {
            max_attempts: 3,
            ..fast_retry()
        },
    );
    for _ in 0..10 {
        push(&f.b, (503, unavailable(json!(false)), Some("0")));
    }
    let e = c.append(id_on_shard_1(), &one_event(None)).await;
    assert!(
        matches!(
            e,
            Err(Error::OwnerUnavailable {
                executed: Executed::No,
                attempts: 3,
                ..
            })
        ),
        "{e:?}"
    );
    assert_eq!(appends(&f.b), 3);
}

#[tokio::test]
async fn a_dead_node_is_a_transport_error_nothing_sent() {
    // A port that was free a moment ago: connection refused.
    let port = std::net::TcpListener::bind("127.0.0.1:0")
        .and_then(|l| l.local_addr())
        .expect("free port")
        .port();
    let c = client(
        &format!("127.0.0.1:{port}"),
        RetryPolicy {
            max_attempts: 2,
            ..fast_retry()
        },
    );
    let e = c.append(id_on_shard_1(), &one_event(None)).await;
    assert!(
        matches!(
            e,
            Err(Error::Transport {
                executed: Executed::No,
                attempts: 2,
                ..
            })
        ),
        "{e:?}"
    );
}

#[tokio::test]
async fn a_newer_map_version_in_an_answer_triggers_a_refresh() {
    let f = fake_cluster().await;
    let c = client(&f.a_url, fast_retry());
    c.append(id_on_shard_1(), &one_event(None))
        .await
        .expect("append");
    let fetches = f.a.map_fetches.load(Ordering::SeqCst);
    // The cluster moves to map version 5; the owner says so on a success.
    f.b.map_version.store(5, Ordering::SeqCst);
    f.a.map_version.store(5, Ordering::SeqCst);
    c.append(id_on_shard_1(), &one_event(None))
        .await
        .expect("append");
    assert_eq!(
        f.a.map_fetches.load(Ordering::SeqCst),
        fetches,
        "no refresh yet"
    );
    c.append(id_on_shard_1(), &one_event(None))
        .await
        .expect("append");
    assert_eq!(f.a.map_fetches.load(Ordering::SeqCst), fetches + 1);
    assert_eq!(c.cached_map().map(|m| m.map_version), Some(5));
}

#[tokio::test]
async fn an_owner_believed_down_is_reached_through_a_live_node() {
    let f = fake_cluster().await;
    f.a.b_alive.store(false, Ordering::SeqCst);
    let c = client(&f.a_url, fast_retry());
    // The live node answers for the shard (here: it fails closed, nothing
    // written, and then succeeds once the owner is back).
    push(&f.a, (503, unavailable(json!(false)), Some("0")));
    c.append(id_on_shard_1(), &one_event(None))
        .await
        .expect("append");
    assert_eq!(appends(&f.a), 2);
    assert_eq!(appends(&f.b), 0, "the owner believed down was not tried");
    // Once the map says it is back, requests go straight to it again.
    f.a.b_alive.store(true, Ordering::SeqCst);
    c.cluster().await.expect("refresh");
    c.append(id_on_shard_1(), &one_event(None))
        .await
        .expect("append");
    assert_eq!(appends(&f.b), 1);
}
