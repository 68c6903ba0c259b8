//! forkless-server (work in progress).
