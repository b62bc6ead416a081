//! [`SsdBackend`] for `Autodiff<B>`: each operation is one graph node whose backward pass is
//! the inner backend's backward operation.

use burn::backend::Autodiff;
use burn::backend::autodiff::checkpoint::base::Checkpointer;
use burn::backend::autodiff::checkpoint::strategy::CheckpointStrategy;
use burn::backend::autodiff::grads::Gradients;
use burn::backend::autodiff::ops::{Backward, Ops, OpsKind};
use burn::tensor::backend::AutodiffBackend;
use burn::tensor::ops::FloatTensor;

use super::{BatchNormOutput, ConvGradsWanted, DepthwiseBetweenOutput, SsdBackend};

/// What a convolution's backward pass needs: input, filters, stride, depthwise.
type ConvState<B> = (FloatTensor<B>, FloatTensor<B>, usize, bool);

/// A convolution node: `N = 3` with a bias (parents x, weight, bias), `N = 2` without.
#[derive(Debug)]
struct ConvSame<const N: usize>;

impl<B: SsdBackend, const N: usize> Backward<B, N> for ConvSame<N> {
    type State = ConvState<B>;

    fn backward(self, ops: Ops<Self::State, N>, grads: &mut Gradients, _: &mut Checkpointer) {
        let grad = grads.consume::<B>(&ops.node);
        let (x, weight, stride, depthwise) = ops.state;
        // an untracked input (the images) needs no gradient
        let wanted = ConvGradsWanted {
            x: ops.parents[0].is_some(),
            bias: N == 3,
        };
        let out = B::conv_same_backward(x, weight, grad, stride, depthwise, wanted);
        for (node, value) in ops
            .parents
            .into_iter()
            .zip([out.x, Some(out.weight), out.bias])
        {
            if let (Some(node), Some(value)) = (node, value) {
                grads.register::<B>(node.id, value);
            }
        }
    }
}

/// Input, gamma, beta, mean, variance and epsilon of a BatchNorm + ReLU6.
type BatchNormState<B> = (
    FloatTensor<B>,
    FloatTensor<B>,
    FloatTensor<B>,
    FloatTensor<B>,
    FloatTensor<B>,
    f64,
);

#[derive(Debug)]
struct BatchNormRelu6;

impl<B: SsdBackend> Backward<B, 3> for BatchNormRelu6 {
    type State = BatchNormState<B>;

    fn backward(self, ops: Ops<Self::State, 3>, grads: &mut Gradients, _: &mut Checkpointer) {
        let [node_x, node_gamma, node_beta] = ops.parents;
        let grad = grads.consume::<B>(&ops.node);
        let (x, gamma, beta, mean, variance, epsilon) = ops.state;
        let out = B::batch_norm_relu6_backward(x, grad, gamma, beta, mean, variance, epsilon);
        for (node, value) in [
            (node_x, out.x),
            (node_gamma, out.gamma),
            (node_beta, out.beta),
        ] {
            if let Some(node) = node {
                grads.register::<B>(node.id, value);
            }
        }
    }
}

/// What a [`DepthwiseBetweenBatchNorms`] node's backward pass needs: the input and the
/// convolution's output; the first BatchNorm's `[gamma, beta, mean, variance]`; filters and
/// stride; the second BatchNorm's; both epsilons.
type DepthwiseBetweenState<B> = (
    [FloatTensor<B>; 2],
    [FloatTensor<B>; 4],
    (FloatTensor<B>, usize),
    [FloatTensor<B>; 4],
    [f64; 2],
);

/// A BatchNorm + ReLU6, depthwise convolution, BatchNorm + ReLU6 node (parents x, gamma,
/// beta, filters, gamma, beta).
#[derive(Debug)]
struct DepthwiseBetweenBatchNorms;

impl<B: SsdBackend> Backward<B, 6> for DepthwiseBetweenBatchNorms {
    type State = DepthwiseBetweenState<B>;

    fn backward(self, ops: Ops<Self::State, 6>, grads: &mut Gradients, _: &mut Checkpointer) {
        let grad = grads.consume::<B>(&ops.node);
        let ([x, conv], before, weight, after, epsilon) = ops.state;
        let out = B::depthwise_between_batch_norms_backward(
            (x, conv, grad),
            before,
            weight,
            after,
            epsilon,
        );
        let [gamma, beta] = out.before;
        let [gamma_after, beta_after] = out.after;
        let values = [out.x, gamma, beta, out.weight, gamma_after, beta_after];
        for (node, value) in ops.parents.into_iter().zip(values) {
            if let Some(node) = node {
                grads.register::<B>(node.id, value);
            }
        }
    }
}

/// Sigmoid cross-entropy summed over classes; the labels (the state's second tensor) are
/// constants.
#[derive(Debug)]
struct SigmoidCrossEntropy;

impl<B: SsdBackend> Backward<B, 1> for SigmoidCrossEntropy {
    type State = (FloatTensor<B>, FloatTensor<B>);

    fn backward(self, ops: Ops<Self::State, 1>, grads: &mut Gradients, _: &mut Checkpointer) {
        let grad = grads.consume::<B>(&ops.node);
        let [parent] = ops.parents;
        if let Some(node) = parent {
            let (logits, labels) = ops.state;
            let value = B::sigmoid_cross_entropy_backward(logits, labels, grad);
            grads.register::<B>(node.id, value);
        }
    }
}

/// An NCHW to NHWC reordering; its backward pass reorders the gradient back.
#[derive(Debug)]
struct ChannelsLast;

impl<B: SsdBackend> Backward<B, 1> for ChannelsLast {
    type State = ();

    fn backward(self, ops: Ops<Self::State, 1>, grads: &mut Gradients, _: &mut Checkpointer) {
        let grad = grads.consume::<B>(&ops.node);
        let [parent] = ops.parents;
        if let Some(node) = parent {
            grads.register::<B>(node.id, B::channels_first(grad));
        }
    }
}

impl<B: SsdBackend, C: CheckpointStrategy> SsdBackend for Autodiff<B, C> {
    fn on_compute_thread<R: Send>(f: impl FnOnce() -> R + Send) -> R {
        B::on_compute_thread(f)
    }

    fn copies_device_to_device() -> bool {
        B::copies_device_to_device()
    }

    /// The inner backend's, with no graph: an update (BatchNorm's moving statistics) has no
    /// gradient, and the generic version would record its element-wise operations.
    fn moving_average(
        average: FloatTensor<Self>,
        value: FloatTensor<Self>,
        scale: f32,
        keep: f32,
    ) -> FloatTensor<Self> {
        Self::from_inner(B::moving_average(
            Self::inner(average),
            Self::inner(value),
            scale,
            keep,
        ))
    }

    fn sigmoid_cross_entropy(
        logits: FloatTensor<Self>,
        labels: FloatTensor<Self>,
    ) -> FloatTensor<Self> {
        let out = B::sigmoid_cross_entropy(logits.primitive.clone(), labels.primitive.clone());
        match SigmoidCrossEntropy
            .prepare::<C>([logits.node])
            .compute_bound()
            .stateful()
        {
            OpsKind::Tracked(prep) => prep.finish((logits.primitive, labels.primitive), out),
            OpsKind::UnTracked(prep) => prep.finish(out),
        }
    }

    fn channels_last(x: FloatTensor<Self>) -> FloatTensor<Self> {
        let out = B::channels_last(x.primitive);
        ChannelsLast
            .prepare::<C>([x.node])
            .compute_bound()
            .stateless(out)
    }

    fn conv_same(
        x: FloatTensor<Self>,
        weight: FloatTensor<Self>,
        bias: Option<FloatTensor<Self>>,
        stride: usize,
        depthwise: bool,
    ) -> FloatTensor<Self> {
        let state = (
            x.primitive.clone(),
            weight.primitive.clone(),
            stride,
            depthwise,
        );
        match bias {
            Some(bias) => {
                let out = B::conv_same(
                    x.primitive,
                    weight.primitive,
                    Some(bias.primitive),
                    stride,
                    depthwise,
                );
                match ConvSame::<3>
                    .prepare::<C>([x.node, weight.node, bias.node])
                    .compute_bound()
                    .stateful()
                {
                    OpsKind::Tracked(prep) => prep.finish(state, out),
                    OpsKind::UnTracked(prep) => prep.finish(out),
                }
            }
            None => {
                let out = B::conv_same(x.primitive, weight.primitive, None, stride, depthwise);
                match ConvSame::<2>
                    .prepare::<C>([x.node, weight.node])
                    .compute_bound()
                    .stateful()
                {
                    OpsKind::Tracked(prep) => prep.finish(state, out),
                    OpsKind::UnTracked(prep) => prep.finish(out),
                }
            }
        }
    }

    fn batch_norm_relu6(
        x: FloatTensor<Self>,
        gamma: FloatTensor<Self>,
        beta: FloatTensor<Self>,
        epsilon: f64,
    ) -> BatchNormOutput<Self> {
        let inner = B::batch_norm_relu6(
            x.primitive.clone(),
            gamma.primitive.clone(),
            beta.primitive.clone(),
            epsilon,
        );
        let state = (
            x.primitive,
            gamma.primitive,
            beta.primitive,
            inner.mean.clone(),
            inner.variance.clone(),
            epsilon,
        );
        let y = match BatchNormRelu6
            .prepare::<C>([x.node, gamma.node, beta.node])
            .compute_bound()
            .stateful()
        {
            OpsKind::Tracked(prep) => prep.finish(state, inner.y),
            OpsKind::UnTracked(prep) => prep.finish(inner.y),
        };
        BatchNormOutput {
            y,
            mean: Self::from_inner(inner.mean),
            variance: Self::from_inner(inner.variance),
        }
    }

    fn depthwise_between_batch_norms(
        x: FloatTensor<Self>,
        [gamma, beta]: [FloatTensor<Self>; 2],
        (weight, stride): (FloatTensor<Self>, usize),
        [gamma_after, beta_after]: [FloatTensor<Self>; 2],
        epsilon: [f64; 2],
    ) -> DepthwiseBetweenOutput<Self> {
        let inner = B::depthwise_between_batch_norms(
            x.primitive.clone(),
            [gamma.primitive.clone(), beta.primitive.clone()],
            (weight.primitive.clone(), stride),
            [gamma_after.primitive.clone(), beta_after.primitive.clone()],
            epsilon,
        );
        let [mean, variance, mean_after, variance_after] = inner.stats;
        let state = (
            [x.primitive, inner.conv.clone()],
            [
                gamma.primitive,
                beta.primitive,
                mean.clone(),
                variance.clone(),
            ],
            (weight.primitive, stride),
            [
                gamma_after.primitive,
                beta_after.primitive,
                mean_after.clone(),
                variance_after.clone(),
            ],
            epsilon,
        );
        let parents = [
            x.node,
            gamma.node,
            beta.node,
            weight.node,
            gamma_after.node,
            beta_after.node,
        ];
        let y = match DepthwiseBetweenBatchNorms
            .prepare::<C>(parents)
            .compute_bound()
            .stateful()
        {
            OpsKind::Tracked(prep) => prep.finish(state, inner.y),
            OpsKind::UnTracked(prep) => prep.finish(inner.y),
        };
        DepthwiseBetweenOutput {
            y,
            conv: Self::from_inner(inner.conv),
            stats: [mean, variance, mean_after, variance_after].map(Self::from_inner),
        }
    }
}
