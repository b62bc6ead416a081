//! Detection metrics: the twelve COCO numbers exactly as pycocotools computes them
//! (`COCOeval` for boxes: greedy matching per IoU threshold, 101-point interpolated precision,
//! area ranges and max-detection limits), and PASCAL VOC AP@0.5 per class as the API's
//! `PascalDetectionEvaluator` (difficult boxes ignored, all-point interpolation).

use std::collections::BTreeMap;

use model::BBox;
use serde::Serialize;

/// A ground-truth box in pixels.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct GtBox {
    /// Box in pixels.
    pub bbox: BBox,
    /// Class id.
    pub class_id: usize,
    /// PASCAL "difficult" (ignored by the VOC metric).
    pub difficult: bool,
    /// COCO `iscrowd`: a region of many objects. The COCO metric ignores the detections it
    /// holds, as pycocotools does: their overlap with it is the intersection over the
    /// detection's own area, and any number of them may match it.
    pub crowd: bool,
}

/// A detection in pixels.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct DetBox {
    /// Box in pixels.
    pub bbox: BBox,
    /// Class id.
    pub class_id: usize,
    /// Score.
    pub score: f32,
}

/// One image's ground truth and detections.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct ImageResult {
    /// Ground truth.
    pub ground_truth: Vec<GtBox>,
    /// Detections.
    pub detections: Vec<DetBox>,
}

/// All metrics of an evaluation.
#[derive(Debug, Clone, PartialEq, Serialize)]
#[allow(non_snake_case)]
pub struct Metrics {
    /// AP at IoU 0.50:0.95, all areas, 100 detections.
    pub AP: f64,
    /// AP at IoU 0.50.
    pub AP50: f64,
    /// AP at IoU 0.75.
    pub AP75: f64,
    /// AP of small objects (area < 32^2).
    pub APs: f64,
    /// AP of medium objects.
    pub APm: f64,
    /// AP of large objects (area > 96^2).
    pub APl: f64,
    /// AR with 1 detection per image.
    pub AR1: f64,
    /// AR with 10.
    pub AR10: f64,
    /// AR with 100.
    pub AR100: f64,
    /// AR of small objects.
    pub ARs: f64,
    /// AR of medium objects.
    pub ARm: f64,
    /// AR of large objects.
    pub ARl: f64,
    /// Mean of the per-class VOC APs (classes with ground truth).
    pub voc_mAP: f64,
    /// VOC AP@0.5 per class name.
    pub voc_AP: BTreeMap<String, f64>,
}

/// Names of the twelve COCO numbers, in pycocotools' order (that of [`Metrics::coco`]).
pub const COCO_NAMES: [&str; 12] = [
    "AP", "AP50", "AP75", "APs", "APm", "APl", "AR1", "AR10", "AR100", "ARs", "ARm", "ARl",
];

impl Metrics {
    /// The twelve COCO numbers in pycocotools' order.
    pub fn coco(&self) -> [f64; 12] {
        [
            self.AP, self.AP50, self.AP75, self.APs, self.APm, self.APl, self.AR1, self.AR10,
            self.AR100, self.ARs, self.ARm, self.ARl,
        ]
    }
}

const AREAS: [(f32, f32); 4] = [(0.0, 1e10), (0.0, 1024.0), (1024.0, 9216.0), (9216.0, 1e10)];
const MAX_DETS: [usize; 3] = [1, 10, 100];

fn iou_thresholds() -> Vec<f64> {
    (0..10).map(|i| 0.5 + 0.05 * i as f64).collect()
}

/// `evaluateImg` of one image, category and area range.
struct ImageEval {
    scores: Vec<f32>,
    /// `[threshold][detection]` matched.
    matched: Vec<Vec<bool>>,
    /// `[threshold][detection]` ignored.
    ignored: Vec<Vec<bool>>,
    gt_ignored: Vec<bool>,
}

fn evaluate_image(
    gts: &[&GtBox],
    dets: &[&DetBox],
    area: (f32, f32),
    thresholds: &[f64],
) -> Option<ImageEval> {
    if gts.is_empty() && dets.is_empty() {
        return None;
    }
    let outside = |b: &BBox| b.area() < area.0 || b.area() > area.1;
    // non-ignored ground truth first (stable)
    let mut gts: Vec<(&GtBox, bool)> = gts
        .iter()
        .map(|g| (*g, g.crowd || outside(&g.bbox)))
        .collect();
    gts.sort_by_key(|(_, ig)| *ig);
    let mut dets: Vec<&DetBox> = dets.to_vec();
    dets.sort_by(|a, b| b.score.total_cmp(&a.score));
    dets.truncate(MAX_DETS[2]);
    let mut matched = vec![vec![false; dets.len()]; thresholds.len()];
    let mut ignored = vec![vec![false; dets.len()]; thresholds.len()];
    for (t, &thr) in thresholds.iter().enumerate() {
        let mut gt_taken = vec![false; gts.len()];
        for (d, det) in dets.iter().enumerate() {
            let mut best = thr.min(1.0 - 1e-10);
            let mut m: Option<usize> = None;
            for (g, (gt, g_ignored)) in gts.iter().enumerate() {
                if gt_taken[g] && !gt.crowd {
                    continue;
                }
                if let Some(prev) = m
                    && !gts[prev].1
                    && *g_ignored
                {
                    break;
                }
                let iou = match gt.crowd {
                    true => {
                        det.bbox.intersection(&gt.bbox) / det.bbox.area().max(f32::MIN_POSITIVE)
                    }
                    false => det.bbox.iou(&gt.bbox),
                } as f64;
                if iou < best {
                    continue;
                }
                best = iou;
                m = Some(g);
            }
            if let Some(g) = m {
                ignored[t][d] = gts[g].1;
                matched[t][d] = true;
                gt_taken[g] = true;
            }
        }
        for (d, det) in dets.iter().enumerate() {
            if !matched[t][d] && outside(&det.bbox) {
                ignored[t][d] = true;
            }
        }
    }
    Some(ImageEval {
        scores: dets.iter().map(|d| d.score).collect(),
        matched,
        ignored,
        gt_ignored: gts.iter().map(|(_, ig)| *ig).collect(),
    })
}

/// `(precision at 101 recall points, final recall)` per threshold, or `None` without ground truth.
fn accumulate(
    evals: &[&ImageEval],
    max_det: usize,
    thresholds: usize,
) -> Option<Vec<(Vec<f64>, f64)>> {
    let npig = evals
        .iter()
        .flat_map(|e| &e.gt_ignored)
        .filter(|ig| !**ig)
        .count();
    if npig == 0 {
        return None;
    }
    let mut entries: Vec<(f32, usize, usize)> = Vec::new(); // (score, image, detection)
    for (i, e) in evals.iter().enumerate() {
        for d in 0..e.scores.len().min(max_det) {
            entries.push((e.scores[d], i, d));
        }
    }
    entries.sort_by(|a, b| b.0.total_cmp(&a.0));
    let rec_thresholds: Vec<f64> = (0..=100).map(|i| i as f64 / 100.0).collect();
    Some(
        (0..thresholds)
            .map(|t| {
                let (mut tp, mut fp) = (0f64, 0f64);
                let mut recall = Vec::new();
                let mut precision = Vec::new();
                for &(_, i, d) in &entries {
                    let e = evals[i];
                    if e.ignored[t][d] {
                        continue;
                    }
                    if e.matched[t][d] {
                        tp += 1.0;
                    } else {
                        fp += 1.0;
                    }
                    recall.push(tp / npig as f64);
                    precision.push(tp / (tp + fp + f64::EPSILON));
                }
                let final_recall = recall.last().copied().unwrap_or(0.0);
                for i in (1..precision.len()).rev() {
                    if precision[i] > precision[i - 1] {
                        precision[i - 1] = precision[i];
                    }
                }
                let q = rec_thresholds
                    .iter()
                    .map(|&r| {
                        let idx = recall.partition_point(|&x| x < r);
                        precision.get(idx).copied().unwrap_or(0.0)
                    })
                    .collect();
                (q, final_recall)
            })
            .collect(),
    )
}

fn mean(values: &[f64]) -> f64 {
    let v: Vec<f64> = values.iter().copied().filter(|x| *x > -1.0).collect();
    if v.is_empty() {
        -1.0
    } else {
        v.iter().sum::<f64>() / v.len() as f64
    }
}

/// The twelve COCO box metrics over `images` for the classes `class_ids`.
pub fn coco_metrics(images: &[ImageResult], class_ids: &[usize]) -> [f64; 12] {
    let thresholds = iou_thresholds();
    // results[area][max_det] -> per (threshold, class): precision vectors and recall
    let mut ap = vec![vec![Vec::<(usize, Vec<f64>)>::new(); MAX_DETS.len()]; AREAS.len()];
    let mut ar = vec![vec![Vec::<(usize, f64)>::new(); MAX_DETS.len()]; AREAS.len()];
    for &class in class_ids {
        for (a, &area) in AREAS.iter().enumerate() {
            let evals: Vec<ImageEval> = images
                .iter()
                .filter_map(|im| {
                    let gts: Vec<&GtBox> = im
                        .ground_truth
                        .iter()
                        .filter(|g| g.class_id == class)
                        .collect();
                    let dets: Vec<&DetBox> = im
                        .detections
                        .iter()
                        .filter(|d| d.class_id == class)
                        .collect();
                    evaluate_image(&gts, &dets, area, &thresholds)
                })
                .collect();
            let refs: Vec<&ImageEval> = evals.iter().collect();
            for (m, &max_det) in MAX_DETS.iter().enumerate() {
                if let Some(per_t) = accumulate(&refs, max_det, thresholds.len()) {
                    for (t, (q, r)) in per_t.into_iter().enumerate() {
                        ap[a][m].push((t, q));
                        ar[a][m].push((t, r));
                    }
                }
            }
        }
    }
    let ap_of = |a: usize, m: usize, t: Option<usize>| {
        let vals: Vec<f64> = ap[a][m]
            .iter()
            .filter(|(ti, _)| t.is_none_or(|t| *ti == t))
            .flat_map(|(_, q)| q.iter().copied())
            .collect();
        mean(&vals)
    };
    let ar_of = |a: usize, m: usize| {
        let vals: Vec<f64> = ar[a][m].iter().map(|(_, r)| *r).collect();
        mean(&vals)
    };
    [
        ap_of(0, 2, None),
        ap_of(0, 2, Some(0)),
        ap_of(0, 2, Some(5)),
        ap_of(1, 2, None),
        ap_of(2, 2, None),
        ap_of(3, 2, None),
        ar_of(0, 0),
        ar_of(0, 1),
        ar_of(0, 2),
        ar_of(1, 2),
        ar_of(2, 2),
        ar_of(3, 2),
    ]
}

/// PASCAL VOC AP at IoU 0.5 for one class; `None` when the class has no (non-difficult)
/// ground truth.
pub fn voc_average_precision(images: &[ImageResult], class: usize) -> Option<f64> {
    let mut scored: Vec<(f32, bool)> = Vec::new();
    let mut num_gt = 0;
    for im in images {
        let gts: Vec<&GtBox> = im
            .ground_truth
            .iter()
            .filter(|g| g.class_id == class)
            .collect();
        num_gt += gts.iter().filter(|g| !g.difficult).count();
        let mut dets: Vec<&DetBox> = im
            .detections
            .iter()
            .filter(|d| d.class_id == class)
            .collect();
        dets.sort_by(|a, b| b.score.total_cmp(&a.score));
        let mut detected = vec![false; gts.len()];
        for d in dets {
            let best = gts
                .iter()
                .enumerate()
                .map(|(g, gt)| (g, d.bbox.iou(&gt.bbox)))
                .fold(None::<(usize, f32)>, |acc, x| match acc {
                    Some(a) if a.1 >= x.1 => Some(a),
                    _ => Some(x),
                });
            match best {
                Some((g, iou)) if iou >= 0.5 => {
                    if gts[g].difficult {
                        continue; // matched to a difficult box: ignored
                    }
                    scored.push((d.score, !detected[g]));
                    detected[g] = true;
                }
                _ => scored.push((d.score, false)),
            }
        }
    }
    if num_gt == 0 {
        return None;
    }
    scored.sort_by(|a, b| b.0.total_cmp(&a.0));
    let mut recall = vec![0.0];
    let mut precision = vec![0.0];
    let (mut tp, mut fp) = (0.0, 0.0);
    for (_, is_tp) in &scored {
        if *is_tp {
            tp += 1.0;
        } else {
            fp += 1.0;
        }
        recall.push(tp / num_gt as f64);
        precision.push(tp / (tp + fp));
    }
    recall.push(1.0);
    precision.push(0.0);
    for i in (0..precision.len() - 1).rev() {
        precision[i] = precision[i].max(precision[i + 1]);
    }
    Some(
        (1..recall.len())
            .filter(|&i| recall[i] != recall[i - 1])
            .map(|i| (recall[i] - recall[i - 1]) * precision[i])
            .sum(),
    )
}

/// All metrics; `class_names[i]` names class id `i + 1`.
pub fn evaluate(images: &[ImageResult], class_names: &[String]) -> Metrics {
    let ids: Vec<usize> = (1..=class_names.len()).collect();
    let c = coco_metrics(images, &ids);
    let mut voc_ap = BTreeMap::new();
    for (i, name) in class_names.iter().enumerate() {
        if let Some(ap) = voc_average_precision(images, i + 1) {
            voc_ap.insert(name.clone(), ap);
        }
    }
    let voc_map = if voc_ap.is_empty() {
        f64::NAN
    } else {
        voc_ap.values().sum::<f64>() / voc_ap.len() as f64
    };
    Metrics {
        AP: c[0],
        AP50: c[1],
        AP75: c[2],
        APs: c[3],
        APm: c[4],
        APl: c[5],
        AR1: c[6],
        AR10: c[7],
        AR100: c[8],
        ARs: c[9],
        ARm: c[10],
        ARl: c[11],
        voc_mAP: voc_map,
        voc_AP: voc_ap,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn gt(y: f32, x: f32, s: f32, class_id: usize) -> GtBox {
        GtBox {
            bbox: BBox::new(y, x, y + s, x + s),
            class_id,
            difficult: false,
            crowd: false,
        }
    }
    fn det(y: f32, x: f32, s: f32, class_id: usize, score: f32) -> DetBox {
        DetBox {
            bbox: BBox::new(y, x, y + s, x + s),
            class_id,
            score,
        }
    }

    #[test]
    fn perfect_detections_score_one() {
        let images = vec![ImageResult {
            ground_truth: vec![gt(0.0, 0.0, 50.0, 1), gt(100.0, 100.0, 120.0, 2)],
            detections: vec![
                det(0.0, 0.0, 50.0, 1, 0.9),
                det(100.0, 100.0, 120.0, 2, 0.8),
            ],
        }];
        let m = evaluate(&images, &["cat".into(), "dog".into()]);
        // precision is tp / (tp + fp + eps) as in pycocotools
        let one = |v: f64| (v - 1.0).abs() < 1e-12;
        assert!(one(m.AP) && one(m.AP50) && one(m.AP75), "{m:?}");
        // no small objects: -1 as pycocotools prints
        assert_eq!(m.APs, -1.0);
        assert!(one(m.APm) && one(m.APl));
        assert!(one(m.AR1) && one(m.AR10) && one(m.AR100));
        assert_eq!(m.voc_mAP, 1.0);
    }

    /// One class, two ground-truth boxes, three detections: a hit (0.9), a false positive
    /// (0.8), then a hit (0.7). Precision/recall points: (1, 0.5), (0.5, 0.5), (2/3, 1).
    #[test]
    fn hand_case_with_a_false_positive() {
        let images = vec![ImageResult {
            ground_truth: vec![gt(0.0, 0.0, 100.0, 1), gt(200.0, 200.0, 100.0, 1)],
            detections: vec![
                det(0.0, 0.0, 100.0, 1, 0.9),
                det(500.0, 500.0, 100.0, 1, 0.8),
                det(200.0, 200.0, 100.0, 1, 0.7),
            ],
        }];
        // VOC all-point: envelope precision 1 up to recall 0.5, 2/3 up to 1 -> 0.5 + 1/3
        let ap = voc_average_precision(&images, 1).unwrap();
        assert!((ap - (0.5 + 1.0 / 3.0)).abs() < 1e-9, "{ap}");
        // COCO 101 points: recall thresholds 0..0.5 (51 points) -> 1, 0.51..1 (50) -> 2/3
        let c = coco_metrics(&images, &[1]);
        let expect = (51.0 + 50.0 * 2.0 / 3.0) / 101.0;
        assert!((c[1] - expect).abs() < 1e-9, "{}", c[1]);
        assert!(
            (c[0] - c[1]).abs() < 1e-12,
            "exact boxes: every IoU threshold gives the same"
        );
        // one detection per image: recall 0.5; ten: 1
        assert_eq!((c[6], c[7]), (0.5, 1.0));
    }

    #[test]
    fn iou_thresholds_and_difficult_boxes() {
        // detection shifted so that IoU = 80 * 100 / (2 * 10000 - 8000) = 2/3
        let images = vec![ImageResult {
            ground_truth: vec![
                gt(0.0, 0.0, 100.0, 1),
                GtBox {
                    difficult: true,
                    ..gt(300.0, 300.0, 50.0, 1)
                },
            ],
            detections: vec![
                DetBox {
                    bbox: BBox::new(0.0, 20.0, 100.0, 120.0),
                    class_id: 1,
                    score: 0.9,
                },
                det(300.0, 300.0, 50.0, 1, 0.95),
            ],
        }];
        // VOC: the detection on the difficult box is ignored; the other is a hit at IoU 0.67
        assert_eq!(voc_average_precision(&images, 1), Some(1.0));
        // COCO does not ignore difficult boxes: 2 ground truths. At IoU 0.5-0.65 both
        // detections hit (AP 1); from 0.7 on only the exact one (recall 0.5, precision 1).
        let c = coco_metrics(&images, &[1]);
        let at_high = 51.0 / 101.0;
        let expect = (4.0 + 6.0 * at_high) / 10.0;
        assert!((c[0] - expect).abs() < 1e-9, "{} vs {expect}", c[0]);
        assert!((c[1] - 1.0).abs() < 1e-12);
        assert!((c[2] - at_high).abs() < 1e-9);
    }

    #[test]
    fn classes_without_ground_truth_are_left_out() {
        let images = vec![ImageResult {
            ground_truth: vec![gt(0.0, 0.0, 50.0, 1)],
            detections: vec![det(0.0, 0.0, 50.0, 2, 0.9)],
        }];
        let m = evaluate(&images, &["a".into(), "b".into()]);
        assert_eq!(m.voc_AP.len(), 1);
        assert_eq!(m.voc_AP["a"], 0.0);
        assert_eq!(m.AP, 0.0);
    }
}
