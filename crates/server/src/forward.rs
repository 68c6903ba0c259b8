//! One-hop forwarding to a shard's owner over a pooled HTTP/1.1 client.
//!
//! **Invariant:** a failed forward is never a local write. Every failure
//! (refused, timed out, an answer that is not the owner's own, a body that
//! does not decode) becomes `503 owner_unavailable`, and the caller returns
//! it without touching its own store.

use crate::error::{ApiError, Executed};
use crate::{HOPS_HEADER, NODE_HEADER, PEER_TOKEN_HEADER};
use axum::response::{IntoResponse, Response};
use bytes::Bytes;
use forkless_routing::OwnerHint;
use http::{HeaderValue, Method, Request};
use http_body_util::{BodyExt, Full};
use hyper_util::client::legacy::connect::HttpConnector;
use hyper_util::client::legacy::Client;
use hyper_util::rt::TokioExecutor;
use std::time::Duration;

/// Largest owner answer a forwarder relays (a full page of events plus room).
const FORWARD_RESPONSE_BYTES_MAX: usize = 64 * 1024 * 1024;

pub struct Forwarder {
    client: Client<HttpConnector, Full<Bytes>>,
    secret: HeaderValue,
}

pub struct ForwardRequest<'a> {
    pub method: Method,
    pub path_and_query: &'a str,
    pub body: Bytes,
    pub hops: u8,
    pub timeout: Duration,
    pub shard: u32,
}

impl Forwarder {
    pub fn new(connect_timeout: Duration, secret: &str) -> Forwarder {
        let mut http = HttpConnector::new();
        http.set_connect_timeout(Some(connect_timeout));
        http.set_nodelay(true);
        let client = Client::builder(TokioExecutor::new())
            .pool_idle_timeout(Duration::from_secs(30))
            .pool_max_idle_per_host(256)
            .build(http);
        let secret = HeaderValue::from_str(secret).unwrap_or_else(|_| HeaderValue::from_static(""));
        Forwarder { client, secret }
    }

    /// Sends the request to the owner's peer address and relays its own
    /// answer verbatim, or fails closed.
    pub async fn forward(
        &self,
        owner: &OwnerHint,
        req: ForwardRequest<'_>,
    ) -> Result<Response, ApiError> {
        let fail = |executed, reason: String| ApiError::OwnerUnavailable {
            shard: req.shard,
            executed,
            reason,
            hint: Some(owner.clone()),
        };
        let uri = format!("http://{}{}", owner.peer_addr, req.path_and_query);
        let request = Request::builder()
            .method(req.method.clone())
            .uri(&uri)
            .header(http::header::CONTENT_TYPE, "application/json")
            .header(HOPS_HEADER, req.hops.to_string())
            .header(PEER_TOKEN_HEADER, self.secret.clone())
            .body(Full::new(req.body.clone()))
            .map_err(|e| fail(Executed::No, format!("bad forward request: {e}")))?;

        let answer = tokio::time::timeout(req.timeout, async {
            let resp = self.client.request(request).await.map_err(|e| {
                // A connect failure means the request never left this node.
                if e.is_connect() {
                    fail(
                        Executed::No,
                        format!(
                            "connecting to node {} at {}: {e}",
                            owner.node, owner.peer_addr
                        ),
                    )
                } else {
                    fail(
                        Executed::Unknown,
                        format!("node {} at {}: {e}", owner.node, owner.peer_addr),
                    )
                }
            })?;
            let (parts, body) = resp.into_parts();
            let body = http_body_util::Limited::new(body, FORWARD_RESPONSE_BYTES_MAX)
                .collect()
                .await
                .map_err(|e| {
                    fail(
                        Executed::Unknown,
                        format!("reading the answer of node {}: {e}", owner.node),
                    )
                })?
                .to_bytes();
            Ok::<_, ApiError>((parts, body))
        })
        .await;
        let (parts, body) = match answer {
            Ok(r) => r?,
            Err(_) => {
                return Err(fail(
                    Executed::Unknown,
                    format!(
                        "node {} did not answer within {} ms",
                        owner.node,
                        req.timeout.as_millis()
                    ),
                ))
            }
        };
        // Only the owner's own answer is relayed: it says who it is, and its
        // body is JSON. Anything else (a proxy's error page, a truncated or
        // garbled body) is not an answer we can vouch for.
        let from_owner = parts
            .headers
            .get(NODE_HEADER)
            .and_then(|v| v.to_str().ok())
            .is_some_and(|v| v == owner.node.to_string());
        if !from_owner {
            return Err(fail(
                Executed::Unknown,
                format!(
                    "answer ({}) did not come from node {}",
                    parts.status, owner.node
                ),
            ));
        }
        if serde_json::from_slice::<serde::de::IgnoredAny>(&body).is_err() {
            return Err(fail(
                Executed::Unknown,
                format!(
                    "node {} answered {} with a body that is not JSON",
                    owner.node, parts.status
                ),
            ));
        }
        let mut resp = (parts.status, body).into_response();
        for (name, value) in parts.headers.iter() {
            let n = name.as_str();
            if n.starts_with("x-forkless-") || n == "content-type" || n == "retry-after" {
                resp.headers_mut().insert(name.clone(), value.clone());
            }
        }
        Ok(resp)
    }

    /// A GET to a peer's internal endpoint, for probes.
    pub async fn probe(
        &self,
        peer_addr: &str,
        path: &str,
        timeout: Duration,
    ) -> Result<Bytes, String> {
        let request = Request::builder()
            .method(Method::GET)
            .uri(format!("http://{peer_addr}{path}"))
            .header(PEER_TOKEN_HEADER, self.secret.clone())
            .body(Full::new(Bytes::new()))
            .map_err(|e| e.to_string())?;
        let r = tokio::time::timeout(timeout, async {
            let resp = self
                .client
                .request(request)
                .await
                .map_err(|e| e.to_string())?;
            if !resp.status().is_success() {
                return Err(format!("status {}", resp.status()));
            }
            let body = http_body_util::Limited::new(resp.into_body(), 1024 * 1024)
                .collect()
                .await
                .map_err(|e| e.to_string())?
                .to_bytes();
            Ok(body)
        })
        .await;
        r.unwrap_or_else(|_| Err(format!("no answer within {} ms", timeout.as_millis())))
    }
}
