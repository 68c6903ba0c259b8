//! Start-up: what a node refuses to start on, and when it says it is ready.
//! Real `forkless` processes on loopback.

use forkless_it::*;
use std::time::Duration;

/// A cluster file for two nodes on free ports with `secret`, written into
/// `dir`; returns its path.
fn two_node_config(dir: &std::path::Path, secret: &str) -> String {
    let p = free_ports(4);
    let text = format!(
        "shard_count = 2\nsecret = {secret}\n\n[[nodes]]\nid = 1\napi_addr = \"127.0.0.1:{}\"\npeer_addr = \"127.0.0.1:{}\"\n\n[[nodes]]\nid = 2\napi_addr = \"127.0.0.1:{}\"\npeer_addr = \"127.0.0.1:{}\"\n",
        p[0], p[1], p[2], p[3]
    );
    let path = dir.join("cluster.toml");
    std::fs::write(&path, text).expect("write config");
    path.display().to_string()
}

/// A secret with whitespace at either end, or a control character, does
/// not survive being sent as a header (a peer would refuse every forward):
/// `forkless serve` refuses to start on it, naming the field and why.
#[test]
fn a_secret_with_outer_whitespace_or_control_characters_is_refused_at_start() {
    let _d = deadline("a_secret_is_refused_at_start", TEST_DEADLINE);
    let dir = tempfile::tempdir().expect("tempdir");
    let data = dir.path().join("data").display().to_string();
    for (toml_secret, why) in [
        (r#""0123456789abcdef ""#, "leading or trailing whitespace"),
        (r#""\t0123456789abcdef""#, "leading or trailing whitespace"),
        (r#""0123456789\u0001abcdef""#, "control character"),
    ] {
        let cfg = two_node_config(dir.path(), toml_secret);
        let (code, _out, err) = run_cli(
            &[
                "serve",
                "--config",
                &cfg,
                "--node",
                "1",
                "--data-dir",
                &data,
            ],
            Duration::from_secs(20),
        );
        assert!(
            code.is_some_and(|c| c != 0),
            "secret {toml_secret} started a node (exit {code:?}); stderr: {err}"
        );
        assert!(err.contains("secret"), "{toml_secret}: stderr: {err}");
        assert!(err.contains(why), "{toml_secret}: stderr: {err}");
    }
}
