//! A minimal HTTP/1.1 keep-alive client for the load loop: one request in
//! flight per connection, written with one `write` and read back in the
//! same task.
//!
//! A general client (hyper's) drives each connection from its own task and
//! hands every request and answer across a channel; at tens of thousands of
//! appends a second on two cores that hand-off costs as much CPU as the
//! server's own HTTP work, and the load generator shares the cores with the
//! server it measures. This client does only what the benchmark needs:
//! `POST` with a body, an answer framed by `Content-Length` (what forkless
//! sends), parsed by `httparse`. Anything else - chunked framing, an
//! interim `1xx`, `Connection: close`, bytes after the answer - is a
//! transport error or closes the connection; it is never guessed at.

use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;

use crate::AppendError;

/// Most header lines read in an answer.
const MAX_HEADERS: usize = 32;
/// Largest answer (head and body) read, in bytes.
const MAX_ANSWER_BYTES: usize = 64 * 1024;

/// One keep-alive connection, opened on first use and again after it
/// broke.
pub struct Http1Conn {
    addr: String,
    authority: String,
    stream: Option<TcpStream>,
    request: Vec<u8>,
    answer: Vec<u8>,
}

/// An answer: its status and body.
pub struct Answer<'a> {
    pub status: u16,
    pub body: &'a [u8],
}

impl Http1Conn {
    /// A connection to `addr` (`host:port`), sending `authority` as `Host`.
    pub fn new(addr: String, authority: String) -> Self {
        Self {
            addr,
            authority,
            stream: None,
            request: Vec::with_capacity(1024),
            answer: Vec::with_capacity(4096),
        }
    }

    /// Opens the connection now unless it is open.
    pub async fn connect(&mut self) -> Result<(), AppendError> {
        if self.stream.is_none() {
            let stream = TcpStream::connect(&self.addr)
                .await
                .map_err(|e| AppendError::Transport(format!("connect {}: {e}", self.addr)))?;
            stream
                .set_nodelay(true)
                .map_err(|e| AppendError::Transport(format!("set_nodelay: {e}")))?;
            self.stream = Some(stream);
        }
        Ok(())
    }

    /// Sends `POST path` with a JSON `body` and reads the whole answer. On
    /// any error the connection is dropped; the next call opens a new one.
    pub async fn post(&mut self, path: &str, body: &[u8]) -> Result<Answer<'_>, AppendError> {
        self.connect().await?;
        match self.exchange(path, body).await {
            Ok((status, body_at, keep)) => {
                if !keep {
                    self.stream = None;
                }
                Ok(Answer {
                    status,
                    body: &self.answer[body_at..],
                })
            }
            Err(e) => {
                self.stream = None;
                Err(e)
            }
        }
    }

    /// Returns the status, where the body starts in `self.answer`, and
    /// whether the connection may carry another request.
    async fn exchange(
        &mut self,
        path: &str,
        body: &[u8],
    ) -> Result<(u16, usize, bool), AppendError> {
        let Some(stream) = self.stream.as_mut() else {
            return Err(AppendError::Transport("not connected".into()));
        };
        self.request.clear();
        self.request.extend_from_slice(b"POST ");
        self.request.extend_from_slice(path.as_bytes());
        self.request.extend_from_slice(b" HTTP/1.1\r\nhost: ");
        self.request.extend_from_slice(self.authority.as_bytes());
        self.request
            .extend_from_slice(b"\r\ncontent-type: application/json\r\ncontent-length: ");
        self.request
            .extend_from_slice(body.len().to_string().as_bytes());
        self.request.extend_from_slice(b"\r\n\r\n");
        self.request.extend_from_slice(body);
        stream
            .write_all(&self.request)
            .await
            .map_err(|e| AppendError::Transport(format!("sending: {e}")))?;

        self.answer.clear();
        let mut chunk = [0u8; 4096];
        loop {
            let n = stream
                .read(&mut chunk)
                .await
                .map_err(|e| AppendError::Transport(format!("reading the answer: {e}")))?;
            if n == 0 {
                return Err(AppendError::Transport(
                    "connection closed before a whole answer".into(),
                ));
            }
            self.answer.extend_from_slice(&chunk[..n]);
            if let Some(done) = parse_answer(&self.answer)? {
                if self.answer.len() > done.body_at + done.body_len {
                    return Err(AppendError::Transport(format!(
                        "{} bytes after the answer, none asked for",
                        self.answer.len() - done.body_at - done.body_len
                    )));
                }
                if self.answer.len() == done.body_at + done.body_len {
                    return Ok((done.status, done.body_at, done.keep_alive));
                }
            }
            if self.answer.len() > MAX_ANSWER_BYTES {
                return Err(AppendError::Transport(format!(
                    "answer larger than {MAX_ANSWER_BYTES} bytes"
                )));
            }
        }
    }
}

/// What the head of an answer says about its framing.
#[derive(Debug, PartialEq)]
struct Framing {
    status: u16,
    body_at: usize,
    body_len: usize,
    keep_alive: bool,
}

/// The framing of the answer in `buf`, or `None` while its head is still
/// incomplete.
fn parse_answer(buf: &[u8]) -> Result<Option<Framing>, AppendError> {
    let mut headers = [httparse::EMPTY_HEADER; MAX_HEADERS];
    let mut resp = httparse::Response::new(&mut headers);
    let body_at = match resp.parse(buf) {
        Ok(httparse::Status::Complete(n)) => n,
        Ok(httparse::Status::Partial) => return Ok(None),
        Err(e) => {
            return Err(AppendError::BadAnswer(format!(
                "malformed HTTP answer: {e}"
            )))
        }
    };
    let status = resp.code.unwrap_or(0);
    if !(200..=599).contains(&status) {
        return Err(AppendError::BadAnswer(format!(
            "HTTP status {status} is not a final answer"
        )));
    }
    let mut body_len = None;
    let mut keep_alive = resp.version == Some(1);
    for h in resp.headers.iter() {
        if h.name.eq_ignore_ascii_case("content-length") {
            let n = std::str::from_utf8(h.value)
                .ok()
                .and_then(|s| s.trim().parse::<usize>().ok())
                .ok_or_else(|| AppendError::BadAnswer("unreadable content-length".into()))?;
            if body_len.is_some_and(|m| m != n) {
                return Err(AppendError::BadAnswer(
                    "two different content-lengths".into(),
                ));
            }
            body_len = Some(n);
        } else if h.name.eq_ignore_ascii_case("transfer-encoding") {
            return Err(AppendError::BadAnswer(
                "answer uses transfer-encoding; this client reads only content-length".into(),
            ));
        } else if h.name.eq_ignore_ascii_case("connection") {
            let v = String::from_utf8_lossy(h.value).to_ascii_lowercase();
            if v.split(',').any(|t| t.trim() == "close") {
                keep_alive = false;
            }
        }
    }
    let body_len =
        body_len.ok_or_else(|| AppendError::BadAnswer("answer without content-length".into()))?;
    if body_len > MAX_ANSWER_BYTES {
        return Err(AppendError::BadAnswer(format!(
            "answer body of {body_len} bytes, over {MAX_ANSWER_BYTES}"
        )));
    }
    Ok(Some(Framing {
        status,
        body_at,
        body_len,
        keep_alive,
    }))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn partial_head_waits_for_more() {
        assert_eq!(
            parse_answer(b"HTTP/1.1 200 OK\r\ncontent-le").ok(),
            Some(None)
        );
    }

    #[test]
    fn content_length_frames_the_body() {
        let f = parse_answer(b"HTTP/1.1 201 Created\r\nContent-Length: 2\r\n\r\n{}")
            .ok()
            .flatten();
        assert_eq!(
            f,
            Some(Framing {
                status: 201,
                body_at: 43,
                body_len: 2,
                keep_alive: true
            })
        );
    }

    #[test]
    fn close_and_http10_end_keep_alive() {
        let close =
            parse_answer(b"HTTP/1.1 200 OK\r\nconnection: close\r\ncontent-length: 0\r\n\r\n");
        assert!(matches!(
            close,
            Ok(Some(Framing {
                keep_alive: false,
                ..
            }))
        ));
        let old = parse_answer(b"HTTP/1.0 200 OK\r\ncontent-length: 0\r\n\r\n");
        assert!(matches!(
            old,
            Ok(Some(Framing {
                keep_alive: false,
                ..
            }))
        ));
    }

    #[test]
    fn unsupported_framing_is_an_error_not_a_guess() {
        for bad in [
            &b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n"[..],
            b"HTTP/1.1 200 OK\r\n\r\n",
            b"HTTP/1.1 200 OK\r\ncontent-length: 1\r\ncontent-length: 2\r\n\r\n",
            b"HTTP/1.1 100 Continue\r\n\r\n",
            b"HTTP/1.1 200 OK\r\ncontent-length: x\r\n\r\n",
            b"NOT HTTP\r\n\r\n",
        ] {
            assert!(
                parse_answer(bad).is_err(),
                "{}",
                String::from_utf8_lossy(bad)
            );
        }
    }

    #[tokio::test]
    async fn exchanges_over_one_connection_and_reconnects_after_close() {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap().to_string();
        let server = tokio::spawn(async move {
            let mut accepted = 0;
            // First connection: two keep-alive exchanges, the second says close.
            // Second connection: one exchange.
            for answers in [2usize, 1] {
                let (mut s, _) = listener.accept().await.unwrap();
                accepted += 1;
                for i in 0..answers {
                    let mut buf = vec![0u8; 4096];
                    let mut got = Vec::new();
                    // Read one whole request: head, then a 2-byte body.
                    loop {
                        let n = s.read(&mut buf).await.unwrap();
                        got.extend_from_slice(&buf[..n]);
                        if let Some(at) = got.windows(4).position(|w| w == b"\r\n\r\n") {
                            if got.len() >= at + 4 + 2 {
                                break;
                            }
                        }
                    }
                    assert!(got.starts_with(b"POST /p HTTP/1.1\r\nhost: h\r\n"));
                    let close = answers == 2 && i == 1;
                    let head = if close { "connection: close\r\n" } else { "" };
                    s.write_all(
                        format!("HTTP/1.1 200 OK\r\n{head}content-length: 7\r\n\r\n{{\"n\":{i}}}")
                            .as_bytes(),
                    )
                    .await
                    .unwrap();
                }
            }
            accepted
        });
        let mut c = Http1Conn::new(addr, "h".into());
        for want in ["{\"n\":0}", "{\"n\":1}", "{\"n\":0}"] {
            let a = c.post("/p", b"{}").await.unwrap();
            assert_eq!(a.status, 200);
            assert_eq!(a.body, want.as_bytes());
        }
        assert_eq!(server.await.unwrap(), 2);
    }
}
