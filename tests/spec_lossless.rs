//! Speculative decoding is lossless: for every drafter and cache kind, greedy speculative
//! output equals mlx-lm's greedy output token for token (the reference is mlx-lm, not
//! mlxb's own vanilla loop); a drafter proposing garbage changes nothing; and rejection
//! sampling keeps the target's distribution (chi-square against plain sampling).

mod common;

use mlxb::engine::forks::Forks;
use mlxb::engine::generate::{Flow, GenerateConfig, Generator};
use mlxb::engine::models::{self, LanguageModel};
use mlxb::engine::sample::{self, LogitsProcessors, ProcessorConfig, Sampler, SamplerConfig};
use mlxb::engine::session::Session;
use mlxb::spec::executor::Speculation;
use mlxb::spec::factory::{open_source, DraftKind, SpecOptions};
use mlxb::spec::metrics::SpecMetrics;
use mlxb::spec::source::{Draft, DraftSource, TargetView, VerifyMode};
use serde_json::{json, Value};
use std::path::Path;

const PROMPT_LEN: usize = 48;
const GEN: usize = 72;

/// Proposes pseudo-random tokens: acceptance is rare, rollback happens almost every round.
struct Garbage {
    state: u64,
    vocab: u32,
}

impl DraftSource for Garbage {
    fn name(&self) -> &'static str {
        "garbage"
    }
    fn draft(
        &mut self,
        _t: TargetView<'_>,
        _seq: &[u32],
        n: usize,
    ) -> mlxb::engine::error::Result<Draft> {
        let tokens = (0..n)
            .map(|_| {
                self.state = self
                    .state
                    .wrapping_mul(6364136223846793005)
                    .wrapping_add(1442695040888963407);
                ((self.state >> 33) % self.vocab as u64) as u32
            })
            .collect();
        Ok(Draft {
            tokens,
            probs: None,
        })
    }
    fn commit(&mut self, _t: TargetView<'_>, _c: usize) -> mlxb::engine::error::Result<()> {
        Ok(())
    }
}

/// Repetitive prompt so that n-gram lookup actually proposes tokens.
fn prompt(vocab: u32) -> Vec<u32> {
    let base = common::prompt_ids(12, vocab, 3);
    base.iter().cycle().take(PROMPT_LEN).copied().collect()
}

fn generate(
    model: &mut dyn LanguageModel,
    prompt: &[u32],
    source: Option<Box<dyn DraftSource + '_>>,
    k: usize,
) -> (Vec<i32>, Option<SpecMetrics>) {
    common::greedy_ids(model, prompt, source, k, GEN)
}

/// Runs every drafter on the model in `dir` and compares with mlx-lm's greedy ids.
fn check_all_drafters(dir: &Path, config: &Value, draft_layers: usize, wraps: bool) {
    let vocab = config["vocab_size"].as_u64().unwrap() as u32;
    let prompt = prompt(vocab);
    let oracle =
        common::oracle_trace(&json!({"model": dir, "prompt_ids": prompt, "max_tokens": GEN}));
    let want: Vec<i32> = oracle["ids"].as_slice::<i32>().to_vec();
    let mut session = Session::open(dir, Forks::default()).unwrap();

    // The last entry of each: the shortest n-gram looked up before the model drafter drafts
    // (0 = no lookup in front).
    let kinds = [
        (DraftKind::Ngram, None, None, 0),
        (DraftKind::SelfLayers, None, Some(draft_layers), 0),
        (DraftKind::Model, Some(dir.to_path_buf()), None, 0),
        (DraftKind::SelfLayers, None, Some(draft_layers), 2),
    ];
    for (kind, draft_model, layers, lookup_first) in kinds {
        for k in [2usize, 4] {
            let opts = SpecOptions {
                kind,
                draft_model: draft_model.clone(),
                num_draft_tokens: k,
                draft_layers: layers,
                ngram_max: 3,
                ngram_min: 1,
                verify: VerifyMode::Match,
                dspark_min_conf: None,
                dspark_prune: Default::default(),
                lookup_first: Some(lookup_first),
                lookup_tokens: None,
                lookup_table: Default::default(),
            };
            let source = open_source(&opts, &session, Forks::default(), 2048).unwrap();
            let (got, metrics) = generate(session.model.model.as_mut(), &prompt, Some(source), k);
            let m = metrics.unwrap();
            assert_eq!(
                got,
                want,
                "{kind:?} (lookup first {lookup_first}) k={k} diverges from mlx-lm greedy; metrics {:?}",
                m.to_json()
            );
            assert!(m.target_forwards > 0);
        }
    }
    let garbage = Box::new(Garbage { state: 42, vocab });
    let (got, metrics) = generate(session.model.model.as_mut(), &prompt, Some(garbage), 4);
    assert_eq!(got, want, "a garbage drafter changed the output");
    let m = metrics.unwrap();
    assert!(
        m.drafts > 10 && m.acceptance_rate() < 0.5,
        "garbage drafter was not exercised: {:?}",
        m.to_json()
    );
    common::assert_rollback_path(&m, wraps);
}

#[test]
fn full_cache_all_drafters_match_mlx_lm() {
    let dir = tempfile::tempdir().unwrap();
    let config = common::tiny_llama(json!({}));
    common::make_model(dir.path(), &config, "f32", None);
    check_all_drafters(dir.path(), &config, 2, false);
}

/// Sliding-window layers with a window far shorter than prompt + generation: the ring wraps
/// and verify blocks straddle its edge (where mlx-lm's own trim silently does nothing).
#[test]
fn rotating_cache_all_drafters_match_mlx_lm() {
    let dir = tempfile::tempdir().unwrap();
    let config = common::tiny_llama(json!({
        "sliding_window": 10,
        "layer_types": ["sliding_attention", "full_attention", "sliding_attention", "sliding_attention"]
    }));
    common::make_model(dir.path(), &config, "f32", None);
    check_all_drafters(dir.path(), &config, 1, true);
}

#[test]
fn gemma3_sliding_window_all_drafters_match_mlx_lm() {
    let dir = tempfile::tempdir().unwrap();
    let config = common::tiny_gemma3();
    common::make_model(dir.path(), &config, "f32", None);
    check_all_drafters(dir.path(), &config, 2, true);
}

/// Rejection sampling keeps the target's distribution: the second generated token's
/// empirical distribution with a deterministic (bad) drafter and `--spec-verify reject`
/// matches plain sampling within a chi-square bound (fixed seeds; deterministic).
/// Proposes what it was told the target will emit, after `pause`.
struct Knowing {
    emitted: Vec<u32>,
    prompt_len: usize,
    pause: std::time::Duration,
}

impl DraftSource for Knowing {
    fn name(&self) -> &'static str {
        "knowing"
    }
    fn draft(
        &mut self,
        _t: TargetView<'_>,
        seq: &[u32],
        n: usize,
    ) -> mlxb::engine::error::Result<Draft> {
        std::thread::sleep(self.pause);
        let from = (seq.len() - self.prompt_len).min(self.emitted.len());
        let to = (from + n).min(self.emitted.len());
        Ok(Draft {
            tokens: self.emitted[from..to].to_vec(),
            probs: None,
        })
    }
    fn commit(&mut self, _t: TargetView<'_>, _c: usize) -> mlxb::engine::error::Result<()> {
        Ok(())
    }
}

#[test]
fn the_cost_policy_drafts_only_while_drafting_pays_and_changes_nothing() {
    let tmp = tempfile::tempdir().unwrap();
    let config = common::tiny_llama(json!({}));
    common::make_model(tmp.path(), &config, "f32", None);
    let prompt = prompt(384);
    let mut session = Session::open(tmp.path(), Forks::default()).unwrap();
    let model = session.model.model.as_mut();
    let tokens = 400;
    let (want, _) = common::greedy_ids(model, &prompt, None, 0, tokens);
    let mut gated = |source: Box<dyn DraftSource>| {
        let mut spec = Speculation::new(source, 4, VerifyMode::Match)
            .with_draft_policy(mlxb::spec::policy::DraftPolicy::Cost);
        let got = common::greedy_ids_speculating(model, &prompt, Some(&mut spec), tokens);
        assert_eq!(got, want, "a gated stream changed the output");
        let m = spec.metrics;
        (m.drafts, m.target_forwards)
    };
    // Always right and free: five tokens a round for about a step's time, so every round
    // drafts but the first plain rounds and one in 64 after them.
    let (drafted, rounds) = gated(Box::new(Knowing {
        emitted: want.iter().map(|&t| t as u32).collect(),
        prompt_len: prompt.len(),
        pause: std::time::Duration::ZERO,
    }));
    assert!(
        rounds - drafted <= 3 + rounds / 64 + 1,
        "{drafted} of {rounds} drafted"
    );
    // Always wrong, after a pause of many steps: drafting turns off after its first 16 rounds
    // and is retried one round in 8.
    let (drafted, rounds) = gated(Box::new(Knowing {
        emitted: want.iter().map(|&t| (t as u32 + 1) % 384).collect(),
        prompt_len: prompt.len(),
        pause: std::time::Duration::from_millis(5),
    }));
    assert!(drafted * 3 < rounds, "{drafted} of {rounds} drafted");
}

#[test]
fn rejection_sampling_is_lossless_in_distribution() {
    let dir = tempfile::tempdir().unwrap();
    let config = common::tiny_llama(json!({
        "hidden_size": 32, "num_hidden_layers": 1, "intermediate_size": 64,
        "num_attention_heads": 2, "num_key_value_heads": 1, "vocab_size": 12
    }));
    common::make_model_with(dir.path(), &config, "f32", None, &["--no-tokenizer"]);
    let mut loaded = models::load(dir.path(), Forks::default()).unwrap();
    let prompt = [1u32, 5, 7, 2, 9];
    let n = 1500;
    let vocab = 12usize;
    let mut plain = vec![0f64; vocab];
    let mut spec = vec![0f64; vocab];
    for (counts, speculative) in [(&mut plain, false), (&mut spec, true)] {
        sample::seed(if speculative { 1234 } else { 99 }).unwrap();
        for _ in 0..n {
            let mut sampler = Sampler::new(&SamplerConfig {
                temp: 1.0,
                ..Default::default()
            })
            .unwrap();
            let mut processors = LogitsProcessors::new(&ProcessorConfig::default()).unwrap();
            let mut attached = None;
            let mut g = Generator::new(loaded.model.as_mut(), &mut sampler, &mut processors);
            if speculative {
                // Always proposes token 3: usually wrong, so the residual path is exercised.
                struct Fixed;
                impl DraftSource for Fixed {
                    fn name(&self) -> &'static str {
                        "fixed"
                    }
                    fn draft(
                        &mut self,
                        _t: TargetView<'_>,
                        _s: &[u32],
                        n: usize,
                    ) -> mlxb::engine::error::Result<Draft> {
                        Ok(Draft {
                            tokens: vec![3; n],
                            probs: None,
                        })
                    }
                    fn commit(
                        &mut self,
                        _t: TargetView<'_>,
                        _c: usize,
                    ) -> mlxb::engine::error::Result<()> {
                        Ok(())
                    }
                }
                let spec =
                    attached.insert(Speculation::new(Box::new(Fixed), 2, VerifyMode::Reject));
                g = g.with_speculation(spec);
            }
            let mut toks = vec![];
            let cfg = GenerateConfig {
                max_tokens: 3,
                prefill_step_size: 2048,
            };
            g.run(&prompt, &cfg, |s| {
                toks.push(s.token as usize);
                Ok(Flow::Continue)
            })
            .unwrap();
            counts[toks[1]] += 1.0;
        }
    }
    // Two-sample chi-square over categories with enough mass.
    let (chi2, dof) = common::two_sample_chi_square(&plain, &spec);
    // 99.9th percentile of chi-square with up to 11 dof is 31.3.
    assert!(dof >= 3, "distribution too concentrated to test: {plain:?}");
    assert!(chi2 < 31.3, "speculative sampling changed the distribution: chi2 {chi2:.1} over {dof} bins; plain {plain:?} spec {spec:?}");
    // And the drafted token 3 is not over-represented (the classic bug: accepting drafts blindly).
    assert!(
        spec[3] < plain[3] * 1.5 + 30.0,
        "draft token over-represented: plain {plain:?} spec {spec:?}"
    );
}
