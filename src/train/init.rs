//! Randomly initialised DSpark drafters for a target (`mlxb dspark-init`; training starts
//! here). Geometry is copied from the target's config as DeepSpec does; weights follow the
//! Hugging Face init DeepSpec inherits: normal(0, std) for projections and the Markov tables,
//! ones for norms, zeros for biases. Each tensor draws from its own key (seed + name), so two
//! drafters made with the same seed share every tensor they both have.

use crate::engine::error::{EngineError, Result};
use crate::engine::models::LanguageModel;
use crate::spec::dspark::checkpoint::{target_rope, DsparkConfig, SeqHead, TargetFacts};
use mlx_rs::{ops, random, Array, Dtype};
use serde_json::Value;
use std::collections::HashMap;
use std::path::Path;

/// What `mlxb dspark-init` decides.
#[derive(Debug, Clone)]
pub struct InitOptions {
    /// Sequential head.
    pub seq_head: SeqHead,
    /// Backbone layers.
    pub layers: i32,
    /// Block size γ.
    pub block_size: usize,
    /// Markov rank r.
    pub markov_rank: i32,
    /// Tapped target layers (`None` = DFlash's spread, see [`default_tap_layers`]).
    pub tap_layers: Option<Vec<usize>>,
    /// Mask token id (`None` = the first padded vocabulary row, else the last id).
    pub mask_token_id: Option<u32>,
    /// Whether to include a confidence head.
    pub confidence_head: bool,
    /// Zero the heads' output projection `W2` (every head then equals plain DFlash).
    pub zero_seq_output: bool,
    /// Standard deviation of the normal init.
    pub std: f32,
    /// Seed.
    pub seed: u64,
}

impl Default for InitOptions {
    fn default() -> Self {
        Self {
            seq_head: SeqHead::Markov,
            layers: 2,
            block_size: 7,
            markov_rank: 256,
            tap_layers: None,
            mask_token_id: None,
            confidence_head: true,
            zero_seq_output: false,
            std: 0.02,
            seed: 0,
        }
    }
}

/// DFlash's `build_target_layer_ids(n, 5)`: up to five layers evenly spaced from 1 to n-3
/// (Python's round-half-even), or every layer below the last on targets of three layers or fewer.
pub fn default_tap_layers(n: usize) -> Vec<usize> {
    if n <= 3 {
        return (0..n.saturating_sub(1)).collect();
    }
    let (start, end) = (1usize, n - 3);
    let count = (end - start + 1).min(5);
    if count == 1 {
        return vec![start];
    }
    let span = (end - start) as f64;
    (0..count)
        .map(|i| (start as f64 + i as f64 * span / (count - 1) as f64).round_ties_even() as usize)
        .collect()
}

fn required(config: &Value, key: &str, path: &Path) -> Result<i32> {
    config
        .get(key)
        .and_then(Value::as_i64)
        .map(|v| v as i32)
        .ok_or_else(|| {
            EngineError::file(
                path,
                format!("`{key}` is missing; dspark-init copies the drafter's geometry from the target's config.json"),
            )
        })
}

/// A tensor drawn from normal(0, std) with a key from the seed and its name.
fn normal(name: &str, shape: &[i32], std: f32, seed: u64, dtype: Dtype) -> Result<Array> {
    let salt = name.bytes().fold(0xcbf2_9ce4_8422_2325u64, |h, b| {
        (h ^ b as u64).wrapping_mul(0x100_0000_01b3)
    });
    let key = random::key(seed ^ salt)?;
    Ok(random::normal::<f32>(shape, 0.0, std, &key)?.as_dtype(dtype)?)
}

/// Refuses shape flags that cannot make a drafter, naming the flag (the config checks after it
/// would name the target's config.json, which the user did not write).
fn check_flags(opts: &InitOptions, vocab_size: i32) -> Result<()> {
    let bad = |msg: String| Err(EngineError::Input(msg));
    if opts.layers < 1 {
        return bad(format!(
            "--layers {}: a drafter needs at least one backbone layer",
            opts.layers
        ));
    }
    if opts.block_size == 0 {
        return bad("--gamma 0: a drafter proposes at least one token per round".into());
    }
    if opts.seq_head != SeqHead::None && opts.markov_rank < 1 {
        return bad(format!(
            "--markov-rank {}: the {:?} head needs W1/W2 of rank >= 1",
            opts.markov_rank, opts.seq_head
        ));
    }
    match opts.mask_token_id {
        Some(m) if m as i64 >= vocab_size as i64 => bad(format!(
            "--mask-token-id {m} is outside the target's vocabulary of {vocab_size} tokens"
        )),
        _ => Ok(()),
    }
}

/// [`init`] for a target opened as a session from `target_dir` (its model, config.json and
/// tokenizer size): what `dspark-init` and a fresh `train-dspark` both start from.
pub fn init_for_session(
    session: &crate::engine::session::Session,
    target_dir: &Path,
    opts: &InitOptions,
) -> Result<(DsparkConfig, HashMap<String, Array>)> {
    init(
        session.model.model.as_ref(),
        &session.model.config,
        target_dir,
        Some(session.tokenizer.vocab_len()),
        opts,
    )
}

/// The config and tensors of a fresh drafter for the target at `target_dir` (its `config.json`
/// as `target_config`, its tokenizer's size as `tokenizer_len` when known).
pub fn init(
    target: &dyn LanguageModel,
    target_config: &Value,
    target_dir: &Path,
    tokenizer_len: Option<usize>,
    opts: &InitOptions,
) -> Result<(DsparkConfig, HashMap<String, Array>)> {
    let facts = TargetFacts::of(target)?;
    check_flags(opts, facts.vocab_size)?;
    let path = target_dir.join("config.json");
    let (d, v, r) = (facts.hidden_size, facts.vocab_size, opts.markov_rank);
    let heads = required(target_config, "num_attention_heads", &path)?;
    let taps = opts
        .tap_layers
        .clone()
        .unwrap_or_else(|| default_tap_layers(facts.num_layers));
    if taps.is_empty() {
        return Err(EngineError::Input(format!(
            "the target has {} layer(s); a DSpark drafter taps at least one layer below the last",
            facts.num_layers
        )));
    }
    let mask = match opts.mask_token_id {
        Some(m) => m as i64,
        None => match tokenizer_len {
            Some(n) if (n as i64) < v as i64 => n as i64,
            _ => v as i64 - 1,
        },
    };
    let (rope_theta, rope_scaling) = target_rope(target_config);
    let with_head = opts.seq_head != SeqHead::None;
    let config = DsparkConfig {
        variant: "dspark".into(),
        hidden_size: d,
        vocab_size: v,
        num_hidden_layers: opts.layers,
        num_attention_heads: heads,
        num_key_value_heads: target_config
            .get("num_key_value_heads")
            .and_then(Value::as_i64)
            .map_or(heads, |n| n as i32),
        head_dim: target_config
            .get("head_dim")
            .and_then(Value::as_i64)
            .map_or(d / heads.max(1), |n| n as i32),
        intermediate_size: required(target_config, "intermediate_size", &path)?,
        rms_norm_eps: target_config
            .get("rms_norm_eps")
            .and_then(Value::as_f64)
            .unwrap_or(1e-6),
        rope_theta,
        rope_scaling,
        block_size: opts.block_size,
        target_layer_ids: taps.iter().map(|&t| t as i64).collect(),
        num_target_layers: Some(facts.num_layers),
        mask_token_id: mask,
        seq_head: opts.seq_head,
        markov_rank: if with_head || opts.confidence_head {
            r
        } else {
            0
        },
        confidence_head: opts.confidence_head,
        confidence_head_with_markov: with_head,
        target_model_type: target_config
            .get("model_type")
            .and_then(Value::as_str)
            .map(str::to_owned),
        ..DsparkConfig::default()
    };
    config.validate(&path)?;
    config.check_target(&facts, &path)?;
    let dtype = target.embed(&Array::from_slice(&[0i32], &[1, 1]))?.dtype();
    let tensors = tensors(&config, opts, dtype)?;
    Ok((config, tensors))
}

/// Every tensor of a Qwen3-style drafter with `config`'s shapes, freshly drawn.
fn tensors(c: &DsparkConfig, opts: &InitOptions, dtype: Dtype) -> Result<HashMap<String, Array>> {
    let (d, v, r) = (c.hidden_size, c.vocab_size, c.markov_rank);
    let (hd, q, kv) = (
        c.head_dim,
        c.num_attention_heads * c.head_dim,
        c.num_key_value_heads * c.head_dim,
    );
    let mut shapes: Vec<(String, Vec<i32>)> = vec![("fc.weight".into(), vec![d, c.num_taps() * d])];
    for i in 0..c.num_hidden_layers {
        let p = format!("layers.{i}");
        for (name, shape) in [
            ("self_attn.q_proj.weight", vec![q, d]),
            ("self_attn.k_proj.weight", vec![kv, d]),
            ("self_attn.v_proj.weight", vec![kv, d]),
            ("self_attn.o_proj.weight", vec![d, q]),
            ("mlp.gate_proj.weight", vec![c.intermediate_size, d]),
            ("mlp.up_proj.weight", vec![c.intermediate_size, d]),
            ("mlp.down_proj.weight", vec![d, c.intermediate_size]),
        ] {
            shapes.push((format!("{p}.{name}"), shape));
        }
    }
    if c.seq_head != SeqHead::None {
        shapes.push(("markov_head.markov_w1.weight".into(), vec![v, r]));
        shapes.push(("markov_head.markov_w2.weight".into(), vec![v, r]));
    }
    match c.seq_head {
        SeqHead::Rnn => shapes.push((
            "markov_head.joint_proj.weight".into(),
            vec![3 * r, 2 * r + d],
        )),
        SeqHead::Gated => shapes.push(("markov_head.gate_proj.weight".into(), vec![r, d + r])),
        _ => {}
    }
    if c.confidence_head {
        shapes.push((
            "confidence_head.proj.weight".into(),
            vec![1, c.confidence_input()],
        ));
    }
    let mut out = HashMap::new();
    for (name, shape) in shapes {
        let zero = opts.zero_seq_output && name == "markov_head.markov_w2.weight";
        let t = if zero {
            ops::zeros_dtype(&shape, dtype)?
        } else {
            normal(&name, &shape, opts.std, opts.seed, dtype)?
        };
        out.insert(name, t);
    }
    let mut norms: Vec<(String, i32)> =
        vec![("hidden_norm.weight".into(), d), ("norm.weight".into(), d)];
    for i in 0..c.num_hidden_layers {
        let p = format!("layers.{i}");
        norms.push((format!("{p}.input_layernorm.weight"), d));
        norms.push((format!("{p}.post_attention_layernorm.weight"), d));
        norms.push((format!("{p}.self_attn.q_norm.weight"), hd));
        norms.push((format!("{p}.self_attn.k_norm.weight"), hd));
    }
    for (name, n) in norms {
        out.insert(name, ops::ones_dtype(&[n], dtype)?);
    }
    let mut biases = Vec::new();
    match c.seq_head {
        SeqHead::Rnn => biases.push(("markov_head.joint_proj.bias", 3 * r)),
        SeqHead::Gated => biases.push(("markov_head.gate_proj.bias", r)),
        _ => {}
    }
    if c.confidence_head {
        biases.push(("confidence_head.proj.bias", 1));
    }
    for (name, n) in biases {
        out.insert(name.to_owned(), ops::zeros_dtype(&[n], dtype)?);
    }
    Ok(out)
}

/// Divides each input column of `fc.weight` by the root-mean-square of that tapped feature over
/// every row of `examples`, returning the smallest and largest RMS. A residual stream's taps
/// differ a hundredfold in scale (a few outlier dimensions, and deeper layers larger), so a
/// plain normal init projects mostly the deepest layer's outliers, and every context row starts
/// out nearly the same feature vector; scaled, every dimension contributes alike. The forward
/// is unchanged (fc stays a plain linear map), so the drafter loads and runs as any other.
pub fn scale_fc_to_unit_features(
    params: &mut crate::train::forward::Params,
    examples: &[crate::train::example::Example],
) -> Result<(f32, f32)> {
    let Some(i) = params.names.iter().position(|n| n == "fc.weight") else {
        return Err(EngineError::Input(
            "the drafter has no `fc.weight` to scale".into(),
        ));
    };
    let mut sum: Option<Array> = None;
    let mut rows = 0usize;
    for ex in examples {
        let sq = ex
            .taps
            .as_dtype(Dtype::Float32)?
            .square()?
            .sum_axis(0, false)?;
        rows += ex.taps.shape()[0] as usize;
        sum = Some(match sum {
            None => sq,
            Some(s) => s.add(&sq)?,
        });
        if let Some(s) = &sum {
            mlx_rs::transforms::eval([s])?;
        }
    }
    let sum = sum.ok_or_else(|| EngineError::Input("no cached sequence to scale fc by".into()))?;
    let rms = sum.divide(Array::from_f32(rows.max(1) as f32))?.sqrt()?;
    let (lo, hi) = (
        rms.min(None)?.item_cast::<f32>(),
        rms.max(None)?.item_cast::<f32>(),
    );
    // A feature that is zero everywhere keeps its column as it was.
    let rms = ops::select(&rms.gt(Array::from_f32(0.0))?, &rms, Array::from_f32(1.0))?;
    let w = &params.values[i];
    params.values[i] = w.divide(&rms.expand_dims(0)?)?.as_dtype(w.dtype())?;
    mlx_rs::transforms::eval([&params.values[i]])?;
    Ok((lo, hi))
}

/// Sets every attention q/k norm gain of a new drafter to `gain`.
pub fn set_qk_norm_gains(params: &mut crate::train::forward::Params, gain: f32) -> Result<()> {
    for (name, value) in params.names.iter().zip(params.values.iter_mut()) {
        if name.ends_with("self_attn.q_norm.weight") || name.ends_with("self_attn.k_norm.weight") {
            *value = ops::full::<f32>(value.shape(), Array::from_f32(gain))?;
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::{default_tap_layers, scale_fc_to_unit_features, set_qk_norm_gains};
    use crate::train::example::Example;
    use crate::train::forward::Params;
    use mlx_rs::Array;

    #[test]
    fn tap_layers_follow_dflash() {
        // dspark-spec.md §1.1: Qwen3-4B/8B (36 layers) and Qwen3-14B (40 layers).
        assert_eq!(default_tap_layers(36), vec![1, 9, 17, 25, 33]);
        assert_eq!(default_tap_layers(40), vec![1, 10, 19, 28, 37]);
        // Python's round-half-even: 7.5 -> 8, 20.5 -> 20.
        assert_eq!(default_tap_layers(30), vec![1, 8, 14, 20, 27]);
        assert_eq!(default_tap_layers(6), vec![1, 2, 3]);
        assert_eq!(default_tap_layers(4), vec![1]);
        assert_eq!(default_tap_layers(3), vec![0, 1]);
        assert_eq!(default_tap_layers(1), Vec::<usize>::new());
    }

    #[test]
    fn fc_columns_scale_to_unit_rms_features() {
        // Feature RMS over the three rows of two sequences: sqrt(35/3), sqrt(20/3), 0 (a zero
        // feature keeps its column).
        let ex = |rows: &[f32], n: i32| Example {
            ids: vec![0; n as usize],
            mask: vec![true; n as usize],
            taps: Array::from_slice(rows, &[n, 3]),
            last_hidden: Array::from_slice(&vec![0f32; n as usize], &[n, 1]),
        };
        let examples = [ex(&[1., 2., 0., 3., 4., 0.], 2), ex(&[5., 0., 0.], 1)];
        let mut params = Params {
            names: vec!["fc.weight".into()],
            values: vec![Array::from_slice(&[1f32, 1., 7., 2., 2., 7.], &[2, 3])],
        };
        let (lo, hi) = scale_fc_to_unit_features(&mut params, &examples).unwrap();
        let (a, b) = ((35f32 / 3.0).sqrt(), (20f32 / 3.0).sqrt());
        assert_eq!((lo, hi), (0.0, a));
        let got: Vec<f32> = params.values[0].as_slice::<f32>().to_vec();
        let want = [1. / a, 1. / b, 7., 2. / a, 2. / b, 7.];
        for (g, w) in got.iter().zip(want) {
            assert!((g - w).abs() <= 1e-6 * w.abs(), "{got:?} vs {want:?}");
        }
    }

    #[test]
    fn qk_norm_gains_start_where_asked_and_nothing_else_moves() {
        let mut params = Params {
            names: vec![
                "layers.0.self_attn.k_norm.weight".into(),
                "layers.0.self_attn.q_norm.weight".into(),
                "norm.weight".into(),
            ],
            values: vec![Array::from_slice(&[1f32; 4], &[4]); 3],
        };
        set_qk_norm_gains(&mut params, 2.5).unwrap();
        let v: Vec<Vec<f32>> = params
            .values
            .iter()
            .map(|a| a.as_slice::<f32>().to_vec())
            .collect();
        assert_eq!(v, vec![vec![2.5; 4], vec![2.5; 4], vec![1.0; 4]]);
    }
}
