//! The runtime's error type.

use std::path::PathBuf;

/// Errors from loading a model or running it; each names the file, tensor or limit at fault.
#[derive(Debug, thiserror::Error)]
pub enum ModelError {
    /// A weight-file problem (missing, truncated, malformed, missing tensor).
    #[error(transparent)]
    Store(#[from] expert_store::StoreError),
    /// A file that could not be read.
    #[error("{path}: {source}")]
    Io {
        /// The file.
        path: PathBuf,
        /// The underlying error.
        source: std::io::Error,
    },
    /// A config file that is missing fields, has wrong types or is not JSON.
    #[error("{path}: {message}")]
    Config {
        /// The file.
        path: PathBuf,
        /// What is wrong.
        message: String,
    },
    /// A `model_type` no architecture is registered for.
    #[error("unsupported model_type `{0}` (supported: {1})")]
    UnknownModelType(String, String),
    /// A quantization mode or width the kernels do not implement.
    #[error("unsupported quantization for `{path}`: {message}")]
    UnsupportedQuant {
        /// Module path.
        path: String,
        /// What is unsupported.
        message: String,
    },
    /// A tensor whose shape or dtype contradicts the config.
    #[error("tensor `{name}`: {message}")]
    BadTensor {
        /// Tensor name.
        name: String,
        /// Expected vs actual.
        message: String,
    },
    /// A tokenizer or chat-template problem.
    #[error("{0}")]
    Tokenizer(String),
    /// Input beyond the context limit.
    #[error("{0}")]
    Limit(String),
    /// A bad request parameter.
    #[error("invalid argument: {0}")]
    InvalidArgument(String),
    /// The compute backend failed (e.g. an MLX error).
    #[error("backend: {0}")]
    Backend(String),
    /// A bug surfaced as a panic; the request that hit it failed, the model is still usable.
    #[error("internal error: {0}")]
    Internal(String),
}

/// Result with [`ModelError`].
pub type Result<T, E = ModelError> = std::result::Result<T, E>;
