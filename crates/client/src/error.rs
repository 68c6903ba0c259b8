//! Typed errors: one variant per way a caller should react, parsed from the
//! server's `{"error": code, "message": ...}` bodies (DESIGN.md section 7).

use serde::Serialize;
use serde_json::{json, Value};
use std::time::Duration;

/// Whether a request that failed may have been applied by the owner.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum Executed {
    /// It certainly was not applied (it never reached the owner).
    No,
    /// It may have been applied: it was sent, but no answer came back. Only
    /// an idempotency key makes a retry safe.
    Unknown,
}

impl Executed {
    fn to_json(self) -> Value {
        match self {
            Executed::No => json!(false),
            Executed::Unknown => json!("unknown"),
        }
    }
}

/// Everything a forkless request can fail with.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// 400: the request is malformed; `field` names the culprit.
    #[error("invalid request: {message}")]
    Invalid { field: String, message: String },
    /// 404: no such execution on its owner.
    #[error("not found: {message}")]
    NotFound { message: String },
    /// 409: `expected_last_seq` did not match the execution's last seq.
    #[error("sequence conflict: {message}")]
    SequenceConflict {
        expected_last_seq: Option<u64>,
        last_seq: u64,
        message: String,
    },
    /// 409: the execution has ended; nothing more can be appended.
    #[error("execution closed: {message}")]
    Closed {
        status: String,
        last_seq: u64,
        message: String,
    },
    /// 409: an idempotency key was reused for a different request.
    #[error("idempotency conflict: {message}")]
    IdempotencyConflict { message: String },
    /// 413: over the server's size limits.
    #[error("too large: {message}")]
    TooLarge {
        size: Option<u64>,
        limit: Option<u64>,
        message: String,
    },
    /// 421: the node is not the shard's owner, even after refreshing the map,
    /// following the owner hint once and trying again by a fresh map within
    /// the retry policy (or with routing disabled: not followed).
    #[error("not the owner: {message}")]
    NotOwner {
        shard: Option<u32>,
        owner_hint: Option<String>,
        map_version: Option<u64>,
        message: String,
    },
    /// 503: the owner could not be answered for. With `executed: Unknown`
    /// the request may have been applied; it was retried only if idempotent.
    #[error("{}", owner_unavailable_text(*.executed, *.attempts, *.gave_up, .message))]
    OwnerUnavailable {
        executed: Executed,
        shard: Option<u32>,
        retry_after: Option<Duration>,
        attempts: u32,
        gave_up: GaveUp,
        message: String,
    },
    /// 403: e.g. a client set a peer-only header.
    #[error("forbidden: {message}")]
    Forbidden { message: String },
    /// Any other answer with an error body (500, 405, an unknown code).
    #[error("server error (HTTP {status} {code}): {message}")]
    Server {
        status: u16,
        code: String,
        message: String,
    },
    /// No usable answer: connection refused, reset, timed out.
    #[error("{}", transport_text(.address, *.executed, *.attempts, *.gave_up, .message))]
    Transport {
        address: String,
        executed: Executed,
        attempts: u32,
        gave_up: GaveUp,
        message: String,
    },
    /// An answer that is not what the API promises (not JSON, missing fields).
    #[error("protocol error: {0}")]
    Protocol(String),
    /// The client was configured wrongly (bad URL, https).
    #[error("client configuration: {0}")]
    Config(String),
}

/// Why a failed request was not sent again.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum GaveUp {
    /// It may have been applied and carries no idempotency key: repeating
    /// it could apply it twice.
    UnsafeToRepeat,
    /// The retry policy's attempts or time ran out (or retries are off).
    Exhausted,
}

fn tries(attempts: u32) -> String {
    format!("{attempts} attempt{}", if attempts == 1 { "" } else { "s" })
}

fn outcome_text(executed: Executed, attempts: u32, gave_up: GaveUp) -> String {
    match (executed, gave_up) {
        (Executed::No, _) => format!("nothing was written (gave up after {})", tries(attempts)),
        (Executed::Unknown, GaveUp::UnsafeToRepeat) => format!(
            "outcome unknown: it MAY have been applied, and was not retried (after {}) because it \
             carries no idempotency key; read the execution to find out, or send an idempotency key",
            tries(attempts)
        ),
        (Executed::Unknown, GaveUp::Exhausted) => format!(
            "outcome unknown: it may have been applied (gave up after {})",
            tries(attempts)
        ),
    }
}

fn owner_unavailable_text(
    executed: Executed,
    attempts: u32,
    gave_up: GaveUp,
    message: &str,
) -> String {
    format!(
        "owner unavailable, {}: {message}",
        outcome_text(executed, attempts, gave_up)
    )
}

fn transport_text(
    address: &str,
    executed: Executed,
    attempts: u32,
    gave_up: GaveUp,
    message: &str,
) -> String {
    let what = match executed {
        Executed::No => "could not reach",
        Executed::Unknown => "no answer from",
    };
    format!(
        "{what} {address}, {}: {message}",
        outcome_text(executed, attempts, gave_up)
    )
}

impl Error {
    /// The server's error code, or a client-side one (`transport`,
    /// `protocol`, `config`).
    pub fn code(&self) -> &str {
        match self {
            Error::Invalid { .. } => "invalid_request",
            Error::NotFound { .. } => "execution_not_found",
            Error::SequenceConflict { .. } => "sequence_conflict",
            Error::Closed { .. } => "execution_closed",
            Error::IdempotencyConflict { .. } => "idempotency_conflict",
            Error::TooLarge { .. } => "payload_too_large",
            Error::NotOwner { .. } => "not_owner",
            Error::OwnerUnavailable { .. } => "owner_unavailable",
            Error::Forbidden { .. } => "forbidden",
            Error::Server { code, .. } => code,
            Error::Transport { .. } => "transport",
            Error::Protocol(_) => "protocol",
            Error::Config(_) => "config",
        }
    }

    /// The HTTP status the server answered, if the error came from one.
    pub fn http_status(&self) -> Option<u16> {
        Some(match self {
            Error::Invalid { .. } => 400,
            Error::NotFound { .. } => 404,
            Error::SequenceConflict { .. }
            | Error::Closed { .. }
            | Error::IdempotencyConflict { .. } => 409,
            Error::TooLarge { .. } => 413,
            Error::NotOwner { .. } => 421,
            Error::OwnerUnavailable { .. } => 503,
            Error::Forbidden { .. } => 403,
            Error::Server { status, .. } => *status,
            Error::Transport { .. } | Error::Protocol(_) | Error::Config(_) => return None,
        })
    }

    /// Whether the request may have been applied although it failed.
    pub fn maybe_executed(&self) -> bool {
        matches!(
            self,
            Error::OwnerUnavailable {
                executed: Executed::Unknown,
                ..
            } | Error::Transport {
                executed: Executed::Unknown,
                ..
            }
        )
    }

    /// The error as one JSON object in the server's shape
    /// (`{"error": code, "message": ..., typed fields}`).
    pub fn to_json(&self) -> Value {
        // The server's own words where it gave them; the client's
        // explanation where the client adds something (retries, outcome).
        let message = match self {
            Error::Invalid { message, .. }
            | Error::NotFound { message }
            | Error::SequenceConflict { message, .. }
            | Error::Closed { message, .. }
            | Error::IdempotencyConflict { message }
            | Error::TooLarge { message, .. }
            | Error::NotOwner { message, .. }
            | Error::Forbidden { message }
            | Error::Server { message, .. } => message.clone(),
            _ => self.to_string(),
        };
        let mut v = json!({"error": self.code(), "message": message});
        if let Some(s) = self.http_status() {
            v["http_status"] = json!(s);
        }
        match self {
            Error::Invalid { field, .. } => v["field"] = json!(field),
            Error::SequenceConflict {
                expected_last_seq,
                last_seq,
                ..
            } => {
                v["expected_last_seq"] = json!(expected_last_seq);
                v["last_seq"] = json!(last_seq);
            }
            Error::Closed {
                status, last_seq, ..
            } => {
                v["status"] = json!(status);
                v["last_seq"] = json!(last_seq);
            }
            Error::TooLarge { size, limit, .. } => {
                v["size"] = json!(size);
                v["limit"] = json!(limit);
            }
            Error::NotOwner {
                shard,
                owner_hint,
                map_version,
                ..
            } => {
                v["shard"] = json!(shard);
                v["owner_hint"] = json!(owner_hint);
                v["map_version"] = json!(map_version);
            }
            Error::OwnerUnavailable {
                executed,
                shard,
                attempts,
                gave_up,
                ..
            } => {
                v["executed"] = executed.to_json();
                v["shard"] = json!(shard);
                v["attempts"] = json!(attempts);
                v["gave_up"] = json!(gave_up);
            }
            Error::Transport {
                address,
                executed,
                attempts,
                gave_up,
                ..
            } => {
                v["executed"] = executed.to_json();
                v["address"] = json!(address);
                v["attempts"] = json!(attempts);
                v["gave_up"] = json!(gave_up);
            }
            _ => {}
        }
        v
    }

    /// Parses a non-2xx answer into its variant. Never panics on what a
    /// server sends: a body that is not an error object is a
    /// [`Error::Protocol`] naming the status and the start of the body.
    pub fn from_response(status: u16, body: &[u8], retry_after: Option<Duration>) -> Error {
        let v: Value = match serde_json::from_slice(body) {
            Ok(v @ Value::Object(_)) => v,
            _ => {
                let text = String::from_utf8_lossy(&body[..body.len().min(200)]).into_owned();
                // A 503 without our body (e.g. from a proxy): we cannot know
                // whether the owner applied the request.
                if status == 503 {
                    return Error::OwnerUnavailable {
                        executed: Executed::Unknown,
                        shard: None,
                        retry_after,
                        attempts: 1,
                        gave_up: GaveUp::Exhausted,
                        message: format!("HTTP 503 without an error body: {text:?}"),
                    };
                }
                return Error::Protocol(format!(
                    "HTTP {status} with a body that is not a JSON error object: {text:?}"
                ));
            }
        };
        let s = |k: &str| v.get(k).and_then(Value::as_str).map(str::to_string);
        let u = |k: &str| v.get(k).and_then(Value::as_u64);
        let code = s("error").unwrap_or_default();
        let message = s("message").unwrap_or_else(|| format!("HTTP {status}"));
        match (status, code.as_str()) {
            (400, _) | (_, "invalid_request") => Error::Invalid {
                field: s("field").unwrap_or_else(|| "request".into()),
                message,
            },
            (_, "execution_not_found") => Error::NotFound { message },
            (_, "sequence_conflict") => Error::SequenceConflict {
                expected_last_seq: u("expected_last_seq"),
                last_seq: u("last_seq").unwrap_or(0),
                message,
            },
            (_, "execution_closed") => Error::Closed {
                status: s("status").unwrap_or_default(),
                last_seq: u("last_seq").unwrap_or(0),
                message,
            },
            (_, "idempotency_conflict") => Error::IdempotencyConflict { message },
            (413, _) | (_, "payload_too_large") => Error::TooLarge {
                size: u("size"),
                limit: u("limit"),
                message,
            },
            (421, _) | (_, "not_owner") => Error::NotOwner {
                shard: u("shard").and_then(|x| u32::try_from(x).ok()),
                owner_hint: v
                    .get("owner_hint")
                    .and_then(|h| h.get("address"))
                    .and_then(Value::as_str)
                    .map(str::to_string),
                map_version: u("map_version"),
                message,
            },
            (503, _) | (_, "owner_unavailable") => Error::OwnerUnavailable {
                // Only an explicit `false` proves nothing was applied.
                executed: if v.get("executed") == Some(&Value::Bool(false)) {
                    Executed::No
                } else {
                    Executed::Unknown
                },
                shard: u("shard").and_then(|x| u32::try_from(x).ok()),
                retry_after,
                attempts: 1,
                gave_up: GaveUp::Exhausted,
                message,
            },
            (403, _) | (_, "forbidden") => Error::Forbidden { message },
            _ => Error::Server {
                status,
                code: if code.is_empty() {
                    "unknown".into()
                } else {
                    code
                },
                message,
            },
        }
    }

    /// Records how many attempts were made, and why there were no more.
    pub(crate) fn gave_up(mut self, n: u32, why: GaveUp) -> Error {
        if let Error::OwnerUnavailable {
            attempts, gave_up, ..
        }
        | Error::Transport {
            attempts, gave_up, ..
        } = &mut self
        {
            *attempts = n;
            *gave_up = why;
        }
        self
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_each_server_error() {
        let e = Error::from_response(
            409,
            br#"{"error":"sequence_conflict","message":"m","expected_last_seq":3,"last_seq":5}"#,
            None,
        );
        assert!(matches!(
            e,
            Error::SequenceConflict {
                expected_last_seq: Some(3),
                last_seq: 5,
                ..
            }
        ));
        let e = Error::from_response(
            409,
            br#"{"error":"execution_closed","message":"m","status":"cancelled","last_seq":4}"#,
            None,
        );
        assert!(
            matches!(e, Error::Closed { ref status, last_seq: 4, .. } if status == "cancelled")
        );
        let e = Error::from_response(
            400,
            br#"{"error":"invalid_request","message":"events[0].type: x","field":"events[0].type"}"#,
            None,
        );
        assert!(matches!(e, Error::Invalid { ref field, .. } if field == "events[0].type"));
        let e = Error::from_response(
            421,
            br#"{"error":"not_owner","message":"m","shard":3,"owner_hint":{"node":2,"address":"127.0.0.1:7072"},"map_version":7,"executed":false}"#,
            None,
        );
        assert!(
            matches!(e, Error::NotOwner { shard: Some(3), ref owner_hint, map_version: Some(7), .. } if owner_hint.as_deref() == Some("127.0.0.1:7072"))
        );
        let e = Error::from_response(
            404,
            br#"{"error":"execution_not_found","message":"m"}"#,
            None,
        );
        assert!(matches!(e, Error::NotFound { .. }));
        let e = Error::from_response(
            413,
            br#"{"error":"payload_too_large","message":"m","size":9,"limit":8}"#,
            None,
        );
        assert!(matches!(
            e,
            Error::TooLarge {
                size: Some(9),
                limit: Some(8),
                ..
            }
        ));
    }

    #[test]
    fn owner_unavailable_executed_is_no_only_when_explicitly_false() {
        let ra = Some(Duration::from_secs(1));
        let no = Error::from_response(
            503,
            br#"{"error":"owner_unavailable","message":"m","shard":1,"executed":false}"#,
            ra,
        );
        assert!(matches!(
            no,
            Error::OwnerUnavailable {
                executed: Executed::No,
                shard: Some(1),
                ..
            }
        ));
        assert!(!no.maybe_executed());
        for body in [
            &br#"{"error":"owner_unavailable","message":"m","executed":"unknown"}"#[..],
            br#"{"error":"owner_unavailable","message":"m"}"#,
            br#"{"error":"owner_unavailable","message":"m","executed":"false"}"#,
            b"<html>bad gateway</html>",
            b"",
        ] {
            let e = Error::from_response(503, body, ra);
            assert!(
                matches!(
                    e,
                    Error::OwnerUnavailable {
                        executed: Executed::Unknown,
                        ..
                    }
                ),
                "{e:?}"
            );
            assert!(e.maybe_executed());
        }
    }

    #[test]
    fn garbage_is_a_protocol_error_not_a_panic() {
        for body in [&b"not json"[..], b"[1,2]", b"\xff\xfe", b"null"] {
            assert!(matches!(
                Error::from_response(500, body, None),
                Error::Protocol(_)
            ));
        }
        // Wrong types inside a valid object fall back to defaults.
        let e = Error::from_response(
            409,
            br#"{"error":"sequence_conflict","last_seq":"five","message":7}"#,
            None,
        );
        assert!(matches!(e, Error::SequenceConflict { last_seq: 0, .. }));
        let e = Error::from_response(500, br#"{"error":"internal","message":"boom"}"#, None);
        assert!(matches!(e, Error::Server { status: 500, ref code, .. } if code == "internal"));
    }

    #[test]
    fn json_form_keeps_the_typed_fields() {
        let e = Error::OwnerUnavailable {
            executed: Executed::Unknown,
            shard: Some(2),
            retry_after: None,
            attempts: 1,
            gave_up: GaveUp::UnsafeToRepeat,
            message: "timeout".into(),
        };
        let v = e.to_json();
        assert_eq!(v["error"], "owner_unavailable");
        assert_eq!(v["executed"], "unknown");
        assert_eq!(v["http_status"], 503);
        assert_eq!(v["gave_up"], "unsafe_to_repeat");
        assert!(v["message"]
            .as_str()
            .is_some_and(|m| m.contains("MAY have been applied")));
        let e = e.gave_up(4, GaveUp::Exhausted);
        assert!(!e.to_string().contains("idempotency key"), "{e}");
        assert!(e.to_string().contains("4 attempts"), "{e}");
    }
}
