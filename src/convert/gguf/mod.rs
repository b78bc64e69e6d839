//! GGUF files: mlxb's own parser of the container (header, metadata, tensor infos) and the
//! importer that turns a llama.cpp checkpoint into an MLX-format model directory.
//!
//! The container format (v2/v3) is small and fully specified, so it is parsed here with every
//! length and offset checked against the file size: a truncated or corrupt file is one sentence
//! naming the file, never a crash inside a C reader. Tensor data is then read either by MLX's own
//! reader (`mlx_rs::io::GgufFile`, for files whose every tensor type MLX decodes) or by
//! [`quant`]'s decoders.

mod config;
pub mod import;
pub mod quant;
mod staging;
mod tensors;
pub mod vocab;

pub use import::{import_gguf, import_reporting, ImportOptions, ImportSummary, OutDtype};
pub use quant::GgmlType;

use crate::engine::error::{EngineError, Result};
use std::collections::BTreeMap;
use std::fs::File;
use std::io::{BufReader, Read, Seek, SeekFrom};
use std::path::{Path, PathBuf};

/// One metadata value.
#[derive(Debug, Clone, PartialEq)]
pub enum MetaValue {
    /// Any unsigned integer type (u8/u16/u32/u64).
    Uint(u64),
    /// Any signed integer type (i8/i16/i32/i64).
    Int(i64),
    /// f32 or f64 (f32 values are widened exactly).
    Float(f64),
    /// A boolean.
    Bool(bool),
    /// A UTF-8 string.
    Str(String),
    /// An array of values.
    Array(Vec<MetaValue>),
}

impl MetaValue {
    /// The value as an unsigned integer, if it is a non-negative integer.
    pub fn as_u64(&self) -> Option<u64> {
        match *self {
            MetaValue::Uint(v) => Some(v),
            MetaValue::Int(v) => u64::try_from(v).ok(),
            _ => None,
        }
    }

    /// The value as a float (integers convert).
    pub fn as_f64(&self) -> Option<f64> {
        match *self {
            MetaValue::Float(v) => Some(v),
            MetaValue::Uint(v) => Some(v as f64),
            MetaValue::Int(v) => Some(v as f64),
            _ => None,
        }
    }

    /// The value as a string.
    pub fn as_str(&self) -> Option<&str> {
        match self {
            MetaValue::Str(s) => Some(s),
            _ => None,
        }
    }

    /// The value as a boolean.
    pub fn as_bool(&self) -> Option<bool> {
        match *self {
            MetaValue::Bool(b) => Some(b),
            _ => None,
        }
    }

    /// The value as an array.
    pub fn as_array(&self) -> Option<&[MetaValue]> {
        match self {
            MetaValue::Array(a) => Some(a),
            _ => None,
        }
    }
}

/// Where one tensor lives in the file and what it holds.
#[derive(Debug, Clone)]
pub struct TensorInfo {
    /// Tensor name (llama.cpp's, e.g. `blk.0.attn_q.weight`).
    pub name: String,
    /// Dimensions in GGUF order: `dims[0]` is the contiguous (innermost) one.
    pub dims: Vec<u64>,
    /// Element encoding.
    pub ggml_type: GgmlType,
    /// Absolute byte offset of the data in the file.
    pub offset: u64,
    /// Byte length of the data.
    pub n_bytes: u64,
}

impl TensorInfo {
    /// Number of elements.
    pub fn n_elements(&self) -> u64 {
        self.dims.iter().product()
    }

    /// The shape MLX uses (row-major, outermost first): the GGUF dims reversed.
    pub fn mlx_shape(&self) -> Vec<i32> {
        self.dims.iter().rev().map(|&d| d as i32).collect()
    }

    /// Length of one row (the innermost dimension).
    pub fn row_len(&self) -> u64 {
        self.dims.first().copied().unwrap_or(1)
    }
}

/// A parsed GGUF file: metadata and tensor directory (the tensor data stays on disk).
#[derive(Debug)]
pub struct GgufHeader {
    /// The file.
    pub path: PathBuf,
    /// Format version (2 or 3).
    pub version: u32,
    /// Metadata key → value.
    pub metadata: BTreeMap<String, MetaValue>,
    /// Tensors in file order.
    pub tensors: Vec<TensorInfo>,
    /// File size in bytes.
    pub file_len: u64,
}

const MAGIC: &[u8; 4] = b"GGUF";
const MAX_DIMS: u32 = 4;
const MAX_NESTING: u32 = 4;

/// Reads the header with bounds checks against the file length.
struct HeaderReader<'a> {
    inner: BufReader<File>,
    pos: u64,
    len: u64,
    path: &'a Path,
}

impl HeaderReader<'_> {
    fn truncated(&self, what: &str) -> EngineError {
        EngineError::file(
            self.path,
            format!(
                "is truncated or corrupt: {what} at byte {} runs past the end of the file ({} bytes); re-download it",
                self.pos, self.len
            ),
        )
    }

    fn bytes(&mut self, n: u64, what: &str) -> Result<Vec<u8>> {
        if n > self.len.saturating_sub(self.pos) {
            return Err(self.truncated(what));
        }
        let mut buf = vec![0u8; n as usize];
        self.inner
            .read_exact(&mut buf)
            .map_err(|e| EngineError::file(self.path, format!("cannot be read ({e})")))?;
        self.pos += n;
        Ok(buf)
    }

    fn array<const N: usize>(&mut self, what: &str) -> Result<[u8; N]> {
        let v = self.bytes(N as u64, what)?;
        let mut a = [0u8; N];
        a.copy_from_slice(&v);
        Ok(a)
    }

    fn u32(&mut self, what: &str) -> Result<u32> {
        Ok(u32::from_le_bytes(self.array(what)?))
    }

    fn u64(&mut self, what: &str) -> Result<u64> {
        Ok(u64::from_le_bytes(self.array(what)?))
    }

    fn string(&mut self, what: &str) -> Result<String> {
        let n = self.u64(what)?;
        let raw = self.bytes(n, what)?;
        String::from_utf8(raw).map_err(|_| {
            EngineError::file(self.path, format!("is corrupt: {what} is not valid UTF-8"))
        })
    }

    fn value(&mut self, ty: u32, what: &str, depth: u32) -> Result<MetaValue> {
        Ok(match ty {
            0 => MetaValue::Uint(self.array::<1>(what)?[0] as u64),
            1 => MetaValue::Int(self.array::<1>(what)?[0] as i8 as i64),
            2 => MetaValue::Uint(u16::from_le_bytes(self.array(what)?) as u64),
            3 => MetaValue::Int(i16::from_le_bytes(self.array(what)?) as i64),
            4 => MetaValue::Uint(self.u32(what)? as u64),
            5 => MetaValue::Int(i32::from_le_bytes(self.array(what)?) as i64),
            6 => MetaValue::Float(f32::from_le_bytes(self.array(what)?) as f64),
            7 => MetaValue::Bool(self.array::<1>(what)?[0] != 0),
            8 => MetaValue::Str(self.string(what)?),
            9 => {
                if depth >= MAX_NESTING {
                    return Err(EngineError::file(
                        self.path,
                        format!("is corrupt: {what} nests arrays too deeply"),
                    ));
                }
                let elem = self.u32(what)?;
                let n = self.u64(what)?;
                // Every element takes at least one byte: a count beyond the rest of the file is
                // corruption, caught before allocating.
                if n > self.len.saturating_sub(self.pos) {
                    return Err(self.truncated(what));
                }
                let mut items = Vec::with_capacity(n as usize);
                for _ in 0..n {
                    items.push(self.value(elem, what, depth + 1)?);
                }
                MetaValue::Array(items)
            }
            10 => MetaValue::Uint(self.u64(what)?),
            11 => MetaValue::Int(i64::from_le_bytes(self.array(what)?)),
            12 => MetaValue::Float(f64::from_le_bytes(self.array(what)?)),
            other => {
                return Err(EngineError::file(
                    self.path,
                    format!("is corrupt: {what} has unknown value type {other}"),
                ))
            }
        })
    }
}

impl GgufHeader {
    /// Parses the header, metadata and tensor directory of `path`, checking that every tensor's
    /// data lies inside the file.
    pub fn open(path: &Path) -> Result<Self> {
        let file = File::open(path)
            .map_err(|e| EngineError::file(path, format!("cannot be opened ({e})")))?;
        let len = file
            .metadata()
            .map_err(|e| EngineError::file(path, format!("cannot be read ({e})")))?
            .len();
        let mut r = HeaderReader {
            inner: BufReader::with_capacity(1 << 20, file),
            pos: 0,
            len,
            path,
        };
        if len < 4 || &r.array::<4>("the magic number")? != MAGIC {
            return Err(EngineError::file(
                path,
                "is not a GGUF file (it does not start with the bytes \"GGUF\")",
            ));
        }
        let version = r.u32("the version")?;
        if version != 2 && version != 3 {
            return Err(EngineError::file(
                path,
                format!("has GGUF version {version}; mlxb reads versions 2 and 3 (re-convert it with a current llama.cpp)"),
            ));
        }
        let n_tensors = r.u64("the tensor count")?;
        let n_kv = r.u64("the metadata count")?;
        if n_tensors > len || n_kv > len {
            return Err(EngineError::file(
                path,
                format!("is corrupt: it claims {n_tensors} tensors and {n_kv} metadata entries"),
            ));
        }
        let mut metadata = BTreeMap::new();
        for i in 0..n_kv {
            let key = r.string(&format!("metadata key #{i}"))?;
            let ty = r.u32(&format!("the type of metadata `{key}`"))?;
            let value = r.value(ty, &format!("metadata `{key}`"), 0)?;
            metadata.insert(key, value);
        }
        let mut raw = Vec::with_capacity(n_tensors as usize);
        for i in 0..n_tensors {
            let name = r.string(&format!("tensor name #{i}"))?;
            let n_dims = r.u32(&format!("the rank of tensor `{name}`"))?;
            if n_dims == 0 || n_dims > MAX_DIMS {
                return Err(EngineError::file(
                    path,
                    format!("is corrupt: tensor `{name}` has rank {n_dims}"),
                ));
            }
            let mut dims = Vec::with_capacity(n_dims as usize);
            for _ in 0..n_dims {
                dims.push(r.u64(&format!("the shape of tensor `{name}`"))?);
            }
            let ty = r.u32(&format!("the type of tensor `{name}`"))?;
            let offset = r.u64(&format!("the offset of tensor `{name}`"))?;
            raw.push((name, dims, ty, offset));
        }
        let alignment = match metadata.get("general.alignment") {
            None => 32,
            Some(v) => match v.as_u64() {
                Some(a) if a > 0 && a.is_power_of_two() => a,
                _ => {
                    return Err(EngineError::file(
                        path,
                        "is corrupt: `general.alignment` is not a power of two",
                    ))
                }
            },
        };
        let data_start = r.pos.div_ceil(alignment) * alignment;
        let mut tensors = Vec::with_capacity(raw.len());
        for (name, dims, ty, offset) in raw {
            let ggml_type = GgmlType::from_id(ty).ok_or_else(|| {
                EngineError::file(
                    path,
                    format!("has tensor `{name}` of unknown type id {ty}; mlxb cannot import it"),
                )
            })?;
            let n_el = dims
                .iter()
                .try_fold(1u64, |acc, &d| acc.checked_mul(d))
                .filter(|&n| n > 0 && dims.iter().all(|&d| d <= i32::MAX as u64))
                .ok_or_else(|| {
                    EngineError::file(
                        path,
                        format!("is corrupt: tensor `{name}` has shape {dims:?}"),
                    )
                })?;
            let (block, block_bytes) = ggml_type.block();
            if dims[0] % block != 0 {
                return Err(EngineError::file(
                    path,
                    format!(
                        "is corrupt: tensor `{name}` has rows of {} elements, not a multiple of {}'s block of {block}",
                        dims[0],
                        ggml_type.name()
                    ),
                ));
            }
            // A byte count past 2^64 (elements within bounds, bytes not) is corrupt too.
            let n_bytes = (n_el / block).checked_mul(block_bytes).ok_or_else(|| {
                EngineError::file(
                    path,
                    format!("is corrupt: tensor `{name}` has shape {dims:?}"),
                )
            })?;
            let start = data_start.checked_add(offset);
            let end = start.and_then(|s| s.checked_add(n_bytes));
            match (start, end) {
                (Some(s), Some(e)) if e <= len => tensors.push(TensorInfo {
                    name,
                    dims,
                    ggml_type,
                    offset: s,
                    n_bytes,
                }),
                _ => {
                    return Err(EngineError::file(
                        path,
                        format!(
                            "is truncated: tensor `{name}` needs bytes up to {} but the file has {len}; re-download it",
                            end.map_or_else(|| "beyond 2^64".to_owned(), |e| e.to_string())
                        ),
                    ))
                }
            }
        }
        Ok(Self {
            path: path.to_path_buf(),
            version,
            metadata,
            tensors,
            file_len: len,
        })
    }

    /// A metadata value.
    pub fn get(&self, key: &str) -> Option<&MetaValue> {
        self.metadata.get(key)
    }

    /// A required string value.
    pub fn str(&self, key: &str) -> Result<&str> {
        self.get(key)
            .and_then(MetaValue::as_str)
            .ok_or_else(|| self.missing(key, "a string"))
    }

    /// A required non-negative integer.
    pub fn uint(&self, key: &str) -> Result<u64> {
        self.get(key)
            .and_then(MetaValue::as_u64)
            .ok_or_else(|| self.missing(key, "an integer"))
    }

    /// An optional non-negative integer (present but mistyped is an error).
    pub fn uint_opt(&self, key: &str) -> Result<Option<u64>> {
        self.get(key)
            .map(|v| v.as_u64().ok_or_else(|| self.missing(key, "an integer")))
            .transpose()
    }

    /// An optional float.
    pub fn float_opt(&self, key: &str) -> Result<Option<f64>> {
        self.get(key)
            .map(|v| v.as_f64().ok_or_else(|| self.missing(key, "a number")))
            .transpose()
    }

    /// An optional boolean.
    pub fn bool_opt(&self, key: &str) -> Result<Option<bool>> {
        self.get(key)
            .map(|v| v.as_bool().ok_or_else(|| self.missing(key, "a boolean")))
            .transpose()
    }

    /// A required array of strings.
    pub fn strings(&self, key: &str) -> Result<Vec<&str>> {
        let arr = self
            .get(key)
            .and_then(MetaValue::as_array)
            .ok_or_else(|| self.missing(key, "an array of strings"))?;
        arr.iter()
            .map(|v| {
                v.as_str()
                    .ok_or_else(|| self.missing(key, "an array of strings"))
            })
            .collect()
    }

    /// An error saying `key` is missing or has the wrong type.
    pub fn missing(&self, key: &str, expected: &str) -> EngineError {
        EngineError::file(
            &self.path,
            format!("metadata `{key}` is missing or is not {expected}; the GGUF is incomplete or not a language model"),
        )
    }

    /// Reads the raw bytes of one tensor.
    pub fn read_tensor(&self, t: &TensorInfo) -> Result<Vec<u8>> {
        let mut f = File::open(&self.path)
            .map_err(|e| EngineError::file(&self.path, format!("cannot be opened ({e})")))?;
        f.seek(SeekFrom::Start(t.offset))
            .and_then(|_| {
                let mut buf = vec![0u8; t.n_bytes as usize];
                f.read_exact(&mut buf).map(|_| buf)
            })
            .map_err(|e| {
                EngineError::file(
                    &self.path,
                    format!(
                        "cannot read tensor `{}` ({e}); the file changed or is damaged",
                        t.name
                    ),
                )
            })
    }
}
