//! The SSD training loss as the API computes it: weighted sigmoid cross-entropy for classes,
//! weighted smooth L1 for boxes, hard example mining per image, normalisation by the number
//! of matched anchors, and the L2 regulariser as its own term.

use burn::backend::Autodiff;
use burn::module::AutodiffModule;
use burn::optim::GradientsParams;
use burn::tensor::backend::Backend;
use burn::tensor::{Tensor, TensorData};

use rayon::prelude::*;

use crate::box_coder::BoxCoder;
use crate::boxes::BBox;
use crate::config::{HardExampleMinerConfig, LossConfig, MinerLossType, SsdConfig};
use crate::ops::{SsdBackend, add_scaled, sigmoid_cross_entropy};
use crate::postprocess::non_max_suppression;
use crate::ssd::{Predictions, Ssd};
use crate::targets::{ImageTargets, Match};

/// The loss of one batch, each part a scalar tensor (one element).
#[derive(Debug, Clone)]
pub struct LossParts<B: Backend> {
    /// Weighted, mined, normalised classification loss.
    pub classification: Tensor<B, 1>,
    /// Weighted, mined, normalised localization loss.
    pub localization: Tensor<B, 1>,
    /// L2 weight regularisation: a value, outside the graph (see [`LossParts::gradients`]).
    pub regularization: Tensor<B, 1>,
    /// Sum of the three.
    pub total: Tensor<B, 1>,
    /// Matched anchors in the batch (the normaliser before clamping at 1).
    pub num_matches: usize,
    /// Anchors the miner kept as negatives, over the batch.
    pub num_mined_negatives: usize,
    /// The regulariser's weight, for its gradient.
    l2_weight: f32,
}

impl<B: SsdBackend> LossParts<Autodiff<B>> {
    /// The gradients of `total` for every parameter of `model`, the network that computed
    /// this loss. The L2 term is not in the graph: its gradient, `l2_weight * w`, is added
    /// to each kernel's gradient in one pass. As graph nodes it cost a product per kernel, a
    /// one-threaded sum into the kernel's gradient and the nodes' bookkeeping: its value and
    /// gradient took 19.5-22.1 ms a step that way and take 3.9-4.7 ms now (default network,
    /// two cores; docs/perf.md).
    pub fn gradients(&self, model: &Ssd<Autodiff<B>>) -> GradientsParams {
        let mut grads = GradientsParams::from_grads(self.total.backward(), model);
        for kernel in model.kernels() {
            if let Some(g) = grads.remove::<B, 4>(kernel.id) {
                let w = kernel.val().inner();
                grads.register(kernel.id, add_scaled(g, w, self.l2_weight));
            }
        }
        grads
    }
}

/// Indices of the anchors hard example mining keeps for one image, as `HardExampleMiner`:
/// NMS over the decoded boxes scored by the anchors' losses, then at most
/// `max(min_negatives_per_image, max_negatives_per_positive * positives)` negatives, taken in
/// NMS order (`cumsum(negatives) <= max_negatives`), plus every positive.
pub fn mine_hard_examples(
    miner: &HardExampleMinerConfig,
    image_losses: &[f32],
    boxes: &[BBox],
    matches: &[Match],
) -> Vec<usize> {
    let selected = non_max_suppression(
        boxes,
        image_losses,
        miner.num_hard_examples,
        miner.iou_threshold,
        f32::NEG_INFINITY,
    );
    if miner.max_negatives_per_positive == 0 {
        return selected;
    }
    let positives = selected
        .iter()
        .filter(|&&i| matches!(matches[i], Match::Matched(_)))
        .count();
    let max_negatives = miner
        .min_negatives_per_image
        .max(miner.max_negatives_per_positive * positives);
    let mut negatives_so_far = 0;
    selected
        .into_iter()
        .filter(|&i| {
            if matches[i] == Match::Unmatched {
                negatives_so_far += 1;
            }
            matches!(matches[i], Match::Matched(_)) || negatives_so_far <= max_negatives
        })
        .collect()
}

/// Huber loss with the given delta, per entry.
fn huber<B: Backend>(diff: Tensor<B, 3>, delta: f32) -> Tensor<B, 3> {
    let abs = diff.abs();
    let small = abs.clone().clamp_max(delta);
    small.clone().square().mul_scalar(0.5) + (abs - small).mul_scalar(delta)
}

/// Host-side targets of a batch, flattened for upload.
struct BatchTargets {
    labels: Vec<f32>,
    class_weights: Vec<f32>,
    box_codes: Vec<f32>,
    box_weights: Vec<f32>,
}

fn flatten_targets(targets: &[ImageTargets], num_classes: usize) -> BatchTargets {
    let anchors = targets.first().map_or(0, |t| t.class_ids.len());
    let n = targets.len() * anchors;
    let mut out = BatchTargets {
        labels: vec![0.0; n * (num_classes + 1)],
        class_weights: Vec::with_capacity(n),
        box_codes: Vec::with_capacity(n * 4),
        box_weights: Vec::with_capacity(n),
    };
    for (i, &t) in targets.iter().flat_map(|t| t.class_ids.iter()).enumerate() {
        // a larger id would set a label in the next anchor's row; the data loader refuses
        // labels outside 1..=num_classes naming the record, so one here is a caller's bug
        assert!(
            t <= num_classes,
            "class id {t} above num_classes {num_classes} in the targets"
        );
        out.labels[i * (num_classes + 1) + t] = 1.0;
    }
    for t in targets {
        out.class_weights.extend(&t.class_weights);
        out.box_weights.extend(&t.box_weights);
        out.box_codes.extend(t.box_codes.iter().flatten());
    }
    out
}

/// Classification and localization loss of a batch of predictions against its targets.
/// Returns `(classification, localization, num_matches, num_mined_negatives)`.
pub fn detection_loss<B: SsdBackend>(
    config: &LossConfig,
    coder: &BoxCoder,
    anchors: &[BBox],
    predictions: &Predictions<B>,
    targets: &[ImageTargets],
) -> (Tensor<B, 1>, Tensor<B, 1>, usize, usize) {
    let [batch, num_anchors, classes_bg] = predictions.class_logits.dims();
    assert_eq!(targets.len(), batch, "one target set per image");
    assert_eq!(num_anchors, anchors.len(), "one anchor per prediction");
    let device = predictions.class_logits.device();
    let flat = flatten_targets(targets, classes_bg - 1);
    let labels = Tensor::<B, 3>::from_data(
        TensorData::new(flat.labels, [batch, num_anchors, classes_bg]),
        &device,
    );
    let class_weights = Tensor::<B, 2>::from_data(
        TensorData::new(flat.class_weights, [batch, num_anchors]),
        &device,
    );
    let box_codes = Tensor::<B, 3>::from_data(
        TensorData::new(flat.box_codes, [batch, num_anchors, 4]),
        &device,
    );
    let box_weights_host = flat.box_weights;
    let num_matches = box_weights_host.iter().filter(|&&w| w > 0.0).count();
    let normalizer = if config.normalize_loss_by_num_matches {
        box_weights_host.iter().sum::<f32>().max(1.0)
    } else {
        1.0
    };
    let box_weights = Tensor::<B, 2>::from_data(
        TensorData::new(box_weights_host, [batch, num_anchors]),
        &device,
    );

    let cls_per_anchor: Tensor<B, 2> =
        sigmoid_cross_entropy(predictions.class_logits.clone(), labels) * class_weights;
    let loc_per_anchor: Tensor<B, 2> = huber(
        predictions.box_encodings.clone() - box_codes,
        config.smooth_l1_delta,
    )
    .sum_dim(2)
    .reshape([batch, num_anchors])
        * box_weights;

    let (mask, mined_negatives) = match &config.hard_example_miner {
        None => (None, 0),
        Some(miner) => {
            let cls_host = to_vec(cls_per_anchor.clone());
            let loc_host = to_vec(loc_per_anchor.clone());
            let codes = to_vec(predictions.box_encodings.clone());
            // images mined in parallel
            let kept: Vec<Vec<usize>> = targets
                .par_iter()
                .enumerate()
                .map(|(b, t)| {
                    let range = b * num_anchors..(b + 1) * num_anchors;
                    let losses: Vec<f32> = match miner.loss_type {
                        MinerLossType::Classification => cls_host[range.clone()].to_vec(),
                        MinerLossType::Localization => loc_host[range.clone()].to_vec(),
                        MinerLossType::Both => cls_host[range.clone()]
                            .iter()
                            .zip(&loc_host[range.clone()])
                            .map(|(c, l)| {
                                c * config.classification_weight + l * config.localization_weight
                            })
                            .collect(),
                    };
                    let boxes = coder.decode_all(
                        &codes[b * num_anchors * 4..(b + 1) * num_anchors * 4],
                        anchors,
                    );
                    mine_hard_examples(miner, &losses, &boxes, &t.matches)
                })
                .collect();
            let mut mask = vec![0.0f32; batch * num_anchors];
            let mut negatives = 0;
            for (b, (t, kept)) in targets.iter().zip(kept).enumerate() {
                for i in kept {
                    mask[b * num_anchors + i] = 1.0;
                    negatives += usize::from(t.matches[i] == Match::Unmatched);
                }
            }
            (
                Some(Tensor::<B, 2>::from_data(
                    TensorData::new(mask, [batch, num_anchors]),
                    &device,
                )),
                negatives,
            )
        }
    };
    let (cls_sum, loc_sum) = match mask {
        Some(mask) => (
            (cls_per_anchor * mask.clone()).sum(),
            (loc_per_anchor * mask).sum(),
        ),
        None => (cls_per_anchor.sum(), loc_per_anchor.sum()),
    };
    let loc_normalizer = if config.normalize_loc_loss_by_codesize {
        normalizer * BoxCoder::CODE_SIZE as f32
    } else {
        normalizer
    };
    let classification = cls_sum.mul_scalar(config.classification_weight / normalizer);
    let localization = loc_sum.mul_scalar(config.localization_weight / loc_normalizer);
    (classification, localization, num_matches, mined_negatives)
}

fn to_vec<B: Backend, const D: usize>(t: Tensor<B, D>) -> Vec<f32> {
    t.into_data()
        .convert::<f32>()
        .to_vec::<f32>()
        .expect("a float tensor converts to f32")
}

/// Full loss of a batch: forward pass, detection loss and L2 regularisation; its
/// gradients come from [`LossParts::gradients`].
pub fn compute_loss<B: SsdBackend>(
    model: &Ssd<Autodiff<B>>,
    config: &SsdConfig,
    anchors: &[BBox],
    images: Tensor<Autodiff<B>, 4>,
    targets: &[ImageTargets],
) -> LossParts<Autodiff<B>> {
    let predictions = model.forward(images);
    let (classification, localization, num_matches, num_mined_negatives) = detection_loss(
        &config.loss,
        &config.box_coder(),
        anchors,
        &predictions,
        targets,
    );
    let l2_weight = config.loss.l2_weight;
    let regularization =
        Tensor::from_inner(model.valid().l2_half_sum_of_squares().mul_scalar(l2_weight));
    let total = classification.clone() + localization.clone() + regularization.clone();
    LossParts {
        classification,
        localization,
        regularization,
        total,
        num_matches,
        num_mined_negatives,
        l2_weight,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use Match::*;

    fn miner(max_neg_per_pos: usize, min_neg: usize) -> HardExampleMinerConfig {
        HardExampleMinerConfig {
            num_hard_examples: 100,
            iou_threshold: 0.5,
            loss_type: MinerLossType::Classification,
            max_negatives_per_positive: max_neg_per_pos,
            min_negatives_per_image: min_neg,
        }
    }

    /// Six anchors: boxes 0 and 1 overlap (IoU 0.9), the rest are apart.
    fn case() -> (Vec<BBox>, Vec<f32>, Vec<Match>) {
        let boxes = vec![
            BBox::new(0.0, 0.0, 1.0, 1.0),
            BBox::new(0.0, 0.0, 1.0, 0.9),
            BBox::new(2.0, 0.0, 3.0, 1.0),
            BBox::new(4.0, 0.0, 5.0, 1.0),
            BBox::new(6.0, 0.0, 7.0, 1.0),
            BBox::new(8.0, 0.0, 9.0, 1.0),
        ];
        let losses = vec![0.9, 0.95, 0.1, 0.8, 0.7, 0.3];
        let matches = vec![
            Unmatched,
            Unmatched,
            Matched(0),
            Unmatched,
            Ignored,
            Unmatched,
        ];
        (boxes, losses, matches)
    }

    #[test]
    fn miner_hand_case() {
        let (boxes, losses, matches) = case();
        // NMS order: 1 (0.95), [0 suppressed by 1], 3 (0.8), 4 (0.7), 5 (0.3), 2 (0.1)
        // one positive -> at most 2 negatives: 1, 3; the ignored anchor 4 comes while the
        // negative count is still 2 <= 2 and is kept, as the API's cumsum rule does; 5 is the
        // third negative and dropped; the positive 2 is kept.
        assert_eq!(
            mine_hard_examples(&miner(2, 0), &losses, &boxes, &matches),
            vec![1, 3, 4, 2]
        );
        // min_negatives_per_image raises the quota
        assert_eq!(
            mine_hard_examples(&miner(1, 3), &losses, &boxes, &matches),
            vec![1, 3, 4, 5, 2]
        );
        // ratio disabled: everything NMS keeps
        assert_eq!(
            mine_hard_examples(&miner(0, 0), &losses, &boxes, &matches),
            vec![1, 3, 4, 5, 2]
        );
        // num_hard_examples caps the NMS output first
        let capped = HardExampleMinerConfig {
            num_hard_examples: 2,
            ..miner(3, 0)
        };
        assert!(mine_hard_examples(&capped, &losses, &boxes, &matches).is_empty());
    }

    fn targets_with_class(class: usize) -> ImageTargets {
        ImageTargets {
            matches: vec![Matched(0), Unmatched],
            class_ids: vec![class, 0],
            class_weights: vec![1.0; 2],
            box_codes: vec![[0.0; 4]; 2],
            box_weights: vec![1.0, 0.0],
        }
    }

    #[test]
    fn one_hot_targets_stay_in_their_anchor_row() {
        let flat = flatten_targets(&[targets_with_class(2)], 2);
        assert_eq!(flat.labels, vec![0.0, 0.0, 1.0, 1.0, 0.0, 0.0]);
    }

    #[test]
    #[should_panic(expected = "class id 3 above num_classes 2 in the targets")]
    fn a_class_id_above_num_classes_is_refused() {
        flatten_targets(&[targets_with_class(3)], 2);
    }

    #[test]
    fn miner_without_positives_keeps_no_negatives() {
        let (boxes, losses, _) = case();
        let matches = vec![Unmatched; 6];
        assert!(mine_hard_examples(&miner(3, 0), &losses, &boxes, &matches).is_empty());
    }

    /// The gradients with the L2 term added outside the graph equal Burn's differentiation
    /// of the whole loss with the term inside it, for every parameter.
    #[test]
    fn gradients_equal_differentiating_the_l2_term_in_the_graph() {
        use crate::targets::{GroundTruth, assign_targets};
        use burn::backend::Flex;
        use burn::module::{Module, ModuleVisitor, Param};
        type A = Autodiff<Flex>;

        let mut config = SsdConfig {
            num_classes: 2,
            image_size: [64, 64],
            depth_multiplier: 0.25,
            ..Default::default()
        };
        // large enough that the L2 gradient is a large part of every kernel's gradient
        config.loss.l2_weight = 20.0;
        let device = Default::default();
        let net = config.init::<A>(7, &device).unwrap();
        let anchors = crate::ssd::anchors(&config);
        let gt = [GroundTruth {
            bbox: BBox::new(0.2, 0.3, 0.7, 0.9),
            class_id: 1,
        }];
        let targets = [assign_targets(
            &config.matcher,
            &config.box_coder(),
            &anchors,
            &gt,
        )];
        let images = crate::test_data::uniform::<A, 4>([1, 3, 64, 64], (0.0, 1.0), 3, &device);
        let loss = || compute_loss(&net, &config, &anchors, images.clone(), &targets);

        let ours = loss().gradients(&net);
        let differentiate = |with_l2: bool| {
            let parts = loss();
            let mut total = parts.classification + parts.localization;
            if with_l2 {
                total = total + net.l2_half_sum_of_squares().mul_scalar(20.0);
            }
            GradientsParams::from_grads(total.backward(), &net)
        };
        let reference = differentiate(true);
        let detection_only = differentiate(false);

        /// Largest difference of `ours` from `reference` and from `detection_only` over
        /// every parameter, relative to the parameter's largest reference gradient.
        struct Compare<'a> {
            grads: [&'a GradientsParams; 3],
            worst: f32,
            l2_share: f32,
            params: usize,
        }
        impl ModuleVisitor<A> for Compare<'_> {
            fn visit_float<const D: usize>(&mut self, param: &Param<Tensor<A, D>>) {
                let [ours, reference, detection] = self.grads.map(|g| {
                    g.get::<Flex, D>(param.id)
                        .map(|t| t.into_data().to_vec::<f32>().expect("f32"))
                });
                // BatchNorm's moving statistics have no gradient in any of the three
                let (Some(ours), Some(reference), Some(detection)) = (ours, reference, detection)
                else {
                    return;
                };
                let scale = reference.iter().fold(1e-12f32, |m, v| m.max(v.abs()));
                let diff = |a: &[f32], b: &[f32]| {
                    a.iter()
                        .zip(b)
                        .fold(0.0f32, |m, (x, y)| m.max((x - y).abs()))
                        / scale
                };
                self.worst = self.worst.max(diff(&ours, &reference));
                if D == 4 {
                    self.l2_share = self.l2_share.min(diff(&ours, &detection));
                }
                self.params += 1;
            }
        }
        let mut compare = Compare {
            grads: [&ours, &reference, &detection_only],
            worst: 0.0,
            l2_share: f32::MAX,
            params: 0,
        };
        net.visit(&mut compare);
        assert!(compare.params > 50, "{} parameters", compare.params);
        assert!(compare.worst < 1e-5, "largest difference {}", compare.worst);
        // the L2 term changes every kernel's gradient
        assert!(
            compare.l2_share > 1e-3,
            "smallest L2 part {}",
            compare.l2_share
        );
    }
}
