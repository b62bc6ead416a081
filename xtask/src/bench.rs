//! `cargo xtask bench`: training, inference and data-pipeline throughput with peak memory.
//!
//! Every case runs in its own child process (`xtask bench-case CASE`) so that its peak
//! resident memory (`VmHWM`) is its own; the parent prints a table and writes JSON.

use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::Arc;
use std::sync::atomic::AtomicBool;
use std::time::Instant;

use anyhow::{Context, Result, bail};
use burn::tensor::ops::ConvOptions;
use burn::tensor::{Distribution, Tensor, TensorMetadata, TensorPrimitive};
use data::augment::Augmentation;
use data::loader::{Loader, LoaderConfig, Position, load_sample};
use data::synthetic::write_resized_set;
use data::tfrecord::RecordIndex;
use model::inference::postprocess;
use model::mobilenet::{CONV0_DEPTH, SEPARABLE_BLOCKS};
use model::ops::{ConvGradsWanted, SsdBackend};
use model::ssd::anchors;
use serde::{Deserialize, Serialize};
use serde_json::json;
use train::config::TrainConfig;
use train::devices::{BackendJob, parse_device, parse_devices};
use train::learner::{RunOptions, TrainingJob};

/// One measurement, run in a child process.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(tag = "kind", rename_all = "snake_case")]
pub enum Case {
    /// Training steps of the pets model (37 classes, 300x300).
    Train {
        /// `cpu`, `cpu:N`, `wgpu`, `wgpu:0,1` or CUDA ordinals.
        devices: String,
        batch: usize,
        /// Confine the case to this many cores, its thread pool and its data loader alike
        /// (1 = one core); 0 = every core.
        threads: usize,
        /// Every step trains on one batch kept in memory, with no data pipeline running
        /// beside it: the training step alone, as the PyTorch peer measures it.
        #[serde(default)]
        in_memory: bool,
    },
    /// Forward pass of the pets model, optionally with post-processing.
    Infer {
        /// `cpu`, `wgpu` or a CUDA ordinal.
        #[serde(default = "cpu")]
        device: String,
        batch: usize,
        postprocess: bool,
    },
    /// Decode + augmentation + resize of 500x375 JPEGs.
    Data { workers: usize },
    /// The filter gradients of the pets network's 13 depthwise layers (300x300, depth 1),
    /// as the training step computes them (`SsdBackend::conv_same_backward`), or with
    /// `burn` by Burn's grouped-convolution weight gradient, which its GPU backends run as
    /// a loop over the channels.
    DepthwiseGrad {
        /// `cpu`, `wgpu` or a CUDA ordinal.
        device: String,
        batch: usize,
        burn: bool,
    },
}

impl Case {
    /// How the table names the case.
    pub fn label(&self) -> String {
        match self {
            Case::Train {
                devices,
                batch,
                threads,
                in_memory,
            } => {
                let cores = if *threads == 0 {
                    String::new()
                } else {
                    format!(", {threads} thread(s)")
                };
                let data = if *in_memory { ", batch in memory" } else { "" };
                format!("train --devices {devices}, batch {batch}{cores}{data}")
            }
            Case::Infer {
                device,
                batch,
                postprocess,
            } => {
                // the CPU cases keep their names; a GPU's name as the training cases'
                let on = if device == "cpu" {
                    String::new()
                } else {
                    format!("--devices {device}, ")
                };
                let what = if *postprocess {
                    " + NMS"
                } else {
                    ", model only"
                };
                format!("inference {on}batch {batch}{what}")
            }
            Case::Data { workers } => format!("data pipeline, {workers} worker(s)"),
            Case::DepthwiseGrad {
                device,
                batch,
                burn,
            } => {
                let how = if *burn {
                    "Burn's grouped convolution"
                } else {
                    "as trained"
                };
                format!("depthwise filter gradients --devices {device}, batch {batch}, {how}")
            }
        }
    }
}

/// What a case measured.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct Measured {
    /// Per-repetition images per second.
    pub images_per_sec: Vec<f64>,
    /// Per-repetition milliseconds per batch (training step, forward, NMS).
    pub ms_per_batch: Vec<f64>,
    /// Share of the step spent in gradient synchronisation (training only).
    pub sync_share: Option<f64>,
    /// Share of the step spent waiting for data (training only).
    pub data_wait_share: Option<f64>,
    /// Milliseconds per image of post-processing alone (inference with NMS only).
    pub postprocess_ms: Option<Vec<f64>>,
    /// Peak resident memory of the process, MiB.
    pub peak_mib: f64,
}

/// The repository root: the current directory when it has `configs/` (a binary carried to
/// another machine), else where this xtask was built.
fn workspace() -> PathBuf {
    if Path::new("configs").is_dir() {
        return PathBuf::from(".");
    }
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .parent()
        .expect("xtask lives in the workspace")
        .to_path_buf()
}

fn peak_mib() -> f64 {
    std::fs::read_to_string("/proc/self/status")
        .ok()
        .and_then(|s| {
            s.lines()
                .find_map(|l| l.strip_prefix("VmHWM:"))
                .and_then(|v| v.trim().trim_end_matches("kB").trim().parse::<f64>().ok())
        })
        .map_or(f64::NAN, |kb| kb / 1024.0)
}

/// Runs one case in this process and prints its [`Measured`] as JSON.
pub fn run_case(case: &Case, scratch: &Path, repeats: usize) -> Result<()> {
    let measured = match case {
        Case::Train {
            devices,
            batch,
            threads,
            in_memory,
        } => {
            if *threads > 0 {
                confine_to_cores(*threads)?;
            }
            train_case(devices, *batch, *in_memory, scratch, repeats)?
        }
        Case::Infer {
            device,
            batch,
            postprocess,
        } => parse_device(device)?.run(Inference {
            batch: *batch,
            with_nms: *postprocess,
            repeats,
        })?,
        Case::Data { workers } => data_case(*workers, scratch, repeats)?,
        Case::DepthwiseGrad {
            device,
            batch,
            burn,
        } => parse_device(device)?.run(DepthwiseGrads {
            batch: *batch,
            burn: *burn,
            repeats,
        })?,
    };
    println!("{}", serde_json::to_string(&measured)?);
    Ok(())
}

/// Confines this thread, and every thread it starts from now on (the thread pools, the data
/// loader's workers), to the first `cores` CPUs it may run on: a case measured "on one core"
/// then has no spare core for its data loader either.
#[cfg(target_os = "linux")]
fn confine_to_cores(cores: usize) -> Result<()> {
    let size = std::mem::size_of::<libc::cpu_set_t>();
    // SAFETY: `cpu_set_t` is plain bits (all zeros is the empty set); the calls read and
    // write only the set passed with its size.
    unsafe {
        let mut allowed: libc::cpu_set_t = std::mem::zeroed();
        if libc::sched_getaffinity(0, size, &mut allowed) != 0 {
            bail!(
                "reading the CPU affinity: {}",
                std::io::Error::last_os_error()
            );
        }
        let mut kept: libc::cpu_set_t = std::mem::zeroed();
        let cpus = (0..libc::CPU_SETSIZE as usize).filter(|&c| libc::CPU_ISSET(c, &allowed));
        for cpu in cpus.take(cores) {
            libc::CPU_SET(cpu, &mut kept);
        }
        if libc::sched_setaffinity(0, size, &kept) != 0 {
            bail!(
                "confining to {cores} core(s): {}",
                std::io::Error::last_os_error()
            );
        }
    }
    Ok(())
}

/// Elsewhere the thread pool alone is limited (`RAYON_NUM_THREADS`).
#[cfg(not(target_os = "linux"))]
fn confine_to_cores(_: usize) -> Result<()> {
    Ok(())
}

/// The 500x375 JPEG set the data and training cases read (made once per scratch dir).
fn bench_records(scratch: &Path) -> Result<Vec<PathBuf>> {
    let base = scratch.join("bench.record");
    let existing = data::shards::expand_patterns(&[format!("{}-*", base.display())]);
    if let Ok(files) = existing
        && !files.is_empty()
    {
        return Ok(files);
    }
    Ok(write_resized_set(&base, 7, 240, [500, 375])?)
}

const WARM_UP_STEPS: usize = 2;

/// The device of a case that names none (the cases of earlier reports).
fn cpu() -> String {
    "cpu".into()
}

/// The config file `path` training at `batch` on the bench's JPEG set, with no checkpoint, log
/// line or evaluation on the way.
pub(crate) fn bench_config(path: &Path, batch: usize, scratch: &Path) -> Result<TrainConfig> {
    let records = bench_records(scratch)?;
    let mut config = TrainConfig::load(path)?;
    config.train.batch_size = batch;
    config.train.checkpoint_every = u64::MAX;
    config.train.log_every = u64::MAX;
    config.eval.every = 0;
    config.data.train = records.iter().map(|p| p.display().to_string()).collect();
    config.data.eval = Vec::new();
    config.data.synthetic_if_missing = false;
    Ok(config)
}

/// Options of a quiet single-machine run into `model_dir`, training every step on the first
/// batch when `in_memory`.
pub(crate) fn quiet_run(model_dir: &Path, in_memory: bool) -> RunOptions {
    RunOptions {
        model_dir: model_dir.to_path_buf(),
        stop: Arc::new(AtomicBool::new(false)),
        verbose: false,
        nodes: None,
        repeat_first_batch: in_memory,
        without_lock: false,
    }
}

fn train_case(
    devices: &str,
    batch: usize,
    in_memory: bool,
    scratch: &Path,
    repeats: usize,
) -> Result<Measured> {
    let pets = workspace().join("configs/ssd_mobilenet_v1_pets.json");
    let mut config = bench_config(&pets, batch, scratch)?;
    config.train.num_steps = (WARM_UP_STEPS + repeats) as u64;
    let model_dir = tempfile::tempdir_in(scratch)?;
    let options = quiet_run(model_dir.path(), in_memory);
    let summary = TrainingJob {
        config: &config,
        options: &options,
    }
    .run_on(&parse_devices(Some(devices))?.0)?;
    let steps = &summary.step_seconds[WARM_UP_STEPS.min(summary.step_seconds.len())..];
    let total: f64 = summary.step_seconds.iter().sum();
    Ok(Measured {
        images_per_sec: steps.iter().map(|s| batch as f64 / s).collect(),
        ms_per_batch: steps.iter().map(|s| s * 1000.0).collect(),
        sync_share: Some(summary.sync_seconds / total),
        data_wait_share: Some(summary.data_wait_seconds / total),
        postprocess_ms: None,
        peak_mib: peak_mib(),
    })
}

/// [`infer_case`] as a [`BackendJob`].
struct Inference {
    batch: usize,
    with_nms: bool,
    repeats: usize,
}

impl BackendJob for Inference {
    type Output = Measured;
    fn run<B: SsdBackend>(self, devices: Vec<B::Device>) -> Result<Measured> {
        let device = devices.into_iter().next().context("one device")?;
        infer_case::<B>(device, self.batch, self.with_nms, self.repeats)
    }
}

fn infer_case<B: SsdBackend>(
    device: B::Device,
    batch: usize,
    with_nms: bool,
    repeats: usize,
) -> Result<Measured> {
    let config = TrainConfig::load(&workspace().join("configs/ssd_mobilenet_v1_pets.json"))?.model;
    let net = config.init::<B>(0, &device)?;
    let anchors = anchors(&config);
    let [h, w] = config.image_size;
    let images =
        Tensor::<B, 4>::random([batch, 3, h, w], Distribution::Uniform(-1.0, 1.0), &device);
    let mut ms = Vec::new();
    let mut nms_ms = Vec::new();
    for i in 0..WARM_UP_STEPS + repeats {
        let start = Instant::now();
        let predictions = net.forward(images.clone());
        let _ = predictions.class_logits.clone().into_data();
        let _ = predictions.box_encodings.clone().into_data();
        if with_nms {
            let nms_start = Instant::now();
            let detections = postprocess(&config, &anchors, &predictions);
            std::hint::black_box(detections);
            if i >= WARM_UP_STEPS {
                nms_ms.push(nms_start.elapsed().as_secs_f64() * 1000.0 / batch as f64);
            }
        }
        if i >= WARM_UP_STEPS {
            ms.push(start.elapsed().as_secs_f64() * 1000.0);
        }
    }
    Ok(Measured {
        images_per_sec: ms.iter().map(|m| 1000.0 * batch as f64 / m).collect(),
        ms_per_batch: ms,
        sync_share: None,
        data_wait_share: None,
        postprocess_ms: with_nms.then_some(nms_ms),
        peak_mib: peak_mib(),
    })
}

/// [`depthwise_case`] as a [`BackendJob`].
struct DepthwiseGrads {
    batch: usize,
    burn: bool,
    repeats: usize,
}

impl BackendJob for DepthwiseGrads {
    type Output = Measured;
    fn run<B: SsdBackend>(self, devices: Vec<B::Device>) -> Result<Measured> {
        let device = devices.into_iter().next().context("one device")?;
        Ok(depthwise_case::<B>(
            &device,
            self.batch,
            self.burn,
            self.repeats,
        ))
    }
}

/// `(channels, input size, stride)` of MobileNet-v1's depthwise layers on a 300x300 image
/// at depth multiplier 1.
pub(crate) fn depthwise_layers() -> Vec<(usize, usize, usize)> {
    // Conv2d_0 (stride 2) makes 150x150
    let (mut channels, mut size) = (CONV0_DEPTH, 150_usize);
    SEPARABLE_BLOCKS
        .iter()
        .map(|&(stride, depth)| {
            let layer = (channels, size, stride);
            (channels, size) = (depth, size.div_ceil(stride));
            layer
        })
        .collect()
}

/// One depthwise layer's random input, filters and output gradient.
pub(crate) struct DepthwiseLayer<B: SsdBackend> {
    x: Tensor<B, 4>,
    weight: Tensor<B, 4>,
    grad: Tensor<B, 4>,
    stride: usize,
}

/// [`DepthwiseLayer`]s of the shapes of [`depthwise_layers`].
pub(crate) fn depthwise_inputs<B: SsdBackend>(
    device: &B::Device,
    batch: usize,
) -> Vec<DepthwiseLayer<B>> {
    let random = |shape: [usize; 4]| Tensor::<B, 4>::random(shape, Distribution::Default, device);
    depthwise_layers()
        .into_iter()
        .map(|(c, size, stride)| {
            let out = size.div_ceil(stride);
            DepthwiseLayer {
                x: random([batch, c, size, size]),
                weight: random([c, 1, 3, 3]),
                grad: random([batch, c, out, out]),
                stride,
            }
        })
        .collect()
}

/// One depthwise layer's filter gradient, as trained or (`burn`) by Burn's grouped
/// convolution; returns once it is computed (the small result is read back).
pub(crate) fn depthwise_filter_grad<B: SsdBackend>(layer: &DepthwiseLayer<B>, burn: bool) {
    let [x, weight, grad] =
        [&layer.x, &layer.weight, &layer.grad].map(|t| t.clone().into_primitive().tensor());
    let stride = layer.stride;
    let filter_grad = if burn {
        let groups = weight.shape().dims::<4>()[0];
        // padding 1 gives each stride the output size of TF's SAME
        let options = ConvOptions::new([stride; 2], [1, 1], [1, 1], groups);
        B::conv2d_weight_backward(x, weight, grad, options)
    } else {
        let wanted = ConvGradsWanted {
            x: false,
            bias: false,
        };
        B::conv_same_backward(x, weight, grad, stride, true, wanted).weight
    };
    let _ = Tensor::<B, 4>::from_primitive(TensorPrimitive::Float(filter_grad)).into_data();
}

/// One depthwise layer's backward pass as trained (input and filter gradients); returns once
/// both are computed: the filter gradient is read back while the input gradient is held, and
/// the read runs everything queued before it.
pub(crate) fn depthwise_backward<B: SsdBackend>(layer: &DepthwiseLayer<B>) {
    let [x, weight, grad] =
        [&layer.x, &layer.weight, &layer.grad].map(|t| t.clone().into_primitive().tensor());
    let wanted = ConvGradsWanted {
        x: true,
        bias: false,
    };
    let grads = B::conv_same_backward(x, weight, grad, layer.stride, true, wanted);
    let _ = Tensor::<B, 4>::from_primitive(TensorPrimitive::Float(grads.weight)).into_data();
    drop(grads.x);
}

fn depthwise_case<B: SsdBackend>(
    device: &B::Device,
    batch: usize,
    burn: bool,
    repeats: usize,
) -> Measured {
    let layers = depthwise_inputs::<B>(device, batch);
    let mut ms = Vec::new();
    for i in 0..WARM_UP_STEPS + repeats {
        let start = Instant::now();
        for layer in &layers {
            depthwise_filter_grad(layer, burn);
        }
        if i >= WARM_UP_STEPS {
            ms.push(start.elapsed().as_secs_f64() * 1000.0);
        }
    }
    Measured {
        images_per_sec: ms.iter().map(|m| 1000.0 * batch as f64 / m).collect(),
        ms_per_batch: ms,
        sync_share: None,
        data_wait_share: None,
        postprocess_ms: None,
        peak_mib: peak_mib(),
    }
}

fn data_case(workers: usize, scratch: &Path, repeats: usize) -> Result<Measured> {
    let index = Arc::new(RecordIndex::build(&bench_records(scratch)?)?);
    let config = LoaderConfig {
        batch_size: 8,
        image_size: [300, 300],
        num_classes: data::synthetic::CLASSES.len(),
        augmentations: vec![
            Augmentation::RandomHorizontalFlip { probability: 0.5 },
            Augmentation::SsdRandomCrop { operations: vec![] },
        ],
        shuffle: true,
        seed: 1,
        workers,
        prefetch: 4,
        share: None,
    };
    let mut rates = Vec::new();
    for round in 0..repeats as u64 {
        let start = Instant::now();
        if workers == 1 {
            for r in 0..index.len() {
                load_sample(&index, r, &config, round, r)?;
            }
        } else {
            let loader = Loader::new(
                index.clone(),
                config.clone(),
                Position {
                    epoch: round,
                    index: 0,
                },
            )?;
            for b in loader.take(index.len() / config.batch_size) {
                b?;
            }
        }
        rates.push(index.len() as f64 / start.elapsed().as_secs_f64());
    }
    Ok(Measured {
        ms_per_batch: rates.iter().map(|r| 8000.0 / r).collect(),
        images_per_sec: rates,
        sync_share: None,
        data_wait_share: None,
        postprocess_ms: None,
        peak_mib: peak_mib(),
    })
}

/// The cases `cargo xtask bench` runs: the CPU always, each CUDA device listed.
pub fn cases(cuda_devices: &[usize], wgpu: bool, cores: usize) -> Vec<Case> {
    let mut cases = Vec::new();
    let train = |devices: String, batch, threads, in_memory| Case::Train {
        devices,
        batch,
        threads,
        in_memory,
    };
    // each GPU alone, and with more than one CUDA device all of them (8 images each)
    let mut gpus: Vec<String> = cuda_devices.iter().map(usize::to_string).collect();
    if wgpu {
        gpus.push("wgpu".into());
    }
    for batch in [8, 24] {
        cases.push(train("cpu".into(), batch, 0, false));
        cases.push(train("cpu".into(), batch, 0, true));
        // the scaling pairs: one replica on one core, two replicas on every core
        for in_memory in [false, true] {
            cases.push(train("cpu".into(), batch, 1, in_memory));
            cases.push(train("cpu:2".into(), batch, 0, in_memory));
        }
        for d in &gpus {
            cases.push(train(d.clone(), batch, 0, false));
            cases.push(train(d.clone(), batch, 0, true));
        }
    }
    if cuda_devices.len() > 1 {
        let all = gpus[..cuda_devices.len()].join(",");
        for in_memory in [false, true] {
            cases.push(train(all.clone(), 8 * cuda_devices.len(), 0, in_memory));
        }
    }
    for device in std::iter::once("cpu".to_string()).chain(gpus.clone()) {
        for (batch, postprocess) in [(1, false), (1, true), (8, false)] {
            cases.push(Case::Infer {
                device: device.clone(),
                batch,
                postprocess,
            });
        }
    }
    for device in gpus {
        for burn in [false, true] {
            cases.push(Case::DepthwiseGrad {
                device: device.clone(),
                batch: 24,
                burn,
            });
        }
    }
    cases.push(Case::Data { workers: 1 });
    cases.push(Case::Data { workers: cores });
    cases
}

fn stats(v: &[f64]) -> [f64; 3] {
    let mut s = v.to_vec();
    s.sort_by(f64::total_cmp);
    if s.is_empty() {
        return [f64::NAN; 3];
    }
    [s[0], s[s.len() / 2], s[s.len() - 1]]
}

/// Runs every case in a child process, prints the table and writes the JSON report.
pub fn run_all(cases: &[Case], repeats: usize, out: &Path) -> Result<()> {
    let exe = std::env::current_exe()?;
    let scratch = tempfile::tempdir()?;
    let mut report = Vec::new();
    println!(
        "{:<62} {:>26} {:>22} {:>7} {:>9}",
        "case", "images/s min/median/max", "ms per batch (median)", "sync", "peak MiB"
    );
    let mut medians = Vec::new();
    for case in cases {
        let mut cmd = Command::new(&exe);
        cmd.arg("bench-case")
            .arg(serde_json::to_string(case)?)
            .arg("--scratch")
            .arg(scratch.path())
            .arg("--repeats")
            .arg(repeats.to_string());
        if let Case::Train { threads, .. } = case
            && *threads > 0
        {
            cmd.env("RAYON_NUM_THREADS", threads.to_string());
        }
        let output = cmd
            .output()
            .with_context(|| format!("running {}", case.label()))?;
        if !output.status.success() {
            bail!(
                "{} failed: {}",
                case.label(),
                String::from_utf8_lossy(&output.stderr)
            );
        }
        let stdout = String::from_utf8_lossy(&output.stdout);
        let line = stdout.lines().last().unwrap_or_default();
        let m: Measured = serde_json::from_str(line)
            .with_context(|| format!("{}: unexpected output {line:?}", case.label()))?;
        let [lo, med, hi] = stats(&m.images_per_sec);
        let ms = stats(&m.ms_per_batch)[1];
        let sync = m
            .sync_share
            .map_or(String::from("-"), |s| format!("{:.1}%", 100.0 * s));
        println!(
            "{:<62} {:>8.1} {:>8.1} {:>8.1} {:>22.1} {:>7} {:>9.0}",
            case.label(),
            lo,
            med,
            hi,
            ms,
            sync,
            m.peak_mib
        );
        if let Some(nms) = &m.postprocess_ms {
            let [a, b, c] = stats(nms);
            println!(
                "{:<62} post-processing alone: {a:.2} / {b:.2} / {c:.2} ms per image",
                ""
            );
        }
        report.push(json!({
            "case": case,
            "label": case.label(),
            "images_per_sec": {"min": lo, "median": med, "max": hi},
            "ms_per_batch_median": ms,
            "measured": m,
        }));
        medians.push((case, med));
    }
    let scaling = scaling(&medians);
    for s in &scaling {
        println!(
            "scaling, batch {}{}: two replicas on every core / one on one core = {:.2}",
            s.batch,
            if s.in_memory { ", batch in memory" } else { "" },
            s.ratio
        );
    }
    let doc = json!({
        "unix_time": unix_time(),
        "cpu_cores": std::thread::available_parallelism().map_or(1, |n| n.get()),
        "repeats": repeats,
        "results": report,
        "scaling": scaling,
    });
    std::fs::write(out, serde_json::to_string_pretty(&doc)?)
        .with_context(|| format!("writing {}", out.display()))?;
    println!("report: {}", out.display());
    Ok(())
}

/// Images per second of two CPU replicas over one replica on one core, at one batch size.
#[derive(Debug, Serialize)]
struct Scaling {
    batch: usize,
    in_memory: bool,
    ratio: f64,
}

/// The scaling ratio of every pair of measured cases `--devices cpu:2` and `--devices cpu`
/// on one core with the same batch and data source (median images per second).
fn scaling(medians: &[(&Case, f64)]) -> Vec<Scaling> {
    let median = |case: &Case| medians.iter().find(|(c, _)| *c == case).map(|(_, m)| *m);
    medians
        .iter()
        .filter_map(|&(case, two)| {
            let Case::Train {
                devices,
                batch,
                threads: 0,
                in_memory,
            } = case
            else {
                return None;
            };
            if devices != "cpu:2" {
                return None;
            }
            let one_core = Case::Train {
                devices: "cpu".into(),
                batch: *batch,
                threads: 1,
                in_memory: *in_memory,
            };
            median(&one_core).map(|one| Scaling {
                batch: *batch,
                in_memory: *in_memory,
                ratio: two / one,
            })
        })
        .collect()
}

/// Seconds since the Unix epoch (the report's timestamp).
fn unix_time() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_secs())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn train(devices: &str, batch: usize, threads: usize, in_memory: bool) -> Case {
        Case::Train {
            devices: devices.into(),
            batch,
            threads,
            in_memory,
        }
    }

    #[test]
    fn scaling_pairs_two_replicas_with_one_core_of_the_same_batch_and_data() {
        let cases = [
            train("cpu", 8, 1, false),
            train("cpu:2", 8, 0, false),
            train("cpu", 8, 1, true),
            train("cpu:2", 8, 0, true),
            train("cpu", 8, 0, true),
            // no one-core case at batch 24: no ratio
            train("cpu:2", 24, 0, false),
        ];
        let rates = [10.0, 18.0, 10.0, 19.0, 18.5, 17.0];
        let medians: Vec<_> = cases.iter().zip(rates).collect();
        let s = scaling(&medians);
        assert_eq!(s.len(), 2);
        assert_eq!((s[0].batch, s[0].in_memory, s[0].ratio), (8, false, 1.8));
        assert_eq!((s[1].batch, s[1].in_memory, s[1].ratio), (8, true, 1.9));
    }

    #[test]
    fn each_gpu_gets_the_training_and_inference_cases_of_the_cpu() {
        let labels: Vec<_> = cases(&[0], false, 2).iter().map(Case::label).collect();
        for batch in [8, 24] {
            for data in ["", ", batch in memory"] {
                let train = format!("train --devices 0, batch {batch}{data}");
                assert!(labels.contains(&train), "{train} missing: {labels:?}");
            }
        }
        for what in [
            "batch 1, model only",
            "batch 1 + NMS",
            "batch 8, model only",
        ] {
            for on in ["", "--devices 0, "] {
                let infer = format!("inference {on}{what}");
                assert!(labels.contains(&infer), "{infer} missing: {labels:?}");
            }
        }
        for how in ["as trained", "Burn's grouped convolution"] {
            let depthwise = format!("depthwise filter gradients --devices 0, batch 24, {how}");
            assert!(
                labels.contains(&depthwise),
                "{depthwise} missing: {labels:?}"
            );
        }
        let gpu = labels.iter().filter(|l| l.contains("--devices 0")).count();
        assert_eq!(gpu, 9, "{labels:?}");
        assert!(
            cases(&[], false, 2)
                .iter()
                .all(|c| !c.label().contains("--devices 0"))
        );
    }

    /// Two CUDA devices add their pair at 8 images each, and `--wgpu` the wgpu cases.
    #[test]
    fn several_gpus_get_a_case_with_all_of_them_and_wgpu_its_own() {
        let labels: Vec<_> = cases(&[0, 1], true, 2).iter().map(Case::label).collect();
        for data in ["", ", batch in memory"] {
            let pair = format!("train --devices 0,1, batch 16{data}");
            assert!(labels.contains(&pair), "{pair} missing: {labels:?}");
        }
        let wgpu = labels
            .iter()
            .filter(|l| l.contains("--devices wgpu"))
            .count();
        assert_eq!(wgpu, 9, "{labels:?}");
    }

    /// The 13 depthwise layers of MobileNet-v1 on 300x300: 150x150 after Conv2d_0, sizes
    /// halved (rounded up) by the stride-2 layers, down to 1024 channels on 10x10.
    #[test]
    fn the_depthwise_layers_are_mobilenets() {
        let layers = depthwise_layers();
        assert_eq!(layers.len(), 13);
        assert_eq!(layers[..3], [(32, 150, 1), (64, 150, 2), (128, 75, 1)]);
        assert_eq!(layers[5], (256, 38, 2));
        assert_eq!(layers[12], (1024, 10, 1));
    }

    #[test]
    fn an_inference_case_without_a_device_runs_on_the_cpu() {
        let case: Case =
            serde_json::from_str(r#"{"kind":"infer","batch":8,"postprocess":false}"#).unwrap();
        let cpu = Case::Infer {
            device: "cpu".into(),
            batch: 8,
            postprocess: false,
        };
        assert_eq!(case, cpu);
    }
}
