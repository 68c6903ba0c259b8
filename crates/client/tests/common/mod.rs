//! A `forkless serve` harness for the tests that use real processes.
#![allow(dead_code)]

use std::io::{Read, Write};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::OnceLock;
use std::time::{Duration, Instant};

pub fn forkless_bin() -> &'static Path {
    static BIN: OnceLock<PathBuf> = OnceLock::new();
    BIN.get_or_init(|| {
        if let Some(p) = std::env::var_os("FORKLESS_BIN") {
            return PathBuf::from(p);
        }
        let root = Path::new(env!("CARGO_MANIFEST_DIR")).join("../..");
        let cargo = std::env::var_os("CARGO").unwrap_or_else(|| "cargo".into());
        let status = Command::new(cargo)
            .args(["build", "--quiet", "-p", "forkless", "--bin", "forkless"])
            .current_dir(&root)
            .stdin(Stdio::null())
            .status()
            .expect("running cargo build -p forkless");
        assert!(status.success(), "cargo build -p forkless failed");
        let target = std::env::var_os("CARGO_TARGET_DIR")
            .map(PathBuf::from)
            .unwrap_or_else(|| root.join("target"));
        let bin = target.join("debug").join("forkless");
        assert!(bin.is_file(), "no binary at {}", bin.display());
        bin
    })
}

pub fn free_ports(n: usize) -> Vec<u16> {
    let ls: Vec<_> = (0..n)
        .map(|_| std::net::TcpListener::bind("127.0.0.1:0").expect("bind"))
        .collect();
    ls.iter()
        .map(|l| l.local_addr().expect("addr").port())
        .collect()
}

/// A `forkless serve` process, killed when dropped.
pub struct Node {
    child: Child,
    pub port: u16,
    _log: PathBuf,
}

impl Drop for Node {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

impl Node {
    pub fn spawn(args: &[&str], port: u16, log: PathBuf) -> Node {
        let out = std::fs::File::create(&log).expect("log file");
        let child = Command::new(forkless_bin())
            .arg("serve")
            .args(args)
            .env_remove("FORKLESS_SHARD_COUNT")
            .env_remove("FORKLESS_CONFIG")
            .stdin(Stdio::null())
            .stdout(out.try_clone().expect("log file"))
            .stderr(out)
            .spawn()
            .expect("spawning forkless serve");
        let mut n = Node {
            child,
            port,
            _log: log,
        };
        n.wait_ready();
        n
    }

    pub fn url(&self) -> String {
        format!("http://127.0.0.1:{}", self.port)
    }

    /// Polls `/readyz` until it answers 200.
    fn wait_ready(&mut self) {
        let deadline = Instant::now() + Duration::from_secs(30);
        loop {
            if let Ok(Some(status)) = self.child.try_wait() {
                panic!(
                    "forkless serve exited during startup ({status}); log: {}",
                    std::fs::read_to_string(&self._log).unwrap_or_default()
                );
            }
            if get_status(self.port, "/readyz") == Some(200) {
                return;
            }
            assert!(Instant::now() < deadline, "node not ready after 30 s");
            std::thread::sleep(Duration::from_millis(20));
        }
    }

    /// `forkless_route_total{outcome=...}` from this node's metrics.
    pub fn route_count(&self, outcome: &str) -> u64 {
        let body = get_body(self.port, "/metrics").unwrap_or_default();
        let needle = format!("outcome=\"{outcome}\"");
        body.lines()
            .filter(|l| l.starts_with("forkless_route") && l.contains(&needle))
            .filter_map(|l| l.split_whitespace().last()?.parse::<f64>().ok())
            .map(|v| v as u64)
            .sum()
    }
}

fn raw_get(port: u16, path: &str) -> Option<String> {
    let mut s = std::net::TcpStream::connect(("127.0.0.1", port)).ok()?;
    s.set_read_timeout(Some(Duration::from_secs(2))).ok()?;
    write!(
        s,
        "GET {path} HTTP/1.1\r\nHost: 127.0.0.1\r\nConnection: close\r\n\r\n"
    )
    .ok()?;
    let mut buf = String::new();
    s.read_to_string(&mut buf).ok()?;
    Some(buf)
}

fn get_status(port: u16, path: &str) -> Option<u16> {
    raw_get(port, path)?.get(9..12)?.parse().ok()
}

fn get_body(port: u16, path: &str) -> Option<String> {
    let r = raw_get(port, path)?;
    Some(r.split_once("\r\n\r\n")?.1.to_string())
}
