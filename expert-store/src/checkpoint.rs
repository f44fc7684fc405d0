//! A safetensors checkpoint (one file or shards with an index), memory-mapped, indexed by tensor name.

use std::collections::{BTreeMap, HashMap};
use std::path::{Path, PathBuf};
use std::sync::Arc;

use safetensors::SafeTensors;

pub use safetensors::Dtype;

use crate::{mmap, OwnedBytes, StoreError};

/// Where one tensor lives and what it holds.
#[derive(Debug, Clone)]
pub struct TensorInfo {
    /// Element type as stored.
    pub dtype: Dtype,
    /// Shape as stored.
    pub shape: Vec<usize>,
    /// The file holding it.
    pub file: PathBuf,
    /// Byte offset of the tensor's data in `file`.
    pub offset: u64,
    bytes: OwnedBytes,
}

impl TensorInfo {
    /// The tensor's bytes, zero-copy.
    pub fn bytes(&self) -> &OwnedBytes {
        &self.bytes
    }
}

/// All tensors of a model directory's safetensors files.
#[derive(Debug)]
pub struct Checkpoint {
    dir: PathBuf,
    tensors: HashMap<String, TensorInfo>,
}

#[derive(serde::Deserialize)]
struct ShardIndex {
    weight_map: BTreeMap<String, String>,
}

impl Checkpoint {
    /// Opens `model.safetensors.index.json` + its shards if present, else every `*.safetensors` in `dir`.
    pub fn open(dir: &Path) -> Result<Self, StoreError> {
        let index_path = dir.join("model.safetensors.index.json");
        let files: Vec<PathBuf> = if index_path.exists() {
            let text = std::fs::read_to_string(&index_path).map_err(|source| StoreError::Io {
                path: index_path.clone(),
                source,
            })?;
            let index: ShardIndex = serde_json::from_str(&text).map_err(|e| StoreError::BadFile {
                path: index_path.clone(),
                message: e.to_string(),
            })?;
            let mut names: Vec<&String> = index.weight_map.values().collect();
            names.sort();
            names.dedup();
            names.into_iter().map(|n| dir.join(n)).collect()
        } else {
            let rd = std::fs::read_dir(dir).map_err(|source| StoreError::Io {
                path: dir.to_path_buf(),
                source,
            })?;
            let mut v: Vec<PathBuf> = rd
                .filter_map(|e| e.ok().map(|e| e.path()))
                .filter(|p| p.extension().is_some_and(|x| x == "safetensors"))
                .collect();
            v.sort();
            v
        };
        if files.is_empty() {
            return Err(StoreError::NoWeights(dir.to_path_buf()));
        }
        let mut tensors = HashMap::new();
        for file in files {
            Self::index_file(&file, &mut tensors)?;
        }
        Ok(Self {
            dir: dir.to_path_buf(),
            tensors,
        })
    }

    fn index_file(path: &Path, out: &mut HashMap<String, TensorInfo>) -> Result<(), StoreError> {
        let map = mmap::map_file(path)?;
        let bad = |message: String| StoreError::BadFile {
            path: path.to_path_buf(),
            message,
        };
        // Validates the header, the offsets and that the file is exactly as long as the header says.
        let (header_len, meta) =
            SafeTensors::read_metadata(&map).map_err(|e| bad(format!("not a valid safetensors file: {e:?}")))?;
        let data_start = 8 + header_len;
        let whole = OwnedBytes::new(Arc::new(map));
        for (name, info) in meta.tensors() {
            let (a, b) = info.data_offsets;
            let bytes = whole
                .slice(data_start + a..data_start + b)
                .ok_or_else(|| bad(format!("tensor `{name}` lies outside the file")))?;
            let t = TensorInfo {
                dtype: info.dtype,
                shape: info.shape.clone(),
                file: path.to_path_buf(),
                offset: (data_start + a) as u64,
                bytes,
            };
            if let Some(prev) = out.insert(name.clone(), t) {
                return Err(bad(format!("tensor `{name}` also appears in {}", prev.file.display())));
            }
        }
        Ok(())
    }

    /// The model directory.
    pub fn dir(&self) -> &Path {
        &self.dir
    }

    /// A tensor by exact name.
    pub fn get(&self, name: &str) -> Option<&TensorInfo> {
        self.tensors.get(name)
    }

    /// A tensor by exact name, or a `MissingTensor` error.
    pub fn require(&self, name: &str) -> Result<&TensorInfo, StoreError> {
        self.get(name)
            .ok_or_else(|| StoreError::MissingTensor(name.to_string()))
    }

    /// Every tensor name (unordered).
    pub fn names(&self) -> impl Iterator<Item = &str> {
        self.tensors.keys().map(String::as_str)
    }

    /// Total bytes of tensor data.
    pub fn total_bytes(&self) -> usize {
        self.tensors.values().map(|t| t.bytes.len()).sum()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn write_st(path: &Path, tensors: &[(&str, &str, Vec<usize>, usize)]) {
        let mut header = serde_json::Map::new();
        let mut off = 0;
        for (name, dtype, shape, nbytes) in tensors {
            header.insert(
                name.to_string(),
                serde_json::json!({"dtype": dtype, "shape": shape, "data_offsets": [off, off + nbytes]}),
            );
            off += nbytes;
        }
        let h = serde_json::Value::Object(header).to_string();
        let mut buf = (h.len() as u64).to_le_bytes().to_vec();
        buf.extend_from_slice(h.as_bytes());
        buf.extend((0..off).map(|i| i as u8));
        std::fs::write(path, buf).unwrap();
    }

    #[test]
    fn opens_single_file_and_shards() {
        let d = tempfile::tempdir().unwrap();
        write_st(
            &d.path().join("a.safetensors"),
            &[("x", "F32", vec![2], 8), ("y", "U8", vec![3], 3)],
        );
        let c = Checkpoint::open(d.path()).unwrap();
        assert_eq!(&**c.require("y").unwrap().bytes(), &[8, 9, 10]);
        assert!(matches!(c.require("z"), Err(StoreError::MissingTensor(n)) if n == "z"));

        write_st(&d.path().join("b.safetensors"), &[("z", "BF16", vec![1], 2)]);
        std::fs::write(
            d.path().join("model.safetensors.index.json"),
            r#"{"metadata":{},"weight_map":{"x":"a.safetensors","z":"b.safetensors"}}"#,
        )
        .unwrap();
        let c = Checkpoint::open(d.path()).unwrap();
        assert_eq!(c.require("z").unwrap().dtype, Dtype::BF16);
    }

    #[test]
    fn truncated_or_garbled_file_is_a_named_error() {
        let d = tempfile::tempdir().unwrap();
        let p = d.path().join("m.safetensors");
        write_st(&p, &[("x", "F32", vec![4], 16)]);
        let full = std::fs::read(&p).unwrap();
        std::fs::write(&p, &full[..full.len() - 3]).unwrap();
        let e = Checkpoint::open(d.path()).unwrap_err().to_string();
        assert!(
            e.contains("m.safetensors") && e.contains("not a valid safetensors"),
            "{e}"
        );
        std::fs::write(&p, b"garbage").unwrap();
        assert!(Checkpoint::open(d.path()).is_err());
        std::fs::remove_file(&p).unwrap();
        assert!(matches!(Checkpoint::open(d.path()), Err(StoreError::NoWeights(_))));
    }

    #[test]
    fn duplicate_tensor_across_shards_is_rejected() {
        let d = tempfile::tempdir().unwrap();
        write_st(&d.path().join("a.safetensors"), &[("x", "F32", vec![1], 4)]);
        write_st(&d.path().join("b.safetensors"), &[("x", "F32", vec![1], 4)]);
        let e = Checkpoint::open(d.path()).unwrap_err().to_string();
        assert!(e.contains("also appears"), "{e}");
    }
}
