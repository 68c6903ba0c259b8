//! `forkless store check`: the offline check of a data directory, and the
//! one repair an operator may ask of it (`--truncate-after`).

use anyhow::{bail, Context};
use clap::{Args, Subcommand};
use forkless_types::ShardId;
use std::path::PathBuf;

#[derive(Args)]
pub struct StoreArgs {
    #[command(subcommand)]
    command: StoreCommand,
}

#[derive(Subcommand)]
enum StoreCommand {
    /// Read every shard of a stopped node's data directory: every log
    /// group's and event's checksum, every execution's sequence, the events
    /// index and the execution records against the log. Changes nothing
    /// (unless --truncate-after is given); exits 1 if anything is damaged.
    Check(CheckArgs),
}

#[derive(Args)]
struct CheckArgs {
    /// The node's data directory.
    #[arg(long, default_value = "./forkless-data")]
    data_dir: PathBuf,
    /// Cut the log after this position, `<segment>:<offset>` (the end of
    /// a whole round or group at or after the checkpoints, as the check
    /// reports it), dropping everything written after it. A position in
    /// the node log (segment 2147483648 on) cuts it for every shard. For
    /// an operator who has decided to lose a damaged tail.
    #[arg(long, value_name = "SEGMENT:OFFSET")]
    truncate_after: Option<String>,
    /// The shard whose own log of before to cut (needed with
    /// --truncate-after at a position in a shard's own log, when the
    /// directory has more than one).
    #[arg(long)]
    shard: Option<u32>,
}

/// Runs the subcommand; `Ok(false)` when the check found damage.
pub fn run(a: StoreArgs) -> anyhow::Result<bool> {
    let StoreCommand::Check(a) = a.command;
    if !a.data_dir.join("shards").is_dir() {
        bail!(
            "--data-dir: {} is not a forkless data directory (it has no shards/ folder)",
            a.data_dir.display()
        );
    }
    if let Some(at) = &a.truncate_after {
        let (seg, off) = at
            .split_once(':')
            .and_then(|(s, o)| Some((s.parse::<u32>().ok()?, o.parse::<u64>().ok()?)))
            .with_context(|| {
                format!("--truncate-after: {at:?} is not <segment>:<offset> (two whole numbers)")
            })?;
        let shards: Vec<u32> = std::fs::read_dir(a.data_dir.join("shards"))?
            .filter_map(|e| e.ok()?.file_name().to_str()?.parse().ok())
            .collect();
        let shard = match (a.shard, shards.as_slice()) {
            (Some(s), _) if shards.contains(&s) => s,
            // A cut of the node log is every shard's: none to name.
            (None, _) if forkless_store::check::cuts_every_shard(seg) => 0,
            (Some(s), _) => bail!("--shard: the data directory has no shard {s}"),
            (None, [only]) => *only,
            (None, _) => bail!(
                "--shard: the data directory has {} shards; say which one to cut",
                shards.len()
            ),
        };
        let done = forkless_store::check::truncate_after(&a.data_dir, ShardId(shard), (seg, off))
            .map_err(|e| anyhow::anyhow!("--truncate-after: {e}"))?;
        println!("{done}");
    }
    let report = forkless_store::check::check(&a.data_dir)
        .with_context(|| format!("checking {}", a.data_dir.display()))?;
    println!("{report}");
    Ok(report.is_healthy())
}
