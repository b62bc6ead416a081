//! Reading TensorFlow checkpoints: the tensor bundle that `tf.train.Saver` (V2) writes in TF 1
//! and `tf.train.Checkpoint` writes in TF 2, `PREFIX.index` (a sorted table of
//! `BundleEntryProto`s, the `BundleHeaderProto` under the empty key) beside the data files
//! `PREFIX.data-NNNNN-of-MMMMM`. Every tensor's bytes are checked against its CRC32C.

mod proto;
mod table;

use std::collections::BTreeMap;
use std::fs::File;
use std::io::{Read, Seek, SeekFrom};
use std::path::{Path, PathBuf};

use prost::Message;

use crate::error::{ModelError, Result};
use crate::floats::{FloatEncoding, chunks};
use proto::{BundleEntry, BundleHeader};

const MASK_DELTA: u32 = 0xa282_ead8;

/// The CRC32C of `data`, masked as TensorFlow stores it (TFRecords, tables, bundles).
pub fn masked_crc32c(data: &[u8]) -> u32 {
    crc32c::crc32c(data)
        .rotate_right(15)
        .wrapping_add(MASK_DELTA)
}

/// A tensor's element type (`DataType` of `types.proto`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum DType {
    /// `float32`.
    F32,
    /// `float64`.
    F64,
    /// `float16`.
    F16,
    /// `bfloat16`.
    BF16,
    /// `int8`.
    I8,
    /// `int16`.
    I16,
    /// `int32`.
    I32,
    /// `int64`.
    I64,
    /// `uint8`.
    U8,
    /// `uint16`.
    U16,
    /// `uint32`.
    U32,
    /// `uint64`.
    U64,
    /// `bool`.
    Bool,
    /// `string` (listed, not read).
    String,
    /// Any other `DataType` value (listed, not read).
    Other(i32),
}

impl DType {
    fn from_proto(v: i32) -> Self {
        match v {
            1 => Self::F32,
            2 => Self::F64,
            3 => Self::I32,
            4 => Self::U8,
            5 => Self::I16,
            6 => Self::I8,
            7 => Self::String,
            9 => Self::I64,
            10 => Self::Bool,
            14 => Self::BF16,
            17 => Self::U16,
            19 => Self::F16,
            22 => Self::U32,
            23 => Self::U64,
            other => Self::Other(other),
        }
    }

    /// Bytes per element of the fixed-size types.
    pub fn size(self) -> Option<usize> {
        Some(match self {
            Self::I8 | Self::U8 | Self::Bool => 1,
            Self::F16 | Self::BF16 | Self::I16 | Self::U16 => 2,
            Self::F32 | Self::I32 | Self::U32 => 4,
            Self::F64 | Self::I64 | Self::U64 => 8,
            Self::String | Self::Other(_) => return None,
        })
    }
}

/// A tensor's type and shape.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TensorInfo {
    /// Element type.
    pub dtype: DType,
    /// Dimensions, outermost first (TF's order: convolution kernels are `[kh, kw, in, out]`).
    pub shape: Vec<usize>,
}

struct Entry {
    info: TensorInfo,
    shard: usize,
    offset: u64,
    size: usize,
    crc: u32,
    partitioned: bool,
}

/// An open TensorFlow checkpoint: its index in memory, tensors read from the data files on
/// demand.
pub struct Checkpoint {
    prefix: PathBuf,
    num_shards: usize,
    entries: BTreeMap<String, Entry>,
}

impl std::fmt::Debug for Checkpoint {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Checkpoint")
            .field("prefix", &self.prefix)
            .field("tensors", &self.entries.len())
            .finish()
    }
}

/// Whether `path` names a TensorFlow checkpoint: a prefix with a `.index` file beside it, the
/// `.index` file itself, or a folder whose `checkpoint` state file names one.
pub fn is_checkpoint(path: &Path) -> bool {
    resolve_prefix(path).is_ok_and(|p| index_path(&p).is_file())
}

fn index_path(prefix: &Path) -> PathBuf {
    let mut s = prefix.as_os_str().to_owned();
    s.push(".index");
    PathBuf::from(s)
}

/// The prefix `path` stands for (module docs of [`is_checkpoint`]).
fn resolve_prefix(path: &Path) -> std::result::Result<PathBuf, String> {
    if let Some(prefix) = path.to_str().and_then(|s| s.strip_suffix(".index")) {
        return Ok(PathBuf::from(prefix));
    }
    if !path.is_dir() {
        return Ok(path.to_path_buf());
    }
    let state = path.join("checkpoint");
    let text = std::fs::read_to_string(&state).map_err(|e| {
        format!(
            "{} is a folder without a readable `checkpoint` file ({e})",
            path.display()
        )
    })?;
    let latest = text
        .lines()
        .find_map(|l| l.trim().strip_prefix("model_checkpoint_path:"))
        .map(|v| v.trim().trim_matches('"'))
        .ok_or_else(|| format!("{} names no model_checkpoint_path", state.display()))?;
    Ok(path.join(latest))
}

impl Checkpoint {
    /// Opens the checkpoint at `path` (a prefix such as `model.ckpt-1234`, its `.index` file,
    /// or a folder with a `checkpoint` state file) and reads its index.
    pub fn open(path: &Path) -> Result<Self> {
        let fail = |p: &Path, problem: String| ModelError::Checkpoint {
            path: p.to_path_buf(),
            problem,
        };
        let prefix = resolve_prefix(path).map_err(|p| fail(path, p))?;
        let index = index_path(&prefix);
        let bytes = std::fs::read(&index).map_err(|source| ModelError::Io {
            action: "reading",
            path: index.clone(),
            source,
        })?;
        let rows = table::read_table(&bytes).map_err(|p| fail(&index, p))?;
        let mut header = None;
        let mut entries = BTreeMap::new();
        for (key, value) in rows {
            let name = String::from_utf8(key)
                .map_err(|_| fail(&index, "a tensor name is not UTF-8".into()))?;
            if name.is_empty() {
                header = Some(
                    BundleHeader::decode(value.as_slice())
                        .map_err(|e| fail(&index, format!("bad bundle header: {e}")))?,
                );
                continue;
            }
            let entry = BundleEntry::decode(value.as_slice())
                .map_err(|e| fail(&index, format!("bad entry for tensor `{name}`: {e}")))?;
            let entry = Entry::from_proto(entry)
                .map_err(|p| fail(&index, format!("tensor `{name}`: {p}")))?;
            entries.insert(name, entry);
        }
        let header =
            header.ok_or_else(|| fail(&index, "no bundle header (not a tensor bundle)".into()))?;
        let num_shards = check_header(&header).map_err(|p| fail(&index, p))?;
        if let Some((name, e)) = entries.iter().find(|(_, e)| e.shard >= num_shards) {
            return Err(fail(
                &index,
                format!("tensor `{name}` lies in shard {} of {num_shards}", e.shard),
            ));
        }
        Ok(Self {
            prefix,
            num_shards,
            entries,
        })
    }

    /// The prefix the checkpoint was opened at.
    pub fn prefix(&self) -> &Path {
        &self.prefix
    }

    /// Every tensor name, sorted.
    pub fn names(&self) -> impl Iterator<Item = &str> {
        self.entries.keys().map(String::as_str)
    }

    /// Type and shape of a tensor, `None` if the checkpoint lacks it.
    pub fn info(&self, name: &str) -> Option<&TensorInfo> {
        self.entries.get(name).map(|e| &e.info)
    }

    /// Path of data file `shard`.
    pub fn data_path(&self, shard: usize) -> PathBuf {
        let mut s = self.prefix.as_os_str().to_owned();
        s.push(format!(".data-{shard:05}-of-{:05}", self.num_shards));
        PathBuf::from(s)
    }

    /// The raw little-endian bytes of a fixed-size tensor, CRC32C checked.
    pub fn read_bytes(&self, name: &str) -> Result<Vec<u8>> {
        let entry = self
            .entries
            .get(name)
            .ok_or_else(|| ModelError::Checkpoint {
                path: self.prefix.clone(),
                problem: format!("no tensor named `{name}`"),
            })?;
        let path = self.data_path(entry.shard);
        let fail = |problem: String| ModelError::Checkpoint {
            path: path.clone(),
            problem: format!("tensor `{name}`: {problem}"),
        };
        if entry.partitioned {
            return Err(fail(
                "a partitioned variable (saved in slices), which is not read".into(),
            ));
        }
        let elem = entry
            .info
            .dtype
            .size()
            .ok_or_else(|| fail(format!("dtype {:?} is not supported", entry.info.dtype)))?;
        let bytes_needed = entry
            .info
            .shape
            .iter()
            .try_fold(elem, |n, &d| n.checked_mul(d));
        if bytes_needed != Some(entry.size) {
            return Err(fail(format!(
                "{} bytes stored for shape {:?} of {elem}-byte elements",
                entry.size, entry.info.shape
            )));
        }
        let bytes = read_range(&path, entry.offset, entry.size).map_err(fail)?;
        if masked_crc32c(&bytes) != entry.crc {
            return Err(fail(
                "the data fails its CRC32C check (corrupt file)".into(),
            ));
        }
        Ok(bytes)
    }

    /// A floating-point tensor (`float32`, `float64`, `float16` or `bfloat16`) as `f32`.
    pub fn read_f32(&self, name: &str) -> Result<Vec<f32>> {
        let bytes = self.read_bytes(name)?;
        let dtype = self.entries[name].info.dtype;
        let encoding = match dtype {
            DType::F32 => FloatEncoding::F32,
            DType::F64 => FloatEncoding::F64,
            DType::F16 => FloatEncoding::F16,
            DType::BF16 => FloatEncoding::BF16,
            other => {
                return Err(ModelError::Checkpoint {
                    path: self.prefix.clone(),
                    problem: format!("tensor `{name}` is {other:?}, not a floating-point tensor"),
                });
            }
        };
        Ok(encoding.decode(&bytes))
    }

    /// An integer or boolean tensor as `i64`.
    pub fn read_i64(&self, name: &str) -> Result<Vec<i64>> {
        let bytes = self.read_bytes(name)?;
        let dtype = self.entries[name].info.dtype;
        let v = match dtype {
            DType::I8 => chunks(&bytes, |b: [u8; 1]| i64::from(i8::from_le_bytes(b))),
            DType::U8 | DType::Bool => chunks(&bytes, |b: [u8; 1]| i64::from(b[0])),
            DType::I16 => chunks(&bytes, |b| i64::from(i16::from_le_bytes(b))),
            DType::U16 => chunks(&bytes, |b| i64::from(u16::from_le_bytes(b))),
            DType::I32 => chunks(&bytes, |b| i64::from(i32::from_le_bytes(b))),
            DType::U32 => chunks(&bytes, |b| i64::from(u32::from_le_bytes(b))),
            DType::I64 => chunks(&bytes, i64::from_le_bytes),
            DType::U64 => chunks(&bytes, |b| u64::from_le_bytes(b) as i64),
            other => {
                return Err(ModelError::Checkpoint {
                    path: self.prefix.clone(),
                    problem: format!("tensor `{name}` is {other:?}, not an integer tensor"),
                });
            }
        };
        Ok(v)
    }
}

fn read_range(path: &Path, offset: u64, size: usize) -> std::result::Result<Vec<u8>, String> {
    let mut file = File::open(path).map_err(|e| format!("cannot open the data file: {e}"))?;
    let len = file.metadata().map_err(|e| e.to_string())?.len();
    if offset.saturating_add(size as u64) > len {
        return Err(format!(
            "bytes {offset}..{} lie past the end of the data file ({len} bytes): truncated?",
            offset.saturating_add(size as u64)
        ));
    }
    let mut bytes = vec![0; size];
    file.seek(SeekFrom::Start(offset))
        .and_then(|_| file.read_exact(&mut bytes))
        .map_err(|e| format!("reading the data file: {e}"))?;
    Ok(bytes)
}

/// TF's bundle format version 1, read by consumers from version 0 on.
const READER_VERSION: i32 = 1;

fn check_header(header: &BundleHeader) -> std::result::Result<usize, String> {
    if header.endianness != 0 {
        return Err("the bundle is big-endian, which is not read".into());
    }
    if let Some(v) = &header.version
        && (v.min_consumer > READER_VERSION || v.bad_consumers.contains(&READER_VERSION))
    {
        return Err(format!(
            "bundle format version {} needs a newer reader (min consumer {})",
            v.producer, v.min_consumer
        ));
    }
    usize::try_from(header.num_shards)
        .ok()
        .filter(|&n| n > 0)
        .ok_or_else(|| format!("the header claims {} data shards", header.num_shards))
}

impl Entry {
    fn from_proto(e: BundleEntry) -> std::result::Result<Self, String> {
        let shape = e.shape.unwrap_or_default();
        if shape.unknown_rank {
            return Err("shape of unknown rank".into());
        }
        let shape = shape
            .dim
            .iter()
            .map(|d| usize::try_from(d.size).map_err(|_| format!("dimension {}", d.size)))
            .collect::<std::result::Result<Vec<_>, _>>()?;
        if shape
            .iter()
            .try_fold(1usize, |n, &d| n.checked_mul(d))
            .is_none()
        {
            return Err(format!(
                "shape {shape:?} has more elements than memory can address"
            ));
        }
        let bad = |what: &str, v: i64| format!("{what} {v} out of range");
        Ok(Self {
            info: TensorInfo {
                dtype: DType::from_proto(e.dtype),
                shape,
            },
            shard: usize::try_from(e.shard_id).map_err(|_| bad("shard id", e.shard_id.into()))?,
            offset: u64::try_from(e.offset).map_err(|_| bad("offset", e.offset))?,
            size: usize::try_from(e.size).map_err(|_| bad("size", e.size))?,
            crc: e.crc32c,
            partitioned: !e.slices.is_empty(),
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proto::{Dim, TensorShape};

    fn entry(dims: &[i64], offset: i64, size: i64) -> BundleEntry {
        BundleEntry {
            dtype: 1,
            shape: Some(TensorShape {
                dim: dims.iter().map(|&size| Dim { size }).collect(),
                unknown_rank: false,
            }),
            offset,
            size,
            ..Default::default()
        }
    }

    #[test]
    fn hostile_entries_are_refused() {
        let huge = 1i64 << 40;
        let err = |e: BundleEntry| Entry::from_proto(e).err().unwrap_or_default();
        assert!(err(entry(&[huge, huge], 0, 4)).contains("more elements than memory"));
        assert!(err(entry(&[-1, 3], 0, 4)).contains("dimension -1"));
        assert!(err(entry(&[3], -5, 12)).contains("offset -5"));
        assert!(err(entry(&[3], 0, -12)).contains("size -12"));
        assert!(Entry::from_proto(entry(&[3, 4], i64::MAX, 48)).is_ok());
    }

    #[test]
    fn a_range_past_the_end_is_named_without_overflow() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("data");
        std::fs::write(&path, [0u8; 16]).unwrap();
        let err = read_range(&path, u64::MAX - 2, 8).unwrap_err();
        assert!(
            err.contains("past the end of the data file (16 bytes)"),
            "{err}"
        );
    }
}
