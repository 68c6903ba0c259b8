//! The closed-loop load loop: C clients, each owning the keys `k` with
//! `k % C == client`, round-robin over them, one append in flight each.

use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::Duration;

use hdrhistogram::Histogram;
use tokio::time::Instant;

use crate::report::Report;
use crate::{cpu, AppendError, Connection, Payload, SetupError, Target};

/// Most distinct error messages kept per run, for the report.
const MAX_ERROR_SAMPLES: usize = 5;
/// Highest latency the histogram records, in microseconds (60 s); slower
/// appends are clamped to it.
const MAX_LATENCY_US: u64 = 60_000_000;

/// What to run.
#[derive(Debug, Clone)]
pub struct Workload {
    /// Concurrent clients, each with one connection and one append in flight.
    pub clients: usize,
    /// Distinct keys; key `k` belongs to client `k % clients`.
    pub keys: usize,
    /// Payload size in bytes of JSON text.
    pub payload_bytes: usize,
    /// Load before measuring starts.
    pub warmup: Duration,
    /// Measured window.
    pub duration: Duration,
    /// An append without an answer after this long counts as an error.
    pub append_timeout: Duration,
    /// If set, the server's CPU (this pid and its descendants) is reported.
    pub server_pid: Option<u32>,
}

impl Default for Workload {
    fn default() -> Self {
        Self {
            clients: 16,
            keys: 1000,
            payload_bytes: 256,
            warmup: Duration::from_secs(3),
            duration: Duration::from_secs(15),
            append_timeout: Duration::from_secs(10),
            server_pid: None,
        }
    }
}

struct ClientResult {
    histogram: Histogram<u64>,
    measured: u64,
    total: u64,
    errors: BTreeMap<&'static str, u64>,
    samples: Vec<String>,
    retired_keys: u64,
}

/// Sets the target up, runs the workload against it and reports.
pub async fn run<T: Target>(mut target: T, workload: &Workload) -> Result<Report, SetupError> {
    if workload.clients == 0 || workload.keys < workload.clients {
        return Err(SetupError(format!(
            "need at least one client and at least as many keys as clients (clients {}, keys {})",
            workload.clients, workload.keys
        )));
    }
    target.setup(workload.keys).await?;
    let target = Arc::new(target);

    let mut conns = Vec::with_capacity(workload.clients);
    for c in 0..workload.clients {
        conns.push(target.connect(c).await?);
    }

    let payload = Payload::new(workload.payload_bytes);
    let start = Instant::now() + Duration::from_millis(50);
    let measure_from = start + workload.warmup;
    let measure_to = measure_from + workload.duration;

    let mut tasks = Vec::with_capacity(workload.clients);
    for (c, conn) in conns.into_iter().enumerate() {
        let keys: Vec<usize> = (c..workload.keys).step_by(workload.clients).collect();
        let payload = payload.clone();
        let timeout = workload.append_timeout;
        tasks.push(tokio::spawn(client_loop(
            conn,
            keys,
            payload,
            timeout,
            start,
            measure_from,
            measure_to,
        )));
    }

    tokio::time::sleep_until(measure_from).await;
    let self0 = cpu::self_cpu_seconds();
    let server0 = workload.server_pid.and_then(cpu::tree_cpu_seconds);
    let machine0 = cpu::machine_busy_seconds();
    let wall0 = std::time::Instant::now();
    tokio::time::sleep_until(measure_to).await;
    let self1 = cpu::self_cpu_seconds();
    let server1 = workload.server_pid.and_then(cpu::tree_cpu_seconds);
    let machine1 = cpu::machine_busy_seconds();
    let wall = wall0.elapsed().as_secs_f64();
    let pct = |a: Option<f64>, b: Option<f64>| match (a, b) {
        (Some(a), Some(b)) if wall > 0.0 => Some((b - a) / wall * 100.0),
        _ => None,
    };

    let mut histogram = new_histogram();
    let mut measured = 0;
    let mut total = 0;
    let mut errors: BTreeMap<String, u64> = BTreeMap::new();
    let mut samples = Vec::new();
    let mut retired = 0;
    for t in tasks {
        let r = t
            .await
            .map_err(|e| SetupError(format!("client task failed: {e}")))?;
        histogram
            .add(&r.histogram)
            .map_err(|e| SetupError(format!("histogram merge: {e}")))?;
        measured += r.measured;
        total += r.total;
        retired += r.retired_keys;
        for (k, n) in r.errors {
            *errors.entry(k.to_string()).or_default() += n;
        }
        for s in r.samples {
            if samples.len() < MAX_ERROR_SAMPLES && !samples.contains(&s) {
                samples.push(s);
            }
        }
    }

    Ok(Report::new(
        target.name(),
        workload,
        &histogram,
        measured,
        total,
        errors,
        samples,
        retired,
        pct(self0, self1),
        pct(server0, server1),
        pct(machine0, machine1),
    ))
}

fn new_histogram() -> Histogram<u64> {
    Histogram::new_with_bounds(1, MAX_LATENCY_US, 3).expect("constant histogram bounds are valid")
}

async fn client_loop<C: Connection>(
    mut conn: C,
    keys: Vec<usize>,
    payload: Payload,
    timeout: Duration,
    start: Instant,
    measure_from: Instant,
    measure_to: Instant,
) -> ClientResult {
    let mut result = ClientResult {
        histogram: new_histogram(),
        measured: 0,
        total: 0,
        errors: BTreeMap::new(),
        samples: Vec::new(),
        retired_keys: 0,
    };
    // Appends done per owned key; `None` once the key is retired after an
    // error (its state on the target is then unknown).
    let mut done: Vec<Option<u64>> = vec![Some(0); keys.len()];
    let mut live = keys.len();
    let mut i = 0;
    tokio::time::sleep_until(start).await;
    while live > 0 {
        let t0 = Instant::now();
        if t0 >= measure_to {
            break;
        }
        let slot = i % keys.len();
        i += 1;
        let Some(n) = done[slot] else { continue };
        let seq = n + 1;
        let outcome =
            match tokio::time::timeout(timeout, conn.append(keys[slot], seq, &payload)).await {
                Ok(r) => r,
                Err(_) => Err(AppendError::Timeout),
            };
        let t1 = Instant::now();
        result.total += 1;
        match outcome {
            Ok(()) => {
                done[slot] = Some(seq);
                if t1 >= measure_from && t1 < measure_to {
                    result.measured += 1;
                    let us = (t1 - t0).as_micros().clamp(1, MAX_LATENCY_US as u128) as u64;
                    let _ = result.histogram.record(us);
                }
            }
            Err(e) => {
                *result.errors.entry(e.kind()).or_default() += 1;
                if result.samples.len() < MAX_ERROR_SAMPLES {
                    result
                        .samples
                        .push(format!("key {} seq {seq}: {e}", keys[slot]));
                }
                done[slot] = None;
                live -= 1;
                result.retired_keys += 1;
            }
        }
    }
    result
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::atomic::{AtomicU64, Ordering};
    use std::sync::Mutex;

    /// An in-memory target that checks order exactly like a real one.
    struct Memory {
        logs: Arc<Mutex<Vec<u64>>>,
        fail_key: Option<usize>,
        appends: Arc<AtomicU64>,
    }

    struct MemoryConn {
        logs: Arc<Mutex<Vec<u64>>>,
        fail_key: Option<usize>,
        appends: Arc<AtomicU64>,
    }

    impl Target for Memory {
        type Conn = MemoryConn;
        fn name(&self) -> String {
            "memory".into()
        }
        async fn setup(&mut self, keys: usize) -> Result<(), SetupError> {
            *self.logs.lock().map_err(SetupError::new)? = vec![0; keys];
            Ok(())
        }
        async fn connect(&self, _client: usize) -> Result<MemoryConn, SetupError> {
            Ok(MemoryConn {
                logs: self.logs.clone(),
                fail_key: self.fail_key,
                appends: self.appends.clone(),
            })
        }
    }

    impl Connection for MemoryConn {
        async fn append(&mut self, key: usize, seq: u64, _p: &Payload) -> Result<(), AppendError> {
            tokio::time::sleep(Duration::from_micros(200)).await;
            if Some(key) == self.fail_key {
                return Err(AppendError::Refused("injected".into()));
            }
            let mut logs = self
                .logs
                .lock()
                .map_err(|e| AppendError::Transport(e.to_string()))?;
            let last = logs[key];
            if last + 1 != seq {
                return Err(AppendError::Conflict(format!("last {last}, got {seq}")));
            }
            logs[key] = seq;
            self.appends.fetch_add(1, Ordering::Relaxed);
            Ok(())
        }
    }

    fn short(clients: usize) -> Workload {
        Workload {
            clients,
            keys: 100,
            payload_bytes: 256,
            warmup: Duration::from_millis(100),
            duration: Duration::from_millis(300),
            append_timeout: Duration::from_secs(1),
            server_pid: Some(std::process::id()),
        }
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn runs_in_order_without_errors() {
        let appends = Arc::new(AtomicU64::new(0));
        let t = Memory {
            logs: Arc::default(),
            fail_key: None,
            appends: appends.clone(),
        };
        let r = run(t, &short(8)).await.expect("run");
        assert_eq!(r.errors, 0, "{r:?}");
        assert!(r.events > 0);
        assert!(r.events <= r.total_appends);
        assert_eq!(r.total_appends, appends.load(Ordering::Relaxed));
        assert!(r.p50_ms > 0.0 && r.p50_ms <= r.p99_ms && r.p99_ms <= r.max_ms);
        assert!(r.loadgen_cpu_pct.is_some());
        assert!(r.server_cpu_pct.is_some());
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn an_error_retires_only_that_key() {
        let t = Memory {
            logs: Arc::default(),
            fail_key: Some(3),
            appends: Arc::default(),
        };
        let r = run(t, &short(4)).await.expect("run");
        assert_eq!(r.errors, 1);
        assert_eq!(r.error_kinds.get("refused"), Some(&1));
        assert_eq!(r.retired_keys, 1);
        assert!(r.events > 0);
    }

    #[tokio::test]
    async fn refuses_more_clients_than_keys() {
        let t = Memory {
            logs: Arc::default(),
            fail_key: None,
            appends: Arc::default(),
        };
        let mut w = short(4);
        w.keys = 2;
        assert!(run(t, &w).await.is_err());
    }
}
