//! Request and answer bodies of the client API. Execution ids are decimal
//! strings in JSON.

use forkless_types::ExecutionId;
use serde::{Deserialize, Serialize};
use serde_json::value::RawValue;

/// `POST /api/executions`.
#[derive(Debug, Clone, Default, Serialize)]
pub struct StartExecution {
    pub workflow: String,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub input: Option<Box<RawValue>>,
    /// Steers the execution to the key's shard and finds it again later.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub routing_key: Option<String>,
    /// A repeated start with the same key returns the same execution.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub idempotency_key: Option<String>,
}

impl StartExecution {
    pub fn new(workflow: impl Into<String>) -> Self {
        StartExecution {
            workflow: workflow.into(),
            ..Default::default()
        }
    }

    /// The key that decides the shard, exactly as the server picks it: the
    /// routing key, else the idempotency key, else none (the receiving node
    /// places the execution on a shard it owns).
    pub fn steering_key(&self) -> Option<&str> {
        self.routing_key
            .as_deref()
            .or(self.idempotency_key.as_deref())
    }
}

/// One event to append.
#[derive(Debug, Clone, Serialize)]
pub struct NewEvent {
    #[serde(rename = "type")]
    pub event_type: String,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub payload: Option<Box<RawValue>>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub idempotency_key: Option<String>,
}

impl NewEvent {
    pub fn new(event_type: impl Into<String>) -> Self {
        NewEvent {
            event_type: event_type.into(),
            payload: None,
            idempotency_key: None,
        }
    }
}

/// `POST /api/executions/{id}/events`.
#[derive(Debug, Clone, Default, Serialize)]
pub struct AppendEvents {
    pub events: Vec<NewEvent>,
    /// Refuse the append (409 `sequence_conflict`) unless the execution's
    /// last seq is exactly this.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub expected_last_seq: Option<u64>,
}

impl AppendEvents {
    /// Safe to send twice: every event carries an idempotency key.
    pub fn is_idempotent(&self) -> bool {
        !self.events.is_empty() && self.events.iter().all(|e| e.idempotency_key.is_some())
    }
}

/// `POST /api/executions/{id}/signals`.
#[derive(Debug, Clone, Default, Serialize)]
pub struct Signal {
    pub name: String,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub payload: Option<Box<RawValue>>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub idempotency_key: Option<String>,
}

/// `POST /api/executions/{id}/cancel`.
#[derive(Debug, Clone, Default, Serialize)]
pub struct Cancel {
    #[serde(skip_serializing_if = "Option::is_none")]
    pub reason: Option<String>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub idempotency_key: Option<String>,
}

/// An execution's metadata.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct Execution {
    #[serde(with = "id_string")]
    pub execution_id: ExecutionId,
    pub workflow: String,
    pub status: String,
    pub last_seq: u64,
    #[serde(default)]
    pub routing_key: Option<String>,
    pub partition: u32,
    pub shard: u32,
    #[serde(default)]
    pub epoch: Option<u64>,
    pub created_at: String,
    pub updated_at: String,
    /// On a start: true when an idempotent start found an earlier execution.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub existing: Option<bool>,
}

impl Execution {
    pub fn is_closed(&self) -> bool {
        self.status != "running"
    }
}

/// The answer to an append.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct Appended {
    #[serde(with = "id_string")]
    pub execution_id: ExecutionId,
    pub first_seq: u64,
    pub last_seq: u64,
    #[serde(default)]
    pub deduplicated: bool,
}

/// The answer to a signal or cancel: the one event written.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct EventWritten {
    #[serde(with = "id_string")]
    pub execution_id: ExecutionId,
    pub seq: u64,
    #[serde(default)]
    pub deduplicated: bool,
    #[serde(default)]
    pub status: Option<String>,
}

/// One stored event.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct Event {
    pub seq: u64,
    #[serde(rename = "type")]
    pub event_type: String,
    pub payload: Box<RawValue>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub idempotency_key: Option<String>,
    pub recorded_at: String,
}

/// A page of events.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct EventsPage {
    #[serde(with = "id_string")]
    pub execution_id: ExecutionId,
    pub status: String,
    pub last_seq: u64,
    pub events: Vec<Event>,
}

impl EventsPage {
    pub fn is_closed(&self) -> bool {
        self.status != "running"
    }
}

/// `GET /api/keys/{key}`: the executions started with a routing key.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct KeyLookup {
    pub routing_key: String,
    pub partition: u32,
    pub shard: u32,
    /// Execution objects (after a resize, an entry may carry only the id,
    /// partition and shard).
    pub executions: Vec<serde_json::Value>,
}

/// What to read from an execution's log.
#[derive(Debug, Clone, Copy, Default)]
pub struct ReadEvents {
    /// Events with seq greater than this.
    pub after: u64,
    /// At most this many (server default 100, maximum 1000).
    pub limit: Option<u32>,
    /// Long-poll: wait up to this long for a first new event.
    pub wait: Option<std::time::Duration>,
}

pub(crate) mod id_string {
    use forkless_types::ExecutionId;
    use serde::{de, Deserializer, Serializer};

    pub fn serialize<S: Serializer>(id: &ExecutionId, s: S) -> Result<S::Ok, S::Error> {
        s.collect_str(id)
    }

    pub fn deserialize<'de, D: Deserializer<'de>>(d: D) -> Result<ExecutionId, D::Error> {
        struct V;
        impl de::Visitor<'_> for V {
            type Value = ExecutionId;
            fn expecting(&self, f: &mut std::fmt::Formatter) -> std::fmt::Result {
                f.write_str("an execution id as a decimal string")
            }
            fn visit_str<E: de::Error>(self, v: &str) -> Result<ExecutionId, E> {
                v.parse().map_err(E::custom)
            }
        }
        d.deserialize_str(V)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn bodies_serialise_in_the_server_shape() {
        let mut s = StartExecution::new("order");
        s.input = RawValue::from_string(r#"{"a":1}"#.into()).ok();
        s.idempotency_key = Some("i".into());
        assert_eq!(
            serde_json::to_string(&s).ok().as_deref(),
            Some(r#"{"workflow":"order","input":{"a":1},"idempotency_key":"i"}"#)
        );
        assert_eq!(s.steering_key(), Some("i"));
        s.routing_key = Some("r".into());
        assert_eq!(s.steering_key(), Some("r"));

        let mut a = AppendEvents {
            events: vec![NewEvent::new("x")],
            expected_last_seq: Some(3),
        };
        assert_eq!(
            serde_json::to_string(&a).ok().as_deref(),
            Some(r#"{"events":[{"type":"x"}],"expected_last_seq":3}"#)
        );
        assert!(!a.is_idempotent());
        a.events[0].idempotency_key = Some("k".into());
        assert!(a.is_idempotent());
        a.events.push(NewEvent::new("y"));
        assert!(!a.is_idempotent());
    }

    #[test]
    fn ids_are_strings_and_validated() {
        let ok: Result<Appended, _> = serde_json::from_str(
            r#"{"execution_id":"123","first_seq":2,"last_seq":2,"deduplicated":false}"#,
        );
        assert_eq!(ok.map(|a| a.execution_id.get()).ok(), Some(123));
        for bad in [r#""-1""#, r#"123"#, r#""abc""#, r#""0""#] {
            let body = format!(r#"{{"execution_id":{bad},"first_seq":2,"last_seq":2}}"#);
            assert!(serde_json::from_str::<Appended>(&body).is_err(), "{bad}");
        }
    }
}
