//! A randomized fault schedule on a five-node replicated cluster (four
//! shards, each a Raft group on three of the five nodes), under a steady
//! write load through every node: rounds of SIGKILL and restart, SIGSTOP
//! past the election timeout and SIGCONT, one node cut off from the
//! others, the nodes split 2/3 (the leader of a shard on either side),
//! a node's disk lost (SIGKILL, its data directory deleted, started
//! again empty), a node stopped on purpose (SIGTERM: it hands its
//! leaderships over and finishes its requests; started again), and a
//! node drained (`POST /api/cluster/drain`; undrained), and a shard's
//! replica moved to a node that held none (a Raft membership change
//! under the load, half the time with the shard's leader killed during
//! it, and then half of those not asked again until the next leader's
//! balancer repaired what the kill left (a learner left behind removed,
//! a change of voters cut short finished); moved back at heal, onto the
//! log the node kept), each healed
//! before the next. Groups snapshot every 100
//! entries and keep 20, so a node back from a fault usually catches up
//! by a snapshot. Afterwards every acknowledged
//! write is at its seq, nothing refused or never sent is there, every
//! replica of a shard holds the same events on disk, and a node cut off
//! alone acknowledged nothing while cut off (it holds one replica of
//! three of any shard: never a quorum).
//!
//! The schedule comes from a seed, printed first; `FORKLESS_FAULT_SEED=N`
//! replays one.

use forkless_it::workload::{
    assert_faulted, fault_seed, settle_unknowns, start_spread, verify, writer, Outcome, Rng, Shared,
};
use forkless_it::*;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

const NODES: u16 = 5;
const SHARDS: u32 = 4;
const FACTOR: u32 = 3;
const ROUNDS: usize = 6;

#[derive(Debug, Clone)]
enum Fault {
    Kill(u16),
    Pause(u16),
    Cut(u16),
    /// These nodes on one side, the rest on the other.
    Split(Vec<u16>),
    /// SIGKILL, the data directory deleted, started again empty.
    Wipe(u16),
    /// SIGTERM (a planned stop: leaderships handed over first), waited
    /// for, started again.
    Stop(u16),
    /// Drained (it leads nothing; still serves), then undrained.
    Drain(u16),
    /// A shard's replica moved from one node to one that held none
    /// (`POST /api/shards/{s}/replace`: a learner caught up, then the
    /// voters changed), and moved back at heal: the node it left holds a
    /// replica its group left behind until it is added again, over its
    /// old log. With `kill_leader`, the shard's leader then is killed
    /// (SIGKILL) while the move is under way, and started again at heal:
    /// the move, asked again (of the next leader), finishes or resumes the
    /// change its leader began. With `abandon` too, the move is not asked
    /// again at once (as an operator who gave up would): the next leader's
    /// balancer removes a learner it left or finishes a change of voters
    /// it cut short, and only then is it asked again.
    Move {
        shard: u32,
        from: u16,
        to: u16,
        kill_leader: Option<u16>,
        abandon: bool,
    },
}

/// Asserts that a move of shard `shard`'s replica from node `from` to
/// node `to` left `to` among its voters and `from` out of them.
fn assert_moved(
    cl: &Cluster,
    voters: Result<Vec<u16>, String>,
    shard: u32,
    from: u16,
    to: u16,
    seed: u64,
) {
    assert!(
        voters
            .as_ref()
            .is_ok_and(|v| v.contains(&to) && !v.contains(&from)),
        "shard {shard}'s voters after its move from node {from} to node {to}: {voters:?} (seed {seed})\n{}",
        cl.logs()
    );
}

/// Waits (at most 10 s) until node `leader` shows node `to` a learner of
/// shard `shard`'s group, or the move (`moving`) has ended.
fn learner_seen<T>(
    cl: &Cluster,
    leader: u16,
    shard: u32,
    to: u16,
    moving: &std::thread::JoinHandle<T>,
) {
    let c = cl.client(leader);
    let until = Instant::now() + Duration::from_secs(10);
    while Instant::now() < until && !moving.is_finished() {
        let learner = c
            .try_req("GET", "/api/cluster", &[], None, Duration::from_secs(2))
            .is_ok_and(|r| {
                r.json()["shards"][shard as usize]["raft"]["learners"]
                    .as_array()
                    .is_some_and(|l| l.iter().any(|n| n.as_u64() == Some(u64::from(to))))
            });
        if learner {
            return;
        }
        std::thread::sleep(Duration::from_millis(5));
    }
}

/// Waits (at most 30 s) until the leader of shard `shard`, seen through
/// one of the `live` nodes, leads a group with no learners and not in the
/// middle of a change of its voters: what a
/// move its killed leader left (a learner, or a joint configuration) is
/// repaired by the next leader's balancer with no move asked
/// (`[raft] learner_kept_s` 2 s here; a joint one is finished after 2 s).
fn wait_repaired(cl: &Cluster, live: &[u16], shard: u32, seed: u64) {
    let until = Instant::now() + Duration::from_secs(30);
    let mut seen = Vec::new();
    loop {
        seen.clear();
        for n in live {
            let Ok(r) =
                cl.client(*n)
                    .try_req("GET", "/api/cluster", &[], None, Duration::from_secs(2))
            else {
                continue;
            };
            let v = r.json();
            let s = &v["shards"][shard as usize];
            let raft = &s["raft"];
            if raft["state"] == "leader" {
                if raft["joint"] == false
                    && raft["learners"].as_array().is_some_and(|l| l.is_empty())
                {
                    eprintln!(
                        "shard {shard} repaired: node {n} leads it, voters {}",
                        raft["voters"]
                    );
                    return;
                }
                seen.push(format!("node {n}: {raft}"));
            }
        }
        assert!(
            Instant::now() < until,
            "shard {shard}'s leader did not repair what its killed leader's move left within 30 s: {seen:?} (seed {seed})\n{}",
            cl.logs()
        );
        std::thread::sleep(Duration::from_millis(100));
    }
}

/// Moves shard `shard`'s replica from node `from` to node `to`, asking
/// the nodes of `via` in turn (each forwards to the shard's leader) while
/// the answer is a 503 or 421 (a leader changing: the move is
/// resumable) or none comes, for at most 60 s, or until `give_up` is set;
/// returns the group's voters after it, or what the last ask said.
fn move_replica(
    via: &[Client],
    shard: u32,
    from: u16,
    to: u16,
    give_up: Option<&AtomicBool>,
) -> Result<Vec<u16>, String> {
    let body = serde_json::json!({"from": from, "to": to}).to_string();
    let until = Instant::now() + Duration::from_secs(60);
    for c in via.iter().cycle() {
        let r = c.try_req(
            "POST",
            &format!("/api/shards/{shard}/replace"),
            &[],
            Some(body.as_bytes()),
            Duration::from_secs(30),
        );
        let said = match r {
            Ok(r) if r.status == 200 => {
                let v = r.json();
                return Ok(v["voters"]
                    .as_array()
                    .into_iter()
                    .flatten()
                    .filter_map(|n| n.as_u64().map(|n| n as u16))
                    .collect());
            }
            Ok(r) if r.status == 503 || r.status == 421 => format!("{} {}", r.status, r.text()),
            Ok(r) => return Err(format!("{} {}", r.status, r.text())),
            Err(e) => e.to_string(),
        };
        let said = format!(
            "moving shard {shard}'s replica from node {from} to node {to} through {}: {said}",
            c.addr
        );
        if Instant::now() > until || give_up.is_some_and(|g| g.load(Ordering::Acquire)) {
            return Err(said);
        }
        eprintln!("{said}; asking again");
        std::thread::sleep(Duration::from_millis(200));
    }
    Err("no node to ask".into())
}

#[test]
fn random_faults_on_five_nodes_lose_no_acknowledged_write() {
    let _deadline = deadline("faults: five nodes", Duration::from_secs(400));
    let seed = fault_seed();
    eprintln!("fault schedule seed {seed} (replay with FORKLESS_FAULT_SEED={seed})");
    let mut rng = Rng(seed);
    let lab = netlab::NetLab::new(NODES);
    let mut cl = Cluster::prepare_in_lab(&lab, SHARDS, FACTOR, PeerTiming::default());
    cl.raft_log = Some((100, 20));
    // A learner a move cut short left (its leader killed mid-move) is
    // removed within seconds, so that the removal meets the moves asked
    // again (which take their learner up, or add it again).
    cl.raft_learner_kept_s = Some(2);
    let ids = cl.start_all_replicated();
    let c = cl.client(1);
    // Leaders are being handed to their preferred replicas just after
    // start: a start is retried (same idempotency key) while its shard is
    // between leaders.
    let execs = start_spread(&c, "faults", 8, SHARDS);
    // One writer through each node: some always through a faulted one.
    let shared = Shared::default();
    let writers: Vec<_> = ids
        .iter()
        .map(|n| {
            let mine: Vec<String> = (0..3)
                .map(|k| execs[(*n as usize + k) % execs.len()].clone())
                .collect();
            let (via, shared) = (vec![cl.client(*n)], shared.clone());
            let tag = format!("w{n}");
            std::thread::spawn(move || writer(via, mine, tag, shared, false))
        })
        .collect();
    let grew = |by: usize, what: &str| {
        let from = shared.acks();
        wait_until(what, Duration::from_secs(30), || {
            (shared.acks() >= from + by).then_some(())
        });
    };
    grew(100, "100 acknowledged writes before the faults");

    // (fault, when it struck, when it was healed)
    let mut windows = Vec::new();
    for round in 0..ROUNDS {
        let leaders = cl.wait_leaders_known(1 + rng.below(NODES as u64) as u16, &[]);
        // Half the faults strike a shard's leader, half any node.
        let target = if rng.below(2) == 0 {
            leaders[rng.below(SHARDS as u64) as usize].0
        } else {
            1 + rng.below(NODES as u64) as u16
        };
        let fault = match rng.below(8) {
            0 => Fault::Kill(target),
            1 => Fault::Pause(target),
            2 => Fault::Cut(target),
            3 => Fault::Wipe(target),
            4 => Fault::Stop(target),
            5 => Fault::Drain(target),
            6 => {
                // A replica of a shard `target` holds (its leader's, half
                // the time) to a node that holds none.
                let members = cl.shard_voters();
                let held: Vec<u32> = (0..SHARDS)
                    .filter(|s| members[&u64::from(*s)].voters.contains(&target))
                    .collect();
                if held.is_empty() {
                    // (Not with this placement: every node holds some.)
                    Fault::Kill(target)
                } else {
                    let shard = held[rng.below(held.len() as u64) as usize];
                    let now = &members[&u64::from(shard)];
                    let outside: Vec<u16> = ids
                        .iter()
                        .copied()
                        .filter(|n| !now.voters.contains(n))
                        .collect();
                    let to = outside[rng.below(outside.len() as u64) as usize];
                    // The shard's leader now (never the target: the move
                    // waits for it to catch up).
                    let kill_leader = (rng.below(2) == 0)
                        .then_some(now.leader)
                        .filter(|l| *l != to);
                    let abandon = kill_leader.is_some() && rng.below(2) == 0;
                    Fault::Move {
                        shard,
                        from: target,
                        to,
                        kill_leader,
                        abandon,
                    }
                }
            }
            _ => {
                let mut side = vec![target];
                while side.len() < 2 {
                    let n = 1 + rng.below(NODES as u64) as u16;
                    if !side.contains(&n) {
                        side.push(n);
                    }
                }
                Fault::Split(side)
            }
        };
        eprintln!("round {round}: {fault:?} (leaders before: {leaders:?})");
        let struck = Instant::now();
        match &fault {
            Fault::Kill(n) => cl.kill9(*n),
            Fault::Wipe(n) => {
                cl.kill9(*n);
                let data = cl.node(*n).data_dir.clone();
                std::fs::remove_dir_all(&data).expect("deleted the node's data directory");
            }
            Fault::Pause(n) => cl.node(*n).proc().sigstop(),
            Fault::Cut(n) => lab.cut(*n),
            Fault::Split(side) => lab.split(side),
            Fault::Stop(n) => {
                // A stop waits at most 2 s for the handover, then for the
                // requests in flight (a write waits at most 10 s).
                cl.node(*n).proc().sigterm();
                let exit = cl
                    .node_mut(*n)
                    .proc
                    .as_mut()
                    .expect("the node runs")
                    .wait_exit(Duration::from_secs(30));
                assert!(
                    exit.is_some_and(|e| e.success()),
                    "node {n} did not stop cleanly within 30 s of SIGTERM: {exit:?} (seed {seed})\n{}",
                    cl.logs()
                );
            }
            Fault::Drain(n) => {
                cl.drain_node(*n, true);
            }
            Fault::Move {
                shard,
                from,
                to,
                kill_leader,
                abandon,
            } => {
                // Asked of every node in turn but the one to be killed.
                let live: Vec<u16> = ids
                    .iter()
                    .copied()
                    .filter(|n| Some(*n) != *kill_leader)
                    .collect();
                let via: Vec<Client> = live.iter().map(|n| cl.client(*n)).collect();
                let (shard, from, to) = (*shard, *from, *to);
                let give_up = Arc::new(AtomicBool::new(false));
                let moving = {
                    let (via, give_up) = (via.clone(), give_up.clone());
                    std::thread::spawn(move || move_replica(&via, shard, from, to, Some(&give_up)))
                };
                if let Some(l) = kill_leader {
                    if *abandon {
                        // While its learner catches up: the move leaves
                        // the learner for the next leader to remove.
                        learner_seen(&cl, *l, shard, to, &moving);
                    } else {
                        // Somewhere in the move: the learner's catch-up,
                        // the change of voters, or just after.
                        std::thread::sleep(Duration::from_millis(rng.below(400)));
                    }
                    cl.kill9(*l);
                    give_up.store(*abandon, Ordering::Release);
                }
                let voters = moving.join().expect("the move's thread");
                let voters = if *abandon && voters.is_err() {
                    eprintln!("round {round}: the move left as the kill left it: {voters:?}");
                    wait_repaired(&cl, &live, shard, seed);
                    move_replica(&via, shard, from, to, None)
                } else {
                    voters
                };
                assert_moved(&cl, voters, shard, from, to, seed);
            }
        }
        // The majority side elects where it must and serves; wait for it
        // through a node the fault left alone, for a node faulted alone.
        let faulted: Vec<u16> = match &fault {
            Fault::Kill(n)
            | Fault::Pause(n)
            | Fault::Cut(n)
            | Fault::Wipe(n)
            | Fault::Stop(n)
            | Fault::Drain(n) => vec![*n],
            Fault::Split(side) => side.clone(),
            Fault::Move { kill_leader, .. } => kill_leader.iter().copied().collect(),
        };
        if faulted.len() == 1 {
            let healthy = ids
                .iter()
                .copied()
                .find(|n| !faulted.contains(n))
                .expect("a healthy node");
            cl.wait_leaders_known(healthy, &faulted);
        }
        // Held on for 150 acknowledgements (not only until the majority
        // elects, which takes under a second): enough operations meet
        // each fault.
        grew(
            150,
            &format!("150 acknowledged writes during round {round}'s fault"),
        );
        let healed = Instant::now();
        match &fault {
            Fault::Kill(n) | Fault::Wipe(n) | Fault::Stop(n) => {
                let cfg = cl.node(*n).config.clone();
                cl.spawn(*n, &cfg);
                cl.wait_ready(*n);
                if let Fault::Wipe(_) = fault {
                    // A lost disk is healed once the node caught up: until
                    // then its shards have a copy fewer, and a second
                    // fault would be two (the new replica votes for no
                    // candidate with entries meanwhile, so a shard that
                    // needs its vote waits rather than risk an entry).
                    let c = cl.client(*n);
                    let deadline = Instant::now() + Duration::from_secs(60);
                    while none_fresh(&c).is_none() {
                        if Instant::now() > deadline {
                            let clusters: String = ids
                                .iter()
                                .map(|id| {
                                    let v = cl
                                        .client(*id)
                                        .try_req(
                                            "GET",
                                            "/api/cluster",
                                            &[],
                                            None,
                                            Duration::from_secs(2),
                                        )
                                        .map(|r| r.json().to_string())
                                        .unwrap_or_else(|e| format!("{e:?}"));
                                    format!("---- node {id} /api/cluster ----\n{v}\n")
                                })
                                .collect();
                            panic!(
                                "timed out after 60s waiting for node {n} caught up after its disk was lost (seed {seed})\n{clusters}{}",
                                cl.logs()
                            );
                        }
                        std::thread::sleep(Duration::from_millis(10));
                    }
                }
            }
            Fault::Pause(n) => cl.node(*n).proc().sigcont(),
            Fault::Cut(_) | Fault::Split(_) => lab.heal_all(),
            Fault::Drain(n) => {
                cl.drain_node(*n, false);
            }
            Fault::Move {
                shard,
                from,
                to,
                kill_leader,
                ..
            } => {
                if let Some(l) = kill_leader {
                    let cfg = cl.node(*l).config.clone();
                    cl.spawn(*l, &cfg);
                    cl.wait_ready(*l);
                }
                let via: Vec<Client> = ids.iter().map(|n| cl.client(*n)).collect();
                let voters = move_replica(&via, *shard, *to, *from, None);
                assert_moved(&cl, voters, *shard, *to, *from, seed);
            }
        }
        for id in &ids {
            cl.wait_leaders_known(*id, &[]);
        }
        windows.push((fault, struck, healed));
        grew(50, &format!("50 acknowledged writes after round {round}"));
    }
    let batches = shared.finish(writers);
    let spans: Vec<_> = windows.iter().map(|(_, s, h)| (*s, *h)).collect();
    assert_faulted(&batches, &spans, 1000, seed);
    // A node cut off alone holds one replica of three: it can acknowledge
    // nothing (a write in flight at the cut may finish just after it).
    for (fault, struck, healed) in &windows {
        if let Fault::Cut(n) = fault {
            let alone = *struck + Duration::from_millis(500)..*healed;
            let tag = format!("w{n}-");
            let acked: Vec<_> = batches
                .iter()
                .filter(|b| b.markers[0].starts_with(&tag) && alone.contains(&b.answered_at))
                .filter(|b| matches!(b.outcome, Outcome::Acked { .. }))
                .collect();
            assert!(
                acked.is_empty(),
                "node {n}, cut off, acknowledged {acked:?} (seed {seed})"
            );
        }
    }
    // Unknown outcomes settled: retried whole with the same keys.
    let mut batches = batches;
    settle_unknowns(&cl.client(1), &mut batches);
    cl.wait_replicas_level();
    for n in &ids {
        let report = verify(&cl.client(*n), &execs, &batches);
        assert!(report.acked >= 300, "{report:?} (seed {seed})");
    }
    let counts = cl.stop_and_compare_replicas();
    assert_eq!(counts.len(), SHARDS as usize, "{counts:?}");
    // How often the membership's repairs ran (rare paths, reached by
    // chance: a fault loop reads this line).
    let logs = cl.logs();
    eprintln!(
        "membership repairs the nodes logged: {} changes of voters finished, {} removals of learners left behind",
        logs.matches("finished a change of voters its leader had cut short")
            .count(),
        logs.matches("removed learners that moves cut short left behind")
            .count()
    );
}
