//! Writing a checkpoint from the first replica's snapshot, and keeping the networks it holds
//! (raw and EMA) for evaluation.

use std::path::{Path, PathBuf};

use anyhow::{Context, Result};
use data::loader::Position;
use model::Ssd;
use model::ops::SsdBackend;
use model::weights::weights_from_bytes;

use super::replica::Snapshot;
use crate::checkpoint::{self, CheckpointFiles, CheckpointState};
use crate::config::TrainConfig;

/// A checkpoint just written, with its networks (inference side).
pub(super) struct Saved<B: SsdBackend> {
    pub dir: PathBuf,
    pub step: u64,
    pub model: Ssd<B>,
    pub ema: Option<Ssd<B>>,
}

impl<B: SsdBackend> Saved<B> {
    /// The network evaluation uses: the EMA weights when the run keeps them.
    pub fn evaluated(&self) -> &Ssd<B> {
        self.ema.as_ref().unwrap_or(&self.model)
    }
}

/// Where the run stands when a checkpoint is written.
pub(super) struct RunState {
    pub step: u64,
    pub position: Position,
    pub learning_rate: f64,
    pub replicas: usize,
}

/// Writes `snapshot` as checkpoint `state.step` of `model_dir` (pruning old ones as the
/// config says).
pub(super) fn save<B: SsdBackend>(
    config: &TrainConfig,
    model_dir: &Path,
    snapshot: Snapshot<B>,
    state: RunState,
    device: &B::Device,
) -> Result<Saved<B>> {
    let ema = ema_network(config, &snapshot, device)?;
    let checkpoint_state = CheckpointState {
        step: state.step,
        position: state.position,
        seed: config.train.seed,
        learning_rate: state.learning_rate,
        replicas: state.replicas,
        has_ema: snapshot.ema.is_some(),
    };
    let dir = checkpoint::save(
        model_dir,
        &checkpoint_state,
        &CheckpointFiles {
            weights: snapshot.weights,
            optimizer: snapshot.optimizer,
            ema: snapshot.ema,
            model_config: serde_json::to_vec_pretty(&config.model)?,
        },
        config.train.keep_checkpoints,
    )
    .context("writing a checkpoint (the previous one is kept)")?;
    Ok(Saved {
        dir,
        step: state.step,
        model: *snapshot.model,
        ema,
    })
}

/// The networks of checkpoint `dir`, written by an earlier run, from the snapshot of the
/// replicas that resumed it (to evaluate it without writing it again).
pub(super) fn written<B: SsdBackend>(
    config: &TrainConfig,
    dir: PathBuf,
    step: u64,
    snapshot: Snapshot<B>,
    device: &B::Device,
) -> Result<Saved<B>> {
    let ema = ema_network(config, &snapshot, device)?;
    Ok(Saved {
        dir,
        step,
        model: *snapshot.model,
        ema,
    })
}

/// The snapshot's EMA weights as a network, where the run keeps them.
fn ema_network<B: SsdBackend>(
    config: &TrainConfig,
    snapshot: &Snapshot<B>,
    device: &B::Device,
) -> Result<Option<Ssd<B>>> {
    snapshot
        .ema
        .as_ref()
        .map(|bytes| {
            weights_from_bytes::<B>(&config.model, bytes.clone(), Path::new("ema"), device)
        })
        .transpose()
        .map_err(Into::into)
}
