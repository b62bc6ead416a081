//! Training configs (JSON): the model, the optimizer and its learning-rate schedule, weight
//! EMA, data, checkpointing and evaluation. Unknown fields are rejected with their name.

use std::path::{Path, PathBuf};

use anyhow::{Context, Result, bail};
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

fn default_checkpoint_every() -> u64 {
    500
}
fn default_keep() -> usize {
    3
}
fn default_log_every() -> u64 {
    10
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
    /// Augmentation steps (`data_augmentation_options`).
    #[serde(default)]
    pub augmentation: Vec<Augmentation>,
    /// Loader threads (0: one per core).
    #[serde(default)]
    pub workers: usize,
    /// Batches prepared ahead.
    #[serde(default = "default_prefetch")]
    pub prefetch: usize,
    /// When the training data is missing and this is true, generate the synthetic set.
    #[serde(default)]
    pub synthetic_if_missing: bool,
}

fn default_prefetch() -> usize {
    4
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

impl TrainConfig {
    /// Reads and validates a JSON config, or imports a TF Object Detection API
    /// `pipeline.config` (a `.config` file; each note of the import is printed to stderr).
    pub fn load(path: &Path) -> Result<Self> {
        if path.extension().is_some_and(|e| e == "config") {
            let imported = crate::pipeline_config::import(path)?;
            for note in &imported.notes {
                eprintln!("note: {}: {note}", path.display());
            }
            return Ok(imported.config);
        }
        let text = std::fs::read_to_string(path)
            .with_context(|| format!("reading config {}", path.display()))?;
        let config: Self =
            serde_json::from_str(&text).with_context(|| format!("config {}", path.display()))?;
        config
            .validate()
            .with_context(|| format!("config {}", path.display()))?;
        Ok(config)
    }

    /// Checks every value; the error names the field.
    pub fn validate(&self) -> Result<()> {
        self.model.validate()?;
        let t = &self.train;
        if t.batch_size == 0 {
            bail!("`train.batch_size` must be at least 1");
        }
        if let Some(d) = t.moving_average_decay
            && !(0.0..1.0).contains(&d)
        {
            bail!("`train.moving_average_decay` must be in [0, 1), got {d}");
        }
        if let Some(n) = t.gradient_clipping_by_norm
            && !(n.is_finite() && n > 0.0)
        {
            bail!("`train.gradient_clipping_by_norm` must be positive, got {n}");
        }
        if t.num_steps == 0 {
            bail!("`train.num_steps` must be at least 1, got 0");
        }
        if t.log_every == 0 {
            bail!("`train.log_every` must be at least 1, got 0");
        }
        if t.checkpoint_every == 0 {
            bail!("`train.checkpoint_every` must be at least 1");
        }
        if t.keep_checkpoints == 0 {
            bail!("`train.keep_checkpoints` must be at least 1");
        }
        match &t.optimizer {
            OptimizerConfig::RmsProp {
                momentum,
                decay,
                epsilon,
                ..
            } => {
                if !(0.0..1.0).contains(momentum)
                    || !(0.0..1.0).contains(decay)
                    || epsilon.partial_cmp(&0.0) != Some(std::cmp::Ordering::Greater)
                {
                    bail!(
                        "`train.optimizer.rms_prop`: momentum and decay must be in [0, 1), epsilon positive"
                    );
                }
            }
            OptimizerConfig::Momentum { momentum, .. } => {
                if !(0.0..1.0).contains(momentum) {
                    bail!("`train.optimizer.momentum.momentum` must be in [0, 1)");
                }
            }
            OptimizerConfig::Adam {
                beta1,
                beta2,
                epsilon,
                ..
            } => {
                if !(0.0..1.0).contains(beta1)
                    || !(0.0..1.0).contains(beta2)
                    || epsilon.partial_cmp(&0.0) != Some(std::cmp::Ordering::Greater)
                {
                    bail!("`train.optimizer.adam`: betas must be in [0, 1), epsilon positive");
                }
            }
        }
        self.train.optimizer.learning_rate().validate()?;
        if self.data.train.is_empty() {
            bail!("`data.train` must name at least one TFRecord file or pattern");
        }
        if self.eval.batch_size == 0 {
            bail!("`eval.batch_size` must be at least 1");
        }
        Ok(())
    }
}

impl LearningRate {
    fn validate(&self) -> Result<()> {
        let ok = match self {
            Self::Constant { learning_rate } => *learning_rate >= 0.0,
            Self::ExponentialDecay {
                initial_learning_rate,
                decay_steps,
                decay_factor,
                ..
            } => *initial_learning_rate >= 0.0 && *decay_steps > 0 && *decay_factor > 0.0,
            Self::CosineDecay {
                learning_rate_base,
                total_steps,
                warmup_steps,
                hold_base_rate_steps,
                warmup_learning_rate,
            } => {
                *learning_rate_base >= 0.0
                    && *total_steps > warmup_steps + hold_base_rate_steps
                    && warmup_learning_rate <= learning_rate_base
            }
            Self::ManualStep {
                initial_learning_rate,
                schedule,
            } => {
                *initial_learning_rate >= 0.0
                    && schedule.iter().all(|(_, rate)| *rate >= 0.0)
                    && schedule.windows(2).all(|w| w[0].0 < w[1].0)
            }
        };
        if ok {
            Ok(())
        } else {
            bail!("`train.optimizer.learning_rate` is invalid: {self:?}")
        }
    }

    /// The rate at `step` (the number of steps already taken), as the API computes it.
    pub fn at(&self, step: u64) -> f64 {
        match *self {
            Self::Constant { learning_rate } => learning_rate,
            Self::ExponentialDecay {
                initial_learning_rate,
                decay_steps,
                decay_factor,
                staircase,
                burnin_learning_rate,
                burnin_steps,
                min_learning_rate,
            } => {
                if step < burnin_steps {
                    return if burnin_learning_rate == 0.0 {
                        initial_learning_rate
                    } else {
                        burnin_learning_rate
                    };
                }
                let p = (step - burnin_steps) as f64 / decay_steps as f64;
                let p = if staircase { p.floor() } else { p };
                (initial_learning_rate * decay_factor.powf(p)).max(min_learning_rate)
            }
            Self::CosineDecay {
                learning_rate_base,
                total_steps,
                warmup_learning_rate,
                warmup_steps,
                hold_base_rate_steps,
            } => {
                if step > total_steps {
                    return 0.0;
                }
                let s = step as f64;
                let denom = (total_steps - warmup_steps - hold_base_rate_steps) as f64;
                let mut lr = 0.5
                    * learning_rate_base
                    * (1.0
                        + (std::f64::consts::PI
                            * (s - warmup_steps as f64 - hold_base_rate_steps as f64)
                            / denom)
                            .cos());
                if hold_base_rate_steps > 0 && step <= warmup_steps + hold_base_rate_steps {
                    lr = learning_rate_base;
                }
                if warmup_steps > 0 && step < warmup_steps {
                    let slope = (learning_rate_base - warmup_learning_rate) / warmup_steps as f64;
                    lr = slope * s + warmup_learning_rate;
                }
                lr
            }
            Self::ManualStep {
                initial_learning_rate,
                ref schedule,
            } => schedule
                .iter()
                .take_while(|(boundary, _)| step >= *boundary)
                .last()
                .map_or(initial_learning_rate, |&(_, lr)| lr),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn exponential_decay_staircase() {
        let lr = LearningRate::ExponentialDecay {
            initial_learning_rate: 0.004,
            decay_steps: 800_720,
            decay_factor: 0.95,
            staircase: true,
            burnin_learning_rate: 0.0,
            burnin_steps: 0,
            min_learning_rate: 0.0,
        };
        assert_eq!(lr.at(0), 0.004);
        assert_eq!(lr.at(800_719), 0.004);
        assert!((lr.at(800_720) - 0.0038).abs() < 1e-12);
        assert!((lr.at(2 * 800_720 + 5) - 0.004 * 0.9025).abs() < 1e-12);
        let smooth = LearningRate::ExponentialDecay {
            initial_learning_rate: 1.0,
            decay_steps: 10,
            decay_factor: 0.5,
            staircase: false,
            burnin_learning_rate: 0.1,
            burnin_steps: 5,
            min_learning_rate: 0.3,
        };
        assert_eq!(smooth.at(4), 0.1); // burn-in
        assert!((smooth.at(10) - 0.5f64.powf(0.5)).abs() < 1e-12); // (10 - 5) / 10
        assert_eq!(smooth.at(1000), 0.3); // floor at min_learning_rate
    }

    #[test]
    fn cosine_decay_with_warmup_and_hold() {
        let lr = LearningRate::CosineDecay {
            learning_rate_base: 1.0,
            total_steps: 120,
            warmup_learning_rate: 0.1,
            warmup_steps: 10,
            hold_base_rate_steps: 10,
        };
        assert!((lr.at(0) - 0.1).abs() < 1e-12);
        assert!((lr.at(5) - (0.09 * 5.0 + 0.1)).abs() < 1e-12);
        assert_eq!(lr.at(15), 1.0); // hold
        assert_eq!(lr.at(20), 1.0);
        // halfway through the cosine part: 0.5 * (1 + cos(pi / 2)) = 0.5
        assert!((lr.at(70) - 0.5).abs() < 1e-12);
        assert!(lr.at(120).abs() < 1e-12);
        assert_eq!(lr.at(121), 0.0);
    }

    #[test]
    fn manual_step_and_constant() {
        let lr = LearningRate::ManualStep {
            initial_learning_rate: 0.01,
            schedule: vec![(100, 0.001), (200, 0.0001)],
        };
        assert_eq!(lr.at(99), 0.01);
        assert_eq!(lr.at(100), 0.001);
        assert_eq!(lr.at(250), 0.0001);
        assert_eq!(LearningRate::Constant { learning_rate: 0.2 }.at(7), 0.2);
    }

    #[test]
    fn shipped_configs_are_valid_and_unknown_fields_rejected() {
        let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("../../configs");
        for name in [
            "synthetic.json",
            "ssd_mobilenet_v1_pets.json",
            "ssd_mobilenet_v1_catdog.json",
        ] {
            TrainConfig::load(&dir.join(name)).unwrap();
        }
        let text = std::fs::read_to_string(dir.join("synthetic.json")).unwrap();
        let bad = text.replacen("\"batch_size\"", "\"batch_sise\"", 1);
        let err = serde_json::from_str::<TrainConfig>(&bad)
            .unwrap_err()
            .to_string();
        assert!(err.contains("batch_sise"), "{err}");
    }

    #[test]
    fn zero_steps_zero_log_interval_and_negative_rates_are_refused() {
        let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("../../configs");
        let good = TrainConfig::load(&dir.join("synthetic.json")).unwrap();
        let refused = |edit: &dyn Fn(&mut TrainConfig), field: &str| {
            let mut c = good.clone();
            edit(&mut c);
            let err = c.validate().unwrap_err().to_string();
            assert!(err.contains(field), "{err}");
        };
        refused(
            &|c| c.train.num_steps = 0,
            "`train.num_steps` must be at least 1, got 0",
        );
        refused(
            &|c| c.train.log_every = 0,
            "`train.log_every` must be at least 1, got 0",
        );
        let rates = [
            LearningRate::Constant {
                learning_rate: -0.1,
            },
            LearningRate::Constant {
                learning_rate: f64::NAN,
            },
            LearningRate::ManualStep {
                initial_learning_rate: 0.1,
                schedule: vec![(10, -0.01)],
            },
        ];
        for rate in rates {
            let rate = &rate;
            refused(
                &|c| {
                    c.train.optimizer = OptimizerConfig::Momentum {
                        learning_rate: rate.clone(),
                        momentum: 0.9,
                    }
                },
                "`train.optimizer.learning_rate` is invalid",
            );
        }
    }
}
