//! The failover measurement behind BENCHMARKS.md ("Failover"): a
//! three-node replicated cluster under a steady write load, its leader of
//! shard 0 killed with SIGKILL 20 times (restarted and caught up between
//! rounds). For each kill: detection (a survivor's group stands for
//! election: it no longer names the dead node as leader), election (a
//! survivor leads at a newer term), and rediscovery (the first write
//! acknowledged on each shard the dead node led). Not a test of
//! correctness (replication.rs is); ignored, run on purpose:
//!
//! ```text
//! cargo build --release -p forkless
//! FORKLESS_BIN=target/release/forkless cargo test -p forkless-it \
//!     --test failover_bench -- --ignored --nocapture
//! ```
//!
//! (`FORKLESS_BENCH_RAFT=50,200,400` tries other `[raft]` timers;
//! `FORKLESS_BENCH_STOP=term` stops the leader with SIGTERM instead, as a
//! rolling restart does: it hands its shards' leadership over first.)
//!
//! Also measured for each stop: the longest time an affected shard went
//! without an acknowledged write from the stop on (a write in flight may
//! be acknowledged just after a SIGTERM, before the node goes).

use forkless_it::workload::{longest_without_ack, writer, Outcome, Shared};
use forkless_it::*;
use serde_json::Value;
use std::time::{Duration, Instant};

const NODES: u16 = 3;
const SHARDS: u32 = 4;
const ROUNDS: usize = 20;

/// Each shard's (leader, term, state) as `node` sees it, if it answers.
fn view(cl: &Cluster, node: u16) -> Option<Vec<(Option<u64>, u64, String)>> {
    let v = cl
        .client(node)
        .try_req("GET", "/api/cluster", &[], None, Duration::from_millis(500))
        .ok()?
        .json();
    v["shards"]
        .as_array()?
        .iter()
        .map(|s| {
            Some((
                s["leader"].as_u64(),
                s["term"].as_u64()?,
                s["raft"]["state"].as_str()?.to_string(),
            ))
        })
        .collect()
}

fn pct(v: &mut [Duration], p: f64) -> Duration {
    v.sort();
    v[((v.len() - 1) as f64 * p).round() as usize]
}

#[test]
#[ignore = "a measurement: run on purpose (see the module's doc)"]
fn failover_after_a_leader_is_killed() {
    // FORKLESS_BENCH_RAFT=heartbeat,min,max (ms) tries other timers.
    let timing = std::env::var("FORKLESS_BENCH_RAFT").ok().map(|v| {
        let n: Vec<u64> = v
            .split(',')
            .map(|x| x.trim().parse().expect("a number of ms"))
            .collect();
        assert_eq!(n.len(), 3, "FORKLESS_BENCH_RAFT=heartbeat,min,max");
        (n[0], n[1], n[2])
    });
    let on_purpose = std::env::var("FORKLESS_BENCH_STOP").is_ok_and(|v| v == "term");
    let mut cl = Cluster::prepare_replicated(NODES, SHARDS, 3, PeerTiming::default());
    cl.raft_timing = timing;
    let ids: Vec<u16> = (1..=NODES).collect();
    cl.start_nodes(&ids, &[]);
    for id in ids {
        cl.wait_leaders_known(id, &[]);
        // A new cluster's replica that did not vote for its shard's first
        // leader is careful for a moment (`docs/replication.md`, "A replica
        // whose data directory is new"): a fault then leaves its shard
        // waiting for the node lost. The bench measures the steady state.
        wait_until("no replica careful", Duration::from_secs(20), || {
            none_fresh(&cl.client(id))
        });
    }
    eprintln!(
        "[raft] timers: {:?} (heartbeat, election min, max; ms; None: the defaults)",
        cl.raft_timing
    );
    let c = cl.client(1);
    let execs: Vec<(u32, String)> = (0..SHARDS)
        .map(|s| {
            let key = key_on_shard(&format!("fo-{s}"), s, SHARDS);
            let v: Value = c.start(&json!({"workflow": "w", "routing_key": key}));
            (s, v["execution_id"].as_str().expect("id").to_string())
        })
        .collect();
    let (mut detect, mut elect, mut first_ack, mut gaps) = (vec![], vec![], vec![], vec![]);
    for round in 0..ROUNDS {
        let leaders = cl.wait_leaders_known(1, &[]);
        let victim = leaders[0].0;
        let affected: Vec<u32> = (0..SHARDS)
            .filter(|s| leaders[*s as usize].0 == victim)
            .collect();
        let survivors: Vec<u16> = (1..=NODES).filter(|n| *n != victim).collect();
        // One writer per shard the victim leads, through the survivors.
        let shared: Vec<Shared> = affected.iter().map(|_| Shared::default()).collect();
        let writers: Vec<_> = affected
            .iter()
            .zip(&shared)
            .map(|(s, sh)| {
                let s = *s;
                let exec = vec![execs[s as usize].1.clone()];
                let via: Vec<Client> = survivors.iter().map(|n| cl.client(*n)).collect();
                let sh = sh.clone();
                std::thread::spawn(move || writer(via, exec, format!("r{round}s{s}"), sh, false))
            })
            .collect();
        wait_until("writes before the kill", Duration::from_secs(10), || {
            shared.iter().all(|s| s.acks() >= 20).then_some(())
        });
        let killed = Instant::now();
        let mut stopping = None;
        if on_purpose {
            let p = cl.node_mut(victim).proc.take().expect("the leader runs");
            p.sigterm();
            stopping = Some(p);
        } else {
            cl.kill9(victim);
        }
        let (mut detected, mut elected) = (None, None);
        while elected.is_none() && killed.elapsed() < Duration::from_secs(10) {
            for n in &survivors {
                let Some(v) = view(&cl, *n) else { continue };
                let s0 = &v[0];
                if detected.is_none() && (s0.0 != Some(u64::from(victim)) || s0.2 == "candidate") {
                    detected = Some(killed.elapsed());
                }
                if s0.0.is_some_and(|l| l != u64::from(victim)) && s0.1 > leaders[0].1 {
                    elected = Some(killed.elapsed());
                }
            }
            std::thread::sleep(Duration::from_millis(2));
        }
        let gone = match stopping.as_mut() {
            Some(p) => {
                let exit = p.wait_exit(Duration::from_secs(10));
                assert!(
                    exit.is_some_and(|e| e.success()),
                    "SIGTERM: {exit:?}; its log's end:\n{}",
                    last_lines(&strip_ansi(&p.log()), 60)
                );
                Instant::now()
            }
            None => killed,
        };
        let stopped_log = stopping
            .as_ref()
            .map(|p| last_lines(&strip_ansi(&p.log()), 80));
        let after = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
            wait_until("writes after the kill", Duration::from_secs(10), || {
                shared
                    .iter()
                    .all(|s| {
                        s.log.lock().expect("log").iter().any(|b| {
                            matches!(b.outcome, Outcome::Acked { .. }) && b.answered_at > gone
                        })
                    })
                    .then_some(())
            })
        }));
        if after.is_err() {
            let acks: Vec<usize> = shared.iter().map(Shared::acks).collect();
            panic!(
                "no write acknowledged on every affected shard {affected:?} within 10 s (acks {acks:?}); the stopped node's log:\n{}\n{}",
                stopped_log.unwrap_or_default(),
                cl.summary()
            );
        }
        for sh in &shared {
            sh.stop.set();
        }
        for w in writers {
            w.join()
                .expect("writer")
                .expect("the API kept its promises");
        }
        let logs: Vec<_> = shared.iter().map(Shared::take).collect();
        let gap = logs
            .iter()
            .map(|log| longest_without_ack(log, killed).unwrap_or_default())
            .max()
            .expect("an affected shard");
        let acked = logs
            .iter()
            .map(|log| {
                log.iter()
                    .filter(|b| {
                        matches!(b.outcome, Outcome::Acked { .. }) && b.answered_at > killed
                    })
                    .map(|b| b.answered_at.duration_since(killed))
                    .min()
                    .expect("an ack after the kill")
            })
            .max()
            .expect("an affected shard");
        let (d, e) = (detected.expect("detected"), elected.expect("elected"));
        eprintln!(
            "round {round}: node {victim} (shards {affected:?}): detected {d:?}, elected {e:?}, every affected shard acknowledging {acked:?}, longest without an ack {gap:?}"
        );
        gaps.push(gap);
        let not_acked: Vec<_> = logs
            .iter()
            .flatten()
            .filter(|b| !matches!(b.outcome, Outcome::Acked { .. }) && b.answered_at > killed)
            .map(|b| {
                format!(
                    "{:?} {:?} after {:?}: {}",
                    b.outcome,
                    b.status,
                    b.answered_at.duration_since(killed),
                    b.error
                )
            })
            .collect();
        if !not_acked.is_empty() {
            eprintln!("  not acknowledged: {not_acked:?}");
        }
        detect.push(d);
        elect.push(e);
        first_ack.push(acked);
        cl.spawn(victim, &cl.node(victim).config.clone());
        cl.wait_ready(victim);
        cl.wait_leaders_known(victim, &[]);
        // As a rolling restart does: the node back has caught up before
        // the next one goes.
        cl.wait_replicas_level();
    }
    eprintln!(
        "failover over {ROUNDS} {}: detection p50 {:?} max {:?}; election p50 {:?} max {:?}; first acknowledged write p50 {:?} max {:?}; longest without an acknowledged write p50 {:?} max {:?}",
        if on_purpose { "SIGTERMs" } else { "kills" },
        pct(&mut detect, 0.5),
        pct(&mut detect, 1.0),
        pct(&mut elect, 0.5),
        pct(&mut elect, 1.0),
        pct(&mut first_ack, 0.5),
        pct(&mut first_ack, 1.0),
        pct(&mut gaps, 0.5),
        pct(&mut gaps, 1.0),
    );
}

/// The last `n` lines of a node's log that are its own (not openraft's).
fn last_lines(log: &str, n: usize) -> String {
    let own: Vec<&str> = log.lines().filter(|l| !l.contains("openraft")).collect();
    own[own.len().saturating_sub(n)..].join("\n")
}
