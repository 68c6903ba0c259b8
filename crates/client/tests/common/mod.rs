//! A `forkless serve` harness for the client tests that use real processes:
//! a thin layer over `forkless-it` (the binary, free ports, spawning with a
//! kill-on-drop backstop, readiness), keeping the `Node::spawn(args, port,
//! log)` shape these tests use.
#![allow(dead_code)]

use std::path::PathBuf;
use std::time::{Duration, Instant};

// Not every test binary uses both.
#[allow(unused_imports)]
pub use forkless_it::{forkless_bin, free_ports};

/// A `forkless serve` process, killed when dropped.
pub struct Node {
    proc: forkless_it::Proc,
    api: forkless_it::Client,
    pub port: u16,
}

impl Node {
    /// Runs `forkless serve ARGS` (which must make it listen on `port`),
    /// its log in `log`, and waits for `/readyz`.
    pub fn spawn(args: &[&str], port: u16, log: PathBuf) -> Node {
        let mut all = vec!["serve".to_string()];
        all.extend(args.iter().map(|a| a.to_string()));
        let mut n = Node {
            proc: forkless_it::Proc::spawn(&all, &log),
            api: forkless_it::Client::new(forkless_it::addr(port)),
            port,
        };
        n.wait_ready();
        n
    }

    pub fn url(&self) -> String {
        format!("http://{}", self.api.addr)
    }

    fn wait_ready(&mut self) {
        let deadline = Instant::now() + Duration::from_secs(30);
        while !self.api.ready() {
            if let Some(status) = self.proc.try_exit() {
                panic!(
                    "forkless serve exited during startup ({status}); log: {}",
                    self.proc.log()
                );
            }
            assert!(Instant::now() < deadline, "node not ready after 30 s");
            std::thread::sleep(Duration::from_millis(20));
        }
    }

    /// `forkless_route_total{outcome=...}` from this node's metrics.
    pub fn route_count(&self, outcome: &str) -> u64 {
        let text = self.api.get("/metrics").text();
        forkless_it::parse_metric(
            &text,
            &format!("forkless_route_total{{outcome=\"{outcome}\"}}"),
        ) as u64
    }
}
