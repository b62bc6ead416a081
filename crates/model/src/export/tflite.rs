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
//! All float32. Inside: `CONV_2D` / `DEPTHWISE_CONV_2D` with BatchNorm folded in and ReLU6
//! fused, each head's output `RESHAPE`d to `[1, anchors, k]` and `CONCATENATION`s into
//! `raw_outputs/box_encodings` `[1, N, 4]` and (after `LOGISTIC`)
//! `raw_outputs/class_predictions` `[1, N, num_classes + 1]` (background first), which feed the
//! `TFLite_Detection_PostProcess` custom op with the constant `anchors` `[N, 4]`
//! (`[ycenter, xcenter, height, width]`) and its options from [`PostProcessOptions::new`].
//!
//! The flatbuffer is written table by table with the `flatbuffers` builder; the field slots
//! are those of TFLite's `schema.fbs`.

use std::path::Path;

use flatbuffers::{FlatBufferBuilder, Push, PushAlignment, WIPOffset};

use crate::config::SsdConfig;
use crate::error::{ModelError, Result};
use crate::export::network::{FrozenConv, FrozenNetwork};
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

/// The model as TFLite flatbuffer bytes.
pub fn to_tflite<B: SsdBackend>(model: &Ssd<B>, config: &SsdConfig) -> Result<Vec<u8>> {
    let options = PostProcessOptions::new(config)?;
    let net = FrozenNetwork::new(model, config)?;
    Ok(serialize(&build_graph(&net, &options)))
}

/// Writes the model as a `.tflite` file (atomically).
pub fn write_tflite<B: SsdBackend>(model: &Ssd<B>, config: &SsdConfig, path: &Path) -> Result<()> {
    let bytes = to_tflite(model, config)?;
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
const LOGISTIC: i32 = 14;
const RESHAPE: i32 = 22;
const CUSTOM: i32 = 32;
const CONV_2D_OPTIONS: u8 = 1;
const DEPTHWISE_CONV_2D_OPTIONS: u8 = 2;
const CONCATENATION_OPTIONS: u8 = 10;
const RESHAPE_OPTIONS: u8 = 17;
// `TensorType` and `ActivationFunctionType` values.
const FLOAT32: i8 = 0;
const INT32: i8 = 2;
const RELU6: i8 = 3;

/// A tensor of the graph; `buffer` 0 is the empty buffer of non-constant tensors.
struct TensorDef {
    name: String,
    shape: Vec<i32>,
    dtype: i8,
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
    /// `(builtin code, custom name)` of each operator code.
    opcodes: Vec<(i32, Option<&'static str>)>,
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

    fn tensor(&mut self, name: impl Into<String>, shape: &[usize]) -> i32 {
        self.push_tensor(name.into(), dims(shape), FLOAT32, 0)
    }

    fn push_tensor(&mut self, name: String, shape: Vec<i32>, dtype: i8, buffer: u32) -> i32 {
        self.tensors.push(TensorDef {
            name,
            shape,
            dtype,
            buffer,
        });
        self.tensors.len() as i32 - 1
    }

    fn constant(&mut self, name: String, shape: Vec<i32>, dtype: i8, bytes: Vec<u8>) -> i32 {
        self.buffers.push(bytes);
        let buffer = self.buffers.len() as u32 - 1;
        self.push_tensor(name, shape, dtype, buffer)
    }

    fn constant_f32(&mut self, name: String, shape: &[usize], values: &[f32]) -> i32 {
        let bytes = values.iter().flat_map(|v| v.to_le_bytes()).collect();
        self.constant(name, dims(shape), FLOAT32, bytes)
    }

    fn op(
        &mut self,
        code: (i32, Option<&'static str>),
        inputs: Vec<i32>,
        outputs: Vec<i32>,
        options: OpOptions,
    ) {
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

    /// Adds `conv` on `input` (`[1, h, w, c]`); returns the output tensor and its `(h, w)`.
    fn conv(
        &mut self,
        input: i32,
        (h, w): (usize, usize),
        conv: &FrozenConv,
    ) -> (i32, (usize, usize)) {
        let (kernel, shape) = channels_last_kernel(conv);
        let kernel = self.constant_f32(format!("{}/weights", conv.name), &shape, &kernel);
        let bias = self.constant_f32(
            format!("{}/bias", conv.name),
            &[conv.bias.len()],
            &conv.bias,
        );
        let out_hw = (h.div_ceil(conv.stride), w.div_ceil(conv.stride));
        let suffix = if conv.relu6 { "Relu6" } else { "BiasAdd" };
        let output = self.tensor(
            format!("{}/{suffix}", conv.name),
            &[1, out_hw.0, out_hw.1, conv.out_channels()],
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

    /// Reshapes `input` to `shape` (given as a constant input and as options, as the converter
    /// writes it).
    fn reshape(&mut self, input: i32, name: String, shape: &[usize]) -> i32 {
        let shape = dims(shape);
        let bytes = shape.iter().flat_map(|v| v.to_le_bytes()).collect();
        let shape_tensor = self.constant(
            format!("{name}/shape"),
            vec![shape.len() as i32],
            INT32,
            bytes,
        );
        let output = self.push_tensor(name, shape.clone(), FLOAT32, 0);
        self.op(
            (RESHAPE, None),
            vec![input, shape_tensor],
            vec![output],
            OpOptions::Reshape { shape },
        );
        output
    }

    fn concat(&mut self, inputs: Vec<i32>, name: &str, shape: &[usize]) -> i32 {
        let output = self.tensor(name, shape);
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

/// The whole inference graph of `net` with the post-processing op.
fn build_graph(net: &FrozenNetwork, options: &PostProcessOptions) -> Graph {
    let mut g = Graph::new();
    let [h, w] = net.image_size;
    let input = g.tensor(INPUT_NAME, &[1, h, w, 3]);
    g.inputs.push(input);
    let (mut x, mut hw) = (input, (h, w));
    let mut maps = Vec::new();
    for (i, conv) in net.trunk.iter().enumerate() {
        (x, hw) = g.conv(x, hw, conv);
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
        let (b, _) = g.conv(map, hw, box_head);
        boxes.push(g.reshape(b, format!("{}/Reshape", box_head.name), &[1, cells, 4]));
        let (c, _) = g.conv(map, hw, class_head);
        scores.push(g.reshape(
            c,
            format!("{}/Reshape", class_head.name),
            &[1, cells, classes],
        ));
    }
    let boxes = g.concat(boxes, BOX_ENCODINGS_NAME, &[1, n, 4]);
    let logits = g.concat(scores, "concat_1", &[1, n, classes]);
    let scores = g.tensor(CLASS_PREDICTIONS_NAME, &[1, n, classes]);
    g.op(
        (LOGISTIC, None),
        vec![logits],
        vec![scores],
        OpOptions::None,
    );
    let anchors = g.constant_f32("anchors".into(), &[n, 4], &net.anchors_center_size());
    let m = options.max_detections as usize;
    let outputs = vec![
        g.tensor(POSTPROCESS_OP, &[1, m, 4]),
        g.tensor(format!("{POSTPROCESS_OP}:1"), &[1, m]),
        g.tensor(format!("{POSTPROCESS_OP}:2"), &[1, m]),
        g.tensor(format!("{POSTPROCESS_OP}:3"), &[1]),
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
        .map(|&(code, custom)| opcode_table(&mut fbb, code, custom))
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
    let start = fbb.start_table();
    fbb.push_slot_always(slot(0), shape);
    fbb.push_slot::<i8>(slot(1), t.dtype, 0);
    fbb.push_slot::<u32>(slot(2), t.buffer, 0);
    fbb.push_slot_always(slot(3), name);
    fbb.end_table(start)
}

/// `OperatorCode`: the code in both the old byte field and the int field that replaced it.
fn opcode_table(fbb: &mut FlatBufferBuilder, code: i32, custom: Option<&str>) -> Table {
    let custom = custom.map(|name| fbb.create_string(name));
    let start = fbb.start_table();
    fbb.push_slot::<i8>(slot(0), code as i8, 0);
    if let Some(custom) = custom {
        fbb.push_slot_always(slot(1), custom);
    }
    fbb.push_slot::<i32>(slot(2), 1, 1);
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
