//! How `model.ssd` assigns targets: the box coder, the matcher, the similarity and the
//! anchor generator.

use model::SsdConfig;

use super::section::{Report, Section};

/// `box_coder`: only the Faster R-CNN box coder, with its four scales.
pub(super) fn read_box_coder(s: &mut Section, model: &mut SsdConfig, report: &mut Report) {
    let scales = s.read_one_of(
        "box_coder",
        &["faster_rcnn_box_coder"],
        report,
        |_, f, report| {
            [
                f.number("y_scale", 10.0f32, report),
                f.number("x_scale", 10.0f32, report),
                f.number("height_scale", 5.0f32, report),
                f.number("width_scale", 5.0f32, report),
            ]
        },
    );
    if let Some(scales) = scales {
        model.box_coder_scales = scales;
    }
}

/// `matcher`: only the argmax matcher with thresholds.
pub(super) fn read_matcher(s: &mut Section, model: &mut SsdConfig, report: &mut Report) {
    let mc = &mut model.matcher;
    s.read_one_of("matcher", &["argmax_matcher"], report, |_, a, report| {
        mc.matched_threshold = a.number("matched_threshold", 0.5f32, report);
        mc.unmatched_threshold = a.number("unmatched_threshold", 0.5f32, report);
        a.only_flag("ignore_thresholds", false, report);
        mc.negatives_lower_than_unmatched = a.flag("negatives_lower_than_unmatched", true, report);
        mc.force_match_for_each_row = a.flag("force_match_for_each_row", false, report);
        a.ignore(
            &["use_matmul_gather"],
            "a TPU implementation detail",
            report,
        );
    });
}

/// `similarity_calculator`: only IoU.
pub(super) fn read_similarity_calculator(s: &mut Section, report: &mut Report) {
    s.read_one_of(
        "similarity_calculator",
        &["iou_similarity"],
        report,
        |_, _, _| (),
    );
}

/// `anchor_generator`: only the SSD anchor generator.
pub(super) fn read_anchor_generator(s: &mut Section, model: &mut SsdConfig, report: &mut Report) {
    let ac = &mut model.anchors;
    s.read_one_of(
        "anchor_generator",
        &["ssd_anchor_generator"],
        report,
        |_, g, report| {
            ac.num_layers = g.number("num_layers", 6usize, report);
            ac.min_scale = g.number("min_scale", 0.2f32, report);
            ac.max_scale = g.number("max_scale", 0.95f32, report);
            ac.aspect_ratios = g.numbers("aspect_ratios", report);
            if ac.aspect_ratios.is_empty() {
                report
                    .errors
                    .push(format!("{}.aspect_ratios must be given", g.path));
            }
            ac.interpolated_scale_aspect_ratio =
                g.number("interpolated_scale_aspect_ratio", 1.0f32, report);
            ac.base_anchor_size = [
                g.number("base_anchor_height", 1.0f32, report),
                g.number("base_anchor_width", 1.0f32, report),
            ];
            ac.reduce_boxes_in_lowest_layer = g.flag("reduce_boxes_in_lowest_layer", true, report);
        },
    );
}
