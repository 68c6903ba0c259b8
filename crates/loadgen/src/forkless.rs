//! The forkless adapter over plain HTTP/1.1 keep-alive: one connection per
//! client, `expected_last_seq` as the order check.
//!
//! Each key is one execution started in [`Target::setup`]; the start writes
//! event 1, so this run's append number `seq` expects `last_seq == seq` and
//! must be acknowledged as `first_seq == last_seq == seq + 1`.

use std::sync::Arc;

use http::Uri;
use serde_json::Value;

use crate::http1::Http1Conn;
use crate::{AppendError, Connection, Payload, SetupError, Target};

/// Executions started in parallel during setup.
const SETUP_CONCURRENCY: usize = 16;

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

impl Server {
    fn conn(&self) -> Http1Conn {
        Http1Conn::new(self.addr.clone(), self.authority.clone())
    }
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

/// Sends one JSON POST and returns the status and the parsed body.
async fn post_json(
    conn: &mut Http1Conn,
    path: &str,
    body: &[u8],
) -> Result<(u16, Value), AppendError> {
    let answer = conn.post(path, body).await?;
    let value = parse_body(answer.status, answer.body)?;
    Ok((answer.status, value))
}

fn parse_body<'a, T: serde::Deserialize<'a>>(
    status: u16,
    body: &'a [u8],
) -> Result<T, AppendError> {
    serde_json::from_slice(body).map_err(|e| {
        AppendError::BadAnswer(format!(
            "HTTP {status}, body not the expected JSON ({e}): {}",
            String::from_utf8_lossy(&body[..body.len().min(200)])
        ))
    })
}

fn error_text(status: u16, v: &Value) -> String {
    let code = v.get("error").and_then(Value::as_str).unwrap_or("?");
    let msg = v.get("message").and_then(Value::as_str).unwrap_or("");
    format!("HTTP {status} {code}: {msg}")
}

async fn start_execution(conn: &mut Http1Conn, workflow: &str) -> Result<String, SetupError> {
    let body = serde_json::to_vec(&serde_json::json!({ "workflow": workflow }))
        .map_err(SetupError::new)?;
    let (status, v) = post_json(conn, "/api/executions", &body)
        .await
        .map_err(|e| SetupError(format!("starting an execution: {e}")))?;
    if status != 201 && status != 200 {
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
            let mut conn = self.server.conn();
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
        let mut conn = self.server.conn();
        // Connect now, so a run never measures connection set-up.
        conn.connect().await.map_err(SetupError::new)?;
        Ok(ForklessConn {
            conn,
            paths,
            body: Vec::new(),
        })
    }
}

/// The body of one benchmark append: one `bench.tick` event carrying
/// `payload`, checked against `expected_last_seq`.
pub fn append_body(payload: &Payload, expected_last: u64) -> Vec<u8> {
    let mut body = Vec::with_capacity(payload.len() + 96);
    write_append_body(&mut body, payload, expected_last);
    body
}

/// [`append_body`] into a buffer that is reused.
fn write_append_body(body: &mut Vec<u8>, payload: &Payload, expected_last: u64) {
    body.clear();
    body.extend_from_slice(br#"{"events":[{"type":"bench.tick","payload":"#);
    body.extend_from_slice(payload.as_bytes());
    body.extend_from_slice(br#"}],"expected_last_seq":"#);
    body.extend_from_slice(expected_last.to_string().as_bytes());
    body.push(b'}');
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
    conn: Http1Conn,
    paths: Vec<String>,
    /// The request body, reused.
    body: Vec<u8>,
}

/// The fields of an append's answer the benchmark looks at (success or
/// error).
#[derive(serde::Deserialize)]
struct AppendAnswer<'a> {
    first_seq: Option<u64>,
    last_seq: Option<u64>,
    #[serde(borrow)]
    error: Option<std::borrow::Cow<'a, str>>,
    #[serde(borrow)]
    message: Option<std::borrow::Cow<'a, str>>,
}

impl Connection for ForklessConn {
    async fn append(&mut self, key: usize, seq: u64, payload: &Payload) -> Result<(), AppendError> {
        let path = self
            .paths
            .get(key)
            .ok_or_else(|| AppendError::Refused(format!("no execution for key {key}")))?;
        // The start wrote event 1, so this run's append `seq` follows event `seq`.
        let expected_last = seq;
        write_append_body(&mut self.body, payload, expected_last);
        let answer = self.conn.post(path, &self.body).await?;
        let status = answer.status;
        let v: AppendAnswer = parse_body(status, answer.body)?;
        if (200..300).contains(&status) {
            return check_ack(expected_last, v.first_seq, v.last_seq);
        }
        if status == 409 && v.error.as_deref() == Some("sequence_conflict") {
            return Err(AppendError::Conflict(format!(
                "expected last_seq {expected_last}, server has {:?}",
                v.last_seq
            )));
        }
        Err(AppendError::Refused(format!(
            "HTTP {status} {}: {}",
            v.error.as_deref().unwrap_or("?"),
            v.message.as_deref().unwrap_or("")
        )))
    }
}
