//! `train eval`: score a trained model on an evaluation set, or COCO-format detections
//! against COCO ground truth.

use std::path::PathBuf;
use std::sync::atomic::AtomicBool;

use anyhow::{Context, Result, bail};
use data::shards::expand_patterns;
use data::tfrecord::RecordIndex;
use model::ops::SsdBackend;
use train::config::{EvalSettings, TrainConfig};
use train::devices::{BackendJob, parse_device};
use train::eval::{COCO_NAMES, Metrics, evaluate, read_coco, run_on_dataset};
use train::trained::{TrainedModel, Weights};

/// Evaluate a checkpoint on a dataset, or score COCO-format detections against COCO ground
/// truth; prints the COCO and VOC metrics.
#[derive(clap::Args)]
pub struct EvalArgs {
    /// The model: a model dir (its latest checkpoint), a checkpoint folder, an exported
    /// `.safetensors` file or a TensorFlow checkpoint prefix.
    #[arg(long, conflicts_with_all = ["ground_truth", "detections"])]
    model_dir: Option<PathBuf>,
    /// Training config (JSON or pipeline.config): the model config (default: the one
    /// stored with the weights) and `data.eval` / `eval` settings (default: the config the
    /// run kept in its model dir, `config.json`).
    #[arg(long)]
    config: Option<PathBuf>,
    /// Raw or moving-average weights (default: the moving average where there is one).
    #[arg(long, value_enum)]
    weights: Option<Weights>,
    /// Evaluation TFRecords (default: `data.eval` of --config, else of the run's own config).
    #[arg(long, num_args = 1..)]
    data: Vec<String>,
    /// COCO ground truth JSON.
    #[arg(long, requires = "detections")]
    ground_truth: Option<PathBuf>,
    /// COCO results JSON (`[{image_id, category_id, bbox, score}]`).
    #[arg(long, requires = "ground_truth")]
    detections: Option<PathBuf>,
    /// Device: `cpu`, `wgpu` (`wgpu:i`: the i-th wgpu device) or a CUDA ordinal.
    #[arg(long, default_value = "cpu")]
    device: String,
    /// Write the metrics as JSON here.
    #[arg(long)]
    out: Option<PathBuf>,
}

/// Evaluates as `args` say, prints the metrics and writes them where asked.
pub fn run(args: EvalArgs) -> Result<()> {
    let metrics = match (&args.ground_truth, &args.detections, &args.model_dir) {
        (Some(gt), Some(dt), _) => {
            let (images, names) = read_coco(gt, dt)?;
            evaluate(&images, &names)
        }
        (_, _, Some(_)) => eval_checkpoint(&args)?,
        _ => bail!("eval needs --model-dir, or --ground-truth with --detections"),
    };
    print_metrics(&metrics);
    if let Some(out) = &args.out {
        model::io::write_atomic(out, serde_json::to_string_pretty(&metrics)?.as_bytes())
            .with_context(|| format!("writing {}", out.display()))?;
    }
    Ok(())
}

/// Prints the twelve COCO numbers and the VOC mAP with each class's AP.
pub fn print_metrics(m: &Metrics) {
    for (n, v) in COCO_NAMES.iter().zip(m.coco()) {
        println!("{n:>6} {v:.4}");
    }
    println!("VOC mAP@0.5 {:.4}", m.voc_mAP);
    for (c, ap) in &m.voc_AP {
        println!("  {c}: {ap:.4}");
    }
}

fn eval_checkpoint(args: &EvalArgs) -> Result<Metrics> {
    let config = args.config.as_deref().map(TrainConfig::load).transpose()?;
    let dir = args.model_dir.as_deref().context("--model-dir")?;
    let trained =
        TrainedModel::locate(dir, config.as_ref().map(|c| c.model.clone()), args.weights)?;
    // the data: --data, else the config's, else the config the run kept in its model dir
    let (config, source) = match (config, &args.config) {
        (Some(c), Some(file)) => (Some(c), file.display().to_string()),
        _ => match TrainConfig::of_run(dir)? {
            Some((file, c)) => (Some(c), format!("the run's config {}", file.display())),
            None => (None, String::new()),
        },
    };
    let (patterns, settings) = config.map(|c| (c.data.eval, c.eval)).unwrap_or_default();
    let index = if args.data.is_empty() {
        if patterns.is_empty() {
            bail!("no evaluation data: pass --data, or a --config whose `data.eval` names it");
        }
        let files = expand_patterns(&patterns)
            .with_context(|| format!("`data.eval` of {source}: pass --data where it moved"))?;
        RecordIndex::build(&files)?
    } else {
        RecordIndex::build(&expand_patterns(&args.data).context("--data")?)?
    };
    parse_device(&args.device)?.run(Evaluation {
        trained: &trained,
        settings: &settings,
        index: &index,
    })
}

/// A trained model scored on an evaluation set, as a [`BackendJob`].
struct Evaluation<'a> {
    trained: &'a TrainedModel,
    settings: &'a EvalSettings,
    index: &'a RecordIndex,
}

impl BackendJob for Evaluation<'_> {
    type Output = Metrics;
    fn run<B: SsdBackend>(self, devices: Vec<B::Device>) -> Result<Metrics> {
        let device = &devices[0];
        let config = &self.trained.config;
        let net = self.trained.load::<B>(device)?;
        let settings = self.settings;
        let run = run_on_dataset(
            &net,
            config,
            self.index,
            (settings.max_images, settings.batch_size),
            0,
            device,
            &AtomicBool::new(false),
        )?
        .context("the evaluation stopped before its end")?;
        let names: Vec<String> = (1..=config.num_classes)
            .map(|i| config.class_name(i))
            .collect();
        Ok(evaluate(&run.results, &names))
    }
}
