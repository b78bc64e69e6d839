"""Numpy oracle for the DSpark training loss (dspark-spec.md §2.4).

Reads a JSON file {logits, target_logits, conf, targets, weights, keep} (nested lists) and
prints the weighted sums [sum w*CE, sum w*L1, sum w*BCE, sum w] and the total loss as JSON.
With `keep` (target ids, ascending) the drafter's logits cover only those ids: its
distribution is spread onto the full vocabulary with zeros elsewhere, cross-entropy counts only
where the target token is kept, and L1 is taken over the full vocabulary."""
import json
import sys

import numpy as np

d = json.load(open(sys.argv[1]))
z = np.asarray(d["logits"], dtype=np.float64)
tl = np.asarray(d["target_logits"], dtype=np.float64)
conf = np.asarray(d["conf"], dtype=np.float64)
tgt = np.asarray(d["targets"], dtype=np.int64)
w = np.asarray(d["weights"], dtype=np.float64)


def softmax(x):
    e = np.exp(x - x.max(-1, keepdims=True))
    return e / e.sum(-1, keepdims=True)


pt = softmax(tl)
keep = d.get("keep")
if keep is None:
    pd = softmax(z)
    ce = -np.take_along_axis(np.log(pd), tgt[..., None], -1)[..., 0]
else:
    pd = np.zeros_like(pt)
    pd[..., keep] = softmax(z)
    kept = np.isin(tgt, keep)
    picked = np.take_along_axis(pd, tgt[..., None], -1)[..., 0]
    ce = np.where(kept, -np.log(np.where(kept, picked, 1.0)), 0.0)
l1 = np.abs(pd - pt).sum(-1)
cstar = np.clip(1 - 0.5 * l1, 0, 1)
sig = 1 / (1 + np.exp(-conf))
bce = -(cstar * np.log(sig) + (1 - cstar) * np.log(1 - sig))
sums = [float((w * ce).sum()), float((w * l1).sum()), float((w * bce).sum()), float(w.sum())]
total = (0.1 * sums[0] + 0.9 * sums[1] + 1.0 * sums[2]) / sums[3]
print(json.dumps({"sums": sums, "total": total}))
