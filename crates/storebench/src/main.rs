//! forkless-storebench: redb vs fjall on forkless's own key layout and write pattern.
//!
//! Layout per shard (one database per shard, keys big-endian, partition-first):
//! - `events`:     `partition u32 | execution u64 | seq u64` (20 B) -> ~300 B value
//!   (recorded_at u64, event type string, 256-byte JSON payload).
//! - `executions`: `partition u32 | execution u64` (12 B) -> ~80 B metadata value,
//!   overwritten on every append.
//!
//! One "append" = one event insert + one metadata overwrite in the same atomic batch.
//! A durable commit is redb `Durability::Immediate`, or a fjall write batch committed
//! with `PersistMode::SyncAll` (journal fsynced before the commit returns).
//!
//! Run `forkless-storebench --help` for the options.

use std::fs::{self, File, OpenOptions};
use std::io::Write;
use std::os::unix::fs::MetadataExt;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::{Duration, Instant};

use redb::ReadableDatabase;

type Result<T> = std::result::Result<T, Box<dyn std::error::Error + Send + Sync>>;

const EVENT_PAYLOAD: usize = 256;
const META_LEN: usize = 80;
const PARTITIONS: u64 = 4096;
const EVENT_TYPES: [&str; 4] = [
    "ActivityTaskScheduled",
    "ActivityTaskCompleted",
    "TimerFired",
    "WorkflowTaskCompleted",
];

#[derive(Clone, Copy, PartialEq, Eq, Debug)]
enum Engine {
    Redb,
    Fjall,
}

impl Engine {
    fn parse(s: &str) -> Option<Engine> {
        match s {
            "redb" => Some(Engine::Redb),
            "fjall" => Some(Engine::Fjall),
            _ => None,
        }
    }
    fn name(self) -> &'static str {
        match self {
            Engine::Redb => "redb",
            Engine::Fjall => "fjall",
        }
    }
}

#[derive(Clone, Debug)]
struct Config {
    engines: Vec<Engine>,
    cases: Vec<String>,
    shards: usize,
    executions: u64,
    groups: Vec<usize>,
    case_secs: f64,
    steady_appends: u64,
    steady_secs: f64,
    steady_group: usize,
    read_secs: f64,
    cache_mb: usize,
    /// fjall's max journal size per database, MiB (0 = fjall's default, 512 MiB).
    fjall_journal_mb: u64,
    root: PathBuf,
}

impl Default for Config {
    fn default() -> Self {
        Config {
            engines: vec![Engine::Redb, Engine::Fjall],
            cases: vec![
                "disk".into(),
                "scattered".into(),
                "steady".into(), // includes read path and reopen
            ],
            shards: 4,
            executions: 1000,
            groups: vec![1, 16, 64, 512],
            case_secs: 4.0,
            steady_appends: 1_000_000,
            steady_secs: 25.0,
            steady_group: 512,
            read_secs: 2.0,
            cache_mb: 64,
            fjall_journal_mb: 0,
            root: PathBuf::from("target/storebench-tmp"),
        }
    }
}

const HELP: &str = "forkless-storebench [options]
  --engines redb,fjall     engines to measure (default both)
  --cases disk,scattered,steady
                           cases to run (steady includes read path and reopen)
  --shards N               databases per engine, one writer thread each (default 4)
  --executions N           interleaved executions, round-robin (default 1000)
  --groups 1,16,64,512     appends per durable commit for the scattered case
  --case-secs S            time limit per scattered measurement (default 4)
  --steady-appends N       steady-state appends (default 1000000)
  --steady-secs S          steady-state time limit; stops early if reached (default 25)
  --read-secs S            time per read measurement (default 2)
  --cache-mb N             cache per shard database, MiB (default 64)
  --fjall-journal-mb N     fjall max journal size per database, >= 64 (default: fjall's 512)
  --dir PATH               scratch dir, removed afterwards (default target/storebench-tmp)";

fn parse_args(args: &[String]) -> Result<Config> {
    let mut c = Config::default();
    let mut i = 0;
    while i < args.len() {
        let flag = args[i].as_str();
        if flag == "--help" || flag == "-h" {
            println!("{HELP}");
            std::process::exit(0);
        }
        let v = args
            .get(i + 1)
            .ok_or_else(|| format!("missing value for {flag}"))?
            .clone();
        match flag {
            "--engines" => {
                c.engines = v
                    .split(',')
                    .map(|s| Engine::parse(s).ok_or_else(|| format!("unknown engine {s}")))
                    .collect::<std::result::Result<_, _>>()?
            }
            "--cases" => c.cases = v.split(',').map(String::from).collect(),
            "--shards" => c.shards = v.parse()?,
            "--executions" => c.executions = v.parse()?,
            "--groups" => {
                c.groups = v
                    .split(',')
                    .map(str::parse)
                    .collect::<std::result::Result<_, _>>()?
            }
            "--case-secs" => c.case_secs = v.parse()?,
            "--steady-appends" => c.steady_appends = v.parse()?,
            "--steady-secs" => c.steady_secs = v.parse()?,
            "--steady-group" => c.steady_group = v.parse()?,
            "--read-secs" => c.read_secs = v.parse()?,
            "--cache-mb" => c.cache_mb = v.parse()?,
            "--fjall-journal-mb" => c.fjall_journal_mb = v.parse()?,
            "--dir" => c.root = PathBuf::from(v),
            _ => return Err(format!("unknown option {flag}\n{HELP}").into()),
        }
        i += 2;
    }
    if c.fjall_journal_mb != 0 && c.fjall_journal_mb < 64 {
        return Err("--fjall-journal-mb must be 0 or >= 64".into());
    }
    if c.shards == 0 || c.executions == 0 || c.groups.contains(&0) {
        return Err("shards, executions and groups must be > 0".into());
    }
    Ok(c)
}

// ---------------------------------------------------------------------------
// Data model

fn splitmix(mut x: u64) -> u64 {
    x = x.wrapping_add(0x9E37_79B9_7F4A_7C15);
    x = (x ^ (x >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    x = (x ^ (x >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    x ^ (x >> 31)
}

#[derive(Clone, Debug)]
struct Exec {
    id: u64,
    partition: u32,
    shard: usize,
    next_seq: u64,
}

impl Exec {
    fn prefix(&self) -> [u8; 12] {
        let mut k = [0u8; 12];
        k[..4].copy_from_slice(&self.partition.to_be_bytes());
        k[4..].copy_from_slice(&self.id.to_be_bytes());
        k
    }
    fn event_key(&self, seq: u64) -> [u8; 20] {
        let mut k = [0u8; 20];
        k[..12].copy_from_slice(&self.prefix());
        k[12..].copy_from_slice(&seq.to_be_bytes());
        k
    }
}

/// Execution ids shaped like forkless's minted ids (time-ordered: ms << 22 | node | seq);
/// the partition is a hash of the id, the shard owns a subset of partitions.
fn make_execs(n: u64, shards: usize) -> Vec<Exec> {
    let base_ms: u64 = 60 * 86_400_000;
    (0..n)
        .map(|i| {
            let id = ((base_ms + i / 8) << 22) | (1 << 12) | (i % 8);
            let partition = (splitmix(id) % PARTITIONS) as u32;
            Exec {
                id,
                partition,
                shard: partition as usize % shards,
                next_seq: 0,
            }
        })
        .collect()
}

struct Append {
    ekey: [u8; 20],
    evalue: Vec<u8>,
    mkey: [u8; 12],
    mvalue: Vec<u8>,
}

/// ~300-byte event: recorded_at u64 | type len u8 | type | 256-byte JSON payload.
/// The payload is filled with pseudo-random characters so LZ4 in fjall cannot
/// shrink it much (conservative for fjall).
fn event_value(exec: &Exec, seq: u64, now: u64) -> Vec<u8> {
    let ty = EVENT_TYPES[(seq % 4) as usize].as_bytes();
    let mut v = Vec::with_capacity(8 + 1 + ty.len() + EVENT_PAYLOAD);
    v.extend_from_slice(&now.to_be_bytes());
    v.push(ty.len() as u8);
    v.extend_from_slice(ty);
    let head = format!("{{\"seq\":{seq},\"exec\":{},\"data\":\"", exec.id);
    let start = v.len();
    v.extend_from_slice(head.as_bytes());
    let mut r = splitmix(exec.id ^ seq.rotate_left(32));
    while v.len() - start < EVENT_PAYLOAD - 2 {
        r = splitmix(r);
        let b = r.to_le_bytes();
        for x in b {
            if v.len() - start >= EVENT_PAYLOAD - 2 {
                break;
            }
            v.push(
                b"ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789-_"
                    [(x & 63) as usize],
            );
        }
    }
    v.extend_from_slice(b"\"}");
    v
}

/// ~80-byte metadata: last_seq, status, created/updated timestamps, workflow type.
fn meta_value(exec: &Exec, last_seq: u64, now: u64) -> Vec<u8> {
    let mut v = Vec::with_capacity(META_LEN);
    v.extend_from_slice(&last_seq.to_be_bytes());
    v.push(1); // status: running
    v.extend_from_slice(&(exec.id >> 22).to_be_bytes()); // created_at (ms)
    v.extend_from_slice(&now.to_be_bytes()); // updated_at
    v.extend_from_slice(&0u64.to_be_bytes()); // deadline
    let wf = b"order-fulfilment-workflow/v3";
    v.push(wf.len() as u8);
    v.extend_from_slice(wf);
    v.resize(META_LEN, 0);
    v
}

// ---------------------------------------------------------------------------
// Engines

trait Shard: Send {
    /// One atomic, durable commit of all the appends.
    fn commit(&mut self, batch: &[Append]) -> Result<()>;
    /// The last `n` events of one execution (reverse prefix scan); returns how many.
    fn last_events(&self, exec: &Exec, n: usize) -> Result<usize>;
    /// Metadata point read.
    fn meta(&self, exec: &Exec) -> Result<bool>;
}

const EVENTS: redb::TableDefinition<&[u8], &[u8]> = redb::TableDefinition::new("events");
const EXECS: redb::TableDefinition<&[u8], &[u8]> = redb::TableDefinition::new("executions");

struct RedbShard {
    db: redb::Database,
}

impl RedbShard {
    fn open(path: &Path, cache: usize) -> Result<Self> {
        let db = redb::Builder::new().set_cache_size(cache).create(path)?;
        let tx = db.begin_write()?;
        {
            tx.open_table(EVENTS)?;
            tx.open_table(EXECS)?;
        }
        tx.commit()?;
        Ok(RedbShard { db })
    }
}

impl Shard for RedbShard {
    fn commit(&mut self, batch: &[Append]) -> Result<()> {
        let mut tx = self.db.begin_write()?;
        tx.set_durability(redb::Durability::Immediate)?;
        {
            let mut ev = tx.open_table(EVENTS)?;
            let mut ex = tx.open_table(EXECS)?;
            for a in batch {
                ev.insert(&a.ekey[..], &a.evalue[..])?;
                ex.insert(&a.mkey[..], &a.mvalue[..])?;
            }
        }
        tx.commit()?;
        Ok(())
    }

    fn last_events(&self, exec: &Exec, n: usize) -> Result<usize> {
        let rtx = self.db.begin_read()?;
        let t = rtx.open_table(EVENTS)?;
        let lo = exec.event_key(0);
        let hi = exec.event_key(u64::MAX);
        let mut got = 0;
        for r in t.range(&lo[..]..=&hi[..])?.rev().take(n) {
            let (_k, v) = r?;
            got += usize::from(!v.value().is_empty());
        }
        Ok(got)
    }

    fn meta(&self, exec: &Exec) -> Result<bool> {
        let rtx = self.db.begin_read()?;
        let t = rtx.open_table(EXECS)?;
        Ok(t.get(&exec.prefix()[..])?.is_some())
    }
}

struct FjallShard {
    db: fjall::Database,
    events: fjall::Keyspace,
    execs: fjall::Keyspace,
}

impl FjallShard {
    fn open(path: &Path, cache: usize, journal_mb: u64) -> Result<Self> {
        let mut b = fjall::Database::builder(path).cache_size(cache as u64);
        if journal_mb > 0 {
            b = b.max_journaling_size(journal_mb << 20);
        }
        let db = b.open()?;
        let events = db.keyspace("events", fjall::KeyspaceCreateOptions::default)?;
        let execs = db.keyspace("executions", fjall::KeyspaceCreateOptions::default)?;
        Ok(FjallShard { db, events, execs })
    }
}

impl Shard for FjallShard {
    fn commit(&mut self, batch: &[Append]) -> Result<()> {
        let mut b = self
            .db
            .batch()
            .durability(Some(fjall::PersistMode::SyncAll));
        for a in batch {
            b.insert(&self.events, &a.ekey[..], &a.evalue[..]);
            b.insert(&self.execs, &a.mkey[..], &a.mvalue[..]);
        }
        b.commit()?;
        Ok(())
    }

    fn last_events(&self, exec: &Exec, n: usize) -> Result<usize> {
        let mut got = 0;
        for g in self.events.prefix(exec.prefix()).rev().take(n) {
            got += usize::from(!g.value()?.is_empty());
        }
        Ok(got)
    }

    fn meta(&self, exec: &Exec) -> Result<bool> {
        Ok(self.execs.get(exec.prefix())?.is_some())
    }
}

fn shard_path(dir: &Path, engine: Engine, i: usize) -> PathBuf {
    match engine {
        Engine::Redb => dir.join(format!("shard-{i}.redb")),
        Engine::Fjall => dir.join(format!("shard-{i}")),
    }
}

fn open_shards(engine: Engine, dir: &Path, cfg: &Config) -> Result<Vec<Box<dyn Shard>>> {
    fs::create_dir_all(dir)?;
    (0..cfg.shards)
        .map(|i| -> Result<Box<dyn Shard>> {
            let p = shard_path(dir, engine, i);
            let cache = cfg.cache_mb << 20;
            Ok(match engine {
                Engine::Redb => Box::new(RedbShard::open(&p, cache)?),
                Engine::Fjall => Box::new(FjallShard::open(&p, cache, cfg.fjall_journal_mb)?),
            })
        })
        .collect()
}

// ---------------------------------------------------------------------------
// Measurement helpers

fn proc_write_bytes() -> u64 {
    fs::read_to_string("/proc/self/io")
        .ok()
        .and_then(|s| {
            s.lines()
                .find_map(|l| {
                    l.strip_prefix("write_bytes:")
                        .map(|v| v.trim().parse().ok())
                })
                .flatten()
        })
        .unwrap_or(0)
}

/// Allocated bytes on disk under `p` (st_blocks * 512).
fn dir_size(p: &Path) -> u64 {
    let Ok(md) = fs::symlink_metadata(p) else {
        return 0;
    };
    if md.is_dir() {
        fs::read_dir(p)
            .map(|rd| rd.flatten().map(|e| dir_size(&e.path())).sum())
            .unwrap_or(0)
    } else {
        md.blocks() * 512
    }
}

fn now_ms() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_millis() as u64)
        .unwrap_or(0)
}

fn mib(b: u64) -> f64 {
    b as f64 / (1024.0 * 1024.0)
}

#[derive(Default, Debug, Clone)]
struct WriteResult {
    appends: u64,
    commits: u64,
    secs: f64,
    final_rate: f64,
    payload_bytes: u64,
}

/// What one writer thread hands back: its shard, appends, commits, seconds,
/// final rate and payload bytes.
type ThreadOut = (Box<dyn Shard>, u64, u64, f64, f64, u64);

/// Each shard gets one writer thread that walks its executions round-robin and commits
/// `group` appends per durable commit, until `total` appends (across shards) or `limit`.
fn run_writes(
    shards: Vec<Box<dyn Shard>>,
    execs: &[Exec],
    group: usize,
    total: u64,
    limit: Duration,
) -> Result<(Vec<Box<dyn Shard>>, WriteResult)> {
    let n = shards.len();
    let share = total.div_ceil(n as u64);
    let results: Vec<Result<ThreadOut>> = std::thread::scope(|s| {
        let handles: Vec<_> = shards
            .into_iter()
            .enumerate()
            .map(|(i, mut shard)| {
                let mut mine: Vec<Exec> = execs.iter().filter(|e| e.shard == i).cloned().collect();
                s.spawn(move || -> Result<ThreadOut> {
                    if mine.is_empty() {
                        return Ok((shard, 0, 0, 0.0, 0.0, 0));
                    }
                    let start = Instant::now();
                    let mut marks: Vec<(f64, u64)> = Vec::new();
                    let (mut done, mut commits, mut payload) = (0u64, 0u64, 0u64);
                    let mut rr = 0usize;
                    let len = mine.len();
                    let mut batch: Vec<Append> = Vec::with_capacity(group);
                    while done < share && start.elapsed() < limit {
                        batch.clear();
                        let now = now_ms();
                        for _ in 0..group.min((share - done) as usize) {
                            let e = &mut mine[rr % len];
                            rr += 1;
                            let seq = e.next_seq;
                            e.next_seq += 1;
                            let a = Append {
                                ekey: e.event_key(seq),
                                evalue: event_value(e, seq, now),
                                mkey: e.prefix(),
                                mvalue: meta_value(e, seq, now),
                            };
                            payload +=
                                (a.ekey.len() + a.evalue.len() + a.mkey.len() + a.mvalue.len())
                                    as u64;
                            batch.push(a);
                        }
                        shard.commit(&batch)?;
                        done += batch.len() as u64;
                        commits += 1;
                        marks.push((start.elapsed().as_secs_f64(), done));
                    }
                    let secs = start.elapsed().as_secs_f64();
                    // Rate over the last 20% of this thread's commits.
                    let final_rate = if marks.len() >= 5 {
                        let (t0, a0) = marks[marks.len() - marks.len() / 5 - 1];
                        let (t1, a1) = marks[marks.len() - 1];
                        (a1 - a0) as f64 / (t1 - t0).max(1e-9)
                    } else {
                        done as f64 / secs.max(1e-9)
                    };
                    Ok((shard, done, commits, secs, final_rate, payload))
                })
            })
            .collect();
        handles
            .into_iter()
            .map(|h| {
                h.join()
                    .unwrap_or_else(|_| Err("writer thread panicked".into()))
            })
            .collect()
    });
    let mut out = Vec::with_capacity(n);
    let mut r = WriteResult::default();
    for res in results {
        let (shard, done, commits, secs, final_rate, payload) = res?;
        out.push(shard);
        r.appends += done;
        r.commits += commits;
        r.secs = r.secs.max(secs);
        r.final_rate += final_rate;
        r.payload_bytes += payload;
    }
    Ok((out, r))
}

fn run_reads(shards: &[Box<dyn Shard>], execs: &[Exec], secs: f64) -> Result<(f64, f64)> {
    let pick = |i: u64| &execs[(splitmix(i ^ 0xABCD) % execs.len() as u64) as usize];
    let limit = Duration::from_secs_f64(secs);
    // last 10 events of random executions, in rounds of 1,000
    let start = Instant::now();
    let mut ops = 0u64;
    while start.elapsed() < limit {
        for _ in 0..1000 {
            let e = pick(ops);
            let got = shards[e.shard].last_events(e, 10)?;
            if got == 0 {
                return Err(format!("no events read for execution {}", e.id).into());
            }
            ops += 1;
        }
    }
    let scan_rate = ops as f64 / start.elapsed().as_secs_f64();
    let start = Instant::now();
    let mut ops = 0u64;
    while start.elapsed() < limit {
        for _ in 0..1000 {
            let e = pick(ops);
            if !shards[e.shard].meta(e)? {
                return Err(format!("metadata of execution {} missing", e.id).into());
            }
            ops += 1;
        }
    }
    Ok((scan_rate, ops as f64 / start.elapsed().as_secs_f64()))
}

// ---------------------------------------------------------------------------
// Cases

fn case_disk(cfg: &Config) -> Result<()> {
    use std::os::unix::fs::FileExt;
    fs::create_dir_all(&cfg.root)?;
    let path = cfg.root.join("disk-probe");
    for overwrite in [false, true] {
        let _ = fs::remove_file(&path);
        let f: File = OpenOptions::new()
            .create(true)
            .truncate(true)
            .read(true)
            .write(true)
            .open(&path)?;
        if overwrite {
            // Preallocate and sync so each write changes no file metadata.
            f.write_all_at(&[0u8; 4096], 0)?;
            f.sync_all()?;
        }
        let buf = [b'x'; 256];
        let mut lat = Vec::new();
        let mut off = 0u64;
        let start = Instant::now();
        while start.elapsed() < Duration::from_secs(3) {
            let t = Instant::now();
            f.write_all_at(&buf, if overwrite { 0 } else { off })?;
            off += 256;
            f.sync_data()?;
            lat.push(t.elapsed());
        }
        let secs = start.elapsed().as_secs_f64();
        drop(f);
        lat.sort();
        let p =
            |q: f64| lat[((lat.len() as f64 * q) as usize).min(lat.len() - 1)].as_secs_f64() * 1e3;
        println!(
            "| disk | 256 B {} + fdatasync, 1 thread, 3 s | {:.0} ops/s | p50 {:.3} ms, p99 {:.3} ms |",
            if overwrite { "overwrite in place" } else { "append (file grows)" },
            lat.len() as f64 / secs,
            p(0.5),
            p(0.99)
        );
    }
    fs::remove_file(&path)?;
    Ok(())
}

fn case_scattered(cfg: &Config, engine: Engine) -> Result<()> {
    for &group in &cfg.groups {
        let dir = cfg
            .root
            .join(format!("{}-scattered-{group}", engine.name()));
        let _ = fs::remove_dir_all(&dir);
        let wb0 = proc_write_bytes();
        let shards = open_shards(engine, &dir, cfg)?;
        let execs = make_execs(cfg.executions, cfg.shards);
        let (shards, r) = run_writes(
            shards,
            &execs,
            group,
            u64::MAX / 2,
            Duration::from_secs_f64(cfg.case_secs),
        )?;
        drop(shards);
        let wb = proc_write_bytes() - wb0;
        let size = dir_size(&dir);
        fs::remove_dir_all(&dir)?;
        println!(
            "| {} | scattered, {} execs, {} per commit | {:.0} appends/s | {:.0} commits/s | {} appends in {:.1} s | {:.1} KiB written/commit | write amp {:.1}x | dir {:.1} MiB |",
            engine.name(),
            cfg.executions,
            group,
            r.appends as f64 / r.secs,
            r.commits as f64 / r.secs,
            r.appends,
            r.secs,
            wb as f64 / 1024.0 / r.commits.max(1) as f64,
            wb as f64 / r.payload_bytes.max(1) as f64,
            mib(size),
        );
    }
    Ok(())
}

/// Child process: fill the steady-state database, print one RESULT line, then exit
/// without closing anything (a process crash, as far as the engines can tell).
fn steady_child(cfg: &Config, engine: Engine, dir: &Path) -> Result<()> {
    let wb0 = proc_write_bytes();
    let shards = open_shards(engine, dir, cfg)?;
    let execs = make_execs(cfg.executions, cfg.shards);
    let (shards, r) = run_writes(
        shards,
        &execs,
        cfg.steady_group,
        cfg.steady_appends,
        Duration::from_secs_f64(cfg.steady_secs),
    )?;
    let wb = proc_write_bytes() - wb0;
    println!(
        "RESULT {} {} {} {} {} {}",
        r.appends, r.commits, r.secs, r.final_rate, wb, r.payload_bytes
    );
    std::io::stdout().flush()?;
    std::mem::forget(shards);
    std::process::exit(0);
}

fn case_steady(cfg: &Config, engine: Engine, args: &[String]) -> Result<()> {
    let dir = cfg.root.join(format!("{}-steady", engine.name()));
    let _ = fs::remove_dir_all(&dir);
    let out = Command::new(std::env::current_exe()?)
        .arg("__steady-child")
        .arg(engine.name())
        .arg(&dir)
        .args(args)
        .output()?;
    if !out.status.success() {
        return Err(format!(
            "steady child failed: {}",
            String::from_utf8_lossy(&out.stderr)
        )
        .into());
    }
    let stdout = String::from_utf8_lossy(&out.stdout);
    let line = stdout
        .lines()
        .find_map(|l| l.strip_prefix("RESULT "))
        .ok_or("no RESULT from steady child")?;
    let f: Vec<f64> = line
        .split_whitespace()
        .map(str::parse)
        .collect::<std::result::Result<_, _>>()?;
    let (appends, commits, secs, final_rate, wb, payload) = (f[0], f[1], f[2], f[3], f[4], f[5]);
    let size_crash = dir_size(&dir);

    // Case 4a: reopen after the crash (redb repairs, fjall replays its journal).
    let t = Instant::now();
    let shards = open_shards(engine, &dir, cfg)?;
    let reopen_crash = t.elapsed();

    // Case 3: read path.
    let execs = make_execs(cfg.executions, cfg.shards);
    let (scan, point) = run_reads(&shards, &execs, cfg.read_secs)?;

    // Case 4b: clean close and reopen.
    let t = Instant::now();
    drop(shards);
    let close = t.elapsed();
    let size_closed = dir_size(&dir);
    let t = Instant::now();
    let shards = open_shards(engine, &dir, cfg)?;
    let reopen_clean = t.elapsed();
    drop(shards);
    fs::remove_dir_all(&dir)?;

    println!(
        "| {} | steady, {} execs, {} per commit | {:.0} appends in {:.1} s: {:.0} appends/s overall, {:.0}/s final (last 20% of commits) | {:.0} commits/s | write amp {:.1}x | dir {:.1} MiB ({:.1} MiB after clean close) |",
        engine.name(),
        cfg.executions,
        cfg.steady_group,
        appends,
        secs,
        appends / secs,
        final_rate,
        commits / secs,
        wb / payload.max(1.0),
        mib(size_crash),
        mib(size_closed),
    );
    println!(
        "| {} | read path after steady | last 10 events (reverse prefix scan): {:.0} ops/s | metadata point read: {:.0} ops/s |",
        engine.name(),
        scan,
        point
    );
    println!(
        "| {} | reopen | after crash: {:.1} ms | clean close: {:.1} ms, then reopen: {:.1} ms |",
        engine.name(),
        reopen_crash.as_secs_f64() * 1e3,
        close.as_secs_f64() * 1e3,
        reopen_clean.as_secs_f64() * 1e3,
    );
    Ok(())
}

fn main() -> Result<()> {
    let args: Vec<String> = std::env::args().skip(1).collect();
    if args.first().map(String::as_str) == Some("__steady-child") {
        let engine = Engine::parse(args.get(1).ok_or("engine")?).ok_or("engine")?;
        let dir = PathBuf::from(args.get(2).ok_or("dir")?);
        let cfg = parse_args(&args[3..])?;
        return steady_child(&cfg, engine, &dir);
    }
    let cfg = parse_args(&args)?;
    if cfg.steady_appends < 10 * cfg.executions {
        return Err("--steady-appends must be at least 10 x --executions".into());
    }
    fs::create_dir_all(&cfg.root)?;
    println!(
        "# forkless-storebench: {} shard(s), one writer thread per shard, {} executions, cache {} MiB/shard, fjall journal {}",
        cfg.shards,
        cfg.executions,
        cfg.cache_mb,
        if cfg.fjall_journal_mb == 0 { "default (512 MiB)".to_string() } else { format!("{} MiB", cfg.fjall_journal_mb) }
    );
    let run = |cfg: &Config| -> Result<()> {
        for case in &cfg.cases {
            match case.as_str() {
                "disk" => case_disk(cfg)?,
                "scattered" => {
                    for &e in &cfg.engines {
                        case_scattered(cfg, e)?;
                    }
                }
                "steady" => {
                    for &e in &cfg.engines {
                        case_steady(cfg, e, &args)?;
                    }
                }
                other => return Err(format!("unknown case {other}").into()),
            }
        }
        Ok(())
    };
    let res = run(&cfg);
    let _ = fs::remove_dir_all(&cfg.root);
    res
}
