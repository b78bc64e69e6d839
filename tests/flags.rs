//! The fork table and its invariants: tiers are pure aliases over the per-fork flags; under
//! `--l1` every L1-valid fork keeps bit-parity with mlx-lm (run with the same KV settings);
//! output-changing forks report a KL divergence > 0 to L1 and L1-valid ones exactly 0;
//! speculative decoding stays lossless over quantized KV caches; bad input is exit code 2.

mod common;

use clap::{Args, FromArgMatches};
use mlx_rs::ops::indexing::IndexOp;
use mlx_rs::Array;
use mlxb::cmd::flags::ForkArgs;
use mlxb::engine::forks::{self, Domain, Forks, KvQuant, Tier, FORKS};
use mlxb::engine::generate::{Flow, GenerateConfig, Generator};
use mlxb::engine::models::{self, LoadedModel};
use mlxb::engine::sample::{LogitsProcessors, ProcessorConfig, Sampler, SamplerConfig};
use mlxb::engine::session::Session;
use mlxb::oracle::divergence::kl_to_l1;
use mlxb::spec::executor::Speculation;
use mlxb::spec::factory::{open_source, DraftKind, SpecOptions};
use mlxb::spec::source::VerifyMode;
use serde_json::{json, Value};
use std::path::Path;

const PROMPT_LEN: usize = 40;
const STEPS: usize = 24;

/// Parses fork flags exactly as the subcommands do (`#[command(flatten)] ForkArgs`).
fn parse(args: &[&str]) -> Result<ForkArgs, clap::Error> {
    let cmd = ForkArgs::augment_args(clap::Command::new("t").no_binary_name(true));
    let m = cmd.try_get_matches_from(args)?;
    ForkArgs::from_arg_matches(&m)
}

fn resolve(args: &[&str]) -> Forks {
    parse(args).unwrap().resolve().unwrap().forks
}

/// The explicit flags a tier expands to, from the table.
fn expanded(tier: Tier) -> Vec<String> {
    FORKS
        .iter()
        .flat_map(|f| [format!("--{}", f.name), f.default_in(tier).to_owned()])
        .collect()
}

/// An alternative valid value for a fork (to prove each row drives its own field).
fn other_value(f: &forks::Fork, current: &str) -> String {
    match &f.domain {
        Domain::Choices(c) => c
            .iter()
            .map(|c| c.value)
            .find(|v| *v != current)
            .unwrap()
            .to_owned(),
        Domain::Count => (current.parse::<u64>().unwrap() + 7).to_string(),
    }
}

#[test]
fn table_is_the_single_source_of_truth() {
    let mut names: Vec<&str> = FORKS.iter().map(|f| f.name).collect();
    names.sort();
    names.dedup();
    assert_eq!(names.len(), FORKS.len(), "duplicate fork names");
    for tier in Tier::ALL {
        // A preset sets every fork, and only forks: its typed value is exactly the table's
        // column for that tier.
        let forks = Forks::tier(tier);
        let values = forks.to_values();
        let column: Vec<String> = FORKS
            .iter()
            .map(|f| f.default_in(tier).to_owned())
            .collect();
        assert_eq!(values, column, "{tier} preset differs from the table");
        for f in FORKS {
            f.check(f.default_in(tier))
                .unwrap_or_else(|e| panic!("{tier} default of --{}: {e}", f.name));
        }
        // Each row drives its own field: changing one value changes the typed value.
        for (i, f) in FORKS.iter().enumerate() {
            let mut v = values.clone();
            v[i] = other_value(f, &v[i]);
            let strs: Vec<&str> = v.iter().map(String::as_str).collect();
            let changed = Forks::from_values(&strs).unwrap();
            assert_ne!(changed, forks, "--{} maps to no field", f.name);
            assert_eq!(changed.to_values(), v, "--{} does not round-trip", f.name);
        }
    }
    // The CLI has one flag per row plus the three tier aliases, and nothing else.
    let cmd = ForkArgs::augment_args(clap::Command::new("t"));
    let mut ids: Vec<String> = cmd
        .get_arguments()
        .map(|a| a.get_id().to_string())
        .collect();
    ids.sort();
    let mut want: Vec<String> = FORKS.iter().map(|f| f.name.to_owned()).collect();
    // Besides the forks and tiers, only the file that `--kv-quant config` reads.
    want.extend(["l1", "l2", "l3", "kv-config"].map(String::from));
    want.sort();
    assert_eq!(ids, want);
    // The README table lists every fork.
    let md = forks::markdown_table();
    for f in FORKS {
        assert!(
            md.contains(&format!("`--{}`", f.name)),
            "{} missing",
            f.name
        );
    }
}

/// Every fork table in the docs is `mlxb flags --markdown` to the byte; README.md has one.
#[test]
fn documented_fork_tables_are_the_generated_one() {
    const BEGIN: &str = "<!-- fork-table:begin";
    const END: &str = "<!-- fork-table:end -->";
    let want = forks::markdown_table();
    let mut docs = vec![common::root().join("README.md")];
    if let Ok(dir) = std::fs::read_dir(common::root().join("docs")) {
        docs.extend(
            dir.map(|e| e.unwrap().path())
                .filter(|p| p.extension().is_some_and(|x| x == "md")),
        );
    }
    let mut in_readme = 0;
    for doc in docs {
        let text = std::fs::read_to_string(&doc).unwrap();
        let mut rest = text.as_str();
        while let Some(at) = rest.find(BEGIN) {
            let body = &rest[at..];
            let start = body.find('\n').unwrap() + 1;
            let end = body
                .find(END)
                .unwrap_or_else(|| panic!("{}: a fork table has no end marker", doc.display()));
            assert_eq!(
                body[start..end].trim(),
                want.trim(),
                "{}: the fork table is not `mlxb flags --markdown`; paste that in",
                doc.display()
            );
            if doc.ends_with("README.md") {
                in_readme += 1;
            }
            rest = &body[end..];
        }
    }
    assert_eq!(in_readme, 1, "README.md must show the fork table once");
}

#[test]
fn tiers_are_pure_aliases_and_flags_override() {
    for tier in Tier::ALL {
        let alias = format!("--{}", tier.flag());
        let exp = expanded(tier);
        let exp: Vec<&str> = exp.iter().map(String::as_str).collect();
        assert_eq!(resolve(&[&alias]), resolve(&exp), "{tier}");
        assert_eq!(resolve(&[&alias]), Forks::tier(tier));
    }
    assert_eq!(resolve(&[]), Forks::tier(Tier::L1), "no tier means --l1");
    let f = resolve(&["--l2", "--kv-quant", "8", "--compiled-decode", "on"]);
    assert_eq!(f.kv_quant, KvQuant::Bits(8));
    assert!(f.compiled_decode);
    assert_eq!(f.quantized_kv_start, 0, "the rest stays at the L2 default");
    let r = parse(&["--l1", "--kv-quant", "config"])
        .unwrap()
        .resolve()
        .unwrap();
    assert_eq!(r.holds(), Tier::L2);
    assert_eq!(r.leaving().len(), 1);
    assert_eq!(r.leaving()[0].fork.name, "kv-quant");
}

/// The shared tiny llama at width 128 (head dim 64) with 2 layers and an explicit rope theta,
/// plus `extra`.
fn llama(extra: Value) -> Value {
    common::with(
        common::tiny_llama(json!({
            "hidden_size": 128, "num_hidden_layers": 2, "intermediate_size": 256, "head_dim": 64,
            "rope_theta": 10000.0
        })),
        extra,
    )
}

/// Greedy steps with `forks`: ids and logprobs.
fn generate(loaded: &mut LoadedModel, prompt: &[u32], prefill: usize) -> (Vec<i32>, Vec<Array>) {
    let mut sampler = Sampler::new(&SamplerConfig::default()).unwrap();
    let mut processors = LogitsProcessors::new(&ProcessorConfig::default()).unwrap();
    let plan = loaded.plan.clone();
    let cfg = GenerateConfig {
        max_tokens: STEPS,
        prefill_step_size: prefill,
    };
    let (mut ids, mut lps) = (vec![], vec![]);
    Generator::new(loaded.model.as_mut(), &mut sampler, &mut processors)
        .with_plan(&plan)
        .run(prompt, &cfg, |s| {
            ids.push(s.token as i32);
            lps.push(s.logprobs.clone());
            Ok(Flow::Continue)
        })
        .unwrap();
    (ids, lps)
}

fn assert_same(a: &(Vec<i32>, Vec<Array>), b: &(Vec<i32>, Vec<Array>), what: &str) {
    assert_eq!(a.0, b.0, "{what}: token ids differ");
    for (i, (x, y)) in a.1.iter().zip(&b.1).enumerate() {
        assert_eq!(
            common::bits(x),
            common::bits(y),
            "{what}: logprobs differ at step {i}"
        );
    }
}

/// Adds a per-layer KV config so that `--kv-quant config` (L2, L3) has layers to quantize.
fn with_kv_config(dir: &Path, bits: Value) {
    common::edit_config(dir, |c| {
        c["kv_quantization"] = json!({ "layer_bits": bits });
    });
}

#[test]
fn each_tier_equals_its_expanded_flags() {
    let dir = tempfile::tempdir().unwrap();
    common::make_model(dir.path(), &llama(json!({})), "bf16", None);
    with_kv_config(dir.path(), json!([8, 4]));
    let prompt = common::prompt_ids(PROMPT_LEN, 384, 5);
    for tier in Tier::ALL {
        let alias = format!("--{}", tier.flag());
        let exp = expanded(tier);
        let exp: Vec<&str> = exp.iter().map(String::as_str).collect();
        let mut a = models::load(dir.path(), resolve(&[&alias])).unwrap();
        let mut b = models::load(dir.path(), resolve(&exp)).unwrap();
        let ra = generate(&mut a, &prompt, 16);
        let rb = generate(&mut b, &prompt, 16);
        assert_same(&ra, &rb, &format!("{tier} vs its expansion"));
        // And through the binary: same ids from `--lN` and from the expanded flags.
        let model = dir.path().to_str().unwrap();
        let run = |extra: &[&str]| {
            let mut args = vec![
                "generate",
                "--model",
                model,
                "--prompt",
                "The quick brown fox",
                "--max-tokens",
                "12",
                "--json",
            ];
            args.extend_from_slice(extra);
            let (code, out, err) = common::run_mlxb(&args);
            assert_eq!(code, 0, "{err}");
            let v: Value = serde_json::from_str(out.trim()).unwrap();
            v["token_ids"].clone()
        };
        assert_eq!(run(&[&alias]), run(&exp), "{tier}: CLI alias vs expansion");
    }
}

/// L2's own invariant: a per-layer config with the same bits on every layer is exactly the
/// uniform L1 path (`--kv-quant N`), and all-zero bits are exactly unquantized L1.
#[test]
fn l2_config_reduces_to_uniform_bits() {
    let dir = tempfile::tempdir().unwrap();
    common::make_model(dir.path(), &llama(json!({})), "bf16", None);
    let prompt = common::prompt_ids(PROMPT_LEN, 384, 9);
    let run = |args: &[&str]| {
        let mut loaded = models::load(dir.path(), resolve(args)).unwrap();
        generate(&mut loaded, &prompt, 2048)
    };
    with_kv_config(dir.path(), json!([4, 4]));
    let config = run(&["--l2"]);
    let uniform = run(&["--kv-quant", "4", "--quantized-kv-start", "0"]);
    assert_same(&config, &uniform, "layer_bits [4, 4] vs --kv-quant 4");
    with_kv_config(dir.path(), json!([0, null]));
    let none = run(&["--l2"]);
    assert_same(&none, &run(&["--l1"]), "layer_bits [0, null] vs --l1");
    with_kv_config(dir.path(), json!([8, 4]));
    let mixed = run(&["--l2"]);
    assert_ne!(
        common::bits(&mixed.1[STEPS - 1]),
        common::bits(&uniform.1[STEPS - 1])
    );
}

/// mlx-lm's greedy trace with the given KV settings.
fn oracle(dir: &Path, prompt: &[u32], prefill: usize, forks: &Forks) -> (Vec<i32>, Array) {
    let kv_bits = match forks.kv_quant {
        KvQuant::Bits(b) => Some(b),
        _ => None,
    };
    let o = common::oracle_trace(&json!({
        "model": dir, "prompt_ids": prompt, "max_tokens": STEPS, "prefill_step_size": prefill,
        "kv_bits": kv_bits, "kv_group_size": forks.kv_group_size,
        "quantized_kv_start": forks.quantized_kv_start,
    }));
    (o["ids"].as_slice::<i32>().to_vec(), o["logprobs"].clone())
}

/// Every L1-valid fork value, alone or with kv-quant, against mlx-lm run the same way.
/// `group` is the KV group size every combination uses unless it names its own.
fn check_l1_forks(config: Value, dtype: &str, quant: Option<u32>, prefill: usize, group: &str) {
    let dir = tempfile::tempdir().unwrap();
    common::make_model(dir.path(), &config, dtype, quant);
    let prompt = common::prompt_ids(PROMPT_LEN, 384, 3);
    let combos: &[&[&str]] = &[
        &["--l1"],
        &["--l1", "--compiled-activations", "off"],
        &["--l1", "--compiled-decode", "on"],
        &["--l1", "--fused-sdpa", "off"],
        // Quantization kicks in after the prompt (start 8 < 40) ...
        &["--l1", "--kv-quant", "4", "--quantized-kv-start", "8"],
        &[
            "--l1",
            "--kv-quant",
            "8",
            "--quantized-kv-start",
            "8",
            "--compiled-decode",
            "on",
        ],
        &[
            "--l1",
            "--kv-quant",
            "8",
            "--quantized-kv-start",
            "0",
            "--kv-group-size",
            "32",
        ],
        // ... or in the middle of decoding (start 50 = prompt + 10 steps).
        &[
            "--l1",
            "--kv-quant",
            "4",
            "--quantized-kv-start",
            "50",
            "--fused-sdpa",
            "off",
        ],
    ];
    for args in combos {
        let mut args = args.to_vec();
        if !args.contains(&"--kv-group-size") {
            args.extend(["--kv-group-size", group]);
        }
        let r = parse(&args).unwrap().resolve().unwrap();
        assert_eq!(r.holds(), Tier::L1, "{args:?} should keep L1");
        let mut loaded = models::load(dir.path(), r.forks).unwrap();
        let (ids, lps) = generate(&mut loaded, &prompt, prefill);
        let (want_ids, want_lp) = oracle(dir.path(), &prompt, prefill, &r.forks);
        assert_eq!(ids, want_ids, "{args:?}: ids differ from mlx-lm");
        for (i, lp) in lps.iter().enumerate() {
            assert_eq!(
                common::bits(lp),
                common::bits(&want_lp.index(i as i32)),
                "{args:?}: logprobs differ from mlx-lm at step {i}"
            );
        }
    }
}

#[test]
fn l1_forks_keep_mlx_lm_parity_llama_bf16() {
    check_l1_forks(llama(json!({})), "bf16", None, 2048, "64");
}

#[test]
fn l1_forks_keep_mlx_lm_parity_llama_4bit_chunked() {
    check_l1_forks(llama(json!({})), "bf16", Some(4), 16, "64");
}

#[test]
fn l1_forks_keep_mlx_lm_parity_qwen3_f32() {
    let config = json!({
        "model_type": "qwen3", "hidden_size": 128, "num_hidden_layers": 2, "intermediate_size": 256,
        "num_attention_heads": 4, "num_key_value_heads": 1, "rms_norm_eps": 1e-6, "vocab_size": 384,
        "max_position_embeddings": 4096, "head_dim": 64, "tie_word_embeddings": false,
        "rope_theta": 10000.0
    });
    check_l1_forks(config, "f32", None, 2048, "64");
}

#[test]
fn kl_divergence_to_l1() {
    let dir = tempfile::tempdir().unwrap();
    common::make_model(dir.path(), &llama(json!({})), "bf16", None);
    with_kv_config(dir.path(), json!([8, 0]));
    let prompts: Vec<Vec<u32>> = (0..3).map(|s| common::prompt_ids(30, 384, s)).collect();
    let kl = |args: &[&str]| {
        let forks = resolve(args);
        kl_to_l1(dir.path(), forks, &prompts, 12, 2048).unwrap()
    };
    for args in [
        &["--compiled-decode", "on"][..],
        &["--fused-sdpa", "off"],
        &["--compiled-activations", "off"],
    ] {
        let r = kl(args);
        assert!(r.identical && r.mean_kl == 0.0, "{args:?}: {r:?}");
    }
    let q8 = ["--kv-quant", "8", "--quantized-kv-start", "0"];
    let q8_perf = [&q8[..], &["--perf-kernel", "on"]].concat();
    let mut changed = vec![];
    for args in [
        &["--kv-quant", "4", "--quantized-kv-start", "0"][..],
        &["--kv-quant", "config", "--quantized-kv-start", "0"],
        &["--l3"],
        &q8,
        &q8_perf,
    ] {
        let r = kl(args);
        assert!(!r.identical && r.mean_kl > 0.0, "{args:?}: {r:?}");
        assert!(r.mean_kl.is_finite() && r.mean_kl < 1.0, "{args:?}: {r:?}");
        changed.push(r.mean_kl);
    }
    // perf-kernel vs plain quantized attention over the same cache: the output differs.
    assert_ne!(changed[3], changed[4]);
    // --fused-decode may or may not change bits; it must run and stay close.
    let r = kl(&["--fused-decode", "on"]);
    assert!(r.mean_kl.is_finite() && r.mean_kl < 1e-2, "{r:?}");
}

/// Greedy speculative decoding over quantized KV caches (switching to quantized in the
/// middle of the generation) equals mlx-lm's greedy output with the same KV settings.
#[test]
fn speculative_decoding_with_quantized_kv_matches_mlx_lm() {
    let dir = tempfile::tempdir().unwrap();
    common::make_model(
        dir.path(),
        &llama(json!({"num_hidden_layers": 3})),
        "f32",
        None,
    );
    let kinds = [
        (DraftKind::Ngram, None, None),
        (DraftKind::SelfLayers, None, Some(1)),
        (DraftKind::Model, Some(dir.path().to_path_buf()), None),
    ];
    check_spec_quantized(dir.path(), 64, &kinds);
}

/// The same over qwen3_5's mix of recurrent and (quantized) attention caches, where rollback
/// restores snapshots and replays.
#[test]
fn speculative_decoding_with_quantized_kv_qwen3_5() {
    let dir = tempfile::tempdir().unwrap();
    common::make_model(dir.path(), &qwen3_5(), "f32", None);
    let kinds = [
        (DraftKind::Ngram, None, None),
        (DraftKind::Model, Some(dir.path().to_path_buf()), None),
    ];
    check_spec_quantized(dir.path(), 32, &kinds);
}

#[test]
fn l1_forks_keep_mlx_lm_parity_qwen3_5_mixed_caches() {
    check_l1_forks(qwen3_5(), "bf16", None, 16, "32");
}

/// The shared tiny qwen3_5 with head dim 32.
fn qwen3_5() -> Value {
    common::tiny_qwen3_5(json!({"head_dim": 32}))
}

type DraftSpec = (DraftKind, Option<std::path::PathBuf>, Option<usize>);

/// Every drafter in `kinds`, 4-bit KV quantized from the start or from the middle of the
/// generation, against mlx-lm's greedy ids with the same KV settings.
fn check_spec_quantized(dir: &Path, group: i32, kinds: &[DraftSpec]) {
    let base = common::prompt_ids(10, 384, 3);
    let prompt: Vec<u32> = base.iter().cycle().take(36).copied().collect();
    for start in [0usize, 45] {
        let (start_s, group_s) = (start.to_string(), group.to_string());
        let forks = resolve(&[
            "--kv-quant",
            "4",
            "--quantized-kv-start",
            &start_s,
            "--kv-group-size",
            &group_s,
        ]);
        let o = common::oracle_trace(&json!({
            "model": dir, "prompt_ids": prompt, "max_tokens": 40,
            "kv_bits": 4, "kv_group_size": group, "quantized_kv_start": start,
        }));
        let want: Vec<i32> = o["ids"].as_slice::<i32>().to_vec();
        let mut session = Session::open(dir, forks).unwrap();
        let plan = session.model.plan.clone();
        for (kind, draft_model, layers) in kinds.iter().cloned() {
            let opts = SpecOptions {
                num_draft_tokens: 4,
                draft_layers: layers,
                ..common::spec_options(kind, draft_model.as_deref())
            };
            let source = open_source(&opts, &session, forks, 2048).unwrap();
            let mut sampler = Sampler::new(&SamplerConfig::default()).unwrap();
            let mut processors = LogitsProcessors::new(&ProcessorConfig::default()).unwrap();
            let mut ids = vec![];
            let cfg = GenerateConfig {
                max_tokens: 40,
                prefill_step_size: 2048,
            };
            let mut spec = Speculation::new(source, 4, VerifyMode::Match);
            Generator::new(session.model.model.as_mut(), &mut sampler, &mut processors)
                .with_plan(&plan)
                .with_speculation(&mut spec)
                .run(&prompt, &cfg, |s| {
                    ids.push(s.token as i32);
                    Ok(Flow::Continue)
                })
                .unwrap();
            let m = spec.metrics;
            assert_eq!(ids, want, "{kind:?} start {start}: {:?}", m.to_json());
            assert!(m.drafts > 0, "{kind:?} drafted nothing");
        }
    }
}

fn as_str(v: &[String]) -> Vec<&str> {
    v.iter().map(String::as_str).collect()
}

fn expect_exit2(args: &[&str], needles: &[&str]) {
    let (code, _, err) = common::run_mlxb(args);
    assert_eq!(code, 2, "{args:?}: exit {code}, stderr {err}");
    assert!(!err.contains("panicked"), "{err}");
    for n in needles {
        assert!(err.contains(n), "{args:?}: {err} lacks {n:?}");
    }
}

#[test]
fn bad_fork_input_is_exit_2() {
    expect_exit2(&["flags", "--kv-quant", "3"], &["--kv-quant"]);
    expect_exit2(
        &["flags", "--compiled-decode", "maybe"],
        &["--compiled-decode"],
    );
    expect_exit2(
        &["flags", "--quantized-kv-start", "many"],
        &["--quantized-kv-start"],
    );
    expect_exit2(&["flags", "--l1", "--l3"], &["--l1", "--l3"]);
    // `--perf-kernel on` alone is valid (the host 4-bit mat-vec needs no quantized KV cache).
    let (code, out, err) = common::run_mlxb(&["flags", "--perf-kernel", "on"]);
    assert_eq!(code, 0, "{err}");
    assert!(
        out.contains("leaves --l1 because of: --perf-kernel on"),
        "{out}"
    );
    expect_exit2(&["flags", "--fused-gelu", "on"], &["--fused-gelu"]);
    let (code, out, err) = common::run_mlxb(&["flags", "--kv-group-size", "32", "--json"]);
    assert_eq!(code, 0, "{err}");
    let v: Value = serde_json::from_str(out.trim()).unwrap();
    assert!(v["warnings"][0].as_str().unwrap().contains("no effect"));

    let dir = tempfile::tempdir().unwrap();
    common::make_model(dir.path(), &llama(json!({})), "bf16", None);
    let model = dir.path().to_str().unwrap();
    let gen = |extra: &[&str]| {
        let mut a = vec!["generate", "--model", model, "--prompt", "hi", "-m", "3"];
        a.extend_from_slice(extra);
        a.into_iter().map(String::from).collect::<Vec<_>>()
    };
    expect_exit2(
        &as_str(&gen(&[
            "--kv-quant",
            "8",
            "--quantized-kv-start",
            "0",
            "--kv-group-size",
            "128",
        ])),
        &["--kv-group-size 128", "head dim 64"],
    );
    with_kv_config(dir.path(), json!([8]));
    expect_exit2(&as_str(&gen(&["--l2"])), &["kv_quantization", "2 layers"]);
    with_kv_config(dir.path(), json!([8, 7]));
    expect_exit2(&as_str(&gen(&["--l2"])), &["layer_bits[1]"]);
    expect_exit2(&["parity", "--model", model, "-m", "2", "--l3"], &["L1"]);
    // No per-layer config: a documented warning, and the run goes on unquantized.
    common::edit_config(dir.path(), |c| {
        c.as_object_mut().unwrap().remove("kv_quantization");
    });
    let (code, _, err) = common::run_mlxb(&as_str(&gen(&["--l2"])));
    assert_eq!(code, 0, "{err}");
    assert!(
        err.contains("warning") && err.contains("kv_quantization"),
        "{err}"
    );

    // A sliding-window (rotating) cache cannot be quantized, as in mlx-lm.
    let sw = tempfile::tempdir().unwrap();
    common::make_model(
        sw.path(),
        &llama(
            json!({"sliding_window": 8, "layer_types": ["sliding_attention", "full_attention"]}),
        ),
        "bf16",
        None,
    );
    let sw_model = sw.path().to_str().unwrap();
    expect_exit2(
        &[
            "generate",
            "--model",
            sw_model,
            "--prompt",
            "hello there",
            "-m",
            "3",
            "--kv-quant",
            "4",
            "--quantized-kv-start",
            "0",
        ],
        &["sliding-window"],
    );
}
