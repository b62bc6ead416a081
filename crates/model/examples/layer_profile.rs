//! Time of each CPU kernel at the backbone's layer shapes (300x300, depth 1, batch 8):
//! convolution forward / backward and BatchNorm + ReLU6 forward / backward, in ms, mean of 3
//! runs after one warm-up. Where a training step's time goes, layer by layer:
//!
//! `cargo run --release -p model --example layer_profile [-- BATCH]`

use std::time::Instant;

use model::mobilenet::SEPARABLE_BLOCKS;
use model::ops::cpu::{self, Conv};

fn mean_ms(mut f: impl FnMut()) -> f64 {
    f();
    let start = Instant::now();
    for _ in 0..3 {
        f();
    }
    start.elapsed().as_secs_f64() * 1000.0 / 3.0
}

/// `(in, out, input size, stride, depthwise, kernel)` of every backbone convolution.
fn backbone() -> Vec<(usize, usize, usize, usize, bool, usize)> {
    let mut layers = vec![(3, 32, 300, 2, false, 3)];
    let (mut channels, mut size) = (32usize, 150usize);
    for (stride, depth) in SEPARABLE_BLOCKS {
        layers.push((channels, channels, size, stride, true, 3));
        size = size.div_ceil(stride);
        layers.push((channels, depth, size, 1, false, 1));
        channels = depth;
    }
    layers
}

fn main() {
    let batch: usize = std::env::args()
        .nth(1)
        .and_then(|a| a.parse().ok())
        .unwrap_or(8);
    let mut totals = [0.0f64; 4];
    for (cin, cout, size, stride, depthwise, k) in backbone() {
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
                cpu::depthwise_forward(&g, &x, &w)
            } else {
                cpu::conv_forward(&g, &x, &w, None)
            }
        };
        let y = forward();
        let conv_fwd = mean_ms(|| drop(forward()));
        let conv_bwd = mean_ms(|| {
            if depthwise {
                drop(cpu::depthwise_backward(&g, &x, &w, &y));
            } else {
                drop(cpu::conv_backward(&g, &x, &w, &y));
            }
        });
        let dims = [batch, g.out_height * g.out_width];
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
        println!(
            "{cin:5} -> {cout:5} at {size:3}x{size:<3} s{stride} {:9}: conv fwd {conv_fwd:6.1} bwd {conv_bwd:6.1} | bn+relu6 fwd {bn_fwd:5.1} bwd {bn_bwd:5.1}",
            if depthwise {
                "depthwise"
            } else if k == 1 {
                "pointwise"
            } else {
                "dense 3x3"
            }
        );
    }
    println!(
        "total (ms): conv fwd {:.0}, conv bwd {:.0}, bn+relu6 fwd {:.0}, bn+relu6 bwd {:.0}",
        totals[0], totals[1], totals[2], totals[3]
    );
}
