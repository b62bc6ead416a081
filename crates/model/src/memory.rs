//! A rough upper bound of the memory a training step needs, so that a config which cannot fit
//! (an image size, class count, depth multiplier or batch far too large) is refused with its
//! figures before an allocation aborts the process.

use crate::config::SsdConfig;
use crate::mobilenet::{CONV0_DEPTH, SEPARABLE_BLOCKS};
use crate::ssd::{EXTRA_LAYER_DEPTHS, feature_map_shapes};

/// Copies of every activation a training step keeps: the value, its gradient, and
/// BatchNorm's saved input and normalised values.
const ACTIVATION_COPIES: f64 = 4.0;
/// Copies of every weight: the value, its gradient, two optimizer slots and the EMA shadow.
const WEIGHT_COPIES: f64 = 5.0;
/// Copies of every per-anchor value (logits, probabilities, targets, losses).
const ANCHOR_COPIES: f64 = 4.0;

/// Bytes, about, that one training step over `images` images needs (f32 everywhere; computed
/// in f64 so that absurd sizes cannot overflow).
pub fn training_bytes(config: &SsdConfig, images: usize) -> f64 {
    let (activations, weights) = network_floats(config);
    let anchors: f64 = feature_map_shapes(config)
        .iter()
        .zip(config.anchors.anchors_per_location())
        .map(|(&(h, w), a)| h as f64 * w as f64 * a as f64)
        .sum();
    let per_anchor = config.num_classes as f64 + 5.0;
    let per_image = ACTIVATION_COPIES * activations + ANCHOR_COPIES * anchors * per_anchor;
    4.0 * (images as f64 * per_image + WEIGHT_COPIES * weights)
}

/// `(activations per image, weights)` of the network, in floats.
fn network_floats(config: &SsdConfig) -> (f64, f64) {
    let depth = |d: usize| config.depth(d) as f64;
    let side = |s: f64, stride: usize| (s / stride as f64).ceil();
    let [mut h, mut w] = config.image_size.map(|s| side(s as f64, 2));
    let mut channels = depth(CONV0_DEPTH);
    let (mut activations, mut weights) = (h * w * channels, 27.0 * channels);
    let mut maps = Vec::new();
    for (i, &(stride, d)) in SEPARABLE_BLOCKS.iter().enumerate() {
        (h, w) = (side(h, stride), side(w, stride));
        let out = depth(d);
        activations += h * w * (channels + out);
        weights += 9.0 * channels + channels * out;
        channels = out;
        if i == 10 || i == 12 {
            maps.push(channels);
        }
    }
    for d in EXTRA_LAYER_DEPTHS {
        let (mid, out) = (depth(d / 2), depth(d));
        activations += h * w * mid;
        (h, w) = (side(h, 2), side(w, 2));
        activations += h * w * out;
        weights += channels * mid + 9.0 * mid * out;
        channels = out;
        maps.push(channels);
    }
    let per_anchor = config.num_classes as f64 + 5.0;
    for (c, a) in maps.iter().zip(config.anchors.anchors_per_location()) {
        weights += c * a as f64 * per_anchor;
    }
    (activations, weights)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_estimate_grows_with_the_sizes_and_never_overflows() {
        let pets = SsdConfig {
            num_classes: 37,
            ..SsdConfig::default()
        };
        let one = training_bytes(&pets, 1);
        // the pets network at 300x300: 5.5 M weights (22 MB each copy), a few hundred MB
        // per image for a training step
        assert!(one > 50e6 && one < 1e9, "{one}");
        let batch = training_bytes(&pets, 24);
        assert!(batch > 10.0 * one, "{batch} against {one}");
        let huge = SsdConfig {
            image_size: [1 << 20, 1 << 20],
            num_classes: usize::MAX / 2,
            depth_multiplier: 1e6,
            ..pets.clone()
        };
        let bytes = training_bytes(&huge, usize::MAX);
        assert!(bytes.is_finite() && bytes > 1e30, "{bytes}");
    }
}
