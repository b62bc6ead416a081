//! Quantization-aware training as the API's `graph_rewriter { quantization { ... } }` runs it:
//! TF1's `contrib.quantize` training rewrite (`experimental_create_training_graph` with
//! `quant_delay`), read from its sources (`fold_batch_norms.py`, `quantize.py`,
//! `quant_ops.py`):
//!
//! - **BatchNorm folded into the weights** (`_FoldFusedBatchNorms`, never frozen: the API
//!   passes no `freeze_bn_delay`): the convolution runs with `w * gamma / sigma_mv`, where
//!   `sigma_mv = sqrt(moving_variance + epsilon)`, and its output is scaled by
//!   `sigma_mv / sigma_b` and shifted by `beta - mu_b * gamma / sigma_b`, with `mu_b` and
//!   `sigma_b` the batch's mean and (biased) standard deviation of the float convolution's
//!   output. The value is BatchNorm's with batch statistics; the weights that are quantized are
//!   scaled by the slowly moving variance, not by each batch's.
//! - **Weights** (`LastValueQuantize`, `narrow_range`): per tensor, over the range of the
//!   folded weights of the step, widened to include 0, in `[1, 2^bits - 1]`.
//! - **Activations** (`MovingAvgQuantize`): after each unit's ReLU6 and after the bias of each
//!   predictor head (the layers without an activation; unlike TF1, the six heads of a kind
//!   share one range, the int8 file's grid: see [`HeadRanges`]); the range of each batch,
//!   widened to include 0, averaged with decay 0.999 by `assign_moving_average`, which debiases
//!   (`zero_debias`): after `t` updates the range is `biased / (1 - 0.999^t)`, so the first
//!   batch's range is taken as it is. Codes `[0, 2^bits - 1]`. The range includes the batch
//!   it quantizes (the fake quantization reads the assigned value).
//! - **`symmetric`**: a batch range `[m, M]` becomes `[min(m, M / r), max(M, m * r)]` with
//!   `r = -1` for the weights' narrow range and `r = -(2^bits - 2) / 2^bits` otherwise.
//! - **`delay`**: the ranges are learned from the first step; the quantization takes effect
//!   at the step numbered `delay`, counting from 1 (`QuantizationConfig::active_at`; before
//!   it, the layer's output passes as it is).
//! - **The fake quantization** (`FakeQuantWithMinMaxVars`): the range is nudged so that 0 is
//!   a code (`scale = (max - min) / (q_max - q_min)`, zero point `q_min - min / scale`
//!   rounded into `[q_min, q_max]`), values are clamped to the nudged range and rounded to
//!   the nearest code (`floor(x / scale + 0.5)`); the gradient passes unchanged inside the
//!   nudged range and is zero outside. The ranges take no gradient.

use burn::module::{Module, RunningState};
use burn::nn::conv::Conv2d;
use burn::tensor::backend::Backend;
use burn::tensor::{ElementConversion, Tensor};

use crate::config::QuantizationConfig;
use crate::layers::{ConvBnRelu6, set_running};
use crate::ops::{SsdBackend, conv_same, filled};

/// Decay of the activation ranges' moving averages (`ema_decay` of `contrib.quantize`).
const RANGE_DECAY: f32 = 0.999;

/// Bits of weights and activations: the only width the API supports.
const BITS: u32 = 8;

/// How a range is quantized: the settings of the run and whether the quantization has taken
/// effect yet (`QuantizationConfig::active_at`).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct FakeQuant {
    /// Ranges symmetric around 0.
    pub symmetric: bool,
    /// The quantization takes effect (the delay has passed).
    pub active: bool,
}

impl FakeQuant {
    /// The rule of `config`, not yet in effect.
    pub fn new(config: &QuantizationConfig) -> Self {
        Self {
            symmetric: config.symmetric,
            active: false,
        }
    }

    /// `weights` fake-quantized per tensor over their own range, narrow (`LastValueQuantize`),
    /// when the quantization is in effect; as they are before.
    pub(crate) fn weights<B: Backend, const D: usize>(
        &self,
        weights: Tensor<B, D>,
    ) -> Tensor<B, D> {
        if !self.active {
            return weights;
        }
        let range = batch_range(std::slice::from_ref(&weights), self.symmetric, true);
        fake_quantize(weights, range, true)
    }
}

/// The learned range of one activation tensor (`act_quant` / the head's BiasAdd quant in TF):
/// the moving averages of its batch ranges, kept before debiasing, and their update count.
#[derive(Module, Debug)]
pub struct ActivationRange<B: Backend> {
    /// `[min, max]` moving averages before debiasing (TF's `biased` slot), `[2]`.
    pub biased: RunningState<Tensor<B, 1>>,
    /// Batches averaged so far (TF's `local_step`), `[1]`.
    pub updates: RunningState<Tensor<B, 1>>,
    /// How the range quantizes.
    pub rule: FakeQuant,
}

impl<B: Backend> ActivationRange<B> {
    /// A range not learned yet. (TF starts its variables at `[0, 6]` after ReLU6 and
    /// `[-6, 6]` elsewhere, but the debiased average discards the start at the first update.)
    pub(crate) fn new(rule: FakeQuant, device: &B::Device) -> Self {
        Self {
            biased: RunningState::new(filled([2], 0.0, device)),
            updates: RunningState::new(filled([1], 0.0, device)),
            rule,
        }
    }

    /// The range `[min, max]` learned so far (read back from the device); `None` before the
    /// first training step.
    pub fn learned(&self) -> Option<[f32; 2]> {
        let updates: f32 = self.updates.value().into_scalar().elem();
        if updates < 0.5 {
            return None;
        }
        let biased = self.biased().into_data().convert::<f32>();
        let biased = biased.as_slice::<f32>().expect("converted to f32");
        let debias = 1.0 - RANGE_DECAY.powf(updates);
        Some([biased[0] / debias, biased[1] / debias])
    }

    /// The `[min, max]` moving averages before debiasing, as they stand after the last
    /// update on any thread.
    pub fn biased(&self) -> Tensor<B, 1> {
        self.biased.value()
    }

    /// Replaces the moving averages before debiasing (`[2]`), e.g. with their mean over
    /// replicas.
    pub fn set_biased(&self, biased: Tensor<B, 1>) {
        set_running(&self.biased, biased);
    }

    /// Moves the range towards `x`'s and fake-quantizes `x` over it when the quantization is
    /// in effect (`MovingAvgQuantize`); `x` as it is before.
    pub(crate) fn quantize<const D: usize>(&self, x: Tensor<B, D>) -> Tensor<B, D> {
        let mut quantized = self.quantize_together(vec![x]);
        quantized.pop().expect("one tensor in, one out")
    }

    /// [`quantize`](Self::quantize) of `xs` as one tensor (as their concatenation would be):
    /// one update of the range, by the batch range of them all, and every tensor quantized
    /// over the same range.
    pub(crate) fn quantize_together<const D: usize>(
        &self,
        xs: Vec<Tensor<B, D>>,
    ) -> Vec<Tensor<B, D>> {
        let device = xs[0].device();
        let batch = batch_range(&xs, self.rule.symmetric, false);
        let biased = self
            .biased
            .value()
            .to_device(&device)
            .mul_scalar(RANGE_DECAY)
            + batch.mul_scalar(1.0 - RANGE_DECAY);
        let updates = self.updates.value().to_device(&device).add_scalar(1.0);
        // 1 - decay^t, as exp(t ln decay) on the device (no read back)
        let debias = updates
            .clone()
            .mul_scalar(RANGE_DECAY.ln())
            .exp()
            .neg()
            .add_scalar(1.0);
        let range = biased.clone() / debias;
        set_running(&self.biased, biased.detach());
        set_running(&self.updates, updates.detach());
        if !self.rule.active {
            return xs;
        }
        xs.into_iter()
            .map(|x| fake_quantize(x, range.clone(), false))
            .collect()
    }
}

/// The learned output ranges of the predictor heads: one for the six box-code heads and one
/// for the six class-logit heads, as the int8 file needs them (TFLite's int8 `CONCATENATION`
/// takes inputs on its output's grid), so that the exported heads are on the grid they were
/// trained on. (TF1's rewrite gives each head a range of its own, which the converter must
/// then bring onto one.)
#[derive(Module, Debug)]
pub struct HeadRanges<B: Backend> {
    /// The box-code heads'.
    pub boxes: ActivationRange<B>,
    /// The class-logit heads'.
    pub classes: ActivationRange<B>,
}

/// The predictor heads' training outputs (`convs` on `maps`, one each) with fake-quantized
/// weights, their output range learned over all of them and fake-quantized (TF quantizes the
/// BiasAdd of a layer without activation).
pub(crate) fn quantized_heads<B: SsdBackend>(
    convs: &[Conv2d<B>],
    range: &ActivationRange<B>,
    maps: &[Tensor<B, 4>],
) -> Vec<Tensor<B, 4>> {
    let outputs = convs
        .iter()
        .zip(maps)
        .map(|(conv, x)| {
            let weight = range.rule.weights(conv.weight.val());
            let bias = conv.bias.as_ref().map(|b| b.val());
            conv_same(x.clone(), weight, bias, conv.stride[0], false)
        })
        .collect();
    range.quantize_together(outputs)
}

/// `[min, max]` over the tensors `xs` (no gradient), widened as `quant_ops` widens a batch
/// range: to include 0, or symmetric around it.
fn batch_range<B: Backend, const D: usize>(
    xs: &[Tensor<B, D>],
    symmetric: bool,
    narrow: bool,
) -> Tensor<B, 1> {
    let (low, high) = xs
        .iter()
        .map(|x| {
            let x = x.clone().detach();
            (x.clone().min(), x.max())
        })
        .reduce(|(l1, h1), (l2, h2)| (l1.min_pair(l2), h1.max_pair(h2)))
        .expect("at least one tensor");
    let (low, high) = if symmetric {
        let codes = (1u32 << BITS) as f32;
        let ratio = if narrow { -1.0 } else { -(codes - 2.0) / codes };
        (
            low.clone().min_pair(high.clone().div_scalar(ratio)),
            high.max_pair(low.mul_scalar(ratio)),
        )
    } else {
        (low.clamp_max(0.0), high.clamp_min(0.0))
    };
    Tensor::cat(vec![low, high], 0)
}

/// TF's `FakeQuantWithMinMaxVars` of `x` over `range` (`[min, max]`, no gradient) with the
/// straight-through gradient inside the nudged range; codes `[1, 255]` when `narrow`,
/// `[0, 255]` otherwise.
fn fake_quantize<B: Backend, const D: usize>(
    x: Tensor<B, D>,
    range: Tensor<B, 1>,
    narrow: bool,
) -> Tensor<B, D> {
    let q_min = if narrow { 1.0 } else { 0.0 };
    let q_max = ((1u32 << BITS) - 1) as f32;
    let range = range.detach();
    let min = range.clone().narrow(0, 0, 1);
    let max = range.narrow(0, 1, 1);
    let scale = (max - min.clone()).div_scalar(q_max - q_min);
    // the zero point is within [q_min, q_max], not negative: floor(z + 0.5) is TF's round
    let zero_point = (min / scale.clone())
        .neg()
        .add_scalar(q_min)
        .clamp(q_min, q_max)
        .add_scalar(0.5)
        .floor();
    let nudged_min = zero_point.clone().neg().add_scalar(q_min) * scale.clone();
    let nudged_max = zero_point.neg().add_scalar(q_max) * scale.clone();
    let dims = x.dims();
    let spread = |t: Tensor<B, 1>| t.unsqueeze::<D>().expand(dims);
    let (nudged_min, nudged_max) = (spread(nudged_min), spread(nudged_max));
    let inverse_scale = spread(scale.clone().recip());
    let scale = spread(scale);
    let values = x.clone().detach();
    let below = values.clone().lower(nudged_min.clone());
    let above = values.clone().greater(nudged_max.clone());
    let clamped = values
        .clone()
        .mask_where(below.clone(), nudged_min.clone())
        .mask_where(above.clone(), nudged_max);
    let codes = ((clamped - nudged_min.clone()) * inverse_scale)
        .add_scalar(0.5)
        .floor();
    let quantized = codes * scale + nudged_min;
    let inside = below.bool_or(above).bool_not().float();
    quantized + (x - values) * inside
}

/// A unit's training forward pass with its BatchNorm folded into the fake-quantized weights
/// and its output range learned and fake-quantized, as the module docs say.
pub(crate) fn folded_unit<B: SsdBackend>(
    unit: &ConvBnRelu6<B>,
    range: &ActivationRange<B>,
    x: Tensor<B, 4>,
) -> Tensor<B, 4> {
    let (conv, bn) = (&unit.conv, &unit.bn);
    let (stride, depthwise) = (conv.stride[0], conv.groups > 1);
    let weight = conv.weight.val();
    // the batch statistics come from the float convolution, whose BatchNorm the rewrite keeps
    let float_out = conv_same(x.clone(), weight.clone(), None, stride, depthwise);
    let [batch, channels, h, w] = float_out.dims();
    let (mean, variance) = channel_moments(float_out);
    let moving_variance = bn.moving_stats().1.to_device(&mean.device()).detach();
    bn.update_moving_stats(mean.clone(), variance.clone(), batch * h * w);
    let epsilon = bn.epsilon();
    let sigma_moving = moving_variance.add_scalar(epsilon).sqrt();
    let sigma_batch = variance.add_scalar(epsilon).sqrt();
    let gamma = bn.gamma.val();
    let folded = weight * (gamma.clone() / sigma_moving.clone()).reshape([channels, 1, 1, 1]);
    let out = conv_same(x, range.rule.weights(folded), None, stride, depthwise);
    let correction = (sigma_moving / sigma_batch.clone()).reshape([1, channels, 1, 1]);
    let shift = (bn.beta.val() - mean * gamma / sigma_batch).reshape([1, channels, 1, 1]);
    range.quantize((out * correction + shift).clamp(0.0, 6.0))
}

/// Per-channel mean and biased variance of `[batch, channels, h, w]`, with their gradients.
fn channel_moments<B: Backend>(x: Tensor<B, 4>) -> (Tensor<B, 1>, Tensor<B, 1>) {
    let channels = x.dims()[1];
    let mean = x.clone().mean_dim(0).mean_dim(2).mean_dim(3);
    let centred = x - mean.clone();
    let variance = (centred.clone() * centred)
        .mean_dim(0)
        .mean_dim(2)
        .mean_dim(3);
    (mean.reshape([channels]), variance.reshape([channels]))
}

#[cfg(test)]
mod tests {
    use super::*;
    use burn::backend::{Autodiff, Flex};
    use burn::tensor::TensorData;

    type A = Autodiff<Flex>;

    fn values<const D: usize>(t: Tensor<A, D>) -> Vec<f32> {
        t.into_data().to_vec::<f32>().expect("f32")
    }

    /// `FakeQuantWithMinMaxVars` worked out from its definition: range [-0.1, 1.0] over
    /// [0, 255] has scale 1.1 / 255; the zero point 0.1 / scale = 23.18 rounds to 23, so the
    /// nudged range is [-23 s, 232 s]; values snap to multiples of s, outside values clamp.
    #[test]
    fn fake_quantize_nudges_rounds_and_clamps() {
        let device = Default::default();
        let s = 1.1f32 / 255.0;
        let x = Tensor::<A, 1>::from_data(
            TensorData::new(
                vec![-0.5f32, -0.1, 0.0, 0.3, 2.4 * s, 2.6 * s, 1.0, 2.0],
                [8],
            ),
            &device,
        )
        .require_grad();
        let range = Tensor::<A, 1>::from_data(TensorData::new(vec![-0.1f32, 1.0], [2]), &device);
        let y = fake_quantize(x.clone(), range, false);
        let expected = [
            -23.0 * s,
            -23.0 * s,
            0.0,
            (0.3f32 / s).round() * s,
            2.0 * s,
            3.0 * s,
            232.0 * s,
            232.0 * s,
        ];
        for (got, want) in values(y.clone()).iter().zip(expected) {
            assert!((got - want).abs() < 1e-6, "{got} vs {want}");
        }
        // the gradient passes inside the nudged range [-0.0992, 1.0008] only: not at -0.5,
        // -0.1 or 2.0
        let grads = y.sum().backward();
        let g = x
            .grad(&grads)
            .expect("a gradient")
            .into_data()
            .to_vec::<f32>();
        assert_eq!(
            g.expect("f32"),
            vec![0.0, 0.0, 1.0, 1.0, 1.0, 1.0, 1.0, 0.0]
        );
    }

    /// Weights: narrow range [1, 255], symmetric: a range [-0.5, 2] becomes [-2, 2]; the
    /// scale is 4 / 254 and the zero point 1 + 2 / s = 128 exactly, so codes are multiples of
    /// 4 / 254 in [-127, 127] steps.
    #[test]
    fn symmetric_narrow_weights_are_multiples_of_the_step() {
        let device = Default::default();
        let w = Tensor::<A, 1>::from_data(
            TensorData::new(vec![-0.5f32, 0.01, 0.02, 2.0], [4]),
            &device,
        );
        let rule = FakeQuant {
            symmetric: true,
            active: true,
        };
        let s = 4.0f32 / 254.0;
        let got = values(rule.weights(w));
        for (g, v) in got.iter().zip([-0.5f32, 0.01, 0.02, 2.0]) {
            assert!((g - (v / s).round() * s).abs() < 1e-6, "{got:?}");
        }
        let inactive = FakeQuant {
            symmetric: true,
            active: false,
        };
        let w = Tensor::<A, 1>::from_data(TensorData::new(vec![0.123f32], [1]), &device);
        assert_eq!(values(inactive.weights(w)), vec![0.123]);
    }

    /// Before `delay` the folded unit computes what the float unit computes (BatchNorm with
    /// batch statistics, whatever the moving variance), with the same gradients and the same
    /// moving-average updates: dense and depthwise, stride 1 and 2.
    #[test]
    fn folded_unit_before_the_delay_equals_the_float_unit() {
        use crate::config::BatchNormConfig;
        use crate::layers::ConvSpec;
        use rand::SeedableRng;
        let device = Default::default();
        for (depthwise, stride) in [(false, 1), (true, 2)] {
            let spec = ConvSpec {
                in_channels: 4,
                out_channels: if depthwise { 4 } else { 3 },
                kernel: 3,
                stride,
                depthwise,
                bias: false,
                init_stddev: 0.5,
            };
            let settings = BatchNormConfig::default();
            let unit = |seed| {
                let mut rng = rand::rngs::StdRng::seed_from_u64(seed);
                let u = ConvBnRelu6::<A>::new(spec, &settings, &mut rng, &device);
                let c = spec.out_channels;
                let ramp = |a: f32, b: f32| {
                    let v: Vec<f32> = (0..c).map(|i| a + b * i as f32).collect();
                    Tensor::<A, 1>::from_data(TensorData::new(v, [c]), &device)
                };
                u.bn.set_moving_stats(ramp(0.1, 0.2), ramp(2.5, 0.7));
                u
            };
            let (float, mut quantized) = (unit(3), unit(3));
            quantized.quant = Some(ActivationRange::new(
                FakeQuant {
                    symmetric: false,
                    active: false,
                },
                &device,
            ));
            let input: Vec<f32> = (0..2 * 4 * 7 * 7)
                .map(|i| ((i * 37 % 23) as f32 - 11.0) / 7.0)
                .collect();
            let x = Tensor::<A, 4>::from_data(TensorData::new(input, [2, 4, 7, 7]), &device);
            let outputs = [&float, &quantized].map(|u| {
                let y = u.forward(x.clone());
                let weights: Tensor<A, 4> = Tensor::from_data(
                    TensorData::new(
                        (0..y.shape().num_elements())
                            .map(|i| (i % 5) as f32 - 1.5)
                            .collect::<Vec<f32>>(),
                        y.shape(),
                    ),
                    &device,
                );
                let grads = (y.clone() * weights).sum().backward();
                let grad = |p: &burn::module::Param<Tensor<A, 1>>| {
                    values(Tensor::from_inner(p.grad(&grads).expect("a gradient")))
                };
                let kernel = u.conv.weight.grad(&grads).expect("a gradient");
                let (mean, variance) = u.bn.moving_stats();
                [
                    values(y),
                    values(Tensor::<A, 4>::from_inner(kernel)),
                    grad(&u.bn.gamma),
                    grad(&u.bn.beta),
                    values(mean),
                    values(variance),
                ]
            });
            let [a, b] = outputs;
            for (what, (a, b)) in ["output", "kernel", "gamma", "beta", "mean", "variance"]
                .iter()
                .zip(a.iter().zip(&b))
            {
                let scale = a.iter().fold(1e-3f32, |m, v| m.max(v.abs()));
                let diff = a.iter().zip(b).fold(0f32, |m, (x, y)| m.max((x - y).abs()));
                assert!(
                    diff <= 2e-5 * scale,
                    "{what} (depthwise {depthwise}): {diff} of {scale}"
                );
            }
            assert_eq!(
                quantized.quant.as_ref().unwrap().learned().map(|r| r[0]),
                Some(0.0)
            );
        }
    }

    /// The folded unit's gradients are TF1's: `contrib/quantize` registers its own gradient
    /// for the batch mean and variance of a folded BatchNorm (`FoldFusedBatchNormGrad`), so the
    /// loss reaches the kernel through the batch statistics. The numbers come from TF 2.21
    /// running TF1's rule (`scripts/tf-fixtures/fold_gradients.py`, delay not reached, 1x1
    /// convolution); with the statistics' gradient stopped the kernel's would be
    /// `[[10.9533, -11.7087], [-3.56487, 4.37507]]`.
    #[test]
    fn folded_unit_gradients_are_tf1s() {
        use crate::config::BatchNormConfig;
        use crate::layers::ConvSpec;
        use burn::module::Param;
        use rand::SeedableRng;
        let device = Default::default();
        let spec = ConvSpec {
            in_channels: 2,
            out_channels: 2,
            kernel: 1,
            stride: 1,
            depthwise: false,
            bias: false,
            init_stddev: 0.5,
        };
        let mut rng = rand::rngs::StdRng::seed_from_u64(1);
        let mut unit = ConvBnRelu6::<A>::new(spec, &BatchNormConfig::default(), &mut rng, &device);
        let t1 = |v: Vec<f32>| Tensor::<A, 1>::from_data(TensorData::new(v, [2]), &device);
        let t4 = |v: Vec<f32>, shape: [usize; 4]| {
            Tensor::<A, 4>::from_data(TensorData::new(v, shape), &device)
        };
        unit.conv.weight = Param::from_tensor(t4(vec![0.5, -0.3, 0.2, 0.8], [2, 2, 1, 1]));
        unit.bn.gamma = Param::from_tensor(t1(vec![1.2, 0.7]));
        unit.bn.beta = Param::from_tensor(t1(vec![0.1, -0.2]));
        unit.bn
            .set_moving_stats(t1(vec![0.1, 0.3]), t1(vec![2.5, 3.2]));
        let rule = FakeQuant {
            symmetric: false,
            active: false,
        };
        unit.quant = Some(ActivationRange::new(rule, &device));
        let x: Vec<f32> = (0..36)
            .map(|i| ((i * 37 % 23) as f32 - 11.0) / 7.0)
            .collect();
        let y = unit.forward(t4(x, [2, 2, 3, 3]));
        let weights: Vec<f32> = (0..36).map(|i| (i % 5) as f32 - 1.5).collect();
        let grads = (y * t4(weights, [2, 2, 3, 3])).sum().backward();
        let kernel = values(Tensor::<A, 4>::from_inner(
            unit.conv.weight.grad(&grads).unwrap(),
        ));
        let grad = |p: &Param<Tensor<A, 1>>| values(Tensor::from_inner(p.grad(&grads).unwrap()));
        let close = |got: &[f32], want: &[f32]| {
            got.iter()
                .zip(want)
                .all(|(g, w)| (g - w).abs() <= 1e-5 * w.abs().max(1.0))
        };
        // TF's [o][c]: the kernel's [out, in, 1, 1]
        let tf_kernel = [-0.992828, -1.71792, -1.97722, 0.505271];
        assert!(close(&kernel, &tf_kernel), "{kernel:?}");
        let gamma = grad(&unit.bn.gamma);
        assert!(close(&gamma, &[7.32494, 4.77373]), "{gamma:?}");
        assert_eq!(grad(&unit.bn.beta), vec![7.5, 5.5]);
    }

    /// A network in quantization-aware training, quantization in effect: the six class heads'
    /// outputs together take at most 256 values (one grid, as the int8 file's concatenation
    /// needs), every range is learned, and every kernel gets a gradient through the
    /// straight-through estimator.
    #[test]
    fn quantized_network_outputs_codes_on_one_grid_and_trains() {
        use crate::config::{QuantizationConfig, SsdConfig};
        let device = Default::default();
        let config = SsdConfig {
            num_classes: 2,
            image_size: [64, 64],
            depth_multiplier: 0.25,
            quantization: Some(QuantizationConfig::default()),
            ..SsdConfig::default()
        };
        let mut net = config.init::<A>(1, &device).unwrap();
        net.set_fake_quant_active(true);
        let input: Vec<f32> = (0..2 * 3 * 64 * 64)
            .map(|i| ((i * 7919 % 255) as f32) / 127.5 - 1.0)
            .collect();
        let x = Tensor::<A, 4>::from_data(TensorData::new(input, [2, 3, 64, 64]), &device);
        let maps = net.feature_maps(x.clone());
        let heads = net.head_ranges.as_ref().unwrap();
        let outputs = quantized_heads(&net.class_heads, &heads.classes, &maps);
        assert_eq!(outputs.len(), 6);
        let mut v: Vec<f32> = outputs.into_iter().flat_map(values).collect();
        v.sort_by(f32::total_cmp);
        v.dedup();
        assert!(v.len() <= 256, "six heads: {} distinct values", v.len());
        assert!(v.len() > 6, "{v:?}");
        let predictions = net.forward(x);
        let total = predictions.class_logits.sum() + predictions.box_encodings.sum();
        let grads = total.backward();
        assert!(
            net.activation_ranges()
                .iter()
                .all(|r| r.learned().is_some())
        );
        for kernel in net.kernels() {
            let g = values(Tensor::<A, 4>::from_inner(
                kernel.grad(&grads).expect("a gradient"),
            ));
            assert!(g.iter().all(|v| v.is_finite()) && g.iter().any(|v| *v != 0.0));
        }
        // a float network has no ranges
        let float = SsdConfig {
            quantization: None,
            ..config
        };
        assert!(
            float
                .init::<A>(1, &device)
                .unwrap()
                .activation_ranges()
                .is_empty()
        );
    }

    /// The moving range is debiased: the first batch's range is taken as it is, the second
    /// moves it by (1 - 0.999) / (1 - 0.999^2) of the difference; 0 is always inside.
    #[test]
    fn activation_ranges_are_debiased_moving_averages() {
        let device = Default::default();
        let rule = FakeQuant {
            symmetric: false,
            active: false,
        };
        let range = ActivationRange::<A>::new(rule, &device);
        assert_eq!(range.learned(), None);
        let batch = |v: Vec<f32>| Tensor::<A, 1>::from_data(TensorData::new(v, [2]), &device);
        let out = range.quantize(batch(vec![0.5, 3.0]));
        assert_eq!(values(out), vec![0.5, 3.0], "inactive: passes as it is");
        let [min, max] = range.learned().expect("learned");
        assert!(min.abs() < 1e-6 && (max - 3.0).abs() < 1e-4, "{min} {max}");
        range.quantize(batch(vec![-1.0, 5.0]));
        let w = 0.001 / (1.0 - 0.999f32 * 0.999);
        let [min, max] = range.learned().expect("learned");
        assert!((min - (-w)).abs() < 1e-4, "{min}");
        assert!((max - (3.0 + w * 2.0)).abs() < 1e-3, "{max}");
    }
}
