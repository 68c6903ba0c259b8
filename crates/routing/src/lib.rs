//! forkless-routing (work in progress).
