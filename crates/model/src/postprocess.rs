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
    let mut kept = SelectedBoxes::default();
    for i in order {
        if selected.len() >= max_output {
            break;
        }
        if !kept.overlaps(&boxes[i], iou_threshold) {
            kept.push(&boxes[i]);
            selected.push(i);
        }
    }
    selected
}

/// The boxes NMS has selected so far, by coordinate (so that the IoU test against all of them
/// vectorises).
#[derive(Default)]
struct SelectedBoxes {
    ymin: Vec<f32>,
    xmin: Vec<f32>,
    ymax: Vec<f32>,
    xmax: Vec<f32>,
    area: Vec<f32>,
}

impl SelectedBoxes {
    fn push(&mut self, b: &BBox) {
        self.ymin.push(b.ymin);
        self.xmin.push(b.xmin);
        self.ymax.push(b.ymax);
        self.xmax.push(b.xmax);
        self.area.push(b.area());
    }

    /// Whether `b` has IoU above `threshold` with any selected box ([`BBox::iou`]'s
    /// arithmetic, selected box first).
    fn overlaps(&self, b: &BBox, threshold: f32) -> bool {
        const BLOCK: usize = 64;
        let area = b.area();
        let n = self.area.len();
        (0..n).step_by(BLOCK).any(|start| {
            let end = (start + BLOCK).min(n);
            let mut hit = false;
            for j in start..end {
                let h = (self.ymax[j].min(b.ymax) - self.ymin[j].max(b.ymin)).max(0.0);
                let w = (self.xmax[j].min(b.xmax) - self.xmin[j].max(b.xmin)).max(0.0);
                let inter = h * w;
                let iou = if inter == 0.0 {
                    0.0
                } else {
                    inter / (self.area[j] + area - inter)
                };
                hit |= iou > threshold;
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
