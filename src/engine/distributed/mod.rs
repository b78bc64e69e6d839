//! Ranks that cooperate through MLX's own distributed layer (`mlx.distributed`): the process
//! group that `mlx.launch` (or `mlxb launch`) sets up, the collective the sharded layers need
//! (`all_sum`), and rank 0's broadcast of what the other ranks cannot know on their own (a
//! served request, a client's disconnect).
//!
//! mlxb writes no transport: the ring backend (TCP, Linux CPUs and Macs) or MPI come from libmlx,
//! joined through the environment `mlx.launch` sets (`MLX_RANK`, `MLX_HOSTFILE`).
//!
//! - `collectives`: `all_sum`, `all_gather`, `send`/`recv_like` as lazy MLX ops, and rank 0's
//!   broadcasts (bytes, a flag, a seed);
//! - `watchdog`: a rank that hears nothing from the others for too long ends the job.

mod collectives;
mod watchdog;

pub use collectives::{
    all_gather, all_sum, common_seed, fresh_seed, recv_like, send, share_bytes, share_flag,
};
pub use watchdog::{heard, silence_limit, waiting, Waiting};

use super::error::{EngineError, Result};
use std::sync::{Arc, OnceLock};
use std::time::Duration;

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
        watchdog::start(group.rank, silence_limit());
    }
    Ok(WORLD.get_or_init(|| world).clone())
}

/// The job joined by [`join`], if any.
pub fn world() -> Option<Arc<Group>> {
    WORLD.get().cloned().flatten()
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

/// The ring hostfile's addresses, per rank (for messages).
fn ring_addresses() -> Option<Vec<Vec<String>>> {
    std::env::var_os(HOSTFILE_ENV)
        .and_then(|p| std::fs::read_to_string(p).ok())
        .and_then(|t| serde_json::from_str(&t).ok())
}

/// This rank's own addresses, from the ring hostfile (for messages).
fn own_address() -> Option<String> {
    let me: usize = std::env::var(RANK_ENV).ok()?.parse().ok()?;
    Some(ring_addresses()?.get(me)?.join(", "))
}

/// The other ranks' addresses, from the ring hostfile (for messages).
fn other_ranks() -> String {
    let me: Option<usize> = std::env::var(RANK_ENV).ok().and_then(|r| r.parse().ok());
    match ring_addresses() {
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
    // This is a process's first MLX call: without mlx-rs's handler, MLX's default one would
    // print a failure (a port in use) to stdout and exit with 255.
    mlx_rs::error::install_error_handler();
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
        let rank = std::env::var(RANK_ENV).unwrap_or_default();
        let cause = mlx_rs::error::take_last_error().unwrap_or_default();
        if cause.contains("Couldn't bind socket") {
            return Err(EngineError::Input(format!(
                "rank {rank} could not listen on {}: the port is taken by another program or \
                 job; start the job on other ports (`--starting-port` of `mlxb launch` or \
                 `mlx.launch`)",
                own_address().unwrap_or_else(|| "its address".to_owned())
            )));
        }
        let cause = match cause.trim() {
            "" => String::new(),
            c => format!(" ({c})"),
        };
        return Err(EngineError::Input(format!(
            "rank {rank} could not join the other ranks {where_}{cause}; start every rank with \
             `mlxb launch` or `mlx.launch` and check that each host's address in the hostfile is \
             reachable"
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

fn seconds_from_env(name: &str, default: f64) -> Duration {
    let secs = std::env::var(name)
        .ok()
        .and_then(|s| s.parse::<f64>().ok())
        .filter(|s| *s > 0.0)
        .unwrap_or(default);
    Duration::from_secs_f64(secs)
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
