//! What `--model` points at: a model directory, or a packed store and the directory it references.

use std::path::{Path, PathBuf};
use std::sync::Arc;

use expert_store::PackedStore;

use crate::error::{ModelError, Result};

/// The model directory `path` names: `path` itself, or the directory a packed store at `path` references.
pub fn model_dir(path: &Path) -> Result<PathBuf> {
    Ok(ModelLocation::resolve(path)?.model_dir().to_path_buf())
}

/// What `--model` pointed at.
pub(crate) enum ModelLocation {
    /// An MLX model directory.
    Dir(PathBuf),
    /// A packed store and the model directory it references.
    Store(Arc<PackedStore>, PathBuf),
}

impl ModelLocation {
    /// Detects a store (by its manifest) or a model directory.
    pub fn resolve(path: &Path) -> Result<Self> {
        if expert_store::is_store(path) {
            let store = PackedStore::open(path)?;
            let dir = store.model_dir();
            if !dir.join("config.json").is_file() {
                return Err(ModelError::Store(expert_store::StoreError::BadStore {
                    path: path.join(expert_store::MANIFEST_FILE),
                    message: format!(
                        "references model directory {} which has no config.json (moved or deleted?)",
                        dir.display()
                    ),
                }));
            }
            Ok(Self::Store(Arc::new(store), dir))
        } else {
            Ok(Self::Dir(path.to_path_buf()))
        }
    }

    /// The directory with config, tokenizer and non-expert weights.
    pub fn model_dir(&self) -> &Path {
        match self {
            Self::Dir(d) | Self::Store(_, d) => d,
        }
    }
}
