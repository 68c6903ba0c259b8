//! forkless-logbench: the node-wide log against a segment log per group,
//! through the store's real code (`docs/replication.md`, "One log per
//! node"; `forkless_store::logbench`).
//!
//! K groups, each on a thread of its own, append one event at a time
//! (`--event-bytes`, default 256) and wait until it is durable, for
//! `--seconds`: each group into a segment log of its own (one `fdatasync`
//! per group per append, as every shard's writer does today), or all of
//! them into one node log (its syncer makes every waiting group's append
//! durable with one `fdatasync` a round). The layouts alternate within
//! each repetition, so the disk's slow spells hit both. Prints appends/s
//! and the append-to-durable time's p50 / p99.
//!
//! `forkless-logbench --dir /var/tmp/forkless-logbench --groups 1,8,64 --seconds 3 --reps 3`

use forkless_store::logbench::{self, Layout};
use std::path::PathBuf;

mod flags;

use flags::Result;

const USAGE: &str =
    "forkless-logbench [--dir D] [--groups 1,8,64] [--seconds 3] [--reps 3] [--event-bytes 256]";

struct Args {
    dir: PathBuf,
    groups: Vec<usize>,
    seconds: f64,
    reps: usize,
    event_bytes: usize,
}

fn parse() -> Result<Args> {
    let mut a = Args {
        dir: PathBuf::from("/var/tmp/forkless-logbench"),
        groups: vec![1, 8, 64],
        seconds: 3.0,
        reps: 3,
        event_bytes: 256,
    };
    for (flag, v) in flags::pairs(USAGE)? {
        match flag.as_str() {
            "--dir" => a.dir = PathBuf::from(v),
            "--groups" => a.groups = flags::counts(&flag, &v)?,
            "--seconds" => a.seconds = flags::value(&flag, &v)?,
            "--reps" => a.reps = flags::value(&flag, &v)?,
            "--event-bytes" => a.event_bytes = flags::value(&flag, &v)?,
            other => return Err(format!("unknown argument {other}").into()),
        }
    }
    if a.groups.contains(&0) || a.event_bytes == 0 || a.reps == 0 || a.seconds <= 0.0 {
        return Err("--groups, --event-bytes, --reps and --seconds must be positive".into());
    }
    if a.dir.exists() {
        return Err(format!(
            "--dir {}: must not exist (it is removed afterwards)",
            a.dir.display()
        )
        .into());
    }
    Ok(a)
}

fn main() -> Result<()> {
    let a = parse()?;
    println!("| rep | groups | layout | appends/s | append p50 us | append p99 us |");
    println!("| --: | --: | --- | --: | --: | --: |");
    for rep in 1..=a.reps {
        for &k in &a.groups {
            let mut layouts = [Layout::SegmentLogs, Layout::NodeLog];
            if rep % 2 == 0 {
                layouts.reverse();
            }
            for layout in layouts {
                let dir = a.dir.join(format!("{rep}-{k}-{}", layout.name()));
                let r = logbench::run(&dir, layout, k, a.seconds, a.event_bytes)?;
                println!(
                    "| {rep} | {k} | {} | {:.0} | {} | {} |",
                    layout.name(),
                    r.appends as f64 / r.elapsed.as_secs_f64(),
                    r.p50.as_micros(),
                    r.p99.as_micros()
                );
                std::fs::remove_dir_all(&dir)?;
            }
        }
    }
    std::fs::remove_dir_all(&a.dir)?;
    Ok(())
}
