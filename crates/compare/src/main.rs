//! `forkless-compare`: runs the durable-ordered-append workload against
//! forkless or a peer system (Redis, PostgreSQL, NATS JetStream, etcd),
//! probes the disk, and turns the results into a markdown table and a chart.
//! Driven end to end by `bench/compare`.

mod chart;
mod peers;
mod probe;
mod results;

use std::path::PathBuf;
use std::time::Duration;

use anyhow::{anyhow, bail, Context};
use clap::{Parser, Subcommand, ValueEnum};
use forkless_loadgen::forkless::ForklessHttp;
use forkless_loadgen::{run, Report, Workload};

/// Exit status of `run` when the disk probe before the point showed a slow
/// spell or other processes took too much CPU during the window (the point
/// is still recorded, marked `slow_probe` / `busy_machine`).
const EXIT_SLOW_PROBE: i32 = 3;

#[derive(Parser)]
#[command(
    name = "forkless-compare",
    about = "Durable ordered append: forkless against its peers"
)]
struct Cli {
    #[command(subcommand)]
    cmd: Cmd,
}

#[derive(Copy, Clone, Debug, ValueEnum)]
enum Kind {
    Forkless,
    Redis,
    Postgres,
    Nats,
    Etcd,
}

#[derive(Subcommand)]
enum Cmd {
    /// Measure one point: C clients appending to K keys on one system.
    Run {
        #[arg(long, value_enum)]
        target: Kind,
        /// Where the system listens (loopback only): forkless
        /// http://127.0.0.1:P, redis redis://127.0.0.1:P/, postgres
        /// "host=127.0.0.1 port=P user=U dbname=D", nats nats://127.0.0.1:P,
        /// etcd http://127.0.0.1:P.
        #[arg(long)]
        url: String,
        #[arg(long, default_value_t = 16)]
        clients: usize,
        #[arg(long, default_value_t = 1000)]
        keys: usize,
        /// Payload bytes (JSON text) per event.
        #[arg(long, default_value_t = 256)]
        payload: usize,
        #[arg(long, default_value = "15s", value_parser = parse_duration)]
        duration: Duration,
        #[arg(long, default_value = "3s", value_parser = parse_duration)]
        warmup: Duration,
        /// Report this process tree's CPU over the measured window.
        #[arg(long)]
        server_pid: Option<u32>,
        /// Print the point as JSON instead of text.
        #[arg(long)]
        json: bool,
        /// Label for tables and the chart (default: the target name).
        #[arg(long)]
        label: Option<String>,
        /// Mark the configuration as not durable (acknowledges before fsync).
        #[arg(long)]
        not_durable: bool,
        /// Probe the disk in this directory right before the point.
        #[arg(long)]
        probe_dir: Option<PathBuf>,
        /// Length of the 256 B fsync loop of that probe (the 64 KiB loop
        /// takes half as long).
        #[arg(long, default_value = "2s", value_parser = parse_duration)]
        probe_seconds: Duration,
        /// A probe under this many fsyncs/s is a slow spell: the point is
        /// marked and the exit status is 3, so the caller can rerun it.
        #[arg(long, default_value_t = 1500.0)]
        slow_below: f64,
        /// Other processes using more than this much CPU (% of one core)
        /// during the measured window make the point suspect: it is marked
        /// and the exit status is 3.
        #[arg(long, default_value_t = 50.0)]
        busy_above: f64,
        /// Append the point to this results file (JSON lines).
        #[arg(long)]
        out: Option<PathBuf>,
        /// Mark the point as a rerun of a slow-spell point.
        #[arg(long)]
        rerun: bool,
        /// Replicas of the NATS stream (a cluster of at least that many
        /// servers); the other systems' replication is their servers'.
        #[arg(long, default_value_t = 1)]
        replicas: usize,
        /// Version of the system under test, recorded with the point.
        #[arg(long)]
        server_version: Option<String>,
        /// The sitting this point belongs to (any number, e.g. the sitting's
        /// start in Unix seconds): the report shows the median of a
        /// sitting's runs of each point.
        #[arg(long)]
        sitting: Option<u64>,
    },
    /// Measure the disk: 256 B write + fdatasync, then 64 KiB write + fdatasync.
    DiskProbe {
        #[arg(long, default_value = ".")]
        dir: PathBuf,
        /// Length of each loop.
        #[arg(long, default_value = "5s", value_parser = parse_duration)]
        seconds: Duration,
        #[arg(long)]
        json: bool,
    },
    /// Draw the chart (PNG) from a results file.
    Chart {
        #[arg(long)]
        results: PathBuf,
        #[arg(long, default_value = "bench/compare.png")]
        out: PathBuf,
        #[arg(
            long,
            default_value = "Durable ordered append, 1,000 keys, 256 B events, loopback, 2 cores"
        )]
        title: String,
        /// A TrueType font (default: DejaVu Sans from fonts-dejavu-core).
        #[arg(long)]
        font: Option<PathBuf>,
    },
    /// Print the markdown table from a results file, optionally splicing it,
    /// after a preamble, into a file between the compare markers.
    Report {
        #[arg(long)]
        results: PathBuf,
        /// Markdown put before the table (date, machine, settings).
        #[arg(long)]
        preamble: Option<PathBuf>,
        /// Replace the text between `<!-- compare:begin -->` and
        /// `<!-- compare:end -->` in this file (created if missing; markers
        /// appended if absent; nothing else touched).
        #[arg(long)]
        insert_into: Option<PathBuf>,
        /// The markers' name: `<!-- NAME:begin -->` and `<!-- NAME:end -->`.
        #[arg(long, default_value = "compare")]
        section: String,
    },
}

/// Parses `15s`, `500ms`, `2m` or a bare number of seconds.
fn parse_duration(s: &str) -> Result<Duration, String> {
    let s = s.trim();
    let (num, unit) = match s.find(|c: char| !(c.is_ascii_digit() || c == '.')) {
        Some(i) => (&s[..i], &s[i..]),
        None => (s, "s"),
    };
    let n: f64 = num.parse().map_err(|_| format!("bad duration {s:?}"))?;
    let secs = match unit {
        "ms" => n / 1000.0,
        "s" => n,
        "m" | "min" => n * 60.0,
        _ => return Err(format!("bad duration unit in {s:?} (use ms, s or m)")),
    };
    if !(0.0..=86_400.0).contains(&secs) {
        return Err(format!("duration {s:?} out of range"));
    }
    Ok(Duration::from_secs_f64(secs))
}

/// The host named by a target address, for the loopback check.
fn host_of(url: &str) -> Option<String> {
    if let Some(rest) = url.split("://").nth(1) {
        let authority = rest.split(['/', '?']).next()?;
        let hostport = authority.rsplit('@').next()?;
        if let Some(v6) = hostport.strip_prefix('[') {
            return v6.split(']').next().map(str::to_string);
        }
        return hostport.split(':').next().map(str::to_string);
    }
    // libpq key=value form.
    url.split_whitespace()
        .find_map(|kv| kv.strip_prefix("host="))
        .map(str::to_string)
}

/// Refuses any target that is not on this machine's loopback.
fn ensure_loopback(url: &str) -> anyhow::Result<()> {
    let host = host_of(url).ok_or_else(|| anyhow!("cannot find the host in {url:?}"))?;
    let ok = host == "localhost"
        || host == "::1"
        || host.starts_with('/')
        || host
            .parse::<std::net::Ipv4Addr>()
            .is_ok_and(|ip| ip.is_loopback());
    if !ok {
        bail!("refusing to send load to {host:?}: only loopback addresses are allowed");
    }
    Ok(())
}

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    let cli = Cli::parse();
    match cli.cmd {
        Cmd::Run {
            target,
            url,
            clients,
            keys,
            payload,
            duration,
            warmup,
            server_pid,
            json,
            label,
            not_durable,
            probe_dir,
            probe_seconds,
            slow_below,
            busy_above,
            out,
            rerun,
            server_version,
            sitting,
            replicas,
        } => {
            ensure_loopback(&url)?;
            let probe = match probe_dir {
                Some(dir) => {
                    let p = tokio::task::spawn_blocking(move || {
                        probe::probe(&dir, probe_seconds, probe_seconds / 2)
                    })
                    .await??;
                    if !json {
                        println!("{p}");
                    }
                    Some(p)
                }
                None => None,
            };
            let slow = probe.as_ref().is_some_and(|p| p.fsync_per_s < slow_below);
            let w = Workload {
                clients,
                keys,
                payload_bytes: payload,
                warmup,
                duration,
                server_pid,
                ..Workload::default()
            };
            let report: Report = match target {
                Kind::Forkless => run(ForklessHttp::new(&url)?, &w).await,
                Kind::Redis => run(peers::Redis::new(&url), &w).await,
                Kind::Postgres => run(peers::Postgres::new(&url), &w).await,
                Kind::Nats => run(peers::Nats::new(&url, replicas), &w).await,
                #[cfg(feature = "etcd")]
                Kind::Etcd => run(peers::Etcd::new(&url), &w).await,
                #[cfg(not(feature = "etcd"))]
                Kind::Etcd => bail!(
                    "this forkless-compare was built without etcd support: \
                     cargo build --release -p forkless-compare --features etcd (needs protoc)"
                ),
            }
            .with_context(|| format!("{target:?} at {url}"))?;
            let busy = report.other_cpu_pct().is_some_and(|o| o > busy_above);
            let point = results::Point {
                label: label.unwrap_or_else(|| report.target.clone()),
                durable: !not_durable,
                unix_time: std::time::SystemTime::now()
                    .duration_since(std::time::UNIX_EPOCH)
                    .map_or(0, |d| d.as_secs()),
                probe,
                slow_probe: slow,
                busy_machine: busy,
                server_version,
                rerun,
                sitting,
                report,
            };
            if json {
                println!("{}", serde_json::to_string(&point)?);
            } else {
                print!("{}", point.report);
                if slow {
                    println!("  (slow disk spell: probe under {slow_below:.0} fsyncs/s)");
                }
                if busy {
                    println!("  (busy machine: other processes over {busy_above:.0}% CPU)");
                }
            }
            if let Some(out) = out {
                results::append(&out, &point)?;
            }
            if slow || busy {
                std::process::exit(EXIT_SLOW_PROBE);
            }
        }
        Cmd::DiskProbe { dir, seconds, json } => {
            let p =
                tokio::task::spawn_blocking(move || probe::probe(&dir, seconds, seconds)).await??;
            if json {
                println!("{}", serde_json::to_string(&p)?);
            } else {
                println!("{p}");
            }
        }
        Cmd::Chart {
            results,
            out,
            title,
            font,
        } => {
            let points = results::load(&results)?;
            chart::draw(&points, &out, &title, font.as_deref())?;
            println!("wrote {}", out.display());
        }
        Cmd::Report {
            results,
            preamble,
            insert_into,
            section: name,
        } => {
            let points = results::load(&results)?;
            let mut section = String::new();
            if let Some(p) = preamble {
                section.push_str(
                    &std::fs::read_to_string(&p)
                        .with_context(|| format!("reading {}", p.display()))?,
                );
                if !section.ends_with('\n') {
                    section.push('\n');
                }
                section.push('\n');
            }
            section.push_str(&results::table(&points));
            match insert_into {
                Some(file) => {
                    let doc = match std::fs::read_to_string(&file) {
                        Ok(d) => d,
                        Err(e) if e.kind() == std::io::ErrorKind::NotFound => {
                            "# Benchmarks\n".to_string()
                        }
                        Err(e) => return Err(e).context(format!("reading {}", file.display())),
                    };
                    std::fs::write(&file, results::splice_named(&doc, &name, &section))
                        .with_context(|| format!("writing {}", file.display()))?;
                    println!("updated {}", file.display());
                }
                None => print!("{section}"),
            }
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn durations() {
        assert_eq!(parse_duration("15s"), Ok(Duration::from_secs(15)));
        assert_eq!(parse_duration("3"), Ok(Duration::from_secs(3)));
        assert_eq!(parse_duration("500ms"), Ok(Duration::from_millis(500)));
        assert_eq!(parse_duration("2m"), Ok(Duration::from_secs(120)));
        assert!(parse_duration("2h").is_err());
        assert!(parse_duration("x").is_err());
    }

    #[test]
    fn loopback_only() {
        for ok in [
            "http://127.0.0.1:7400",
            "redis://127.0.0.1:6390/",
            "nats://localhost:4230",
            "http://[::1]:2379",
            "host=127.0.0.1 port=5439 user=postgres",
            "postgresql://u@127.0.0.1:5439/db",
            "host=/tmp/pg port=5439",
        ] {
            assert!(ensure_loopback(ok).is_ok(), "{ok}");
        }
        for bad in [
            "http://10.0.0.1:7400",
            "redis://example.com:6379/",
            "host=192.168.1.2 port=5432",
            "postgresql://u@8.8.8.8/db",
            "nonsense",
        ] {
            assert!(ensure_loopback(bad).is_err(), "{bad}");
        }
    }
}
