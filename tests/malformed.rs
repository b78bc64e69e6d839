//! The malformed-input suite (issue #13): hand-made broken models, DSpark checkpoints, prompt
//! files, GGUF files and flag combinations. Every case must end in one sentence on stderr that
//! names the file or flag at fault, exit code 2, no panic, and leave every file it was given
//! byte-identical with no new file or directory (no partial output) next to them.
//!
//! `tests/bad_input.rs`, `tests/dspark.rs` and `tests/gguf_import.rs` hold other broken inputs;
//! none of theirs is repeated here.

mod common;

use serde_json::{json, Value};
use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::sync::OnceLock;

/// Inputs every case starts from: a tiny llama, a DSpark drafter for it, a good prompt file.
struct Fixture {
    _root: tempfile::TempDir,
    model: PathBuf,
    drafter: PathBuf,
    prompts: PathBuf,
}

fn fixture() -> &'static Fixture {
    static F: OnceLock<Fixture> = OnceLock::new();
    F.get_or_init(|| {
        let root = tempfile::tempdir().unwrap();
        let model = root.path().join("model");
        let mut config = common::tiny_llama(json!({}));
        config["num_hidden_layers"] = json!(2);
        common::make_model(&model, &config, "f32", None);
        let drafter = root.path().join("drafter");
        let (code, _, err) = common::run_mlxb(&common::dspark_init_args(
            model.to_str().unwrap(),
            drafter.to_str().unwrap(),
            &[],
        ));
        assert_eq!(code, 0, "dspark-init failed: {err}");
        let prompts = root.path().join("prompts.jsonl");
        std::fs::write(&prompts, "{\"prompt\": \"hello there\"}\n").unwrap();
        Fixture {
            _root: root,
            model,
            drafter,
            prompts,
        }
    })
}

impl Fixture {
    fn model(&self) -> &str {
        self.model.to_str().unwrap()
    }
    fn drafter(&self) -> &str {
        self.drafter.to_str().unwrap()
    }
    fn prompts(&self) -> &str {
        self.prompts.to_str().unwrap()
    }
}

/// Every file and directory under `root`: relative path → contents (`None` for directories).
fn snapshot(root: &Path) -> BTreeMap<PathBuf, Option<Vec<u8>>> {
    let mut out = BTreeMap::new();
    let mut stack = vec![root.to_path_buf()];
    while let Some(dir) = stack.pop() {
        for e in std::fs::read_dir(&dir).unwrap() {
            let p = e.unwrap().path();
            let rel = p.strip_prefix(root).unwrap().to_path_buf();
            if p.is_dir() {
                stack.push(p);
                out.insert(rel, None);
            } else {
                out.insert(rel, Some(std::fs::read(&p).unwrap()));
            }
        }
    }
    out
}

/// One way of breaking a JSON file.
type JsonEdit = Box<dyn Fn(&mut Value)>;

/// Rewrites the JSON file `path` through `f`.
fn edit_json(path: &Path, f: impl FnOnce(&mut Value)) {
    let mut v: Value = serde_json::from_slice(&std::fs::read(path).unwrap()).unwrap();
    f(&mut v);
    std::fs::write(path, v.to_string()).unwrap();
}

/// Rewrites the header of the safetensors file `path` through `f` (data kept as is).
fn edit_safetensors_header(path: &Path, f: impl FnOnce(&mut Value)) {
    let bytes = std::fs::read(path).unwrap();
    let n = u64::from_le_bytes(bytes[..8].try_into().unwrap()) as usize;
    let mut header: Value = serde_json::from_slice(&bytes[8..8 + n]).unwrap();
    f(&mut header);
    let h = header.to_string().into_bytes();
    let mut out = (h.len() as u64).to_le_bytes().to_vec();
    out.extend_from_slice(&h);
    out.extend_from_slice(&bytes[8 + n..]);
    std::fs::write(path, out).unwrap();
}

/// The cases of one group, each in its own directory under one scratch root.
struct Suite {
    root: tempfile::TempDir,
    count: usize,
}

impl Suite {
    fn new() -> Self {
        let _ = fixture();
        Suite {
            root: tempfile::tempdir().unwrap(),
            count: 0,
        }
    }

    /// A fresh directory for the case `name` (the command's working directory).
    fn dir(&self, name: &str) -> PathBuf {
        let d = self.root.path().join(name);
        std::fs::create_dir(&d).unwrap();
        d
    }

    /// A copy of the fixture model in the case directory `name`, with `break_it` applied.
    fn model(&self, name: &str, break_it: impl FnOnce(&Path)) -> PathBuf {
        let d = self.dir(name).join("model");
        common::copy_dir(&fixture().model, &d);
        break_it(&d);
        d
    }

    /// A copy of the fixture drafter in the case directory `name`, with `break_it` applied.
    fn drafter(&self, name: &str, break_it: impl FnOnce(&Path)) -> PathBuf {
        let d = self.dir(name).join("drafter");
        common::copy_dir(&fixture().drafter, &d);
        break_it(&d);
        d
    }

    /// Runs `mlxb args` in `dir` (stdin from `stdin`) and checks the refusal: exit code 2, one
    /// line, no panic, every needle present, and `dir` and the fixtures exactly as they were.
    fn refuse(&mut self, dir: &Path, args: &[&str], stdin: &[u8], needles: &[&str]) {
        let fx = fixture();
        let before = (snapshot(dir), snapshot(&fx.model), snapshot(&fx.drafter));
        let (code, _, err) = common::run(
            common::mlxb_command(args)
                .current_dir(dir)
                .env("HF_HUB_OFFLINE", "1"),
            stdin,
        );
        let what = format!("`mlxb {}` in {}", args.join(" "), dir.display());
        common::assert_refused(&what, code, &err, needles);
        let after = (snapshot(dir), snapshot(&fx.model), snapshot(&fx.drafter));
        assert!(
            before.0 == after.0,
            "{what}: the case directory changed: {:?} → {:?}",
            before.0.keys().collect::<Vec<_>>(),
            after.0.keys().collect::<Vec<_>>()
        );
        assert!(
            before.1 == after.1 && before.2 == after.2,
            "{what}: a fixture changed"
        );
        self.count += 1;
    }

    /// `mlxb generate --model MODEL --prompt hi --max-tokens 2 EXTRA...` must be refused.
    /// `generate` on the broken model `m` (a copy in its case directory) must refuse it.
    fn refuse_model(&mut self, m: &Path, needles: &[&str]) {
        let dir = m.parent().unwrap().to_path_buf();
        self.refuse_generate(&dir, m, &[], needles);
    }

    fn refuse_generate(&mut self, dir: &Path, model: &Path, extra: &[&str], needles: &[&str]) {
        let mut args = vec![
            "generate",
            "--model",
            model.to_str().unwrap(),
            "--prompt",
            "hi",
            "--max-tokens",
            "2",
        ];
        args.extend_from_slice(extra);
        self.refuse(dir, &args, b"", needles);
    }
}

#[test]
fn broken_models_are_refused_and_left_untouched() {
    let mut s = Suite::new();
    let config_cases: Vec<(&str, JsonEdit, Vec<&str>)> = vec![
        (
            "zero_layers",
            Box::new(|c| c["num_hidden_layers"] = json!(0)),
            vec![
                "config.json",
                "`num_hidden_layers` is 0; it must be a positive size",
            ],
        ),
        (
            // Found by fuzzing (fixed in 0739813): qwen3_5_moe's sanitize looped over every
            // layer formatting tensor names before any tensor was required (minutes).
            "huge_layer_count",
            Box::new(|c| {
                c["model_type"] = json!("qwen3_5_moe");
                c["num_hidden_layers"] = json!(12777778);
            }),
            vec![
                "config.json",
                "`num_hidden_layers` is 12777778; mlxb accepts at most 10000",
            ],
        ),
        (
            "nested_huge_expert_count",
            Box::new(|c| {
                c["model_type"] = json!("qwen3_5_moe");
                c["text_config"] = json!({"num_experts": 2147483647});
            }),
            vec!["config.json", "`text_config.num_experts` is 2147483647"],
        ),
        (
            "negative_hidden",
            Box::new(|c| c["hidden_size"] = json!(-64)),
            vec![
                "config.json",
                "`hidden_size` is -64; it must be a positive size",
            ],
        ),
        (
            "zero_intermediate",
            Box::new(|c| c["intermediate_size"] = json!(0)),
            vec!["config.json", "`intermediate_size` is 0"],
        ),
        (
            "negative_vocab",
            Box::new(|c| c["vocab_size"] = json!(-384)),
            vec!["config.json", "`vocab_size` is -384"],
        ),
        (
            "qwen3_negative_head_dim",
            Box::new(|c| {
                c["model_type"] = json!("qwen3");
                c["head_dim"] = json!(-16);
            }),
            vec!["config.json", "`head_dim` is -16"],
        ),
        (
            "gemma3_negative_heads",
            Box::new(|c| {
                c["model_type"] = json!("gemma3_text");
                c["num_attention_heads"] = json!(-4);
            }),
            vec!["config.json", "`num_attention_heads` is -4"],
        ),
        (
            "qwen3_5_nested_negative",
            Box::new(|c| {
                c["model_type"] = json!("qwen3_5");
                c["text_config"] = json!({"linear_num_key_heads": -2});
            }),
            vec!["config.json", "`text_config.linear_num_key_heads` is -2"],
        ),
        (
            "moe_negative_experts",
            Box::new(|c| {
                c["model_type"] = json!("qwen3_moe");
                c["num_experts"] = json!(-4);
            }),
            vec![
                "config.json",
                "`num_experts` is -4; it must be zero or more",
            ],
        ),
        (
            "unknown_rope",
            Box::new(|c| c["rope_scaling"] = json!({"rope_type": "weird", "factor": 2.0})),
            vec!["config.json", "rope_scaling type \"weird\""],
        ),
        (
            "quant_not_object",
            Box::new(|c| c["quantization"] = json!(4)),
            vec!["config.json", "`quantization` must be an object"],
        ),
        (
            "quant_mode",
            Box::new(|c| c["quantization"] = json!({"group_size": 64, "bits": 4, "mode": "mxfp4"})),
            vec!["config.json", "`quantization.mode` is \"mxfp4\""],
        ),
        (
            "config_array",
            Box::new(|c| *c = json!([1, 2])),
            vec!["config.json", "`model_type` is missing"],
        ),
        (
            "tie_string",
            Box::new(|c| c["tie_word_embeddings"] = json!("yes")),
            vec!["config.json", "expected a boolean"],
        ),
        (
            "eps_null",
            Box::new(|c| c["rms_norm_eps"] = Value::Null),
            vec!["config.json", "invalid type: null"],
        ),
        (
            "vocab_off_by_one",
            Box::new(|c| c["vocab_size"] = json!(385)),
            vec![
                "model.embed_tokens.weight",
                "shape [384, 64], expected [385, 64]",
            ],
        ),
    ];
    for (name, edit, needles) in config_cases {
        let m = s.model(name, |d| edit_json(&d.join("config.json"), edit));
        s.refuse_generate(m.parent().unwrap(), &m, &[], &needles);
    }

    let m = s.model("no_config", |d| {
        std::fs::remove_file(d.join("config.json")).unwrap()
    });
    s.refuse_model(&m, &["config.json", "cannot read config.json"]);
    let m = s.model("no_tokenizer", |d| {
        std::fs::remove_file(d.join("tokenizer.json")).unwrap()
    });
    s.refuse_model(&m, &["tokenizer.json", "is missing"]);
    let m = s.model("empty_tokenizer", |d| {
        std::fs::write(d.join("tokenizer.json"), "{}").unwrap()
    });
    s.refuse_model(
        &m,
        &[
            "tokenizer.json",
            "is not a tokenizer the tokenizers library can load",
        ],
    );
    // Found by fuzzing: the tokenizers crate panicked on both (an `expect` in its decoder and
    // `Precompiled` normalizer deserialization).
    let m = s.model("tokenizer_key_not_utf8", |d| {
        let path = d.join("tokenizer.json");
        let b = std::fs::read(&path).unwrap();
        let key = b"\"add_prefix_space\"";
        let at = b.windows(9).position(|w| w == b"\"decoder\"").unwrap();
        let at = at + b[at..].windows(key.len()).position(|w| w == key).unwrap();
        let mut broken = b[..at].to_vec();
        broken.extend_from_slice(b"\"a\xfe\xfedd_prefix_space\"");
        broken.extend_from_slice(&b[at + key.len()..]);
        std::fs::write(&path, broken).unwrap();
    });
    s.refuse_model(
        &m,
        &[
            "tokenizer.json",
            "is not valid JSON",
            "invalid unicode code point",
        ],
    );
    let m = s.model("tokenizer_bad_precompiled", |d| {
        edit_json(&d.join("tokenizer.json"), |t| {
            t["normalizer"] = json!({"type": "Precompiled", "precompiled_charsmap": 5})
        })
    });
    s.refuse_model(
        &m,
        &[
            "tokenizer.json",
            "is not a tokenizer the tokenizers library can load",
            "Precompiled",
        ],
    );
    // Found by fuzzing (fixed in cd94c13): the tokenizers crate loads this post-processor but
    // panics encoding with it (its special-token map's key differs from the token's `id`).
    let m = s.model("tokenizer_template_key_mismatch", |d| {
        edit_json(&d.join("tokenizer.json"), |t| {
            t["post_processor"] = json!({
                "type": "TemplateProcessing",
                "single": [{"SpecialToken": {"id": "<|im_start|>", "type_id": 0}},
                           {"Sequence": {"id": "A", "type_id": 0}}],
                "pair": [{"Sequence": {"id": "A", "type_id": 0}},
                         {"Sequence": {"id": "B", "type_id": 1}}],
                "special_tokens": {"<|im_sta_rt|>": {"id": "<|im_start|>", "ids": [1],
                                                     "tokens": ["<|im_start|>"]}}
            })
        })
    });
    s.refuse_model(
        &m,
        &[
            "tokenizer.json",
            "is not a tokenizer the tokenizers library can run",
        ],
    );
    let m = s.model("bad_tokenizer_config", |d| {
        std::fs::write(d.join("tokenizer_config.json"), "{bad").unwrap()
    });
    s.refuse_model(&m, &["tokenizer_config.json", "is not valid JSON"]);
    let m = s.model("broken_template", |d| {
        edit_json(&d.join("tokenizer_config.json"), |c| {
            c["chat_template"] = json!("{% for m in messages %}{{ m.content ")
        })
    });
    s.refuse_model(
        &m,
        &[
            "tokenizer_config.json",
            "chat template that does not compile",
        ],
    );

    let st = |d: &Path| d.join("model.safetensors");
    let m = s.model("huge_header_length", |d| {
        let mut b = std::fs::read(st(d)).unwrap();
        b[..8].copy_from_slice(&(1u64 << 40).to_le_bytes());
        std::fs::write(st(d), b).unwrap();
    });
    s.refuse_model(
        &m,
        &["model.safetensors", "header length points past the end"],
    );
    let m = s.model("three_bytes", |d| std::fs::write(st(d), b"abc").unwrap());
    s.refuse_model(&m, &["model.safetensors", "shorter than its 8-byte header"]);
    let m = s.model("no_offsets", |d| {
        edit_safetensors_header(&st(d), |h| {
            h["model.norm.weight"]
                .as_object_mut()
                .unwrap()
                .remove("data_offsets");
        })
    });
    s.refuse_model(
        &m,
        &[
            "model.safetensors",
            "`model.norm.weight` has no data_offsets",
        ],
    );
    let m = s.model("unknown_dtype", |d| {
        edit_safetensors_header(&st(d), |h| h["model.norm.weight"]["dtype"] = json!("Q7"))
    });
    s.refuse_model(&m, &["model.safetensors", "unsupported dtype Q7"]);
    let m = s.model("shape_vs_offsets", |d| {
        edit_safetensors_header(&st(d), |h| h["model.norm.weight"]["shape"] = json!([3, 3]))
    });
    s.refuse_model(&m, &["model.safetensors", "invalid data offsets"]);
    let m = s.model("models_cmd", |d| {
        std::fs::write(d.join("config.json"), "[]").unwrap()
    });
    s.refuse(
        m.parent().unwrap(),
        &["models", "--model", m.to_str().unwrap()],
        b"",
        &["is not supported", "`model_type` is missing"],
    );
    assert_eq!(s.count, 31);
}

#[test]
fn broken_drafters_are_refused_and_left_untouched() {
    let mut s = Suite::new();
    let model = fixture().model.clone();
    let json_cases: Vec<(&str, JsonEdit, &str)> = vec![
        (
            "seq_head",
            Box::new(|c| c["seq_head"] = json!("lstm")),
            "unknown variant `lstm`",
        ),
        (
            "block_zero",
            Box::new(|c| c["block_size"] = json!(0)),
            "`block_size` is 0",
        ),
        (
            "sts_length",
            Box::new(|c| {
                c["thresholds"] = json!([0.5, 0.5, 0.5, 0.5]);
                c["sts_temperatures"] = json!([1.0]);
            }),
            "`sts_temperatures` has 1 entries but `block_size` is 4",
        ),
        (
            "threshold_range",
            Box::new(|c| c["thresholds"] = json!([0.5, 2.0, 0.1, 0.1])),
            "`thresholds` must all lie in [0, 1]",
        ),
        (
            "layer_style",
            Box::new(|c| c["layer_style"] = json!("gpt2")),
            "unknown variant `gpt2`",
        ),
        (
            "head_dim_zero",
            Box::new(|c| c["head_dim"] = json!(0)),
            "`head_dim` is 0",
        ),
    ];
    for (name, edit, needle) in json_cases {
        let d = s.drafter(name, |d| edit_json(&d.join("dspark.json"), edit));
        s.refuse_generate(
            d.parent().unwrap(),
            &model,
            &["--drafter", d.to_str().unwrap()],
            &["dspark.json", needle],
        );
    }
    let d = s.drafter("no_weights", |d| {
        std::fs::remove_file(d.join("model.safetensors")).unwrap()
    });
    s.refuse_generate(
        d.parent().unwrap(),
        &model,
        &["--drafter", d.to_str().unwrap()],
        &["drafter", "no model*.safetensors files found"],
    );
    let d = s.drafter("truncated_weights", |d| {
        let p = d.join("model.safetensors");
        let b = std::fs::read(&p).unwrap();
        std::fs::write(&p, &b[..b.len() / 2]).unwrap();
    });
    s.refuse_generate(
        d.parent().unwrap(),
        &model,
        &["--drafter", d.to_str().unwrap()],
        &["model.safetensors", "extends past the end of the file"],
    );
    let d = s.drafter("deepspec_bad_json", |d| {
        std::fs::remove_file(d.join("dspark.json")).unwrap();
        std::fs::write(d.join("config.json"), "{oops").unwrap();
    });
    s.refuse_generate(
        d.parent().unwrap(),
        &model,
        &["--drafter", d.to_str().unwrap()],
        &["config.json", "is not valid JSON"],
    );
    let dir = s.dir("min_conf");
    s.refuse_generate(
        &dir,
        &model,
        &["--drafter", fixture().drafter(), "--dspark-min-conf", "2"],
        &["--dspark-min-conf 2.0 is out of range"],
    );
    // An existing drafter is never overwritten by a new run.
    /// `train-dspark` of the fixture model and prompts into `out`.
    fn train_into(out: &str) -> Vec<&str> {
        let fx = fixture();
        vec![
            "train-dspark",
            "--model",
            fx.model(),
            "--data",
            fx.prompts(),
            "--out",
            out,
        ]
    }
    let dir = s.dir("train_over_drafter");
    let fx = fixture();
    s.refuse(
        &dir,
        &train_into(fx.drafter()),
        b"",
        &["already holds a DSpark checkpoint", "--resume"],
    );
    // A broken training state is refused before the target cache is built (nothing written).
    let d = s.drafter("resume_corrupt_state", |d| {
        std::fs::write(d.join("train-state.safetensors"), b"not a safetensors file").unwrap()
    });
    let mut args = train_into(d.to_str().unwrap());
    args.push("--resume");
    s.refuse(
        d.parent().unwrap(),
        &args,
        b"",
        &["train-state.safetensors", "start without --resume"],
    );
    let dir = s.dir("init_over_drafter");
    s.refuse(
        &dir,
        &["dspark-init", "--model", fx.model(), "--out", fx.drafter()],
        b"",
        &["already holds a DSpark checkpoint", "--force"],
    );
    assert_eq!(s.count, 13);
}

#[test]
fn broken_prompt_files_are_refused_before_anything_is_written() {
    let mut s = Suite::new();
    let cases: [(&str, &[u8], &str); 7] = [
        (
            "not_a_string",
            b"{\"prompt\": \"a\"}\n{\"prompt\": 3}\n",
            "line 2: no `prompt` string",
        ),
        (
            "not_json",
            b"{\"prompt\": \"a\"}\nnot json\n",
            "line 2: not valid JSON",
        ),
        (
            "no_content",
            b"{\"messages\": [{\"role\": \"user\"}]}\n",
            "line 1: a message lacks a `role` or `content` string",
        ),
        ("empty", b"\n\n", "the prompt file holds no prompts"),
        (
            "not_utf8",
            b"\xff\xfe{\"prompt\": \"a\"}\n",
            "cannot read the prompt file",
        ),
        (
            "messages_string",
            b"{\"messages\": \"hi\"}\n",
            "line 1: no `prompt` string",
        ),
        ("array_line", b"[1, 2]\n", "line 1: no `prompt` string"),
    ];
    let model = fixture().model();
    for (name, text, needle) in cases {
        let dir = s.dir(name);
        std::fs::write(dir.join("p.jsonl"), text).unwrap();
        s.refuse(
            &dir,
            &[
                "train-dspark",
                "--model",
                model,
                "--data",
                "p.jsonl",
                "--out",
                "out",
            ],
            b"",
            &["p.jsonl", needle],
        );
    }
    let dir = s.dir("missing");
    s.refuse(
        &dir,
        &[
            "train-dspark",
            "--model",
            model,
            "--data",
            "none.jsonl",
            "--out",
            "out",
        ],
        b"",
        &["none.jsonl", "cannot read the prompt file"],
    );
    assert_eq!(s.count, 8);
}

#[test]
fn contradictory_or_out_of_range_flags_are_refused() {
    let mut s = Suite::new();
    let fx = fixture();
    let model = fx.model.clone();
    let d = fx.drafter();
    let generate_cases: [(&str, &[&str], &[&str]); 16] = [
        (
            "top_p",
            &["--top-p", "2"],
            &["`--top-p` must be between 0 and 1"],
        ),
        (
            "lookup_before_ngram",
            &["--draft-kind", "ngram", "--lookup-first", "2"],
            &["--lookup-first", "drop --lookup-first or set --ngram-min"],
        ),
        (
            "ngram_range",
            &[
                "--draft-kind",
                "ngram",
                "--ngram-min",
                "3",
                "--ngram-max",
                "1",
            ],
            &["--ngram-min 3 / --ngram-max 1"],
        ),
        (
            "fused_gelu",
            &["--fused-gelu", "on"],
            &["--fused-gelu on", "use --fused-gelu off"],
        ),
        (
            "no_drafts",
            &["--draft-kind", "ngram", "--num-draft-tokens", "0"],
            &["--num-draft-tokens must be at least 1"],
        ),
        (
            "draft_layers",
            &["--draft-layers", "9"],
            &["--draft-layers 9 is out of range"],
        ),
        (
            "trace_dir",
            &[
                "--draft-kind",
                "ngram",
                "--spec-trace",
                "no/such/dir/t.jsonl",
            ],
            &["no/such/dir/t.jsonl", "cannot create the trace file"],
        ),
        (
            "policy_without_drafter",
            &["--draft-policy", "all"],
            &[
                "--draft-policy decides which speculative rounds draft",
                "give a drafter",
            ],
        ),
        (
            "prompt_ids",
            &["--prompt-ids", "1,2,99999"],
            &["--prompt-ids has id 99999", "vocabulary of 384"],
        ),
        (
            "drafter_vs_ngram",
            &["--drafter", d, "--draft-kind", "ngram"],
            &[
                "--drafter",
                "--draft-kind ngram",
                "drop one of the two flags",
            ],
        ),
        (
            "drafter_vs_draft_model",
            &["--drafter", d, "--draft-model", d],
            &["--drafter and --draft-model both name a drafter"],
        ),
        (
            "draft_model_vs_ngram",
            &["--draft-model", d, "--draft-kind", "ngram"],
            &["--draft-model is not used by --draft-kind ngram"],
        ),
        (
            "draft_model_unknown",
            &["--draft-model", "no-such-model"],
            &[
                "--draft-model no-such-model: no such directory or built-in model",
                "smollm2-135m-instruct",
            ],
        ),
        (
            "draft_layers_vs_ngram",
            &["--draft-kind", "ngram", "--draft-layers", "1"],
            &["--draft-layers is only used by --draft-kind self", "ngram"],
        ),
        (
            "no_lookup_tokens",
            &["--drafter", d, "--lookup-tokens", "0"],
            &["--lookup-tokens must be at least 1"],
        ),
        (
            "lookup_tokens_without_lookup",
            &[
                "--drafter",
                d,
                "--lookup-first",
                "0",
                "--lookup-tokens",
                "2",
            ],
            &[
                "--lookup-tokens",
                "add --lookup-first N or drop --lookup-tokens",
            ],
        ),
    ];
    for (name, extra, needles) in generate_cases {
        let dir = s.dir(name);
        s.refuse_generate(&dir, &model, extra, needles);
    }
    let dir = s.dir("stdin_not_utf8");
    s.refuse(
        &dir,
        &[
            "generate",
            "--model",
            fx.model(),
            "--prompt",
            "-",
            "--max-tokens",
            "2",
        ],
        b"\xff\xfe",
        &["--prompt -", "UTF-8"],
    );

    let train = |extra: &[&'static str]| -> Vec<&str> {
        let mut a = vec![
            "train-dspark",
            "--model",
            fx.model(),
            "--data",
            fx.prompts(),
            "--out",
            "out",
        ];
        a.extend_from_slice(extra);
        a
    };
    let init = |extra: &[&'static str]| -> Vec<&str> {
        let mut a = vec!["dspark-init", "--model", fx.model(), "--out", "out"];
        a.extend_from_slice(extra);
        a
    };
    let flag_cases: Vec<(&str, Vec<&str>, &[&str])> = vec![
        (
            "batch_zero",
            train(&["--batch", "0"]),
            &["--batch, --anchors and --checkpoint-every must be at least 1"],
        ),
        (
            "resume_nothing",
            train(&["--resume"]),
            &["out", "holds no training state to resume"],
        ),
        ("gamma_zero", train(&["--gamma", "0"]), &["--gamma 0"]),
        ("layers_zero", init(&["--layers", "0"]), &["--layers 0"]),
        (
            "markov_rank_zero",
            init(&["--seq-head", "rnn", "--markov-rank", "0"]),
            &["--markov-rank 0"],
        ),
        (
            "mask_token",
            init(&["--mask-token-id", "100000"]),
            &["--mask-token-id 100000", "vocabulary of 384"],
        ),
        (
            "tap_layers",
            init(&["--tap-layers", "5"]),
            &["tapped layer 5 is out of range"],
        ),
        (
            "unknown_model",
            vec!["generate", "--model", "no-such-model", "--prompt", "hi"],
            &[
                "--model no-such-model",
                "no such directory or built-in model",
            ],
        ),
        (
            "measure_drafter_vs_self",
            vec![
                "measure",
                "--model",
                fx.model(),
                "--data",
                fx.prompts(),
                "--drafter",
                d,
                "--draft-kind",
                "self",
            ],
            &["--drafter", "--draft-kind self"],
        ),
        (
            "serve_drafter_vs_model",
            vec![
                "serve",
                "--model",
                fx.model(),
                "--drafter",
                d,
                "--draft-kind",
                "model",
            ],
            &["--drafter", "--draft-kind model"],
        ),
        (
            "serve_limit",
            vec!["serve", "--model", fx.model(), "--max-tokens-limit", "0"],
            &["--max-tokens-limit must be at least 1"],
        ),
        (
            "serve_prompt_concurrency",
            vec!["serve", "--model", fx.model(), "--prompt-concurrency", "0"],
            &["--prompt-concurrency must be at least 1"],
        ),
        (
            "bench_drafter_vs_ngram",
            vec![
                "bench",
                "--model",
                fx.model(),
                "--drafter",
                d,
                "--draft-kind",
                "ngram",
            ],
            &["--drafter", "--draft-kind ngram"],
        ),
    ];
    for (name, args, needles) in flag_cases {
        let dir = s.dir(name);
        s.refuse(&dir, &args, b"", needles);
    }
    assert_eq!(s.count, 30);
}

/// A hand-made GGUF file, byte by byte (little endian, as the format is).
#[derive(Default)]
struct Gguf(Vec<u8>);

impl Gguf {
    /// Magic, version and the two counts.
    fn header(version: u32, n_tensors: u64, n_kv: u64) -> Self {
        Gguf(b"GGUF".to_vec()).u32(version).u64(n_tensors).u64(n_kv)
    }
    fn u32(mut self, v: u32) -> Self {
        self.0.extend_from_slice(&v.to_le_bytes());
        self
    }
    fn u64(mut self, v: u64) -> Self {
        self.0.extend_from_slice(&v.to_le_bytes());
        self
    }
    fn raw(mut self, b: &[u8]) -> Self {
        self.0.extend_from_slice(b);
        self
    }
    fn str(self, s: &[u8]) -> Self {
        self.u64(s.len() as u64).raw(s)
    }
    /// A string metadata entry.
    fn kv_str(self, key: &str, value: &str) -> Self {
        self.str(key.as_bytes()).u32(8).str(value.as_bytes())
    }
    /// A u32 metadata entry.
    fn kv_u32(self, key: &str, value: u32) -> Self {
        self.str(key.as_bytes()).u32(4).u32(value)
    }
    /// One tensor directory entry.
    fn tensor(self, name: &str, dims: &[u64], ty: u32, offset: u64) -> Self {
        let mut g = self.str(name.as_bytes()).u32(dims.len() as u32);
        for &d in dims {
            g = g.u64(d);
        }
        g.u32(ty).u64(offset)
    }
    /// Zero bytes up to the next multiple of 32 and then `data` more (the tensor data).
    fn data(self, data: usize) -> Self {
        let pad = self.0.len().div_ceil(32) * 32 - self.0.len() + data;
        self.raw(&vec![0u8; pad])
    }
}

#[test]
fn broken_gguf_files_are_refused_without_partial_output() {
    let mut s = Suite::new();
    let arch = || Gguf::header(3, 1, 1).kv_str("general.architecture", "llama");
    let q4_0 = 2;
    let cases: Vec<(&str, Gguf, Vec<&str>)> = vec![
        ("empty", Gguf::default(), vec!["is not a GGUF file"]),
        (
            "version_1",
            Gguf::header(1, 0, 0),
            vec!["has GGUF version 1"],
        ),
        (
            "tensor_count",
            Gguf::header(3, 1 << 40, 0),
            vec!["claims 1099511627776 tensors"],
        ),
        (
            "value_type",
            Gguf::header(3, 0, 1).str(b"k").u32(13).u32(0),
            vec!["metadata `k`", "unknown value type 13"],
        ),
        (
            "key_not_utf8",
            Gguf::header(3, 0, 1).str(b"\xff\xfe").u32(4).u32(0),
            vec!["metadata key #0 is not valid UTF-8"],
        ),
        (
            "nested_arrays",
            (0..5)
                .fold(Gguf::header(3, 0, 1).str(b"deep").u32(9), |g, _| {
                    g.u32(9).u64(1)
                })
                .u32(0),
            vec!["metadata `deep` nests arrays too deeply"],
        ),
        (
            "string_length",
            Gguf::header(3, 0, 1).u64(u64::MAX / 2),
            vec!["metadata key #0", "is truncated or corrupt"],
        ),
        (
            "rank_zero",
            arch().tensor("token_embd.weight", &[], 0, 0).data(64),
            vec!["tensor `token_embd.weight` has rank 0"],
        ),
        (
            "alignment",
            Gguf::header(3, 0, 1).kv_u32("general.alignment", 3),
            vec!["`general.alignment` is not a power of two"],
        ),
        (
            "type_id",
            arch().tensor("token_embd.weight", &[4, 4], 99, 0).data(64),
            vec!["`token_embd.weight` of unknown type id 99"],
        ),
        (
            "block_rows",
            arch()
                .tensor("token_embd.weight", &[33, 1], q4_0, 0)
                .data(64),
            vec!["rows of 33 elements, not a multiple of Q4_0's block of 32"],
        ),
        (
            "data_past_end",
            arch().tensor("token_embd.weight", &[8, 8], 0, 0).data(16),
            vec!["is truncated: tensor `token_embd.weight` needs bytes up to"],
        ),
        (
            // 27905 · 429509837 · 384773 = 2^62 + 1 elements: the f32 byte count overflows
            // 64 bits (to 4 when it wrapped), so the tensor must be refused as corrupt.
            "element_overflow",
            arch()
                .tensor("token_embd.weight", &[27905, 429509837, 384773], 0, 0)
                .data(64),
            vec!["tensor `token_embd.weight` has shape [27905, 429509837, 384773]"],
        ),
        (
            "no_architecture",
            Gguf::header(3, 0, 1).kv_u32("general.file_type", 0),
            vec!["metadata `general.architecture` is missing"],
        ),
    ];
    for (name, gguf, needles) in cases {
        let dir = s.dir(name);
        std::fs::write(dir.join("in.gguf"), &gguf.0).unwrap();
        let mut needles = needles;
        needles.push("in.gguf");
        s.refuse(
            &dir,
            &["convert", "--gguf", "in.gguf", "--out", "out"],
            b"",
            &needles,
        );
    }
    // An existing output directory is never touched.
    let dir = s.dir("out_exists");
    std::fs::write(dir.join("in.gguf"), arch().0).unwrap();
    std::fs::create_dir(dir.join("out")).unwrap();
    std::fs::write(dir.join("out/keep.txt"), "mine").unwrap();
    s.refuse(
        &dir,
        &["convert", "--gguf", "in.gguf", "--out", "out"],
        b"",
        &["out", "already exists"],
    );
    assert_eq!(s.count, 15);
}
