//! Pieces the decoders here share: the decoder loop itself ([`run`], with the hooks an
//! architecture plugs into it, [`Decoder`]), the pre-norm residual layer, the LM head (untied
//! or tied to the embedding) and the plain llama attention shape.

use super::attention::{inv_sqrt_scale, AttentionShape};
use super::{Caches, ForwardOpts, ForwardOut, LanguageModel};
use crate::engine::cache::{ArraysCache, AttentionMask, FullCache, KvCache, RotatingCache};
use crate::engine::error::{EngineError, Result};
use crate::engine::kernels;
use crate::engine::nn::{Embedding, Linear, RmsNorm};
use crate::engine::weights::WeightStore;
use mlx_rs::Array;

/// Which mask a layer attends with: mlx-lm builds one mask per kind, from the cache of the
/// first layer of that kind.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum LayerKind {
    /// Full causal attention.
    Full,
    /// Sliding-window attention (the window is [`Decoder::sliding_window`]).
    Sliding,
    /// A recurrent layer (linear attention) over an `ArraysCache` of two slots (the conv and
    /// the recurrent state); it is handed the full-attention mask and ignores it.
    Recurrent,
}

/// What an architecture plugs into [`run`]: the parts of mlx-lm's `Model.__call__` that differ
/// between architectures. The architecture file keeps its args, its block and its weight
/// sanitising; the loop around them lives here once.
///
/// `P` is what one call builds before the first layer and hands to every block (gemma4's
/// per-layer inputs and the keys/values its KV-shared layers reuse); `()` for most.
pub trait Decoder<P: Default = ()>: LanguageModel {
    /// Number of decoder layers.
    fn layer_count(&self) -> usize;

    /// Layer `i`'s kind, which picks its mask.
    fn layer_kind(&self, _i: usize) -> LayerKind {
        LayerKind::Full
    }

    /// The window of [`LayerKind::Sliding`] layers' mask.
    fn sliding_window(&self) -> Option<i32> {
        None
    }

    /// Whether the full-attention mask is always an explicit array (mlx-lm's
    /// `create_attention_mask(.., return_array=True)`, as gemma2 asks).
    fn full_mask_array(&self) -> bool {
        false
    }

    /// How many leading layers keep a cache of their own; later layers get none (gemma4's
    /// KV-shared layers) and need none given.
    fn cached_layers(&self) -> usize {
        self.layer_count()
    }

    /// A path that serves the whole call instead of the loop when it returns `Some` (llama's
    /// host decode step); called once the options are checked.
    fn shortcut(
        &mut self,
        _inputs: &Array,
        _caches: &mut Caches,
        _opts: &ForwardOpts,
    ) -> Result<Option<ForwardOut>> {
        Ok(None)
    }

    /// What the first layer receives for ids `[B, L]`: [`LanguageModel::embed`], for
    /// architectures that expose it.
    fn input(&self, inputs: &Array) -> Result<Array> {
        self.embed(inputs)
    }

    /// Builds the call's `P` from the ids and the embedded input.
    fn begin(&self, _inputs: &Array, _h: &Array) -> Result<P> {
        Ok(P::default())
    }

    /// Runs layer `i` on the residual stream `h`.
    fn block(&mut self, i: usize, h: &Array, io: LayerIo<'_, P>) -> Result<Array>;

    /// Logits from the last layer's output: [`LanguageModel::final_norm`] then
    /// [`LanguageModel::lm_head`], for architectures that expose them.
    fn output(&mut self, h: &Array) -> Result<Array> {
        self.lm_head(&self.final_norm(h)?)
    }
}

/// The decoder loop: embed → one mask per layer kind → each layer's block with its mask and
/// cache (capturing `opts.taps`) → final norm and LM head, stopping after `opts.exit_after`
/// layers when asked.
pub fn run<P: Default, M: Decoder<P>>(
    m: &mut M,
    inputs: &Array,
    caches: &mut Caches,
    opts: &ForwardOpts,
) -> Result<ForwardOut> {
    let run = opts.layers_to_run(m.layer_count(), m.cached_layers(), caches.len())?;
    if let Some(out) = m.shortcut(inputs, caches, opts)? {
        return Ok(out);
    }
    let mut h = m.input(inputs)?;
    let mut pass = m.begin(inputs, &h)?;
    let n = h.shape()[1];
    let cached = run.min(m.cached_layers());
    // Every cache of one kind has the same offset, so the first one gives mlx-lm's mask.
    let first = |kind| (0..cached).find(|&i| m.layer_kind(i) == kind);
    let full = match first(LayerKind::Full) {
        Some(i) => caches[i].make_mask(n, None, m.full_mask_array())?,
        None => AttentionMask::None,
    };
    let sliding = match first(LayerKind::Sliding) {
        Some(i) => caches[i].make_mask(n, m.sliding_window(), false)?,
        None => AttentionMask::None,
    };
    // `create_ssm_mask`: none for one sequence, a batch's padding for recurrent layers.
    let recurrent = match first(LayerKind::Recurrent) {
        Some(i) => caches[i].make_mask(n, None, false)?,
        None => AttentionMask::None,
    };
    let mut taps = Vec::new();
    let mut own = caches.iter_mut().take(cached);
    for i in 0..run {
        let mask = match m.layer_kind(i) {
            LayerKind::Sliding => &sliding,
            LayerKind::Full => &full,
            LayerKind::Recurrent => &recurrent,
        };
        let cache = own.next().map(|c| -> &mut dyn KvCache { c.as_mut() });
        let io = LayerIo {
            mask,
            cache,
            pass: &mut pass,
        };
        h = m.block(i, &h, io)?;
        opts.capture(i, &h, &mut taps);
    }
    let logits = m.output(&h)?;
    Ok(ForwardOut {
        logits,
        taps: opts.finish_taps(taps),
    })
}

/// mlx-lm's `make_prompt_cache` for a decoder: per layer that keeps a cache, a `KVCache`, a
/// `RotatingKVCache` of the sliding window, or an `ArraysCache`, by its [`LayerKind`].
pub fn make_caches<P: Default, M: Decoder<P>>(m: &M) -> Caches {
    (0..m.cached_layers())
        .map(|i| -> Box<dyn KvCache> {
            match (m.layer_kind(i), m.sliding_window()) {
                (LayerKind::Sliding, Some(w)) => Box::new(RotatingCache::new(w, 0)),
                (LayerKind::Recurrent, _) => Box::new(ArraysCache::new(2)),
                _ => Box::new(FullCache::new()),
            }
        })
        .collect()
}

/// What [`run`] hands a layer besides the residual stream.
pub struct LayerIo<'a, P = ()> {
    /// The mask of the layer's kind.
    pub mask: &'a AttentionMask,
    /// The layer's cache; `None` past [`Decoder::cached_layers`].
    pub cache: Option<&'a mut dyn KvCache>,
    /// The call's state (see [`Decoder`]).
    pub pass: &'a mut P,
}

impl<'a, P> LayerIo<'a, P> {
    /// The mask and the cache of a layer that keeps one.
    pub fn attention(self) -> Result<(&'a AttentionMask, &'a mut dyn KvCache)> {
        let cache = self.cache.ok_or_else(|| {
            EngineError::Runtime("a decoder layer that keeps a cache was run without one".into())
        })?;
        Ok((self.mask, cache))
    }
}

/// A llama-style layer's two pre-norm residual halves:
/// `h = x + mixer(input_layernorm(x))`, then `h + ffn(post_attention_layernorm(h))`.
pub struct PreNormLayer {
    input_layernorm: RmsNorm,
    post_attention_layernorm: RmsNorm,
    /// `--host-elementwise`: residual adds of f32 or bfloat16 data already on the host stay
    /// there.
    host: bool,
}

impl PreNormLayer {
    /// Loads `{prefix}.input_layernorm` and `{prefix}.post_attention_layernorm`.
    pub fn load(w: &mut WeightStore, prefix: &str, dim: i32, eps: f64) -> Result<Self> {
        Ok(Self {
            input_layernorm: RmsNorm::load(w, &format!("{prefix}.input_layernorm"), dim, eps)?,
            post_attention_layernorm: RmsNorm::load(
                w,
                &format!("{prefix}.post_attention_layernorm"),
                dim,
                eps,
            )?,
            host: w.host_elementwise(),
        })
    }

    /// The two norms on the host, for a host decode step of `form` (`None` unless both are
    /// f32, or both bfloat16 for the exact step, and, for the exact step, their host form
    /// matched MLX's).
    pub fn host_norms(&self, form: kernels::HostForm) -> Result<Option<HostNorms>> {
        let (a, b) = (
            self.input_layernorm.host_weight(form)?,
            self.post_attention_layernorm.host_weight(form)?,
        );
        let dtype = self.input_layernorm.dtype();
        Ok(match (a, b) {
            (Some((input, eps)), Some((post, _)))
                if self.post_attention_layernorm.dtype() == dtype =>
            {
                Some(HostNorms {
                    input,
                    post,
                    eps,
                    dtype,
                })
            }
            _ => None,
        })
    }

    /// Runs the layer with its token mixer and feed-forward branches.
    pub fn forward(
        &self,
        x: &Array,
        mixer: impl FnOnce(&Array) -> Result<Array>,
        ffn: impl FnOnce(&Array) -> Result<Array>,
    ) -> Result<Array> {
        let h = self.residual(x, &mixer(&self.input_layernorm.forward(x)?)?)?;
        self.residual(&h, &ffn(&self.post_attention_layernorm.forward(&h)?)?)
    }

    /// `x + y`; on the host when both are same-shape f32 or bfloat16 data already there (the
    /// host decode step's case), so the next norm and products need not wait for MLX.
    fn residual(&self, x: &Array, y: &Array) -> Result<Array> {
        if self.host && kernels::host_allowed() && x.shape() == y.shape() {
            if let (Some(a), Some(b)) = (kernels::ready_f32(x), kernels::ready_f32(y)) {
                let mut out = vec![0.0; a.len()];
                kernels::elementwise::add(a, b, &mut out);
                return Ok(Array::from_slice(&out, x.shape()));
            }
            if let (Some(a), Some(b)) = (kernels::ready_bf16(x), kernels::ready_bf16(y)) {
                let mut out = vec![half::bf16::ZERO; a.len()];
                kernels::elementwise::add_bf16(a, b, &mut out);
                return Ok(Array::from_slice(&out, x.shape()));
            }
        }
        Ok(x.add(y)?)
    }
}

/// A [`PreNormLayer`]'s norm weights as host vectors.
pub struct HostNorms {
    /// `input_layernorm` weight.
    pub input: Vec<f32>,
    /// `post_attention_layernorm` weight.
    pub post: Vec<f32>,
    /// Their epsilon.
    pub eps: f32,
    /// Their weights' dtype (the values above are widened).
    pub dtype: mlx_rs::Dtype,
}

/// The output projection: `lm_head`, or the embedding's `as_linear` when tied.
pub struct LmHead(Option<Linear>);

impl LmHead {
    /// Loads `{path}` (`[vocab, dim]`) unless the head is tied.
    pub fn load(w: &mut WeightStore, tied: bool, path: &str, dim: i32, vocab: i32) -> Result<Self> {
        Ok(Self(if tied {
            None
        } else {
            Some(Linear::load(w, path, dim, vocab, false)?)
        }))
    }

    /// Logits for the final hidden states.
    pub fn forward(&self, embed: &Embedding, x: &Array) -> Result<Array> {
        match &self.0 {
            Some(head) => head.forward(x),
            None => embed.as_linear(x),
        }
    }
}

/// A llama block's attention shape: no biases, no q/k norms, scale `head_dim**-0.5`.
pub fn plain_attention(
    hidden: i32,
    n_heads: i32,
    n_kv_heads: i32,
    head_dim: i32,
) -> AttentionShape {
    AttentionShape {
        hidden,
        n_heads,
        n_kv_heads,
        head_dim,
        qkv_bias: false,
        o_bias: false,
        qk_norm_eps: None,
        scale: inv_sqrt_scale(head_dim),
    }
}
