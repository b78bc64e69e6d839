//! `mlxb calibrate`: fits temperatures and thresholds on unpruned greedy rounds and patches
//! them into the checkpoint atomically. The patched config loads with the checkpoint loader
//! and holds exactly what the JSON reported, every other field and the weights unchanged; the
//! per-position counts equal a recount from `generate --spec-trace` runs of the same prompts;
//! the drafter then prunes with the fitted table and stays lossless; bad input exits 2.

mod common;
#[path = "common/dspark_cli.rs"]
mod dspark_cli;

use dspark_cli::{s, Fixture, GAMMA};
use mlxb::spec::dspark::checkpoint;
use serde_json::Value;
use std::path::Path;

const IDS: [&str; 3] = ["5,17,99,250,17,99", "7,8,9,10,11", "300,12,44,12,44,12"];

fn prompt_file(fx: &Fixture) -> std::path::PathBuf {
    let mut text = String::from("{\"prompt\": \"the quick brown fox\"}\n");
    for ids in IDS {
        text.push_str(&format!("{{\"prompt_ids\": [{ids}]}}\n"));
    }
    fx.prompts("p.jsonl", &text)
}

fn config_json(dir: &Path) -> Value {
    serde_json::from_str(
        &std::fs::read_to_string(dir.join(checkpoint::DSPARK_CONFIG_FILE)).unwrap(),
    )
    .unwrap()
}

fn floats(v: &Value) -> Vec<f64> {
    v.as_array()
        .unwrap()
        .iter()
        .map(|x| x.as_f64().unwrap())
        .collect()
}

/// (proposed, reached) per position, recounted from an unpruned trace: every verified
/// position of a round is proposed; a round that stopped on an accepted token (no `next`)
/// only judged its accepted positions; one that stopped on its own draft judged one more.
fn recount(trace: &[Value], counts: &mut [(usize, usize)]) {
    for r in trace {
        let proposed: Vec<u64> = r["proposed"]
            .as_array()
            .unwrap()
            .iter()
            .map(|t| t.as_u64().unwrap())
            .collect();
        let mut acc = r["accepted"].as_u64().unwrap() as usize;
        let judged = match r["next"].as_u64() {
            None => acc,
            Some(t) if proposed.get(acc) == Some(&t) => {
                acc += 1;
                acc
            }
            Some(_) => proposed.len(),
        };
        for (k, c) in counts.iter_mut().enumerate().take(judged) {
            c.0 += 1;
            if acc >= k {
                c.1 += 1;
            }
        }
    }
}

#[test]
fn calibration_patches_a_config_that_round_trips_and_prunes_losslessly() {
    let fx = Fixture::new();
    let data = prompt_file(&fx);
    let before = config_json(&fx.drafter);
    let weights = std::fs::read(fx.drafter.join(checkpoint::WEIGHTS_FILE)).unwrap();
    let mut args = fx.args("calibrate", &data, "24");
    args.extend(["--drafter", s(&fx.drafter), "--json"]);
    args.extend(["--min-samples", "3", "--target-rate", "0.3"]);
    let (code, v, err) = common::run_mlxb_json(&args, &[]);
    assert_eq!(code, 0, "{err}");
    let (th, temps) = (floats(&v["thresholds"]), floats(&v["temperatures"]));
    assert_eq!((th.len(), temps.len()), (GAMMA, GAMMA));
    assert_eq!(th[0], 0.0);
    assert!(th.iter().all(|t| (0.0..=1.0).contains(t)), "{th:?}");
    assert!(temps.iter().all(|&t| t > 0.0), "{temps:?}");

    // The loader sees exactly the reported tables; nothing else changed.
    let ck = checkpoint::load(&fx.drafter).unwrap();
    assert_eq!(ck.config.thresholds.as_deref(), Some(&th[..]));
    assert_eq!(ck.config.sts_temperatures.as_deref(), Some(&temps[..]));
    let strip = |mut c: Value| {
        let o = c.as_object_mut().unwrap();
        o.remove("thresholds");
        o.remove("sts_temperatures");
        c
    };
    assert_eq!(strip(config_json(&fx.drafter)), strip(before));
    assert_eq!(
        std::fs::read(fx.drafter.join(checkpoint::WEIGHTS_FILE)).unwrap(),
        weights
    );
    let leftovers: Vec<_> = std::fs::read_dir(&fx.drafter)
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .filter(|n| n != checkpoint::DSPARK_CONFIG_FILE && n != checkpoint::WEIGHTS_FILE)
        .collect();
    assert!(leftovers.is_empty(), "temporary files left: {leftovers:?}");

    // Recount the positions from unpruned `generate` traces of the same prompts (the
    // calibrated temperatures change confidences, never proposals).
    let mut counts = vec![(0usize, 0usize); GAMMA];
    let trace = fx.tmp.path().join("t.jsonl");
    let mut rounds = 0;
    for prompt in [vec!["--prompt", "the quick brown fox"]]
        .into_iter()
        .chain(IDS.iter().map(|ids| vec!["--prompt-ids", ids]))
    {
        let mut args = vec![
            "generate",
            "--model",
            s(&fx.target),
            "--drafter",
            s(&fx.drafter),
            "--dspark-min-conf",
            "0",
            "--max-tokens",
            "24",
            "--json",
            "--spec-trace",
            s(&trace),
        ];
        args.extend(&prompt);
        let (code, _, err) = common::run_mlxb_json(&args, &[]);
        assert_eq!(code, 0, "{err}");
        let t: Vec<Value> = std::fs::read_to_string(&trace)
            .unwrap()
            .lines()
            .map(|l| serde_json::from_str(l).unwrap())
            .collect();
        rounds += t
            .iter()
            .filter(|r| !r["proposed"].as_array().unwrap().is_empty())
            .count();
        recount(&t, &mut counts);
    }
    let positions = v["positions"].as_array().unwrap();
    assert_eq!(positions.len(), GAMMA);
    for (k, p) in positions.iter().enumerate() {
        assert_eq!(
            (p["proposed"].as_u64(), p["reached"].as_u64()),
            (Some(counts[k].0 as u64), Some(counts[k].1 as u64)),
            "position {k}: {p}"
        );
    }
    assert_eq!(v["rounds"].as_u64(), Some(rounds as u64));
    assert!(positions[0]["ece_after"].as_f64() <= positions[0]["ece_before"].as_f64());

    // The drafter now prunes with the fitted table and stays lossless.
    let gen = |drafter: bool| {
        let mut args = vec![
            "generate",
            "--model",
            s(&fx.target),
            "--prompt-ids",
            IDS[0],
            "--max-tokens",
            "24",
            "--json",
        ];
        if drafter {
            args.extend(["--drafter", s(&fx.drafter), "--spec-trace", s(&trace)]);
        }
        let (code, v, err) = common::run_mlxb_json(&args, &[]);
        assert_eq!(code, 0, "{err}");
        v
    };
    assert_eq!(gen(true)["token_ids"], gen(false)["token_ids"]);
    let first: Value = serde_json::from_str(
        std::fs::read_to_string(&trace)
            .unwrap()
            .lines()
            .next()
            .unwrap(),
    )
    .unwrap();
    let in_force = if th.windows(2).all(|w| w[0] == w[1]) {
        vec![first["threshold"].as_f64().unwrap(); GAMMA]
    } else {
        floats(&first["thresholds"])
    };
    assert_eq!(in_force, th);

    // Without --json: the table.
    let mut args = fx.args("calibrate", &data, "8");
    args.extend(["--drafter", s(&fx.drafter)]);
    let (code, out, err) = common::run_mlxb(&args);
    assert_eq!(code, 0, "{err}");
    assert!(
        out.contains("threshold") && out.contains("temperature"),
        "{out}"
    );
}

#[test]
fn bad_input_exits_2_and_leaves_the_checkpoint_alone() {
    let fx = Fixture::new();
    let good = prompt_file(&fx);
    let config = std::fs::read(fx.drafter.join(checkpoint::DSPARK_CONFIG_FILE)).unwrap();
    let run = |drafter: &Path, data: &Path, extra: &[&str]| {
        let mut a = fx.args("calibrate", data, "8");
        a.extend(["--drafter", s(drafter)]);
        a.extend(extra);
        common::run_mlxb(&a)
    };
    let cases = [
        ("empty.jsonl", "", "no prompts"),
        (
            "broken.jsonl",
            "{\"prompt_ids\": [1, 2]}\n[oops\n",
            "line 2",
        ),
        (
            "field.jsonl",
            "{\"prompt\": \"a\"}\n{\"prompt_ids\": \"1 2\"}\n",
            "line 2",
        ),
        (
            "ids.jsonl",
            "{\"prompt_ids\": [4]}\n\n{\"prompt_ids\": [3, 99999]}\n",
            "line 3",
        ),
    ];
    for (name, text, want) in cases {
        let p = fx.prompts(name, text);
        let (code, _, err) = run(&fx.drafter, &p, &[]);
        common::assert_refused(name, code, &err, &[want]);
    }
    for (extra, want) in [
        (&["--target-rate", "1.5"][..], "--target-rate"),
        (&["--max-tokens", "1"][..], "--max-tokens"),
    ] {
        let (code, _, err) = run(&fx.drafter, &good, extra);
        assert_eq!(code, 2, "{extra:?}: {err}");
        assert!(err.contains(want), "{err}");
    }
    // A directory that is not a DSpark checkpoint.
    let (code, _, err) = run(&fx.target, &good, &[]);
    assert_eq!(code, 2, "{err}");
    assert_eq!(
        std::fs::read(fx.drafter.join(checkpoint::DSPARK_CONFIG_FILE)).unwrap(),
        config,
        "a refused calibration changed the config"
    );
    // A broken chat template: generate and calibrate name `--ignore-chat-template`, which
    // feeds the prompts as plain text instead.
    let broken = fx.tmp.path().join("broken-template");
    common::copy_dir(&fx.target, &broken);
    let tc = broken.join("tokenizer_config.json");
    let mut cfg: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(&tc).unwrap()).unwrap();
    let generate = || {
        common::run_mlxb(&[
            "generate",
            "--model",
            s(&broken),
            "--prompt",
            "hi",
            "--max-tokens",
            "1",
        ])
    };
    cfg["chat_template"] = serde_json::json!("{% for m in messages %}{{ m.content ");
    std::fs::write(&tc, cfg.to_string()).unwrap();
    let (code, _, err) = generate();
    assert_eq!(code, 2, "{err}");
    assert!(
        err.contains("does not compile") && err.contains("--ignore-chat-template"),
        "{err}"
    );
    let mut calibrate = fx.args("calibrate", &good, "8");
    calibrate[2] = s(&broken);
    calibrate.extend(["--drafter", s(&fx.drafter)]);
    let (code, _, err) = common::run_mlxb(&calibrate);
    common::assert_refused(
        "calibrate with a broken template",
        code,
        &err,
        &["does not compile", "--ignore-chat-template"],
    );
    assert_eq!(
        std::fs::read(fx.drafter.join(checkpoint::DSPARK_CONFIG_FILE)).unwrap(),
        config,
        "a refused calibration changed the config"
    );
    calibrate.push("--ignore-chat-template");
    let (code, _, err) = common::run_mlxb(&calibrate);
    assert_eq!(code, 0, "--ignore-chat-template: {err}");
}

/// The sequences `train-dspark --cache-only` regenerates from `data` on `model`, as the cache
/// holds them.
fn cached_sequences(fx: &Fixture, model: &Path, data: &Path, extra: &[&str]) -> Vec<Vec<u32>> {
    let out = tempfile::tempdir_in(fx.tmp.path()).unwrap();
    let mut args = fx.args("train-dspark", data, "24");
    args[2] = s(model);
    let out_dir = out.path().join("drafter");
    args.extend(["--out", s(&out_dir), "--cache-only"]);
    args.extend(extra);
    let (code, _, err) = common::run_mlxb(&args);
    assert_eq!(code, 0, "{args:?}: {err}");
    let cache = mlxb::train::data::read_cache(&out_dir.join("cache"), 1).unwrap();
    assert!(!cache.is_empty(), "{args:?}: nothing cached");
    for ex in &cache {
        let prompt = ex.mask.iter().take_while(|m| !**m).count();
        assert!(
            prompt > 0 && ex.mask[prompt..].iter().all(|m| *m),
            "{:?}",
            ex.mask
        );
    }
    cache.into_iter().map(|ex| ex.ids).collect()
}

#[test]
fn base_models_read_prompts_as_plain_text() {
    let fx = Fixture::new();
    // The prompt as plain text: the tokenizer's own encoding of the turn's content, special
    // tokens included (computed here with the tokenizers crate, not through mlxb).
    let tokenizer = tokenizers::Tokenizer::from_file(fx.target.join("tokenizer.json")).unwrap();
    let plain_prompt = tokenizer
        .encode("the quick brown fox", true)
        .unwrap()
        .get_ids()
        .to_vec();
    let chat = fx.prompts(
        "chat.jsonl",
        "{\"messages\": [{\"role\": \"user\", \"content\": \"the quick brown fox\"}]}\n",
    );
    let starts_plain = |seqs: &[Vec<u32>]| seqs[0].starts_with(&plain_prompt);

    // train-dspark takes `prompt_ids` lines as given.
    let ids = fx.prompts("only-ids.jsonl", "{\"prompt_ids\": [4, 5]}\n");
    let seqs = cached_sequences(&fx, &fx.target, &ids, &[]);
    assert!(seqs[0].starts_with(&[4, 5]), "{seqs:?}");

    // An instruct target renders the turn through its template unless told otherwise.
    let templated = cached_sequences(&fx, &fx.target, &chat, &[]);
    assert!(!starts_plain(&templated), "{templated:?}");
    let ignored = cached_sequences(&fx, &fx.target, &chat, &["--ignore-chat-template"]);
    assert!(starts_plain(&ignored), "{ignored:?} vs {plain_prompt:?}");

    // A base target (no chat template) reads the turn as plain text, as generate does.
    let base = fx.tmp.path().join("base-target");
    common::copy_dir(&fx.target, &base);
    let tc = base.join("tokenizer_config.json");
    let mut cfg: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(&tc).unwrap()).unwrap();
    cfg.as_object_mut().unwrap().remove("chat_template");
    std::fs::write(&tc, cfg.to_string()).unwrap();
    assert_eq!(cached_sequences(&fx, &base, &chat, &[]), ignored);
    for cmd in ["measure", "calibrate"] {
        let mut args = fx.args(cmd, &chat, "8");
        args[2] = s(&base);
        args.extend(["--drafter", s(&fx.drafter), "--json"]);
        let (code, v, err) = common::run_mlxb_json(&args, &[]);
        assert_eq!(code, 0, "{cmd} on a base model: {err}");
        assert_eq!(v["prompts"], 1, "{cmd}: {v}");
    }
}
