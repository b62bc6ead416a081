//! Errors of the data crate. Every variant names the file concerned.

use std::path::PathBuf;

/// Everything that can go wrong reading or writing datasets.
#[derive(Debug, thiserror::Error)]
pub enum DataError {
    /// A file could not be opened, read or written.
    #[error("{action} {path}: {source}")]
    Io {
        /// What was being done.
        action: &'static str,
        /// The file.
        path: PathBuf,
        /// The underlying error.
        source: std::io::Error,
    },
    /// A TFRecord file is damaged at a byte offset.
    #[error("{path}: corrupt TFRecord at byte {offset}: {problem}")]
    CorruptRecord {
        /// The file.
        path: PathBuf,
        /// Byte offset of the damaged record's header.
        offset: u64,
        /// What is wrong (CRC mismatch, truncation).
        problem: String,
    },
    /// A record of a TFRecord file holds what it should not (a bad label, box or image).
    #[error("{path}: record {record} (byte {offset}): {problem}")]
    Record {
        /// The file.
        path: PathBuf,
        /// The record's number in the file, from 0.
        record: usize,
        /// Byte offset of the record's header.
        offset: u64,
        /// What is wrong, naming the field and the value.
        problem: String,
    },
    /// A record or annotation does not hold what it should.
    #[error("{path}: {problem}")]
    Invalid {
        /// The file (and record, where known, in the message).
        path: PathBuf,
        /// What is wrong.
        problem: String,
    },
    /// One example of a dataset being prepared is bad; `skip_invalid` would skip and count
    /// it.
    #[error("{0}\n(to skip such examples and count them, run prepare-data with --skip-invalid)")]
    InvalidExample(Box<DataError>),
    /// An image could not be decoded.
    #[error("{path}: cannot decode image: {problem}")]
    Image {
        /// The file or record the image came from.
        path: PathBuf,
        /// What the decoder said.
        problem: String,
    },
}

impl DataError {
    pub(crate) fn io(
        action: &'static str,
        path: impl Into<PathBuf>,
    ) -> impl FnOnce(std::io::Error) -> Self {
        let path = path.into();
        move |source| Self::Io {
            action,
            path,
            source,
        }
    }

    pub(crate) fn invalid(path: impl Into<PathBuf>, problem: impl Into<String>) -> Self {
        Self::Invalid {
            path: path.into(),
            problem: problem.into(),
        }
    }
}

/// Shorthand for results of this crate.
pub type Result<T> = std::result::Result<T, DataError>;
