//! The Gemma 4 assistant drafter: lossless behind the seam (greedy speculative ids equal
//! mlx-lm's greedy ids on a gemma4_text target with sliding and full layers, generating past
//! the window, with both head kinds), drafting leaves the target's caches byte-identical, its
//! drafted tokens and logits match an independent numpy reference of the spec's equations
//! (tests/oracle/gemma4_assistant.py), malformed checkpoints are refused with exit 2, and the
//! draft length comes from the checkpoint's generation_config when not given. In a batch, each
//! row's assistant reads that row's keys and values (lent by the batch) and drafts what it would
//! draft over a single stream of the same tokens.

mod common;
mod serve_harness;

use mlxb::engine::batch::{BatchGenerator, BatchSettings, DecodingRow, SequenceRequest};
use mlxb::engine::forks::Forks;
use mlxb::engine::models::{ForwardOpts, LanguageModel};
use mlxb::engine::sample::{Sampler, SamplerConfig};
use mlxb::engine::session::Session;
use mlxb::spec::assistant::config;
use mlxb::spec::assistant::drafter::AssistantSource;
use mlxb::spec::factory::{open_source, DraftKind, SpecOptions};
use mlxb::spec::slots::row_caches;
use mlxb::spec::source::{DraftSource, TargetView};
use serde_json::{json, Value};
use std::collections::HashMap;
use std::path::Path;

const GEN: usize = 40;
const VOCAB: u32 = 384;

/// Layers S, S, F, S | S, F (the last two KV-shared): donors are layer 3 (sliding) and layer 2
/// (full); window 8 < prompt 20 < generation.
fn target_config() -> Value {
    json!({
        "model_type": "gemma4_text", "hidden_size": 64, "num_hidden_layers": 6, "intermediate_size": 64,
        "num_attention_heads": 4, "head_dim": 16, "global_head_dim": 32, "num_key_value_heads": 2,
        "rms_norm_eps": 1e-6, "vocab_size": VOCAB, "vocab_size_per_layer_input": VOCAB,
        "num_kv_shared_layers": 2, "hidden_size_per_layer_input": 16, "sliding_window": 8,
        "layer_types": ["sliding_attention", "sliding_attention", "full_attention",
            "sliding_attention", "sliding_attention", "full_attention"]
    })
}

fn assistant_config(centroids: bool) -> Value {
    json!({
        "model_type": "gemma4_assistant", "backbone_hidden_size": 64,
        "use_ordered_embeddings": centroids, "num_centroids": 8, "centroid_intermediate_top_k": 2,
        "tie_word_embeddings": true,
        "text_config": {
            "model_type": "gemma4_text", "hidden_size": 32, "num_hidden_layers": 4,
            "intermediate_size": 64, "num_attention_heads": 4, "head_dim": 16, "global_head_dim": 32,
            "num_key_value_heads": 2, "vocab_size": VOCAB, "vocab_size_per_layer_input": 0,
            "hidden_size_per_layer_input": 0, "num_kv_shared_layers": 4, "sliding_window": 8,
            "use_double_wide_mlp": false, "enable_moe_block": false, "final_logit_softcapping": null,
            "layer_types": ["sliding_attention", "sliding_attention", "sliding_attention", "full_attention"]
        }
    })
}

fn target_with(config: &Value) -> tempfile::TempDir {
    let dir = tempfile::tempdir().unwrap();
    common::make_model(dir.path(), config, "f32", None);
    dir
}

fn assistant(config: &Value, seed: u32, extra: &[&str]) -> tempfile::TempDir {
    let dir = tempfile::tempdir().unwrap();
    let cfg = config.to_string();
    let seed = seed.to_string();
    let mut args = vec![
        "make",
        dir.path().to_str().unwrap(),
        cfg.as_str(),
        "--seed",
        seed.as_str(),
    ];
    args.extend_from_slice(extra);
    common::run_python(
        &common::root().join("tests/oracle/gemma4_assistant.py"),
        &args,
    );
    dir
}

fn options(path: &Path) -> SpecOptions {
    common::spec_options(DraftKind::Assistant, Some(path))
}

fn prompt() -> Vec<u32> {
    common::prompt_ids(20, VOCAB, 5)
}

/// `mlxb generate --model target --prompt "hello there" --max-tokens 12 --temp 0 EXTRA...`.
fn generate(target: &Path, extra: &[&str]) -> (i32, String, String) {
    let mut args = vec!["generate", "--model", target.to_str().unwrap()];
    args.extend([
        "--prompt",
        "hello there",
        "--max-tokens",
        "12",
        "--temp",
        "0",
    ]);
    args.extend_from_slice(extra);
    common::run_mlxb(&args)
}

#[test]
fn lossless_with_both_heads_past_the_window() {
    let dir = target_with(&target_config());
    let prompt = prompt();
    let t = common::oracle_trace(
        &json!({"model": dir.path(), "prompt_ids": prompt, "max_tokens": GEN}),
    );
    let want = t["ids"].as_slice::<i32>().to_vec();
    let mut session = Session::open(dir.path(), Forks::default()).unwrap();
    for (centroids, k) in [(false, 3), (true, 4)] {
        let asst = assistant(&assistant_config(centroids), 1, &[]);
        let source = open_source(&options(asst.path()), &session, Forks::default(), 2048).unwrap();
        let model = session.model.model.as_mut();
        let (got, metrics) = common::greedy_ids(model, &prompt, Some(source), k, GEN);
        let m = metrics.map(|m| (m.drafter.clone(), m.drafts, m.to_json()));
        let Some((drafter, drafts, json)) = m else {
            panic!("no metrics");
        };
        // Lossless, drafted by the assistant, and exercised (rounds well past the window).
        assert!(
            got == want && drafter == "assistant" && drafts > 5,
            "centroid head {centroids}: {got:?} vs mlx-lm {want:?}; {json:?}"
        );
    }
}

/// Runs the target on `prompt` from empty caches with the drafter's tap and hands the drafter
/// the tapped rows; returns the caches.
fn forward_tapped(
    model: &mut dyn LanguageModel,
    source: &mut AssistantSource,
    prompt: &[u32],
) -> mlxb::engine::models::Caches {
    let mut caches = model.make_caches();
    let ids: Vec<i32> = prompt.iter().map(|&t| t as i32).collect();
    let x = mlx_rs::Array::from_slice(&ids, &[1, ids.len() as i32]);
    let opts = ForwardOpts {
        exit_after: None,
        taps: source.tap_layers(),
    };
    let out = model.forward_ext(&x, &mut caches, &opts).unwrap();
    let state: Vec<_> = caches.iter().flat_map(|c| c.state()).collect();
    mlx_rs::transforms::eval(&state).unwrap();
    source.observe_taps(0, out.taps).unwrap();
    caches
}

/// Prefills the target on `prompt` with the drafter's tap and hands the rows over.
fn prefill(
    session: &mut Session,
    source: &mut AssistantSource,
    prompt: &[u32],
) -> mlxb::engine::models::Caches {
    let model = session.model.model.as_mut();
    let caches = forward_tapped(&mut *model, source, prompt);
    source
        .begin(
            TargetView {
                model,
                caches: &caches,
            },
            prompt,
        )
        .unwrap();
    caches
}

fn cache_bits(caches: &mlxb::engine::models::Caches) -> Vec<(i32, Vec<Vec<u64>>)> {
    caches
        .iter()
        .map(|c| {
            let arrays = c
                .state()
                .iter()
                .map(|a| common::bits(&a.contiguous().unwrap()))
                .collect();
            (c.offset(), arrays)
        })
        .collect()
}

#[test]
fn one_round_matches_the_numpy_reference_and_leaves_the_target_cache_untouched() {
    let dir = target_with(&target_config());
    let prompt = prompt();
    let (anchor, steps) = (17u32, 4usize);
    for centroids in [false, true] {
        let asst = assistant(&assistant_config(centroids), 2, &[]);
        let mut session = Session::open(dir.path(), Forks::default()).unwrap();
        let mut source = AssistantSource::open(asst.path(), dir.path(), Forks::default()).unwrap();
        let caches = prefill(&mut session, &mut source, &prompt);
        let before = cache_bits(&caches);
        let mut seq = prompt.clone();
        seq.push(anchor);
        let model = session.model.model.as_mut();
        let (tokens, logits) = source
            .draft_logits(
                TargetView {
                    model: &mut *model,
                    caches: &caches,
                },
                &seq,
                steps,
            )
            .unwrap();
        let draft = source
            .draft(
                TargetView {
                    model,
                    caches: &caches,
                },
                &seq,
                steps,
            )
            .unwrap();
        assert_eq!(draft.tokens, tokens);
        assert_eq!(
            cache_bits(&caches),
            before,
            "drafting changed the target's caches"
        );

        let work = tempfile::tempdir().unwrap();
        let req = work.path().join("req.json");
        let out = work.path().join("out.safetensors");
        let r = json!({"target": dir.path(), "assistant": asst.path(), "prompt_ids": prompt,
            "anchor": anchor, "steps": steps});
        std::fs::write(&req, r.to_string()).unwrap();
        common::run_python(
            &common::root().join("tests/oracle/gemma4_assistant.py"),
            &["step", req.to_str().unwrap(), out.to_str().unwrap()],
        );
        let reference = mlx_rs::Array::load_safetensors(&out).unwrap();
        let want: Vec<u32> = reference["tokens"]
            .as_slice::<i32>()
            .iter()
            .map(|&t| t as u32)
            .collect();
        assert_eq!(
            tokens, want,
            "centroid head {centroids}: drafted tokens differ from the reference"
        );
        // Tolerance: f32 MLX vs float64 numpy through 4 layers: 1e-4 of the largest logit (seen: ~3e-7).
        let got = logits
            .as_dtype(mlx_rs::Dtype::Float32)
            .unwrap()
            .contiguous()
            .unwrap();
        got.eval().unwrap();
        let (g, w) = (got.as_slice::<f32>(), reference["logits"].as_slice::<f32>());
        assert_eq!(g.len(), w.len());
        let scale = w.iter().fold(1f32, |m, x| m.max(x.abs()));
        let worst = g
            .iter()
            .zip(w)
            .map(|(a, b)| (a - b).abs())
            .fold(0f32, f32::max);
        assert!(
            worst <= 1e-4 * scale,
            "centroid head {centroids}: logits differ by {worst} (scale {scale})"
        );
    }
}

/// The assistant's `n` drafted tokens and logits after `sequence` over a single stream: the
/// target prefilled afresh on all of `sequence` but its anchor.
fn single_stream_draft(
    model: &mut dyn LanguageModel,
    source: &mut AssistantSource,
    sequence: &[u32],
    n: usize,
) -> (Vec<u32>, mlx_rs::Array) {
    let caches = forward_tapped(&mut *model, source, &sequence[..sequence.len() - 1]);
    let view = TargetView {
        model,
        caches: &caches,
    };
    source.draft_logits(view, sequence, n).unwrap()
}

/// Drafting per slot: three prompts of different lengths decode together past the window
/// (the batch verifies the assistant's drafts, the right continuation or that spoiled at its
/// end, so rows keep different numbers of drafts: full layers hide positions and the batch
/// restores and replays); at every proposal each row's
/// assistant, reading the keys and values the batch lends that row, drafts the tokens it drafts
/// over a single stream of the same tokens (logits within 1e-4 of the largest), and each row's
/// ids equal its greedy ids alone.
#[test]
fn batched_rows_draft_as_a_single_stream() {
    let dir = target_with(&target_config());
    let asst = assistant(&assistant_config(false), 3, &[]);
    let mut session = Session::open(dir.path(), Forks::default()).unwrap();
    let open = || AssistantSource::open(asst.path(), dir.path(), Forks::default()).unwrap();
    let prompts = [
        prompt(),
        common::prompt_ids(13, VOCAB, 6),
        common::prompt_ids(27, VOCAB, 7),
    ];
    let (budget, k) = (24, 3);
    let model = session.model.model.as_mut();
    let want: Vec<Vec<i32>> = prompts
        .iter()
        .map(|p| common::greedy_ids(&mut *model, p, None, 0, budget).0)
        .collect();
    let template = open();
    let settings = BatchSettings {
        prefill_batch_size: 2,
        completion_batch_size: 4,
        prefill_step_size: 8,
    };
    let mut gen = BatchGenerator::new(
        &*model,
        &session.model.plan,
        Sampler::new(&SamplerConfig::default()).unwrap(),
        vec![],
        settings,
    )
    .unwrap()
    .speculative(&*model)
    .unwrap()
    .tapping(template.tap_layers())
    .lending_kv(template.kv_layers());
    let requests = prompts
        .iter()
        .map(|p| SequenceRequest::new(p.clone(), budget))
        .collect();
    let uids = gen.insert(requests).unwrap();
    let row_of: HashMap<usize, usize> = uids.iter().enumerate().map(|(i, &u)| (u, i)).collect();
    let mut slots: Vec<AssistantSource> = prompts.iter().map(|_| open()).collect();
    let mut reference = open();
    let mut got: Vec<Vec<u32>> = vec![Vec::new(); prompts.len()];
    let (mut compared, mut uneven) = (0, 0);
    for step in 0.. {
        let mut propose = |rows: &[DecodingRow], m: &mut dyn LanguageModel| {
            let mut drafts = HashMap::new();
            for r in rows {
                let i = row_of[&r.uid];
                for t in &r.tapped {
                    slots[i].observe_taps(t.first_position, t.layers.clone())?;
                }
                let mut sequence: Vec<u32> = prompts[i].iter().chain(&got[i]).copied().collect();
                match (r.next_pending, r.next) {
                    (true, Some(next)) => sequence.push(next),
                    // Unread: a placeholder asks for the proposal again once it is read.
                    (true, None) => {
                        drafts.insert(r.uid, vec![0; k + 1]);
                        continue;
                    }
                    (false, _) => {}
                }
                let n = k.min(r.room.saturating_sub(1 + usize::from(r.next.is_some())));
                if n == 0 {
                    continue;
                }
                let caches = row_caches(r, sequence.len() - 1);
                let view = TargetView {
                    model: &mut *m,
                    caches: &caches,
                };
                let (tokens, logits) = slots[i].draft_logits(view, &sequence, n)?;
                let (want_tokens, want_logits) =
                    single_stream_draft(&mut *m, &mut reference, &sequence, n);
                assert_eq!(tokens, want_tokens, "row {i} at {}", sequence.len());
                let scale = want_logits.abs()?.max(None)?.item_exact::<f32>().max(1.0);
                let worst = logits
                    .subtract(&want_logits)?
                    .abs()?
                    .max(None)?
                    .item_exact::<f32>();
                assert!(worst <= 1e-4 * scale, "row {i}: logits off by {worst}");
                compared += 1;
                // What the batch verifies: the assistant's drafts, the right continuation, or
                // that with its last token spoiled, in turns that differ by row.
                let right = || {
                    let from = sequence.len() - prompts[i].len();
                    want[i].iter().skip(from).take(n).map(|&t| t as u32)
                };
                let proposal: Vec<u32> = match (step + i) % 3 {
                    0 => tokens,
                    1 => right().collect(),
                    _ => {
                        let mut d: Vec<u32> = right().collect();
                        if let Some(last) = d.last_mut() {
                            *last = 3 + (*last + 1) % (VOCAB - 3);
                        }
                        d
                    }
                };
                drafts.insert(r.uid, r.next.into_iter().chain(proposal).collect());
            }
            Ok(drafts)
        };
        let tokens = gen.next_tokens_drafted(&mut *model, &mut propose).unwrap();
        if tokens.is_empty() {
            break;
        }
        for t in tokens {
            got[row_of[&t.uid]].push(t.token);
        }
        let kept: Vec<usize> = gen.take_verified().iter().map(|v| v.accepted).collect();
        if kept.iter().any(|&a| a != kept[0]) {
            uneven += 1;
        }
    }
    assert!(
        compared > 20 && uneven > 2,
        "{compared} proposals, {uneven} uneven steps"
    );
    for (i, (got, want)) in got.iter().zip(&want).enumerate() {
        let got: Vec<i32> = got.iter().map(|&t| t as i32).collect();
        assert_eq!(&got, want, "row {i}: ids differ from the prompt alone");
    }
}

/// Served: six concurrent greedy requests to `serve --max-batch 6` with the assistant, each
/// drafting for itself in the batch, answer exactly as the same prompts asked one at a time of
/// a server without a drafter.
#[test]
fn served_in_a_batch_answers_as_alone() {
    let dir = target_with(&target_config());
    let asst = assistant(&assistant_config(true), 4, &[]);
    let target = dir.path().to_str().unwrap();
    let prompts: Vec<String> = (0..6)
        .map(|i| format!("Round {i}: {}", serve_harness::PROMPT))
        .collect();
    let plain = serve_harness::Server::start_model(target, &[], &["--max-batch", "1"]);
    let expected = serve_harness::answers_alone(&plain, &prompts, 40);
    drop(plain);
    let drafter = [
        "--draft-model",
        asst.path().to_str().unwrap(),
        "--num-draft-tokens",
        "3",
    ];
    let rounds =
        serve_harness::concurrent_drafted_answers(target, &drafter, "all", &prompts, &expected);
    assert!(rounds > 0, "no request drafted");
}

/// A change to an assistant's config.json.
type ConfigEdit = Box<dyn Fn(&mut Value)>;

#[test]
fn malformed_checkpoints_are_refused_with_exit_2() {
    let dir = target_with(&target_config());
    let all_sliding = {
        let mut c = target_config();
        c["layer_types"] = json!(vec!["sliding_attention"; 6]);
        target_with(&c)
    };
    let cases: Vec<(&str, ConfigEdit, &Path, &str)> = vec![
        (
            "wrong backbone",
            Box::new(|c| c["backbone_hidden_size"] = json!(128)),
            dir.path(),
            "backbone_hidden_size",
        ),
        (
            "untied head",
            Box::new(|c| c["tie_word_embeddings"] = json!(false)),
            dir.path(),
            "tie_word_embeddings",
        ),
        (
            "wrong vocab",
            Box::new(|c| c["text_config"]["vocab_size"] = json!(512)),
            dir.path(),
            "vocab_size",
        ),
        (
            "kv heads",
            Box::new(|c| c["text_config"]["num_key_value_heads"] = json!(1)),
            dir.path(),
            "KV heads",
        ),
        (
            "missing donor type",
            Box::new(|_| {}),
            all_sliding.path(),
            "full_attention",
        ),
    ];
    for (what, edit, target, expect) in cases {
        let asst = assistant(&assistant_config(false), 3, &[]);
        common::edit_config(asst.path(), |c| edit(c));
        let draft = ["--draft-kind", "assistant", "--draft-model"];
        let mut extra = draft.to_vec();
        extra.push(asst.path().to_str().unwrap());
        let (code, _, stderr) = generate(target, &extra);
        common::assert_refused(what, code, &stderr, &[expect]);
    }
}

#[test]
fn detection_and_draft_length_from_generation_config() {
    let dir = target_with(&target_config());
    let asst = assistant(&assistant_config(true), 4, &["--num-assistant-tokens", "5"]);
    assert!(config::is_artifact(asst.path()));
    assert!(!config::is_artifact(dir.path()));
    assert_eq!(config::draft_tokens(None, asst.path()), 5);
    assert_eq!(config::draft_tokens(Some(2), asst.path()), 2);
    assert_eq!(
        config::draft_tokens(None, dir.path()),
        config::DEFAULT_DRAFT_TOKENS
    );
    // Detected from --draft-model without --draft-kind; the CLI serves it losslessly.
    let (code, stdout, stderr) = generate(
        dir.path(),
        &["--draft-model", asst.path().to_str().unwrap()],
    );
    assert_eq!(code, 0, "{stderr}");
    let (code2, stdout2, stderr2) = generate(dir.path(), &[]);
    assert_eq!(code2, 0, "{stderr2}");
    let body = |s: &str| {
        s.lines()
            .filter(|l| {
                !l.starts_with("==") && !l.contains("tokens-per-sec") && !l.contains("Peak")
            })
            .collect::<Vec<_>>()
            .join("\n")
    };
    assert_eq!(
        body(&stdout),
        body(&stdout2),
        "speculative output differs:\n{stdout}\n---\n{stderr}"
    );
}
