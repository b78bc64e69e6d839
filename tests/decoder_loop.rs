//! The shared decoder loop's early exit and layer taps on the architectures that gained them
//! from it (gemma2, minicpm, qwen3_moe, qwen3_5), against mlx-lm 0.32.2: a forward that taps
//! the last layer gives mlx-lm's prompt logits bit for bit, and speculative decoding with the
//! `self` (early-exit) drafter gives mlx-lm's greedy ids.

mod common;

use mlx_rs::Array;
use mlxb::engine::forks::Forks;
use mlxb::engine::models::{self, ForwardOpts, LanguageModel};
use mlxb::spec::early_exit::EarlyExitSource;
use serde_json::{json, Value};

const PROMPT_LEN: usize = 24;
const GEN: usize = 24;

/// The prompt as a `[1, L]` id array.
fn ids(prompt: &[u32]) -> Array {
    let ids: Vec<i32> = prompt.iter().map(|&t| t as i32).collect();
    Array::from_slice(&ids, &[1, ids.len() as i32])
}

fn check(config: Value, layers: usize, hidden: i32) {
    let dir = tempfile::tempdir().unwrap();
    common::make_model(dir.path(), &config, "f32", None);
    let vocab = config["vocab_size"].as_u64().unwrap() as u32;
    let base = common::prompt_ids(8, vocab, 5);
    let prompt: Vec<u32> = base.iter().cycle().take(PROMPT_LEN).copied().collect();
    let oracle = common::oracle_trace(&json!({
        "model": dir.path(),
        "prompt_ids": prompt,
        "max_tokens": GEN,
        "prompt_logits": true,
    }));
    let mut loaded = models::load(dir.path(), Forks::default()).unwrap();
    let model: &mut dyn LanguageModel = loaded.model.as_mut();

    let opts = ForwardOpts {
        exit_after: None,
        taps: vec![layers - 1],
    };
    let mut caches = model.make_caches();
    let out = model
        .forward_ext(&ids(&prompt), &mut caches, &opts)
        .unwrap();
    let logits = out.logits.squeeze_axes(&[0]).unwrap();
    assert_eq!(
        common::bits(&logits),
        common::bits(&oracle["prompt_logits"]),
        "logits of a forward with a tap differ from mlx-lm's"
    );
    assert_eq!(out.taps.len(), 1);
    assert_eq!(out.taps[0].shape(), &[1, PROMPT_LEN as i32, hidden]);

    let early = ForwardOpts {
        exit_after: Some(1),
        taps: vec![0],
    };
    let mut caches = model.make_caches();
    caches.truncate(1);
    let out = model
        .forward_ext(&ids(&prompt), &mut caches, &early)
        .unwrap();
    assert_eq!(out.logits.shape(), &[1, PROMPT_LEN as i32, vocab as i32]);
    assert_eq!(caches[0].offset(), PROMPT_LEN as i32);

    let want: Vec<i32> = oracle["ids"].as_slice::<i32>().to_vec();
    for k in [2usize, 4] {
        let source = Box::new(EarlyExitSource::new(1));
        let (got, metrics) = common::greedy_ids(model, &prompt, Some(source), k, GEN);
        assert_eq!(got, want, "self drafter k={k} diverges from mlx-lm greedy");
        assert!(metrics.unwrap().target_forwards > 0);
    }
}

#[test]
fn gemma2_taps_and_early_exit() {
    let config = json!({
        "model_type": "gemma2", "hidden_size": 64, "num_hidden_layers": 3, "intermediate_size": 128,
        "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16, "rms_norm_eps": 1e-6,
        "vocab_size": 384, "query_pre_attn_scalar": 16, "attn_logit_softcapping": 5.0,
        "final_logit_softcapping": 3.0
    });
    check(config, 3, 64);
}

#[test]
fn minicpm_taps_and_early_exit() {
    let config = json!({
        "model_type": "minicpm", "hidden_size": 64, "dim_model_base": 16, "num_hidden_layers": 3,
        "intermediate_size": 128, "num_attention_heads": 4, "num_key_value_heads": 2,
        "rms_norm_eps": 1e-5, "vocab_size": 384, "scale_depth": 1.4, "scale_emb": 12,
        "rope_theta": 10000.0, "tie_word_embeddings": false
    });
    check(config, 3, 64);
}

#[test]
fn qwen3_moe_taps_and_early_exit() {
    let config = json!({
        "model_type": "qwen3_moe", "hidden_size": 64, "num_hidden_layers": 3, "intermediate_size": 96,
        "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16, "rms_norm_eps": 1e-6,
        "vocab_size": 384, "num_experts": 4, "num_experts_per_tok": 2, "decoder_sparse_step": 1,
        "mlp_only_layers": [], "moe_intermediate_size": 32, "rope_theta": 10000.0,
        "tie_word_embeddings": false, "max_position_embeddings": 4096, "norm_topk_prob": true
    });
    check(config, 3, 64);
}

/// Layers 0 and 1 are linear attention: an early exit after layer 0 runs no attention layer.
#[test]
fn qwen3_5_taps_and_early_exit() {
    let config = json!({
        "model_type": "qwen3_5", "hidden_size": 32, "num_hidden_layers": 3, "intermediate_size": 64,
        "num_attention_heads": 2, "num_key_value_heads": 1, "head_dim": 16, "rms_norm_eps": 1e-5,
        "vocab_size": 320, "linear_num_value_heads": 2, "linear_num_key_heads": 1,
        "linear_key_head_dim": 8, "linear_value_head_dim": 8, "linear_conv_kernel_dim": 3,
        "full_attention_interval": 3, "max_position_embeddings": 1024, "tie_word_embeddings": true,
        "rope_parameters": {"rope_type": "default", "rope_theta": 5000.0, "partial_rotary_factor": 0.25}
    });
    check(config, 3, 32);
}
