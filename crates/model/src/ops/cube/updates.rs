//! The per-parameter arithmetic of a training step as CubeCL kernels: the RMSProp update, the
//! moving average (weights' EMA, BatchNorm's moving statistics), the L2 gradient `x + alpha y`
//! and the L2 loss `sum(x^2) / 2`, each compiled once for every parameter.
//!
//! As Burn's operations, fusion joins the updates of neighbouring parameters into one kernel,
//! a different kernel for every grouping, rank and vector width: 37 of the 227 kernels a cold
//! pets training step compiled were RMSProp updates so joined, and 18 were sums of squares
//! (docs/src/performance.md). Here each is one launch of one kernel per parameter, reading the
//! tensors as flat arrays (contiguous first) with one unit per value.

use burn::tensor::{Shape, TensorMetadata};
use burn_cubecl::CubeRuntime;
use burn_cubecl::kernel::into_contiguous;
use burn_cubecl::ops::numeric::empty_device_dtype;
use burn_cubecl::tensor::CubeTensor;
use cubecl::prelude::*;

use super::sums::{UNITS, cube_sum, per_value};
use crate::ops::RmsPropStep;

/// `ms' = decay ms + (1 - decay) g^2`, `mom' = momentum mom + lr g / sqrt(ms' + epsilon)`,
/// `w' = w - mom'` (`tf.train.RMSPropOptimizer`), one unit per value.
#[cube(launch)]
#[allow(clippy::too_many_arguments)]
fn rmsprop_kernel<F: Float>(
    weights: &Tensor<F>,
    mean_square: &Tensor<F>,
    momentum: &Tensor<F>,
    grad: &Tensor<F>,
    new_weights: &mut Tensor<F>,
    new_mean_square: &mut Tensor<F>,
    new_momentum: &mut Tensor<F>,
    learning_rate: InputScalar,
    keep_momentum: InputScalar,
    decay: InputScalar,
    complement: InputScalar,
    epsilon: InputScalar,
    #[comptime] units: u32,
    #[define(F)] _dtype: StorageType,
) {
    let i = CUBE_POS * units as usize + UNIT_POS as usize;
    if i >= weights.len() {
        terminate!();
    }
    let g = grad[i];
    let ms = mean_square[i] * decay.get::<F>() + g * g * complement.get::<F>();
    let root = F::sqrt(ms + epsilon.get::<F>());
    let mom = momentum[i] * keep_momentum.get::<F>() + g * learning_rate.get::<F>() / root;
    new_mean_square[i] = ms;
    new_momentum[i] = mom;
    new_weights[i] = weights[i] - mom;
}

/// `out = a - (a - b scale) factor` (`factor = 1 - keep`: the moving average), or, with
/// `add`, `out = a + b factor`; one unit per value.
#[cube(launch)]
#[allow(clippy::too_many_arguments)]
fn combine_kernel<F: Float>(
    a: &Tensor<F>,
    b: &Tensor<F>,
    out: &mut Tensor<F>,
    factor: InputScalar,
    scale: InputScalar,
    add: u32,
    #[comptime] units: u32,
    #[define(F)] _dtype: StorageType,
) {
    let i = CUBE_POS * units as usize + UNIT_POS as usize;
    if i >= a.len() {
        terminate!();
    }
    let factor = factor.get::<F>();
    out[i] = select(
        add == 1,
        a[i] + b[i] * factor,
        a[i] - (a[i] - b[i] * scale.get::<F>()) * factor,
    );
}

/// `out[0] = sum(x^2) / 2`, by one cube.
#[cube(launch)]
fn half_squared_norm_kernel<F: Float>(
    x: &Tensor<F>,
    out: &mut Tensor<F>,
    #[comptime] units: u32,
    #[define(F)] _dtype: StorageType,
) {
    let mut sum = F::new(0.0);
    let mut i = UNIT_POS as usize;
    while i < x.len() {
        sum += x[i] * x[i];
        i += units as usize;
    }
    let mut shares = SharedMemory::<F>::new(units as usize);
    let total = cube_sum(&mut shares, sum);
    if UNIT_POS == 0 {
        out[0] = total * F::new(0.5);
    }
}

/// A new tensor of `like`'s shape and type on its device.
fn empty_like<R: CubeRuntime>(like: &CubeTensor<R>) -> CubeTensor<R> {
    empty_device_dtype(
        like.client.clone(),
        like.device.clone(),
        like.shape(),
        like.dtype,
    )
}

/// `[weights, mean_square, momentum]` after one RMSProp update with `grad`.
pub fn rmsprop<R: CubeRuntime>(
    state: [CubeTensor<R>; 3],
    grad: CubeTensor<R>,
    step: RmsPropStep,
) -> [CubeTensor<R>; 3] {
    let [w, ms, mom] = state.map(into_contiguous);
    let grad = into_contiguous(grad);
    let outputs = [&w, &ms, &mom].map(empty_like);
    let dtype = w.dtype;
    let scalar = |value: f32| InputScalar::new(value, dtype);
    let (count, dim) = per_value(&w);
    rmsprop_kernel::launch::<R>(
        &w.client.clone(),
        count,
        dim,
        w.into_tensor_arg(),
        ms.into_tensor_arg(),
        mom.into_tensor_arg(),
        grad.into_tensor_arg(),
        outputs[0].clone().into_tensor_arg(),
        outputs[1].clone().into_tensor_arg(),
        outputs[2].clone().into_tensor_arg(),
        scalar(step.learning_rate),
        scalar(step.momentum),
        scalar(step.decay),
        scalar(1.0 - step.decay),
        scalar(step.epsilon),
        UNITS,
        dtype.into(),
    );
    outputs
}

/// How [`combine`] joins its two tensors.
enum Combine {
    /// `a - (a - b scale) (1 - keep)`.
    MovingAverage { scale: f32, keep: f32 },
    /// `a + alpha b`.
    AddScaled { alpha: f32 },
}

fn combine<R: CubeRuntime>(a: CubeTensor<R>, b: CubeTensor<R>, how: Combine) -> CubeTensor<R> {
    let (a, b) = (into_contiguous(a), into_contiguous(b));
    let out = empty_like(&a);
    let (factor, scale, add) = match how {
        Combine::MovingAverage { scale, keep } => (1.0 - keep, scale, 0),
        Combine::AddScaled { alpha } => (alpha, 1.0, 1),
    };
    let dtype = a.dtype;
    let (count, dim) = per_value(&a);
    combine_kernel::launch::<R>(
        &a.client.clone(),
        count,
        dim,
        a.into_tensor_arg(),
        b.into_tensor_arg(),
        out.clone().into_tensor_arg(),
        InputScalar::new(factor, dtype),
        InputScalar::new(scale, dtype),
        add,
        UNITS,
        dtype.into(),
    );
    out
}

/// `average - (average - scale value) (1 - keep)`.
pub fn moving_average<R: CubeRuntime>(
    average: CubeTensor<R>,
    value: CubeTensor<R>,
    scale: f32,
    keep: f32,
) -> CubeTensor<R> {
    combine(average, value, Combine::MovingAverage { scale, keep })
}

/// `x + alpha y` for tensors of one shape.
pub fn add_scaled<R: CubeRuntime>(x: CubeTensor<R>, y: CubeTensor<R>, alpha: f32) -> CubeTensor<R> {
    combine(x, y, Combine::AddScaled { alpha })
}

/// `[sum(x^2) / 2]`.
pub fn half_squared_norm<R: CubeRuntime>(x: CubeTensor<R>) -> CubeTensor<R> {
    let x = into_contiguous(x);
    let out = empty_device_dtype(x.client.clone(), x.device.clone(), Shape::new([1]), x.dtype);
    let dtype = x.dtype;
    half_squared_norm_kernel::launch::<R>(
        &x.client.clone(),
        CubeCount::Static(1, 1, 1),
        CubeDim::new_1d(UNITS),
        x.into_tensor_arg(),
        out.clone().into_tensor_arg(),
        UNITS,
        dtype.into(),
    );
    out
}
