//! Detection metrics: the twelve COCO numbers exactly as pycocotools computes them
//! (`COCOeval` for boxes: greedy matching per IoU threshold, 101-point interpolated precision,
//! area ranges and max-detection limits), and PASCAL VOC AP@0.5 per class as the API's
//! `PascalDetectionEvaluator` (difficult boxes ignored, all-point interpolation).
//!
//! The COCO metric computes as pycocotools does, to the last bit: boxes as COCO writes them
//! (`[x, y, width, height]`), areas, scores and IoUs (maskApi's `bbIou`) in f64; a ground
//! truth's area range read from its `area` (a mask's, in COCO's own files), a detection's
//! from its box; the IoU and recall thresholds numpy's `linspace` values; the images visited
//! in the order of their ids, so that detections of equal score rank in that order (a stable
//! sort, as pycocotools' mergesort); the means summed pairwise, as numpy sums. Not followed:
//! pycocotools never counts a match to an annotation of id 0 as a true positive (it records
//! matches by annotation id, 0 meaning none); here every annotation matches alike.

use std::collections::BTreeMap;

use model::BBox;
use serde::Serialize;

/// A box in pixels as COCO writes it, `[x, y, width, height]`, in f64 as pycocotools reads
/// it.
#[derive(Debug, Clone, Copy, PartialEq, Default)]
pub struct CocoBox {
    /// Left edge.
    pub x: f64,
    /// Top edge.
    pub y: f64,
    /// Width.
    pub width: f64,
    /// Height.
    pub height: f64,
}

impl CocoBox {
    /// The box of corners in f32 pixels, as the API's evaluator converts its float32 boxes
    /// (`coco_tools._ConvertBoxToCOCOFormat`): the width and height subtracted in f32, then
    /// widened.
    pub fn from_corners(b: &BBox) -> Self {
        Self {
            x: f64::from(b.xmin),
            y: f64::from(b.ymin),
            width: f64::from(b.xmax - b.xmin),
            height: f64::from(b.ymax - b.ymin),
        }
    }

    /// Width times height: pycocotools' `area` of a detection.
    pub fn area(&self) -> f64 {
        self.width * self.height
    }

    /// The corners in f32 pixels, as training data reads a COCO box (the VOC metric's).
    pub fn corners(&self) -> BBox {
        let (x, y) = (self.x as f32, self.y as f32);
        BBox::new(y, x, y + self.height as f32, x + self.width as f32)
    }

    /// The overlap of this detection with a ground-truth box as maskApi's `bbIou` computes
    /// it: the intersection over the union, or over the detection's own area where the
    /// ground truth is a crowd region; 0 where they do not intersect.
    fn overlap(&self, gt: &CocoBox, crowd: bool) -> f64 {
        let w = (self.width + self.x).min(gt.width + gt.x) - self.x.max(gt.x);
        if w <= 0.0 {
            return 0.0;
        }
        let h = (self.height + self.y).min(gt.height + gt.y) - self.y.max(gt.y);
        if h <= 0.0 {
            return 0.0;
        }
        let i = w * h;
        let u = if crowd {
            self.area()
        } else {
            self.area() + gt.area() - i
        };
        i / u
    }
}

/// A ground-truth box in pixels.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct GtBox {
    /// Corners in f32 pixels (the VOC metric's).
    pub bbox: BBox,
    /// The box the COCO metric matches.
    pub coco_box: CocoBox,
    /// The area the COCO metric's ranges read (small, medium, large): the annotation's
    /// `area`, which in COCO's own files is its mask's, else its box's.
    pub area: f64,
    /// Class id.
    pub class_id: usize,
    /// PASCAL "difficult" (ignored by the VOC metric).
    pub difficult: bool,
    /// COCO `iscrowd`: a region of many objects. The COCO metric ignores the detections it
    /// holds, as pycocotools does: their overlap with it is the intersection over the
    /// detection's own area, and any number of them may match it.
    pub crowd: bool,
}

impl GtBox {
    /// A box of corners in f32 pixels (a record's), with the area a record gives for it:
    /// used where above 0, else the box's own (in f32), as the API's evaluator takes it.
    pub fn from_corners(
        bbox: BBox,
        area: Option<f32>,
        class_id: usize,
        difficult: bool,
        crowd: bool,
    ) -> Self {
        let area = area.filter(|a| a.is_finite() && *a > 0.0);
        Self {
            bbox,
            coco_box: CocoBox::from_corners(&bbox),
            area: f64::from(area.unwrap_or_else(|| bbox.area())),
            class_id,
            difficult,
            crowd,
        }
    }
}

/// A detection in pixels.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct DetBox {
    /// Box in f32 pixels (the VOC metric's, and what is drawn).
    pub bbox: BBox,
    /// Class id.
    pub class_id: usize,
    /// Score in f32 (what is drawn).
    pub score: f32,
    /// The box the COCO metric matches (a results file's, in f64).
    pub coco_box: CocoBox,
    /// The score both metrics rank by (a results file's, in f64).
    pub coco_score: f64,
}

impl DetBox {
    /// A detection of the network, its box in f32 pixels.
    pub fn new(bbox: BBox, class_id: usize, score: f32) -> Self {
        Self {
            bbox,
            class_id,
            score,
            coco_box: CocoBox::from_corners(&bbox),
            coco_score: f64::from(score),
        }
    }
}

/// One image's ground truth and detections.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct ImageResult {
    /// The image's id: the COCO metric visits the images in the order of their ids, as
    /// pycocotools does, so that detections of equal score across images rank in that order.
    pub image_id: u64,
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

/// pycocotools' area ranges (all, small, medium, large), compared with `<` and `>`: an area
/// on a limit is in both ranges.
const AREAS: [(f64, f64); 4] = [(0.0, 1e10), (0.0, 1024.0), (1024.0, 9216.0), (9216.0, 1e10)];
const MAX_DETS: [usize; 3] = [1, 10, 100];

/// numpy's `linspace(start, stop, num)`, as pycocotools makes its thresholds: `i * step +
/// start`, the last one `stop` itself (0.85 and 0.9 differ from `0.5 + 0.05 * i` in the last
/// bit, and so do ten of the recall points from `i / 100`).
fn linspace(start: f64, stop: f64, num: usize) -> Vec<f64> {
    let step = (stop - start) / (num - 1) as f64;
    (0..num)
        .map(|i| {
            if i + 1 == num {
                stop
            } else {
                i as f64 * step + start
            }
        })
        .collect()
}

fn iou_thresholds() -> Vec<f64> {
    linspace(0.5, 0.95, 10)
}

fn recall_thresholds() -> Vec<f64> {
    linspace(0.0, 1.0, 101)
}

/// `evaluateImg` of one image, category and area range.
struct ImageEval {
    scores: Vec<f64>,
    /// `[threshold][detection]` matched.
    matched: Vec<Vec<bool>>,
    /// `[threshold][detection]` ignored.
    ignored: Vec<Vec<bool>>,
    gt_ignored: Vec<bool>,
}

/// `evaluateImg` of one image and category in each of the [`AREAS`]; `None` without ground
/// truth and detections.
fn evaluate_image(gts: &[&GtBox], dets: &[&DetBox], thresholds: &[f64]) -> Option<Vec<ImageEval>> {
    if gts.is_empty() && dets.is_empty() {
        return None;
    }
    // the best first (stable: equal scores keep their order), the first 100
    let mut dets: Vec<&DetBox> = dets.to_vec();
    dets.sort_by(|a, b| {
        b.coco_score
            .partial_cmp(&a.coco_score)
            .unwrap_or(std::cmp::Ordering::Equal)
    });
    dets.truncate(MAX_DETS[2]);
    let ious: Vec<Vec<f64>> = dets
        .iter()
        .map(|d| {
            gts.iter()
                .map(|g| d.coco_box.overlap(&g.coco_box, g.crowd))
                .collect()
        })
        .collect();
    let evals = AREAS
        .iter()
        .map(|&(lo, hi)| {
            let outside = |area: f64| area < lo || area > hi;
            // the ground truth not ignored first (stable)
            let mut order: Vec<usize> = (0..gts.len()).collect();
            let ignore: Vec<bool> = gts.iter().map(|g| g.crowd || outside(g.area)).collect();
            order.sort_by_key(|&g| ignore[g]);
            let mut matched = vec![vec![false; dets.len()]; thresholds.len()];
            let mut ignored = vec![vec![false; dets.len()]; thresholds.len()];
            for (t, &thr) in thresholds.iter().enumerate() {
                let mut gt_taken = vec![false; gts.len()];
                for d in 0..dets.len() {
                    let mut best = thr.min(1.0 - 1e-10);
                    let mut m: Option<usize> = None;
                    for &g in &order {
                        if gt_taken[g] && !gts[g].crowd {
                            continue;
                        }
                        // matched to an object: an ignored one cannot replace it
                        if m.is_some_and(|m| !ignore[m]) && ignore[g] {
                            break;
                        }
                        if ious[d][g] < best {
                            continue;
                        }
                        best = ious[d][g];
                        m = Some(g);
                    }
                    if let Some(g) = m {
                        ignored[t][d] = ignore[g];
                        matched[t][d] = true;
                        gt_taken[g] = true;
                    }
                }
                // unmatched detections outside the range are ignored
                for (d, det) in dets.iter().enumerate() {
                    if !matched[t][d] && outside(det.coco_box.area()) {
                        ignored[t][d] = true;
                    }
                }
            }
            ImageEval {
                scores: dets.iter().map(|d| d.coco_score).collect(),
                matched,
                ignored,
                gt_ignored: order.iter().map(|&g| ignore[g]).collect(),
            }
        })
        .collect();
    Some(evals)
}

/// `(precision at the recall points, final recall)` per threshold, or `None` without ground
/// truth that counts.
fn accumulate(
    evals: &[&ImageEval],
    max_det: usize,
    thresholds: usize,
    recall_points: &[f64],
) -> Option<Vec<(Vec<f64>, f64)>> {
    let npig = evals
        .iter()
        .flat_map(|e| &e.gt_ignored)
        .filter(|ig| !**ig)
        .count();
    if npig == 0 {
        return None;
    }
    // (score, image, detection), the images in order: equal scores keep it (stable sort)
    let mut entries: Vec<(f64, usize, usize)> = Vec::new();
    for (i, e) in evals.iter().enumerate() {
        for d in 0..e.scores.len().min(max_det) {
            entries.push((e.scores[d], i, d));
        }
    }
    entries.sort_by(|a, b| b.0.partial_cmp(&a.0).unwrap_or(std::cmp::Ordering::Equal));
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
                let q = recall_points
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

/// numpy's sum of a float64 array (`pairwise_sum`): blocks of up to 128 values summed in
/// eight interleaved partial sums, longer arrays halved (at a multiple of 8) and the halves'
/// sums added.
fn numpy_sum(v: &[f64]) -> f64 {
    let n = v.len();
    if n < 8 {
        v.iter().fold(0.0, |acc, x| acc + x)
    } else if n <= 128 {
        let mut r = [0f64; 8];
        r.copy_from_slice(&v[..8]);
        let whole = n - n % 8;
        for chunk in v[8..whole].chunks_exact(8) {
            for (acc, x) in r.iter_mut().zip(chunk) {
                *acc += x;
            }
        }
        let mut res = ((r[0] + r[1]) + (r[2] + r[3])) + ((r[4] + r[5]) + (r[6] + r[7]));
        for x in &v[whole..] {
            res += x;
        }
        res
    } else {
        let half = n / 2;
        let half = half - half % 8;
        numpy_sum(&v[..half]) + numpy_sum(&v[half..])
    }
}

/// pycocotools' mean of the values above -1 (those of classes with ground truth), in the
/// order given (numpy's C order of the precision or recall array); -1 when there are none.
fn mean(values: impl Iterator<Item = f64>) -> f64 {
    let v: Vec<f64> = values.filter(|x| *x > -1.0).collect();
    if v.is_empty() {
        -1.0
    } else {
        numpy_sum(&v) / v.len() as f64
    }
}

/// The twelve COCO box metrics over `images` for the classes `class_ids` (in ascending
/// order, as pycocotools sorts its category ids).
pub fn coco_metrics(images: &[ImageResult], class_ids: &[usize]) -> [f64; 12] {
    let thresholds = iou_thresholds();
    let recall_points = recall_thresholds();
    let (nt, nr, nk) = (thresholds.len(), recall_points.len(), class_ids.len());
    // the images in the order of their ids (stable: images with the same id keep theirs)
    let mut images: Vec<&ImageResult> = images.iter().collect();
    images.sort_by_key(|im| im.image_id);
    // each image's ground truth and detections by class
    type ByClass<'a> = BTreeMap<usize, (Vec<&'a GtBox>, Vec<&'a DetBox>)>;
    let by_class: Vec<ByClass> = images
        .iter()
        .map(|im| {
            let mut m = ByClass::new();
            for g in &im.ground_truth {
                m.entry(g.class_id).or_default().0.push(g);
            }
            for d in &im.detections {
                m.entry(d.class_id).or_default().1.push(d);
            }
            m
        })
        .collect();
    // precision[area][max_det] as numpy's [threshold][recall point][class] (C order), -1
    // where a class has no ground truth; recall[area][max_det] as [threshold][class]
    let mut precision = vec![vec![vec![-1.0; nt * nr * nk]; MAX_DETS.len()]; AREAS.len()];
    let mut recall = vec![vec![vec![-1.0; nt * nk]; MAX_DETS.len()]; AREAS.len()];
    for (k, class) in class_ids.iter().enumerate() {
        // evals[area]: the images with ground truth or detections of the class, in order
        let mut evals: Vec<Vec<ImageEval>> = (0..AREAS.len()).map(|_| Vec::new()).collect();
        for classes in &by_class {
            let Some((gts, dets)) = classes.get(class) else {
                continue;
            };
            if let Some(per_area) = evaluate_image(gts, dets, &thresholds) {
                for (a, e) in per_area.into_iter().enumerate() {
                    evals[a].push(e);
                }
            }
        }
        for (a, area_evals) in evals.iter().enumerate() {
            let refs: Vec<&ImageEval> = area_evals.iter().collect();
            for (m, &max_det) in MAX_DETS.iter().enumerate() {
                let Some(per_t) = accumulate(&refs, max_det, nt, &recall_points) else {
                    continue;
                };
                for (t, (q, r)) in per_t.into_iter().enumerate() {
                    for (ri, p) in q.into_iter().enumerate() {
                        precision[a][m][(t * nr + ri) * nk + k] = p;
                    }
                    recall[a][m][t * nk + k] = r;
                }
            }
        }
    }
    let ap = |a: usize, m: usize, t: Option<usize>| {
        let s = &precision[a][m];
        match t {
            None => mean(s.iter().copied()),
            Some(t) => mean(s[t * nr * nk..(t + 1) * nr * nk].iter().copied()),
        }
    };
    let ar = |a: usize, m: usize| mean(recall[a][m].iter().copied());
    // AP50 and AP75: the thresholds 0.5 and 0.75 (the first and the sixth)
    [
        ap(0, 2, None),
        ap(0, 2, Some(0)),
        ap(0, 2, Some(5)),
        ap(1, 2, None),
        ap(2, 2, None),
        ap(3, 2, None),
        ar(0, 0),
        ar(0, 1),
        ar(0, 2),
        ar(1, 2),
        ar(2, 2),
        ar(3, 2),
    ]
}

/// PASCAL VOC AP at IoU 0.5 for one class; `None` when the class has no (non-difficult)
/// ground truth.
pub fn voc_average_precision(images: &[ImageResult], class: usize) -> Option<f64> {
    let mut scored: Vec<(f64, bool)> = Vec::new();
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
        dets.sort_by(|a, b| b.coco_score.total_cmp(&a.coco_score));
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
                    scored.push((d.coco_score, !detected[g]));
                    detected[g] = true;
                }
                _ => scored.push((d.coco_score, false)),
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
        GtBox::from_corners(BBox::new(y, x, y + s, x + s), None, class_id, false, false)
    }
    fn det(y: f32, x: f32, s: f32, class_id: usize, score: f32) -> DetBox {
        DetBox::new(BBox::new(y, x, y + s, x + s), class_id, score)
    }
    fn image(ground_truth: Vec<GtBox>, detections: Vec<DetBox>) -> ImageResult {
        ImageResult {
            image_id: 0,
            ground_truth,
            detections,
        }
    }

    #[test]
    fn perfect_detections_score_one() {
        let images = vec![image(
            vec![gt(0.0, 0.0, 50.0, 1), gt(100.0, 100.0, 120.0, 2)],
            vec![
                det(0.0, 0.0, 50.0, 1, 0.9),
                det(100.0, 100.0, 120.0, 2, 0.8),
            ],
        )];
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
        let images = vec![image(
            vec![gt(0.0, 0.0, 100.0, 1), gt(200.0, 200.0, 100.0, 1)],
            vec![
                det(0.0, 0.0, 100.0, 1, 0.9),
                det(500.0, 500.0, 100.0, 1, 0.8),
                det(200.0, 200.0, 100.0, 1, 0.7),
            ],
        )];
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
        let images = vec![image(
            vec![
                gt(0.0, 0.0, 100.0, 1),
                GtBox {
                    difficult: true,
                    ..gt(300.0, 300.0, 50.0, 1)
                },
            ],
            vec![
                DetBox::new(BBox::new(0.0, 20.0, 100.0, 120.0), 1, 0.9),
                det(300.0, 300.0, 50.0, 1, 0.95),
            ],
        )];
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
        let images = vec![image(
            vec![gt(0.0, 0.0, 50.0, 1)],
            vec![det(0.0, 0.0, 50.0, 2, 0.9)],
        )];
        let m = evaluate(&images, &["a".into(), "b".into()]);
        assert_eq!(m.voc_AP.len(), 1);
        assert_eq!(m.voc_AP["a"], 0.0);
        assert_eq!(m.AP, 0.0);
    }

    /// pycocotools reads a ground truth's area range from its `area` (a mask's, smaller than
    /// its box), a detection's from its box: a 40x40 box whose mask covers 900 px^2 is small.
    #[test]
    fn area_ranges_read_the_annotation_area() {
        let mut object = gt(10.0, 10.0, 40.0, 1);
        object.area = 900.0;
        let images = vec![image(vec![object], vec![det(10.0, 10.0, 40.0, 1, 0.9)])];
        let c = coco_metrics(&images, &[1]);
        // APs, APm, APl; ARs, ARm, ARl: the object is small; the detection (1600 px^2,
        // medium) matches it in the small range and is ignored, unmatched, outside medium
        assert!((c[3] - 1.0).abs() < 1e-12, "{c:?}");
        assert_eq!([c[4], c[5]], [-1.0, -1.0], "{c:?}");
        assert_eq!([c[9], c[10], c[11]], [1.0, -1.0, -1.0]);
    }

    /// Detections of equal score (an int8 model's scores come in steps of 1/256) rank in the
    /// order of their images' ids, whatever the order of the images given.
    #[test]
    fn equal_scores_rank_in_image_id_order() {
        let second = ImageResult {
            image_id: 2,
            // a false positive at 0.5 and a hit at 0.25
            ..image(
                vec![gt(0.0, 0.0, 100.0, 1)],
                vec![
                    det(300.0, 300.0, 100.0, 1, 0.5),
                    det(0.0, 0.0, 100.0, 1, 0.25),
                ],
            )
        };
        let first = ImageResult {
            image_id: 1,
            // a hit at 0.5
            ..image(
                vec![gt(0.0, 0.0, 100.0, 1)],
                vec![det(0.0, 0.0, 100.0, 1, 0.5)],
            )
        };
        // image 1's hit first: precision 1 up to recall 0.5 (51 recall points), then 2/3
        let want = (51.0 + 50.0 * 2.0 / 3.0) / 101.0;
        for images in [
            vec![second.clone(), first.clone()],
            vec![first.clone(), second.clone()],
        ] {
            let c = coco_metrics(&images, &[1]);
            assert!((c[1] - want).abs() < 1e-9, "{} vs {want}", c[1]);
        }
    }

    /// IoUs and thresholds as pycocotools has them: in f64 (an IoU of exactly 0.7 is 0.7,
    /// not float32's 0.69999999), the thresholds numpy's linspace values (0.85 is 0.85, not
    /// `0.5 + 0.05 * 7` = 0.8500000000000001).
    #[test]
    fn ious_on_a_threshold_match_it() {
        assert_eq!(iou_thresholds()[7], 0.85);
        assert_eq!(iou_thresholds()[8], 0.8999999999999999);
        assert_eq!(recall_thresholds()[35], 0.35000000000000003);
        assert_eq!(recall_thresholds()[100], 1.0);
        // the detection covers 70% and 85% of its object: it matches at the thresholds from
        // 0.5 to 0.7 (5 of 10) and to 0.85 (8 of 10)
        for (width, want) in [(70.0, 0.5), (85.0, 0.8)] {
            let images = vec![image(
                vec![gt(0.0, 0.0, 100.0, 1)],
                vec![DetBox::new(BBox::new(0.0, 0.0, 100.0, width), 1, 0.9)],
            )];
            let c = coco_metrics(&images, &[1]);
            assert!((c[0] - want).abs() < 1e-12, "{width}: {} vs {want}", c[0]);
        }
    }

    #[test]
    fn means_are_summed_as_numpy_sums() {
        // numbers numpy gives: np.add.reduce(np.array([1.0 / (i + 3) for i in range(n)]))
        let v = |n: usize| (0..n).map(|i| 1.0 / (i as f64 + 3.0)).collect::<Vec<f64>>();
        assert_eq!(numpy_sum(&v(1010)), 5.99739350452643);
        assert_eq!(numpy_sum(&v(100)), 3.707082429307257);
        assert_eq!(mean(v(1010).into_iter()), 0.0059380133708182474);
        assert_eq!(mean([-1.0, -1.0].into_iter()), -1.0);
    }
}
