//! Which accelerators this machine has.

/// Number of CUDA devices the driver reports; 0 without a driver or without the `cuda`
/// feature.
#[cfg(feature = "cuda")]
pub fn cuda_device_count() -> usize {
    // SAFETY: only probes whether the CUDA driver library can be loaded.
    if !unsafe { cudarc::driver::sys::is_culib_present() } {
        return 0;
    }
    cudarc::driver::CudaContext::device_count().map_or(0, |n| n.max(0) as usize)
}

/// Number of CUDA devices the driver reports; 0 without a driver or without the `cuda`
/// feature.
#[cfg(not(feature = "cuda"))]
pub fn cuda_device_count() -> usize {
    0
}
