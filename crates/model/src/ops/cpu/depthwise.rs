//! Depthwise convolutions (one filter per channel), computed directly plane by plane, and
//! their backward pass.

use super::slices::{as_uninit, axpy, copy_strided, dot, written, zero_filled};
use super::{Conv, Epilogue};

use std::mem::MaybeUninit;

use rayon::prelude::*;

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
pub(super) struct DepthwiseScratch {
    /// The padded input plane (blocked layout).
    padded: Vec<f32>,
    /// One block's outputs (forward) or the padded input gradient (backward).
    flat: Vec<f32>,
    /// The output gradient of one block (backward).
    block_grad: BlockGrad,
}

/// How the depthwise kernels run planes of one geometry: row by row from the source
/// ([`is_direct`]), or through the padded layout of [`Padded`], block by block.
pub(super) struct Depthwise {
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
    pub(super) fn new(g: &Conv) -> Self {
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

    pub(super) fn scratch(&self) -> DepthwiseScratch {
        DepthwiseScratch {
            block_grad: BlockGrad::new(self.reach * self.padded.run + self.reach),
            ..Default::default()
        }
    }

    /// The output plane of one input plane `src` and its channel's `filter`.
    pub(super) fn forward_plane(
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
    pub(super) fn backward_plane(
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
/// (`Depthwise::backward_plane`).
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
