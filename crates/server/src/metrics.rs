//! Prometheus metrics, rendered as text on `/metrics`.

use prometheus_client::collector::Collector;
use prometheus_client::encoding::{DescriptorEncoder, EncodeLabelSet, EncodeMetric, NoLabelSet};
use prometheus_client::metrics::counter::ConstCounter;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::{ConstGauge, Gauge};
use prometheus_client::metrics::histogram::Histogram;
use prometheus_client::metrics::MetricType;
use prometheus_client::registry::{Registry, Unit};
use std::sync::OnceLock;

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct OutcomeLabel {
    pub outcome: &'static str,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct NodeLabel {
    pub node: u16,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct StatusLabel {
    pub status: u16,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct KindLabel {
    pub kind: &'static str,
}

/// Routing outcomes, as label values of `forkless_route_total`.
pub mod outcome {
    pub const LOCAL: &str = "owned_locally";
    pub const FORWARDED_OK: &str = "forwarded_ok";
    pub const FORWARD_FAILED: &str = "forward_failed";
    pub const NOT_OWNER: &str = "not_owner";
    pub const FAIL_CLOSED: &str = "fail_closed";
    pub const REFUSED_HOP_HEADER: &str = "refused_hop_header";
    /// A read that asked for `consistency=stale`, answered by this node's
    /// replica as it stands (leader or not, with no read-index round).
    pub const STALE_LOCALLY: &str = "stale_read_locally";
    /// A request routed a second time (then counted by where it went:
    /// forwarded, not owner, or failed closed; or run or refused here):
    /// one decided here (counted `owned_locally` first) that the shard's
    /// group refused as its leadership moved, once it settled; one from a
    /// client that the node taken for the leader refused (`421`), or did
    /// not reach (nothing sent), once a leader is reachable.
    pub const REROUTED: &str = "rerouted";
    pub const ALL: [&str; 8] = [
        LOCAL,
        STALE_LOCALLY,
        REROUTED,
        FORWARDED_OK,
        FORWARD_FAILED,
        NOT_OWNER,
        FAIL_CLOSED,
        REFUSED_HOP_HEADER,
    ];
}

/// HTTP status codes are three digits.
const STATUS_CODES: usize = 1000;

pub struct Metrics {
    registry: Registry,
    /// Handles into `responses` by status code, made on first use (a
    /// status never answered is not exported): a request then costs one
    /// atomic add, not a family lookup under its lock.
    by_status: Box<[OnceLock<Counter>]>,
    /// The same for `route`, indexed like [`outcome::ALL`].
    by_outcome: [OnceLock<Counter>; outcome::ALL.len()],
    pub route: Family<OutcomeLabel, Counter>,
    pub forward_seconds: Histogram,
    pub events_appended: Counter,
    pub executions_started: Counter,
    pub responses: Family<StatusLabel, Counter>,
    pub peer_up: Family<NodeLabel, Gauge>,
    /// Client connections open now (API and peer listeners).
    pub connections_open: Gauge,
    /// Connections refused for being over `limits.connections_max`.
    pub connections_refused: Counter,
    /// Connections closed by a timeout, by kind (idle, write, shutdown).
    pub connection_timeouts: Family<KindLabel, Counter>,
    /// Long-polls waiting now.
    pub long_polls_waiting: Gauge,
    /// Long-polls refused for being over `limits.long_polls_max`.
    pub long_polls_refused: Counter,
    /// Times a waiting long-poll was woken by a commit of its execution.
    pub long_poll_wakeups: Counter,
    /// Reads dropped unanswered because their client hung up.
    pub reads_abandoned: Counter,
    /// Bytes of request bodies held now (`limits.body_bytes_in_flight_max`
    /// bounds it).
    pub body_bytes_in_flight: Gauge,
    /// Requests refused for being over `limits.body_bytes_in_flight_max`.
    pub body_bytes_refused: Counter,
    /// Bytes of answers to reads held now, made and not yet written
    /// (`limits.answer_bytes_in_flight_max` bounds it).
    pub answer_bytes_in_flight: Gauge,
    /// Reads refused for being over `limits.answer_bytes_in_flight_max`.
    pub answer_bytes_refused: Counter,
    /// Reloads of the cluster file (`forkless cluster reload`, SIGHUP), by
    /// outcome: `taken` or `refused`.
    pub cluster_reloads: Family<OutcomeLabel, Counter>,
    /// Leaders this node's replica of a shard has come to know: one per
    /// new (leader, term) it learned (an election, a handover), so an
    /// alert sees a shard's leadership move between two scrapes.
    pub raft_leader_changes: Family<ShardLabel, Counter>,
}

impl Metrics {
    pub fn new(store: std::sync::Arc<forkless_store::Store>) -> Metrics {
        let mut registry = Registry::with_prefix("forkless");
        registry.register_collector(Box::new(StoreCollector(store)));
        let route = Family::<OutcomeLabel, Counter>::default();
        registry.register("route", "Requests by routing outcome", route.clone());
        let forward_seconds = Histogram::new([
            0.0002, 0.0005, 0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.5, 1.0, 5.0,
        ]);
        registry.register(
            "forward_seconds",
            "Latency of forwards to the owner",
            forward_seconds.clone(),
        );
        let events_appended = Counter::default();
        registry.register(
            "events_appended",
            "Events durably appended on this node",
            events_appended.clone(),
        );
        let executions_started = Counter::default();
        registry.register(
            "executions_started",
            "Executions created on this node",
            executions_started.clone(),
        );
        let responses = Family::<StatusLabel, Counter>::default();
        registry.register(
            "responses",
            "API responses by status code",
            responses.clone(),
        );
        let peer_up = Family::<NodeLabel, Gauge>::default();
        registry.register(
            "peer_up",
            "1 if the peer answered its last probe",
            peer_up.clone(),
        );
        let connections_open = Gauge::default();
        registry.register(
            "connections_open",
            "Client connections open now",
            connections_open.clone(),
        );
        let connections_refused = Counter::default();
        registry.register(
            "connections_refused",
            "Connections refused (503 and closed) for being over limits.connections_max",
            connections_refused.clone(),
        );
        let connection_timeouts = Family::<KindLabel, Counter>::default();
        registry.register(
            "connection_timeouts",
            "Connections closed by a timeout: idle (kept alive with no request), write (the client took no answer), shutdown (still busy after the grace)",
            connection_timeouts.clone(),
        );
        let long_polls_waiting = Gauge::default();
        registry.register(
            "long_polls_waiting",
            "Long-polls waiting now",
            long_polls_waiting.clone(),
        );
        let long_polls_refused = Counter::default();
        registry.register(
            "long_polls_refused",
            "Long-polls refused (503) for being over limits.long_polls_max",
            long_polls_refused.clone(),
        );
        let long_poll_wakeups = Counter::default();
        registry.register(
            "long_poll_wakeups",
            "Times a waiting long-poll was woken by a commit of its own execution",
            long_poll_wakeups.clone(),
        );
        let body_bytes_in_flight = Gauge::default();
        registry.register(
            "body_bytes_in_flight",
            "Bytes of request bodies this node holds now (being read, or not yet answered), as limits.body_bytes_in_flight_max counts them (whole KiB)",
            body_bytes_in_flight.clone(),
        );
        let body_bytes_refused = Counter::default();
        registry.register(
            "body_bytes_refused",
            "Requests refused (503 too_many_body_bytes) because their body would take the bytes of request bodies held past limits.body_bytes_in_flight_max",
            body_bytes_refused.clone(),
        );
        let answer_bytes_in_flight = Gauge::default();
        registry.register(
            "answer_bytes_in_flight",
            "Bytes of answers to reads this node holds now (made, and not yet written to their client), as limits.answer_bytes_in_flight_max counts them (whole KiB)",
            answer_bytes_in_flight.clone(),
        );
        let answer_bytes_refused = Counter::default();
        registry.register(
            "answer_bytes_refused",
            "Reads refused (503 too_many_answer_bytes) because their answer would take the bytes of answers held past limits.answer_bytes_in_flight_max",
            answer_bytes_refused.clone(),
        );
        let reads_abandoned = Counter::default();
        registry.register(
            "reads_abandoned",
            "Reads (GET: long-polls, reads forwarded to their owner) dropped unanswered because their client closed the connection first; what they held is let go at once",
            reads_abandoned.clone(),
        );
        let cluster_reloads = Family::<OutcomeLabel, Counter>::default();
        registry.register(
            "cluster_reloads",
            "Reloads of the cluster file (forkless cluster reload, SIGHUP) by outcome: taken, or refused with nothing changed",
            cluster_reloads.clone(),
        );
        let raft_leader_changes = Family::<ShardLabel, Counter>::default();
        registry.register(
            "raft_leader_changes",
            "Leaders this node's replica of the shard came to know, one per new leader and term (an election or a handover): a rate above zero is a shard whose leadership moves",
            raft_leader_changes.clone(),
        );
        Metrics {
            raft_leader_changes,
            cluster_reloads,
            connections_open,
            connections_refused,
            connection_timeouts,
            long_polls_waiting,
            long_polls_refused,
            long_poll_wakeups,
            reads_abandoned,
            body_bytes_in_flight,
            body_bytes_refused,
            answer_bytes_in_flight,
            answer_bytes_refused,
            registry,
            by_status: (0..STATUS_CODES).map(|_| OnceLock::new()).collect(),
            by_outcome: Default::default(),
            route,
            forward_seconds,
            events_appended,
            executions_started,
            responses,
            peer_up,
        }
    }

    /// Counts a connection closed by a timeout of `kind`.
    pub fn connection_timeout(&self, kind: &'static str) {
        self.connection_timeouts
            .get_or_create(&KindLabel { kind })
            .inc();
    }

    pub fn outcome(&self, outcome: &'static str) {
        let make = || self.route.get_or_create(&OutcomeLabel { outcome }).clone();
        match outcome::ALL.iter().position(|o| *o == outcome) {
            Some(i) => self.by_outcome[i].get_or_init(make).inc(),
            None => make().inc(),
        };
    }

    /// Counts one answer with this status.
    pub fn response(&self, status: u16) {
        let make = || {
            self.responses
                .get_or_create(&StatusLabel { status })
                .clone()
        };
        match self.by_status.get(usize::from(status)) {
            Some(slot) => slot.get_or_init(make).inc(),
            None => make().inc(),
        };
    }

    pub fn render(&self) -> String {
        let mut out = String::new();
        if prometheus_client::encoding::text::encode(&mut out, &self.registry).is_err() {
            out.clear();
        }
        out
    }
}

/// The shards' group-commit counters, read from the store at each scrape:
/// `forkless_store_commits_total{shard, committer}` and
/// `forkless_store_committed_commands_total{shard}` (their ratio is the
/// mean group size: how much each fsync carried), the histogram of those
/// fsyncs (`forkless_store_log_sync_seconds{shard}` for a shard with a
/// log of its own, `forkless_store_node_log_sync_seconds` for the node
/// log's rounds), and the log's
/// checkpoints (`forkless_store_checkpoints_total{shard}`,
/// `forkless_store_checkpoint_seconds_total{shard, phase}`), the bytes on
/// disk (`forkless_store_node_log_bytes`,
/// `forkless_store_shard_disk_bytes{shard}`), the bytes held in memory
/// (`forkless_store_write_buffer_bytes{shard}`), and which shards are out of
/// service (`forkless_store_shard_failed{shard}`).
pub struct StoreCollector(pub std::sync::Arc<forkless_store::Store>);

impl std::fmt::Debug for StoreCollector {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("StoreCollector")
    }
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct CommitLabel {
    shard: u32,
    committer: &'static str,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct PhaseLabel {
    shard: u32,
    phase: &'static str,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct ShardLabel {
    pub shard: u32,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct FollowerLabel {
    shard: u32,
    follower: u64,
}

impl StoreCollector {
    /// Each replicated shard's Raft group as this replica sees it: term,
    /// leader, its log's last, committed and applied indexes, and on the
    /// leader each follower's lag in entries.
    fn encode_raft(&self, encoder: &mut DescriptorEncoder) -> Result<(), std::fmt::Error> {
        let mut groups: Vec<_> = self
            .0
            .hosted()
            .into_iter()
            .filter(|s| s.is_replicated())
            .filter_map(|s| Some((s.id().get(), s.raft_status()?, s.has_left_group())))
            .collect();
        if groups.is_empty() {
            return Ok(());
        }
        groups.sort_by_key(|(id, _, _)| *id);
        type Pick = fn(&forkless_store::RaftStatus) -> i64;
        let gauges: [(&str, &str, Pick); 11] = [
            ("raft_term", "The shard's Raft term (its epoch) as this replica knows it", |g| g.term as i64),
            ("raft_leader", "The node this replica believes leads the shard's group (-1: none known, an election is under way)", |g| g.leader.map_or(-1, |l| l as i64)),
            ("raft_is_leader", "1 while this node leads the shard's group (owns the shard), else 0", |g| i64::from(g.leader == Some(g.me))),
            ("raft_last_log_index", "The last entry in this replica's log of the shard's group (-1: none)", |g| g.last_log_index.map_or(-1, |i| i as i64)),
            ("raft_committed_index", "The last entry this replica knows to be committed (-1: none)", |g| g.committed.map_or(-1, |i| i as i64)),
            ("raft_applied_index", "The last entry this replica has applied (-1: none)", |g| g.applied.map_or(-1, |i| i as i64)),
            ("raft_joint", "1 while a change of the shard's group's voters is under way as this replica knows it (openraft's joint configuration: a quorum of the old voters and of the new needed; one its leader left unfinished is finished by the next leader), else 0", |g| i64::from(g.joint)),
            ("raft_fresh", "1 while this replica's data directory is new (a lost disk, back under its id) and it has not caught up: it votes for no candidate with entries yet", |g| i64::from(g.fresh)),
            ("raft_quiet", "1 while the shard's group is idle with its timers off here (its leader known alive by its node's heartbeat), else 0", |g| i64::from(g.quiet)),
            ("raft_log_held_entries", "Entries this replica's log of the shard's group holds past its purge mark (raft.log_kept_entries past the last snapshot, at most): a follower further behind gets a snapshot", |g| g.log_held_entries as i64),
            ("raft_log_memory_bytes", "Memory this replica's log of the shard's group holds: its entries' places and the bodies it caches", |g| g.log_memory_bytes as i64),
        ];
        for (name, help, pick) in gauges {
            let mut m = encoder.encode_descriptor(name, help, None, MetricType::Gauge)?;
            for (shard, g, _) in &groups {
                ConstGauge::new(pick(g)).encode(m.encode_family(&ShardLabel { shard: *shard })?)?;
            }
        }
        let mut left = encoder.encode_descriptor(
            "raft_left_group",
            "1 while this replica's group no longer counts it (its node was removed while away and came back on its old data, or it was the learner of a move left unfinished, removed since): it stands for nothing and takes no entry; its data stays until deleted by hand or the node is retired, or a move of the shard to this node takes it up again",
            None,
            MetricType::Gauge,
        )?;
        for (shard, _, l) in &groups {
            ConstGauge::new(i64::from(*l))
                .encode(left.encode_family(&ShardLabel { shard: *shard })?)?;
        }
        type Count = fn(&forkless_store::RaftStatus) -> u64;
        let counters: [(&str, &str, Count); 2] = [
            ("raft_appends_taken", "AppendEntries carrying entries this replica took from the shard's leaders", |g| g.appends_taken),
            ("raft_appends_taken_behind_others", "Of those, the ones taken while an earlier one of the same leader's stream was unanswered (the leader pipelines them)", |g| g.appends_taken_behind_others),
        ];
        for (name, help, pick) in counters {
            let mut m = encoder.encode_descriptor(name, help, None, MetricType::Counter)?;
            for (shard, g, _) in &groups {
                ConstCounter::new(pick(g))
                    .encode(m.encode_family(&ShardLabel { shard: *shard })?)?;
            }
        }
        let mut lag = encoder.encode_descriptor(
            "raft_follower_lag_entries",
            "On the leader of a shard's group: entries of its log a follower is not yet known to hold",
            None,
            MetricType::Gauge,
        )?;
        for (shard, g, _) in &groups {
            let last = g.last_log_index.unwrap_or(0);
            for (follower, matched) in &g.matched {
                let behind = last.saturating_sub(matched.unwrap_or(0));
                ConstGauge::new(behind as i64).encode(lag.encode_family(&FollowerLabel {
                    shard: *shard,
                    follower: *follower,
                })?)?;
            }
        }
        Ok(())
    }
}

impl Collector for StoreCollector {
    fn encode(&self, mut encoder: DescriptorEncoder) -> Result<(), std::fmt::Error> {
        let mut shards: Vec<_> = self
            .0
            .hosted()
            .into_iter()
            .map(|s| (s.id().get(), s.commit_stats(), s.log_sync_latency()))
            .collect();
        shards.sort_by_key(|(id, _, _)| *id);
        let mut commits = encoder.encode_descriptor(
            "store_commits",
            "Group commits (one fsync each), by shard and by who committed: the shard's writer thread, or an idle shard's caller",
            None,
            MetricType::Counter,
        )?;
        for (shard, st, _) in &shards {
            for (committer, n) in [
                ("writer_thread", st.groups_by_writer_thread),
                ("caller", st.groups_by_caller),
            ] {
                let label = CommitLabel {
                    shard: *shard,
                    committer,
                };
                ConstCounter::new(n).encode(commits.encode_family(&label)?)?;
            }
        }
        let mut commands = encoder.encode_descriptor(
            "store_committed_commands",
            "Commands (starts, appends, epoch moves) carried by those commits, by shard",
            None,
            MetricType::Counter,
        )?;
        for (shard, st, _) in &shards {
            ConstCounter::new(st.commands)
                .encode(commands.encode_family(&ShardLabel { shard: *shard })?)?;
        }
        let mut behind = encoder.encode_descriptor(
            "store_groups_behind_others",
            "Of those commits, the groups a shard's Raft leader proposed while earlier ones were still in flight (not yet applied), by shard",
            None,
            MetricType::Counter,
        )?;
        for (shard, st, _) in &shards {
            ConstCounter::new(st.groups_behind_others)
                .encode(behind.encode_family(&ShardLabel { shard: *shard })?)?;
        }
        let mut checkpoints = encoder.encode_descriptor(
            "store_checkpoints",
            "Checkpoints of the shard's log: the events written since the last one moved from memory into the events index",
            None,
            MetricType::Counter,
        )?;
        for (shard, st, _) in &shards {
            ConstCounter::new(st.checkpoints)
                .encode(checkpoints.encode_family(&ShardLabel { shard: *shard })?)?;
        }
        let mut spent = encoder.encode_descriptor(
            "store_checkpoint",
            "Time checkpoints took, by phase: index (writing the events index; readers wait for its commit only) and sync (making it durable); the shard's next commit waits for both",
            Some(&Unit::Seconds),
            MetricType::Counter,
        )?;
        for (shard, st, _) in &shards {
            for (phase, micros) in [
                ("index", st.checkpoint_index_micros),
                ("sync", st.checkpoint_sync_micros),
            ] {
                let label = PhaseLabel {
                    shard: *shard,
                    phase,
                };
                ConstCounter::new(micros as f64 / 1e6).encode(spent.encode_family(&label)?)?;
            }
        }
        let mut syncs = encoder.encode_descriptor(
            "store_log_sync",
            "How long each group commit's fdatasync of the shard's log took, which every acknowledged write waits for (wall time to its return: a wait for a core after the disk answered counts too)",
            Some(&Unit::Seconds),
            MetricType::Histogram,
        )?;
        for (shard, _, sync) in &shards {
            let Some(sync) = sync else { continue };
            syncs
                .encode_family(&ShardLabel { shard: *shard })?
                .encode_histogram::<NoLabelSet>(
                    sync.sum_seconds,
                    sync.count(),
                    &sync.buckets,
                    None,
                )?;
        }
        if let Some(sync) = self.0.node_log_sync_latency() {
            let mut rounds = encoder.encode_descriptor(
                "store_node_log_sync",
                "How long each round's fdatasync of the node log took, which every acknowledged write waits for; a round carries one group commit of every shard that had one waiting (wall time to its return: a wait for a core after the disk answered counts too)",
                Some(&Unit::Seconds),
                MetricType::Histogram,
            )?;
            rounds.encode_histogram::<NoLabelSet>(
                sync.sum_seconds,
                sync.count(),
                &sync.buckets,
                None,
            )?;
            let node_log = encoder.encode_descriptor(
                "store_node_log",
                "Bytes the node log holds: every shard's events and Raft entries since they moved to it (no space comes back yet: a snapshot's install adds the events the replica lacked, and a replica moved away leaves its events)",
                Some(&Unit::Bytes),
                MetricType::Gauge,
            )?;
            ConstGauge::new(i64::try_from(self.0.log_disk_bytes()).unwrap_or(i64::MAX))
                .encode(node_log)?;
        }
        let hosted = self.0.hosted();
        let bytes_by_shard = [
            (
                "store_shard_disk",
                "Bytes each shard's database takes on disk, with its own log of before if it has one (the node log's bytes are the node's: forkless_store_node_log_bytes)",
                forkless_store::ShardStore::disk_bytes as fn(&forkless_store::ShardStore) -> u64,
            ),
            (
                "store_write_buffer",
                "Bytes of each shard's writes its database holds in memory (memtables, active and sealed, not yet flushed into tables); the node holds them all to store.write_buffer_bytes",
                forkless_store::ShardStore::write_buffer_bytes,
            ),
        ];
        for (name, help, bytes) in bytes_by_shard {
            let mut family =
                encoder.encode_descriptor(name, help, Some(&Unit::Bytes), MetricType::Gauge)?;
            for shard in &hosted {
                ConstGauge::new(i64::try_from(bytes(shard)).unwrap_or(i64::MAX)).encode(
                    family.encode_family(&ShardLabel {
                        shard: shard.id().get(),
                    })?,
                )?;
            }
        }
        self.encode_raft(&mut encoder)?;
        let mut failed = encoder.encode_descriptor(
            "store_shard_failed",
            "1 for a shard of this node that is out of service (damage found when it was opened, or a failed write or sync of its log; the reason is in the log and /readyz), 0 for one that serves",
            None,
            MetricType::Gauge,
        )?;
        let failures = self.0.failures();
        let mut all: Vec<u32> = shards.iter().map(|(s, _, _)| *s).collect();
        all.extend(failures.keys().map(|s| s.get()));
        all.sort_unstable();
        all.dedup();
        for shard in all {
            let down = failures.contains_key(&forkless_types::ShardId(shard));
            ConstGauge::new(i64::from(down))
                .encode(failed.encode_family(&ShardLabel { shard })?)?;
        }
        let restarts = self.0.restarts();
        if !restarts.is_empty() {
            let mut family = encoder.encode_descriptor(
                "store_shard_restarts",
                "Restarts of this shard's Raft group by the store's supervisor after it stopped by itself (a panic); the reason is in the log and /api/cluster",
                None,
                MetricType::Counter,
            )?;
            for (shard, r) in restarts {
                prometheus_client::metrics::counter::ConstCounter::new(r.count)
                    .encode(family.encode_family(&ShardLabel { shard: shard.get() })?)?;
            }
        }
        Ok(())
    }
}
