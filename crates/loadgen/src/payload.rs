//! The event payload: a JSON object serialised to exactly the requested size.

use bytes::Bytes;

/// A JSON object whose serialised text is exactly `len` bytes (for `len`
/// of at least 16), e.g. `{"pad":"xxxx…"}`.
#[derive(Clone, Debug)]
pub struct Payload {
    json: Bytes,
}

/// The smallest payload [`Payload::new`] can make exactly.
pub const MIN_PAYLOAD_BYTES: usize = 16;

impl Payload {
    /// Builds a payload of exactly `len` bytes of JSON text (at least
    /// [`MIN_PAYLOAD_BYTES`]; smaller requests get that size).
    pub fn new(len: usize) -> Self {
        let len = len.max(MIN_PAYLOAD_BYTES);
        let prefix = r#"{"bench":"forkless","pad":""#;
        let suffix = r#""}"#;
        let text = if len >= prefix.len() + suffix.len() {
            let pad = len - prefix.len() - suffix.len();
            format!("{prefix}{}{suffix}", "x".repeat(pad))
        } else {
            // {"p":"xx…"} has 8 bytes of framing.
            format!(r#"{{"p":"{}"}}"#, "x".repeat(len - 8))
        };
        Self {
            json: Bytes::from(text),
        }
    }

    /// The JSON text.
    pub fn as_bytes(&self) -> &Bytes {
        &self.json
    }

    /// The JSON text as a string slice.
    pub fn as_str(&self) -> &str {
        // Built from a `String` above, so always valid UTF-8.
        std::str::from_utf8(&self.json).unwrap_or("{}")
    }

    /// Length in bytes.
    pub fn len(&self) -> usize {
        self.json.len()
    }

    /// Always false: a payload is at least [`MIN_PAYLOAD_BYTES`] long.
    pub fn is_empty(&self) -> bool {
        self.json.is_empty()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn exact_sizes_and_valid_json() {
        for len in [16, 20, 31, 32, 33, 64, 256, 1024, 4096] {
            let p = Payload::new(len);
            assert_eq!(p.len(), len, "len {len}");
            let v: serde_json::Value = serde_json::from_slice(p.as_bytes()).expect("valid json");
            assert!(v.is_object());
        }
    }
}
