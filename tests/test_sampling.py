"""Per-row batched sampling (mola/engine/sampling.py)."""

from __future__ import annotations

import mlx.core as mx
import numpy as np

from mola.engine.sampling import make_keys, sample, top_p_mask


def test_greedy_rows_take_the_argmax():
    logits = mx.random.normal((5, 50))
    tokens, logprobs, keys = sample(logits, [0.0] * 5, [1.0] * 5, make_keys([1] * 5))
    assert tokens.tolist() == mx.argmax(logits, axis=-1).tolist()
    assert mx.allclose(mx.logsumexp(logprobs, axis=-1), mx.zeros(5), atol=1e-5).item()


def test_seeded_row_is_independent_of_its_batch():
    """The same seed gives the same draws alone and beside other rows."""
    mx.random.seed(0)
    row = mx.random.normal((1, 100))
    others = mx.random.normal((3, 100))

    def draws(logits, temps, seeds, steps=8):
        keys = make_keys(seeds)
        out = []
        for _ in range(steps):
            tokens, _, keys = sample(logits, temps, [1.0] * len(temps), keys)
            out.append(tokens.tolist())
        return out

    alone = [t[0] for t in draws(row, [0.9], [1234])]
    batch = mx.concatenate([others[:1], row, others[1:]])
    mixed = [t[1] for t in draws(batch, [0.0, 0.9, 1.3, 0.7], [7, 1234, 99, 5])]
    assert alone == mixed
    assert len(set(alone)) > 1  # it does sample


def test_temperature_sampling_follows_the_distribution():
    probs = np.array([0.5, 0.3, 0.15, 0.05])
    logits = mx.array(np.log(probs)[None].repeat(4000, axis=0).astype(np.float32))
    tokens, _, _ = sample(logits, [1.0] * 4000, [1.0] * 4000, make_keys(list(range(4000))))
    freq = np.bincount(np.array(tokens.tolist()), minlength=4) / 4000
    assert np.abs(freq - probs).max() < 0.04


def test_top_p_mask_matches_a_naive_cut():
    rng = np.random.default_rng(0)
    logits = rng.normal(size=(6, 30)).astype(np.float32)
    top_p = np.array([0.1, 0.5, 0.9, 1.0, 0.3, 0.75], dtype=np.float32)
    logprobs = logits - np.log(np.exp(logits).sum(-1, keepdims=True))
    mask = np.array(top_p_mask(mx.array(logprobs), mx.array(top_p)[:, None]))
    for i in range(6):
        order = np.argsort(-logprobs[i])
        p = np.exp(logprobs[i][order])
        keep = np.zeros(30, bool)
        mass = 0.0
        for j, tok in enumerate(order):
            if mass < top_p[i] or j == 0:
                keep[tok] = True
            mass += p[j]
        assert (mask[i] == keep).all(), i


def test_top_p_restricts_draws():
    logits = mx.array(np.log(np.array([[0.6, 0.3, 0.06, 0.04]] * 500, dtype=np.float32)))
    tokens, _, _ = sample(logits, [1.0] * 500, [0.7] * 500, make_keys(list(range(500))))
    assert set(tokens.tolist()) <= {0, 1} and set(tokens.tolist()) == {0, 1}
