//! What the kernels of one cube per channel (or per filter tap) share: the cube's size and
//! the sum of one value from each of its units.

use cubecl::prelude::*;

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
