//! Faults of the links between nodes that network namespaces cannot make,
//! from the fault-injecting proxies every link between two nodes goes
//! through, Raft and HTTP (probes, forwarded requests) alike
//! (`forkless_it::faultproxy`): three nodes, two shards replicated on all
//! three, a writer through every node (a write for a shard another node
//! leads is forwarded to it, through the faults), and rounds of
//! - a leader that hears nothing (every link into it cut, its own still
//!   sending: the case a plain Raft leader survives as a leader that can
//!   commit nothing, its heartbeats keeping the followers from electing),
//! - a leader that cannot send (every link out of it cut),
//! - a follower that hears nothing, and one that cannot send,
//! - one direction between a leader and one follower cut,
//! - every link slow (delay with jitter),
//! - every link losing chunks (each lost one held a retransmission
//!   timeout, and everything behind it),
//! - connections reset again and again,
//!
//! in an order drawn from a printed seed (`FORKLESS_FAULT_SEED` replays
//! it). During each fault every shard must go on acknowledging writes (the
//! nodes that can talk both ways are a majority of every shard); afterwards
//! every acknowledged write is at its seq on every node, nothing refused
//! or never sent is there, unknown outcomes settle by a retry with the
//! same idempotency keys, and every replica holds the same events on disk.

use forkless_it::faultproxy::LinkFault;
use forkless_it::workload::{
    assert_faulted, fault_seed, settle_unknowns, start_spread, verify, writer, Outcome, Rng, Shared,
};
use forkless_it::*;
use std::time::{Duration, Instant};

const NODES: u16 = 3;
const SHARDS: u32 = 2;
/// Acknowledgements every shard must take while each fault is on.
const ACKS_PER_SHARD: usize = 40;
/// Acknowledgements in all a fault is held on for (so that enough
/// operations meet it: a slow or lossy link for a while, not a moment).
const ACKS_PER_FAULT: usize = 300;
/// How long a shard may take to reach them (a failover included).
const ACKS_WITHIN: Duration = Duration::from_secs(25);

#[derive(Debug, Clone, Copy, PartialEq)]
enum Fault {
    /// Every link into the node cut: it sends, and hears nothing.
    Deaf(u16),
    /// Every link out of the node cut: it hears, and nothing it sends
    /// arrives.
    Mute(u16),
    /// The one direction from the first node to the second cut.
    OneWay(u16, u16),
    /// Every link delayed 20 ms, plus up to 30 ms more.
    Slow,
    /// Every link losing 3% of its chunks.
    Lossy,
    /// Every connection between two nodes reset every 300 ms.
    Resets,
}

/// Acknowledged batches per shard answered since `since`.
fn acks_since(shared: &Shared, since: Instant) -> Vec<usize> {
    let mut per = vec![0; SHARDS as usize];
    for b in shared.log.lock().expect("the writers' log").iter() {
        if b.answered_at >= since && matches!(b.outcome, Outcome::Acked { .. }) {
            per[shard_of_id(&b.exec, SHARDS) as usize] += 1;
        }
    }
    per
}

#[test]
fn one_way_cuts_delay_loss_and_resets_lose_nothing_and_every_shard_serves() {
    let _deadline = deadline("link faults: three nodes", Duration::from_secs(300));
    let seed = fault_seed();
    eprintln!("link fault seed {seed} (replay with FORKLESS_FAULT_SEED={seed})");
    let mut rng = Rng(seed);
    let mut cl = Cluster::prepare_behind_proxies(NODES, SHARDS, 3, PeerTiming::default());
    let ids = cl.start_all_replicated();
    let c = cl.client(1);
    let execs = start_spread(&c, "links", 6, SHARDS);
    let shared = Shared::default();
    let writers: Vec<_> = ids
        .iter()
        .map(|n| {
            let mine: Vec<String> = (0..2)
                .map(|k| execs[(2 * *n as usize + k) % execs.len()].clone())
                .collect();
            let (via, shared) = (vec![cl.client(*n)], shared.clone());
            let tag = format!("w{n}");
            std::thread::spawn(move || writer(via, mine, tag, shared, false))
        })
        .collect();
    // Waits until every shard has taken `per_shard` acknowledgements, and
    // all of them `total`, since the call; returns when each shard had
    // its `per_shard`.
    let served = |what: &str, cl: &Cluster, per_shard: usize, total: usize| {
        let since = Instant::now();
        let until = since + ACKS_WITHIN;
        let mut each = None;
        loop {
            let per = acks_since(&shared, since);
            if each.is_none() && per.iter().all(|n| *n >= per_shard) {
                each = Some(since.elapsed());
            }
            if let Some(each) = each.filter(|_| per.iter().sum::<usize>() >= total) {
                return each;
            }
            if Instant::now() > until {
                panic!(
                    "{what}: acknowledgements per shard {per:?} in {ACKS_WITHIN:?}, wanted {per_shard} each and {total} in all (seed {seed})\n{}",
                    cl.logs()
                );
            }
            std::thread::sleep(Duration::from_millis(20));
        }
    };
    served("before the faults", &cl, ACKS_PER_SHARD, 0);

    // Each kind once, in an order from the seed; the node a one-sided
    // fault strikes is a shard's leader or a follower, from the seed too.
    let mut kinds: Vec<u64> = (0..8).collect();
    for i in (1..kinds.len()).rev() {
        kinds.swap(i, rng.below(i as u64 + 1) as usize);
    }
    let faults = cl.faults.clone().expect("the cluster is behind proxies");
    let mut windows = Vec::new();
    for (round, kind) in kinds.into_iter().enumerate() {
        let leaders = cl.wait_leaders_known(1 + rng.below(NODES as u64) as u16, &[]);
        let leader = leaders[rng.below(SHARDS as u64) as usize].0;
        let follower = ids
            .iter()
            .copied()
            .filter(|n| *n != leader)
            .nth(rng.below(NODES as u64 - 1) as usize)
            .expect("a follower");
        let fault = match kind {
            0 => Fault::Deaf(leader),
            1 => Fault::Mute(leader),
            2 => Fault::Deaf(follower),
            3 => Fault::Mute(follower),
            4 => {
                if rng.below(2) == 0 {
                    Fault::OneWay(leader, follower)
                } else {
                    Fault::OneWay(follower, leader)
                }
            }
            5 => Fault::Slow,
            6 => Fault::Lossy,
            _ => Fault::Resets,
        };
        eprintln!("round {round}: {fault:?} (leaders before: {leaders:?})");
        let struck = Instant::now();
        match fault {
            Fault::Deaf(n) => faults.cut_into(n),
            Fault::Mute(n) => faults.cut_out_of(n),
            Fault::OneWay(a, b) => faults.link(
                a,
                b,
                LinkFault {
                    cut: true,
                    ..LinkFault::default()
                },
            ),
            Fault::Slow => faults.all(LinkFault {
                delay: Duration::from_millis(20),
                jitter: Duration::from_millis(30),
                ..LinkFault::default()
            }),
            Fault::Lossy => faults.all(LinkFault {
                loss_per_mille: 30,
                ..LinkFault::default()
            }),
            Fault::Resets => {}
        }
        let took = if fault == Fault::Resets {
            // Reset from a thread of its own while the shards must serve.
            let stop = Stop::default();
            let resets = {
                let stop = stop.clone();
                let pairs = [(1u16, 2u16), (2, 3), (1, 3)];
                let f = faults.clone();
                std::thread::spawn(move || {
                    let mut i = 0;
                    while !stop.is_set() {
                        let (a, b) = pairs[i % pairs.len()];
                        f.reset(a, b);
                        i += 1;
                        std::thread::sleep(Duration::from_millis(100));
                    }
                    i
                })
            };
            let took = served(
                &format!("round {round} ({fault:?})"),
                &cl,
                ACKS_PER_SHARD,
                ACKS_PER_FAULT,
            );
            stop.set();
            let n = resets.join().expect("the reset thread");
            eprintln!("  {n} resets");
            took
        } else {
            served(
                &format!("round {round} ({fault:?})"),
                &cl,
                ACKS_PER_SHARD,
                ACKS_PER_FAULT,
            )
        };
        // (What node 1 sees now, not waited for: the fault may leave it
        // knowing no leader of a shard, rightly, as when a one-way cut
        // into it holds back the answers of a shard's new leader.)
        eprintln!(
            "  every shard took {ACKS_PER_SHARD} acknowledgements within {took:?}; (leader, term) of each shard as node 1 sees them now: {:?}",
            leaders_seen_by(&cl, 1)
        );
        faults.heal_all();
        let healed = Instant::now();
        for id in &ids {
            cl.wait_leaders_known(*id, &[]);
        }
        windows.push((fault, struck, healed));
        served(&format!("after round {round} ({fault:?})"), &cl, 20, 0);
    }
    eprintln!("chunks held back as lost: {}", faults.lost());
    let mut batches = shared.finish(writers);
    let spans: Vec<_> = windows.iter().map(|(_, s, h)| (*s, *h)).collect();
    assert_faulted(&batches, &spans, 1000, seed);
    settle_unknowns(&cl.client(1), &mut batches);
    cl.wait_replicas_level();
    for n in &ids {
        let report = verify(&cl.client(*n), &execs, &batches);
        assert!(report.acked >= 300, "{report:?} (seed {seed})");
    }
    let counts = cl.stop_and_compare_replicas();
    assert_eq!(counts.len(), SHARDS as usize, "{counts:?}");
}

/// Each shard's (leader, term) as node `via`'s `/api/cluster` says now
/// (`None` for a shard it knows no leader of), or why it did not answer.
fn leaders_seen_by(cl: &Cluster, via: u16) -> Result<Vec<Option<(u64, u64)>>, String> {
    let r = cl
        .client(via)
        .try_req("GET", "/api/cluster", &[], None, Duration::from_secs(2))
        .map_err(|e| e.to_string())?;
    let v = r.json();
    Ok(v["shards"]
        .as_array()
        .into_iter()
        .flatten()
        .map(|s| Some((s["leader"].as_u64()?, s["term"].as_u64()?)))
        .collect())
}
