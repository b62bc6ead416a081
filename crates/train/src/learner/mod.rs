//! The data-parallel learner: one replica per device (or several on the CPU), each a thread
//! holding a copy of the network made from one record, taking a disjoint slice of every global
//! batch; gradients are averaged by a bucketed all-reduce so the replicas stay identical.
//!
//! [`train`] reads top-down: the run's setup, the starting point (`start`), the gradient
//! exchange, the replica pool (`pool`, each replica in `replica`), then the steps, each
//! logged (`run_log`), checkpointed (`checkpointing`) and evaluated (`evaluation`) when
//! due, and the summary.

mod batches;
mod checkpointing;
mod evaluation;
mod lock;
mod pool;
mod replica;
mod run_log;
mod start;

use std::path::PathBuf;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Instant;

use anyhow::{Context, Result, bail};
use data::loader::{Loader, LoaderConfig, Position};
use data::shards::expand_patterns;
use data::tfrecord::RecordIndex;
use model::ops::SsdBackend;

use self::batches::Batches;
use self::checkpointing::{RunState, Saved};
pub use self::lock::{LOCK_FILE, ModelDirLock};
use self::pool::{Blueprint, ReplicaPool, StepCommand};
pub use self::replica::LossValues;
use self::run_log::{RunLog, StepRecord};
use crate::checkpoint;
use crate::config::TrainConfig;
use crate::devices::BackendJob;
use crate::eval::Metrics;
use crate::sync::{Bucketing, GradientSync, InProcessAllReduce, Nodes, Transfer};

/// How a run is driven.
#[derive(Debug, Clone)]
pub struct RunOptions {
    /// Checkpoints, metrics and evaluations go here; an existing checkpoint is resumed.
    pub model_dir: PathBuf,
    /// Set (by SIGINT, SIGTERM or SIGUSR1 in `train`) to checkpoint and stop after the
    /// current step; an evaluation under way is abandoned.
    pub stop: Arc<AtomicBool>,
    /// Print progress lines.
    pub verbose: bool,
    /// This process's place in a multi-node run; `None` trains on this machine alone.
    pub nodes: Option<Nodes>,
    /// For benchmarks: every step trains on the first batch again, and the data loader stops
    /// once it has made that batch, so the steps run without the data pipeline beside them
    /// (checkpoints then record the position after the first batch).
    pub repeat_first_batch: bool,
    /// Train without the model dir's lock, where the filesystem has none (`train
    /// --risk-concurrent-writers`): nothing then stops a second run on the same dir.
    pub without_lock: bool,
}

/// What a run did.
#[derive(Debug, Clone)]
pub struct RunSummary {
    /// Step reached.
    pub step: u64,
    /// Steps taken by this run (not counting resumed ones).
    pub steps_this_run: u64,
    /// Loss of the last step.
    pub last_loss: LossValues,
    /// Training images per second over the run.
    pub images_per_sec: f64,
    /// Seconds spent in gradient synchronisation, summed over steps (mean over replicas).
    pub sync_seconds: f64,
    /// Wall time of each step of this run (waiting for its batch included).
    pub step_seconds: Vec<f64>,
    /// Seconds the steps spent waiting for the data loader, summed.
    pub data_wait_seconds: f64,
    /// Wall time of the run.
    pub seconds: f64,
    /// The last evaluation.
    pub metrics: Option<Metrics>,
    /// The last checkpoint.
    pub checkpoint: Option<PathBuf>,
    /// A stop request ended the run before `num_steps` (its checkpoint written).
    pub stopped: bool,
}

/// `train`'s exit status when a stop request ended the run before `num_steps` with its
/// checkpoint written: EX_TEMPFAIL of sysexits.h, "try again", so a requeue script can tell it
/// from success (0) and from failure (1). A second request ends the process at once with
/// 128 + the signal's number, as a shell reports death by that signal.
pub const STOPPED_EXIT_STATUS: u8 = 75;

/// Trains `config` on `devices` (one replica each; repeat a device for several replicas).
pub fn train<B: SsdBackend>(
    config: &TrainConfig,
    devices: &[B::Device],
    options: &RunOptions,
) -> Result<RunSummary> {
    let shape = RunShape::of(devices.len(), options.nodes.as_ref(), config)?;
    let per_replica = config.train.batch_size / shape.total_replicas();
    // the data first: a path that matches nothing leaves no model dir behind
    let (index, eval_index) = record_indexes(config)?;
    std::fs::create_dir_all(&options.model_dir)
        .with_context(|| format!("creating {}", options.model_dir.display()))?;
    // held to the end of the run: one writer per model dir
    let _lock = match shape.leader() && !options.without_lock {
        true => Some(ModelDirLock::acquire(&options.model_dir)?),
        false => None,
    };
    if shape.leader() {
        config.keep_in(&options.model_dir)?;
    }
    let log = RunLog::open(&options.model_dir, shape.leader(), options.verbose)?;
    log.say(format!(
        "model dir: {} (checkpoints, metrics.jsonl, TensorBoard event files)",
        options.model_dir.display()
    ));
    log.say(format!(
        "{} training records in {} files; global batch {} = {} replica(s){} x {per_replica}",
        index.len(),
        index.files().len(),
        config.train.batch_size,
        shape.total_replicas(),
        match shape.nodes {
            1 => String::new(),
            n => format!(" over {n} processes ({})", shape.describe_counts()),
        },
    ));
    if let Some(q) = &config.model.quantization {
        log.say(format!(
            "quantization-aware training: activation ranges learned from the first step, 8-bit fake quantization from step {}{}",
            q.delay.max(1),
            if q.symmetric { ", symmetric ranges" } else { "" }
        ));
    }
    let start = start::starting_point::<B>(config, &options.model_dir, &devices[0], &log)?;
    let fingerprint = run_fingerprint(config, &index)?;
    let (transfer, fallback) = Transfer::between::<B>(devices);
    if let Some(why) = fallback {
        log.say(format!(
            "the device-to-device copy failed its start-up check ({why}): tensors move through the host instead"
        ));
    }
    if devices.len() > 1 {
        log.say(format!(
            "exchange between replicas: {}",
            transfer.describe()
        ));
    }
    let exchange = ((shape.replicas, shape.total_replicas()), transfer);
    let sync = connect::<B>(options.nodes.as_ref(), exchange, &devices[0], &log);
    let pool = ReplicaPool::start(
        devices,
        &Blueprint {
            config: &Arc::new(config.clone()),
            start: &start,
            anchors: &Arc::new(model::ssd::anchors(&config.model)),
            sync: &sync,
            bucketing: Bucketing::for_replicas(devices, options.nodes.is_some()),
            run: &fingerprint,
        },
    )?;
    let loader = Loader::new(
        Arc::new(index),
        loader_config(config, &shape),
        start.position,
    )?;
    let batches = Batches::Loader {
        loader,
        repeat_first: options.repeat_first_batch,
    };
    // every replica of every node joins the exchange and checks it starts where the others do
    pool.join(start.step)?;
    let progress = Progress::at(start.step, start.position, config);
    let parts = (pool, batches, log);
    let mut run = Run::new(config, options, devices, shape, parts, eval_index, progress);
    run.train()?;
    run.finish()
}

/// [`train`] as a [`BackendJob`]: [`TrainingJob::run_on`] runs it on a device list.
pub struct TrainingJob<'a> {
    /// The config to train.
    pub config: &'a TrainConfig,
    /// How the run is driven.
    pub options: &'a RunOptions,
}

impl TrainingJob<'_> {
    /// Trains on `devices`. Not generic on purpose: the training code is compiled for each
    /// backend once, in this library, where each caller of the generic
    /// [`Devices::run`](crate::devices::Devices::run) (the `train` binary, `xtask`) would
    /// compile its own copy, minutes of a release build each. Left out of this library's
    /// unit-test build, which would compile it for nothing.
    #[cfg(not(test))]
    pub fn run_on(self, devices: &crate::devices::Devices) -> Result<RunSummary> {
        devices.run(self)
    }
}

impl BackendJob for TrainingJob<'_> {
    type Output = RunSummary;
    fn run<B: SsdBackend>(self, devices: Vec<B::Device>) -> Result<RunSummary> {
        train::<B>(self.config, &devices, self.options)
    }
}

/// How many replicas and machines take part, and which one this process is.
struct RunShape {
    /// This process's replicas.
    replicas: usize,
    nodes: usize,
    rank: usize,
    /// Every process's replicas, by rank (the ranks of a job may have different numbers).
    counts: Vec<usize>,
}

impl RunShape {
    /// The shape of a run with `replicas` here: in a multi-node run every process's count is
    /// gathered (an exchange, at the same point on every process), and the global batch must
    /// split evenly over all of them.
    fn of(replicas: usize, nodes: Option<&Nodes>, config: &TrainConfig) -> Result<Self> {
        if replicas == 0 {
            bail!("no device to train on");
        }
        let (count, rank) = nodes.map_or((1, 0), |n| (n.count(), n.rank));
        let counts = match nodes {
            None => vec![replicas],
            Some(nodes) => replica_counts(nodes, replicas)?,
        };
        let shape = Self {
            replicas,
            nodes: count,
            rank,
            counts,
        };
        let (batch_size, total) = (config.train.batch_size, shape.total_replicas());
        if !batch_size.is_multiple_of(total) {
            bail!(
                "`train.batch_size` {batch_size} does not split evenly over {total} replicas{}",
                match count {
                    1 => String::new(),
                    _ => format!(" ({})", shape.describe_counts()),
                }
            );
        }
        Ok(shape)
    }

    /// "process 0: 2, process 1: 1".
    fn describe_counts(&self) -> String {
        let each: Vec<String> = self
            .counts
            .iter()
            .enumerate()
            .map(|(rank, n)| format!("process {rank}: {n}"))
            .collect();
        each.join(", ")
    }

    /// The slots of every global batch this process's replicas take: after those of the
    /// lower ranks, in proportion to its replicas (`None`: the whole batch).
    fn batch_share(&self, batch_size: usize) -> Option<std::ops::Range<usize>> {
        let per_replica = batch_size / self.total_replicas();
        let first: usize = self.counts[..self.rank].iter().sum();
        (self.nodes > 1).then(|| first * per_replica..(first + self.replicas) * per_replica)
    }

    /// Rank 0 writes checkpoints, metrics and events, and evaluates.
    fn leader(&self) -> bool {
        self.rank == 0
    }

    fn total_replicas(&self) -> usize {
        self.counts.iter().sum()
    }
}

/// Every process's replica count, by rank: each adds its own at its rank's place.
fn replica_counts(nodes: &Nodes, replicas: usize) -> Result<Vec<usize>> {
    let mut mine = vec![0f32; nodes.count()];
    mine[nodes.rank] = replicas as f32;
    let all = nodes
        .exchange
        .sum_over_nodes(mine)
        .map_err(|why| anyhow::anyhow!("gathering the processes' replica counts: {why}"))?;
    Ok(all.into_iter().map(|n| n as usize).collect())
}

/// The training records and, when the config names any, the evaluation records.
fn record_indexes(config: &TrainConfig) -> Result<(RecordIndex, Option<RecordIndex>)> {
    let train_files = expand_patterns(&config.data.train).context("training data")?;
    let index = RecordIndex::build(&train_files)?;
    let eval_index = match config.data.eval.is_empty() {
        true => None,
        false => Some(RecordIndex::build(
            &expand_patterns(&config.data.eval).context("evaluation data")?,
        )?),
    };
    Ok((index, eval_index))
}

/// The gradient exchange: between this process's replicas (and the mean over all of them,
/// `total_replicas`), and over the processes of a multi-node run (on the devices where every process can, else through host memory).
fn connect<B: SsdBackend>(
    nodes: Option<&Nodes>,
    ((replicas, total_replicas), transfer): ((usize, usize), Transfer),
    first_device: &B::Device,
    log: &RunLog,
) -> Arc<dyn GradientSync<B>> {
    let Some(nodes) = nodes else {
        return Arc::new(InProcessAllReduce::<B>::new(replicas, transfer));
    };
    let on_device = crate::sync::device_exchange::<B>(first_device, nodes);
    log.say(format!(
        "process {} of {}; exchange between processes: {}",
        nodes.rank,
        nodes.count(),
        match &on_device {
            Ok(_) => "NCCL on the GPUs".to_string(),
            Err(why) => format!("MPI through host memory ({why})"),
        }
    ));
    Arc::new(InProcessAllReduce::<B>::across_nodes(
        (replicas, total_replicas),
        transfer,
        nodes.exchange.clone(),
        on_device.ok(),
    ))
}

/// What every node of a multi-node run must share, hashed: the config and the training
/// records (each file's name and size, the record count).
fn run_fingerprint(config: &TrainConfig, index: &RecordIndex) -> Result<String> {
    let mut text = serde_json::to_string(config)?;
    for file in index.files() {
        let size = std::fs::metadata(file).map_or(0, |m| m.len());
        let name = file.file_name().map(|n| n.to_string_lossy().into_owned());
        text += &format!("\n{} {size}", name.unwrap_or_default());
    }
    text += &format!("\n{} records", index.len());
    Ok(data::example::sha256_hex(text.as_bytes()))
}

fn loader_config(config: &TrainConfig, shape: &RunShape) -> LoaderConfig {
    LoaderConfig {
        batch_size: config.train.batch_size,
        image_size: config.model.image_size,
        num_classes: config.model.num_classes,
        augmentations: config.data.augmentation.clone(),
        shuffle: true,
        seed: config.train.seed,
        workers: match config.data.workers {
            0 => std::thread::available_parallelism().map_or(1, |n| n.get()),
            n => n,
        },
        prefetch: config.data.prefetch,
        share: shape.batch_share(config.train.batch_size),
    }
}

/// Where the run stands.
struct Progress {
    step: u64,
    first_step: u64,
    position: Position,
    learning_rate: f64,
    /// A stop request (a signal on any machine) travels with a step's exchange, so every
    /// machine stops after the same step, and that step reads its loss back, so the
    /// checkpoint written at the stop holds a checked step.
    stopping: bool,
}

impl Progress {
    fn at(step: u64, position: Position, config: &TrainConfig) -> Self {
        Self {
            step,
            first_step: step,
            position,
            learning_rate: config.train.optimizer.learning_rate().at(step),
            stopping: false,
        }
    }
}

/// Time spent, for the progress lines and the summary.
struct Timing {
    run_start: Instant,
    /// Start and steps of the window the next progress line reports.
    window: (Instant, u64),
    sync_seconds: f64,
    step_seconds: Vec<f64>,
    data_wait_seconds: f64,
}

/// The latest of what the run produced.
struct Latest<B: SsdBackend> {
    loss: LossValues,
    saved: Option<Saved<B>>,
    metrics: Option<Metrics>,
    /// Steps of the last snapshot and evaluation (a step gets at most one of each).
    snapshot_step: Option<u64>,
    evaluated_step: Option<u64>,
}

/// A run in progress.
struct Run<'a, B: SsdBackend> {
    config: &'a TrainConfig,
    options: &'a RunOptions,
    devices: &'a [B::Device],
    shape: RunShape,
    pool: ReplicaPool<B>,
    batches: Batches,
    log: RunLog,
    eval_index: Option<RecordIndex>,
    progress: Progress,
    timing: Timing,
    latest: Latest<B>,
}

impl<'a, B: SsdBackend> Run<'a, B> {
    fn new(
        config: &'a TrainConfig,
        options: &'a RunOptions,
        devices: &'a [B::Device],
        shape: RunShape,
        (pool, batches, log): (ReplicaPool<B>, Batches, RunLog),
        eval_index: Option<RecordIndex>,
        progress: Progress,
    ) -> Self {
        Self {
            config,
            options,
            devices,
            shape,
            pool,
            batches,
            log,
            eval_index,
            progress,
            timing: Timing {
                run_start: Instant::now(),
                window: (Instant::now(), 0),
                sync_seconds: 0.0,
                step_seconds: Vec::new(),
                data_wait_seconds: 0.0,
            },
            latest: Latest {
                loss: LossValues::default(),
                saved: None,
                metrics: None,
                snapshot_step: None,
                evaluated_step: None,
            },
        }
    }

    /// Steps until `num_steps` or a stop request, logging, checkpointing and evaluating on
    /// the configured steps.
    fn train(&mut self) -> Result<()> {
        // a request during the start-up: nothing trained, nothing to write
        self.progress.stopping |= self.stop_here();
        let train = &self.config.train;
        while self.progress.step < train.num_steps && !self.progress.stopping {
            self.step()?;
            let step = self.progress.step;
            if self.logs(step) || self.progress.stopping {
                self.log_step()?;
            }
            if self.checkpoints(step) {
                self.checkpoint()?;
            }
            if self.evaluates(step) {
                self.evaluate()?;
            }
        }
        Ok(())
    }

    /// A stop request on this machine that can be acted on at once: in a run of this machine
    /// alone, between steps (a multi-node run waits for the request to travel with a step).
    fn stop_here(&self) -> bool {
        self.options.nodes.is_none() && self.options.stop.load(Ordering::Relaxed)
    }

    fn logs(&self, step: u64) -> bool {
        let train = &self.config.train;
        step.is_multiple_of(train.log_every) || step == train.num_steps
    }

    fn evaluates(&self, step: u64) -> bool {
        self.config.eval.every > 0 && step.is_multiple_of(self.config.eval.every)
    }

    fn checkpoints(&self, step: u64) -> bool {
        step.is_multiple_of(self.config.train.checkpoint_every) || self.evaluates(step)
    }

    /// Whether step `step` (counted from 1) reads its loss back from the device: the run's
    /// first (its time, compilation of the GPU kernels included, is reported), a step that
    /// is logged, checkpointed or evaluated, the last one, one after a stop request, and
    /// every step of a multi-node run (whose stop requests travel with the loss). The others
    /// leave it on the device: one blocking read fewer per step.
    fn reads_loss(&self, step: u64, stop: bool) -> bool {
        self.options.nodes.is_some()
            || self.timing.step_seconds.is_empty()
            || stop
            || self.logs(step)
            || self.checkpoints(step)
            || step == self.config.train.num_steps
    }

    /// One step of every replica on its part of the next batch.
    fn step(&mut self) -> Result<()> {
        let step_start = Instant::now();
        let batch = self.batches.next()?;
        self.timing.data_wait_seconds += step_start.elapsed().as_secs_f64();
        let stop = self.options.stop.load(Ordering::Relaxed);
        let read_loss = self.reads_loss(self.progress.step + 1, stop);
        let p = &mut self.progress;
        p.position = batch.next_position;
        p.learning_rate = self.config.train.optimizer.learning_rate().at(p.step);
        let parts = batch.split(self.shape.replicas);
        let command = StepCommand {
            learning_rate: p.learning_rate,
            step: p.step,
            stop,
            read_loss,
        };
        let outcome = self.pool.step(parts, command)?;
        if let Some(loss) = outcome.loss {
            if !loss.total.is_finite() {
                let kept = checkpoint::latest(&self.options.model_dir)?
                    .map_or("none".into(), |p| p.display().to_string());
                bail!(
                    "the loss is {} at step {} (classification {}, localization {}); stopped, last good checkpoint: {kept}",
                    loss.total,
                    p.step,
                    loss.classification,
                    loss.localization
                );
            }
            self.latest.loss = loss;
        }
        p.stopping |= outcome.stop;
        p.step += 1;
        self.timing.sync_seconds += outcome.sync_seconds;
        let seconds = step_start.elapsed().as_secs_f64();
        if self.timing.step_seconds.is_empty() {
            // on a GPU, mostly the compilation of its kernels where no cache holds them yet
            self.log
                .say(format!("first step of this run: {seconds:.1} s"));
        }
        self.timing.step_seconds.push(seconds);
        self.timing.window.1 += 1;
        Ok(())
    }

    /// The progress line and records of the step just taken, over the window since the
    /// last one.
    fn log_step(&mut self) -> Result<()> {
        let loss = self.latest.loss;
        let (since, steps) = self.timing.window;
        let secs = since.elapsed().as_secs_f64();
        let num_steps = self.config.train.num_steps;
        let step = self.progress.step;
        self.log.step(&StepRecord {
            step,
            num_steps,
            loss,
            learning_rate: self.progress.learning_rate,
            images_per_sec: (steps as usize * self.config.train.batch_size) as f64 / secs.max(1e-9),
            eta_seconds: (num_steps - step) as f64 * secs / steps as f64,
            seconds: self.timing.run_start.elapsed().as_secs_f64(),
        })?;
        self.timing.window = (Instant::now(), 0);
        Ok(())
    }

    /// Averages the BatchNorm statistics over all replicas, then (on the leader) writes the
    /// first replica's state as a checkpoint.
    fn checkpoint(&mut self) -> Result<()> {
        let step = self.progress.step;
        self.latest.snapshot_step = Some(step);
        if self.shape.total_replicas() > 1 {
            self.pool.average_bn_stats()?;
        }
        // the processes compare their weights' hash: the same bits everywhere, or the run
        // stops here (within a process the weights are compared byte for byte below)
        if self.shape.nodes > 1 {
            self.pool.join(step)?;
        }
        if !self.shape.leader() {
            return Ok(());
        }
        let snapshot = self.pool.snapshot(step)?;
        let state = RunState {
            step,
            position: self.progress.position,
            learning_rate: self.progress.learning_rate,
            replicas: self.shape.replicas,
        };
        let saved = checkpointing::save(
            self.config,
            &self.options.model_dir,
            snapshot,
            state,
            &self.devices[0],
        )?;
        self.log.say(format!("checkpoint {}", saved.dir.display()));
        self.latest.saved = Some(saved);
        Ok(())
    }

    /// Evaluates the last checkpoint (its EMA weights when present) where there is
    /// evaluation data (on the leader), and records the metrics. A stop request abandons the
    /// evaluation: the checkpoint it would score is written, and the stop must come within
    /// a scheduler's grace period.
    fn evaluate(&mut self) -> Result<()> {
        self.latest.evaluated_step = Some(self.progress.step);
        let (Some(index), Some(saved)) = (&self.eval_index, &self.latest.saved) else {
            self.latest.metrics = None;
            return Ok(());
        };
        let net = saved.evaluated();
        let stop = &self.options.stop;
        match evaluation::evaluate_net(net, self.config, index, &self.devices[0], stop)? {
            Some((metrics, drawn)) => {
                self.log.evaluation(saved.step, &metrics, &drawn)?;
                self.latest.metrics = Some(metrics);
            }
            None => {
                self.log.say(format!(
                    "evaluation of step {} abandoned: stop requested",
                    saved.step
                ));
                self.latest.metrics = None;
                // its checkpoint is written: alone, the run stops here
                self.progress.stopping |= self.stop_here();
            }
        }
        Ok(())
    }

    /// The checkpoint this run resumed at `step`, with the replicas' networks, to evaluate.
    fn resumed_checkpoint(&self, step: u64) -> Result<Saved<B>> {
        let dir = checkpoint::latest(&self.options.model_dir)?
            .context("a resumed run's checkpoint is gone from its model dir")?;
        let snapshot = self.pool.snapshot(step)?;
        checkpointing::written(self.config, dir, step, snapshot, &self.devices[0])
    }

    /// The end of the run (or a stop request): a checkpoint and, unless interrupted, a final
    /// evaluation, each unless this step already has one; the charts; the summary. A run that
    /// reached `num_steps` without its final evaluation (a stop request came first) ends as
    /// stopped, and resuming it evaluates the last checkpoint.
    fn finish(mut self) -> Result<RunSummary> {
        let step = self.progress.step;
        let trained = step > self.progress.first_step;
        if trained && self.latest.snapshot_step != Some(step) {
            self.checkpoint()?;
        }
        let evaluated = |l: &Latest<B>| l.evaluated_step == Some(step) && l.metrics.is_some();
        let final_due = step == self.config.train.num_steps
            && self.eval_index.is_some()
            && !evaluated(&self.latest)
            && (trained || !self.log.evaluated_at(step)?);
        if final_due && !self.progress.stopping {
            if !trained {
                self.latest.saved = Some(self.resumed_checkpoint(step)?);
            }
            self.evaluate()?;
        }
        let stopped = self.progress.stopping
            && (step < self.config.train.num_steps || (final_due && !evaluated(&self.latest)));
        if trained && self.shape.leader() {
            write_charts(&self.log, &self.options.model_dir);
        }
        // the other processes wait for the leader's last writes: a launcher ends the whole
        // job as soon as one process exits with a status other than 0, the stopped one too
        if self.shape.nodes > 1 {
            self.pool.join(step)?;
        }
        self.pool.shut_down();
        let seconds = self.timing.run_start.elapsed().as_secs_f64();
        let steps_this_run = step - self.progress.first_step;
        Ok(RunSummary {
            step,
            steps_this_run,
            last_loss: self.latest.loss,
            images_per_sec: (steps_this_run as usize * self.config.train.batch_size) as f64
                / seconds.max(1e-9),
            sync_seconds: self.timing.sync_seconds,
            step_seconds: self.timing.step_seconds,
            data_wait_seconds: self.timing.data_wait_seconds,
            seconds,
            metrics: self.latest.metrics,
            checkpoint: self.latest.saved.map(|s| s.dir),
            stopped,
        })
    }
}

/// The run's charts from its metrics log; a failure is only reported (the run succeeded).
fn write_charts(log: &RunLog, dir: &std::path::Path) {
    match crate::report::charts::write_charts(dir) {
        Ok(charts) => {
            let names: Vec<String> = charts
                .files
                .iter()
                .filter_map(|f| Some(f.file_name()?.to_string_lossy().into_owned()))
                .collect();
            log.say(format!("charts: {} in {}", names.join(", "), dir.display()));
            if let Some(note) = charts.note() {
                log.say(note);
            }
        }
        Err(e) => log.say(format!("warning: no charts: {e:#}")),
    }
}
