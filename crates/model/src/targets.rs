//! Target assignment as the API's SSD does it: IoU similarity between ground truth and anchors,
//! the `argmax_matcher`, and the per-anchor classification and regression targets.

use crate::box_coder::BoxCoder;
use crate::boxes::BBox;
use crate::config::MatcherConfig;

/// What an anchor was matched to.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Match {
    /// Matched to the ground-truth box with this index.
    Matched(usize),
    /// A negative (background) anchor.
    Unmatched,
    /// Neither: it does not contribute to any loss.
    Ignored,
}

/// A ground-truth object: its box (normalised) and its class id (1-based, 0 is background).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct GroundTruth {
    /// Normalised `[ymin, xmin, ymax, xmax]` box.
    pub bbox: BBox,
    /// Label-map id, from 1 to `num_classes`.
    pub class_id: usize,
}

/// Training targets of one image, one entry per anchor.
#[derive(Debug, Clone, PartialEq)]
pub struct ImageTargets {
    /// Match of every anchor.
    pub matches: Vec<Match>,
    /// Target class of every anchor (0 = background).
    pub class_ids: Vec<usize>,
    /// Classification weight of every anchor (0 for ignored anchors).
    pub class_weights: Vec<f32>,
    /// Encoded target box of every anchor (zeros where unmatched).
    pub box_codes: Vec<[f32; 4]>,
    /// Regression weight of every anchor (1 where matched).
    pub box_weights: Vec<f32>,
}

impl ImageTargets {
    /// Number of matched anchors.
    pub fn num_matches(&self) -> usize {
        self.matches
            .iter()
            .filter(|m| matches!(m, Match::Matched(_)))
            .count()
    }
}

/// Row-major `[gt.len(), anchors.len()]` IoU matrix.
pub fn iou_matrix(gt: &[BBox], anchors: &[BBox]) -> Vec<f32> {
    gt.iter()
        .flat_map(|g| anchors.iter().map(move |a| g.iou(a)))
        .collect()
}

impl MatcherConfig {
    /// Matches the columns (anchors) of a row-major `[rows, cols]` similarity matrix to its rows
    /// (ground truth), exactly as `ArgMaxMatcher`: ties go to the lowest index, forced matches
    /// override thresholds, and an anchor forced by several rows goes to the first of them.
    pub fn match_anchors(&self, similarity: &[f32], rows: usize, cols: usize) -> Vec<Match> {
        assert_eq!(similarity.len(), rows * cols, "similarity matrix shape");
        if rows == 0 {
            return vec![Match::Unmatched; cols];
        }
        let mut matches: Vec<Match> = (0..cols)
            .map(|c| {
                let (best_row, best) = (0..rows).map(|r| (r, similarity[r * cols + c])).fold(
                    (0, f32::NEG_INFINITY),
                    |acc, x| if x.1 > acc.1 { x } else { acc },
                );
                if best < self.unmatched_threshold {
                    if self.negatives_lower_than_unmatched {
                        Match::Unmatched
                    } else {
                        Match::Ignored
                    }
                } else if best < self.matched_threshold {
                    if self.negatives_lower_than_unmatched {
                        Match::Ignored
                    } else {
                        Match::Unmatched
                    }
                } else {
                    Match::Matched(best_row)
                }
            })
            .collect();
        if self.force_match_for_each_row {
            let mut forced: Vec<Option<usize>> = vec![None; cols];
            for r in 0..rows {
                let row = &similarity[r * cols..(r + 1) * cols];
                let (best_col, _) =
                    row.iter()
                        .enumerate()
                        .fold(
                            (0, f32::NEG_INFINITY),
                            |acc, (c, &v)| if v > acc.1 { (c, v) } else { acc },
                        );
                forced[best_col].get_or_insert(r);
            }
            for (m, f) in matches.iter_mut().zip(forced) {
                if let Some(r) = f {
                    *m = Match::Matched(r);
                }
            }
        }
        matches
    }
}

/// Builds the targets of one image: IoU with every anchor, argmax matching, box encoding.
pub fn assign_targets(
    matcher: &MatcherConfig,
    coder: &BoxCoder,
    anchors: &[BBox],
    ground_truth: &[GroundTruth],
) -> ImageTargets {
    let boxes: Vec<BBox> = ground_truth.iter().map(|g| g.bbox).collect();
    let similarity = iou_matrix(&boxes, anchors);
    let matches = matcher.match_anchors(&similarity, boxes.len(), anchors.len());
    let mut targets = ImageTargets {
        class_ids: Vec::with_capacity(anchors.len()),
        class_weights: Vec::with_capacity(anchors.len()),
        box_codes: Vec::with_capacity(anchors.len()),
        box_weights: Vec::with_capacity(anchors.len()),
        matches,
    };
    for (m, anchor) in targets.matches.iter().zip(anchors) {
        let (class, cw, code, bw) = match *m {
            Match::Matched(g) => (
                ground_truth[g].class_id,
                1.0,
                coder.encode(&ground_truth[g].bbox, anchor),
                1.0,
            ),
            Match::Unmatched => (0, 1.0, [0.0; 4], 0.0),
            Match::Ignored => (0, 0.0, [0.0; 4], 0.0),
        };
        targets.class_ids.push(class);
        targets.class_weights.push(cw);
        targets.box_codes.push(code);
        targets.box_weights.push(bw);
    }
    targets
}

#[cfg(test)]
mod tests {
    use super::*;
    use Match::*;

    fn matcher(matched: f32, unmatched: f32, force: bool) -> MatcherConfig {
        MatcherConfig {
            matched_threshold: matched,
            unmatched_threshold: unmatched,
            negatives_lower_than_unmatched: true,
            force_match_for_each_row: force,
        }
    }

    #[test]
    fn threshold_edges() {
        // one row; values exactly at the thresholds
        let sim = [0.5, 0.4999, 0.3, 0.7];
        let m = matcher(0.5, 0.5, false).match_anchors(&sim, 1, 4);
        assert_eq!(m, vec![Matched(0), Unmatched, Unmatched, Matched(0)]);
        // an ignored band [0.3, 0.5)
        let m = matcher(0.5, 0.3, false).match_anchors(&sim, 1, 4);
        assert_eq!(m, vec![Matched(0), Ignored, Ignored, Matched(0)]);
        // negatives_lower_than_unmatched = false swaps the two labels
        let mut c = matcher(0.5, 0.3, false);
        c.negatives_lower_than_unmatched = false;
        let m = c.match_anchors(&[0.5, 0.4, 0.1], 1, 3);
        assert_eq!(m, vec![Matched(0), Unmatched, Ignored]);
    }

    #[test]
    fn argmax_over_rows_and_ties() {
        // rows = 2 gt, cols = 3 anchors
        let sim = [
            0.6, 0.8, 0.1, //
            0.6, 0.9, 0.2,
        ];
        let m = matcher(0.5, 0.5, false).match_anchors(&sim, 2, 3);
        // column 0 ties -> lowest row; column 1 -> row 1; column 2 below threshold
        assert_eq!(m, vec![Matched(0), Matched(1), Unmatched]);
    }

    #[test]
    fn forced_matches() {
        let sim = [
            0.1, 0.3, 0.2, // row 0 best at col 1 (below threshold)
            0.0, 0.0, 0.0, // row 1 overlaps nothing: forced to col 0
            0.0, 0.25, 0.0, // row 2 best at col 1 too: row 0 keeps it
        ];
        let m = matcher(0.5, 0.5, true).match_anchors(&sim, 3, 3);
        assert_eq!(m, vec![Matched(1), Matched(0), Unmatched]);
        // no ground truth: everything is a negative
        assert_eq!(
            matcher(0.5, 0.5, true).match_anchors(&[], 0, 2),
            vec![Unmatched; 2]
        );
    }

    #[test]
    fn targets_follow_matches() {
        let anchors = [BBox::new(0.0, 0.0, 0.5, 0.5), BBox::new(0.5, 0.5, 1.0, 1.0)];
        let gt = [GroundTruth {
            bbox: BBox::new(0.0, 0.0, 0.5, 0.6),
            class_id: 2,
        }];
        let coder = BoxCoder::new([10.0, 10.0, 5.0, 5.0]);
        let t = assign_targets(&MatcherConfig::default(), &coder, &anchors, &gt);
        assert_eq!(t.matches, vec![Matched(0), Unmatched]);
        assert_eq!(t.class_ids, vec![2, 0]);
        assert_eq!(t.class_weights, vec![1.0, 1.0]);
        assert_eq!(t.box_weights, vec![1.0, 0.0]);
        assert_eq!(t.box_codes[0], coder.encode(&gt[0].bbox, &anchors[0]));
        assert_eq!(t.box_codes[1], [0.0; 4]);
        assert_eq!(t.num_matches(), 1);
    }
}
