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
