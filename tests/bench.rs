//! `mlxb bench` end to end on a tiny model: rows parse back, results files refuse mixed
//! setups. Timing numbers themselves are never asserted.

mod common;

use mlxb::bench::report::{self, Row};
use serde_json::json;
use std::process::Command;

#[test]
fn bench_rows_parse_back_and_results_refuse_other_setups() {
    let dir = tempfile::tempdir().unwrap();
    let model = dir.path().join("m");
    common::make_model(
        &model,
        &json!({"model_type": "llama", "hidden_size": 64, "num_hidden_layers": 2, "intermediate_size": 128,
                "num_attention_heads": 4, "num_key_value_heads": 2, "rms_norm_eps": 1e-5, "vocab_size": 384}),
        "f32",
        None,
    );
    let run = |extra: &[&str]| {
        Command::new(common::mlxb())
            .args([
                "bench",
                "--model",
                model.to_str().unwrap(),
                "-p",
                "8",
                "-n",
                "4",
                "-d",
                "0,4",
                "-r",
                "2",
            ])
            .args(extra)
            .output()
            .unwrap()
    };
    let out = run(&["-o", "json", "--draft-kind", "ngram"]);
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let rows: Vec<Row> = serde_json::from_slice(&out.stdout).unwrap();
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
    assert!(run(&["--results", results.to_str().unwrap()])
        .status
        .success());
    assert!(
        run(&["--results", results.to_str().unwrap()])
            .status
            .success(),
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
    let out = run(&["--results", other.to_str().unwrap()]);
    assert_eq!(
        out.status.code(),
        Some(2),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(String::from_utf8_lossy(&out.stderr).contains("another setup"));
    assert_eq!(
        std::fs::read_to_string(&other).unwrap().lines().count(),
        1,
        "results file was modified"
    );
}

#[test]
fn bad_test_specs_are_clear_errors() {
    let out = Command::new(common::mlxb())
        .args(["bench", "--model", "/nonexistent", "-p", "0", "-n", "0"])
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(2));
    assert!(String::from_utf8_lossy(&out.stderr).contains("no tests selected"));
}
