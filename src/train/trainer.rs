//! DSpark training (dspark-spec.md §2): a functional, differentiable forward of the drafter over
//! many anchors of one cached sequence at once, the loss exactly as DeepSpec writes it, AdamW
//! with warm-up + cosine decay and global-norm clipping, and resumable checkpoints.
//!
//! - **Parameters** ([`Params`]): every drafter tensor except `embed_tokens` / `lm_head` (the
//!   target's, frozen and shared), as f32 master weights in name order.
//! - **Forward** ([`Frozen::forward`]): teacher-forced blocks `[x_p, MASK x (γ-1)]` at positions
//!   `p..p+γ-1`; block rows of anchor `p` see the context rows `< p` and their own block
//!   (non-causal), exactly what inference sees; the sequential head's previous token is the
//!   ground-truth `x_{p+k}`.
//! - **Loss** ([`loss_sums`]): `0.1 CE + 0.9 L1(p_d, p_t) + 1.0 BCE(conf, c*)`, weights
//!   `exp(-k/4)` times the contiguous-prefix supervision mask, normalised by the global weight.
//! - **Determinism**: the sequence order and anchors of step `s` derive from `(seed, s)` alone,
//!   and the optimizer state is saved exactly, so `--resume` reproduces an uninterrupted run
//!   bit for bit.

use crate::engine::bits::same_bits;
use crate::engine::error::{EngineError, Result};
use crate::engine::models::LanguageModel;
use crate::spec::dspark::checkpoint::{self, DsparkConfig, LayerStyle, SeqHead};
use mlx_rs::error::Exception;
use mlx_rs::ops::indexing::{take_along_axis, IndexOp};
use mlx_rs::{fast, ops, Array, Dtype};
use std::collections::{BTreeMap, HashMap};
use std::path::{Path, PathBuf};

/// The training-state file inside a checkpoint directory (parameters, Adam moments, step).
pub const STATE_FILE: &str = "train-state.safetensors";
/// Loss weights: cross-entropy, L1 between distributions, confidence BCE (the paper's Eq. 12).
pub const LOSS_WEIGHTS: (f32, f32, f32) = (0.1, 0.9, 1.0);
/// `loss_decay_gamma` of DeepSpec's code: position weights `exp(-k / 4)`.
pub const LOSS_DECAY: f32 = 4.0;

fn exc(e: EngineError) -> Exception {
    Exception::custom(e.to_string())
}

/// A training example: one sequence of the target's cache (dspark-spec.md §2.2).
#[derive(Clone)]
pub struct Example {
    /// Token ids `[S]`.
    pub ids: Vec<u32>,
    /// Loss mask `[S]` (assistant tokens).
    pub mask: Vec<bool>,
    /// Raw tapped layer outputs, concatenated: `[S, m*d]`.
    pub taps: Array,
    /// The target's final post-norm hidden states `[S, d]`.
    pub last_hidden: Array,
}

/// Runs the target over `ids` and returns the example (taps + final hidden states).
pub fn extract_example(
    target: &mut dyn LanguageModel,
    ids: &[u32],
    mask: &[bool],
    tap_layers: &[usize],
) -> Result<Example> {
    let n = target.make_caches().len();
    let mut caches = target.make_caches();
    let mut taps = tap_layers.to_vec();
    taps.push(n - 1);
    let opts = crate::engine::models::ForwardOpts {
        exit_after: None,
        taps: taps.clone(),
    };
    let input = Array::from_slice(
        &ids.iter().map(|&t| t as i32).collect::<Vec<_>>(),
        &[1, ids.len() as i32],
    );
    let out = target.forward_ext(&input, &mut caches, &opts)?;
    let mut t = out.taps;
    let last = t
        .pop()
        .ok_or_else(|| EngineError::Runtime("the target returned no taps".into()))?;
    let last_hidden = target.final_norm(&last)?.squeeze_axes(&[0])?;
    let taps = ops::concatenate(&t, -1)?.squeeze_axes(&[0])?;
    let (taps, last_hidden) = (
        taps.as_dtype(Dtype::Bfloat16)?,
        last_hidden.as_dtype(Dtype::Bfloat16)?,
    );
    mlx_rs::transforms::eval([&taps, &last_hidden])?;
    Ok(Example {
        ids: ids.to_vec(),
        mask: mask.to_vec(),
        taps,
        last_hidden,
    })
}

/// The trainable tensors, by name (sorted), as f32.
#[derive(Clone)]
pub struct Params {
    /// Tensor names in DeepSpec's unprefixed scheme.
    pub names: Vec<String>,
    /// The tensors, aligned with `names`.
    pub values: Vec<Array>,
}

impl Params {
    /// Takes the trainable tensors out of a checkpoint's map (the embedding and LM head stay
    /// the target's). Refuses what the training forward does not implement.
    pub fn from_tensors(config: &DsparkConfig, tensors: &HashMap<String, Array>) -> Result<Self> {
        if config.layer_style != LayerStyle::Qwen3 || config.attention_k_eq_v {
            return Err(EngineError::Input(
                "training supports Qwen3-style drafters only (create one with `mlxb dspark-init`)"
                    .into(),
            ));
        }
        let sorted: BTreeMap<&String, &Array> = tensors
            .iter()
            .filter(|(k, _)| !k.starts_with("embed_tokens.") && !k.starts_with("lm_head."))
            .collect();
        if sorted.keys().any(|k| k.ends_with(".scales")) {
            return Err(EngineError::Input(
                "cannot train a quantized drafter; start from an unquantized checkpoint".into(),
            ));
        }
        let mut names = Vec::new();
        let mut values = Vec::new();
        for (k, v) in sorted {
            names.push(k.clone());
            values.push(v.as_dtype(Dtype::Float32)?);
        }
        Ok(Self { names, values })
    }

    /// The tensors as a map in `dtype` (for [`checkpoint::save`]).
    pub fn to_tensors(&self, dtype: Dtype) -> Result<HashMap<String, Array>> {
        self.names
            .iter()
            .zip(&self.values)
            .map(|(k, v)| Ok((k.clone(), v.as_dtype(dtype)?)))
            .collect()
    }

    /// A name → position index.
    fn index(&self) -> HashMap<&str, usize> {
        self.names
            .iter()
            .enumerate()
            .map(|(i, n)| (n.as_str(), i))
            .collect()
    }
}

/// One sequence's anchors, laid out for [`Frozen::forward`] and [`loss_sums`].
pub struct AnchorBatch {
    /// Anchor positions `p_a` (ascending).
    pub anchors: Vec<usize>,
    /// Block input ids `[A, γ]`: the anchor token then `MASK`.
    pub block_ids: Array,
    /// The sequential head's previous tokens `[A, γ]`: `x_{p+k}` (teacher forcing).
    pub prev_ids: Array,
    /// Supervised next tokens `x*_k = x_{p+k+1}` `[A, γ]` (0 where unsupervised).
    pub targets: Array,
    /// Rows `p+k` of the target's hidden states that give `p_t` `[A, γ]`.
    pub target_rows: Array,
    /// Loss weights `exp(-k/4)` times the contiguous-prefix mask `[A, γ]`.
    pub weights: Array,
}

/// SplitMix64: the deterministic stream behind sequence order and anchors.
pub struct SplitMix(u64);

impl SplitMix {
    /// A stream for `seed` mixed with `salt`.
    pub fn new(seed: u64, salt: u64) -> Self {
        let mut s = Self(seed ^ salt.wrapping_mul(0x9e37_79b9_7f4a_7c15));
        s.next_u64();
        s
    }
    /// The next 64 random bits.
    pub fn next_u64(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9e37_79b9_7f4a_7c15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        z ^ (z >> 31)
    }
    /// Fisher-Yates shuffle.
    pub fn shuffle<T>(&mut self, v: &mut [T]) {
        for i in (1..v.len()).rev() {
            let j = (self.next_u64() % (i as u64 + 1)) as usize;
            v.swap(i, j);
        }
    }
}

/// DeepSpec's `sample_anchor_positions`: candidates `p ∈ [0, S-2]` with `mask[p]` and
/// `mask[p+1]`, up to `n` drawn without replacement, sorted.
pub fn sample_anchors(mask: &[bool], n: usize, rng: &mut SplitMix) -> Vec<usize> {
    let mut cands: Vec<usize> = (0..mask.len().saturating_sub(1))
        .filter(|&p| mask[p] && mask[p + 1])
        .collect();
    rng.shuffle(&mut cands);
    cands.truncate(n);
    cands.sort_unstable();
    cands
}

/// Lays out the anchors of `ex` for a block of `gamma` with mask token `mask_id`: supervision of
/// slot k needs `p+k+1 < S` and `mask[p+k+1]`, as a contiguous prefix.
pub fn anchor_batch(ex: &Example, anchors: &[usize], gamma: usize, mask_id: i64) -> AnchorBatch {
    let s = ex.ids.len();
    let a = anchors.len();
    let (mut block, mut prev, mut tgt, mut rows, mut w) = (
        Vec::with_capacity(a * gamma),
        Vec::with_capacity(a * gamma),
        Vec::with_capacity(a * gamma),
        Vec::with_capacity(a * gamma),
        Vec::with_capacity(a * gamma),
    );
    for &p in anchors {
        let mut alive = true;
        for k in 0..gamma {
            block.push(if k == 0 {
                ex.ids[p] as i32
            } else {
                mask_id as i32
            });
            let row = (p + k).min(s - 1);
            prev.push(ex.ids[row] as i32);
            rows.push(row as i32);
            let next = p + k + 1;
            alive = alive && next < s && ex.mask[next];
            tgt.push(if alive { ex.ids[next] as i32 } else { 0 });
            w.push(if alive {
                (-(k as f32) / LOSS_DECAY).exp()
            } else {
                0.0
            });
        }
    }
    let shape = [a as i32, gamma as i32];
    AnchorBatch {
        anchors: anchors.to_vec(),
        block_ids: Array::from_slice(&block, &shape),
        prev_ids: Array::from_slice(&prev, &shape),
        targets: Array::from_slice(&tgt, &shape),
        target_rows: Array::from_slice(&rows, &shape),
        weights: Array::from_slice(&w, &shape),
    }
}

/// Weighted sums of the three loss terms and of the weights (scalars, f32):
/// `(Σw·CE, Σw·L1, Σw·BCE, Σw)`. `logits`/`target_logits` `[.., V]`, `conf` `[..]` logits,
/// `targets` ids `[..]`, `weights` `[..]`. `c*` is detached.
pub fn loss_sums(
    logits: &Array,
    target_logits: &Array,
    conf: Option<&Array>,
    targets: &Array,
    weights: &Array,
) -> std::result::Result<[Array; 4], Exception> {
    let z = logits.as_dtype(Dtype::Float32)?;
    let lse = z.logsumexp_axis(-1, true)?;
    let logp = z.subtract(&lse)?;
    let picked = take_along_axis(&logp, &targets.expand_dims(-1)?, -1)?.squeeze_axes(&[-1])?;
    let ce = picked.negative()?;
    let pd = logp.exp()?;
    let pt = ops::softmax_axis(&target_logits.as_dtype(Dtype::Float32)?, -1, true)?;
    let pt = mlx_rs::stop_gradient(&pt)?;
    let l1 = pd.subtract(&pt)?.abs()?.sum_axis(-1, false)?;
    let w = weights.as_dtype(Dtype::Float32)?;
    let bce = match conf {
        Some(c) => {
            let one = Array::from_f32(1.0);
            let star = ops::clip(
                &one.subtract(&l1.multiply(Array::from_f32(0.5))?)?,
                (0.0f32, 1.0f32),
            )?;
            let star = mlx_rs::stop_gradient(&star)?;
            let x = c.as_dtype(Dtype::Float32)?;
            // BCE with logits: max(x,0) - x c* + log(1 + exp(-|x|)).
            ops::maximum(&x, Array::from_f32(0.0))?
                .subtract(&x.multiply(&star)?)?
                .add(&x.abs()?.negative()?.exp()?.log1p()?)?
        }
        None => ops::zeros_like(&l1)?,
    };
    let wsum = |t: &Array| t.multiply(&w)?.sum(false);
    Ok([wsum(&ce)?, wsum(&l1)?, wsum(&bce)?, w.sum(false)?])
}

/// The total loss `0.1 CE + 0.9 L1 + 1.0 BCE` from summed terms over a global weight.
pub fn total_loss(sums: &[Array; 4]) -> std::result::Result<Array, Exception> {
    let (a, b, c) = LOSS_WEIGHTS;
    let den = ops::maximum(&sums[3], Array::from_f32(1e-12))?;
    sums[0]
        .multiply(Array::from_f32(a))?
        .add(&sums[1].multiply(Array::from_f32(b))?)?
        .add(&sums[2].multiply(Array::from_f32(c))?)?
        .divide(&den)
}

/// `x @ w.T` for a `[out, in]` weight (+ bias).
fn linear(x: &Array, w: &Array, b: Option<&Array>) -> std::result::Result<Array, Exception> {
    let y = ops::matmul(x, w.t())?;
    match b {
        Some(b) => y.add(b),
        None => Ok(y),
    }
}

/// Non-traditional RoPE (mlx `fast.rope`, `traditional=False`) at explicit positions:
/// `x` `[.., N, hd]`, `positions` `[N]`.
fn rope_at(
    x: &Array,
    positions: &Array,
    base: f32,
    scale: f32,
) -> std::result::Result<Array, Exception> {
    let hd = x.shape()[x.ndim() - 1];
    let half = hd / 2;
    let i = ops::arange::<_, f32>(0, half, None)?;
    let inv = Array::from_f32(base).power(&i.multiply(Array::from_f32(-2.0 / hd as f32))?)?;
    let ang = positions
        .as_dtype(Dtype::Float32)?
        .multiply(Array::from_f32(scale))?
        .expand_dims(-1)?
        .multiply(&inv)?;
    let (cos, sin) = (ang.cos()?, ang.sin()?);
    let x1 = x.index((.., .., ..half));
    let x2 = x.index((.., .., half..));
    let r1 = x1.multiply(&cos)?.subtract(&x2.multiply(&sin)?)?;
    let r2 = x1.multiply(&sin)?.add(&x2.multiply(&cos)?)?;
    ops::concatenate(&[r1, r2], -1)
}

/// The attention mask `[N, S+N]` (additive): block row `(a, k)` sees context rows `< p_a` and
/// the `γ` block rows of its own anchor.
fn block_mask(anchors: &[usize], s: usize, gamma: usize) -> Array {
    let n = anchors.len() * gamma;
    let mut m = vec![-1e9f32; n * (s + n)];
    for (a, &p) in anchors.iter().enumerate() {
        for k in 0..gamma {
            let row = &mut m[(a * gamma + k) * (s + n)..(a * gamma + k + 1) * (s + n)];
            row[..p].iter_mut().for_each(|v| *v = 0.0);
            row[s + a * gamma..s + (a + 1) * gamma]
                .iter_mut()
                .for_each(|v| *v = 0.0);
        }
    }
    Array::from_slice(&m, &[n as i32, (s + n) as i32])
}

/// The RoPE base and scale of a config (plain or default-typed scaling only).
fn rope_params(c: &DsparkConfig) -> Result<(f32, f32)> {
    match &c.rope_scaling {
        None => Ok((c.rope_theta as f32, 1.0)),
        Some(v) => {
            let kind = v
                .get("rope_type")
                .or_else(|| v.get("type"))
                .and_then(|t| t.as_str())
                .unwrap_or("default");
            match kind {
                "default" => Ok((c.rope_theta as f32, 1.0)),
                "linear" => Ok((
                    c.rope_theta as f32,
                    1.0 / v.get("factor").and_then(|f| f.as_f64()).unwrap_or(1.0) as f32,
                )),
                other => Err(EngineError::Input(format!(
                    "training does not implement `{other}` RoPE scaling yet"
                ))),
            }
        }
    }
}

/// Frozen context of a forward: the config, name index and the target (embedding, LM head).
pub struct Frozen<'a> {
    config: &'a DsparkConfig,
    index: HashMap<String, usize>,
    target: &'a dyn LanguageModel,
    rope: (f32, f32),
}

impl<'a> Frozen<'a> {
    /// Binds a config and the target to the parameter layout of `params`.
    pub fn new(
        config: &'a DsparkConfig,
        params: &Params,
        target: &'a dyn LanguageModel,
    ) -> Result<Self> {
        Ok(Self {
            config,
            index: params
                .index()
                .into_iter()
                .map(|(k, v)| (k.to_owned(), v))
                .collect(),
            target,
            rope: rope_params(config)?,
        })
    }

    fn get<'p>(&self, p: &'p [Array], name: &str) -> std::result::Result<&'p Array, Exception> {
        self.index
            .get(name)
            .map(|&i| &p[i])
            .ok_or_else(|| Exception::custom(format!("the drafter has no tensor `{name}`")))
    }

    fn opt<'p>(&self, p: &'p [Array], name: &str) -> Option<&'p Array> {
        self.index.get(name).map(|&i| &p[i])
    }

    /// The teacher-forced forward of one sequence's anchors: corrected logits `[A, γ, V]` and
    /// confidence logits `[A, γ]` (when the drafter has a confidence head).
    pub fn forward(
        &self,
        p: &[Array],
        ex: &Example,
        b: &AnchorBatch,
    ) -> std::result::Result<(Array, Option<Array>), Exception> {
        let c = self.config;
        let (g, a, s) = (
            c.block_size as i32,
            b.anchors.len() as i32,
            ex.ids.len() as i32,
        );
        let n = a * g;
        let (d, hd) = (c.hidden_size, c.head_dim);
        let (nh, nkv) = (c.num_attention_heads, c.num_key_value_heads);
        let eps = c.rms_norm_eps as f32;
        let f32_ = |x: &Array| x.as_dtype(Dtype::Float32);
        let feats = fast::rms_norm(
            linear(&f32_(&ex.taps)?, self.get(p, "fc.weight")?, None)?,
            Some(self.get(p, "hidden_norm.weight")?),
            eps,
        )?;
        let ctx_pos = ops::arange::<_, i32>(0, s, None)?;
        let anchors: Vec<i32> = b.anchors.iter().map(|&x| x as i32).collect();
        let blk_pos = Array::from_slice(&anchors, &[a, 1])
            .add(&ops::arange::<_, i32>(0, g, None)?)?
            .reshape(&[n])?;
        let mask = block_mask(&b.anchors, s as usize, g as usize);
        let emb = self
            .target
            .embed(&b.block_ids.reshape(&[1, n])?)
            .map_err(exc)?;
        let mut h = f32_(&emb)?.reshape(&[n, d])?;
        let scale = c
            .attention_scale
            .unwrap_or(crate::engine::models::attention::inv_sqrt_scale(hd));
        let (base, rscale) = self.rope;
        let heads =
            |x: &Array, rows: i32, nheads: i32, norm: Option<&Array>, pos: Option<&Array>| {
                let x = x.reshape(&[rows, nheads, hd])?;
                let x = match norm {
                    Some(w) => fast::rms_norm(&x, Some(w), eps)?,
                    None => x,
                };
                let x = x.transpose_axes(&[1, 0, 2])?;
                match pos {
                    Some(pos) => rope_at(&x, pos, base, rscale),
                    None => Ok(x),
                }
            };
        for l in 0..c.num_hidden_layers {
            let w = |name: &str| self.get(p, &format!("layers.{l}.{name}"));
            let x = fast::rms_norm(&h, Some(w("input_layernorm.weight")?), eps)?;
            let (wq, wk, wv) = (
                w("self_attn.q_proj.weight")?,
                w("self_attn.k_proj.weight")?,
                w("self_attn.v_proj.weight")?,
            );
            let (qn, kn) = (w("self_attn.q_norm.weight")?, w("self_attn.k_norm.weight")?);
            let q = heads(&linear(&x, wq, None)?, n, nh, Some(qn), Some(&blk_pos))?;
            let kb = heads(&linear(&x, wk, None)?, n, nkv, Some(kn), Some(&blk_pos))?;
            let vb = heads(&linear(&x, wv, None)?, n, nkv, None, None)?;
            let kc = heads(&linear(&feats, wk, None)?, s, nkv, Some(kn), Some(&ctx_pos))?;
            let vc = heads(&linear(&feats, wv, None)?, s, nkv, None, None)?;
            let keys = ops::concatenate(&[kc, kb], 1)?.expand_dims(1)?;
            let vals = ops::concatenate(&[vc, vb], 1)?.expand_dims(1)?;
            let q = q.reshape(&[nkv, nh / nkv, n, hd])?;
            let scores = ops::matmul(&q, &keys.transpose_axes(&[0, 1, 3, 2])?)?
                .multiply(Array::from_f32(scale))?
                .add(&mask)?;
            let probs = ops::softmax_axis(&scores, -1, true)?;
            let out = ops::matmul(&probs, &vals)?
                .reshape(&[nh, n, hd])?
                .transpose_axes(&[1, 0, 2])?
                .reshape(&[n, nh * hd])?;
            h = h.add(&linear(&out, w("self_attn.o_proj.weight")?, None)?)?;
            let x = fast::rms_norm(&h, Some(w("post_attention_layernorm.weight")?), eps)?;
            let gate = linear(&x, w("mlp.gate_proj.weight")?, None)?;
            let up = linear(&x, w("mlp.up_proj.weight")?, None)?;
            let act = gate.multiply(ops::sigmoid(&gate)?)?.multiply(&up)?;
            h = h.add(&linear(&act, w("mlp.down_proj.weight")?, None)?)?;
        }
        let hidden = fast::rms_norm(&h, Some(self.get(p, "norm.weight")?), eps)?;
        let base_logits =
            f32_(&self.target.lm_head(&hidden).map_err(exc)?)?.reshape(&[a, g, -1])?;
        let hidden = hidden.reshape(&[a, g, d])?;
        let e = match self.opt(p, "markov_head.markov_w1.weight") {
            Some(w1) => Some(w1.take_axis(&b.prev_ids, 0)?),
            None => None,
        };
        let z = match (c.seq_head, &e) {
            (SeqHead::None, _) | (_, None) => base_logits,
            (kind, Some(e)) => {
                let inner = match kind {
                    SeqHead::Gated => {
                        let gw = self.get(p, "markov_head.gate_proj.weight")?;
                        let gb = self.opt(p, "markov_head.gate_proj.bias");
                        let gate =
                            linear(&ops::concatenate(&[hidden.clone(), e.clone()], -1)?, gw, gb)?;
                        ops::sigmoid(&gate)?.multiply(e)?
                    }
                    SeqHead::Rnn => self.rnn(p, &hidden, e)?,
                    _ => e.clone(),
                };
                base_logits.add(&linear(
                    &inner,
                    self.get(p, "markov_head.markov_w2.weight")?,
                    None,
                )?)?
            }
        };
        let conf = match self.opt(p, "confidence_head.proj.weight") {
            Some(cw) => {
                let input = match (&e, c.confidence_head_with_markov) {
                    (Some(e), true) => ops::concatenate(&[hidden.clone(), e.clone()], -1)?,
                    _ => hidden.clone(),
                };
                let cb = self.opt(p, "confidence_head.proj.bias");
                Some(linear(&input, cw, cb)?.squeeze_axes(&[-1])?)
            }
            None => None,
        };
        Ok((z, conf))
    }

    /// The RNN head's inner outputs `tanh(out_k)` `[A, γ, r]`, stepping the state over k.
    fn rnn(&self, p: &[Array], hidden: &Array, e: &Array) -> std::result::Result<Array, Exception> {
        let jw = self.get(p, "markov_head.joint_proj.weight")?;
        let jb = self.opt(p, "markov_head.joint_proj.bias");
        let (a, g, r) = (e.shape()[0], e.shape()[1], e.shape()[2]);
        let mut s = ops::zeros::<f32>(&[a, r])?;
        let mut outs = Vec::new();
        for k in 0..g {
            let ek = e.index((.., k));
            let hk = hidden.index((.., k));
            let z = linear(&ops::concatenate(&[s.clone(), ek, hk], -1)?, jw, jb)?;
            let parts = z.split_equal(3, -1)?;
            let gate = ops::sigmoid(&parts[0])?;
            s = gate.multiply(&s)?.add(
                &Array::from_f32(1.0)
                    .subtract(&gate)?
                    .multiply(ops::tanh(&parts[1])?)?,
            )?;
            outs.push(ops::tanh(&parts[2])?.expand_dims(1)?);
        }
        ops::concatenate(&outs, 1)
    }

    /// Summed loss terms of one sequence (see [`loss_sums`]).
    pub fn sums(
        &self,
        p: &[Array],
        ex: &Example,
        b: &AnchorBatch,
    ) -> std::result::Result<[Array; 4], Exception> {
        let (z, conf) = self.forward(p, ex, b)?;
        let rows = ex.last_hidden.take_axis(&b.target_rows, 0)?;
        let tl = mlx_rs::stop_gradient(&self.target.lm_head(&rows).map_err(exc)?)?;
        loss_sums(&z, &tl, conf.as_ref(), &b.targets, &b.weights)
    }
}

/// Training options (what `mlxb train-dspark` decides).
#[derive(Debug, Clone, serde::Serialize, serde::Deserialize, PartialEq)]
pub struct TrainOptions {
    /// Total optimizer steps.
    pub steps: u64,
    /// Sequences per step.
    pub batch: usize,
    /// Anchors sampled per sequence.
    pub anchors: usize,
    /// Peak learning rate.
    pub lr: f64,
    /// Warm-up fraction of the steps.
    pub warmup: f64,
    /// Global gradient-norm clip.
    pub clip: f64,
    /// Decoupled weight decay.
    pub weight_decay: f64,
    /// Seed of the sequence order and anchors.
    pub seed: u64,
    /// Write a checkpoint every this many steps (and at the end).
    pub checkpoint_every: u64,
}

impl Default for TrainOptions {
    fn default() -> Self {
        Self {
            steps: 100,
            batch: 4,
            anchors: 32,
            lr: 6e-4,
            warmup: 0.04,
            clip: 1.0,
            weight_decay: 0.0,
            seed: 42,
            checkpoint_every: 50,
        }
    }
}

impl TrainOptions {
    /// The learning rate of (0-based) step `t`: linear warm-up over `ceil(warmup * steps)`
    /// steps, then cosine decay to 0.
    pub fn lr_at(&self, t: u64) -> f64 {
        let warm = (self.warmup * self.steps as f64).ceil() as u64;
        if t < warm {
            return self.lr * (t + 1) as f64 / warm as f64;
        }
        let span = (self.steps - warm).max(1) as f64;
        let frac = ((t - warm) as f64 / span).min(1.0);
        self.lr * 0.5 * (1.0 + (std::f64::consts::PI * frac).cos())
    }

    /// The example indices of step `t` over `n` examples: epoch-wise shuffles from the seed.
    pub fn step_examples(&self, t: u64, n: usize) -> Vec<usize> {
        (0..self.batch as u64)
            .map(|j| {
                let global = t * self.batch as u64 + j;
                let (epoch, pos) = (global / n as u64, (global % n as u64) as usize);
                let mut order: Vec<usize> = (0..n).collect();
                SplitMix::new(self.seed, 0x5eed_0000 + epoch).shuffle(&mut order);
                order[pos]
            })
            .collect()
    }
}

/// AdamW state (β = 0.9, 0.999, ε = 1e-8, as torch's defaults DeepSpec uses).
pub struct AdamW {
    /// Steps taken.
    pub step: u64,
    /// First moments.
    pub m: Vec<Array>,
    /// Second moments.
    pub v: Vec<Array>,
}

impl AdamW {
    /// Zero moments for `params`.
    pub fn new(params: &Params) -> Result<Self> {
        let zeros = || -> Result<Vec<Array>> {
            params
                .values
                .iter()
                .map(|p| Ok(ops::zeros_like(p)?))
                .collect()
        };
        Ok(Self {
            step: 0,
            m: zeros()?,
            v: zeros()?,
        })
    }

    /// One update with `grads` clipped to global norm `opts.clip`; returns the pre-clip norm.
    pub fn update(
        &mut self,
        params: &mut Params,
        grads: &[Array],
        opts: &TrainOptions,
    ) -> Result<f32> {
        let (b1, b2, eps) = (0.9f32, 0.999f32, 1e-8f32);
        let lr = opts.lr_at(self.step) as f32;
        let mut sq = Array::from_f32(0.0);
        for g in grads {
            sq = sq.add(&g.square()?.sum(false)?)?;
        }
        let norm = sq.sqrt()?;
        norm.eval()?;
        let norm_v = norm.item_cast::<f32>();
        let coef = if norm_v.is_finite() && norm_v > opts.clip as f32 {
            opts.clip as f32 / (norm_v + 1e-6)
        } else {
            1.0
        };
        self.step += 1;
        let t = self.step as i32;
        let (c1, c2) = (1.0 - b1.powi(t), 1.0 - b2.powi(t));
        let s = Array::from_f32;
        let slots = params
            .values
            .iter_mut()
            .zip(self.m.iter_mut())
            .zip(self.v.iter_mut());
        for (g, ((p, m), v)) in grads.iter().zip(slots) {
            let g = g.multiply(s(coef))?;
            let m_new = m.multiply(s(b1))?.add(&g.multiply(s(1.0 - b1))?)?;
            let v_new = v
                .multiply(s(b2))?
                .add(&g.square()?.multiply(s(1.0 - b2))?)?;
            let decayed = p.multiply(s(1.0 - lr * opts.weight_decay as f32))?;
            let upd = m_new
                .divide(s(c1))?
                .divide(&v_new.divide(s(c2))?.sqrt()?.add(s(eps))?)?;
            *p = decayed.subtract(&upd.multiply(s(lr))?)?;
            *m = m_new;
            *v = v_new;
        }
        let all: Vec<&Array> = params.values.iter().chain(&self.m).chain(&self.v).collect();
        mlx_rs::transforms::eval(all)?;
        Ok(norm_v)
    }
}

/// What one step reported.
#[derive(Debug, Clone, Copy)]
pub struct StepReport {
    /// Step index (1-based, after the update).
    pub step: u64,
    /// Total loss before the update.
    pub loss: f32,
    /// Weighted CE, L1 and BCE (each over the global weight).
    pub terms: [f32; 3],
    /// Gradient norm before clipping.
    pub grad_norm: f32,
    /// Learning rate used.
    pub lr: f64,
}

/// The loss (and its terms) of `params` over `examples` with the anchors of step `t`, and the
/// gradients when `grad` is set.
pub fn step_loss(
    frozen: &Frozen<'_>,
    params: &Params,
    examples: &[&Example],
    opts: &TrainOptions,
    t: u64,
    grad: bool,
) -> Result<(f32, [f32; 3], Option<Vec<Array>>)> {
    let gamma = frozen.config.block_size;
    let mask_id = frozen.config.mask_token_id;
    let batches: Vec<(&Example, AnchorBatch)> = examples
        .iter()
        .enumerate()
        .map(|(j, ex)| {
            let mut rng = SplitMix::new(opts.seed, (t << 16) ^ j as u64);
            let anchors = sample_anchors(&ex.mask, opts.anchors, &mut rng);
            (*ex, anchor_batch(ex, &anchors, gamma, mask_id))
        })
        .filter(|(_, b)| !b.anchors.is_empty())
        .collect();
    if batches.is_empty() {
        return Err(EngineError::Input(
            "no training sequence in this step has two consecutive loss tokens".into(),
        ));
    }
    let f = |p: &[Array]| -> std::result::Result<Vec<Array>, Exception> {
        let mut acc: Option<[Array; 4]> = None;
        for (ex, b) in &batches {
            let s = frozen.sums(p, ex, b)?;
            acc = Some(match acc {
                None => s,
                Some(a) => [
                    a[0].add(&s[0])?,
                    a[1].add(&s[1])?,
                    a[2].add(&s[2])?,
                    a[3].add(&s[3])?,
                ],
            });
        }
        let sums = acc.ok_or_else(|| Exception::custom("empty batch"))?;
        let total = total_loss(&sums)?;
        let den = ops::maximum(&sums[3], Array::from_f32(1e-12))?;
        Ok(vec![
            total,
            sums[0].divide(&den)?,
            sums[1].divide(&den)?,
            sums[2].divide(&den)?,
        ])
    };
    let (vals, grads) = if grad {
        let argnums: Vec<i32> = (0..params.values.len() as i32).collect();
        let mut vg = mlx_rs::transforms::value_and_grad_with_argnums(f, argnums.as_slice());
        let (v, g) = vg(&params.values)?;
        (v, Some(g))
    } else {
        (f(&params.values)?, None)
    };
    mlx_rs::transforms::eval(vals.iter())?;
    Ok((
        vals[0].item_cast::<f32>(),
        [
            vals[1].item_cast::<f32>(),
            vals[2].item_cast::<f32>(),
            vals[3].item_cast::<f32>(),
        ],
        grads,
    ))
}

/// A training run: target, drafter config, parameters, optimizer and where it saves.
pub struct Trainer<'a> {
    /// Frozen parts.
    pub frozen: Frozen<'a>,
    /// Trainable parameters.
    pub params: Params,
    /// Optimizer state.
    pub opt: AdamW,
    /// Options.
    pub opts: TrainOptions,
    /// Output checkpoint directory.
    pub out: PathBuf,
    /// Dtype the drafter weights are written in.
    pub save_dtype: Dtype,
}

impl<'a> Trainer<'a> {
    /// One optimizer step over the examples of the current step.
    pub fn step(&mut self, examples: &[Example]) -> Result<StepReport> {
        let t = self.opt.step;
        let chosen: Vec<&Example> = self
            .opts
            .step_examples(t, examples.len())
            .into_iter()
            .map(|i| &examples[i])
            .collect();
        let (loss, terms, grads) =
            step_loss(&self.frozen, &self.params, &chosen, &self.opts, t, true)?;
        let grads = grads.ok_or_else(|| EngineError::Runtime("no gradients".into()))?;
        let lr = self.opts.lr_at(t);
        let grad_norm = self.opt.update(&mut self.params, &grads, &self.opts)?;
        Ok(StepReport {
            step: self.opt.step,
            loss,
            terms,
            grad_norm,
            lr,
        })
    }

    /// Writes the training state and then the drafter (`model.safetensors` + `dspark.json`),
    /// each atomically. State first: a run killed in between leaves either no `dspark.json`
    /// (a plain re-run starts over) or an older drafter next to a newer state (`--resume`
    /// continues from the state), never a checkpoint that neither can continue.
    pub fn save(&self) -> Result<()> {
        std::fs::create_dir_all(&self.out).map_err(|e| {
            EngineError::file(&self.out, format!("cannot create the directory ({e})"))
        })?;
        save_state(&self.out, &self.params, &self.opt, &self.opts)?;
        self.save_drafter()
    }

    /// Writes only the drafter from the current parameters.
    pub fn save_drafter(&self) -> Result<()> {
        checkpoint::save(
            &self.out,
            self.frozen.config,
            &self.params.to_tensors(self.save_dtype)?,
        )
    }

    /// Whether `on_disk` (a drafter's tensors) is exactly the drafter the current parameters
    /// save as: same names, dtypes, shapes and bits. A run killed between [`Self::save`]'s two
    /// writes leaves an older drafter next to a newer state; `--resume` checks this to repair it.
    pub fn drafter_matches(&self, on_disk: &HashMap<String, Array>) -> Result<bool> {
        let current = self.params.to_tensors(self.save_dtype)?;
        if current.len() != on_disk.len() {
            return Ok(false);
        }
        for (name, a) in &current {
            let Some(b) = on_disk.get(name) else {
                return Ok(false);
            };
            if !same_bits(a, b)? {
                return Ok(false);
            }
        }
        Ok(true)
    }
}

/// Writes the training state (f32 parameters, moments, step, options) atomically.
pub fn save_state(dir: &Path, params: &Params, opt: &AdamW, opts: &TrainOptions) -> Result<()> {
    let mut arrays: Vec<(String, &Array)> = Vec::new();
    for (i, name) in params.names.iter().enumerate() {
        arrays.push((format!("p.{name}"), &params.values[i]));
        arrays.push((format!("m.{name}"), &opt.m[i]));
        arrays.push((format!("v.{name}"), &opt.v[i]));
    }
    let mut meta = HashMap::new();
    meta.insert("step".to_owned(), opt.step.to_string());
    meta.insert(
        "options".to_owned(),
        serde_json::to_string(opts).map_err(|e| EngineError::Runtime(e.to_string()))?,
    );
    let tmp = dir.join(format!("tmp-{STATE_FILE}"));
    Array::save_safetensors(arrays, &meta, &tmp)
        .map_err(|e| EngineError::file(&tmp, format!("cannot write the training state ({e})")))?;
    std::fs::rename(&tmp, dir.join(STATE_FILE))
        .map_err(|e| EngineError::file(dir, format!("cannot write {STATE_FILE} ({e})")))
}

/// Reads a training state written by [`save_state`] into `params` (names must match) and
/// returns the optimizer and the saved options.
pub fn load_state(dir: &Path, params: &mut Params) -> Result<(AdamW, TrainOptions)> {
    let path = dir.join(STATE_FILE);
    let bad = |r: String| EngineError::file(&path, r);
    let (arrays, meta) = Array::load_safetensors_with_metadata(&path).map_err(|e| {
        bad(format!(
            "cannot read the training state ({e}); start without --resume"
        ))
    })?;
    let step = meta
        .get("step")
        .and_then(|s| s.parse::<u64>().ok())
        .ok_or_else(|| bad("the training state has no step".into()))?;
    let opts: TrainOptions = meta
        .get("options")
        .and_then(|s| serde_json::from_str(s).ok())
        .ok_or_else(|| bad("the training state has no options".into()))?;
    let mut opt = AdamW::new(params)?;
    opt.step = step;
    for (i, name) in params.names.iter().enumerate() {
        let get = |prefix: &str| {
            arrays
                .get(&format!("{prefix}.{name}"))
                .cloned()
                .ok_or_else(|| {
                    bad(format!(
                        "tensor `{name}` is missing; the state belongs to another drafter"
                    ))
                })
        };
        let p = get("p")?;
        if p.shape() != params.values[i].shape() {
            return Err(bad(format!(
                "tensor `{name}` has another shape; the state belongs to another drafter"
            )));
        }
        params.values[i] = p;
        opt.m[i] = get("m")?;
        opt.v[i] = get("v")?;
    }
    if arrays.len() != 3 * params.names.len() {
        return Err(bad(
            "the state has extra tensors; it belongs to another drafter".into(),
        ));
    }
    Ok((opt, opts))
}
