//! A Hugging Face checkpoint folder: `model.safetensors`, or the shards listed by
//! `model.safetensors.index.json`. Files are memory-mapped; every header is parsed and checked
//! against the file's bytes once, at open ([`parse_safetensors_header`]: a truncated or
//! inconsistent file is an error then, not a crash later), and every tensor is checked for
//! non-finite values as it is converted to f32.

use super::{LoadError, WeightSource};
use memmap2::Mmap;
use safetensors::tensor::TensorInfo;
use safetensors::Dtype;
use serde_json::{Map, Value};
use std::collections::HashMap;
use std::fs::File;
use std::path::{Path, PathBuf};

/// The largest header read (the safetensors crate's own limit).
const MAX_HEADER_BYTES: u64 = 100_000_000;

/// One tensor of a safetensors file, as its header describes it and checked against the file.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct TensorHeader {
    pub name: String,
    pub dtype: Dtype,
    pub shape: Vec<usize>,
    /// Byte range of the data in the whole file (after the header); `start ≤ end ≤ file length`,
    /// and `end − start` is what `dtype` and `shape` need.
    pub start: usize,
    pub end: usize,
}

/// Parses and checks the header of one safetensors file's `bytes` (`path` names it in errors):
/// the 8-byte header length (bounded), a UTF-8 JSON object of tensors, each with a known dtype,
/// a shape whose byte size does not overflow and equals its data offsets, and offsets that tile
/// the data exactly (no gap, no overlap, nothing past the end). Any bytes give a result or an
/// error, never a panic. Tensors come sorted by offset.
pub fn parse_safetensors_header(path: &Path, bytes: &[u8]) -> Result<Vec<TensorHeader>, LoadError> {
    let bad = |message: String| LoadError::Safetensors { path: path.to_path_buf(), message };
    let len_bytes: [u8; 8] = match bytes.get(..8) {
        Some(b) => [b[0], b[1], b[2], b[3], b[4], b[5], b[6], b[7]],
        None => return Err(bad(format!("expected an 8-byte header length, found a {}-byte file", bytes.len()))),
    };
    let header_len = u64::from_le_bytes(len_bytes);
    if header_len > MAX_HEADER_BYTES {
        return Err(bad(format!("header length {header_len} is over the limit of {MAX_HEADER_BYTES} bytes")));
    }
    let data_start = 8 + header_len as usize;
    let header = bytes
        .get(8..data_start)
        .ok_or_else(|| bad(format!("header length {header_len} runs past the end of the {}-byte file", bytes.len())))?;
    let header = std::str::from_utf8(header).map_err(|e| bad(format!("header is not UTF-8: {e}")))?;
    let entries: Map<String, Value> =
        serde_json::from_str(header).map_err(|e| bad(format!("header is not a JSON object: {e}")))?;
    let data_len = bytes.len() - data_start;
    let mut tensors = Vec::with_capacity(entries.len());
    for (name, info) in entries {
        if name == "__metadata__" {
            continue;
        }
        let info: TensorInfo = serde_json::from_value(info).map_err(|e| bad(format!("tensor `{name}`: {e}")))?;
        let (s, e) = info.data_offsets;
        if s > e || e > data_len {
            return Err(bad(format!("tensor `{name}`: data offsets [{s}, {e}) are outside the {data_len} data bytes")));
        }
        let bits = info
            .shape
            .iter()
            .try_fold(1usize, |n, &d| n.checked_mul(d))
            .and_then(|n| n.checked_mul(info.dtype.bitsize()));
        let needed = bits.filter(|b| b % 8 == 0).map(|b| b / 8);
        if needed != Some(e - s) {
            let needs = needed.map_or("a size that does not fit in bytes".to_string(), |n| format!("{n} bytes"));
            return Err(bad(format!(
                "tensor `{name}`: dtype {:?} and shape {:?} need {needs}, its data offsets hold {}",
                info.dtype,
                info.shape,
                e - s
            )));
        }
        tensors.push(TensorHeader {
            name,
            dtype: info.dtype,
            shape: info.shape,
            start: data_start + s,
            end: data_start + e,
        });
    }
    tensors.sort_by_key(|t| (t.start, t.end));
    let mut covered = data_start;
    for t in &tensors {
        if t.start != covered {
            let what = if t.start < covered {
                "overlaps the tensor before it"
            } else {
                "leaves a gap after the tensor before it"
            };
            return Err(bad(format!("tensor `{}` at bytes [{}, {}) {what}", t.name, t.start, t.end)));
        }
        covered = t.end;
    }
    if covered != bytes.len() {
        return Err(bad(format!("the tensors cover {} of the {data_len} data bytes", covered - data_start)));
    }
    Ok(tensors)
}

/// A checked tensor and the shard that holds it.
struct TensorEntry {
    shard: usize,
    header: TensorHeader,
}

/// The tensors of a checkpoint folder.
pub struct SafetensorsDir {
    dir: PathBuf,
    shards: Vec<(PathBuf, Mmap)>,
    tensors: HashMap<String, TensorEntry>,
}

impl SafetensorsDir {
    pub fn open(dir: &Path) -> Result<Self, LoadError> {
        let files = shard_names(dir)?;
        let mut shards = Vec::new();
        let mut tensors: HashMap<String, TensorEntry> = HashMap::new();
        for (shard, name) in files.iter().enumerate() {
            let path = dir.join(name);
            let file = File::open(&path).map_err(|source| LoadError::Io { path: path.clone(), source })?;
            // SAFETY: the checkpoint is opened read-only and not modified while kvflow runs.
            let mmap = unsafe { Mmap::map(&file) }.map_err(|source| LoadError::Io { path: path.clone(), source })?;
            for header in parse_safetensors_header(&path, &mmap)? {
                if let Some(other) = tensors.get(&header.name) {
                    return Err(LoadError::Safetensors {
                        path: path.clone(),
                        message: format!("tensor `{}` is also in {}", header.name, files[other.shard]),
                    });
                }
                tensors.insert(header.name.clone(), TensorEntry { shard, header });
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

/// The safetensors files of `dir`: the shards its index lists (plain file names in `dir`), or
/// `model.safetensors`.
fn shard_names(dir: &Path) -> Result<Vec<String>, LoadError> {
    let index_path = dir.join("model.safetensors.index.json");
    if !index_path.exists() {
        return Ok(vec!["model.safetensors".to_string()]);
    }
    let text =
        std::fs::read_to_string(&index_path).map_err(|source| LoadError::Io { path: index_path.clone(), source })?;
    let index: Value = serde_json::from_str(&text)
        .map_err(|e| LoadError::Parse { path: index_path.clone(), message: e.to_string() })?;
    let map = index
        .get("weight_map")
        .and_then(|m| m.as_object())
        .ok_or_else(|| LoadError::config(&index_path, "weight_map", "missing or not an object"))?;
    let mut files = Vec::new();
    for (tensor, file) in map {
        let field = format!("weight_map.{tensor}");
        let file = file.as_str().ok_or_else(|| LoadError::config(&index_path, &field, "expected a file name"))?;
        if Path::new(file).file_name().and_then(|f| f.to_str()) != Some(file) {
            return Err(LoadError::config(
                &index_path,
                &field,
                format!("expected a file name in the folder, found {file:?}"),
            ));
        }
        files.push(file.to_string());
    }
    files.sort();
    files.dedup();
    Ok(files)
}

/// Little-endian values of `N` bytes each, converted by `to_f32`, and whether all are finite
/// (one pass).
fn decode<const N: usize>(bytes: &[u8], to_f32: impl Fn(&[u8]) -> f32) -> (Vec<f32>, bool) {
    let mut finite = true;
    let values = bytes
        .chunks_exact(N)
        .map(|b| {
            let v = to_f32(b);
            finite &= v.is_finite();
            v
        })
        .collect();
    (values, finite)
}

impl WeightSource for SafetensorsDir {
    fn tensor(&self, name: &str, shape: &[usize]) -> Result<Vec<f32>, LoadError> {
        let entry = self
            .tensors
            .get(name)
            .ok_or_else(|| LoadError::MissingTensor { path: self.dir.clone(), name: name.to_string() })?;
        let (path, mmap) = &self.shards[entry.shard];
        let header = &entry.header;
        if header.shape != shape {
            return Err(LoadError::WrongShape {
                path: path.clone(),
                name: name.to_string(),
                expected: shape.to_vec(),
                found: header.shape.clone(),
            });
        }
        let bytes = &mmap[header.start..header.end];
        let (values, finite) = match header.dtype {
            Dtype::F32 => decode::<4>(bytes, |b| f32::from_le_bytes([b[0], b[1], b[2], b[3]])),
            Dtype::BF16 => decode::<2>(bytes, |b| half::bf16::from_le_bytes([b[0], b[1]]).to_f32()),
            Dtype::F16 => decode::<2>(bytes, |b| half::f16::from_le_bytes([b[0], b[1]]).to_f32()),
            other => {
                return Err(LoadError::WrongDtype {
                    path: path.clone(),
                    name: name.to_string(),
                    found: format!("{other:?}"),
                })
            }
        };
        if !finite {
            let index = values.iter().position(|v| !v.is_finite()).unwrap_or(0);
            let value = values.get(index).copied().unwrap_or(f32::NAN);
            return Err(LoadError::NonFinite { path: path.clone(), name: name.to_string(), index, value });
        }
        debug_assert_eq!(values.len(), shape.iter().product::<usize>());
        Ok(values)
    }

    fn contains(&self, name: &str) -> bool {
        self.tensors.contains_key(name)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A file of `header` (JSON) followed by `data` bytes.
    fn file(header: &str, data: usize) -> Vec<u8> {
        let mut bytes = (header.len() as u64).to_le_bytes().to_vec();
        bytes.extend_from_slice(header.as_bytes());
        bytes.resize(bytes.len() + data, 0);
        bytes
    }

    fn error(bytes: &[u8]) -> String {
        parse_safetensors_header(Path::new("m.safetensors"), bytes).unwrap_err().to_string()
    }

    const TWO: &str = r#"{"a": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]},
        "b": {"dtype": "BF16", "shape": [2, 2], "data_offsets": [8, 16]}, "__metadata__": {"format": "pt"}}"#;

    #[test]
    fn a_consistent_header_gives_each_tensor_its_byte_range() {
        let bytes = file(TWO, 16);
        let tensors = parse_safetensors_header(Path::new("m.safetensors"), &bytes).unwrap();
        let base = 8 + TWO.len();
        assert_eq!(
            tensors.iter().map(|t| (t.name.as_str(), t.start - base, t.end - base)).collect::<Vec<_>>(),
            vec![("a", 0, 8), ("b", 8, 16)]
        );
    }

    #[test]
    fn header_problems_are_errors_naming_the_file() {
        let huge_len = u64::MAX.to_le_bytes();
        let cases: Vec<(Vec<u8>, &str)> = vec![
            (vec![1, 2, 3], "8-byte header length"),
            (huge_len.to_vec(), "over the limit"),
            (file(TWO, 16)[..30].to_vec(), "runs past the end"),
            (file(TWO, 12), "outside the 12 data bytes"),
            (file(TWO, 20), "cover 16 of the 20"),
            (file(&TWO.replace("[8, 16]", "[4, 12]"), 16), "overlaps"),
            (file(&TWO.replace("[0, 8]", "[0, 4]"), 16), "need 8 bytes"),
            (file(&TWO.replace("[2, 2]", "[18446744073709551615, 4]"), 16), "does not fit"),
            (file(&TWO.replace("BF16", "Q9"), 16), "tensor `b`"),
            (file("[1, 2]", 0), "not a JSON object"),
        ];
        for (bytes, expected) in cases {
            let e = error(&bytes);
            assert!(e.contains("m.safetensors") && e.contains(expected), "{expected}: {e}");
        }
    }

    #[test]
    fn random_damage_to_a_file_never_panics() {
        let original = file(TWO, 16);
        let mut state = 7u64;
        for _ in 0..5000 {
            let mut bytes = original.clone();
            for _ in 0..3 {
                state = state.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
                let at = (state >> 33) as usize % bytes.len();
                match (state >> 20) % 3 {
                    0 => bytes[at] ^= 1 << ((state >> 8) % 8),
                    1 => bytes.truncate(at.max(1)),
                    _ => bytes[at] = b"0123456789[],\""[(state >> 12) as usize % 14],
                }
            }
            let _ = parse_safetensors_header(Path::new("m.safetensors"), &bytes);
        }
    }
}
