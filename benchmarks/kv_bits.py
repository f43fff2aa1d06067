"""What --kv-bits costs in fidelity and saves in memory, on the real model.

    python benchmarks/kv_bits.py [--prompts 8] [--tokens 64]

SmolLM2-135M-Instruct (the Q4_1 GGUF, dequantized to float32 as `--dtype auto`
serves it on a CPU; heads of 64, so groups of 64 quantize them). For each of
--prompts chat prompts, the float cache's greedy answer of --tokens tokens is
fed again, token by token, with mlx-lm's QuantizedKVCache at 8 and 4 bits:
teacher-forced, so every position compares like with like. Reported per
setting: KV bytes a token, the share of positions whose top token is the
float cache's, the mean and largest |difference| of the answer tokens'
log-probabilities, and how many of the free-running greedy answers are the
same as the float cache's to the end. Writes benchmarks/results/kv_bits.json.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import mlx.core as mx
import numpy as np
from mlx_lm.models.cache import KVCache, QuantizedKVCache

HERE = Path(__file__).resolve().parent


def caches(model, bits):
    return [KVCache() if bits is None else QuantizedKVCache(group_size=64, bits=bits) for _ in model.layers]


def logprobs_along(model, prompt: list[int], answer: list[int], bits) -> np.ndarray:
    """[len(answer), V] log-probabilities before each answer token, fed the answer."""
    cache = caches(model, bits)
    model(mx.array([prompt[:-1]]), cache=cache)
    rows, token = [], prompt[-1]
    for nxt in answer:
        logits = model(mx.array([[token]]), cache=cache)[0, -1].astype(mx.float32)
        rows.append(np.array(logits - mx.logsumexp(logits)))
        token = nxt
    return np.stack(rows)


def greedy(model, prompt: list[int], n: int, bits) -> list[int]:
    cache = caches(model, bits)
    model(mx.array([prompt[:-1]]), cache=cache)
    token, out = prompt[-1], []
    for _ in range(n):
        token = int(mx.argmax(model(mx.array([[token]]), cache=cache)[0, -1]).item())
        out.append(token)
    return out


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--prompts", type=int, default=8)
    p.add_argument("--tokens", type=int, default=64)
    a = p.parse_args()
    from mola.demo.questions import questions
    from mola.engine.kv_store import kv_bytes_per_token, measured_caches
    from mola.lora.pack import AdapterPacks
    from mola.models.fetch import ensure_smollm
    from mola.models.loader import load_base_model

    loaded = load_base_model(str(ensure_smollm()))
    model, tok = loaded.model, loaded.tokenizer
    routing = AdapterPacks.install(model, max_loras=1, max_rank=8).routing
    prompts = [tok.apply_chat_template([{"role": "user", "content": q}], add_generation_prompt=True)
               for q in questions(held_out=True)[: a.prompts]]
    answers = [greedy(model, pr, a.tokens, None) for pr in prompts]
    floats = [logprobs_along(model, pr, ans, None) for pr, ans in zip(prompts, answers)]
    result = {"model": "SmolLM2-135M-Instruct (float32)", "prompts": len(prompts), "tokens": a.tokens,
              "float": {"kv_bytes_per_token": kv_bytes_per_token(measured_caches(model, routing))}}
    for bits in (8, 4):
        top, diffs, same = 0, [], 0
        for pr, ans, ref in zip(prompts, answers, floats):
            lp = logprobs_along(model, pr, ans, bits)
            top += int((lp.argmax(-1) == ref.argmax(-1)).sum())
            diffs += [abs(lp[i, t] - ref[i, t]) for i, t in enumerate(ans)]
            same += greedy(model, pr, a.tokens, bits) == ans
        result[f"{bits}-bit"] = {
            "kv_bytes_per_token": kv_bytes_per_token(measured_caches(model, routing, quant=(bits, 64))),
            "top1_agreement": round(top / (len(prompts) * a.tokens), 4),
            "mean_abs_logprob_diff": round(float(np.mean(diffs)), 4),
            "max_abs_logprob_diff": round(float(np.max(diffs)), 4),
            "greedy_answers_identical": f"{same}/{len(prompts)}"}
    print(json.dumps(result, indent=1))
    (HERE / "results" / "kv_bits.json").write_text(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
