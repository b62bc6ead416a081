//! Datasets for SSD training: TFRecord files of `tf.train.Example`s with the Object Detection
//! API's keys, label maps, PASCAL VOC / Oxford-IIIT Pet folders, COCO annotation files and the
//! built-in synthetic cats-and-dogs set; the protobuf text format of label maps and pipeline configs.
//!
//! ```
//! use data::label_map::LabelMap;
//!
//! let map = LabelMap::parse("item { id: 1 name: 'cat' } item { id: 2 name: 'dog' }")?;
//! assert_eq!(map.id_of("dog"), Some(2));
//! // one image of the synthetic set: its objects' boxes are normalised to the image
//! let sample = data::synthetic::generate(7, 0);
//! for (bbox, class) in &sample.objects {
//!     assert!(bbox.xmin < bbox.xmax && bbox.xmax <= 1.0 && [1, 2].contains(class));
//! }
//! # Ok::<(), String>(())
//! ```

pub mod augment;
pub mod coco;
pub mod error;
pub mod example;
pub mod images;
pub mod label_map;
pub mod loader;
pub mod prepare;
pub mod shards;
pub mod synthetic;
pub mod textproto;
pub mod tfrecord;
pub mod validate;
pub mod voc;

pub use error::{DataError, Result};
pub use example::{DetectionExample, Object};
pub use label_map::LabelMap;
