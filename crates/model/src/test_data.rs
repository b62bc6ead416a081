//! Seeded random tensors for the unit tests.
//!
//! Burn's `Tensor::random` draws from one generator per backend, shared by every test of the
//! process: tests running in parallel interleave their draws, so a seeded tensor would differ
//! from run to run. These draw from a generator of their own.

use burn::tensor::backend::Backend;
use burn::tensor::{Tensor, TensorData};
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};

/// A tensor of values drawn uniformly from `[low, high)`, the same for the same seed.
pub fn uniform<B: Backend, const D: usize>(
    shape: [usize; D],
    (low, high): (f32, f32),
    seed: u64,
    device: &B::Device,
) -> Tensor<B, D> {
    let mut rng = StdRng::seed_from_u64(seed);
    let values: Vec<f32> = (0..shape.iter().product())
        .map(|_| rng.random_range(low..high))
        .collect();
    Tensor::from_data(TensorData::new(values, shape), device)
}
