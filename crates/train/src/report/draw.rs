//! Pixel drawing for `detect` and the evaluation images: filled rectangles and 8x8 text.

use font8x8::{BASIC_FONTS, UnicodeFonts};
use image::{Rgb, RgbImage};

/// Fills the rectangle `[x0, y0, x1, y1)`, clipped to the image.
pub fn fill(image: &mut RgbImage, [x0, y0, x1, y1]: [i64; 4], colour: Rgb<u8>) {
    let (w, h) = (image.width() as i64, image.height() as i64);
    for y in y0.max(0)..y1.min(h) {
        for x in x0.max(0)..x1.min(w) {
            image.put_pixel(x as u32, y as u32, colour);
        }
    }
}

/// Writes `text` with the 8x8 font scaled by `scale`, top-left at `(x, y)`.
pub fn draw_text(image: &mut RgbImage, text: &str, x: i64, y: i64, scale: i64, colour: Rgb<u8>) {
    for (i, c) in text.chars().enumerate() {
        let glyph = BASIC_FONTS.get(c).unwrap_or([0; 8]);
        for (row, bits) in glyph.iter().enumerate() {
            for col in 0..8 {
                if bits >> col & 1 == 1 {
                    let px = x + (i as i64 * 8 + col) * scale;
                    let py = y + row as i64 * scale;
                    fill(image, [px, py, px + scale, py + scale], colour);
                }
            }
        }
    }
}
