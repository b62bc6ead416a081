//! [`SsdBackend`] for burn-flex: `f32` tensors go to the [`cpu`] kernels, other float types
//! to the [`reference`] operations.

use burn::backend::Flex;
use burn::backend::flex::FlexTensor;
use burn::tensor::ops::FloatTensor;
use burn::tensor::{DType, Shape, TensorData, TensorMetadata};

use super::cpu::{self, Conv, Epilogue};
use super::{
    BatchNormGrads, BatchNormOutput, ConvGrads, ConvGradsWanted, DepthwiseBetweenGrads,
    DepthwiseBetweenOutput, RmsPropState, RmsPropStep, SsdBackend, reference,
};

/// A tensor whose values are one contiguous run of its buffer: the tensor itself when they
/// already are (at any offset, as a view into a larger buffer such as a gradient bucket is;
/// [`values`] reads just that run), else a contiguous copy.
fn contiguous(t: &FlexTensor) -> FlexTensor {
    if t.layout().contiguous_offsets().is_some() {
        t.clone()
    } else {
        t.to_contiguous()
    }
}

/// `t`'s values in a buffer of exactly them that may be written: `t` itself when it is a
/// whole buffer nobody else holds, else a copy.
fn writable(t: FlexTensor) -> FlexTensor {
    let len = t.shape().num_elements();
    let whole = t.layout().contiguous_offsets() == Some((0, len));
    let mut t = if whole { t } else { t.to_contiguous() };
    if t.try_storage_mut::<f32>().is_none_or(|s| s.len() != len) {
        t = FlexTensor::from_data(t.into_data());
    }
    t
}

fn values(t: &FlexTensor) -> &[f32] {
    t.as_slice::<f32>()
        .expect("an f32 tensor made contiguous has a contiguous f32 slice")
}

fn output(values: Vec<f32>, shape: impl Into<Shape>) -> FlexTensor {
    FlexTensor::from_data(TensorData::new(values, shape.into()))
}

/// Each image of `x`, read as a `rows x cols` matrix (`[batch, rows, cols]`), transposed,
/// as a tensor of `shape`.
fn transposed_images(
    x: &FlexTensor,
    [batch, rows, cols]: [usize; 3],
    shape: [usize; 4],
) -> FlexTensor {
    let x = contiguous(x);
    output(
        cpu::batched_transpose(values(&x), [batch, rows, cols]),
        shape,
    )
}

fn all_f32(tensors: &[&FlexTensor]) -> bool {
    tensors.iter().all(|t| t.dtype() == DType::F32)
}

fn geometry(x: &FlexTensor, weight: &FlexTensor, stride: usize) -> Conv {
    let [out_channels, _, kernel, _] = weight.shape().dims();
    Conv::same(x.shape().dims(), out_channels, kernel, stride)
}

/// [`SsdBackend::conv_same`] of `f32` tensors on the CPU kernels, with `epilogue` applied to
/// each output plane as it is made.
fn convolution(
    x: &FlexTensor,
    weight: &FlexTensor,
    stride: usize,
    depthwise: bool,
    epilogue: Epilogue,
) -> FlexTensor {
    let g = geometry(x, weight, stride);
    let (x, weight) = (contiguous(x), contiguous(weight));
    let (x, weight) = (values(&x), values(&weight));
    let y = if depthwise {
        cpu::depthwise_forward(&g, x, weight, epilogue)
    } else {
        cpu::conv_forward(&g, x, weight, epilogue)
    };
    output(y, [g.batch, g.out_channels, g.out_height, g.out_width])
}

impl SsdBackend for Flex {
    fn on_compute_thread<R: Send>(f: impl FnOnce() -> R + Send) -> R {
        // on a pool thread already: in place; otherwise one hand-off for the whole block
        rayon::scope(|_| f())
    }

    fn conv_same(
        x: FloatTensor<Self>,
        weight: FloatTensor<Self>,
        bias: Option<FloatTensor<Self>>,
        stride: usize,
        depthwise: bool,
    ) -> FloatTensor<Self> {
        if !all_f32(&[&x, &weight]) || bias.as_ref().is_some_and(|b| b.dtype() != DType::F32) {
            return reference::conv_same::<Self>(x, weight, bias, stride, depthwise);
        }
        let bias = bias.map(|b| contiguous(&b));
        let epilogue = bias
            .as_ref()
            .map_or(Epilogue::None, |b| Epilogue::Bias(values(b)));
        convolution(&x, &weight, stride, depthwise, epilogue)
    }

    fn conv_affine_relu6(
        x: FloatTensor<Self>,
        (weight, stride, depthwise): (FloatTensor<Self>, usize, bool),
        [scale, shift]: [FloatTensor<Self>; 2],
    ) -> FloatTensor<Self> {
        if !all_f32(&[&x, &weight, &scale, &shift]) {
            let y = reference::conv_same::<Self>(x, weight, None, stride, depthwise);
            return reference::affine_relu6::<Self>(y, scale, shift);
        }
        let (scale, shift) = (contiguous(&scale), contiguous(&shift));
        let (scale, shift) = (values(&scale), values(&shift));
        let epilogue = Epilogue::AffineRelu6 { scale, shift };
        convolution(&x, &weight, stride, depthwise, epilogue)
    }

    fn conv_same_backward(
        x: FloatTensor<Self>,
        weight: FloatTensor<Self>,
        grad: FloatTensor<Self>,
        stride: usize,
        depthwise: bool,
        wanted: ConvGradsWanted,
    ) -> ConvGrads<Self> {
        if !all_f32(&[&x, &weight, &grad]) {
            return reference::conv_same_backward::<Self>(
                x, weight, grad, stride, depthwise, wanted,
            );
        }
        let g = geometry(&x, &weight, stride);
        let (x_shape, w_shape) = (x.shape(), weight.shape());
        let (x, weight, grad) = (contiguous(&x), contiguous(&weight), contiguous(&grad));
        let (dx, dw) = if depthwise {
            // one pass makes both (a depthwise layer's input is never an untracked image)
            let (dx, dw) = cpu::depthwise_backward(&g, values(&x), values(&weight), values(&grad));
            (wanted.x.then_some(dx), dw)
        } else {
            let (x, weight, grad) = (values(&x), values(&weight), values(&grad));
            cpu::conv_backward(&g, x, weight, grad, wanted.x)
        };
        let bias = wanted.bias.then(|| {
            let db = cpu::bias_grad(values(&grad), g.out_height * g.out_width, g.out_channels);
            output(db, [g.out_channels])
        });
        ConvGrads {
            x: dx.map(|dx| output(dx, x_shape)),
            weight: output(dw, w_shape),
            bias,
        }
    }

    fn batch_norm_relu6(
        x: FloatTensor<Self>,
        gamma: FloatTensor<Self>,
        beta: FloatTensor<Self>,
        epsilon: f64,
    ) -> BatchNormOutput<Self> {
        if !all_f32(&[&x, &gamma, &beta]) {
            return reference::batch_norm_relu6::<Self>(x, gamma, beta, epsilon);
        }
        let shape = x.shape();
        let [batch, channels, h, w] = shape.dims();
        let (x, gamma, beta) = (contiguous(&x), contiguous(&gamma), contiguous(&beta));
        let (y, mean, variance) = cpu::batch_norm_relu6(
            values(&x),
            [batch, h * w],
            values(&gamma),
            values(&beta),
            epsilon as f32,
        );
        BatchNormOutput {
            y: output(y, shape),
            mean: output(mean, [channels]),
            variance: output(variance, [channels]),
        }
    }

    fn batch_norm_relu6_backward(
        x: FloatTensor<Self>,
        grad: FloatTensor<Self>,
        gamma: FloatTensor<Self>,
        beta: FloatTensor<Self>,
        mean: FloatTensor<Self>,
        variance: FloatTensor<Self>,
        epsilon: f64,
    ) -> BatchNormGrads<Self> {
        if !all_f32(&[&x, &grad, &gamma, &beta, &mean, &variance]) {
            return reference::batch_norm_relu6_backward::<Self>(
                x, grad, gamma, beta, mean, variance, epsilon,
            );
        }
        let shape = x.shape();
        let [batch, channels, h, w] = shape.dims();
        let [x, grad, gamma, beta, mean, variance] =
            [&x, &grad, &gamma, &beta, &mean, &variance].map(contiguous);
        let (dx, dgamma, dbeta) = cpu::batch_norm_relu6_backward(
            values(&x),
            values(&grad),
            [batch, h * w],
            [values(&gamma), values(&beta)],
            [values(&mean), values(&variance)],
            epsilon as f32,
        );
        BatchNormGrads {
            x: output(dx, shape),
            gamma: output(dgamma, [channels]),
            beta: output(dbeta, [channels]),
        }
    }

    fn depthwise_between_batch_norms(
        x: FloatTensor<Self>,
        before: [FloatTensor<Self>; 2],
        (weight, stride): (FloatTensor<Self>, usize),
        after: [FloatTensor<Self>; 2],
        epsilon: [f64; 2],
    ) -> DepthwiseBetweenOutput<Self> {
        let [b0, b1] = &before;
        let [a0, a1] = &after;
        if !all_f32(&[&x, b0, b1, &weight, a0, a1]) {
            return reference::depthwise_between_batch_norms::<Self>(
                x,
                before,
                (weight, stride),
                after,
                epsilon,
            );
        }
        let g = geometry(&x, &weight, stride);
        let [x, weight] = [&x, &weight].map(contiguous);
        let before = before.each_ref().map(contiguous);
        let after = after.each_ref().map(contiguous);
        let out = cpu::depthwise_between_batch_norms(
            &g,
            values(&x),
            (
                before.each_ref().map(values),
                values(&weight),
                after.each_ref().map(values),
            ),
            epsilon.map(|e| e as f32),
        );
        let shape = [g.batch, g.out_channels, g.out_height, g.out_width];
        DepthwiseBetweenOutput {
            y: output(out.y, shape),
            conv: output(out.conv, shape),
            stats: out.stats.map(|s| output(s, [g.in_channels])),
        }
    }

    fn depthwise_between_batch_norms_backward(
        (x, conv, grad): (FloatTensor<Self>, FloatTensor<Self>, FloatTensor<Self>),
        before: [FloatTensor<Self>; 4],
        (weight, stride): (FloatTensor<Self>, usize),
        after: [FloatTensor<Self>; 4],
        epsilon: [f64; 2],
    ) -> DepthwiseBetweenGrads<Self> {
        let tensors: Vec<&FlexTensor> = [&x, &conv, &grad, &weight]
            .into_iter()
            .chain(&before)
            .chain(&after)
            .collect();
        if !all_f32(&tensors) {
            return reference::depthwise_between_batch_norms_backward::<Self>(
                (x, conv, grad),
                before,
                (weight, stride),
                after,
                epsilon,
            );
        }
        let g = geometry(&x, &weight, stride);
        let (x_shape, w_shape) = (x.shape(), weight.shape());
        let [x, conv, grad, weight] = [&x, &conv, &grad, &weight].map(contiguous);
        let before = before.each_ref().map(contiguous);
        let after = after.each_ref().map(contiguous);
        let [dx, dgamma, dbeta, dweight, dgamma_after, dbeta_after] =
            cpu::depthwise_between_batch_norms_backward(
                &g,
                (values(&x), values(&conv), values(&grad)),
                (
                    (before.each_ref().map(values), epsilon[0] as f32),
                    values(&weight),
                    (after.each_ref().map(values), epsilon[1] as f32),
                ),
            );
        let channels = |v: Vec<f32>| output(v, [g.in_channels]);
        DepthwiseBetweenGrads {
            x: output(dx, x_shape),
            before: [channels(dgamma), channels(dbeta)],
            weight: output(dweight, w_shape),
            after: [channels(dgamma_after), channels(dbeta_after)],
        }
    }

    fn sigmoid_cross_entropy(
        logits: FloatTensor<Self>,
        labels: FloatTensor<Self>,
    ) -> FloatTensor<Self> {
        if !all_f32(&[&logits, &labels]) {
            return reference::sigmoid_cross_entropy::<Self>(logits, labels);
        }
        let [batch, anchors, classes] = logits.shape().dims();
        let (logits, labels) = (contiguous(&logits), contiguous(&labels));
        let loss = cpu::sigmoid_cross_entropy(values(&logits), values(&labels), classes);
        output(loss, [batch, anchors])
    }

    fn sigmoid_cross_entropy_backward(
        logits: FloatTensor<Self>,
        labels: FloatTensor<Self>,
        grad: FloatTensor<Self>,
    ) -> FloatTensor<Self> {
        if !all_f32(&[&logits, &labels, &grad]) {
            return reference::sigmoid_cross_entropy_backward::<Self>(logits, labels, grad);
        }
        let shape = logits.shape();
        let classes = shape.dims::<3>()[2];
        let [logits, labels, grad] = [&logits, &labels, &grad].map(contiguous);
        let d = cpu::sigmoid_cross_entropy_backward(
            values(&logits),
            values(&labels),
            values(&grad),
            classes,
        );
        output(d, shape)
    }

    fn half_squared_norm(x: FloatTensor<Self>) -> FloatTensor<Self> {
        if x.dtype() != DType::F32 {
            return reference::half_squared_norm::<Self>(x);
        }
        let x = contiguous(&x);
        output(vec![cpu::half_squared_norm(values(&x))], [1])
    }

    fn rmsprop_update(
        state: RmsPropState<Self>,
        grad: FloatTensor<Self>,
        step: RmsPropStep,
    ) -> RmsPropState<Self> {
        if !all_f32(&[&state.weights, &state.mean_square, &state.momentum, &grad]) {
            return reference::rmsprop_update::<Self>(state, grad, step);
        }
        let grad = contiguous(&grad);
        let [mut w, mut ms, mut mom] =
            [state.weights, state.mean_square, state.momentum].map(writable);
        cpu::rmsprop_update_in_place(
            [
                w.storage_mut::<f32>(),
                ms.storage_mut::<f32>(),
                mom.storage_mut::<f32>(),
            ],
            values(&grad),
            step,
        );
        RmsPropState {
            weights: w,
            mean_square: ms,
            momentum: mom,
        }
    }

    fn moving_average(
        average: FloatTensor<Self>,
        value: FloatTensor<Self>,
        scale: f32,
        keep: f32,
    ) -> FloatTensor<Self> {
        if !all_f32(&[&average, &value]) {
            return reference::moving_average::<Self>(average, value, scale, keep);
        }
        let value = contiguous(&value);
        let mut average = writable(average);
        cpu::moving_average_in_place(average.storage_mut::<f32>(), values(&value), scale, keep);
        average
    }

    fn add_scaled(x: FloatTensor<Self>, y: FloatTensor<Self>, alpha: f32) -> FloatTensor<Self> {
        if !all_f32(&[&x, &y]) || x.shape() != y.shape() {
            return reference::add_scaled::<Self>(x, y, alpha);
        }
        let y = contiguous(&y);
        let mut x = writable(x);
        cpu::add_scaled_in_place(x.storage_mut::<f32>(), values(&y), alpha);
        x
    }

    fn channels_last(x: FloatTensor<Self>) -> FloatTensor<Self> {
        if x.dtype() != DType::F32 {
            return reference::channels_last::<Self>(x);
        }
        let [batch, channels, h, w] = x.shape().dims();
        transposed_images(&x, [batch, channels, h * w], [batch, h, w, channels])
    }

    fn channels_first(x: FloatTensor<Self>) -> FloatTensor<Self> {
        if x.dtype() != DType::F32 {
            return reference::channels_first::<Self>(x);
        }
        let [batch, h, w, channels] = x.shape().dims();
        transposed_images(&x, [batch, h * w, channels], [batch, channels, h, w])
    }

    fn affine_relu6(
        x: FloatTensor<Self>,
        scale: FloatTensor<Self>,
        shift: FloatTensor<Self>,
    ) -> FloatTensor<Self> {
        if !all_f32(&[&x, &scale, &shift]) {
            return reference::affine_relu6::<Self>(x, scale, shift);
        }
        let [_, _, h, w] = x.shape().dims();
        let (scale, shift) = (contiguous(&scale), contiguous(&shift));
        // in place on the convolution's output at inference
        let mut y = writable(x);
        let values = y.storage_mut::<f32>();
        cpu::affine_relu6_in_place(values, h * w, self::values(&scale), self::values(&shift));
        y
    }
}
