//! `forkless route`: where an execution id or routing key lives.

use anyhow::{bail, Context};
use forkless_sharding::{partition_for, partition_for_key, shard_for_partition, ShardCount};
use serde_json::json;

#[derive(clap::Args)]
pub struct RouteArgs {
    /// An execution id (a positive decimal integer).
    #[arg(required_unless_present = "key", conflicts_with = "key")]
    execution_id: Option<String>,
    /// A routing key instead of an id.
    #[arg(long)]
    key: Option<String>,
    /// The cluster's shard count: a power of two from 1 to 4096.
    #[arg(long, default_value_t = 1, env = "FORKLESS_SHARD_COUNT")]
    shard_count: u64,
}

pub fn run(a: RouteArgs) -> anyhow::Result<()> {
    let n = ShardCount::new(a.shard_count).context("--shard-count")?;
    let out = match (a.execution_id, a.key) {
        (Some(id), None) => {
            let parsed: forkless_types::ExecutionId =
                id.parse().with_context(|| format!("execution id {id:?}"))?;
            let p = partition_for(parsed.get());
            json!({"execution_id": parsed.to_string(), "partition": p, "shard": shard_for_partition(p, n), "shard_count": n.get()})
        }
        (None, Some(key)) => {
            let p = partition_for_key(&key);
            json!({"routing_key": key, "partition": p, "shard": shard_for_partition(p, n), "shard_count": n.get()})
        }
        _ => bail!("give an execution id or --key, not both"),
    };
    println!("{out}");
    Ok(())
}
