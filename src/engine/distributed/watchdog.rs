//! The ranks' watchdog: MLX's collectives wait without a limit, so each rank watches for
//! silence from the others while it waits on them, and ends the job when it lasts too long.

use super::seconds_from_env;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::OnceLock;
use std::time::{Duration, Instant};

/// How long a rank waits for word from the others in the middle of a generation, or for rank
/// 0's next order or keep-alive, before it ends the job (`MLXB_RANKS_TIMEOUT` seconds, default
/// 600): MLX's collectives wait without a limit, so a peer that stops answering without closing
/// its connection (a machine gone from the network, a stopped process) would hang every rank.
pub fn silence_limit() -> Duration {
    seconds_from_env("MLXB_RANKS_TIMEOUT", 600.0)
}

static STARTED: OnceLock<Instant> = OnceLock::new();
/// Milliseconds since [`STARTED`] of the last sign of life from the other ranks.
static LAST_WORD: AtomicU64 = AtomicU64::new(0);
/// How many waits on the other ranks are under way (the watchdog only counts silence then).
static WAITING: AtomicUsize = AtomicUsize::new(0);

fn now_ms() -> u64 {
    STARTED.get_or_init(Instant::now).elapsed().as_millis() as u64
}

/// Records a sign of life from the other ranks (a token generated together, a message).
pub fn heard() {
    LAST_WORD.store(now_ms(), Ordering::Relaxed);
}

/// A wait on the other ranks, for as long as it lives (see [`waiting`]).
pub struct Waiting(());

impl Drop for Waiting {
    fn drop(&mut self) {
        WAITING.fetch_sub(1, Ordering::Relaxed);
    }
}

/// Starts a wait on the other ranks: until it is dropped, a silence longer than
/// [`silence_limit`] ends the process.
pub fn waiting() -> Waiting {
    heard();
    WAITING.fetch_add(1, Ordering::Relaxed);
    Waiting(())
}

/// Starts the watchdog of rank `rank`, which ends the process after `limit` of silence.
pub(super) fn start(rank: usize, limit: Duration) {
    heard();
    std::thread::spawn(move || loop {
        std::thread::sleep(Duration::from_millis(200));
        let silent =
            Duration::from_millis(now_ms().saturating_sub(LAST_WORD.load(Ordering::Relaxed)));
        if WAITING.load(Ordering::Relaxed) > 0 && silent > limit {
            eprintln!(
                "mlxb (rank {rank}): error: no word from the other ranks for {:.0} s (one stopped \
                 answering without closing its connection); the job ends",
                silent.as_secs_f64()
            );
            std::process::exit(1);
        }
    });
}
