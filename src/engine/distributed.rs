//! Ranks that cooperate through MLX's own distributed layer (`mlx.distributed`): the process
//! group that `mlx.launch` (or `mlxb launch`) sets up, the collective the sharded layers need
//! (`all_sum`), and rank 0's broadcast of what the other ranks cannot know on their own (a
//! served request, a client's disconnect).
//!
//! mlxb writes no transport: the ring backend (TCP, Linux CPUs and Macs) or MPI come from libmlx,
//! joined through the environment `mlx.launch` sets (`MLX_RANK`, `MLX_HOSTFILE`).

use super::error::{EngineError, Result};
use mlx_rs::{Array, Dtype, Stream};
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, OnceLock};
use std::time::{Duration, Instant};

/// The environment variable `mlx.launch` sets to each process's rank.
pub const RANK_ENV: &str = "MLX_RANK";
/// The environment variable naming the ring backend's hostfile (JSON: per rank, its addresses).
pub const HOSTFILE_ENV: &str = "MLX_HOSTFILE";

/// The group of every rank of this job.
pub struct Group {
    raw: mlx_sys::mlx_distributed_group,
    rank: usize,
    size: usize,
}

// SAFETY: the handle wraps an MLX `Group` (a shared pointer to the backend's state), which MLX
// uses from whichever thread evaluates a collective; mlxb never frees it while it is in use
// (the handle lives as long as the process's world).
unsafe impl Send for Group {}
unsafe impl Sync for Group {}

impl Drop for Group {
    fn drop(&mut self) {
        // SAFETY: `raw` came from `mlx_distributed_init` and is freed once.
        unsafe {
            mlx_sys::mlx_distributed_group_free(self.raw);
        }
    }
}

impl std::fmt::Debug for Group {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "Group(rank {} of {})", self.rank, self.size)
    }
}

impl Group {
    /// This process's rank (0 = the one that tokenizes, prints and serves).
    pub fn rank(&self) -> usize {
        self.rank
    }

    /// Number of ranks.
    pub fn size(&self) -> usize {
        self.size
    }

    /// Whether this is rank 0.
    pub fn is_leader(&self) -> bool {
        self.rank == 0
    }
}

static WORLD: OnceLock<Option<Arc<Group>>> = OnceLock::new();

/// Whether this process was started as one rank of several (`mlx.launch` / `mlxb launch` set
/// `MLX_RANK`).
pub fn launched_as_rank() -> bool {
    std::env::var_os(RANK_ENV).is_some()
}

/// Joins the job this process was launched into (once; later calls return the same group).
/// `None` when it was not launched as a rank, or the job has a single rank.
pub fn join() -> Result<Option<Arc<Group>>> {
    if let Some(world) = WORLD.get() {
        return Ok(world.clone());
    }
    let world = if launched_as_rank() {
        init_within(join_timeout())?
            .filter(|g| g.size > 1)
            .map(Arc::new)
    } else {
        None
    };
    if let Some(group) = &world {
        start_watchdog(group.rank, silence_limit());
    }
    Ok(WORLD.get_or_init(|| world).clone())
}

/// The job joined by [`join`], if any.
pub fn world() -> Option<Arc<Group>> {
    WORLD.get().cloned().flatten()
}

/// How long a rank waits for word from the others in the middle of a generation, or for rank
/// 0's next order or keep-alive, before it ends the job (`MLXB_RANKS_TIMEOUT` seconds, default
/// 600): MLX's collectives wait without a limit, so a peer that stops answering without closing
/// its connection (a machine gone from the network, a stopped process) would hang every rank.
pub fn silence_limit() -> Duration {
    seconds_from_env("MLXB_RANKS_TIMEOUT", 600.0)
}

fn seconds_from_env(name: &str, default: f64) -> Duration {
    let secs = std::env::var(name)
        .ok()
        .and_then(|s| s.parse::<f64>().ok())
        .filter(|s| *s > 0.0)
        .unwrap_or(default);
    Duration::from_secs_f64(secs)
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

fn start_watchdog(rank: usize, limit: Duration) {
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

/// How long a rank waits for the others to connect (`MLXB_JOIN_TIMEOUT` seconds, default 120).
fn join_timeout() -> Duration {
    seconds_from_env("MLXB_JOIN_TIMEOUT", 120.0)
}

/// [`init`], given up after `timeout`: MLX's ring backend waits for its neighbours without a
/// limit, so a rank that never starts would leave the others waiting forever.
fn init_within(timeout: std::time::Duration) -> Result<Option<Group>> {
    let (tx, rx) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        let _ = tx.send(init());
    });
    rx.recv_timeout(timeout).unwrap_or_else(|_| {
        Err(EngineError::Input(format!(
            "rank {} waited {:.0} s for {} to connect; start every rank (mlxb launch starts them \
             all) and check that the addresses are reachable",
            std::env::var(RANK_ENV).unwrap_or_default(),
            timeout.as_secs_f64(),
            other_ranks()
        )))
    })
}

/// The other ranks' addresses, from the ring hostfile (for messages).
fn other_ranks() -> String {
    let me: Option<usize> = std::env::var(RANK_ENV).ok().and_then(|r| r.parse().ok());
    let hosts: Option<Vec<Vec<String>>> = std::env::var_os(HOSTFILE_ENV)
        .and_then(|p| std::fs::read_to_string(p).ok())
        .and_then(|t| serde_json::from_str(&t).ok());
    match hosts {
        Some(hosts) => {
            let others: Vec<String> = hosts
                .iter()
                .enumerate()
                .filter(|(r, _)| Some(*r) != me)
                .map(|(r, a)| format!("rank {r} ({})", a.join(", ")))
                .collect();
            others.join(", ")
        }
        None => "the other ranks".to_owned(),
    }
}

fn init() -> Result<Option<Group>> {
    let hostfile = std::env::var_os(HOSTFILE_ENV);
    // The ring backend when a hostfile says where the ranks are (mlx.launch's default on CPUs);
    // otherwise whatever backend MLX finds (MPI under mpirun).
    let backend = hostfile.as_ref().map(|_| c"ring");
    let mut raw = mlx_sys::mlx_distributed_group {
        ctx: std::ptr::null_mut(),
    };
    // SAFETY: `raw` is written by MLX; the backend name is a static C string or null.
    let rc = unsafe {
        mlx_sys::mlx_distributed_init(
            &mut raw,
            true,
            backend.map_or(std::ptr::null(), |b| b.as_ptr()),
        )
    };
    let where_ = hostfile.map_or_else(
        || "under its launcher".to_owned(),
        |h| format!("with {HOSTFILE_ENV}={}", std::path::Path::new(&h).display()),
    );
    if rc != 0 || raw.ctx.is_null() {
        return Err(EngineError::Input(format!(
            "rank {} could not join the other ranks {where_}; start every rank with `mlxb launch` \
             or `mlx.launch` and check that each host's address in the hostfile is reachable",
            std::env::var(RANK_ENV).unwrap_or_default()
        )));
    }
    // SAFETY: `raw` is a valid group handle.
    let (rank, size) = unsafe {
        (
            mlx_sys::mlx_distributed_group_rank(raw),
            mlx_sys::mlx_distributed_group_size(raw),
        )
    };
    Ok(Some(Group {
        raw,
        rank: rank.max(0) as usize,
        size: size.max(1) as usize,
    }))
}

/// One collective op: `op(result, group, stream)` through mlx-c, as a lazy MLX array.
fn collective(
    group: &Group,
    op: impl FnOnce(
        *mut mlx_sys::mlx_array,
        mlx_sys::mlx_distributed_group,
        mlx_sys::mlx_stream,
    ) -> std::os::raw::c_int,
) -> Result<Array> {
    let stream = Stream::thread_local_or_default();
    // SAFETY: `res` is a fresh array handle MLX writes; on failure it is freed here.
    unsafe {
        let mut res = mlx_sys::mlx_array_new();
        if op(&mut res, group.raw, stream.as_ptr()) != 0 {
            mlx_sys::mlx_array_free(res);
            return Err(lost(group));
        }
        Ok(Array::from_ptr(res))
    }
}

/// `mx.distributed.all_sum(x, group=group)`: every rank gets the element-wise sum of every
/// rank's `x` (lazy, like any MLX op; evaluating it waits for the other ranks).
pub fn all_sum(x: &Array, group: &Group) -> Result<Array> {
    // SAFETY: `x` is a live array for the call.
    collective(group, |res, g, s| unsafe {
        mlx_sys::mlx_distributed_all_sum(res, x.as_ptr(), g, s)
    })
}

/// `mx.distributed.all_gather(x)`: every rank's `x` concatenated along axis 0, in rank order.
pub fn all_gather(x: &Array, group: &Group) -> Result<Array> {
    // SAFETY: `x` is a live array for the call.
    collective(group, |res, g, s| unsafe {
        mlx_sys::mlx_distributed_all_gather(res, x.as_ptr(), g, s)
    })
}

/// `mx.distributed.send(x, dst)`: `x` for rank `dst`; the result must be evaluated (or be an
/// input of something evaluated) for the send to happen.
pub fn send(x: &Array, dst: usize, group: &Group) -> Result<Array> {
    // SAFETY: `x` is a live array for the call.
    collective(group, |res, g, s| unsafe {
        mlx_sys::mlx_distributed_send(res, x.as_ptr(), dst as i32, g, s)
    })
}

/// `mx.distributed.recv_like(x, src)`: what rank `src` sends, shaped and typed like `x`.
pub fn recv_like(x: &Array, src: usize, group: &Group) -> Result<Array> {
    // SAFETY: `x` is a live array for the call.
    collective(group, |res, g, s| unsafe {
        mlx_sys::mlx_distributed_recv_like(res, x.as_ptr(), src as i32, g, s)
    })
}

/// How a job splits the model over its ranks.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum Split {
    /// Every layer split within (mlx-lm's `Model.shard`).
    #[default]
    Tensor,
    /// Whole layers per rank, the activations passed from rank to rank (mlx-lm's
    /// `model.pipeline`).
    Pipeline,
}

static SPLIT: OnceLock<Split> = OnceLock::new();

/// Chooses how this job splits its model (before the model is opened; once).
pub fn set_split(split: Split) {
    let _ = SPLIT.set(split);
}

/// How this job splits its model.
pub fn split() -> Split {
    SPLIT.get().copied().unwrap_or_default()
}

/// mlx-lm's pipeline split of `layers` over `size` ranks: rank r runs `start..end`, where the
/// last rank takes the first layers and rank 0 the last, and the low ranks one extra layer
/// each when they do not divide evenly.
pub fn pipeline_layers(layers: usize, rank: usize, size: usize) -> std::ops::Range<usize> {
    let (base, extra) = (layers / size, layers % size);
    let count = |r: usize| base + usize::from(r < extra);
    let start: usize = (rank + 1..size).map(count).sum();
    start..start + count(rank)
}

fn lost(group: &Group) -> EngineError {
    let why = format!(
        "rank {} lost the other ranks (one stopped or its connection dropped); the job ends",
        group.rank
    );
    mark_broken(why.clone());
    EngineError::Runtime(why)
}

static BROKEN: OnceLock<String> = OnceLock::new();

/// Marks the job broken (a rank lost, or ranks possibly out of step): no more generations run
/// across its ranks, and a server's `/health` says why.
pub fn mark_broken(why: String) {
    let _ = BROKEN.set(why);
}

/// Why the job is broken, if it is.
pub fn broken() -> Option<&'static str> {
    BROKEN.get().map(String::as_str)
}

/// Evaluates a collective, naming the lost ranks if it fails.
fn settled(a: Array, group: &Group) -> Result<Array> {
    let _wait = waiting();
    a.eval().map_err(|_| lost(group))?;
    heard();
    Ok(a)
}

/// Rank 0's bytes on every rank: rank 0 passes `Some(bytes)`, the others `None` (their
/// contribution to the sum is zero). Two collectives: the length, then the bytes.
pub fn share_bytes(group: &Group, bytes: Option<&[u8]>) -> Result<Vec<u8>> {
    let mine = bytes.filter(|_| group.is_leader());
    let len = mine.map_or(0, |b| b.len() as i32);
    let n = settled(all_sum(&Array::from_slice(&[len], &[1]), group)?, group)?;
    let n = n.as_slice::<i32>().first().copied().unwrap_or(0).max(0) as usize;
    if n == 0 {
        return Ok(Vec::new());
    }
    let data = match mine {
        Some(b) if b.len() == n => Array::from_slice(b, &[n as i32]),
        _ => mlx_rs::ops::zeros::<u8>(&[n as i32])?,
    };
    let data = settled(all_sum(&data, group)?, group)?;
    Ok(data.as_dtype(Dtype::Uint8)?.as_slice::<u8>().to_vec())
}

/// Rank 0's decision on every rank (one collective): rank 0 passes `Some(flag)`, the others
/// `None`.
pub fn share_flag(group: &Group, flag: Option<bool>) -> Result<bool> {
    let mine = i32::from(group.is_leader() && flag == Some(true));
    let sum = settled(all_sum(&Array::from_slice(&[mine], &[1]), group)?, group)?;
    Ok(sum.as_slice::<i32>().first().copied().unwrap_or(0) != 0)
}

/// A seed every rank samples with: `seed` when one was given (every rank was given the same),
/// else one rank 0 draws (unseeded ranks would each draw different tokens).
pub fn common_seed(group: &Group, seed: Option<u64>) -> Result<u64> {
    if let Some(seed) = seed {
        return Ok(seed);
    }
    let drawn = fresh_seed().to_le_bytes();
    let shared = share_bytes(group, Some(&drawn))?;
    let bytes: [u8; 8] = shared
        .try_into()
        .map_err(|_| EngineError::Runtime("rank 0 sent a malformed seed".into()))?;
    Ok(u64::from_le_bytes(bytes))
}

/// A seed drawn from the clock and the process id.
pub fn fresh_seed() -> u64 {
    let now = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_nanos() as u64);
    now ^ u64::from(std::process::id()).rotate_left(32)
}

#[cfg(test)]
mod tests {
    use super::pipeline_layers;

    #[test]
    fn pipeline_layers_split_like_mlx_lm() {
        // mlx-lm's PipelineMixin.pipeline: split [base + (r < extra)], rank r after r+1..size.
        assert_eq!(pipeline_layers(24, 0, 2), 12..24);
        assert_eq!(pipeline_layers(24, 1, 2), 0..12);
        assert_eq!(pipeline_layers(7, 0, 3), 4..7);
        assert_eq!(pipeline_layers(7, 1, 3), 2..4);
        assert_eq!(pipeline_layers(7, 2, 3), 0..2);
    }
}
