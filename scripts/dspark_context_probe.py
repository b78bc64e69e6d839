"""How much a trained DSpark drafter reads its context: the share of anchors where its block
position 0 proposes the target's own greedy next token, on cached sequences it was not trained
on, with the real context features, with another sequence's features, and with the context
zeroed; beside a bigram table (anchor token -> the target's most frequent greedy next token)
counted on training shards; and where block row 0's attention goes (the previous context row,
averaged over heads and for the head that looks at it most; its own block; a uniform share).

    .venv/bin/python scripts/dspark_context_probe.py DRAFTER CACHE MODEL_DIR FIRST LAST N_BIGRAM

DRAFTER: a one-layer DSpark checkpoint with the RNN head and a reduced draft vocabulary (the
shape `train-dspark --seq-head rnn --layers 1 --draft-vocab N` makes); CACHE: a `train-dspark`
target cache; MODEL_DIR: the f32 target (its tied embedding is the LM head); shards FIRST..LAST
are probed (12 anchors per sequence, seeded), shards 0..N_BIGRAM-1 count the bigram. An
independent re-implementation of the drafter's forward in MLX's Python API (position 0 only),
not mlxb's code."""
import json, sys, math
import mlx.core as mx
import numpy as np
from collections import Counter, defaultdict

drafter, cache, model = sys.argv[1:4]
s0, s1, ntrain = (int(a) for a in sys.argv[4:7])
cfg = json.load(open(f"{drafter}/dspark.json"))
if cfg["num_hidden_layers"] != 1 or cfg["seq_head"] != "rnn":
    sys.exit("the probe re-implements one-layer drafters with the rnn head only")
W = mx.load(f"{drafter}/model.safetensors")
T = mx.load(f"{model}/model.safetensors")
emb = T["model.embed_tokens.weight"].astype(mx.float32)
if "d2t" not in W:
    sys.exit("the probe needs a drafter with a reduced draft vocabulary (d2t)")
d2t = np.array(W["d2t"]); draft_ids = np.arange(len(d2t)) + d2t
head_rows = emb[mx.array(draft_ids)]
eps = cfg["rms_norm_eps"]; nh, nkv, hd = cfg["num_attention_heads"], cfg["num_key_value_heads"], cfg["head_dim"]
g = cfg["block_size"]; mask_id = cfg["mask_token_id"]; theta = cfg["rope_theta"]
L = "layers.0."

def rope(x, pos):  # x [H, N, hd]
    half = hd // 2
    inv = theta ** (-2.0 * mx.arange(half, dtype=mx.float32) / hd)
    ang = pos.astype(mx.float32)[:, None] * inv[None]
    c, s = mx.cos(ang), mx.sin(ang)
    x1, x2 = x[..., :half], x[..., half:]
    return mx.concatenate([x1 * c - x2 * s, x1 * s + x2 * c], -1)

def heads(x, n, norm=None, pos=None):
    x = x.reshape(x.shape[0], n, hd)
    if norm is not None:
        x = mx.fast.rms_norm(x, norm, eps)
    x = x.transpose(1, 0, 2)
    return rope(x, pos) if pos is not None else x

attention = []  # per anchor with the real context: (mean, max over heads on row p-1, on the block, uniform)


def pos0_pred(taps, ids, anchors, record=False):
    """Argmax target ids the drafter proposes at block position 0 for each anchor."""
    S = taps.shape[0]
    feats = mx.fast.rms_norm(taps @ W["fc.weight"].T, W["hidden_norm.weight"], eps)
    kc = heads(feats @ W[L + "self_attn.k_proj.weight"].T, nkv, W[L + "self_attn.k_norm.weight"], mx.arange(S))
    vc = heads(feats @ W[L + "self_attn.v_proj.weight"].T, nkv)
    out = []
    for p in anchors:
        blk = mx.array([int(ids[p])] + [mask_id] * (g - 1))
        pos = mx.arange(p, p + g)
        h = emb[blk]
        x = mx.fast.rms_norm(h, W[L + "input_layernorm.weight"], eps)
        q = heads(x @ W[L + "self_attn.q_proj.weight"].T, nh, W[L + "self_attn.q_norm.weight"], pos)
        kb = heads(x @ W[L + "self_attn.k_proj.weight"].T, nkv, W[L + "self_attn.k_norm.weight"], pos)
        vb = heads(x @ W[L + "self_attn.v_proj.weight"].T, nkv)
        k = mx.concatenate([kc[:, :p], kb], 1); v = mx.concatenate([vc[:, :p], vb], 1)
        rep = nh // nkv
        k = mx.repeat(k, rep, 0); v = mx.repeat(v, rep, 0)
        sc = (q @ k.transpose(0, 2, 1)) / math.sqrt(hd)
        a = mx.softmax(sc, -1)
        if record:
            row0 = np.array(a[:, 0, :])  # [heads, p + g]: block row 0's attention
            attention.append((row0[:, p - 1].mean(), row0[:, p - 1].max(), row0[:, p:].sum(-1).mean(), 1.0 / (p + g)))
        o = (a @ v).transpose(1, 0, 2).reshape(g, nh * hd)
        h = h + o @ W[L + "self_attn.o_proj.weight"].T
        x = mx.fast.rms_norm(h, W[L + "post_attention_layernorm.weight"], eps)
        gt = x @ W[L + "mlp.gate_proj.weight"].T; up = x @ W[L + "mlp.up_proj.weight"].T
        h = h + (gt * mx.sigmoid(gt) * up) @ W[L + "mlp.down_proj.weight"].T
        hid = mx.fast.rms_norm(h, W["norm.weight"], eps)[0]
        z = hid @ head_rows.T
        e = W["markov_head.markov_w1.weight"][int(ids[p])]
        r = e.shape[0]
        s = mx.zeros((r,))
        jz = mx.concatenate([s, e, hid]) @ W["markov_head.joint_proj.weight"].T + W["markov_head.joint_proj.bias"]
        inner = mx.tanh(jz[2 * r:])
        z = z + W["markov_head.markov_w2.weight"][mx.array(draft_ids)] @ inner
        out.append(int(draft_ids[int(mx.argmax(z))]))
    return out

def shard(k):
    d = mx.load(f"{cache}/shard-{k:05d}.safetensors")
    n = len({key.split('.')[0] for key in d})
    return [(np.array(d[f"{i}.ids"]), np.array(d[f"{i}.mask"]).astype(bool), d[f"{i}.taps"].astype(mx.float32), d[f"{i}.last"].astype(mx.float32)) for i in range(n)]

def target_argmax(last):
    return np.array(mx.argmax(last @ emb.T, -1))

# bigram of the target's greedy choice, from training shards
big = defaultdict(Counter)
for k in range(ntrain):
    for ids, m, taps, last in shard(k):
        am = target_argmax(last)
        for p in range(len(ids) - 1):
            if m[p] and m[p + 1]:
                big[ids[p]][am[p]] += 1
rng = np.random.default_rng(0)
stats = Counter(); n = 0
prev_taps = None
for k in range(s0, s1 + 1):
    for ids, m, taps, last in shard(k):
        am = target_argmax(last)
        anchors = [p for p in range(1, len(ids) - 1) if m[p] and m[p + 1]]
        anchors = sorted(rng.choice(anchors, min(12, len(anchors)), replace=False).tolist()) if anchors else []
        if not anchors:
            continue
        real = pos0_pred(taps, ids, anchors, record=True)
        zero = pos0_pred(mx.zeros_like(taps), ids, anchors)
        if prev_taps is not None and prev_taps.shape[0] >= taps.shape[0]:
            other = pos0_pred(prev_taps[:taps.shape[0]], ids, anchors)
        else:
            other = None
        for j, p in enumerate(anchors):
            want = am[p]
            n += 1
            stats["real"] += real[j] == want
            stats["zero"] += zero[j] == want
            if other is not None:
                stats["other_n"] += 1
                stats["other"] += other[j] == want
            b = big.get(ids[p])
            stats["bigram"] += bool(b) and b.most_common(1)[0][0] == want
            stats["agree_real_zero"] += real[j] == zero[j]
        prev_taps = taps
print(json.dumps({"anchors": n, "real": stats["real"] / n, "zeroed_context": stats["zero"] / n,
                  "other_context": stats["other"] / max(stats["other_n"], 1), "bigram_of_target_argmax": stats["bigram"] / n,
                  "real_equals_zeroed": stats["agree_real_zero"] / n,
                  "attention_to_previous_row_mean_head": float(np.mean([x[0] for x in attention])),
                  "attention_to_previous_row_best_head": float(np.mean([x[1] for x in attention])),
                  "attention_to_own_block": float(np.mean([x[2] for x in attention])),
                  "uniform_share": float(np.mean([x[3] for x in attention]))}))
