//! Slice primitives the kernels share: uninitialised destinations, strided copies, and
//! dot products and sums in lane accumulators (so that the compiler vectorises them).

use std::mem::MaybeUninit;

/// `values` as a destination [`gemm_into`] may overwrite (the inverse of [`zero_filled`]).
pub(super) fn as_uninit(values: &mut [f32]) -> &mut [MaybeUninit<f32>] {
    // SAFETY: `[f32]` and `[MaybeUninit<f32>]` have the same layout, and every value written
    // through the view is an initialised `f32`.
    unsafe { &mut *(values as *mut [f32] as *mut [MaybeUninit<f32>]) }
}

/// `dst[i] = src[i * stride]` for every place of `dst` (`src` holds at least
/// `(dst.len() - 1) * stride + 1` values).
pub(super) fn copy_strided(dst: &mut [f32], src: &[f32], stride: usize) {
    match stride {
        1 => dst.copy_from_slice(&src[..dst.len()]),
        // pairs: the compiler turns this into vector shuffles
        2 => {
            let (pairs, last) = src.split_at(src.len() / 2 * 2);
            let (whole, tail) = dst.split_at_mut(dst.len().min(pairs.len() / 2));
            for (d, pair) in whole.iter_mut().zip(pairs.chunks_exact(2)) {
                *d = pair[0];
            }
            if let (Some(d), Some(&v)) = (tail.first_mut(), last.first()) {
                *d = v;
            }
        }
        _ => {
            for (d, &v) in dst.iter_mut().zip(src.iter().step_by(stride)) {
                *d = v;
            }
        }
    }
}

/// Zero-fills `values` and returns them as initialised.
pub(super) fn zero_filled(values: &mut [MaybeUninit<f32>]) -> &mut [f32] {
    values.fill(MaybeUninit::new(0.0));
    // SAFETY: every value was just written.
    unsafe { written(values) }
}

/// `values` as initialised.
///
/// # Safety
/// Every value must have been written.
pub(super) unsafe fn written(values: &mut [MaybeUninit<f32>]) -> &mut [f32] {
    // SAFETY: initialised by the caller's contract, and the layouts are the same.
    unsafe { &mut *(values as *mut [MaybeUninit<f32>] as *mut [f32]) }
}

/// Below this many values [`dot`] uses one vector of lanes: the 31 additions that sum four
/// vectors' lanes cost more than they save on short runs (the 10x10 planes' 118 values).
const WIDE_DOT_MIN: usize = 256;

/// `sum(a[i] * b[i])` with independent lane accumulators, so that the compiler vectorises
/// it: four vectors of 8 lanes over the bulk of a long run (one vector is one chain of
/// dependent additions, a quarter of the speed), one vector over the rest, then single
/// values.
pub(super) fn dot(a: &[f32], b: &[f32]) -> f32 {
    let n = a.len().min(b.len());
    let (a, b) = (&a[..n], &b[..n]);
    let narrow = if n >= WIDE_DOT_MIN { n / 32 * 32 } else { 0 };
    let wide = lane_dot::<32>(&a[..narrow], &b[..narrow]);
    let single = n / 8 * 8;
    let rest = lane_dot::<8>(&a[narrow..single], &b[narrow..single]);
    let tail: f32 = a[single..]
        .iter()
        .zip(&b[single..])
        .map(|(x, y)| x * y)
        .sum();
    wide + rest + tail
}

/// `sum(a[i] * b[i])` over the first `len / L * L` values, in `L` lane accumulators.
fn lane_dot<const L: usize>(a: &[f32], b: &[f32]) -> f32 {
    let mut acc = [0.0f32; L];
    for (x, y) in a.chunks_exact(L).zip(b.chunks_exact(L)) {
        for i in 0..L {
            acc[i] += x[i] * y[i];
        }
    }
    acc.iter().sum()
}

/// `dst[i] += w * src[i]`.
pub(super) fn axpy(dst: &mut [f32], w: f32, src: &[f32]) {
    for (d, &v) in dst.iter_mut().zip(src) {
        *d += w * v;
    }
}

/// Lanes of the BatchNorm statistics sums. At 8 lanes (one vector) the compiler left
/// these two-accumulator loops scalar: a channel's sums at 64 x 150 x 150, batch 8, took
/// 5.7 ms on two cores; at 32 lanes 1.3 ms (at 16 no faster than 8).
pub(super) const STATISTICS_LANES: usize = 32;

/// `sum(x)` with lane accumulators (`iter().sum()` is one serial chain of additions).
pub(super) fn lane_sum(x: &[f32]) -> f32 {
    let mut s = [0.0f32; STATISTICS_LANES];
    let chunks = x.chunks_exact(STATISTICS_LANES);
    let tail: f32 = chunks.remainder().iter().sum();
    for ch in chunks {
        for i in 0..STATISTICS_LANES {
            s[i] += ch[i];
        }
    }
    s.iter().sum::<f32>() + tail
}

/// `(sum(x), sum((x - shift)^2))` of a slice with lane accumulators.
pub(super) fn sum_and_squares(x: &[f32], shift: f32) -> (f32, f32) {
    let (mut s, mut q) = ([0.0f32; STATISTICS_LANES], [0.0f32; STATISTICS_LANES]);
    let chunks = x.chunks_exact(STATISTICS_LANES);
    let (mut ts, mut tq) = (0.0f32, 0.0f32);
    for &v in chunks.remainder() {
        ts += v;
        tq += (v - shift) * (v - shift);
    }
    for ch in chunks {
        for i in 0..STATISTICS_LANES {
            s[i] += ch[i];
            q[i] += (ch[i] - shift) * (ch[i] - shift);
        }
    }
    (s.iter().sum::<f32>() + ts, q.iter().sum::<f32>() + tq)
}
