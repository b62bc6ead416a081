//! Post-training int8 quantization: the activation ranges of the inference network calibrated
//! on images ([`Calibration`]), and the parameters TFLite's int8 quantization specification
//! asks for, computed from them and from the weights:
//!
//! - activations: int8 per tensor, `real = scale * (q - zero_point)`, the range widened to
//!   include 0 (so that 0, the padding value, is exact) and spread over `[-128, 127]`;
//! - weights: int8 symmetric per output channel, zero point 0, values in `[-127, 127]`;
//! - biases: int32, zero point 0, scale `input_scale * weight_scale[c]` (what the kernels
//!   accumulate into);
//! - `LOGISTIC`'s output: scale 1/256, zero point -128; `RESHAPE` and `CONCATENATION` keep
//!   their input's parameters (the box-code heads share one range, the class-logit heads
//!   another).

use burn::nn::conv::Conv2d;
use burn::tensor::backend::Backend;
use burn::tensor::{ElementConversion, Tensor};

use crate::error::{ModelError, Result};
use crate::export::network::FEATURE_MAP_UNITS;
use crate::fake_quant::ActivationRange;
use crate::layers::apply_conv;
use crate::ops::SsdBackend;
use crate::ssd::Ssd;

/// The smallest and largest value a tensor took.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Range {
    /// Smallest value seen.
    pub min: f32,
    /// Largest value seen.
    pub max: f32,
}

impl Range {
    /// Nothing seen yet.
    const EMPTY: Range = Range {
        min: f32::INFINITY,
        max: f32::NEG_INFINITY,
    };

    fn union(self, other: Range) -> Range {
        Range {
            min: self.min.min(other.min),
            max: self.max.max(other.max),
        }
    }

    fn of<B: SsdBackend, const D: usize>(t: &Tensor<B, D>) -> Range {
        Range {
            min: t.clone().min().into_scalar().elem(),
            max: t.clone().max().into_scalar().elem(),
        }
    }
}

/// Activation ranges of the inference network over the images it was shown: the output of
/// each layer of the trunk (after ReLU6, so the clamp is already in the range), of the
/// box-code heads together and of the class-logit heads together.
#[derive(Debug, Clone, PartialEq)]
pub struct Calibration {
    trunk: Vec<Range>,
    box_codes: Range,
    class_logits: Range,
    images: usize,
}

impl Default for Calibration {
    fn default() -> Self {
        Self {
            trunk: Vec::new(),
            box_codes: Range::EMPTY,
            class_logits: Range::EMPTY,
            images: 0,
        }
    }
}

impl Calibration {
    /// Widens the ranges by what `model` computes for `images` (`[batch, 3, height, width]`,
    /// preprocessed as for inference); a value that is not finite is an error.
    pub fn observe<B: SsdBackend>(&mut self, model: &Ssd<B>, images: Tensor<B, 4>) -> Result<()> {
        let batch = images.dims()[0];
        let (trunk, boxes, classes) = B::on_compute_thread(|| {
            let units = model.conv_units();
            let mut trunk = Vec::with_capacity(units.len());
            let mut maps = Vec::new();
            let mut x = images;
            for (i, unit) in units.iter().enumerate() {
                x = unit.forward(x);
                trunk.push(Range::of(&x));
                if FEATURE_MAP_UNITS.contains(&i) {
                    maps.push(x.clone());
                }
            }
            let heads = |convs: &[Conv2d<B>]| {
                maps.iter()
                    .zip(convs)
                    .map(|(map, conv)| Range::of(&apply_conv(conv, map.clone())))
                    .fold(Range::EMPTY, Range::union)
            };
            (trunk, heads(&model.box_heads), heads(&model.class_heads))
        });
        let finite = |r: &&Range| r.min.is_finite() && r.max.is_finite();
        let bad = trunk.iter().chain([&boxes, &classes]).find(|r| !finite(r));
        if let Some(bad) = bad.copied() {
            return Err(ModelError::Quantization(format!(
                "the network computes a value that is not finite ({}..{}) on a calibration image",
                bad.min, bad.max
            )));
        }
        if self.trunk.is_empty() {
            self.trunk = vec![Range::EMPTY; trunk.len()];
        }
        for (seen, new) in self.trunk.iter_mut().zip(trunk) {
            *seen = seen.union(new);
        }
        self.box_codes = self.box_codes.union(boxes);
        self.class_logits = self.class_logits.union(classes);
        self.images += batch;
        Ok(())
    }

    /// The ranges quantization-aware training learned for `model`: each unit's output range,
    /// the box-code heads' together and the class-logit heads' together (their reshapes and
    /// concatenation share one range). `None` for a float network or one whose ranges were
    /// never trained.
    pub fn learned<B: Backend>(model: &Ssd<B>) -> Option<Calibration> {
        let heads = model.head_ranges.as_ref()?;
        let range = |r: &ActivationRange<B>| r.learned().map(|[min, max]| Range { min, max });
        let union = |ranges: &[ActivationRange<B>]| {
            ranges
                .iter()
                .map(range)
                .try_fold(Range::EMPTY, |all, r| Some(all.union(r?)))
        };
        let trunk = model
            .conv_units()
            .into_iter()
            .map(|u| u.quant.as_ref().and_then(range))
            .collect::<Option<Vec<_>>>()?;
        Some(Calibration {
            trunk,
            box_codes: union(&heads.boxes)?,
            class_logits: union(&heads.classes)?,
            images: 0,
        })
    }

    /// Number of images observed (0 for learned ranges).
    pub fn images(&self) -> usize {
        self.images
    }

    /// The int8 parameters of every activation; an error when there are no ranges (no
    /// image was observed).
    pub(crate) fn activations(&self) -> Result<Activations> {
        if self.trunk.is_empty() {
            return Err(ModelError::Quantization(
                "no calibration image was observed".into(),
            ));
        }
        Ok(Activations {
            trunk: self.trunk.iter().map(|&r| Affine::of_range(r)).collect(),
            box_codes: Affine::of_range(self.box_codes),
            class_logits: Affine::of_range(self.class_logits),
        })
    }
}

/// Int8 parameters of one tensor: `real = scale * (q - zero_point)`.
#[derive(Debug, Clone, Copy, PartialEq)]
pub(crate) struct Affine {
    pub scale: f32,
    pub zero_point: i32,
}

impl Affine {
    /// The network input in int8: `(2 / 255) p - 1` for a pixel `p` would need the zero point
    /// 127.5; 128 - 128 = 0 is the nearest integer (a uint8 pixel `p` is `p - 128` in int8),
    /// so the input is read as `(2 / 255) (p - 128)`, half a step (1/255) below the float
    /// model's input, as the API's quantized models (zero point 128) read it.
    pub const INPUT: Affine = Affine {
        scale: 2.0 / 255.0,
        zero_point: 0,
    };

    /// `LOGISTIC`'s output, fixed by the specification: `[0, 1)` in steps of 1/256.
    pub const LOGISTIC: Affine = Affine {
        scale: 1.0 / 256.0,
        zero_point: -128,
    };

    /// The parameters spreading `range`, widened to include 0, over `[-128, 127]`, with 0
    /// exactly representable (the zero point is an integer, rounded as TFLite's converter
    /// rounds it). A range of (almost) one value, which calibration can give a layer that
    /// outputs only zeros, is widened to `[0, 1]` to keep the rescale factors of the kernels
    /// bounded.
    pub fn of_range(range: Range) -> Affine {
        let (min, max) = (range.min.min(0.0), range.max.max(0.0));
        let (min, max) = if max - min < 1e-6 {
            (0.0, 1.0)
        } else {
            (min, max)
        };
        let scale = (max - min) / 255.0;
        let zero_point = (-128.0 - min / scale).round().clamp(-128.0, 127.0) as i32;
        Affine { scale, zero_point }
    }

    /// Rounds `x` to its int8 code.
    #[cfg(test)]
    fn quantize(self, x: f32) -> i8 {
        ((x / self.scale).round() + self.zero_point as f32).clamp(-128.0, 127.0) as i8
    }
}

/// The int8 parameters of the activations of the whole network.
#[derive(Debug, Clone)]
pub(crate) struct Activations {
    /// Each trunk layer's output.
    pub trunk: Vec<Affine>,
    /// The box-code heads' outputs, their reshapes and their concatenation.
    pub box_codes: Affine,
    /// The class-logit heads' outputs, their reshapes and their concatenation.
    pub class_logits: Affine,
}

/// A kernel quantized per channel: the codes (in the kernel's layout) and each channel's
/// scale.
pub(crate) struct ChannelQuantized {
    pub codes: Vec<i8>,
    pub scales: Vec<f32>,
}

/// Quantizes `kernel` symmetrically per channel into `[-127, 127]`; `channel_of(i)` is the
/// channel of element `i`. A channel of zeros gets scale 1 (any positive scale codes it).
pub(crate) fn quantize_per_channel(
    kernel: &[f32],
    channels: usize,
    channel_of: impl Fn(usize) -> usize,
) -> ChannelQuantized {
    let mut largest = vec![0.0f32; channels];
    for (i, w) in kernel.iter().enumerate() {
        let c = channel_of(i);
        largest[c] = largest[c].max(w.abs());
    }
    let scales: Vec<f32> = largest
        .iter()
        .map(|&m| if m > 0.0 { m / 127.0 } else { 1.0 })
        .collect();
    let codes = kernel
        .iter()
        .enumerate()
        .map(|(i, w)| (w / scales[channel_of(i)]).round().clamp(-127.0, 127.0) as i8)
        .collect();
    ChannelQuantized { codes, scales }
}

/// The int32 bias codes of a layer whose input has scale `input_scale` and whose weights have
/// the per-channel `weight_scales`: at the scales [`bias_scales`] gives.
pub(crate) fn quantize_bias(bias: &[f32], input_scale: f32, weight_scales: &[f32]) -> Vec<i32> {
    bias.iter()
        .zip(bias_scales(input_scale, weight_scales))
        .map(|(b, scale)| {
            (f64::from(*b) / f64::from(scale))
                .round()
                .clamp(f64::from(i32::MIN), f64::from(i32::MAX)) as i32
        })
        .collect()
}

/// The scales of a bias (as written in the file): `input_scale * weight_scale[c]`.
pub(crate) fn bias_scales(input_scale: f32, weight_scales: &[f32]) -> Vec<f32> {
    weight_scales.iter().map(|w| input_scale * w).collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn activation_ranges_include_zero_exactly() {
        let a = Affine::of_range(Range {
            min: -1.0,
            max: 3.0,
        });
        assert_eq!(a.scale, 4.0 / 255.0);
        // -1 is 63.75 steps below 0: the zero point -128 + 63.75, rounded
        assert_eq!(a.zero_point, -64);
        assert_eq!(a.quantize(0.0) as i32, a.zero_point);
        // a positive range (ReLU6) starts at 0, coded -128
        let relu = Affine::of_range(Range { min: 0.5, max: 6.0 });
        assert_eq!((relu.scale, relu.zero_point), (6.0 / 255.0, -128));
        assert_eq!(relu.quantize(6.0), 127);
        // a negative range ends at 0, coded 127
        let neg = Affine::of_range(Range {
            min: -2.0,
            max: -1.0,
        });
        assert_eq!(neg.zero_point, 127);
        // one value: a finite positive scale
        let flat = Affine::of_range(Range { min: 0.0, max: 0.0 });
        assert!(flat.scale > 0.0 && flat.scale.is_finite());
    }

    #[test]
    fn the_input_contract_maps_pixels_within_half_a_step() {
        for p in 0u8..=255 {
            let q = i32::from(p) - 128;
            let real = Affine::INPUT.scale * (q - Affine::INPUT.zero_point) as f32;
            let float_input = 2.0 / 255.0 * f32::from(p) - 1.0;
            assert!((real - float_input + 1.0 / 255.0).abs() < 1e-6, "pixel {p}");
        }
    }

    #[test]
    fn weights_are_symmetric_per_channel() {
        // two channels interleaved (channel = i % 2), as in a depthwise kernel
        let kernel = [0.5, -4.0, -1.0, 2.0, 0.25, 0.0];
        let q = quantize_per_channel(&kernel, 2, |i| i % 2);
        assert_eq!(q.scales, vec![1.0 / 127.0, 4.0 / 127.0]);
        assert_eq!(q.codes, vec![64, -127, -127, 64, 32, 0]);
        let zeros = quantize_per_channel(&[0.0; 3], 1, |_| 0);
        assert_eq!((zeros.codes, zeros.scales), (vec![0; 3], vec![1.0]));
    }

    #[test]
    fn bias_scale_is_input_scale_times_weight_scale() {
        let codes = quantize_bias(&[1.0, -0.5, 1e9], 0.5, &[0.01, 0.1, 1e-6]);
        assert_eq!(codes, vec![200, -10, i32::MAX]);
    }
}
