//! Reading `.safetensors` files into MLX arrays fast and bit-exactly.
//!
//! MLX's own loader reads every tensor into a buffer of its own: one allocation per tensor,
//! each 4 KiB page of it a page fault (the kernel zeroes it) before the copy from the page
//! cache: ~130k faults and most of the load time for a 538 MB checkpoint on this VM. Here the
//! file's data section becomes one or a few large byte arrays ("segments"), still allocated
//! and filled through MLX's own `Load` primitive, but through a custom reader that receives
//! MLX's destination buffer. On Linux with the CPU backend, a segment whose tensors are all
//! aligned in the file gets its whole pages replaced by a private mapping of the file (no
//! zeroing, no copy; pages are shared with the page cache until written, which weights never
//! are; like any mapped-weights loader, truncating the file while mlxb runs would fault).
//! Other segments (e.g. MLX-written files, whose header length is often odd) are copied with
//! parallel `pread`s (transparent huge pages for them were 1.7x faster typically but now and
//! then 5x slower on this VM, whose host reclaims idle 2 MiB blocks). Each tensor is then a zero-copy view of its segment
//! (slice, dtype view, reshape), so the model sees exactly the file's bytes, as with MLX's
//! loader; a tensor misaligned for its dtype gets an aligned buffer of its own.
//!
//! The header is parsed and checked here first, so a corrupt file is one sentence naming
//! the file and the tensor, never an MLX message with C++ source paths.

mod header;
mod reader;

pub use header::{mlx_dtype, model_files, pad_header, read_header, Header, TensorEntry};

use super::error::{EngineError, Result};
use mlx_rs::ops::indexing::IndexOp;
use mlx_rs::{Array, Dtype};
use std::collections::HashMap;
use std::ffi::c_void;
use std::path::Path;

/// Largest segment: MLX shapes are `i32`, so one byte array holds less than 2 GiB.
const SEGMENT_MAX: u64 = 1 << 30;

/// Slack after each segment, so its bytes can start at any offset within a page of MLX's
/// buffer: the one where buffer and file share their offset within a page (see `reader::place`).
const PAGE: u64 = 4096;

/// How [`load_with`] lays the file out in memory.
#[derive(Debug, Clone, Copy)]
pub struct LoadOptions {
    /// Segments at least this long are mapped from the page cache instead of copied (below
    /// it MLX's buffer may come from the heap rather than its own `mmap`, and copying is
    /// cheap). Tests use 0 to cover mapping with small files, `u64::MAX` to copy everything.
    pub map_min: u64,
    /// Longest segment (tests use small values to cover files split into many segments).
    pub segment_max: u64,
}

impl Default for LoadOptions {
    fn default() -> Self {
        Self {
            map_min: 64 << 20,
            segment_max: SEGMENT_MAX,
        }
    }
}

/// Loads every tensor of `path` with the same bytes, dtypes and shapes as MLX's
/// `load_safetensors`, evaluated (read) before returning.
pub fn load(path: &Path) -> Result<HashMap<String, Array>> {
    load_with(path, LoadOptions::default()).map(|l| l.tensors)
}

/// What [`load_with`] produced and how it laid it out (tests check the layout they asked for).
pub struct Loaded {
    /// The tensors by name.
    pub tensors: HashMap<String, Array>,
    /// File bytes mapped from the page cache rather than copied.
    pub mapped_bytes: u64,
    /// Tensors copied into buffers of their own (misaligned for their dtype).
    pub own_buffers: usize,
}

/// What a partial load reads of one tensor ([`load_narrowed`]).
#[derive(Debug, Clone)]
pub enum Narrowed {
    /// Only this part of it: a contiguous byte range with its shape.
    Part(TensorEntry),
    /// A strided part: the tensor is read whole on its own, cut, and its buffer freed before
    /// the next one is read.
    Strided,
    /// Nothing: the tensor is left out (another rank's layer).
    Skip,
}

/// [`load`] with explicit layout options.
pub fn load_with(path: &Path, opts: LoadOptions) -> Result<Loaded> {
    read_tensors(path, &read_header(path)?, opts)
}

/// [`load`] of the parts of tensors `narrow` asks for (a tensor-parallel rank's shard): each
/// tensor is read whole (`None`), only in part, or whole and then cut by `cut` (name, tensor)
/// one at a time, so that at most one whole strided tensor is in memory.
pub fn load_narrowed(
    path: &Path,
    narrow: &dyn Fn(&TensorEntry) -> Option<Narrowed>,
    cut: &dyn Fn(&str, Array) -> Result<Array>,
) -> Result<HashMap<String, Array>> {
    let mut header = read_header(path)?;
    let mut strided = Vec::new();
    let mut kept = Vec::with_capacity(header.tensors.len());
    for t in header.tensors.drain(..) {
        match narrow(&t) {
            Some(Narrowed::Part(part)) => kept.push(part),
            Some(Narrowed::Strided) => strided.push(t),
            Some(Narrowed::Skip) => {}
            None => kept.push(t),
        }
    }
    header.tensors = kept;
    let mut out = read_tensors(path, &header, LoadOptions::default())?.tensors;
    for t in strided {
        header.tensors = vec![t];
        let whole = read_tensors(path, &header, LoadOptions::default())?.tensors;
        for (name, a) in whole {
            let part = cut(&name, a)?;
            part.eval()?;
            out.insert(name, part);
        }
        // The whole tensor's buffer back to the system, not to MLX's cache.
        mlx_rs::memory::clear_cache()?;
    }
    Ok(out)
}

/// Reads `header`'s tensors of `path`.
fn read_tensors(path: &Path, header: &Header, opts: LoadOptions) -> Result<Loaded> {
    let segments = plan_segments(path, header, opts)?;
    let (seg_arrays, shifts) = reader::read_segments(path, &segments)?;
    let mut out = HashMap::with_capacity(header.tensors.len());
    let mut own_buffers = 0;
    let mut i = 0usize;
    for t in &header.tensors {
        let (dtype, itemsize) = mlx_dtype(&t.dtype).unwrap_or((Dtype::Uint8, 1));
        let shape: Vec<i32> = t.shape.iter().map(|&d| d as i32).collect();
        let real = header.data_start + t.start;
        let tensor = if t.end == t.start {
            Array::from_slice::<u8>(&[], &[0])
                .view_dtype(dtype)?
                .reshape(&shape)?
        } else {
            while real >= segments[i].real + segments[i].len {
                i += 1;
            }
            let seg = segments[i];
            let a = (shifts[i] + real - seg.real) as i32;
            let bytes = seg_arrays[i].index(a..a + (t.end - t.start) as i32);
            if (seg.anchor + real - seg.real).is_multiple_of(itemsize) {
                bytes.view_dtype(dtype)?.reshape(&shape)?
            } else {
                // Misaligned for its dtype even within the data section (a writer that packs
                // tensors without padding): its own aligned buffer, as MLX's loader gives it.
                bytes.eval()?;
                own_buffers += 1;
                let raw = bytes.as_slice::<u8>();
                // SAFETY: `raw` holds exactly the bytes of `shape` elements of `dtype`
                // (checked by `read_header`); MLX copies them into a new buffer.
                unsafe { Array::from_raw_data(raw.as_ptr() as *const c_void, &shape, dtype) }
            }
        };
        out.insert(t.name.clone(), tensor);
    }
    // The views are metadata only (MLX shares the segment's buffer); evaluating them here
    // keeps the first forward free of loading work.
    mlx_rs::transforms::eval(out.values())
        .map_err(|e| EngineError::file(path, format!("cannot read the weights ({e})")))?;
    Ok(Loaded {
        tensors: out,
        mapped_bytes: segments.iter().filter(|s| s.map).map(|s| s.len).sum(),
        own_buffers,
    })
}

/// Whether segments may be mapped: Linux on MLX's CPU backend, whose buffers are plain
/// `malloc` memory (a GPU backend's buffers are driver memory that must not be remapped).
fn can_map() -> bool {
    cfg!(target_os = "linux") && super::runtime::backend() == super::runtime::Backend::Cpu
}

/// A contiguous byte range of the file read as one `uint8` MLX array.
#[derive(Debug, Clone, Copy)]
struct Segment {
    /// Offset of its stand-in tensor in the stand-in data section.
    virt: u64,
    /// Absolute file offset of its first byte.
    real: u64,
    /// Bytes of file data (the MLX array is [`PAGE`] longer).
    len: u64,
    /// Whether its whole pages are mapped from the page cache rather than copied.
    map: bool,
    /// Address of its first byte modulo [`PAGE`]: the file offset's when mapped (a mapping
    /// keeps offsets within a page), else the offset within the data section (which writers
    /// align for every dtype, unlike the header length).
    anchor: u64,
}

/// Groups the (sorted, non-empty) tensors into contiguous byte ranges of the data section,
/// each at most `segment_max` long unless one tensor alone is longer; bytes between tensors
/// (parts left out by a narrowed load) are not read.
fn plan_segments(path: &Path, header: &Header, opts: LoadOptions) -> Result<Vec<Segment>> {
    let segment_max = opts.segment_max.min(SEGMENT_MAX);
    // (start, end, every tensor aligned in the file for its dtype)
    let mut ranges: Vec<(u64, u64, bool)> = Vec::new();
    for t in header.tensors.iter().filter(|t| t.end > t.start) {
        if t.end - t.start > SEGMENT_MAX {
            return Err(EngineError::file(
                path,
                format!(
                    "tensor `{}` is {} bytes; mlxb loads tensors of at most {SEGMENT_MAX} bytes, split the checkpoint into smaller tensors",
                    t.name,
                    t.end - t.start
                ),
            ));
        }
        let itemsize = mlx_dtype(&t.dtype).map_or(1, |(_, n)| n);
        let aligned = (header.data_start + t.start).is_multiple_of(itemsize);
        match ranges.last_mut() {
            Some((s, e, ok)) if t.start <= *e && t.end.max(*e) - *s <= segment_max => {
                *e = t.end.max(*e);
                *ok &= aligned;
            }
            _ => ranges.push((t.start, t.end, aligned)),
        }
    }
    let mut virt = 0;
    Ok(ranges
        .into_iter()
        .map(|(s, e, aligned)| {
            let map = aligned && e - s >= opts.map_min && can_map();
            let real = header.data_start + s;
            let seg = Segment {
                virt,
                real,
                len: e - s,
                map,
                anchor: if map { real % PAGE } else { s % PAGE },
            };
            virt += seg.len + PAGE;
            seg
        })
        .collect())
}
