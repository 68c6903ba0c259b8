//! The forkless HTTP adapter against a small fake of forkless's API (a raw
//! HTTP/1.1 keep-alive server on loopback): request shapes, order checks,
//! one connection per client, and errors counted rather than panicking.

use std::collections::HashMap;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use forkless_loadgen::forkless::ForklessHttp;
use forkless_loadgen::{run, Workload};
use serde_json::{json, Value};
use tokio::io::{AsyncBufReadExt, AsyncReadExt, AsyncWriteExt, BufReader};
use tokio::net::{TcpListener, TcpStream};

#[derive(Clone, Copy)]
enum Mode {
    /// Behaves like forkless.
    Honest,
    /// Acknowledges appends with a wrong sequence.
    WrongSeq,
    /// Answers appends with a body that is not JSON.
    Garbage,
}

#[derive(Default)]
struct State {
    next_id: u64,
    last_seq: HashMap<String, u64>,
}

struct Fake {
    url: String,
    connections: Arc<AtomicUsize>,
    state: Arc<Mutex<State>>,
}

async fn fake(mode: Mode) -> Fake {
    let listener = TcpListener::bind("127.0.0.1:0").await.expect("bind");
    let url = format!("http://{}", listener.local_addr().expect("addr"));
    let connections = Arc::new(AtomicUsize::new(0));
    let state = Arc::new(Mutex::new(State {
        next_id: 7_000_000_000_000,
        ..State::default()
    }));
    let (c, s) = (connections.clone(), state.clone());
    tokio::spawn(async move {
        while let Ok((sock, _)) = listener.accept().await {
            c.fetch_add(1, Ordering::SeqCst);
            let _ = sock.set_nodelay(true);
            tokio::spawn(serve(sock, s.clone(), mode));
        }
    });
    Fake {
        url,
        connections,
        state,
    }
}

async fn serve(sock: TcpStream, state: Arc<Mutex<State>>, mode: Mode) {
    let (r, mut w) = sock.into_split();
    let mut r = BufReader::new(r);
    loop {
        let mut request_line = String::new();
        if r.read_line(&mut request_line).await.unwrap_or(0) == 0 {
            return;
        }
        let mut len = 0usize;
        loop {
            let mut h = String::new();
            if r.read_line(&mut h).await.unwrap_or(0) == 0 {
                return;
            }
            if h == "\r\n" {
                break;
            }
            if let Some((k, v)) = h.split_once(':') {
                if k.eq_ignore_ascii_case("content-length") {
                    len = v.trim().parse().unwrap_or(0);
                }
            }
        }
        let mut body = vec![0; len];
        if r.read_exact(&mut body).await.is_err() {
            return;
        }
        let path = request_line.split(' ').nth(1).unwrap_or("").to_string();
        let (status, answer) = handle(&path, &body, &state, mode);
        let head = format!(
            "HTTP/1.1 {status}\r\ncontent-type: application/json\r\ncontent-length: {}\r\n\r\n",
            answer.len()
        );
        if w.write_all(head.as_bytes()).await.is_err()
            || w.write_all(answer.as_bytes()).await.is_err()
        {
            return;
        }
    }
}

fn handle(path: &str, body: &[u8], state: &Mutex<State>, mode: Mode) -> (&'static str, String) {
    let mut st = state.lock().expect("state");
    let req: Value = serde_json::from_slice(body).unwrap_or(Value::Null);
    if path == "/api/executions" {
        assert_eq!(req, json!({"workflow": "bench"}));
        st.next_id += 1;
        let id = st.next_id.to_string();
        st.last_seq.insert(id.clone(), 1);
        return (
            "201 Created",
            json!({"execution_id": id, "partition": 1, "shard": 0}).to_string(),
        );
    }
    let Some(id) = path
        .strip_prefix("/api/executions/")
        .and_then(|p| p.strip_suffix("/events"))
    else {
        return (
            "404 Not Found",
            json!({"error": "not_found", "message": path}).to_string(),
        );
    };
    match mode {
        Mode::Garbage => return ("200 OK", "<html>".into()),
        Mode::WrongSeq => {
            return (
                "200 OK",
                json!({"first_seq": 99, "last_seq": 99}).to_string(),
            )
        }
        Mode::Honest => {}
    }
    let events = req["events"].as_array().cloned().unwrap_or_default();
    assert_eq!(events.len(), 1);
    assert_eq!(events[0]["type"], "bench.tick");
    assert_eq!(
        serde_json::to_string(&events[0]["payload"])
            .map(|s| s.len())
            .ok(),
        Some(256)
    );
    let expected = req["expected_last_seq"]
        .as_u64()
        .expect("expected_last_seq");
    let Some(last) = st.last_seq.get_mut(id) else {
        return (
            "404 Not Found",
            json!({"error": "execution_not_found", "message": id}).to_string(),
        );
    };
    if *last != expected {
        let body = json!({"error": "sequence_conflict", "message": "no", "last_seq": *last});
        return ("409 Conflict", body.to_string());
    }
    *last += 1;
    (
        "200 OK",
        json!({"first_seq": *last, "last_seq": *last}).to_string(),
    )
}

fn workload(clients: usize) -> Workload {
    Workload {
        clients,
        keys: 40,
        payload_bytes: 256,
        warmup: Duration::from_millis(100),
        duration: Duration::from_millis(400),
        append_timeout: Duration::from_secs(2),
        server_pid: None,
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn appends_in_order_over_one_connection_per_client() {
    let f = fake(Mode::Honest).await;
    let target = ForklessHttp::new(&f.url).expect("target");
    let r = run(target, &workload(4)).await.expect("run");
    assert_eq!(r.errors, 0, "{r}");
    assert!(r.events > 0);
    // Setup opens 16 connections; the run exactly one per client.
    assert_eq!(f.connections.load(Ordering::SeqCst), 16 + 4);
    let st = f.state.lock().expect("state");
    assert_eq!(st.last_seq.len(), 40);
    let appended: u64 = st.last_seq.values().map(|s| s - 1).sum();
    assert_eq!(appended, r.total_appends);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_conflict_is_counted_and_retires_the_key() {
    let f = fake(Mode::Honest).await;
    let target = ForklessHttp::new(&f.url).expect("target");
    // Someone else appends to one execution before the run: the first append
    // to that key conflicts.
    let r = {
        let w = workload(2);
        let state = f.state.clone();
        tokio::spawn(async move {
            // As soon as setup has started all 40 executions (the run begins
            // 50 ms after the clients connect), move one of them on.
            loop {
                {
                    let mut st = state.lock().expect("state");
                    if st.last_seq.len() == 40 {
                        if let Some(v) = st.last_seq.values_mut().next() {
                            *v += 1_000_000;
                        }
                        return;
                    }
                }
                tokio::time::sleep(Duration::from_micros(200)).await;
            }
        });
        run(target, &w).await.expect("run")
    };
    assert_eq!(r.errors, 1, "{r}");
    assert_eq!(r.error_kinds.get("conflict"), Some(&1));
    assert_eq!(r.retired_keys, 1);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn wrong_or_garbage_answers_are_errors_not_panics() {
    for mode in [Mode::WrongSeq, Mode::Garbage] {
        let f = fake(mode).await;
        let target = ForklessHttp::new(&f.url).expect("target");
        let r = run(target, &workload(2)).await.expect("run");
        assert_eq!(r.events, 0);
        assert_eq!(r.errors, 40, "{r}");
        assert_eq!(r.error_kinds.get("bad_answer"), Some(&40));
    }
}

#[test]
fn rejects_non_http_urls() {
    assert!(ForklessHttp::new("https://127.0.0.1:1").is_err());
    assert!(ForklessHttp::new("127.0.0.1:7070").is_err());
    assert!(ForklessHttp::new("http://127.0.0.1:7070/").is_ok());
}
