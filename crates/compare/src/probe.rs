//! The disk probe: what one fsync costs right now on the data disk.
//!
//! Two loops on a scratch file in the given directory: 256-byte append +
//! `fdatasync` (the cost of one unbatched durable append), then 64 KiB
//! append + `fdatasync` (what batching can reach). The file is removed after.

use std::fs::OpenOptions;
use std::io::Write;
use std::path::Path;
use std::time::{Duration, Instant};

use anyhow::Context;
use hdrhistogram::Histogram;
use serde::{Deserialize, Serialize};

/// Result of one probe.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct Probe {
    /// Seconds spent in the small-write loop.
    pub small_seconds: f64,
    /// 256-byte write + fdatasync per second.
    pub fsync_per_s: f64,
    pub small_p50_ms: f64,
    pub small_p99_ms: f64,
    /// Seconds spent in the 64 KiB loop.
    pub big_seconds: f64,
    /// 64 KiB write + fdatasync per second.
    pub big_batches_per_s: f64,
    pub big_mb_per_s: f64,
}

const SMALL: usize = 256;
const BIG: usize = 64 * 1024;

/// Runs the small loop for `small` and the big loop for `big` in `dir`.
pub fn probe(dir: &Path, small: Duration, big: Duration) -> anyhow::Result<Probe> {
    std::fs::create_dir_all(dir).with_context(|| format!("creating {}", dir.display()))?;
    let path = dir.join(format!(".forkless-disk-probe-{}", std::process::id()));
    let result = run(&path, small, big);
    let _ = std::fs::remove_file(&path);
    result
}

fn run(path: &Path, small: Duration, big: Duration) -> anyhow::Result<Probe> {
    let mut file = OpenOptions::new()
        .create(true)
        .truncate(true)
        .write(true)
        .open(path)
        .with_context(|| format!("opening {}", path.display()))?;
    file.sync_all()?;

    let mut h = Histogram::<u64>::new_with_bounds(1, 60_000_000, 3)?;
    let block = vec![b'x'; SMALL];
    let start = Instant::now();
    let mut n = 0u64;
    while start.elapsed() < small {
        let t = Instant::now();
        file.write_all(&block)?;
        file.sync_data()?;
        h.record((t.elapsed().as_micros() as u64).max(1))?;
        n += 1;
    }
    let small_seconds = start.elapsed().as_secs_f64();

    let block = vec![b'y'; BIG];
    let start = Instant::now();
    let mut m = 0u64;
    while start.elapsed() < big {
        file.write_all(&block)?;
        file.sync_data()?;
        m += 1;
    }
    let big_seconds = start.elapsed().as_secs_f64();
    let per_s = |count: u64, secs: f64| if secs > 0.0 { count as f64 / secs } else { 0.0 };
    Ok(Probe {
        small_seconds,
        fsync_per_s: per_s(n, small_seconds),
        small_p50_ms: h.value_at_quantile(0.5) as f64 / 1000.0,
        small_p99_ms: h.value_at_quantile(0.99) as f64 / 1000.0,
        big_seconds,
        big_batches_per_s: per_s(m, big_seconds),
        big_mb_per_s: per_s(m, big_seconds) * BIG as f64 / 1e6,
    })
}

impl std::fmt::Display for Probe {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "disk: {:.0} fsyncs/s of 256 B (p50 {:.2} ms, p99 {:.2} ms); {:.0} x 64 KiB batches/s = {:.0} MB/s",
            self.fsync_per_s,
            self.small_p50_ms,
            self.small_p99_ms,
            self.big_batches_per_s,
            self.big_mb_per_s
        )
    }
}
