//! Saving and loading network weights: Burn's named MessagePack record, written atomically
//! (temporary file, fsync, rename) and checked parameter by parameter against the config on
//! load, so a file made for another config is a clear error.

use std::panic::{AssertUnwindSafe, catch_unwind};
use std::path::Path;

use burn::module::{Module, ModuleVisitor, Param};
use burn::record::{FullPrecisionSettings, NamedMpkBytesRecorder, Recorder};
use burn::tensor::Tensor;
use burn::tensor::backend::Backend;

use crate::config::SsdConfig;
use crate::error::{ModelError, Result};
use crate::io::write_atomic;
use crate::ssd::Ssd;

type WeightsRecorder = NamedMpkBytesRecorder<FullPrecisionSettings>;

/// Encodes the weights (including BatchNorm moving statistics) as bytes.
pub fn weights_to_bytes<B: Backend>(model: &Ssd<B>) -> Vec<u8> {
    WeightsRecorder::default()
        .record(model.clone().into_record(), ())
        .expect("encoding a record in memory cannot fail")
}

/// Saves the weights to `path` atomically.
pub fn save_weights<B: Backend>(model: &Ssd<B>, path: &Path) -> Result<()> {
    write_atomic(path, &weights_to_bytes(model)).map_err(|source| ModelError::Io {
        action: "writing",
        path: path.to_path_buf(),
        source,
    })
}

/// Collects `(path, shape)` of every float parameter and running statistic.
#[derive(Default)]
struct ShapeCollector {
    stack: Vec<String>,
    shapes: Vec<(String, Vec<usize>)>,
}

impl<B: Backend> ModuleVisitor<B> for ShapeCollector {
    fn enter_module(&mut self, name: &str, _container_type: &str) {
        self.stack.push(name.to_string());
    }
    fn exit_module(&mut self, _name: &str, _container_type: &str) {
        self.stack.pop();
    }
    fn visit_float<const D: usize>(&mut self, param: &Param<Tensor<B, D>>) {
        self.shapes
            .push((self.stack.join("."), param.shape().to_vec()));
    }
}

fn shapes<B: Backend>(model: &Ssd<B>) -> Vec<(String, Vec<usize>)> {
    let mut collector = ShapeCollector::default();
    model.visit(&mut collector);
    collector.shapes
}

/// Decodes weights into the network of `config`, checking the shapes of every parameter
/// when `check_shapes` is set (without, tensors keep the file's shapes).
fn decode_checked<B: Backend>(
    config: &SsdConfig,
    bytes: Vec<u8>,
    path: &Path,
    device: &B::Device,
    check_shapes: bool,
) -> Result<Ssd<B>> {
    let fresh: Ssd<B> = config.init(0, device)?;
    let incompatible = |problem: String| ModelError::IncompatibleWeights {
        path: path.to_path_buf(),
        problem,
    };
    let record = WeightsRecorder::default()
        .load(bytes, device)
        .map_err(|e| incompatible(format!("not an SSD-MobileNet-v1 weights file ({e})")))?;
    let expected = shapes(&fresh);
    let loaded = catch_unwind(AssertUnwindSafe(|| fresh.load_record(record)))
        .map_err(|_| incompatible("the file's layer structure differs from the config".into()))?;
    let found = shapes(&loaded);
    if found.len() != expected.len() {
        return Err(incompatible(format!(
            "the file holds {} tensors where the config's network has {} (activation ranges of \
             quantization-aware training in one but not the other?)",
            found.len(),
            expected.len()
        )));
    }
    for ((name, want), (_, got)) in expected.iter().zip(found) {
        if check_shapes && *want != got {
            return Err(incompatible(format!(
                "parameter `{name}` has shape {got:?} in the file but {want:?} in the config \
                 (different num_classes, depth_multiplier or anchors?)"
            )));
        }
    }
    Ok(loaded)
}

/// Decodes weights for the network described by `config`, checking every parameter's shape.
pub fn weights_from_bytes<B: Backend>(
    config: &SsdConfig,
    bytes: Vec<u8>,
    path: &Path,
    device: &B::Device,
) -> Result<Ssd<B>> {
    decode_checked(config, bytes, path, device, true)
}

/// Decodes weights of the layer structure of `config` whose tensors may have other shapes
/// (a checkpoint made for another number of classes, to fine-tune from): each tensor keeps
/// the file's shape, for [`crate::restore`] to match by name and shape.
pub fn weights_any_shapes<B: Backend>(
    config: &SsdConfig,
    bytes: Vec<u8>,
    path: &Path,
    device: &B::Device,
) -> Result<Ssd<B>> {
    decode_checked(config, bytes, path, device, false)
}

/// Loads weights saved by [`save_weights`] into a network built from `config`.
pub fn load_weights<B: Backend>(
    config: &SsdConfig,
    path: &Path,
    device: &B::Device,
) -> Result<Ssd<B>> {
    let bytes = std::fs::read(path).map_err(|source| ModelError::Io {
        action: "reading",
        path: path.to_path_buf(),
        source,
    })?;
    weights_from_bytes(config, bytes, path, device)
}
