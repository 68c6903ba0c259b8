//! Key and value encodings of the on-disk format (see `docs/storage.md`).
//!
//! Every key starts with its partition as a big-endian `u32`, so everything
//! in one partition is one contiguous range: migrating a partition is a range
//! scan plus a bulk load. Integers in keys are big-endian so byte order is
//! numeric order. Values start with a format version byte; a value that does
//! not decode is corruption and is reported as such, never guessed at.

use crate::{ExecutionMeta, ExecutionStatus, StoreError, StoredEvent};
use forkless_types::{ExecutionId, PartitionId};

pub const VALUE_VERSION: u8 = 1;

/// `partition | execution` (12 bytes): the executions keyspace.
pub fn execution_key(p: PartitionId, id: ExecutionId) -> [u8; 12] {
    let mut k = [0u8; 12];
    k[..4].copy_from_slice(&p.get().to_be_bytes());
    k[4..].copy_from_slice(&(id.get() as u64).to_be_bytes());
    k
}

/// `partition | execution | seq` (20 bytes): the events keyspace.
pub fn event_key(p: PartitionId, id: ExecutionId, seq: u64) -> [u8; 20] {
    let mut k = [0u8; 20];
    k[..12].copy_from_slice(&execution_key(p, id));
    k[12..].copy_from_slice(&seq.to_be_bytes());
    k
}

/// `partition | execution | idempotency key`: the event idempotency index.
pub fn event_idem_key(p: PartitionId, id: ExecutionId, idem: &str) -> Vec<u8> {
    let mut k = Vec::with_capacity(12 + idem.len());
    k.extend_from_slice(&execution_key(p, id));
    k.extend_from_slice(idem.as_bytes());
    k
}

/// `partition | len u16 | routing key`: prefix of the routing-key index.
pub fn routing_key_prefix(p: PartitionId, key: &str) -> Vec<u8> {
    let mut k = Vec::with_capacity(6 + key.len() + 8);
    k.extend_from_slice(&p.get().to_be_bytes());
    k.extend_from_slice(&(key.len() as u16).to_be_bytes());
    k.extend_from_slice(key.as_bytes());
    k
}

/// `partition | len u16 | routing key | execution`: the routing-key index.
pub fn routing_key_entry(p: PartitionId, key: &str, id: ExecutionId) -> Vec<u8> {
    let mut k = routing_key_prefix(p, key);
    k.extend_from_slice(&(id.get() as u64).to_be_bytes());
    k
}

/// `partition | len u16 | routing key (may be empty) | idempotency key`:
/// the start idempotency index, in the steering key's partition.
pub fn start_idem_key(p: PartitionId, routing_key: Option<&str>, idem: &str) -> Vec<u8> {
    let mut k = routing_key_prefix(p, routing_key.unwrap_or(""));
    k.extend_from_slice(idem.as_bytes());
    k
}

pub fn u64_value(v: u64) -> [u8; 8] {
    v.to_be_bytes()
}

pub fn decode_u64(bytes: &[u8], what: &str) -> Result<u64, StoreError> {
    let arr: [u8; 8] = bytes.try_into().map_err(|_| {
        StoreError::Corrupt(format!("{what}: expected 8 bytes, found {}", bytes.len()))
    })?;
    Ok(u64::from_be_bytes(arr))
}

pub fn decode_execution_id(bytes: &[u8], what: &str) -> Result<ExecutionId, StoreError> {
    let raw = decode_u64(bytes, what)?;
    ExecutionId::new(raw as i64).map_err(|e| StoreError::Corrupt(format!("{what}: {e}")))
}

/// Reads big-endian fields off the front of a byte string; running short
/// is corruption, named by `what`. Used for the values here and for the
/// log's records and the events index's entries.
pub(crate) struct Reader<'a> {
    buf: &'a [u8],
    what: &'static str,
}

impl<'a> Reader<'a> {
    pub(crate) fn new(buf: &'a [u8], what: &'static str) -> Reader<'a> {
        Reader { buf, what }
    }

    /// Bytes not read yet.
    pub(crate) fn remaining(&self) -> usize {
        self.buf.len()
    }

    /// A reader past the value's version byte, which must be ours.
    fn versioned(buf: &'a [u8], what: &'static str) -> Result<Reader<'a>, StoreError> {
        let mut r = Reader { buf, what };
        let version = r.u8()?;
        if version != VALUE_VERSION {
            return Err(StoreError::Corrupt(format!(
                "{what}: unknown version {version}"
            )));
        }
        Ok(r)
    }

    pub(crate) fn take(&mut self, n: usize) -> Result<&'a [u8], StoreError> {
        if self.buf.len() < n {
            return Err(StoreError::Corrupt(format!(
                "{}: truncated value",
                self.what
            )));
        }
        let (a, b) = self.buf.split_at(n);
        self.buf = b;
        Ok(a)
    }
    pub(crate) fn u8(&mut self) -> Result<u8, StoreError> {
        Ok(self.take(1)?[0])
    }
    pub(crate) fn u32(&mut self) -> Result<u32, StoreError> {
        let b = self.take(4)?;
        Ok(u32::from_be_bytes([b[0], b[1], b[2], b[3]]))
    }
    pub(crate) fn u64(&mut self) -> Result<u64, StoreError> {
        decode_u64(self.take(8)?, self.what)
    }
    fn string(&mut self) -> Result<String, StoreError> {
        let len = u16::from_be_bytes([self.u8()?, self.u8()?]) as usize;
        let bytes = self.take(len)?;
        String::from_utf8(bytes.to_vec())
            .map_err(|_| StoreError::Corrupt(format!("{}: bad utf-8", self.what)))
    }
    fn opt_string(&mut self) -> Result<Option<String>, StoreError> {
        match self.u8()? {
            0 => Ok(None),
            1 => Ok(Some(self.string()?)),
            t => Err(StoreError::Corrupt(format!(
                "{}: bad option tag {t}",
                self.what
            ))),
        }
    }
}

fn put_string(out: &mut Vec<u8>, s: &str) {
    debug_assert!(s.len() <= u16::MAX as usize);
    out.extend_from_slice(&(s.len() as u16).to_be_bytes());
    out.extend_from_slice(s.as_bytes());
}

fn put_opt_string(out: &mut Vec<u8>, s: Option<&str>) {
    match s {
        None => out.push(0),
        Some(s) => {
            out.push(1);
            put_string(out, s);
        }
    }
}

/// The metadata record: what does not change with every append. `last_seq`
/// and `updated_at_ms` are not stored here; they are the last event's
/// (from the events index), so an append writes its events and nothing else.
pub fn encode_meta(m: &ExecutionMeta) -> Vec<u8> {
    let mut out = Vec::with_capacity(32 + m.workflow.len());
    out.push(VALUE_VERSION);
    out.push(m.status.code());
    out.extend_from_slice(&m.created_at_ms.to_be_bytes());
    put_string(&mut out, &m.workflow);
    put_opt_string(&mut out, m.routing_key.as_deref());
    out
}

/// Decodes a metadata record; `last` is the execution's last event
/// `(seq, recorded_at_ms)`.
pub fn decode_meta(
    id: ExecutionId,
    bytes: &[u8],
    last: (u64, u64),
) -> Result<ExecutionMeta, StoreError> {
    let mut r = Reader::versioned(bytes, "execution metadata")?;
    let status = ExecutionStatus::from_code(r.u8()?)
        .ok_or_else(|| StoreError::Corrupt("execution metadata: bad status".into()))?;
    Ok(ExecutionMeta {
        id,
        status,
        created_at_ms: r.u64()?,
        workflow: r.string()?,
        routing_key: r.opt_string()?,
        last_seq: last.0,
        updated_at_ms: last.1,
    })
}

/// The `recorded_at_ms` of an event value.
pub fn recorded_at(value: &[u8]) -> Result<u64, StoreError> {
    Reader::versioned(value, "event")?.u64()
}

/// An event's value, written into `out` (cleared first) so that the writer
/// reuses one buffer for every event it encodes.
pub fn encode_event_into(
    out: &mut Vec<u8>,
    recorded_at_ms: u64,
    event_type: &str,
    idem: Option<&str>,
    payload: &[u8],
) {
    out.clear();
    out.push(VALUE_VERSION);
    out.extend_from_slice(&recorded_at_ms.to_be_bytes());
    put_string(out, event_type);
    put_opt_string(out, idem);
    out.extend_from_slice(payload);
}

pub fn decode_event(seq: u64, bytes: &[u8]) -> Result<StoredEvent, StoreError> {
    let mut r = Reader::versioned(bytes, "event")?;
    let recorded_at_ms = r.u64()?;
    let event_type = r.string()?;
    let idempotency_key = r.opt_string()?;
    Ok(StoredEvent {
        seq,
        event_type,
        idempotency_key,
        recorded_at_ms,
        payload: r.buf.to_vec(),
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn keys_sort_by_partition_then_execution_then_seq() {
        let p1 = PartitionId::new(1).unwrap();
        let p2 = PartitionId::new(2).unwrap();
        let a = ExecutionId::new(5).unwrap();
        let b = ExecutionId::new(300).unwrap();
        let mut keys = vec![
            event_key(p2, a, 1).to_vec(),
            event_key(p1, b, 1).to_vec(),
            event_key(p1, a, 256).to_vec(),
            event_key(p1, a, 2).to_vec(),
        ];
        keys.sort();
        assert_eq!(
            keys,
            vec![
                event_key(p1, a, 2).to_vec(),
                event_key(p1, a, 256).to_vec(),
                event_key(p1, b, 1).to_vec(),
                event_key(p2, a, 1).to_vec(),
            ]
        );
    }

    #[test]
    fn values_round_trip_and_garbage_is_corruption() {
        let id = ExecutionId::new(77).unwrap();
        let m = ExecutionMeta {
            id,
            status: ExecutionStatus::Failed,
            last_seq: 9,
            created_at_ms: 1,
            updated_at_ms: 2,
            workflow: "wf".into(),
            routing_key: Some("k/é".into()),
        };
        assert_eq!(decode_meta(id, &encode_meta(&m), (9, 2)).unwrap(), m);
        let mut e = Vec::new();
        encode_event_into(&mut e, 5, "t", Some("i"), b"{\"a\":1}");
        let d = decode_event(3, &e).unwrap();
        assert_eq!(
            (
                d.seq,
                d.event_type.as_str(),
                d.idempotency_key.as_deref(),
                d.payload.as_slice()
            ),
            (3, "t", Some("i"), &b"{\"a\":1}"[..])
        );
        for cut in 0..encode_meta(&m).len() - 1 {
            assert!(decode_meta(id, &encode_meta(&m)[..cut], (9, 2)).is_err());
        }
        assert!(decode_event(1, &[9, 9, 9]).is_err());
    }
}
