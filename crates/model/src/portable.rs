//! Portable weights: safetensors files with the TF Object Detection API's variable names
//! ([`crate::tf::names`]), and MobileNet-v1 backbone import.
//!
//! Tensors are `float32` in this crate's layout: convolution kernels `[out, in, kh, kw]`,
//! depthwise kernels `[channels, 1, kh, kw]` (PyTorch's layout; TF stores `[kh, kw, in, out]`).
//! The file's metadata holds the model config as JSON under `config`.
//!
//! [`import_mobilenet_v1`] reads a backbone from such a file, or from the Hugging Face
//! `transformers` layout of the `google/mobilenet_v1_*` checkpoints (converted from TF's slim
//! checkpoints, same layout and TF padding): `[mobilenet_v1.]conv_stem.convolution.weight`,
//! `[mobilenet_v1.]layer.<2i>` (depthwise `i + 1`) and `layer.<2i+1>` (pointwise `i + 1`), each
//! with `.convolution.weight` and `.normalization.{weight,bias,running_mean,running_var}`.

use std::collections::HashMap;
use std::path::Path;

use burn::tensor::backend::Backend;
use safetensors::tensor::{Dtype, TensorView};

use crate::config::SsdConfig;
use crate::error::{ModelError, Result};
use crate::io::write_atomic;
use crate::restore::{RestoreScope, SafetensorsSource, restore, restore_exact};
use crate::ssd::Ssd;
use crate::tf::names::named_tensors;

/// Writes the network's weights (BatchNorm moving statistics included) as safetensors with
/// the names in the module documentation, the config in the metadata; atomically.
pub fn save_safetensors<B: Backend>(model: &Ssd<B>, config: &SsdConfig, path: &Path) -> Result<()> {
    let tensors = named_tensors(model, config);
    let bytes: Vec<(String, Vec<usize>, Vec<u8>)> = tensors
        .into_iter()
        .map(|(n, s, v)| (n, s, v.iter().flat_map(|x| x.to_le_bytes()).collect()))
        .collect();
    let views = bytes
        .iter()
        .map(|(n, s, b)| {
            TensorView::new(Dtype::F32, s.clone(), b)
                .map(|v| (n.clone(), v))
                .map_err(|e| ModelError::Decode {
                    path: path.to_path_buf(),
                    problem: format!("{n}: {e}"),
                })
        })
        .collect::<Result<Vec<_>>>()?;
    let config_json = serde_json::to_string(config).expect("a config serialises");
    let metadata = HashMap::from([("config".to_string(), config_json)]);
    let encoded =
        safetensors::serialize(views, Some(metadata)).map_err(|e| ModelError::Decode {
            path: path.to_path_buf(),
            problem: e.to_string(),
        })?;
    write_atomic(path, &encoded).map_err(|source| ModelError::Io {
        action: "writing",
        path: path.to_path_buf(),
        source,
    })
}

/// The model config stored in a safetensors file by [`save_safetensors`], if any.
pub fn safetensors_config(path: &Path) -> Result<Option<SsdConfig>> {
    let Some(json) = SafetensorsSource::open(path)?.config_json()? else {
        return Ok(None);
    };
    serde_json::from_str(&json)
        .map(Some)
        .map_err(|e| ModelError::Decode {
            path: path.to_path_buf(),
            problem: format!("the config in its metadata: {e}"),
        })
}

/// Loads a network saved by [`save_safetensors`] for `config` (every tensor must be present
/// with this config's shape; the error names the first that is not).
pub fn load_safetensors<B: Backend>(
    config: &SsdConfig,
    path: &Path,
    device: &B::Device,
) -> Result<Ssd<B>> {
    let source = SafetensorsSource::open(path)?;
    restore_exact(config.init::<B>(0, device)?, config, &source)
}

/// Replaces the MobileNet-v1 backbone (kernels, BatchNorm scales, offsets and moving
/// statistics of `Conv2d_0` to `Conv2d_13`) with the one in a safetensors file, in this
/// crate's layout or the Hugging Face `transformers` one (module documentation). Extra layers
/// and predictor heads are untouched; a backbone tensor missing from the file is an error.
pub fn import_mobilenet_v1<B: Backend>(
    model: Ssd<B>,
    config: &SsdConfig,
    path: &Path,
) -> Result<Ssd<B>> {
    let source = SafetensorsSource::open(path)?;
    let (model, report) = restore(model, config, &source, RestoreScope::Classification)?;
    let shape_problem = report.skipped.iter().find(|(r, _)| r.starts_with("shape"));
    if let Some((reason, names)) = shape_problem {
        return Err(ModelError::IncompatibleWeights {
            path: path.to_path_buf(),
            problem: format!("{reason}: {}", names[0]),
        });
    }
    if let Some(name) = report.missing.first() {
        return Err(ModelError::IncompatibleWeights {
            path: path.to_path_buf(),
            problem: format!("no tensor for {name}"),
        });
    }
    Ok(model)
}
