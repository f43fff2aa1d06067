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


# ---- alone and in a batch ----------------------------------------------------------

def test_the_quantized_cache_gives_a_row_the_same_attention_alone_and_in_a_batch():
    """The cache itself is batch-invariant: its groups run along one position's
    head dimension, so left padding and the other rows never enter a row's
    groups. Fixed keys, values and queries (no matmul upstream): a row's
    attention at prefill and at a decode step is bit-identical alone and
    left-padded among rows of other lengths."""
    from mlx_lm.models.base import quantized_scaled_dot_product_attention as attend

    from mola.engine.quantized_cache import BatchQuantizedKVCache

    H, D, bits = 2, 64, 8
    lengths = [5, 40, 17]
    mx.random.seed(0)
    kv = [[mx.random.normal((1, H, n + 1, D)) for _ in range(2)] for n in lengths]  # + 1: the decode step
    queries = [mx.random.normal((1, 2 * H, n + 1, D)) for n in lengths]  # grouped-query: 2 heads a KV head

    def run(cache, keys, values, q):
        mask = cache.make_mask(q.shape[2]) if q.shape[2] > 1 or cache.left_padding.any() else None
        k, v = cache.update_and_fetch(keys, values)
        return attend(q, k, v, scale=D**-0.5, mask=mask, group_size=GROUP, bits=bits)

    alone = []
    for (k, v), q in zip(kv, queries):
        cache = BatchQuantizedKVCache([0], GROUP, bits)
        prefill = run(cache, k[:, :, :-1], v[:, :, :-1], q[:, :, :-1])
        alone.append((prefill, run(cache, k[:, :, -1:], v[:, :, -1:], q[:, :, -1:])))
    longest = max(lengths)
    padding = [longest - n for n in lengths]

    def left_padded(arrays, cut):
        return mx.concatenate([mx.pad(a[:, :, :cut], [(0, 0), (0, 0), (p, 0), (0, 0)]) for a, p in
                               zip(arrays, padding)])

    cache = BatchQuantizedKVCache(padding, GROUP, bits)
    prefill = run(cache, left_padded([k for k, _ in kv], -1), left_padded([v for _, v in kv], -1),
                  left_padded(queries, -1))
    decode = run(cache, mx.concatenate([k[:, :, -1:] for k, _ in kv]), mx.concatenate([v[:, :, -1:] for _, v in kv]),
                 mx.concatenate([q[:, :, -1:] for q in queries]))
    for i, (p, (own_prefill, own_decode)) in enumerate(zip(padding, alone)):
        assert mx.array_equal(prefill[i : i + 1, :, p:], own_prefill).item(), f"row {i} at prefill"
        assert mx.array_equal(decode[i : i + 1], own_decode).item(), f"row {i} at its decode step"


def test_a_row_alone_and_in_a_batch_of_16(wide_heads):
    """A row's log-probabilities alone and among 15 others that join the batch
    one by one (left padding, rows kept and appended): bit-identical on MLX's
    reference BLAS, whose products do not depend on the batch's shape. OpenBLAS
    picks its kernels by shape, and a last-bit difference in a key or value can
    flip its 8-bit rounding: there the answers agree within the bound that
    docs/operations.md and /v1/models ("kv_cache") state."""
    from mola import blas

    rng = random.Random(5)
    rows = [[rng.randrange(3, 500) for _ in range(rng.randrange(3, 70))] for _ in range(16)]
    r = EngineRunner(wide_heads, max_tokens=MAX_TOKENS, kv_bits=8, kv_cache_bytes=0, prompt_cache_bytes=0)
    try:
        alone = []
        for p in rows[:4]:
            s = r.submit(p, logprobs=0)
            r.wait([s])
            alone.append([lp for lp, _ in r.logprobs[s.seq_id]])
        seqs = []
        for p in rows:
            seqs.append(r.submit(p, logprobs=0))
            r.wait_decoding(seqs[-1:])
        r.wait(seqs)
        batched = [[lp for lp, _ in r.logprobs[s.seq_id]] for s in seqs[:4]]
    finally:
        r.stop()
    if blas.blas_in_use() == "reference":
        assert batched == alone
    else:
        np.testing.assert_allclose(batched, alone, rtol=0, atol=5e-3)


def test_models_states_whether_a_quantized_cache_is_batch_invariant(wide_heads):
    """The model card's words, in process: the card reads the config, no model runs."""
    from helpers.scripted import InProcessServer, tokenizer_model
    from mola import blas

    handle = InProcessServer(tokenizer_model(wide_heads), served_model_name="wide", kv_bits=8)
    try:
        with handle.client(timeout=60) as c:
            card = c.get("/v1/models/wide").json()
    finally:
        handle.stop()
    assert card["kv_cache"] == {"bits": 8, "group_size": GROUP,
                                "batch_invariant": blas.blas_in_use() == "reference"}, card
