//! Matrix helpers: the GEMM call the dense convolution makes, how a batch's products share
//! rayon's pool, and transposes in cache-sized tiles.

use std::mem::MaybeUninit;

use gemm::Parallelism;
use rayon::prelude::*;

/// Row-major matrix product `dst (m x n) (+)= a (m x k) * b (k x n)`, where `a` and `b` may
/// be stored transposed; `parallel` lets the GEMM split a large product over rayon's pool.
/// `dst` may be uninitialised when `accumulate` is false (the product overwrites every one
/// of its `m * n` values without reading them).
#[allow(clippy::too_many_arguments)]
pub(super) fn gemm_into(
    dst: &mut [MaybeUninit<f32>],
    a: &[f32],
    a_transposed: bool,
    b: &[f32],
    b_transposed: bool,
    [m, n, k]: [usize; 3],
    accumulate: bool,
    parallel: bool,
) {
    assert!(dst.len() >= m * n && a.len() >= m * k && b.len() >= k * n);
    // (row stride, column stride) of each operand
    let (a_rs, a_cs) = if a_transposed { (1, m) } else { (k, 1) };
    let (b_rs, b_cs) = if b_transposed { (1, k) } else { (n, 1) };
    let parallelism = if parallel && m * n * k >= 1 << 18 {
        Parallelism::Rayon(0)
    } else {
        Parallelism::None
    };
    // SAFETY: the assertion above keeps every element the strides address inside the slices,
    // and `dst` is borrowed mutably so it aliases neither operand.
    unsafe {
        gemm::gemm(
            m,
            n,
            k,
            dst.as_mut_ptr().cast::<f32>(),
            1,
            n as isize,
            accumulate,
            a.as_ptr(),
            a_cs as isize,
            a_rs as isize,
            b.as_ptr(),
            b_cs as isize,
            b_rs as isize,
            1.0,
            1.0,
            false,
            false,
            false,
            parallelism,
        );
    }
}

/// How a batch's per-image products share rayon's pool: `groups` runs of consecutive images
/// go to separate tasks (no synchronisation inside a product, which for the small products
/// of the later layers costs more than it saves), and the products themselves split only
/// when there are more threads than groups.
pub(super) struct Split {
    pub(super) images_per_group: usize,
    pub(super) parallel_products: bool,
}

impl Split {
    pub(super) fn new(batch: usize) -> Self {
        let threads = rayon::current_num_threads().max(1);
        let groups = batch.clamp(1, threads);
        Self {
            images_per_group: batch.div_ceil(groups).max(1),
            parallel_products: threads > groups,
        }
    }
}

/// The transpose of a row-major `rows x cols` matrix, in tiles that stay in the cache.
pub(super) fn transposed(m: &[f32], rows: usize, cols: usize) -> Vec<f32> {
    batched_transpose(m, [1, rows, cols])
}

/// `[batch, rows, cols]` row-major data to `[batch, cols, rows]`: each matrix transposed in
/// tiles that stay in the cache, the tiles of all matrices in parallel.
pub fn batched_transpose(x: &[f32], [batch, rows, cols]: [usize; 3]) -> Vec<f32> {
    const TILE: usize = 32;
    let len = rows * cols;
    assert_eq!(x.len(), batch * len);
    // every value is written below: no zeroing first
    let mut t: Vec<f32> = Vec::with_capacity(x.len());
    if len > 0 {
        // each task fills `TILE` rows of one transpose (`TILE` columns of its matrix)
        t.spare_capacity_mut()[..x.len()]
            .par_chunks_mut(len)
            .zip(x.par_chunks(len))
            .for_each(|(t, m)| {
                t.par_chunks_mut(TILE * rows)
                    .enumerate()
                    .for_each(|(tile, out)| {
                        let c0 = tile * TILE;
                        for r0 in (0..rows).step_by(TILE) {
                            for c in c0..(c0 + TILE).min(cols) {
                                let dst = &mut out[(c - c0) * rows..][..rows];
                                for r in r0..(r0 + TILE).min(rows) {
                                    dst[r].write(m[r * cols + c]);
                                }
                            }
                        }
                    });
            });
    }
    // SAFETY: the tasks above wrote rows 0..rows of every column of every matrix, that is
    // all `x.len()` values (none when a matrix is empty).
    unsafe { t.set_len(x.len()) };
    t
}
