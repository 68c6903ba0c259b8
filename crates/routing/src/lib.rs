//! Where a request goes: the shard directory and the routing decisions.
//!
//! Every decision here is a pure function of its inputs (is routing active,
//! hops already taken, who the directory says owns the shard), so the whole
//! decision table is tested without a socket, a runtime or a peer.
//!
//! **Architecture invariant:** nothing in this crate touches a socket, a
//! file or a clock. The edge gathers the facts, asks here, and performs the
//! answer.
//!
//! Two rules this crate exists to protect:
//! - a request is handled locally only when this node owns the shard at the
//!   current epoch, never as a fallback when the owner cannot be reached: a
//!   local write by a non-owner would fork the log (the store's epoch fence
//!   refuses it too, but routing must not even try);
//! - a request is forwarded at most [`MAX_FORWARD_HOPS`] times, so a loop
//!   between two nodes with disagreeing maps is impossible: the second node
//!   answers `NotOwner` with its hint instead.

mod directory;

pub use directory::{
    Directory, Liveness, NodeInfo, Observation, PeerState, ShardAssignment, StaticDirectory,
    StaticDirectoryError,
};

use forkless_types::{Epoch, ExecutionId, IdMinter, NodeId, ShardCount, ShardId};

/// A request may cross at most this many nodes after the one it reached.
pub const MAX_FORWARD_HOPS: u8 = 1;

/// Who owns a shard, as this node believes.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Owner {
    /// This node owns the shard at `epoch`.
    Local { epoch: Epoch },
    /// Another node, believed reachable, owns it.
    Remote(OwnerHint),
    /// No reachable owner is known. `hint` is the owner of record, if any,
    /// believed down.
    Unknown { hint: Option<OwnerHint> },
}

/// An owner as named in the map: node, address to reach it, epoch.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct OwnerHint {
    pub node: NodeId,
    /// The owner's client API address.
    pub api_addr: String,
    /// The owner's peer address (where forwarded requests go).
    pub peer_addr: String,
    pub epoch: Epoch,
}

/// Why a request fails closed.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum FailClosed {
    /// The owner of record is believed down: the request never left.
    OwnerDown,
    /// The map names no owner for the shard.
    NoOwner,
}

/// What to do with a request that names a shard.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Decision {
    /// Handle it here, writing with this epoch.
    Local { epoch: Epoch },
    /// Send it to the owner, carrying `hops` in the hop header.
    Forward { owner: OwnerHint, hops: u8 },
    /// Refuse with `421 not_owner`: this node is not the owner and may not
    /// forward further. The hint is the best owner this node knows.
    NotOwner { hint: Option<OwnerHint> },
    /// Refuse with `503 owner_unavailable`; nothing is written anywhere.
    FailClosed {
        reason: FailClosed,
        hint: Option<OwnerHint>,
    },
}

/// The facts a routing decision depends on.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Facts {
    /// False when routing is inert: one shard, or one node that owns all.
    pub routing_active: bool,
    /// Hops the request has already taken (0 from a client).
    pub hops_taken: u8,
    /// The directory's answer for the request's shard.
    pub owner: Owner,
    /// The epoch this node's own copy of the shard is fenced at, if it
    /// hosts one (only consulted when the directory says `Local`). Newer
    /// than the directory's epoch means another node owns the shard at a
    /// newer epoch (learned from a peer, or from a config, and written
    /// into the copy's fence) although this node's map has not caught up:
    /// the copy is stale, for reads as much as for writes. The edge gives
    /// `None` for a replicated shard, whose fence is its Raft group's term.
    pub local_fence: Option<Epoch>,
}

/// The routing decision for a request that names a shard (an execution id,
/// or a steering key).
pub fn decide(facts: &Facts) -> Decision {
    match &facts.owner {
        // The map says this node, but its copy has been fenced by a newer
        // epoch: it is not the owner at the current epoch, so it answers
        // nothing from that copy (a read would be stale, a write is
        // refused by the store anyway). Who owns it at the newer epoch is
        // not in this node's map, so there is no one to forward to: the
        // client re-resolves (and the prober will move the map). With
        // routing inert this node is the whole cluster by its own config
        // (e.g. a one-node config to inspect a copy): it reads its data,
        // and the store still refuses every write.
        Owner::Local { epoch }
            if facts.routing_active && facts.local_fence.is_some_and(|f| f > *epoch) =>
        {
            Decision::NotOwner { hint: None }
        }
        Owner::Local { epoch } => Decision::Local { epoch: *epoch },
        // Inert routing means this node owns every shard; an answer other
        // than Local here would be a directory bug, and the store's fence
        // still guards the write.
        _ if !facts.routing_active => Decision::NotOwner { hint: None },
        Owner::Remote(owner) if facts.hops_taken < MAX_FORWARD_HOPS => Decision::Forward {
            owner: owner.clone(),
            hops: facts.hops_taken + 1,
        },
        // A forwarded request reached a node that is not the owner: the two
        // maps disagree. Forwarding again could loop; the client re-resolves.
        Owner::Remote(owner) => Decision::NotOwner {
            hint: Some(owner.clone()),
        },
        Owner::Unknown { hint } if facts.hops_taken > 0 => {
            Decision::NotOwner { hint: hint.clone() }
        }
        Owner::Unknown { hint: Some(h) } => Decision::FailClosed {
            reason: FailClosed::OwnerDown,
            hint: Some(h.clone()),
        },
        Owner::Unknown { hint: None } => Decision::FailClosed {
            reason: FailClosed::NoOwner,
            hint: None,
        },
    }
}

/// Where an unsteered start goes.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Placement {
    /// Minted on a shard this node owns: handle locally, never forwards.
    Local { id: ExecutionId, shard: ShardId },
    /// No local shard could be had: the id routes like any other.
    Routed { id: ExecutionId, shard: ShardId },
}

/// Places an unsteered start: mint an id on a shard this node owns (bounded
/// re-mint), else a plain id routed normally.
pub fn place_unsteered(
    minter: &IdMinter,
    n: ShardCount,
    owns: impl Fn(ShardId) -> bool,
) -> Placement {
    match minter.mint_on(n, &owns) {
        Ok(id) => Placement::Local {
            id,
            shard: id.shard(n),
        },
        Err(_) => {
            let id = minter.mint();
            Placement::Routed {
                id,
                shard: id.shard(n),
            }
        }
    }
}

/// Mints an id on the steering key's shard, so the execution lives next to
/// its key's index entry. Fails only if the bounded re-mint runs out, which
/// happens with probability about e^-16.
pub fn mint_steered(
    minter: &IdMinter,
    n: ShardCount,
    key: &str,
) -> Result<ExecutionId, forkless_types::MintError> {
    let shard = ShardId(forkless_sharding::shard_for_key(key, n));
    minter.mint_on(n, |s| s == shard)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn hint(node: u64) -> OwnerHint {
        OwnerHint {
            node: NodeId::new(node).unwrap(),
            api_addr: format!("127.0.0.1:70{node}0"),
            peer_addr: format!("127.0.0.1:71{node}0"),
            epoch: Epoch(7),
        }
    }

    fn check(routing_active: bool, hops_taken: u8, owner: Owner, expected: Decision) {
        let facts = Facts {
            routing_active,
            hops_taken,
            owner,
            local_fence: None,
        };
        assert_eq!(decide(&facts), expected, "{facts:?}");
    }

    #[test]
    fn the_decision_table() {
        let local = Owner::Local { epoch: Epoch(3) };
        let remote = Owner::Remote(hint(2));
        let down = Owner::Unknown {
            hint: Some(hint(2)),
        };
        let none = Owner::Unknown { hint: None };
        use Decision::*;
        // Owned here: local, whatever the hops.
        check(true, 0, local.clone(), Local { epoch: Epoch(3) });
        check(true, 1, local.clone(), Local { epoch: Epoch(3) });
        check(false, 0, local.clone(), Local { epoch: Epoch(3) });
        // Owned elsewhere: forward once, then refuse with the hint.
        check(
            true,
            0,
            remote.clone(),
            Forward {
                owner: hint(2),
                hops: 1,
            },
        );
        check(
            true,
            1,
            remote.clone(),
            NotOwner {
                hint: Some(hint(2)),
            },
        );
        check(
            true,
            200,
            remote.clone(),
            NotOwner {
                hint: Some(hint(2)),
            },
        );
        // Owner down or unknown: fail closed from a client, refuse when forwarded.
        check(
            true,
            0,
            down.clone(),
            FailClosed {
                reason: super::FailClosed::OwnerDown,
                hint: Some(hint(2)),
            },
        );
        check(
            true,
            0,
            none.clone(),
            FailClosed {
                reason: super::FailClosed::NoOwner,
                hint: None,
            },
        );
        check(
            true,
            1,
            down.clone(),
            NotOwner {
                hint: Some(hint(2)),
            },
        );
        check(true, 1, none.clone(), NotOwner { hint: None });
        // Inert routing never forwards and never fails closed.
        for o in [remote, down, none] {
            for hops in [0, 1] {
                let d = decide(&Facts {
                    routing_active: false,
                    hops_taken: hops,
                    owner: o.clone(),
                    local_fence: None,
                });
                assert!(!matches!(d, Forward { .. } | FailClosed { .. }), "{d:?}");
            }
        }
    }

    /// A copy fenced by a newer epoch than the map's is not answered from,
    /// whatever the request and its hops: 421 with no hint (the map does
    /// not know the newer owner). The same epoch, or an older fence (the
    /// store moves it up at open), is this node's to serve; inert routing
    /// reads its own data (the store still refuses the writes).
    #[test]
    fn a_copy_fenced_by_a_newer_epoch_answers_nothing() {
        let local = Owner::Local { epoch: Epoch(3) };
        let table = [
            // (routing active, hops, fence, expected)
            (true, 0, None, Decision::Local { epoch: Epoch(3) }),
            (true, 0, Some(Epoch(2)), Decision::Local { epoch: Epoch(3) }),
            (true, 0, Some(Epoch(3)), Decision::Local { epoch: Epoch(3) }),
            (true, 0, Some(Epoch(4)), Decision::NotOwner { hint: None }),
            (true, 1, Some(Epoch(4)), Decision::NotOwner { hint: None }),
            (true, 1, Some(Epoch(9)), Decision::NotOwner { hint: None }),
            (
                false,
                0,
                Some(Epoch(4)),
                Decision::Local { epoch: Epoch(3) },
            ),
            (
                false,
                1,
                Some(Epoch(4)),
                Decision::Local { epoch: Epoch(3) },
            ),
        ];
        for (active, hops, fence, expected) in table {
            let facts = Facts {
                routing_active: active,
                hops_taken: hops,
                owner: local.clone(),
                local_fence: fence,
            };
            assert_eq!(decide(&facts), expected, "{facts:?}");
        }
        // A fence says nothing about shards this node does not own.
        let facts = Facts {
            routing_active: true,
            hops_taken: 0,
            owner: Owner::Remote(hint(2)),
            local_fence: Some(Epoch(9)),
        };
        assert!(matches!(decide(&facts), Decision::Forward { .. }));
    }

    #[test]
    fn no_path_forwards_past_the_hop_limit_or_writes_locally_for_another_owner() {
        let owners = [
            Owner::Local { epoch: Epoch(1) },
            Owner::Remote(hint(1)),
            Owner::Unknown {
                hint: Some(hint(1)),
            },
            Owner::Unknown { hint: None },
        ];
        for active in [true, false] {
            for hops in 0..=3u8 {
                for (o, fence) in owners
                    .iter()
                    .flat_map(|o| [None, Some(Epoch(1)), Some(Epoch(2))].map(|f| (o, f)))
                {
                    let d = decide(&Facts {
                        routing_active: active,
                        hops_taken: hops,
                        owner: o.clone(),
                        local_fence: fence,
                    });
                    if let Decision::Forward { hops: h, .. } = d {
                        assert!(h <= MAX_FORWARD_HOPS);
                    }
                    if matches!(d, Decision::Local { .. }) {
                        assert!(
                            matches!(o, Owner::Local { .. }),
                            "local write for a non-owned shard"
                        );
                        assert!(
                            !active || fence.is_none_or(|f| f <= Epoch(1)),
                            "answered from a copy fenced at {fence:?} for a map at epoch 1"
                        );
                    }
                }
            }
        }
    }

    #[test]
    fn unsteered_starts_land_on_owned_shards() {
        let minter = IdMinter::new(NodeId::new(1).unwrap());
        let n = ShardCount::new(16).unwrap();
        for _ in 0..200 {
            match place_unsteered(&minter, n, |s| s.get() % 3 == 1) {
                Placement::Local { id, shard } => {
                    assert_eq!(id.shard(n), shard);
                    assert_eq!(shard.get() % 3, 1);
                }
                p => panic!("{p:?}"),
            }
        }
        assert!(matches!(
            place_unsteered(&minter, n, |_| false),
            Placement::Routed { .. }
        ));
    }

    #[test]
    fn steered_ids_land_on_the_key_shard() {
        let minter = IdMinter::new(NodeId::new(1).unwrap());
        for count in [1u64, 2, 16, 4096] {
            let n = ShardCount::new(count).unwrap();
            for key in ["tenant-a/order-1", "x", "ünï"] {
                let id = mint_steered(&minter, n, key).unwrap();
                assert_eq!(id.shard(n).get(), forkless_sharding::shard_for_key(key, n));
            }
        }
    }
}
