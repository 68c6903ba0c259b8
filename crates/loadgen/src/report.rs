//! The result of one run, as a human-readable block and as JSON.

use std::collections::BTreeMap;
use std::fmt;

use hdrhistogram::Histogram;
use serde::{Deserialize, Serialize};

use crate::runner::Workload;

/// Result of one measured run.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct Report {
    /// Target name.
    pub target: String,
    /// Concurrent clients.
    pub clients: usize,
    /// Distinct keys.
    pub keys: usize,
    /// Payload bytes per event.
    pub payload_bytes: usize,
    /// Warm-up seconds.
    pub warmup_s: f64,
    /// Measured seconds.
    pub duration_s: f64,
    /// Appends acknowledged inside the measured window.
    pub events: u64,
    /// `events / duration_s`.
    pub events_per_s: f64,
    /// Latency percentiles of the measured appends, milliseconds.
    pub p50_ms: f64,
    pub p90_ms: f64,
    pub p99_ms: f64,
    pub p999_ms: f64,
    pub max_ms: f64,
    /// Appends that failed, during warm-up or measurement.
    pub errors: u64,
    /// Errors by kind (`conflict`, `refused`, `transport`, `bad_answer`, `timeout`).
    pub error_kinds: BTreeMap<String, u64>,
    /// A few error messages, for diagnosis.
    pub error_samples: Vec<String>,
    /// Keys no longer appended to after an error.
    pub retired_keys: u64,
    /// All acknowledged appends, warm-up included.
    pub total_appends: u64,
    /// CPU of the load generator over the measured window, percent of one
    /// core (a 2-core machine has 200%).
    pub loadgen_cpu_pct: Option<f64>,
    /// CPU of the server process tree over the measured window, percent of
    /// one core; absent without a server pid.
    pub server_cpu_pct: Option<f64>,
    /// Busy CPU of the whole machine over the measured window, percent of
    /// one core; what neither the server nor the load generator used is
    /// other activity that competed with the run.
    #[serde(default)]
    pub machine_cpu_pct: Option<f64>,
}

impl Report {
    /// Machine CPU used by neither the load generator nor the server (when
    /// both are known), percent of one core; clamped at 0, since the three
    /// readings are taken a moment apart.
    pub fn other_cpu_pct(&self) -> Option<f64> {
        Some((self.machine_cpu_pct? - self.loadgen_cpu_pct? - self.server_cpu_pct?).max(0.0))
    }
}

impl Report {
    #[allow(clippy::too_many_arguments)]
    pub(crate) fn new(
        target: String,
        w: &Workload,
        h: &Histogram<u64>,
        events: u64,
        total_ok: u64,
        error_kinds: BTreeMap<String, u64>,
        error_samples: Vec<String>,
        retired_keys: u64,
        loadgen_cpu_pct: Option<f64>,
        server_cpu_pct: Option<f64>,
        machine_cpu_pct: Option<f64>,
    ) -> Self {
        let ms = |us: u64| us as f64 / 1000.0;
        let q = |q: f64| {
            if h.is_empty() {
                0.0
            } else {
                ms(h.value_at_quantile(q))
            }
        };
        let errors = error_kinds.values().sum();
        let duration_s = w.duration.as_secs_f64();
        Self {
            target,
            clients: w.clients,
            keys: w.keys,
            payload_bytes: w.payload_bytes,
            warmup_s: w.warmup.as_secs_f64(),
            duration_s,
            events,
            events_per_s: if duration_s > 0.0 {
                events as f64 / duration_s
            } else {
                0.0
            },
            p50_ms: q(0.50),
            p90_ms: q(0.90),
            p99_ms: q(0.99),
            p999_ms: q(0.999),
            max_ms: if h.is_empty() { 0.0 } else { ms(h.max()) },
            errors,
            error_kinds,
            error_samples,
            retired_keys,
            total_appends: total_ok.saturating_sub(errors),
            loadgen_cpu_pct,
            server_cpu_pct,
            machine_cpu_pct,
        }
    }
}

fn opt_pct(v: Option<f64>) -> String {
    v.map_or_else(|| "n/a".to_string(), |v| format!("{v:.0}%"))
}

impl fmt::Display for Report {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        writeln!(
            f,
            "{}: {} clients, {} keys, {} B payload, {:.0} s warm-up + {:.0} s measured",
            self.target,
            self.clients,
            self.keys,
            self.payload_bytes,
            self.warmup_s,
            self.duration_s
        )?;
        writeln!(
            f,
            "  {:.0} events/s ({} events)  latency ms p50 {:.2}  p90 {:.2}  p99 {:.2}  p99.9 {:.2}  max {:.2}",
            self.events_per_s,
            self.events,
            self.p50_ms,
            self.p90_ms,
            self.p99_ms,
            self.p999_ms,
            self.max_ms
        )?;
        writeln!(
            f,
            "  errors {}  CPU (of {}%): server {}  load generator {}  machine {}  other {}",
            self.errors,
            100 * std::thread::available_parallelism().map_or(1, |n| n.get()),
            opt_pct(self.server_cpu_pct),
            opt_pct(self.loadgen_cpu_pct),
            opt_pct(self.machine_cpu_pct),
            opt_pct(self.other_cpu_pct())
        )?;
        if self.errors > 0 {
            writeln!(
                f,
                "  errors by kind: {:?}; {} keys retired",
                self.error_kinds, self.retired_keys
            )?;
            for s in &self.error_samples {
                writeln!(f, "    {s}")?;
            }
        }
        Ok(())
    }
}
