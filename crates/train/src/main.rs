//! `cargo run --release -p train -- [--devices 0,1|cpu|cpu:N] [--config FILE] ...`
//! and `... eval ...`.

use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

use anyhow::{Context, Result, bail};
use burn::backend::Flex;
use clap::{Parser, Subcommand};
use data::shards::expand_patterns;
use data::tfrecord::RecordIndex;
use model::ops::SsdBackend;
use train::cluster::Cluster;
use train::config::{EvalSettings, TrainConfig};
use train::devices::{Devices, parse_devices};
use train::eval::{read_coco, run_on_dataset};
use train::learner::{RunOptions, train};
use train::metrics::{COCO_NAMES, Metrics, evaluate};
use train::trained::{TrainedModel, Weights};

#[derive(Parser)]
#[command(
    name = "train",
    about = "Train SSD-MobileNet-v1 detectors on one device or many",
    version
)]
struct Cli {
    #[command(subcommand)]
    command: Option<Command>,
    #[command(flatten)]
    train: TrainArgs,
}

#[derive(clap::Args)]
struct TrainArgs {
    /// Devices: CUDA ordinals `0,1`, `cpu` (one replica) or `cpu:N` (N replicas on the CPU,
    /// through the same data-parallel path). Default: every CUDA device found, else `cpu`.
    #[arg(long)]
    devices: Option<String>,
    /// Training config (JSON).
    #[arg(long, default_value = "configs/synthetic.json")]
    config: PathBuf,
    /// Where checkpoints, metrics and evaluations go (default: runs/<config name>). An
    /// existing checkpoint there is resumed.
    #[arg(long)]
    model_dir: Option<PathBuf>,
    /// Override `train.num_steps`.
    #[arg(long)]
    num_steps: Option<u64>,
    /// Override `train.seed`.
    #[arg(long)]
    seed: Option<u64>,
    /// Override `train.batch_size` (the global batch, over all replicas).
    #[arg(long)]
    batch_size: Option<usize>,
    /// Override `data.train` (TFRecord files, globs or base@N).
    #[arg(long, num_args = 1..)]
    train_data: Vec<String>,
    /// Override `data.eval`.
    #[arg(long, num_args = 1..)]
    eval_data: Vec<String>,
    /// Skip evaluation (benchmarks).
    #[arg(long, conflicts_with = "eval_data")]
    no_eval: bool,
    /// Machines (processes) in a multi-node run; each runs this command with its own
    /// `--node-rank` and its local `--devices`.
    #[arg(long, default_value_t = 1)]
    nodes: usize,
    /// This node's rank, 0..nodes. Rank 0 serves the coordinator address, writes checkpoints
    /// and evaluates.
    #[arg(long, default_value_t = 0)]
    node_rank: usize,
    /// The coordinator, `ws://HOST:PORT` with HOST the rank-0 machine: rank 0 listens on PORT,
    /// the others connect to it (needed with --nodes).
    #[arg(long)]
    coordinator: Option<String>,
    /// Seconds to wait for the other nodes (to connect, or in one exchange) before ending the
    /// run with an error; rank 0's evaluations must fit in it.
    #[arg(long, default_value_t = 300.0)]
    node_timeout: f64,
}

#[derive(Subcommand)]
enum Command {
    /// Evaluate a checkpoint on a dataset, or score COCO-format detections against COCO ground
    /// truth; prints the COCO and VOC metrics.
    Eval {
        /// The model: a model dir (its latest checkpoint), a checkpoint folder, an exported
        /// `.safetensors` file or a TensorFlow checkpoint prefix.
        #[arg(long, conflicts_with_all = ["ground_truth", "detections"])]
        model_dir: Option<PathBuf>,
        /// Training config (JSON or pipeline.config): the model config (default: the one
        /// stored with the weights) and `data.eval` / `eval` settings.
        #[arg(long)]
        config: Option<PathBuf>,
        /// Raw or moving-average weights (default: the moving average where there is one).
        #[arg(long, value_enum)]
        weights: Option<Weights>,
        /// Evaluation TFRecords (default: the config's `data.eval`).
        #[arg(long, num_args = 1..)]
        data: Vec<String>,
        /// COCO ground truth JSON.
        #[arg(long, requires = "detections")]
        ground_truth: Option<PathBuf>,
        /// COCO results JSON (`[{image_id, category_id, bbox, score}]`).
        #[arg(long, requires = "ground_truth")]
        detections: Option<PathBuf>,
        /// Device: `cpu` or a CUDA ordinal.
        #[arg(long, default_value = "cpu")]
        device: String,
        /// Write the metrics as JSON here.
        #[arg(long)]
        out: Option<PathBuf>,
    },
    /// Detect objects in images (files, folders or globs) with a checkpoint: each image is
    /// written as PNG with coloured, labelled boxes and scores, and every detection goes to
    /// `OUT/detections.json`.
    Detect {
        #[command(flatten)]
        checkpoint: CheckpointArgs,
        /// Output folder.
        #[arg(long)]
        out: PathBuf,
        /// Keep detections scoring at least this.
        #[arg(long, default_value_t = 0.5)]
        score_threshold: f32,
        /// At most this many detections per image.
        #[arg(long, default_value_t = 20)]
        max_detections: usize,
        /// Device: `cpu` or a CUDA ordinal.
        #[arg(long, default_value = "cpu")]
        device: String,
        /// Image files, folders or glob patterns.
        #[arg(required = true)]
        images: Vec<String>,
    },
    /// Convert a TF Object Detection API `pipeline.config` into a JSON training config,
    /// listing every setting that is ignored or still to be filled in (an unsupported setting
    /// is an error). `--config` also takes a `.config` file directly.
    ImportConfig {
        /// The `pipeline.config` file.
        pipeline: PathBuf,
        /// The JSON config to write.
        #[arg(long)]
        out: PathBuf,
    },
    /// Draw the run's charts (loss parts, learning rate, evaluation metrics over steps) as PNG
    /// into the model dir from its `metrics.jsonl` (also done at the end of every run).
    Plot {
        /// The model dir.
        #[arg(long)]
        model_dir: PathBuf,
    },
    /// Write a model's inference weights (by default its moving-average weights when it keeps
    /// them) as safetensors (names in `model::portable`, the model config in the metadata;
    /// `model::Detector::load` takes the file), or the inference network as TFLite or ONNX
    /// (`model::export`); the model config goes beside it as JSON (`FILE.json`).
    Export {
        #[command(flatten)]
        checkpoint: CheckpointArgs,
        /// The file to write.
        #[arg(long)]
        out: PathBuf,
        /// What to write.
        #[arg(long, value_enum, default_value_t = Format::Safetensors)]
        format: Format,
    },
    /// Convert a TensorFlow Object Detection API checkpoint (`PREFIX.index` +
    /// `PREFIX.data-*`) of SSD-MobileNet-v1 into safetensors (as `export` writes them), to
    /// continue training it (`train.fine_tune_checkpoint`) or to deploy it.
    ImportCheckpoint {
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
    },
}

/// The formats of `train export`.
#[derive(Clone, Copy, clap::ValueEnum)]
enum Format {
    /// The weights, for `model::Detector` and further training.
    Safetensors,
    /// A `.tflite` flatbuffer with the `TFLite_Detection_PostProcess` op.
    Tflite,
    /// An ONNX model with the raw outputs and the decoded boxes.
    Onnx,
}

/// A trained model: its weights and its config.
#[derive(clap::Args)]
struct CheckpointArgs {
    /// The model: a model dir (its latest checkpoint), a checkpoint folder, an exported
    /// `.safetensors` file or a TensorFlow checkpoint prefix.
    #[arg(long)]
    model_dir: PathBuf,
    /// Config of the model, JSON or pipeline.config (default: the one stored with the
    /// weights; a TensorFlow checkpoint needs one).
    #[arg(long)]
    config: Option<PathBuf>,
    /// Raw or moving-average weights (default: the moving average where there is one).
    #[arg(long, value_enum)]
    weights: Option<Weights>,
}

impl CheckpointArgs {
    fn locate(&self) -> Result<TrainedModel> {
        let config = self.config.as_deref().map(TrainConfig::load).transpose()?;
        TrainedModel::locate(&self.model_dir, config.map(|c| c.model), self.weights)
    }
}

fn main() -> Result<()> {
    train::allocator::keep_freed_memory();
    tracing_subscriber::fmt()
        .with_env_filter(tracing_subscriber::EnvFilter::from_default_env())
        .with_writer(std::io::stderr)
        .init();
    let cli = Cli::parse();
    match cli.command {
        None => run_training(cli.train),
        Some(Command::Eval {
            model_dir,
            config,
            weights,
            data,
            ground_truth,
            detections,
            device,
            out,
        }) => {
            let metrics = match (ground_truth, detections, model_dir) {
                (Some(gt), Some(dt), _) => {
                    let (images, names) = read_coco(&gt, &dt)?;
                    evaluate(&images, &names)
                }
                (_, _, Some(dir)) => {
                    let config = config.as_deref().map(TrainConfig::load).transpose()?;
                    eval_checkpoint(&dir, config, weights, &data, &device)?
                }
                _ => bail!("eval needs --model-dir, or --ground-truth with --detections"),
            };
            print_metrics(&metrics);
            if let Some(out) = out {
                model::weights::write_atomic(
                    &out,
                    serde_json::to_string_pretty(&metrics)?.as_bytes(),
                )
                .with_context(|| format!("writing {}", out.display()))?;
            }
            Ok(())
        }
        Some(Command::Export {
            checkpoint,
            out,
            format,
        }) => export(&checkpoint.locate()?, &out, format),
        Some(Command::ImportCheckpoint {
            prefix,
            config,
            out,
            moving_average,
        }) => {
            if !model::tf::bundle::is_checkpoint(&prefix) {
                bail!(
                    "{}: no TensorFlow checkpoint there (no {}.index)",
                    prefix.display(),
                    prefix.display()
                );
            }
            let config = TrainConfig::load(&config)?.model;
            let weights = if moving_average {
                Weights::MovingAverage
            } else {
                Weights::Raw
            };
            export(
                &TrainedModel::locate(&prefix, Some(config), Some(weights))?,
                &out,
                Format::Safetensors,
            )
        }
        Some(Command::ImportConfig { pipeline, out }) => {
            let imported = train::pipeline_config::import(&pipeline)?;
            for note in &imported.notes {
                eprintln!("note: {note}");
            }
            let json = serde_json::to_string_pretty(&imported.config)? + "\n";
            model::weights::write_atomic(&out, json.as_bytes())
                .with_context(|| format!("writing {}", out.display()))?;
            eprintln!("wrote {}", out.display());
            Ok(())
        }
        Some(Command::Plot { model_dir }) => {
            for f in train::charts::write_charts(&model_dir)? {
                println!("{}", f.display());
            }
            Ok(())
        }
        Some(Command::Detect {
            checkpoint,
            out,
            score_threshold,
            max_detections,
            device,
            images,
        }) => {
            let trained = checkpoint.locate()?;
            let files = train::detect::image_files(&images)?;
            fn run<B: SsdBackend>(
                trained: &TrainedModel,
                files: &[PathBuf],
                out: &Path,
                threshold: f32,
                max: usize,
                device: B::Device,
            ) -> Result<usize> {
                let net = trained.load::<B>(&device)?;
                let detector = model::Detector::new(trained.config.clone(), net, &device)?;
                let results = train::detect::detect_files(&detector, files, out, threshold, max)?;
                Ok(results.iter().map(|r| r.detections.len()).sum())
            }
            let (t, m) = (score_threshold, max_detections);
            let found = match device.as_str() {
                "cpu" => run::<Flex>(&trained, &files, &out, t, m, Default::default())?,
                #[cfg(feature = "cuda")]
                d => {
                    let i: usize = d
                        .parse()
                        .with_context(|| format!("--device {d}: expected cpu or a CUDA ordinal"))?;
                    let device = burn::backend::cuda::CudaDevice::new(i);
                    run::<burn::backend::Cuda>(&trained, &files, &out, t, m, device)?
                }
                #[cfg(not(feature = "cuda"))]
                d => bail!("--device {d}: built without the `cuda` feature"),
            };
            println!(
                "{found} detections in {} images; drawn images and detections.json in {}",
                files.len(),
                out.display()
            );
            Ok(())
        }
    }
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
    model::weights::write_atomic(
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

fn print_metrics(m: &Metrics) {
    for (n, v) in COCO_NAMES.iter().zip(m.coco()) {
        println!("{n:>6} {v:.4}");
    }
    println!("VOC mAP@0.5 {:.4}", m.voc_mAP);
    for (c, ap) in &m.voc_AP {
        println!("  {c}: {ap:.4}");
    }
}

fn eval_checkpoint(
    dir: &Path,
    config: Option<TrainConfig>,
    weights: Option<Weights>,
    data: &[String],
    device: &str,
) -> Result<Metrics> {
    let trained = TrainedModel::locate(dir, config.as_ref().map(|c| c.model.clone()), weights)?;
    let settings = config.map(|c| (c.data.eval, c.eval)).unwrap_or_default();
    let patterns = if data.is_empty() {
        settings.0
    } else {
        data.to_vec()
    };
    if patterns.is_empty() {
        bail!("no evaluation data: pass --data or set `data.eval` in the config");
    }
    let index = RecordIndex::build(&expand_patterns(&patterns)?)?;
    let names: Vec<String> = (1..=trained.config.num_classes)
        .map(|i| trained.config.class_name(i))
        .collect();
    fn run<B: SsdBackend>(
        trained: &TrainedModel,
        eval: &EvalSettings,
        index: &RecordIndex,
        names: &[String],
        device: B::Device,
    ) -> Result<Metrics> {
        let net = trained.load::<B>(&device)?;
        let results = run_on_dataset(
            &net,
            &trained.config,
            index,
            eval.max_images,
            eval.batch_size,
            &device,
        )?;
        Ok(evaluate(&results, names))
    }
    let eval = &settings.1;
    match device {
        "cpu" => run::<Flex>(&trained, eval, &index, &names, Default::default()),
        #[cfg(feature = "cuda")]
        d => {
            let i: usize = d
                .parse()
                .with_context(|| format!("--device {d}: expected cpu or a CUDA ordinal"))?;
            run::<burn::backend::Cuda>(
                &trained,
                eval,
                &index,
                &names,
                burn::backend::cuda::CudaDevice::new(i),
            )
        }
        #[cfg(not(feature = "cuda"))]
        d => bail!("--device {d}: built without the `cuda` feature"),
    }
}

fn run_training(args: TrainArgs) -> Result<()> {
    let (devices, first_line) = parse_devices(args.devices.as_deref())?;
    eprintln!("{first_line}");
    let mut config = TrainConfig::load(&args.config)?;
    if let Some(n) = args.num_steps {
        config.train.num_steps = n;
    }
    if let Some(s) = args.seed {
        config.train.seed = s;
    }
    if let Some(b) = args.batch_size {
        config.train.batch_size = b;
    }
    if !args.train_data.is_empty() {
        config.data.train = args.train_data;
    }
    if !args.eval_data.is_empty() {
        config.data.eval = args.eval_data;
    }
    if args.no_eval {
        config.data.eval.clear();
    }
    config.validate()?;
    if config.data.synthetic_if_missing && expand_patterns(&config.data.train).is_err() {
        let pattern = PathBuf::from(&config.data.train[0]);
        let out = pattern
            .parent()
            .map(Path::to_path_buf)
            .unwrap_or_else(|| PathBuf::from("datasets/synthetic"));
        eprintln!(
            "training data {} missing: generating the synthetic set into {}",
            config.data.train[0],
            out.display()
        );
        data::prepare::prepare_synthetic(&out, 42, 3000, 300, 4, &|_, _| {})?;
    }
    let model_dir = args.model_dir.unwrap_or_else(|| {
        PathBuf::from("runs").join(
            args.config
                .file_stem()
                .and_then(|s| s.to_str())
                .unwrap_or("run"),
        )
    });
    let stop = Arc::new(AtomicBool::new(false));
    {
        let stop = stop.clone();
        ctrlc::set_handler(move || {
            eprintln!("interrupted: finishing the step and writing a checkpoint");
            stop.store(true, Ordering::Relaxed);
        })
        .context("installing the Ctrl-C handler")?;
    }
    let cluster = match (args.nodes, &args.coordinator) {
        (1, None) => None,
        (1, Some(_)) => bail!("--coordinator needs --nodes N with N >= 2"),
        (_, None) => bail!("--nodes {} needs --coordinator ws://HOST:PORT", args.nodes),
        (nodes, Some(coordinator)) => {
            if !(args.node_timeout.is_finite() && args.node_timeout > 0.0) {
                bail!("--node-timeout must be a positive number of seconds");
            }
            Some(Cluster::new(
                nodes,
                args.node_rank,
                coordinator,
                Duration::from_secs_f64(args.node_timeout),
            )?)
        }
    };
    let options = RunOptions {
        model_dir: model_dir.clone(),
        stop,
        verbose: true,
        cluster,
        repeat_first_batch: false,
    };
    let summary = match devices {
        Devices::Cpu(n) => train::<Flex>(&config, &vec![Default::default(); n], &options)?,
        #[cfg(feature = "cuda")]
        Devices::Cuda(ids) => {
            let devs: Vec<_> = ids
                .into_iter()
                .map(burn::backend::cuda::CudaDevice::new)
                .collect();
            train::<burn::backend::Cuda>(&config, &devs, &options)?
        }
        #[cfg(not(feature = "cuda"))]
        Devices::Cuda(_) => bail!("built without the `cuda` feature"),
    };
    eprintln!(
        "done: step {} ({} this run) in {:.0} s, {:.2} images/s, {:.1}% of the time in gradient sync; last loss {:.4}",
        summary.step,
        summary.steps_this_run,
        summary.seconds,
        summary.images_per_sec,
        100.0 * summary.sync_seconds / summary.seconds.max(1e-9),
        summary.last_loss.total
    );
    if let Some(m) = &summary.metrics {
        print_metrics(m);
    }
    if let Some(c) = &summary.checkpoint {
        eprintln!("checkpoint: {}", c.display());
    }
    eprintln!("metrics log: {}", model_dir.join("metrics.jsonl").display());
    Ok(())
}
