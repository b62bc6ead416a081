//! The TFLite and ONNX exports parse back: the flatbuffer passes a verifier written from the
//! TFLite schema and every tensor has the documented name, shape and type; the int8 export's
//! quantization parameters are those of TFLite's int8 specification and its integers code the
//! float export's weights; the ONNX protobuf
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
use model::export::{Calibration, InputType, Precision, to_onnx, to_tflite, write_tflite};
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
struct QuantizationT;
struct AnyTableT;

type Tables<T> = ForwardsUOffset<Vector<'static, ForwardsUOffset<T>>>;
type Ints = ForwardsUOffset<Vector<'static, i32>>;
type Bytes = ForwardsUOffset<Vector<'static, u8>>;
type Floats = ForwardsUOffset<Vector<'static, f32>>;
type Longs = ForwardsUOffset<Vector<'static, i64>>;
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
            .visit_field::<ForwardsUOffset<QuantizationT>>("quantization", slot(4), false)?
            .finish();
        Ok(())
    }
}

impl Verifiable for QuantizationT {
    fn run_verifier(v: &mut Verifier, pos: usize) -> Res {
        v.visit_table(pos)?
            .visit_field::<Floats>("min", slot(0), false)?
            .visit_field::<Floats>("max", slot(1), false)?
            .visit_field::<Floats>("scale", slot(2), false)?
            .visit_field::<Longs>("zero_point", slot(3), false)?
            .visit_field::<i32>("quantized_dimension", slot(6), false)?
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

    fn vector<T: flatbuffers::Follow<'a, Inner = T> + 'a>(&self, id: u16) -> Vec<T> {
        // SAFETY: verified, as above.
        let v = unsafe { self.0.get::<ForwardsUOffset<Vector<'a, T>>>(slot(id), None) };
        v.map(|v| v.iter().collect()).unwrap_or_default()
    }

    fn table(&self, id: u16) -> Option<Reader<'a>> {
        // SAFETY: verified, as above.
        unsafe { self.0.get::<ForwardsUOffset<Table<'a>>>(slot(id), None) }.map(Reader)
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
    let bytes = to_tflite(&network(&config), &config, Precision::Float32).unwrap();
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
    write_tflite(&net, &config, Precision::Float32, &path).unwrap();
    assert_eq!(
        std::fs::read(&path).unwrap(),
        to_tflite(&net, &config, Precision::Float32).unwrap()
    );
}

#[test]
fn settings_the_tflite_op_lacks_are_errors_naming_them() {
    let mut config = config();
    let net = network(&config);
    config.post_processing.iou_threshold = 0.0;
    let err = to_tflite(&net, &config, Precision::Float32)
        .unwrap_err()
        .to_string();
    assert!(err.contains("post_processing.iou_threshold"), "{err}");
    // ONNX leaves NMS to the caller: the same config exports
    to_onnx(&net, &config).unwrap();
}

// `TensorType`s and `BuiltinOperator`s of TFLite's schema.
const FLOAT32: i8 = 0;
const INT32: i8 = 2;
const UINT8: i8 = 3;
const INT8: i8 = 9;
const CONCATENATION: i32 = 2;
const CONV_2D: i32 = 3;
const DEPTHWISE_CONV_2D: i32 = 4;
const DEQUANTIZE: i32 = 6;
const LOGISTIC: i32 = 14;
const RESHAPE: i32 = 22;
const CUSTOM: i32 = 32;
const QUANTIZE: i32 = 114;

/// A tensor with its quantization and its constant data (empty for activations).
struct QTensor<'a> {
    name: &'a str,
    shape: Vec<i32>,
    dtype: i8,
    data: &'a [u8],
    scale: Vec<f32>,
    zero_point: Vec<i64>,
    axis: i32,
}

impl QTensor<'_> {
    /// int8 with one scale and one zero point in range, as every int8 activation.
    fn assert_int8_per_tensor(&self) {
        assert_eq!(self.dtype, INT8, "{}", self.name);
        assert_eq!(self.scale.len(), 1, "{}", self.name);
        assert!(
            self.scale[0] > 0.0 && self.scale[0].is_finite(),
            "{}",
            self.name
        );
        assert!((-128..=127).contains(&self.zero_point[0]), "{}", self.name);
        assert_eq!(self.zero_point.len(), 1, "{}", self.name);
    }

    fn params(&self) -> (i8, &[f32], &[i64]) {
        (self.dtype, &self.scale, &self.zero_point)
    }

    fn floats(&self) -> Vec<f32> {
        self.data
            .chunks_exact(4)
            .map(|b| f32::from_le_bytes(b.try_into().unwrap()))
            .collect()
    }
}

fn quantized_tensors<'a>(model: &Reader<'a>, graph: &Reader<'a>) -> Vec<QTensor<'a>> {
    let buffers = model.tables(4);
    graph
        .tables(0)
        .iter()
        .map(|t| {
            let q = t.table(4);
            QTensor {
                name: t.string(3),
                shape: t.ints(0),
                dtype: t.scalar::<i8>(1, 0),
                data: buffers[t.scalar::<u32>(2, 0) as usize].bytes(0),
                scale: q.as_ref().map(|q| q.vector::<f32>(2)).unwrap_or_default(),
                zero_point: q.as_ref().map(|q| q.vector::<i64>(3)).unwrap_or_default(),
                axis: q.map(|q| q.scalar::<i32>(6, 0)).unwrap_or(0),
            }
        })
        .collect()
}

/// The activation ranges of `net` over two random images.
fn calibrated(net: &Ssd<Flex>, config: &SsdConfig) -> Calibration {
    use burn::tensor::{Distribution, Tensor};
    let [h, w] = config.image_size;
    let images = Tensor::<Flex, 4>::random(
        [2, 3, h, w],
        Distribution::Uniform(-1.0, 1.0),
        &Default::default(),
    );
    let mut calibration = Calibration::default();
    calibration.observe(net, images).unwrap();
    assert_eq!(calibration.images(), 2);
    calibration
}

fn int8_export(net: &Ssd<Flex>, config: &SsdConfig, input: InputType) -> Vec<u8> {
    let calibration = calibrated(net, config);
    let precision = Precision::Int8 {
        calibration: &calibration,
        input,
    };
    to_tflite(net, config, precision).unwrap()
}

fn close(a: f32, b: f32) -> bool {
    (a - b).abs() <= 1e-6 * a.abs().max(b.abs())
}

/// A convolution as the specification has it: int8 input and output per tensor (ReLU6
/// layers: a range within `[0, 6]` from 0), weights int8 per channel along `axis` with zero
/// points 0, codes in `[-127, 127]` that are the float weights to half a step, the largest
/// of each channel coded 127; the bias int32 with scale `input_scale * weight_scale`.
fn check_int8_conv(io: (&QTensor, &QTensor), kernel: &QTensor, bias: &QTensor, float: &[QTensor]) {
    let (input, output) = io;
    input.assert_int8_per_tensor();
    output.assert_int8_per_tensor();
    if output.name.ends_with("Relu6") {
        assert_eq!(output.zero_point, vec![-128], "{}", output.name);
        assert!(
            output.scale[0] * 255.0 <= 6.0 * (1.0 + 1e-6),
            "{}",
            output.name
        );
    }
    let by_name = |name: &str| float.iter().find(|t| t.name == name).unwrap().floats();
    let depthwise = kernel.shape[0] == 1 && bias.shape[0] > 1;
    let axis = if depthwise { 3 } else { 0 };
    let channels = kernel.shape[axis] as usize;
    assert_eq!(
        (kernel.dtype, kernel.axis),
        (INT8, axis as i32),
        "{}",
        kernel.name
    );
    assert_eq!(kernel.scale.len(), channels, "{}", kernel.name);
    assert_eq!(kernel.zero_point, vec![0; channels], "{}", kernel.name);
    let weights = by_name(kernel.name);
    let per_channel = weights.len() / channels;
    let mut largest = vec![0i8; channels];
    for (i, (&code, w)) in kernel.data.iter().zip(&weights).enumerate() {
        let c = if depthwise {
            i % channels
        } else {
            i / per_channel
        };
        let code = code as i8;
        assert!(code != i8::MIN, "{}: -128", kernel.name);
        let s = kernel.scale[c];
        assert!(
            (f32::from(code) * s - w).abs() <= 0.5 * s * (1.0 + 1e-5),
            "{}",
            kernel.name
        );
        largest[c] = largest[c].max(code.saturating_abs());
    }
    assert_eq!(largest, vec![127; channels], "{}", kernel.name);
    assert_eq!((bias.dtype, bias.axis), (INT32, 0), "{}", bias.name);
    assert_eq!(bias.zero_point, vec![0; channels], "{}", bias.name);
    let float_bias = by_name(bias.name);
    for (c, code) in bias.data.chunks_exact(4).enumerate() {
        let s = bias.scale[c];
        assert!(close(s, input.scale[0] * kernel.scale[c]), "{}", bias.name);
        let code = f64::from(i32::from_le_bytes(code.try_into().unwrap()));
        let error = (code * f64::from(s) - f64::from(float_bias[c])).abs();
        assert!(error <= 0.5 * f64::from(s) * (1.0 + 1e-9), "{}", bias.name);
    }
}

#[test]
fn int8_tflite_follows_the_quantization_specification() {
    let config = config();
    let net = network_with_batch_norm(&config);
    let int8 = int8_export(&net, &config, InputType::Uint8);
    let float = to_tflite(&net, &config, Precision::Float32).unwrap();
    let (model, float_model) = (verified_model(&int8), verified_model(&float));
    let graph = &model.tables(2)[0];
    let tensors = quantized_tensors(&model, graph);
    let float_tensors = quantized_tensors(&float_model, &float_model.tables(2)[0]);
    let infos: Vec<TensorInfo> = graph.tables(0).iter().map(tensor_info).collect();
    check_operators(&model, graph, &infos, &config);
    let input = &tensors[graph.ints(1)[0] as usize];
    assert_eq!(input.name, "normalized_input_image_tensor");
    assert_eq!(
        (input.dtype, input.shape.clone()),
        (UINT8, vec![1, 72, 40, 3])
    );
    assert_eq!(input.params(), (UINT8, &[2.0 / 255.0][..], &[128][..]));
    let codes = model.tables(1);
    let mut counts = std::collections::BTreeMap::new();
    for op in graph.tables(3) {
        let code = &codes[op.scalar::<u32>(0, 0) as usize];
        let (builtin, version) = (code.scalar::<i32>(3, 0), code.scalar::<i32>(2, 1));
        *counts.entry(builtin).or_insert(0) += 1;
        let ins: Vec<&QTensor> = op.ints(1).iter().map(|&i| &tensors[i as usize]).collect();
        let outs: Vec<&QTensor> = op.ints(2).iter().map(|&i| &tensors[i as usize]).collect();
        match builtin {
            QUANTIZE => {
                assert_eq!((ins[0].dtype, version), (UINT8, 1));
                outs[0].assert_int8_per_tensor();
                // the same reals: zero point 128 lower
                assert_eq!(outs[0].scale, ins[0].scale);
                assert_eq!(outs[0].zero_point, vec![0]);
            }
            CONV_2D | DEPTHWISE_CONV_2D => {
                assert_eq!(version, 3);
                check_int8_conv((ins[0], outs[0]), ins[1], ins[2], &float_tensors);
            }
            RESHAPE => {
                ins[0].assert_int8_per_tensor();
                assert_eq!(outs[0].params(), ins[0].params(), "{}", outs[0].name);
            }
            CONCATENATION => {
                assert_eq!(version, 2);
                outs[0].assert_int8_per_tensor();
                for i in &ins {
                    assert_eq!(i.params(), outs[0].params(), "{}", i.name);
                }
            }
            LOGISTIC => {
                assert_eq!(version, 2);
                ins[0].assert_int8_per_tensor();
                assert_eq!(outs[0].name, CLASS_PREDICTIONS_NAME);
                assert_eq!(outs[0].params(), (INT8, &[1.0 / 256.0][..], &[-128][..]));
            }
            DEQUANTIZE => {
                assert_eq!(version, 2);
                ins[0].assert_int8_per_tensor();
                assert_eq!(outs[0].dtype, FLOAT32);
            }
            CUSTOM => {
                // the op's kernel reads float32 box codes, scores and anchors
                assert!(ins.iter().all(|t| t.dtype == FLOAT32));
                assert!(outs.iter().all(|t| t.dtype == FLOAT32));
            }
            other => panic!("unexpected operator {other}"),
        }
    }
    let expected = [
        (CONCATENATION, 2),
        (CONV_2D, 35 - 13 + 12),
        (DEPTHWISE_CONV_2D, 13),
        (DEQUANTIZE, 2),
        (LOGISTIC, 1),
        (RESHAPE, 12),
        (CUSTOM, 1),
        (QUANTIZE, 1),
    ];
    assert_eq!(counts, expected.into_iter().collect());
    // a weight takes one byte, against four
    let weight_bytes = |ts: &[QTensor]| -> usize {
        ts.iter()
            .filter(|t| t.name.ends_with("/weights"))
            .map(|t| t.data.len())
            .sum()
    };
    assert_eq!(4 * weight_bytes(&tensors), weight_bytes(&float_tensors));
}

#[test]
fn int8_input_types_take_int8_or_floats() {
    let config = config();
    let net = network(&config);
    for (input, dtype, quantize_ops) in
        [(InputType::Int8, INT8, 0), (InputType::Float32, FLOAT32, 1)]
    {
        let bytes = int8_export(&net, &config, input);
        let model = verified_model(&bytes);
        let graph = &model.tables(2)[0];
        let tensors = quantized_tensors(&model, graph);
        let first = &tensors[graph.ints(1)[0] as usize];
        assert_eq!(first.dtype, dtype, "{input:?}");
        if dtype == INT8 {
            assert_eq!(first.params(), (INT8, &[2.0 / 255.0][..], &[0][..]));
        }
        let codes = model.tables(1);
        let quantizes = graph
            .tables(3)
            .iter()
            .filter(|op| codes[op.scalar::<u32>(0, 0) as usize].scalar::<i32>(3, 0) == QUANTIZE)
            .count();
        assert_eq!(quantizes, quantize_ops, "{input:?}");
    }
}

#[test]
fn quantizing_without_calibration_is_an_error() {
    let config = config();
    let net = network(&config);
    let calibration = Calibration::default();
    let precision = Precision::Int8 {
        calibration: &calibration,
        input: InputType::Uint8,
    };
    let err = to_tflite(&net, &config, precision).unwrap_err().to_string();
    assert!(err.contains("no calibration image"), "{err}");
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
