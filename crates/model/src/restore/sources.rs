//! The places tensors are restored from.

use std::collections::HashMap;
use std::path::{Path, PathBuf};

use safetensors::SafeTensors;
use safetensors::tensor::Dtype;

use super::TensorSource;
use crate::error::{ModelError, Result};
use crate::floats::FloatEncoding;
use crate::mobilenet::SEPARABLE_BLOCKS;
use crate::tf::bundle::{Checkpoint, DType};
use crate::tf::names::{is_depthwise_kernel, is_moving_statistic, kernel_from_tf};

/// A TensorFlow checkpoint, its kernels converted to this crate's layout; with
/// `moving_average`, each trained variable is read from its `ExponentialMovingAverage`
/// shadow (what the API evaluates and exports), BatchNorm moving statistics as they are.
pub struct TfCheckpointSource {
    checkpoint: Checkpoint,
    moving_average: bool,
}

const SHADOW: &str = "/ExponentialMovingAverage";

impl TfCheckpointSource {
    /// Opens the checkpoint at `path` (see [`Checkpoint::open`]). With `moving_average`, a
    /// checkpoint without shadows is an error.
    pub fn open(path: &Path, moving_average: bool) -> Result<Self> {
        let checkpoint = Checkpoint::open(path)?;
        if moving_average && !checkpoint.names().any(|n| n.ends_with(SHADOW)) {
            return Err(ModelError::Checkpoint {
                path: checkpoint.prefix().to_path_buf(),
                problem: "holds no ExponentialMovingAverage shadows (trained without use_moving_average?)".into(),
            });
        }
        Ok(Self {
            checkpoint,
            moving_average,
        })
    }

    /// The checkpoint tensor that stands for variable `name`.
    fn stored(&self, name: &str) -> String {
        if self.moving_average && !is_moving_statistic(name) && !name.ends_with(SHADOW) {
            format!("{name}{SHADOW}")
        } else {
            name.to_string()
        }
    }
}

impl TensorSource for TfCheckpointSource {
    fn path(&self) -> &Path {
        self.checkpoint.prefix()
    }

    fn stored_name(&self, name: &str) -> String {
        self.stored(name)
    }

    fn names(&self) -> Vec<String> {
        self.checkpoint.names().map(str::to_string).collect()
    }

    fn shape(&self, name: &str) -> Option<Vec<usize>> {
        let info = self.checkpoint.info(&self.stored(name))?;
        if !matches!(
            info.dtype,
            DType::F32 | DType::F64 | DType::F16 | DType::BF16
        ) {
            return None;
        }
        let s = &info.shape;
        Some(match s.len() {
            4 if is_depthwise_kernel(name) => vec![s[2].saturating_mul(s[3]), 1, s[0], s[1]],
            4 => vec![s[3], s[2], s[0], s[1]],
            _ => s.clone(),
        })
    }

    fn values(&self, name: &str) -> Result<Vec<f32>> {
        let stored = self.stored(name);
        let values = self.checkpoint.read_f32(&stored)?;
        let info = self.checkpoint.info(&stored).expect("read above");
        if info.shape.len() == 4 {
            Ok(kernel_from_tf(&info.shape, &values, is_depthwise_kernel(name)).1)
        } else {
            Ok(values)
        }
    }
}

/// A safetensors file: this crate's layout (`train export`), or a Hugging Face
/// `transformers` MobileNet-v1 (`google/mobilenet_v1_*`, converted from TF-slim with the
/// same layout), whose backbone tensors it offers under TF-slim's names (`MobilenetV1/...`).
pub struct SafetensorsSource {
    path: PathBuf,
    bytes: Vec<u8>,
    /// Our name -> the file's name, for the Hugging Face layout.
    aliases: HashMap<String, String>,
}

impl SafetensorsSource {
    /// Reads and parses `path`.
    pub fn open(path: &Path) -> Result<Self> {
        let bytes = std::fs::read(path).map_err(|source| ModelError::Io {
            action: "reading",
            path: path.to_path_buf(),
            source,
        })?;
        let mut source = Self {
            path: path.to_path_buf(),
            bytes,
            aliases: HashMap::new(),
        };
        let names = source
            .file()?
            .names()
            .into_iter()
            .map(str::to_string)
            .collect::<Vec<_>>();
        source.aliases = hugging_face_aliases(&names);
        Ok(source)
    }

    fn file(&self) -> Result<SafeTensors<'_>> {
        SafeTensors::deserialize(&self.bytes).map_err(|e| ModelError::Decode {
            path: self.path.clone(),
            problem: e.to_string(),
        })
    }

    /// The model config stored in the file's metadata by `train export`, if any.
    pub fn config_json(&self) -> Result<Option<String>> {
        let (_, metadata) =
            SafeTensors::read_metadata(&self.bytes).map_err(|e| ModelError::Decode {
                path: self.path.clone(),
                problem: e.to_string(),
            })?;
        Ok(metadata
            .metadata()
            .as_ref()
            .and_then(|m| m.get("config").cloned()))
    }

    fn stored<'a>(&'a self, name: &'a str) -> &'a str {
        self.aliases.get(name).map_or(name, String::as_str)
    }
}

/// TF-slim names of the backbone mapped to the Hugging Face names present in `names`.
fn hugging_face_aliases(names: &[String]) -> HashMap<String, String> {
    let parts = [
        ("weights", "convolution.weight"),
        ("depthwise_weights", "convolution.weight"),
        ("BatchNorm/gamma", "normalization.weight"),
        ("BatchNorm/beta", "normalization.bias"),
        ("BatchNorm/moving_mean", "normalization.running_mean"),
        ("BatchNorm/moving_variance", "normalization.running_var"),
    ];
    let mut units = vec![("Conv2d_0".to_string(), "conv_stem".to_string())];
    for i in 1..=SEPARABLE_BLOCKS.len() {
        units.push((
            format!("Conv2d_{i}_depthwise"),
            format!("layer.{}", 2 * i - 2),
        ));
        units.push((
            format!("Conv2d_{i}_pointwise"),
            format!("layer.{}", 2 * i - 1),
        ));
    }
    let mut out = HashMap::new();
    for (ours, hf) in &units {
        for (our_part, hf_part) in parts {
            for prefix in ["mobilenet_v1.", ""] {
                let theirs = format!("{prefix}{hf}.{hf_part}");
                if names.contains(&theirs) {
                    out.insert(format!("MobilenetV1/{ours}/{our_part}"), theirs);
                }
            }
        }
    }
    out
}

impl TensorSource for SafetensorsSource {
    fn path(&self) -> &Path {
        &self.path
    }

    fn names(&self) -> Vec<String> {
        self.file()
            .map(|f| f.names().into_iter().map(str::to_string).collect())
            .unwrap_or_default()
    }

    fn stored_name(&self, name: &str) -> String {
        self.stored(name).to_string()
    }

    fn shape(&self, name: &str) -> Option<Vec<usize>> {
        let file = self.file().ok()?;
        let view = file.tensor(self.stored(name)).ok()?;
        float_encoding(view.dtype()).map(|_| view.shape().to_vec())
    }

    fn values(&self, name: &str) -> Result<Vec<f32>> {
        let file = self.file()?;
        let view = file
            .tensor(self.stored(name))
            .map_err(|e| ModelError::Decode {
                path: self.path.clone(),
                problem: format!("{name}: {e}"),
            })?;
        let encoding = float_encoding(view.dtype()).ok_or_else(|| ModelError::Decode {
            path: self.path.clone(),
            problem: format!("{name} is {:?}, not a floating-point tensor", view.dtype()),
        })?;
        Ok(encoding.decode(view.data()))
    }
}

/// How a safetensors dtype encodes floats, `None` for the others (integers, booleans, 8-bit
/// floats).
fn float_encoding(dtype: Dtype) -> Option<FloatEncoding> {
    match dtype {
        Dtype::F16 => Some(FloatEncoding::F16),
        Dtype::BF16 => Some(FloatEncoding::BF16),
        Dtype::F32 => Some(FloatEncoding::F32),
        Dtype::F64 => Some(FloatEncoding::F64),
        _ => None,
    }
}

/// Tensors already in memory (e.g. the weights of one of this crate's checkpoints).
pub struct MemorySource {
    path: PathBuf,
    tensors: HashMap<String, (Vec<usize>, Vec<f32>)>,
}

impl MemorySource {
    /// `(name, shape, values)` triples that came from `path`.
    pub fn new(path: &Path, tensors: Vec<(String, Vec<usize>, Vec<f32>)>) -> Self {
        Self {
            path: path.to_path_buf(),
            tensors: tensors.into_iter().map(|(n, s, v)| (n, (s, v))).collect(),
        }
    }
}

impl TensorSource for MemorySource {
    fn path(&self) -> &Path {
        &self.path
    }

    fn names(&self) -> Vec<String> {
        let mut names: Vec<String> = self.tensors.keys().cloned().collect();
        names.sort();
        names
    }

    fn shape(&self, name: &str) -> Option<Vec<usize>> {
        self.tensors.get(name).map(|(s, _)| s.clone())
    }

    fn values(&self, name: &str) -> Result<Vec<f32>> {
        self.tensors
            .get(name)
            .map(|(_, v)| v.clone())
            .ok_or_else(|| ModelError::IncompatibleWeights {
                path: self.path.clone(),
                problem: format!("no tensor named {name}"),
            })
    }
}
