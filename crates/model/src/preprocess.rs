//! Image preprocessing of the API's SSD: bilinear resize to the network's input size
//! (`tf.image.resize_images`, legacy pixel mapping without half-pixel centres) and the
//! MobileNet normalisation `(2 / 255) x - 1`.

use image::{DynamicImage, RgbImage};

use crate::error::{ModelError, Result};

/// Bilinear resize of an RGB image to `out_h` x `out_w`, returning interleaved `f32` RGB
/// (HWC) in `[0, 255]`. Source coordinates are `dst * in / out`, as TF 1's default resize.
pub fn resize_bilinear(image: &RgbImage, out_h: usize, out_w: usize) -> Vec<f32> {
    let (in_w, in_h) = (image.width() as usize, image.height() as usize);
    let scale = |n: usize, out: usize| n as f32 / out as f32;
    resize_scaled(image, out_h, out_w, scale(in_h, out_h), scale(in_w, out_w))
}

/// [`resize_bilinear`] as TF's `align_corners=True`: the corner pixels' centres stay on the
/// corners, source coordinates `dst * (in - 1) / (out - 1)`.
pub fn resize_bilinear_aligned(image: &RgbImage, out_h: usize, out_w: usize) -> Vec<f32> {
    let (in_w, in_h) = (image.width() as usize, image.height() as usize);
    let scale = |n: usize, out: usize| {
        if out > 1 {
            (n - 1) as f32 / (out - 1) as f32
        } else {
            0.0
        }
    };
    resize_scaled(image, out_h, out_w, scale(in_h, out_h), scale(in_w, out_w))
}

/// Bilinear resize with source coordinates `dst * scale`, clamped to the last pixel.
fn resize_scaled(
    image: &RgbImage,
    out_h: usize,
    out_w: usize,
    scale_y: f32,
    scale_x: f32,
) -> Vec<f32> {
    let (in_w, in_h) = (image.width() as usize, image.height() as usize);
    let raw = image.as_raw();
    let xs: Vec<(usize, usize, f32)> = (0..out_w)
        .map(|x| {
            let src = x as f32 * scale_x;
            let x0 = (src.floor() as usize).min(in_w - 1);
            (x0, (x0 + 1).min(in_w - 1), src - x0 as f32)
        })
        .collect();
    let mut out = Vec::with_capacity(out_h * out_w * 3);
    for y in 0..out_h {
        let src = y as f32 * scale_y;
        let y0 = (src.floor() as usize).min(in_h - 1);
        let y1 = (y0 + 1).min(in_h - 1);
        let dy = src - y0 as f32;
        let (row0, row1) = (&raw[y0 * in_w * 3..], &raw[y1 * in_w * 3..]);
        for &(x0, x1, dx) in &xs {
            for c in 0..3 {
                let tl = row0[x0 * 3 + c] as f32;
                let tr = row0[x1 * 3 + c] as f32;
                let bl = row1[x0 * 3 + c] as f32;
                let br = row1[x1 * 3 + c] as f32;
                let top = tl + (tr - tl) * dx;
                let bottom = bl + (br - bl) * dx;
                out.push(top + (bottom - top) * dy);
            }
        }
    }
    out
}

/// Interleaved HWC pixels in `[0, 255]` to planar CHW values in `[-1, 1]`, appended to `out`.
pub fn normalize_hwc_to_chw(hwc: &[f32], height: usize, width: usize, out: &mut Vec<f32>) {
    let plane = height * width;
    let start = out.len();
    out.resize(start + 3 * plane, 0.0);
    for (i, px) in hwc.chunks_exact(3).enumerate() {
        for c in 0..3 {
            out[start + c * plane + i] = px[c] * (2.0 / 255.0) - 1.0;
        }
    }
}

/// Converts any image to the network input (CHW, `[-1, 1]`, `height` x `width`), appended to
/// `out`. Empty images are an error.
pub fn image_to_input(
    image: &DynamicImage,
    height: usize,
    width: usize,
    out: &mut Vec<f32>,
) -> Result<()> {
    if image.width() == 0 || image.height() == 0 {
        return Err(ModelError::InvalidImage(format!(
            "image has zero size ({}x{})",
            image.width(),
            image.height()
        )));
    }
    let rgb = image.to_rgb8();
    normalize_hwc_to_chw(&resize_bilinear(&rgb, height, width), height, width, out);
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn resize_uses_legacy_tf_mapping() {
        // 1x4 row 0, 10, 20, 30 resized to width 2: sources x = 0 and 2 -> 0 and 20
        let img = RgbImage::from_fn(4, 1, |x, _| image::Rgb([(x * 10) as u8; 3]));
        let out = resize_bilinear(&img, 1, 2);
        assert_eq!(out, vec![0.0, 0.0, 0.0, 20.0, 20.0, 20.0]);
        // upsampling 2 -> 4: sources 0, 0.5, 1, 1.5 (last clamps to the edge)
        let img = RgbImage::from_fn(2, 1, |x, _| image::Rgb([(x * 100) as u8; 3]));
        let out: Vec<f32> = resize_bilinear(&img, 1, 4)
            .chunks(3)
            .map(|p| p[0])
            .collect();
        assert_eq!(out, vec![0.0, 50.0, 100.0, 100.0]);
    }

    #[test]
    fn normalisation_maps_to_unit_range() {
        let mut out = Vec::new();
        normalize_hwc_to_chw(&[0.0, 127.5, 255.0], 1, 1, &mut out);
        assert_eq!(out, vec![-1.0, 0.0, 1.0]);
        let empty = DynamicImage::new_rgb8(0, 5);
        assert!(image_to_input(&empty, 33, 33, &mut out).is_err());
    }
}
