//! Memory for the weight copies that the host kernels stream every token: the re-laid dense
//! weights of [`super::packed`] and the quantized ones of [`super::host::HostQuant`].
//!
//! A decode step reads each weight once, front to back. In 4 KiB pages that stream crosses a
//! page every 4 KiB (a TLB walk, and the end of the hardware prefetcher's run); in the 2 MiB
//! pages of Linux's transparent huge pages it crosses one every 2 MiB, and the same bytes
//! stream faster (docs/performance.md). Where transparent huge pages are set to `madvise`
//! (the usual default) memory gets them only when asked, so the copies are made in mappings
//! advised `MADV_HUGEPAGE`. A small matrix does not round up to a page of its own: copies are
//! carved from shared chunks, and a chunk is unmapped when its last copy drops. Elsewhere
//! (macOS, transparent huge pages off) the same code gives ordinary pages.
//!
//! The copies of a process stay within a budget, so that a large model is not doubled into
//! swap: past it the kernels read MLX's own buffers (same bits, slower).

use memmap2::MmapMut;
use std::ops::{Deref, DerefMut};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, Weak};

/// A transparent huge page.
const HUGE_PAGE: usize = 2 << 20;

/// Chunks are mapped this large; a copy of half of it or more gets a mapping of its own.
const CHUNK: usize = 32 << 20;

/// Each copy starts on a cache line.
const ALIGN: usize = 64;

/// Bytes the copies of this process hold.
static COPIED_BYTES: AtomicUsize = AtomicUsize::new(0);

/// Bytes the copies may take in this process: half the memory the system had available when
/// the first copy was made (Linux's `MemAvailable`), or 1 GiB where that cannot be read;
/// `MLXB_PACKED_BUDGET_MB` sets it.
fn budget() -> usize {
    static BUDGET: std::sync::OnceLock<usize> = std::sync::OnceLock::new();
    *BUDGET.get_or_init(|| {
        let set = std::env::var("MLXB_PACKED_BUDGET_MB")
            .ok()
            .and_then(|v| v.trim().parse::<usize>().ok());
        let available_kb = || -> Option<usize> {
            let info = std::fs::read_to_string("/proc/meminfo").ok()?;
            let line = info.lines().find(|l| l.starts_with("MemAvailable:"))?;
            line.split_whitespace().nth(1)?.parse().ok()
        };
        match (set, available_kb()) {
            (Some(mb), _) => mb << 20,
            (None, Some(kb)) => (kb << 10) / 2,
            (None, None) => 1 << 30,
        }
    })
}

/// Whether this system backs memory advised `MADV_HUGEPAGE` with transparent huge pages
/// (Linux with them set to `always` or `madvise`): where it does not, a copy made only for its
/// pages would cost memory and gain nothing.
pub(super) fn huge_pages() -> bool {
    static ON: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    *ON.get_or_init(|| {
        cfg!(target_os = "linux")
            && std::fs::read_to_string("/sys/kernel/mm/transparent_hugepage/enabled")
                .is_ok_and(|mode| huge_pages_in(&mode))
    })
}

/// [`huge_pages`] for the contents of `transparent_hugepage/enabled` (the mode in brackets).
fn huge_pages_in(mode: &str) -> bool {
    mode.split_whitespace()
        .any(|m| m == "[always]" || m == "[madvise]")
}

/// Adds `bytes` to `used` when the total stays within `budget`; whether it did.
fn reserve(used: &AtomicUsize, budget: usize, bytes: usize) -> bool {
    used.fetch_update(Ordering::Relaxed, Ordering::Relaxed, |u| {
        u.checked_add(bytes).filter(|&total| total <= budget)
    })
    .is_ok()
}

/// One anonymous mapping, its usable part starting on a huge page.
struct Chunk {
    _map: MmapMut,
    start: *mut u8,
    len: usize,
}

// SAFETY: the chunk only hands out disjoint ranges ([`Carver`]), each owned by one `HostCopy`.
unsafe impl Send for Chunk {}
unsafe impl Sync for Chunk {}

impl Chunk {
    /// `len` bytes (a multiple of [`HUGE_PAGE`]) of zeroed memory advised for huge pages.
    fn map(len: usize) -> Option<Arc<Self>> {
        let mut map = MmapMut::map_anon(len + HUGE_PAGE).ok()?;
        let base = map.as_mut_ptr();
        let skip = base.align_offset(HUGE_PAGE);
        #[cfg(target_os = "linux")]
        {
            // Best effort: a kernel without transparent huge pages refuses the advice, and
            // the memory works the same in small pages.
            let _ = map.advise_range(memmap2::Advice::HugePage, skip, len);
        }
        // SAFETY: `skip < HUGE_PAGE`, so `skip + len` lies within the mapping.
        let start = unsafe { base.add(skip) };
        Some(Arc::new(Self {
            _map: map,
            start,
            len,
        }))
    }
}

/// The chunk small copies are carved from, and how much of it is taken.
struct Carver {
    chunk: Weak<Chunk>,
    used: usize,
}

static CARVER: Mutex<Carver> = Mutex::new(Carver {
    chunk: Weak::new(),
    used: 0,
});

/// `bytes` of fresh zeroed memory: a range of the current chunk, a new chunk, or a mapping of
/// its own for a large copy. Ranges are never reused, so they are zero as mapped.
fn carve(bytes: usize) -> Option<(Arc<Chunk>, *mut u8)> {
    let bytes = bytes.div_ceil(ALIGN) * ALIGN;
    if bytes >= CHUNK / 2 {
        let chunk = Chunk::map(bytes.div_ceil(HUGE_PAGE) * HUGE_PAGE)?;
        let start = chunk.start;
        return Some((chunk, start));
    }
    let mut carver = CARVER.lock().unwrap_or_else(|e| e.into_inner());
    let chunk = match carver.chunk.upgrade() {
        Some(chunk) if carver.used + bytes <= chunk.len => chunk,
        _ => {
            let chunk = Chunk::map(CHUNK)?;
            *carver = Carver {
                chunk: Arc::downgrade(&chunk),
                used: 0,
            };
            chunk
        }
    };
    // SAFETY: `used + bytes <= len`: the range lies within the chunk and no copy holds it.
    let start = unsafe { chunk.start.add(carver.used) };
    carver.used += bytes;
    Some((chunk, start))
}

/// A host kernel's copy of `len` values of `T`, in huge-page memory where the system gives it.
pub(super) struct HostCopy<T: bytemuck::Pod> {
    _chunk: Arc<Chunk>,
    ptr: *mut T,
    len: usize,
}

// SAFETY: the copy owns its range of the chunk alone; `T: Pod` values are plain data.
unsafe impl<T: bytemuck::Pod> Send for HostCopy<T> {}
unsafe impl<T: bytemuck::Pod> Sync for HostCopy<T> {}

impl<T: bytemuck::Pod> HostCopy<T> {
    /// `len` zero values; `None` past the budget or when the memory cannot be mapped.
    pub(super) fn zeroed(len: usize) -> Option<Self> {
        let bytes = len.checked_mul(std::mem::size_of::<T>())?;
        if !reserve(&COPIED_BYTES, budget(), bytes) {
            return None;
        }
        let Some((chunk, start)) = carve(bytes.max(1)) else {
            COPIED_BYTES.fetch_sub(bytes, Ordering::Relaxed);
            return None;
        };
        Some(Self {
            _chunk: chunk,
            ptr: start.cast(),
            len,
        })
    }

    /// A copy of `values`; `None` as for [`HostCopy::zeroed`].
    pub(super) fn of(values: &[T]) -> Option<Self> {
        let mut copy = Self::zeroed(values.len())?;
        copy.copy_from_slice(values);
        Some(copy)
    }

    /// A copy of `values` made for its huge pages: `None` where the system gives none (the
    /// copy would cost memory and gain nothing), as well as where [`HostCopy::of`] gives none.
    pub(super) fn paged(values: &[T]) -> Option<Self> {
        huge_pages().then(|| Self::of(values)).flatten()
    }
}

impl<T: bytemuck::Pod> Drop for HostCopy<T> {
    fn drop(&mut self) {
        COPIED_BYTES.fetch_sub(self.len * std::mem::size_of::<T>(), Ordering::Relaxed);
    }
}

impl<T: bytemuck::Pod> Deref for HostCopy<T> {
    type Target = [T];
    fn deref(&self) -> &[T] {
        // SAFETY: `ptr` is aligned (to `ALIGN`), in the chunk `self` keeps mapped, and its
        // `len` values were zeroed by the mapping (valid for `Pod`).
        unsafe { std::slice::from_raw_parts(self.ptr, self.len) }
    }
}

impl<T: bytemuck::Pod> DerefMut for HostCopy<T> {
    fn deref_mut(&mut self) -> &mut [T] {
        // SAFETY: as in `deref`; the range is this copy's alone.
        unsafe { std::slice::from_raw_parts_mut(self.ptr, self.len) }
    }
}

impl<T: bytemuck::Pod> std::fmt::Debug for HostCopy<T> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "HostCopy({} values)", self.len)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn copies_stop_at_the_budget() {
        let used = AtomicUsize::new(0);
        assert!(reserve(&used, 100, 60));
        assert!(!reserve(&used, 100, 41), "past the budget");
        assert!(reserve(&used, 100, 40));
        assert_eq!(used.load(Ordering::Relaxed), 100);
        assert!(
            !reserve(&used, usize::MAX, usize::MAX),
            "an overflowing total"
        );
    }

    #[test]
    fn huge_pages_are_read_from_the_bracketed_mode() {
        assert!(huge_pages_in("always [madvise] never\n"));
        assert!(huge_pages_in("[always] madvise never\n"));
        assert!(!huge_pages_in("always madvise [never]\n"));
        assert!(!huge_pages_in(""));
    }

    #[test]
    fn small_copies_share_a_chunk_and_keep_their_own_values() {
        let copies: Vec<HostCopy<u32>> = (0..40u32)
            .map(|i| {
                let values: Vec<u32> = (0..1000 + i).map(|v| v * 7 + i).collect();
                HostCopy::of(&values).expect("a small copy")
            })
            .collect();
        for (i, c) in copies.iter().enumerate() {
            let i = i as u32;
            assert_eq!(c.len(), 1000 + i as usize);
            assert!(c.iter().enumerate().all(|(v, &x)| x == v as u32 * 7 + i));
            assert_eq!(c.as_ptr() as usize % ALIGN, 0);
        }
        let shared = copies
            .windows(2)
            .filter(|w| Arc::ptr_eq(&w[0]._chunk, &w[1]._chunk))
            .count();
        assert!(shared >= 30, "only {shared} neighbours share a chunk");
        let fresh = HostCopy::<f32>::zeroed(5000).expect("zeroed");
        assert!(fresh.iter().all(|&x| x == 0.0));
    }

    #[test]
    fn a_chunk_is_unmapped_with_its_last_copy() {
        let big = HostCopy::<u8>::zeroed(CHUNK).expect("a large copy");
        let chunk = Arc::downgrade(&big._chunk);
        assert_eq!(big._chunk.start as usize % HUGE_PAGE, 0);
        drop(big);
        assert!(chunk.upgrade().is_none());
    }

    /// Linux marks a range advised `MADV_HUGEPAGE` with the `hg` flag in `/proc/self/smaps`.
    #[cfg(target_os = "linux")]
    #[test]
    fn copies_are_advised_for_huge_pages() {
        let copy = HostCopy::<u32>::zeroed(CHUNK).expect("a large copy");
        let at = copy.as_ptr() as usize;
        let smaps = std::fs::read_to_string("/proc/self/smaps").expect("smaps");
        let mut inside = false;
        let mut flags = None;
        for line in smaps.lines() {
            if let Some((range, _)) = line.split_once(' ') {
                if let Some((lo, hi)) = range.split_once('-') {
                    if let (Ok(lo), Ok(hi)) =
                        (usize::from_str_radix(lo, 16), usize::from_str_radix(hi, 16))
                    {
                        inside = (lo..hi).contains(&at);
                        continue;
                    }
                }
            }
            if inside {
                if let Some(f) = line.strip_prefix("VmFlags:") {
                    flags = Some(f.to_string());
                }
            }
        }
        let flags = flags.expect("the copy's mapping in smaps");
        assert!(
            flags.split_whitespace().any(|f| f == "hg"),
            "not advised for huge pages: {flags}"
        );
    }
}
