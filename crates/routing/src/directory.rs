//! The shard directory: which node owns each shard, at which epoch, and
//! whether that node is believed alive.

use crate::{Owner, OwnerHint};
use forkless_types::{Epoch, NodeId, ShardCount, ShardId};
use std::collections::BTreeMap;
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicU8, Ordering};
use std::sync::RwLock;

/// What a peer's claim did to this node's map.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Observation {
    /// The claim carried a newer epoch: the shard moved to the claimant.
    Moved,
    /// The claimant and this node both own the shard at the same epoch:
    /// the shard now fails closed here.
    Conflict,
    Unchanged,
}

/// A node's view of shard ownership.
pub trait Directory: Send + Sync {
    fn local_node(&self) -> NodeId;
    fn shard_count(&self) -> ShardCount;
    /// Who owns `shard`, as this node believes now.
    fn owner_of(&self, shard: ShardId) -> Owner;
    /// Grows whenever the map changes; lets a client tell which of two
    /// disagreeing answers is newer.
    fn map_version(&self) -> u64;
    /// False when routing is inert: this node owns every shard (the embedded
    /// single-node default, or a one-node cluster).
    fn routing_active(&self) -> bool;
    fn owns(&self, shard: ShardId) -> bool {
        matches!(self.owner_of(shard), Owner::Local { .. })
    }
}

/// A cluster member as the config names it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct NodeInfo {
    pub id: NodeId,
    pub api_addr: String,
    pub peer_addr: String,
}

/// One shard's owner of record.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ShardAssignment {
    pub owner: NodeId,
    pub epoch: Epoch,
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub enum StaticDirectoryError {
    UnknownLocalNode(NodeId),
    WrongAssignmentCount { shards: u32, assignments: usize },
    UnknownOwner { shard: u32, owner: NodeId },
}

impl std::fmt::Display for StaticDirectoryError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Self::UnknownLocalNode(n) => write!(f, "node {n} is not in the cluster's node list"),
            Self::WrongAssignmentCount {
                shards,
                assignments,
            } => {
                write!(f, "{assignments} shard assignments for {shards} shards: every shard needs exactly one owner")
            }
            Self::UnknownOwner { shard, owner } => write!(
                f,
                "shard {shard} is assigned to node {owner}, which is not in the node list"
            ),
        }
    }
}

impl std::error::Error for StaticDirectoryError {}

/// What this node knows of a peer from its probes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum PeerState {
    /// The peer has never answered a probe of this node (it may not have
    /// been probed yet, or not have been started yet when it was): not
    /// believed down, so a request for its shards tries it. A forward
    /// that finds nobody there fails closed anyway (`executed: false` on
    /// a refused connection).
    NeverAnswered,
    /// The peer answered its last probe.
    Up,
    /// The peer answered a probe once, and missed its last one: its shards
    /// fail closed at once instead of waiting for a forward's timeout.
    Down,
}

const NEVER_ANSWERED: u8 = 0;
const UP: u8 = 1;
const DOWN: u8 = 2;

impl PeerState {
    fn from_u8(v: u8) -> PeerState {
        match v {
            UP => PeerState::Up,
            DOWN => PeerState::Down,
            _ => PeerState::NeverAnswered,
        }
    }

    /// Whether requests for the peer's shards are sent to it.
    pub fn is_alive(self) -> bool {
        self != PeerState::Down
    }

    pub fn as_str(self) -> &'static str {
        match self {
            PeerState::NeverAnswered => "never_answered",
            PeerState::Up => "up",
            PeerState::Down => "down",
        }
    }
}

/// Which peers are believed alive. Written by the prober, read by routing.
#[derive(Debug)]
pub struct Liveness {
    /// Grows when a node is added at run time ([`StaticDirectory::add_node`]).
    state: RwLock<BTreeMap<NodeId, Peer>>,
    /// What [`Peer::answered_at`] counts from.
    since: std::time::Instant,
}

/// One peer's probe state, and when it last answered one.
#[derive(Debug)]
struct Peer {
    state: AtomicU8,
    /// Milliseconds after [`Liveness::since`], plus one (0: never).
    answered_at: AtomicU64,
}

impl Peer {
    fn new() -> Peer {
        Peer {
            state: AtomicU8::new(NEVER_ANSWERED),
            answered_at: AtomicU64::new(0),
        }
    }
}

impl Liveness {
    /// Every node starts [`PeerState::NeverAnswered`]: not believed down
    /// until it has answered once and then missed a probe. A forward to a
    /// dead one fails closed anyway.
    pub fn new(nodes: impl IntoIterator<Item = NodeId>) -> Liveness {
        Liveness {
            state: RwLock::new(nodes.into_iter().map(|n| (n, Peer::new())).collect()),
            since: std::time::Instant::now(),
        }
    }

    /// Starts following `node` (never answered), if it is not followed yet.
    fn add(&self, node: NodeId) {
        self.state
            .write()
            .unwrap_or_else(|e| e.into_inner())
            .entry(node)
            .or_insert_with(Peer::new);
    }

    /// Records one probe's outcome: answered (`alive`) or not. A peer that
    /// has never answered stays [`PeerState::NeverAnswered`] when it does
    /// not answer. Returns whether the peer was believed alive before.
    pub fn set(&self, node: NodeId, alive: bool) -> bool {
        self.record(node, alive).0.is_alive()
    }

    /// Like [`Liveness::set`], returning the states before and after.
    pub fn record(&self, node: NodeId, answered: bool) -> (PeerState, PeerState) {
        self.record_asked(node, answered, std::time::Instant::now())
    }

    /// [`Liveness::record`] of a probe asked at `asked`: an answer says
    /// the peer was alive after that moment (not only when the answer was
    /// taken in, which may be later), and [`Liveness::last_answered`]
    /// keeps it so, to the millisecond below.
    pub fn record_asked(
        &self,
        node: NodeId,
        answered: bool,
        asked: std::time::Instant,
    ) -> (PeerState, PeerState) {
        let state = self.state.read().unwrap_or_else(|e| e.into_inner());
        let Some(p) = state.get(&node) else {
            return (PeerState::Down, PeerState::Down);
        };
        let a = &p.state;
        let before = if answered {
            let at = u64::try_from(asked.saturating_duration_since(self.since).as_millis())
                .unwrap_or(u64::MAX - 1);
            p.answered_at.fetch_max(at + 1, Ordering::AcqRel);
            a.swap(UP, Ordering::AcqRel)
        } else {
            // Down only once it has answered: NEVER_ANSWERED stays so.
            match a.compare_exchange(UP, DOWN, Ordering::AcqRel, Ordering::Acquire) {
                Ok(v) | Err(v) => v,
            }
        };
        let after = match (answered, before) {
            (true, _) => UP,
            (false, NEVER_ANSWERED) => NEVER_ANSWERED,
            (false, _) => DOWN,
        };
        (PeerState::from_u8(before), PeerState::from_u8(after))
    }

    pub fn state(&self, node: NodeId) -> PeerState {
        self.state
            .read()
            .unwrap_or_else(|e| e.into_inner())
            .get(&node)
            .map(|p| PeerState::from_u8(p.state.load(Ordering::Acquire)))
            .unwrap_or(PeerState::Down)
    }

    /// When the last probe `node` answered was asked, to the millisecond
    /// below (`None`: never answered, or not followed).
    pub fn last_answered(&self, node: NodeId) -> Option<std::time::Instant> {
        let state = self.state.read().unwrap_or_else(|e| e.into_inner());
        match state.get(&node)?.answered_at.load(Ordering::Acquire) {
            0 => None,
            at => self
                .since
                .checked_add(std::time::Duration::from_millis(at - 1)),
        }
    }

    /// Whether requests for `node`'s shards are sent to it (it is not
    /// believed down).
    pub fn is_alive(&self, node: NodeId) -> bool {
        self.state(node).is_alive()
    }
}

/// A directory from a static cluster map, overlaid with live peer liveness
/// and with newer epochs learned from peers.
pub struct StaticDirectory {
    local: NodeId,
    shard_count: ShardCount,
    /// Grows when a node is added at run time ([`StaticDirectory::add_node`]).
    nodes: RwLock<BTreeMap<NodeId, NodeInfo>>,
    assignments: RwLock<Vec<ShardAssignment>>,
    liveness: Liveness,
    /// Shards two nodes claim at the same epoch: they fail closed.
    conflicts: Vec<AtomicBool>,
    /// Derived from `assignments` whenever they change, so the per-request
    /// questions are one atomic load, not a walk over every shard.
    derived: Derived,
    /// Routing stays active even while this node owns every shard (a
    /// replicated cluster: ownership moves with each election).
    always_route: bool,
}

#[derive(Debug, Default)]
struct Derived {
    map_version: AtomicU64,
    routing_active: AtomicBool,
}

impl Derived {
    fn update(&self, local: NodeId, a: &[ShardAssignment], always_route: bool) {
        self.map_version.store(
            a.iter().map(|a| a.epoch.get()).max().unwrap_or(0),
            Ordering::Release,
        );
        // Routing is inert exactly when this node owns every shard (the
        // embedded default, or a one-node cluster). A multi-node cluster with
        // one shard routes like any other: non-owners forward.
        let active = always_route || a.iter().any(|a| a.owner != local);
        self.routing_active.store(active, Ordering::Release);
    }
}

impl StaticDirectory {
    pub fn new(
        local: NodeId,
        shard_count: ShardCount,
        nodes: Vec<NodeInfo>,
        assignments: Vec<ShardAssignment>,
    ) -> Result<StaticDirectory, StaticDirectoryError> {
        let nodes: BTreeMap<_, _> = nodes.into_iter().map(|n| (n.id, n)).collect();
        if !nodes.contains_key(&local) {
            return Err(StaticDirectoryError::UnknownLocalNode(local));
        }
        if assignments.len() != shard_count.get() as usize {
            return Err(StaticDirectoryError::WrongAssignmentCount {
                shards: shard_count.get(),
                assignments: assignments.len(),
            });
        }
        for (s, a) in assignments.iter().enumerate() {
            if !nodes.contains_key(&a.owner) {
                return Err(StaticDirectoryError::UnknownOwner {
                    shard: s as u32,
                    owner: a.owner,
                });
            }
        }
        let liveness = Liveness::new(nodes.keys().copied());
        let derived = Derived::default();
        derived.update(local, &assignments, false);
        Ok(StaticDirectory {
            local,
            shard_count,
            nodes: RwLock::new(nodes),
            assignments: RwLock::new(assignments),
            liveness,
            derived,
            always_route: false,
            conflicts: (0..shard_count.get())
                .map(|_| AtomicBool::new(false))
                .collect(),
        })
    }

    /// The embedded default: this node alone, owning every shard at epoch 1.
    pub fn single_node(
        local: NodeId,
        shard_count: ShardCount,
        api_addr: String,
    ) -> StaticDirectory {
        let nodes = vec![NodeInfo {
            id: local,
            api_addr: api_addr.clone(),
            peer_addr: api_addr,
        }];
        let assignments = vec![
            ShardAssignment {
                owner: local,
                epoch: Epoch(1)
            };
            shard_count.get() as usize
        ];
        // Cannot fail: the only owner is the local node, and the count matches.
        match StaticDirectory::new(local, shard_count, nodes, assignments) {
            Ok(d) => d,
            Err(e) => unreachable!("single-node directory is always valid: {e}"),
        }
    }

    /// The directory of a replicated cluster: its owners are elected and
    /// move between nodes, so routing never goes inert, even while this
    /// node leads every shard.
    pub fn always_route(mut self) -> StaticDirectory {
        self.always_route = true;
        let a = self.assignments();
        self.derived.update(self.local, &a, true);
        self
    }

    pub fn liveness(&self) -> &Liveness {
        &self.liveness
    }

    /// Every node of the cluster, in id order.
    pub fn nodes(&self) -> Vec<NodeInfo> {
        self.nodes_read().values().cloned().collect()
    }

    /// How many nodes the directory lists, this one included.
    pub fn node_count(&self) -> usize {
        self.nodes_read().len()
    }

    pub fn node(&self, id: NodeId) -> Option<NodeInfo> {
        self.nodes_read().get(&id).cloned()
    }

    fn nodes_read(&self) -> std::sync::RwLockReadGuard<'_, BTreeMap<NodeId, NodeInfo>> {
        self.nodes.read().unwrap_or_else(|e| e.into_inner())
    }

    /// Removes a node that retired from the cluster (`forkless cluster
    /// reload` of a file listing it in `retired_nodes`): no longer probed
    /// or routed to; a shard the map still gives it has no owner here
    /// (fails closed) until a peer names its leader. Returns whether it
    /// was known.
    pub fn remove_node(&self, id: NodeId) -> bool {
        if id == self.local {
            return false;
        }
        let removed = self
            .nodes
            .write()
            .unwrap_or_else(|e| e.into_inner())
            .remove(&id)
            .is_some();
        self.liveness
            .state
            .write()
            .unwrap_or_else(|e| e.into_inner())
            .remove(&id);
        removed
    }

    /// Takes a known peer's new addresses (the cluster file moved it:
    /// restarted on another machine, or other ports). It counts as never
    /// answered again until a probe reaches it there. Returns whether the
    /// node was known (an unknown one is not added).
    pub fn move_node(&self, node: NodeInfo) -> bool {
        let id = node.id;
        if id == self.local {
            return false;
        }
        let moved = match self
            .nodes
            .write()
            .unwrap_or_else(|e| e.into_inner())
            .get_mut(&id)
        {
            Some(n) => {
                *n = node;
                true
            }
            None => false,
        };
        if moved {
            if let Some(a) = self
                .liveness
                .state
                .read()
                .unwrap_or_else(|e| e.into_inner())
                .get(&id)
            {
                a.state.store(NEVER_ANSWERED, Ordering::Release);
                a.answered_at.store(0, Ordering::Release);
            }
        }
        moved
    }

    /// Adds a node the cluster file gained while this node ran (`forkless
    /// cluster reload`): it is probed, routed to and followed from now on.
    /// A node already known keeps its addresses; returns whether it was
    /// added.
    pub fn add_node(&self, node: NodeInfo) -> bool {
        let id = node.id;
        let added = {
            let mut nodes = self.nodes.write().unwrap_or_else(|e| e.into_inner());
            match nodes.entry(id) {
                std::collections::btree_map::Entry::Occupied(_) => false,
                std::collections::btree_map::Entry::Vacant(v) => {
                    v.insert(node);
                    true
                }
            }
        };
        self.liveness.add(id);
        added
    }

    pub fn assignment(&self, shard: ShardId) -> Option<ShardAssignment> {
        self.assignments
            .read()
            .unwrap_or_else(|e| e.into_inner())
            .get(shard.get() as usize)
            .copied()
    }

    pub fn assignments(&self) -> Vec<ShardAssignment> {
        self.assignments
            .read()
            .unwrap_or_else(|e| e.into_inner())
            .clone()
    }

    /// A peer says `owner` holds `shard` at `epoch`. A newer epoch than the
    /// map's wins (ownership moved after this node's config was written);
    /// an older or equal one changes nothing. Returns true if the map changed.
    pub fn observe(&self, shard: ShardId, owner: NodeId, epoch: Epoch) -> Observation {
        if !self.nodes_read().contains_key(&owner) {
            return Observation::Unchanged;
        }
        let mut a = self.assignments.write().unwrap_or_else(|e| e.into_inner());
        let Some(cur) = a.get_mut(shard.get() as usize) else {
            return Observation::Unchanged;
        };
        if epoch > cur.epoch {
            *cur = ShardAssignment { owner, epoch };
            self.set_conflict(shard, false);
            self.derived.update(self.local, &a, self.always_route);
            return Observation::Moved;
        }
        // Two nodes claiming one shard at one epoch (a config moved it
        // without raising the epoch): neither claim can be preferred, so
        // both sides stop treating the shard as theirs until an operator
        // gives it a newer epoch. Better unavailable than forked.
        if epoch == cur.epoch
            && owner != cur.owner
            && cur.owner == self.local
            && owner != self.local
        {
            let was = self.set_conflict(shard, true);
            return if was {
                Observation::Unchanged
            } else {
                Observation::Conflict
            };
        }
        Observation::Unchanged
    }

    fn set_conflict(&self, shard: ShardId, on: bool) -> bool {
        self.conflicts
            .get(shard.get() as usize)
            .map(|c| c.swap(on, Ordering::AcqRel))
            .unwrap_or(false)
    }

    /// True while two nodes claim this shard at the same epoch.
    pub fn in_conflict(&self, shard: ShardId) -> bool {
        self.conflicts
            .get(shard.get() as usize)
            .is_some_and(|c| c.load(Ordering::Acquire))
    }

    /// The shards this node's map assigns to it, with their epochs: what it
    /// tells its peers it claims (conflicted or not, so a conflict stays
    /// visible to both sides).
    pub fn claimed(&self) -> Vec<(ShardId, Epoch)> {
        self.assignments
            .read()
            .unwrap_or_else(|e| e.into_inner())
            .iter()
            .enumerate()
            .filter(|(_, a)| a.owner == self.local)
            .map(|(s, a)| (ShardId(s as u32), a.epoch))
            .collect()
    }

    fn hint(&self, a: ShardAssignment) -> Option<OwnerHint> {
        self.nodes_read().get(&a.owner).map(|n| OwnerHint {
            node: n.id,
            api_addr: n.api_addr.clone(),
            peer_addr: n.peer_addr.clone(),
            epoch: a.epoch,
        })
    }
}

impl Directory for StaticDirectory {
    fn local_node(&self) -> NodeId {
        self.local
    }

    fn shard_count(&self) -> ShardCount {
        self.shard_count
    }

    fn owner_of(&self, shard: ShardId) -> Owner {
        let Some(a) = self.assignment(shard) else {
            return Owner::Unknown { hint: None };
        };
        if self.in_conflict(shard) {
            return Owner::Unknown { hint: None };
        }
        if a.owner == self.local {
            return Owner::Local { epoch: a.epoch };
        }
        let hint = self.hint(a);
        match hint {
            Some(h) if self.liveness.is_alive(a.owner) => Owner::Remote(h),
            h => Owner::Unknown { hint: h },
        }
    }

    fn map_version(&self) -> u64 {
        self.derived.map_version.load(Ordering::Acquire)
    }

    fn routing_active(&self) -> bool {
        self.derived.routing_active.load(Ordering::Acquire)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_peer_last_answered_when_its_last_answered_probe_came() {
        let n = |x| NodeId::new(x).unwrap();
        let l = Liveness::new([n(1), n(2)]);
        assert_eq!(l.last_answered(n(2)), None, "never answered");
        let before = std::time::Instant::now();
        l.record(n(2), true);
        let at = l.last_answered(n(2)).expect("answered once");
        // (Kept to the millisecond: within one of the probe's time.)
        assert!(
            at + std::time::Duration::from_millis(1) >= before,
            "{at:?} {before:?}"
        );
        assert!(at <= std::time::Instant::now());
        l.record(n(2), false);
        assert_eq!(l.state(n(2)), PeerState::Down);
        assert_eq!(
            l.last_answered(n(2)),
            Some(at),
            "a missed probe keeps the last answer"
        );
        assert_eq!(l.last_answered(n(1)), None);
        assert_eq!(l.last_answered(n(3)), None, "not followed");
    }

    #[test]
    fn an_answer_counts_from_when_its_probe_was_asked() {
        let n = |x| NodeId::new(x).unwrap();
        let l = Liveness::new([n(2)]);
        let asked = std::time::Instant::now();
        std::thread::sleep(std::time::Duration::from_millis(20));
        let taken_in = std::time::Instant::now();
        l.record_asked(n(2), true, asked);
        let at = l.last_answered(n(2)).expect("answered");
        // To the millisecond below the asking, never later.
        assert!(at <= asked, "{at:?} {asked:?}");
        assert!(at + std::time::Duration::from_millis(1) >= asked);
        assert!(at < taken_in);
        // An older round's answer, taken in later, does not move it back.
        l.record_asked(
            n(2),
            true,
            asked - std::time::Duration::from_millis(5).min(asked.elapsed()),
        );
        assert_eq!(l.last_answered(n(2)), Some(at));
    }

    fn node(n: u64) -> NodeInfo {
        NodeInfo {
            id: NodeId::new(n).unwrap(),
            api_addr: format!("a{n}"),
            peer_addr: format!("p{n}"),
        }
    }

    fn dir() -> StaticDirectory {
        let n = |x| NodeId::new(x).unwrap();
        let a = |o, e| ShardAssignment {
            owner: n(o),
            epoch: Epoch(e),
        };
        StaticDirectory::new(
            n(1),
            ShardCount::new(4).unwrap(),
            vec![node(1), node(2), node(3)],
            vec![a(1, 1), a(2, 1), a(3, 1), a(2, 2)],
        )
        .unwrap()
    }

    #[test]
    fn a_node_added_at_run_time_is_known_followed_and_claimable() {
        let d = dir();
        let n4 = NodeId::new(4).unwrap();
        assert!(d.node(n4).is_none());
        // A claim by a node the directory does not know changes nothing.
        assert_eq!(d.observe(ShardId(1), n4, Epoch(9)), Observation::Unchanged);
        assert!(d.add_node(node(4)));
        assert!(!d.add_node(NodeInfo {
            api_addr: "elsewhere".into(),
            ..node(4)
        }));
        assert_eq!(d.node(n4).unwrap().api_addr, "a4");
        assert_eq!(d.nodes().len(), 4);
        assert_eq!(d.liveness().state(n4), PeerState::NeverAnswered);
        d.liveness().record(n4, true);
        assert_eq!(d.liveness().state(n4), PeerState::Up);
        assert_eq!(d.observe(ShardId(1), n4, Epoch(9)), Observation::Moved);
        assert!(matches!(d.owner_of(ShardId(1)), Owner::Remote(h) if h.node == n4));
        // Moved: reached at its new address, never answered there yet.
        assert!(d.move_node(NodeInfo {
            api_addr: "a4-new".into(),
            ..node(4)
        }));
        assert_eq!(d.liveness().state(n4), PeerState::NeverAnswered);
        assert!(matches!(d.owner_of(ShardId(1)), Owner::Remote(h) if h.api_addr == "a4-new"));
        assert!(
            !d.move_node(node(7)),
            "an unknown node is not added by a move"
        );
        assert!(d.node(NodeId::new(7).unwrap()).is_none());
        // Retired: unknown, and its shard has no owner here until a newer
        // claim names one.
        assert!(d.remove_node(n4));
        assert!(!d.remove_node(n4));
        assert!(
            !d.remove_node(NodeId::new(1).unwrap()),
            "this node is no peer to remove"
        );
        assert!(d.node(n4).is_none());
        assert_eq!(d.liveness().state(n4), PeerState::Down);
        assert!(matches!(
            d.owner_of(ShardId(1)),
            Owner::Unknown { hint: None }
        ));
        let n3 = NodeId::new(3).unwrap();
        assert_eq!(d.observe(ShardId(1), n3, Epoch(10)), Observation::Moved);
        assert!(matches!(d.owner_of(ShardId(1)), Owner::Remote(h) if h.node == n3));
    }

    #[test]
    fn owners_follow_the_map_and_liveness() {
        let d = dir();
        assert!(d.routing_active());
        assert_eq!(d.owner_of(ShardId(0)), Owner::Local { epoch: Epoch(1) });
        assert!(
            matches!(d.owner_of(ShardId(1)), Owner::Remote(h) if h.node.get() == 2 && h.peer_addr == "p2")
        );
        assert_eq!(d.map_version(), 2);
        d.liveness().set(NodeId::new(2).unwrap(), true);
        d.liveness().set(NodeId::new(2).unwrap(), false);
        assert!(
            matches!(d.owner_of(ShardId(1)), Owner::Unknown { hint: Some(h) } if h.node.get() == 2)
        );
        assert!(matches!(d.owner_of(ShardId(2)), Owner::Remote(_)));
        assert_eq!(d.owner_of(ShardId(9)), Owner::Unknown { hint: None });
    }

    /// The never-probed (or never-answered) state: a peer that has not
    /// answered a probe yet is tried, not believed down; one that answered
    /// and then missed a probe is down; answering again brings it back.
    #[test]
    fn a_peer_that_never_answered_a_probe_is_tried_not_believed_down() {
        let d = dir();
        let n2 = NodeId::new(2).unwrap();
        let remote = |d: &StaticDirectory| matches!(d.owner_of(ShardId(1)), Owner::Remote(h) if h.node == n2);
        let down = |d: &StaticDirectory| matches!(d.owner_of(ShardId(1)), Owner::Unknown { hint: Some(h) } if h.node == n2);
        // (probe outcomes so far, state after them, routed to the peer?)
        let table: &[(&[bool], PeerState, bool)] = &[
            (&[], PeerState::NeverAnswered, true),
            (&[false], PeerState::NeverAnswered, true),
            (&[false, false, false], PeerState::NeverAnswered, true),
            (&[true], PeerState::Up, true),
            (&[false, true], PeerState::Up, true),
            (&[true, false], PeerState::Down, false),
            (&[false, true, false, false], PeerState::Down, false),
            (&[true, false, true], PeerState::Up, true),
        ];
        for (outcomes, state, routed) in table {
            let d2 = dir();
            for o in outcomes.iter() {
                d2.liveness().record(n2, *o);
            }
            assert_eq!(d2.liveness().state(n2), *state, "{outcomes:?}");
            assert_eq!(remote(&d2), *routed, "{outcomes:?}");
            assert_eq!(down(&d2), !*routed, "{outcomes:?}");
        }
        assert_eq!(d.liveness().state(n2), PeerState::NeverAnswered);
        assert!(remote(&d));
        assert_eq!(
            d.liveness().record(n2, false),
            (PeerState::NeverAnswered, PeerState::NeverAnswered)
        );
        assert_eq!(
            d.liveness().record(n2, true),
            (PeerState::NeverAnswered, PeerState::Up)
        );
        assert_eq!(
            d.liveness().record(n2, false),
            (PeerState::Up, PeerState::Down)
        );
    }

    /// A replicated cluster's directory routes even while this node leads
    /// every shard; a static one goes inert then.
    #[test]
    fn a_replicated_directory_never_goes_inert() {
        let all_mine = |always: bool| {
            let d = StaticDirectory::new(
                NodeId::new(1).unwrap(),
                ShardCount::new(2).unwrap(),
                vec![node(1), node(2)],
                vec![
                    ShardAssignment {
                        owner: NodeId::new(2).unwrap(),
                        epoch: Epoch(0),
                    };
                    2
                ],
            )
            .unwrap();
            let d = if always { d.always_route() } else { d };
            let n1 = NodeId::new(1).unwrap();
            assert!(d.routing_active());
            d.observe(ShardId(0), n1, Epoch(3));
            d.observe(ShardId(1), n1, Epoch(3));
            assert!(d.owns(ShardId(0)) && d.owns(ShardId(1)));
            d.routing_active()
        };
        assert!(!all_mine(false));
        assert!(all_mine(true));
    }

    #[test]
    fn newer_epochs_learned_from_peers_win_and_older_ones_do_not() {
        let d = dir();
        let n3 = NodeId::new(3).unwrap();
        assert_eq!(d.observe(ShardId(2), n3, Epoch(1)), Observation::Unchanged);
        assert_eq!(d.observe(ShardId(0), n3, Epoch(5)), Observation::Moved);
        assert!(
            matches!(d.owner_of(ShardId(0)), Owner::Remote(h) if h.node == n3 && h.epoch == Epoch(5))
        );
        assert_eq!(d.map_version(), 5);
        assert_eq!(
            d.observe(ShardId(0), NodeId::new(1).unwrap(), Epoch(4)),
            Observation::Unchanged
        );
    }

    #[test]
    fn two_claims_at_one_epoch_fail_closed_until_a_newer_epoch() {
        let d = dir();
        let n2 = NodeId::new(2).unwrap();
        assert_eq!(d.observe(ShardId(0), n2, Epoch(1)), Observation::Conflict);
        assert_eq!(d.owner_of(ShardId(0)), Owner::Unknown { hint: None });
        assert_eq!(d.observe(ShardId(0), n2, Epoch(1)), Observation::Unchanged);
        assert_eq!(
            d.claimed().first(),
            Some(&(ShardId(0), Epoch(1))),
            "still claimed, so the peer sees it too"
        );
        assert_eq!(d.observe(ShardId(0), n2, Epoch(2)), Observation::Moved);
        assert!(matches!(d.owner_of(ShardId(0)), Owner::Remote(h) if h.node == n2));
        // A claim on a shard owned by a third node at the same epoch is not ours to judge.
        assert_eq!(d.observe(ShardId(2), n2, Epoch(1)), Observation::Unchanged);
    }

    #[test]
    fn one_shard_on_many_nodes_routes() {
        let n = |x| NodeId::new(x).unwrap();
        let a = ShardAssignment {
            owner: n(1),
            epoch: Epoch(1),
        };
        let d2 =
            StaticDirectory::new(n(2), ShardCount::ONE, vec![node(1), node(2)], vec![a]).unwrap();
        assert!(d2.routing_active());
        assert!(matches!(d2.owner_of(ShardId(0)), Owner::Remote(_)));
        let d1 =
            StaticDirectory::new(n(1), ShardCount::ONE, vec![node(1), node(2)], vec![a]).unwrap();
        assert!(!d1.routing_active());
    }

    #[test]
    fn bad_maps_are_refused() {
        let n = |x| NodeId::new(x).unwrap();
        let c = ShardCount::new(2).unwrap();
        let a = |o| ShardAssignment {
            owner: n(o),
            epoch: Epoch(1),
        };
        assert!(StaticDirectory::new(n(9), c, vec![node(1)], vec![a(1), a(1)]).is_err());
        assert!(StaticDirectory::new(n(1), c, vec![node(1)], vec![a(1)]).is_err());
        assert!(StaticDirectory::new(n(1), c, vec![node(1)], vec![a(1), a(4)]).is_err());
        let single = StaticDirectory::single_node(n(1), c, "x".into());
        assert!(!single.routing_active());
        assert!(single.owns(ShardId(1)));
    }
}
