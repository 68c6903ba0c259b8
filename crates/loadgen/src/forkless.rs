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
use hyper_util::client::legacy::connect::HttpConnector;
use hyper_util::client::legacy::Client;
use hyper_util::rt::TokioExecutor;
use serde_json::Value;

use crate::{AppendError, Connection, Payload, SetupError, Target};

/// Executions started in parallel during setup.
const SETUP_CONCURRENCY: usize = 16;
/// Largest answer body read, in bytes.
const MAX_ANSWER_BYTES: usize = 64 * 1024;

type HttpClient = Client<HttpConnector, Full<Bytes>>;

/// A forkless node reached over HTTP at `base` (e.g. `http://127.0.0.1:7400`).
pub struct ForklessHttp {
    base: String,
    workflow: String,
    executions: Arc<Vec<String>>,
}

impl ForklessHttp {
    /// A target at `base`, an `http://host:port` URL without a path.
    pub fn new(base: &str) -> Result<Self, SetupError> {
        let base = base.trim_end_matches('/').to_string();
        let uri: Uri = base
            .parse()
            .map_err(|e| SetupError(format!("bad forkless URL {base:?}: {e}")))?;
        if uri.scheme_str() != Some("http") || uri.host().is_none() {
            return Err(SetupError(format!(
                "forkless URL must be http://host:port, got {base:?}"
            )));
        }
        Ok(Self {
            base,
            workflow: "bench".into(),
            executions: Arc::default(),
        })
    }

    /// The execution ids of the keys, after setup.
    pub fn executions(&self) -> &[String] {
        &self.executions
    }
}

fn client() -> HttpClient {
    let mut connector = HttpConnector::new();
    connector.set_nodelay(true);
    Client::builder(TokioExecutor::new())
        .pool_max_idle_per_host(1)
        .build(connector)
}

/// Sends one JSON request and returns the status and the parsed body.
async fn call(
    client: &HttpClient,
    uri: &str,
    body: Bytes,
) -> Result<(StatusCode, Value), AppendError> {
    let req = Request::builder()
        .method(Method::POST)
        .uri(uri)
        .header(http::header::CONTENT_TYPE, "application/json")
        .body(Full::new(body))
        .map_err(|e| AppendError::Transport(format!("building request: {e}")))?;
    let resp = client
        .request(req)
        .await
        .map_err(|e| AppendError::Transport(e.to_string()))?;
    let status = resp.status();
    let body = http_body_util::Limited::new(resp.into_body(), MAX_ANSWER_BYTES)
        .collect()
        .await
        .map_err(|e| AppendError::Transport(format!("reading answer: {e}")))?
        .to_bytes();
    let value = serde_json::from_slice(&body).map_err(|e| {
        AppendError::BadAnswer(format!(
            "HTTP {status}, body not JSON ({e}): {}",
            String::from_utf8_lossy(&body[..body.len().min(200)])
        ))
    })?;
    Ok((status, value))
}

fn error_text(status: StatusCode, v: &Value) -> String {
    let code = v.get("error").and_then(Value::as_str).unwrap_or("?");
    let msg = v.get("message").and_then(Value::as_str).unwrap_or("");
    format!("HTTP {status} {code}: {msg}")
}

async fn start_execution(
    client: &HttpClient,
    base: &str,
    workflow: &str,
) -> Result<String, SetupError> {
    let body = serde_json::to_vec(&serde_json::json!({ "workflow": workflow }))
        .map_err(SetupError::new)?;
    let (status, v) = call(client, &format!("{base}/api/executions"), body.into())
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
            let base = self.base.clone();
            let workflow = self.workflow.clone();
            tasks.push(tokio::spawn(async move {
                let client = client();
                let mut ids = Vec::new();
                for k in (worker..keys).step_by(SETUP_CONCURRENCY) {
                    ids.push((k, start_execution(&client, &base, &workflow).await?));
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
        let uris = self
            .executions
            .iter()
            .map(|id| format!("{}/api/executions/{id}/events", self.base))
            .collect();
        Ok(ForklessConn {
            client: client(),
            uris,
        })
    }
}

/// One client's keep-alive connection to a forkless node.
pub struct ForklessConn {
    client: HttpClient,
    uris: Vec<String>,
}

impl Connection for ForklessConn {
    async fn append(&mut self, key: usize, seq: u64, payload: &Payload) -> Result<(), AppendError> {
        let uri = self
            .uris
            .get(key)
            .ok_or_else(|| AppendError::Refused(format!("no execution for key {key}")))?;
        // The start wrote event 1, so this run's append `seq` follows event `seq`.
        let expected_last = seq;
        let mut body = Vec::with_capacity(payload.len() + 96);
        body.extend_from_slice(br#"{"events":[{"type":"bench.tick","payload":"#);
        body.extend_from_slice(payload.as_bytes());
        body.extend_from_slice(format!(r#"}}],"expected_last_seq":{expected_last}}}"#).as_bytes());
        let (status, v) = call(&self.client, uri, body.into()).await?;
        if status.is_success() {
            let first = v.get("first_seq").and_then(Value::as_u64);
            let last = v.get("last_seq").and_then(Value::as_u64);
            let want = expected_last + 1;
            if first == Some(want) && last == Some(want) {
                return Ok(());
            }
            return Err(AppendError::BadAnswer(format!(
                "expected first_seq = last_seq = {want}, got {first:?} / {last:?}"
            )));
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
