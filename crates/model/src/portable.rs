//! Portable weights: safetensors files with the TF Object Detection API's variable names, and
//! MobileNet-v1 backbone import.
//!
//! Tensor names (all `float32`, convolution kernels in `[out, in, kh, kw]` order, depthwise
//! kernels `[channels, 1, kh, kw]`, i.e. PyTorch's layout; TF stores `[kh, kw, in, out]`):
//!
//! | tensor | name |
//! |---|---|
//! | backbone convolution `i` (0..=13) | `FeatureExtractor/MobilenetV1/Conv2d_0/weights`, `.../Conv2d_<i>_depthwise/depthwise_weights`, `.../Conv2d_<i>_pointwise/weights` |
//! | its BatchNorm | `<layer>/BatchNorm/gamma`, `beta`, `moving_mean`, `moving_variance` |
//! | extra layer `i` (2..=5) | `FeatureExtractor/MobilenetV1/Conv2d_13_pointwise_1_Conv2d_<i>_1x1_<d/2>/...` and `..._2_Conv2d_<i>_3x3_s2_<d>/...` (`d` after the depth multiplier) |
//! | predictor for feature map `i` (0..=5) | `BoxPredictor_<i>/BoxEncodingPredictor/weights`, `biases`; `BoxPredictor_<i>/ClassPredictor/weights`, `biases` |
//!
//! The file's metadata holds the model config as JSON under `config`.
//!
//! [`import_mobilenet_v1`] reads a backbone from such a file, or from the Hugging Face
//! `transformers` layout of the `google/mobilenet_v1_*` checkpoints (converted from TF's slim
//! checkpoints, same layout and TF padding): `[mobilenet_v1.]conv_stem.convolution.weight`,
//! `[mobilenet_v1.]layer.<2i>` (depthwise `i + 1`) and `layer.<2i+1>` (pointwise `i + 1`), each
//! with `.convolution.weight` and `.normalization.{weight,bias,running_mean,running_var}`.

use std::collections::HashMap;
use std::path::Path;

use burn::module::Param;
use burn::nn::conv::Conv2d;
use burn::tensor::backend::Backend;
use burn::tensor::{Tensor, TensorData};
use safetensors::tensor::{Dtype, SafeTensors, TensorView};

use crate::config::SsdConfig;
use crate::error::{ModelError, Result};
use crate::layers::ConvBnRelu6;
use crate::mobilenet::SEPARABLE_BLOCKS;
use crate::ssd::{EXTRA_LAYER_DEPTHS, Ssd};
use crate::weights::write_atomic;

const BACKBONE: &str = "FeatureExtractor/MobilenetV1";

/// Name prefix of every convolution + BatchNorm unit, in [`Ssd::conv_units_mut`] order.
fn unit_names(config: &SsdConfig) -> Vec<String> {
    let mut names = vec![format!("{BACKBONE}/Conv2d_0")];
    for i in 1..=SEPARABLE_BLOCKS.len() {
        names.push(format!("{BACKBONE}/Conv2d_{i}_depthwise"));
        names.push(format!("{BACKBONE}/Conv2d_{i}_pointwise"));
    }
    for (i, &depth) in EXTRA_LAYER_DEPTHS.iter().enumerate() {
        let base = format!("{BACKBONE}/Conv2d_13_pointwise");
        let index = i + 2;
        names.push(format!(
            "{base}_1_Conv2d_{index}_1x1_{}",
            config.depth(depth / 2)
        ));
        names.push(format!(
            "{base}_2_Conv2d_{index}_3x3_s2_{}",
            config.depth(depth)
        ));
    }
    names
}

fn kernel_name(unit: &str) -> String {
    if unit.ends_with("_depthwise") {
        format!("{unit}/depthwise_weights")
    } else {
        format!("{unit}/weights")
    }
}

const BN_PARTS: [&str; 4] = ["gamma", "beta", "moving_mean", "moving_variance"];

fn values<B: Backend, const D: usize>(t: Tensor<B, D>) -> Vec<f32> {
    t.into_data()
        .convert::<f32>()
        .to_vec()
        .expect("a float tensor converts to f32")
}

/// `(name, shape, values)` of every tensor of the network, in a fixed order.
fn named_tensors<B: Backend>(
    model: &Ssd<B>,
    config: &SsdConfig,
) -> Vec<(String, Vec<usize>, Vec<f32>)> {
    let mut model = model.clone();
    let mut out = Vec::new();
    let mut push = |name: String, dims: Vec<usize>, v: Vec<f32>| out.push((name, dims, v));
    for (unit, name) in model.conv_units_mut().into_iter().zip(unit_names(config)) {
        let w = unit.conv.weight.val();
        push(kernel_name(&name), w.dims().to_vec(), values(w));
        let (mean, variance) = unit.bn.moving_stats();
        let parts = [unit.bn.gamma.val(), unit.bn.beta.val(), mean, variance];
        for (part, t) in BN_PARTS.iter().zip(parts) {
            push(
                format!("{name}/BatchNorm/{part}"),
                t.dims().to_vec(),
                values(t),
            );
        }
    }
    for (name, head) in head_names(&mut model) {
        let w = head.weight.val();
        push(format!("{name}/weights"), w.dims().to_vec(), values(w));
        if let Some(b) = &head.bias {
            let b = b.val();
            push(format!("{name}/biases"), b.dims().to_vec(), values(b));
        }
    }
    out
}

fn head_names<B: Backend>(model: &mut Ssd<B>) -> Vec<(String, &mut Conv2d<B>)> {
    let (boxes, classes) = model.heads_mut();
    let mut out = Vec::new();
    for (i, (b, c)) in boxes.iter_mut().zip(classes.iter_mut()).enumerate() {
        out.push((format!("BoxPredictor_{i}/BoxEncodingPredictor"), b));
        out.push((format!("BoxPredictor_{i}/ClassPredictor"), c));
    }
    out
}

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

/// A parsed safetensors file and where it came from (for error messages).
struct TensorFile<'a> {
    tensors: SafeTensors<'a>,
    path: &'a Path,
}

impl TensorFile<'_> {
    fn incompatible(&self, problem: String) -> ModelError {
        ModelError::IncompatibleWeights {
            path: self.path.to_path_buf(),
            problem,
        }
    }

    /// The first of `names` present, as an `f32` tensor of exactly `shape`.
    fn get<B: Backend, const D: usize>(
        &self,
        names: &[String],
        shape: [usize; D],
        device: &B::Device,
    ) -> Result<Tensor<B, D>> {
        let (name, view) = names
            .iter()
            .find_map(|n| self.tensors.tensor(n).ok().map(|v| (n, v)))
            .ok_or_else(|| self.incompatible(format!("no tensor named {}", names.join(" or "))))?;
        if view.dtype() != Dtype::F32 {
            return Err(self.incompatible(format!("{name} is {:?}, expected F32", view.dtype())));
        }
        if view.shape() != shape {
            return Err(self.incompatible(format!(
                "{name} has shape {:?}, this model needs {shape:?}",
                view.shape()
            )));
        }
        let v: Vec<f32> = view
            .data()
            .chunks_exact(4)
            .map(|b| f32::from_le_bytes([b[0], b[1], b[2], b[3]]))
            .collect();
        Ok(Tensor::from_data(TensorData::new(v, shape), device))
    }
}

fn read(path: &Path) -> Result<Vec<u8>> {
    std::fs::read(path).map_err(|source| ModelError::Io {
        action: "reading",
        path: path.to_path_buf(),
        source,
    })
}

fn parse<'a>(bytes: &'a [u8], path: &'a Path) -> Result<TensorFile<'a>> {
    let tensors = SafeTensors::deserialize(bytes).map_err(|e| ModelError::Decode {
        path: path.to_path_buf(),
        problem: e.to_string(),
    })?;
    Ok(TensorFile { tensors, path })
}

/// Sets one unit's kernel and BatchNorm from the file; `names(part)` lists the accepted
/// names of `part` ("kernel", "gamma", "beta", "moving_mean", "moving_variance").
fn load_unit<B: Backend>(
    file: &TensorFile,
    unit: &mut ConvBnRelu6<B>,
    names: impl Fn(&str) -> Vec<String>,
) -> Result<()> {
    let device = unit.conv.weight.device();
    let dims = unit.conv.weight.dims();
    unit.conv.weight = Param::from_tensor(file.get(&names("kernel"), dims, &device)?);
    let c = [dims[0]];
    unit.bn.gamma = Param::from_tensor(file.get(&names("gamma"), c, &device)?);
    unit.bn.beta = Param::from_tensor(file.get(&names("beta"), c, &device)?);
    unit.bn.set_moving_stats(
        file.get(&names("moving_mean"), c, &device)?,
        file.get(&names("moving_variance"), c, &device)?,
    );
    Ok(())
}

/// Loads a network saved by [`save_safetensors`] for `config` (every tensor must be present
/// with this config's shape; the error names the first that is not).
pub fn load_safetensors<B: Backend>(
    config: &SsdConfig,
    path: &Path,
    device: &B::Device,
) -> Result<Ssd<B>> {
    let bytes = read(path)?;
    let file = parse(&bytes, path)?;
    let mut model = config.init::<B>(0, device)?;
    let names = unit_names(config);
    for (unit, name) in model.conv_units_mut().into_iter().zip(&names) {
        load_unit(&file, unit, |part| match part {
            "kernel" => vec![kernel_name(name)],
            bn => vec![format!("{name}/BatchNorm/{bn}")],
        })?;
    }
    for (name, head) in head_names(&mut model) {
        let dims = head.weight.dims();
        head.weight = Param::from_tensor(file.get(&[format!("{name}/weights")], dims, device)?);
        if head.bias.is_some() {
            let b = file.get(&[format!("{name}/biases")], [dims[0]], device)?;
            head.bias = Some(Param::from_tensor(b));
        }
    }
    Ok(model)
}

/// Replaces the MobileNet-v1 backbone (kernels, BatchNorm scales, offsets and moving
/// statistics of `Conv2d_0` to `Conv2d_13`) with the one in a safetensors file, in this
/// crate's layout or the Hugging Face `transformers` one (module documentation). Extra layers
/// and predictor heads are untouched.
pub fn import_mobilenet_v1<B: Backend>(mut model: Ssd<B>, path: &Path) -> Result<Ssd<B>> {
    let bytes = read(path)?;
    let file = parse(&bytes, path)?;
    let backbone_units = 1 + 2 * SEPARABLE_BLOCKS.len();
    for (i, unit) in model
        .conv_units_mut()
        .into_iter()
        .take(backbone_units)
        .enumerate()
    {
        let ours = if i == 0 {
            format!("{BACKBONE}/Conv2d_0")
        } else {
            let kind = if i % 2 == 1 { "depthwise" } else { "pointwise" };
            format!("{BACKBONE}/Conv2d_{}_{kind}", i.div_ceil(2))
        };
        let hf = if i == 0 {
            "conv_stem".to_string()
        } else {
            format!("layer.{}", i - 1)
        };
        load_unit(&file, unit, |part| {
            let (tf_part, hf_part) = match part {
                "kernel" => (kernel_name(&ours), "convolution.weight".to_string()),
                "gamma" => (
                    format!("{ours}/BatchNorm/gamma"),
                    "normalization.weight".into(),
                ),
                "beta" => (
                    format!("{ours}/BatchNorm/beta"),
                    "normalization.bias".into(),
                ),
                "moving_mean" => (
                    format!("{ours}/BatchNorm/moving_mean"),
                    "normalization.running_mean".into(),
                ),
                _ => (
                    format!("{ours}/BatchNorm/moving_variance"),
                    "normalization.running_var".into(),
                ),
            };
            vec![
                tf_part,
                format!("mobilenet_v1.{hf}.{hf_part}"),
                format!("{hf}.{hf_part}"),
            ]
        })?;
    }
    Ok(model)
}
