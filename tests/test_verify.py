"""Speculative decoding's device half (mola/engine/verify.py), each piece
against a reference computed another way: the KV rewind against plain
mlx-lm fed only the accepted tokens, acceptance and counts against naive
loops, per-position sampling against as many plain sampling steps."""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest
from mlx_lm import load
from mlx_lm.models.cache import make_prompt_cache

from mola.engine import verify
from mola.engine.caches import merge_caches
from mola.engine.sampling import make_keys, sample
from mola.engine.sequence import SamplingParams, Sequence


@pytest.fixture(scope="module")
def model(tiny_model):
    m, _ = load(str(tiny_model))
    return m


def single_logits(model, tokens: list[int]) -> np.ndarray:
    """Plain mlx-lm, one sequence: the logits after ``tokens`` [V]."""
    cache = make_prompt_cache(model)
    return np.array(model(mx.array([tokens]), cache=cache)[0, -1])


def test_rewind_leaves_each_row_as_if_only_its_accepted_tokens_were_fed(model):
    """Rows of different lengths are fed five positions; each keeps its own
    number of them (one row keeps all, one none), then decodes on: its next
    logits equal plain mlx-lm's on the prompt and the kept tokens alone."""
    rng = np.random.default_rng(0)
    prompts = [rng.integers(1, 500, n).tolist() for n in (7, 3, 12, 5)]
    fed = rng.integers(1, 500, (4, 5)).tolist()
    kept = [1, 5, 3, 0]  # of the five: the input and the accepted drafts
    caches = []
    for p in prompts:  # each prompt but its last token, as prefill leaves it
        c = make_prompt_cache(model)
        model(mx.array([p[:-1]]), cache=c)
        caches.append(c)
    batch = merge_caches(caches)
    inputs = mx.array([[p[-1]] + f[:4] for p, f in zip(prompts, fed)], dtype=mx.uint32)  # [B, 5]
    model(inputs, cache=batch)
    verify.rewind(batch, [5 - k for k in kept])
    nxt = rng.integers(1, 500, 4).tolist()
    logits = np.array(model(mx.array(nxt, dtype=mx.uint32)[:, None], cache=batch)[:, -1])
    for i, (p, row, k) in enumerate(zip(prompts, inputs.tolist(), kept)):
        tokens = p[:-1] + row[:k] + [nxt[i]] if k else p[:-1] + [nxt[i]]
        np.testing.assert_allclose(logits[i], single_logits(model, tokens), atol=2e-4, rtol=1e-4)
    assert batch[0].offset.tolist() == [len(p) - 1 + k + 1 for p, k in zip(prompts, kept)]


def test_rewind_trims_what_every_row_rejected_without_rolling(model):
    c = make_prompt_cache(model)
    model(mx.array([[1, 2, 3]]), cache=c)
    batch = merge_caches([c, c])
    model(mx.array([[4, 5, 6], [4, 5, 6]], dtype=mx.uint32), cache=batch)
    verify.rewind(batch, [2, 2])
    assert batch[0].left_padding.tolist() == [0, 0] and batch[0].size() == 4


def test_accepted_lengths_match_a_naive_loop():
    rng = np.random.default_rng(1)
    for _ in range(20):
        B, D = rng.integers(1, 6), rng.integers(1, 6)
        drafts = rng.integers(0, 3, (B, D))
        tokens = rng.integers(0, 3, (B, D + 1))
        num_draft = rng.integers(0, D + 1, B).tolist()
        got = verify.accepted_lengths(mx.array(tokens), mx.array(drafts), num_draft).tolist()
        for i in range(B):
            n = 0
            while n < num_draft[i] and tokens[i, n] == drafts[i, n]:
                n += 1
            assert got[i] == n


def test_a_row_produces_its_accepted_drafts_then_the_token_after_them():
    tokens = mx.array([[1, 2, 3], [4, 5, 6], [7, 8, 9]], dtype=mx.uint32)
    drafts = mx.array([[1, 9], [4, 5], [0, 0]], dtype=mx.uint32)
    accepted = mx.array([1, 2, 0])
    got = verify.produced_tokens(tokens, drafts, accepted).tolist()
    assert [row[: a + 1] for row, a in zip(got, accepted.tolist())] == [[1, 2], [4, 5, 6], [7]]


def test_position_counts_and_produced_counts_match_naive_ones():
    rng = np.random.default_rng(2)
    B, D, V = 3, 4, 7
    counts = rng.integers(0, 3, (B, V)).astype(np.float32)
    drafts = rng.integers(0, V, (B, D))
    got = np.array(verify.position_counts(mx.array(counts), mx.array(drafts, dtype=mx.uint32)))
    for i in range(B):
        for j in range(D + 1):
            want = counts[i].copy()
            for t in drafts[i, :j]:
                want[t] += 1
            np.testing.assert_array_equal(got[i * (D + 1) + j], want)
    tokens = rng.integers(0, V, (B, D + 1))
    tokens[0, :3] = 5  # one token produced several times
    accepted = [2, 0, 4]
    got = np.array(verify.count_produced(mx.array(counts), mx.array(tokens, dtype=mx.uint32),
                                         mx.array(accepted)))
    for i in range(B):
        want = counts[i].copy()
        for t in tokens[i, : accepted[i] + 1]:
            want[t] += 1
        np.testing.assert_array_equal(got[i], want)


def rows(temps, top_p=1.0):
    return [Sequence(prompt=[1], params=SamplingParams(max_tokens=8, temperature=t, top_p=top_p))
            for t in temps]


@pytest.mark.parametrize("top_p", [1.0, 0.8])
def test_each_position_is_drawn_as_that_many_plain_steps_draw(top_p):
    """Position j of a row is sampled with the key the j-th of several
    plain steps would use; the row's key then moves on by one split per
    token it produced."""
    mx.random.seed(3)
    temps = [0.0, 0.8, 1.3]
    B, P, V = len(temps), 4, 40
    logits = mx.random.normal((B, P, V)) * 2
    keys = make_keys([11, 22, 33])
    tokens, chain = verify.sample_positions(logits.reshape(B * P, V), rows(temps, top_p), keys, P)
    plain, k, after = [], keys, [keys]
    for j in range(P):
        t, _, k = sample(logits[:, j], temps, [top_p] * B, k)
        plain.append(t.tolist())
        after.append(k)
    assert tokens.tolist() == np.array(plain).T.tolist()
    accepted = mx.array([0, 3, 1])
    # the accepted drafts are the tokens sampled there (as produced_tokens makes them)
    inputs, next_keys = verify.next_state(tokens, accepted, chain, keys)
    assert inputs.tolist() == [plain[a][i] for i, a in enumerate(accepted.tolist())]
    want = mx.stack([after[a + 1][i] for i, a in enumerate(accepted.tolist())])
    assert next_keys.tolist() == want.tolist()


def test_a_draft_model_drafts_its_own_greedy_continuation(model):
    from helpers.references import greedy_tokens

    prompts = [[5, 9, 13, 2], [100, 3]]
    caches = []
    for p in prompts:
        c = make_prompt_cache(model)
        model(mx.array([p[:-1]]), cache=c)
        caches.append(c)
    batch = merge_caches(caches)
    inputs = mx.array([p[-1] for p in prompts], dtype=mx.uint32)
    drafts = verify.draft_with_model(model, batch, inputs, 5, 512).tolist()
    for p, d in zip(prompts, drafts):
        assert d == greedy_tokens(model, p, 5)
    assert batch[0].offset.tolist() == [len(p) - 1 + 6 for p in prompts]  # input and five drafts
