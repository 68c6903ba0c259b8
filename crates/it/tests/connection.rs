//! The node's own HTTP/1.1 connection handling (crates/server/src/conn.rs),
//! over raw sockets: kept-alive and pipelined requests answered in order,
//! requests split at every byte, bad appends refused with nothing written,
//! and every request shape it leaves to hyper answered on the same
//! connection, before and after the hand-over.

use forkless_it::*;
use serde_json::Value;
use std::time::{Duration, Instant};

const BODY_MAX: usize = 16 * 1024;

fn node(dir: &tempfile::TempDir) -> Node {
    Node::start_single(
        &dir.path().join("data"),
        &[
            "--request-body-bytes-max",
            &BODY_MAX.to_string(),
            "--event-payload-bytes-max",
            "1024",
        ],
    )
}

fn start(c: &Client) -> String {
    let v = c.start(&json!({"workflow": "w"}));
    v["execution_id"]
        .as_str()
        .unwrap_or_else(|| panic!("no execution_id in {v}"))
        .to_string()
}

fn step(n: u64) -> String {
    json!({"events": [{"type": "step", "payload": {"n": n}}]}).to_string()
}

fn post(path: &str, body: &str, extra_headers: &str) -> Vec<u8> {
    format!(
        "POST {path} HTTP/1.1\r\nHost: t\r\nContent-Type: application/json\r\n{extra_headers}Content-Length: {}\r\n\r\n{body}",
        body.len()
    )
    .into_bytes()
}

fn append(id: &str, body: &str) -> Vec<u8> {
    post(&format!("/api/executions/{id}/events"), body, "")
}

fn get(path: &str) -> Vec<u8> {
    format!("GET {path} HTTP/1.1\r\nHost: t\r\n\r\n").into_bytes()
}

fn first_seq(r: &Resp) -> u64 {
    r.expect(200);
    r.json()["first_seq"]
        .as_u64()
        .unwrap_or_else(|| panic!("no first_seq in {}", r.text()))
}

/// The log is exactly seqs 1..=n.
fn assert_log(c: &Client, id: &str, n: u64) {
    let seqs: Vec<u64> = c
        .events(id)
        .iter()
        .map(|e| e["seq"].as_u64().unwrap_or(0))
        .collect();
    assert_eq!(seqs, (1..=n).collect::<Vec<_>>(), "the log of {id}");
}

#[test]
fn pipelined_requests_on_one_connection_are_answered_in_order() {
    let _d = deadline("pipelined_requests_in_order", TEST_DEADLINE);
    let dir = tempfile::tempdir().unwrap();
    let n = node(&dir);
    let id = start(&n.client);
    let mut conn = RawConn::open(n.client.addr);
    // Five requests in one write: appends, a read between them, a probe.
    let mut all = Vec::new();
    all.extend(append(&id, &step(1)));
    all.extend(append(&id, &step(2)));
    all.extend(get(&format!("/api/executions/{id}")));
    all.extend(append(&id, &step(3)));
    all.extend(get("/healthz"));
    conn.send(&all);
    let a1 = conn.read();
    let a2 = conn.read();
    let status = conn.read();
    let a3 = conn.read();
    let health = conn.read();
    assert_eq!([first_seq(&a1), first_seq(&a2), first_seq(&a3)], [2, 3, 4]);
    // The read came after the second append and before the third.
    status.expect(200);
    assert_eq!(status.json()["last_seq"], 3, "{}", status.text());
    health.expect(200);
    assert_eq!(health.json()["status"], "ok");
    for r in [&a1, &a2, &a3] {
        assert_eq!(r.header("content-type"), Some("application/json"));
        // The default single node is node 0, and owns every shard.
        assert_eq!(r.header("x-forkless-node"), Some("0"));
        assert_eq!(r.header("x-forkless-hops"), Some("0"));
        assert_eq!(r.header("x-forkless-owner"), Some("0"));
        for h in [
            "x-forkless-partition",
            "x-forkless-shard",
            "x-forkless-epoch",
            "x-forkless-map-version",
            "date",
        ] {
            assert!(r.header(h).is_some(), "no {h} on {:?}", r.headers);
        }
        assert_eq!(
            r.header_u64("content-length"),
            Some(r.body.len() as u64),
            "{:?}",
            r.headers
        );
    }
    // Still open and usable.
    conn.send(&append(&id, &step(4)));
    assert_eq!(first_seq(&conn.read()), 5);
    assert_log(&n.client, &id, 5);
}

#[test]
fn a_request_split_at_every_byte_is_answered() {
    let _d = deadline("split_at_every_byte", TEST_DEADLINE);
    let dir = tempfile::tempdir().unwrap();
    let n = node(&dir);
    let id = start(&n.client);
    let mut conn = RawConn::open(n.client.addr);
    for (i, req) in [append(&id, &step(1)), get(&format!("/api/executions/{id}"))]
        .iter()
        .enumerate()
    {
        for b in req {
            conn.send(std::slice::from_ref(b));
        }
        let r = conn.read();
        r.expect(200);
        if i == 0 {
            assert_eq!(first_seq(&r), 2);
        } else {
            assert_eq!(r.json()["last_seq"], 2);
        }
    }
}

#[test]
fn shapes_left_to_hyper_are_answered_on_the_same_connection() {
    let _d = deadline("shapes_left_to_hyper", TEST_DEADLINE);
    let dir = tempfile::tempdir().unwrap();
    let n = node(&dir);
    let c = n.client;
    let id = start(&c);
    let path = format!("/api/executions/{id}/events");

    // A chunked body hands the connection over; appends before and after it
    // on the same connection are answered, in order.
    let mut conn = RawConn::open(c.addr);
    let body = step(2);
    let mut all = append(&id, &step(1));
    all.extend(chunked(&path, &body, true).into_bytes());
    all.extend(append(&id, &step(3)));
    conn.send(&all);
    assert_eq!(first_seq(&conn.read()), 2);
    assert_eq!(first_seq(&conn.read()), 3);
    assert_eq!(first_seq(&conn.read()), 4);
    conn.send(&get("/healthz"));
    conn.read().expect(200);

    // Expect: 100-continue: the interim answer, then the body, then 200.
    let mut conn = RawConn::open(c.addr);
    let body = step(4);
    conn.send(
        format!(
            "POST {path} HTTP/1.1\r\nHost: t\r\nContent-Type: application/json\r\nExpect: 100-continue\r\nContent-Length: {}\r\n\r\n",
            body.len()
        )
        .as_bytes(),
    );
    conn.read().expect(100);
    conn.send(body.as_bytes());
    assert_eq!(first_seq(&conn.read()), 5);

    // HTTP/1.0.
    let mut conn = RawConn::open(c.addr);
    conn.send(b"GET /healthz HTTP/1.0\r\n\r\n");
    conn.read().expect(200);

    // Connection: close is honoured after the answer.
    let mut conn = RawConn::open(c.addr);
    conn.send(&post(&path, &step(5), "Connection: close\r\n"));
    assert_eq!(first_seq(&conn.read()), 6);
    assert!(conn.closed_by_node(), "still open after Connection: close");

    // A head past the fast path's 16 KiB is hyper's: served while it fits
    // hyper's buffer (64 KiB, give or take its last read; the buffer also
    // bounds how far hyper reads a body ahead of the body budget's count),
    // 431 well past it (hyper's default buffer, about 400 KiB, took it).
    for (pad, status) in [(20_000, 200), (200_000, 431)] {
        let mut conn = RawConn::open(c.addr);
        conn.send(
            format!(
                "GET /healthz HTTP/1.1\r\nHost: t\r\nX-Pad: {}\r\n\r\n",
                "p".repeat(pad)
            )
            .as_bytes(),
        );
        conn.read().expect(status);
    }

    // Malformed heads are refused with 400 and write nothing.
    for bad in [
        format!(
            "POST {path} HTTP/1.1\r\nHost: t\r\nContent-Length: 2\r\nContent-Length: 3\r\n\r\n{{}}"
        ),
        "GARBAGE\r\n\r\n".to_string(),
        format!("POST {path} HTTP/1.1\r\nHost: t\r\nContent-Length: x\r\n\r\n"),
    ] {
        let mut conn = RawConn::open(c.addr);
        conn.send(bad.as_bytes());
        conn.read().expect(400);
    }
    assert_log(&c, &id, 6);
}

#[test]
fn bad_appends_on_a_kept_alive_connection_name_the_field_and_write_nothing() {
    let _d = deadline("bad_appends_kept_alive", TEST_DEADLINE);
    let dir = tempfile::tempdir().unwrap();
    let n = node(&dir);
    let c = n.client;
    let id = start(&c);
    let mut conn = RawConn::open(c.addr);
    let mut read = |req: Vec<u8>| -> Resp {
        conn.send(&req);
        conn.read()
    };

    let v = read(append(&id, "{not json")).expect_error(400, "invalid_request");
    assert!(v["message"].is_string(), "{v}");
    let v = read(append(
        &id,
        r#"{"events":[{"type":"a","payload":{},"typo":1}]}"#,
    ))
    .expect_error(400, "invalid_request");
    assert_eq!(v["field"], "events[0].typo", "{v}");
    let v = read(append(&id, "")).expect_error(400, "invalid_request");
    assert_eq!(v["field"], "body", "{v}");
    let big = format!(
        r#"{{"events":[{{"type":"a","payload":"{}"}}]}}"#,
        "x".repeat(BODY_MAX)
    );
    read(append(&id, &big)).expect_error(413, "payload_too_large");

    // Refused by the store: the route headers are there as on a success.
    let r = read(append(
        &id,
        r#"{"events":[{"type":"a","payload":{}}],"expected_last_seq":7}"#,
    ));
    r.expect_error(409, "sequence_conflict");
    assert_eq!(r.header("x-forkless-hops"), Some("0"), "{:?}", r.headers);
    assert_eq!(r.header("x-forkless-node"), Some("0"), "{:?}", r.headers);
    let missing = "123456789";
    let r = read(append(missing, &step(1)));
    r.expect_error(404, "execution_not_found");
    assert!(r.header("x-forkless-shard").is_some(), "{:?}", r.headers);

    // The connection still serves, and nothing was written by any of them.
    assert_eq!(first_seq(&read(append(&id, &step(1)))), 2);
    assert_log(&c, &id, 2);
}

#[test]
fn the_direct_append_answer_has_the_general_paths_headers() {
    let _d = deadline("direct_answer_headers", TEST_DEADLINE);
    let dir = tempfile::tempdir().unwrap();
    let n = node(&dir);
    let c = n.client;
    let id = start(&c);
    let mut conn = RawConn::open(c.addr);
    conn.send(&append(&id, &step(1)));
    let direct = conn.read();
    // The same append by body id goes through the router and axum.
    let body = json!({"execution_id": id, "events": [{"type": "step", "payload": {}}]});
    conn.send(&post("/api/events", &body.to_string(), ""));
    let general = conn.read();
    direct.expect(200);
    general.expect(200);
    let names = |r: &Resp| {
        let mut v: Vec<String> = r.headers.iter().map(|(k, _)| k.clone()).collect();
        v.sort();
        v
    };
    assert_eq!(names(&direct), names(&general));
    for (k, v) in &general.headers {
        if k != "date" && k != "content-length" {
            assert_eq!(direct.header(k), Some(v.as_str()), "{k}");
        }
    }
    let (d, g): (Value, Value) = (direct.json(), general.json());
    assert_eq!(d["first_seq"], 2);
    assert_eq!(g["first_seq"], 3);
    assert_eq!(d["execution_id"], g["execution_id"]);
    assert_eq!(d["deduplicated"], g["deduplicated"]);
}

#[test]
fn an_idle_kept_alive_connection_does_not_hold_up_a_stop() {
    let _d = deadline("idle_connection_and_stop", TEST_DEADLINE);
    let dir = tempfile::tempdir().unwrap();
    let mut n = node(&dir);
    let id = start(&n.client);
    let mut conn = RawConn::open(n.client.addr);
    conn.send(&append(&id, &step(1)));
    assert_eq!(first_seq(&conn.read()), 2);
    n.sigterm_expect_prompt_exit(" with an idle connection open");
    assert!(conn.closed_by_node(), "the idle connection was left open");
    n.restart();
    assert_eq!(n.client.last_seq(&id), 2);
}

#[test]
fn a_request_not_received_in_full_in_time_is_answered_408_and_closed() {
    let _d = deadline("request_read_timeout", TEST_DEADLINE);
    let dir = tempfile::tempdir().unwrap();
    let n = Node::start_single(
        &dir.path().join("data"),
        &["--request-read-timeout-ms", "300"],
    );
    let c = n.client;
    let id = start(&c);
    let path = format!("/api/executions/{id}/events");
    // A head that never ends, and a body that never arrives in full.
    let body = step(1);
    for partial in [
        format!("POST {path} HTTP/1.1\r\nHost: t\r\n"),
        format!(
            "POST {path} HTTP/1.1\r\nHost: t\r\nContent-Length: {}\r\n\r\n{}",
            body.len(),
            &body[..body.len() / 2]
        ),
        // A chunked body (left to hyper) whose last chunk never comes.
        chunked(&path, &body[..body.len() / 2], false),
    ] {
        let mut conn = RawConn::open(c.addr);
        let t = Instant::now();
        conn.send(partial.as_bytes());
        let r = conn.read();
        let v = r.expect_error(408, "request_timeout");
        assert_eq!(v["timeout_ms"], 300, "{v}");
        assert!(
            t.elapsed() >= Duration::from_millis(300),
            "{:?}",
            t.elapsed()
        );
        assert!(conn.closed_by_node(), "still open after 408");
    }
    // An idle kept-alive connection has no limit: idle longer than the
    // timeout, then a request is served.
    let mut conn = RawConn::open(c.addr);
    conn.send(&append(&id, &step(1)));
    assert_eq!(first_seq(&conn.read()), 2);
    std::thread::sleep(Duration::from_millis(700));
    conn.send(&append(&id, &step(2)));
    assert_eq!(first_seq(&conn.read()), 3);
    // Nothing of the cut-off requests was written.
    assert_log(&c, &id, 3);
}

#[test]
fn a_chunked_body_that_breaks_off_is_refused_naming_the_body() {
    let _d = deadline("chunked_body_breaks_off", TEST_DEADLINE);
    let dir = tempfile::tempdir().unwrap();
    let n = node(&dir);
    let c = n.client;
    let id = start(&c);
    let body = step(1);
    let half = &body[..body.len() / 2];
    let mut conn = RawConn::open(c.addr);
    conn.send(chunked(&format!("/api/executions/{id}/events"), half, false).as_bytes());
    // The stream ends before the last chunk: not an oversize body (413),
    // a body that could not be read.
    conn.finish_sending();
    let v = conn.read().expect_error(400, "invalid_request");
    assert_eq!(v["field"], "body", "{v}");
    assert_log(&c, &id, 1);
}

/// An append to `path` with a chunked body of one data chunk, `chunk`;
/// `last` adds the zero-length chunk that ends it (without, the body never
/// ends).
fn chunked(path: &str, chunk: &str, last: bool) -> String {
    format!(
        "POST {path} HTTP/1.1\r\nHost: t\r\nContent-Type: application/json\r\nTransfer-Encoding: chunked\r\n\r\n{:x}\r\n{chunk}\r\n{}",
        chunk.len(),
        if last { "0\r\n\r\n" } else { "" }
    )
}
