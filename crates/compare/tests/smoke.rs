//! Smoke test of the binary with no external server: the disk probe, the
//! markdown report spliced between the markers, and the chart (when a
//! TrueType font is installed).

use std::process::Command;

fn bin() -> Command {
    Command::new(env!("CARGO_BIN_EXE_forkless-compare"))
}

fn point(label: &str, clients: usize, rate: f64, p99: f64) -> String {
    serde_json::json!({
        "label": label, "durable": true, "unix_time": 0, "probe": null,
        "slow_probe": false, "rerun": false,
        "report": {
            "target": "memory", "clients": clients, "keys": 1000, "payload_bytes": 256,
            "warmup_s": 1.0, "duration_s": 3.0, "events": (rate * 3.0) as u64,
            "events_per_s": rate, "p50_ms": p99 / 3.0, "p90_ms": p99 / 2.0, "p99_ms": p99,
            "p999_ms": p99 * 2.0, "max_ms": p99 * 3.0, "errors": 0, "error_kinds": {},
            "error_samples": [], "retired_keys": 0, "total_appends": (rate * 4.0) as u64,
            "loadgen_cpu_pct": 20.0, "server_cpu_pct": 80.0
        }
    })
    .to_string()
}

#[test]
fn probe_report_and_chart() {
    let dir = tempfile::tempdir().expect("tempdir");

    let out = bin()
        .args(["disk-probe", "--seconds", "200ms", "--json", "--dir"])
        .arg(dir.path())
        .output()
        .expect("run disk-probe");
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let probe: serde_json::Value = serde_json::from_slice(&out.stdout).expect("probe json");
    assert!(probe["fsync_per_s"].as_f64().unwrap_or(0.0) > 0.0);

    let results = dir.path().join("r.jsonl");
    let lines = [
        point("a", 1, 1000.0, 0.5),
        point("a", 16, 9000.0, 2.0),
        point("b", 1, 800.0, 0.9),
        point("b", 16, 3000.0, 11.0),
        point("a", 16, 9500.0, 1.9), // a rerun supersedes the earlier point
    ];
    std::fs::write(&results, lines.join("\n")).expect("write results");

    let md = dir.path().join("B.md");
    std::fs::write(&md, "# Benchmarks\n\nkeep me\n").expect("write md");
    let out = bin()
        .args(["report", "--results"])
        .arg(&results)
        .arg("--insert-into")
        .arg(&md)
        .output()
        .expect("run report");
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let text = std::fs::read_to_string(&md).expect("read md");
    assert!(text.starts_with("# Benchmarks\n\nkeep me\n"));
    assert!(text.contains("<!-- compare:begin -->") && text.contains("<!-- compare:end -->"));
    assert!(text.contains("| a | 16 | 9,500 |"), "{text}");
    assert!(!text.contains("9,000"));

    let font_installed = [
        "/usr/share/fonts/truetype/dejavu/DejaVuSans.ttf",
        "/usr/share/fonts/truetype/liberation/LiberationSans-Regular.ttf",
    ]
    .iter()
    .any(|p| std::path::Path::new(p).exists());
    if font_installed {
        let png = dir.path().join("c.png");
        let out = bin()
            .args(["chart", "--results"])
            .arg(&results)
            .arg("--out")
            .arg(&png)
            .output()
            .expect("run chart");
        assert!(
            out.status.success(),
            "{}",
            String::from_utf8_lossy(&out.stderr)
        );
        let bytes = std::fs::read(&png).expect("read png");
        assert!(bytes.starts_with(b"\x89PNG"));
    }
}
