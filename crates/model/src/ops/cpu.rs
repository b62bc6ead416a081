//! CPU kernels for the network's layers on contiguous NCHW `f32` buffers: TF-"SAME"
//! convolutions (dense through im2col + GEMM, depthwise directly) and training-mode
//! BatchNorm + ReLU6, each with its backward pass. Work is split over rayon's pool.

use std::mem::MaybeUninit;

use gemm::Parallelism;
use rayon::prelude::*;

use super::RmsPropStep;

/// Output size and leading padding of TF "SAME" along one axis: `out = ceil(size / stride)`,
/// total padding `max((out - 1) * stride + kernel - size, 0)`, the smaller half first:
/// `(out, before, after)`.
pub fn same_padding(size: usize, kernel: usize, stride: usize) -> (usize, usize, usize) {
    let out = size.div_ceil(stride);
    let total = ((out.saturating_sub(1)) * stride + kernel).saturating_sub(size);
    (out, total / 2, total - total / 2)
}

/// What a convolution does to each output plane right after computing it, while the plane
/// is still in cache (instead of another pass over the whole output).
#[derive(Debug, Clone, Copy)]
pub enum Epilogue<'a> {
    /// Nothing: the convolution's output as it is.
    None,
    /// `y + bias[c]`.
    Bias(&'a [f32]),
    /// `clamp(y * scale[c] + shift[c], 0, 6)`: inference-mode BatchNorm folded into a
    /// per-channel affine map, then ReLU6.
    AffineRelu6 {
        /// Per-channel factor.
        scale: &'a [f32],
        /// Per-channel offset.
        shift: &'a [f32],
    },
}

impl Epilogue<'_> {
    /// Applies the epilogue to `values`, one plane of channel `c`.
    fn apply(self, values: &mut [f32], c: usize) {
        match self {
            Self::None => {}
            Self::Bias(bias) => {
                let b = bias[c];
                values.iter_mut().for_each(|v| *v += b);
            }
            Self::AffineRelu6 { scale, shift } => {
                let (s, t) = (scale[c], shift[c]);
                values.iter_mut().for_each(|v| *v = scaled_relu6(*v, s, t));
            }
        }
    }

    /// Applies the epilogue to every plane of `[batch, channels, plane]` data, over rayon's
    /// pool when `parallel`.
    pub fn apply_planes(self, values: &mut [f32], plane: usize, parallel: bool) {
        let channels = match self {
            Self::None => return,
            Self::Bias(bias) => bias.len(),
            Self::AffineRelu6 { scale, .. } => scale.len(),
        };
        let plane = plane.max(1);
        if parallel {
            let chunks = values.par_chunks_mut(plane).enumerate();
            chunks.for_each(|(p, values)| self.apply(values, p % channels));
        } else {
            let chunks = values.chunks_mut(plane).enumerate();
            chunks.for_each(|(p, values)| self.apply(values, p % channels));
        }
    }
}

/// The bias gradient: `dy` of `[batch, channels, plane]` summed per channel.
pub fn bias_grad(dy: &[f32], plane: usize, channels: usize) -> Vec<f32> {
    let mut sums = vec![0.0f32; channels];
    for (p, chunk) in dy.chunks(plane.max(1)).enumerate() {
        sums[p % channels] += lane_sum(chunk);
    }
    sums
}

/// Geometry of one convolution.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Conv {
    pub batch: usize,
    pub in_channels: usize,
    pub height: usize,
    pub width: usize,
    pub out_channels: usize,
    pub kernel: usize,
    pub stride: usize,
    pub out_height: usize,
    pub out_width: usize,
    pub pad_top: usize,
    pub pad_left: usize,
}

impl Conv {
    /// The geometry of a SAME convolution of `[batch, in_channels, height, width]` by a
    /// `kernel x kernel` filter bank with `out_channels` outputs.
    pub fn same(
        [batch, in_channels, height, width]: [usize; 4],
        out_channels: usize,
        kernel: usize,
        stride: usize,
    ) -> Self {
        let (out_height, pad_top, _) = same_padding(height, kernel, stride);
        let (out_width, pad_left, _) = same_padding(width, kernel, stride);
        Self {
            batch,
            in_channels,
            height,
            width,
            out_channels,
            kernel,
            stride,
            out_height,
            out_width,
            pad_top,
            pad_left,
        }
    }

    fn in_plane(&self) -> usize {
        self.height * self.width
    }

    fn out_plane(&self) -> usize {
        self.out_height * self.out_width
    }

    /// Rows of the im2col matrix: one per (input channel, kernel row, kernel column).
    fn patch(&self) -> usize {
        self.in_channels * self.kernel * self.kernel
    }

    /// A 1x1 stride-1 convolution reads its input as the im2col matrix itself.
    fn is_pointwise(&self) -> bool {
        self.kernel == 1 && self.stride == 1
    }

    /// Output columns `lo..hi` whose input column `ox * stride + kx - pad_left` is inside
    /// the image.
    fn valid_columns(&self, kx: usize) -> (usize, usize) {
        valid_range(self.out_width, self.width, self.stride, kx, self.pad_left)
    }

    /// The input row read by output row `oy` at kernel row `ky`, if inside the image.
    fn input_row(&self, oy: usize, ky: usize) -> Option<usize> {
        (oy * self.stride + ky)
            .checked_sub(self.pad_top)
            .filter(|&iy| iy < self.height)
    }
}

/// Outputs `o` in `0..out` with `o * stride + k - pad` in `0..size`, as a range.
fn valid_range(out: usize, size: usize, stride: usize, k: usize, pad: usize) -> (usize, usize) {
    let lo = pad.saturating_sub(k).div_ceil(stride);
    let hi = if size + pad > k {
        ((size + pad - k - 1) / stride + 1).min(out)
    } else {
        0
    };
    (lo.min(hi), hi)
}

/// `values` as a destination [`gemm_into`] may overwrite (the inverse of [`zero_filled`]).
fn as_uninit(values: &mut [f32]) -> &mut [MaybeUninit<f32>] {
    // SAFETY: `[f32]` and `[MaybeUninit<f32>]` have the same layout, and every value written
    // through the view is an initialised `f32`.
    unsafe { &mut *(values as *mut [f32] as *mut [MaybeUninit<f32>]) }
}

/// Row-major matrix product `dst (m x n) (+)= a (m x k) * b (k x n)`, where `a` and `b` may
/// be stored transposed; `parallel` lets the GEMM split a large product over rayon's pool.
/// `dst` may be uninitialised when `accumulate` is false (the product overwrites every one
/// of its `m * n` values without reading them).
#[allow(clippy::too_many_arguments)]
fn gemm_into(
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
struct Split {
    images_per_group: usize,
    parallel_products: bool,
}

impl Split {
    fn new(batch: usize) -> Self {
        let threads = rayon::current_num_threads().max(1);
        let groups = batch.clamp(1, threads);
        Self {
            images_per_group: batch.div_ceil(groups).max(1),
            parallel_products: threads > groups,
        }
    }
}

/// Unfolds one image `[in_channels, h, w]` into `cols [patch, out_plane]` (zeros in the
/// padding).
fn im2col(g: &Conv, image: &[f32], cols: &mut [f32]) {
    let k = g.kernel;
    cols.par_chunks_mut(g.out_plane())
        .enumerate()
        .for_each(|(row, col)| {
            let (c, ky, kx) = (row / (k * k), (row / k) % k, row % k);
            let plane = &image[c * g.in_plane()..][..g.in_plane()];
            let (lo, hi) = g.valid_columns(kx);
            for oy in 0..g.out_height {
                let out = &mut col[oy * g.out_width..][..g.out_width];
                match g.input_row(oy, ky) {
                    None => out.fill(0.0),
                    Some(iy) => {
                        let src = &plane[iy * g.width..][..g.width];
                        out[..lo].fill(0.0);
                        out[hi..].fill(0.0);
                        let first = lo * g.stride + kx - g.pad_left;
                        copy_strided(&mut out[lo..hi], &src[first..], g.stride);
                    }
                }
            }
        });
}

/// `dst[i] = src[i * stride]` for every place of `dst` (`src` holds at least
/// `(dst.len() - 1) * stride + 1` values).
fn copy_strided(dst: &mut [f32], src: &[f32], stride: usize) {
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
fn zero_filled(values: &mut [MaybeUninit<f32>]) -> &mut [f32] {
    values.fill(MaybeUninit::new(0.0));
    // SAFETY: every value was just written.
    unsafe { written(values) }
}

/// `values` as initialised.
///
/// # Safety
/// Every value must have been written.
unsafe fn written(values: &mut [MaybeUninit<f32>]) -> &mut [f32] {
    // SAFETY: initialised by the caller's contract, and the layouts are the same.
    unsafe { &mut *(values as *mut [MaybeUninit<f32>] as *mut [f32]) }
}

/// Folds `cols [patch, out_plane]` back onto one image `[in_channels, h, w]` (which it
/// overwrites, so it may start uninitialised), summing overlaps (the adjoint of [`im2col`]).
fn col2im(g: &Conv, cols: &[f32], image: &mut [MaybeUninit<f32>]) {
    let k = g.kernel;
    image
        .par_chunks_mut(g.in_plane())
        .enumerate()
        .for_each(|(c, plane)| {
            let plane = zero_filled(plane);
            for ky in 0..k {
                for kx in 0..k {
                    let col = &cols[((c * k + ky) * k + kx) * g.out_plane()..][..g.out_plane()];
                    let (lo, hi) = g.valid_columns(kx);
                    for oy in 0..g.out_height {
                        if let Some(iy) = g.input_row(oy, ky) {
                            let dst = &mut plane[iy * g.width..][..g.width];
                            let src = &col[oy * g.out_width..][..g.out_width];
                            for ox in lo..hi {
                                dst[ox * g.stride + kx - g.pad_left] += src[ox];
                            }
                        }
                    }
                }
            }
        });
}

/// Scratch for the unfolded patches of one image (none for a pointwise convolution).
fn cols_buffer(g: &Conv) -> Vec<f32> {
    if g.is_pointwise() {
        Vec::new()
    } else {
        vec![0.0; g.patch() * g.out_plane()]
    }
}

/// The im2col matrix of one image: the image itself for a pointwise convolution, else
/// unfolded into `cols`.
fn patches<'a>(g: &Conv, image: &'a [f32], cols: &'a mut [f32]) -> &'a [f32] {
    if g.is_pointwise() {
        image
    } else {
        im2col(g, image, cols);
        cols
    }
}

/// Dense convolution: `x [batch, in, h, w]`, `weight [out, in, k, k]`, then `epilogue` on
/// each image's output as soon as its product is done.
pub fn conv_forward(g: &Conv, x: &[f32], weight: &[f32], epilogue: Epilogue) -> Vec<f32> {
    let (image_len, out_len) = (g.in_channels * g.in_plane(), g.out_channels * g.out_plane());
    let len = g.batch * out_len;
    let split = Split::new(g.batch);
    // every value is written by the per-image products below: no zeroing pass first
    let mut y: Vec<f32> = Vec::with_capacity(len);
    y.spare_capacity_mut()[..len]
        .par_chunks_mut(split.images_per_group * out_len)
        .zip(x.par_chunks(split.images_per_group * image_len))
        .for_each(|(outs, images)| {
            let mut cols = cols_buffer(g);
            for (out, image) in outs.chunks_mut(out_len).zip(images.chunks(image_len)) {
                let cols = patches(g, image, &mut cols);
                let shape = [g.out_channels, g.out_plane(), g.patch()];
                let parallel = split.parallel_products;
                gemm_into(out, weight, false, cols, false, shape, false, parallel);
                // SAFETY: the product just wrote all of `out`.
                let out = unsafe { written(out) };
                epilogue.apply_planes(out, g.out_plane(), parallel);
            }
        });
    // SAFETY: the products above wrote all `len` values (one `out_channels x out_plane` block
    // per image, `batch` blocks).
    unsafe { y.set_len(len) };
    y
}

/// The smallest output plane for which [`conv_backward`] copies the filters transposed.
const MIN_COLUMNS_FOR_TRANSPOSE: usize = 64;

/// Backward pass of [`conv_forward`] given the output gradient `dy`: `(dx, dweight)`, `dx`
/// only `with_dx` (the bias gradient is [`bias_grad`]). The filter gradient is summed image
/// by image within each group of [`Split`], then over the groups in order.
pub fn conv_backward(
    g: &Conv,
    x: &[f32],
    weight: &[f32],
    dy: &[f32],
    with_dx: bool,
) -> (Option<Vec<f32>>, Vec<f32>) {
    let (image_len, out_len) = (g.in_channels * g.in_plane(), g.out_channels * g.out_plane());
    let split = Split::new(g.batch);
    let parallel = split.parallel_products;
    // both gradients are written, not accumulated, by the first pass over them: no zeroing
    let dx_len = if with_dx { g.batch * image_len } else { 0 };
    let mut dx: Vec<f32> = Vec::with_capacity(dx_len);
    // each group's block of `dx` (none without it)
    let dx_blocks = dx.spare_capacity_mut()[..dx_len]
        .chunks_mut((split.images_per_group * image_len).max(1))
        .map(Some)
        .chain(std::iter::repeat_with(|| None));
    // `W^T (patch x out)` stored row-major, once for all groups: the GEMM runs up to twice
    // as fast on it as on `W` read transposed (the 1024 -> 1024 layer on one thread: 14.4 ->
    // 7.5 ms for four images). Below `MIN_COLUMNS_FOR_TRANSPOSE` columns per image the
    // products are too small to repay the copy.
    let weight_t = (with_dx && g.out_plane() >= MIN_COLUMNS_FOR_TRANSPOSE)
        .then(|| transposed(weight, g.out_channels, g.patch()));
    // the input-gradient product's left operand `W^T` (`a`): the copy, or `W` read transposed
    let (a, a_t) = match &weight_t {
        Some(wt) => (wt.as_slice(), false),
        None => (weight, true),
    };
    let groups: Vec<_> = x
        .chunks(split.images_per_group * image_len)
        .zip(dy.chunks(split.images_per_group * out_len))
        .zip(dx_blocks)
        .collect();
    let partials: Vec<Vec<f32>> = groups
        .into_par_iter()
        .map(|((images, grads), mut dimages)| {
            let mut dw: Vec<f32> = Vec::with_capacity(weight.len());
            let (mut cols, mut dcols) = (cols_buffer(g), cols_buffer(g));
            let per_image = images.chunks(image_len).zip(grads.chunks(out_len));
            for (b, (image, grad)) in per_image.enumerate() {
                let cols = patches(g, image, &mut cols);
                // dW (out x patch) (+)= dY (out x plane) * cols^T (plane x patch)
                let dw_shape = [g.out_channels, g.patch(), g.out_plane()];
                if b == 0 {
                    let dst = dw.spare_capacity_mut();
                    gemm_into(dst, grad, false, cols, true, dw_shape, false, parallel);
                    // SAFETY: the product wrote all `out_channels * patch` values.
                    unsafe { dw.set_len(weight.len()) };
                } else {
                    let dst = as_uninit(&mut dw);
                    gemm_into(dst, grad, false, cols, true, dw_shape, true, parallel);
                }
                let Some(dimages) = dimages.as_deref_mut() else {
                    continue;
                };
                let dimage = &mut dimages[b * image_len..][..image_len];
                // dcols (patch x plane) = W^T (patch x out) * dY (out x plane)
                let dcols_shape = [g.patch(), g.out_plane(), g.out_channels];
                if g.is_pointwise() {
                    gemm_into(dimage, a, a_t, grad, false, dcols_shape, false, parallel);
                } else {
                    let dst = as_uninit(&mut dcols);
                    gemm_into(dst, a, a_t, grad, false, dcols_shape, false, parallel);
                    col2im(g, &dcols, dimage);
                }
            }
            dw
        })
        .collect();
    let dx = with_dx.then(|| {
        // SAFETY: every image's block of `dx` was written above (`batch` blocks of
        // `image_len`).
        unsafe { dx.set_len(g.batch * image_len) };
        dx
    });
    let mut partials = partials.into_iter();
    let mut dw = partials.next().unwrap_or_else(|| vec![0.0; weight.len()]);
    for partial in partials {
        axpy(&mut dw, 1.0, &partial);
    }
    (dx, dw)
}

/// The transpose of a row-major `rows x cols` matrix, in tiles that stay in the cache.
fn transposed(m: &[f32], rows: usize, cols: usize) -> Vec<f32> {
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

/// Below this many values [`dot`] uses one vector of lanes: the 31 additions that sum four
/// vectors' lanes cost more than they save on short runs (the 10x10 planes' 118 values).
const WIDE_DOT_MIN: usize = 256;

/// `sum(a[i] * b[i])` with independent lane accumulators, so that the compiler vectorises
/// it: four vectors of 8 lanes over the bulk of a long run (one vector is one chain of
/// dependent additions, a quarter of the speed), one vector over the rest, then single
/// values.
fn dot(a: &[f32], b: &[f32]) -> f32 {
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
fn axpy(dst: &mut [f32], w: f32, src: &[f32]) {
    for (d, &v) in dst.iter_mut().zip(src) {
        *d += w * v;
    }
}

/// Values of a depthwise block (see [`Padded::blocks`]): its nine taps' runs then stay in
/// the L1 cache.
const BLOCK_VALUES: usize = 2048;

/// One depthwise plane zero-padded as the SAME convolution reads it and split into
/// `stride x stride` phase planes by `(row % stride, column % stride)`, so that the inputs
/// one kernel tap reads for a row of outputs are one contiguous run and those for the next
/// output row follow `run` further on: padded row `r`, column `c` sits at
/// `((r % stride) * stride + c % stride) * phase_rows * run + (r / stride) * run + c / stride`.
struct Padded {
    kernel: usize,
    stride: usize,
    pad_top: usize,
    pad_left: usize,
    width: usize,
    rows: usize,
    phase_rows: usize,
    run: usize,
    out_width: usize,
}

impl Padded {
    fn new(g: &Conv) -> Self {
        let padded_width = (g.out_width.max(1) - 1) * g.stride + g.kernel;
        let rows = (g.out_height.max(1) - 1) * g.stride + g.kernel;
        Self {
            kernel: g.kernel,
            stride: g.stride,
            pad_top: g.pad_top,
            pad_left: g.pad_left,
            width: g.width,
            rows,
            phase_rows: rows.div_ceil(g.stride),
            run: padded_width.div_ceil(g.stride),
            out_width: g.out_width,
        }
    }

    fn len(&self) -> usize {
        self.stride * self.stride * self.phase_rows * self.run
    }

    /// Where padded column `c` of padded row `r` sits.
    fn at(&self, r: usize, c: usize) -> usize {
        let phase = (r % self.stride) * self.stride + c % self.stride;
        (phase * self.phase_rows + r / self.stride) * self.run + c / self.stride
    }

    /// For each column phase, the first input column of that phase and how many of that
    /// phase the padded plane holds: `(ix0, count)`, the columns `ix0, ix0 + stride, ...`
    /// going to consecutive places of a row from `at(r, ix0 + pad_left)`.
    fn column_phases(&self) -> Vec<(usize, usize)> {
        // input columns the padded plane holds
        let cols = self
            .width
            .min((self.run * self.stride).saturating_sub(self.pad_left));
        (0..self.stride.min(cols))
            .map(|ix0| (ix0, (cols - ix0).div_ceil(self.stride)))
            .collect()
    }

    /// `(input row, padded row)` of the input rows inside the padded plane.
    fn input_rows(&self, height: usize) -> impl Iterator<Item = (usize, usize)> + '_ {
        (0..height)
            .map(|iy| (iy, iy + self.pad_top))
            .filter(|&(_, r)| r < self.rows)
    }

    /// Writes `plane` (`height x width`) into `buf`, zeros around it. Every fill writes the
    /// same places, so a buffer already of this layout keeps its zeros and is not cleared.
    fn fill(&self, plane: &[f32], buf: &mut Vec<f32>) {
        if buf.len() != self.len() {
            buf.clear();
            buf.resize(self.len(), 0.0);
        }
        let phases = self.column_phases();
        for (iy, r) in self.input_rows(plane.len() / self.width) {
            let row = &plane[iy * self.width..][..self.width];
            for &(ix0, count) in &phases {
                let dst = &mut buf[self.at(r, ix0 + self.pad_left)..][..count];
                copy_strided(dst, &row[ix0..], self.stride);
            }
        }
    }

    /// Whether the padded plane holds every place of a `height x width` input (true of every
    /// SAME convolution whose kernel is larger than its stride).
    fn holds_every_input(&self, height: usize) -> bool {
        height + self.pad_top <= self.rows && self.width + self.pad_left <= self.run * self.stride
    }

    /// Reads the plane back out of `buf` (the adjoint of [`Padded::fill`]), writing every
    /// input place the padded plane holds: with [`Padded::holds_every_input`] all of `plane`,
    /// else the caller zero-fills it first.
    fn extract(&self, buf: &[f32], plane: &mut [MaybeUninit<f32>]) {
        let phases = self.column_phases();
        for (iy, r) in self.input_rows(plane.len() / self.width) {
            let row = &mut plane[iy * self.width..][..self.width];
            let run = |ix0: usize, count: usize| &buf[self.at(r, ix0 + self.pad_left)..][..count];
            match (self.stride, phases.as_slice()) {
                (1, &[(ix0, count)]) => {
                    for (d, &v) in row[ix0..][..count].iter_mut().zip(run(ix0, count)) {
                        d.write(v);
                    }
                }
                // both phases of each pair of columns at once: vector shuffles
                (2, &[(0, even), (1, odd)]) => {
                    let (even, odd) = (run(0, even), run(1, odd));
                    let pairs = row.chunks_exact_mut(2);
                    for ((pair, &e), &o) in pairs.zip(even).zip(odd) {
                        pair[0].write(e);
                        pair[1].write(o);
                    }
                    // an even column without its odd partner
                    if even.len() > odd.len() {
                        row[2 * odd.len()].write(even[odd.len()]);
                    }
                }
                _ => {
                    for &(ix0, count) in &phases {
                        let src = run(ix0, count);
                        for (d, &v) in row[ix0..].iter_mut().step_by(self.stride).zip(src) {
                            d.write(v);
                        }
                    }
                }
            }
        }
    }

    /// Start of the run that tap `(ky, kx)` reads for output row `oy`: output column `ox`
    /// reads `buf[start + ox]`.
    fn tap(&self, oy: usize, ky: usize, kx: usize) -> usize {
        self.at(oy * self.stride + ky, kx)
    }

    /// Output rows computed as one run, `(first row, rows)`: the runs a tap reads for
    /// consecutive output rows follow each other `run` apart, so up to [`BLOCK_VALUES`] of a
    /// plane's values are one block (row `j` of it at `j * run`, `run - out_width` padding
    /// values between rows).
    fn blocks(&self, out_height: usize) -> Vec<(usize, usize)> {
        let rows = (BLOCK_VALUES / self.run).max(1);
        (0..out_height)
            .step_by(rows)
            .map(|oy| (oy, rows.min(out_height - oy)))
            .collect()
    }

    /// Length of a block of `rows` output rows.
    fn block_len(&self, rows: usize) -> usize {
        (rows.max(1) - 1) * self.run + self.out_width
    }

    /// The runs of every tap for the block starting at output row `oy`, in filter order.
    fn taps<'a>(
        &'a self,
        buf: &'a [f32],
        (oy, rows): (usize, usize),
    ) -> impl Iterator<Item = &'a [f32]> + 'a {
        (0..self.kernel * self.kernel).map(move |t| {
            let start = self.tap(oy, t / self.kernel, t % self.kernel);
            &buf[start..][..self.block_len(rows)]
        })
    }
}

/// `sum_t w[t] * taps[t][i]`, the taps in order by fused multiply-adds.
#[inline(always)]
fn tap_sum<const N: usize>(taps: &[&[f32]; N], w: &[f32; N], i: usize) -> f32 {
    let mut acc = taps[0][i] * w[0];
    for k in 1..N {
        acc = taps[k][i].mul_add(w[k], acc);
    }
    acc
}

/// `out[i] = sum_t w[t] * taps[t][i]` over `N` taps, in one pass over the run (`out` may
/// start uninitialised).
fn weighted_sum<const N: usize>(out: &mut [MaybeUninit<f32>], taps: [&[f32]; N], w: [f32; N]) {
    let n = out.len();
    let t = taps.map(|t| &t[..n]);
    for (i, o) in out.iter_mut().enumerate() {
        o.write(tap_sum(&t, &w, i));
    }
}

/// `out[i] += sum_t w[t] * taps[t][i]` over `N` taps, in one pass over the run.
fn add_weighted_sum<const N: usize>(out: &mut [f32], taps: [&[f32]; N], w: [f32; N]) {
    let n = out.len();
    let t = taps.map(|t| &t[..n]);
    for (i, o) in out.iter_mut().enumerate() {
        *o += tap_sum(&t, &w, i);
    }
}

/// The input gradient of one block for the filter taps `(ky, kx)` that reach one phase plane
/// of the padded layout, gathered from the block's output gradient: `out` holds that plane's
/// rows from the block's first on; tap `(ky, kx)` adds `w * grad` shifted by `ky / stride`
/// rows and `kx / stride` columns. The first `seen` values, which the previous block already
/// wrote, are added to; the rest are written.
fn gather_phase<const N: usize>(
    out: &mut [f32],
    seen: usize,
    grad: &BlockGrad,
    (padded, filter): (&Padded, &[f32]),
    taps: [(usize, usize); N],
) {
    let stride = padded.stride;
    let n = out.len();
    let runs = taps.map(|(ky, kx)| grad.shifted((ky / stride) * padded.run + kx / stride, n));
    let w = taps.map(|(ky, kx)| filter[ky * padded.kernel + kx]);
    let (overlap, fresh) = out.split_at_mut(seen);
    add_weighted_sum::<N>(overlap, runs, w);
    weighted_sum::<N>(as_uninit(fresh), runs.map(|r| &r[seen..]), w);
}

/// The taps of a block as an array (3x3 filters).
fn taps3x3<'a>(padded: &'a Padded, buf: &'a [f32], block: (usize, usize)) -> [&'a [f32]; 9] {
    let mut taps = padded.taps(buf, block);
    std::array::from_fn(|_| taps.next().unwrap_or_default())
}

/// The narrowest plane that [`depthwise_forward`] and [`depthwise_backward`] run row by row
/// straight from its source ([`is_direct`]): on wide rows that saves the copies into and out
/// of the padded layout; on narrow rows the per-row edges and vector tails cost more.
const DIRECT_MIN_WIDTH: usize = 64;

/// Whether a depthwise convolution runs row by row from its source: a 3x3 filter at stride 1
/// (SAME then pads one row and column on each side) over planes of two rows or more, at
/// least [`DIRECT_MIN_WIDTH`] wide.
fn is_direct(g: &Conv) -> bool {
    g.kernel == 3
        && g.stride == 1
        && (g.pad_top, g.pad_left) == (1, 1)
        && g.height >= 2
        && g.width >= DIRECT_MIN_WIDTH
}

/// The kernel rows of a stride-1 3x3 SAME filter that read inside a plane of `height` rows
/// at output row `oy`.
fn kernel_rows_inside(oy: usize, height: usize) -> std::ops::Range<usize> {
    usize::from(oy == 0)..if oy + 1 == height { 2 } else { 3 }
}

/// One plane of a stride-1 3x3 SAME correlation with the filter `f`, row by row from `src`
/// (`height >= 2`, `width >= 3`): the inner values of an output row are one weighted sum of
/// the 6 or 9 shifted source runs, the two edge values are summed apart.
fn correlate3x3_plane(
    src: &[f32],
    [height, width]: [usize; 2],
    f: &[f32; 9],
    out: &mut [MaybeUninit<f32>],
) {
    let inner = width - 2;
    // the source row kernel row `ky` reads for output row `oy`
    let row = |oy: usize, ky: usize| &src[(oy + ky - 1) * width..][..width];
    // its runs, by kernel column
    let runs = |oy: usize, ky: usize| {
        let r = row(oy, ky);
        [&r[..inner], &r[1..][..inner], &r[2..][..inner]]
    };
    for (oy, o) in out.chunks_exact_mut(width).take(height).enumerate() {
        let rows = kernel_rows_inside(oy, height);
        let (mut left, mut right) = (0.0f32, 0.0f32);
        for ky in rows.clone() {
            let r = row(oy, ky);
            let w = &f[ky * 3..][..3];
            left += w[1] * r[0] + w[2] * r[1];
            right += w[0] * r[width - 2] + w[1] * r[width - 1];
        }
        let (first, rest) = o.split_at_mut(1);
        let (middle, last) = rest.split_at_mut(inner);
        if rows.len() == 3 {
            let [a, b, c] = [0, 1, 2].map(|ky| runs(oy, ky));
            let taps = [a[0], a[1], a[2], b[0], b[1], b[2], c[0], c[1], c[2]];
            weighted_sum::<9>(middle, taps, *f);
        } else {
            let [a, b] = [rows.start, rows.start + 1].map(|ky| runs(oy, ky));
            let w = std::array::from_fn(|i| f[rows.start * 3 + i]);
            weighted_sum::<6>(middle, [a[0], a[1], a[2], b[0], b[1], b[2]], w);
        }
        first[0].write(left);
        last[0].write(right);
    }
}

/// Lanes of [`filter_grad3x3_plane`]'s partial sums.
const GRAD_LANES: usize = 8;

/// `acc[k][l] += d[i] * x[i + k]` for `k < 3`, over the whole `GRAD_LANES`-chunks of `d`
/// (`i = l` modulo `GRAD_LANES`), in one pass with three independent accumulators; returns
/// the three sums over the values after the last whole chunk. `x` holds `d.len() + 2`
/// values.
fn shifted_dots3(acc: &mut [[f32; GRAD_LANES]; 3], d: &[f32], x: &[f32]) -> [f32; 3] {
    let whole = d.len() / GRAD_LANES * GRAD_LANES;
    let x = &x[..d.len() + 2];
    // the accumulators as locals, so that they stay in vector registers
    let [mut a0, mut a1, mut a2] = *acc;
    let lanes = |v: &[f32]| -> [f32; GRAD_LANES] { std::array::from_fn(|l| v[l]) };
    for (chunk, dv) in d[..whole].chunks_exact(GRAD_LANES).enumerate() {
        let i = chunk * GRAD_LANES;
        let dv = lanes(dv);
        let [x0, x1, x2] = [0, 1, 2].map(|k| lanes(&x[i + k..][..GRAD_LANES]));
        for l in 0..GRAD_LANES {
            a0[l] = dv[l].mul_add(x0[l], a0[l]);
            a1[l] = dv[l].mul_add(x1[l], a1[l]);
            a2[l] = dv[l].mul_add(x2[l], a2[l]);
        }
    }
    *acc = [a0, a1, a2];
    std::array::from_fn(|k| {
        let xs = &x[whole + k..];
        d[whole..].iter().zip(xs).map(|(a, b)| a * b).sum()
    })
}

/// The filter gradient of one plane of a stride-1 3x3 SAME convolution,
/// `dw[ky][kx] = sum dy[oy][ox] * x[oy + ky - 1][ox + kx - 1]`, row by row (`height >= 2`,
/// `width >= 3`).
fn filter_grad3x3_plane(x: &[f32], dy: &[f32], [height, width]: [usize; 2]) -> [f32; 9] {
    let mut lanes = [[[0.0f32; GRAD_LANES]; 3]; 3];
    let mut sums = [0.0f32; 9];
    for (oy, d) in dy.chunks_exact(width).take(height).enumerate() {
        for ky in kernel_rows_inside(oy, height) {
            let r = &x[(oy + ky - 1) * width..][..width];
            let s = &mut sums[ky * 3..][..3];
            // the edge columns: the first reads nothing left of the plane, the last nothing
            // right of it
            s[1] += d[0] * r[0] + d[width - 1] * r[width - 1];
            s[2] += d[0] * r[1];
            s[0] += d[width - 1] * r[width - 2];
            let rest = shifted_dots3(&mut lanes[ky], &d[1..width - 1], r);
            for (s, r) in s.iter_mut().zip(rest) {
                *s += r;
            }
        }
    }
    std::array::from_fn(|t| sums[t] + lanes[t / 3][t % 3].iter().sum::<f32>())
}

/// Per-thread buffers of the depthwise kernels.
#[derive(Default)]
struct DepthwiseScratch {
    /// The padded input plane (blocked layout).
    padded: Vec<f32>,
    /// One block's outputs (forward) or the padded input gradient (backward).
    flat: Vec<f32>,
    /// The output gradient of one block (backward).
    block_grad: BlockGrad,
}

/// How the depthwise kernels run planes of one geometry: row by row from the source
/// ([`is_direct`]), or through the padded layout of [`Padded`], block by block.
struct Depthwise {
    /// The convolution's geometry.
    g: Conv,
    /// The padded, phase-split layout of an input plane.
    padded: Padded,
    /// The output rows computed as one run each ([`Padded::blocks`]).
    blocks: Vec<(usize, usize)>,
    /// Planes run row by row from their source ([`is_direct`]).
    direct: bool,
    /// The backward pass gathers the input gradient per phase plane ([`gather_phase`]): a
    /// 3x3 filter at stride 1 or 2.
    gather: bool,
    /// Zeros before each block's gradient: the gather reads it shifted back by up to
    /// `reach` rows and columns.
    reach: usize,
    /// `extract` writes every input place, so the input gradient needs no zero fill.
    extract_writes_all: bool,
}

impl Depthwise {
    fn new(g: &Conv) -> Self {
        let padded = Padded::new(g);
        let gather = g.kernel == 3 && g.stride <= 2;
        Self {
            g: *g,
            blocks: padded.blocks(g.out_height),
            direct: is_direct(g),
            gather,
            reach: if gather { (g.kernel - 1) / g.stride } else { 0 },
            extract_writes_all: padded.holds_every_input(g.height),
            padded,
        }
    }

    fn scratch(&self) -> DepthwiseScratch {
        DepthwiseScratch {
            block_grad: BlockGrad::new(self.reach * self.padded.run + self.reach),
            ..Default::default()
        }
    }

    /// The output plane of one input plane `src` and its channel's `filter`.
    fn forward_plane(
        &self,
        src: &[f32],
        filter: &[f32],
        out: &mut [MaybeUninit<f32>],
        scratch: &mut DepthwiseScratch,
    ) {
        let g = &self.g;
        if self.direct {
            let f = std::array::from_fn(|t| filter[t]);
            return correlate3x3_plane(src, [g.height, g.width], &f, out);
        }
        let padded = &self.padded;
        let (buf, flat) = (&mut scratch.padded, &mut scratch.flat);
        padded.fill(src, buf);
        for &(oy, rows) in &self.blocks {
            // every value is written below
            flat.resize(padded.block_len(rows), 0.0);
            if filter.len() == 9 {
                let w = std::array::from_fn(|t| filter[t]);
                weighted_sum::<9>(as_uninit(flat), taps3x3(padded, buf, (oy, rows)), w);
            } else {
                flat.fill(0.0);
                for (tap, &w) in padded.taps(buf, (oy, rows)).zip(filter) {
                    axpy(flat, w, tap);
                }
            }
            let out_rows = out[oy * g.out_width..].chunks_mut(g.out_width);
            for (j, row) in out_rows.take(rows).enumerate() {
                let src = &flat[j * padded.run..][..g.out_width];
                for (o, &v) in row.iter_mut().zip(src) {
                    o.write(v);
                }
            }
        }
    }

    /// The input gradient `dplane` (written whole) and the filter gradient `dfilter` (added
    /// to) of one plane, from its input `src` and output gradient `grad`.
    ///
    /// Directly ([`is_direct`]): the filter gradient by [`filter_grad3x3_plane`]; the input
    /// gradient is the output gradient correlated with the filter turned by 180 degrees,
    /// which at stride 1 is [`correlate3x3_plane`] again. Otherwise block by block: the
    /// output gradient is copied into a buffer laid out like the block's runs (zeros between
    /// rows), [`BlockGrad`]; the filter gradient is its dot product with each tap's run. The
    /// input gradient is that buffer spread back through the filter: for a 3x3 filter of
    /// stride 1 or 2 by gathering, per phase plane of the padded layout, the shifted copies
    /// of the taps that reach it ([`gather_phase`]; the buffer has zero margins for them),
    /// which writes each input value once instead of adding to it once per tap, so the
    /// padded gradient needs no zeroing; else one `axpy` per tap into a zeroed buffer.
    fn backward_plane(
        &self,
        (src, grad): (&[f32], &[f32]),
        filter: &[f32],
        dplane: &mut [MaybeUninit<f32>],
        dfilter: &mut [f32],
        scratch: &mut DepthwiseScratch,
    ) {
        let g = &self.g;
        if self.direct {
            let dims = [g.height, g.width];
            for (d, v) in dfilter
                .iter_mut()
                .zip(filter_grad3x3_plane(src, grad, dims))
            {
                *d += v;
            }
            let turned = std::array::from_fn(|t| filter[8 - t]);
            return correlate3x3_plane(grad, dims, &turned, dplane);
        }
        let (padded, reach) = (&self.padded, self.reach);
        let (xs, dxs, block_grad) = (
            &mut scratch.padded,
            &mut scratch.flat,
            &mut scratch.block_grad,
        );
        padded.fill(src, xs);
        // the gather writes every value the first time a block reaches it; the `axpy`s add
        // to zeros
        if !self.gather {
            dxs.clear();
        }
        dxs.resize(padded.len(), 0.0);
        for &(oy, rows) in &self.blocks {
            block_grad.fill(padded, grad, (oy, rows));
            let flat = block_grad.values();
            for (d, tap) in dfilter.iter_mut().zip(padded.taps(xs, (oy, rows))) {
                *d += dot(flat, tap);
            }
            if self.gather {
                // rows oy .. of each phase plane: the block reaches `reach` rows past its
                // own, which the next block adds to
                let n = (rows + reach) * padded.run;
                let seen = if oy == 0 { 0 } else { reach * padded.run };
                let at = |py: usize, px: usize| padded.tap(oy, py, px);
                let with = (padded, filter);
                if g.stride == 1 {
                    let out = &mut dxs[at(0, 0)..][..n];
                    let taps = std::array::from_fn(|t| (t / 3, t % 3));
                    gather_phase::<9>(out, seen, block_grad, with, taps);
                } else {
                    let out = &mut dxs[at(0, 0)..][..n];
                    let taps = [(0, 0), (0, 2), (2, 0), (2, 2)];
                    gather_phase::<4>(out, seen, block_grad, with, taps);
                    let out = &mut dxs[at(0, 1)..][..n];
                    gather_phase::<2>(out, seen, block_grad, with, [(0, 1), (2, 1)]);
                    let out = &mut dxs[at(1, 0)..][..n];
                    gather_phase::<2>(out, seen, block_grad, with, [(1, 0), (1, 2)]);
                    let out = &mut dxs[at(1, 1)..][..n];
                    gather_phase::<1>(out, seen, block_grad, with, [(1, 1)]);
                }
            } else {
                for (t, &w) in filter.iter().enumerate() {
                    let start = padded.tap(oy, t / g.kernel, t % g.kernel);
                    axpy(&mut dxs[start..][..flat.len()], w, flat);
                }
            }
        }
        if !self.extract_writes_all {
            zero_filled(dplane);
        }
        padded.extract(dxs, dplane);
    }
}

/// Per-image filter gradients (`batch` runs of `len`) summed over the batch, in order.
fn batch_sum(partial: &[f32], len: usize) -> Vec<f32> {
    let mut sum = vec![0.0f32; len];
    for image in partial.chunks(len.max(1)) {
        axpy(&mut sum, 1.0, image);
    }
    sum
}

/// Depthwise convolution (`in_channels == out_channels`, one `k x k` filter per channel):
/// `x [batch, c, h, w]`, `weight [c, 1, k, k]`, then `epilogue` on each output plane as soon
/// as it is done.
pub fn depthwise_forward(g: &Conv, x: &[f32], weight: &[f32], epilogue: Epilogue) -> Vec<f32> {
    let (c, kk) = (g.in_channels, g.kernel * g.kernel);
    let plan = Depthwise::new(g);
    let len = g.batch * c * g.out_plane();
    // every value is written below, plane by plane: no zeroing first
    let mut y: Vec<f32> = Vec::with_capacity(len);
    y.spare_capacity_mut()[..len]
        .par_chunks_mut(g.out_plane().max(1))
        .enumerate()
        .for_each_init(
            || plan.scratch(),
            |scratch, (p, out)| {
                let filter = &weight[(p % c) * kk..][..kk];
                let src = &x[p * g.in_plane()..][..g.in_plane()];
                plan.forward_plane(src, filter, out, scratch);
                // SAFETY: `forward_plane` wrote every value of `out`.
                let out = unsafe { written(out) };
                epilogue.apply(out, p % c);
            },
        );
    // SAFETY: `forward_plane` wrote every value of every plane.
    unsafe { y.set_len(len) };
    y
}

/// Backward pass of [`depthwise_forward`]: `(dx, dweight)`, plane by plane
/// ([`Depthwise::backward_plane`]).
pub fn depthwise_backward(g: &Conv, x: &[f32], weight: &[f32], dy: &[f32]) -> (Vec<f32>, Vec<f32>) {
    let (c, kk) = (g.in_channels, g.kernel * g.kernel);
    let plan = Depthwise::new(g);
    let mut dx: Vec<f32> = Vec::with_capacity(x.len());
    // per-plane filter gradients, summed over the batch below
    let mut partial = vec![0.0f32; g.batch * c * kk];
    dx.spare_capacity_mut()[..x.len()]
        .par_chunks_mut(g.in_plane().max(1))
        .zip(partial.par_chunks_mut(kk))
        .enumerate()
        .for_each_init(
            || plan.scratch(),
            |scratch, (p, (dplane, dfilter))| {
                let src = &x[p * g.in_plane()..][..g.in_plane()];
                let grad = &dy[p * g.out_plane()..][..g.out_plane()];
                let filter = &weight[(p % c) * kk..][..kk];
                plan.backward_plane((src, grad), filter, dplane, dfilter, scratch);
            },
        );
    // SAFETY: `backward_plane` wrote every place of every plane.
    unsafe { dx.set_len(x.len()) };
    (dx, batch_sum(&partial, weight.len()))
}

/// One block's output gradient laid out like the block's runs (row `j` at `j * run`, zeros
/// between rows), after `margin` zeros and followed by zeros to `2 * margin` past its end, so
/// that runs shifted back by up to `margin` read zeros outside the block.
#[derive(Default)]
struct BlockGrad {
    buf: Vec<f32>,
    margin: usize,
    len: usize,
}

impl BlockGrad {
    fn new(margin: usize) -> Self {
        Self {
            buf: Vec::new(),
            margin,
            len: 0,
        }
    }

    /// Lays out rows `oy .. oy + rows` of the plane gradient `grad`. Every block writes the
    /// same places, so the zeros between rows stay; the zeros after the block are rewritten
    /// (a longer block before it may have left values there).
    fn fill(&mut self, padded: &Padded, grad: &[f32], (oy, rows): (usize, usize)) {
        let (margin, len) = (self.margin, padded.block_len(rows));
        if self.buf.len() < len + 2 * margin {
            self.buf.resize(len + 2 * margin, 0.0);
        }
        self.len = len;
        let rows_out = grad[oy * padded.out_width..].chunks(padded.out_width);
        for (j, row) in rows_out.take(rows).enumerate() {
            self.buf[margin + j * padded.run..][..padded.out_width].copy_from_slice(row);
        }
        self.buf[margin + len..].fill(0.0);
    }

    /// The block's values.
    fn values(&self) -> &[f32] {
        &self.buf[self.margin..][..self.len]
    }

    /// `n` values starting `shift` before the block (`shift <= margin`).
    fn shifted(&self, shift: usize, n: usize) -> &[f32] {
        &self.buf[self.margin - shift..][..n]
    }
}

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

/// Lanes of the BatchNorm statistics sums. At 8 lanes (one vector) the compiler left
/// these two-accumulator loops scalar: a channel's sums at 64 x 150 x 150, batch 8, took
/// 5.7 ms on two cores; at 32 lanes 1.3 ms (at 16 no faster than 8).
const STATISTICS_LANES: usize = 32;

/// `sum(x)` with lane accumulators (`iter().sum()` is one serial chain of additions).
fn lane_sum(x: &[f32]) -> f32 {
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
fn sum_and_squares(x: &[f32], shift: f32) -> (f32, f32) {
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

/// Values per task of the parallel element-wise loops below.
const ELEMENTWISE_CHUNK: usize = 1 << 14;

/// Rows (anchors) per task of the sigmoid cross-entropy loops.
const ROWS_PER_TASK: usize = 512;

/// `n` values computed in parallel, `chunk` at a time, into a new vector without zeroing it
/// first: `values(range)` yields the values at `range`.
fn parallel_values<I: ExactSizeIterator<Item = f32>>(
    n: usize,
    chunk: usize,
    values: impl Fn(std::ops::Range<usize>) -> I + Sync,
) -> Vec<f32> {
    let chunk = chunk.max(1);
    let mut out: Vec<f32> = Vec::with_capacity(n);
    out.spare_capacity_mut()[..n]
        .par_chunks_mut(chunk)
        .enumerate()
        .for_each(|(i, out)| {
            let start = i * chunk;
            let values = values(start..start + out.len());
            assert_eq!(values.len(), out.len(), "one value for each place");
            for (o, v) in out.iter_mut().zip(values) {
                o.write(v);
            }
        });
    // SAFETY: the chunks cover all `n` places, and each chunk's were written above (the
    // assertion guarantees as many values as places).
    unsafe { out.set_len(n) };
    out
}

/// `exp(y)` for `y <= 0` (below -87.3 it returns `exp(-87.3)`, about 1.2e-38), without a
/// library call, so that loops over it vectorise: `y = n ln 2 + r` with `|r| <= ln 2 / 2`
/// (Cody-Waite split of `ln 2`), `exp(r)` by its Taylor series to `r^7` (truncation below
/// 3e-9 relative), times `2^n` built in the exponent bits.
fn exp_non_positive(y: f32) -> f32 {
    const LN2_HI: f32 = 0.693_359_4;
    const LN2_LO: f32 = -2.121_944_4e-4;
    let y = y.clamp(-87.3, 0.0);
    let n = (y * std::f32::consts::LOG2_E).round_ties_even();
    let r = (y - n * LN2_HI) - n * LN2_LO;
    let taylor = [
        1.0 / 5040.0,
        1.0 / 720.0,
        1.0 / 120.0,
        1.0 / 24.0,
        1.0 / 6.0,
        0.5,
        1.0,
        1.0,
    ];
    polynomial(r, taylor) * f32::from_bits(((n as i32 + 127) as u32) << 23)
}

/// `ln(1 + e)` for `e` in `[0, 1]` without a library call: `2 atanh(s)` with
/// `s = e / (2 + e) <= 1/3`, its odd series to `s^15` (truncation below 1e-9 relative; no
/// loss for tiny `e`, where `1 + e` would round to 1).
fn ln_1p_unit(e: f32) -> f32 {
    let s = e / (2.0 + e);
    let odd = [
        1.0 / 15.0,
        1.0 / 13.0,
        1.0 / 11.0,
        1.0 / 9.0,
        1.0 / 7.0,
        1.0 / 5.0,
        1.0 / 3.0,
        1.0,
    ];
    2.0 * s * polynomial(s * s, odd)
}

/// `c[0] x^(N-1) + c[1] x^(N-2) + ... + c[N-1]` by Horner's rule (fused multiply-adds).
fn polynomial<const N: usize>(x: f32, coefficients: [f32; N]) -> f32 {
    coefficients[1..]
        .iter()
        .fold(coefficients[0], |p, &c| p.mul_add(x, c))
}

/// `sigmoid_cross_entropy_with_logits` of one logit `x` and label `z`:
/// `max(x, 0) - x z + log(1 + exp(-|x|))`.
fn sigmoid_cross_entropy_value(x: f32, z: f32) -> f32 {
    x.max(0.0) - x * z + ln_1p_unit(exp_non_positive(-x.abs()))
}

/// `sigmoid_cross_entropy_with_logits` of `[rows, classes]` logits and labels, summed over
/// each row's classes: `max(x, 0) - x z + log(1 + exp(-|x|))`. The values are computed
/// over a task's rows in one vectorised pass, then summed row by row.
pub fn sigmoid_cross_entropy(logits: &[f32], labels: &[f32], classes: usize) -> Vec<f32> {
    assert_eq!(logits.len(), labels.len());
    let classes = classes.max(1);
    parallel_values(logits.len() / classes, ROWS_PER_TASK, |rows| {
        let values = rows.start * classes..rows.end * classes;
        let (x, z) = (&logits[values.clone()], &labels[values]);
        let terms: Vec<f32> = x
            .iter()
            .zip(z)
            .map(|(&x, &z)| sigmoid_cross_entropy_value(x, z))
            .collect();
        (0..rows.len()).map(move |r| terms[r * classes..][..classes].iter().sum())
    })
}

/// `sigmoid(x)` without overflow for large `|x|` and without branches:
/// `1 / (1 + exp(-x))` for `x >= 0`, `exp(x) / (1 + exp(x))` below.
fn sigmoid(x: f32) -> f32 {
    let e = exp_non_positive(-x.abs());
    let s = 1.0 / (1.0 + e);
    if x >= 0.0 { s } else { e * s }
}

/// Gradient of [`sigmoid_cross_entropy`] for the per-row output gradient `grad`:
/// `(sigmoid(x) - z) * grad[row]`.
pub fn sigmoid_cross_entropy_backward(
    logits: &[f32],
    labels: &[f32],
    grad: &[f32],
    classes: usize,
) -> Vec<f32> {
    assert_eq!(logits.len(), labels.len());
    let classes = classes.max(1);
    assert_eq!(grad.len() * classes, logits.len());
    let mut out = vec![0.0f32; logits.len()];
    out.par_chunks_mut(ROWS_PER_TASK * classes)
        .zip(logits.par_chunks(ROWS_PER_TASK * classes))
        .zip(labels.par_chunks(ROWS_PER_TASK * classes))
        .zip(grad.par_chunks(ROWS_PER_TASK))
        .for_each(|(((out, x), z), g)| {
            let rows = out.chunks_mut(classes).zip(x.chunks(classes));
            for ((o, x), (z, &g)) in rows.zip(z.chunks(classes).zip(g)) {
                for ((o, &x), &z) in o.iter_mut().zip(x).zip(z) {
                    *o = (sigmoid(x) - z) * g;
                }
            }
        });
    out
}

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

/// `average <- average - (1 - keep) (average - value)`, in place and in parallel.
pub fn moving_average_in_place(average: &mut [f32], value: &[f32], keep: f32) {
    assert_eq!(value.len(), average.len());
    average
        .par_chunks_mut(ELEMENTWISE_CHUNK)
        .zip(value.par_chunks(ELEMENTWISE_CHUNK))
        .for_each(|(average, value)| {
            for (a, &v) in average.iter_mut().zip(value) {
                *a -= (*a - v) * (1.0 - keep);
            }
        });
}

/// Mean and biased variance of one channel's planes, in one pass: sums of `x` and
/// `(x - k)^2` with `k` the channel's first value (close enough to the mean that
/// `E[(x - k)^2] - (mean - k)^2` loses no precision that matters), per plane in lanes, across
/// planes in `f64`.
fn moments<'a>(planes: impl Iterator<Item = &'a [f32]> + Clone) -> (f32, f32) {
    let k = planes
        .clone()
        .find_map(|p| p.first().copied())
        .unwrap_or(0.0);
    let (mut sum, mut squares, mut count) = (0.0f64, 0.0f64, 0usize);
    for p in planes {
        let (s, q) = sum_and_squares(p, k);
        sum += s as f64;
        squares += q as f64;
        count += p.len();
    }
    let count = count.max(1) as f64;
    let mean = sum / count;
    let var = (squares / count - (mean - k as f64).powi(2)).max(0.0);
    (mean as f32, var as f32)
}

/// The planes of `[batch, channels, plane]` data that belong to channel `c`.
fn channel_planes(
    x: &[f32],
    [batch, channels, plane]: [usize; 3],
    c: usize,
) -> impl Iterator<Item = &[f32]> + Clone {
    (0..batch).map(move |b| &x[(b * channels + c) * plane..][..plane])
}

/// An output of `[batch, channels, plane]` values that parallel tasks fill channel by
/// channel: each task writes the planes of its own channel, which no other task touches.
struct ChannelOutput<'a> {
    values: *mut MaybeUninit<f32>,
    dims: [usize; 3],
    _buffer: std::marker::PhantomData<&'a mut [MaybeUninit<f32>]>,
}

// SAFETY: tasks only reach the buffer through `plane`, whose contract keeps their writes
// disjoint.
unsafe impl Send for ChannelOutput<'_> {}
unsafe impl Sync for ChannelOutput<'_> {}

impl<'a> ChannelOutput<'a> {
    fn new(values: &'a mut [MaybeUninit<f32>], dims: [usize; 3]) -> Self {
        assert_eq!(values.len(), dims.iter().product::<usize>());
        Self {
            values: values.as_mut_ptr(),
            dims,
            _buffer: std::marker::PhantomData,
        }
    }

    /// Plane `b` of channel `c`.
    ///
    /// # Safety
    /// Only one task may hold a given `(b, c)` plane at a time.
    #[allow(clippy::mut_from_ref)]
    unsafe fn plane(&self, b: usize, c: usize) -> &mut [MaybeUninit<f32>] {
        let [batch, channels, plane] = self.dims;
        assert!(b < batch && c < channels);
        // SAFETY: in bounds by the assertion; exclusive by the caller's contract.
        unsafe {
            std::slice::from_raw_parts_mut(self.values.add((b * channels + c) * plane), plane)
        }
    }
}

/// `clamp(v * s + t, 0, 6)`.
#[inline]
fn scaled_relu6(v: f32, s: f32, t: f32) -> f32 {
    (v * s + t).clamp(0.0, 6.0)
}

/// `x <- clamp(x * scale[c] + shift[c], 0, 6)` over `[batch, channels, plane]` data, in
/// place (inference: the convolution's output buffer becomes the layer's output).
pub fn affine_relu6_in_place(x: &mut [f32], plane: usize, scale: &[f32], shift: &[f32]) {
    Epilogue::AffineRelu6 { scale, shift }.apply_planes(x, plane, true);
}

/// Training-mode BatchNorm followed by ReLU6 over `[batch, channels, plane]` data:
/// `(y, mean, variance)` with the batch mean and biased variance. Channel by channel, so
/// that the normalising pass reads the planes the statistics pass just brought into the
/// cache.
pub fn batch_norm_relu6(
    x: &[f32],
    [batch, plane]: [usize; 2],
    gamma: &[f32],
    beta: &[f32],
    epsilon: f32,
) -> (Vec<f32>, Vec<f32>, Vec<f32>) {
    let dims = [batch, gamma.len(), plane];
    let mut y: Vec<f32> = Vec::with_capacity(x.len());
    let out = ChannelOutput::new(&mut y.spare_capacity_mut()[..x.len()], dims);
    let (mean, var) = (0..gamma.len())
        .into_par_iter()
        .map(|c| {
            let (mean, var) = moments(channel_planes(x, dims, c));
            let (s, t) = channel_affine(gamma[c], beta[c], mean, var, epsilon);
            for (b, src) in channel_planes(x, dims, c).enumerate() {
                // SAFETY: this task is the only one writing channel `c`.
                let dst = unsafe { out.plane(b, c) };
                for (o, &v) in dst.iter_mut().zip(src) {
                    o.write(scaled_relu6(v, s, t));
                }
            }
            (mean, var)
        })
        .unzip();
    // SAFETY: every channel's `batch` planes were written above.
    unsafe { y.set_len(x.len()) };
    (y, mean, var)
}

/// `(scale, shift)` of one channel of a training-mode BatchNorm: `gamma / sqrt(var + eps)`
/// and `beta - mean * scale` (the forward and backward passes share this arithmetic, so the
/// backward pass's ReLU6 mask is the forward pass's exactly).
fn channel_affine(gamma: f32, beta: f32, mean: f32, var: f32, epsilon: f32) -> (f32, f32) {
    let scale = gamma / (var + epsilon).sqrt();
    (scale, beta - mean * scale)
}

/// One channel's constants in [`batch_norm_relu6_backward`].
struct ChannelGrad {
    /// The forward pass's `(scale, shift)`.
    affine: (f32, f32),
    mean: f32,
    inv_std: f32,
}

impl ChannelGrad {
    fn new([gamma, beta, mean, variance]: [f32; 4], epsilon: f32) -> Self {
        Self {
            affine: channel_affine(gamma, beta, mean, variance, epsilon),
            mean,
            inv_std: 1.0 / (variance + epsilon).sqrt(),
        }
    }

    /// The output gradient `g` where ReLU6 passes it: where its input `x * scale + shift`
    /// was strictly inside `(0, 6)` (TF's `Relu6Grad`), computed with the forward pass's
    /// arithmetic, so the mask is the forward pass's exactly.
    #[inline]
    fn masked(&self, g: f32, x: f32) -> f32 {
        let (s, t) = self.affine;
        let z = x * s + t;
        if z > 0.0 && z < 6.0 { g } else { 0.0 }
    }

    /// `(sum(dz), sum(dz * (x - mean)))` over one plane's inputs `xs` and output gradients
    /// `gs`, `dz` the masked gradient, in lanes.
    fn plane_sums(&self, xs: &[f32], gs: &[f32]) -> (f32, f32) {
        let m = self.mean;
        let (mut a, mut d) = ([0.0f32; STATISTICS_LANES], [0.0f32; STATISTICS_LANES]);
        let (xc, gc) = (
            xs.chunks_exact(STATISTICS_LANES),
            gs.chunks_exact(STATISTICS_LANES),
        );
        let (mut ta, mut td) = (0.0f32, 0.0f32);
        for (&xv, &g) in xc.remainder().iter().zip(gc.remainder()) {
            let dz = self.masked(g, xv);
            td += dz;
            ta += dz * (xv - m);
        }
        for (xv, g) in xc.zip(gc) {
            for i in 0..STATISTICS_LANES {
                let dz = self.masked(g[i], xv[i]);
                d[i] += dz;
                a[i] += dz * (xv[i] - m);
            }
        }
        (d.iter().sum::<f32>() + td, a.iter().sum::<f32>() + ta)
    }
}

/// The sums of one channel's [`ChannelGrad::plane_sums`], added plane by plane in order.
#[derive(Default)]
struct ChannelSums {
    dz: f64,
    dz_centred: f64,
    count: usize,
}

impl ChannelSums {
    fn add(&mut self, channel: &ChannelGrad, xs: &[f32], gs: &[f32]) {
        let (dz, dz_centred) = channel.plane_sums(xs, gs);
        self.dz += dz as f64;
        self.dz_centred += dz_centred as f64 * channel.inv_std as f64;
        self.count += xs.len();
    }

    /// Writes the channel's input-gradient planes into `out`, one for each of its `(input,
    /// output gradient)` planes, and returns `(dgamma, dbeta)`.
    fn finish<'a, 'o>(
        self,
        channel: &ChannelGrad,
        planes: impl Iterator<Item = (&'a [f32], &'a [f32])>,
        out: impl Iterator<Item = &'o mut [MaybeUninit<f32>]>,
    ) -> (f32, f32) {
        let (dgamma, dbeta) = (self.dz_centred as f32, self.dz as f32);
        let count = self.count as f32;
        let (mean_dz, mean_dz_xhat) = (dbeta / count, dgamma / count);
        let (s, m, inv_std) = (channel.affine.0, channel.mean, channel.inv_std);
        for ((xs, gs), dst) in planes.zip(out) {
            for ((o, &xv), &g) in dst.iter_mut().zip(xs).zip(gs) {
                let xhat = (xv - m) * inv_std;
                o.write(s * (channel.masked(g, xv) - mean_dz - xhat * mean_dz_xhat));
            }
        }
        (dgamma, dbeta)
    }
}

/// One channel's BatchNorm + ReLU6 backward pass: the sums over its `(input, output
/// gradient)` planes ([`ChannelSums`]), then its input-gradient planes into `out` from the
/// planes the sums just brought into the cache; returns `(dgamma, dbeta)`.
fn channel_backward<'a, 'o>(
    channel: &ChannelGrad,
    planes: impl Iterator<Item = (&'a [f32], &'a [f32])> + Clone,
    out: impl Iterator<Item = &'o mut [MaybeUninit<f32>]>,
) -> (f32, f32) {
    let mut sums = ChannelSums::default();
    for (xs, gs) in planes.clone() {
        sums.add(channel, xs, gs);
    }
    sums.finish(channel, planes, out)
}

/// Gradients of [`batch_norm_relu6`]: `(dx, dgamma, dbeta)`, channel by channel
/// ([`channel_backward`]).
pub fn batch_norm_relu6_backward(
    x: &[f32],
    dy: &[f32],
    [batch, plane]: [usize; 2],
    [gamma, beta]: [&[f32]; 2],
    [mean, variance]: [&[f32]; 2],
    epsilon: f32,
) -> (Vec<f32>, Vec<f32>, Vec<f32>) {
    let dims = [batch, gamma.len(), plane];
    let mut dx: Vec<f32> = Vec::with_capacity(x.len());
    let out = ChannelOutput::new(&mut dx.spare_capacity_mut()[..x.len()], dims);
    let (dgamma, dbeta) = (0..gamma.len())
        .into_par_iter()
        .map(|c| {
            let channel = ChannelGrad::new([gamma[c], beta[c], mean[c], variance[c]], epsilon);
            let planes = channel_planes(x, dims, c).zip(channel_planes(dy, dims, c));
            // SAFETY: this task is the only one writing channel `c`.
            let dst = (0..batch).map(|b| unsafe { out.plane(b, c) });
            channel_backward(&channel, planes, dst)
        })
        .unzip();
    // SAFETY: every channel's `batch` planes were written above.
    unsafe { dx.set_len(x.len()) };
    (dx, dgamma, dbeta)
}

/// `clamp(v * s + t, 0, 6)` of every value of `src`, into `dst`: a plane of a training
/// BatchNorm + ReLU6's output, made where it is consumed instead of stored.
fn scaled_relu6_into<'a>(dst: &'a mut Vec<f32>, src: &[f32], s: f32, t: f32) -> &'a [f32] {
    dst.clear();
    dst.extend(src.iter().map(|&v| scaled_relu6(v, s, t)));
    dst
}

/// Outputs of [`depthwise_between_batch_norms`].
pub struct DepthwiseBetween {
    /// The second BatchNorm + ReLU6's output.
    pub y: Vec<f32>,
    /// The convolution's output (the second BatchNorm's input).
    pub conv: Vec<f32>,
    /// Batch mean and biased variance of the first BatchNorm, then of the second.
    pub stats: [Vec<f32>; 4],
}

/// Training-mode BatchNorm + ReLU6 of `x [batch, c, h, w]` with `before` (as
/// [`batch_norm_relu6`]), the depthwise convolution `g` with `weight` (as
/// [`depthwise_forward`]), then BatchNorm + ReLU6 with `after`, as one pass per channel: the
/// channel's statistics, each of its planes normalised into a buffer and convolved from
/// there into a buffer of the channel's outputs, their statistics, then the normalised
/// output. The activations between the operations are never read back from memory, and the
/// first BatchNorm's output is not stored at all. The values are those of the three
/// operations one after the other, bit for bit.
pub fn depthwise_between_batch_norms(
    g: &Conv,
    x: &[f32],
    (before, weight, after): ([&[f32]; 2], &[f32], [&[f32]; 2]),
    [epsilon_before, epsilon_after]: [f32; 2],
) -> DepthwiseBetween {
    let (c, kk) = (g.in_channels, g.kernel * g.kernel);
    let plan = Depthwise::new(g);
    let in_dims = [g.batch, c, g.in_plane()];
    let out_plane = g.out_plane().max(1);
    let len = g.batch * c * g.out_plane();
    let (mut y, mut conv): (Vec<f32>, Vec<f32>) =
        (Vec::with_capacity(len), Vec::with_capacity(len));
    let out_dims = [g.batch, c, g.out_plane()];
    let y_out = ChannelOutput::new(&mut y.spare_capacity_mut()[..len], out_dims);
    let conv_out = ChannelOutput::new(&mut conv.spare_capacity_mut()[..len], out_dims);
    let stats: Vec<[f32; 4]> = (0..c)
        .into_par_iter()
        .map_init(
            || (plan.scratch(), Vec::new(), Vec::new()),
            |(scratch, normalised, outputs), ch| {
                let (mean, var) = moments(channel_planes(x, in_dims, ch));
                let [gamma, beta] = before;
                let (s, t) = channel_affine(gamma[ch], beta[ch], mean, var, epsilon_before);
                let filter = &weight[ch * kk..][..kk];
                outputs.resize(g.batch * g.out_plane(), 0.0);
                let planes = channel_planes(x, in_dims, ch).zip(outputs.chunks_mut(out_plane));
                for (src, dst) in planes {
                    let src = scaled_relu6_into(normalised, src, s, t);
                    plan.forward_plane(src, filter, as_uninit(dst), scratch);
                }
                let (mean_after, var_after) = moments(outputs.chunks(out_plane));
                let [gamma, beta] = after;
                let affine =
                    channel_affine(gamma[ch], beta[ch], mean_after, var_after, epsilon_after);
                for (b, src) in outputs.chunks(out_plane).enumerate() {
                    // SAFETY: this task is the only one writing channel `ch`.
                    let (dst, kept) = unsafe { (y_out.plane(b, ch), conv_out.plane(b, ch)) };
                    for ((o, k), &v) in dst.iter_mut().zip(kept).zip(src) {
                        o.write(scaled_relu6(v, affine.0, affine.1));
                        k.write(v);
                    }
                }
                [mean, var, mean_after, var_after]
            },
        )
        .collect();
    // SAFETY: every channel's `batch` planes of both outputs were written above.
    unsafe {
        y.set_len(len);
        conv.set_len(len);
    }
    let stat = |i: usize| stats.iter().map(|s| s[i]).collect();
    DepthwiseBetween {
        y,
        conv,
        stats: [stat(0), stat(1), stat(2), stat(3)],
    }
}

/// One BatchNorm's `[gamma, beta, mean, variance]` (per channel) and epsilon.
pub type BatchNormState<'a> = ([&'a [f32]; 4], f32);

/// Gradients of [`depthwise_between_batch_norms`] for the output gradient `dy`, given its
/// input `x` and the convolution's output `conv`: `[dx, dgamma_before, dbeta_before,
/// dweight, dgamma_after, dbeta_after]`. Channel by channel: the second BatchNorm's backward
/// pass into a buffer of the channel's gradients at the convolution's output; each input
/// plane normalised again and sent back through the convolution
/// ([`Depthwise::backward_plane`]) into a buffer of the channel's gradients at the first
/// BatchNorm's output, summed for its backward pass while in the cache ([`ChannelSums`]);
/// then that backward pass. The gradients between the operations are never stored. The
/// values are those of the three backward passes one after the other, bit for bit.
pub fn depthwise_between_batch_norms_backward(
    g: &Conv,
    (x, conv, dy): (&[f32], &[f32], &[f32]),
    (before, weight, after): (BatchNormState<'_>, &[f32], BatchNormState<'_>),
) -> [Vec<f32>; 6] {
    let (c, kk, plane) = (g.in_channels, g.kernel * g.kernel, g.in_plane());
    let out_plane = g.out_plane().max(1);
    let plan = Depthwise::new(g);
    let (in_dims, out_dims) = ([g.batch, c, plane], [g.batch, c, g.out_plane()]);
    let mut dx: Vec<f32> = Vec::with_capacity(x.len());
    let out = ChannelOutput::new(&mut dx.spare_capacity_mut()[..x.len()], in_dims);
    let channel_grad = |(params, epsilon): BatchNormState<'_>, ch: usize| {
        ChannelGrad::new(params.map(|p| p[ch]), epsilon)
    };
    let per_channel: Vec<([f32; 4], Vec<f32>)> = (0..c)
        .into_par_iter()
        .map_init(
            || {
                let buffers = (Vec::new(), Vec::new(), Vec::new(), vec![0.0f32; kk]);
                (plan.scratch(), buffers)
            },
            |(scratch, (normalised, conv_grads, grads, image)), ch| {
                // the second BatchNorm
                let channel = channel_grad(after, ch);
                let planes =
                    channel_planes(conv, out_dims, ch).zip(channel_planes(dy, out_dims, ch));
                conv_grads.resize(g.batch * g.out_plane(), 0.0);
                let dst = conv_grads.chunks_mut(out_plane).map(as_uninit);
                let (dgamma_after, dbeta_after) = channel_backward(&channel, planes, dst);

                // the convolution, then the first BatchNorm's sums
                let channel = channel_grad(before, ch);
                let (s, t) = channel.affine;
                let filter = &weight[ch * kk..][..kk];
                // the filter gradient summed image by image, as `depthwise_backward` does
                let mut dfilter = vec![0.0f32; kk];
                let mut sums = ChannelSums::default();
                grads.resize(g.batch * plane, 0.0);
                let inputs = channel_planes(x, in_dims, ch).zip(conv_grads.chunks(out_plane));
                for ((src, grad), dst) in inputs.zip(grads.chunks_mut(plane.max(1))) {
                    let normal = scaled_relu6_into(normalised, src, s, t);
                    image.fill(0.0);
                    let dst_uninit = as_uninit(dst);
                    plan.backward_plane((normal, grad), filter, dst_uninit, image, scratch);
                    axpy(&mut dfilter, 1.0, image);
                    // while the plane's gradient is in the cache
                    sums.add(&channel, src, dst);
                }
                let planes = channel_planes(x, in_dims, ch).zip(grads.chunks(plane.max(1)));
                // SAFETY: this task is the only one writing channel `ch`.
                let dst = (0..g.batch).map(|b| unsafe { out.plane(b, ch) });
                let (dgamma, dbeta) = sums.finish(&channel, planes, dst);
                ([dgamma, dbeta, dgamma_after, dbeta_after], dfilter)
            },
        )
        .collect();
    // SAFETY: every channel's `batch` planes were written above.
    unsafe { dx.set_len(x.len()) };
    let param = |i: usize| per_channel.iter().map(|(p, _)| p[i]).collect();
    let dweight = per_channel
        .iter()
        .flat_map(|(_, w)| w.iter().copied())
        .collect();
    [dx, param(0), param(1), dweight, param(2), param(3)]
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Relative error of `got` against the exact `want` (absolute below 1e-30).
    fn relative_error(got: f32, want: f64) -> f64 {
        (got as f64 - want).abs() / want.abs().max(1e-30)
    }

    #[test]
    fn exp_and_ln_1p_match_the_exact_functions_to_float_precision() {
        // every 1/1000 from -87 to 0: within 2 float ulps (2^-23 relative each) of exp
        let mut worst_exp = 0.0f64;
        for i in 0..=87_000 {
            let y = -(i as f32) / 1000.0;
            worst_exp = worst_exp.max(relative_error(exp_non_positive(y), (y as f64).exp()));
        }
        assert!(
            worst_exp < 2.5e-7,
            "exp: worst relative error {worst_exp:e}"
        );
        assert_eq!(exp_non_positive(0.0), 1.0);
        // the clamp: far below -87.3, the value at -87.3 (tiny, positive, finite)
        let floor = exp_non_positive(-1000.0);
        assert!(floor > 0.0 && floor < 1.3e-38, "{floor:e}");

        // ln(1 + e) on [0, 1], down to e = 1e-30 where 1 + e rounds to 1
        let mut worst_ln = 0.0f64;
        for i in 0..=10_000 {
            let e = i as f32 / 10_000.0;
            let want = (e as f64).ln_1p();
            if e > 0.0 {
                worst_ln = worst_ln.max(relative_error(ln_1p_unit(e), want));
            }
        }
        for e in [1e-30f32, 1e-12, 1e-8, 3e-5] {
            worst_ln = worst_ln.max(relative_error(ln_1p_unit(e), (e as f64).ln_1p()));
        }
        assert!(
            worst_ln < 2.5e-7,
            "ln_1p: worst relative error {worst_ln:e}"
        );
        assert_eq!(ln_1p_unit(0.0), 0.0);
    }

    #[test]
    fn sigmoid_and_the_loss_term_match_their_definitions() {
        for i in -4000..=4000 {
            let x = i as f32 / 50.0;
            let exact = 1.0 / (1.0 + (-(x as f64)).exp());
            assert!(relative_error(sigmoid(x), exact) < 5e-7, "sigmoid({x})");
            for z in [0.0f32, 0.3, 1.0] {
                let (xd, zd) = (x as f64, z as f64);
                let want = xd.max(0.0) - xd * zd + (-xd.abs()).exp().ln_1p();
                let got = sigmoid_cross_entropy_value(x, z) as f64;
                // absolute against the larger of the terms (the subtraction cancels)
                let scale = xd.abs().max(1.0);
                assert!(
                    (got - want).abs() < 5e-7 * scale,
                    "loss({x}, {z}): {got} vs {want}"
                );
            }
        }
    }
}
