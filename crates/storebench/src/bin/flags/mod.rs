//! Command-line flags shared by the storebench binaries (`--flag value`
//! pairs, `-h`/`--help`).

use std::fmt::Display;
use std::str::FromStr;

pub type Result<T> = std::result::Result<T, Box<dyn std::error::Error + Send + Sync>>;

/// The arguments as `(flag, value)` pairs; `-h` or `--help` prints `usage`
/// and exits.
pub fn pairs(usage: &str) -> Result<Vec<(String, String)>> {
    let mut out = Vec::new();
    let mut it = std::env::args().skip(1);
    while let Some(flag) = it.next() {
        if flag == "-h" || flag == "--help" {
            println!("{usage}");
            std::process::exit(0);
        }
        let value = it
            .next()
            .ok_or_else(|| format!("{flag}: a value is needed"))?;
        out.push((flag, value));
    }
    Ok(out)
}

/// `value` parsed for `flag`, or an error naming the flag.
pub fn value<T: FromStr>(flag: &str, value: &str) -> Result<T>
where
    T::Err: Display,
{
    value.parse().map_err(|e| format!("{flag}: {e}").into())
}

/// A comma-separated list of counts (`1,8,64`).
pub fn counts(flag: &str, value: &str) -> Result<Vec<usize>> {
    value
        .split(',')
        .map(|g| g.parse().map_err(|e| format!("{flag}: {g:?}: {e}").into()))
        .collect()
}
