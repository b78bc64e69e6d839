//! L1 under batching: mlxb's batched engine against mlx-lm 0.32.2's own `BatchGenerator` (the
//! loop `batch_generate` runs) on tiny random models built by mlx-lm. For the same prompts,
//! budgets and batch sizes, every sequence's greedy ids and full-vocabulary logprobs must be
//! bit-identical, while sequences join (a second prefill group) and leave (budgets, a stop
//! token) mid-run.

mod common;

use common::with;
use mlx_rs::ops::indexing::IndexOp;
use mlxb::engine::batch::{generate_all, BatchGenerator, BatchSettings, SequenceRequest};
use mlxb::engine::forks::Forks;
use mlxb::engine::models;
use mlxb::engine::sample::{Sampler, SamplerConfig};
use mlxb::engine::text::FinishReason;
use serde_json::json;
use std::collections::HashMap;

/// Runs mlx-lm's batched loop through assets/oracle/mlx_lm_batch.py.
fn oracle(request: &serde_json::Value) -> HashMap<String, mlx_rs::Array> {
    let dir = tempfile::tempdir().unwrap();
    let req = dir.path().join("req.json");
    let out = dir.path().join("out.safetensors");
    std::fs::write(&req, request.to_string()).unwrap();
    common::run_python(
        &common::root().join("assets/oracle/mlx_lm_batch.py"),
        &[req.to_str().unwrap(), out.to_str().unwrap()],
    );
    mlx_rs::Array::load_safetensors(&out).unwrap()
}

/// What one sequence produced: ids, logprob rows, whether a stop token ended it.
type Produced = (Vec<i32>, Vec<mlx_rs::Array>, bool);

/// mlxb's batched engine on the same request.
fn mlxb_batch(dir: &std::path::Path, req: &serde_json::Value) -> Vec<Produced> {
    let mut loaded = models::load(dir, Forks::default()).unwrap();
    let prompts: Vec<Vec<u32>> = serde_json::from_value(req["prompts"].clone()).unwrap();
    let budgets: Vec<usize> = serde_json::from_value(req["max_tokens"].clone()).unwrap();
    let stop: Vec<u32> = serde_json::from_value(req["stop_tokens"].clone()).unwrap();
    let settings = BatchSettings {
        prefill_batch_size: req["prefill_batch_size"].as_u64().unwrap() as usize,
        completion_batch_size: req["completion_batch_size"].as_u64().unwrap() as usize,
        prefill_step_size: req["prefill_step_size"].as_u64().unwrap() as usize,
    };
    let requests = prompts
        .into_iter()
        .zip(budgets)
        .map(|(p, m)| SequenceRequest::new(p, m))
        .collect();
    let out = generate_all(&mut loaded, greedy(), stop, settings, requests).unwrap();
    out.into_iter()
        .map(|g| {
            let ids = g.tokens.iter().map(|&t| t as i32).collect();
            (ids, g.logprobs, g.finish == FinishReason::Eos)
        })
        .collect()
}

fn greedy() -> Sampler {
    Sampler::new(&SamplerConfig::default()).unwrap()
}

fn request(
    model: &std::path::Path,
    vocab: u32,
    lengths: &[usize],
    budgets: &[usize],
) -> serde_json::Value {
    let prompts: Vec<Vec<u32>> = lengths
        .iter()
        .enumerate()
        .map(|(i, &n)| common::prompt_ids(n, vocab, i as u32 + 1))
        .collect();
    json!({
        "model": model, "prompts": prompts, "max_tokens": budgets, "stop_tokens": [],
        "prefill_batch_size": 8, "completion_batch_size": 32, "prefill_step_size": 2048,
    })
}

/// Compares mlxb's batched run with mlx-lm's, sequence by sequence and step by step.
fn compare(dir: &std::path::Path, req: &serde_json::Value) {
    let want = oracle(req);
    let got = mlxb_batch(dir, req);
    for (i, (ids, rows, stopped)) in got.iter().enumerate() {
        let want_ids = want[&format!("ids_{i}")].as_slice::<i32>().to_vec();
        assert_eq!(
            ids, &want_ids,
            "sequence {i}: ids differ from mlx-lm's batch"
        );
        let want_rows = &want[&format!("logprobs_{i}")];
        for (s, row) in rows.iter().enumerate() {
            assert_eq!(
                common::bits(row),
                common::bits(&want_rows.index(s as i32)),
                "sequence {i}: logprobs differ from mlx-lm's batch at step {s}"
            );
        }
        let want_stop = want[&format!("stopped_{i}")].as_slice::<bool>()[0];
        assert_eq!(*stopped, want_stop, "sequence {i}: end reason differs");
    }
}

fn build(config: &serde_json::Value, dtype: &str, bits: Option<u32>) -> tempfile::TempDir {
    let dir = tempfile::tempdir().unwrap();
    common::make_model(dir.path(), config, dtype, bits);
    dir
}

#[test]
fn llama_f32_sequences_join_and_leave() {
    let config = common::tiny_llama(json!({}));
    let dir = build(&config, "f32", None);
    // Two prefill groups of two (the later ones join a running batch), a one-token prompt,
    // budgets that end sequences at different steps.
    let mut req = request(
        dir.path(),
        384,
        &[9, 30, 1, 17, 5, 22],
        &[6, 14, 4, 20, 9, 11],
    );
    req["prefill_batch_size"] = json!(2);
    req["completion_batch_size"] = json!(4);
    compare(dir.path(), &req);
    // A stop token taken from the run itself ends a sequence early (and is reported).
    let first = oracle(&req);
    let stop = first["ids_3"].as_slice::<i32>()[5];
    req["stop_tokens"] = json!([stop]);
    compare(dir.path(), &req);
}

#[test]
fn llama_bf16_chunked_prefill() {
    let config = common::tiny_llama(json!({"num_hidden_layers": 2}));
    let dir = build(&config, "bf16", None);
    let mut req = request(dir.path(), 384, &[13, 40, 7, 26], &[12, 8, 16, 10]);
    req["prefill_step_size"] = json!(8);
    compare(dir.path(), &req);
}

#[test]
fn qwen3_4bit() {
    let config = common::tiny_qwen3(json!({"hidden_size": 128, "intermediate_size": 256}));
    let dir = build(&config, "bf16", Some(4));
    let req = request(dir.path(), 384, &[11, 25, 3, 18, 33], &[10, 7, 12, 9, 5]);
    compare(dir.path(), &req);
}

#[test]
fn qwen2_f32_untied() {
    let config = with(
        json!({
            "model_type": "qwen2", "hidden_size": 64, "num_hidden_layers": 2, "intermediate_size": 128,
            "num_attention_heads": 4, "num_key_value_heads": 2, "rms_norm_eps": 1e-6, "vocab_size": 384
        }),
        json!({"tie_word_embeddings": false}),
    );
    let dir = build(&config, "f32", None);
    let req = request(dir.path(), 384, &[21, 6, 14], &[9, 15, 6]);
    compare(dir.path(), &req);
}

/// gemma2: attention computed by hand with soft-capped scores over the batch's padded mask
/// (with as many key/value heads as query heads: mlx-lm's gemma2 cannot broadcast a batch mask
/// over grouped heads).
#[test]
fn gemma2_bf16_softcapped_attention() {
    let config = common::tiny_gemma2(json!({"num_key_value_heads": 4}));
    let dir = build(&config, "bf16", None);
    let req = request(dir.path(), 384, &[16, 3, 25], &[10, 14, 8]);
    compare(dir.path(), &req);
}

/// Sliding-window layers (mlx-lm's `BatchRotatingKVCache`, window 8) beside global ones:
/// prompts shorter and longer than the window, decoding far past it, rows joining a batch whose
/// rings have wrapped (at other write positions) and leaving it.
#[test]
fn gemma3_bf16_sliding_window_rings_join_and_leave() {
    let dir = build(&common::tiny_gemma3(), "bf16", None);
    let mut req = request(dir.path(), 384, &[5, 19, 3, 12, 27], &[20, 9, 25, 14, 6]);
    req["prefill_batch_size"] = json!(2);
    req["completion_batch_size"] = json!(3);
    compare(dir.path(), &req);
}

/// llama with `layer_types`: sliding layers (window 12) first, so the batch's sliding mask comes
/// from a ring and the full one from the layer after it.
#[test]
fn llama_f32_sliding_layers() {
    let config = common::tiny_llama(json!({"num_hidden_layers": 3, "sliding_window": 12,
        "layer_types": ["sliding_attention", "full_attention", "sliding_attention"]}));
    let dir = build(&config, "f32", None);
    let mut req = request(dir.path(), 384, &[9, 26, 15], &[20, 8, 16]);
    req["prefill_batch_size"] = json!(2);
    compare(dir.path(), &req);
}

/// Prefill chunks shorter than the prompts, so right padding is appended to the ring chunk by
/// chunk and rolled out before it can evict a row's real positions.
#[test]
fn gemma3_f32_chunked_prefill_past_the_window() {
    let dir = build(&common::tiny_gemma3(), "f32", None);
    let mut req = request(dir.path(), 384, &[30, 7, 18, 11], &[12, 16, 10, 18]);
    req["prefill_step_size"] = json!(6);
    compare(dir.path(), &req);
}

/// gemma4: sliding and global layers with their own head widths, keys/values shared across
/// layers, per-layer inputs; every row rotated at its own position.
#[test]
fn gemma4_bf16_shared_kv_layers() {
    let dir = build(&common::tiny_gemma4(json!({})), "bf16", None);
    let mut req = request(dir.path(), 384, &[14, 4, 22, 9], &[11, 18, 7, 13]);
    req["prefill_batch_size"] = json!(3);
    compare(dir.path(), &req);
}

/// qwen3_5: gated delta-net layers (mlx-lm's `ArraysCache` rows: pad tokens masked out of the
/// conv and recurrent states, each row's conv state cut at its own length) beside gated
/// full-attention layers; right-padded prefill groups, rows joining and leaving.
#[test]
fn qwen3_5_bf16_recurrent_layers() {
    let dir = build(&common::tiny_qwen3_5(json!({})), "bf16", None);
    let mut req = request(dir.path(), 384, &[12, 3, 21, 8, 15], &[9, 14, 6, 12, 10]);
    req["prefill_batch_size"] = json!(3);
    req["completion_batch_size"] = json!(4);
    compare(dir.path(), &req);
}

/// The same in f32 with prefill chunks shorter than the prompts.
#[test]
fn qwen3_5_f32_chunked_prefill() {
    let dir = build(&common::tiny_qwen3_5(json!({})), "f32", None);
    let mut req = request(dir.path(), 384, &[17, 6, 11], &[8, 12, 10]);
    req["prefill_step_size"] = json!(5);
    compare(dir.path(), &req);
}

/// A quantized KV cache has no batched form (mlx-lm's batched caches cannot quantize): refused
/// with the reason and the way out.
#[test]
fn quantized_kv_caches_are_refused_with_the_reason() {
    let dir = build(&common::tiny_llama(json!({})), "f32", None);
    let forks = Forks {
        kv_quant: mlxb::engine::forks::KvQuant::Bits(4),
        ..Forks::default()
    };
    let loaded = models::load(dir.path(), forks).unwrap();
    let sampler = Sampler::new(&SamplerConfig::default()).unwrap();
    let err = BatchGenerator::new(
        loaded.model.as_ref(),
        &loaded.plan,
        sampler,
        vec![],
        BatchSettings::default(),
    )
    .err()
    .expect("a quantized KV cache cannot batch");
    let msg = err.to_string();
    assert!(
        msg.contains("--kv-quant") && msg.contains("--max-batch 1"),
        "{msg}"
    );
}

/// gemma2 with grouped heads, which mlx-lm's own gemma2 cannot batch (its `[B, 1, L, S]` mask
/// meets `[B, kv, rep, L, S]` scores; with B equal to the group size it broadcasts, silently,
/// over the wrong axis): each row of a batch of two must follow its own prompt, as alone (f32:
/// the same greedy ids, logprobs within 1e-4; a row's batch mask on another row's heads moves
/// them by far more).
#[test]
fn gemma2_grouped_heads_batch_row_by_row() {
    let dir = build(&common::tiny_gemma2(json!({})), "f32", None);
    let mut loaded = models::load(dir.path(), Forks::default()).unwrap();
    let prompts = [
        common::prompt_ids(19, 384, 3),
        common::prompt_ids(6, 384, 4),
    ];
    let requests = prompts
        .iter()
        .map(|p| SequenceRequest::new(p.clone(), 12))
        .collect();
    let batched = generate_all(
        &mut loaded,
        greedy(),
        vec![],
        BatchSettings::default(),
        requests,
    )
    .unwrap();
    for (i, (prompt, got)) in prompts.iter().zip(&batched).enumerate() {
        let alone = common::single_stream(&mut loaded, prompt, 12, 2048);
        let ids: Vec<u32> = alone.iter().map(|(t, _)| *t).collect();
        assert_eq!(got.tokens, ids, "row {i}: ids differ from the row alone");
        for (s, ((_, lp), row)) in alone.iter().zip(&got.logprobs).enumerate() {
            let diff = lp.subtract(row).unwrap().abs().unwrap().max(None).unwrap();
            let diff = diff.item_exact::<f32>();
            assert!(diff < 1e-4, "row {i} step {s}: logprobs differ by {diff}");
        }
    }
}

/// A batch of one takes the batched path (left-padded cache, array mask, per-row RoPE offsets)
/// and still equals the single-stream loop bit for bit: `serve` at one client answers exactly as
/// `generate` does. (Rows in a batch of several need not: see docs/serving.md.)
#[test]
fn a_batch_of_one_is_bit_identical_to_the_single_stream_path() {
    for (config, dtype, bits) in [
        (common::tiny_llama(json!({})), "f32", None),
        // Grouped heads under gemma2's hand-written attention, which mlx-lm cannot batch.
        (common::tiny_gemma2(json!({})), "bf16", None),
        (common::tiny_gemma3(), "bf16", None),
        (
            common::tiny_qwen3(json!({"hidden_size": 128, "intermediate_size": 256})),
            "bf16",
            Some(4),
        ),
    ] {
        let dir = build(&config, dtype, bits);
        let prompt = common::prompt_ids(23, 384, 5);
        let mut loaded = models::load(dir.path(), Forks::default()).unwrap();
        let request = vec![SequenceRequest::new(prompt.clone(), 20)];
        let batched = generate_all(
            &mut loaded,
            greedy(),
            vec![],
            BatchSettings::default(),
            request,
        )
        .unwrap()
        .remove(0);
        let alone = common::single_stream(&mut loaded, &prompt, 20, 2048);
        assert_same(dtype, &batched, &alone);
    }
}

/// Asserts a batched sequence's ids and logprobs equal the single-stream loop's, bit for bit.
fn assert_same(what: &str, got: &mlxb::engine::batch::Generated, alone: &[(u32, mlx_rs::Array)]) {
    let ids: Vec<u32> = alone.iter().map(|(t, _)| *t).collect();
    assert_eq!(
        got.tokens, ids,
        "{what}: ids differ from the single-stream loop"
    );
    for (s, ((_, lp), row)) in alone.iter().zip(&got.logprobs).enumerate() {
        assert_eq!(
            common::bits(lp),
            common::bits(row),
            "{what}: logprobs differ from the single-stream loop at step {s}"
        );
    }
}

/// The server's kept prefixes: a prompt the batch prefilled alone leaves the keys and values of
/// all but its last token; a later prompt that starts from them at a prefill boundary (or the
/// same prompt again), prefilled alone as well, is bit-identical to the single-stream loop on
/// the whole prompt. Prompts prefilled together are not kept.
#[test]
fn kept_prefixes_continue_bit_identically() {
    let dir = build(&common::tiny_llama(json!({})), "f32", None);
    let mut loaded = models::load(dir.path(), Forks::default()).unwrap();
    let settings = BatchSettings {
        prefill_step_size: 16,
        ..BatchSettings::default()
    };
    let keep = |loaded: &mut models::LoadedModel, prompts: &[Vec<u32>]| {
        let mut gen = BatchGenerator::new(
            loaded.model.as_ref(),
            &loaded.plan,
            greedy(),
            vec![],
            settings,
        )
        .unwrap()
        .capture_prefixes();
        let requests = prompts
            .iter()
            .map(|p| SequenceRequest::new(p.clone(), 3))
            .collect();
        gen.insert(requests).unwrap();
        while !gen.next_tokens(loaded.model.as_mut()).unwrap().is_empty() {}
        gen.take_prefixes()
    };
    let first = common::prompt_ids(40, 384, 7);
    let kept = keep(&mut loaded, std::slice::from_ref(&first));
    assert_eq!(kept.len(), 1, "a prompt prefilled alone is kept");
    let kv = kept[0].1.clone();
    assert_eq!(kv.len, 39);
    let mut next = first[..35].to_vec();
    next.extend(common::prompt_ids(12, 384, 9));
    for (what, prompt, reuse) in [
        ("two shared chunks of 16", next, 32),
        ("the same prompt again", first.clone(), 39),
    ] {
        let request = SequenceRequest {
            prefix: Some(kv.truncated(reuse)),
            ..SequenceRequest::new(prompt.clone(), 10)
        };
        let got = generate_all(&mut loaded, greedy(), vec![], settings, vec![request])
            .unwrap()
            .remove(0);
        assert_same(
            what,
            &got,
            &common::single_stream(&mut loaded, &prompt, 10, 16),
        );
    }
    let together = [first.clone(), common::prompt_ids(30, 384, 8)];
    assert!(
        keep(&mut loaded, &together).is_empty(),
        "prompts prefilled together are not kept"
    );
}
