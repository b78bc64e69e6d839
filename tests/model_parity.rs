//! L1 parity per architecture: tiny random models built and saved by mlx-lm's own classes;
//! mlxb's logits at every prompt position and its greedy ids + logprobs at every generated
//! step must be bit-identical to mlx-lm 0.32.2 on the same libmlx.

mod common;

use common::{tiny_qwen3_5, with};
use mlxb::engine::cache::in_place_appends_here;
use mlxb::engine::forks::Forks;
use mlxb::engine::generate::{Flow, GenerateConfig, Generator};
use mlxb::engine::kernels::dense::dense_packed_calls;
use mlxb::engine::kernels::exact_steps_here;
use mlxb::engine::kernels::mlx_order::F32Kernels;
use mlxb::engine::kernels::packed::{dot_available, dot_calls, packed_calls};
use mlxb::engine::logprobs::{host_argmax_calls, host_logprobs_calls};
use mlxb::engine::models;
use mlxb::engine::sample::{LogitsProcessors, ProcessorConfig, Sampler, SamplerConfig};
use serde_json::json;

const PROMPT_LEN: usize = 45;
const GEN_TOKENS: usize = 32;

/// Builds the model with mlx-lm, then compares prompt logits and greedy generation.
fn check(config: serde_json::Value, dtype: &str, quant_bits: Option<u32>, prefill_step: usize) {
    let lengths = (PROMPT_LEN, GEN_TOKENS);
    check_lengths(config, dtype, quant_bits, prefill_step, lengths);
}

/// [`check`] for a prompt and a generation of these lengths; returns how many of the greedy
/// steps the L1 host step (`--host-step on`) computed.
fn check_lengths(
    config: serde_json::Value,
    dtype: &str,
    quant_bits: Option<u32>,
    prefill_step: usize,
    (prompt_len, gen_tokens): (usize, usize),
) -> usize {
    let dir = tempfile::tempdir().unwrap();
    common::make_model(dir.path(), &config, dtype, quant_bits);
    let vocab = config["vocab_size"].as_u64().unwrap() as u32;
    let prompt = common::prompt_ids(prompt_len, vocab, 1);
    let oracle = common::oracle_trace(&json!({
        "model": dir.path(),
        "prompt_ids": prompt,
        "max_tokens": gen_tokens,
        "prefill_step_size": prefill_step,
        "prompt_logits": true,
    }));

    let mut loaded = models::load(dir.path(), Forks::default()).unwrap();
    // As a session opens a model: the host step and its packed copies made at load, so the
    // prompt's products may read them.
    loaded.model.prepare_host_step().unwrap();
    let logits = Generator::prompt_logits(loaded.model.as_mut(), &prompt).unwrap();
    let want = &oracle["prompt_logits"];
    assert_eq!(logits.shape(), want.shape(), "prompt logits shape");
    assert_eq!(logits.dtype(), want.dtype(), "prompt logits dtype");
    let (got_bits, want_bits) = (common::bits(&logits), common::bits(want));
    let row = want.shape()[1] as usize;
    let first_bad = (0..prompt_len)
        .find(|&p| got_bits[p * row..(p + 1) * row] != want_bits[p * row..(p + 1) * row]);
    assert_eq!(
        first_bad, None,
        "prompt logits differ from mlx-lm starting at position {first_bad:?}"
    );

    let mut sampler = Sampler::new(&SamplerConfig::default()).unwrap();
    let mut processors = LogitsProcessors::new(&ProcessorConfig::default()).unwrap();
    let cfg = GenerateConfig {
        max_tokens: gen_tokens,
        prefill_step_size: prefill_step,
    };
    let steps_before = exact_steps_here();
    let appends_before = in_place_appends_here();
    let host_logprobs_before = host_logprobs_calls();
    let host_argmax_before = host_argmax_calls();
    let mut ids = vec![];
    let mut lps = vec![];
    Generator::new(loaded.model.as_mut(), &mut sampler, &mut processors)
        .run(&prompt, &cfg, |s| {
            ids.push(s.token as i32);
            lps.push(s.logprobs.clone());
            Ok(Flow::Continue)
        })
        .unwrap();
    let want_ids: Vec<i32> = oracle["ids"].as_slice::<i32>().to_vec();
    assert_eq!(ids, want_ids, "greedy ids differ from mlx-lm");
    let want_lp = &oracle["logprobs"];
    for (i, lp) in lps.iter().enumerate() {
        let w = want_lp.index(i as i32);
        assert_eq!(
            common::bits(lp),
            common::bits(&w),
            "logprobs differ from mlx-lm at step {i}"
        );
    }
    let steps = exact_steps_here() - steps_before;
    // Each host step writes its new keys and values straight into the cache's buffers (no
    // MLX append), except where a buffer grows.
    let appends = in_place_appends_here() - appends_before;
    assert!(
        appends >= steps.saturating_sub(1),
        "{appends} in-place cache appends for {steps} host steps"
    );
    if ["f32", "bf16"].contains(&dtype) {
        // Each host step's logits stay on the host, and so does their logprobs tail (as do
        // those of a per-layer forward whose head was a host product).
        let rows = host_logprobs_calls() - host_logprobs_before;
        assert!(
            rows >= steps,
            "{rows} logprob rows on the host for {steps} host steps"
        );
        // And the greedy sampler picks from them there.
        let picks = host_argmax_calls() - host_argmax_before;
        assert!(
            picks >= steps,
            "{picks} greedy picks on the host for {steps} host steps"
        );
    }
    steps
}

use mlx_rs::ops::indexing::IndexOp;

/// The shared tiny llama with 2 layers and an explicit rope theta, plus `extra`.
fn llama(extra: serde_json::Value) -> serde_json::Value {
    with(
        common::tiny_llama(json!({"num_hidden_layers": 2, "rope_theta": 10000.0})),
        extra,
    )
}

/// Every greedy step after the first of a dense bfloat16 llama is the L1 host step's, unless
/// this machine has no host kernels (no AVX2): then none is.
fn assert_bf16_host_steps(steps: usize, gen_tokens: usize) {
    let expected = if mlxb::engine::kernels::mlx_order::available() {
        gen_tokens - 1
    } else {
        0
    };
    assert_eq!(
        steps, expected,
        "decode steps taken by the bfloat16 L1 host step"
    );
}

#[test]
fn llama_bf16() {
    let packed = packed_calls().0;
    let prompt_packed = dense_packed_calls();
    let dot = dot_calls();
    let steps = check_lengths(
        llama(json!({})),
        "bf16",
        None,
        2048,
        (PROMPT_LEN, GEN_TOKENS),
    );
    assert_bf16_host_steps(steps, GEN_TOKENS);
    if steps > 0 {
        // Its products read the packed copy of the weights (kept only once it matched MLX).
        assert!(
            packed_calls().0 > packed,
            "the bfloat16 host step's products"
        );
        // So do the prompts' products (any number of tokens: one chain per output).
        assert!(
            dense_packed_calls() > prompt_packed,
            "the bfloat16 prompt's products"
        );
        // On a CPU with AVX512_BF16, through `vdpbf16ps` in the chains' order.
        assert_eq!(
            dot_calls() > dot,
            dot_available(),
            "the bfloat16 dot-product kernel"
        );
    }
}

/// The bfloat16 L1 host step on an untied llama with llama3 rope scaling (the rope's
/// frequencies form) and SmolLM2's grouping, decoding from 1,010 to 1,210 positions: past the
/// step's first rope table (1,024 positions, rebuilt larger).
#[test]
fn llama_bf16_host_step_untied_llama3_rope_across_rope_table_growth() {
    let rope = json!({"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
        "high_freq_factor": 4.0, "original_max_position_embeddings": 16});
    let config = llama(json!({"tie_word_embeddings": false, "rope_scaling": rope,
        "num_attention_heads": 6, "num_key_value_heads": 2, "head_dim": 32}));
    let steps = check_lengths(config, "bf16", None, 512, (1010, 200));
    assert_bf16_host_steps(steps, 200);
}

/// Every greedy step after the first (which runs on MLX alone) of a dense f32 llama with heads
/// `head_dim` wide is the L1 host step's (`--host-step on`, a default), unless this machine has
/// no host kernels for OpenBLAS's order (no AVX2, or no OpenBLAS): then none is.
fn assert_host_steps(steps: usize, gen_tokens: usize, head_dim: usize) {
    if mlxb::engine::kernels::attention::f32_values_fit(1, 1, head_dim) {
        assert_eq!(
            steps,
            gen_tokens - 1,
            "decode steps taken by the L1 host step"
        );
    } else {
        eprintln!("this machine's OpenBLAS sums attention otherwise: checked off the host step");
        assert_eq!(steps, 0);
    }
}

/// Also an MLP and a head wide enough (over 1,200 outputs) that OpenBLAS sums their
/// single-token products on its GEMM driver, which the step reads from a packed copy.
#[test]
fn llama_f32_untied_llama3_rope() {
    let rope = json!({"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
        "high_freq_factor": 4.0, "original_max_position_embeddings": 16});
    let config = llama(
        json!({"tie_word_embeddings": false, "rope_scaling": rope, "head_dim": 32,
        "intermediate_size": 1280, "vocab_size": 1536}),
    );
    let packed = packed_calls().1;
    let steps = check_lengths(config, "f32", None, 2048, (PROMPT_LEN, GEN_TOKENS));
    assert_host_steps(steps, GEN_TOKENS, 32);
    if steps > 0 {
        assert!(packed_calls().1 > packed, "the f32 host step's products");
    }
}

/// The L1 host step on a tied f32 llama with three query heads per key/value head (SmolLM2's
/// grouping), decoding from 1,010 to 1,210 positions: past the step's first rope table (1,024
/// positions, so it is rebuilt larger) and past 1,200 keys, where OpenBLAS stops summing the
/// attention scores on its small-matrix kernel.
#[test]
fn llama_f32_host_step_across_rope_table_growth_and_long_attention() {
    let config = llama(json!({"num_attention_heads": 6, "num_key_value_heads": 2, "head_dim": 32}));
    let steps = check_lengths(config, "f32", None, 512, (1010, 200));
    assert_host_steps(steps, 200, 32);
}

/// Speculative verify blocks of one to eight tokens on an f32 llama with SmolLM2's grouping
/// (three query heads per key/value head) are L1 host steps whose logits are bit-identical to
/// mlx-lm forwarding the same blocks on the same cache. The block's size decides how OpenBLAS
/// sums its attention scores (the small-matrix kernel reduces a whole group of four queries
/// with its transpose, the queries past it alone, and past 1,200 scores its GEMM driver takes
/// over), so every size from one to eight is checked, at depths on both sides of that limit.
#[test]
fn llama_f32_verify_blocks_of_one_to_eight_tokens() {
    let packed = packed_calls().1;
    let (steps, warm_steps, sizes) = verify_blocks_of_one_to_eight_tokens("f32");
    if steps > 0 {
        // Its query projection (192 outputs) and head (384) sum a single token on OpenBLAS's
        // small-matrix kernel but the longer blocks on its GEMM driver: those blocks read the
        // copies made for verify blocks.
        assert!(packed_calls().1 > packed, "the blocks' packed products");
    }
    if mlxb::engine::kernels::attention::f32_values_fit(1, 1, 32) {
        // OpenBLAS's `Haswell` kernels sum a product of four or more tokens through this
        // model's small weights on one thread, in its 8×4 tile's two chains (which the host
        // reproduces for attention only, `kernels::haswell_tiles`): the step's check refuses
        // those blocks there, and they take the per-layer path. SmolLM2's widths below.
        let haswell = F32Kernels::here() == F32Kernels::Haswell;
        let taken = sizes.iter().filter(|&&n| n < 4 || !haswell).count();
        assert_eq!(steps, taken, "blocks taken by the L1 host step");
        let warmed = (1..=8).filter(|&n| n < 4 || !haswell).count();
        assert_eq!(
            warm_steps, warmed,
            "warm-up blocks taken by the L1 host step"
        );
    } else {
        eprintln!("this machine's OpenBLAS sums attention otherwise: checked off the host step");
        assert_eq!(steps + warm_steps, 0);
    }
}

/// [`llama_f32_verify_blocks_of_one_to_eight_tokens`] at SmolLM2-135M's widths (576 wide,
/// nine query heads of 64 over three key/value heads, 1,536 in the MLP): every weight product of
/// up to eight tokens is past OpenBLAS's threading threshold, so every block is an L1 host step
/// on every kernel set, and on the `Haswell` kernels blocks of four or more sum part of their
/// attention in the two chains of the kernel's 8×4 tile (`kernels::haswell_tiles`).
#[test]
fn llama_f32_verify_blocks_at_smollm2_widths() {
    let config = llama(json!({
        "hidden_size": 576, "intermediate_size": 1536, "num_attention_heads": 9,
        "num_key_value_heads": 3, "head_dim": 64
    }));
    let (steps, warm_steps, sizes) = verify_blocks_of_one_to_eight_tokens_of(config, "f32");
    if mlxb::engine::kernels::attention::f32_values_fit(1, 1, 64) {
        assert_eq!(steps, sizes.len(), "blocks taken by the L1 host step");
        assert_eq!(warm_steps, 8, "warm-up blocks taken by the L1 host step");
    } else {
        assert_eq!(steps + warm_steps, 0);
    }
}

/// [`llama_f32_verify_blocks_of_one_to_eight_tokens`] for a bfloat16 llama, whose products and
/// attention MLX sums in its own order whatever the block's size: every block is a host step.
#[test]
fn llama_bf16_verify_blocks_of_one_to_eight_tokens() {
    let (steps, warm_steps, sizes) = verify_blocks_of_one_to_eight_tokens("bf16");
    let available = mlxb::engine::kernels::mlx_order::available();
    assert_eq!(steps, if available { sizes.len() } else { 0 });
    assert_eq!(warm_steps, if available { 8 } else { 0 });
}

/// Forwards blocks of every size from one to eight (after `measure`'s warm-up) past a 141-token
/// prompt of a llama of `dtype`, each required to give mlx-lm's logits bit for bit; returns how
/// many of them and of the warm-up's blocks the L1 host step took, and the blocks' sizes.
fn verify_blocks_of_one_to_eight_tokens(dtype: &str) -> (usize, usize, Vec<usize>) {
    let config = llama(json!({"num_attention_heads": 6, "num_key_value_heads": 2, "head_dim": 32}));
    verify_blocks_of_one_to_eight_tokens_of(config, dtype)
}

/// [`verify_blocks_of_one_to_eight_tokens`] for the llama of `config`.
fn verify_blocks_of_one_to_eight_tokens_of(
    config: serde_json::Value,
    dtype: &str,
) -> (usize, usize, Vec<usize>) {
    let dir = tempfile::tempdir().unwrap();
    common::make_model(dir.path(), &config, dtype, None);
    let vocab = config["vocab_size"].as_u64().unwrap() as u32;
    let prompt = common::prompt_ids(141, vocab, 3);
    let sizes = [1usize, 2, 3, 4, 5, 6, 7, 8, 8, 7, 6, 5, 4, 3];
    let blocks: Vec<Vec<u32>> = (0..sizes.len())
        .map(|i| common::prompt_ids(sizes[i], vocab, 11 + i as u32))
        .collect();
    let oracle = common::oracle_trace(&json!({
        "model": dir.path(),
        "prompt_ids": prompt,
        "max_tokens": 1,
        "prompt_logits": true,
        "blocks": blocks,
    }));

    let mut loaded = models::load(dir.path(), Forks::default()).unwrap();
    // `measure`'s warm-up runs every block size once on scratch caches first: the blocks
    // below must come out the same after it.
    let warm_before = exact_steps_here();
    loaded.warm_up_blocks(8).unwrap();
    let warm_steps = exact_steps_here() - warm_before;
    let model = loaded.model.as_mut();
    let mut caches = model.make_caches();
    let ids = |ids: &[u32]| {
        let v: Vec<i32> = ids.iter().map(|&t| t as i32).collect();
        mlx_rs::Array::from_slice(&v, &[1, v.len() as i32])
    };
    model.forward(&ids(&prompt), &mut caches).unwrap();
    let steps_before = exact_steps_here();
    for (i, block) in blocks.iter().enumerate() {
        let logits = model.forward(&ids(block), &mut caches).unwrap();
        let want = &oracle[&format!("block_logits_{i}")];
        assert_eq!(
            common::bits(&logits.squeeze_axes(&[0]).unwrap()),
            common::bits(want),
            "logits of block {i} ({} tokens) differ from mlx-lm",
            block.len()
        );
    }
    let steps = exact_steps_here() - steps_before;
    (steps, warm_steps, sizes.to_vec())
}

#[test]
fn llama_4bit_chunked_prefill() {
    check(
        llama(json!({"hidden_size": 128, "intermediate_size": 256})),
        "bf16",
        Some(4),
        16,
    );
}

#[test]
fn llama_sliding_window_layers() {
    check(
        llama(json!({"num_hidden_layers": 3, "sliding_window": 12,
            "layer_types": ["sliding_attention", "full_attention", "sliding_attention"]})),
        "bf16",
        None,
        2048,
    );
}

fn qwen2(extra: serde_json::Value) -> serde_json::Value {
    with(
        json!({
            "model_type": "qwen2", "hidden_size": 64, "num_hidden_layers": 2, "intermediate_size": 128,
            "num_attention_heads": 4, "num_key_value_heads": 2, "rms_norm_eps": 1e-6, "vocab_size": 384
        }),
        extra,
    )
}

#[test]
fn qwen2_bf16() {
    check(qwen2(json!({})), "bf16", None, 2048);
}

#[test]
fn qwen2_4bit_untied_chunked_prefill() {
    check(
        qwen2(
            json!({"hidden_size": 128, "intermediate_size": 256, "num_key_value_heads": 1,
            "tie_word_embeddings": false}),
        ),
        "bf16",
        Some(4),
        16,
    );
}

fn qwen3(extra: serde_json::Value) -> serde_json::Value {
    with(
        json!({
            "model_type": "qwen3", "hidden_size": 64, "num_hidden_layers": 2, "intermediate_size": 128,
            "num_attention_heads": 4, "num_key_value_heads": 1, "rms_norm_eps": 1e-6, "vocab_size": 384,
            "max_position_embeddings": 4096, "head_dim": 32, "tie_word_embeddings": true
        }),
        extra,
    )
}

#[test]
fn qwen3_bf16_rope_parameters() {
    // transformers >= 5 layout: rope_theta only inside rope_parameters.
    check(
        qwen3(json!({"rope_parameters": {"rope_theta": 1000000.0, "rope_type": "default"}})),
        "bf16",
        None,
        2048,
    );
}

#[test]
fn qwen3_4bit_untied_linear_rope() {
    check(
        qwen3(
            json!({"hidden_size": 128, "intermediate_size": 256, "num_attention_heads": 2,
            "num_key_value_heads": 2, "head_dim": 64, "tie_word_embeddings": false, "rope_theta": 10000.0,
            "rope_scaling": {"type": "linear", "factor": 2.0}}),
        ),
        "bf16",
        Some(4),
        2048,
    );
}

fn gemma3(extra: serde_json::Value) -> serde_json::Value {
    with(
        json!({
            "model_type": "gemma3_text", "hidden_size": 128, "num_hidden_layers": 4, "intermediate_size": 256,
            "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 32, "vocab_size": 384,
            "query_pre_attn_scalar": 24, "sliding_window": 8, "sliding_window_pattern": 3
        }),
        extra,
    )
}

#[test]
fn gemma3_text_bf16_sliding_window() {
    // Window 8 < 45-token prompt + 32 generated; layers: sliding, sliding, global, sliding.
    check(gemma3(json!({})), "bf16", None, 2048);
}

/// An f32 gemma3 (off the llama host step: its layers run per layer on MLX and the host
/// products) with an MLP and a tied head wide enough (over 1,200 outputs) that OpenBLAS sums
/// their single-token products on its GEMM driver: those read the packed copies, made at the
/// first decode token, and still give mlx-lm's bits.
#[test]
fn gemma3_text_f32_wide_products_read_packed_copies() {
    let packed = dense_packed_calls();
    check(
        gemma3(json!({"intermediate_size": 1280, "vocab_size": 1536})),
        "f32",
        None,
        2048,
    );
    if mlxb::engine::kernels::mlx_order::available() {
        assert!(
            dense_packed_calls() > packed,
            "single-token products of the GEMM driver's shapes"
        );
    }
}

#[test]
fn gemma3_text_bf16_chunked_prefill_tied() {
    // No lm_head in the checkpoint: gemma3's sanitize ties the head to the embedding.
    check(
        gemma3(json!({"_drop_modules": ["lm_head"]})),
        "bf16",
        None,
        16,
    );
}

#[test]
fn gemma3_text_4bit_tied_linear_rope() {
    check(
        gemma3(
            json!({"num_attention_heads": 2, "num_key_value_heads": 1, "head_dim": 64,
            "sliding_window": 12, "sliding_window_pattern": 2, "_drop_modules": ["lm_head"],
            "rope_scaling": {"rope_type": "linear", "factor": 8.0}}),
        ),
        "bf16",
        Some(4),
        2048,
    );
}

#[test]
fn gemma3_text_f16_clip_residual() {
    check(gemma3(json!({"num_hidden_layers": 3})), "f16", None, 16);
}

/// Seeded sampling through the whole loop (temp, top-p, top-k, min-p, repetition penalty):
/// the same seed and settings give the same ids as mlx-lm's generate_step.
#[test]
fn llama_seeded_sampling_matches_mlx_lm() {
    let dir = tempfile::tempdir().unwrap();
    let config = llama(json!({}));
    common::make_model(dir.path(), &config, "bf16", None);
    let prompt = common::prompt_ids(PROMPT_LEN, 384, 2);
    let oracle = common::oracle_trace(&json!({
        "model": dir.path(), "prompt_ids": prompt, "max_tokens": GEN_TOKENS, "seed": 7,
        "sampler": {"temp": 1.3, "top_p": 0.95, "top_k": 40, "min_p": 0.02},
        "processors": {"repetition_penalty": 1.3, "repetition_context_size": 16},
    }));
    let mut loaded = models::load(dir.path(), Forks::default()).unwrap();
    mlxb::engine::sample::seed(7).unwrap();
    let mut sampler = Sampler::new(&SamplerConfig {
        temp: 1.3,
        top_p: 0.95,
        top_k: 40,
        min_p: 0.02,
        ..Default::default()
    })
    .unwrap();
    let mut processors = LogitsProcessors::new(&ProcessorConfig {
        repetition_penalty: Some(1.3),
        repetition_context_size: 16,
        ..Default::default()
    })
    .unwrap();
    let cfg = GenerateConfig {
        max_tokens: GEN_TOKENS,
        prefill_step_size: 2048,
    };
    let mut ids = vec![];
    Generator::new(loaded.model.as_mut(), &mut sampler, &mut processors)
        .run(&prompt, &cfg, |s| {
            ids.push(s.token as i32);
            Ok(Flow::Continue)
        })
        .unwrap();
    let want: Vec<i32> = oracle["ids"].as_slice::<i32>().to_vec();
    let distinct: std::collections::BTreeSet<_> = want.iter().collect();
    assert!(
        distinct.len() > 4,
        "sampling collapsed; the test would not discriminate: {want:?}"
    );
    assert_eq!(ids, want, "seeded sampled ids differ from mlx-lm");
}

#[test]
fn gemma2_bf16_softcaps() {
    check(common::tiny_gemma2(json!({})), "bf16", None, 2048);
}

#[test]
fn gemma2_bf16_chunked_prefill_mha() {
    // No grouping (kv heads == heads), default caps, wider heads.
    check(
        common::tiny_gemma2(
            json!({"num_key_value_heads": 4, "head_dim": 32, "num_hidden_layers": 3,
            "attn_logit_softcapping": 50.0, "final_logit_softcapping": 30.0, "query_pre_attn_scalar": 144}),
        ),
        "bf16",
        None,
        16,
    );
}

#[test]
fn gemma2_4bit_mqa() {
    check(
        common::tiny_gemma2(
            json!({"hidden_size": 128, "intermediate_size": 256, "num_key_value_heads": 1,
            "head_dim": 64, "rope_theta": 500.0}),
        ),
        "bf16",
        Some(4),
        16,
    );
}

fn minicpm(extra: serde_json::Value) -> serde_json::Value {
    with(
        json!({
            "model_type": "minicpm", "hidden_size": 64, "dim_model_base": 16, "num_hidden_layers": 2,
            "intermediate_size": 128, "num_attention_heads": 4, "num_key_value_heads": 2,
            "rms_norm_eps": 1e-5, "vocab_size": 384, "scale_depth": 1.4, "scale_emb": 12,
            "rope_theta": 10000.0, "tie_word_embeddings": false
        }),
        extra,
    )
}

#[test]
fn minicpm_bf16() {
    check(minicpm(json!({})), "bf16", None, 2048);
}

#[test]
fn minicpm_bf16_head_from_embedding_chunked_prefill() {
    // No lm_head in the checkpoint: mlx-lm's sanitize uses the embedding table as the head.
    check(
        minicpm(json!({"_drop_modules": ["lm_head"], "num_hidden_layers": 3,
            "num_key_value_heads": 1, "scale_emb": 2.5, "scale_depth": 0.7, "dim_model_base": 24})),
        "bf16",
        None,
        16,
    );
}

#[test]
fn minicpm_4bit_linear_rope() {
    check(
        minicpm(
            json!({"hidden_size": 128, "intermediate_size": 256, "num_attention_heads": 2,
            "num_key_value_heads": 2, "rope_scaling": {"type": "linear", "factor": 4.0}}),
        ),
        "bf16",
        Some(4),
        16,
    );
}

fn qwen3_moe(extra: serde_json::Value) -> serde_json::Value {
    with(
        json!({
            "model_type": "qwen3_moe", "hidden_size": 64, "num_hidden_layers": 2, "intermediate_size": 96,
            "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16, "rms_norm_eps": 1e-6,
            "vocab_size": 384, "num_experts": 4, "num_experts_per_tok": 2, "decoder_sparse_step": 1,
            "mlp_only_layers": [], "moe_intermediate_size": 32, "rope_theta": 10000.0,
            "tie_word_embeddings": false, "max_position_embeddings": 4096, "norm_topk_prob": true
        }),
        extra,
    )
}

// MLX's CPU `gather_mm` (unquantized experts) supports only float32, in mlx-lm as here, so the
// unquantized MoE tests run in f32 and the bf16 ones are quantized (`gather_qmm`).

#[test]
fn qwen3_moe_f32() {
    // 45 prompt tokens x 2 experts: the prefill takes mlx-lm's sort-by-expert path.
    check(qwen3_moe(json!({})), "f32", None, 2048);
}

#[test]
fn qwen3_moe_f32_sparse_step_chunked_prefill() {
    // Layer 0 dense (mlp_only_layers), layer 1 dense (sparse step 2), layer 3 MoE with 8 experts,
    // top-4 (16-token chunks x 4 = 64: the sorted path), scores not renormalized, tied head.
    check(
        qwen3_moe(
            json!({"num_hidden_layers": 4, "num_experts": 8, "num_experts_per_tok": 4,
            "decoder_sparse_step": 2, "mlp_only_layers": [0], "norm_topk_prob": false,
            "tie_word_embeddings": true, "head_dim": 32, "num_key_value_heads": 1}),
        ),
        "f32",
        None,
        16,
    );
}

#[test]
fn qwen3_moe_4bit_f32_mixed() {
    // down_proj's input (32) is not a multiple of the group size: mlx-lm leaves it unquantized
    // (f32: see above), and the router gate is 8-bit (qwen3_moe's quant_predicate).
    check(
        qwen3_moe(
            json!({"hidden_size": 128, "intermediate_size": 128, "num_experts": 6,
            "num_experts_per_tok": 3, "moe_intermediate_size": 32, "head_dim": 32}),
        ),
        "f32",
        Some(4),
        16,
    );
}

#[test]
fn qwen3_moe_4bit_quantized_down_proj() {
    check(
        qwen3_moe(
            json!({"hidden_size": 128, "intermediate_size": 128, "num_experts": 3,
            "num_experts_per_tok": 1, "moe_intermediate_size": 64, "num_attention_heads": 2,
            "num_key_value_heads": 2, "head_dim": 64}),
        ),
        "bf16",
        Some(4),
        2048,
    );
}

#[test]
fn qwen3_5_bf16() {
    // Layers: linear, full, linear, full. Gated delta state repeated over 2 value heads per key head.
    check(tiny_qwen3_5(json!({})), "bf16", None, 2048);
}

#[test]
fn qwen3_5_bf16_chunked_prefill() {
    // 3 linear layers then 1 full; 1 key head shared by 4 value heads of another width; conv
    // kernel 3; mrope with mlx-lm's default partial rotary factor; tied head.
    check(
        tiny_qwen3_5(
            json!({"full_attention_interval": 4, "linear_num_key_heads": 1,
            "linear_key_head_dim": 32, "linear_value_head_dim": 8, "linear_conv_kernel_dim": 3,
            "num_key_value_heads": 1, "head_dim": 32, "tie_word_embeddings": true,
            "rope_parameters": {"type": "mrope", "mrope_section": [2, 1, 1], "rope_theta": 5000}}),
        ),
        "bf16",
        None,
        16,
    );
}

#[test]
fn qwen3_5_4bit_text_config() {
    // Nested `text_config` (as Qwen3.5 checkpoints ship it); out_proj input (4 x 16) is quantized,
    // o_proj's (2 x 48 = 96) is not a multiple of the group size and stays dense.
    let text = tiny_qwen3_5(
        json!({"hidden_size": 128, "intermediate_size": 256, "num_attention_heads": 2,
        "num_key_value_heads": 2, "head_dim": 48, "linear_num_value_heads": 4, "linear_num_key_heads": 4,
        "full_attention_interval": 3, "num_hidden_layers": 3}),
    );
    let config = json!({"model_type": "qwen3_5", "vocab_size": 384, "text_config": text});
    check(config, "bf16", Some(4), 16);
}

fn qwen3_5_moe(extra: serde_json::Value) -> serde_json::Value {
    with(
        tiny_qwen3_5(
            json!({"model_type": "qwen3_5_moe", "num_experts": 4, "num_experts_per_tok": 2,
            "moe_intermediate_size": 32, "shared_expert_intermediate_size": 48}),
        ),
        extra,
    )
}

#[test]
fn qwen3_5_moe_f32() {
    check(qwen3_5_moe(json!({})), "f32", None, 2048);
}

#[test]
fn qwen3_5_moe_f32_chunked_prefill_top1() {
    check(
        qwen3_5_moe(
            json!({"num_experts": 5, "num_experts_per_tok": 1, "norm_topk_prob": false,
            "full_attention_interval": 3, "num_hidden_layers": 3}),
        ),
        "f32",
        None,
        16,
    );
}

#[test]
fn qwen3_5_moe_4bit() {
    // Experts 64 wide: every projection quantized; router and shared-expert gate 8-bit.
    check(
        qwen3_5_moe(json!({"hidden_size": 128, "moe_intermediate_size": 64,
            "shared_expert_intermediate_size": 64, "num_experts": 8, "num_experts_per_tok": 4})),
        "bf16",
        Some(4),
        16,
    );
}

#[test]
fn gemma4_text_bf16_kv_sharing_per_layer_inputs() {
    // Layers s, s, F, s, s (window 8 < prompt); the last two reuse layer 1's keys/values and have
    // double-wide MLPs; global layer: 32-wide heads with mlx-lm's default proportional RoPE
    // (a quarter rotated); per-layer input embeddings; final soft-cap 30.
    check(common::tiny_gemma4(json!({})), "bf16", None, 2048);
}

#[test]
fn gemma4_text_bf16_layer_types_chunked_prefill() {
    // Explicit layer types; shared layers 4 (sliding → 2) and 5 (full → 3); no global head dim,
    // half-rotated proportional RoPE with a factor; no per-layer inputs, no soft-cap, untied.
    check(
        common::tiny_gemma4(json!({
            "num_hidden_layers": 6, "global_head_dim": null, "hidden_size_per_layer_input": 0,
            "layer_types": ["full_attention", "sliding_attention", "sliding_attention",
                "full_attention", "sliding_attention", "full_attention"],
            "use_double_wide_mlp": false, "final_logit_softcapping": null, "tie_word_embeddings": false,
            "num_key_value_heads": 1, "sliding_window": 12,
            "rope_parameters": {
                "full_attention": {"rope_type": "proportional", "partial_rotary_factor": 0.5,
                    "rope_theta": 10000.0, "factor": 2.0},
                "sliding_attention": {"rope_type": "default", "rope_theta": 1000.0}}
        })),
        "bf16",
        None,
        16,
    );
}

#[test]
fn gemma4_text_4bit_per_layer_inputs() {
    check(
        common::tiny_gemma4(
            json!({"hidden_size": 128, "intermediate_size": 128, "hidden_size_per_layer_input": 64,
            "num_attention_heads": 2, "head_dim": 64, "global_head_dim": 128, "num_key_value_heads": 1}),
        ),
        "bf16",
        Some(4),
        16,
    );
}

fn gemma4_moe(extra: serde_json::Value) -> serde_json::Value {
    common::tiny_gemma4(with(
        json!({"enable_moe_block": true, "num_experts": 4, "top_k_experts": 2,
            "moe_intermediate_size": 32, "attention_k_eq_v": true, "num_global_key_value_heads": 1,
            "num_kv_shared_layers": 0, "hidden_size_per_layer_input": 0, "num_hidden_layers": 4}),
        extra,
    ))
}

#[test]
fn gemma4_text_moe_f32_k_eq_v() {
    // 26B-A4B-style: routed experts next to the dense MLP, K == V on global layers.
    check(gemma4_moe(json!({})), "f32", None, 2048);
}

#[test]
fn gemma4_text_moe_f32_chunked_prefill_shared_kv() {
    check(
        gemma4_moe(
            json!({"num_experts": 6, "top_k_experts": 4, "num_kv_shared_layers": 1,
            "num_global_key_value_heads": 2, "sliding_window_pattern": 2}),
        ),
        "f32",
        None,
        16,
    );
}

#[test]
fn gemma4_text_moe_4bit() {
    check(
        gemma4_moe(
            json!({"hidden_size": 128, "intermediate_size": 128, "moe_intermediate_size": 64,
            "head_dim": 32, "global_head_dim": 64}),
        ),
        "bf16",
        Some(4),
        16,
    );
}

/// Checkpoints in Hugging Face layout (per-expert or fused expert tensors, HF conv layout and
/// `w - 1` norms, HF key prefixes, MTP/vision/KV-shared extras): loading goes through each
/// family's `sanitize`, on both sides.
#[test]
fn hf_layout_checkpoints_are_sanitized() {
    let hf = json!({"_hf_layout": true});
    check(with(qwen3_moe(json!({})), hf.clone()), "f32", None, 2048);
    check(with(tiny_qwen3_5(json!({})), hf.clone()), "bf16", None, 16);
    check(with(qwen3_5_moe(json!({})), hf.clone()), "f32", None, 2048);
    check(
        with(gemma4_moe(json!({"num_kv_shared_layers": 1})), hf),
        "f32",
        None,
        2048,
    );
}

/// Recurrent (gated delta-net) and attention caches roll back exactly: snapshot after a prefix,
/// run a block, restore, run it again — identical logits and state.
#[test]
fn qwen3_5_cache_snapshot_restore_is_exact() {
    let dir = tempfile::tempdir().unwrap();
    common::make_model_with(
        dir.path(),
        &tiny_qwen3_5(json!({})),
        "bf16",
        None,
        &["--no-tokenizer"],
    );
    let mut loaded = models::load(dir.path(), Forks::default()).unwrap();
    let model = loaded.model.as_mut();
    let ids: Vec<i32> = common::prompt_ids(24, 384, 3)
        .iter()
        .map(|&t| t as i32)
        .collect();
    let mut caches = model.make_caches();
    let prefix = mlx_rs::Array::from_slice(&ids[..16], &[1, 16]);
    model.forward(&prefix, &mut caches).unwrap();
    let saved: Vec<_> = caches.iter().map(|c| c.snapshot()).collect();
    let block = mlx_rs::Array::from_slice(&ids[16..], &[1, 8]);
    let first = model.forward(&block, &mut caches).unwrap();
    let state_after: Vec<Vec<u64>> = caches
        .iter()
        .flat_map(|c| c.state())
        .map(|a| common::bits(&a))
        .collect();
    for (c, s) in caches.iter_mut().zip(saved) {
        c.restore(s).unwrap();
    }
    assert_eq!(
        caches[0].offset(),
        16,
        "recurrent cache offset not rolled back"
    );
    let again = model.forward(&block, &mut caches).unwrap();
    assert_eq!(common::bits(&first), common::bits(&again));
    let state_again: Vec<Vec<u64>> = caches
        .iter()
        .flat_map(|c| c.state())
        .map(|a| common::bits(&a))
        .collect();
    assert_eq!(state_after, state_again);
}
