//! CPU time of processes from `/proc/<pid>/stat` (Linux only; elsewhere the
//! readings are absent).

use std::collections::HashMap;

/// Kernel clock ticks per second for `/proc` times. `sysconf(_SC_CLK_TCK)`
/// is 100 on every Linux configuration this runs on.
const CLK_TCK: f64 = 100.0;

/// CPU seconds (user + system) used so far by this process (and any
/// children it reaped).
pub fn self_cpu_seconds() -> Option<f64> {
    let text = std::fs::read_to_string("/proc/self/stat").ok()?;
    parse_stat(&text).map(|s| s.cpu_ticks as f64 / CLK_TCK)
}

/// Busy CPU seconds of the whole machine so far, summed over all cores
/// (from the `cpu` line of `/proc/stat`: everything but idle and iowait).
pub fn machine_busy_seconds() -> Option<f64> {
    let text = std::fs::read_to_string("/proc/stat").ok()?;
    parse_machine(&text).map(|t| t as f64 / CLK_TCK)
}

fn parse_machine(text: &str) -> Option<u64> {
    let line = text.lines().find(|l| l.starts_with("cpu "))?;
    let v: Vec<u64> = line
        .split_whitespace()
        .skip(1)
        .map(|f| f.parse().ok())
        .collect::<Option<_>>()?;
    // user nice system idle iowait irq softirq steal [guest guest_nice],
    // guest time being already counted in user.
    let busy = v.get(0..8)?.iter().sum::<u64>() - v.get(3)? - v.get(4)?;
    Some(busy)
}

/// CPU seconds (user + system) used so far by `pid` and all its
/// descendants: the live ones, and (through each process's `cutime` and
/// `cstime`) the ones that have exited and been reaped. A server such as
/// PostgreSQL forks one process per connection and short-lived workers.
pub fn tree_cpu_seconds(pid: u32) -> Option<f64> {
    let mut all: HashMap<u32, Stat> = HashMap::new();
    let dir = std::fs::read_dir("/proc").ok()?;
    for entry in dir.flatten() {
        let Some(p) = entry
            .file_name()
            .to_str()
            .and_then(|s| s.parse::<u32>().ok())
        else {
            continue;
        };
        if let Ok(text) = std::fs::read_to_string(format!("/proc/{p}/stat")) {
            if let Some(s) = parse_stat(&text) {
                all.insert(p, s);
            }
        }
    }
    all.get(&pid)?;
    let mut total = 0u64;
    let mut stack = vec![pid];
    while let Some(p) = stack.pop() {
        if let Some(s) = all.get(&p) {
            total += s.cpu_ticks;
        }
        stack.extend(all.iter().filter(|(_, s)| s.ppid == p).map(|(c, _)| *c));
    }
    Some(total as f64 / CLK_TCK)
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct Stat {
    ppid: u32,
    cpu_ticks: u64,
}

/// Parses `/proc/<pid>/stat`: fields after the parenthesised command name
/// (which may itself contain spaces and parentheses).
fn parse_stat(text: &str) -> Option<Stat> {
    let rest = &text[text.rfind(')')? + 1..];
    let fields: Vec<&str> = rest.split_whitespace().collect();
    // rest[0] is field 3 (state); ppid is field 4, utime 14, stime 15,
    // cutime 16, cstime 17 (reaped children).
    let ppid = fields.get(1)?.parse().ok()?;
    let mut ticks = 0u64;
    for i in 11..=14 {
        // cutime and cstime are signed in the kernel's format; never negative in practice.
        let v: i64 = fields.get(i)?.parse().ok()?;
        ticks += v.max(0) as u64;
    }
    Some(Stat {
        ppid,
        cpu_ticks: ticks,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_stat_with_odd_command_name() {
        let line = "1234 (a (b) c) S 77 1234 1234 0 -1 4194560 100 0 0 0 250 50 7 3 20 0 4 0 1 1 1";
        assert_eq!(
            parse_stat(line),
            Some(Stat {
                ppid: 77,
                cpu_ticks: 310
            })
        );
    }

    #[test]
    fn parses_machine_busy() {
        let text = "cpu  100 5 50 1000 20 3 2 1 0 0\ncpu0 50 0 0 0 0 0 0 0 0 0\n";
        assert_eq!(parse_machine(text), Some(161));
    }

    #[test]
    fn reads_own_process() {
        if cfg!(target_os = "linux") {
            assert!(self_cpu_seconds().is_some());
            assert!(machine_busy_seconds().is_some());
            assert!(tree_cpu_seconds(std::process::id()).is_some());
        }
    }
}
