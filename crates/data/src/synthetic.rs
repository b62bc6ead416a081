//! The built-in synthetic cats-and-dogs set: procedural images of cat heads (round face,
//! pointed ears) and dog heads (round face, long floppy ears) of varied size, colour, position
//! and count on textured backgrounds. Deterministic: image `i` of a seed is always the same.

use std::path::{Path, PathBuf};

use image::{ImageEncoder, Rgb, RgbImage, imageops};
use model::BBox;
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};

use crate::error::Result;
use crate::example::{DetectionExample, Object, sha256_hex};
use crate::shards::ShardedWriter;

/// The two classes, label-map ids 1 and 2.
pub const CLASSES: [&str; 2] = ["cat", "dog"];

/// One generated image with its annotations.
#[derive(Debug, Clone)]
pub struct SyntheticImage {
    /// The pixels.
    pub image: RgbImage,
    /// Objects as `(normalised box, class id)`.
    pub objects: Vec<(BBox, usize)>,
}

fn blend(a: [u8; 3], b: [u8; 3], t: f32) -> [u8; 3] {
    [0, 1, 2].map(|i| (a[i] as f32 * (1.0 - t) + b[i] as f32 * t) as u8)
}

fn random_colour(rng: &mut StdRng) -> [u8; 3] {
    [rng.random(), rng.random(), rng.random()]
}

/// Paints pixels inside an ellipse.
fn ellipse(img: &mut RgbImage, cx: f32, cy: f32, rx: f32, ry: f32, colour: [u8; 3]) {
    let (w, h) = img.dimensions();
    let y0 = (cy - ry).floor().max(0.0) as u32;
    let y1 = ((cy + ry).ceil().max(0.0) as u32).min(h);
    let x0 = (cx - rx).floor().max(0.0) as u32;
    let x1 = ((cx + rx).ceil().max(0.0) as u32).min(w);
    for y in y0..y1 {
        for x in x0..x1 {
            let dx = (x as f32 + 0.5 - cx) / rx;
            let dy = (y as f32 + 0.5 - cy) / ry;
            if dx * dx + dy * dy <= 1.0 {
                img.put_pixel(x, y, Rgb(colour));
            }
        }
    }
}

/// Paints pixels inside a triangle.
fn triangle(img: &mut RgbImage, p: [(f32, f32); 3], colour: [u8; 3]) {
    let (w, h) = img.dimensions();
    let min_x = p.iter().map(|q| q.0).fold(f32::MAX, f32::min).max(0.0) as u32;
    let max_x = (p.iter().map(|q| q.0).fold(f32::MIN, f32::max).max(0.0) as u32 + 1).min(w);
    let min_y = p.iter().map(|q| q.1).fold(f32::MAX, f32::min).max(0.0) as u32;
    let max_y = (p.iter().map(|q| q.1).fold(f32::MIN, f32::max).max(0.0) as u32 + 1).min(h);
    let edge = |a: (f32, f32), b: (f32, f32), x: f32, y: f32| {
        (b.0 - a.0) * (y - a.1) - (b.1 - a.1) * (x - a.0)
    };
    for y in min_y..max_y {
        for x in min_x..max_x {
            let (fx, fy) = (x as f32 + 0.5, y as f32 + 0.5);
            let e = [
                edge(p[0], p[1], fx, fy),
                edge(p[1], p[2], fx, fy),
                edge(p[2], p[0], fx, fy),
            ];
            if e.iter().all(|&v| v >= 0.0) || e.iter().all(|&v| v <= 0.0) {
                img.put_pixel(x, y, Rgb(colour));
            }
        }
    }
}

/// Draws a head of `class` (1 cat, 2 dog) with face radius `r` at `(cx, cy)`; returns its
/// pixel box `(x0, y0, x1, y1)` covering face and ears.
fn draw_head(
    img: &mut RgbImage,
    rng: &mut StdRng,
    class: usize,
    cx: f32,
    cy: f32,
    r: f32,
) -> (f32, f32, f32, f32) {
    let fur = random_colour(rng);
    let dark = blend(fur, [0, 0, 0], 0.6);
    let light = blend(fur, [255, 255, 255], 0.5);
    let bounds = if class == 1 {
        // pointed ears above the face
        for side in [-1.0f32, 1.0] {
            let base_out = (cx + side * r * 0.95, cy - r * 0.2);
            let base_in = (cx + side * r * 0.25, cy - r * 0.85);
            let tip = (cx + side * r * 0.8, cy - r * 1.45);
            triangle(img, [base_out, base_in, tip], dark);
        }
        ellipse(img, cx, cy, r, r * 0.9, fur);
        // whiskers
        for k in [-1.0f32, 1.0] {
            for j in 0..3 {
                let y = cy + r * 0.25 + j as f32 * r * 0.1;
                for t in 0..(r as u32 / 2) {
                    let x = cx + k * (r * 0.3 + t as f32);
                    if x >= 0.0 && (x as u32) < img.width() && y >= 0.0 && (y as u32) < img.height()
                    {
                        img.put_pixel(x as u32, y as u32, Rgb(light));
                    }
                }
            }
        }
        (cx - r, cy - r * 1.45, cx + r, cy + r * 0.9)
    } else {
        // long floppy ears hanging at the sides
        for side in [-1.0f32, 1.0] {
            ellipse(
                img,
                cx + side * r * 0.95,
                cy + r * 0.25,
                r * 0.35,
                r * 0.8,
                dark,
            );
        }
        ellipse(img, cx, cy, r * 0.85, r, fur);
        // muzzle and nose
        ellipse(img, cx, cy + r * 0.45, r * 0.45, r * 0.35, light);
        ellipse(img, cx, cy + r * 0.3, r * 0.15, r * 0.1, [20, 20, 20]);
        (cx - r * 1.3, cy - r, cx + r * 1.3, cy + r * 1.05)
    };
    // eyes
    for side in [-1.0f32, 1.0] {
        ellipse(
            img,
            cx + side * r * 0.35,
            cy - r * 0.15,
            r * 0.12,
            r * 0.12,
            [15, 15, 15],
        );
    }
    bounds
}

/// Generates image `index` of the set drawn with `seed`.
pub fn generate(seed: u64, index: u64) -> SyntheticImage {
    let mut rng = StdRng::seed_from_u64(seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) ^ index);
    let (w, h) = (
        rng.random_range(240..=400u32),
        rng.random_range(200..=320u32),
    );
    let (c1, c2) = (random_colour(&mut rng), random_colour(&mut rng));
    let stripes = rng.random_range(4.0..30.0f32);
    let angle = rng.random_range(0.0..std::f32::consts::PI);
    let (sa, ca) = angle.sin_cos();
    let mut img = RgbImage::from_fn(w, h, |x, y| {
        let t = ((x as f32 * ca + y as f32 * sa) / stripes).sin() * 0.5 + 0.5;
        Rgb(blend(c1, c2, t * 0.6))
    });
    for p in img.pixels_mut() {
        let n: i16 = rng.random_range(-12..=12);
        p.0 = p.0.map(|v| (v as i16 + n).clamp(0, 255) as u8);
    }
    let count = rng.random_range(1..=3);
    let mut objects: Vec<(BBox, usize)> = Vec::new();
    let min_side = w.min(h) as f32;
    for _ in 0..count {
        for _attempt in 0..20 {
            let class = rng.random_range(1..=2usize);
            let r = rng.random_range(min_side * 0.08..min_side * 0.25);
            let cx = rng.random_range(r * 1.3..w as f32 - r * 1.3);
            let cy = rng.random_range(r * 1.5..h as f32 - r * 1.1);
            let guess = BBox::new(
                (cy - r * 1.5) / h as f32,
                (cx - r * 1.3) / w as f32,
                (cy + r * 1.1) / h as f32,
                (cx + r * 1.3) / w as f32,
            );
            if objects.iter().any(|(b, _)| b.iou(&guess) > 0.0) {
                continue;
            }
            let (x0, y0, x1, y1) = draw_head(&mut img, &mut rng, class, cx, cy, r);
            let bbox = BBox::new(y0 / h as f32, x0 / w as f32, y1 / h as f32, x1 / w as f32)
                .clip_to(&BBox::new(0.0, 0.0, 1.0, 1.0));
            objects.push((bbox, class));
            break;
        }
    }
    SyntheticImage {
        image: img,
        objects,
    }
}

/// Writes images `0..count` of the set drawn with `seed`, each resized to `width x height`
/// (boxes are normalised, so they still fit), as one TFRecord file at `path`: a fixed-size
/// set for benchmarks.
pub fn write_resized_set(
    path: &Path,
    seed: u64,
    count: u64,
    [width, height]: [u32; 2],
) -> Result<Vec<PathBuf>> {
    let mut writer = ShardedWriter::create(path, 1)?;
    for i in 0..count {
        let s = generate(seed, i);
        let image = imageops::resize(&s.image, width, height, imageops::FilterType::Triangle);
        let example = SyntheticImage {
            image,
            objects: s.objects,
        }
        .to_example(i);
        writer.write(&example.encode())?;
    }
    writer.finish()
}

impl SyntheticImage {
    /// Encodes as a detection example (JPEG, quality 90) named `synthetic_<index>.jpg`.
    pub fn to_example(&self, index: u64) -> DetectionExample {
        let mut jpeg = Vec::new();
        image::codecs::jpeg::JpegEncoder::new_with_quality(&mut jpeg, 90)
            .write_image(
                self.image.as_raw(),
                self.image.width(),
                self.image.height(),
                image::ExtendedColorType::Rgb8,
            )
            .expect("encoding an RGB image in memory cannot fail");
        let filename = format!("synthetic_{index:06}.jpg");
        DetectionExample {
            sha256: sha256_hex(&jpeg),
            encoded: jpeg,
            format: "jpeg".into(),
            height: self.image.height() as i64,
            width: self.image.width() as i64,
            source_id: filename.clone(),
            filename,
            objects: self
                .objects
                .iter()
                .map(|&(bbox, class)| Object {
                    bbox,
                    class_text: CLASSES[class - 1].into(),
                    label: class as i64,
                    difficult: false,
                    truncated: false,
                    view: String::new(),
                })
                .collect(),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn deterministic_valid_and_varied() {
        let a = generate(1, 5);
        let b = generate(1, 5);
        assert_eq!(a.image, b.image);
        assert_eq!(a.objects, b.objects);
        assert_ne!(generate(2, 5).image, a.image);
        let mut classes = [0usize; 3];
        for i in 0..50 {
            let s = generate(3, i);
            assert!(!s.objects.is_empty() && s.objects.len() <= 3);
            for (b, c) in &s.objects {
                assert!(b.ymin >= 0.0 && b.xmin >= 0.0 && b.ymax <= 1.0 && b.xmax <= 1.0);
                assert!(b.height() > 0.05 && b.width() > 0.05, "{b:?}");
                classes[*c] += 1;
            }
            for (i, (p, _)) in s.objects.iter().enumerate() {
                for (q, _) in &s.objects[i + 1..] {
                    assert!(p.iou(q) < 0.2);
                }
            }
        }
        assert!(classes[1] > 10 && classes[2] > 10, "{classes:?}");
    }

    #[test]
    fn example_decodes_back_to_the_image() {
        let s = generate(0, 0);
        let e = s.to_example(0);
        let img = image::load_from_memory(&e.encoded).unwrap();
        assert_eq!(
            (img.width() as i64, img.height() as i64),
            (e.width, e.height)
        );
        assert_eq!(e.objects.len(), s.objects.len());
        assert_eq!(e.sha256, sha256_hex(&e.encoded));
    }
}
