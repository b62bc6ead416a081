//! This crate's kernels under Burn's fusion: each is registered in the fusion stream as a
//! custom operation, which the stream runs (after the fused element-wise kernels before it)
//! by calling the backend underneath on its tensors.

use std::marker::PhantomData;

use burn::tensor::TensorMetadata;
use burn::tensor::ops::FloatTensor;
use burn_fusion::stream::{Operation, OperationStreams};
use burn_fusion::{Fusion, FusionBackend, FusionRuntime};
use burn_ir::{CustomOpIr, HandleContainer, OperationIr, TensorIr};

use super::depthwise;
use crate::ops::{
    BatchNormGrads, BatchNormOutput, RmsPropState, RmsPropStep, SsdBackend, reference,
};

impl<B: FusionBackend + SsdBackend> SsdBackend for Fusion<B> {
    fn depthwise_conv(
        x: FloatTensor<Self>,
        weight: FloatTensor<Self>,
        stride: usize,
    ) -> FloatTensor<Self> {
        let kernel = weight.shape().dims::<4>()[2];
        let (out, _) = depthwise::geometry(&x.shape(), kernel, stride);
        let mut outputs = register::<B, 2>(
            "ssd_depthwise_conv",
            [x, weight],
            vec![out],
            Custom::DepthwiseConv { stride },
        );
        outputs.remove(0)
    }

    fn conv_input_grad(
        weight: FloatTensor<Self>,
        grad: FloatTensor<Self>,
        size: [usize; 2],
        stride: usize,
        padding: [usize; 2],
    ) -> FloatTensor<Self> {
        let batch = grad.shape().dims::<4>()[0];
        let channels = weight.shape().dims::<4>()[1];
        let shape = burn::tensor::Shape::new([batch, channels, size[0], size[1]]);
        let mut outputs = register::<B, 2>(
            "ssd_conv_input_grad",
            [weight, grad],
            vec![shape],
            Custom::ConvInputGrad {
                size,
                stride,
                padding,
            },
        );
        outputs.remove(0)
    }

    fn depthwise_conv_backward(
        x: FloatTensor<Self>,
        weight: FloatTensor<Self>,
        grad: FloatTensor<Self>,
        stride: usize,
        want_x: bool,
    ) -> (Option<FloatTensor<Self>>, FloatTensor<Self>) {
        let mut outputs = vec![weight.shape()];
        if want_x {
            outputs.push(x.shape());
        }
        let mut tensors = register::<B, 3>(
            "ssd_depthwise_conv_backward",
            [x, weight, grad],
            outputs,
            Custom::DepthwiseConvBackward { stride, want_x },
        );
        let dweight = tensors.remove(0);
        (tensors.pop(), dweight)
    }

    fn batch_norm_relu6(
        x: FloatTensor<Self>,
        gamma: FloatTensor<Self>,
        beta: FloatTensor<Self>,
        epsilon: f64,
    ) -> BatchNormOutput<Self> {
        let outputs = vec![x.shape(), gamma.shape(), gamma.shape()];
        let tensors = register::<B, 3>(
            "ssd_batch_norm_relu6",
            [x, gamma, beta],
            outputs,
            Custom::BatchNorm { epsilon },
        );
        let [y, mean, variance] = three(tensors);
        BatchNormOutput { y, mean, variance }
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
        let outputs = vec![x.shape(), gamma.shape(), gamma.shape()];
        let tensors = register::<B, 6>(
            "ssd_batch_norm_relu6_backward",
            [x, grad, gamma, beta, mean, variance],
            outputs,
            Custom::BatchNormBackward { epsilon },
        );
        let [x, gamma, beta] = three(tensors);
        BatchNormGrads { x, gamma, beta }
    }

    fn half_squared_norm(x: FloatTensor<Self>) -> FloatTensor<Self> {
        let one = burn::tensor::Shape::new([1]);
        let mut outputs = register::<B, 1>(
            "ssd_half_squared_norm",
            [x],
            vec![one],
            Custom::HalfSquaredNorm,
        );
        outputs.remove(0)
    }

    fn add_scaled(x: FloatTensor<Self>, y: FloatTensor<Self>, alpha: f32) -> FloatTensor<Self> {
        let shape = x.shape();
        if shape != y.shape() {
            return reference::add_scaled::<Self>(x, y, alpha);
        }
        let mut outputs = register::<B, 2>(
            "ssd_add_scaled",
            [x, y],
            vec![shape],
            Custom::AddScaled { alpha },
        );
        outputs.remove(0)
    }

    fn rmsprop_update(
        state: RmsPropState<Self>,
        grad: FloatTensor<Self>,
        step: RmsPropStep,
    ) -> RmsPropState<Self> {
        let shape = state.weights.shape();
        let [weights, mean_square, momentum] = state.into_array();
        let inputs = [weights, mean_square, momentum, grad];
        let outputs = vec![shape.clone(), shape.clone(), shape];
        let tensors = register::<B, 4>(
            "ssd_rmsprop_update",
            inputs,
            outputs,
            Custom::RmsProp { step },
        );
        RmsPropState::from_array(three(tensors))
    }

    fn moving_average(
        average: FloatTensor<Self>,
        value: FloatTensor<Self>,
        scale: f32,
        keep: f32,
    ) -> FloatTensor<Self> {
        let shape = average.shape();
        let mut outputs = register::<B, 2>(
            "ssd_moving_average",
            [average, value],
            vec![shape],
            Custom::MovingAverage { scale, keep },
        );
        outputs.remove(0)
    }

    fn copies_device_to_device() -> bool {
        B::copies_device_to_device()
    }
}

/// The three outputs of an operation that has three.
fn three<T>(tensors: Vec<T>) -> [T; 3] {
    let mut tensors = tensors.into_iter();
    let mut next = || tensors.next().expect("three outputs, as registered");
    [next(), next(), next()]
}

/// Registers the custom operation `name` on `inputs`, with outputs of the inputs' float type
/// and the given shapes; returns them in that order.
fn register<B: FusionBackend + SsdBackend, const N: usize>(
    name: &'static str,
    inputs: [FloatTensor<Fusion<B>>; N],
    outputs: Vec<burn::tensor::Shape>,
    custom: Custom,
) -> Vec<FloatTensor<Fusion<B>>> {
    let client = inputs[0].client.clone();
    let dtype = inputs[0].dtype;
    let streams = OperationStreams::with_inputs(&inputs);
    let outputs: Vec<TensorIr> = outputs
        .into_iter()
        .map(|shape| TensorIr::uninit(client.create_empty_handle(), shape, dtype))
        .collect();
    let inputs: Vec<TensorIr> = inputs.into_iter().map(|t| t.into_ir()).collect();
    let desc = CustomOpIr::new(name, &inputs, &outputs);
    client.register(
        streams,
        OperationIr::Custom(desc.clone()),
        CustomOp::<B> {
            desc,
            custom,
            backend: PhantomData,
        },
    )
}

/// Which of this crate's operations a [`CustomOp`] runs, with its arguments.
#[derive(Debug, Clone, Copy)]
enum Custom {
    /// [`SsdBackend::depthwise_conv`] of inputs `[x, weight]`.
    DepthwiseConv { stride: usize },
    /// [`SsdBackend::conv_input_grad`] of inputs `[weight, grad]`.
    ConvInputGrad {
        size: [usize; 2],
        stride: usize,
        padding: [usize; 2],
    },
    /// [`SsdBackend::depthwise_conv_backward`] of inputs `[x, weight, grad]`: outputs the
    /// filter gradient, then the input gradient when `want_x`.
    DepthwiseConvBackward { stride: usize, want_x: bool },
    /// [`SsdBackend::batch_norm_relu6`] of inputs `[x, gamma, beta]`: outputs `[y, mean,
    /// variance]`.
    BatchNorm { epsilon: f64 },
    /// [`SsdBackend::batch_norm_relu6_backward`] of inputs `[x, grad, gamma, beta, mean,
    /// variance]`: outputs the gradients of `[x, gamma, beta]`.
    BatchNormBackward { epsilon: f64 },
    /// [`SsdBackend::half_squared_norm`] of input `[x]`.
    HalfSquaredNorm,
    /// [`SsdBackend::add_scaled`] of inputs `[x, y]`.
    AddScaled { alpha: f32 },
    /// [`SsdBackend::rmsprop_update`] of inputs `[weights, mean_square, momentum, grad]`:
    /// outputs the new `[weights, mean_square, momentum]`.
    RmsProp { step: RmsPropStep },
    /// [`SsdBackend::moving_average`] of inputs `[average, value]`.
    MovingAverage { scale: f32, keep: f32 },
}

/// A custom operation in the fusion stream: runs [`Custom`] on the backend `B` underneath.
#[derive(Debug)]
struct CustomOp<B> {
    desc: CustomOpIr,
    custom: Custom,
    backend: PhantomData<fn() -> B>,
}

impl<B: FusionBackend + SsdBackend> Operation<B::FusionRuntime> for CustomOp<B> {
    fn execute(
        &self,
        handles: &mut HandleContainer<<B::FusionRuntime as FusionRuntime>::FusionHandle>,
    ) {
        let mut inputs = self
            .desc
            .inputs
            .iter()
            .map(|t| handles.get_float_tensor::<B>(t))
            .collect::<Vec<_>>()
            .into_iter();
        let mut input = || {
            inputs
                .next()
                .expect("the operation's inputs, as registered")
        };
        let outputs: Vec<FloatTensor<B>> = match self.custom {
            Custom::DepthwiseConv { stride } => {
                let (x, weight) = (input(), input());
                vec![B::depthwise_conv(x, weight, stride)]
            }
            Custom::ConvInputGrad {
                size,
                stride,
                padding,
            } => {
                let (weight, grad) = (input(), input());
                vec![B::conv_input_grad(weight, grad, size, stride, padding)]
            }
            Custom::DepthwiseConvBackward { stride, want_x } => {
                let (x, weight, grad) = (input(), input(), input());
                let (dx, dweight) = B::depthwise_conv_backward(x, weight, grad, stride, want_x);
                std::iter::once(dweight).chain(dx).collect()
            }
            Custom::BatchNorm { epsilon } => {
                let (x, gamma, beta) = (input(), input(), input());
                let out = B::batch_norm_relu6(x, gamma, beta, epsilon);
                vec![out.y, out.mean, out.variance]
            }
            Custom::BatchNormBackward { epsilon } => {
                let (x, grad, gamma, beta) = (input(), input(), input(), input());
                let (mean, variance) = (input(), input());
                let out =
                    B::batch_norm_relu6_backward(x, grad, gamma, beta, mean, variance, epsilon);
                vec![out.x, out.gamma, out.beta]
            }
            Custom::HalfSquaredNorm => vec![B::half_squared_norm(input())],
            Custom::AddScaled { alpha } => vec![B::add_scaled(input(), input(), alpha)],
            Custom::RmsProp { step } => {
                let state = RmsPropState::from_array([input(), input(), input()]);
                B::rmsprop_update(state, input(), step).into_array().into()
            }
            Custom::MovingAverage { scale, keep } => {
                vec![B::moving_average(input(), input(), scale, keep)]
            }
        };
        for (ir, tensor) in self.desc.outputs.iter().zip(outputs) {
            handles.register_float_tensor::<B>(&ir.id, tensor);
        }
    }
}
