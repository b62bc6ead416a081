//! ONNX export (opset 13): the inference network with its outputs decoded into boxes, for ONNX
//! Runtime, TensorRT, OpenVINO and the like.
//!
//! | | name | shape |
//! |---|---|---|
//! | input | `normalized_input_image_tensor`: RGB scaled as `(2 / 255) x - 1` | `[batch, H, W, 3]` |
//! | output 0 | `raw_outputs/box_encodings`: box codes relative to the anchors | `[batch, N, 4]` |
//! | output 1 | `raw_outputs/class_predictions`: sigmoid scores, background first | `[batch, N, num_classes + 1]` |
//! | output 2 | `detection_boxes`: decoded `[ymin, xmin, ymax, xmax]`, normalised, not clipped | `[batch, N, 4]` |
//!
//! All float32, `N` the number of anchors. Non-maximum suppression is left to the caller
//! (ONNX's `NonMaxSuppression` has no per-class limit with a global cut, so it would not
//! reproduce the API's post-processing). Inside: a `Transpose` to NCHW, `Conv` with BatchNorm
//! folded in and `Clip(0, 6)`, each head `Transpose`d back to channels last and `Reshape`d to
//! `[batch, anchors, k]`, `Concat`, `Sigmoid`, and the Faster R-CNN box decoding with the
//! anchors as initializers.

use std::path::Path;

use prost::Message;

use crate::config::SsdConfig;
use crate::error::{ModelError, Result};
use crate::export::network::{FrozenConv, FrozenNetwork, same_padding};
use crate::export::onnx_proto::{
    AttributeProto, Dimension, FLOAT, GraphProto, INT64, ModelProto, NodeProto, OperatorSetIdProto,
    TensorProto, TensorShapeProto, TensorTypeProto, TypeProto, ValueInfoProto, attribute_type,
};
use crate::ops::SsdBackend;
use crate::ssd::Ssd;

/// The opset the graph is written for.
pub const OPSET: i64 = 13;
/// The IR version that goes with [`OPSET`].
pub const IR_VERSION: i64 = 7;
/// The input's name.
pub const INPUT_NAME: &str = "normalized_input_image_tensor";
/// The outputs' names, in order.
pub const OUTPUT_NAMES: [&str; 3] = [
    "raw_outputs/box_encodings",
    "raw_outputs/class_predictions",
    "detection_boxes",
];

/// The model as ONNX protobuf bytes.
pub fn to_onnx<B: SsdBackend>(model: &Ssd<B>, config: &SsdConfig) -> Result<Vec<u8>> {
    let net = FrozenNetwork::new(model, config)?;
    let graph = build_graph(&net, config.box_coder_scales);
    let model = ModelProto {
        ir_version: IR_VERSION,
        producer_name: "ssd-burn".into(),
        producer_version: env!("CARGO_PKG_VERSION").into(),
        doc_string: "SSD-MobileNet-v1; NMS left to the caller".into(),
        graph: Some(graph),
        opset_import: vec![OperatorSetIdProto {
            domain: String::new(),
            version: OPSET,
        }],
    };
    Ok(model.encode_to_vec())
}

/// Writes the model as an `.onnx` file (atomically).
pub fn write_onnx<B: SsdBackend>(model: &Ssd<B>, config: &SsdConfig, path: &Path) -> Result<()> {
    let bytes = to_onnx(model, config)?;
    crate::io::write_atomic(path, &bytes).map_err(|source| ModelError::Io {
        action: "writing",
        path: path.to_path_buf(),
        source,
    })
}

fn float_tensor(name: &str, dims: &[usize], values: &[f32]) -> TensorProto {
    TensorProto {
        dims: dims.iter().map(|&d| d as i64).collect(),
        data_type: FLOAT,
        name: name.into(),
        raw_data: values.iter().flat_map(|v| v.to_le_bytes()).collect(),
    }
}

fn ints(name: &str, values: &[usize]) -> AttributeProto {
    AttributeProto {
        name: name.into(),
        ints: values.iter().map(|&v| v as i64).collect(),
        r#type: attribute_type::INTS,
        ..Default::default()
    }
}

fn int(name: &str, value: i64) -> AttributeProto {
    AttributeProto {
        name: name.into(),
        i: value,
        r#type: attribute_type::INT,
        ..Default::default()
    }
}

/// A float tensor value `[batch, dims...]` for the graph's inputs and outputs.
fn value_info(name: &str, dims: &[usize]) -> ValueInfoProto {
    let batch = Dimension {
        dim_param: Some("batch".into()),
        ..Default::default()
    };
    let rest = dims.iter().map(|&d| Dimension {
        dim_value: Some(d as i64),
        ..Default::default()
    });
    ValueInfoProto {
        name: name.into(),
        r#type: Some(TypeProto {
            tensor_type: Some(TensorTypeProto {
                elem_type: FLOAT,
                shape: Some(TensorShapeProto {
                    dim: std::iter::once(batch).chain(rest).collect(),
                }),
            }),
        }),
    }
}

/// The graph under construction; values are named by the node that makes them.
#[derive(Default)]
struct Graph {
    nodes: Vec<NodeProto>,
    initializers: Vec<TensorProto>,
}

impl Graph {
    fn node(
        &mut self,
        op: &str,
        name: &str,
        inputs: &[&str],
        attrs: Vec<AttributeProto>,
    ) -> String {
        self.nodes.push(NodeProto {
            input: inputs.iter().map(|s| s.to_string()).collect(),
            output: vec![name.into()],
            name: name.into(),
            op_type: op.into(),
            attribute: attrs,
        });
        name.into()
    }

    fn constant(&mut self, name: &str, dims: &[usize], values: &[f32]) -> String {
        self.initializers.push(float_tensor(name, dims, values));
        name.into()
    }

    fn constant_i64(&mut self, name: &str, values: &[i64]) -> String {
        self.initializers.push(TensorProto {
            dims: vec![values.len() as i64],
            data_type: INT64,
            name: name.into(),
            raw_data: values.iter().flat_map(|v| v.to_le_bytes()).collect(),
        });
        name.into()
    }

    /// `conv` (TF "SAME" padding written out, since ONNX's `SAME_UPPER` is deprecated) on an
    /// NCHW input of spatial size `hw`; ReLU6 as `Clip(0, 6)`. Returns the output and its size.
    fn conv(
        &mut self,
        input: &str,
        hw: (usize, usize),
        conv: &FrozenConv,
    ) -> (String, (usize, usize)) {
        let k = conv.kernel_size();
        let (h, (top, bottom)) = same_padding(hw.0, k, conv.stride);
        let (w, (left, right)) = same_padding(hw.1, k, conv.stride);
        let weight = self.constant(&format!("{}/weights", conv.name), &conv.shape, &conv.kernel);
        let bias = self.constant(
            &format!("{}/bias", conv.name),
            &[conv.bias.len()],
            &conv.bias,
        );
        let groups = if conv.depthwise {
            conv.out_channels()
        } else {
            1
        };
        let attrs = vec![
            ints("kernel_shape", &[k, k]),
            ints("strides", &[conv.stride, conv.stride]),
            ints("pads", &[top, left, bottom, right]),
            int("group", groups as i64),
        ];
        let name = format!("{}/BiasAdd", conv.name);
        let out = self.node("Conv", &name, &[input, &weight, &bias], attrs);
        if !conv.relu6 {
            return (out, (h, w));
        }
        let name = format!("{}/Relu6", conv.name);
        (
            self.node("Clip", &name, &[&out, "relu6/min", "relu6/max"], vec![]),
            (h, w),
        )
    }

    /// A head's NCHW output as `[batch, cells * anchors, k]` in the API's order (channels last).
    fn flatten_head(&mut self, input: &str, name: &str, k: usize) -> String {
        let nhwc = self.node(
            "Transpose",
            &format!("{name}/nhwc"),
            &[input],
            vec![ints("perm", &[0, 2, 3, 1])],
        );
        let shape = self.constant_i64(&format!("{name}/shape"), &[0, -1, k as i64]);
        self.node(
            "Reshape",
            &format!("{name}/Reshape"),
            &[&nhwc, &shape],
            vec![],
        )
    }
}

/// The network up to the concatenated raw outputs; returns the box codes and the class logits.
fn network_nodes(g: &mut Graph, net: &FrozenNetwork) -> (String, String) {
    g.constant("relu6/min", &[], &[0.0]);
    g.constant("relu6/max", &[], &[6.0]);
    let nchw = g.node(
        "Transpose",
        "nchw",
        &[INPUT_NAME],
        vec![ints("perm", &[0, 3, 1, 2])],
    );
    let (mut x, mut hw) = (nchw, (net.image_size[0], net.image_size[1]));
    let mut maps = Vec::new();
    for (i, conv) in net.trunk.iter().enumerate() {
        (x, hw) = g.conv(&x, hw, conv);
        if net.feature_maps.contains(&i) {
            maps.push((x.clone(), hw));
        }
    }
    let (mut boxes, mut logits) = (Vec::new(), Vec::new());
    let heads = net.box_heads.iter().zip(&net.class_heads);
    for ((map, hw), (box_head, class_head)) in maps.iter().zip(heads) {
        let (b, _) = g.conv(map, *hw, box_head);
        boxes.push(g.flatten_head(&b, &box_head.name, 4));
        let (c, _) = g.conv(map, *hw, class_head);
        logits.push(g.flatten_head(&c, &class_head.name, net.num_classes + 1));
    }
    let concat = |g: &mut Graph, name: &str, parts: &[String]| {
        let parts: Vec<&str> = parts.iter().map(String::as_str).collect();
        g.node("Concat", name, &parts, vec![int("axis", 1)])
    };
    (
        concat(g, OUTPUT_NAMES[0], &boxes),
        concat(g, "concat_1", &logits),
    )
}

/// Faster R-CNN decoding of `codes` `[batch, N, 4]`: `center = code / scale * anchor_size +
/// anchor_center`, `size = exp(code / scale) * anchor_size`, corners `center -+ size / 2`
/// (the order of operations of `BoxCoder::decode`).
fn decode_nodes(g: &mut Graph, codes: &str, net: &FrozenNetwork, scales: [f32; 4]) -> String {
    let n = net.anchors.len();
    let anchors = net.anchors_center_size();
    let pick = |from: usize| -> Vec<f32> {
        anchors
            .chunks_exact(4)
            .flat_map(|a| [a[from], a[from + 1]])
            .collect()
    };
    let center = g.constant("anchors/center", &[n, 2], &pick(0));
    let size = g.constant("anchors/size", &[n, 2], &pick(2));
    let scales = g.constant("box_coder/scales", &[4], &scales);
    let two = g.constant("box_coder/two", &[], &[2.0]);
    let axes = g.constant_i64("box_coder/axes", &[2]);
    let t = g.node("Div", "box_coder/unscaled", &[codes, &scales], vec![]);
    // the [y, x] and the [height, width] halves of the codes
    let mut half_of = |part: &str, start: i64| {
        let first = g.constant_i64(&format!("box_coder/{part}_start"), &[start]);
        let end = g.constant_i64(&format!("box_coder/{part}_end"), &[start + 2]);
        let name = format!("box_coder/t_{part}");
        g.node("Slice", &name, &[&t, &first, &end, &axes], vec![])
    };
    let (t_yx, t_hw) = (half_of("yx", 0), half_of("hw", 2));
    let offset = g.node("Mul", "box_coder/offset", &[&t_yx, &size], vec![]);
    let centers = g.node("Add", "box_coder/centers", &[&offset, &center], vec![]);
    let growth = g.node("Exp", "box_coder/growth", &[&t_hw], vec![]);
    let sizes = g.node("Mul", "box_coder/sizes", &[&growth, &size], vec![]);
    let half = g.node("Div", "box_coder/half", &[&sizes, &two], vec![]);
    let mins = g.node("Sub", "box_coder/mins", &[&centers, &half], vec![]);
    let maxs = g.node("Add", "box_coder/maxs", &[&centers, &half], vec![]);
    g.node(
        "Concat",
        OUTPUT_NAMES[2],
        &[&mins, &maxs],
        vec![int("axis", 2)],
    )
}

fn build_graph(net: &FrozenNetwork, scales: [f32; 4]) -> GraphProto {
    let mut g = Graph::default();
    let (codes, logits) = network_nodes(&mut g, net);
    g.node("Sigmoid", OUTPUT_NAMES[1], &[&logits], vec![]);
    decode_nodes(&mut g, &codes, net, scales);
    let [h, w] = net.image_size;
    let n = net.anchors.len();
    GraphProto {
        node: g.nodes,
        name: "ssd_mobilenet_v1".into(),
        initializer: g.initializers,
        input: vec![value_info(INPUT_NAME, &[h, w, 3])],
        output: vec![
            value_info(OUTPUT_NAMES[0], &[n, 4]),
            value_info(OUTPUT_NAMES[1], &[n, net.num_classes + 1]),
            value_info(OUTPUT_NAMES[2], &[n, 4]),
        ],
    }
}
