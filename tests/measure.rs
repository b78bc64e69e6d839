//! `mlxb measure`: the reported acceptance metrics equal an independent recount from the
//! `--spec-trace` rounds, greedy speculative ids equal vanilla ids, T > 0 runs with rejection
//! sampling, DSpark drafters get a calibration table, and bad prompt files exit 2 naming the
//! line.

mod common;
#[path = "common/dspark_cli.rs"]
mod dspark_cli;

use dspark_cli::{s, Fixture, MIXED};
use serde_json::Value;
use std::collections::BTreeSet;
use std::path::Path;

const FIELDS: [&str; 11] = [
    "mean_acceptance_length",
    "acceptance_rate",
    "per_position_acceptance",
    "tokens_per_sec_vanilla",
    "tokens_per_sec_spec",
    "speedup",
    "target_forwards",
    "prompts",
    "generated_tokens",
    "ece",
    "auroc",
];

fn read_trace(path: &Path) -> Vec<Value> {
    std::fs::read_to_string(path)
        .unwrap()
        .lines()
        .map(|l| serde_json::from_str(l).unwrap())
        .collect()
}

fn f(v: &Value) -> f64 {
    v.as_f64().unwrap_or_else(|| panic!("not a number: {v}"))
}

/// The generated ids of one prompt, rebuilt from its rounds: the first round's anchor (the
/// token sampled from the prompt), then each round's accepted proposals and its next token.
fn ids_from_rounds(rounds: &[&Value]) -> Vec<u64> {
    let mut ids = vec![rounds[0]["anchor"].as_u64().unwrap()];
    for r in rounds {
        let acc = r["accepted"].as_u64().unwrap() as usize;
        let proposed = r["proposed"].as_array().unwrap();
        ids.extend(proposed[..acc].iter().map(|t| t.as_u64().unwrap()));
        ids.extend(r["next"].as_u64());
    }
    ids
}

/// Recounts vLLM's metrics from the trace and checks the report against them.
fn check_against_trace(report: &Value, trace: &[Value]) {
    let (mut drafts, mut drafted, mut accepted) = (0usize, 0usize, 0usize);
    let mut per = Vec::<usize>::new();
    for r in trace {
        let n = r["proposed"].as_array().unwrap().len();
        let a = r["accepted"].as_u64().unwrap() as usize;
        assert!(a <= n, "{r}");
        if n == 0 {
            continue;
        }
        drafts += 1;
        drafted += n;
        accepted += a;
        per.resize(per.len().max(n), 0);
        for slot in &mut per[..a] {
            *slot += 1;
        }
    }
    assert!(drafts > 0, "no drafts in the trace");
    assert_eq!(report["drafts"].as_u64(), Some(drafts as u64));
    assert_eq!(report["drafted_tokens"].as_u64(), Some(drafted as u64));
    assert_eq!(report["accepted_tokens"].as_u64(), Some(accepted as u64));
    assert_eq!(report["target_forwards"].as_u64(), Some(trace.len() as u64));
    let mal = 1.0 + accepted as f64 / drafts as f64;
    assert!((f(&report["mean_acceptance_length"]) - mal).abs() < 1e-12);
    let rate = accepted as f64 / drafted as f64;
    assert!((f(&report["acceptance_rate"]) - rate).abs() < 1e-12);
    let got: Vec<f64> = report["per_position_acceptance"]
        .as_array()
        .unwrap()
        .iter()
        .map(f)
        .collect();
    let want: Vec<f64> = per.iter().map(|&a| a as f64 / drafts as f64).collect();
    assert_eq!(got.len(), want.len());
    for (g, w) in got.iter().zip(&want) {
        assert!((g - w).abs() < 1e-12, "{got:?} vs {want:?}");
    }
}

#[test]
fn greedy_reports_match_the_trace_and_vanilla() {
    let fx = Fixture::new();
    let data = fx.prompts("p.jsonl", MIXED);
    let trace_path = fx.tmp.path().join("trace.jsonl");
    let mut base = fx.args("measure", &data, "20");
    base.extend(["--json", "--spec-trace", s(&trace_path)]);
    // The vanilla ids of the `prompt_ids` line, from `generate`.
    let (code, vanilla, err) = common::run_mlxb_json(
        &[
            "generate",
            "--model",
            s(&fx.target),
            "--prompt-ids",
            "5,17,99,250,17,99",
            "--max-tokens",
            "20",
            "--json",
        ],
        &[],
    );
    assert_eq!(code, 0, "{err}");
    let vanilla: Vec<u64> = vanilla["token_ids"]
        .as_array()
        .unwrap()
        .iter()
        .map(|t| t.as_u64().unwrap())
        .collect();
    for drafter in [
        vec!["--draft-kind", "ngram"],
        vec!["--drafter", s(&fx.drafter)],
    ] {
        let mut args = base.clone();
        args.extend(&drafter);
        let (code, v, err) = common::run_mlxb_json(&args, &[]);
        assert_eq!(code, 0, "{drafter:?}: {err}");
        for k in FIELDS {
            assert!(v.get(k).is_some(), "{drafter:?}: no `{k}` in {v}");
        }
        assert_eq!(v["prompts"], 3);
        assert_eq!(v["verify"], "match");
        assert_eq!(v["lossless_checked"], true);
        assert_eq!(v["generated_tokens"], v["generated_tokens_vanilla"]);
        assert!(f(&v["tokens_per_sec_vanilla"]) > 0.0 && f(&v["tokens_per_sec_spec"]) > 0.0);
        let ratio = f(&v["tokens_per_sec_spec"]) / f(&v["tokens_per_sec_vanilla"]);
        assert!((f(&v["speedup"]) - ratio).abs() < 1e-9 * ratio);
        // A round's three parts are measured inside the speculative run, so together they fit
        // in its wall time; the vanilla step is the vanilla run's time per token.
        let part = |k: &str| {
            let ms = f(&v[k]);
            assert!(ms >= 0.0, "{drafter:?}: {k} = {ms}");
            ms
        };
        let round_ms = part("draft_ms_per_round")
            + part("verify_ms_per_round")
            + part("rollback_ms_per_round");
        assert!(f(&v["verify_ms_per_round"]) > 0.0, "{drafter:?}: {v}");
        let spec_seconds = f(&v["generated_tokens"]) / f(&v["tokens_per_sec_spec"]);
        let rounds = f(&v["target_forwards"]);
        assert!(
            round_ms * rounds / 1e3 <= spec_seconds * 1.0001,
            "{drafter:?}: {v}"
        );
        let step_ms = 1e3 / f(&v["tokens_per_sec_vanilla"]);
        assert!(
            (f(&v["vanilla_step_ms"]) - step_ms).abs() < 1e-6 * step_ms,
            "{v}"
        );

        let trace = read_trace(&trace_path);
        check_against_trace(&v, &trace);
        let prompts: BTreeSet<u64> = trace
            .iter()
            .map(|r| r["prompt"].as_u64().unwrap())
            .collect();
        assert_eq!(prompts, BTreeSet::from([0, 1, 2]));
        let last: Vec<&Value> = trace.iter().filter(|r| r["prompt"] == 2).collect();
        assert_eq!(last[0]["round"], 0);
        assert_eq!(
            ids_from_rounds(&last),
            vanilla,
            "{drafter:?}: speculative ids of the prompt_ids line differ from generate's"
        );
        let total: usize = (0..3)
            .map(|p| {
                let r: Vec<&Value> = trace.iter().filter(|r| r["prompt"] == p).collect();
                ids_from_rounds(&r).len()
            })
            .sum();
        assert_eq!(v["generated_tokens"].as_u64(), Some(total as u64));

        if drafter[0] == "--draft-kind" {
            assert!(v["ece"].is_null() && v["auroc"].is_null(), "{v}");
        } else {
            assert_eq!(v["drafter"], "dspark");
            let positions = v["per_position_acceptance"].as_array().unwrap().len();
            assert_eq!(v["ece"].as_array().unwrap().len(), positions);
            assert_eq!(v["auroc"].as_array().unwrap().len(), positions);
            // Uncalibrated drafter: the checkpoint's temperatures are all 1.
            assert_eq!(v["ece"], v["ece_before"]);
            let cal = v["calibration"].as_array().unwrap();
            let rounds_with_0 = trace
                .iter()
                .filter(|r| !r["proposed"].as_array().unwrap().is_empty())
                .count();
            assert_eq!(cal[0]["proposed"].as_u64(), Some(rounds_with_0 as u64));
        }
    }
    // Without --json: the summary.
    let mut args = base.clone();
    args.retain(|a| *a != "--json");
    args.extend(["--drafter", s(&fx.drafter)]);
    let (code, out, err) = common::run_mlxb(&args);
    assert_eq!(code, 0, "{err}");
    assert!(
        out.contains("mean acceptance length") && out.contains("ECE before"),
        "{out}"
    );
}

#[test]
fn either_draft_policy_is_lossless_and_all_drafts_every_round() {
    // Which rounds `cost` drafts depends on timing (tests/spec_lossless.rs holds it to a
    // drafter that pays and one that does not); here both policies go through the command.
    let fx = Fixture::new();
    let data = fx.prompts("p.jsonl", MIXED);
    let drafts = |policy: &str| {
        let mut args = fx.args("measure", &data, "120");
        args.extend(["--draft-layers", "3", "--draft-policy", policy, "--json"]);
        let (code, v, err) = common::run_mlxb_json(&args, &[]);
        // Exit 0 means every prompt's speculative ids equal its vanilla ids.
        assert_eq!(code, 0, "{policy}: {err}");
        assert_eq!(v["lossless_checked"], true);
        (
            v["drafts"].as_u64().unwrap(),
            v["target_forwards"].as_u64().unwrap(),
        )
    };
    let (every, rounds) = drafts("all");
    // Every round but a prompt's last, which may have no room left to draft.
    assert!(
        every + 3 >= rounds,
        "`all`: {every} of {rounds} rounds drafted"
    );
    let (gated, gated_rounds) = drafts("cost");
    assert!(gated > 0 && gated <= gated_rounds);
}

#[test]
fn sampling_uses_rejection_and_bad_input_exits_2() {
    let fx = Fixture::new();
    let data = fx.prompts("p.jsonl", MIXED);
    let mut base = fx.args("measure", &data, "16");
    base.extend([
        "--json",
        "--drafter",
        s(&fx.drafter),
        "--temp",
        "0.8",
        "--seed",
        "3",
    ]);
    let (code, v, err) = common::run_mlxb_json(&base, &[]);
    assert_eq!(code, 0, "{err}");
    assert_eq!(v["verify"], "reject");
    assert_eq!(v["lossless_checked"], false);
    assert!(v["drafts"].as_u64().unwrap() > 0, "{v}");
    let mut matching = base.clone();
    matching.extend(["--spec-verify", "match"]);
    let (code, v, err) = common::run_mlxb_json(&matching, &[]);
    assert_eq!(code, 0, "{err}");
    assert_eq!(v["verify"], "match");

    let run = |data: &Path, extra: &[&str]| {
        let mut a = fx.args("measure", data, "8");
        a.extend(extra);
        common::run_mlxb_json(&a, &[])
    };
    let ngram = ["--draft-kind", "ngram"];
    for (name, text, want) in [
        ("empty.jsonl", "\n", "no prompts"),
        (
            "broken.jsonl",
            "{\"prompt\": \"a\"}\n{\"prompt\": \n",
            "line 2",
        ),
        (
            "none.jsonl",
            "{\"prompt\": \"a\"}\n\n{\"text\": \"b\"}\n",
            "line 3",
        ),
        ("vocab.jsonl", "{\"prompt_ids\": [1, 384]}\n", "line 1"),
    ] {
        let p = fx.prompts(name, text);
        let (code, _, err) = run(&p, &ngram);
        common::assert_refused(name, code, &err, &[want]);
    }
    let (code, _, err) = run(&data, &[]);
    assert_eq!(code, 2, "{err}");
    assert!(err.contains("drafter"), "{err}");
    // `--drafter default` names the shipped drafter; while it is absent that is one sentence.
    let shipped = common::root().join("assets/drafters/smollm2-135m-instruct");
    let (code, _, err) = run(&data, &["--drafter", "default"]);
    assert_eq!(code, 2, "{err}");
    if !shipped.is_dir() {
        assert!(
            err.contains("assets/drafters/smollm2-135m-instruct"),
            "{err}"
        );
    }
}

#[test]
fn batched_measure_checks_against_the_plain_batch_and_refuses_what_it_cannot_compare() {
    let fx = Fixture::new();
    // Five prompts: with --n-parallel 2, groups of 2, 2 and 1 (the order of the two batches
    // alternates per group).
    let text = format!(
        "{MIXED}{{\"prompt_ids\": [7, 8, 9, 7, 8, 9, 7, 8]}}\n{{\"prompt\": \"one two one two one two\"}}\n"
    );
    let data = fx.prompts("p.jsonl", &text);
    let run = |extra: &[&str]| {
        let mut a = fx.args("measure", &data, "24");
        a.extend(["--draft-kind", "ngram"]);
        a.extend(extra);
        common::run_mlxb_json(&a, &[])
    };
    let (code, single, err) = run(&["--json"]);
    assert_eq!(code, 0, "{err}");
    assert_eq!(single["n_parallel"], 1);
    for policy in ["all", "cost"] {
        let (code, v, err) = run(&["--json", "--n-parallel", "2", "--draft-policy", policy]);
        assert_eq!(code, 0, "{policy}: {err}");
        assert_eq!(v["n_parallel"], 2);
        assert_eq!(v["prompts"], 5);
        assert_eq!(v["lossless_checked"], true);
        // Every prompt generates what it generates one stream at a time, where the ids are
        // checked against vanilla decoding.
        assert_eq!(v["generated_tokens"], single["generated_tokens"], "{v}");
        assert_eq!(v["generated_tokens"], v["generated_tokens_vanilla"]);
        let ratio = f(&v["tokens_per_sec_spec"]) / f(&v["tokens_per_sec_vanilla"]);
        assert!((f(&v["speedup"]) - ratio).abs() < 1e-9 * ratio, "{v}");
        let (drafted, accepted) = (f(&v["drafted_tokens"]), f(&v["accepted_tokens"]));
        assert!(accepted <= drafted, "{v}");
        if policy == "all" {
            assert!(v["drafts"].as_u64().unwrap() > 0, "{v}");
            // A step's draft and verify times are parts of the drafting batch's time.
            let spec_seconds = f(&v["generated_tokens"]) / f(&v["tokens_per_sec_spec"]);
            let step_ms = f(&v["draft_ms_per_round"]) + f(&v["verify_ms_per_round"]);
            assert!(
                step_ms * f(&v["target_forwards"]) / 1e3 <= spec_seconds,
                "{v}"
            );
        }
    }
    let (code, out, err) = common::run_mlxb(&{
        let mut a = fx.args("measure", &data, "8");
        a.extend(["--draft-kind", "ngram", "--n-parallel", "3"]);
        a
    });
    assert_eq!(code, 0, "{err}");
    assert!(
        out.contains("3 sequences at once") && out.contains("plain batched steps"),
        "{out}"
    );
    let trace = fx.tmp.path().join("t.jsonl");
    for (extra, want) in [
        (vec!["--n-parallel", "0"], "at least 1"),
        (vec!["--n-parallel", "2", "--temp", "0.5"], "--temp 0"),
        (
            vec!["--n-parallel", "2", "--spec-trace", s(&trace)],
            "--spec-trace",
        ),
        (
            vec!["--n-parallel", "2", "--repetition-penalty", "1.2"],
            "penalty",
        ),
    ] {
        let (code, _, err) = run(&extra);
        common::assert_refused(&format!("{extra:?}"), code, &err, &[want]);
    }
    // DSpark drafts per sequence from each row's tapped target outputs: every block verified
    // (unpruned), the ids still those of the plain batch.
    let mut a = fx.args("measure", &data, "16");
    a.extend(["--drafter", s(&fx.drafter), "--dspark-min-conf", "0"]);
    a.extend(["--n-parallel", "2", "--draft-policy", "all", "--json"]);
    let (code, v, err) = common::run_mlxb_json(&a, &[]);
    assert_eq!(code, 0, "{err}");
    assert_eq!(v["lossless_checked"], true, "{v}");
    assert_eq!(v["drafter"], "dspark", "{v}");
    assert!(v["drafts"].as_u64().unwrap() > 0, "{v}");
    assert_eq!(v["generated_tokens"], v["generated_tokens_vanilla"]);
    // A draft model (here the target itself, so every draft is kept) and the target's first
    // layer draft per sequence with caches of their own.
    for drafter in [
        ["--draft-kind", "model", "--draft-model", s(&fx.target)],
        ["--draft-kind", "self", "--draft-layers", "1"],
    ] {
        let mut a = fx.args("measure", &data, "16");
        a.extend(drafter);
        a.extend(["--n-parallel", "2", "--draft-policy", "all", "--json"]);
        let (code, v, err) = common::run_mlxb_json(&a, &[]);
        assert_eq!(code, 0, "{drafter:?}: {err}");
        assert_eq!(v["lossless_checked"], true, "{v}");
        let drafts = v["drafts"].as_u64().unwrap();
        assert!(drafts > 0, "{v}");
        if drafter[1] == "model" {
            // The target drafting for itself guesses every pending token right and drafts again
            // from it once it is read, so a step without a block is rare: at most one per
            // sequence (its first after its prompt, or one with no room left at its end); a
            // drafter that cannot draft twice from one point leaves every other step plain.
            let plain = v["block_widths"][0].as_u64().unwrap();
            assert!(plain <= v["prompts"].as_u64().unwrap(), "{v}");
        }
    }
    assert!(!trace.exists());
}
