//! `train export` and `train import-checkpoint`: a trained model's inference weights as a
//! file other tools read.

use std::path::{Path, PathBuf};

use anyhow::{Context, Result, bail};
use burn::backend::Flex;
use burn::tensor::{Tensor, TensorData};
use data::shards::expand_patterns;
use data::tfrecord::RecordIndex;
use data::validate::read_checked;
use model::export::{Calibration, InputType, Precision};
use model::preprocess::image_to_input;
use model::{Ssd, SsdConfig};
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
    /// Quantize the TFLite network after training: int8 weights (per output channel) and
    /// activations (ranges calibrated on training images), int32 biases.
    #[arg(long, value_enum)]
    quantize: Option<Quantize>,
    /// Training images the activation ranges are calibrated on (spread evenly over the
    /// records; all of them when there are fewer).
    #[arg(long, default_value_t = 100, value_parser = positive)]
    calibration_images: usize,
    /// Calibration TFRecords (default: `data.train` of --config, else of the config the run
    /// kept in its model dir).
    #[arg(long, num_args = 1..)]
    calibration_data: Vec<String>,
    /// The int8 model's input: `uint8` camera pixels, `int8` pixels minus 128, or the float
    /// model's `float32` input.
    #[arg(long, value_enum, default_value_t = InputArg::Uint8)]
    input_type: InputArg,
}

/// `--quantize`: the one supported width.
#[derive(Clone, Copy, clap::ValueEnum)]
pub enum Quantize {
    /// 8-bit integers (TFLite's int8 quantization specification).
    Int8,
}

/// `--input-type`.
#[derive(Clone, Copy, clap::ValueEnum)]
pub enum InputArg {
    /// Pixels 0 to 255.
    Uint8,
    /// Pixels minus 128.
    Int8,
    /// `(2 / 255) p - 1`, as the float model.
    Float32,
}

fn positive(text: &str) -> Result<usize, String> {
    match text.parse::<usize>() {
        Ok(n) if n > 0 => Ok(n),
        _ => Err(format!(
            "expected a whole number of at least 1, got {text:?}"
        )),
    }
}

/// How to quantize: the calibration images and the input type.
struct Quantization {
    images: usize,
    data: Vec<String>,
    input: InputType,
}

impl Quantization {
    /// The quantization `args` ask for, checked against the format; `None` for float.
    fn from_args(args: &ExportArgs) -> Result<Option<Self>> {
        let Some(Quantize::Int8) = args.quantize else {
            return Ok(None);
        };
        if !matches!(args.format, Format::Tflite) {
            bail!("--quantize int8 needs --format tflite");
        }
        // checked when a float-trained model needs them (quantization-aware training brings
        // its own ranges)
        let data = match (&args.checkpoint.config, args.calibration_data.is_empty()) {
            (_, false) => args.calibration_data.clone(),
            (Some(config), true) => TrainConfig::load(config)?.data.train,
            (None, true) => TrainConfig::of_run(&args.checkpoint.model_dir)?
                .map(|(_, c)| c.data.train)
                .unwrap_or_default(),
        };
        let input = match args.input_type {
            InputArg::Uint8 => InputType::Uint8,
            InputArg::Int8 => InputType::Int8,
            InputArg::Float32 => InputType::Float32,
        };
        Ok(Some(Self {
            images: args.calibration_images,
            data,
            input,
        }))
    }

    /// The activation ranges of `net`: those quantization-aware training learned, or else
    /// the ranges over the calibration images.
    fn ranges(&self, net: &Ssd<Flex>, config: &SsdConfig) -> Result<Calibration> {
        match Calibration::learned(net) {
            Some(learned) => {
                eprintln!(
                    "int8 activation ranges: those learned in quantization-aware training (no calibration)"
                );
                Ok(learned)
            }
            None => self.calibrate(net, config),
        }
    }

    /// The activation ranges of `net` over the calibration images, preprocessed as for
    /// inference (resized, scaled to `[-1, 1]`, no augmentation).
    fn calibrate(&self, net: &Ssd<Flex>, config: &SsdConfig) -> Result<Calibration> {
        if self.data.is_empty() {
            bail!(
                "--quantize int8 calibrates a float-trained model on training images: pass \
                 --calibration-data, or a --config whose data.train names them (a model dir \
                 written by `train` keeps its config)"
            );
        }
        let what = "the calibration records (--calibration-data, else data.train of --config or of the run's config.json)";
        let files = expand_patterns(&self.data).context(what)?;
        let index = RecordIndex::build(&files).context(what)?;
        if index.is_empty() {
            bail!("--calibration-data: no records in {:?}", self.data);
        }
        let count = self.images.min(index.len());
        let picks: Vec<usize> = (0..count).map(|i| i * index.len() / count).collect();
        let [h, w] = config.image_size;
        let mut calibration = Calibration::default();
        for batch in picks.chunks(8) {
            let mut input = Vec::with_capacity(batch.len() * 3 * h * w);
            for &i in batch {
                let (_, image) = read_checked(&index, i, Some(config.num_classes))?;
                image_to_input(&image, h, w, &mut input)?;
            }
            let data = TensorData::new(input, [batch.len(), 3, h, w]);
            calibration.observe(net, Tensor::from_data(data, &Default::default()))?;
        }
        eprintln!(
            "calibrated the int8 activation ranges on {count} of {} training images",
            index.len()
        );
        Ok(calibration)
    }
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
    let quantization = Quantization::from_args(&args)?;
    export(
        &args.checkpoint.locate()?,
        &args.out,
        args.format,
        quantization.as_ref(),
    )
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
        None,
    )
}

fn export(
    trained: &TrainedModel,
    out: &Path,
    format: Format,
    quantization: Option<&Quantization>,
) -> Result<()> {
    let net = trained.load::<Flex>(&Default::default())?;
    if let Some(parent) = out.parent().filter(|p| !p.as_os_str().is_empty()) {
        std::fs::create_dir_all(parent)
            .with_context(|| format!("creating {}", parent.display()))?;
    }
    let config = &trained.config;
    match format {
        Format::Safetensors => model::portable::save_safetensors(&net, config, out)?,
        Format::Tflite => {
            let calibration = quantization.map(|q| q.ranges(&net, config)).transpose()?;
            let precision = match (quantization, &calibration) {
                (Some(q), Some(calibration)) => Precision::Int8 {
                    calibration,
                    input: q.input,
                },
                _ => Precision::Float32,
            };
            model::export::write_tflite(&net, config, precision, out)?
        }
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
