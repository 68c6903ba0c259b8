//! The results file (one JSON object per line, one line per measured point)
//! and the markdown section made from it.

use std::collections::BTreeMap;
use std::io::Write;
use std::path::Path;

use anyhow::Context;
use forkless_loadgen::Report;
use serde::{Deserialize, Serialize};

use crate::probe::Probe;

/// One measured point.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct Point {
    /// Display label, e.g. `redis (appendfsync always)`; one line per label
    /// in the chart.
    pub label: String,
    /// False for configurations that acknowledge before fsync.
    pub durable: bool,
    /// Seconds since the Unix epoch when the point finished.
    pub unix_time: u64,
    /// The disk probe taken right before the point.
    pub probe: Option<Probe>,
    /// The probe showed a slow spell.
    pub slow_probe: bool,
    /// Other processes used more CPU than allowed during the measured window.
    #[serde(default)]
    pub busy_machine: bool,
    /// Version of the system measured, as the caller knew it.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub server_version: Option<String>,
    /// This point is a rerun of one taken in a slow spell or on a busy machine.
    pub rerun: bool,
    /// The sitting (one `bench/compare` invocation, named by its start in
    /// Unix seconds) the point belongs to; its rounds are summarised
    /// together.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub sitting: Option<u64>,
    pub report: Report,
}

impl Point {
    /// Taken with a normal disk and no competing load.
    pub fn is_clean(&self) -> bool {
        !self.slow_probe && !self.busy_machine
    }
}

/// Appends one point to the results file.
pub fn append(path: &Path, point: &Point) -> anyhow::Result<()> {
    let mut f = std::fs::OpenOptions::new()
        .create(true)
        .append(true)
        .open(path)
        .with_context(|| format!("opening {}", path.display()))?;
    let mut line = serde_json::to_string(point)?;
    line.push('\n');
    f.write_all(line.as_bytes())?;
    Ok(())
}

/// Reads every point of a results file (JSON lines, or one JSON array).
pub fn load(path: &Path) -> anyhow::Result<Vec<Point>> {
    let text =
        std::fs::read_to_string(path).with_context(|| format!("reading {}", path.display()))?;
    if text.trim_start().starts_with('[') {
        return Ok(serde_json::from_str(&text)?);
    }
    text.lines()
        .filter(|l| !l.trim().is_empty())
        .enumerate()
        .map(|(i, l)| {
            serde_json::from_str(l).with_context(|| format!("{} line {}", path.display(), i + 1))
        })
        .collect()
}

/// One row of the table: the run shown, and how many runs it stands for.
#[derive(Debug, Clone)]
pub struct Row {
    /// The median run (by events/s; the lower one of the middle two).
    pub point: Point,
    /// Runs it was chosen from.
    pub runs: usize,
    /// Lowest and highest events/s among those runs.
    pub min_events_per_s: f64,
    pub max_events_per_s: f64,
}

/// The rows that count: for each (label, clients), the runs of the latest
/// sitting that measured it (a point without a sitting is a sitting of its
/// own), only the clean ones (probe not slow, machine not busy) if any is
/// clean; shown is their median run by events/s. In first-seen label order
/// and ascending client count.
pub fn rows(points: &[Point]) -> Vec<(String, Vec<Row>)> {
    let mut order: Vec<String> = Vec::new();
    // (label index, clients) -> the latest sitting's points, in file order.
    let mut by: BTreeMap<(usize, usize), Vec<Point>> = BTreeMap::new();
    for p in points {
        let li = match order.iter().position(|l| *l == p.label) {
            Some(i) => i,
            None => {
                order.push(p.label.clone());
                order.len() - 1
            }
        };
        let runs = by.entry((li, p.report.clients)).or_default();
        let same_sitting =
            p.sitting.is_some() && runs.last().is_some_and(|last| last.sitting == p.sitting);
        if !same_sitting {
            runs.clear();
        }
        runs.push(p.clone());
    }
    order
        .iter()
        .enumerate()
        .map(|(li, label)| {
            let rows = by
                .range((li, 0)..(li, usize::MAX))
                .filter_map(|(_, runs)| row_of(runs))
                .collect();
            (label.clone(), rows)
        })
        .collect()
}

fn row_of(runs: &[Point]) -> Option<Row> {
    let clean: Vec<&Point> = runs.iter().filter(|p| p.is_clean()).collect();
    let mut pick: Vec<&Point> = if clean.is_empty() {
        runs.iter().collect()
    } else {
        clean
    };
    pick.sort_by(|a, b| a.report.events_per_s.total_cmp(&b.report.events_per_s));
    let first = pick.first()?;
    let last = pick.last()?;
    Some(Row {
        point: (*pick.get((pick.len() - 1) / 2)?).clone(),
        runs: pick.len(),
        min_events_per_s: first.report.events_per_s,
        max_events_per_s: last.report.events_per_s,
    })
}

/// The run shown for each (label, clients): see [`rows`].
pub fn latest(points: &[Point]) -> Vec<(String, Vec<Point>)> {
    rows(points)
        .into_iter()
        .map(|(l, rows)| (l, rows.into_iter().map(|r| r.point).collect()))
        .collect()
}

fn opt(v: Option<f64>) -> String {
    v.map_or_else(|| "n/a".into(), |v| format!("{v:.0}%"))
}

fn thousands(v: f64) -> String {
    let n = v.round() as u64;
    let s = n.to_string();
    let mut out = String::new();
    for (i, c) in s.chars().enumerate() {
        if i > 0 && (s.len() - i).is_multiple_of(3) {
            out.push(',');
        }
        out.push(c);
    }
    out
}

/// The markdown results table.
pub fn table(points: &[Point]) -> String {
    let mut s = String::from(
        "| system | C | events/s | runs (events/s range) | p50 ms | p99 ms | p99.9 ms | errors | server CPU | loadgen CPU | other CPU | disk probe fsyncs/s |\n\
         | --- | --: | --: | --: | --: | --: | --: | --: | --: | --: | --: | --: |\n",
    );
    for (label, rows) in rows(points) {
        for row in rows {
            let p = &row.point;
            let r = &p.report;
            let runs = if row.runs > 1 {
                format!(
                    "{} ({}-{})",
                    row.runs,
                    thousands(row.min_events_per_s),
                    thousands(row.max_events_per_s)
                )
            } else {
                "1".to_string()
            };
            let probe = p.probe.as_ref().map_or_else(
                || "n/a".to_string(),
                |pr| {
                    let mut t = thousands(pr.fsync_per_s);
                    if p.slow_probe {
                        t.push_str(" (slow)");
                    }
                    if p.busy_machine {
                        t.push_str(" (busy)");
                    }
                    if p.rerun {
                        t.push_str(" (rerun)");
                    }
                    t
                },
            );
            s.push_str(&format!(
                "| {} | {} | {} | {} | {:.2} | {:.2} | {:.2} | {} | {} | {} | {} | {} |\n",
                label,
                r.clients,
                thousands(r.events_per_s),
                runs,
                r.p50_ms,
                r.p99_ms,
                r.p999_ms,
                r.errors,
                opt(r.server_cpu_pct),
                opt(r.loadgen_cpu_pct),
                opt(r.other_cpu_pct()),
                probe
            ));
        }
    }
    s
}

/// Replaces the text between the markers `<!-- {name}:begin -->` and
/// `<!-- {name}:end -->` in `doc` with `section`, or appends a marked
/// section if the markers are absent (bench/compare's is `compare`, its
/// `--replicated` one `compare-replicated`). Everything outside the
/// markers is kept byte for byte.
pub fn splice_named(doc: &str, name: &str, section: &str) -> String {
    let (begin, end) = (
        format!("<!-- {name}:begin -->"),
        format!("<!-- {name}:end -->"),
    );
    let block = format!("{begin}\n{}\n{end}", section.trim_end());
    match (doc.find(&begin), doc.find(&end)) {
        (Some(b), Some(e)) if e > b => {
            format!("{}{}{}", &doc[..b], block, &doc[e + end.len()..])
        }
        _ => {
            let mut out = doc.to_string();
            if !out.is_empty() && !out.ends_with('\n') {
                out.push('\n');
            }
            if !out.is_empty() {
                out.push('\n');
            }
            out.push_str(&block);
            out.push('\n');
            out
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const BEGIN_MARKER: &str = "<!-- compare:begin -->";
    const END_MARKER: &str = "<!-- compare:end -->";

    fn splice(doc: &str, section: &str) -> String {
        splice_named(doc, "compare", section)
    }

    #[test]
    fn splice_keeps_outside_text() {
        let doc = format!("# B\n\nintro\n{BEGIN_MARKER}\nold\n{END_MARKER}\ntail\n");
        let out = splice(&doc, "new table\n");
        assert_eq!(
            out,
            format!("# B\n\nintro\n{BEGIN_MARKER}\nnew table\n{END_MARKER}\ntail\n")
        );
        let again = splice(&out, "newer");
        assert!(
            again.contains("newer") && !again.contains("new table") && again.ends_with("tail\n")
        );
    }

    #[test]
    fn a_named_section_leaves_the_others_alone() {
        let doc = format!("{BEGIN_MARKER}\na\n{END_MARKER}\n");
        let out = splice_named(&doc, "compare-replicated", "b");
        assert_eq!(
            out,
            format!("{BEGIN_MARKER}\na\n{END_MARKER}\n\n<!-- compare-replicated:begin -->\nb\n<!-- compare-replicated:end -->\n")
        );
        let again = splice_named(&out, "compare-replicated", "c");
        assert!(again.starts_with(&doc) && again.contains("\nc\n") && !again.contains("\nb\n"));
        assert_eq!(splice(&again, "z").matches("\nz\n").count(), 1);
    }

    #[test]
    fn splice_appends_when_markers_missing() {
        let out = splice("# Benchmarks\n", "t");
        assert_eq!(
            out,
            format!("# Benchmarks\n\n{BEGIN_MARKER}\nt\n{END_MARKER}\n")
        );
        let out = splice("", "t");
        assert_eq!(out, format!("{BEGIN_MARKER}\nt\n{END_MARKER}\n"));
    }

    fn point(label: &str, clients: usize, rate: f64, slow: bool, busy: bool) -> Point {
        serde_json::from_value(serde_json::json!({
            "label": label, "durable": true, "unix_time": 0, "probe": null,
            "slow_probe": slow, "busy_machine": busy, "rerun": false,
            "report": {
                "target": "t", "clients": clients, "keys": 1000, "payload_bytes": 256,
                "warmup_s": 1.0, "duration_s": 1.0, "events": 1, "events_per_s": rate,
                "p50_ms": 1.0, "p90_ms": 1.0, "p99_ms": 1.0, "p999_ms": 1.0, "max_ms": 1.0,
                "errors": 0, "error_kinds": {}, "error_samples": [], "retired_keys": 0,
                "total_appends": 1, "loadgen_cpu_pct": null, "server_cpu_pct": null
            }
        }))
        .expect("point")
    }

    fn in_sitting(mut p: Point, sitting: u64) -> Point {
        p.sitting = Some(sitting);
        p
    }

    fn shown(pts: &[Point]) -> Vec<(String, Vec<(f64, usize)>)> {
        rows(pts)
            .into_iter()
            .map(|(l, rows)| {
                (
                    l,
                    rows.iter()
                        .map(|r| (r.point.report.events_per_s, r.runs))
                        .collect(),
                )
            })
            .collect()
    }

    #[test]
    fn a_sitting_shows_the_median_of_its_clean_runs() {
        let pts = vec![
            in_sitting(point("a", 1, 10.0, false, false), 1),
            in_sitting(point("a", 16, 20.0, true, false), 1),
            in_sitting(point("b", 1, 30.0, false, false), 1),
            in_sitting(point("a", 1, 14.0, false, false), 1),
            in_sitting(point("a", 1, 99.0, false, true), 1), // busy: left out
            in_sitting(point("a", 1, 12.0, false, false), 1),
            in_sitting(point("a", 16, 21.0, false, true), 1), // none clean: all count
        ];
        assert_eq!(
            shown(&pts),
            vec![
                ("a".to_string(), vec![(12.0, 3), (20.0, 2)]),
                ("b".to_string(), vec![(30.0, 1)])
            ]
        );
        // An even count shows the lower of the middle two.
        let pts = vec![
            in_sitting(point("a", 1, 13.0, false, false), 1),
            in_sitting(point("a", 1, 11.0, false, false), 1),
        ];
        assert_eq!(shown(&pts), vec![("a".to_string(), vec![(11.0, 2)])]);
    }

    #[test]
    fn a_later_sitting_replaces_an_earlier_one_point_by_point() {
        let pts = vec![
            in_sitting(point("a", 1, 10.0, false, false), 1),
            in_sitting(point("a", 16, 20.0, false, false), 1),
            in_sitting(point("a", 1, 11.0, false, false), 1),
            in_sitting(point("a", 1, 50.0, false, false), 2),
            // Points without a sitting are a sitting each.
            point("b", 1, 30.0, false, false),
            point("b", 1, 31.0, false, true),
        ];
        let r = rows(&pts);
        assert_eq!(
            shown(&pts),
            vec![
                ("a".to_string(), vec![(50.0, 1), (20.0, 1)]),
                ("b".to_string(), vec![(31.0, 1)])
            ]
        );
        assert_eq!(r[0].1[0].min_events_per_s, 50.0);
    }

    #[test]
    fn the_table_names_the_runs_and_their_range() {
        let pts = vec![
            in_sitting(point("a", 64, 61_000.0, false, false), 7),
            in_sitting(point("a", 64, 72_500.0, false, false), 7),
            in_sitting(point("a", 64, 66_000.0, false, false), 7),
        ];
        let t = table(&pts);
        assert!(t.contains("| a | 64 | 66,000 | 3 (61,000-72,500) |"), "{t}");
    }

    #[test]
    fn thousands_separators() {
        assert_eq!(thousands(0.0), "0");
        assert_eq!(thousands(999.4), "999");
        assert_eq!(thousands(1234.0), "1,234");
        assert_eq!(thousands(1234567.0), "1,234,567");
    }
}
