//! `model.ssd.loss`: the classification and localization losses, the hard example miner and
//! the weights of the parts.

use model::SsdConfig;
use model::config::{HardExampleMinerConfig, MinerLossType};

use super::section::{Report, Section};

pub(super) fn read_loss(l: &mut Section, model: &mut SsdConfig, report: &mut Report) {
    for required in ["classification_loss", "localization_loss"] {
        if l.message.all(required).next().is_none() {
            report
                .errors
                .push(format!("{}.{required} is missing", l.path));
        }
    }
    l.read_one_of(
        "classification_loss",
        &["weighted_sigmoid"],
        report,
        |_, w, report| w.ignore(&["anchorwise_output"], "deprecated in the API", report),
    );
    let delta = l.read_one_of(
        "localization_loss",
        &["weighted_smooth_l1"],
        report,
        |_, w, report| {
            w.ignore(&["anchorwise_output"], "deprecated in the API", report);
            w.number("delta", 1.0f32, report)
        },
    );
    if let Some(delta) = delta {
        model.loss.smooth_l1_delta = delta;
    }
    model.loss.hard_example_miner = l
        .child("hard_example_miner", report)
        .map(|h| read_hard_example_miner(h, report));
    model.loss.classification_weight = l.number("classification_weight", 1.0f32, report);
    model.loss.localization_weight = l.number("localization_weight", 1.0f32, report);
}

fn read_hard_example_miner(mut h: Section, report: &mut Report) -> HardExampleMinerConfig {
    let loss_type = match h.word("loss_type", "BOTH", report).as_str() {
        "CLASSIFICATION" => MinerLossType::Classification,
        "LOCALIZATION" => MinerLossType::Localization,
        "BOTH" => MinerLossType::Both,
        other => {
            report
                .errors
                .push(format!("{}.loss_type: unknown `{other}`", h.path));
            MinerLossType::Both
        }
    };
    let miner = HardExampleMinerConfig {
        num_hard_examples: h.number("num_hard_examples", 64usize, report),
        iou_threshold: h.number("iou_threshold", 0.7f32, report),
        loss_type,
        max_negatives_per_positive: h.number("max_negatives_per_positive", 0usize, report),
        min_negatives_per_image: h.number("min_negatives_per_image", 0usize, report),
    };
    h.finish(report);
    miner
}
