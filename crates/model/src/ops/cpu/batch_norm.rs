//! Training-mode BatchNorm + ReLU6 (batch statistics, normalisation, backward pass) and the
//! inference-mode affine map + ReLU6.

use std::mem::MaybeUninit;

use super::Epilogue;
use super::scaled_relu6;
use super::slices::{STATISTICS_LANES, sum_and_squares};

use rayon::prelude::*;

/// Mean and biased variance of one channel's planes, in one pass: sums of `x` and
/// `(x - k)^2` with `k` the channel's first value (close enough to the mean that
/// `E[(x - k)^2] - (mean - k)^2` loses no precision that matters), per plane in lanes, across
/// planes in `f64`.
pub(super) fn moments<'a>(planes: impl Iterator<Item = &'a [f32]> + Clone) -> (f32, f32) {
    let k = planes
        .clone()
        .find_map(|p| p.first().copied())
        .unwrap_or(0.0);
    let (mut sum, mut squares, mut count) = (0.0f64, 0.0f64, 0usize);
    for p in planes {
        let (s, q) = sum_and_squares(p, k);
        sum += s as f64;
        squares += q as f64;
        count += p.len();
    }
    let count = count.max(1) as f64;
    let mean = sum / count;
    let var = (squares / count - (mean - k as f64).powi(2)).max(0.0);
    (mean as f32, var as f32)
}

/// The planes of `[batch, channels, plane]` data that belong to channel `c`.
pub(super) fn channel_planes(
    x: &[f32],
    [batch, channels, plane]: [usize; 3],
    c: usize,
) -> impl Iterator<Item = &[f32]> + Clone {
    (0..batch).map(move |b| &x[(b * channels + c) * plane..][..plane])
}

/// An output of `[batch, channels, plane]` values that parallel tasks fill channel by
/// channel: each task writes the planes of its own channel, which no other task touches.
pub(super) struct ChannelOutput<'a> {
    values: *mut MaybeUninit<f32>,
    dims: [usize; 3],
    _buffer: std::marker::PhantomData<&'a mut [MaybeUninit<f32>]>,
}

// SAFETY: tasks only reach the buffer through `plane`, whose contract keeps their writes
// disjoint.
unsafe impl Send for ChannelOutput<'_> {}
unsafe impl Sync for ChannelOutput<'_> {}

impl<'a> ChannelOutput<'a> {
    pub(super) fn new(values: &'a mut [MaybeUninit<f32>], dims: [usize; 3]) -> Self {
        assert_eq!(values.len(), dims.iter().product::<usize>());
        Self {
            values: values.as_mut_ptr(),
            dims,
            _buffer: std::marker::PhantomData,
        }
    }

    /// Plane `b` of channel `c`.
    ///
    /// # Safety
    /// Only one task may hold a given `(b, c)` plane at a time.
    #[allow(clippy::mut_from_ref)]
    pub(super) unsafe fn plane(&self, b: usize, c: usize) -> &mut [MaybeUninit<f32>] {
        let [batch, channels, plane] = self.dims;
        assert!(b < batch && c < channels);
        // SAFETY: in bounds by the assertion; exclusive by the caller's contract.
        unsafe {
            std::slice::from_raw_parts_mut(self.values.add((b * channels + c) * plane), plane)
        }
    }
}

/// `x <- clamp(x * scale[c] + shift[c], 0, 6)` over `[batch, channels, plane]` data, in
/// place (inference: the convolution's output buffer becomes the layer's output).
pub fn affine_relu6_in_place(x: &mut [f32], plane: usize, scale: &[f32], shift: &[f32]) {
    Epilogue::AffineRelu6 { scale, shift }.apply_planes(x, plane, true);
}

/// Training-mode BatchNorm followed by ReLU6 over `[batch, channels, plane]` data:
/// `(y, mean, variance)` with the batch mean and biased variance. Channel by channel, so
/// that the normalising pass reads the planes the statistics pass just brought into the
/// cache.
pub fn batch_norm_relu6(
    x: &[f32],
    [batch, plane]: [usize; 2],
    gamma: &[f32],
    beta: &[f32],
    epsilon: f32,
) -> (Vec<f32>, Vec<f32>, Vec<f32>) {
    let dims = [batch, gamma.len(), plane];
    let mut y: Vec<f32> = Vec::with_capacity(x.len());
    let out = ChannelOutput::new(&mut y.spare_capacity_mut()[..x.len()], dims);
    let (mean, var) = (0..gamma.len())
        .into_par_iter()
        .map(|c| {
            let (mean, var) = moments(channel_planes(x, dims, c));
            let (s, t) = channel_affine(gamma[c], beta[c], mean, var, epsilon);
            for (b, src) in channel_planes(x, dims, c).enumerate() {
                // SAFETY: this task is the only one writing channel `c`.
                let dst = unsafe { out.plane(b, c) };
                for (o, &v) in dst.iter_mut().zip(src) {
                    o.write(scaled_relu6(v, s, t));
                }
            }
            (mean, var)
        })
        .unzip();
    // SAFETY: every channel's `batch` planes were written above.
    unsafe { y.set_len(x.len()) };
    (y, mean, var)
}

/// `(scale, shift)` of one channel of a training-mode BatchNorm: `gamma / sqrt(var + eps)`
/// and `beta - mean * scale` (the forward and backward passes share this arithmetic, so the
/// backward pass's ReLU6 mask is the forward pass's exactly).
pub(super) fn channel_affine(
    gamma: f32,
    beta: f32,
    mean: f32,
    var: f32,
    epsilon: f32,
) -> (f32, f32) {
    let scale = gamma / (var + epsilon).sqrt();
    (scale, beta - mean * scale)
}

/// One channel's constants in [`batch_norm_relu6_backward`].
pub(super) struct ChannelGrad {
    /// The forward pass's `(scale, shift)`.
    pub(super) affine: (f32, f32),
    mean: f32,
    inv_std: f32,
}

impl ChannelGrad {
    pub(super) fn new([gamma, beta, mean, variance]: [f32; 4], epsilon: f32) -> Self {
        Self {
            affine: channel_affine(gamma, beta, mean, variance, epsilon),
            mean,
            inv_std: 1.0 / (variance + epsilon).sqrt(),
        }
    }

    /// The output gradient `g` where ReLU6 passes it: where its input `x * scale + shift`
    /// was strictly inside `(0, 6)` (TF's `Relu6Grad`), computed with the forward pass's
    /// arithmetic, so the mask is the forward pass's exactly.
    #[inline]
    pub(super) fn masked(&self, g: f32, x: f32) -> f32 {
        let (s, t) = self.affine;
        let z = x * s + t;
        if z > 0.0 && z < 6.0 { g } else { 0.0 }
    }

    /// `(sum(dz), sum(dz * (x - mean)))` over one plane's inputs `xs` and output gradients
    /// `gs`, `dz` the masked gradient, in lanes.
    pub(super) fn plane_sums(&self, xs: &[f32], gs: &[f32]) -> (f32, f32) {
        let m = self.mean;
        let (mut a, mut d) = ([0.0f32; STATISTICS_LANES], [0.0f32; STATISTICS_LANES]);
        let (xc, gc) = (
            xs.chunks_exact(STATISTICS_LANES),
            gs.chunks_exact(STATISTICS_LANES),
        );
        let (mut ta, mut td) = (0.0f32, 0.0f32);
        for (&xv, &g) in xc.remainder().iter().zip(gc.remainder()) {
            let dz = self.masked(g, xv);
            td += dz;
            ta += dz * (xv - m);
        }
        for (xv, g) in xc.zip(gc) {
            for i in 0..STATISTICS_LANES {
                let dz = self.masked(g[i], xv[i]);
                d[i] += dz;
                a[i] += dz * (xv[i] - m);
            }
        }
        (d.iter().sum::<f32>() + td, a.iter().sum::<f32>() + ta)
    }
}

/// The sums of one channel's [`ChannelGrad::plane_sums`], added plane by plane in order.
#[derive(Default)]
pub(super) struct ChannelSums {
    dz: f64,
    dz_centred: f64,
    count: usize,
}

impl ChannelSums {
    pub(super) fn add(&mut self, channel: &ChannelGrad, xs: &[f32], gs: &[f32]) {
        let (dz, dz_centred) = channel.plane_sums(xs, gs);
        self.dz += dz as f64;
        self.dz_centred += dz_centred as f64 * channel.inv_std as f64;
        self.count += xs.len();
    }

    /// Writes the channel's input-gradient planes into `out`, one for each of its `(input,
    /// output gradient)` planes, and returns `(dgamma, dbeta)`.
    pub(super) fn finish<'a, 'o>(
        self,
        channel: &ChannelGrad,
        planes: impl Iterator<Item = (&'a [f32], &'a [f32])>,
        out: impl Iterator<Item = &'o mut [MaybeUninit<f32>]>,
    ) -> (f32, f32) {
        let (dgamma, dbeta) = (self.dz_centred as f32, self.dz as f32);
        let count = self.count as f32;
        let (mean_dz, mean_dz_xhat) = (dbeta / count, dgamma / count);
        let (s, m, inv_std) = (channel.affine.0, channel.mean, channel.inv_std);
        for ((xs, gs), dst) in planes.zip(out) {
            for ((o, &xv), &g) in dst.iter_mut().zip(xs).zip(gs) {
                let xhat = (xv - m) * inv_std;
                o.write(s * (channel.masked(g, xv) - mean_dz - xhat * mean_dz_xhat));
            }
        }
        (dgamma, dbeta)
    }
}

/// One channel's BatchNorm + ReLU6 backward pass: the sums over its `(input, output
/// gradient)` planes ([`ChannelSums`]), then its input-gradient planes into `out` from the
/// planes the sums just brought into the cache; returns `(dgamma, dbeta)`.
pub(super) fn channel_backward<'a, 'o>(
    channel: &ChannelGrad,
    planes: impl Iterator<Item = (&'a [f32], &'a [f32])> + Clone,
    out: impl Iterator<Item = &'o mut [MaybeUninit<f32>]>,
) -> (f32, f32) {
    let mut sums = ChannelSums::default();
    for (xs, gs) in planes.clone() {
        sums.add(channel, xs, gs);
    }
    sums.finish(channel, planes, out)
}

/// Gradients of [`batch_norm_relu6`]: `(dx, dgamma, dbeta)`, channel by channel
/// (`channel_backward`).
pub fn batch_norm_relu6_backward(
    x: &[f32],
    dy: &[f32],
    [batch, plane]: [usize; 2],
    [gamma, beta]: [&[f32]; 2],
    [mean, variance]: [&[f32]; 2],
    epsilon: f32,
) -> (Vec<f32>, Vec<f32>, Vec<f32>) {
    let dims = [batch, gamma.len(), plane];
    let mut dx: Vec<f32> = Vec::with_capacity(x.len());
    let out = ChannelOutput::new(&mut dx.spare_capacity_mut()[..x.len()], dims);
    let (dgamma, dbeta) = (0..gamma.len())
        .into_par_iter()
        .map(|c| {
            let channel = ChannelGrad::new([gamma[c], beta[c], mean[c], variance[c]], epsilon);
            let planes = channel_planes(x, dims, c).zip(channel_planes(dy, dims, c));
            // SAFETY: this task is the only one writing channel `c`.
            let dst = (0..batch).map(|b| unsafe { out.plane(b, c) });
            channel_backward(&channel, planes, dst)
        })
        .unzip();
    // SAFETY: every channel's `batch` planes were written above.
    unsafe { dx.set_len(x.len()) };
    (dx, dgamma, dbeta)
}

/// `clamp(v * s + t, 0, 6)` of every value of `src`, into `dst`: a plane of a training
/// BatchNorm + ReLU6's output, made where it is consumed instead of stored.
pub(super) fn scaled_relu6_into<'a>(
    dst: &'a mut Vec<f32>,
    src: &[f32],
    s: f32,
    t: f32,
) -> &'a [f32] {
    dst.clear();
    dst.extend(src.iter().map(|&v| scaled_relu6(v, s, t)));
    dst
}
