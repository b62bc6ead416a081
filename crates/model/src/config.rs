//! The model's configuration. Every default reproduces `ssd_mobilenet_v1_pets.config` of the TF
//! Object Detection API (except `num_classes`, which the pets config sets to 37 and which is
//! the only field without a meaningful default: it defaults to 37 as well).

use std::path::Path;

use serde::{Deserialize, Serialize};

use crate::error::{ModelError, Result};

/// Full configuration of an SSD-MobileNet-v1 detector.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct SsdConfig {
    /// Number of object classes, not counting the background class.
    pub num_classes: usize,
    /// Display names of the classes, in label-map id order (id 1 first). Empty: `class_<id>`.
    pub class_names: Vec<String>,
    /// Input height and width of the network (`fixed_shape_resizer`), in pixels.
    pub image_size: [usize; 2],
    /// Width multiplier of every layer (`depth_multiplier`).
    pub depth_multiplier: f32,
    /// No layer gets fewer channels than this (`min_depth`).
    pub min_depth: usize,
    /// BatchNorm settings shared by every normalised layer.
    pub batch_norm: BatchNormConfig,
    /// Stddev of the truncated normal initialiser of the MobileNet backbone
    /// (`mobilenet_v1_arg_scope`, 0.09).
    pub backbone_init_stddev: f32,
    /// Stddev of the truncated normal initialiser of the extra layers and box predictor
    /// (the config's `conv_hyperparams`, 0.03).
    pub init_stddev: f32,
    /// Anchor generator (`ssd_anchor_generator`).
    pub anchors: AnchorConfig,
    /// Box coder scales `[y, x, height, width]` (`faster_rcnn_box_coder`).
    pub box_coder_scales: [f32; 4],
    /// Matcher (`argmax_matcher`).
    pub matcher: MatcherConfig,
    /// Loss settings.
    pub loss: LossConfig,
    /// Post-processing (`batch_non_max_suppression`, sigmoid score converter).
    pub post_processing: PostProcessingConfig,
    /// Quantization-aware training (`graph_rewriter { quantization { ... } }`); `null`
    /// (default) trains a float network.
    pub quantization: Option<QuantizationConfig>,
}

/// Quantization-aware training as the API's `graph_rewriter.quantization` asks for it (TF1's
/// `contrib.quantize` training rewrite; the rules are in [`crate::fake_quant`]).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct QuantizationConfig {
    /// The fake quantization takes effect at the step numbered `delay`, counting from 1
    /// ([`active_at`](Self::active_at)); the activation ranges are learned from the first
    /// step.
    pub delay: u64,
    /// Bits of the weights (`weight_bits`): only 8.
    pub weight_bits: u32,
    /// Bits of the activations (`activation_bits`): only 8.
    pub activation_bits: u32,
    /// Ranges symmetric around 0 instead of a learned minimum and maximum (`symmetric`).
    pub symmetric: bool,
}

impl Default for QuantizationConfig {
    /// The proto's defaults: 500,000 steps of delay, 8 bits, asymmetric ranges.
    fn default() -> Self {
        Self {
            delay: 500_000,
            weight_bits: 8,
            activation_bits: 8,
            symmetric: false,
        }
    }
}

impl QuantizationConfig {
    /// Whether the fake quantization is in effect in the step that follows `steps_done`
    /// steps. TF1 increments its `fake_quantization_step` before comparing it with
    /// `quant_delay` (`CreateOrGetQuantizationStep` returns the `assign_add`), so the step
    /// numbered `delay`, counting from 1, is the first one quantized.
    pub fn active_at(&self, steps_done: u64) -> bool {
        steps_done + 1 >= self.delay
    }
}

/// BatchNorm hyper-parameters (`batch_norm` of `conv_hyperparams`).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct BatchNormConfig {
    /// Added to the variance before the square root.
    pub epsilon: f64,
    /// Moving-average decay of the running statistics.
    pub decay: f64,
}

/// `ssd_anchor_generator` settings.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct AnchorConfig {
    /// Number of feature maps (must be 6 for SSD-MobileNet-v1).
    pub num_layers: usize,
    /// Scale of the lowest layer's anchors.
    pub min_scale: f32,
    /// Scale of the highest layer's anchors.
    pub max_scale: f32,
    /// Aspect ratios (width / height) of every layer but the lowest.
    pub aspect_ratios: Vec<f32>,
    /// Aspect ratio of the extra anchor with scale `sqrt(s_i * s_(i+1))`; 0 disables it.
    pub interpolated_scale_aspect_ratio: f32,
    /// Base anchor height and width.
    pub base_anchor_size: [f32; 2],
    /// Use the three fixed boxes `(0.1, 1.0), (s0, 2.0), (s0, 0.5)` in the lowest layer.
    pub reduce_boxes_in_lowest_layer: bool,
}

/// `argmax_matcher` settings.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct MatcherConfig {
    /// IoU at or above which an anchor is matched.
    pub matched_threshold: f32,
    /// IoU below which an anchor is a negative.
    pub unmatched_threshold: f32,
    /// Anchors below `unmatched_threshold` are negatives (true) or ignored (false).
    pub negatives_lower_than_unmatched: bool,
    /// Every ground-truth box is matched to its best anchor, whatever the IoU.
    pub force_match_for_each_row: bool,
}

/// Which per-anchor loss the hard example miner ranks by.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum MinerLossType {
    /// Classification loss (the pets config).
    Classification,
    /// Localization loss.
    Localization,
    /// Weighted sum of both.
    Both,
}

/// `hard_example_miner` settings.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct HardExampleMinerConfig {
    /// At most this many anchors per image survive the NMS step.
    pub num_hard_examples: usize,
    /// IoU of the NMS over decoded boxes.
    pub iou_threshold: f32,
    /// Loss the anchors are ranked by.
    pub loss_type: MinerLossType,
    /// At most this many negatives per positive (0 disables the ratio).
    pub max_negatives_per_positive: usize,
    /// At least this many negatives per image.
    pub min_negatives_per_image: usize,
}

/// Loss settings (`loss` of the SSD config plus the L2 regulariser of `conv_hyperparams`).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct LossConfig {
    /// Weight of the classification loss.
    pub classification_weight: f32,
    /// Weight of the localization loss.
    pub localization_weight: f32,
    /// Hard example mining; `null` disables it.
    pub hard_example_miner: Option<HardExampleMinerConfig>,
    /// Divide both losses by the number of matched anchors (at least 1).
    pub normalize_loss_by_num_matches: bool,
    /// Also divide the localization loss by the box code size (4).
    pub normalize_loc_loss_by_codesize: bool,
    /// Huber delta of the smooth L1 localization loss.
    pub smooth_l1_delta: f32,
    /// L2 regulariser weight on every convolution kernel: `weight * sum(w^2) / 2`.
    pub l2_weight: f32,
}

/// `post_processing` settings.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct PostProcessingConfig {
    /// Detections must score strictly above this.
    pub score_threshold: f32,
    /// IoU above which NMS suppresses a box of the same class.
    pub iou_threshold: f32,
    /// At most this many detections per class.
    pub max_detections_per_class: usize,
    /// At most this many detections per image.
    pub max_total_detections: usize,
}

impl Default for SsdConfig {
    fn default() -> Self {
        Self {
            num_classes: 37,
            class_names: Vec::new(),
            image_size: [300, 300],
            depth_multiplier: 1.0,
            min_depth: 16,
            batch_norm: BatchNormConfig::default(),
            backbone_init_stddev: 0.09,
            init_stddev: 0.03,
            anchors: AnchorConfig::default(),
            box_coder_scales: [10.0, 10.0, 5.0, 5.0],
            matcher: MatcherConfig::default(),
            loss: LossConfig::default(),
            post_processing: PostProcessingConfig::default(),
            quantization: None,
        }
    }
}

impl Default for BatchNormConfig {
    fn default() -> Self {
        Self {
            epsilon: 0.001,
            decay: 0.9997,
        }
    }
}

impl Default for AnchorConfig {
    fn default() -> Self {
        Self {
            num_layers: 6,
            min_scale: 0.2,
            max_scale: 0.95,
            aspect_ratios: vec![1.0, 2.0, 0.5, 3.0, 0.3333],
            interpolated_scale_aspect_ratio: 1.0,
            base_anchor_size: [1.0, 1.0],
            reduce_boxes_in_lowest_layer: true,
        }
    }
}

impl Default for MatcherConfig {
    fn default() -> Self {
        Self {
            matched_threshold: 0.5,
            unmatched_threshold: 0.5,
            negatives_lower_than_unmatched: true,
            force_match_for_each_row: true,
        }
    }
}

impl Default for HardExampleMinerConfig {
    fn default() -> Self {
        Self {
            num_hard_examples: 3000,
            iou_threshold: 0.99,
            loss_type: MinerLossType::Classification,
            max_negatives_per_positive: 3,
            min_negatives_per_image: 0,
        }
    }
}

impl Default for LossConfig {
    fn default() -> Self {
        Self {
            classification_weight: 1.0,
            localization_weight: 1.0,
            hard_example_miner: Some(HardExampleMinerConfig::default()),
            normalize_loss_by_num_matches: true,
            normalize_loc_loss_by_codesize: false,
            smooth_l1_delta: 1.0,
            l2_weight: 0.00004,
        }
    }
}

impl Default for PostProcessingConfig {
    fn default() -> Self {
        Self {
            score_threshold: 1e-8,
            iou_threshold: 0.6,
            max_detections_per_class: 100,
            max_total_detections: 100,
        }
    }
}

/// The smallest input side the feature extractor accepts (the API's `check_min_image_dim(33)`).
pub const MIN_IMAGE_SIDE: usize = 33;

fn invalid(field: &'static str, problem: impl Into<String>) -> ModelError {
    ModelError::InvalidConfig {
        field,
        problem: problem.into(),
    }
}

fn check_fraction(field: &'static str, value: f32, allow_zero: bool) -> Result<()> {
    let ok = value.is_finite() && value <= 1.0 && (value > 0.0 || (allow_zero && value == 0.0));
    if ok {
        Ok(())
    } else {
        Err(invalid(field, format!("must be in (0, 1], got {value}")))
    }
}

impl SsdConfig {
    /// Reads a config from a JSON file; unknown fields are rejected by name.
    pub fn load(path: &Path) -> Result<Self> {
        let text = std::fs::read_to_string(path).map_err(|source| ModelError::Io {
            action: "reading",
            path: path.to_path_buf(),
            source,
        })?;
        let config: Self = serde_json::from_str(&text).map_err(|e| ModelError::Decode {
            path: path.to_path_buf(),
            problem: e.to_string(),
        })?;
        config.validate()?;
        Ok(config)
    }

    /// Checks every value; the error names the first bad field.
    pub fn validate(&self) -> Result<()> {
        if self.num_classes == 0 {
            return Err(invalid("num_classes", "must be at least 1"));
        }
        if !self.class_names.is_empty() && self.class_names.len() != self.num_classes {
            return Err(invalid(
                "class_names",
                format!(
                    "has {} names but num_classes is {}",
                    self.class_names.len(),
                    self.num_classes
                ),
            ));
        }
        if self.image_size.iter().any(|&s| s < MIN_IMAGE_SIDE) {
            return Err(invalid(
                "image_size",
                format!(
                    "each side must be at least {MIN_IMAGE_SIDE}, got {:?}",
                    self.image_size
                ),
            ));
        }
        if !(self.depth_multiplier.is_finite() && self.depth_multiplier > 0.0) {
            return Err(invalid(
                "depth_multiplier",
                format!("must be positive, got {}", self.depth_multiplier),
            ));
        }
        if self.min_depth == 0 {
            return Err(invalid("min_depth", "must be at least 1"));
        }
        let bn = &self.batch_norm;
        if !(bn.epsilon.is_finite() && bn.epsilon > 0.0) {
            return Err(invalid("batch_norm.epsilon", "must be positive"));
        }
        if !(0.0..1.0).contains(&bn.decay) {
            return Err(invalid("batch_norm.decay", "must be in [0, 1)"));
        }
        for (field, v) in [
            ("backbone_init_stddev", self.backbone_init_stddev),
            ("init_stddev", self.init_stddev),
        ] {
            if !(v.is_finite() && v > 0.0) {
                return Err(invalid(field, format!("must be positive, got {v}")));
            }
        }
        let a = &self.anchors;
        if a.num_layers != 6 {
            return Err(invalid(
                "anchors.num_layers",
                format!("SSD-MobileNet-v1 has 6 feature maps, got {}", a.num_layers),
            ));
        }
        check_fraction("anchors.min_scale", a.min_scale, false)?;
        check_fraction("anchors.max_scale", a.max_scale, false)?;
        if a.min_scale > a.max_scale {
            return Err(invalid("anchors.min_scale", "must not exceed max_scale"));
        }
        if a.aspect_ratios.is_empty()
            || a.aspect_ratios.iter().any(|r| !(r.is_finite() && *r > 0.0))
        {
            return Err(invalid(
                "anchors.aspect_ratios",
                "must be a non-empty list of positive numbers",
            ));
        }
        if !(a.interpolated_scale_aspect_ratio.is_finite()
            && a.interpolated_scale_aspect_ratio >= 0.0)
        {
            return Err(invalid(
                "anchors.interpolated_scale_aspect_ratio",
                "must be >= 0",
            ));
        }
        if a.base_anchor_size
            .iter()
            .any(|s| !(s.is_finite() && *s > 0.0))
        {
            return Err(invalid("anchors.base_anchor_size", "must be positive"));
        }
        if self
            .box_coder_scales
            .iter()
            .any(|s| !(s.is_finite() && *s > 0.0))
        {
            return Err(invalid("box_coder_scales", "must be positive"));
        }
        let m = &self.matcher;
        check_fraction("matcher.matched_threshold", m.matched_threshold, true)?;
        check_fraction("matcher.unmatched_threshold", m.unmatched_threshold, true)?;
        if m.unmatched_threshold > m.matched_threshold {
            return Err(invalid(
                "matcher.unmatched_threshold",
                "must not exceed matched_threshold",
            ));
        }
        let l = &self.loss;
        for (field, v) in [
            ("loss.classification_weight", l.classification_weight),
            ("loss.localization_weight", l.localization_weight),
            ("loss.l2_weight", l.l2_weight),
        ] {
            if !(v.is_finite() && v >= 0.0) {
                return Err(invalid(field, format!("must be >= 0, got {v}")));
            }
        }
        if !(l.smooth_l1_delta.is_finite() && l.smooth_l1_delta > 0.0) {
            return Err(invalid("loss.smooth_l1_delta", "must be positive"));
        }
        if let Some(miner) = &l.hard_example_miner {
            if miner.num_hard_examples == 0 {
                return Err(invalid(
                    "loss.hard_example_miner.num_hard_examples",
                    "must be at least 1",
                ));
            }
            check_fraction(
                "loss.hard_example_miner.iou_threshold",
                miner.iou_threshold,
                true,
            )?;
        }
        let p = &self.post_processing;
        if !p.score_threshold.is_finite() {
            return Err(invalid("post_processing.score_threshold", "must be finite"));
        }
        check_fraction("post_processing.iou_threshold", p.iou_threshold, true)?;
        if p.max_detections_per_class == 0 || p.max_total_detections == 0 {
            return Err(invalid(
                "post_processing.max_total_detections",
                "detection limits must be at least 1",
            ));
        }
        if let Some(q) = &self.quantization {
            for (field, bits) in [
                ("quantization.weight_bits", q.weight_bits),
                ("quantization.activation_bits", q.activation_bits),
            ] {
                if bits != 8 {
                    return Err(invalid(
                        field,
                        format!("only 8-bit quantization is supported, got {bits}"),
                    ));
                }
            }
        }
        Ok(())
    }

    /// The channel count the API gives a layer of nominal depth `d`:
    /// `max(int(d * depth_multiplier), min_depth)`.
    pub fn depth(&self, d: usize) -> usize {
        ((d as f32 * self.depth_multiplier) as usize).max(self.min_depth)
    }

    /// The display name of the class with label-map id `id` (1-based).
    pub fn class_name(&self, id: usize) -> String {
        id.checked_sub(1)
            .and_then(|i| self.class_names.get(i))
            .cloned()
            .unwrap_or_else(|| format!("class_{id}"))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// TF1's counter reads 1 in the first step: with `quant_delay` 3 the third step is the
    /// first quantized; with 0 or 1, the first.
    #[test]
    fn the_quantization_delay_counts_steps_from_one() {
        let at = |delay| {
            let q = QuantizationConfig {
                delay,
                ..QuantizationConfig::default()
            };
            (0..4).map(|done| q.active_at(done)).collect::<Vec<_>>()
        };
        assert_eq!(at(3), [false, false, true, true]);
        assert_eq!(at(1), [true; 4]);
        assert_eq!(at(0), [true; 4]);
    }

    #[test]
    fn defaults_are_valid_and_round_trip_through_json() {
        let c = SsdConfig::default();
        c.validate().unwrap();
        let json = serde_json::to_string(&c).unwrap();
        let back: SsdConfig = serde_json::from_str(&json).unwrap();
        assert_eq!(c, back);
    }

    #[test]
    fn bad_values_name_the_field() {
        let bad = [
            SsdConfig {
                num_classes: 0,
                ..Default::default()
            },
            SsdConfig {
                depth_multiplier: 0.0,
                ..Default::default()
            },
            SsdConfig {
                image_size: [32, 300],
                ..Default::default()
            },
            SsdConfig {
                class_names: vec!["cat".into()],
                ..Default::default()
            },
        ];
        let fields = [
            "num_classes",
            "depth_multiplier",
            "image_size",
            "class_names",
        ];
        for (config, field) in bad.iter().zip(fields) {
            let err = config.validate().unwrap_err().to_string();
            assert!(err.contains(field), "{err}");
        }
    }

    #[test]
    fn unknown_fields_are_rejected() {
        let err = serde_json::from_str::<SsdConfig>(r#"{"num_clases": 2}"#).unwrap_err();
        assert!(err.to_string().contains("num_clases"), "{err}");
    }

    #[test]
    fn depth_rule_matches_the_api() {
        let c = SsdConfig {
            depth_multiplier: 0.25,
            ..Default::default()
        };
        assert_eq!(c.depth(32), 16); // int(8) clamped up to min_depth
        assert_eq!(c.depth(1024), 256);
        assert_eq!(
            SsdConfig {
                depth_multiplier: 0.75,
                ..Default::default()
            }
            .depth(100),
            75
        );
    }
}
