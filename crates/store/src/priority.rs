//! Thread priorities: the shard writers run above the request path, the
//! storage engine's background threads below it (see
//! [`crate::StoreConfig::writer_priority`] and `background_nice`).

use std::sync::atomic::Ordering;

/// Sets the calling thread's priority `by` nice steps below the process's
/// main thread (whose priority the request path has; a negative `by` is
/// above it), within Linux's -20..=19. Relative to the main thread, not to
/// the caller's own, so that a thread started by a raised or lowered one
/// (they inherit it) lands where it should.
#[cfg(target_os = "linux")]
pub(crate) fn adjust_own_priority(by: i32) -> std::io::Result<()> {
    if by == 0 {
        return Ok(());
    }
    // SAFETY: errno is thread-local; get/setpriority only read their
    // integer arguments. With PRIO_PROCESS, Linux takes `who` as a thread
    // id: the process id names the main thread, 0 the calling thread.
    unsafe {
        // -1 is both a nice value and getpriority's error: errno tells.
        *libc::__errno_location() = 0;
        let base = libc::getpriority(libc::PRIO_PROCESS, libc::getpid() as libc::id_t);
        if base == -1 && *libc::__errno_location() != 0 {
            return Err(std::io::Error::last_os_error());
        }
        if libc::setpriority(libc::PRIO_PROCESS, 0, (base + by).clamp(-20, 19)) != 0 {
            return Err(std::io::Error::last_os_error());
        }
    }
    Ok(())
}

#[cfg(not(target_os = "linux"))]
pub(crate) fn adjust_own_priority(_by: i32) -> std::io::Result<()> {
    Ok(())
}

/// Lowers a background thread's priority; failing to is not worth more
/// than a debug line.
pub(crate) fn lower_own_priority(by: i32) {
    if by > 0 {
        if let Err(e) = adjust_own_priority(by) {
            tracing::debug!(error = %e, "could not lower the storage threads' priority");
        }
    }
}

/// Raises a shard writer's priority, warning once per process if it may
/// not.
pub(crate) fn raise_own_priority(by: i32) {
    static WARNED: std::sync::atomic::AtomicBool = std::sync::atomic::AtomicBool::new(false);
    if by > 0 {
        if let Err(e) = adjust_own_priority(-by) {
            if !WARNED.swap(true, Ordering::Relaxed) {
                tracing::warn!(error = %e, "could not raise the shard writers' priority (that takes root or CAP_SYS_NICE); they run at the request path's priority");
            }
        }
    }
}
