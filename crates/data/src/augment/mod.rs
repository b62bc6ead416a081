//! Data augmentation with the Object Detection API's semantics, selected by a list of options
//! as a pipeline.config's `data_augmentation_options`. Every step takes the RNG explicitly, so
//! a seed fixes the output.

mod color;
mod crop;
mod geometry;

use image::RgbImage;
use model::BBox;
use rand::Rng;
use serde::de::Error as _;
use serde::{Deserialize, Deserializer, Serialize};
use serde_json::{Map, Value};

use color::Pixels;
pub use crop::{CropOperation, default_ssd_crop_operations, random_crop, random_pad};
pub use geometry::{JitterMode, flip_horizontal};
use geometry::{black_patches, flip_vertical, jitter_boxes, rotate_quarter, scale_image};

/// An image with its boxes (normalised) and label-map ids.
#[derive(Debug, Clone, PartialEq)]
pub struct Annotated {
    /// Pixels.
    pub image: RgbImage,
    /// Normalised boxes.
    pub boxes: Vec<BBox>,
    /// Class id of each box.
    pub labels: Vec<usize>,
}

/// One augmentation step (a `data_augmentation_options` entry), named and set as in the API's
/// `preprocessor.proto`. As JSON a step is its name alone, for the API's defaults
/// ([`Augmentation::with_defaults`]), or `{"name": {settings}}` with the settings it changes
/// ([`deserialize_steps`]).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case", deny_unknown_fields)]
pub enum Augmentation {
    /// Mirror left-right with this probability (0.5).
    RandomHorizontalFlip {
        /// Probability of a flip.
        probability: f32,
    },
    /// Mirror up-down with this probability (0.5).
    RandomVerticalFlip {
        /// Probability of a flip.
        probability: f32,
    },
    /// Turn a quarter counter-clockwise with this probability (0.5).
    RandomRotation90 {
        /// Probability of a turn.
        probability: f32,
    },
    /// One of the operations (uniformly chosen) of `ssd_random_crop`; empty = the defaults.
    SsdRandomCrop {
        /// The operations.
        #[serde(default)]
        operations: Vec<CropOperation>,
    },
    /// `random_crop_image`: one crop operation ([`CropOperation::default`]).
    RandomCropImage(CropOperation),
    /// Add a uniform delta in `[-max_delta, max_delta]` (on the `[0, 1]` scale), clip.
    RandomAdjustBrightness {
        /// Default 0.2.
        max_delta: f32,
    },
    /// Scale each channel's deviation from its mean by a factor in `[min, max]`.
    RandomAdjustContrast {
        /// Default 0.8.
        min_delta: f32,
        /// Default 1.25.
        max_delta: f32,
    },
    /// Turn the HSV hue by a uniform delta in `[-max_delta, max_delta]` (turns).
    RandomAdjustHue {
        /// Default 0.02.
        max_delta: f32,
    },
    /// Scale saturation by a factor in `[min, max]`.
    RandomAdjustSaturation {
        /// Default 0.8.
        min_delta: f32,
        /// Default 1.25.
        max_delta: f32,
    },
    /// Brightness (32/255), saturation (0.5-1.5), hue (0.2) and contrast (0.5-1.5) in that
    /// order (`color_ordering` 0), or brightness, contrast, saturation, hue (1).
    RandomDistortColor {
        /// 0 or 1.
        color_ordering: u8,
    },
    /// Make the image grey (luma) with this probability (0.1).
    RandomRgbToGray {
        /// Probability of grey.
        probability: f32,
    },
    /// Resize the image by a uniform factor in `[min, max]`; the boxes stay.
    RandomImageScale {
        /// Default 0.5.
        min_scale_ratio: f32,
        /// Default 2.0.
        max_scale_ratio: f32,
    },
    /// Move each box's sides by up to half `ratio` of its size ([`JitterMode`]).
    RandomJitterBoxes {
        /// Default 0.05.
        ratio: f32,
        /// Default `default`.
        jitter_mode: JitterMode,
    },
    /// Up to `max_black_patches` black squares, each with `probability`, of side
    /// `size_to_image_ratio` of the image's shorter side.
    RandomBlackPatches {
        /// Default 10.
        max_black_patches: u32,
        /// Default 0.5.
        probability: f32,
        /// Default 0.1.
        size_to_image_ratio: f32,
    },
    /// Zoom out: place the image at a random spot of a canvas up to `max_scale` times larger,
    /// filled with the image's mean colour (`random_pad_image`).
    RandomPadImage {
        /// Largest canvas side relative to the image (2.0 in the API's SSD recipes).
        max_scale: f32,
    },
}

impl Augmentation {
    /// Every step's name, as the API's `PreprocessingStep` field and this enum's JSON.
    pub const NAMES: [&str; 15] = [
        "random_horizontal_flip",
        "random_vertical_flip",
        "random_rotation90",
        "ssd_random_crop",
        "random_crop_image",
        "random_adjust_brightness",
        "random_adjust_contrast",
        "random_adjust_hue",
        "random_adjust_saturation",
        "random_distort_color",
        "random_rgb_to_gray",
        "random_image_scale",
        "random_jitter_boxes",
        "random_black_patches",
        "random_pad_image",
    ];

    /// The step of this name with the defaults of the API's `preprocessor.proto`
    /// (`random_pad_image`: a canvas of up to twice the image's sides, the API's own default
    /// size range); `None` for a name not in [`Augmentation::NAMES`].
    pub fn with_defaults(name: &str) -> Option<Self> {
        Some(match name {
            "random_horizontal_flip" => Self::RandomHorizontalFlip { probability: 0.5 },
            "random_vertical_flip" => Self::RandomVerticalFlip { probability: 0.5 },
            "random_rotation90" => Self::RandomRotation90 { probability: 0.5 },
            "ssd_random_crop" => Self::SsdRandomCrop { operations: vec![] },
            "random_crop_image" => Self::RandomCropImage(CropOperation::default()),
            "random_adjust_brightness" => Self::RandomAdjustBrightness { max_delta: 0.2 },
            "random_adjust_contrast" => Self::RandomAdjustContrast {
                min_delta: 0.8,
                max_delta: 1.25,
            },
            "random_adjust_hue" => Self::RandomAdjustHue { max_delta: 0.02 },
            "random_adjust_saturation" => Self::RandomAdjustSaturation {
                min_delta: 0.8,
                max_delta: 1.25,
            },
            "random_distort_color" => Self::RandomDistortColor { color_ordering: 0 },
            "random_rgb_to_gray" => Self::RandomRgbToGray { probability: 0.1 },
            "random_image_scale" => Self::RandomImageScale {
                min_scale_ratio: 0.5,
                max_scale_ratio: 2.0,
            },
            "random_jitter_boxes" => Self::RandomJitterBoxes {
                ratio: 0.05,
                jitter_mode: JitterMode::Default,
            },
            "random_black_patches" => Self::RandomBlackPatches {
                max_black_patches: 10,
                probability: 0.5,
                size_to_image_ratio: 0.1,
            },
            "random_pad_image" => Self::RandomPadImage { max_scale: 2.0 },
            _ => return None,
        })
    }

    /// Applies the step.
    pub fn apply(&self, sample: Annotated, rng: &mut impl Rng) -> Annotated {
        match self {
            Self::RandomHorizontalFlip { probability } => {
                maybe(sample, *probability, rng, flip_horizontal)
            }
            Self::RandomVerticalFlip { probability } => {
                maybe(sample, *probability, rng, flip_vertical)
            }
            Self::RandomRotation90 { probability } => {
                maybe(sample, *probability, rng, rotate_quarter)
            }
            Self::SsdRandomCrop { operations } => {
                let defaults;
                let ops = if operations.is_empty() {
                    defaults = default_ssd_crop_operations();
                    &defaults
                } else {
                    operations
                };
                let op = &ops[rng.random_range(0..ops.len())];
                random_crop(sample, op, rng)
            }
            Self::RandomCropImage(op) => random_crop(sample, op, rng),
            Self::RandomAdjustBrightness { max_delta } => {
                adjust(sample, -*max_delta, *max_delta, rng, Pixels::brightness)
            }
            Self::RandomAdjustContrast {
                min_delta,
                max_delta,
            } => adjust(sample, *min_delta, *max_delta, rng, Pixels::contrast),
            Self::RandomAdjustHue { max_delta } => {
                adjust(sample, -*max_delta, *max_delta, rng, Pixels::hue)
            }
            Self::RandomAdjustSaturation {
                min_delta,
                max_delta,
            } => adjust(sample, *min_delta, *max_delta, rng, Pixels::saturation),
            Self::RandomDistortColor { color_ordering } => {
                distort_color(sample, *color_ordering, rng)
            }
            // grey unless the draw is above the probability, as the API has it
            Self::RandomRgbToGray { probability } => {
                if rng.random::<f32>() > *probability {
                    sample
                } else {
                    recolour(sample, Pixels::gray)
                }
            }
            Self::RandomImageScale {
                min_scale_ratio,
                max_scale_ratio,
            } => {
                let coef = rng.random_range(*min_scale_ratio..=*max_scale_ratio);
                scale_image(sample, coef)
            }
            Self::RandomJitterBoxes { ratio, jitter_mode } => {
                jitter_boxes(sample, *ratio, *jitter_mode, rng)
            }
            Self::RandomBlackPatches {
                max_black_patches,
                probability,
                size_to_image_ratio,
            } => black_patches(
                sample,
                *max_black_patches,
                *probability,
                *size_to_image_ratio,
                rng,
            ),
            Self::RandomPadImage { max_scale } => random_pad(sample, *max_scale, rng),
        }
    }
}

/// `step` when a uniform draw is below `probability` (the API's flips and turn).
fn maybe(
    sample: Annotated,
    probability: f32,
    rng: &mut impl Rng,
    step: fn(Annotated) -> Annotated,
) -> Annotated {
    if rng.random::<f32>() < probability {
        step(sample)
    } else {
        sample
    }
}

/// One `random_adjust_*` step: `f` with a value drawn uniformly from `[lo, hi]`.
fn adjust(
    sample: Annotated,
    lo: f32,
    hi: f32,
    rng: &mut impl Rng,
    f: fn(&mut Pixels, f32),
) -> Annotated {
    let value = rng.random_range(lo..=hi);
    recolour(sample, |p| f(p, value))
}

/// The image's pixels changed in float by `f`, rounded to 8 bits once at the end.
fn recolour(mut sample: Annotated, f: impl FnOnce(&mut Pixels)) -> Annotated {
    let mut pixels = Pixels::of(&sample.image);
    f(&mut pixels);
    pixels.write_to(&mut sample.image);
    sample
}

/// The values `random_distort_color` draws, from the API's fixed ranges.
struct ColorDraws {
    brightness: f32,
    saturation: f32,
    hue: f32,
    contrast: f32,
}

/// `random_distort_color`: four adjustments in the order `color_ordering` picks.
fn distort_color(sample: Annotated, color_ordering: u8, rng: &mut impl Rng) -> Annotated {
    let draws = ColorDraws {
        brightness: rng.random_range(-32.0 / 255.0..=32.0 / 255.0),
        saturation: rng.random_range(0.5..=1.5),
        hue: rng.random_range(-0.2..=0.2),
        contrast: rng.random_range(0.5..=1.5),
    };
    recolour(sample, |p| distort(p, color_ordering, &draws))
}

/// Ordering 0: brightness, saturation, hue, contrast; any other (the config's check allows
/// only 1): brightness, contrast, saturation, hue.
fn distort(p: &mut Pixels, color_ordering: u8, d: &ColorDraws) {
    p.brightness(d.brightness);
    if color_ordering == 0 {
        p.saturation(d.saturation);
        p.hue(d.hue);
        p.contrast(d.contrast);
    } else {
        p.contrast(d.contrast);
        p.saturation(d.saturation);
        p.hue(d.hue);
    }
}

/// Applies the steps in order.
pub fn augment(mut sample: Annotated, steps: &[Augmentation], rng: &mut impl Rng) -> Annotated {
    for step in steps {
        sample = step.apply(sample, rng);
    }
    sample
}

/// A JSON list of steps: each a name alone (`"random_adjust_hue"`: the API's defaults) or
/// `{"random_adjust_hue": {"max_delta": 0.05}}` (the settings given, the defaults for the
/// rest). For `#[serde(deserialize_with)]`.
pub fn deserialize_steps<'de, D: Deserializer<'de>>(d: D) -> Result<Vec<Augmentation>, D::Error> {
    Vec::<Value>::deserialize(d)?
        .into_iter()
        .enumerate()
        .map(|(i, v)| step_from_json(v).map_err(|e| D::Error::custom(format!("[{i}]: {e}"))))
        .collect()
}

/// One step from JSON ([`deserialize_steps`]).
fn step_from_json(value: Value) -> Result<Augmentation, String> {
    let (name, settings) = match &value {
        Value::String(name) => (name.clone(), Map::new()),
        Value::Object(map) => match map.iter().collect::<Vec<_>>()[..] {
            [(name, Value::Object(settings))] => (name.clone(), settings.clone()),
            _ => return Err(shape_error(&value)),
        },
        _ => return Err(shape_error(&value)),
    };
    let Some(defaults) = Augmentation::with_defaults(&name) else {
        return Err(format!(
            "unknown step `{name}` (the steps: {})",
            Augmentation::NAMES.join(", ")
        ));
    };
    let mut step = serde_json::to_value(defaults).map_err(|e| e.to_string())?;
    if let Some(Value::Object(slots)) = step.get_mut(&name) {
        slots.extend(settings);
    }
    serde_json::from_value(step).map_err(|e| format!("`{name}`: {e}"))
}

fn shape_error(value: &Value) -> String {
    format!("expected a step's name or {{\"name\": {{settings}}}}, found {value}")
}

#[cfg(test)]
mod tests {
    use super::*;
    use rand::SeedableRng;
    use rand::rngs::StdRng;

    /// A 200x100 gradient with three boxes, the whole image among them.
    pub(super) fn sample() -> Annotated {
        let image = RgbImage::from_fn(200, 100, |x, y| {
            image::Rgb([x as u8, y as u8, (x + y) as u8])
        });
        Annotated {
            image,
            boxes: vec![
                BBox::new(0.1, 0.1, 0.5, 0.3),
                BBox::new(0.6, 0.7, 0.9, 0.95),
                BBox::new(0.0, 0.0, 1.0, 1.0),
            ],
            labels: vec![1, 2, 1],
        }
    }

    /// `tests/fixtures/tf_augment.json`: what TF computes for the steps' deterministic parts
    /// (`scripts/tf-fixtures/augment_fixtures.py`).
    #[derive(Deserialize)]
    pub(super) struct TfFixture {
        pub height: u32,
        pub width: u32,
        /// `height x width x 3` pixels.
        pub image: Vec<f64>,
        pub hue: Vec<HueCase>,
        pub gray: Vec<f64>,
        pub boxes: Vec<[f32; 4]>,
        pub rotation90: Moved,
        pub vertical_flip: Moved,
        pub image_scale: Vec<ScaleCase>,
    }

    #[derive(Deserialize)]
    pub(super) struct HueCase {
        pub delta: f32,
        pub image: Vec<f64>,
    }

    #[derive(Deserialize)]
    pub(super) struct Moved {
        pub image: Vec<f64>,
        #[serde(default)]
        pub shape: [u32; 3],
        pub boxes: Vec<[f32; 4]>,
    }

    #[derive(Deserialize)]
    pub(super) struct ScaleCase {
        pub coef: f32,
        pub shape: [u32; 2],
        pub image: Vec<f64>,
    }

    pub(super) fn tf_fixture() -> TfFixture {
        let path = concat!(
            env!("CARGO_MANIFEST_DIR"),
            "/tests/fixtures/tf_augment.json"
        );
        let text = std::fs::read_to_string(path).expect("the TF fixture");
        serde_json::from_str(&text).expect("the TF fixture's fields")
    }

    fn every_step() -> Vec<Augmentation> {
        Augmentation::NAMES
            .iter()
            .map(|n| Augmentation::with_defaults(n).expect("a name of NAMES"))
            .collect()
    }

    #[test]
    fn same_seed_same_output() {
        let steps = every_step();
        let a = augment(sample(), &steps, &mut StdRng::seed_from_u64(9));
        let b = augment(sample(), &steps, &mut StdRng::seed_from_u64(9));
        assert_eq!(a, b);
        let differs =
            (10..20).any(|s| augment(sample(), &steps, &mut StdRng::seed_from_u64(s)) != a);
        assert!(differs);
    }

    #[test]
    fn every_step_keeps_its_boxes_valid() {
        let mut rng = StdRng::seed_from_u64(4);
        for step in every_step() {
            for _ in 0..20 {
                let out = step.apply(sample(), &mut rng);
                let (w, h) = out.image.dimensions();
                assert!(w > 0 && h > 0, "{step:?}");
                assert_eq!(out.boxes.len(), out.labels.len(), "{step:?}");
                for b in &out.boxes {
                    let inside = [b.ymin, b.xmin, b.ymax, b.xmax]
                        .iter()
                        .all(|v| (0.0..=1.0).contains(v));
                    assert!(
                        inside && b.ymin <= b.ymax && b.xmin <= b.xmax,
                        "{step:?}: {b:?}"
                    );
                }
            }
        }
    }

    #[test]
    fn names_are_the_json_names() {
        for (name, step) in Augmentation::NAMES.iter().zip(every_step()) {
            let json = serde_json::to_value(&step).unwrap();
            assert!(json.get(name).is_some(), "{name}: {json}");
            assert_eq!(step_from_json(json), Ok(step.clone()));
            assert_eq!(step_from_json(Value::String(name.to_string())), Ok(step));
        }
    }

    #[test]
    fn steps_parse_from_names_and_partial_settings() {
        let parse = |text: &str| -> Result<Vec<Augmentation>, String> {
            let mut json = serde_json::Deserializer::from_str(text);
            deserialize_steps(&mut json).map_err(|e| e.to_string())
        };
        let steps = parse(
            r#"["random_horizontal_flip", {"ssd_random_crop": {}},
                {"random_black_patches": {"probability": 0.25}},
                {"random_jitter_boxes": {"jitter_mode": "shrink_symmetric"}}]"#,
        )
        .unwrap();
        assert_eq!(
            steps[0],
            Augmentation::RandomHorizontalFlip { probability: 0.5 }
        );
        assert_eq!(steps[1], Augmentation::SsdRandomCrop { operations: vec![] });
        let patches = Augmentation::RandomBlackPatches {
            max_black_patches: 10,
            probability: 0.25,
            size_to_image_ratio: 0.1,
        };
        assert_eq!(steps[2], patches);
        let jitter = Augmentation::RandomJitterBoxes {
            ratio: 0.05,
            jitter_mode: JitterMode::ShrinkSymmetric,
        };
        assert_eq!(steps[3], jitter);
        let err = parse(r#"["random_flip"]"#).unwrap_err();
        assert!(
            err.contains("[0]: unknown step `random_flip`") && err.contains("random_rotation90"),
            "{err}"
        );
        let err = parse(r#"["random_horizontal_flip", {"random_adjust_hue": {"delta": 1}}]"#)
            .unwrap_err();
        assert!(
            err.contains("[1]: `random_adjust_hue`: unknown field `delta`"),
            "{err}"
        );
        let err = parse(r#"[{"random_adjust_hue": 0.1}]"#).unwrap_err();
        assert!(err.contains("expected a step's name"), "{err}");
    }

    #[test]
    fn distort_color_applies_its_four_adjustments_in_the_apis_order() {
        let d = ColorDraws {
            brightness: 0.1,
            saturation: 1.4,
            hue: 0.15,
            contrast: 0.6,
        };
        let chain = |steps: &[&dyn Fn(&mut Pixels)]| {
            let mut p = Pixels::of(&sample().image);
            steps.iter().for_each(|step| step(&mut p));
            recolour(sample(), |q| *q = p)
        };
        let brightness = |p: &mut Pixels| p.brightness(0.1);
        let saturation = |p: &mut Pixels| p.saturation(1.4);
        let hue = |p: &mut Pixels| p.hue(0.15);
        let contrast = |p: &mut Pixels| p.contrast(0.6);
        // preprocessor.py's random_distort_color, color_ordering 0 and 1
        let first = chain(&[&brightness, &saturation, &hue, &contrast]);
        let second = chain(&[&brightness, &contrast, &saturation, &hue]);
        assert_ne!(first.image, second.image, "the order shows in the pixels");
        assert_eq!(recolour(sample(), |p| distort(p, 0, &d)), first);
        assert_eq!(recolour(sample(), |p| distort(p, 1, &d)), second);
    }
}
