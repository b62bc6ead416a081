//! The protobuf messages of a tensor bundle's index (`tensor_bundle.proto`,
//! `tensor_shape.proto`, `versions.proto`), decoded with prost. Only the fields the reader
//! needs are declared; prost skips the others.

/// `BundleHeaderProto`: the value stored under the empty key.
#[derive(Clone, PartialEq, prost::Message)]
pub struct BundleHeader {
    /// Number of data files (`PREFIX.data-NNNNN-of-MMMMM`).
    #[prost(int32, tag = "1")]
    pub num_shards: i32,
    /// `LITTLE = 0`, `BIG = 1`.
    #[prost(int32, tag = "2")]
    pub endianness: i32,
    /// The format version.
    #[prost(message, optional, tag = "3")]
    pub version: Option<VersionDef>,
}

/// `VersionDef`.
#[derive(Clone, PartialEq, prost::Message)]
pub struct VersionDef {
    /// The version of the writer.
    #[prost(int32, tag = "1")]
    pub producer: i32,
    /// The oldest reader that may read the bundle.
    #[prost(int32, tag = "2")]
    pub min_consumer: i32,
    /// Reader versions that must not read it.
    #[prost(int32, repeated, tag = "3")]
    pub bad_consumers: Vec<i32>,
}

/// `BundleEntryProto`: where one tensor lies and how to check it.
#[derive(Clone, PartialEq, prost::Message)]
pub struct BundleEntry {
    /// `DataType` enum value.
    #[prost(int32, tag = "1")]
    pub dtype: i32,
    /// The tensor's shape.
    #[prost(message, optional, tag = "2")]
    pub shape: Option<TensorShape>,
    /// Which data file holds the bytes.
    #[prost(int32, tag = "3")]
    pub shard_id: i32,
    /// Byte offset in that file.
    #[prost(int64, tag = "4")]
    pub offset: i64,
    /// Byte length.
    #[prost(int64, tag = "5")]
    pub size: i64,
    /// Masked CRC32C of the bytes.
    #[prost(fixed32, tag = "6")]
    pub crc32c: u32,
    /// Slices of a partitioned variable (not read here).
    #[prost(message, repeated, tag = "7")]
    pub slices: Vec<TensorSlice>,
}

/// `TensorShapeProto`.
#[derive(Clone, PartialEq, prost::Message)]
pub struct TensorShape {
    /// The dimensions, outermost first.
    #[prost(message, repeated, tag = "2")]
    pub dim: Vec<Dim>,
    /// Set when the rank is unknown.
    #[prost(bool, tag = "3")]
    pub unknown_rank: bool,
}

/// `TensorShapeProto.Dim`.
#[derive(Clone, PartialEq, prost::Message)]
pub struct Dim {
    /// Size, `-1` if unknown.
    #[prost(int64, tag = "1")]
    pub size: i64,
}

/// `TensorSliceProto`: only its presence matters here.
#[derive(Clone, PartialEq, prost::Message)]
pub struct TensorSlice {}
