//! One client connection: its requests read and answered here, with hyper
//! taking over the connection for anything this does not handle.
//!
//! Why not hyper for everything: at 64 clients appending on one node,
//! hyper's connection machinery (its dispatcher, the request body channel,
//! header maps in and out, response encoding) cost about as much CPU as
//! everything else the node does per append (BENCHMARKS.md, issue 4). This
//! reads a request head with `httparse` (the parser hyper itself uses),
//! builds the same `http::Request` hyper would, calls the same service, and
//! writes the answer in one buffer; the hot append skips the request and
//! response maps entirely ([`api::hot_append`]).
//!
//! What is served here is deliberately narrow: HTTP/1.1 requests in origin
//! form whose head parses completely within [`HEAD_BYTES_MAX`], with no body
//! or a body framed by one `Content-Length` within the configured limit, and
//! no `Transfer-Encoding`, `Expect`, `Upgrade`, or `Connection` other than
//! `keep-alive`; not `HEAD` or `CONNECT`. The first request that is anything
//! else — and every byte after it, none of them consumed — goes to hyper,
//! which serves the rest of the connection exactly as if it had read it from
//! the first byte. Answers already written came before it, so pipelined
//! requests are still answered in order.

use crate::api::{self, Hot, RouteHeaders};
use crate::budget::{body_budget_refusal, ByteBudget, Held, ListenerIndex, OverBodyBudget};
use crate::headers::{self, content_length};
use crate::App;
use axum::body::Body;
use axum::extract::Request;
use axum::response::{IntoResponse, Response};
use bytes::{Buf, BufMut, Bytes, BytesMut};
use forkless_types::ExecutionId;
use http::header;
use std::convert::Infallible;
use std::future::Future;
use std::io;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::{Duration, Instant};
use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt, ReadBuf};
use tokio::net::TcpStream;
use tokio::sync::watch;
use tower::{Service, ServiceExt};

/// A request head longer than this goes to hyper (which has its own, larger
/// limit, [`HYPER_BUF_MAX`], and answers 431 past it).
pub const HEAD_BYTES_MAX: usize = 16 * 1024;
/// The most hyper buffers of a connection it serves: a request head must
/// fit in it (431 past it), and it is as far as hyper reads a body ahead of
/// the body budget's count (`Counted`), as the connection loop reads at
/// most [`BODY_STEP`] ahead. hyper's default is about 400 KiB.
const HYPER_BUF_MAX: usize = 64 * 1024;
/// A request with more header lines than this goes to hyper.
const HEADERS_MAX: usize = 32;
/// Room made in the read buffer before each read.
const READ_CHUNK: usize = 8 * 1024;
/// The most of a body read at once, each read covered by the body budget
/// first.
const BODY_STEP: usize = 64 * 1024;
/// A read buffer grown past this (a large body) is let go once empty, and
/// so is an answer buffer after an answer larger than this.
const BUF_KEEP_MAX: usize = 64 * 1024;
// A held answer (`budget::hold_answer`) is written from its own bytes,
// never copied into the answer buffer (and let go before it is written).
const _: () = assert!(crate::budget::ANSWER_UNCOUNTED_MAX >= BUF_KEEP_MAX);
/// Once the node is stopping, a write still blocked (a client that does
/// not read) gets this long before the connection is dropped, so a stuck
/// client cannot hold the shutdown up for the whole write timeout.
pub(crate) const SHUTDOWN_WRITE_GRACE: Duration = Duration::from_secs(1);

/// Serves `tcp` until the client closes it, an I/O error, or `stop` (an
/// idle connection closes at once; a request in progress is answered
/// first).
/// `listener` is the index of the listener it came in on, whose budget
/// of body bytes its requests' bodies are held against
/// ([`App::body_budgets`]).
pub(crate) async fn serve<S>(
    app: Arc<App>,
    tcp: TcpStream,
    service: S,
    stop: watch::Receiver<bool>,
    listener: usize,
) where
    S: Service<Request, Response = Response, Error = Infallible> + Clone + Send + 'static,
    S::Future: Send + 'static,
{
    let mut c = Conn {
        app,
        tcp,
        buf: BytesMut::with_capacity(READ_CHUNK),
        stop,
        listener,
    };
    let mut out = Vec::with_capacity(OUT_INITIAL);
    let read_timeout = Duration::from_millis(c.app.cfg.limits.request_read_timeout_ms);
    loop {
        // Set once the request's first byte is here: the whole request must
        // follow by then.
        let mut deadline = None;
        let head = loop {
            if deadline.is_none() && !c.buf.is_empty() {
                deadline = Some(Instant::now() + read_timeout);
            }
            match read_head(&c.app, &c.buf) {
                Parsed::Head(h) => break h,
                Parsed::Partial if c.buf.len() < HEAD_BYTES_MAX => {
                    if !c.fill(READ_CHUNK, deadline).await {
                        return;
                    }
                }
                Parsed::Partial | Parsed::Other => return c.hand_to_hyper(service).await,
            }
        };
        let total = head.len + head.body_len;
        // The body's bytes are held against the listener's budget as they
        // arrive, until the request's answer is made (not while it is
        // written: a client slow to read holds no body).
        let body_held = c.budget().hold();
        match c.read_body(&body_held, total, head.len, deadline).await {
            Some(true) => {}
            Some(false) => {
                // Over the budget: what came of the request is dropped
                // with the buffer room made for its body, the rest of it
                // is read and dropped as it comes (a read at a time), and
                // the request refused.
                drop(body_held);
                let here = c.buf.len().min(total);
                c.buf.advance(here);
                c.fresh_buffer();
                if !c.discard(total - here, deadline).await {
                    return;
                }
                out.clear();
                let refused = api::stamp(
                    &c.app,
                    body_budget_refusal(c.budget().max_bytes()).into_response(),
                );
                let Ok(tail) = write_response(refused, &mut out).await else {
                    return;
                };
                if !c.write_answer(&out, tail).await {
                    return;
                }
                continue;
            }
            None => return,
        }
        let request = c.buf.split_to(total).freeze();
        if total > BUF_KEEP_MAX {
            // A large request's buffer is let go with the request, not
            // kept (and taken back whole at the next read) by what
            // follows it on the connection.
            c.fresh_buffer();
        }
        let body = request.slice(head.len..);
        out.clear();
        // A large answer's body, written after `out` (its head) as it is,
        // not copied into it: kept until written, and with it what it
        // holds of the listener's answer budget (`budget::hold_answer`).
        let mut tail = Bytes::new();
        match head.kind {
            Kind::HotAppend { id, hops, path } => match api::hot_append(
                &c.app,
                id,
                std::str::from_utf8(&request[path]).unwrap_or_default(),
                body,
                hops,
            )
            .await
            {
                Hot::Appended { body, route } => write_appended(&c.app, &mut out, &body, &route),
                Hot::Other(resp) => match write_response(resp, &mut out).await {
                    Ok(t) => tail = t,
                    Err(_) => return,
                },
            },
            Kind::Plain(parts) => {
                let read = parts.method == http::Method::GET;
                let mut req = Request::from_parts(*parts, Body::from(body));
                req.extensions_mut().insert(ListenerIndex(c.listener));
                let answer = service.clone().oneshot(req);
                let answered = if read {
                    // A read whose client hangs up is dropped at once, and
                    // what it holds with it: a long-poll's slot here, or
                    // the connection it was forwarded on (which its owner
                    // sees close, and drops its own part). Writes run to
                    // their end: their outcome is decided either way.
                    tokio::select! {
                        r = answer => r,
                        () = hung_up(&mut c.tcp, &mut c.buf) => {
                            c.app.metrics.reads_abandoned.inc();
                            return;
                        }
                    }
                } else {
                    answer.await
                };
                let resp = match answered {
                    Ok(r) => r,
                    Err(never) => match never {},
                };
                match write_response(resp, &mut out).await {
                    Ok(t) => tail = t,
                    Err(_) => return,
                }
            }
        }
        drop(request);
        drop(body_held);
        if !c.write_answer(&out, tail).await || *c.stop.borrow() {
            return;
        }
        if c.buf.is_empty() && c.buf.capacity() > BUF_KEEP_MAX {
            c.buf = BytesMut::with_capacity(READ_CHUNK);
        }
        shrink_answer_buffer(&mut out);
    }
}

/// Resolves once the client closes its side of the connection (or it
/// fails) while a request is being answered. Bytes it sends meanwhile (a
/// pipelined request) are kept in `buf` for after the answer, up to
/// [`HEAD_BYTES_MAX`]; past that, it stops looking (the client's next
/// bytes wait in the socket). A client that closes its side and waits for
/// its answer (a half-close) is taken for gone, as hyper's server does by
/// default.
async fn hung_up(tcp: &mut TcpStream, buf: &mut BytesMut) {
    while buf.len() < HEAD_BYTES_MAX {
        buf.reserve(READ_CHUNK);
        match tcp.read_buf(buf).await {
            Ok(0) | Err(_) => return,
            Ok(_) => {}
        }
    }
    std::future::pending().await
}

/// How hyper serves the connections handed to it: its buffer bounded
/// ([`HYPER_BUF_MAX`]), and a request head within `head_within`.
fn hyper_server(head_within: Duration) -> hyper::server::conn::http1::Builder {
    let mut b = hyper::server::conn::http1::Builder::new();
    b.timer(hyper_util::rt::TokioTimer::new())
        .max_buf_size(HYPER_BUF_MAX)
        .header_read_timeout(head_within);
    b
}

/// An answer's body on hyper's path, handed over at most
/// [`ANSWER_STEP`] at a time: hyper asks for the next step only once what
/// it holds unwritten is under [`HYPER_BUF_MAX`]. A step it queues as it
/// is (a socket that takes vectored writes) keeps the answer's bytes,
/// and what they hold of their listener's answer budget
/// (`budget::hold_answer`), until written; a step it copies into its own
/// buffer lets them go once copied, so at most that buffer and one step
/// of an answer are not counted, rather than all of it.
struct Stepped {
    inner: Body,
    pending: Bytes,
}

/// The most of an answer on hyper's path handed over at once.
const ANSWER_STEP: usize = 64 * 1024;

impl http_body::Body for Stepped {
    type Data = Bytes;
    type Error = axum::Error;

    fn poll_frame(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<http_body::Frame<Bytes>, axum::Error>>> {
        let this = self.get_mut();
        if this.pending.is_empty() {
            match std::task::ready!(Pin::new(&mut this.inner).poll_frame(cx)) {
                Some(Ok(f)) => match f.into_data() {
                    Ok(data) => this.pending = data,
                    Err(f) => return Poll::Ready(Some(Ok(f))),
                },
                other => return Poll::Ready(other),
            }
        }
        let step = this.pending.split_to(this.pending.len().min(ANSWER_STEP));
        if this.pending.is_empty() {
            // (The rest of the frame goes with its last step.)
            this.pending = Bytes::new();
        }
        Poll::Ready(Some(Ok(http_body::Frame::data(step))))
    }

    fn is_end_stream(&self) -> bool {
        self.pending.is_empty() && self.inner.is_end_stream()
    }

    fn size_hint(&self) -> http_body::SizeHint {
        let inner = self.inner.size_hint();
        let pending = self.pending.len() as u64;
        let mut hint = http_body::SizeHint::new();
        hint.set_lower(inner.lower().saturating_add(pending));
        if let Some(upper) = inner.upper() {
            hint.set_upper(upper.saturating_add(pending));
        }
        hint
    }
}

/// A body hyper streams, its bytes held in the listener's budget as they
/// come. Past the budget, reading it fails with [`OverBodyBudget`] (the
/// request is answered 503 `too_many_body_bytes`: `api::read_body`).
struct Counted {
    inner: Body,
    held: Arc<Held>,
    seen: usize,
}

impl http_body::Body for Counted {
    type Data = Bytes;
    type Error = axum::Error;

    fn poll_frame(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<http_body::Frame<Bytes>, axum::Error>>> {
        let this = self.get_mut();
        let frame = std::task::ready!(Pin::new(&mut this.inner).poll_frame(cx));
        if let Some(Ok(f)) = &frame {
            if let Some(data) = f.data_ref() {
                this.seen = this.seen.saturating_add(data.len());
                if !this.held.cover(this.seen) {
                    return Poll::Ready(Some(Err(axum::Error::new(OverBodyBudget))));
                }
            }
        }
        Poll::Ready(frame)
    }

    fn is_end_stream(&self) -> bool {
        self.inner.is_end_stream()
    }

    fn size_hint(&self) -> http_body::SizeHint {
        self.inner.size_hint()
    }
}

/// The answer buffer's starting capacity.
const OUT_INITIAL: usize = 1024;

/// Lets go of an answer buffer that a large answer grew past
/// [`BUF_KEEP_MAX`], so an idle connection does not keep holding it.
fn shrink_answer_buffer(out: &mut Vec<u8>) {
    if out.capacity() > BUF_KEEP_MAX {
        *out = Vec::with_capacity(OUT_INITIAL);
    }
}

struct Conn {
    app: Arc<App>,
    tcp: TcpStream,
    buf: BytesMut,
    stop: watch::Receiver<bool>,
    /// The listener it came in on (its index in [`App::body_budgets`]).
    listener: usize,
}

/// Writes `out` whole, unless the client takes none of it for
/// `write_timeout` (then false: the caller drops the connection), or the
/// node is stopping and the write is still blocked after
/// [`SHUTDOWN_WRITE_GRACE`].
async fn write_bounded(
    app: &App,
    tcp: &mut TcpStream,
    out: &[u8],
    stop: &mut watch::Receiver<bool>,
) -> bool {
    let write_timeout = Duration::from_millis(app.cfg.limits.write_timeout_ms);
    let mut written = 0;
    while written < out.len() {
        let step = tokio::select! {
            r = tokio::time::timeout(write_timeout, tcp.write(&out[written..])) => r,
            () = stopped(stop) => {
                tokio::time::timeout(SHUTDOWN_WRITE_GRACE, tcp.write(&out[written..])).await
            }
        };
        match step {
            Ok(Ok(n)) if n > 0 => written += n,
            Ok(_) => return false,
            Err(_) => {
                app.metrics.connection_timeout("write");
                tracing::debug!(
                    ms = app.cfg.limits.write_timeout_ms,
                    "the client took none of its answer in time; dropping the connection"
                );
                return false;
            }
        }
    }
    true
}

/// Resolves once the node is stopping.
async fn stopped(stop: &mut watch::Receiver<bool>) {
    let _ = stop.wait_for(|s| *s).await;
}

impl Conn {
    /// Writes an answer: `out`, then the body [`write_response`] left
    /// out of it (kept until written, as is what it holds).
    async fn write_answer(&mut self, out: &[u8], tail: Bytes) -> bool {
        self.write_out(out).await && (tail.is_empty() || self.write_out(&tail).await)
    }

    async fn write_out(&mut self, out: &[u8]) -> bool {
        write_bounded(&self.app, &mut self.tcp, out, &mut self.stop).await
    }

    /// Reads more into the buffer (making room for at least `room` bytes);
    /// false when the connection is done: closed, failed, or - between
    /// requests (no `deadline`) - the node is stopping. Past `deadline`
    /// (a request begun and not yet whole), answers 408 first.
    async fn fill(&mut self, room: usize, deadline: Option<Instant>) -> bool {
        self.buf.reserve(room.max(READ_CHUNK));
        let read = match deadline {
            // Between requests: an idle connection is closed after the
            // idle timeout.
            None => tokio::select! {
                r = self.tcp.read_buf(&mut self.buf) => r,
                _ = self.stop.wait_for(|s| *s) => return false,
                _ = tokio::time::sleep(Duration::from_millis(self.app.cfg.limits.idle_timeout_ms)) => {
                    self.app.metrics.connection_timeout("idle");
                    return false;
                }
            },
            Some(d) => {
                match tokio::time::timeout_at(d.into(), self.tcp.read_buf(&mut self.buf)).await {
                    Ok(r) => r,
                    Err(_) => {
                        self.request_timed_out().await;
                        return false;
                    }
                }
            }
        };
        matches!(read, Ok(n) if n > 0)
    }

    fn budget(&self) -> &ByteBudget {
        &self.app.body_budgets[self.listener]
    }

    /// Reads the request's body, to `total` bytes of `buf` (its head is
    /// `head_len` of them), holding its bytes in `held` as they come:
    /// each read is first covered by the budget. `Some(false)` when the
    /// budget has no room for more of it; `None` when the connection ended
    /// or the deadline passed (then 408 was answered).
    async fn read_body(
        &mut self,
        held: &Held,
        total: usize,
        head_len: usize,
        deadline: Option<Instant>,
    ) -> Option<bool> {
        if !held.cover(self.buf.len().min(total) - head_len) {
            return Some(false);
        }
        if self.buf.len() < total {
            // Room for the whole body at once (untouched, it takes no
            // memory), so that it is read without copies.
            self.buf.reserve(total - self.buf.len());
        }
        while self.buf.len() < total {
            let step = (total - self.buf.len()).min(BODY_STEP);
            if !held.cover(self.buf.len() + step - head_len) {
                return Some(false);
            }
            if !self.read_at_most(step, deadline).await {
                return None;
            }
        }
        Some(true)
    }

    /// Moves what is left in the read buffer (bytes after a large
    /// request) into a new one of the usual size, so that the allocation
    /// the large request grew goes with it. (What `split_to` leaves shares
    /// that allocation, and a later `reserve` takes all of it back once
    /// the request is dropped, whatever its `capacity()` says now.)
    fn fresh_buffer(&mut self) {
        let rest = self.buf.split();
        self.buf = BytesMut::with_capacity(READ_CHUNK.max(rest.len()));
        self.buf.extend_from_slice(&rest);
    }

    /// Reads and drops the next `n` bytes of the connection (a refused
    /// request's), holding no more than a read's worth at a time; false
    /// if the connection ends or `deadline` passes first (then 408 was
    /// answered).
    async fn discard(&mut self, mut n: usize, deadline: Option<Instant>) -> bool {
        loop {
            let here = n.min(self.buf.len());
            self.buf.advance(here);
            n -= here;
            if n == 0 {
                return true;
            }
            // At most what is left of it, a chunk at a time: the bytes
            // after it are the next request's, read as it is.
            self.buf.reserve(READ_CHUNK);
            if !self.read_at_most(n.min(READ_CHUNK), deadline).await {
                return false;
            }
        }
    }

    /// One read of at most `n` (> 0) bytes into `buf`, which has room for
    /// them; false when the connection ended, or the deadline passed
    /// first (then 408 was answered).
    async fn read_at_most(&mut self, n: usize, deadline: Option<Instant>) -> bool {
        let read = {
            let mut limited = (&mut self.buf).limit(n);
            match deadline {
                Some(d) => tokio::time::timeout_at(d.into(), self.tcp.read_buf(&mut limited)).await,
                None => Ok(self.tcp.read_buf(&mut limited).await),
            }
        };
        match read {
            Ok(Ok(got)) => got > 0,
            Ok(Err(_)) => false,
            Err(_) => {
                self.request_timed_out().await;
                false
            }
        }
    }

    /// Answers 408 to a request that did not arrive in full in time; the
    /// caller then closes the connection (what was read of the request is
    /// dropped, nothing of it was acted on).
    async fn request_timed_out(&mut self) {
        let ms = self.app.cfg.limits.request_read_timeout_ms;
        tracing::debug!(
            ms,
            "request not received in full in time; answering 408 and closing"
        );
        let resp = crate::error::ApiError::RequestTimeout(ms).into_response();
        let mut out = Vec::with_capacity(256);
        if let Ok(tail) = write_response(crate::api::stamp(&self.app, resp), &mut out).await {
            let _ = self.write_answer(&out, tail).await;
        }
    }

    /// Gives the connection, with everything read but not yet answered, to
    /// hyper for the rest of its life.
    async fn hand_to_hyper<S>(self, service: S)
    where
        S: Service<Request, Response = Response, Error = Infallible> + Clone + Send + 'static,
        S::Future: Send + 'static,
    {
        let self_timeout_ms = self.app.cfg.limits.request_read_timeout_ms;
        let write_timeout = Duration::from_millis(self.app.cfg.limits.write_timeout_ms);
        let Conn {
            tcp,
            buf,
            mut stop,
            app,
            listener,
        } = self;
        // (A large buffer is not kept for the connection's life for the
        // few bytes hyper has yet to read of it.)
        let unread = if buf.capacity() > BUF_KEEP_MAX {
            Bytes::copy_from_slice(&buf)
        } else {
            buf.freeze()
        };
        let io = hyper_util::rt::TokioIo::new(Rewind {
            unread,
            tcp,
            write_timeout,
            stalled: None,
        });
        // Each request's body held against the listener's budget as it
        // comes, as on the fast path, until its answer is made.
        let budgeted = {
            let app = app.clone();
            tower::service_fn(move |req: Request| {
                let (app, service) = (app.clone(), service.clone());
                async move {
                    let held = Arc::new(app.body_budgets[listener].hold());
                    let mut req = req.map(|body| {
                        Body::new(Counted {
                            inner: body,
                            held: held.clone(),
                            seen: 0,
                        })
                    });
                    req.extensions_mut().insert(ListenerIndex(listener));
                    let answer = service.oneshot(req).await;
                    drop(held);
                    answer.map(|resp| {
                        resp.map(|body| {
                            Body::new(Stepped {
                                inner: body,
                                pending: Bytes::new(),
                            })
                        })
                    })
                }
            })
        };
        let service = hyper_util::service::TowerToHyperService::new(
            budgeted.map_request(|r: http::Request<hyper::body::Incoming>| r.map(Body::new)),
        );
        // hyper bounds the time to read a request head the same way (it
        // closes without an answer); a body it streams (chunked) is bounded
        // where the service reads it (`api::read_body`, 408).
        let conn =
            hyper_server(Duration::from_millis(self_timeout_ms)).serve_connection(io, service);
        tokio::pin!(conn);
        tokio::select! {
            r = conn.as_mut() => {
                if let Err(e) = r {
                    tracing::debug!(error = %e, "connection ended with an error");
                }
                return;
            }
            _ = stop.wait_for(|s| *s) => conn.as_mut().graceful_shutdown(),
        }
        // A request in progress is answered; a client that does not take
        // the answer does not hold the shutdown up past the grace.
        match tokio::time::timeout(SHUTDOWN_WRITE_GRACE + Duration::from_secs(1), conn).await {
            Ok(Err(e)) => tracing::debug!(error = %e, "connection ended with an error"),
            Ok(Ok(())) => {}
            Err(_) => {
                app.metrics.connection_timeout("shutdown");
                tracing::debug!("a connection still busy at shutdown was dropped");
            }
        }
    }
}

enum Parsed {
    /// The head is not complete yet.
    Partial,
    /// Not a request served here: hyper's.
    Other,
    Head(Head),
}

struct Head {
    /// Bytes of the head, through the blank line.
    len: usize,
    body_len: usize,
    kind: Kind,
}

enum Kind {
    /// An append to an execution on a shard this node owns, or forwards
    /// to its owner.
    /// `path` is where the request target sits in the request's bytes (a
    /// forward sends it on as it came).
    HotAppend {
        id: ExecutionId,
        /// Hops taken to get here (a peer's forward: proven by the secret).
        hops: u8,
        path: std::ops::Range<usize>,
    },
    /// Any other request this serves, for the service.
    Plain(Box<http::request::Parts>),
}

/// Reads the request head at the start of `buf`, if complete, and says how
/// it is to be served.
fn read_head(app: &App, buf: &[u8]) -> Parsed {
    let mut headers = [httparse::EMPTY_HEADER; HEADERS_MAX];
    let mut req = httparse::Request::new(&mut headers);
    let len = match req.parse(buf) {
        Ok(httparse::Status::Complete(n)) => n,
        Ok(httparse::Status::Partial) => return Parsed::Partial,
        // Malformed, or too many headers: hyper answers it.
        Err(_) => return Parsed::Other,
    };
    let (Some(method), Some(path), Some(1)) = (req.method, req.path, req.version) else {
        return Parsed::Other;
    };
    if method == "HEAD" || method == "CONNECT" || !path.starts_with('/') {
        return Parsed::Other;
    }
    let mut body_len = None;
    let mut hops: Option<&[u8]> = None;
    let mut peer_token: Option<&[u8]> = None;
    let mut hops_repeated = false;
    for h in req.headers.iter() {
        let name = h.name;
        if name.eq_ignore_ascii_case("content-length") {
            match (body_len, content_length(h.value)) {
                (None, Some(n)) => body_len = Some(n),
                _ => return Parsed::Other,
            }
        } else if name.eq_ignore_ascii_case("transfer-encoding")
            || name.eq_ignore_ascii_case("expect")
            || name.eq_ignore_ascii_case("upgrade")
            || (name.eq_ignore_ascii_case("connection")
                && !h.value.eq_ignore_ascii_case(b"keep-alive"))
        {
            return Parsed::Other;
        } else if name.eq_ignore_ascii_case(crate::HOPS_HEADER) {
            hops_repeated |= hops.replace(h.value).is_some();
        } else if name.eq_ignore_ascii_case(crate::PEER_TOKEN_HEADER) && peer_token.is_none() {
            peer_token = Some(h.value);
        }
    }
    let body_len = body_len.unwrap_or(0);
    if body_len > app.cfg.limits.request_body_bytes_max {
        // hyper reads what it must and the service answers 413.
        return Parsed::Other;
    }
    // Hops a peer says the request took; a hop header that is not a
    // peer's, or not a number, is refused by the service (403 or 400).
    let hops = match hops {
        None => Some(0),
        Some(_) if hops_repeated => None,
        Some(v) => headers::peer_token_valid(&app.secret, peer_token)
            .then(|| headers::hop_count(v))
            .flatten(),
    };
    if let (Some(hops), "POST") = (hops, method) {
        if let Some(id) = hot_append_id(path) {
            if api::hot_append_serves(app, id, hops) {
                return Parsed::Head(Head {
                    len,
                    body_len,
                    kind: Kind::HotAppend {
                        id,
                        hops,
                        // `path` is a slice of `buf`.
                        path: {
                            let at = path.as_ptr() as usize - buf.as_ptr() as usize;
                            at..at + path.len()
                        },
                    },
                });
            }
        }
    }
    match plain_parts(method, path, req.headers) {
        Some(parts) => Parsed::Head(Head {
            len,
            body_len,
            kind: Kind::Plain(Box::new(parts)),
        }),
        None => Parsed::Other,
    }
}

/// The id of `/api/executions/{id}/events` when it is plain digits that
/// make a valid id (anything else is the router's to answer).
fn hot_append_id(path: &str) -> Option<ExecutionId> {
    api::parse_id(api::hot_append_digits(path)?).ok()
}

/// The request as hyper would have handed it to the service, or `None` if
/// any part of it is not valid for `http` (hyper then refuses it itself).
fn plain_parts(
    method: &str,
    path: &str,
    headers: &[httparse::Header<'_>],
) -> Option<http::request::Parts> {
    let mut b = http::Request::builder()
        .method(method)
        .uri(path)
        .version(http::Version::HTTP_11);
    let map = b.headers_mut()?;
    map.reserve(headers.len());
    for h in headers {
        let name = header::HeaderName::from_bytes(h.name.as_bytes()).ok()?;
        let value = header::HeaderValue::from_bytes(h.value).ok()?;
        map.append(name, value);
    }
    Some(b.body(()).ok()?.into_parts().0)
}

const CRLF: &[u8] = b"\r\n";

/// A successful hot append's answer, with the headers the general path
/// would have put on it.
fn write_appended(app: &App, out: &mut Vec<u8>, body: &[u8], route: &RouteHeaders) {
    out.extend_from_slice(b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\n");
    let mut n = itoa::Buffer::new();
    for (name, v) in route.pairs() {
        push_header(out, name.as_str().as_bytes(), n.format(v).as_bytes());
    }
    push_header(
        out,
        crate::NODE_HEADER.as_bytes(),
        app.node_header.as_bytes(),
    );
    push_header(out, b"content-length", n.format(body.len()).as_bytes());
    push_date(out);
    out.extend_from_slice(CRLF);
    out.extend_from_slice(body);
}

/// Any answer of the service, its body collected (every answer of this API
/// is a complete body, long-polls included: they answer once).
/// A body larger than [`BUF_KEEP_MAX`] is not copied into `out`: it is
/// returned, to be written after it ([`Conn::write_answer`]); else the
/// returned bytes are empty.
async fn write_response(resp: Response, out: &mut Vec<u8>) -> Result<Bytes, axum::Error> {
    let (parts, body) = resp.into_parts();
    let body = axum::body::to_bytes(body, usize::MAX).await?;
    let status = parts.status;
    out.extend_from_slice(b"HTTP/1.1 ");
    out.extend_from_slice(status.as_str().as_bytes());
    out.push(b' ');
    out.extend_from_slice(status.canonical_reason().unwrap_or("").as_bytes());
    out.extend_from_slice(CRLF);
    for (name, value) in &parts.headers {
        if name == header::CONTENT_LENGTH
            || name == header::TRANSFER_ENCODING
            || name == header::CONNECTION
            || name == header::DATE
        {
            continue;
        }
        push_header(out, name.as_str().as_bytes(), value.as_bytes());
    }
    let bodiless = status.is_informational()
        || status == http::StatusCode::NO_CONTENT
        || status == http::StatusCode::NOT_MODIFIED;
    if !bodiless {
        let mut n = itoa::Buffer::new();
        push_header(out, b"content-length", n.format(body.len()).as_bytes());
    }
    push_date(out);
    out.extend_from_slice(CRLF);
    if bodiless {
        return Ok(Bytes::new());
    }
    if body.len() > BUF_KEEP_MAX {
        return Ok(body);
    }
    out.extend_from_slice(&body);
    Ok(Bytes::new())
}

fn push_header(out: &mut Vec<u8>, name: &[u8], value: &[u8]) {
    out.extend_from_slice(name);
    out.extend_from_slice(b": ");
    out.extend_from_slice(value);
    out.extend_from_slice(CRLF);
}

/// The `date` header, formatted once a second per thread.
fn push_date(out: &mut Vec<u8>) {
    use std::cell::RefCell;
    use std::time::{SystemTime, UNIX_EPOCH};
    thread_local! {
        static DATE: RefCell<(u64, String)> = const { RefCell::new((u64::MAX, String::new())) };
    }
    let now = SystemTime::now();
    let secs = now
        .duration_since(UNIX_EPOCH)
        .map(|d| d.as_secs())
        .unwrap_or(0);
    DATE.with_borrow_mut(|(at, text)| {
        if *at != secs {
            *at = secs;
            *text = httpdate::fmt_http_date(now);
        }
        push_header(out, b"date", text.as_bytes());
    });
}

/// The socket, with the bytes already read from it put back in front, and
/// writes that make no progress for `write_timeout` failed (`TimedOut`), so
/// hyper drops a connection whose client does not read its answers.
struct Rewind {
    unread: Bytes,
    tcp: TcpStream,
    write_timeout: Duration,
    /// Armed while a write is blocked.
    stalled: Option<Pin<Box<tokio::time::Sleep>>>,
}

impl Rewind {
    /// Passes a write's outcome on, failing it once it has been blocked for
    /// the write timeout.
    fn bound<T>(&mut self, cx: &mut Context<'_>, r: Poll<io::Result<T>>) -> Poll<io::Result<T>> {
        if r.is_ready() {
            self.stalled = None;
            return r;
        }
        let timeout = self.write_timeout;
        let sleep = self
            .stalled
            .get_or_insert_with(|| Box::pin(tokio::time::sleep(timeout)));
        match sleep.as_mut().poll(cx) {
            Poll::Ready(()) => {
                self.stalled = None;
                Poll::Ready(Err(io::Error::new(
                    io::ErrorKind::TimedOut,
                    "the client took none of its answer within the write timeout",
                )))
            }
            Poll::Pending => Poll::Pending,
        }
    }
}

impl AsyncRead for Rewind {
    fn poll_read(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<io::Result<()>> {
        let this = self.get_mut();
        if !this.unread.is_empty() {
            let n = this.unread.len().min(buf.remaining());
            buf.put_slice(&this.unread[..n]);
            this.unread.advance(n);
            return Poll::Ready(Ok(()));
        }
        Pin::new(&mut this.tcp).poll_read(cx, buf)
    }
}

impl AsyncWrite for Rewind {
    fn poll_write(self: Pin<&mut Self>, cx: &mut Context<'_>, b: &[u8]) -> Poll<io::Result<usize>> {
        let this = self.get_mut();
        let r = Pin::new(&mut this.tcp).poll_write(cx, b);
        this.bound(cx, r)
    }
    fn poll_write_vectored(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        bufs: &[io::IoSlice<'_>],
    ) -> Poll<io::Result<usize>> {
        let this = self.get_mut();
        let r = Pin::new(&mut this.tcp).poll_write_vectored(cx, bufs);
        this.bound(cx, r)
    }
    fn is_write_vectored(&self) -> bool {
        self.tcp.is_write_vectored()
    }
    fn poll_flush(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        let this = self.get_mut();
        let r = Pin::new(&mut this.tcp).poll_flush(cx);
        this.bound(cx, r)
    }
    fn poll_shutdown(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.get_mut().tcp).poll_shutdown(cx)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// How many bytes of a 300 KB answer held against a budget a client
    /// had taken from hyper (through a 16 KiB pipe, read a KiB at a time)
    /// when the answer was let go, with hyper set up as `builder`.
    async fn let_go_at(builder: hyper::server::conn::http1::Builder) -> usize {
        use tokio::io::{AsyncReadExt, AsyncWriteExt};
        const LEN: usize = 300_000;
        let budget = Arc::new(ByteBudget::new(
            1 << 20,
            Default::default(),
            Default::default(),
        ));
        let full = budget.room();
        let (mut client, server) = tokio::io::duplex(16 * 1024);
        let b = budget.clone();
        let service = hyper::service::service_fn(move |_: http::Request<hyper::body::Incoming>| {
            let b = b.clone();
            async move {
                let answer = Response::new(Body::from(vec![b'x'; LEN]));
                let resp = crate::budget::hold_answer(&b, answer).await;
                Ok::<_, Infallible>(resp.map(|body| {
                    Body::new(Stepped {
                        inner: body,
                        pending: Bytes::new(),
                    })
                }))
            }
        });
        tokio::spawn(builder.serve_connection(hyper_util::rt::TokioIo::new(server), service));
        client
            .write_all(b"GET / HTTP/1.1\r\nhost: x\r\n\r\n")
            .await
            .unwrap();
        // The answer is made (and held) before its first byte is sent.
        let (mut got, mut buf, mut let_go_at) = (0, [0u8; 1024], None);
        while got < LEN {
            let n = client.read(&mut buf).await.unwrap();
            assert!(n > 0, "the answer ended after {got} bytes");
            got += n;
            if let_go_at.is_none() && budget.room() == full {
                let_go_at = Some(got);
            }
        }
        assert_eq!(budget.room(), full, "the answer let go once written");
        let_go_at.unwrap_or(got)
    }

    /// hyper lets a large answer go, and what it holds of its listener's
    /// budget, only once all of it but what hyper's buffer, one step and
    /// the pipe hold has gone to the client: whether hyper queues the
    /// steps as they are (as on a socket) or copies them.
    #[tokio::test]
    async fn hyper_lets_a_large_answer_go_only_once_most_of_it_is_written() {
        let most_ahead = ANSWER_STEP + HYPER_BUF_MAX + 16 * 1024;
        let mut queued = hyper_server(Duration::from_secs(5));
        queued.writev(true);
        let at = let_go_at(queued).await;
        assert!(at >= 300_000 - most_ahead, "queued: let go at {at}");
        let mut copied = hyper_server(Duration::from_secs(5));
        copied.writev(false);
        let at = let_go_at(copied).await;
        assert!(at >= 300_000 - most_ahead, "copied: let go at {at}");
    }

    #[test]
    fn an_answer_buffer_grown_by_a_large_answer_is_let_go() {
        let mut out = Vec::with_capacity(OUT_INITIAL);
        out.extend_from_slice(&[0u8; 1000]);
        shrink_answer_buffer(&mut out);
        assert!(out.capacity() >= 1000, "a small one is kept");
        out.clear();
        out.extend_from_slice(&vec![0u8; 4 << 20]);
        out.clear();
        shrink_answer_buffer(&mut out);
        assert!(out.capacity() <= BUF_KEEP_MAX, "{}", out.capacity());
    }

    #[test]
    fn content_length_takes_plain_decimal_digits_only() {
        assert_eq!(content_length(b"0"), Some(0));
        assert_eq!(content_length(b"312"), Some(312));
        for bad in [
            &b""[..],
            b"+1",
            b"-1",
            b" 1",
            b"1,1",
            b"0x10",
            b"99999999999999999999",
        ] {
            assert_eq!(
                content_length(bad),
                None,
                "{:?}",
                String::from_utf8_lossy(bad)
            );
        }
    }

    #[test]
    fn hot_append_id_takes_the_digits_path_only() {
        assert!(hot_append_id("/api/executions/12/events").is_some());
        for p in [
            "/api/executions//events",
            "/api/executions/12/events?x=1",
            "/api/executions/1%32/events",
            "/api/executions/12/events/",
            "/api/executions/12/signals",
            "/api/executions/99999999999999999999999/events",
        ] {
            assert!(hot_append_id(p).is_none(), "{p}");
        }
    }

    #[test]
    fn plain_parts_are_what_hyper_would_build() {
        let h = [
            httparse::Header {
                name: "Content-Type",
                value: b"application/json",
            },
            httparse::Header {
                name: "X-A",
                value: b"1",
            },
            httparse::Header {
                name: "x-a",
                value: b"2",
            },
        ];
        let p = plain_parts("GET", "/api/cluster?x=1", &h).expect("valid");
        assert_eq!(p.method, http::Method::GET);
        assert_eq!(p.uri.path(), "/api/cluster");
        assert_eq!(p.uri.query(), Some("x=1"));
        assert_eq!(p.version, http::Version::HTTP_11);
        assert_eq!(p.headers["content-type"], "application/json");
        let all: Vec<_> = p.headers.get_all("x-a").iter().collect();
        assert_eq!(all, ["1", "2"]);
        let bad = [httparse::Header {
            name: "x",
            value: b"a\x7fb",
        }];
        assert!(plain_parts("GET", "/", &bad).is_none());
    }

    #[tokio::test]
    async fn rewind_gives_the_unread_bytes_back_first() {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
            .await
            .expect("bind");
        let addr = listener.local_addr().expect("addr");
        let client = tokio::spawn(async move {
            let mut s = TcpStream::connect(addr).await.expect("connect");
            s.write_all(b" world").await.expect("write");
        });
        let (tcp, _) = listener.accept().await.expect("accept");
        let mut r = Rewind {
            unread: Bytes::from_static(b"hello"),
            tcp,
            write_timeout: Duration::from_secs(1),
            stalled: None,
        };
        let mut got = Vec::new();
        r.read_to_end(&mut got).await.expect("read");
        client.await.expect("client");
        assert_eq!(got, b"hello world");
    }

    #[tokio::test]
    async fn written_answers_carry_status_headers_length_and_date() {
        let resp = Response::builder()
            .status(http::StatusCode::CONFLICT)
            .header("content-type", "application/json")
            .header("content-length", "999")
            .body(Body::from("{\"error\":\"x\"}"))
            .expect("response");
        let mut out = Vec::new();
        let tail = write_response(resp, &mut out).await.expect("write");
        out.extend_from_slice(&tail);
        let text = String::from_utf8(out).expect("utf8");
        assert!(text.starts_with("HTTP/1.1 409 Conflict\r\n"), "{text}");
        assert!(
            text.contains("content-type: application/json\r\n"),
            "{text}"
        );
        assert!(text.contains("content-length: 13\r\n"), "{text}");
        assert!(!text.contains("999"), "{text}");
        assert!(text.contains("\r\ndate: "), "{text}");
        assert!(text.ends_with("\r\n\r\n{\"error\":\"x\"}"), "{text}");
    }
}
