//! The multi-device SSD learner: TF-semantics optimizers and learning-rate schedules, weight
//! EMA, data-parallel replicas with a bucketed gradient all-reduce, atomic checkpoints with
//! exact resume, and COCO / PASCAL VOC evaluation.

pub mod allocator;
pub mod charts;
pub mod checkpoint;
pub mod cluster;
pub mod config;
pub mod detect;
pub mod devices;
mod draw;
pub mod ema;
pub mod eval;
pub mod events;
pub mod learner;
pub mod metrics;
pub mod optim;
pub mod pipeline_config;
pub mod sync;
pub mod trained;
