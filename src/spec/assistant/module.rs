//! The assistant network: one drafted token per [`AssistantModule::step`] (spec §5).
//!
//! `x = pre_projection([E·√B ; h])`, then 4 Gemma 4 layers whose attention is q-only over a
//! donor target layer's keys/values (q_norm, the layer type's RoPE at the anchor position,
//! scale 1, sliding layers see only the last `sliding_window` keys), sandwich norms, a
//! gelu-tanh gated MLP and the layer scalar; `hn = norm(x)`; logits from the tied dense head or
//! the centroid head; `post_projection(hn)` is the next step's `h`.

use super::config::{kv_shape, Checked};
use crate::engine::cache::AttentionMask;
use crate::engine::error::{EngineError, Result};
use crate::engine::models::activations::{geglu, CompiledOp};
use crate::engine::models::attention::sdpa;
use crate::engine::models::gemma4_text::{load_rope, FULL, SLIDING};
use crate::engine::models::mlp::GatedMlp;
use crate::engine::models::rope::Rope;
use crate::engine::models::switch::top_k_indices;
use crate::engine::models::ModelSpec;
use crate::engine::nn::{weak_scalar, Embedding, Linear, RmsNorm};
use crate::engine::weights::WeightStore;
use mlx_rs::{ops, Array};
use std::path::Path;

/// One drafter layer (every one KV-shared: no k/v projections).
struct Layer {
    q_proj: Linear,
    o_proj: Linear,
    q_norm: RmsNorm,
    input_layernorm: RmsNorm,
    post_attention_layernorm: RmsNorm,
    pre_feedforward_layernorm: RmsNorm,
    post_feedforward_layernorm: RmsNorm,
    mlp: GatedMlp,
    layer_scalar: Array,
    rope: Rope,
    n_heads: i32,
    head_dim: i32,
    /// Index into the step's donor keys/values.
    donor: usize,
}

/// The E2B/E4B "ordered embeddings" head.
struct CentroidHead {
    centroids: Linear,
    /// `token_ordering` viewed as `[num_centroids, vocab / num_centroids]`.
    ordering: Array,
    top_k: i32,
}

/// Borrowed keys/values of one donor layer `[1, H_kv, n, D]`, already limited to what the
/// drafter's layers of that type may see.
#[derive(Clone)]
pub struct DonorKv {
    /// Keys (post-k_norm, post-RoPE, as the target stored them).
    pub keys: Array,
    /// Values (post-v_norm).
    pub values: Array,
}

/// The loaded assistant network.
pub struct AssistantModule {
    pre_projection: Linear,
    post_projection: Linear,
    layers: Vec<Layer>,
    norm: RmsNorm,
    embed: Embedding,
    centroid: Option<CentroidHead>,
    geglu: CompiledOp,
    vocab: i32,
    /// Per donor slot: `(is_full, target cache index)`.
    donor_slots: Vec<(bool, usize)>,
    sliding_window: i32,
}

impl AssistantModule {
    /// Builds the network from the checked config and the checkpoint's tensors.
    pub fn build(
        c: &Checked,
        w: &mut WeightStore,
        config_path: &Path,
        compiled: bool,
    ) -> Result<Self> {
        let t = &c.text;
        let (h, b, eps) = (t.hidden_size, c.config.backbone_hidden_size, t.rms_norm_eps);
        let spec = ModelSpec {
            config_path: config_path.to_path_buf(),
            config: c.config.text_config.clone().unwrap_or_default(),
            forks: Default::default(),
        };
        let rope_params = t.rope_parameters();
        // The tied head may be stored as well; it is the embedding table.
        w.discard("lm_head.weight");
        w.discard_matching("rotary_emb");
        let mut donor_slots: Vec<(bool, usize)> = Vec::new();
        let mut layers = Vec::with_capacity(c.donors.len());
        for (i, &(full, donor)) in c.donors.iter().enumerate() {
            let p = format!("model.layers.{i}");
            let (_, d) = kv_shape(t, full);
            let q = t.num_attention_heads * d;
            let slot = match donor_slots.iter().position(|s| *s == (full, donor)) {
                Some(s) => s,
                None => {
                    donor_slots.push((full, donor));
                    donor_slots.len() - 1
                }
            };
            let norm = |w: &mut WeightStore, n: &str| RmsNorm::load(w, &format!("{p}.{n}"), h, eps);
            let kind = if full { FULL } else { SLIDING };
            layers.push(Layer {
                q_proj: Linear::load(w, &format!("{p}.self_attn.q_proj"), h, q, false)?,
                o_proj: Linear::load(w, &format!("{p}.self_attn.o_proj"), q, h, false)?,
                q_norm: RmsNorm::load(w, &format!("{p}.self_attn.q_norm"), d, eps)?,
                input_layernorm: norm(w, "input_layernorm")?,
                post_attention_layernorm: norm(w, "post_attention_layernorm")?,
                pre_feedforward_layernorm: norm(w, "pre_feedforward_layernorm")?,
                post_feedforward_layernorm: norm(w, "post_feedforward_layernorm")?,
                mlp: GatedMlp::load(w, &format!("{p}.mlp"), h, t.intermediate_size, false)?,
                layer_scalar: w.take(&format!("{p}.layer_scalar"), &[1])?,
                rope: load_rope(&spec, t, &rope_params, kind, d)?,
                n_heads: t.num_attention_heads,
                head_dim: d,
                donor: slot,
            });
        }
        let centroid = if c.config.use_ordered_embeddings {
            let (nc, k) = (c.config.num_centroids, c.config.centroid_intermediate_top_k);
            let ordering = w.take("masked_embedding.token_ordering", &[t.vocab_size])?;
            Some(CentroidHead {
                centroids: Linear::load(w, "masked_embedding.centroids", h, nc, false)?,
                ordering: ordering.reshape(&[nc, t.vocab_size / nc])?,
                top_k: k,
            })
        } else {
            w.discard("masked_embedding.token_ordering");
            None
        };
        Ok(Self {
            pre_projection: Linear::load(w, "pre_projection", 2 * b, h, false)?,
            post_projection: Linear::load(w, "post_projection", h, b, false)?,
            layers,
            norm: RmsNorm::load(w, "model.norm", h, eps)?,
            embed: Embedding::load(w, "model.embed_tokens", t.vocab_size, h)?,
            centroid,
            geglu: geglu(compiled),
            vocab: t.vocab_size,
            donor_slots,
            sliding_window: c.sliding_window,
        })
    }

    /// `(is_full, target cache index)` of each donor slot [`Self::step`] takes, in order.
    pub fn donor_slots(&self) -> &[(bool, usize)] {
        &self.donor_slots
    }

    /// The window the sliding layers attend.
    pub fn sliding_window(&self) -> i32 {
        self.sliding_window
    }

    /// One drafted token: `embedding` (`E(tok)·√B`, `[1, 1, B]`) and `hidden` (`[1, 1, B]`) at
    /// anchor `position`, attending `donors` (one per [`Self::donor_slots`]). Returns the logits
    /// `[1, 1, V]` and the next step's hidden `[1, 1, B]`.
    pub fn step(
        &mut self,
        embedding: &Array,
        hidden: &Array,
        position: i32,
        donors: &[DonorKv],
    ) -> Result<(Array, Array)> {
        let mut x = self
            .pre_projection
            .forward(&ops::concatenate(&[embedding, hidden], -1)?)?;
        for layer in &self.layers {
            let kv = donors.get(layer.donor).ok_or_else(|| {
                EngineError::Runtime("assistant step is missing a donor layer's keys/values".into())
            })?;
            let n = layer.input_layernorm.forward(&x)?;
            let q = layer
                .q_proj
                .forward(&n)?
                .reshape(&[1, 1, layer.n_heads, layer.head_dim])?;
            let q = layer.q_norm.forward(&q)?.transpose_axes(&[0, 2, 1, 3])?;
            let q = layer.rope.apply(&q, position)?;
            let a = sdpa(&q, &kv.keys, &kv.values, 1.0, &AttentionMask::None)?;
            let a = a.transpose_axes(&[0, 2, 1, 3])?.reshape(&[1, 1, -1])?;
            x = x.add(
                layer
                    .post_attention_layernorm
                    .forward(&layer.o_proj.forward(&a)?)?,
            )?;
            let ff = layer.mlp.forward_op(
                &layer.pre_feedforward_layernorm.forward(&x)?,
                &mut self.geglu,
            )?;
            x = x.add(layer.post_feedforward_layernorm.forward(&ff)?)?;
            x = x.multiply(&layer.layer_scalar)?;
        }
        let hn = self.norm.forward(&x)?;
        let logits = self.head(&hn)?;
        Ok((logits, self.post_projection.forward(&hn)?))
    }

    /// The tied dense head, or the centroid head (top-k clusters, their tokens' dot products
    /// scattered into a full-vocabulary row filled with `min(selected) - 1`).
    fn head(&self, hn: &Array) -> Result<Array> {
        let Some(c) = &self.centroid else {
            return self.embed.as_linear(hn);
        };
        let scores = c.centroids.forward(hn)?.reshape(&[-1])?;
        let clusters = top_k_indices(&scores, c.top_k)?;
        let ids = c.ordering.take_axis(&clusters, 0)?.reshape(&[-1])?;
        let rows = self.embed.forward(&ids)?;
        let selected = ops::matmul(&rows, hn.reshape(&[-1, 1])?)?.reshape(&[-1])?;
        let fill = selected.min(None)?.subtract(weak_scalar(1.0, &selected)?)?;
        let base = ops::broadcast_to(&fill, &[self.vocab])?;
        let out = ops::indexing::put_along_axis(&base, &ids, &selected, 0)?;
        Ok(out.reshape(&[1, 1, self.vocab])?)
    }
}
