//! `conv_hyperparams`: activation, L2 regulariser, initializer and BatchNorm of a group of
//! convolutions (the feature extractor's, the box predictor's).

use super::section::{Report, Section, require};

/// What a `conv_hyperparams` message sets.
#[derive(Debug, Default)]
pub(super) struct ConvHyperparams {
    /// `regularizer.l2_regularizer.weight`.
    pub l2_weight: Option<f32>,
    /// `initializer.truncated_normal_initializer.stddev`.
    pub stddev: Option<f32>,
    /// `batch_norm`'s `(decay, epsilon)`.
    pub batch_norm: Option<(f64, f64)>,
}

pub(super) fn read_conv_hyperparams(mut h: Section, report: &mut Report) -> ConvHyperparams {
    let path = h.path.clone();
    let activation = h.word("activation", "RELU", report);
    require(&path, "activation", activation.as_str(), "RELU_6", report);
    let l2_weight = h.read_one_of(
        "regularizer",
        &["l2_regularizer"],
        report,
        |_, l, report| l.number("weight", 1.0f32, report),
    );
    let stddev = h.read_one_of(
        "initializer",
        &["truncated_normal_initializer"],
        report,
        |_, t, report| {
            let mean = t.number("mean", 0.0f32, report);
            require(&t.path, "mean", mean, 0.0, report);
            t.number("stddev", 1.0f32, report)
        },
    );
    let batch_norm = match h.child("batch_norm", report) {
        Some(b) => Some(read_batch_norm(b, report)),
        None => {
            report.errors.push(format!(
                "{path}: layers without `batch_norm` are not supported"
            ));
            None
        }
    };
    let op = h.word("op", "CONV", report);
    require(&path, "op", op.as_str(), "CONV", report);
    h.ignore(
        &["regularize_depthwise"],
        "depthwise kernels are regularised like the others",
        report,
    );
    h.finish(report);
    ConvHyperparams {
        l2_weight,
        stddev,
        batch_norm,
    }
}

/// `(decay, epsilon)` of a `batch_norm` message.
fn read_batch_norm(mut b: Section, report: &mut Report) -> (f64, f64) {
    let decay = b.number("decay", 0.999f64, report);
    let epsilon = b.number("epsilon", 0.001f64, report);
    b.only_flag("center", true, report);
    b.only_flag("train", true, report);
    // absent, `scale` is false: no gamma, which our BatchNorm always has
    let scale = b.flag("scale", false, report);
    require(&b.path, "scale", scale, true, report);
    b.finish(report);
    (decay, epsilon)
}
