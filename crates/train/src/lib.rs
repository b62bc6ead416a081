//! The multi-device SSD learner: TF-semantics optimizers and learning-rate schedules, weight
//! EMA, data-parallel replicas with a bucketed gradient all-reduce, atomic checkpoints with
//! exact resume, and COCO / PASCAL VOC evaluation.
//!
//! - [`learner`]: a training run, its replicas and its step.
//! - [`sync`]: how replicas (and machines) average gradients.
//! - [`optim`]: TF's optimizers, gradient clipping and the weight EMA.
//! - [`config`]: training configs, JSON or an imported `pipeline.config`.
//! - [`checkpoint`], [`trained`]: checkpoints of a run, and a trained model wherever it lies.
//! - [`eval`]: detections on an evaluation set and their COCO / VOC scores.
//! - [`report`]: what a run writes for people: TensorBoard events, charts, drawn detections.
//! - [`detect`]: detection on image files.
//! - [`devices`]: which devices a run uses, and the one place that picks the backend.
//!
//! A config as `train` reads it: JSON, or the API's `pipeline.config` (imported, with notes on
//! what it leaves out), checked before anything runs:
//!
//! ```
//! use std::path::Path;
//! use train::config::TrainConfig;
//!
//! let path = Path::new(env!("CARGO_MANIFEST_DIR")).join("../../configs/synthetic.json");
//! let config = TrainConfig::load(&path)?;
//! let schedule = config.train.optimizer.learning_rate();
//! println!("batch {}, learning rate at step 0: {}", config.train.batch_size, schedule.at(0));
//! assert_eq!(config.model.num_classes, 2);
//! # Ok::<(), anyhow::Error>(())
//! ```

pub mod allocator;
pub mod checkpoint;
pub mod config;
pub mod detect;
pub mod devices;
pub mod eval;
pub mod learner;
pub mod optim;
pub mod report;
pub mod sync;
pub mod trained;
