//! Many sequences decoded together: mlx-lm 0.32.2's `BatchGenerator` (continuous batching).
//! Requests wait in a queue, are prefilled together (up to `prefill_batch_size` at a time,
//! right-padded, in chunks of `prefill_step_size`), then join the decoding batch, where one
//! forward of B rows produces one token for each; a finished sequence leaves the batch after
//! the step that was already queued with it. Every step is mlx-lm's in its order (which rows a
//! forward holds and how long its cache buffer is both change the bits), so batched greedy ids
//! and logprobs equal `mlx_lm.generate.batch_generate`'s for the same prompts and settings.
//!
//! Every cache kind mlx-lm batches has its batched form here (full attention: `BatchKVCache`;
//! sliding window: `BatchRotatingKVCache`; recurrent: `ArraysCache` with its padding mask);
//! quantized KV caches, which mlx-lm cannot batch, are refused with the reason.
//!
//! A speculative batch ([`BatchGenerator::speculative`]) hands out each token as soon as it is
//! sampled and, at each decoding step, verifies the blocks its caller drafted per row
//! (`batch_verify`): a row then gains between 1 and k + 1 tokens per step, on every cache kind
//! that batches.

use super::batch_verify::{
    block, checkpoint, confirmed, padded_input, replay_kept, restore, rewind_rows, rows_can_rewind,
    Verified,
};
use super::cache::{BatchKvCache, BatchRows, CacheSnapshot, KvCache};
use super::error::{EngineError, Result};
use super::models::{Caches, ForwardOpts, LanguageModel};
use super::plan::ForkPlan;
use super::sample::Sampler;
use super::text::FinishReason;
use mlx_rs::ops::indexing::IndexOp;
use mlx_rs::transforms::{async_eval, eval};
use mlx_rs::{memory, ops, Array};
use std::collections::{HashMap, VecDeque};

/// How requests are grouped (mlx-lm's `BatchGenerator` arguments, with its defaults).
#[derive(Debug, Clone, Copy)]
pub struct BatchSettings {
    /// Most sequences decoded at once (`completion_batch_size`, default 32).
    pub completion_batch_size: usize,
    /// Most sequences prefilled at once (`prefill_batch_size`, default 8).
    pub prefill_batch_size: usize,
    /// Prompt tokens per sequence per prefill forward (`prefill_step_size`, default 2048).
    pub prefill_step_size: usize,
}

impl Default for BatchSettings {
    fn default() -> Self {
        Self {
            completion_batch_size: 32,
            prefill_batch_size: 8,
            prefill_step_size: 2048,
        }
    }
}

/// One token of one sequence from [`BatchGenerator::next_tokens`].
pub struct BatchToken {
    /// The sequence ([`BatchGenerator::insert`]'s id).
    pub uid: usize,
    /// The sampled token.
    pub token: u32,
    /// Full-vocabulary logprobs `[V]` it was sampled from.
    pub logprobs: Array,
    /// Set on the sequence's last token: [`FinishReason::Eos`] when it is a stop token
    /// (`batch_generate` then leaves it out of the text), [`FinishReason::Length`] when the
    /// budget ran out.
    pub finish: Option<FinishReason>,
}

/// One sequence to generate.
pub struct SequenceRequest {
    /// Its prompt ids (at least one).
    pub prompt: Vec<u32>,
    /// Its token budget (at least one).
    pub max_tokens: usize,
    /// Its own sampler; `None` samples with the generator's (rows that all use it are sampled
    /// in one call, as mlx-lm does for a batch that shares a sampler).
    pub sampler: Option<Sampler>,
    /// Keys and values already computed for the prompt's first tokens (mlx-lm's `insert(...,
    /// caches=...)`): only the rest is prefilled. Shorter than the prompt.
    pub prefix: Option<PrefixKv>,
}

impl SequenceRequest {
    /// A request sampled with the generator's sampler.
    pub fn new(prompt: Vec<u32>, max_tokens: usize) -> Self {
        Self {
            prompt,
            max_tokens,
            sampler: None,
            prefix: None,
        }
    }
}

/// The keys and values of a prompt's first `len` tokens, per layer `[1, H, len, D]` (every layer
/// a full-attention one).
#[derive(Clone)]
pub struct PrefixKv {
    /// Positions held.
    pub len: usize,
    /// Per layer: keys and values.
    pub layers: Vec<(Array, Array)>,
}

impl PrefixKv {
    /// Bytes its arrays hold.
    pub fn nbytes(&self) -> usize {
        self.layers
            .iter()
            .map(|(k, v)| k.nbytes() + v.nbytes())
            .sum()
    }

    /// Its first `len` positions.
    pub fn truncated(&self, len: usize) -> PrefixKv {
        let n = len.min(self.len) as i32;
        let cut = |a: &Array| a.index((.., .., ..n, ..));
        PrefixKv {
            len: n as usize,
            layers: self.layers.iter().map(|(k, v)| (cut(k), cut(v))).collect(),
        }
    }
}

/// A request's prompt still to be prefilled: segments in order, the last one its final token.
struct Prefill {
    uid: usize,
    segments: VecDeque<Vec<u32>>,
    max_tokens: usize,
    sampler: Option<Sampler>,
    /// What it starts from, taken when it joins the prompt batch.
    prefix: Option<PrefixKv>,
    /// Whether every prefill forward it took part in held it alone (then its keys and values
    /// are bit-identical to a single-stream prefill's).
    alone: bool,
    /// Positions in its cache (its reused prefix, then the prefilled chunks).
    cached: usize,
    /// Tapped outputs of its prefill forwards (see [`BatchGenerator::tapping`]).
    tapped: Vec<TappedRows>,
}

/// A sequence in the decoding batch.
struct Decoding {
    uid: usize,
    max_tokens: usize,
    produced: usize,
    sampler: Option<Sampler>,
    /// Whether its queued token was already handed out (by a verify step, which hands out
    /// every token it samples); a plain step then feeds it without handing it out again.
    anchor_out: bool,
    /// Positions in its cache: the queued token goes in at this position.
    cached: usize,
    /// Tapped outputs of its forwards not yet given to a proposer.
    tapped: Vec<TappedRows>,
}

/// The target's outputs at the tapped layers for consecutive positions of one sequence: what a
/// drafter conditioned on the target's hidden states (DSpark) reads.
#[derive(Debug, Clone)]
pub struct TappedRows {
    /// Position of the first row in the sequence.
    pub first_position: usize,
    /// Per tapped layer, in the order asked for: `[1, L, D]`.
    pub layers: Vec<Array>,
}

/// A decoding sequence as a drafter sees it (see [`BatchGenerator::decoding_rows`]).
#[derive(Debug, Clone)]
pub struct DecodingRow {
    /// The sequence.
    pub uid: usize,
    /// Tokens it may still hand out.
    pub room: usize,
    /// Whether its next token is sampled but not handed out yet: a draft for it then starts
    /// with that token (`next`, when it has been read) or a guess of it (kept only when the
    /// guess is right).
    pub next_pending: bool,
    /// The pending token, once read (it comes out in this call's tokens).
    pub next: Option<u32>,
    /// The tapped outputs of its positions forwarded since the previous proposal (prompt
    /// included; rejected verify positions too, which a later round's tokens replace); empty
    /// unless the generator taps layers.
    pub tapped: Vec<TappedRows>,
    /// Positions in its cache (its next fed token goes in at this position).
    pub cached: usize,
    /// Per target layer, its keys and values as its own cache would hold them (`[1, H, n,
    /// D]`, ending at position `cached`) for the layers lent to drafters
    /// ([`BatchGenerator::lending_kv`]), `None` elsewhere; empty unless some are lent.
    pub kv: Vec<Option<(Array, Array)>>,
}

/// What proposes the drafts of a speculative batch's step: given the decoding rows, the ids
/// proposed to follow each row's last handed-out token, by sequence id. It may be asked twice
/// in one step: first with pending tokens unread (a draft then guesses them), and, when some
/// row offers a draft, again once they are read.
pub type Proposer<'a> =
    dyn FnMut(&[DecodingRow], &mut dyn LanguageModel) -> Result<HashMap<usize, Vec<u32>>> + 'a;

/// A verify forward's results, for [`BatchGenerator::accept_blocks`]: each row's block, the
/// token sampled at each position (row-major, `width` per row), the logprobs `[rows, width,
/// V]`, and the caches as they were before it when rows cannot drop positions in place.
struct VerifiedBlocks<'a> {
    blocks: &'a [Vec<u32>],
    picks: &'a [u32],
    logprobs: &'a Array,
    width: usize,
    before: Option<Vec<CacheSnapshot>>,
}

/// Rows being prefilled together, with their batched caches (empty when there are no rows).
#[derive(Default)]
struct PromptBatch {
    rows: Vec<Prefill>,
    caches: Caches,
}

/// Rows decoding together: the step queued for them (`next_tokens`, `next_logprobs`) and their
/// caches.
#[derive(Default)]
struct DecodeBatch {
    rows: Vec<Decoding>,
    caches: Caches,
    next_tokens: Option<Array>,
    next_logprobs: Option<Array>,
}

impl DecodeBatch {
    /// Keeps rows `keep`, in that order (caches and queued step included).
    fn keep(&mut self, keep: &[usize]) -> Result<()> {
        let mut rows: Vec<Option<Decoding>> = std::mem::take(&mut self.rows)
            .into_iter()
            .map(Some)
            .collect();
        self.rows = keep.iter().filter_map(|&i| rows[i].take()).collect();
        filter_caches(&mut self.caches, keep)?;
        self.next_tokens = take_rows(&self.next_tokens, keep)?;
        self.next_logprobs = take_rows(&self.next_logprobs, keep)?;
        Ok(())
    }

    /// The queued step's tokens (evaluated) and logprobs `[B, V]`.
    fn queued(&self) -> Result<(Vec<u32>, Array)> {
        match (&self.next_tokens, &self.next_logprobs) {
            (Some(t), Some(lp)) => {
                eval([t, lp])?;
                Ok((read_ids(t)?, lp.clone()))
            }
            _ => Err(EngineError::Runtime(
                "a decoding batch has no queued step".into(),
            )),
        }
    }
}

/// Token ids of an evaluated `[n]` array.
fn read_ids(tokens: &Array) -> Result<Vec<u32>> {
    let ids = tokens.as_dtype(mlx_rs::Dtype::Uint32)?;
    Ok(ids
        .try_as_slice::<u32>()
        .map_err(|e| EngineError::Runtime(format!("cannot read the sampled tokens ({e})")))?
        .to_vec())
}

/// Continuous batching over one model (see the module docs). The model is lent to each call
/// rather than held, so its owner can run other work between steps (the server's unbatched
/// requests).
pub struct BatchGenerator {
    sampler: Sampler,
    stop_tokens: Vec<u32>,
    settings: BatchSettings,
    plan: ForkPlan,
    next_uid: usize,
    queue: VecDeque<Prefill>,
    prompt: PromptBatch,
    decode: DecodeBatch,
    steps: usize,
    /// Whether prompts prefilled alone are kept for [`BatchGenerator::take_prefixes`].
    capture: bool,
    captured: Vec<(usize, PrefixKv)>,
    /// Whether decoding steps verify drafted blocks (tokens handed out as soon as sampled).
    speculative: bool,
    /// Whether a verify step's rejected positions are dropped in place (every layer full
    /// attention) rather than by restoring the caches and replaying the kept tokens.
    rewind_in_place: bool,
    verified: Vec<Verified>,
    /// Decoding forwards (plain or verify) run so far.
    decode_forwards: usize,
    /// Rounds that did prompt work (a prefill chunk, or sequences starting to decode) so far.
    prompt_rounds: usize,
    /// Layers whose outputs every forward hands to the rows it ran (see
    /// [`BatchGenerator::tapping`]).
    taps: Vec<usize>,
    /// Layers whose keys and values each proposal sees per row (see
    /// [`BatchGenerator::lending_kv`]).
    lent: Vec<usize>,
}

/// One forward of `input` `[B, W]` on `caches`; with `taps`, also each row's outputs at those
/// layers for its first `lens[i]` positions, which start at position `starts[i]`.
fn forward_tapped(
    model: &mut dyn LanguageModel,
    input: &Array,
    caches: &mut Caches,
    taps: &[usize],
    rows: &[(usize, usize)],
) -> Result<(Array, Vec<Option<TappedRows>>)> {
    if taps.is_empty() {
        return Ok((model.forward(input, caches)?, vec![None; rows.len()]));
    }
    let opts = ForwardOpts {
        exit_after: None,
        taps: taps.to_vec(),
    };
    let out = model.forward_ext(input, caches, &opts)?;
    let tapped = rows
        .iter()
        .enumerate()
        .map(|(i, &(start, len))| {
            (len > 0).then(|| TappedRows {
                first_position: start,
                layers: out
                    .taps
                    .iter()
                    .map(|t| t.index((i as i32..i as i32 + 1, ..len as i32, ..)))
                    .collect(),
            })
        })
        .collect();
    Ok((out.logits, tapped))
}

/// One layer's keys and values, a pair per row.
type LayerRows = Vec<(Array, Array)>;

/// Per layer, each row's keys and values at the layers in `layers` (`None` at every other
/// layer).
fn lent_kv(caches: &mut Caches, layers: &[usize]) -> Result<Vec<Option<LayerRows>>> {
    caches
        .iter_mut()
        .enumerate()
        .map(|(l, c)| match c.as_batch_mut() {
            Some(b) if layers.contains(&l) => b.rows_kv(),
            _ => Ok(None),
        })
        .collect()
}

/// Per-layer batched caches, all rows empty.
fn fresh_caches(model: &dyn LanguageModel, plan: &ForkPlan, rows: usize) -> Result<Caches> {
    let mut caches = model
        .make_caches()
        .iter()
        .map(|c| c.empty_batch(rows))
        .collect::<Option<Caches>>()
        .ok_or_else(|| {
            EngineError::Input(
                "this model has layers whose caches have no batched form; use --max-batch 1".into(),
            )
        })?;
    plan.prepare(&mut caches);
    Ok(caches)
}

/// mlx-lm's `BatchKVCache.merge` of per-row caches: rows with a prefix hold it, left-padded to
/// the longest; rows without one start empty.
fn merged_caches(plan: &ForkPlan, prefixes: &[Option<PrefixKv>]) -> Result<Caches> {
    let layers = prefixes
        .iter()
        .flatten()
        .map(|p| p.layers.len())
        .next()
        .unwrap_or(0);
    let mut caches: Caches = (0..layers)
        .map(|l| -> Result<Box<dyn KvCache>> {
            let rows: Vec<Option<&(Array, Array)>> = prefixes
                .iter()
                .map(|p| p.as_ref().and_then(|p| p.layers.get(l)))
                .collect();
            Ok(Box::new(BatchKvCache::merge(&rows)?))
        })
        .collect::<Result<_>>()?;
    plan.prepare(&mut caches);
    Ok(caches)
}

/// Row `row`'s keys and values when every layer is full attention (`None` otherwise).
fn row_prefix(caches: &mut Caches, row: usize) -> Result<Option<PrefixKv>> {
    let mut layers = Vec::with_capacity(caches.len());
    for c in caches.iter_mut() {
        let full = c
            .as_batch_mut()
            .and_then(|b| b.as_any_mut().downcast_mut::<BatchKvCache>());
        match full.map(|b| b.extract(row)).transpose()?.flatten() {
            Some(kv) => layers.push(kv),
            None => return Ok(None),
        }
    }
    let len = layers.first().map_or(0, |(k, _)| k.shape()[2] as usize);
    Ok((len > 0).then_some(PrefixKv { len, layers }))
}

fn batch_of(cache: &mut dyn KvCache) -> Result<&mut dyn BatchRows> {
    cache
        .as_batch_mut()
        .ok_or_else(|| EngineError::Runtime("a batched step met an unbatched cache".into()))
}

/// mlx-lm's `_extend_cache`: appends `other`'s rows to `caches` layer by layer.
fn extend_caches(caches: &mut Caches, other: Caches) -> Result<()> {
    if caches.is_empty() {
        *caches = other;
        return Ok(());
    }
    for (mine, mut theirs) in caches.iter_mut().zip(other) {
        batch_of(mine.as_mut())?.extend(batch_of(theirs.as_mut())?)?;
    }
    Ok(())
}

/// Keeps rows `keep` of every layer (no rows: no caches).
fn filter_caches(caches: &mut Caches, keep: &[usize]) -> Result<()> {
    if keep.is_empty() {
        caches.clear();
        return Ok(());
    }
    for c in caches.iter_mut() {
        batch_of(c.as_mut())?.filter(keep)?;
    }
    Ok(())
}

fn take_rows(a: &Option<Array>, keep: &[usize]) -> Result<Option<Array>> {
    if keep.is_empty() {
        return Ok(None);
    }
    let idx: Vec<i32> = keep.iter().map(|&i| i as i32).collect();
    let rows = Array::from_slice(&idx, &[idx.len() as i32]);
    Ok(match a {
        Some(a) => Some(a.take_axis(&rows, 0)?),
        None => None,
    })
}

fn concat_rows(a: Option<Array>, b: Option<Array>) -> Result<Option<Array>> {
    Ok(match (a, b) {
        (Some(a), Some(b)) => Some(ops::concatenate(&[a, b], 0)?),
        (a, b) => a.or(b),
    })
}

fn eval_caches(caches: &Caches) -> Result<()> {
    let state: Vec<Array> = caches.iter().flat_map(|c| c.state()).collect();
    eval(&state)?;
    Ok(())
}

impl BatchGenerator {
    /// A generator over `model` sampling every row with `sampler`, ending a sequence at any of
    /// `stop_tokens`. Refuses models whose caches cannot batch and plans that quantize the KV
    /// cache (neither has a batched form in mlx-lm).
    pub fn new(
        model: &dyn LanguageModel,
        plan: &ForkPlan,
        sampler: Sampler,
        stop_tokens: Vec<u32>,
        settings: BatchSettings,
    ) -> Result<Self> {
        fresh_caches(model, plan, 0)?;
        if plan.kv_bits.iter().any(Option::is_some) {
            return Err(EngineError::Input(
                "--kv-quant has no batched form (mlx-lm's BatchKVCache has no to_quantized); use --kv-quant off or --max-batch 1".into(),
            ));
        }
        let settings = BatchSettings {
            completion_batch_size: settings
                .completion_batch_size
                .max(settings.prefill_batch_size)
                .max(1),
            prefill_batch_size: settings.prefill_batch_size.max(1),
            prefill_step_size: settings.prefill_step_size.max(1),
        };
        Ok(Self {
            sampler,
            stop_tokens,
            settings,
            plan: plan.clone(),
            next_uid: 0,
            queue: VecDeque::new(),
            prompt: PromptBatch::default(),
            decode: DecodeBatch::default(),
            steps: 0,
            capture: false,
            captured: Vec::new(),
            speculative: false,
            rewind_in_place: true,
            verified: Vec::new(),
            decode_forwards: 0,
            prompt_rounds: 0,
            taps: Vec::new(),
            lent: Vec::new(),
        })
    }

    /// Hands the outputs of target layers `layers` for every position a forward runs to that
    /// sequence's next proposal ([`DecodingRow::tapped`]): for drafters that read the target's
    /// hidden states. The logits are those of the untapped forward.
    pub fn tapping(mut self, layers: Vec<usize>) -> Self {
        self.taps = layers;
        self
    }

    /// Makes every decoding step a verify step for the blocks given to
    /// [`BatchGenerator::next_tokens_drafted`], each token handed out as soon as it is sampled.
    /// Rows drop their rejected positions in place when every layer is full attention, else by
    /// a second forward (see `batch_verify`).
    pub fn speculative(mut self, model: &dyn LanguageModel) -> Result<Self> {
        self.rewind_in_place = rows_can_rewind(&mut fresh_caches(model, &self.plan, 1)?);
        self.speculative = true;
        Ok(self)
    }

    /// The decoding sequences, in batch order.
    pub fn decoding_rows(&self) -> Vec<DecodingRow> {
        self.decode
            .rows
            .iter()
            .map(|r| DecodingRow {
                uid: r.uid,
                room: r.max_tokens.saturating_sub(r.produced),
                next_pending: !r.anchor_out,
                next: None,
                tapped: Vec::new(),
                cached: r.cached,
                kv: Vec::new(),
            })
            .collect()
    }

    /// [`BatchGenerator::decoding_rows`] with the tapped outputs each row has gathered since
    /// they were last handed out, and its lent keys and values.
    fn rows_to_propose(&mut self) -> Result<Vec<DecodingRow>> {
        let mut rows = self.decoding_rows();
        for (row, r) in rows.iter_mut().zip(self.decode.rows.iter_mut()) {
            row.tapped = std::mem::take(&mut r.tapped);
        }
        if !self.lent.is_empty() {
            let layers = lent_kv(&mut self.decode.caches, &self.lent)?;
            for (i, row) in rows.iter_mut().enumerate() {
                row.kv = layers
                    .iter()
                    .map(|rows| rows.as_ref().map(|r| r[i].clone()))
                    .collect();
            }
        }
        Ok(rows)
    }

    /// Hands each decoding row's keys and values at target layers `layers` to its proposals
    /// ([`DecodingRow::kv`]): for drafters that attend the target's keys (the Gemma 4
    /// assistant).
    pub fn lending_kv(mut self, layers: Vec<usize>) -> Self {
        self.lent = layers;
        self
    }

    /// Seconds one forward of `rows` sequences × `width` tokens takes on this machine, for
    /// each width `1..=max_width`, after a 16-token context: the better of two, run on caches
    /// of its own (a draft-length policy's cost table).
    pub fn forward_seconds(
        &self,
        model: &mut dyn LanguageModel,
        rows: usize,
        max_width: usize,
    ) -> Result<Vec<f64>> {
        let mut caches = fresh_caches(model, &self.plan, rows)?;
        let context = ops::zeros::<i32>(&[rows as i32, 16])?;
        model.forward(&context, &mut caches)?;
        eval_caches(&caches)?;
        let mut seconds = Vec::with_capacity(max_width);
        for width in 1..=max_width {
            let mut best = f64::INFINITY;
            for _ in 0..2 {
                let block = ops::zeros::<i32>(&[rows as i32, width as i32])?;
                // Put back after: a ring or recurrent state cannot be trimmed.
                let before = checkpoint(&caches);
                let started = std::time::Instant::now();
                let logits = model.forward(&block, &mut caches)?;
                let logprobs = logits.subtract(logits.logsumexp_axis(-1, true)?)?;
                eval([&logprobs])?;
                best = best.min(started.elapsed().as_secs_f64());
                restore(&mut caches, before)?;
            }
            seconds.push(best);
        }
        Ok(seconds)
    }

    /// Decoding forwards (plain or verify) run so far: a call that hands out tokens may have
    /// run two (a plain step after a verify step hands out nothing itself).
    pub fn decode_forwards(&self) -> usize {
        self.decode_forwards
    }

    /// Rounds that did prompt work so far (a step's wall time then includes a prefill).
    pub fn prompt_rounds(&self) -> usize {
        self.prompt_rounds
    }

    /// What the verify steps since the last call did, per row and step.
    pub fn take_verified(&mut self) -> Vec<Verified> {
        std::mem::take(&mut self.verified)
    }

    /// Keeps the keys and values of every prompt prefilled alone (all but its last token) for
    /// [`BatchGenerator::take_prefixes`]: a server's reusable prefixes. Only for models whose
    /// every layer is full attention (others keep nothing).
    pub fn capture_prefixes(mut self) -> Self {
        self.capture = true;
        self
    }

    /// The prefixes kept since the last call, by sequence id.
    pub fn take_prefixes(&mut self) -> Vec<(usize, PrefixKv)> {
        std::mem::take(&mut self.captured)
    }

    /// Queues the sequences in order; returns their ids.
    pub fn insert(&mut self, requests: Vec<SequenceRequest>) -> Result<Vec<usize>> {
        if let Some(i) = requests.iter().position(|r| r.prompt.is_empty()) {
            return Err(EngineError::Input(format!(
                "prompt {i} is empty; give at least one token"
            )));
        }
        if let Some(i) = requests.iter().position(|r| r.max_tokens == 0) {
            return Err(EngineError::Input(format!(
                "prompt {i} has a token budget of 0; give at least 1"
            )));
        }
        if let Some(i) = requests
            .iter()
            .position(|r| r.prefix.as_ref().is_some_and(|p| p.len >= r.prompt.len()))
        {
            return Err(EngineError::Input(format!(
                "prompt {i} has a reused prefix as long as itself; at least its last token must be computed"
            )));
        }
        let mut uids = Vec::with_capacity(requests.len());
        for request in requests {
            let skip = request.prefix.as_ref().map_or(0, |p| p.len);
            let (last, head) = request.prompt[skip..].split_last().unwrap_or((&0, &[]));
            let mut segments = VecDeque::new();
            if !head.is_empty() {
                segments.push_back(head.to_vec());
            }
            segments.push_back(vec![*last]);
            let uid = self.next_uid;
            self.next_uid += 1;
            self.queue.push_back(Prefill {
                uid,
                segments,
                max_tokens: request.max_tokens,
                sampler: request.sampler,
                prefix: request.prefix,
                alone: true,
                cached: skip,
                tapped: Vec::new(),
            });
            uids.push(uid);
        }
        Ok(uids)
    }

    /// Drops sequences wherever they are (queued, prefilling or decoding): a cancelled request.
    pub fn remove(&mut self, uids: &[usize]) -> Result<()> {
        self.queue.retain(|p| !uids.contains(&p.uid));
        let keep: Vec<usize> = (0..self.prompt.rows.len())
            .filter(|&i| !uids.contains(&self.prompt.rows[i].uid))
            .collect();
        if keep.len() < self.prompt.rows.len() {
            self.filter_prompt(&keep)?;
        }
        let keep: Vec<usize> = (0..self.decode.rows.len())
            .filter(|&i| !uids.contains(&self.decode.rows[i].uid))
            .collect();
        if keep.len() < self.decode.rows.len() {
            self.decode.keep(&keep)?;
        }
        Ok(())
    }

    /// Sequences queued, prefilling or decoding.
    pub fn active(&self) -> usize {
        self.queue.len() + self.prompt.rows.len() + self.decode.rows.len()
    }

    /// Sequences in the decoding batch.
    pub fn decoding(&self) -> usize {
        self.decode.rows.len()
    }

    /// The next tokens (one per decoding sequence), running prefills as needed (mlx-lm's
    /// `next_generated`); empty once nothing is left.
    pub fn next_tokens(&mut self, model: &mut dyn LanguageModel) -> Result<Vec<BatchToken>> {
        self.next_tokens_drafted(model, &mut |_, _| Ok(HashMap::new()))
    }

    /// [`BatchGenerator::next_tokens`] where, in a speculative batch, the decoding step verifies
    /// what `propose` drafts (see [`Proposer`]). A step without any usable draft is a plain,
    /// pipelined decoding step. A row's tokens come in order, several per call when drafts are
    /// kept.
    pub fn next_tokens_drafted(
        &mut self,
        model: &mut dyn LanguageModel,
        propose: &mut Proposer<'_>,
    ) -> Result<Vec<BatchToken>> {
        loop {
            let (prompt_progress, tokens) = self.advance(model, propose)?;
            if tokens.is_empty() && prompt_progress {
                continue;
            }
            return Ok(tokens);
        }
    }

    /// One round of mlx-lm's `_next`: a decoding step, then admission and one prefill step.
    /// Returns whether any prompt work happened and the tokens produced.
    fn advance(
        &mut self,
        model: &mut dyn LanguageModel,
        propose: &mut Proposer<'_>,
    ) -> Result<(bool, Vec<BatchToken>)> {
        let mut tokens = Vec::new();
        if !self.decode.rows.is_empty() {
            tokens = if self.speculative {
                self.verify_next(model, propose)?
            } else {
                self.decode_next(model)?
            };
            self.steps += 1;
            if self.steps.is_multiple_of(512) {
                memory::clear_cache()?;
            }
        }
        if self.decode.rows.len() >= self.settings.completion_batch_size {
            return Ok((false, tokens));
        }
        let n = (self
            .settings
            .prefill_batch_size
            .saturating_sub(self.prompt.rows.len()))
        .min(self.settings.completion_batch_size - self.decode.rows.len())
        .min(self.queue.len());
        if n > 0 {
            let mut rows: Vec<Prefill> = self.queue.drain(..n).collect();
            let prefixes: Vec<Option<PrefixKv>> =
                rows.iter_mut().map(|r| r.prefix.take()).collect();
            let caches = if prefixes.iter().any(Option::is_some) {
                merged_caches(&self.plan, &prefixes)?
            } else {
                fresh_caches(model, &self.plan, rows.len())?
            };
            extend_caches(&mut self.prompt.caches, caches)?;
            self.prompt.rows.extend(rows);
        }
        let ready: Vec<usize> = (0..self.prompt.rows.len())
            .filter(|&i| {
                let s = &self.prompt.rows[i].segments;
                s.len() == 1 && s[0].len() == 1
            })
            .collect();
        let mut progress = !ready.is_empty();
        if !ready.is_empty() {
            self.start_decoding(model, &ready)?;
        }
        let mut chunks = Vec::with_capacity(self.prompt.rows.len());
        for row in &mut self.prompt.rows {
            let first = row.segments.front_mut().ok_or_else(|| {
                EngineError::Runtime("a prefilling sequence has no prompt left".into())
            })?;
            let n = first.len().min(self.settings.prefill_step_size);
            chunks.push(first.drain(..n).collect::<Vec<u32>>());
            if first.is_empty() {
                row.segments.pop_front();
            }
        }
        if !chunks.is_empty() {
            progress = true;
            self.prefill(model, &chunks)?;
        }
        self.prompt_rounds += usize::from(progress);
        Ok((progress, tokens))
    }

    /// `PromptProcessingBatch.prompt`: one chunk per row, right-padded to the longest, run in
    /// forwards of `prefill_step_size` positions, the padding then moved to the left.
    fn prefill(&mut self, model: &mut dyn LanguageModel, chunks: &[Vec<u32>]) -> Result<()> {
        let longest = chunks.iter().map(Vec::len).max().unwrap_or(0);
        if chunks.len() > 1 {
            self.prompt.rows.iter_mut().for_each(|r| r.alone = false);
        }
        let lengths: Vec<i32> = chunks.iter().map(|c| c.len() as i32).collect();
        let padding: Vec<i32> = lengths.iter().map(|&n| longest as i32 - n).collect();
        let padded = padding.iter().any(|&p| p > 0);
        if padded {
            for c in self.prompt.caches.iter_mut() {
                batch_of(c.as_mut())?.prepare(&lengths, &padding);
            }
        }
        let ids: Vec<i32> = chunks
            .iter()
            .flat_map(|c| {
                c.iter()
                    .map(|&t| t as i32)
                    .chain(std::iter::repeat_n(0, longest - c.len()))
            })
            .collect();
        let tokens = Array::from_slice(&ids, &[chunks.len() as i32, longest as i32]);
        let mut start = 0;
        while start < longest {
            let n = self.settings.prefill_step_size.min(longest - start);
            let part = tokens.index((.., start as i32..(start + n) as i32));
            // Each row's real positions of this part (padding follows them).
            let rows: Vec<(usize, usize)> = self
                .prompt
                .rows
                .iter()
                .zip(chunks)
                .map(|(r, c)| (r.cached + start, n.min(c.len().saturating_sub(start))))
                .collect();
            let (_, tapped) =
                forward_tapped(model, &part, &mut self.prompt.caches, &self.taps, &rows)?;
            for (r, t) in self.prompt.rows.iter_mut().zip(tapped) {
                r.tapped.extend(t);
            }
            eval_caches(&self.prompt.caches)?;
            memory::clear_cache()?;
            start += n;
        }
        for (r, c) in self.prompt.rows.iter_mut().zip(chunks) {
            r.cached += c.len();
        }
        if padded {
            for c in self.prompt.caches.iter_mut() {
                batch_of(c.as_mut())?.finalize()?;
            }
            eval_caches(&self.prompt.caches)?;
            memory::clear_cache()?;
        }
        Ok(())
    }

    /// Moves prompt rows `ready` (each down to its last token) into the decoding batch: their
    /// caches split off, their first step queued (`PromptProcessingBatch.split(...).generate`).
    fn start_decoding(&mut self, model: &mut dyn LanguageModel, ready: &[usize]) -> Result<()> {
        let rest: Vec<usize> = (0..self.prompt.rows.len())
            .filter(|i| !ready.contains(i))
            .collect();
        let mut caches: Caches = Vec::with_capacity(self.prompt.caches.len());
        for c in &self.prompt.caches {
            caches.push(c.clone_box().ok_or_else(|| {
                EngineError::Runtime("a batched cache could not be copied".into())
            })?);
        }
        filter_caches(&mut caches, ready)?;
        if self.capture {
            for (row, &i) in ready.iter().enumerate() {
                if self.prompt.rows[i].alone {
                    if let Some(prefix) = row_prefix(&mut caches, row)? {
                        self.captured.push((self.prompt.rows[i].uid, prefix));
                    }
                }
            }
        }
        let mut moved = Vec::with_capacity(ready.len());
        let mut rows: Vec<Option<Prefill>> = std::mem::take(&mut self.prompt.rows)
            .into_iter()
            .map(Some)
            .collect();
        for &i in ready {
            moved.extend(rows[i].take());
        }
        self.prompt.rows = rows.into_iter().flatten().collect();
        filter_caches(&mut self.prompt.caches, &rest)?;
        let last: Vec<i32> = moved
            .iter()
            .map(|r| {
                r.segments
                    .front()
                    .and_then(|s| s.first())
                    .copied()
                    .unwrap_or(0) as i32
            })
            .collect();
        let mut batch = DecodeBatch {
            rows: moved
                .into_iter()
                .map(|r| Decoding {
                    uid: r.uid,
                    max_tokens: r.max_tokens,
                    produced: 0,
                    sampler: r.sampler,
                    anchor_out: false,
                    cached: r.cached,
                    tapped: r.tapped,
                })
                .collect(),
            caches,
            next_tokens: Some(Array::from_slice(&last, &[last.len() as i32])),
            next_logprobs: None,
        };
        self.step(model, &mut batch)?;
        self.decode.rows.extend(batch.rows);
        extend_caches(&mut self.decode.caches, batch.caches)?;
        self.decode.next_tokens = concat_rows(self.decode.next_tokens.take(), batch.next_tokens)?;
        self.decode.next_logprobs =
            concat_rows(self.decode.next_logprobs.take(), batch.next_logprobs)?;
        Ok(())
    }

    /// `GenerationBatch._step`: forwards the queued tokens, queues the next step, and returns
    /// the tokens and logprobs that step had produced.
    fn step(
        &mut self,
        model: &mut dyn LanguageModel,
        batch: &mut DecodeBatch,
    ) -> Result<(Array, Option<Array>)> {
        let inputs = batch
            .next_tokens
            .take()
            .ok_or_else(|| EngineError::Runtime("a decoding batch has no queued step".into()))?;
        let current_logprobs = batch.next_logprobs.take();
        let rows: Vec<(usize, usize)> = batch.rows.iter().map(|r| (r.cached, 1)).collect();
        let (logits, tapped) = forward_tapped(
            model,
            &inputs.expand_dims(1)?,
            &mut batch.caches,
            &self.taps,
            &rows,
        )?;
        for (r, t) in batch.rows.iter_mut().zip(tapped) {
            r.cached += 1;
            r.tapped.extend(t);
        }
        let logits = logits.index((.., -1, ..));
        let logprobs = logits.subtract(logits.logsumexp_axis(-1, true)?)?;
        let sampled = if batch.rows.iter().all(|r| r.sampler.is_none()) {
            self.sampler.sample(&logprobs)?
        } else {
            let mut parts = Vec::with_capacity(batch.rows.len());
            for (i, row) in batch.rows.iter_mut().enumerate() {
                let lp = logprobs.index(i as i32..i as i32 + 1);
                let sampler = row.sampler.as_mut().unwrap_or(&mut self.sampler);
                parts.push(sampler.sample(&lp)?);
            }
            ops::concatenate(&parts, 0)?
        };
        async_eval([&sampled, &logprobs])?;
        batch.next_tokens = Some(sampled);
        batch.next_logprobs = Some(logprobs);
        match &current_logprobs {
            Some(lp) => eval([&inputs, lp])?,
            None => eval([&inputs])?,
        }
        Ok((inputs, current_logprobs))
    }

    /// `GenerationBatch.next`: one step for every decoding row; finished rows leave. Rows
    /// whose fed token was handed out already hand out nothing this step; when that is every
    /// row, the next step follows at once.
    fn decode_next(&mut self, model: &mut dyn LanguageModel) -> Result<Vec<BatchToken>> {
        loop {
            self.decode_forwards += 1;
            let mut batch = std::mem::take(&mut self.decode);
            let stepped = self.step(model, &mut batch);
            self.decode = batch;
            let (tokens, logprobs) = stepped?;
            let logprobs = logprobs.ok_or_else(|| {
                EngineError::Runtime("a decoding step had no logprobs to hand out".into())
            })?;
            let ids = read_ids(&tokens)?;
            let mut rows = std::mem::take(&mut self.decode.rows);
            let (out, keep) = self.emit(&mut rows, &ids, |i| logprobs.index(i as i32));
            rows.iter_mut().for_each(|r| r.anchor_out = false);
            self.decode.rows = rows;
            if keep.len() < self.decode.rows.len() {
                self.decode.keep(&keep)?;
            }
            if !out.is_empty() || self.decode.rows.is_empty() {
                return Ok(out);
            }
        }
    }

    /// Hands out the fed token of every row that has not had it yet (`logprobs(i)`: row `i`'s
    /// `[V]`), counting it against the row's budget; returns the tokens and the rows that go on.
    fn emit(
        &self,
        rows: &mut [Decoding],
        ids: &[u32],
        logprobs: impl Fn(usize) -> Array,
    ) -> (Vec<BatchToken>, Vec<usize>) {
        let mut keep = Vec::with_capacity(ids.len());
        let mut out = Vec::with_capacity(ids.len());
        for (i, (&token, row)) in ids.iter().zip(rows.iter_mut()).enumerate() {
            if row.anchor_out {
                keep.push(i);
                continue;
            }
            let finish = self.count(row, token);
            if finish.is_none() {
                keep.push(i);
            }
            out.push(BatchToken {
                uid: row.uid,
                token,
                logprobs: logprobs(i),
                finish,
            });
        }
        (out, keep)
    }

    /// Counts `token` as produced by `row`; says why the row ends with it, if it does.
    fn count(&self, row: &mut Decoding, token: u32) -> Option<FinishReason> {
        row.produced += 1;
        if self.stop_tokens.contains(&token) {
            return Some(FinishReason::Eos);
        }
        (row.produced >= row.max_tokens).then_some(FinishReason::Length)
    }

    /// A speculative decoding step: every row's block `[anchor, drafts..]` (its anchor being its
    /// queued token, handed out first if it was not yet) in one forward, right-padded to the
    /// widest; each row hands out its sampled tokens up to the first that differs from its
    /// draft (that one included), and its caches drop the rest (see `batch_verify`). Without a
    /// usable draft it is a plain step.
    fn verify_next(
        &mut self,
        model: &mut dyn LanguageModel,
        propose: &mut Proposer<'_>,
    ) -> Result<Vec<BatchToken>> {
        let mut rows = self.rows_to_propose()?;
        let mut drafts = propose(&rows, model)?;
        let offers = |r: &DecodingRow| {
            drafts
                .get(&r.uid)
                .is_some_and(|d| d.len() > usize::from(r.next_pending))
        };
        if !rows.iter().any(offers) {
            return self.decode_next(model);
        }
        let (anchors, anchor_logprobs) = self.decode.queued()?;
        if rows.iter().any(|r| r.next_pending) {
            // The pending tokens are read now: draft again from them rather than guesses.
            for (row, &a) in rows.iter_mut().zip(&anchors) {
                row.next = row.next_pending.then_some(a);
                // Already given to the first proposal.
                row.tapped.clear();
            }
            drafts = propose(&rows, model)?;
        }
        let mut out = Vec::new();
        let blocks = self.hand_out_anchors(&drafts, &anchors, &anchor_logprobs, &mut out)?;
        if blocks.is_empty() {
            return Ok(out);
        }
        let before = (!self.rewind_in_place).then(|| checkpoint(&self.decode.caches));
        let (picks, logprobs, width) = self.verify_blocks(model, &blocks)?;
        let verified = VerifiedBlocks {
            blocks: &blocks,
            picks: &picks,
            logprobs: &logprobs,
            width,
            before,
        };
        self.accept_blocks(model, verified, &mut out)?;
        Ok(out)
    }

    /// Hands out the queued tokens (`anchors`) no plain step has handed out yet, keeps the rows
    /// still decoding, and returns each kept row's verify block: its anchor, then its drafts
    /// (a draft that starts with a guess of an unread anchor keeps the rest only when the guess
    /// was right).
    fn hand_out_anchors(
        &mut self,
        drafts: &HashMap<usize, Vec<u32>>,
        anchors: &[u32],
        anchor_logprobs: &Array,
        out: &mut Vec<BatchToken>,
    ) -> Result<Vec<Vec<u32>>> {
        let mut rows = std::mem::take(&mut self.decode.rows);
        let mut keep = Vec::with_capacity(rows.len());
        let mut blocks = Vec::with_capacity(rows.len());
        for (i, row) in rows.iter_mut().enumerate() {
            let mut d = drafts.get(&row.uid).map_or(&[][..], Vec::as_slice);
            if !row.anchor_out {
                row.anchor_out = true;
                let finish = self.count(row, anchors[i]);
                out.push(BatchToken {
                    uid: row.uid,
                    token: anchors[i],
                    logprobs: anchor_logprobs.index(i as i32),
                    finish,
                });
                if finish.is_some() {
                    continue;
                }
                d = match d.split_first() {
                    Some((&guess, rest)) if guess == anchors[i] => rest,
                    _ => &[],
                };
            }
            keep.push(i);
            blocks.push(block(anchors[i], d, row.max_tokens - row.produced));
        }
        self.decode.rows = rows;
        if keep.len() < self.decode.rows.len() {
            self.decode.keep(&keep)?;
        }
        Ok(blocks)
    }

    /// One forward of every decoding row's block, right-padded to the widest: each position's
    /// sampled token (row-major, `width` per row), the logprobs `[rows, width, V]` and the width.
    fn verify_blocks(
        &mut self,
        model: &mut dyn LanguageModel,
        blocks: &[Vec<u32>],
    ) -> Result<(Vec<u32>, Array, usize)> {
        let (input, width) = padded_input(blocks);
        let rows = blocks.len();
        self.decode_forwards += 1;
        let spans: Vec<(usize, usize)> = self
            .decode
            .rows
            .iter()
            .zip(blocks)
            .map(|(r, b)| (r.cached, b.len()))
            .collect();
        let (logits, tapped) =
            forward_tapped(model, &input, &mut self.decode.caches, &self.taps, &spans)?;
        for (r, t) in self.decode.rows.iter_mut().zip(tapped) {
            r.tapped.extend(t);
        }
        let logprobs = logits.subtract(logits.logsumexp_axis(-1, true)?)?;
        let picks = if self.decode.rows.iter().all(|r| r.sampler.is_none()) {
            let vocab = logprobs.shape()[2];
            let flat = logprobs.reshape(&[rows as i32 * width as i32, vocab])?;
            self.sampler.sample(&flat)?
        } else {
            let mut parts = Vec::with_capacity(rows);
            for (i, row) in self.decode.rows.iter_mut().enumerate() {
                let sampler = row.sampler.as_mut().unwrap_or(&mut self.sampler);
                parts.push(sampler.sample(&logprobs.index(i as i32))?);
            }
            ops::concatenate(&parts, 0)?
        };
        eval([&picks, &logprobs])?;
        Ok((read_ids(&picks)?, logprobs, width))
    }

    /// Each row keeps its drafts up to its first disagreement with its own sampled tokens and
    /// hands out one token more; the token after its last kept one is queued as its next
    /// anchor, and the positions it rejected are dropped from its caches.
    fn accept_blocks(
        &mut self,
        model: &mut dyn LanguageModel,
        verified: VerifiedBlocks<'_>,
        out: &mut Vec<BatchToken>,
    ) -> Result<()> {
        let VerifiedBlocks {
            blocks,
            picks,
            logprobs,
            width,
            before,
        } = verified;
        let rows = blocks.len();
        self.decode.next_tokens = None;
        self.decode.next_logprobs = None;
        let mut rows_out = std::mem::take(&mut self.decode.rows);
        let mut keep = Vec::with_capacity(rows);
        let mut next_logprobs = Vec::with_capacity(rows);
        let mut next = Vec::with_capacity(rows);
        let mut drop = Vec::with_capacity(rows);
        let mut kept_tokens = Vec::with_capacity(rows);
        for (i, (row, block)) in rows_out.iter_mut().zip(blocks).enumerate() {
            let picked = &picks[i * width..i * width + block.len()];
            let accepted = confirmed(&block[1..], picked);
            self.verified.push(Verified {
                uid: row.uid,
                proposed: block.len() - 1,
                accepted,
            });
            let mut finished = false;
            for (j, &token) in picked[..=accepted].iter().enumerate() {
                let finish = self.count(row, token);
                out.push(BatchToken {
                    uid: row.uid,
                    token,
                    logprobs: logprobs.index((i as i32, j as i32)),
                    finish,
                });
                if finish.is_some() {
                    finished = true;
                    break;
                }
            }
            if !finished {
                // Its anchor and kept drafts stay in its cache.
                row.cached += accepted + 1;
                keep.push(i);
                next.push(picked[accepted] as i32);
                next_logprobs.push(logprobs.index((i as i32, accepted as i32, ..)));
                drop.push((width - 1 - accepted) as i32);
                kept_tokens.push(block[..=accepted].to_vec());
            }
        }
        self.decode.rows = rows_out;
        // Put back before rows are filtered: the saved caches hold every row the forward ran.
        let replay = match before {
            Some(saved) if drop.iter().any(|&d| d > 0) => {
                restore(&mut self.decode.caches, saved)?;
                true
            }
            _ => false,
        };
        if keep.len() < rows {
            self.decode.keep(&keep)?;
        }
        if !keep.is_empty() {
            self.decode.next_tokens = Some(Array::from_slice(&next, &[next.len() as i32]));
            // Kept beside the handed-out anchors so rows joining later line up with them.
            self.decode.next_logprobs = Some(ops::stack(&next_logprobs, 0)?);
            if replay {
                replay_kept(model, &mut self.decode.caches, &kept_tokens)?;
            } else if self.rewind_in_place {
                rewind_rows(&mut self.decode.caches, &drop)?;
            }
            eval_caches(&self.decode.caches)?;
        }
        Ok(())
    }

    fn filter_prompt(&mut self, keep: &[usize]) -> Result<()> {
        let p = &mut self.prompt;
        let mut rows: Vec<Option<Prefill>> =
            std::mem::take(&mut p.rows).into_iter().map(Some).collect();
        p.rows = keep.iter().filter_map(|&i| rows[i].take()).collect();
        filter_caches(&mut p.caches, keep)
    }
}

/// What one sequence of [`generate_all`] produced.
pub struct Generated {
    /// Its tokens (a stop token included when it ended the sequence).
    pub tokens: Vec<u32>,
    /// Each token's full-vocabulary logprobs `[V]`.
    pub logprobs: Vec<Array>,
    /// Why it ended.
    pub finish: FinishReason,
}

/// Runs `requests` to completion in one [`BatchGenerator`] on `model` and returns every
/// sequence's output, in request order (mlx-lm's `batch_generate`, with full logprobs).
pub fn generate_all(
    model: &mut super::models::LoadedModel,
    sampler: Sampler,
    stop_tokens: Vec<u32>,
    settings: BatchSettings,
    requests: Vec<SequenceRequest>,
) -> Result<Vec<Generated>> {
    let mut gen = BatchGenerator::new(
        model.model.as_ref(),
        &model.plan,
        sampler,
        stop_tokens,
        settings,
    )?;
    let uids = gen.insert(requests)?;
    let mut out: Vec<Generated> = uids
        .iter()
        .map(|_| Generated {
            tokens: Vec::new(),
            logprobs: Vec::new(),
            finish: FinishReason::Length,
        })
        .collect();
    loop {
        let tokens = gen.next_tokens(model.model.as_mut())?;
        if tokens.is_empty() {
            return Ok(out);
        }
        for t in tokens {
            let Some(i) = uids.iter().position(|&u| u == t.uid) else {
                continue;
            };
            let slot = &mut out[i];
            slot.tokens.push(t.token);
            slot.logprobs.push(t.logprobs);
            if let Some(reason) = t.finish {
                slot.finish = reason;
            }
        }
    }
}
