//! The training step's element-wise updates over parameter slices, in place and in parallel:
//! the L2 term's norm, `x += alpha y`, RMSProp and the weight EMA.

use super::slices::{axpy, dot};

use rayon::prelude::*;

use crate::ops::RmsPropStep;

/// `sum(x^2) / 2`, summed in lanes per 4096 values and in `f64` across them, in order (the
/// parallel chunks' partial sums are added one after the other, so the result does not
/// depend on the thread count).
pub fn half_squared_norm(x: &[f32]) -> f32 {
    let partials: Vec<f64> = x.par_chunks(4096).map(|c| dot(c, c) as f64).collect();
    (partials.iter().sum::<f64>() / 2.0) as f32
}

/// `x += alpha y`, in parallel.
pub fn add_scaled_in_place(x: &mut [f32], y: &[f32], alpha: f32) {
    assert_eq!(x.len(), y.len());
    x.par_chunks_mut(ELEMENTWISE_CHUNK)
        .zip(y.par_chunks(ELEMENTWISE_CHUNK))
        .for_each(|(x, y)| axpy(x, alpha, y));
}

/// Values per task of the parallel element-wise loops below.
const ELEMENTWISE_CHUNK: usize = 1 << 14;

/// [`RmsPropStep`] over slices, in place and in one parallel pass: `(w, ms, mom)` become
/// their values after the update. In place because writing three new parameter-sized buffers
/// cost more than the update itself: 5.5 M values on two cores, 13-28 ms into new buffers
/// against 2-5 ms in place.
pub fn rmsprop_update_in_place([w, ms, mom]: [&mut [f32]; 3], grad: &[f32], step: RmsPropStep) {
    let n = grad.len();
    assert!(w.len() == n && ms.len() == n && mom.len() == n);
    w.par_chunks_mut(ELEMENTWISE_CHUNK)
        .zip(ms.par_chunks_mut(ELEMENTWISE_CHUNK))
        .zip(mom.par_chunks_mut(ELEMENTWISE_CHUNK))
        .zip(grad.par_chunks(ELEMENTWISE_CHUNK))
        .for_each(|(((w, ms), mom), grad)| {
            for (((w, ms), mom), &g) in w.iter_mut().zip(ms).zip(mom).zip(grad) {
                *ms = *ms * step.decay + g * g * (1.0 - step.decay);
                *mom = *mom * step.momentum + g * step.learning_rate / (*ms + step.epsilon).sqrt();
                *w -= *mom;
            }
        });
}

/// `average <- average - (1 - keep) (average - scale value)`, in place and in parallel.
pub fn moving_average_in_place(average: &mut [f32], value: &[f32], scale: f32, keep: f32) {
    assert_eq!(value.len(), average.len());
    average
        .par_chunks_mut(ELEMENTWISE_CHUNK)
        .zip(value.par_chunks(ELEMENTWISE_CHUNK))
        .for_each(|(average, value)| {
            for (a, &v) in average.iter_mut().zip(value) {
                *a -= (*a - v * scale) * (1.0 - keep);
            }
        });
}
