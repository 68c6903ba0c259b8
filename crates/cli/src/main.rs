//! The `forkless` binary (work in progress).
fn main() {}
