//! gemma4_text's attention (mlx-lm's `Attention` in `models/gemma4_text.py`): q/k RMSNorm and
//! a scale-free v norm, attention scale 1, the RoPE of the layer's type rotated at an
//! `mx.array` offset, optionally K == V (no v projection) on global layers, and KV sharing: a
//! layer without projections of its own attends the keys/values an earlier layer produced.

use super::attention::sdpa;
use super::gemma4_text::{Args, SLIDING};
use super::rope::Rope;
use super::ModelSpec;
use crate::engine::cache::{AttentionMask, KvCache};
use crate::engine::error::{EngineError, Result};
use crate::engine::nn::{Linear, RmsNorm};
use crate::engine::weights::WeightStore;
use mlx_rs::{fast, Array};
use serde_json::{json, Value};

/// Keys/values (+ the position offset they were rotated at) a KV-shared layer reuses.
#[derive(Clone)]
pub struct SharedKv {
    keys: Array,
    values: Array,
    offset: Array,
}

/// The key/value side of a layer that computes its own.
struct KvProj {
    k_proj: Linear,
    v_proj: Option<Linear>,
    k_norm: RmsNorm,
}

/// One layer's attention.
pub struct Attention {
    q_proj: Linear,
    kv: Option<KvProj>,
    o_proj: Linear,
    q_norm: RmsNorm,
    n_heads: i32,
    n_kv_heads: i32,
    head_dim: i32,
    eps: f32,
    rope: Rope,
}

impl Attention {
    /// Loads the attention at `prefix` (`model.layers.{i}.self_attn`) of a layer of type
    /// `layer_type`, with k/v projections of its own when `has_kv` (it is not KV-shared);
    /// `rope_params` is [`Args::rope_parameters`].
    pub fn load(
        spec: &ModelSpec,
        w: &mut WeightStore,
        prefix: &str,
        a: &Args,
        rope_params: &Value,
        layer_type: &str,
        has_kv: bool,
    ) -> Result<Self> {
        let sliding = layer_type == SLIDING;
        let (d, eps) = (a.hidden_size, a.rms_norm_eps);
        let head_dim = match a.global_head_dim {
            Some(g) if !sliding && g != 0 => g,
            _ => a.head_dim,
        };
        let k_eq_v = a.attention_k_eq_v && !sliding;
        let n_kv_heads = match a.num_global_key_value_heads {
            Some(g) if k_eq_v => g,
            _ => a.num_key_value_heads,
        };
        let (qd, kvd) = (a.num_attention_heads * head_dim, n_kv_heads * head_dim);
        let kv = if has_kv {
            Some(KvProj {
                k_proj: Linear::load(w, &format!("{prefix}.k_proj"), d, kvd, false)?,
                v_proj: if k_eq_v {
                    None
                } else {
                    Some(Linear::load(w, &format!("{prefix}.v_proj"), d, kvd, false)?)
                },
                k_norm: RmsNorm::load(w, &format!("{prefix}.k_norm"), head_dim, eps)?,
            })
        } else {
            None
        };
        Ok(Self {
            q_proj: Linear::load(w, &format!("{prefix}.q_proj"), d, qd, false)?,
            kv,
            o_proj: Linear::load(w, &format!("{prefix}.o_proj"), qd, d, false)?,
            q_norm: RmsNorm::load(w, &format!("{prefix}.q_norm"), head_dim, eps)?,
            n_heads: a.num_attention_heads,
            n_kv_heads,
            head_dim,
            eps: eps as f32,
            rope: load_rope(spec, a, rope_params, layer_type, head_dim)?,
        })
    }

    /// Attends `x` with this layer's own keys/values (stored in `cache`) or, for a KV-shared
    /// layer, with `shared`; returns the output and the keys/values attended.
    pub fn forward(
        &self,
        x: &Array,
        mask: &AttentionMask,
        cache: Option<&mut dyn KvCache>,
        shared: Option<&SharedKv>,
    ) -> Result<(Array, SharedKv)> {
        let (b, l) = (x.shape()[0], x.shape()[1]);
        let heads = |t: Array, n: i32| t.reshape(&[b, l, n, self.head_dim]);
        let queries = self
            .q_norm
            .forward(&heads(self.q_proj.forward(x)?, self.n_heads)?)?;
        let (keys, values, offset, cache) = match (shared, &self.kv, cache) {
            (Some(s), _, _) => (s.keys.clone(), s.values.clone(), s.offset.clone(), None),
            (None, Some(kv), Some(cache)) => {
                let keys = heads(kv.k_proj.forward(x)?, self.n_kv_heads)?;
                let values = match &kv.v_proj {
                    Some(v) => heads(v.forward(x)?, self.n_kv_heads)?,
                    None => keys.clone(),
                };
                // Rows of a batch sit at their own positions (one offset per row).
                let offset = cache
                    .rope_offsets()
                    .unwrap_or_else(|| Array::from_int(cache.offset()));
                let keys = kv.k_norm.forward(&keys)?.transpose_axes(&[0, 2, 1, 3])?;
                let keys = self.rope.apply_dynamic(&keys, &offset)?;
                let values =
                    fast::rms_norm(&values, None, self.eps)?.transpose_axes(&[0, 2, 1, 3])?;
                (keys, values, offset, Some(cache))
            }
            _ => {
                return Err(EngineError::Runtime(
                    "gemma4 layer has neither its own key/value cache nor shared keys/values"
                        .into(),
                ))
            }
        };
        let queries = queries.transpose_axes(&[0, 2, 1, 3])?;
        let queries = self.rope.apply_dynamic(&queries, &offset)?;
        let (keys, values) = match cache {
            Some(c) => c.update_and_fetch(&keys, &values)?,
            None => (keys, values),
        };
        let out = sdpa(&queries, &keys, &values, 1.0, mask)?;
        let out = out.transpose_axes(&[0, 2, 1, 3])?.reshape(&[b, l, -1])?;
        Ok((
            self.o_proj.forward(&out)?,
            SharedKv {
                keys,
                values,
                offset,
            },
        ))
    }
}

/// The RoPE of one layer type (`rope_parameters[layer_type]`) for heads `head_dim` wide.
pub fn load_rope(
    spec: &ModelSpec,
    a: &Args,
    params: &Value,
    layer_type: &str,
    head_dim: i32,
) -> Result<Rope> {
    let p = params.get(layer_type).cloned().unwrap_or_else(|| json!({}));
    let theta = match p.get("rope_theta") {
        None => 10000.0,
        Some(v) => v.as_f64().ok_or_else(|| {
            spec.field_error(
                &format!("rope_parameters.{layer_type}.rope_theta"),
                "must be a number",
            )
        })?,
    };
    Rope::from_config(head_dim, theta, a.rope_traditional, Some(&p))
}
