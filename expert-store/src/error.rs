use std::path::PathBuf;

/// Errors from opening or reading weight files; each names the file or tensor at fault.
#[derive(Debug, thiserror::Error)]
pub enum StoreError {
    /// An I/O error on a named file.
    #[error("{path}: {source}")]
    Io {
        /// The file.
        path: PathBuf,
        /// The underlying error.
        source: std::io::Error,
    },
    /// A file that is not a valid safetensors file or index.
    #[error("{path}: {message}")]
    BadFile {
        /// The file.
        path: PathBuf,
        /// What is wrong with it.
        message: String,
    },
    /// No weight files where some were expected.
    #[error("no *.safetensors files in {0}")]
    NoWeights(PathBuf),
    /// A tensor the model needs is absent from every shard.
    #[error("tensor `{0}` is missing from the checkpoint")]
    MissingTensor(String),
    /// A tensor whose size does not fit the requested expert layout.
    #[error("tensor `{name}`: {message}")]
    BadTensor {
        /// The tensor.
        name: String,
        /// What is wrong with it.
        message: String,
    },
    /// A record asked for outside the layout.
    #[error("no expert record for layer {layer} expert {expert}")]
    NoRecord {
        /// Layer index.
        layer: usize,
        /// Expert index.
        expert: usize,
    },
    /// A record read that failed (I/O error, short read, checksum mismatch); names the record and file.
    #[error("{0}")]
    Read(String),
    /// The streaming engine cannot serve (bad budget, no records, cache too small).
    #[error("expert engine: {0}")]
    Engine(String),
    /// A packed store that is missing, corrupt, or does not match the model; names the file.
    #[error("{path}: {message}")]
    BadStore {
        /// The manifest or data file.
        path: PathBuf,
        /// What is wrong.
        message: String,
    },
}
