#!/usr/bin/env python3
"""Replays n-gram drafting with a lookup table over the target's greedy replies, to choose
`mlxb lookup-table`'s --min-count and --min-share without timing anything.

For each prompt (the `prompt` lines of a prompt file), the target's greedy reply is generated
once with `mlxb generate --json`; then, for every setting, rounds are replayed as the `ngram`
drafter with a table drafts them (`src/spec/ngram.rs`: the sequence's own latest match of 3 down
to 1 tokens, the table's continuation where its n-gram is longer; 3 tokens a round) and scored
with a verify-cost curve measured by `mlxb bench --n-verify` (a verify of k tokens in decode
steps; a plain round costs one). It prints, per setting, tokens per round and the estimated
speed-up. This is a model of the rounds, not a measurement: `mlxb measure` decides.

    python3 scripts/lookup_table_replay.py SEQUENCES PROMPTS N [MLXB]
"""

import json
import subprocess
import sys
from collections import Counter, defaultdict

MAX_ORDER = 4
DRAFT = 3
# Verify cost in decode steps by drafted tokens (bench --n-verify 2,4 on a Zen 4, f32 L1).
COST = {0: 1.0, 1: 0.93, 2: 1.05, 3: 1.22}


def tables(path):
    """N-gram → Counter of continuations, over the reply tokens of a sequences file."""
    counts = [None] + [defaultdict(Counter) for _ in range(MAX_ORDER)]
    with open(path) as f:
        next(f)
        for line in f:
            d = json.loads(line)
            ids, start = d["ids"], d["reply_from"]
            for n in range(1, MAX_ORDER + 1):
                for i in range(max(start, n), len(ids)):
                    counts[n][tuple(ids[i - n:i])][ids[i]] += 1
    return counts


def table_draft(counts, seq, min_count, min_share):
    out, first = [], 0
    tail = list(seq[-MAX_ORDER:])
    while len(out) < DRAFT:
        hit = None
        for n in range(min(MAX_ORDER, len(tail)), 0, -1):
            c = counts[n].get(tuple(tail[-n:]))
            if c and sum(c.values()) >= min_count:
                hit = n, c
                break
        if hit is None:
            break
        n, c = hit
        tok, k = min(c.items(), key=lambda kv: (-kv[1], kv[0]))
        if not out:
            first = n
        if k < min_share * sum(c.values()):
            break
        out.append(tok)
        tail = tail[1:] + [tok] if len(tail) == MAX_ORDER else tail + [tok]
    return out, first


def own_draft(seq):
    for n in range(3, 0, -1):
        if len(seq) <= n:
            continue
        pat = seq[-n:]
        for s in range(len(seq) - n - 1, -1, -1):
            if seq[s:s + n] == pat:
                return seq[s + n:s + n + DRAFT], n
    return [], 0


def replay(cases, counts, min_count, min_share):
    tokens = rounds = 0
    cost = 0.0
    for prompt, reply in cases:
        seq, i = list(prompt), 0
        while i < len(reply):
            own, size = own_draft(seq)
            prop = own
            if counts is not None:
                tab, order = table_draft(counts, seq, min_count, min_share)
                if tab and order > size:
                    prop = tab
            a = 0
            while a < len(prop) and i + a < len(reply) and prop[a] == reply[i + a]:
                a += 1
            n = min(a + 1, len(reply) - i)
            seq += reply[i:i + n]
            i += n
            tokens += n
            rounds += 1
            cost += COST[len(prop)]
    return tokens / rounds, tokens / cost


def main():
    sequences, prompts, limit = sys.argv[1], sys.argv[2], int(sys.argv[3])
    mlxb = sys.argv[4] if len(sys.argv) > 4 else "target/release/mlxb"
    cases = []
    for line in open(prompts):
        if len(cases) >= limit:
            break
        d = json.loads(line)
        if "prompt" not in d:
            continue
        out = subprocess.run([mlxb, "generate", "--prompt", d["prompt"], "--max-tokens", "128",
                              "--json"], capture_output=True, text=True, check=True).stdout
        j = json.loads(out)
        cases.append((j["prompt_token_ids"], j["token_ids"]))
    counts = tables(sequences)
    tau, speed = replay(cases, None, 0, 0)
    print(f"no table: {tau:.3f} tokens a round, {speed:.3f}x estimated")
    for min_count in (1, 2, 4, 8):
        for min_share in (0.0, 0.2, 0.4):
            tau, speed = replay(cases, counts, min_count, min_share)
            print(f"--min-count {min_count} --min-share {min_share}: {tau:.3f} tokens a round, "
                  f"{speed:.3f}x estimated")


if __name__ == "__main__":
    main()
