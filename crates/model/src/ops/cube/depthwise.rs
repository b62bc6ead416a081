//! The depthwise convolution with TF "SAME" padding and its two gradients as CubeCL kernels.
//!
//! Shapes, strides and pads are runtime arguments and every tensor is read through its own
//! strides, so each kernel compiles once per float type for the whole network (Burn's
//! grouped convolutions compile per layer geometry and copy their operands to channels-last
//! first). A cube of 256 units takes one plane `[n, c]`, each unit a strided share of its
//! positions, with the tensors' strides and sizes read once; the filter gradient sums each
//! image's share per tap in the cube, then the images' shares in a second kernel. Positions
//! are written in padded coordinates (`row = out_row * stride + tap`), so the bounds tests
//! need no signed arithmetic.

use burn::tensor::{Shape, TensorMetadata};
use burn_cubecl::CubeRuntime;
use burn_cubecl::ops::numeric::empty_device_dtype;
use burn_cubecl::tensor::CubeTensor;
use cubecl::prelude::*;
use cubecl::server::CubeCountSelection;

use super::sums::{UNITS, cube_sum, sum_partials};
use crate::ops::cpu::same_padding;

/// `y[n, c, i, j] = sum over the taps of x[n, c, i s + ky - top, j s + kx - left] w[c, 0, ky, kx]`,
/// one cube per plane `[n, c]`, each unit a strided share of its outputs.
#[cube(launch)]
#[allow(clippy::too_many_arguments)]
fn forward_kernel<F: Float>(
    x: &Tensor<F>,
    weight: &Tensor<F>,
    y: &mut Tensor<F>,
    stride: u32,
    pad_top: u32,
    pad_left: u32,
    #[comptime] units: u32,
    #[define(F)] _dtype: StorageType,
) {
    let channels = y.shape(1);
    if CUBE_POS >= y.shape(0) * channels {
        terminate!();
    }
    let c = CUBE_POS % channels;
    let x_plane = CUBE_POS / channels * x.stride(0) + c * x.stride(1);
    let x_row = x.stride(2);
    let x_col = x.stride(3);
    let height = x.shape(2);
    let width = x.shape(3);
    let taps = c * weight.stride(0);
    let w_row = weight.stride(2);
    let w_col = weight.stride(3);
    let kernel = weight.shape(2);
    let cols = y.shape(3);
    let plane = y.shape(2) * cols;
    let step = stride as usize;
    let top = pad_top as usize;
    let left = pad_left as usize;
    let mut p = UNIT_POS as usize;
    while p < plane {
        let i = p / cols;
        let j = p - i * cols;
        let mut sum = F::new(0.0);
        for ky in 0..kernel {
            let row = i * step + ky;
            if row >= top && row - top < height {
                let x_at = x_plane + (row - top) * x_row;
                let w_at = taps + ky * w_row;
                for kx in 0..kernel {
                    let col = j * step + kx;
                    if col >= left && col - left < width {
                        sum += x[x_at + (col - left) * x_col] * weight[w_at + kx * w_col];
                    }
                }
            }
        }
        y[CUBE_POS * plane + p] = sum;
        p += units as usize;
    }
}

/// `dx[n, c, y, x] = sum of grad[n, c, i, j] w[c, 0, ky, kx]` over the taps and outputs with
/// `i s + ky = y + top` and `j s + kx = x + left`, one cube per plane `[n, c]`.
#[cube(launch)]
#[allow(clippy::too_many_arguments)]
fn input_grad_kernel<F: Float>(
    grad: &Tensor<F>,
    weight: &Tensor<F>,
    dx: &mut Tensor<F>,
    stride: u32,
    pad_top: u32,
    pad_left: u32,
    #[comptime] units: u32,
    #[define(F)] _dtype: StorageType,
) {
    let channels = dx.shape(1);
    if CUBE_POS >= dx.shape(0) * channels {
        terminate!();
    }
    let c = CUBE_POS % channels;
    let g_plane = CUBE_POS / channels * grad.stride(0) + c * grad.stride(1);
    let g_row = grad.stride(2);
    let g_col = grad.stride(3);
    let rows = grad.shape(2);
    let cols = grad.shape(3);
    let taps = c * weight.stride(0);
    let w_row = weight.stride(2);
    let w_col = weight.stride(3);
    let kernel = weight.shape(2);
    let width = dx.shape(3);
    let plane = dx.shape(2) * width;
    let step = stride as usize;
    let mut p = UNIT_POS as usize;
    while p < plane {
        let y = p / width;
        // padded coordinates
        let row = y + pad_top as usize;
        let col = p - y * width + pad_left as usize;
        let mut sum = F::new(0.0);
        for ky in 0..kernel {
            if row >= ky {
                let i = (row - ky) / step;
                if i * step == row - ky && i < rows {
                    let g_at = g_plane + i * g_row;
                    let w_at = taps + ky * w_row;
                    for kx in 0..kernel {
                        if col >= kx {
                            let j = (col - kx) / step;
                            if j * step == col - kx && j < cols {
                                sum += grad[g_at + j * g_col] * weight[w_at + kx * w_col];
                            }
                        }
                    }
                }
            }
        }
        dx[CUBE_POS * plane + p] = sum;
        p += units as usize;
    }
}

/// `dw[n][c, 0, ky, kx] = sum over i, j of x[n, c, i s + ky - top, j s + kx - left] grad[n, c, i, j]`
/// (one image's share of the filter gradient), one cube per plane `[n, c]`: each unit takes a
/// strided share of the outputs, adding each output's gradient times the `kernel^2` inputs it
/// saw to one sum per tap, so the plane is read once; then the cube adds the shares tap by tap.
/// Compiled once per filter size (the sums are registers), 3 for every layer of this network.
#[cube(launch)]
#[allow(clippy::too_many_arguments)]
fn filter_grad_kernel<F: Float>(
    x: &Tensor<F>,
    grad: &Tensor<F>,
    partials: &mut Tensor<F>,
    stride: u32,
    pad_top: u32,
    pad_left: u32,
    #[comptime] kernel: u32,
    #[comptime] units: u32,
    #[define(F)] _dtype: StorageType,
) {
    let channels = grad.shape(1);
    // uniform over the cube: the whole cube leaves or none of it
    if CUBE_POS >= grad.shape(0) * channels {
        terminate!();
    }
    let n = CUBE_POS / channels;
    let c = CUBE_POS - n * channels;
    let x_plane = n * x.stride(0) + c * x.stride(1);
    let x_row = x.stride(2);
    let x_col = x.stride(3);
    let height = x.shape(2);
    let width = x.shape(3);
    let g_plane = n * grad.stride(0) + c * grad.stride(1);
    let g_row = grad.stride(2);
    let g_col = grad.stride(3);
    let cols = grad.shape(3);
    let plane = grad.shape(2) * cols;
    let step = stride as usize;
    let top = pad_top as usize;
    let left = pad_left as usize;
    let k = comptime!(kernel as usize);
    let taps = comptime!((kernel * kernel) as usize);
    let mut sums = Array::<F>::new(taps);
    #[unroll]
    for t in 0..taps {
        sums[t] = F::new(0.0);
    }
    let mut p = UNIT_POS as usize;
    while p < plane {
        let i = p / cols;
        let j = p - i * cols;
        let g = grad[g_plane + i * g_row + j * g_col];
        #[unroll]
        for ky in 0..k {
            let row = i * step + ky;
            if row >= top && row - top < height {
                let x_at = x_plane + (row - top) * x_row;
                #[unroll]
                for kx in 0..k {
                    let col = j * step + kx;
                    if col >= left && col - left < width {
                        sums[ky * k + kx] += x[x_at + (col - left) * x_col] * g;
                    }
                }
            }
        }
        p += units as usize;
    }
    let mut shares = SharedMemory::<F>::new(units as usize);
    #[unroll]
    for t in 0..taps {
        let total = cube_sum(&mut shares, sums[t]);
        if UNIT_POS == 0 {
            partials[CUBE_POS * taps + t] = total;
        }
    }
}

/// The output shape and the top / left pads of a depthwise SAME convolution of an input
/// `x_shape [batch, channels, h, w]` by a `kernel`-wide filter.
pub(super) fn geometry(x_shape: &Shape, kernel: usize, stride: usize) -> (Shape, [u32; 2]) {
    let [batch, channels, h, w] = x_shape.dims();
    let (rows, top, _) = same_padding(h, kernel, stride);
    let (cols, left, _) = same_padding(w, kernel, stride);
    (
        Shape::new([batch, channels, rows, cols]),
        [top as u32, left as u32],
    )
}

/// One cube of [`UNITS`] per plane `[n, c]` of `out [batch, channels, h, w]`.
fn plane_cubes<R: CubeRuntime>(out: &CubeTensor<R>) -> (CubeCount, CubeDim) {
    let [batch, channels, _, _] = out.shape().dims();
    let cubes = (batch * channels) as u32;
    let count = CubeCountSelection::new(&out.client, cubes).cube_count();
    (count, CubeDim::new_1d(UNITS))
}

/// The depthwise convolution of `x [batch, channels, h, w]` by `weight [channels, 1, k, k]`
/// with SAME padding.
pub fn forward<R: CubeRuntime>(
    x: CubeTensor<R>,
    weight: CubeTensor<R>,
    stride: usize,
) -> CubeTensor<R> {
    let kernel = weight.shape().dims::<4>()[2];
    let (out_shape, [top, left]) = geometry(&x.shape(), kernel, stride);
    let y = empty_device_dtype(x.client.clone(), x.device.clone(), out_shape, x.dtype);
    let (count, dim) = plane_cubes(&y);
    let dtype = x.dtype;
    forward_kernel::launch::<R>(
        &y.client,
        count,
        dim,
        x.into_tensor_arg(),
        weight.into_tensor_arg(),
        y.clone().into_tensor_arg(),
        stride as u32,
        top,
        left,
        UNITS,
        dtype.into(),
    );
    y
}

/// The input gradient of [`forward`] for an input `x_shape`, given the output gradient.
pub fn input_grad<R: CubeRuntime>(
    x_shape: Shape,
    weight: CubeTensor<R>,
    grad: CubeTensor<R>,
    stride: usize,
) -> CubeTensor<R> {
    let kernel = weight.shape().dims::<4>()[2];
    let (_, [top, left]) = geometry(&x_shape, kernel, stride);
    let dx = empty_device_dtype(
        grad.client.clone(),
        grad.device.clone(),
        x_shape,
        grad.dtype,
    );
    let (count, dim) = plane_cubes(&dx);
    let dtype = grad.dtype;
    input_grad_kernel::launch::<R>(
        &dx.client,
        count,
        dim,
        grad.into_tensor_arg(),
        weight.into_tensor_arg(),
        dx.clone().into_tensor_arg(),
        stride as u32,
        top,
        left,
        UNITS,
        dtype.into(),
    );
    dx
}

/// The filter gradient of [`forward`] (`[channels, 1, k, k]`), given its input and the
/// output gradient.
pub fn filter_grad<R: CubeRuntime>(
    x: CubeTensor<R>,
    grad: CubeTensor<R>,
    kernel: usize,
    stride: usize,
) -> CubeTensor<R> {
    let [batch, channels, _, _] = x.shape().dims();
    let (_, [top, left]) = geometry(&x.shape(), kernel, stride);
    let shape = Shape::new([channels, 1, kernel, kernel]);
    let partials = empty_device_dtype(
        x.client.clone(),
        x.device.clone(),
        Shape::new([batch * channels, 1, kernel, kernel]),
        x.dtype,
    );
    let (count, dim) = plane_cubes(&grad);
    let dtype = x.dtype;
    filter_grad_kernel::launch::<R>(
        &partials.client,
        count,
        dim,
        x.into_tensor_arg(),
        grad.into_tensor_arg(),
        partials.clone().into_tensor_arg(),
        stride as u32,
        top,
        left,
        kernel as u32,
        UNITS,
        dtype.into(),
    );
    sum_partials(partials, batch, shape)
}
