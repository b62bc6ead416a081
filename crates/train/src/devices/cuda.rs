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
/// NVRTC must also be no newer than the CUDA version the driver supports: cubecl loads the
/// PTX it writes, which an older driver refuses.
pub fn check_toolkit() -> Result<()> {
    // SAFETY: only probes whether the NVRTC library can be loaded.
    let nvrtc = unsafe { cudarc::nvrtc::sys::is_culib_present() };
    let versions = if nvrtc { versions() } else { None };
    toolkit_problem(
        nvrtc,
        versions,
        cubecl_cuda::install::cuda_path().as_deref(),
    )
}

/// The CUDA version the driver supports and NVRTC's, each as `1000 * major + 10 * minor`
/// (CUDA's own encoding); `None` where either cannot be read.
fn versions() -> Option<(i32, i32)> {
    let (mut driver, mut major, mut minor) = (0, 0, 0);
    // SAFETY: both libraries load (probed by the caller); each call writes the ints it is given.
    let read = unsafe {
        cudarc::driver::sys::cuDriverGetVersion(&mut driver)
            == cudarc::driver::sys::CUresult::CUDA_SUCCESS
            && cudarc::nvrtc::sys::nvrtcVersion(&mut major, &mut minor)
                == cudarc::nvrtc::sys::nvrtcResult::NVRTC_SUCCESS
    };
    read.then_some((driver, 1000 * major + 10 * minor))
}

/// CUDA's `1000 * major + 10 * minor` as `major.minor`.
fn dotted(version: i32) -> String {
    format!("{}.{}", version / 1000, version % 1000 / 10)
}

/// The error for a toolkit without NVRTC or headers, or with an NVRTC newer than the driver,
/// given what was found (`versions`: the driver's CUDA version and NVRTC's).
fn toolkit_problem(nvrtc: bool, versions: Option<(i32, i32)>, root: Option<&Path>) -> Result<()> {
    const HOW: &str = "CUDA devices compile their kernels at run time with the CUDA toolkit's NVRTC and headers (a driver-only host, or an nvidia/cuda:*-runtime image, has neither): install the toolkit (or use an nvidia/cuda:*-devel image), or train with `--devices wgpu`, which needs only the driver";
    if !nvrtc {
        bail!(
            "NVRTC (libnvrtc.so) was not found on the library path (LD_LIBRARY_PATH: {:?}). {HOW}",
            std::env::var("LD_LIBRARY_PATH").unwrap_or_default()
        );
    }
    if let Some((driver, nvrtc)) = versions
        && nvrtc > driver
    {
        bail!(
            "NVRTC {} is newer than the CUDA {} this driver supports: the driver would refuse the kernels it compiles. Use a CUDA toolkit no newer than {} (its NVRTC first on LD_LIBRARY_PATH), or update the driver",
            dotted(nvrtc),
            dotted(driver),
            dotted(driver)
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
    // SAFETY: only probes whether the CUDA driver library can be loaded.
    if !unsafe { cudarc::driver::sys::is_culib_present() } {
        return None;
    }
    cudarc::driver::result::init().ok()?;
    let device = cudarc::driver::result::device::get(ordinal as i32).ok()?;
    // SAFETY: `device` is a handle the driver has just returned.
    let bytes = unsafe { cudarc::driver::result::device::total_mem(device) }.ok()?;
    Some(bytes as f64)
}

/// What the PTX cubecl compiles for CUDA devices `ids` is good for, as the kernel cache's
/// folder names it: their one GPU architecture and NVRTC's version (`cuda-sm90-nvrtc12.8`).
/// cubecl compiles for the device's architecture, which another refuses, and a driver refuses
/// PTX of a newer NVRTC; neither is in cubecl's key. `None` for devices of several
/// architectures, or one the driver does not report.
pub fn architecture(ids: &[usize]) -> Option<String> {
    let mut capabilities: Vec<(i32, i32)> = ids
        .iter()
        .map(|&i| compute_capability(i))
        .collect::<Option<_>>()?;
    capabilities.dedup();
    let [(major, minor)] = capabilities[..] else {
        return None;
    };
    let (_, nvrtc) = versions()?;
    Some(format!("cuda-sm{major}{minor}-nvrtc{}", dotted(nvrtc)))
}

/// The compute capability (major, minor) of CUDA device `ordinal`; `None` where the driver
/// cannot tell.
fn compute_capability(ordinal: usize) -> Option<(i32, i32)> {
    use cudarc::driver::sys::CUdevice_attribute as Attribute;
    cudarc::driver::result::init().ok()?;
    let device = cudarc::driver::result::device::get(ordinal as i32).ok()?;
    // SAFETY: `device` is a handle the driver has just returned.
    let read = |attribute| {
        unsafe { cudarc::driver::result::device::get_attribute(device, attribute) }.ok()
    };
    Some((
        read(Attribute::CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR)?,
        read(Attribute::CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MINOR)?,
    ))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_toolkit_without_nvrtc_or_headers_or_newer_than_the_driver_is_named() {
        let toolkit = tempfile::tempdir().unwrap();
        let root = Some(toolkit.path());
        let err = toolkit_problem(false, None, root).unwrap_err().to_string();
        assert!(err.contains("NVRTC (libnvrtc.so) was not found"), "{err}");
        let err = toolkit_problem(true, None, root).unwrap_err().to_string();
        assert!(
            err.contains("cuda_runtime.h does not exist") && err.contains("--devices wgpu"),
            "{err}"
        );
        let err = toolkit_problem(true, None, None).unwrap_err().to_string();
        assert!(err.contains("CUDA_PATH is not set"), "{err}");
        std::fs::create_dir(toolkit.path().join("include")).unwrap();
        std::fs::write(toolkit.path().join("include/cuda_runtime.h"), "").unwrap();
        toolkit_problem(true, None, root).unwrap();
        // a driver for CUDA 12.4 and NVRTC 13.0; the same NVRTC with a CUDA 13.0 driver
        let err = toolkit_problem(true, Some((12040, 13000)), root)
            .unwrap_err()
            .to_string();
        assert!(
            err.contains("NVRTC 13.0 is newer than the CUDA 12.4 this driver supports"),
            "{err}"
        );
        toolkit_problem(true, Some((13000, 13000)), root).unwrap();
    }
}
