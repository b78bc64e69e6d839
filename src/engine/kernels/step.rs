//! A whole forward step of a llama-style decoder on the host (`--perf-kernel on`, tier L3, and
//! `--host-step on`, L1: see [`Numerics`]): pre-norm grouped-query attention and a SwiGLU MLP,
//! projections quantized (4/8-bit on the affine kernel, other widths and dense f32 layers beside
//! them: [`super::proj`]), biased or not, or dense in MLX's order, f32 activations (bfloat16 ones
//! held widened for a bf16 model's L1 step), for blocks of up to [`MAX_M`] tokens (a decode step
//! or a speculative verify block).
//!
//! Why a whole step: a decode token of a small model is ~200 mat-vecs of a few hundred
//! microseconds each; handing each one to the host kernel separately costs an MLX
//! evaluation and a graph round trip per projection, which is where the per-layer host path
//! lost most of its time. Here the only MLX work left per step is reading the past
//! keys/values in place and appending the new ones (done by the caller).

use super::affine::MAX_M;
use super::attention::{attend_bf16_query, attend_f32_query, scale_bf16_query, F32AttentionOrder};
use super::dispatch::{by_token, selection, Selection};
use super::elementwise::{self, narrow_bf16, round_bf16};
use super::proj::{HostProj, Inputs, ProjView, ProjWeight};
use super::rope_table::RopeTable;
use super::team::{run_team, ErrorSlot, Member, Shared};
use super::vecops::{attend_head, rms_norm, silu_mul, HeadShape, HostRope, KvRows};
use crate::engine::error::{EngineError, Result};

/// One pre-norm layer: `h += o(attn(rope(q, k), v))` over `input_norm(h)`, then
/// `h += down(silu(gate(x)) * up(x))` over `x = post_norm(h)`.
#[derive(Debug, Clone)]
pub struct HostLayer {
    /// `input_layernorm` weight.
    pub input_norm: Vec<f32>,
    /// `post_attention_layernorm` weight.
    pub post_norm: Vec<f32>,
    /// `[q, k, v, o]` projections.
    pub attn: [HostProj; 4],
    /// `[gate, up, down]` projections.
    pub mlp: [HostProj; 3],
    /// Per-head RMSNorm weights `[q_norm, k_norm]` applied before the rotary embedding (Qwen3's
    /// layer; `None` for llama's).
    pub qk_norm: Option<[Vec<f32>; 2]>,
}

/// The decoder the host step runs.
#[derive(Debug, Clone)]
pub struct HostDecoder {
    /// The layers, in order.
    pub layers: Vec<HostLayer>,
    /// The embedding table (also the LM head when `head` is `None`).
    pub embed: HostProj,
    /// An untied LM head.
    pub head: Option<HostProj>,
    /// The final norm's weight.
    pub final_norm: Vec<f32>,
    /// Every RMSNorm's epsilon.
    pub eps: f32,
    /// Attention heads and scale.
    pub heads: HeadShape,
    /// How everything but the products is computed (the rotary embedding with it).
    pub numerics: Numerics,
}

/// How a step computes its norms, rotary embedding, attention and activation (each
/// projection's kind fixes its own order).
#[derive(Debug, Clone)]
pub enum Numerics {
    /// `--perf-kernel on` (L3): the host's own fast forms.
    Fast(HostRope),
    /// `--host-step on` (L1): every operation as MLX's CPU backend computes it, so the step has
    /// MLX's bits (its projections are [`super::ProjWeight::Exact`]).
    Mlx(RopeTable),
    /// `--host-step on` (L1) for a bfloat16 model: the same, with every activation a bfloat16
    /// as in MLX (held widened in the step's f32 buffers, each result rounded as MLX rounds it).
    MlxBf16(Bf16Numerics),
}

/// What the bfloat16 L1 step takes from MLX itself.
#[derive(Debug, Clone)]
pub struct Bf16Numerics {
    /// MLX's cosines and sines ([`RopeTable::apply_bf16`]).
    pub rope: RopeTable,
    /// MLX's bfloat16 `silu` of every bfloat16 value ([`elementwise::swiglu_bf16`]).
    pub silu: &'static [half::bf16],
}

impl Numerics {
    /// Whether activations are bfloat16 (rounded after every operation).
    fn bf16(&self) -> bool {
        matches!(self, Numerics::MlxBf16(_))
    }
}

/// A layer's cache buffers, in the cache's dtype.
#[derive(Debug, Clone, Copy)]
pub enum KvBuffers<'a> {
    /// An f32 cache.
    F32 {
        /// Key buffer.
        keys: &'a [f32],
        /// Value buffer.
        values: &'a [f32],
    },
    /// A bfloat16 cache.
    Bf16 {
        /// Key buffer.
        keys: &'a [half::bf16],
        /// Value buffer.
        values: &'a [half::bf16],
    },
}

/// One layer's cached keys and values before the step, read in place from the cache buffers
/// (`[kv_heads, capacity, head_dim]`, first `len` positions valid; empty slices when `len` is 0).
#[derive(Debug, Clone, Copy)]
pub struct PastKv<'a> {
    /// Key and value buffers.
    pub buffers: KvBuffers<'a>,
    /// Positions each buffer has room for.
    pub capacity: usize,
    /// Valid positions (the cache offset).
    pub len: usize,
}

/// What a step is asked for.
#[derive(Debug, Clone, Copy)]
pub struct StepPlan<'a> {
    /// How many layers run (all of them, or fewer for an early-exit drafter).
    pub layers: usize,
    /// Layers whose outputs (the residual stream after them) to hand back, in this order.
    pub taps: &'a [usize],
    /// Whether to compute the final norm and LM head (a prefill chunk whose logits nobody
    /// reads skips the largest mat-vec of the step).
    pub logits: bool,
    /// Whether token `j` of the block sees only the block's first `j + 1` tokens (a decoder's
    /// step) or all of them (a DSpark drafting block; the fast numerics only).
    pub causal: bool,
}

/// What a step's tokens enter as.
#[derive(Debug, Clone, Copy)]
enum Input<'a> {
    /// Token ids, looked up in the embedding table.
    Ids(&'a [u32]),
    /// Rows already embedded (`m × hidden`).
    Rows(&'a [f32]),
}

impl Input<'_> {
    fn tokens(&self, hidden: usize) -> usize {
        match self {
            Input::Ids(ids) => ids.len(),
            Input::Rows(rows) => rows.len() / hidden.max(1),
        }
    }
}

/// What a step computes.
#[derive(Debug)]
pub struct StepOut {
    /// Logits, `m × vocab`, by token (empty when the step was asked for none).
    pub logits: Vec<f32>,
    /// The residual stream after the last layer run (before the final norm), `m × hidden`.
    pub hidden: Vec<f32>,
    /// The requested taps, `m × hidden` each, in the order asked.
    pub taps: Vec<Vec<f32>>,
    /// Per layer, the block's new keys as `[kv_heads, m, head_dim]` (the cache layout).
    pub keys: Vec<Vec<f32>>,
    /// Per layer, the block's new values, same layout.
    pub values: Vec<Vec<f32>>,
}

static STEPS: std::sync::atomic::AtomicUsize = std::sync::atomic::AtomicUsize::new(0);

/// How many blocks the host decode step has run in this process (lets tests and benchmarks
/// check that a forward really took the whole-step path, not the per-projection one).
pub fn host_steps() -> usize {
    STEPS.load(std::sync::atomic::Ordering::Relaxed)
}

thread_local! {
    static EXACT_STEPS: std::cell::Cell<usize> = const { std::cell::Cell::new(0) };
}

/// How many L1 host steps ([`Numerics::Mlx`]) this thread has run (per thread, so tests running
/// side by side in one process do not count each other's).
pub fn exact_steps_here() -> usize {
    EXACT_STEPS.with(std::cell::Cell::get)
}

fn runtime(e: String) -> EngineError {
    EngineError::Runtime(format!("host decode step: {e}"))
}

/// This thread's rows of `x · Wᵀ` for each `(W, out)` pair (outputs in the kernel's
/// `rows × m` layout), over one input `x` prepared here.
fn rows_share(
    me: Member<'_>,
    sel: Selection,
    x: &[f32],
    m: usize,
    pairs: &[(&ProjView<'_>, &Shared)],
) -> Result<()> {
    let cols = pairs.first().map_or(0, |(w, _)| w.cols);
    let mats: Vec<&ProjView<'_>> = pairs.iter().map(|(w, _)| *w).collect();
    let inputs = Inputs::new(sel, x, m, cols, &mats).map_err(runtime)?;
    for (w, out) in pairs {
        let rows = me.share(w.rows);
        // SAFETY: each member writes only its own share of rows; readers wait for the
        // barrier that follows.
        let part = unsafe { out.part_mut(rows.start * m..rows.end * m) };
        w.rows_into(sel, x, inputs.for_matrix(w), m, rows, part)
            .map_err(runtime)?;
    }
    Ok(())
}

/// Token-major `[m, heads, head_dim]` to the cache's `[heads, m, head_dim]`.
fn to_cache_layout(x: &[f32], m: usize, heads: usize, hd: usize) -> Vec<f32> {
    let mut out = vec![0.0f32; x.len()];
    for j in 0..m {
        for h in 0..heads {
            out[(h * m + j) * hd..][..hd].copy_from_slice(&x[(j * heads + h) * hd..][..hd]);
        }
    }
    out
}

/// Query head `head` of token `j` (`q`, unscaled) over its key/value head, as MLX's CPU SDPA
/// computes it ([`attend_f32_query`]): the query scaled as MLX's fallback scales it (one
/// multiply), then the block's sums in `order` (decided once per layer for all its heads).
#[allow(clippy::too_many_arguments)]
fn mlx_attention(
    s: HeadShape,
    head: usize,
    q: &[f32],
    keys: KvRows<'_>,
    values: KvRows<'_>,
    j: usize,
    order: &F32AttentionOrder,
    scores: &mut Vec<f32>,
    out: &mut [f32],
) -> Result<()> {
    let hd = s.head_dim;
    let kvh = s.kv_head(head);
    let m = keys.new_len;
    let total = keys.len + m;
    let scaled: Vec<f32> = q.iter().map(|v| s.scale * v).collect();
    let (past, new) = (
        (kvh * keys.capacity * hd, keys.len * hd),
        (kvh * m * hd, m * hd),
    );
    attend_f32_query(
        &scaled,
        (
            &keys.past[past.0..][..past.1],
            &values.past[past.0..][..past.1],
        ),
        (&keys.new[new.0..][..new.1], &values.new[new.0..][..new.1]),
        total,
        keys.len + j + 1,
        order,
        scores,
        out,
    )
    .map_err(runtime)
}

impl HostDecoder {
    /// Output vocabulary (the LM head's rows).
    pub fn vocab(&self) -> usize {
        self.head.as_ref().unwrap_or(&self.embed).rows()
    }

    /// Positions the step can rotate (its rope table's, unbounded for the fast form's).
    pub fn positions(&self) -> usize {
        match &self.numerics {
            Numerics::Fast(_) => usize::MAX,
            Numerics::Mlx(table) => table.positions(),
            Numerics::MlxBf16(b) => b.rope.positions(),
        }
    }

    /// Whether a block of `m` tokens after `past` cached positions is one this step computes:
    /// any under [`Numerics::Fast`]; under [`Numerics::Mlx`] a block of up to [`MAX_M`] tokens
    /// (one block: each product sums in the order MLX uses for the block's size) within the
    /// rope table, whose attention sums its values as MLX does
    /// ([`super::attention::f32_values_fit`]), on a thread where the L1 host kernels may run
    /// (see also [`HostDecoder::exact_ready`]).
    pub fn takes(&self, m: usize, past: usize) -> bool {
        match &self.numerics {
            Numerics::Fast(_) => true,
            Numerics::Mlx(table) => {
                m <= MAX_M
                    && past + m <= table.positions()
                    && super::attention::f32_values_fit(m, past + m, self.heads.head_dim)
                    && super::host_allowed()
            }
            Numerics::MlxBf16(b) => {
                m <= MAX_M && past + m <= b.rope.positions() && super::host_allowed()
            }
        }
    }

    /// Whether the step is the L1 one ([`Numerics::Mlx`] or [`Numerics::MlxBf16`]).
    pub fn is_exact(&self) -> bool {
        matches!(self.numerics, Numerics::Mlx(_) | Numerics::MlxBf16(_))
    }

    /// The dtype of the step's activations, caches and logits: bfloat16 under
    /// [`Numerics::MlxBf16`], f32 otherwise.
    pub fn dtype(&self) -> mlx_rs::Dtype {
        if self.numerics.bf16() {
            mlx_rs::Dtype::Bfloat16
        } else {
            mlx_rs::Dtype::Float32
        }
    }

    /// Under the L1 numerics, whether every projection's host product of `m` tokens matched
    /// MLX's (each weight shape checked against MLX once per token count, see
    /// [`super::dense::HostDense::accepts`]; the packed copies' products of `m` tokens are
    /// checked here too, see [`super::dense::HostDense::check_packed`]); always under
    /// [`Numerics::Fast`].
    pub fn exact_ready(&self, m: usize) -> Result<bool> {
        for p in self.projections() {
            if let ProjWeight::Exact(dense) = p.weight() {
                if !dense.accepts(m)? {
                    return Ok(false);
                }
                dense.check_packed(m, false)?;
            }
        }
        Ok(true)
    }

    /// Makes (and checks against MLX) the packed copies blocks of `m` tokens read where a
    /// weight has none for one token ([`super::dense::HostDense::check_packed`]); under the
    /// L1 numerics only, where MLX may run (the step's caller).
    pub fn make_block_copies(&self, m: usize) -> Result<()> {
        for p in self.projections() {
            if let ProjWeight::Exact(dense) = p.weight() {
                dense.check_packed(m, true)?;
            }
        }
        Ok(())
    }

    /// Every projection of the step: the layers' attention and MLP, then the head (the
    /// embedding when tied).
    fn projections(&self) -> impl Iterator<Item = &HostProj> {
        self.layers
            .iter()
            .flat_map(|l| l.attn.iter().chain(&l.mlp))
            .chain(self.head.as_ref().or(Some(&self.embed)))
    }

    /// Runs the block `ids` (1..=[`MAX_M`] tokens at positions `past[_].len..`) through the
    /// first `plan.layers` layers (one `past` each), collecting `plan.taps`, then the final
    /// norm and LM head when `plan.logits` is set.
    pub fn step(&self, ids: &[u32], past: &[PastKv<'_>], plan: StepPlan<'_>) -> Result<StepOut> {
        self.run(Input::Ids(ids), past, plan)
    }

    /// [`Self::step`] over rows already embedded (`m × hidden`, by token): a drafter whose block
    /// enters as embeddings it made itself.
    pub fn step_rows(
        &self,
        rows: &[f32],
        past: &[PastKv<'_>],
        plan: StepPlan<'_>,
    ) -> Result<StepOut> {
        let d = self.embed.cols();
        if d == 0 || !rows.len().is_multiple_of(d) {
            return Err(runtime(format!(
                "{} input values are not whole rows of {d}",
                rows.len()
            )));
        }
        self.run(Input::Rows(rows), past, plan)
    }

    fn run(&self, input: Input<'_>, past: &[PastKv<'_>], plan: StepPlan<'_>) -> Result<StepOut> {
        let sel = selection()?;
        let m = input.tokens(self.embed.cols());
        let run = plan.layers;
        if m == 0 || m > MAX_M || past.len() != run || run == 0 || run > self.layers.len() {
            return Err(runtime(format!(
                "{m} tokens (1..={MAX_M}) with {} caches for {run} of {} layers",
                past.len(),
                self.layers.len()
            )));
        }
        if plan.taps.iter().any(|&t| t >= run) {
            return Err(runtime(format!("a tap is outside the {run} layers run")));
        }
        // The MLX handles stay on this thread; the pool sees only borrowed host memory.
        let layers = self.layers[..run]
            .iter()
            .map(|l| {
                let [q, k, v, o] = &l.attn;
                let [g, u, d] = &l.mlp;
                Ok(LayerView {
                    input_norm: &l.input_norm,
                    post_norm: &l.post_norm,
                    qk_norm: l.qk_norm.as_ref().map(|[q, k]| [&q[..], &k[..]]),
                    attn: [q.view()?, k.view()?, v.view()?, o.view()?],
                    mlp: [g.view()?, u.view()?, d.view()?],
                })
            })
            .collect::<Result<Vec<_>>>()?;
        let embed = self.embed.view()?;
        let view = View {
            layers,
            embed,
            head: match &self.head {
                Some(h) => h.view()?,
                None => embed,
            },
            final_norm: &self.final_norm,
            eps: self.eps,
            heads: self.heads,
            numerics: &self.numerics,
        };
        // Run on a pool thread so the step's many fork/joins stay inside the pool.
        let (out, ()) = rayon::join(|| view.step(sel, input, past, plan), || ());
        if out.is_ok() && self.is_exact() {
            EXACT_STEPS.with(|c| c.set(c.get() + 1));
        }
        out
    }
}

/// One layer's weights as host slices.
struct LayerView<'a> {
    input_norm: &'a [f32],
    post_norm: &'a [f32],
    qk_norm: Option<[&'a [f32]; 2]>,
    attn: [ProjView<'a>; 4],
    mlp: [ProjView<'a>; 3],
}

/// A [`HostDecoder`] as borrowed host memory only (shareable with the thread pool).
struct View<'a> {
    layers: Vec<LayerView<'a>>,
    embed: ProjView<'a>,
    head: ProjView<'a>,
    final_norm: &'a [f32],
    eps: f32,
    heads: HeadShape,
    numerics: &'a Numerics,
}

/// The team's shared mat-vec outputs and attention output for one step.
struct Buffers {
    q: Shared,
    k: Shared,
    v: Shared,
    attn: Shared,
    o: Shared,
    gate: Shared,
    up: Shared,
    down: Shared,
    logits: Shared,
}

/// What thread 0 collects for the caller while the team runs.
#[derive(Default)]
struct Collected {
    keys: Vec<Vec<f32>>,
    values: Vec<Vec<f32>>,
    taps: Vec<Vec<f32>>,
    hidden: Vec<f32>,
}

impl View<'_> {
    fn step(
        &self,
        sel: Selection,
        input: Input<'_>,
        past: &[PastKv<'_>],
        plan: StepPlan<'_>,
    ) -> Result<StepOut> {
        let d = self.embed.cols;
        let m = input.tokens(d);
        let s = self.heads;
        let (qd, kvd) = (s.n_heads * s.head_dim, s.n_kv_heads * s.head_dim);
        for l in &self.layers {
            let [wq, wk, wv, wo] = l.attn;
            if wq.rows != qd || wk.rows != kvd || wv.rows != kvd || wo.cols != qd {
                return Err(runtime(
                    "attention projections disagree with the head shape".into(),
                ));
            }
        }
        if let Input::Ids(ids) = input {
            if let Some(bad) = ids.iter().find(|&&t| t as usize >= self.embed.rows) {
                return Err(runtime(format!(
                    "token id {bad} is outside the embedding table of {}",
                    self.embed.rows
                )));
            }
        }
        if !plan.causal && !matches!(self.numerics, Numerics::Fast(_)) {
            return Err(runtime(
                "a block that sees itself whole runs only in the fast numerics".into(),
            ));
        }
        let inter = self.layers.first().map_or(0, |l| l.mlp[0].rows);
        let buffers = Buffers {
            q: Shared::new(m * qd),
            k: Shared::new(m * kvd),
            v: Shared::new(m * kvd),
            attn: Shared::new(m * qd),
            o: Shared::new(m * d),
            gate: Shared::new(m * inter),
            up: Shared::new(m * inter),
            down: Shared::new(m * d),
            logits: Shared::new(if plan.logits { m * self.head.rows } else { 0 }),
        };
        let errors = ErrorSlot::new();
        let collected = std::sync::Mutex::new(Collected::default());
        run_team(sel.threads, |me| {
            let mut mine = Collected::default();
            self.member(me, sel, input, past, plan, &buffers, &errors, &mut mine);
            if me.index == 0 {
                if let Ok(mut c) = collected.lock() {
                    *c = mine;
                }
            }
        });
        if let Some(e) = errors.take() {
            return Err(e);
        }
        let c = collected
            .into_inner()
            .map_err(|_| runtime("a team thread panicked".into()))?;
        let mut logits = Vec::new();
        if plan.logits {
            // SAFETY: the team has finished; nothing writes the buffer any more.
            by_token(unsafe { buffers.logits.all() }, m, &mut logits);
            self.head.add_bias(&mut logits);
            self.round(&mut logits);
        }
        super::host::count_calls(7 * self.layers.len() + usize::from(plan.logits));
        STEPS.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        Ok(StepOut {
            logits,
            hidden: c.hidden,
            taps: c.taps,
            keys: c.keys,
            values: c.values,
        })
    }

    /// RMSNorm of each token's row of `h` by `w`, into `out`.
    fn norm(&self, h: &[f32], w: &[f32], out: &mut [f32]) {
        match self.numerics {
            Numerics::Fast(_) => rms_norm(h, w, self.eps, out),
            Numerics::Mlx(_) => elementwise::rms_norm(h, w, self.eps, out),
            Numerics::MlxBf16(_) => {
                let mut y = vec![half::bf16::ZERO; h.len()];
                elementwise::rms_norm_bf16(&narrow_bf16(h), &narrow_bf16(w), self.eps, &mut y);
                for (o, v) in out.iter_mut().zip(y) {
                    *o = v.to_f32();
                }
            }
        }
    }

    /// A product's (or the attention's) results rounded to the activations' dtype.
    fn round(&self, x: &mut [f32]) {
        if self.numerics.bf16() {
            round_bf16(x);
        }
    }

    /// The residual add `h += t`, rounded to the activations' dtype.
    fn residual(&self, h: &mut [f32], t: &[f32]) {
        h.iter_mut().zip(t).for_each(|(a, b)| *a += b);
        self.round(h);
    }

    /// Rotates one token's heads (`x`: whole heads) for position `pos`.
    fn rope(&self, x: &mut [f32], pos: usize) -> Result<()> {
        let hd = self.heads.head_dim;
        match self.numerics {
            Numerics::Fast(rope) => {
                rope.apply(x, hd, pos);
                Ok(())
            }
            Numerics::Mlx(table) => table.apply(x, hd, pos).map_err(runtime),
            Numerics::MlxBf16(b) => b.rope.apply_bf16(x, hd, pos).map_err(runtime),
        }
    }

    /// `gate = silu(gate) * up` (`scratch` for the exact form, which writes out of place).
    fn silu_mul(&self, gate: &mut Vec<f32>, up: &[f32], scratch: &mut Vec<f32>) {
        match self.numerics {
            Numerics::Fast(_) => silu_mul(gate, up),
            Numerics::Mlx(_) => {
                scratch.resize(gate.len(), 0.0);
                elementwise::swiglu(gate, up, scratch);
                std::mem::swap(gate, scratch);
            }
            Numerics::MlxBf16(b) => {
                let mut y = vec![half::bf16::ZERO; gate.len()];
                elementwise::swiglu_bf16(&narrow_bf16(gate), &narrow_bf16(up), b.silu, &mut y);
                for (o, v) in gate.iter_mut().zip(y) {
                    *o = v.to_f32();
                }
            }
        }
    }

    /// The attention of this member's `items` (token `j`, head `h` as `j * heads + h`) of the
    /// block's rotated queries `q` over the past keys/values and the block's own (`new`, in the
    /// cache layout), into `out` (one head's output per item).
    #[allow(clippy::too_many_arguments)]
    fn attend(
        &self,
        items: std::ops::Range<usize>,
        q: &[f32],
        past: &PastKv<'_>,
        new: (&[f32], &[f32]),
        m: usize,
        causal: bool,
        scores: &mut Vec<f32>,
        out: &mut [f32],
    ) -> Result<()> {
        let s = self.heads;
        let hd = s.head_dim;
        let rows = |past_buf, new| KvRows {
            past: past_buf,
            capacity: past.capacity,
            len: past.len,
            new,
            new_len: m,
        };
        match (self.numerics, past.buffers) {
            (Numerics::Fast(_), KvBuffers::F32 { keys, values }) => {
                let (keys, values) = (rows(keys, new.0), rows(values, new.1));
                for (n, out) in items.zip(out.chunks_exact_mut(hd)) {
                    let (j, head) = (n / s.n_heads, n % s.n_heads);
                    scores.resize(past.len + m, 0.0);
                    let qh = &q[n * hd..(n + 1) * hd];
                    // A whole-block token sees the block as its last token does.
                    let seen = if causal { j } else { m - 1 };
                    attend_head(s, head, qh, keys, values, seen, scores, out);
                }
            }
            (Numerics::Mlx(_), KvBuffers::F32 { keys, values }) => {
                let (keys, values) = (rows(keys, new.0), rows(values, new.1));
                // Under MLX's order every head and query of the block sums alike: decided once.
                let Some(order) = F32AttentionOrder::here(m, past.len + m, hd) else {
                    let keys = past.len + m;
                    return Err(runtime(format!(
                        "no MLX order for {m} queries over {keys} keys"
                    )));
                };
                for (n, out) in items.zip(out.chunks_exact_mut(hd)) {
                    let (j, head) = (n / s.n_heads, n % s.n_heads);
                    let qh = &q[n * hd..(n + 1) * hd];
                    mlx_attention(s, head, qh, keys, values, j, &order, scores, out)?;
                }
            }
            (Numerics::MlxBf16(_), KvBuffers::Bf16 { keys, values }) => {
                let (new_keys, new_values) = (narrow_bf16(new.0), narrow_bf16(new.1));
                let mut scaled = vec![0.0f32; hd];
                let (cached, fresh) = (past.len * hd, m * hd);
                for (n, out) in items.zip(out.chunks_exact_mut(hd)) {
                    let (j, head) = (n / s.n_heads, n % s.n_heads);
                    scale_bf16_query(&q[n * hd..(n + 1) * hd], s.scale, &mut scaled);
                    let kvh = s.kv_head(head);
                    let (p, f) = (kvh * past.capacity * hd, kvh * fresh);
                    attend_bf16_query(
                        &scaled,
                        (&keys[p..][..cached], &values[p..][..cached]),
                        (&new_keys[f..][..fresh], &new_values[f..][..fresh]),
                        past.len + j + 1,
                        scores,
                        out,
                    )
                    .map_err(runtime)?;
                }
            }
            _ => {
                return Err(runtime(
                    "a cache of another dtype than the step's activations".into(),
                ))
            }
        }
        Ok(())
    }

    /// One team member's walk through the step. It never returns early: every member meets
    /// every barrier even after an error (reported into `errors`), so none waits forever.
    #[allow(clippy::too_many_arguments)]
    fn member(
        &self,
        me: Member<'_>,
        sel: Selection,
        input: Input<'_>,
        past: &[PastKv<'_>],
        plan: StepPlan<'_>,
        b: &Buffers,
        errors: &ErrorSlot<EngineError>,
        out: &mut Collected,
    ) {
        let d = self.embed.cols;
        let m = input.tokens(d);
        let s = self.heads;
        let (hd, qd, kvd) = (
            s.head_dim,
            s.n_heads * s.head_dim,
            s.n_kv_heads * s.head_dim,
        );
        // The residual stream and the small per-token ops are computed by every member
        // (cheap, and it saves a barrier each); the mat-vecs and attention are shared out.
        let mut h = match input {
            Input::Ids(ids) => {
                let mut h = vec![0.0f32; m * d];
                for (id, row) in ids.iter().zip(h.chunks_exact_mut(d)) {
                    errors.keep(self.embed.row(*id as usize, row).map_err(runtime));
                }
                h
            }
            Input::Rows(rows) => rows.to_vec(),
        };
        let mut xn = vec![0.0f32; m * d];
        let (mut q, mut k, mut v, mut t) = (Vec::new(), Vec::new(), Vec::new(), Vec::new());
        let (mut gate, mut up, mut act) = (Vec::new(), Vec::new(), Vec::new());
        let (mut scores, mut normed) = (Vec::new(), Vec::new());
        out.taps = vec![Vec::new(); plan.taps.len()];
        // SAFETY (every `all()` below): the buffer was written before the barrier just passed
        // and is next written only after at least one more barrier.
        for (i, (layer, past)) in self.layers.iter().zip(past).enumerate() {
            let [wq, wk, wv, wo] = &layer.attn;
            self.norm(&h, layer.input_norm, &mut xn);
            errors.keep(rows_share(
                me,
                sel,
                &xn,
                m,
                &[(wq, &b.q), (wk, &b.k), (wv, &b.v)],
            ));
            me.sync();
            by_token(unsafe { b.q.all() }, m, &mut q);
            by_token(unsafe { b.k.all() }, m, &mut k);
            by_token(unsafe { b.v.all() }, m, &mut v);
            wq.add_bias(&mut q);
            wk.add_bias(&mut k);
            wv.add_bias(&mut v);
            for x in [&mut q, &mut k, &mut v] {
                self.round(x);
            }
            if let Some([qn, kn]) = layer.qk_norm {
                // Per head: the norm's rows are its weight's width.
                for (x, w) in [(&mut q, qn), (&mut k, kn)] {
                    normed.resize(x.len(), 0.0);
                    self.norm(x, w, &mut normed);
                    std::mem::swap(x, &mut normed);
                }
            }
            for j in 0..m {
                errors.keep(self.rope(&mut q[j * qd..(j + 1) * qd], past.len + j));
                errors.keep(self.rope(&mut k[j * kvd..(j + 1) * kvd], past.len + j));
            }
            let (kc, vc) = (
                to_cache_layout(&k, m, s.n_kv_heads, hd),
                to_cache_layout(&v, m, s.n_kv_heads, hd),
            );
            let items = me.share(m * s.n_heads);
            // SAFETY: each member writes the heads of its own share.
            let attn = unsafe { b.attn.part_mut(items.start * hd..items.end * hd) };
            let new = (&kc[..], &vc[..]);
            let attended = self.attend(items, &q, past, new, m, plan.causal, &mut scores, attn);
            errors.keep(attended);
            if me.index == 0 {
                out.keys.push(kc);
                out.values.push(vc);
            }
            me.sync();
            errors.keep(rows_share(
                me,
                sel,
                unsafe { b.attn.all() },
                m,
                &[(wo, &b.o)],
            ));
            me.sync();
            by_token(unsafe { b.o.all() }, m, &mut t);
            wo.add_bias(&mut t);
            self.round(&mut t);
            self.residual(&mut h, &t);

            let [wg, wu, wd] = &layer.mlp;
            self.norm(&h, layer.post_norm, &mut xn);
            errors.keep(rows_share(me, sel, &xn, m, &[(wg, &b.gate), (wu, &b.up)]));
            me.sync();
            by_token(unsafe { b.gate.all() }, m, &mut gate);
            by_token(unsafe { b.up.all() }, m, &mut up);
            wg.add_bias(&mut gate);
            wu.add_bias(&mut up);
            self.round(&mut gate);
            self.round(&mut up);
            self.silu_mul(&mut gate, &up, &mut act);
            errors.keep(rows_share(me, sel, &gate, m, &[(wd, &b.down)]));
            me.sync();
            by_token(unsafe { b.down.all() }, m, &mut t);
            wd.add_bias(&mut t);
            self.round(&mut t);
            self.residual(&mut h, &t);
            if me.index == 0 {
                for (tap, _) in out.taps.iter_mut().zip(plan.taps).filter(|(_, &t)| t == i) {
                    tap.clone_from(&h);
                }
            }
        }
        if plan.logits {
            self.norm(&h, self.final_norm, &mut xn);
            errors.keep(rows_share(me, sel, &xn, m, &[(&self.head, &b.logits)]));
        }
        out.hidden = h;
    }
}
