"""mlx-lm's tensor-parallel generation, the oracle of `mlxb launch`: run under
`mlx.launch -n N --backend ring`, every rank loads its shard with mlx-lm's `sharded_load` and
runs `generate_step` (greedy); rank 0 prints {"token_ids": [...], "token_logprobs": [...]}, each
logprob the sampled token's, as f32.

With --pipeline, mlx-lm's pipeline split (`sharded_load(pipeline_group=...)`): whole layers
per rank.

usage: mlx.launch -n 2 --backend ring -- python sharded_generate.py MODEL_DIR '[prompt ids]' MAX_TOKENS [--pipeline]
"""
import json
import sys

import mlx.core as mx
from mlx_lm.generate import generate_step
from mlx_lm.utils import sharded_load

model_dir, prompt, max_tokens = sys.argv[1], json.loads(sys.argv[2]), int(sys.argv[3])
group = mx.distributed.init()
if "--pipeline" in sys.argv[4:]:
    model, _ = sharded_load(model_dir, pipeline_group=group)
else:
    model, _ = sharded_load(model_dir)
ids, logprobs = [], []
for token, lp in generate_step(mx.array(prompt), model, max_tokens=max_tokens):
    ids.append(int(token))
    logprobs.append(float(lp[int(token)].astype(mx.float32).item()))
if group.rank() == 0:
    print(json.dumps({"token_ids": ids, "token_logprobs": logprobs}))
