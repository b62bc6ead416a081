//! The network's layer operations as a Burn backend extension.
//!
//! [`SsdBackend`] adds the three operations every MobileNet layer is made of: a convolution
//! with TF "SAME" padding (dense or depthwise), training-mode BatchNorm fused with ReLU6, and
//! the inference-mode affine map + ReLU6; the loss's sigmoid cross-entropy; and the training
//! step's element-wise updates (L2 term, RMSProp, weight EMA) as single passes. Each has a
//! default built from Burn's generic tensor operations ([`reference`](mod@reference)), which any backend
//! (CUDA included) gets for free; the CPU backend overrides them with kernels written for
//! these layers ([`cpu`]), the GPU backends the depthwise convolution and its gradients with
//! CubeCL kernels (module `cube`, features `cuda` and `wgpu`), and `Autodiff<B>` records them as single graph nodes whose
//! backward pass calls the inner backend's backward operation. Model code stays generic
//! over `B: SsdBackend`.

mod autodiff;
pub mod cpu;
#[cfg(feature = "cube")]
pub mod cube;
mod flex;
pub mod reference;

use burn::tensor::backend::Backend;
use burn::tensor::ops::FloatTensor;
use burn::tensor::{Shape, Tensor, TensorCreationOptions, TensorData, TensorPrimitive};

/// Gradients of [`SsdBackend::conv_same`].
#[derive(Debug)]
pub struct ConvGrads<B: Backend> {
    /// Gradient of the input, when asked for (not for an input that needs none, such as
    /// the images fed to the first layer).
    pub x: Option<FloatTensor<B>>,
    /// Gradient of the filters.
    pub weight: FloatTensor<B>,
    /// Gradient of the bias (the output gradient summed per channel), when asked for.
    pub bias: Option<FloatTensor<B>>,
}

/// Which optional gradients [`SsdBackend::conv_same_backward`] computes (the filter
/// gradient it always does).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ConvGradsWanted {
    /// The input's gradient.
    pub x: bool,
    /// The bias's gradient.
    pub bias: bool,
}

/// Outputs of [`SsdBackend::batch_norm_relu6`].
#[derive(Debug)]
pub struct BatchNormOutput<B: Backend> {
    /// `clamp(gamma * (x - mean) / sqrt(variance + epsilon) + beta, 0, 6)`.
    pub y: FloatTensor<B>,
    /// Per-channel batch mean.
    pub mean: FloatTensor<B>,
    /// Per-channel biased batch variance.
    pub variance: FloatTensor<B>,
}

/// Gradients of [`SsdBackend::batch_norm_relu6`].
#[derive(Debug)]
pub struct BatchNormGrads<B: Backend> {
    /// Gradient of the input.
    pub x: FloatTensor<B>,
    /// Gradient of the scale.
    pub gamma: FloatTensor<B>,
    /// Gradient of the offset.
    pub beta: FloatTensor<B>,
}

/// Outputs of [`SsdBackend::depthwise_between_batch_norms`].
#[derive(Debug)]
pub struct DepthwiseBetweenOutput<B: Backend> {
    /// The second BatchNorm + ReLU6's output.
    pub y: FloatTensor<B>,
    /// The convolution's output, the second BatchNorm's input (its backward pass reads it).
    pub conv: FloatTensor<B>,
    /// Per-channel batch mean and biased variance of the first BatchNorm, then of the second.
    pub stats: [FloatTensor<B>; 4],
}

/// Gradients of [`SsdBackend::depthwise_between_batch_norms`].
#[derive(Debug)]
pub struct DepthwiseBetweenGrads<B: Backend> {
    /// Gradient of the input.
    pub x: FloatTensor<B>,
    /// Gradients of the first BatchNorm's scale and offset.
    pub before: [FloatTensor<B>; 2],
    /// Gradient of the depthwise filters.
    pub weight: FloatTensor<B>,
    /// Gradients of the second BatchNorm's scale and offset.
    pub after: [FloatTensor<B>; 2],
}

/// The constants of one [`SsdBackend::rmsprop_update`] (`tf.train.RMSPropOptimizer`).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct RmsPropStep {
    /// Learning rate of this step.
    pub learning_rate: f32,
    /// Momentum.
    pub momentum: f32,
    /// Decay of the mean square.
    pub decay: f32,
    /// Added to the mean square inside the square root.
    pub epsilon: f32,
}

/// A parameter and its RMSProp slots, before or after [`SsdBackend::rmsprop_update`].
#[derive(Debug)]
pub struct RmsPropState<B: Backend> {
    /// The parameter.
    pub weights: FloatTensor<B>,
    /// Moving mean of the squared gradient (`ms`).
    pub mean_square: FloatTensor<B>,
    /// The momentum slot (`mom`).
    pub momentum: FloatTensor<B>,
}

impl<B: Backend> RmsPropState<B> {
    /// `[weights, mean_square, momentum]`, the order the GPU kernels take and give them in.
    pub fn into_array(self) -> [FloatTensor<B>; 3] {
        [self.weights, self.mean_square, self.momentum]
    }

    /// The state from `[weights, mean_square, momentum]`.
    pub fn from_array([weights, mean_square, momentum]: [FloatTensor<B>; 3]) -> Self {
        Self {
            weights,
            mean_square,
            momentum,
        }
    }
}

/// A backend that runs the network's layers; see the module documentation.
pub trait SsdBackend: Backend {
    /// Convolution of `x [batch, in, h, w]` with TF "SAME" padding (extra row/column at the
    /// bottom/right). Dense: `weight [out, in, k, k]`; depthwise: `weight [in, 1, k, k]`.
    fn conv_same(
        x: FloatTensor<Self>,
        weight: FloatTensor<Self>,
        bias: Option<FloatTensor<Self>>,
        stride: usize,
        depthwise: bool,
    ) -> FloatTensor<Self> {
        reference::conv_same::<Self>(x, weight, bias, stride, depthwise)
    }

    /// Backward pass of [`SsdBackend::conv_same`] for the output gradient `grad`: the input
    /// gradient only when `wanted.x`, the bias gradient only when `wanted.bias`.
    fn conv_same_backward(
        x: FloatTensor<Self>,
        weight: FloatTensor<Self>,
        grad: FloatTensor<Self>,
        stride: usize,
        depthwise: bool,
        wanted: ConvGradsWanted,
    ) -> ConvGrads<Self> {
        reference::conv_same_backward::<Self>(x, weight, grad, stride, depthwise, wanted)
    }

    /// The input gradient of a dense convolution (no groups, no dilation) of an input of
    /// `size` (`[h, w]`, with the pads that `padding` does not make), `weight [out, in, k,
    /// k]`, for the output gradient `grad`: the transposed convolution, as Burn's
    /// `conv2d_x_backward` makes it. The GPU backends run it as a matrix product and `col2im`
    /// (module `cube`), where Burn without autotuning takes a direct kernel.
    fn conv_input_grad(
        weight: FloatTensor<Self>,
        grad: FloatTensor<Self>,
        size: [usize; 2],
        stride: usize,
        padding: [usize; 2],
    ) -> FloatTensor<Self> {
        let options = reference::input_grad_options(&weight, &grad, size, stride, padding);
        Self::conv_transpose2d(grad, weight, None, options)
    }

    /// The depthwise case of [`SsdBackend::conv_same`] without bias, `weight [in, 1, k, k]`:
    /// the GPU backends run it as a kernel of this crate (module `cube`).
    fn depthwise_conv(
        x: FloatTensor<Self>,
        weight: FloatTensor<Self>,
        stride: usize,
    ) -> FloatTensor<Self> {
        reference::depthwise_conv::<Self>(x, weight, stride)
    }

    /// The input gradient (when `want_x`) and the filter gradient of
    /// [`SsdBackend::depthwise_conv`] for the output gradient `grad`.
    fn depthwise_conv_backward(
        x: FloatTensor<Self>,
        weight: FloatTensor<Self>,
        grad: FloatTensor<Self>,
        stride: usize,
        want_x: bool,
    ) -> (Option<FloatTensor<Self>>, FloatTensor<Self>) {
        reference::depthwise_grads::<Self>(x, weight, grad, stride, want_x)
    }

    /// Training-mode BatchNorm (batch statistics) followed by ReLU6.
    fn batch_norm_relu6(
        x: FloatTensor<Self>,
        gamma: FloatTensor<Self>,
        beta: FloatTensor<Self>,
        epsilon: f64,
    ) -> BatchNormOutput<Self> {
        reference::batch_norm_relu6::<Self>(x, gamma, beta, epsilon)
    }

    /// Backward pass of [`SsdBackend::batch_norm_relu6`], given its input, parameters and
    /// statistics. ReLU6 passes gradient where its input was strictly inside `(0, 6)`, which
    /// the backward pass recomputes from `x` exactly as the forward pass computed it (so the
    /// output need not be read).
    #[allow(clippy::too_many_arguments)]
    fn batch_norm_relu6_backward(
        x: FloatTensor<Self>,
        grad: FloatTensor<Self>,
        gamma: FloatTensor<Self>,
        beta: FloatTensor<Self>,
        mean: FloatTensor<Self>,
        variance: FloatTensor<Self>,
        epsilon: f64,
    ) -> BatchNormGrads<Self> {
        reference::batch_norm_relu6_backward::<Self>(x, grad, gamma, beta, mean, variance, epsilon)
    }

    /// Training-mode BatchNorm + ReLU6 of `x` with `before` (`[gamma, beta]`,
    /// [`SsdBackend::batch_norm_relu6`]), a depthwise convolution of the result
    /// ([`SsdBackend::conv_same`], no bias), then BatchNorm + ReLU6 with `after`, as one
    /// operation; `epsilon` is each BatchNorm's. The CPU backend runs it channel by channel
    /// and never stores the first BatchNorm's output, which saves writing the activations
    /// between the operations and reading them back (and their gradients in the backward
    /// pass).
    fn depthwise_between_batch_norms(
        x: FloatTensor<Self>,
        before: [FloatTensor<Self>; 2],
        (weight, stride): (FloatTensor<Self>, usize),
        after: [FloatTensor<Self>; 2],
        epsilon: [f64; 2],
    ) -> DepthwiseBetweenOutput<Self> {
        reference::depthwise_between_batch_norms::<Self>(
            x,
            before,
            (weight, stride),
            after,
            epsilon,
        )
    }

    /// Backward pass of [`SsdBackend::depthwise_between_batch_norms`] for the output
    /// gradient `grad`, given its input `x`, the convolution's output `conv`, and each
    /// BatchNorm's `[gamma, beta, mean, variance]`.
    fn depthwise_between_batch_norms_backward(
        (x, conv, grad): (FloatTensor<Self>, FloatTensor<Self>, FloatTensor<Self>),
        before: [FloatTensor<Self>; 4],
        (weight, stride): (FloatTensor<Self>, usize),
        after: [FloatTensor<Self>; 4],
        epsilon: [f64; 2],
    ) -> DepthwiseBetweenGrads<Self> {
        reference::depthwise_between_batch_norms_backward::<Self>(
            (x, conv, grad),
            before,
            (weight, stride),
            after,
            epsilon,
        )
    }

    /// `[batch, channels, height, width]` reordered to `[batch, height, width, channels]`
    /// (the API's NHWC order of the predictor heads' outputs), its values in that order.
    fn channels_last(x: FloatTensor<Self>) -> FloatTensor<Self> {
        reference::channels_last::<Self>(x)
    }

    /// The inverse of [`SsdBackend::channels_last`] (its backward pass):
    /// `[batch, height, width, channels]` to `[batch, channels, height, width]`.
    fn channels_first(x: FloatTensor<Self>) -> FloatTensor<Self> {
        reference::channels_first::<Self>(x)
    }

    /// Inference-mode unit: [`SsdBackend::conv_same`] (no bias), then
    /// [`SsdBackend::affine_relu6`] with `[scale, shift]`. The CPU backend applies the affine
    /// map and ReLU6 to each image's (or, depthwise, each plane's) output as soon as it is
    /// computed, while it is still in cache, instead of in a second pass over the output.
    fn conv_affine_relu6(
        x: FloatTensor<Self>,
        (weight, stride, depthwise): (FloatTensor<Self>, usize, bool),
        [scale, shift]: [FloatTensor<Self>; 2],
    ) -> FloatTensor<Self> {
        let y = Self::conv_same(x, weight, None, stride, depthwise);
        Self::affine_relu6(y, scale, shift)
    }

    /// `clamp(x * scale[c] + shift[c], 0, 6)`: inference-mode BatchNorm folded into a
    /// per-channel affine map, then ReLU6.
    fn affine_relu6(
        x: FloatTensor<Self>,
        scale: FloatTensor<Self>,
        shift: FloatTensor<Self>,
    ) -> FloatTensor<Self> {
        reference::affine_relu6::<Self>(x, scale, shift)
    }

    /// TF's `sigmoid_cross_entropy_with_logits`, `max(x, 0) - x z + log(1 + exp(-|x|))`, of
    /// `logits [batch, anchors, classes]` against `labels` of the same shape, summed over the
    /// classes: `[batch, anchors]`. The labels are constants: no gradient flows to them.
    fn sigmoid_cross_entropy(
        logits: FloatTensor<Self>,
        labels: FloatTensor<Self>,
    ) -> FloatTensor<Self> {
        reference::sigmoid_cross_entropy::<Self>(logits, labels)
    }

    /// Backward pass of [`SsdBackend::sigmoid_cross_entropy`] for the output gradient
    /// `grad [batch, anchors]`: `(sigmoid(x) - z) * grad`.
    fn sigmoid_cross_entropy_backward(
        logits: FloatTensor<Self>,
        labels: FloatTensor<Self>,
        grad: FloatTensor<Self>,
    ) -> FloatTensor<Self> {
        reference::sigmoid_cross_entropy_backward::<Self>(logits, labels, grad)
    }

    /// `sum(x^2) / 2` as a one-element tensor (TF's `tf.nn.l2_loss`, the L2 regulariser of
    /// one kernel).
    fn half_squared_norm(x: FloatTensor<Self>) -> FloatTensor<Self> {
        reference::half_squared_norm::<Self>(x)
    }

    /// `x + alpha y` for tensors of one shape (a kernel's gradient plus its L2 gradient),
    /// into `x`'s buffer where nothing else holds it.
    fn add_scaled(x: FloatTensor<Self>, y: FloatTensor<Self>, alpha: f32) -> FloatTensor<Self> {
        reference::add_scaled::<Self>(x, y, alpha)
    }

    /// One RMSProp update as TF applies it: `ms <- decay ms + (1 - decay) g^2`,
    /// `mom <- momentum mom + lr g / sqrt(ms + epsilon)`, `w <- w - mom`, all in `f32`
    /// (one pass over the four tensors on the CPU instead of ten, writing into the weights'
    /// and slots' own buffers where nothing else holds them).
    fn rmsprop_update(
        state: RmsPropState<Self>,
        grad: FloatTensor<Self>,
        step: RmsPropStep,
    ) -> RmsPropState<Self> {
        reference::rmsprop_update::<Self>(state, grad, step)
    }

    /// One step of an exponential moving average towards `scale value`,
    /// `average - (1 - keep) (average - scale value)` (`tf.train.ExponentialMovingAverage`'s
    /// update; `scale` is 1 but for BatchNorm's moving variance, where it makes the batch's
    /// variance unbiased), in `f32` (on the CPU into `average`'s buffer where nothing else
    /// holds it).
    fn moving_average(
        average: FloatTensor<Self>,
        value: FloatTensor<Self>,
        scale: f32,
        keep: f32,
    ) -> FloatTensor<Self> {
        reference::moving_average::<Self>(average, value, scale, keep)
    }

    /// Runs `f`, a block of many tensor operations (a forward pass, a training step), where
    /// this backend's kernels start fastest. In place by default; the CPU backend runs it on
    /// a thread of rayon's pool, so that each kernel's parallel loop starts on that thread
    /// instead of being handed from the caller's thread to the pool and back (which cost a
    /// quarter of a batch-1 forward pass on one core). `f` must not wait for
    /// other work on the pool, such as another replica's step.
    fn on_compute_thread<R: Send>(f: impl FnOnce() -> R + Send) -> R {
        f()
    }

    /// Whether `Tensor::to_device` can copy between two distinct devices of this backend on
    /// this machine. Burn 0.21 implements it only between CUDA devices, with NCCL
    /// point-to-point, so it needs libnccl at run time; wgpu's panics (`comm_init` is not
    /// implemented). Where it cannot, callers stage the copy through the host.
    fn copies_device_to_device() -> bool {
        false
    }
}

/// burn-wgpu's backend without the fusion layer that [`burn::backend::Wgpu`] wraps it in.
#[cfg(all(feature = "wgpu", feature = "generic-backend"))]
pub type WgpuUnfused =
    burn::backend::wgpu::CubeBackend<burn::backend::wgpu::WgpuRuntime, f32, i32, u32>;

/// burn-ndarray with every default: the generic code the GPU backends run, on the CPU, for
/// the tests.
#[cfg(any(test, feature = "generic-backend"))]
impl SsdBackend for burn::backend::NdArray {}

fn prim<B: Backend, const D: usize>(t: Tensor<B, D>) -> FloatTensor<B> {
    t.into_primitive().tensor()
}

fn tensor<B: Backend, const D: usize>(t: FloatTensor<B>) -> Tensor<B, D> {
    Tensor::from_primitive(TensorPrimitive::Float(t))
}

/// [`SsdBackend::conv_same`] on tensors.
pub fn conv_same<B: SsdBackend>(
    x: Tensor<B, 4>,
    weight: Tensor<B, 4>,
    bias: Option<Tensor<B, 1>>,
    stride: usize,
    depthwise: bool,
) -> Tensor<B, 4> {
    tensor(B::conv_same(
        prim(x),
        prim(weight),
        bias.map(prim),
        stride,
        depthwise,
    ))
}

/// [`SsdBackend::batch_norm_relu6`] on tensors: `(y, mean, variance)`; the statistics carry
/// no gradient (the backward pass of `y` already accounts for them).
pub fn batch_norm_relu6<B: SsdBackend>(
    x: Tensor<B, 4>,
    gamma: Tensor<B, 1>,
    beta: Tensor<B, 1>,
    epsilon: f64,
) -> (Tensor<B, 4>, Tensor<B, 1>, Tensor<B, 1>) {
    let out = B::batch_norm_relu6(prim(x), prim(gamma), prim(beta), epsilon);
    (tensor(out.y), tensor(out.mean), tensor(out.variance))
}

/// [`SsdBackend::depthwise_between_batch_norms`] on tensors: the output and `[mean, variance]`
/// of the first BatchNorm then of the second; the statistics carry no gradient.
pub fn depthwise_between_batch_norms<B: SsdBackend>(
    x: Tensor<B, 4>,
    before: [Tensor<B, 1>; 2],
    (weight, stride): (Tensor<B, 4>, usize),
    after: [Tensor<B, 1>; 2],
    epsilon: [f64; 2],
) -> (Tensor<B, 4>, [Tensor<B, 1>; 4]) {
    let out = B::depthwise_between_batch_norms(
        prim(x),
        before.map(prim),
        (prim(weight), stride),
        after.map(prim),
        epsilon,
    );
    (tensor(out.y), out.stats.map(tensor))
}

/// [`SsdBackend::sigmoid_cross_entropy`] on tensors.
pub fn sigmoid_cross_entropy<B: SsdBackend>(
    logits: Tensor<B, 3>,
    labels: Tensor<B, 3>,
) -> Tensor<B, 2> {
    tensor(B::sigmoid_cross_entropy(prim(logits), prim(labels)))
}

/// [`SsdBackend::channels_last`] on tensors.
pub fn channels_last<B: SsdBackend>(x: Tensor<B, 4>) -> Tensor<B, 4> {
    tensor(B::channels_last(prim(x)))
}

/// [`SsdBackend::conv_affine_relu6`] on tensors.
pub fn conv_affine_relu6<B: SsdBackend>(
    x: Tensor<B, 4>,
    (weight, stride, depthwise): (Tensor<B, 4>, usize, bool),
    [scale, shift]: [Tensor<B, 1>; 2],
) -> Tensor<B, 4> {
    tensor(B::conv_affine_relu6(
        prim(x),
        (prim(weight), stride, depthwise),
        [prim(scale), prim(shift)],
    ))
}

/// [`SsdBackend::affine_relu6`] on tensors.
pub fn affine_relu6<B: SsdBackend>(
    x: Tensor<B, 4>,
    scale: Tensor<B, 1>,
    shift: Tensor<B, 1>,
) -> Tensor<B, 4> {
    tensor(B::affine_relu6(prim(x), prim(scale), prim(shift)))
}

/// [`SsdBackend::rmsprop_update`] on tensors: `(weights, mean_square, momentum)` after the
/// update.
pub fn rmsprop_update<B: SsdBackend, const D: usize>(
    [weights, mean_square, momentum]: [Tensor<B, D>; 3],
    grad: Tensor<B, D>,
    step: RmsPropStep,
) -> [Tensor<B, D>; 3] {
    let state = RmsPropState {
        weights: prim(weights),
        mean_square: prim(mean_square),
        momentum: prim(momentum),
    };
    let out = B::rmsprop_update(state, prim(grad), step);
    [out.weights, out.mean_square, out.momentum].map(tensor)
}

/// [`SsdBackend::moving_average`] on tensors.
pub fn moving_average<B: SsdBackend, const D: usize>(
    average: Tensor<B, D>,
    value: Tensor<B, D>,
    scale: f32,
    keep: f32,
) -> Tensor<B, D> {
    tensor(B::moving_average(prim(average), prim(value), scale, keep))
}

/// [`SsdBackend::add_scaled`] on tensors.
pub fn add_scaled<B: SsdBackend, const D: usize>(
    x: Tensor<B, D>,
    y: Tensor<B, D>,
    alpha: f32,
) -> Tensor<B, D> {
    tensor(B::add_scaled(prim(x), prim(y), alpha))
}

/// [`SsdBackend::half_squared_norm`] on tensors.
pub fn half_squared_norm<B: SsdBackend, const D: usize>(x: Tensor<B, D>) -> Tensor<B, 1> {
    tensor(B::half_squared_norm(prim(x)))
}

/// A tensor of `shape` with every value `value`, written from the host. A GPU compiles no
/// kernel for it, where `Tensor::zeros` / `ones` / `full` launch a fill that fusion joins with
/// the fills around it into a different kernel for every grouping and cube size: 17 of a cold
/// pets step's kernels made the network's first values, 15 the optimizer's slots.
pub fn filled<B: Backend, const D: usize>(
    shape: impl Into<Shape>,
    value: f32,
    options: impl Into<TensorCreationOptions<B>>,
) -> Tensor<B, D> {
    Tensor::from_data(TensorData::full(shape, value), options)
}

#[cfg(test)]
mod generic_tests;
#[cfg(test)]
mod tests;
