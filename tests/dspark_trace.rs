//! DSpark fidelity and speculative traces (`generate --spec-trace`):
//!
//! - every round of `mlxb generate` with a DeepSpec-format drafter (float32 and bf16) on a
//!   Hugging Face-layout target (qwen3 `model.*` names, tied embeddings) equals an independent
//!   numpy re-computation of DeepSpec's loop (tests/oracle/dspark_loop_ref.py): anchors,
//!   proposals, accepted counts and next tokens exactly, confidences within 1e-5, for every
//!   pruning mode;
//! - each pruning mode follows its rule on the recorded confidences;
//! - the trace schema round-trips; writing a trace changes no output; runs are deterministic;
//!   every drafter writes a trace; `--prompt-ids` feeds ids as given.

mod common;

use mlx_rs::Array;
use mlxb::spec::trace::{self, JsonlTrace, RoundTrace, TraceSink};
use serde_json::{json, Value};
use std::path::Path;

const GEN: usize = 48;
const VOCAB: u32 = 384;
const TAPS: [usize; 2] = [0, 2];

/// A tiny qwen3 target saved as a Hugging Face checkpoint would be: `model.*` tensor names,
/// tied embeddings (no `lm_head.weight`), HF's config fields.
fn hf_qwen3_target() -> tempfile::TempDir {
    let dir = tempfile::tempdir().unwrap();
    let config = common::tiny_qwen3(json!({"tie_word_embeddings": true}));
    assert_eq!(config["vocab_size"], VOCAB);
    common::make_model(dir.path(), &config, "f32", None);
    common::edit_config(dir.path(), |c| {
        let extra = json!({
            "architectures": ["Qwen3ForCausalLM"], "torch_dtype": "float32", "rope_scaling": null,
            "attention_bias": false, "attention_dropout": 0.0, "hidden_act": "silu",
            "use_sliding_window": false, "sliding_window": null, "max_window_layers": 4,
            "bos_token_id": 1, "transformers_version": "4.51.0", "use_cache": true
        });
        *c = common::with(c.take(), extra);
    });
    let names = Array::load_safetensors(dir.path().join("model.safetensors")).unwrap();
    assert!(names.contains_key("model.embed_tokens.weight"));
    assert!(
        !names.contains_key("lm_head.weight"),
        "the head must be tied"
    );
    dir
}

fn prompt() -> Vec<u32> {
    common::prompt_ids(12, VOCAB, 3)
}

fn ref_script() -> std::path::PathBuf {
    common::root().join("tests/oracle/dspark_loop_ref.py")
}

/// A random DeepSpec-format drafter (written by the reference script, not by mlxb) in `dtype`,
/// its Markov table fitted to the target's greedy bigrams so that some drafts are accepted.
fn deepspec_drafter(target: &Path, dtype: &str) -> tempfile::TempDir {
    let out = tempfile::tempdir().unwrap();
    let spec = json!({
        "layers": 2, "block_size": 5, "markov_rank": 32, "target_layer_ids": TAPS,
        "mask_token_id": VOCAB - 1, "seed": 11,
        "fit": {"prompt_ids": prompt(), "max_tokens": GEN}
    });
    common::run_python(
        &ref_script(),
        &[
            "make",
            target.to_str().unwrap(),
            out.path().to_str().unwrap(),
            dtype,
            &spec.to_string(),
        ],
    );
    out
}

/// Runs `mlxb generate --json` with `args`; returns its JSON and, with a trace file, the trace.
fn generate(target: &Path, args: &[&str], trace: Option<&Path>) -> (Value, Vec<RoundTrace>) {
    let prompt = common::ids_arg(&prompt());
    let max = GEN.to_string();
    let mut all = vec![
        "generate",
        "--model",
        target.to_str().unwrap(),
        "--prompt-ids",
        &prompt,
        "--max-tokens",
        &max,
        "--json",
    ];
    all.extend_from_slice(args);
    if let Some(t) = trace {
        all.extend(["--spec-trace", t.to_str().unwrap()]);
    }
    let (code, stdout, stderr) = common::run_mlxb(&all);
    assert_eq!(code, 0, "mlxb {all:?}: {stderr}");
    let v: Value = serde_json::from_str(stdout.trim()).unwrap();
    let rounds = trace.map(|t| trace::read(t).unwrap()).unwrap_or_default();
    (v, rounds)
}

/// The kept length each pruning mode's rule gives for `conf` against `t`.
fn rule(mode: &str, conf: &[f64], t: f64) -> usize {
    let mut product = 1.0;
    for (k, c) in conf.iter().enumerate() {
        product *= c;
        let (first, score) = match mode {
            "keep-first" => (1, *c),
            "deepspec" => (0, *c),
            _ => (0, product),
        };
        if k >= first && score < t {
            return k;
        }
    }
    conf.len()
}

fn assert_same_rounds(mine: &[RoundTrace], theirs: &[RoundTrace], what: &str) {
    assert_eq!(
        mine.len(),
        theirs.len(),
        "{what}: round counts differ\nmlxb: {mine:?}\nreference: {theirs:?}"
    );
    for (a, b) in mine.iter().zip(theirs) {
        let strip = |r: &RoundTrace| RoundTrace {
            confidence: None,
            block_confidence: None,
            ..r.clone()
        };
        assert_eq!(strip(a), strip(b), "{what}: round {} differs", a.round);
        for (x, y) in [
            (&a.confidence, &b.confidence),
            (&a.block_confidence, &b.block_confidence),
        ] {
            let (x, y) = (x.clone().unwrap_or_default(), y.clone().unwrap_or_default());
            assert_eq!(x.len(), y.len(), "{what}: round {}", a.round);
            for (p, q) in x.iter().zip(&y) {
                assert!(
                    (p - q).abs() <= 1e-5,
                    "{what}: round {} confidence {p} vs reference {q}",
                    a.round
                );
            }
        }
    }
}

/// mlxb's rounds equal the independent reference's, round for round, for float32 and bf16
/// DeepSpec checkpoints on an HF-layout target, for thresholds 0 and 0.5 under DeepSpec's rule
/// and 0.5 under the other two; each mode's proposals follow its rule.
#[test]
fn rounds_match_the_independent_reference() {
    let target = hf_qwen3_target();
    let runs = [
        ("deepspec", 0.0),
        ("deepspec", 0.5),
        ("keep-first", 0.5),
        ("survival", 0.5),
    ];
    for dtype in ["f32", "bf16"] {
        let ck = deepspec_drafter(target.path(), dtype);
        let tmp = tempfile::tempdir().unwrap();
        let req = tmp.path().join("req.json");
        let runs_json: Vec<Value> = runs
            .iter()
            .map(|(m, t)| json!({"prune": m, "threshold": t}))
            .collect();
        std::fs::write(
            &req,
            json!({
                "target": target.path(), "drafter": ck.path(), "prompt_ids": prompt(),
                "max_tokens": GEN, "eos": [2], "runs": runs_json
            })
            .to_string(),
        )
        .unwrap();
        let out = tmp.path().join("ref");
        common::run_python(
            &ref_script(),
            &["run", req.to_str().unwrap(), out.to_str().unwrap()],
        );
        let (mut accepted, mut empty, mut pruned) = (0, 0, 0);
        for (i, (mode, t)) in runs.iter().enumerate() {
            let what = format!("{dtype} {mode} {t}");
            let file = tmp.path().join(format!("mlxb{i}.jsonl"));
            let thr = t.to_string();
            let args = [
                "--drafter",
                ck.path().to_str().unwrap(),
                "--dspark-prune",
                mode,
                "--dspark-min-conf",
                &thr,
            ];
            let (v, mine) = generate(target.path(), &args, Some(&file));
            let theirs = trace::read(&out.join(format!("run{i}.jsonl"))).unwrap();
            assert_same_rounds(&mine, &theirs, &what);
            assert_eq!(v["speculative"]["drafter"], "dspark");
            // Tokens emitted before each round: the block is capped at one less than the rest.
            let mut emitted = 1;
            for r in &mine {
                let block = r.block_confidence.clone().unwrap_or_default();
                let cap = GEN - emitted - 1;
                // No draft at all when one token is left to emit.
                let drafted = (cap > 0).then_some(*mode);
                assert_eq!(r.prune.as_deref(), drafted, "{what}: {r:?}");
                assert_eq!(r.threshold, drafted.map(|_| *t), "{what}: {r:?}");
                assert_eq!(
                    r.proposed.len(),
                    rule(mode, &block, *t).min(cap),
                    "{what}: {r:?}"
                );
                emitted += r.accepted + r.next.is_some() as usize;
                if *mode == "keep-first" && !block.is_empty() {
                    assert!(!r.proposed.is_empty(), "{what}: position 0 must survive");
                }
                accepted += r.accepted;
                empty += (r.proposed.is_empty() && !block.is_empty()) as usize;
                pruned += (r.proposed.len() < block.len()) as usize;
            }
            // The trace accounts for every generated token.
            let tokens: usize = mine
                .iter()
                .map(|r| r.accepted + r.next.is_some() as usize)
                .sum();
            assert_eq!(
                tokens + 1,
                v["token_ids"].as_array().unwrap().len(),
                "{what}"
            );
        }
        eprintln!("{dtype}: accepted {accepted}, zero-length rounds {empty}, pruned {pruned}");
        assert!(accepted > 0, "{dtype}: no draft was ever accepted");
        assert!(
            empty > 0,
            "{dtype}: deepspec at 0.5 never proposed zero tokens"
        );
        assert!(pruned > 0, "{dtype}: threshold 0.5 never pruned");
    }
}

/// Writing a trace changes nothing generated, traces are identical across runs, and every
/// drafter (dspark, ngram, self) writes one consistent object per round.
#[test]
fn tracing_changes_no_output_and_is_deterministic_for_every_drafter() {
    let target = hf_qwen3_target();
    let ck = deepspec_drafter(target.path(), "f32");
    let ckp = ck.path().to_str().unwrap();
    let providers: [(&str, Vec<&str>); 4] = [
        ("dspark", vec!["--drafter", ckp]),
        (
            "dspark",
            vec![
                "--drafter",
                ckp,
                "--dspark-min-conf",
                "0.5",
                "--dspark-prune",
                "deepspec",
            ],
        ),
        ("ngram", vec!["--draft-kind", "ngram"]),
        ("self", vec!["--draft-layers", "2"]),
    ];
    let tmp = tempfile::tempdir().unwrap();
    let (plain, _) = generate(target.path(), &[], None);
    for (i, (name, args)) in providers.iter().enumerate() {
        // A traced stream drafts every round (`--draft-policy` defaults to `all` there), so
        // the untraced run it is compared with is asked for the same.
        let every_round = [args.as_slice(), &["--draft-policy", "all"]].concat();
        let (without, _) = generate(target.path(), &every_round, None);
        let a = tmp.path().join(format!("{i}a.jsonl"));
        let b = tmp.path().join(format!("{i}b.jsonl"));
        let (with, rounds) = generate(target.path(), args, Some(&a));
        let (again, rounds_again) = generate(target.path(), args, Some(&b));
        assert_eq!(without["token_ids"], plain["token_ids"], "{name} is lossy");
        assert_eq!(
            with["token_ids"], without["token_ids"],
            "{name}: trace changed output"
        );
        assert_eq!(
            common::spec_counters(&with["speculative"]),
            common::spec_counters(&without["speculative"]),
            "{name}"
        );
        assert_eq!(again["token_ids"], with["token_ids"], "{name}");
        assert_eq!(rounds, rounds_again, "{name}: rounds differ across runs");
        assert_eq!(
            std::fs::read(&a).unwrap(),
            std::fs::read(&b).unwrap(),
            "{name}: trace files differ across runs"
        );
        let m = &with["speculative"];
        assert_eq!(m["drafter"], *name);
        assert_eq!(rounds.len() as u64, m["target_forwards"].as_u64().unwrap());
        let prompt_len = prompt().len();
        let mut pos = prompt_len;
        for (k, r) in rounds.iter().enumerate() {
            assert_eq!(
                (r.prompt, r.round, r.anchor_pos),
                (0, k, pos),
                "{name}: {r:?}"
            );
            assert!(r.accepted <= r.proposed.len());
            if *name != "dspark" {
                assert!(r.confidence.is_none() && r.prune.is_none(), "{name}: {r:?}");
            } else if k + 1 < rounds.len() {
                assert!(r.confidence.is_some() && r.prune.is_some(), "{r:?}");
            }
            pos += r.accepted + 1;
        }
        let ids: Vec<u64> = with["token_ids"]
            .as_array()
            .unwrap()
            .iter()
            .map(|v| v.as_u64().unwrap())
            .collect();
        // Anchors are the generated tokens at their positions; `next` is the token after the
        // accepted ones.
        for r in &rounds {
            let at = |p: usize| ids[p - prompt_len];
            assert_eq!(u64::from(r.anchor), at(r.anchor_pos), "{name}: {r:?}");
            if let Some(n) = r.next {
                assert_eq!(u64::from(n), at(r.anchor_pos + r.accepted + 1), "{name}");
            }
        }
    }
}

/// The JSON schema: the field names, a DSpark round with every field and another
/// drafter's round without confidences, written by the sink and read back unchanged.
#[test]
fn trace_schema_round_trips() {
    let dspark = RoundTrace {
        prompt: 0,
        round: 3,
        anchor_pos: 17,
        anchor: 42,
        proposed: vec![5, 6],
        confidence: Some(vec![0.75, 0.5]),
        block_confidence: Some(vec![0.75, 0.5, 0.25]),
        threshold: Some(0.4),
        thresholds: None,
        prune: Some("survival".into()),
        accepted: 1,
        next: Some(9),
    };
    let ngram = RoundTrace {
        round: 4,
        anchor_pos: 19,
        anchor: 9,
        next: None,
        ..RoundTrace::default()
    };
    let v = serde_json::to_value(&dspark).unwrap();
    for key in [
        "prompt",
        "round",
        "anchor_pos",
        "anchor",
        "proposed",
        "confidence",
        "threshold",
        "accepted",
        "next",
        "prune",
    ] {
        assert!(v.get(key).is_some(), "missing `{key}` in {v}");
    }
    let v = serde_json::to_value(&ngram).unwrap();
    assert!(v.get("confidence").is_none() && v["threshold"].is_null() && v["next"].is_null());
    let tmp = tempfile::tempdir().unwrap();
    let path = tmp.path().join("t.jsonl");
    let mut sink = JsonlTrace::create(&path).unwrap();
    sink.set_prompt(2);
    sink.record(&dspark).unwrap();
    sink.record(&ngram).unwrap();
    sink.flush().unwrap();
    let back = trace::read(&path).unwrap();
    assert_eq!(
        back,
        vec![
            RoundTrace {
                prompt: 2,
                ..dspark
            },
            RoundTrace { prompt: 2, ..ngram }
        ]
    );
    let text = std::fs::read_to_string(&path).unwrap();
    assert_eq!(text.lines().count(), 2);
    std::fs::write(&path, "{\"round\": 1}\n").unwrap();
    let err = trace::read(&path).unwrap_err().to_string();
    assert!(err.contains("line 1"), "{err}");
}

/// `--prompt-ids` feeds the ids as given (what `--prompt` tokenizes to gives the same output);
/// an id outside the vocabulary is refused in one line with exit code 2.
#[test]
fn prompt_ids_are_fed_as_given() {
    let target = hf_qwen3_target();
    let t = target.path().to_str().unwrap();
    let base = [
        "generate",
        "--model",
        t,
        "--max-tokens",
        "8",
        "--json",
        "--ignore-chat-template",
    ];
    let mut by_text = base.to_vec();
    by_text.extend(["--prompt", "The quick brown fox"]);
    let (code, out, err) = common::run_mlxb(&by_text);
    assert_eq!(code, 0, "{err}");
    let text: Value = serde_json::from_str(out.trim()).unwrap();
    let ids = common::json_ids(&text["prompt_token_ids"]);
    let joined = common::ids_arg(&ids);
    let mut by_ids = base.to_vec();
    by_ids.extend(["--prompt-ids", &joined]);
    let (code, out, err) = common::run_mlxb(&by_ids);
    assert_eq!(code, 0, "{err}");
    let v: Value = serde_json::from_str(out.trim()).unwrap();
    assert_eq!(v["prompt_token_ids"], text["prompt_token_ids"]);
    assert_eq!(v["token_ids"], text["token_ids"]);
    let mut bad = base.to_vec();
    bad.extend(["--prompt-ids", "1,384"]);
    let (code, _, err) = common::run_mlxb(&bad);
    common::assert_refused("a prompt id past the vocabulary", code, &err, &["384"]);
    // A trace without a drafter is refused rather than left empty.
    let mut untraced = by_ids.clone();
    untraced.extend(["--spec-trace", "/dev/null"]);
    let (code, _, err) = common::run_mlxb(&untraced);
    assert_eq!(code, 2, "{err}");
    assert!(err.contains("give a drafter"), "{err}");
}
