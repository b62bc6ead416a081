//! CPU kernels for the network's layers on contiguous NCHW `f32` buffers, one family a
//! module: TF-"SAME" convolutions (`conv`: dense through im2col + GEMM; `depthwise`:
//! directly), training-mode BatchNorm + ReLU6 (`batch_norm`), the two fused around a
//! depthwise convolution (`depthwise_between`), the loss's sigmoid cross-entropy
//! (`loss`) and the optimizer's element-wise updates (`update`), each with its backward
//! pass where it has one. Work is split over rayon's pool.

mod batch_norm;
mod conv;
mod depthwise;
mod depthwise_between;
mod loss;
mod matrix;
mod slices;
mod update;

pub use batch_norm::{affine_relu6_in_place, batch_norm_relu6, batch_norm_relu6_backward};
pub use conv::{bias_grad, conv_backward, conv_forward};
pub use depthwise::{depthwise_backward, depthwise_forward};
pub use depthwise_between::{
    DepthwiseBetween, depthwise_between_batch_norms, depthwise_between_batch_norms_backward,
};
pub use loss::{sigmoid_cross_entropy, sigmoid_cross_entropy_backward};
pub use matrix::batched_transpose;
pub use update::{
    add_scaled_in_place, half_squared_norm, moving_average_in_place, rmsprop_update_in_place,
};

use rayon::prelude::*;

/// Output size and leading padding of TF "SAME" along one axis: `out = ceil(size / stride)`,
/// total padding `max((out - 1) * stride + kernel - size, 0)`, the smaller half first:
/// `(out, before, after)`.
pub fn same_padding(size: usize, kernel: usize, stride: usize) -> (usize, usize, usize) {
    let out = size.div_ceil(stride);
    let total = ((out.saturating_sub(1)) * stride + kernel).saturating_sub(size);
    (out, total / 2, total - total / 2)
}

/// What a convolution does to each output plane right after computing it, while the plane
/// is still in cache (instead of another pass over the whole output).
#[derive(Debug, Clone, Copy)]
pub enum Epilogue<'a> {
    /// Nothing: the convolution's output as it is.
    None,
    /// `y + bias[c]`.
    Bias(&'a [f32]),
    /// `clamp(y * scale[c] + shift[c], 0, 6)`: inference-mode BatchNorm folded into a
    /// per-channel affine map, then ReLU6.
    AffineRelu6 {
        /// Per-channel factor.
        scale: &'a [f32],
        /// Per-channel offset.
        shift: &'a [f32],
    },
}

impl Epilogue<'_> {
    /// Applies the epilogue to `values`, one plane of channel `c`.
    fn apply(self, values: &mut [f32], c: usize) {
        match self {
            Self::None => {}
            Self::Bias(bias) => {
                let b = bias[c];
                values.iter_mut().for_each(|v| *v += b);
            }
            Self::AffineRelu6 { scale, shift } => {
                let (s, t) = (scale[c], shift[c]);
                values.iter_mut().for_each(|v| *v = scaled_relu6(*v, s, t));
            }
        }
    }

    /// Applies the epilogue to every plane of `[batch, channels, plane]` data, over rayon's
    /// pool when `parallel`.
    pub fn apply_planes(self, values: &mut [f32], plane: usize, parallel: bool) {
        let channels = match self {
            Self::None => return,
            Self::Bias(bias) => bias.len(),
            Self::AffineRelu6 { scale, .. } => scale.len(),
        };
        let plane = plane.max(1);
        if parallel {
            let chunks = values.par_chunks_mut(plane).enumerate();
            chunks.for_each(|(p, values)| self.apply(values, p % channels));
        } else {
            let chunks = values.chunks_mut(plane).enumerate();
            chunks.for_each(|(p, values)| self.apply(values, p % channels));
        }
    }
}

/// Geometry of one convolution.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Conv {
    pub batch: usize,
    pub in_channels: usize,
    pub height: usize,
    pub width: usize,
    pub out_channels: usize,
    pub kernel: usize,
    pub stride: usize,
    pub out_height: usize,
    pub out_width: usize,
    pub pad_top: usize,
    pub pad_left: usize,
}

impl Conv {
    /// The geometry of a SAME convolution of `[batch, in_channels, height, width]` by a
    /// `kernel x kernel` filter bank with `out_channels` outputs.
    pub fn same(
        [batch, in_channels, height, width]: [usize; 4],
        out_channels: usize,
        kernel: usize,
        stride: usize,
    ) -> Self {
        let (out_height, pad_top, _) = same_padding(height, kernel, stride);
        let (out_width, pad_left, _) = same_padding(width, kernel, stride);
        Self {
            batch,
            in_channels,
            height,
            width,
            out_channels,
            kernel,
            stride,
            out_height,
            out_width,
            pad_top,
            pad_left,
        }
    }

    fn in_plane(&self) -> usize {
        self.height * self.width
    }

    fn out_plane(&self) -> usize {
        self.out_height * self.out_width
    }

    /// Rows of the im2col matrix: one per (input channel, kernel row, kernel column).
    fn patch(&self) -> usize {
        self.in_channels * self.kernel * self.kernel
    }

    /// A 1x1 stride-1 convolution reads its input as the im2col matrix itself.
    fn is_pointwise(&self) -> bool {
        self.kernel == 1 && self.stride == 1
    }

    /// Output columns `lo..hi` whose input column `ox * stride + kx - pad_left` is inside
    /// the image.
    fn valid_columns(&self, kx: usize) -> (usize, usize) {
        valid_range(self.out_width, self.width, self.stride, kx, self.pad_left)
    }

    /// The input row read by output row `oy` at kernel row `ky`, if inside the image.
    fn input_row(&self, oy: usize, ky: usize) -> Option<usize> {
        (oy * self.stride + ky)
            .checked_sub(self.pad_top)
            .filter(|&iy| iy < self.height)
    }
}

/// Outputs `o` in `0..out` with `o * stride + k - pad` in `0..size`, as a range.
fn valid_range(out: usize, size: usize, stride: usize, k: usize, pad: usize) -> (usize, usize) {
    let lo = pad.saturating_sub(k).div_ceil(stride);
    let hi = if size + pad > k {
        ((size + pad - k - 1) / stride + 1).min(out)
    } else {
        0
    };
    (lo.min(hi), hi)
}

/// `clamp(v * s + t, 0, 6)`.
#[inline]
fn scaled_relu6(v: f32, s: f32, t: f32) -> f32 {
    (v * s + t).clamp(0.0, 6.0)
}
