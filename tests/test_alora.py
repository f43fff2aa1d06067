"""Activated LoRA in the engine's batch (issue 37, first part: the LoRA
layer's per-position delta; Sequence.adapter_start): a row's adapter applies
from its invocation's position on, the base alone before it. Checked against
a naive per-position loop over plain mlx-lm: one KV cache fed token by token,
by the base model before the start and by the adapter merged into the base
from it; alone and in one batch with plain LoRA rows and base rows, over
prefill chunks that cut across the starts."""

from __future__ import annotations

import random

import mlx.core as mx
import pytest
from mlx_lm.models.cache import make_prompt_cache

from helpers import EngineRunner, merged_model, together

MAX_TOKENS = 12


def activated_reference(base, merged, prompt: list[int], start: int) -> list[int]:
    """Greedy: position p of the prompt fed alone, to ``merged`` if p >= start
    else to ``base``, into one cache; then the answer, all merged."""
    cache = make_prompt_cache(base)
    for p, token in enumerate(prompt[:-1]):
        (merged if p >= start else base)(mx.array([[token]]), cache=cache)
    token, out = prompt[-1], []
    for _ in range(MAX_TOKENS):
        logits = (merged if len(prompt) - 1 + len(out) >= start else base)(mx.array([[token]]), cache=cache)
        token = int(mx.argmax(logits[0, -1]).item())
        out.append(token)
    return out


@pytest.fixture(scope="module")
def models(tiny_model, adapters):
    return merged_model(tiny_model)[0], merged_model(tiny_model, [adapters["a"]])[0]


def test_activated_rows_match_a_per_position_loop_in_a_mixed_batch(tiny_model, adapters, models):
    base, merged = models
    rng = random.Random(5)
    prompts = [[rng.randrange(3, 500) for _ in range(n)] for n in (40, 23, 57, 31)]
    starts = [(0, 0), (0, 9), (1, 22), (2, 30), (3, 30)]  # (prompt, start): from the first token to the last
    r = EngineRunner(tiny_model, adapters=list(adapters.items()), max_tokens=MAX_TOKENS, prefill_step_size=16)
    try:
        alone = r.run(prompts[0], "a", adapter_start=9)
        seqs = together(r, lambda: [
            *(r.submit(prompts[i], "a", adapter_start=s) for i, s in starts),
            r.submit(prompts[0], "b"), r.submit(prompts[1]), r.submit(prompts[2], "a")])
        outputs = r.wait(seqs)
    finally:
        r.stop()
    references = [activated_reference(base, merged, prompts[i], s) for i, s in starts]
    assert alone == references[1]
    assert outputs[: len(starts)] == references
    # the plain rows beside them are what plain LoRA and the base give
    b = merged_model(tiny_model, [adapters["b"]])[0]
    assert outputs[len(starts)] == activated_reference(b, b, prompts[0], 0)
    assert outputs[len(starts) + 1] == activated_reference(base, base, prompts[1], 0)
    assert outputs[len(starts) + 2] == activated_reference(base, merged, prompts[2], 0)
    # and the start matters: from 0 it is plain LoRA, later it is neither that nor the base
    assert references[0] == activated_reference(merged, merged, prompts[0], 0)
    assert references[1] not in (references[0], activated_reference(base, base, prompts[0], 0))
