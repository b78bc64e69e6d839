//! The functional, differentiable forward of a drafter over many anchors of one cached sequence
//! at once, next to the trainable parameters it reads.
//!
//! - **Parameters** ([`Params`]): every drafter tensor except `embed_tokens` / `lm_head` (the
//!   target's, frozen and shared), as f32 master weights in name order.
//! - **Forward** ([`Frozen::forward`]): teacher-forced blocks `[x_p, MASK x (γ-1)]` at positions
//!   `p..p+γ-1`; block rows of anchor `p` see the context rows `< p` and their own block
//!   (non-causal), exactly what inference sees; the sequential head's previous token is the
//!   ground-truth `x_{p+k}`.

use crate::engine::error::{EngineError, Result};
use crate::engine::models::LanguageModel;
use crate::spec::dspark::checkpoint::{DsparkConfig, LayerStyle, SeqHead};
use crate::spec::dspark::vocab::DraftVocab;
use mlx_rs::error::Exception;
use mlx_rs::ops::indexing::IndexOp;
use mlx_rs::{fast, ops, Array, Dtype};
use std::collections::{BTreeMap, HashMap};

use super::example::{AnchorBatch, Example};
use super::loss::{loss_sums, Target, VocabMap};

/// The draft-vocabulary tensors of a checkpoint: fixed by the chosen ids, never trained.
const VOCAB_TENSORS: [&str; 2] = ["d2t", "t2d"];

fn exc(e: EngineError) -> Exception {
    Exception::custom(e.to_string())
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
            .filter(|(k, _)| {
                !k.starts_with("embed_tokens.")
                    && !k.starts_with("lm_head.")
                    && !VOCAB_TENSORS.contains(&k.as_str())
            })
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

    /// The tensors as a map in `dtype` (for [`crate::spec::dspark::checkpoint::save`]).
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
    pub(super) config: &'a DsparkConfig,
    index: HashMap<String, usize>,
    target: &'a dyn LanguageModel,
    rope: (f32, f32),
    head: Option<DraftHead>,
}

/// A reduced draft vocabulary as training sees it: the drafter scores only these target ids,
/// exactly as it will at inference ([`crate::spec::dspark::vocab`]), so training spends its
/// output-head work where proposals can land.
pub struct DraftHead {
    /// The chosen target ids, ascending.
    pub ids: Vec<u32>,
    map: VocabMap,
    /// The target's output head at the draft ids `[Vd, d]` (f32).
    rows: Array,
}

impl DraftHead {
    /// The head of `ids` (ascending target ids) over `target`'s output head. Refuses
    /// soft-capped targets, as inference does.
    pub fn new(ids: Vec<u32>, target: &dyn LanguageModel, config: &DsparkConfig) -> Result<Self> {
        if config.final_logit_softcapping.is_some() {
            return Err(EngineError::Input(
                "a reduced draft vocabulary needs a target without soft-capped logits; train this drafter without --draft-vocab".into(),
            ));
        }
        let rows = DraftVocab::from_ids(&ids).target_head_rows(
            target,
            |x| target.lm_head(x),
            config.hidden_size,
            Dtype::Float32,
        )?;
        Ok(Self {
            map: VocabMap::new(&ids, config.vocab_size as usize),
            ids,
            rows,
        })
    }
}

impl<'a> Frozen<'a> {
    /// Binds a config and the target to the parameter layout of `params`.
    pub fn new(
        config: &'a DsparkConfig,
        params: &Params,
        target: &'a dyn LanguageModel,
        head: Option<DraftHead>,
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
            head,
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

    /// The reduced draft vocabulary trained on, if any.
    pub fn draft_head(&self) -> Option<&DraftHead> {
        self.head.as_ref()
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
        let base_logits = match &self.head {
            Some(head) => linear(&hidden, &head.rows, None)?,
            None => f32_(&self.target.lm_head(&hidden).map_err(exc)?)?,
        }
        .reshape(&[a, g, -1])?;
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
                let w2 = self.get(p, "markov_head.markov_w2.weight")?;
                let w2 = match &self.head {
                    Some(head) => w2.take_axis(&head.map.target_ids, 0)?,
                    None => w2.clone(),
                };
                base_logits.add(&linear(&inner, &w2, None)?)?
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
    ) -> std::result::Result<[Array; 5], Exception> {
        let (z, conf) = self.forward(p, ex, b)?;
        let rows = ex.last_hidden.take_axis(&b.target_rows, 0)?;
        let tl = mlx_rs::stop_gradient(&self.target.lm_head(&rows).map_err(exc)?)?;
        let target = Target::new(&tl, &b.targets, self.head.as_ref().map(|h| &h.map))?;
        loss_sums(&z, &target, conf.as_ref(), &b.weights)
    }
}
