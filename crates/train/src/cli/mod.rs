//! The command line: training (the default command, [`training`]) and the subcommands, one
//! module each.

mod detect;
mod evaluate;
mod export;
mod stop_signals;
mod training;

use std::path::PathBuf;
use std::process::ExitCode;

use anyhow::{Context, Result};
use clap::{Parser, Subcommand};
use train::config::TrainConfig;
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
    train: training::TrainArgs,
}

#[derive(Subcommand)]
enum Command {
    Eval(evaluate::EvalArgs),
    Detect(detect::DetectArgs),
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
    Export(export::ExportArgs),
    ImportCheckpoint(export::ImportCheckpointArgs),
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

/// Parses the command line and runs the command.
pub fn main() -> Result<ExitCode> {
    // SAFETY: the first thing `main` does: the process has one thread
    #[cfg(feature = "cuda")]
    unsafe {
        train::devices::kernel_cache::point_driver_cache()
    };
    train::allocator::keep_freed_memory();
    tracing_subscriber::fmt()
        .with_env_filter(tracing_subscriber::EnvFilter::from_default_env())
        .with_writer(std::io::stderr)
        .init();
    let cli = Cli::parse();
    let done = match cli.command {
        None => return training::run(cli.train),
        Some(Command::Eval(args)) => evaluate::run(args),
        Some(Command::Detect(args)) => detect::run(args),
        Some(Command::Export(args)) => export::run(args),
        Some(Command::ImportCheckpoint(args)) => export::import_checkpoint(args),
        Some(Command::ImportConfig { pipeline, out }) => import_config(&pipeline, &out),
        Some(Command::Plot { model_dir }) => {
            let charts = train::report::charts::write_charts(&model_dir)?;
            for f in &charts.files {
                println!("{}", f.display());
            }
            if let Some(note) = charts.note() {
                eprintln!("note: {note}");
            }
            Ok(())
        }
    };
    done.map(|()| ExitCode::SUCCESS)
}

fn import_config(pipeline: &std::path::Path, out: &std::path::Path) -> Result<()> {
    let imported = train::config::pipeline::import(pipeline)?;
    for note in &imported.notes {
        eprintln!("note: {note}");
    }
    let json = serde_json::to_string_pretty(&imported.config)? + "\n";
    model::io::write_atomic(out, json.as_bytes())
        .with_context(|| format!("writing {}", out.display()))?;
    eprintln!("wrote {}", out.display());
    Ok(())
}
