//! Evaluation: running a network over an evaluation set ([`dataset`]), reading COCO-format
//! ground truth and results ([`coco_json`]), and scoring them with the COCO and PASCAL VOC
//! metrics ([`metrics`]).

pub mod coco_json;
pub mod dataset;
pub mod metrics;

pub use coco_json::read_coco;
pub use dataset::run_on_dataset;
pub use metrics::{COCO_NAMES, Metrics, evaluate};
