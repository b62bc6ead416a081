//! `faster_rcnn_box_coder`: boxes encoded relative to anchors as
//! `[ty * sy, tx * sx, th * sh, tw * sw]` with `ty = (y - ya) / ha`, `th = log(h / ha)`.

use crate::boxes::BBox;

/// Small constant the API adds to every height and width before encoding.
const EPSILON: f32 = 1e-8;

/// The Faster R-CNN box coder with its four scale factors.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct BoxCoder {
    /// Scales `[y, x, height, width]`; the API's SSD default is `[10, 10, 5, 5]`.
    pub scales: [f32; 4],
}

impl BoxCoder {
    /// Number of numbers in one code.
    pub const CODE_SIZE: usize = 4;

    /// A coder with the given scales.
    pub fn new(scales: [f32; 4]) -> Self {
        Self { scales }
    }

    /// Encodes `bbox` relative to `anchor`.
    pub fn encode(&self, bbox: &BBox, anchor: &BBox) -> [f32; 4] {
        let (ya, xa, ha, wa) = anchor.center_size();
        let (y, x, h, w) = bbox.center_size();
        let (ha, wa, h, w) = (ha + EPSILON, wa + EPSILON, h + EPSILON, w + EPSILON);
        let [sy, sx, sh, sw] = self.scales;
        [
            (y - ya) / ha * sy,
            (x - xa) / wa * sx,
            (h / ha).ln() * sh,
            (w / wa).ln() * sw,
        ]
    }

    /// Decodes `code` relative to `anchor` back into a box.
    pub fn decode(&self, code: &[f32; 4], anchor: &BBox) -> BBox {
        let (ya, xa, ha, wa) = anchor.center_size();
        let [sy, sx, sh, sw] = self.scales;
        let (ty, tx, th, tw) = (code[0] / sy, code[1] / sx, code[2] / sh, code[3] / sw);
        let w = tw.exp() * wa;
        let h = th.exp() * ha;
        let yc = ty * ha + ya;
        let xc = tx * wa + xa;
        BBox::new(yc - h / 2.0, xc - w / 2.0, yc + h / 2.0, xc + w / 2.0)
    }

    /// Decodes a flat `[n * 4]` slice of codes against `n` anchors.
    pub fn decode_all(&self, codes: &[f32], anchors: &[BBox]) -> Vec<BBox> {
        codes
            .chunks_exact(Self::CODE_SIZE)
            .zip(anchors)
            .map(|(c, a)| self.decode(&[c[0], c[1], c[2], c[3]], a))
            .collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn known_values() {
        let coder = BoxCoder::new([10.0, 10.0, 5.0, 5.0]);
        let anchor = BBox::new(0.0, 0.0, 0.5, 0.5); // centre (0.25, 0.25), size 0.5
        let bbox = BBox::new(0.1, 0.2, 0.5, 1.0); // centre (0.3, 0.6), h 0.4, w 0.8
        let code = coder.encode(&bbox, &anchor);
        let expect = [
            10.0 * 0.05 / 0.5,
            10.0 * 0.35 / 0.5,
            5.0 * (0.4f32 / 0.5).ln(),
            5.0 * (0.8f32 / 0.5).ln(),
        ];
        for (a, b) in code.iter().zip(expect) {
            assert!((a - b).abs() < 1e-5, "{code:?} vs {expect:?}");
        }
        // the identical box encodes to zeros
        let zero = coder.encode(&anchor, &anchor);
        assert!(zero.iter().all(|v| v.abs() < 1e-6));
    }

    #[test]
    fn encode_decode_round_trip() {
        let coder = BoxCoder::new([10.0, 10.0, 5.0, 5.0]);
        let anchor = BBox::new(0.2, 0.3, 0.6, 0.5);
        for bbox in [
            BBox::new(0.1, 0.1, 0.9, 0.4),
            BBox::new(0.45, 0.0, 0.55, 1.0),
        ] {
            let back = coder.decode(&coder.encode(&bbox, &anchor), &anchor);
            for (a, b) in back.to_array().iter().zip(bbox.to_array()) {
                assert!((a - b).abs() < 1e-5, "{back:?} vs {bbox:?}");
            }
        }
    }
}
