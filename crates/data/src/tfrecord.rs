//! TFRecord files: `u64 length (LE) | u32 masked CRC32C of length | data | u32 masked CRC32C of
//! data`. Both checksums are verified on every read. An [`RecordIndex`] built by one scan gives
//! random access, so epochs can be shuffled globally and a run can resume at an exact record.

use std::fs::File;
use std::io::{BufReader, Read, Seek, SeekFrom, Write};
use std::path::{Path, PathBuf};

use crate::error::{DataError, Result};

/// The CRC32C of `data`, masked as TFRecord stores it.
pub use model::tf::bundle::masked_crc32c as masked_crc;

/// Appends records to any writer.
#[derive(Debug)]
pub struct RecordWriter<W: Write> {
    inner: W,
}

impl<W: Write> RecordWriter<W> {
    /// Wraps a writer.
    pub fn new(inner: W) -> Self {
        Self { inner }
    }

    /// Writes one record.
    pub fn write(&mut self, data: &[u8]) -> std::io::Result<()> {
        let len = (data.len() as u64).to_le_bytes();
        self.inner.write_all(&len)?;
        self.inner.write_all(&masked_crc(&len).to_le_bytes())?;
        self.inner.write_all(data)?;
        self.inner.write_all(&masked_crc(data).to_le_bytes())
    }

    /// The wrapped writer (e.g. to flush it).
    pub fn get_mut(&mut self) -> &mut W {
        &mut self.inner
    }

    /// Returns the writer.
    pub fn into_inner(self) -> W {
        self.inner
    }
}

/// Reads one record from `reader` positioned at `offset` (for error messages).
/// Returns `Ok(None)` at a clean end of file.
fn read_record(reader: &mut impl Read, path: &Path, offset: u64) -> Result<Option<Vec<u8>>> {
    let corrupt = |problem: String| DataError::CorruptRecord {
        path: path.to_path_buf(),
        offset,
        problem,
    };
    let mut header = [0u8; 12];
    let mut filled = 0;
    while filled < header.len() {
        let n = reader
            .read(&mut header[filled..])
            .map_err(DataError::io("reading", path))?;
        if n == 0 {
            break;
        }
        filled += n;
    }
    if filled == 0 {
        return Ok(None);
    }
    if filled < header.len() {
        return Err(corrupt(format!("truncated header ({filled} of 12 bytes)")));
    }
    let len_bytes: [u8; 8] = header[..8].try_into().expect("8 bytes");
    let len_crc = u32::from_le_bytes(header[8..].try_into().expect("4 bytes"));
    if masked_crc(&len_bytes) != len_crc {
        return Err(corrupt("length checksum mismatch".into()));
    }
    let len = u64::from_le_bytes(len_bytes);
    let mut data = Vec::new();
    let got = reader
        .take(len)
        .read_to_end(&mut data)
        .map_err(DataError::io("reading", path))?;
    if (got as u64) < len {
        return Err(corrupt(format!("truncated data ({got} of {len} bytes)")));
    }
    let mut crc = [0u8; 4];
    reader
        .read_exact(&mut crc)
        .map_err(|_| corrupt("truncated data checksum".into()))?;
    if masked_crc(&data) != u32::from_le_bytes(crc) {
        return Err(corrupt("data checksum mismatch".into()));
    }
    Ok(Some(data))
}

/// Every record of a file, in order, each verified.
pub fn read_all(path: &Path) -> Result<Vec<Vec<u8>>> {
    let file = File::open(path).map_err(DataError::io("opening", path))?;
    let mut reader = BufReader::new(file);
    let mut records = Vec::new();
    let mut offset = 0;
    while let Some(r) = read_record(&mut reader, path, offset)? {
        offset += r.len() as u64 + 16;
        records.push(r);
    }
    Ok(records)
}

/// Where a record lives: file number in the index and byte offset of its header.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct RecordLocation {
    /// Index into [`RecordIndex::files`].
    pub file: usize,
    /// Byte offset of the record's header.
    pub offset: u64,
}

/// Offsets of every record of a set of files, from one verifying scan.
#[derive(Debug, Clone, Default)]
pub struct RecordIndex {
    files: Vec<PathBuf>,
    records: Vec<RecordLocation>,
}

impl RecordIndex {
    /// Scans `files` in order, verifying every checksum.
    pub fn build(files: &[PathBuf]) -> Result<Self> {
        let mut index = Self {
            files: files.to_vec(),
            records: Vec::new(),
        };
        for (i, path) in files.iter().enumerate() {
            let file = File::open(path).map_err(DataError::io("opening", path))?;
            let mut reader = BufReader::new(file);
            let mut offset = 0;
            while let Some(r) = read_record(&mut reader, path, offset)? {
                index.records.push(RecordLocation { file: i, offset });
                offset += r.len() as u64 + 16;
            }
        }
        Ok(index)
    }

    /// The indexed files.
    pub fn files(&self) -> &[PathBuf] {
        &self.files
    }

    /// Number of records.
    pub fn len(&self) -> usize {
        self.records.len()
    }

    /// True when there are no records.
    pub fn is_empty(&self) -> bool {
        self.records.is_empty()
    }

    /// Location of record `i`.
    pub fn location(&self, i: usize) -> RecordLocation {
        self.records[i]
    }

    /// The number of record `i` within its file, from 0.
    pub fn number_in_file(&self, i: usize) -> usize {
        let file = self.records[i].file;
        i - self.records.partition_point(|r| r.file < file)
    }

    /// An error about record `i` that names its file, its number in the file and its byte
    /// offset.
    pub fn record_error(&self, i: usize, problem: String) -> DataError {
        let loc = self.location(i);
        DataError::Record {
            path: self.files[loc.file].clone(),
            record: self.number_in_file(i),
            offset: loc.offset,
            problem,
        }
    }

    /// Reads record `i` (checksums verified again).
    pub fn read(&self, i: usize) -> Result<Vec<u8>> {
        let loc = self.records.get(i).copied().ok_or_else(|| {
            DataError::invalid(
                self.files.first().cloned().unwrap_or_default(),
                format!("record {i} out of range ({} records)", self.records.len()),
            )
        })?;
        let path = &self.files[loc.file];
        let mut file = File::open(path).map_err(DataError::io("opening", path))?;
        file.seek(SeekFrom::Start(loc.offset))
            .map_err(DataError::io("seeking", path))?;
        read_record(&mut BufReader::new(file), path, loc.offset)?.ok_or_else(|| {
            DataError::CorruptRecord {
                path: path.clone(),
                offset: loc.offset,
                problem: "record vanished (file shortened since indexing)".into(),
            }
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn write_file(path: &Path, records: &[&[u8]]) {
        let mut w = RecordWriter::new(Vec::new());
        for r in records {
            w.write(r).unwrap();
        }
        std::fs::write(path, w.into_inner()).unwrap();
    }

    #[test]
    fn masked_crc_of_known_input() {
        // CRC32C("123456789") = 0xE3069283, masked = ror15 + 0xa282ead8
        let crc: u32 = 0xE306_9283;
        assert_eq!(crc32c::crc32c(b"123456789"), crc);
        assert_eq!(
            masked_crc(b"123456789"),
            crc.rotate_right(15).wrapping_add(0xa282_ead8)
        );
    }

    #[test]
    fn round_trip_and_random_access() {
        let dir = tempfile::tempdir().unwrap();
        let (a, b) = (dir.path().join("a"), dir.path().join("b"));
        write_file(&a, &[b"one", b"", b"three"]);
        write_file(&b, &[b"four"]);
        assert_eq!(
            read_all(&a).unwrap(),
            vec![b"one".to_vec(), vec![], b"three".to_vec()]
        );
        let index = RecordIndex::build(&[a, b]).unwrap();
        assert_eq!(index.len(), 4);
        assert_eq!(index.read(3).unwrap(), b"four");
        assert_eq!(index.read(2).unwrap(), b"three");
        assert_eq!(
            (0..4).map(|i| index.number_in_file(i)).collect::<Vec<_>>(),
            vec![0, 1, 2, 0]
        );
        assert_eq!(
            index.location(2),
            RecordLocation {
                file: 0,
                offset: 19 + 16
            }
        );
        assert!(index.read(4).is_err());
    }

    #[test]
    fn corruption_and_truncation_name_file_and_offset() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("bad.tfrecord");
        write_file(&path, &[b"hello", b"world"]);
        let good = std::fs::read(&path).unwrap();
        // flip a payload byte of the second record (header at 21, payload at 33)
        let mut bytes = good.clone();
        bytes[34] ^= 1;
        std::fs::write(&path, &bytes).unwrap();
        let err = read_all(&path).unwrap_err().to_string();
        assert!(
            err.contains("bad.tfrecord")
                && err.contains("byte 21")
                && err.contains("data checksum"),
            "{err}"
        );
        // damaged length
        let mut bytes = good.clone();
        bytes[0] ^= 1;
        std::fs::write(&path, &bytes).unwrap();
        let err = RecordIndex::build(std::slice::from_ref(&path))
            .unwrap_err()
            .to_string();
        assert!(
            err.contains("byte 0") && err.contains("length checksum"),
            "{err}"
        );
        // truncated in the middle of the second record's payload, and of its header
        for (cut, what) in [
            (good.len() - 6, "truncated data"),
            (good.len() - 20, "truncated header"),
        ] {
            std::fs::write(&path, &good[..cut]).unwrap();
            let err = read_all(&path).unwrap_err().to_string();
            assert!(
                err.contains("byte 21") && err.contains(what),
                "{cut}: {err}"
            );
        }
    }
}
