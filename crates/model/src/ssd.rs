//! The SSD-MobileNet-v1 network: backbone, the four extra feature layers and the
//! convolutional box predictor with 1x1 kernels.

use burn::module::{Module, Param};
use burn::nn::conv::Conv2d;
use burn::tensor::Tensor;
use burn::tensor::backend::Backend;
use rand::SeedableRng;
use rand::rngs::StdRng;

use crate::anchors::BoxSpec;
use crate::box_coder::BoxCoder;
use crate::boxes::BBox;
use crate::config::SsdConfig;
use crate::error::Result;
use crate::fake_quant::{ActivationRange, FakeQuant, HeadRanges, quantized_heads};
use crate::layers::{BatchNorm, ConvBnRelu6, ConvSpec, apply_conv};
use crate::mobilenet::{MobileNetV1, SEPARABLE_BLOCKS};
use crate::ops::{SsdBackend, channels_last};

/// Nominal depths of the four extra feature maps (`layer_depth` of the feature map layout).
pub const EXTRA_LAYER_DEPTHS: [usize; 4] = [512, 256, 256, 128];

/// One extra feature layer: 1x1 conv to half the depth, then 3x3 stride-2 conv.
#[derive(Module, Debug)]
pub struct ExtraLayer<B: Backend> {
    /// `..._1_Conv2d_<i>_1x1_<d/2>`.
    pub reduce: ConvBnRelu6<B>,
    /// `..._2_Conv2d_<i>_3x3_s2_<d>`.
    pub expand: ConvBnRelu6<B>,
}

/// Raw network outputs for a batch, in the anchors' order.
#[derive(Debug, Clone)]
pub struct Predictions<B: Backend> {
    /// `[batch, anchors, 4]` box codes.
    pub box_encodings: Tensor<B, 3>,
    /// `[batch, anchors, num_classes + 1]` class logits, background first.
    pub class_logits: Tensor<B, 3>,
}

/// The SSD-MobileNet-v1 detector network.
#[derive(Module, Debug)]
pub struct Ssd<B: Backend> {
    /// MobileNet-v1 up to `Conv2d_13_pointwise`.
    pub backbone: MobileNetV1<B>,
    /// The four extra feature layers.
    pub extras: Vec<ExtraLayer<B>>,
    /// Box-code convolutions, one per feature map.
    pub box_heads: Vec<Conv2d<B>>,
    /// Class-logit convolutions, one per feature map.
    pub class_heads: Vec<Conv2d<B>>,
    /// The heads' learned output ranges, in quantization-aware training.
    pub head_ranges: Option<HeadRanges<B>>,
    num_classes: usize,
}

/// Spatial size after a TF "SAME" convolution of the given stride.
fn same_out(size: usize, stride: usize) -> usize {
    size.div_ceil(stride)
}

/// `(height, width)` of the six feature maps for the config's input size.
pub fn feature_map_shapes(config: &SsdConfig) -> Vec<(usize, usize)> {
    let [mut h, mut w] = config.image_size;
    let mut shapes = Vec::new();
    h = same_out(h, 2);
    w = same_out(w, 2);
    for (i, &(stride, _)) in SEPARABLE_BLOCKS.iter().enumerate() {
        h = same_out(h, stride);
        w = same_out(w, stride);
        if i == 10 || i == 12 {
            shapes.push((h, w));
        }
    }
    for _ in EXTRA_LAYER_DEPTHS {
        h = same_out(h, 2);
        w = same_out(w, 2);
        shapes.push((h, w));
    }
    shapes
}

/// The anchors of a config, in the predictor's output order.
pub fn anchors(config: &SsdConfig) -> Vec<BBox> {
    let [h, w] = config.image_size;
    config.anchors.generate(&feature_map_shapes(config), h, w)
}

impl SsdConfig {
    /// The box coder of this config.
    pub fn box_coder(&self) -> BoxCoder {
        BoxCoder::new(self.box_coder_scales)
    }

    /// Builds a freshly initialised network; `seed` fixes every initial weight.
    pub fn init<B: Backend>(&self, seed: u64, device: &B::Device) -> Result<Ssd<B>> {
        self.validate()?;
        let mut rng = StdRng::seed_from_u64(seed);
        let backbone = MobileNetV1::new(self, &mut rng, device);
        let bn = &self.batch_norm;
        let mut channels = self.depth(SEPARABLE_BLOCKS[12].1);
        let mut map_channels = vec![self.depth(SEPARABLE_BLOCKS[10].1), channels];
        let extras = EXTRA_LAYER_DEPTHS
            .iter()
            .map(|&depth| {
                let (half, full) = (self.depth(depth / 2), self.depth(depth));
                let spec = |in_channels, out_channels, kernel, stride| ConvSpec {
                    in_channels,
                    out_channels,
                    kernel,
                    stride,
                    depthwise: false,
                    bias: false,
                    init_stddev: self.init_stddev,
                };
                let reduce = ConvBnRelu6::new(spec(channels, half, 1, 1), bn, &mut rng, device);
                let expand = ConvBnRelu6::new(spec(half, full, 3, 2), bn, &mut rng, device);
                channels = full;
                map_channels.push(full);
                ExtraLayer { reduce, expand }
            })
            .collect();
        let specs: Vec<Vec<BoxSpec>> = self.anchors.box_specs();
        let head = |in_channels, out_channels| ConvSpec {
            in_channels,
            out_channels,
            kernel: 1,
            stride: 1,
            depthwise: false,
            bias: true,
            init_stddev: self.init_stddev,
        };
        let mut box_heads = Vec::new();
        let mut class_heads = Vec::new();
        for (&c, layer_specs) in map_channels.iter().zip(&specs) {
            let a = layer_specs.len();
            box_heads.push(head(c, a * BoxCoder::CODE_SIZE).init(&mut rng, device));
            class_heads.push(head(c, a * (self.num_classes + 1)).init(&mut rng, device));
        }
        let mut ssd = Ssd {
            backbone,
            extras,
            box_heads,
            class_heads,
            head_ranges: None,
            num_classes: self.num_classes,
        };
        if let Some(quantization) = &self.quantization {
            ssd.add_activation_ranges(FakeQuant::new(quantization), device);
        }
        Ok(ssd)
    }
}

/// `[batch, a * k, h, w]` (NCHW) to `[batch, h * w * a, k]`, the API's NHWC flattening.
fn flatten_head<B: SsdBackend>(x: Tensor<B, 4>, k: usize) -> Tensor<B, 3> {
    let [b, c, h, w] = x.dims();
    channels_last(x).reshape([b, h * w * (c / k), k])
}

impl<B: SsdBackend> Ssd<B> {
    /// The six feature maps for a `[batch, 3, height, width]` input in `[-1, 1]`.
    pub fn feature_maps(&self, images: Tensor<B, 4>) -> Vec<Tensor<B, 4>> {
        let (conv11, conv13) = self.backbone.forward(images);
        let mut maps = vec![conv11, conv13];
        for extra in &self.extras {
            let last = maps.last().expect("two backbone maps").clone();
            maps.push(extra.expand.forward(extra.reduce.forward(last)));
        }
        maps
    }

    /// Box codes and class logits of every anchor for a `[batch, 3, height, width]` input
    /// (run through [`SsdBackend::on_compute_thread`]).
    pub fn forward(&self, images: Tensor<B, 4>) -> Predictions<B> {
        B::on_compute_thread(|| {
            let maps = self.feature_maps(images);
            let boxes = self.head_outputs(&self.box_heads, &maps, |r| &r.boxes);
            let classes = self.head_outputs(&self.class_heads, &maps, |r| &r.classes);
            let flatten = |outputs: Vec<Tensor<B, 4>>, k: usize| {
                let flat = outputs.into_iter().map(|x| flatten_head(x, k)).collect();
                Tensor::cat(flat, 1)
            };
            Predictions {
                box_encodings: flatten(boxes, BoxCoder::CODE_SIZE),
                class_logits: flatten(classes, self.num_classes + 1),
            }
        })
    }

    /// The outputs of `heads` on `maps` (one each): fake-quantized over their shared range in
    /// quantization-aware training (`range` picks it), the plain convolutions otherwise.
    fn head_outputs(
        &self,
        heads: &[Conv2d<B>],
        maps: &[Tensor<B, 4>],
        range: impl Fn(&HeadRanges<B>) -> &ActivationRange<B>,
    ) -> Vec<Tensor<B, 4>> {
        match &self.head_ranges {
            Some(ranges) if B::ad_enabled(&maps[0].device()) => {
                quantized_heads(heads, range(ranges), maps)
            }
            _ => heads
                .iter()
                .zip(maps)
                .map(|(head, map)| apply_conv(head, map.clone()))
                .collect(),
        }
    }
}

impl<B: Backend> Ssd<B> {
    /// Gives every unit a learned output range for quantization-aware training, and each kind
    /// of head one.
    fn add_activation_ranges(&mut self, rule: FakeQuant, device: &B::Device) {
        for unit in self.conv_units_mut() {
            unit.quant = Some(ActivationRange::new(rule, device));
        }
        self.head_ranges = Some(HeadRanges {
            boxes: ActivationRange::new(rule, device),
            classes: ActivationRange::new(rule, device),
        });
    }

    /// Whether the fake quantization of quantization-aware training takes effect
    /// ([`QuantizationConfig::active_at`](crate::config::QuantizationConfig::active_at)); the
    /// ranges are learned either way. Nothing happens to a float network.
    pub fn set_fake_quant_active(&mut self, active: bool) {
        for unit in self.conv_units_mut() {
            if let Some(range) = &mut unit.quant {
                range.rule.active = active;
            }
        }
        if let Some(heads) = &mut self.head_ranges {
            heads.boxes.rule.active = active;
            heads.classes.rule.active = active;
        }
    }

    /// Every learned activation range, units first (`Conv2d_0`, the separable blocks, the extra
    /// layers, as the network runs them), then the box-code heads' one, then the class-logit
    /// heads' one; empty for a float network.
    pub fn activation_ranges(&self) -> Vec<&ActivationRange<B>> {
        let units = self
            .conv_units()
            .into_iter()
            .filter_map(|u| u.quant.as_ref());
        let heads = self.head_ranges.iter().flat_map(|h| [&h.boxes, &h.classes]);
        units.chain(heads).collect()
    }

    /// Number of object classes (without background).
    pub fn num_classes(&self) -> usize {
        self.num_classes
    }

    /// Every convolution kernel, backbone first, then extra layers, then predictor heads.
    pub(crate) fn kernels(&self) -> Vec<&Param<Tensor<B, 4>>> {
        let mut kernels = self.backbone.conv_weights();
        kernels.extend(
            self.extras
                .iter()
                .flat_map(|e| [&e.reduce.conv.weight, &e.expand.conv.weight]),
        );
        kernels.extend(
            self.box_heads
                .iter()
                .chain(&self.class_heads)
                .map(|c| &c.weight),
        );
        kernels
    }

    /// Every convolution + BatchNorm unit: `Conv2d_0`, the 13 depthwise / pointwise pairs,
    /// then each extra layer's 1x1 and 3x3 units.
    pub(crate) fn conv_units_mut(&mut self) -> Vec<&mut ConvBnRelu6<B>> {
        let mut units = vec![&mut self.backbone.conv0];
        for b in &mut self.backbone.blocks {
            units.push(&mut b.depthwise);
            units.push(&mut b.pointwise);
        }
        for e in &mut self.extras {
            units.push(&mut e.reduce);
            units.push(&mut e.expand);
        }
        units
    }

    /// The box and class predictor convolutions.
    pub(crate) fn heads_mut(&mut self) -> (&mut [Conv2d<B>], &mut [Conv2d<B>]) {
        (&mut self.box_heads, &mut self.class_heads)
    }

    /// Every convolution + BatchNorm unit in [`Ssd::conv_units_mut`] order; each feeds the
    /// next, so this is also the order of the network's layers up to the predictor heads.
    pub(crate) fn conv_units(&self) -> Vec<&ConvBnRelu6<B>> {
        std::iter::once(&self.backbone.conv0)
            .chain(
                self.backbone
                    .blocks
                    .iter()
                    .flat_map(|b| [&b.depthwise, &b.pointwise]),
            )
            .chain(self.extras.iter().flat_map(|e| [&e.reduce, &e.expand]))
            .collect()
    }

    /// Every BatchNorm of the network, in a fixed order.
    pub fn batch_norms(&self) -> Vec<&BatchNorm<B>> {
        self.conv_units().into_iter().map(|u| &u.bn).collect()
    }

    /// Number of trainable parameters as TF counts its trainable variables: kernels, BatchNorm
    /// gamma and beta, predictor biases (BatchNorm moving statistics are not trainable;
    /// Burn's `num_params` counts them too).
    pub fn num_trainable_params(&self) -> usize {
        let kernels: usize = self
            .kernels()
            .iter()
            .map(|k| k.shape().num_elements())
            .sum();
        let biases: usize = self
            .box_heads
            .iter()
            .chain(&self.class_heads)
            .filter_map(|c| c.bias.as_ref())
            .map(|b| b.shape().num_elements())
            .sum();
        let bn_units = std::iter::once(&self.backbone.conv0)
            .chain(
                self.backbone
                    .blocks
                    .iter()
                    .flat_map(|b| [&b.depthwise, &b.pointwise]),
            )
            .chain(self.extras.iter().flat_map(|e| [&e.reduce, &e.expand]));
        let bn: usize = bn_units
            .map(|u| 2 * u.bn.gamma.shape().num_elements())
            .sum();
        kernels + biases + bn
    }
}

impl<B: SsdBackend> Ssd<B> {
    /// `sum(w^2) / 2` over every convolution kernel (biases and BatchNorm excluded), the
    /// quantity `tf.nn.l2_loss` regularises.
    pub fn l2_half_sum_of_squares(&self) -> Tensor<B, 1> {
        self.kernels()
            .into_iter()
            .map(|k| crate::ops::half_squared_norm(k.val()))
            .reduce(|a, b| a + b)
            .expect("the network has kernels")
    }
}
