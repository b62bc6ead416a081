//! `model.ssd`: the sub-messages that shape the network (image resizer, feature extractor,
//! box predictor) and the model-wide flags; the targets, loss and post-processing have
//! modules of their own.

use model::SsdConfig;

use super::hyperparams::{ConvHyperparams, read_conv_hyperparams};
use super::section::{Report, Section, require};
use super::{loss, post_processing, targets};

/// Sub-messages every SSD config must have.
const REQUIRED: [&str; 8] = [
    "image_resizer",
    "feature_extractor",
    "box_coder",
    "matcher",
    "similarity_calculator",
    "anchor_generator",
    "box_predictor",
    "loss",
];

pub(super) fn read_ssd(mut s: Section, model: &mut SsdConfig, report: &mut Report) {
    let path = s.path.clone();
    for required in REQUIRED {
        if s.message.all(required).next().is_none() {
            report.errors.push(format!("{path}.{required} is missing"));
        }
    }
    model.num_classes = s.number("num_classes", 0usize, report);
    if model.num_classes == 0 {
        report
            .errors
            .push(format!("{path}.num_classes must be set"));
    }
    read_image_resizer(&mut s, model, report);
    let backbone = read_feature_extractor(&mut s, model, report);
    let heads = read_box_predictor(&mut s, report);
    shared_hyperparams(&path, [backbone, heads], model, report);
    targets::read_box_coder(&mut s, model, report);
    targets::read_matcher(&mut s, model, report);
    targets::read_similarity_calculator(&mut s, report);
    targets::read_anchor_generator(&mut s, model, report);
    if let Some(mut l) = s.child("loss", report) {
        loss::read_loss(&mut l, model, report);
        l.finish(report);
    }
    read_model_flags(&mut s, model, report);
    if let Some(p) = s.child("post_processing", report) {
        post_processing::read_post_processing(p, model, report);
    }
    s.finish(report);
}

/// `image_resizer`: only `fixed_shape_resizer` with bilinear resizing.
fn read_image_resizer(s: &mut Section, model: &mut SsdConfig, report: &mut Report) {
    let size = s.read_one_of(
        "image_resizer",
        &["fixed_shape_resizer"],
        report,
        |_, f, report| {
            let size = [
                f.number("height", 300usize, report),
                f.number("width", 300usize, report),
            ];
            let method = f.word("resize_method", "BILINEAR", report);
            require(
                &f.path,
                "resize_method",
                method.as_str(),
                "BILINEAR",
                report,
            );
            f.only_flag("convert_to_grayscale", false, report);
            size
        },
    );
    if let Some(size) = size {
        model.image_size = size;
    }
}

/// `feature_extractor`: MobileNet-v1's depth multiplier and minimum depth, and its
/// hyperparameters (the BatchNorm's are the network's).
fn read_feature_extractor(
    s: &mut Section,
    model: &mut SsdConfig,
    report: &mut Report,
) -> ConvHyperparams {
    let Some(mut fe) = s.child("feature_extractor", report) else {
        return ConvHyperparams::default();
    };
    let kind = fe.word("type", "", report);
    if kind.ends_with("_keras") {
        report.errors.push(format!(
            "{}.type: {kind:?} is a TF2 (Keras) feature extractor, which is not supported: only the TF1 `ssd_mobilenet_v1` of model_main.py (TF1 checkpoints, tf.slim names)",
            fe.path
        ));
    } else {
        require(&fe.path, "type", kind.as_str(), "ssd_mobilenet_v1", report);
    }
    model.depth_multiplier = fe.number("depth_multiplier", 1.0f32, report);
    model.min_depth = fe.number("min_depth", 16usize, report);
    fe.only_number("pad_to_multiple", 1usize, report);
    let flags = [
        "use_explicit_padding",
        "use_depthwise",
        "override_base_feature_extractor_hyperparams",
    ];
    fe.only_flags(&flags.map(|f| (f, false)), report);
    let hyperparams = fe
        .child("conv_hyperparams", report)
        .map(|h| read_conv_hyperparams(h, report))
        .unwrap_or_default();
    if let Some((decay, epsilon)) = hyperparams.batch_norm {
        model.batch_norm.decay = decay;
        model.batch_norm.epsilon = epsilon;
    }
    fe.finish(report);
    hyperparams
}

/// `box_predictor`: the plain convolutional predictor (one 1x1 convolution per head).
fn read_box_predictor(s: &mut Section, report: &mut Report) -> ConvHyperparams {
    s.read_one_of(
        "box_predictor",
        &["convolutional_box_predictor"],
        report,
        |_, c, report| {
            for (name, supported) in [
                ("min_depth", 0usize),
                ("max_depth", 0),
                ("num_layers_before_predictor", 0),
                ("box_code_size", 4),
                ("kernel_size", 1),
            ] {
                c.only_number(name, supported, report);
            }
            let flags = ["use_dropout", "apply_sigmoid_to_scores", "use_depthwise"];
            c.only_flags(&flags.map(|f| (f, false)), report);
            c.only_number("class_prediction_bias_init", 0.0f32, report);
            c.ignore(
                &["dropout_keep_probability"],
                "no dropout (use_dropout is false)",
                report,
            );
            // the predictor convolutions have no BatchNorm whatever this says
            // (num_layers_before_predictor is 0)
            c.child("conv_hyperparams", report)
                .map(|h| read_conv_hyperparams(h, report))
                .unwrap_or_default()
        },
    )
    .unwrap_or_default()
}

/// The L2 weight and initializer stddev, which the feature extractor and the box predictor
/// must share (the network has one of each).
fn shared_hyperparams(
    path: &str,
    groups: [ConvHyperparams; 2],
    model: &mut SsdConfig,
    report: &mut Report,
) {
    let l2: Vec<f32> = groups.iter().filter_map(|g| g.l2_weight).collect();
    let stddevs: Vec<f32> = groups.iter().filter_map(|g| g.stddev).collect();
    model.loss.l2_weight = l2.first().copied().unwrap_or(0.0);
    if l2.iter().any(|&x| x != model.loss.l2_weight) {
        report.errors.push(format!(
            "{path}: different L2 weights for the feature extractor and the box predictor ({l2:?}) are not supported"
        ));
    }
    if let Some(&sd) = stddevs.first() {
        model.init_stddev = sd;
        if stddevs.iter().any(|&x| x != sd) {
            report.errors.push(format!(
                "{path}: different initializer stddevs for the feature extractor and the box predictor ({stddevs:?}) are not supported"
            ));
        }
    }
}

/// The flags of `model.ssd` itself.
fn read_model_flags(s: &mut Section, model: &mut SsdConfig, report: &mut Report) {
    model.loss.normalize_loss_by_num_matches =
        s.flag("normalize_loss_by_num_matches", true, report);
    model.loss.normalize_loc_loss_by_codesize =
        s.flag("normalize_loc_loss_by_codesize", false, report);
    s.only_flags(
        &[
            ("encode_background_as_zeros", false),
            ("freeze_batchnorm", false),
            ("add_background_class", true),
        ],
        report,
    );
    s.only_number("negative_class_weight", 1.0f32, report);
    s.ignore(
        &["inplace_batchnorm_update"],
        "BatchNorm statistics are always updated in the training step",
        report,
    );
}
