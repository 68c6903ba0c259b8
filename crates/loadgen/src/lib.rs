//! Closed-loop load generator for the "durable ordered append" workload.
//!
//! The workload: C concurrent clients, K keys, each operation appends one
//! event with a fixed-size JSON payload to one key and counts only when the
//! target acknowledged it as durable. Key `k` belongs to client `k % C`, and
//! each client round-robins over its own keys, so every append carries the
//! exact order expectation (sequence, revision, primary key) and a target
//! that lost or reordered an append refuses the next one.
//!
//! A system under test plugs in through [`Target`] (setup plus one
//! [`Connection`] per client). This crate carries the forkless HTTP adapter
//! ([`forkless::ForklessHttp`]) and nothing that talks to other systems, so
//! the main `forkless` binary can use it for `forkless bench`.

pub mod cpu;
pub mod forkless;
pub mod http1;
pub mod payload;
pub mod report;
pub mod runner;

use std::future::Future;

pub use payload::Payload;
pub use report::Report;
pub use runner::{run, Workload};

/// A system under test.
///
/// `setup` runs once, before any connection is opened; `connect` opens the
/// connection that one client uses for the whole run (one connection per
/// client, so concurrency is exactly the client count).
pub trait Target: Send + Sync + 'static {
    /// One client's connection.
    type Conn: Connection;

    /// A short name for reports, e.g. `forkless` or `redis`.
    fn name(&self) -> String;

    /// Prepares `keys` fresh keys (executions, streams, rows) with no
    /// appends of this run yet.
    fn setup(&mut self, keys: usize) -> impl Future<Output = Result<(), SetupError>> + Send;

    /// Opens the connection for client number `client` (0-based).
    fn connect(&self, client: usize)
        -> impl Future<Output = Result<Self::Conn, SetupError>> + Send;
}

/// One client's connection to a [`Target`].
pub trait Connection: Send + 'static {
    /// Appends one event to key number `key` and returns once the target has
    /// acknowledged it as durable.
    ///
    /// `seq` is the 1-based ordinal of this append among this run's appends
    /// to `key` (1 for the first). The append must carry the target's order
    /// check derived from it (expected last sequence, explicit stream id,
    /// primary key, compared revision), so an append that does not follow
    /// the previous acknowledged one is refused, and the implementation must
    /// verify that the acknowledgement agrees with `seq` where the target
    /// reports it.
    fn append(
        &mut self,
        key: usize,
        seq: u64,
        payload: &Payload,
    ) -> impl Future<Output = Result<(), AppendError>> + Send;
}

/// Why a target could not be prepared or connected.
#[derive(Debug, thiserror::Error)]
#[error("{0}")]
pub struct SetupError(pub String);

impl SetupError {
    /// Wraps any displayable error.
    pub fn new(e: impl std::fmt::Display) -> Self {
        Self(e.to_string())
    }
}

/// Why one append failed. The runner retires the key after any error,
/// because the key's state on the target is then no longer known exactly.
#[derive(Debug, thiserror::Error)]
pub enum AppendError {
    /// The target's order check refused the append: the key's state was not
    /// what this client expected.
    #[error("order check refused: {0}")]
    Conflict(String),
    /// The target refused the append for another reason.
    #[error("refused: {0}")]
    Refused(String),
    /// The request or its answer was lost; whether it was applied is unknown.
    #[error("transport: {0}")]
    Transport(String),
    /// The target answered something that is not a valid acknowledgement, or
    /// one that disagrees with the expected order.
    #[error("bad answer: {0}")]
    BadAnswer(String),
    /// No answer within the per-append timeout.
    #[error("timed out")]
    Timeout,
}

impl AppendError {
    /// A stable name for counting errors by kind in reports.
    pub fn kind(&self) -> &'static str {
        match self {
            AppendError::Conflict(_) => "conflict",
            AppendError::Refused(_) => "refused",
            AppendError::Transport(_) => "transport",
            AppendError::BadAnswer(_) => "bad_answer",
            AppendError::Timeout => "timeout",
        }
    }
}
