//! DSpark training: the loss terms equal a direct numpy computation, the training forward
//! equals the inference module on the same anchor, a few AdamW steps lower the loss on a tiny
//! target, and an interrupted run resumed from its last checkpoint reproduces the
//! uninterrupted run's parameters bit for bit.

mod common;

use mlx_rs::ops::indexing::IndexOp;
use mlx_rs::transforms::eval;
use mlx_rs::{random, Array};
use mlxb::engine::forks::Forks;
use mlxb::engine::models::{self, LanguageModel};
use mlxb::spec::dspark::checkpoint::{self, DsparkConfig, SeqHead};
use mlxb::spec::dspark::module::DsparkModule;
use mlxb::train::draft_vocab::vocab_tensors;
use mlxb::train::example::{anchor_batch, extract_example, sample_anchors, Example, SplitMix};
use mlxb::train::forward::{DraftHead, Frozen, Params};
use mlxb::train::init::{init, InitOptions};
use mlxb::train::loss::{loss_sums, total_loss, LossWeights, Target, VocabMap};
use mlxb::train::optim::{AdamW, TrainOptions};
use mlxb::train::state::load_state;
use mlxb::train::trainer::{step_loss, Trainer};
use serde_json::json;
use std::collections::HashMap;
use std::path::Path;

fn rand(shape: &[i32], seed: u64, std: f32) -> Array {
    let key = random::key(seed).unwrap();
    random::normal::<f32>(shape, 0.0, std, &key).unwrap()
}

fn to_json(a: &Array) -> serde_json::Value {
    let shape = a.shape().to_vec();
    let flat: Vec<f64> = a
        .as_dtype(mlx_rs::Dtype::Float32)
        .unwrap()
        .as_slice::<f32>()
        .iter()
        .map(|&x| x as f64)
        .collect();
    json!({"shape": shape, "data": flat})
}

/// Checks the loss sums and total (with `terms`' weights) against the numpy oracle; with
/// `keep`, the drafter scores only those target ids (a reduced draft vocabulary) and the oracle
/// spreads its distribution over all.
fn check_loss_against_numpy(keep: Option<&[u32]>, terms: LossWeights) {
    let (a, g, v) = (3, 4, 11);
    let vd = keep.map_or(v, |k| k.len() as i32);
    let logits = rand(&[a, g, vd], 1, 2.0);
    let target_logits = rand(&[a, g, v], 2, 2.0);
    let conf = rand(&[a, g], 3, 1.5);
    let targets = Array::from_slice(
        &(0..a * g).map(|i| (i * 7) % v).collect::<Vec<i32>>(),
        &[a, g],
    );
    // Contiguous-prefix weights: exp(-k/4), cut after a masked slot.
    let mut w = vec![0f32; (a * g) as usize];
    for r in 0..a as usize {
        for k in 0..(g as usize - r) {
            w[r * g as usize + k] = (-(k as f32) / 4.0).exp();
        }
    }
    let weights = Array::from_slice(&w, &[a, g]);
    let map = keep.map(|k| VocabMap::new(k, v as usize));
    let target = Target::new(&target_logits, &targets, map.as_ref()).unwrap();
    let sums = loss_sums(&logits, &target, Some(&conf), &weights).unwrap();
    let total = total_loss(&sums, terms).unwrap();
    eval(sums.iter().chain([&total])).unwrap();

    let nested = |x: &Array| -> serde_json::Value {
        let j = to_json(x);
        let shape: Vec<usize> = j["shape"]
            .as_array()
            .unwrap()
            .iter()
            .map(|s| s.as_u64().unwrap() as usize)
            .collect();
        let data: Vec<f64> = j["data"]
            .as_array()
            .unwrap()
            .iter()
            .map(|x| x.as_f64().unwrap())
            .collect();
        fn build(data: &[f64], shape: &[usize]) -> serde_json::Value {
            if shape.len() == 1 {
                return json!(data);
            }
            let step = data.len() / shape[0];
            json!((0..shape[0])
                .map(|i| build(&data[i * step..(i + 1) * step], &shape[1..]))
                .collect::<Vec<_>>())
        }
        build(&data, &shape)
    };
    let tmp = tempfile::tempdir().unwrap();
    let req = tmp.path().join("req.json");
    let t: Vec<Vec<i32>> = targets
        .as_slice::<i32>()
        .chunks(g as usize)
        .map(|c| c.to_vec())
        .collect();
    std::fs::write(
        &req,
        json!({
            "logits": nested(&logits), "target_logits": nested(&target_logits),
            "conf": nested(&conf), "targets": t, "weights": nested(&weights), "keep": keep,
            "loss_weights": [terms.ce, terms.l1, terms.conf, terms.kl],
        })
        .to_string(),
    )
    .unwrap();
    let out = common::run_python(
        &common::root().join("tests/oracle/dspark_loss.py"),
        &[req.to_str().unwrap()],
    );
    let theirs: serde_json::Value = serde_json::from_str(out.trim()).unwrap();
    for (i, s) in sums.iter().enumerate() {
        let mine = s.item_cast::<f32>() as f64;
        let want = theirs["sums"][i].as_f64().unwrap();
        assert!(
            (mine - want).abs() <= 1e-4 * want.abs().max(1.0),
            "term {i}: mlxb {mine} numpy {want}"
        );
    }
    let want = theirs["total"].as_f64().unwrap();
    let mine = total.item_cast::<f32>() as f64;
    assert!(
        (mine - want).abs() <= 1e-4 * want.abs().max(1.0),
        "total: {mine} vs {want}"
    );
}

#[test]
fn loss_terms_match_numpy() {
    check_loss_against_numpy(None, LossWeights::default());
}

#[test]
fn loss_term_weights_are_applied() {
    for terms in ["1,0.25,0.5", "0.5,0,1,2"] {
        let terms: LossWeights = terms.parse().unwrap();
        check_loss_against_numpy(None, terms);
        check_loss_against_numpy(Some(&[0, 2, 3, 5, 8, 9]), terms);
    }
    for bad in [
        "1,2",
        "1,-1,1",
        "0,0,1",
        "0,0,1,0",
        "a,b,c",
        "1,1,inf",
        "1,1,1,1,1",
    ] {
        assert!(bad.parse::<LossWeights>().is_err(), "{bad} accepted");
    }
}

#[test]
fn reduced_vocabulary_loss_matches_numpy() {
    // Targets 4 and 7 (among others) fall outside: no cross-entropy there, and the target's
    // mass outside the kept ids counts in full in L1.
    check_loss_against_numpy(Some(&[0, 2, 3, 5, 8, 9]), LossWeights::default());
}

#[test]
fn anchors_and_prefix_supervision() {
    // Loss tokens at 2..=9 except 6: candidates need mask[p] and mask[p+1].
    let mask: Vec<bool> = (0..12).map(|i| (2..=9).contains(&i) && i != 6).collect();
    let mut rng = SplitMix::new(42, 0);
    let all = sample_anchors(&mask, 100, &mut rng);
    assert_eq!(all, vec![2, 3, 4, 7, 8]);
    let some = sample_anchors(&mask, 2, &mut SplitMix::new(42, 1));
    assert_eq!(some.len(), 2);
    assert!(some.windows(2).all(|w| w[0] < w[1]));
    let ex = Example {
        ids: (0..12).collect(),
        mask,
        taps: Array::from_f32(0.0),
        last_hidden: Array::from_f32(0.0),
    };
    let b = anchor_batch(&ex, &[3, 8], 4, 99);
    let w = b.weights.as_slice::<f32>().to_vec();
    // Anchor 3: slots predict 4, 5, 6(masked) -> prefix of 2. Anchor 8: 9, 10(masked) -> 1.
    let e = |k: f32| (-k / 4.0).exp();
    assert_eq!(w, vec![e(0.0), e(1.0), 0.0, 0.0, e(0.0), 0.0, 0.0, 0.0]);
    assert_eq!(
        b.block_ids.as_slice::<i32>(),
        &[3, 99, 99, 99, 8, 99, 99, 99]
    );
    assert_eq!(b.prev_ids.as_slice::<i32>(), &[3, 4, 5, 6, 8, 9, 10, 11]);
    assert_eq!(b.targets.as_slice::<i32>(), &[4, 5, 0, 0, 9, 0, 0, 0]);
}

struct Fixture {
    _dir: tempfile::TempDir,
    target: Box<dyn LanguageModel>,
    config: DsparkConfig,
    tensors: HashMap<String, Array>,
    examples: Vec<Example>,
}

fn fixture(head: SeqHead) -> Fixture {
    let dir = tempfile::tempdir().unwrap();
    common::make_model(
        dir.path(),
        &common::tiny_llama(json!({"tie_word_embeddings": false})),
        "f32",
        None,
    );
    let mut loaded = models::load(dir.path(), Forks::default()).unwrap();
    let o = InitOptions {
        seq_head: head,
        layers: 2,
        block_size: 5,
        markov_rank: 16,
        tap_layers: Some(vec![0, 1, 2]),
        std: 0.05,
        seed: 3,
        ..InitOptions::default()
    };
    let (config, tensors) =
        init(loaded.model.as_ref(), &loaded.config, dir.path(), None, &o).unwrap();
    let mut examples = Vec::new();
    for s in 0..3u32 {
        let ids = common::prompt_ids(24, 384, 11 + s);
        let mask: Vec<bool> = (0..ids.len()).map(|i| i >= 6).collect();
        examples.push(extract_example(loaded.model.as_mut(), &ids, &mask, &[0, 1, 2]).unwrap());
    }
    Fixture {
        _dir: dir,
        target: loaded.model,
        config,
        tensors,
        examples,
    }
}

fn opts(steps: u64) -> TrainOptions {
    TrainOptions {
        steps,
        batch: 2,
        anchors: 6,
        lr: 3e-3,
        checkpoint_every: 2,
        ..TrainOptions::default()
    }
}

#[test]
fn training_forward_matches_the_inference_module() {
    for head in [SeqHead::None, SeqHead::Markov, SeqHead::Gated, SeqHead::Rnn] {
        check_forward_against_module(head, None);
    }
}

#[test]
fn reduced_vocabulary_forward_matches_the_inference_module() {
    // Every third target id: the training head's rows and the inference module's restricted
    // head (read from the saved `d2t`/`t2d`) must score the same draft ids alike.
    let keep: Vec<u32> = (0..384).step_by(3).collect();
    for head in [SeqHead::None, SeqHead::Markov] {
        check_forward_against_module(head, Some(keep.clone()));
    }
}

/// The training forward's logits (and confidences) of two anchors against the inference
/// module's, on a drafter with the given head and, with `keep`, a reduced draft vocabulary.
fn check_forward_against_module(head: SeqHead, keep: Option<Vec<u32>>) {
    let mut fx = fixture(head);
    let params = Params::from_tensors(&fx.config, &fx.tensors).unwrap();
    let draft_head = keep
        .clone()
        .map(|ids| DraftHead::new(ids, fx.target.as_ref(), &fx.config).unwrap());
    if let Some(ids) = &keep {
        fx.tensors
            .extend(vocab_tensors(ids, fx.config.vocab_size).unwrap());
    }
    let frozen = Frozen::new(&fx.config, &params, fx.target.as_ref(), draft_head).unwrap();
    let ex = &fx.examples[0];
    let anchors = [7usize, 12];
    let b = anchor_batch(ex, &anchors, fx.config.block_size, fx.config.mask_token_id);
    let (z, conf) = frozen.forward(&params.values, ex, &b).unwrap();
    // The module, run the inference way on the same anchors.
    let ck = tempfile::tempdir().unwrap();
    checkpoint::save(ck.path(), &fx.config, &fx.tensors).unwrap();
    let mut c = checkpoint::load(ck.path()).unwrap();
    let mut module = DsparkModule::build(&c.config, &mut c.weights, false).unwrap();
    let taps = ex
        .taps
        .as_dtype(mlx_rs::Dtype::Float32)
        .unwrap()
        .expand_dims(0)
        .unwrap();
    for (a, &p) in anchors.iter().enumerate() {
        let mut caches = module.new_caches();
        let f = module
            .context_features(&taps.index((.., ..p as i32, ..)))
            .unwrap();
        module.extend_context(&f, &mut caches).unwrap();
        let out = module
            .block(fx.target.as_ref(), ex.ids[p], &mut caches)
            .unwrap();
        let s = module.sample(&out, ex.ids[p], 0.0).unwrap();
        // Slot 0's previous token is the anchor in both; later slots are teacher-forced in
        // training, so only the head-less logits agree there.
        let slots = if head == SeqHead::None { 5 } else { 1 };
        let mine = z.index((a as i32, ..slots));
        let theirs = s.logits.index(..slots);
        let diff = mine
            .subtract(&theirs)
            .unwrap()
            .abs()
            .unwrap()
            .max(None)
            .unwrap();
        let diff = diff.item_cast::<f32>();
        assert!(diff < 2e-4, "{head:?} anchor {p}: logits differ by {diff}");
        if let (Some(cm), Some(ct)) = (&conf, &s.confidence) {
            let d = cm
                .index((a as i32, 0))
                .subtract(ct.index(0))
                .unwrap()
                .abs()
                .unwrap();
            assert!(d.item_cast::<f32>() < 2e-4, "{head:?} confidence differs");
        }
    }
}

fn trainer<'a>(
    fx: &'a Fixture,
    frozen_params: &Params,
    out: &Path,
    o: TrainOptions,
) -> Trainer<'a> {
    let params = Params::from_tensors(&fx.config, &fx.tensors).unwrap();
    Trainer {
        frozen: Frozen::new(&fx.config, frozen_params, fx.target.as_ref(), None).unwrap(),
        opt: AdamW::new(&params).unwrap(),
        params,
        opts: o,
        out: out.to_path_buf(),
        save_dtype: mlx_rs::Dtype::Float32,
    }
}

#[test]
fn a_few_steps_lower_the_loss() {
    let fx = fixture(SeqHead::Markov);
    let p0 = Params::from_tensors(&fx.config, &fx.tensors).unwrap();
    let out = tempfile::tempdir().unwrap();
    let mut t = trainer(&fx, &p0, out.path(), opts(12));
    let all: Vec<&Example> = fx.examples.iter().collect();
    let eval_opts = TrainOptions {
        anchors: 100,
        ..opts(12)
    };
    let before = step_loss(&t.frozen, &t.params, &all, &eval_opts, 0, false)
        .unwrap()
        .0;
    for _ in 0..12 {
        let r = t.step(&fx.examples).unwrap();
        assert!(r.loss.is_finite() && r.grad_norm.is_finite());
    }
    let after = step_loss(&t.frozen, &t.params, &all, &eval_opts, 0, false)
        .unwrap()
        .0;
    eprintln!("loss {before} -> {after}");
    assert!(
        after < before * 0.95,
        "loss did not drop: {before} -> {after}"
    );
}

#[test]
fn resume_reproduces_the_uninterrupted_run() {
    let fx = fixture(SeqHead::Markov);
    let p0 = Params::from_tensors(&fx.config, &fx.tensors).unwrap();
    let (full, cut) = (tempfile::tempdir().unwrap(), tempfile::tempdir().unwrap());
    let mut a = trainer(&fx, &p0, full.path(), opts(6));
    for s in 1..=6 {
        a.step(&fx.examples).unwrap();
        if s % 2 == 0 {
            a.save().unwrap();
        }
    }
    // Interrupted after step 3 (its update never saved), then resumed from step 2.
    let mut b = trainer(&fx, &p0, cut.path(), opts(6));
    for s in 1..=3 {
        b.step(&fx.examples).unwrap();
        if s % 2 == 0 {
            b.save().unwrap();
        }
    }
    drop(b);
    let mut c = trainer(&fx, &p0, cut.path(), opts(6));
    let (opt, saved) = load_state(cut.path(), &mut c.params).unwrap();
    assert_eq!(saved, opts(6));
    assert_eq!(opt.step, 2);
    c.opt = opt;
    while c.opt.step < 6 {
        c.step(&fx.examples).unwrap();
    }
    for (i, name) in a.params.names.iter().enumerate() {
        let (x, y) = (&a.params.values[i], &c.params.values[i]);
        assert_eq!(
            common::bits(x),
            common::bits(y),
            "{name} differs after resume"
        );
    }
}

use mlxb::train::calibrate::{
    auroc, ece, fit_temperatures, fit_thresholds, patch_config, Round, ECE_BINS,
};

fn uniform(rng: &mut SplitMix) -> f64 {
    (rng.next_u64() >> 11) as f64 / (1u64 << 53) as f64
}

#[test]
fn calibration_recovers_known_thresholds() {
    // Position k accepts exactly when sigmoid(logit_k) >= truth[k] (and all before did).
    let truth = [0.0, 0.3, 0.5, 0.7, 0.8];
    let mut rng = SplitMix::new(9, 9);
    let rounds: Vec<Round> = (0..4000)
        .map(|_| {
            let logits: Vec<f64> = (0..5).map(|_| uniform(&mut rng) * 8.0 - 4.0).collect();
            let accepted = (0..5)
                .find(|&k| 1.0 / (1.0 + (-logits[k]).exp()) < truth[k])
                .unwrap_or(5);
            Round { logits, accepted }
        })
        .collect();
    let ones = vec![1.0; 5];
    let fit = fit_thresholds(&rounds, &ones, 5, 0.9, 20);
    assert_eq!(fit[0], 0.0);
    for k in 1..5 {
        // Logits are uniform on [-4, 4], so P(accept | c >= tau) = (4 - logit(truth)) /
        // (4 - logit(tau)) below the truth: the smallest tau reaching 0.9 is known.
        let logit = |p: f64| (p / (1.0 - p)).ln();
        let want = 1.0 / (1.0 + (-(4.0 - (4.0 - logit(truth[k])) / 0.9)).exp());
        assert!(
            (fit[k] - want).abs() < 0.04,
            "position {k}: fitted {} vs {want}",
            fit[k]
        );
    }
    // Too few samples -> 0; an unreachable rate -> 1.0.
    assert_eq!(fit_thresholds(&rounds[..10], &ones, 5, 0.9, 20)[4], 0.0);
    let never: Vec<Round> = rounds
        .iter()
        .map(|r| Round {
            logits: r.logits.clone(),
            accepted: 1,
        })
        .collect();
    // Position 1 is reached and never accepted; later positions are never reached.
    assert_eq!(
        fit_thresholds(&never, &ones, 5, 0.9, 20),
        [0.0, 1.0, 0.0, 0.0, 0.0]
    );
}

#[test]
fn temperature_scaling_recovers_a_known_temperature() {
    // True acceptance probability sigmoid(logit / 2): STS should find T ~ 2 and cut the ECE.
    let mut rng = SplitMix::new(5, 5);
    let rounds: Vec<Round> = (0..6000)
        .map(|_| {
            let l = uniform(&mut rng) * 12.0 - 6.0;
            let p = 1.0 / (1.0 + (-l / 2.0).exp());
            Round {
                logits: vec![l],
                accepted: (uniform(&mut rng) < p) as usize,
            }
        })
        .collect();
    let t = fit_temperatures(&rounds, 1);
    assert!(t[0] > 1.6 && t[0] < 2.5, "fitted T = {}", t[0]);
    let (before, y) = mlxb::train::calibrate::survival_at(&rounds, &[1.0], 0);
    let (after, _) = mlxb::train::calibrate::survival_at(&rounds, &t, 0);
    assert!(ece(&after, &y, ECE_BINS) < ece(&before, &y, ECE_BINS));
    let a = auroc(&after, &y).unwrap();
    assert!(
        (a - auroc(&before, &y).unwrap()).abs() < 1e-12,
        "scaling keeps the order"
    );
    assert_eq!(auroc(&[0.1, 0.9], &[false, true]), Some(1.0));
    assert_eq!(auroc(&[0.1, 0.9], &[true, true]), None);
}

#[test]
fn patched_config_round_trips() {
    let fx = fixture(SeqHead::Markov);
    let ck = tempfile::tempdir().unwrap();
    checkpoint::save(ck.path(), &fx.config, &fx.tensors).unwrap();
    let weights = std::fs::read(ck.path().join(checkpoint::WEIGHTS_FILE)).unwrap();
    let th = vec![0.0, 0.2, 0.3, 0.4, 0.5];
    let temps = vec![1.0, 1.5, 0.7, 2.0, 1.25];
    patch_config(ck.path(), th.clone(), temps.clone()).unwrap();
    let (c, _) = checkpoint::read_config(ck.path()).unwrap();
    assert_eq!(c.thresholds, Some(th));
    assert_eq!(c.sts_temperatures, Some(temps));
    assert_eq!(c.target_layer_ids, fx.config.target_layer_ids);
    assert_eq!(
        std::fs::read(ck.path().join(checkpoint::WEIGHTS_FILE)).unwrap(),
        weights
    );
    checkpoint::load(ck.path()).unwrap();
    // A wrong-length table is refused and leaves the file as it was.
    let before = std::fs::read(ck.path().join(checkpoint::DSPARK_CONFIG_FILE)).unwrap();
    assert!(patch_config(ck.path(), vec![0.0; 3], vec![1.0; 3]).is_err());
    assert_eq!(
        std::fs::read(ck.path().join(checkpoint::DSPARK_CONFIG_FILE)).unwrap(),
        before
    );
}

fn snapshot(dir: &Path) -> Vec<(String, Vec<u8>)> {
    let mut out: Vec<(String, Vec<u8>)> = std::fs::read_dir(dir)
        .unwrap()
        .map(|e| e.unwrap().path())
        .filter(|p| p.is_file())
        .map(|p| {
            (
                p.file_name().unwrap().to_string_lossy().into_owned(),
                std::fs::read(&p).unwrap(),
            )
        })
        .collect();
    out.sort();
    out
}

#[test]
fn cli_trains_and_refuses_bad_input_with_exit_2() {
    let tmp = tempfile::tempdir().unwrap();
    let t = tmp.path().join("target");
    common::make_model(&t, &common::tiny_llama(json!({})), "f32", None);
    let other = tmp.path().join("other");
    common::make_model(
        &other,
        &common::tiny_llama(json!({"hidden_size": 32})),
        "f32",
        None,
    );
    let data = tmp.path().join("p.jsonl");
    std::fs::write(
        &data,
        "{\"prompt\": \"hello there\"}\n{\"messages\": [{\"role\": \"user\", \"content\": \"a b\"}, {\"role\": \"assistant\", \"content\": \"x\"}, {\"role\": \"user\", \"content\": \"c\"}]}\n{\"prompt\": \"zzz\"}\n",
    )
    .unwrap();
    let out = tmp.path().join("ck");
    let (t_s, d_s, o_s) = (
        t.to_str().unwrap(),
        data.to_str().unwrap(),
        out.to_str().unwrap(),
    );
    let base = [
        "train-dspark",
        "--model",
        t_s,
        "--out",
        o_s,
        "--iters",
        "3",
        "--batch",
        "2",
        "--max-tokens",
        "20",
        "--markov-rank",
        "16",
        "--gamma",
        "5",
        "--checkpoint-every",
        "2",
    ];
    let with_data = |d: &str, extra: &[&str]| {
        let mut a: Vec<&str> = base.to_vec();
        a.extend(["--data", d]);
        a.extend(extra);
        common::run_mlxb(&a)
    };
    // Empty and malformed prompt files: exit 2, nothing written.
    let empty = tmp.path().join("empty.jsonl");
    std::fs::write(&empty, "\n").unwrap();
    let bad = tmp.path().join("bad.jsonl");
    std::fs::write(&bad, "{\"prompt\": \"ok\"}\n{\"text\": 3}\n").unwrap();
    for f in [&empty, &bad] {
        let (code, _, err) = with_data(f.to_str().unwrap(), &[]);
        assert_eq!(code, 2, "{err}");
        assert!(err.contains("prompt"), "{err}");
        assert!(!out.exists());
    }
    let (code, _, err) = with_data(d_s, &[]);
    assert_eq!(code, 0, "{err}");
    let c = checkpoint::load(&out).unwrap();
    assert_eq!(c.config.block_size, 5);
    let before = snapshot(&out);
    // An existing checkpoint without --resume, and a resume on a target it does not fit.
    let (code, _, err) = with_data(d_s, &[]);
    assert_eq!(code, 2, "{err}");
    let mut args: Vec<&str> = base.to_vec();
    args[2] = other.to_str().unwrap();
    args.extend(["--data", d_s, "--resume"]);
    let (code, _, err) = common::run_mlxb(&args);
    assert_eq!(code, 2, "{err}");
    assert_eq!(snapshot(&out), before, "files changed after refused input");
    // Resuming a finished run is a no-op.
    let (code, _, err) = with_data(d_s, &["--resume"]);
    assert_eq!(code, 0, "{err}");
    assert_eq!(snapshot(&out), before);
    // A kill between the final state and the final drafter leaves an older drafter next to the
    // finished state: --resume writes the state's drafter (seen in CI as a torn crash test).
    let weights = out.join(checkpoint::WEIGHTS_FILE);
    let finished = Array::load_safetensors(&weights).unwrap();
    let mut older = finished.clone();
    let fc = older["fc.weight"].add(Array::from_f32(1.0)).unwrap();
    older.insert(
        "fc.weight".into(),
        fc.as_dtype(finished["fc.weight"].dtype()).unwrap(),
    );
    checkpoint::save(&out, &c.config, &older).unwrap();
    let (code, _, err) = with_data(d_s, &["--resume"]);
    assert_eq!(code, 0, "{err}");
    let repaired = Array::load_safetensors(&weights).unwrap();
    let mut names: Vec<&String> = repaired.keys().collect();
    names.sort();
    let mut expected: Vec<&String> = finished.keys().collect();
    expected.sort();
    assert_eq!(names, expected);
    for name in names {
        let (a, b) = (&repaired[name], &finished[name]);
        assert_eq!((a.dtype(), a.shape()), (b.dtype(), b.shape()), "{name}");
        assert_eq!(
            common::bits(a),
            common::bits(b),
            "{name}: --resume kept the older drafter"
        );
    }
}

/// A tiny target, a prompt file and an output directory for `mlxb train-dspark` runs.
struct CliFixture {
    _tmp: tempfile::TempDir,
    target: std::path::PathBuf,
    data: std::path::PathBuf,
    out: std::path::PathBuf,
}

impl CliFixture {
    fn new(prompts: &str) -> Self {
        let tmp = tempfile::tempdir().unwrap();
        let target = tmp.path().join("target");
        common::make_model(&target, &common::tiny_llama(json!({})), "f32", None);
        let data = tmp.path().join("p.jsonl");
        std::fs::write(&data, prompts).unwrap();
        let out = tmp.path().join("ck");
        Self {
            _tmp: tmp,
            target,
            data,
            out,
        }
    }

    /// `mlxb train-dspark` on the fixture's target, prompts and output, plus `extra`.
    fn train_dspark(&self, extra: &[&str]) -> (i32, String, String) {
        let mut a = vec![
            "train-dspark",
            "--model",
            self.target.to_str().unwrap(),
            "--data",
            self.data.to_str().unwrap(),
            "--out",
            self.out.to_str().unwrap(),
        ];
        a.extend(extra);
        common::run_mlxb(&a)
    }

    /// [`Self::train_dspark`] with `fixed` before each call's own arguments.
    fn trainer<'f>(
        &'f self,
        fixed: &'f [&'f str],
    ) -> impl Fn(&[&str]) -> (i32, String, String) + 'f {
        move |extra| self.train_dspark(&[fixed, extra].concat())
    }
}

/// `--draft-vocab N` trains on the N most frequent reply tokens: the checkpoint carries them
/// as `d2t`/`t2d` (each one a reply token of the regenerated sequences, the most frequent
/// first), `--resume` keeps them whatever N it is given, and decoding with the drafter emits
/// the target's own greedy text.
#[test]
fn cli_trains_on_a_reduced_draft_vocabulary() {
    let fx = CliFixture::new(
        "{\"prompt\": \"hello there\"}\n{\"prompt\": \"a b c\"}\n{\"prompt\": \"zzz\"}\n",
    );
    let (t_s, o_s) = (fx.target.to_str().unwrap(), fx.out.to_str().unwrap());
    let out = &fx.out;
    let train = fx.trainer(&[
        "--iters",
        "2",
        "--batch",
        "2",
        "--max-tokens",
        "24",
        "--markov-rank",
        "8",
        "--gamma",
        "4",
    ]);
    let (code, _, err) = train(&["--draft-vocab", "0"]);
    common::assert_refused("--draft-vocab 0", code, &err, &["--draft-vocab"]);
    let (code, _, err) = train(&["--draft-vocab", "12"]);
    assert_eq!(code, 0, "{err}");
    let weights = out.join(checkpoint::WEIGHTS_FILE);
    let tensors = Array::load_safetensors(&weights).unwrap();
    let ids = mlxb::train::draft_vocab::ids_of(&tensors)
        .unwrap()
        .expect("d2t saved");
    assert_eq!(ids.len(), 12);
    assert!(ids.windows(2).all(|w| w[0] < w[1]));
    // The kept ids are the 12 most frequent reply tokens of the sequences (counted here).
    let (_, seqs) =
        mlxb::train::sequences::read_sequences(&out.join("cache/sequences.jsonl")).unwrap();
    let mut counts: HashMap<u32, usize> = HashMap::new();
    for s in &seqs {
        for &t in &s.ids[s.reply_from..] {
            *counts.entry(t).or_default() += 1;
        }
    }
    let least_kept = ids
        .iter()
        .map(|t| counts.get(t).copied().unwrap_or(0))
        .min();
    let most_left = counts
        .iter()
        .filter(|(t, _)| !ids.contains(t))
        .map(|(_, &c)| c)
        .max()
        .unwrap_or(0);
    assert!(
        least_kept.unwrap() >= most_left.max(1),
        "not the most frequent"
    );
    // Resume keeps the saved vocabulary.
    let before = Array::load_safetensors(&weights).unwrap();
    let (code, _, err) = train(&["--resume", "--draft-vocab", "5"]);
    assert_eq!(code, 0, "{err}");
    let after = Array::load_safetensors(&weights).unwrap();
    assert_eq!(common::bits(&after["d2t"]), common::bits(&before["d2t"]));
    // Lossless with the drafter attached.
    let gen = |extra: &[&str]| {
        let mut a = vec![
            "generate",
            "--model",
            t_s,
            "--prompt",
            "hello there",
            "--max-tokens",
            "16",
            "--ignore-chat-template",
        ];
        a.extend(extra);
        let (code, stdout, err) = common::run_mlxb(&a);
        assert_eq!(code, 0, "{err}");
        stdout
    };
    assert_eq!(gen(&["--drafter", o_s]), gen(&[]));
}

/// A sequences file grown by a later regeneration stage keeps the cache shards of its earlier
/// sequences (same bytes, same inode) and adds the rest; the partial last shard is rebuilt.
/// A cache built with other tapped layers is refused, untouched.
#[test]
fn a_grown_sequences_file_keeps_its_cache_shards() {
    let prompts = |n: usize| -> String {
        (0..n)
            .map(|i| format!("{{\"prompt\": \"prompt number {i}\"}}\n"))
            .collect()
    };
    let fx = CliFixture::new(&prompts(20));
    let (data, cache) = (&fx.data, fx.out.join("cache"));
    let run = fx.trainer(&[
        "--max-tokens",
        "20",
        "--cache-only",
        "--ignore-chat-template",
    ]);
    use std::os::unix::fs::MetadataExt;
    let inode = |k: usize| {
        std::fs::metadata(cache.join(format!("shard-{k:05}.safetensors")))
            .unwrap()
            .ino()
    };
    let (code, _, err) = run(&[]);
    assert_eq!(code, 0, "{err}");
    let (first, first_bytes) = (
        inode(0),
        std::fs::read(cache.join("shard-00000.safetensors")).unwrap(),
    );
    let partial = inode(1);
    std::fs::write(data, prompts(36)).unwrap();
    let (code, _, err) = run(&[]);
    assert_eq!(code, 0, "{err}");
    assert_eq!(inode(0), first, "shard 0 was rebuilt");
    assert_eq!(
        std::fs::read(cache.join("shard-00000.safetensors")).unwrap(),
        first_bytes
    );
    assert_ne!(inode(1), partial, "the partial shard was kept");
    let manifest: serde_json::Value =
        serde_json::from_slice(&std::fs::read(cache.join("manifest.json")).unwrap()).unwrap();
    assert_eq!(manifest["shards"].as_array().unwrap().len(), 3);
    let before = snapshot(&cache);
    let (code, _, err) = run(&["--tap-layers", "0,1"]);
    common::assert_refused("other taps", code, &err, &["other taps", "--cache"]);
    assert_eq!(snapshot(&cache), before);
}

/// `--sequences-only` stops after the regeneration stage; a copied sequences file is the only
/// source of a later run's hidden-state cache (nothing is regenerated: the edited reply is
/// what gets cached), and a file from other prompts or settings is refused untouched.
#[test]
fn regenerated_sequences_are_a_reusable_stage() {
    let tmp = tempfile::tempdir().unwrap();
    let t = tmp.path().join("target");
    common::make_model(&t, &common::tiny_llama(json!({})), "f32", None);
    let data = tmp.path().join("p.jsonl");
    std::fs::write(
        &data,
        "{\"prompt\": \"hello there\"}\n{\"prompt\": \"a b c\"}\n",
    )
    .unwrap();
    let path = |p: &Path| p.to_str().unwrap().to_owned();
    let run = |out: &Path, extra: &[&str]| {
        let mut a = vec![
            "train-dspark".to_owned(),
            "--model".into(),
            path(&t),
            "--data".into(),
            path(&data),
            "--out".into(),
            path(out),
            "--max-tokens".into(),
            "24".into(),
            "--markov-rank".into(),
            "16".into(),
        ];
        a.extend(extra.iter().map(|s| s.to_string()));
        let a: Vec<&str> = a.iter().map(String::as_str).collect();
        common::run_mlxb(&a)
    };
    let first = tmp.path().join("first");
    let (code, out, err) = run(&first, &["--sequences-only"]);
    assert_eq!(code, 0, "{err}");
    let seq_file = first.join("cache/sequences.jsonl");
    assert!(out.contains("regenerated 2 sequences"), "{out}");
    assert!(
        !first.join("cache/manifest.json").exists(),
        "no hidden states yet"
    );
    let text = std::fs::read_to_string(&seq_file).unwrap();
    let lines: Vec<serde_json::Value> = text
        .lines()
        .map(|l| serde_json::from_str(l).unwrap())
        .collect();
    assert_eq!(lines.len(), 3, "{text}");
    assert_eq!(lines[0]["max_tokens"], 24);

    // Edit the second reply: the cache built from the copy must hold the edited ids.
    let mut edited = lines.clone();
    let from = edited[2]["reply_from"].as_u64().unwrap() as usize;
    let mut ids: Vec<u64> = edited[2]["ids"]
        .as_array()
        .unwrap()
        .iter()
        .map(|v| v.as_u64().unwrap())
        .collect();
    ids.truncate(from);
    ids.extend((0..20).map(|i| 7 + i % 5));
    edited[2]["ids"] = json!(ids);
    let copy = tmp.path().join("copy.jsonl");
    let body: String = edited.iter().map(|v| format!("{v}\n")).collect();
    std::fs::write(&copy, &body).unwrap();
    let second = tmp.path().join("second");
    let (code, out, err) = run(&second, &["--sequences", &path(&copy), "--cache-only"]);
    assert_eq!(code, 0, "{err}");
    assert!(out.contains("cached"), "{out}");
    let cache = mlxb::train::data::read_cache(&second.join("cache"), 1).unwrap();
    let cached: Vec<Vec<u64>> = cache
        .iter()
        .map(|e| e.ids.iter().map(|&t| t as u64).collect())
        .collect();
    assert!(cached.contains(&ids), "{cached:?}");
    assert_eq!(
        std::fs::read_to_string(&copy).unwrap(),
        body,
        "the file was changed"
    );

    // Other settings or other prompts: exit 2, the file untouched.
    let third = tmp.path().join("third");
    let (code, _, err) = run(
        &third,
        &[
            "--sequences",
            &path(&copy),
            "--seed",
            "7",
            "--sequences-only",
        ],
    );
    common::assert_refused(
        "another seed",
        code,
        &err,
        &["other settings", "--sequences"],
    );
    std::fs::write(
        &data,
        "{\"prompt\": \"hello there\"}\n{\"prompt\": \"x y z\"}\n",
    )
    .unwrap();
    let (code, _, err) = run(&third, &["--sequences", &path(&copy), "--sequences-only"]);
    common::assert_refused("other prompts", code, &err, &["line 3", "--sequences"]);
    assert_eq!(std::fs::read_to_string(&copy).unwrap(), body);
}

/// `--regen-temp 0` regenerates the replies greedy decoding gives: each equals `mlxb generate`'s
/// greedy output for its prompt (an independent run of the decoding loop). The file records the
/// temperature, so a sampling run refuses it untouched; a negative temperature exits 2 before
/// anything is written.
#[test]
fn greedy_regeneration_gives_the_replies_of_greedy_decoding() {
    let prompts: Vec<Vec<u32>> = (0..3)
        .map(|i| common::prompt_ids(9 + i, 384, i as u32))
        .collect();
    let lines: String = prompts
        .iter()
        .map(|p| format!("{}\n", json!({ "prompt_ids": p })))
        .collect();
    let fx = CliFixture::new(&lines);
    let regen = fx.trainer(&[
        "--sequences-only",
        "--max-tokens",
        "16",
        "--markov-rank",
        "8",
    ]);
    let (code, _, err) = regen(&["--regen-temp", "-1"]);
    common::assert_refused("a negative temperature", code, &err, &["--regen-temp"]);
    assert!(!fx.out.exists(), "a refused run wrote {:?}", fx.out);

    let (code, out, err) = regen(&["--regen-temp", "0"]);
    assert_eq!(code, 0, "{err}");
    assert!(out.contains("regenerated 3 sequences"), "{out}");
    let file = fx.out.join("cache/sequences.jsonl");
    let (header, seqs) = mlxb::train::sequences::read_sequences(&file).unwrap();
    assert_eq!(header["sampling"], json!({"temp": 0.0}));
    assert_eq!(seqs.len(), 3);
    for (prompt, seq) in prompts.iter().zip(&seqs) {
        let ids = common::ids_arg(prompt);
        let (code, v, err) = common::run_mlxb_json(
            &[
                "generate",
                "--model",
                fx.target.to_str().unwrap(),
                "--prompt-ids",
                &ids,
                "--max-tokens",
                "16",
                "--json",
            ],
            &[],
        );
        assert_eq!(code, 0, "{err}");
        let greedy = common::json_ids(&v["token_ids"]);
        assert_eq!(&seq.ids[..prompt.len()], &prompt[..]);
        assert_eq!(seq.ids[prompt.len()..], greedy[..], "prompt {prompt:?}");
    }

    // A sampling run (the default temperature) refuses the greedy file, untouched.
    let body = std::fs::read_to_string(&file).unwrap();
    let (code, _, err) = regen(&[]);
    common::assert_refused(
        "a sampled run",
        code,
        &err,
        &["other settings", "--sequences"],
    );
    assert_eq!(std::fs::read_to_string(&file).unwrap(), body);
}

/// `--regen-batch N` samples N replies at once in the batched engine. The sequences file records
/// the batch size (a run at another size refuses the file, untouched), the same seed gives the
/// same file, and a run resumed inside a group (the file cut after 5 of 6 sequences; a group
/// is 8 batch widths) samples the group again and ends with exactly the file of an unbroken run.
#[test]
fn replies_regenerate_in_batches_reproducibly() {
    let prompts: String = (0..6)
        .map(|i| {
            format!(
                "{{\"prompt\": \"prompt number {i} says {}\"}}\n",
                "ab ".repeat(i + 1)
            )
        })
        .collect();
    let fx = CliFixture::new(&prompts);
    let run = |batch: &str| {
        fx.train_dspark(&[
            "--sequences-only",
            "--max-tokens",
            "12",
            "--markov-rank",
            "8",
            "--regen-batch",
            batch,
        ])
    };
    let (code, out, err) = run("2");
    assert_eq!(code, 0, "{err}");
    assert!(out.contains("regenerated 6 sequences"), "{out}");
    let file = fx.out.join("cache/sequences.jsonl");
    let body = std::fs::read_to_string(&file).unwrap();
    let lines: Vec<&str> = body.lines().collect();
    assert_eq!(lines.len(), 7, "a header and six sequences:\n{body}");
    assert!(lines[0].contains("\"regen_batch\":2"), "{}", lines[0]);
    let (header, seqs) = mlxb::train::sequences::read_sequences(&file).unwrap();
    assert_eq!(header["regen_batch"], 2);
    assert!(
        seqs.iter().all(|s| s.loss_tokens() > 0),
        "every reply has tokens"
    );

    // Resumed inside the group: the same file.
    std::fs::write(&file, lines[..6].join("\n") + "\n").unwrap();
    let (code, _, err) = run("2");
    assert_eq!(code, 0, "{err}");
    assert_eq!(
        std::fs::read_to_string(&file).unwrap(),
        body,
        "resumed run differs"
    );
    // From scratch again: the same file.
    std::fs::remove_file(&file).unwrap();
    let (code, _, err) = run("2");
    assert_eq!(code, 0, "{err}");
    assert_eq!(
        std::fs::read_to_string(&file).unwrap(),
        body,
        "rerun differs"
    );
    // Another batch size samples other replies: refused, the file untouched.
    let (code, _, err) = run("3");
    common::assert_refused("--regen-batch 3", code, &err, &["--sequences"]);
    assert_eq!(std::fs::read_to_string(&file).unwrap(), body);
}

/// `--init-from DRAFTER` starts a new run from a trained drafter: its weights (at learning
/// rate 0 one step leaves them exactly as they were), its draft vocabulary and its shape (the
/// shape flags are ignored); it cannot be combined with `--resume`, and a directory without a
/// drafter is refused with exit 2.
#[test]
fn init_from_starts_a_new_run_from_a_trained_drafter() {
    let fx = CliFixture::new("{\"prompt\": \"hello there\"}\n{\"prompt\": \"zzz\"}\n");
    let shape = [
        "--iters",
        "2",
        "--batch",
        "2",
        "--max-tokens",
        "20",
        "--markov-rank",
        "16",
        "--gamma",
        "5",
        "--draft-vocab",
        "40",
    ];
    let (code, _, err) = fx.train_dspark(&shape);
    assert_eq!(code, 0, "{err}");
    let first = checkpoint::load(&fx.out).unwrap();
    let second = fx.out.with_extension("second");
    let run = |extra: &[&str]| {
        let mut a = vec![
            "train-dspark",
            "--model",
            fx.target.to_str().unwrap(),
            "--data",
            fx.data.to_str().unwrap(),
            "--out",
            second.to_str().unwrap(),
            "--max-tokens",
            "20",
        ];
        a.extend(extra);
        common::run_mlxb(&a)
    };
    let from = fx.out.to_str().unwrap();
    let (code, _, err) = run(&[
        "--init-from",
        from,
        "--iters",
        "1",
        "--lr",
        "0",
        "--gamma",
        "3",
    ]);
    assert_eq!(code, 0, "{err}");
    let again = checkpoint::load(&second).unwrap();
    assert_eq!(again.config.block_size, 5, "the shape flags are ignored");
    let (a, b) = (
        Array::load_safetensors(fx.out.join(checkpoint::WEIGHTS_FILE)).unwrap(),
        Array::load_safetensors(second.join(checkpoint::WEIGHTS_FILE)).unwrap(),
    );
    let mut names: Vec<&String> = a.keys().collect();
    names.sort();
    assert!(names.iter().any(|n| n.as_str() == "d2t"), "{names:?}");
    for name in names {
        assert_eq!(
            common::bits(&a[name]),
            common::bits(&b[name]),
            "{name} changed"
        );
    }
    assert_eq!(first.config.block_size, again.config.block_size);
    // A real step moves them.
    std::fs::remove_dir_all(&second).unwrap();
    let (code, _, err) = run(&["--init-from", from, "--iters", "1"]);
    assert_eq!(code, 0, "{err}");
    let moved = Array::load_safetensors(second.join(checkpoint::WEIGHTS_FILE)).unwrap();
    assert_ne!(
        common::bits(&a["fc.weight"]),
        common::bits(&moved["fc.weight"])
    );
    // Refused: with --resume, and a directory that holds no drafter.
    let (code, _, err) = run(&["--init-from", from, "--resume"]);
    assert_eq!(code, 2, "{err}");
    assert!(err.contains("--resume"), "{err}");
    std::fs::remove_dir_all(&second).unwrap();
    let empty = fx.out.with_extension("empty");
    std::fs::create_dir_all(&empty).unwrap();
    let (code, _, err) = run(&["--init-from", empty.to_str().unwrap(), "--iters", "1"]);
    assert_eq!(code, 2, "{err}");
    assert!(err.contains(empty.to_str().unwrap()), "{err}");
    assert!(!second.exists(), "a refused run wrote {}", second.display());
}
