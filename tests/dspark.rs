//! The DSpark drafter: lossless behind the seam (greedy speculative ids equal mlx-lm's greedy
//! ids for full-cache and sliding-window targets), confidence pruning only shortens a block,
//! zero-output heads equal plain DFlash, the loader refuses checkpoints that do not fit with
//! one sentence, DeepSpec-format checkpoints load and draft, and one drafter forward matches
//! an independent numpy re-computation of the spec's equations.

mod common;

use mlx_rs::ops::indexing::IndexOp;
use mlx_rs::transforms::eval;
use mlx_rs::{ops, random, Array};
use mlxb::engine::error::Result as EngineResult;
use mlxb::engine::forks::Forks;
use mlxb::engine::models::{self, ForwardOpts, LanguageModel};
use mlxb::engine::session::Session;
use mlxb::spec::dspark::checkpoint::{self, SeqHead};
use mlxb::spec::dspark::drafter::DsparkSource;
use mlxb::spec::dspark::module::DsparkModule;
use mlxb::spec::factory::{open_source, DraftKind, SpecOptions};
use mlxb::spec::lookup_first::LookupFirst;
use mlxb::spec::metrics::SpecMetrics;
use mlxb::spec::source::{Draft, DraftSource, TargetView, VerifyMode};
use mlxb::train::init::{init, InitOptions};
use serde_json::{json, Value};
use std::cell::RefCell;
use std::collections::HashMap;
use std::path::Path;
use std::rc::Rc;

const GEN: usize = 40;

/// A tiny random target saved by mlx-lm in f32.
fn target(config: &Value) -> tempfile::TempDir {
    let dir = tempfile::tempdir().unwrap();
    common::make_model(dir.path(), config, "f32", None);
    dir
}

fn opts(seq_head: SeqHead) -> InitOptions {
    InitOptions {
        seq_head,
        layers: 2,
        block_size: 5,
        markov_rank: 32,
        tap_layers: Some(vec![0, 1, 2]),
        std: 0.05,
        seed: 7,
        ..InitOptions::default()
    }
}

/// Writes a random drafter for the target in `target_dir` (tensors passed through `edit`).
fn drafter(
    target_dir: &Path,
    o: &InitOptions,
    edit: impl FnOnce(&mut checkpoint::DsparkConfig, &mut HashMap<String, Array>),
) -> tempfile::TempDir {
    let loaded = models::load(target_dir, Forks::default()).unwrap();
    let (mut config, mut tensors) =
        init(loaded.model.as_ref(), &loaded.config, target_dir, None, o).unwrap();
    edit(&mut config, &mut tensors);
    let out = tempfile::tempdir().unwrap();
    checkpoint::save(out.path(), &config, &tensors).unwrap();
    out
}

fn prompt(vocab: u32) -> Vec<u32> {
    common::prompt_ids(20, vocab, 5)
}

fn oracle_ids(dir: &Path, prompt: &[u32]) -> Vec<i32> {
    let t = common::oracle_trace(&json!({"model": dir, "prompt_ids": prompt, "max_tokens": GEN}));
    t["ids"].as_slice::<i32>().to_vec()
}

fn spec_options(kind: DraftKind, path: &Path, min_conf: Option<f64>) -> SpecOptions {
    SpecOptions {
        dspark_min_conf: min_conf,
        ..common::spec_options(kind, Some(path))
    }
}

/// Runs DSpark drafters with every head (and with pruning) on the target in `dir` and checks
/// greedy speculative ids against mlx-lm's.
fn check_lossless(config: &Value, wraps: bool) {
    let dir = target(config);
    let prompt = prompt(384);
    let want = oracle_ids(dir.path(), &prompt);
    let mut session = Session::open(dir.path(), Forks::default()).unwrap();
    let cases = [
        (SeqHead::Markov, DraftKind::Model, None),
        (SeqHead::Rnn, DraftKind::Dspark, Some(0.5)),
        (SeqHead::Gated, DraftKind::Dspark, None),
    ];
    for (head, kind, min_conf) in cases {
        let ck = drafter(dir.path(), &opts(head), |_, _| {});
        let source = open_source(
            &spec_options(kind, ck.path(), min_conf),
            &session,
            Forks::default(),
            2048,
        )
        .unwrap();
        let (got, metrics) =
            common::greedy_ids(session.model.model.as_mut(), &prompt, Some(source), 3, GEN);
        let m = metrics.unwrap();
        assert_eq!(
            got,
            want,
            "{head:?} (min conf {min_conf:?}) diverges from mlx-lm greedy: {:?}",
            m.to_json()
        );
        assert_eq!(m.drafter, "dspark");
        assert!(
            m.drafts > 5,
            "the drafter was not exercised: {:?}",
            m.to_json()
        );
        // --num-draft-tokens 3 is pinned to the checkpoint's γ = 5.
        if min_conf.is_none() {
            assert_eq!(
                m.accepted_per_position.len(),
                5,
                "γ not used: {:?}",
                m.to_json()
            );
        }
        common::assert_rollback_path(&m, wraps);
        eprintln!("{head:?} min_conf {min_conf:?}: {}", m.footer());
    }
}

#[test]
fn lossless_full_cache_llama() {
    check_lossless(&common::tiny_llama(json!({})), false);
}

#[test]
fn lossless_full_cache_qwen3() {
    check_lossless(&common::tiny_qwen3(json!({})), false);
}

#[test]
fn lossless_sliding_window_llama() {
    check_lossless(
        &common::tiny_llama(json!({
            "sliding_window": 10,
            "layer_types": ["sliding_attention", "full_attention", "sliding_attention", "sliding_attention"]
        })),
        true,
    );
}

#[test]
fn lossless_sliding_window_gemma3() {
    check_lossless(&common::tiny_gemma3(), true);
}

/// Delegates to a DSpark drafter and records what it proposed (and its unpruned block).
struct Recorder {
    inner: DsparkSource,
    log: Rc<RefCell<Vec<Round>>>,
    /// Rounds drafted on the host kernels.
    hosted: Rc<RefCell<usize>>,
}

/// One round as the recorder saw it. Rounds compare by what was drafted, not by the
/// confidences (the host and MLX forms sum in other orders, and STS rescales them).
#[derive(Debug, Clone)]
struct Round {
    anchor: usize,
    proposed: Vec<u32>,
    block: Vec<u32>,
    kept: usize,
    passes: usize,
    confidence: Vec<f64>,
}

impl PartialEq for Round {
    fn eq(&self, o: &Self) -> bool {
        (
            self.anchor,
            &self.proposed,
            &self.block,
            self.kept,
            self.passes,
        ) == (o.anchor, &o.proposed, &o.block, o.kept, o.passes)
    }
}

impl DraftSource for Recorder {
    fn name(&self) -> &'static str {
        self.inner.name()
    }
    fn tap_layers(&self) -> Vec<usize> {
        self.inner.tap_layers()
    }
    fn observe_taps(&mut self, first: usize, taps: Vec<Array>) -> EngineResult<()> {
        self.inner.observe_taps(first, taps)
    }
    fn block_size(&self) -> Option<usize> {
        self.inner.block_size()
    }
    fn begin(&mut self, t: TargetView<'_>, prompt: &[u32]) -> EngineResult<()> {
        self.inner.begin(t, prompt)
    }
    fn draft(&mut self, t: TargetView<'_>, seq: &[u32], n: usize) -> EngineResult<Draft> {
        let d = self.inner.draft(t, seq, n)?;
        *self.hosted.borrow_mut() += usize::from(self.inner.drafts_on_host());
        let block = self.inner.last_block().unwrap();
        self.log.borrow_mut().push(Round {
            anchor: block.anchor_position,
            proposed: d.tokens.clone(),
            block: block.tokens.clone(),
            kept: block.kept,
            passes: self.inner.passes(),
            confidence: block.confidence.clone(),
        });
        Ok(d)
    }
    fn commit(&mut self, t: TargetView<'_>, committed: usize) -> EngineResult<()> {
        self.inner.commit(t, committed)
    }
}

type Log = Vec<Round>;

/// Greedy ids and the drafter's log for the checkpoint at `ck`.
fn recorded(
    session: &mut Session,
    ck: &Path,
    prompt: &[u32],
    min_conf: Option<f64>,
) -> (Vec<i32>, Log, SpecMetrics) {
    let inner =
        DsparkSource::open(ck, session.model.model.as_ref(), min_conf, Forks::default()).unwrap();
    let (ids, log, m, _) = recorded_with(session, inner, prompt);
    (ids, log, m)
}

/// Greedy ids, the log and the rounds drafted on the host kernels for `inner`.
fn recorded_with(
    session: &mut Session,
    inner: DsparkSource,
    prompt: &[u32],
) -> (Vec<i32>, Log, SpecMetrics, usize) {
    recorded_behind(session, inner, prompt, None, GEN)
}

/// As [`recorded_with`] for `max_tokens`, with `inner` behind a lookup of the last `lookup`
/// n-grams when given.
fn recorded_behind(
    session: &mut Session,
    inner: DsparkSource,
    prompt: &[u32],
    lookup: Option<(usize, usize)>,
    max_tokens: usize,
) -> (Vec<i32>, Log, SpecMetrics, usize) {
    let log = Rc::new(RefCell::new(Vec::new()));
    let hosted = Rc::new(RefCell::new(0));
    let rec = Box::new(Recorder {
        inner,
        log: log.clone(),
        hosted: hosted.clone(),
    });
    let source: Box<dyn DraftSource> = match lookup {
        Some((min, max)) => Box::new(LookupFirst::new(rec, min, max, None)),
        None => rec,
    };
    let (ids, m) = common::greedy_ids(
        session.model.model.as_mut(),
        prompt,
        Some(source),
        3,
        max_tokens,
    );
    let log = log.borrow().clone();
    let hosted = *hosted.borrow();
    (ids, log, m.unwrap(), hosted)
}

/// Pruning cuts the block at the first low-confidence position: what is proposed is a prefix
/// of the block sampled in the same (single) backbone pass; a calibrated threshold table in
/// the checkpoint prunes exactly like the same global threshold; pruning never changes output.
#[test]
fn pruning_keeps_a_prefix_and_never_redrafts() {
    let dir = target(&common::tiny_llama(json!({})));
    let prompt = prompt(384);
    let mut session = Session::open(dir.path(), Forks::default()).unwrap();
    let ck = drafter(dir.path(), &opts(SeqHead::Markov), |_, _| {});
    let (plain_ids, plain_log, _) = recorded(&mut session, ck.path(), &prompt, None);
    let (ids, log, m) = recorded(&mut session, ck.path(), &prompt, Some(0.5));
    assert_eq!(ids, plain_ids, "pruning changed the output");
    let mut pruned = 0;
    for (i, r) in log.iter().enumerate() {
        assert_eq!(r.passes, i + 1, "more than one backbone pass in round {i}");
        assert!(
            r.kept >= 1 && !r.proposed.is_empty(),
            "position 0 must always survive"
        );
        assert!(r.proposed.len() <= r.kept);
        assert_eq!(
            &r.block[..r.proposed.len()],
            &r.proposed[..],
            "not a prefix of the block"
        );
        pruned += (r.kept < r.block.len()) as usize;
    }
    assert!(pruned > 0, "threshold 0.5 never pruned: {:?}", m.to_json());
    assert!(
        plain_log.iter().all(|r| r.kept == r.block.len()),
        "pruned without thresholds"
    );
    assert!(m.drafted_tokens < log.len() * 5);

    // The same threshold as a checkpoint table (per position) prunes identically.
    let table = drafter(dir.path(), &opts(SeqHead::Markov), |c, _| {
        c.thresholds = Some(vec![0.9, 0.5, 0.5, 0.5, 0.5]);
    });
    let (_, table_log, _) = recorded(&mut session, table.path(), &prompt, None);
    assert_eq!(table_log, log);
    // A global threshold overrides the table; 0 disables pruning.
    let (_, off_log, _) = recorded(&mut session, table.path(), &prompt, Some(0.0));
    assert_eq!(off_log, plain_log);
    // STS temperatures rescale the logits before the threshold: a tiny temperature pushes
    // every confidence to 0 or 1.
    let sts = drafter(dir.path(), &opts(SeqHead::Markov), |c, _| {
        c.sts_temperatures = Some(vec![1e-6; 5]);
    });
    let (_, sts_log, _) = recorded(&mut session, sts.path(), &prompt, Some(0.5));
    assert_eq!(
        sts_log, log,
        "STS changed which side of 0.5 a confidence falls"
    );

    // Two drafters fed identical taps: the pruned proposal is a prefix of the unpruned one.
    let model = session.model.model.as_mut();
    let mut a = DsparkSource::open(ck.path(), &*model, None, Forks::default()).unwrap();
    let mut b = DsparkSource::open(ck.path(), &*model, Some(0.55), Forks::default()).unwrap();
    let mut caches = model.make_caches();
    let ids: Vec<i32> = prompt.iter().map(|&t| t as i32).collect();
    let fwd = ForwardOpts {
        exit_after: None,
        taps: a.tap_layers(),
    };
    let out = model
        .forward_ext(
            &Array::from_slice(&ids, &[1, ids.len() as i32]),
            &mut caches,
            &fwd,
        )
        .unwrap();
    let mut seq = prompt.clone();
    seq.push(17);
    let mut drafts = Vec::new();
    for s in [&mut a, &mut b] {
        s.observe_taps(0, out.taps.clone()).unwrap();
        let view = TargetView {
            model: &mut *model,
            caches: &caches,
        };
        drafts.push(s.draft(view, &seq, 5).unwrap());
    }
    let (da, db) = (&drafts[0], &drafts[1]);
    assert_eq!(da.tokens.len(), 5);
    assert_eq!(&da.tokens[..db.tokens.len()], &db.tokens[..]);
    assert_eq!(b.passes(), 1);
}

/// With the heads' output projection W2 at zero, Markov, RNN and gated heads all reduce to
/// the base logits: every round's proposal equals plain DFlash's (legacy "dflash" variant,
/// same backbone), token for token. With W2 non-zero the Markov head does change proposals.
#[test]
fn zero_w2_heads_equal_plain_dflash() {
    let dir = target(&common::tiny_qwen3(json!({})));
    let prompt = prompt(384);
    let mut session = Session::open(dir.path(), Forks::default()).unwrap();
    let dflash = drafter(
        dir.path(),
        &InitOptions {
            confidence_head: false,
            ..opts(SeqHead::None)
        },
        |c, _| c.variant = "dflash".into(),
    );
    let (_, reference, _) = recorded(&mut session, dflash.path(), &prompt, None);
    assert!(reference.len() > 5);
    for head in [SeqHead::Markov, SeqHead::Rnn, SeqHead::Gated] {
        let ck = drafter(
            dir.path(),
            &InitOptions {
                zero_seq_output: true,
                ..opts(head)
            },
            |_, _| {},
        );
        let (_, log, _) = recorded(&mut session, ck.path(), &prompt, None);
        assert_eq!(
            log, reference,
            "{head:?} with W2 = 0 differs from plain DFlash"
        );
    }
    let strong = drafter(dir.path(), &opts(SeqHead::Markov), |_, t| {
        let w2 = t["markov_head.markov_w2.weight"]
            .multiply(Array::from_f32(400.0))
            .unwrap();
        t.insert("markov_head.markov_w2.weight".into(), w2);
    });
    let (_, log, _) = recorded(&mut session, strong.path(), &prompt, None);
    assert_ne!(log, reference, "a strong Markov head changed no proposal");
}

/// The error a checkpoint in `ck` gives when opened for the target.
fn open_error(model: &dyn LanguageModel, ck: &Path) -> String {
    match DsparkSource::open(ck, model, None, Forks::default()) {
        Ok(_) => panic!("{} loaded but should have been refused", ck.display()),
        Err(e) => e.to_string(),
    }
}

fn edit_json(ck: &Path, f: impl FnOnce(&mut Value)) {
    let path = ck.join("dspark.json");
    let mut v: Value = serde_json::from_str(&std::fs::read_to_string(&path).unwrap()).unwrap();
    f(&mut v);
    std::fs::write(&path, v.to_string()).unwrap();
}

fn edit_tensors(ck: &Path, f: impl FnOnce(&mut HashMap<String, Array>)) {
    let path = ck.join("model.safetensors");
    let mut t = Array::load_safetensors(&path).unwrap();
    f(&mut t);
    Array::save_safetensors(t.iter(), None, &path).unwrap();
}

#[test]
fn loader_refuses_malformed_checkpoints() {
    let dir = target(&common::tiny_llama(json!({})));
    let loaded = models::load(dir.path(), Forks::default()).unwrap();
    let model = loaded.model.as_ref();
    let fresh = || drafter(dir.path(), &opts(SeqHead::Markov), |_, _| {});
    // Config fields set to values that do not fit, and what the error must mention.
    let fields = [
        ("variant", json!("eagle3"), "`variant` is \"eagle3\""),
        (
            "hidden_size",
            json!(128),
            "hidden size 128 but the target's is 64",
        ),
        (
            "vocab_size",
            json!(500),
            "vocabulary has 500 tokens but the target's has 384",
        ),
        (
            "target_layer_ids",
            json!([0, 3]),
            "tapped layer 3 is out of range",
        ),
        ("target_layer_ids", json!([2, 1]), "strictly increasing"),
        ("target_layer_ids", json!([-1, 1]), "negative id"),
        ("num_target_layers", json!(36), "target with 36 layers"),
        ("mask_token_id", json!(384), "`mask_token_id` 384"),
        (
            "thresholds",
            json!([0.1, 0.2]),
            "`thresholds` has 2 entries",
        ),
        ("lookup_tokens", json!(0), "`lookup_tokens` is 0"),
    ];
    for (field, value, expect) in fields {
        let ck = fresh();
        edit_json(ck.path(), |v| v[field] = value.clone());
        let err = open_error(model, ck.path());
        assert!(
            err.contains(expect),
            "{field} = {value}: got `{err}`, expected `{expect}`"
        );
        assert!(!err.contains('\n'), "{field}: not one sentence: {err}");
    }
    type Breaker = Box<dyn Fn(&Path)>;
    let cases: Vec<(&str, Breaker, &str)> = vec![
        (
            "missing field",
            Box::new(|p| {
                edit_json(p, |v| {
                    v.as_object_mut().unwrap().remove("block_size");
                })
            }),
            "block_size",
        ),
        (
            "bad json",
            Box::new(|p| std::fs::write(p.join("dspark.json"), "{ nope").unwrap()),
            "not valid JSON",
        ),
        (
            "missing tensor",
            Box::new(|p| {
                edit_tensors(p, |t| {
                    t.remove("fc.weight");
                })
            }),
            "tensor `fc.weight` is missing",
        ),
        (
            "mis-shaped tensor",
            Box::new(|p| {
                edit_tensors(p, |t| {
                    t.insert("norm.weight".into(), ops::ones::<f32>(&[65]).unwrap());
                })
            }),
            "tensor `norm.weight` has shape [65]",
        ),
        (
            "unknown architecture",
            Box::new(|p| {
                std::fs::remove_file(p.join("dspark.json")).unwrap();
                std::fs::write(
                    p.join("config.json"),
                    json!({"architectures": ["Qwen3Eagle3Model"]}).to_string(),
                )
                .unwrap();
            }),
            "architectures[0] is \"Qwen3Eagle3Model\"",
        ),
        (
            "not a checkpoint",
            Box::new(|p| std::fs::remove_file(p.join("dspark.json")).unwrap()),
            "is not a DSpark checkpoint",
        ),
    ];
    for (what, break_it, expect) in cases {
        let ck = fresh();
        break_it(ck.path());
        let err = open_error(model, ck.path());
        assert!(
            err.contains(expect),
            "{what}: got `{err}`, expected it to mention `{expect}`"
        );
        assert!(!err.contains('\n'), "{what}: not one sentence: {err}");
    }
    // The command line turns it into one line and exit code 2.
    let ck = fresh();
    edit_json(ck.path(), |v| v["hidden_size"] = json!(128));
    let (code, _, stderr) = common::run_mlxb(&[
        "generate",
        "--model",
        dir.path().to_str().unwrap(),
        "--prompt",
        "hi",
        "--max-tokens",
        "4",
        "--drafter",
        ck.path().to_str().unwrap(),
    ]);
    common::assert_refused(
        "a drafter that does not fit",
        code,
        &stderr,
        &["mlxb dspark-init"],
    );
}

fn rand(shape: &[i32], seed: u64, std: f32) -> Array {
    let key = random::key(seed).unwrap();
    random::normal::<f32>(shape, 0.0, std, &key).unwrap()
}

/// Writes a DeepSpec-format checkpoint (`config.json` + `model.safetensors`) with random
/// weights from the documented tensor list (dspark-spec.md §5.2).
fn deepspec_checkpoint(target_config: &Value, extra: Value, gemma: bool) -> tempfile::TempDir {
    let mut c = target_config.clone();
    let o = c.as_object_mut().unwrap();
    o.extend(extra.as_object().unwrap().clone());
    let (d, v, r, layers) = (64, 384, 32, 2);
    let heads = c["num_attention_heads"].as_i64().unwrap() as i32;
    let hd = c
        .get("global_head_dim")
        .or(c.get("head_dim"))
        .and_then(Value::as_i64)
        .unwrap() as i32;
    let k_eq_v = c
        .get("attention_k_eq_v")
        .and_then(Value::as_bool)
        .unwrap_or(false);
    let kv_heads = if k_eq_v {
        c["num_global_key_value_heads"].as_i64().unwrap() as i32
    } else {
        c["num_key_value_heads"].as_i64().unwrap() as i32
    };
    let inter = c["intermediate_size"].as_i64().unwrap() as i32;
    let m = c["target_layer_ids"].as_array().unwrap().len() as i32;
    let mut t: Vec<(String, Vec<i32>)> = vec![
        ("embed_tokens.weight".into(), vec![v, d]),
        ("lm_head.weight".into(), vec![v, d]),
        ("fc.weight".into(), vec![d, m * d]),
        ("markov_head.markov_w1.weight".into(), vec![v, r]),
        ("markov_head.markov_w2.weight".into(), vec![v, r]),
        (
            "markov_head.joint_proj.weight".into(),
            vec![3 * r, 2 * r + d],
        ),
        ("confidence_head.proj.weight".into(), vec![1, d + r]),
    ];
    let mut ones = vec!["hidden_norm.weight".to_owned(), "norm.weight".to_owned()];
    for i in 0..layers {
        let p = format!("layers.{i}");
        t.push((format!("{p}.self_attn.q_proj.weight"), vec![heads * hd, d]));
        t.push((
            format!("{p}.self_attn.k_proj.weight"),
            vec![kv_heads * hd, d],
        ));
        if !k_eq_v {
            t.push((
                format!("{p}.self_attn.v_proj.weight"),
                vec![kv_heads * hd, d],
            ));
        }
        t.push((format!("{p}.self_attn.o_proj.weight"), vec![d, heads * hd]));
        t.push((format!("{p}.mlp.gate_proj.weight"), vec![inter, d]));
        t.push((format!("{p}.mlp.up_proj.weight"), vec![inter, d]));
        t.push((format!("{p}.mlp.down_proj.weight"), vec![d, inter]));
        for n in ["input_layernorm", "post_attention_layernorm"] {
            ones.push(format!("{p}.{n}.weight"));
        }
        if gemma {
            for n in ["pre_feedforward_layernorm", "post_feedforward_layernorm"] {
                ones.push(format!("{p}.{n}.weight"));
            }
        }
    }
    let mut tensors: HashMap<String, Array> = t
        .iter()
        .enumerate()
        .map(|(i, (n, s))| (n.clone(), rand(s, 100 + i as u64, 0.05)))
        .collect();
    for n in ones {
        tensors.insert(n, ops::ones::<f32>(&[d]).unwrap());
    }
    for i in 0..layers {
        let p = format!("layers.{i}.self_attn");
        tensors.insert(
            format!("{p}.q_norm.weight"),
            ops::ones::<f32>(&[hd]).unwrap(),
        );
        tensors.insert(
            format!("{p}.k_norm.weight"),
            ops::ones::<f32>(&[hd]).unwrap(),
        );
        if gemma {
            tensors.insert(
                format!("layers.{i}.layer_scalar"),
                Array::from_slice(&[0.9f32], &[1]),
            );
        }
    }
    tensors.insert(
        "markov_head.joint_proj.bias".into(),
        rand(&[3 * r], 7, 0.05),
    );
    tensors.insert(
        "confidence_head.proj.bias".into(),
        Array::from_slice(&[0.1f32], &[1]),
    );
    let dir = tempfile::tempdir().unwrap();
    std::fs::write(dir.path().join("config.json"), c.to_string()).unwrap();
    Array::save_safetensors(tensors.iter(), None, dir.path().join("model.safetensors")).unwrap();
    dir
}

/// Opens a DeepSpec checkpoint through `--draft-model` detection and generates with it.
fn deepspec_drafts(target_config: &Value, extra: Value, gemma: bool) {
    let dir = target(target_config);
    let ck = deepspec_checkpoint(target_config, extra, gemma);
    assert!(checkpoint::is_artifact(ck.path()));
    let (config, format) = checkpoint::read_config(ck.path()).unwrap();
    assert_eq!(format, checkpoint::Format::DeepSpec);
    assert_eq!(config.seq_head, SeqHead::Rnn);
    let prompt = prompt(384);
    let want = oracle_ids(dir.path(), &prompt);
    let mut session = Session::open(dir.path(), Forks::default()).unwrap();
    let source = open_source(
        &spec_options(DraftKind::Model, ck.path(), None),
        &session,
        Forks::default(),
        2048,
    )
    .unwrap();
    assert_eq!(source.name(), "dspark");
    let (got, m) = common::greedy_ids(session.model.model.as_mut(), &prompt, Some(source), 3, GEN);
    let m = m.unwrap();
    assert_eq!(got, want);
    // --num-draft-tokens 3 is pinned to the checkpoint's block_size 4.
    assert!(
        m.drafts > 5 && m.accepted_per_position.len() == 4,
        "{:?}",
        m.to_json()
    );
}

#[test]
fn deepspec_qwen3_checkpoint_loads_and_drafts() {
    deepspec_drafts(
        &common::tiny_qwen3(json!({})),
        json!({
            "architectures": ["Qwen3DSparkModel"], "num_target_layers": 4, "num_hidden_layers": 2,
            "block_size": 4, "tie_word_embeddings": false, "layer_types": ["full_attention", "full_attention"],
            "mask_token_id": 383, "target_layer_ids": [0, 1, 2], "num_anchors": 512,
            "enable_confidence_head": true, "confidence_head_with_markov": true,
            "markov_rank": 32, "markov_head_type": "rnn"
        }),
        false,
    );
}

#[test]
fn deepspec_gemma4_checkpoint_loads_and_drafts() {
    deepspec_drafts(
        &common::tiny_gemma3(),
        json!({
            "architectures": ["Gemma4DSparkModel"], "model_type": "gemma4_text",
            "target_model_type": "gemma3_text", "num_target_layers": 4, "num_hidden_layers": 2,
            "block_size": 4, "tie_word_embeddings": false, "mask_token_id": 4,
            "target_layer_ids": [0, 2], "markov_rank": 32, "markov_head_type": "rnn",
            "global_head_dim": 64, "attention_k_eq_v": true, "num_global_key_value_heads": 1,
            "final_logit_softcapping": 30.0,
            "rope_parameters": {"full_attention": {"partial_rotary_factor": 0.25, "rope_theta": 1000000.0, "rope_type": "proportional"}}
        }),
        true,
    );
}

/// One drafter forward (two blocks: the second after appending context rows to the cached
/// context) against tests/oracle/dspark_ref.py's numpy float64 re-computation from the spec's
/// equations. Tolerance: 1e-4 absolute on hidden states, logits and confidence logits of
/// magnitude ~1 (float32 vs float64); tokens exactly.
#[test]
fn one_forward_matches_the_spec_reference() {
    let dir = target(&common::tiny_llama(json!({"tie_word_embeddings": false})));
    let prompt = prompt(384);
    for head in [SeqHead::Markov, SeqHead::Rnn, SeqHead::Gated] {
        let ck = drafter(dir.path(), &opts(head), |_, t| {
            // Make the heads matter: W2 large enough to move the argmax.
            let w2 = t["markov_head.markov_w2.weight"]
                .multiply(Array::from_f32(20.0))
                .unwrap();
            t.insert("markov_head.markov_w2.weight".into(), w2);
            // And the RNN's state: a joint projection large enough that it moves the bias.
            if let Some(j) = t.get("markov_head.joint_proj.weight") {
                let j = j.multiply(Array::from_f32(20.0)).unwrap();
                t.insert("markov_head.joint_proj.weight".into(), j);
            }
        });
        let mut loaded = models::load(dir.path(), Forks::default()).unwrap();
        let model = loaded.model.as_mut();
        let mut c = checkpoint::load(ck.path()).unwrap();
        let mut module = DsparkModule::build(&c.config, &mut c.weights, true).unwrap();
        let ids: Vec<i32> = prompt.iter().map(|&t| t as i32).collect();
        let mut tcaches = model.make_caches();
        let fwd = ForwardOpts {
            exit_after: None,
            taps: vec![0, 1, 2],
        };
        let out = model
            .forward_ext(
                &Array::from_slice(&ids, &[1, ids.len() as i32]),
                &mut tcaches,
                &fwd,
            )
            .unwrap();
        let taps = ops::concatenate(&out.taps, -1).unwrap();
        let mut caches = module.new_caches();
        let steps = [8usize, 13];
        let mut mine = HashMap::new();
        let mut done = 0;
        for (i, &n) in steps.iter().enumerate() {
            let rows = taps.index((.., done as i32..n as i32, ..));
            let f = module.context_features(&rows).unwrap();
            module.extend_context(&f, &mut caches).unwrap();
            done = n;
            let anchor = prompt[n];
            let b = module.block(&*model, anchor, &mut caches).unwrap();
            let s = module.sample(&b, anchor, 0.0).unwrap();
            let conf = s.confidence.unwrap();
            eval([&b.hidden, &b.base_logits, &s.logits, &s.tokens, &conf]).unwrap();
            // The drafter's greedy path samples on the host: held to the same reference.
            let host = module.sample_greedy_on_host(&b, anchor).unwrap().unwrap();
            let host_tokens: Vec<i32> = host.tokens.iter().map(|&t| t as i32).collect();
            let n = host_tokens.len() as i32;
            mine.insert(
                format!("step{i}.host_tokens"),
                Array::from_slice(&host_tokens, &[n]),
            );
            mine.insert(
                format!("step{i}.host_confidence"),
                Array::from_slice(&host.confidence, &[n]),
            );
            mine.insert(format!("step{i}.hidden"), b.hidden);
            mine.insert(format!("step{i}.base_logits"), b.base_logits);
            mine.insert(format!("step{i}.logits"), s.logits);
            mine.insert(format!("step{i}.confidence"), conf);
            mine.insert(
                format!("step{i}.tokens"),
                s.tokens.as_dtype(mlx_rs::Dtype::Int32).unwrap(),
            );
        }
        let tmp = tempfile::tempdir().unwrap();
        let req = tmp.path().join("req.json");
        let res = tmp.path().join("out.safetensors");
        let steps_json: Vec<Value> = steps.iter().map(|n| json!({"context": n})).collect();
        std::fs::write(
            &req,
            json!({"target": dir.path(), "drafter": ck.path(), "prompt_ids": prompt, "steps": steps_json}).to_string(),
        )
        .unwrap();
        common::run_python(
            &common::root().join("tests/oracle/dspark_ref.py"),
            &[req.to_str().unwrap(), res.to_str().unwrap()],
        );
        let theirs = Array::load_safetensors(&res).unwrap();
        for (name, a) in &mine {
            let b = &theirs[&name.replace("host_", "")];
            assert_eq!(a.shape(), b.shape(), "{head:?} {name}");
            if name.ends_with("tokens") {
                assert_eq!(a.as_slice::<i32>(), b.as_slice::<i32>(), "{head:?} {name}");
                continue;
            }
            let diff = a
                .subtract(b)
                .unwrap()
                .abs()
                .unwrap()
                .max(None)
                .unwrap()
                .item_cast::<f32>();
            eprintln!("{head:?} {name}: max |mlxb - reference| = {diff:.2e}");
            assert!(diff <= 1e-4, "{head:?} {name}: max |diff| {diff}");
        }
    }
}

/// `mlxb dspark-init` writes a drafter `mlxb generate --drafter` serves losslessly; the global
/// threshold comes from `--dspark-min-conf` or `MLXB_DSPARK_MINCONF`; bad values are refused.
#[test]
fn cli_init_and_generate() {
    let dir = target(&common::tiny_llama(json!({})));
    let ck = tempfile::tempdir().unwrap();
    let (m, c) = (dir.path().to_str().unwrap(), ck.path().to_str().unwrap());
    let init_args = common::dspark_init_args(m, c, &["--tap-layers", "0,2", "--seq-head", "gated"]);
    let (code, _, err) = common::run_mlxb_json(&init_args, &[]);
    assert_eq!(code, 0, "{err}");
    let (config, _) = checkpoint::read_config(ck.path()).unwrap();
    assert_eq!((config.block_size, config.seq_head), (4, SeqHead::Gated));
    assert_eq!(config.target_layer_ids, vec![0, 2]);
    let (code, _, err) = common::run_mlxb_json(&init_args, &[]);
    assert_eq!(
        code, 2,
        "an existing checkpoint was overwritten without --force: {err}"
    );

    let gen = [
        "generate",
        "--model",
        m,
        "--prompt",
        "The quick brown fox",
        "--max-tokens",
        "24",
        "--json",
    ];
    let (code, plain, err) = common::run_mlxb_json(&gen, &[]);
    assert_eq!(code, 0, "{err}");
    let mut with = gen.to_vec();
    with.extend(["--drafter", c]);
    let (code, spec, err) = common::run_mlxb_json(&with, &[]);
    assert_eq!(code, 0, "{err}");
    assert_eq!(spec["token_ids"], plain["token_ids"]);
    assert_eq!(spec["speculative"]["drafter"], "dspark");
    let full = spec["speculative"]["drafted_tokens"].as_u64().unwrap();
    let (_, env, err) = common::run_mlxb_json(&with, &[("MLXB_DSPARK_MINCONF", "0.6")]);
    assert_eq!(env["token_ids"], plain["token_ids"], "{err}");
    let pruned = env["speculative"]["drafted_tokens"].as_u64().unwrap();
    assert!(
        pruned < full,
        "MLXB_DSPARK_MINCONF did not prune: {pruned} vs {full}"
    );
    let mut flag = with.clone();
    flag.extend(["--dspark-min-conf", "0.6"]);
    let (_, by_flag, _) = common::run_mlxb_json(&flag, &[("MLXB_DSPARK_MINCONF", "0")]);
    assert_eq!(
        common::spec_counters(&by_flag["speculative"]),
        common::spec_counters(&env["speculative"]),
        "the flag must override the variable"
    );
    let mut bad_flag = with.clone();
    bad_flag.extend(["--dspark-min-conf", "1.5"]);
    for (args, env) in [(bad_flag, "0"), (with.clone(), "lots")] {
        let (code, _, err) = common::run_mlxb_json(&args, &[("MLXB_DSPARK_MINCONF", env)]);
        common::assert_refused(
            &format!("{args:?} with MLXB_DSPARK_MINCONF={env}"),
            code,
            &err,
            &[],
        );
    }

    // A checkpoint's `lookup_first` puts a lookup in front of it unless `--lookup-first` says
    // otherwise; the output stays the target's.
    edit_json(ck.path(), |v| v["lookup_first"] = json!(1));
    let (code, looked, err) = common::run_mlxb_json(&with, &[]);
    assert_eq!(code, 0, "{err}");
    assert_eq!(looked["token_ids"], plain["token_ids"]);
    assert_eq!(looked["speculative"]["drafter"], "lookup+dspark");
    let mut off = with.clone();
    off.extend(["--lookup-first", "0"]);
    let (_, alone, _) = common::run_mlxb_json(&off, &[]);
    assert_eq!(alone["speculative"]["drafter"], "dspark");
    assert_eq!(
        common::spec_counters(&alone["speculative"]),
        common::spec_counters(&spec["speculative"])
    );

    // Its `lookup_tokens` caps what the lookup proposes (`--lookup-tokens` the same way). With
    // a table of the target's own reply the lookup would propose whole blocks; every round
    // drafts (`--draft-policy all`), so that runs compare round for round.
    let long: Vec<&str> = gen
        .iter()
        .map(|a| if *a == "24" { "96" } else { a })
        .chain(["--drafter", c, "--draft-policy", "all"])
        .collect();
    let (_, plain, _) = common::run_mlxb_json(&long[..long.len() - 4], &[]);
    let ids = |key: &str| -> Vec<u64> {
        plain[key]
            .as_array()
            .unwrap()
            .iter()
            .map(|t| t.as_u64().unwrap())
            .collect()
    };
    let (prompt_ids, reply) = (ids("prompt_token_ids"), ids("token_ids"));
    let lines: Vec<String> = (0..4)
        .map(|j| {
            json!({"prompt": j, "prompt_sha256": "x", "reply_from": prompt_ids.len(),
                "ids": prompt_ids.iter().chain(&reply).collect::<Vec<_>>()})
            .to_string()
        })
        .collect();
    let seqs = ck.path().join("sequences.jsonl");
    let header = json!({"mlxb_sequences": 1, "vocab_size": 384});
    std::fs::write(&seqs, format!("{header}\n{}\n", lines.join("\n"))).unwrap();
    let table = ck.path().join("own-reply.safetensors");
    let (s, t) = (seqs.to_str().unwrap(), table.to_str().unwrap());
    let (code, _, err) =
        common::run_mlxb_json(&["lookup-table", "--sequences", s, "--out", t], &[]);
    assert_eq!(code, 0, "{err}");
    let with: Vec<&str> = long.iter().copied().chain(["--lookup-table", t]).collect();
    let run = |args: &[&str]| {
        let (code, v, err) = common::run_mlxb_json(args, &[]);
        assert_eq!(code, 0, "{err}");
        assert_eq!(v["token_ids"], plain["token_ids"], "{args:?}");
        v["speculative"].clone()
    };
    let looked = run(&with);
    edit_json(ck.path(), |v| v["lookup_tokens"] = json!(1));
    let capped = run(&with);
    let drafted = |v: &Value| v["drafted_tokens"].as_u64().unwrap();
    assert!(
        drafted(&capped) < drafted(&looked),
        "lookup_tokens 1 drafted {} tokens, uncapped {}",
        drafted(&capped),
        drafted(&looked)
    );
    edit_json(ck.path(), |v| {
        v.as_object_mut().unwrap().remove("lookup_tokens");
    });
    let flagged = run(&[&with[..], &["--lookup-tokens", "1"]].concat());
    assert_eq!(
        common::spec_counters(&flagged),
        common::spec_counters(&capped)
    );

    // A `lookup.safetensors` beside the weights is the lookup's own table: one that is not a
    // table is refused by name, and `--lookup-table none` leaves it out.
    let untabled = run(&long);
    std::fs::write(ck.path().join("lookup.safetensors"), b"not a table").unwrap();
    let (code, _, err) = common::run_mlxb_json(&long, &[]);
    common::assert_refused(
        "a damaged lookup.safetensors",
        code,
        &err,
        &["lookup.safetensors"],
    );
    let none = run(&[&long[..], &["--lookup-table", "none"]].concat());
    assert_eq!(
        common::spec_counters(&none),
        common::spec_counters(&untabled)
    );
    std::fs::copy(&table, ck.path().join("lookup.safetensors")).unwrap();
    assert_eq!(
        common::spec_counters(&run(&long)),
        common::spec_counters(&looked)
    );
    std::fs::remove_file(ck.path().join("lookup.safetensors")).unwrap();
}

/// With `--spec-verify reject` at T > 0 the drafter samples its proposals at the target's
/// temperature and hands over their distributions; generation runs to the end.
#[test]
fn rejection_sampling_with_sampled_proposals_runs() {
    use mlxb::engine::generate::{Flow, GenerateConfig, Generator};
    use mlxb::engine::sample::{self, LogitsProcessors, ProcessorConfig, Sampler, SamplerConfig};
    use mlxb::spec::executor::Speculation;
    let dir = target(&common::tiny_llama(json!({})));
    let ck = drafter(dir.path(), &opts(SeqHead::Rnn), |_, _| {});
    let mut loaded = models::load(dir.path(), Forks::default()).unwrap();
    let source =
        DsparkSource::open(ck.path(), loaded.model.as_ref(), None, Forks::default()).unwrap();
    sample::seed(3).unwrap();
    let mut sampler = Sampler::new(&SamplerConfig {
        temp: 1.0,
        ..Default::default()
    })
    .unwrap();
    let mut processors = LogitsProcessors::new(&ProcessorConfig::default()).unwrap();
    let mut spec = Speculation::new(Box::new(source), 3, VerifyMode::Reject);
    let g = Generator::new(loaded.model.as_mut(), &mut sampler, &mut processors)
        .with_speculation(&mut spec);
    let mut n = 0;
    let cfg = GenerateConfig {
        max_tokens: GEN,
        prefill_step_size: 2048,
    };
    g.run(&prompt(384), &cfg, |_| {
        n += 1;
        Ok(Flow::Continue)
    })
    .unwrap();
    let m = spec.metrics;
    assert_eq!(n, GEN);
    assert!(
        m.drafts > 5 && m.accepted_per_position.len() == 5,
        "{:?}",
        m.to_json()
    );
}

/// A speculators-format draft vocabulary of `ids` (ascending target ids): `d2t` offsets and the
/// `t2d` mask over the tiny targets' 384 ids.
fn with_draft_vocab(t: &mut HashMap<String, Array>, ids: &[i64]) {
    let offsets: Vec<i64> = ids.iter().enumerate().map(|(i, &t)| t - i as i64).collect();
    t.insert(
        "d2t".into(),
        Array::from_slice(&offsets, &[offsets.len() as i32]),
    );
    let mut marks = vec![false; 384];
    for &id in ids {
        if let Some(m) = marks.get_mut(id as usize) {
            *m = true;
        }
    }
    t.insert("t2d".into(), Array::from_slice(&marks, &[384]));
}

/// A reduced draft vocabulary only narrows what can be proposed: covering every id it drafts
/// exactly what the full drafter drafts, round by round; covering the even ids it proposes
/// only even ids; output equals vanilla greedy decoding either way, and sampled proposals
/// (rejection rule, distributions spread back onto the target's ids) run to the end.
/// Malformed maps are refused with one sentence.
#[test]
fn reduced_draft_vocabulary_is_draft_side_only() {
    let dir = target(&common::tiny_llama(json!({})));
    let prompt = prompt(384);
    let mut session = Session::open(dir.path(), Forks::default()).unwrap();
    let (vanilla, _) = common::greedy_ids(session.model.model.as_mut(), &prompt, None, 3, GEN);
    let full = drafter(dir.path(), &opts(SeqHead::Rnn), |_, _| {});
    let all: Vec<i64> = (0..384).collect();
    let whole = drafter(dir.path(), &opts(SeqHead::Rnn), |_, t| {
        with_draft_vocab(t, &all)
    });
    let even: Vec<i64> = (0..384).step_by(2).collect();
    let half = drafter(dir.path(), &opts(SeqHead::Rnn), |_, t| {
        with_draft_vocab(t, &even)
    });
    let (full_ids, full_log, _) = recorded(&mut session, full.path(), &prompt, None);
    let (whole_ids, whole_log, _) = recorded(&mut session, whole.path(), &prompt, None);
    let (half_ids, half_log, m) = recorded(&mut session, half.path(), &prompt, None);
    assert_eq!(full_ids, vanilla);
    assert_eq!(whole_ids, vanilla);
    assert_eq!(half_ids, vanilla, "a reduced vocabulary changed the output");
    assert_eq!(
        whole_log, full_log,
        "the whole vocabulary drafted otherwise"
    );
    assert!(m.drafts > 5, "{:?}", m.to_json());
    assert!(
        half_log.iter().all(|r| r.block.iter().all(|t| t % 2 == 0)),
        "an odd id was drafted: {half_log:?}"
    );

    {
        use mlxb::engine::generate::{Flow, GenerateConfig, Generator};
        use mlxb::engine::sample::{self, LogitsProcessors, ProcessorConfig, Sampler};
        use mlxb::spec::executor::Speculation;
        let model = session.model.model.as_mut();
        let source = DsparkSource::open(half.path(), &*model, None, Forks::default()).unwrap();
        sample::seed(3).unwrap();
        let mut sampler = Sampler::new(&mlxb::engine::sample::SamplerConfig {
            temp: 1.0,
            ..Default::default()
        })
        .unwrap();
        let mut processors = LogitsProcessors::new(&ProcessorConfig::default()).unwrap();
        let mut spec = Speculation::new(Box::new(source), 3, VerifyMode::Reject);
        let g = Generator::new(model, &mut sampler, &mut processors).with_speculation(&mut spec);
        let mut n = 0;
        let cfg = GenerateConfig {
            max_tokens: GEN,
            prefill_step_size: 2048,
        };
        g.run(&prompt, &cfg, |_| {
            n += 1;
            Ok(Flow::Continue)
        })
        .unwrap();
        assert_eq!(n, GEN);
        assert!(spec.metrics.drafts > 5, "{:?}", spec.metrics.to_json());
    }

    let model = session.model.model.as_ref();
    let refused = |edit: &dyn Fn(&mut HashMap<String, Array>), needle: &str| {
        let ck = drafter(dir.path(), &opts(SeqHead::Rnn), |_, t| edit(t));
        let e = open_error(model, ck.path());
        assert!(e.contains(needle), "{needle}: {e}");
    };
    refused(&|t| with_draft_vocab(t, &[5, 3]), "ascend");
    refused(&|t| with_draft_vocab(t, &[0, 384]), "ascend");
    refused(
        &|t| {
            with_draft_vocab(t, &[1, 2]);
            t.insert("t2d".into(), Array::from_slice(&[true; 384], &[384]));
        },
        "disagree",
    );
    refused(
        &|t| {
            t.insert("t2d".into(), Array::from_slice(&[true; 384], &[384]));
        },
        "without `d2t`",
    );
}

/// Greedy rounds on the host kernels draft what the MLX graphs draft: a drafter with a head
/// over draft ids (here the whole vocabulary), its weights f32 or bfloat16 values, proposes the
/// same blocks round by round either way, every round of the first on the host and none of the
/// second, and the output equals vanilla greedy decoding.
#[test]
fn host_block_drafts_what_mlx_drafts() {
    let dir = target(&common::tiny_llama(json!({})));
    let prompt = prompt(384);
    let mut session = Session::open(dir.path(), Forks::default()).unwrap();
    let (vanilla, _) = common::greedy_ids(session.model.model.as_mut(), &prompt, None, 3, GEN);
    let all: Vec<i64> = (0..384).collect();
    for bf16 in [false, true] {
        let ck = drafter(dir.path(), &opts(SeqHead::Rnn), |_, t| {
            with_draft_vocab(t, &all);
            if bf16 {
                for v in t.values_mut() {
                    if v.dtype() == mlx_rs::Dtype::Float32 {
                        *v = v.as_dtype(mlx_rs::Dtype::Bfloat16).unwrap();
                    }
                }
            }
        });
        let what = if bf16 { "bf16" } else { "f32" };
        let model = session.model.model.as_ref();
        let open = |host: bool| {
            DsparkSource::open(ck.path(), model, None, Forks::default())
                .unwrap()
                .with_host_block(host)
        };
        let (host, mlx) = (open(true), open(false));
        let (host_ids, host_log, m, hosted) = recorded_with(&mut session, host, &prompt);
        let (mlx_ids, mlx_log, _, on_mlx_hosted) = recorded_with(&mut session, mlx, &prompt);
        assert_eq!(
            host_ids, vanilla,
            "{what}: the host block changed the output"
        );
        assert_eq!(mlx_ids, vanilla, "{what}");
        assert!(m.drafts > 5, "{what}: {:?}", m.to_json());
        assert_eq!(hosted, host_log.len(), "{what}: a round left the host");
        assert_eq!(on_mlx_hosted, 0, "{what}: a round took the host kernels");
        assert_eq!(
            host_log, mlx_log,
            "{what}: the host block drafted otherwise"
        );
    }
}

/// Behind a lookup, the drafter drafts only the rounds the lookup finds no copy for, and drafts
/// them as it would have alone: every block it drafts at an anchor the drafter alone also
/// drafted at is the same block (the context rows of the rounds it skipped are taken in at its
/// next round), on the host kernels and on MLX. The output equals vanilla greedy decoding.
#[test]
fn a_lookup_in_front_leaves_the_drafters_own_rounds_unchanged() {
    let dir = target(&common::tiny_llama(json!({})));
    let prompt = prompt(384);
    let mut session = Session::open(dir.path(), Forks::default()).unwrap();
    // Long enough for the lookup to miss often: its misses leave rows the drafter must drop.
    const LONG: usize = 160;
    let (vanilla, _) = common::greedy_ids(session.model.model.as_mut(), &prompt, None, 3, LONG);
    // A head over draft ids (the whole vocabulary), so that greedy rounds can take the host form.
    let all: Vec<i64> = (0..384).collect();
    let ck = drafter(dir.path(), &opts(SeqHead::Rnn), |_, t| {
        with_draft_vocab(t, &all)
    });
    for host in [true, false] {
        let open = |session: &Session| {
            DsparkSource::open(
                ck.path(),
                session.model.model.as_ref(),
                None,
                Forks::default(),
            )
            .unwrap()
            .with_host_block(host)
        };
        let alone = open(&session);
        let (alone_ids, alone_log, _, _) =
            recorded_behind(&mut session, alone, &prompt, None, LONG);
        let behind = open(&session);
        let (ids, log, m, hosted) =
            recorded_behind(&mut session, behind, &prompt, Some((2, 3)), LONG);
        assert_eq!(hosted, if host { log.len() } else { 0 }, "host {host}");
        assert_eq!(alone_ids, vanilla, "host {host}");
        assert_eq!(ids, vanilla, "host {host}: the lookup changed the output");
        assert_eq!(m.drafter, "lookup+dspark");
        assert!(
            !log.is_empty() && m.drafts > log.len(),
            "host {host}: both the lookup and the drafter must propose ({} drafter rounds): {:?}",
            log.len(),
            m.to_json()
        );
        // Shared anchors, and how many of them follow rounds the drafter skipped (its previous
        // round cannot have moved the sequence that far).
        let (mut shared, mut after_skips) = (0, 0);
        for (i, r) in log.iter().enumerate() {
            if let Some(a) = alone_log.iter().find(|a| a.anchor == r.anchor) {
                assert_eq!(
                    (&r.block, &r.proposed),
                    (&a.block, &a.proposed),
                    "host {host}: anchor {} drafted otherwise behind the lookup",
                    r.anchor
                );
                // The confidences too, which read the context rows more finely than the tokens
                // (within rounding: rows taken in several at a time sum in another order).
                let off = r
                    .confidence
                    .iter()
                    .zip(&a.confidence)
                    .map(|(x, y)| (x - y).abs())
                    .fold(0.0, f64::max);
                assert!(
                    off < 1e-5,
                    "host {host}: anchor {}: confidences off by {off:e} behind the lookup",
                    r.anchor
                );
                shared += 1;
                let skipped = i > 0 && r.anchor > log[i - 1].anchor + log[i - 1].proposed.len() + 1;
                after_skips += usize::from(skipped);
            }
        }
        assert!(
            shared >= 5 && after_skips >= 1,
            "host {host}: {shared} shared anchors, {after_skips} after skipped rounds"
        );
    }
}

/// On a quantized target (tied and untied heads), the restricted head is read from the
/// target's own rows, dequantized: the drafter proposes only its ids and the output equals
/// vanilla greedy decoding.
#[test]
fn reduced_draft_vocabulary_on_a_quantized_target() {
    for tied in [true, false] {
        let dir = tempfile::tempdir().unwrap();
        common::make_model(
            dir.path(),
            &common::tiny_llama(json!({"tie_word_embeddings": tied})),
            "f32",
            Some(4),
        );
        let prompt = prompt(384);
        let mut session = Session::open(dir.path(), Forks::default()).unwrap();
        let (vanilla, _) = common::greedy_ids(session.model.model.as_mut(), &prompt, None, 3, GEN);
        let even: Vec<i64> = (0..384).step_by(2).collect();
        let half = drafter(dir.path(), &opts(SeqHead::Markov), |_, t| {
            with_draft_vocab(t, &even)
        });
        let (ids, log, m) = recorded(&mut session, half.path(), &prompt, None);
        assert_eq!(ids, vanilla, "tied {tied}: the output changed");
        assert!(m.drafts > 5, "{:?}", m.to_json());
        assert!(
            log.iter().all(|r| r.block.iter().all(|t| t % 2 == 0)),
            "tied {tied}: an odd id was drafted"
        );
    }
}

/// `mlxb dspark-vocab` keeps the most frequent reply tokens of a sequences file (prompt tokens
/// not counted, ties to the lower id) as `d2t`/`t2d`; the drafter then proposes only those and
/// output is unchanged. Bad input exits 2 and leaves the weights as they were.
#[test]
fn dspark_vocab_keeps_the_most_frequent_reply_tokens() {
    let dir = target(&common::tiny_llama(json!({})));
    let prompt = prompt(384);
    let ck = drafter(dir.path(), &opts(SeqHead::Markov), |_, _| {});
    let tmp = tempfile::tempdir().unwrap();
    let seqs = tmp.path().join("sequences.jsonl");
    // Replies: 7 five times, 3 and 11 four times each, 200 once; the prompts' 9s do not count.
    let line = |j: usize, ids: &[u32], from: usize| {
        json!({"prompt": j, "prompt_sha256": "x", "ids": ids, "reply_from": from}).to_string()
    };
    let text = [
        json!({"mlxb_sequences": 1, "vocab_size": 384}).to_string(),
        line(0, &[9, 9, 9, 7, 7, 3, 11, 200], 3),
        line(1, &[9, 7, 7, 7, 3, 3, 3, 11, 11, 11], 1),
    ]
    .join("\n")
        + "\n";
    std::fs::write(&seqs, text).unwrap();
    let weights = ck.path().join("model.safetensors");
    let run = |seq: &Path, size: &str| {
        common::run_mlxb_json(
            &[
                "dspark-vocab",
                "--drafter",
                ck.path().to_str().unwrap(),
                "--sequences",
                seq.to_str().unwrap(),
                "--size",
                size,
                "--json",
            ],
            &[],
        )
    };
    let before = std::fs::read(&weights).unwrap();
    let (code, _, err) = run(&seqs, "0");
    common::assert_refused("--size 0", code, &err, &["--size"]);
    let not_seqs = tmp.path().join("prompts.jsonl");
    std::fs::write(&not_seqs, "{\"prompt\": \"hi\"}\n").unwrap();
    let (code, _, err) = run(&not_seqs, "3");
    common::assert_refused("a prompt file", code, &err, &["sequences header"]);
    assert_eq!(std::fs::read(&weights).unwrap(), before, "a refusal wrote");

    let (code, v, err) = run(&seqs, "3");
    assert_eq!(code, 0, "{err}");
    assert_eq!(v["draft_vocab"], 3);
    assert_eq!(v["distinct_reply_tokens"], 4);
    assert_eq!(v["reply_tokens"], 14);
    assert!(
        (v["coverage"].as_f64().unwrap() - 13.0 / 14.0).abs() < 1e-12,
        "{v}"
    );
    let t = Array::load_safetensors(&weights).unwrap();
    let d2t: Vec<i64> = t["d2t"].as_slice::<i64>().to_vec();
    let kept: Vec<i64> = d2t.iter().enumerate().map(|(i, o)| i as i64 + o).collect();
    assert_eq!(kept, vec![3, 7, 11]);
    let marks = t["t2d"].as_slice::<bool>();
    assert_eq!(marks.len(), 384);
    assert!((0..384).all(|i| marks[i] == [3, 7, 11].contains(&i)));

    let mut session = Session::open(dir.path(), Forks::default()).unwrap();
    let (vanilla, _) = common::greedy_ids(session.model.model.as_mut(), &prompt, None, 3, GEN);
    let (ids, log, _) = recorded(&mut session, ck.path(), &prompt, None);
    assert_eq!(ids, vanilla);
    assert!(log
        .iter()
        .all(|r| r.block.iter().all(|t| [3, 7, 11].contains(t))));
}
