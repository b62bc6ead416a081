//! `train export` and `train import-checkpoint`: a trained model's inference weights as a
//! file other tools read.

use std::path::{Path, PathBuf};

use anyhow::{Context, Result, bail};
use burn::backend::Flex;
use train::config::TrainConfig;
use train::trained::{TrainedModel, Weights};

use super::CheckpointArgs;

/// Write a model's inference weights (by default its moving-average weights when it keeps
/// them) as safetensors (names in `model::portable`, the model config in the metadata;
/// `model::Detector::load` takes the file), or the inference network as TFLite or ONNX
/// (`model::export`); the model config goes beside it as JSON (`FILE.json`).
#[derive(clap::Args)]
pub struct ExportArgs {
    #[command(flatten)]
    checkpoint: CheckpointArgs,
    /// The file to write.
    #[arg(long)]
    out: PathBuf,
    /// What to write.
    #[arg(long, value_enum, default_value_t = Format::Safetensors)]
    format: Format,
}

/// The formats of `train export`.
#[derive(Clone, Copy, clap::ValueEnum)]
pub enum Format {
    /// The weights, for `model::Detector` and further training.
    Safetensors,
    /// A `.tflite` flatbuffer with the `TFLite_Detection_PostProcess` op.
    Tflite,
    /// An ONNX model with the raw outputs and the decoded boxes.
    Onnx,
}

/// Convert a TensorFlow Object Detection API checkpoint (`PREFIX.index` +
/// `PREFIX.data-*`) of SSD-MobileNet-v1 into safetensors (as `export` writes them), to
/// continue training it (`train.fine_tune_checkpoint`) or to deploy it.
#[derive(clap::Args)]
pub struct ImportCheckpointArgs {
    /// The checkpoint prefix (e.g. `.../model.ckpt-200000`), its `.index` file, or a
    /// folder with a `checkpoint` state file.
    prefix: PathBuf,
    /// The model's config (JSON or the API's pipeline.config).
    #[arg(long)]
    config: PathBuf,
    /// The safetensors file to write.
    #[arg(long)]
    out: PathBuf,
    /// Take the `ExponentialMovingAverage` shadows (what the API evaluates and exports
    /// with `use_moving_average`) instead of the trained values.
    #[arg(long)]
    moving_average: bool,
}

/// `train export`.
pub fn run(args: ExportArgs) -> Result<()> {
    export(&args.checkpoint.locate()?, &args.out, args.format)
}

/// `train import-checkpoint`.
pub fn import_checkpoint(args: ImportCheckpointArgs) -> Result<()> {
    let prefix = &args.prefix;
    if !model::tf::bundle::is_checkpoint(prefix) {
        bail!(
            "{}: no TensorFlow checkpoint there (no {}.index)",
            prefix.display(),
            prefix.display()
        );
    }
    let config = TrainConfig::load(&args.config)?.model;
    let weights = if args.moving_average {
        Weights::MovingAverage
    } else {
        Weights::Raw
    };
    export(
        &TrainedModel::locate(prefix, Some(config), Some(weights))?,
        &args.out,
        Format::Safetensors,
    )
}

fn export(trained: &TrainedModel, out: &Path, format: Format) -> Result<()> {
    let net = trained.load::<Flex>(&Default::default())?;
    if let Some(parent) = out.parent().filter(|p| !p.as_os_str().is_empty()) {
        std::fs::create_dir_all(parent)
            .with_context(|| format!("creating {}", parent.display()))?;
    }
    let config = &trained.config;
    match format {
        Format::Safetensors => model::portable::save_safetensors(&net, config, out)?,
        Format::Tflite => model::export::write_tflite(&net, config, out)?,
        Format::Onnx => model::export::write_onnx(&net, config, out)?,
    }
    let json = out.with_extension("json");
    model::io::write_atomic(
        &json,
        serde_json::to_string_pretty(&trained.config)?.as_bytes(),
    )
    .with_context(|| format!("writing {}", json.display()))?;
    println!(
        "exported {} to {} (config {})",
        trained.describe(),
        out.display(),
        json.display()
    );
    Ok(())
}
