//! The depthwise convolution with TF "SAME" padding and its two gradients as CubeCL kernels.
//!
//! Shapes, strides and pads are runtime arguments and every tensor is read through its own
//! strides, so each kernel compiles once per float type for the whole network (Burn's
//! grouped convolutions compile per layer geometry and copy their operands to channels-last
//! first). Positions are written in padded coordinates (`row = out_row * stride + tap`), so
//! the bounds tests need no signed arithmetic.

use burn::tensor::{Shape, TensorMetadata};
use burn_cubecl::CubeRuntime;
use burn_cubecl::ops::numeric::empty_device_dtype;
use burn_cubecl::tensor::CubeTensor;
use cubecl::calculate_cube_count_elemwise;
use cubecl::prelude::*;
use cubecl::server::CubeCountSelection;

use super::sums::{UNITS, cube_sum};
use crate::ops::cpu::same_padding;

/// `y[n, c, i, j] = sum over the taps of x[n, c, i s + ky - top, j s + kx - left] w[c, 0, ky, kx]`,
/// one unit per output value.
#[cube(launch)]
fn forward_kernel<F: Float>(
    x: &Tensor<F>,
    weight: &Tensor<F>,
    y: &mut Tensor<F>,
    stride: u32,
    pad_top: u32,
    pad_left: u32,
    #[define(F)] _dtype: StorageType,
) {
    if ABSOLUTE_POS >= y.len() {
        terminate!();
    }
    let step = stride as usize;
    let top = pad_top as usize;
    let left = pad_left as usize;
    let cols = y.shape(3);
    let rows = y.shape(2);
    let channels = y.shape(1);
    let j = ABSOLUTE_POS % cols;
    let i = (ABSOLUTE_POS / cols) % rows;
    let c = (ABSOLUTE_POS / (cols * rows)) % channels;
    let n = ABSOLUTE_POS / (cols * rows * channels);
    let kernel = weight.shape(2);
    let plane = n * x.stride(0) + c * x.stride(1);
    let mut sum = F::new(0.0);
    for ky in 0..kernel {
        let row = i * step + ky;
        if row >= top && row - top < x.shape(2) {
            for kx in 0..kernel {
                let col = j * step + kx;
                if col >= left && col - left < x.shape(3) {
                    let pixel = plane + (row - top) * x.stride(2) + (col - left) * x.stride(3);
                    let tap = c * weight.stride(0) + ky * weight.stride(2) + kx * weight.stride(3);
                    sum += x[pixel] * weight[tap];
                }
            }
        }
    }
    y[ABSOLUTE_POS] = sum;
}

/// `dx[n, c, y, x] = sum of grad[n, c, i, j] w[c, 0, ky, kx]` over the taps and outputs with
/// `i s + ky = y + top` and `j s + kx = x + left`, one unit per input value.
#[cube(launch)]
fn input_grad_kernel<F: Float>(
    grad: &Tensor<F>,
    weight: &Tensor<F>,
    dx: &mut Tensor<F>,
    stride: u32,
    pad_top: u32,
    pad_left: u32,
    #[define(F)] _dtype: StorageType,
) {
    if ABSOLUTE_POS >= dx.len() {
        terminate!();
    }
    let step = stride as usize;
    let width = dx.shape(3);
    let height = dx.shape(2);
    let channels = dx.shape(1);
    let col = ABSOLUTE_POS % width + pad_left as usize;
    let row = (ABSOLUTE_POS / width) % height + pad_top as usize;
    let c = (ABSOLUTE_POS / (width * height)) % channels;
    let n = ABSOLUTE_POS / (width * height * channels);
    let kernel = weight.shape(2);
    let plane = n * grad.stride(0) + c * grad.stride(1);
    let mut sum = F::new(0.0);
    for ky in 0..kernel {
        if row >= ky {
            let i = (row - ky) / step;
            if i * step == row - ky && i < grad.shape(2) {
                for kx in 0..kernel {
                    if col >= kx {
                        let j = (col - kx) / step;
                        if j * step == col - kx && j < grad.shape(3) {
                            let out = plane + i * grad.stride(2) + j * grad.stride(3);
                            let tap = c * weight.stride(0)
                                + ky * weight.stride(2)
                                + kx * weight.stride(3);
                            sum += grad[out] * weight[tap];
                        }
                    }
                }
            }
        }
    }
    dx[ABSOLUTE_POS] = sum;
}

/// `dw[c, 0, ky, kx] = sum over n, i, j of x[n, c, i s + ky - top, j s + kx - left] grad[n, c, i, j]`,
/// one cube per filter tap: each unit sums a strided share of the outputs, then the cube adds
/// the shares in shared memory.
#[cube(launch)]
fn filter_grad_kernel<F: Float>(
    x: &Tensor<F>,
    grad: &Tensor<F>,
    dweight: &mut Tensor<F>,
    stride: u32,
    pad_top: u32,
    pad_left: u32,
    #[comptime] units: u32,
    #[define(F)] _dtype: StorageType,
) {
    // uniform over the cube: the whole cube leaves or none of it
    if CUBE_POS >= dweight.len() {
        terminate!();
    }
    let step = stride as usize;
    let top = pad_top as usize;
    let left = pad_left as usize;
    let kernel = dweight.shape(3);
    let kx = CUBE_POS % kernel;
    let ky = (CUBE_POS / kernel) % kernel;
    let c = CUBE_POS / (kernel * kernel);
    let cols = grad.shape(3);
    let rows = grad.shape(2);
    let count = grad.shape(0) * rows * cols;
    let mut sum = F::new(0.0);
    let mut index = UNIT_POS as usize;
    while index < count {
        let j = index % cols;
        let i = (index / cols) % rows;
        let n = index / (cols * rows);
        let row = i * step + ky;
        let col = j * step + kx;
        if row >= top && row - top < x.shape(2) && col >= left && col - left < x.shape(3) {
            let pixel = n * x.stride(0)
                + c * x.stride(1)
                + (row - top) * x.stride(2)
                + (col - left) * x.stride(3);
            let out =
                n * grad.stride(0) + c * grad.stride(1) + i * grad.stride(2) + j * grad.stride(3);
            sum += x[pixel] * grad[out];
        }
        index += units as usize;
    }
    let mut shares = SharedMemory::<F>::new(units as usize);
    let total = cube_sum(&mut shares, sum);
    if UNIT_POS == 0 {
        dweight[CUBE_POS] = total;
    }
}

/// The output size and the top / left pads of a SAME convolution of `x` by a `kernel`-wide
/// filter.
fn geometry<R: CubeRuntime>(
    x: &CubeTensor<R>,
    kernel: usize,
    stride: usize,
) -> ([usize; 2], [u32; 2]) {
    let [_, _, h, w] = x.shape().dims();
    let (rows, top, _) = same_padding(h, kernel, stride);
    let (cols, left, _) = same_padding(w, kernel, stride);
    ([rows, cols], [top as u32, left as u32])
}

/// Launches an element-wise kernel over `out`'s values.
fn elementwise_count<R: CubeRuntime>(out: &CubeTensor<R>) -> (CubeCount, CubeDim) {
    let units = out.shape().num_elements();
    let cube_dim = CubeDim::new(&out.client, units);
    (
        calculate_cube_count_elemwise(&out.client, units, cube_dim),
        cube_dim,
    )
}

/// The depthwise convolution of `x [batch, channels, h, w]` by `weight [channels, 1, k, k]`
/// with SAME padding.
pub fn forward<R: CubeRuntime>(
    x: CubeTensor<R>,
    weight: CubeTensor<R>,
    stride: usize,
) -> CubeTensor<R> {
    let [batch, channels, _, _] = x.shape().dims();
    let kernel = weight.shape().dims::<4>()[2];
    let ([rows, cols], [top, left]) = geometry(&x, kernel, stride);
    let y = empty_device_dtype(
        x.client.clone(),
        x.device.clone(),
        Shape::new([batch, channels, rows, cols]),
        x.dtype,
    );
    let (count, dim) = elementwise_count(&y);
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
    let [_, _, h, w] = x_shape.dims();
    let (_, top, _) = same_padding(h, kernel, stride);
    let (_, left, _) = same_padding(w, kernel, stride);
    let dx = empty_device_dtype(
        grad.client.clone(),
        grad.device.clone(),
        x_shape,
        grad.dtype,
    );
    let (count, dim) = elementwise_count(&dx);
    let dtype = grad.dtype;
    input_grad_kernel::launch::<R>(
        &dx.client,
        count,
        dim,
        grad.into_tensor_arg(),
        weight.into_tensor_arg(),
        dx.clone().into_tensor_arg(),
        stride as u32,
        top as u32,
        left as u32,
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
    let channels = x.shape().dims::<4>()[1];
    let (_, [top, left]) = geometry(&x, kernel, stride);
    let dweight = empty_device_dtype(
        x.client.clone(),
        x.device.clone(),
        Shape::new([channels, 1, kernel, kernel]),
        x.dtype,
    );
    let taps = (channels * kernel * kernel) as u32;
    let count = CubeCountSelection::new(&x.client, taps).cube_count();
    let dtype = x.dtype;
    filter_grad_kernel::launch::<R>(
        &dweight.client,
        count,
        CubeDim::new_1d(UNITS),
        x.into_tensor_arg(),
        grad.into_tensor_arg(),
        dweight.clone().into_tensor_arg(),
        stride as u32,
        top,
        left,
        UNITS,
        dtype.into(),
    );
    dweight
}
