//! `mlxb bench` end to end on a tiny model: rows parse back, results files refuse mixed
//! setups, `--matrix` covers every fork of the fork table. Timing numbers themselves are
//! never asserted.

mod common;

use mlxb::bench::matrix;
use mlxb::bench::report::{self, Row};
use mlxb::engine::forks::{Domain, Forks, Output, Tier, FORKS};
use serde_json::json;
use std::path::Path;

/// A tiny random llama with head dim 64, so that KV group sizes 32 and 64 apply (128 does
/// not divide it: the matrix must list that value as skipped with the engine's reason).
fn tiny_model(dir: &Path) {
    common::make_model(
        dir,
        &json!({"model_type": "llama", "hidden_size": 128, "num_hidden_layers": 2, "intermediate_size": 128,
                "num_attention_heads": 2, "num_key_value_heads": 1, "rms_norm_eps": 1e-5, "vocab_size": 384}),
        "f32",
        None,
    );
}

/// `mlxb bench --model MODEL ARGS...`: (exit code, stdout, stderr).
fn bench(model: &Path, args: &[&str]) -> (i32, String, String) {
    common::run_mlxb(&[&["bench", "--model", model.to_str().unwrap()], args].concat())
}

#[test]
fn bench_rows_parse_back_and_results_refuse_other_setups() {
    let dir = tempfile::tempdir().unwrap();
    let model = dir.path().join("m");
    tiny_model(&model);
    let run = |extra: &[&str]| {
        bench(
            &model,
            &[&["-p", "8", "-n", "4", "-d", "0,4", "-r", "2"], extra].concat(),
        )
    };
    // --tui without a terminal on stdout falls back to plain output and says so.
    let (code, out, err) = run(&["-o", "json", "--draft-kind", "ngram", "--tui"]);
    assert!(err.contains("--tui needs a terminal"), "{err}");
    assert_eq!(code, 0, "{err}");
    let rows: Vec<Row> = serde_json::from_str(&out).unwrap();
    let tests: Vec<&str> = rows.iter().map(|r| r.test.as_str()).collect();
    assert_eq!(
        tests,
        ["pp8", "tg4", "tg4", "pp8 @ d4", "tg4 @ d4", "tg4 @ d4"]
    );
    for r in &rows {
        assert_eq!(r.samples_ts.len(), 2);
        assert!(r.avg_ts > 0.0 && r.setup.mlx_version == "0.32.4");
    }
    assert!(rows.iter().any(|r| r.mean_acceptance_length.is_some()));
    let csv = report::csv(&rows);
    let back = report::parse_csv(&csv).unwrap();
    assert_eq!(back.len(), rows.len());
    for (a, b) in back.iter().zip(&rows) {
        assert_eq!(
            (a.avg_ts, &a.samples_ts, &a.test),
            (b.avg_ts, &b.samples_ts, &b.test)
        );
    }

    let results = dir.path().join("results.jsonl");
    assert_eq!(run(&["--results", results.to_str().unwrap()]).0, 0);
    assert_eq!(
        run(&["--results", results.to_str().unwrap()]).0,
        0,
        "same setup must append"
    );
    let lines = std::fs::read_to_string(&results).unwrap().lines().count();
    assert_eq!(lines, 8);
    let mut foreign: Row = serde_json::from_str(
        std::fs::read_to_string(&results)
            .unwrap()
            .lines()
            .next()
            .unwrap(),
    )
    .unwrap();
    foreign.setup.mlx_version = "0.0.1".into();
    let other = dir.path().join("other.jsonl");
    std::fs::write(
        &other,
        format!("{}\n", serde_json::to_string(&foreign).unwrap()),
    )
    .unwrap();
    let (code, _, err) = run(&["--results", other.to_str().unwrap()]);
    assert_eq!(code, 2, "{err}");
    assert!(err.contains("another setup"));
    assert_eq!(
        std::fs::read_to_string(&other).unwrap().lines().count(),
        1,
        "results file was modified"
    );
}

/// `--n-verify`: a row per block size and depth, each with its cost in one-token steps per
/// repetition, for mlxb and for mlx-lm measured in the same run; the table gains the columns.
#[test]
fn verify_tests_report_the_block_cost_beside_mlx_lm() {
    let dir = tempfile::tempdir().unwrap();
    let model = dir.path().join("m");
    tiny_model(&model);
    let args = [
        "-p",
        "0",
        "-n",
        "0",
        "--n-verify",
        "1,4",
        "-d",
        "0,4",
        "-r",
        "2",
    ];
    let (code, out, err) = bench(
        &model,
        &[&args[..], &["--baseline", "mlx-lm", "-o", "json"]].concat(),
    );
    assert_eq!(code, 0, "{err}");
    let rows: Vec<Row> = serde_json::from_str(&out).unwrap();
    let tests: Vec<&str> = rows.iter().map(|r| r.test.as_str()).collect();
    assert_eq!(tests, ["v1", "v4", "v1 @ d4", "v4 @ d4"]);
    for r in &rows {
        assert_eq!((r.n_prompt, r.n_gen), (0, 0));
        assert!(r.n_verify == 1 || r.n_verify == 4);
        assert_eq!(r.verify_cost_samples.len(), 2, "{}", r.test);
        assert_eq!(r.baseline_verify_cost_samples.len(), 2, "{}", r.test);
        assert!(r
            .verify_cost_samples
            .iter()
            .all(|c| *c > 0.0 && c.is_finite()));
        assert!(r
            .baseline_verify_cost_samples
            .iter()
            .all(|c| *c > 0.0 && c.is_finite()));
        assert!(r.verify_cost.is_some() && r.baseline_verify_cost.is_some());
        assert_eq!(r.baseline_samples_ts.as_ref().map(Vec::len), Some(2));
    }
    let back = report::parse_csv(&report::csv(&rows)).unwrap();
    for (a, b) in back.iter().zip(&rows) {
        assert_eq!(
            (a.n_verify, &a.verify_cost_samples, a.baseline_verify_cost),
            (b.n_verify, &b.verify_cost_samples, b.baseline_verify_cost)
        );
    }
    let (code, out, err) = bench(&model, &args);
    assert_eq!(code, 0, "{err}");
    assert!(out.contains("| steps per block |"), "{out}");
    assert!(out.contains("| v4 @ d4 |"), "{out}");
}

/// `--baseline llama.cpp` runs llama-bench once per recorded repetition of each `-p`/`-n`
/// test (its own warm-up stands for the skipped one) and reads its JSON row. A stand-in
/// llama-bench logs its arguments and answers with a fixed rate, so what mlxb asks and
/// reports is checked exactly; the real one is timed in docs/performance.md.
#[test]
fn llama_cpp_baseline_runs_llama_bench_once_per_repetition() {
    let dir = tempfile::tempdir().unwrap();
    let model = dir.path().join("m");
    tiny_model(&model);
    let gguf = dir.path().join("m.gguf");
    std::fs::write(&gguf, b"GGUF").unwrap();
    let log = dir.path().join("calls.log");
    let fake = dir.path().join("llama-bench");
    std::fs::write(
        &fake,
        format!(
            "#!/bin/sh\necho \"$@\" >> {}\necho '[{{\"build_commit\": \"abc1234\", \"avg_ts\": 123.5}}]'\n",
            log.display()
        ),
    )
    .unwrap();
    std::process::Command::new("chmod")
        .args(["+x", fake.to_str().unwrap()])
        .status()
        .unwrap();
    let (fake, gguf) = (fake.to_str().unwrap(), gguf.to_str().unwrap());
    let llama = [
        "--baseline",
        "llama.cpp",
        "--llama-bench",
        fake,
        "--gguf",
        gguf,
    ];
    let run = |extra: &[&str]| {
        let args = [&["-p", "8", "-n", "4", "-d", "0,4", "-r", "2"], extra].concat();
        bench(&model, &args)
    };
    let (code, out, err) = run(&[&llama[..], &["-o", "json"]].concat());
    assert_eq!(code, 0, "{err}");
    let rows: Vec<Row> = serde_json::from_str(&out).unwrap();
    assert_eq!(rows.len(), 4);
    for r in &rows {
        assert_eq!(r.baseline.as_deref(), Some("llama.cpp abc1234"));
        assert_eq!(r.baseline_samples_ts.as_deref(), Some(&[123.5, 123.5][..]));
        assert!(r.ratio.is_some());
    }
    let threads = std::thread::available_parallelism().unwrap().get();
    let calls: Vec<String> = std::fs::read_to_string(&log)
        .unwrap()
        .lines()
        .map(str::to_owned)
        .collect();
    let want: Vec<String> = [(8, 0, 0), (0, 4, 0), (8, 0, 4), (0, 4, 4)]
        .iter()
        .flat_map(|(p, n, d)| {
            let call = format!("-m {gguf} -p {p} -n {n} -d {d} -r 1 -t {threads} -o json");
            [call.clone(), call]
        })
        .collect();
    assert_eq!(calls, want);
    let (code, out, _) = run(&llama);
    assert_eq!(code, 0);
    assert!(
        out.contains("baseline: llama.cpp abc1234 for `vanilla` rows"),
        "{out}"
    );

    // What it cannot measure, or cannot find, is one sentence and exit 2 before any model
    // is loaded.
    let missing = dir.path().join("nothing.gguf");
    let cases: [(Vec<&str>, &str); 4] = [
        (
            vec!["--baseline", "llama.cpp", "--llama-bench", fake],
            "add --gguf FILE",
        ),
        (
            [&llama[..], &["--n-verify", "4"]].concat(),
            "--baseline llama.cpp measures -p and -n tests only",
        ),
        (
            vec!["--gguf", gguf],
            "--gguf is only used by --baseline llama.cpp",
        ),
        (
            vec![
                "--baseline",
                "llama.cpp",
                "--llama-bench",
                fake,
                "--gguf",
                missing.to_str().unwrap(),
            ],
            "nothing.gguf",
        ),
    ];
    for (args, want) in cases {
        let (code, _, err) = run(&args);
        assert_eq!(code, 2, "{args:?}: {err}");
        assert!(
            err.contains(want) && err.lines().count() == 1,
            "{args:?}: {err}"
        );
    }
}

#[test]
fn bad_test_specs_are_clear_errors() {
    let (code, _, err) = bench(Path::new("/nonexistent"), &["-p", "0", "-n", "0"]);
    assert_eq!(code, 2);
    assert!(err.contains("no tests selected"));
}

/// The fork table's non-default values, computed here independently of the matrix code.
fn table_values() -> Vec<(&'static str, Vec<&'static str>)> {
    FORKS
        .iter()
        .map(|f| {
            let l1 = f.default_in(Tier::L1);
            let mut values: Vec<&str> = match &f.domain {
                Domain::Choices(c) => c.iter().map(|c| c.value).filter(|v| *v != l1).collect(),
                Domain::Count => Tier::ALL
                    .iter()
                    .map(|t| f.default_in(*t))
                    .filter(|v| *v != l1)
                    .collect(),
            };
            values.dedup();
            (f.name, values)
        })
        .collect()
}

#[test]
fn matrix_plan_is_derived_from_the_fork_table() {
    let entries = matrix::plan();
    let mut expected = 0;
    for (name, values) in table_values() {
        let got: Vec<&matrix::Entry> = entries.iter().filter(|e| e.fork == Some(name)).collect();
        assert!(!got.is_empty(), "--{name} has no row in the matrix");
        assert_eq!(
            got.iter().map(|e| e.value.as_str()).collect::<Vec<_>>(),
            values,
            "--{name}"
        );
        expected += values.len();
        for e in got {
            match &e.run {
                Err(why) => assert!(!why.is_empty(), "{}: skipped without a reason", e.label),
                Ok(r) => {
                    let v = r.values.iter().find(|v| v.fork.name == name).unwrap();
                    assert_eq!(v.value, e.value, "{}", e.label);
                    assert_ne!(r.forks, Forks::default(), "{} is L1 itself", e.label);
                }
            }
        }
    }
    let tiers: Vec<&str> = entries
        .iter()
        .filter(|e| e.fork.is_none())
        .map(|e| e.value.as_str())
        .collect();
    assert_eq!(tiers, ["l2", "l3"]);
    assert_eq!(entries.len(), expected + 2);
    // No configuration is measured twice.
    let ran: Vec<Forks> = entries
        .iter()
        .filter_map(|e| e.run.as_ref().ok().map(|r| r.forks))
        .collect();
    for (i, f) in ran.iter().enumerate() {
        assert!(!ran[..i].contains(f), "{f:?} twice");
    }
    // The CPU backend refuses --fused-gelu on: listed with the engine's own reason.
    let gelu = entries
        .iter()
        .find(|e| e.fork == Some("fused-gelu"))
        .unwrap();
    assert!(gelu.run.as_ref().unwrap_err().contains("--fused-gelu on"));
    // A quantized-KV-only value runs on a quantized cache instead of doing nothing.
    let group = entries
        .iter()
        .find(|e| e.fork == Some("kv-group-size"))
        .unwrap();
    let r = group.run.as_ref().unwrap();
    assert!(
        r.warnings.is_empty() && r.forks.quantized_kv_start == 0,
        "{r:?}"
    );
}

#[test]
fn matrix_runs_every_fork_with_kl_for_output_changing_ones() {
    let dir = tempfile::tempdir().unwrap();
    let model = dir.path().join("m");
    tiny_model(&model);
    let (code, out, err) = bench(
        &model,
        &["--matrix", "-p", "16", "-n", "8", "-r", "1", "-o", "json"],
    );
    assert_eq!(code, 0, "{err}");
    let rows: Vec<Row> = serde_json::from_str(&out).unwrap();
    let mut warned = false;
    let loaded = mlxb::engine::models::load(&model, Forks::default()).unwrap();
    for e in matrix::plan_for(&loaded, &model) {
        let mine: Vec<&Row> = rows.iter().filter(|r| r.config == e.label).collect();
        assert!(!mine.is_empty(), "no row for {}", e.label);
        for r in &mine {
            assert_eq!(r.output.as_deref(), Some(e.output.name()), "{}", e.label);
            assert_eq!(r.keeps.as_deref(), Some(e.keeps.to_string().as_str()));
        }
        if let Some(why) = &mine[0].skipped {
            assert!(!why.is_empty() && mine.len() == 1, "{}: {mine:?}", e.label);
            assert!(mine[0].samples_ts.is_empty() && mine[0].ratio.is_none());
            continue;
        }
        assert!(e.run.is_ok(), "{} ran although the plan skips it", e.label);
        let tests: Vec<&str> = mine.iter().map(|r| r.test.as_str()).collect();
        assert_eq!(tests, ["pp16", "tg8"], "{}", e.label);
        for r in &mine {
            assert_eq!(r.samples_ts.len(), 1);
            assert_eq!(r.baseline_samples_ts.as_ref().map(Vec::len), Some(1));
            assert!(r.ratio.is_some_and(|x| x > 0.0) && r.ratio_ci.is_none());
            if e.output == Output::Identical {
                assert!(r.kl_mean.is_none() && r.kl_warn.is_none(), "{}", e.label);
                continue;
            }
            let (mean, max) = (r.kl_mean.unwrap(), r.kl_max.unwrap());
            assert!(mean.is_finite() && mean >= 0.0 && max >= mean, "{r:?}");
            assert!((0.0..=1.0).contains(&r.kl_top1.unwrap()));
            assert_eq!(r.kl_warn, Some(mean > 1e-3), "{}", e.label);
            warned |= mean > 1e-3;
        }
    }
    // 4-bit KV from the first token must move a float32 model's distributions.
    let q4 = rows
        .iter()
        .find(|r| r.config.starts_with("kv-quant 4"))
        .unwrap();
    assert!(
        q4.kl_identical == Some(false) && q4.kl_mean.unwrap() > 0.0,
        "{q4:?}"
    );
    let g128 = rows
        .iter()
        .find(|r| r.config.starts_with("kv-group-size 128"))
        .unwrap();
    assert!(
        g128.skipped.as_deref().unwrap().contains("head dim 64"),
        "{g128:?}"
    );
    assert_eq!(err.contains("WARN"), warned, "{err}");
    let back: Vec<Row> = serde_json::from_str(&serde_json::to_string(&rows).unwrap()).unwrap();
    assert_eq!(back, rows);
    assert_eq!(report::parse_csv(&report::csv(&rows)).unwrap(), rows);
    let md = report::matrix_markdown(&rows);
    assert!(md.contains("skipped: ") && md.contains("speedup (95% CI)"));
}

#[test]
fn bench_takes_the_fork_flags() {
    let dir = tempfile::tempdir().unwrap();
    let model = dir.path().join("m");
    tiny_model(&model);
    let small = ["-p", "8", "-n", "4", "-r", "1", "-o", "json"];
    let (code, out, err) = bench(
        &model,
        &[
            &small[..],
            &["--kv-quant", "8", "--quantized-kv-start", "0"],
        ]
        .concat(),
    );
    assert_eq!(code, 0, "{err}");
    let rows: Vec<Row> = serde_json::from_str(&out).unwrap();
    assert_eq!(rows.len(), 2);
    let (code, _, err) = bench(&model, &[&small[..], &["--fused-gelu", "on"]].concat());
    assert_eq!(code, 2, "{err}");
    assert!(err.contains("--fused-gelu on"));
    let (code, _, err) = bench(&model, &[&small[..], &["--matrix", "--l3"]].concat());
    assert_eq!(code, 2, "{err}");
    assert!(err.contains("drop the fork and tier flags"));
}
