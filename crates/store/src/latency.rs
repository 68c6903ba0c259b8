//! A fixed-bucket latency histogram, cheap enough to record on the writer's
//! hot path (one relaxed add per bucket and sum), read at each metrics
//! scrape.

use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

/// Upper bounds of the buckets, in microseconds; a last bucket takes
/// everything above. Spaced for an `fdatasync`: tens of microseconds on a
/// fast disk, milliseconds in a slow spell, more when something is wrong.
const BOUNDS_MICROS: [u64; 16] = [
    25, 50, 75, 100, 150, 200, 300, 500, 750, 1_000, 2_000, 5_000, 10_000, 20_000, 50_000, 100_000,
];

#[derive(Default)]
pub(crate) struct Latency {
    /// One count per bound, and one for everything above the last.
    buckets: [AtomicU64; BOUNDS_MICROS.len() + 1],
    sum_micros: AtomicU64,
}

impl Latency {
    pub(crate) fn record(&self, took: Duration) {
        let micros = u64::try_from(took.as_micros()).unwrap_or(u64::MAX);
        let bucket = BOUNDS_MICROS.partition_point(|&b| b < micros);
        self.buckets[bucket].fetch_add(1, Ordering::Relaxed);
        self.sum_micros.fetch_add(micros, Ordering::Relaxed);
    }

    pub(crate) fn snapshot(&self) -> LatencySnapshot {
        LatencySnapshot {
            buckets: BOUNDS_MICROS
                .iter()
                .map(|&b| b as f64 / 1e6)
                .chain([f64::INFINITY])
                .zip(self.buckets.iter().map(|c| c.load(Ordering::Relaxed)))
                .collect(),
            sum_seconds: self.sum_micros.load(Ordering::Relaxed) as f64 / 1e6,
        }
    }
}

/// A histogram read at one moment, in the shape Prometheus exporters take.
#[derive(Debug, Clone, PartialEq)]
pub struct LatencySnapshot {
    /// (upper bound in seconds, count in this bucket alone), the last bound
    /// infinite.
    pub buckets: Vec<(f64, u64)>,
    pub sum_seconds: f64,
}

impl LatencySnapshot {
    pub fn count(&self) -> u64 {
        self.buckets.iter().map(|(_, n)| n).sum()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn values_land_in_the_bucket_of_the_first_bound_at_or_above_them() {
        let l = Latency::default();
        for micros in [0, 25, 26, 100, 101, 100_000, 100_001, 10_000_000] {
            l.record(Duration::from_micros(micros));
        }
        let s = l.snapshot();
        let at = |bound: f64| {
            s.buckets
                .iter()
                .find(|(b, _)| *b == bound)
                .map(|(_, n)| *n)
                .expect("a bucket with that bound")
        };
        assert_eq!(at(0.000_025), 2);
        assert_eq!(at(0.000_05), 1);
        assert_eq!(at(0.000_1), 1);
        assert_eq!(at(0.000_15), 1);
        assert_eq!(at(0.1), 1);
        assert_eq!(at(f64::INFINITY), 2);
        assert_eq!(s.count(), 8);
        assert!(
            (s.sum_seconds - 10.200_253).abs() < 1e-9,
            "{}",
            s.sum_seconds
        );
    }
}
