//! The data-parallel learner: one replica per device (or several on the CPU), each a thread
//! holding a copy of the network made from one record, taking a disjoint slice of every global
//! batch; gradients are averaged by a bucketed all-reduce so the replicas stay identical.

use std::fs::OpenOptions;
use std::io::Write;
use std::panic::{AssertUnwindSafe, catch_unwind};
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::mpsc::{Receiver, Sender, channel};
use std::time::Instant;

use anyhow::{Context, Result, bail};
use burn::backend::Autodiff;
use burn::module::AutodiffModule;
use burn::optim::adaptor::OptimizerAdaptor;
use burn::optim::{GradientsParams, Optimizer};
use burn::record::{FullPrecisionSettings, NamedMpkBytesRecorder, Recorder};
use burn::tensor::backend::Backend;
use burn::tensor::{Tensor, TensorData};
use data::loader::{Batch, Loader, LoaderConfig, Position};
use data::shards::expand_patterns;
use data::tfrecord::RecordIndex;
use model::loss::compute_loss;
use model::ops::SsdBackend;
use model::targets::assign_targets;
use model::weights::{load_weights, weights_from_bytes, weights_to_bytes};
use model::{BBox, Ssd};
use serde::Serialize;
use serde_json::json;

use crate::checkpoint::{self, CheckpointFiles, CheckpointState};
use crate::cluster::{Cluster, WsExchange};
use crate::config::TrainConfig;
use crate::ema::{Ema, trainable_ids};
use crate::eval::run_on_dataset;
use crate::events::EventWriter;
use crate::metrics::{COCO_NAMES, Metrics, evaluate};
use crate::optim::{TfOptimizer, clip_by_global_norm};
use crate::sync::{
    Bucketing, GradientSync, InProcessAllReduce, bn_stats_flat, flatten_gradients,
    set_bn_stats_flat, unflatten_gradients, weight_checksum,
};

type Train<B> = Autodiff<B>;
type Optim<B> = OptimizerAdaptor<TfOptimizer, Ssd<Train<B>>, Train<B>>;
type Recorder_ = NamedMpkBytesRecorder<FullPrecisionSettings>;
/// `(step, network, EMA network)` of the last checkpoint.
type Snapshot<B> = (u64, Ssd<B>, Option<Ssd<B>>);
/// `(checkpoint dir, network, EMA network)` of a checkpoint just written.
type Written<B> = (PathBuf, Ssd<B>, Option<Ssd<B>>);

/// How a run is driven.
#[derive(Debug, Clone)]
pub struct RunOptions {
    /// Checkpoints, metrics and evaluations go here; an existing checkpoint is resumed.
    pub model_dir: PathBuf,
    /// Set (e.g. by Ctrl-C) to checkpoint and stop after the current step.
    pub stop: Arc<AtomicBool>,
    /// Print progress lines.
    pub verbose: bool,
    /// This process's place in a multi-node run; `None` trains on this machine alone.
    pub cluster: Option<Cluster>,
    /// For benchmarks: every step trains on the first batch again, and the data loader stops
    /// once it has made that batch, so the steps run without the data pipeline beside them
    /// (checkpoints then record the position after the first batch).
    pub repeat_first_batch: bool,
}

/// The loss parts of a step, averaged over replicas.
#[derive(Debug, Clone, Copy, Default, PartialEq, Serialize)]
pub struct LossValues {
    /// Classification loss.
    pub classification: f32,
    /// Localization loss.
    pub localization: f32,
    /// L2 regularisation.
    pub regularization: f32,
    /// Their sum.
    pub total: f32,
    /// Anchors matched to a ground-truth box, per image (the API's
    /// `AvgNumPositiveAnchorsPerImage`); logged under `targets`, not `loss`.
    #[serde(skip)]
    pub matched_per_image: f32,
    /// Negative anchors kept by hard example mining, per image.
    #[serde(skip)]
    pub mined_negatives_per_image: f32,
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
}

enum Command {
    Step {
        batch: Batch,
        learning_rate: f64,
        step: u64,
        /// This process was asked to stop (Ctrl-C) after this step.
        stop: bool,
    },
    /// Check that every replica everywhere starts from the same step and weights.
    Join {
        step: u64,
    },
    /// Replace the BatchNorm moving statistics by their mean over all replicas.
    AverageBnStats,
    Snapshot,
}

enum Reply<B: Backend> {
    Stepped {
        loss: LossValues,
        sync_seconds: f64,
        /// Some process of the run was asked to stop: every one stops after this step.
        stop: bool,
    },
    Snapshot {
        weights: Vec<u8>,
        optimizer: Vec<u8>,
        ema: Option<Vec<u8>>,
        model: Box<Ssd<B>>,
    },
    Done,
}

struct Replica<B: SsdBackend> {
    index: usize,
    device: B::Device,
    /// The replica's network; `None` only while [`Replica::apply`] updates it.
    model: Option<Ssd<Train<B>>>,
    optim: Optim<B>,
    ema: Option<Ema<B>>,
    config: Arc<TrainConfig>,
    anchors: Arc<Vec<BBox>>,
    sync: Arc<dyn GradientSync<B>>,
    /// How the gradients travel through `sync`.
    bucketing: Bucketing,
}

/// The values of a small tensor, on the host.
fn to_host<B: Backend>(t: Tensor<B, 1>) -> Result<Vec<f32>, String> {
    t.into_data()
        .convert::<f32>()
        .to_vec()
        .map_err(|e| format!("{e:?}"))
}

fn panic_message(e: Box<dyn std::any::Any + Send>) -> String {
    e.downcast_ref::<String>()
        .cloned()
        .or_else(|| e.downcast_ref::<&str>().map(|s| s.to_string()))
        .unwrap_or_else(|| "panic".into())
}

impl<B: SsdBackend> Replica<B> {
    /// One training step: this replica's gradients, their mean over all replicas, the update.
    fn step(
        &mut self,
        batch: Batch,
        learning_rate: f64,
        step: u64,
        stop: bool,
    ) -> Result<Reply<B>, String> {
        let (grads, tail) = self.gradients(batch, stop);
        let (grads, mean, sync_seconds) = self.average(grads, tail)?;
        self.apply(grads, learning_rate, step);
        Ok(Reply::Stepped {
            loss: LossValues {
                classification: mean[0],
                localization: mean[1],
                regularization: mean[2],
                total: mean[3],
                matched_per_image: mean[5],
                mined_negatives_per_image: mean[6],
            },
            sync_seconds,
            stop: mean[4] > 0.0,
        })
    }

    /// This replica's gradients and a tail of values to average with them: the loss parts,
    /// the stop request, and the matched and mined anchors per image.
    fn gradients(&self, batch: Batch, stop: bool) -> (GradientsParams, Tensor<B, 1>) {
        let cfg = &self.config.model;
        let coder = cfg.box_coder();
        let targets: Vec<_> = batch
            .ground_truth
            .iter()
            .map(|gt| assign_targets(&cfg.matcher, &coder, &self.anchors, gt))
            .collect();
        let images = batch.images_tensor::<Train<B>>(&self.device);
        let loss = compute_loss(self.model(), cfg, &self.anchors, images, &targets);
        let grads = loss.gradients(self.model());
        let stop = Tensor::<B, 1>::from_data(
            TensorData::new(vec![if stop { 1.0f32 } else { 0.0 }], [1]),
            &self.device,
        );
        let images = targets.len().max(1) as f32;
        let counts = Tensor::<B, 1>::from_data(
            TensorData::new(
                vec![
                    loss.num_matches as f32 / images,
                    loss.num_mined_negatives as f32 / images,
                ],
                [2],
            ),
            &self.device,
        );
        let tail = Tensor::cat(
            vec![
                loss.classification.inner(),
                loss.localization.inner(),
                loss.regularization.inner(),
                loss.total.inner(),
                stop,
                counts,
            ],
            0,
        );
        (grads, tail)
    }

    /// The mean over all replicas of the gradients and of the tail's values (on the host),
    /// and the seconds the exchange took. The tail rides at the end of the last bucket: its
    /// mean comes back with the gradients, at no extra exchange or copy, so every machine
    /// logs the same loss and stops after the same step. A lone replica keeps its own.
    fn average(
        &self,
        grads: GradientsParams,
        tail: Tensor<B, 1>,
    ) -> Result<(GradientsParams, Vec<f32>, f64), String> {
        if self.sync.single_replica() {
            return Ok((grads, to_host(tail)?, 0.0));
        }
        let tail_len = tail.dims()[0];
        let (layout, buckets) = flatten_gradients(self.model(), grads, Some(tail), self.bucketing);
        let start = Instant::now();
        let buckets = self.sync.all_reduce_mean(self.index, buckets)?;
        let sync_seconds = start.elapsed().as_secs_f64();
        let last = buckets.last().ok_or("the exchange returned no buckets")?;
        let mean = to_host(last.clone().narrow(0, last.dims()[0] - tail_len, tail_len))?;
        let grads = unflatten_gradients::<Train<B>>(&layout, buckets);
        Ok((grads, mean, sync_seconds))
    }

    /// Clips the averaged gradients (when configured), then updates the weights and the EMA.
    fn apply(&mut self, mut grads: GradientsParams, learning_rate: f64, step: u64) {
        if let Some(max_norm) = self.config.train.gradient_clipping_by_norm {
            grads = clip_by_global_norm(self.model(), grads, max_norm);
        }
        // taken, not cloned: holding the only reference to each weight and slot, the
        // optimizer updates them in place (and likewise the EMA its shadow)
        let model = self
            .model
            .take()
            .expect("a replica holds its network between steps");
        let model = self
            .model
            .insert(self.optim.step(learning_rate, model, grads));
        if let Some(ema) = self.ema.take() {
            self.ema = Some(ema.update(&model.valid(), step + 1));
        }
    }

    fn model(&self) -> &Ssd<Train<B>> {
        self.model
            .as_ref()
            .expect("a replica holds its network between steps")
    }

    fn handle(&mut self, command: Command) -> Result<Reply<B>, String> {
        match command {
            Command::Step {
                batch,
                learning_rate,
                step,
                stop,
            } => self.step(batch, learning_rate, step, stop),
            Command::Join { step } => {
                // every replica of every node must start from the same step and weights (a
                // node that cannot see the checkpoint would silently start afresh)
                let checksum = weight_checksum(&self.model().valid());
                // small integers: their mean over identical replicas is exact in f32
                let mine = [step as f32, (checksum % 65_536) as f32];
                let probe = Tensor::from_data(TensorData::new(mine.to_vec(), [2]), &self.device);
                let all = self.sync.all_reduce_mean(self.index, vec![probe])?;
                let mean = to_host(all[0].clone())?;
                let same = mine.iter().zip(&mean).all(|(a, b)| (a - b).abs() < 0.25);
                if !same {
                    return Err(format!(
                        "the replicas do not start from the same point: this one is at step {step} (weights hash {}), the mean over all replicas is step {} (hash {}); every node needs the same config and model dir contents (shared storage or a copy of the latest checkpoint)",
                        mine[1], mean[0], mean[1]
                    ));
                }
                Ok(Reply::Done)
            }
            Command::AverageBnStats => {
                let model = self.model().valid();
                let flat = bn_stats_flat(&model);
                let mean = self
                    .sync
                    .all_reduce_mean(self.index, vec![flat])?
                    .pop()
                    .ok_or("the exchange returned nothing")?;
                set_bn_stats_flat(self.model(), Tensor::from_inner(mean));
                Ok(Reply::Done)
            }
            Command::Snapshot => {
                let model = self.model().valid();
                Ok(Reply::Snapshot {
                    weights: weights_to_bytes(&model),
                    optimizer: Recorder_::default()
                        .record(self.optim.to_record(), ())
                        .map_err(|e| e.to_string())?,
                    ema: self.ema.as_ref().map(|e| weights_to_bytes(e.shadow())),
                    model: Box::new(model),
                })
            }
        }
    }

    fn run(
        mut self,
        commands: Receiver<Command>,
        replies: Sender<(usize, Result<Reply<B>, String>)>,
    ) {
        while let Ok(command) = commands.recv() {
            let result = catch_unwind(AssertUnwindSafe(|| self.handle(command)))
                .unwrap_or_else(|e| Err(panic_message(e)));
            if let Err(why) = &result {
                self.sync
                    .abort(format!("replica {} failed: {why}", self.index));
            }
            let failed = result.is_err();
            if replies.send((self.index, result)).is_err() || failed {
                break;
            }
        }
    }
}

/// Where the steps' batches come from.
enum Batches {
    /// The data loader; with `repeat_first`, it makes only the first batch.
    Loader { loader: Loader, repeat_first: bool },
    /// The first batch again ([`RunOptions::repeat_first_batch`]); the loader has stopped.
    Repeat(Batch),
}

impl Batches {
    fn next(&mut self) -> Result<Batch> {
        match self {
            Batches::Repeat(batch) => Ok(batch.clone()),
            Batches::Loader {
                loader,
                repeat_first,
            } => {
                let repeat = *repeat_first;
                let batch = loader.next().context("the data loader stopped")??;
                if repeat {
                    // drops the loader, which joins its workers
                    *self = Batches::Repeat(batch.clone());
                }
                Ok(batch)
            }
        }
    }
}

/// Starting weights, optimizer state, EMA and position.
struct Start<B: Backend> {
    model: Ssd<Train<B>>,
    optimizer: Option<Vec<u8>>,
    ema: Option<Ssd<B>>,
    step: u64,
    position: Position,
}

fn starting_point<B: Backend>(
    config: &TrainConfig,
    model_dir: &Path,
    device: &B::Device,
    log: &dyn Fn(String),
) -> Result<Start<B>> {
    let mc = &config.model;
    if let Some(dir) = checkpoint::latest(model_dir)? {
        let state = checkpoint::read_state(&dir)?;
        log(format!(
            "resuming from {} (step {}, written by {} replica(s))",
            dir.display(),
            state.step,
            state.replicas
        ));
        let model = load_weights::<Train<B>>(mc, &dir.join("model.mpk"), device)?;
        let optimizer = Some(
            std::fs::read(dir.join("optimizer.mpk"))
                .with_context(|| format!("reading {}", dir.display()))?,
        );
        let ema = if state.has_ema {
            Some(load_weights::<B>(mc, &dir.join("ema.mpk"), device)?)
        } else {
            None
        };
        return Ok(Start {
            model,
            optimizer,
            ema,
            step: state.step,
            position: state.position,
        });
    }
    let mut model = mc.init::<Train<B>>(config.train.seed, device)?;
    if let Some(source) = &config.train.fine_tune_checkpoint {
        let scope = config.train.fine_tune_restore;
        let (restored, report) = crate::trained::fine_tune(model, mc, source, scope, device)?;
        model = restored;
        log(format!(
            "fine-tuning from {} (restore scope `{}`)",
            source.display(),
            scope.name()
        ));
        for line in report.summary(source) {
            log(line);
        }
    }
    Ok(Start {
        model,
        optimizer: None,
        ema: None,
        step: 0,
        position: Position::default(),
    })
}

/// Trains `config` on `devices` (one replica each; repeat a device for several replicas).
pub fn train<B: SsdBackend>(
    config: &TrainConfig,
    devices: &[B::Device],
    options: &RunOptions,
) -> Result<RunSummary> {
    let verbose = options.verbose;
    let log = |s: String| {
        if verbose {
            eprintln!("{s}");
        }
    };
    let replicas = devices.len();
    if replicas == 0 {
        bail!("no device to train on");
    }
    let (nodes, rank) = options
        .cluster
        .as_ref()
        .map_or((1, 0), |c| (c.nodes, c.rank));
    // rank 0 writes checkpoints, metrics and events, and evaluates
    let leader = rank == 0;
    let batch_size = config.train.batch_size;
    if !batch_size.is_multiple_of(replicas * nodes) {
        bail!(
            "`train.batch_size` {batch_size} does not split evenly over {} replicas",
            replicas * nodes
        );
    }
    std::fs::create_dir_all(&options.model_dir)
        .with_context(|| format!("creating {}", options.model_dir.display()))?;
    let train_files = expand_patterns(&config.data.train).context("training data")?;
    let index = Arc::new(RecordIndex::build(&train_files)?);
    let eval_index = if config.data.eval.is_empty() {
        None
    } else {
        Some(RecordIndex::build(
            &expand_patterns(&config.data.eval).context("evaluation data")?,
        )?)
    };
    log(format!(
        "{} training records in {} files; global batch {batch_size} = {nodes} node(s) x {replicas} replica(s) x {}",
        index.len(),
        train_files.len(),
        batch_size / replicas / nodes
    ));
    let start = starting_point::<B>(config, &options.model_dir, &devices[0], &log)?;
    let start_weights = weights_to_bytes(&start.model.valid());
    let anchors = Arc::new(model::ssd::anchors(&config.model));
    let shared_config = Arc::new(config.clone());
    let sync: Arc<dyn GradientSync<B>> = match &options.cluster {
        Some(cluster) => {
            log(format!(
                "node {rank} of {nodes}: connecting through {}",
                cluster.coordinator
            ));
            let exchange = WsExchange::connect(cluster, replicas)?;
            log(format!("node {rank} of {nodes}: all nodes connected"));
            Arc::new(InProcessAllReduce::<B>::across_nodes(
                replicas,
                Arc::new(exchange),
            ))
        }
        None => Arc::new(InProcessAllReduce::<B>::new(replicas)),
    };
    let bucketing = Bucketing::for_replicas(devices, options.cluster.is_some());
    let (reply_tx, reply_rx) = channel();
    let mut senders = Vec::new();
    let mut handles = Vec::new();
    // Each replica runs on a thread pool of its own with its share of the cores (rayon's
    // default: all of them, or RAYON_NUM_THREADS): the CPU kernels' parallel loops start on
    // the replica's own thread instead of being handed to a shared pool and back, and no
    // replica's kernels queue behind another's. On a GPU the pool only runs the replica.
    let threads = (rayon::current_num_threads() / replicas).max(1);
    for (i, device) in devices.iter().enumerate() {
        // Every replica is decoded afresh from the same bytes: the same weights and parameter
        // ids, but its own autodiff leaves and BatchNorm running state (clones would share
        // both across threads).
        let model = weights_from_bytes::<Train<B>>(
            &config.model,
            start_weights.clone(),
            Path::new("start"),
            device,
        )?;
        let mut optim: Optim<B> =
            OptimizerAdaptor::from(TfOptimizer::from(&config.train.optimizer));
        if let Some(bytes) = &start.optimizer {
            let rec = Recorder_::default()
                .load(bytes.clone(), device)
                .map_err(|e| anyhow::anyhow!("optimizer state of the checkpoint: {e}"))?;
            optim = optim.load_record(rec);
        }
        let ema = match (i, config.train.moving_average_decay) {
            (0, Some(decay)) => Some(Ema::new(
                start.ema.clone().unwrap_or_else(|| model.valid()),
                decay,
                config.train.moving_average_warmup,
                trainable_ids(&model),
            )),
            _ => None,
        };
        let replica = Replica {
            index: i,
            device: device.clone(),
            model: Some(model),
            optim,
            ema,
            config: shared_config.clone(),
            anchors: anchors.clone(),
            sync: sync.clone(),
            bucketing,
        };
        let (tx, rx) = channel();
        let replies = reply_tx.clone();
        let pool = rayon::ThreadPoolBuilder::new()
            .num_threads(threads)
            .thread_name(move |t| format!("replica-{i}-{t}"))
            .build()
            .with_context(|| format!("starting the {threads} thread(s) of replica {i}"))?;
        handles.push(
            std::thread::Builder::new()
                .name(format!("replica-{i}"))
                .spawn(move || pool.install(|| replica.run(rx, replies)))?,
        );
        senders.push(tx);
    }
    drop(reply_tx);
    let device_name = |i: usize| format!("{:?}", devices[i]);
    // Sends one command to every replica and collects the replies in replica order.
    let broadcast = |make: &mut dyn FnMut(usize) -> Command| -> Result<Vec<Reply<B>>> {
        for (i, s) in senders.iter().enumerate() {
            if s.send(make(i)).is_err() {
                bail!("replica {i} on {} stopped", device_name(i));
            }
        }
        let mut out: Vec<Option<Reply<B>>> = (0..replicas).map(|_| None).collect();
        for _ in 0..replicas {
            let (i, r) = reply_rx.recv().context("a replica thread ended")?;
            match r {
                Ok(r) => out[i] = Some(r),
                Err(why) => bail!("replica {i} on {} failed: {why}", device_name(i)),
            }
        }
        Ok(out
            .into_iter()
            .map(|r| r.expect("every replica replied"))
            .collect())
    };
    let loader_config = LoaderConfig {
        batch_size,
        image_size: config.model.image_size,
        num_classes: config.model.num_classes,
        augmentations: config.data.augmentation.clone(),
        shuffle: true,
        seed: config.train.seed,
        workers: if config.data.workers == 0 {
            std::thread::available_parallelism().map_or(1, |n| n.get())
        } else {
            config.data.workers
        },
        prefetch: config.data.prefetch,
        share: (rank, nodes),
    };
    let mut batches = Batches::Loader {
        loader: Loader::new(index.clone(), loader_config, start.position)?,
        repeat_first: options.repeat_first_batch,
    };
    // every replica of every node joins the exchange and checks it starts where the others do
    broadcast(&mut |_| Command::Join { step: start.step })?;
    let metrics_path = options.model_dir.join("metrics.jsonl");
    let metrics_file = match leader {
        true => Some(std::cell::RefCell::new(
            OpenOptions::new()
                .create(true)
                .append(true)
                .open(&metrics_path)
                .with_context(|| format!("opening {}", metrics_path.display()))?,
        )),
        false => None,
    };
    let write_metrics = |v: serde_json::Value| -> Result<()> {
        match &metrics_file {
            Some(file) => writeln!(file.borrow_mut(), "{v}")
                .with_context(|| format!("writing {}", metrics_path.display())),
            None => Ok(()),
        }
    };
    let events = match leader {
        true => Some(std::cell::RefCell::new(
            EventWriter::create(&options.model_dir).with_context(|| {
                format!(
                    "creating a TensorBoard event file in {}",
                    options.model_dir.display()
                )
            })?,
        )),
        false => None,
    };
    let write_events = |step: u64, values: &[(&str, f64)]| -> Result<()> {
        let Some(events) = &events else {
            return Ok(());
        };
        let mut events = events.borrow_mut();
        events
            .scalars(step, values)
            .with_context(|| format!("writing {}", events.path().display()))
    };

    let class_names: Vec<String> = (1..=config.model.num_classes)
        .map(|i| config.model.class_name(i))
        .collect();
    let mut step = start.step;
    let mut position = start.position;
    let mut last_checkpoint = None;
    let mut last_metrics = None;
    let mut last_loss = LossValues::default();
    let mut lr = config.train.optimizer.learning_rate().at(step);
    let run_start = Instant::now();
    let mut window = (Instant::now(), 0u64);
    let mut sync_seconds = 0.0;
    let mut step_seconds = Vec::new();
    let mut data_wait_seconds = 0.0;
    let first_step = step;

    // Average BatchNorm statistics over all replicas, then (on the leader) snapshot replica 0
    // and write the checkpoint.
    let snapshot = |step: u64, position: Position, lr: f64| -> Result<Option<Written<B>>> {
        if replicas * nodes > 1 {
            broadcast(&mut |_| Command::AverageBnStats)?;
        }
        if !leader {
            return Ok(None);
        }
        let mut snapshots: Vec<_> = broadcast(&mut |_| Command::Snapshot)?
            .into_iter()
            .map(|r| match r {
                Reply::Snapshot {
                    weights,
                    optimizer,
                    ema,
                    model,
                } => (weights, optimizer, ema, model),
                _ => unreachable!("Snapshot answers Snapshot"),
            })
            .collect();
        // the replicas must hold bit-identical weights (and, after the averaging above,
        // BatchNorm statistics)
        if let Some(i) = snapshots.iter().position(|s| s.0 != snapshots[0].0) {
            bail!(
                "replica {i} on {} diverged from replica 0 at step {step}",
                device_name(i)
            );
        }
        let (weights, optimizer, ema, model) = snapshots.swap_remove(0);
        let ema_model = match &ema {
            Some(bytes) => Some(weights_from_bytes::<B>(
                &config.model,
                bytes.clone(),
                Path::new("ema"),
                &devices[0],
            )?),
            None => None,
        };
        let state = CheckpointState {
            step,
            position,
            seed: config.train.seed,
            learning_rate: lr,
            replicas,
            has_ema: ema.is_some(),
        };
        let dir = checkpoint::save(
            &options.model_dir,
            &state,
            &CheckpointFiles {
                weights,
                optimizer,
                ema,
                model_config: serde_json::to_vec_pretty(&config.model)?,
            },
            config.train.keep_checkpoints,
        )
        .context("writing a checkpoint (the previous one is kept)")?;
        Ok(Some((dir, *model, ema_model)))
    };
    // Evaluates the snapshot (its EMA weights when present), logs and records the metrics.
    let evaluate_now = |step: u64, snapshot: &Option<Snapshot<B>>| -> Result<Option<Metrics>> {
        let (Some(eval_index), Some((_, model, ema))) = (&eval_index, snapshot) else {
            return Ok(None);
        };
        let net = ema.as_ref().unwrap_or(model);
        let results = run_on_dataset(
            net,
            &config.model,
            eval_index,
            config.eval.max_images,
            config.eval.batch_size,
            &devices[0],
        )?;
        let m = evaluate(&results, &class_names);
        log(format!(
            "eval at step {step}: VOC mAP@0.5 {:.4}, COCO AP {:.4}, AP50 {:.4}",
            m.voc_mAP, m.AP, m.AP50
        ));
        write_metrics(json!({"step": step, "eval": m}))?;
        let tags: Vec<(String, f64)> = COCO_NAMES
            .iter()
            .zip(m.coco())
            .map(|(n, v)| (format!("eval/{n}"), v))
            .chain(std::iter::once(("eval/voc_mAP".to_string(), m.voc_mAP)))
            .chain(
                m.voc_AP
                    .iter()
                    .map(|(c, v)| (format!("eval/voc_AP/{c}"), *v)),
            )
            .collect();
        let tags: Vec<(&str, f64)> = tags.iter().map(|(t, v)| (t.as_str(), *v)).collect();
        write_events(step, &tags)?;
        let drawn = crate::detect::eval_images(eval_index, &results, &config.model, 3)?;
        for (i, image) in drawn.iter().enumerate() {
            let Some(events) = &events else { break };
            let mut events = events.borrow_mut();
            events
                .image(step, &format!("eval/image_{i}"), image)
                .with_context(|| format!("writing {}", events.path().display()))?;
        }
        Ok(Some(m))
    };
    let mut last_snapshot: Option<Snapshot<B>> = None;
    let mut evaluated_at = u64::MAX;
    let mut snapshot_step = u64::MAX;

    let num_steps = config.train.num_steps;
    // a stop request (Ctrl-C on any machine) travels with the step's exchange, so every
    // machine stops after the same step
    let mut stopping = false;
    while step < num_steps && !stopping {
        let step_start = Instant::now();
        let batch = batches.next()?;
        data_wait_seconds += step_start.elapsed().as_secs_f64();
        position = batch.next_position;
        lr = config.train.optimizer.learning_rate().at(step);
        let mut parts = batch.split(replicas).into_iter();
        let stop = options.stop.load(Ordering::Relaxed);
        let replies = broadcast(&mut |_| Command::Step {
            batch: parts.next().expect("one part per replica"),
            learning_rate: lr,
            step,
            stop,
        })?;
        // every replica holds the loss averaged over all replicas
        let mut loss = LossValues::default();
        for r in &replies {
            if let Reply::Stepped {
                loss: l,
                sync_seconds: s,
                stop,
            } = r
            {
                loss = *l;
                sync_seconds += s / replicas as f64;
                stopping |= *stop;
            }
        }
        if !loss.total.is_finite() {
            let kept = checkpoint::latest(&options.model_dir)?
                .map_or("none".into(), |p| p.display().to_string());
            bail!(
                "the loss is {} at step {step} (classification {}, localization {}); stopped, last good checkpoint: {kept}",
                loss.total,
                loss.classification,
                loss.localization
            );
        }
        step += 1;
        step_seconds.push(step_start.elapsed().as_secs_f64());
        last_loss = loss;
        window.1 += 1;
        if step % config.train.log_every == 0 || step == num_steps {
            let secs = window.0.elapsed().as_secs_f64();
            let ips = (window.1 as usize * batch_size) as f64 / secs.max(1e-9);
            let eta = (num_steps - step) as f64 * secs / window.1 as f64;
            log(format!(
                "step {step}/{num_steps} | loss {:.4} (cls {:.4}, loc {:.4}, reg {:.4}) | {:.1} matched, {:.1} mined negatives per image | lr {lr:.6} | {ips:.1} img/s | eta {:.0}s",
                loss.total,
                loss.classification,
                loss.localization,
                loss.regularization,
                loss.matched_per_image,
                loss.mined_negatives_per_image,
                eta
            ));
            write_metrics(
                json!({"step": step, "loss": loss, "targets": {"matched_per_image": loss.matched_per_image, "mined_negatives_per_image": loss.mined_negatives_per_image}, "learning_rate": lr, "images_per_sec": ips, "seconds": run_start.elapsed().as_secs_f64()}),
            )?;
            write_events(
                step,
                &[
                    ("loss/total", loss.total as f64),
                    ("loss/classification", loss.classification as f64),
                    ("loss/localization", loss.localization as f64),
                    ("loss/regularization", loss.regularization as f64),
                    ("targets/matched_per_image", loss.matched_per_image as f64),
                    (
                        "targets/mined_negatives_per_image",
                        loss.mined_negatives_per_image as f64,
                    ),
                    ("learning_rate", lr),
                    ("images_per_sec", ips),
                ],
            )?;
            window = (Instant::now(), 0);
        }
        let eval_due = config.eval.every > 0 && step.is_multiple_of(config.eval.every);
        if step.is_multiple_of(config.train.checkpoint_every) || eval_due {
            snapshot_step = step;
            if let Some((dir, model, ema)) = snapshot(step, position, lr)? {
                log(format!("checkpoint {}", dir.display()));
                last_checkpoint = Some(dir);
                last_snapshot = Some((step, model, ema));
            }
            if eval_due {
                last_metrics = evaluate_now(step, &last_snapshot)?;
                evaluated_at = step;
            }
        }
    }
    // the end of the run (or a stop request): a checkpoint and, unless interrupted, a final
    // evaluation, each unless this step already has one
    if step > first_step {
        if snapshot_step != step
            && let Some((dir, model, ema)) = snapshot(step, position, lr)?
        {
            log(format!("checkpoint {}", dir.display()));
            last_checkpoint = Some(dir);
            last_snapshot = Some((step, model, ema));
        }
        if evaluated_at != step && !stopping {
            last_metrics = evaluate_now(step, &last_snapshot)?;
        }
    }
    drop(senders);
    for h in handles {
        let _ = h.join();
    }
    if step > first_step && leader {
        match crate::charts::write_charts(&options.model_dir) {
            Ok(_) => log(format!(
                "charts: loss.png, learning_rate.png, eval.png in {}",
                options.model_dir.display()
            )),
            Err(e) => log(format!("warning: no charts: {e:#}")),
        }
    }
    let seconds = run_start.elapsed().as_secs_f64();
    let steps_this_run = step - first_step;
    let summary = RunSummary {
        step,
        steps_this_run,
        last_loss,
        images_per_sec: (steps_this_run as usize * batch_size) as f64 / seconds.max(1e-9),
        sync_seconds,
        step_seconds,
        data_wait_seconds,
        seconds,
        metrics: last_metrics,
        checkpoint: last_checkpoint,
    };
    Ok(summary)
}
