//! forkless-flushbench: how one node makes many groups' appends durable in
//! one flush round (docs/replication.md, "Durability across groups").
//!
//! Each round, every one of K groups appends one entry (`--entry-bytes`,
//! default 330: a 256-byte event with its framing) and the round makes all
//! of them durable, in one of three layouts:
//!
//! - `per-group`: one zero-filled segment file per group, and one
//!   `fdatasync` per file, one after another;
//! - `per-group-parallel`: the same files, their `fdatasync`s issued at
//!   once from K threads (at most `--sync-threads`);
//! - `shared`: one zero-filled file for all groups, the K entries written
//!   back to back, and one `fdatasync`.
//!
//! Rounds run back to back for `--seconds`; it prints rounds/s, entries/s
//! and the round time's p50 / p99, per layout and K, interleaving the
//! layouts within each repetition so that the disk's slow spells hit them
//! alike. Files are zero-filled first (as the log's segments are), so no
//! write changes a file's size or block map.
//!
//! `forkless-flushbench --dir /var/tmp/fb --groups 1,8,64 --seconds 3 --reps 3`

use std::fs::{File, OpenOptions};
use std::os::unix::fs::FileExt;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

mod flags;

use flags::Result;

const USAGE: &str = "forkless-flushbench [--dir D] [--groups 1,8,64] [--seconds 3] [--reps 3] [--entry-bytes 330] [--sync-threads 64]";

const FILE_BYTES: u64 = 16 * 1024 * 1024;

#[derive(Clone, Copy, Debug, PartialEq)]
enum Layout {
    PerGroup,
    PerGroupParallel,
    Shared,
}

impl Layout {
    fn name(self) -> &'static str {
        match self {
            Layout::PerGroup => "per-group",
            Layout::PerGroupParallel => "per-group-parallel",
            Layout::Shared => "shared",
        }
    }
}

struct Args {
    dir: PathBuf,
    groups: Vec<usize>,
    seconds: f64,
    reps: usize,
    entry_bytes: usize,
    sync_threads: usize,
}

fn parse() -> Result<Args> {
    let mut a = Args {
        dir: PathBuf::from("/var/tmp/forkless-flushbench"),
        groups: vec![1, 8, 64],
        seconds: 3.0,
        reps: 3,
        entry_bytes: 330,
        sync_threads: 64,
    };
    for (flag, v) in flags::pairs(USAGE)? {
        match flag.as_str() {
            "--dir" => a.dir = PathBuf::from(v),
            "--groups" => a.groups = flags::counts(&flag, &v)?,
            "--seconds" => a.seconds = flags::value(&flag, &v)?,
            "--reps" => a.reps = flags::value(&flag, &v)?,
            "--entry-bytes" => a.entry_bytes = flags::value(&flag, &v)?,
            "--sync-threads" => a.sync_threads = flags::value(&flag, &v)?,
            other => return Err(format!("unknown argument {other}").into()),
        }
    }
    if a.groups.contains(&0) || a.entry_bytes == 0 || a.sync_threads == 0 {
        return Err("--groups, --entry-bytes and --sync-threads must be positive".into());
    }
    Ok(a)
}

/// A zero-filled, synced file of [`FILE_BYTES`].
fn zero_filled(path: &Path) -> Result<File> {
    let f = OpenOptions::new()
        .read(true)
        .write(true)
        .create(true)
        .truncate(true)
        .open(path)?;
    let zeros = vec![0u8; 1 << 20];
    let mut at = 0;
    while at < FILE_BYTES {
        f.write_all_at(&zeros, at)?;
        at += zeros.len() as u64;
    }
    f.sync_all()?;
    Ok(f)
}

struct Result1 {
    rounds: u64,
    secs: f64,
    p50_us: u64,
    p99_us: u64,
}

fn run(layout: Layout, files: &[File], shared: &File, k: usize, a: &Args) -> Result<Result1> {
    let entry = vec![0xabu8; a.entry_bytes];
    let mut offsets = vec![0u64; k];
    let mut shared_at = 0u64;
    let mut times = Vec::new();
    let start = Instant::now();
    let until = start + Duration::from_secs_f64(a.seconds);
    while Instant::now() < until {
        let t = Instant::now();
        match layout {
            Layout::PerGroup => {
                for (f, at) in files[..k].iter().zip(offsets.iter_mut()) {
                    f.write_all_at(&entry, *at)?;
                    *at = (*at + entry.len() as u64) % (FILE_BYTES - entry.len() as u64);
                }
                for f in &files[..k] {
                    f.sync_data()?;
                }
            }
            Layout::PerGroupParallel => {
                for (f, at) in files[..k].iter().zip(offsets.iter_mut()) {
                    f.write_all_at(&entry, *at)?;
                    *at = (*at + entry.len() as u64) % (FILE_BYTES - entry.len() as u64);
                }
                let per = k.div_ceil(a.sync_threads.min(k));
                std::thread::scope(|s| -> Result<()> {
                    let handles: Vec<_> = files[..k]
                        .chunks(per)
                        .map(|chunk| {
                            s.spawn(move || -> std::io::Result<()> {
                                for f in chunk {
                                    f.sync_data()?;
                                }
                                Ok(())
                            })
                        })
                        .collect();
                    for h in handles {
                        h.join().map_err(|_| "a sync thread panicked")??;
                    }
                    Ok(())
                })?;
            }
            Layout::Shared => {
                let mut buf = Vec::with_capacity(k * entry.len());
                for _ in 0..k {
                    buf.extend_from_slice(&entry);
                }
                if shared_at + buf.len() as u64 > FILE_BYTES {
                    shared_at = 0;
                }
                shared.write_all_at(&buf, shared_at)?;
                shared_at += buf.len() as u64;
                shared.sync_data()?;
            }
        }
        times.push(t.elapsed().as_micros() as u64);
    }
    let secs = start.elapsed().as_secs_f64();
    times.sort_unstable();
    let pct = |p: f64| times[((times.len() as f64 * p) as usize).min(times.len() - 1)];
    Ok(Result1 {
        rounds: times.len() as u64,
        secs,
        p50_us: pct(0.50),
        p99_us: pct(0.99),
    })
}

fn main() -> Result<()> {
    let a = parse()?;
    std::fs::create_dir_all(&a.dir)?;
    let most = a.groups.iter().copied().max().unwrap_or(1);
    eprintln!(
        "zero-filling {} files of {} MiB in {}",
        most + 1,
        FILE_BYTES >> 20,
        a.dir.display()
    );
    let files: Vec<File> = (0..most)
        .map(|g| zero_filled(&a.dir.join(format!("group-{g}.seg"))))
        .collect::<Result<_>>()?;
    let shared = zero_filled(&a.dir.join("shared.seg"))?;
    println!("| rep | groups | layout | rounds/s | entries/s | round p50 us | round p99 us |");
    println!("| --: | --: | --- | --: | --: | --: | --: |");
    for rep in 1..=a.reps {
        for &k in &a.groups {
            for layout in [Layout::PerGroup, Layout::PerGroupParallel, Layout::Shared] {
                let r = run(layout, &files, &shared, k, &a)?;
                let rps = r.rounds as f64 / r.secs;
                println!(
                    "| {rep} | {k} | {} | {:.0} | {:.0} | {} | {} |",
                    layout.name(),
                    rps,
                    rps * k as f64,
                    r.p50_us,
                    r.p99_us
                );
            }
        }
    }
    drop(files);
    drop(shared);
    std::fs::remove_dir_all(&a.dir)?;
    Ok(())
}
