"""mlx-lm's in-process batch_generate on the benchmark's prompts: the engine's
ceiling with no server around it. Run by benchmarks/serve.py in a process of
its own; prints one JSON line.

    python benchmarks/_batch_generate.py MODEL NUM_REQUESTS CONCURRENCY MAX_TOKENS
"""

from __future__ import annotations

import json
import sys
import time

import mlx.core as mx
from mlx_lm import batch_generate, load
from mlx_lm.sample_utils import make_logits_processors

sys.path.insert(0, __file__.rsplit("/", 1)[0])
from loadgen import prompt_for  # noqa: E402


def main() -> int:
    model_dir, n, conc, max_tokens = sys.argv[1], *map(int, sys.argv[2:5])
    model, tok = load(model_dir)
    eos = sorted(tok.eos_token_ids)
    prompts = [tok.apply_chat_template([{"role": "user", "content": prompt_for(i)}],
                                       add_generation_prompt=True) for i in range(n)]
    ban_eos = make_logits_processors(logit_bias={e: -100.0 for e in eos})
    kwargs = dict(max_tokens=max_tokens, completion_batch_size=conc, prefill_batch_size=min(conc, 8),
                  logits_processors=ban_eos, return_token_ids=True)
    batch_generate(model, tok, prompts[: min(n, conc)], **{**kwargs, "max_tokens": 4})  # warm up
    t0 = time.perf_counter()
    r = batch_generate(model, tok, prompts, **kwargs)
    wall = time.perf_counter() - t0
    tokens = sum(len(t) for t in r.token_ids)
    print(json.dumps({"tok_s": tokens / wall, "tokens": tokens, "wall_s": wall,
                      "generation_tps": r.stats.generation_tps, "prompt_tps": r.stats.prompt_tps}))
    mx.clear_streams()
    return 0


if __name__ == "__main__":
    sys.exit(main())
