//! `pipeline.config` import: the API's sample SSD-MobileNet-v1 configs give our shipped JSON
//! configs, proto defaults apply to absent fields, and unsupported settings are errors that
//! name the field and line.

use std::path::{Path, PathBuf};

use model::config::MinerLossType;
use train::config::pipeline::{import, import_text};
use train::config::{LearningRate, OptimizerConfig, TrainConfig};

fn root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../..")
}

fn fixture(name: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("tests/pipeline")
        .join(name)
}

/// The imported sample config equals the shipped JSON but for the data paths (the sample's are
/// placeholders).
fn matches_shipped(sample: &str, shipped: &str) -> TrainConfig {
    let imported = import(&fixture(sample)).unwrap();
    let notes = imported.notes.join("\n");
    assert!(
        notes.contains(
            "fine_tune_checkpoint: PATH_TO_BE_CONFIGURED/model.ckpt still has to be filled in"
        ),
        "{notes}"
    );
    assert!(notes.contains("still has to be filled in"), "{notes}");
    assert!(notes.contains("eval_config.max_evals (line"), "{notes}");
    assert!(
        notes.contains("eval_input_reader.num_readers (line"),
        "{notes}"
    );
    let mut config = imported.config;
    let json = TrainConfig::load(&root().join("configs").join(shipped)).unwrap();
    assert!(config.data.train[0].starts_with("PATH_TO_BE_CONFIGURED/"));
    config.data.train = json.data.train.clone();
    config.data.eval = json.data.eval.clone();
    // the sample's checkpoint path is a placeholder too; the shipped JSON leaves it unset
    assert_eq!(
        config.train.fine_tune_checkpoint.as_deref(),
        Some(Path::new("PATH_TO_BE_CONFIGURED/model.ckpt"))
    );
    config.train.fine_tune_checkpoint = None;
    assert_eq!(config, json);
    // `--config` takes the pipeline.config itself
    let mut direct = TrainConfig::load(&fixture(sample)).unwrap();
    direct.data = json.data.clone();
    direct.train.fine_tune_checkpoint = None;
    assert_eq!(direct, json);
    config
}

#[test]
fn pets_sample_gives_the_shipped_pets_config() {
    let c = matches_shipped("ssd_mobilenet_v1_pets.config", "ssd_mobilenet_v1_pets.json");
    // the sample's values, field by field
    assert_eq!(c.model.num_classes, 37);
    assert_eq!(c.model.image_size, [300, 300]);
    assert_eq!(c.model.box_coder_scales, [10.0, 10.0, 5.0, 5.0]);
    assert_eq!(c.model.anchors.aspect_ratios, [1.0, 2.0, 0.5, 3.0, 0.3333]);
    assert_eq!(
        (c.model.anchors.min_scale, c.model.anchors.max_scale),
        (0.2, 0.95)
    );
    assert!(c.model.matcher.force_match_for_each_row);
    assert_eq!(c.model.loss.l2_weight, 0.00004);
    assert_eq!(c.model.init_stddev, 0.03);
    assert_eq!(
        (c.model.batch_norm.decay, c.model.batch_norm.epsilon),
        (0.9997, 0.001)
    );
    let miner = c.model.loss.hard_example_miner.unwrap();
    assert_eq!(
        (
            miner.num_hard_examples,
            miner.iou_threshold,
            miner.loss_type
        ),
        (3000, 0.99, MinerLossType::Classification)
    );
    assert_eq!(miner.max_negatives_per_positive, 3);
    assert_eq!(c.model.post_processing.score_threshold, 1e-8);
    assert_eq!(c.train.batch_size, 24);
    assert_eq!(c.train.num_steps, 200_000);
    assert_eq!(
        c.train.optimizer,
        OptimizerConfig::RmsProp {
            learning_rate: LearningRate::ExponentialDecay {
                initial_learning_rate: 0.004,
                decay_steps: 800_720,
                decay_factor: 0.95,
                staircase: true,
                burnin_learning_rate: 0.0,
                burnin_steps: 0,
                min_learning_rate: 0.0,
            },
            momentum: 0.9,
            decay: 0.9,
            epsilon: 1.0,
        }
    );
    // `use_moving_average` defaults to true with decay 0.9999 in optimizer.proto
    assert_eq!(c.train.moving_average_decay, Some(0.9999));
    assert_eq!(c.data.augmentation.len(), 2);
    assert_eq!(c.eval.max_images, 2000);
}

#[test]
fn coco_sample_gives_the_shipped_coco_config() {
    let c = matches_shipped("ssd_mobilenet_v1_coco.config", "ssd_mobilenet_v1_coco.json");
    assert_eq!(c.model.num_classes, 90);
    assert_eq!(c.eval.max_images, 8000);
}

const MINIMAL: &str = r#"
model { ssd {
  num_classes: 2
  feature_extractor { type: "ssd_mobilenet_v1"
    conv_hyperparams { activation: RELU_6 batch_norm { scale: true } } }
  anchor_generator { ssd_anchor_generator { aspect_ratios: 1.0 aspect_ratios: 2.0 } }
  box_coder { faster_rcnn_box_coder {} } matcher { argmax_matcher {} }
  similarity_calculator { iou_similarity {} } image_resizer { fixed_shape_resizer {} }
  box_predictor { convolutional_box_predictor { conv_hyperparams {
    activation: RELU_6 batch_norm { scale: true } } } }
  loss { classification_loss { weighted_sigmoid {} } localization_loss { weighted_smooth_l1 {} } }
  post_processing { score_converter: SIGMOID }
} }
train_config { num_steps: 10 optimizer { adam_optimizer { learning_rate {
  cosine_decay_learning_rate { learning_rate_base: 0.01 total_steps: 20000 } } } } }
train_input_reader { tf_record_input_reader { input_path: "a.record" input_path: "b.record" } }
"#;

#[test]
fn absent_fields_take_the_proto_defaults() {
    let c = import_text(MINIMAL).unwrap().config;
    assert_eq!(c.train.batch_size, 32);
    assert!(!c.model.matcher.force_match_for_each_row);
    assert_eq!(c.model.loss.hard_example_miner, None);
    assert_eq!(c.model.loss.l2_weight, 0.0, "no regularizer: no L2 loss");
    assert_eq!(c.model.batch_norm.decay, 0.999);
    assert_eq!(c.model.post_processing.score_threshold, 0.0);
    assert_eq!(c.model.anchors.aspect_ratios, [1.0, 2.0]);
    assert_eq!(c.data.train, ["a.record", "b.record"]);
    assert_eq!(c.train.moving_average_decay, Some(0.9999));
    assert_eq!(
        c.train.optimizer,
        OptimizerConfig::Adam {
            learning_rate: LearningRate::CosineDecay {
                learning_rate_base: 0.01,
                total_steps: 20_000,
                warmup_learning_rate: 0.0002,
                warmup_steps: 10_000,
                hold_base_rate_steps: 0,
            },
            beta1: 0.9,
            beta2: 0.999,
            epsilon: 1e-8,
        }
    );
}

#[test]
fn unsupported_settings_are_all_named_with_their_lines() {
    let text = MINIMAL
        .replace("weighted_sigmoid {}", "weighted_softmax {}")
        .replace("score_converter: SIGMOID", "score_converter: SOFTMAX")
        .replace(
            "num_steps: 10",
            "num_steps: 10 use_bfloat16: true mystery: 3",
        );
    let e = format!("{:#}", import_text(&text).unwrap_err());
    for want in [
        "model.ssd.loss.classification_loss.weighted_softmax (line 11): not supported",
        "model.ssd.post_processing.score_converter: \"SOFTMAX\" is not supported",
        "train_config.use_bfloat16: true is not supported",
        "train_config.mystery (line 14): not supported",
    ] {
        assert!(e.contains(want), "missing `{want}` in:\n{e}");
    }
    // a misspelt field is named with the field it was meant to be
    let e = format!(
        "{:#}",
        import_text(&MINIMAL.replace("num_classes: 2", "num_clases: 2")).unwrap_err()
    );
    assert!(
        e.contains(
            "model.ssd.num_clases (line 3): unknown field `num_clases`, did you mean `num_classes`?"
        ),
        "{e}"
    );
    let keras = MINIMAL.replace(
        "type: \"ssd_mobilenet_v1\"",
        "type: \"ssd_mobilenet_v1_keras\"",
    );
    assert_ne!(keras, MINIMAL);
    let e = format!("{:#}", import_text(&keras).unwrap_err());
    assert!(
        e.contains("is a TF2 (Keras) feature extractor, which is not supported"),
        "{e}"
    );
    let faster = "model { faster_rcnn { num_classes: 3 } }";
    let e = format!("{:#}", import_text(faster).unwrap_err());
    assert!(e.contains("only `ssd` models"), "{e}");
    let e = format!(
        "{:#}",
        import_text(&MINIMAL.replace("matcher { argmax_matcher {} }", "")).unwrap_err()
    );
    assert!(e.contains("model.ssd.matcher is missing"), "{e}");
    let e = format!("{:#}", import_text("model { ssd {").unwrap_err());
    assert!(e.contains("line 1"), "{e}");
    let e = format!(
        "{:#}",
        import_text(&MINIMAL.replace("num_classes: 2", "num_classes: two")).unwrap_err()
    );
    assert!(
        e.contains("model.ssd.num_classes (line 3): expected a number"),
        "{e}"
    );
}

/// MINIMAL with these `data_augmentation_options`.
fn with_augmentation(steps: &str) -> String {
    let options: String = steps
        .lines()
        .map(|step| format!("data_augmentation_options {{ {step} }}\n"))
        .collect();
    MINIMAL.replace("num_steps: 10", &format!("num_steps: 10\n{options}"))
}

#[test]
fn augmentation_steps_take_their_settings_and_the_proto_defaults() {
    use data::augment::{Augmentation, CropOperation, JitterMode};
    let text = with_augmentation(
        "random_vertical_flip { probability: 0.3 }
random_rotation90 {}
random_adjust_hue {}
random_distort_color { color_ordering: 1 }
random_rgb_to_gray {}
random_crop_image { min_object_covered: 0.5 max_area: 0.9 }
random_image_scale { max_scale_ratio: 1.5 }
random_jitter_boxes { ratio: 0.1 jitter_mode: SHRINK_SYMMETRIC }
random_black_patches { max_black_patches: 3 }",
    );
    let c = import_text(&text).unwrap().config;
    assert_eq!(
        c.data.augmentation,
        [
            Augmentation::RandomVerticalFlip { probability: 0.3 },
            Augmentation::RandomRotation90 { probability: 0.5 },
            Augmentation::RandomAdjustHue { max_delta: 0.02 },
            Augmentation::RandomDistortColor { color_ordering: 1 },
            Augmentation::RandomRgbToGray { probability: 0.1 },
            Augmentation::RandomCropImage(CropOperation {
                min_object_covered: 0.5,
                area_range: [0.1, 0.9],
                ..CropOperation::default()
            }),
            Augmentation::RandomImageScale {
                min_scale_ratio: 0.5,
                max_scale_ratio: 1.5,
            },
            Augmentation::RandomJitterBoxes {
                ratio: 0.1,
                jitter_mode: JitterMode::ShrinkSymmetric,
            },
            Augmentation::RandomBlackPatches {
                max_black_patches: 3,
                probability: 0.5,
                size_to_image_ratio: 0.1,
            },
        ]
    );
    // what the import cannot honour is named with its line
    let text = with_augmentation(
        "random_jitter_boxes { jitter_mode: WOBBLE }
ssd_random_crop_pad {}
random_horizontal_flip { keypoint_flip_permutation: 1 }",
    );
    let e = format!("{:#}", import_text(&text).unwrap_err());
    for want in [
        "random_jitter_boxes.jitter_mode: `WOBBLE` is not one of DEFAULT, EXPAND, SHRINK",
        "data_augmentation_options.ssd_random_crop_pad (line 16): not supported",
        "random_horizontal_flip.keypoint_flip_permutation (line 17): not supported",
    ] {
        assert!(e.contains(want), "missing `{want}` in:\n{e}");
    }
    // a setting out of range is refused by the config's check, with the step
    let text = with_augmentation("random_distort_color { color_ordering: 2 }");
    let e = format!("{:#}", import_text(&text).unwrap_err());
    assert!(
        e.contains("`data.augmentation[0].color_ordering`: 2, expected 0 or 1"),
        "{e}"
    );
}

#[test]
fn numbers_beyond_a_float_are_named_with_their_lines() {
    // (a bare `nan` or `inf` is a word, refused as "expected a number")
    for number in ["1e400", "-inf", "+nan", "3.5e38"] {
        let text = MINIMAL.replace(
            "learning_rate_base: 0.01",
            &format!("learning_rate_base: {number}"),
        );
        let e = format!("{:#}", import_text(&text).unwrap_err());
        let want = format!("learning_rate_base (line 15): `{number}` is not a finite number");
        assert!(e.contains(&want), "missing `{want}` in:\n{e}");
    }
}

/// MINIMAL with `num_classes` classes and a label map of `text`.
fn import_with_label_map(
    num_classes: usize,
    text: &str,
) -> anyhow::Result<train::config::pipeline::Imported> {
    let dir = tempfile::tempdir().unwrap();
    let map = dir.path().join("label_map.pbtxt");
    std::fs::write(&map, text).unwrap();
    let reader = format!(
        "label_map_path: {:?} tf_record_input_reader {{",
        map.display().to_string()
    );
    let config = MINIMAL
        .replace("num_classes: 2", &format!("num_classes: {num_classes}"))
        .replace("tf_record_input_reader {", &reader);
    import_text(&config)
}

#[test]
fn label_map_ids_keep_their_places_and_an_empty_map_is_an_error() {
    // no item for id 2: the class of id 3 stays class 3 (it was class 2 when names were
    // taken in order)
    let map = "item { id: 1 name: 'cat' } item { id: 3 name: 'dog' }";
    let imported = import_with_label_map(3, map).unwrap();
    assert_eq!(imported.config.model.class_names, ["cat", "class_2", "dog"]);
    assert!(
        imported
            .notes
            .iter()
            .any(|n| n.contains("no item for ids [2]")),
        "{:?}",
        imported.notes
    );
    let e = format!("{:#}", import_with_label_map(2, map).unwrap_err());
    assert!(e.contains("id 3 (\"dog\") is over num_classes 2"), "{e}");
    let e = format!(
        "{:#}",
        import_with_label_map(2, "# nothing here\n").unwrap_err()
    );
    assert!(e.contains("no `item`"), "{e}");
}

/// `graph_rewriter { quantization }` turns quantization-aware training on with the model
/// zoo's quantized config's settings or the proto's defaults; widths other than 8 are errors
/// naming the field (the API's `graph_rewriter_builder` refuses them too), in the JSON config
/// as in the pipeline.config.
#[test]
fn graph_rewriter_quantization_is_imported() {
    use model::config::QuantizationConfig;
    let with = |rewriter: &str| import_text(&format!("{MINIMAL}\ngraph_rewriter {{ {rewriter} }}"));
    let zoo = with("quantization { delay: 48000 weight_bits: 8 activation_bits: 8 }").unwrap();
    let expected = QuantizationConfig {
        delay: 48_000,
        weight_bits: 8,
        activation_bits: 8,
        symmetric: false,
    };
    assert_eq!(zoo.config.model.quantization, Some(expected));
    assert!(
        zoo.notes
            .iter()
            .any(|n| n.contains("quantization-aware training, fake quantization from step 48000")),
        "{:?}",
        zoo.notes
    );
    let defaults = with("quantization { symmetric: true }")
        .unwrap()
        .config
        .model;
    let q = defaults.quantization.unwrap();
    assert_eq!((q.delay, q.symmetric), (500_000, true));
    assert_eq!(
        import_text(MINIMAL).unwrap().config.model.quantization,
        None
    );
    let e = format!("{:#}", with("quantization { weight_bits: 4 }").unwrap_err());
    assert!(
        e.contains("graph_rewriter.quantization.weight_bits: 4 is not supported (only 8)"),
        "{e}"
    );
    let mut json = import_text(MINIMAL).unwrap().config.model;
    json.quantization = Some(QuantizationConfig {
        activation_bits: 16,
        ..QuantizationConfig::default()
    });
    let e = json.validate().unwrap_err().to_string();
    assert!(
        e.contains("quantization.activation_bits") && e.contains("16"),
        "{e}"
    );
}
