//! API errors and their JSON shape: `{"error": code, "message": ...}` plus
//! typed context, with the status codes of DESIGN.md section 7.

use axum::http::{HeaderValue, StatusCode};
use axum::response::{IntoResponse, Response};
use forkless_routing::OwnerHint;
use forkless_store::StoreError;
use serde_json::{json, Value};

/// Whether a request that failed closed may have been applied by the owner.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Executed {
    /// It never reached the owner.
    No,
    /// It was sent but no answer came back: only an idempotency key makes a
    /// retry safe.
    Unknown,
}

impl Executed {
    fn json(self) -> Value {
        match self {
            Executed::No => json!(false),
            Executed::Unknown => json!("unknown"),
        }
    }
}

#[derive(Debug)]
pub enum ApiError {
    Invalid {
        field: String,
        reason: String,
    },
    TooLarge {
        what: String,
        size: usize,
        limit: usize,
    },
    NotFound(String),
    SequenceConflict {
        expected: u64,
        last_seq: u64,
    },
    Closed {
        status: &'static str,
        last_seq: u64,
    },
    /// A reused idempotency key: `key` names it.
    IdempotencyConflict {
        message: String,
        key: String,
    },
    NotOwner {
        partition: Option<u32>,
        shard: u32,
        hint: Option<OwnerHint>,
        map_version: u64,
        detail: String,
    },
    /// A shard's group refused this node as its leader before executing
    /// anything: `leader` leads it at `term` (`None`: none is known).
    /// Internal: the routing step (`api::route_request`) routes the
    /// request again instead of answering it. Should one reach a client
    /// some other way, it is a 421 that names the leader in its message
    /// only (the node's address is the directory's, not known here).
    NotLeader {
        partition: Option<u32>,
        shard: u32,
        leader: Option<u64>,
        term: u64,
        map_version: u64,
    },
    OwnerUnavailable {
        shard: u32,
        executed: Executed,
        reason: String,
        hint: Option<OwnerHint>,
    },
    /// The shard is hosted here but out of service: its storage failed
    /// (damage found at open, or a failed write or sync). `Unknown` when
    /// the write was in the commit that failed.
    ShardUnavailable {
        shard: u32,
        executed: Executed,
        reason: String,
    },
    Forbidden(String),
    /// A move of one of `shard`'s replicas to node `node` that was not
    /// made (503): `code` `target_unreachable`, the node answers nothing
    /// (down, or cut off from the shard's leader), and the move was
    /// refused before it began or ended with `node` left a learner;
    /// `catch_up_timeout`, its learner did not catch up in time (it stays
    /// one). Asking again goes on from a learner left.
    MoveUnfinished {
        code: &'static str,
        shard: u32,
        node: u64,
        /// The move ended with `node` a learner of the group (asking
        /// again goes on from it); `false`: it was not begun.
        learner_left: bool,
        message: String,
    },
    /// Over a per-node bound on something clients hold (long-polls,
    /// forwards that wait): 503 with `Retry-After`, nothing done
    /// (`executed: false`).
    Overloaded {
        code: &'static str,
        message: String,
        limit: usize,
    },
    /// A request not received in full within this many milliseconds.
    RequestTimeout(u64),
    /// A reload of the cluster file refused: `field` of the file changes
    /// what a running node cannot take; nothing was changed.
    ReloadRefused {
        field: String,
        reason: String,
    },
    Internal(String),
}

impl ApiError {
    pub fn invalid(field: impl Into<String>, reason: impl Into<String>) -> ApiError {
        ApiError::Invalid {
            field: field.into(),
            reason: reason.into(),
        }
    }

    /// The same refusal, naming `field` (a checker's error about a value
    /// that is one field of something larger).
    pub fn at(self, field: String) -> ApiError {
        match self {
            ApiError::Invalid { reason, .. } => ApiError::Invalid { field, reason },
            ApiError::TooLarge { size, limit, .. } => ApiError::TooLarge {
                what: field,
                size,
                limit,
            },
            other => other,
        }
    }

    pub fn code(&self) -> &'static str {
        match self {
            ApiError::Invalid { .. } => "invalid_request",
            ApiError::TooLarge { .. } => "payload_too_large",
            ApiError::NotFound(_) => "execution_not_found",
            ApiError::SequenceConflict { .. } => "sequence_conflict",
            ApiError::Closed { .. } => "execution_closed",
            ApiError::IdempotencyConflict { .. } => "idempotency_conflict",
            ApiError::NotOwner { .. } | ApiError::NotLeader { .. } => "not_owner",
            ApiError::OwnerUnavailable { .. } => "owner_unavailable",
            ApiError::ShardUnavailable { .. } => "shard_unavailable",
            ApiError::Forbidden(_) => "forbidden",
            ApiError::MoveUnfinished { code, .. } => code,
            ApiError::Overloaded { code, .. } => code,
            ApiError::RequestTimeout(_) => "request_timeout",
            ApiError::ReloadRefused { .. } => "reload_refused",
            ApiError::Internal(_) => "internal",
        }
    }

    pub fn status(&self) -> StatusCode {
        match self {
            ApiError::Invalid { .. } => StatusCode::BAD_REQUEST,
            ApiError::TooLarge { .. } => StatusCode::PAYLOAD_TOO_LARGE,
            ApiError::NotFound(_) => StatusCode::NOT_FOUND,
            ApiError::SequenceConflict { .. }
            | ApiError::Closed { .. }
            | ApiError::IdempotencyConflict { .. }
            | ApiError::ReloadRefused { .. } => StatusCode::CONFLICT,
            ApiError::NotOwner { .. } | ApiError::NotLeader { .. } => {
                StatusCode::MISDIRECTED_REQUEST
            }
            ApiError::OwnerUnavailable { .. }
            | ApiError::ShardUnavailable { .. }
            | ApiError::MoveUnfinished { .. }
            | ApiError::Overloaded { .. } => StatusCode::SERVICE_UNAVAILABLE,
            ApiError::Forbidden(_) => StatusCode::FORBIDDEN,
            ApiError::RequestTimeout(_) => StatusCode::REQUEST_TIMEOUT,
            ApiError::Internal(_) => StatusCode::INTERNAL_SERVER_ERROR,
        }
    }

    pub fn body(&self) -> Value {
        let code = self.code();
        match self {
            ApiError::Invalid { field, reason } | ApiError::ReloadRefused { field, reason } => {
                json!({"error": code, "message": format!("{field}: {reason}"), "field": field})
            }
            ApiError::TooLarge { what, size, limit } => json!({
                "error": code, "message": format!("{what} is {size} bytes or more, over the limit of {limit}"),
                "size": size, "limit": limit,
            }),
            ApiError::RequestTimeout(ms) => json!({
                "error": code,
                "message": format!("the request was not received in full within {ms} ms; nothing of it was acted on"),
                "timeout_ms": ms,
            }),
            ApiError::IdempotencyConflict { message, key } => {
                json!({"error": code, "message": message, "idempotency_key": key})
            }
            ApiError::Overloaded { message, limit, .. } => {
                json!({"error": code, "message": message, "limit": limit, "executed": false})
            }
            ApiError::NotFound(m) | ApiError::Forbidden(m) | ApiError::Internal(m) => {
                json!({"error": code, "message": m})
            }
            ApiError::MoveUnfinished {
                shard,
                node,
                learner_left,
                message,
                ..
            } => json!({
                "error": code, "message": message, "shard": shard, "node": node,
                "learner_left": learner_left,
            }),
            ApiError::SequenceConflict { expected, last_seq } => json!({
                "error": code,
                "message": format!("expected_last_seq is {expected} but the execution's last seq is {last_seq}"),
                "expected_last_seq": expected, "last_seq": last_seq,
            }),
            ApiError::Closed { status, last_seq } => json!({
                "error": code,
                "message": format!("execution is {status} (last seq {last_seq}); nothing more can be appended"),
                "status": status, "last_seq": last_seq,
            }),
            ApiError::NotOwner {
                partition,
                shard,
                hint,
                map_version,
                detail,
            } => json!({
                "error": code,
                "message": format!("this node does not own shard {shard}: {detail}"),
                "partition": partition, "shard": shard,
                "owner_hint": hint.as_ref().map(|h| json!({"node": h.node.get(), "address": h.api_addr})),
                "owner_epoch": hint.as_ref().map(|h| h.epoch.get()),
                "map_version": map_version,
                "executed": false,
            }),
            ApiError::NotLeader {
                partition,
                shard,
                leader,
                term,
                map_version,
            } => json!({
                "error": code,
                "message": format!(
                    "this node does not lead shard {shard}'s Raft group: {}; nothing was written (re-resolve the owner with GET /api/cluster)",
                    match leader {
                        Some(l) => format!("node {l} does, at term {term}"),
                        None => format!("it has no leader at term {term} (an election or a leadership transfer is under way)"),
                    }
                ),
                "partition": partition, "shard": shard,
                "owner_hint": null,
                "owner_epoch": term,
                "map_version": map_version,
                "executed": false,
            }),
            ApiError::OwnerUnavailable {
                shard,
                executed,
                reason,
                hint,
            } => json!({
                "error": code,
                "message": format!("the owner of shard {shard} could not be reached: {reason}; nothing was written on this node"),
                "shard": shard,
                "owner_hint": hint.as_ref().map(|h| json!({"node": h.node.get(), "address": h.api_addr})),
                "executed": executed.json(),
            }),
            ApiError::ShardUnavailable {
                shard,
                executed,
                reason,
            } => json!({
                "error": code,
                "message": match executed {
                    Executed::No => format!("shard {shard} is out of service on this node: {reason}; nothing was written"),
                    Executed::Unknown => format!("shard {shard} failed while committing this write: {reason}; whether it was written is unknown (a retry with the same idempotency key is safe)"),
                },
                "shard": shard,
                "executed": executed.json(),
            }),
        }
    }
}

impl IntoResponse for ApiError {
    fn into_response(self) -> Response {
        let mut resp = (self.status(), axum::Json(self.body())).into_response();
        if matches!(
            self,
            ApiError::OwnerUnavailable { .. }
                | ApiError::ShardUnavailable { .. }
                | ApiError::Overloaded { .. }
        ) {
            resp.headers_mut()
                .insert(http::header::RETRY_AFTER, HeaderValue::from_static("1"));
        }
        resp
    }
}

/// Maps a store refusal to the answer a client sees. A fence refusal means
/// this node believed it owned the shard but the store knows a newer epoch:
/// the same as not owning it.
pub fn from_store(e: StoreError, shard: u32, partition: Option<u32>, map_version: u64) -> ApiError {
    match e {
        StoreError::NotFound(id) => ApiError::NotFound(format!("execution {id} not found")),
        StoreError::SequenceConflict { expected, last_seq } => {
            ApiError::SequenceConflict { expected, last_seq }
        }
        StoreError::ExecutionClosed { status, last_seq } => ApiError::Closed {
            status: status.as_str(),
            last_seq,
        },
        StoreError::IdempotencyConflict { ref key, .. }
        | StoreError::IdempotencyKeyReused { ref key, .. } => ApiError::IdempotencyConflict {
            key: key.clone(),
            message: e.to_string(),
        },
        e @ (StoreError::Fenced { .. } | StoreError::ShardNotHosted(_)) => ApiError::NotOwner {
            partition,
            shard,
            hint: None,
            map_version,
            detail: e.to_string(),
        },
        StoreError::Invalid(m) => ApiError::invalid("request", m),
        e @ StoreError::MoveTargetIsVoter { .. } => ApiError::invalid("to", e.to_string()),
        StoreError::OutcomeUnknown { reason, .. } => ApiError::ShardUnavailable {
            shard,
            executed: Executed::Unknown,
            reason,
        },
        StoreError::NotLeader { leader, term, .. } => ApiError::NotLeader {
            partition,
            shard,
            leader,
            term,
            map_version,
        },
        e @ StoreError::MoveTargetUnreachable { node, .. } => ApiError::MoveUnfinished {
            code: "target_unreachable",
            shard,
            node,
            learner_left: true,
            message: e.to_string(),
        },
        e @ StoreError::MoveCatchUpTimeout { node, .. } => ApiError::MoveUnfinished {
            code: "catch_up_timeout",
            shard,
            node,
            learner_left: true,
            message: e.to_string(),
        },
        StoreError::ShardFailed { reason, .. } | StoreError::NotExecuted { reason, .. } => {
            ApiError::ShardUnavailable {
                shard,
                executed: Executed::No,
                reason,
            }
        }
        // The writer went away with the command: it may have been in the
        // group being committed.
        e @ StoreError::WriterGone => ApiError::ShardUnavailable {
            shard,
            executed: Executed::Unknown,
            reason: e.to_string(),
        },
        e => ApiError::Internal(e.to_string()),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use forkless_types::ShardId;

    /// A move that ended unfinished answers 503 with a code of its own
    /// and says that it left its learner (not "nothing was written").
    #[test]
    fn an_unfinished_move_says_why_and_that_it_left_its_learner() {
        for (e, code) in [
            (
                StoreError::MoveTargetUnreachable {
                    shard: ShardId(2),
                    node: 4,
                    silent_s: 30,
                },
                "target_unreachable",
            ),
            (
                StoreError::MoveCatchUpTimeout {
                    shard: ShardId(2),
                    node: 4,
                    within_s: 300,
                },
                "catch_up_timeout",
            ),
        ] {
            let a = from_store(e, 2, None, 1);
            assert_eq!(a.status(), StatusCode::SERVICE_UNAVAILABLE);
            let body = a.body();
            assert_eq!(body["error"], code, "{body}");
            assert_eq!(body["shard"], 2, "{body}");
            assert_eq!(body["node"], 4, "{body}");
            assert_eq!(body["learner_left"], true, "{body}");
            assert!(body.get("executed").is_none(), "{body}");
            let message = body["message"].as_str().unwrap_or_default();
            assert!(message.contains("node 4"), "{message}");
            assert!(!message.contains("nothing was written"), "{message}");
        }
        // A move to a node that is a voter already (found by the move,
        // under its group's lock): the field is the target's.
        let a = from_store(
            StoreError::MoveTargetIsVoter {
                shard: ShardId(2),
                node: 4,
                voters: vec![1, 4, 5],
            },
            2,
            None,
            1,
        );
        assert_eq!(a.status(), StatusCode::BAD_REQUEST);
        let body = a.body();
        assert_eq!(
            (&body["error"], &body["field"]),
            (&json!("invalid_request"), &json!("to")),
            "{body}"
        );
        let message = body["message"].as_str().unwrap_or_default();
        assert!(
            message.contains("node 4 already holds a voting replica of shard 2"),
            "{message}"
        );
    }
}
