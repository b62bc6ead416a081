//! The [`SsdBackend`] operations built from Burn's generic tensor
//! operations: the defaults for any backend, and the reference the CPU kernels are tested
//! against.

use burn::tensor::backend::Backend;
use burn::tensor::module::conv2d;
use burn::tensor::ops::conv::calculate_padding_out;
use burn::tensor::ops::{ConvOptions, ConvTransposeOptions, FloatTensor, PadMode};
use burn::tensor::{Tensor, TensorMetadata};

use super::cpu::same_padding;
use super::{
    BatchNormGrads, BatchNormOutput, ConvGrads, ConvGradsWanted, DepthwiseBetweenGrads,
    DepthwiseBetweenOutput, RmsPropState, RmsPropStep, SsdBackend, prim, tensor,
};

/// TF "SAME" padding for one convolution: folded into the convolution's own (symmetric)
/// padding where top equals bottom and left equals right (every stride-1 layer, and every
/// 1x1 convolution, whose pads are zero), so the input is not copied; else an explicit
/// padded copy (TF puts the extra row / column at the bottom / right).
struct Same {
    options: ConvOptions<2>,
    /// `(left, right, top, bottom)`: every pad.
    pads: (usize, usize, usize, usize),
}

impl Same {
    fn new(x: &impl TensorMetadata, kernel: usize, stride: usize, groups: usize) -> Self {
        let [_, _, h, w] = x.shape().dims();
        let pads = |size| {
            let (_, before, after) = same_padding(size, kernel, stride);
            (before, after)
        };
        let ((top, bottom), (left, right)) = (pads(h), pads(w));
        let folded = if symmetric((left, right, top, bottom)) {
            [top, left]
        } else {
            [0, 0]
        };
        Self {
            options: ConvOptions::new([stride, stride], folded, [1, 1], groups),
            pads: (left, right, top, bottom),
        }
    }

    /// Whether the convolution pads by itself.
    fn folded(&self) -> bool {
        symmetric(self.pads)
    }

    /// `x` as the convolution takes it: copied with its pads unless they are folded.
    fn input<B: Backend>(&self, x: FloatTensor<B>) -> FloatTensor<B> {
        if self.folded() {
            x
        } else {
            padded::<B>(x, self.pads)
        }
    }
}

fn symmetric((left, right, top, bottom): (usize, usize, usize, usize)) -> bool {
    left == right && top == bottom
}

fn padded<B: Backend>(x: FloatTensor<B>, pads: (usize, usize, usize, usize)) -> FloatTensor<B> {
    if pads == (0, 0, 0, 0) {
        return x;
    }
    prim(tensor::<B, 4>(x).pad(pads, PadMode::Constant(0.0)))
}

/// A dense convolution as a matrix product (1x1, stride 1) or Burn's; a depthwise one as
/// [`SsdBackend::depthwise_conv`], then the bias.
pub fn conv_same<B: SsdBackend>(
    x: FloatTensor<B>,
    weight: FloatTensor<B>,
    bias: Option<FloatTensor<B>>,
    stride: usize,
    depthwise: bool,
) -> FloatTensor<B> {
    if depthwise {
        let y = B::depthwise_conv(x, weight, stride);
        return match bias {
            Some(bias) => prim(tensor::<B, 4>(y) + per_channel(bias)),
            None => y,
        };
    }
    let kernel = weight.shape().dims::<4>()[2];
    if is_pointwise(kernel, stride) {
        return pointwise::<B>(x, weight, bias);
    }
    burn_conv_same::<B>(x, weight, bias, kernel, stride, 1)
}

/// Burn's convolution of `x` with SAME padding, in `groups`.
fn burn_conv_same<B: Backend>(
    x: FloatTensor<B>,
    weight: FloatTensor<B>,
    bias: Option<FloatTensor<B>>,
    kernel: usize,
    stride: usize,
    groups: usize,
) -> FloatTensor<B> {
    let same = Same::new(&x, kernel, stride, groups);
    let x = same.input::<B>(x);
    prim(conv2d(
        tensor::<B, 4>(x),
        tensor(weight),
        bias.map(tensor),
        same.options,
    ))
}

/// The depthwise convolution as one grouped convolution of Burn's (a group per channel).
pub fn depthwise_conv<B: Backend>(
    x: FloatTensor<B>,
    weight: FloatTensor<B>,
    stride: usize,
) -> FloatTensor<B> {
    let kernel = weight.shape().dims::<4>()[2];
    let channels = x.shape().dims::<4>()[1];
    burn_conv_same::<B>(x, weight, None, kernel, stride, channels)
}

pub fn conv_same_backward<B: SsdBackend>(
    x: FloatTensor<B>,
    weight: FloatTensor<B>,
    grad: FloatTensor<B>,
    stride: usize,
    depthwise: bool,
    wanted: ConvGradsWanted,
) -> ConvGrads<B> {
    let bias = wanted.bias.then(|| {
        let grad = tensor::<B, 4>(grad.clone());
        let channels = grad.dims()[1];
        prim(channel_sums(grad).reshape([channels]))
    });
    let (x, weight) = if depthwise {
        B::depthwise_conv_backward(x, weight, grad, stride, wanted.x)
    } else {
        dense_grads::<B>(x, weight, grad, stride, wanted.x)
    };
    ConvGrads { x, weight, bias }
}

/// Whether a dense convolution is a 1x1 one of stride 1, which [`pointwise`] computes: most
/// of MobileNet's arithmetic (the pointwise layers, the heads, half the extra layers).
fn is_pointwise(kernel: usize, stride: usize) -> bool {
    kernel == 1 && stride == 1
}

/// A dense 1x1 convolution of stride 1 as a matrix product, `weight [out, in]` times each
/// image's `[in, h w]` (the filter broadcast over the batch). Burn's GPU backends without
/// autotuning run a convolution as a direct kernel and its input gradient as a direct
/// transposed convolution: measured on lavapipe, seconds per layer where a matrix product
/// takes milliseconds.
fn pointwise<B: Backend>(
    x: FloatTensor<B>,
    weight: FloatTensor<B>,
    bias: Option<FloatTensor<B>>,
) -> FloatTensor<B> {
    let [batch, channels, h, w] = x.shape().dims();
    let out = weight.shape().dims::<4>()[0];
    let x = tensor::<B, 4>(x).reshape([batch, channels, h * w]);
    let y = tensor::<B, 4>(weight).reshape([1, out, channels]).matmul(x);
    let y = match bias {
        Some(bias) => y + tensor::<B, 1>(bias).reshape([1, out, 1]),
        None => y,
    };
    prim(y.reshape([batch, out, h, w]))
}

/// The input (when `want_x`) and filter gradients of [`pointwise`]: `weight^T grad` per
/// image, and `grad x^T` summed over the images.
fn pointwise_grads<B: Backend>(
    x: FloatTensor<B>,
    weight: FloatTensor<B>,
    grad: FloatTensor<B>,
    want_x: bool,
) -> (Option<FloatTensor<B>>, FloatTensor<B>) {
    let [batch, channels, h, w] = x.shape().dims();
    let out = weight.shape().dims::<4>()[0];
    let grad = tensor::<B, 4>(grad).reshape([batch, out, h * w]);
    let dx = want_x.then(|| {
        let weight = tensor::<B, 4>(weight).reshape([1, out, channels]);
        prim(
            weight
                .transpose()
                .matmul(grad.clone())
                .reshape([batch, channels, h, w]),
        )
    });
    let x = tensor::<B, 4>(x).reshape([batch, channels, h * w]);
    let per_image = grad.matmul(x.transpose());
    // a sum over one image would be a kernel that copies
    let dweight = if batch == 1 {
        per_image
    } else {
        per_image.sum_dim(0)
    };
    (dx, prim(dweight.reshape([out, channels, 1, 1])))
}

/// The input (when `want_x`) and filter gradients of a dense convolution: [`pointwise_grads`]
/// for a 1x1 one of stride 1, else [`SsdBackend::conv_input_grad`] and Burn's filter gradient.
fn dense_grads<B: SsdBackend>(
    x: FloatTensor<B>,
    weight: FloatTensor<B>,
    grad: FloatTensor<B>,
    stride: usize,
    want_x: bool,
) -> (Option<FloatTensor<B>>, FloatTensor<B>) {
    let [batch, in_channels, h, w] = x.shape().dims();
    let kernel = weight.shape().dims::<4>()[2];
    if is_pointwise(kernel, stride) {
        return pointwise_grads::<B>(x, weight, grad, want_x);
    }
    let same = Same::new(&x, kernel, stride, 1);
    let input = same.input::<B>(x);
    let dx = want_x.then(|| {
        let [_, _, rows, cols] = input.shape().dims();
        let padding = same.options.padding;
        let dx = B::conv_input_grad(weight.clone(), grad.clone(), [rows, cols], stride, padding);
        if same.folded() {
            return dx;
        }
        let (left, _, top, _) = same.pads;
        prim(tensor::<B, 4>(dx).slice([0..batch, 0..in_channels, top..top + h, left..left + w]))
    });
    let dweight = B::conv2d_weight_backward(input, weight, grad, same.options);
    (dx, dweight)
}

/// The options of the transposed convolution of `grad` by `weight` that is the input
/// gradient of a dense convolution of an input of `size` (see
/// [`SsdBackend::conv_input_grad`]): `padding_out` restores the last rows and columns that
/// the forward convolution's stride left unread.
pub fn input_grad_options(
    weight: &impl TensorMetadata,
    grad: &impl TensorMetadata,
    size: [usize; 2],
    stride: usize,
    padding: [usize; 2],
) -> ConvTransposeOptions<2> {
    let kernel = weight.shape().dims::<4>()[2];
    let [_, _, rows, cols] = grad.shape().dims();
    let padding_out = |size: usize, out: usize, pad: usize| {
        calculate_padding_out(kernel, stride, pad, 1, size, out)
    };
    ConvTransposeOptions::new(
        [stride, stride],
        padding,
        [
            padding_out(size[0], rows, padding[0]),
            padding_out(size[1], cols, padding[1]),
        ],
        [1, 1],
        1,
    )
}

/// The input (when `want_x`) and filter gradients of a depthwise convolution, each one
/// whole-tensor convolution whatever the channel count, with the SAME pads folded into it
/// (no padded copy of the input). Burn's grouped gradients loop over the channels on its GPU
/// backends instead: a slice, a convolution and a slice assignment per channel, thousands of
/// kernel launches a step.
pub fn depthwise_grads<B: Backend>(
    x: FloatTensor<B>,
    weight: FloatTensor<B>,
    grad: FloatTensor<B>,
    stride: usize,
    want_x: bool,
) -> (Option<FloatTensor<B>>, FloatTensor<B>) {
    let [_, _, h, w] = x.shape().dims();
    let kernel = weight.shape().dims::<4>()[2];
    let dx = want_x.then(|| depthwise_input_grad::<B>(weight, grad.clone(), [h, w], stride));
    let dweight = depthwise_filter_grad::<B>(tensor(x), tensor(grad), kernel, stride);
    (dx, prim(dweight))
}

/// The input gradient of a depthwise convolution of an input `size` (`[h, w]`): the grouped
/// transposed convolution of the output gradient, which covers the padded input; cropping
/// the top / left pads from both ends leaves the bottom / right pad's surplus to cut off, or a
/// last row / column that no output read (a 1x1 filter of stride 2 on an even size) to add
/// as `padding_out`.
fn depthwise_input_grad<B: Backend>(
    weight: FloatTensor<B>,
    grad: FloatTensor<B>,
    size: [usize; 2],
    stride: usize,
) -> FloatTensor<B> {
    let [batch, channels, rows, cols] = grad.shape().dims();
    let kernel = weight.shape().dims::<4>()[2];
    // the transposed convolution's size cropped by `before` at both ends: `(before, size)`
    let cropped = |input, out: usize| {
        let (_, before, _) = same_padding(input, kernel, stride);
        (before, (out - 1) * stride + kernel - 2 * before)
    };
    let ((top, height), (left, width)) = (cropped(size[0], rows), cropped(size[1], cols));
    let options = ConvTransposeOptions::new(
        [stride, stride],
        [top, left],
        [
            size[0].saturating_sub(height),
            size[1].saturating_sub(width),
        ],
        [1, 1],
        channels,
    );
    let dx = tensor::<B, 4>(B::conv_transpose2d(grad, weight, None, options));
    if height <= size[0] && width <= size[1] {
        return prim(dx);
    }
    prim(dx.slice([0..batch, 0..channels, 0..size[0], 0..size[1]]))
}

/// The filter gradient of a depthwise convolution, tap `(ky, kx)` of channel `c` being
/// `sum over n, i, j of padded[n, c, ky + stride i, kx + stride j] grad[n, c, i, j]`: one
/// grouped convolution with a group per channel, whose input channels are that channel's
/// images, whose filter is that channel's output gradients (dilated by the stride) and whose
/// output is the channel's taps. Its padding is the larger SAME pad on every side, so the
/// taps start `after - before` rows / columns in. Both operands are laid out channels last
/// (the images of a channel next to each other), the order Burn's GPU convolution reads, so
/// that it copies neither again.
fn depthwise_filter_grad<B: Backend>(
    x: Tensor<B, 4>,
    grad: Tensor<B, 4>,
    kernel: usize,
    stride: usize,
) -> Tensor<B, 4> {
    let [batch, channels, h, w] = x.dims();
    let [_, _, rows, cols] = grad.dims();
    // `(padding, first tap)` of one dimension
    let pads = |size| {
        let (_, before, after) = same_padding(size, kernel, stride);
        (after, after - before)
    };
    let ((pad_y, top), (pad_x, left)) = (pads(h), pads(w));
    let images = x
        .permute([2, 3, 1, 0])
        .reshape([1, h, w, channels * batch])
        .permute([0, 3, 1, 2]);
    let filters = grad
        .permute([1, 2, 3, 0])
        .reshape([channels, rows * cols * batch])
        .reshape([channels, rows, cols, batch])
        .permute([0, 3, 1, 2]);
    let options = ConvOptions::new([1, 1], [pad_y, pad_x], [stride, stride], channels);
    conv2d(images, filters, None, options)
        .slice([0..1, 0..channels, top..top + kernel, left..left + kernel])
        .reshape([channels, 1, kernel, kernel])
}

/// The sum over the batch and space of each channel, `[1, c, 1, 1]`: one reduction over the
/// whole tensor (each image's planes) and, for more than one image, one over the batch's
/// partial sums, where `sum_dims(&[0, 2, 3])` makes three passes, each a kernel of its own on
/// a GPU (a sum over a batch of one would be a kernel that copies).
fn channel_sums<B: Backend>(x: Tensor<B, 4>) -> Tensor<B, 4> {
    channel_reduction(x, |t, dim| t.sum_dim(dim))
}

/// The mean over the batch and space of each channel, `[1, c, 1, 1]`, as [`channel_sums`]
/// reduces: a reduction computes the mean itself, where a sum divided by the count would
/// take one more kernel (a per-channel operation does not join the element-wise kernels
/// around it, which run over whole tensors).
fn channel_means<B: Backend>(x: Tensor<B, 4>) -> Tensor<B, 4> {
    channel_reduction(x, |t, dim| t.mean_dim(dim))
}

/// `reduce` over each image's planes, then over the batch when it has more than one image.
fn channel_reduction<B: Backend>(
    x: Tensor<B, 4>,
    reduce: impl Fn(Tensor<B, 3>, usize) -> Tensor<B, 3>,
) -> Tensor<B, 4> {
    let [batch, channels, h, w] = x.dims();
    let per_image = reduce(x.reshape([batch, channels, h * w]), 2);
    let all = if batch > 1 {
        reduce(per_image, 0)
    } else {
        per_image
    };
    all.reshape([1, channels, 1, 1])
}

fn per_channel<B: Backend>(t: FloatTensor<B>) -> Tensor<B, 4> {
    let t = tensor::<B, 1>(t);
    let c = t.dims()[0];
    t.reshape([1, c, 1, 1])
}

/// `gamma / sqrt(variance + epsilon)` per channel and its second factor, `1 / sqrt(variance +
/// epsilon)`, formed together: per-channel operations in a row make one GPU kernel.
fn scale_and_inv_std<B: Backend>(
    variance: Tensor<B, 4>,
    gamma: FloatTensor<B>,
    epsilon: f64,
) -> (Tensor<B, 4>, Tensor<B, 4>) {
    let inv_std = variance.add_scalar(epsilon).sqrt().recip();
    (inv_std.clone() * per_channel(gamma), inv_std)
}

pub fn batch_norm_relu6<B: Backend>(
    x: FloatTensor<B>,
    gamma: FloatTensor<B>,
    beta: FloatTensor<B>,
    epsilon: f64,
) -> BatchNormOutput<B> {
    let x = tensor::<B, 4>(x);
    let channels = x.dims()[1];
    let mean = channel_means(x.clone());
    let centred = x - mean.clone();
    let variance = channel_means(centred.clone().square());
    let (scale, _) = scale_and_inv_std(variance.clone(), gamma, epsilon);
    let y = (centred * scale + per_channel(beta)).clamp(0.0, 6.0);
    BatchNormOutput {
        y: prim(y),
        mean: prim(mean.reshape([channels])),
        variance: prim(variance.reshape([channels])),
    }
}

/// The gradients of [`batch_norm_relu6`] in four GPU kernels besides the two channel sums:
/// the per-channel factors; `dz` and `dz x_hat`; the sums; `dx` as
/// `(count dz - sum dz - x_hat sum(dz x_hat)) scale / count`, where the textbook
/// `(dz - mean dz - x_hat mean(dz x_hat)) scale` would divide per channel between the sums
/// and the element-wise kernel.
pub fn batch_norm_relu6_backward<B: Backend>(
    x: FloatTensor<B>,
    grad: FloatTensor<B>,
    gamma: FloatTensor<B>,
    beta: FloatTensor<B>,
    mean: FloatTensor<B>,
    variance: FloatTensor<B>,
    epsilon: f64,
) -> BatchNormGrads<B> {
    let (x, grad) = (tensor::<B, 4>(x), tensor::<B, 4>(grad));
    let [batch, channels, h, w] = x.dims();
    let count = (batch * h * w) as f64;
    let (scale, inv_std) = scale_and_inv_std(per_channel(variance), gamma, epsilon);
    let dx_factor = scale.clone().div_scalar(count);
    let centred = x - per_channel(mean);
    // ReLU6's input, as the forward pass computes it; two masks rather than one of their
    // union: a GPU backend's fusion takes comparisons and masked fills into the element-wise
    // kernel around them, but not a boolean `or`
    let z = centred.clone() * scale + per_channel(beta);
    let dz = grad
        .mask_fill(z.clone().lower_equal_elem(0.0), 0.0)
        .mask_fill(z.greater_equal_elem(6.0), 0.0);
    let x_hat = centred * inv_std;
    // formed before either sum, so that it joins the element-wise kernel that forms `dz`
    let dz_x_hat = dz.clone() * x_hat.clone();
    let dbeta = channel_sums(dz.clone());
    let dgamma = channel_sums(dz_x_hat);
    let dx = (dz.mul_scalar(count) - dbeta.clone() - x_hat * dgamma.clone()) * dx_factor;
    BatchNormGrads {
        x: prim(dx),
        gamma: prim(dgamma.reshape([channels])),
        beta: prim(dbeta.reshape([channels])),
    }
}

/// [`SsdBackend::depthwise_between_batch_norms`] as the three operations one after the other.
pub fn depthwise_between_batch_norms<B: SsdBackend>(
    x: FloatTensor<B>,
    [gamma, beta]: [FloatTensor<B>; 2],
    (weight, stride): (FloatTensor<B>, usize),
    [gamma_after, beta_after]: [FloatTensor<B>; 2],
    [epsilon, epsilon_after]: [f64; 2],
) -> DepthwiseBetweenOutput<B> {
    let first = B::batch_norm_relu6(x, gamma, beta, epsilon);
    let conv = B::conv_same(first.y, weight, None, stride, true);
    let second = B::batch_norm_relu6(conv.clone(), gamma_after, beta_after, epsilon_after);
    DepthwiseBetweenOutput {
        y: second.y,
        conv,
        stats: [first.mean, first.variance, second.mean, second.variance],
    }
}

/// [`SsdBackend::depthwise_between_batch_norms_backward`] as the three backward passes one
/// after the other, the first BatchNorm's output recomputed from its batch statistics.
pub fn depthwise_between_batch_norms_backward<B: SsdBackend>(
    (x, conv, grad): (FloatTensor<B>, FloatTensor<B>, FloatTensor<B>),
    [gamma, beta, mean, variance]: [FloatTensor<B>; 4],
    (weight, stride): (FloatTensor<B>, usize),
    [gamma_after, beta_after, mean_after, variance_after]: [FloatTensor<B>; 4],
    [epsilon, epsilon_after]: [f64; 2],
) -> DepthwiseBetweenGrads<B> {
    let second = B::batch_norm_relu6_backward(
        conv,
        grad,
        gamma_after,
        beta_after,
        mean_after,
        variance_after,
        epsilon_after,
    );
    let inv_std = tensor::<B, 1>(variance.clone())
        .add_scalar(epsilon)
        .sqrt()
        .recip();
    let scale = inv_std * tensor::<B, 1>(gamma.clone());
    let shift = tensor::<B, 1>(beta.clone()) - tensor::<B, 1>(mean.clone()) * scale.clone();
    let normalised = B::affine_relu6(x.clone(), prim(scale), prim(shift));
    let wanted = ConvGradsWanted {
        x: true,
        bias: false,
    };
    let conv = B::conv_same_backward(normalised, weight, second.x, stride, true, wanted);
    let dy = conv.x.expect("the input gradient was asked for");
    let first = B::batch_norm_relu6_backward(x, dy, gamma, beta, mean, variance, epsilon);
    DepthwiseBetweenGrads {
        x: first.x,
        before: [first.gamma, first.beta],
        weight: conv.weight,
        after: [second.gamma, second.beta],
    }
}

pub fn affine_relu6<B: Backend>(
    x: FloatTensor<B>,
    scale: FloatTensor<B>,
    shift: FloatTensor<B>,
) -> FloatTensor<B> {
    let x = tensor::<B, 4>(x);
    prim((x * per_channel(scale) + per_channel(shift)).clamp(0.0, 6.0))
}

/// `x` as a one-dimensional tensor of all its values.
fn flat<B: Backend>(x: FloatTensor<B>) -> Tensor<B, 1> {
    let n = x.shape().num_elements();
    tensor(B::float_reshape(x, [n].into()))
}

pub fn sigmoid_cross_entropy<B: Backend>(
    logits: FloatTensor<B>,
    labels: FloatTensor<B>,
) -> FloatTensor<B> {
    let (x, z) = (tensor::<B, 3>(logits), tensor::<B, 3>(labels));
    let [batch, anchors, _] = x.dims();
    let softplus_neg_abs = x.clone().abs().neg().exp().log1p();
    let per_class = x.clone().clamp_min(0.0) - x * z + softplus_neg_abs;
    prim(per_class.sum_dim(2).reshape([batch, anchors]))
}

pub fn sigmoid_cross_entropy_backward<B: Backend>(
    logits: FloatTensor<B>,
    labels: FloatTensor<B>,
    grad: FloatTensor<B>,
) -> FloatTensor<B> {
    let (x, z) = (tensor::<B, 3>(logits), tensor::<B, 3>(labels));
    let grad = tensor::<B, 2>(grad).unsqueeze_dim::<3>(2);
    prim((burn::tensor::activation::sigmoid(x) - z) * grad)
}

pub fn channels_last<B: Backend>(x: FloatTensor<B>) -> FloatTensor<B> {
    prim(tensor::<B, 4>(x).permute([0, 2, 3, 1]))
}

pub fn channels_first<B: Backend>(x: FloatTensor<B>) -> FloatTensor<B> {
    prim(tensor::<B, 4>(x).permute([0, 3, 1, 2]))
}

pub fn half_squared_norm<B: Backend>(x: FloatTensor<B>) -> FloatTensor<B> {
    prim(flat::<B>(x).square().sum().mul_scalar(0.5))
}

pub fn add_scaled<B: Backend>(x: FloatTensor<B>, y: FloatTensor<B>, alpha: f32) -> FloatTensor<B> {
    B::float_add(x, B::float_mul_scalar(y, alpha.into()))
}

// The two updates below work on the primitives, whatever their rank, with no reshape: a
// reshape of a weight between its update and its average keeps a fusion backend from
// joining the two into one kernel.

pub fn rmsprop_update<B: Backend>(
    state: RmsPropState<B>,
    grad: FloatTensor<B>,
    step: RmsPropStep,
) -> RmsPropState<B> {
    let RmsPropState {
        weights,
        mean_square,
        momentum,
    } = state;
    let square = B::float_powi_scalar(grad.clone(), 2.into());
    let ms = B::float_add(
        B::float_mul_scalar(mean_square, step.decay.into()),
        B::float_mul_scalar(square, (1.0 - step.decay).into()),
    );
    let root = B::float_sqrt(B::float_add_scalar(ms.clone(), step.epsilon.into()));
    let mom = B::float_add(
        B::float_mul_scalar(momentum, step.momentum.into()),
        B::float_div(B::float_mul_scalar(grad, step.learning_rate.into()), root),
    );
    RmsPropState {
        weights: B::float_sub(weights, mom.clone()),
        mean_square: ms,
        momentum: mom,
    }
}

pub fn moving_average<B: Backend>(
    average: FloatTensor<B>,
    value: FloatTensor<B>,
    scale: f32,
    keep: f32,
) -> FloatTensor<B> {
    let value = match scale {
        1.0 => value,
        _ => B::float_mul_scalar(value, scale.into()),
    };
    let step = B::float_mul_scalar(B::float_sub(average.clone(), value), (1.0 - keep).into());
    B::float_sub(average, step)
}
