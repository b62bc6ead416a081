//! The replica pool: one thread per replica, each on a thread pool of its own, driven by typed
//! calls (join, step, average the BatchNorm statistics, snapshot) that send one command to
//! every replica and collect the replies in replica order.

use std::path::Path;
use std::sync::Arc;
use std::sync::mpsc::{Receiver, Sender, channel};
use std::thread::JoinHandle;

use anyhow::{Context, Result, bail};
use burn::module::AutodiffModule;
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
    /// The run's fingerprint, shortened for the join check.
    run: u16,
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
    /// The run's fingerprint (config and training records), the same on every process.
    pub run: &'a str,
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
            run: u16::from_str_radix(blueprint.run.get(..4).unwrap_or("0"), 16).unwrap_or(0),
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

    /// Checks that every replica of every process is at `step` with the same weights (by a
    /// hash) in the same run (config and training records, by a hash).
    pub fn join(&self, step: u64) -> Result<()> {
        let run = self.run;
        self.broadcast(&mut |_| Command::Join { step, run })
            .map(drop)
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
        for answered in 0..self.len() {
            let (i, r) = self.replies.recv().context("a replica thread ended")?;
            match r {
                Ok(r) => out[i] = Some(r),
                Err(why) => return Err(self.cause(i, why, self.len() - answered - 1)),
            }
        }
        Ok(out
            .into_iter()
            .map(|r| r.expect("every replica replied"))
            .collect())
    }

    /// The error of a command that replica `i` failed with `why`, `pending` replies still
    /// to come. A failing replica aborts the exchange with its reason, so the others fail
    /// too, each with a report that holds the first one's: the shortest report among those
    /// that arrive within a few seconds is the cause, and it names the replica and device
    /// where it happened.
    fn cause(&self, i: usize, why: String, pending: usize) -> anyhow::Error {
        let mut cause = (i, why);
        for _ in 0..pending {
            match self.replies.recv_timeout(CAUSE_WAIT) {
                Ok((j, Err(other))) if other.len() < cause.1.len() => cause = (j, other),
                Ok(_) => {}
                Err(_) => break,
            }
        }
        let (i, why) = cause;
        anyhow::anyhow!("replica {i} on {} failed: {why}", self.device_name(i))
    }
}

/// How long the pool waits for the other replicas' reports once one failed.
const CAUSE_WAIT: std::time::Duration = std::time::Duration::from_secs(5);

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
    let mut optim = Optim::<B>::new(TfOptimizer::from(&config.train.optimizer));
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

#[cfg(test)]
mod tests {
    use super::*;
    use burn::backend::Flex;
    use burn::tensor::Tensor;
    use data::loader::Position;
    use model::targets::GroundTruth;

    use crate::sync::{InProcessAllReduce, Mean, Transfer};

    /// What goes wrong in [`Faulty`], on its replica only.
    #[derive(Clone, Copy, PartialEq)]
    enum Fault {
        /// The replica panics in the exchange (as a kernel that runs out of memory does).
        Panic,
        /// The replica receives its first bucket's mean negated: its update differs.
        Negate,
    }

    thread_local! {
        /// This thread's replica panicked in [`Faulty`].
        static PANICKED: std::cell::Cell<bool> = const { std::cell::Cell::new(false) };
    }

    /// The in-process exchange with a fault injected on one replica.
    struct Faulty {
        inner: InProcessAllReduce<Flex>,
        fault: Option<(usize, Fault)>,
    }

    impl GradientSync<Flex> for Faulty {
        fn all_reduce_mean(
            &self,
            replica: usize,
            buckets: Vec<Tensor<Flex, 1>>,
            norm_before_tail: Option<usize>,
        ) -> Result<Mean<Flex>, String> {
            if self.fault == Some((replica, Fault::Panic)) {
                PANICKED.set(true);
                panic!("injected out-of-memory");
            }
            let mut mean = self
                .inner
                .all_reduce_mean(replica, buckets, norm_before_tail)?;
            if self.fault == Some((replica, Fault::Negate)) {
                mean.buckets[0] = -mean.buckets[0].clone();
            }
            Ok(mean)
        }

        fn single_replica(&self) -> bool {
            false
        }

        /// Called by a failing replica before it reports. The one that panicked reports late
        /// here, as a device thread that takes its time to unwind does, so that the replica
        /// released by the abort reports first.
        fn abort(&self, reason: String) {
            self.inner.abort(reason);
            if PANICKED.get() {
                std::thread::sleep(std::time::Duration::from_millis(300));
            }
        }
    }

    fn config() -> TrainConfig {
        let path = Path::new(env!("CARGO_MANIFEST_DIR")).join("../../configs/synthetic.json");
        let mut config = TrainConfig::load(&path).unwrap();
        config.model.image_size = [64, 64];
        config.model.depth_multiplier = 0.25;
        config
    }

    fn device() -> <Flex as burn::tensor::backend::BackendTypes>::Device {
        Default::default()
    }

    fn start(config: &TrainConfig) -> Start<Flex> {
        Start {
            model: config.model.init::<Train<Flex>>(7, &device()).unwrap(),
            optimizer: None,
            ema: None,
            step: 0,
            position: Position::default(),
        }
    }

    /// Two replicas on the CPU from `start`, exchanging through `fault`'s [`Faulty`].
    fn pool(
        config: &Arc<TrainConfig>,
        start: &Start<Flex>,
        fault: Option<(usize, Fault)>,
    ) -> ReplicaPool<Flex> {
        let device = device();
        let sync: Arc<dyn GradientSync<Flex>> = Arc::new(Faulty {
            inner: InProcessAllReduce::new(2, Transfer::SameDevice),
            fault,
        });
        let blueprint = Blueprint {
            config,
            start,
            anchors: &Arc::new(model::ssd::anchors(&config.model)),
            sync: &sync,
            bucketing: Bucketing::for_replicas(&[device; 2], false),
            run: "",
        };
        ReplicaPool::start(&[device; 2], &blueprint).unwrap()
    }

    /// One image per replica, each with one object.
    fn parts(config: &TrainConfig) -> Vec<Batch> {
        let [h, w] = config.model.image_size;
        (0..2)
            .map(|i| Batch {
                images: (0..3 * h * w)
                    .map(|p| ((p * 7 + i * 13) % 255) as f32 / 127.5 - 1.0)
                    .collect(),
                image_size: [h, w],
                ground_truth: vec![vec![GroundTruth {
                    bbox: BBox::new(0.2, 0.1 + 0.2 * i as f32, 0.7, 0.6 + 0.2 * i as f32),
                    class_id: 1 + i,
                }]],
                records: vec![i],
                sizes: vec![[h as u32, w as u32]],
                next_position: Position::default(),
            })
            .collect()
    }

    fn step(pool: &ReplicaPool<Flex>, config: &TrainConfig, step: u64) -> Result<Stepped> {
        let command = StepCommand {
            learning_rate: 0.01,
            step,
            stop: false,
            read_loss: true,
        };
        pool.step(parts(config), command)
    }

    /// A replica that fails ends the step with an error naming it and its device (not the
    /// replica that the abort released), and the other replica is not left waiting.
    #[test]
    fn a_replica_that_fails_ends_the_step_naming_it_and_its_device() {
        let config = Arc::new(config());
        let pool = pool(&config, &start(&config), Some((1, Fault::Panic)));
        let device = format!("{:?}", device());
        let err = step(&pool, &config, 0).unwrap_err().to_string();
        assert_eq!(
            err,
            format!("replica 1 on {device} failed: injected out-of-memory")
        );
        pool.shut_down();
    }

    /// Replicas whose weights differ stop the run at the checkpoint's bit-identity check,
    /// naming the replica, its device and the step; identical ones pass it.
    #[test]
    fn replicas_that_drift_apart_are_refused_at_the_checkpoint() {
        let config = Arc::new(config());
        // one start for both pools: the encoded weights carry the parameter ids
        let start = start(&config);
        let healthy = pool(&config, &start, None);
        step(&healthy, &config, 0).unwrap();
        // each replica's BatchNorm statistics are of its own images until averaged
        healthy.average_bn_stats().unwrap();
        let snapshot = healthy.snapshot(1).unwrap();
        healthy.shut_down();
        let drifting = pool(&config, &start, Some((1, Fault::Negate)));
        step(&drifting, &config, 0).unwrap();
        drifting.average_bn_stats().unwrap();
        let err = drifting.snapshot(1).err().unwrap().to_string();
        let device = format!("{:?}", device());
        assert_eq!(
            err,
            format!("replica 1 on {device} diverged from replica 0 at step 1")
        );
        // the fault changed replica 1 only: replica 0 holds the healthy run's weights
        let first = drifting.broadcast(&mut |_| Command::Snapshot).unwrap();
        match &first[0] {
            Reply::Snapshot(s) => assert!(s.weights == snapshot.weights),
            _ => panic!("a snapshot"),
        }
        drifting.shut_down();
    }
}
