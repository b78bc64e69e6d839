//! Sampler and logits-processor parity with mlx-lm 0.32.2 itself: tests/oracle/sampling.py
//! runs `make_sampler` / `make_logits_processors` on fixed logits with fixed seeds and saves
//! inputs and results; here the same inputs go through `mlxb::engine::sample` with the same
//! seeds, and token ids must match exactly and processed logits bit for bit.

mod common;

use std::collections::HashMap;
use std::path::PathBuf;
use std::sync::OnceLock;

use mlx_rs::ops::indexing::TryIndexOp;
use mlx_rs::{ops, Array, Dtype};
use mlxb::engine::error::EngineError;
use mlxb::engine::sample::{seed, LogitsProcessors, ProcessorConfig, Sampler, SamplerConfig};

// Must match tests/oracle/sampling.py.
const ROWS: i32 = 8;
const STEPS: i32 = 32;
const SEED: u64 = 20240611;

/// Runs the oracle once per test binary; every test reads the file it wrote.
fn oracle_file() -> PathBuf {
    static FILE: OnceLock<PathBuf> = OnceLock::new();
    FILE.get_or_init(|| {
        let out = PathBuf::from(env!("CARGO_TARGET_TMPDIR")).join("sampling_oracle.safetensors");
        let script = common::root().join("tests/oracle/sampling.py");
        common::run_python(&script, &[out.to_str().unwrap()]);
        out
    })
    .clone()
}

fn oracle() -> HashMap<String, Array> {
    Array::load_safetensors(oracle_file()).unwrap()
}

fn get<'a>(o: &'a HashMap<String, Array>, key: &str) -> &'a Array {
    o.get(key)
        .unwrap_or_else(|| panic!("oracle output lacks `{key}`"))
}

fn ids(a: &Array) -> Vec<u32> {
    assert_eq!(
        a.dtype(),
        Dtype::Uint32,
        "token ids must be uint32 as in mlx-lm"
    );
    a.eval().unwrap();
    a.as_slice::<u32>().to_vec()
}

const DTYPES: [(&str, Dtype); 2] = [("f32", Dtype::Float32), ("bf16", Dtype::Bfloat16)];

/// Row `i % ROWS` of the oracle's logits in `dt`, shape `[1, vocab]`.
fn row(o: &HashMap<String, Array>, dt: Dtype, i: i32) -> Array {
    let r = i % ROWS;
    get(o, "logits")
        .as_dtype(dt)
        .unwrap()
        .try_index(r..r + 1)
        .unwrap()
}

/// What generate.py does before sampling: `logits - logsumexp(logits, keepdims=True)`.
fn logprobs_of(logits: &Array) -> Array {
    logits
        .subtract(ops::logsumexp(logits, true).unwrap())
        .unwrap()
}

/// Same settings as SAMPLERS in the oracle.
fn sampler_case(name: &str) -> SamplerConfig {
    let d = SamplerConfig::default();
    match name {
        "greedy" => d,
        "temp" => SamplerConfig { temp: 0.7, ..d },
        "temp_hot" => SamplerConfig { temp: 1.1, ..d },
        "top_p" => SamplerConfig {
            temp: 0.7,
            top_p: 0.9,
            ..d
        },
        "top_k" => SamplerConfig {
            temp: 0.7,
            top_k: 20,
            ..d
        },
        "min_p" => SamplerConfig {
            temp: 0.7,
            min_p: 0.1,
            ..d
        },
        "min_p_keep" => SamplerConfig {
            temp: 1.1,
            min_p: 0.9,
            min_tokens_to_keep: 5,
            ..d
        },
        "xtc" => SamplerConfig {
            temp: 0.7,
            xtc_probability: 0.5,
            xtc_threshold: 0.03,
            ..d
        },
        "xtc_special" => SamplerConfig {
            temp: 0.85,
            xtc_probability: 0.7,
            xtc_threshold: 0.02,
            xtc_special_tokens: vec![7, 13, 600],
            ..d
        },
        "all" => SamplerConfig {
            temp: 0.85,
            top_p: 0.95,
            min_p: 0.05,
            min_tokens_to_keep: 3,
            top_k: 40,
            xtc_probability: 0.6,
            xtc_threshold: 0.04,
            xtc_special_tokens: vec![7, 31],
        },
        _ => panic!("unknown sampler case {name}"),
    }
}

/// Same settings as PROCESSORS in the oracle, with the token dtype of the history.
fn processor_case(name: &str) -> (ProcessorConfig, Dtype) {
    let d = ProcessorConfig::default();
    match name {
        "repetition" => (
            ProcessorConfig {
                repetition_penalty: Some(1.3),
                repetition_context_size: 8,
                ..d
            },
            Dtype::Int32,
        ),
        "repetition_wide" => (
            ProcessorConfig {
                repetition_penalty: Some(1.1),
                ..d
            },
            Dtype::Int32,
        ),
        "presence" => (
            ProcessorConfig {
                presence_penalty: Some(0.7),
                presence_context_size: 12,
                ..d
            },
            Dtype::Int32,
        ),
        "frequency" => (
            ProcessorConfig {
                frequency_penalty: Some(0.45),
                frequency_context_size: 16,
                ..d
            },
            Dtype::Int32,
        ),
        "bias" => (
            ProcessorConfig {
                logit_bias: vec![(5, 3.7), (17, -2.25), (600, 11.1), (42, -100.0)],
                ..d
            },
            Dtype::Int32,
        ),
        "all" => (
            ProcessorConfig {
                logit_bias: vec![(3, 1.5), (600, -0.3)],
                repetition_penalty: Some(1.15),
                repetition_context_size: 10,
                presence_penalty: Some(0.35),
                presence_context_size: 6,
                frequency_penalty: Some(0.2),
                frequency_context_size: 30,
            },
            Dtype::Uint32,
        ),
        _ => panic!("unknown processor case {name}"),
    }
}

/// Seeds, builds the sampler and draws STEPS tokens as the oracle does.
fn run_sampler(o: &HashMap<String, Array>, name: &str, dt: Dtype, seed_value: u64) -> Vec<u32> {
    seed(seed_value).unwrap();
    let mut sampler = Sampler::new(&sampler_case(name)).unwrap();
    let toks: Vec<Array> = (0..STEPS)
        .map(|i| sampler.sample(&logprobs_of(&row(o, dt, i))).unwrap())
        .collect();
    ids(&ops::concatenate(&toks, 0).unwrap())
}

fn check_sampler(name: &str) {
    let o = oracle();
    for (dt_name, dt) in DTYPES {
        let want = ids(get(&o, &format!("sample.{name}.{dt_name}")));
        assert_eq!(want.len(), STEPS as usize);
        let got = run_sampler(&o, name, dt, SEED);
        assert_eq!(
            got, want,
            "sampler `{name}` ({dt_name}) drew different tokens than mlx-lm"
        );
        if name != "greedy" {
            // The comparison is not vacuous: the draws vary, and another seed changes them.
            let distinct: std::collections::BTreeSet<_> = want.iter().collect();
            assert!(
                distinct.len() > 4,
                "oracle draws for `{name}` barely vary: {want:?}"
            );
            let other = run_sampler(&o, name, dt, SEED + 99);
            assert_ne!(other, want, "sampler `{name}` ({dt_name}) ignores the seed");
            check_filter(&o, name, dt_name, dt);
        }
    }
}

/// The masked logprobs the categorical draw sees must equal mlx-lm's bit for bit (the
/// tokens alone would not notice e.g. a finite mask value instead of -inf).
fn check_filter(o: &HashMap<String, Array>, name: &str, dt_name: &str, dt: Dtype) {
    let want = get(o, &format!("filter.{name}.{dt_name}"));
    assert_eq!(want.dtype(), dt);
    seed(SEED).unwrap();
    let mut sampler = Sampler::new(&sampler_case(name)).unwrap();
    for i in 0..STEPS {
        let got = sampler.filter(&logprobs_of(&row(o, dt, i))).unwrap();
        assert_eq!(got.dtype(), dt, "`{name}` filters changed the dtype");
        let (g, w) = (
            common::bits(&got),
            common::bits(&want.try_index(i..i + 1).unwrap()),
        );
        let diff = g.iter().zip(&w).filter(|(a, b)| a != b).count();
        assert_eq!(
            diff, 0,
            "sampler `{name}` ({dt_name}) step {i}: {diff} filtered logprobs differ from mlx-lm"
        );
    }
}

/// Every sampler on a whole batch of rows at once (`[ROWS, VOCAB]`, one call per step, as the
/// batched engine samples) draws mlx-lm's tokens: the filters and the categorical draw keep
/// rows apart and consume the random state as mlx-lm does.
#[test]
fn batched_sampling_matches_mlx_lm() {
    let o = oracle();
    for name in [
        "greedy",
        "temp",
        "temp_hot",
        "top_p",
        "top_k",
        "min_p",
        "min_p_keep",
        "xtc",
        "xtc_special",
        "all",
    ] {
        for (dt_name, dt) in DTYPES {
            let want = ids(get(&o, &format!("batch.{name}.{dt_name}")));
            let logits = get(&o, "logits").as_dtype(dt).unwrap();
            let rows = logits
                .subtract(logits.logsumexp_axis(-1, true).unwrap())
                .unwrap();
            seed(SEED).unwrap();
            let mut sampler = Sampler::new(&sampler_case(name)).unwrap();
            let draws: Vec<Array> = (0..4).map(|_| sampler.sample(&rows).unwrap()).collect();
            let got = ids(&ops::concatenate(&draws, 0).unwrap());
            assert_eq!(got.len(), 4 * 8, "one token per row per step");
            assert_eq!(
                got, want,
                "batched `{name}` ({dt_name}) drew other tokens than mlx-lm"
            );
        }
    }
}

#[test]
fn greedy_matches_mlx_lm() {
    check_sampler("greedy");
}

#[test]
fn temperature_matches_mlx_lm() {
    check_sampler("temp");
}

#[test]
fn hot_temperature_matches_mlx_lm() {
    // temp > 1 flattens the distribution: many distinct tokens.
    check_sampler("temp_hot");
}

#[test]
fn top_p_matches_mlx_lm() {
    check_sampler("top_p");
}

#[test]
fn top_k_matches_mlx_lm() {
    check_sampler("top_k");
}

#[test]
fn min_p_matches_mlx_lm() {
    check_sampler("min_p");
}

#[test]
fn min_p_with_min_tokens_to_keep_matches_mlx_lm() {
    check_sampler("min_p_keep");
}

#[test]
fn xtc_matches_mlx_lm() {
    check_sampler("xtc");
}

#[test]
fn xtc_with_special_tokens_matches_mlx_lm() {
    check_sampler("xtc_special");
}

#[test]
fn all_samplers_combined_match_mlx_lm() {
    check_sampler("all");
}

fn check_processors(name: &str) {
    let o = oracle();
    let history = get(&o, "history");
    let prompt_len = get(&o, "prompt_len").as_slice::<i32>()[0];
    let (cfg, token_dt) = processor_case(name);
    for (dt_name, dt) in DTYPES {
        let want = get(&o, &format!("proc.{name}.{dt_name}"));
        assert_eq!(want.dtype(), dt);
        let mut procs = LogitsProcessors::new(&cfg).unwrap();
        assert!(!procs.is_empty());
        let mut changed = 0;
        for i in 0..STEPS {
            let tokens = history
                .try_index(..prompt_len + i)
                .unwrap()
                .as_dtype(token_dt)
                .unwrap();
            let input = row(&o, dt, i);
            let got = procs.apply(&tokens, &input).unwrap();
            assert_eq!(got.dtype(), dt, "`{name}` changed the logits dtype");
            let want_i = want.try_index(i..i + 1).unwrap();
            let (g, w) = (common::bits(&got), common::bits(&want_i));
            let diff = g.iter().zip(&w).filter(|(a, b)| a != b).count();
            assert_eq!(
                diff, 0,
                "processor `{name}` ({dt_name}) step {i}: {diff} logits differ from mlx-lm"
            );
            changed += g
                .iter()
                .zip(common::bits(&input))
                .filter(|(a, b)| **a != *b)
                .count();
        }
        assert!(
            changed > 0,
            "processor `{name}` changed nothing: vacuous test"
        );
    }
}

#[test]
fn repetition_penalty_matches_mlx_lm() {
    check_processors("repetition");
}

#[test]
fn repetition_penalty_default_context_matches_mlx_lm() {
    check_processors("repetition_wide");
}

#[test]
fn presence_penalty_matches_mlx_lm() {
    check_processors("presence");
}

#[test]
fn frequency_penalty_matches_mlx_lm() {
    check_processors("frequency");
}

#[test]
fn logit_bias_matches_mlx_lm() {
    check_processors("bias");
}

#[test]
fn all_processors_combined_match_mlx_lm() {
    check_processors("all");
}

#[test]
fn generate_like_pipeline_matches_mlx_lm() {
    // generate.py `_step`: processors on the growing history, logprobs, sample, feed back.
    let o = oracle();
    let history = get(&o, "history");
    let prompt_len = get(&o, "prompt_len").as_slice::<i32>()[0];
    for (dt_name, dt) in DTYPES {
        seed(SEED + 1).unwrap();
        let mut sampler = Sampler::new(&sampler_case("all")).unwrap();
        let mut procs = LogitsProcessors::new(&processor_case("all").0).unwrap();
        let mut tokens = history.try_index(..prompt_len).unwrap();
        let mut ys = Vec::new();
        for i in 0..STEPS {
            let logits = procs.apply(&tokens, &row(&o, dt, i)).unwrap();
            let y = sampler.sample(&logprobs_of(&logits)).unwrap();
            tokens = ops::concatenate(&[tokens, y.clone()], 0).unwrap();
            ys.push(y);
        }
        let got = ids(&ops::concatenate(&ys, 0).unwrap());
        let want = ids(get(&o, &format!("pipe.{dt_name}")));
        assert_eq!(
            got, want,
            "generate-like loop ({dt_name}) diverged from mlx-lm"
        );
    }
}

fn input_error(r: Result<impl Sized, EngineError>) -> String {
    match r {
        Err(EngineError::Input(msg)) => msg,
        Err(e) => panic!("expected an input error, got {e}"),
        Ok(_) => panic!("expected an input error, got Ok"),
    }
}

#[test]
fn invalid_settings_are_input_errors() {
    let d = SamplerConfig::default();
    let bad = [
        (
            "--temp",
            SamplerConfig {
                temp: -0.5,
                ..d.clone()
            },
        ),
        (
            "--temp",
            SamplerConfig {
                temp: f64::NAN,
                ..d.clone()
            },
        ),
        (
            "--top-p",
            SamplerConfig {
                temp: 1.0,
                top_p: 1.5,
                ..d.clone()
            },
        ),
        (
            "--top-p",
            SamplerConfig {
                temp: 1.0,
                top_p: -0.1,
                ..d.clone()
            },
        ),
        (
            "--min-p",
            SamplerConfig {
                temp: 1.0,
                min_p: 1.01,
                ..d.clone()
            },
        ),
        (
            "--min-p",
            SamplerConfig {
                temp: 1.0,
                min_p: -0.2,
                ..d.clone()
            },
        ),
        (
            "--min-tokens-to-keep",
            SamplerConfig {
                temp: 1.0,
                min_p: 0.1,
                min_tokens_to_keep: 0,
                ..d.clone()
            },
        ),
        (
            "--xtc-probability",
            SamplerConfig {
                temp: 1.0,
                xtc_probability: 1.5,
                ..d.clone()
            },
        ),
        (
            "--xtc-threshold",
            SamplerConfig {
                temp: 1.0,
                xtc_probability: 0.5,
                xtc_threshold: 0.6,
                ..d.clone()
            },
        ),
    ];
    for (flag, cfg) in bad {
        let msg = input_error(Sampler::new(&cfg));
        assert!(
            msg.contains(flag),
            "message for {flag} does not name it: {msg}"
        );
    }

    // top_k is checked against the vocabulary when sampling, as mlx-lm does.
    let mut s = Sampler::new(&SamplerConfig {
        temp: 1.0,
        top_k: 640,
        ..d.clone()
    })
    .unwrap();
    let lp = Array::zeros::<f32>(&[1, 640]).unwrap();
    assert!(input_error(s.sample(&lp)).contains("--top-k"));

    let msg = input_error(LogitsProcessors::new(&ProcessorConfig {
        repetition_penalty: Some(-1.0),
        ..ProcessorConfig::default()
    }));
    assert!(msg.contains("--repetition-penalty"), "{msg}");

    let mut p = LogitsProcessors::new(&ProcessorConfig {
        logit_bias: vec![(700, 1.0)],
        ..ProcessorConfig::default()
    })
    .unwrap();
    let tokens = Array::from_slice(&[1i32, 2], &[2]);
    assert!(input_error(p.apply(&tokens, &lp)).contains("--logit-bias"));
}

#[test]
fn disabled_settings_build_what_mlx_lm_builds() {
    assert!(Sampler::new(&SamplerConfig::default()).unwrap().is_greedy());
    // temp 0 is greedy whatever else is set; top_p 1.0 and penalty 0 are off, as in mlx-lm.
    let cfg = SamplerConfig {
        temp: 0.0,
        top_p: 0.5,
        top_k: 3,
        ..SamplerConfig::default()
    };
    assert!(Sampler::new(&cfg).unwrap().is_greedy());
    let procs = LogitsProcessors::new(&ProcessorConfig {
        repetition_penalty: Some(0.0),
        presence_penalty: Some(0.0),
        ..ProcessorConfig::default()
    })
    .unwrap();
    assert!(procs.is_empty());
}
