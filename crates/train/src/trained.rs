//! A trained network as users name it: a model dir or checkpoint folder of this project, an
//! exported `.safetensors` file, or a TensorFlow checkpoint, with the model config it was
//! made for; and the sources a fine-tune restores from.

use std::path::{Path, PathBuf};

use anyhow::{Context, Result, bail};
use burn::tensor::backend::Backend;
use model::restore::{
    MemorySource, RestoreReport, RestoreScope, SafetensorsSource, TensorSource, TfCheckpointSource,
    restore, restore_exact,
};
use model::tf::bundle::is_checkpoint;
use model::tf::names::named_tensors;
use model::{Ssd, SsdConfig};

use crate::checkpoint::{self, MODEL_CONFIG_FILE};

/// Which weights to take from a run or checkpoint that keeps both.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum Weights {
    /// The trained weights.
    Raw,
    /// Their exponential moving average (what the API evaluates and exports).
    MovingAverage,
}

#[derive(Debug, Clone)]
enum Source {
    /// One of this project's `.mpk` weights files.
    Record(PathBuf),
    Safetensors(PathBuf),
    Tf {
        prefix: PathBuf,
        moving_average: bool,
    },
}

/// A trained network, located and with its config, ready to load.
#[derive(Debug, Clone)]
pub struct TrainedModel {
    /// The model config.
    pub config: SsdConfig,
    source: Source,
}

fn read_model_config(path: &Path) -> Result<SsdConfig> {
    let text =
        std::fs::read_to_string(path).with_context(|| format!("reading {}", path.display()))?;
    serde_json::from_str(&text).with_context(|| format!("model config {}", path.display()))
}

impl TrainedModel {
    /// Locates the network `path` names: a TF checkpoint prefix (or its `.index`, or a folder
    /// with a TF `checkpoint` file), a `.safetensors` export, a checkpoint folder or a model
    /// dir (its latest checkpoint). `config` overrides the config found with the weights (a
    /// TF checkpoint has none, so it needs one). `weights` picks raw or moving-average weights
    /// (default: the moving average when there is one).
    pub fn locate(
        path: &Path,
        config: Option<SsdConfig>,
        weights: Option<Weights>,
    ) -> Result<Self> {
        if path.extension().is_some_and(|e| e == "safetensors") {
            if weights.is_some() {
                bail!(
                    "{}: an exported file holds one set of weights; --weights applies to runs and checkpoints",
                    path.display()
                );
            }
            let config = match config {
                Some(c) => c,
                None => model::portable::safetensors_config(path)?.with_context(|| {
                    format!(
                        "{} has no model config in its metadata: pass --config",
                        path.display()
                    )
                })?,
            };
            return Ok(Self {
                config,
                source: Source::Safetensors(path.to_path_buf()),
            });
        }
        if is_checkpoint(path) {
            let config = config.with_context(|| {
                format!("{} is a TensorFlow checkpoint, which holds no model config: pass --config (JSON or pipeline.config)", path.display())
            })?;
            let has_shadows = TfCheckpointSource::open(path, true).is_ok();
            let moving_average = match weights {
                Some(Weights::MovingAverage) => true,
                Some(Weights::Raw) => false,
                None => has_shadows,
            };
            return Ok(Self {
                config,
                source: Source::Tf {
                    prefix: path.to_path_buf(),
                    moving_average,
                },
            });
        }
        let ckpt = checkpoint_folder(path)?;
        let state = checkpoint::read_state(&ckpt)?;
        let file = match (weights, state.has_ema) {
            (Some(Weights::MovingAverage), false) => {
                bail!(
                    "{} keeps no moving-average weights (moving_average_decay was off)",
                    ckpt.display()
                )
            }
            (Some(Weights::Raw), _) | (None, false) => "model.mpk",
            _ => "ema.mpk",
        };
        let config = match config {
            Some(c) => c,
            None => {
                let stored = ckpt.join(MODEL_CONFIG_FILE);
                if !stored.is_file() {
                    bail!(
                        "{} holds no {MODEL_CONFIG_FILE} (written before it was kept): pass --config",
                        ckpt.display()
                    );
                }
                read_model_config(&stored)?
            }
        };
        Ok(Self {
            config,
            source: Source::Record(ckpt.join(file)),
        })
    }

    /// What is loaded, for messages.
    pub fn describe(&self) -> String {
        match &self.source {
            Source::Record(p) | Source::Safetensors(p) => p.display().to_string(),
            Source::Tf {
                prefix,
                moving_average,
            } => format!(
                "{} ({} weights)",
                prefix.display(),
                if *moving_average {
                    "moving-average"
                } else {
                    "raw"
                }
            ),
        }
    }

    /// Builds the network and loads every weight (a missing or misshapen tensor is an error).
    pub fn load<B: Backend>(&self, device: &B::Device) -> Result<Ssd<B>> {
        let c = &self.config;
        Ok(match &self.source {
            Source::Record(p) => model::weights::load_weights(c, p, device)?,
            Source::Safetensors(p) => model::portable::load_safetensors(c, p, device)?,
            Source::Tf {
                prefix,
                moving_average,
            } => {
                let source = TfCheckpointSource::open(prefix, *moving_average)?;
                restore_exact(c.init(0, device)?, c, &source)?
            }
        })
    }
}

/// The checkpoint folder `path` names: itself, or a model dir's latest.
fn checkpoint_folder(path: &Path) -> Result<PathBuf> {
    if path.join("state.json").is_file() {
        return Ok(path.to_path_buf());
    }
    if !path.exists() {
        bail!(
            "{} does not exist (expected a model dir, a checkpoint folder, a .safetensors file or a TensorFlow checkpoint prefix)",
            path.display()
        );
    }
    checkpoint::latest(path)?.with_context(|| format!("{} holds no checkpoint", path.display()))
}

/// Restores `model` from the fine-tune checkpoint `path` under `scope`: a TensorFlow
/// checkpoint (its trained values, not the moving averages, as the API fine-tunes), a
/// `.safetensors` file, a `.mpk` weights file, or a model dir / checkpoint folder (its
/// trained weights).
pub fn fine_tune<B: Backend>(
    model: Ssd<B>,
    config: &SsdConfig,
    path: &Path,
    scope: RestoreScope,
    device: &B::Device,
) -> Result<(Ssd<B>, RestoreReport)> {
    let source: Box<dyn TensorSource> = if is_checkpoint(path) {
        Box::new(TfCheckpointSource::open(path, false)?)
    } else if path.extension().is_some_and(|e| e == "safetensors") {
        Box::new(SafetensorsSource::open(path)?)
    } else {
        let file = if path.is_file() {
            path.to_path_buf()
        } else {
            checkpoint_folder(path)?.join("model.mpk")
        };
        let bytes = std::fs::read(&file).with_context(|| format!("reading {}", file.display()))?;
        // weights only: a float run's file has no activation ranges, and a quantized run's
        // are not restored (fine-tuning learns its own)
        let float = SsdConfig {
            quantization: None,
            ..config.clone()
        };
        let net = model::weights::weights_any_shapes::<B>(&float, bytes, &file, device)?;
        Box::new(MemorySource::new(&file, named_tensors(&net, config)))
    };
    let result = restore(model, config, source.as_ref(), scope)
        .with_context(|| format!("fine_tune_checkpoint {}", path.display()))?;
    Ok(result)
}
