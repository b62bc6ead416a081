//! The training config's sections and their defaults: the model, the optimizer and its
//! learning-rate schedule, weight EMA, data, checkpointing and evaluation. Unknown fields are
//! rejected with their name. Every default lives here (the pipeline.config import uses them).

use std::path::PathBuf;

use data::augment::Augmentation;
use model::SsdConfig;
use model::restore::RestoreScope;
use serde::{Deserialize, Serialize};

/// A whole training config.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct TrainConfig {
    /// The detector.
    pub model: SsdConfig,
    /// Optimisation.
    pub train: TrainSettings,
    /// Data.
    pub data: DataSettings,
    /// Evaluation.
    #[serde(default)]
    pub eval: EvalSettings,
}

/// Optimisation settings (`train_config`).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct TrainSettings {
    /// Global batch size: the images of one step over all replicas together (it must divide
    /// evenly among them).
    pub batch_size: usize,
    /// Steps to train.
    pub num_steps: u64,
    /// The optimizer.
    pub optimizer: OptimizerConfig,
    /// Weight exponential moving average decay (`moving_average_decay`); `null` disables it.
    #[serde(default)]
    pub moving_average_decay: Option<f64>,
    /// Ramp the EMA decay up as `min(decay, (1 + n) / (10 + n))` after `n` updates (TF's
    /// `num_updates`); `false` (default) keeps it constant, as the API's optimizer builder does.
    #[serde(default)]
    pub moving_average_warmup: bool,
    /// Clip the gradients to this global norm (`gradient_clipping_by_norm`); `null` disables.
    #[serde(default)]
    pub gradient_clipping_by_norm: Option<f32>,
    /// Weights to start from (`fine_tune_checkpoint`): a TensorFlow checkpoint prefix
    /// (`.../model.ckpt`), a model dir or checkpoint folder of this project, a weights file
    /// (`.mpk`), or a `.safetensors` file (`model::portable` layout, or with
    /// `fine_tune_restore: classification` a Hugging Face `google/mobilenet_v1_*` backbone).
    #[serde(default)]
    pub fine_tune_checkpoint: Option<PathBuf>,
    /// Which of its variables are restored: `all` (every name and shape that match,
    /// `load_all_detection_checkpoint_vars: true`), `feature_extractor` (`detection`) or
    /// `classification` (the backbone from an ImageNet classification checkpoint). Optimizer
    /// slots and moving-average shadows are never restored when fine-tuning.
    #[serde(default)]
    pub fine_tune_restore: RestoreScope,
    /// Seed of weights, shuffling and augmentation.
    #[serde(default)]
    pub seed: u64,
    /// Save a checkpoint every this many steps.
    #[serde(default = "default_checkpoint_every")]
    pub checkpoint_every: u64,
    /// Checkpoints kept.
    #[serde(default = "default_keep")]
    pub keep_checkpoints: usize,
    /// Print a progress line every this many steps.
    #[serde(default = "default_log_every")]
    pub log_every: u64,
}

/// Default of `train.checkpoint_every`.
pub const DEFAULT_CHECKPOINT_EVERY: u64 = 500;
/// Default of `train.keep_checkpoints`.
pub const DEFAULT_KEEP_CHECKPOINTS: usize = 3;
/// Default of `train.log_every`.
pub const DEFAULT_LOG_EVERY: u64 = 10;
/// Default of `data.prefetch`.
pub const DEFAULT_PREFETCH: usize = 4;

fn default_checkpoint_every() -> u64 {
    DEFAULT_CHECKPOINT_EVERY
}
fn default_keep() -> usize {
    DEFAULT_KEEP_CHECKPOINTS
}
fn default_log_every() -> u64 {
    DEFAULT_LOG_EVERY
}

/// An optimizer with TF semantics.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case", deny_unknown_fields)]
pub enum OptimizerConfig {
    /// `rms_prop_optimizer`.
    RmsProp {
        /// Learning rate schedule.
        learning_rate: LearningRate,
        /// `momentum_optimizer_value`.
        momentum: f32,
        /// `decay`.
        decay: f32,
        /// `epsilon` (inside the square root).
        epsilon: f32,
    },
    /// `momentum_optimizer`.
    Momentum {
        /// Learning rate schedule.
        learning_rate: LearningRate,
        /// `momentum_optimizer_value`.
        momentum: f32,
    },
    /// `adam_optimizer`.
    Adam {
        /// Learning rate schedule.
        learning_rate: LearningRate,
        /// Default 0.9.
        beta1: f32,
        /// Default 0.999.
        beta2: f32,
        /// Default 1e-8.
        epsilon: f32,
    },
}

impl OptimizerConfig {
    /// The schedule of any optimizer.
    pub fn learning_rate(&self) -> &LearningRate {
        match self {
            Self::RmsProp { learning_rate, .. }
            | Self::Momentum { learning_rate, .. }
            | Self::Adam { learning_rate, .. } => learning_rate,
        }
    }
}

/// Learning-rate schedules of the API (`learning_schedules.py`).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case", deny_unknown_fields)]
pub enum LearningRate {
    /// `constant_learning_rate`.
    Constant {
        /// The rate.
        learning_rate: f64,
    },
    /// `exponential_decay_learning_rate` (`exponential_decay_with_burnin`).
    ExponentialDecay {
        /// `initial_learning_rate`.
        initial_learning_rate: f64,
        /// `decay_steps`.
        decay_steps: u64,
        /// `decay_factor`.
        decay_factor: f64,
        /// Decay in whole steps of `decay_steps` (default true).
        #[serde(default = "yes")]
        staircase: bool,
        /// `burnin_learning_rate` (0 = initial rate).
        #[serde(default)]
        burnin_learning_rate: f64,
        /// `burnin_steps`.
        #[serde(default)]
        burnin_steps: u64,
        /// `min_learning_rate`.
        #[serde(default)]
        min_learning_rate: f64,
    },
    /// `cosine_decay_learning_rate` (`cosine_decay_with_warmup`).
    CosineDecay {
        /// `learning_rate_base`.
        learning_rate_base: f64,
        /// `total_steps`.
        total_steps: u64,
        /// `warmup_learning_rate`.
        #[serde(default)]
        warmup_learning_rate: f64,
        /// `warmup_steps`.
        #[serde(default)]
        warmup_steps: u64,
        /// `hold_base_rate_steps`.
        #[serde(default)]
        hold_base_rate_steps: u64,
    },
    /// `manual_step_learning_rate`: `initial` until the first boundary, then each step's rate.
    ManualStep {
        /// Rate before the first boundary.
        initial_learning_rate: f64,
        /// `(step, rate)` pairs with increasing steps.
        schedule: Vec<(u64, f64)>,
    },
}

fn yes() -> bool {
    true
}

/// Data settings (`train_input_reader`, `eval_input_reader`).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct DataSettings {
    /// Training TFRecords (globs or `base@N`), relative to the working directory.
    pub train: Vec<String>,
    /// Evaluation TFRecords.
    #[serde(default)]
    pub eval: Vec<String>,
    /// Augmentation steps (`data_augmentation_options`): each a step's name alone (the API's
    /// defaults) or `{"name": {settings}}` ([`data::augment::deserialize_steps`]).
    #[serde(default, deserialize_with = "data::augment::deserialize_steps")]
    pub augmentation: Vec<Augmentation>,
    /// Loader threads (0: one per core).
    #[serde(default)]
    pub workers: usize,
    /// Batches prepared ahead.
    #[serde(default = "default_prefetch")]
    pub prefetch: usize,
    /// Generate the synthetic set into `datasets/synthetic` when this is true, `train` and
    /// `eval` are that set's own paths (`datasets/synthetic/{train,val}.record-*`, as in
    /// `configs/synthetic.json`), no command-line flag names other data, and the files are
    /// missing. Any other path that matches nothing is an error naming it.
    #[serde(default)]
    pub synthetic_if_missing: bool,
}

fn default_prefetch() -> usize {
    DEFAULT_PREFETCH
}

/// Evaluation settings (`eval_config`).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct EvalSettings {
    /// Evaluate every this many steps (0: only at the end).
    pub every: u64,
    /// Evaluate at most this many images (0: all).
    pub max_images: usize,
    /// Evaluation batch size.
    pub batch_size: usize,
}

impl Default for EvalSettings {
    fn default() -> Self {
        Self {
            every: 0,
            max_images: 0,
            batch_size: 8,
        }
    }
}
