//! The default command: train a config on the chosen devices.

use std::path::{Path, PathBuf};
use std::process::ExitCode;

use anyhow::{Result, anyhow};
use data::prepare::SYNTHETIC_DIR;
use data::shards::expand_patterns;
use train::config::TrainConfig;
use train::devices::{check_memory, cuda_device_count, parse_devices};
use train::learner::{RunOptions, RunSummary, STOPPED_EXIT_STATUS, TrainingJob};
#[cfg(feature = "mpi")]
use train::sync::mpi::MpiSession;
use train::sync::{Launch, Nodes};

use super::evaluate::print_metrics;

#[derive(clap::Args)]
pub struct TrainArgs {
    /// Devices: CUDA ordinals `0,1`, `cpu` (one replica), `cpu:N` (N replicas on the CPU,
    /// through the same data-parallel path), `wgpu` (a Vulkan, Metal or DirectX 12 GPU) or
    /// `wgpu:0,1` (two wgpu devices, on one GPU or several). Default: every CUDA device found
    /// (under mpirun or srun with several processes on a machine: the GPU of the process's
    /// local rank), else `cpu`.
    #[arg(long)]
    devices: Option<String>,
    /// Training config: JSON, or the TF Object Detection API's `pipeline.config` (a
    /// `.config` file, imported on the fly).
    #[arg(long, default_value = DEFAULT_CONFIG)]
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
    /// Train without locking the model dir, on a filesystem that refuses locks (Lustre
    /// mounted `noflock`): nothing then stops a second run on the same dir from mixing its
    /// checkpoints and logs with this one's.
    #[arg(long)]
    risk_concurrent_writers: bool,
    /// In a multi-node run, the longest wait in seconds for the other processes in an
    /// exchange (MPI's or NCCL's) before the job is ended: a process that died or lost its
    /// link never answers. It must exceed the longest evaluation and checkpoint of rank 0,
    /// which the others wait for.
    #[arg(long, default_value_t = 1800, value_name = "SECONDS")]
    #[cfg_attr(not(feature = "mpi"), allow(dead_code))] // a build without MPI has no job
    node_timeout: u64,
}

/// The config a bare `train` trains, relative to the checkout's root.
const DEFAULT_CONFIG: &str = "configs/synthetic.json";

/// Trains as `args` say and prints what the run did; the exit status tells a stop request
/// ([`STOPPED_EXIT_STATUS`]) from the end of the run. A process of a job of several (mpirun,
/// srun) joins the others through MPI; when it fails, it says why and ends the whole job.
pub fn run(args: TrainArgs) -> Result<ExitCode> {
    let launch = Launch::from_env(|k| std::env::var(k).ok()).map_err(|e| anyhow!(e))?;
    match launch {
        None => train(args, None),
        Some(launch) => train_in_job(args, &launch),
    }
}

/// [`train`] as one process of a job of several: MPI joins it to the others, and when it
/// fails it says why and ends the whole job.
#[cfg(feature = "mpi")]
fn train_in_job(args: TrainArgs, launch: &Launch) -> Result<ExitCode> {
    let timeout = std::time::Duration::from_secs(args.node_timeout);
    let (session, nodes) = MpiSession::start(timeout).map_err(|e| anyhow!(e))?;
    if (nodes.rank, nodes.count()) != (launch.rank, launch.processes) {
        anyhow::bail!(
            "{} says process {} of {}, MPI says {} of {}: is this binary linked against the MPI library of the launcher?",
            launch.launcher,
            launch.rank,
            launch.processes,
            nodes.rank,
            nodes.count()
        );
    }
    match train(args, Some((launch, nodes))) {
        Err(e) => {
            eprintln!(
                "Error: process {} of {}: {e:?}",
                launch.rank, launch.processes
            );
            session.abort(1)
        }
        done => done,
    }
}

/// Without MPI no process of a job of several trains: each would train alone.
#[cfg(not(feature = "mpi"))]
fn train_in_job(_args: TrainArgs, launch: &Launch) -> Result<ExitCode> {
    Err(anyhow!(launch.without_mpi()))
}

/// The run itself, alone or as one process of a job.
fn train(args: TrainArgs, job: Option<(&Launch, Nodes)>) -> Result<ExitCode> {
    let spec = devices_spec(&args, job.as_ref().map(|(launch, _)| *launch));
    let leader = job.as_ref().is_none_or(|(_, nodes)| nodes.rank == 0);
    let (devices, first_line) = parse_devices(spec.as_deref())?;
    if leader {
        eprintln!("{first_line}");
    }
    let config = config_with_overrides(&args)?;
    check_memory(&config, &devices)?;
    ensure_training_data(&config, &args)?;
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
        // the other processes of a job would repeat the leader's lines
        verbose: leader,
        nodes: job.map(|(_, nodes)| nodes),
        repeat_first_batch: false,
        without_lock: args.risk_concurrent_writers,
    };
    let summary = TrainingJob {
        config: &config,
        options: &options,
    }
    .run_on(&devices)?;
    if leader {
        print_summary(&summary, &model_dir, config.train.num_steps);
    }
    if summary.stopped {
        if leader {
            eprintln!(
                "stopped on request at step {} of {}{}: run the same command to resume (exit status {STOPPED_EXIT_STATUS})",
                summary.step,
                config.train.num_steps,
                if summary.step == config.train.num_steps {
                    ", before the final evaluation"
                } else {
                    ""
                }
            );
        }
        return Ok(ExitCode::from(STOPPED_EXIT_STATUS));
    }
    Ok(ExitCode::SUCCESS)
}

/// The `--devices` value: the command line's, else, for one of several processes on a
/// machine with several GPUs, the GPU of its local rank.
fn devices_spec(args: &TrainArgs, launch: Option<&Launch>) -> Option<String> {
    if args.devices.is_some() {
        return args.devices.clone();
    }
    let gpu = launch?.gpu(cuda_device_count())?;
    eprintln!(
        "one of several processes on this machine: training on CUDA device {gpu}, that of its local rank (--devices overrides)"
    );
    Some(gpu.to_string())
}

/// The config file with the command line's overrides, validated.
fn config_with_overrides(args: &TrainArgs) -> Result<TrainConfig> {
    if args.config == Path::new(DEFAULT_CONFIG) && !args.config.exists() {
        anyhow::bail!(
            "no {DEFAULT_CONFIG} here ({}): pass --config FILE (JSON or pipeline.config), or run from the checkout's root for the synthetic default",
            std::env::current_dir().map_or_else(|_| "?".into(), |d| d.display().to_string())
        );
    }
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

/// Generates the synthetic set where the config asks for it, its data paths are that set's
/// own, no flag named other data and the files are missing; nothing is written anywhere else
/// (a mistyped path is the learner's error, naming it and what exists nearest).
fn ensure_training_data(config: &TrainConfig, args: &TrainArgs) -> Result<()> {
    let out = Path::new(SYNTHETIC_DIR);
    let own = |split: &str| vec![format!("{SYNTHETIC_DIR}/{split}.record-*")];
    let wanted = config.data.synthetic_if_missing
        && args.train_data.is_empty()
        && args.eval_data.is_empty()
        && config.data.train == own("train")
        && (config.data.eval.is_empty() || config.data.eval == own("val"));
    if !wanted || expand_patterns(&config.data.train).is_ok() {
        return Ok(());
    }
    eprintln!(
        "training data {} missing: generating the synthetic set into {} (`cargo xtask prepare-data` does the same)",
        config.data.train[0],
        out.display()
    );
    data::prepare::prepare_synthetic(out, 42, 3000, 300, 4, &|_, _| {})?;
    Ok(())
}

fn print_summary(summary: &RunSummary, model_dir: &Path, num_steps: u64) {
    if summary.steps_this_run == 0 && !summary.stopped {
        match &summary.metrics {
            None => eprintln!(
                "nothing to do: {} is at step {} and the config's num_steps is {num_steps} (--num-steps trains further)",
                model_dir.display(),
                summary.step
            ),
            Some(m) => {
                eprintln!(
                    "done: the final evaluation of step {}, which a stop request had interrupted",
                    summary.step
                );
                print_metrics(m);
            }
        }
        return;
    }
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
