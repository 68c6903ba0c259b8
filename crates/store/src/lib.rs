//! forkless-store (work in progress).
