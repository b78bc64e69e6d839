//! Parsing and checking safetensors headers, and the file-level helpers around them.

use crate::engine::error::{EngineError, Result};
use mlx_rs::Dtype;
use std::fs::File;
use std::io::Read;
use std::path::{Path, PathBuf};

/// One tensor of a safetensors header.
#[derive(Debug, Clone)]
pub struct TensorEntry {
    /// Tensor name.
    pub name: String,
    /// The header's dtype string (`F32`, `BF16`, `U32`, ...).
    pub dtype: String,
    /// Shape as written in the header.
    pub shape: Vec<u64>,
    /// Byte range inside the data section.
    pub start: u64,
    /// End of the byte range (exclusive).
    pub end: u64,
}

/// A parsed, checked safetensors header.
#[derive(Debug, Clone)]
pub struct Header {
    /// File offset where the data section starts (8 + header length).
    pub data_start: u64,
    /// Bytes in the data section.
    pub data_len: u64,
    /// Tensors, in data order.
    pub tensors: Vec<TensorEntry>,
}

/// The MLX dtype (and its size in bytes) that MLX's own safetensors loader gives a header
/// dtype string, or `None` for one MLX rejects (the set mirrors MLX 0.32: `F8_E4M3` loads as
/// raw bytes, `F64` fails).
pub fn mlx_dtype(name: &str) -> Option<(Dtype, u64)> {
    Some(match name {
        "BOOL" => (Dtype::Bool, 1),
        "U8" | "F8_E4M3" => (Dtype::Uint8, 1),
        "U16" => (Dtype::Uint16, 2),
        "U32" => (Dtype::Uint32, 4),
        "U64" => (Dtype::Uint64, 8),
        "I8" => (Dtype::Int8, 1),
        "I16" => (Dtype::Int16, 2),
        "I32" => (Dtype::Int32, 4),
        "I64" => (Dtype::Int64, 8),
        "F16" => (Dtype::Float16, 2),
        "BF16" => (Dtype::Bfloat16, 2),
        "F32" => (Dtype::Float32, 4),
        "C64" => (Dtype::Complex64, 8),
        _ => return None,
    })
}

/// Reads and checks the header of `path`: JSON well-formed, every tensor's dtype known to
/// MLX, its byte range inside the file and as long as its shape and dtype need.
pub fn read_header(path: &Path) -> Result<Header> {
    let bad = |why: &str| EngineError::file(path, format!("corrupt safetensors file: {why}"));
    let mut f =
        File::open(path).map_err(|e| EngineError::file(path, format!("cannot open ({e})")))?;
    let len = f.metadata().map(|m| m.len()).unwrap_or(0);
    let mut n = [0u8; 8];
    f.read_exact(&mut n)
        .map_err(|_| bad("shorter than its 8-byte header length"))?;
    let n = u64::from_le_bytes(n);
    if n > 100_000_000 || 8 + n > len {
        return Err(bad("header length points past the end of the file"));
    }
    let mut raw = vec![0u8; n as usize];
    f.read_exact(&mut raw)
        .map_err(|_| bad("header is truncated"))?;
    let json: serde_json::Value =
        serde_json::from_slice(&raw).map_err(|_| bad("header is not valid JSON"))?;
    let obj = json
        .as_object()
        .ok_or_else(|| bad("header is not a JSON object"))?;
    let data_len = len - 8 - n;
    let mut tensors = Vec::with_capacity(obj.len());
    for (name, info) in obj {
        if name == "__metadata__" {
            continue;
        }
        let offsets = info
            .get("data_offsets")
            .and_then(|o| o.as_array())
            .and_then(|o| Some((o.first()?.as_u64()?, o.get(1)?.as_u64()?)))
            .ok_or_else(|| bad(&format!("tensor `{name}` has no data_offsets")))?;
        let (start, end) = offsets;
        if end > data_len {
            return Err(bad(&format!(
                "tensor `{name}` extends past the end of the file (truncated download?)"
            )));
        }
        let dtype = info.get("dtype").and_then(|d| d.as_str()).unwrap_or("");
        let Some((_, itemsize)) = mlx_dtype(dtype) else {
            return Err(bad(&format!(
                "tensor `{name}` has unsupported dtype {dtype}; MLX reads BOOL, U8-U64, I8-I64, F16, BF16, F32, C64 and F8_E4M3"
            )));
        };
        let shape: Vec<u64> = info
            .get("shape")
            .and_then(|s| s.as_array())
            .and_then(|s| s.iter().map(|d| d.as_u64()).collect())
            .ok_or_else(|| bad(&format!("tensor `{name}` has no valid shape")))?;
        let need = shape
            .iter()
            .try_fold(itemsize, |acc, &d| acc.checked_mul(d));
        if start > end || need != Some(end - start) || shape.iter().any(|&d| d > i32::MAX as u64) {
            return Err(bad(&format!(
                "tensor `{name}` has invalid data offsets ({start}, {end}) for shape {shape:?} of {dtype}"
            )));
        }
        tensors.push(TensorEntry {
            name: name.clone(),
            dtype: dtype.to_owned(),
            shape,
            start,
            end,
        });
    }
    tensors.sort_by_key(|t| (t.start, t.end));
    Ok(Header {
        data_start: 8 + n,
        data_len,
        tensors,
    })
}

/// Rewrites `path` (temp file + rename) with its header padded by spaces to a multiple of 8
/// bytes, as the `safetensors` library writes it; returns whether it had to. MLX's writer
/// leaves the header unpadded, so the data section starts at an odd offset and no tensor can
/// be mapped from the page cache (an address keeps its file offset within a page, and would
/// be misaligned); importers call this after `save_safetensors`. Tensor bytes are unchanged.
pub fn pad_header(path: &Path) -> Result<bool> {
    use std::io::{Seek, SeekFrom, Write};
    let header = read_header(path)?;
    if header.data_start.is_multiple_of(8) {
        return Ok(false);
    }
    let err = |e: std::io::Error| EngineError::file(path, format!("cannot rewrite ({e})"));
    let mut src = File::open(path).map_err(err)?;
    let mut json = vec![0u8; header.data_start as usize - 8];
    src.seek(SeekFrom::Start(8)).map_err(err)?;
    src.read_exact(&mut json).map_err(err)?;
    json.resize(json.len().next_multiple_of(8), b' ');
    let name = path.file_name().map(|n| n.to_string_lossy().into_owned());
    let tmp = path.with_file_name(format!(
        ".{}.pad-{}",
        name.unwrap_or_default(),
        std::process::id()
    ));
    let written = (|| {
        let mut dst = std::io::BufWriter::new(File::create(&tmp)?);
        dst.write_all(&(json.len() as u64).to_le_bytes())?;
        dst.write_all(&json)?;
        std::io::copy(&mut src, &mut dst)?;
        dst.into_inner().map_err(|e| e.into_error())?.sync_all()?;
        std::fs::rename(&tmp, path)
    })();
    if let Err(e) = written {
        let _ = std::fs::remove_file(&tmp);
        return Err(err(e));
    }
    Ok(true)
}

/// Paths of the `model*.safetensors` files in `dir`, sorted (the index file is not needed:
/// mlx-lm globs too).
pub fn model_files(dir: &Path) -> Result<Vec<PathBuf>> {
    let mut files: Vec<PathBuf> = std::fs::read_dir(dir)
        .map_err(|e| EngineError::file(dir, format!("cannot read the model directory ({e})")))?
        .filter_map(|e| e.ok().map(|e| e.path()))
        .filter(|p| {
            let name = p.file_name().and_then(|n| n.to_str()).unwrap_or("");
            name.starts_with("model") && name.ends_with(".safetensors")
        })
        .collect();
    files.sort();
    Ok(files)
}
