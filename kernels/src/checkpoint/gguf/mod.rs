//! GGUF checkpoints (llama.cpp's one-file format, version 2 and 3): a header of typed metadata
//! (the model's config, its tokenizer, its chat template) and a table of tensors, then their
//! data. The file is memory-mapped; the header and every tensor's extent are checked against the
//! file's bytes at open ([`GgufFile::parse`]: any bytes give a result or an error naming the
//! file and what was wrong, never a panic), and each tensor is dequantized to f32 when asked for
//! (`quants`). A llama-architecture file serves as a [`WeightSource`] under the Hugging Face
//! names the llama family reads (`llama`), its config built from the metadata.

mod llama;
mod quants;
#[cfg(test)]
mod tests;

pub use llama::{gguf_config, GgufWeights};
pub use quants::GgmlType;

use super::LoadError;
use memmap2::Mmap;
use std::collections::{BTreeMap, HashMap};
use std::path::{Path, PathBuf};

const MAGIC: &[u8; 4] = b"GGUF";
/// The most tensors, metadata entries, array items or dimensions a header may declare: a real
/// model has a few thousand tensors and one array of each token (a few hundred thousand).
const MAX_COUNT: u64 = 1 << 24;
const MAX_DIMS: u32 = 4;

/// A metadata value.
#[derive(Clone, Debug, PartialEq)]
pub enum GgufValue {
    Uint(u64),
    Int(i64),
    Float(f64),
    Bool(bool),
    String(String),
    Array(Vec<GgufValue>),
}

impl GgufValue {
    pub fn as_u64(&self) -> Option<u64> {
        match *self {
            GgufValue::Uint(v) => Some(v),
            GgufValue::Int(v) => u64::try_from(v).ok(),
            _ => None,
        }
    }

    pub fn as_f64(&self) -> Option<f64> {
        match *self {
            GgufValue::Float(v) => Some(v),
            GgufValue::Uint(v) => Some(v as f64),
            GgufValue::Int(v) => Some(v as f64),
            _ => None,
        }
    }

    pub fn as_str(&self) -> Option<&str> {
        match self {
            GgufValue::String(s) => Some(s),
            _ => None,
        }
    }

    pub fn as_bool(&self) -> Option<bool> {
        match *self {
            GgufValue::Bool(b) => Some(b),
            _ => None,
        }
    }

    pub fn as_array(&self) -> Option<&[GgufValue]> {
        match self {
            GgufValue::Array(a) => Some(a),
            _ => None,
        }
    }

    /// What the value is, for errors.
    pub fn kind(&self) -> &'static str {
        match self {
            GgufValue::Uint(_) => "an unsigned integer",
            GgufValue::Int(_) => "an integer",
            GgufValue::Float(_) => "a float",
            GgufValue::Bool(_) => "a bool",
            GgufValue::String(_) => "a string",
            GgufValue::Array(_) => "an array",
        }
    }
}

/// One tensor of the file, checked against its bytes.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct GgufTensor {
    /// GGUF order: `dims[0]` varies fastest (a Hugging Face `[out, in]` weight is `[in, out]`).
    pub dims: Vec<usize>,
    pub kind: GgmlType,
    /// Byte range of its data in the file.
    pub start: usize,
    pub end: usize,
}

impl GgufTensor {
    /// The shape in Hugging Face order (slowest-varying first).
    pub fn shape(&self) -> Vec<usize> {
        self.dims.iter().rev().copied().collect()
    }
}

/// A GGUF file: its metadata and tensors, and its bytes.
pub struct GgufFile {
    pub path: PathBuf,
    pub version: u32,
    pub metadata: BTreeMap<String, GgufValue>,
    pub tensors: HashMap<String, GgufTensor>,
    bytes: Mmap,
}

impl GgufFile {
    /// Opens and checks `path`.
    pub fn open(path: &Path) -> Result<GgufFile, LoadError> {
        let io = |source| LoadError::Io { path: path.to_path_buf(), source };
        let file = std::fs::File::open(path).map_err(io)?;
        // SAFETY: read-only mapping of a checkpoint nothing in this process writes; its header
        // and extents are checked against the mapped length before any tensor is read.
        let bytes = unsafe { Mmap::map(&file) }.map_err(io)?;
        let (version, metadata, tensors) = Self::parse(path, &bytes)?;
        Ok(GgufFile { path: path.to_path_buf(), version, metadata, tensors, bytes })
    }

    /// Parses and checks the header of a GGUF file's `bytes`.
    #[allow(clippy::type_complexity)]
    pub fn parse(
        path: &Path,
        bytes: &[u8],
    ) -> Result<(u32, BTreeMap<String, GgufValue>, HashMap<String, GgufTensor>), LoadError> {
        let mut r = Reader { bytes, at: 0, path };
        let magic = r.take(4, "the magic")?.to_vec();
        if magic != MAGIC {
            return Err(r.bad(format!("expected the magic \"GGUF\" at byte 0, found {magic:?}: not a GGUF file")));
        }
        let version = r.u32("the version")?;
        if !(2..=3).contains(&version) {
            return Err(r.bad(format!("GGUF version {version}; kvflow reads versions 2 and 3")));
        }
        let tensor_count = r.count("the tensor count")?;
        let kv_count = r.count("the metadata count")?;
        let mut metadata = BTreeMap::new();
        for i in 0..kv_count {
            let key = r.string(&format!("metadata entry {i}'s key"))?;
            let kind = r.u32(&format!("metadata `{key}`'s type"))?;
            let value = r.value(kind, &key, 0)?;
            if metadata.insert(key.clone(), value).is_some() {
                return Err(r.bad(format!("metadata `{key}` appears twice")));
            }
        }
        let alignment = match metadata.get("general.alignment") {
            None => 32,
            Some(v) => match v.as_u64() {
                Some(a) if a > 0 && a.is_power_of_two() && a <= 1 << 16 => a as usize,
                _ => return Err(r.bad(format!("metadata `general.alignment`: expected a power of two, found {v:?}"))),
            },
        };
        let mut table = Vec::with_capacity(tensor_count as usize);
        for i in 0..tensor_count {
            let name = r.string(&format!("tensor {i}'s name"))?;
            let n_dims = r.u32(&format!("tensor `{name}`'s dimension count"))?;
            if n_dims == 0 || n_dims > MAX_DIMS {
                return Err(r.bad(format!("tensor `{name}`: {n_dims} dimensions (expected 1 to {MAX_DIMS})")));
            }
            let mut dims = Vec::with_capacity(n_dims as usize);
            for d in 0..n_dims {
                let n = r.u64(&format!("tensor `{name}`'s dimension {d}"))?;
                if n == 0 || n > 1 << 32 {
                    return Err(r.bad(format!("tensor `{name}`: dimension {d} is {n} (expected 1 to 2^32)")));
                }
                dims.push(n as usize);
            }
            let kind = r.u32(&format!("tensor `{name}`'s type"))?;
            let kind = GgmlType::from_id(kind).ok_or_else(|| {
                r.bad(format!(
                    "tensor `{name}`: ggml type {kind} is not one kvflow dequantizes (it reads {})",
                    GgmlType::NAMES
                ))
            })?;
            let offset = r.u64(&format!("tensor `{name}`'s offset"))?;
            table.push((name, dims, kind, offset));
        }
        let data_start = r.at.div_ceil(alignment) * alignment;
        let mut tensors = HashMap::with_capacity(table.len());
        for (name, dims, kind, offset) in table {
            let size = kind.bytes_for(&dims).ok_or_else(|| {
                r.bad(format!(
                    "tensor `{name}`: {} shape {dims:?} does not split into its {}-element blocks",
                    kind.name(),
                    kind.block_elements()
                ))
            })?;
            let start = usize::try_from(offset).ok().and_then(|o| o.checked_add(data_start));
            let end = start.and_then(|s| s.checked_add(size));
            let (Some(start), Some(end)) = (start, end) else {
                return Err(r.bad(format!("tensor `{name}`: offset {offset} overflows")));
            };
            if !(offset as usize).is_multiple_of(alignment) || end > bytes.len() {
                return Err(r.bad(format!(
                    "tensor `{name}`: its {size} bytes at offset {offset} (aligned to {alignment}) are not inside \
                     the {}-byte file's data",
                    bytes.len()
                )));
            }
            if tensors.insert(name.clone(), GgufTensor { dims, kind, start, end }).is_some() {
                return Err(r.bad(format!("tensor `{name}` appears twice")));
            }
        }
        Ok((version, metadata, tensors))
    }

    /// Tensor `name` as f32, in Hugging Face order.
    pub fn dequantize(&self, name: &str) -> Result<Vec<f32>, LoadError> {
        let t = self
            .tensors
            .get(name)
            .ok_or_else(|| LoadError::MissingTensor { path: self.path.clone(), name: name.to_string() })?;
        let values = t.kind.dequantize(&self.bytes[t.start..t.end]);
        if let Some((index, value)) = values.iter().enumerate().find(|(_, v)| !v.is_finite()) {
            return Err(LoadError::NonFinite { path: self.path.clone(), name: name.to_string(), index, value: *value });
        }
        Ok(values)
    }

    /// Metadata `key`, if present.
    pub fn get(&self, key: &str) -> Option<&GgufValue> {
        self.metadata.get(key)
    }

    /// An error naming the file and metadata `key`.
    pub fn field_error(&self, key: &str, message: impl Into<String>) -> LoadError {
        LoadError::config(&self.path, key, message)
    }

    /// Metadata `key` as an unsigned integer: absent, or of another kind, is an error naming it.
    pub fn uint(&self, key: &str) -> Result<u64, LoadError> {
        match self.get(key) {
            None => Err(self.field_error(key, "missing from the GGUF metadata")),
            Some(v) => {
                v.as_u64().ok_or_else(|| self.field_error(key, format!("expected an integer, found {}", v.kind())))
            }
        }
    }

    /// Metadata `key` as a string array (a tokenizer's tokens, merges).
    pub fn strings(&self, key: &str) -> Result<Vec<&str>, LoadError> {
        let v = self.get(key).ok_or_else(|| self.field_error(key, "missing from the GGUF metadata"))?;
        let items =
            v.as_array().ok_or_else(|| self.field_error(key, format!("expected an array, found {}", v.kind())))?;
        items
            .iter()
            .enumerate()
            .map(|(i, s)| {
                s.as_str().ok_or_else(|| self.field_error(key, format!("item {i} is {}, not a string", s.kind())))
            })
            .collect()
    }
}

/// Reads the header, every read bounded by the bytes left.
struct Reader<'a> {
    bytes: &'a [u8],
    at: usize,
    path: &'a Path,
}

impl<'a> Reader<'a> {
    fn bad(&self, message: String) -> LoadError {
        LoadError::Gguf { path: self.path.to_path_buf(), message }
    }

    fn take(&mut self, n: usize, what: &str) -> Result<&'a [u8], LoadError> {
        let end = self.at.checked_add(n).filter(|&e| e <= self.bytes.len());
        let Some(end) = end else {
            return Err(self.bad(format!(
                "{what} ({n} bytes at byte {}) runs past the end of the {}-byte file",
                self.at,
                self.bytes.len()
            )));
        };
        let got = &self.bytes[self.at..end];
        self.at = end;
        Ok(got)
    }

    fn array<const N: usize>(&mut self, what: &str) -> Result<[u8; N], LoadError> {
        let b = self.take(N, what)?;
        let mut out = [0; N];
        out.copy_from_slice(b);
        Ok(out)
    }

    fn u32(&mut self, what: &str) -> Result<u32, LoadError> {
        Ok(u32::from_le_bytes(self.array(what)?))
    }

    fn u64(&mut self, what: &str) -> Result<u64, LoadError> {
        Ok(u64::from_le_bytes(self.array(what)?))
    }

    /// A count, bounded by [`MAX_COUNT`] and by the bytes left (each item takes at least one).
    fn count(&mut self, what: &str) -> Result<u64, LoadError> {
        let n = self.u64(what)?;
        let left = (self.bytes.len() - self.at) as u64;
        if n > MAX_COUNT || n > left {
            return Err(self.bad(format!("{what} is {n}, more than the {left} bytes left could hold")));
        }
        Ok(n)
    }

    fn string(&mut self, what: &str) -> Result<String, LoadError> {
        let len = self.u64(what)?;
        let len = usize::try_from(len).map_err(|_| self.bad(format!("{what}: length {len} overflows")))?;
        let at = self.at;
        let raw = self.take(len, what)?;
        String::from_utf8(raw.to_vec()).map_err(|e| self.bad(format!("{what} at byte {at} is not UTF-8: {e}")))
    }

    fn value(&mut self, kind: u32, key: &str, depth: u32) -> Result<GgufValue, LoadError> {
        let what = format!("metadata `{key}`");
        Ok(match kind {
            0 => GgufValue::Uint(u64::from(self.array::<1>(&what)?[0])),
            1 => GgufValue::Int(i64::from(self.array::<1>(&what)?[0] as i8)),
            2 => GgufValue::Uint(u64::from(u16::from_le_bytes(self.array(&what)?))),
            3 => GgufValue::Int(i64::from(i16::from_le_bytes(self.array(&what)?))),
            4 => GgufValue::Uint(u64::from(self.u32(&what)?)),
            5 => GgufValue::Int(i64::from(i32::from_le_bytes(self.array(&what)?))),
            6 => GgufValue::Float(f64::from(f32::from_le_bytes(self.array(&what)?))),
            7 => match self.array::<1>(&what)?[0] {
                0 => GgufValue::Bool(false),
                1 => GgufValue::Bool(true),
                b => return Err(self.bad(format!("{what}: a bool of value {b}"))),
            },
            8 => GgufValue::String(self.string(&what)?),
            9 => {
                if depth > 0 {
                    return Err(self.bad(format!("{what}: an array of arrays (kvflow reads one level)")));
                }
                let item = self.u32(&what)?;
                let n = self.count(&what)?;
                let mut items = Vec::with_capacity(n as usize);
                for _ in 0..n {
                    items.push(self.value(item, key, depth + 1)?);
                }
                GgufValue::Array(items)
            }
            10 => GgufValue::Uint(self.u64(&what)?),
            11 => GgufValue::Int(i64::from_le_bytes(self.array(&what)?)),
            12 => GgufValue::Float(f64::from_le_bytes(self.array(&what)?)),
            other => return Err(self.bad(format!("{what}: unknown value type {other}"))),
        })
    }
}
