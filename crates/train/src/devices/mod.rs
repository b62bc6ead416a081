//! Which accelerators this machine has, which of them a run uses, and the one place that
//! picks the backend for them ([`Devices::run`]).

#[cfg(feature = "cuda")]
pub mod cuda;
#[cfg(any(feature = "cuda", feature = "wgpu"))]
pub mod kernel_cache;
#[cfg(feature = "wgpu")]
pub mod wgpu;

use anyhow::{Context, Result, bail};
use burn::backend::Flex;
use model::ops::SsdBackend;

use crate::config::TrainConfig;

/// Number of CUDA devices the driver reports; 0 without a driver or without the `cuda`
/// feature.
#[cfg(feature = "cuda")]
pub fn cuda_device_count() -> usize {
    cuda::device_count()
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
    /// These wgpu devices (Vulkan, Metal), one replica each ([`wgpu`]).
    Wgpu(Vec<usize>),
}

/// The forms `--devices` takes, for its errors.
const ACCEPTED: &str =
    "accepted: CUDA ordinals `0` or `0,1`, `cpu`, `cpu:N` (N replicas), `wgpu` or `wgpu:0,1`";

/// The devices of a `--devices` value: CUDA ordinals `0,1`, `cpu` (one replica), `cpu:N`
/// (N replicas on the CPU), `wgpu` (the default wgpu adapter) or `wgpu:0,1` (two wgpu
/// devices); `None`: every CUDA device found, else the CPU. Also returns the line that tells
/// the user what was chosen. CUDA ordinals must exist.
pub fn parse_devices(spec: Option<&str>) -> Result<(Devices, String)> {
    match spec {
        None => Ok(default_devices()),
        Some("cpu") => Ok((Devices::Cpu(1), "training on the CPU (one replica)".into())),
        Some(s) if s.starts_with("cpu:") => {
            let n: usize = s[4..]
                .parse()
                .with_context(|| format!("--devices {s}: expected cpu:N ({ACCEPTED})"))?;
            if n == 0 {
                bail!("--devices {s}: at least one replica");
            }
            Ok((
                Devices::Cpu(n),
                format!("training on the CPU with {n} replicas"),
            ))
        }
        Some("wgpu") => parse_wgpu("wgpu", "0"),
        Some(s) if s.starts_with("wgpu:") => parse_wgpu(s, &s[5..]),
        Some(s) => {
            let ids = indices(s, s, "a CUDA ordinal")?;
            let available = cuda_device_count();
            if let Some(bad) = ids.iter().find(|&&i| i >= available) {
                let why = if cfg!(not(feature = "cuda")) {
                    "; built without the `cuda` feature"
                } else if available == 0 {
                    "; `--devices cpu` trains on the CPU, `--devices wgpu` on a Vulkan or Metal GPU"
                } else {
                    ""
                };
                bail!("--devices {s}: CUDA device {bad} does not exist ({available} found{why})");
            }
            Ok((
                Devices::Cuda(ids.clone()),
                format!("training on CUDA devices {ids:?}"),
            ))
        }
    }
}

/// Every CUDA device found, else one replica on the CPU.
fn default_devices() -> (Devices, String) {
    let n = cuda_device_count();
    if n > 0 {
        return (
            Devices::Cuda((0..n).collect()),
            format!(
                "{n} CUDA device(s) found: training on all of them (a machine's first run compiles the GPU kernels, kept for later runs; `--devices cpu` trains on the CPU)"
            ),
        );
    }
    (
        Devices::Cpu(1),
        "no CUDA device found: training on the CPU (one replica; `--devices wgpu` trains on a Vulkan or Metal GPU)".into(),
    )
}

fn parse_wgpu(spec: &str, list: &str) -> Result<(Devices, String)> {
    if cfg!(not(feature = "wgpu")) {
        bail!("--devices {spec}: built without the `wgpu` feature");
    }
    let ids = indices(spec, list, "a wgpu device index")?;
    Ok((
        Devices::Wgpu(ids.clone()),
        format!("training on wgpu devices {ids:?}"),
    ))
}

/// The comma-separated indices of `list`, part of the `--devices` value `spec`.
fn indices(spec: &str, list: &str, what: &str) -> Result<Vec<usize>> {
    list.split(',')
        .map(|p| {
            p.trim()
                .parse::<usize>()
                .with_context(|| format!("--devices {spec}: `{p}` is not {what} ({ACCEPTED})"))
        })
        .collect()
}

/// Work written once for every backend; [`Devices::run`] calls it with the backend of the
/// chosen devices (generic closures do not exist in Rust, so the work is a trait).
pub trait BackendJob {
    /// What the work returns.
    type Output;
    /// Does the work on `devices` (one or more, all of backend `B`).
    fn run<B: SsdBackend>(self, devices: Vec<B::Device>) -> Result<Self::Output>;
}

impl Devices {
    /// Runs `job` with these devices' backend: burn-flex on the CPU (one device per
    /// replica, all the same), CUDA or wgpu on GPUs.
    pub fn run<J: BackendJob>(&self, job: J) -> Result<J::Output> {
        match self {
            Devices::Cpu(n) => job.run::<Flex>(vec![Default::default(); *n]),
            #[cfg(feature = "cuda")]
            Devices::Cuda(ids) => {
                cuda::check_toolkit()?;
                kernel_cache::use_kernel_caches(self.kernel_cache_name().as_deref());
                job.run::<burn::backend::Cuda>(
                    ids.iter()
                        .map(|&i| burn::backend::cuda::CudaDevice::new(i))
                        .collect(),
                )
            }
            #[cfg(not(feature = "cuda"))]
            Devices::Cuda(_) => bail!("built without the `cuda` feature"),
            #[cfg(feature = "wgpu")]
            Devices::Wgpu(ids) => {
                kernel_cache::use_kernel_caches(self.kernel_cache_name().as_deref());
                job.run::<burn::backend::Wgpu>(wgpu::devices(ids)?)
            }
            #[cfg(not(feature = "wgpu"))]
            Devices::Wgpu(_) => bail!("built without the `wgpu` feature"),
        }
    }
}

impl Devices {
    /// What the GPU kernels compiled for these devices are good for, which names their
    /// folder in the kernel cache: the CUDA architecture and NVRTC version
    /// (`cuda-sm90-nvrtc12.8`), or `wgpu` (SPIR-V, the same for every Vulkan GPU; autotune
    /// results are kept per device). `None` where no one folder fits (CUDA devices of several
    /// architectures).
    #[cfg(any(feature = "cuda", feature = "wgpu"))]
    pub fn kernel_cache_name(&self) -> Option<String> {
        match self {
            #[cfg(feature = "cuda")]
            Devices::Cuda(ids) => cuda::architecture(ids),
            #[cfg(not(feature = "cuda"))]
            Devices::Cuda(_) => None,
            Devices::Wgpu(_) => Some("wgpu".into()),
            Devices::Cpu(_) => Some("cpu".into()),
        }
    }
}

/// The one device of a `--device` value: `cpu`, `wgpu`, `wgpu:i` or a CUDA ordinal
/// (evaluation, detection and inference benchmarks run on one device).
pub fn parse_device(spec: &str) -> Result<Devices> {
    match parse_devices(Some(spec))?.0 {
        Devices::Cuda(ids) | Devices::Wgpu(ids) if ids.len() > 1 => {
            bail!("--device {spec}: one device (`cpu`, `wgpu` or a CUDA ordinal), not several")
        }
        Devices::Cpu(n) if n > 1 => bail!("--device {spec}: one device (`cpu`), not {n} replicas"),
        one => Ok(one),
    }
}

/// The most memory a run may plan to use on a GPU whose memory is not known (wgpu; no GPU
/// has more): a guard against sizes that would abort in the allocator.
const MAX_DEVICE_BYTES: f64 = 1024.0 * GIB;
const GIB: f64 = (1u64 << 30) as f64;

/// Refuses a run whose training step cannot fit, with the figures: on the CPU the estimate
/// (`model::memory::training_bytes`) for the whole batch against the machine's memory, on
/// GPUs each device's share against the smallest CUDA device's memory, or on wgpu against
/// `MAX_DEVICE_BYTES`.
pub fn check_memory(config: &TrainConfig, devices: &Devices) -> Result<()> {
    let batch = config.train.batch_size;
    let per_gpu = |ids: &[usize]| batch.div_ceil(ids.len().max(1));
    let (images, available, place) = match devices {
        Devices::Cpu(_) => (batch, host_memory_bytes(), "this machine has".into()),
        Devices::Cuda(ids) => match smallest_cuda_memory(ids) {
            Some((ordinal, bytes)) => (
                per_gpu(ids),
                Some(bytes),
                format!("CUDA device {ordinal} has"),
            ),
            None => (per_gpu(ids), Some(MAX_DEVICE_BYTES), "no GPU has".into()),
        },
        Devices::Wgpu(ids) => (per_gpu(ids), Some(MAX_DEVICE_BYTES), "no GPU has".into()),
    };
    let needed = model::memory::training_bytes(&config.model, images);
    let Some(available) = available.filter(|&a| needed > a) else {
        return Ok(());
    };
    let m = &config.model;
    bail!(
        "a training step of {images} image(s) needs about {:.1} GiB (`model.image_size` {:?}, `model.num_classes` {}, `model.depth_multiplier` {}, `model.min_depth` {}, `train.batch_size` {batch}), and {place} {:.1} GiB: lower the batch size, the image size, the depth multiplier or the minimum depth",
        needed / GIB,
        m.image_size,
        m.num_classes,
        m.depth_multiplier,
        m.min_depth,
        available / GIB
    )
}

/// The CUDA device of `ids` with the least memory, and its memory; `None` where the driver
/// cannot tell.
#[cfg(feature = "cuda")]
fn smallest_cuda_memory(ids: &[usize]) -> Option<(usize, f64)> {
    ids.iter()
        .map(|&i| cuda::memory_bytes(i).map(|bytes| (i, bytes)))
        .collect::<Option<Vec<_>>>()?
        .into_iter()
        .min_by(|a, b| a.1.total_cmp(&b.1))
}

#[cfg(not(feature = "cuda"))]
fn smallest_cuda_memory(_: &[usize]) -> Option<(usize, f64)> {
    None
}

/// The machine's physical memory (Linux's `MemTotal`); `None` where it cannot be read.
fn host_memory_bytes() -> Option<f64> {
    let info = std::fs::read_to_string("/proc/meminfo").ok()?;
    let line = info.lines().find(|l| l.starts_with("MemTotal:"))?;
    let kib: f64 = line.split_whitespace().nth(1)?.parse().ok()?;
    Some(kib * 1024.0)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn cpu_specs_name_the_replicas() {
        assert_eq!(parse_devices(Some("cpu")).unwrap().0, Devices::Cpu(1));
        assert_eq!(parse_devices(Some("cpu:3")).unwrap().0, Devices::Cpu(3));
        for bad in ["cpu:0", "cpu:x", "gpu", "0,a", "wgpu:", "wgpu:0,x"] {
            let err = format!("{:#}", parse_devices(Some(bad)).unwrap_err());
            assert!(err.contains(bad), "{bad}: {err}");
            if bad != "cpu:0" {
                assert!(err.contains(ACCEPTED), "{bad}: {err}");
            }
        }
    }

    #[test]
    fn wgpu_specs_name_the_devices() {
        assert_eq!(
            parse_devices(Some("wgpu")).unwrap().0,
            Devices::Wgpu(vec![0])
        );
        assert_eq!(
            parse_devices(Some("wgpu:0,1")).unwrap().0,
            Devices::Wgpu(vec![0, 1])
        );
        assert_eq!(parse_device("wgpu:1").unwrap(), Devices::Wgpu(vec![1]));
        let err = parse_device("wgpu:0,1").unwrap_err().to_string();
        assert!(err.contains("not several"), "{err}");
    }

    #[test]
    fn a_single_device_is_cpu_or_one_ordinal() {
        assert_eq!(parse_device("cpu").unwrap(), Devices::Cpu(1));
        let err = parse_device("cpu:2").unwrap_err().to_string();
        assert!(err.contains("not 2 replicas"), "{err}");
        let err = parse_device("tpu").unwrap_err().to_string();
        assert!(err.contains("tpu"), "{err}");
    }

    /// The job runs with the backend and device count of the spec.
    #[test]
    fn a_job_runs_on_the_devices_of_its_spec() {
        struct Count;
        impl BackendJob for Count {
            type Output = (usize, &'static str);
            fn run<B: SsdBackend>(self, devices: Vec<B::Device>) -> Result<Self::Output> {
                Ok((devices.len(), std::any::type_name::<B>()))
            }
        }
        let (n, backend) = Devices::Cpu(3).run(Count).unwrap();
        assert_eq!(n, 3);
        assert!(backend.contains("Flex"), "{backend}");
    }

    #[test]
    fn sizes_that_cannot_fit_are_refused_with_their_figures() {
        let mut config: TrainConfig = serde_json::from_str(
            &std::fs::read_to_string(concat!(
                env!("CARGO_MANIFEST_DIR"),
                "/../../configs/synthetic.json"
            ))
            .unwrap(),
        )
        .unwrap();
        check_memory(&config, &Devices::Cpu(1)).unwrap();
        check_memory(&config, &Devices::Cuda(vec![0])).unwrap();
        let fits = config.clone();
        config.model.image_size = [100_000, 100_000];
        for devices in [Devices::Cpu(2), Devices::Cuda(vec![0, 1])] {
            let err = check_memory(&config, &devices).unwrap_err().to_string();
            assert!(
                err.contains("[100000, 100000]") && err.contains("GiB"),
                "{err}"
            );
        }
        // made large by the minimum depth alone: the message names it with its value
        let mut deep = fits;
        deep.model.min_depth = 1_000_000;
        let err = check_memory(&deep, &Devices::Cpu(1))
            .unwrap_err()
            .to_string();
        assert!(err.contains("`model.min_depth` 1000000"), "{err}");
    }

    #[test]
    fn a_cuda_ordinal_must_exist() {
        let ordinal = cuda_device_count().to_string();
        let err = parse_devices(Some(&ordinal)).unwrap_err().to_string();
        assert!(err.contains("does not exist"), "{err}");
        // without a CUDA device the error says how to train anyway
        if cuda_device_count() == 0 && cfg!(feature = "cuda") {
            assert!(err.contains("`--devices cpu` trains on the CPU"), "{err}");
        }
    }
}
