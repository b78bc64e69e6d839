//! The custom MLX reader behind [`super::load_with`]: it serves a stand-in header listing the
//! segments, then fills MLX's freshly allocated segment buffers from the real file, mapping
//! whole pages from the page cache where allowed and copying the rest with parallel `pread`s.

use super::{Segment, PAGE};
use crate::engine::error::{EngineError, Result};
use mlx_rs::{Array, Stream};
use std::ffi::{c_char, c_void, CString};
use std::fs::File;
use std::os::unix::fs::FileExt;
use std::path::Path;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};

/// Reads the segments into `uint8` MLX arrays through MLX's `Load` primitive fed by a custom
/// reader; returns them with the offset of each segment's first byte in its array.
pub(super) fn read_segments(path: &Path, segments: &[Segment]) -> Result<(Vec<Array>, Vec<u64>)> {
    if segments.is_empty() {
        return Ok((Vec::new(), Vec::new()));
    }
    // A stand-in header listing the segments as `U8` tensors; the reader serves it, then
    // maps data reads to the real file.
    let mut json = serde_json::Map::new();
    for (i, seg) in segments.iter().enumerate() {
        let end = seg.virt + seg.len + PAGE;
        json.insert(
            format!("s{i}"),
            serde_json::json!({"dtype": "U8", "shape": [end - seg.virt], "data_offsets": [seg.virt, end]}),
        );
    }
    let text = serde_json::Value::Object(json).to_string();
    let mut prefix = (text.len() as u64).to_le_bytes().to_vec();
    prefix.extend_from_slice(text.as_bytes());
    let file =
        File::open(path).map_err(|e| EngineError::file(path, format!("cannot open ({e})")))?;
    advise_sequential(&file);
    let state = Arc::new(ReaderState {
        file,
        label: CString::new(format!("file {}", path.display())).unwrap_or_default(),
        prefix,
        segments: segments.to_vec(),
        shifts: segments.iter().map(|_| AtomicUsize::new(0)).collect(),
        pos: AtomicUsize::new(0),
        error: Mutex::new(None),
    });
    let arrays = load_via_reader(path, &state, segments.len())?;
    mlx_rs::transforms::eval(&arrays)
        .map_err(|e| EngineError::file(path, format!("cannot read the weights ({e})")))?;
    if let Some(e) = state.error.lock().map(|g| g.clone()).unwrap_or(None) {
        return Err(EngineError::file(
            path,
            format!("cannot read the weights ({e}); is the file still being written?"),
        ));
    }
    let shifts = state
        .shifts
        .iter()
        .map(|s| s.load(Ordering::SeqCst) as u64)
        .collect();
    Ok((arrays, shifts))
}

/// Hands `state` to MLX as a custom reader and takes back the lazily-loaded segments.
fn load_via_reader(path: &Path, state: &Arc<ReaderState>, n: usize) -> Result<Vec<Array>> {
    let vtable = mlx_sys::mlx_io_vtable {
        is_open: Some(reader_ok),
        good: Some(reader_ok),
        tell: Some(reader_tell),
        seek: Some(reader_seek),
        read: Some(reader_read),
        read_at_offset: Some(reader_read_at),
        write: Some(reader_write),
        label: Some(reader_label),
        free: Some(reader_free),
    };
    let desc = Arc::into_raw(Arc::clone(state)) as *mut c_void;
    let stream = Stream::thread_local_or_cpu();
    let fail = |what: &str| {
        EngineError::file(
            path,
            format!("MLX could not {what}; the MLX runtime may be broken, rerun scripts/setup.sh"),
        )
    };
    // SAFETY: `desc` is a leaked `Arc<ReaderState>` that `reader_free` reclaims exactly once,
    // when MLX drops the last `Load` holding the reader (if `mlx_io_reader_new` itself fails
    // it stays leaked: a few bytes, on an error path). The maps are freed on every path.
    unsafe {
        let reader = mlx_sys::mlx_io_reader_new(desc, vtable);
        if reader.ctx.is_null() {
            return Err(fail("create a file reader"));
        }
        let mut data = mlx_sys::mlx_map_string_to_array_new();
        let mut meta = mlx_sys::mlx_map_string_to_string_new();
        let rc =
            mlx_sys::mlx_load_safetensors_reader(&mut data, &mut meta, reader, stream.as_ptr());
        mlx_sys::mlx_io_reader_free(reader);
        let mut out = Vec::with_capacity(n);
        let mut ok = rc == 0;
        for i in 0..n {
            if !ok {
                break;
            }
            let key = CString::new(format!("s{i}")).unwrap_or_default();
            let mut arr = mlx_sys::mlx_array_new();
            ok = mlx_sys::mlx_map_string_to_array_get(&mut arr, data, key.as_ptr()) == 0;
            out.push(Array::from_ptr(arr));
        }
        mlx_sys::mlx_map_string_to_string_free(meta);
        mlx_sys::mlx_map_string_to_array_free(data);
        if !ok {
            return Err(fail("index the checkpoint"));
        }
        Ok(out)
    }
}

/// What the custom reader serves: the stand-in header, then the segments' file bytes.
struct ReaderState {
    file: File,
    label: CString,
    prefix: Vec<u8>,
    segments: Vec<Segment>,
    /// Where each segment's first byte landed in its MLX array (set by [`ReaderState::fill`]).
    shifts: Vec<AtomicUsize>,
    pos: AtomicUsize,
    error: Mutex<Option<String>>,
}

impl ReaderState {
    /// Total length of the stand-in file.
    fn len(&self) -> u64 {
        let last = self.segments.last().map_or(0, |s| s.virt + s.len + PAGE);
        self.prefix.len() as u64 + last
    }

    /// Fills MLX's buffer `dst` for the stand-in tensor at offset `off`: the segment's bytes
    /// go at the shift that puts its first byte at its anchor modulo the page size.
    fn fill(&self, dst: &mut [u8], off: u64) -> std::io::Result<()> {
        let virt = off.wrapping_sub(self.prefix.len() as u64);
        let Some(i) = self.segments.iter().position(|s| s.virt == virt) else {
            return Err(std::io::Error::other("read of an unknown segment"));
        };
        let seg = self.segments[i];
        if dst.len() as u64 != seg.len + PAGE {
            return Err(std::io::Error::other("read of an unexpected length"));
        }
        let addr = dst.as_ptr() as u64;
        let shift = (seg.anchor + PAGE - addr % PAGE) % PAGE;
        self.shifts[i].store(shift as usize, Ordering::SeqCst);
        let body = &mut dst[shift as usize..(shift + seg.len) as usize];
        place(&self.file, body, seg.real, seg.map)
    }
}

/// Puts the file bytes at `offset` into `dst`. With `map` (then `dst`'s address agrees with
/// `offset` modulo the page size), the whole pages inside `dst` are replaced by a private mapping of
/// the file's page cache (no copy, no zeroed pages: the weights are shared with the page
/// cache until written, which they never are; a write would copy that page, as any private
/// mapping does); the partial pages at both ends, or everything without `map`, are copied.
fn place(file: &File, dst: &mut [u8], offset: u64, map: bool) -> std::io::Result<()> {
    let addr = dst.as_ptr() as u64;
    let first = addr.next_multiple_of(PAGE).min(addr + dst.len() as u64);
    let last = ((addr + dst.len() as u64) & !(PAGE - 1)).max(first);
    if !map || last == first {
        return parallel_pread(file, dst, offset);
    }
    let (head, rest) = dst.split_at_mut((first - addr) as usize);
    let (body, tail) = rest.split_at_mut((last - first) as usize);
    file.read_exact_at(head, offset)?;
    map_file(file, body, offset + head.len() as u64)?;
    file.read_exact_at(tail, offset + (last - addr))
}

/// Maps `dst.len()` bytes of `file` at `offset` over `dst` (page-aligned, a region of MLX's
/// own anonymous buffer) as a private copy-on-write mapping, then pre-faults it for reading.
fn map_file(file: &File, dst: &mut [u8], offset: u64) -> std::io::Result<()> {
    use std::os::fd::AsRawFd;
    let at = dst.as_mut_ptr() as *mut c_void;
    // SAFETY: `dst` is whole pages inside a buffer this call has exclusive use of; the new
    // mapping keeps it readable and writable, and it goes away with the buffer when MLX frees
    // it (glibc unmaps a large allocation in one call, whatever mappings it contains).
    let got = unsafe {
        libc::mmap(
            at,
            dst.len(),
            libc::PROT_READ | libc::PROT_WRITE,
            libc::MAP_PRIVATE | libc::MAP_FIXED,
            file.as_raw_fd(),
            offset as libc::off_t,
        )
    };
    if got != at {
        return Err(std::io::Error::last_os_error());
    }
    // SAFETY: advice only; without it pages fault in on first use instead.
    #[cfg(target_os = "linux")]
    unsafe {
        libc::madvise(at, dst.len(), libc::MADV_POPULATE_READ);
    }
    Ok(())
}

/// Bytes each reading thread takes at a time.
const CHUNK: usize = 8 << 20;

/// `pread`s `dst.len()` bytes at `offset` with a few threads (the page-cache copy and the
/// destination's page faults are CPU work that splits well).
fn parallel_pread(file: &File, dst: &mut [u8], offset: u64) -> std::io::Result<()> {
    let threads = std::thread::available_parallelism()
        .map(|n| n.get())
        .unwrap_or(1)
        .clamp(1, 4)
        .min(dst.len().div_ceil(CHUNK));
    if threads <= 1 {
        return file.read_exact_at(dst, offset);
    }
    let chunks: Vec<Mutex<Option<&mut [u8]>>> =
        dst.chunks_mut(CHUNK).map(|c| Mutex::new(Some(c))).collect();
    let next = AtomicUsize::new(0);
    let work = || -> std::io::Result<()> {
        loop {
            let i = next.fetch_add(1, Ordering::Relaxed);
            let Some(slot) = chunks.get(i) else {
                return Ok(());
            };
            let taken = slot.lock().ok().and_then(|mut g| g.take());
            if let Some(chunk) = taken {
                file.read_exact_at(chunk, offset + (i * CHUNK) as u64)?;
            }
        }
    };
    std::thread::scope(|s| {
        let helpers: Vec<_> = (1..threads).map(|_| s.spawn(work)).collect();
        let mine = work();
        helpers
            .into_iter()
            .map(|h| h.join().unwrap_or_else(|p| std::panic::resume_unwind(p)))
            .chain(std::iter::once(mine))
            .collect::<std::io::Result<Vec<()>>>()
            .map(|_| ())
    })
}

/// Tells the kernel the file is read front to back (bigger read-ahead when it is not cached).
fn advise_sequential(file: &File) {
    #[cfg(target_os = "linux")]
    {
        use std::os::fd::AsRawFd;
        // SAFETY: advice only on an open descriptor.
        unsafe {
            libc::posix_fadvise(file.as_raw_fd(), 0, 0, libc::POSIX_FADV_SEQUENTIAL);
        }
    }
    #[cfg(not(target_os = "linux"))]
    let _ = file;
}

/// Runs a reader callback, turning a panic into a recorded error (no unwinding into C++).
fn guarded<T>(desc: *mut c_void, fallback: T, f: impl FnOnce(&ReaderState) -> T) -> T {
    // SAFETY: `desc` is the `Arc<ReaderState>` leaked in `load_via_reader`, alive until
    // `reader_free`.
    let state = unsafe { &*(desc as *const ReaderState) };
    std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| f(state))).unwrap_or_else(|_| {
        record(state, "the reader panicked".into());
        fallback
    })
}

fn record(state: &ReaderState, e: String) {
    if let Ok(mut g) = state.error.lock() {
        g.get_or_insert(e);
    }
}

extern "C" fn reader_ok(_: *mut c_void) -> bool {
    true
}

extern "C" fn reader_tell(desc: *mut c_void) -> usize {
    guarded(desc, 0, |s| s.pos.load(Ordering::SeqCst))
}

extern "C" fn reader_seek(desc: *mut c_void, off: i64, whence: libc::c_int) -> libc::c_int {
    guarded(desc, -1, |s| {
        let base = match whence {
            libc::SEEK_SET => 0,
            libc::SEEK_CUR => s.pos.load(Ordering::SeqCst) as i64,
            _ => s.len() as i64,
        };
        match usize::try_from(base + off) {
            Ok(p) => {
                s.pos.store(p, Ordering::SeqCst);
                0
            }
            Err(_) => -1,
        }
    })
}

extern "C" fn reader_read(desc: *mut c_void, data: *mut c_char, n: usize) -> usize {
    guarded(desc, 0, |s| {
        let pos = s.pos.load(Ordering::SeqCst);
        let avail = s.prefix.len().saturating_sub(pos).min(n);
        // SAFETY: MLX passes a buffer of `n` writable bytes.
        let dst = unsafe { std::slice::from_raw_parts_mut(data as *mut u8, avail) };
        dst.copy_from_slice(&s.prefix[pos..pos + avail]);
        s.pos.store(pos + avail, Ordering::SeqCst);
        avail
    })
}

extern "C" fn reader_read_at(desc: *mut c_void, data: *mut c_char, n: usize, off: usize) -> usize {
    // A short count would make mlx-c throw on MLX's I/O thread, where nothing catches it;
    // errors are recorded instead and reported after the evaluation.
    guarded(desc, n, |s| {
        // SAFETY: MLX passes its freshly allocated destination buffer of `n` bytes.
        let dst = unsafe { std::slice::from_raw_parts_mut(data as *mut u8, n) };
        if let Err(e) = s.fill(dst, off as u64) {
            record(s, e.to_string());
        }
        n
    })
}

extern "C" fn reader_write(_: *mut c_void, _: *const c_char, _: usize) -> usize {
    0
}

extern "C" fn reader_label(desc: *mut c_void) -> *const c_char {
    guarded(desc, std::ptr::null(), |s| s.label.as_ptr())
}

extern "C" fn reader_free(desc: *mut c_void) {
    // SAFETY: reclaims the reference leaked in `load_via_reader`, once.
    drop(unsafe { Arc::from_raw(desc as *const ReaderState) });
}
