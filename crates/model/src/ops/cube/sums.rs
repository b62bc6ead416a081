//! What the reducing kernels share: the cube's size, the sum of one value from each of its
//! units, and the sum of partial results computed by separate cubes.

use burn::tensor::{Shape, TensorMetadata};
use burn_cubecl::CubeRuntime;
use burn_cubecl::ops::numeric::empty_device_dtype;
use burn_cubecl::tensor::CubeTensor;
use cubecl::prelude::*;
use cubecl::server::CubeCountSelection;

/// Units of a cube that reduces with [`cube_sum`]: a power of two (the sum halves them).
pub const UNITS: u32 = 256;

/// The sum of every unit's `value`, returned to every unit. `shares` holds one value per unit
/// (the cube's size); it may be used again after the call.
#[cube]
pub fn cube_sum<F: Float>(shares: &mut SharedMemory<F>, value: F) -> F {
    let unit = UNIT_POS as usize;
    shares[unit] = value;
    sync_cube();
    // a runtime count: a value computed from a compile-time one would itself be
    // compile-time, which a loop cannot change
    let mut half = CUBE_DIM as usize / 2;
    while half > 0 {
        if unit < half {
            shares[unit] = shares[unit] + shares[unit + half];
        }
        sync_cube();
        half /= 2;
    }
    let total = shares[0];
    // every unit has read the total before any writes its next value
    sync_cube();
    total
}

/// `out[i] = sum over s of partials[s len + i]`, one unit per value.
#[cube(launch)]
fn sum_partials_kernel<F: Float>(
    partials: &Tensor<F>,
    out: &mut Tensor<F>,
    parts: u32,
    #[comptime] units: u32,
    #[define(F)] _dtype: StorageType,
) {
    let i = CUBE_POS * units as usize + UNIT_POS as usize;
    let len = out.len();
    if i >= len {
        terminate!();
    }
    let mut sum = F::new(0.0);
    for s in 0..parts as usize {
        sum += partials[s * len + i];
    }
    out[i] = sum;
}

/// The sum of the `parts` equal blocks `partials` holds (contiguous, one after the other), as
/// a tensor of `shape`; `partials` itself, reshaped, when it holds one.
pub fn sum_partials<R: CubeRuntime>(
    partials: CubeTensor<R>,
    parts: usize,
    shape: Shape,
) -> CubeTensor<R> {
    let client = partials.client.clone();
    let dtype = partials.dtype;
    if parts == 1 {
        return burn_cubecl::ops::reshape(partials, shape);
    }
    let out = empty_device_dtype(client.clone(), partials.device.clone(), shape, dtype);
    let (count, dim) = per_value(&out);
    sum_partials_kernel::launch::<R>(
        &client,
        count,
        dim,
        partials.into_tensor_arg(),
        out.clone().into_tensor_arg(),
        parts as u32,
        UNITS,
        dtype.into(),
    );
    out
}

/// One unit per value of `x`, in cubes of [`UNITS`]: the launch of the element-wise kernels.
pub fn per_value<R: CubeRuntime>(x: &CubeTensor<R>) -> (CubeCount, CubeDim) {
    let cubes = x.shape().num_elements().div_ceil(UNITS as usize).max(1);
    let count = CubeCountSelection::new(&x.client, cubes as u32).cube_count();
    (count, CubeDim::new_1d(UNITS))
}
