//! forkless-raftidle: how much CPU does openraft itself burn when nothing happens?
//!
//! One process hosts 3 "nodes" x G Raft groups (every group has a replica on each node, so 3*G
//! `Raft` instances) on one tokio runtime with 2 worker threads. Storage is in memory (the flush
//! callback fires at once) and RPCs are delivered in-process by calling the target's `Raft`
//! handle, so what is measured is openraft's own cost: ticks, heartbeats, the tasks behind them.
//! A real node also pays for syscalls and serialization; this is a lower bound.
//!
//! After every group has a leader and has applied the leader's blank entry on all three replicas,
//! the process's CPU time (getrusage, user + sys) is taken over `--seconds` of idle.

use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::io;
use std::ops::RangeBounds;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, RwLock};
use std::time::{Duration, Instant};

use futures_util::{Stream, StreamExt};
use openraft::async_runtime::WatchReceiver;
// `openraft::alias` is only re-exported with feature `type-alias`; the module itself is public.
use openraft::errors::{RPCError, ReplicationClosed, StreamingError, Unreachable};
use openraft::network::RPCOption;
use openraft::raft::{
    AppendEntriesRequest, AppendEntriesResponse, SnapshotResponse, VoteRequest, VoteResponse,
};
use openraft::storage::{
    EntryResponder, IOFlushed, RaftLogStorage, RaftSnapshotBuilder, RaftStateMachine,
};
use openraft::type_config::alias::{
    EntryOf, LogIdOf, SnapshotMetaOf, SnapshotOf, StoredMembershipOf, VoteOf,
};
use openraft::{
    Config, EmptyNode, EntryPayload, LogState, OptionalSend, Raft, RaftLogReader,
    RaftNetworkFactory, RaftNetworkV2, Snapshot, SnapshotMeta, StoredMembership,
};

openraft::declare_raft_types!(
    pub TC:
        D = String,
        R = (),
        Node = EmptyNode,
        LeaderId = openraft::impls::leader_id_std::LeaderId<Self::Term, Self::NodeId>,
);

type NodeId = u64;
type Group = u32;
type SnapData = Vec<u8>;
type Handle = Raft<TC, StateMachine>;

// ---------------------------------------------------------------------------------------------
// Log storage: a BTreeMap in memory.

#[derive(Default)]
struct LogInner {
    vote: Option<VoteOf<TC>>,
    committed: Option<LogIdOf<TC>>,
    last_purged: Option<LogIdOf<TC>>,
    log: BTreeMap<u64, EntryOf<TC>>,
}

#[derive(Clone, Default)]
struct LogStore(Arc<Mutex<LogInner>>);

impl LogStore {
    fn inner(&self) -> std::sync::MutexGuard<'_, LogInner> {
        self.0.lock().unwrap()
    }
}

impl RaftLogReader<TC> for LogStore {
    async fn try_get_log_entries<RB>(&mut self, range: RB) -> Result<Vec<EntryOf<TC>>, io::Error>
    where
        RB: RangeBounds<u64> + Clone + std::fmt::Debug + OptionalSend,
    {
        Ok(self
            .inner()
            .log
            .range(range)
            .map(|(_, e)| e.clone())
            .collect())
    }

    async fn read_vote(&mut self) -> Result<Option<VoteOf<TC>>, io::Error> {
        Ok(self.inner().vote)
    }
}

impl RaftLogStorage<TC> for LogStore {
    type LogReader = LogStore;

    async fn get_log_state(&mut self) -> Result<LogState<TC>, io::Error> {
        let inner = self.inner();
        let last_purged_log_id = inner.last_purged;
        let last_log_id = inner
            .log
            .values()
            .next_back()
            .map(|e| e.log_id)
            .or(last_purged_log_id);
        Ok(LogState {
            last_purged_log_id,
            last_log_id,
        })
    }

    async fn get_log_reader(&mut self) -> Self::LogReader {
        self.clone()
    }

    async fn save_vote(&mut self, vote: &VoteOf<TC>) -> Result<(), io::Error> {
        self.inner().vote = Some(*vote);
        Ok(())
    }

    async fn save_committed(&mut self, committed: Option<LogIdOf<TC>>) -> Result<(), io::Error> {
        self.inner().committed = committed;
        Ok(())
    }

    async fn read_committed(&mut self) -> Result<Option<LogIdOf<TC>>, io::Error> {
        Ok(self.inner().committed)
    }

    async fn append<I>(&mut self, entries: I, callback: IOFlushed<TC>) -> Result<(), io::Error>
    where
        I: IntoIterator<Item = EntryOf<TC>> + OptionalSend,
        I::IntoIter: OptionalSend,
    {
        {
            let mut inner = self.inner();
            for e in entries {
                inner.log.insert(e.log_id.index, e);
            }
        }
        callback.io_completed(Ok(()));
        Ok(())
    }

    async fn truncate_after(&mut self, last_log_id: Option<LogIdOf<TC>>) -> Result<(), io::Error> {
        let mut inner = self.inner();
        match last_log_id {
            Some(l) => drop(inner.log.split_off(&(l.index + 1))),
            None => inner.log.clear(),
        }
        Ok(())
    }

    async fn purge(&mut self, log_id: LogIdOf<TC>) -> Result<(), io::Error> {
        let mut inner = self.inner();
        inner.log = inner.log.split_off(&(log_id.index + 1));
        inner.last_purged = Some(log_id);
        Ok(())
    }
}

// ---------------------------------------------------------------------------------------------
// State machine: counts applied entries; a snapshot is an empty Vec.

#[derive(Default)]
struct StateMachine {
    last_applied: Option<LogIdOf<TC>>,
    membership: StoredMembershipOf<TC>,
    /// Shared by every state machine in the process.
    applied: Arc<AtomicU64>,
    current: Arc<Mutex<Option<SnapshotOf<TC, SnapData>>>>,
}

struct SnapBuilder {
    meta: SnapshotMetaOf<TC>,
    current: Arc<Mutex<Option<SnapshotOf<TC, SnapData>>>>,
}

impl RaftSnapshotBuilder<TC> for SnapBuilder {
    type SnapshotData = SnapData;

    async fn build_snapshot(&mut self) -> Result<SnapshotOf<TC, SnapData>, io::Error> {
        let snap = Snapshot {
            meta: self.meta.clone(),
            snapshot: Vec::new(),
        };
        *self.current.lock().unwrap() = Some(snap.clone());
        Ok(snap)
    }
}

impl RaftStateMachine<TC> for StateMachine {
    type SnapshotData = SnapData;
    type SnapshotBuilder = SnapBuilder;

    async fn applied_state(
        &mut self,
    ) -> Result<(Option<LogIdOf<TC>>, StoredMembershipOf<TC>), io::Error> {
        Ok((self.last_applied, self.membership.clone()))
    }

    async fn apply<Strm>(&mut self, mut entries: Strm) -> Result<(), io::Error>
    where
        Strm: Stream<Item = Result<EntryResponder<TC>, io::Error>> + Unpin + OptionalSend,
    {
        while let Some(item) = entries.next().await {
            let (entry, responder) = item?;
            self.last_applied = Some(entry.log_id);
            if let EntryPayload::Membership(m) = &entry.payload {
                self.membership = StoredMembership::new(Some(entry.log_id), m.clone());
            }
            self.applied.fetch_add(1, Ordering::Relaxed);
            if let Some(r) = responder {
                r.send(());
            }
        }
        Ok(())
    }

    async fn get_snapshot_builder(&mut self) -> Self::SnapshotBuilder {
        SnapBuilder {
            meta: SnapshotMeta {
                last_log_id: self.last_applied,
                last_membership: self.membership.clone(),
            },
            current: self.current.clone(),
        }
    }

    async fn install_snapshot(
        &mut self,
        meta: &SnapshotMetaOf<TC>,
        snapshot: SnapData,
    ) -> Result<(), io::Error> {
        self.last_applied = meta.last_log_id;
        self.membership = meta.last_membership.clone();
        *self.current.lock().unwrap() = Some(Snapshot {
            meta: meta.clone(),
            snapshot,
        });
        Ok(())
    }

    async fn get_current_snapshot(
        &mut self,
    ) -> Result<Option<SnapshotOf<TC, SnapData>>, io::Error> {
        Ok(self.current.lock().unwrap().clone())
    }
}

// ---------------------------------------------------------------------------------------------
// Network: in-process, by calling the target's Raft handle.

#[derive(Default)]
struct Counters {
    heartbeats: AtomicU64,
    appends: AtomicU64,
    votes: AtomicU64,
    pre_votes: AtomicU64,
    snapshots: AtomicU64,
    /// Entries applied by all state machines.
    applied: Arc<AtomicU64>,
}

#[derive(Default)]
struct Registry {
    rafts: RwLock<HashMap<(NodeId, Group), Handle>>,
    counters: Counters,
}

struct NetFactory {
    registry: Arc<Registry>,
    group: Group,
}

impl NetFactory {
    fn client(&self, target: NodeId, heartbeat: bool) -> Net {
        let target = self
            .registry
            .rafts
            .read()
            .unwrap()
            .get(&(target, self.group))
            .cloned();
        Net {
            registry: self.registry.clone(),
            target,
            heartbeat,
        }
    }
}

impl RaftNetworkFactory<TC> for NetFactory {
    type Network = Net;

    async fn new_client(&mut self, target: NodeId, _node: &EmptyNode) -> Net {
        self.client(target, false)
    }

    async fn new_heartbeat_client(&mut self, target: NodeId, _node: &EmptyNode) -> Net {
        self.client(target, true)
    }
}

struct Net {
    registry: Arc<Registry>,
    target: Option<Handle>,
    /// Made by `new_heartbeat_client`: everything it sends is a heartbeat.
    heartbeat: bool,
}

fn unreachable<E: std::error::Error + 'static>(e: E) -> Unreachable<TC> {
    Unreachable::new(&e)
}

impl Net {
    fn target(&self) -> Result<&Handle, Unreachable<TC>> {
        self.target
            .as_ref()
            .ok_or_else(|| Unreachable::from_string("no such replica"))
    }

    fn count(&self, c: &AtomicU64) {
        c.fetch_add(1, Ordering::Relaxed);
    }
}

impl RaftNetworkV2<TC> for Net {
    type SnapshotData = SnapData;

    async fn append_entries(
        &mut self,
        rpc: AppendEntriesRequest<TC>,
        _option: RPCOption,
    ) -> Result<AppendEntriesResponse<TC>, RPCError<TC>> {
        let resp = self
            .target()?
            .append_entries(rpc)
            .await
            .map_err(unreachable)?;
        let c = &self.registry.counters;
        self.count(if self.heartbeat {
            &c.heartbeats
        } else {
            &c.appends
        });
        Ok(resp)
    }

    async fn vote(
        &mut self,
        rpc: VoteRequest<TC>,
        _option: RPCOption,
    ) -> Result<VoteResponse<TC>, RPCError<TC>> {
        let resp = self.target()?.vote(rpc).await.map_err(unreachable)?;
        self.count(&self.registry.counters.votes);
        Ok(resp)
    }

    async fn pre_vote(
        &mut self,
        rpc: VoteRequest<TC>,
        _option: RPCOption,
    ) -> Result<VoteResponse<TC>, RPCError<TC>> {
        let resp = self.target()?.pre_vote(rpc).await.map_err(unreachable)?;
        self.count(&self.registry.counters.pre_votes);
        Ok(resp)
    }

    async fn full_snapshot(
        &mut self,
        vote: VoteOf<TC>,
        snapshot: SnapshotOf<TC, SnapData>,
        _cancel: impl std::future::Future<Output = ReplicationClosed> + OptionalSend + 'static,
        _option: RPCOption,
    ) -> Result<SnapshotResponse<TC>, StreamingError<TC>> {
        let resp = self
            .target()?
            .install_full_snapshot(vote, snapshot)
            .await
            .map_err(unreachable)?;
        self.count(&self.registry.counters.snapshots);
        Ok(resp)
    }
}

// ---------------------------------------------------------------------------------------------
// The benchmark.

struct Args {
    groups: u32,
    seconds: f64,
    heartbeat: u64,
    election_min: u64,
    election_max: u64,
    /// Turns every group's tick off once leaders are elected (openraft's
    /// `runtime_config().tick(false)`): what an idle group costs when it
    /// is quiesced, as a design that detects a dead leader per node, not
    /// per group, would leave it.
    quiesce: bool,
}

const USAGE: &str = "usage: forkless-raftidle [--groups N (64)] [--seconds S (10)] \
[--heartbeat-interval MS (50)] [--election-timeout-min MS (150)] [--election-timeout-max MS (300)] \
[--quiesce true|false (false)]";

fn parse_args() -> Args {
    let mut a = Args {
        groups: 64,
        seconds: 10.0,
        heartbeat: 50,
        election_min: 150,
        election_max: 300,
        quiesce: false,
    };
    let mut it = std::env::args().skip(1);
    while let Some(flag) = it.next() {
        if flag == "-h" || flag == "--help" {
            println!("{USAGE}");
            std::process::exit(0);
        }
        let value = it
            .next()
            .unwrap_or_else(|| die(&format!("{flag} needs a value")));
        match flag.as_str() {
            "--groups" => a.groups = parse(&flag, &value),
            "--seconds" => a.seconds = parse(&flag, &value),
            "--heartbeat-interval" => a.heartbeat = parse(&flag, &value),
            "--election-timeout-min" => a.election_min = parse(&flag, &value),
            "--election-timeout-max" => a.election_max = parse(&flag, &value),
            "--quiesce" => a.quiesce = parse(&flag, &value),
            _ => die(&format!("unknown flag {flag}")),
        }
    }
    a
}

fn parse<T: std::str::FromStr>(flag: &str, value: &str) -> T {
    value
        .parse()
        .unwrap_or_else(|_| die(&format!("bad value for {flag}: {value}")))
}

fn die(msg: &str) -> ! {
    eprintln!("{msg}\n{USAGE}");
    std::process::exit(2)
}

/// The process's CPU time so far, user + system.
fn cpu_time() -> Duration {
    let mut ru = std::mem::MaybeUninit::<libc::rusage>::zeroed();
    // SAFETY: getrusage writes a full `rusage` into the pointer it is given.
    let ru = unsafe {
        assert_eq!(libc::getrusage(libc::RUSAGE_SELF, ru.as_mut_ptr()), 0);
        ru.assume_init()
    };
    let tv = |t: libc::timeval| Duration::new(t.tv_sec as u64, t.tv_usec as u32 * 1000);
    tv(ru.ru_utime) + tv(ru.ru_stime)
}

const NODES: u64 = 3;

async fn run(args: Args) {
    let config = Config {
        cluster_name: "raftidle".to_string(),
        heartbeat_interval: args.heartbeat,
        election_timeout_min: args.election_min,
        election_timeout_max: args.election_max,
        enable_pre_vote: Some(true),
        enable_leader_restore: Some(false),
        ..Default::default()
    };
    let config = Arc::new(config.validate().unwrap_or_else(|e| die(&e.to_string())));
    let registry = Arc::new(Registry::default());

    let started = Instant::now();
    let mut rafts: Vec<Vec<Handle>> = Vec::new();
    for g in 0..args.groups {
        let mut replicas = Vec::new();
        for n in 0..NODES {
            let network = NetFactory {
                registry: registry.clone(),
                group: g,
            };
            let raft = Raft::new(
                n,
                config.clone(),
                network,
                LogStore::default(),
                StateMachine {
                    applied: registry.counters.applied.clone(),
                    ..Default::default()
                },
            )
            .await
            .expect("Raft::new");
            registry.rafts.write().unwrap().insert((n, g), raft.clone());
            replicas.push(raft);
        }
        rafts.push(replicas);
    }
    // Spread the first leaders over the nodes, as a real cluster would be balanced.
    let members: BTreeSet<NodeId> = (0..NODES).collect();
    for (g, replicas) in rafts.iter().enumerate() {
        replicas[g % NODES as usize]
            .initialize(members.clone())
            .await
            .expect("initialize");
    }
    // Ready: every replica knows a leader and has applied the leader's blank entry (index 1;
    // the initial membership is index 0).
    for replicas in &rafts {
        for raft in replicas {
            raft.wait(Some(Duration::from_secs(60)))
                .metrics(
                    |m| m.current_leader.is_some() && m.last_applied.is_some_and(|l| l.index >= 1),
                    "leader elected and blank entry applied",
                )
                .await
                .expect("group never got a leader");
        }
    }
    let ready_ms = started.elapsed().as_millis();
    let terms = |rafts: &[Vec<Handle>]| -> u64 {
        rafts
            .iter()
            .flatten()
            .map(|r| r.metrics().borrow_watched().current_term)
            .sum()
    };
    let mut leaders_per_node = [0u32; NODES as usize];
    for replicas in &rafts {
        let leader = replicas[0]
            .metrics()
            .borrow_watched()
            .current_leader
            .unwrap();
        leaders_per_node[leader as usize] += 1;
    }
    let terms_before = terms(&rafts);
    if args.quiesce {
        for r in rafts.iter().flatten() {
            r.runtime_config().tick(false);
        }
    }

    let c = &registry.counters;
    let snap = |c: &Counters| {
        [
            c.heartbeats.load(Ordering::Relaxed),
            c.appends.load(Ordering::Relaxed),
            c.votes.load(Ordering::Relaxed),
            c.pre_votes.load(Ordering::Relaxed),
            c.snapshots.load(Ordering::Relaxed),
            c.applied.load(Ordering::Relaxed),
        ]
    };
    let n0 = snap(c);
    let cpu0 = cpu_time();
    let t0 = Instant::now();
    tokio::time::sleep(Duration::from_secs_f64(args.seconds)).await;
    let cpu = cpu_time() - cpu0;
    let wall = t0.elapsed();
    let n1 = snap(c);
    let terms_after = terms(&rafts);

    let w = wall.as_secs_f64();
    let pct = cpu.as_secs_f64() / w * 100.0;
    let rate = |i: usize| (n1[i] - n0[i]) as f64 / w;
    println!(
        "groups={} quiesced={} heartbeat_ms={} election_ms={}-{} wall_s={:.2} cpu_process_pct={:.2} \
         cpu_per_node_pct={:.2} heartbeats_per_s={:.0} other_appends_per_s={:.1} \
         votes={} pre_votes={} snapshots={} applied={} term_changes={} leaders_per_node={:?} \
         ready_ms={}",
        args.groups,
        args.quiesce,
        args.heartbeat,
        args.election_min,
        args.election_max,
        w,
        pct,
        pct / NODES as f64,
        rate(0),
        rate(1),
        n1[2] - n0[2],
        n1[3] - n0[3],
        n1[4] - n0[4],
        n1[5] - n0[5],
        terms_after - terms_before,
        leaders_per_node,
        ready_ms,
    );
}

fn main() {
    let args = parse_args();
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .expect("tokio runtime");
    rt.block_on(run(args));
    // The Raft tasks hold each other's handles (through the registry); do not wait for them.
    rt.shutdown_background();
}
