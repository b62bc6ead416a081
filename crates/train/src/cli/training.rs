//! The default command: train a config on the chosen devices.

use std::path::{Path, PathBuf};
use std::process::ExitCode;
use std::time::Duration;

use anyhow::{Context, Result, bail};
use data::shards::expand_patterns;
use train::config::TrainConfig;
use train::devices::{check_memory, parse_devices};
use train::learner::{RunOptions, RunSummary, STOPPED_EXIT_STATUS, TrainingJob};
use train::sync::{Cluster, TOKEN_ENV};

use super::evaluate::print_metrics;

#[derive(clap::Args)]
pub struct TrainArgs {
    /// Devices: CUDA ordinals `0,1`, `cpu` (one replica), `cpu:N` (N replicas on the CPU,
    /// through the same data-parallel path), `wgpu` (a Vulkan, Metal or DirectX 12 GPU) or
    /// `wgpu:0,1` (two wgpu devices, on one GPU or several). Default: every CUDA device found,
    /// else `cpu`.
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
    /// The coordinator, `tcp://HOST:PORT` with HOST the rank-0 machine: rank 0 listens on
    /// that address, the others connect to it (needed with --nodes).
    #[arg(long)]
    coordinator: Option<String>,
    /// Where rank 0 listens instead, `HOST:PORT` (e.g. `0.0.0.0:29500` for every interface,
    /// when the coordinator's name is not an address of rank 0's own).
    #[arg(long)]
    listen: Option<String>,
    /// The shared secret of a multi-node run (at least 16 characters, the same on every node);
    /// default: the SSD_BURN_CLUSTER_TOKEN environment variable. Prefer the variable: a
    /// command line is visible to other users of the machine.
    #[arg(long)]
    cluster_token: Option<String>,
    /// Seconds to wait for the other nodes (to connect, or in one exchange) before ending the
    /// run with an error; rank 0's evaluations must fit in it.
    #[arg(long, default_value_t = 300.0)]
    node_timeout: f64,
}

/// Trains as `args` say and prints what the run did; the exit status tells a stop request
/// ([`STOPPED_EXIT_STATUS`]) from the end of the run.
pub fn run(args: TrainArgs) -> Result<ExitCode> {
    let (devices, first_line) = parse_devices(args.devices.as_deref())?;
    eprintln!("{first_line}");
    let config = config_with_overrides(&args)?;
    check_memory(&config, &devices)?;
    ensure_training_data(&config)?;
    let model_dir = args.model_dir.clone().unwrap_or_else(|| {
        PathBuf::from("runs").join(
            args.config
                .file_stem()
                .and_then(|s| s.to_str())
                .unwrap_or("run"),
        )
    });
    let options = RunOptions {
        model_dir: model_dir.clone(),
        stop: super::stop_signals::stop_flag()?,
        verbose: true,
        cluster: cluster(&args)?,
        repeat_first_batch: false,
    };
    let summary = devices.run(TrainingJob {
        config: &config,
        options: &options,
    })?;
    print_summary(&summary, &model_dir);
    if summary.stopped {
        eprintln!(
            "stopped on request at step {} of {}: run the same command to resume (exit status {STOPPED_EXIT_STATUS})",
            summary.step, config.train.num_steps
        );
        return Ok(ExitCode::from(STOPPED_EXIT_STATUS));
    }
    Ok(ExitCode::SUCCESS)
}

/// The config file with the command line's overrides, validated.
fn config_with_overrides(args: &TrainArgs) -> Result<TrainConfig> {
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
        config.data.train = args.train_data.clone();
    }
    if !args.eval_data.is_empty() {
        config.data.eval = args.eval_data.clone();
    }
    if args.no_eval {
        config.data.eval.clear();
    }
    config.validate()?;
    Ok(config)
}

/// Generates the synthetic set where the config asks for it and its data is missing.
fn ensure_training_data(config: &TrainConfig) -> Result<()> {
    if !config.data.synthetic_if_missing || expand_patterns(&config.data.train).is_ok() {
        return Ok(());
    }
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
    Ok(())
}

/// This process's place in a multi-node run, `None` for a run on this machine alone.
fn cluster(args: &TrainArgs) -> Result<Option<Cluster>> {
    match (args.nodes, &args.coordinator) {
        (1, None) => Ok(None),
        (1, Some(_)) => bail!("--coordinator needs --nodes N with N >= 2"),
        (_, None) => bail!("--nodes {} needs --coordinator tcp://HOST:PORT", args.nodes),
        (nodes, Some(coordinator)) => {
            if !(args.node_timeout.is_finite() && args.node_timeout > 0.0) {
                bail!("--node-timeout must be a positive number of seconds");
            }
            let token = match &args.cluster_token {
                Some(t) => t.clone(),
                None => std::env::var(TOKEN_ENV).with_context(|| {
                    format!("a multi-node run needs a shared secret: set {TOKEN_ENV} (or --cluster-token) to the same value of at least 16 characters on every node")
                })?,
            };
            let timeout = Duration::from_secs_f64(args.node_timeout);
            let cluster = Cluster::new(nodes, args.node_rank, coordinator, &token, timeout)?;
            match &args.listen {
                Some(address) => Ok(Some(cluster.listening_on(address)?)),
                None => Ok(Some(cluster)),
            }
        }
    }
}

fn print_summary(summary: &RunSummary, model_dir: &Path) {
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
}
