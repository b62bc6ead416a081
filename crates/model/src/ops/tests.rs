//! The CPU kernels against the reference operations: values, and gradients through
//! `Autodiff` (custom graph nodes against Burn's own differentiation of the reference).

use burn::backend::{Autodiff, Flex};
use burn::tensor::Tensor;

use super::{
    ConvGradsWanted, SsdBackend, add_scaled, affine_relu6, batch_norm_relu6, channels_last,
    conv_affine_relu6, conv_same, depthwise_between_batch_norms, half_squared_norm, prim,
    reference, sigmoid_cross_entropy, tensor,
};

type A = Autodiff<Flex>;

fn random<const D: usize>(shape: [usize; D], seed: u64) -> Tensor<Flex, D> {
    crate::test_data::uniform(shape, (-1.0, 1.0), seed, &Default::default())
}

fn values<const D: usize, B: burn::tensor::backend::Backend>(t: Tensor<B, D>) -> Vec<f32> {
    t.into_data().convert::<f32>().to_vec().expect("f32 data")
}

pub(super) fn assert_close(what: &str, got: Vec<f32>, want: Vec<f32>, tol: f32) {
    assert_eq!(got.len(), want.len(), "{what}: length");
    let scale = want.iter().fold(1.0f32, |m, v| m.max(v.abs()));
    for (i, (g, w)) in got.iter().zip(&want).enumerate() {
        assert!(
            (g - w).abs() <= tol * scale,
            "{what}[{i}]: got {g}, reference {w}"
        );
    }
}

/// Input shape, output channels, kernel, stride, depthwise, bias.
pub(super) type ConvCase = ([usize; 4], usize, usize, usize, bool, bool);

pub(super) const CONVS: &[ConvCase] = &[
    ([2, 5, 7, 6], 4, 1, 1, false, false),
    ([2, 5, 7, 6], 4, 1, 1, false, true),
    ([2, 3, 9, 8], 6, 3, 2, false, false),
    ([1, 4, 6, 6], 3, 3, 1, false, true),
    ([2, 4, 5, 5], 3, 3, 2, false, false),
    ([3, 6, 7, 6], 6, 3, 1, true, false),
    ([2, 6, 8, 9], 6, 3, 2, true, false),
    ([2, 6, 7, 7], 6, 3, 2, true, true),
    ([1, 2, 1, 1], 2, 3, 1, true, false),
    ([1, 2, 2, 3], 5, 3, 2, false, true),
    // depthwise planes over several blocks (stride 1 and 2), and a 1x1 stride-2 filter that
    // leaves the last column unread
    ([1, 2, 45, 100], 2, 3, 1, true, false),
    ([1, 2, 61, 99], 2, 3, 2, true, false),
    // stride-1 depthwise planes wide enough to run row by row: two rows (each misses a
    // kernel row), three rows, and a bias
    ([2, 3, 2, 64], 3, 3, 1, true, false),
    ([1, 2, 3, 71], 2, 3, 1, true, true),
    ([1, 3, 6, 8], 3, 1, 2, true, false),
    // output planes of 64 values or more, where the input gradient uses transposed filters
    ([2, 5, 9, 8], 7, 1, 1, false, false),
    ([2, 3, 17, 16], 4, 3, 2, false, true),
    // the extra layers and heads on the smallest feature maps (150x120 input): batch 2
    ([2, 8, 2, 1], 16, 3, 2, false, false),
    ([2, 8, 1, 1], 16, 3, 2, false, false),
    ([2, 8, 3, 2], 16, 3, 2, false, false),
    ([2, 16, 5, 4], 8, 1, 1, false, false),
    ([2, 8, 1, 1], 12, 1, 1, false, true),
    ([2, 8, 2, 1], 12, 1, 1, false, true),
    ([2, 8, 5, 4], 8, 3, 2, true, false),
    ([2, 8, 10, 8], 8, 3, 2, true, false),
];

/// The filter bank of a [`ConvCase`]: `[out, in, k, k]`, depthwise `[in, 1, k, k]`.
pub(super) fn filter_shape(shape: [usize; 4], out: usize, k: usize, depthwise: bool) -> [usize; 4] {
    if depthwise {
        [shape[1], 1, k, k]
    } else {
        [out, shape[1], k, k]
    }
}

#[test]
fn conv_matches_reference_values_and_gradients() {
    for (n, &(shape, out, k, stride, depthwise, with_bias)) in CONVS.iter().enumerate() {
        let what =
            format!("conv {shape:?} -> {out} k{k} s{stride} dw={depthwise} bias={with_bias}");
        let x = random(shape, 10 + n as u64);
        let w_shape = filter_shape(shape, out, k, depthwise);
        let w = random(w_shape, 20 + n as u64);
        let bias = with_bias.then(|| random([w_shape[0]], 30 + n as u64));

        let fast = conv_same(x.clone(), w.clone(), bias.clone(), stride, depthwise);
        let slow = tensor::<Flex, 4>(reference::conv_same::<Flex>(
            prim(x.clone()),
            prim(w.clone()),
            bias.clone().map(prim),
            stride,
            depthwise,
        ));
        assert_eq!(fast.dims(), slow.dims(), "{what}");
        let upstream = random(fast.dims(), 40 + n as u64);
        assert_close(&what, values(fast), values(slow), 1e-5);

        // gradients of sum(y * upstream)
        let grads = |custom: bool| {
            let xa = Tensor::<A, 4>::from_inner(x.clone()).require_grad();
            let wa = Tensor::<A, 4>::from_inner(w.clone()).require_grad();
            let ba = bias
                .clone()
                .map(|b| Tensor::<A, 1>::from_inner(b).require_grad());
            let y = if custom {
                conv_same(xa.clone(), wa.clone(), ba.clone(), stride, depthwise)
            } else {
                tensor::<A, 4>(reference::conv_same::<A>(
                    prim(xa.clone()),
                    prim(wa.clone()),
                    ba.clone().map(prim),
                    stride,
                    depthwise,
                ))
            };
            let g = (y * Tensor::from_inner(upstream.clone())).sum().backward();
            let mut out = vec![
                values(xa.grad(&g).expect("x grad")),
                values(wa.grad(&g).expect("w grad")),
            ];
            if let Some(b) = ba {
                out.push(values(b.grad(&g).expect("bias grad")));
            }
            out
        };
        let custom = grads(true);
        for (i, (got, want)) in custom.iter().zip(grads(false)).enumerate() {
            assert_close(&format!("{what} grad {i}"), got.clone(), want, 1e-4);
        }

        // an untracked input (as the images are): no input gradient, the same filter
        // gradient
        let xa = Tensor::<A, 4>::from_inner(x.clone());
        let wa = Tensor::<A, 4>::from_inner(w.clone()).require_grad();
        let ba = bias.map(|b| Tensor::<A, 1>::from_inner(b).require_grad());
        let y = conv_same(xa.clone(), wa.clone(), ba, stride, depthwise);
        let g = (y * Tensor::from_inner(upstream)).sum().backward();
        assert!(xa.grad(&g).is_none(), "{what}: untracked input");
        let dw = values(wa.grad(&g).expect("w grad"));
        assert_close(
            &format!("{what} untracked input, dw"),
            dw,
            custom[1].clone(),
            1e-6,
        );
    }
}

#[test]
fn batch_norm_relu6_matches_reference_values_and_gradients() {
    check_batch_norm_relu6([3, 4, 5, 6], true);
    // the smallest feature maps of a 150x120 input, one and two images
    for shape in [[2, 4, 1, 1], [2, 4, 2, 1], [1, 4, 2, 1], [2, 3, 3, 2]] {
        check_batch_norm_relu6(shape, false);
    }
}

fn check_batch_norm_relu6(shape: [usize; 4], check_clamping: bool) {
    let (x, gamma, beta) = (
        random(shape, 1).mul_scalar(4.0).add_scalar(1.0),
        random([shape[1]], 2).mul_scalar(3.0),
        random([shape[1]], 3),
    );
    let eps = 0.001;
    let (y, mean, var) = batch_norm_relu6(x.clone(), gamma.clone(), beta.clone(), eps);
    let r = reference::batch_norm_relu6::<Flex>(
        prim(x.clone()),
        prim(gamma.clone()),
        prim(beta.clone()),
        eps,
    );
    let clamped = values(y.clone())
        .iter()
        .filter(|&&v| v == 0.0 || v == 6.0)
        .count();
    assert!(
        !check_clamping || clamped > 20,
        "the case exercises both ReLU6 bounds: {clamped}"
    );
    assert_close("bn y", values(y), values(tensor::<Flex, 4>(r.y)), 1e-5);
    assert_close(
        "bn mean",
        values(mean),
        values(tensor::<Flex, 1>(r.mean)),
        1e-5,
    );
    assert_close(
        "bn var",
        values(var),
        values(tensor::<Flex, 1>(r.variance)),
        1e-5,
    );

    let upstream = random(shape, 4);
    let grads = |custom: bool| {
        let xa = Tensor::<A, 4>::from_inner(x.clone()).require_grad();
        let ga = Tensor::<A, 1>::from_inner(gamma.clone()).require_grad();
        let ba = Tensor::<A, 1>::from_inner(beta.clone()).require_grad();
        let y = if custom {
            batch_norm_relu6(xa.clone(), ga.clone(), ba.clone(), eps).0
        } else {
            tensor::<A, 4>(
                reference::batch_norm_relu6::<A>(
                    prim(xa.clone()),
                    prim(ga.clone()),
                    prim(ba.clone()),
                    eps,
                )
                .y,
            )
        };
        let g = (y * Tensor::from_inner(upstream.clone())).sum().backward();
        [
            values(xa.grad(&g).expect("x")),
            values(ga.grad(&g).expect("gamma")),
            values(ba.grad(&g).expect("beta")),
        ]
    };
    for (i, (got, want)) in grads(true).into_iter().zip(grads(false)).enumerate() {
        assert_close(&format!("bn grad {i}"), got, want, 1e-4);
    }
    // and the reference backward operation (the default other backends use) agrees too
    let ours = grads(true);
    let (_, mean, var) = batch_norm_relu6(x.clone(), gamma.clone(), beta.clone(), eps);
    let r = reference::batch_norm_relu6_backward::<Flex>(
        prim(x),
        prim(upstream),
        prim(gamma),
        prim(beta),
        prim(mean),
        prim(var),
        eps,
    );
    assert_close(
        "reference bn dx",
        values(tensor::<Flex, 4>(r.x)),
        ours[0].clone(),
        1e-4,
    );
    assert_close(
        "reference bn dgamma",
        values(tensor::<Flex, 1>(r.gamma)),
        ours[1].clone(),
        1e-4,
    );
}

/// The fused BatchNorm + ReLU6, depthwise convolution, BatchNorm + ReLU6 against the three
/// operations one after the other: the same values and gradients bit for bit on the CPU, and
/// the reference operations (the defaults of other backends) within rounding.
#[test]
fn depthwise_between_batch_norms_matches_the_three_operations() {
    // planes run row by row (stride 1, 70 wide), through the padded layout (stride 1 narrow,
    // stride 2 with even and odd sizes)
    let cases = [
        ([2, 3, 9, 70], 1),
        ([3, 4, 7, 6], 1),
        ([2, 3, 10, 9], 2),
        ([1, 2, 11, 11], 2),
        // the backbone's planes at a 150x120 input, two images
        ([2, 4, 75, 60], 1),
        ([2, 4, 75, 60], 2),
        ([2, 4, 19, 15], 2),
        ([2, 4, 10, 8], 2),
        ([2, 4, 5, 4], 1),
    ];
    let eps = [0.001, 0.01];
    for (n, (shape, stride)) in cases.into_iter().enumerate() {
        let what = format!("fused {shape:?} s{stride}");
        let seed = 100 + 10 * n as u64;
        let c = shape[1];
        let x = random(shape, seed).mul_scalar(4.0).add_scalar(1.0);
        let scale = |seed| random([c], seed).mul_scalar(2.0).add_scalar(2.5);
        let offset = |seed| random([c], seed).mul_scalar(2.0).add_scalar(1.0);
        let params = [
            scale(seed + 1),
            offset(seed + 2),
            scale(seed + 5),
            offset(seed + 6),
        ];
        let w = random([c, 1, 3, 3], seed + 3);
        // both ReLU6 bounds reached
        let bounds = |y: &Tensor<A, 4>| {
            let ys = values(y.clone());
            let at = |bound: f32| ys.iter().filter(|&&v| v == bound).count();
            assert!(
                at(0.0) > 0 && at(6.0) > 0,
                "{what}: both ReLU6 bounds reached"
            );
        };
        let run = |fuse: bool, upstream: Option<&Tensor<Flex, 4>>| {
            let xa = Tensor::<A, 4>::from_inner(x.clone()).require_grad();
            let wa = Tensor::<A, 4>::from_inner(w.clone()).require_grad();
            let pa = params
                .clone()
                .map(|p| Tensor::<A, 1>::from_inner(p).require_grad());
            let [g0, b0, g1, b1] = pa.clone();
            let (y, stats) = if fuse {
                depthwise_between_batch_norms(
                    xa.clone(),
                    [g0, b0],
                    (wa.clone(), stride),
                    [g1, b1],
                    eps,
                )
            } else {
                let (first, m0, v0) = batch_norm_relu6(xa.clone(), g0, b0, eps[0]);
                bounds(&first);
                let conv = conv_same(first, wa.clone(), None, stride, true);
                let (y, m1, v1) = batch_norm_relu6(conv, g1, b1, eps[1]);
                bounds(&y);
                (y, [m0, v0, m1, v1])
            };
            let mut out = vec![values(y.clone())];
            out.extend(stats.map(values));
            let Some(upstream) = upstream else {
                return (out, Vec::new());
            };
            let g = (y * Tensor::from_inner(upstream.clone())).sum().backward();
            let mut grads = vec![
                values(xa.grad(&g).expect("x")),
                values(wa.grad(&g).expect("weight")),
            ];
            grads.extend(pa.map(|p| values(p.grad(&g).expect("batch norm parameter"))));
            (out, grads)
        };
        let dims = {
            let (out, _) = run(false, None);
            let len = out[0].len();
            let [batch, c, h, w] = shape;
            let (oh, ow) = (h.div_ceil(stride), w.div_ceil(stride));
            assert_eq!(len, batch * c * oh * ow);
            [batch, c, oh, ow]
        };
        let upstream = random(dims, seed + 4);
        let (out, grads) = run(true, Some(&upstream));
        let (want_out, want_grads) = run(false, Some(&upstream));
        for (i, (got, want)) in out.iter().zip(&want_out).enumerate() {
            assert_eq!(got, want, "{what}: output {i}");
        }
        for (i, (got, want)) in grads.iter().zip(&want_grads).enumerate() {
            assert_eq!(got, want, "{what}: gradient {i}");
        }

        // the reference operations (the defaults of other backends)
        let [g0, b0, g1, b1] = params.map(prim);
        let r = reference::depthwise_between_batch_norms::<Flex>(
            prim(x.clone()),
            [g0.clone(), b0.clone()],
            (prim(w.clone()), stride),
            [g1.clone(), b1.clone()],
            eps,
        );
        assert_close(&what, values(tensor::<Flex, 4>(r.y)), out[0].clone(), 1e-5);
        let [m0, v0, m1, v1] = r.stats;
        let r = reference::depthwise_between_batch_norms_backward::<Flex>(
            (prim(x.clone()), r.conv, prim(upstream)),
            [g0, b0, m0, v0],
            (prim(w.clone()), stride),
            [g1, b1, m1, v1],
            eps,
        );
        let [dg0, db0] = r.before.map(tensor::<Flex, 1>);
        let [dg1, db1] = r.after.map(tensor::<Flex, 1>);
        let reference = [
            values(tensor::<Flex, 4>(r.x)),
            values(tensor::<Flex, 4>(r.weight)),
            values(dg0),
            values(db0),
            values(dg1),
            values(db1),
        ];
        for (i, (got, want)) in reference.into_iter().zip(grads).enumerate() {
            assert_close(&format!("{what} reference grad {i}"), got, want, 1e-4);
        }
    }
}

#[test]
fn reference_conv_backward_matches_autodiff() {
    for (n, &(shape, out, k, stride, depthwise, with_bias)) in CONVS.iter().enumerate() {
        let x = random(shape, 50 + n as u64);
        let w_shape = filter_shape(shape, out, k, depthwise);
        let w = random(w_shape, 60 + n as u64);
        let y = conv_same(x.clone(), w.clone(), None, stride, depthwise);
        let upstream = random(y.dims(), 70 + n as u64);
        let backward = |custom: bool, x_wanted: bool| {
            let wanted = ConvGradsWanted {
                x: x_wanted,
                bias: with_bias,
            };
            let (x, w, upstream) = (prim(x.clone()), prim(w.clone()), prim(upstream.clone()));
            if custom {
                <Flex as SsdBackend>::conv_same_backward(x, w, upstream, stride, depthwise, wanted)
            } else {
                reference::conv_same_backward::<Flex>(x, w, upstream, stride, depthwise, wanted)
            }
        };
        // without the input gradient: none, and the same filter gradient
        for custom in [true, false] {
            let without = backward(custom, false);
            assert!(without.x.is_none(), "dx computed though not wanted");
            assert_eq!(
                values(tensor::<Flex, 4>(without.weight)),
                values(tensor::<Flex, 4>(backward(custom, true).weight)),
                "dw with and without dx"
            );
        }
        let (fast, slow) = (backward(true, true), backward(false, true));
        assert_close(
            "dx",
            values(tensor::<Flex, 4>(fast.x.expect("dx"))),
            values(tensor::<Flex, 4>(slow.x.expect("dx"))),
            1e-4,
        );
        assert_close(
            "dw",
            values(tensor::<Flex, 4>(fast.weight)),
            values(tensor::<Flex, 4>(slow.weight)),
            1e-4,
        );
        match (fast.bias, slow.bias) {
            (Some(fast), Some(slow)) => assert_close(
                "db",
                values(tensor::<Flex, 1>(fast)),
                values(tensor::<Flex, 1>(slow)),
                1e-4,
            ),
            (None, None) => assert!(!with_bias),
            _ => panic!("only one of the two computed a bias gradient"),
        }
    }
}

/// A contiguous kernel, a transposed view of one, and one of more values than a parallel
/// chunk.
fn kernels(seed: u64) -> [Tensor<Flex, 4>; 3] {
    [
        random([6, 5, 3, 3], seed),
        random([5, 6, 3, 3], seed + 1).swap_dims(0, 1),
        random([64, 32, 3, 3], seed + 2),
    ]
}

/// Both sums against the exact value (summed in `f64`): our kernel at 1e-6; Burn's `f32`
/// sum, whose vector width (and so its rounding) depends on the CPU it runs on, at 1e-5, the
/// tolerance of an `f32` sum of 18 432 terms. Compared with each other at 1e-6, the two
/// differed by 1.07e-6 once on an AVX2 machine.
#[test]
fn half_squared_norm_matches_exact_sum() {
    for (n, w) in kernels(80).into_iter().enumerate() {
        let exact = values(w.clone())
            .iter()
            .map(|&v| f64::from(v) * f64::from(v))
            .sum::<f64>()
            / 2.0;
        let want = vec![exact as f32];
        let fast = half_squared_norm(w.clone());
        assert_close(&format!("kernel {n}"), values(fast), want.clone(), 1e-6);
        let slow = tensor::<Flex, 1>(reference::half_squared_norm::<Flex>(prim(w)));
        assert_close(&format!("reference {n}"), values(slow), want, 1e-5);
    }
}

#[test]
fn add_scaled_matches_reference_and_leaves_shared_buffers_alone() {
    for (n, (x, y)) in kernels(90).into_iter().zip(kernels(95)).enumerate() {
        let what = format!("kernel {n}");
        let want = values(x.clone() + y.clone().mul_scalar(0.25));
        // `x` is also held here: the sum goes to a new buffer
        let before = values(x.clone());
        let shared = add_scaled(x.clone(), y.clone(), 0.25);
        assert_close(&what, values(shared), want.clone(), 1e-6);
        assert_eq!(
            values(x.clone()),
            before,
            "{what}: the shared input changed"
        );
        // a buffer held by nobody else (the case of a gradient) is written in place
        let own = x.clone() * 1.0;
        assert_close(&what, values(add_scaled(own, y, 0.25)), want, 1e-6);
    }
}

/// The NHWC reordering of the head outputs: values against Burn's permutation, the gradient
/// through `Autodiff` against Burn's differentiation of it, for planes wider than a tile.
#[test]
fn channels_last_matches_reference_values_and_gradients() {
    for (i, shape) in [[2, 5, 3, 4], [3, 70, 6, 7], [1, 33, 1, 40]]
        .into_iter()
        .enumerate()
    {
        let seed = 60 + 3 * i as u64;
        let x = random(shape, seed);
        let want = tensor::<Flex, 4>(reference::channels_last::<Flex>(prim(x.clone())));
        let got = channels_last(x.clone());
        assert_eq!(got.dims(), want.dims());
        assert_eq!(values(got.clone()), values(want), "{shape:?}: values");
        let back = tensor::<Flex, 4>(Flex::channels_first(prim(got)));
        assert_eq!(
            values(back),
            values(x.clone()),
            "{shape:?}: channels_first inverts it"
        );
        let [b, c, h, w] = shape;
        let upstream = random([b, h, w, c], seed + 1);
        let grad = |custom: bool| {
            let xa = Tensor::<A, 4>::from_inner(x.clone()).require_grad();
            let y = if custom {
                channels_last(xa.clone())
            } else {
                xa.clone().permute([0, 2, 3, 1])
            };
            let g = (y * Tensor::from_inner(upstream.clone())).sum().backward();
            values(xa.grad(&g).expect("input grad"))
        };
        assert_eq!(grad(true), grad(false), "{shape:?}: gradient");
    }
}

#[test]
fn affine_relu6_matches_reference() {
    let x = random([2, 3, 4, 5], 5).mul_scalar(8.0);
    let (scale, shift) = (random([3], 6), random([3], 7));
    let reference = |x: Tensor<Flex, 4>| {
        tensor::<Flex, 4>(reference::affine_relu6::<Flex>(
            prim(x),
            prim(scale.clone()),
            prim(shift.clone()),
        ))
    };
    let slow = reference(x.clone());
    let before = values(x.clone());
    // a shared input is left alone (the result goes to a new buffer)
    let shared = affine_relu6(x.clone(), scale.clone(), shift.clone());
    assert_close("affine, shared", values(shared), values(slow.clone()), 1e-6);
    assert_eq!(values(x.clone()), before, "the shared input changed");
    // the only holder's buffer is reused
    let unique = affine_relu6(x.clone().mul_scalar(1.0), scale.clone(), shift.clone());
    assert_close("affine, in place", values(unique), values(slow), 1e-6);
    // a view into a larger buffer
    let part = x.narrow(0, 1, 1);
    let fast = affine_relu6(part.clone(), scale.clone(), shift.clone());
    assert_close("affine, view", values(fast), values(reference(part)), 1e-6);
}

#[test]
fn conv_affine_relu6_matches_convolution_then_affine() {
    for (n, &(shape, out, k, stride, depthwise, _)) in CONVS.iter().enumerate() {
        let what = format!("conv + affine {shape:?} -> {out} k{k} s{stride} dw={depthwise}");
        let x = random(shape, 40 + n as u64);
        let w_shape = filter_shape(shape, out, k, depthwise);
        let w = random(w_shape, 50 + n as u64);
        // wide enough that outputs land below 0, inside (0, 6) and above 6
        let scale = random([w_shape[0]], 60 + n as u64).mul_scalar(6.0);
        let shift = random([w_shape[0]], 70 + n as u64).mul_scalar(4.0);
        let fused = conv_affine_relu6(
            x.clone(),
            (w.clone(), stride, depthwise),
            [scale.clone(), shift.clone()],
        );
        let conv = reference::conv_same::<Flex>(prim(x), prim(w), None, stride, depthwise);
        let slow = reference::affine_relu6::<Flex>(conv, prim(scale), prim(shift));
        let slow = values(tensor::<Flex, 4>(slow));
        let clamped = |v: f32| v == 0.0 || v == 6.0;
        assert!(slow.iter().any(|&v| clamped(v)), "{what}: nothing clamped");
        assert_close(&what, values(fused), slow, 1e-5);
    }
}

/// The CPU backend runs a block on one of rayon's pool threads (a nested block in place on
/// that same thread); `Autodiff` delegates to its inner backend.
#[test]
fn compute_blocks_run_on_a_pool_thread() {
    use super::SsdBackend;
    assert_eq!(rayon::current_thread_index(), None, "the test thread");
    let (outer, inner) = Flex::on_compute_thread(|| {
        let outer = rayon::current_thread_index();
        (outer, Flex::on_compute_thread(rayon::current_thread_index))
    });
    assert!(outer.is_some());
    assert_eq!(inner, outer);
    assert!(A::on_compute_thread(rayon::current_thread_index).is_some());
    assert_eq!(Flex::on_compute_thread(|| 6 * 7), 42);
}

/// The fused CPU updates against the reference's tensor operations, over more values than
/// one parallel chunk holds: into new buffers where the inputs are also held elsewhere (which
/// keep their values), in place where nothing else holds them.
#[test]
fn rmsprop_and_moving_average_match_the_reference() {
    use super::{RmsPropState, RmsPropStep, moving_average, rmsprop_update};
    let shape = [3, 7, 41, 47];
    let w = random(shape, 1);
    // the gradient as a view into a larger buffer, as the all-reduce buckets hand it over
    let n: usize = shape.iter().product();
    let g = random([n + 10], 2).narrow(0, 7, n).reshape(shape);
    let ms = random(shape, 3).abs().add_scalar(0.5);
    let mom = random(shape, 4);
    let step = RmsPropStep {
        learning_rate: 0.004,
        momentum: 0.9,
        decay: 0.9,
        epsilon: 1.0,
    };
    let inputs = [w.clone(), ms.clone(), mom.clone()];
    let before = inputs.clone().map(values);
    let shared = rmsprop_update(inputs.clone(), g.clone(), step);
    // the same values in buffers nobody else holds
    let own = rmsprop_update(inputs.clone().map(|t| t * 1.0), g.clone(), step);
    let state = RmsPropState {
        weights: prim(w.clone()),
        mean_square: prim(ms),
        momentum: prim(mom),
    };
    let want = reference::rmsprop_update::<Flex>(state, prim(g), step);
    let want = [want.weights, want.mean_square, want.momentum].map(tensor::<Flex, 4>);
    for (i, name) in ["weights", "mean square", "momentum"].iter().enumerate() {
        for got in [&shared[i], &own[i]] {
            assert_eq!(got.dims(), shape);
            assert_close(name, values(got.clone()), values(want[i].clone()), 1e-6);
        }
        assert_eq!(
            values(inputs[i].clone()),
            before[i],
            "{name}: the shared input changed"
        );
    }
    let value = random(shape, 5);
    let want = values(tensor::<Flex, 4>(reference::moving_average::<Flex>(
        prim(w.clone()),
        prim(value.clone()),
        1.25,
        0.99,
    )));
    let before = values(w.clone());
    let shared = moving_average(w.clone(), value.clone(), 1.25, 0.99);
    assert_close("moving average", values(shared), want.clone(), 1e-6);
    assert_eq!(values(w.clone()), before, "the shared average changed");
    let own = moving_average(w * 1.0, value, 1.25, 0.99);
    assert_close("moving average in place", values(own), want, 1e-6);
}

#[test]
fn sigmoid_cross_entropy_matches_reference_value_and_gradient() {
    // a worked case: x = 0, z = 1 gives log 2; x = 2, z = 0 gives 2 + log(1 + e^-2); the
    // gradients are sigmoid(x) - z: -0.5 and 0.880797
    let x = Tensor::<A, 3>::from_floats([[[0.0, 2.0]]], &Default::default()).require_grad();
    let z = Tensor::<A, 3>::from_floats([[[1.0, 0.0]]], &Default::default());
    let loss = sigmoid_cross_entropy(x.clone(), z);
    assert_close("worked loss", values(loss.clone()), vec![2.820_075], 1e-6);
    let g = loss.sum().backward();
    assert_close(
        "worked gradient",
        values(x.grad(&g).expect("logits grad")),
        vec![-0.5, 0.880_797],
        1e-6,
    );

    // logits out to +-40 (both tails), labels in [0, 1]; more rows than one parallel task
    let logits = random([3, 700, 5], 90).mul_scalar(40.0);
    let labels = random([3, 700, 5], 91).add_scalar(1.0).mul_scalar(0.5);
    let fast = sigmoid_cross_entropy(logits.clone(), labels.clone());
    let slow = reference::sigmoid_cross_entropy::<Flex>(prim(logits.clone()), prim(labels.clone()));
    assert_close("loss", values(fast), values(tensor::<Flex, 2>(slow)), 1e-5);
    let upstream = random([3, 700], 92);
    let grads = |custom: bool| {
        let xa = Tensor::<A, 3>::from_inner(logits.clone()).require_grad();
        let za = Tensor::<A, 3>::from_inner(labels.clone());
        let y = if custom {
            sigmoid_cross_entropy(xa.clone(), za)
        } else {
            tensor::<A, 2>(reference::sigmoid_cross_entropy::<A>(
                prim(xa.clone()),
                prim(za),
            ))
        };
        let g = (y * Tensor::from_inner(upstream.clone())).sum().backward();
        values(xa.grad(&g).expect("logits grad"))
    };
    assert_close("gradient", grads(true), grads(false), 1e-5);
}
