//! Where a run starts: resumed from the model dir's latest checkpoint (weights, optimizer
//! slots, EMA, step and data position), or fresh weights, fine-tuned from a checkpoint when
//! the config names one.

use std::path::Path;

use anyhow::{Context, Result, bail};
use burn::tensor::backend::Backend;
use data::loader::Position;
use model::Ssd;
use model::weights::load_weights;

use super::replica::Train;
use super::run_log::RunLog;
use crate::checkpoint::{self, CheckpointState, MODEL_CONFIG_FILE};
use crate::config::TrainConfig;

/// Starting weights, optimizer state, EMA and position.
pub(super) struct Start<B: Backend> {
    pub model: Ssd<Train<B>>,
    pub optimizer: Option<Vec<u8>>,
    pub ema: Option<Ssd<B>>,
    pub step: u64,
    pub position: Position,
}

/// Where a run starts: the model dir's latest checkpoint, else fresh weights (restored from
/// `train.fine_tune_checkpoint` when it names one).
pub(super) fn starting_point<B: Backend>(
    config: &TrainConfig,
    model_dir: &Path,
    device: &B::Device,
    log: &RunLog,
) -> Result<Start<B>> {
    let mc = &config.model;
    if let Some(dir) = checkpoint::latest(model_dir)? {
        let state = checkpoint::read_state(&dir)?;
        check_resumable(&dir, &state, config)?;
        log.say(format!(
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
        log.say(format!(
            "fine-tuning from {} (restore scope `{}`)",
            source.display(),
            scope.name()
        ));
        for line in report.summary(source) {
            log.say(line);
        }
    } else {
        log.say(format!(
            "training from scratch (random weights, seed {}): the config names no `train.fine_tune_checkpoint`; the API's recipes fine-tune from the model zoo's COCO checkpoint (see the guide's Coming from the TF Object Detection API)",
            config.train.seed
        ));
    }
    Ok(Start {
        model,
        optimizer: None,
        ema: None,
        step: 0,
        position: Position::default(),
    })
}

/// A checkpoint resumes only the run that wrote it: the same seed (the data order and the
/// augmentation follow from it) and the same model config. Anything else is an error saying
/// what to do, never a silent fresh start or a half-matching restore.
fn check_resumable(dir: &Path, state: &CheckpointState, config: &TrainConfig) -> Result<()> {
    let seed = config.train.seed;
    if state.seed != seed {
        bail!(
            "{} was written by a run with seed {}, and this run has seed {seed}: resuming with another seed changes the data order and the augmentation. Pass --seed {} to resume it, or another --model-dir to start a new run",
            dir.display(),
            state.seed,
            state.seed
        );
    }
    let path = dir.join(MODEL_CONFIG_FILE);
    let Ok(text) = std::fs::read_to_string(&path) else {
        return Ok(()); // written before checkpoints kept their config: the weights are checked on load
    };
    // both sides through the same typed round trip, so that f32 values compare equal
    let stored: model::SsdConfig =
        serde_json::from_str(&text).with_context(|| format!("{} is damaged", path.display()))?;
    let stored = serde_json::to_value(&stored)?;
    let ours = serde_json::to_value(&config.model)?;
    let differing: Vec<&str> = ours
        .as_object()
        .into_iter()
        .flatten()
        .filter(|(k, v)| stored.get(k.as_str()) != Some(*v))
        .map(|(k, _)| k.as_str())
        .collect();
    if !differing.is_empty() {
        bail!(
            "{} was written for another model config (`model.{}` differ{}): resume it with the config it was trained with, or pass another --model-dir to start a new run",
            dir.display(),
            differing.join("`, `model."),
            if differing.len() == 1 { "s" } else { "" }
        );
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn config() -> TrainConfig {
        let path = Path::new(env!("CARGO_MANIFEST_DIR")).join("../../configs/synthetic.json");
        TrainConfig::load(&path).unwrap()
    }

    fn state(seed: u64) -> CheckpointState {
        CheckpointState {
            step: 7,
            position: Position::default(),
            seed,
            learning_rate: 0.1,
            replicas: 1,
            has_ema: false,
        }
    }

    #[test]
    fn another_seed_or_model_config_is_an_error_saying_what_to_do() {
        let dir = tempfile::tempdir().unwrap();
        let c = config();
        let seed = c.train.seed;
        // written before checkpoints kept their config: only the seed is checked
        check_resumable(dir.path(), &state(seed), &c).unwrap();
        let err = check_resumable(dir.path(), &state(seed + 1), &c)
            .unwrap_err()
            .to_string();
        assert!(
            err.contains(&format!("--seed {} to resume it", seed + 1)),
            "{err}"
        );
        let stored = serde_json::to_vec_pretty(&c.model).unwrap();
        std::fs::write(dir.path().join(MODEL_CONFIG_FILE), stored).unwrap();
        check_resumable(dir.path(), &state(seed), &c).unwrap();
        let mut other = c.clone();
        other.model.num_classes += 1;
        other.model.class_names.clear();
        other.model.image_size = [160, 160];
        let err = check_resumable(dir.path(), &state(seed), &other)
            .unwrap_err()
            .to_string();
        for field in ["model.class_names", "model.image_size", "model.num_classes"] {
            assert!(err.contains(field), "{err}");
        }
        assert!(
            err.contains("was written for another model config"),
            "{err}"
        );
        assert!(!err.contains("model.anchors"), "{err}");
    }
}
