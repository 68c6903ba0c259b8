//! The harness itself: a test's time bound does not count the build of
//! the binary under test, which on a first run (a fresh target folder)
//! takes longer than any test's bound. Its own test binary, so that it
//! finds the binary first, through a `cargo` that is slow on purpose.

use forkless_it::{deadline, forkless_bin};
use std::time::{Duration, Instant};

/// A `cargo` that takes 3 s before doing what it is asked (the harness
/// runs `$CARGO build -p forkless`), against a bound of 1 s: the test
/// binary aborts if the bound's clock runs while the binary is built.
#[test]
fn a_deadline_starts_once_the_binary_is_built() {
    let dir = tempfile::tempdir().expect("tempdir");
    let slow = dir.path().join("slow-cargo");
    let cargo = std::env::var("CARGO").unwrap_or_else(|_| "cargo".into());
    std::fs::write(
        &slow,
        format!("#!/bin/sh\nsleep 3\nexec '{cargo}' \"$@\"\n"),
    )
    .expect("write the slow cargo");
    {
        use std::os::unix::fs::PermissionsExt;
        std::fs::set_permissions(&slow, std::fs::Permissions::from_mode(0o755))
            .expect("chmod the slow cargo");
    }
    // This binary's only test: nothing else reads the environment now.
    std::env::set_var("CARGO", &slow);
    std::env::remove_var("FORKLESS_BIN");
    std::env::remove_var("FORKLESS_IT_NO_BUILD");
    let started = Instant::now();
    let bound = deadline(
        "a_deadline_starts_once_the_binary_is_built",
        Duration::from_secs(1),
    );
    let bin = forkless_bin();
    drop(bound);
    assert!(bin.is_file(), "{}", bin.display());
    assert!(
        started.elapsed() >= Duration::from_secs(3),
        "the slow cargo was not used: {:?}",
        started.elapsed()
    );
}
