//! The steps that move pixels or boxes without cropping: flips, the quarter turn, the image
//! scale, box jitter and black patches, with the API's `preprocessor.py` definitions.

use image::{Rgb, RgbImage};
use model::BBox;
use model::preprocess::resize_bilinear_aligned;
use rand::Rng;
use serde::{Deserialize, Serialize};

use super::Annotated;

/// Mirrors image and boxes left-right: `xmin' = 1 - xmax`, `xmax' = 1 - xmin`.
pub fn flip_horizontal(sample: Annotated) -> Annotated {
    moved(sample, image::imageops::flip_horizontal, |b| {
        BBox::new(b.ymin, 1.0 - b.xmax, b.ymax, 1.0 - b.xmin)
    })
}

/// Mirrors image and boxes up-down (`_flip_boxes_up_down`).
pub(super) fn flip_vertical(sample: Annotated) -> Annotated {
    moved(sample, image::imageops::flip_vertical, |b| {
        BBox::new(1.0 - b.ymax, b.xmin, 1.0 - b.ymin, b.xmax)
    })
}

/// Turns image and boxes a quarter counter-clockwise (`tf.image.rot90`, `_rot90_boxes`): the
/// left edge becomes the bottom, `ymin' = 1 - xmax`, `xmin' = ymin`.
pub(super) fn rotate_quarter(sample: Annotated) -> Annotated {
    moved(sample, image::imageops::rotate270, |b| {
        BBox::new(1.0 - b.xmax, b.ymin, 1.0 - b.xmin, b.ymax)
    })
}

/// The image and every box moved alike.
fn moved(
    sample: Annotated,
    image: fn(&RgbImage) -> RgbImage,
    bbox: fn(&BBox) -> BBox,
) -> Annotated {
    Annotated {
        image: image(&sample.image),
        boxes: sample.boxes.iter().map(bbox).collect(),
        labels: sample.labels,
    }
}

/// `random_image_scale` with the drawn `coef`: the image resized to `int(h coef) x int(w coef)`
/// (at least a pixel) by `tf.image.resize_images(..., align_corners=True)`, bilinear with the
/// corner pixels' centres kept; the normalised boxes stay.
pub(super) fn scale_image(sample: Annotated, coef: f32) -> Annotated {
    let (w, h) = sample.image.dimensions();
    let size = |n: u32| ((n as f32 * coef) as u32).max(1);
    let (w, h) = (size(w), size(h));
    let hwc = resize_bilinear_aligned(&sample.image, h as usize, w as usize);
    let image = RgbImage::from_fn(w, h, |x, y| {
        let at = (y as usize * w as usize + x as usize) * 3;
        Rgb([0, 1, 2].map(|c| hwc[at + c].round().clamp(0.0, 255.0) as u8))
    });
    Annotated { image, ..sample }
}

/// How `random_jitter_boxes` moves a box's sides (`RandomJitterBoxes.JitterMode`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize, Default)]
#[serde(rename_all = "snake_case")]
pub enum JitterMode {
    /// Each side independently, out or in by up to half `ratio` of the box's size (its
    /// distance from the centre scaled by a factor in `[1 - ratio, 1 + ratio]`).
    #[default]
    Default,
    /// Each side independently, only out.
    Expand,
    /// Each side independently, only in.
    Shrink,
    /// Height and width each scaled by its own factor about the centre, only up.
    ExpandSymmetric,
    /// The same, only down.
    ShrinkSymmetric,
    /// Height and width scaled by one factor about the centre, only up.
    ExpandSymmetricXy,
    /// The same, only down.
    ShrinkSymmetricXy,
}

impl JitterMode {
    /// The API's name (`JitterMode`'s enum value, lower case).
    pub fn name(self) -> &'static str {
        match self {
            Self::Default => "default",
            Self::Expand => "expand",
            Self::Shrink => "shrink",
            Self::ExpandSymmetric => "expand_symmetric",
            Self::ShrinkSymmetric => "shrink_symmetric",
            Self::ExpandSymmetricXy => "expand_symmetric_xy",
            Self::ShrinkSymmetricXy => "shrink_symmetric_xy",
        }
    }

    /// Every mode, in `JitterMode`'s order.
    pub const ALL: [Self; 7] = [
        Self::Default,
        Self::Expand,
        Self::Shrink,
        Self::ExpandSymmetric,
        Self::ShrinkSymmetric,
        Self::ExpandSymmetricXy,
        Self::ShrinkSymmetricXy,
    ];

    /// The range of the drawn distortions, from `ratio`.
    fn range(self, ratio: f32) -> (f32, f32) {
        match self {
            Self::Shrink | Self::ShrinkSymmetric | Self::ShrinkSymmetricXy => (-ratio, 0.0),
            Self::Expand | Self::ExpandSymmetric | Self::ExpandSymmetricXy => (0.0, ratio),
            Self::Default => (-ratio, ratio),
        }
    }
}

/// `random_jitter_boxes`: every box's sides moved by random fractions of its size (a side's
/// distance from the centre, half the size, times `1 + u` with `u` in the mode's range), then
/// clipped to the image. The image stays.
pub(super) fn jitter_boxes(
    mut sample: Annotated,
    ratio: f32,
    mode: JitterMode,
    rng: &mut impl Rng,
) -> Annotated {
    let (lo, hi) = mode.range(ratio);
    for b in &mut sample.boxes {
        let mut draw = || 1.0 + lo + rng.random::<f32>() * (hi - lo);
        let factors = [draw(), draw(), draw(), draw()];
        *b = jittered(b, mode, factors);
    }
    sample
}

/// One box jittered with the drawn factors `1 + u` (`u` in the mode's range): four sides'
/// for the independent modes, height's and width's (the first two) for the symmetric ones.
fn jittered(b: &BBox, mode: JitterMode, [f0, f1, f2, f3]: [f32; 4]) -> BBox {
    let (yc, xc) = ((b.ymin + b.ymax) / 2.0, (b.xmin + b.xmax) / 2.0);
    let h = (b.ymax - b.ymin).abs().max(1e-6);
    let w = (b.xmax - b.xmin).abs().max(1e-6);
    let out = match mode {
        JitterMode::Default | JitterMode::Expand | JitterMode::Shrink => BBox::new(
            yc - h * f0 / 2.0,
            xc - w * f1 / 2.0,
            yc + h * f2 / 2.0,
            xc + w * f3 / 2.0,
        ),
        _ => {
            // the factors are bounded so that the box's centre stays inside it
            let max_h = ((2.0 * yc) / h).min(2.0 * (1.0 - yc) / h).abs();
            let max_w = ((2.0 * xc) / w).min(2.0 * (1.0 - xc) / w).abs();
            let (fh, fw, max_h, max_w) = match mode {
                JitterMode::ExpandSymmetricXy | JitterMode::ShrinkSymmetricXy => {
                    let m = max_w.min(max_h);
                    (f0, f0, m, m)
                }
                _ => (f0, f1, max_h, max_w),
            };
            let (fh, fw) = (fh.clamp(-max_h, max_h), fw.clamp(-max_w, max_w));
            BBox::new(
                yc - h * fh / 2.0,
                xc - w * fw / 2.0,
                yc + h * fh / 2.0,
                xc + w * fw / 2.0,
            )
        }
    };
    BBox::new(
        out.ymin.clamp(0.0, 1.0),
        out.xmin.clamp(0.0, 1.0),
        out.ymax.clamp(0.0, 1.0),
        out.xmax.clamp(0.0, 1.0),
    )
}

/// `random_black_patches`: `max_patches` tries, each with `probability` of a black square of
/// side `size_ratio * min(h, w)` (truncated) at a random place, its corner drawn in
/// `[0, 1 - size_ratio)` of the height and width. The boxes stay.
pub(super) fn black_patches(
    mut sample: Annotated,
    max_patches: u32,
    probability: f32,
    size_ratio: f32,
    rng: &mut impl Rng,
) -> Annotated {
    let (w, h) = sample.image.dimensions();
    let side = (w.min(h) as f32 * size_ratio) as u32;
    for _ in 0..max_patches {
        if rng.random::<f32>() > probability {
            continue;
        }
        let y0 = (rng.random::<f32>() * (1.0 - size_ratio) * h as f32) as u32;
        let x0 = (rng.random::<f32>() * (1.0 - size_ratio) * w as f32) as u32;
        for y in y0..(y0 + side).min(h) {
            for x in x0..(x0 + side).min(w) {
                sample.image.put_pixel(x, y, Rgb([0, 0, 0]));
            }
        }
    }
    sample
}

#[cfg(test)]
mod tests {
    use super::super::tests::{sample, tf_fixture};
    use super::*;
    use rand::SeedableRng;
    use rand::rngs::StdRng;

    fn close(a: &BBox, b: [f32; 4]) -> bool {
        a.to_array()
            .iter()
            .zip(b)
            .all(|(x, y)| (x - y).abs() < 1e-6)
    }

    #[test]
    fn flip_twice_is_identity() {
        let s = sample();
        let f = flip_horizontal(s.clone());
        assert_eq!(f.boxes[0], BBox::new(0.1, 0.7, 0.5, 0.9));
        assert_eq!(f.image.get_pixel(0, 0), s.image.get_pixel(199, 0));
        let back = flip_horizontal(f);
        assert_eq!(back.image, s.image);
        for (a, b) in back.boxes.iter().zip(&s.boxes) {
            assert!(close(a, b.to_array()), "{a:?} {b:?}");
        }
    }

    /// The fixture's image and boxes as a sample.
    fn tf_sample() -> Annotated {
        let tf = tf_fixture();
        let pixels = tf.image.iter().map(|&v| v as u8).collect();
        Annotated {
            image: RgbImage::from_vec(tf.width, tf.height, pixels).unwrap(),
            boxes: tf
                .boxes
                .iter()
                .map(|b| BBox::new(b[0], b[1], b[2], b[3]))
                .collect(),
            labels: vec![1; tf.boxes.len()],
        }
    }

    fn assert_like_tf(got: &Annotated, image: &[f64], boxes: &[[f32; 4]], what: &str) {
        let want: Vec<u8> = image.iter().map(|&v| v as u8).collect();
        assert_eq!(got.image.as_raw(), &want, "{what}: pixels");
        assert_eq!(got.boxes.len(), boxes.len(), "{what}: boxes");
        for (a, b) in got.boxes.iter().zip(boxes) {
            assert!(close(a, *b), "{what}: {a:?} against TF's {b:?}");
        }
    }

    #[test]
    fn vertical_flip_and_quarter_turn_equal_tfs() {
        let tf = tf_fixture();
        let turned = rotate_quarter(tf_sample());
        let [h, w, _] = tf.rotation90.shape;
        assert_eq!(turned.image.dimensions(), (w, h));
        let r = &tf.rotation90;
        assert_like_tf(&turned, &r.image, &r.boxes, "rot90");
        let v = &tf.vertical_flip;
        assert_like_tf(&flip_vertical(tf_sample()), &v.image, &v.boxes, "flip");
    }

    #[test]
    fn image_scale_equals_tfs_resize_with_aligned_corners() {
        for case in &tf_fixture().image_scale {
            let out = scale_image(tf_sample(), case.coef);
            assert_eq!(out.image.dimensions(), (case.shape[1], case.shape[0]));
            for (i, (&got, want)) in out.image.as_raw().iter().zip(&case.image).enumerate() {
                // ours rounded to 8 bits, TF's float
                assert!(
                    (got as f64 - want).abs() <= 0.5 + 1e-3,
                    "scale {}: value {i}: {got} against {want}",
                    case.coef
                );
            }
        }
    }

    #[test]
    fn jitter_follows_the_apis_definition() {
        let b = BBox::new(0.2, 0.4, 0.6, 0.5); // centre (0.4, 0.45), size 0.4 x 0.1
        // independent sides: each from the centre by half the size times its factor
        let out = jittered(&b, JitterMode::Default, [1.05, 0.95, 1.0, 1.1]);
        assert!(close(&out, [0.19, 0.4025, 0.6, 0.505]), "{out:?}");
        // symmetric: height by the first factor, width by the second, about the centre
        let out = jittered(&b, JitterMode::ExpandSymmetric, [1.05, 1.1, 9.0, 9.0]);
        assert!(close(&out, [0.19, 0.395, 0.61, 0.505]), "{out:?}");
        // one factor for both, bounded so that the centre stays inside: a box at the edge cannot
        // grow past it
        let edge = BBox::new(0.0, 0.0, 0.2, 0.2);
        let out = jittered(&edge, JitterMode::ExpandSymmetricXy, [1.5, 9.0, 9.0, 9.0]);
        assert!(close(&out, [0.0, 0.0, 0.2, 0.2]), "{out:?}");
        // drawn factors stay in the mode's range: shrinking never grows a side
        let mut rng = StdRng::seed_from_u64(5);
        let shrunk = jitter_boxes(sample(), 0.05, JitterMode::Shrink, &mut rng);
        for (s, o) in shrunk.boxes.iter().zip(&sample().boxes) {
            assert!(s.height() <= o.height() + 1e-6 && s.width() <= o.width() + 1e-6);
            assert!(s.height() >= o.height() * 0.95 - 1e-6, "{s:?} {o:?}");
        }
    }

    #[test]
    fn jitter_mode_names_are_their_json_names() {
        for mode in JitterMode::ALL {
            assert_eq!(serde_json::to_value(mode).unwrap(), mode.name());
        }
    }

    #[test]
    fn black_patches_are_squares_of_the_ratio() {
        let s = Annotated {
            image: RgbImage::from_pixel(100, 50, Rgb([200, 200, 200])),
            ..sample()
        };
        let out = black_patches(s.clone(), 1, 1.0, 0.1, &mut StdRng::seed_from_u64(2));
        let black = out.image.pixels().filter(|p| p.0 == [0, 0, 0]).count();
        assert_eq!(black, 25, "one 5x5 square: a tenth of the shorter side");
        assert_eq!(out.boxes, s.boxes);
        let none = black_patches(s.clone(), 10, 0.0, 0.1, &mut StdRng::seed_from_u64(2));
        assert_eq!(none.image, s.image);
    }
}
