//! Training-mode BatchNorm + ReLU6 and its backward pass as CubeCL kernels, two launches each
//! way: the per-channel sums by one cube per channel, then the element-wise part by one cube
//! per plane (`[n, c]`); each unit walks a strided share of the planes, so none divides to
//! find its channel. Burn's operations take separate reductions and fused element-wise
//! kernels around them, which recompute every value's channel from its index (on lavapipe,
//! one training step's fused element-wise kernels took 8.0 s before these and 1.1 s after,
//! docs/src/performance.md).
//!
//! The formulas are [`reference`](crate::ops::reference)'s: `z = (x - mean) * scale + beta`
//! with `scale = gamma / sqrt(variance + epsilon)`, computed the same way forward and
//! backward, so ReLU6's mask is the same in both.

use burn::tensor::{Shape, TensorMetadata};
use burn_cubecl::CubeRuntime;
use burn_cubecl::kernel::into_contiguous;
use burn_cubecl::ops::numeric::empty_device_dtype;
use burn_cubecl::tensor::CubeTensor;
use cubecl::prelude::*;
use cubecl::server::CubeCountSelection;

use super::sums::{UNITS, cube_sum};

/// `1 / sqrt(variance + epsilon)`.
#[cube]
fn inv_std<F: Float>(variance: F, epsilon: F) -> F {
    F::new(1.0) / F::sqrt(variance + epsilon)
}

/// ReLU6's gradient: `grad` where `0 < z < 6`, else zero.
#[cube]
fn relu6_grad<F: Float>(z: F, grad: F) -> F {
    select(z > F::new(0.0) && z < F::new(6.0), grad, F::new(0.0))
}

/// Batch mean and biased variance of each channel (`x - mean` squared in a second pass),
/// one cube per channel.
#[cube(launch)]
fn statistics_kernel<F: Float>(
    x: &Tensor<F>,
    mean: &mut Tensor<F>,
    variance: &mut Tensor<F>,
    #[comptime] units: u32,
    #[define(F)] _dtype: StorageType,
) {
    let channels = x.shape(1);
    if CUBE_POS >= channels {
        terminate!();
    }
    let c = CUBE_POS;
    let plane = x.shape(2) * x.shape(3);
    let count = x.shape(0) * plane;
    let mut shares = SharedMemory::<F>::new(units as usize);
    let mut sum = F::new(0.0);
    for n in 0..x.shape(0) {
        let start = (n * channels + c) * plane;
        let mut p = UNIT_POS as usize;
        while p < plane {
            sum += x[start + p];
            p += units as usize;
        }
    }
    let m = cube_sum(&mut shares, sum) / F::cast_from(count as u32);
    let mut squares = F::new(0.0);
    for n in 0..x.shape(0) {
        let start = (n * channels + c) * plane;
        let mut p = UNIT_POS as usize;
        while p < plane {
            let d = x[start + p] - m;
            squares += d * d;
            p += units as usize;
        }
    }
    let v = cube_sum(&mut shares, squares) / F::cast_from(count as u32);
    if UNIT_POS == 0 {
        mean[c] = m;
        variance[c] = v;
    }
}

/// `y = clamp((x - mean) * scale + beta, 0, 6)`, one cube per plane.
#[cube(launch)]
#[allow(clippy::too_many_arguments)]
fn normalise_kernel<F: Float>(
    x: &Tensor<F>,
    mean: &Tensor<F>,
    variance: &Tensor<F>,
    gamma: &Tensor<F>,
    beta: &Tensor<F>,
    y: &mut Tensor<F>,
    epsilon: InputScalar,
    #[comptime] units: u32,
    #[define(F)] _dtype: StorageType,
) {
    let channels = x.shape(1);
    if CUBE_POS >= x.shape(0) * channels {
        terminate!();
    }
    let c = CUBE_POS % channels;
    let plane = x.shape(2) * x.shape(3);
    let scale = gamma[c] * inv_std::<F>(variance[c], epsilon.get::<F>());
    let m = mean[c];
    let b = beta[c];
    let start = CUBE_POS * plane;
    let mut p = UNIT_POS as usize;
    while p < plane {
        let z = (x[start + p] - m) * scale + b;
        let low = select(z > F::new(0.0), z, F::new(0.0));
        y[start + p] = select(low < F::new(6.0), low, F::new(6.0));
        p += units as usize;
    }
}

/// Per channel, `sum dz` (the offset's gradient) and `sum dz x_hat` (the scale's), where
/// `dz` is the output gradient where ReLU6 passed it; one cube per channel.
#[cube(launch)]
#[allow(clippy::too_many_arguments)]
fn gradient_sums_kernel<F: Float>(
    x: &Tensor<F>,
    grad: &Tensor<F>,
    mean: &Tensor<F>,
    variance: &Tensor<F>,
    gamma: &Tensor<F>,
    beta: &Tensor<F>,
    dgamma: &mut Tensor<F>,
    dbeta: &mut Tensor<F>,
    epsilon: InputScalar,
    #[comptime] units: u32,
    #[define(F)] _dtype: StorageType,
) {
    let channels = x.shape(1);
    if CUBE_POS >= channels {
        terminate!();
    }
    let c = CUBE_POS;
    let plane = x.shape(2) * x.shape(3);
    let unit_std = inv_std::<F>(variance[c], epsilon.get::<F>());
    let scale = gamma[c] * unit_std;
    let m = mean[c];
    let b = beta[c];
    let mut sum_dz = F::new(0.0);
    let mut sum_dz_x_hat = F::new(0.0);
    for n in 0..x.shape(0) {
        let start = (n * channels + c) * plane;
        let mut p = UNIT_POS as usize;
        while p < plane {
            let centred = x[start + p] - m;
            let z = centred * scale + b;
            let dz = relu6_grad::<F>(z, grad[start + p]);
            sum_dz += dz;
            sum_dz_x_hat += dz * centred * unit_std;
            p += units as usize;
        }
    }
    let mut shares = SharedMemory::<F>::new(units as usize);
    let total_dz = cube_sum(&mut shares, sum_dz);
    let total_dz_x_hat = cube_sum(&mut shares, sum_dz_x_hat);
    if UNIT_POS == 0 {
        dbeta[c] = total_dz;
        dgamma[c] = total_dz_x_hat;
    }
}

/// `dx = (count dz - sum dz - x_hat sum(dz x_hat)) scale / count`, one cube per plane.
#[cube(launch)]
#[allow(clippy::too_many_arguments)]
fn input_grad_kernel<F: Float>(
    x: &Tensor<F>,
    grad: &Tensor<F>,
    mean: &Tensor<F>,
    variance: &Tensor<F>,
    gamma: &Tensor<F>,
    beta: &Tensor<F>,
    dgamma: &Tensor<F>,
    dbeta: &Tensor<F>,
    dx: &mut Tensor<F>,
    epsilon: InputScalar,
    #[comptime] units: u32,
    #[define(F)] _dtype: StorageType,
) {
    let channels = x.shape(1);
    if CUBE_POS >= x.shape(0) * channels {
        terminate!();
    }
    let c = CUBE_POS % channels;
    let plane = x.shape(2) * x.shape(3);
    let count = F::cast_from((x.shape(0) * plane) as u32);
    let unit_std = inv_std::<F>(variance[c], epsilon.get::<F>());
    let scale = gamma[c] * unit_std;
    let m = mean[c];
    let b = beta[c];
    let sum_dz = dbeta[c];
    let sum_dz_x_hat = dgamma[c];
    let factor = scale / count;
    let start = CUBE_POS * plane;
    let mut p = UNIT_POS as usize;
    while p < plane {
        let centred = x[start + p] - m;
        let z = centred * scale + b;
        let dz = relu6_grad::<F>(z, grad[start + p]);
        dx[start + p] = (count * dz - sum_dz - centred * unit_std * sum_dz_x_hat) * factor;
        p += units as usize;
    }
}

/// One cube of [`UNITS`] per channel (`per_plane`: per plane) of `x [batch, channels, h, w]`.
fn cubes<R: CubeRuntime>(x: &CubeTensor<R>, per_plane: bool) -> (CubeCount, CubeDim) {
    let [batch, channels, _, _] = x.shape().dims();
    let cubes = if per_plane {
        batch * channels
    } else {
        channels
    };
    let count = CubeCountSelection::new(&x.client, cubes as u32).cube_count();
    (count, CubeDim::new_1d(UNITS))
}

/// A new `[channels]` tensor of `x`'s type on its device.
fn per_channel<R: CubeRuntime>(x: &CubeTensor<R>) -> CubeTensor<R> {
    let channels = x.shape().dims::<4>()[1];
    empty_device_dtype(
        x.client.clone(),
        x.device.clone(),
        Shape::new([channels]),
        x.dtype,
    )
}

/// `[y, mean, variance]` of training-mode BatchNorm + ReLU6.
pub fn forward<R: CubeRuntime>(
    x: CubeTensor<R>,
    gamma: CubeTensor<R>,
    beta: CubeTensor<R>,
    epsilon: f64,
) -> [CubeTensor<R>; 3] {
    let x = into_contiguous(x);
    let (mean, variance) = (per_channel(&x), per_channel(&x));
    let y = empty_device_dtype(x.client.clone(), x.device.clone(), x.shape(), x.dtype);
    let dtype = x.dtype;
    let (count, dim) = cubes(&x, false);
    statistics_kernel::launch::<R>(
        &x.client,
        count,
        dim,
        x.clone().into_tensor_arg(),
        mean.clone().into_tensor_arg(),
        variance.clone().into_tensor_arg(),
        UNITS,
        dtype.into(),
    );
    let (count, dim) = cubes(&x, true);
    normalise_kernel::launch::<R>(
        &x.client.clone(),
        count,
        dim,
        x.into_tensor_arg(),
        mean.clone().into_tensor_arg(),
        variance.clone().into_tensor_arg(),
        gamma.into_tensor_arg(),
        beta.into_tensor_arg(),
        y.clone().into_tensor_arg(),
        InputScalar::new(epsilon, dtype),
        UNITS,
        dtype.into(),
    );
    [y, mean, variance]
}

/// `[dx, dgamma, dbeta]` of [`forward`] for the output gradient `grad`.
pub fn backward<R: CubeRuntime>(
    [x, grad]: [CubeTensor<R>; 2],
    [gamma, beta, mean, variance]: [CubeTensor<R>; 4],
    epsilon: f64,
) -> [CubeTensor<R>; 3] {
    let (x, grad) = (into_contiguous(x), into_contiguous(grad));
    let (dgamma, dbeta) = (per_channel(&x), per_channel(&x));
    let dx = empty_device_dtype(x.client.clone(), x.device.clone(), x.shape(), x.dtype);
    let dtype = x.dtype;
    let client = x.client.clone();
    let (count, dim) = cubes(&x, false);
    gradient_sums_kernel::launch::<R>(
        &client,
        count,
        dim,
        x.clone().into_tensor_arg(),
        grad.clone().into_tensor_arg(),
        mean.clone().into_tensor_arg(),
        variance.clone().into_tensor_arg(),
        gamma.clone().into_tensor_arg(),
        beta.clone().into_tensor_arg(),
        dgamma.clone().into_tensor_arg(),
        dbeta.clone().into_tensor_arg(),
        InputScalar::new(epsilon, dtype),
        UNITS,
        dtype.into(),
    );
    let (count, dim) = cubes(&x, true);
    input_grad_kernel::launch::<R>(
        &client,
        count,
        dim,
        x.into_tensor_arg(),
        grad.into_tensor_arg(),
        mean.into_tensor_arg(),
        variance.into_tensor_arg(),
        gamma.into_tensor_arg(),
        beta.into_tensor_arg(),
        dgamma.clone().into_tensor_arg(),
        dbeta.clone().into_tensor_arg(),
        dx.clone().into_tensor_arg(),
        InputScalar::new(epsilon, dtype),
        UNITS,
        dtype.into(),
    );
    [dx, dgamma, dbeta]
}
