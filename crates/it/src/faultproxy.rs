//! A fault-injecting TCP proxy for the links between test nodes (their
//! Raft transport, and their HTTP peer links: probes and forwarded
//! requests):
//! one-way cuts, delay with jitter, loss and connection resets, which this
//! kernel cannot make with `tc netem` and which network namespaces make
//! only both ways at once.
//!
//! Every ordered pair of nodes (a, b) gets a proxy for each of b's ports
//! (its Raft address, its peer address): node a's cluster file names them
//! as node b's `raft_addr` and `peer_addr`, so every connection a makes to
//! b goes through one (the bytes a sends on it are the a → b direction,
//! b's answers the b → a direction). The faults are set per direction
//! ([`Faults::link`]), and each direction is shared by every proxy that
//! carries it, as a network link is: a → b is the request side of a's
//! connections to b and the answer side of b's connections to a, Raft
//! and HTTP alike.
//!
//! The faults are TCP's, not a datagram network's, since a stream cannot
//! lose a byte and go on:
//! - a **cut** holds every byte of its direction back (the sender's
//!   writes fill the socket buffers, then block), and a heal lets them
//!   through in order, as TCP's retransmissions would after a partition
//!   heals; a connection made across a cut is accepted and then hears
//!   nothing, as a SYN lost would leave it;
//! - **delay** holds each read chunk for a time (plus a jitter drawn per
//!   chunk), keeping the order;
//! - **loss** holds a chunk, and everything behind it, one retransmission
//!   timeout ([`RETRANSMIT_AFTER`]): a lost segment on TCP;
//! - a **reset** closes every connection of a pair at once (both ways).
//!
//! Each direction of each connection is two threads (a reader and a
//! writer) over a bounded queue, so the memory a stalled direction holds
//! is bounded ([`CHUNKS_QUEUED_MAX`] chunks of [`CHUNK_BYTES`]).

use std::collections::BTreeMap;
use std::io::{Read, Write};
use std::net::{Shutdown, SocketAddr, TcpListener, TcpStream};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{mpsc, Arc, Condvar, Mutex};
use std::time::{Duration, Instant};

/// The most one read takes off a socket.
pub const CHUNK_BYTES: usize = 64 * 1024;
/// The most chunks one direction of a connection holds back.
pub const CHUNKS_QUEUED_MAX: usize = 256;
/// How long a lost chunk is held: Linux's minimum retransmission timeout.
pub const RETRANSMIT_AFTER: Duration = Duration::from_millis(200);
/// How often a writer held by a cut looks whether its connection closed.
const CUT_RECHECK: Duration = Duration::from_millis(50);

/// What one direction of a link between two nodes does to its bytes.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct LinkFault {
    /// Hold every byte back until healed.
    pub cut: bool,
    /// Hold each chunk this long...
    pub delay: Duration,
    /// ...plus up to this much more, drawn per chunk.
    pub jitter: Duration,
    /// Chunks in a thousand held [`RETRANSMIT_AFTER`] more.
    pub loss_per_mille: u32,
}

/// One direction of a link: its fault, and a condition its held writers
/// wait on.
#[derive(Default)]
struct Direction {
    fault: Mutex<LinkFault>,
    changed: Condvar,
}

impl Direction {
    fn get(&self) -> LinkFault {
        *self.fault.lock().unwrap_or_else(|p| p.into_inner())
    }

    fn set(&self, f: LinkFault) {
        *self.fault.lock().unwrap_or_else(|p| p.into_inner()) = f;
        self.changed.notify_all();
    }

    /// Waits while this direction is cut, or until `closed`.
    fn wait_while_cut(&self, closed: &AtomicBool) {
        let mut f = self.fault.lock().unwrap_or_else(|p| p.into_inner());
        while f.cut && !closed.load(Ordering::Acquire) {
            f = self
                .changed
                .wait_timeout(f, CUT_RECHECK)
                .unwrap_or_else(|p| p.into_inner())
                .0;
        }
    }
}

/// The connections one proxy carries, so that a reset can close them.
#[derive(Default)]
struct Open {
    next: u64,
    conns: BTreeMap<u64, (TcpStream, TcpStream, Arc<AtomicBool>)>,
}

/// The proxy for node `from`'s connections to node `to`.
struct Proxy {
    listen: SocketAddr,
    open: Arc<Mutex<Open>>,
}

/// Every proxy of a cluster, and the faults of every direction.
pub struct Faults {
    directions: BTreeMap<(u16, u16), Arc<Direction>>,
    /// By (from, to, port): `port` indexes the addresses each node was
    /// given to [`Faults::start`].
    proxies: BTreeMap<(u16, u16, usize), Proxy>,
    stop: Arc<AtomicBool>,
    /// Chunks held back for loss so far (all directions).
    lost: Arc<AtomicU64>,
}

impl Faults {
    /// Starts a proxy for every ordered pair of `nodes` (id, the addresses
    /// of its ports: Raft, then peer) and every port of the second, each
    /// listening on its listener of `listeners` (by from, to, port).
    pub fn start(
        nodes: &[(u16, Vec<SocketAddr>)],
        mut listeners: BTreeMap<(u16, u16, usize), TcpListener>,
    ) -> Faults {
        let stop = Arc::new(AtomicBool::new(false));
        let lost = Arc::new(AtomicU64::new(0));
        let mut directions = BTreeMap::new();
        for (a, _) in nodes {
            for (b, _) in nodes {
                if a != b {
                    directions.insert((*a, *b), Arc::new(Direction::default()));
                }
            }
        }
        let mut proxies = BTreeMap::new();
        for (from, _) in nodes {
            for (to, targets) in nodes {
                if from == to {
                    continue;
                }
                for (port, target) in targets.iter().enumerate() {
                    let listener = listeners.remove(&(*from, *to, port)).unwrap_or_else(|| {
                        panic!("no listener for the proxy {from} -> {to}, port {port}")
                    });
                    let listen = listener.local_addr().expect("a proxy listener's address");
                    let open = Arc::new(Mutex::new(Open::default()));
                    let up = directions[&(*from, *to)].clone();
                    let down = directions[&(*to, *from)].clone();
                    let (target, o, s, l) = (*target, open.clone(), stop.clone(), lost.clone());
                    let seed = (u64::from(*from) << 16) ^ (u64::from(*to) << 4) ^ port as u64;
                    std::thread::Builder::new()
                        .name(format!("proxy-{from}-{to}-{port}"))
                        .spawn(move || accept_loop(listener, target, up, down, o, s, l, seed))
                        .expect("spawn a proxy's accept thread");
                    proxies.insert((*from, *to, port), Proxy { listen, open });
                }
            }
        }
        Faults {
            directions,
            proxies,
            stop,
            lost,
        }
    }

    /// The address node `from` dials to reach node `to`'s first port
    /// (its Raft address).
    pub fn addr(&self, from: u16, to: u16) -> SocketAddr {
        self.port_addr(from, to, 0)
    }

    /// The address node `from` dials to reach node `to`'s port `port`, if
    /// it is behind a proxy.
    pub fn port_addr(&self, from: u16, to: u16, port: usize) -> SocketAddr {
        self.proxies[&(from, to, port)].listen
    }

    /// Whether node `to`'s port `port` is behind proxies.
    pub fn proxies_port(&self, port: usize) -> bool {
        self.proxies.keys().any(|(_, _, p)| *p == port)
    }

    /// Sets what the direction `from` → `to` does.
    pub fn link(&self, from: u16, to: u16, fault: LinkFault) {
        self.directions[&(from, to)].set(fault);
    }

    /// The direction `from` → `to`'s fault now.
    pub fn fault(&self, from: u16, to: u16) -> LinkFault {
        self.directions[&(from, to)].get()
    }

    /// Sets `fault` on every direction.
    pub fn all(&self, fault: LinkFault) {
        for d in self.directions.values() {
            d.set(fault);
        }
    }

    /// Cuts every direction into node `n`: it still sends, and hears
    /// nothing.
    pub fn cut_into(&self, n: u16) {
        self.cut_where(|_, to| to == n);
    }

    /// Cuts every direction out of node `n`: it hears, and nothing it
    /// sends arrives.
    pub fn cut_out_of(&self, n: u16) {
        self.cut_where(|from, _| from == n);
    }

    /// Cuts every direction (from, to) that `which` picks, keeping the
    /// rest of its fault.
    fn cut_where(&self, which: impl Fn(u16, u16) -> bool) {
        for ((from, to), d) in &self.directions {
            if which(*from, *to) {
                d.set(LinkFault {
                    cut: true,
                    ..d.get()
                });
            }
        }
    }

    /// Every direction back to no fault.
    pub fn heal_all(&self) {
        self.all(LinkFault::default());
    }

    /// Closes every connection between `a` and `b`, both ways, on every
    /// port.
    pub fn reset(&self, a: u16, b: u16) {
        let between = self
            .proxies
            .iter()
            .filter(|((from, to, _), _)| (*from, *to) == (a, b) || (*from, *to) == (b, a));
        for (_, proxy) in between {
            let conns =
                std::mem::take(&mut proxy.open.lock().unwrap_or_else(|p| p.into_inner()).conns);
            for (_, (x, y, closed)) in conns {
                closed.store(true, Ordering::Release);
                let _ = x.shutdown(Shutdown::Both);
                let _ = y.shutdown(Shutdown::Both);
            }
        }
    }

    /// Closes every connection of every pair.
    pub fn reset_all(&self) {
        let mut pairs: Vec<(u16, u16)> = self
            .proxies
            .keys()
            .map(|(a, b, _)| (*a, *b))
            .filter(|(a, b)| a < b)
            .collect();
        pairs.dedup();
        for (a, b) in pairs {
            self.reset(a, b);
        }
    }

    /// How many chunks were held back for loss so far.
    pub fn lost(&self) -> u64 {
        self.lost.load(Ordering::Relaxed)
    }
}

impl Drop for Faults {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::Release);
        self.heal_all();
        self.reset_all();
        // Wake each accept loop so that it sees the stop.
        for p in self.proxies.values() {
            let _ = TcpStream::connect_timeout(&p.listen, Duration::from_millis(100));
        }
    }
}

#[allow(clippy::too_many_arguments)]
fn accept_loop(
    listener: TcpListener,
    target: SocketAddr,
    up: Arc<Direction>,
    down: Arc<Direction>,
    open: Arc<Mutex<Open>>,
    stop: Arc<AtomicBool>,
    lost: Arc<AtomicU64>,
    seed: u64,
) {
    let mut n = 0u64;
    for client in listener.incoming() {
        if stop.load(Ordering::Acquire) {
            return;
        }
        let Ok(client) = client else { continue };
        n += 1;
        // The node behind may be down: then the connection is closed at
        // once, as a refused connect would be seen.
        let Ok(server) = TcpStream::connect_timeout(&target, Duration::from_secs(1)) else {
            let _ = client.shutdown(Shutdown::Both);
            continue;
        };
        let _ = client.set_nodelay(true);
        let _ = server.set_nodelay(true);
        let closed = Arc::new(AtomicBool::new(false));
        let (Ok(c2), Ok(s2), Ok(c3), Ok(s3)) = (
            client.try_clone(),
            server.try_clone(),
            client.try_clone(),
            server.try_clone(),
        ) else {
            continue;
        };
        let id = {
            let mut o = open.lock().unwrap_or_else(|p| p.into_inner());
            o.next += 1;
            let id = o.next;
            o.conns.insert(id, (c3, s3, closed.clone()));
            id
        };
        let seed = seed.wrapping_mul(0x9e37_79b9_7f4a_7c15) ^ n;
        // The request side (client to server) and the answer side.
        let gone = {
            let (open, closed) = (open.clone(), closed.clone());
            move || {
                closed.store(true, Ordering::Release);
                open.lock()
                    .unwrap_or_else(|p| p.into_inner())
                    .conns
                    .remove(&id);
            }
        };
        pump(
            client,
            s2,
            up.clone(),
            closed.clone(),
            lost.clone(),
            seed,
            gone.clone(),
        );
        pump(
            server,
            c2,
            down.clone(),
            closed,
            lost.clone(),
            seed ^ 1,
            gone,
        );
    }
}

/// Carries `from`'s bytes to `to` through `dir`'s faults: a reader thread
/// stamps each chunk with when it may go, a writer thread sends it then
/// (and not while the direction is cut).
fn pump(
    mut from: TcpStream,
    mut to: TcpStream,
    dir: Arc<Direction>,
    closed: Arc<AtomicBool>,
    lost: Arc<AtomicU64>,
    seed: u64,
    gone: impl Fn() + Send + Clone + 'static,
) {
    let (tx, rx) = mpsc::sync_channel::<(Instant, Vec<u8>)>(CHUNKS_QUEUED_MAX);
    let d = dir.clone();
    let _ = std::thread::Builder::new()
        .name("proxy-read".into())
        .spawn(move || {
            let mut rng = seed | 1;
            let mut last_due = Instant::now();
            let mut buf = vec![0u8; CHUNK_BYTES];
            loop {
                let n = match from.read(&mut buf) {
                    Ok(0) | Err(_) => break,
                    Ok(n) => n,
                };
                let f = d.get();
                let mut hold = f.delay;
                if !f.jitter.is_zero() {
                    let j = f.jitter.as_micros() as u64;
                    hold += Duration::from_micros(next(&mut rng) % (j + 1));
                }
                if f.loss_per_mille > 0 && next(&mut rng) % 1000 < u64::from(f.loss_per_mille) {
                    hold += RETRANSMIT_AFTER;
                    lost.fetch_add(1, Ordering::Relaxed);
                }
                // In order: never before the chunk ahead of it.
                let due = (Instant::now() + hold).max(last_due);
                last_due = due;
                if tx.send((due, buf[..n].to_vec())).is_err() {
                    break;
                }
            }
            // The writer sends what was read, then ends this direction.
            drop(tx);
        });
    let _ = std::thread::Builder::new()
        .name("proxy-write".into())
        .spawn(move || {
            for (due, chunk) in rx {
                let now = Instant::now();
                if due > now {
                    std::thread::sleep(due - now);
                }
                dir.wait_while_cut(&closed);
                if closed.load(Ordering::Acquire) || to.write_all(&chunk).is_err() {
                    break;
                }
            }
            // One side ended (or a write failed): close both ways, so the
            // other direction's reader ends too.
            let _ = to.shutdown(Shutdown::Both);
            gone();
        });
}

/// xorshift64*.
fn next(s: &mut u64) -> u64 {
    *s ^= *s >> 12;
    *s ^= *s << 25;
    *s ^= *s >> 27;
    s.wrapping_mul(0x2545_f491_4f6c_dd1d)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// An echo server: every byte it reads it writes back.
    fn echo() -> SocketAddr {
        let l = TcpListener::bind("127.0.0.1:0").unwrap();
        let a = l.local_addr().unwrap();
        std::thread::spawn(move || {
            for s in l.incoming().flatten() {
                std::thread::spawn(move || {
                    let mut r = s.try_clone().unwrap();
                    let mut w = s;
                    let _ = std::io::copy(&mut r, &mut w);
                });
            }
        });
        a
    }

    fn faults_to(target: SocketAddr) -> Faults {
        let mut ls = BTreeMap::new();
        ls.insert((1, 2, 0), TcpListener::bind("127.0.0.1:0").unwrap());
        ls.insert((2, 1, 0), TcpListener::bind("127.0.0.1:0").unwrap());
        Faults::start(&[(1, vec![target]), (2, vec![target])], ls)
    }

    fn round_trip(s: &mut TcpStream, bytes: &[u8]) -> Vec<u8> {
        s.write_all(bytes).unwrap();
        let mut back = vec![0u8; bytes.len()];
        s.read_exact(&mut back).unwrap();
        back
    }

    #[test]
    fn bytes_pass_in_order_and_a_cut_holds_them_until_healed() {
        let f = faults_to(echo());
        let mut s = TcpStream::connect(f.addr(1, 2)).unwrap();
        s.set_read_timeout(Some(Duration::from_secs(5))).unwrap();
        let data: Vec<u8> = (0..200_000u32).map(|i| i as u8).collect();
        assert_eq!(round_trip(&mut s, &data), data);
        // The answer side (2 -> 1) cut: the bytes go and nothing comes back.
        f.link(
            2,
            1,
            LinkFault {
                cut: true,
                ..LinkFault::default()
            },
        );
        s.write_all(b"held").unwrap();
        s.set_read_timeout(Some(Duration::from_millis(300)))
            .unwrap();
        let mut b = [0u8; 4];
        assert!(s.read_exact(&mut b).is_err(), "a cut let bytes through");
        f.heal_all();
        s.set_read_timeout(Some(Duration::from_secs(5))).unwrap();
        s.read_exact(&mut b).unwrap();
        assert_eq!(&b, b"held");
    }

    #[test]
    fn delay_and_loss_hold_chunks_and_keep_their_order() {
        let f = faults_to(echo());
        let mut s = TcpStream::connect(f.addr(1, 2)).unwrap();
        s.set_read_timeout(Some(Duration::from_secs(5))).unwrap();
        f.link(
            1,
            2,
            LinkFault {
                delay: Duration::from_millis(40),
                ..LinkFault::default()
            },
        );
        let t = Instant::now();
        assert_eq!(round_trip(&mut s, b"slow"), b"slow");
        assert!(
            t.elapsed() >= Duration::from_millis(40),
            "{:?}",
            t.elapsed()
        );
        f.link(
            1,
            2,
            LinkFault {
                loss_per_mille: 1000,
                ..LinkFault::default()
            },
        );
        let t = Instant::now();
        assert_eq!(round_trip(&mut s, b"lost"), b"lost");
        assert!(t.elapsed() >= RETRANSMIT_AFTER, "{:?}", t.elapsed());
        assert!(f.lost() >= 1);
        f.heal_all();
        for i in 0..50u8 {
            assert_eq!(round_trip(&mut s, &[i; 10]), [i; 10]);
        }
    }

    #[test]
    fn a_reset_closes_the_pairs_connections() {
        let f = faults_to(echo());
        let mut s = TcpStream::connect(f.addr(1, 2)).unwrap();
        s.set_read_timeout(Some(Duration::from_secs(5))).unwrap();
        assert_eq!(round_trip(&mut s, b"x"), b"x");
        f.reset(1, 2);
        let mut b = [0u8; 1];
        assert!(matches!(s.read(&mut b), Ok(0) | Err(_)));
        // A new connection works.
        let mut s = TcpStream::connect(f.addr(1, 2)).unwrap();
        s.set_read_timeout(Some(Duration::from_secs(5))).unwrap();
        assert_eq!(round_trip(&mut s, b"y"), b"y");
    }
}
