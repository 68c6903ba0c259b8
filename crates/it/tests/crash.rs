//! Crash safety: many concurrent writers append with `expected_last_seq`
//! while a node is SIGKILLed mid-stream. After each restart on the same
//! data dir, every acknowledged event is present at its seq with its marker,
//! every log is gap-free with no duplicates, batches are all-or-nothing,
//! refusals that say nothing was written hold, and nothing appears that was
//! never sent. In-flight batches retried with their idempotency keys land
//! exactly once.

use forkless_it::workload::{batch_body, histogram, verify, writer, Batch, Outcome, Shared};
use forkless_it::*;
use std::time::{Duration, Instant};

const WRITERS: usize = 16;

fn start_execs(c: &Client, n: usize, body: &serde_json::Value) -> Vec<String> {
    (0..n)
        .map(|_| c.start(body)["execution_id"].as_str().unwrap().to_string())
        .collect()
}

/// Retries every in-flight batch with its idempotency keys (no
/// expected_last_seq) and marks it acknowledged where it now is.
fn settle_unknown(c: &Client, all: &mut [Batch]) {
    for b in all.iter_mut().filter(|b| b.outcome == Outcome::Unknown) {
        let r = c.post(
            &format!("/api/executions/{}/events", b.exec),
            &batch_body(&b.markers, None),
        );
        r.expect(200);
        let first = r.json()["first_seq"].as_u64().unwrap();
        b.outcome = Outcome::Acked { first_seq: first };
    }
}

/// A start sent while the node may die: its key, and the id if acknowledged.
struct SentStart {
    key: String,
    id: Option<String>,
}

fn start_body(key: &str) -> serde_json::Value {
    json!({"workflow": "crash", "routing_key": format!("crash/{key}"), "idempotency_key": key})
}

/// Starts keyed executions until the node stops answering.
fn starter(
    c: Client,
    tag: String,
    out: std::sync::Arc<std::sync::Mutex<Vec<SentStart>>>,
    stop: Stop,
) {
    let mut n = 0;
    while !stop.is_set() {
        let key = format!("{tag}-{n}");
        n += 1;
        let body = start_body(&key).to_string();
        let r = c.try_req(
            "POST",
            "/api/executions",
            &[],
            Some(body.as_bytes()),
            Duration::from_secs(10),
        );
        let id = match r {
            Ok(r) if r.status == 201 => {
                Some(r.json()["execution_id"].as_str().unwrap().to_string())
            }
            Ok(r) => panic!("start answered {} {}", r.status, r.text()),
            Err(_) => None,
        };
        let dead = id.is_none();
        out.lock().unwrap().push(SentStart { key, id });
        if dead {
            return;
        }
    }
}

/// Every acknowledged start exists; every start retried with its keys
/// finds exactly one execution.
fn verify_starts(c: &Client, starts: &[SentStart]) -> (usize, usize) {
    let (mut acked, mut unknown) = (0, 0);
    for s in starts {
        if let Some(id) = &s.id {
            acked += 1;
            assert_eq!(
                c.last_seq(id),
                1,
                "acknowledged start {id} ({}) lost",
                s.key
            );
        } else {
            unknown += 1;
        }
        let r = c.post("/api/executions", &start_body(&s.key));
        assert!(
            r.status == 200 || (r.status == 201 && s.id.is_none()),
            "retrying start {}: {} {}",
            s.key,
            r.status,
            r.text()
        );
        let again = r.json()["execution_id"].as_str().unwrap().to_string();
        if let Some(id) = &s.id {
            assert_eq!(
                &again, id,
                "a retried start of {} made a new execution",
                s.key
            );
        }
        let k = c.get(&format!("/api/keys/crash/{}", s.key)).json();
        let ids = k["executions"].as_array().unwrap();
        assert_eq!(
            ids.len(),
            1,
            "key {} has {} executions: {k}",
            s.key,
            ids.len()
        );
        assert_eq!(ids[0]["execution_id"].as_str(), Some(again.as_str()));
    }
    (acked, unknown)
}

#[test]
fn acknowledged_appends_survive_sigkill() {
    const EXECUTIONS: usize = 6;
    const ROUNDS: usize = 5;
    let _d = deadline(
        "acknowledged_appends_survive_sigkill",
        Duration::from_secs(150),
    );
    let dir = tempfile::tempdir().unwrap();
    let mut node = Node::start_single(&dir.path().join("data"), &["--shard-count", "4"]);
    let c = node.client;
    let execs = start_execs(&c, EXECUTIONS, &json!({"workflow": "crash"}));
    let mut all: Vec<Batch> = Vec::new();
    for round in 0..ROUNDS {
        let shared = Shared::default();
        let started = Instant::now();
        let handles: Vec<_> = (0..WRITERS)
            .map(|t| {
                // Each writer works on three executions; every execution
                // has several writers racing on expected_last_seq.
                let mine: Vec<String> = (0..3)
                    .map(|k| execs[(t + k) % EXECUTIONS].clone())
                    .collect();
                let shared = shared.clone();
                std::thread::spawn(move || {
                    writer(vec![c], mine, format!("r{round}-t{t}"), shared, true)
                })
            })
            .collect();
        let starts = std::sync::Arc::new(std::sync::Mutex::new(Vec::new()));
        let starters: Vec<_> = (0..3)
            .map(|t| {
                let (starts, stop) = (starts.clone(), shared.stop.clone());
                std::thread::spawn(move || starter(c, format!("r{round}-s{t}"), starts, stop))
            })
            .collect();
        // Kill mid-stream, once enough has been acknowledged.
        let target = 250 + round * 37;
        wait_until(
            "writers to get acknowledgements",
            Duration::from_secs(60),
            || (shared.acks() >= target).then_some(()),
        );
        node.kill9();
        let killed_after = started.elapsed();
        shared.stop.set();
        for h in handles {
            h.join()
                .expect("writer panicked")
                .expect("writer saw a wrong answer");
        }
        for h in starters {
            h.join().expect("starter panicked");
        }
        let batches = shared.take();
        let hist = histogram(&batches);
        all.extend(batches);

        node.restart();
        let (acked_starts, unknown_starts) = verify_starts(&c, &starts.lock().unwrap());
        eprintln!("[crash] round {round}: {acked_starts} acknowledged starts intact, {unknown_starts} in-flight starts resolved by retry");
        let rep = verify(&c, &execs, &all);
        eprintln!(
            "[crash] round {round}: killed after {killed_after:?}; answers {hist:?}; in flight at the kill: {} landed, {} did not",
            rep.unknown_landed, rep.unknown_lost
        );
        settle_unknown(&c, &mut all);
        let rep = verify(&c, &execs, &all);
        assert_eq!(rep.unknown_landed + rep.unknown_lost, 0);
    }
    let total: u64 = execs.iter().map(|e| c.last_seq(e)).sum();
    eprintln!("[crash] {ROUNDS} kill/restart rounds, {total} events verified");
}

/// The same through a 3-node cluster: writers send through every node (so
/// most writes are forwarded), and each round SIGKILLs a different owner
/// mid-stream. Forwarded acknowledgements are durable on the owner; a 503
/// with `executed: false` never lands; the other shards keep working.
#[test]
fn acknowledged_forwarded_appends_survive_sigkill_of_the_owner() {
    const SHARDS: u32 = 8;
    let _d = deadline(
        "acknowledged_forwarded_appends_survive_sigkill_of_the_owner",
        Duration::from_secs(150),
    );
    let mut cl = Cluster::start(3, SHARDS, &[], PeerTiming::default());
    let clients: Vec<Client> = cl.clients().into_iter().map(|(_, c)| c).collect();
    // Two executions per node.
    let mut execs = Vec::new();
    for c in &clients {
        execs.extend(start_execs(c, 2, &json!({"workflow": "crash"})));
    }
    let owner = |id: &str| (shard_of_id(id, SHARDS) % 3) as u16 + 1;
    let mut all: Vec<Batch> = Vec::new();
    for (round, victim) in [2u16, 1, 3].into_iter().enumerate() {
        let shared = Shared::default();
        let handles: Vec<_> = (0..12)
            .map(|t| {
                let mine: Vec<String> = (0..3)
                    .map(|k| execs[(t + k) % execs.len()].clone())
                    .collect();
                // Rotate the entry node, starting at a different one per writer.
                let mut via = clients.clone();
                via.rotate_left(t % 3);
                let shared = shared.clone();
                std::thread::spawn(move || {
                    writer(via, mine, format!("c{round}-t{t}"), shared, false)
                })
            })
            .collect();
        let target = 150;
        wait_until(
            "writers to get acknowledgements",
            Duration::from_secs(60),
            || (shared.acks() >= target).then_some(()),
        );
        cl.kill9(victim);
        // Keep writing while the owner is dead: until plenty more was sent
        // and the survivors' shards acknowledged more.
        let (sent, acks) = (shared.sent(), shared.acks());
        wait_until(
            "writes to go on while the owner is dead",
            Duration::from_secs(30),
            || (shared.sent() >= sent + 200 && shared.acks() >= acks + 50).then_some(()),
        );
        shared.stop.set();
        for h in handles {
            h.join()
                .expect("writer panicked")
                .expect("writer saw a wrong answer");
        }
        let batches = shared.take();
        let hist = histogram(&batches);
        // Requests for the dead owner's executions failed closed, never
        // locally: no 200 for them came from another node.
        for b in &batches {
            if b.status == Some(200) {
                assert_eq!(
                    b.node,
                    Some(owner(&b.exec) as u64),
                    "acknowledged by a non-owner: {b:?}"
                );
            }
        }
        assert!(
            batches
                .iter()
                .any(|b| owner(&b.exec) == victim && b.status == Some(503)),
            "no write for the dead owner's shards failed closed: {hist:?}"
        );
        all.extend(batches);
        cl.restart(victim, None);
        cl.wait_all_alive();
        for (_, c) in cl.clients() {
            let rep = verify(&c, &execs, &all);
            if c.addr == clients[0].addr {
                eprintln!(
                    "[crash] cluster round {round} (killed node {victim}): answers {hist:?}; {} events; in flight: {} landed, {} did not",
                    rep.events, rep.unknown_landed, rep.unknown_lost
                );
            }
        }
        settle_unknown(&clients[0], &mut all);
        verify(&clients[1], &execs, &all);
    }
}
