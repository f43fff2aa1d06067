"""Run under `mlx.launch --backend ring -n N`: how much of a sharded decode
step is the collective. Loads the model's tensor-parallel shard, times decode
steps at batch B, then times the all-sums one step makes on their own (two
per block: after o_proj and down_proj, each [B, 1, hidden]). Rank 0 prints
one JSON line.

    mlx.launch --backend ring -n 2 python benchmarks/_collective.py MODEL BATCH
"""

from __future__ import annotations

import json
import sys
import time

import mlx.core as mx
from mlx_lm.models.cache import make_prompt_cache
from mlx_lm.utils import sharded_load


def main() -> int:
    model_dir, batch = sys.argv[1], int(sys.argv[2])
    group = mx.distributed.init()
    model, _, config = sharded_load(model_dir, tensor_group=group, return_config=True,
                                    tokenizer_config={"trust_remote_code": False})
    caches = [make_prompt_cache(model) for _ in range(batch)]
    cache = [layer[0].merge(list(layer)) for layer in zip(*caches)]
    tokens = mx.array([[5]] * batch, dtype=mx.uint32)
    model(mx.array([[5] * 32] * batch, dtype=mx.uint32), cache=cache)  # some context
    mx.eval([c.state for c in cache])
    steps = 30
    for _ in range(5):
        mx.eval(model(tokens, cache=cache))
    t0 = time.perf_counter()
    for _ in range(steps):
        mx.eval(model(tokens, cache=cache))
    step = (time.perf_counter() - t0) / steps
    hidden = config["hidden_size"]
    n = 2 * config["num_hidden_layers"]
    x = mx.ones((batch, 1, hidden))
    mx.eval(x)
    for _ in range(5):
        mx.eval(mx.distributed.all_sum(x, group=group))
    t0 = time.perf_counter()
    for _ in range(steps):
        for _ in range(n):
            y = mx.distributed.all_sum(x, group=group)
            mx.eval(y)
    collective = (time.perf_counter() - t0) / steps
    if group.rank() == 0:
        print(json.dumps({"ranks": group.size(), "batch": batch, "step_ms": step * 1e3,
                          "collective_ms": collective * 1e3, "all_sums_per_step": n,
                          "collective_share": collective / step}), flush=True)
    mx.clear_streams()
    return 0


if __name__ == "__main__":
    sys.exit(main())
