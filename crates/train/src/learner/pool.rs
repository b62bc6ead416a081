//! The replica pool: one thread per replica, each on a thread pool of its own, driven by typed
//! calls (join, step, average the BatchNorm statistics, snapshot) that send one command to
//! every replica and collect the replies in replica order.

use std::path::Path;
use std::sync::Arc;
use std::sync::mpsc::{Receiver, Sender, channel};
use std::thread::JoinHandle;

use anyhow::{Context, Result, bail};
use burn::module::AutodiffModule;
use burn::optim::Optimizer;
use burn::optim::adaptor::OptimizerAdaptor;
use burn::record::Recorder;
use data::loader::Batch;
use model::BBox;
use model::ops::SsdBackend;
use model::weights::{weights_from_bytes, weights_to_bytes};

use super::replica::{Command, Optim, OptimRecorder, Replica, Reply, Snapshot, Stepped, Train};
use super::start::Start;
use crate::config::TrainConfig;
use crate::optim::TfOptimizer;
use crate::optim::ema::{Ema, trainable_ids};
use crate::sync::{Bucketing, GradientSync};

type Replies<B> = Receiver<(usize, Result<Reply<B>, String>)>;

/// The running replicas of this process.
pub(super) struct ReplicaPool<B: SsdBackend> {
    devices: Vec<B::Device>,
    senders: Vec<Sender<Command>>,
    replies: Replies<B>,
    handles: Vec<JoinHandle<()>>,
}

/// What every replica is told for one step.
#[derive(Debug, Clone, Copy)]
pub(super) struct StepCommand {
    pub learning_rate: f64,
    /// The step about to be taken (counted from 0).
    pub step: u64,
    /// This process was asked to stop after the step.
    pub stop: bool,
    /// Read the loss back from the device.
    pub read_loss: bool,
}

/// What every replica is built from.
pub(super) struct Blueprint<'a, B: SsdBackend> {
    pub config: &'a Arc<TrainConfig>,
    pub start: &'a Start<B>,
    pub anchors: &'a Arc<Vec<BBox>>,
    pub sync: &'a Arc<dyn GradientSync<B>>,
    pub bucketing: Bucketing,
}

impl<B: SsdBackend> ReplicaPool<B> {
    /// Starts one replica per device, each from `blueprint.start`'s weights and state.
    pub fn start(devices: &[B::Device], blueprint: &Blueprint<B>) -> Result<Self> {
        let start_weights = weights_to_bytes(&blueprint.start.model.valid());
        let (reply_tx, replies) = channel();
        let mut pool = Self {
            devices: devices.to_vec(),
            senders: Vec::new(),
            replies,
            handles: Vec::new(),
        };
        // Each replica runs on a thread pool of its own with its share of the cores (rayon's
        // default: all of them, or RAYON_NUM_THREADS): the CPU kernels' parallel loops start on
        // the replica's own thread instead of being handed to a shared pool and back, and no
        // replica's kernels queue behind another's. On a GPU the pool only runs the replica.
        let threads = (rayon::current_num_threads() / devices.len()).max(1);
        for (i, device) in devices.iter().enumerate() {
            let replica = build_replica(i, device, blueprint, start_weights.clone())?;
            let (tx, rx) = channel();
            let replies = reply_tx.clone();
            let threads = rayon::ThreadPoolBuilder::new()
                .num_threads(threads)
                .thread_name(move |t| format!("replica-{i}-{t}"))
                .build()
                .with_context(|| format!("starting the {threads} thread(s) of replica {i}"))?;
            pool.handles.push(
                std::thread::Builder::new()
                    .name(format!("replica-{i}"))
                    .spawn(move || threads.install(|| replica.run(rx, replies)))?,
            );
            pool.senders.push(tx);
        }
        Ok(pool)
    }

    /// Number of replicas.
    pub fn len(&self) -> usize {
        self.senders.len()
    }

    /// Checks that every replica of every node starts from `step` and the same weights.
    pub fn join(&self, step: u64) -> Result<()> {
        self.broadcast(&mut |_| Command::Join { step }).map(drop)
    }

    /// One training step, each replica on its part of the batch (`parts` in replica order).
    pub fn step(&self, parts: Vec<Batch>, command: StepCommand) -> Result<Stepped> {
        let mut parts = parts.into_iter();
        let replies = self.broadcast(&mut |_| Command::Step {
            batch: parts.next().expect("one part per replica"),
            learning_rate: command.learning_rate,
            step: command.step,
            stop: command.stop,
            read_loss: command.read_loss,
        })?;
        // every replica holds the loss averaged over all replicas; the exchange time is theirs
        let mut outcome: Option<Stepped> = None;
        let (mut sync_seconds, mut stop) = (0.0, false);
        for reply in replies {
            if let Reply::Stepped(s) = reply {
                sync_seconds += s.sync_seconds / self.len() as f64;
                stop |= s.stop;
                outcome = Some(s);
            }
        }
        let outcome = outcome.context("no replica answered the step")?;
        Ok(Stepped {
            sync_seconds,
            stop,
            ..outcome
        })
    }

    /// Replaces every replica's BatchNorm moving statistics by their mean over all replicas.
    pub fn average_bn_stats(&self) -> Result<()> {
        self.broadcast(&mut |_| Command::AverageBnStats).map(drop)
    }

    /// The first replica's state, after checking that every replica holds bit-identical
    /// weights (and, after [`Self::average_bn_stats`], BatchNorm statistics).
    pub fn snapshot(&self, step: u64) -> Result<Snapshot<B>> {
        let mut snapshots: Vec<Snapshot<B>> = self
            .broadcast(&mut |_| Command::Snapshot)?
            .into_iter()
            .filter_map(|r| match r {
                Reply::Snapshot(s) => Some(s),
                _ => None,
            })
            .collect();
        if let Some(i) = snapshots
            .iter()
            .position(|s| s.weights != snapshots[0].weights)
        {
            bail!(
                "replica {i} on {} diverged from replica 0 at step {step}",
                self.device_name(i)
            );
        }
        Ok(snapshots.swap_remove(0))
    }

    /// Stops the replicas and waits for their threads.
    pub fn shut_down(self) {
        drop(self.senders);
        for h in self.handles {
            let _ = h.join();
        }
    }

    fn device_name(&self, i: usize) -> String {
        format!("{:?}", self.devices[i])
    }

    /// Sends one command to every replica and collects the replies in replica order.
    fn broadcast(&self, make: &mut dyn FnMut(usize) -> Command) -> Result<Vec<Reply<B>>> {
        for (i, s) in self.senders.iter().enumerate() {
            if s.send(make(i)).is_err() {
                bail!("replica {i} on {} stopped", self.device_name(i));
            }
        }
        let mut out: Vec<Option<Reply<B>>> = (0..self.len()).map(|_| None).collect();
        for _ in 0..self.len() {
            let (i, r) = self.replies.recv().context("a replica thread ended")?;
            match r {
                Ok(r) => out[i] = Some(r),
                Err(why) => bail!("replica {i} on {} failed: {why}", self.device_name(i)),
            }
        }
        Ok(out
            .into_iter()
            .map(|r| r.expect("every replica replied"))
            .collect())
    }
}

/// Replica `i` on `device`. Every replica is decoded afresh from the same bytes: the same
/// weights and parameter ids, but its own autodiff leaves and BatchNorm running state
/// (clones would share both across threads).
fn build_replica<B: SsdBackend>(
    i: usize,
    device: &B::Device,
    blueprint: &Blueprint<B>,
    start_weights: Vec<u8>,
) -> Result<Replica<B>> {
    let config = blueprint.config;
    let model =
        weights_from_bytes::<Train<B>>(&config.model, start_weights, Path::new("start"), device)?;
    let mut optim: Optim<B> = OptimizerAdaptor::from(TfOptimizer::from(&config.train.optimizer));
    if let Some(bytes) = &blueprint.start.optimizer {
        let rec = OptimRecorder::default()
            .load(bytes.clone(), device)
            .map_err(|e| anyhow::anyhow!("optimizer state of the checkpoint: {e}"))?;
        optim = optim.load_record(rec);
    }
    // the EMA lives on the first replica, which checkpoints and evaluation read
    let ema = match (i, config.train.moving_average_decay) {
        (0, Some(decay)) => Some(Ema::new(
            blueprint.start.ema.clone().unwrap_or_else(|| model.valid()),
            decay,
            config.train.moving_average_warmup,
            trainable_ids(&model),
        )),
        _ => None,
    };
    Ok(Replica {
        index: i,
        device: device.clone(),
        model: Some(model),
        optim,
        ema,
        config: config.clone(),
        anchors: blueprint.anchors.clone(),
        sync: blueprint.sync.clone(),
        bucketing: blueprint.bucketing,
    })
}
