//! `cargo xtask launches`: kernel launches on a GPU (wgpu or CUDA) per training step and per
//! depthwise layer's backward pass, counted in cubecl's execution log (one `Executing` line per
//! launch, written by a background thread: counts are read once the log stops growing).

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::time::Duration;

use anyhow::{Context, Result};
use burn::cubecl::config::profiling::ProfilingLogLevel;
use burn::cubecl::config::{CubeClRuntimeConfig, RuntimeConfig};
use model::ops::SsdBackend;
use serde_json::json;
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
    /// Where the JSON report goes; cubecl's execution log goes beside it (`.log`).
    pub out: PathBuf,
}

/// Logs every launch to `log` (emptied first), where the report's counts come from and a
/// reader can follow the kernels in order: must run before any GPU work in this process.
fn log_launches(log: &Path) -> Result<()> {
    if log.exists() {
        std::fs::remove_file(log).with_context(|| format!("removing {}", log.display()))?;
    }
    let mut config = CubeClRuntimeConfig::from_current_dir().override_from_env();
    config.profiling.logger.level = ProfilingLogLevel::Minimal;
    config.profiling.logger.file = Some(log.to_path_buf());
    config.profiling.logger.append = true;
    CubeClRuntimeConfig::set(config);
    Ok(())
}

/// The launches logged so far, by kernel name.
type Kernels = BTreeMap<String, usize>;

/// The launches logged so far by kernel name, once the log has stopped growing for half a
/// second.
fn settled_kernels(log: &Path) -> Kernels {
    let count = || {
        let mut kernels = Kernels::new();
        for line in std::fs::read_to_string(log).unwrap_or_default().lines() {
            if let Some((_, name)) = line.split_once("Executing ") {
                *kernels.entry(name.to_string()).or_default() += 1;
            }
        }
        kernels
    };
    let mut last = count();
    loop {
        std::thread::sleep(Duration::from_millis(500));
        let now = count();
        if now == last {
            return now;
        }
        last = now;
    }
}

/// The launches logged so far, once the log has stopped growing for half a second.
fn settled(log: &Path) -> usize {
    settled_kernels(log).values().sum()
}

/// Counts, prints and writes the report.
pub fn run(request: &Request) -> Result<()> {
    let scratch = tempfile::tempdir()?;
    let log = request.out.with_extension("log");
    log_launches(&log)?;
    let mut steps = Vec::new();
    for path in &request.configs {
        let (kernels, step_seconds) = step_launches(request, path, scratch.path(), &log)?;
        let per_step: f64 = kernels.values().sum();
        println!(
            "{}, batch {}, --devices {}: {per_step:.0} launches per training step; steps of {} s (kernels compiled and tuned, launches logged)",
            path.display(),
            request.batch,
            request.device,
            step_seconds
                .iter()
                .map(|s| format!("{s:.3}"))
                .collect::<Vec<_>>()
                .join(", ")
        );
        steps.push(json!({
            "config": path,
            "launches_per_step": per_step,
            "kernels": kernels,
            "step_seconds": step_seconds,
        }));
    }
    let layers = parse_device(&request.device)?.run(DepthwiseLaunches {
        batch: request.batch,
        log: log.clone(),
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
        "training_steps": steps,
        "depthwise_layers": depthwise_layers().iter().zip(&layers).map(|(l, c)| json!({
            "channels": l.0, "size": l.1, "stride": l.2, "backward": c,
        })).collect::<Vec<_>>(),
    });
    std::fs::write(&request.out, serde_json::to_string_pretty(&report)?)
        .with_context(|| format!("writing {}", request.out.display()))?;
    Ok(())
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
                let before = settled(&self.log);
                depthwise_backward(layer);
                settled(&self.log) - before
            })
            .collect();
        Ok(counts)
    }
}
