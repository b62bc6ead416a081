//! SSD-MobileNet-v1 as the TF Object Detection API defines it (`ssd_mobilenet_v1_pets.config`):
//! the MobileNet-v1 backbone with TF "SAME" padding, the four extra feature layers, the
//! convolutional box predictor, `ssd_anchor_generator` anchors, the Faster R-CNN box coder,
//! the argmax matcher, the loss with hard example mining, multi-class NMS, and an inference
//! API ([`Detector`]).
//!
//! Everything that holds tensors is generic over `B: burn::tensor::backend::Backend`.
//!
//! ```no_run
//! use burn::backend::Flex;
//! use model::{Detector, SsdConfig};
//!
//! let config = SsdConfig::load("model.json".as_ref())?;
//! let detector = Detector::<Flex>::load(config, "model.mpk".as_ref(), &Default::default())?;
//! let image = image::open("cat.jpg").expect("an image");
//! for d in detector.detect(&image)? {
//!     println!("{} {:.2} {:?}", d.class_name, d.score, d.pixel_bbox);
//! }
//! # Ok::<(), model::ModelError>(())
//! ```

pub mod anchors;
pub mod box_coder;
pub mod boxes;
pub mod config;
pub mod error;
pub mod export;
mod floats;
pub mod inference;
pub mod io;
mod layers;
pub mod loss;
pub mod memory;
pub mod mobilenet;
pub mod ops;
pub mod portable;
pub mod postprocess;
pub mod preprocess;
pub mod restore;
pub mod ssd;
pub mod targets;
#[cfg(test)]
mod test_data;
pub mod tf;
pub mod weights;

pub use boxes::BBox;
pub use config::SsdConfig;
pub use error::{ModelError, Result};
pub use inference::{Detection, Detector};
pub use layers::{BatchNorm, ConvBnRelu6};
pub use ssd::{Predictions, Ssd};
