//! TFLite export in the layout of the API's `export_tflite_ssd_graph.py` + TFLite converter,
//! the layout the TFLite Android / iOS object detection examples read:
//!
//! | | tensor | shape |
//! |---|---|---|
//! | input 0 | `normalized_input_image_tensor`: RGB scaled as `(2 / 255) x - 1` | `[1, H, W, 3]` |
//! | output 0 | `TFLite_Detection_PostProcess`: boxes `[ymin, xmin, ymax, xmax]`, normalised | `[1, max_detections, 4]` |
//! | output 1 | `TFLite_Detection_PostProcess:1`: class index without background (label-map id - 1) | `[1, max_detections]` |
//! | output 2 | `TFLite_Detection_PostProcess:2`: score | `[1, max_detections]` |
//! | output 3 | `TFLite_Detection_PostProcess:3`: number of valid detections | `[1]` |
//!
//! All float32 by default. Inside: `CONV_2D` / `DEPTHWISE_CONV_2D` with BatchNorm folded in and ReLU6
//! fused, each head's output `RESHAPE`d to `[1, anchors, k]` and `CONCATENATION`s into
//! `raw_outputs/box_encodings` `[1, N, 4]` and (after `LOGISTIC`)
//! `raw_outputs/class_predictions` `[1, N, num_classes + 1]` (background first), which feed the
//! `TFLite_Detection_PostProcess` custom op with the constant `anchors` `[N, 4]`
//! (`[ycenter, xcenter, height, width]`) and its options from [`PostProcessOptions::new`].
//!
//! [`Precision::Int8`] quantizes the network after training ([`super::quantize`]): the same
//! graph with int8 activations and weights and int32 biases, the input `uint8` (or `int8`, or
//! `float32` for apps that feed floats) followed by a `QUANTIZE` to int8 where it is not int8
//! already, and a `DEQUANTIZE` of the box codes and the scores before the post-processing op,
//! whose TFLite kernel reads float32 (or uint8) but not int8; its outputs stay float32.
//!
//! The flatbuffer is written table by table with the `flatbuffers` builder; the field slots
//! are those of TFLite's `schema.fbs`.

use std::path::Path;

use flatbuffers::{FlatBufferBuilder, Push, PushAlignment, WIPOffset};

use crate::config::SsdConfig;
use crate::error::{ModelError, Result};
use crate::export::network::{FrozenConv, FrozenNetwork};
use crate::export::quantize::{
    Activations, Affine, Calibration, bias_scales, quantize_per_channel,
};
use crate::ops::SsdBackend;
use crate::ssd::Ssd;

/// The name of the input tensor.
pub const INPUT_NAME: &str = "normalized_input_image_tensor";
/// The custom post-processing op (and the name of its first output).
pub const POSTPROCESS_OP: &str = "TFLite_Detection_PostProcess";
/// The raw box codes `[1, N, 4]` (an intermediate tensor).
pub const BOX_ENCODINGS_NAME: &str = "raw_outputs/box_encodings";
/// The sigmoid scores `[1, N, num_classes + 1]` (an intermediate tensor).
pub const CLASS_PREDICTIONS_NAME: &str = "raw_outputs/class_predictions";
/// The file identifier of TFLite flatbuffers.
pub const FILE_IDENTIFIER: &str = "TFL3";

/// Options of the `TFLite_Detection_PostProcess` op, as its flexbuffer map names them.
#[derive(Debug, Clone, PartialEq)]
pub struct PostProcessOptions {
    /// `max_detections`: `post_processing.max_total_detections`.
    pub max_detections: i32,
    /// `max_classes_per_detection`: 1, the API export's fixed value (fast NMS only).
    pub max_classes_per_detection: i32,
    /// `detections_per_class`: `post_processing.max_detections_per_class`.
    pub detections_per_class: i32,
    /// `use_regular_nms`: true, the per-class NMS of the API's post-processing (the API
    /// export's default is the fast variant, which has no counterpart in our post-processing).
    pub use_regular_nms: bool,
    /// `nms_score_threshold`: the op keeps scores `>=` it, the config's threshold is strict
    /// (`>`), so this is the next float above `post_processing.score_threshold`.
    pub nms_score_threshold: f32,
    /// `nms_iou_threshold`: `post_processing.iou_threshold`.
    pub nms_iou_threshold: f32,
    /// `num_classes`: classes without the background.
    pub num_classes: i32,
    /// `y_scale`, `x_scale`, `h_scale`, `w_scale`: `box_coder_scales`.
    pub scales: [f32; 4],
}

fn inexpressible(field: &'static str, problem: impl Into<String>) -> ModelError {
    ModelError::InvalidConfig {
        field,
        problem: format!(
            "cannot be expressed in TFLite_Detection_PostProcess: {}",
            problem.into()
        ),
    }
}

fn to_i32(field: &'static str, value: usize) -> Result<i32> {
    i32::try_from(value).map_err(|_| inexpressible(field, format!("{value} exceeds an int32")))
}

impl PostProcessOptions {
    /// The op's options for `config`; an error names a setting the op has no equivalent for.
    pub fn new(config: &SsdConfig) -> Result<Self> {
        let p = &config.post_processing;
        if !(p.iou_threshold > 0.0 && p.iou_threshold <= 1.0) {
            return Err(inexpressible(
                "post_processing.iou_threshold",
                format!("the op requires a value in (0, 1], got {}", p.iou_threshold),
            ));
        }
        Ok(Self {
            max_detections: to_i32(
                "post_processing.max_total_detections",
                p.max_total_detections,
            )?,
            max_classes_per_detection: 1,
            detections_per_class: to_i32(
                "post_processing.max_detections_per_class",
                p.max_detections_per_class,
            )?,
            use_regular_nms: true,
            nms_score_threshold: p.score_threshold.next_up(),
            nms_iou_threshold: p.iou_threshold,
            num_classes: to_i32("num_classes", config.num_classes)?,
            scales: config.box_coder_scales,
        })
    }

    /// The flexbuffer map the op's `Init` reads.
    pub fn to_flexbuffer(&self) -> Vec<u8> {
        let mut builder = flexbuffers::Builder::default();
        let mut map = builder.start_map();
        map.push("max_detections", self.max_detections);
        map.push("max_classes_per_detection", self.max_classes_per_detection);
        map.push("detections_per_class", self.detections_per_class);
        map.push("use_regular_nms", self.use_regular_nms);
        map.push("nms_score_threshold", self.nms_score_threshold);
        map.push("nms_iou_threshold", self.nms_iou_threshold);
        map.push("num_classes", self.num_classes);
        for (key, scale) in ["y_scale", "x_scale", "h_scale", "w_scale"]
            .into_iter()
            .zip(self.scales)
        {
            map.push(key, scale);
        }
        map.end_map();
        builder.view().to_vec()
    }
}

/// The element type of an int8 model's input tensor.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum InputType {
    /// Camera pixels `p` in `[0, 255]`, read as `(2 / 255) (p - 128)`.
    Uint8,
    /// Pixels minus 128, `p - 128` in `[-128, 127]`, read as `(2 / 255) (p - 128)`.
    Int8,
    /// The float model's input, `(2 / 255) p - 1`, quantized by the model's first op.
    Float32,
}

/// How the exported network computes.
#[derive(Debug, Clone, Copy)]
pub enum Precision<'a> {
    /// Float32 throughout.
    Float32,
    /// Int8 up to the post-processing op, the activation ranges from `calibration`.
    Int8 {
        /// The activation ranges.
        calibration: &'a Calibration,
        /// The input tensor's type.
        input: InputType,
    },
}

/// The model as TFLite flatbuffer bytes.
pub fn to_tflite<B: SsdBackend>(
    model: &Ssd<B>,
    config: &SsdConfig,
    precision: Precision,
) -> Result<Vec<u8>> {
    let options = PostProcessOptions::new(config)?;
    let net = FrozenNetwork::new(model, config)?;
    let int8 = match precision {
        Precision::Float32 => None,
        Precision::Int8 { calibration, input } => Some(Int8 {
            activations: calibration.activations()?,
            input,
        }),
    };
    Ok(serialize(&build_graph(&net, &options, int8.as_ref())))
}

/// Writes the model as a `.tflite` file (atomically).
pub fn write_tflite<B: SsdBackend>(
    model: &Ssd<B>,
    config: &SsdConfig,
    precision: Precision,
    path: &Path,
) -> Result<()> {
    let bytes = to_tflite(model, config, precision)?;
    crate::io::write_atomic(path, &bytes).map_err(|source| ModelError::Io {
        action: "writing",
        path: path.to_path_buf(),
        source,
    })
}

// `BuiltinOperator` codes and `BuiltinOptions` union indices of schema.fbs.
const CONCATENATION: i32 = 2;
const CONV_2D: i32 = 3;
const DEPTHWISE_CONV_2D: i32 = 4;
const DEQUANTIZE: i32 = 6;
const LOGISTIC: i32 = 14;
const RESHAPE: i32 = 22;
const CUSTOM: i32 = 32;
const QUANTIZE: i32 = 114;
const CONV_2D_OPTIONS: u8 = 1;
const DEPTHWISE_CONV_2D_OPTIONS: u8 = 2;
const CONCATENATION_OPTIONS: u8 = 10;
const RESHAPE_OPTIONS: u8 = 17;
// `TensorType` and `ActivationFunctionType` values.
const FLOAT32: i8 = 0;
const INT32: i8 = 2;
const UINT8: i8 = 3;
const INT8: i8 = 9;
const RELU6: i8 = 3;

/// An int8 export's settings, checked.
struct Int8 {
    activations: Activations,
    input: InputType,
}

/// `QuantizationParameters`: `real = scale * (q - zero_point)`, per tensor (one scale) or per
/// slice along dimension `axis`.
#[derive(Debug, Clone, PartialEq)]
struct Quantization {
    scale: Vec<f32>,
    zero_point: Vec<i64>,
    axis: i32,
}

/// A tensor's element type and, for integers that stand for reals, their quantization.
#[derive(Debug, Clone, PartialEq)]
struct Elem {
    dtype: i8,
    quantization: Option<Quantization>,
}

impl Elem {
    const FLOAT32: Elem = Elem {
        dtype: FLOAT32,
        quantization: None,
    };

    fn quantized(dtype: i8, a: Affine) -> Elem {
        Elem {
            dtype,
            quantization: Some(Quantization {
                scale: vec![a.scale],
                zero_point: vec![i64::from(a.zero_point)],
                axis: 0,
            }),
        }
    }

    /// Scales per slice along dimension `axis`, zero points 0.
    fn per_axis(dtype: i8, scale: Vec<f32>, axis: i32) -> Elem {
        Elem {
            dtype,
            quantization: Some(Quantization {
                zero_point: vec![0; scale.len()],
                scale,
                axis,
            }),
        }
    }

    /// Int8 with `a`, or float32.
    fn int8_or_float(a: Option<Affine>) -> Elem {
        a.map_or(Elem::FLOAT32, |a| Elem::quantized(INT8, a))
    }

    /// The scale of a per-tensor quantized element.
    fn scale(&self) -> Option<f32> {
        self.quantization.as_ref().map(|q| q.scale[0])
    }
}

/// A tensor of the graph; `buffer` 0 is the empty buffer of non-constant tensors.
struct TensorDef {
    name: String,
    shape: Vec<i32>,
    elem: Elem,
    buffer: u32,
}

/// The operator-specific options of an operator.
enum OpOptions {
    None,
    Conv {
        stride: i32,
        depthwise: bool,
        relu6: bool,
    },
    Concat {
        axis: i32,
    },
    Reshape {
        shape: Vec<i32>,
    },
    Custom(Vec<u8>),
}

struct OpDef {
    opcode: u32,
    inputs: Vec<i32>,
    outputs: Vec<i32>,
    options: OpOptions,
}

/// A TFLite graph under construction: one subgraph, its constants in `buffers`.
struct Graph {
    /// `(builtin code, custom name, version)` of each operator code.
    opcodes: Vec<(i32, Option<&'static str>, i32)>,
    tensors: Vec<TensorDef>,
    buffers: Vec<Vec<u8>>,
    ops: Vec<OpDef>,
    inputs: Vec<i32>,
    outputs: Vec<i32>,
}

fn dims(shape: &[usize]) -> Vec<i32> {
    shape.iter().map(|&d| d as i32).collect()
}

impl Graph {
    fn new() -> Self {
        Self {
            opcodes: Vec::new(),
            tensors: Vec::new(),
            // the schema's convention: buffer 0 is empty
            buffers: vec![Vec::new()],
            ops: Vec::new(),
            inputs: Vec::new(),
            outputs: Vec::new(),
        }
    }

    fn tensor(&mut self, name: impl Into<String>, shape: &[usize], elem: Elem) -> i32 {
        self.push_tensor(name.into(), dims(shape), elem, 0)
    }

    fn push_tensor(&mut self, name: String, shape: Vec<i32>, elem: Elem, buffer: u32) -> i32 {
        self.tensors.push(TensorDef {
            name,
            shape,
            elem,
            buffer,
        });
        self.tensors.len() as i32 - 1
    }

    fn elem(&self, tensor: i32) -> &Elem {
        &self.tensors[tensor as usize].elem
    }

    fn constant(&mut self, name: String, shape: Vec<i32>, elem: Elem, bytes: Vec<u8>) -> i32 {
        self.buffers.push(bytes);
        let buffer = self.buffers.len() as u32 - 1;
        self.push_tensor(name, shape, elem, buffer)
    }

    fn constant_f32(&mut self, name: String, shape: &[usize], values: &[f32]) -> i32 {
        let bytes = values.iter().flat_map(|v| v.to_le_bytes()).collect();
        self.constant(name, dims(shape), Elem::FLOAT32, bytes)
    }

    fn op(
        &mut self,
        (code, custom): (i32, Option<&'static str>),
        inputs: Vec<i32>,
        outputs: Vec<i32>,
        options: OpOptions,
    ) {
        let input_int8 = self.elem(inputs[0]).dtype == INT8;
        let code = (code, custom, op_version(code, input_int8));
        let opcode = match self.opcodes.iter().position(|c| *c == code) {
            Some(i) => i,
            None => {
                self.opcodes.push(code);
                self.opcodes.len() - 1
            }
        } as u32;
        self.ops.push(OpDef {
            opcode,
            inputs,
            outputs,
            options,
        });
    }

    /// Adds `conv` on `input` (`[1, h, w, c]`), its output of type `out`; returns the output
    /// tensor and its `(h, w)`. The weights are int8 where the input is.
    fn conv(
        &mut self,
        input: i32,
        (h, w): (usize, usize),
        conv: &FrozenConv,
        out: Elem,
    ) -> (i32, (usize, usize)) {
        let (kernel, bias) = match self.elem(input).scale() {
            Some(input_scale) => self.int8_weights(conv, input_scale),
            None => {
                let (kernel, shape) = channels_last_kernel(conv);
                let name = format!("{}/weights", conv.name);
                let kernel = self.constant_f32(name, &shape, &kernel);
                let name = format!("{}/bias", conv.name);
                (
                    kernel,
                    self.constant_f32(name, &[conv.bias.len()], &conv.bias),
                )
            }
        };
        let out_hw = (h.div_ceil(conv.stride), w.div_ceil(conv.stride));
        let suffix = if conv.relu6 { "Relu6" } else { "BiasAdd" };
        let output = self.tensor(
            format!("{}/{suffix}", conv.name),
            &[1, out_hw.0, out_hw.1, conv.out_channels()],
            out,
        );
        let code = if conv.depthwise {
            DEPTHWISE_CONV_2D
        } else {
            CONV_2D
        };
        let options = OpOptions::Conv {
            stride: conv.stride as i32,
            depthwise: conv.depthwise,
            relu6: conv.relu6,
        };
        self.op(
            (code, None),
            vec![input, kernel, bias],
            vec![output],
            options,
        );
        (output, out_hw)
    }

    /// `conv`'s kernel in int8, per output channel: dimension 0 of `CONV_2D`'s
    /// `[out, k, k, in]`, dimension 3 of `DEPTHWISE_CONV_2D`'s `[1, k, k, channels]`; and its
    /// bias in int32 at `input_scale` times each channel's weight scale (a bias beyond the
    /// int32 codes widens its channel's weight scale).
    fn int8_weights(&mut self, conv: &FrozenConv, input_scale: f32) -> (i32, i32) {
        let (kernel, shape) = channels_last_kernel(conv);
        let channels = conv.out_channels();
        let per_channel = kernel.len() / channels;
        let q = if conv.depthwise {
            quantize_per_channel(&kernel, |i| i % channels, &conv.bias, input_scale)
        } else {
            quantize_per_channel(&kernel, |i| i / per_channel, &conv.bias, input_scale)
        };
        let axis = if conv.depthwise { 3 } else { 0 };
        let kernel = self.constant(
            format!("{}/weights", conv.name),
            dims(&shape),
            Elem::per_axis(INT8, q.scales.clone(), axis),
            q.codes.iter().map(|&c| c as u8).collect(),
        );
        let bias = self.constant(
            format!("{}/bias", conv.name),
            vec![channels as i32],
            Elem::per_axis(INT32, bias_scales(input_scale, &q.scales), 0),
            q.bias.iter().flat_map(|c| c.to_le_bytes()).collect(),
        );
        (kernel, bias)
    }

    /// Adds a one-input op without options (`LOGISTIC`, `QUANTIZE`, `DEQUANTIZE`).
    fn unary(&mut self, code: i32, input: i32, name: impl Into<String>, out: Elem) -> i32 {
        let shape = self.tensors[input as usize].shape.clone();
        let output = self.push_tensor(name.into(), shape, out, 0);
        self.op((code, None), vec![input], vec![output], OpOptions::None);
        output
    }

    /// Reshapes `input` to `shape` (given as a constant input and as options, as the converter
    /// writes it).
    fn reshape(&mut self, input: i32, name: String, shape: &[usize]) -> i32 {
        let shape = dims(shape);
        let bytes = shape.iter().flat_map(|v| v.to_le_bytes()).collect();
        let shape_tensor = self.constant(
            format!("{name}/shape"),
            vec![shape.len() as i32],
            Elem {
                dtype: INT32,
                quantization: None,
            },
            bytes,
        );
        // int8: the input's parameters, as the specification requires
        let elem = self.elem(input).clone();
        let output = self.push_tensor(name, shape.clone(), elem, 0);
        self.op(
            (RESHAPE, None),
            vec![input, shape_tensor],
            vec![output],
            OpOptions::Reshape { shape },
        );
        output
    }

    /// Concatenates `inputs`, which share one type (int8: the same parameters, as the
    /// specification requires of the inputs and the output).
    fn concat(&mut self, inputs: Vec<i32>, name: &str, shape: &[usize]) -> i32 {
        let elem = self.elem(inputs[0]).clone();
        let output = self.tensor(name, shape, elem);
        self.op(
            (CONCATENATION, None),
            inputs,
            vec![output],
            OpOptions::Concat { axis: 1 },
        );
        output
    }
}

/// The kernel in TFLite's layout and its shape: `[out, k, k, in]` for `CONV_2D`,
/// `[1, k, k, channels]` for `DEPTHWISE_CONV_2D`.
fn channels_last_kernel(conv: &FrozenConv) -> (Vec<f32>, [usize; 4]) {
    let [o, i, kh, kw] = conv.shape;
    let at =
        |oc: usize, ic: usize, y: usize, x: usize| conv.kernel[((oc * i + ic) * kh + y) * kw + x];
    let mut out = Vec::with_capacity(conv.kernel.len());
    if conv.depthwise {
        for y in 0..kh {
            for x in 0..kw {
                out.extend((0..o).map(|c| at(c, 0, y, x)));
            }
        }
        return (out, [1, kh, kw, o]);
    }
    for oc in 0..o {
        for y in 0..kh {
            for x in 0..kw {
                out.extend((0..i).map(|ic| at(oc, ic, y, x)));
            }
        }
    }
    (out, [o, kh, kw, i])
}

/// The operator version TFLite's converter gives `code` (versioning: the int8 kernels came
/// in these versions).
fn op_version(code: i32, input_int8: bool) -> i32 {
    match (code, input_int8) {
        (CONV_2D | DEPTHWISE_CONV_2D, true) => 3,
        (CONCATENATION | LOGISTIC | DEQUANTIZE, true) => 2,
        _ => 1,
    }
}

/// Adds the graph's input; returns the tensor the first convolution reads: the input, or for
/// an int8 network whose input is not int8, the input quantized.
fn add_input(g: &mut Graph, [h, w]: [usize; 2], int8: Option<&Int8>) -> i32 {
    let shape = [1, h, w, 3];
    let elem = match int8.map(|q| q.input) {
        None | Some(InputType::Float32) => Elem::FLOAT32,
        Some(InputType::Int8) => Elem::quantized(INT8, Affine::INPUT),
        // the same reals as int8: the zero point 128 higher
        Some(InputType::Uint8) => Elem::quantized(
            UINT8,
            Affine {
                zero_point: Affine::INPUT.zero_point + 128,
                ..Affine::INPUT
            },
        ),
    };
    let needs_quantize = int8.is_some() && elem.dtype != INT8;
    let input = g.tensor(INPUT_NAME, &shape, elem);
    g.inputs.push(input);
    if !needs_quantize {
        return input;
    }
    let int8_input = Elem::quantized(INT8, Affine::INPUT);
    g.unary(QUANTIZE, input, format!("{INPUT_NAME}/int8"), int8_input)
}

/// The whole inference graph of `net` with the post-processing op, int8 up to it with `int8`.
fn build_graph(net: &FrozenNetwork, options: &PostProcessOptions, int8: Option<&Int8>) -> Graph {
    let mut g = Graph::new();
    let acts = int8.map(|q| &q.activations);
    let mut x = add_input(&mut g, net.image_size, int8);
    let mut hw = (net.image_size[0], net.image_size[1]);
    let mut maps = Vec::new();
    for (i, conv) in net.trunk.iter().enumerate() {
        let out = Elem::int8_or_float(acts.map(|a| a.trunk[i]));
        (x, hw) = g.conv(x, hw, conv, out);
        if net.feature_maps.contains(&i) {
            maps.push((x, hw));
        }
    }
    let n = net.anchors.len();
    let classes = net.num_classes + 1;
    let (mut boxes, mut scores) = (Vec::new(), Vec::new());
    let heads = net.box_heads.iter().zip(&net.class_heads);
    for (((map, hw), (box_head, class_head)), a) in
        maps.into_iter().zip(heads).zip(net.anchors_per_cell())
    {
        let cells = hw.0 * hw.1 * a;
        let out = Elem::int8_or_float(acts.map(|a| a.box_codes));
        let (b, _) = g.conv(map, hw, box_head, out);
        boxes.push(g.reshape(b, format!("{}/Reshape", box_head.name), &[1, cells, 4]));
        let out = Elem::int8_or_float(acts.map(|a| a.class_logits));
        let (c, _) = g.conv(map, hw, class_head, out);
        scores.push(g.reshape(
            c,
            format!("{}/Reshape", class_head.name),
            &[1, cells, classes],
        ));
    }
    let boxes = g.concat(boxes, BOX_ENCODINGS_NAME, &[1, n, 4]);
    let logits = g.concat(scores, "concat_1", &[1, n, classes]);
    let out = Elem::int8_or_float(acts.map(|_| Affine::LOGISTIC));
    let scores = g.unary(LOGISTIC, logits, CLASS_PREDICTIONS_NAME, out);
    // the op's kernel reads float32 (or uint8) box codes and scores, not int8
    let (boxes, scores) = match int8 {
        None => (boxes, scores),
        Some(_) => (
            g.unary(
                DEQUANTIZE,
                boxes,
                format!("{BOX_ENCODINGS_NAME}/dequantize"),
                Elem::FLOAT32,
            ),
            g.unary(
                DEQUANTIZE,
                scores,
                format!("{CLASS_PREDICTIONS_NAME}/dequantize"),
                Elem::FLOAT32,
            ),
        ),
    };
    let anchors = g.constant_f32("anchors".into(), &[n, 4], &net.anchors_center_size());
    let m = options.max_detections as usize;
    let outputs = vec![
        g.tensor(POSTPROCESS_OP, &[1, m, 4], Elem::FLOAT32),
        g.tensor(format!("{POSTPROCESS_OP}:1"), &[1, m], Elem::FLOAT32),
        g.tensor(format!("{POSTPROCESS_OP}:2"), &[1, m], Elem::FLOAT32),
        g.tensor(format!("{POSTPROCESS_OP}:3"), &[1], Elem::FLOAT32),
    ];
    let custom = OpOptions::Custom(options.to_flexbuffer());
    g.op(
        (CUSTOM, Some(POSTPROCESS_OP)),
        vec![boxes, scores, anchors],
        outputs.clone(),
        custom,
    );
    g.outputs = outputs;
    g
}

/// A byte of a `Buffer`'s data: the schema aligns that vector to 16 bytes (`force_align`),
/// which the builder does for an element type of that alignment.
#[derive(Clone, Copy)]
struct Aligned16(u8);

impl Push for Aligned16 {
    type Output = u8;

    unsafe fn push(&self, dst: &mut [u8], _written_len: usize) {
        dst[0] = self.0;
    }

    fn size() -> usize {
        1
    }

    fn alignment() -> PushAlignment {
        PushAlignment::new(16)
    }
}

/// The vtable offset of field `id` of a table.
const fn slot(id: u16) -> flatbuffers::VOffsetT {
    4 + 2 * id
}

type Table = WIPOffset<flatbuffers::TableFinishedWIPOffset>;

fn serialize(g: &Graph) -> Vec<u8> {
    let size: usize = g.buffers.iter().map(|b| b.len() + 32).sum();
    let mut fbb = FlatBufferBuilder::with_capacity(size + (1 << 16));
    let buffers: Vec<Table> = g
        .buffers
        .iter()
        .map(|b| buffer_table(&mut fbb, b))
        .collect();
    let buffers = fbb.create_vector(&buffers);
    let tensors: Vec<Table> = g
        .tensors
        .iter()
        .map(|t| tensor_table(&mut fbb, t))
        .collect();
    let tensors = fbb.create_vector(&tensors);
    let ops: Vec<Table> = g
        .ops
        .iter()
        .map(|op| operator_table(&mut fbb, op))
        .collect();
    let ops = fbb.create_vector(&ops);
    let (inputs, outputs) = (fbb.create_vector(&g.inputs), fbb.create_vector(&g.outputs));
    let name = fbb.create_string("main");
    let start = fbb.start_table();
    fbb.push_slot_always(slot(0), tensors);
    fbb.push_slot_always(slot(1), inputs);
    fbb.push_slot_always(slot(2), outputs);
    fbb.push_slot_always(slot(3), ops);
    fbb.push_slot_always(slot(4), name);
    let subgraph = fbb.end_table(start);
    let subgraphs = fbb.create_vector(&[subgraph]);
    let codes: Vec<Table> = g
        .opcodes
        .iter()
        .map(|&(code, custom, version)| opcode_table(&mut fbb, code, custom, version))
        .collect();
    let codes = fbb.create_vector(&codes);
    let description = fbb.create_string("SSD-MobileNet-v1 (ssd-burn)");
    let start = fbb.start_table();
    fbb.push_slot::<u32>(slot(0), 3, 0); // schema version 3
    fbb.push_slot_always(slot(1), codes);
    fbb.push_slot_always(slot(2), subgraphs);
    fbb.push_slot_always(slot(3), description);
    fbb.push_slot_always(slot(4), buffers);
    let model = fbb.end_table(start);
    fbb.finish(model, Some(FILE_IDENTIFIER));
    fbb.finished_data().to_vec()
}

fn buffer_table(fbb: &mut FlatBufferBuilder, data: &[u8]) -> Table {
    let data = (!data.is_empty()).then(|| {
        let aligned: Vec<Aligned16> = data.iter().map(|&b| Aligned16(b)).collect();
        fbb.create_vector(&aligned)
    });
    let start = fbb.start_table();
    if let Some(data) = data {
        fbb.push_slot_always(slot(0), data);
    }
    fbb.end_table(start)
}

fn tensor_table(fbb: &mut FlatBufferBuilder, t: &TensorDef) -> Table {
    let shape = fbb.create_vector(&t.shape);
    let name = fbb.create_string(&t.name);
    let quantization = t
        .elem
        .quantization
        .as_ref()
        .map(|q| quantization_table(fbb, q));
    let start = fbb.start_table();
    fbb.push_slot_always(slot(0), shape);
    fbb.push_slot::<i8>(slot(1), t.elem.dtype, 0);
    fbb.push_slot::<u32>(slot(2), t.buffer, 0);
    fbb.push_slot_always(slot(3), name);
    if let Some(quantization) = quantization {
        fbb.push_slot_always(slot(4), quantization);
    }
    fbb.end_table(start)
}

/// `QuantizationParameters`: `scale` (slot 2), `zero_point` (3), `quantized_dimension` (6).
fn quantization_table(fbb: &mut FlatBufferBuilder, q: &Quantization) -> Table {
    let scale = fbb.create_vector(&q.scale);
    let zero_point = fbb.create_vector(&q.zero_point);
    let start = fbb.start_table();
    fbb.push_slot_always(slot(2), scale);
    fbb.push_slot_always(slot(3), zero_point);
    fbb.push_slot::<i32>(slot(6), q.axis, 0);
    fbb.end_table(start)
}

/// `OperatorCode`: the code in both the old byte field and the int field that replaced it.
fn opcode_table(
    fbb: &mut FlatBufferBuilder,
    code: i32,
    custom: Option<&str>,
    version: i32,
) -> Table {
    let custom = custom.map(|name| fbb.create_string(name));
    let start = fbb.start_table();
    fbb.push_slot::<i8>(slot(0), code as i8, 0);
    if let Some(custom) = custom {
        fbb.push_slot_always(slot(1), custom);
    }
    fbb.push_slot::<i32>(slot(2), version, 1);
    fbb.push_slot::<i32>(slot(3), code, 0);
    fbb.end_table(start)
}

/// The builtin options table of `options` and its union type.
fn options_table(fbb: &mut FlatBufferBuilder, options: &OpOptions) -> Option<(u8, Table)> {
    match options {
        OpOptions::None | OpOptions::Custom(_) => None,
        &OpOptions::Conv {
            stride,
            depthwise,
            relu6,
        } => {
            let activation = if relu6 { RELU6 } else { 0 };
            // padding (slot 0): SAME, the default; then stride_w, stride_h
            let start = fbb.start_table();
            fbb.push_slot::<i32>(slot(1), stride, 0);
            fbb.push_slot::<i32>(slot(2), stride, 0);
            if depthwise {
                fbb.push_slot::<i32>(slot(3), 1, 0); // depth_multiplier
                fbb.push_slot::<i8>(slot(4), activation, 0);
                Some((DEPTHWISE_CONV_2D_OPTIONS, fbb.end_table(start)))
            } else {
                fbb.push_slot::<i8>(slot(3), activation, 0);
                Some((CONV_2D_OPTIONS, fbb.end_table(start)))
            }
        }
        &OpOptions::Concat { axis } => {
            let start = fbb.start_table();
            fbb.push_slot::<i32>(slot(0), axis, 0);
            Some((CONCATENATION_OPTIONS, fbb.end_table(start)))
        }
        OpOptions::Reshape { shape } => {
            let shape = fbb.create_vector(shape);
            let start = fbb.start_table();
            fbb.push_slot_always(slot(0), shape);
            Some((RESHAPE_OPTIONS, fbb.end_table(start)))
        }
    }
}

fn operator_table(fbb: &mut FlatBufferBuilder, op: &OpDef) -> Table {
    let inputs = fbb.create_vector(&op.inputs);
    let outputs = fbb.create_vector(&op.outputs);
    let builtin = options_table(fbb, &op.options);
    let custom = match &op.options {
        OpOptions::Custom(bytes) => Some(fbb.create_vector(bytes)),
        _ => None,
    };
    let start = fbb.start_table();
    fbb.push_slot::<u32>(slot(0), op.opcode, 0);
    fbb.push_slot_always(slot(1), inputs);
    fbb.push_slot_always(slot(2), outputs);
    if let Some((kind, table)) = builtin {
        fbb.push_slot::<u8>(slot(3), kind, 0);
        fbb.push_slot_always(slot(4), table);
    }
    if let Some(custom) = custom {
        fbb.push_slot_always(slot(5), custom);
        // custom_options_format (slot 6): FLEXBUFFERS is the default, 0
    }
    fbb.end_table(start)
}
