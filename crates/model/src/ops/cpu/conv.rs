//! Dense convolutions through im2col + GEMM, and their backward pass.

use super::matrix::{Split, gemm_into, transposed};
use super::slices::{as_uninit, axpy, copy_strided, lane_sum, written, zero_filled};
use super::{Conv, Epilogue};

use std::mem::MaybeUninit;

use rayon::prelude::*;

/// The bias gradient: `dy` of `[batch, channels, plane]` summed per channel.
pub fn bias_grad(dy: &[f32], plane: usize, channels: usize) -> Vec<f32> {
    let mut sums = vec![0.0f32; channels];
    for (p, chunk) in dy.chunks(plane.max(1)).enumerate() {
        sums[p % channels] += lane_sum(chunk);
    }
    sums
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
/// by image within each group of `Split`, then over the groups in order.
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
