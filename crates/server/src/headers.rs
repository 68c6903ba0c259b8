//! Header helpers shared by the API, the connection loop, the forwarder and
//! the peer endpoints: the route headers' names, the hop count, the peer
//! token check, and `Content-Length`. A leaf: it knows no other module of
//! the crate.

use crate::PEER_TOKEN_HEADER;
use axum::http::{HeaderMap, HeaderValue};
use subtle::ConstantTimeEq;

/// The route headers on every routed answer, named once (the forwarder
/// relays them by these names).
pub(crate) mod route_header {
    use axum::http::HeaderName;
    pub const PARTITION: HeaderName = HeaderName::from_static("x-forkless-partition");
    pub const SHARD: HeaderName = HeaderName::from_static("x-forkless-shard");
    pub const OWNER: HeaderName = HeaderName::from_static("x-forkless-owner");
    pub const EPOCH: HeaderName = HeaderName::from_static("x-forkless-epoch");
    pub const MAP_VERSION: HeaderName = HeaderName::from_static("x-forkless-map-version");
    pub const HOPS: HeaderName = HeaderName::from_static(crate::HOPS_HEADER);
    /// `stale` on a read answered by a replica as it stood
    /// (`consistency=stale`), not confirmed with the shard's group.
    pub const READ: HeaderName = HeaderName::from_static("x-forkless-read");
    /// The last Raft entry the replica that answered a stale read had
    /// applied.
    pub const APPLIED_INDEX: HeaderName = HeaderName::from_static("x-forkless-applied-index");
}

/// A hop header's value as a count, if it is one (the connection loop's
/// hot path and `api::hops_taken` read it the same way).
pub(crate) fn hop_count(v: &[u8]) -> Option<u8> {
    std::str::from_utf8(v).ok()?.parse().ok()
}

/// Whether `headers` carry the cluster's secret as the peer token.
pub(crate) fn peer_authenticated(secret: &str, headers: &HeaderMap) -> bool {
    peer_token_valid(
        secret,
        headers.get(PEER_TOKEN_HEADER).map(HeaderValue::as_bytes),
    )
}

/// Whether `token` (the peer token header's value, if any) is the
/// cluster's secret (compared in constant time; a node with no secret
/// has no peers and trusts none).
pub(crate) fn peer_token_valid(secret: &str, token: Option<&[u8]>) -> bool {
    !secret.is_empty() && token.is_some_and(|t| bool::from(t.ct_eq(secret.as_bytes())))
}

/// A `Content-Length` value: decimal digits only (requests here, and the
/// answers a forwarder reads).
pub(crate) fn content_length(v: &[u8]) -> Option<usize> {
    if v.is_empty() || v.len() > 19 || !v.iter().all(u8::is_ascii_digit) {
        return None;
    }
    std::str::from_utf8(v).ok()?.parse().ok()
}
