//! Restoring a network's tensors by the TF Object Detection API's variable names from any
//! [`TensorSource`] (a TensorFlow checkpoint, a safetensors file, weights in memory), with the
//! API's fine-tuning rules ([`RestoreScope`]) and a report of what was restored and skipped.

mod sources;

use std::collections::{BTreeMap, HashSet};
use std::path::Path;

use burn::tensor::backend::Backend;
use serde::{Deserialize, Serialize};

use crate::config::SsdConfig;
use crate::error::{ModelError, Result};
use crate::ssd::Ssd;
use crate::tf::names::{BACKBONE, FEATURE_EXTRACTOR, tensor_shapes, update_tensors};
pub use sources::{MemorySource, SafetensorsSource, TfCheckpointSource};

/// Tensors by name, in this crate's layout (module docs of [`crate::tf::names`]).
pub trait TensorSource {
    /// The file the tensors come from, for messages.
    fn path(&self) -> &Path;
    /// Every tensor name the source holds.
    fn names(&self) -> Vec<String>;
    /// A tensor's shape in this crate's layout, `None` if absent.
    fn shape(&self, name: &str) -> Option<Vec<usize>>;
    /// A tensor's values in this crate's layout.
    fn values(&self, name: &str) -> Result<Vec<f32>>;
    /// The name the source stores `name` under, for messages.
    fn stored_name(&self, name: &str) -> String {
        name.to_string()
    }
}

/// Which variables a fine-tune restores: the API's `fine_tune_checkpoint_type` and
/// `load_all_detection_checkpoint_vars` (`SSDMetaArch.restore_map`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum RestoreScope {
    /// Every variable whose name and shape match (`detection` with
    /// `load_all_detection_checkpoint_vars: true`): a class predictor made for another number
    /// of classes is skipped.
    #[default]
    All,
    /// The feature extractor, backbone and extra layers (`detection`).
    FeatureExtractor,
    /// The MobileNet-v1 backbone from an ImageNet classification checkpoint
    /// (`classification`): `FeatureExtractor/MobilenetV1/X` is read from `MobilenetV1/X`
    /// (TF-slim's names), or from the detection name where the source has it.
    Classification,
}

/// What a restore did.
#[derive(Debug, Default, Clone, PartialEq)]
pub struct RestoreReport {
    /// The network's tensors that were restored.
    pub restored: Vec<String>,
    /// Source tensors not restored, grouped by the reason.
    pub skipped: BTreeMap<String, Vec<String>>,
    /// The network's tensors in scope that the source lacks (they keep their initial values).
    pub missing: Vec<String>,
}

impl RestoreReport {
    /// A few lines for the user: counts, each reason with up to 8 names, what is missing.
    pub fn summary(&self, source: &Path) -> Vec<String> {
        let list = |names: &[String]| {
            let shown: Vec<&str> = names.iter().take(8).map(String::as_str).collect();
            let more = names.len().saturating_sub(shown.len());
            let tail = if more > 0 {
                format!(" and {more} more")
            } else {
                String::new()
            };
            format!("{}{tail}", shown.join(", "))
        };
        let mut lines = vec![format!(
            "restored {} tensors from {}",
            self.restored.len(),
            source.display()
        )];
        for (reason, names) in &self.skipped {
            lines.push(format!(
                "  skipped {} ({reason}): {}",
                names.len(),
                list(names)
            ));
        }
        if !self.missing.is_empty() {
            lines.push(format!(
                "  not in the checkpoint, left as initialised: {} ({})",
                self.missing.len(),
                list(&self.missing)
            ));
        }
        lines
    }
}

const SHAPE_DIFFERS: &str = "shape differs from this model's";

impl RestoreScope {
    /// The scope as written in a config.
    pub fn name(self) -> &'static str {
        match self {
            Self::All => "all",
            Self::FeatureExtractor => "feature_extractor",
            Self::Classification => "classification",
        }
    }
}

/// Whether a backbone name belongs to an extra feature layer (`Conv2d_13_pointwise_1_...`).
fn is_extra_layer(name: &str) -> bool {
    name.starts_with(&format!("{BACKBONE}/Conv2d_13_pointwise_"))
}

/// The source names a model tensor may be read from under `scope` (empty: out of scope).
fn candidates(name: &str, scope: RestoreScope) -> Vec<String> {
    match scope {
        RestoreScope::All => vec![name.to_string()],
        RestoreScope::FeatureExtractor if name.starts_with(FEATURE_EXTRACTOR) => {
            vec![name.to_string()]
        }
        RestoreScope::Classification if name.starts_with(BACKBONE) && !is_extra_layer(name) => {
            let slim = name
                .trim_start_matches(FEATURE_EXTRACTOR)
                .trim_start_matches('/');
            vec![slim.to_string(), name.to_string()]
        }
        _ => Vec::new(),
    }
}

/// Why a source tensor that no model tensor took is not restored.
fn unused_reason(name: &str) -> &'static str {
    let slot = ["/RMSProp", "/RMSProp_1", "/Momentum", "/Adam", "/Adam_1"];
    if slot.iter().any(|s| name.ends_with(s)) {
        "optimizer slots: not restored when fine-tuning"
    } else if name.ends_with("/ExponentialMovingAverage") {
        "moving-average shadows: not restored when fine-tuning"
    } else if name == "global_step" {
        "step counter: training starts at step 0"
    } else {
        NOT_IN_NETWORK
    }
}

const NOT_IN_NETWORK: &str = "not part of this network";

/// Restores `model`'s tensors from `source` under `scope`. An error when nothing at all, or
/// nothing of the feature extractor, could be restored (a checkpoint of another network).
pub fn restore<B: Backend>(
    mut model: Ssd<B>,
    config: &SsdConfig,
    source: &dyn TensorSource,
    scope: RestoreScope,
) -> Result<(Ssd<B>, RestoreReport)> {
    // model names looked up (for what is missing), source names read (for what is unused)
    let mut taken = HashSet::new();
    let mut used = HashSet::new();
    let mut skipped: Vec<(String, String)> = Vec::new();
    let mut restored = Vec::new();
    let mut failure = None;
    update_tensors(&mut model, config, |name, shape, _| {
        if failure.is_some() {
            return None;
        }
        let found = candidates(name, scope)
            .into_iter()
            .find(|n| source.shape(n).is_some())?;
        let theirs = source.shape(&found).expect("found above");
        used.insert(source.stored_name(&found));
        taken.insert(found.clone());
        if theirs != shape {
            let what = format!(
                "{} {theirs:?} here, {shape:?} in this model",
                source.stored_name(&found)
            );
            skipped.push((SHAPE_DIFFERS.to_string(), what));
            return None;
        }
        match source
            .values(&found)
            .and_then(|v| finite(v, source, &found))
        {
            Ok(v) => {
                restored.push(name.to_string());
                Some(v)
            }
            Err(e) => {
                failure = Some(e);
                None
            }
        }
    });
    if let Some(e) = failure {
        return Err(e);
    }
    let model_names: Vec<String> = tensor_shapes(&model, config)
        .into_iter()
        .map(|(n, _)| n)
        .collect();
    let missing = model_names
        .iter()
        .filter(|n| {
            let c = candidates(n, scope);
            !c.is_empty() && !c.iter().any(|c| taken.contains(c))
        })
        .cloned()
        .collect();
    for name in source.names().into_iter().filter(|n| !used.contains(n)) {
        let known = unused_reason(&name);
        let reason = if known != NOT_IN_NETWORK {
            known.to_string()
        } else if source.shape(&name).is_none() {
            "not a floating-point tensor".to_string()
        } else if used.contains(&source.stored_name(&name)) {
            "trained values: their moving averages were read".to_string()
        } else if model_names.contains(&name) {
            format!("outside the restore scope `{}`", scope.name())
        } else {
            known.to_string()
        };
        skipped.push((reason, name));
    }
    let mut report = RestoreReport {
        restored,
        missing,
        ..RestoreReport::default()
    };
    for (reason, name) in skipped {
        report.skipped.entry(reason).or_default().push(name);
    }
    check_useful(&report, source)?;
    Ok((model, report))
}

/// `values` of the tensor `name` when every one is finite: a NaN or an infinity would
/// make the first step's loss NaN, far from its cause.
fn finite(values: Vec<f32>, source: &dyn TensorSource, name: &str) -> Result<Vec<f32>> {
    match values.iter().position(|v| !v.is_finite()) {
        None => Ok(values),
        Some(index) => Err(ModelError::NonFinite {
            path: source.path().to_path_buf(),
            tensor: source.stored_name(name),
            index,
            value: values[index],
        }),
    }
}

/// A restore that took no feature-extractor tensor is of another network.
fn check_useful(report: &RestoreReport, source: &dyn TensorSource) -> Result<()> {
    if report
        .restored
        .iter()
        .any(|n| n.starts_with(FEATURE_EXTRACTOR))
    {
        return Ok(());
    }
    let mut sample: Vec<String> = source.names().into_iter().take(5).collect();
    if sample.is_empty() {
        sample.push("no tensors at all".into());
    }
    let shape_note = report
        .skipped
        .get(SHAPE_DIFFERS)
        .map(|v| {
            format!(
                "; {} tensors have other shapes (another depth multiplier?)",
                v.len()
            )
        })
        .unwrap_or_default();
    Err(ModelError::IncompatibleWeights {
        path: source.path().to_path_buf(),
        problem: format!(
            "it restores no SSD-MobileNet-v1 feature extractor tensor (its names begin: {}){shape_note}",
            sample.join(", ")
        ),
    })
}

/// Restores every tensor of the network from `source`: an error naming the first tensor
/// that is missing or has another shape (loading a whole model, not fine-tuning).
pub fn restore_exact<B: Backend>(
    model: Ssd<B>,
    config: &SsdConfig,
    source: &dyn TensorSource,
) -> Result<Ssd<B>> {
    let shapes = tensor_shapes(&model, config);
    for (name, shape) in &shapes {
        let problem = match source.shape(name) {
            None => format!("no tensor named {name}"),
            Some(s) if s != *shape => format!("{name} has shape {s:?}, this model needs {shape:?}"),
            Some(_) => continue,
        };
        return Err(ModelError::IncompatibleWeights {
            path: source.path().to_path_buf(),
            problem,
        });
    }
    restore(model, config, source, RestoreScope::All).map(|(m, _)| m)
}
