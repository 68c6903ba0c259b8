//! JSON shapes of the client API, and their parsing with field paths in
//! every error. Converted by hand to and from the store's types.

use crate::config::Limits;
use crate::error::ApiError;
use bytes::Bytes;
use serde::de::DeserializeOwned;
use serde::Deserialize;
use serde_json::value::RawValue;

/// Longest workflow name, event type or idempotency key, bytes.
pub const NAME_BYTES_MAX: usize = 256;
/// Longest routing key, bytes.
pub const ROUTING_KEY_BYTES_MAX: usize = 1024;

/// Parses a JSON body; errors name the field (`events[0].type`) and why.
pub fn parse<T: DeserializeOwned>(body: &Bytes) -> Result<T, ApiError> {
    if body.is_empty() {
        return Err(ApiError::invalid("body", "a JSON object is required"));
    }
    // The fast path parses once; only a body that fails is parsed again,
    // tracking the path, so the error can name the field.
    if let Ok(v) = serde_json::from_slice::<T>(body) {
        return Ok(v);
    }
    let mut de = serde_json::Deserializer::from_slice(body);
    match serde_path_to_error::deserialize::<_, T>(&mut de) {
        Ok(v) => {
            // The fast path failed, so if the value parsed, something
            // follows it (`{...} trailing`): refuse, never drop it.
            de.end()
                .map_err(|e| ApiError::invalid("body", e.to_string()))?;
            Ok(v)
        }
        Err(e) => {
            let path = e.path().to_string();
            let field = if path == "." {
                "body".to_string()
            } else {
                path
            };
            Err(ApiError::invalid(field, e.into_inner().to_string()))
        }
    }
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct StartBody {
    pub workflow: String,
    #[serde(default)]
    pub input: Option<Box<RawValue>>,
    #[serde(default)]
    pub routing_key: Option<String>,
    #[serde(default)]
    pub idempotency_key: Option<String>,
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct EventBody {
    #[serde(rename = "type")]
    pub event_type: String,
    #[serde(default)]
    pub payload: Option<Box<RawValue>>,
    #[serde(default)]
    pub idempotency_key: Option<String>,
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct AppendBody {
    pub events: Vec<EventBody>,
    #[serde(default)]
    pub expected_last_seq: Option<u64>,
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct AppendByIdBody {
    pub execution_id: IdString,
    pub events: Vec<EventBody>,
    #[serde(default)]
    pub expected_last_seq: Option<u64>,
}

/// An execution id in a JSON body: always a decimal string.
#[derive(Debug)]
pub struct IdString(pub String);

impl<'de> Deserialize<'de> for IdString {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        struct V;
        impl serde::de::Visitor<'_> for V {
            type Value = IdString;
            fn expecting(&self, f: &mut std::fmt::Formatter) -> std::fmt::Result {
                f.write_str("a decimal string (ids are strings in JSON because JavaScript loses integers above 2^53)")
            }
            fn visit_str<E: serde::de::Error>(self, v: &str) -> Result<IdString, E> {
                Ok(IdString(v.to_string()))
            }
        }
        d.deserialize_any(V)
    }
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct SignalBody {
    pub name: String,
    #[serde(default)]
    pub payload: Option<Box<RawValue>>,
    #[serde(default)]
    pub idempotency_key: Option<String>,
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct CancelBody {
    #[serde(default)]
    pub reason: Option<String>,
    #[serde(default)]
    pub idempotency_key: Option<String>,
}

/// Event types only the server writes.
pub const RESERVED_TYPES: [(&str, &str); 3] = [
    ("execution.started", "it is written by POST /api/executions"),
    (
        "execution.signaled",
        "use POST /api/executions/{id}/signals",
    ),
    (
        "execution.cancelled",
        "use POST /api/executions/{id}/cancel",
    ),
];

pub fn check_name(field: &str, v: &str, max: usize) -> Result<(), ApiError> {
    if v.is_empty() {
        return Err(ApiError::invalid(field, "must not be empty"));
    }
    if v.len() > max {
        return Err(ApiError::invalid(
            field,
            format!("is {} bytes, longer than the limit of {max}", v.len()),
        ));
    }
    if v.chars().any(char::is_control) {
        return Err(ApiError::invalid(
            field,
            "must not contain control characters",
        ));
    }
    Ok(())
}

pub fn check_payload(
    field: &str,
    p: &Option<Box<RawValue>>,
    limits: &Limits,
) -> Result<(), ApiError> {
    if let Some(p) = p {
        if p.get().len() > limits.event_payload_bytes_max {
            return Err(ApiError::TooLarge {
                what: field.to_string(),
                size: p.get().len(),
                limit: limits.event_payload_bytes_max,
            });
        }
    }
    Ok(())
}

pub fn payload_bytes(p: Option<Box<RawValue>>) -> Vec<u8> {
    match p {
        Some(p) => {
            let s: Box<str> = p.into();
            s.into_string().into_bytes()
        }
        None => b"null".to_vec(),
    }
}

/// Validates an append's events: count, types, keys, payload sizes.
pub fn check_events(events: &[EventBody], limits: &Limits) -> Result<(), ApiError> {
    if events.is_empty() {
        return Err(ApiError::invalid("events", "must hold at least one event"));
    }
    if events.len() > limits.batch_events_max {
        return Err(ApiError::TooLarge {
            what: "events (count)".into(),
            size: events.len(),
            limit: limits.batch_events_max,
        });
    }
    let mut keys = std::collections::HashSet::new();
    for (i, e) in events.iter().enumerate() {
        // Field names are formatted only for an error: this runs for every
        // event appended.
        let field = |name: &str| format!("events[{i}].{name}");
        check_name("type", &e.event_type, NAME_BYTES_MAX).map_err(|err| err.at(field("type")))?;
        if let Some((_, why)) = RESERVED_TYPES.iter().find(|(t, _)| *t == e.event_type) {
            return Err(ApiError::invalid(
                field("type"),
                format!("{} is reserved: {why}", e.event_type),
            ));
        }
        if forkless_store::terminal_status(&e.event_type).is_some() && i + 1 != events.len() {
            return Err(ApiError::invalid(
                field("type"),
                format!(
                    "{} ends the execution, so it must be the last event of the batch",
                    e.event_type
                ),
            ));
        }
        if let Some(k) = &e.idempotency_key {
            check_name("idempotency_key", k, NAME_BYTES_MAX)
                .map_err(|err| err.at(field("idempotency_key")))?;
            if !keys.insert(k.as_str()) {
                return Err(ApiError::invalid(
                    field("idempotency_key"),
                    "repeats an earlier key in this batch",
                ));
            }
        }
        check_payload("payload", &e.payload, limits).map_err(|err| err.at(field("payload")))?;
    }
    Ok(())
}

pub fn rfc3339(ms: u64) -> String {
    let t = std::time::UNIX_EPOCH + std::time::Duration::from_millis(ms);
    humantime::format_rfc3339_millis(t).to_string()
}

/// Encodes a page of events by hand, splicing each stored payload verbatim.
///
/// Payloads were validated as JSON when they were written and are stored as
/// the client's exact text. Re-parsing them here (into a `serde_json::Value`
/// or a checked `RawValue`) would cost CPU on every read and, worse, could
/// refuse text that is valid JSON but not representable as a `Value` (a
/// number like `1e400`, a lone surrogate escape, deep nesting), making an
/// acknowledged event unreadable.
pub fn encode_events_page(
    execution_id: &str,
    status: &str,
    last_seq: u64,
    events: &[forkless_store::StoredEvent],
    next_after: Option<u64>,
) -> Vec<u8> {
    let mut out =
        Vec::with_capacity(96 + events.iter().map(|e| e.payload.len() + 128).sum::<usize>());
    out.extend_from_slice(b"{\"execution_id\":");
    push_str(&mut out, execution_id);
    out.extend_from_slice(b",\"status\":");
    push_str(&mut out, status);
    out.extend_from_slice(format!(",\"last_seq\":{last_seq},\"events\":[").as_bytes());
    for (i, e) in events.iter().enumerate() {
        if i > 0 {
            out.push(b',');
        }
        put_event(&mut out, e);
    }
    match next_after {
        Some(n) => out.extend_from_slice(format!("],\"next_after\":{n}}}").as_bytes()),
        None => out.extend_from_slice(b"],\"next_after\":null}"),
    }
    out
}

/// The bytes `e` takes in a page [`encode_events_page`] makes, with the
/// comma before it: what a page is cut to fit by (counted, not made).
pub fn event_bytes_in_page(e: &forkless_store::StoredEvent) -> usize {
    /// Counts what is written to it.
    struct Count(usize);
    impl std::io::Write for Count {
        fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
            self.0 += buf.len();
            Ok(buf.len())
        }
        fn flush(&mut self) -> std::io::Result<()> {
            Ok(())
        }
    }
    let mut n = Count(1);
    put_event(&mut n, e);
    n.0
}

/// One event of a page, written to `out` (a `Vec`, or a count of its
/// bytes: neither fails).
fn put_event(out: &mut impl std::io::Write, e: &forkless_store::StoredEvent) {
    out_all(out, format!("{{\"seq\":{},\"type\":", e.seq).as_bytes());
    push_str(&mut *out, &e.event_type);
    out_all(out, b",\"payload\":");
    if e.payload.is_empty() {
        out_all(out, b"null");
    } else {
        out_all(out, &e.payload);
    }
    if let Some(k) = &e.idempotency_key {
        out_all(out, b",\"idempotency_key\":");
        push_str(&mut *out, k);
    }
    out_all(out, b",\"recorded_at\":");
    push_str(&mut *out, &rfc3339(e.recorded_at_ms));
    out_all(out, b"}");
}

fn out_all(out: &mut impl std::io::Write, b: &[u8]) {
    // Writing to a Vec or a count cannot fail.
    let _ = out.write_all(b);
}

fn push_str(out: &mut impl std::io::Write, s: &str) {
    // Serializing a &str into a Vec or a count cannot fail.
    let _ = serde_json::to_writer(out, s);
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A page's events take at most `EVENT_FRAME_BYTES_MAX` each besides
    /// their payloads, and the page `PAGE_FRAME_BYTES_MAX` besides them,
    /// with the longest names escaping to twice their length.
    #[test]
    fn a_pages_frame_is_within_its_bound() {
        use crate::config::{EVENT_FRAME_BYTES_MAX, PAGE_FRAME_BYTES_MAX};
        let name = "\"".repeat(NAME_BYTES_MAX);
        let event = forkless_store::StoredEvent {
            seq: u64::MAX,
            event_type: name.clone(),
            idempotency_key: Some(name),
            // The last millisecond of year 9999.
            recorded_at_ms: 253_402_300_799_999,
            payload: Vec::new(),
        };
        let id = i64::MAX.to_string();
        let empty = encode_events_page(&id, "cancelled", u64::MAX, &[], Some(u64::MAX));
        assert!(empty.len() <= PAGE_FRAME_BYTES_MAX, "{}", empty.len());
        let events = vec![event; 3];
        let page = encode_events_page(&id, "cancelled", u64::MAX, &events, Some(u64::MAX));
        let per_event = (page.len() - empty.len()).div_ceil(3);
        assert!(per_event <= EVENT_FRAME_BYTES_MAX, "{per_event}");
        assert!(
            per_event > EVENT_FRAME_BYTES_MAX - 100,
            "{per_event}: a loose bound"
        );
    }

    /// What a page is cut to fit by is what its events take in it, to
    /// the byte: names that escape, no payload, no key.
    #[test]
    fn an_events_bytes_in_a_page_are_counted_exactly() {
        let ev =
            |seq, event_type: &str, payload: &str, key: Option<&str>| forkless_store::StoredEvent {
                seq,
                event_type: event_type.to_string(),
                idempotency_key: key.map(str::to_string),
                recorded_at_ms: 1_765_000_000_123,
                payload: payload.as_bytes().to_vec(),
            };
        let events = [
            ev(2, "a", r#"{"x":1}"#, None),
            ev(3, "tab\there \"quoted\" \u{1}", "", Some("k\\1")),
            ev(u64::MAX, "\u{e9}t\u{e9}", "[1,2,3]", Some("key")),
        ];
        let empty = encode_events_page("7", "running", 9, &[], None);
        for n in 1..=events.len() {
            let page = encode_events_page("7", "running", 9, &events[..n], None);
            let counted: usize = events[..n].iter().map(event_bytes_in_page).sum();
            // (The first event has no comma before it.)
            assert_eq!(page.len(), empty.len() + counted - 1, "{n} events");
        }
    }

    #[test]
    fn trailing_bytes_after_the_value_are_refused_on_both_paths() {
        let ok: Result<StartBody, _> = parse(&Bytes::from_static(br#"{"workflow":"a"}"#));
        assert!(ok.is_ok());
        for bad in [
            &br#"{"workflow":"a"} trailing"#[..],
            br#"{"workflow":"a"}{"workflow":"b"}"#,
        ] {
            let err = parse::<StartBody>(&Bytes::copy_from_slice(bad)).unwrap_err();
            assert!(
                matches!(err, ApiError::Invalid { ref field, .. } if field == "body"),
                "{err:?}"
            );
        }
        let err = parse::<StartBody>(&Bytes::from_static(br#"{"workflow":1}"#)).unwrap_err();
        assert!(
            matches!(err, ApiError::Invalid { ref field, .. } if field == "workflow"),
            "{err:?}"
        );
    }

    #[test]
    fn each_refused_event_field_is_named_with_its_index() {
        let limits = Limits {
            event_payload_bytes_max: 8,
            ..Limits::default()
        };
        let body = |events: &str| {
            parse::<AppendBody>(&Bytes::from(format!(r#"{{"events":{events}}}"#)))
                .expect("a well-formed body")
                .events
        };
        let ok = r#"{"type":"t","payload":1,"idempotency_key":"a"}"#;
        let cases = [
            (r#"{"type":""}"#, "events[1].type", "invalid_request"),
            (r#"{"type":"t\u0007"}"#, "events[1].type", "invalid_request"),
            (
                r#"{"type":"t","idempotency_key":""}"#,
                "events[1].idempotency_key",
                "invalid_request",
            ),
            (
                r#"{"type":"t","idempotency_key":"a"}"#,
                "events[1].idempotency_key",
                "invalid_request",
            ),
            (
                r#"{"type":"t","payload":"123456789"}"#,
                "events[1].payload",
                "payload_too_large",
            ),
        ];
        assert!(check_events(&body(&format!("[{ok}]")), &limits).is_ok());
        for (bad, field, code) in cases {
            let err = check_events(&body(&format!("[{ok},{bad}]")), &limits).unwrap_err();
            let named = match &err {
                ApiError::Invalid { field, .. } => field,
                ApiError::TooLarge { what, .. } => what,
                other => panic!("{bad}: {other:?}"),
            };
            assert_eq!((named.as_str(), err.code()), (field, code), "{bad}");
        }
    }

    #[test]
    fn events_page_splices_payloads_that_a_value_could_not_hold() {
        let ev = |seq, payload: &str, idem: Option<&str>| forkless_store::StoredEvent {
            seq,
            event_type: "t\"q".into(),
            idempotency_key: idem.map(String::from),
            recorded_at_ms: 0,
            payload: payload.as_bytes().to_vec(),
        };
        let deep = format!("{}{}", "[".repeat(200), "]".repeat(200));
        let events = vec![
            ev(1, "1e400", None),
            ev(2, r#""\ud800""#, Some("k")),
            ev(3, &deep, None),
        ];
        let out = String::from_utf8(encode_events_page("7", "running", 3, &events, None)).unwrap();
        assert!(out.starts_with(r#"{"execution_id":"7","status":"running","last_seq":3,"events":[{"seq":1,"type":"t\"q","payload":1e400,"recorded_at":"1970-01-01T00:00:00.000Z"}"#), "{out}");
        assert!(out.contains(r#""payload":"\ud800","idempotency_key":"k""#));
        assert!(out.contains(&format!(r#""payload":{deep},"recorded_at""#)));
        assert!(out.ends_with(r#"}],"next_after":null}"#));
        let empty = encode_events_page("7", "completed", 0, &[], None);
        assert_eq!(
            empty,
            br#"{"execution_id":"7","status":"completed","last_seq":0,"events":[],"next_after":null}"#
        );
        let more =
            String::from_utf8(encode_events_page("7", "running", 9, &events, Some(3))).unwrap();
        assert!(more.ends_with(r#"}],"next_after":3}"#), "{more}");
    }
}
