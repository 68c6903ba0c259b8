//! One real node: every endpoint's happy path and every error of DESIGN.md
//! section 7 that one node can produce, with exact status codes and error
//! codes, and proof that nothing is written on an error.

use forkless_it::*;
use serde_json::Value;
use std::time::{Duration, Instant};

const PAYLOAD_MAX: usize = 1024;
const BATCH_MAX: usize = 5;
const BODY_MAX: usize = 16 * 1024;

fn node(dir: &tempfile::TempDir) -> Node {
    Node::start_single(
        &dir.path().join("data"),
        &[
            "--shard-count",
            "4",
            "--event-payload-bytes-max",
            &PAYLOAD_MAX.to_string(),
            "--batch-events-max",
            &BATCH_MAX.to_string(),
            "--request-body-bytes-max",
            &BODY_MAX.to_string(),
        ],
    )
}

fn ev(t: &str) -> Value {
    json!({"type": t, "payload": {"n": 1}})
}

#[test]
fn happy_paths_of_every_endpoint() {
    let _d = deadline("happy_paths_of_every_endpoint", TEST_DEADLINE);
    let dir = tempfile::tempdir().unwrap();
    let n = node(&dir);
    let c = n.client;

    c.get("/healthz").expect(200);
    assert_eq!(c.get("/healthz").json()["status"], "ok");
    c.get("/readyz").expect(200);
    assert_eq!(c.get("/readyz").json()["status"], "ready");

    // Start: 201, a string id, the started event at seq 1.
    let r = c.post(
        "/api/executions",
        &json!({"workflow": "order", "input": {"a": [1, 2]}}),
    );
    r.expect(201);
    let v = r.json();
    let id = id_of(&v);
    assert!(id.parse::<i64>().unwrap() > 0);
    assert_eq!(v["workflow"], "order");
    assert_eq!(v["status"], "running");
    assert_eq!(v["last_seq"], 1);
    assert_eq!(v["existing"], false);
    assert_eq!(v["shard"], shard_of_id(&id, 4));
    assert!(r.header("x-forkless-node").is_some());
    assert_eq!(r.header("x-forkless-hops"), Some("0"));
    assert_eq!(
        r.header_u64("x-forkless-shard"),
        Some(shard_of_id(&id, 4) as u64)
    );

    // GET execution.
    let g = c.get(&format!("/api/executions/{id}"));
    g.expect(200);
    let gv = g.json();
    assert_eq!(id_of(&gv), id);
    assert_eq!(gv["last_seq"], 1);
    assert_eq!(gv["status"], "running");

    // Append by path: seqs 2..=3, then with expected_last_seq.
    let a = c.post(
        &format!("/api/executions/{id}/events"),
        &json!({"events": [ev("step.a"), ev("step.b")]}),
    );
    a.expect(200);
    let av = a.json();
    assert_eq!(
        (av["first_seq"].as_u64(), av["last_seq"].as_u64()),
        (Some(2), Some(3))
    );
    assert_eq!(av["deduplicated"], false);
    assert_eq!(id_of(&av), id);
    c.post(
        &format!("/api/executions/{id}/events"),
        &json!({"events": [ev("step.c")], "expected_last_seq": 3}),
    )
    .expect(200);

    // Append by body id.
    let b = c.post(
        "/api/events",
        &json!({"execution_id": id, "events": [ev("step.d")], "expected_last_seq": 4}),
    );
    b.expect(200);
    assert_eq!(b.json()["first_seq"], 5);

    // Signal.
    let s = c.post(
        &format!("/api/executions/{id}/signals"),
        &json!({"name": "poke", "payload": {"x": true}}),
    );
    s.expect(200);
    let sv = s.json();
    assert_eq!(sv["seq"], 6);
    assert_eq!(sv["status"], "running");

    // Read events: all, paged, after.
    let all = c.events(&id);
    let types: Vec<_> = all.iter().map(|e| e["type"].as_str().unwrap()).collect();
    assert_eq!(
        types,
        [
            "execution.started",
            "step.a",
            "step.b",
            "step.c",
            "step.d",
            "execution.signaled"
        ]
    );
    for (i, e) in all.iter().enumerate() {
        assert_eq!(e["seq"], i as u64 + 1);
        assert!(e["recorded_at"].is_string());
    }
    assert_eq!(all[1]["payload"], json!({"n": 1}));
    assert_eq!(all[0]["payload"]["input"], json!({"a": [1, 2]}));
    assert_eq!(all[5]["payload"]["name"], "poke");
    let page = c
        .get(&format!("/api/executions/{id}/events?after=2&limit=2"))
        .json();
    let seqs: Vec<_> = page["events"]
        .as_array()
        .unwrap()
        .iter()
        .map(|e| e["seq"].as_u64().unwrap())
        .collect();
    assert_eq!(seqs, [3, 4]);
    assert_eq!(page["last_seq"], 6);

    // Cancel (empty body allowed): terminal.
    let k = c.req("POST", &format!("/api/executions/{id}/cancel"), &[], None);
    k.expect(200);
    assert_eq!(k.json()["status"], "cancelled");
    assert_eq!(k.json()["seq"], 7);
    assert_eq!(
        c.get(&format!("/api/executions/{id}")).json()["status"],
        "cancelled"
    );

    // A steered start, found again by its key (which contains '/').
    let key = "tenant-a/order-1";
    let st = c.start(&json!({"workflow": "w", "routing_key": key}));
    let sid = id_of(&st);
    assert_eq!(st["routing_key"], key);
    assert_eq!(shard_of_id(&sid, 4), shard_of_key(key, 4));
    let kr = c.get(&format!("/api/keys/{key}"));
    kr.expect(200);
    let kv = kr.json();
    assert_eq!(kv["routing_key"], key);
    assert_eq!(kv["shard"], shard_of_key(key, 4));
    let ids: Vec<_> = kv["executions"]
        .as_array()
        .unwrap()
        .iter()
        .map(id_of)
        .collect();
    assert_eq!(ids, vec![sid]);
    // A key with nothing under it: an empty list.
    let empty = c.get("/api/keys/nobody/here").json();
    assert_eq!(empty["executions"], json!([]));

    // Cluster map of a lone node: inert routing, every shard local.
    let cl = c.get("/api/cluster");
    cl.expect(200);
    let clv = cl.json();
    assert_eq!(clv["shard_count"], 4);
    assert_eq!(clv["partition_count"], 4096);
    assert_eq!(clv["routing_active"], false);
    let shards = clv["shards"].as_array().unwrap();
    assert_eq!(shards.len(), 4);
    assert!(shards.iter().all(|s| s["local"] == true));

    // Metrics.
    let m = c.get("/metrics");
    m.expect(200);
    let text = m.text();
    assert!(text.contains("forkless_route_total"), "{text}");
    assert!(
        parse_metric(&text, "forkless_route_total{outcome=\"owned_locally\"}") >= 8.0,
        "{text}"
    );
    assert!(parse_metric(&text, "forkless_executions_started_total") >= 2.0);
    // Every write above was committed in some shard's group commit, by the
    // writer thread or by a lone caller; each group carried one command or
    // more.
    let (mut groups, mut commands) = (0.0, 0.0);
    for shard in 0..4 {
        for committer in ["writer_thread", "caller"] {
            groups += parse_metric(
                &text,
                &format!(
                    "forkless_store_commits_total{{shard=\"{shard}\",committer=\"{committer}\"}}"
                ),
            );
        }
        commands += parse_metric(
            &text,
            &format!("forkless_store_committed_commands_total{{shard=\"{shard}\"}}"),
        );
    }
    assert!(groups >= 1.0, "{text}");
    assert!(commands >= groups, "{text}");
    // One fdatasync of the node log per round, each timed; these requests
    // came one at a time, so each round carried one group commit, besides
    // the rounds a shard's Raft group writes to start, if the shards have
    // one (its membership, its leader's two votes and first entry: four,
    // at the same time for every shard, so some share a round).
    let syncs = parse_metric(&text, "forkless_store_node_log_sync_seconds_count");
    assert!(
        syncs >= groups && syncs <= groups + 4.0 * 4.0,
        "{syncs} syncs for {groups} groups: {text}"
    );
    assert!(
        !text.contains("forkless_store_log_sync_seconds_count{"),
        "no shard has a log of its own: {text}"
    );
    // What the node log and each shard's database take on disk.
    assert!(
        parse_metric(&text, "forkless_store_node_log_bytes") > 0.0,
        "{text}"
    );
    for shard in 0..4 {
        assert!(
            parse_metric(
                &text,
                &format!("forkless_store_shard_disk_bytes{{shard=\"{shard}\"}}")
            ) > 0.0,
            "{text}"
        );
        // What each shard's writes hold in memory until a flush (these few
        // writes: some, far under the node's budget).
        let held = parse_metric(
            &text,
            &format!("forkless_store_write_buffer_bytes{{shard=\"{shard}\"}}"),
        );
        assert!(held > 0.0 && held < (1 << 20) as f64, "{held}: {text}");
    }
    // Checkpoints are counted per shard, their time by phase (these few
    // writes made none since the shards opened).
    for shard in 0..4 {
        for series in [
            format!("forkless_store_checkpoints_total{{shard=\"{shard}\"}} 0"),
            format!(
                "forkless_store_checkpoint_seconds_total{{shard=\"{shard}\",phase=\"index\"}} 0.0"
            ),
            format!(
                "forkless_store_checkpoint_seconds_total{{shard=\"{shard}\",phase=\"sync\"}} 0.0"
            ),
        ] {
            assert!(text.lines().any(|l| l == series), "{series} in {text}");
        }
    }
    assert!(
        commands >= parse_metric(&text, "forkless_executions_started_total"),
        "{text}"
    );
}

#[test]
fn validation_errors_are_400_and_write_nothing() {
    let _d = deadline("validation_errors_are_400_and_write_nothing", TEST_DEADLINE);
    let dir = tempfile::tempdir().unwrap();
    let n = node(&dir);
    let c = n.client;
    let id = id_of(&c.start(&json!({"workflow": "w"})));
    let before = c.last_seq(&id);
    let events = format!("/api/executions/{id}/events");
    let signals = format!("/api/executions/{id}/signals");
    let cancel = format!("/api/executions/{id}/cancel");

    // Malformed JSON on every body-taking endpoint.
    for path in [
        "/api/executions",
        events.as_str(),
        "/api/events",
        signals.as_str(),
        cancel.as_str(),
    ] {
        for body in [&b"{"[..], b"{\"events\": [", b"not json", b"[1,2]"] {
            c.post_raw(path, body).expect_error(400, "invalid_request");
        }
    }
    // A missing body where one is required.
    c.req("POST", "/api/executions", &[], None)
        .expect_error(400, "invalid_request");
    c.req("POST", &events, &[], None)
        .expect_error(400, "invalid_request");

    // Unknown fields: refused, and the message names the field.
    let unknown = [
        (
            "/api/executions",
            json!({"workflow": "w", "bogus_field": 1}),
        ),
        (
            events.as_str(),
            json!({"events": [ev("t")], "bogus_field": 1}),
        ),
        (
            events.as_str(),
            json!({"events": [{"type": "t", "bogus_field": 1}]}),
        ),
        (
            "/api/events",
            json!({"execution_id": id, "events": [ev("t")], "bogus_field": 1}),
        ),
        (signals.as_str(), json!({"name": "s", "bogus_field": 1})),
        (cancel.as_str(), json!({"reason": "r", "bogus_field": 1})),
    ];
    for (path, body) in &unknown {
        let v = c.post(path, body).expect_error(400, "invalid_request");
        assert!(
            v["message"].as_str().unwrap().contains("bogus_field"),
            "message should name the field: {v}"
        );
    }
    // Wrong types and missing fields name the field path.
    let v = c
        .post(&events, &json!({"events": [{"type": 5}]}))
        .expect_error(400, "invalid_request");
    assert_eq!(v["field"], "events[0].type", "{v}");
    let v = c
        .post("/api/executions", &json!({"input": 1}))
        .expect_error(400, "invalid_request");
    assert!(v["message"].as_str().unwrap().contains("workflow"), "{v}");
    c.post(&events, &json!({"events": []}))
        .expect_error(400, "invalid_request");
    // Reserved event types, and a terminal event that is not last.
    for t in [
        "execution.started",
        "execution.signaled",
        "execution.cancelled",
    ] {
        let v = c
            .post(&events, &json!({"events": [ev(t)]}))
            .expect_error(400, "invalid_request");
        assert_eq!(v["field"], "events[0].type", "{v}");
    }
    c.post(
        &events,
        &json!({"events": [ev("execution.completed"), ev("t")]}),
    )
    .expect_error(400, "invalid_request");
    // Repeated idempotency key in a batch.
    c.post(
        &events,
        &json!({"events": [{"type": "t", "idempotency_key": "k"}, {"type": "t", "idempotency_key": "k"}]}),
    )
    .expect_error(400, "invalid_request");
    // Empty or control-character names.
    c.post("/api/executions", &json!({"workflow": ""}))
        .expect_error(400, "invalid_request");
    c.post(&signals, &json!({"name": "a\u{1}b"}))
        .expect_error(400, "invalid_request");
    c.post(
        "/api/executions",
        &json!({"workflow": "w", "routing_key": ""}),
    )
    .expect_error(400, "invalid_request");

    // execution_id as a JSON number in POST /api/events: ids are strings.
    let num: i64 = id.parse().unwrap();
    let v = c
        .post(
            "/api/events",
            &json!({"execution_id": num, "events": [ev("t")]}),
        )
        .expect_error(400, "invalid_request");
    assert_eq!(v["field"], "execution_id", "{v}");
    c.post("/api/events", &json!({"events": [ev("t")]}))
        .expect_error(400, "invalid_request");
    c.post(
        "/api/events",
        &json!({"execution_id": "abc", "events": [ev("t")]}),
    )
    .expect_error(400, "invalid_request");

    // Bad ids in the path, on every id-taking endpoint.
    for bad in [
        "abc",
        "0",
        "-1",
        "99999999999999999999",
        "9223372036854775808",
        "+5",
        "1.5",
        "%20%31",
    ] {
        let gets = [
            format!("/api/executions/{bad}"),
            format!("/api/executions/{bad}/events"),
        ];
        for p in &gets {
            let v = c.get(p).expect_error(400, "invalid_request");
            assert_eq!(v["field"], "execution_id", "{p}: {v}");
        }
        for (p, body) in [
            (
                format!("/api/executions/{bad}/events"),
                json!({"events": [ev("t")]}),
            ),
            (
                format!("/api/executions/{bad}/signals"),
                json!({"name": "s"}),
            ),
            (format!("/api/executions/{bad}/cancel"), json!({})),
        ] {
            let v = c.post(&p, &body).expect_error(400, "invalid_request");
            assert_eq!(v["field"], "execution_id", "{p}: {v}");
        }
    }

    // Read parameters.
    for q in [
        "limit=0",
        "limit=1001",
        "after=-1",
        "after=x",
        "wait_ms=30001",
        "wait_ms=abc",
    ] {
        let v = c
            .get(&format!("/api/executions/{id}/events?{q}"))
            .expect_error(400, "invalid_request");
        let field = q.split('=').next().unwrap();
        assert_eq!(v["field"], field, "{q}: {v}");
    }
    // Bad routing keys in the path.
    let long = "k".repeat(1025);
    c.get(&format!("/api/keys/{long}"))
        .expect_error(400, "invalid_request");
    c.get("/api/keys/a%01b")
        .expect_error(400, "invalid_request");

    assert_eq!(c.last_seq(&id), before, "an error wrote events");
    assert_eq!(c.events(&id).len() as u64, before);
}

#[test]
fn conflicts_limits_and_not_found() {
    let _d = deadline("conflicts_limits_and_not_found", TEST_DEADLINE);
    let dir = tempfile::tempdir().unwrap();
    let n = node(&dir);
    let c = n.client;
    let id = id_of(&c.start(&json!({"workflow": "w"})));
    let events = format!("/api/executions/{id}/events");
    c.post(&events, &json!({"events": [ev("a"), ev("b")]}))
        .expect(200);
    assert_eq!(c.last_seq(&id), 3);

    // Wrong expected_last_seq: 409 with the current last seq, nothing written.
    for wrong in [0u64, 2, 4, 100] {
        let v = c
            .post(
                &events,
                &json!({"events": [ev("x")], "expected_last_seq": wrong}),
            )
            .expect_error(409, "sequence_conflict");
        assert_eq!(v["last_seq"], 3, "{v}");
        assert_eq!(v["expected_last_seq"], wrong, "{v}");
        let v = c
            .post(
                "/api/events",
                &json!({"execution_id": id, "events": [ev("x")], "expected_last_seq": wrong}),
            )
            .expect_error(409, "sequence_conflict");
        assert_eq!(v["last_seq"], 3, "{v}");
    }
    assert_eq!(c.last_seq(&id), 3);

    // Over the limits: 413, nothing written.
    let big = "x".repeat(PAYLOAD_MAX + 10);
    let v = c
        .post(&events, &json!({"events": [{"type": "t", "payload": big}]}))
        .expect_error(413, "payload_too_large");
    assert_eq!(v["limit"], PAYLOAD_MAX, "{v}");
    let v = c
        .post(
            &events,
            &json!({"events": (0..=BATCH_MAX).map(|_| ev("t")).collect::<Vec<_>>()}),
        )
        .expect_error(413, "payload_too_large");
    assert_eq!(v["limit"], BATCH_MAX, "{v}");
    // A body over the request limit (events each small enough, count too).
    let filler = "y".repeat(BODY_MAX);
    let body = format!("{{\"events\": [{{\"type\": \"t\"}}], \"pad\": \"{filler}\"}}");
    c.post_raw(&events, body.as_bytes())
        .expect_error(413, "payload_too_large");
    c.post_raw("/api/executions", body.as_bytes())
        .expect_error(413, "payload_too_large");
    c.post(
        "/api/executions",
        &json!({"workflow": "w", "input": "z".repeat(PAYLOAD_MAX + 1)}),
    )
    .expect_error(413, "payload_too_large");
    c.post(
        &format!("/api/executions/{id}/signals"),
        &json!({"name": "s", "payload": "z".repeat(PAYLOAD_MAX + 1)}),
    )
    .expect_error(413, "payload_too_large");
    c.post(
        &format!("/api/executions/{id}/cancel"),
        &json!({"reason": "z".repeat(PAYLOAD_MAX + 1)}),
    )
    .expect_error(413, "payload_too_large");
    // At the limits it is fine.
    let exact = "q".repeat(PAYLOAD_MAX - 2); // a JSON string: two quotes
    c.post(
        &events,
        &json!({"events": [{"type": "t", "payload": exact}]}),
    )
    .expect(200);
    c.post(
        &events,
        &json!({"events": (0..BATCH_MAX).map(|_| ev("t")).collect::<Vec<_>>()}),
    )
    .expect(200);
    assert_eq!(c.last_seq(&id), 3 + 1 + BATCH_MAX as u64);
    let seq = c.last_seq(&id);

    // Unknown execution: 404 on every id-scoped endpoint.
    let missing = "12345";
    for r in [
        c.get(&format!("/api/executions/{missing}")),
        c.get(&format!("/api/executions/{missing}/events")),
        c.get(&format!("/api/executions/{missing}/events?wait_ms=50")),
        c.post(
            &format!("/api/executions/{missing}/events"),
            &json!({"events": [ev("t")]}),
        ),
        c.post(
            "/api/events",
            &json!({"execution_id": missing, "events": [ev("t")]}),
        ),
        c.post(
            &format!("/api/executions/{missing}/signals"),
            &json!({"name": "s"}),
        ),
        c.post(&format!("/api/executions/{missing}/cancel"), &json!({})),
    ] {
        r.expect_error(404, "execution_not_found");
    }
    c.get(&format!("/api/executions/{missing}"))
        .expect_error(404, "execution_not_found");

    // Append after execution.completed: 409 execution_closed, nothing written.
    let done = c.post(
        &events,
        &json!({"events": [ev("x"), ev("execution.completed")]}),
    );
    done.expect(200);
    assert_eq!(done.json()["last_seq"], seq + 2);
    let g = c.get(&format!("/api/executions/{id}")).json();
    assert_eq!(g["status"], "completed");
    for r in [
        c.post(&events, &json!({"events": [ev("late")]})),
        c.post(
            "/api/events",
            &json!({"execution_id": id, "events": [ev("late")]}),
        ),
        c.post(
            &format!("/api/executions/{id}/signals"),
            &json!({"name": "s"}),
        ),
        c.post(&format!("/api/executions/{id}/cancel"), &json!({})),
    ] {
        let v = r.expect_error(409, "execution_closed");
        assert_eq!(v["status"], "completed", "{v}");
        assert_eq!(v["last_seq"], seq + 2, "{v}");
    }
    assert_eq!(c.last_seq(&id), seq + 2);

    // Unknown routes and methods.
    c.get("/api/nothing").expect_error(404, "not_found");
    c.req("DELETE", &format!("/api/executions/{id}"), &[], None)
        .expect_error(405, "method_not_allowed");
}

#[test]
fn idempotent_starts_and_appends() {
    let _d = deadline("idempotent_starts_and_appends", TEST_DEADLINE);
    let dir = tempfile::tempdir().unwrap();
    let n = node(&dir);
    let c = n.client;

    // Same routing key + idempotency key: 201, then 200 with the same id.
    let body = json!({"workflow": "w", "routing_key": "tenant-b/x", "idempotency_key": "start-1"});
    let r1 = c.post("/api/executions", &body);
    r1.expect(201);
    let id = id_of(&r1.json());
    for _ in 0..3 {
        let r2 = c.post("/api/executions", &body);
        r2.expect(200);
        let v = r2.json();
        assert_eq!(id_of(&v), id);
        assert_eq!(v["existing"], true);
        assert_eq!(v["last_seq"], 1);
    }
    // Another idempotency key under the same routing key: a new execution.
    let other = c.start(
        &json!({"workflow": "w", "routing_key": "tenant-b/x", "idempotency_key": "start-2"}),
    );
    assert_ne!(id_of(&other), id);
    let keyed = c.get("/api/keys/tenant-b/x").json();
    assert_eq!(keyed["executions"].as_array().unwrap().len(), 2);
    // An idempotency key alone also dedups.
    let a = c.start(&json!({"workflow": "w", "idempotency_key": "solo"}));
    let b = c.post(
        "/api/executions",
        &json!({"workflow": "w", "idempotency_key": "solo"}),
    );
    b.expect(200);
    assert_eq!(id_of(&b.json()), id_of(&a));

    // Idempotent append retry: same seqs, deduplicated, nothing new.
    let events = format!("/api/executions/{id}/events");
    let batch = json!({"events": [
        {"type": "t", "payload": 1, "idempotency_key": "e1"},
        {"type": "t", "payload": 2, "idempotency_key": "e2"}
    ]});
    let first = c.post(&events, &batch);
    first.expect(200);
    let fv = first.json();
    assert_eq!(
        (fv["first_seq"].as_u64(), fv["last_seq"].as_u64()),
        (Some(2), Some(3))
    );
    assert_eq!(fv["deduplicated"], false);
    c.post(&events, &json!({"events": [ev("u")]})).expect(200);
    for _ in 0..2 {
        let again = c.post(&events, &batch);
        again.expect(200);
        let v = again.json();
        assert_eq!(
            (v["first_seq"].as_u64(), v["last_seq"].as_u64()),
            (Some(2), Some(3)),
            "{v}"
        );
        assert_eq!(v["deduplicated"], true);
        // Via the body-id endpoint as well.
        let v = c
            .post(
                "/api/events",
                &json!({"execution_id": id, "events": batch["events"]}),
            )
            .json();
        assert_eq!(
            (v["first_seq"].as_u64(), v["last_seq"].as_u64()),
            (Some(2), Some(3)),
            "{v}"
        );
    }
    assert_eq!(c.last_seq(&id), 4);
    // A batch mixing a used key with a new one is refused, nothing written.
    c.post(
        &events,
        &json!({"events": [
            {"type": "t", "idempotency_key": "e1"},
            {"type": "t", "idempotency_key": "e3"}
        ]}),
    )
    .expect_error(409, "idempotency_conflict");
    assert_eq!(c.last_seq(&id), 4);
    // A used key with another event (payload, or type) is a conflict that
    // names the key, not a deduplicated answer.
    for changed in [
        json!({"events": [{"type": "t", "payload": 9, "idempotency_key": "e1"}]}),
        json!({"events": [{"type": "other", "payload": 1, "idempotency_key": "e1"}]}),
    ] {
        let v = c
            .post(&events, &changed)
            .expect_error(409, "idempotency_conflict");
        assert_eq!(v["idempotency_key"], "e1", "{v}");
        assert!(
            v["message"].as_str().unwrap().contains("different event"),
            "{v}"
        );
    }
    // A used key next to an event without one: the answer says what to do.
    let v = c
        .post(
            &events,
            &json!({"events": [{"type": "t", "payload": 1, "idempotency_key": "e1"}, {"type": "t"}]}),
        )
        .expect_error(409, "idempotency_conflict");
    assert!(
        v["message"].as_str().unwrap().contains("give every event"),
        "{v}"
    );
    assert_eq!(c.last_seq(&id), 4);
    // Signal with an idempotency key.
    let s1 = c
        .post(
            &format!("/api/executions/{id}/signals"),
            &json!({"name": "s", "idempotency_key": "sig-1"}),
        )
        .json();
    let s2 = c
        .post(
            &format!("/api/executions/{id}/signals"),
            &json!({"name": "s", "idempotency_key": "sig-1"}),
        )
        .json();
    assert_eq!(s1["seq"], 5);
    assert_eq!(s2["seq"], 5);
    assert_eq!(s2["deduplicated"], true);
    assert_eq!(c.last_seq(&id), 5);
}

#[test]
fn long_poll_returns_early_and_times_out_empty() {
    let _d = deadline("long_poll_returns_early_and_times_out_empty", TEST_DEADLINE);
    let dir = tempfile::tempdir().unwrap();
    let n = node(&dir);
    let c = n.client;
    let id = id_of(&c.start(&json!({"workflow": "w"})));

    // Nothing after seq 1: an empty answer at the timeout, not before.
    let t = Instant::now();
    let r = c.get(&format!("/api/executions/{id}/events?after=1&wait_ms=400"));
    let took = t.elapsed();
    r.expect(200);
    assert_eq!(r.json()["events"], json!([]));
    assert!(
        took >= Duration::from_millis(380),
        "returned after {took:?}"
    );
    assert!(
        took < Duration::from_millis(3000),
        "returned after {took:?}"
    );

    // An event lands during a 20 s wait: the poll returns with it, early.
    let pid = id.clone();
    let poller = std::thread::spawn(move || {
        let t = Instant::now();
        let r = c.get(&format!(
            "/api/executions/{pid}/events?after=1&wait_ms=20000"
        ));
        (r, t.elapsed())
    });
    // Let the poll get going (it must not matter whether it has: the event
    // is after seq 1 either way).
    std::thread::sleep(Duration::from_millis(200));
    let appended_at = Instant::now();
    c.post(
        &format!("/api/executions/{id}/events"),
        &json!({"events": [ev("wake")]}),
    )
    .expect(200);
    let (r, took) = poller.join().unwrap();
    r.expect(200);
    let v = r.json();
    assert_eq!(v["events"][0]["type"], "wake", "{v}");
    assert_eq!(v["events"][0]["seq"], 2);
    assert!(
        took < Duration::from_secs(5),
        "long-poll took {took:?}: it did not return early"
    );
    assert!(appended_at.elapsed() < Duration::from_secs(5));

    // A terminal execution answers a long-poll at once.
    c.post(&format!("/api/executions/{id}/cancel"), &json!({}))
        .expect(200);
    let t = Instant::now();
    let r = c.get(&format!(
        "/api/executions/{id}/events?after=3&wait_ms=10000"
    ));
    r.expect(200);
    assert!(t.elapsed() < Duration::from_secs(3), "{:?}", t.elapsed());
    assert_eq!(r.json()["status"], "cancelled");

    // Over the maximum wait: 400.
    c.get(&format!("/api/executions/{id}/events?wait_ms=30001"))
        .expect_error(400, "invalid_request");
    c.get(&format!(
        "/api/executions/{id}/events?wait_ms=30000&after=0"
    ))
    .expect(200);
}

#[test]
fn forged_hop_header_is_refused() {
    let _d = deadline("forged_hop_header_is_refused", TEST_DEADLINE);
    let dir = tempfile::tempdir().unwrap();
    let n = node(&dir);
    let c = n.client;
    let id = id_of(&c.start(&json!({"workflow": "w"})));
    let forged: &[(&str, &str)] = &[("x-forkless-hops", "1")];
    let ev_body = json!({"events": [ev("t")]}).to_string();
    let reqs: Vec<(&str, String, Option<String>)> = vec![
        (
            "POST",
            "/api/executions".into(),
            Some(json!({"workflow": "w"}).to_string()),
        ),
        ("GET", format!("/api/executions/{id}"), None),
        ("GET", format!("/api/executions/{id}/events"), None),
        (
            "POST",
            format!("/api/executions/{id}/events"),
            Some(ev_body.clone()),
        ),
        (
            "POST",
            "/api/events".into(),
            Some(json!({"execution_id": id, "events": [ev("t")]}).to_string()),
        ),
        (
            "POST",
            format!("/api/executions/{id}/signals"),
            Some(json!({"name": "s"}).to_string()),
        ),
        (
            "POST",
            format!("/api/executions/{id}/cancel"),
            Some("{}".into()),
        ),
        ("GET", "/api/keys/some/key".into(), None),
    ];
    for (m, p, b) in &reqs {
        for hops in ["0", "1", "5"] {
            let r = c.req(
                m,
                p,
                &[("x-forkless-hops", hops)],
                b.as_deref().map(str::as_bytes),
            );
            r.expect_error(403, "forbidden");
        }
        // A wrong peer token does not help.
        let r = c.req(
            m,
            p,
            &[forged[0], ("x-forkless-peer-token", "not-the-secret-0000")],
            b.as_deref().map(str::as_bytes),
        );
        r.expect_error(403, "forbidden");
    }
    assert_eq!(c.last_seq(&id), 1, "a refused request wrote");
    assert!(c.metric("forkless_route_total{outcome=\"refused_hop_header\"}") >= 32.0);
    // Peer status needs credentials too.
    c.get("/internal/v1/status").expect(403);
}

#[test]
fn shard_count_is_checked_at_startup_and_by_route() {
    let _d = deadline(
        "shard_count_is_checked_at_startup_and_by_route",
        TEST_DEADLINE,
    );
    let dir = tempfile::tempdir().unwrap();
    let data = dir.path().join("data");
    let mut n = Node::start_single(&data, &["--shard-count", "4"]);
    let id = id_of(&n.client.start(&json!({"workflow": "w"})));
    n.kill9();

    // Reopening with another shard count refuses to start, saying why.
    let port = free_ports(1)[0].to_string();
    let listen = format!("127.0.0.1:{port}");
    let d = data.display().to_string();
    let (code, _out, err) = run_cli(
        &[
            "serve",
            "--listen",
            &listen,
            "--data-dir",
            &d,
            "--shard-count",
            "8",
        ],
        Duration::from_secs(20),
    );
    assert_ne!(
        code,
        Some(0),
        "started on a data dir written with another shard count"
    );
    assert!(code.is_some());
    assert!(err.contains("shard count"), "stderr: {err}");
    assert!(err.contains('4') && err.contains('8'), "stderr: {err}");

    // An illegal count: refused, naming the legal ones.
    let (code, _out, err) = run_cli(
        &[
            "serve",
            "--listen",
            &listen,
            "--data-dir",
            &d,
            "--shard-count",
            "3",
        ],
        Duration::from_secs(20),
    );
    assert_ne!(code, Some(0));
    assert!(err.contains("power of two"), "stderr: {err}");
    assert!(
        err.contains("4096") && err.contains("1, 2, 4, 8"),
        "stderr: {err}"
    );

    // The original count still works, and the data is there.
    n.restart();
    assert_eq!(n.client.last_seq(&id), 1);
    drop(n);

    // `forkless route`.
    let (code, out, err) = run_cli(
        &["route", "42", "--shard-count", "16"],
        Duration::from_secs(20),
    );
    assert_eq!(code, Some(0), "stderr: {err}");
    let v: Value = serde_json::from_str(out.trim()).expect("route prints JSON");
    let p = forkless_sharding::partition_for(42);
    assert_eq!(v["partition"], p);
    assert_eq!(v["shard"], p % 16);
    assert_eq!(v["shard_count"], 16);
    assert_eq!(v["execution_id"], "42");
    let (code, out, _) = run_cli(
        &["route", "--key", "tenant-a/order-1", "--shard-count", "8"],
        Duration::from_secs(20),
    );
    assert_eq!(code, Some(0));
    let v: Value = serde_json::from_str(out.trim()).unwrap();
    assert_eq!(v["shard"], shard_of_key("tenant-a/order-1", 8));
    assert_eq!(
        v["partition"],
        forkless_sharding::partition_for_key("tenant-a/order-1")
    );
    for bad in [
        vec!["route", "42", "--shard-count", "12"],
        vec!["route", "42", "--shard-count", "0"],
        vec!["route", "42", "--shard-count", "8192"],
        vec!["route", "0", "--shard-count", "16"],
        vec!["route", "abc"],
    ] {
        let (code, out, err) = run_cli(&bad, Duration::from_secs(20));
        assert_ne!(code, Some(0), "{bad:?} succeeded: {out}");
        assert!(!err.trim().is_empty(), "{bad:?}: no message");
    }
    let (_, _, err) = run_cli(
        &["route", "42", "--shard-count", "12"],
        Duration::from_secs(20),
    );
    assert!(err.contains("power of two"), "{err}");
}

#[test]
fn restart_keeps_everything() {
    let _d = deadline("restart_keeps_everything", TEST_DEADLINE);
    let dir = tempfile::tempdir().unwrap();
    let mut n = node(&dir);
    let c = n.client;
    let id =
        id_of(&c.start(&json!({"workflow": "w", "routing_key": "r/1", "idempotency_key": "i"})));
    c.post(
        &format!("/api/executions/{id}/events"),
        &json!({"events": [{"type": "t", "idempotency_key": "e"}]}),
    )
    .expect(200);
    n.restart();
    let c = n.client;
    assert_eq!(c.last_seq(&id), 2);
    // The indexes survive: key lookup, start and append idempotency.
    let again = c.post(
        "/api/executions",
        &json!({"workflow": "w", "routing_key": "r/1", "idempotency_key": "i"}),
    );
    again.expect(200);
    assert_eq!(id_of(&again.json()), id);
    let v = c
        .post(
            &format!("/api/executions/{id}/events"),
            &json!({"events": [{"type": "t", "idempotency_key": "e"}]}),
        )
        .json();
    assert_eq!(v["deduplicated"], true);
    assert_eq!(v["last_seq"], 2);
    assert_eq!(id_of(&c.get("/api/keys/r/1").json()["executions"][0]), id);
    // A fresh start after restart gets a new, distinct id.
    let id2 = id_of(&c.start(&json!({"workflow": "w"})));
    assert_ne!(id2, id);
}

#[test]
fn sigterm_stops_promptly_and_keeps_the_data() {
    let _d = deadline("sigterm_stops_promptly_and_keeps_the_data", TEST_DEADLINE);
    let dir = tempfile::tempdir().unwrap();
    let mut n = Node::start_single(&dir.path().join("data"), &[]);
    let c = n.client;
    let id = id_of(&c.start(&json!({"workflow": "w"})));
    // A plain SIGTERM: exits 0, and the data is there after a restart.
    n.sigterm_expect_prompt_exit("");
    n.restart();
    assert_eq!(n.client.last_seq(&id), 1);
}

/// Regression: SIGHUP (a service manager's `reload`) ended a node that
/// had nothing to read again (no cluster file), and any node still
/// starting: the handler was installed only on a cluster node with a
/// file, once it served. Now every node takes it from its first moment;
/// here it is a refused reload, logged and counted, and the node serves on.
#[test]
fn sighup_does_not_end_a_node_with_nothing_to_reload() {
    let _d = deadline(
        "sighup_does_not_end_a_node_with_nothing_to_reload",
        TEST_DEADLINE,
    );
    let dir = tempfile::tempdir().unwrap();
    let mut n = Node::start_single(&dir.path().join("data"), &[]);
    let id = id_of(&n.client.start(&json!({"workflow": "w"})));
    let p = n.proc.as_mut().expect("running");
    p.sighup();
    let outcome = wait_until("the SIGHUP's outcome", Duration::from_secs(10), || {
        if let Some(status) = p.try_exit() {
            return Some(Err(status));
        }
        p.log()
            .contains("SIGHUP: reload refused, nothing changed")
            .then_some(Ok(()))
    });
    assert_eq!(outcome, Ok(()), "the node exited on SIGHUP");
    assert_eq!(
        n.client
            .metric("forkless_cluster_reloads_total{outcome=\"refused\"}"),
        1.0
    );
    n.client
        .post(
            &format!("/api/executions/{id}/events"),
            &json!({"events": [ev("after")]}),
        )
        .expect(200);
    assert_eq!(n.client.last_seq(&id), 2);
    n.sigterm_expect_prompt_exit(" after a SIGHUP");
}

/// Regression: graceful shutdown used to wait for every long-poll in
/// flight, so a node with a client polling with `wait_ms=30000` took up to
/// 30 s to stop after SIGTERM.
#[test]
fn sigterm_stops_promptly_with_a_long_poll_in_flight() {
    let _d = deadline("sigterm_stops_promptly_with_a_long_poll", TEST_DEADLINE);
    let dir = tempfile::tempdir().unwrap();
    let mut n = Node::start_single(&dir.path().join("data"), &[]);
    let c = n.client;
    let id = id_of(&c.start(&json!({"workflow": "w"})));
    // With a client long-polling for 6 s: the node should still stop
    // promptly (answering the poll with what it has, or closing it).
    let poll = std::thread::spawn(move || {
        c.try_req(
            "GET",
            &format!("/api/executions/{id}/events?after=1&wait_ms=6000"),
            &[],
            None,
            Duration::from_secs(15),
        )
    });
    // Give the poll time to reach the handler (nothing observable says so).
    std::thread::sleep(Duration::from_millis(300));
    let t = Instant::now();
    let p = n.proc.as_mut().unwrap();
    p.sigterm();
    let status = p.wait_exit(Duration::from_secs(15));
    let took = t.elapsed();
    let _ = poll.join();
    assert!(status.is_some(), "no exit within 15 s of SIGTERM");
    assert!(
        took < Duration::from_secs(3),
        "SIGTERM took {took:?} to stop a node with one long-poll in flight (it waited for the poll)"
    );
}

#[test]
fn a_second_node_on_the_same_data_dir_refuses_to_start() {
    let _d = deadline("a_second_node_on_the_same_data_dir", TEST_DEADLINE);
    let dir = tempfile::tempdir().unwrap();
    let data = dir.path().join("data");
    let n = Node::start_single(&data, &[]);
    let id = id_of(&n.client.start(&json!({"workflow": "w"})));
    let listen = format!("127.0.0.1:{}", free_ports(1)[0]);
    let d = data.display().to_string();
    let (code, _, err) = run_cli(
        &["serve", "--listen", &listen, "--data-dir", &d],
        Duration::from_secs(20),
    );
    assert_ne!(code, Some(0), "a second process opened a data dir in use");
    assert!(code.is_some());
    assert!(
        err.to_lowercase().contains("in use by another process"),
        "stderr: {err}"
    );
    // The first node is unharmed.
    assert_eq!(n.client.last_seq(&id), 1);
    n.client
        .post(
            &format!("/api/executions/{id}/events"),
            &json!({"events": [ev("t")]}),
        )
        .expect(200);
}

/// (thread name, nice) of every thread of process `pid`.
#[cfg(target_os = "linux")]
fn thread_nices(pid: u32) -> Vec<(String, i64)> {
    std::fs::read_dir(format!("/proc/{pid}/task"))
        .expect("the node's /proc entry")
        .flatten()
        .filter_map(|t| {
            let stat = std::fs::read_to_string(t.path().join("stat")).ok()?;
            let comm = std::fs::read_to_string(t.path().join("comm")).ok()?;
            // After the parenthesised name, nice is the 17th field.
            let rest = &stat[stat.rfind(')')? + 2..];
            Some((
                comm.trim().to_string(),
                rest.split(' ').nth(16)?.parse().ok()?,
            ))
        })
        .collect()
}

/// The storage engine's background threads run `--background-nice` (or
/// `[store] background_nice`) steps below the rest of the node, and the
/// shard writer `--writer-priority` (`[store] writer_priority`) steps above
/// it when the process may raise a thread (root or CAP_SYS_NICE; else at
/// the node's nice); the rest stays at the nice it was started with. A
/// value out of range is refused at startup, naming the setting.
#[cfg(target_os = "linux")]
#[test]
fn the_storage_engines_threads_run_at_the_configured_nice() {
    let _d = deadline(
        "the_storage_engines_threads_run_at_the_configured_nice",
        TEST_DEADLINE,
    );
    let dir = tempfile::tempdir().unwrap();
    // SAFETY: getpriority only reads this process's nice.
    let own = unsafe { libc::getpriority(libc::PRIO_PROCESS, 0) } as i64;
    // Whether a thread here may raise itself (the node inherits it).
    let may_raise = std::thread::spawn(move || {
        // SAFETY: plain integer arguments; `who` 0 is this thread.
        own > -20 && unsafe { libc::setpriority(libc::PRIO_PROCESS, 0, own as i32 - 1) } == 0
    })
    .join()
    .unwrap();
    let check = |n: &Node, below: i64, above: i64| {
        let pid = n.proc.as_ref().expect("running").pid();
        // A new thread names itself once it runs: wait (bounded) for the
        // storage engine's worker and the shard writer to carry their
        // names.
        let deadline = Instant::now() + Duration::from_secs(10);
        let threads = loop {
            let threads = thread_nices(pid);
            if threads.iter().any(|(name, _)| name.starts_with("fjall"))
                && threads.iter().any(|(name, _)| name == "shard-0-writer")
            {
                break threads;
            }
            assert!(
                Instant::now() < deadline,
                "no storage engine or writer threads in {threads:?}"
            );
            std::thread::yield_now();
        };
        let (fjall, rest): (Vec<_>, Vec<_>) = threads
            .iter()
            .partition(|(name, _)| name.starts_with("fjall"));
        assert!(
            fjall.iter().all(|(_, nice)| *nice == (own + below).min(19)),
            "storage threads should be at {own} + {below}: {threads:?}"
        );
        type Threads<'a> = Vec<&'a (String, i64)>;
        // The shard's writer and the node log's syncer, which every
        // acknowledged write may wait for as well.
        let raised = |name: &str| name == "shard-0-writer" || name == "node-log-syncer";
        let (writers, rest): (Threads, Threads) =
            rest.into_iter().partition(|(name, _)| raised(name));
        let writer_at = if may_raise {
            (own - above).max(-20)
        } else {
            own
        };
        // The writer raises itself as its thread starts, which may come
        // after the snapshot above: wait (bounded) for it.
        let deadline = Instant::now() + Duration::from_secs(10);
        while thread_nices(pid)
            .iter()
            .filter(|(name, nice)| raised(name) && *nice == writer_at)
            .count()
            < 2
        {
            assert!(
                Instant::now() < deadline,
                "the writer and the syncer should be at {writer_at}: {writers:?} (may raise: {may_raise})"
            );
            std::thread::yield_now();
        }
        assert!(
            rest.iter()
                .filter(|(name, _)| name != "shard-open")
                .all(|(_, nice)| *nice == own),
            "every other thread should be at {own}: {threads:?}"
        );
    };
    let n = Node::start_single(
        &dir.path().join("flag"),
        &["--background-nice", "3", "--writer-priority", "2"],
    );
    check(&n, 3, 2);
    drop(n);
    let file = dir.path().join("store.toml");
    std::fs::write(&file, "[store]\nbackground_nice = 0\nwriter_priority = 0\n").unwrap();
    let n = Node::start_single(
        &dir.path().join("file"),
        &["--config", &file.display().to_string()],
    );
    check(&n, 0, 0);
    drop(n);
    // The defaults: 10 below, 5 above.
    let n = Node::start_single(&dir.path().join("defaults"), &[]);
    check(&n, 10, 5);
    drop(n);

    let listen = format!("127.0.0.1:{}", free_ports(1)[0]);
    let d = dir.path().join("bad").display().to_string();
    for (flag, value, message) in [
        (
            "--background-nice",
            "20",
            "store.background_nice must be 0 to 19",
        ),
        (
            "--writer-priority",
            "21",
            "store.writer_priority must be 0 to 20",
        ),
    ] {
        let (code, _, err) = run_cli(
            &["serve", "--listen", &listen, "--data-dir", &d, flag, value],
            Duration::from_secs(20),
        );
        assert!(
            code.is_some() && code != Some(0),
            "started with {flag} {value}: {err}"
        );
        assert!(err.contains(message), "stderr: {err}");
        assert!(
            !dir.path().join("bad").exists(),
            "a refused start wrote its data dir"
        );
    }
}
