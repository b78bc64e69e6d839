//! A persistent helper thread that shares a host product with the thread that posts it, for
//! host calls that MLX's graph interleaves (`--host-matvec`: ~200 products per token, each a
//! few dozen to a few hundred microseconds, separated by MLX's own ops).
//!
//! Why not rayon: a rayon fork/join wakes a sleeping pool thread through the kernel each
//! time, which costs about as much as a small product itself. The helper spins for a short
//! while after each job (yielding its core to anyone else who wants it), so the next product
//! finds it awake; after `IDLE_BEFORE_PARK` without work it parks until the next job.
//!
//! Why chunks claimed one at a time rather than two fixed halves: when the helper's core is
//! busy (other processes, a hypervisor taking the vCPU), a fixed half waits for it, and a
//! token takes twice as long as on one thread. Here both threads take the next unclaimed
//! chunk until none are left, and a job the helper has not picked up by then is withdrawn,
//! so the poster never waits for more than the one chunk the helper is in.

use std::sync::atomic::{AtomicBool, AtomicU8, AtomicUsize, Ordering};
use std::sync::{Mutex, OnceLock};
use std::thread::Thread;
use std::time::{Duration, Instant};

/// How long the helper stays awake without work before it parks.
const IDLE_BEFORE_PARK: Duration = Duration::from_micros(80);
/// Busy-wait iterations before a waiting thread starts yielding its core.
const SPINS_BEFORE_YIELD: u32 = 256;

/// A job: a borrowed closure, its lifetime erased (the poster withdraws it or waits for it).
type Job = *const (dyn Fn() + Sync);

/// The current job's state (one job at a time).
const POSTED: u8 = 0;
const TAKEN: u8 = 1;
const DONE: u8 = 2;
const WITHDRAWN: u8 = 3;

struct Slot(std::cell::UnsafeCell<Option<Job>>);
// SAFETY: the slot is written only by the poster (holding `POSTER`) while no job is `TAKEN`,
// before it stores `POSTED` (Release); the helper reads it only after moving the state from
// `POSTED` to `TAKEN` (Acquire).
unsafe impl Sync for Slot {}

struct Helper {
    thread: Thread,
    job: Slot,
    /// Jobs posted so far (the helper's wake-up signal).
    posted: AtomicUsize,
    /// The current job's state: `POSTED`, `TAKEN`, `DONE` or `WITHDRAWN`.
    state: AtomicU8,
    /// Whether the helper is (about to be) parked.
    parked: AtomicBool,
    /// Whether the last job panicked (the poster re-raises it).
    failed: AtomicBool,
}

fn helper() -> Option<&'static Helper> {
    static HELPER: OnceLock<Option<&'static Helper>> = OnceLock::new();
    *HELPER.get_or_init(|| {
        if std::thread::available_parallelism().map_or(1, usize::from) < 2 {
            return None;
        }
        let (tx, rx) = std::sync::mpsc::channel::<&'static Helper>();
        let spawned = std::thread::Builder::new()
            .name("mlxb-pair".into())
            .spawn(move || {
                let me = Box::leak(Box::new(Helper {
                    thread: std::thread::current(),
                    job: Slot(std::cell::UnsafeCell::new(None)),
                    posted: AtomicUsize::new(0),
                    state: AtomicU8::new(DONE),
                    parked: AtomicBool::new(false),
                    failed: AtomicBool::new(false),
                }));
                let _ = tx.send(me);
                serve(me);
            });
        spawned.ok().and_then(|_| rx.recv().ok())
    })
}

fn serve(me: &'static Helper) {
    let mut seen = 0usize;
    loop {
        let since = Instant::now();
        let mut spins = 0u32;
        while me.posted.load(Ordering::Acquire) == seen {
            if spins < SPINS_BEFORE_YIELD {
                spins += 1;
                std::hint::spin_loop();
            } else if since.elapsed() < IDLE_BEFORE_PARK {
                std::thread::yield_now();
            } else {
                me.parked.store(true, Ordering::SeqCst);
                if me.posted.load(Ordering::SeqCst) == seen {
                    std::thread::park();
                }
                me.parked.store(false, Ordering::SeqCst);
            }
        }
        seen = me.posted.load(Ordering::Acquire);
        // A job withdrawn (or already run) in the meantime is not ours any more.
        if me
            .state
            .compare_exchange(POSTED, TAKEN, Ordering::AcqRel, Ordering::Acquire)
            .is_err()
        {
            continue;
        }
        // SAFETY: see `Slot`; the poster keeps the closure alive until the state is `DONE`.
        if let Some(job) = unsafe { *me.job.0.get() } {
            let job = unsafe { &*job };
            // A panicking job must still be marked done, or its poster would wait for ever.
            let ok = std::panic::catch_unwind(std::panic::AssertUnwindSafe(job)).is_ok();
            me.failed.store(!ok, Ordering::Relaxed);
        }
        me.state.store(DONE, Ordering::Release);
    }
}

/// Runs `work(i)` for every `i` in `0..chunks`, shared between this thread and the helper
/// (each takes the next unclaimed chunk), returning when all are done; all on this thread where
/// no helper can run (one core). Which thread runs a chunk must not matter to its result.
pub fn share(chunks: usize, work: &(dyn Fn(usize) + Sync)) {
    static POSTER: Mutex<()> = Mutex::new(());
    let next = AtomicUsize::new(0);
    let take_chunks = || loop {
        let i = next.fetch_add(1, Ordering::Relaxed);
        if i >= chunks {
            break;
        }
        work(i);
    };
    let Some(h) = helper().filter(|_| chunks > 1) else {
        take_chunks();
        return;
    };
    // One poster at a time (the engine has one MLX thread; tests may run several).
    let _guard = super::lock(&POSTER);
    let job: &(dyn Fn() + Sync) = &take_chunks;
    // SAFETY: lifetime erased; this function does not return before the job is withdrawn
    // unstarted or finished.
    let job: Job = unsafe { std::mem::transmute::<&(dyn Fn() + Sync), Job>(job) };
    unsafe { *h.job.0.get() = Some(job) };
    h.state.store(POSTED, Ordering::Release);
    h.posted.fetch_add(1, Ordering::SeqCst);
    if h.parked.load(Ordering::SeqCst) {
        h.thread.unpark();
    }
    // Withdraw the job or wait for it even if a chunk here panics (the helper reads `next`).
    struct Finish<'a>(&'a Helper);
    impl Drop for Finish<'_> {
        fn drop(&mut self) {
            let state = &self.0.state;
            if state
                .compare_exchange(POSTED, WITHDRAWN, Ordering::AcqRel, Ordering::Acquire)
                .is_ok()
            {
                return;
            }
            let mut spins = 0u32;
            while state.load(Ordering::Acquire) != DONE {
                if spins < SPINS_BEFORE_YIELD {
                    spins += 1;
                    std::hint::spin_loop();
                } else {
                    std::thread::yield_now();
                }
            }
        }
    }
    let finish = Finish(h);
    take_chunks();
    drop(finish);
    if h.failed.swap(false, Ordering::Relaxed) {
        panic!("the helper thread's part of a host product panicked");
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_chunk_runs_once_before_return() {
        for round in 0..300usize {
            let chunks = 1 + round % 9;
            let hits: Vec<AtomicUsize> = (0..chunks).map(|_| AtomicUsize::new(0)).collect();
            share(chunks, &|i| {
                hits[i].fetch_add(1, Ordering::Relaxed);
            });
            assert!(
                hits.iter().all(|h| h.load(Ordering::Relaxed) == 1),
                "round {round}"
            );
            if round % 50 == 0 {
                // Let the helper park, then wake it with the next job.
                std::thread::sleep(IDLE_BEFORE_PARK * 2);
            }
        }
    }

    #[test]
    fn a_busy_helper_does_not_hold_the_poster_back() {
        // While one `share` keeps the helper in a long chunk, a second poster's job may be
        // withdrawn unstarted: all its chunks still run, on the poster's thread.
        let slow_started = AtomicBool::new(false);
        std::thread::scope(|scope| {
            scope.spawn(|| {
                share(2, &|_| {
                    slow_started.store(true, Ordering::SeqCst);
                    std::thread::sleep(Duration::from_millis(50));
                })
            });
            while !slow_started.load(Ordering::SeqCst) {
                std::hint::spin_loop();
            }
            let hits = AtomicUsize::new(0);
            share(4, &|_| {
                hits.fetch_add(1, Ordering::Relaxed);
            });
            assert_eq!(hits.load(Ordering::Relaxed), 4);
        });
    }

    #[test]
    fn a_panicking_chunk_is_re_raised_and_the_helper_keeps_serving() {
        for _ in 0..20 {
            let r = std::panic::catch_unwind(|| {
                share(2, &|i| {
                    if i == 1 {
                        panic!("chunk 1")
                    }
                })
            });
            assert!(r.is_err());
        }
        let b = AtomicUsize::new(0);
        share(3, &|_| {
            b.fetch_add(1, Ordering::Relaxed);
        });
        assert_eq!(b.load(Ordering::Relaxed), 3);
    }
}
