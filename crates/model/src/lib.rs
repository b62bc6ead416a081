//! SSD-MobileNet-v1 as the TF Object Detection API defines it (`ssd_mobilenet_v1_pets.config`):
//! the MobileNet-v1 backbone with TF "SAME" padding, the four extra feature layers, the
//! convolutional box predictor, `ssd_anchor_generator` anchors, the Faster R-CNN box coder,
//! the argmax matcher, the loss with hard example mining, multi-class NMS, and an inference
//! API ([`Detector`]).
//!
//! Everything that holds tensors is generic over `B: burn::tensor::backend::Backend`.
//!
//! A detector from a config and weights, on the CPU backend. Here an untrained network of a
//! quarter of MobileNet's channels at 96x96 (`SsdConfig::init`); a trained one comes from a
//! file with `Detector::load(SsdConfig::load(path)?, weights, &device)`:
//!
//! ```
//! use burn::backend::Flex;
//! use model::{Detector, SsdConfig};
//!
//! let config = SsdConfig {
//!     num_classes: 2,
//!     class_names: vec!["cat".into(), "dog".into()],
//!     image_size: [96, 96],
//!     depth_multiplier: 0.25,
//!     ..SsdConfig::default()
//! };
//! let device = Default::default();
//! let network = config.init::<Flex>(7, &device)?;
//! let detector = Detector::new(config, network, &device)?;
//! let image = image::DynamicImage::new_rgb8(160, 120); // any size: resized to 96x96
//! for d in detector.detect(&image)? {
//!     assert!(["cat", "dog"].contains(&d.class_name.as_str()));
//!     assert!(d.pixel_bbox.xmax <= 160.0 && d.pixel_bbox.ymax <= 120.0);
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
pub mod fake_quant;
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
