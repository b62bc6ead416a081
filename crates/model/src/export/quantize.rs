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
    /// Ranges learned in quantization-aware training, whose grid the file keeps.
    learned: bool,
}

impl Default for Calibration {
    fn default() -> Self {
        Self {
            trunk: Vec::new(),
            box_codes: Range::EMPTY,
            class_logits: Range::EMPTY,
            images: 0,
            learned: false,
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
    /// the box-code heads' and the class-logit heads' (one each, as their reshapes and
    /// concatenation share one range). `None` for a float network or one whose ranges were
    /// never trained.
    pub fn learned<B: Backend>(model: &Ssd<B>) -> Option<Calibration> {
        let heads = model.head_ranges.as_ref()?;
        let range = |r: &ActivationRange<B>| r.learned().map(|[min, max]| Range { min, max });
        let trunk = model
            .conv_units()
            .into_iter()
            .map(|u| u.quant.as_ref().and_then(range))
            .collect::<Option<Vec<_>>>()?;
        Some(Calibration {
            trunk,
            box_codes: range(&heads.boxes)?,
            class_logits: range(&heads.classes)?,
            images: 0,
            learned: true,
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
        let affine = match self.learned {
            true => Affine::of_training_range,
            false => Affine::of_range,
        };
        Ok(Activations {
            trunk: self.trunk.iter().map(|&r| affine(r)).collect(),
            box_codes: affine(self.box_codes),
            class_logits: affine(self.class_logits),
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

    /// The parameters spreading a calibrated `range`, widened to include 0, over
    /// `[-128, 127]`, with 0 exactly representable: the zero point rounded in int8, half away
    /// from zero, as TFLite's converter rounds it. A range of (almost) one value, which
    /// calibration can give a layer that outputs only zeros, is widened to `[0, 1]` to keep
    /// the rescale factors of the kernels bounded.
    pub fn of_range(range: Range) -> Affine {
        Self::spread(range, |steps_below_zero| (steps_below_zero - 128.0).round())
    }

    /// The parameters of the grid quantization-aware training used for a learned `range`:
    /// `FakeQuantWithMinMaxVars` nudges the zero point in `[0, 255]` (a zero point of 2.5
    /// becomes 3, 3 - 128 = -125 in int8, where [`of_range`](Self::of_range) gives -126).
    pub fn of_training_range(range: Range) -> Affine {
        Self::spread(range, |steps_below_zero| steps_below_zero.round() - 128.0)
    }

    /// `range` over 255 steps, the zero point from the steps between its minimum and 0.
    fn spread(range: Range, zero_point: impl Fn(f32) -> f32) -> Affine {
        let (min, max) = (range.min.min(0.0), range.max.max(0.0));
        let (min, max) = if max - min < 1e-6 {
            (0.0, 1.0)
        } else {
            (min, max)
        };
        let scale = (max - min) / 255.0;
        let zero_point = zero_point(-min / scale).clamp(-128.0, 127.0) as i32;
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

/// A convolution's kernel quantized per channel (the codes, in the kernel's layout, and each
/// channel's scale) and its bias in int32 at the input's scale times each weight scale.
pub(crate) struct ChannelQuantized {
    pub codes: Vec<i8>,
    pub scales: Vec<f32>,
    pub bias: Vec<i32>,
}

/// Quantizes `kernel` symmetrically per channel into `[-127, 127]` (`channel_of(i)` is the
/// channel of element `i`; a channel of zeros gets scale 1) and `bias` for an input of scale
/// `input_scale`. A bias that would take half the int32 range or more widens its channel's
/// weight scale until it takes half, as TFLite's converter does (`AdjustWeightsForBiasScale`):
/// coarser weights rather than a clamped bias, which would shift every output of the channel.
pub(crate) fn quantize_per_channel(
    kernel: &[f32],
    channel_of: impl Fn(usize) -> usize,
    bias: &[f32],
    input_scale: f32,
) -> ChannelQuantized {
    let mut largest = vec![0.0f32; bias.len()];
    for (i, w) in kernel.iter().enumerate() {
        let c = channel_of(i);
        largest[c] = largest[c].max(w.abs());
    }
    let half_of_int32 = 0.5 * f64::from(i32::MAX);
    let scales: Vec<f32> = largest
        .iter()
        .zip(bias)
        .map(|(&m, &b)| {
            let scale = if m > 0.0 { m / 127.0 } else { 1.0 };
            let bias_codes = f64::from(b.abs()) / f64::from(input_scale * scale);
            match bias_codes >= half_of_int32 {
                true => (f64::from(b.abs()) / (half_of_int32 * f64::from(input_scale))) as f32,
                false => scale,
            }
        })
        .collect();
    let codes = kernel
        .iter()
        .enumerate()
        .map(|(i, w)| (w / scales[channel_of(i)]).round().clamp(-127.0, 127.0) as i8)
        .collect();
    let bias = quantize_bias(bias, input_scale, &scales);
    ChannelQuantized {
        codes,
        scales,
        bias,
    }
}

/// The int32 bias codes of a layer whose input has scale `input_scale` and whose weights have
/// the per-channel `weight_scales`: at the scales [`bias_scales`] gives.
fn quantize_bias(bias: &[f32], input_scale: f32, weight_scales: &[f32]) -> Vec<i32> {
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

    /// A learned range whose zero point falls at 2.5 steps: the file's largest code is the
    /// largest value training's fake quantization gives (TF's nudge, zero point 3 of 255).
    #[test]
    fn learned_ranges_keep_the_training_grid() {
        use crate::fake_quant::{ActivationRange, FakeQuant};
        use burn::backend::Flex;
        use burn::tensor::{Tensor, TensorData};
        let range = Range {
            min: -1.25,
            max: 126.25,
        };
        let rule = FakeQuant {
            symmetric: false,
            active: true,
        };
        let device = Default::default();
        let learned = ActivationRange::<Flex>::new(rule, &device);
        let batch =
            Tensor::<Flex, 1>::from_data(TensorData::new(vec![-1.25, 126.25], [2]), &device);
        let out = learned.quantize(batch).into_data().to_vec::<f32>().unwrap();
        let trained = Affine::of_training_range(range);
        assert_eq!((trained.scale, trained.zero_point), (0.5, -125));
        let largest = |a: Affine| a.scale * (127 - a.zero_point) as f32;
        // within float rounding of the debiased moving range, far from the next code (0.5)
        assert!((out[1] - largest(trained)).abs() < 1e-3, "{}", out[1]);
        // calibrated ranges round as the converter does, one code lower here: off the grid
        let calibrated = Affine::of_range(range);
        assert_eq!(calibrated.zero_point, -126);
        assert!((out[1] - largest(calibrated)).abs() > 0.4);
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
        let q = quantize_per_channel(&kernel, |i| i % 2, &[1.0, -0.5], 0.5);
        assert_eq!(q.scales, vec![1.0 / 127.0, 4.0 / 127.0]);
        assert_eq!(q.codes, vec![64, -127, -127, 64, 32, 0]);
        // the bias at input scale times weight scale: 1 / (0.5 / 127), -0.5 / (0.5 * 4 / 127)
        assert_eq!(q.bias, vec![254, -32]);
        let zeros = quantize_per_channel(&[0.0; 3], |_| 0, &[0.0], 1.0);
        assert_eq!((zeros.codes, zeros.scales), (vec![0; 3], vec![1.0]));
    }

    /// A bias of 1e9 at input scale 0.5 and weight scale 1/127 would need 2.5e11 codes: the
    /// weight scale widens to 2 * 1e9 / (0.5 * (2^31 - 1)) and the bias takes half the int32
    /// range (TFLite's rule); the other channel keeps its scale.
    #[test]
    fn a_bias_beyond_int32_widens_its_weight_scale() {
        let q = quantize_per_channel(&[1.0, 1.0], |i| i, &[1e9, 1.0], 0.5);
        let widened = (2e9 / (0.5 * f64::from(i32::MAX))) as f32;
        assert_eq!(q.scales, vec![widened, 1.0 / 127.0]);
        assert_eq!(q.codes, vec![1, 127]);
        let half = f64::from(i32::MAX) / 2.0;
        assert!((f64::from(q.bias[0]) - half).abs() <= 1.0, "{}", q.bias[0]);
        assert_eq!(q.bias[1], 254);
        let real = f64::from(q.bias[0]) * f64::from(0.5 * widened);
        assert!((real - 1e9).abs() <= 1e-6 * 1e9, "{real}");
    }
}
