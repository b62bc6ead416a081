//! A depthwise convolution between two training-mode BatchNorm + ReLU6 layers as one pass
//! per channel, forward and backward.

use super::batch_norm::{
    ChannelGrad, ChannelOutput, ChannelSums, channel_affine, channel_backward, channel_planes,
    moments, scaled_relu6_into,
};
use super::depthwise::Depthwise;
use super::slices::{as_uninit, axpy};
use super::{Conv, scaled_relu6};

use rayon::prelude::*;

/// Outputs of [`depthwise_between_batch_norms`].
pub struct DepthwiseBetween {
    /// The second BatchNorm + ReLU6's output.
    pub y: Vec<f32>,
    /// The convolution's output (the second BatchNorm's input).
    pub conv: Vec<f32>,
    /// Batch mean and biased variance of the first BatchNorm, then of the second.
    pub stats: [Vec<f32>; 4],
}

/// Training-mode BatchNorm + ReLU6 of `x [batch, c, h, w]` with `before` (as
/// [`batch_norm_relu6`](super::batch_norm_relu6)), the depthwise convolution `g` with `weight` (as
/// [`depthwise_forward`](super::depthwise_forward)), then BatchNorm + ReLU6 with `after`, as one pass per channel: the
/// channel's statistics, each of its planes normalised into a buffer and convolved from
/// there into a buffer of the channel's outputs, their statistics, then the normalised
/// output. The activations between the operations are never read back from memory, and the
/// first BatchNorm's output is not stored at all. The values are those of the three
/// operations one after the other, bit for bit.
pub fn depthwise_between_batch_norms(
    g: &Conv,
    x: &[f32],
    (before, weight, after): ([&[f32]; 2], &[f32], [&[f32]; 2]),
    [epsilon_before, epsilon_after]: [f32; 2],
) -> DepthwiseBetween {
    let (c, kk) = (g.in_channels, g.kernel * g.kernel);
    let plan = Depthwise::new(g);
    let in_dims = [g.batch, c, g.in_plane()];
    let out_plane = g.out_plane().max(1);
    let len = g.batch * c * g.out_plane();
    let (mut y, mut conv): (Vec<f32>, Vec<f32>) =
        (Vec::with_capacity(len), Vec::with_capacity(len));
    let out_dims = [g.batch, c, g.out_plane()];
    let y_out = ChannelOutput::new(&mut y.spare_capacity_mut()[..len], out_dims);
    let conv_out = ChannelOutput::new(&mut conv.spare_capacity_mut()[..len], out_dims);
    let stats: Vec<[f32; 4]> = (0..c)
        .into_par_iter()
        .map_init(
            || (plan.scratch(), Vec::new(), Vec::new()),
            |(scratch, normalised, outputs), ch| {
                let (mean, var) = moments(channel_planes(x, in_dims, ch));
                let [gamma, beta] = before;
                let (s, t) = channel_affine(gamma[ch], beta[ch], mean, var, epsilon_before);
                let filter = &weight[ch * kk..][..kk];
                outputs.resize(g.batch * g.out_plane(), 0.0);
                let planes = channel_planes(x, in_dims, ch).zip(outputs.chunks_mut(out_plane));
                for (src, dst) in planes {
                    let src = scaled_relu6_into(normalised, src, s, t);
                    plan.forward_plane(src, filter, as_uninit(dst), scratch);
                }
                let (mean_after, var_after) = moments(outputs.chunks(out_plane));
                let [gamma, beta] = after;
                let affine =
                    channel_affine(gamma[ch], beta[ch], mean_after, var_after, epsilon_after);
                for (b, src) in outputs.chunks(out_plane).enumerate() {
                    // SAFETY: this task is the only one writing channel `ch`.
                    let (dst, kept) = unsafe { (y_out.plane(b, ch), conv_out.plane(b, ch)) };
                    for ((o, k), &v) in dst.iter_mut().zip(kept).zip(src) {
                        o.write(scaled_relu6(v, affine.0, affine.1));
                        k.write(v);
                    }
                }
                [mean, var, mean_after, var_after]
            },
        )
        .collect();
    // SAFETY: every channel's `batch` planes of both outputs were written above.
    unsafe {
        y.set_len(len);
        conv.set_len(len);
    }
    let stat = |i: usize| stats.iter().map(|s| s[i]).collect();
    DepthwiseBetween {
        y,
        conv,
        stats: [stat(0), stat(1), stat(2), stat(3)],
    }
}

/// One BatchNorm's `[gamma, beta, mean, variance]` (per channel) and epsilon.
pub type BatchNormState<'a> = ([&'a [f32]; 4], f32);

/// Gradients of [`depthwise_between_batch_norms`] for the output gradient `dy`, given its
/// input `x` and the convolution's output `conv`: `[dx, dgamma_before, dbeta_before,
/// dweight, dgamma_after, dbeta_after]`. Channel by channel: the second BatchNorm's backward
/// pass into a buffer of the channel's gradients at the convolution's output; each input
/// plane normalised again and sent back through the convolution
/// (`Depthwise::backward_plane`) into a buffer of the channel's gradients at the first
/// BatchNorm's output, summed for its backward pass while in the cache (`ChannelSums`);
/// then that backward pass. The gradients between the operations are never stored. The
/// values are those of the three backward passes one after the other, bit for bit.
pub fn depthwise_between_batch_norms_backward(
    g: &Conv,
    (x, conv, dy): (&[f32], &[f32], &[f32]),
    (before, weight, after): (BatchNormState<'_>, &[f32], BatchNormState<'_>),
) -> [Vec<f32>; 6] {
    let (c, kk, plane) = (g.in_channels, g.kernel * g.kernel, g.in_plane());
    let out_plane = g.out_plane().max(1);
    let plan = Depthwise::new(g);
    let (in_dims, out_dims) = ([g.batch, c, plane], [g.batch, c, g.out_plane()]);
    let mut dx: Vec<f32> = Vec::with_capacity(x.len());
    let out = ChannelOutput::new(&mut dx.spare_capacity_mut()[..x.len()], in_dims);
    let channel_grad = |(params, epsilon): BatchNormState<'_>, ch: usize| {
        ChannelGrad::new(params.map(|p| p[ch]), epsilon)
    };
    let per_channel: Vec<([f32; 4], Vec<f32>)> = (0..c)
        .into_par_iter()
        .map_init(
            || {
                let buffers = (Vec::new(), Vec::new(), Vec::new(), vec![0.0f32; kk]);
                (plan.scratch(), buffers)
            },
            |(scratch, (normalised, conv_grads, grads, image)), ch| {
                // the second BatchNorm
                let channel = channel_grad(after, ch);
                let planes =
                    channel_planes(conv, out_dims, ch).zip(channel_planes(dy, out_dims, ch));
                conv_grads.resize(g.batch * g.out_plane(), 0.0);
                let dst = conv_grads.chunks_mut(out_plane).map(as_uninit);
                let (dgamma_after, dbeta_after) = channel_backward(&channel, planes, dst);

                // the convolution, then the first BatchNorm's sums
                let channel = channel_grad(before, ch);
                let (s, t) = channel.affine;
                let filter = &weight[ch * kk..][..kk];
                // the filter gradient summed image by image, as `depthwise_backward` does
                let mut dfilter = vec![0.0f32; kk];
                let mut sums = ChannelSums::default();
                grads.resize(g.batch * plane, 0.0);
                let inputs = channel_planes(x, in_dims, ch).zip(conv_grads.chunks(out_plane));
                for ((src, grad), dst) in inputs.zip(grads.chunks_mut(plane.max(1))) {
                    let normal = scaled_relu6_into(normalised, src, s, t);
                    image.fill(0.0);
                    let dst_uninit = as_uninit(dst);
                    plan.backward_plane((normal, grad), filter, dst_uninit, image, scratch);
                    axpy(&mut dfilter, 1.0, image);
                    // while the plane's gradient is in the cache
                    sums.add(&channel, src, dst);
                }
                let planes = channel_planes(x, in_dims, ch).zip(grads.chunks(plane.max(1)));
                // SAFETY: this task is the only one writing channel `ch`.
                let dst = (0..g.batch).map(|b| unsafe { out.plane(b, ch) });
                let (dgamma, dbeta) = sums.finish(&channel, planes, dst);
                ([dgamma, dbeta, dgamma_after, dbeta_after], dfilter)
            },
        )
        .collect();
    // SAFETY: every channel's `batch` planes were written above.
    unsafe { dx.set_len(x.len()) };
    let param = |i: usize| per_channel.iter().map(|(p, _)| p[i]).collect();
    let dweight = per_channel
        .iter()
        .flat_map(|(_, w)| w.iter().copied())
        .collect();
    [dx, param(0), param(1), dweight, param(2), param(3)]
}
