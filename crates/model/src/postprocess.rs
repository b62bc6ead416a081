//! Non-maximum suppression and the API's multi-class post-processing
//! (`batch_multiclass_non_max_suppression` with a sigmoid score converter).

use serde::{Deserialize, Serialize};

use crate::boxes::BBox;
use crate::config::PostProcessingConfig;

/// Greedy NMS as `tf.image.non_max_suppression`: visits boxes by descending score (ties by
/// index), drops those scoring at or below `score_threshold`, suppresses a box whose IoU with
/// an already selected box exceeds `iou_threshold`, and stops after `max_output` selections.
/// Returns the selected indices in selection order.
pub fn non_max_suppression(
    boxes: &[BBox],
    scores: &[f32],
    max_output: usize,
    iou_threshold: f32,
    score_threshold: f32,
) -> Vec<usize> {
    let mut order: Vec<usize> = (0..boxes.len())
        .filter(|&i| scores[i] > score_threshold)
        .collect();
    order.sort_by(|&a, &b| scores[b].total_cmp(&scores[a]));
    let mut selected = Vec::new();
    let mut kept = SelectedBoxes::new(iou_threshold);
    for i in order {
        if selected.len() >= max_output {
            break;
        }
        if !kept.overlaps(&boxes[i]) {
            kept.push(&boxes[i]);
            selected.push(i);
        }
    }
    selected
}

/// From this IoU threshold on, only selected boxes of similar area are tested (see
/// [`SelectedBoxes::overlaps`]); below it the area window would hold most boxes anyway.
const AREA_WINDOW_FROM: f32 = 0.5;

/// Relative slack of the area window, far above the rounding of the IoU arithmetic (a few
/// units in the last place), so that no box whose computed IoU passes is left out.
const AREA_WINDOW_SLACK: f32 = 1e-5;

/// The boxes NMS has selected so far, by coordinate (so that the IoU test against all of them
/// vectorises), and, for high thresholds, by area.
struct SelectedBoxes {
    threshold: f32,
    ymin: Vec<f32>,
    xmin: Vec<f32>,
    ymax: Vec<f32>,
    xmax: Vec<f32>,
    area: Vec<f32>,
    /// Indices of the selected boxes with a finite, non-negative area, by that area's bits
    /// (ordered like the areas); used when `threshold >= AREA_WINDOW_FROM`.
    by_area: std::collections::BTreeMap<u32, Vec<usize>>,
    /// Selected boxes outside `by_area` (negative or not finite area): always tested.
    odd: Vec<usize>,
}

/// Whether `area` can be windowed (ordered by its bits).
fn windowable(area: f32) -> bool {
    area.is_finite() && area >= 0.0
}

impl SelectedBoxes {
    fn new(threshold: f32) -> Self {
        Self {
            threshold,
            ymin: Vec::new(),
            xmin: Vec::new(),
            ymax: Vec::new(),
            xmax: Vec::new(),
            area: Vec::new(),
            by_area: Default::default(),
            odd: Vec::new(),
        }
    }

    fn windowed(&self) -> bool {
        self.threshold >= AREA_WINDOW_FROM
    }

    fn push(&mut self, b: &BBox) {
        let (index, area) = (self.area.len(), b.area());
        self.ymin.push(b.ymin);
        self.xmin.push(b.xmin);
        self.ymax.push(b.ymax);
        self.xmax.push(b.xmax);
        self.area.push(area);
        if self.windowed() {
            if windowable(area) {
                self.by_area.entry(area.to_bits()).or_default().push(index);
            } else {
                self.odd.push(index);
            }
        }
    }

    /// IoU of selected box `j` with `b` (of area `area`), as [`BBox::iou`] computes it.
    #[inline]
    fn iou(&self, j: usize, b: &BBox, area: f32) -> f32 {
        let h = (self.ymax[j].min(b.ymax) - self.ymin[j].max(b.ymin)).max(0.0);
        let w = (self.xmax[j].min(b.xmax) - self.xmin[j].max(b.xmin)).max(0.0);
        let inter = h * w;
        if inter == 0.0 {
            0.0
        } else {
            inter / (self.area[j] + area - inter)
        }
    }

    /// Whether `b` has IoU above the threshold with any selected box ([`BBox::iou`]'s
    /// arithmetic, selected box first). Since the IoU of two boxes is at most the ratio of the
    /// smaller area to the larger, for a threshold `t >= 0.5` only boxes whose area lies within
    /// `[t a, a / t]` (widened by `AREA_WINDOW_SLACK`) can pass; the hard example miner's
    /// `t = 0.99` makes that a handful of boxes instead of all of them.
    fn overlaps(&self, b: &BBox) -> bool {
        let (area, threshold) = (b.area(), self.threshold);
        if self.windowed() && windowable(area) {
            let low = area * threshold * (1.0 - AREA_WINDOW_SLACK);
            let high = area / (threshold * (1.0 - AREA_WINDOW_SLACK));
            let high = if high.is_finite() { high } else { f32::MAX };
            return self
                .by_area
                .range(low.to_bits()..=high.to_bits())
                .flat_map(|(_, boxes)| boxes)
                .chain(&self.odd)
                .any(|&j| self.iou(j, b, area) > threshold);
        }
        const BLOCK: usize = 64;
        let n = self.area.len();
        (0..n).step_by(BLOCK).any(|start| {
            let end = (start + BLOCK).min(n);
            let mut hit = false;
            for j in start..end {
                hit |= self.iou(j, b, area) > threshold;
            }
            hit
        })
    }
}

/// One detection of the post-processing.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
pub struct RawDetection {
    /// Class index among the non-background classes (0-based; label-map id minus 1).
    pub class_index: usize,
    /// Sigmoid score.
    pub score: f32,
    /// Normalised box, clipped to the image.
    pub bbox: BBox,
}

/// Multi-class NMS of one image: for each class, NMS over the boxes whose score exceeds the
/// threshold (at most `max_detections_per_class`); then all classes merged by descending score,
/// clipped to `[0, 1]` (boxes left without area dropped) and cut to `max_total_detections`.
///
/// `scores` is row-major `[boxes.len(), num_classes]` without the background column.
pub fn multiclass_nms(
    boxes: &[BBox],
    scores: &[f32],
    num_classes: usize,
    config: &PostProcessingConfig,
) -> Vec<RawDetection> {
    let window = BBox::new(0.0, 0.0, 1.0, 1.0);
    let mut class_scores = vec![0.0f32; boxes.len()];
    let mut detections = Vec::new();
    for class in 0..num_classes {
        for (i, s) in class_scores.iter_mut().enumerate() {
            *s = scores[i * num_classes + class];
        }
        let keep = non_max_suppression(
            boxes,
            &class_scores,
            config.max_detections_per_class,
            config.iou_threshold,
            config.score_threshold,
        );
        detections.extend(keep.into_iter().map(|i| RawDetection {
            class_index: class,
            score: class_scores[i],
            bbox: boxes[i],
        }));
    }
    detections.sort_by(|a, b| b.score.total_cmp(&a.score));
    detections
        .into_iter()
        .map(|d| RawDetection {
            bbox: d.bbox.clip_to(&window),
            ..d
        })
        .filter(|d| d.bbox.area() > 0.0)
        .take(config.max_total_detections)
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn nms_suppresses_overlaps_above_threshold_only() {
        let boxes = [
            BBox::new(0.0, 0.0, 1.0, 1.0),
            BBox::new(0.0, 0.1, 1.0, 1.1), // IoU with 0: 0.9/1.1 = 0.818
            BBox::new(0.0, 0.5, 1.0, 1.5), // IoU with 0: 1/3
            BBox::new(2.0, 2.0, 3.0, 3.0),
        ];
        let scores = [0.9, 0.95, 0.5, 0.1];
        // box 1 first (highest), box 0 suppressed (0.818 > 0.6), box 2: IoU with 1 = 0.6/1.4
        assert_eq!(
            non_max_suppression(&boxes, &scores, 10, 0.6, 0.0),
            vec![1, 2, 3]
        );
        // threshold is strict: IoU exactly 1/3 kept at 1/3
        let b = [boxes[0], boxes[2]];
        assert_eq!(
            non_max_suppression(&b, &[0.9, 0.8], 10, 1.0 / 3.0, 0.0),
            vec![0, 1]
        );
        // max_output and score threshold
        assert_eq!(non_max_suppression(&boxes, &scores, 1, 0.6, 0.0), vec![1]);
        assert_eq!(non_max_suppression(&boxes, &scores, 10, 0.6, 0.5), vec![1]);
        // ties by index
        assert_eq!(
            non_max_suppression(&b, &[0.5, 0.5], 10, 0.9, 0.0),
            vec![0, 1]
        );
    }

    /// Greedy NMS straight from the definition, with [`BBox::iou`].
    fn brute_force_nms(boxes: &[BBox], scores: &[f32], max: usize, t: f32) -> Vec<usize> {
        let mut order: Vec<usize> = (0..boxes.len()).collect();
        order.sort_by(|&a, &b| scores[b].total_cmp(&scores[a]));
        let mut selected: Vec<usize> = Vec::new();
        for i in order {
            if selected.len() < max && selected.iter().all(|&j| boxes[j].iou(&boxes[i]) <= t) {
                selected.push(i);
            }
        }
        selected
    }

    #[test]
    fn area_window_selects_exactly_what_the_full_scan_selects() {
        // clusters of jittered copies (areas within a few percent, IoUs near every threshold),
        // exact duplicates and empty boxes; a small LCG keeps the test dependency-free
        let mut state = 12345u64;
        let mut next = || {
            state = state
                .wrapping_mul(6364136223846793005)
                .wrapping_add(1442695040888963407);
            (state >> 40) as f32 / (1u64 << 24) as f32
        };
        let mut boxes = Vec::new();
        for _ in 0..60 {
            let (y, x, h, w) = (next(), next(), 0.05 + next() * 0.5, 0.05 + next() * 0.5);
            for _ in 0..20 {
                let j = 0.01 * next();
                boxes.push(BBox::new(y + j, x - j, y + h + j * next(), x + w + j));
            }
            boxes.push(BBox::new(y, x, y + h, x + w));
            boxes.push(BBox::new(y, x, y + h, x + w));
            boxes.push(BBox::new(y, x, y, x + w));
        }
        let scores: Vec<f32> = boxes.iter().map(|_| next()).collect();
        for t in [0.0, 0.3, 0.5, 0.6, 0.9, 0.97, 0.99, 0.999, 1.0] {
            let fast = non_max_suppression(&boxes, &scores, 3000, t, f32::NEG_INFINITY);
            assert_eq!(
                fast,
                brute_force_nms(&boxes, &scores, 3000, t),
                "threshold {t}"
            );
        }
    }

    #[test]
    fn multiclass_keeps_classes_apart_and_clips() {
        let boxes = [
            BBox::new(-0.1, 0.0, 0.5, 0.5),
            BBox::new(-0.1, 0.0, 0.5, 0.52),
            BBox::new(1.2, 1.2, 1.5, 1.5),
        ];
        // scores [box, class]: box 0 and 1 overlap; class 0 keeps box 1 only, class 1 keeps box 0
        let scores = [0.3, 0.8, 0.7, 0.2, 0.9, 0.9];
        let config = PostProcessingConfig::default();
        let d = multiclass_nms(&boxes, &scores, 2, &config);
        // box 2 lies outside the image: clipped to zero area and dropped
        assert_eq!(d.len(), 2);
        assert_eq!((d[0].class_index, d[0].score), (1, 0.8));
        assert_eq!((d[1].class_index, d[1].score), (0, 0.7));
        assert_eq!(d[0].bbox, BBox::new(0.0, 0.0, 0.5, 0.5));
        let limited = multiclass_nms(
            &boxes,
            &scores,
            2,
            &PostProcessingConfig {
                max_total_detections: 1,
                ..config
            },
        );
        assert_eq!(limited.len(), 1);
    }
}
