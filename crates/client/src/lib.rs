//! forkless-client (work in progress).
