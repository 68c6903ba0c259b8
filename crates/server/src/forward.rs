//! One-hop forwarding to a shard's owner over pooled HTTP/1.1 connections.
//!
//! **Invariant:** a failed forward is never a local write. Every failure
//! (refused, timed out, an answer that is not the owner's own, a body that
//! does not decode) becomes `503 owner_unavailable`, and the caller returns
//! it without touching its own store.
//!
//! Why not hyper's pooled client: it runs every connection as a task of its
//! own, so a forward crossed two more task hand-offs (request in, answer
//! out) and hyper's header maps both ways. At 64 clients through a
//! non-owner node that made the forwarding node spend about 40 us of CPU
//! per event, twice what an append sent straight to its owner costs there
//! (BENCHMARKS.md, "The forwarding path, rebuilt"). Here the forwarding
//! task itself writes the request in one buffer and reads the answer with
//! `httparse` (hyper's own parser) on a connection it takes from the pool
//! for the length of the exchange. The peer is another forkless node, which
//! answers every request with a `Content-Length` body; an answer framed any
//! other way is not one this relays.

use crate::error::{ApiError, Executed};
use crate::{HOPS_HEADER, NODE_HEADER, PEER_TOKEN_HEADER};
use axum::response::{IntoResponse, Response};
use bytes::{Bytes, BytesMut};
use forkless_routing::OwnerHint;
use http::{HeaderName, HeaderValue, Method, StatusCode};
use std::collections::{HashMap, VecDeque};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::{Duration, Instant};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;
use tokio::sync::{OwnedSemaphorePermit, Semaphore};

/// Largest owner answer a forwarder relays (a full page of events plus room).
pub(crate) const FORWARD_RESPONSE_BYTES_MAX: usize = 64 * 1024 * 1024;
/// Largest answer a probe reads.
const PROBE_RESPONSE_BYTES_MAX: usize = 1024 * 1024;
/// An answer's head longer than this is not an answer of a forkless node.
const ANSWER_HEAD_BYTES_MAX: usize = 16 * 1024;
/// Header lines an answer may have.
const ANSWER_HEADERS_MAX: usize = 32;
/// Idle connections kept per peer (and never more than its share: see
/// [`share`]).
const IDLE_PER_PEER_MAX: usize = 256;
/// Of a node's peer connections (`limits.connections_max`), how many
/// each peer leaves for its probes: one in flight, and one it gave up on
/// that the node has not seen closed yet.
const PROBE_RESERVE: usize = 2;
/// An idle connection older than this is closed rather than reused.
const IDLE_TIMEOUT: Duration = Duration::from_secs(30);
/// Room made in an answer's read buffer before each read.
const READ_CHUNK: usize = 4 * 1024;

pub struct Forwarder {
    secret: HeaderValue,
    connect_timeout: Duration,
    /// This node's `limits.connections_max`: what [`share`] divides,
    /// or the peer's when that is lower ([`Forwarder::peer_says`]).
    connections_max: usize,
    /// Each peer's `limits.connections_max` as its last status said, by
    /// peer address.
    peer_limits: Mutex<HashMap<String, usize>>,
    /// [`IDLE_TIMEOUT`] (a field so that tests can age connections).
    idle_timeout: Duration,
    /// Idle keep-alive connections by peer address, oldest first (each
    /// goes in at the back when it is put back, so the ages are in order):
    /// forwards' and probes' apart, so that a probe neither takes nor
    /// opens one of the connections the forwards' share counts.
    idle: [Mutex<HashMap<String, VecDeque<Idle>>>; 2],
    /// Each peer's share of connections, by peer address.
    shares: Mutex<HashMap<String, Arc<PeerShare>>>,
}

/// Which of a forwarder's idle pools a connection belongs to.
#[derive(Debug, Clone, Copy)]
enum Pool {
    Forwards = 0,
    Probes = 1,
}

/// How many connections this node may hold to one peer's peer address,
/// from that peer's `limits.connections_max` (the lower of its own, as
/// its status says, and this node's: [`Forwarder::peer_says`]) shared
/// evenly among its `peers` peers (its peers taken to be as many as this
/// node's), less [`PROBE_RESERVE`] each. Held this way, forwards
/// through every other node at once (idle pooled connections counted)
/// cannot fill a node's peer listener, and every peer's probe still gets
/// in: a node whose clients send many long-polls through its peers is not
/// taken for dead by them. Of the share, at most half may wait (a
/// long-poll, a replica move: requests that hold their connection for up
/// to `limits.wait_ms_max` or a move's catch-up), so that short requests
/// always find connections: a share of one connection forwards none
/// (`connections_max` under four times the peers; the node warns of it
/// at start).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Share {
    pub connections: usize,
    pub waiting: usize,
}

pub(crate) fn share(connections_max: usize, peers: usize) -> Share {
    let peers = peers.max(1);
    let connections = (connections_max.saturating_sub(PROBE_RESERVE * peers) / peers).max(1);
    Share {
        connections,
        waiting: connections / 2,
    }
}

/// What this node holds of one peer's share: a permit per connection in
/// use, and one more per waiting request.
struct PeerShare {
    share: Share,
    connections: Arc<Semaphore>,
    waiting: Arc<Semaphore>,
}

/// A forward's hold on its peer's share, for the length of its exchange.
struct Held {
    _connection: OwnedSemaphorePermit,
    _waiting: Option<OwnedSemaphorePermit>,
}

struct Idle {
    tcp: TcpStream,
    since: Instant,
}

pub struct ForwardRequest<'a> {
    pub method: Method,
    pub path_and_query: &'a str,
    pub body: Bytes,
    pub hops: u8,
    pub timeout: Duration,
    pub shard: u32,
    /// How many peers this node has (what its share of a peer's
    /// connections is reckoned with: [`share`]).
    pub peers: usize,
    /// The request waits at its owner (a long-poll, a replica move):
    /// counted against the share's `waiting` part.
    pub waits: bool,
    /// How long it may wait for a connection of the share, before its
    /// `timeout` starts (then 503, not sent).
    pub queue_within: Duration,
    /// A page of events: the room this node has for its answer
    /// ([`crate::ANSWER_ROOM_HEADER`]).
    pub answer_room: Option<usize>,
}

/// How long after a forwarded write's forwarder gave up on it (its
/// timeout, a connection broken after the request left) its owner may
/// still hold the connection: a write runs to its end there, whoever
/// waits for it, and is bounded by the store's
/// [`forkless_store::WRITE_WITHIN`]. The forward's place in its share is
/// kept that long, so that forwards given up on cannot add up at the
/// owner past the share. (A read is dropped by its owner once its
/// connection closes: nothing is kept.)
const WRITE_OUTLIVES_ITS_FORWARD: Duration =
    Duration::from_secs(forkless_store::WRITE_WITHIN.as_secs() + 1);

/// A peer's answer, read in full.
struct Answer {
    status: StatusCode,
    /// The headers a forwarder relays, and the node header.
    headers: Vec<(HeaderName, HeaderValue)>,
    body: Bytes,
}

/// Why an exchange with a peer failed.
#[derive(Debug)]
enum Failure {
    /// The request did not leave this node in full: the peer cannot have
    /// acted on it.
    NotSent(String),
    /// The request was sent; whether the peer acted on it is unknown.
    Unknown(String),
}

/// Whether a header of the owner's answer is relayed to the client (the
/// node header among them). Names are compared ignoring case.
fn relayed(name: &str) -> bool {
    const PREFIX: &str = "x-forkless-";
    name.get(..PREFIX.len())
        .is_some_and(|p| p.eq_ignore_ascii_case(PREFIX))
        || name.eq_ignore_ascii_case("content-type")
        || name.eq_ignore_ascii_case("retry-after")
}

/// `name` as a header name: the ones every answer carries come from a
/// table of constants (no allocation per answer), any other is parsed.
fn header_name(name: &str) -> Option<HeaderName> {
    use crate::headers::route_header as route;
    const KNOWN: [HeaderName; 9] = [
        http::header::CONTENT_TYPE,
        HeaderName::from_static(NODE_HEADER),
        route::HOPS,
        route::PARTITION,
        route::SHARD,
        route::OWNER,
        route::EPOCH,
        route::MAP_VERSION,
        http::header::RETRY_AFTER,
    ];
    KNOWN
        .iter()
        .find(|k| k.as_str().eq_ignore_ascii_case(name))
        .cloned()
        .or_else(|| HeaderName::from_bytes(name.as_bytes()).ok())
}

impl Forwarder {
    pub fn new(connect_timeout: Duration, secret: &str, connections_max: usize) -> Forwarder {
        let secret = HeaderValue::from_str(secret).unwrap_or_else(|_| HeaderValue::from_static(""));
        Forwarder {
            secret,
            connect_timeout,
            connections_max,
            idle_timeout: IDLE_TIMEOUT,
            idle: Default::default(),
            shares: Mutex::new(HashMap::new()),
            peer_limits: Mutex::new(HashMap::new()),
        }
    }

    /// Records the `limits.connections_max` the peer at `addr` runs with
    /// (its status says it): its share is reckoned with the lower of that
    /// and this node's own from the next forward on.
    pub(crate) fn peer_says(&self, addr: &str, connections_max: usize) {
        let mut limits = self.peer_limits.lock().unwrap_or_else(|p| p.into_inner());
        match limits.get_mut(addr) {
            Some(said) => *said = connections_max,
            None => {
                limits.insert(addr.to_string(), connections_max);
            }
        }
    }

    /// What this node's share of the peer at `addr` is reckoned with: the
    /// lower of its own `limits.connections_max` and the one the peer
    /// last said (its own until it said one). The peer's, because the
    /// share is of its listener; never more than this node's, because this
    /// node's descriptors for forwards are counted with its own.
    fn limit_for(&self, addr: &str) -> usize {
        let limits = self.peer_limits.lock().unwrap_or_else(|p| p.into_inner());
        limits.get(addr).map_or(self.connections_max, |&theirs| {
            theirs.min(self.connections_max)
        })
    }

    /// This node's share of the connections of the peer at `addr`, made
    /// anew when it changes (a reload changed the number of peers, or the
    /// peer said another `limits.connections_max`): forwards holding the
    /// old one finish on it.
    fn peer_share(&self, addr: &str, peers: usize) -> Arc<PeerShare> {
        let want = share(self.limit_for(addr), peers);
        let mut shares = self.shares.lock().unwrap_or_else(|p| p.into_inner());
        if let Some(s) = shares.get(addr).filter(|s| s.share == want) {
            return s.clone();
        }
        let s = Arc::new(PeerShare {
            share: want,
            connections: Arc::new(Semaphore::new(want.connections)),
            waiting: Arc::new(Semaphore::new(want.waiting)),
        });
        shares.insert(addr.to_string(), s.clone());
        s
    }

    /// A hold on this node's share of `owner`'s connections: a waiting
    /// request over the share's `waiting` part is refused at once (503
    /// `too_many_forwards`); any other waits up to `req.queue_within` for
    /// a connection another forward is done with.
    async fn hold(&self, owner: &OwnerHint, req: &ForwardRequest<'_>) -> Result<Held, ApiError> {
        let s = self.peer_share(&owner.peer_addr, req.peers);
        let waiting = if req.waits {
            match s.waiting.clone().try_acquire_owned() {
                Ok(p) => Some(p),
                Err(_) if s.share.waiting == 0 => {
                    return Err(ApiError::Overloaded {
                        code: "too_many_forwards",
                        message: format!(
                            "this node forwards no requests that wait (long-polls, replica moves) to node {}: its share of that node's peer connections ((limits.connections_max, the lower of the two nodes', - 2 x {peers}) / {peers} peers) is one connection, kept for short requests; send it to node {} itself, or raise limits.connections_max on both to at least {}",
                            owner.node, owner.node, 4 * req.peers.max(1), peers = req.peers.max(1)
                        ),
                        limit: 0,
                    })
                }
                Err(_) => {
                    return Err(ApiError::Overloaded {
                        code: "too_many_forwards",
                        message: format!(
                            "this node forwards {} requests that wait (long-polls, replica moves) to node {} already: half its share of that node's peer connections ((limits.connections_max, the lower of the two nodes', - 2 x {peers}) / {peers} peers, {} connections); retry later, through another node, or read without wait_ms",
                            s.share.waiting, owner.node, s.share.connections, peers = req.peers.max(1)
                        ),
                        limit: s.share.waiting,
                    })
                }
            }
        } else {
            None
        };
        let queued = s.connections.clone().acquire_owned();
        match tokio::time::timeout(req.queue_within, queued).await {
            Ok(Ok(connection)) => Ok(Held {
                _connection: connection,
                _waiting: waiting,
            }),
            // (Never closed: a forwarder's semaphores live as long as it.)
            Ok(Err(_)) | Err(_) => Err(ApiError::OwnerUnavailable {
                shard: req.shard,
                executed: Executed::No,
                reason: format!(
                    "node {}: this node's {} connections to it (its share of that node's peer connections: (limits.connections_max, the lower of the two nodes', - 2 x {peers}) / {peers} peers) were all in use for {} ms; nothing was sent",
                    owner.node,
                    s.share.connections,
                    req.queue_within.as_millis(),
                    peers = req.peers.max(1),
                ),
                hint: Some(owner.clone()),
            }),
        }
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
        let (mut hops, mut room) = (itoa::Buffer::new(), itoa::Buffer::new());
        let mut head = vec![
            ("content-type", b"application/json".as_slice()),
            (HOPS_HEADER, hops.format(req.hops).as_bytes()),
            (PEER_TOKEN_HEADER, self.secret.as_bytes()),
        ];
        if let Some(r) = req.answer_room {
            head.push((crate::ANSWER_ROOM_HEADER, room.format(r).as_bytes()));
        }
        let request = encode_request(
            &req.method,
            req.path_and_query,
            &owner.peer_addr,
            &head,
            &req.body,
        )
        .map_err(|e| fail(Executed::No, e))?;
        let held = self.hold(owner, &req).await?;
        let answer = tokio::time::timeout(
            req.timeout,
            self.exchange(
                Pool::Forwards,
                &owner.peer_addr,
                &request,
                FORWARD_RESPONSE_BYTES_MAX,
            ),
        )
        .await;
        // A write given up on after it left (no answer in time, or its
        // connection broke) runs on at its owner: its place in the share
        // is kept as long as it may.
        let left_unanswered = matches!(answer, Ok(Err(Failure::Unknown(_))) | Err(_));
        if left_unanswered && req.method != Method::GET {
            // (A move, which waits at its owner, is bounded there by its
            // own time, which its timeout covers.)
            let kept = WRITE_OUTLIVES_ITS_FORWARD.max(req.timeout);
            tokio::spawn(async move {
                tokio::time::sleep(kept).await;
                drop(held);
            });
        } else {
            drop(held);
        }
        let answer = match answer {
            Ok(Ok(a)) => a,
            Ok(Err(Failure::NotSent(e))) => {
                return Err(fail(
                    Executed::No,
                    format!("node {} at {}: {e}", owner.node, owner.peer_addr),
                ))
            }
            Ok(Err(Failure::Unknown(e))) => {
                return Err(fail(
                    Executed::Unknown,
                    format!("node {} at {}: {e}", owner.node, owner.peer_addr),
                ))
            }
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
        let mut node = itoa::Buffer::new();
        let node = node.format(owner.node.get());
        let from_owner = answer
            .headers
            .iter()
            .any(|(n, v)| n == NODE_HEADER && v.as_bytes() == node.as_bytes());
        if !from_owner {
            return Err(fail(
                Executed::Unknown,
                format!(
                    "answer ({}) did not come from node {}",
                    answer.status, owner.node
                ),
            ));
        }
        if serde_json::from_slice::<serde::de::IgnoredAny>(&answer.body).is_err() {
            return Err(fail(
                Executed::Unknown,
                format!(
                    "node {} answered {} with a body that is not JSON",
                    owner.node, answer.status
                ),
            ));
        }
        let mut resp = (answer.status, answer.body).into_response();
        let headers = resp.headers_mut();
        headers.reserve(answer.headers.len());
        for (name, value) in answer.headers {
            headers.insert(name, value);
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
        let request = encode_request(
            &Method::GET,
            path,
            peer_addr,
            &[(PEER_TOKEN_HEADER, self.secret.as_bytes())],
            &[],
        )?;
        let r = tokio::time::timeout(
            timeout,
            self.exchange(Pool::Probes, peer_addr, &request, PROBE_RESPONSE_BYTES_MAX),
        )
        .await;
        match r {
            Ok(Ok(a)) if a.status.is_success() => Ok(a.body),
            Ok(Ok(a)) => Err(format!("status {}", a.status)),
            Ok(Err(Failure::NotSent(e) | Failure::Unknown(e))) => Err(e),
            Err(_) => Err(format!("no answer within {} ms", timeout.as_millis())),
        }
    }

    /// Sends `request` to `addr` and reads the answer, on an idle
    /// connection to `addr` if there is one, else a new one. A connection
    /// goes back to the pool only after a complete answer with nothing
    /// after it; one dropped mid-exchange (the caller's timeout) is closed.
    async fn exchange(
        &self,
        pool: Pool,
        addr: &str,
        request: &[u8],
        limit: usize,
    ) -> Result<Answer, Failure> {
        let sent_on_idle = match self.take_idle(pool, addr) {
            // A failed write means the peer closed it while it was idle;
            // the request did not leave in full, so a new connection may
            // carry it.
            Some(mut tcp) => tcp.write_all(request).await.is_ok().then_some(tcp),
            None => None,
        };
        let mut tcp = match sent_on_idle {
            Some(tcp) => tcp,
            None => {
                let mut tcp = self.connect(addr).await?;
                send(&mut tcp, request).await?;
                tcp
            }
        };
        let (answer, reusable) = read_answer(&mut tcp, limit).await?;
        if reusable {
            self.put_idle(pool, addr, tcp);
        }
        Ok(answer)
    }

    async fn connect(&self, addr: &str) -> Result<TcpStream, Failure> {
        let tcp = tokio::time::timeout(self.connect_timeout, TcpStream::connect(addr))
            .await
            .map_err(|_| {
                Failure::NotSent(format!(
                    "connecting: no connection within {} ms",
                    self.connect_timeout.as_millis()
                ))
            })?
            .map_err(|e| Failure::NotSent(format!("connecting: {e}")))?;
        let _ = tcp.set_nodelay(true);
        Ok(tcp)
    }

    fn idle(&self, pool: Pool) -> MutexGuard<'_, HashMap<String, VecDeque<Idle>>> {
        self.idle[pool as usize]
            .lock()
            .unwrap_or_else(|p| p.into_inner())
    }

    /// The newest idle connection to `addr` that is still open and quiet.
    fn take_idle(&self, pool: Pool, addr: &str) -> Option<TcpStream> {
        let mut idle = self.idle(pool);
        let conns = idle.get_mut(addr)?;
        while let Some(c) = conns.pop_back() {
            if c.since.elapsed() >= self.idle_timeout {
                // Every older one is older still.
                conns.clear();
                return None;
            }
            // An idle connection has nothing to read: end of stream (the
            // peer closed it, or died) or stray bytes both retire it. Asked
            // of the socket itself, not of the runtime's readiness, which
            // learns of a close only when its reactor next turns.
            let mut probe = [std::mem::MaybeUninit::<u8>::uninit()];
            match socket2::SockRef::from(&c.tcp).peek(&mut probe) {
                Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => return Some(c.tcp),
                _ => continue,
            }
        }
        None
    }

    fn put_idle(&self, pool: Pool, addr: &str, tcp: TcpStream) {
        let mut idle = self.idle(pool);
        let conns = match idle.get_mut(addr) {
            Some(c) => c,
            None => idle.entry(addr.to_string()).or_default(),
        };
        // Connections idle too long are closed here, from the oldest: the
        // pool is taken from the newest end, so under steady traffic (the
        // probes alone put one back every interval) the old end would
        // never be looked at otherwise.
        while conns
            .front()
            .is_some_and(|c| c.since.elapsed() >= self.idle_timeout)
        {
            conns.pop_front();
        }
        if conns.len() >= IDLE_PER_PEER_MAX {
            // Keep the newest; the oldest is the first to time out anyway.
            conns.pop_front();
        }
        conns.push_back(Idle {
            tcp,
            since: Instant::now(),
        });
    }
}

/// Writes the request on a connection just made for it.
async fn send(tcp: &mut TcpStream, request: &[u8]) -> Result<(), Failure> {
    // Not all of it was taken by the socket, so the peer cannot have all of
    // it, and it acts only on a whole request.
    tcp.write_all(request)
        .await
        .map_err(|e| Failure::NotSent(format!("sending: {e}")))
}

/// The request's bytes: request line, `host`, `headers`, a
/// `content-length` when there is a body, then the body.
fn encode_request(
    method: &Method,
    path_and_query: &str,
    host: &str,
    headers: &[(&str, &[u8])],
    body: &[u8],
) -> Result<Vec<u8>, String> {
    // The target and host come from a parsed URI and the cluster file;
    // anything that could break the request line is refused, not sent.
    let clean = |s: &str| s.bytes().all(|b| b.is_ascii_graphic());
    if !path_and_query.starts_with('/') || !clean(path_and_query) || !clean(host) {
        return Err(format!("cannot forward to {host} for {path_and_query:?}"));
    }
    let mut out = Vec::with_capacity(256 + body.len());
    out.extend_from_slice(method.as_str().as_bytes());
    out.push(b' ');
    out.extend_from_slice(path_and_query.as_bytes());
    out.extend_from_slice(b" HTTP/1.1\r\nhost: ");
    out.extend_from_slice(host.as_bytes());
    out.extend_from_slice(b"\r\n");
    for (name, value) in headers {
        out.extend_from_slice(name.as_bytes());
        out.extend_from_slice(b": ");
        out.extend_from_slice(value);
        out.extend_from_slice(b"\r\n");
    }
    if !body.is_empty() || *method == Method::POST {
        let mut n = itoa::Buffer::new();
        out.extend_from_slice(b"content-length: ");
        out.extend_from_slice(n.format(body.len()).as_bytes());
        out.extend_from_slice(b"\r\n");
    }
    out.extend_from_slice(b"\r\n");
    out.extend_from_slice(body);
    Ok(out)
}

/// Reads one answer: a head, then exactly `Content-Length` bytes of body.
/// Also says whether the connection may carry another request (keep-alive,
/// and nothing arrived past the answer).
async fn read_answer(tcp: &mut TcpStream, limit: usize) -> Result<(Answer, bool), Failure> {
    let unknown = Failure::Unknown;
    let mut buf = BytesMut::with_capacity(READ_CHUNK);
    let (head_len, status, headers, body_len, keep_alive) = loop {
        if let Some(head) = parse_head(&buf, limit)? {
            break head;
        }
        if buf.len() >= ANSWER_HEAD_BYTES_MAX {
            return Err(unknown(format!(
                "answer head longer than {ANSWER_HEAD_BYTES_MAX} bytes"
            )));
        }
        buf.reserve(READ_CHUNK);
        match tcp.read_buf(&mut buf).await {
            Ok(0) => {
                return Err(unknown(if buf.is_empty() {
                    "connection closed before an answer".into()
                } else {
                    "connection closed in the middle of the answer's head".into()
                }))
            }
            Ok(_) => {}
            Err(e) => return Err(unknown(format!("reading the answer: {e}"))),
        }
    };
    let total = head_len + body_len;
    while buf.len() < total {
        buf.reserve(total - buf.len());
        match tcp.read_buf(&mut buf).await {
            Ok(0) => {
                return Err(unknown(format!(
                    "connection closed after {} of the answer's {body_len} body bytes",
                    buf.len() - head_len
                )))
            }
            Ok(_) => {}
            Err(e) => return Err(unknown(format!("reading the answer: {e}"))),
        }
    }
    let reusable = keep_alive && buf.len() == total;
    let body = buf.freeze().slice(head_len..total);
    Ok((
        Answer {
            status,
            headers,
            body,
        },
        reusable,
    ))
}

type Head = (
    usize,
    StatusCode,
    Vec<(HeaderName, HeaderValue)>,
    usize,
    bool,
);

/// The answer's head at the start of `buf`, if it is all there: its
/// length, status, relayed headers, body length, and whether the
/// connection stays open after it.
fn parse_head(buf: &[u8], limit: usize) -> Result<Option<Head>, Failure> {
    let unknown = Failure::Unknown;
    let mut raw = [httparse::EMPTY_HEADER; ANSWER_HEADERS_MAX];
    let mut resp = httparse::Response::new(&mut raw);
    let head_len = match resp.parse(buf) {
        Ok(httparse::Status::Complete(n)) => n,
        Ok(httparse::Status::Partial) => return Ok(None),
        Err(e) => return Err(unknown(format!("the answer is not HTTP: {e}"))),
    };
    let status = resp
        .code
        .and_then(|c| StatusCode::from_u16(c).ok())
        .filter(|s| !s.is_informational())
        .ok_or_else(|| unknown("the answer has no final status".into()))?;
    let mut body_len = None;
    let mut keep_alive = resp.version == Some(1);
    let mut headers = Vec::with_capacity(8);
    for h in resp.headers.iter() {
        let name = h.name;
        if name.eq_ignore_ascii_case("content-length") {
            match (body_len, crate::headers::content_length(h.value)) {
                (None, Some(n)) => body_len = Some(n),
                _ => {
                    return Err(unknown(
                        "the answer's content-length is not one number".into(),
                    ))
                }
            }
        } else if name.eq_ignore_ascii_case("transfer-encoding") {
            return Err(unknown(
                "the answer is framed by transfer-encoding, not content-length".into(),
            ));
        } else if name.eq_ignore_ascii_case("connection") {
            keep_alive &= !h.value.eq_ignore_ascii_case(b"close");
        } else if relayed(name) {
            if let (Some(n), Ok(v)) = (header_name(name), HeaderValue::from_bytes(h.value)) {
                headers.push((n, v));
            }
        }
    }
    let bodiless = status == StatusCode::NO_CONTENT || status == StatusCode::NOT_MODIFIED;
    let body_len = match body_len {
        Some(n) if n > limit => {
            return Err(unknown(format!(
                "the answer's body of {n} bytes is over the {limit} relayed"
            )))
        }
        Some(n) => n,
        None if bodiless => 0,
        None => return Err(unknown("the answer has no content-length".into())),
    };
    Ok(Some((head_len, status, headers, body_len, keep_alive)))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn request_bytes() {
        let r = encode_request(
            &Method::POST,
            "/api/executions/7/events?x=1",
            "127.0.0.1:7700",
            &[("x-forkless-hops", b"1")],
            b"{}",
        )
        .unwrap();
        assert_eq!(
            r,
            b"POST /api/executions/7/events?x=1 HTTP/1.1\r\nhost: 127.0.0.1:7700\r\nx-forkless-hops: 1\r\ncontent-length: 2\r\n\r\n{}"
        );
        let g = encode_request(&Method::GET, "/readyz", "h:1", &[], &[]).unwrap();
        assert_eq!(g, b"GET /readyz HTTP/1.1\r\nhost: h:1\r\n\r\n");
        for bad in ["/a b", "/a\r\nx: y", "noslash"] {
            assert!(
                encode_request(&Method::GET, bad, "h:1", &[], &[]).is_err(),
                "{bad:?}"
            );
        }
        assert!(encode_request(&Method::GET, "/", "h:1\r\n", &[], &[]).is_err());
    }

    #[test]
    fn answer_heads() {
        let ok = b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nx-forkless-node: 3\r\ndate: x\r\ncontent-length: 2\r\n\r\n{}";
        let (len, status, headers, body, keep) = parse_head(ok, 100).unwrap().unwrap();
        assert_eq!(
            (len, status, body, keep),
            (ok.len() - 2, StatusCode::OK, 2, true)
        );
        let names: Vec<_> = headers.iter().map(|(n, _)| n.as_str()).collect();
        assert_eq!(names, ["content-type", "x-forkless-node"]);
        let other = b"HTTP/1.1 503 x\r\nX-Forkless-Something-New: 1\r\nRetry-After: 1\r\nx-other: 2\r\ncontent-length: 0\r\n\r\n";
        let (_, _, headers, _, _) = parse_head(other, 100).unwrap().unwrap();
        let names: Vec<_> = headers.iter().map(|(n, _)| n.as_str()).collect();
        assert_eq!(names, ["x-forkless-something-new", "retry-after"]);

        assert!(parse_head(b"HTTP/1.1 200 OK\r\ncontent-len", 100)
            .unwrap()
            .is_none());
        let close = b"HTTP/1.1 503 x\r\nconnection: close\r\ncontent-length: 0\r\n\r\n";
        assert!(!parse_head(close, 100).unwrap().unwrap().4);
        let old = b"HTTP/1.0 200 OK\r\ncontent-length: 0\r\n\r\n";
        assert!(!parse_head(old, 100).unwrap().unwrap().4);

        for bad in [
            &b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n"[..],
            b"HTTP/1.1 200 OK\r\n\r\n",
            b"HTTP/1.1 200 OK\r\ncontent-length: 2\r\ncontent-length: 2\r\n\r\n",
            b"HTTP/1.1 200 OK\r\ncontent-length: +2\r\n\r\n",
            b"HTTP/1.1 200 OK\r\ncontent-length: 101\r\n\r\n",
            b"HTTP/1.1 100 Continue\r\n\r\n",
            b"garbage\r\n\r\n",
        ] {
            assert!(
                matches!(parse_head(bad, 100), Err(Failure::Unknown(_))),
                "{}",
                String::from_utf8_lossy(bad)
            );
        }
    }

    /// Connections idle past the timeout are closed when another is put
    /// back, even though taking always finds a fresh one first; and the
    /// pool holds at most its bound, keeping the newest.
    #[tokio::test]
    async fn idle_connections_past_the_timeout_are_closed_and_the_pool_is_bounded() {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap().to_string();
        let mut f = Forwarder::new(Duration::from_secs(1), "0123456789abcdef", 1024);
        // Every connection is past a zero timeout as soon as it is idle.
        f.idle_timeout = Duration::ZERO;
        let old = TcpStream::connect(&addr).await.unwrap();
        let (mut old_peer, _) = listener.accept().await.unwrap();
        f.put_idle(Pool::Forwards, &addr, old);
        let fresh = TcpStream::connect(&addr).await.unwrap();
        let _fresh_peer = listener.accept().await.unwrap();
        f.put_idle(Pool::Forwards, &addr, fresh);
        assert_eq!(f.idle(Pool::Forwards)[&addr].len(), 1);
        // The aged connection was closed: its peer reads the end.
        let mut b = [0u8; 1];
        let n = tokio::time::timeout(Duration::from_secs(5), old_peer.read(&mut b))
            .await
            .expect("the aged connection was not closed")
            .unwrap();
        assert_eq!(n, 0);

        let f = Forwarder::new(Duration::from_secs(1), "0123456789abcdef", 1024);
        let mut peers = Vec::new();
        for _ in 0..IDLE_PER_PEER_MAX + 1 {
            let c = TcpStream::connect(&addr).await.unwrap();
            peers.push(listener.accept().await.unwrap().0);
            f.put_idle(Pool::Forwards, &addr, c);
        }
        assert_eq!(f.idle(Pool::Forwards)[&addr].len(), IDLE_PER_PEER_MAX);
        // The first one put back, the oldest, was the one let go.
        let n = tokio::time::timeout(Duration::from_secs(5), peers[0].read(&mut b))
            .await
            .expect("the oldest connection was not closed")
            .unwrap();
        assert_eq!(n, 0);
    }

    /// A peer that closed an idle connection is not reused, and the pool
    /// hands back a live one.
    #[tokio::test]
    async fn idle_connections_closed_by_the_peer_are_not_reused() {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap().to_string();
        let f = Forwarder::new(Duration::from_secs(1), "0123456789abcdef", 1024);
        let a = TcpStream::connect(&addr).await.unwrap();
        let (server_a, _) = listener.accept().await.unwrap();
        let b = TcpStream::connect(&addr).await.unwrap();
        let b_at = b.local_addr().unwrap();
        let (_server_b, _) = listener.accept().await.unwrap();
        f.put_idle(Pool::Forwards, &addr, b);
        f.put_idle(Pool::Forwards, &addr, a);
        drop(server_a);
        // Wait until the close has reached a (newest in the pool, so taken
        // first): then the pool must skip it and hand back b.
        let deadline = Instant::now() + Duration::from_secs(5);
        loop {
            let got = f
                .take_idle(Pool::Forwards, &addr)
                .expect("a live connection");
            let skipped_a = f
                .idle(Pool::Forwards)
                .get(&addr)
                .is_none_or(VecDeque::is_empty);
            if skipped_a {
                assert_eq!(got.local_addr().unwrap(), b_at);
                break;
            }
            // a was still taken as live: the FIN had not arrived yet.
            f.put_idle(Pool::Forwards, &addr, got);
            assert!(
                Instant::now() < deadline,
                "the close never reached the pool"
            );
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
    }
    #[test]
    fn a_peers_connections_are_shared_among_its_peers_less_their_probes() {
        let s = |c, p| {
            let s = share(c, p);
            (s.connections, s.waiting)
        };
        assert_eq!(s(1024, 2), (510, 255));
        assert_eq!(s(8, 2), (2, 1));
        assert_eq!(s(4, 1), (2, 1));
        // Never no connection, however many peers; one is kept for short
        // requests.
        assert_eq!(s(16, 100), (1, 0));
        assert_eq!(s(1024, 0), (1022, 511));
    }

    #[test]
    fn a_share_is_reckoned_with_the_lower_of_the_two_nodes_limits() {
        let f = Forwarder::new(Duration::from_secs(1), "0123456789abcdef", 1024);
        let (a, b) = ("127.0.0.1:1", "127.0.0.1:2");
        let of = |addr| f.peer_share(addr, 2).share;
        assert_eq!(of(a), share(1024, 2), "its own until the peer says");
        f.peer_says(a, 8);
        assert_eq!(of(a), share(8, 2), "the peer's, lower");
        assert_eq!(of(b), share(1024, 2), "another peer's is its own");
        f.peer_says(b, 4096);
        assert_eq!(of(b), share(1024, 2), "never more than its own");
        f.peer_says(a, 1024);
        assert_eq!(of(a), share(1024, 2), "made anew when the peer's changes");
    }

    /// A fake owner at `listener`: answers each request as node 1, once
    /// `go` lets it, counting the connections open at once.
    async fn slow_owner(
        listener: tokio::net::TcpListener,
        go: Arc<Semaphore>,
        open: Arc<std::sync::atomic::AtomicUsize>,
        most: Arc<std::sync::atomic::AtomicUsize>,
    ) {
        use std::sync::atomic::Ordering::SeqCst;
        loop {
            let (mut tcp, _) = listener.accept().await.unwrap();
            let (go, open, most) = (go.clone(), open.clone(), most.clone());
            most.fetch_max(open.fetch_add(1, SeqCst) + 1, SeqCst);
            tokio::spawn(async move {
                let mut buf = Vec::new();
                loop {
                    let mut b = [0u8; 1024];
                    let n = tcp.read(&mut b).await.unwrap_or(0);
                    if n == 0 {
                        break;
                    }
                    buf.extend_from_slice(&b[..n]);
                    if buf.windows(4).any(|w| w == b"\r\n\r\n") {
                        buf.clear();
                        go.acquire().await.unwrap().forget();
                        let a =
                            b"HTTP/1.1 200 OK\r\nx-forkless-node: 1\r\ncontent-length: 2\r\n\r\n{}";
                        if tcp.write_all(a).await.is_err() {
                            break;
                        }
                    }
                }
                open.fetch_sub(1, SeqCst);
            });
        }
    }

    /// Forwards to one peer hold at most this node's share of its
    /// connections: past it a short one waits for a connection another is
    /// done with (and fails closed, not sent, if none is in its timeout),
    /// and one that waits at its owner is refused at once past its part.
    #[tokio::test]
    async fn forwards_to_a_peer_hold_at_most_this_nodes_share_of_its_connections() {
        use std::sync::atomic::{AtomicUsize, Ordering::SeqCst};
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap().to_string();
        let go = Arc::new(Semaphore::new(0));
        let (open, most) = (Arc::new(AtomicUsize::new(0)), Arc::new(AtomicUsize::new(0)));
        tokio::spawn(slow_owner(listener, go.clone(), open.clone(), most.clone()));
        // Six connections, one peer: a share of four, two of them waiting.
        let f = Arc::new(Forwarder::new(
            Duration::from_secs(1),
            "0123456789abcdef",
            6,
        ));
        let owner = OwnerHint {
            node: forkless_types::NodeId::new(1).unwrap(),
            api_addr: addr.clone(),
            peer_addr: addr.clone(),
            epoch: forkless_types::Epoch(1),
        };
        let send = |waits: bool, timeout: Duration| {
            let (f, owner) = (f.clone(), owner.clone());
            tokio::spawn(async move {
                let req = ForwardRequest {
                    method: Method::GET,
                    path_and_query: "/x",
                    body: Bytes::new(),
                    hops: 1,
                    timeout,
                    shard: 0,
                    peers: 1,
                    waits,
                    queue_within: timeout,
                    answer_room: None,
                };
                f.forward(&owner, req).await.map(|r| r.status())
            })
        };
        let long = Duration::from_secs(30);
        let waiting: Vec<_> = (0..2).map(|_| send(true, long)).collect();
        // A third that waits is refused at once.
        let refused = send(true, long).await.unwrap().unwrap_err();
        assert!(
            matches!(
                refused,
                ApiError::Overloaded {
                    code: "too_many_forwards",
                    limit: 2,
                    ..
                }
            ),
            "{refused:?}"
        );
        // Six short ones: two get connections, four wait for one.
        let short: Vec<_> = (0..6).map(|_| send(false, long)).collect();
        let deadline = Instant::now() + Duration::from_secs(5);
        while open.load(SeqCst) < 4 {
            assert!(Instant::now() < deadline, "the share was not taken");
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
        // One whose timeout ends before a connection frees fails closed,
        // not sent.
        let failed = send(false, Duration::from_millis(200))
            .await
            .unwrap()
            .unwrap_err();
        assert!(
            matches!(
                failed,
                ApiError::OwnerUnavailable {
                    executed: Executed::No,
                    ..
                }
            ),
            "{failed:?}"
        );
        go.add_permits(1000);
        for h in waiting.into_iter().chain(short) {
            assert_eq!(h.await.unwrap().unwrap(), StatusCode::OK);
        }
        assert_eq!(most.load(SeqCst), 4, "connections open at once");
    }
    /// A write whose forward is given up on (no answer in its time) keeps
    /// its place in the share for as long as its owner may still hold
    /// it; a read given up on frees its place at once (its owner drops
    /// it when the connection closes).
    #[tokio::test]
    async fn a_write_given_up_on_keeps_its_place_in_the_share_a_read_does_not() {
        use std::sync::atomic::AtomicUsize;
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap().to_string();
        // The owner never answers.
        let go = Arc::new(Semaphore::new(0));
        let counts = (Arc::new(AtomicUsize::new(0)), Arc::new(AtomicUsize::new(0)));
        tokio::spawn(slow_owner(listener, go, counts.0, counts.1));
        // Three connections, one peer: a share of one.
        let f = Forwarder::new(Duration::from_secs(1), "0123456789abcdef", 3);
        let owner = OwnerHint {
            node: forkless_types::NodeId::new(1).unwrap(),
            api_addr: addr.clone(),
            peer_addr: addr.clone(),
            epoch: forkless_types::Epoch(1),
        };
        let req = |method| ForwardRequest {
            method,
            path_and_query: "/x",
            body: Bytes::new(),
            hops: 1,
            timeout: Duration::from_millis(100),
            shard: 0,
            peers: 1,
            waits: false,
            queue_within: Duration::from_millis(300),
            answer_room: None,
        };
        let unknown = |r: Result<Response, ApiError>| {
            matches!(
                r,
                Err(ApiError::OwnerUnavailable {
                    executed: Executed::Unknown,
                    ..
                })
            )
        };
        // A read times out; the next forward gets the connection's place
        // at once (and times out in turn).
        assert!(unknown(f.forward(&owner, req(Method::GET)).await));
        assert!(unknown(f.forward(&owner, req(Method::POST)).await));
        // The write's place is kept: the next waits its queue time out,
        // not sent.
        let r = f.forward(&owner, req(Method::GET)).await;
        assert!(
            matches!(
                r,
                Err(ApiError::OwnerUnavailable {
                    executed: Executed::No,
                    ..
                })
            ),
            "{r:?}"
        );
    }
}
