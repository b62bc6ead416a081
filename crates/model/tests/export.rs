//! The TFLite and ONNX exports parse back: the flatbuffer passes a verifier written from the
//! TFLite schema and every tensor has the documented name, shape and type; the ONNX protobuf
//! decodes, its graph is topologically ordered with every initializer's data of its shape; a
//! setting the TFLite post-processing op cannot express is an error naming it. (Their numbers
//! against TFLite and ONNX Runtime: `scripts/deploy_check.py`.)

use burn::backend::Flex;
use flatbuffers::{
    ForwardsUOffset, InvalidFlatbuffer, Table, Vector, Verifiable, Verifier, VerifierOptions,
};
use model::export::onnx::{INPUT_NAME, OPSET, OUTPUT_NAMES};
use model::export::onnx_proto::{FLOAT, INT64, ModelProto, TensorProto, ValueInfoProto};
use model::export::tflite::{
    BOX_ENCODINGS_NAME, CLASS_PREDICTIONS_NAME, FILE_IDENTIFIER, POSTPROCESS_OP,
};
use model::export::{to_onnx, to_tflite, write_tflite};
use model::{Ssd, SsdConfig};
use prost::Message;

fn config() -> SsdConfig {
    SsdConfig {
        num_classes: 5,
        image_size: [72, 40],
        depth_multiplier: 0.25,
        ..Default::default()
    }
}

fn network(config: &SsdConfig) -> Ssd<Flex> {
    config.init::<Flex>(7, &Default::default()).unwrap()
}

/// The vtable offset of field `id`.
const fn slot(id: u16) -> u16 {
    4 + 2 * id
}

// Tables of TFLite's schema.fbs, verified field by field (the fields the export writes).
struct ModelT;
struct SubGraphT;
struct TensorT;
struct OperatorT;
struct OperatorCodeT;
struct BufferT;
struct AnyTableT;

type Tables<T> = ForwardsUOffset<Vector<'static, ForwardsUOffset<T>>>;
type Ints = ForwardsUOffset<Vector<'static, i32>>;
type Bytes = ForwardsUOffset<Vector<'static, u8>>;
type Str = ForwardsUOffset<&'static str>;
type Res = Result<(), InvalidFlatbuffer>;

impl Verifiable for ModelT {
    fn run_verifier(v: &mut Verifier, pos: usize) -> Res {
        v.visit_table(pos)?
            .visit_field::<u32>("version", slot(0), true)?
            .visit_field::<Tables<OperatorCodeT>>("operator_codes", slot(1), true)?
            .visit_field::<Tables<SubGraphT>>("subgraphs", slot(2), true)?
            .visit_field::<Str>("description", slot(3), false)?
            .visit_field::<Tables<BufferT>>("buffers", slot(4), true)?
            .finish();
        Ok(())
    }
}

impl Verifiable for SubGraphT {
    fn run_verifier(v: &mut Verifier, pos: usize) -> Res {
        v.visit_table(pos)?
            .visit_field::<Tables<TensorT>>("tensors", slot(0), true)?
            .visit_field::<Ints>("inputs", slot(1), true)?
            .visit_field::<Ints>("outputs", slot(2), true)?
            .visit_field::<Tables<OperatorT>>("operators", slot(3), true)?
            .visit_field::<Str>("name", slot(4), false)?
            .finish();
        Ok(())
    }
}

impl Verifiable for TensorT {
    fn run_verifier(v: &mut Verifier, pos: usize) -> Res {
        v.visit_table(pos)?
            .visit_field::<Ints>("shape", slot(0), true)?
            .visit_field::<i8>("type", slot(1), false)?
            .visit_field::<u32>("buffer", slot(2), false)?
            .visit_field::<Str>("name", slot(3), true)?
            .finish();
        Ok(())
    }
}

impl Verifiable for OperatorT {
    fn run_verifier(v: &mut Verifier, pos: usize) -> Res {
        v.visit_table(pos)?
            .visit_field::<u32>("opcode_index", slot(0), false)?
            .visit_field::<Ints>("inputs", slot(1), true)?
            .visit_field::<Ints>("outputs", slot(2), true)?
            .visit_union::<u8, _>(
                "builtin_options_type",
                slot(3),
                "builtin_options",
                slot(4),
                false,
                |_, v, pos| <ForwardsUOffset<AnyTableT>>::run_verifier(v, pos),
            )?
            .visit_field::<Bytes>("custom_options", slot(5), false)?
            .visit_field::<i8>("custom_options_format", slot(6), false)?
            .finish();
        Ok(())
    }
}

impl Verifiable for OperatorCodeT {
    fn run_verifier(v: &mut Verifier, pos: usize) -> Res {
        v.visit_table(pos)?
            .visit_field::<i8>("deprecated_builtin_code", slot(0), false)?
            .visit_field::<Str>("custom_code", slot(1), false)?
            .visit_field::<i32>("version", slot(2), false)?
            .visit_field::<i32>("builtin_code", slot(3), false)?
            .finish();
        Ok(())
    }
}

impl Verifiable for BufferT {
    fn run_verifier(v: &mut Verifier, pos: usize) -> Res {
        v.visit_table(pos)?
            .visit_field::<Bytes>("data", slot(0), false)?
            .finish();
        Ok(())
    }
}

impl Verifiable for AnyTableT {
    fn run_verifier(v: &mut Verifier, pos: usize) -> Res {
        v.visit_table(pos)?.finish();
        Ok(())
    }
}

/// Field access on a verified buffer.
struct Reader<'a>(Table<'a>);

impl<'a> Reader<'a> {
    fn tables(&self, id: u16) -> Vec<Reader<'a>> {
        // SAFETY: the buffer passed the verifier, which checked this field's type.
        let v = unsafe {
            self.0
                .get::<ForwardsUOffset<Vector<'a, ForwardsUOffset<Table<'a>>>>>(slot(id), None)
        };
        v.map(|v| v.iter().map(Reader).collect())
            .unwrap_or_default()
    }

    fn ints(&self, id: u16) -> Vec<i32> {
        // SAFETY: verified, as above.
        let v = unsafe {
            self.0
                .get::<ForwardsUOffset<Vector<'a, i32>>>(slot(id), None)
        };
        v.map(|v| v.iter().collect()).unwrap_or_default()
    }

    fn bytes(&self, id: u16) -> &'a [u8] {
        // SAFETY: verified, as above.
        let v = unsafe {
            self.0
                .get::<ForwardsUOffset<Vector<'a, u8>>>(slot(id), None)
        };
        v.map(|v| v.bytes()).unwrap_or_default()
    }

    fn string(&self, id: u16) -> &'a str {
        // SAFETY: verified, as above.
        unsafe { self.0.get::<ForwardsUOffset<&str>>(slot(id), None) }.unwrap_or_default()
    }

    fn scalar<T: flatbuffers::Follow<'a, Inner = T> + Copy + 'a>(&self, id: u16, default: T) -> T {
        // SAFETY: verified, as above.
        unsafe { self.0.get::<T>(slot(id), Some(default)) }.unwrap_or(default)
    }
}

fn verified_model(bytes: &[u8]) -> Reader<'_> {
    assert!(flatbuffers::buffer_has_identifier(
        bytes,
        FILE_IDENTIFIER,
        false
    ));
    let opts = VerifierOptions {
        max_apparent_size: 1 << 31,
        ..Default::default()
    };
    let mut verifier = Verifier::new(&opts, bytes);
    <ForwardsUOffset<ModelT>>::run_verifier(&mut verifier, 0).expect("a valid TFLite flatbuffer");
    // SAFETY: just verified.
    Reader(unsafe { flatbuffers::root_unchecked::<Table>(bytes) })
}

/// `(name, shape, type, buffer)` of every tensor of the main subgraph.
type TensorInfo<'a> = (&'a str, Vec<i32>, i8, u32);

fn tensor_info<'a>(t: &Reader<'a>) -> TensorInfo<'a> {
    (
        t.string(3),
        t.ints(0),
        t.scalar::<i8>(1, 0),
        t.scalar::<u32>(2, 0),
    )
}

#[test]
fn tflite_flatbuffer_verifies_with_the_documented_tensors() {
    let config = config();
    let bytes = to_tflite(&network(&config), &config).unwrap();
    let model = verified_model(&bytes);
    assert_eq!(model.scalar::<u32>(0, 0), 3);
    let subgraphs = model.tables(2);
    assert_eq!(subgraphs.len(), 1);
    let graph = &subgraphs[0];
    let tensors: Vec<TensorInfo> = graph.tables(0).iter().map(tensor_info).collect();
    let buffers = model.tables(4);
    assert!(
        buffers[0].bytes(0).is_empty(),
        "buffer 0 is the empty sentinel"
    );
    let n = model::ssd::anchors(&config).len() as i32;
    let by_name = |name: &str| {
        tensors
            .iter()
            .position(|t| t.0 == name)
            .unwrap_or_else(|| panic!("no tensor {name}"))
    };
    let input = by_name("normalized_input_image_tensor");
    assert_eq!(graph.ints(1), vec![input as i32]);
    assert_eq!(tensors[input].1, vec![1, 72, 40, 3]);
    let outputs: Vec<usize> = graph.ints(2).iter().map(|&i| i as usize).collect();
    let names: Vec<&str> = outputs.iter().map(|&i| tensors[i].0).collect();
    assert_eq!(
        names,
        [
            POSTPROCESS_OP,
            &format!("{POSTPROCESS_OP}:1"),
            &format!("{POSTPROCESS_OP}:2"),
            &format!("{POSTPROCESS_OP}:3")
        ]
    );
    let shapes: Vec<&Vec<i32>> = outputs.iter().map(|&i| &tensors[i].1).collect();
    assert_eq!(
        shapes,
        [&vec![1, 100, 4], &vec![1, 100], &vec![1, 100], &vec![1]]
    );
    assert_eq!(tensors[by_name(BOX_ENCODINGS_NAME)].1, vec![1, n, 4]);
    assert_eq!(tensors[by_name(CLASS_PREDICTIONS_NAME)].1, vec![1, n, 6]);
    assert_eq!(tensors[by_name("anchors")].1, vec![n, 4]);
    for (name, shape, dtype, buffer) in &tensors {
        assert!(
            *dtype == 0 || (*dtype == 2 && name.ends_with("/shape")),
            "{name}: type {dtype}"
        );
        let data = buffers[*buffer as usize].bytes(0);
        let elements: i32 = shape.iter().product();
        if *buffer != 0 {
            assert_eq!(data.len(), 4 * elements as usize, "{name}");
            assert_eq!(
                (data.as_ptr() as usize - bytes.as_ptr() as usize) % 16,
                0,
                "{name}"
            );
        }
    }
    check_operators(&model, graph, &tensors, &config);
}

/// Operators: indices in range, every tensor produced before use, the post-processing op's
/// options those of the config.
fn check_operators(model: &Reader, graph: &Reader, tensors: &[TensorInfo], config: &SsdConfig) {
    let codes = model.tables(1);
    let mut ready: Vec<bool> = tensors.iter().map(|t| t.3 != 0).collect();
    for &i in &graph.ints(1) {
        ready[i as usize] = true;
    }
    let mut convs = 0;
    for op in graph.tables(3) {
        for &i in &op.ints(1) {
            assert!(
                ready[i as usize],
                "{} used before it is made",
                tensors[i as usize].0
            );
        }
        op.ints(2).iter().for_each(|&o| ready[o as usize] = true);
        let code = &codes[op.scalar::<u32>(0, 0) as usize];
        match code.scalar::<i32>(3, 0) {
            3 | 4 => convs += 1,
            32 => {
                assert_eq!(code.string(1), POSTPROCESS_OP);
                let options = flexbuffers::Reader::get_root(op.bytes(5)).unwrap().as_map();
                assert_eq!(options.idx("max_detections").as_i32(), 100);
                assert_eq!(options.idx("detections_per_class").as_i32(), 100);
                assert_eq!(options.idx("num_classes").as_i32(), 5);
                assert!(options.idx("use_regular_nms").as_bool());
                assert_eq!(options.idx("nms_iou_threshold").as_f32(), 0.6);
                // the op keeps scores `>=` its threshold, the API's is strict: the next float up
                let strict = config.post_processing.score_threshold;
                assert!(strict >= 0.0);
                assert_eq!(
                    options.idx("nms_score_threshold").as_f32(),
                    f32::from_bits(strict.to_bits() + 1)
                );
                assert_eq!(options.idx("h_scale").as_f32(), 5.0);
                assert_eq!(options.idx("y_scale").as_f32(), 10.0);
            }
            _ => {}
        }
    }
    // Conv2d_0, 13 depthwise / pointwise pairs, 4 extra 1x1 / 3x3 pairs, 12 predictor heads
    assert_eq!(convs, 1 + 26 + 8 + 12);
    assert!(graph.ints(2).iter().all(|&o| ready[o as usize]));
}

#[test]
fn tflite_file_is_written_whole() {
    let config = config();
    let net = network(&config);
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("model.tflite");
    write_tflite(&net, &config, &path).unwrap();
    assert_eq!(
        std::fs::read(&path).unwrap(),
        to_tflite(&net, &config).unwrap()
    );
}

#[test]
fn settings_the_tflite_op_lacks_are_errors_naming_them() {
    let mut config = config();
    let net = network(&config);
    config.post_processing.iou_threshold = 0.0;
    let err = to_tflite(&net, &config).unwrap_err().to_string();
    assert!(err.contains("post_processing.iou_threshold"), "{err}");
    // ONNX leaves NMS to the caller: the same config exports
    to_onnx(&net, &config).unwrap();
}

fn dims(info: &ValueInfoProto) -> Vec<String> {
    let shape = info.r#type.as_ref().unwrap().tensor_type.as_ref().unwrap();
    assert_eq!(shape.elem_type, FLOAT, "{}", info.name);
    shape
        .shape
        .as_ref()
        .unwrap()
        .dim
        .iter()
        .map(|d| match (&d.dim_value, &d.dim_param) {
            (Some(v), None) => v.to_string(),
            (None, Some(p)) => p.clone(),
            other => panic!("{}: dimension {other:?}", info.name),
        })
        .collect()
}

fn element_size(t: &TensorProto) -> usize {
    match t.data_type {
        FLOAT => 4,
        INT64 => 8,
        other => panic!("{}: data type {other}", t.name),
    }
}

#[test]
fn onnx_model_decodes_with_the_documented_values() {
    let config = config();
    let bytes = to_onnx(&network(&config), &config).unwrap();
    let model = ModelProto::decode(bytes.as_slice()).unwrap();
    assert_eq!(model.opset_import.len(), 1);
    assert_eq!(model.opset_import[0].version, OPSET);
    let graph = model.graph.unwrap();
    let n = model::ssd::anchors(&config).len().to_string();
    assert_eq!(graph.input.len(), 1);
    assert_eq!(graph.input[0].name, INPUT_NAME);
    assert_eq!(dims(&graph.input[0]), ["batch", "72", "40", "3"]);
    let outputs: Vec<(&str, Vec<String>)> = graph
        .output
        .iter()
        .map(|o| (o.name.as_str(), dims(o)))
        .collect();
    let shape = |k: &str| vec!["batch".to_string(), n.clone(), k.to_string()];
    assert_eq!(
        outputs,
        [
            (OUTPUT_NAMES[0], shape("4")),
            (OUTPUT_NAMES[1], shape("6")),
            (OUTPUT_NAMES[2], shape("4")),
        ]
    );
    let mut known: std::collections::HashSet<&str> =
        graph.initializer.iter().map(|t| t.name.as_str()).collect();
    for t in &graph.initializer {
        let elements: i64 = t.dims.iter().product();
        assert_eq!(
            t.raw_data.len(),
            elements as usize * element_size(t),
            "{}",
            t.name
        );
    }
    known.insert(INPUT_NAME);
    for node in &graph.node {
        for input in &node.input {
            assert!(
                known.contains(input.as_str()),
                "{}: {input} not made yet",
                node.name
            );
        }
        known.extend(node.output.iter().map(String::as_str));
    }
    assert!(OUTPUT_NAMES.iter().all(|o| known.contains(o)));
    let convs = graph.node.iter().filter(|n| n.op_type == "Conv").count();
    assert_eq!(convs, 1 + 26 + 8 + 12);
}

/// The network of `config` with BatchNorm statistics and parameters far from their initial
/// 1s and 0s, so that folding them into the convolutions shows.
fn network_with_batch_norm(config: &SsdConfig) -> Ssd<Flex> {
    use model::restore::{MemorySource, restore_exact};
    use model::tf::names::named_tensors;
    let net = network(config);
    let mut state = 1u32;
    let mut next = move || {
        state = state.wrapping_mul(1_664_525).wrapping_add(1_013_904_223);
        (state >> 8) as f32 / (1u32 << 24) as f32
    };
    let tensors = named_tensors(&net, config)
        .into_iter()
        .map(|(name, shape, values)| {
            let values = match name.rsplit('/').next() {
                Some("gamma") | Some("moving_variance") => {
                    values.iter().map(|_| 0.5 + next()).collect()
                }
                Some("beta") | Some("moving_mean") => values.iter().map(|_| next() - 0.5).collect(),
                _ => values,
            };
            (name, shape, values)
        })
        .collect();
    restore_exact(
        net,
        config,
        &MemorySource::new(std::path::Path::new("test"), tensors),
    )
    .unwrap()
}

/// An initializer of `graph` as floats.
fn initializer(graph: &model::export::onnx_proto::GraphProto, name: &str) -> Vec<f32> {
    let t = graph.initializer.iter().find(|t| t.name == name).unwrap();
    t.raw_data
        .chunks_exact(4)
        .map(|b| f32::from_le_bytes(b.try_into().unwrap()))
        .collect()
}

/// The exported graph's numbers, checked in Rust: the first convolution evaluated by hand
/// from its initializers (BatchNorm folded in, `[out, in, kh, kw]` layout, TF's SAME padding)
/// against the network's own first layer, and the anchors against `model::ssd::anchors`.
#[test]
fn onnx_initializers_compute_what_the_network_does() {
    use burn::tensor::{Tensor, TensorData};
    let config = config();
    let net = network_with_batch_norm(&config);
    let bytes = to_onnx(&net, &config).unwrap();
    let graph = ModelProto::decode(bytes.as_slice()).unwrap().graph.unwrap();
    let conv = graph.node.iter().find(|n| n.op_type == "Conv").unwrap();
    let (kernel, bias) = (
        initializer(&graph, &conv.input[1]),
        initializer(&graph, &conv.input[2]),
    );
    let [h, w] = config.image_size;
    let out = bias.len();
    let input: Vec<f32> = (0..3 * h * w)
        .map(|i| ((i * 7919) % 201) as f32 / 100.0 - 1.0)
        .collect();
    // stride 2, 3x3, SAME: output ceil(n / 2), padding split with the extra row below/right
    let (oh, ow) = (h.div_ceil(2), w.div_ceil(2));
    let pad = |n: usize, o: usize| ((o - 1) * 2 + 3).saturating_sub(n) / 2;
    let (top, left) = (pad(h, oh), pad(w, ow));
    let mut by_hand = vec![0f32; out * oh * ow];
    for o in 0..out {
        for (y, x) in (0..oh).flat_map(|y| (0..ow).map(move |x| (y, x))) {
            let mut sum = bias[o];
            for (c, ky, kx) in
                (0..3).flat_map(|c| (0..3).flat_map(move |ky| (0..3).map(move |kx| (c, ky, kx))))
            {
                let (iy, ix) = (
                    (y * 2 + ky) as isize - top as isize,
                    (x * 2 + kx) as isize - left as isize,
                );
                if iy >= 0 && ix >= 0 && (iy as usize) < h && (ix as usize) < w {
                    sum += kernel[((o * 3 + c) * 3 + ky) * 3 + kx]
                        * input[(c * h + iy as usize) * w + ix as usize];
                }
            }
            by_hand[(o * oh + y) * ow + x] = sum.clamp(0.0, 6.0);
        }
    }
    let x = Tensor::<Flex, 4>::from_data(TensorData::new(input, [1, 3, h, w]), &Default::default());
    let theirs: Vec<f32> = net.backbone.conv0.forward(x).into_data().to_vec().unwrap();
    assert_eq!(theirs.len(), by_hand.len());
    let worst = theirs
        .iter()
        .zip(&by_hand)
        .map(|(a, b)| (a - b).abs())
        .fold(0f32, f32::max);
    assert!(worst < 1e-4, "the exported first layer differs by {worst}");
    assert!(by_hand.iter().filter(|v| **v > 0.0 && **v < 6.0).count() > by_hand.len() / 4);
    // the anchors, as centres and sizes
    let anchors = model::ssd::anchors(&config);
    let (center, size) = (
        initializer(&graph, "anchors/center"),
        initializer(&graph, "anchors/size"),
    );
    assert_eq!(center.len(), 2 * anchors.len());
    for (i, a) in anchors.iter().enumerate() {
        let want_center = [(a.ymin + a.ymax) / 2.0, (a.xmin + a.xmax) / 2.0];
        let want_size = [a.ymax - a.ymin, a.xmax - a.xmin];
        for k in 0..2 {
            assert!(
                (center[2 * i + k] - want_center[k]).abs() < 1e-6,
                "anchor {i}"
            );
            assert!((size[2 * i + k] - want_size[k]).abs() < 1e-6, "anchor {i}");
        }
    }
}
