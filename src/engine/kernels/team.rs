//! A team of threads that runs one host decode step in lockstep: every thread walks the same
//! layer loop, computes its share of each mat-vec's rows (or of the attention heads) into a
//! [`Shared`] buffer, and meets the others at a [`SpinBarrier`] before anyone reads it.
//!
//! Why not a fork/join per mat-vec: a decode token of a small model is ~150 parallel phases
//! of a few dozen microseconds each, and waking a sleeping pool thread for each one cost
//! about as much as the work it took over (perf showed ~14% of the step in the scheduler).
//! The team is launched once per step on the pool's threads and only spins between phases.

use std::ops::Range;
use std::sync::atomic::{AtomicUsize, Ordering};

/// Spins before a waiting thread starts yielding its core (a descheduled team mate on a
/// loaded machine would otherwise be starved by the spinning one).
const SPINS_BEFORE_YIELD: u32 = 2000;

/// A reusable barrier for a fixed number of threads that busy-waits.
#[derive(Debug)]
pub struct SpinBarrier {
    threads: usize,
    arrived: AtomicUsize,
    generation: AtomicUsize,
}

impl SpinBarrier {
    /// A barrier for `threads` threads.
    pub fn new(threads: usize) -> Self {
        Self {
            threads,
            arrived: AtomicUsize::new(0),
            generation: AtomicUsize::new(0),
        }
    }

    /// Returns once all `threads` threads have called `wait` for this generation. Writes made
    /// before `wait` are visible to every thread after it.
    pub fn wait(&self) {
        let generation = self.generation.load(Ordering::Acquire);
        if self.arrived.fetch_add(1, Ordering::AcqRel) + 1 == self.threads {
            self.arrived.store(0, Ordering::Relaxed);
            self.generation.fetch_add(1, Ordering::Release);
            return;
        }
        let mut spins = 0u32;
        while self.generation.load(Ordering::Acquire) == generation {
            if spins < SPINS_BEFORE_YIELD {
                spins += 1;
                std::hint::spin_loop();
            } else {
                std::thread::yield_now();
            }
        }
    }
}

/// An f32 buffer the team writes in disjoint ranges and reads whole, with a barrier between.
pub struct Shared {
    ptr: *mut f32,
    len: usize,
    _buf: Vec<f32>,
}

// SAFETY: access goes through `part_mut`/`all`, whose callers keep writes to disjoint ranges
// and separate every write from every read of the same range by a `SpinBarrier::wait`.
unsafe impl Sync for Shared {}
unsafe impl Send for Shared {}

impl Shared {
    /// `len` zeros.
    pub fn new(len: usize) -> Self {
        let mut buf = vec![0.0f32; len];
        Self {
            ptr: buf.as_mut_ptr(),
            len,
            _buf: buf,
        }
    }

    /// Values `range`, for writing.
    ///
    /// # Safety
    /// No other thread may access `range` until the writers have passed the next barrier.
    #[allow(clippy::mut_from_ref)]
    pub unsafe fn part_mut(&self, range: Range<usize>) -> &mut [f32] {
        assert!(range.start <= range.end && range.end <= self.len);
        std::slice::from_raw_parts_mut(self.ptr.add(range.start), range.len())
    }

    /// The whole buffer, for reading.
    ///
    /// # Safety
    /// No thread may write any part of it until every reader has passed the next barrier.
    pub unsafe fn all(&self) -> &[f32] {
        std::slice::from_raw_parts(self.ptr, self.len)
    }
}

/// This thread's place in the team.
#[derive(Debug, Clone, Copy)]
pub struct Member<'a> {
    /// This thread's index (0 also does the team's serial bookkeeping).
    pub index: usize,
    /// Threads in the team.
    pub threads: usize,
    /// The team's barrier.
    pub barrier: &'a SpinBarrier,
}

impl Member<'_> {
    /// This thread's share of `n` items (contiguous, as even as possible).
    pub fn share(&self, n: usize) -> Range<usize> {
        let per = n.div_ceil(self.threads);
        let start = (self.index * per).min(n);
        start..(start + per).min(n)
    }

    /// Waits for the rest of the team.
    pub fn sync(&self) {
        self.barrier.wait();
    }
}

/// An error slot the team's threads report into (the first one wins); the others keep
/// meeting at barriers so nobody waits forever.
pub struct ErrorSlot<E>(std::sync::Mutex<Option<E>>);

impl<E> ErrorSlot<E> {
    /// An empty slot.
    pub fn new() -> Self {
        Self(std::sync::Mutex::new(None))
    }

    /// Keeps `result`'s error if it is the first.
    pub fn keep(&self, result: std::result::Result<(), E>) {
        if let Err(e) = result {
            if let Ok(mut slot) = self.0.lock() {
                slot.get_or_insert(e);
            }
        }
    }

    /// The first error reported, if any.
    pub fn take(self) -> Option<E> {
        self.0.into_inner().ok().flatten()
    }
}

impl<E> Default for ErrorSlot<E> {
    fn default() -> Self {
        Self::new()
    }
}

/// Runs `work(member)` on `threads` threads of the rayon pool at once (at most the pool's
/// size; the calling thread waits).
pub fn run_team(threads: usize, work: impl Fn(Member<'_>) + Sync) {
    let threads = threads.clamp(1, rayon::current_num_threads().max(1));
    let barrier = SpinBarrier::new(threads);
    if threads == 1 {
        work(Member {
            index: 0,
            threads: 1,
            barrier: &barrier,
        });
        return;
    }
    rayon::broadcast(|ctx| {
        if ctx.index() < threads {
            work(Member {
                index: ctx.index(),
                threads,
                barrier: &barrier,
            });
        }
    });
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_thread_sees_every_part_after_the_barrier() {
        let buf = Shared::new(64);
        let seen = std::sync::Mutex::new(Vec::new());
        run_team(2, |me| {
            for round in 0..50 {
                // SAFETY: each thread writes its own share, then all read after the barrier,
                // and the next round's writes come after a second barrier.
                unsafe {
                    for (i, v) in buf.part_mut(me.share(64)).iter_mut().enumerate() {
                        *v = (round * 1000 + me.share(64).start + i) as f32;
                    }
                }
                me.sync();
                let ok = unsafe { buf.all() }
                    .iter()
                    .enumerate()
                    .all(|(i, v)| *v == (round * 1000 + i) as f32);
                seen.lock().unwrap().push(ok);
                me.sync();
            }
        });
        let seen = seen.into_inner().unwrap();
        assert!(!seen.is_empty() && seen.iter().all(|ok| *ok));
    }

    #[test]
    fn shares_cover_every_item_once() {
        let barrier = SpinBarrier::new(3);
        let covered: Vec<usize> = (0..3)
            .flat_map(|index| {
                Member {
                    index,
                    threads: 3,
                    barrier: &barrier,
                }
                .share(10)
            })
            .collect();
        assert_eq!(covered, (0..10).collect::<Vec<_>>());
    }
}
