//! The subset of `onnx.proto` (ONNX IR) the ONNX export writes, declared by hand with
//! `prost`: field numbers and enum values as the format defines them. Fields left out are
//! ones the export never sets; decoding skips them.

/// `TensorProto.DataType.FLOAT`.
pub const FLOAT: i32 = 1;
/// `TensorProto.DataType.INT64`.
pub const INT64: i32 = 7;

/// `AttributeProto.AttributeType` values used here.
pub mod attribute_type {
    /// A float.
    pub const FLOAT: i32 = 1;
    /// An int64.
    pub const INT: i32 = 2;
    /// A list of int64.
    pub const INTS: i32 = 7;
}

/// `ModelProto`: the file.
#[derive(Clone, PartialEq, prost::Message)]
pub struct ModelProto {
    /// IR version of the file format.
    #[prost(int64, tag = "1")]
    pub ir_version: i64,
    /// The tool that wrote the model.
    #[prost(string, tag = "2")]
    pub producer_name: String,
    /// Its version.
    #[prost(string, tag = "3")]
    pub producer_version: String,
    /// Free text.
    #[prost(string, tag = "6")]
    pub doc_string: String,
    /// The computation.
    #[prost(message, optional, tag = "7")]
    pub graph: Option<GraphProto>,
    /// Operator sets the graph uses.
    #[prost(message, repeated, tag = "8")]
    pub opset_import: Vec<OperatorSetIdProto>,
}

/// `OperatorSetIdProto`.
#[derive(Clone, PartialEq, prost::Message)]
pub struct OperatorSetIdProto {
    /// Empty: the default ONNX domain.
    #[prost(string, tag = "1")]
    pub domain: String,
    /// Opset version.
    #[prost(int64, tag = "2")]
    pub version: i64,
}

/// `GraphProto`.
#[derive(Clone, PartialEq, prost::Message)]
pub struct GraphProto {
    /// Nodes in topological order.
    #[prost(message, repeated, tag = "1")]
    pub node: Vec<NodeProto>,
    /// Graph name.
    #[prost(string, tag = "2")]
    pub name: String,
    /// Constant tensors (weights, anchors).
    #[prost(message, repeated, tag = "5")]
    pub initializer: Vec<TensorProto>,
    /// Graph inputs.
    #[prost(message, repeated, tag = "11")]
    pub input: Vec<ValueInfoProto>,
    /// Graph outputs.
    #[prost(message, repeated, tag = "12")]
    pub output: Vec<ValueInfoProto>,
}

/// `NodeProto`: one operator application.
#[derive(Clone, PartialEq, prost::Message)]
pub struct NodeProto {
    /// Input value names.
    #[prost(string, repeated, tag = "1")]
    pub input: Vec<String>,
    /// Output value names.
    #[prost(string, repeated, tag = "2")]
    pub output: Vec<String>,
    /// Node name.
    #[prost(string, tag = "3")]
    pub name: String,
    /// Operator (`Conv`, `Clip`, ...).
    #[prost(string, tag = "4")]
    pub op_type: String,
    /// Attributes.
    #[prost(message, repeated, tag = "5")]
    pub attribute: Vec<AttributeProto>,
}

/// `AttributeProto` (float, int and ints attributes only).
#[derive(Clone, PartialEq, prost::Message)]
pub struct AttributeProto {
    /// Attribute name.
    #[prost(string, tag = "1")]
    pub name: String,
    /// Float value.
    #[prost(float, tag = "2")]
    pub f: f32,
    /// Int value.
    #[prost(int64, tag = "3")]
    pub i: i64,
    /// Ints value.
    #[prost(int64, repeated, tag = "8")]
    pub ints: Vec<i64>,
    /// [`attribute_type`] of the value.
    #[prost(int32, tag = "20")]
    pub r#type: i32,
}

/// `TensorProto` (dense, data in `raw_data`, little-endian).
#[derive(Clone, PartialEq, prost::Message)]
pub struct TensorProto {
    /// Shape.
    #[prost(int64, repeated, tag = "1")]
    pub dims: Vec<i64>,
    /// [`FLOAT`] or [`INT64`].
    #[prost(int32, tag = "2")]
    pub data_type: i32,
    /// Name (initializers: the value name).
    #[prost(string, tag = "8")]
    pub name: String,
    /// The values, little-endian.
    #[prost(bytes = "vec", tag = "9")]
    pub raw_data: Vec<u8>,
}

/// `ValueInfoProto`: a named, typed value.
#[derive(Clone, PartialEq, prost::Message)]
pub struct ValueInfoProto {
    /// Value name.
    #[prost(string, tag = "1")]
    pub name: String,
    /// Its type.
    #[prost(message, optional, tag = "2")]
    pub r#type: Option<TypeProto>,
}

/// `TypeProto` (tensor types only: `tensor_type`, field 1 of the `value` oneof).
#[derive(Clone, PartialEq, prost::Message)]
pub struct TypeProto {
    /// The tensor type.
    #[prost(message, optional, tag = "1")]
    pub tensor_type: Option<TensorTypeProto>,
}

/// `TypeProto.Tensor`.
#[derive(Clone, PartialEq, prost::Message)]
pub struct TensorTypeProto {
    /// Element type ([`FLOAT`], ...).
    #[prost(int32, tag = "1")]
    pub elem_type: i32,
    /// Shape.
    #[prost(message, optional, tag = "2")]
    pub shape: Option<TensorShapeProto>,
}

/// `TensorShapeProto`.
#[derive(Clone, PartialEq, prost::Message)]
pub struct TensorShapeProto {
    /// Dimensions.
    #[prost(message, repeated, tag = "1")]
    pub dim: Vec<Dimension>,
}

/// `TensorShapeProto.Dimension`: a size or a symbolic name (the `value` oneof).
#[derive(Clone, PartialEq, prost::Message)]
pub struct Dimension {
    /// Fixed size.
    #[prost(int64, optional, tag = "1")]
    pub dim_value: Option<i64>,
    /// Symbolic size (e.g. `batch`).
    #[prost(string, optional, tag = "2")]
    pub dim_param: Option<String>,
}
