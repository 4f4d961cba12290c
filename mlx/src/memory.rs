//! MLX allocator statistics and limits (bytes).
use crate::ffi::bridge;
use crate::{Error, Result};

/// Bytes held by live arrays.
pub fn active() -> usize {
    bridge::active_memory()
}

/// Highest `active()` since start or the last `reset_peak()`.
pub fn peak() -> usize {
    bridge::peak_memory()
}

pub fn reset_peak() {
    bridge::reset_peak_memory()
}

/// Bytes MLX keeps in its buffer cache for reuse (not held by arrays).
pub fn cache() -> usize {
    bridge::cache_memory()
}

/// Returns cached buffers to the system.
pub fn clear_cache() -> Result<()> {
    bridge::clear_cache().map_err(|e| Error::from_cxx("clear_cache", e))
}

/// Returns MLX's cached buffers, then the C heap's free pages, to the
/// system: the process's resident memory falls back toward what live data
/// needs. A few milliseconds; call it when idle, not on a hot path.
/// Returns whether the heap gave any memory back.
pub fn release_to_system() -> Result<bool> {
    clear_cache()?;
    Ok(bridge::trim_process_heap())
}

/// Sets the allocator's memory limit; returns the previous one.
pub fn set_memory_limit(bytes: usize) -> usize {
    bridge::set_memory_limit(bytes)
}

/// Sets the buffer cache limit; returns the previous one.
pub fn set_cache_limit(bytes: usize) -> usize {
    bridge::set_cache_limit(bytes)
}
