//! What the learner tests share: a tiny synthetic dataset, a config for it, and samples of
//! a network's weights.

use std::path::Path;
use std::sync::Arc;
use std::sync::atomic::AtomicBool;

use burn::backend::Flex;
use burn::tensor::backend::Backend;
use model::ops::SsdBackend;
use model::weights::load_weights;
use model::{Ssd, SsdConfig};
use train::config::{
    DataSettings, EvalSettings, LearningRate, OptimizerConfig, TrainConfig, TrainSettings,
};
use train::learner::{RunOptions, RunSummary, train};

/// Three training shards of 24 images and 6 evaluation images, two classes.
pub fn prepare(dir: &Path) {
    data::prepare::prepare_synthetic(dir, 3, 24, 6, 2, &|_, _| {}).unwrap();
}

/// A tiny network (64x64, depth 0.25) trained on [`prepare`]'s data for `steps` steps,
/// checkpointed every 2 steps, logged every step.
pub fn config(dir: &Path, steps: u64) -> TrainConfig {
    TrainConfig {
        model: SsdConfig {
            num_classes: 2,
            image_size: [64, 64],
            depth_multiplier: 0.25,
            ..Default::default()
        },
        train: TrainSettings {
            batch_size: 4,
            num_steps: steps,
            optimizer: OptimizerConfig::RmsProp {
                learning_rate: LearningRate::Constant {
                    learning_rate: 0.002,
                },
                momentum: 0.9,
                decay: 0.9,
                epsilon: 1.0,
            },
            moving_average_decay: None,
            moving_average_warmup: true,
            gradient_clipping_by_norm: None,
            fine_tune_checkpoint: None,
            fine_tune_restore: model::restore::RestoreScope::All,
            seed: 5,
            checkpoint_every: 2,
            keep_checkpoints: 5,
            log_every: 1,
        },
        data: DataSettings {
            train: vec![format!("{}/train.record-*", dir.display())],
            eval: vec![format!("{}/val.record-*", dir.display())],
            augmentation: vec![data::augment::Augmentation::RandomHorizontalFlip {
                probability: 0.5,
            }],
            workers: 1,
            prefetch: 2,
            synthetic_if_missing: false,
        },
        eval: EvalSettings {
            every: 0,
            max_images: 6,
            batch_size: 3,
        },
    }
}

/// The first convolution's filters, the first class head's filters and the first
/// BatchNorm's moving variance, one after the other.
pub fn sampled_weights<I: Backend>(net: &Ssd<I>) -> Vec<f32> {
    let mut all = Vec::new();
    for w in [
        net.backbone.conv0.conv.weight.val(),
        net.class_heads[0].weight.val(),
    ] {
        all.extend(w.into_data().to_vec::<f32>().unwrap());
    }
    all.extend(
        net.backbone
            .conv0
            .bn
            .moving_stats()
            .1
            .into_data()
            .to_vec::<f32>()
            .unwrap(),
    );
    all
}

/// The first convolution's and the first class head's filters: what a step's gradients change
/// (unlike the BatchNorm statistics of [`sampled_weights`]).
pub fn filters<I: Backend>(net: &Ssd<I>) -> Vec<f32> {
    [
        net.backbone.conv0.conv.weight.val(),
        net.class_heads[0].weight.val(),
    ]
    .into_iter()
    .flat_map(|w| w.into_data().to_vec::<f32>().unwrap())
    .collect()
}

/// The largest element-wise difference.
pub fn max_diff(a: &[f32], b: &[f32]) -> f32 {
    assert_eq!(a.len(), b.len());
    a.iter()
        .zip(b)
        .map(|(x, y)| (x - y).abs())
        .fold(0.0, f32::max)
}

/// Trains `config` into `model_dir` on `devices` (one replica each), quietly.
pub fn run_on<B: SsdBackend>(
    config: &TrainConfig,
    model_dir: &Path,
    devices: &[B::Device],
) -> anyhow::Result<RunSummary> {
    let options = RunOptions {
        model_dir: model_dir.to_path_buf(),
        stop: Arc::new(AtomicBool::new(false)),
        verbose: false,
        nodes: None,
        repeat_first_batch: false,
        without_lock: false,
    };
    train::<B>(config, devices, &options)
}

/// [`sampled_weights`] of the latest checkpoint in `model_dir`.
pub fn weights(config: &TrainConfig, model_dir: &Path) -> Vec<f32> {
    let dir = train::checkpoint::latest(model_dir).unwrap().unwrap();
    let net: Ssd<Flex> =
        load_weights(&config.model, &dir.join("model.mpk"), &Default::default()).unwrap();
    sampled_weights(&net)
}

/// The total loss of each logged step.
pub fn losses(model_dir: &Path) -> Vec<f64> {
    std::fs::read_to_string(model_dir.join("metrics.jsonl"))
        .unwrap()
        .lines()
        .map(|l| serde_json::from_str::<serde_json::Value>(l).unwrap())
        .filter_map(|v| v["loss"]["total"].as_f64())
        .collect()
}
