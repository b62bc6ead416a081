//! Which accelerators this machine has, and which of them a run uses.

use anyhow::{Context, Result, bail};

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

/// Where to run.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Devices {
    /// This many replicas on the CPU.
    Cpu(usize),
    /// These CUDA ordinals, one replica each.
    Cuda(Vec<usize>),
}

/// The devices of a `--devices` value: CUDA ordinals `0,1`, `cpu` (one replica) or `cpu:N`
/// (N replicas on the CPU); `None`: every CUDA device found, else the CPU. Also returns the
/// line that tells the user what was chosen. CUDA ordinals must exist.
pub fn parse_devices(spec: Option<&str>) -> Result<(Devices, String)> {
    match spec {
        None => {
            let n = cuda_device_count();
            if n > 0 {
                Ok((
                    Devices::Cuda((0..n).collect()),
                    format!("{n} CUDA device(s) found: training on all of them"),
                ))
            } else {
                Ok((
                    Devices::Cpu(1),
                    "no CUDA device found: training on the CPU (one replica)".into(),
                ))
            }
        }
        Some("cpu") => Ok((Devices::Cpu(1), "training on the CPU (one replica)".into())),
        Some(s) if s.starts_with("cpu:") => {
            let n: usize = s[4..]
                .parse()
                .with_context(|| format!("--devices {s}: expected cpu:N"))?;
            if n == 0 {
                bail!("--devices {s}: at least one replica");
            }
            Ok((
                Devices::Cpu(n),
                format!("training on the CPU with {n} replicas"),
            ))
        }
        Some(s) => {
            let ids: Vec<usize> = s
                .split(',')
                .map(|p| {
                    p.trim()
                        .parse::<usize>()
                        .with_context(|| format!("--devices {s}: `{p}` is not a CUDA ordinal"))
                })
                .collect::<Result<_>>()?;
            let available = cuda_device_count();
            if let Some(bad) = ids.iter().find(|&&i| i >= available) {
                bail!(
                    "--devices {s}: CUDA device {bad} does not exist ({available} found{})",
                    if cfg!(feature = "cuda") {
                        ""
                    } else {
                        "; built without the `cuda` feature"
                    }
                );
            }
            Ok((
                Devices::Cuda(ids.clone()),
                format!("training on CUDA devices {ids:?}"),
            ))
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn cpu_specs_name_the_replicas() {
        assert_eq!(parse_devices(Some("cpu")).unwrap().0, Devices::Cpu(1));
        assert_eq!(parse_devices(Some("cpu:3")).unwrap().0, Devices::Cpu(3));
        for bad in ["cpu:0", "cpu:x", "gpu", "0,a"] {
            let err = parse_devices(Some(bad)).unwrap_err().to_string();
            assert!(err.contains(bad), "{bad}: {err}");
        }
    }

    #[test]
    fn a_cuda_ordinal_must_exist() {
        let ordinal = cuda_device_count().to_string();
        let err = parse_devices(Some(&ordinal)).unwrap_err().to_string();
        assert!(err.contains("does not exist"), "{err}");
    }
}
