//! `cargo xtask launches`: what a GPU (wgpu or CUDA) compiles, tunes and launches. For each
//! config: the kernels compiled and the shapes autotuned by the first training step and by a
//! first inference pass with post-processing (as an evaluation runs it) of the process,
//! against the kernel cache in use (`SSD_BURN_KERNEL_CACHE`: an empty folder for a cold
//! start, the same folder again for a warm one), then the kernel launches per training step;
//! and the launches per depthwise layer's backward pass. Counted in cubecl's logs (one
//! `Compiling kernel` line per compilation, one `Fastest result` per tuned shape, one
//! `Executing` line per launch), written by a background thread: counts are read once a log
//! stops growing.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use anyhow::{Context, Result};
use burn::cubecl::config::autotune::AutotuneLogLevel;
use burn::cubecl::config::compilation::CompilationLogLevel;
use burn::cubecl::config::profiling::ProfilingLogLevel;
use burn::cubecl::config::{CubeClRuntimeConfig, RuntimeConfig};
use burn::tensor::{Tensor, TensorData};
use model::inference::postprocess;
use model::ops::SsdBackend;
use model::ssd::anchors;
use serde_json::json;
use train::config::TrainConfig;
use train::devices::kernel_cache::{self, KernelCaches};
use train::devices::{BackendJob, parse_device};
use train::learner::TrainingJob;

use crate::bench::{
    bench_config, depthwise_backward, depthwise_inputs, depthwise_layers, quiet_run,
};

/// What to count.
pub struct Request {
    /// `wgpu` or a CUDA ordinal.
    pub device: String,
    /// Config files whose training step is counted.
    pub configs: Vec<PathBuf>,
    /// Images per step.
    pub batch: usize,
    /// Where the JSON report goes; cubecl's logs go beside it (`.log`: launches,
    /// `.compile.log`, `.autotune.log`).
    pub out: PathBuf,
}

/// cubecl's logs of this process.
struct Logs {
    launches: PathBuf,
    compiled: PathBuf,
    tuned: PathBuf,
}

impl Logs {
    fn beside(out: &Path) -> Self {
        Self {
            launches: out.with_extension("log"),
            compiled: out.with_extension("compile.log"),
            tuned: out.with_extension("autotune.log"),
        }
    }

    /// Kernels compiled and shapes tuned so far.
    fn compiled_and_tuned(&self) -> (usize, usize) {
        (
            settled_count(&self.compiled, "Compiling kernel"),
            settled_count(&self.tuned, "Fastest result"),
        )
    }
}

/// Uses the kernel cache as a run would, and logs every launch, compilation and autotune
/// result to `logs` (emptied first): must run before any GPU work in this process.
fn log_gpu_work(logs: &Logs, caches: &KernelCaches) -> Result<()> {
    for log in [&logs.launches, &logs.compiled, &logs.tuned] {
        if log.exists() {
            std::fs::remove_file(log).with_context(|| format!("removing {}", log.display()))?;
        }
    }
    let mut config = caches.runtime_config();
    config.profiling.logger.level = ProfilingLogLevel::Minimal;
    config.profiling.logger.file = Some(logs.launches.clone());
    config.profiling.logger.append = true;
    config.compilation.logger.level = CompilationLogLevel::Basic;
    config.compilation.logger.file = Some(logs.compiled.clone());
    config.compilation.logger.append = true;
    config.autotune.logger.level = AutotuneLogLevel::Minimal;
    config.autotune.logger.file = Some(logs.tuned.clone());
    config.autotune.logger.append = true;
    CubeClRuntimeConfig::set(config);
    Ok(())
}

/// `read()` once it gives the same twice half a second apart: cubecl writes its logs from a
/// background thread.
fn settled<T: PartialEq>(read: impl Fn() -> T) -> T {
    let mut last = read();
    loop {
        std::thread::sleep(Duration::from_millis(500));
        let now = read();
        if now == last {
            return now;
        }
        last = now;
    }
}

/// Lines of `log` holding `marker`, once the log has stopped growing.
fn settled_count(log: &Path, marker: &str) -> usize {
    settled(|| {
        std::fs::read_to_string(log)
            .unwrap_or_default()
            .lines()
            .filter(|l| l.contains(marker))
            .count()
    })
}

/// The launches logged so far, by kernel name.
type Kernels = BTreeMap<String, usize>;

/// The launches logged so far by kernel name, once the log has stopped growing.
fn settled_kernels(log: &Path) -> Kernels {
    settled(|| {
        let mut kernels = Kernels::new();
        for line in std::fs::read_to_string(log).unwrap_or_default().lines() {
            if let Some((_, name)) = line.split_once("Executing ") {
                *kernels.entry(name.to_string()).or_default() += 1;
            }
        }
        kernels
    })
}

/// Counts, prints and writes the report.
pub fn run(request: &Request) -> Result<()> {
    let scratch = tempfile::tempdir()?;
    let logs = Logs::beside(&request.out);
    let devices = parse_device(&request.device)?;
    let root = kernel_cache::root(|k| std::env::var(k).ok())
        .context("no kernel cache folder: set SSD_BURN_KERNEL_CACHE")?;
    let gpus = devices
        .kernel_cache_name()
        .context("no kernel cache fits these devices")?;
    let caches = KernelCaches::open(&root, &gpus)?;
    println!("{}", caches.describe());
    log_gpu_work(&logs, &caches)?;
    let mut steps = Vec::new();
    for path in &request.configs {
        let first = first_work(request, path, scratch.path(), &logs)?;
        println!(
            "{}, batch {}, --devices {}: first training step {:.1} s, {} kernels compiled, {} shapes autotuned; then a first inference pass with post-processing: {} compiled, {} autotuned",
            path.display(),
            request.batch,
            request.device,
            first.step_seconds,
            first.step.0,
            first.step.1,
            first.inference.0,
            first.inference.1,
        );
        let (kernels, step_seconds) = step_launches(request, path, scratch.path(), &logs.launches)?;
        let per_step: f64 = kernels.values().sum();
        println!(
            "  {per_step:.0} launches per training step; steps of {} s (kernels compiled and tuned, launches logged)",
            step_seconds
                .iter()
                .map(|s| format!("{s:.3}"))
                .collect::<Vec<_>>()
                .join(", ")
        );
        steps.push(json!({
            "config": path,
            "first_step": {
                "seconds": first.step_seconds,
                "compiled": first.step.0,
                "autotuned": first.step.1,
            },
            "first_inference": {
                "compiled": first.inference.0,
                "autotuned": first.inference.1,
            },
            "launches_per_step": per_step,
            "kernels": kernels,
            "step_seconds": step_seconds,
        }));
    }
    let layers = devices.run(DepthwiseLaunches {
        batch: request.batch,
        log: logs.launches.clone(),
    })?;
    println!(
        "depthwise backward launches per layer (channels, size, stride: input and filter gradients):"
    );
    for (layer, count) in depthwise_layers().iter().zip(&layers) {
        println!("  {layer:?}: {count}");
    }
    let report = json!({
        "device": request.device,
        "batch": request.batch,
        "kernel_cache": {
            "dir": caches.dir,
            "compiled_kernels_found": caches.kernels,
            "autotune_results_found": caches.tuned,
        },
        "training_steps": steps,
        "depthwise_layers": depthwise_layers().iter().zip(&layers).map(|(l, c)| json!({
            "channels": l.0, "size": l.1, "stride": l.2, "backward": c,
        })).collect::<Vec<_>>(),
    });
    std::fs::write(&request.out, serde_json::to_string_pretty(&report)?)
        .with_context(|| format!("writing {}", request.out.display()))?;
    Ok(())
}

/// What the first GPU work of a config compiled and tuned: (kernels compiled, shapes tuned).
struct FirstWork {
    step: (usize, usize),
    step_seconds: f64,
    inference: (usize, usize),
}

/// The first training step of the config file `path` in a model dir of its own (one run of
/// one step), then a first inference pass with post-processing at batch 1, each with what it
/// compiled and tuned.
fn first_work(request: &Request, path: &Path, scratch: &Path, logs: &Logs) -> Result<FirstWork> {
    let mut config = bench_config(path, request.batch, scratch)?;
    config.train.num_steps = 1;
    let model_dir = tempfile::tempdir_in(scratch)?;
    let devices = parse_device(&request.device)?;
    let before = logs.compiled_and_tuned();
    let start = Instant::now();
    TrainingJob {
        config: &config,
        options: &quiet_run(model_dir.path(), true),
    }
    .run_on(&devices)?;
    let step_seconds = start.elapsed().as_secs_f64();
    let after_step = logs.compiled_and_tuned();
    devices.run(FirstInference { config: &config })?;
    let after_inference = logs.compiled_and_tuned();
    let since = |a: (usize, usize), b: (usize, usize)| (b.0 - a.0, b.1 - a.1);
    Ok(FirstWork {
        step: since(before, after_step),
        step_seconds,
        inference: since(after_step, after_inference),
    })
}

/// One inference pass with post-processing of a config's model at batch 1.
struct FirstInference<'a> {
    config: &'a TrainConfig,
}

impl BackendJob for FirstInference<'_> {
    type Output = ();
    fn run<B: SsdBackend>(self, devices: Vec<B::Device>) -> Result<()> {
        let device = devices.into_iter().next().context("one device")?;
        let model = &self.config.model;
        let net = model.init::<B>(0, &device)?;
        let [h, w] = model.image_size;
        // an image arrives from the host, as in `train eval` and `detect`
        let pixels = (0..3 * h * w)
            .map(|i| (i % 255) as f32 / 127.5 - 1.0)
            .collect();
        let images = Tensor::<B, 4>::from_data(TensorData::new(pixels, [1, 3, h, w]), &device);
        let predictions = net.forward(images);
        std::hint::black_box(postprocess(model, &anchors(model), &predictions));
        Ok(())
    }
}

/// Launches per step of the config file `path`, by kernel name: after two warm-up steps
/// (kernels compiled and tuned), a run of one more step and a run of three, each resuming the
/// last; the difference is two steps' launches, with what a run does besides its steps
/// (loading, the last checkpoint) cancelled. Also the seconds of the three steps of the
/// last run: the steady step time of the device (the last step reads its loss).
fn step_launches(
    request: &Request,
    path: &Path,
    scratch: &Path,
    log: &Path,
) -> Result<(BTreeMap<String, f64>, Vec<f64>)> {
    let mut config = bench_config(path, request.batch, scratch)?;
    let model_dir = tempfile::tempdir_in(scratch)?;
    let devices = parse_device(&request.device)?;
    let mut run_to = |step: u64| -> Result<(Kernels, Vec<f64>)> {
        config.train.num_steps = step;
        let options = quiet_run(model_dir.path(), true);
        let before = settled_kernels(log);
        let summary = TrainingJob {
            config: &config,
            options: &options,
        }
        .run_on(&devices)?;
        let mut launched = settled_kernels(log);
        for (name, count) in before {
            *launched.entry(name).or_default() -= count;
        }
        Ok((launched, summary.step_seconds))
    };
    run_to(2)?;
    let (one, _) = run_to(3)?;
    let (three, step_seconds) = run_to(6)?;
    let per_step = |name: &String| {
        let count = |run: &Kernels| run.get(name).copied().unwrap_or(0) as f64;
        (count(&three) - count(&one)) / 2.0
    };
    let names: Vec<String> = one.keys().chain(three.keys()).cloned().collect();
    let kernels = names
        .into_iter()
        .map(|name| (per_step(&name), name))
        .filter(|(count, _)| *count != 0.0)
        .map(|(count, name)| (name, count))
        .collect();
    Ok((kernels, step_seconds))
}

/// Launches of each depthwise layer's backward pass (input and filter gradients), counted on a
/// second call (the first compiles and tunes).
struct DepthwiseLaunches {
    batch: usize,
    log: PathBuf,
}

impl BackendJob for DepthwiseLaunches {
    type Output = Vec<usize>;
    fn run<B: SsdBackend>(self, devices: Vec<B::Device>) -> Result<Self::Output> {
        let device = devices.into_iter().next().context("one device")?;
        let layers = depthwise_inputs::<B>(&device, self.batch);
        let counts = layers
            .iter()
            .map(|layer| {
                depthwise_backward(layer);
                let before = settled_count(&self.log, "Executing ");
                depthwise_backward(layer);
                settled_count(&self.log, "Executing ") - before
            })
            .collect();
        Ok(counts)
    }
}
