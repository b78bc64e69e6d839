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
    // train-dspark reads the same files, but regenerates through the chat template.
    let ids = fx.prompts("only-ids.jsonl", "{\"prompt_ids\": [4, 5]}\n");
    let out = fx.tmp.path().join("trained");
    let train = |model: &Path, data: &Path| {
        common::run_mlxb(&[
            "train-dspark",
            "--model",
            s(model),
            "--data",
            s(data),
            "--out",
            s(&out),
        ])
    };
    let (code, _, err) = train(&fx.target, &ids);
    assert_eq!(code, 2, "{err}");
    assert!(
        err.contains("line 1") && err.contains("prompt_ids"),
        "{err}"
    );
    assert!(!out.exists());

    // A target without a chat template: train-dspark says what does work and advises no flag
    // it lacks; generate, which has `--ignore-chat-template`, names it.
    let plain = fx.tmp.path().join("plain-target");
    common::copy_dir(&fx.target, &plain);
    let tc = plain.join("tokenizer_config.json");
    let mut cfg: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(&tc).unwrap()).unwrap();
    cfg.as_object_mut().unwrap().remove("chat_template");
    std::fs::write(&tc, cfg.to_string()).unwrap();
    let chat = fx.prompts(
        "chat.jsonl",
        "{\"messages\": [{\"role\": \"user\", \"content\": \"a b c\"}]}\n",
    );
    let (code, _, err) = train(&plain, &chat);
    common::assert_refused(
        "train-dspark without a chat template",
        code,
        &err,
        &["no chat template", "smollm2-135m-instruct"],
    );
    assert!(!err.contains("--ignore-chat-template"), "{err}");
    assert!(!out.exists());
    let generate_plain = || {
        common::run_mlxb(&[
            "generate",
            "--model",
            s(&plain),
            "--prompt",
            "hi",
            "--max-tokens",
            "1",
        ])
    };
    let (code, _, err) = generate_plain();
    assert_eq!(code, 0, "a missing template is not used by generate: {err}");
    cfg["chat_template"] = serde_json::json!("{% for m in messages %}{{ m.content ");
    std::fs::write(&tc, cfg.to_string()).unwrap();
    let (code, _, err) = generate_plain();
    assert_eq!(code, 2, "{err}");
    assert!(
        err.contains("does not compile") && err.contains("--ignore-chat-template"),
        "{err}"
    );
}
