//! Serving across ranks: rank 0 takes the HTTP requests and the other ranks run the same
//! generations in step with it, each over its shard of the model. Rank 0 sends each request's
//! prompt and settings before its generation (an [`Order`]) and, after every token, whether the
//! generation goes on (a client that went away, a stop string): what the other ranks cannot
//! know by themselves. Everything else (sampling with the shared seed, EOS, the token budget,
//! the prompt-prefix cache) they compute identically. Requests decode one at a time, as
//! mlx-lm's server does across ranks.

use crate::engine::distributed::{fresh_seed, share_bytes, share_flag, Group};
use crate::engine::error::{EngineError, Result};
use crate::engine::generate::Flow;
use crate::engine::text::{TextEvent, TextParams};
use serde::{Deserialize, Serialize};

/// One generation rank 0 is about to run.
#[derive(Debug, Serialize, Deserialize)]
pub struct Order {
    /// The prompt, tokenized.
    pub prompt_ids: Vec<u32>,
    /// Sampling settings, with the seed every rank uses.
    pub params: TextParams,
}

/// `params` with a seed every rank can use: the request's own, or one rank 0 draws (ranks
/// must sample the same tokens; an unseeded generation would draw differently on each).
pub fn seeded(params: &TextParams) -> TextParams {
    let mut params = params.clone();
    params.seed = params.seed.or_else(|| Some(fresh_seed()));
    params
}

/// Rank 0: sends the next generation to the other ranks.
pub fn send(group: &Group, order: &Order) -> Result<()> {
    let bytes = serde_json::to_vec(order)
        .map_err(|e| EngineError::Runtime(format!("encoding a request for the ranks: {e}")))?;
    share_bytes(group, Some(&bytes)).map(drop)
}

/// Rank 0: tells the other ranks that no more generations come (the server is stopping).
pub fn send_end(group: &Group) -> Result<()> {
    share_bytes(group, Some(&[])).map(drop)
}

/// What rank 0 sends while it has no request, so that the other ranks know it is alive.
const KEEP_ALIVE: &[u8] = b"alive";

/// Rank 0, idle: tells the other ranks it is still there (see [`keep_alive_every`]).
pub fn send_keep_alive(group: &Group) -> Result<()> {
    share_bytes(group, Some(KEEP_ALIVE)).map(drop)
}

/// How often an idle rank 0 sends [`send_keep_alive`]: well within the other ranks' limit on
/// silence.
pub fn keep_alive_every() -> std::time::Duration {
    crate::engine::distributed::silence_limit() / 4
}

/// The other ranks: waits for rank 0's next generation; `None` once the server stops.
pub fn receive(group: &Group) -> Result<Option<Order>> {
    let mut bytes = share_bytes(group, None)?;
    while bytes == KEEP_ALIVE {
        bytes = share_bytes(group, None)?;
    }
    if bytes.is_empty() {
        return Ok(None);
    }
    serde_json::from_slice(&bytes)
        .map(Some)
        .map_err(|e| EngineError::Runtime(format!("rank 0 sent an unreadable request: {e}")))
}

/// Rank 0's token callback: runs `on_event`, then tells the other ranks whether the
/// generation goes on (they stop where rank 0 stops, for whatever reason it stops).
pub fn leading<'a>(
    group: Option<&'a Group>,
    mut on_event: impl FnMut(TextEvent<'_>) -> Result<Flow> + 'a,
) -> impl FnMut(TextEvent<'_>) -> Result<Flow> + 'a {
    move |event| {
        let flow = on_event(event);
        if let Some(group) = group {
            share_flag(group, Some(!matches!(flow, Ok(Flow::Continue))))?;
        }
        flow
    }
}

/// The other ranks' token callback: rank 0's decision.
pub fn following(group: &Group) -> Result<Flow> {
    Ok(if share_flag(group, None)? {
        Flow::Stop
    } else {
        Flow::Continue
    })
}
