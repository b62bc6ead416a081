//! The inference network as plain numbers, the common input of every format writer: each
//! convolution with its BatchNorm (moving statistics) folded into the kernel and a bias, the
//! chain of layers up to the predictor heads, the heads, and the anchors.

use burn::nn::conv::Conv2d;
use burn::tensor::backend::Backend;

use crate::boxes::BBox;
use crate::config::SsdConfig;
use crate::error::Result;
use crate::layers::ConvBnRelu6;
use crate::ops::SsdBackend;
use crate::ssd::{Ssd, anchors};
use crate::tf::names::{unit_names, values};

/// One convolution of the frozen network (TF "SAME" padding, square kernel).
#[derive(Debug, Clone)]
pub(crate) struct FrozenConv {
    /// The API's scope of the layer (`FeatureExtractor/MobilenetV1/Conv2d_0`, ...).
    pub name: String,
    /// Kernel `[out, in / groups, k, k]` (depthwise: `[channels, 1, k, k]`), row-major.
    pub kernel: Vec<f32>,
    /// Shape of `kernel`.
    pub shape: [usize; 4],
    /// One bias per output channel.
    pub bias: Vec<f32>,
    pub stride: usize,
    /// One filter per input channel.
    pub depthwise: bool,
    /// Followed by ReLU6 (every layer but the predictor heads).
    pub relu6: bool,
}

impl FrozenConv {
    /// Output channels.
    pub fn out_channels(&self) -> usize {
        self.shape[0]
    }

    /// Kernel height (= width).
    pub fn kernel_size(&self) -> usize {
        self.shape[2]
    }
}

/// The whole inference network.
#[derive(Debug, Clone)]
pub(crate) struct FrozenNetwork {
    /// Input `[height, width]`.
    pub image_size: [usize; 2],
    /// `Conv2d_0` to the last extra layer, each layer feeding the next.
    pub trunk: Vec<FrozenConv>,
    /// Indices into `trunk` of the layers whose outputs are the six feature maps.
    pub feature_maps: Vec<usize>,
    /// Box-code convolution of each feature map (4 codes per anchor).
    pub box_heads: Vec<FrozenConv>,
    /// Class-logit convolution of each feature map (`num_classes + 1` per anchor).
    pub class_heads: Vec<FrozenConv>,
    /// Object classes, without the background.
    pub num_classes: usize,
    /// The anchors, in the order of the concatenated head outputs.
    pub anchors: Vec<BBox>,
}

/// Folds `unit`'s BatchNorm into its convolution: `kernel * scale` per output channel and the
/// shift as bias, the scale and shift computed as inference computes them.
fn fold_unit<B: SsdBackend>(unit: &ConvBnRelu6<B>, name: String) -> FrozenConv {
    let weight = unit.conv.weight.val();
    let [scale, shift] = unit.bn.folded(&weight.device());
    let shape = weight.dims();
    let per_channel = shape[1] * shape[2] * shape[3];
    let scale = values(scale);
    let mut kernel = values(weight);
    for (chunk, s) in kernel.chunks_exact_mut(per_channel).zip(&scale) {
        chunk.iter_mut().for_each(|w| *w *= s);
    }
    FrozenConv {
        name,
        kernel,
        shape,
        bias: values(shift),
        stride: unit.conv.stride[0],
        depthwise: unit.conv.groups > 1,
        relu6: true,
    }
}

fn head<B: Backend>(conv: &Conv2d<B>, name: String) -> FrozenConv {
    let weight = conv.weight.val();
    let shape = weight.dims();
    let bias = match &conv.bias {
        Some(b) => values(b.val()),
        None => vec![0.0; shape[0]],
    };
    FrozenConv {
        name,
        kernel: values(weight),
        shape,
        bias,
        stride: conv.stride[0],
        depthwise: false,
        relu6: false,
    }
}

/// The trunk indices of the feature maps: `Conv2d_11_pointwise`, `Conv2d_13_pointwise`, then
/// the 3x3 layer of each extra layer (trunk: `Conv2d_0`, 13 depthwise / pointwise pairs, 4
/// extra 1x1 / 3x3 pairs).
pub(crate) const FEATURE_MAP_UNITS: [usize; 6] = [22, 26, 28, 30, 32, 34];

impl FrozenNetwork {
    /// Freezes `model`, built from `config`.
    pub fn new<B: SsdBackend>(model: &Ssd<B>, config: &SsdConfig) -> Result<Self> {
        crate::inference::check_network(config, model)?;
        let trunk: Vec<FrozenConv> = model
            .conv_units()
            .into_iter()
            .zip(unit_names(config))
            .map(|(unit, name)| fold_unit(unit, name))
            .collect();
        debug_assert_eq!(trunk.len(), FEATURE_MAP_UNITS[5] + 1);
        let heads = |convs: &[Conv2d<B>], kind: &str| -> Vec<FrozenConv> {
            convs
                .iter()
                .enumerate()
                .map(|(i, c)| head(c, format!("BoxPredictor_{i}/{kind}")))
                .collect()
        };
        Ok(Self {
            image_size: config.image_size,
            trunk,
            feature_maps: FEATURE_MAP_UNITS.to_vec(),
            box_heads: heads(&model.box_heads, "BoxEncodingPredictor"),
            class_heads: heads(&model.class_heads, "ClassPredictor"),
            num_classes: config.num_classes,
            anchors: anchors(config),
        })
    }

    /// Anchors as `[ycenter, xcenter, height, width]` rows, the form TFLite's post-processing
    /// op takes and the box decoding uses.
    pub fn anchors_center_size(&self) -> Vec<f32> {
        self.anchors
            .iter()
            .flat_map(|a| {
                let (y, x, h, w) = a.center_size();
                [y, x, h, w]
            })
            .collect()
    }

    /// Anchors per cell of each feature map (from its box head's channels).
    pub fn anchors_per_cell(&self) -> Vec<usize> {
        self.box_heads
            .iter()
            .map(|h| h.out_channels() / crate::box_coder::BoxCoder::CODE_SIZE)
            .collect()
    }
}

/// Output side of a TF "SAME" convolution, and the padding `(before, after)` it needs.
pub(crate) fn same_padding(size: usize, kernel: usize, stride: usize) -> (usize, (usize, usize)) {
    let out = size.div_ceil(stride);
    let total = ((out - 1) * stride + kernel).saturating_sub(size);
    (out, (total / 2, total - total / 2))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn same_padding_puts_the_odd_pixel_after() {
        // 4 -> 2 with a 3x3 stride-2 kernel needs one padded pixel, at the end (as TF)
        assert_eq!(same_padding(4, 3, 2), (2, (0, 1)));
        assert_eq!(same_padding(5, 3, 2), (3, (1, 1)));
        assert_eq!(same_padding(7, 1, 1), (7, (0, 0)));
        assert_eq!(same_padding(3, 3, 1), (3, (1, 1)));
    }
}
