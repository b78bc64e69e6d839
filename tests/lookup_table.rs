//! `mlxb lookup-table` and `--lookup-table`: a table built from the target's own replies is
//! drafted from (acceptance rises when its replies are the ones the target gives), never
//! changes what is emitted (also when its replies are wrong), and bad input (a file that is
//! not a table, a table of another model) exits 2 naming the file or flag.

mod common;

use serde_json::{json, Value};
use std::path::Path;

const VOCAB: u32 = 384;
const TOKENS: usize = 48;

/// A sequences file of `train-dspark` holding `reply` after `prompt`, four times.
fn write_sequences(path: &Path, prompt: &[u32], reply: &[u32]) {
    let ids: Vec<u32> = prompt.iter().chain(reply).copied().collect();
    let mut lines = vec![json!({"mlxb_sequences": 1, "vocab_size": VOCAB}).to_string()];
    lines.extend((0..4).map(|j| {
        json!({"prompt": j, "prompt_sha256": "x", "ids": ids, "reply_from": prompt.len()})
            .to_string()
    }));
    std::fs::write(path, lines.join("\n") + "\n").unwrap();
}

/// `mlxb lookup-table --sequences SEQS --out OUT --json` plus `extra`.
fn build(seqs: &Path, out: &Path, extra: &[&str]) -> (i32, Value, String) {
    let mut args = vec![
        "lookup-table",
        "--sequences",
        seqs.to_str().unwrap(),
        "--out",
        out.to_str().unwrap(),
        "--json",
    ];
    args.extend_from_slice(extra);
    common::run_mlxb_json(&args, &[])
}

/// Greedy `generate --json` of the tiny model at `model` on `prompt`, with `extra` flags.
fn generate(model: &Path, prompt: &str, extra: &[&str]) -> (i32, Value, String) {
    let tokens = TOKENS.to_string();
    let mut args = vec![
        "generate",
        "--model",
        model.to_str().unwrap(),
        "--prompt-ids",
        prompt,
        "--max-tokens",
        &tokens,
        "--json",
    ];
    args.extend_from_slice(extra);
    common::run_mlxb_json(&args, &[])
}

fn ids(v: &Value) -> Vec<u32> {
    common::json_ids(&v["token_ids"])
}

fn accepted(v: &Value) -> u64 {
    v["speculative"]["accepted_tokens"]
        .as_u64()
        .unwrap_or_else(|| panic!("no accepted_tokens in {v}"))
}

#[test]
fn a_table_of_the_targets_replies_is_drafted_from_and_changes_nothing() {
    let tmp = tempfile::tempdir().unwrap();
    let model = tmp.path().join("model");
    common::make_model(&model, &common::tiny_llama(json!({})), "f32", None);
    let prompt = common::prompt_ids(20, VOCAB, 5);
    let prompt_arg = common::ids_arg(&prompt);
    let (code, vanilla, err) = generate(&model, &prompt_arg, &[]);
    assert_eq!(code, 0, "{err}");
    let vanilla = ids(&vanilla);
    assert_eq!(vanilla.len(), TOKENS);

    // The table of the target's own reply, and one of a reply it never gives.
    let right = tmp.path().join("right.safetensors");
    let seqs = tmp.path().join("right.jsonl");
    write_sequences(&seqs, &prompt, &vanilla);
    let (code, summary, err) = build(&seqs, &right, &[]);
    assert_eq!(code, 0, "{err}");
    assert_eq!(summary["sequences"], 4);
    assert_eq!(summary["reply_tokens"], 4 * TOKENS);
    let kept = summary["ngrams_by_order"].as_array().unwrap();
    assert_eq!(kept.len(), 4);
    assert!(kept.iter().all(|k| k.as_u64().unwrap() > 0), "{summary}");
    let wrong = tmp.path().join("wrong.safetensors");
    let shifted: Vec<u32> = vanilla.iter().map(|t| (t + 1) % VOCAB).collect();
    write_sequences(&seqs, &prompt, &shifted);
    let (code, _, err) = build(&seqs, &wrong, &[]);
    assert_eq!(code, 0, "{err}");

    // Every round drafts (`--draft-policy all`): under `cost`, which rounds draft depends on
    // timing, and the runs are compared by their counts.
    let ngram = [
        "--draft-kind",
        "ngram",
        "--num-draft-tokens",
        "4",
        "--draft-policy",
        "all",
    ];
    let run = |table: Option<&Path>| {
        let mut extra = ngram.to_vec();
        if let Some(t) = table {
            extra.extend(["--lookup-table", t.to_str().unwrap()]);
        }
        let (code, v, err) = generate(&model, &prompt_arg, &extra);
        assert_eq!(code, 0, "{err}");
        assert_eq!(ids(&v), vanilla, "table {table:?} changed the output");
        accepted(&v)
    };
    let alone = run(None);
    let with_right = run(Some(&right));
    let with_wrong = run(Some(&wrong));
    // The right table proposes the reply from the first round on: most tokens are accepted
    // drafts, and more than the sequence's own n-grams give.
    assert!(
        with_right > alone && with_right as usize >= TOKENS / 2,
        "accepted drafts: {with_right} with the right table, {alone} without"
    );
    assert!(
        with_wrong <= alone,
        "a table of wrong replies was accepted more ({with_wrong}) than none ({alone})"
    );

    // `none` turns a table off; a table is refused where nothing would consult it.
    let (code, v, err) = generate(
        &model,
        &prompt_arg,
        &[&ngram[..], &["--lookup-table", "none"]].concat(),
    );
    assert_eq!(code, 0, "{err}");
    assert_eq!(accepted(&v), alone);
    let (code, _, err) = generate(
        &model,
        &prompt_arg,
        &[
            "--draft-kind",
            "self",
            "--draft-layers",
            "1",
            "--lookup-table",
            right.to_str().unwrap(),
        ],
    );
    common::assert_refused(
        "a table for the self drafter",
        code,
        &err,
        &["--lookup-table", "--lookup-first"],
    );
}

#[test]
fn bad_tables_and_settings_exit_2_naming_the_file_or_flag() {
    let tmp = tempfile::tempdir().unwrap();
    let seqs = tmp.path().join("seqs.jsonl");
    write_sequences(&seqs, &[1, 2, 3], &[4, 5, 6, 4, 5, 6]);
    let out = tmp.path().join("t.safetensors");
    let (code, _, err) = build(&seqs, &out, &["--min-share", "2"]);
    common::assert_refused("--min-share 2", code, &err, &["--min-share"]);
    let (code, _, err) = build(&seqs, &out, &["--min-count", "0"]);
    common::assert_refused("--min-count 0", code, &err, &["--min-count"]);
    let (code, _, err) = build(&seqs, &out, &["--min-count", "100"]);
    common::assert_refused(
        "--min-count 100",
        code,
        &err,
        &["seqs.jsonl", "--min-count"],
    );
    let prompts = tmp.path().join("prompts.jsonl");
    std::fs::write(&prompts, "{\"prompt\": \"hi\"}\n").unwrap();
    let (code, _, err) = build(&prompts, &out, &[]);
    common::assert_refused("a prompt file", code, &err, &["prompts.jsonl"]);
    assert!(!out.exists(), "a refusal wrote the table");

    // A file that is not a table, given to a drafter: refused before any decoding, named.
    let model = tmp.path().join("model");
    common::make_model(&model, &common::tiny_llama(json!({})), "f32", None);
    let not_table = tmp.path().join("weights.safetensors");
    std::fs::copy(model.join("model.safetensors"), &not_table).unwrap();
    // A table of another model's replies (ids past this target's 384).
    let other = tmp.path().join("other-model.safetensors");
    write_sequences(&seqs, &[1, 2, 3], &[400, 500, 400, 500]);
    let (code, _, err) = build(&seqs, &other, &[]);
    assert_eq!(code, 0, "{err}");
    for table in [
        &not_table,
        &prompts,
        &tmp.path().join("missing.safetensors"),
        &other,
    ] {
        let (code, _, err) = generate(
            &model,
            "1,2,3",
            &[
                "--draft-kind",
                "ngram",
                "--lookup-table",
                table.to_str().unwrap(),
            ],
        );
        let name = table.file_name().unwrap().to_str().unwrap();
        common::assert_refused(name, code, &err, &[name]);
    }
}
