//! Errors of the model crate.

use std::path::PathBuf;

/// Everything that can go wrong when building, loading or running the model.
#[derive(Debug, thiserror::Error)]
pub enum ModelError {
    /// A configuration value is out of its allowed range.
    #[error("invalid model config: `{field}` {problem}")]
    InvalidConfig {
        /// The offending field, as written in the JSON config.
        field: &'static str,
        /// What is wrong with it.
        problem: String,
    },
    /// An input image cannot be used.
    #[error("invalid image: {0}")]
    InvalidImage(String),
    /// A weights file does not fit the model built from the config.
    #[error("weights file {path} does not fit this model: {problem}")]
    IncompatibleWeights {
        /// The weights file.
        path: PathBuf,
        /// Which parameter differs and how.
        problem: String,
    },
    /// A file could not be read or written.
    #[error("{action} {path}: {source}")]
    Io {
        /// What was being done ("reading", "writing").
        action: &'static str,
        /// The file concerned.
        path: PathBuf,
        /// The underlying error.
        source: std::io::Error,
    },
    /// A TensorFlow checkpoint cannot be read.
    #[error("TensorFlow checkpoint {path}: {problem}")]
    Checkpoint {
        /// The index or data file concerned (or the prefix).
        path: PathBuf,
        /// What is wrong, naming the tensor where there is one.
        problem: String,
    },
    /// A weights file holds a value that is not finite.
    #[error(
        "weights file {path}: tensor `{tensor}` holds {value} at element {index}; a network restored from it cannot train or detect"
    )]
    NonFinite {
        /// The file.
        path: PathBuf,
        /// The tensor, as the file names it.
        tensor: String,
        /// The first element that is not finite, in the file's order.
        index: usize,
        /// Its value (NaN or an infinity).
        value: f32,
    },
    /// A network cannot be quantized as asked.
    #[error("int8 quantization: {0}")]
    Quantization(String),
    /// A config or weights file could not be decoded.
    #[error("cannot decode {path}: {problem}")]
    Decode {
        /// The file concerned.
        path: PathBuf,
        /// What the decoder said.
        problem: String,
    },
}

/// Shorthand for results of this crate.
pub type Result<T> = std::result::Result<T, ModelError>;
