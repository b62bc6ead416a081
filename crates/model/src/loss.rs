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
    /// two cores).
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

/// Values per anchor in [`PackedTargets`]: class id, class weight, four box codes, box
/// weight.
const PACKED: usize = 7;

/// A batch's targets as one host buffer, uploaded in one transfer: per anchor the values of
/// [`PACKED`]. The class ids travel as floats (exact up to 2^24) and become one-hot labels on
/// the device, so the `[batch, anchors, classes]` labels never cross from the host.
struct PackedTargets {
    values: Vec<f32>,
    /// Matched anchors (box weight above 0) over the batch.
    num_matches: usize,
    /// Sum of the box weights.
    box_weight_sum: f32,
}

fn pack_targets(targets: &[ImageTargets], num_classes: usize) -> PackedTargets {
    let anchors = targets.first().map_or(0, |t| t.class_ids.len());
    let mut out = PackedTargets {
        values: Vec::with_capacity(targets.len() * anchors * PACKED),
        num_matches: 0,
        box_weight_sum: 0.0,
    };
    for t in targets {
        for (a, &id) in t.class_ids.iter().enumerate() {
            // a larger id would mark no class (or, before the labels were made on the
            // device, the next anchor's); the data loader refuses labels outside
            // 1..=num_classes naming the record, so one here is a caller's bug
            assert!(
                id <= num_classes,
                "class id {id} above num_classes {num_classes} in the targets"
            );
            let box_weight = t.box_weights[a];
            out.values.extend([id as f32, t.class_weights[a]]);
            out.values.extend(t.box_codes[a]);
            out.values.push(box_weight);
            out.num_matches += usize::from(box_weight > 0.0);
            out.box_weight_sum += box_weight;
        }
    }
    out
}

/// The device side of [`PackedTargets`]: `(labels [batch, anchors, classes] one-hot,
/// class weights [batch, anchors], box codes [batch, anchors, 4], box weights)`.
fn unpack_targets<B: Backend>(
    packed: Tensor<B, 3>,
    classes: usize,
) -> (Tensor<B, 3>, Tensor<B, 2>, Tensor<B, 3>, Tensor<B, 2>) {
    let [batch, anchors, _] = packed.dims();
    let column = |from: usize| packed.clone().narrow(2, from, 1).reshape([batch, anchors]);
    // the class index of each label column, made on the device: 0, 1, ... (exact in f32)
    let positions = Tensor::<B, 3>::ones([1, 1, classes], &packed.device())
        .cumsum(2)
        .sub_scalar(1.0)
        .expand([batch, anchors, classes]);
    let ids = packed
        .clone()
        .narrow(2, 0, 1)
        .expand([batch, anchors, classes]);
    let labels = positions.equal(ids).float();
    (labels, column(1), packed.clone().narrow(2, 2, 4), column(6))
}

/// Indices of the anchors hard example mining keeps in each image, and the negatives among
/// them over the batch. What the miner reads (each anchor's mining loss and box encoding)
/// comes back from the device in one transfer.
fn mine_batch<B: Backend>(
    (config, miner): (&LossConfig, &HardExampleMinerConfig),
    coder: &BoxCoder,
    anchors: &[BBox],
    [cls_per_anchor, loc_per_anchor]: [Tensor<B, 2>; 2],
    box_encodings: Tensor<B, 3>,
    targets: &[ImageTargets],
) -> (Vec<f32>, usize) {
    let [batch, num_anchors, _] = box_encodings.dims();
    let losses = match miner.loss_type {
        MinerLossType::Classification => cls_per_anchor,
        MinerLossType::Localization => loc_per_anchor,
        MinerLossType::Both => {
            cls_per_anchor.mul_scalar(config.classification_weight)
                + loc_per_anchor.mul_scalar(config.localization_weight)
        }
    };
    let codes = box_encodings.reshape([batch, num_anchors * 4]);
    let host = to_vec(Tensor::cat(vec![losses, codes], 1));
    let row = num_anchors * 5;
    // images mined in parallel
    let kept: Vec<Vec<usize>> = targets
        .par_iter()
        .enumerate()
        .map(|(b, t)| {
            let (losses, codes) = host[b * row..(b + 1) * row].split_at(num_anchors);
            let boxes = coder.decode_all(codes, anchors);
            mine_hard_examples(miner, losses, &boxes, &t.matches)
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
    (mask, negatives)
}

/// Classification and localization loss of a batch of predictions against its targets.
/// Returns `(classification, localization, num_matches, num_mined_negatives)`. Crossing
/// between host and device: the targets go up in one transfer; with hard example mining,
/// what the miner reads comes down in one and the kept anchors go up in one.
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
    let packed = pack_targets(targets, classes_bg - 1);
    let num_matches = packed.num_matches;
    let normalizer = if config.normalize_loss_by_num_matches {
        packed.box_weight_sum.max(1.0)
    } else {
        1.0
    };
    let packed = Tensor::<B, 3>::from_data(
        TensorData::new(packed.values, [batch, num_anchors, PACKED]),
        &device,
    );
    let (labels, class_weights, box_codes, box_weights) = unpack_targets(packed, classes_bg);

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
            let (mask, negatives) = mine_batch(
                (config, miner),
                coder,
                anchors,
                [
                    cls_per_anchor.clone().detach(),
                    loc_per_anchor.clone().detach(),
                ],
                predictions.box_encodings.clone().detach(),
                targets,
            );
            let mask = TensorData::new(mask, [batch, num_anchors]);
            (Some(Tensor::<B, 2>::from_data(mask, &device)), negatives)
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
    compute_step_loss(model, config, anchors, images, targets, true)
}

/// [`compute_loss`] for a training step, which forms the L2 term's value only where
/// `l2_value` is set (a step that reads its loss): the term is outside the gradients' graph
/// ([`LossParts::gradients`] adds its gradient), and its value is a reduction and an
/// addition per kernel, about 190 kernel launches of the pets step on a GPU. Without it,
/// `regularization` is zero and `total` the sum of the other two parts.
pub fn compute_step_loss<B: SsdBackend>(
    model: &Ssd<Autodiff<B>>,
    config: &SsdConfig,
    anchors: &[BBox],
    images: Tensor<Autodiff<B>, 4>,
    targets: &[ImageTargets],
    l2_value: bool,
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
    let data_loss = classification.clone() + localization.clone();
    let (regularization, total) = if l2_value {
        let value = model.valid().l2_half_sum_of_squares().mul_scalar(l2_weight);
        let value = Tensor::from_inner(value);
        (value.clone(), data_loss + value)
    } else {
        // uploaded, not filled: no kernel
        let zero = Tensor::from_floats([0.0], &data_loss.device());
        (zero, data_loss)
    };
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

    /// The packed targets become one-hot labels on the device, each in its anchor's row, and
    /// the weights and codes land in their own columns.
    #[test]
    fn packed_targets_unpack_into_labels_weights_and_codes() {
        use burn::backend::Flex;
        let mut targets = targets_with_class(2);
        targets.box_codes[0] = [0.5, -1.0, 2.0, 0.25];
        targets.class_weights[1] = 0.5;
        let packed = pack_targets(&[targets], 2);
        assert_eq!((packed.num_matches, packed.box_weight_sum), (1, 1.0));
        let data = TensorData::new(packed.values, [1, 2, PACKED]);
        let packed = Tensor::<Flex, 3>::from_data(data, &Default::default());
        let (labels, class_weights, codes, box_weights) = unpack_targets(packed, 3);
        assert_eq!(to_vec(labels), vec![0.0, 0.0, 1.0, 1.0, 0.0, 0.0]);
        assert_eq!(to_vec(class_weights), vec![1.0, 0.5]);
        assert_eq!(
            to_vec(codes),
            vec![0.5, -1.0, 2.0, 0.25, 0.0, 0.0, 0.0, 0.0]
        );
        assert_eq!(to_vec(box_weights), vec![1.0, 0.0]);
    }

    #[test]
    #[should_panic(expected = "class id 3 above num_classes 2 in the targets")]
    fn a_class_id_above_num_classes_is_refused() {
        pack_targets(&[targets_with_class(3)], 2);
    }

    #[test]
    fn miner_without_positives_keeps_no_negatives() {
        let (boxes, losses, _) = case();
        let matches = vec![Unmatched; 6];
        assert!(mine_hard_examples(&miner(3, 0), &losses, &boxes, &matches).is_empty());
    }

    type A = Autodiff<burn::backend::Flex>;

    /// A small network (L2 weight 20: large enough that the L2 gradient is a large part of
    /// every kernel's gradient), its anchors, one image and its targets.
    struct Case {
        config: SsdConfig,
        net: Ssd<A>,
        anchors: Vec<BBox>,
        images: Tensor<A, 4>,
        targets: Vec<ImageTargets>,
    }

    fn small_case() -> Case {
        use crate::targets::{GroundTruth, assign_targets};
        let mut config = SsdConfig {
            num_classes: 2,
            image_size: [64, 64],
            depth_multiplier: 0.25,
            ..Default::default()
        };
        config.loss.l2_weight = 20.0;
        let device = Default::default();
        let net = config.init::<A>(7, &device).unwrap();
        let anchors = crate::ssd::anchors(&config);
        let gt = [GroundTruth {
            bbox: BBox::new(0.2, 0.3, 0.7, 0.9),
            class_id: 1,
        }];
        let targets = vec![assign_targets(
            &config.matcher,
            &config.box_coder(),
            &anchors,
            &gt,
        )];
        let images = crate::test_data::uniform::<A, 4>([1, 3, 64, 64], (0.0, 1.0), 3, &device);
        Case {
            config,
            net,
            anchors,
            images,
            targets,
        }
    }

    fn values<B: Backend, const D: usize>(t: Tensor<B, D>) -> Vec<f32> {
        t.into_data().to_vec::<f32>().expect("f32")
    }

    /// A step that does not read its loss skips the L2 value: the same gradients, a zero
    /// `regularization` and a `total` of the other two parts.
    #[test]
    fn a_step_without_the_l2_value_has_the_same_gradients() {
        use burn::module::{Module, ModuleVisitor, Param};
        let case = small_case();
        let net = &case.net;
        let step = |l2_value| {
            let images = case.images.clone();
            compute_step_loss(
                net,
                &case.config,
                &case.anchors,
                images,
                &case.targets,
                l2_value,
            )
        };
        let (full, skipped) = (step(true), step(false));
        assert!(values(full.regularization.clone())[0] > 0.0);
        assert_eq!(values(skipped.regularization.clone()), [0.0]);
        let data_loss = full.classification.clone() + full.localization.clone();
        assert_eq!(values(skipped.total.clone()), values(data_loss));
        struct Same<'a>([&'a GradientsParams; 2], usize);
        impl ModuleVisitor<A> for Same<'_> {
            fn visit_float<const D: usize>(&mut self, param: &Param<Tensor<A, D>>) {
                let [a, b] = self.0.map(|g| g.get::<burn::backend::Flex, D>(param.id));
                if let (Some(a), Some(b)) = (a, b) {
                    assert_eq!(values(a), values(b), "gradient of {}", param.id);
                    self.1 += 1;
                }
            }
        }
        let grads = [full.gradients(net), skipped.gradients(net)];
        let mut same = Same([&grads[0], &grads[1]], 0);
        net.visit(&mut same);
        assert!(same.1 > 50, "{} gradients compared", same.1);
    }

    /// The gradients with the L2 term added outside the graph equal Burn's differentiation
    /// of the whole loss with the term inside it, for every parameter.
    #[test]
    fn gradients_equal_differentiating_the_l2_term_in_the_graph() {
        use burn::backend::Flex;
        use burn::module::{Module, ModuleVisitor, Param};
        let Case {
            config,
            net,
            anchors,
            images,
            targets,
        } = small_case();
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
