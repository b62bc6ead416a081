//! Time of each CPU kernel at the network's layer shapes (the default config: 300x300,
//! depth 1, 37 classes; batch 8): convolution forward / backward and BatchNorm + ReLU6
//! forward / backward, in ms, mean of 3 runs after one warm-up, for the backbone, the extra
//! feature layers and the predictor heads (which have a bias and no BatchNorm), then the
//! totals (with the depthwise layers' share) and the classification loss (sigmoid
//! cross-entropy over every anchor's logits). Training runs most depthwise layers together
//! with the BatchNorm + ReLU6 before and after them (`depthwise_between_batch_norms`): those
//! rows add the three operations' time one after the other (each output a new buffer, as
//! a training step makes them) and fused, and sum both. Where a training step's time goes,
//! layer by layer:
//!
//! `cargo run --release -p model --example layer_profile [-- BATCH]`

use std::time::Instant;

use model::box_coder::BoxCoder;
use model::config::SsdConfig;
use model::mobilenet::SEPARABLE_BLOCKS;
use model::ops::cpu::{self, Conv, Epilogue};
use model::ssd::{EXTRA_LAYER_DEPTHS, anchors, feature_map_shapes};

fn mean_ms(mut f: impl FnMut()) -> f64 {
    f();
    let start = Instant::now();
    for _ in 0..3 {
        f();
    }
    start.elapsed().as_secs_f64() * 1000.0 / 3.0
}

/// One convolution: `(in, out, input size, stride, kind)`.
type Layer = (usize, usize, usize, usize, Kind);

#[derive(Clone, Copy, PartialEq)]
enum Kind {
    Dense3x3,
    Depthwise,
    /// A depthwise convolution that training runs together with the BatchNorm + ReLU6 of
    /// the unit before it and its own.
    FusedDepthwise,
    Pointwise,
    /// A predictor head: a 1x1 convolution with a bias and no BatchNorm.
    Head,
}

impl Kind {
    fn kernel(self) -> usize {
        match self {
            Kind::Dense3x3 | Kind::Depthwise | Kind::FusedDepthwise => 3,
            Kind::Pointwise | Kind::Head => 1,
        }
    }
}

/// Every convolution of the default network (square 300x300 input, depth multiplier 1).
fn network() -> Vec<Layer> {
    let config = SsdConfig::default();
    let mut layers = vec![(3, 32, 300, 2, Kind::Dense3x3)];
    let (mut channels, mut size) = (32usize, 150usize);
    let mut maps = Vec::new();
    for (i, (stride, depth)) in SEPARABLE_BLOCKS.into_iter().enumerate() {
        // the input of block 11 is the first feature map: stored normalised
        let kind = if i == 11 {
            Kind::Depthwise
        } else {
            Kind::FusedDepthwise
        };
        layers.push((channels, channels, size, stride, kind));
        size = size.div_ceil(stride);
        layers.push((channels, depth, size, 1, Kind::Pointwise));
        channels = depth;
        if i == 10 || i == 12 {
            maps.push(channels);
        }
    }
    for depth in EXTRA_LAYER_DEPTHS {
        layers.push((channels, depth / 2, size, 1, Kind::Pointwise));
        layers.push((depth / 2, depth, size, 2, Kind::Dense3x3));
        (channels, size) = (depth, size.div_ceil(2));
        maps.push(channels);
    }
    let shapes = feature_map_shapes(&config);
    for ((channels, (size, _)), specs) in
        maps.into_iter().zip(shapes).zip(config.anchors.box_specs())
    {
        let a = specs.len();
        layers.push((channels, a * BoxCoder::CODE_SIZE, size, 1, Kind::Head));
        layers.push((channels, a * (config.num_classes + 1), size, 1, Kind::Head));
    }
    layers
}

fn main() {
    let batch: usize = std::env::args()
        .nth(1)
        .and_then(|a| a.parse().ok())
        .unwrap_or(8);
    let mut totals = [0.0f64; 4];
    // the depthwise layers' share of the convolution totals
    let mut depthwise_totals = [0.0f64; 2];
    // the fused layers: their convolutions and the BatchNorm + ReLU6 before and after them,
    // apart and fused (forward, backward)
    let (mut apart, mut fused) = ([0.0f64; 2], [0.0f64; 2]);
    for (i, (cin, cout, size, stride, kind)) in network().into_iter().enumerate() {
        // the first layer's input is the images: no input gradient
        let with_dx = i > 0;
        let depthwise = matches!(kind, Kind::Depthwise | Kind::FusedDepthwise);
        let k = kind.kernel();
        let g = Conv::same([batch, cin, size, size], cout, k, stride);
        let x: Vec<f32> = (0..batch * cin * size * size)
            .map(|i| ((i * 7919) % 1000) as f32 / 500.0 - 1.0)
            .collect();
        let w_len = cout * if depthwise { 1 } else { cin } * k * k;
        let w: Vec<f32> = (0..w_len)
            .map(|i| ((i * 31) % 100) as f32 / 500.0)
            .collect();
        let forward = || {
            if depthwise {
                cpu::depthwise_forward(&g, &x, &w, Epilogue::None)
            } else {
                cpu::conv_forward(&g, &x, &w, Epilogue::None)
            }
        };
        let conv_backward = |dy: &[f32]| {
            if depthwise {
                drop(cpu::depthwise_backward(&g, &x, &w, dy));
            } else {
                drop(cpu::conv_backward(&g, &x, &w, dy, with_dx));
            }
        };
        let y = forward();
        let conv_fwd = mean_ms(|| drop(forward()));
        let conv_bwd = mean_ms(|| conv_backward(&y));
        if depthwise {
            depthwise_totals[0] += conv_fwd;
            depthwise_totals[1] += conv_bwd;
        }
        let plane = g.out_height * g.out_width;
        if kind == Kind::Head {
            let bias = vec![0.1f32; cout];
            let bias_ms = mean_ms(|| {
                let mut y = y.clone();
                Epilogue::Bias(&bias).apply_planes(&mut y, plane, true);
                drop(cpu::bias_grad(&y, plane, cout));
            });
            totals[0] += conv_fwd;
            totals[1] += conv_bwd + bias_ms;
            println!(
                "{cin:5} -> {cout:5} at {size:3}x{size:<3} s{stride} head     : conv fwd {conv_fwd:6.1} bwd {conv_bwd:6.1} | bias {bias_ms:5.1}"
            );
            continue;
        }
        let dims = [batch, plane];
        let (gamma, beta) = (vec![1.0f32; cout], vec![0.1f32; cout]);
        let (_, mean, var) = cpu::batch_norm_relu6(&y, dims, &gamma, &beta, 0.001);
        let bn_fwd = mean_ms(|| drop(cpu::batch_norm_relu6(&y, dims, &gamma, &beta, 0.001)));
        let bn_bwd = mean_ms(|| {
            drop(cpu::batch_norm_relu6_backward(
                &y,
                &y,
                dims,
                [&gamma, &beta],
                [&mean, &var],
                0.001,
            ))
        });
        for (t, v) in totals.iter_mut().zip([conv_fwd, conv_bwd, bn_fwd, bn_bwd]) {
            *t += v;
        }
        let fused_ms = (kind == Kind::FusedDepthwise).then(|| {
            let [ms_apart, ms_fused] = fused_against_apart(&g, &x, &w);
            for i in 0..2 {
                apart[i] += ms_apart[i];
                fused[i] += ms_fused[i];
            }
            format!(
                " | with both bns apart: fwd {:5.1} bwd {:5.1}, fused: fwd {:5.1} bwd {:5.1}",
                ms_apart[0], ms_apart[1], ms_fused[0], ms_fused[1]
            )
        });
        println!(
            "{cin:5} -> {cout:5} at {size:3}x{size:<3} s{stride} {:9}: conv fwd {conv_fwd:6.1} bwd {conv_bwd:6.1} | bn+relu6 fwd {bn_fwd:5.1} bwd {bn_bwd:5.1}{}",
            match kind {
                Kind::Depthwise | Kind::FusedDepthwise => "depthwise",
                Kind::Pointwise => "pointwise",
                _ => "dense 3x3",
            },
            fused_ms.unwrap_or_default()
        );
    }
    println!(
        "total (ms): conv fwd {:.0}, conv bwd {:.0} (depthwise {:.1} / {:.1}), bn+relu6 fwd {:.0}, bn+relu6 bwd {:.0}",
        totals[0], totals[1], depthwise_totals[0], depthwise_totals[1], totals[2], totals[3]
    );
    println!(
        "fused bn+relu6 -> depthwise -> bn+relu6 (ms): apart fwd {:.1} bwd {:.1}, fused fwd {:.1} bwd {:.1}",
        apart[0], apart[1], fused[0], fused[1]
    );
    classification_loss(batch, anchors(&SsdConfig::default()).len());
}

/// `[forward, backward]` ms of BatchNorm + ReLU6, the depthwise convolution `g`, BatchNorm +
/// ReLU6 on `x`: one after the other (each output a new buffer, as the training step makes
/// them), then fused (`depthwise_between_batch_norms`).
fn fused_against_apart(g: &Conv, x: &[f32], w: &[f32]) -> [[f64; 2]; 2] {
    let (c, batch) = (g.in_channels, g.batch);
    let (plane, out_plane) = (g.height * g.width, g.out_height * g.out_width);
    let (gamma, beta) = (vec![1.0f32; c], vec![0.1f32; c]);
    let params = [gamma.as_slice(), beta.as_slice()];
    let eps = 0.001;
    let normalised =
        |x: &[f32], plane: usize| cpu::batch_norm_relu6(x, [batch, plane], &gamma, &beta, eps);
    let forward = || {
        let (x_norm, mean, var) = normalised(x, plane);
        let conv = cpu::depthwise_forward(g, &x_norm, w, Epilogue::None);
        let (y, mean_after, var_after) = normalised(&conv, out_plane);
        (x_norm, [mean, var, mean_after, var_after], conv, y)
    };
    let (x_norm, stats, conv, dy) = forward();
    let backward = || {
        let after = [stats[2].as_slice(), &stats[3]];
        let dims = [batch, out_plane];
        let (dconv, _, _) = cpu::batch_norm_relu6_backward(&conv, &dy, dims, params, after, eps);
        let (dx_norm, _) = cpu::depthwise_backward(g, &x_norm, w, &dconv);
        let before = [stats[0].as_slice(), &stats[1]];
        drop(cpu::batch_norm_relu6_backward(
            x,
            &dx_norm,
            [batch, plane],
            params,
            before,
            eps,
        ));
    };
    let apart = [mean_ms(|| drop(forward())), mean_ms(backward)];
    let with = (params, w, params);
    let fused_forward = || cpu::depthwise_between_batch_norms(g, x, with, [eps; 2]);
    let fused_backward = || {
        let state = |i: usize| ([gamma.as_slice(), &beta, &stats[i], &stats[i + 1]], eps);
        let inputs = (x, conv.as_slice(), dy.as_slice());
        drop(cpu::depthwise_between_batch_norms_backward(
            g,
            inputs,
            (state(0), w, state(2)),
        ));
    };
    let fused = [mean_ms(|| drop(fused_forward())), mean_ms(fused_backward)];
    [apart, fused]
}

/// The classification loss of the default config: sigmoid cross-entropy over every anchor's
/// class logits (background included), forward and backward.
fn classification_loss(batch: usize, anchors: usize) {
    let classes = SsdConfig::default().num_classes + 1;
    let n = batch * anchors * classes;
    let logits: Vec<f32> = (0..n)
        .map(|i| ((i * 7919) % 2000) as f32 / 100.0 - 10.0)
        .collect();
    let labels: Vec<f32> = (0..n).map(|i| f32::from(i % 37 == 0)).collect();
    let grad = vec![1.0f32; batch * anchors];
    let fwd = mean_ms(|| drop(cpu::sigmoid_cross_entropy(&logits, &labels, classes)));
    let bwd = mean_ms(|| {
        drop(cpu::sigmoid_cross_entropy_backward(
            &logits, &labels, &grad, classes,
        ))
    });
    println!(
        "classification loss ({batch} x {anchors} anchors x {classes} classes): fwd {fwd:.2} bwd {bwd:.2}"
    );
}
