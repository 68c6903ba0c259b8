//! One adapter per peer system, each over its maintained Rust client, each
//! carrying that system's own order check so an append that does not follow
//! the previous acknowledged one is refused.
//!
//! | system | key | order check | acknowledged when |
//! | --- | --- | --- | --- |
//! | Redis | stream `fl:<k>` | explicit entry id `0-<seq>` (XADD refuses an id not above the top) | XADD returns (with `appendfsync always`, after fsync) |
//! | PostgreSQL | rows `(execution, seq)` | primary key (a repeated seq fails) | INSERT commits (`synchronous_commit=on`) |
//! | NATS JetStream | subject `ev.<k>` | `Nats-Expected-Last-Subject-Sequence` = stream seq of the last ack | publish ack (with `sync_interval: always`, after fsync) |
//! | etcd | key `fl/<k>` | txn: mod revision equals the last one seen, then put | txn returns (etcd fsyncs its WAL) |

use std::collections::HashMap;

use forkless_loadgen::{AppendError, Connection, Payload, SetupError, Target};

// ---------------------------------------------------------------- Redis

/// Redis Streams, one stream per key.
pub struct Redis {
    url: String,
}

impl Redis {
    /// `url` like `redis://127.0.0.1:6390/`.
    pub fn new(url: &str) -> Self {
        Self { url: url.into() }
    }
    fn client(&self) -> Result<redis::Client, SetupError> {
        redis::Client::open(self.url.as_str()).map_err(SetupError::new)
    }
}

fn redis_key(k: usize) -> String {
    format!("fl:{k}")
}

impl Target for Redis {
    type Conn = RedisConn;
    fn name(&self) -> String {
        "redis".into()
    }
    async fn setup(&mut self, keys: usize) -> Result<(), SetupError> {
        let mut conn = self
            .client()?
            .get_multiplexed_async_connection()
            .await
            .map_err(SetupError::new)?;
        for chunk in (0..keys).collect::<Vec<_>>().chunks(100) {
            let mut cmd = redis::cmd("DEL");
            for k in chunk {
                cmd.arg(redis_key(*k));
            }
            cmd.query_async::<i64>(&mut conn)
                .await
                .map_err(SetupError::new)?;
        }
        Ok(())
    }
    async fn connect(&self, _client: usize) -> Result<RedisConn, SetupError> {
        let conn = self
            .client()?
            .get_multiplexed_async_connection()
            .await
            .map_err(SetupError::new)?;
        Ok(RedisConn { conn })
    }
}

/// One client's Redis connection.
pub struct RedisConn {
    conn: redis::aio::MultiplexedConnection,
}

impl Connection for RedisConn {
    async fn append(&mut self, key: usize, seq: u64, payload: &Payload) -> Result<(), AppendError> {
        let id = format!("0-{seq}");
        let answer: Result<String, redis::RedisError> = redis::cmd("XADD")
            .arg(redis_key(key))
            .arg(&id)
            .arg("event")
            .arg(payload.as_bytes().as_ref())
            .query_async(&mut self.conn)
            .await;
        match answer {
            Ok(got) if got == id => Ok(()),
            Ok(got) => Err(AppendError::BadAnswer(format!("XADD {id} answered {got}"))),
            Err(e) if e.to_string().contains("equal or smaller") => {
                Err(AppendError::Conflict(e.to_string()))
            }
            Err(e) if e.is_io_error() || e.is_connection_dropped() => {
                Err(AppendError::Transport(e.to_string()))
            }
            Err(e) => Err(AppendError::Refused(e.to_string())),
        }
    }
}

// ----------------------------------------------------------- PostgreSQL

/// PostgreSQL, one row per event, primary key (execution, seq).
pub struct Postgres {
    conninfo: String,
}

impl Postgres {
    /// `conninfo` like `host=127.0.0.1 port=5439 user=postgres dbname=postgres`
    /// or a `postgresql://` URL.
    pub fn new(conninfo: &str) -> Self {
        Self {
            conninfo: conninfo.into(),
        }
    }
    async fn client(&self) -> Result<tokio_postgres::Client, SetupError> {
        let (client, connection) = tokio_postgres::connect(&self.conninfo, tokio_postgres::NoTls)
            .await
            .map_err(SetupError::new)?;
        tokio::spawn(async move {
            if let Err(e) = connection.await {
                eprintln!("postgres connection ended: {e}");
            }
        });
        Ok(client)
    }
}

impl Target for Postgres {
    type Conn = PostgresConn;
    fn name(&self) -> String {
        "postgres".into()
    }
    async fn setup(&mut self, _keys: usize) -> Result<(), SetupError> {
        let client = self.client().await?;
        client
            .batch_execute(
                "DROP TABLE IF EXISTS events;
                 CREATE TABLE events (
                     execution bigint NOT NULL,
                     seq bigint NOT NULL,
                     payload jsonb NOT NULL,
                     PRIMARY KEY (execution, seq)
                 );",
            )
            .await
            .map_err(SetupError::new)?;
        Ok(())
    }
    async fn connect(&self, _client: usize) -> Result<PostgresConn, SetupError> {
        let client = self.client().await?;
        let insert = client
            .prepare("INSERT INTO events (execution, seq, payload) VALUES ($1, $2, $3)")
            .await
            .map_err(SetupError::new)?;
        Ok(PostgresConn {
            client,
            insert,
            payload: None,
        })
    }
}

/// One client's PostgreSQL connection.
pub struct PostgresConn {
    client: tokio_postgres::Client,
    insert: tokio_postgres::Statement,
    payload: Option<serde_json::Value>,
}

impl Connection for PostgresConn {
    async fn append(&mut self, key: usize, seq: u64, payload: &Payload) -> Result<(), AppendError> {
        if self.payload.is_none() {
            self.payload = Some(
                serde_json::from_slice(payload.as_bytes())
                    .map_err(|e| AppendError::Refused(format!("payload: {e}")))?,
            );
        }
        let value = self.payload.as_ref().unwrap_or(&serde_json::Value::Null);
        let key = key as i64;
        let seq = seq as i64;
        match self
            .client
            .execute(&self.insert, &[&key, &seq, value])
            .await
        {
            Ok(1) => Ok(()),
            Ok(n) => Err(AppendError::BadAnswer(format!("INSERT reported {n} rows"))),
            Err(e) if e.code() == Some(&tokio_postgres::error::SqlState::UNIQUE_VIOLATION) => {
                Err(AppendError::Conflict(e.to_string()))
            }
            Err(e) if e.is_closed() || e.code().is_none() => {
                Err(AppendError::Transport(e.to_string()))
            }
            Err(e) => Err(AppendError::Refused(e.to_string())),
        }
    }
}

// ------------------------------------------------------- NATS JetStream

const NATS_STREAM: &str = "EV";

/// NATS JetStream, one file-stored stream, one subject per key.
pub struct Nats {
    url: String,
    replicas: usize,
}

impl Nats {
    /// `url` like `nats://127.0.0.1:4230`; the stream has `replicas`
    /// replicas (1 on one server; 3 on a cluster of three).
    pub fn new(url: &str, replicas: usize) -> Self {
        Self {
            url: url.into(),
            replicas,
        }
    }
}

impl Target for Nats {
    type Conn = NatsConn;
    fn name(&self) -> String {
        "nats".into()
    }
    async fn setup(&mut self, _keys: usize) -> Result<(), SetupError> {
        let client = async_nats::connect(self.url.as_str())
            .await
            .map_err(SetupError::new)?;
        let js = async_nats::jetstream::new(client);
        // A fresh stream: drop whatever an earlier run left.
        let _ = js.delete_stream(NATS_STREAM).await;
        js.create_stream(async_nats::jetstream::stream::Config {
            name: NATS_STREAM.into(),
            subjects: vec!["ev.>".into()],
            storage: async_nats::jetstream::stream::StorageType::File,
            num_replicas: self.replicas,
            ..Default::default()
        })
        .await
        .map_err(SetupError::new)?;
        Ok(())
    }
    async fn connect(&self, _client: usize) -> Result<NatsConn, SetupError> {
        let client = async_nats::connect(self.url.as_str())
            .await
            .map_err(SetupError::new)?;
        Ok(NatsConn {
            js: async_nats::jetstream::new(client),
            last: HashMap::new(),
        })
    }
}

/// One client's NATS connection and the stream sequence of the last
/// acknowledged message of each of its keys.
pub struct NatsConn {
    js: async_nats::jetstream::Context,
    last: HashMap<usize, u64>,
}

impl Connection for NatsConn {
    async fn append(&mut self, key: usize, seq: u64, payload: &Payload) -> Result<(), AppendError> {
        use async_nats::jetstream::context::PublishErrorKind;
        let last = self.last.get(&key).copied().unwrap_or(0);
        if (seq == 1) != (last == 0) {
            return Err(AppendError::Refused(format!(
                "key {key}: append {seq} but last stream sequence {last}"
            )));
        }
        let mut headers = async_nats::HeaderMap::new();
        headers.insert(
            "Nats-Expected-Last-Subject-Sequence",
            last.to_string().as_str(),
        );
        let classify = |e: async_nats::jetstream::context::PublishError| match e.kind() {
            PublishErrorKind::WrongLastSequence => AppendError::Conflict(e.to_string()),
            PublishErrorKind::TimedOut | PublishErrorKind::BrokenPipe => {
                AppendError::Transport(e.to_string())
            }
            _ => AppendError::Refused(e.to_string()),
        };
        let ack = self
            .js
            .publish_with_headers(format!("ev.{key}"), headers, payload.as_bytes().clone())
            .await
            .map_err(classify)?
            .await
            .map_err(classify)?;
        if ack.stream != NATS_STREAM || ack.sequence <= last || ack.duplicate {
            return Err(AppendError::BadAnswer(format!(
                "ack {ack:?} after last sequence {last}"
            )));
        }
        self.last.insert(key, ack.sequence);
        Ok(())
    }
}

// ----------------------------------------------------------------- etcd
// Behind the `etcd` feature: etcd-client needs `protoc` to build.

#[cfg(feature = "etcd")]
pub use etcd::Etcd;

#[cfg(feature = "etcd")]
mod etcd {
    use std::collections::HashMap;

    use forkless_loadgen::{AppendError, Connection, Payload, SetupError, Target};

    /// etcd, one key per key, compare-revision-then-put transactions.
    pub struct Etcd {
        endpoint: String,
    }

    impl Etcd {
        /// `endpoint` like `http://127.0.0.1:2389`.
        pub fn new(endpoint: &str) -> Self {
            Self {
                endpoint: endpoint.into(),
            }
        }
        async fn client(&self) -> Result<etcd_client::Client, SetupError> {
            etcd_client::Client::connect([self.endpoint.as_str()], None)
                .await
                .map_err(SetupError::new)
        }
    }

    fn etcd_key(k: usize) -> String {
        format!("fl/{k}")
    }

    impl Target for Etcd {
        type Conn = EtcdConn;
        fn name(&self) -> String {
            "etcd".into()
        }
        async fn setup(&mut self, _keys: usize) -> Result<(), SetupError> {
            let mut client = self.client().await?;
            client
                .delete("fl/", Some(etcd_client::DeleteOptions::new().with_prefix()))
                .await
                .map_err(SetupError::new)?;
            Ok(())
        }
        async fn connect(&self, _client: usize) -> Result<EtcdConn, SetupError> {
            Ok(EtcdConn {
                client: self.client().await?,
                revision: HashMap::new(),
            })
        }
    }

    /// One client's etcd connection and the mod revision of the last put of
    /// each of its keys.
    pub struct EtcdConn {
        client: etcd_client::Client,
        revision: HashMap<usize, i64>,
    }

    impl Connection for EtcdConn {
        async fn append(
            &mut self,
            key: usize,
            seq: u64,
            payload: &Payload,
        ) -> Result<(), AppendError> {
            use etcd_client::{Compare, CompareOp, Txn, TxnOp};
            let last = self.revision.get(&key).copied().unwrap_or(0);
            if (seq == 1) != (last == 0) {
                return Err(AppendError::Refused(format!(
                    "key {key}: append {seq} but last revision {last}"
                )));
            }
            let k = etcd_key(key);
            let txn = Txn::new()
                .when([Compare::mod_revision(k.clone(), CompareOp::Equal, last)])
                .and_then([TxnOp::put(k, payload.as_bytes().to_vec(), None)]);
            let resp = self.client.txn(txn).await.map_err(|e| match e {
                etcd_client::Error::GRpcStatus(s) => AppendError::Refused(s.to_string()),
                other => AppendError::Transport(other.to_string()),
            })?;
            if !resp.succeeded() {
                return Err(AppendError::Conflict(format!(
                    "mod revision of {} is no longer {last}",
                    etcd_key(key)
                )));
            }
            match resp.header().map(|h| h.revision()) {
                Some(rev) if rev > last => {
                    self.revision.insert(key, rev);
                    Ok(())
                }
                other => Err(AppendError::BadAnswer(format!(
                    "txn succeeded with revision {other:?} after {last}"
                ))),
            }
        }
    }
}
