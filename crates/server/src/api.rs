//! The client API handlers and the routing step every execution-scoped
//! request goes through (`dispatch`).

use crate::error::{from_store, ApiError, Executed};
use crate::forward::ForwardRequest;
use crate::headers::{self, route_header};
use crate::metrics::outcome;
use crate::wire::{self, check_name, parse, NAME_BYTES_MAX, ROUTING_KEY_BYTES_MAX};
use crate::{App, HOPS_HEADER, NODE_HEADER};
use axum::body::Body;
use axum::extract::rejection::PathRejection;
use axum::extract::{Path, Query, Request, State};
use axum::http::{HeaderMap, HeaderName, HeaderValue, Method, StatusCode, Uri};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::{Json, Router};
use bytes::Bytes;
use forkless_routing::{
    decide, Decision, Directory, Facts, FailClosed, Owner, OwnerHint, PeerState,
};
use forkless_store::{
    AppendRequest, ExecutionMeta, Fit, NewEvent, ShardStore, StartRequest, StoreError,
};
use forkless_types::{Epoch, ExecutionId, PartitionId, ShardId};
use serde::Serialize;
use serde_json::json;
use serde_json::value::RawValue;
use std::collections::HashMap;
use std::future::Future;
use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::Duration;

type AppState = State<Arc<App>>;

/// The API as one service: the routes, with every answer stamped and every
/// request counted while in progress.
///
/// An append to `/api/executions/{decimal id}/events`, the hottest request
/// by far, goes straight to its handler; the router would answer it the
/// same way after matching the path among every route, which costs about
/// as much as the handler's own work before the store. Any other shape of
/// that path (percent-encoded, not a decimal) goes through the router, which
/// names what is wrong with it.
pub fn service(
    app: Arc<App>,
) -> impl tower::Service<
    Request,
    Response = Response,
    Error = std::convert::Infallible,
    Future = impl Send + 'static,
> + Clone
       + Send
       + 'static {
    use tower::ServiceExt;
    let router = router(app.clone());
    tower::service_fn(move |req: Request| {
        let app = app.clone();
        let router = router.clone();
        async move {
            let guard = InProgress::enter(&app.in_progress);
            let resp = match hot_append_id(&req) {
                Some(raw) => append_with_id(&app, req, raw)
                    .await
                    .unwrap_or_else(|e| e.into_response()),
                None => match router.oneshot(req).await {
                    Ok(r) => r,
                    Err(never) => match never {},
                },
            };
            drop(guard);
            Ok(stamp(&app, resp))
        }
    })
}

/// The id of `POST /api/executions/{id}/events` when it is plain digits.
fn hot_append_id(req: &Request) -> Option<Result<ExecutionId, ApiError>> {
    if req.method() != Method::POST {
        return None;
    }
    hot_append_digits(req.uri().path()).map(parse_id)
}

/// The `{id}` of an `/api/executions/{id}/events` path when it is plain
/// digits (any other shape is the router's to answer, which names what is
/// wrong with it).
pub(crate) fn hot_append_digits(path: &str) -> Option<&str> {
    let raw = path
        .strip_prefix("/api/executions/")?
        .strip_suffix("/events")?;
    (!raw.is_empty() && raw.bytes().all(|b| b.is_ascii_digit())).then_some(raw)
}

/// Counts one request in [`App::in_progress`] until its answer is ready or
/// it is dropped (the client went away).
struct InProgress(Arc<std::sync::atomic::AtomicUsize>);

impl InProgress {
    fn enter(n: &Arc<std::sync::atomic::AtomicUsize>) -> Self {
        n.fetch_add(1, std::sync::atomic::Ordering::AcqRel);
        InProgress(n.clone())
    }
}

impl Drop for InProgress {
    fn drop(&mut self) {
        self.0.fetch_sub(1, std::sync::atomic::Ordering::AcqRel);
    }
}

fn router(app: Arc<App>) -> Router {
    Router::new()
        .route("/api/executions", post(start))
        .route("/api/executions/{id}", get(get_execution))
        .route("/api/executions/{id}/events", post(append).get(read_events))
        .route("/api/events", post(append_by_body_id))
        .route("/api/executions/{id}/signals", post(signal))
        .route("/api/executions/{id}/cancel", post(cancel))
        .route("/api/keys/{*key}", get(by_key))
        .route("/api/cluster", get(cluster))
        .route("/api/cluster/placement", get(cluster_placement))
        .route("/api/cluster/remove-node", post(remove_node))
        .route("/api/cluster/reload", post(cluster_reload))
        .route("/api/cluster/drain", post(cluster_drain))
        .route("/api/cluster/undrain", post(cluster_undrain))
        .route("/api/shards/{shard}/replace", post(replace_replica))
        .route("/api/shards/{shard}/trust", post(trust_replica))
        .route("/healthz", get(|| async { Json(json!({"status": "ok"})) }))
        .route("/readyz", get(readyz))
        .route("/metrics", get(metrics))
        .route("/internal/v1/status", get(crate::peer::status))
        .fallback(|uri: Uri| async move {
            (StatusCode::NOT_FOUND, Json(json!({"error": "not_found", "message": format!("no route for {}", uri.path())})))
        })
        .method_not_allowed_fallback(|method: Method, uri: Uri| async move {
            (
                StatusCode::METHOD_NOT_ALLOWED,
                Json(json!({"error": "method_not_allowed", "message": format!("{method} is not allowed on {}", uri.path())})),
            )
        })
        .with_state(app)
}

/// Every answer says which node produced it, and is counted by status.
pub(crate) fn stamp(app: &App, mut resp: Response) -> Response {
    resp.headers_mut()
        .entry(NODE_HEADER)
        .or_insert_with(|| app.node_header.clone());
    app.metrics.response(resp.status().as_u16());
    resp
}

// ---------------------------------------------------------------------------
// Request plumbing

/// Reads the body up to the configured limit: over it is 413, nothing read.
/// A body that does not arrive in full within `request_read_timeout_ms` is
/// 408 (the connection loop reads a body before the request gets here; this
/// bounds a body hyper streams, e.g. a chunked one), and one that breaks off
/// is 400, never taken for an oversize one.
async fn read_body(app: &App, body: Body) -> Result<Bytes, ApiError> {
    let limit = app.cfg.limits.request_body_bytes_max;
    let ms = app.cfg.limits.request_read_timeout_ms;
    let read = axum::body::to_bytes(body, limit);
    match tokio::time::timeout(std::time::Duration::from_millis(ms), read).await {
        Ok(Ok(bytes)) => Ok(bytes),
        Ok(Err(e)) if over_limit(&e) => Err(ApiError::TooLarge {
            what: "request body".into(),
            size: limit + 1,
            limit,
        }),
        Ok(Err(e)) if caused_by::<crate::budget::OverBodyBudget>(&e) => Err(
            crate::budget::body_budget_refusal(app.cfg.limits.body_bytes_in_flight_max),
        ),
        Ok(Err(e)) => Err(ApiError::invalid(
            "body",
            format!("the request body could not be read: {e}"),
        )),
        Err(_) => Err(ApiError::RequestTimeout(ms)),
    }
}

/// Whether reading a body failed because it is over the limit.
fn over_limit(e: &axum::Error) -> bool {
    caused_by::<http_body_util::LengthLimitError>(e)
}

/// Whether `e`, or an error it came of, is a `T`.
fn caused_by<T: std::error::Error + 'static>(e: &axum::Error) -> bool {
    let mut cause: Option<&(dyn std::error::Error + 'static)> = Some(e);
    while let Some(c) = cause {
        if c.is::<T>() {
            return true;
        }
        cause = c.source();
    }
    false
}

/// The hops a request has taken. Only a peer, proven by the cluster
/// secret, may say a request was forwarded; a client that sets the header
/// is refused, never trusted, so it cannot bypass routing.
fn hops_taken(app: &App, headers: &HeaderMap) -> Result<u8, ApiError> {
    let Some(h) = headers.get(HOPS_HEADER) else {
        return Ok(0);
    };
    if !headers::peer_authenticated(&app.secret, headers) {
        app.metrics.outcome(outcome::REFUSED_HOP_HEADER);
        tracing::warn!("refused a request carrying {HOPS_HEADER} without valid peer credentials");
        return Err(ApiError::Forbidden(format!(
            "{HOPS_HEADER} may only be set by cluster peers, and this request carries no valid peer credentials"
        )));
    }
    headers::hop_count(h.as_bytes())
        .ok_or_else(|| ApiError::invalid(HOPS_HEADER, "must be a small non-negative integer"))
}

/// A path segment, or a JSON 400 naming it (axum's own rejection is plain
/// text, e.g. for invalid UTF-8 after percent-decoding).
fn path_param(p: Result<Path<String>, PathRejection>, field: &str) -> Result<String, ApiError> {
    p.map(|Path(v)| v)
        .map_err(|e| ApiError::invalid(field, e.body_text()))
}

/// The `{id}` path segment as an execution id, or a 400 naming
/// `execution_id`.
fn path_execution_id(p: Result<Path<String>, PathRejection>) -> Result<ExecutionId, ApiError> {
    parse_id(&path_param(p, "execution_id")?)
}

pub(crate) fn parse_id(raw: &str) -> Result<ExecutionId, ApiError> {
    raw.parse::<ExecutionId>()
        .map_err(|e| ApiError::invalid("execution_id", e.to_string()))
}

/// Where a request goes, and who it was routed by.
struct Route {
    partition: Option<PartitionId>,
    shard: ShardId,
    hops_taken: u8,
    /// Extra time a forward may take (long-polls).
    extra_wait: Duration,
    /// A read that may be answered by any replica of the shard this node
    /// holds, as it stands (`consistency=stale`).
    stale_ok: bool,
    /// A page of events: the room this node's listener has for its answer,
    /// told to the owner it is forwarded to (`ANSWER_ROOM_HEADER`), which
    /// cuts the page short to it as to its own.
    answer_room: Option<usize>,
}

/// The route headers' values for one answer: who owns the request's shard
/// as this node sees it, and how the request got here.
pub(crate) struct RouteHeaders {
    partition: Option<u64>,
    shard: u64,
    owner: Option<u64>,
    epoch: Option<u64>,
    map_version: u64,
    hops: u64,
    /// Set on a stale read answered here: the replica's applied index.
    stale_applied: Option<u64>,
}

impl RouteHeaders {
    fn new(app: &App, route: &Route, owner: &Owner) -> Self {
        let (node, epoch) = match owner {
            Owner::Local { epoch } => (Some(app.cfg.node_id), Some(*epoch)),
            Owner::Remote(h) => (Some(h.node), Some(h.epoch)),
            Owner::Unknown { hint } => (
                hint.as_ref().map(|h| h.node),
                hint.as_ref().map(|h| h.epoch),
            ),
        };
        RouteHeaders {
            partition: route.partition.map(|p| p.get().into()),
            shard: route.shard.get().into(),
            owner: node.map(|n| n.get().into()),
            epoch: epoch.map(|e| e.get()),
            map_version: app.dir.map_version(),
            hops: route.hops_taken.into(),
            stale_applied: None,
        }
    }

    /// Puts the headers on `resp`.
    fn apply(&self, resp: &mut Response) {
        let h = resp.headers_mut();
        h.reserve(7);
        for (name, v) in self.pairs() {
            h.insert(name, number_header(v));
        }
        if let Some(applied) = self.stale_applied {
            h.insert(route_header::READ, HeaderValue::from_static("stale"));
            h.insert(route_header::APPLIED_INDEX, number_header(applied));
        }
    }

    /// Each header present, with its value.
    pub(crate) fn pairs(&self) -> impl Iterator<Item = (HeaderName, u64)> {
        [
            (route_header::PARTITION, self.partition),
            (route_header::SHARD, Some(self.shard)),
            (route_header::OWNER, self.owner),
            (route_header::EPOCH, self.epoch),
            (route_header::MAP_VERSION, Some(self.map_version)),
            (route_header::HOPS, Some(self.hops)),
        ]
        .into_iter()
        .filter_map(|(name, v)| Some((name, v?)))
    }
}

/// `n` as a header value. The route headers carry small numbers (a
/// partition is under 4096, and so are shards, hops, node ids and epochs
/// in practice): those come from one table made once, so that a request
/// does not allocate six header values.
fn number_header(n: u64) -> HeaderValue {
    const SMALL: usize = forkless_types::PARTITION_COUNT as usize;
    static TABLE: std::sync::OnceLock<Vec<&'static str>> = std::sync::OnceLock::new();
    // Made once per process and kept for its life (about 20 KiB).
    let table = TABLE.get_or_init(|| {
        (0..SMALL)
            .map(|i| -> &'static str { i.to_string().leak() })
            .collect()
    });
    match usize::try_from(n).ok().and_then(|i| table.get(i)) {
        Some(s) => HeaderValue::from_static(s),
        None => HeaderValue::from(n),
    }
}

/// This node's routing decision now for a request on `shard` that has taken
/// `hops` hops, and the owner it was made from.
fn decision(app: &App, shard: ShardId, hops: u8) -> (Owner, Decision) {
    let mut owner = app.dir.owner_of(shard);
    // A replicated shard this node holds a replica of is its own exactly
    // while its group says this node leads: the group knows sooner than
    // the directory, which follows it. A group that knows no leader, or
    // one at an older term than the directory learned from the peers (a
    // replica cut off, or one a membership change removed, which hears
    // from its group no more), leaves the directory's owner standing: the
    // higher term wins.
    let replicated = app
        .cfg
        .cluster
        .as_ref()
        .is_some_and(|c| c.replication.is_some());
    let directory_term = app.dir.assignment(shard).map(|a| a.epoch);
    if let Some(l) = replicated
        .then(|| app.store.shard(shard).and_then(|st| st.leadership()))
        .flatten()
        .filter(|l| l.leader.is_some() && directory_term.is_none_or(|t| Epoch(l.term) >= t))
    {
        owner = match l.leader {
            Some(n) if n == l.me => Owner::Local {
                epoch: Epoch(l.term),
            },
            Some(n) => leader_named(app, n, l.term),
            None => Owner::Unknown { hint: None },
        };
    }
    // A request that came forwarded is not run here while this node's
    // replica knows no leader (its writer would wait for an election, and
    // its sender's forward timeout runs): the map's word that this node
    // owns the shard is then only a stand-in, and the request goes back
    // (`route_request` first waits a moment for a leader:
    // `after_an_election`).
    if replicated
        && hops > 0
        && matches!(owner, Owner::Local { .. })
        && app
            .store
            .shard(shard)
            .and_then(|st| st.leadership())
            .is_some_and(|l| l.leader.is_none())
    {
        owner = Owner::Unknown { hint: None };
    }
    // Only an owned shard's copy matters to the decision, and only an
    // unreplicated one's: a replicated shard's fence is its group's term,
    // checked at apply, and its store keeps the epoch it opened at (which
    // a new cluster's map, before any leader is learned, names as older:
    // every request of its first moments was refused 421 "fenced").
    let local_fence = match owner {
        Owner::Local { .. } if !replicated => app.store.shard(shard).map(|st| st.epoch()),
        _ => None,
    };
    let d = decide(&Facts {
        routing_active: app.dir.routing_active(),
        hops_taken: hops,
        owner: owner.clone(),
        local_fence,
    });
    (owner, d)
}

/// The routing step: decide, then perform. `local` runs only when this node
/// owns the shard at the current epoch; every other answer leaves the local
/// store untouched.
async fn dispatch<F, Fut>(
    app: &Arc<App>,
    method: Method,
    uri: &Uri,
    body: Bytes,
    route: Route,
    local: F,
) -> Response
where
    F: FnOnce(Epoch, Arc<ShardStore>) -> Fut,
    Fut: Future<Output = Result<Response, ApiError>>,
{
    let path_and_query = uri.path_and_query().map(|p| p.as_str()).unwrap_or("/");
    match route_request(app, method, path_and_query, body, route, local).await {
        Routed::Local(mut resp, headers) => {
            headers.apply(&mut resp);
            resp
        }
        Routed::Answer(resp) => resp,
    }
}

/// What the routing step came to.
enum Routed<T> {
    /// This node owns the shard and `local` succeeded: its value, and the
    /// route headers its answer is to carry.
    Local(T, RouteHeaders),
    /// Any other answer, with its route headers (a forwarded answer with
    /// the owner's own).
    Answer(Response),
}

/// [`dispatch`], with the local step's value handed back as it is rather
/// than as a response (the connection loop writes a hot append's answer
/// itself).
async fn route_request<T, F, Fut>(
    app: &Arc<App>,
    method: Method,
    path_and_query: &str,
    body: Bytes,
    route: Route,
    local: F,
) -> Routed<T>
where
    F: FnOnce(Epoch, Arc<ShardStore>) -> Fut,
    Fut: Future<Output = Result<T, ApiError>>,
{
    // A request that came forwarded waits here for its shard's group at
    // most this long in all (its sender's forward timeout runs).
    let wait_until = tokio::time::Instant::now() + forwarded_wait(app);
    // A leader found unreachable by this decision is taken for back once
    // it answers a probe asked after it (`route_again`).
    let decided_at = std::time::Instant::now();
    let (mut owner, mut decided) = decision(app, route.shard, route.hops_taken);
    // (A stale read is answered by a replica that knows no leader too.)
    let stale_read = route.stale_ok && method == Method::GET;
    if route.hops_taken > 0 && !stale_read && !matches!(owner, Owner::Remote(_)) {
        if let Some(again) = after_an_election(app, route.shard, route.hops_taken, wait_until).await
        {
            (owner, decided) = again;
        }
    }
    let partition = route.partition.map(|p| p.get());
    let shard = route.shard.get();
    if route.stale_ok && method == Method::GET {
        if let Some((st, applied)) = stale_replica(app, route.shard) {
            app.metrics.outcome(outcome::STALE_LOCALLY);
            let mut headers = RouteHeaders::new(app, &route, &owner);
            headers.stale_applied = Some(applied);
            return match local(st.epoch(), st).await {
                Ok(v) => Routed::Local(v, headers),
                Err(e) => {
                    let mut resp = e.into_response();
                    headers.apply(&mut resp);
                    Routed::Answer(resp)
                }
            };
        }
    }
    let is_read = method == Method::GET || method == Method::HEAD;
    // Taken when it runs: a read refused at its confirmation (before it
    // ran) may run once more, below.
    let mut local = Some(local);
    let (owner, mut resp) = match decided {
        Decision::Local { epoch } => {
            app.metrics.outcome(outcome::LOCAL);
            let mut tried = None;
            let refused = match app.store.shard(route.shard) {
                Some(st) => {
                    tried = Some(st.clone());
                    // A read of a replicated shard is confirmed with its
                    // group first (read index), so it sees every write
                    // acknowledged before it began. A replicated shard's
                    // fence is its group's term, checked at apply; its
                    // store keeps the epoch it opened at.
                    let (epoch, confirm) = if st.is_replicated() {
                        (st.epoch(), is_read)
                    } else {
                        (epoch, false)
                    };
                    match run_here(app, st, epoch, confirm, &mut local, partition).await {
                        Ok(v) => return Routed::Local(v, RouteHeaders::new(app, &route, &owner)),
                        Err(e) => e,
                    }
                }
                None => from_store(
                    match app.store.failure(route.shard) {
                        Some(reason) => StoreError::ShardFailed {
                            shard: route.shard,
                            reason,
                        },
                        None => StoreError::ShardNotHosted(route.shard),
                    },
                    shard,
                    partition,
                    app.dir.map_version(),
                ),
            };
            match (refused, tried) {
                // The group's leadership moved, or is moving, after this
                // node decided it leads (a transfer, an election): nothing
                // was executed, so once the group's leadership settles the
                // request is routed again, as if it had been known when
                // the request came in.
                (ApiError::NotLeader { leader, term, .. }, Some(st)) => {
                    app.metrics.outcome(outcome::REROUTED);
                    let within = settle_within(app);
                    let (owner, d) = if route.hops_taken == 0 {
                        let settled = st.leadership_settled(term, within).await;
                        tracing::info!(
                            shard,
                            refused_at_term = term,
                            named = ?leader,
                            now = ?settled.map(|l| (l.leader, l.term)),
                            "this node's leadership of the shard moved under the request; routing it again"
                        );
                        decision(app, route.shard, route.hops_taken)
                    } else {
                        // It came forwarded (the hop is taken): the
                        // leader goes back in a 421, which its sender
                        // follows once if it names a later term. So it
                        // waits a moment (within half the sender's
                        // forward timeout) for the group to name a
                        // leader other than this node: in a handover
                        // (this node stopping, or its balancer moving the
                        // shard) the replica named is elected within a
                        // round trip or two, and is then named at its
                        // new term (at once, openraft names it at this
                        // node's term, still campaigning).
                        // Not settled within the wait (this node still
                        // leads at the refused term, or no leader is
                        // known): no leader is named, rather than the
                        // replica openraft names at a term it does not
                        // lead at, which a sender's map would keep until
                        // the next term.
                        let left =
                            wait_until.saturating_duration_since(tokio::time::Instant::now());
                        let settled = st.leadership_settled(term, left).await.and_then(|l| {
                            let moved = !(l.this_node_leads() && l.term <= term);
                            l.leader.filter(|_| moved).map(|n| (n, l.term))
                        });
                        let owner = settled.map_or(Owner::Unknown { hint: None }, |(l, t)| {
                            leader_named(app, l, t)
                        });
                        let d = decide(&Facts {
                            routing_active: app.dir.routing_active(),
                            hops_taken: route.hops_taken,
                            owner: owner.clone(),
                            local_fence: None,
                        });
                        (owner, d)
                    };
                    match d {
                        // This node leads again, and the request is a read
                        // that was refused at its confirmation: it has not
                        // run, and runs here once more (confirmed again).
                        Decision::Local { .. } if is_read && local.is_some() => {
                            match run_here(app, st.clone(), st.epoch(), true, &mut local, partition)
                                .await
                            {
                                Ok(v) => {
                                    return Routed::Local(v, RouteHeaders::new(app, &route, &owner))
                                }
                                Err(e) => (owner, e.into_response()),
                            }
                        }
                        Decision::Local { .. } => (
                            owner,
                            ApiError::ShardUnavailable {
                                shard,
                                executed: Executed::No,
                                reason: format!(
                                    "the shard's Raft group refused this node as its leader at term {term}, and within {} ms it came to lead the group again or knew no other leader",
                                    within.as_millis()
                                ),
                            }
                            .into_response(),
                        ),
                        d => match elsewhere(app, d, &owner, method, path_and_query, body, &route)
                            .await
                        {
                            Ok(resp) => return Routed::Answer(resp),
                            Err(u) => (owner, u.resp),
                        },
                    }
                }
                (e, _) => (owner, e.into_response()),
            }
        }
        d => 'sent: {
            let forwarded_to = match &d {
                Decision::Forward { owner: to, .. } => Some(to.clone()),
                _ => None,
            };
            let started = std::time::Instant::now();
            let first = elsewhere(
                app,
                d,
                &owner,
                method.clone(),
                path_and_query,
                body.clone(),
                &route,
            )
            .await;
            // A request from a client to a replicated shard whose leader
            // did not take it, with nothing executed, may be routed once
            // more when the group's next leader is known (`route_again`).
            let again = route.hops_taken == 0 && app.replication.is_some();
            let (to, why, fallback) = match first {
                Ok(resp) if again && resp.status() == StatusCode::MISDIRECTED_REQUEST => {
                    match forwarded_to {
                        Some(to) => (to, Again::Refused, Fallback::Relayed(resp)),
                        None => return Routed::Answer(resp),
                    }
                }
                Ok(resp) => return Routed::Answer(resp),
                Err(Unrouted {
                    resp,
                    unreached: Some(to),
                }) if again => (to, Again::Unreached, Fallback::Own(owner, resp)),
                Err(u) => break 'sent (owner, u.resp),
            };
            let r = route_again(
                app,
                &route,
                RequestParts {
                    method,
                    path_and_query,
                    body,
                },
                &mut local,
                to,
                why,
                (decided_at, started),
                fallback,
            )
            .await;
            match r {
                Ok(routed) => return routed,
                Err(Fallback::Relayed(resp)) => return Routed::Answer(resp),
                Err(Fallback::Own(owner, resp)) => (owner, resp),
            }
        }
    };
    RouteHeaders::new(app, &route, &owner).apply(&mut resp);
    Routed::Answer(resp)
}

/// Why a request from a client, sent toward its shard's leader, may be
/// routed once more (`route_again`). Nothing was executed either way.
enum Again {
    /// The node taken for the shard's leader refused it (421) as the
    /// group's leadership moved on: an election, a transfer (a new
    /// cluster's first moments, a node coming back or stopping).
    Refused,
    /// The leader of record was not reached and nothing was sent to it:
    /// it is believed down, or the forward's connection failed before the
    /// request left (a leader that has just stopped or died).
    Unreached,
}

/// The answer a request gets if it is not routed once more: the peer's
/// own, relayed as it is, or this node's refusal on behalf of `Owner`
/// (route headers are added to it).
enum Fallback {
    Relayed(Response),
    Own(Owner, Response),
}

/// The parts of a request that a second route sends on.
struct RequestParts<'a> {
    method: Method,
    path_and_query: &'a str,
    body: Bytes,
}

/// A request from a client that the node taken for its shard's leader
/// (`to`) did not take, with nothing executed (`why`): when a leader of
/// the group at a later term than `to`'s is known within a bound, the
/// request is routed once more, as if it had come then; otherwise (or
/// if routing finds nothing new to try) `fallback` is its answer.
///
/// - Refused: this node's replica waits for its group to name a leader
///   at a later term, within an election's longest timeout
///   (`settle_within`); a node holding no replica takes the one the
///   refusal names, if at a later term.
/// - Unreached: the directory is waited on to name one (this node's
///   replica, or the new leader's node, tells it: a node with no
///   replica hears of a new leader within a round trip of its
///   election), or for the unreached leader to answer a probe again (a
///   pause shorter than an election: it is sent there once more), until
///   a failover that began when the leader last
///   answered a probe would have ended (`failover_within`), and within
///   the forward timeout (a failed connect takes next to none of it,
///   and the client allowed the request that long). A leader that
///   stopped on purpose handed its leaderships over before it exited,
///   so the wait is a round trip; one that died takes a failover (under
///   a second at the default timers: BENCHMARKS.md). A leader unreached
///   for longer is not being replaced, and its shard's requests are
///   refused at once, as before.
///
/// Either way the first try and the wait take one forward timeout at
/// most, and the second try another; each try may first wait up to half
/// a forward timeout for a connection of this node's share of the
/// owner's (`ForwardRequest::queue_within`).
#[allow(clippy::too_many_arguments)]
async fn route_again<T, F, Fut>(
    app: &Arc<App>,
    route: &Route,
    req: RequestParts<'_>,
    local: &mut Option<F>,
    to: OwnerHint,
    why: Again,
    (decided_at, started): (std::time::Instant, std::time::Instant),
    fallback: Fallback,
) -> Result<Routed<T>, Fallback>
where
    F: FnOnce(Epoch, Arc<ShardStore>) -> Fut,
    Fut: Future<Output = Result<T, ApiError>>,
{
    let shard = route.shard.get();
    let partition = route.partition.map(|p| p.get());
    let left = app
        .cfg
        .peer
        .forward_timeout()
        .saturating_sub(started.elapsed());
    let within = match why {
        Again::Refused => settle_within(app),
        // Until a failover begun when the leader last answered would have
        // ended: a leader unreached for longer is not being replaced (its
        // group lost its quorum, or this node is cut off from it), and the
        // request is refused at once, as before. A node that never
        // answered is not waited for.
        Again::Unreached => app
            .dir
            .liveness()
            .last_answered(to.node)
            .map_or(Duration::ZERO, |at| {
                (at + failover_within(app)).saturating_duration_since(std::time::Instant::now())
            }),
    }
    .min(left);
    if within.is_zero() {
        return Err(fallback);
    }
    let replica = app.store.shard(route.shard).filter(|st| st.is_replicated());
    let later = match (&why, &replica, &fallback) {
        // Its own replica learns the group's next leader.
        (Again::Refused, Some(st), _) => {
            let now = st.leader_after(to.epoch.get(), within).await;
            tracing::info!(
                shard,
                refused_by = %to.node,
                at_term = to.epoch.get(),
                now = ?now.map(|l| (l.leader, l.term)),
                "the node taken for the shard's leader refused a request as the leadership moved; routing it again"
            );
            now.is_some_and(|l| l.leader.is_some() && l.term > to.epoch.get())
        }
        // No replica here: the refusal's word, if it names a leader at a
        // later term.
        (Again::Refused, None, Fallback::Relayed(resp)) => {
            later_leader_named(app, route.shard, resp, &to)
        }
        (Again::Refused, None, Fallback::Own(..)) => false,
        (Again::Unreached, ..) => {
            let now = leader_reachable(app, route.shard, &to, decided_at, within).await;
            // (Per request: many in a failover under load.)
            tracing::debug!(
                shard,
                unreached = %to.node,
                at_term = to.epoch.get(),
                now = ?now.as_ref().map(|r| match r {
                    Reachable::Successor(a) => (a.owner.get(), a.epoch.get()),
                    Reachable::Back => (to.node.get(), to.epoch.get()),
                }),
                waited_ms = started.elapsed().as_millis() as u64,
                "the shard's leader was not reached (nothing sent); routing the request again once a leader is reachable"
            );
            now.is_some()
        }
    };
    // No later leader within the wait: the first answer stands.
    if !later {
        return Err(fallback);
    }
    app.metrics.outcome(outcome::REROUTED);
    let (owner, d) = decision(app, route.shard, route.hops_taken);
    match (d, replica) {
        (Decision::Local { .. }, Some(st)) if local.is_some() => {
            app.metrics.outcome(outcome::LOCAL);
            let is_read = req.method == Method::GET || req.method == Method::HEAD;
            match run_here(app, st.clone(), st.epoch(), is_read, local, partition).await {
                Ok(v) => Ok(Routed::Local(v, RouteHeaders::new(app, route, &owner))),
                Err(e) => Err(Fallback::Own(owner, e.into_response())),
            }
        }
        // (Never so with a replica here: the first try did not run the
        // step; without one, a refusal that named this node.)
        (Decision::Local { .. }, _) => Err(fallback),
        // The same node at the same term, after it refused: nothing new
        // to try. (One not reached before, nothing sent, has answered
        // again since: it is tried once more.)
        (Decision::Forward { owner: again, .. }, _)
            if again.node == to.node
                && again.epoch == to.epoch
                && matches!(why, Again::Refused) =>
        {
            Err(fallback)
        }
        // Forwarded once more, or this node's own refusal now (the leader
        // it knows is down, or unknown).
        (d, _) => match elsewhere(
            app,
            d,
            &owner,
            req.method,
            req.path_and_query,
            req.body,
            route,
        )
        .await
        {
            Ok(again) => Ok(Routed::Answer(again)),
            Err(again) => Err(Fallback::Own(owner, again.resp)),
        },
    }
}

/// What a request waiting for its shard's leader saw (`leader_reachable`).
enum Reachable {
    /// The directory names a leader at a later term than the unreached
    /// one's.
    Successor(forkless_routing::ShardAssignment),
    /// The unreached leader answered a probe asked after the request was
    /// found unable to reach it (a pause shorter than an election, say):
    /// believed up.
    Back,
}

/// Waits, at most `within`, until `shard`'s leader is reachable again
/// after `to` was found unreachable by the decision made at `since`: the
/// directory names a leader at a later term than `to`'s, or `to` answered
/// a probe asked after `since` and is believed up (one asked before, and
/// answered just before it died, proves nothing); `None` if neither.
/// A leader that was killed and restarted meanwhile is taken for back
/// too: the request sent to it once more is refused there (`421`,
/// nothing executed) if it no longer leads.
async fn leader_reachable(
    app: &App,
    shard: ShardId,
    to: &OwnerHint,
    since: std::time::Instant,
    within: Duration,
) -> Option<Reachable> {
    // Subscribed before the first look, so that a change between the look
    // and the wait still wakes it.
    let mut changed = app.routes_changed.subscribe();
    let until = tokio::time::Instant::now() + within;
    loop {
        if let Some(a) = app.dir.assignment(shard).filter(|a| a.epoch > to.epoch) {
            return Some(Reachable::Successor(a));
        }
        let peers = app.dir.liveness();
        if peers.state(to.node) == PeerState::Up
            && peers.last_answered(to.node).is_some_and(|at| at > since)
        {
            return Some(Reachable::Back);
        }
        match tokio::time::timeout_at(until, changed.changed()).await {
            Ok(Ok(())) => {}
            Ok(Err(_)) | Err(_) => return None,
        }
    }
}

/// A request that came forwarded to this node, whose replica of the
/// shard knows no leader now (an election under way: this node handing
/// its leadership over as it stops, or a leader lost): waits a moment for
/// the group to name one (until `until`: within half the sender's forward
/// timeout of its arrival, whatever else it waits for), and decides
/// again. Refused at once, it would name no leader; named, the
/// leader's later term goes back in the 421, which the sender follows.
/// `None` if there is no such replica here (nothing to wait for).
async fn after_an_election(
    app: &App,
    shard: ShardId,
    hops: u8,
    until: tokio::time::Instant,
) -> Option<(Owner, Decision)> {
    let st = app.store.shard(shard).filter(|st| st.is_replicated())?;
    let l = st.leadership().filter(|l| l.leader.is_none())?;
    let wait = until.saturating_duration_since(tokio::time::Instant::now());
    let now = st.leader_after(l.term.saturating_sub(1), wait).await;
    tracing::debug!(
        shard = shard.get(),
        term = l.term,
        now = ?now.map(|l| (l.leader, l.term)),
        "a forwarded request met an election here; it waited for a leader"
    );
    Some(decision(app, shard, hops))
}

/// How long a request that came forwarded waits here for its shard's
/// group to name a leader before it goes back: an election's longest
/// timeout (`settle_within`), and at most half the forward timeout, so
/// that its sender has the time to send it on.
fn forwarded_wait(app: &App) -> Duration {
    settle_within(app).min(app.cfg.peer.forward_timeout() / 2)
}

/// Runs a request's local step on `st` at `epoch`, once: first confirms,
/// if `confirm`, that this node still leads the shard's group (read
/// index, for a read of a replicated shard). A refused confirmation
/// leaves the step in `local`, not run, so that the request may be run
/// again once the group's leadership settles.
async fn run_here<T, F, Fut>(
    app: &App,
    st: Arc<ShardStore>,
    epoch: Epoch,
    confirm: bool,
    local: &mut Option<F>,
    partition: Option<u32>,
) -> Result<T, ApiError>
where
    F: FnOnce(Epoch, Arc<ShardStore>) -> Fut,
    Fut: Future<Output = Result<T, ApiError>>,
{
    if confirm {
        st.linearize()
            .await
            .map_err(|e| from_store(e, st.id().get(), partition, app.dir.map_version()))?;
    }
    let run = local
        .take()
        .ok_or_else(|| ApiError::Internal("the local step ran twice".into()))?;
    run(epoch, st).await
}

/// Whether a peer's refusal (`resp`, a 421 to a request forwarded to
/// `to`) names, in its route headers, a leader of `shard` at a later term
/// than `to`'s: the directory then takes it (a later term wins), so that
/// the request, sent once more, and those after it go there. A node
/// holding no replica of the shard learns a new leader so between the
/// heartbeats of its leader's node.
fn later_leader_named(app: &App, shard: ShardId, resp: &Response, to: &OwnerHint) -> bool {
    let number = |name: &HeaderName| {
        resp.headers()
            .get(name)
            .and_then(|v| v.to_str().ok())
            .and_then(|v| v.parse::<u64>().ok())
    };
    let (Some(node), Some(term)) = (
        number(&route_header::OWNER).and_then(forkless_types::NodeId::new),
        number(&route_header::EPOCH),
    ) else {
        return false;
    };
    // This node holds no replica: it cannot lead the shard.
    if term <= to.epoch.get() || node == app.cfg.node_id {
        return false;
    }
    let moved = app.observe(shard, node, Epoch(term));
    tracing::info!(
        shard = shard.get(),
        refused_by = %to.node,
        at_term = to.epoch.get(),
        named = %node,
        term,
        map_moved = moved == forkless_routing::Observation::Moved,
        "the node taken for the shard's leader refused a request, naming a leader at a later term; routing it again"
    );
    true
}

/// How long after a shard's leader last answered a probe its group has
/// elected a successor, if it can: a probe round's interval and timeout
/// (the leader may have died just before the next round, and a round
/// waits for its slowest peer, so answers can come that far apart), the
/// leader's lease and a follower's election timer (each an election's
/// longest timeout at most: openraft stands only once its leader's lease
/// has run out), and as much again for the election (a split vote
/// takes another timer) and the word of it on a loaded machine. At the
/// default timers 1.95 s, against a measured failover of 0.8 s at most
/// (BENCHMARKS.md, "Failover").
fn failover_within(app: &App) -> Duration {
    let p = &app.cfg.peer;
    Duration::from_millis(
        p.probe_interval_ms
            .saturating_add(p.probe_timeout_ms)
            .saturating_add(election_max_ms(app).saturating_mul(3)),
    )
}

/// The replicated cluster's longest election timeout (`raft.
/// election_timeout_max_ms`); 0 in a cluster that does not replicate.
fn election_max_ms(app: &App) -> u64 {
    app.cfg
        .cluster
        .as_ref()
        .and_then(|c| c.replication.as_ref())
        .map_or(0, |r| r.timing.election_timeout_max_ms)
}

/// How long a request refused by a shard's group as its leadership moved
/// waits for it to settle before it is routed again: an election's
/// longest timeout (a transfer takes a round trip and an election), and
/// 2 s at most however long the timers are set.
fn settle_within(app: &App) -> Duration {
    Duration::from_millis(election_max_ms(app)).min(Duration::from_secs(2))
}

/// The owner a shard's group names: `leader` at `term`, reached if it is
/// believed up.
fn leader_named(app: &App, leader: u64, term: u64) -> Owner {
    match forkless_types::NodeId::new(leader).and_then(|n| app.dir.node(n)) {
        Some(info) => {
            let hint = forkless_routing::OwnerHint {
                node: info.id,
                api_addr: info.api_addr,
                peer_addr: info.peer_addr,
                epoch: Epoch(term),
            };
            if app.dir.liveness().is_alive(info.id) {
                Owner::Remote(hint)
            } else {
                Owner::Unknown { hint: Some(hint) }
            }
        }
        None => Owner::Unknown { hint: None },
    }
}

/// Performs a routing decision other than [`Decision::Local`]: forwards
/// one hop, or refuses. `Ok`: the owner's answer as it came, with its own
/// route headers; `Err`: this node's refusal, to be given the route
/// headers of `owner`.
async fn elsewhere(
    app: &Arc<App>,
    decision: Decision,
    owner: &Owner,
    method: Method,
    path_and_query: &str,
    body: Bytes,
    route: &Route,
) -> Result<Response, Unrouted> {
    let partition = route.partition.map(|p| p.get());
    let shard = route.shard.get();
    let refused = |resp| Unrouted {
        resp,
        unreached: None,
    };
    Err(match decision {
        Decision::Forward { owner: to, hops } => {
            let started = std::time::Instant::now();
            let req = ForwardRequest {
                method,
                path_and_query,
                body,
                hops,
                timeout: app.cfg.peer.forward_timeout() + route.extra_wait,
                shard,
                peers: app.dir.node_count().saturating_sub(1),
                waits: !route.extra_wait.is_zero(),
                queue_within: app.cfg.peer.forward_timeout() / 2,
                answer_room: route.answer_room,
            };
            let r = app.forwarder.forward(&to, req).await;
            app.metrics
                .forward_seconds
                .observe(started.elapsed().as_secs_f64());
            match r {
                Ok(resp) => {
                    app.metrics.outcome(outcome::FORWARDED_OK);
                    return Ok(resp);
                }
                Err(e) => {
                    app.metrics.outcome(outcome::FORWARD_FAILED);
                    tracing::warn!(shard, owner = %to.node, error = ?e.body(), "forward failed (fail closed: 503, unless the request is routed again to a later leader)");
                    let not_sent = matches!(
                        e,
                        ApiError::OwnerUnavailable {
                            executed: Executed::No,
                            ..
                        }
                    );
                    Unrouted {
                        resp: e.into_response(),
                        unreached: not_sent.then_some(to),
                    }
                }
            }
        }
        Decision::NotOwner { hint } => {
            app.metrics.outcome(outcome::NOT_OWNER);
            tracing::info!(
                shard,
                hops = route.hops_taken,
                "not the owner; answering 421 with a hint"
            );
            // The map names this node, but its copy is fenced by a newer
            // epoch: the map is stale (the prober will move it).
            let detail = if matches!(owner, Owner::Local { .. }) {
                tracing::warn!(shard, "this node's copy of the shard is fenced by a newer epoch than its map names; refusing with 421");
                "its copy of the shard is fenced by a newer epoch than this node's map names (another node owns it now); re-resolve the owner with GET /api/cluster on another node"
            } else {
                "re-resolve the owner from the hint or GET /api/cluster"
            };
            refused(
                ApiError::NotOwner {
                    partition,
                    shard,
                    hint,
                    map_version: app.dir.map_version(),
                    detail: detail.into(),
                }
                .into_response(),
            )
        }
        Decision::FailClosed { reason, hint } => {
            app.metrics.outcome(outcome::FAIL_CLOSED);
            let why = match reason {
                FailClosed::OwnerDown => "the owner is believed down (it missed its last probe)",
                FailClosed::NoOwner => "the map names no owner",
            };
            tracing::warn!(shard, owner = ?hint.as_ref().map(|h| h.node.get()), why, "failing closed (503, unless the request is routed again to a later leader)");
            // Nothing was sent to the owner believed down.
            let unreached = match reason {
                FailClosed::OwnerDown => hint.clone(),
                FailClosed::NoOwner => None,
            };
            Unrouted {
                resp: ApiError::OwnerUnavailable {
                    shard,
                    executed: Executed::No,
                    reason: why.into(),
                    hint,
                }
                .into_response(),
                unreached,
            }
        }
        // Handled by the caller; an owner decided from a refusal is never
        // this node.
        Decision::Local { .. } => refused(
            ApiError::Internal("routing decided to run a request here as it left".into())
                .into_response(),
        ),
    })
}

/// A request [`elsewhere`] did not hand to the shard's owner: this node's
/// refusal, and the owner of record if nothing was sent to it (believed
/// down, or its connection failed before the request left).
struct Unrouted {
    resp: Response,
    unreached: Option<OwnerHint>,
}

/// This node's replica of a replicated `shard` and its applied index, if
/// it may answer a stale read: it holds one, it is one of its group's
/// voters as it knows the group, it is not a new replica still catching
/// up (whose state may be empty, not merely behind), and its group has not
/// left it behind (a removed node back on its old data: its replica takes
/// no entry ever again, so its answers would fall further behind for
/// good, and it would answer 404 for every execution started since). A
/// learner (a move's target catching up) is not asked either: it may hold
/// nothing yet. Its group may know no leader: a stale read is served on
/// the minority side of a partition too.
fn stale_replica(app: &App, shard: ShardId) -> Option<(Arc<ShardStore>, u64)> {
    let st = app.store.shard(shard).filter(|st| st.is_replicated())?;
    let s = st.raft_status()?;
    if s.fresh || st.has_left_group() || !s.voters.contains(&s.me) {
        return None;
    }
    Some((st, s.applied.unwrap_or(0)))
}

/// The `consistency` query parameter of a read: `linearizable` (the
/// default: the shard's leader answers, after confirming with a quorum
/// that it still leads) or `stale` (any replica answers as it stands);
/// true for stale.
fn stale_read(q: &HashMap<String, String>) -> Result<bool, ApiError> {
    match q.get("consistency").map(String::as_str) {
        None | Some("linearizable") => Ok(false),
        Some("stale") => Ok(true),
        Some(other) => Err(ApiError::invalid(
            "consistency",
            format!("must be linearizable or stale, got {other:?}"),
        )),
    }
}

fn id_route(id: ExecutionId, app: &App, hops_taken: u8) -> Route {
    let n = app.dir.shard_count();
    Route {
        partition: Some(id.partition()),
        shard: id.shard(n),
        hops_taken,
        extra_wait: Duration::ZERO,
        stale_ok: false,
        answer_room: None,
    }
}

const JSON_CONTENT_TYPE: HeaderValue = HeaderValue::from_static("application/json");

fn json_response(status: StatusCode, v: &impl Serialize) -> Response {
    match serde_json::to_vec(v) {
        Ok(b) => (status, [(http::header::CONTENT_TYPE, JSON_CONTENT_TYPE)], b).into_response(),
        Err(e) => ApiError::Internal(format!("encoding the answer: {e}")).into_response(),
    }
}

// ---------------------------------------------------------------------------
// Executions

fn execution_json(app: &App, m: &ExecutionMeta, epoch: Option<Epoch>) -> serde_json::Value {
    let n = app.dir.shard_count();
    // A replicated shard's epoch is its group's term (as in the route
    // headers); its store keeps the epoch it opened at, which fences
    // nothing there.
    let epoch = match app
        .store
        .shard(m.id.shard(n))
        .and_then(|st| st.leadership())
    {
        Some(l) => Some(l.term),
        None => epoch.map(|e| e.get()),
    };
    json!({
        "execution_id": m.id.to_string(),
        "workflow": m.workflow,
        "status": m.status.as_str(),
        "last_seq": m.last_seq,
        "routing_key": m.routing_key,
        "partition": m.id.partition().get(),
        "shard": m.id.shard(n).get(),
        "epoch": epoch,
        "created_at": wire::rfc3339(m.created_at_ms),
        "updated_at": wire::rfc3339(m.updated_at_ms),
    })
}

async fn start(
    State(app): AppState,
    method: Method,
    uri: Uri,
    headers: HeaderMap,
    body: Body,
) -> Response {
    match start_inner(&app, method, &uri, &headers, body).await {
        Ok(r) => r,
        Err(e) => e.into_response(),
    }
}

async fn start_inner(
    app: &Arc<App>,
    method: Method,
    uri: &Uri,
    headers: &HeaderMap,
    body: Body,
) -> Result<Response, ApiError> {
    let hops = hops_taken(app, headers)?;
    let bytes = read_body(app, body).await?;
    let b: wire::StartBody = parse(&bytes)?;
    check_name("workflow", &b.workflow, NAME_BYTES_MAX)?;
    if let Some(k) = &b.routing_key {
        check_name("routing_key", k, ROUTING_KEY_BYTES_MAX)?;
    }
    if let Some(k) = &b.idempotency_key {
        check_name("idempotency_key", k, NAME_BYTES_MAX)?;
    }
    wire::check_payload("input", &b.input, &app.cfg.limits)?;

    let n = app.dir.shard_count();
    let steering = b.routing_key.clone().or_else(|| b.idempotency_key.clone());
    // The id minted for placement is used for the first attempt, so a
    // local unsteered start mints once.
    let (route, mut placed) = match &steering {
        // Steered: the key decides the shard, wherever the request landed.
        Some(key) => {
            let p = PartitionId::for_key(key);
            let route = Route {
                partition: Some(p),
                shard: p.shard(n),
                hops_taken: hops,
                extra_wait: Duration::ZERO,
                stale_ok: false,
                answer_room: None,
            };
            (route, None)
        }
        // Unsteered: a shard this node owns, so the start never forwards.
        None => {
            let (shard, placed) =
                match forkless_routing::place_unsteered(&app.minter, n, |s| app.dir.owns(s)) {
                    forkless_routing::Placement::Local { id, shard } => (shard, Some(id)),
                    forkless_routing::Placement::Routed { shard, .. } => (shard, None),
                };
            let route = Route {
                partition: None,
                shard,
                hops_taken: hops,
                extra_wait: Duration::ZERO,
                stale_ok: false,
                answer_room: None,
            };
            (route, placed)
        }
    };
    let shard = route.shard;
    let app2 = app.clone();
    Ok(dispatch(
        app,
        method,
        uri,
        bytes,
        route,
        move |epoch, st| async move {
            let started_payload = started_payload(&b);
            // The minted id is new, but the clock may have stepped back since a
            // restart: the store refuses a duplicate id, and we mint again.
            for _ in 0..4 {
                let id = match placed.take() {
                    Some(id) => id,
                    None => app2
                        .minter
                        .mint_on(n, |s| s == shard)
                        .map_err(|e| ApiError::Internal(e.to_string()))?,
                };
                let req = StartRequest {
                    epoch,
                    id,
                    workflow: b.workflow.clone(),
                    started_payload: started_payload.clone(),
                    routing_key: b.routing_key.clone(),
                    idempotency_key: b.idempotency_key.clone(),
                };
                match st.start(req).await {
                    Ok(out) => {
                        let status = if out.existing {
                            StatusCode::OK
                        } else {
                            StatusCode::CREATED
                        };
                        if !out.existing {
                            app2.metrics.executions_started.inc();
                        }
                        let mut v = execution_json(&app2, &out.meta, Some(epoch));
                        v["existing"] = json!(out.existing);
                        return Ok(json_response(status, &v));
                    }
                    Err(StoreError::ExecutionExists(_)) => continue,
                    Err(e) => {
                        return Err(from_store(
                            e,
                            shard.get(),
                            Some(id.partition().get()),
                            app2.dir.map_version(),
                        ))
                    }
                }
            }
            Err(ApiError::Internal(
                "could not mint a fresh execution id".into(),
            ))
        },
    )
    .await)
}

fn started_payload(b: &wire::StartBody) -> Vec<u8> {
    #[derive(Serialize)]
    struct Started<'a> {
        workflow: &'a str,
        input: Option<&'a RawValue>,
        routing_key: Option<&'a str>,
        idempotency_key: Option<&'a str>,
    }
    serde_json::to_vec(&Started {
        workflow: &b.workflow,
        input: b.input.as_deref(),
        routing_key: b.routing_key.as_deref(),
        idempotency_key: b.idempotency_key.as_deref(),
    })
    .unwrap_or_else(|_| b"null".to_vec())
}

async fn get_execution(
    State(app): AppState,
    id: Result<Path<String>, PathRejection>,
    Query(q): Query<HashMap<String, String>>,
    method: Method,
    uri: Uri,
    headers: HeaderMap,
) -> Result<Response, ApiError> {
    let hops = hops_taken(&app, &headers)?;
    let id = path_execution_id(id)?;
    let mut route = id_route(id, &app, hops);
    route.stale_ok = stale_read(&q)?;
    let app2 = app.clone();
    Ok(dispatch(
        &app,
        method,
        &uri,
        Bytes::new(),
        route,
        move |epoch, st| async move {
            match st.execution(id) {
                Ok(Some(m)) => Ok(json_response(
                    StatusCode::OK,
                    &execution_json(&app2, &m, Some(epoch)),
                )),
                Ok(None) => Err(ApiError::NotFound(format!("execution {id} not found"))),
                Err(e) => Err(ApiError::Internal(e.to_string())),
            }
        },
    )
    .await)
}

// ---------------------------------------------------------------------------
// Appends, signals, cancel

async fn append(State(app): AppState, req: Request) -> Result<Response, ApiError> {
    let (mut parts, body) = req.into_parts();
    let id =
        <Path<String> as axum::extract::FromRequestParts<_>>::from_request_parts(&mut parts, &app)
            .await;
    // Checked after the hop header, as on the direct path.
    let id = path_execution_id(id);
    append_with_id(&app, Request::from_parts(parts, body), id).await
}

/// An append once its id is read off the path (by the router, or by
/// [`hot_append_id`]). The request is taken apart, not its head cloned
/// into extractors.
async fn append_with_id(
    app: &Arc<App>,
    req: Request,
    id: Result<ExecutionId, ApiError>,
) -> Result<Response, ApiError> {
    let (parts, body) = req.into_parts();
    let hops = hops_taken(app, &parts.headers)?;
    let id = id?;
    let bytes = read_body(app, body).await?;
    let b: wire::AppendBody = parse(&bytes)?;
    wire::check_events(&b.events, &app.cfg.limits)?;
    Ok(append_routed(
        app,
        parts.method,
        &parts.uri,
        hops,
        id,
        bytes,
        b.events,
        b.expected_last_seq,
    )
    .await)
}

async fn append_by_body_id(
    State(app): AppState,
    method: Method,
    uri: Uri,
    headers: HeaderMap,
    body: Body,
) -> Result<Response, ApiError> {
    let hops = hops_taken(&app, &headers)?;
    let bytes = read_body(&app, body).await?;
    let b: wire::AppendByIdBody = parse(&bytes)?;
    let id = parse_id(&b.execution_id.0)?;
    wire::check_events(&b.events, &app.cfg.limits)?;
    Ok(append_routed(
        &app,
        method,
        &uri,
        hops,
        id,
        bytes,
        b.events,
        b.expected_last_seq,
    )
    .await)
}

#[allow(clippy::too_many_arguments)]
async fn append_routed(
    app: &Arc<App>,
    method: Method,
    uri: &Uri,
    hops: u8,
    id: ExecutionId,
    bytes: Bytes,
    events: Vec<wire::EventBody>,
    expected_last_seq: Option<u64>,
) -> Response {
    let route = id_route(id, app, hops);
    let events = new_events(events);
    let app2 = app.clone();
    dispatch(
        app,
        method,
        uri,
        bytes,
        route,
        move |epoch, st| async move {
            let out = append_local(&app2, &st, epoch, id, events, expected_last_seq).await?;
            Ok((
                StatusCode::OK,
                [(http::header::CONTENT_TYPE, JSON_CONTENT_TYPE)],
                append_answer(id, &out),
            )
                .into_response())
        },
    )
    .await
}

fn new_events(events: Vec<wire::EventBody>) -> Vec<NewEvent> {
    events
        .into_iter()
        .map(|e| NewEvent {
            event_type: e.event_type,
            payload: wire::payload_bytes(e.payload),
            idempotency_key: e.idempotency_key,
        })
        .collect()
}

/// The body of a successful append's answer, written directly: four
/// fields, numbers and a boolean, nothing to escape.
fn append_answer(id: ExecutionId, out: &forkless_store::AppendOutcome) -> Vec<u8> {
    let mut n = itoa::Buffer::new();
    let mut body = Vec::with_capacity(112);
    body.extend_from_slice(br#"{"execution_id":""#);
    body.extend_from_slice(n.format(id.get()).as_bytes());
    body.extend_from_slice(br#"","first_seq":"#);
    body.extend_from_slice(n.format(out.first_seq).as_bytes());
    body.extend_from_slice(br#","last_seq":"#);
    body.extend_from_slice(n.format(out.last_seq).as_bytes());
    body.extend_from_slice(if out.deduplicated {
        br#","deduplicated":true}"#.as_slice()
    } else {
        br#","deduplicated":false}"#.as_slice()
    });
    body
}

/// The answer to a hot append served by [`crate::conn`].
pub(crate) enum Hot {
    /// Appended: a 200 with this JSON body and these route headers, to be
    /// written as is (the node header and the status count are the
    /// writer's job, as [`stamp`] would have done them).
    Appended { body: Vec<u8>, route: RouteHeaders },
    /// Any other answer, stamped.
    Other(Response),
}

/// `POST /api/executions/{id}/events` (`path`) from a client, or from a
/// peer (proven by the cluster secret) after `hops` hops, answered exactly
/// as [`service`] would answer it but without building a request, and
/// without building a response for the common case.
pub(crate) async fn hot_append(
    app: &Arc<App>,
    id: ExecutionId,
    path: &str,
    bytes: Bytes,
    hops: u8,
) -> Hot {
    let guard = InProgress::enter(&app.in_progress);
    let r = hot_append_inner(app, id, path, bytes, hops).await;
    drop(guard);
    match r {
        Routed::Local(body, route) => {
            app.metrics.response(StatusCode::OK.as_u16());
            Hot::Appended { body, route }
        }
        Routed::Answer(resp) => Hot::Other(stamp(app, resp)),
    }
}

async fn hot_append_inner(
    app: &Arc<App>,
    id: ExecutionId,
    path: &str,
    bytes: Bytes,
    hops: u8,
) -> Routed<Vec<u8>> {
    let b: wire::AppendBody = match parse(&bytes)
        .and_then(|b: wire::AppendBody| wire::check_events(&b.events, &app.cfg.limits).map(|()| b))
    {
        Ok(b) => b,
        Err(e) => return Routed::Answer(e.into_response()),
    };
    let (events, expected_last_seq) = (new_events(b.events), b.expected_last_seq);
    let app2 = app.clone();
    route_request(
        app,
        Method::POST,
        path,
        bytes,
        id_route(id, app, hops),
        move |epoch, st| async move {
            let out = append_local(&app2, &st, epoch, id, events, expected_last_seq).await?;
            Ok(append_answer(id, &out))
        },
    )
    .await
}

/// Whether [`hot_append`] serves an append to `id` that has taken `hops`
/// hops: this node owns its shard now, or forwards it to the owner. (Any
/// other answer is rare and goes the general way.) The decision may change
/// before the body is read; [`hot_append`] decides again.
pub(crate) fn hot_append_serves(app: &App, id: ExecutionId, hops: u8) -> bool {
    let shard = id.shard(app.dir.shard_count());
    matches!(
        decision(app, shard, hops).1,
        Decision::Local { .. } | Decision::Forward { .. }
    )
}

async fn append_local(
    app: &App,
    st: &ShardStore,
    epoch: Epoch,
    id: ExecutionId,
    events: Vec<NewEvent>,
    expected_last_seq: Option<u64>,
) -> Result<forkless_store::AppendOutcome, ApiError> {
    let count = events.len() as u64;
    let out = st
        .append(AppendRequest {
            epoch,
            id,
            events,
            expected_last_seq,
        })
        .await
        .map_err(|e| {
            from_store(
                e,
                id.shard(app.dir.shard_count()).get(),
                Some(id.partition().get()),
                app.dir.map_version(),
            )
        })?;
    if !out.deduplicated {
        app.metrics.events_appended.inc_by(count);
    }
    Ok(out)
}

async fn signal(
    State(app): AppState,
    id: Result<Path<String>, PathRejection>,
    method: Method,
    uri: Uri,
    headers: HeaderMap,
    body: Body,
) -> Result<Response, ApiError> {
    let hops = hops_taken(&app, &headers)?;
    let id = path_execution_id(id)?;
    let bytes = read_body(&app, body).await?;
    let b: wire::SignalBody = parse(&bytes)?;
    check_name("name", &b.name, NAME_BYTES_MAX)?;
    if let Some(k) = &b.idempotency_key {
        check_name("idempotency_key", k, NAME_BYTES_MAX)?;
    }
    wire::check_payload("payload", &b.payload, &app.cfg.limits)?;
    #[derive(Serialize)]
    struct Signal<'a> {
        name: &'a str,
        payload: Option<&'a RawValue>,
    }
    let payload = serde_json::to_vec(&Signal {
        name: &b.name,
        payload: b.payload.as_deref(),
    })
    .map_err(|e| ApiError::Internal(e.to_string()))?;
    let event = NewEvent {
        event_type: "execution.signaled".into(),
        payload,
        idempotency_key: b.idempotency_key,
    };
    Ok(single_event(&app, method, &uri, hops, id, bytes, event).await)
}

async fn cancel(
    State(app): AppState,
    id: Result<Path<String>, PathRejection>,
    method: Method,
    uri: Uri,
    headers: HeaderMap,
    body: Body,
) -> Result<Response, ApiError> {
    let hops = hops_taken(&app, &headers)?;
    let id = path_execution_id(id)?;
    let bytes = read_body(&app, body).await?;
    // An empty body is a cancel without a reason.
    let b: wire::CancelBody = if bytes.iter().all(u8::is_ascii_whitespace) {
        wire::CancelBody {
            reason: None,
            idempotency_key: None,
        }
    } else {
        parse(&bytes)?
    };
    if let Some(r) = &b.reason {
        if r.len() > app.cfg.limits.event_payload_bytes_max {
            return Err(ApiError::TooLarge {
                what: "reason".into(),
                size: r.len(),
                limit: app.cfg.limits.event_payload_bytes_max,
            });
        }
    }
    if let Some(k) = &b.idempotency_key {
        check_name("idempotency_key", k, NAME_BYTES_MAX)?;
    }
    let payload = serde_json::to_vec(&json!({"reason": b.reason}))
        .map_err(|e| ApiError::Internal(e.to_string()))?;
    let event = NewEvent {
        event_type: "execution.cancelled".into(),
        payload,
        idempotency_key: b.idempotency_key,
    };
    Ok(single_event(&app, method, &uri, hops, id, bytes, event).await)
}

async fn single_event(
    app: &Arc<App>,
    method: Method,
    uri: &Uri,
    hops: u8,
    id: ExecutionId,
    bytes: Bytes,
    event: NewEvent,
) -> Response {
    let route = id_route(id, app, hops);
    let app2 = app.clone();
    dispatch(app, method, uri, bytes, route, move |epoch, st| async move {
        let out = append_local(&app2, &st, epoch, id, vec![event], None).await?;
        // The status comes with the append's own answer: a second read here
        // could already see a later append's.
        Ok(json_response(
            StatusCode::OK,
            &json!({"execution_id": id.to_string(), "seq": out.last_seq, "deduplicated": out.deduplicated, "status": out.status.as_str()}),
        ))
    })
    .await
}

// ---------------------------------------------------------------------------
// Reads

struct ReadParams {
    after: u64,
    limit: usize,
    wait: Duration,
}

fn read_params(app: &App, q: &HashMap<String, String>) -> Result<ReadParams, ApiError> {
    let num = |name: &str, default: u64| -> Result<u64, ApiError> {
        match q.get(name) {
            None => Ok(default),
            Some(v) => v.parse::<u64>().map_err(|_| {
                ApiError::invalid(name, format!("must be a non-negative integer, got {v:?}"))
            }),
        }
    };
    let after = num("after", 0)?;
    let limit = num("limit", 100)?;
    let max = app.cfg.limits.read_events_max as u64;
    if limit == 0 || limit > max {
        return Err(ApiError::invalid(
            "limit",
            format!("must be 1 to {max}, got {limit}"),
        ));
    }
    let wait_ms = num("wait_ms", 0)?;
    if wait_ms > app.cfg.limits.wait_ms_max {
        return Err(ApiError::invalid(
            "wait_ms",
            format!(
                "must be at most {}, got {wait_ms}",
                app.cfg.limits.wait_ms_max
            ),
        ));
    }
    Ok(ReadParams {
        after,
        limit: limit as usize,
        wait: Duration::from_millis(wait_ms),
    })
}

async fn read_events(
    State(app): AppState,
    id: Result<Path<String>, PathRejection>,
    Query(q): Query<HashMap<String, String>>,
    method: Method,
    uri: Uri,
    headers: HeaderMap,
    listener: Option<axum::Extension<crate::budget::ListenerIndex>>,
) -> Result<Response, ApiError> {
    // (A request made in-process, by tests, counts as a client's.)
    let listener = listener.map_or(0, |l| l.0 .0);
    let hops = hops_taken(&app, &headers)?;
    let id = path_execution_id(id)?;
    let p = read_params(&app, &q)?;
    // The room the peer that forwarded this read has for its answer (its
    // credentials were checked with its hop count).
    let peers_room = (hops > 0)
        .then(|| headers.get(crate::ANSWER_ROOM_HEADER))
        .flatten()
        .and_then(|v| v.to_str().ok()?.parse::<usize>().ok());
    let mut route = id_route(id, &app, hops);
    route.answer_room = Some(app.answer_budgets[listener].room());
    route.extra_wait = p.wait;
    route.stale_ok = stale_read(&q)?;
    if route.stale_ok && !p.wait.is_zero() {
        return Err(ApiError::invalid(
            "consistency",
            "a long-poll (wait_ms) is served by the shard's leader: leave out consistency=stale, or wait_ms",
        ));
    }
    let app2 = app.clone();
    let answer = dispatch(
        &app,
        method,
        &uri,
        Bytes::new(),
        route,
        move |_epoch, st| async move {
            let deadline = tokio::time::Instant::now() + p.wait;
            let answers = &app2.answer_budgets[listener];
            // Interest in this execution's commits only (not the shard's),
            // taken before the first read so no commit is missed; counted
            // against the node's long-poll bound once the poll waits.
            let interest = (!p.wait.is_zero()).then(|| st.watch_execution(id));
            let mut slot: Option<LongPollSlot> = None;
            let mut stopping = app2.stopping.subscribe();
            // A replicated shard's poll is its leader's: it ends (with what
            // there is) once this node leads no more or the group stops
            // (its supervisor restarts it only once nothing holds the
            // shard), and the client's next poll goes to the new leader.
            let mut leadership = st.raft_watch().filter(|_| !p.wait.is_zero());
            let mut led_away = leadership
                .as_ref()
                .is_some_and(|w| !w.now().this_node_leads());
            loop {
                let woken = interest.as_ref().map(|i| i.notified());
                tokio::pin!(woken);
                if let Some(w) = woken.as_mut().as_pin_mut() {
                    w.enable();
                }
                // A page stops after the event whose payload reaches
                // `read_page_bytes_max`, and before one that would take its
                // answer past what the listener's answers have room for
                // (and the forwarding peer's, for a read it forwarded: it
                // holds the page again to relay it), and says where to go
                // on. Never below what is not counted: a page that small
                // is served however full the budget. The answer is held
                // against the budget until written (`budget::hold_answer`),
                // and refused if it does not fit even so (its one event
                // is larger, or another read took the room first). Each
                // event's bytes are counted exactly when a whole page might
                // not fit, else bounded by its payload and the most its
                // frame takes, and counted once the bound would not fit
                // (an event written under a higher payload limit).
                let limits = &app2.cfg.limits;
                let room = answers
                    .room()
                    .min(peers_room.unwrap_or(usize::MAX))
                    .max(crate::budget::ANSWER_UNCOUNTED_MAX);
                let mut exact = room
                    < limits
                        .read_page_bytes_max
                        .saturating_add(crate::config::page_overhead_bytes_max(limits, p.limit));
                let (mut payloads, mut answer) = (0usize, crate::config::PAGE_FRAME_BYTES_MAX);
                let (meta, events) = st
                    .read_events_fitting(id, p.after, p.limit, |e| {
                        let mut bytes = e
                            .payload
                            .len()
                            .saturating_add(crate::config::EVENT_FRAME_BYTES_MAX);
                        if exact || answer.saturating_add(bytes) > room {
                            exact = true;
                            bytes = wire::event_bytes_in_page(e);
                        }
                        answer = answer.saturating_add(bytes);
                        if answer > room {
                            return Fit::End;
                        }
                        payloads = payloads.saturating_add(e.payload.len());
                        if payloads >= limits.read_page_bytes_max {
                            Fit::TakeAndEnd
                        } else {
                            Fit::Take
                        }
                    })
                    .map_err(|e| ApiError::Internal(e.to_string()))?
                    .ok_or_else(|| ApiError::NotFound(format!("execution {id} not found")))?;
                let done = !events.is_empty()
                    || meta.status.is_terminal()
                    || tokio::time::Instant::now() >= deadline
                    || *stopping.borrow()
                    || led_away;
                if done {
                    // Where to continue when the page stopped before the
                    // end of the log (by `limit` or by the byte budget).
                    let next_after = events.last().map(|e| e.seq).filter(|s| *s < meta.last_seq);
                    let body = wire::encode_events_page(
                        &id.to_string(),
                        meta.status.as_str(),
                        meta.last_seq,
                        &events,
                        next_after,
                    );
                    return Ok((
                        StatusCode::OK,
                        [(http::header::CONTENT_TYPE, "application/json")],
                        body,
                    )
                        .into_response());
                }
                if slot.is_none() {
                    slot = Some(LongPollSlot::take(&app2)?);
                }
                let Some(w) = woken.as_mut().as_pin_mut() else {
                    // No wait asked for: answered above.
                    continue;
                };
                // Wake on a commit of this execution, the deadline,
                // shutdown (the poll then answers with what there is, so
                // it does not hold the node's shutdown up), or a change of
                // the shard's leadership.
                let moved = async {
                    match leadership.as_mut() {
                        Some(watch) => watch.changed().await,
                        None => std::future::pending().await,
                    }
                };
                tokio::select! {
                    r = tokio::time::timeout_at(deadline, w) => {
                        if r.is_ok() {
                            app2.metrics.long_poll_wakeups.inc();
                        }
                    }
                    _ = stopping.changed() => {}
                    now = moved => {
                        // (The group stopped: `None`.)
                        led_away = now.is_none_or(|l| !l.this_node_leads());
                    }
                }
            }
        },
    )
    .await;
    // Held from here until written, the owner's answer relayed by this
    // node too.
    Ok(crate::budget::hold_answer(&app.answer_budgets[listener], answer).await)
}

/// One waiting long-poll counted in [`App::long_polls`] until dropped.
struct LongPollSlot(Arc<App>);

impl LongPollSlot {
    /// A slot, or 503 `too_many_long_polls` when `limits.long_polls_max`
    /// are waiting already.
    fn take(app: &Arc<App>) -> Result<LongPollSlot, ApiError> {
        let max = app.cfg.limits.long_polls_max;
        let taken = app
            .long_polls
            .fetch_update(Ordering::AcqRel, Ordering::Acquire, |n| {
                (n < max).then_some(n + 1)
            })
            .is_ok();
        if !taken {
            app.metrics.long_polls_refused.inc();
            return Err(ApiError::Overloaded {
                code: "too_many_long_polls",
                message: format!(
                    "this node has {max} long-polls waiting, its limit (limits.long_polls_max); retry later, or read without wait_ms"
                ),
                limit: max,
            });
        }
        app.metrics.long_polls_waiting.inc();
        Ok(LongPollSlot(app.clone()))
    }
}

impl Drop for LongPollSlot {
    fn drop(&mut self) {
        self.0.long_polls.fetch_sub(1, Ordering::AcqRel);
        self.0.metrics.long_polls_waiting.dec();
    }
}

async fn by_key(
    State(app): AppState,
    key: Result<Path<String>, PathRejection>,
    Query(q): Query<HashMap<String, String>>,
    method: Method,
    uri: Uri,
    headers: HeaderMap,
    listener: Option<axum::Extension<crate::budget::ListenerIndex>>,
) -> Result<Response, ApiError> {
    let listener = listener.map_or(0, |l| l.0 .0);
    let hops = hops_taken(&app, &headers)?;
    let key = path_param(key, "routing_key")?;
    check_name("routing_key", &key, ROUTING_KEY_BYTES_MAX)?;
    let n = app.dir.shard_count();
    let p = PartitionId::for_key(&key);
    let route = Route {
        partition: Some(p),
        shard: p.shard(n),
        hops_taken: hops,
        extra_wait: Duration::ZERO,
        stale_ok: stale_read(&q)?,
        answer_room: None,
    };
    let app2 = app.clone();
    let answer =
        dispatch(&app, method, &uri, Bytes::new(), route, move |epoch, st| async move {
            let ids = st.executions_for_key(&key, 1000).map_err(|e| ApiError::Internal(e.to_string()))?;
            let mut out = Vec::new();
            for id in ids {
                // Steered ids are minted on the key's shard, so this is
                // normally the same store; after a resize it may not be.
                // (A read that fails is the request's failure: taken for
                // "held elsewhere", it would answer 200 with a bare id.)
                let meta = match app2.store.shard(id.shard(n)) {
                    Some(s) => s.execution(id).map_err(|e| ApiError::Internal(e.to_string()))?,
                    None => None,
                };
                out.push(match meta {
                    Some(m) => execution_json(&app2, &m, Some(epoch)),
                    None => json!({"execution_id": id.to_string(), "partition": id.partition().get(), "shard": id.shard(n).get()}),
                });
            }
            Ok(json_response(
                StatusCode::OK,
                &json!({"routing_key": key, "partition": p.get(), "shard": p.shard(n).get(), "executions": out}),
            ))
        })
        .await;
    Ok(crate::budget::hold_answer(&app.answer_budgets[listener], answer).await)
}

// ---------------------------------------------------------------------------
// Operators: replacing replicas (Raft membership changes), the cluster map

/// How long a new replica may take to catch up as a learner before its
/// replacement gives up (it stays a learner; asking again within
/// `[raft] learner_kept_s` goes on, and the shard's leader removes it
/// after that: `forkless_raftnet::balance::run`).
const CATCH_UP_WITHIN: Duration = Duration::from_secs(300);
/// How long a replacement waits for a new replica's node that answers
/// none of this node's probes, its learner taking nothing meanwhile (the
/// node is down, or cut off from this one), before it gives up likewise.
const UNREACHABLE_WITHIN: Duration = Duration::from_secs(30);

/// The `{shard}` of a path: one of this cluster's shards.
fn shard_param(app: &App, p: Result<Path<String>, PathRejection>) -> Result<ShardId, ApiError> {
    let raw = path_param(p, "shard")?;
    let n = app.dir.shard_count().get();
    raw.parse::<u32>()
        .ok()
        .filter(|s| *s < n)
        .map(ShardId)
        .ok_or_else(|| {
            ApiError::invalid(
                "shard",
                format!("{raw:?} is not a shard of this cluster (0 to {})", n - 1),
            )
        })
}

#[derive(serde::Deserialize)]
#[serde(deny_unknown_fields)]
struct TrustBody {
    /// Must be true: the operator accepts that an entry only the lost
    /// disk and a replica that is gone held is lost.
    #[serde(default)]
    accept_loss: bool,
}

/// `POST /api/shards/{shard}/trust`: an operator's override for a shard
/// that cannot elect because this node's replica is new (its data
/// directory was lost) and has not caught up, while a replica it would
/// need is gone for good (`docs/replication.md`, "A replica whose data
/// directory is new"). This node's replica is trusted as caught up
/// (durably) and votes and stands as any replica. This node's own
/// replica only: never forwarded.
async fn trust_replica(
    State(app): AppState,
    shard: Result<Path<String>, PathRejection>,
    body: Body,
) -> Response {
    let run = async {
        let shard = shard_param(&app, shard)?;
        let bytes = read_body(&app, body).await?;
        let b: TrustBody = parse(&bytes)?;
        if !b.accept_loss {
            return Err(ApiError::invalid(
                "accept_loss",
                "must be true: a trusted replica may let its group elect a leader without an entry that only its lost disk and a replica that is gone held",
            ));
        }
        let Some(st) = app.store.shard(shard).filter(|st| st.is_replicated()) else {
            return Err(ApiError::invalid(
                "shard",
                format!(
                    "node {} holds no replica of shard {} (trust the replica on the node that holds it)",
                    app.cfg.node_id,
                    shard.get()
                ),
            ));
        };
        // (Whether the group can elect is not asked: a replica names the
        // last leader it took, alive or not, and one gone for good is the
        // case this is for.)
        let trusted = st
            .trust_replica()
            .map_err(|e| ApiError::Internal(format!("recording the trust: {e}")))?;
        Ok((shard, trusted))
    };
    match run.await {
        Ok((shard, true)) => Json(json!({
            "shard": shard.get(),
            "node": app.cfg.node_id.get(),
            "trusted": true,
        }))
        .into_response(),
        Ok((shard, false)) => (
            StatusCode::CONFLICT,
            Json(json!({
                "error": "not_new",
                "message": format!(
                    "shard: the replica of shard {} on node {} is not new (its data directory was never lost, or it caught up): nothing to trust",
                    shard.get(),
                    app.cfg.node_id
                ),
                "field": "shard",
            })),
        )
            .into_response(),
        Err(e) => e.into_response(),
    }
}

#[derive(serde::Deserialize)]
#[serde(deny_unknown_fields)]
struct ReplaceBody {
    /// The node whose replica moves.
    from: u16,
    /// Where it moves; left out, the shard's leader picks a live node
    /// outside the shard's replicas.
    #[serde(default)]
    to: Option<u16>,
}

#[derive(serde::Deserialize)]
#[serde(deny_unknown_fields)]
struct RemoveNodeBody {
    node: u16,
    #[serde(default)]
    to: Option<u16>,
}

type RaftAddrs = std::collections::BTreeMap<forkless_types::NodeId, std::net::SocketAddr>;

/// The node ids of the cluster as this node runs it (its file, and the
/// nodes reloads added), and their Raft addresses; a 400 when the cluster
/// does not replicate its shards.
fn replicated_nodes(app: &App) -> Result<RaftAddrs, ApiError> {
    app.cluster
        .read()
        .unwrap_or_else(|e| e.into_inner())
        .as_ref()
        .and_then(|c| c.replication.as_ref())
        .map(|r| r.raft_addrs.clone())
        .ok_or_else(|| {
            ApiError::invalid(
                "cluster",
                "this cluster does not replicate its shards (replication_factor 1, or one node): there is no replica to move",
            )
        })
}

/// A node id from a request body, checked against the cluster this node
/// runs (its file, and the nodes reloads added).
fn cluster_node(app: &App, field: &str, id: u16) -> Result<forkless_types::NodeId, ApiError> {
    let nodes = replicated_nodes(app)?;
    forkless_types::NodeId::new(u64::from(id))
        .filter(|n| nodes.contains_key(n))
        .ok_or_else(|| {
            ApiError::invalid(
                field,
                format!(
                    "node {id} is not in the cluster this node runs (its nodes: {:?}); a node added to the cluster file joins the running nodes once each reads its file again (`forkless cluster reload`)",
                    nodes.keys().map(|n| n.get()).collect::<Vec<_>>()
                ),
            )
        })
}

/// `POST /api/shards/{shard}/replace`: moves the shard's replica on node
/// `from` to node `to` (`ShardStore::replace_replica`), on the shard's
/// leader (forwarded one hop there, as a write is).
async fn replace_replica(
    State(app): AppState,
    method: Method,
    uri: Uri,
    headers: HeaderMap,
    shard: Result<Path<String>, PathRejection>,
    body: Body,
) -> Response {
    let run = async {
        let hops = hops_taken(&app, &headers)?;
        let shard = shard_param(&app, shard)?;
        let bytes = read_body(&app, body).await?;
        let b: ReplaceBody = parse(&bytes)?;
        let from = cluster_node(&app, "from", b.from)?;
        let to = b.to.map(|t| cluster_node(&app, "to", t)).transpose()?;
        if to == Some(from) {
            return Err(ApiError::invalid("to", "must differ from `from`"));
        }
        Ok((hops, shard, from, to, bytes))
    };
    let (hops, shard, from, to, bytes) = match run.await {
        Ok(v) => v,
        Err(e) => return e.into_response(),
    };
    let route = Route {
        partition: None,
        shard,
        hops_taken: hops,
        extra_wait: CATCH_UP_WITHIN + Duration::from_secs(30),
        stale_ok: false,
        answer_room: None,
    };
    let app2 = app.clone();
    dispatch(&app, method, &uri, bytes, route, move |_, st| async move {
        replace_on_leader(&app2, &st, from, to).await
    })
    .await
}

/// Whether node `t` holds a voting replica of the group `status` is of,
/// for a move to it to be refused as such before it begins. Not while a
/// change of voters is under way (joint: `voters` holds the old and the
/// new), as a leader that died between a move's two steps leaves it: the
/// move asked again finishes that change first (`replace_replica`), and
/// `t` may be the node it was moving to. (The fault suite's moves with
/// the leader killed found a move asked again so refused `400`, "node 2
/// already holds a voting replica", in the joint configuration.)
fn already_a_voter(status: &forkless_store::RaftStatus, t: forkless_types::NodeId) -> bool {
    !status.joint && status.voters.contains(&u64::from(t.get()))
}

/// The leader's part of a replacement: picks the node to move to when
/// none was named, then moves the replica.
async fn replace_on_leader(
    app: &App,
    st: &ShardStore,
    from: forkless_types::NodeId,
    to: Option<forkless_types::NodeId>,
) -> Result<Response, ApiError> {
    let shard = st.id();
    // The voter list below decides "nothing to move" and picks the node
    // to move to: it is read once a quorum confirmed that this node leads
    // (a deposed leader that does not know it yet holds an older list; a
    // `NotLeader` here is routed again, to the leader).
    st.linearize()
        .await
        .map_err(|e| from_store(e, shard.get(), None, app.dir.map_version()))?;
    let status = st.raft_status().ok_or_else(|| {
        from_store(
            StoreError::NotExecuted {
                shard,
                reason: "the shard's Raft group has stopped".into(),
            },
            shard.get(),
            None,
            app.dir.map_version(),
        )
    })?;
    if status.state != "leader" {
        // It stopped leading since the confirmation: routed again, to the
        // leader, rather than decided on this replica's view.
        return Err(from_store(
            StoreError::NotLeader {
                shard,
                leader: status.leader.filter(|&l| l != status.me),
                term: status.term,
            },
            shard.get(),
            None,
            app.dir.map_version(),
        ));
    }
    if !status.voters.contains(&u64::from(from.get())) {
        // Nothing to move (the node holds no replica of the shard, or the
        // move was made before), as the leader confirmed above sees it.
        return Ok(json_response(
            StatusCode::OK,
            &json!({
                "shard": shard.get(),
                "from": from.get(),
                "changed": false,
                "voters": status.voters,
            }),
        ));
    }
    let nodes = replicated_nodes(app)?;
    let to = match to {
        // (Checked again by the move, under its group's lock.)
        Some(t) if already_a_voter(&status, t) => {
            return Err(from_store(
                StoreError::MoveTargetIsVoter {
                    shard,
                    node: u64::from(t.get()),
                    voters: status.voters,
                },
                shard.get(),
                None,
                app.dir.map_version(),
            ));
        }
        // (A node this one does not run yet, or no longer, is refused
        // below, naming the reload.)
        Some(t)
            if t != app.cfg.node_id
                && nodes.contains_key(&t)
                && app.dir.liveness().state(t) == PeerState::Down =>
        {
            // (One that never answered is tried: it may be starting. A
            // move to a node that answers nothing ends at
            // UNREACHABLE_WITHIN.)
            let silent = app
                .dir
                .liveness()
                .last_answered(t)
                .map(|a| format!("for {} s", a.elapsed().as_secs()))
                .unwrap_or_else(|| "yet".into());
            return Err(ApiError::MoveUnfinished {
                code: "target_unreachable",
                shard: shard.get(),
                node: u64::from(t.get()),
                learner_left: false,
                message: format!(
                    "node {t} has answered none of node {}'s probes {silent} (it is down, or cut \
                     off from node {}): the move was not begun; ask again once node {t} answers, \
                     or move the replica to another node",
                    app.cfg.node_id, app.cfg.node_id
                ),
            });
        }
        Some(t) => t,
        None => pick_target(app, &nodes, shard, from, &status.voters, &status.learners).ok_or_else(|| {
            ApiError::invalid(
                "to",
                format!(
                    "shard {shard}'s replicas are on nodes {:?}: no live node of the cluster file is outside them to move node {from}'s replica to",
                    status.voters
                ),
            )
        })?,
    };
    // The target is held from here to the end of the move, and looked up
    // again after that: a reload that retired it meanwhile is seen now, and
    // one that comes later refuses to retire it (`reload::MoveTargets`).
    let _target = app.move_targets.hold(to);
    let addr = replicated_nodes(app)?
        .get(&to)
        .map(|a| a.to_string())
        .ok_or_else(|| {
            ApiError::invalid(
                "to",
                format!(
                    "node {to} is not in the cluster this node runs (retired, or not added here: `forkless cluster reload`)"
                ),
            )
        })?;
    let done = st
        .replace_replica(
            u64::from(from.get()),
            u64::from(to.get()),
            addr,
            forkless_store::MoveBounds {
                catch_up_within: CATCH_UP_WITHIN,
                unreachable_within: UNREACHABLE_WITHIN,
                last_answered: &|| {
                    if to == app.cfg.node_id {
                        Some(std::time::Instant::now())
                    } else {
                        app.dir.liveness().last_answered(to)
                    }
                },
            },
        )
        .await
        .map_err(|e| from_store(e, shard.get(), None, app.dir.map_version()))?;
    Ok(json_response(
        StatusCode::OK,
        &json!({
            "shard": shard.get(),
            "from": from.get(),
            // Where the replica went: a change cut short that this move
            // finished took it to that change's own target.
            "to": done.to.unwrap_or(u64::from(to.get())),
            "changed": done.changed,
            "voters": done.voters,
        }),
    ))
}

/// The node a shard's replica on `from` moves to: a learner already
/// catching up (a replacement cut short), else the first live node of
/// the cluster file outside the shard's replicas, counting from the
/// shard's own place in the node list (so the moved replicas of many
/// shards spread over the nodes left).
fn pick_target(
    app: &App,
    nodes: &RaftAddrs,
    shard: ShardId,
    from: forkless_types::NodeId,
    voters: &[u64],
    learners: &[u64],
) -> Option<forkless_types::NodeId> {
    let ids: Vec<_> = nodes.keys().copied().collect();
    // (A node that has not answered a probe yet is passed over: it may
    // never have started.)
    let usable = |n: &forkless_types::NodeId| {
        *n != from && !voters.contains(&u64::from(n.get())) && answers(app, *n)
    };
    if let Some(l) = ids
        .iter()
        .find(|n| usable(n) && learners.contains(&u64::from(n.get())))
    {
        return Some(*l);
    }
    let start = shard.get() as usize % ids.len().max(1);
    (0..ids.len())
        .map(|i| ids[(start + i) % ids.len()])
        .find(|n| usable(n))
}

/// Whether `node` is this node, or answered this node's last probe.
fn answers(app: &App, node: forkless_types::NodeId) -> bool {
    node == app.cfg.node_id || app.dir.liveness().state(node) == PeerState::Up
}

/// How long a node's removal keeps asking a shard that answers 503 or
/// 421 (a few elections' time: a shard whose leader's node just died, or
/// whose leadership is being handed over, has a leader again within one).
const REPLACE_RETRY_WITHIN: Duration = Duration::from_secs(20);
/// The pause between those asks.
const REPLACE_RETRY_EVERY: Duration = Duration::from_millis(250);

/// One shard's step of a node's removal (`POST /api/shards/{s}/replace`),
/// run on the shard's leader, one hop away at most: its status and body.
async fn replace_through_leader(
    app: &Arc<App>,
    shard: ShardId,
    node: forkless_types::NodeId,
    to: Option<u16>,
) -> (StatusCode, serde_json::Value) {
    let body = Bytes::from(json!({ "from": node.get(), "to": to }).to_string());
    let route = Route {
        partition: None,
        shard,
        hops_taken: 0,
        extra_wait: CATCH_UP_WITHIN + Duration::from_secs(30),
        stale_ok: false,
        answer_room: None,
    };
    let path = format!("/api/shards/{}/replace", shard.get());
    let a = app.clone();
    let answer = route_request(
        app,
        Method::POST,
        &path,
        body,
        route,
        move |_, st| async move {
            replace_on_leader(
                &a,
                &st,
                node,
                to.and_then(|t| forkless_types::NodeId::new(u64::from(t))),
            )
            .await
        },
    )
    .await;
    let resp = match answer {
        Routed::Local(r, _) | Routed::Answer(r) => r,
    };
    let status = resp.status();
    let text = axum::body::to_bytes(resp.into_body(), 1 << 20)
        .await
        .unwrap_or_default();
    let v = serde_json::from_slice(&text)
        .unwrap_or_else(|_| json!({ "error": String::from_utf8_lossy(&text) }));
    (status, v)
}

/// `POST /api/cluster/remove-node`: moves every replica node `node` holds
/// to another node (`to`, or one each shard's leader picks), one shard
/// at a time, each on its leader. The answer lists each shard, and
/// `complete` says whether every one is done; one that could not be says
/// why (ask again to go on: shards already done are reported unchanged).
async fn remove_node(State(app): AppState, headers: HeaderMap, body: Body) -> Response {
    let run = async {
        if headers.contains_key(HOPS_HEADER) {
            return Err(ApiError::invalid(
                HOPS_HEADER,
                "a node removal is not forwarded",
            ));
        }
        let bytes = read_body(&app, body).await?;
        let b: RemoveNodeBody = parse(&bytes)?;
        let node = cluster_node(&app, "node", b.node)?;
        if let Some(t) = b.to {
            cluster_node(&app, "to", t)?;
            if t == b.node {
                return Err(ApiError::invalid("to", "must differ from `node`"));
            }
        }
        Ok((node, b.to))
    };
    let (node, to) = match run.await {
        Ok(v) => v,
        Err(e) => return e.into_response(),
    };
    tracing::info!(node = node.get(), to = ?to, "moving every replica of a node to others");
    let mut shards = Vec::new();
    let mut complete = true;
    for s in 0..app.dir.shard_count().get() {
        // A shard with no leader to take the step (it is electing one, a
        // handover is under way, or its leader's node just died: a 503,
        // or a 421 naming a leader this node sees dead) is asked again,
        // until it answers otherwise or REPLACE_RETRY_WITHIN has passed.
        // The step is idempotent (a replica already moved is not moved
        // again; a learner left by a step cut short is the one picked),
        // so asking again is safe whatever the first answer did.
        let mut until = std::time::Instant::now() + REPLACE_RETRY_WITHIN;
        let mut picked_again = false;
        let (status, mut v) = loop {
            let (status, v) = replace_through_leader(&app, ShardId(s), node, to).await;
            // (Its learner still catching up: asked again, the move waits
            // for it as long again. Left to the operator.)
            if v["error"] == "catch_up_timeout" {
                break (status, v);
            }
            if v["error"] == "target_unreachable" {
                // The node the leader picked stopped answering during the
                // move: asked again (once), the leader picks one that
                // answers, and removes the learner the move left. A node
                // named (`to`) is the operator's to see to.
                if to.is_some() || picked_again {
                    break (status, v);
                }
                picked_again = true;
                until = std::time::Instant::now() + REPLACE_RETRY_WITHIN;
                tracing::info!(shard = s, node = node.get(), answer = %v, "moving a replica: the node it went to answers nothing; asking the leader to pick another");
                continue;
            }
            let leaderless = status == StatusCode::SERVICE_UNAVAILABLE
                || status == StatusCode::MISDIRECTED_REQUEST;
            if !leaderless || std::time::Instant::now() + REPLACE_RETRY_EVERY >= until {
                break (status, v);
            }
            tracing::info!(shard = s, node = node.get(), status = status.as_u16(), answer = %v, "moving a replica: the shard has no leader to take the step; asking again");
            tokio::time::sleep(REPLACE_RETRY_EVERY).await;
        };
        if !status.is_success() {
            complete = false;
            v = json!({ "shard": s, "status": status.as_u16(), "error": v });
        }
        shards.push(v);
    }
    tracing::info!(
        node = node.get(),
        complete,
        "moving every replica of a node to others: done"
    );
    json_response(
        StatusCode::OK,
        &json!({ "node": node.get(), "complete": complete, "shards": shards }),
    )
}

/// Every shard's replicas as this replicated cluster's groups were made
/// with (`crate::placement`; what this node's start checked the file
/// against), in the order the file as last read names them (a reload may
/// reorder a pin, never change its set): what a node without a record of
/// its own compares its file with, and what `forkless cluster placement`
/// prints to pin.
async fn cluster_placement(State(app): AppState) -> Response {
    let running = app
        .cluster
        .read()
        .unwrap_or_else(|e| e.into_inner())
        .clone();
    match running.as_ref().and_then(|c| c.replication.as_ref()) {
        Some(r) => Json(crate::placement::Placement::of(r, app.cfg.shard_count)).into_response(),
        None => (
            StatusCode::NOT_FOUND,
            Json(json!({
                "error": "not_found",
                "message": "placement: this node is not in a replicated cluster (replication_factor 1): its shards have owners, not replicas",
            })),
        )
            .into_response(),
    }
}

async fn cluster(State(app): AppState) -> Response {
    let n = app.dir.shard_count();
    let restarts = app.store.restarts();
    let heard_all = app.replicas_heard.lock().unwrap_or_else(|e| e.into_inner());
    let shards: Vec<_> = (0..n.get())
        .map(|s| {
            let a = app.dir.assignment(ShardId(s));
            let local = app.store.shard(ShardId(s));
            let failed = app.store.failure(ShardId(s));
            let mut shard = json!({
                "shard": s,
                "owner": a.map(|a| a.owner.get()),
                "epoch": a.map(|a| a.epoch.get()),
                "local": app.dir.owns(ShardId(s)),
                "store_epoch": local.as_ref().map(|st| st.epoch().get()),
            });
            if let Some(why) = failed {
                shard["failed"] = json!(why);
            }
            // Restarts of its Raft group by the store's supervisor.
            if let Some(r) = restarts.get(&ShardId(s)) {
                shard["restarts"] = json!({
                    "count": r.count,
                    "in_a_row": r.in_a_row,
                    "last_reason": r.last_reason,
                    "last_error": r.last_outcome.as_ref().err(),
                });
            }
            if app.replication.is_some() {
                shard["replicas"] = json!(app.placed(ShardId(s)));
                shard["replicas_from"] = json!("cluster_file");
                let status = local.as_ref().and_then(|st| st.raft_status());
                // What the shard's leader said in answer to a probe, when
                // this node holds no replica, or its replica's membership
                // is from an earlier entry than the leader's: the voters a
                // replacement gave the group, which the cluster file does
                // not know, and which a replica the group left behind
                // never heard.
                // (Or, where the group left this node's replica behind,
                // whatever the leader said: the replica follows no leader.)
                let left = local.as_ref().is_some_and(|st| st.has_left_group());
                let heard = heard_all
                    .get(&s)
                    .filter(|h| left || h.newer_than(status.as_ref()));
                if let Some(h) = heard {
                    shard["replicas"] = json!(h.voters);
                    shard["replicas_from"] = json!(format!("leader {} at term {}", h.from, h.term));
                }
                // The group's own view where this node holds a replica,
                // else what the directory learned (epoch 0: none yet).
                match status {
                    Some(g) => {
                        // The group's own membership, which a replacement
                        // changes; the placement above is only its first.
                        if !g.voters.is_empty() && heard.is_none() {
                            shard["replicas"] = json!(g.voters);
                            shard["replicas_from"] = json!("this replica");
                        }
                        // A replica the group left behind knows an older
                        // leader than the one heard, or none at the heard
                        // one's term (its candidacies, refused, took it
                        // there): shown with the heard one.
                        let (leader, term) = match heard
                            .filter(|h| h.term > g.term || (h.term == g.term && g.leader.is_none()))
                        {
                            Some(h) => (Some(u64::from(h.from)), h.term),
                            None => (g.leader, g.term),
                        };
                        shard["leader"] = json!(leader);
                        shard["term"] = json!(term);
                        shard["raft"] = json!({
                            "state": g.state,
                            "last_log_index": g.last_log_index,
                            "committed": g.committed,
                            "applied": g.applied,
                            "snapshot": g.snapshot,
                            "purged": g.purged,
                            "voters": g.voters,
                            "joint": g.joint,
                            "learners": g.learners,
                            "quiet": g.quiet,
                            "fresh": g.fresh,
                            "followers": g.matched.iter().map(|(id, m)| json!({
                                "node": id,
                                "matched": m,
                                "lag": g.last_log_index.map(|l| l.saturating_sub(m.unwrap_or(0))),
                            })).collect::<Vec<_>>(),
                            // The group's newer committed membership, as its
                            // leader said it, no longer counts this replica,
                            // which stands for no election (`crate::quiet`).
                            "left_group": local.as_ref().is_some_and(|st| st.has_left_group()),
                        });
                    }
                    None => {
                        let known = a.filter(|a| a.epoch.get() > 0);
                        shard["leader"] = json!(known.map(|a| a.owner.get()));
                        shard["term"] = json!(known.map(|a| a.epoch.get()));
                    }
                }
            }
            shard
        })
        .collect();
    drop(heard_all);
    let same_nodes = app
        .same_nodes
        .lock()
        .unwrap_or_else(|e| e.into_inner())
        .clone();
    let same_placement = app
        .same_placement
        .lock()
        .unwrap_or_else(|e| e.into_inner())
        .clone();
    let drained = app
        .drained_peers
        .lock()
        .unwrap_or_else(|e| e.into_inner())
        .clone();
    let me_drained = app.drainer.get().is_some_and(|d| d.draining());
    let nodes: Vec<_> = app
        .dir
        .nodes()
        .into_iter()
        .map(|nd| {
            json!({
                "id": nd.id.get(),
                "api_addr": nd.api_addr,
                "peer_addr": nd.peer_addr,
                "alive": nd.id == app.cfg.node_id || app.dir.liveness().is_alive(nd.id),
                "probe": if nd.id == app.cfg.node_id { "self" } else { app.dir.liveness().state(nd.id).as_str() },
                // Unknown (null) until the peer answered a probe.
                "same_nodes": if nd.id == app.cfg.node_id { Some(true) } else { same_nodes.get(&nd.id.get()).copied() },
                // Null until the peer answered a probe, and in a cluster
                // that does not replicate.
                "same_placement": if nd.id == app.cfg.node_id { app.links.as_ref().map(|_| true) } else { same_placement.get(&nd.id.get()).copied() },
                "self": nd.id == app.cfg.node_id,
                // Takes no leadership (drained, or stopping), as it said in
                // its last answer to a probe (null: not known yet).
                "draining": if nd.id == app.cfg.node_id { Some(me_drained) } else { drained.get(&nd.id.get()).copied() },
            })
        })
        .collect();
    json_response(
        StatusCode::OK,
        &json!({
            "node": app.cfg.node_id.get(),
            "shard_count": n.get(),
            "partition_count": forkless_types::PARTITION_COUNT,
            "map_version": app.dir.map_version(),
            "routing_active": app.dir.routing_active(),
            // Takes no leadership (drained by an operator, or stopping).
            "draining": me_drained,
            "nodes": nodes,
            "shards": shards,
        }),
    )
}

/// A node a reload added or moved, with its addresses.
fn node_json(a: &crate::reload::Added) -> serde_json::Value {
    json!({
        "id": a.node.id.get(),
        "api_addr": a.node.api_addr,
        "peer_addr": a.node.peer_addr,
        "raft_addr": a.raft_addr.map(|r| r.to_string()),
    })
}

/// The body of a request that takes none: empty (or white space), else a
/// 400 naming it.
async fn no_body(app: &App, body: Body, why: &str) -> Result<(), ApiError> {
    let b = read_body(app, body).await?;
    if b.iter().all(|c| c.is_ascii_whitespace()) {
        Ok(())
    } else {
        Err(ApiError::invalid("body", format!("takes no body: {why}")))
    }
}

/// The answer to a drain or an undrain on a node that runs no replicated
/// cluster (it has no `Drain`: it leads nothing to hand over): 409.
fn not_replicated(app: &App) -> Response {
    json_response(
        StatusCode::CONFLICT,
        &json!({
            "error": "not_replicated",
            "message": format!(
                "node {} runs no replicated cluster: it has no leadership to hand over",
                app.cfg.node_id
            ),
        }),
    )
}

/// `POST /api/cluster/drain`: this node takes no leadership from now on
/// (its replicas stand for no election, a handover to it is refused, and
/// its peers are told it cannot lead) and hands the shards it leads to
/// other replicas now, waiting at most 2 s; it still serves and forwards
/// every request. Until `POST /api/cluster/undrain`, or its restart.
async fn cluster_drain(State(app): AppState, body: Body) -> Response {
    if let Err(e) = no_body(&app, body, "it drains the node that answers").await {
        return e.into_response();
    }
    let Some(d) = app.drainer.get() else {
        return not_replicated(&app);
    };
    let (done, took_ms) = d.drain().await;
    json_response(
        StatusCode::OK,
        &json!({
            "node": app.cfg.node_id.get(),
            "draining": true,
            "handed": done.handed,
            "not_taken": done.not_taken,
            "no_replica": done.no_replica,
            "took_ms": took_ms,
        }),
    )
}

/// `POST /api/cluster/undrain`: a drained node takes leaderships again;
/// its peers' balancers hand it its preferred shards back. A 409 once the
/// node is stopping.
async fn cluster_undrain(State(app): AppState, body: Body) -> Response {
    if let Err(e) = no_body(&app, body, "it undrains the node that answers").await {
        return e.into_response();
    }
    let Some(d) = app.drainer.get() else {
        return not_replicated(&app);
    };
    if app.leaving.load(std::sync::atomic::Ordering::SeqCst) {
        return json_response(
            StatusCode::CONFLICT,
            &json!({
                "error": "stopping",
                "message": format!("node {} is stopping: it takes no leadership again", app.cfg.node_id),
            }),
        );
    }
    d.undo();
    // A stop that came meanwhile keeps the node draining.
    if app.leaving.load(std::sync::atomic::Ordering::SeqCst) {
        d.redo();
    }
    json_response(
        StatusCode::OK,
        &json!({"node": app.cfg.node_id.get(), "draining": false}),
    )
}

/// `POST /api/cluster/reload`: this node reads its cluster file again and
/// takes the nodes it gained, moved or retired (`crate::reload`);
/// anything else the file changed is refused (409, naming the field) or
/// left for a restart.
async fn cluster_reload(State(app): AppState, body: Body) -> Response {
    // No body is taken: a client that sends one is told so.
    if let Err(e) = no_body(&app, body, "the node reads its cluster file").await {
        return e.into_response();
    }
    match crate::reload::run(&app).await {
        Ok(done) => json_response(
            StatusCode::OK,
            &json!({
                "node": app.cfg.node_id.get(),
                "added": done.added.iter().map(node_json).collect::<Vec<_>>(),
                "moved": done.moved.iter().map(node_json).collect::<Vec<_>>(),
                "retired": done.removed.iter().map(|n| n.get()).collect::<Vec<_>>(),
                "nodes": done.nodes.iter().map(|n| n.get()).collect::<Vec<_>>(),
                "restart_needed": done.restart_needed,
            }),
        ),
        Err(r) => ApiError::ReloadRefused {
            field: r.field,
            reason: r.reason,
        }
        .into_response(),
    }
}

/// Ready once started; a node with shards out of service still serves
/// the others, so it stays ready and says which are failed and why. Not
/// ready once it is shutting down (it still answers what it is sent while
/// it hands its leaderships over and finishes the requests in flight).
async fn readyz(State(app): AppState) -> Response {
    if app.leaving.load(Ordering::Acquire) {
        json_response(
            StatusCode::SERVICE_UNAVAILABLE,
            &json!({"status": "stopping"}),
        )
    } else if app.ready.load(Ordering::Acquire) {
        let failed: Vec<_> = app
            .store
            .failures()
            .into_iter()
            .map(|(s, why)| json!({"shard": s.get(), "reason": why}))
            .collect();
        if failed.is_empty() {
            json_response(StatusCode::OK, &json!({"status": "ready"}))
        } else {
            json_response(
                StatusCode::OK,
                &json!({"status": "degraded", "failed_shards": failed}),
            )
        }
    } else {
        json_response(
            StatusCode::SERVICE_UNAVAILABLE,
            &json!({"status": "starting"}),
        )
    }
}

async fn metrics(State(app): AppState) -> Response {
    (
        [(
            http::header::CONTENT_TYPE,
            "application/openmetrics-text; version=1.0.0; charset=utf-8",
        )],
        app.metrics.render(),
    )
        .into_response()
}

#[cfg(test)]
mod tests {
    use super::already_a_voter;
    use forkless_store::RaftStatus;
    use forkless_types::NodeId;

    fn node(n: u64) -> NodeId {
        NodeId::new(n).expect("a node id")
    }

    #[test]
    fn a_move_to_a_voter_is_refused_but_not_while_a_change_of_voters_is_under_way() {
        let settled = RaftStatus {
            voters: vec![1, 2, 4],
            ..Default::default()
        };
        assert!(already_a_voter(&settled, node(2)));
        assert!(!already_a_voter(&settled, node(5)));
        // A move of node 5's replica to node 2 whose leader died between
        // its two steps: the group's voters are {1, 4, 5} and {1, 2, 4}.
        let joint = RaftStatus {
            voters: vec![1, 2, 4, 5],
            joint: true,
            ..Default::default()
        };
        assert!(!already_a_voter(&joint, node(2)));
    }
}
