//! `train_config`: batch, steps, the optimizer with its learning-rate schedule and weight EMA,
//! fine-tuning, gradient clipping and the augmentation steps.

use std::path::PathBuf;

use data::augment::{Augmentation, CropOperation, JitterMode};
use model::restore::RestoreScope;

use super::section::{Report, Section};
use crate::config::settings::{
    DEFAULT_CHECKPOINT_EVERY, DEFAULT_KEEP_CHECKPOINTS, DEFAULT_LOG_EVERY, LearningRate,
    OptimizerConfig, TrainSettings,
};

/// Reads `train_config`; its augmentation steps go to `augmentation`. `None` when a part
/// the settings cannot do without (the optimizer) is missing or unsupported.
pub(super) fn read_train(
    mut t: Section,
    augmentation: &mut Vec<Augmentation>,
    report: &mut Report,
) -> Option<TrainSettings> {
    let path = t.path.clone();
    let batch_size = t.number("batch_size", 32usize, report);
    let num_steps = t.number("num_steps", 0u64, report);
    if num_steps == 0 {
        report.errors.push(format!(
            "{path}.num_steps: 0 (train forever) is not supported: set a step count"
        ));
    }
    let (optimizer, moving_average_decay) = match t.child("optimizer", report) {
        Some(o) => read_optimizer(o, report),
        None => {
            report.errors.push(format!("{path}.optimizer is missing"));
            (None, None)
        }
    };
    let (fine_tune_checkpoint, fine_tune_restore) = read_fine_tune(&mut t, report);
    let clip = t.number("gradient_clipping_by_norm", 0.0f32, report);
    for mut step in t.children("data_augmentation_options", report) {
        if let Some(a) = read_augmentation(&mut step, report) {
            augmentation.push(a);
        }
        step.finish(report);
    }
    read_unsupported_and_ignored(&mut t, report);
    t.finish(report);
    Some(TrainSettings {
        batch_size,
        num_steps,
        optimizer: optimizer?,
        moving_average_decay,
        moving_average_warmup: false,
        gradient_clipping_by_norm: (clip > 0.0).then_some(clip),
        fine_tune_checkpoint,
        fine_tune_restore,
        seed: 0,
        checkpoint_every: DEFAULT_CHECKPOINT_EVERY,
        keep_checkpoints: DEFAULT_KEEP_CHECKPOINTS,
        log_every: DEFAULT_LOG_EVERY,
    })
}

/// `optimizer`: the optimizer (RMSProp, momentum or Adam) and the EMA decay.
fn read_optimizer(mut o: Section, report: &mut Report) -> (Option<OptimizerConfig>, Option<f64>) {
    let kinds = ["rms_prop_optimizer", "momentum_optimizer", "adam_optimizer"];
    let optimizer = o.one_of(&kinds, report).map(|(kind, mut k)| {
        let learning_rate = read_learning_rate(k.child("learning_rate", report), report);
        let optimizer = match kind.as_str() {
            "rms_prop_optimizer" => OptimizerConfig::RmsProp {
                learning_rate,
                momentum: k.number("momentum_optimizer_value", 0.9, report),
                decay: k.number("decay", 0.9, report),
                epsilon: k.number("epsilon", 1.0, report),
            },
            "momentum_optimizer" => OptimizerConfig::Momentum {
                learning_rate,
                momentum: k.number("momentum_optimizer_value", 0.9, report),
            },
            _ => OptimizerConfig::Adam {
                learning_rate,
                beta1: 0.9,
                beta2: 0.999,
                epsilon: k.number("epsilon", 1e-8, report),
            },
        };
        k.finish(report);
        optimizer
    });
    let mut moving_average_decay = None;
    if o.flag("use_moving_average", true, report) {
        moving_average_decay = Some(o.number("moving_average_decay", 0.9999f64, report));
    } else {
        o.ignore(
            &["moving_average_decay"],
            "use_moving_average is false",
            report,
        );
    }
    o.finish(report);
    (optimizer, moving_average_decay)
}

/// The fine-tune checkpoint and the restore scope its fields name (with a note when the
/// checkpoint is a placeholder or missing).
fn read_fine_tune(t: &mut Section, report: &mut Report) -> (Option<PathBuf>, RestoreScope) {
    let path = t.path.clone();
    let fine_tune = t.word("fine_tune_checkpoint", "", report);
    let from_detection = t.flag("from_detection_checkpoint", false, report);
    let checkpoint_type = t.word(
        "fine_tune_checkpoint_type",
        if from_detection {
            "detection"
        } else {
            "classification"
        },
        report,
    );
    let load_all = t.flag("load_all_detection_checkpoint_vars", false, report);
    let scope = match (checkpoint_type.as_str(), load_all) {
        ("detection", true) => RestoreScope::All,
        ("detection", false) => RestoreScope::FeatureExtractor,
        ("classification", _) => RestoreScope::Classification,
        (other, _) => {
            report.errors.push(format!(
                "{path}.fine_tune_checkpoint_type: `{other}` is not supported (detection or classification)"
            ));
            RestoreScope::All
        }
    };
    let checkpoint = (!fine_tune.is_empty()).then(|| PathBuf::from(&fine_tune));
    if fine_tune.contains("PATH_TO_BE_CONFIGURED") {
        report.notes.push(format!(
            "{path}.fine_tune_checkpoint: {fine_tune} still has to be filled in (training stops at its start until it names a checkpoint)"
        ));
    } else if let Some(f) = &checkpoint
        && !model::tf::bundle::is_checkpoint(f)
        && !f.exists()
    {
        report.notes.push(format!(
            "{path}.fine_tune_checkpoint: {} does not exist (yet): training stops at its start unless it does",
            f.display()
        ));
    }
    (checkpoint, scope)
}

/// The settings of `train_config` we cannot honour (errors) or that only steer TF's
/// machinery (ignored with a note).
fn read_unsupported_and_ignored(t: &mut Section, report: &mut Report) {
    t.only_flags(
        &[
            ("merge_multiple_label_boxes", false),
            ("add_regularization_loss", true),
            ("use_bfloat16", false),
        ],
        report,
    );
    t.only_number("bias_grad_multiplier", 0.0f32, report);
    if !t.take("freeze_variables").is_empty() || !t.take("update_trainable_variables").is_empty() {
        report
            .errors
            .push(format!("{}: freezing variables is not supported", t.path));
    }
    t.ignore(
        &[
            "sync_replicas",
            "replicas_to_aggregate",
            "worker_replicas",
            "startup_delay_steps",
        ],
        "replicas are synchronous, set with --devices and --nodes",
        report,
    );
    t.ignore(
        &[
            "batch_queue_capacity",
            "num_batch_queue_threads",
            "prefetch_queue_capacity",
            "max_number_of_boxes",
            "unpad_groundtruth_tensors",
            "retain_original_images",
        ],
        "the loader is set with data.workers and data.prefetch",
        report,
    );
    t.ignore(
        &["keep_checkpoint_every_n_hours"],
        "train.keep_checkpoints sets how many are kept",
        report,
    );
}

fn read_learning_rate(lr: Option<Section>, report: &mut Report) -> LearningRate {
    let fallback = LearningRate::Constant {
        learning_rate: 0.002,
    };
    let Some(mut lr) = lr else {
        return fallback;
    };
    let schedules = [
        "constant_learning_rate",
        "exponential_decay_learning_rate",
        "manual_step_learning_rate",
        "cosine_decay_learning_rate",
    ];
    let schedule = match lr.one_of(&schedules, report) {
        Some((name, mut s)) => {
            let out = match name.as_str() {
                "constant_learning_rate" => LearningRate::Constant {
                    learning_rate: s.number("learning_rate", 0.002, report),
                },
                "exponential_decay_learning_rate" => LearningRate::ExponentialDecay {
                    initial_learning_rate: s.number("initial_learning_rate", 0.002, report),
                    decay_steps: s.number("decay_steps", 4_000_000, report),
                    decay_factor: s.number("decay_factor", 0.95, report),
                    staircase: s.flag("staircase", true, report),
                    burnin_learning_rate: s.number("burnin_learning_rate", 0.0, report),
                    burnin_steps: s.number("burnin_steps", 0, report),
                    min_learning_rate: s.number("min_learning_rate", 0.0, report),
                },
                "manual_step_learning_rate" => {
                    let initial = s.number("initial_learning_rate", 0.002, report);
                    let mut schedule = Vec::new();
                    for mut e in s.children("schedule", report) {
                        schedule.push((
                            e.number("step", 0u64, report),
                            e.number("learning_rate", 0.002f64, report),
                        ));
                        e.finish(report);
                    }
                    s.only_flag("warmup", false, report);
                    LearningRate::ManualStep {
                        initial_learning_rate: initial,
                        schedule,
                    }
                }
                _ => LearningRate::CosineDecay {
                    learning_rate_base: s.number("learning_rate_base", 0.002, report),
                    total_steps: s.number("total_steps", 4_000_000, report),
                    warmup_learning_rate: s.number("warmup_learning_rate", 0.0002, report),
                    warmup_steps: s.number("warmup_steps", 10_000, report),
                    hold_base_rate_steps: s.number("hold_base_rate_steps", 0, report),
                },
            };
            s.finish(report);
            out
        }
        None => fallback,
    };
    lr.finish(report);
    schedule
}

/// One `data_augmentation_options` entry: the step's defaults (the API's proto defaults,
/// `Augmentation::with_defaults`) with the fields the config sets.
fn read_augmentation(step: &mut Section, report: &mut Report) -> Option<Augmentation> {
    let (kind, mut a) = step.one_of(&Augmentation::NAMES, report)?;
    let mut out = Augmentation::with_defaults(&kind)?;
    match &mut out {
        Augmentation::RandomHorizontalFlip { probability }
        | Augmentation::RandomVerticalFlip { probability }
        | Augmentation::RandomRotation90 { probability }
        | Augmentation::RandomRgbToGray { probability } => {
            *probability = a.number("probability", *probability, report)
        }
        Augmentation::SsdRandomCrop { operations } => {
            // an operation's fields default to the proto's zeros, as in the API
            let zeros = CropOperation {
                min_object_covered: 0.0,
                aspect_ratio_range: [0.0, 0.0],
                area_range: [0.0, 0.0],
                overlap_thresh: 0.0,
                clip_boxes: true,
                random_coef: 0.0,
            };
            for mut op in a.children("operations", report) {
                operations.push(read_crop(&mut op, &zeros, report));
                op.finish(report);
            }
        }
        Augmentation::RandomCropImage(op) => *op = read_crop(&mut a, op, report),
        Augmentation::RandomAdjustBrightness { max_delta }
        | Augmentation::RandomAdjustHue { max_delta } => {
            *max_delta = a.number("max_delta", *max_delta, report)
        }
        Augmentation::RandomAdjustContrast {
            min_delta,
            max_delta,
        }
        | Augmentation::RandomAdjustSaturation {
            min_delta,
            max_delta,
        } => {
            *min_delta = a.number("min_delta", *min_delta, report);
            *max_delta = a.number("max_delta", *max_delta, report);
        }
        Augmentation::RandomDistortColor { color_ordering } => {
            *color_ordering = a.number("color_ordering", *color_ordering, report)
        }
        Augmentation::RandomImageScale {
            min_scale_ratio,
            max_scale_ratio,
        } => {
            *min_scale_ratio = a.number("min_scale_ratio", *min_scale_ratio, report);
            *max_scale_ratio = a.number("max_scale_ratio", *max_scale_ratio, report);
        }
        Augmentation::RandomJitterBoxes { ratio, jitter_mode } => {
            *ratio = a.number("ratio", *ratio, report);
            *jitter_mode = read_jitter_mode(&mut a, *jitter_mode, report);
        }
        Augmentation::RandomBlackPatches {
            max_black_patches,
            probability,
            size_to_image_ratio,
        } => {
            *max_black_patches = a.number("max_black_patches", *max_black_patches, report);
            *probability = a.number("probability", *probability, report);
            *size_to_image_ratio = a.number("size_to_image_ratio", *size_to_image_ratio, report);
        }
        // the API's defaults: a canvas up to twice the image size, its mean colour; other
        // settings are left unread and reported as unsupported
        Augmentation::RandomPadImage { .. } => {}
    }
    a.finish(report);
    Some(out)
}

/// A crop operation's fields (`random_crop_image`, an `ssd_random_crop` operation).
fn read_crop(op: &mut Section, defaults: &CropOperation, report: &mut Report) -> CropOperation {
    let [min_ratio, max_ratio] = defaults.aspect_ratio_range;
    let [min_area, max_area] = defaults.area_range;
    CropOperation {
        min_object_covered: op.number("min_object_covered", defaults.min_object_covered, report),
        aspect_ratio_range: [
            op.number("min_aspect_ratio", min_ratio, report),
            op.number("max_aspect_ratio", max_ratio, report),
        ],
        area_range: [
            op.number("min_area", min_area, report),
            op.number("max_area", max_area, report),
        ],
        overlap_thresh: op.number("overlap_thresh", defaults.overlap_thresh, report),
        clip_boxes: op.flag("clip_boxes", defaults.clip_boxes, report),
        random_coef: op.number("random_coef", defaults.random_coef, report),
    }
}

/// `jitter_mode`: `DEFAULT`, `EXPAND`, ... (`RandomJitterBoxes.JitterMode`).
fn read_jitter_mode(a: &mut Section, default: JitterMode, report: &mut Report) -> JitterMode {
    let word = a.word("jitter_mode", default.name(), report);
    match JitterMode::ALL
        .into_iter()
        .find(|m| m.name().eq_ignore_ascii_case(&word))
    {
        Some(mode) => mode,
        None => {
            let names: Vec<String> = JitterMode::ALL
                .iter()
                .map(|m| m.name().to_uppercase())
                .collect();
            report.errors.push(format!(
                "{}: `{word}` is not one of {}",
                a.join("jitter_mode"),
                names.join(", ")
            ));
            default
        }
    }
}
