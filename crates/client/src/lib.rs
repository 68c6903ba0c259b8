//! A routing-aware client for the forkless HTTP API.
//!
//! The client fetches and caches the cluster map (`GET /api/cluster`),
//! computes the owner of an execution id or routing key locally with the
//! partition table, and sends each request straight to the owner's API
//! address, so a request normally takes no forwarding hop.
//!
//! - `421 not_owner`: the map was stale. The client refreshes it (from any
//!   node) and follows the answer's owner hint once. A second `421` from a
//!   replicated shard (its leadership moving) is retried by a fresh map
//!   within the retry policy, like a `503` that executed nothing; from a
//!   shard of a static cluster (two maps that disagree) it is returned.
//! - `503 owner_unavailable` or an unreachable node: retried with backoff
//!   that honours `Retry-After`, within [`RetryPolicy`] bounds, but only
//!   when repeating cannot apply the request twice: the failure proves
//!   nothing was executed (`executed: false`, connection refused), or the
//!   request is idempotent (a read; a write carrying idempotency keys). An
//!   append without an idempotency key whose outcome is unknown is returned
//!   as an error saying so ([`Error::maybe_executed`]).
//!
//! [`Routing::Fixed`] disables routing: every request goes to the first
//! server, which forwards what it does not own (for benchmarks and
//! debugging).

pub mod error;
pub mod map;
pub mod retry;
pub mod types;

pub use error::{Error, Executed, GaveUp};
pub use map::{ClusterMap, Destination, NodeInfo, ShardInfo};
pub use retry::{Decision, Failure, RetryPolicy};
pub use types::*;

use bytes::Bytes;
use forkless_types::ExecutionId;
use http::{Method, Request, StatusCode};
use http_body_util::{BodyExt, Full};
use hyper_util::client::legacy::connect::HttpConnector;
use hyper_util::rt::TokioExecutor;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, RwLock};
use std::time::{Duration, Instant};

/// Largest answer body read (a full page of large events fits).
const MAX_ANSWER_BYTES: usize = 64 * 1024 * 1024;
/// The response header carrying the answering node's map version.
const MAP_VERSION_HEADER: &str = "x-forkless-map-version";

/// How requests find their node.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum Routing {
    /// Each request goes straight to its shard's owner (the default).
    #[default]
    Owner,
    /// Every request goes to the first server, which forwards what it does
    /// not own. A `421` is returned as [`Error::NotOwner`], not followed.
    Fixed,
}

/// Client settings.
#[derive(Debug, Clone)]
pub struct Config {
    /// Base URLs (`http://host:port`) to fetch the cluster map from; the
    /// first is the fixed node in [`Routing::Fixed`].
    pub servers: Vec<String>,
    pub routing: Routing,
    pub retry: RetryPolicy,
    /// Time for one attempt, connect to last byte (long-polls add their wait).
    pub request_timeout: Duration,
    pub connect_timeout: Duration,
}

impl Config {
    pub fn new(server: &str) -> Config {
        Config {
            servers: vec![server.to_string()],
            routing: Routing::Owner,
            retry: RetryPolicy::default(),
            request_timeout: Duration::from_secs(10),
            connect_timeout: Duration::from_secs(2),
        }
    }
}

/// Normalises a server URL to `http://host:port` (a bare `host:port` is
/// accepted; `https` is refused: the API is plain HTTP).
pub fn normalize_base(url: &str) -> Result<String, Error> {
    let url = url.trim().trim_end_matches('/');
    let rest = if let Some(r) = url.strip_prefix("http://") {
        r
    } else if url.starts_with("https://") {
        return Err(Error::Config(format!(
            "{url}: forkless speaks plain HTTP; use http://"
        )));
    } else if url.contains("://") {
        return Err(Error::Config(format!(
            "{url}: only http:// URLs are supported"
        )));
    } else {
        url
    };
    if rest.is_empty() || rest.contains('/') || rest.contains('?') {
        return Err(Error::Config(format!(
            "{url:?}: expected http://host:port with no path"
        )));
    }
    let base = format!("http://{rest}");
    base.parse::<http::Uri>()
        .map_err(|e| Error::Config(format!("{url:?}: {e}")))?;
    Ok(base)
}

/// Percent-encodes a routing key for a path segment.
fn encode_segment(s: &str) -> String {
    let mut out = String::with_capacity(s.len());
    for b in s.bytes() {
        if b.is_ascii_alphanumeric() || matches!(b, b'-' | b'.' | b'_' | b'~') {
            out.push(b as char);
        } else {
            out.push_str(&format!("%{b:02X}"));
        }
    }
    out
}

type Http = hyper_util::client::legacy::Client<HttpConnector, Full<Bytes>>;

fn http_client(connect_timeout: Duration) -> Http {
    let mut connector = HttpConnector::new();
    connector.set_nodelay(true);
    connector.set_connect_timeout(Some(connect_timeout));
    hyper_util::client::legacy::Client::builder(TokioExecutor::new())
        .pool_idle_timeout(Duration::from_secs(30))
        .build(connector)
}

/// What decides a request's node.
#[derive(Debug, Clone)]
enum Steer {
    Id(ExecutionId),
    Key(String),
    /// Any node will do (an unsteered start).
    Any,
}

struct Call {
    method: Method,
    path: String,
    body: Option<Bytes>,
    steer: Steer,
    idempotent: bool,
    extra_timeout: Duration,
}

/// An answer with a 2xx status.
struct Answer {
    status: StatusCode,
    body: Bytes,
}

/// One attempt's raw outcome.
enum Attempt {
    Answered {
        status: StatusCode,
        retry_after: Option<Duration>,
        map_version: Option<u64>,
        body: Bytes,
    },
    Failed {
        executed: Executed,
        message: String,
    },
}

struct Inner {
    http: Http,
    servers: Vec<String>,
    routing: Routing,
    retry: RetryPolicy,
    request_timeout: Duration,
    connect_timeout: Duration,
    map: RwLock<Option<Arc<ClusterMap>>>,
    /// Bumped on every map stored, so concurrent refreshes collapse.
    generation: AtomicU64,
    stale: AtomicBool,
    refresh: tokio::sync::Mutex<()>,
}

/// A forkless client. Cheap to clone; clones share the map and the
/// connection pool.
#[derive(Clone)]
pub struct Client {
    inner: Arc<Inner>,
}

impl std::fmt::Debug for Client {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Client")
            .field("servers", &self.inner.servers)
            .field("routing", &self.inner.routing)
            .finish()
    }
}

/// How long a node's removal may take: each of its shards' new replica
/// catches up in turn (the server gives each five minutes).
const REMOVE_NODE_WITHIN: Duration = Duration::from_secs(3600);

impl Client {
    /// A routing-aware client that learns the cluster from `server`.
    pub fn new(server: &str) -> Result<Client, Error> {
        Client::with_config(Config::new(server))
    }

    pub fn with_config(cfg: Config) -> Result<Client, Error> {
        if cfg.servers.is_empty() {
            return Err(Error::Config("no server given".into()));
        }
        let servers = cfg
            .servers
            .iter()
            .map(|s| normalize_base(s))
            .collect::<Result<Vec<_>, _>>()?;
        Ok(Client {
            inner: Arc::new(Inner {
                http: http_client(cfg.connect_timeout),
                servers,
                routing: cfg.routing,
                retry: cfg.retry,
                request_timeout: cfg.request_timeout,
                connect_timeout: cfg.connect_timeout,
                map: RwLock::new(None),
                generation: AtomicU64::new(0),
                stale: AtomicBool::new(false),
                refresh: tokio::sync::Mutex::new(()),
            }),
        })
    }

    /// A client with its own connection pool that starts from this one's
    /// cached map (one per benchmark connection).
    pub fn fresh_pool(&self) -> Client {
        let i = &self.inner;
        Client {
            inner: Arc::new(Inner {
                http: http_client(i.connect_timeout),
                servers: i.servers.clone(),
                routing: i.routing,
                retry: i.retry.clone(),
                request_timeout: i.request_timeout,
                connect_timeout: i.connect_timeout,
                map: RwLock::new(self.cached_map()),
                generation: AtomicU64::new(0),
                stale: AtomicBool::new(false),
                refresh: tokio::sync::Mutex::new(()),
            }),
        }
    }

    pub fn routing(&self) -> Routing {
        self.inner.routing
    }

    /// Whether the cached map says `shard` is replicated (its replicas are
    /// listed; any shard, when the answer named none).
    fn replicated(&self, shard: Option<u32>) -> bool {
        self.cached_map().is_some_and(|m| {
            m.shards
                .iter()
                .filter(|s| shard.is_none_or(|n| s.shard == n))
                .any(|s| s.replicas.is_some())
        })
    }

    /// The map in the cache, if one was fetched.
    pub fn cached_map(&self) -> Option<Arc<ClusterMap>> {
        self.inner
            .map
            .read()
            .unwrap_or_else(|e| e.into_inner())
            .clone()
    }

    fn store_map(&self, m: ClusterMap) -> Arc<ClusterMap> {
        let m = Arc::new(m);
        *self.inner.map.write().unwrap_or_else(|e| e.into_inner()) = Some(m.clone());
        self.inner.generation.fetch_add(1, Ordering::AcqRel);
        self.inner.stale.store(false, Ordering::Release);
        m
    }

    // -----------------------------------------------------------------
    // The cluster map

    /// Fetches the cluster map from the first server that answers (the
    /// configured servers first, then the nodes of the cached map) and
    /// caches it.
    pub async fn cluster(&self) -> Result<Arc<ClusterMap>, Error> {
        let mut candidates = self.inner.servers.clone();
        if self.inner.routing == Routing::Owner {
            if let Some(m) = self.cached_map() {
                for c in m.refresh_candidates() {
                    if !candidates.contains(&c) {
                        candidates.push(c);
                    }
                }
            }
        }
        let mut last = None;
        for base in candidates {
            match self.fetch_map(&base).await {
                Ok(m) => return Ok(self.store_map(m)),
                Err(e) => last = Some(e),
            }
        }
        Err(last.unwrap_or_else(|| Error::Config("no server given".into())))
    }

    async fn fetch_map(&self, base: &str) -> Result<ClusterMap, Error> {
        let timeout = self.inner.request_timeout.min(Duration::from_secs(5));
        match self
            .attempt(base, &Method::GET, "/api/cluster", None, timeout)
            .await
        {
            Attempt::Answered { status, body, .. } if status.is_success() => {
                ClusterMap::from_json(&body, base)
            }
            Attempt::Answered {
                status,
                body,
                retry_after,
                ..
            } => Err(Error::from_response(status.as_u16(), &body, retry_after)),
            Attempt::Failed { executed, message } => Err(Error::Transport {
                address: base.to_string(),
                executed,
                attempts: 1,
                gave_up: GaveUp::Exhausted,
                message,
            }),
        }
    }

    /// Refreshes the map unless another task already did since `seen`.
    async fn refresh_since(&self, seen: u64) {
        let _guard = self.inner.refresh.lock().await;
        if self.inner.generation.load(Ordering::Acquire) != seen {
            return;
        }
        if let Err(e) = self.cluster().await {
            tracing::debug!(error = %e, "refreshing the cluster map failed; keeping the old one");
        }
    }

    /// The map to route by: fetched on first use, refreshed when marked
    /// stale. `None` when no node answers (requests then go to the first
    /// server and fail there with a real error).
    async fn routing_map(&self) -> Option<Arc<ClusterMap>> {
        let seen = self.inner.generation.load(Ordering::Acquire);
        let cached = self.cached_map();
        if cached.is_none() || self.inner.stale.load(Ordering::Acquire) {
            self.refresh_since(seen).await;
            return self.cached_map();
        }
        cached
    }

    fn destination(&self, steer: &Steer, map: Option<&ClusterMap>) -> String {
        let fixed = || self.inner.servers[0].clone();
        if self.inner.routing == Routing::Fixed {
            return fixed();
        }
        let Some(map) = map else { return fixed() };
        let shard = match steer {
            Steer::Id(id) => Some(map.shard_of(*id)),
            Steer::Key(k) => Some(map.shard_of_key(k)),
            Steer::Any => None,
        };
        map.destination(shard).base
    }

    /// Where a request for `id` would be sent now (for diagnostics).
    pub async fn destination_of(&self, id: ExecutionId) -> String {
        let map = match self.inner.routing {
            Routing::Owner => self.routing_map().await,
            Routing::Fixed => None,
        };
        self.destination(&Steer::Id(id), map.as_deref())
    }

    // -----------------------------------------------------------------
    // Sending

    async fn attempt(
        &self,
        base: &str,
        method: &Method,
        path: &str,
        body: Option<&Bytes>,
        timeout: Duration,
    ) -> Attempt {
        let uri = format!("{base}{path}");
        let mut b = Request::builder().method(method.clone()).uri(&uri);
        if body.is_some() {
            b = b.header(http::header::CONTENT_TYPE, "application/json");
        }
        let req = match b.body(Full::new(body.cloned().unwrap_or_default())) {
            Ok(r) => r,
            Err(e) => {
                return Attempt::Failed {
                    executed: Executed::No,
                    message: format!("building the request for {uri}: {e}"),
                }
            }
        };
        let fut = async {
            let resp = self.inner.http.request(req).await.map_err(|e| {
                let executed = if e.is_connect() {
                    Executed::No
                } else {
                    Executed::Unknown
                };
                let mut msg = e.to_string();
                let mut src = std::error::Error::source(&e);
                while let Some(s) = src {
                    msg.push_str(": ");
                    msg.push_str(&s.to_string());
                    src = s.source();
                }
                (executed, msg)
            })?;
            let status = resp.status();
            let header = |name: &str| {
                resp.headers()
                    .get(name)
                    .and_then(|v| v.to_str().ok())
                    .map(str::to_string)
            };
            let retry_after = header("retry-after")
                .as_deref()
                .and_then(retry::parse_retry_after);
            let map_version = header(MAP_VERSION_HEADER).and_then(|v| v.parse().ok());
            let body = http_body_util::Limited::new(resp.into_body(), MAX_ANSWER_BYTES)
                .collect()
                .await
                .map_err(|e| {
                    (
                        Executed::Unknown,
                        format!("reading the answer (HTTP {status}): {e}"),
                    )
                })?
                .to_bytes();
            Ok::<_, (Executed, String)>(Attempt::Answered {
                status,
                retry_after,
                map_version,
                body,
            })
        };
        match tokio::time::timeout(timeout, fut).await {
            Ok(Ok(a)) => a,
            Ok(Err((executed, message))) => Attempt::Failed { executed, message },
            Err(_) => Attempt::Failed {
                executed: Executed::Unknown,
                message: format!("no answer within {} ms", timeout.as_millis()),
            },
        }
    }

    /// Sends one call: routes it, follows `not_owner` once, retries what
    /// is safe to retry.
    async fn execute(&self, call: Call) -> Result<Answer, Error> {
        let started = Instant::now();
        let timeout = self.inner.request_timeout + call.extra_timeout;
        let mut attempts: u32 = 0;
        let mut followed_hint = false;
        let mut next: Option<String> = None;
        loop {
            let base = match next.take() {
                Some(b) => b,
                None => {
                    let map = match self.inner.routing {
                        Routing::Owner => self.routing_map().await,
                        Routing::Fixed => None,
                    };
                    self.destination(&call.steer, map.as_deref())
                }
            };
            // The map this attempt was routed by: a 421 refreshes past it.
            let seen = self.inner.generation.load(Ordering::Acquire);
            attempts += 1;
            let outcome = self
                .attempt(&base, &call.method, &call.path, call.body.as_ref(), timeout)
                .await;
            let (failure, err) = match outcome {
                Attempt::Answered {
                    status,
                    body,
                    map_version,
                    ..
                } if status.is_success() => {
                    if let (Some(v), Some(m)) = (map_version, self.cached_map()) {
                        if v > m.map_version {
                            self.inner.stale.store(true, Ordering::Release);
                        }
                    }
                    return Ok(Answer { status, body });
                }
                Attempt::Answered {
                    status,
                    body,
                    retry_after,
                    ..
                } => {
                    let err = Error::from_response(status.as_u16(), &body, retry_after);
                    match &err {
                        Error::NotOwner { owner_hint, .. }
                            if self.inner.routing == Routing::Owner && !followed_hint =>
                        {
                            followed_hint = true;
                            tracing::debug!(%base, hint = ?owner_hint, "not_owner: refreshing the map and following the hint");
                            self.refresh_since(seen).await;
                            next = owner_hint.as_deref().and_then(|h| normalize_base(h).ok());
                            continue;
                        }
                        // Refused again after the hint was followed, by a
                        // replicated shard: its leadership is moving (an
                        // election, a transfer). Nothing was executed, so
                        // it is tried again by a fresh map, within the
                        // retry policy. (In a static cluster it is two
                        // maps that disagree, which waiting does not
                        // mend: returned at once.)
                        Error::NotOwner { shard, .. }
                            if self.inner.routing == Routing::Owner && self.replicated(*shard) =>
                        {
                            (
                                Failure {
                                    executed: Executed::No,
                                    idempotent: call.idempotent,
                                    retry_after,
                                },
                                err,
                            )
                        }
                        Error::OwnerUnavailable { executed, .. } => (
                            Failure {
                                executed: *executed,
                                idempotent: call.idempotent,
                                retry_after,
                            },
                            err,
                        ),
                        _ => return Err(err),
                    }
                }
                Attempt::Failed { executed, message } => (
                    Failure {
                        executed,
                        idempotent: call.idempotent,
                        retry_after: None,
                    },
                    Error::Transport {
                        address: base.clone(),
                        executed,
                        attempts,
                        gave_up: GaveUp::Exhausted,
                        message,
                    },
                ),
            };
            // The owner may have moved or died: the next request (or retry)
            // routes by a fresh map.
            self.inner.stale.store(true, Ordering::Release);
            match self
                .inner
                .retry
                .decide(failure, attempts, started.elapsed())
            {
                Decision::Retry(wait) => {
                    tracing::debug!(%base, attempts, ?wait, error = %err, "retrying");
                    tokio::time::sleep(wait + jitter(wait)).await;
                }
                Decision::Unsafe => return Err(err.gave_up(attempts, GaveUp::UnsafeToRepeat)),
                Decision::Exhausted => return Err(err.gave_up(attempts, GaveUp::Exhausted)),
            }
        }
    }

    async fn json<T: serde::de::DeserializeOwned>(&self, call: Call) -> Result<T, Error> {
        let a = self.execute(call).await?;
        serde_json::from_slice(&a.body).map_err(|e| {
            Error::Protocol(format!(
                "HTTP {} answer does not have the expected shape: {e}",
                a.status
            ))
        })
    }

    fn body(v: &impl serde::Serialize) -> Result<Bytes, Error> {
        serde_json::to_vec(v)
            .map(Bytes::from)
            .map_err(|e| Error::Config(format!("encoding the request: {e}")))
    }

    // -----------------------------------------------------------------
    // The API

    /// Starts an execution. Idempotent (and retried) when it carries an
    /// idempotency key; steered to the routing key's shard when it has one.
    pub async fn start(&self, req: &StartExecution) -> Result<Execution, Error> {
        self.json(Call {
            method: Method::POST,
            path: "/api/executions".into(),
            body: Some(Self::body(req)?),
            steer: match req.steering_key() {
                Some(k) => Steer::Key(k.to_string()),
                None => Steer::Any,
            },
            idempotent: req.idempotency_key.is_some(),
            extra_timeout: Duration::ZERO,
        })
        .await
    }

    /// Appends events. Retried after an unknown outcome only when every
    /// event carries an idempotency key.
    pub async fn append(&self, id: ExecutionId, req: &AppendEvents) -> Result<Appended, Error> {
        self.append_raw(id, Self::body(req)?, req.is_idempotent())
            .await
    }

    /// Appends a pre-encoded `AppendEvents` body. `idempotent` must be true
    /// only if every event in it carries an idempotency key.
    pub async fn append_raw(
        &self,
        id: ExecutionId,
        body: Bytes,
        idempotent: bool,
    ) -> Result<Appended, Error> {
        self.json(Call {
            method: Method::POST,
            path: format!("/api/executions/{id}/events"),
            body: Some(body),
            steer: Steer::Id(id),
            idempotent,
            extra_timeout: Duration::ZERO,
        })
        .await
    }

    /// Moves every replica node `node` holds to other nodes (`to`, or
    /// where each shard's leader picks), by Raft membership changes, one
    /// shard at a time: the server's report, each shard listed, with
    /// `complete` false if one could not be moved (asking again goes on).
    /// A replicated cluster's placement of every shard's replicas, as its
    /// groups were made with (`GET /api/cluster/placement`).
    pub async fn placement(&self) -> Result<serde_json::Value, Error> {
        self.json(Call {
            method: Method::GET,
            path: "/api/cluster/placement".into(),
            body: None,
            steer: Steer::Any,
            idempotent: true,
            extra_timeout: Duration::ZERO,
        })
        .await
    }

    /// Asks the node this client sends to (the first server, with
    /// [`Routing::Fixed`]) to read its cluster file again and take the
    /// nodes it gained.
    pub async fn reload_cluster(&self) -> Result<serde_json::Value, Error> {
        self.json(Call {
            method: Method::POST,
            path: "/api/cluster/reload".into(),
            body: None,
            steer: Steer::Any,
            // Reading the same file twice adds nothing the second time.
            idempotent: true,
            extra_timeout: Duration::ZERO,
        })
        .await
    }

    /// Drains (`drain` true) or undrains the node this client sends to
    /// (with [`Routing::Fixed`]): drained, it takes no leadership and
    /// hands the shards it leads to other replicas (`POST
    /// /api/cluster/drain`, `/api/cluster/undrain`).
    pub async fn drain_node(&self, drain: bool) -> Result<serde_json::Value, Error> {
        self.json(Call {
            method: Method::POST,
            path: if drain {
                "/api/cluster/drain"
            } else {
                "/api/cluster/undrain"
            }
            .into(),
            body: None,
            steer: Steer::Any,
            // Asked twice, the second hands over only what the first
            // left led there.
            idempotent: true,
            // The handover's own bound (2 s) on top of the request's.
            extra_timeout: Duration::from_secs(3),
        })
        .await
    }

    /// Asks the node this client sends to (with [`Routing::Fixed`]) to
    /// trust its new replica of `shard` as caught up: an operator's
    /// override for a shard that cannot elect while a replica it needs is
    /// gone for good (`POST /api/shards/{shard}/trust`).
    pub async fn trust_replica(&self, shard: u32) -> Result<serde_json::Value, Error> {
        self.json(Call {
            method: Method::POST,
            path: format!("/api/shards/{shard}/trust"),
            body: Some(Self::body(&serde_json::json!({ "accept_loss": true }))?),
            steer: Steer::Any,
            // Asked again, a trusted replica answers that it is not new.
            idempotent: false,
            extra_timeout: Duration::ZERO,
        })
        .await
    }

    pub async fn remove_node(
        &self,
        node: u16,
        to: Option<u16>,
    ) -> Result<serde_json::Value, Error> {
        self.json(Call {
            method: Method::POST,
            path: "/api/cluster/remove-node".into(),
            body: Some(Self::body(&serde_json::json!({ "node": node, "to": to }))?),
            steer: Steer::Any,
            // Asked again, it goes on where it stopped.
            idempotent: true,
            extra_timeout: REMOVE_NODE_WITHIN,
        })
        .await
    }

    pub async fn signal(&self, id: ExecutionId, req: &Signal) -> Result<EventWritten, Error> {
        self.json(Call {
            method: Method::POST,
            path: format!("/api/executions/{id}/signals"),
            body: Some(Self::body(req)?),
            steer: Steer::Id(id),
            idempotent: req.idempotency_key.is_some(),
            extra_timeout: Duration::ZERO,
        })
        .await
    }

    pub async fn cancel(&self, id: ExecutionId, req: &Cancel) -> Result<EventWritten, Error> {
        self.json(Call {
            method: Method::POST,
            path: format!("/api/executions/{id}/cancel"),
            body: Some(Self::body(req)?),
            steer: Steer::Id(id),
            idempotent: req.idempotency_key.is_some(),
            extra_timeout: Duration::ZERO,
        })
        .await
    }

    pub async fn get(&self, id: ExecutionId) -> Result<Execution, Error> {
        self.json(Call {
            method: Method::GET,
            path: format!("/api/executions/{id}"),
            body: None,
            steer: Steer::Id(id),
            idempotent: true,
            extra_timeout: Duration::ZERO,
        })
        .await
    }

    /// Reads a page of events; with `wait`, long-polls for the first new one
    /// (answers early when the execution is closed).
    pub async fn read_events(&self, id: ExecutionId, r: ReadEvents) -> Result<EventsPage, Error> {
        let mut path = format!("/api/executions/{id}/events?after={}", r.after);
        if let Some(l) = r.limit {
            path.push_str(&format!("&limit={l}"));
        }
        let wait = r.wait.unwrap_or(Duration::ZERO);
        if !wait.is_zero() {
            path.push_str(&format!("&wait_ms={}", wait.as_millis()));
        }
        self.json(Call {
            method: Method::GET,
            path,
            body: None,
            steer: Steer::Id(id),
            idempotent: true,
            extra_timeout: wait,
        })
        .await
    }

    /// The executions started with a routing key.
    pub async fn find_by_key(&self, key: &str) -> Result<KeyLookup, Error> {
        self.json(Call {
            method: Method::GET,
            path: format!("/api/keys/{}", encode_segment(key)),
            body: None,
            steer: Steer::Key(key.to_string()),
            idempotent: true,
            extra_timeout: Duration::ZERO,
        })
        .await
    }
}

/// Up to 10% extra wait, so clients that failed together do not retry in
/// lockstep.
fn jitter(wait: Duration) -> Duration {
    let nanos = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.subsec_nanos())
        .unwrap_or(0);
    wait.mul_f64(f64::from(nanos % 1000) / 10_000.0)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn server_urls_are_normalised() {
        assert_eq!(
            normalize_base("http://127.0.0.1:7070/").ok().as_deref(),
            Some("http://127.0.0.1:7070")
        );
        assert_eq!(
            normalize_base("127.0.0.1:7070").ok().as_deref(),
            Some("http://127.0.0.1:7070")
        );
        assert!(matches!(
            normalize_base("https://x:1"),
            Err(Error::Config(_))
        ));
        assert!(matches!(
            normalize_base("http://x:1/api"),
            Err(Error::Config(_))
        ));
        assert!(matches!(normalize_base(""), Err(Error::Config(_))));
    }

    #[test]
    fn keys_are_percent_encoded() {
        assert_eq!(encode_segment("tenant-a/order 1"), "tenant-a%2Forder%201");
        assert_eq!(encode_segment("é?#"), "%C3%A9%3F%23");
    }

    #[test]
    fn jitter_is_small() {
        let w = Duration::from_secs(1);
        assert!(jitter(w) <= Duration::from_millis(100));
    }
}
