//! One replica: a thread holding a copy of the network, its optimizer state and (on the
//! first replica) the weight EMA, that takes its slice of every batch and answers the
//! [`Command`]s of the pool. A step is: this replica's gradients, their mean over all replicas
//! through the [`GradientSync`], the clipped update and the EMA.

use std::panic::{AssertUnwindSafe, catch_unwind};
use std::sync::Arc;
use std::sync::mpsc::{Receiver, Sender};
use std::time::Instant;

use burn::backend::Autodiff;
use burn::module::AutodiffModule;
use burn::optim::GradientsParams;
use burn::record::{FullPrecisionSettings, NamedMpkBytesRecorder, Recorder};
use burn::tensor::backend::Backend;
use burn::tensor::{Tensor, TensorData};
use data::loader::Batch;
use model::loss::compute_step_loss;
use model::ops::SsdBackend;
use model::targets::assign_targets;
use model::weights::weights_to_bytes;
use model::{BBox, Ssd};
use serde::Serialize;

use crate::config::TrainConfig;
use crate::optim::ema::Ema;
use crate::optim::network::NetworkOptimizer;
use crate::optim::{clip_by_global_norm, squared_global_norm};
use crate::sync::{
    Bucketing, GradientSync, bn_stats_flat, flatten_gradients, ranges_flat, set_bn_stats_flat,
    set_ranges_flat, unflatten_gradients, weight_checksum,
};

pub(super) type Train<B> = Autodiff<B>;
pub(super) type Optim<B> = NetworkOptimizer<Train<B>>;
pub(super) type OptimRecorder = NamedMpkBytesRecorder<FullPrecisionSettings>;

/// Values at the start of a step's averaged tail: the four loss parts, the stop request,
/// the matched and the mined anchors per image.
const LOSS_TAIL: usize = 7;

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

/// What the pool asks of a replica.
pub(super) enum Command {
    /// One training step on this replica's part of the batch.
    Step {
        batch: Batch,
        learning_rate: f64,
        step: u64,
        /// This process was asked to stop (a signal) after this step.
        stop: bool,
        /// Read the loss back from the device (a logging, checkpoint or last step, or every
        /// step of a multi-node run, whose stop requests travel with it).
        read_loss: bool,
    },
    /// Check that every replica everywhere is at the same step with the same weights in the
    /// same run (`run`: a hash of the config and training records).
    Join { step: u64, run: u16 },
    /// Replace the BatchNorm moving statistics by their mean over all replicas.
    AverageBnStats,
    /// The weights, optimizer state and EMA, encoded, and the network for evaluation.
    Snapshot,
}

/// A replica's answer to a [`Command`].
pub(super) enum Reply<B: Backend> {
    Stepped(Stepped),
    Snapshot(Snapshot<B>),
    Done,
}

/// The outcome of a step, the same on every replica.
#[derive(Debug, Clone, Copy)]
pub(super) struct Stepped {
    /// The loss parts, averaged over all replicas, where the step read them.
    pub loss: Option<LossValues>,
    /// Seconds this replica spent in the exchange.
    pub sync_seconds: f64,
    /// Some process of the run was asked to stop: every one stops after this step.
    pub stop: bool,
}

/// A replica's state, encoded for a checkpoint.
pub(super) struct Snapshot<B: Backend> {
    pub weights: Vec<u8>,
    pub optimizer: Vec<u8>,
    pub ema: Option<Vec<u8>>,
    /// The network itself (inference side), for evaluation.
    pub model: Box<Ssd<B>>,
}

/// One replica's network, optimizer and EMA, and how it reaches the others.
pub(super) struct Replica<B: SsdBackend> {
    pub index: usize,
    pub device: B::Device,
    /// The replica's network; `None` only while [`Replica::apply`] updates it.
    pub model: Option<Ssd<Train<B>>>,
    pub optim: Optim<B>,
    pub ema: Option<Ema<B>>,
    pub config: Arc<TrainConfig>,
    pub anchors: Arc<Vec<BBox>>,
    pub sync: Arc<dyn GradientSync<B>>,
    /// How the gradients travel through `sync`.
    pub bucketing: Bucketing,
}

type StepResult<B> = Result<Reply<B>, String>;

/// What a step reads back to the host.
#[derive(Debug, Clone, Copy)]
struct Reading {
    /// This process was asked to stop after the step.
    stop: bool,
    /// Read the averaged tail (loss parts, stop requests, target counts).
    loss: bool,
}

/// A step's gradients after the exchange.
struct Averaged<B: Backend> {
    grads: GradientsParams,
    /// The averaged tail, on the device.
    tail: Tensor<B, 1>,
    /// The squared global norm of `grads`, when clipping needs it.
    squared_norm: Option<Tensor<B, 1>>,
    sync_seconds: f64,
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
        read: Reading,
    ) -> StepResult<B> {
        if let (Some(q), Some(model)) = (&self.config.model.quantization, self.model.as_mut()) {
            model.set_fake_quant_active(q.active_at(step));
        }
        let (grads, tail) = self.gradients(batch, read);
        let averaged = self.average(grads, tail)?;
        if !self.sync.single_replica() {
            self.share_ranges(&averaged.tail);
        }
        let loss = match read.loss {
            true => Some(to_host(averaged.tail)?),
            false => None,
        };
        self.apply(averaged.grads, averaged.squared_norm, learning_rate, step);
        Ok(Reply::Stepped(Stepped {
            loss: loss.as_deref().map(|mean| LossValues {
                classification: mean[0],
                localization: mean[1],
                regularization: mean[2],
                total: mean[3],
                matched_per_image: mean[5],
                mined_negatives_per_image: mean[6],
            }),
            sync_seconds: averaged.sync_seconds,
            stop: loss.map_or(read.stop, |mean| mean[4] > 0.0),
        }))
    }

    /// Sets the activation ranges of quantization-aware training to their mean over the
    /// replicas, which rode at the end of the averaged tail: each replica moved the same
    /// ranges towards its own batch's, so the mean is the ranges moved towards the mean of
    /// the batches', and every replica quantizes the next step over the same ranges.
    fn share_ranges(&self, tail: &Tensor<B, 1>) {
        let len = tail.dims()[0] - LOSS_TAIL;
        if len > 0 {
            let ranges = tail.clone().narrow(0, LOSS_TAIL, len);
            set_ranges_flat(self.model(), Tensor::from_inner(ranges));
        }
    }

    /// This replica's gradients and a tail of values to average with them: the loss parts,
    /// the stop request, the matched and mined anchors per image ([`LOSS_TAIL`] values), then
    /// the activation ranges of quantization-aware training. The L2 term's value is formed
    /// only where the step reads its loss.
    fn gradients(&self, batch: Batch, read: Reading) -> (GradientsParams, Tensor<B, 1>) {
        let cfg = &self.config.model;
        let coder = cfg.box_coder();
        let targets: Vec<_> = batch
            .ground_truth
            .iter()
            .map(|gt| assign_targets(&cfg.matcher, &coder, &self.anchors, gt))
            .collect();
        let images = batch.images_tensor::<Train<B>>(&self.device);
        let loss = compute_step_loss(
            self.model(),
            cfg,
            &self.anchors,
            images,
            &targets,
            read.loss,
        );
        let grads = loss.gradients(self.model());
        let images = targets.len().max(1) as f32;
        let host_values = vec![
            if read.stop { 1.0f32 } else { 0.0 },
            loss.num_matches as f32 / images,
            loss.num_mined_negatives as f32 / images,
        ];
        let mut tail = vec![
            loss.classification.inner(),
            loss.localization.inner(),
            loss.regularization.inner(),
            loss.total.inner(),
            Tensor::from_data(TensorData::new(host_values, [3]), &self.device),
        ];
        tail.extend(ranges_flat(self.model()).map(|r| r.inner()));
        (grads, Tensor::cat(tail, 0))
    }

    /// The mean over all replicas of the gradients and of the tail, the squared global norm
    /// when clipping needs it, and the seconds the exchange took. The tail rides at the end
    /// of the last bucket: its mean comes back with the gradients, at no extra exchange, so
    /// every machine logs the same loss and stops after the same step; the norm is formed
    /// once in the exchange, so every replica clips by the same factor. A lone replica keeps
    /// its own.
    fn average(&self, grads: GradientsParams, tail: Tensor<B, 1>) -> Result<Averaged<B>, String> {
        let clipping = self.config.train.gradient_clipping_by_norm.is_some();
        if self.sync.single_replica() {
            let squared_norm = clipping
                .then(|| squared_global_norm(self.model(), &grads))
                .flatten();
            return Ok(Averaged {
                grads,
                tail,
                squared_norm,
                sync_seconds: 0.0,
            });
        }
        let tail_len = tail.dims()[0];
        let (layout, buckets) = flatten_gradients(self.model(), grads, Some(tail), self.bucketing);
        let start = Instant::now();
        let mean = self
            .sync
            .all_reduce_mean(self.index, buckets, clipping.then_some(tail_len))?;
        let sync_seconds = start.elapsed().as_secs_f64();
        let last = mean
            .buckets
            .last()
            .ok_or("the exchange returned no buckets")?;
        let tail = last.clone().narrow(0, last.dims()[0] - tail_len, tail_len);
        Ok(Averaged {
            grads: unflatten_gradients::<Train<B>>(&layout, mean.buckets),
            tail,
            squared_norm: mean.squared_norm,
            sync_seconds,
        })
    }

    /// Clips the averaged gradients (when configured), then updates the weights and the EMA.
    fn apply(
        &mut self,
        mut grads: GradientsParams,
        squared_norm: Option<Tensor<B, 1>>,
        learning_rate: f64,
        step: u64,
    ) {
        if let (Some(max_norm), Some(squared_norm)) =
            (self.config.train.gradient_clipping_by_norm, squared_norm)
        {
            grads = clip_by_global_norm(self.model(), grads, max_norm, squared_norm);
        }
        // taken, not cloned: holding the only reference to each weight and slot, the
        // optimizer updates them in place
        let model = self
            .model
            .take()
            .expect("a replica holds its network between steps");
        let mut averaging = self.ema.take().map(|ema| ema.averaging(step + 1));
        let model = self
            .optim
            .step(learning_rate, model, grads, averaging.as_mut());
        self.model = Some(model);
        self.ema = averaging.map(|a| a.finish());
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
                read_loss,
            } => {
                let read = Reading {
                    stop,
                    loss: read_loss,
                };
                self.step(batch, learning_rate, step, read)
            }
            Command::Join { step, run } => self.join(step, run).map(|()| Reply::Done),
            Command::AverageBnStats => self.average_bn_stats().map(|()| Reply::Done),
            Command::Snapshot => self.snapshot().map(Reply::Snapshot),
        }
    }

    /// Checks that every replica of every process is at the same step with the same weights
    /// in the same run: a process that cannot see the checkpoint would silently start afresh,
    /// one with another config or other data would train something else, and replicas whose
    /// weights drifted apart train different networks.
    fn join(&self, step: u64, run: u16) -> Result<(), String> {
        let checksum = weight_checksum(&self.model().valid());
        // small integers: their mean over identical replicas is exact in f32
        let mine = [step as f32, (checksum % 65_536) as f32, f32::from(run)];
        let probe = Tensor::from_data(TensorData::new(mine.to_vec(), [3]), &self.device);
        let all = self.sync.all_reduce_mean(self.index, vec![probe], None)?;
        let mean = to_host(all.buckets[0].clone())?;
        let differs = |i: usize| (mine[i] - mean[i]).abs() >= 0.25;
        if differs(2) {
            return Err(format!(
                "the processes do not train the same run: the config or the training records (names, sizes, count) differ between them (hash {} here, mean {} over all); every process needs the same config and data",
                mine[2], mean[2]
            ));
        }
        if differs(0) || differs(1) {
            return Err(format!(
                "the replicas are not at the same point: this one is at step {step} (weights hash {}), the mean over all replicas is step {} (hash {}); every process needs the same config and model dir contents (shared storage or a copy of the latest checkpoint)",
                mine[1], mean[0], mean[1]
            ));
        }
        Ok(())
    }

    fn average_bn_stats(&self) -> Result<(), String> {
        let flat = bn_stats_flat(&self.model().valid());
        let mean = self
            .sync
            .all_reduce_mean(self.index, vec![flat], None)?
            .buckets
            .pop()
            .ok_or("the exchange returned nothing")?;
        // the EMA network takes the BatchNorm statistics as they are (TF averages only the
        // trainable weights): the averaged ones, as the raw network
        if let Some(ema) = &self.ema {
            set_bn_stats_flat(ema.shadow(), mean.clone());
        }
        set_bn_stats_flat(self.model(), Tensor::from_inner(mean));
        Ok(())
    }

    fn snapshot(&self) -> Result<Snapshot<B>, String> {
        let model = self.model().valid();
        Ok(Snapshot {
            weights: weights_to_bytes(&model),
            optimizer: OptimRecorder::default()
                .record(self.optim.to_record(), ())
                .map_err(|e| e.to_string())?,
            ema: self.ema.as_ref().map(|e| weights_to_bytes(e.shadow())),
            model: Box::new(model),
        })
    }

    /// Answers `commands` until they end or one fails (a failure, panics included, aborts
    /// the exchange so that no other replica waits for this one).
    pub(super) fn run(
        mut self,
        commands: Receiver<Command>,
        replies: Sender<(usize, Result<Reply<B>, String>)>,
    ) {
        while let Ok(command) = commands.recv() {
            let result = catch_unwind(AssertUnwindSafe(|| self.handle(command)))
                .unwrap_or_else(|e| Err(panic_message(e)));
            if let Err(why) = &result {
                self.sync.abort(format!(
                    "replica {} on {:?} failed: {why}",
                    self.index, self.device
                ));
            }
            let failed = result.is_err();
            if replies.send((self.index, result)).is_err() || failed {
                break;
            }
        }
    }
}
