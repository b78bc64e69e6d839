"""How well a small network predicts the target's greedy token after the anchor (DSpark block
position 0) when the previous context row's tapped features are handed to it directly
(EAGLE-style input: [fc(taps[p-1]); embed(x_p)] through one SwiGLU MLP to the frozen tied head
over a drafter's reduced vocabulary) instead of found by attention; with `zero`, the same
network with the features zeroed (what the anchor token alone predicts). Trained on position 0
only (cross-entropy on the target's greedy token, lr 1e-3, 256 rows a step) for SECONDS, then
reports top-1 agreement with the target on held-out shards. An independent MLX Python model,
not mlxb's drafter.

    .venv/bin/python scripts/dspark_direct_probe.py CACHE MODEL_DIR DRAFTER N_TRAIN FIRST LAST SECONDS [zero]

CACHE: a `train-dspark` target cache (shards 0..N_TRAIN-1 train, FIRST..LAST are held out);
MODEL_DIR: the f32 target (its tied embedding is the head); DRAFTER: a checkpoint with `d2t`
(its draft vocabulary)."""
import json, sys, time
import mlx.core as mx, mlx.nn as nn, mlx.optimizers as optim
import numpy as np

cache, model, drafter = sys.argv[1:4]
ntrain, e0, e1, seconds = (int(a) for a in sys.argv[4:8])
zero = len(sys.argv) > 8 and sys.argv[8] == "zero"
mx.random.seed(0)
T = mx.load(f"{model}/model.safetensors")
emb = T["model.embed_tokens.weight"].astype(mx.float32)
W = mx.load(f"{drafter}/model.safetensors")
d2t = np.array(W["d2t"]); draft_ids = np.arange(len(d2t)) + d2t
t2d = {int(t): i for i, t in enumerate(draft_ids)}
head_rows = emb[mx.array(draft_ids)]
D = emb.shape[1]


def rows(shards):
    X, E, Y = [], [], []
    for k in shards:
        d = mx.load(f"{cache}/shard-{k:05d}.safetensors")
        n = len({key.split('.')[0] for key in d})
        for i in range(n):
            ids = np.array(d[f"{i}.ids"]); m = np.array(d[f"{i}.mask"]).astype(bool)
            taps = d[f"{i}.taps"].astype(mx.float32); last = d[f"{i}.last"].astype(mx.float32)
            am = np.array(mx.argmax(last @ emb.T, -1))
            ps = [p for p in range(1, len(ids) - 1) if m[p] and m[p + 1]]
            if not ps:
                continue
            X.append(taps[mx.array([p - 1 for p in ps])])
            E.append(mx.array(ids[ps]))
            Y.append(np.array([t2d.get(int(am[p]), -1) for p in ps]))
    return mx.concatenate(X), mx.concatenate(E), np.concatenate(Y)


class Probe(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(5 * D, D, bias=False)
        self.fnorm = nn.RMSNorm(D)
        self.inp = nn.Linear(2 * D, D, bias=False)
        self.n1 = nn.RMSNorm(D)
        self.gate = nn.Linear(D, 1536, bias=False)
        self.up = nn.Linear(D, 1536, bias=False)
        self.down = nn.Linear(1536, D, bias=False)
        self.n2 = nn.RMSNorm(D)

    def __call__(self, taps, tok):
        f = self.fnorm(self.fc(taps))
        h = self.inp(mx.concatenate([f, emb[tok]], -1))
        x = self.n1(h)
        h = h + self.down(nn.silu(self.gate(x)) * self.up(x))
        return self.n2(h) @ head_rows.T


t0 = time.time()
Xtr, Etr, Ytr = rows(range(ntrain))
Xev, Eev, Yev = rows(range(e0, e1 + 1))
# per-feature RMS scaling of the taps (the tapped layers differ a thousandfold in scale)
scale = mx.sqrt(mx.mean(Xtr * Xtr, 0) + 1e-6)
Xtr = Xtr / scale; Xev = Xev / scale
if zero:
    Xtr = mx.zeros_like(Xtr); Xev = mx.zeros_like(Xev)
keep = Ytr >= 0
Xtr, Etr, Ytr = Xtr[mx.array(np.nonzero(keep)[0])], Etr[mx.array(np.nonzero(keep)[0])], mx.array(Ytr[keep])
print(f"rows train {Xtr.shape[0]} eval {Xev.shape[0]} load {time.time()-t0:.0f}s", flush=True)
net = Probe(); mx.eval(net.parameters())
opt = optim.AdamW(learning_rate=1e-3, weight_decay=0.0)
loss_fn = lambda net, x, e, y: nn.losses.cross_entropy(net(x, e), y).mean()
step = nn.value_and_grad(net, loss_fn)


def evaluate():
    pred = []
    for i in range(0, Xev.shape[0], 1024):
        pred.append(np.array(mx.argmax(net(Xev[i:i + 1024], Eev[i:i + 1024]), -1)))
    return float(np.mean(np.concatenate(pred) == Yev))


rng = np.random.default_rng(0)
n = Xtr.shape[0]; it = 0; start = time.time(); losses = []
while time.time() - start < seconds:
    idx = mx.array(rng.integers(0, n, 256))
    loss, g = step(net, Xtr[idx], Etr[idx], Ytr[idx])
    opt.update(net, g); mx.eval(net.parameters(), opt.state, loss)
    losses.append(float(loss)); it += 1
    if it % 500 == 0:
        print(f"step {it} loss {np.mean(losses[-500:]):.3f} eval acc {evaluate():.3f} t {time.time()-start:.0f}s", flush=True)
print(json.dumps({"steps": it, "eval_acc": evaluate(), "zero": zero}))
