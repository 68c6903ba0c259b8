//! `forkless dev-cluster`: a local cluster of real `forkless serve`
//! processes on loopback, for trying routing in one command. A replicated
//! one keeps running when a node exits (kill one to watch its shards
//! elect new leaders); a static one stops every node when one exits.

use anyhow::{bail, Context};
use std::io::Read;
use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

#[derive(clap::Args, Debug)]
pub struct DevClusterArgs {
    /// How many nodes to run.
    #[arg(long, default_value_t = 3)]
    nodes: u16,
    /// Shards: a power of two from 1 to 4096, spread evenly over the nodes.
    #[arg(long, default_value_t = 16)]
    shards: u64,
    /// Where the nodes keep their data (one folder per node).
    #[arg(long, default_value = "./forkless-dev-cluster")]
    data_dir: PathBuf,
    /// Node i (from 1) listens for clients on base_port + i - 1, for
    /// peers on base_port + 100 + i - 1, and for Raft on base_port + 200 +
    /// i - 1.
    #[arg(long, default_value_t = 7071)]
    base_port: u16,
    /// Replicas of each shard (every shard a Raft group on that many
    /// nodes, its leader elected); 1 is the static cluster of one copy.
    /// Default: 3 with three nodes or more, else 1.
    #[arg(long)]
    replication_factor: Option<u16>,
}

struct Nodes(Vec<(u16, Child)>);

impl Nodes {
    /// A node that has exited, and how.
    fn exited(&mut self) -> Option<(u16, std::process::ExitStatus)> {
        self.0
            .iter_mut()
            .find_map(|(id, c)| c.try_wait().ok().flatten().map(|s| (*id, s)))
    }
}

impl Drop for Nodes {
    fn drop(&mut self) {
        for (_, c) in &mut self.0 {
            // A node that exited already (killed by hand) is not signalled:
            // `kill` said "No such process" for it.
            if matches!(c.try_wait(), Ok(Some(_))) {
                continue;
            }
            // SIGTERM first, so each node shuts down gracefully. Its pid
            // is still its own: the child is not reaped until try_wait
            // sees it exit.
            if let Ok(pid) = libc::pid_t::try_from(c.id()) {
                // SAFETY: kill(2) reads no memory of ours; a child that
                // has just exited (a zombie until reaped) takes the
                // signal harmlessly.
                unsafe {
                    libc::kill(pid, libc::SIGTERM);
                }
            }
        }
        let deadline = Instant::now() + Duration::from_secs(10);
        for (id, c) in &mut self.0 {
            loop {
                match c.try_wait() {
                    Ok(Some(_)) => break,
                    Ok(None) if Instant::now() < deadline => {
                        std::thread::sleep(Duration::from_millis(20))
                    }
                    _ => {
                        eprintln!("node {id} did not stop in time; killing it");
                        let _ = c.kill();
                        let _ = c.wait();
                        break;
                    }
                }
            }
        }
    }
}

pub fn run(a: DevClusterArgs) -> anyhow::Result<()> {
    let count = forkless_sharding::ShardCount::new(a.shards).context("--shards")?;
    if a.nodes == 0 || a.nodes > 64 {
        bail!("--nodes must be 1 to 64");
    }
    let factor = a
        .replication_factor
        .unwrap_or(if a.nodes >= 3 { 3 } else { 1 });
    if factor == 0 || factor > a.nodes {
        bail!(
            "--replication-factor must be 1 to --nodes ({}), not {factor}",
            a.nodes
        );
    }
    if a.base_port as u32 + 200 + a.nodes as u32 > u16::MAX as u32 {
        bail!(
            "--base-port {} leaves no room for {} nodes",
            a.base_port,
            a.nodes
        );
    }
    std::fs::create_dir_all(&a.data_dir)
        .with_context(|| format!("creating {}", a.data_dir.display()))?;
    let config = a.data_dir.join("cluster.toml");
    let mut toml = format!(
        "# Written by `forkless dev-cluster`.\nshard_count = {}\nsecret = \"{}\"\n\n[peer]\nforward_connect_timeout_ms = 500\nforward_timeout_ms = 2000\nprobe_interval_ms = 250\nprobe_timeout_ms = 500\n",
        count.get(),
        random_secret()?
    );
    // Said even when 1: a file of three nodes or more that leaves it out
    // replicates three times.
    toml = format!("replication_factor = {factor}\n{toml}");
    for i in 1..=a.nodes {
        toml.push_str(&format!(
            "\n[[nodes]]\nid = {i}\napi_addr = \"127.0.0.1:{}\"\npeer_addr = \"127.0.0.1:{}\"\n",
            a.base_port + i - 1,
            a.base_port + 100 + i - 1
        ));
        if factor > 1 {
            toml.push_str(&format!(
                "raft_addr = \"127.0.0.1:{}\"\n",
                a.base_port + 200 + i - 1
            ));
        }
    }
    std::fs::write(&config, toml).with_context(|| format!("writing {}", config.display()))?;

    let exe = std::env::current_exe().context("finding the forkless binary")?;
    let mut nodes = Nodes(Vec::new());
    for i in 1..=a.nodes {
        let dir = a.data_dir.join(format!("node-{i}"));
        let log = std::fs::File::create(a.data_dir.join(format!("node-{i}.log")))?;
        let mut cmd = Command::new(&exe);
        ends_with_this_process(&mut cmd);
        let child = cmd
            .args(["serve", "--config"])
            .arg(&config)
            .args(["--node", &i.to_string(), "--data-dir"])
            .arg(&dir)
            .stdin(Stdio::null())
            .stdout(log.try_clone()?)
            .stderr(log)
            .spawn()
            .with_context(|| format!("starting node {i}"))?;
        nodes.0.push((i, child));
    }
    let deadline = Instant::now() + Duration::from_secs(30);
    for i in 1..=a.nodes {
        let addr = format!("127.0.0.1:{}", a.base_port + i - 1);
        while !ready(&addr) {
            if let Some((id, status)) = nodes.exited() {
                bail!(
                    "node {id} exited ({status}) during startup; see {}",
                    a.data_dir.join(format!("node-{id}.log")).display()
                );
            }
            if Instant::now() > deadline {
                bail!("node {i} at {addr} not ready after 30 s");
            }
            std::thread::sleep(Duration::from_millis(50));
        }
    }
    if factor > 1 {
        // Every shard led, and no replica still new: each replica of a new
        // cluster starts careful (it cannot tell a new cluster from a lost
        // disk), and one that did not vote for its shard's first leader
        // takes it only once that leader confirmed with the others; a node
        // killed before then leaves the shard waiting for it
        // (`docs/replication.md`, "A replica whose data directory is new").
        // A user told to kill a node once the cluster is up should find it
        // settled.
        for i in 1..=a.nodes {
            let addr = format!("127.0.0.1:{}", a.base_port + i - 1);
            while !settled(&addr) {
                if let Some((id, status)) = nodes.exited() {
                    bail!(
                        "node {id} exited ({status}) during startup; see {}",
                        a.data_dir.join(format!("node-{id}.log")).display()
                    );
                }
                if Instant::now() > deadline {
                    bail!(
                        "node {i} at {addr}: its shards did not all elect a leader and catch up within 30 s; see {}",
                        a.data_dir.join(format!("node-{i}.log")).display()
                    );
                }
                std::thread::sleep(Duration::from_millis(50));
            }
        }
    }
    println!(
        "forkless dev cluster: {} nodes, {} shards, {}, config {}",
        a.nodes,
        count.get(),
        if factor > 1 {
            format!("{factor} replicas of each (leaders elected: `forkless status` shows them)")
        } else {
            "one copy of each".to_string()
        },
        config.display()
    );
    println!(
        "{:<6} {:<18} {:<18} {}",
        "node",
        "api",
        "peer",
        if factor > 1 {
            "replicas of shards"
        } else {
            "shards"
        }
    );
    for i in 1..=a.nodes {
        // The placement of `config::Replicated::replicas` (factor 1: the
        // static spread, the same rule).
        let held: Vec<String> = (0..count.get())
            .filter(|s| (0..factor as u32).any(|k| (s + k) % a.nodes as u32 == (i - 1) as u32))
            .map(|s| s.to_string())
            .collect();
        println!(
            "{:<6} {:<18} {:<18} {}",
            i,
            format!("127.0.0.1:{}", a.base_port + i - 1),
            format!("127.0.0.1:{}", a.base_port + 100 + i - 1),
            held.join(",")
        );
    }
    println!(
        "logs: {}/node-<id>.log; press Ctrl-C to stop every node",
        a.data_dir.display()
    );

    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()?;
    let stop = rt.block_on(async {
        let mut term = tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate()).ok();
        let mut tick = tokio::time::interval(Duration::from_millis(200));
        let mut exited = std::collections::BTreeSet::new();
        loop {
            tokio::select! {
                _ = tokio::signal::ctrl_c() => return None,
                _ = async { match term.as_mut() { Some(t) => { t.recv().await; } None => std::future::pending::<()>().await } } => return None,
                _ = tick.tick() => {
                    for (id, c) in &mut nodes.0 {
                        if exited.contains(id) {
                            continue;
                        }
                        let Ok(Some(status)) = c.try_wait() else { continue };
                        let why = format!("node {id} exited ({status})");
                        // A replicated cluster is meant to outlive a node
                        // (kill one to watch its shards elect new leaders):
                        // the others keep running.
                        if factor == 1 {
                            return Some(why);
                        }
                        exited.insert(*id);
                        println!(
                            "{why}; the others keep serving. Start it again with: forkless serve --config {} --node {id} --data-dir {}",
                            config.display(),
                            a.data_dir.join(format!("node-{id}")).display()
                        );
                    }
                    if exited.len() == nodes.0.len() {
                        return Some("every node exited".to_string());
                    }
                }
            }
        }
    });
    let running = nodes
        .0
        .iter_mut()
        .filter_map(|(_, c)| matches!(c.try_wait(), Ok(None)).then_some(()))
        .count();
    if running == nodes.0.len() {
        println!("stopping {running} nodes");
    } else {
        println!(
            "stopping {running} of its {} nodes (the others exited; a node started again by hand is not the dev cluster's to stop)",
            nodes.0.len()
        );
    }
    drop(nodes);
    match stop {
        Some(why) => bail!("{why}; stopped the others"),
        None => Ok(()),
    }
}

fn ready(addr: &str) -> bool {
    get(addr, "/readyz", Duration::from_millis(500)).is_some()
}

/// The body of a `200` answer to `GET path` from the node at `addr`, read
/// within `within`; `None` for any other answer or none.
fn get(addr: &str, path: &str, within: Duration) -> Option<Vec<u8>> {
    use std::io::Write;
    let mut s = std::net::TcpStream::connect_timeout(
        &addr.parse().expect("formatted above"),
        Duration::from_millis(200),
    )
    .ok()?;
    let _ = s.set_read_timeout(Some(within));
    s.write_all(format!("GET {path} HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n").as_bytes())
        .ok()?;
    let mut answer = Vec::new();
    s.read_to_end(&mut answer).ok()?;
    if !answer.starts_with(b"HTTP/1.1 200") {
        return None;
    }
    let at = answer.windows(4).position(|w| w == b"\r\n\r\n")?;
    Some(answer.split_off(at + 4))
}

/// A node the dev cluster starts gets SIGTERM when the dev cluster's
/// process ends, however it ends: a `kill -9` of the dev cluster (or of a
/// test that ran it) would otherwise leave its nodes running, holding
/// their ports (CI found two left from a failed test an hour later).
#[cfg(target_os = "linux")]
fn ends_with_this_process(cmd: &mut Command) {
    use std::os::unix::process::CommandExt;
    // SAFETY: getpid is async-signal-safe.
    let parent = unsafe { libc::getpid() };
    // SAFETY: the closure runs in the child between fork and exec and
    // calls only prctl, getppid and _exit, which are async-signal-safe.
    unsafe {
        cmd.pre_exec(move || {
            if libc::prctl(libc::PR_SET_PDEATHSIG, libc::SIGTERM) != 0 {
                return Err(std::io::Error::last_os_error());
            }
            // The dev cluster ended before the prctl took: end too.
            if libc::getppid() != parent {
                libc::_exit(0);
            }
            Ok(())
        });
    }
}

#[cfg(not(target_os = "linux"))]
fn ends_with_this_process(_cmd: &mut Command) {}

/// Whether the node at `addr` knows a leader for every shard and holds no
/// replica that is new and not caught up (`GET /api/cluster`).
fn settled(addr: &str) -> bool {
    let Some(body) = get(addr, "/api/cluster", Duration::from_secs(2))
        .and_then(|b| serde_json::from_slice::<serde_json::Value>(&b).ok())
    else {
        return false;
    };
    body["shards"].as_array().is_some_and(|shards| {
        shards
            .iter()
            .all(|s| !s["leader"].is_null() && s["raft"]["fresh"] != true)
    })
}

fn random_secret() -> anyhow::Result<String> {
    let mut b = [0u8; 16];
    std::fs::File::open("/dev/urandom")
        .and_then(|mut f| f.read_exact(&mut b))
        .context("reading /dev/urandom for the cluster secret")?;
    Ok(b.iter().map(|x| format!("{x:02x}")).collect())
}
