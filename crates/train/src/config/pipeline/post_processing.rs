//! `model.ssd.post_processing`: multi-class NMS and the score converter.

use data::textproto::Message;
use model::SsdConfig;

use super::section::{Report, Section, require};

pub(super) fn read_post_processing(mut p: Section, model: &mut SsdConfig, report: &mut Report) {
    // absent, the NMS settings take their proto defaults too
    let defaults = Message::default();
    let nms = p.child("batch_non_max_suppression", report);
    let mut n = nms.unwrap_or_else(|| Section::new(&defaults, p.join("batch_non_max_suppression")));
    let pc = &mut model.post_processing;
    pc.score_threshold = n.number("score_threshold", 0.0f32, report);
    pc.iou_threshold = n.number("iou_threshold", 0.6f32, report);
    pc.max_detections_per_class = n.number("max_detections_per_class", 100usize, report);
    pc.max_total_detections = n.number("max_total_detections", 100usize, report);
    let nms_flags = ["use_class_agnostic_nms", "use_combined_nms", "combined_nms"];
    n.only_flags(&nms_flags.map(|f| (f, false)), report);
    n.only_number("soft_nms_sigma", 0.0f32, report);
    n.ignore(
        &["use_static_shapes"],
        "an XLA/TPU implementation detail",
        report,
    );
    n.finish(report);
    let converter = p.word("score_converter", "IDENTITY", report);
    require(
        &p.path,
        "score_converter",
        converter.as_str(),
        "SIGMOID",
        report,
    );
    p.only_number("logit_scale", 1.0f32, report);
    p.finish(report);
}
