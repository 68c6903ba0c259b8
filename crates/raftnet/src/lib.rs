//! The Raft transport between forkless nodes: one TCP connection from
//! each node to each peer, carrying the calls of every shard's group
//! (`docs/replication.md`, "Many groups on two cores").
//!
//! ```text
//! frame     = len u32 (big-endian) | postcard(message)          (tokio-util's length-delimited codec)
//! to server = Hello { version, from, secret, placement } | Call { id, group, rpc }
//! to client = Welcome | Refused(reason) | Answer { id, result }
//! ```
//!
//! A connection begins with `Hello`, which carries the cluster secret and
//! a fingerprint of the placement the node's groups were made with
//! ([`Handshake`]); a server answers `Welcome` or `Refused` (and closes). A node's server
//! also refuses a peer that is not one of its cluster's nodes (retired, or
//! not in its file: [`Admit`]), at hello and at every call after, so a
//! node retired while it still runs gets no say in a group any more. Then the client
//! sends calls, each with an id of its own, and the server answers each
//! as its group does, in any order: a call is handed to its group on a
//! task of its own, so one slow group does not hold up another's
//! heartbeats. AppendEntries are the exception: a leader keeps several
//! of them unanswered to a follower (`forkless_store::APPENDS_IN_FLIGHT`),
//! so those of one group on one connection go in the order they came
//! through the group's lane (`Lanes`), one openraft stream, each handed
//! to the group without waiting for the answer to the one before.
//! What each side holds is bounded: calls in flight on a
//! connection ([`IN_FLIGHT_MAX`]), a frame's bytes ([`FRAME_BYTES_MAX`]),
//! connections a server holds that have not said hello
//! ([`AWAITING_HELLO_MAX`]: past it, the oldest from the address that
//! holds the most is closed) and that one peer holds ([`PER_PEER_MAX`]:
//! past it, the peer's quietest is closed), and the time a peer may take
//! to say hello ([`HELLO_WITHIN`]).
//!
//! A call that cannot be sent, or whose connection breaks before its
//! answer, is `Unreachable`; one not answered within its time is a
//! `Timeout`. Neither is ever an answer (a vote not heard is not granted).

pub mod balance;
pub mod quiesce;

use bytes::Bytes;
use forkless_store::{Answer, CallError, Peers, RaftAppend, Rpc, RpcReply, ShardStore};
use futures_util::future::BoxFuture;
use futures_util::{SinkExt, StreamExt};
use serde::{Deserialize, Serialize};
use std::collections::{BTreeMap, HashMap, VecDeque};
use std::sync::{Arc, Mutex};
use std::time::Duration;
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::{mpsc, oneshot, watch, OwnedSemaphorePermit, Semaphore};
use tokio::time::Instant;
use tokio_util::codec::{Framed, LengthDelimitedCodec};

/// The protocol's version: a peer that says another is refused.
pub const PROTOCOL_VERSION: u32 = 8;
/// The most bytes one frame may hold. An AppendEntries carries at most
/// openraft's `max_payload_entries` entries of at most a round's budget
/// each; a frame over this closes the connection.
pub const FRAME_BYTES_MAX: usize = 80 << 20;
// A frame holds the longest AppendEntries the store sends: its byte
// budget plus the one entry that may go over it.
const _: () = assert!(
    FRAME_BYTES_MAX
        >= forkless_store::APPEND_BYTES_MAX + forkless_store::GROUP_COMMIT_BYTES_MAX + (1 << 20)
);

/// Calls one connection holds in flight, on either side; over it a call
/// is refused at once (`Unreachable`), and a server stops reading until
/// one is answered.
pub const IN_FLIGHT_MAX: usize = 1024;
/// Connections a node's Raft listener holds that have not said hello
/// yet. One more closes the oldest of those from the address that holds
/// the most: anyone who reaches the port can open connections and say
/// nothing for [`HELLO_WITHIN`], and a peer's, which says hello at once,
/// must still get in. (Before, 256 connections of any kind were held and
/// the next refused: 256 silent ones shut the peers out for 5 s at a
/// time.) A flood of new connections from many addresses can still close
/// a peer's before its hello is read, as for any TCP service: the Raft
/// address belongs on the cluster's own network.
pub const AWAITING_HELLO_MAX: usize = 64;
/// Connections a node's Raft listener holds from one peer (that said
/// hello, was welcome). A node keeps one connection to each peer and
/// makes another only once it gave that one up; a connection it gave up
/// while the two were cut off may never be seen closed here (its close
/// was lost), so a peer's connection past this closes the one of its
/// others that read a frame longest ago (a live one reads the peer's
/// heartbeats), at once, its calls in flight unanswered. (Before, such
/// connections stayed for good, counted against the listener's 256:
/// enough partitions healed and the listener refused every peer.)
pub const PER_PEER_MAX: usize = 2;
/// How long a new connection may take to say hello.
pub const HELLO_WITHIN: Duration = Duration::from_secs(5);
/// How long a connect and its handshake may take.
const CONNECT_WITHIN: Duration = Duration::from_secs(1);
/// After a failed connect, calls to that peer fail at once for this long
/// instead of each trying again.
const RETRY_CONNECT_AFTER: Duration = Duration::from_millis(100);

#[derive(Debug, Serialize, Deserialize)]
enum ToServer {
    Hello {
        version: u32,
        from: u64,
        secret: String,
        placement: u64,
    },
    Call {
        id: u64,
        group: u32,
        rpc: Rpc,
    },
}

#[derive(Debug, Serialize, Deserialize)]
enum ToClient {
    Welcome,
    Refused(String),
    Answer {
        id: u64,
        result: Result<RpcReply, String>,
    },
}

/// The largest hello (and answer to one) a node reads: a connection is
/// read with this bound until its hello is answered welcome, and with
/// [`FRAME_BYTES_MAX`] after. A hello is a few dozen bytes; before, a
/// connection that knew no secret could announce an 80 MiB hello and have
/// the node reserve room for it (and wait for its bytes), on each of the
/// listener's connections.
pub const HELLO_BYTES_MAX: usize = 64 << 10;

/// The codec of a connection before its hello is answered welcome.
fn codec() -> LengthDelimitedCodec {
    LengthDelimitedCodec::builder()
        .max_frame_length(HELLO_BYTES_MAX)
        .new_codec()
}

fn encode<T: Serialize>(msg: &T) -> Result<Bytes, String> {
    postcard::to_stdvec(msg)
        .map(Bytes::from)
        .map_err(|e| format!("encoding a Raft message: {e}"))
}

fn decode<'a, T: Deserialize<'a>>(bytes: &'a [u8]) -> Result<T, String> {
    postcard::from_bytes(bytes).map_err(|e| format!("a malformed Raft message: {e}"))
}

/// Compares secrets in time that does not depend on where they differ.
fn same_secret(a: &str, b: &str) -> bool {
    let (a, b) = (a.as_bytes(), b.as_bytes());
    a.len() == b.len() && a.iter().zip(b).fold(0u8, |acc, (x, y)| acc | (x ^ y)) == 0
}

type Reply = oneshot::Sender<Result<RpcReply, CallError>>;
type Outgoing = (u32, Rpc, Reply);

/// What a node says at a connection's hello, and what its server takes
/// from a peer's: the cluster's secret, and a fingerprint of the
/// placement its groups were made with (each shard's first membership).
/// A peer whose placement differs is refused: its groups were (or would
/// be) made with another membership, and two such replicas of one shard
/// could elect a leader of their own (a fork; `docs/replication.md`,
/// "Adding a node: the placement is pinned first"). The start-up check
/// refuses such a node before it opens a replica, but only against a
/// record or a peer that answers; this check holds for every call.
#[derive(Debug, Clone)]
pub struct Handshake {
    pub secret: String,
    pub placement: u64,
}

impl Handshake {
    /// A handshake with the secret alone (placement 0): for a transport
    /// whose every node is made the same way (tests, tools).
    pub fn secret(secret: String) -> Handshake {
        Handshake {
            secret,
            placement: 0,
        }
    }
}

/// This node's connections to its peers: [`Peers`] for the store.
#[derive(Clone)]
pub struct Links {
    inner: Arc<Inner>,
}

struct Inner {
    me: u64,
    hello: Handshake,
    /// Grows when a node is added at run time ([`Links::add_peer`]).
    links: std::sync::RwLock<BTreeMap<u64, Arc<Link>>>,
    /// The runtime the connections are made and run on (the caller's when
    /// `None`): a socket is driven by the runtime it was made on.
    runtime: Option<tokio::runtime::Handle>,
}

struct Link {
    addr: String,
    conn: tokio::sync::Mutex<Conn>,
}

impl Link {
    /// A link to `addr`, its connection made at the first call.
    fn to(addr: String) -> Arc<Link> {
        Arc::new(Link {
            addr,
            conn: tokio::sync::Mutex::new(Conn::default()),
        })
    }
}

#[derive(Default)]
struct Conn {
    tx: Option<mpsc::Sender<Outgoing>>,
    /// The last connect that failed, and why.
    failed: Option<(Instant, String)>,
    /// When this node last logged that the peer refused it at hello.
    refusal_said: Option<Instant>,
}

impl Links {
    /// Connections from node `me` to each of `peers` (id → Raft address),
    /// made when first needed and again after one breaks.
    pub fn new(me: u64, secret: String, peers: impl IntoIterator<Item = (u64, String)>) -> Links {
        Links::on(me, Handshake::secret(secret), peers, None)
    }

    /// [`Links::new`], each connection made and run on `runtime` (the
    /// groups' own, so that openraft's calls and their answers stay on
    /// its threads, whoever made the connection first), or on the
    /// caller's runtime when `None`.
    pub fn on(
        me: u64,
        hello: Handshake,
        peers: impl IntoIterator<Item = (u64, String)>,
        runtime: Option<tokio::runtime::Handle>,
    ) -> Links {
        let links = peers
            .into_iter()
            .filter(|(id, _)| *id != me)
            .map(|(id, addr)| (id, Link::to(addr)))
            .collect();
        Links {
            inner: Arc::new(Inner {
                me,
                hello,
                links: std::sync::RwLock::new(links),
                runtime,
            }),
        }
    }

    /// What this node says at hello (and so what its server takes from a
    /// peer's).
    pub fn handshake(&self) -> Handshake {
        self.inner.hello.clone()
    }

    /// Adds a peer the cluster file gained while this node ran (`forkless
    /// cluster reload`). A peer already known keeps its address (an
    /// address changes only with a restart); returns whether it was added.
    pub fn add_peer(&self, id: u64, addr: String) -> bool {
        if id == self.inner.me {
            return false;
        }
        let mut links = self.inner.links.write().unwrap_or_else(|e| e.into_inner());
        match links.entry(id) {
            std::collections::btree_map::Entry::Occupied(_) => false,
            std::collections::btree_map::Entry::Vacant(v) => {
                v.insert(Link::to(addr));
                true
            }
        }
    }

    /// Points the link to a known peer at its new address (the cluster
    /// file moved it): a new connection is made there at the next call,
    /// and the old one closes once the calls on it are done. Returns
    /// whether the link was made anew: not for an unknown peer (it is not
    /// added), nor for one already at `addr` (its working connection
    /// stays: the file moved only its other addresses).
    pub fn move_peer(&self, id: u64, addr: String) -> bool {
        let mut links = self.inner.links.write().unwrap_or_else(|e| e.into_inner());
        match links.get_mut(&id) {
            Some(link) if link.addr != addr => {
                *link = Link::to(addr);
                true
            }
            _ => false,
        }
    }

    /// Drops the link to a peer that retired from the cluster (`forkless
    /// cluster reload` of a file listing it in `retired_nodes`): its
    /// connection closes once the calls on it are done, and calls to it
    /// fail as to a node that is no peer. Returns whether there was one.
    pub fn remove_peer(&self, id: u64) -> bool {
        self.inner
            .links
            .write()
            .unwrap_or_else(|e| e.into_inner())
            .remove(&id)
            .is_some()
    }

    /// The peers this node has links to, in id order.
    pub fn peer_ids(&self) -> Vec<u64> {
        self.inner
            .links
            .read()
            .unwrap_or_else(|e| e.into_inner())
            .keys()
            .copied()
            .collect()
    }
}

impl Peers for Links {
    fn send(
        &self,
        target: u64,
        group: u32,
        rpc: Rpc,
        within: Duration,
    ) -> BoxFuture<'static, Result<Answer, CallError>> {
        let inner = self.inner.clone();
        Box::pin(async move {
            let deadline = Instant::now() + within;
            // In order: the link's lock is taken in turn, and the
            // connection's task writes its calls as they were queued.
            let tx = inner.sender(target, deadline).await?;
            let (reply, answer) = oneshot::channel();
            tx.try_send((group, rpc, reply)).map_err(|e| {
                CallError::Unreachable(match e {
                    mpsc::error::TrySendError::Full(_) => format!(
                        "node {target} has {IN_FLIGHT_MAX} calls waiting to be sent (it does not read)"
                    ),
                    mpsc::error::TrySendError::Closed(_) => {
                        format!("the connection to node {target} closed")
                    }
                })
            })?;
            let answer: Answer = Box::pin(async move {
                match tokio::time::timeout_at(deadline, answer).await {
                    Err(_) => Err(CallError::Timeout),
                    Ok(Err(_)) => Err(CallError::Unreachable(format!(
                        "the connection to node {target} broke before its answer"
                    ))),
                    Ok(Ok(r)) => r,
                }
            });
            Ok(answer)
        })
    }

    fn link_down(&self, target: u64) -> bool {
        let Some(link) = self.inner.link(target) else {
            return true;
        };
        // Held while a call takes the connection, or while one is made:
        // not known.
        let Ok(conn) = link.conn.try_lock() else {
            return false;
        };
        match &conn.tx {
            // Its task ends when the socket breaks (a peer killed resets
            // it at once).
            Some(tx) => tx.is_closed(),
            None => conn.failed.is_some(),
        }
    }
}

impl Inner {
    fn link(&self, target: u64) -> Option<Arc<Link>> {
        self.links
            .read()
            .unwrap_or_else(|e| e.into_inner())
            .get(&target)
            .cloned()
    }

    /// The connection to `target`, made now if there is none.
    async fn sender(
        &self,
        target: u64,
        deadline: Instant,
    ) -> Result<mpsc::Sender<Outgoing>, CallError> {
        let link = self.link(target).ok_or_else(|| {
            CallError::Unreachable(format!("node {target} is not a peer of this node"))
        })?;
        let mut conn = tokio::time::timeout_at(deadline, link.conn.lock())
            .await
            .map_err(|_| CallError::Timeout)?;
        if let Some(tx) = &conn.tx {
            if !tx.is_closed() {
                return Ok(tx.clone());
            }
        }
        conn.tx = None;
        if let Some((at, why)) = &conn.failed {
            if at.elapsed() < RETRY_CONNECT_AFTER {
                return Err(CallError::Unreachable(why.clone()));
            }
        }
        let within = deadline.min(Instant::now() + CONNECT_WITHIN);
        let (me, hello, addr) = (self.me, self.hello.clone(), link.addr.clone());
        let attempt = async move {
            let framed =
                tokio::time::timeout_at(within, connect(me, &hello, target, &addr)).await?;
            Ok::<_, tokio::time::error::Elapsed>(framed.map(|framed| {
                let (tx, rx) = mpsc::channel(IN_FLIGHT_MAX);
                tokio::spawn(run_client(framed, rx, target));
                tx
            }))
        };
        let outcome = match &self.runtime {
            // Aborted if this call is dropped (its caller gave up): a
            // connect nobody waits for must not go on beside the next
            // caller's, nor skip the pause after a failed one.
            Some(rt) => AbortOnDrop(rt.spawn(attempt)).await.unwrap_or_else(|e| {
                Ok(Err(Connect::failed(format!(
                    "connecting to node {target}: the connecting task ended: {e}"
                ))))
            }),
            None => attempt.await,
        };
        match outcome {
            Ok(Ok(tx)) => {
                conn.failed = None;
                conn.tx = Some(tx.clone());
                Ok(tx)
            }
            Ok(Err(Connect { why, refused })) => {
                // A refusal is the peer's word on this node (its secret,
                // protocol version, placement, or its place in the
                // cluster): said here too, once a minute, since this
                // node's groups cannot reach that peer until it changes.
                if refused
                    && conn
                        .refusal_said
                        .is_none_or(|at| at.elapsed() >= REFUSAL_SAID_EVERY)
                {
                    conn.refusal_said = Some(Instant::now());
                    tracing::warn!(peer = target, reason = %why, "a peer refused this node's Raft connection (said once a minute while it goes on)");
                }
                conn.failed = Some((Instant::now(), why.clone()));
                Err(CallError::Unreachable(why))
            }
            Err(_elapsed) => {
                let why = format!(
                    "connecting to node {target} at {} took over {} ms",
                    link.addr,
                    within.saturating_duration_since(Instant::now()).as_millis()
                );
                conn.failed = Some((Instant::now(), why.clone()));
                Err(CallError::Unreachable(why))
            }
        }
    }
}

/// A spawned task, aborted when this is dropped before it finished.
struct AbortOnDrop<T>(tokio::task::JoinHandle<T>);

impl<T> std::future::Future for AbortOnDrop<T> {
    type Output = Result<T, tokio::task::JoinError>;
    fn poll(
        mut self: std::pin::Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
    ) -> std::task::Poll<Self::Output> {
        std::pin::Pin::new(&mut self.0).poll(cx)
    }
}

impl<T> Drop for AbortOnDrop<T> {
    fn drop(&mut self) {
        self.0.abort();
    }
}

/// Why a connect failed, and whether the peer refused this node at
/// hello (rather than not being reached).
struct Connect {
    why: String,
    refused: bool,
}

impl Connect {
    fn failed(why: String) -> Connect {
        Connect {
            why,
            refused: false,
        }
    }
}

impl From<String> for Connect {
    fn from(why: String) -> Connect {
        Connect::failed(why)
    }
}

/// A connection to node `target` at `addr`, its hello answered welcome.
async fn connect(
    me: u64,
    hello: &Handshake,
    target: u64,
    addr: &str,
) -> Result<Framed<TcpStream, LengthDelimitedCodec>, Connect> {
    let tcp = TcpStream::connect(addr)
        .await
        .map_err(|e| format!("connecting to node {target} at {addr}: {e}"))?;
    let _ = tcp.set_nodelay(true);
    let mut framed = Framed::new(tcp, codec());
    let hello = encode(&ToServer::Hello {
        version: PROTOCOL_VERSION,
        from: me,
        secret: hello.secret.clone(),
        placement: hello.placement,
    })?;
    framed
        .send(hello)
        .await
        .map_err(|e| format!("saying hello to node {target}: {e}"))?;
    match framed.next().await {
        Some(Ok(b)) => match decode::<ToClient>(&b)? {
            ToClient::Welcome => {
                framed.codec_mut().set_max_frame_length(FRAME_BYTES_MAX);
                Ok(framed)
            }
            ToClient::Refused(why) => Err(Connect {
                why: format!("node {target} refused this node: {why}"),
                refused: true,
            }),
            other => Err(format!("node {target} answered hello with {other:?}").into()),
        },
        Some(Err(e)) => Err(format!("node {target}'s answer to hello: {e}").into()),
        None => Err(format!("node {target} closed the connection at hello").into()),
    }
}

/// One connection's client side: sends the calls handed to it, and gives
/// each answer to its caller. Ends when the connection breaks (every call
/// in flight then fails as unreachable) or every sender is gone.
async fn run_client(
    framed: Framed<TcpStream, LengthDelimitedCodec>,
    mut calls: mpsc::Receiver<Outgoing>,
    target: u64,
) {
    let (mut sink, mut stream) = framed.split();
    let mut pending: HashMap<u64, Reply> = HashMap::new();
    let mut next_id = 0u64;
    let why = loop {
        tokio::select! {
            call = calls.recv() => {
                let Some((group, rpc, reply)) = call else { break None };
                if pending.len() >= IN_FLIGHT_MAX {
                    // Callers that gave up (timed out) leave their slot.
                    pending.retain(|_, r| !r.is_closed());
                }
                if pending.len() >= IN_FLIGHT_MAX {
                    let _ = reply.send(Err(CallError::Unreachable(format!(
                        "node {target} has {IN_FLIGHT_MAX} calls unanswered"
                    ))));
                    continue;
                }
                next_id += 1;
                let frame = match encode(&ToServer::Call { id: next_id, group, rpc }) {
                    Ok(f) => f,
                    Err(e) => {
                        let _ = reply.send(Err(CallError::Remote(e)));
                        continue;
                    }
                };
                pending.insert(next_id, reply);
                if let Err(e) = sink.feed(frame).await {
                    break Some(format!("writing: {e}"));
                }
                if calls.is_empty() {
                    if let Err(e) = sink.flush().await {
                        break Some(format!("writing: {e}"));
                    }
                }
            }
            frame = stream.next() => {
                let bytes = match frame {
                    None => break Some("the peer closed the connection".into()),
                    Some(Err(e)) => break Some(format!("reading: {e}")),
                    Some(Ok(b)) => b,
                };
                match decode::<ToClient>(&bytes) {
                    Ok(ToClient::Answer { id, result }) => {
                        if let Some(reply) = pending.remove(&id) {
                            let _ = reply.send(result.map_err(CallError::Remote));
                        }
                    }
                    Ok(other) => break Some(format!("an unexpected message: {other:?}")),
                    Err(e) => break Some(e),
                }
            }
        }
    };
    if let Some(why) = why {
        tracing::info!(peer = target, calls_in_flight = pending.len(), reason = %why, "Raft connection to a peer closed");
    }
}

/// Where a server finds the shard a call is for.
pub type Groups = Arc<dyn Fn(u32) -> Option<Arc<ShardStore>> + Send + Sync>;

/// The replicated shards this node holds now, looked up again each round
/// by the tasks that go over them (a group the store's supervisor
/// restarted is a new `ShardStore`; the one it replaced must not be held).
pub type Hosted = Arc<dyn Fn() -> Vec<Arc<ShardStore>> + Send + Sync>;

/// Opens this node's replica of a shard it holds none of, for a leader
/// that replicates to it (a replica added by a membership change, or one
/// whose data directory was lost): `None` if it cannot.
pub type Join = Arc<dyn Fn(u32) -> Option<Arc<ShardStore>> + Send + Sync>;

/// What a node makes of a peer's heartbeat naming the groups it leads:
/// `(peer, [(shard, term)])` (a node holding no replica of a shard
/// learns its leader so; a later term wins).
pub type Told = Arc<dyn Fn(u64, &[(u32, u64)]) + Send + Sync>;

/// What a node's Raft server does beyond handing calls to its groups.
#[derive(Clone, Default)]
pub struct Hooks {
    /// Opens a replica of a shard this node holds none of, for a leader
    /// that replicates to it; `None` refuses such calls.
    pub join: Option<Join>,
    /// Told the groups each peer leads, at every beat of its heartbeat.
    pub told: Option<Told>,
}

/// Whether a peer (by its node id) may talk to this node's groups now:
/// `Err` says why not (it was retired, or is not in this node's cluster
/// file). Asked at hello and at every call, since a reload may retire a
/// peer whose connection is open.
pub type Admit = Arc<dyn Fn(u64) -> Result<(), String> + Send + Sync>;

/// Serves the Raft calls of peers on `listener` until `stop` turns true,
/// from any peer that knows the secret.
pub async fn serve(
    listener: TcpListener,
    secret: String,
    groups: Groups,
    stop: watch::Receiver<bool>,
) {
    let anyone: Admit = Arc::new(|_| Ok(()));
    serve_node(
        listener,
        Handshake::secret(secret),
        groups,
        Hooks::default(),
        anyone,
        stop,
    )
    .await
}

/// [`serve`] for a node: only peers `admit` lets in are served, and a
/// call that replicates to a shard this node holds no replica of
/// (AppendEntries, a snapshot's chunk) first opens one with `hooks.join`
/// (in the background: the call is refused meanwhile, and the leader
/// sends it again); each peer's heartbeat is told to `hooks.told`.
pub async fn serve_node(
    listener: TcpListener,
    hello: Handshake,
    groups: Groups,
    hooks: Hooks,
    admit: Admit,
    mut stop: watch::Receiver<bool>,
) {
    let joins = Arc::new(Joins {
        join: hooks.join,
        opening: Mutex::default(),
    });
    let told = hooks.told;
    let held = Arc::new(Held::default());
    let refusals = Arc::new(Refusals::default());
    let hello = Arc::new(hello);
    loop {
        let accepted = tokio::select! {
            r = listener.accept() => r,
            _ = stop.wait_for(|s| *s) => return,
        };
        let (tcp, from) = match accepted {
            Ok(a) => a,
            Err(e) => {
                tracing::warn!(error = %e, "accepting a Raft connection failed");
                tokio::time::sleep(Duration::from_millis(100)).await;
                continue;
            }
        };
        let _ = tcp.set_nodelay(true);
        let slot = Held::arrived(&held, from.ip());
        let (refusals, hello, groups, joins, told, admit, stop) = (
            refusals.clone(),
            hello.clone(),
            groups.clone(),
            joins.clone(),
            told.clone(),
            admit.clone(),
            stop.clone(),
        );
        tokio::spawn(async move {
            match serve_connection(tcp, &slot, &hello, groups, joins, told, admit, stop).await {
                Ok(()) => {}
                Err(Closed::Unwelcomed(why)) => {
                    tracing::debug!(%from, reason = %why, "closed a Raft connection that said no hello")
                }
                // Such a node tries again and again: said once a minute.
                Err(Closed::NotAPeer { node, why }) if refusals.first_in_a_while(node) => {
                    tracing::warn!(%from, node, reason = %why, "refused the Raft calls of a node that is not a peer (said once a minute while it goes on)")
                }
                Err(Closed::NotAPeer { node, why }) => {
                    tracing::debug!(%from, node, reason = %why, "refused the Raft calls of a node that is not a peer")
                }
                Err(Closed::Other(why)) => {
                    tracing::info!(%from, reason = %why, "Raft connection from a peer closed")
                }
            }
            drop(slot);
        });
    }
}

/// The connections a Raft listener holds, as [`AWAITING_HELLO_MAX`] and
/// [`PER_PEER_MAX`] bound them: each with the signal that closes it.
#[derive(Default)]
struct Held {
    state: Mutex<HeldState>,
    /// What [`Slot::read`] counts from.
    since: std::sync::OnceLock<Instant>,
}

#[derive(Default)]
struct HeldState {
    next: u64,
    /// Connections that have not said hello, oldest first, with the
    /// address each came from.
    awaiting: VecDeque<(u64, std::net::IpAddr, Arc<tokio::sync::Notify>)>,
    /// Each peer's connections.
    peers: HashMap<u64, Vec<Welcomed>>,
    /// When closing connections that said no hello was last logged.
    awaiting_said: Option<Instant>,
}

/// A peer's connection: its id, when it last read a frame (ms from
/// [`Held::since`]), and its close signal.
type Welcomed = (
    u64,
    Arc<std::sync::atomic::AtomicU64>,
    Arc<tokio::sync::Notify>,
);

/// One connection's place in [`Held`], given up when dropped.
struct Slot {
    held: Arc<Held>,
    id: u64,
    /// Signalled when the connection is to close to make room.
    close: Arc<tokio::sync::Notify>,
    /// When it last read a frame, in ms from [`Held::since`].
    last_read: Arc<std::sync::atomic::AtomicU64>,
}

impl Held {
    fn lock(&self) -> std::sync::MutexGuard<'_, HeldState> {
        self.state.lock().unwrap_or_else(|e| e.into_inner())
    }

    fn now_ms(&self) -> u64 {
        let since = self.since.get_or_init(Instant::now);
        u64::try_from(since.elapsed().as_millis()).unwrap_or(u64::MAX)
    }

    /// A new connection from `from`, awaiting its hello. With
    /// [`AWAITING_HELLO_MAX`] awaiting already, the oldest of those from
    /// the address that holds the most of them is closed: a flood from
    /// one address closes its own, not a peer's that just came.
    fn arrived(held: &Arc<Held>, from: std::net::IpAddr) -> Slot {
        let close = Arc::new(tokio::sync::Notify::new());
        let mut st = held.lock();
        let id = st.next;
        st.next += 1;
        if st.awaiting.len() >= AWAITING_HELLO_MAX {
            let mut counts: HashMap<std::net::IpAddr, usize> = HashMap::new();
            for (_, ip, _) in &st.awaiting {
                *counts.entry(*ip).or_default() += 1;
            }
            // (Ties: the address of the oldest connection, by the order
            // below.)
            let most = counts.values().copied().max().unwrap_or(0);
            let at = st
                .awaiting
                .iter()
                .position(|(_, ip, _)| counts.get(ip) == Some(&most));
            if let Some((_, _, oldest)) = at.and_then(|at| st.awaiting.remove(at)) {
                oldest.notify_one();
            }
            let now = Instant::now();
            if st
                .awaiting_said
                .is_none_or(|at| now.duration_since(at) >= REFUSAL_SAID_EVERY)
            {
                st.awaiting_said = Some(now);
                tracing::warn!(
                    limit = AWAITING_HELLO_MAX,
                    "more Raft connections awaiting their hello than held: closing the oldest from the address that holds the most (said once a minute while it goes on)"
                );
            }
        }
        st.awaiting.push_back((id, from, close.clone()));
        Slot {
            held: held.clone(),
            id,
            close,
            last_read: Arc::new(std::sync::atomic::AtomicU64::new(held.now_ms())),
        }
    }
}

impl Slot {
    /// The connection said hello as `peer` and is welcome: counted as
    /// that peer's from now on. If the peer holds [`PER_PEER_MAX`]
    /// already, the one of them that read a frame longest ago is closed:
    /// a live connection reads the peer's heartbeats, one whose close a
    /// partition lost reads nothing. False if this one was closed
    /// meanwhile (no longer awaiting).
    fn welcomed(&self, peer: u64) -> bool {
        let mut st = self.held.lock();
        let Some(at) = st.awaiting.iter().position(|(id, _, _)| *id == self.id) else {
            return false;
        };
        st.awaiting.remove(at);
        let theirs = st.peers.entry(peer).or_default();
        while theirs.len() >= PER_PEER_MAX {
            let quietest = theirs
                .iter()
                .enumerate()
                .min_by_key(|(_, (_, read, _))| read.load(std::sync::atomic::Ordering::Relaxed))
                .map(|(i, _)| i);
            if let Some(i) = quietest {
                let (_, _, close) = theirs.swap_remove(i);
                close.notify_one();
            }
        }
        theirs.push((self.id, self.last_read.clone(), self.close.clone()));
        true
    }

    /// The connection read a frame.
    fn read(&self) {
        self.last_read
            .store(self.held.now_ms(), std::sync::atomic::Ordering::Relaxed);
    }
}

impl Drop for Slot {
    fn drop(&mut self) {
        let mut st = self.held.lock();
        st.awaiting.retain(|(id, _, _)| *id != self.id);
        st.peers.retain(|_, conns| {
            conns.retain(|(id, _, _)| *id != self.id);
            !conns.is_empty()
        });
    }
}

/// When each node that is not a peer was last said to be refused.
#[derive(Default)]
struct Refusals(Mutex<HashMap<u64, Instant>>);

impl Refusals {
    /// Whether `node`'s refusal is the first in a minute (and so is said).
    fn first_in_a_while(&self, node: u64) -> bool {
        let mut said = self.0.lock().unwrap_or_else(|e| e.into_inner());
        let now = Instant::now();
        // Bounded by the nodes that knew the secret and were refused in
        // the last minute.
        said.retain(|_, at| now.duration_since(*at) < REFUSAL_SAID_EVERY);
        match said.entry(node) {
            std::collections::hash_map::Entry::Occupied(_) => false,
            std::collections::hash_map::Entry::Vacant(v) => {
                v.insert(now);
                true
            }
        }
    }
}

/// How often a node that is not a peer and keeps calling is logged.
const REFUSAL_SAID_EVERY: Duration = Duration::from_secs(60);

/// The shards being opened for a leader that replicates to them.
/// How many replicas a node opens at once for leaders that replicate to
/// it ([`Joins::open`]).
const OPENING_MAX: usize = 16;

struct Joins {
    join: Option<Join>,
    opening: Mutex<std::collections::HashSet<u32>>,
}

impl Joins {
    /// For a call to `group`, which this node holds no replica of: opens
    /// one in the background if the call replicates to it, and says why
    /// the call is refused.
    fn refuse(self: &Arc<Self>, peer: u64, group: u32, rpc: &Rpc) -> String {
        let replicates = matches!(rpc, Rpc::AppendEntries(_) | Rpc::Snapshot(_));
        if !replicates || !self.open(peer, group) {
            return format!("this node holds no replica of shard {group}");
        }
        format!("this node is opening its replica of shard {group}; send it again")
    }

    /// Opens this node's replica of `group` in the background for its
    /// leader `peer`, unless one is being opened; false if this node opens
    /// none (no `join`). At most [`OPENING_MAX`] are opened at once: a
    /// peer whose calls name many groups (a beat names every group it
    /// leads that this node is a member of) waits for the next call for
    /// the rest, rather than have a blocking task queued for each.
    fn open(self: &Arc<Self>, peer: u64, group: u32) -> bool {
        let Some(join) = self.join.clone() else {
            return false;
        };
        let starts = {
            let mut opening = self.opening.lock().unwrap_or_else(|e| e.into_inner());
            opening.len() < OPENING_MAX && opening.insert(group)
        };
        if starts {
            let me = self.clone();
            tokio::task::spawn_blocking(move || {
                if join(group).is_some() {
                    tracing::info!(
                        shard = group,
                        leader = peer,
                        "a leader replicates to this node a shard it held no replica of: opened one"
                    );
                }
                me.opening
                    .lock()
                    .unwrap_or_else(|e| e.into_inner())
                    .remove(&group);
            });
        }
        true
    }
}

/// Why a peer's connection closed.
enum Closed {
    /// Closed before its hello, to make room ([`AWAITING_HELLO_MAX`]).
    Unwelcomed(String),
    /// The peer (`node`) is not (or no longer) one of this node's cluster.
    NotAPeer {
        node: u64,
        why: String,
    },
    Other(String),
}

impl From<String> for Closed {
    fn from(why: String) -> Closed {
        Closed::Other(why)
    }
}

#[allow(clippy::too_many_arguments)]
async fn serve_connection(
    tcp: TcpStream,
    slot: &Slot,
    hello: &Handshake,
    groups: Groups,
    joins: Arc<Joins>,
    told: Option<Told>,
    admit: Admit,
    mut stop: watch::Receiver<bool>,
) -> Result<(), Closed> {
    let mut framed = Framed::new(tcp, codec());
    let said = tokio::select! {
        said = tokio::time::timeout(HELLO_WITHIN, framed.next()) => said,
        () = slot.close.notified() => {
            return Err(Closed::Unwelcomed(format!(
                "{AWAITING_HELLO_MAX} newer connections awaited their hello"
            )))
        }
    };
    let said = match said {
        Err(_) => return Err(format!("no hello within {} s", HELLO_WITHIN.as_secs()).into()),
        Ok(None) => return Err(Closed::Other("closed before hello".into())),
        Ok(Some(Err(e))) => return Err(format!("reading hello: {e}").into()),
        Ok(Some(Ok(b))) => b,
    };
    let peer = match decode::<ToServer>(&said)? {
        ToServer::Hello {
            version,
            from,
            secret: theirs,
            placement,
        } => {
            // The secret first: who a peer says it is counts only once it
            // knows it.
            let refused = if version != PROTOCOL_VERSION {
                Some(Closed::Other(format!(
                    "protocol version {version}; this node speaks {PROTOCOL_VERSION}"
                )))
            } else if !same_secret(&theirs, &hello.secret) {
                Some(Closed::Other("wrong cluster secret".to_string()))
            } else if placement != hello.placement {
                Some(Closed::NotAPeer {
                    node: from,
                    why: format!(
                        "its groups' placement (fingerprint {placement:016x}) is not this node's ({:016x}): \
                         their cluster files place some shard's replicas on other nodes, and a replica made with \
                         another membership must not vote or replicate in this node's groups; compare \
                         `forkless cluster placement` on both nodes",
                        hello.placement
                    ),
                })
            } else {
                admit(from)
                    .err()
                    .map(|why| Closed::NotAPeer { node: from, why })
            };
            if let Some(closed) = refused {
                let (Closed::NotAPeer { why, .. } | Closed::Other(why) | Closed::Unwelcomed(why)) =
                    &closed;
                if let Ok(f) = encode(&ToClient::Refused(why.clone())) {
                    let _ = framed.send(f).await;
                }
                return Err(match closed {
                    Closed::Other(why) => Closed::Other(format!("refused node {from}: {why}")),
                    not_a_peer => not_a_peer,
                });
            }
            from
        }
        other => return Err(format!("a call before hello: {other:?}").into()),
    };
    if !slot.welcomed(peer) {
        return Err(Closed::Unwelcomed(format!(
            "node {peer}: {AWAITING_HELLO_MAX} newer connections awaited their hello"
        )));
    }
    framed
        .send(encode(&ToClient::Welcome)?)
        .await
        .map_err(|e| format!("answering hello: {e}"))?;
    framed.codec_mut().set_max_frame_length(FRAME_BYTES_MAX);
    let (mut sink, mut stream) = framed.split();
    let (out, mut answers) = mpsc::channel::<Bytes>(IN_FLIGHT_MAX);
    let writer = tokio::spawn(async move {
        while let Some(f) = answers.recv().await {
            if sink.feed(f).await.is_err() {
                return;
            }
            if answers.is_empty() && sink.flush().await.is_err() {
                return;
            }
        }
    });
    let permits = Arc::new(Semaphore::new(IN_FLIGHT_MAX));
    let mut lanes = Lanes {
        peer,
        groups: groups.clone(),
        joins: joins.clone(),
        out: out.clone(),
        lanes: HashMap::new(),
    };
    let ended = loop {
        let frame = tokio::select! {
            f = stream.next() => f,
            _ = stop.wait_for(|s| *s) => break Ok(()),
            () = slot.close.notified() => {
                // Closed at once, its calls in flight unanswered (the peer
                // takes them for unreachable), rather than once the
                // slowest is answered: the peer must see it close.
                writer.abort();
                return Err(format!(
                    "node {peer}: its newer connections replaced this one ({PER_PEER_MAX} held a peer)"
                )
                .into());
            }
        };
        let bytes = match frame {
            None => break Ok(()),
            Some(Err(e)) => break Err(format!("node {peer}: reading: {e}").into()),
            Some(Ok(b)) => b,
        };
        slot.read();
        let (id, group, rpc) = match decode::<ToServer>(&bytes) {
            Ok(ToServer::Call { id, group, rpc }) => (id, group, rpc),
            Ok(other) => break Err(format!("node {peer}: an unexpected message: {other:?}").into()),
            Err(e) => break Err(format!("node {peer}: {e}").into()),
        };
        // A reload may have retired the peer since its hello: its calls
        // in flight are answered, and the connection closes (a new one is
        // refused at hello).
        if let Err(why) = admit(peer) {
            break Err(Closed::NotAPeer { node: peer, why });
        }
        // Stops reading while IN_FLIGHT_MAX calls are unanswered.
        let Ok(permit) = permits.clone().acquire_owned().await else {
            break Ok(());
        };
        // AppendEntries go to their group in the order they came, each
        // without waiting for the answer to the one before: the leader
        // keeps several in flight (`forkless_store::APPENDS_IN_FLIGHT`).
        let rpc = match rpc {
            Rpc::AppendEntries(req) => {
                lanes.take(group, id, req, permit);
                continue;
            }
            rpc => rpc,
        };
        let (groups, joins, told, out) = (groups.clone(), joins.clone(), told.clone(), out.clone());
        tokio::spawn(async move {
            let result = match rpc {
                Rpc::Beat(beat) => {
                    if let Some(told) = &told {
                        told(peer, &beat.led);
                    }
                    let wake = quiesce::heard(peer, &beat, &groups);
                    // A group of this node's, led quietly by the peer, that
                    // it holds no replica of: opened (it then tells the
                    // leader it starts from nothing, which wakes it).
                    for shard in &beat.yours {
                        if groups(*shard).is_none() {
                            joins.open(peer, *shard);
                        }
                    }
                    let cannot_lead = beat
                        .led
                        .iter()
                        .map(|(s, _)| *s)
                        .filter(|s| groups(*s).is_none_or(|st| !st.takes_leadership()))
                        .collect();
                    Ok(RpcReply::Beat { cannot_lead, wake })
                }
                // Only a node itself says that its data directory is new.
                Rpc::Reverted { node } if node != peer => Err(format!(
                    "node {peer} spoke for node {node}: a node says only of itself that its data directory is new"
                )),
                rpc => match groups(group) {
                    Some(st) => st.handle_rpc(rpc).await,
                    None => Err(joins.refuse(peer, group, &rpc)),
                },
            };
            answer(out, id, result, permit).await;
        });
    };
    drop(lanes);
    drop(out);
    let _ = writer.await;
    ended
}

/// An AppendEntries taken off a connection: its id, the call, and its
/// place among the connection's calls in flight.
type LaneCall = (u64, RaftAppend, OwnedSemaphorePermit);

/// A connection's AppendEntries, one lane per group: each lane a task
/// that hands its group the calls in the order they came, as one
/// openraft stream (`ShardStore::append_stream`), and answers each once
/// the group has. A lane is made for a group this node holds when its
/// first call comes, and lasts as long as the connection: there are at
/// most as many as the shards this node holds.
struct Lanes {
    peer: u64,
    groups: Groups,
    joins: Arc<Joins>,
    out: mpsc::Sender<Bytes>,
    lanes: HashMap<u32, mpsc::UnboundedSender<LaneCall>>,
}

impl Lanes {
    fn take(&mut self, group: u32, id: u64, req: RaftAppend, permit: OwnedSemaphorePermit) {
        let mut call = (id, req, permit);
        if let Some(lane) = self.lanes.get(&group) {
            match lane.send(call) {
                Ok(()) => return,
                // Its task ended (it panicked): made again below.
                Err(mpsc::error::SendError(back)) => call = back,
            }
        }
        let (id, req, permit) = call;
        if self.groups.as_ref()(group).is_none() {
            // No lane for a group this node does not hold: a peer naming
            // groups cannot make this connection hold more.
            let why = self
                .joins
                .refuse(self.peer, group, &Rpc::AppendEntries(req));
            let out = self.out.clone();
            tokio::spawn(answer(out, id, Err(why), permit));
            return;
        }
        let (tx, rx) = mpsc::unbounded_channel();
        let lane = Lane {
            peer: self.peer,
            group,
            groups: self.groups.clone(),
            joins: self.joins.clone(),
            out: self.out.clone(),
            bound: None,
            waiting: VecDeque::new(),
        };
        tokio::spawn(lane.run(rx));
        // Unbounded: what it holds is bounded by the connection's permits.
        let _ = tx.send((id, req, permit));
        self.lanes.insert(group, tx);
    }
}

/// Sends one call's answer, then gives back its place.
async fn answer(
    out: mpsc::Sender<Bytes>,
    id: u64,
    result: Result<RpcReply, String>,
    permit: OwnedSemaphorePermit,
) {
    if let Ok(f) = encode(&ToClient::Answer { id, result }) {
        let _ = out.send(f).await;
    }
    drop(permit);
}

/// One group's lane on one connection ([`Lanes`]).
struct Lane {
    peer: u64,
    group: u32,
    groups: Groups,
    joins: Arc<Joins>,
    out: mpsc::Sender<Bytes>,
    /// The openraft stream the calls are fed to, and the shard it is of.
    bound: Option<Bound>,
    /// The calls fed to it and not yet answered, oldest first, and
    /// whether each carries entries.
    waiting: VecDeque<(u64, OwnedSemaphorePermit, bool)>,
}

struct Bound {
    store: std::sync::Weak<ShardStore>,
    input: mpsc::UnboundedSender<RaftAppend>,
    answers:
        futures_util::stream::BoxStream<'static, Result<forkless_store::RaftAppendAnswer, String>>,
}

impl Lane {
    async fn run(mut self, mut calls: mpsc::UnboundedReceiver<LaneCall>) {
        loop {
            tokio::select! {
                call = calls.recv() => match call {
                    Some((id, req, permit)) => self.feed(id, req, permit).await,
                    None => return,
                },
                a = next_answer(&mut self.bound) => self.answered(a).await,
            }
        }
    }

    async fn feed(&mut self, id: u64, req: RaftAppend, permit: OwnedSemaphorePermit) {
        let Some(st) = self.groups.as_ref()(self.group) else {
            self.unbind("this node no longer holds the shard").await;
            let why = self
                .joins
                .refuse(self.peer, self.group, &Rpc::AppendEntries(req));
            return answer(self.out.clone(), id, Err(why), permit).await;
        };
        if self
            .bound
            .as_ref()
            .is_some_and(|b| !std::ptr::eq(b.store.as_ptr(), Arc::as_ptr(&st)))
        {
            self.unbind("the shard's group started again").await;
        }
        let entries = !req.entries.is_empty();
        let behind_others = entries && self.waiting.iter().any(|w| w.2);
        if let Err(why) = st.admit_append(&req, behind_others) {
            // Answered before the calls ahead of it: the client matches
            // answers by id, and one refused ends the leader's stream.
            return answer(self.out.clone(), id, Err(why), permit).await;
        }
        if self.bound.is_none() {
            let (input, rx) = mpsc::unbounded_channel();
            let requests = futures_util::stream::unfold(rx, |mut rx| async move {
                rx.recv().await.map(|r| (r, rx))
            });
            match st.append_stream(requests) {
                Ok(answers) => {
                    self.bound = Some(Bound {
                        store: Arc::downgrade(&st),
                        input,
                        answers,
                    })
                }
                Err(why) => return answer(self.out.clone(), id, Err(why), permit).await,
            }
        }
        let fed = match &self.bound {
            Some(b) => b.input.send(req).is_ok(),
            None => false,
        };
        if fed {
            self.waiting.push_back((id, permit, entries));
        } else {
            self.unbind("the shard's group stopped").await;
            answer(
                self.out.clone(),
                id,
                Err("the shard's group stopped".into()),
                permit,
            )
            .await;
        }
    }

    async fn answered(&mut self, a: Option<Result<forkless_store::RaftAppendAnswer, String>>) {
        match a {
            Some(Ok(r)) => {
                if let Some((id, permit, _)) = self.waiting.pop_front() {
                    answer(self.out.clone(), id, Ok(RpcReply::AppendEntries(r)), permit).await;
                }
                if let Some(st) = self.bound.as_ref().and_then(|b| b.store.upgrade()) {
                    st.appended();
                }
            }
            Some(Err(why)) => {
                if let Some((id, permit, _)) = self.waiting.pop_front() {
                    answer(self.out.clone(), id, Err(why.clone()), permit).await;
                }
                self.unbind(&why).await;
            }
            // After an answer that was not a success (or the group
            // stopped): the calls fed after it are answered with an
            // error (openraft's core may have taken them; the leader
            // counts none without a success).
            None => {
                self.unbind("no answer: the group ended the stream (a call before it was refused, or the group stopped)")
                    .await
            }
        }
    }

    /// Lets go of the openraft stream, and answers the calls it did not
    /// with `why`.
    async fn unbind(&mut self, why: &str) {
        self.bound = None;
        for (id, permit, _) in std::mem::take(&mut self.waiting) {
            answer(self.out.clone(), id, Err(why.to_string()), permit).await;
        }
    }
}

/// The lane's next answer from its openraft stream; pending while it has
/// none bound.
async fn next_answer(
    bound: &mut Option<Bound>,
) -> Option<Result<forkless_store::RaftAppendAnswer, String>> {
    match bound {
        Some(b) => b.answers.next().await,
        None => std::future::pending().await,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::atomic::{AtomicUsize, Ordering};

    #[test]
    fn secrets_compare_whole() {
        assert!(same_secret("abc", "abc"));
        assert!(!same_secret("abc", "abd"));
        assert!(!same_secret("abc", "ab"));
        assert!(!same_secret("", "a"));
    }

    #[tokio::test]
    async fn an_unknown_peer_and_a_dead_one_are_unreachable_never_an_answer() {
        let links = Links::new(1, "s".into(), [(2, "127.0.0.1:1".to_string())]);
        let rpc = || Rpc::Vote(openraft_vote());
        match links.call(3, 0, rpc(), Duration::from_secs(1)).await {
            Err(CallError::Unreachable(why)) => assert!(why.contains("not a peer"), "{why}"),
            other => panic!("{other:?}"),
        }
        match links.call(2, 0, rpc(), Duration::from_secs(1)).await {
            Err(CallError::Unreachable(why)) => assert!(why.contains("127.0.0.1:1"), "{why}"),
            other => panic!("{other:?}"),
        }
        // Within the retry pause, at once, with the same reason.
        match links.call(2, 0, rpc(), Duration::from_secs(1)).await {
            Err(CallError::Unreachable(why)) => assert!(why.contains("127.0.0.1:1"), "{why}"),
            other => panic!("{other:?}"),
        }
        // A peer added at run time is called at its address; one known
        // keeps its address, and this node is never its own peer.
        assert!(links.add_peer(3, "127.0.0.1:2".into()));
        assert!(!links.add_peer(3, "127.0.0.1:3".into()));
        assert!(!links.add_peer(1, "127.0.0.1:4".into()));
        assert_eq!(links.peer_ids(), vec![2, 3]);
        match links.call(3, 0, rpc(), Duration::from_secs(1)).await {
            Err(CallError::Unreachable(why)) => assert!(why.contains("127.0.0.1:2"), "{why}"),
            other => panic!("{other:?}"),
        }
        // A moved peer is called at its new address; a peer whose Raft
        // address did not change keeps its link (and its connection).
        assert!(links.move_peer(3, "127.0.0.1:5".into()));
        assert!(!links.move_peer(9, "127.0.0.1:6".into()));
        let link = |links: &Links| links.inner.links.read().expect("links")[&3].clone();
        let before = link(&links);
        assert!(!links.move_peer(3, "127.0.0.1:5".into()));
        assert!(
            Arc::ptr_eq(&before, &link(&links)),
            "the link was made anew"
        );
        assert_eq!(links.peer_ids(), vec![2, 3]);
        match links.call(3, 0, rpc(), Duration::from_secs(1)).await {
            Err(CallError::Unreachable(why)) => assert!(why.contains("127.0.0.1:5"), "{why}"),
            other => panic!("{other:?}"),
        }
        // A retired peer is no peer.
        assert!(links.remove_peer(3));
        assert!(!links.remove_peer(3));
        assert_eq!(links.peer_ids(), vec![2]);
        match links.call(3, 0, rpc(), Duration::from_secs(1)).await {
            Err(CallError::Unreachable(why)) => assert!(why.contains("not a peer"), "{why}"),
            other => panic!("{other:?}"),
        }
    }

    fn openraft_vote() -> openraft::raft::VoteRequest<forkless_store::GroupConfig> {
        openraft::raft::VoteRequest::new(openraft::impls::Vote::new(2, 1), None)
    }

    /// A peer whose calls name many groups this node holds no replica of
    /// has at most `OPENING_MAX` of them opened at once: a blocking task
    /// each, not one queued for every group named (a beat of 80 MiB could
    /// name millions).
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn at_most_a_few_replicas_are_opened_at_once_for_a_peer() {
        let (running, most) = (Arc::new(AtomicUsize::new(0)), Arc::new(AtomicUsize::new(0)));
        let join: Join = {
            let (running, most) = (running.clone(), most.clone());
            Arc::new(move |_| {
                let now = running.fetch_add(1, Ordering::AcqRel) + 1;
                most.fetch_max(now, Ordering::AcqRel);
                std::thread::sleep(Duration::from_millis(200));
                running.fetch_sub(1, Ordering::AcqRel);
                None
            })
        };
        let joins = Arc::new(Joins {
            join: Some(join),
            opening: Mutex::default(),
        });
        for g in 0..1000 {
            joins.open(2, g);
        }
        let until = std::time::Instant::now() + Duration::from_secs(10);
        while !joins
            .opening
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .is_empty()
        {
            assert!(std::time::Instant::now() < until, "the opens did not end");
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        let most = most.load(Ordering::Acquire);
        assert!(
            (1..=OPENING_MAX).contains(&most),
            "{most} replicas were opened at once"
        );
    }

    /// A connection that announces a hello larger than any is closed at
    /// once, before its secret is read and without waiting for its bytes.
    /// Before, the node took up to 80 MiB for it and waited the whole
    /// hello bound (5 s) for them, on each of its listener's connections.
    #[tokio::test]
    async fn a_hello_larger_than_any_is_refused_at_once() {
        use tokio::io::{AsyncReadExt, AsyncWriteExt};
        let (addr, _stop) = serving("right").await;
        let mut tcp = tokio::net::TcpStream::connect(addr).await.unwrap();
        // A length-delimited frame's header: 16 MiB to come.
        tcp.write_all(&(16u32 << 20).to_be_bytes()).await.unwrap();
        tcp.write_all(&[0; 1024]).await.unwrap();
        let mut buf = [0u8; 64];
        let closed = tokio::time::timeout(Duration::from_secs(2), async {
            loop {
                match tcp.read(&mut buf).await {
                    Ok(0) | Err(_) => return,
                    Ok(_) => {}
                }
            }
        })
        .await;
        assert!(
            closed.is_ok(),
            "the connection was still open 2 s after announcing a 16 MiB hello"
        );
        // A real peer still gets in (its hello is small, its calls are not
        // bounded by the hello's bound).
        let links = Links::new(1, "right".into(), [(2, addr.to_string())]);
        if let Err(CallError::Unreachable(why)) = links
            .call(2, 0, Rpc::Vote(openraft_vote()), Duration::from_secs(2))
            .await
        {
            assert!(!why.contains("hello"), "a real peer refused: {why}");
        }
    }

    /// Connections that say nothing do not shut a peer out: past
    /// [`AWAITING_HELLO_MAX`] of them the oldest are closed, and a peer's
    /// call is served at once. Before, 256 connections of any kind were
    /// held and the peer's refused until the silent ones' hello time ran
    /// out.
    #[tokio::test]
    async fn silent_connections_do_not_shut_a_peer_out() {
        let (addr, _stop) = serving("right").await;
        let mut silent = Vec::new();
        for _ in 0..270 {
            silent.push(tokio::net::TcpStream::connect(addr).await.unwrap());
        }
        let links = Links::new(1, "right".into(), [(2, addr.to_string())]);
        match links
            .call(2, 0, Rpc::Vote(openraft_vote()), Duration::from_secs(2))
            .await
        {
            Ok(_) | Err(CallError::Remote(_)) => {}
            Err(e) => panic!("the peer was not served: {e:?}"),
        }
        // All but the newest AWAITING_HELLO_MAX silent ones were closed.
        let closed = closed_of(&mut silent).await;
        assert!(
            closed >= 270 - AWAITING_HELLO_MAX,
            "{closed} of 270 silent connections closed"
        );
    }

    /// A server of no groups for peers that know `secret`, on a port of
    /// its own; it stops when the sender returned is dropped.
    async fn serving(secret: &str) -> (std::net::SocketAddr, watch::Sender<bool>) {
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let (stop_tx, stop) = watch::channel(false);
        let groups: Groups = Arc::new(|_| None);
        tokio::spawn(serve(listener, secret.into(), groups, stop));
        (addr, stop_tx)
    }

    /// The hello of node 1 that knows secret "s".
    fn hello_frame() -> Bytes {
        encode(&ToServer::Hello {
            version: PROTOCOL_VERSION,
            from: 1,
            secret: "s".into(),
            placement: 0,
        })
        .unwrap()
    }

    /// A connection from `from` to `addr` that says hello as node 1 and
    /// is welcome.
    async fn welcomed_from(
        from: std::net::IpAddr,
        addr: std::net::SocketAddr,
    ) -> Framed<TcpStream, LengthDelimitedCodec> {
        let tcp = connect_from(from, addr).await;
        let mut framed = Framed::new(tcp, codec());
        framed.send(hello_frame()).await.unwrap();
        let answer = framed.next().await.unwrap().unwrap();
        assert!(matches!(
            decode::<ToClient>(&answer).unwrap(),
            ToClient::Welcome
        ));
        framed
    }

    async fn connect_from(from: std::net::IpAddr, addr: std::net::SocketAddr) -> TcpStream {
        let socket = tokio::net::TcpSocket::new_v4().unwrap();
        socket.bind(std::net::SocketAddr::new(from, 0)).unwrap();
        socket.connect(addr).await.unwrap()
    }

    /// How many of `conns` the server has closed (each read for 20 ms).
    async fn closed_of(conns: &mut [TcpStream]) -> usize {
        use tokio::io::AsyncReadExt;
        let mut closed = 0;
        for tcp in conns {
            let mut b = [0u8; 1];
            if let Ok(Ok(0) | Err(_)) =
                tokio::time::timeout(Duration::from_millis(20), tcp.read(&mut b)).await
            {
                closed += 1;
            }
        }
        closed
    }

    /// Whether `framed` is closed by the server within `within`.
    async fn closed_within(
        framed: &mut Framed<TcpStream, LengthDelimitedCodec>,
        within: Duration,
    ) -> bool {
        let deadline = Instant::now() + within;
        loop {
            match tokio::time::timeout_at(deadline, framed.next()).await {
                Err(_) => return false,
                Ok(None | Some(Err(_))) => return true,
                // An answer to a call it sent.
                Ok(Some(Ok(_))) => {}
            }
        }
    }

    /// A peer's connections past [`PER_PEER_MAX`] close the one that read
    /// a frame longest ago: one the peer gave up while the two were cut
    /// off (its close lost) does not stay for good, and one the peer
    /// still calls on is kept though it is the oldest. Before, every one
    /// stayed.
    #[tokio::test]
    async fn a_peers_quietest_connection_is_closed_past_its_bound() {
        let (addr, _stop) = serving("s").await;
        let here = std::net::IpAddr::from([127, 0, 0, 1]);
        let mut live = welcomed_from(here, addr).await;
        let mut quiet = welcomed_from(here, addr).await;
        // The oldest calls on (and the clock moves past its welcome).
        tokio::time::sleep(Duration::from_millis(20)).await;
        let call = ToServer::Call {
            id: 1,
            group: 0,
            rpc: Rpc::Vote(openraft_vote()),
        };
        live.send(encode(&call).unwrap()).await.unwrap();
        let answered = live.next().await.unwrap().unwrap();
        assert!(matches!(
            decode::<ToClient>(&answered).unwrap(),
            ToClient::Answer { id: 1, .. }
        ));
        let mut newest = welcomed_from(here, addr).await;
        assert!(
            closed_within(&mut quiet, Duration::from_secs(5)).await,
            "the peer's quiet connection is still open"
        );
        for (c, which) in [(&mut live, "the live one"), (&mut newest, "the newest")] {
            assert!(
                !closed_within(c, Duration::from_millis(200)).await,
                "{which} was closed"
            );
        }
    }

    /// Past [`AWAITING_HELLO_MAX`] connections awaiting their hello, the
    /// one closed is the oldest from the address that holds the most:
    /// a peer whose hello is slow is not closed by a flood from another
    /// address, even though its connection is the oldest.
    #[tokio::test]
    async fn a_flood_from_one_address_closes_its_own_connections() {
        let (addr, _stop) = serving("s").await;
        // The peer connects first and says nothing yet.
        let slow = connect_from(std::net::IpAddr::from([127, 0, 0, 1]), addr).await;
        let flood_from = std::net::IpAddr::from([127, 0, 0, 2]);
        let mut flood = Vec::new();
        for _ in 0..AWAITING_HELLO_MAX + 36 {
            flood.push(connect_from(flood_from, addr).await);
        }
        // The flood's oldest were closed, as it went on.
        let closed = closed_of(&mut flood).await;
        assert!(closed >= 36, "{closed} of the flood's connections closed");
        // The peer says hello now, and is welcome.
        let mut framed = Framed::new(slow, codec());
        framed.send(hello_frame()).await.unwrap();
        let answer = tokio::time::timeout(Duration::from_secs(5), framed.next()).await;
        assert!(
            matches!(&answer, Ok(Some(Ok(a))) if matches!(decode::<ToClient>(a), Ok(ToClient::Welcome))),
            "the slow peer was not welcome: {answer:?}"
        );
    }

    #[tokio::test]
    async fn a_wrong_secret_is_refused_at_hello() {
        let (addr, _stop) = serving("right").await;
        let addr = addr.to_string();
        let links = Links::new(1, "wrong".into(), [(2, addr)]);
        match links
            .call(2, 0, Rpc::Vote(openraft_vote()), Duration::from_secs(2))
            .await
        {
            Err(CallError::Unreachable(why)) => {
                assert!(why.contains("wrong cluster secret"), "{why}")
            }
            other => panic!("{other:?}"),
        }
    }

    /// A node whose groups' placement differs from this node's (it skipped
    /// the start-up check: its record deleted, every peer down when it
    /// started) is refused at hello, naming both fingerprints; one that
    /// places alike is served.
    #[tokio::test]
    async fn a_node_placed_otherwise_is_refused_at_hello() {
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap().to_string();
        let (_stop_tx, stop) = watch::channel(false);
        let groups: Groups = Arc::new(|_| None);
        let anyone: Admit = Arc::new(|_| Ok(()));
        let placed = |placement| Handshake {
            secret: "s".into(),
            placement,
        };
        tokio::spawn(serve_node(
            listener,
            placed(0xab),
            groups,
            Hooks::default(),
            anyone,
            stop,
        ));
        let vote = || Rpc::Vote(openraft_vote());
        let other = Links::on(1, placed(0xcd), [(2, addr.clone())], None);
        match other.call(2, 7, vote(), Duration::from_secs(2)).await {
            Err(CallError::Unreachable(why)) => assert!(
                why.contains("refused this node: its groups' placement (fingerprint 00000000000000cd) is not this node's (00000000000000ab)"),
                "{why}"
            ),
            other => panic!("{other:?}"),
        }
        let alike = Links::on(1, placed(0xab), [(2, addr)], None);
        assert!(matches!(
            alike.call(2, 7, vote(), Duration::from_secs(2)).await,
            Err(CallError::Remote(_))
        ));
    }

    /// A node that is not a peer (retired, or not in the file) is refused
    /// at hello with the reason, and one retired while its connection is
    /// open has that connection closed at its next call.
    #[tokio::test]
    async fn a_node_that_is_not_a_peer_is_refused_at_hello_and_at_its_next_call() {
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap().to_string();
        let (_stop_tx, stop) = watch::channel(false);
        let groups: Groups = Arc::new(|_| None);
        let retired = Arc::new(std::sync::atomic::AtomicBool::new(false));
        let admit: Admit = {
            let retired = retired.clone();
            Arc::new(move |node| match node {
                1 if !retired.load(Ordering::Acquire) => Ok(()),
                1 => Err("node 1 is retired".into()),
                n => Err(format!("node {n} is not in this node's cluster file")),
            })
        };
        tokio::spawn(serve_node(
            listener,
            Handshake::secret("s".into()),
            groups,
            Hooks::default(),
            admit,
            stop,
        ));
        let vote = || Rpc::Vote(openraft_vote());
        let stranger = Links::new(9, "s".into(), [(2, addr.clone())]);
        match stranger.call(2, 0, vote(), Duration::from_secs(2)).await {
            Err(CallError::Unreachable(why)) => assert!(
                why.contains("refused this node: node 9 is not in this node's cluster file"),
                "{why}"
            ),
            other => panic!("{other:?}"),
        }
        // A peer is served (the shard is not here: the group's answer).
        let peer = Links::new(1, "s".into(), [(2, addr)]);
        assert!(matches!(
            peer.call(2, 7, vote(), Duration::from_secs(2)).await,
            Err(CallError::Remote(_))
        ));
        // Retired: its open connection closes at its next call, and a new
        // one is refused with the reason.
        retired.store(true, Ordering::Release);
        assert!(matches!(
            peer.call(2, 7, vote(), Duration::from_secs(2)).await,
            Err(CallError::Unreachable(_))
        ));
        let until = Instant::now() + Duration::from_secs(10);
        loop {
            match peer.call(2, 7, vote(), Duration::from_secs(2)).await {
                Err(CallError::Unreachable(why)) if why.contains("node 1 is retired") => break,
                other => assert!(
                    Instant::now() < until,
                    "not refused as retired within 10 s: {other:?}"
                ),
            }
            tokio::time::sleep(RETRY_CONNECT_AFTER).await;
        }
    }

    #[tokio::test]
    async fn a_link_is_down_once_its_connection_breaks_and_up_once_one_is_made() {
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let (stop_tx, stop) = watch::channel(false);
        let groups: Groups = Arc::new(|_| None);
        let served = tokio::spawn(serve(listener, "s".into(), groups.clone(), stop));
        let links = Links::new(1, "s".into(), [(2, addr.to_string())]);
        // Never connected: not known to be down.
        assert!(!links.link_down(2));
        // Not a peer: down.
        assert!(links.link_down(5));
        let call = || links.call(2, 7, Rpc::Vote(openraft_vote()), Duration::from_secs(2));
        assert!(matches!(call().await, Err(CallError::Remote(_))));
        assert!(!links.link_down(2));
        // The peer goes away: its connections close, and its port too.
        stop_tx.send(true).unwrap();
        served.await.unwrap();
        let until = Instant::now() + Duration::from_secs(10);
        while !links.link_down(2) {
            assert!(
                Instant::now() < until,
                "the link was not seen down within 10 s"
            );
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
        // A connect that fails keeps it down.
        assert!(matches!(call().await, Err(CallError::Unreachable(_))));
        assert!(links.link_down(2));
        // The peer back on its port: the next call connects, and it is up.
        let listener = TcpListener::bind(addr).await.unwrap();
        let (_stop_tx, stop) = watch::channel(false);
        tokio::spawn(serve(listener, "s".into(), groups, stop));
        let until = Instant::now() + Duration::from_secs(10);
        while !matches!(call().await, Err(CallError::Remote(_))) {
            assert!(
                Instant::now() < until,
                "no connection to the peer back within 10 s"
            );
            tokio::time::sleep(RETRY_CONNECT_AFTER).await;
        }
        assert!(!links.link_down(2));
    }

    #[tokio::test]
    async fn a_call_for_a_shard_the_peer_does_not_hold_is_its_error() {
        let (addr, _stop) = serving("s").await;
        let addr = addr.to_string();
        let links = Links::new(1, "s".into(), [(2, addr)]);
        match links
            .call(2, 7, Rpc::Vote(openraft_vote()), Duration::from_secs(2))
            .await
        {
            Err(CallError::Remote(why)) => assert!(why.contains("shard 7"), "{why}"),
            other => panic!("{other:?}"),
        }
    }
}
