//! Checking every value of a training config before anything runs; each error names the
//! field, the value and what is allowed.

use anyhow::{Result, bail};

use data::augment::{Augmentation, CropOperation};

use super::settings::{LearningRate, OptimizerConfig, TrainConfig};

impl TrainConfig {
    /// Checks every value; the error names the field.
    pub fn validate(&self) -> Result<()> {
        self.model.validate()?;
        let t = &self.train;
        if t.batch_size == 0 {
            bail!("`train.batch_size` must be at least 1");
        }
        if let Some(d) = t.moving_average_decay
            && !(0.0..1.0).contains(&d)
        {
            bail!("`train.moving_average_decay` must be in [0, 1), got {d}");
        }
        if let Some(n) = t.gradient_clipping_by_norm
            && !positive(n.into())
        {
            bail!("`train.gradient_clipping_by_norm` must be positive, got {n}");
        }
        if t.num_steps == 0 {
            bail!("`train.num_steps` must be at least 1, got 0");
        }
        if t.log_every == 0 {
            bail!("`train.log_every` must be at least 1, got 0");
        }
        if t.checkpoint_every == 0 {
            bail!("`train.checkpoint_every` must be at least 1");
        }
        if t.keep_checkpoints == 0 {
            bail!("`train.keep_checkpoints` must be at least 1");
        }
        match &t.optimizer {
            OptimizerConfig::RmsProp {
                momentum,
                decay,
                epsilon,
                ..
            } => {
                if !(0.0..1.0).contains(momentum)
                    || !(0.0..1.0).contains(decay)
                    || !positive((*epsilon).into())
                {
                    bail!(
                        "`train.optimizer.rms_prop`: momentum and decay must be in [0, 1), epsilon finite and positive"
                    );
                }
            }
            OptimizerConfig::Momentum { momentum, .. } => {
                if !(0.0..1.0).contains(momentum) {
                    bail!("`train.optimizer.momentum.momentum` must be in [0, 1)");
                }
            }
            OptimizerConfig::Adam {
                beta1,
                beta2,
                epsilon,
                ..
            } => {
                if !(0.0..1.0).contains(beta1)
                    || !(0.0..1.0).contains(beta2)
                    || !positive((*epsilon).into())
                {
                    bail!(
                        "`train.optimizer.adam`: betas must be in [0, 1), epsilon finite and positive"
                    );
                }
            }
        }
        self.train.optimizer.learning_rate().validate()?;
        validate_augmentation(&self.data.augmentation)?;
        if self.data.train.is_empty() {
            bail!("`data.train` must name at least one TFRecord file or pattern");
        }
        if self.eval.batch_size == 0 {
            bail!("`eval.batch_size` must be at least 1");
        }
        Ok(())
    }
}

/// Finite and above 0 (NaN is not).
fn positive(x: f64) -> bool {
    x.is_finite() && x > 0.0
}

impl LearningRate {
    /// Every rate finite and at least 0 (a negative rate climbs the loss), each named when it
    /// is not; then the schedule's shape.
    fn validate(&self) -> Result<()> {
        for (name, rate) in self.rates() {
            if !(rate.is_finite() && rate >= 0.0) {
                bail!(
                    "`train.optimizer.learning_rate.{name}` must be a finite rate of at least 0, got {rate}"
                );
            }
        }
        let ok = match self {
            Self::Constant { .. } => true,
            Self::ExponentialDecay {
                decay_steps,
                decay_factor,
                ..
            } => *decay_steps > 0 && decay_factor.is_finite() && *decay_factor > 0.0,
            Self::CosineDecay {
                learning_rate_base,
                total_steps,
                warmup_steps,
                hold_base_rate_steps,
                warmup_learning_rate,
            } => {
                *total_steps > warmup_steps + hold_base_rate_steps
                    && warmup_learning_rate <= learning_rate_base
            }
            Self::ManualStep { schedule, .. } => schedule.windows(2).all(|w| w[0].0 < w[1].0),
        };
        if ok {
            Ok(())
        } else {
            bail!("`train.optimizer.learning_rate` is invalid: {self:?}")
        }
    }

    /// Every rate of the schedule, with its field's name.
    fn rates(&self) -> Vec<(&'static str, f64)> {
        match self {
            Self::Constant { learning_rate } => vec![("learning_rate", *learning_rate)],
            Self::ExponentialDecay {
                initial_learning_rate,
                burnin_learning_rate,
                min_learning_rate,
                ..
            } => vec![
                ("initial_learning_rate", *initial_learning_rate),
                ("burnin_learning_rate", *burnin_learning_rate),
                ("min_learning_rate", *min_learning_rate),
            ],
            Self::CosineDecay {
                learning_rate_base,
                warmup_learning_rate,
                ..
            } => vec![
                ("learning_rate_base", *learning_rate_base),
                ("warmup_learning_rate", *warmup_learning_rate),
            ],
            Self::ManualStep {
                initial_learning_rate,
                schedule,
            } => std::iter::once(("initial_learning_rate", *initial_learning_rate))
                .chain(schedule.iter().map(|(_, rate)| ("schedule", *rate)))
                .collect(),
        }
    }
}

/// How many times its side an image may grow through the steps together
/// (`random_pad_image.max_scale` times `random_image_scale.max_scale_ratio`): 64 times the
/// area (a 500-pixel image padded to 4000 pixels a side, 48 MB), far beyond the API's recipes
/// (2).
const MAX_CANVAS_SCALE: f32 = 8.0;

/// The most `random_black_patches.max_black_patches`: each is a draw and a loop over pixels.
const MAX_BLACK_PATCHES: u32 = 1000;

/// Every augmentation step's ranges: finite, ordered, and inside what the step can do (an
/// empty or inverted range would otherwise fail inside a loader thread).
fn validate_augmentation(steps: &[Augmentation]) -> Result<()> {
    let unit = [0.0, 1.0];
    for (i, step) in steps.iter().enumerate() {
        let field = format!("data.augmentation[{i}]");
        let check = |name, range, allowed| check_range(&field, name, range, allowed);
        match step {
            Augmentation::RandomHorizontalFlip { probability }
            | Augmentation::RandomVerticalFlip { probability }
            | Augmentation::RandomRotation90 { probability }
            | Augmentation::RandomRgbToGray { probability } => {
                check("probability", [0.0, *probability], unit)?
            }
            Augmentation::RandomAdjustBrightness { max_delta } => {
                check("max_delta", [0.0, *max_delta], unit)?
            }
            // TF's adjust_hue takes deltas in [-1, 1]
            Augmentation::RandomAdjustHue { max_delta } => {
                check("max_delta", [0.0, *max_delta], unit)?
            }
            Augmentation::RandomAdjustContrast {
                min_delta,
                max_delta,
            }
            | Augmentation::RandomAdjustSaturation {
                min_delta,
                max_delta,
            } => check(
                "min_delta..max_delta",
                [*min_delta, *max_delta],
                [0.0, f32::MAX],
            )?,
            Augmentation::RandomDistortColor { color_ordering } => {
                if *color_ordering > 1 {
                    bail!("`{field}.color_ordering`: {color_ordering}, expected 0 or 1");
                }
            }
            // the image is resized: at least a pixel, at most MAX_CANVAS_SCALE times its side
            Augmentation::RandomImageScale {
                min_scale_ratio,
                max_scale_ratio,
            } => check(
                "min_scale_ratio..max_scale_ratio",
                [*min_scale_ratio, *max_scale_ratio],
                [f32::MIN_POSITIVE, MAX_CANVAS_SCALE],
            )?,
            Augmentation::RandomJitterBoxes { ratio, .. } => check("ratio", [0.0, *ratio], unit)?,
            Augmentation::RandomBlackPatches {
                max_black_patches,
                probability,
                size_to_image_ratio,
            } => {
                if *max_black_patches > MAX_BLACK_PATCHES {
                    bail!(
                        "`{field}.max_black_patches`: {max_black_patches}, at most {MAX_BLACK_PATCHES}"
                    );
                }
                check("probability", [0.0, *probability], unit)?;
                check("size_to_image_ratio", [0.0, *size_to_image_ratio], unit)?
            }
            // the canvas is allocated: its side is at most MAX_CANVAS_SCALE times the image's
            Augmentation::RandomPadImage { max_scale } => {
                check("max_scale", [1.0, *max_scale], [1.0, MAX_CANVAS_SCALE])?
            }
            Augmentation::SsdRandomCrop { operations } => {
                for (j, op) in operations.iter().enumerate() {
                    validate_crop(&format!("{field}.operations[{j}]"), op)?;
                }
            }
            Augmentation::RandomCropImage(op) => validate_crop(&field, op)?,
        }
    }
    check_canvas_growth(steps)
}

/// The canvases are allocated: an image's growth through the steps together is bounded.
fn check_canvas_growth(steps: &[Augmentation]) -> Result<()> {
    let mut growth = 1.0f32;
    for (i, step) in steps.iter().enumerate() {
        let field = format!("data.augmentation[{i}]");
        growth *= match step {
            Augmentation::RandomPadImage { max_scale } => *max_scale,
            Augmentation::RandomImageScale {
                max_scale_ratio, ..
            } => max_scale_ratio.max(1.0),
            _ => 1.0,
        };
        if growth > MAX_CANVAS_SCALE {
            bail!(
                "`{field}`: with the steps before it an image's side may grow {growth} times, beyond {MAX_CANVAS_SCALE} (the product of `random_pad_image.max_scale` and `random_image_scale.max_scale_ratio`)"
            );
        }
    }
    Ok(())
}

fn validate_crop(field: &str, op: &CropOperation) -> Result<()> {
    let unit = [0.0, 1.0];
    check_range(
        field,
        "min_object_covered",
        [0.0, op.min_object_covered],
        unit,
    )?;
    check_range(
        field,
        "aspect_ratio_range",
        op.aspect_ratio_range,
        [f32::MIN_POSITIVE, f32::MAX],
    )?;
    check_range(field, "area_range", op.area_range, [f32::MIN_POSITIVE, 1.0])?;
    check_range(field, "overlap_thresh", [0.0, op.overlap_thresh], unit)?;
    check_range(field, "random_coef", [0.0, op.random_coef], unit)
}

/// `[lo, hi]` must be finite, `lo <= hi`, and inside `[min, max]`.
fn check_range(field: &str, name: &str, [lo, hi]: [f32; 2], [min, max]: [f32; 2]) -> Result<()> {
    if !(lo.is_finite() && hi.is_finite() && min <= lo && lo <= hi && hi <= max) {
        bail!("`{field}.{name}`: [{lo}, {hi}] is not a range within [{min}, {max}]");
    }
    Ok(())
}
