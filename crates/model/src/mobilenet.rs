//! The MobileNet-v1 backbone up to `Conv2d_13_pointwise`, as `mobilenet_v1_base` builds it.

use burn::module::{Module, Param};
use burn::tensor::Tensor;
use burn::tensor::backend::Backend;
use rand::Rng;

use crate::config::SsdConfig;
use crate::layers::{BatchNorm, ConvBnRelu6, ConvSpec, apply_conv};
use crate::ops::SsdBackend;

/// `(stride, nominal depth)` of the 13 depthwise-separable blocks (`MOBILENETV1_CONV_DEFS`).
pub const SEPARABLE_BLOCKS: [(usize, usize); 13] = [
    (1, 64),
    (2, 128),
    (1, 128),
    (2, 256),
    (1, 256),
    (2, 512),
    (1, 512),
    (1, 512),
    (1, 512),
    (1, 512),
    (1, 512),
    (2, 1024),
    (1, 1024),
];

/// Nominal depth of `Conv2d_0` (3x3, stride 2).
pub const CONV0_DEPTH: usize = 32;

/// One depthwise-separable block: 3x3 depthwise + BN + ReLU6, then 1x1 pointwise + BN + ReLU6.
#[derive(Module, Debug)]
pub struct SeparableBlock<B: Backend> {
    /// `Conv2d_<i>_depthwise`.
    pub depthwise: ConvBnRelu6<B>,
    /// `Conv2d_<i>_pointwise`.
    pub pointwise: ConvBnRelu6<B>,
}

/// MobileNet-v1 without its classifier.
#[derive(Module, Debug)]
pub struct MobileNetV1<B: Backend> {
    /// `Conv2d_0`.
    pub conv0: ConvBnRelu6<B>,
    /// `Conv2d_1` to `Conv2d_13`.
    pub blocks: Vec<SeparableBlock<B>>,
}

impl<B: Backend> MobileNetV1<B> {
    pub(crate) fn new(config: &SsdConfig, rng: &mut impl Rng, device: &B::Device) -> Self {
        let bn = &config.batch_norm;
        let stddev = config.backbone_init_stddev;
        let mut channels = config.depth(CONV0_DEPTH);
        let conv0 = ConvBnRelu6::new(
            ConvSpec {
                in_channels: 3,
                out_channels: channels,
                kernel: 3,
                stride: 2,
                depthwise: false,
                bias: false,
                init_stddev: stddev,
            },
            bn,
            rng,
            device,
        );
        let blocks = SEPARABLE_BLOCKS
            .iter()
            .map(|&(stride, depth)| {
                let out = config.depth(depth);
                let depthwise = ConvBnRelu6::new(
                    ConvSpec {
                        in_channels: channels,
                        out_channels: channels,
                        kernel: 3,
                        stride,
                        depthwise: true,
                        bias: false,
                        init_stddev: stddev,
                    },
                    bn,
                    rng,
                    device,
                );
                let pointwise = ConvBnRelu6::new(
                    ConvSpec {
                        in_channels: channels,
                        out_channels: out,
                        kernel: 1,
                        stride: 1,
                        depthwise: false,
                        bias: false,
                        init_stddev: stddev,
                    },
                    bn,
                    rng,
                    device,
                );
                channels = out;
                SeparableBlock {
                    depthwise,
                    pointwise,
                }
            })
            .collect();
        Self { conv0, blocks }
    }

    /// Every convolution kernel of the backbone.
    pub(crate) fn conv_weights(&self) -> Vec<&Param<Tensor<B, 4>>> {
        std::iter::once(&self.conv0)
            .chain(
                self.blocks
                    .iter()
                    .flat_map(|b| [&b.depthwise, &b.pointwise]),
            )
            .map(|u| &u.conv.weight)
            .collect()
    }
}

/// A unit's output on its way to the next unit: normalised, or still before its BatchNorm +
/// ReLU6, which a depthwise convolution applies itself.
enum Activation<'a, B: Backend> {
    Normalised(Tensor<B, 4>),
    Pending(Tensor<B, 4>, &'a BatchNorm<B>),
}

impl<'a, B: SsdBackend> Activation<'a, B> {
    /// The output of `unit` on `x`: its convolution alone in float training (its BatchNorm +
    /// ReLU6 pending), the whole unit otherwise (quantization-aware training needs each
    /// unit's output to learn its range).
    fn of(unit: &'a ConvBnRelu6<B>, x: Tensor<B, 4>, training: bool) -> Self {
        if training && unit.quant.is_none() {
            Self::Pending(apply_conv(&unit.conv, x), &unit.bn)
        } else {
            Self::Normalised(unit.forward(x))
        }
    }

    fn normalised(self) -> Tensor<B, 4> {
        match self {
            Self::Normalised(x) => x,
            Self::Pending(x, bn) => bn.forward_relu6(x),
        }
    }
}

impl<B: SsdBackend> MobileNetV1<B> {
    /// Returns the `Conv2d_11_pointwise` and `Conv2d_13_pointwise` activations. In float
    /// training, each depthwise unit applies the BatchNorm + ReLU6 of the unit before it
    /// (`ConvBnRelu6::forward_after`), except after `Conv2d_11_pointwise`, whose activations
    /// are also a feature map; at inference every unit applies its own, with its convolution
    /// ([`ConvBnRelu6::forward`]).
    pub fn forward(&self, x: Tensor<B, 4>) -> (Tensor<B, 4>, Tensor<B, 4>) {
        let training = B::ad_enabled(&x.device());
        let mut x = Activation::of(&self.conv0, x, training);
        let mut conv11 = None;
        for (i, block) in self.blocks.iter().enumerate() {
            let y = match x {
                Activation::Pending(x, bn) => block.depthwise.forward_after(x, bn),
                Activation::Normalised(x) => block.depthwise.forward(x),
            };
            x = Activation::of(&block.pointwise, y, training);
            if i == 10 {
                let map = x.normalised();
                conv11 = Some(map.clone());
                x = Activation::Normalised(map);
            }
        }
        let conv11 = conv11.expect("MobileNet-v1 always has 13 blocks");
        (conv11, x.normalised())
    }
}
