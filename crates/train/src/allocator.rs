//! The process allocator of the `train` and `xtask` binaries (and this crate's tests).
//!
//! Every training step frees and reallocates the same large activation buffers. The system
//! allocator returns them to the kernel and faults them back in zero-filled; mimalloc by
//! default does the same after a one-second "purge delay", about the length of one 300x300
//! batch-8 step on two cores. Without [`keep_freed_memory`] 13.5% of such a step went to
//! zeroing pages (`clear_page_erms`, measured with `perf`).

use libmimalloc_sys::{mi_option_get, mi_option_set, mi_option_t};

#[global_allocator]
static ALLOCATOR: mimalloc::MiMalloc = mimalloc::MiMalloc;

/// `mi_option_purge_delay` in mimalloc v3's `mi_option_t` (include/mimalloc.h), which
/// libmimalloc-sys does not name: milliseconds before freed memory goes back to the OS,
/// `-1` for never.
const PURGE_DELAY: mi_option_t = 15;

/// Makes the allocator keep freed memory for reuse instead of returning it to the OS. The
/// process then holds its peak footprint until it exits (a training run holds it anyway).
pub fn keep_freed_memory() {
    // SAFETY: setting an option is thread-safe in mimalloc and takes plain integers.
    unsafe { mi_option_set(PURGE_DELAY, -1) }
}

/// The current purge delay in milliseconds (`-1`: never).
pub fn purge_delay_ms() -> std::ffi::c_long {
    // SAFETY: reading an option is thread-safe and has no preconditions.
    unsafe { mi_option_get(PURGE_DELAY) }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_option_index_is_the_purge_delay() {
        // the purge delay defaults to 1000 ms (src/options.c of mimalloc v3): a different
        // option at this index (a libmimalloc-sys upgrade) shows up here
        if std::env::var_os("MIMALLOC_PURGE_DELAY").is_none() {
            assert_eq!(purge_delay_ms(), 1000);
        }
        keep_freed_memory();
        assert_eq!(purge_delay_ms(), -1);
    }
}
