//! The crops and the zoom-out: `ssd_random_crop`, `random_crop_image` (TF's
//! `sample_distorted_bounding_box` search, then the boxes that stay) and `random_pad_image`.

use image::{Rgb, RgbImage};
use model::BBox;
use rand::Rng;
use serde::{Deserialize, Serialize};

use super::Annotated;
use super::color::channel_means;

/// One crop: an operation of `ssd_random_crop`, or `random_crop_image` (whose defaults are
/// [`CropOperation::default`]'s).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct CropOperation {
    /// Some box must have at least this fraction of its area inside the crop.
    pub min_object_covered: f32,
    /// Crop aspect ratio range (width / height).
    pub aspect_ratio_range: [f32; 2],
    /// Crop area range, as a fraction of the image.
    pub area_range: [f32; 2],
    /// Boxes with less than this fraction of their area inside the crop are dropped.
    pub overlap_thresh: f32,
    /// Clip kept boxes to the crop.
    pub clip_boxes: bool,
    /// Probability of leaving the image uncropped.
    pub random_coef: f32,
}

/// `random_crop_image`'s defaults in the API's `preprocessor.proto`: a crop of 10-100% of the
/// image with an aspect ratio of 0.75-1.33 holding a whole object, boxes kept with 30% of
/// their area inside, always cropped.
impl Default for CropOperation {
    fn default() -> Self {
        Self {
            min_object_covered: 1.0,
            aspect_ratio_range: [0.75, 1.33],
            area_range: [0.1, 1.0],
            overlap_thresh: 0.3,
            clip_boxes: true,
            random_coef: 0.0,
        }
    }
}

/// The API's seven default `ssd_random_crop` operations.
pub fn default_ssd_crop_operations() -> Vec<CropOperation> {
    [0.0, 0.1, 0.3, 0.5, 0.7, 0.9, 1.0]
        .into_iter()
        .map(|t| CropOperation {
            min_object_covered: t,
            aspect_ratio_range: [0.5, 2.0],
            area_range: [0.1, 1.0],
            overlap_thresh: t,
            clip_boxes: true,
            random_coef: 0.15,
        })
        .collect()
}

/// A crop rectangle in pixels: `x, y, width, height`.
type Rect = (u32, u32, u32, u32);

/// `GenerateRandomCrop` of TF's `sample_distorted_bounding_box`.
fn generate_random_crop(
    rng: &mut impl Rng,
    w: u32,
    h: u32,
    min_area: f32,
    max_area: f32,
    ratio: f32,
) -> Option<Rect> {
    let lrint = |v: f32| v.round_ties_even() as i64;
    let mut min_h = lrint((min_area / ratio).sqrt());
    let mut max_h = lrint((max_area / ratio).sqrt());
    if lrint(max_h as f32 * ratio) > w as i64 {
        max_h = ((w as f32 + 0.5 - 1e-7) / ratio) as i64;
        if lrint(max_h as f32 * ratio) > w as i64 {
            max_h -= 1;
        }
    }
    max_h = max_h.min(h as i64);
    min_h = min_h.min(max_h);
    if min_h < max_h {
        min_h += rng.random_range(0..=(max_h - min_h));
    }
    let mut height = min_h;
    let mut width = lrint(height as f32 * ratio);
    let mut area = (width * height) as f32;
    if area < min_area {
        height += 1;
        width = lrint(height as f32 * ratio);
        area = (width * height) as f32;
    }
    if area > max_area {
        height -= 1;
        width = lrint(height as f32 * ratio);
        area = (width * height) as f32;
    }
    if area < min_area
        || area > max_area
        || width > w as i64
        || height > h as i64
        || width <= 0
        || height <= 0
    {
        return None;
    }
    let y = if (height as u32) < h {
        rng.random_range(0..h - height as u32)
    } else {
        0
    };
    let x = if (width as u32) < w {
        rng.random_range(0..w - width as u32)
    } else {
        0
    };
    Some((x, y, width as u32, height as u32))
}

/// `sample_distorted_bounding_box` with `max_attempts = 100` and
/// `use_image_if_no_bounding_boxes`: a crop covering at least `min_object_covered` of some box,
/// or the whole image when no attempt succeeds.
fn sample_crop(rng: &mut impl Rng, w: u32, h: u32, boxes: &[BBox], op: &CropOperation) -> Rect {
    let whole = BBox::new(0.0, 0.0, 1.0, 1.0);
    let pixel_boxes: Vec<BBox> = if boxes.is_empty() {
        vec![whole]
    } else {
        boxes.to_vec()
    }
    .iter()
    .map(|b| {
        let b = b.clip_to(&whole);
        BBox::new(
            (b.ymin * h as f32).trunc(),
            (b.xmin * w as f32).trunc(),
            (b.ymax * h as f32).trunc(),
            (b.xmax * w as f32).trunc(),
        )
    })
    .collect();
    let image_area = (w * h) as f32;
    for _ in 0..100 {
        let ratio = rng.random::<f32>() * (op.aspect_ratio_range[1] - op.aspect_ratio_range[0])
            + op.aspect_ratio_range[0];
        let Some(rect) = generate_random_crop(
            rng,
            w,
            h,
            op.area_range[0] * image_area,
            op.area_range[1] * image_area,
            ratio,
        ) else {
            continue;
        };
        let crop = BBox::new(
            rect.1 as f32,
            rect.0 as f32,
            (rect.1 + rect.3) as f32,
            (rect.0 + rect.2) as f32,
        );
        if crop.area() < 1.0 {
            continue;
        }
        let covered = pixel_boxes
            .iter()
            .filter(|b| b.area() >= 1.0)
            .any(|b| crop.intersection(b) / b.area() >= op.min_object_covered);
        if covered {
            return rect;
        }
    }
    (0, 0, w, h)
}

/// One `ssd_random_crop` operation (`random_crop_image` with its `random_coef`).
pub fn random_crop(sample: Annotated, op: &CropOperation, rng: &mut impl Rng) -> Annotated {
    if op.random_coef > 0.0 && rng.random::<f32>() <= op.random_coef {
        return sample;
    }
    let (w, h) = sample.image.dimensions();
    let rect = sample_crop(rng, w, h, &sample.boxes, op);
    crop_to_rect(sample, rect, op.overlap_thresh, op.clip_boxes)
}

/// Crops to `rect` (pixels), keeping the boxes not completely outside whose area lies at least
/// `overlap_thresh` inside, in the crop's coordinates (clipped when `clip_boxes`).
fn crop_to_rect(
    sample: Annotated,
    (x, y, cw, ch): Rect,
    overlap_thresh: f32,
    clip_boxes: bool,
) -> Annotated {
    let (w, h) = sample.image.dimensions();
    let window = BBox::new(
        y as f32 / h as f32,
        x as f32 / w as f32,
        (y + ch) as f32 / h as f32,
        (x + cw) as f32 / w as f32,
    );
    let image = image::imageops::crop_imm(&sample.image, x, y, cw, ch).to_image();
    let (mut boxes, mut labels) = (Vec::new(), Vec::new());
    for (b, &l) in sample.boxes.iter().zip(&sample.labels) {
        let outside = b.ymin >= window.ymax
            || b.xmin >= window.xmax
            || b.ymax <= window.ymin
            || b.xmax <= window.xmin;
        if outside {
            continue;
        }
        // intersection over the box's own area (`ioa(window, box)`)
        let area = b.area();
        let ioa = if area > 0.0 {
            window.intersection(b) / area
        } else {
            0.0
        };
        if ioa < overlap_thresh {
            continue;
        }
        let (wh, ww) = (window.height(), window.width());
        let mut nb = BBox::new(
            (b.ymin - window.ymin) / wh,
            (b.xmin - window.xmin) / ww,
            (b.ymax - window.ymin) / wh,
            (b.xmax - window.xmin) / ww,
        );
        if clip_boxes {
            nb = nb.clip_to(&BBox::new(0.0, 0.0, 1.0, 1.0));
        }
        boxes.push(nb);
        labels.push(l);
    }
    Annotated {
        image,
        boxes,
        labels,
    }
}

/// Zoom-out: the image pasted at a random offset of a larger canvas filled with its mean colour.
pub fn random_pad(sample: Annotated, max_scale: f32, rng: &mut impl Rng) -> Annotated {
    let (w, h) = sample.image.dimensions();
    let scale = rng.random_range(1.0..=max_scale.max(1.0));
    let (nw, nh) = ((w as f32 * scale) as u32, (h as f32 * scale) as u32);
    let (ox, oy) = (rng.random_range(0..=nw - w), rng.random_range(0..=nh - h));
    let mean = channel_means(&sample.image).map(|v| v.round() as u8);
    let mut canvas = RgbImage::from_pixel(nw, nh, Rgb(mean));
    image::imageops::replace(&mut canvas, &sample.image, ox as i64, oy as i64);
    let boxes = sample
        .boxes
        .iter()
        .map(|b| {
            BBox::new(
                (b.ymin * h as f32 + oy as f32) / nh as f32,
                (b.xmin * w as f32 + ox as f32) / nw as f32,
                (b.ymax * h as f32 + oy as f32) / nh as f32,
                (b.xmax * w as f32 + ox as f32) / nw as f32,
            )
        })
        .collect();
    Annotated {
        image: canvas,
        boxes,
        labels: sample.labels,
    }
}

#[cfg(test)]
mod tests {
    use super::super::tests::sample;
    use super::*;
    use rand::SeedableRng;
    use rand::rngs::StdRng;

    #[test]
    fn crops_keep_valid_boxes_and_cover_an_object() {
        let mut rng = StdRng::seed_from_u64(3);
        for op in default_ssd_crop_operations() {
            for _ in 0..50 {
                let s = sample();
                let (w, h) = s.image.dimensions();
                let rect = sample_crop(&mut rng, w, h, &s.boxes, &op);
                let (x, y, cw, ch) = rect;
                assert!(x + cw <= w && y + ch <= h && cw > 0 && ch > 0);
                let area = (cw * ch) as f32 / (w * h) as f32;
                assert!(area >= 0.1 - 0.02 || (cw, ch) == (w, h), "{area}");
                // some box has at least min_object_covered of its area inside the crop
                let crop = BBox::new(y as f32, x as f32, (y + ch) as f32, (x + cw) as f32);
                let covered = s.boxes.iter().any(|b| {
                    let p = b.to_pixels(h, w);
                    crop.intersection(&p) / p.area() >= op.min_object_covered - 0.02
                });
                assert!(covered || (cw, ch) == (w, h));
                let out = crop_to_rect(s, rect, op.overlap_thresh, true);
                assert_eq!(out.image.dimensions(), (cw, ch));
                assert_eq!(out.boxes.len(), out.labels.len());
                for b in &out.boxes {
                    assert!(
                        b.ymin >= 0.0 && b.xmin >= 0.0 && b.ymax <= 1.0 && b.xmax <= 1.0,
                        "{b:?}"
                    );
                    assert!(b.ymin <= b.ymax && b.xmin <= b.xmax);
                }
            }
        }
    }

    #[test]
    fn most_crops_are_real_and_meet_the_operations_constraints() {
        // two objects, neither the whole image
        let s = Annotated {
            boxes: sample().boxes[..2].to_vec(),
            labels: vec![1, 2],
            ..sample()
        };
        let (w, h) = s.image.dimensions();
        let mut ops = default_ssd_crop_operations();
        ops.push(CropOperation {
            aspect_ratio_range: [0.5, 0.7],
            area_range: [0.2, 0.4],
            ..ops[2].clone()
        });
        let mut rng = StdRng::seed_from_u64(11);
        for op in &ops {
            let crops: Vec<Rect> = (0..200)
                .map(|_| sample_crop(&mut rng, w, h, &s.boxes, op))
                .collect();
            let real: Vec<&Rect> = crops.iter().filter(|r| (r.2, r.3) != (w, h)).collect();
            assert!(
                real.len() >= 180,
                "{op:?}: {} of 200 crops are real",
                real.len()
            );
            let mut distinct = real.clone();
            distinct.sort();
            distinct.dedup();
            assert!(
                distinct.len() >= 100,
                "{op:?}: {} distinct crops",
                distinct.len()
            );
            let image_area = (w * h) as f32;
            for &&(x, y, cw, ch) in &real {
                assert!(x + cw <= w && y + ch <= h, "{op:?}: {:?}", (x, y, cw, ch));
                // the area in pixels within the range exactly; the width rounded from the
                // height times a ratio in the range
                let area = (cw * ch) as f32;
                assert!(
                    area >= op.area_range[0] * image_area && area <= op.area_range[1] * image_area,
                    "{op:?}: area {area}"
                );
                let slack = 0.5 / ch as f32;
                let ratio = cw as f32 / ch as f32;
                let [lo, hi] = op.aspect_ratio_range;
                assert!(
                    ratio >= lo - slack && ratio <= hi + slack,
                    "{op:?}: ratio {ratio}"
                );
                // some object (in whole pixels, as TF takes it) at least min_object_covered inside
                let crop = BBox::new(y as f32, x as f32, (y + ch) as f32, (x + cw) as f32);
                let covered = s.boxes.iter().any(|b| {
                    let p = b.to_pixels(h, w);
                    let p = BBox::new(
                        p.ymin.trunc(),
                        p.xmin.trunc(),
                        p.ymax.trunc(),
                        p.xmax.trunc(),
                    );
                    crop.intersection(&p) / p.area() >= op.min_object_covered
                });
                assert!(
                    covered,
                    "{op:?}: {:?} covers no object enough",
                    (x, y, cw, ch)
                );
            }
        }
    }

    #[test]
    fn crop_keeps_only_boxes_meeting_the_overlap_rule() {
        // right half of the 200x100 image: box 0 (x 0.1-0.3) is outside, box 1 (x 0.7-0.95)
        // inside, the whole-image box has half its area inside
        let window = (100, 0, 100, 100);
        let out = crop_to_rect(sample(), window, 0.6, true);
        assert_eq!(out.labels, vec![2]);
        let b = out.boxes[0];
        for (got, want) in b.to_array().iter().zip([0.6, 0.4, 0.9, 0.9]) {
            assert!((got - want).abs() < 1e-5, "{b:?}");
        }
        let out = crop_to_rect(sample(), window, 0.5, true);
        assert_eq!(out.labels, vec![2, 1]);
        assert_eq!(out.boxes[1], BBox::new(0.0, 0.0, 1.0, 1.0));
        // without clipping the whole-image box extends left of the crop
        let out = crop_to_rect(sample(), window, 0.5, false);
        assert!((out.boxes[1].xmin + 1.0).abs() < 1e-5);
    }

    #[test]
    fn pad_keeps_boxes_on_their_pixels() {
        let s = sample();
        let out = random_pad(s.clone(), 2.0, &mut StdRng::seed_from_u64(1));
        let (w, h) = out.image.dimensions();
        let b = out.boxes[0];
        let (x, y) = (
            (b.xmin * w as f32).round() as u32,
            (b.ymin * h as f32).round() as u32,
        );
        assert_eq!(out.image.get_pixel(x, y), s.image.get_pixel(20, 10));
    }
}
