//! A small harness for forkless integration tests: the real `forkless`
//! binary run as child processes on 127.0.0.1, a blocking HTTP/1.1 client,
//! free ports, temporary data dirs, and guards that kill every process they
//! started (SIGKILL on drop, and the kernel's parent-death signal as a
//! backstop), plus a per-test deadline that aborts a hung test.
//!
//! Nothing here sleeps for a fixed time to let something happen: callers
//! wait on conditions with [`wait_until`].
//!
//! Run: `cargo test -p forkless-it` (builds `forkless` first if needed; set
//! `FORKLESS_BIN` to test another binary). A test that pins down a
//! reported, not yet fixed bug is `#[ignore]`d with the bug in the reason
//! (`cargo test -p forkless-it -- --ignored` runs those).

use serde_json::Value;
use std::io::{Read, Write};
use std::net::{SocketAddr, TcpListener, TcpStream};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{mpsc, Arc, Mutex, OnceLock};
use std::time::{Duration, Instant};

pub use serde_json::json;

pub mod faultproxy;

/// How long a test may run before the deadline guard aborts it.
pub const TEST_DEADLINE: Duration = Duration::from_secs(90);

/// How long a node may take to answer `/readyz` after it is spawned.
pub const READY_TIMEOUT: Duration = Duration::from_secs(20);

/// The per-request timeout of the test client.
pub const REQUEST_TIMEOUT: Duration = Duration::from_secs(15);

// ---------------------------------------------------------------------------
// The binary

/// The `forkless` binary: `$FORKLESS_BIN`, else `cargo build -p forkless`
/// (once per test binary; a no-op when up to date) and
/// `<target>/debug/forkless`. Panics with a clear message if there is none.
pub fn forkless_bin() -> &'static Path {
    static BIN: OnceLock<PathBuf> = OnceLock::new();
    BIN.get_or_init(|| {
        if let Some(p) = std::env::var_os("FORKLESS_BIN") {
            let p = PathBuf::from(p);
            assert!(
                p.is_file(),
                "FORKLESS_BIN={} is not a file",
                p.display()
            );
            return p;
        }
        let root = Path::new(env!("CARGO_MANIFEST_DIR")).join("../..");
        let target = std::env::var_os("CARGO_TARGET_DIR")
            .map(PathBuf::from)
            .unwrap_or_else(|| root.join("target"));
        let debug = target.join("debug").join("forkless");
        let release = target.join("release").join("forkless");
        let mut build_error = None;
        if std::env::var_os("FORKLESS_IT_NO_BUILD").is_none() {
            let cargo = std::env::var_os("CARGO").unwrap_or_else(|| "cargo".into());
            let started = Instant::now();
            match Command::new(&cargo)
                .args(["build", "--quiet", "-p", "forkless", "--bin", "forkless"])
                .current_dir(&root)
                .stdin(Stdio::null())
                .status()
            {
                Ok(s) if s.success() => {}
                Ok(s) => build_error = Some(format!("`cargo build -p forkless` failed: {s}")),
                Err(e) => build_error = Some(format!("could not run cargo: {e}")),
            }
            eprintln!(
                "[it] cargo build -p forkless: {:.1}s",
                started.elapsed().as_secs_f64()
            );
        }
        let found = [&debug, &release].into_iter().find(|p| p.is_file()).cloned();
        match (found, build_error) {
            (Some(p), None) => p,
            (Some(p), Some(e)) => {
                eprintln!("[it] WARNING: {e}; testing the existing, possibly stale, {}", p.display());
                p
            }
            (None, e) => panic!(
                "the forkless binary was not found at {} or {} ({}); build it with `cargo build -p forkless` or set FORKLESS_BIN",
                debug.display(),
                release.display(),
                e.unwrap_or_else(|| "FORKLESS_IT_NO_BUILD is set".into())
            ),
        }
    })
}

/// `forkless cluster remove-node node [--to to] --server server`, given
/// `within` to end: its exit code and the report it printed.
fn remove_node_cli(
    server: &str,
    node: u16,
    to: Option<u16>,
    within: Duration,
) -> (Option<i32>, Value) {
    let (node, to) = (node.to_string(), to.map(|t| t.to_string()));
    let mut args = vec!["cluster", "remove-node", node.as_str(), "--server", server];
    if let Some(t) = &to {
        args.extend(["--to", t.as_str()]);
    }
    let (code, out, err) = run_cli(&args, within);
    let report = serde_json::from_str(out.trim())
        .unwrap_or_else(|e| panic!("remove-node printed no report ({e}): {out}\n{err}"));
    (code, report)
}

/// Runs `forkless ARGS` to completion (bounded), returning (exit ok, stdout, stderr).
pub fn run_cli(args: &[&str], timeout: Duration) -> (Option<i32>, String, String) {
    let dir = tempfile::tempdir().expect("tempdir");
    let out = dir.path().join("stdout");
    let err = dir.path().join("stderr");
    let mut child = Command::new(forkless_bin())
        .args(args)
        .stdin(Stdio::null())
        .stdout(std::fs::File::create(&out).expect("stdout file"))
        .stderr(std::fs::File::create(&err).expect("stderr file"))
        .env_remove("FORKLESS_SHARD_COUNT")
        .spawn()
        .expect("spawn forkless");
    let deadline = Instant::now() + timeout;
    let code = loop {
        if let Some(s) = child.try_wait().expect("try_wait") {
            break s.code();
        }
        if Instant::now() > deadline {
            let _ = child.kill();
            let _ = child.wait();
            panic!("forkless {args:?} did not exit within {timeout:?}");
        }
        std::thread::sleep(Duration::from_millis(10));
    };
    (
        code,
        std::fs::read_to_string(out).unwrap_or_default(),
        std::fs::read_to_string(err).unwrap_or_default(),
    )
}

// ---------------------------------------------------------------------------
// Processes

fn live_pids() -> &'static Mutex<Vec<u32>> {
    static PIDS: OnceLock<Mutex<Vec<u32>>> = OnceLock::new();
    PIDS.get_or_init(|| Mutex::new(Vec::new()))
}

/// Whether every thread of `pid` is stopped (state `T` in its
/// `/proc/<pid>/task/<tid>/stat`).
fn all_threads_stopped(pid: u32) -> bool {
    let Ok(tasks) = std::fs::read_dir(format!("/proc/{pid}/task")) else {
        return false;
    };
    let mut any = false;
    for t in tasks.flatten() {
        let Ok(stat) = std::fs::read_to_string(t.path().join("stat")) else {
            // A thread that ended between the listing and the read.
            continue;
        };
        // The state follows the command name, which is in parentheses and
        // may itself contain them.
        let state = stat
            .rsplit_once(')')
            .and_then(|(_, rest)| rest.split_whitespace().next());
        if state != Some("T") {
            return false;
        }
        any = true;
    }
    any
}

fn signal(pid: u32, sig: libc::c_int) {
    // SAFETY: kill(2) with a pid we spawned and still own (not yet reaped).
    unsafe {
        libc::kill(pid as libc::pid_t, sig);
    }
}

/// A child process, SIGKILLed and reaped on drop.
pub struct Proc {
    child: Child,
    pub stderr_path: PathBuf,
    reaped: bool,
}

impl Proc {
    /// Spawns `forkless ARGS`, stderr (its log) to `stderr_path` (appended).
    pub fn spawn(args: &[String], stderr_path: &Path) -> Proc {
        Proc::spawn_in(args, stderr_path, None)
    }

    /// [`Proc::spawn`], in the network namespace at `netns` (a file under
    /// `/var/run/netns`) when given.
    pub fn spawn_in(args: &[String], stderr_path: &Path, netns: Option<&Path>) -> Proc {
        let log = std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(stderr_path)
            .expect("open node log");
        let mut cmd = Command::new(forkless_bin());
        cmd.args(args)
            .stdin(Stdio::null())
            .stdout(log.try_clone().expect("dup log"))
            .stderr(log)
            .env_remove("FORKLESS_CONFIG")
            .env_remove("FORKLESS_NODE")
            .env_remove("FORKLESS_DATA_DIR")
            .env_remove("FORKLESS_LISTEN")
            .env_remove("FORKLESS_SHARD_COUNT")
            .env("FORKLESS_LOG", "info");
        let ns = netns.map(|p| {
            std::fs::File::open(p)
                .unwrap_or_else(|e| panic!("open network namespace {}: {e}", p.display()))
        });
        #[cfg(target_os = "linux")]
        {
            use std::os::fd::AsRawFd;
            use std::os::unix::process::CommandExt;
            let ns_fd = ns.as_ref().map(|f| f.as_raw_fd());
            // SAFETY: prctl and setns are async-signal-safe; the first is a
            // backstop so a node never outlives the test that started it,
            // even if the test aborts; the second moves the child into the
            // test's network namespace before it runs.
            unsafe {
                cmd.pre_exec(move || {
                    libc::prctl(libc::PR_SET_PDEATHSIG, libc::SIGKILL);
                    if let Some(fd) = ns_fd {
                        if libc::setns(fd, libc::CLONE_NEWNET) != 0 {
                            return Err(std::io::Error::last_os_error());
                        }
                    }
                    Ok(())
                });
            }
        }
        let child = cmd.spawn().expect("spawn forkless");
        drop(ns);
        live_pids().lock().unwrap().push(child.id());
        Proc {
            child,
            stderr_path: stderr_path.to_path_buf(),
            reaped: false,
        }
    }

    pub fn pid(&self) -> u32 {
        self.child.id()
    }

    /// The exit code if it has exited.
    pub fn try_exit(&mut self) -> Option<std::process::ExitStatus> {
        let s = self.child.try_wait().ok().flatten();
        if s.is_some() {
            self.reaped = true;
        }
        s
    }

    /// SIGSTOP, and waits until every thread of the process has stopped:
    /// kill(2) returns once the signal is pending, and until the thread
    /// the kernel picks to take it runs (late on a busy machine), the
    /// process's other threads keep serving.
    pub fn sigstop(&self) {
        let pid = self.pid();
        signal(pid, libc::SIGSTOP);
        wait_until(
            &format!("process {pid} to stop after SIGSTOP"),
            Duration::from_secs(10),
            || all_threads_stopped(pid).then_some(()),
        );
    }

    pub fn sigterm(&self) {
        signal(self.pid(), libc::SIGTERM);
    }

    pub fn sigcont(&self) {
        signal(self.pid(), libc::SIGCONT);
    }

    /// SIGHUP: a node reads its cluster file again.
    pub fn sighup(&self) {
        signal(self.pid(), libc::SIGHUP);
    }

    /// SIGKILL and reap.
    pub fn kill9(&mut self) {
        if !self.reaped {
            let _ = self.child.kill();
            let _ = self.child.wait();
            self.reaped = true;
        }
        let pid = self.pid();
        live_pids().lock().unwrap().retain(|p| *p != pid);
    }

    /// Waits (bounded) for the process to exit on its own.
    pub fn wait_exit(&mut self, timeout: Duration) -> Option<std::process::ExitStatus> {
        let deadline = Instant::now() + timeout;
        while Instant::now() < deadline {
            if let Some(s) = self.try_exit() {
                return Some(s);
            }
            std::thread::sleep(Duration::from_millis(10));
        }
        None
    }

    pub fn log(&self) -> String {
        std::fs::read_to_string(&self.stderr_path).unwrap_or_default()
    }
}

impl Drop for Proc {
    fn drop(&mut self) {
        self.kill9();
    }
}

/// Aborts the test binary (killing every node it started) if the guard is
/// not dropped within `limit`.
pub struct Deadline {
    done: Option<mpsc::Sender<()>>,
}

/// A test's time bound, which starts once the binary under test is there:
/// [`forkless_bin`] is found (built, on a first run, which can take longer
/// than any test's bound) before the clock starts.
pub fn deadline(name: &'static str, limit: Duration) -> Deadline {
    forkless_bin();
    let (tx, rx) = mpsc::channel::<()>();
    std::thread::spawn(move || {
        if let Err(mpsc::RecvTimeoutError::Timeout) = rx.recv_timeout(limit) {
            eprintln!("[it] TEST {name} EXCEEDED ITS DEADLINE OF {limit:?}: killing its nodes and aborting");
            for pid in live_pids().lock().map(|p| p.clone()).unwrap_or_default() {
                signal(pid, libc::SIGCONT);
                signal(pid, libc::SIGKILL);
            }
            std::process::abort();
        }
    });
    Deadline { done: Some(tx) }
}

impl Drop for Deadline {
    fn drop(&mut self) {
        if let Some(tx) = self.done.take() {
            let _ = tx.send(());
        }
    }
}

/// Polls `f` every 10 ms until it returns `Some`, or panics naming `what`.
pub fn wait_until<T>(what: &str, timeout: Duration, mut f: impl FnMut() -> Option<T>) -> T {
    let deadline = Instant::now() + timeout;
    loop {
        if let Some(v) = f() {
            return v;
        }
        if Instant::now() > deadline {
            panic!("timed out after {timeout:?} waiting for {what}");
        }
        std::thread::sleep(Duration::from_millis(10));
    }
}

/// `n` distinct free ports on 127.0.0.1 (all held while picking, then
/// released): [`hold_free_ports`]'s, let go at once. Where the port is
/// bound again only later, hold it instead (as [`Cluster`] does until a
/// node starts): a released port can be taken by anyone meanwhile.
pub fn free_ports(n: usize) -> Vec<u16> {
    hold_free_ports(n).iter().map(HeldPort::port).collect()
}

/// A TCP port of 127.0.0.1 bound and not listening, without
/// `SO_REUSEADDR`: no one else can bind it while it is held, and a
/// connection to it is refused (as to a node not started yet).
pub struct HeldPort(socket2::Socket);

impl HeldPort {
    fn bind(port: u16) -> std::io::Result<HeldPort> {
        use socket2::{Domain, Socket, Type};
        let s = Socket::new(Domain::IPV4, Type::STREAM, None)?;
        s.bind(&addr(port).into())?;
        Ok(HeldPort(s))
    }

    pub fn port(&self) -> u16 {
        self.0
            .local_addr()
            .ok()
            .and_then(|a| a.as_socket())
            .map(|a| a.port())
            .expect("a bound socket's address")
    }

    /// Starts listening (the kernel then completes connections to it).
    pub fn listen(self) -> TcpListener {
        self.0.listen(128).expect("listen on a held port");
        self.0.into()
    }
}

/// `n` listeners on distinct free ports of 127.0.0.1, below the kernel's
/// ephemeral range: a port picked from that range (`bind(:0)`) can be
/// taken between the pick and the node's bind by any outgoing connection
/// on the machine (a node's own, or another test's: CI once saw a node
/// refuse to start with "address already in use" so). No port is handed
/// out twice in one process (the tests of one binary run in parallel), and
/// each process starts its walk at a place of its own (its pid and the
/// clock: processes in separate pid namespaces can share a pid).
pub fn hold_free_ports(n: usize) -> Vec<HeldPort> {
    use std::sync::atomic::{AtomicUsize, Ordering};
    static NEXT: AtomicUsize = AtomicUsize::new(usize::MAX);
    let ephemeral_low = std::fs::read_to_string("/proc/sys/net/ipv4/ip_local_port_range")
        .ok()
        .and_then(|t| t.split_whitespace().next()?.parse::<usize>().ok())
        .unwrap_or(32768);
    let (low, high) = (10_000usize, ephemeral_low.min(65_536));
    if high <= low + 1000 {
        // An ephemeral range that leaves no room below it: the kernel picks.
        return (0..n)
            .map(|_| HeldPort::bind(0).expect("bind 127.0.0.1:0"))
            .collect();
    }
    let span = high - low;
    // Each process starts at its own place in the range.
    let nanos = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.subsec_nanos() as usize)
        .unwrap_or(0);
    let _ = NEXT.compare_exchange(
        usize::MAX,
        (std::process::id() as usize * 7919 + nanos / 1000) % span,
        Ordering::AcqRel,
        Ordering::Acquire,
    );
    let mut held = Vec::with_capacity(n);
    for _ in 0..span {
        if held.len() == n {
            break;
        }
        let port = low + NEXT.fetch_add(1, Ordering::AcqRel) % span;
        if let Ok(l) = HeldPort::bind(port as u16) {
            held.push(l);
        }
    }
    assert_eq!(held.len(), n, "no {n} free ports below {high} on 127.0.0.1");
    held
}

/// A base port `b` such that every `b + offset` of `offsets` is free on
/// 127.0.0.1 now (for a command that takes a base port and adds to it,
/// as `forkless dev-cluster --base-port` does). Not held: free when
/// picked, like [`hold_free_ports`]'s.
pub fn free_port_block(offsets: &[u16]) -> u16 {
    let top = offsets.iter().copied().max().unwrap_or(0);
    for _ in 0..200 {
        let base = hold_free_ports(1)[0].port();
        if base.checked_add(top).is_none() {
            continue;
        }
        if offsets.iter().all(|o| HeldPort::bind(base + o).is_ok()) {
            return base;
        }
    }
    panic!("no base port with {offsets:?} all free on 127.0.0.1");
}

/// What `ss` says holds TCP port `port` (for a failure message: which
/// process took a port the harness picked).
pub fn who_holds(port: u16) -> String {
    match Command::new("ss")
        .args(["-tanp", &format!("( sport = :{port} )")])
        .output()
    {
        Ok(o) => format!(
            "sockets on port {port} (a socket bound and not listening, as another harness holds a port, is not listed):\n{}",
            String::from_utf8_lossy(&o.stdout)
        ),
        Err(e) => format!("(ss not run: {e})"),
    }
}

/// The `execution_id` of an execution's JSON (a start's answer, say).
pub fn id_of(v: &Value) -> String {
    v["execution_id"]
        .as_str()
        .unwrap_or_else(|| panic!("no string execution_id in {v}"))
        .to_string()
}

pub fn addr(port: u16) -> SocketAddr {
    SocketAddr::from(([127, 0, 0, 1], port))
}

// ---------------------------------------------------------------------------
// HTTP

/// The answer of `ask`, asked again (for at most `within`) while it is 503
/// or 421: a replicated shard between leaders (an election, a handover of
/// its leadership) answers so for a moment, with nothing done.
pub fn settled(within: Duration, mut ask: impl FnMut() -> Resp) -> Resp {
    let until = Instant::now() + within;
    loop {
        let r = ask();
        if !matches!(r.status, 503 | 421) || Instant::now() > until {
            return r;
        }
        std::thread::sleep(Duration::from_millis(20));
    }
}

/// An HTTP answer.
#[derive(Debug, Clone)]
pub struct Resp {
    pub status: u16,
    pub headers: Vec<(String, String)>,
    pub body: Vec<u8>,
}

impl Resp {
    pub fn header(&self, name: &str) -> Option<&str> {
        self.headers
            .iter()
            .find(|(k, _)| k.eq_ignore_ascii_case(name))
            .map(|(_, v)| v.as_str())
    }

    pub fn header_u64(&self, name: &str) -> Option<u64> {
        self.header(name).and_then(|v| v.parse().ok())
    }

    pub fn text(&self) -> String {
        String::from_utf8_lossy(&self.body).into_owned()
    }

    /// The body as JSON; panics with the body if it is not.
    pub fn json(&self) -> Value {
        serde_json::from_slice(&self.body).unwrap_or_else(|e| {
            panic!(
                "status {} body is not JSON ({e}): {}",
                self.status,
                self.text()
            )
        })
    }

    /// The `error` code of an error body.
    pub fn error(&self) -> String {
        self.json()["error"].as_str().unwrap_or("").to_string()
    }

    #[track_caller]
    pub fn expect(&self, status: u16) -> &Resp {
        assert_eq!(
            self.status,
            status,
            "expected status {status}, got {}: {} (headers {:?})",
            self.status,
            self.text(),
            self.headers
        );
        self
    }

    #[track_caller]
    pub fn expect_error(&self, status: u16, code: &str) -> Value {
        self.expect(status);
        let v = self.json();
        assert_eq!(v["error"], code, "error code in {v}");
        assert!(v["message"].is_string(), "no message in {v}");
        v
    }
}

/// One HTTP/1.1 request on a fresh connection, dropped after the answer
/// (kept alive until then, as real clients do: add `Connection: close` to
/// `headers` to ask the server to close it).
pub fn request(
    to: SocketAddr,
    method: &str,
    path: &str,
    headers: &[(&str, &str)],
    body: Option<&[u8]>,
    timeout: Duration,
) -> std::io::Result<Resp> {
    let deadline = Instant::now() + timeout;
    let mut s = TcpStream::connect_timeout(&to, timeout)?;
    s.set_nodelay(true)?;
    s.set_write_timeout(Some(timeout))?;
    let mut head = format!("{method} {path} HTTP/1.1\r\nHost: {to}\r\n");
    for (k, v) in headers {
        head.push_str(&format!("{k}: {v}\r\n"));
    }
    if let Some(b) = body {
        if !headers
            .iter()
            .any(|(k, _)| k.eq_ignore_ascii_case("content-type"))
        {
            head.push_str("Content-Type: application/json\r\n");
        }
        head.push_str(&format!("Content-Length: {}\r\n", b.len()));
    }
    head.push_str("\r\n");
    let mut out = head.into_bytes();
    if let Some(b) = body {
        out.extend_from_slice(b);
    }
    // The server may answer (413) and close before reading a large body:
    // a failed write is not yet a failed request.
    let _ = s.write_all(&out);
    let mut buf = Vec::new();
    let mut chunk = [0u8; 64 * 1024];
    loop {
        let left = deadline.saturating_duration_since(Instant::now());
        if left.is_zero() {
            return Err(std::io::Error::new(
                std::io::ErrorKind::TimedOut,
                format!("{method} {path}: no complete answer within {timeout:?}"),
            ));
        }
        s.set_read_timeout(Some(left))?;
        match s.read(&mut chunk) {
            Ok(0) => break,
            Ok(n) => {
                buf.extend_from_slice(&chunk[..n]);
                if let Some((r, _)) = parse_response(&buf, false)? {
                    return Ok(r);
                }
            }
            Err(e) if e.kind() == std::io::ErrorKind::Interrupted => continue,
            Err(e) if e.kind() == std::io::ErrorKind::ConnectionReset && !buf.is_empty() => break,
            Err(e) => return Err(e),
        }
    }
    parse_response(&buf, true)?.map(|(r, _)| r).ok_or_else(|| {
        std::io::Error::new(
            std::io::ErrorKind::UnexpectedEof,
            format!(
                "{method} {path}: connection closed mid-answer ({} bytes)",
                buf.len()
            ),
        )
    })
}

fn bad(m: &str) -> std::io::Error {
    std::io::Error::new(std::io::ErrorKind::InvalidData, m.to_string())
}

/// Parses a whole response out of the start of `buf`, with the bytes it
/// took, or `None` if more is needed.
fn parse_response(buf: &[u8], eof: bool) -> std::io::Result<Option<(Resp, usize)>> {
    let Some(end) = buf.windows(4).position(|w| w == b"\r\n\r\n") else {
        return Ok(None);
    };
    let head = std::str::from_utf8(&buf[..end]).map_err(|_| bad("head is not UTF-8"))?;
    let mut lines = head.split("\r\n");
    let status_line = lines.next().ok_or_else(|| bad("no status line"))?;
    let status: u16 = status_line
        .split(' ')
        .nth(1)
        .and_then(|s| s.parse().ok())
        .ok_or_else(|| bad("bad status line"))?;
    let headers: Vec<(String, String)> = lines
        .filter_map(|l| l.split_once(':'))
        .map(|(k, v)| (k.trim().to_ascii_lowercase(), v.trim().to_string()))
        .collect();
    let rest = &buf[end + 4..];
    let get = |n: &str| {
        headers
            .iter()
            .find(|(k, _)| k == n)
            .map(|(_, v)| v.as_str())
    };
    let informational = (100..200).contains(&status);
    let (body, used) = if informational {
        (Vec::new(), 0)
    } else if get("transfer-encoding").is_some_and(|v| v.contains("chunked")) {
        let mut body = Vec::new();
        let mut i = 0;
        loop {
            let Some(le) = rest[i..].windows(2).position(|w| w == b"\r\n") else {
                return Ok(None);
            };
            let size_str = std::str::from_utf8(&rest[i..i + le]).map_err(|_| bad("chunk size"))?;
            let size = usize::from_str_radix(size_str.split(';').next().unwrap_or("").trim(), 16)
                .map_err(|_| bad("chunk size"))?;
            i += le + 2;
            if size == 0 {
                break;
            }
            if rest.len() < i + size + 2 {
                return Ok(None);
            }
            body.extend_from_slice(&rest[i..i + size]);
            i += size + 2;
        }
        // The last chunk's line, then no trailers: one more CRLF.
        if rest.len() < i + 2 {
            return Ok(None);
        }
        (body, i + 2)
    } else if let Some(len) = get("content-length").and_then(|v| v.parse::<usize>().ok()) {
        if rest.len() < len {
            return Ok(None);
        }
        (rest[..len].to_vec(), len)
    } else if eof {
        (rest.to_vec(), rest.len())
    } else {
        return Ok(None);
    };
    Ok(Some((
        Resp {
            status,
            headers,
            body,
        },
        end + 4 + used,
    )))
}

/// One kept-alive connection to a node, written and read as raw bytes:
/// for pipelining, odd framings and partial writes.
pub struct RawConn {
    s: TcpStream,
    buf: Vec<u8>,
}

impl RawConn {
    pub fn open(to: SocketAddr) -> RawConn {
        let s = TcpStream::connect_timeout(&to, REQUEST_TIMEOUT)
            .unwrap_or_else(|e| panic!("connecting to {to}: {e}"));
        s.set_nodelay(true).expect("nodelay");
        s.set_read_timeout(Some(REQUEST_TIMEOUT)).expect("timeout");
        s.set_write_timeout(Some(REQUEST_TIMEOUT)).expect("timeout");
        RawConn { s, buf: Vec::new() }
    }

    pub fn send(&mut self, bytes: &[u8]) {
        self.s.write_all(bytes).expect("writing to the node");
    }

    /// The next whole answer (an interim 1xx counts as one).
    pub fn read(&mut self) -> Resp {
        self.try_read().unwrap_or_else(|e| panic!("{e}"))
    }

    /// The next answer, or why there is none (the node closed or reset
    /// the connection, or sent something unreadable).
    pub fn try_read(&mut self) -> Result<Resp, String> {
        let mut chunk = [0u8; 64 * 1024];
        loop {
            match parse_response(&self.buf, false) {
                Ok(Some((r, used))) => {
                    self.buf.drain(..used);
                    return Ok(r);
                }
                Ok(None) => {}
                Err(e) => {
                    return Err(format!(
                        "unreadable answer ({e}): {:?}",
                        String::from_utf8_lossy(&self.buf)
                    ))
                }
            }
            match self.s.read(&mut chunk) {
                Ok(0) => {
                    return Err(format!(
                        "the node closed the connection mid-answer: {:?}",
                        String::from_utf8_lossy(&self.buf)
                    ))
                }
                Ok(n) => self.buf.extend_from_slice(&chunk[..n]),
                Err(e) if e.kind() == std::io::ErrorKind::Interrupted => {}
                Err(e) => return Err(format!("reading from the node: {e}")),
            }
        }
    }

    /// Closes the sending side (a TCP half-close): the node reads the end
    /// of the stream, answers can still be read.
    pub fn finish_sending(&mut self) {
        self.s
            .shutdown(std::net::Shutdown::Write)
            .expect("half-closing the connection");
    }

    /// True once the node has closed its side (reads end) with nothing
    /// left unread; false if it sends more.
    pub fn closed_by_node(&mut self) -> bool {
        let mut b = [0u8; 1];
        self.buf.is_empty() && matches!(self.s.read(&mut b), Ok(0))
    }
}

/// A client for one node's API address.
#[derive(Debug, Clone, Copy)]
pub struct Client {
    pub addr: SocketAddr,
}

impl Client {
    pub fn new(addr: SocketAddr) -> Client {
        Client { addr }
    }

    #[track_caller]
    pub fn req(
        &self,
        method: &str,
        path: &str,
        headers: &[(&str, &str)],
        body: Option<&[u8]>,
    ) -> Resp {
        request(self.addr, method, path, headers, body, REQUEST_TIMEOUT)
            .unwrap_or_else(|e| panic!("{method} {path} to {}: {e}", self.addr))
    }

    /// Like `req` but returns transport errors.
    pub fn try_req(
        &self,
        method: &str,
        path: &str,
        headers: &[(&str, &str)],
        body: Option<&[u8]>,
        timeout: Duration,
    ) -> std::io::Result<Resp> {
        request(self.addr, method, path, headers, body, timeout)
    }

    #[track_caller]
    pub fn get(&self, path: &str) -> Resp {
        self.req("GET", path, &[], None)
    }

    /// A GET retried (for at most 10 s) while it is answered 503 or 421
    /// (see [`settled`]).
    #[track_caller]
    pub fn get_settled(&self, path: &str) -> Resp {
        settled(Duration::from_secs(10), || self.get(path))
    }

    #[track_caller]
    pub fn post(&self, path: &str, body: &Value) -> Resp {
        self.req("POST", path, &[], Some(body.to_string().as_bytes()))
    }

    #[track_caller]
    pub fn post_raw(&self, path: &str, body: &[u8]) -> Resp {
        self.req("POST", path, &[], Some(body))
    }

    /// Starts an execution; panics unless 201/200. Returns the body.
    #[track_caller]
    pub fn start(&self, body: &Value) -> Value {
        let r = self.post("/api/executions", body);
        assert!(
            r.status == 201 || r.status == 200,
            "start {body} on {}: {} {}",
            self.addr,
            r.status,
            r.text()
        );
        r.json()
    }

    /// The execution's `last_seq` as its owner reports it (panics unless 200).
    #[track_caller]
    pub fn last_seq(&self, id: &str) -> u64 {
        let r = self.get_settled(&format!("/api/executions/{id}"));
        r.expect(200);
        r.json()["last_seq"].as_u64().expect("last_seq")
    }

    /// All events of an execution (paged), as JSON values.
    #[track_caller]
    pub fn events(&self, id: &str) -> Vec<Value> {
        let mut out = Vec::new();
        loop {
            let r = self.get_settled(&format!(
                "/api/executions/{id}/events?after={}&limit=1000",
                out.len()
            ));
            r.expect(200);
            let v = r.json();
            let page = v["events"].as_array().expect("events").clone();
            if page.is_empty() {
                return out;
            }
            out.extend(page);
        }
    }

    /// A counter or gauge from `/metrics`, 0 if absent.
    #[track_caller]
    pub fn metric(&self, series: &str) -> f64 {
        let r = self.get("/metrics");
        r.expect(200);
        parse_metric(&r.text(), series)
    }

    pub fn ready(&self) -> bool {
        request(
            self.addr,
            "GET",
            "/readyz",
            &[],
            None,
            Duration::from_millis(500),
        )
        .is_ok_and(|r| r.status == 200)
    }
}

/// The value of `series` (e.g. `forkless_route_total{outcome="local"}`) in
/// a Prometheus text exposition, 0 if absent.
pub fn parse_metric(text: &str, series: &str) -> f64 {
    text.lines()
        .filter(|l| !l.starts_with('#'))
        .find_map(|l| {
            let (name, value) = l.rsplit_once(' ')?;
            (name == series)
                .then(|| value.parse::<f64>().ok())
                .flatten()
        })
        .unwrap_or(0.0)
}

// ---------------------------------------------------------------------------
// A single node

/// One `forkless serve` process with its own data dir.
pub struct Node {
    pub proc: Option<Proc>,
    pub client: Client,
    pub data_dir: PathBuf,
    pub log: PathBuf,
    args: Vec<String>,
}

impl Node {
    /// Starts a single node on a free port with `extra` flags, data in `data_dir`.
    pub fn start_single(data_dir: &Path, extra: &[&str]) -> Node {
        let port = free_ports(1)[0];
        let mut args: Vec<String> = vec![
            "serve".into(),
            "--listen".into(),
            addr(port).to_string(),
            "--data-dir".into(),
            data_dir.display().to_string(),
        ];
        args.extend(extra.iter().map(|s| s.to_string()));
        let log = data_dir.with_extension("log");
        let mut n = Node {
            proc: None,
            client: Client::new(addr(port)),
            data_dir: data_dir.to_path_buf(),
            log,
            args,
        };
        n.restart();
        n
    }

    /// Sends SIGTERM and asserts the node exits 0 within 3 s (it gets 10 s
    /// before the test gives up on it); `when` says what was going on.
    pub fn sigterm_expect_prompt_exit(&mut self, when: &str) {
        let t = Instant::now();
        let p = self.proc.as_mut().expect("the node is running");
        p.sigterm();
        let status = p
            .wait_exit(Duration::from_secs(10))
            .unwrap_or_else(|| panic!("no exit within 10 s of SIGTERM{when}"));
        assert!(status.success(), "exit after SIGTERM{when}: {status}");
        assert!(t.elapsed() < Duration::from_secs(3), "{:?}", t.elapsed());
    }

    /// (Re)starts the process with the same arguments and waits for /readyz.
    pub fn restart(&mut self) {
        self.kill9();
        let p = Proc::spawn(&self.args, &self.log);
        self.proc = Some(p);
        self.wait_ready();
    }

    pub fn wait_ready(&mut self) {
        let deadline = Instant::now() + READY_TIMEOUT;
        loop {
            if self.client.ready() {
                return;
            }
            if let Some(p) = self.proc.as_mut() {
                if let Some(s) = p.try_exit() {
                    panic!(
                        "node on {} exited during startup ({s}); its log:\n{}",
                        self.client.addr,
                        p.log()
                    );
                }
            }
            if Instant::now() > deadline {
                panic!(
                    "node on {} not ready within {READY_TIMEOUT:?}; its log:\n{}",
                    self.client.addr,
                    std::fs::read_to_string(&self.log).unwrap_or_default()
                );
            }
            std::thread::sleep(Duration::from_millis(10));
        }
    }

    pub fn kill9(&mut self) {
        if let Some(mut p) = self.proc.take() {
            p.kill9();
        }
    }

    /// Starts the node again, expecting it to refuse to start: returns how
    /// it exited (within `timeout`) and its log. Panics if it becomes
    /// ready instead.
    pub fn restart_expecting_refusal(
        &mut self,
        timeout: Duration,
    ) -> (std::process::ExitStatus, String) {
        self.kill9();
        let mut p = Proc::spawn(&self.args, &self.log);
        let status = p.wait_exit(timeout);
        let log = p.log();
        match status {
            Some(s) => (s, log),
            None => {
                let ready = self.client.ready();
                p.kill9();
                panic!(
                    "the node did not exit within {timeout:?} (ready: {ready}); its log:\n{log}"
                );
            }
        }
    }
}

// ---------------------------------------------------------------------------
// A static cluster

/// Peer timing written into the cluster file.
#[derive(Debug, Clone, Copy)]
pub struct PeerTiming {
    pub forward_connect_timeout_ms: u64,
    pub forward_timeout_ms: u64,
    pub probe_interval_ms: u64,
    pub probe_timeout_ms: u64,
}

impl PeerTiming {
    /// Probes as often, but slower to call a busy peer down: for tests that
    /// do not kill or pause nodes, so a starved CI machine does not fail
    /// requests closed that the test expects to succeed.
    pub fn relaxed() -> PeerTiming {
        PeerTiming {
            forward_connect_timeout_ms: 1000,
            forward_timeout_ms: 3000,
            probe_interval_ms: 100,
            probe_timeout_ms: 1500,
        }
    }
}

impl Default for PeerTiming {
    fn default() -> Self {
        PeerTiming {
            forward_connect_timeout_ms: 300,
            forward_timeout_ms: 1000,
            probe_interval_ms: 100,
            probe_timeout_ms: 300,
        }
    }
}

pub struct ClusterNode {
    pub id: u16,
    pub api: SocketAddr,
    pub peer: SocketAddr,
    /// The Raft transport's address, in a replicated cluster.
    pub raft: Option<SocketAddr>,
    /// The network namespace the node runs in (a [`netlab::NetLab`]'s).
    pub netns: Option<PathBuf>,
    pub data_dir: PathBuf,
    pub log: PathBuf,
    pub proc: Option<Proc>,
    /// The config file this node was last started with.
    pub config: PathBuf,
}

impl ClusterNode {
    pub fn client(&self) -> Client {
        Client::new(self.api)
    }
    pub fn proc(&self) -> &Proc {
        self.proc.as_ref().expect("node is running")
    }
}

/// A replica's (node, last log index, applied index).
type ReplicaProgress = (u16, Option<u64>, Option<u64>);
/// A node's replica of a shard, as its node's `/api/cluster` shows it.
#[derive(Debug)]
struct ReplicaView {
    /// (node, last log index, applied).
    progress: ReplicaProgress,
    /// It takes itself for the leader, at `term`.
    leads: bool,
    term: u64,
    /// The voters its group counts.
    voters: Vec<u16>,
    /// The learners its group counts.
    learners: Vec<u16>,
}

/// Of a shard's replicas, the one that leads at the highest term (a
/// deposed leader that does not know it yet leads at an older one).
fn leading(v: &[ReplicaView]) -> Option<&ReplicaView> {
    v.iter().filter(|r| r.leads).max_by_key(|r| r.term)
}

/// A shard's leader and voters, as the replica leading at the highest
/// term among the running nodes says ([`Cluster::shard_voters`]).
#[derive(Debug, Clone)]
pub struct ShardMembers {
    pub leader: u16,
    pub voters: Vec<u16>,
    pub learners: Vec<u16>,
}

/// Whether node `c` says none of its replicas is new and still catching
/// up (`raft.fresh`); `None` while one is, or while it does not answer.
pub fn none_fresh(c: &Client) -> Option<()> {
    let v = c
        .try_req("GET", "/api/cluster", &[], None, Duration::from_secs(2))
        .ok()?
        .json();
    v["shards"]
        .as_array()?
        .iter()
        .all(|s| s["raft"].is_null() || s["raft"]["fresh"] == false)
        .then_some(())
}

/// Real nodes of a static cluster, sharing a TOML config in a temp dir.
pub struct Cluster {
    pub dir: tempfile::TempDir,
    pub shard_count: u32,
    pub timing: PeerTiming,
    pub nodes: Vec<ClusterNode>,
    pub secret: String,
    /// Set for a replicated cluster (every shard a Raft group on this
    /// many nodes).
    pub replication_factor: Option<u32>,
    /// `[raft]` timers (heartbeat, election min, max; ms), if not the
    /// defaults.
    pub raft_timing: Option<(u64, u64, u64)>,
    /// `[raft]` snapshot_every_entries and log_kept_entries, if not the
    /// defaults.
    pub raft_log: Option<(u64, u64)>,
    /// `[raft]` learner_kept_s, if not the default.
    pub raft_learner_kept_s: Option<u64>,
    /// The loopback ports picked for nodes that have not started yet, held
    /// (bound, not listening), by port: a node's are let go just before it starts
    /// (see [`Cluster::spawn`]), so nothing else can take them meanwhile.
    held: std::collections::HashMap<u16, HeldPort>,
    /// Text appended to every cluster file written (`[[placement]]`
    /// entries, say).
    pub file_tail: String,
    /// Nodes every cluster file written leaves out of `[[nodes]]` and lists
    /// in `retired_nodes`.
    pub retired: Vec<u16>,
    /// The fault-injecting proxies every Raft link goes through, for a
    /// cluster made by [`Cluster::prepare_behind_proxies`]: each node's
    /// cluster file then names, as each peer's `raft_addr`, its proxy to
    /// that peer.
    pub faults: Option<Arc<faultproxy::Faults>>,
}

impl Cluster {
    /// Writes a config naming every node, with `shards` as `(shard, owner,
    /// epoch)` (empty: spread evenly), starts every node, waits until all
    /// are ready.
    pub fn start(
        node_count: u16,
        shard_count: u32,
        shards: &[(u32, u16, u64)],
        timing: PeerTiming,
    ) -> Cluster {
        let mut c = Cluster::prepare(node_count, shard_count, timing);
        let ids: Vec<u16> = (1..=node_count).collect();
        c.start_nodes(&ids, shards);
        c
    }

    /// Picks ports and data dirs for `node_count` nodes, starting none.
    pub fn prepare(node_count: u16, shard_count: u32, timing: PeerTiming) -> Cluster {
        let dir = tempfile::tempdir().expect("tempdir");
        let held = hold_free_ports(2 * node_count as usize);
        let ports: Vec<u16> = held.iter().map(HeldPort::port).collect();
        let nodes = (0..node_count)
            .map(|i| {
                let id = i + 1;
                ClusterNode {
                    id,
                    api: addr(ports[2 * i as usize]),
                    peer: addr(ports[2 * i as usize + 1]),
                    raft: None,
                    netns: None,
                    data_dir: dir.path().join(format!("node-{id}")),
                    log: dir.path().join(format!("node-{id}.log")),
                    proc: None,
                    config: PathBuf::new(),
                }
            })
            .collect();
        Cluster {
            dir,
            shard_count,
            timing,
            nodes,
            secret: "it-secret-0123456789abcdef".into(),
            replication_factor: None,
            raft_timing: None,
            raft_log: None,
            raft_learner_kept_s: None,
            held: ports.iter().copied().zip(held).collect(),
            file_tail: String::new(),
            retired: Vec::new(),
            faults: None,
        }
    }

    /// Picks ports and data dirs for a replicated cluster of `node_count`
    /// nodes (every shard a Raft group on `factor` of them), starting none.
    pub fn prepare_replicated(
        node_count: u16,
        shard_count: u32,
        factor: u32,
        timing: PeerTiming,
    ) -> Cluster {
        let mut c = Cluster::prepare(node_count, shard_count, timing);
        // The API and peer ports are still held, so no pick repeats them.
        for (i, l) in hold_free_ports(node_count as usize).into_iter().enumerate() {
            let port = l.port();
            c.nodes[i].raft = Some(addr(port));
            c.held.insert(port, l);
        }
        c.replication_factor = Some(factor);
        c
    }

    /// [`Cluster::prepare_replicated`] with every link between two nodes
    /// behind a fault-injecting proxy ([`faultproxy::Faults`], in
    /// `self.faults`): each node dials each peer's Raft address and peer
    /// address (probes, forwarded requests) through proxies of its own, so
    /// that the test can cut, delay or slow each direction between two
    /// nodes apart. Clients still reach every node directly.
    pub fn prepare_behind_proxies(
        node_count: u16,
        shard_count: u32,
        factor: u32,
        timing: PeerTiming,
    ) -> Cluster {
        let mut c = Cluster::prepare_replicated(node_count, shard_count, factor, timing);
        // Port 0 is a node's Raft address, port 1 its peer address.
        let links: Vec<(u16, u16, usize)> = (1..=node_count)
            .flat_map(|a| {
                (1..=node_count)
                    .filter(move |b| *b != a)
                    .flat_map(move |b| [(a, b, 0), (a, b, 1)])
            })
            .collect();
        let listeners = links
            .iter()
            .copied()
            .zip(
                hold_free_ports(links.len())
                    .into_iter()
                    .map(HeldPort::listen),
            )
            .collect();
        let targets: Vec<(u16, Vec<SocketAddr>)> = c
            .nodes
            .iter()
            .map(|n| {
                let raft = n.raft.expect("a replicated node's Raft address");
                (n.id, vec![raft, n.peer])
            })
            .collect();
        c.faults = Some(Arc::new(faultproxy::Faults::start(&targets, listeners)));
        c
    }

    /// [`Cluster::prepare_replicated`] with each node in its own network
    /// namespace of `lab`, at the lab's addresses, so that the test can
    /// cut nodes off from each other (and its own connections to each
    /// node's client address stay up).
    pub fn prepare_in_lab(
        lab: &netlab::NetLab,
        shard_count: u32,
        factor: u32,
        timing: PeerTiming,
    ) -> Cluster {
        let mut c = Cluster::prepare(lab.nodes(), shard_count, timing);
        // The nodes listen at the lab's addresses, not on loopback.
        c.held.clear();
        for n in &mut c.nodes {
            let (api, peer, raft) = lab.addrs(n.id);
            n.api = api;
            n.peer = peer;
            n.raft = Some(raft);
            n.netns = Some(lab.netns(n.id));
        }
        c.replication_factor = Some(factor);
        c
    }

    /// Starts a replicated cluster and waits until every node is ready
    /// and every shard has a leader that every node knows.
    pub fn start_replicated(
        node_count: u16,
        shard_count: u32,
        factor: u32,
        timing: PeerTiming,
    ) -> Cluster {
        let mut c = Cluster::prepare_replicated(node_count, shard_count, factor, timing);
        c.start_all_replicated();
        c
    }

    /// Starts every node of a prepared replicated cluster and waits until
    /// each is ready and knows every shard's leader; the node ids.
    pub fn start_all_replicated(&mut self) -> Vec<u16> {
        let ids: Vec<u16> = self.nodes.iter().map(|n| n.id).collect();
        self.start_nodes(&ids, &[]);
        for id in &ids {
            self.wait_leaders_known(*id, &[]);
        }
        // Every replica of a new cluster starts careful, and one that did
        // not vote for its shard's first leader takes it only once that
        // leader confirmed with the others: a fault before then leaves
        // the shard waiting for the faulted node (`docs/replication.md`,
        // "A replica whose data directory is new"). Tests fault a settled
        // cluster.
        let until = Instant::now() + Duration::from_secs(20);
        for id in &ids {
            let c = self.client(*id);
            while none_fresh(&c).is_none() {
                assert!(
                    Instant::now() < until,
                    "timed out after 20s waiting for node {id}'s replicas to catch up\n{}",
                    self.logs()
                );
                std::thread::sleep(Duration::from_millis(10));
            }
        }
        ids
    }

    /// Each running node's view of its replicas, by shard; `false` if a
    /// running node did not answer.
    fn replica_views(&self) -> (bool, std::collections::BTreeMap<u64, Vec<ReplicaView>>) {
        let mut by_shard: std::collections::BTreeMap<u64, Vec<_>> = Default::default();
        let mut answered = true;
        for n in self.nodes.iter().filter(|n| n.proc.is_some()) {
            let Ok(r) =
                n.client()
                    .try_req("GET", "/api/cluster", &[], None, Duration::from_secs(2))
            else {
                answered = false;
                continue;
            };
            let v = r.json();
            for s in v["shards"].as_array().into_iter().flatten() {
                let r = &s["raft"];
                if r.is_null() {
                    continue;
                }
                let shard = s["shard"].as_u64().unwrap_or(u64::MAX);
                let ids = |key: &str| {
                    r[key]
                        .as_array()
                        .into_iter()
                        .flatten()
                        .filter_map(|v| v.as_u64().map(|v| v as u16))
                        .collect()
                };
                let (voters, learners) = (ids("voters"), ids("learners"));
                by_shard.entry(shard).or_default().push(ReplicaView {
                    progress: (n.id, r["last_log_index"].as_u64(), r["applied"].as_u64()),
                    leads: r["state"] == "leader",
                    term: s["term"].as_u64().unwrap_or(0),
                    voters,
                    learners,
                });
            }
        }
        (answered, by_shard)
    }

    /// Waits (up to 20 s) until every shard has a leader among the
    /// running nodes and every running node holding a voting replica of
    /// it (one its leader counts) has applied every entry that shard's
    /// voters hold, so that the replicas can be compared. A replica its
    /// group left behind (moved to another node) is not waited for.
    pub fn wait_replicas_level(&self) {
        let until = Instant::now() + Duration::from_secs(20);
        loop {
            let (answered, views) = self.replica_views();
            let voting: std::collections::BTreeMap<u64, Vec<ReplicaProgress>> = views
                .iter()
                .map(|(shard, v)| {
                    let voters = leading(v).map(|l| &l.voters);
                    let held = v
                        .iter()
                        .filter(|r| voters.is_some_and(|vs| vs.contains(&r.progress.0)))
                        .map(|r| r.progress)
                        .collect();
                    (*shard, held)
                })
                .collect();
            let seen = format!(
                "(node, last log index, applied) of each voting replica, by shard: {voting:?}; \
                 every replica's view: {views:?}"
            );
            let led = views.values().all(|v| leading(v).is_some());
            let level = voting.values().all(|v| {
                let last = v.iter().filter_map(|(_, l, _)| *l).max();
                !v.is_empty() && v.iter().all(|(_, l, a)| *l == last && *a == last)
            });
            if answered && led && level && views.len() == self.shard_count as usize {
                return;
            }
            assert!(
                Instant::now() < until,
                "the replicas did not level within 20 s: {seen}\n{}",
                self.logs()
            );
            std::thread::sleep(Duration::from_millis(20));
        }
    }

    /// Each shard's leader and its voters as that leader counts them: the
    /// replica leading at the highest term among the running nodes (waits
    /// up to 20 s for a leader of every shard).
    pub fn shard_voters(&self) -> std::collections::BTreeMap<u64, ShardMembers> {
        let until = Instant::now() + Duration::from_secs(20);
        loop {
            let (_, views) = self.replica_views();
            let voters: std::collections::BTreeMap<u64, ShardMembers> = views
                .iter()
                .filter_map(|(shard, v)| {
                    leading(v).map(|l| {
                        (
                            *shard,
                            ShardMembers {
                                leader: l.progress.0,
                                voters: l.voters.clone(),
                                learners: l.learners.clone(),
                            },
                        )
                    })
                })
                .collect();
            if voters.len() == self.shard_count as usize {
                return voters;
            }
            assert!(
                Instant::now() < until,
                "not every shard had a leader among the running nodes within 20 s: {views:?}\n{}",
                self.logs()
            );
            std::thread::sleep(Duration::from_millis(20));
        }
    }

    /// Stops every running node with SIGTERM (each must exit within 20 s)
    /// and reads each one's events per shard from its data directory with
    /// `forkless store check`; panics unless every voting replica of a
    /// shard (one its leader counts just before the stop: a replica the
    /// group left behind when it moved to another node is not compared)
    /// holds the same count. Returns each shard's count.
    pub fn stop_and_compare_replicas(&mut self) -> std::collections::BTreeMap<u32, u64> {
        let voters = self.shard_voters();
        for n in self.nodes.iter().filter(|n| n.proc.is_some()) {
            n.proc().sigterm();
        }
        let mut seen: std::collections::BTreeMap<u32, Vec<(u16, u64)>> = Default::default();
        for i in 0..self.nodes.len() {
            let Some(mut p) = self.nodes[i].proc.take() else {
                continue;
            };
            let id = self.nodes[i].id;
            assert!(
                p.wait_exit(Duration::from_secs(20)).is_some(),
                "node {id} did not stop on SIGTERM:\n{}",
                self.logs()
            );
            for (shard, events) in events_on_disk(&self.nodes[i].data_dir) {
                if voters
                    .get(&u64::from(shard))
                    .is_some_and(|m| !m.voters.contains(&id))
                {
                    eprintln!(
                        "node {id}'s replica of shard {shard} ({events} events) is not a voter of its group: not compared"
                    );
                    continue;
                }
                seen.entry(shard).or_default().push((id, events));
            }
        }
        let differ = seen.values().any(|v| v.iter().any(|(_, e)| *e != v[0].1));
        if differ {
            // Kept for a look: the test's folder goes when it fails.
            let kept = std::env::temp_dir()
                .join(format!("forkless-replicas-differ-{}", std::process::id()));
            let _ = std::process::Command::new("cp")
                .arg("-a")
                .arg(self.dir.path())
                .arg(&kept)
                .status();
            panic!(
                "the replicas differ: (node, events) by shard {seen:?}; the data directories are \
                 kept in {}",
                kept.display()
            );
        }
        seen.iter().map(|(shard, v)| (*shard, v[0].1)).collect()
    }

    /// Waits (up to 20 s) until node `via` knows a leader of every shard
    /// elected at a term at least 1 and not on any of `not_on`, and
    /// returns each shard's (leader, term).
    pub fn wait_leaders_known(&self, via: u16, not_on: &[u16]) -> Vec<(u16, u64)> {
        let c = self.client(via);
        let until = Instant::now() + Duration::from_secs(20);
        let known = || {
            let v = c
                .try_req("GET", "/api/cluster", &[], None, Duration::from_secs(2))
                .ok()?
                .json();
            let shards = v["shards"].as_array()?;
            let known: Vec<(u16, u64)> = shards
                .iter()
                .filter_map(|s| {
                    let leader = s["leader"].as_u64()? as u16;
                    let term = s["term"].as_u64()?;
                    (term >= 1 && !not_on.contains(&leader)).then_some((leader, term))
                })
                .collect();
            (known.len() == shards.len()).then_some(known)
        };
        loop {
            if let Some(k) = known() {
                return k;
            }
            if Instant::now() > until {
                let now = c
                    .try_req("GET", "/api/cluster", &[], None, Duration::from_secs(2))
                    .map(|r| r.text())
                    .unwrap_or_else(|e| e.to_string());
                panic!(
                    "node {via} did not know every shard's leader (not on {not_on:?}) within 20 s; it says {now}\n{}",
                    self.logs()
                );
            }
            std::thread::sleep(Duration::from_millis(10));
        }
    }

    /// Writes the v1 config with `shards` and starts the nodes `ids` (the
    /// others are left to the test), waiting until they are ready and see
    /// each other alive.
    pub fn start_nodes(&mut self, ids: &[u16], shards: &[(u32, u16, u64)]) {
        let c = self;
        let cfg = c.write_config("cluster-v1.toml", shards);
        for &id in ids {
            if c.faults.is_some() {
                // Behind proxies, each node's file names its own proxies.
                let own = c.write_config_seen_by(&format!("cluster-v1-node-{id}.toml"), shards, id);
                c.spawn(id, &own);
            } else {
                c.spawn(id, &cfg);
            }
        }
        for &id in ids {
            c.wait_ready(id);
        }
        c.wait_all_alive();
    }

    /// Waits until every running node believes every other running node is
    /// alive and its probes have answered (`probe: up`), so routing is
    /// settled. (`alive` alone is true of a peer that never answered a
    /// probe yet, whose shards are still tried; such a peer, killed, stays
    /// so and is never seen down: a static-cluster test once waited 10 s
    /// in vain for a killed peer to be seen down.)
    pub fn wait_all_alive(&self) {
        let running: Vec<u16> = self
            .nodes
            .iter()
            .filter(|n| n.proc.is_some())
            .map(|n| n.id)
            .collect();
        for &n in &running {
            let c = self.client(n);
            wait_until(
                &format!("node {n} to see every running peer alive"),
                READY_TIMEOUT,
                || {
                    let v = c.get("/api/cluster").json();
                    let alive: Vec<u16> = v["nodes"]
                        .as_array()?
                        .iter()
                        .filter(|x| x["alive"] == true && (x["self"] == true || x["probe"] == "up"))
                        .filter_map(|x| x["id"].as_u64())
                        .map(|x| x as u16)
                        .collect();
                    running.iter().all(|r| alive.contains(r)).then_some(())
                },
            );
        }
    }

    /// `POST /api/cluster/drain` (`undrain` when `drain` is false) on node
    /// `id`: its answer, asserted 200.
    pub fn drain_node(&self, id: u16, drain: bool) -> serde_json::Value {
        let verb = if drain { "drain" } else { "undrain" };
        let r = self
            .client(id)
            .try_req(
                "POST",
                &format!("/api/cluster/{verb}"),
                &[],
                None,
                Duration::from_secs(10),
            )
            .unwrap_or_else(|e| panic!("{verb} of node {id} not answered: {e}"));
        assert_eq!(r.status, 200, "{verb} of node {id}: {}", r.text());
        r.json()
    }

    /// Waits (up to 10 s) until each of `observers` reports `peer` in
    /// `/api/cluster` as alive, or as down when `alive` is false.
    pub fn wait_peer_seen(&self, observers: &[u16], peer: u16, alive: bool) {
        let state = if alive { "alive" } else { "down" };
        for &n in observers {
            let c = self.client(n);
            let seen = || {
                let v = c.get("/api/cluster").json();
                v["nodes"]
                    .as_array()?
                    .iter()
                    .any(|x| x["id"] == peer && x["alive"] == alive)
                    .then_some(())
            };
            let until = Instant::now() + Duration::from_secs(10);
            while seen().is_none() {
                // With the nodes' logs: the prober's side of it.
                assert!(
                    Instant::now() < until,
                    "timed out after 10s waiting for node {n} to see node {peer} {state}\n{}",
                    self.logs()
                );
                std::thread::sleep(Duration::from_millis(10));
            }
        }
    }

    /// Writes a config file into the cluster dir and returns its path.
    pub fn write_config(&self, name: &str, shards: &[(u32, u16, u64)]) -> PathBuf {
        self.write_config_as(name, shards, None)
    }

    /// [`Cluster::write_config`] for node `viewer` of a cluster behind
    /// proxies: each peer's `raft_addr` is the proxy `viewer` dials it
    /// through (its own is where it listens).
    pub fn write_config_seen_by(
        &self,
        name: &str,
        shards: &[(u32, u16, u64)],
        viewer: u16,
    ) -> PathBuf {
        self.write_config_as(name, shards, Some(viewer))
    }

    fn write_config_as(
        &self,
        name: &str,
        shards: &[(u32, u16, u64)],
        viewer: Option<u16>,
    ) -> PathBuf {
        let t = &self.timing;
        let mut s = format!(
            "shard_count = {}\nsecret = \"{}\"\n\n[peer]\nforward_connect_timeout_ms = {}\nforward_timeout_ms = {}\nprobe_interval_ms = {}\nprobe_timeout_ms = {}\n",
            self.shard_count, self.secret, t.forward_connect_timeout_ms, t.forward_timeout_ms, t.probe_interval_ms, t.probe_timeout_ms
        );
        // Said even when 1: a file of three nodes or more that leaves it
        // out replicates three times.
        s = format!(
            "replication_factor = {}\n{s}",
            self.replication_factor.unwrap_or(1)
        );
        if !self.retired.is_empty() {
            s = format!("retired_nodes = {:?}\n{s}", self.retired);
        }
        if self.raft_timing.is_some()
            || self.raft_log.is_some()
            || self.raft_learner_kept_s.is_some()
        {
            s.push_str("\n[raft]\n");
        }
        if let Some(kept) = self.raft_learner_kept_s {
            s.push_str(&format!("learner_kept_s = {kept}\n"));
        }
        if let Some((h, lo, hi)) = self.raft_timing {
            s.push_str(&format!(
                "heartbeat_ms = {h}\nelection_timeout_min_ms = {lo}\nelection_timeout_max_ms = {hi}\n"
            ));
        }
        if let Some((every, kept)) = self.raft_log {
            s.push_str(&format!(
                "snapshot_every_entries = {every}\nlog_kept_entries = {kept}\n"
            ));
        }
        for n in self.nodes.iter().filter(|n| !self.retired.contains(&n.id)) {
            // Behind proxies, the viewer dials each peer's ports through
            // its proxies to that peer (its own are where it listens).
            let proxy = |port: usize| match (&self.faults, viewer) {
                (Some(f), Some(v)) if v != n.id && f.proxies_port(port) => {
                    Some(f.port_addr(v, n.id, port))
                }
                _ => None,
            };
            s.push_str(&format!(
                "\n[[nodes]]\nid = {}\napi_addr = \"{}\"\npeer_addr = \"{}\"\n",
                n.id,
                n.api,
                proxy(1).unwrap_or(n.peer)
            ));
            if let Some(r) = proxy(0).or(n.raft) {
                s.push_str(&format!("raft_addr = \"{r}\"\n"));
            }
        }
        for (shard, owner, epoch) in shards {
            s.push_str(&format!(
                "\n[[shards]]\nshard = {shard}\nowner = {owner}\nepoch = {epoch}\n"
            ));
        }
        if !self.file_tail.is_empty() {
            s.push('\n');
            s.push_str(&self.file_tail);
        }
        let p = self.dir.path().join(name);
        std::fs::write(&p, s).expect("write config");
        p
    }

    /// A config in which node `id` is the whole cluster and owns every
    /// shard at epoch 1: routing is inert, so it reads its own data dir
    /// exactly as it is (and its store's fence still refuses writes at a
    /// stale epoch).
    pub fn write_solo_config(&self, id: u16) -> PathBuf {
        let n = self.node(id);
        let t = &self.timing;
        let mut text = format!(
            "shard_count = {}\n[peer]\nforward_timeout_ms = {}\nprobe_interval_ms = {}\nprobe_timeout_ms = {}\n\n[[nodes]]\nid = {id}\napi_addr = \"{}\"\npeer_addr = \"{}\"\n",
            self.shard_count, t.forward_timeout_ms, t.probe_interval_ms, t.probe_timeout_ms, n.api, n.peer
        );
        for s in 0..self.shard_count {
            text.push_str(&format!(
                "\n[[shards]]\nshard = {s}\nowner = {id}\nepoch = 1\n"
            ));
        }
        let p = self.dir.path().join(format!("solo-{id}.toml"));
        std::fs::write(&p, text).expect("write solo config");
        p
    }

    pub fn node(&self, id: u16) -> &ClusterNode {
        &self.nodes[id as usize - 1]
    }

    pub fn node_mut(&mut self, id: u16) -> &mut ClusterNode {
        &mut self.nodes[id as usize - 1]
    }

    pub fn client(&self, id: u16) -> Client {
        self.node(id).client()
    }

    pub fn clients(&self) -> Vec<(u16, Client)> {
        self.nodes.iter().map(|n| (n.id, n.client())).collect()
    }

    /// Spawns node `id` on `config` without waiting for anything (see
    /// [`Cluster::wait_ready`]).
    pub fn spawn(&mut self, id: u16, config: &Path) {
        let n = self.node_mut(id);
        let args: Vec<String> = vec![
            "serve".into(),
            "--config".into(),
            config.display().to_string(),
            "--node".into(),
            id.to_string(),
            "--data-dir".into(),
            n.data_dir.display().to_string(),
        ];
        n.config = config.to_path_buf();
        let ports = [Some(n.api), Some(n.peer), n.raft];
        for p in ports.into_iter().flatten() {
            self.held.remove(&p.port());
        }
        let n = self.node_mut(id);
        // The process before (exited on its own, say), let go first: its
        // drop, after the new one's start, would take the new pid off the
        // list of processes to kill if the pid was reused.
        if let Some(mut before) = n.proc.take() {
            before.kill9();
        }
        n.proc = Some(Proc::spawn_in(&args, &n.log, n.netns.as_deref()));
    }

    /// A listener at `addr`, a port held for a node not started yet (for a
    /// test that stands in for that node), or a new one bound there.
    pub fn take_listener(&mut self, addr: SocketAddr) -> TcpListener {
        match self.held.remove(&addr.port()) {
            Some(h) => h.listen(),
            None => TcpListener::bind(addr)
                .unwrap_or_else(|e| panic!("bind {addr}: {e}; {}", who_holds(addr.port()))),
        }
    }

    pub fn wait_ready(&mut self, id: u16) {
        let n = self.node_mut(id);
        let c = n.client();
        let deadline = Instant::now() + READY_TIMEOUT;
        loop {
            if c.ready() {
                return;
            }
            if let Some(p) = n.proc.as_mut() {
                if let Some(s) = p.try_exit() {
                    let ports = [Some(n.api), Some(n.peer), n.raft];
                    let holders: Vec<String> = ports
                        .into_iter()
                        .flatten()
                        .map(|a| who_holds(a.port()))
                        .collect();
                    panic!(
                        "node {id} exited during startup ({s}); its log:\n{}\n{}",
                        p.log(),
                        holders.join("\n")
                    );
                }
            }
            if Instant::now() > deadline {
                panic!(
                    "node {id} not ready within {READY_TIMEOUT:?}; its log:\n{}",
                    std::fs::read_to_string(&n.log).unwrap_or_default()
                );
            }
            std::thread::sleep(Duration::from_millis(10));
        }
    }

    /// SIGKILL (and reap) one node.
    pub fn kill9(&mut self, id: u16) {
        if let Some(mut p) = self.node_mut(id).proc.take() {
            p.kill9();
        }
    }

    /// A node the cluster's files have not listed yet (the next id, its
    /// ports held, a Raft address when the cluster is replicated), not
    /// started: the files written from now on list it.
    pub fn add_node(&mut self) -> u16 {
        let id = self.nodes.iter().map(|n| n.id).max().unwrap_or(0) + 1;
        let replicated = self.replication_factor.is_some();
        let held = hold_free_ports(if replicated { 3 } else { 2 });
        let ports: Vec<u16> = held.iter().map(HeldPort::port).collect();
        self.held.extend(ports.iter().copied().zip(held));
        self.nodes.push(ClusterNode {
            id,
            api: addr(ports[0]),
            peer: addr(ports[1]),
            raft: replicated.then(|| addr(ports[2])),
            netns: None,
            data_dir: self.dir.path().join(format!("node-{id}")),
            log: self.dir.path().join(format!("node-{id}.log")),
            proc: None,
            config: PathBuf::new(),
        });
        id
    }

    /// Gives node `id` (stopped) new ports, held until it starts: as a
    /// node restarted on another machine with its data. The files written
    /// from now on list it there.
    pub fn move_node(&mut self, id: u16) {
        assert!(
            self.node(id).proc.is_none(),
            "node {id} runs: stop it first"
        );
        let raft = self.node(id).raft.is_some();
        let held = hold_free_ports(if raft { 3 } else { 2 });
        let ports: Vec<u16> = held.iter().map(HeldPort::port).collect();
        self.held.extend(ports.iter().copied().zip(held));
        let n = self.node_mut(id);
        n.api = addr(ports[0]);
        n.peer = addr(ports[1]);
        n.raft = raft.then(|| addr(ports[2]));
    }

    /// Starts node `id` (stopping it first if it runs) on `config`,
    /// expecting it to refuse to start: how it exited (within `within`)
    /// and its log. Panics if it becomes ready instead.
    pub fn start_expecting_refusal(
        &mut self,
        id: u16,
        config: &Path,
        within: Duration,
    ) -> (std::process::ExitStatus, String) {
        self.kill9(id);
        self.spawn(id, config);
        let client = self.client(id);
        let n = self.node_mut(id);
        let mut p = n.proc.take().expect("just spawned");
        let status = p.wait_exit(within);
        let log = p.log();
        match status {
            Some(s) => (s, log),
            None => {
                let ready = client.ready();
                p.kill9();
                panic!(
                    "node {id} did not exit within {within:?} (ready: {ready}); its log:\n{log}"
                );
            }
        }
    }

    /// Restarts a node on its data dir with `config` (or its last one).
    pub fn restart(&mut self, id: u16, config: Option<&Path>) {
        self.kill9(id);
        let cfg = config
            .map(Path::to_path_buf)
            .unwrap_or_else(|| self.node(id).config.clone());
        self.spawn(id, &cfg);
        self.wait_ready(id);
    }

    /// Node `id`'s log so far.
    pub fn node_log(&self, id: u16) -> String {
        std::fs::read_to_string(&self.node(id).log).unwrap_or_default()
    }

    /// The logs of every node, for a failure message.
    pub fn logs(&self) -> String {
        let mut out: String = self
            .nodes
            .iter()
            .map(|n| {
                format!(
                    "---- node {} log ----\n{}",
                    n.id,
                    std::fs::read_to_string(&n.log).unwrap_or_default()
                )
            })
            .collect();
        // Last, where a cut output (a CI report shows its tail) keeps it.
        out.push_str(&self.summary());
        out
    }

    /// For each node: its last warnings and errors (the system's own, not
    /// its libraries'), and, if it runs, each shard as its `GET
    /// /api/cluster` shows it.
    pub fn summary(&self) -> String {
        let mut out = String::from("---- summary ----\n");
        for n in &self.nodes {
            let log = std::fs::read_to_string(&n.log).unwrap_or_default();
            let log = strip_ansi(&log);
            let own: Vec<&str> = log
                .lines()
                .filter(|l| {
                    (l.contains(" WARN ") || l.contains(" ERROR ")) && l.contains(" forkless")
                })
                .collect();
            out.push_str(&format!(
                "node {} ({}), its last warnings and errors:\n",
                n.id,
                if n.proc.is_some() {
                    "running"
                } else {
                    "not running"
                }
            ));
            for l in &own[own.len().saturating_sub(12)..] {
                out.push_str(&format!("  {}\n", l.chars().take(400).collect::<String>()));
            }
            if n.proc.is_none() {
                continue;
            }
            match n
                .client()
                .try_req("GET", "/api/cluster", &[], None, Duration::from_secs(1))
            {
                Ok(r) => {
                    for sh in r.json()["shards"].as_array().into_iter().flatten() {
                        let raft = &sh["raft"];
                        out.push_str(&format!(
                            "  shard {}: replicas {} ({}) raft {} failed {} restarts {}\n",
                            sh["shard"],
                            sh["replicas"],
                            sh["replicas_from"],
                            if raft.is_null() {
                                "none".to_string()
                            } else {
                                serde_json::json!({
                                    "state": raft["state"], "leader": raft["leader"],
                                    "term": raft["term"], "last_log_index": raft["last_log_index"],
                                    "applied": raft["applied"], "fresh": raft["fresh"],
                                    "voters": raft["voters"],
                                })
                                .to_string()
                            },
                            sh["failed"],
                            sh["restarts"],
                        ));
                    }
                }
                Err(e) => out.push_str(&format!("  GET /api/cluster: {e}\n")),
            }
        }
        out
    }

    /// `forkless cluster remove-node N [--to M]` through node `via`: its
    /// report, the command having succeeded (exit 0).
    pub fn remove_node(&self, node: u16, to: Option<u16>, via: u16) -> Value {
        self.removal_succeeded(self.try_remove_node(node, to, via))
    }

    /// A removal's report, asserted to have ended with exit code 0.
    fn removal_succeeded(&self, (code, report): (Option<i32>, Value)) -> Value {
        assert_eq!(
            code,
            Some(0),
            "remove-node failed: {report}\n{}",
            self.logs()
        );
        report
    }

    /// `forkless cluster remove-node` as [`Cluster::remove_node`], which
    /// may end incomplete: its exit code and its report.
    pub fn try_remove_node(&self, node: u16, to: Option<u16>, via: u16) -> (Option<i32>, Value) {
        let server = format!("http://{}", self.node(via).api);
        remove_node_cli(&server, node, to, Duration::from_secs(120))
    }

    /// `forkless cluster remove-node` through node `via` on a thread of
    /// its own (naming no node to move to), given `within` to end; its
    /// report is had with [`Cluster::removal_done`].
    pub fn remove_node_in_background(
        &self,
        node: u16,
        via: u16,
        within: Duration,
    ) -> std::thread::JoinHandle<(Option<i32>, Value)> {
        let server = format!("http://{}", self.node(via).api);
        std::thread::spawn(move || remove_node_cli(&server, node, None, within))
    }

    /// The report of a removal [`Cluster::remove_node_in_background`]
    /// began, asserted to have ended with exit code 0.
    pub fn removal_done(&self, removal: std::thread::JoinHandle<(Option<i32>, Value)>) -> Value {
        self.removal_succeeded(removal.join().expect("the removal's thread"))
    }

    /// `forkless status` through node `via`: its table.
    pub fn status(&self, via: u16) -> String {
        let server = format!("http://{}", self.node(via).api);
        let (code, out, err) = run_cli(&["status", "--server", &server], Duration::from_secs(30));
        assert_eq!(code, Some(0), "forkless status failed: {out}\n{err}");
        out
    }

    /// `forkless cluster reload` of `nodes`: its exit code and standard
    /// output (its standard error is printed).
    pub fn reload(&self, nodes: &[u16]) -> (Option<i32>, String) {
        let servers: Vec<String> = nodes
            .iter()
            .map(|n| format!("http://{}", self.node(*n).api))
            .collect();
        let (code, out, err) = run_cli(
            &["cluster", "reload", "--server", &servers.join(",")],
            Duration::from_secs(30),
        );
        if !err.is_empty() {
            eprintln!("cluster reload said on stderr: {err}");
        }
        (code, out)
    }

    pub fn owners(&self, via: u16) -> Vec<(u16, u64)> {
        let v = self.client(via).get("/api/cluster").json();
        v["shards"]
            .as_array()
            .expect("shards")
            .iter()
            .map(|s| {
                (
                    s["owner"].as_u64().expect("owner") as u16,
                    s["epoch"].as_u64().expect("epoch"),
                )
            })
            .collect()
    }
}

impl Drop for Cluster {
    fn drop(&mut self) {
        for n in &mut self.nodes {
            if let Some(p) = n.proc.as_ref() {
                p.sigcont();
            }
            n.proc.take();
        }
    }
}

/// Each shard's event count, as `forkless store check` reads it from a
/// stopped node's data directory (every shard it holds).
pub fn events_on_disk(data_dir: &Path) -> std::collections::BTreeMap<u32, u64> {
    let (code, out, err) = run_cli(
        &[
            "store",
            "check",
            "--data-dir",
            &data_dir.display().to_string(),
        ],
        Duration::from_secs(60),
    );
    assert_eq!(
        code,
        Some(0),
        "store check of {}: {out}\n{err}",
        data_dir.display()
    );
    out.lines()
        .filter_map(|l| l.strip_prefix("shard "))
        .map(|l| {
            let shard = l.split(':').next().and_then(|s| s.parse().ok());
            let events = l
                .split(" events of ")
                .next()
                .and_then(|b| b.rsplit(' ').next())
                .and_then(|n| n.parse().ok());
            match (shard, events) {
                (Some(s), Some(e)) => (s, e),
                _ => panic!("no shard and event count in {l:?}"),
            }
        })
        .collect()
}

// ---------------------------------------------------------------------------
// Routing helpers (the partition table, from the sharding crate)

pub fn shard_count(n: u32) -> forkless_sharding::ShardCount {
    forkless_sharding::ShardCount::new(n as u64).expect("legal shard count")
}

/// The shard of an execution id string.
pub fn shard_of_id(id: &str, n: u32) -> u32 {
    let raw: i64 = id.parse().expect("execution id is a decimal string");
    forkless_sharding::shard_for(raw, shard_count(n))
}

/// The shard of a routing key.
pub fn shard_of_key(key: &str, n: u32) -> u32 {
    forkless_sharding::shard_for_key(key, shard_count(n))
}

/// A routing key (`prefix-i`) whose shard is `shard`.
pub fn key_on_shard(prefix: &str, shard: u32, n: u32) -> String {
    (0..100_000)
        .map(|i| format!("{prefix}-{i}"))
        .find(|k| shard_of_key(k, n) == shard)
        .expect("a key on the shard")
}

/// A flag that is set once; for stopping writer threads.
#[derive(Clone, Default)]
pub struct Stop(Arc<AtomicBool>);

impl Stop {
    pub fn set(&self) {
        self.0.store(true, Ordering::SeqCst);
    }
    pub fn is_set(&self) -> bool {
        self.0.load(Ordering::SeqCst)
    }
}

// ---------------------------------------------------------------------------
// A concurrent append workload and its checker

pub mod workload {
    //! Writers that append uniquely marked batches with `expected_last_seq`
    //! and record what each answer promised; and a checker that compares
    //! the logs with those promises.

    use super::{json, Client, Stop};
    use serde_json::Value;
    use std::collections::{HashMap, HashSet};
    use std::sync::atomic::{AtomicUsize, Ordering};
    use std::sync::{Arc, Mutex};
    use std::time::Duration;

    /// What an answer promised about a batch.
    #[derive(Debug, Clone, PartialEq)]
    pub enum Outcome {
        /// 200: durable at these seqs.
        Acked { first_seq: u64 },
        /// A refusal that says nothing was written (409, 404, 421, 503
        /// with `executed: false`): must not be in any log.
        Refused,
        /// No answer, or 503 with `executed: "unknown"`: all or nothing,
        /// at most once.
        Unknown,
    }

    /// One batch sent, and its answer.
    #[derive(Debug, Clone)]
    pub struct Batch {
        pub exec: String,
        pub markers: Vec<String>,
        pub outcome: Outcome,
        /// HTTP status, or None for a transport error.
        pub status: Option<u16>,
        pub error: String,
        /// `x-forkless-node` / `x-forkless-epoch` of the answer.
        pub node: Option<u64>,
        pub epoch: Option<u64>,
        /// Index of the client it was sent through.
        pub via: usize,
        /// When the answer (or the failure) came back.
        pub answered_at: std::time::Instant,
    }

    pub fn batch_body(markers: &[String], expected: Option<u64>) -> Value {
        let events: Vec<Value> = markers
            .iter()
            .map(|m| json!({"type": "w", "payload": {"marker": m}, "idempotency_key": m}))
            .collect();
        match expected {
            Some(e) => json!({"events": events, "expected_last_seq": e}),
            None => json!({"events": events}),
        }
    }

    /// Shared state of a run of writers.
    #[derive(Clone, Default)]
    pub struct Shared {
        pub log: Arc<Mutex<Vec<Batch>>>,
        pub acks: Arc<AtomicUsize>,
        pub sent: Arc<AtomicUsize>,
        pub stop: Stop,
    }

    impl Shared {
        pub fn acks(&self) -> usize {
            self.acks.load(Ordering::SeqCst)
        }
        pub fn sent(&self) -> usize {
            self.sent.load(Ordering::SeqCst)
        }
        pub fn take(&self) -> Vec<Batch> {
            std::mem::take(&mut *self.log.lock().unwrap())
        }

        /// Waits (up to 60 s) until `n` writes in all were acknowledged.
        pub fn wait_acks(&self, n: usize, what: &str) {
            crate::wait_until(what, Duration::from_secs(60), || {
                (self.acks() >= n).then_some(())
            })
        }

        /// Stops the writers, waits for each (a writer that saw an answer
        /// break the API's promises fails the test), and takes the log.
        pub fn finish(
            &self,
            writers: Vec<std::thread::JoinHandle<Result<(), String>>>,
        ) -> Vec<Batch> {
            self.stop.set();
            for w in writers {
                w.join()
                    .expect("writer thread")
                    .expect("the API kept its promises");
            }
            self.take()
        }
    }

    /// Counts the batches answered while a fault was on (`windows`: when
    /// each struck and was healed), prints it with the answers' histogram,
    /// and fails the test if fewer than `at_least` met a fault.
    #[track_caller]
    pub fn assert_faulted(
        batches: &[Batch],
        windows: &[(std::time::Instant, std::time::Instant)],
        at_least: usize,
        seed: u64,
    ) {
        let during = batches
            .iter()
            .filter(|b| {
                windows
                    .iter()
                    .any(|(s, h)| (*s..*h).contains(&b.answered_at))
            })
            .count();
        eprintln!(
            "{} operations, {during} of them answered while a fault was on; answers {:?}",
            batches.len(),
            histogram(batches)
        );
        assert!(
            during >= at_least,
            "only {during} operations met a fault (seed {seed})"
        );
    }

    /// The seed of a randomized fault schedule: `FORKLESS_FAULT_SEED` (to
    /// replay one), else the clock; odd, as [`Rng`] needs. Printed by the
    /// caller.
    pub fn fault_seed() -> u64 {
        std::env::var("FORKLESS_FAULT_SEED")
            .ok()
            .and_then(|s| s.parse().ok())
            .unwrap_or_else(|| {
                std::time::SystemTime::now()
                    .duration_since(std::time::UNIX_EPOCH)
                    .map(|d| d.as_nanos() as u64)
                    .unwrap_or(1)
            })
            | 1
    }

    /// xorshift64*: enough to draw a fault schedule from a seed.
    pub struct Rng(pub u64);

    impl Rng {
        pub fn draw(&mut self) -> u64 {
            self.0 ^= self.0 >> 12;
            self.0 ^= self.0 << 25;
            self.0 ^= self.0 >> 27;
            self.0.wrapping_mul(0x2545_f491_4f6c_dd1d)
        }

        /// A number below `n`.
        pub fn below(&mut self, n: u64) -> u64 {
            self.draw() % n
        }
    }

    /// Starts `count` executions through `c`, the i-th steered to shard
    /// `i % shards` (routing key `prefix-i...`, idempotency key `start-i`,
    /// so that a start retried while its shard is between leaders lands
    /// once); their ids.
    pub fn start_spread(c: &Client, prefix: &str, count: u32, shards: u32) -> Vec<String> {
        (0..count)
            .map(|i| {
                let key = crate::key_on_shard(&format!("{prefix}-{i}"), i % shards, shards);
                let body = json!({"workflow": "w", "routing_key": key, "idempotency_key": format!("start-{i}")});
                let r = crate::settled(Duration::from_secs(20), || c.post("/api/executions", &body));
                assert!(
                    r.status == 201 || r.status == 200,
                    "start {body}: {} {}",
                    r.status,
                    r.text()
                );
                r.json()["execution_id"].as_str().expect("id").to_string()
            })
            .collect()
    }

    /// `count` [`writer`]s (tagged `t0`, `t1`, ...): writer t appends to
    /// `each` of `execs` from the (t * `stride`)-th on (wrapping), through
    /// `via` turned by t, so that the writers start on different nodes.
    pub fn spawn_writers(
        via: &[Client],
        execs: &[String],
        count: usize,
        each: usize,
        stride: usize,
        shared: &Shared,
    ) -> Vec<std::thread::JoinHandle<Result<(), String>>> {
        (0..count)
            .map(|t| {
                let mine: Vec<String> = (0..each)
                    .map(|k| execs[(t * stride + k) % execs.len()].clone())
                    .collect();
                let mut via = via.to_vec();
                let n = via.len();
                via.rotate_left(t % n);
                let shared = shared.clone();
                std::thread::spawn(move || writer(via, mine, format!("t{t}"), shared, false))
            })
            .collect()
    }

    /// Appends batches of 1 to 3 events to `execs` in turn, through
    /// `clients` in turn, until `stop`; with `exit_on_no_answer`, returns at
    /// the first transport error (the node died). Errs on an answer that
    /// breaks the API's promises.
    pub fn writer(
        clients: Vec<Client>,
        execs: Vec<String>,
        tag: String,
        shared: Shared,
        exit_on_no_answer: bool,
    ) -> Result<(), String> {
        let mut belief: HashMap<String, u64> = HashMap::new();
        let mut n = 0usize;
        while !shared.stop.is_set() {
            let exec = execs[n % execs.len()].clone();
            let via = n % clients.len();
            let c = clients[via];
            let size = 1 + n % 3;
            let markers: Vec<String> = (0..size).map(|k| format!("{tag}-n{n}-k{k}")).collect();
            n += 1;
            // The last seq this writer believes in; if it cannot learn it,
            // it appends without expected_last_seq.
            let expected = match belief.get(&exec) {
                Some(s) => Some(*s),
                None => match c.try_req(
                    "GET",
                    &format!("/api/executions/{exec}"),
                    &[],
                    None,
                    Duration::from_secs(5),
                ) {
                    Ok(r) if r.status == 200 => r.json()["last_seq"].as_u64(),
                    Ok(_) => None,
                    Err(_) if exit_on_no_answer => return Ok(()),
                    Err(_) => {
                        std::thread::sleep(Duration::from_millis(10));
                        continue;
                    }
                },
            };
            let body = batch_body(&markers, expected).to_string();
            shared.sent.fetch_add(1, Ordering::SeqCst);
            let r = c.try_req(
                "POST",
                &format!("/api/executions/{exec}/events"),
                &[],
                Some(body.as_bytes()),
                Duration::from_secs(10),
            );
            let mut batch = Batch {
                exec: exec.clone(),
                markers,
                outcome: Outcome::Unknown,
                status: None,
                error: String::new(),
                node: None,
                epoch: None,
                via,
                answered_at: std::time::Instant::now(),
            };
            match r {
                Ok(r) => {
                    batch.status = Some(r.status);
                    batch.node = r.header_u64("x-forkless-node");
                    batch.epoch = r.header_u64("x-forkless-epoch");
                    let v: Value = serde_json::from_slice(&r.body).map_err(|e| {
                        format!("{} answer is not JSON ({e}): {}", r.status, r.text())
                    })?;
                    batch.error = v["error"].as_str().unwrap_or("").to_string();
                    batch.outcome = match (r.status, batch.error.as_str()) {
                        (200, _) => {
                            let first = v["first_seq"].as_u64().ok_or("no first_seq")?;
                            let last = v["last_seq"].as_u64().ok_or("no last_seq")?;
                            if expected.is_some_and(|e| first != e + 1)
                                || last != first + size as u64 - 1
                            {
                                return Err(format!(
                                    "append of {size} after {expected:?} answered {v}"
                                ));
                            }
                            belief.insert(exec.clone(), last);
                            shared.acks.fetch_add(1, Ordering::SeqCst);
                            Outcome::Acked { first_seq: first }
                        }
                        (409, "sequence_conflict") => {
                            let last = v["last_seq"].as_u64().ok_or("409 without last_seq")?;
                            if Some(last) == expected {
                                return Err(format!(
                                    "409 but last_seq {last} is what was expected: {v}"
                                ));
                            }
                            belief.insert(exec.clone(), last);
                            Outcome::Refused
                        }
                        (404, "execution_not_found") | (421, "not_owner") => {
                            if v["executed"] == "unknown" {
                                return Err(format!("{}: {v}", r.status));
                            }
                            // Nothing was written: the belief still holds.
                            Outcome::Refused
                        }
                        // No owner reachable, or (a replicated shard) the
                        // node asked does not lead it or lost leadership.
                        (503, "owner_unavailable") | (503, "shard_unavailable") => {
                            if r.header("retry-after").is_none() {
                                return Err(format!("503 without Retry-After: {v}"));
                            }
                            match &v["executed"] {
                                // Nothing changed: the belief still holds.
                                Value::Bool(false) => Outcome::Refused,
                                Value::String(s) if s == "unknown" => {
                                    belief.remove(&exec);
                                    Outcome::Unknown
                                }
                                other => return Err(format!("503 with executed={other}: {v}")),
                            }
                        }
                        _ => return Err(format!("append: unexpected {} {v}", r.status)),
                    };
                }
                Err(_) => {
                    belief.remove(&exec);
                }
            }
            let no_answer = batch.status.is_none();
            let refused = batch.status.is_some_and(|s| s != 200 && s != 409);
            shared.log.lock().unwrap().push(batch);
            if no_answer {
                if exit_on_no_answer {
                    return Ok(());
                }
                std::thread::sleep(Duration::from_millis(10));
            } else if refused {
                // Do not spin on a shard that fails fast.
                std::thread::sleep(Duration::from_millis(5));
            }
        }
        Ok(())
    }

    /// Settles every batch whose outcome was unknown by sending it again,
    /// whole, with the same idempotency keys (and no `expected_last_seq`):
    /// one that had landed is answered with its original seqs
    /// (deduplicated), one that had not lands now. Either way it is then
    /// acknowledged, at the seqs [`verify`] then checks. Returns how many
    /// had landed before.
    #[track_caller]
    pub fn settle_unknowns(c: &Client, batches: &mut [Batch]) -> usize {
        let unknown = batches
            .iter()
            .filter(|b| b.outcome == Outcome::Unknown)
            .count();
        let mut landed = 0;
        for b in batches.iter_mut().filter(|b| b.outcome == Outcome::Unknown) {
            let body = batch_body(&b.markers, None).to_string();
            // Retried with the same keys while the shard is between
            // leaders.
            let r = crate::settled(Duration::from_secs(20), || {
                c.post_raw(
                    &format!("/api/executions/{}/events", b.exec),
                    body.as_bytes(),
                )
            });
            assert_eq!(
                r.status,
                200,
                "retrying an unknown batch {b:?}: {}",
                r.text()
            );
            let v = r.json();
            if v["deduplicated"] == true {
                landed += 1;
            }
            let first = v["first_seq"].as_u64().expect("first_seq");
            b.outcome = Outcome::Acked { first_seq: first };
        }
        eprintln!(
            "{unknown} unknown outcomes settled by a retry: {landed} had landed, {} had not",
            unknown - landed
        );
        landed
    }

    /// The end of a replicated run: settles the unknown outcomes through
    /// node `settle_via`, waits until the replicas are level, verifies
    /// every execution through each of `nodes` (each with at least
    /// `min_acked` acknowledged batches), then stops the cluster and
    /// compares every shard's replicas (at least `min_acked` events in
    /// all). Returns each shard's event count.
    #[track_caller]
    pub fn settle_verify_and_compare(
        cl: &mut crate::Cluster,
        batches: &mut [Batch],
        execs: &[String],
        settle_via: u16,
        nodes: &[u16],
        min_acked: usize,
    ) -> std::collections::BTreeMap<u32, u64> {
        settle_unknowns(&cl.client(settle_via), batches);
        cl.wait_replicas_level();
        for n in nodes {
            let report = verify(&cl.client(*n), execs, batches);
            assert!(report.acked >= min_acked, "node {n}: {report:?}");
        }
        let counts = cl.stop_and_compare_replicas();
        assert!(
            counts.values().sum::<u64>() >= min_acked as u64,
            "{counts:?}"
        );
        counts
    }

    /// What [`verify`] found.
    #[derive(Debug, Default)]
    pub struct Report {
        pub events: u64,
        pub acked: usize,
        pub refused: usize,
        pub unknown_landed: usize,
        pub unknown_lost: usize,
    }

    /// Reads every execution through `c` and checks it against every batch
    /// sent: gap-free logs, unique markers, nothing unsent, acknowledged
    /// batches at their seqs, refused ones absent, unknown ones whole or absent.
    #[track_caller]
    pub fn verify(c: &Client, execs: &[String], batches: &[Batch]) -> Report {
        let mut rep = Report::default();
        let mut by_marker: HashMap<String, (String, u64)> = HashMap::new();
        for e in execs {
            let last_seq = c.last_seq(e);
            let events = c.events(e);
            assert_eq!(
                events.len() as u64,
                last_seq,
                "execution {e}: {} events but last_seq {last_seq}",
                events.len()
            );
            rep.events += last_seq;
            for (i, ev) in events.iter().enumerate() {
                assert_eq!(
                    ev["seq"].as_u64(),
                    Some(i as u64 + 1),
                    "execution {e}: gap or disorder at index {i}: {ev}"
                );
            }
            assert_eq!(events[0]["type"], "execution.started");
            for ev in &events[1..] {
                let Some(m) = ev["payload"]["marker"].as_str() else {
                    continue;
                };
                assert_eq!(ev["idempotency_key"].as_str(), Some(m));
                let seq = ev["seq"].as_u64().unwrap();
                if let Some(prev) = by_marker.insert(m.to_string(), (e.clone(), seq)) {
                    panic!("marker {m} appears twice: {prev:?} and ({e}, {seq})");
                }
            }
        }
        let sent: HashSet<&str> = batches
            .iter()
            .flat_map(|b| b.markers.iter().map(String::as_str))
            .collect();
        for m in by_marker.keys() {
            assert!(
                sent.contains(m.as_str()),
                "marker {m} in a log was never sent"
            );
        }
        for b in batches {
            let found: Vec<_> = b.markers.iter().map(|m| by_marker.get(m)).collect();
            match &b.outcome {
                Outcome::Acked { first_seq } => {
                    rep.acked += 1;
                    for (k, f) in found.iter().enumerate() {
                        assert_eq!(
                            *f,
                            Some(&(b.exec.clone(), first_seq + k as u64)),
                            "acknowledged {} is not at its seq (batch {b:?})",
                            b.markers[k]
                        );
                    }
                }
                Outcome::Refused => {
                    rep.refused += 1;
                    assert!(
                        found.iter().all(Option::is_none),
                        "a batch refused with nothing-written landed: {b:?} at {found:?}"
                    );
                }
                Outcome::Unknown => {
                    if found.iter().all(Option::is_none) {
                        rep.unknown_lost += 1;
                    } else {
                        let first = found[0]
                            .unwrap_or_else(|| panic!("half a batch landed: {b:?} {found:?}"));
                        for (k, f) in found.iter().enumerate() {
                            assert_eq!(
                                *f,
                                Some(&(b.exec.clone(), first.1 + k as u64)),
                                "batch {b:?} landed torn: {found:?}"
                            );
                        }
                        rep.unknown_landed += 1;
                    }
                }
            }
        }
        rep
    }

    /// The longest `batches` went without an acknowledged answer from
    /// `from` on (from `from` to the first, and between any two after);
    /// `None` if none was acknowledged after `from`.
    pub fn longest_without_ack(batches: &[Batch], from: std::time::Instant) -> Option<Duration> {
        let mut acked: Vec<std::time::Instant> = batches
            .iter()
            .filter(|b| matches!(b.outcome, Outcome::Acked { .. }) && b.answered_at > from)
            .map(|b| b.answered_at)
            .collect();
        acked.sort();
        std::iter::once(from)
            .chain(acked.iter().copied())
            .zip(acked.iter().copied())
            .map(|(a, b)| b.duration_since(a))
            .max()
    }

    /// Counts of (status, error) among `batches`, for a log line.
    pub fn histogram(batches: &[Batch]) -> Vec<(String, usize)> {
        let mut h: std::collections::BTreeMap<String, usize> = Default::default();
        for b in batches {
            let k = match b.status {
                Some(s) if b.error.is_empty() => s.to_string(),
                Some(s) => format!("{s} {}", b.error),
                None => "no answer".into(),
            };
            *h.entry(k).or_default() += 1;
        }
        h.into_iter().collect()
    }
}

/// A tmpfs of `bytes` mounted on a fresh temporary folder, unmounted on
/// drop: a real filesystem to fill up, for real ENOSPC from the kernel.
/// Needs root (as the suite runs in CI); as another user it fails,
/// saying so, rather than skip.
pub struct Tmpfs {
    _dir: tempfile::TempDir,
    pub mount: PathBuf,
}

impl Tmpfs {
    pub fn new(bytes: u64) -> Tmpfs {
        // SAFETY: geteuid reads the process's credentials and cannot fail.
        assert!(
            unsafe { libc::geteuid() } == 0,
            "this test mounts a tmpfs to fill a real filesystem and needs root (CI runs as root)"
        );
        let dir = tempfile::tempdir().expect("a temporary folder");
        let mount = dir.path().join("fs");
        std::fs::create_dir(&mount).expect("a mount point");
        let status = Command::new("mount")
            .args(["-t", "tmpfs", "-o", &format!("size={bytes}"), "tmpfs"])
            .arg(&mount)
            .status()
            .expect("mount runs");
        assert!(status.success(), "mount -t tmpfs failed: {status}");
        Tmpfs { _dir: dir, mount }
    }
}

impl Drop for Tmpfs {
    fn drop(&mut self) {
        let _ = Command::new("umount").arg("-l").arg(&self.mount).status();
    }
}

/// Fills the filesystem holding `dir` to the last byte; returns the filler
/// file (remove it to free the space).
pub fn fill(dir: &Path) -> PathBuf {
    let path = dir.join("filler");
    let mut f = std::fs::File::create(&path).expect("a filler file");
    let chunk = vec![0xa5u8; 4096];
    while f.write(&chunk).is_ok_and(|n| n > 0) {}
    // The last partial page too.
    while f.write(&[0xa5]).is_ok_and(|n| n > 0) {}
    path
}

pub mod netlab {
    //! Real network partitions between nodes: each node in a network
    //! namespace of its own, with two links to the test's namespace: a
    //! client link (the node's API address, which the test always
    //! reaches) and a peer link into a bridge that every node's peer link
    //! joins (its peer and Raft addresses). Cutting a node's peer link
    //! parts it from every other node, with its clients still connected;
    //! the kernel drops what it sends, so its connections hang rather
    //! than fail, as across a real partition. Needs root (CI runs as
    //! root); the namespaces, links and bridge are removed on drop.

    use std::net::SocketAddr;
    use std::path::PathBuf;
    use std::process::Command;
    use std::sync::atomic::{AtomicU32, Ordering};

    fn ip(args: &[&str]) {
        let out = Command::new("ip")
            .args(args)
            .output()
            .unwrap_or_else(|e| panic!("running ip {args:?}: {e} (iproute2 is needed)"));
        assert!(
            out.status.success(),
            "ip {args:?} failed: {}",
            String::from_utf8_lossy(&out.stderr)
        );
    }

    /// The namespaces and links of one test.
    pub struct NetLab {
        tag: String,
        nodes: u16,
        /// The third octet of this lab's addresses, unique per lab of a
        /// test binary so labs can run at once.
        net: u32,
    }

    impl NetLab {
        /// Namespaces for nodes 1 to `nodes`.
        pub fn new(nodes: u16) -> NetLab {
            // SAFETY: geteuid reads the process's credentials and cannot fail.
            assert!(
                unsafe { libc::geteuid() } == 0,
                "this test makes network namespaces and needs root (CI runs as root)"
            );
            static NEXT: AtomicU32 = AtomicU32::new(0);
            let n = NEXT.fetch_add(1, Ordering::SeqCst);
            let net = (std::process::id() + n) % 200 + 20;
            let tag = format!("fk{:x}{n}", std::process::id() % 0xffff);
            let lab = NetLab { tag, nodes, net };
            for br in [lab.bridge(), lab.other_bridge()] {
                ip(&["link", "add", &br, "type", "bridge"]);
                ip(&["link", "set", &br, "up"]);
            }
            let br = lab.bridge();
            for k in 1..=nodes {
                let ns = lab.ns_name(k);
                ip(&["netns", "add", &ns]);
                ip(&["-n", &ns, "link", "set", "lo", "up"]);
                let (client, peer) = (lab.client_link(k), lab.peer_link(k));
                ip(&[
                    "link", "add", &client, "type", "veth", "peer", "name", "c0", "netns", &ns,
                ]);
                ip(&[
                    "link", "add", &peer, "type", "veth", "peer", "name", "p0", "netns", &ns,
                ]);
                ip(&[
                    "addr",
                    "add",
                    &format!("10.{}.{k}.1/24", lab.net + 1),
                    "dev",
                    &client,
                ]);
                ip(&["link", "set", &client, "up"]);
                ip(&["link", "set", &peer, "master", &br]);
                ip(&["link", "set", &peer, "up"]);
                ip(&[
                    "-n",
                    &ns,
                    "addr",
                    "add",
                    &format!("10.{}.{k}.2/24", lab.net + 1),
                    "dev",
                    "c0",
                ]);
                ip(&["-n", &ns, "link", "set", "c0", "up"]);
                ip(&[
                    "-n",
                    &ns,
                    "addr",
                    "add",
                    &format!("10.{}.0.{k}/24", lab.net),
                    "dev",
                    "p0",
                ]);
                ip(&["-n", &ns, "link", "set", "p0", "up"]);
            }
            lab
        }

        pub fn nodes(&self) -> u16 {
            self.nodes
        }

        fn bridge(&self) -> String {
            format!("{}br", self.tag)
        }

        /// Where the peer links of one side of a split go.
        fn other_bridge(&self) -> String {
            format!("{}b2", self.tag)
        }

        fn ns_name(&self, k: u16) -> String {
            format!("{}n{k}", self.tag)
        }

        fn client_link(&self, k: u16) -> String {
            format!("{}c{k}", self.tag)
        }

        fn peer_link(&self, k: u16) -> String {
            format!("{}p{k}", self.tag)
        }

        /// Node `k`'s namespace, as a file to enter it by.
        pub fn netns(&self, k: u16) -> PathBuf {
            PathBuf::from("/var/run/netns").join(self.ns_name(k))
        }

        /// Node `k`'s API (client link), peer and Raft addresses (peer link).
        pub fn addrs(&self, k: u16) -> (SocketAddr, SocketAddr, SocketAddr) {
            let a = |s: String| s.parse().unwrap_or_else(|e| panic!("{s}: {e}"));
            (
                a(format!("10.{}.{k}.2:7070", self.net + 1)),
                a(format!("10.{}.0.{k}:7071", self.net)),
                a(format!("10.{}.0.{k}:7072", self.net)),
            )
        }

        /// Parts node `k` from every other node (its clients still reach it).
        pub fn cut(&self, k: u16) {
            ip(&["link", "set", &self.peer_link(k), "down"]);
        }

        /// Joins node `k` to the others again.
        pub fn heal(&self, k: u16) {
            ip(&["link", "set", &self.peer_link(k), "up"]);
        }

        /// Splits the nodes in two: `side` reach each other and no one
        /// else; the rest reach each other.
        pub fn split(&self, side: &[u16]) {
            for k in side {
                ip(&[
                    "link",
                    "set",
                    &self.peer_link(*k),
                    "master",
                    &self.other_bridge(),
                ]);
            }
        }

        /// Undoes every cut and split.
        pub fn heal_all(&self) {
            for k in 1..=self.nodes {
                ip(&["link", "set", &self.peer_link(k), "master", &self.bridge()]);
                self.heal(k);
            }
        }
    }

    impl Drop for NetLab {
        fn drop(&mut self) {
            // Best effort: a namespace goes with its links' far ends.
            for k in 1..=self.nodes {
                let _ = Command::new("ip")
                    .args(["netns", "del", &self.ns_name(k)])
                    .output();
                let _ = Command::new("ip")
                    .args(["link", "del", &self.client_link(k)])
                    .output();
                let _ = Command::new("ip")
                    .args(["link", "del", &self.peer_link(k)])
                    .output();
            }
            for br in [self.bridge(), self.other_bridge()] {
                let _ = Command::new("ip").args(["link", "del", &br]).output();
            }
        }
    }
}

/// `text` without its terminal colours (escape sequences run to their
/// final letter).
pub fn strip_ansi(text: &str) -> String {
    let mut out = String::with_capacity(text.len());
    let mut chars = text.chars();
    while let Some(c) = chars.next() {
        if c == '\u{1b}' {
            for c in chars.by_ref() {
                if c.is_ascii_alphabetic() {
                    break;
                }
            }
        } else {
            out.push(c);
        }
    }
    out
}
