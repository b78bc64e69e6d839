//! The host decode step of llama-style models: under `--perf-kernel on` (L3) small blocks (a
//! decode token, a speculative verify block) run as one [`HostDecoder`] step on the host
//! instead of an MLX graph; under `--host-step on` (L1) blocks of up to eight tokens of a
//! dense f32 or bf16 model do, in MLX's own order.
//!
//! The MLX caches stay the source of truth: the step reads each layer's past keys/values in
//! place from the cache buffers and appends its new ones through `update_and_fetch`, so
//! trimming, snapshots, speculative rollback and prefix reuse work unchanged. Early exit and
//! layer taps (the `self` and DSpark drafters) run here too, so every drafter verifies with
//! the same arithmetic as vanilla decoding. Anything the step does not cover (another cache
//! kind, a batch, a cache of another dtype than the step's) takes the model's MLX path.

use super::{Caches, ForwardOpts};
use crate::engine::cache::{KvCache, StoredKv};
use crate::engine::cache_attention::exact_attention_matches_mlx;
use crate::engine::error::{EngineError, Result};
use crate::engine::kernels::elementwise::narrow_bf16;
use crate::engine::kernels::{HostDecoder, KvBuffers, PastKv, StepOut, StepPlan, MAX_M};
use mlx_rs::{Array, Dtype};
use std::cell::RefCell;

/// A model's host step, built on first use (`None` inside when the model does not qualify), and
/// built again for more positions when a step needs them ([`HostDecoder::positions`]).
#[derive(Default)]
pub struct HostStep {
    decoder: RefCell<Option<Option<HostDecoder>>>,
    /// Per block size, whether the L1 step's products and attention matched MLX's.
    exact_ready: RefCell<Vec<Option<bool>>>,
    /// Per block size, how many blocks of it the L1 step has run (see [`BLOCK_COPIES_AFTER`]).
    blocks_run: RefCell<Vec<usize>>,
}

/// Blocks of one size the L1 step runs before it makes the packed copies such blocks read where
/// a weight has none for one token ([`HostDecoder::make_block_copies`]): writing them costs
/// about what a hundred verify rounds save, so a short speculative generation never pays it and
/// a long one (or a server) soon gets them; `mlxb measure`'s warm-up makes them at once
/// ([`HostStep::prepare_blocks`]).
const BLOCK_COPIES_AFTER: usize = 64;

/// Positions the first build of a step covers; each rebuild doubles past what a step needs.
const FIRST_POSITIONS: usize = 1024;

/// One layer's cache buffers as host slices of the step's `dtype` (f32 or bfloat16), or `None`
/// when the step cannot read them.
fn past_of(stored: StoredKv<'_>, offset: i32, dtype: Dtype) -> Result<Option<PastKv<'_>>> {
    let bf16 = dtype == Dtype::Bfloat16;
    let (k, v) = match stored {
        StoredKv::Unsupported => return Ok(None),
        StoredKv::Empty => {
            let buffers = if bf16 {
                KvBuffers::Bf16 {
                    keys: &[],
                    values: &[],
                }
            } else {
                KvBuffers::F32 {
                    keys: &[],
                    values: &[],
                }
            };
            return Ok(Some(PastKv {
                buffers,
                capacity: 0,
                len: 0,
            }));
        }
        StoredKv::Buffers(k, v) => (k, v),
    };
    if k.dtype() != dtype || v.dtype() != dtype || k.ndim() != 4 {
        return Ok(None);
    }
    if k.shape()[0] != 1 || k.shape() != v.shape() {
        return Ok(None);
    }
    let buffers = if bf16 {
        let (Ok(keys), Ok(values)) = (
            k.try_as_slice::<half::bf16>(),
            v.try_as_slice::<half::bf16>(),
        ) else {
            return Ok(None);
        };
        KvBuffers::Bf16 { keys, values }
    } else {
        let (Ok(keys), Ok(values)) = (k.try_as_slice::<f32>(), v.try_as_slice::<f32>()) else {
            return Ok(None);
        };
        KvBuffers::F32 { keys, values }
    };
    Ok(Some(PastKv {
        buffers,
        capacity: k.shape()[2] as usize,
        len: offset.max(0) as usize,
    }))
}

/// The host step's result before the model's head.
pub enum HostHead {
    /// The block's logits `[1, L, V]` (blocks of at most [`MAX_M`] tokens).
    Logits(Array),
    /// The residual stream after the last layer run `[1, L, D]`, for longer blocks (prompt
    /// chunks): the model applies its final norm and LM head as a lazy MLX graph, which is
    /// never computed when only the cache matters, as in mlx-lm's prefill.
    Hidden(Array),
}

/// What the host step hands back to the model.
pub struct HostOut {
    /// Logits, or the hidden states the model's head still has to map.
    pub head: HostHead,
    /// The requested layer taps `[1, L, D]`, in the order asked.
    pub taps: Vec<Array>,
}

impl HostStep {
    /// Runs `inputs` (`[1, L]`) through the host step, in sub-blocks of at most [`MAX_M`]
    /// tokens, with `opts`' early exit and taps, when the model (`build` makes its
    /// [`HostDecoder`], once) and every cache qualify; `Ok(None)` sends the caller down its
    /// MLX path.
    pub fn run(
        &self,
        build: impl FnOnce(usize) -> Result<Option<HostDecoder>>,
        inputs: &Array,
        caches: &mut Caches,
        opts: &ForwardOpts,
    ) -> Result<Option<HostOut>> {
        let shape = inputs.shape();
        if shape.len() != 2 || shape[0] != 1 || shape[1] < 1 {
            return Ok(None);
        }
        let m = shape[1] as usize;
        let past = caches.first().map_or(0, |c| c.offset().max(0) as usize);
        let needed = past + m;
        let short = match &*self.decoder.borrow() {
            None => true,
            Some(built) => built.as_ref().is_some_and(|d| d.positions() < needed),
        };
        if short {
            let built = build(needed.next_power_of_two().max(FIRST_POSITIONS))?;
            *self.decoder.borrow_mut() = Some(built);
        }
        let held = self.decoder.borrow();
        let Some(decoder) = held.as_ref().and_then(Option::as_ref) else {
            return Ok(None);
        };
        if !decoder.takes(m, past) || !self.ready_for(decoder, m)? {
            return Ok(None);
        }
        if m > 1 && decoder.is_exact() && self.count_block(m) == BLOCK_COPIES_AFTER {
            decoder.make_block_copies(m)?;
        }
        let run = opts.layers_to_run(decoder.layers.len(), decoder.layers.len(), caches.len())?;
        let caches = &mut caches[..run];
        if caches
            .iter()
            .any(|c| matches!(c.stored_kv(), StoredKv::Unsupported))
        {
            return Ok(None);
        }
        let ids = inputs.as_dtype(Dtype::Uint32)?;
        let ids = ids
            .try_as_slice::<u32>()
            .map_err(|e| EngineError::Runtime(format!("cannot read the input ids ({e})")))?
            .to_vec();
        let vocab = decoder.vocab();
        if let Some(bad) = ids.iter().find(|&&t| t as usize >= vocab) {
            return Err(EngineError::Input(format!(
                "token id {bad} is outside the model's vocabulary of {vocab}"
            )));
        }
        let short = ids.len() <= MAX_M;
        let plan = StepPlan {
            layers: run,
            taps: &opts.taps,
            logits: short,
            causal: true,
        };
        let (mut hidden, mut logits) = (Vec::new(), Vec::new());
        let mut taps = vec![Vec::new(); opts.taps.len()];
        for block in ids.chunks(MAX_M) {
            let Some(out) = block_step(decoder, block, caches, plan)? else {
                // Only the first block can bail out (nothing appended yet): every later one
                // reads caches this step itself wrote.
                return Ok(None);
            };
            if short {
                logits = out.logits;
            } else {
                hidden.extend_from_slice(&out.hidden);
            }
            for (all, part) in taps.iter_mut().zip(&out.taps) {
                all.extend_from_slice(part);
            }
        }
        let l = ids.len() as i32;
        let d = decoder.embed.cols() as i32;
        let head = if short {
            HostHead::Logits(host_array(&logits, &[1, l, vocab as i32], decoder))
        } else {
            HostHead::Hidden(host_array(&hidden, &[1, l, d], decoder))
        };
        let taps = taps
            .iter()
            .map(|t| host_array(t, &[1, l, d], decoder))
            .collect();
        Ok(Some(HostOut { head, taps }))
    }

    /// Builds the step (`build`, as [`HostStep::run`] would at its first block) and makes the
    /// checks and packed copies of a one-token block, unless that is done already.
    pub fn prepare(&self, build: impl FnOnce(usize) -> Result<Option<HostDecoder>>) -> Result<()> {
        if self.decoder.borrow().is_none() {
            let built = build(FIRST_POSITIONS)?;
            *self.decoder.borrow_mut() = Some(built);
        }
        let held = self.decoder.borrow();
        if let Some(decoder) = held.as_ref().and_then(Option::as_ref) {
            self.ready_for(decoder, 1)?;
        }
        Ok(())
    }

    /// Makes the packed copies of every block size from 2 to `max_block` the L1 step takes now,
    /// rather than after [`BLOCK_COPIES_AFTER`] blocks (a warm-up before timed speculative
    /// decoding); nothing before the step is prepared ([`HostStep::prepare`]).
    pub fn prepare_blocks(&self, max_block: usize) -> Result<()> {
        let held = self.decoder.borrow();
        let Some(decoder) = held.as_ref().and_then(Option::as_ref) else {
            return Ok(());
        };
        if !decoder.is_exact() {
            return Ok(());
        }
        for m in 2..=max_block.min(MAX_M) {
            if self.ready_for(decoder, m)? {
                decoder.make_block_copies(m)?;
            }
        }
        Ok(())
    }

    /// Counts a block of `m` tokens; how many there were, this one included.
    fn count_block(&self, m: usize) -> usize {
        let mut run = self.blocks_run.borrow_mut();
        if run.len() <= m {
            run.resize(m + 1, 0);
        }
        run[m] += 1;
        run[m]
    }

    /// Whether the step may run a block of `m` tokens: always for the L3 step; for the L1 one
    /// once every product and the attention of `m` tokens matched MLX's (checked at the first
    /// block of that size).
    fn ready_for(&self, decoder: &HostDecoder, m: usize) -> Result<bool> {
        if !decoder.is_exact() {
            return Ok(true);
        }
        if let Some(Some(known)) = self.exact_ready.borrow().get(m) {
            return Ok(*known);
        }
        let ready = decoder.exact_ready(m)?
            && exact_attention_matches_mlx(decoder.heads, m, decoder.dtype())?;
        let mut known = self.exact_ready.borrow_mut();
        if known.len() <= m {
            known.resize(m + 1, None);
        }
        known[m] = Some(ready);
        Ok(ready)
    }
}

/// The step's values as an MLX array of the model's activation dtype (a bfloat16 step's values
/// are bfloat16 already, held widened: narrowing them is exact).
fn host_array(values: &[f32], shape: &[i32], decoder: &HostDecoder) -> Array {
    match decoder.dtype() {
        Dtype::Bfloat16 => Array::from_slice(&narrow_bf16(values), shape),
        _ => Array::from_slice(values, shape),
    }
}

/// One block through the decoder, its keys/values appended to the caches and materialized.
/// `Ok(None)` when a cache cannot be read in place.
fn block_step(
    decoder: &HostDecoder,
    ids: &[u32],
    caches: &mut [Box<dyn KvCache>],
    plan: StepPlan<'_>,
) -> Result<Option<StepOut>> {
    let out = {
        let mut past = Vec::with_capacity(caches.len());
        for c in caches.iter() {
            match past_of(c.stored_kv(), c.offset(), decoder.dtype())? {
                Some(p) => past.push(p),
                None => return Ok(None),
            }
        }
        decoder.step(ids, &past, plan)?
    };
    let heads = decoder.heads;
    let kv_shape = [
        1,
        heads.n_kv_heads as i32,
        ids.len() as i32,
        heads.head_dim as i32,
    ];
    let mut state = Vec::new();
    for ((cache, k), v) in caches.iter_mut().zip(&out.keys).zip(&out.values) {
        // Written into the buffers directly where the cache allows it: an MLX append costs
        // ~25 µs a layer, mostly dispatch (10-15 % of a 4-bit step).
        if cache.append_in_place(k, v, ids.len())? {
            continue;
        }
        let (k, v) = (
            host_array(k, &kv_shape, decoder),
            host_array(v, &kv_shape, decoder),
        );
        cache.update_and_fetch(&k, &v)?;
        state.extend(cache.state());
    }
    // Materialize the appended buffers now, so the next block reads them in place.
    if !state.is_empty() {
        mlx_rs::transforms::eval(&state)?;
    }
    Ok(Some(out))
}
