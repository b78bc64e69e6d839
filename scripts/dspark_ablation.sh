#!/usr/bin/env bash
# Trains DSpark drafter variants for the same budget on the same regenerated sequences and
# measures each, unpruned, on the calibration split (never on held-out prompts), printing one
# JSON line per variant. Usage:
#
#   scripts/dspark_ablation.sh OUT STEPS N_TRAIN N_CALIB [VARIANT...]
#
# OUT: scratch directory (the shared target cache goes to OUT/cache); STEPS: optimizer steps
# per variant; N_TRAIN: the first N lines of assets/prompts/corpora/train.jsonl whose
# sequences are in $SEQUENCES (default assets/sequences/smollm2-135m-instruct.jsonl; set
# REGEN_BATCH=8 for the .b8.jsonl file); N_CALIB: the first N prompts of
# assets/prompts/corpora/calibration.jsonl, 64 tokens each. VARIANTs (default: the first five)
# name the rows below. Needs `python3 scripts/prompt_corpora.py` first.
set -euo pipefail
cd "$(dirname "$0")/.."
out=$1 steps=$2 ntrain=$3 ncalib=$4
shift 4
mlxb=${MLXB:-target/release/mlxb}
regen_batch=${REGEN_BATCH:-1}
mkdir -p "$out"
head -n "$ntrain" assets/prompts/corpora/train.jsonl >"$out/train.jsonl"
# The header and the first N_TRAIN sequences: the committed file keeps growing in stages, and
# a sequences file may not hold more sequences than the prompts given.
head -n "$((ntrain + 1))" "${SEQUENCES:-assets/sequences/smollm2-135m-instruct.jsonl}" >"$out/sequences.jsonl"
sequences=$out/sequences.jsonl
head -n "$ncalib" assets/prompts/corpora/calibration.jsonl >"$out/calib.jsonl"

# name: flags (everything else shared: markov rank 32, batch 4, 32 anchors, lr 6e-4, seed 42)
declare -A variants=(
  [markov-1l-g7-vocab]="--seq-head markov --layers 1 --gamma 7 --draft-vocab 8192"
  [rnn-1l-g7-vocab]="--seq-head rnn --layers 1 --gamma 7 --draft-vocab 8192"
  [markov-2l-g7-vocab]="--seq-head markov --layers 2 --gamma 7 --draft-vocab 8192"
  [markov-1l-g4-vocab]="--seq-head markov --layers 1 --gamma 4 --draft-vocab 8192"
  [markov-1l-g7-full]="--seq-head markov --layers 1 --gamma 7"
  # loss-term weights CE,L1,CONF[,KL] (the rows above use DeepSpec's 0.1,0.9,1.0)
  [rnn-1l-g7-vocab-ce1]="--seq-head rnn --layers 1 --gamma 7 --draft-vocab 8192 --loss-weights 1,0.9,1"
  [rnn-1l-g7-vocab-kl]="--seq-head rnn --layers 1 --gamma 7 --draft-vocab 8192 --loss-weights 0.1,0,1,1"
  [rnn-1l-g7-vocab-kl-lr3e-3]="--seq-head rnn --layers 1 --gamma 7 --draft-vocab 8192 --loss-weights 0.1,0,1,1 --lr 3e-3"
  # fc's columns scaled to unit-RMS tapped features at the start
  # attention q/k norm gains starting at 2 (scores x4)
  [rnn-1l-g7-vocab-kl-qk2]="--seq-head rnn --layers 1 --gamma 7 --draft-vocab 8192 --loss-weights 0.1,0,1,1 --qk-norm-init 2"
  [rnn-1l-g7-vocab-kl-fcrms]="--seq-head rnn --layers 1 --gamma 7 --draft-vocab 8192 --loss-weights 0.1,0,1,1 --fc-init rms"
)
order=(markov-1l-g7-vocab rnn-1l-g7-vocab markov-2l-g7-vocab markov-1l-g4-vocab markov-1l-g7-full)
[ $# -gt 0 ] && order=("$@")

for name in "${order[@]}"; do
  flags=${variants[$name]:?unknown variant $name}
  dir="$out/$name"
  start=$(date +%s)
  resume=()
  [ -f "$dir/train-state.safetensors" ] && resume=(--resume)
  # shellcheck disable=SC2086
  "$mlxb" train-dspark --data "$out/train.jsonl" --out "$dir" --cache "$out/cache" \
    --sequences "$sequences" --regen-batch "$regen_batch" --max-tokens 256 --seed 42 \
    --markov-rank 32 --iters "$steps" --batch 4 --checkpoint-every 50 $flags "${resume[@]}" \
    2>"$dir.train.log" >/dev/null
  trained=$(($(date +%s) - start))
  "$mlxb" measure --drafter "$dir" --data "$out/calib.jsonl" --max-tokens 64 --json \
    2>/dev/null >"$dir.measure.json"
  python3 - "$name" "$trained" "$dir.measure.json" "$dir.train.log" <<'EOF'
import json, re, sys
name, secs, mpath, log = sys.argv[1:]
m = json.load(open(mpath))
last = [l for l in open(log) if l.startswith("step ")][-1]
loss = re.search(r"loss ([0-9.]+)", last).group(1)
print(json.dumps({
    "variant": name, "train_s": int(secs), "final_loss": float(loss),
    "tau": round(m["mean_acceptance_length"], 3),
    "per_position": [round(x, 3) for x in m["per_position_acceptance"]],
    "draft_ms": round(m["draft_ms_per_round"], 2), "verify_ms": round(m["verify_ms_per_round"], 2),
    "vanilla_step_ms": round(m["vanilla_step_ms"], 2), "speedup": round(m["speedup"], 3),
    "lossless": m["lossless_checked"],
}))
EOF
done
