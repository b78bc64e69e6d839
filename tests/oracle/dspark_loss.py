"""Numpy oracle for the DSpark training loss (dspark-spec.md §2.4).

Reads a JSON file {logits, target_logits, conf, targets, weights, keep, loss_weights} (nested
lists; loss_weights [CE, L1, BCE, KL], default DeepSpec's [0.1, 0.9, 1.0, 0]) and prints the
weighted sums [sum w*CE, sum w*L1, sum w*BCE, sum w*KL, sum w] and the total loss as JSON. KL is
KL(target || draft) over the draft's ids.
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
ids = keep if keep is not None else list(range(pt.shape[-1]))
ptk, pdk = pt[..., ids], pd[..., ids]
kl = (ptk * (np.log(ptk) - np.log(pdk))).sum(-1)
sums = [float((w * t).sum()) for t in (ce, l1, bce, kl)] + [float(w.sum())]
coef = d.get("loss_weights") or [0.1, 0.9, 1.0, 0.0]
total = sum(c * x for c, x in zip(coef, sums)) / sums[4]
print(json.dumps({"sums": sums, "total": total}))
