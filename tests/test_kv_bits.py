"""A quantized KV cache (--kv-bits; mola/engine/quantized_cache.py): the
engine's answers equal a step-by-step decode of plain mlx-lm with mlx-lm's
own QuantizedKVCache, alone and in a batch of prompts of several lengths;
the budget counts the quantized bytes; and preemption through the prompt
cache changes no answer."""

from __future__ import annotations

import random

import mlx.core as mx
import numpy as np
import pytest
from mlx_lm.models.cache import KVCache, QuantizedKVCache

from helpers.engines import EngineRunner, together

from mola.models.loader import load_base_model
from mola.testing.model import TinyModelSpec, make_tiny_model

MAX_TOKENS = 24
GROUP = 64


@pytest.fixture(scope="module")
def wide_heads(tmp_path_factory):
    """A tiny model whose heads are 64 wide, so that groups of 64 quantize them."""
    return make_tiny_model(tmp_path_factory.mktemp("models") / "tiny-h64",
                           TinyModelSpec(hidden_size=128, num_attention_heads=2, num_key_value_heads=1))


def prompts() -> list[list[int]]:
    rng = random.Random(3)
    return [[rng.randrange(3, 500) for _ in range(n)] for n in (5, 40, 17, 64, 9, 33)]


def quantized_reference(model, prompt: list[int], bits: int | None) -> tuple[list[int], list[float]]:
    """Greedy, as mola's engine feeds a row: the prompt but its last token at
    once, then one token a step, over mlx-lm's QuantizedKVCache (bits None: its
    KVCache); the tokens and their log-probabilities."""
    cache = [QuantizedKVCache(group_size=GROUP, bits=bits) if bits else KVCache() for _ in model.layers]
    model(mx.array([prompt[:-1]]), cache=cache)
    token, tokens, lps = prompt[-1], [], []
    for _ in range(MAX_TOKENS):
        logits = model(mx.array([[token]]), cache=cache)[0, -1].astype(mx.float32)
        logp = np.array(logits - mx.logsumexp(logits))
        token = int(np.argmax(logp))
        tokens.append(token)
        lps.append(float(logp[token]))
    return tokens, lps


@pytest.mark.parametrize("bits", [8, 4])
def test_answers_equal_mlx_lm_with_its_quantized_cache(wide_heads, bits):
    model = load_base_model(str(wide_heads)).model
    references = [quantized_reference(model, p, bits) for p in prompts()]
    r = EngineRunner(wide_heads, max_tokens=MAX_TOKENS, kv_bits=bits, kv_cache_bytes=0)
    try:
        alone = [r.run(p, logprobs=0) for p in prompts()[:2]]
        seqs = together(r, lambda: [r.submit(p, logprobs=0) for p in prompts()])  # one batch, left-padded
        batched = r.wait(seqs)
        logprobs = [[lp for lp, _ in r.logprobs[s.seq_id]] for s in seqs]
        per_token = r.engine.call(lambda: r.engine.runner.kv_position_bytes).result(timeout=30)
    finally:
        r.stop()
    assert alone == [t for t, _ in references[:2]]
    assert batched == [t for t, _ in references]
    for mine, (_, theirs) in zip(logprobs, references):
        np.testing.assert_allclose(mine, theirs, rtol=0, atol=1e-5)
    # and the quantization is there to see: a float cache gives other log-probabilities
    unquantized = [quantized_reference(model, p, None)[1] for p in prompts()]
    assert max(abs(a - b) for x, y in zip(unquantized, (lp for _, lp in references)) for a, b in zip(x, y)) > 1e-3
    # 2 layers, keys and values, 1 KV head of 64: packed words and a float32 scale and bias a group
    assert per_token == 2 * 2 * (64 * bits // 8 + 2 * 4 * 64 // GROUP)


def test_preemption_over_a_quantized_cache_changes_no_answer(wide_heads):
    from mola.engine.kv_budget import peak

    def run(**config):
        r = EngineRunner(wide_heads, max_tokens=MAX_TOKENS, kv_bits=8, **config)
        try:
            seqs = together(r, lambda: [r.submit(p, temperature=0.9, seed=i) for i, p in enumerate(prompts())])
            return r.wait(seqs), r.engine.snapshot.kv, r.engine.call(
                lambda: r.engine.runner.kv_position_bytes).result(timeout=30)
        finally:
            r.stop()

    free, _, per_token = run(kv_cache_bytes=0)
    # room for three rows at their prompt, not for three at their longest
    budget = (peak([(64, 18)] * 3) + peak([(64 + MAX_TOKENS, 1)] * 3)) // 2 * per_token
    bounded, kv, _ = run(kv_cache_bytes=budget)
    assert kv.preemptions >= 1
    assert bounded == free


def test_a_group_size_the_heads_cannot_take_is_refused_at_start(tiny_model):
    from mola.errors import ModelLoadError

    with pytest.raises(ModelLoadError, match="--kv-bits 8 --kv-group-size 64"):
        EngineRunner(tiny_model, kv_bits=8)  # heads of 16
