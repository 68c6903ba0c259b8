//! Bounds on what a client can hold: read pages by bytes, connections,
//! idle and stuck connections, long-poll waiters. Real `forkless`
//! processes on loopback.

use forkless_it::*;
use std::time::{Duration, Instant};

/// A page of events stops once its payloads reach the page budget (4 MiB
/// by default), with at least one event, and says where to continue
/// (`next_after`); following it reads every event exactly once.
#[test]
fn a_read_page_stops_at_its_byte_budget_and_says_where_to_continue() {
    let _d = deadline("a_read_page_stops_at_its_byte_budget", TEST_DEADLINE);
    let dir = tempfile::tempdir().expect("tempdir");
    let n = Node::start_single(&dir.path().join("data"), &[]);
    let c = n.client;
    // Six events of about 900 KB each: 5.4 MB in all, over the budget.
    let id = big_execution(&c);
    let r = c.get(&format!("/api/executions/{id}/events?limit=1000"));
    r.expect(200);
    let v = r.json();
    let events = v["events"].as_array().expect("events");
    assert_eq!(v["last_seq"], 7, "{}", &r.text()[..200]);
    assert!(
        events.len() < 7,
        "one page held all {} events ({} bytes): no byte budget",
        events.len(),
        r.body.len()
    );
    assert!(r.body.len() < 6 * 1024 * 1024, "{} bytes", r.body.len());
    let last = events.last().expect("at least one event")["seq"].clone();
    assert_eq!(v["next_after"], last, "where to continue");
    // Following next_after reads the rest, each event once.
    let mut seqs: Vec<u64> = events.iter().filter_map(|e| e["seq"].as_u64()).collect();
    let mut after = last.as_u64().expect("seq");
    loop {
        let r = c.get(&format!(
            "/api/executions/{id}/events?after={after}&limit=1000"
        ));
        r.expect(200);
        let v = r.json();
        let page = v["events"].as_array().expect("events");
        assert!(!page.is_empty(), "a page after {after} was empty: {v}");
        seqs.extend(page.iter().filter_map(|e| e["seq"].as_u64()));
        match v["next_after"].as_u64() {
            Some(next) => after = next,
            None => break,
        }
    }
    assert_eq!(seqs, (1..=7).collect::<Vec<u64>>());
}

/// Over `--connections-max`, a new connection is answered 503 (or just
/// closed) at once, the node keeps serving the connections it has, and
/// takes new ones again once one closes.
#[test]
fn connections_over_the_limit_are_refused_and_the_node_keeps_serving() {
    let _d = deadline("connections_over_the_limit_are_refused", TEST_DEADLINE);
    let dir = tempfile::tempdir().expect("tempdir");
    let n = Node::start_single(&dir.path().join("data"), &["--connections-max", "3"]);
    let c = n.client;
    // The harness's readiness checks have closed their connections; wait
    // until the node has counted them closed.
    wait_until("no connection open but the probe's", READY_TIMEOUT, || {
        (c.metric("forkless_connections_open") <= 1.0).then_some(())
    });
    let mut held = hold_connections(&c, 3);
    for _ in 0..3 {
        let t = Instant::now();
        match c.try_req("GET", "/healthz", &[], None, Duration::from_secs(5)) {
            Ok(r) => {
                let v = r.expect_error(503, "too_many_connections");
                assert_eq!(r.header("retry-after"), Some("1"));
                assert_eq!(v["limit"], 3);
            }
            // Closed before the answer could be read: refused all the same.
            Err(e) => assert!(
                matches!(
                    e.kind(),
                    std::io::ErrorKind::ConnectionReset
                        | std::io::ErrorKind::UnexpectedEof
                        | std::io::ErrorKind::BrokenPipe
                ),
                "{e}"
            ),
        }
        assert!(t.elapsed() < Duration::from_secs(3), "refused at once");
    }
    // The held connections still work.
    for h in held.iter_mut() {
        h.send(b"GET /healthz HTTP/1.1\r\nHost: x\r\n\r\n");
        h.read().expect(200);
    }
    drop(held.pop());
    wait_until("a new connection to be served again", READY_TIMEOUT, || {
        c.try_req("GET", "/healthz", &[], None, Duration::from_secs(2))
            .ok()
            .filter(|r| r.status == 200)
    });
    drop(held);
    // Read once the dropped connections are counted closed (until then a
    // new one may still be refused).
    let refused = wait_until("the metrics answered", READY_TIMEOUT, || {
        c.try_req("GET", "/metrics", &[], None, Duration::from_secs(2))
            .ok()
            .filter(|r| r.status == 200)
            .map(|r| parse_metric(&r.text(), "forkless_connections_refused_total"))
    });
    assert!(refused >= 3.0, "{refused}");
}

/// A connection limit that does not fit in the open-file limit with the
/// store's reserve is refused at start, naming the field.
#[test]
fn a_connection_limit_over_the_file_descriptor_limit_is_refused_at_start() {
    let _d = deadline("a_connection_limit_over_the_fd_limit", TEST_DEADLINE);
    let dir = tempfile::tempdir().expect("tempdir");
    let data = dir.path().join("data").display().to_string();
    let listen = format!("127.0.0.1:{}", free_ports(1)[0]);
    let (code, _out, err) = run_cli(
        &[
            "serve",
            "--listen",
            &listen,
            "--data-dir",
            &data,
            "--connections-max",
            "2000000000",
        ],
        Duration::from_secs(20),
    );
    assert!(code.is_some_and(|c| c != 0), "started: {err}");
    assert!(err.contains("limits.connections_max"), "{err}");
    assert!(err.contains("RLIMIT_NOFILE"), "{err}");
}

/// A kept-alive connection with no request for `--idle-timeout-ms` is
/// closed by the node.
#[test]
fn an_idle_kept_alive_connection_is_closed_after_the_idle_timeout() {
    let _d = deadline("an_idle_kept_alive_connection_is_closed", TEST_DEADLINE);
    let dir = tempfile::tempdir().expect("tempdir");
    let n = Node::start_single(&dir.path().join("data"), &["--idle-timeout-ms", "300"]);
    let mut conn = RawConn::open(n.client.addr);
    conn.send(b"GET /healthz HTTP/1.1\r\nHost: x\r\n\r\n");
    conn.read().expect(200);
    let t = Instant::now();
    // Blocks until the node closes (or the harness's 15 s read timeout).
    assert!(
        conn.closed_by_node(),
        "the node sent more on an idle connection"
    );
    let took = t.elapsed();
    assert!(
        took >= Duration::from_millis(250) && took < Duration::from_secs(5),
        "closed after {took:?}, want about 300 ms"
    );
    assert!(
        n.client
            .metric("forkless_connection_timeouts_total{kind=\"idle\"}")
            >= 1.0
    );
}

/// Starts nodes `ids` of `cl` on `cfg`, and waits until each is ready and
/// every node takes every other for up.
fn start(cl: &mut Cluster, cfg: &std::path::Path, ids: &[u16]) {
    for &id in ids {
        cl.spawn(id, cfg);
    }
    for &id in ids {
        cl.wait_ready(id);
    }
    cl.wait_all_alive();
}

/// `n` connections to the node, each served once. The node counts a
/// closed connection gone only once its task ends, which may be just after
/// the client saw the close, so a lingering one can make the last of the
/// `n` refused: then all are dropped and opened again, until the node has
/// room for `n`.
fn hold_connections(c: &Client, n: usize) -> Vec<RawConn> {
    wait_until(&format!("{n} connections held"), READY_TIMEOUT, || {
        let mut held: Vec<RawConn> = (0..n).map(|_| RawConn::open(c.addr)).collect();
        for h in held.iter_mut() {
            h.send(b"GET /healthz HTTP/1.1\r\nHost: x\r\n\r\n");
            if h.try_read().map_or(true, |r| r.status != 200) {
                return None;
            }
        }
        Some(held)
    })
}

/// An execution with six ~900 KB events, so that each page of events is a
/// few MB: a client that asks for many and reads none fills the sockets.
fn big_execution(c: &Client) -> String {
    let id = id_of(&c.start(&json!({"workflow": "w"})));
    let big = "y".repeat(900_000);
    for _ in 0..2 {
        c.post(
            &format!("/api/executions/{id}/events"),
            &json!({"events": [
                {"type": "big", "payload": big},
                {"type": "big", "payload": big},
                {"type": "big", "payload": big},
            ]}),
        )
        .expect(200);
    }
    id
}

/// Sends `n` pipelined page reads of `id` on a new connection and never
/// reads the answers: the node's writes block once the socket buffers are
/// full. Returns the connection (dropping it closes it).
fn stuck_reader(c: &Client, id: &str, n: usize) -> std::net::TcpStream {
    stuck_on(c, &format!("/api/executions/{id}/events?limit=1000"), "", n)
}

/// A client that does not read its answers is disconnected after
/// `--write-timeout-ms`.
#[test]
fn a_client_that_does_not_read_is_dropped_after_the_write_timeout() {
    let _d = deadline("a_client_that_does_not_read_is_dropped", TEST_DEADLINE);
    let dir = tempfile::tempdir().expect("tempdir");
    let n = Node::start_single(&dir.path().join("data"), &["--write-timeout-ms", "500"]);
    let c = n.client;
    let id = big_execution(&c);
    let mut s = stuck_reader(&c, &id, 40);
    wait_until(
        "the node to drop the connection that does not read",
        Duration::from_secs(30),
        || (c.metric("forkless_connection_timeouts_total{kind=\"write\"}") >= 1.0).then_some(()),
    );
    // What the socket holds is some of the answers, then the end.
    use std::io::Read;
    s.set_read_timeout(Some(Duration::from_secs(10)))
        .expect("timeout");
    let mut got = 0usize;
    let mut chunk = vec![0u8; 1 << 20];
    loop {
        match s.read(&mut chunk) {
            Ok(0) => break,
            Ok(k) => got += k,
            Err(e) if e.kind() == std::io::ErrorKind::ConnectionReset => break,
            Err(e) => panic!("reading what the node sent: {e} after {got} bytes"),
        }
    }
    assert!(
        got < 40 * 4 * 1024 * 1024,
        "{got} bytes: every answer was sent"
    );
    // The node serves on.
    c.get("/healthz").expect(200);
}

/// A client that asks for answers and never reads them does not hold a
/// node's shutdown up (default timeouts: the write timeout is 30 s).
#[test]
fn a_client_that_does_not_read_does_not_hold_up_a_stop() {
    let _d = deadline(
        "a_client_that_does_not_read_does_not_hold_up_a_stop",
        TEST_DEADLINE,
    );
    let dir = tempfile::tempdir().expect("tempdir");
    let mut n = Node::start_single(&dir.path().join("data"), &[]);
    let c = n.client;
    let id = big_execution(&c);
    let _s = stuck_reader(&c, &id, 40);
    // Once several pages have been made, the socket buffers are full and
    // the node is blocked writing the next.
    wait_until(
        "the node to have answered several pages",
        Duration::from_secs(30),
        || (c.metric("forkless_responses_total{status=\"200\"}") >= 10.0).then_some(()),
    );
    n.sigterm_expect_prompt_exit(" with a client that does not read its answers");
}

/// Over `--long-polls-max`, a long-poll is refused with 503 and
/// `Retry-After`; a waiting long-poll is woken by its own execution's
/// appends, not by other executions' appends on the same shard.
#[test]
fn long_polls_are_bounded_and_woken_only_by_their_execution() {
    let _d = deadline("long_polls_are_bounded", TEST_DEADLINE);
    let dir = tempfile::tempdir().expect("tempdir");
    let n = Node::start_single(&dir.path().join("data"), &["--long-polls-max", "2"]);
    let c = n.client;
    let a = id_of(&c.start(&json!({"workflow": "w"})));
    let b = id_of(&c.start(&json!({"workflow": "w"})));
    let poll = move |id: String| {
        std::thread::spawn(move || {
            c.try_req(
                "GET",
                &format!("/api/executions/{id}/events?after=1&wait_ms=20000"),
                &[],
                None,
                Duration::from_secs(30),
            )
        })
    };
    let first = poll(a.clone());
    let second = poll(a.clone());
    wait_until("two long-polls waiting", Duration::from_secs(10), || {
        (c.metric("forkless_long_polls_waiting") == 2.0).then_some(())
    });
    let r = c.get(&format!("/api/executions/{b}/events?after=1&wait_ms=20000"));
    let v = r.expect_error(503, "too_many_long_polls");
    assert_eq!(r.header("retry-after"), Some("1"), "{:?}", r.headers);
    assert_eq!(v["limit"], 2);
    // A read that does not wait is not a long-poll: served.
    c.get(&format!("/api/executions/{b}/events?after=1"))
        .expect(200);
    // Twenty appends to B (same shard: one shard) wake neither poll on A.
    for i in 0..20 {
        c.post(
            &format!("/api/executions/{b}/events"),
            &json!({"events": [{"type": "b", "payload": i}]}),
        )
        .expect(200);
    }
    assert_eq!(c.metric("forkless_long_poll_wakeups_total"), 0.0);
    assert_eq!(c.metric("forkless_long_polls_waiting"), 2.0);
    c.post(
        &format!("/api/executions/{a}/events"),
        &json!({"events": [{"type": "a"}]}),
    )
    .expect(200);
    for h in [first, second] {
        let r = h.join().expect("poll thread").expect("poll answered");
        r.expect(200);
        assert_eq!(r.json()["events"][0]["seq"], 2);
    }
    assert_eq!(c.metric("forkless_long_poll_wakeups_total"), 2.0);
    wait_until("no long-poll waiting", Duration::from_secs(10), || {
        (c.metric("forkless_long_polls_waiting") == 0.0).then_some(())
    });
}

/// Clients that fill a node's client listener (`--connections-max`) do not
/// take the connections its peers forward on: the peer address, a listener
/// of its own, has a budget of its own, so requests forwarded to the node
/// through another node are still served.
#[test]
fn clients_at_the_connection_limit_do_not_shut_out_the_peers() {
    let _d = deadline(
        "clients_at_the_connection_limit_do_not_shut_out_the_peers",
        TEST_DEADLINE,
    );
    let mut cl = Cluster::prepare(2, 2, PeerTiming::relaxed());
    // Shard 0 on node 1, shard 1 on node 2; each node takes 4 connections
    // a listener.
    let cfg = cl.write_config("limited.toml", &[(0, 1, 1), (1, 2, 1)]);
    let mut text = std::fs::read_to_string(&cfg).expect("config");
    text.push_str("\n[limits]\nconnections_max = 4\n");
    std::fs::write(&cfg, text).expect("config");
    start(&mut cl, &cfg, &[1, 2]);
    let (c1, c2) = (cl.client(1), cl.client(2));
    // Hold node 1's whole client budget.
    let held = hold_connections(&c1, 4);
    // Node 1's client listener is full...
    let refused = c1.try_req("GET", "/healthz", &[], None, Duration::from_secs(5));
    assert!(
        refused.as_ref().map_or(true, |r| r.status == 503),
        "{:?}",
        refused.map(|r| r.text())
    );
    // ...and starts on shard 0 sent through node 2 are forwarded to node 1's
    // peer listener and served, several at once (so the forwarder opens
    // new connections, not only its pooled one; three, within node 2's own
    // client budget of four).
    let two = forkless_sharding::ShardCount::new(2).expect("2 shards");
    let starts: Vec<_> = (0..3)
        .map(|i| {
            std::thread::spawn(move || {
                // Routing keys that land on shard 0 (of 2).
                let key = (0..)
                    .map(|k| format!("peer-{i}-{k}"))
                    .find(|k| forkless_sharding::shard_for_key(k, two) == 0)
                    .expect("a key on shard 0");
                c2.post(
                    "/api/executions",
                    &json!({"workflow": "w", "routing_key": key}),
                )
            })
        })
        .collect();
    for s in starts {
        let r = s.join().expect("a start");
        r.expect(201);
        assert_eq!(r.header("x-forkless-node"), Some("1"), "{r:?}");
    }
    drop(held);
}

/// A long-poll whose client hangs up is let go at once: at the node it
/// waits on, and, sent through a peer, at its owner too (the peer drops
/// the connection it forwarded it on, and the owner sees that close).
/// Neither the slot it holds (`limits.long_polls_max`) nor the peer
/// connection waits out its `wait_ms`.
#[test]
fn a_long_poll_whose_client_hangs_up_is_let_go_at_once() {
    let _d = deadline(
        "a_long_poll_whose_client_hangs_up_is_let_go_at_once",
        TEST_DEADLINE,
    );
    let mut cl = Cluster::prepare(2, 2, PeerTiming::relaxed());
    let cfg = cl.write_config("hang-up.toml", &[(0, 1, 1), (1, 2, 1)]);
    start(&mut cl, &cfg, &[1, 2]);
    let (c1, c2) = (cl.client(1), cl.client(2));
    // Placed on node 1's own shard.
    let id = id_of(&c1.start(&json!({"workflow": "w"})));
    for (through, how) in [(c1, "at its owner"), (c2, "through a peer")] {
        let mut poll = RawConn::open(through.addr);
        poll.send(
            format!(
                "GET /api/executions/{id}/events?after=1&wait_ms=30000 HTTP/1.1\r\nHost: x\r\n\r\n"
            )
            .as_bytes(),
        );
        wait_until(
            &format!("the long-poll sent {how} waiting"),
            Duration::from_secs(10),
            || (c1.metric("forkless_long_polls_waiting") == 1.0).then_some(()),
        );
        drop(poll);
        wait_until(
            &format!("the long-poll sent {how} let go"),
            Duration::from_secs(5),
            || (c1.metric("forkless_long_polls_waiting") == 0.0).then_some(()),
        );
    }
    // (At least: a probe or a harness request cut short counts too.)
    assert!(c1.metric("forkless_reads_abandoned_total") >= 2.0);
    assert!(c2.metric("forkless_reads_abandoned_total") >= 1.0);
}

/// Long-polls sent to a node through its peers leave room on its peer
/// listener for the peers' probes and short requests: each peer forwards
/// at most its share of the node's connections (`limits.connections_max`
/// less two for each peer's probes, shared among the peers; at most half
/// of a share waits), and refuses the rest at once with 503
/// `too_many_forwards`. Before, each forwarded all it was sent, and the
/// node's peer listener filled: further forwards and the probes were
/// refused, and the peers took the node for down.
#[test]
fn long_polls_through_the_peers_leave_room_on_the_owners_peer_listener() {
    let _d = deadline(
        "long_polls_through_the_peers_leave_room_on_the_owners_peer_listener",
        TEST_DEADLINE,
    );
    long_polls_through_the_peers(true);
}

/// As above with the peers on the default `limits.connections_max`
/// (1024) and the owner on 8: each peer reckons its share with the lower
/// of its own and the one the owner's status says. Before, with its own:
/// 510 connections, and the owner's peer listener filled.
#[test]
fn a_peer_with_a_lower_connection_limit_gets_a_share_of_it() {
    let _d = deadline(
        "a_peer_with_a_lower_connection_limit_gets_a_share_of_it",
        TEST_DEADLINE,
    );
    long_polls_through_the_peers(false);
}

/// Five long-polls through each of nodes 2 and 3 to node 1, which runs
/// with `connections_max = 8` (and so do its peers, when `all_limited`).
fn long_polls_through_the_peers(all_limited: bool) {
    let mut cl = Cluster::prepare(3, 4, PeerTiming::relaxed());
    let placed = [(0, 1, 1), (1, 2, 1), (2, 3, 1), (3, 1, 1)];
    let cfg = cl.write_config("shares.toml", &placed);
    let limited = cl.write_config("shares-limited.toml", &placed);
    // Eight connections a listener: each of the two peers may hold
    // (8 - 2 * 2) / 2 = 2 of node 1's peer connections, one of them
    // waiting.
    let mut text = std::fs::read_to_string(&limited).expect("config");
    text.push_str("\n[limits]\nconnections_max = 8\n");
    std::fs::write(&limited, text).expect("config");
    cl.spawn(1, &limited);
    for id in [2, 3] {
        cl.spawn(id, if all_limited { &limited } else { &cfg });
    }
    for id in [1, 2, 3] {
        cl.wait_ready(id);
    }
    cl.wait_all_alive();
    if !all_limited {
        // Each peer has heard node 1's limit from its status.
        for id in [2, 3] {
            wait_until(
                &format!("node {id} hearing node 1's limit"),
                Duration::from_secs(10),
                || {
                    let log = plain(&cl.node_log(id));
                    log.contains("peer=1 theirs=8 ours=1024").then_some(())
                },
            );
        }
    }
    let c1 = cl.client(1);
    let id = id_of(&c1.start(&json!({"workflow": "w"})));
    // Five long-polls through each peer: ten, more than node 1's eight
    // peer connections.
    let (tx, rx) = std::sync::mpsc::channel();
    for through in [2, 3] {
        let c = cl.client(through);
        for _ in 0..5 {
            let (tx, id) = (tx.clone(), id.clone());
            std::thread::spawn(move || {
                let r = c.try_req(
                    "GET",
                    &format!("/api/executions/{id}/events?after=1&wait_ms=30000"),
                    &[],
                    None,
                    Duration::from_secs(45),
                );
                let _ = tx.send((through, r));
            });
        }
    }
    // Four of each peer's five are refused at once, by the peer itself.
    let mut refused = std::collections::BTreeMap::new();
    for _ in 0..8 {
        let (through, r) = rx
            .recv_timeout(Duration::from_secs(10))
            .expect("a long-poll over its peer's share refused at once");
        let r = r.expect("an answer");
        let v = r.expect_error(503, "too_many_forwards");
        assert_eq!(v["limit"], 1, "{v}");
        assert_eq!(v["executed"], false, "{v}");
        assert_eq!(
            r.header("x-forkless-node"),
            Some(through.to_string().as_str())
        );
        *refused.entry(through).or_insert(0) += 1;
    }
    assert_eq!(refused, [(2, 4), (3, 4)].into(), "refused by node");
    wait_until(
        "one long-poll from each peer waiting",
        Duration::from_secs(10),
        || (c1.metric("forkless_long_polls_waiting") == 2.0).then_some(()),
    );
    // Short requests through both peers are still forwarded and served,
    // node 1 refused no connection, and its peers take it for up.
    for through in [2, 3] {
        let c = cl.client(through);
        let r = c.get(&format!("/api/executions/{id}/events"));
        r.expect(200);
        assert_eq!(r.header("x-forkless-node"), Some("1"), "{r:?}");
        assert_eq!(c.metric(r#"forkless_peer_up{node="1"}"#), 1.0);
    }
    assert_eq!(c1.metric("forkless_connections_refused_total"), 0.0);
    // An append wakes the two that wait.
    c1.post(
        &format!("/api/executions/{id}/events"),
        &json!({"events": [{"type": "a"}]}),
    )
    .expect(200);
    for _ in 0..2 {
        let (_, r) = rx
            .recv_timeout(Duration::from_secs(10))
            .expect("a waiting long-poll woken");
        let r = r.expect("an answer");
        r.expect(200);
        assert_eq!(r.json()["events"][0]["seq"], 2);
    }
}

/// The bytes of request bodies a listener's connections hold at once
/// are bounded (`--body-bytes-in-flight-max`), counted as they arrive: a
/// request whose body would go over it is answered 503
/// `too_many_body_bytes`, its body read and dropped, and its connection
/// serves on; once the held body is answered, the same request is
/// served. Before, every connection could hold a body of the largest
/// size at once (1024 x 8 MiB by default).
#[test]
fn request_bodies_held_at_once_are_bounded() {
    let _d = deadline("request_bodies_held_at_once_are_bounded", TEST_DEADLINE);
    let dir = tempfile::tempdir().expect("tempdir");
    // One body of the largest size fits; two of 700 KB do not.
    let n = Node::start_single(
        &dir.path().join("data"),
        &[
            "--request-body-bytes-max",
            "1048576",
            "--body-bytes-in-flight-max",
            "1048576",
            // The slow body below must not run out of time on a slow
            // machine.
            "--request-read-timeout-ms",
            "300000",
        ],
    );
    let c = n.client;
    let id = id_of(&c.start(&json!({"workflow": "w"})));
    let body = |ty: &str| {
        let frame = format!(r#"{{"events":[{{"type":"{ty}","payload":""}}]}}"#);
        let pad = "y".repeat(700_000 - frame.len());
        format!(r#"{{"events":[{{"type":"{ty}","payload":"{pad}"}}]}}"#)
    };
    let head = |len: usize| {
        format!("POST /api/executions/{id}/events HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nContent-Length: {len}\r\n\r\n")
    };
    // A body said to be of the largest size, none of it sent, holds only
    // what the node reads ahead (64 KiB), not the size it was said to be.
    let mut silent = RawConn::open(c.addr);
    silent.send(head(1_048_576).as_bytes());
    // The first body arrives slowly: half of it now.
    let (first, second) = (body("first"), body("second"));
    assert_eq!((first.len(), second.len()), (700_000, 700_000));
    let mut slow = RawConn::open(c.addr);
    slow.send(head(first.len()).as_bytes());
    slow.send(&first.as_bytes()[..350_000]);
    // Held: the silent one's read ahead, and the half of the first read
    // with its read ahead.
    wait_until("the bodies held", Duration::from_secs(10), || {
        (c.metric("forkless_body_bytes_in_flight") >= (65_536 + 350_000 + 65_536) as f64)
            .then_some(())
    });
    // The second, whole, would go over: refused, nothing written, and its
    // connection serves the next request.
    let mut other = RawConn::open(c.addr);
    other.send(head(second.len()).as_bytes());
    other.send(second.as_bytes());
    let r = other.read();
    let v = r.expect_error(503, "too_many_body_bytes");
    assert_eq!(
        (v["limit"].as_u64(), v["executed"].as_bool()),
        (Some(1_048_576), Some(false)),
        "{v}"
    );
    assert_eq!(r.header("retry-after"), Some("1"));
    other.send(b"GET /healthz HTTP/1.1\r\nHost: x\r\n\r\n");
    other.read().expect(200);
    // A streamed (chunked) body, which hyper serves, is held as it comes
    // too: refused once it would go over (hyper then closes the
    // connection, the rest of the body unread).
    let mut chunked = RawConn::open(c.addr);
    let third = body("chunked");
    chunked.send(
        format!(
            "POST /api/executions/{id}/events HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nTransfer-Encoding: chunked\r\n\r\n{:x}\r\n{third}\r\n0\r\n\r\n",
            third.len()
        )
        .as_bytes(),
    );
    chunked.read().expect_error(503, "too_many_body_bytes");
    assert_eq!(c.metric("forkless_body_bytes_refused_total"), 2.0);
    // The first comes in full and is served; then the second is.
    slow.send(&first.as_bytes()[350_000..]);
    assert_eq!(slow.read().expect(200).json()["first_seq"], 2);
    other.send(head(second.len()).as_bytes());
    other.send(second.as_bytes());
    assert_eq!(other.read().expect(200).json()["first_seq"], 3);
    drop(silent);
    wait_until("no body held", Duration::from_secs(10), || {
        (c.metric("forkless_body_bytes_in_flight") == 0.0).then_some(())
    });
}

/// The answers to reads held at once (made, and not yet written to their
/// clients) are bounded per listener: clients that ask for pages and do
/// not read them hold no more than `--answer-bytes-in-flight-max`; a page
/// is cut short to fit what is left, a read whose answer does not fit is
/// refused (503, `executed: false`), small answers (an execution, health,
/// metrics) are served however full the budget is, an answer on hyper's
/// path is held until written as on the connection loop, and every byte
/// is given back once the stuck clients go.
#[test]
fn answers_held_at_once_are_bounded() {
    let _d = deadline("answers_held_at_once_are_bounded", TEST_DEADLINE);
    let dir = tempfile::tempdir().expect("tempdir");
    const BUDGET: f64 = 4.0 * 1024.0 * 1024.0;
    // What one answer of a single 300 KB event holds (whole KiB).
    const ONE: f64 = 294.0 * 1024.0;
    let n = Node::start_single(
        &dir.path().join("data"),
        &[
            "--read-page-bytes-max",
            "1048576",
            "--answer-bytes-in-flight-max",
            "4194304",
            // The stuck clients below must not be dropped for not
            // reading while the test runs.
            "--write-timeout-ms",
            "300000",
        ],
    );
    let c = n.client;
    // Twelve events of 300 KB: a full page is the start event and four of
    // them (it stops after the one that reaches 1 MiB).
    let id = start_with_300_kb_events(&c);
    // One event of 270 KB.
    let filler_id = id_of(&c.start(&json!({"workflow": "w"})));
    c.post(
        &format!("/api/executions/{filler_id}/events"),
        &json!({"events": [{"type": "filler", "payload": "f".repeat(270_000)}]}),
    )
    .expect(200);
    // Forty events of 1 KB: their page (about 45 KB) is not counted.
    let small_id = id_of(&c.start(&json!({"workflow": "w"})));
    let events: Vec<_> = (0..40)
        .map(|_| json!({"type": "small", "payload": "z".repeat(1000)}))
        .collect();
    c.post(
        &format!("/api/executions/{small_id}/events"),
        &json!({ "events": events }),
    )
    .expect(200);
    let pages = format!("/api/executions/{id}/events?limit=10");
    let one = format!("/api/executions/{id}/events?after=1&limit=1");
    let full = c.get(&pages).expect(200).json();
    assert_eq!(
        full["events"].as_array().map(Vec::len),
        Some(5),
        "a full page"
    );
    let held = |c: &Client| c.metric("forkless_answer_bytes_in_flight");
    let refusals = |c: &Client| c.metric("forkless_answer_bytes_refused_total");
    // (The server lets an answer go just after its last byte is written.)
    let held_at_most = |c: &Client, most: f64| {
        wait_until(
            &format!("at most {most} bytes held"),
            Duration::from_secs(10),
            || {
                let h = held(c);
                (h <= most).then_some(h)
            },
        )
    };
    held_at_most(&c, 0.0);
    // Two clients that ask for pages and read none: each ends up with one
    // page held, its write blocked once the socket buffers are full.
    let mut stuck = vec![stuck_on(&c, &pages, "", 40)];
    wait_until("one page held", Duration::from_secs(30), || {
        (held(&c) >= 1_200_000.0).then_some(())
    });
    stuck.push(stuck_on(&c, &pages, "", 40));
    wait_until("two pages held", Duration::from_secs(30), || {
        (held(&c) >= 2_400_000.0).then_some(())
    });
    let two_held = held_steady(&c);
    assert!(two_held < 2_500_000.0, "{two_held} bytes held by two pages");
    // About 1.7 MiB left: a whole page (1.2 MB) still fits, and is whole
    // (before, it was cut short by a payload's room and ten events'
    // frames it did not need).
    assert_eq!(
        c.get(&pages).expect(200).json()["events"],
        full["events"],
        "a page that fits, read with 1.7 MiB of answers left"
    );
    stuck.push(stuck_on(&c, &pages, "", 40));
    wait_until("three pages held", Duration::from_secs(30), || {
        (held(&c) >= 3_600_000.0).then_some(())
    });
    let pages_held = held_steady(&c);
    // About 0.56 MiB left: a page is cut short to fit, and says where to
    // go on.
    let short = c.get(&pages).expect(200).json();
    let events = short["events"].as_array().map_or(0, Vec::len);
    assert!(
        (1..5).contains(&events),
        "{events} events in a page read with 0.56 MiB of answers left"
    );
    assert_eq!(short["next_after"], short["events"][events - 1]["seq"]);
    // Clients stuck on single events of 300 KB fill the rest, until one's
    // answers do not fit and are refused.
    for k in 1.. {
        assert!(k <= 10, "4 MiB held by two pages and 10 events of 300 KB");
        let refused_so_far = refusals(&c);
        stuck.push(stuck_on(&c, &one, "", 100));
        let refused = wait_until(
            "its answer held or refused",
            Duration::from_secs(30),
            || {
                if refusals(&c) > refused_so_far {
                    Some(true)
                } else {
                    (held(&c) >= pages_held + k as f64 * ONE).then_some(false)
                }
            },
        );
        assert!(held(&c) <= BUDGET, "{} bytes held", held(&c));
        if refused {
            break;
        }
    }
    // What the stuck clients hold now leaves no room for one more such
    // answer: a read of it is refused, nothing held for it.
    let h = held_steady(&c);
    assert!(h <= BUDGET && h > BUDGET - ONE, "{h} bytes held");
    let r = c.get(&one);
    let v = r.expect_error(503, "too_many_answer_bytes");
    assert_eq!(
        (v["limit"].as_u64(), v["executed"].as_bool()),
        (Some(4_194_304), Some(false)),
        "{v}"
    );
    assert_eq!(r.header("retry-after"), Some("1"));
    assert!(r.header("x-forkless-shard").is_some(), "{:?}", r.headers);
    // So is one that hyper serves (its head names another connection
    // option).
    let mut other = RawConn::open(c.addr);
    other.send(format!("GET {one} HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n").as_bytes());
    other.read().expect_error(503, "too_many_answer_bytes");
    // A client stuck on the 270 KB event leaves less room than the 64 KiB
    // an answer may take uncounted.
    stuck.push(stuck_on(
        &c,
        &format!("/api/executions/{filler_id}/events?after=1&limit=1"),
        "",
        100,
    ));
    wait_until("the 270 KB event held", Duration::from_secs(30), || {
        (held(&c) >= h + 260_000.0).then_some(())
    });
    let h = held_steady(&c);
    assert!(BUDGET - h < 65_536.0, "{h} bytes held");
    // Small answers are served however full: the execution, a page of
    // its small start event, the health check, the metrics; and a page of
    // small events is whole, up to what is not counted (before, every
    // page was cut to one event once the room was less than a payload and
    // its frames).
    c.get(&format!("/api/executions/{id}")).expect(200);
    let small = c
        .get(&format!("/api/executions/{id}/events?limit=1"))
        .expect(200)
        .json();
    assert_eq!(small["events"][0]["seq"], 1);
    let page = c
        .get(&format!("/api/executions/{small_id}/events?limit=100"))
        .expect(200)
        .json();
    assert_eq!(
        (page["events"].as_array().map(Vec::len), &page["next_after"]),
        (Some(41), &json!(null)),
        "a page of 45 KB read with less than 64 KiB of room left"
    );
    c.get("/healthz").expect(200);
    // The stuck clients go: every byte is given back, and pages are whole.
    drop(stuck);
    held_at_most(&c, 0.0);
    assert_eq!(c.get(&pages).expect(200).json()["events"], full["events"]);
    // On hyper's path, an answer is held until written too: not let go
    // once hyper has queued it (300 KB fits hyper's queue).
    let s = stuck_on(&c, &one, "Connection: keep-alive, te\r\n", 100);
    wait_until(
        "an answer held on hyper's path",
        Duration::from_secs(30),
        || (held(&c) >= ONE).then_some(()),
    );
    assert!(
        held_steady(&c) >= ONE,
        "the answer let go before it was written"
    );
    drop(s);
    held_at_most(&c, 0.0);
}

/// The bytes of answers the node holds once they hold still (three
/// readings 50 ms apart alike): a client stuck on its answers holds one
/// for good, but one still taking them lets go of each as it is written.
fn held_steady(c: &Client) -> f64 {
    wait_until(
        "the answers held to hold still",
        Duration::from_secs(30),
        || {
            let first = c.metric("forkless_answer_bytes_in_flight");
            for _ in 0..2 {
                std::thread::sleep(Duration::from_millis(50));
                if c.metric("forkless_answer_bytes_in_flight") != first {
                    return None;
                }
            }
            Some(first)
        },
    )
}

/// A page read through a node that does not own its shard is held there
/// too while it is relayed: the owner cuts it short to the room both
/// nodes have (the forwarder says its own), rather than make a page the
/// forwarder must refuse.
#[test]
fn a_page_read_through_another_node_is_cut_short_to_its_room() {
    let _d = deadline(
        "a_page_read_through_another_node_is_cut_short_to_its_room",
        TEST_DEADLINE,
    );
    let mut cl = Cluster::prepare(2, 1, PeerTiming::relaxed());
    let cfg = cl.write_config("room.toml", &[(0, 1, 1)]);
    let mut text = std::fs::read_to_string(&cfg).expect("config");
    text.push_str(
        "\n[limits]\nread_page_bytes_max = 1048576\nanswer_bytes_in_flight_max = 4194304\nwrite_timeout_ms = 300000\n",
    );
    std::fs::write(&cfg, text).expect("config");
    start(&mut cl, &cfg, &[1, 2]);
    let (c1, c2) = (cl.client(1), cl.client(2));
    let id = start_with_300_kb_events(&c1);
    let pages = format!("/api/executions/{id}/events?limit=10");
    // Three clients of node 2 stuck on pages node 1 made: node 2 holds
    // them (over 3 MB of its 4 MiB).
    let mut stuck = Vec::new();
    for k in 1..=3 {
        stuck.push(stuck_on(&c2, &pages, "", 40));
        wait_until(&format!("{k} pages held"), Duration::from_secs(30), || {
            let h = c2.metric("forkless_answer_bytes_in_flight");
            (h >= 900_000.0 * k as f64).then_some(())
        });
    }
    let h = held_steady(&c2);
    assert!(h > 3_000_000.0, "{h} bytes held by node 2");
    // Too little room left at node 2 for a whole page (1.2 MB): node 1
    // makes a short one.
    let r = c2.get(&pages);
    r.expect(200);
    assert_eq!(r.header("x-forkless-node"), Some("1"));
    let v = r.json();
    let events = v["events"].as_array().map_or(0, Vec::len);
    assert!((1..5).contains(&events), "{events} events");
    assert_eq!(v["next_after"], v["events"][events - 1]["seq"]);
    drop(stuck);
}

/// Starts an execution and appends twelve events of 300 KB to it, four
/// a request; returns its id.
fn start_with_300_kb_events(c: &Client) -> String {
    let id = id_of(&c.start(&json!({"workflow": "w"})));
    let event = json!({"type": "mid", "payload": "y".repeat(300_000)});
    for _ in 0..3 {
        c.post(
            &format!("/api/executions/{id}/events"),
            &json!({"events": [event, event, event, event]}),
        )
        .expect(200);
    }
    id
}

/// Sends `n` pipelined GETs of `path` (with `headers`, each line ending
/// in CRLF) on a new connection and never reads the answers: the node's
/// writes block once the socket buffers are full. Returns the connection
/// (dropping it closes it).
fn stuck_on(c: &Client, path: &str, headers: &str, n: usize) -> std::net::TcpStream {
    use std::io::Write;
    let mut s = std::net::TcpStream::connect(c.addr).expect("connect");
    let one = format!("GET {path} HTTP/1.1\r\nHost: x\r\n{headers}\r\n");
    s.write_all(one.repeat(n).as_bytes()).expect("send");
    s
}

/// A node whose peer runs with another `limits.connections_max` says so
/// (the two forward to each other within shares reckoned with the lower
/// value), and so does the peer.
#[test]
fn a_peer_with_another_connection_limit_is_named() {
    let _d = deadline(
        "a_peer_with_another_connection_limit_is_named",
        TEST_DEADLINE,
    );
    let mut cl = Cluster::prepare(2, 2, PeerTiming::relaxed());
    let cfg = cl.write_config("limits-1.toml", &[(0, 1, 1), (1, 2, 1)]);
    let other = cl.write_config("limits-2.toml", &[(0, 1, 1), (1, 2, 1)]);
    let mut text = std::fs::read_to_string(&other).expect("config");
    text.push_str("\n[limits]\nconnections_max = 512\n");
    std::fs::write(&other, text).expect("config");
    cl.spawn(1, &cfg);
    cl.spawn(2, &other);
    for id in [1, 2] {
        cl.wait_ready(id);
    }
    for (id, said) in [(1, "theirs=512 ours=1024"), (2, "theirs=1024 ours=512")] {
        wait_until(
            &format!("node {id} naming its peer's limit"),
            Duration::from_secs(10),
            || {
                let log = plain(&cl.node_log(id));
                (log.contains("peer runs with another limits.connections_max")
                    && log.contains(said))
                .then_some(())
            },
        );
    }
}

/// `log` without its terminal colour sequences (`ESC [ ... m`).
fn plain(log: &str) -> String {
    let mut out = String::with_capacity(log.len());
    let mut chars = log.chars();
    while let Some(c) = chars.next() {
        if c == '\u{1b}' {
            for c in chars.by_ref() {
                if c == 'm' {
                    break;
                }
            }
        } else {
            out.push(c);
        }
    }
    out
}
