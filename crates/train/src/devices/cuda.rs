//! What CUDA devices need at run time, checked before a run starts: cubecl compiles every
//! kernel with NVRTC against the CUDA toolkit's headers, inside each device's runner thread,
//! where a panic is only logged and the run hangs; and each GPU's memory, against which a
//! run's size is checked.

use std::path::Path;

use anyhow::{Result, bail};

/// Number of CUDA devices the driver reports; 0 without a driver.
pub fn device_count() -> usize {
    // SAFETY: only probes whether the CUDA driver library can be loaded.
    if !unsafe { cudarc::driver::sys::is_culib_present() } {
        return 0;
    }
    cudarc::driver::CudaContext::device_count().map_or(0, |n| n.max(0) as usize)
}

/// Refuses a CUDA run on a machine without what cubecl compiles kernels with: NVRTC
/// (`libnvrtc.so`) and the toolkit's `include/cuda_runtime.h` under `CUDA_PATH` (else
/// `/usr/local/cuda`, `/opt/cuda` or `/usr` where `nvcc` is), as cubecl looks for them.
pub fn check_toolkit() -> Result<()> {
    // SAFETY: only probes whether the NVRTC library can be loaded.
    let nvrtc = unsafe { cudarc::nvrtc::sys::is_culib_present() };
    toolkit_problem(nvrtc, cubecl_cuda::install::cuda_path().as_deref())
}

/// The error for a toolkit without NVRTC or headers, given what was found.
fn toolkit_problem(nvrtc: bool, root: Option<&Path>) -> Result<()> {
    const HOW: &str = "CUDA devices compile their kernels at run time with the CUDA toolkit's NVRTC and headers (a driver-only host, or an nvidia/cuda:*-runtime image, has neither): install the toolkit (or use an nvidia/cuda:*-devel image), or train with `--devices wgpu`, which needs only the driver";
    if !nvrtc {
        bail!(
            "NVRTC (libnvrtc.so) was not found on the library path (LD_LIBRARY_PATH: {:?}). {HOW}",
            std::env::var("LD_LIBRARY_PATH").unwrap_or_default()
        );
    }
    let header = root.map(|r| r.join("include").join("cuda_runtime.h"));
    match header {
        Some(h) if h.is_file() => Ok(()),
        Some(h) => bail!(
            "the CUDA headers are missing: {} does not exist (set CUDA_PATH to the toolkit's folder). {HOW}",
            h.display()
        ),
        None => bail!(
            "no CUDA toolkit found: CUDA_PATH is not set and none of /usr/local/cuda, /opt/cuda or /usr/bin/nvcc exists. {HOW}"
        ),
    }
}

/// The memory of CUDA device `ordinal`, in bytes; `None` where the driver cannot tell.
pub fn memory_bytes(ordinal: usize) -> Option<f64> {
    cudarc::driver::result::init().ok()?;
    let device = cudarc::driver::result::device::get(ordinal as i32).ok()?;
    // SAFETY: `device` is a handle the driver has just returned.
    let bytes = unsafe { cudarc::driver::result::device::total_mem(device) }.ok()?;
    Some(bytes as f64)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_toolkit_without_nvrtc_or_headers_is_named() {
        let err = toolkit_problem(false, Some(Path::new("/usr/local/cuda"))).unwrap_err();
        assert!(
            err.to_string()
                .contains("NVRTC (libnvrtc.so) was not found"),
            "{err}"
        );
        let empty = tempfile::tempdir().unwrap();
        let err = toolkit_problem(true, Some(empty.path()))
            .unwrap_err()
            .to_string();
        assert!(
            err.contains("cuda_runtime.h does not exist") && err.contains("--devices wgpu"),
            "{err}"
        );
        let err = toolkit_problem(true, None).unwrap_err().to_string();
        assert!(err.contains("CUDA_PATH is not set"), "{err}");
        std::fs::create_dir(empty.path().join("include")).unwrap();
        std::fs::write(empty.path().join("include/cuda_runtime.h"), "").unwrap();
        toolkit_problem(true, Some(empty.path())).unwrap();
    }
}
