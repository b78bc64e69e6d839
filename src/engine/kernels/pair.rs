//! A persistent helper thread that takes the second half of a host product, for host calls
//! that MLX's graph interleaves (`--host-matvec`: ~200 products per token, each a few dozen
//! to a few hundred microseconds, separated by MLX's own ops).
//!
//! Why not rayon: a rayon fork/join wakes a sleeping pool thread through the kernel each
//! time, which costs about as much as a small product itself. The helper spins for a short
//! while after each job (yielding its core to anyone else who wants it), so the next product
//! finds it awake; after [`IDLE_BEFORE_PARK`] without work it parks until the next job.

use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Mutex, OnceLock};
use std::thread::Thread;
use std::time::{Duration, Instant};

/// How long the helper stays awake without work before it parks.
const IDLE_BEFORE_PARK: Duration = Duration::from_micros(80);
/// Busy-wait iterations before a waiting thread starts yielding its core.
const SPINS_BEFORE_YIELD: u32 = 256;

/// A job: a borrowed closure, its lifetime erased (the poster waits for it to finish).
type Job = *const (dyn Fn() + Sync);

struct Slot(std::cell::UnsafeCell<Option<Job>>);
// SAFETY: the slot is written only by the poster before it publishes `posted` (Release) and
// read only by the helper after it observes it (Acquire); the poster holds `POSTER` meanwhile.
unsafe impl Sync for Slot {}

struct Helper {
    thread: Thread,
    job: Slot,
    /// Jobs posted so far.
    posted: AtomicUsize,
    /// Jobs finished so far.
    done: AtomicUsize,
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
                    done: AtomicUsize::new(0),
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
        seen += 1;
        // SAFETY: see `Slot`; the poster keeps the closure alive until `done` reaches `seen`.
        if let Some(job) = unsafe { *me.job.0.get() } {
            let job = unsafe { &*job };
            // A panicking job must still be marked done, or its poster would wait for ever.
            let ok = std::panic::catch_unwind(std::panic::AssertUnwindSafe(job)).is_ok();
            me.failed.store(!ok, Ordering::Relaxed);
        }
        me.done.store(seen, Ordering::Release);
    }
}

/// Runs `first` on this thread and `second` on the helper, returning when both are done;
/// both on this thread where no helper can run (one core).
pub fn both(first: impl FnOnce(), second: &(dyn Fn() + Sync)) {
    static POSTER: Mutex<()> = Mutex::new(());
    let Some(h) = helper() else {
        first();
        second();
        return;
    };
    // One poster at a time (the engine has one MLX thread; tests may run several).
    let _guard = super::lock(&POSTER);
    // SAFETY: lifetime erased; this function does not return before the helper finished it.
    let job: Job = unsafe { std::mem::transmute::<&(dyn Fn() + Sync), Job>(second) };
    unsafe { *h.job.0.get() = Some(job) };
    let ticket = h.posted.fetch_add(1, Ordering::SeqCst) + 1;
    if h.parked.load(Ordering::SeqCst) {
        h.thread.unpark();
    }
    // Wait for the helper even if `first` panics (it still reads `second`).
    struct Wait<'a>(&'a Helper, usize);
    impl Drop for Wait<'_> {
        fn drop(&mut self) {
            let mut spins = 0u32;
            while self.0.done.load(Ordering::Acquire) < self.1 {
                if spins < SPINS_BEFORE_YIELD {
                    spins += 1;
                    std::hint::spin_loop();
                } else {
                    std::thread::yield_now();
                }
            }
        }
    }
    let wait = Wait(h, ticket);
    first();
    drop(wait);
    if h.failed.load(Ordering::Relaxed) {
        panic!("the helper thread's half of a host product panicked");
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn both_halves_run_and_finish_before_return() {
        for round in 0..200usize {
            let a = AtomicUsize::new(0);
            let b = AtomicUsize::new(0);
            both(
                || {
                    a.fetch_add(round, Ordering::Relaxed);
                },
                &|| {
                    b.fetch_add(round + 1, Ordering::Relaxed);
                },
            );
            assert_eq!(a.load(Ordering::Relaxed), round);
            assert_eq!(b.load(Ordering::Relaxed), round + 1);
            if round % 50 == 0 {
                // Let the helper park, then wake it with the next job.
                std::thread::sleep(IDLE_BEFORE_PARK * 2);
            }
        }
    }

    #[test]
    fn a_panicking_half_is_re_raised_and_the_helper_keeps_serving() {
        let r = std::panic::catch_unwind(|| both(|| {}, &|| panic!("second half")));
        assert!(r.is_err());
        let b = AtomicUsize::new(0);
        both(|| {}, &|| {
            b.fetch_add(1, Ordering::Relaxed);
        });
        assert_eq!(b.load(Ordering::Relaxed), 1);
    }
}
