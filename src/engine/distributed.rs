//! Ranks that cooperate through MLX's own distributed layer (`mlx.distributed`): the process
//! group that `mlx.launch` (or `mlxb launch`) sets up, the collective the sharded layers need
//! (`all_sum`), and rank 0's broadcast of what the other ranks cannot know on their own (a
//! served request, a client's disconnect).
//!
//! mlxb writes no transport: the ring backend (TCP, Linux CPUs and Macs) or MPI come from libmlx,
//! joined through the environment `mlx.launch` sets (`MLX_RANK`, `MLX_HOSTFILE`).

use super::error::{EngineError, Result};
use mlx_rs::{Array, Dtype, Stream};
use std::sync::{Arc, OnceLock};

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
    Ok(WORLD.get_or_init(|| world).clone())
}

/// The job joined by [`join`], if any.
pub fn world() -> Option<Arc<Group>> {
    WORLD.get().cloned().flatten()
}

/// How long a rank waits for the others to connect (`MLXB_JOIN_TIMEOUT` seconds, default 120).
fn join_timeout() -> std::time::Duration {
    let secs = std::env::var("MLXB_JOIN_TIMEOUT")
        .ok()
        .and_then(|s| s.parse::<f64>().ok())
        .filter(|s| *s > 0.0)
        .unwrap_or(120.0);
    std::time::Duration::from_secs_f64(secs)
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

/// `mx.distributed.all_sum(x, group=group)`: every rank gets the element-wise sum of every
/// rank's `x` (lazy, like any MLX op; evaluating it waits for the other ranks).
pub fn all_sum(x: &Array, group: &Group) -> Result<Array> {
    let stream = Stream::thread_local_or_default();
    // SAFETY: `res` is a fresh array handle MLX writes; on failure it is freed here.
    unsafe {
        let mut res = mlx_sys::mlx_array_new();
        let rc = mlx_sys::mlx_distributed_all_sum(&mut res, x.as_ptr(), group.raw, stream.as_ptr());
        if rc != 0 {
            mlx_sys::mlx_array_free(res);
            return Err(lost(group));
        }
        Ok(Array::from_ptr(res))
    }
}

fn lost(group: &Group) -> EngineError {
    EngineError::Runtime(format!(
        "rank {} lost the other ranks (one stopped or its connection dropped); the job ends",
        group.rank
    ))
}

/// Evaluates a collective, naming the lost ranks if it fails.
fn settled(a: Array, group: &Group) -> Result<Array> {
    a.eval().map_err(|_| lost(group))?;
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
