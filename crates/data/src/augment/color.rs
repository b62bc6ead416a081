//! The colour steps, as the API's `random_adjust_*`, `random_rgb_to_gray` and
//! `random_distort_color` compute them: on float pixels in `[0, 255]`, each adjustment made on
//! the `[0, 1]` scale by the `tf.image` op it calls and clipped to `[0, 255]` after it.

use image::RgbImage;

/// An image's pixels as floats in `[0, 255]`, between the adjustments of one step.
pub(super) struct Pixels(Vec<[f32; 3]>);

impl Pixels {
    pub(super) fn of(image: &RgbImage) -> Self {
        Self(image.pixels().map(|p| p.0.map(f32::from)).collect())
    }

    /// Writes the pixels back, rounded to 8 bits (TF keeps floats between steps: this loses at
    /// most half a level of 255 a step).
    pub(super) fn write_to(&self, image: &mut RgbImage) {
        for (p, v) in image.pixels_mut().zip(&self.0) {
            p.0 = v.map(|c| c.round().clamp(0.0, 255.0) as u8);
        }
    }

    /// `f` on every pixel, clipped to `[0, 255]` after it as every API step clips.
    fn map(&mut self, f: impl Fn([f32; 3]) -> [f32; 3]) {
        for p in &mut self.0 {
            *p = f(*p).map(|c| c.clamp(0.0, 255.0));
        }
    }

    fn means(&self) -> [f32; 3] {
        means(self.0.iter().copied())
    }

    /// `tf.image.adjust_brightness`: `delta` (on the `[0, 1]` scale) added to every channel.
    pub(super) fn brightness(&mut self, delta: f32) {
        let delta = delta * 255.0;
        self.map(|p| p.map(|v| v + delta));
    }

    /// `tf.image.adjust_contrast`: each channel's distance from its mean over the image scaled.
    pub(super) fn contrast(&mut self, factor: f32) {
        let mean = self.means();
        self.map(|p| [0, 1, 2].map(|c| (p[c] - mean[c]) * factor + mean[c]));
    }

    /// `tf.image.adjust_saturation`.
    pub(super) fn saturation(&mut self, factor: f32) {
        self.map(|p| saturate(p, factor));
    }

    /// `tf.image.adjust_hue`.
    pub(super) fn hue(&mut self, delta: f32) {
        self.map(|p| rotate_hue(p, delta));
    }

    /// The API's `_rgb_to_grayscale` (luma weights on the float pixels) then
    /// `tf.image.grayscale_to_rgb`.
    pub(super) fn gray(&mut self) {
        self.map(|[r, g, b]| [0.2989 * r + 0.5870 * g + 0.1140 * b; 3]);
    }
}

/// The mean of each channel over the image.
pub(super) fn channel_means(image: &RgbImage) -> [f32; 3] {
    means(image.pixels().map(|p| p.0.map(f32::from)))
}

fn means(pixels: impl Iterator<Item = [f32; 3]>) -> [f32; 3] {
    let (mut sum, mut n) = ([0f64; 3], 0usize);
    for p in pixels {
        for c in 0..3 {
            sum[c] += p[c] as f64;
        }
        n += 1;
    }
    sum.map(|s| (s / n.max(1) as f64) as f32)
}

/// TF's `adjust_saturation`: the pixel's HSV saturation times `factor`, clipped to 1, hue and
/// value kept. With hue and value fixed every channel keeps its place between the value (the
/// largest channel) and the smallest channel `v (1 - s)`, so each moves from the value in
/// proportion to the new saturation: `c' = v - (v - c) s' / s`.
fn saturate(p: [f32; 3], factor: f32) -> [f32; 3] {
    let v = p[0].max(p[1]).max(p[2]);
    let min = p[0].min(p[1]).min(p[2]);
    if v <= 0.0 || v == min {
        return p; // black or grey: no saturation to scale
    }
    let s = (v - min) / v;
    let scale = (s * factor).clamp(0.0, 1.0) / s;
    p.map(|c| v - (v - c) * scale)
}

/// TF's `adjust_hue`: the pixel to HSV, `delta` added to the hue (turns, modulo 1), back to
/// RGB. Saturation and value are kept, so the smallest and largest channels stay where they
/// are and the hue picks the sector of the colour wheel and the middle channel's place.
fn rotate_hue(p: [f32; 3], delta: f32) -> [f32; 3] {
    let [r, g, b] = p;
    let v = r.max(g).max(b);
    let range = v - r.min(g).min(b);
    if range <= 0.0 {
        return p; // grey: no hue to turn
    }
    let norm = 1.0 / (6.0 * range);
    let hue = if r == v {
        norm * (g - b)
    } else if g == v {
        norm * (b - r) + 2.0 / 6.0
    } else {
        norm * (r - g) + 4.0 / 6.0
    };
    let hue = (hue + delta).rem_euclid(1.0);
    // HSV to RGB: chroma `range`, smallest channel `v - range`
    let sector = hue * 6.0;
    let x = range * (1.0 - ((sector % 2.0) - 1.0).abs());
    let m = v - range;
    let (r, g, b) = match sector as u32 {
        0 => (range, x, 0.0),
        1 => (x, range, 0.0),
        2 => (0.0, range, x),
        3 => (0.0, x, range),
        4 => (x, 0.0, range),
        _ => (range, 0.0, x),
    };
    [r + m, g + m, b + m]
}

#[cfg(test)]
mod tests {
    use super::super::tests::tf_fixture;
    use super::*;

    fn pixels(values: &[f32]) -> Pixels {
        Pixels(values.chunks(3).map(|c| [c[0], c[1], c[2]]).collect())
    }

    fn assert_close(got: &Pixels, want: &[f64], what: &str) {
        let got: Vec<f32> = got.0.iter().flatten().copied().collect();
        assert_eq!(got.len(), want.len(), "{what}");
        for (i, (g, w)) in got.iter().zip(want).enumerate() {
            // float32 arithmetic in another order than TF's kernel
            assert!(
                (*g as f64 - w).abs() < 2e-3,
                "{what}: value {i}: {g} against TF's {w}"
            );
        }
    }

    #[test]
    fn hue_and_gray_equal_tfs() {
        let tf = tf_fixture();
        let image: Vec<f32> = tf.image.iter().map(|&v| v as f32).collect();
        for case in &tf.hue {
            let mut p = pixels(&image);
            p.hue(case.delta);
            assert_close(&p, &case.image, &format!("hue {}", case.delta));
        }
        let mut p = pixels(&image);
        p.gray();
        assert_close(&p, &tf.gray, "gray");
    }

    #[test]
    fn contrast_and_saturation_follow_tfs_definitions() {
        let image = [200.0, 100.0, 50.0, 40.0, 60.0, 80.0];
        let rounded = |p: Pixels| -> Vec<u8> {
            let mut img = RgbImage::new(2, 1);
            p.write_to(&mut img);
            img.into_raw()
        };
        // contrast: each channel's distance from its mean over the image times the factor
        // (means 120, 80, 65), clipped to [0, 255], rounded
        let mut p = pixels(&image);
        p.contrast(1.5);
        assert_eq!(rounded(p), [240, 110, 43, 0, 50, 88]);
        // saturation, in HSV: (200, 100, 50) has value 200 and saturation 0.75; times 1.2 it
        // is 0.9, so the smallest channel goes to 200 (1 - 0.9) = 20 and the middle one keeps
        // its place between them, 20 + 180 (100 - 50) / 150 = 80; (40, 60, 80): value 80,
        // saturation 0.5 -> 0.6, smallest 32, middle 56
        let mut p = pixels(&image);
        p.saturation(1.2);
        assert_eq!(rounded(p), [200, 80, 20, 32, 56, 80]);
        // saturation 0.75 times 2 clips at 1: the smallest channel reaches 0
        let mut p = pixels(&image);
        p.saturation(2.0);
        assert_eq!(rounded(p)[..3], [200, 67, 0]);
    }
}
