#!/usr/bin/env python3
"""Whole-command benchmark: `mlxb generate` vs `python -m mlx_lm generate`, interleaved.

Each run is a fresh process, as a user starts it, so the numbers include start-up. Per run it
records prefill and decode tokens/sec and MLX peak memory from the footer both tools print
(mlxb's is byte-compatible with mlx-lm's), the process's peak RSS (wait4's ru_maxrss), and
process-start-to-first-token: the time from spawn to the first byte of generated text on
stdout (after the `==========` line), and the whole command's wall time (the fair end-to-end
figure for speculative runs, whose prompt/generation split differs between the tools). Runs alternate ABBA so drift hits both sides equally.
Output: a Markdown table (or JSON with --json) of mean +- std per tool and the mlxb/mlx-lm ratio.

Usage: scripts/bench_cli.py --model DIR [--runs 6] [--max-tokens 64] [--prompt TEXT]
       [--mlxb target/release/mlxb] [--extra-mlxb '--draft-kind ngram'] [--json]
"""

import argparse
import json
import os
import re
import shlex
import statistics
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DEFAULT_PROMPT = (
    "Write a short story about a lighthouse keeper who finds a message in a bottle. "
    "Describe the sea, the weather, the keeper's daily routine, the moment of discovery, "
    "what the message says, and how it changes the keeper's life over the following year."
)
FOOTER = {
    "prompt_tps": re.compile(r"^Prompt: (\d+) tokens, ([\d.]+) tokens-per-sec", re.M),
    "gen_tps": re.compile(r"^Generation: (\d+) tokens, ([\d.]+) tokens-per-sec", re.M),
    "peak_gb": re.compile(r"^Peak memory: ([\d.]+) GB", re.M),
}


def run_once(cmd):
    """Runs `cmd`; returns metrics parsed from its output plus timing of the first token."""
    t0 = time.perf_counter()
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, bufsize=0)
    out = b""
    first = None
    sep = b"==========\n"
    while True:
        chunk = os.read(proc.stdout.fileno(), 65536)
        if not chunk:
            break
        out += chunk
        if first is None:
            at = out.find(sep)
            if at >= 0 and len(out) > at + len(sep):
                first = time.perf_counter() - t0
    err = proc.stderr.read()
    _, status, usage = os.wait4(proc.pid, 0)
    wall = time.perf_counter() - t0
    proc.returncode = os.waitstatus_to_exitcode(status)
    if proc.returncode != 0:
        sys.exit(f"bench_cli: {' '.join(cmd)} failed ({proc.returncode}): {err.decode()[-2000:]}")
    text = out.decode("utf-8", "replace")
    row = {"start_to_first_token_s": first, "wall_s": wall,
           "peak_rss_gb": usage.ru_maxrss / 1024 / 1024}
    m = FOOTER["prompt_tps"].search(text)
    row["prompt_tokens"], row["prompt_tps"] = int(m.group(1)), float(m.group(2))
    m = FOOTER["gen_tps"].search(text)
    row["gen_tokens"], row["gen_tps"] = int(m.group(1)), float(m.group(2))
    row["peak_gb"] = float(FOOTER["peak_gb"].search(text).group(1))
    row["text"] = text.split("==========")[1].strip() if text.count("==========") >= 2 else ""
    return row


def summarize(rows, key):
    vals = [r[key] for r in rows if r[key] is not None]
    if not vals:
        return None, None
    return statistics.fmean(vals), (statistics.stdev(vals) if len(vals) > 1 else 0.0)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", required=True)
    ap.add_argument("--runs", type=int, default=6)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--prompt", default=DEFAULT_PROMPT)
    ap.add_argument("--mlxb", default=os.path.join(ROOT, "target", "release", "mlxb"))
    ap.add_argument("--extra-mlxb", default="", help="extra mlxb flags (e.g. a drafter)")
    ap.add_argument("--extra-mlx-lm", default="", help="extra mlx_lm generate flags (e.g. --draft-model DIR)")
    ap.add_argument("--no-baseline", action="store_true", help="mlxb only (e.g. a drafter vs vanilla mlxb via --extra-mlxb on a second call)")
    ap.add_argument("--json", action="store_true")
    a = ap.parse_args()

    common = ["--prompt", a.prompt, "--max-tokens", str(a.max_tokens)]
    tools = {
        "mlxb": [a.mlxb, "generate", "--model", a.model, "--verbose"]
        + shlex.split(a.extra_mlxb) + common,
        "mlx-lm": [os.path.join(ROOT, ".venv", "bin", "python"), "-m", "mlx_lm", "generate",
                   "--model", a.model, "--verbose", "True"]
        + shlex.split(a.extra_mlx_lm) + common,
    }
    if a.no_baseline:
        tools.pop("mlx-lm")
    for name, cmd in tools.items():  # warm-up: page cache, compiled kernels on disk
        run_once(cmd)
    rows = {name: [] for name in tools}
    order = list(tools)
    for i in range(a.runs):
        seq = order if i % 2 == 0 else order[::-1]
        for name in seq:
            rows[name].append(run_once(tools[name]))
        print(f"bench_cli: run {i + 1}/{a.runs} done", file=sys.stderr)
    same_text = len(tools) == 2 and all(
        r["text"] == rows["mlx-lm"][0]["text"] for r in rows["mlxb"]
    )
    metrics = ["prompt_tps", "gen_tps", "start_to_first_token_s", "wall_s", "peak_gb",
               "peak_rss_gb"]
    result = {"model": a.model, "runs": a.runs, "max_tokens": a.max_tokens,
              "prompt_tokens": rows["mlxb"][0]["prompt_tokens"],
              "gen_tokens": rows["mlxb"][0]["gen_tokens"], "same_text": same_text,
              "extra_mlxb": a.extra_mlxb, "extra_mlx_lm": a.extra_mlx_lm, "tools": {}}
    for name in tools:
        result["tools"][name] = {m: summarize(rows[name], m) for m in metrics}
        result["tools"][name]["samples"] = [{m: r[m] for m in metrics} for r in rows[name]]
    if a.json:
        print(json.dumps(result, indent=1))
        return
    labels = {"prompt_tps": "prefill tok/s", "gen_tps": "decode tok/s",
              "start_to_first_token_s": "start→first token (s)",
              "wall_s": "whole command (s)",
              "peak_gb": "MLX peak memory (GB)", "peak_rss_gb": "process peak RSS (GB)"}
    print(f"model `{os.path.basename(a.model.rstrip('/'))}`, prompt {result['prompt_tokens']} tokens, "
          f"{result['gen_tokens']} generated, {a.runs} interleaved runs; identical text: {same_text}\n")
    head = "| metric | " + " | ".join(tools) + (" | mlxb / mlx-lm |" if len(tools) == 2 else " |")
    print(head)
    print("|" + "---|" * (head.count("|") - 1))
    for m in metrics:
        cells = []
        for name in tools:
            mean, sd = result["tools"][name][m]
            cells.append("n/a" if mean is None else f"{mean:.3f} ± {sd:.3f}")
        ratio = ""
        if len(tools) == 2:
            x, y = result["tools"]["mlxb"][m][0], result["tools"]["mlx-lm"][m][0]
            ratio = f" {x / y:.2f}x |" if x and y else " n/a |"
        print(f"| {labels[m]} | " + " | ".join(cells) + " |" + ratio)


if __name__ == "__main__":
    main()
