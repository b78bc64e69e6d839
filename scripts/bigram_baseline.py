"""What the anchor token alone predicts: a bigram table built from the replies of the first
N_TRAIN sequences of a `train-dspark` sequences file, scored (top-1) on every reply position
of the remaining sequences. A DSpark drafter's position-0 acceptance that stays near this number
has not learned to use the target's context features.

    python3 scripts/bigram_baseline.py assets/sequences/smollm2-135m-instruct.b8.jsonl 900
"""
import collections
import json
import sys

path, n_train = sys.argv[1], int(sys.argv[2])
seqs = [json.loads(line) for line in open(path)][1:]  # the first line is the header
table = collections.defaultdict(collections.Counter)
for s in seqs[:n_train]:
    ids, start = s["ids"], s["reply_from"]
    for i in range(max(start, 1), len(ids)):
        table[ids[i - 1]][ids[i]] += 1
positions = hits = 0
for s in seqs[n_train:]:
    ids, start = s["ids"], s["reply_from"]
    for i in range(start + 1, len(ids)):
        positions += 1
        seen = table.get(ids[i - 1])
        hits += bool(seen) and seen.most_common(1)[0][0] == ids[i]
print(json.dumps({"train_sequences": n_train, "test_sequences": len(seqs) - n_train,
                  "positions": positions, "bigram_top1": round(hits / max(positions, 1), 4)}))
