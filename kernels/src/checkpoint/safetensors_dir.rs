//! A Hugging Face checkpoint folder: `model.safetensors`, or the shards listed by
//! `model.safetensors.index.json`. Files are memory-mapped; every header is parsed and checked
//! against the file length once, at open (a truncated file is an error then, not a crash later).

use super::{LoadError, WeightSource};
use memmap2::Mmap;
use safetensors::{Dtype, SafeTensors};
use std::collections::HashMap;
use std::fs::File;
use std::path::{Path, PathBuf};

struct TensorEntry {
    shard: usize,
    dtype: Dtype,
    shape: Vec<usize>,
    /// Byte range in the shard's mapping.
    start: usize,
    end: usize,
}

/// The tensors of a checkpoint folder.
pub struct SafetensorsDir {
    dir: PathBuf,
    shards: Vec<(PathBuf, Mmap)>,
    tensors: HashMap<String, TensorEntry>,
}

impl SafetensorsDir {
    pub fn open(dir: &Path) -> Result<Self, LoadError> {
        let index_path = dir.join("model.safetensors.index.json");
        let files: Vec<String> = if index_path.exists() {
            let text = std::fs::read_to_string(&index_path)
                .map_err(|source| LoadError::Io { path: index_path.clone(), source })?;
            let index: serde_json::Value = serde_json::from_str(&text)
                .map_err(|e| LoadError::Parse { path: index_path.clone(), message: e.to_string() })?;
            let map = index
                .get("weight_map")
                .and_then(|m| m.as_object())
                .ok_or_else(|| LoadError::config(&index_path, "weight_map", "missing or not an object"))?;
            let mut files: Vec<String> = map.values().filter_map(|v| v.as_str().map(str::to_string)).collect();
            files.sort();
            files.dedup();
            files
        } else {
            vec!["model.safetensors".to_string()]
        };
        let mut shards = Vec::new();
        let mut tensors = HashMap::new();
        for (shard, name) in files.iter().enumerate() {
            let path = dir.join(name);
            let file = File::open(&path).map_err(|source| LoadError::Io { path: path.clone(), source })?;
            // SAFETY: the checkpoint is opened read-only and not modified while kvflow runs.
            let mmap = unsafe { Mmap::map(&file) }.map_err(|source| LoadError::Io { path: path.clone(), source })?;
            let (header_len, metadata) = SafeTensors::read_metadata(&mmap)
                .map_err(|e| LoadError::Safetensors { path: path.clone(), message: e.to_string() })?;
            let base = 8 + header_len;
            for (tname, info) in metadata.tensors() {
                tensors.insert(
                    tname,
                    TensorEntry {
                        shard,
                        dtype: info.dtype,
                        shape: info.shape.clone(),
                        start: base + info.data_offsets.0,
                        end: base + info.data_offsets.1,
                    },
                );
            }
            shards.push((path, mmap));
        }
        Ok(SafetensorsDir { dir: dir.to_path_buf(), shards, tensors })
    }

    /// Number of tensors in the checkpoint.
    pub fn len(&self) -> usize {
        self.tensors.len()
    }

    pub fn is_empty(&self) -> bool {
        self.tensors.is_empty()
    }
}

impl WeightSource for SafetensorsDir {
    fn tensor(&self, name: &str, shape: &[usize]) -> Result<Vec<f32>, LoadError> {
        let entry = self
            .tensors
            .get(name)
            .ok_or_else(|| LoadError::MissingTensor { path: self.dir.clone(), name: name.to_string() })?;
        let (path, mmap) = &self.shards[entry.shard];
        if entry.shape != shape {
            return Err(LoadError::WrongShape {
                path: path.clone(),
                name: name.to_string(),
                expected: shape.to_vec(),
                found: entry.shape.clone(),
            });
        }
        let bytes = &mmap[entry.start..entry.end];
        let values: Vec<f32> = match entry.dtype {
            Dtype::F32 => bytes.chunks_exact(4).map(|b| f32::from_le_bytes([b[0], b[1], b[2], b[3]])).collect(),
            Dtype::BF16 => bytes.chunks_exact(2).map(|b| half::bf16::from_le_bytes([b[0], b[1]]).to_f32()).collect(),
            Dtype::F16 => bytes.chunks_exact(2).map(|b| half::f16::from_le_bytes([b[0], b[1]]).to_f32()).collect(),
            other => {
                return Err(LoadError::WrongDtype {
                    path: path.clone(),
                    name: name.to_string(),
                    found: format!("{other:?}"),
                })
            }
        };
        debug_assert_eq!(values.len(), shape.iter().product::<usize>());
        Ok(values)
    }

    fn contains(&self, name: &str) -> bool {
        self.tensors.contains_key(name)
    }
}
