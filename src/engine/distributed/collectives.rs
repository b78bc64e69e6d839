//! The collectives mlxb issues through mlx-c, as lazy MLX arrays, and rank 0's broadcasts of
//! what the other ranks cannot know on their own (a served request, a stop decision, a seed).

use super::watchdog::{heard, waiting};
use super::{mark_broken, Group};
use crate::engine::error::{EngineError, Result};
use mlx_rs::{Array, Dtype, Stream};

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

fn lost(group: &Group) -> EngineError {
    let why = format!(
        "rank {} lost the other ranks (one stopped or its connection dropped); the job ends",
        group.rank
    );
    mark_broken(why.clone());
    EngineError::Runtime(why)
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
