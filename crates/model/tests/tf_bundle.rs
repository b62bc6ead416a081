//! The tensor-bundle reader on checkpoints written by TensorFlow 2.21 (TF 1 `Saver` V2 with
//! every dtype, a two-shard checkpoint, a TF 2 object-based checkpoint; see
//! `scripts/tf-fixtures/PROVENANCE.md`), and on damaged copies of them.

use std::path::{Path, PathBuf};

use model::ModelError;
use model::tf::bundle::{Checkpoint, DType, is_checkpoint};
use serde_json::Value;

fn fixture(name: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("tests/fixtures/tf/bundle")
        .join(name)
}

fn expected(json: &str) -> Vec<Value> {
    let text = std::fs::read_to_string(fixture(json)).unwrap();
    let v: Value = serde_json::from_str(&text).unwrap();
    v["tensors"].as_array().unwrap().clone()
}

fn dtype(name: &str) -> DType {
    match name {
        "float32" => DType::F32,
        "float64" => DType::F64,
        "float16" => DType::F16,
        "bfloat16" => DType::BF16,
        "int8" => DType::I8,
        "int16" => DType::I16,
        "int32" => DType::I32,
        "int64" => DType::I64,
        "uint8" => DType::U8,
        "bool" => DType::Bool,
        "string" => DType::String,
        other => panic!("fixture dtype {other}"),
    }
}

fn hex(bytes: &[u8]) -> String {
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}

/// Every tensor of `json`'s list has the listed dtype, shape, bytes and values.
fn check_all(ckpt: &Checkpoint, json: &str) {
    let tensors = expected(json);
    let names: Vec<&str> = ckpt.names().collect();
    let listed: Vec<&str> = tensors
        .iter()
        .map(|t| t["name"].as_str().unwrap())
        .collect();
    assert_eq!(names, listed, "names, in key order");
    for t in &tensors {
        let name = t["name"].as_str().unwrap();
        let info = ckpt.info(name).unwrap();
        let shape: Vec<usize> = t["shape"]
            .as_array()
            .unwrap()
            .iter()
            .map(|d| d.as_u64().unwrap() as usize)
            .collect();
        assert_eq!(info.shape, shape, "{name}");
        assert_eq!(info.dtype, dtype(t["dtype"].as_str().unwrap()), "{name}");
        if info.dtype == DType::String {
            let err = ckpt.read_bytes(name).unwrap_err().to_string();
            assert!(
                err.contains(name) && err.contains("String is not supported"),
                "{err}"
            );
            continue;
        }
        assert_eq!(
            hex(&ckpt.read_bytes(name).unwrap()),
            t["bytes_le_hex"].as_str().unwrap(),
            "{name}"
        );
        let values = t["values"].as_array().unwrap();
        match info.dtype {
            DType::F32 | DType::F64 | DType::F16 | DType::BF16 => {
                let got = ckpt.read_f32(name).unwrap();
                let want: Vec<f32> = values.iter().map(|v| v.as_f64().unwrap() as f32).collect();
                assert_eq!(
                    got.iter().map(|v| v.to_bits()).collect::<Vec<_>>(),
                    want.iter().map(|v| v.to_bits()).collect::<Vec<_>>(),
                    "{name}"
                );
            }
            _ => {
                let got = ckpt.read_i64(name).unwrap();
                let want: Vec<i64> = values
                    .iter()
                    .map(|v| v.as_i64().or_else(|| v.as_bool().map(i64::from)).unwrap())
                    .collect();
                assert_eq!(got, want, "{name}");
            }
        }
    }
}

#[test]
fn every_dtype_of_a_tf1_checkpoint_reads_exactly() {
    let prefix = fixture("dtypes.ckpt");
    assert!(is_checkpoint(&prefix));
    let ckpt = Checkpoint::open(&prefix).unwrap();
    check_all(&ckpt, "dtypes.json");
    // the index file itself names the checkpoint too
    let via_index = Checkpoint::open(&fixture("dtypes.ckpt.index")).unwrap();
    assert_eq!(via_index.names().count(), 14);
    // a float tensor is not an integer one, and the reverse
    assert!(
        ckpt.read_i64("dtypes/float32")
            .unwrap_err()
            .to_string()
            .contains("not an integer tensor")
    );
    assert!(
        ckpt.read_f32("dtypes/int32")
            .unwrap_err()
            .to_string()
            .contains("not a floating-point tensor")
    );
    assert!(
        ckpt.read_f32("nothing/here")
            .unwrap_err()
            .to_string()
            .contains("no tensor named `nothing/here`")
    );
}

#[test]
fn tensors_come_from_both_data_shards() {
    let ckpt = Checkpoint::open(&fixture("sharded.ckpt")).unwrap();
    check_all(&ckpt, "sharded.json");
    assert!(
        ckpt.data_path(1)
            .ends_with("sharded.ckpt.data-00001-of-00002")
    );
}

#[test]
fn a_tf2_object_based_checkpoint_lists_and_reads() {
    let ckpt = Checkpoint::open(&fixture("tf2.ckpt-1")).unwrap();
    check_all(&ckpt, "tf2.json");
}

/// A copy of `dtypes.ckpt` in a temporary folder, for damaging.
fn copy() -> (tempfile::TempDir, PathBuf) {
    let dir = tempfile::tempdir().unwrap();
    for ext in ["index", "data-00000-of-00001"] {
        std::fs::copy(
            fixture(&format!("dtypes.ckpt.{ext}")),
            dir.path().join(format!("dtypes.ckpt.{ext}")),
        )
        .unwrap();
    }
    let prefix = dir.path().join("dtypes.ckpt");
    (dir, prefix)
}

fn data_file(prefix: &Path) -> PathBuf {
    PathBuf::from(format!("{}.data-00000-of-00001", prefix.display()))
}

fn index_file(prefix: &Path) -> PathBuf {
    PathBuf::from(format!("{}.index", prefix.display()))
}

#[test]
fn a_flipped_data_byte_fails_the_crc_naming_file_and_tensor() {
    let (_dir, prefix) = copy();
    let info = expected("dtypes.json")
        .into_iter()
        .find(|t| t["name"] == "dtypes/float32_4d")
        .unwrap();
    let offset = info["offset"].as_u64().unwrap() as usize;
    let mut bytes = std::fs::read(data_file(&prefix)).unwrap();
    bytes[offset + 5] ^= 0x10;
    std::fs::write(data_file(&prefix), bytes).unwrap();
    let ckpt = Checkpoint::open(&prefix).unwrap();
    let err = ckpt.read_f32("dtypes/float32_4d").unwrap_err();
    let msg = err.to_string();
    assert!(matches!(err, ModelError::Checkpoint { .. }));
    assert!(
        msg.contains("dtypes.ckpt.data-00000-of-00001")
            && msg.contains("dtypes/float32_4d")
            && msg.contains("CRC32C"),
        "{msg}"
    );
    // the other tensors still read
    assert!(ckpt.read_f32("dtypes/float32").is_ok());
}

#[test]
fn truncated_files_are_errors_naming_them() {
    let (_dir, prefix) = copy();
    let data = std::fs::read(data_file(&prefix)).unwrap();
    std::fs::write(data_file(&prefix), &data[..data.len() / 2]).unwrap();
    let ckpt = Checkpoint::open(&prefix).unwrap();
    let last = expected("dtypes.json")
        .into_iter()
        .max_by_key(|t| t["offset"].as_u64().unwrap())
        .unwrap();
    let err = ckpt
        .read_bytes(last["name"].as_str().unwrap())
        .unwrap_err()
        .to_string();
    assert!(
        err.contains("past the end of the data file") && err.contains("truncated"),
        "{err}"
    );

    let index = std::fs::read(index_file(&prefix)).unwrap();
    for cut in [index.len() - 1, index.len() / 2, 20] {
        std::fs::write(index_file(&prefix), &index[..cut]).unwrap();
        let err = Checkpoint::open(&prefix).unwrap_err().to_string();
        assert!(err.contains("dtypes.ckpt.index"), "cut at {cut}: {err}");
    }
    // a block of the index damaged: its CRC fails
    let mut damaged = index.clone();
    damaged[3] ^= 0x01;
    std::fs::write(index_file(&prefix), &damaged).unwrap();
    let err = Checkpoint::open(&prefix).unwrap_err().to_string();
    assert!(err.contains("CRC32C"), "{err}");
}

#[test]
fn other_files_are_not_checkpoints() {
    let dir = tempfile::tempdir().unwrap();
    let prefix = dir.path().join("image");
    std::fs::write(index_file(&prefix), vec![0x89; 300]).unwrap();
    let err = Checkpoint::open(&prefix).unwrap_err().to_string();
    assert!(err.contains("not a TensorFlow checkpoint index"), "{err}");
    let err = Checkpoint::open(&dir.path().join("missing"))
        .unwrap_err()
        .to_string();
    assert!(err.contains("missing.index"), "{err}");
    assert!(!is_checkpoint(&dir.path().join("missing")));
    // a folder with TF's `checkpoint` state file names its latest checkpoint
    let (copy_dir, _) = copy();
    std::fs::write(
        copy_dir.path().join("checkpoint"),
        "model_checkpoint_path: \"dtypes.ckpt\"\nall_model_checkpoint_paths: \"dtypes.ckpt\"\n",
    )
    .unwrap();
    assert_eq!(
        Checkpoint::open(copy_dir.path()).unwrap().names().count(),
        14
    );
}
