#!/usr/bin/env bash
# Measures how much a fuzz target's process grows per execution, without mutation (issue #13:
# the fuzz runs' RSS rises over hours, and a run that reaches -rss_limit_mb stops with an
# out-of-memory report that is not a finding).
#
#   scripts/fuzz-rss.sh TARGET INPUT [RUNS]    replay INPUT RUNS/4 and RUNS times (default
#                                              8000) in the built fuzz binary and print the
#                                              peak RSS of each, the growth per execution and
#                                              the threads each execution creates
#   scripts/fuzz-rss.sh --threads [RUNS]       the same growth for a 10-line program that only
#                                              spawns and joins one thread per iteration, built
#                                              with and without AddressSanitizer
#
# ASan's quarantine (256 MB of freed memory held back to catch use-after-free) is turned off,
# so what remains is memory that stays with the process. Needs the fuzz binaries
# (scripts/fuzz.sh) and /usr/bin/time; strace, if installed, for the thread count.
set -euo pipefail
cd "$(dirname "$0")/.."
export ASAN_OPTIONS=detect_odr_violation=0:quarantine_size_mb=0:thread_local_quarantine_size_kb=0
BIN=fuzz/target/x86_64-unknown-linux-gnu/release

# Peak RSS in KB of the command's process.
peak_kb() {
  /usr/bin/time -f '%M' "$@" 2>&1 >/dev/null | tail -n 1
}

# Prints the peak RSS of `CMD -runs=RUNS/4` and `CMD -runs=RUNS` and the growth between them
# per run.
growth() {
  local runs=$1 label=$2 small big
  shift 2
  small=$(peak_kb "$@" -runs=$((runs / 4)))
  big=$(peak_kb "$@" -runs="$runs")
  awk -v l="$label" -v a="$small" -v b="$big" -v n="$runs" 'BEGIN {
    printf "%s: peak RSS %d KB after %d runs, %d KB after %d: %.3f KB per run\n",
      l, a, n / 4, b, n, (b - a) / (n - n / 4) }'
}

if [ "${1:-}" = --threads ]; then
  RUNS=${2:-40000}
  DIR=$(mktemp -d)
  trap 'rm -rf "$DIR"' EXIT
  cat >"$DIR/spawn.rs" <<'EOF'
fn main() {
    let arg = std::env::args().nth(1).unwrap_or_default();
    let runs: usize = arg.trim_start_matches("-runs=").parse().unwrap_or(1);
    let data = vec![1u8; 4096];
    let mut sum = 0u64;
    for _ in 0..runs {
        sum += std::thread::scope(|s| {
            s.spawn(|| data.iter().map(|&b| u64::from(b)).sum::<u64>()).join().unwrap_or(0)
        });
    }
    println!("{sum}");
}
EOF
  rustc -O "$DIR/spawn.rs" -o "$DIR/plain"
  # The sanitizer flag is nightly-only, as for cargo fuzz.
  RUSTC_BOOTSTRAP=1 rustc -Zsanitizer=address -O "$DIR/spawn.rs" -o "$DIR/asan"
  growth "$RUNS" "spawn+join, plain" "$DIR/plain"
  growth "$RUNS" "spawn+join, ASan" "$DIR/asan"
  exit 0
fi

TARGET=${1:?usage: scripts/fuzz-rss.sh TARGET INPUT [RUNS] | --threads [RUNS]}
INPUT=${2:?usage: scripts/fuzz-rss.sh TARGET INPUT [RUNS] | --threads [RUNS]}
RUNS=${3:-8000}
PY=.venv/bin/python
LD_LIBRARY_PATH="$($PY -c 'import mlx, os; print(os.path.join(list(mlx.__path__)[0], "lib"))')${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
export LD_LIBRARY_PATH
[ -x "$BIN/$TARGET" ] || { echo "no fuzz binary $BIN/$TARGET: run scripts/fuzz.sh first" >&2; exit 2; }
[ -f "$INPUT" ] || { echo "no input file $INPUT" >&2; exit 2; }

# libFuzzer runs a file given on the command line -runs times, each a full execution.
growth "$RUNS" "$TARGET $(basename "$INPUT")" "$BIN/$TARGET" "$INPUT"

# Threads created per execution: clone calls of 200 runs less those of 100.
clones() {
  strace -f -qq -e trace=clone,clone3 -o /dev/stdout "$BIN/$TARGET" "$INPUT" -runs="$1" \
    2>/dev/null | grep -c 'clone' || true
}
if command -v strace >/dev/null; then
  echo "threads created per run: $(awk -v a="$(clones 100)" -v b="$(clones 200)" \
    'BEGIN { printf "%.2f", (b - a) / 100 }')"
else
  echo "threads created per run: not counted (strace is not installed)"
fi
