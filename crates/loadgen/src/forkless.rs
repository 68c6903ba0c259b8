//! The forkless adapter over plain HTTP/1.1 keep-alive: one connection per
//! client, `expected_last_seq` as the order check.
//!
//! Each key is one execution started in [`Target::setup`]; the start writes
//! event 1, so this run's append number `seq` expects `last_seq == seq` and
//! must be acknowledged as `first_seq == last_seq == seq + 1`.

use std::sync::Arc;

use bytes::Bytes;
use http::{Method, Request, StatusCode, Uri};
use http_body_util::{BodyExt, Full};
use hyper::client::conn::http1::{self, SendRequest};
use hyper_util::rt::TokioIo;
use serde_json::Value;
use tokio::net::TcpStream;

use crate::{AppendError, Connection, Payload, SetupError, Target};

/// Executions started in parallel during setup.
const SETUP_CONCURRENCY: usize = 16;
/// Largest answer body read, in bytes.
const MAX_ANSWER_BYTES: usize = 64 * 1024;

/// A forkless node reached over HTTP at `base` (e.g. `http://127.0.0.1:7400`).
pub struct ForklessHttp {
    server: Server,
    workflow: String,
    executions: Arc<Vec<String>>,
}

/// Where the node listens.
#[derive(Clone, Debug)]
struct Server {
    /// `host:port` to connect to.
    addr: String,
    /// The `Host` header.
    authority: String,
}

impl ForklessHttp {
    /// A target at `base`, an `http://host:port` URL without a path.
    pub fn new(base: &str) -> Result<Self, SetupError> {
        let base = base.trim_end_matches('/');
        let uri: Uri = base
            .parse()
            .map_err(|e| SetupError(format!("bad forkless URL {base:?}: {e}")))?;
        let (Some("http"), Some(authority), Some(host)) =
            (uri.scheme_str(), uri.authority(), uri.host())
        else {
            return Err(SetupError(format!(
                "forkless URL must be http://host:port, got {base:?}"
            )));
        };
        if !uri.path().is_empty() && uri.path() != "/" {
            return Err(SetupError(format!(
                "forkless URL must have no path, got {base:?}"
            )));
        }
        let port = uri.port_u16().unwrap_or(80);
        let host = host.trim_start_matches('[').trim_end_matches(']');
        let addr = if host.contains(':') {
            format!("[{host}]:{port}")
        } else {
            format!("{host}:{port}")
        };
        Ok(Self {
            server: Server {
                addr,
                authority: authority.to_string(),
            },
            workflow: "bench".into(),
            executions: Arc::default(),
        })
    }

    /// The execution ids of the keys, after setup.
    pub fn executions(&self) -> &[String] {
        &self.executions
    }
}

/// One HTTP/1.1 keep-alive connection, opened on first use and again after
/// it broke; never more than one at a time.
struct HttpConn {
    server: Server,
    sender: Option<SendRequest<Full<Bytes>>>,
}

impl HttpConn {
    fn new(server: Server) -> Self {
        Self {
            server,
            sender: None,
        }
    }

    async fn open(&self) -> Result<SendRequest<Full<Bytes>>, AppendError> {
        let stream = TcpStream::connect(&self.server.addr)
            .await
            .map_err(|e| AppendError::Transport(format!("connect {}: {e}", self.server.addr)))?;
        stream
            .set_nodelay(true)
            .map_err(|e| AppendError::Transport(e.to_string()))?;
        let (sender, conn) = http1::handshake(TokioIo::new(stream))
            .await
            .map_err(|e| AppendError::Transport(format!("handshake: {e}")))?;
        tokio::spawn(async move {
            // Ends when the connection closes; errors surface on the sender.
            let _ = conn.await;
        });
        Ok(sender)
    }

    /// Sends one JSON POST and returns the status and the parsed body.
    async fn post(&mut self, path: &str, body: Bytes) -> Result<(StatusCode, Value), AppendError> {
        let mut sender = match self.sender.take() {
            Some(s) if !s.is_closed() => s,
            _ => self.open().await?,
        };
        sender
            .ready()
            .await
            .map_err(|e| AppendError::Transport(e.to_string()))?;
        let req = Request::builder()
            .method(Method::POST)
            .uri(path)
            .header(http::header::HOST, &self.server.authority)
            .header(http::header::CONTENT_TYPE, "application/json")
            .body(Full::new(body))
            .map_err(|e| AppendError::Transport(format!("building request: {e}")))?;
        let resp = sender
            .send_request(req)
            .await
            .map_err(|e| AppendError::Transport(e.to_string()))?;
        let status = resp.status();
        let body = http_body_util::Limited::new(resp.into_body(), MAX_ANSWER_BYTES)
            .collect()
            .await
            .map_err(|e| AppendError::Transport(format!("reading answer: {e}")))?
            .to_bytes();
        // The answer was read whole: the connection can carry the next request.
        self.sender = Some(sender);
        let value = serde_json::from_slice(&body).map_err(|e| {
            AppendError::BadAnswer(format!(
                "HTTP {status}, body not JSON ({e}): {}",
                String::from_utf8_lossy(&body[..body.len().min(200)])
            ))
        })?;
        Ok((status, value))
    }
}

fn error_text(status: StatusCode, v: &Value) -> String {
    let code = v.get("error").and_then(Value::as_str).unwrap_or("?");
    let msg = v.get("message").and_then(Value::as_str).unwrap_or("");
    format!("HTTP {status} {code}: {msg}")
}

async fn start_execution(conn: &mut HttpConn, workflow: &str) -> Result<String, SetupError> {
    let body = serde_json::to_vec(&serde_json::json!({ "workflow": workflow }))
        .map_err(SetupError::new)?;
    let (status, v) = conn
        .post("/api/executions", body.into())
        .await
        .map_err(|e| SetupError(format!("starting an execution: {e}")))?;
    if status != StatusCode::CREATED && status != StatusCode::OK {
        return Err(SetupError(format!(
            "starting an execution: {}",
            error_text(status, &v)
        )));
    }
    match v.get("execution_id") {
        Some(Value::String(s)) if !s.is_empty() && s.bytes().all(|b| b.is_ascii_digit()) => {
            Ok(s.clone())
        }
        Some(Value::Number(n)) => Ok(n.to_string()),
        other => Err(SetupError(format!(
            "start answered without a decimal execution_id: {other:?}"
        ))),
    }
}

impl Target for ForklessHttp {
    type Conn = ForklessConn;

    fn name(&self) -> String {
        "forkless".into()
    }

    async fn setup(&mut self, keys: usize) -> Result<(), SetupError> {
        let mut tasks = Vec::new();
        for worker in 0..SETUP_CONCURRENCY.min(keys) {
            let mut conn = HttpConn::new(self.server.clone());
            let workflow = self.workflow.clone();
            tasks.push(tokio::spawn(async move {
                let mut ids = Vec::new();
                for k in (worker..keys).step_by(SETUP_CONCURRENCY) {
                    ids.push((k, start_execution(&mut conn, &workflow).await?));
                }
                Ok::<_, SetupError>(ids)
            }));
        }
        let mut ids = vec![String::new(); keys];
        for t in tasks {
            for (k, id) in t.await.map_err(SetupError::new)?? {
                ids[k] = id;
            }
        }
        self.executions = Arc::new(ids);
        Ok(())
    }

    async fn connect(&self, _client: usize) -> Result<ForklessConn, SetupError> {
        let paths = self
            .executions
            .iter()
            .map(|id| format!("/api/executions/{id}/events"))
            .collect();
        let mut conn = HttpConn::new(self.server.clone());
        // Connect now, so a run never measures connection set-up.
        conn.sender = Some(conn.open().await.map_err(SetupError::new)?);
        Ok(ForklessConn { conn, paths })
    }
}

/// The body of one benchmark append: one `bench.tick` event carrying
/// `payload`, checked against `expected_last_seq`.
pub fn append_body(payload: &Payload, expected_last: u64) -> Vec<u8> {
    let mut body = Vec::with_capacity(payload.len() + 96);
    body.extend_from_slice(br#"{"events":[{"type":"bench.tick","payload":"#);
    body.extend_from_slice(payload.as_bytes());
    body.extend_from_slice(format!(r#"}}],"expected_last_seq":{expected_last}}}"#).as_bytes());
    body
}

/// Checks an acknowledgement of [`append_body`]: exactly one event, right
/// after `expected_last`.
pub fn check_ack(
    expected_last: u64,
    first: Option<u64>,
    last: Option<u64>,
) -> Result<(), AppendError> {
    let want = expected_last + 1;
    if first == Some(want) && last == Some(want) {
        return Ok(());
    }
    Err(AppendError::BadAnswer(format!(
        "expected first_seq = last_seq = {want}, got {first:?} / {last:?}"
    )))
}

/// One client's keep-alive connection to a forkless node.
pub struct ForklessConn {
    conn: HttpConn,
    paths: Vec<String>,
}

impl Connection for ForklessConn {
    async fn append(&mut self, key: usize, seq: u64, payload: &Payload) -> Result<(), AppendError> {
        let path = self
            .paths
            .get(key)
            .ok_or_else(|| AppendError::Refused(format!("no execution for key {key}")))?;
        // The start wrote event 1, so this run's append `seq` follows event `seq`.
        let expected_last = seq;
        let body = append_body(payload, expected_last);
        let (status, v) = self.conn.post(path, body.into()).await?;
        if status.is_success() {
            let first = v.get("first_seq").and_then(Value::as_u64);
            let last = v.get("last_seq").and_then(Value::as_u64);
            return check_ack(expected_last, first, last);
        }
        if status == StatusCode::CONFLICT
            && v.get("error").and_then(Value::as_str) == Some("sequence_conflict")
        {
            return Err(AppendError::Conflict(format!(
                "expected last_seq {expected_last}, server has {:?}",
                v.get("last_seq")
            )));
        }
        Err(AppendError::Refused(error_text(status, &v)))
    }
}
