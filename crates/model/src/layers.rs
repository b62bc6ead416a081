//! Building blocks: TF-"SAME" convolutions initialised from a truncated normal, and the
//! convolution + BatchNorm + ReLU6 unit every MobileNet and extra layer is made of.

use burn::module::{Module, Param, ParamId, RunningState};
use burn::nn::PaddingConfig2d;
use burn::nn::conv::{Conv2d, Conv2dConfig};
use burn::tensor::backend::Backend;
use burn::tensor::{Tensor, TensorData};
use rand::Rng;
use rand_distr::{Distribution, StandardNormal};

use crate::config::BatchNormConfig as BnSettings;
use crate::fake_quant::{ActivationRange, folded_unit};
use crate::ops::{
    SsdBackend, affine_relu6, batch_norm_relu6, conv_affine_relu6, conv_same,
    depthwise_between_batch_norms, filled, moving_average,
};

/// Shape and initialisation of one convolution.
#[derive(Debug, Clone, Copy)]
pub(crate) struct ConvSpec {
    pub in_channels: usize,
    pub out_channels: usize,
    pub kernel: usize,
    pub stride: usize,
    /// Depthwise (one filter per input channel) rather than dense.
    pub depthwise: bool,
    pub bias: bool,
    pub init_stddev: f32,
}

/// `tf.truncated_normal_initializer`: normal draws, redrawn while more than two stddevs out.
fn truncated_normal(len: usize, stddev: f32, rng: &mut impl Rng) -> Vec<f32> {
    (0..len)
        .map(|_| {
            loop {
                let v: f32 = StandardNormal.sample(rng);
                if v.abs() <= 2.0 {
                    break v * stddev;
                }
            }
        })
        .collect()
}

impl ConvSpec {
    /// A convolution with TF "SAME" padding, weights from a truncated normal, zero bias.
    pub fn init<B: Backend>(&self, rng: &mut impl Rng, device: &B::Device) -> Conv2d<B> {
        let groups = if self.depthwise { self.in_channels } else { 1 };
        let mut conv = Conv2dConfig::new(
            [self.in_channels, self.out_channels],
            [self.kernel, self.kernel],
        )
        .with_stride([self.stride, self.stride])
        .with_groups(groups)
        .with_padding(PaddingConfig2d::Same)
        .with_bias(self.bias)
        .init::<B>(device);
        let shape = [
            self.out_channels,
            self.in_channels / groups,
            self.kernel,
            self.kernel,
        ];
        let values = truncated_normal(shape.iter().product(), self.init_stddev, rng);
        conv.weight = Param::from_tensor(Tensor::from_data(TensorData::new(values, shape), device));
        if self.bias {
            conv.bias = Some(Param::from_tensor(filled([self.out_channels], 0.0, device)));
        }
        conv
    }
}

/// Applies a convolution made by [`ConvSpec::init`] (TF "SAME" padding, square kernel,
/// depthwise when it has one group per input channel).
pub(crate) fn apply_conv<B: SsdBackend>(conv: &Conv2d<B>, x: Tensor<B, 4>) -> Tensor<B, 4> {
    conv_same(
        x,
        conv.weight.val(),
        conv.bias.as_ref().map(|b| b.val()),
        conv.stride[0],
        conv.groups > 1,
    )
}

/// BatchNorm as slim's `batch_norm` computes it with TF's fused kernel (`FusedBatchNormV3`,
/// what the API's graphs run): batch statistics with the biased variance in training, and
/// moving averages `m <- m - (m - v) (1 - decay)` for inference, where `v` is the batch mean
/// and the unbiased batch variance (`n / (n - 1)` times the biased one over the `n` values
/// of a channel; checked against TF's training step, `crates/train/tests/tf_step.rs`).
///
/// Always followed by ReLU6 in this network, so the two run as one operation
/// ([`SsdBackend::batch_norm_relu6`] in training, [`SsdBackend::affine_relu6`] with the moving
/// averages folded into a per-channel affine map otherwise).
#[derive(Module, Debug)]
pub struct BatchNorm<B: Backend> {
    /// Scale (`gamma`).
    pub gamma: Param<Tensor<B, 1>>,
    /// Offset (`beta`).
    pub beta: Param<Tensor<B, 1>>,
    /// Moving mean.
    pub moving_mean: RunningState<Tensor<B, 1>>,
    /// Moving variance.
    pub moving_variance: RunningState<Tensor<B, 1>>,
    epsilon: f64,
    decay: f64,
}

impl<B: Backend> BatchNorm<B> {
    fn new(channels: usize, settings: &BnSettings, device: &B::Device) -> Self {
        Self {
            gamma: Param::from_tensor(filled([channels], 1.0, device)),
            beta: Param::from_tensor(filled([channels], 0.0, device)),
            moving_mean: RunningState::new(filled([channels], 0.0, device)),
            moving_variance: RunningState::new(filled([channels], 1.0, device)),
            epsilon: settings.epsilon,
            decay: settings.decay,
        }
    }

    /// The moving mean and variance.
    pub fn moving_stats(&self) -> (Tensor<B, 1>, Tensor<B, 1>) {
        (self.moving_mean.value(), self.moving_variance.value())
    }

    /// Replaces the moving mean and variance (e.g. with their average over replicas).
    pub fn set_moving_stats(&self, mean: Tensor<B, 1>, variance: Tensor<B, 1>) {
        set_running(&self.moving_mean, mean);
        set_running(&self.moving_variance, variance);
    }
}

impl<B: SsdBackend> BatchNorm<B> {
    /// Normalises `[batch, channels, h, w]` and applies ReLU6. Batch statistics (and a
    /// moving-average update) when the backend records gradients, moving averages otherwise.
    pub fn forward_relu6(&self, x: Tensor<B, 4>) -> Tensor<B, 4> {
        if B::ad_enabled(&x.device()) {
            let count = values_per_channel(&x);
            let (y, mean, variance) =
                batch_norm_relu6(x, self.gamma.val(), self.beta.val(), self.epsilon);
            self.update_moving_stats(mean, variance, count);
            y
        } else {
            let [scale, shift] = self.folded(&x.device());
            affine_relu6(x, scale, shift)
        }
    }

    /// The moving averages folded into the per-channel affine map of inference:
    /// `[scale, shift]` with `scale = gamma / sqrt(variance + epsilon)` and
    /// `shift = beta - mean * scale`.
    pub(crate) fn folded(&self, device: &B::Device) -> [Tensor<B, 1>; 2] {
        let mean = self.moving_mean.value().to_device(device);
        let variance = self.moving_variance.value().to_device(device);
        let scale = self.gamma.val() / variance.add_scalar(self.epsilon).sqrt();
        let shift = self.beta.val() - mean * scale.clone();
        [scale, shift]
    }

    /// Added to the variance before the square root.
    pub(crate) fn epsilon(&self) -> f64 {
        self.epsilon
    }

    /// Moves the moving averages towards a training batch's statistics over `count` values
    /// per channel: `m <- m - (m - batch) (1 - decay)` (TF's `assign_moving_average`), the
    /// biased batch `variance` made unbiased first (TF's fused kernel: `n / max(n - 1, 1)`).
    pub(crate) fn update_moving_stats(
        &self,
        mean: Tensor<B, 1>,
        variance: Tensor<B, 1>,
        count: usize,
    ) {
        // in the update's kernel: a multiply of its own would be a launch per BatchNorm
        let unbiased = (count as f64 / count.saturating_sub(1).max(1) as f64) as f32;
        let keep = self.decay as f32;
        let update = |state: &RunningState<Tensor<B, 1>>, batch: Tensor<B, 1>, scale| {
            let moving = state.value().to_device(&batch.device());
            set_running(state, moving_average(moving, batch.detach(), scale, keep));
        };
        update(&self.moving_mean, mean, 1.0);
        update(&self.moving_variance, variance, unbiased);
    }
}

/// Sets `state` to `value`, for it and every clone of it (they share the value).
///
/// Not `RunningState::update`: that queues a value per thread and averages the queue at the
/// next read, a `value / 1` for the one writer every state here has, which fusion joins with
/// its neighbours into a different kernel for every grouping (13 of a cold pets step's
/// compilations, two launches per BatchNorm a step).
pub(crate) fn set_running<B: Backend, const D: usize>(
    state: &RunningState<Tensor<B, D>>,
    value: Tensor<B, D>,
) {
    // the id is the clone's alone, and the clone is dropped
    let _ = state
        .clone()
        .load_record(Param::initialized(ParamId::new(), value));
}

/// The values a BatchNorm averages per channel of `[batch, channels, h, w]`: `batch * h * w`.
fn values_per_channel<B: Backend>(x: &Tensor<B, 4>) -> usize {
    let [batch, _, h, w] = x.dims();
    batch * h * w
}

/// Convolution (no bias) followed by BatchNorm and ReLU6.
#[derive(Module, Debug)]
pub struct ConvBnRelu6<B: Backend> {
    /// The convolution.
    pub conv: Conv2d<B>,
    /// Its BatchNorm (gamma, beta, moving mean and variance).
    pub bn: BatchNorm<B>,
    /// The learned range of its output, in quantization-aware training.
    pub quant: Option<ActivationRange<B>>,
}

impl<B: Backend> ConvBnRelu6<B> {
    pub(crate) fn new(
        spec: ConvSpec,
        bn: &BnSettings,
        rng: &mut impl Rng,
        device: &B::Device,
    ) -> Self {
        let conv = ConvSpec {
            bias: false,
            ..spec
        }
        .init(rng, device);
        let bn = BatchNorm::new(spec.out_channels, bn, device);
        Self {
            conv,
            bn,
            quant: None,
        }
    }
}

impl<B: SsdBackend> ConvBnRelu6<B> {
    /// Applies the unit. BatchNorm uses batch statistics (and updates its moving averages)
    /// when the backend records gradients, folded into fake-quantized weights in
    /// quantization-aware training ([`crate::fake_quant`]); the moving averages otherwise, as
    /// one operation with the convolution ([`SsdBackend::conv_affine_relu6`]).
    pub fn forward(&self, x: Tensor<B, 4>) -> Tensor<B, 4> {
        if B::ad_enabled(&x.device()) {
            return match &self.quant {
                Some(range) => folded_unit(self, range, x),
                None => self.bn.forward_relu6(apply_conv(&self.conv, x)),
            };
        }
        let folded = self.bn.folded(&x.device());
        let conv = &self.conv;
        let depthwise = conv.groups > 1;
        conv_affine_relu6(x, (conv.weight.val(), conv.stride[0], depthwise), folded)
    }

    /// Applies `before`'s BatchNorm + ReLU6 to `x`, then this unit, a depthwise convolution.
    /// When the backend records gradients the three run as one operation
    /// ([`SsdBackend::depthwise_between_batch_norms`], which updates both moving averages),
    /// otherwise one after the other.
    pub(crate) fn forward_after(&self, x: Tensor<B, 4>, before: &BatchNorm<B>) -> Tensor<B, 4> {
        debug_assert!(self.conv.groups > 1, "a depthwise convolution");
        if !B::ad_enabled(&x.device()) {
            return self.forward(before.forward_relu6(x));
        }
        let before_count = values_per_channel(&x);
        let [batch, _, h, w] = x.dims();
        let stride = self.conv.stride[0];
        let after_count = batch * h.div_ceil(stride) * w.div_ceil(stride);
        let (y, [mean, variance, mean_after, variance_after]) = depthwise_between_batch_norms(
            x,
            [before.gamma.val(), before.beta.val()],
            (self.conv.weight.val(), self.conv.stride[0]),
            [self.bn.gamma.val(), self.bn.beta.val()],
            [before.epsilon, self.bn.epsilon],
        );
        before.update_moving_stats(mean, variance, before_count);
        self.bn
            .update_moving_stats(mean_after, variance_after, after_count);
        y
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use burn::backend::Flex;
    use rand::SeedableRng;
    use rand::rngs::StdRng;

    #[test]
    fn batch_norm_train_and_inference() {
        use burn::backend::Autodiff;
        type A = Autodiff<Flex>;
        let device = Default::default();
        let settings = BnSettings {
            epsilon: 0.001,
            decay: 0.9,
        };
        let bn = BatchNorm::<A>::new(1, &settings, &device);
        // one channel, values 1, 2, 3, 6: mean 3, biased variance 3.5
        let x = Tensor::<A, 4>::from_data(
            TensorData::new(vec![1.0f32, 2.0, 3.0, 6.0], [1, 1, 2, 2]),
            &device,
        );
        let y = bn.forward_relu6(x).into_data().to_vec::<f32>().unwrap();
        let sd = (3.5f32 + 0.001).sqrt();
        for (got, v) in y.iter().zip([1.0f32, 2.0, 3.0, 6.0]) {
            assert!(
                (got - ((v - 3.0) / sd).clamp(0.0, 6.0)).abs() < 1e-5,
                "{y:?}"
            );
        }
        // moving averages: 0.9 * 0 + 0.1 * 3, and 0.9 * 1 + 0.1 * 14 / 3 (the unbiased
        // variance: 3.5 * 4 / 3)
        let mean = bn.moving_mean.value().into_scalar();
        let var = bn.moving_variance.value().into_scalar();
        assert!(
            (mean - 0.3).abs() < 1e-6 && (var - (0.9 + 0.1 * 14.0 / 3.0)).abs() < 1e-6,
            "{mean} {var}"
        );
        // inference (no autodiff) uses the moving averages
        let inner = burn::module::AutodiffModule::valid(&bn);
        let x =
            Tensor::<Flex, 4>::from_data(TensorData::new(vec![0.3f32; 4], [1, 1, 2, 2]), &device);
        let y = inner.forward_relu6(x).into_data().to_vec::<f32>().unwrap();
        assert!(y.iter().all(|v| v.abs() < 1e-6), "{y:?}");
    }

    /// TF "SAME" pads the extra row and column at the bottom and right: a 3x3 stride-2 sum
    /// over a 4x4 image of ones needs one padded row/column, all of it after the image.
    #[test]
    fn same_padding_is_asymmetric_like_tf() {
        let device = Default::default();
        let spec = ConvSpec {
            in_channels: 1,
            out_channels: 1,
            kernel: 3,
            stride: 2,
            depthwise: false,
            bias: false,
            init_stddev: 0.1,
        };
        let mut conv = spec.init::<Flex>(&mut StdRng::seed_from_u64(0), &device);
        conv.weight = Param::from_tensor(Tensor::ones([1, 1, 3, 3], &device));
        let out = apply_conv(&conv, Tensor::ones([1, 1, 4, 4], &device));
        let values = out.into_data().to_vec::<f32>().unwrap();
        // top-left window covers rows/cols 0..3 of the image: 9 ones; bottom-right window
        // covers rows/cols 2, 3 and one padded row/column: 4 ones.
        assert_eq!(values, vec![9.0, 6.0, 6.0, 4.0]);
    }

    #[test]
    fn truncated_normal_stays_within_two_stddevs() {
        let mut rng = StdRng::seed_from_u64(7);
        let v = truncated_normal(20_000, 0.03, &mut rng);
        assert!(v.iter().all(|x| x.abs() <= 0.06));
        let mean = v.iter().sum::<f32>() / v.len() as f32;
        let var = v.iter().map(|x| (x - mean).powi(2)).sum::<f32>() / v.len() as f32;
        // stddev of a normal truncated at 2 sigma is 0.8796 sigma
        assert!(mean.abs() < 1e-3, "{mean}");
        assert!((var.sqrt() - 0.03 * 0.8796).abs() < 5e-4, "{}", var.sqrt());
    }
}
