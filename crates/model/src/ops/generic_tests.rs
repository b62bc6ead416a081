//! Every operation's generic version (the defaults built from Burn's tensor operations, which
//! CUDA and wgpu run) against the CPU kernels: burn-ndarray takes every default, burn-flex
//! overrides every one. Values and the gradients of `sum(y * upstream)` through `Autodiff`
//! for every input (so each backward default runs too), from the same host data.

use burn::backend::{Autodiff, Flex, NdArray};
use burn::tensor::Tensor;

use super::tests::{CONVS, ConvCase, assert_close, filter_shape};
use super::{
    RmsPropStep, SsdBackend, add_scaled, affine_relu6, batch_norm_relu6, channels_last,
    conv_affine_relu6, conv_same, depthwise_between_batch_norms, half_squared_norm, moving_average,
    rmsprop_update, sigmoid_cross_entropy,
};
use crate::test_data::uniform;

/// Values of the outputs, then of the gradients.
type Outcome = Vec<Vec<f32>>;

/// Reads one input's gradient.
type GradOf<'a, B> =
    &'a dyn Fn(&<Autodiff<B> as burn::tensor::backend::AutodiffBackend>::Gradients) -> Vec<f32>;

fn values<B: burn::tensor::backend::Backend, const D: usize>(t: Tensor<B, D>) -> Vec<f32> {
    t.into_data().convert::<f32>().to_vec().expect("f32 data")
}

/// A seeded input on backend `B`, tracked by autodiff.
fn input<B: SsdBackend, const D: usize>(
    shape: [usize; D],
    (scale, shift): (f32, f32),
    seed: u64,
) -> Tensor<Autodiff<B>, D> {
    uniform::<Autodiff<B>, D>(shape, (-1.0, 1.0), seed, &Default::default())
        .mul_scalar(scale)
        .add_scalar(shift)
        .require_grad()
}

/// `y`'s values and, for each of `inputs`, the gradient of `sum(y * upstream)`, with a
/// seeded upstream gradient.
fn outcome<B: SsdBackend, const D: usize, const N: usize>(
    outputs: Vec<Vec<f32>>,
    y: Tensor<Autodiff<B>, D>,
    inputs: [GradOf<B>; N],
    seed: u64,
) -> Outcome {
    let upstream = uniform::<Autodiff<B>, D>(y.dims(), (-1.0, 1.0), seed, &Default::default());
    let mut out = outputs;
    out.push(values(y.clone()));
    let grads = (y * upstream).sum().backward();
    out.extend(inputs.map(|grad| grad(&grads)));
    out
}

/// Where a case runs.
#[derive(Debug, Clone, Copy, PartialEq)]
enum On {
    /// burn-flex, the CPU kernels.
    Kernels,
    /// burn-ndarray, every default.
    Generic,
    /// burn-wgpu (with fusion), every default, where this machine has an adapter.
    #[cfg(feature = "wgpu")]
    Wgpu,
}

/// The backends compared with the CPU kernels.
fn generic_backends() -> Vec<On> {
    #[allow(unused_mut)]
    let mut on = vec![On::Generic];
    #[cfg(feature = "wgpu")]
    if std::env::var("WGPU_TESTS_REQUIRED").is_ok_and(|v| v == "1") {
        on.push(On::Wgpu);
    }
    on
}

/// The same case on the generic backends and on the CPU kernels.
fn compare(what: &str, case: impl Fn(On) -> Outcome, tolerance: f32) {
    let kernels = case(On::Kernels);
    for on in generic_backends() {
        let generic = case(on);
        assert_eq!(generic.len(), kernels.len(), "{what}");
        for (i, (g, k)) in generic.into_iter().zip(&kernels).enumerate() {
            assert_close(&format!("{what} on {on:?} [{i}]"), g, k.clone(), tolerance);
        }
    }
}

macro_rules! on_both {
    ($on:expr, $f:ident ( $($arg:expr),* )) => {
        match $on {
            On::Kernels => $f::<Flex>($($arg),*),
            On::Generic => $f::<NdArray>($($arg),*),
            #[cfg(feature = "wgpu")]
            On::Wgpu => $f::<burn::backend::Wgpu>($($arg),*),
        }
    };
}

fn conv_case<B: SsdBackend>(
    (shape, out, k, stride, depthwise, with_bias): ConvCase,
    seed: u64,
) -> Outcome {
    let w_shape = filter_shape(shape, out, k, depthwise);
    let x = input::<B, 4>(shape, (1.0, 0.0), seed);
    let w = input::<B, 4>(w_shape, (1.0, 0.0), seed + 1);
    let b = input::<B, 1>([w_shape[0]], (1.0, 0.0), seed + 2);
    let y = conv_same(
        x.clone(),
        w.clone(),
        with_bias.then(|| b.clone()),
        stride,
        depthwise,
    );
    let bias_grad = |g: &_| match with_bias {
        true => values(b.grad(g).expect("bias gradient")),
        false => Vec::new(),
    };
    outcome(
        Vec::new(),
        y,
        [
            &|g| values(x.grad(g).expect("input gradient")),
            &|g| values(w.grad(g).expect("filter gradient")),
            &bias_grad,
        ],
        seed + 3,
    )
}

#[test]
fn convolutions_and_their_gradients() {
    for (n, conv) in CONVS.iter().enumerate() {
        compare(
            &format!("conv {conv:?}"),
            |on| on_both!(on, conv_case(*conv, 1000 + 10 * n as u64)),
            1e-4,
        );
    }
}

/// The layer shapes of SSD-MobileNet-v1's backbone at 300x300 (each depthwise layer's input
/// size, channel count and stride, batch 2): the GPU kernels (`ops/cube`) against the CPU
/// kernels, forward and backward: the depthwise convolution, and BatchNorm + ReLU6 at its
/// input's and output's shapes (every BatchNorm of the backbone has one of them). Only on
/// wgpu: burn-ndarray's grouped convolutions take minutes at these sizes.
#[cfg(feature = "wgpu")]
#[test]
fn layers_of_the_pets_network_on_wgpu() {
    if !generic_backends().contains(&On::Wgpu) {
        eprintln!("skipped: WGPU_TESTS_REQUIRED=1 runs it (needs a Vulkan driver)");
        return;
    }
    let layers = [
        (150, 32, 1),
        (150, 64, 2),
        (75, 128, 1),
        (75, 128, 2),
        (38, 256, 1),
        (38, 256, 2),
        (19, 512, 1),
        (19, 512, 2),
        (10, 1024, 1),
    ];
    for (n, (size, channels, stride)) in layers.into_iter().enumerate() {
        let case = ([2, channels, size, size], channels, 3, stride, true, false);
        let seed = 5000 + 10 * n as u64;
        let same = |what: &str, got: Outcome, want: Outcome| {
            assert_eq!(got.len(), want.len(), "{what}");
            for (i, (g, w)) in got.into_iter().zip(want).enumerate() {
                assert_close(&format!("{what} [{i}]"), g, w, 1e-4);
            }
        };
        same(
            &format!("depthwise {case:?}"),
            conv_case::<burn::backend::Wgpu>(case, seed),
            conv_case::<Flex>(case, seed),
        );
        let out = size.div_ceil(stride);
        for shape in [[2, channels, size, size], [2, channels, out, out]] {
            same(
                &format!("batch norm {shape:?}"),
                batch_norm_case::<burn::backend::Wgpu>(shape),
                batch_norm_case::<Flex>(shape),
            );
        }
    }
}

fn batch_norm_case<B: SsdBackend>(shape: [usize; 4]) -> Outcome {
    let x = input::<B, 4>(shape, (4.0, 1.0), 1);
    let gamma = input::<B, 1>([shape[1]], (3.0, 0.0), 2);
    let beta = input::<B, 1>([shape[1]], (1.0, 0.0), 3);
    let (y, mean, variance) = batch_norm_relu6(x.clone(), gamma.clone(), beta.clone(), 0.001);
    outcome(
        vec![values(mean), values(variance)],
        y,
        [
            &|g| values(x.grad(g).expect("x")),
            &|g| values(gamma.grad(g).expect("gamma")),
            &|g| values(beta.grad(g).expect("beta")),
        ],
        4,
    )
}

#[test]
fn batch_norm_relu6_and_its_gradients_beta_included() {
    for shape in [[3, 4, 5, 6], [2, 4, 1, 1], [2, 3, 3, 2]] {
        compare(
            &format!("batch norm {shape:?}"),
            |g| on_both!(g, batch_norm_case(shape)),
            1e-4,
        );
    }
}

fn depthwise_between_case<B: SsdBackend>((shape, stride): ([usize; 4], usize)) -> Outcome {
    let c = shape[1];
    let x = input::<B, 4>(shape, (4.0, 1.0), 11);
    let w = input::<B, 4>([c, 1, 3, 3], (1.0, 0.0), 12);
    let params = [(2.0, 2.5), (2.0, 1.0), (2.0, 2.5), (2.0, 1.0)]
        .into_iter()
        .enumerate()
        .map(|(i, range)| input::<B, 1>([c], range, 13 + i as u64))
        .collect::<Vec<_>>();
    let [g0, b0, g1, b1] = [0, 1, 2, 3].map(|i| params[i].clone());
    let (y, stats) = depthwise_between_batch_norms(
        x.clone(),
        [g0, b0],
        (w.clone(), stride),
        [g1, b1],
        [0.001, 0.01],
    );
    let params = &params;
    let param = |i: usize| move |g: &_| values(params[i].grad(g).expect("batch norm parameter"));
    let (p0, p1, p2, p3) = (param(0), param(1), param(2), param(3));
    outcome(
        stats.into_iter().map(values).collect(),
        y,
        [
            &|g| values(x.grad(g).expect("x")),
            &|g| values(w.grad(g).expect("filter")),
            &p0,
            &p1,
            &p2,
            &p3,
        ],
        17,
    )
}

#[test]
fn depthwise_between_batch_norms_and_its_gradients() {
    for case in [([2, 3, 9, 70], 1), ([2, 3, 10, 9], 2), ([2, 4, 5, 4], 1)] {
        compare(
            &format!("fused {case:?}"),
            |g| on_both!(g, depthwise_between_case(case)),
            1e-4,
        );
    }
}

fn heads_and_loss_case<B: SsdBackend>(seed: u64) -> Outcome {
    let x = input::<B, 4>([2, 6, 5, 4], (1.0, 0.0), seed);
    let nhwc = channels_last(x.clone());
    let logits = input::<B, 3>([3, 40, 5], (40.0, 0.0), seed + 1);
    let labels = uniform::<Autodiff<B>, 3>([3, 40, 5], (0.0, 1.0), seed + 2, &Default::default());
    let loss = sigmoid_cross_entropy(logits.clone(), labels);
    let mut out = outcome(
        Vec::new(),
        nhwc,
        [&|g| values(x.grad(g).expect("x"))],
        seed + 3,
    );
    out.extend(outcome(
        Vec::new(),
        loss,
        [&|g| values(logits.grad(g).expect("logits"))],
        seed + 4,
    ));
    out
}

#[test]
fn channels_last_and_sigmoid_cross_entropy_and_their_gradients() {
    compare(
        "heads and loss",
        |g| on_both!(g, heads_and_loss_case(21)),
        1e-5,
    );
}

fn inference_and_update_case<B: SsdBackend>(seed: u64) -> Outcome {
    let device = Default::default();
    let t = |shape: [usize; 4], s: u64| uniform::<B, 4>(shape, (-1.0, 1.0), seed + s, &device);
    let x = t([2, 6, 9, 8], 0);
    let scale = uniform::<B, 1>([4], (0.5, 2.0), seed + 1, &device);
    let shift = uniform::<B, 1>([4], (-1.0, 3.0), seed + 2, &device);
    let weight = t([4, 6, 3, 3], 3);
    let depthwise = t([6, 1, 3, 3], 4);
    let (s6, h6) = (
        uniform::<B, 1>([6], (0.5, 2.0), seed + 5, &device),
        uniform::<B, 1>([6], (-1.0, 3.0), seed + 6, &device),
    );
    let step = RmsPropStep {
        learning_rate: 0.004,
        momentum: 0.9,
        decay: 0.9,
        epsilon: 1.0,
    };
    // more values than a GPU cube (256 units) takes, and not a multiple of it
    let update_shape = [40, 30, 3, 3];
    let grad = t(update_shape, 7);
    let param = t(update_shape, 10);
    let slots = [param.clone(), t(update_shape, 8).abs(), t(update_shape, 9)];
    let mut out = vec![
        values(conv_affine_relu6(
            x.clone(),
            (weight, 2, false),
            [scale.clone(), shift.clone()],
        )),
        values(conv_affine_relu6(
            x.clone(),
            (depthwise, 1, true),
            [s6.clone(), h6.clone()],
        )),
        values(affine_relu6(x.mul_scalar(4.0), s6, h6)),
        values(half_squared_norm(param.clone())),
        values(add_scaled(grad.clone(), param.clone(), 0.5)),
        values(moving_average(param, grad.clone(), 1.25, 0.99)),
    ];
    out.extend(rmsprop_update(slots, grad, step).map(values));
    out
}

#[test]
fn inference_units_and_updates() {
    compare(
        "inference and updates",
        |g| on_both!(g, inference_and_update_case(31)),
        1e-5,
    );
}
