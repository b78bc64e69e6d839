#!/usr/bin/env bash
# Fuzzes every parser that reads untrusted bytes (issue #13) with cargo-fuzz / libFuzzer.
#
#   scripts/fuzz.sh [SECONDS_PER_TARGET] [TARGET...]     (default: 120 s, every target)
#   FUZZ_NO_BUILD=1 scripts/fuzz.sh ...                  (reuse the built fuzz binaries)
#   FUZZ_FORK=N scripts/fuzz.sh ...                      (N worker processes on one target)
#   FUZZ_NO_DICT=1 scripts/fuzz.sh ...                   (without the dictionaries, below)
#   FUZZ_KEEP=1 scripts/fuzz.sh ...                      (store the minimized corpus in
#                                                        fuzz/kept/TARGET.tar.xz, committed)
#   FUZZ_TMPDIR=DIR scripts/fuzz.sh ...                  (the targets' scratch files under DIR;
#                                                        default /dev/shm where it is writable)
#   FUZZ_WORK=DIR scripts/fuzz.sh ...                    (corpora, logs, crashes under DIR, not
#                                                        fuzz/: e.g. two runs of one target from
#                                                        copies of its corpus, side by side)
#
# Needs `cargo install cargo-fuzz`; libFuzzer's flags are nightly-only, so the stable toolchain
# runs with RUSTC_BOOTSTRAP=1. Seed corpora are generated here from real files (a tiny model
# made by mlx-lm, a DSpark drafter made by mlxb, GGUF files written by the `gguf` package) into
# fuzz/corpus/TARGET (not committed; runs add to it, and start from fuzz/kept/TARGET.tar.xz, the
# committed minimized corpus of earlier runs, where there is one); crashes land in fuzz/artifacts/TARGET,
# logs and the final statistics of each run in fuzz/logs/TARGET.log, its coverage timeline in
# fuzz/logs/TARGET.cov.tsv. Runs are sequential at `nice -n 19` (the machine is shared), and
# each prints whether its target plateaued (a run of an hour or more whose cov grew by under 1 %
# over its last third) and what a replay of the corpus reaches (twice: the spread is the
# target's run-to-run noise).
set -euo pipefail
cd "$(dirname "$0")/.."
SECS=${1:-120}
WORK=${FUZZ_WORK:-fuzz}
shift || true
ALL=(safetensors_header model_config gguf_header gguf_quant tokenizer_files dspark_config
  http_request prompt_file)
TARGETS=("$@")
[ ${#TARGETS[@]} -gt 0 ] || TARGETS=("${ALL[@]}")
PY=.venv/bin/python
# The fuzz binaries are not given mlxb's rpath (build.rs only links mlxb's own targets).
LD_LIBRARY_PATH="$($PY -c 'import mlx, os; print(os.path.join(list(mlx.__path__)[0], "lib"))')${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
export LD_LIBRARY_PATH

# FUZZ_NO_BUILD=1 reuses the binaries already built (e.g. several runs in parallel).
if [ -z "${FUZZ_NO_BUILD:-}" ]; then
  # mlxb itself without RUSTC_BOOTSTRAP: cargo fingerprints it, and setting it here would
  # rebuild target/release from scratch (and again for the next plain `cargo build`).
  # Both binaries: `mlxb` is the launcher and runs `mlxb-engine` beside it (seeds below).
  cargo build --release --bins
  RUSTC_BOOTSTRAP=1 nice -n 10 cargo fuzz build --fuzz-dir fuzz -O
fi

# ---- seed corpora -------------------------------------------------------------------------
SEEDS=$(mktemp -d)
trap 'rm -rf "$SEEDS"' EXIT
$PY tests/oracle/make_model.py "$SEEDS/model" '{"model_type": "llama", "hidden_size": 64,
  "num_hidden_layers": 2, "intermediate_size": 128, "num_attention_heads": 4,
  "num_key_value_heads": 2, "rms_norm_eps": 1e-5, "vocab_size": 384,
  "tie_word_embeddings": true}' --dtype f32 >/dev/null
target/release/mlxb dspark-init --model "$SEEDS/model" --out "$SEEDS/drafter" --layers 1 \
  --gamma 4 --markov-rank 16 >/dev/null
$PY - "$SEEDS" "$WORK/corpus" <<'EOF'
import json, os, random, subprocess, sys
import numpy as np
import mlx.core as mx
import gguf

sys.path.insert(0, "fuzz")
import seed_shapes  # tokenizer families and config.json forms real models ship

seeds, corpora = sys.argv[1], sys.argv[2]
SEP = b"\n\x00MLXB-FUZZ-FILE\x00\n"  # fuzz/src/lib.rs SEPARATOR
rng = random.Random(0)


def put(target, name, data):
    d = os.path.join(corpora, target)
    os.makedirs(d, exist_ok=True)
    with open(os.path.join(d, name), "wb") as f:
        f.write(data if isinstance(data, bytes) else data.encode())


def read(*p):
    with open(os.path.join(seeds, *p), "rb") as f:
        return f.read()


# safetensors: small files written by MLX itself, in each float dtype and with metadata.
for i, dt in enumerate([mx.float32, mx.bfloat16, mx.float16, mx.uint32]):
    p = os.path.join(seeds, f"t{i}.safetensors")
    mx.save_safetensors(p, {"model.embed_tokens.weight": mx.zeros((3, 2), dtype=dt),
                            "model.norm.weight": mx.ones((2,), dtype=dt)},
                        metadata={"format": "mlx"})
    put("safetensors_header", f"mlx-{i}", read(f"t{i}.safetensors"))

# config.json of every supported family (shapes tiny, family-specific keys present).
base = json.loads(read("model", "config.json"))
fam = {
    "llama": {}, "mistral": {"sliding_window": 8},
    "qwen2": {}, "qwen3": {"head_dim": 16, "rope_parameters": {"rope_type": "default", "rope_theta": 1e6}},
    "qwen3_moe": {"num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 32,
                  "decoder_sparse_step": 1, "mlp_only_layers": [], "norm_topk_prob": True, "head_dim": 16},
    "qwen3_5": {"layer_types": ["linear_attention", "full_attention"], "linear_num_value_heads": 4,
                "linear_num_key_heads": 2, "linear_key_head_dim": 16, "linear_value_head_dim": 16,
                "linear_conv_kernel_dim": 4, "full_attention_interval": 2, "head_dim": 16,
                "partial_rotary_factor": 0.25},
    "qwen3_5_moe": {"layer_types": ["linear_attention", "full_attention"], "num_experts": 4,
                    "num_experts_per_tok": 1, "moe_intermediate_size": 32,
                    "shared_expert_intermediate_size": 32, "head_dim": 16},
    "gemma2": {"head_dim": 16, "query_pre_attn_scalar": 16, "attn_logit_softcapping": 50.0,
               "final_logit_softcapping": 30.0, "sliding_window": 8},
    "gemma3_text": {"head_dim": 16, "query_pre_attn_scalar": 16, "sliding_window": 8,
                    "sliding_window_pattern": 2, "rope_local_base_freq": 10000.0,
                    "layer_types": ["sliding_attention", "full_attention"]},
    "gemma4_text": {"head_dim": 16, "global_head_dim": 32, "sliding_window": 8,
                    "layer_types": ["sliding_attention", "full_attention"],
                    "num_kv_shared_layers": 0, "hidden_size_per_layer_input": 0,
                    "final_logit_softcapping": 30.0},
    "minicpm": {"scale_emb": 12, "dim_model_base": 256, "scale_depth": 1.4},
}
for t, extra in fam.items():
    c = dict(base, model_type=t, **extra)
    put("model_config", t, json.dumps(c, indent=1))
    q = dict(c, quantization={"group_size": 64, "bits": 4, "model.embed_tokens": {"group_size": 32, "bits": 8}})
    put("model_config", t + "-q4", json.dumps(q))
put("model_config", "kv-config", json.dumps(dict(base, kv_quantization={"layer_bits": [4, 8]})))
for name, c in seed_shapes.model_configs(base):
    put("model_config", name, seed_shapes.as_json(c))

# GGUF: small llama files written by the gguf package (f32, f16, q8_0 tensors, BPE and SPM vocabularies).
def write_gguf(name, tok_model, qtype):
    p = os.path.join(seeds, name)
    w = gguf.GGUFWriter(p, "llama")
    w.add_block_count(1); w.add_context_length(64); w.add_embedding_length(32)
    w.add_feed_forward_length(64); w.add_head_count(2); w.add_head_count_kv(1)
    w.add_layer_norm_rms_eps(1e-5); w.add_rope_freq_base(10000.0)
    toks = ["<s>", "</s>", "a", "b", "ab", "c", "Ġ", "Ġa"]
    w.add_tokenizer_model(tok_model)
    w.add_token_list(toks)
    w.add_token_types([3, 3] + [1] * (len(toks) - 2))
    w.add_bos_token_id(0); w.add_eos_token_id(1)
    if tok_model == "gpt2":
        w.add_token_merges(["a b", "Ġ a"])
    else:
        w.add_token_scores([0.0] * len(toks))
    w.add_chat_template("{% for m in messages %}{{ m['content'] }}{% endfor %}")
    Q = gguf.GGMLQuantizationType
    def t(n, shape):
        a = np.random.default_rng(len(n)).standard_normal(shape).astype(np.float32)
        if qtype == "f16":
            a = a.astype(np.float16)
        w.add_tensor(n, a)
    t("token_embd.weight", (8, 32)); t("output_norm.weight", (32,))
    for n, s in [("attn_q", (32, 32)), ("attn_k", (16, 32)), ("attn_v", (16, 32)), ("attn_output", (32, 32)),
                 ("ffn_gate", (64, 32)), ("ffn_up", (64, 32)), ("ffn_down", (32, 64))]:
        t(f"blk.0.{n}.weight", s)
    for n in ["attn_norm", "ffn_norm"]:
        t(f"blk.0.{n}.weight", (32,))
    w.write_header_to_file(); w.write_kv_data_to_file(); w.write_tensors_to_file(); w.close()
    put("gguf_header", name, read(name))

write_gguf("bpe-f32.gguf", "gpt2", "f32")
write_gguf("spm-f16.gguf", "llama", "f16")

# GGUF tensor data: one or two random blocks of each type id.
for tid in range(0, 40):
    try:
        block, size = gguf.GGML_QUANT_SIZES[gguf.GGMLQuantizationType(tid)]
    except (ValueError, KeyError):
        continue
    for k in (1, 2):
        put("gguf_quant", f"type{tid}-{k}", bytes([tid]) + bytes(rng.randrange(256) for _ in range(size * k)))

# Tokenizer files: tokenizer.json, tokenizer_config.json, config.json, generation_config.json.
parts = [read("model", "tokenizer.json"), read("model", "tokenizer_config.json"),
         read("model", "config.json"), json.dumps({"eos_token_id": [1, 2]}).encode()]
put("tokenizer_files", "tiny", SEP.join(parts))
tc = json.loads(parts[1])
tc["chat_template"] = ("{% for m in messages %}{% if m['role'] == 'system' %}[S]{{ m['content'] }}"
                       "{% else %}<{{ m['role'] }}>{{ m['content'] | trim }}{% endif %}{% endfor %}"
                       "{% if add_generation_prompt %}<assistant>{% endif %}")
put("tokenizer_files", "template", SEP.join([parts[0], json.dumps(tc).encode()] + parts[2:]))
# The tokenizer-parity fixtures (tests/oracle/tokenizer.py: ChatML and Gemma SPM tokenizers,
# dict- and list-form tokenizer_config.json, a corrupt generation_config.json, legacy layouts,
# real chat templates), and the tokenizer families they lack (fuzz/seed_shapes.py).
fixtures = os.path.join(seeds, "tokenizer-fixtures")
subprocess.run([sys.executable, "tests/oracle/tokenizer.py", "build", fixtures], check=True,
               stdout=subprocess.DEVNULL)
def fixture_file(name, file):
    p = os.path.join(fixtures, name, file)
    return open(p, "rb").read() if os.path.exists(p) else b""  # empty: the file is absent
for name in sorted(os.listdir(fixtures)):
    put("tokenizer_files", f"fixture-{name}", SEP.join(fixture_file(name, f) for f in
        ["tokenizer.json", "tokenizer_config.json", "config.json", "generation_config.json"]))
for name, tok_json in seed_shapes.tokenizers_by_shape():
    put("tokenizer_files", f"shape-{name}", SEP.join([tok_json] + parts[1:]))

# DSpark configs: mlxb's dspark.json (first byte even) and a DeepSpec config.json (odd).
put("dspark_config", "mlxb", b"\x00" + read("drafter", "dspark.json"))
d = json.loads(read("drafter", "dspark.json"))
d.update(thresholds=[0.5, 0.4, 0.3, 0.2], sts_temperatures=[1.0, 1.1, 1.2, 1.3])
put("dspark_config", "mlxb-calibrated", b"\x00" + json.dumps(d).encode())
deepspec = {"architectures": ["Qwen3DSparkModel"], "hidden_size": 64, "num_attention_heads": 4,
            "num_key_value_heads": 2, "head_dim": 16, "intermediate_size": 128,
            "num_hidden_layers": 1, "vocab_size": 384, "rms_norm_eps": 1e-6, "rope_theta": 1e6,
            "block_size": 4, "target_layer_ids": [0], "num_target_layers": 2, "mask_token_id": 383,
            "markov_head_type": "vanilla", "markov_rank": 16}
put("dspark_config", "deepspec", b"\x01" + json.dumps(deepspec).encode())
put("dspark_config", "deepspec-gemma4", b"\x01" + json.dumps(dict(deepspec, architectures=["Gemma4DSparkModel"], markov_head_type="gated")).encode())

# OpenAI request bodies (first byte: bit 0 = completions, bit 1 = server has a drafter).
chat = {"model": "default", "messages": [{"role": "system", "content": "be brief"},
                                          {"role": "user", "content": "hi"}],
        "max_tokens": 8, "temperature": 0.7, "top_p": 0.9, "top_k": 5, "min_p": 0.05,
        "seed": 3, "stop": ["\n", "END"], "logprobs": True, "top_logprobs": 2,
        "logit_bias": {"5": -100}, "repetition_penalty": 1.1, "stream": True,
        "stream_options": {"include_usage": True}, "num_draft_tokens": 4}
put("http_request", "chat", b"\x00" + json.dumps(chat).encode())
put("http_request", "chat-min", b"\x02" + json.dumps({"messages": [{"role": "user", "content": "x"}]}).encode())
put("http_request", "completion", b"\x01" + json.dumps({"prompt": "once", "max_tokens": 4, "logprobs": 1}).encode())
put("http_request", "completion-ids", b"\x03" + json.dumps({"prompt": [1, 2, 3], "max_completion_tokens": 4, "stop": "x"}).encode())

# train-dspark prompt files.
put("prompt_file", "mixed", "\n".join(json.dumps(x) for x in [
    {"prompt": "hello there"},
    {"messages": [{"role": "user", "content": "a b"}, {"role": "assistant", "content": "x"}]},
    {"prompt_ids": [1, 2, 3]}, {"prompt": "zzz"}]) + "\n")
EOF

# ---- runs ---------------------------------------------------------------------------------
# The binaries built above run directly (`cargo fuzz run` would rebuild whenever the tree moved).
# Each run also writes fuzz/logs/TARGET.cov.tsv, a coverage timeline (seconds, executions, cov,
# ft: one row per libFuzzer status line), and prints whether the target plateaued (the rule is
# at `plateau` below).
BIN=fuzz/target/x86_64-unknown-linux-gnu/release
export ASAN_OPTIONS=detect_odr_violation=0
# Every input's files are written into a scratch directory and deleted for the next input
# (fuzz/src/lib.rs). On ext4 that churn of inodes is slow: a profile of `tokenizer_files` 20
# minutes into a run found 55-60 % of a worker's time in ext4's inode allocator
# (`recently_deleted`, under `ext4_create` and `ext4_mkdir`). So the scratch directory of the runs
# below goes on tmpfs where there is one (the builds and seeds above keep the caller's TMPDIR).
if [ -n "${FUZZ_TMPDIR:-}" ]; then
  export TMPDIR=$FUZZ_TMPDIR
elif [ -d /dev/shm ] && [ -w /dev/shm ]; then
  export TMPDIR=/dev/shm
fi

# Reads libFuzzer's output on stdin, copies it to $1 and writes the timeline to $2.
timeline() {
  local start=$SECONDS line
  printf 'seconds\texecs\tcov\tft\n' >"$2"
  while IFS= read -r line; do
    printf '%s\n' "$line" >>"$1"
    if [[ $line =~ ^#([0-9]+).*cov:\ ([0-9]+)\ ft:\ ([0-9]+) ]]; then
      printf '%s\t%s\t%s\t%s\n' $((SECONDS - start)) "${BASH_REMATCH[1]}" \
        "${BASH_REMATCH[2]}" "${BASH_REMATCH[3]}" >>"$2"
    fi
  done
}

# Prints the final figures of a timeline and whether it plateaued: a run of at least an hour
# whose cov grew by less than 1 % over its last third (fuzz/README.md says why the rule has this
# form); "exhausted" when neither cov nor ft grew at all in that third.
plateau() {
  awk -F'\t' 'NR > 1 { t[n] = $1; e[n] = $2; c[n] = $3; f[n] = $4; n++ }
    END {
      if (n == 0) { print "   no status lines"; exit }
      cut = t[n - 1] * 2 / 3; i = 0
      while (i + 1 < n && t[i + 1] <= cut) i++
      grew = c[i] > 0 ? 100 * (c[n - 1] - c[i]) / c[i] : 100
      if (c[i] == c[n - 1] && f[i] == f[n - 1]) verdict = "plateaued (exhausted: cov and ft flat)"
      else if (t[n - 1] < 3600) verdict = "too short to judge (under an hour)"
      else if (grew < 1) verdict = "plateaued"
      else verdict = "still rising"
      printf "   %s execs, %s s, cov %s, ft %s; at %d s cov %s ft %s (cov +%.2f %%): %s\n",
        e[n - 1], t[n - 1], c[n - 1], f[n - 1], t[i], c[i], f[i], grew, verdict
    }' "$1"
}

# fuzz/kept/TARGET.tar.xz (committed): the minimized corpus of the runs so far, so that runs add
# up across checkouts instead of restarting from the seeds. Unpacked before a run; FUZZ_KEEP=1
# replaces it after the run with libFuzzer's minimal merge of the whole corpus.
unkeep() {
  local archive="fuzz/kept/$1.tar.xz"
  [ -f "$archive" ] || return 0
  mkdir -p "$WORK/corpus/$1"
  tar -C "$WORK/corpus/$1" --skip-old-files -xJf "$archive"
}

keep() {
  [ -n "${FUZZ_KEEP:-}" ] || return 0
  local merged tmp="fuzz/kept/.$1.tar.xz.tmp-$$"
  merged=$(mktemp -d)
  nice -n 19 "$BIN/$1" -merge=1 "$merged" "$WORK/corpus/$1" >/dev/null 2>&1
  mkdir -p fuzz/kept
  tar -C "$merged" --sort=name --owner=0 --group=0 --mtime=@0 -cf - . | xz -9e >"$tmp"
  mv "$tmp" "fuzz/kept/$1.tar.xz"
  echo "   kept $(find "$merged" -type f | wc -l) inputs in fuzz/kept/$1.tar.xz ($(du -k "fuzz/kept/$1.tar.xz" | cut -f1) KB)"
  rm -rf "$merged"
}

# Replays the whole corpus twice without fuzzing and prints the cov/ft each replay reached. The
# targets run rayon on one thread and use a fixed-shape scratch path (fuzz/src/lib.rs), but
# some still differ by a few edges or features between replays (randomly seeded hash maps: in
# `tokenizer_files`, -print_coverage shows the tokenizers crate's maps probing and iterating
# differently); growth of that size within a run may be noise rather than newly reached code.
replay() {
  local i line out=()
  for i in 1 2; do
    line=$(nice -n 19 "$BIN/$1" "$WORK/corpus/$1" -runs=0 2>&1 | grep INITED) || line=""
    if [[ $line =~ cov:\ ([0-9]+)\ ft:\ ([0-9]+) ]]; then
      out+=("${BASH_REMATCH[1]}/${BASH_REMATCH[2]}")
    fi
  done
  echo "   corpus replayed twice, cov/ft: ${out[*]}"
}

# libFuzzer's -dict for a target: fuzz/dicts/TARGET.dict (the keys, type names and syntax its
# parser looks for, so a mutation can insert a whole `"pre_tokenizer"` instead of finding it a
# byte at a time), after fuzz/dicts/json.dict for the targets that read JSON. libFuzzer takes
# one -dict file, so the two are joined into the seeds' temporary directory.
dict_flag() {
  local own="fuzz/dicts/$1.dict" joined="$SEEDS/$1.dict"
  [ -z "${FUZZ_NO_DICT:-}" ] && [ -f "$own" ] || return 0
  case $1 in
    gguf_*) cat "$own" ;;
    *) cat fuzz/dicts/json.dict "$own" ;;
  esac >"$joined"
  echo "-dict=$joined"
}

mkdir -p "$WORK/logs"
for t in "${TARGETS[@]}"; do
  echo "== $t (${SECS}s)"
  mkdir -p "$WORK/artifacts/$t"
  : >"$WORK/logs/$t.log"
  unkeep "$t"
  set +e
  nice -n 19 "$BIN/$t" "$WORK/corpus/$t" -artifact_prefix="$WORK/artifacts/$t/" \
    -max_total_time="$SECS" -timeout=10 -rss_limit_mb=4096 -malloc_limit_mb=2048 \
    -print_final_stats=1 ${FUZZ_FORK:+-fork="$FUZZ_FORK"} $(dict_flag "$t") 2>&1 | timeline "$WORK/logs/$t.log" "$WORK/logs/$t.cov.tsv"
  rc=${PIPESTATUS[0]}
  set -e
  if [ "$rc" -ne 0 ]; then
    echo "   crash: see $WORK/logs/$t.log and $WORK/artifacts/$t/"
    continue
  fi
  plateau "$WORK/logs/$t.cov.tsv"
  replay "$t"
  keep "$t"
done
