//! The `ssd_anchor_generator` of the TF Object Detection API (`create_ssd_anchors` feeding a
//! `MultipleGridAnchorGenerator`), computed in the same float precision and order.
//!
//! Anchors are laid out layer by layer; within a layer by row (y), then column (x), then box
//! spec, which is the order the box predictor flattens its outputs in.

use crate::boxes::BBox;
use crate::config::AnchorConfig;

/// One anchor shape of a layer: `(scale, aspect_ratio)`.
pub type BoxSpec = (f32, f32);

impl AnchorConfig {
    /// Scales `s_0 .. s_(n-1)` followed by `s_n = 1.0`, computed as the API does (in double
    /// precision from the config's single-precision values).
    fn scales(&self) -> Vec<f64> {
        let (min, max) = (self.min_scale as f64, self.max_scale as f64);
        let n = self.num_layers;
        let denom = n.saturating_sub(1).max(1) as f64;
        (0..n)
            .map(|i| min + (max - min) * i as f64 / denom)
            .chain(std::iter::once(1.0))
            .collect()
    }

    /// The box specs of every layer.
    pub fn box_specs(&self) -> Vec<Vec<BoxSpec>> {
        let scales = self.scales();
        (0..self.num_layers)
            .map(|layer| {
                let (scale, next) = (scales[layer], scales[layer + 1]);
                if layer == 0 && self.reduce_boxes_in_lowest_layer {
                    vec![(0.1, 1.0), (scale as f32, 2.0), (scale as f32, 0.5)]
                } else {
                    let mut specs: Vec<BoxSpec> = self
                        .aspect_ratios
                        .iter()
                        .map(|&r| (scale as f32, r))
                        .collect();
                    if self.interpolated_scale_aspect_ratio > 0.0 {
                        specs.push((
                            (scale * next).sqrt() as f32,
                            self.interpolated_scale_aspect_ratio,
                        ));
                    }
                    specs
                }
            })
            .collect()
    }

    /// Anchors per feature-map location, for every layer.
    pub fn anchors_per_location(&self) -> Vec<usize> {
        self.box_specs().iter().map(Vec::len).collect()
    }

    /// All anchors, normalised to `[0, 1]`, for feature maps of the given `(height, width)` and
    /// an input image of `image_height` x `image_width` pixels (which scales the base anchor
    /// size as the API does for non-square inputs).
    pub fn generate(
        &self,
        feature_map_shapes: &[(usize, usize)],
        image_height: usize,
        image_width: usize,
    ) -> Vec<BBox> {
        let min_side = image_height.min(image_width) as f32;
        let base_h = min_side / image_height as f32 * self.base_anchor_size[0];
        let base_w = min_side / image_width as f32 * self.base_anchor_size[1];
        let mut anchors = Vec::new();
        for (specs, &(grid_h, grid_w)) in self.box_specs().iter().zip(feature_map_shapes) {
            let sizes: Vec<(f32, f32)> = specs
                .iter()
                .map(|&(scale, ratio)| {
                    let root = ratio.sqrt();
                    (scale / root * base_h, scale * root * base_w)
                })
                .collect();
            let stride_y = 1.0 / grid_h as f32;
            let stride_x = 1.0 / grid_w as f32;
            let (offset_y, offset_x) = (0.5 * stride_y, 0.5 * stride_x);
            for y in 0..grid_h {
                let cy = y as f32 * stride_y + offset_y;
                for x in 0..grid_w {
                    let cx = x as f32 * stride_x + offset_x;
                    for &(h, w) in &sizes {
                        anchors.push(BBox::new(
                            cy - 0.5 * h,
                            cx - 0.5 * w,
                            cy + 0.5 * h,
                            cx + 0.5 * w,
                        ));
                    }
                }
            }
        }
        anchors
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const SHAPES_300: [(usize, usize); 6] = [(19, 19), (10, 10), (5, 5), (3, 3), (2, 2), (1, 1)];

    fn close(a: BBox, b: [f64; 4]) {
        for (x, y) in a.to_array().iter().zip(b) {
            assert!((*x as f64 - y).abs() < 1e-6, "{a:?} vs {b:?}");
        }
    }

    #[test]
    fn default_config_gives_1917_anchors() {
        let c = AnchorConfig::default();
        assert_eq!(c.anchors_per_location(), vec![3, 6, 6, 6, 6, 6]);
        assert_eq!(c.generate(&SHAPES_300, 300, 300).len(), 1917);
    }

    /// First and last anchor of every layer, worked out from the definition:
    /// scales s_i = 0.2 + 0.75 i / 5, box (h, w) = (s / sqrt(r), s sqrt(r)),
    /// centres (i + 0.5) / n.
    #[test]
    fn first_and_last_anchor_of_each_layer() {
        let c = AnchorConfig::default();
        let anchors = c.generate(&SHAPES_300, 300, 300);
        let s: Vec<f64> = (0..6).map(|i| 0.2 + 0.15 * i as f64).chain([1.0]).collect();
        let mut start = 0;
        for (layer, &(n, _)) in SHAPES_300.iter().enumerate() {
            let per_loc = if layer == 0 { 3 } else { 6 };
            let count = n * n * per_loc;
            let c0 = 0.5 / n as f64;
            let clast = (n as f64 - 0.5) / n as f64;
            // first spec: layer 0 -> (0.1, 1.0); others -> (s_i, 1.0)
            let first = if layer == 0 { 0.1 } else { s[layer] };
            close(
                anchors[start],
                [
                    c0 - first / 2.0,
                    c0 - first / 2.0,
                    c0 + first / 2.0,
                    c0 + first / 2.0,
                ],
            );
            // last spec: layer 0 -> (s0, 0.5); others -> (sqrt(s_i s_(i+1)), 1.0)
            let (h, w) = if layer == 0 {
                (s[0] / 0.5f64.sqrt(), s[0] * 0.5f64.sqrt())
            } else {
                let v = (s[layer] * s[layer + 1]).sqrt();
                (v, v)
            };
            close(
                anchors[start + count - 1],
                [
                    clast - h / 2.0,
                    clast - w / 2.0,
                    clast + h / 2.0,
                    clast + w / 2.0,
                ],
            );
            start += count;
        }
        assert_eq!(start, anchors.len());
    }

    #[test]
    fn order_is_row_column_spec() {
        let c = AnchorConfig::default();
        let anchors = c.generate(&SHAPES_300, 300, 300);
        // second location of layer 0 is (y=0, x=1): centre x = 1.5 / 19
        let (cy, cx, _, _) = anchors[3].center_size();
        assert!((cy - 0.5 / 19.0).abs() < 1e-6 && (cx - 1.5 / 19.0).abs() < 1e-6);
        // aspect ratio 2.0 box (spec 1 of layer 0) is twice as wide as high
        let b = anchors[1];
        assert!((b.width() / b.height() - 2.0).abs() < 1e-5);
    }

    #[test]
    fn non_square_input_scales_base_size() {
        let c = AnchorConfig::default();
        // 300 high, 600 wide: base width is halved so anchors stay square in pixels.
        let anchors = c.generate(
            &[(19, 38), (10, 19), (5, 10), (3, 5), (2, 3), (1, 2)],
            300,
            600,
        );
        let b = anchors[0];
        assert!((b.height() - 0.1).abs() < 1e-6 && (b.width() - 0.05).abs() < 1e-6);
    }
}
